/*
 * tools/bench chaos: kill -9 at random moments, recover, compare with an undisturbed run.
 *
 *   bench_chaos [--rows N] [--seed S] [--dir DIR] [--quick] [--check] [--sync] [--only
 * worker|ps|replica]
 *
 * Training (mlp on `ember gen` data, 2 PS x 2 workers over ipc://, asynchronous):
 *   clean  the same job with no kills;
 *   chaos  (1) kill worker 0, restart it with --rejoin (the others go on);
 *          (2) kill a PS that has no backup: the workers fail (--ps-timeout), the harness stops
 *              the rest and restarts the whole job with --resume from ckpt/LATEST, this time
 *              with a backup for every shard;
 *          (3) kill the primary of a replicated shard: the workers fail over, nothing restarts.
 *   Each kill comes when the workers' progress notes pass a random fraction of the schedule
 *   (seeded). A kill counts as recovered when the job then goes on to finish.
 * Ledger (lost acknowledged updates): `ember ps` primary + backup processes, one SGD table
 * with lr 1; a client pushes gradients of 1 to every key and counts the pushes acknowledged;
 * the primary is killed with pushes in flight; in the end every row must read exactly minus
 * the acknowledged count: anything less is an acknowledged update lost, more one applied
 * twice.
 *
 * Also: the clean job run twice (two asynchronous workers never apply updates in quite the same
 * order, so the two runs' AUCs differ: that spread is the noise floor, and the reference is
 * their mean), and one worker with a replicated primary killed, which is deterministic and
 * must end with exactly the clean one-worker run's AUC, logloss and training loss.
 *
 * Prints a table and, last, one JSON line: kills, recovered, clean_auc (the mean of the two
 * clean runs), clean_auc_runs, clean_spread, chaos_auc, auc_delta, failover_exact,
 * lost_updates_acknowledged, double_applied, metrics_whole, seconds. --check exits 1 unless
 * every kill was recovered, nothing was lost or doubled, the one-worker failover was exact, the
 * chaos run's metrics.jsonl is whole lines (worker 0, killed, left half a line), and the chaos
 * AUC is within 0.002 of the clean mean (0.01 with --quick, whose small data is noisier).
 */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench_util.h"
#include "common/common.h"
#include "ps/ps.h"

#define MAX_PROCS 16

static const char *ember, *dir;
static pid_t procs[MAX_PROCS];
static int n_procs;

static void kill_all(void)
{
    for (int i = 0; i < n_procs; i++)
        if (procs[i] > 0) kill(procs[i], SIGKILL);
    for (int i = 0; i < n_procs; i++)
        if (procs[i] > 0) waitpid(procs[i], NULL, 0);
    n_procs = 0;
}

static void die(const char *fmt, const char *what)
{
    fprintf(stderr, "bench_chaos: ");
    fprintf(stderr, fmt, what);
    fprintf(stderr, "\n");
    kill_all();
    exit(2);
}

static void on_signal(int sig)
{
    (void)sig;
    for (int i = 0; i < n_procs; i++)
        if (procs[i] > 0) kill(procs[i], SIGKILL);
    _exit(2);
}

static const char *path(const char *a, const char *b)
{
    static char buf[8][2100];
    static int k;
    char *s = buf[k++ % 8];
    snprintf(s, sizeof buf[0], "%s/%s", a, b);
    return s;
}

/* Starts argv with stdout/stderr to log.out/log.err; remembers the pid. */
static pid_t spawn(char *const argv[], const char *log)
{
    pid_t pid = fork();
    if (pid < 0) die("fork: %s", strerror(errno));
    if (pid == 0) {
        char out[1100], err[1100];
        snprintf(out, sizeof out, "%s.out", log);
        snprintf(err, sizeof err, "%s.err", log);
        if (!freopen(out, "w", stdout) || !freopen(err, "w", stderr)) _exit(127);
        execv(argv[0], argv);
        _exit(127);
    }
    if (n_procs < MAX_PROCS) procs[n_procs++] = pid;
    return pid;
}

static void forget(pid_t pid)
{
    for (int i = 0; i < n_procs; i++)
        if (procs[i] == pid) procs[i] = -1;
}

/* Waits for pid up to limit seconds: its exit status, or -1 on timeout. */
static int wait_pid(pid_t pid, double limit)
{
    double t0 = cm_now();
    for (;;) {
        int st;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) {
            forget(pid);
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        }
        if (cm_now() - t0 > limit) return -1;
        usleep(20000);
    }
}

static void run_or_die(char *const argv[], const char *log, double limit)
{
    pid_t p = spawn(argv, log);
    int rc = wait_pid(p, limit);
    if (rc != 0) die("%s failed (see its .err log)", log);
}

/* ---- a training job ---- */

typedef struct job {
    char run[1024], cluster[1100];
    char *const *train_args;
    pid_t ps[2], bk[2], w[2];
    int n_w; /* workers: 2, or 1 for the deterministic failover check */
    int backups;
    char w0log[1300];                /* worker 0's latest log */
    double auc, logloss, train_loss; /* worker 0's final JSON line */
} job;

static void write_cluster(job *j, int backups)
{
    FILE *f = fopen(j->cluster, "w");
    if (f == NULL) die("cannot write %s", j->cluster);
    fprintf(f, "[cluster]\nps = ipc://%s/ps0, ipc://%s/ps1\nworkers = %d\n", j->run, j->run,
            j->n_w);
    if (backups) fprintf(f, "backups = ipc://%s/bk0, ipc://%s/bk1\n", j->run, j->run);
    fclose(f);
    j->backups = backups;
}

static pid_t start_role(job *j, const char *role, int index, int resume, int rejoin)
{
    char *argv[64];
    int n = 0;
    char idx[16], log[1200];
    snprintf(idx, sizeof idx, "%d", index);
    snprintf(log, sizeof log, "%s/logs/%s-%d%s", j->run, role, index,
             rejoin   ? "-rejoin"
             : resume ? "-resume"
                      : "");
    if (!strcmp(role, "worker") && index == 0) snprintf(j->w0log, sizeof j->w0log, "%s.out", log);
    argv[n++] = (char *)ember;
    argv[n++] = "train";
    for (char *const *a = j->train_args; *a; a++)
        argv[n++] = *a;
    argv[n++] = "--out";
    argv[n++] = j->run;
    argv[n++] = "--cluster";
    argv[n++] = j->cluster;
    argv[n++] = "--role";
    argv[n++] = (char *)role;
    argv[n++] = "--index";
    argv[n++] = idx;
    if (resume) argv[n++] = "--resume";
    if (rejoin) argv[n++] = "--rejoin";
    argv[n] = NULL;
    return spawn(argv, log);
}

static void start_job(job *j, int resume)
{
    for (int i = 0; i < 2 && j->backups; i++)
        j->bk[i] = start_role(j, "backup", i, resume, 0);
    for (int i = 0; i < 2; i++)
        j->ps[i] = start_role(j, "ps", i, resume, 0);
    for (int i = 0; i < j->n_w; i++)
        j->w[i] = start_role(j, "worker", i, resume, 0);
}

/* The smaller of the workers' progress notes (batches), or 0. */
static uint64_t progress(const job *j)
{
    uint64_t lo = UINT64_MAX;
    for (int i = 0; i < j->n_w; i++) {
        char p[1200], line[128] = "";
        snprintf(p, sizeof p, "%s/progress/worker-%d", j->run, i);
        FILE *f = fopen(p, "r");
        unsigned long long v = 0;
        if (f) {
            if (fgets(line, sizeof line, f) == NULL || sscanf(line, "step %llu", &v) != 1) v = 0;
            fclose(f);
        }
        if (v < lo) lo = v;
    }
    return lo;
}

static void wait_progress(const job *j, uint64_t at, double limit)
{
    double t0 = cm_now();
    while (progress(j) < at) {
        if (cm_now() - t0 > limit) die("the job made no progress to batch %s in time", "?");
        for (int i = 0; i < j->n_w; i++) {
            int st;
            if (j->w[i] > 0 && waitpid(j->w[i], &st, WNOHANG) == j->w[i])
                die("a worker exited before the kill (see %s/logs)", j->run);
        }
        usleep(20000);
    }
}

/* Whether a run's metrics.jsonl is whole lines of JSON objects, steps never going back, the
 * last the final one; prints the first line that is not, with its number. */
static bool metrics_whole(const char *run)
{
    FILE *f = fopen(path(run, "metrics.jsonl"), "r");
    char line[4096];
    unsigned long long prev = 0, st;
    bool ok = f != NULL, final = false;
    for (int no = 1; ok && fgets(line, sizeof line, f) != NULL; no++) {
        size_t n = strlen(line);
        /* Flat objects: a brace inside is where two lines ran together. */
        ok = n >= 2 && line[n - 1] == '\n' && strchr(line + 1, '{') == NULL &&
             strchr(line, '}') == line + n - 2 && sscanf(line, "{\"step\":%llu,", &st) == 1 &&
             st >= prev;
        if (!ok) fprintf(stderr, "bench_chaos: %s/metrics.jsonl line %d: %s", run, no, line);
        prev = st;
        final = strstr(line, "\"final\":true") != NULL;
    }
    if (f) fclose(f);
    if (ok && !final) fprintf(stderr, "bench_chaos: %s/metrics.jsonl has no final line\n", run);
    return ok && final;
}

/* Waits for both workers and the PS side; returns worker 0's test AUC, or -1 on failure. */
static double finish_job(job *j, double limit)
{
    int rc0 = wait_pid(j->w[0], limit), rc1 = j->n_w > 1 ? wait_pid(j->w[1], limit) : 0;
    for (int i = 0; i < 2; i++) {
        wait_pid(j->ps[i], 10);
        if (j->backups) wait_pid(j->bk[i], 10);
    }
    kill_all();
    if (rc0 != 0 || rc1 != 0) return -1;
    char line[4096] = "";
    FILE *f = fopen(j->w0log, "r");
    double auc = -1;
    while (f && fgets(line, sizeof line, f))
        if (line[0] == '{') {
            const char *ll = strstr(line, "\"logloss\":"), *tl = strstr(line, "\"train_loss\":");
            sscanf(line, "{\"auc\":%lf", &auc);
            j->logloss = ll ? atof(ll + 10) : -1;
            j->train_loss = tl ? atof(tl + 13) : -1;
        }
    j->auc = auc;
    if (f) fclose(f);
    return auc;
}

static void job_init(job *j, const char *name, int n_w, char *const *train_args)
{
    memset(j, 0, sizeof *j);
    j->n_w = n_w;
    snprintf(j->run, sizeof j->run, "%s/%s", dir, name);
    snprintf(j->cluster, sizeof j->cluster, "%s/cluster.ini", j->run);
    j->train_args = train_args;
    char cmd[2200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s/logs'", j->run, j->run);
    if (system(cmd) != 0) die("cannot create %s", j->run);
}

static uint64_t rnd_state;
static double rnd(double lo, double hi)
{
    rnd_state = rnd_state * 6364136223846793005ull + 1442695040888963407ull;
    return lo + (hi - lo) * (double)(rnd_state >> 11) / 9007199254740992.0;
}

/* ---- ledger ---- */

#define LEDGER_KEYS 4096
#define LEDGER_DIM 4

static void ledger(int pushes, int64_t *lost, int64_t *doubled, int *kills, int *recovered)
{
    const char *cfgp = path(dir, "ledger.ini");
    FILE *f = fopen(cfgp, "w");
    if (f == NULL) die("cannot write %s", cfgp);
    fprintf(f,
            "[cluster]\nshards = 1\nworkers = 1\n[table t]\ndim = %d\noptimizer = sgd\nlr = 1\n"
            "init_scale = 0\n",
            LEDGER_DIM);
    fclose(f);
    char pu[1100], bu[1100];
    snprintf(pu, sizeof pu, "ipc://%s/ledger-p", dir);
    snprintf(bu, sizeof bu, "ipc://%s/ledger-b", dir);
    char *bargv[] = {(char *)ember, "ps", "--config", (char *)cfgp,
                     "--listen",    bu,   "--backup", NULL};
    char *pargv[] = {(char *)ember, "ps", "--config", (char *)cfgp, "--listen", pu,
                     "--replica",   bu,   NULL};
    pid_t b = spawn(bargv, path(dir, "ledger-backup"));
    pid_t p = spawn(pargv, path(dir, "ledger-primary"));
    ps_config cfg;
    char *err = NULL;
    if (ps_config_load(cfgp, &cfg, &err) != CM_OK) die("ledger config: %s", err);
    const char *urls[1] = {pu}, *backups[1] = {bu};
    ps_client_opts o = {
        .cfg = &cfg, .urls = urls, .worker = 0, .timeout_ms = 20000, .backup_urls = backups};
    ps_client *c = NULL;
    if (ps_client_create(&o, &c, &err) != CM_OK) die("ledger client: %s", err);
    static uint64_t keys[LEDGER_KEYS];
    static float g[LEDGER_KEYS * LEDGER_DIM], rows[LEDGER_KEYS * LEDGER_DIM];
    for (int i = 0; i < LEDGER_KEYS; i++)
        keys[i] = 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1);
    for (int i = 0; i < LEDGER_KEYS * LEDGER_DIM; i++)
        g[i] = 1.0f;
    int kill_at = (int)rnd(pushes * 0.3, pushes * 0.7), acked = 0;
    for (int i = 0; i < pushes; i++) {
        if (ps_client_push(c, 0, keys, LEDGER_KEYS, g, &err) != CM_OK) die("ledger push: %s", err);
        if (i % 8 == 7) {
            if (ps_client_flush(c, &err) != CM_OK) die("ledger flush: %s", err);
            acked = i + 1; /* every push so far is acknowledged */
        }
        if (i == kill_at) {
            kill(p, SIGKILL); /* pushes i-7..i may be in flight */
            (*kills)++;
        }
    }
    if (ps_client_flush(c, &err) != CM_OK) die("ledger flush after the kill: %s", err);
    acked = pushes;
    if (ps_client_pull(c, 0, keys, LEDGER_KEYS, rows, &err) != CM_OK) die("ledger pull: %s", err);
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int i = 0; i < LEDGER_KEYS * LEDGER_DIM; i++) {
        int64_t applied = (int64_t)-rows[i];
        if (applied < lo) lo = applied;
        if (applied > hi) hi = applied;
    }
    *lost = lo < acked ? acked - lo : 0;
    *doubled = hi > acked ? hi - acked : 0;
    if (*lost == 0 && *doubled == 0) (*recovered)++;
    ps_client_shutdown(c, NULL);
    ps_client_destroy(c);
    wait_pid(p, 5);
    wait_pid(b, 10);
    kill_all();
}

int main(int argc, char **argv)
{
    uint64_t rows = 1000000, seed = 1;
    int quick = 0, check = 0, sync = 0,
        phases = 7; /* 1 worker, 2 PS without backup, 4 replicated PS */
    dir = "/tmp/ember-chaos";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--rows") && i + 1 < argc)
            rows = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
            seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--dir") && i + 1 < argc)
            dir = argv[++i];
        else if (!strcmp(argv[i], "--quick"))
            quick = 1, rows = 60000;
        else if (!strcmp(argv[i], "--check"))
            check = 1;
        else if (!strcmp(argv[i], "--sync"))
            sync = 1;
        else if (!strcmp(argv[i], "--only") && i + 1 < argc) {
            const char *k = argv[++i];
            phases = !strcmp(k, "worker")    ? 1
                     : !strcmp(k, "ps")      ? 2
                     : !strcmp(k, "replica") ? 4
                                             : 0;
            if (phases == 0) die("--only worker|ps|replica, not %s", k);
        } else {
            fprintf(stderr,
                    "usage: bench_chaos [--rows N] [--seed S] [--dir DIR] [--quick] [--check] "
                    "[--sync] [--only worker|ps|replica]\n");
            return 2;
        }
    }
    ember = bench_ember_path();
    if (ember == NULL || access(ember, X_OK) != 0)
        die("no ember binary at %s", ember ? ember : "?");
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    rnd_state = seed * 0x9e3779b97f4a7c15ull + 1;
    double t0 = cm_now();
    char cmd[2200];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", dir);
    if (system(cmd) != 0) die("cannot create %s", dir);

    /* Data. */
    char nrows[32], sseed[32];
    snprintf(nrows, sizeof nrows, "%" PRIu64, rows);
    snprintf(sseed, sizeof sseed, "%" PRIu64, seed);
    const char *tsv = path(dir, "gen.tsv"), *data = path(dir, "data");
    char *gen[] = {(char *)ember, "gen", "--rows", nrows,       "--seed", sseed,
                   "--threads",   "1",   "--out",  (char *)tsv, NULL};
    run_or_die(gen, path(dir, "gen"), 300);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", data);
    if (system(cmd) != 0) die("cannot clear %s", data);
    char *ing[] = {(char *)ember,     "ingest",
                   "--format",        "criteo",
                   "--out",           (char *)data,
                   "--eval-fraction", "0.1",
                   "--block-rows",    quick ? "1024" : "8192",
                   "--threads",       "1",
                   (char *)tsv,       NULL};
    run_or_die(ing, path(dir, "ingest"), 300);
    unlink(tsv);
    char train[1100], eval[1100];
    snprintf(train, sizeof train, "%s/train", data);
    snprintf(eval, sizeof eval, "%s/eval", data);
    char *targs[] = {"--train",
                     train,
                     "--eval",
                     eval,
                     "--model",
                     "mlp",
                     "--batch",
                     quick ? "256" : "1024",
                     "--epochs",
                     "1",
                     "--device",
                     "cpu",
                     "--no-progress",
                     "--threads",
                     "1",
                     "--checkpoint-every",
                     quick ? "20" : "50",
                     "--keep-checkpoints",
                     "2",
                     "--ps-timeout",
                     "3000",
                     NULL,
                     NULL,
                     NULL};
    if (sync) { /* synchronous: every run applies the same updates per step, far less noise */
        size_t n = 0;
        while (targs[n])
            n++;
        targs[n] = "--staleness";
        targs[n + 1] = "0";
    }
    double limit = quick ? 120 : 900;

    int kills = 0, recovered = 0;
    /* Clean run. */
    job clean;
    job_init(&clean, "clean", 2, targs);
    write_cluster(&clean, 0);
    double tc = cm_now();
    start_job(&clean, 0);
    double clean_auc = finish_job(&clean, limit);
    tc = cm_now() - tc;
    if (clean_auc < 0) die("the clean run failed (see %s/clean/logs)", dir);
    /* Worker 0's schedule length, from its last progress note (the final batch index). */
    uint64_t total = progress(&clean) + 1;
    /* The same clean job again: two asynchronous workers never train in quite the same order,
     * so this is the noise any comparison of AUCs stands on. */
    job clean2;
    job_init(&clean2, "clean2", 2, targs);
    write_cluster(&clean2, 0);
    start_job(&clean2, 0);
    double clean2_auc = finish_job(&clean2, limit);
    if (clean2_auc < 0) die("the second clean run failed (see %s/clean2/logs)", dir);

    /* Exactness: one worker is deterministic, so killing a replicated primary must change
     * nothing at all: the same test AUC, logloss and training loss to the last digit. */
    job one, onek;
    job_init(&one, "one", 1, targs);
    write_cluster(&one, 1);
    start_job(&one, 0);
    if (finish_job(&one, limit) < 0) die("the one-worker run failed (see %s/one/logs)", dir);
    job_init(&onek, "one-kill", 1, targs);
    write_cluster(&onek, 1);
    start_job(&onek, 0);
    wait_progress(&onek, (uint64_t)(rnd(0.3, 0.7) * 2 * total), limit);
    kill(onek.ps[0], SIGKILL);
    wait_pid(onek.ps[0], 5);
    fprintf(stderr, "bench_chaos: one worker: killed PS 0 (replicated) at batch %" PRIu64 "\n",
            progress(&onek));
    kills++;
    if (finish_job(&onek, limit) >= 0) recovered++;
    int exact = onek.auc >= 0 && onek.auc == one.auc && onek.logloss == one.logloss &&
                onek.train_loss == one.train_loss;

    /* Chaos run. A kill counts as recovered once the job trains on past it (the last, once
     * the job has finished). */
    job j;
    job_init(&j, "chaos", 2, targs);
    /* Without the unreplicated PS kill, the backups are there from the start. */
    write_cluster(&j, !(phases & 2) && (phases & 4));
    double tx = cm_now();
    start_job(&j, 0);
    double f1 = rnd(0.1, 0.25), f2 = rnd(0.35, 0.5), f3 = rnd(0.65, 0.85);
    if (phases & 1) { /* (1) a worker */
        wait_progress(&j, (uint64_t)(f1 * total), limit);
        kill(j.w[0], SIGKILL);
        wait_pid(j.w[0], 5);
        kills++;
        uint64_t at = progress(&j);
        fprintf(stderr,
                "bench_chaos: killed worker 0 at batch %" PRIu64 "; restarting it with --rejoin\n",
                at);
        /* What a kill in the middle of a metrics line leaves: the rejoined worker must not
         * write on after it. */
        FILE *mf = fopen(path(j.run, "metrics.jsonl"), "a");
        if (mf == NULL || fputs("{\"step\":1,\"samp", mf) < 0 || fclose(mf) != 0)
            die("cannot append to %s", path(j.run, "metrics.jsonl"));
        j.w[0] = start_role(&j, "worker", 0, 0, 1);
        wait_progress(&j, at + 2, limit);
        recovered++;
    }
    if (phases & 2) { /* (2) a PS without a backup */
        wait_progress(&j, (uint64_t)(f2 * total), limit);
        kill(j.ps[1], SIGKILL);
        wait_pid(j.ps[1], 5);
        kills++;
        fprintf(stderr, "bench_chaos: killed PS 1 (no backup) at batch %" PRIu64 "\n",
                progress(&j));
        /* The job notices (request timeouts); once one worker has stopped, stop the rest. */
        double td = cm_now();
        int rc_first = -1;
        while (rc_first < 0 && cm_now() - td < 60) {
            for (int i = 0; i < 2 && rc_first < 0; i++)
                rc_first = wait_pid(j.w[i], 0);
            usleep(50000);
        }
        fprintf(stderr,
                "bench_chaos: a worker stopped %.1f s after the kill (exit %d); restarting the job "
                "with --resume%s\n",
                cm_now() - td, rc_first, phases & 4 ? " and backups" : "");
        kill_all();
        write_cluster(&j, (phases & 4) != 0);
        start_job(&j, 1);
        uint64_t at = progress(&j);
        wait_progress(&j, at + 2, limit);
        recovered++;
    }
    if (phases & 4) { /* (3) the primary of a replicated shard */
        wait_progress(&j, (uint64_t)(f3 * total), limit);
        kill(j.ps[0], SIGKILL);
        wait_pid(j.ps[0], 5);
        kills++;
        fprintf(stderr, "bench_chaos: killed PS 0 (replicated) at batch %" PRIu64 "\n",
                progress(&j));
    }
    double chaos_auc = finish_job(&j, limit);
    if (chaos_auc >= 0 && (phases & 4)) recovered++;
    tx = cm_now() - tx;

    /* Ledger. */
    int64_t lost = 0, doubled = 0;
    ledger(quick ? 200 : 1000, &lost, &doubled, &kills, &recovered);

    /* The reference is the mean of the two clean runs: one run alone is as far off as the
     * spread between them. */
    double spread = clean2_auc - clean_auc, ref = (clean_auc + clean2_auc) / 2;
    double delta = chaos_auc >= 0 ? chaos_auc - ref : -1;
    double seconds = cm_now() - t0, tol = quick ? 0.01 : 0.002;
    printf("%-34s %s\n", "rows generated", nrows);
    printf("%-34s %.1f s, test AUC %.4f\n", "clean run (2 PS x 2 workers)", tc, clean_auc);
    printf("%-34s test AUC %.4f (clean-to-clean %+.4f)\n", "clean run again", clean2_auc, spread);
    printf("%-34s AUC %.6f vs %.6f, logloss %.6f vs %.6f: %s\n", "1 worker, replicated PS 0 killed",
           onek.auc, one.auc, onek.logloss, one.logloss, exact ? "identical" : "DIFFERENT");
    printf("%-34s %.1f s, test AUC %.4f (%+.4f from the clean mean)\n", "chaos run (3 kills)", tx,
           chaos_auc, delta);
    printf("%-34s lost %" PRId64 ", applied twice %" PRId64 "\n",
           "ledger (kill a replicated primary)", lost, doubled);
    printf("%-34s %d of %d\n", "kills recovered", recovered, kills);
    bool metrics = metrics_whole(j.run);
    printf("%-34s %s\n", "chaos run's metrics.jsonl", metrics ? "whole lines" : "BROKEN");
    printf(
        "{\"kills\":%d,\"recovered\":%d,\"clean_auc\":%.6f,\"chaos_auc\":%.6f,\"auc_delta\":%.6f,"
        "\"lost_updates_acknowledged\":%" PRId64 ",\"double_applied\":%" PRId64
        ",\"clean_auc_runs\":[%.6f,%.6f],\"clean_spread\":%.6f,\"failover_exact\":%s,\"rows\":%s,"
        "\"metrics_whole\":%s,\"seconds\":%.1f}\n",
        kills, recovered, ref, chaos_auc, delta, lost, doubled, clean_auc, clean2_auc, spread,
        exact ? "true" : "false", nrows, metrics ? "true" : "false", seconds);
    if (!check) return 0;
    int ok = recovered == kills && lost == 0 && doubled == 0 && chaos_auc >= 0 && exact &&
             (delta < 0 ? -delta : delta) <= tol && metrics;
    if (!ok) fprintf(stderr, "bench_chaos: FAILED (logs under %s)\n", dir);
    return ok ? 0 : 1;
}
