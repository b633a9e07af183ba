/*
 * tools/launch: a 2 PS x 2 worker job on ~20K generated rows must print worker 0's JSON with
 * auc > 0.55 and leave no process behind; a job whose workers fail, and one stopped with
 * SIGTERM (one of its PS processes stopped by SIGSTOP, as a hung one), must exit non-zero and
 * leave no process behind either, the latter within 4.5 s; nor may a job whose launch is killed
 * with SIGKILL (within 5 s). The PS processes run at
 * niceness 5 (--ps-nice), the workers at the caller's; a bad --ps-nice is refused. A job with
 * --checkpoint-every stopped with SIGTERM stops gracefully: every process gone within 30 s,
 * launch's status 143, LATEST naming a checkpoint newer than the one written when the signal
 * came and before the end, and a --resume through launch completing the schedule; so does one
 * without it (its workers' stop polls fix the checkpoint's step).
 *
 * argv[1] is tools/launch; $EMBER_BIN the ember binary (set by ember_add_test). Every child runs
 * in its own process group under a watchdog, so a hung launch cannot outlive the test.
 */
#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

static const char *launch, *ember, *dir;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Starts argv with stdout to out_path, stderr inherited, in a new process group. */
static pid_t spawn(char *const argv[], const char *out_path)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        setpgid(0, 0);
        if (out_path && freopen(out_path, "w", stdout) == NULL) _exit(127);
        execv(argv[0], argv);
        _exit(127);
    }
    return pid;
}

/* Waits up to limit seconds; then kills the whole group. Exit status, or -1 killed/failed. */
static int wait_bounded(pid_t pid, double limit)
{
    double t0 = now_s();
    int st;
    for (;;) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        if (r < 0 && errno != EINTR) return -1;
        if (now_s() - t0 > limit) {
            fprintf(stderr, "launch_test: pid %d ran past %.0f s; killing its group\n", (int)pid, limit);
            kill(-pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        usleep(50000);
    }
}

static int run(char *const argv[], const char *out_path, double limit)
{
    pid_t pid = spawn(argv, out_path);
    return pid < 0 ? -1 : wait_bounded(pid, limit);
}

/* Counts the pids listed in RUNDIR/pids that are still alive (and not zombies). */
static int quiet;

static int alive_from(const char *run_dir, int *listed)
{
    char path[4200], role[32];
    snprintf(path, sizeof path, "%s/pids", run_dir);
    FILE *f = fopen(path, "r");
    *listed = 0;
    if (f == NULL) return -1;
    int idx, pid, alive = 0;
    while (fscanf(f, "%31s %d %d", role, &idx, &pid) == 3) {
        (*listed)++;
        char stat[64], buf[512];
        snprintf(stat, sizeof stat, "/proc/%d/stat", pid);
        FILE *s = fopen(stat, "r");
        if (s == NULL) continue;
        if (fgets(buf, sizeof buf, s)) {
            char *p = strrchr(buf, ')');
            if (p && p[1] == ' ' && p[2] != 'Z' && strstr(buf, "(ember)")) {
                alive++;
                if (!quiet) fprintf(stderr, "launch_test: %s %d (pid %d) is still running\n", role, idx, pid);
            }
        }
        fclose(s);
    }
    fclose(f);
    return alive;
}

/* Waits (up to 10 s) until the job's n processes are listed, and so started, then half a second
 * more; returns how many run (alive_from). */
static int wait_listed(const char *run_dir, int n, int *listed)
{
    quiet = 1;
    for (int i = 0; i < 200; i++) {
        int got = 0;
        if (alive_from(run_dir, &got) >= 0 && got == n) break;
        usleep(50000);
    }
    usleep(500000);
    int alive = alive_from(run_dir, listed);
    quiet = 0;
    return alive;
}

/* SIGKILLs every listed process still running ember (a failed check leaves none behind). */
static void kill_listed(const char *run_dir)
{
    char path[4400], proc[64], role[32], comm[64];
    snprintf(path, sizeof path, "%s/pids", run_dir);
    FILE *f = fopen(path, "r");
    int idx, pid;
    while (f != NULL && fscanf(f, "%31s %d %d", role, &idx, &pid) == 3) {
        snprintf(proc, sizeof proc, "/proc/%d/comm", pid);
        FILE *c = fopen(proc, "r");
        if (c != NULL && fgets(comm, sizeof comm, c) && strncmp(comm, "ember", 5) == 0)
            kill(pid, SIGKILL);
        if (c != NULL) fclose(c);
    }
    if (f != NULL) fclose(f);
}

/* The pid of the job's PS process `index` (RUNDIR/pids), or -1. */
static pid_t ps_pid(const char *run_dir, int index)
{
    char path[4400], role[32];
    snprintf(path, sizeof path, "%s/pids", run_dir);
    FILE *f = fopen(path, "r");
    if (f == NULL) return -1;
    int idx, pid;
    pid_t found = -1;
    while (found < 0 && fscanf(f, "%31s %d %d", role, &idx, &pid) == 3)
        if (!strcmp(role, "ps") && idx == index) found = pid;
    fclose(f);
    return found;
}

/* Checks the niceness of every listed process that runs: ps and backup at `ps_nice`, workers
 * at this test's own. Returns how many it read. */
static int check_nice(const char *run_dir, int ps_nice)
{
    char path[4400], role[32];
    snprintf(path, sizeof path, "%s/pids", run_dir);
    FILE *f = fopen(path, "r");
    if (f == NULL) return 0;
    int idx, pid, n = 0, own = nice(0);
    while (fscanf(f, "%31s %d %d", role, &idx, &pid) == 3) {
        char stat[64], buf[1024];
        snprintf(stat, sizeof stat, "/proc/%d/stat", pid);
        FILE *s = fopen(stat, "r");
        if (s == NULL) continue;
        char *p = fgets(buf, sizeof buf, s) ? strrchr(buf, ')') : NULL;
        fclose(s);
        int ni = 0;
        /* After the comm: state, then fields 4..19; niceness is field 19. */
        if (p == NULL || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %d", &ni) != 1)
            continue;
        int want = strcmp(role, "worker") == 0 ? own : own + ps_nice;
        if (want > 19) want = 19; /* the kernel's ceiling, when the test itself runs niced */
        CHECK_MSG(ni == want, "%s %d (pid %d) runs at niceness %d, expected %d", role, idx, pid, ni, want);
        n++;
    }
    fclose(f);
    return n;
}

static double json_num(const char *line, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(line, pat);
    return p ? strtod(p + strlen(pat), NULL) : NAN;
}

/* The step dir/ckpt/LATEST names (0: none yet). */
static unsigned long latest_step(const char *run_dir)
{
    char path[4400], buf[64] = "";
    snprintf(path, sizeof path, "%s/ckpt/LATEST", run_dir);
    FILE *f = fopen(path, "r");
    unsigned long step = 0;
    if (f != NULL && fgets(buf, sizeof buf, f) && sscanf(buf, "step-%lu", &step) != 1) step = 0;
    if (f != NULL) fclose(f);
    return step;
}

/* The last JSON line in file path, into line (n bytes; "" when none). */
static void last_json(const char *path, char *line, size_t n)
{
    line[0] = '\0';
    FILE *f = fopen(path, "r");
    char buf[4096];
    while (f != NULL && fgets(buf, sizeof buf, f))
        if (buf[0] == '{') snprintf(line, n, "%s", buf);
    if (f != NULL) fclose(f);
}

/* The pid dir/pids lists for role's process idx (0: none). */
static pid_t listed_pid(const char *run_dir, const char *want, int want_idx)
{
    char path[4400], role[32];
    snprintf(path, sizeof path, "%s/pids", run_dir);
    FILE *f = fopen(path, "r");
    int idx, pid;
    pid_t found = 0;
    while (f != NULL && fscanf(f, "%31s %d %d", role, &idx, &pid) == 3)
        if (strcmp(role, want) == 0 && idx == want_idx) found = pid;
    if (f != NULL) fclose(f);
    return found;
}

/* 5. SIGTERM to a job with --checkpoint-every (a scheduler's preemption): launch passes it on,
 * the workers agree at their next periodic checkpoint and stop after it, worker 0 shuts the PS
 * down, and a --resume through launch completes the schedule. Before, every process died at
 * once and the steps since the last periodic checkpoint were lost. With to_worker the signal
 * goes to worker 1 alone (a scheduler's to one process): launch must take its stop for what it
 * is and wait for the others, not fail the job and kill them (it did), and no resume is run. */
/* With polls, the job has no --checkpoint-every: the workers' stop polls of shard 0 (every 100
 * steps) fix a step they all reach, and they checkpoint there and stop (before, every process
 * died at once and the whole run was lost). */
static void graceful_stop(const char *train, bool to_worker, bool polls)
{
    char run_dir[4300], out[4400];
    snprintf(run_dir, sizeof run_dir, "%s/run-grace%s%s", dir, to_worker ? "-w" : "",
             polls ? "-p" : "");
    snprintf(out, sizeof out, "%s.json", run_dir);
    const unsigned total = polls ? 1000 : 400;
    /* The job's command line, split at spaces (no path here has one) with room for one more
     * argument (--resume). */
    char line_buf[16384], *job[32];
    snprintf(line_buf, sizeof line_buf,
             "%s --ps 1 --workers 2 --out %s -- --train %s --model mlp --batch 64 --epochs 100 "
             "--max-steps %u --device cpu --no-progress%s",
             launch, run_dir, train, total, polls ? "" : " --checkpoint-every 20");
    size_t n = 0;
    for (char *save = NULL, *t = strtok_r(line_buf, " ", &save); t && n < 30;
         t = strtok_r(NULL, " ", &save))
        job[n++] = t;
    job[n] = job[n + 1] = NULL;
    pid_t pid = spawn(job, "/dev/null");
    unsigned long before = 0;
    char note[4400];
    snprintf(note, sizeof note, "%s/progress/worker-1", run_dir);
    bool training = false;
    /* Its first checkpoint, or with polls worker 1's progress note (written as its loop
     * starts): it is training. */
    for (int i = 0; i < 1200 && !training; i++) {
        usleep(25000);
        before = latest_step(run_dir);
        training = polls ? access(note, F_OK) == 0 : before > 0;
    }
    CHECK_MSG(training, "not training within 30 s (logs in %s/logs)", run_dir);
    if (polls) usleep(300000);
    double t_term = now_s();
    pid_t target = to_worker ? listed_pid(run_dir, "worker", 1) : pid;
    CHECK_MSG(target > 0, "no worker 1 in %s/pids", run_dir);
    if (target > 0) kill(target, SIGTERM);
    int rc = wait_bounded(pid, 60);
    double took = now_s() - t_term;
    int listed;
    unsigned long at = latest_step(run_dir);
    fprintf(stderr,
            "launch_test: SIGTERM to %s at LATEST step-%lu: launch exited %d after %.1f s, "
            "LATEST step-%lu\n",
            to_worker ? "worker 1" : "launch", before, rc, took, at);
    CHECK_MSG(rc == 143, "launch exited %d after SIGTERM, expected 143 (logs in %s/logs)", rc,
              run_dir);
    CHECK_MSG(took < 30, "the job took %.1f s to stop", took);
    CHECK(alive_from(run_dir, &listed) == 0);
    CHECK(listed == 3);
    CHECK_MSG(at > before && at < total && (!polls || at % 100 == 0),
              "LATEST names step %lu: expected a checkpoint after step %lu (written when the "
              "signal came) and before the end (%u)%s",
              at, before, total, polls ? ", at a stop poll's step (a multiple of 100)" : "");
    if (to_worker) return;
    /* The --resume through launch completes the job. */
    job[n] = "--resume";
    rc = run(job, out, 120);
    char line[4096];
    last_json(out, line, sizeof line);
    CHECK_MSG(rc == 0 && json_num(line, "steps") == total,
              "--resume: launch exited %d, final JSON %s", rc, line[0] ? line : "(none)\n");
    CHECK(alive_from(run_dir, &listed) == 0);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: launch_test PATH/tools/launch\n");
        return 2;
    }
    launch = argv[1];
    ember = getenv("EMBER_BIN");
    if (ember == NULL || access(ember, X_OK) != 0) {
        fprintf(stderr, "launch_test: EMBER_BIN is not an executable\n");
        return 2;
    }
    dir = check_tmpdir("tools_launch");
    char tsv[4200], data[4200], train[4300], eval[4300], run_ok[4200], run_bad[4200], run_term[4200],
        out[4300];
    snprintf(tsv, sizeof tsv, "%s/data.tsv", dir);
    snprintf(data, sizeof data, "%s/data", dir);
    snprintf(train, sizeof train, "%s/train", data);
    snprintf(eval, sizeof eval, "%s/eval", data);
    snprintf(run_ok, sizeof run_ok, "%s/run-ok", dir);
    snprintf(run_bad, sizeof run_bad, "%s/run-bad", dir);
    snprintf(run_term, sizeof run_term, "%s/run-term", dir);

    /* ~20K rows: 18K train in several blocks (so both workers get some), 2K eval. */
    char *gen[] = {(char *)ember, "gen", "--rows", "20000", "--seed", "3", "--threads", "1", "--out", tsv, NULL};
    CHECK(run(gen, "/dev/null", 60) == 0);
    char *ing[] = {(char *)ember, "ingest", "--format", "criteo", "--out", data, "--eval-fraction", "0.1",
                   "--block-rows", "1024", "--threads", "1", tsv, NULL};
    CHECK(run(ing, "/dev/null", 60) == 0);

    /* 1. A good job: 2 PS x 2 workers, one epoch of small batches (enough steps on 18K rows for
     * an AUC of ~0.63; batch 2048 would give only ~9 steps a worker). */
    snprintf(out, sizeof out, "%s.json", run_ok);
    char *ok[] = {(char *)launch, "--ps", "2", "--workers", "2", "--out", run_ok, "--timeout", "100", "--",
                  "--train", train, "--eval", eval, "--model", "mlp", "--batch", "64", "--epochs", "1",
                  "--device", "cpu", "--no-progress", NULL};
    double t0 = now_s();
    int rc = run(ok, out, 120);
    CHECK_MSG(rc == 0, "launch exited %d (logs in %s/logs)", rc, run_ok);
    char line[4096];
    last_json(out, line, sizeof line);
    double auc = json_num(line, "auc");
    fprintf(stderr, "launch_test: good job took %.1f s: %s", now_s() - t0, line[0] ? line : "(no JSON)\n");
    CHECK_MSG(auc > 0.55, "auc %.4f", auc);
    CHECK(json_num(line, "eval_rows") > 1000);
    /* The job's figures, not worker 0's alone: both workers' rows (the eval rows plus the
     * training rows are the 20K generated), from the cluster file's 2 workers and 2 shards. */
    double rows = json_num(line, "rows"), erows = json_num(line, "eval_rows");
    CHECK_MSG(rows + erows == 20000 && json_num(line, "workers") == 2 &&
                  json_num(line, "shards") == 2,
              "final JSON: rows %g + eval_rows %g (expected 20000), workers %g, shards %g", rows,
              erows, json_num(line, "workers"), json_num(line, "shards"));
    int listed;
    CHECK(alive_from(run_ok, &listed) == 0);
    CHECK(listed == 4);
    struct stat st;
    char cl[4400];
    snprintf(cl, sizeof cl, "%s/cluster.ini", run_ok);
    CHECK(stat(cl, &st) == 0);

    /* 2. A failing job: the workers cannot read their data; launch must stop the PS processes. */
    char *bad[] = {(char *)launch, "--ps", "2", "--workers", "2", "--out", run_bad, "--timeout", "60", "--",
                   "--train", "/nonexistent/train", "--no-progress", NULL};
    rc = run(bad, "/dev/null", 90);
    CHECK_MSG(rc != 0 && rc != -1, "launch exited %d on a failing job", rc);
    CHECK(alive_from(run_bad, &listed) == 0);

    char *badnice[] = {(char *)launch, "--ps", "1", "--workers", "1", "--ps-nice", "x", "--out", run_bad, "--",
                       "--train", train, NULL};
    CHECK_MSG(run(badnice, "/dev/null", 30) == 2, "--ps-nice x accepted");

    /* 3. SIGTERM while the job runs (long enough not to finish first). The workers then stop
     * at a checkpoint their stop polls fix (graceful_stop tests that), which a sanitizer build
     * with a hung PS can take longer than this test allows: --grace 2 bounds it, after which
     * launch kills what is left, and a hung PS must not delay that. */
    char *term[] = {(char *)launch,
                    "--ps",
                    "2",
                    "--workers",
                    "2",
                    "--grace",
                    "2",
                    "--out",
                    run_term,
                    "--",
                    "--train",
                    train,
                    "--model",
                    "mlp",
                    "--batch",
                    "64",
                    "--epochs",
                    "1000",
                    "--device",
                    "cpu",
                    "--no-progress",
                    NULL};
    pid_t pid = spawn(term, "/dev/null");
    int before = wait_listed(run_term, 4, &listed);
    CHECK_MSG(before > 0, "no process of the job running before SIGTERM (%d listed)", listed);
    /* The PS processes share the cores with the workers at niceness 5 (--ps-nice's default). */
    CHECK_MSG(check_nice(run_term, 5) > 0, "no niceness read");
    /* A stopped (hung) PS is stopped as promptly as the rest: a stopped process keeps a TERM
     * pending until it is continued, and launch then waited its full 5 s for the KILL. */
    pid_t stopped = ps_pid(run_term, 1);
    CHECK_MSG(stopped > 0 && kill(stopped, SIGSTOP) == 0, "cannot stop ps 1 (pid %d)", stopped);
    usleep(200000);
    double t_term = now_s();
    kill(pid, SIGTERM);
    rc = wait_bounded(pid, 30);
    double took = now_s() - t_term;
    CHECK_MSG(rc != 0 && rc != -1, "launch exited %d after SIGTERM", rc);
    CHECK_MSG(took < 4.5, "launch took %.1f s to stop a job with a stopped PS", took);
    CHECK(alive_from(run_term, &listed) == 0);
    CHECK(listed == 4);

    /* 3b. launch killed outright (SIGKILL: no trap runs): its processes must not run on. */
    char run_kill[4300];
    snprintf(run_kill, sizeof run_kill, "%s/run-kill", dir);
    char *killed[] = {(char *)launch,  "--ps", "1",        "--workers", "1",        "--out",
                      run_kill,        "--",   "--train",  train,       "--model",  "mlp",
                      "--batch",       "64",   "--epochs", "1000",      "--device", "cpu",
                      "--no-progress", NULL};
    /* Its socket folder (mktemp under $TMPDIR) outlives it, as nothing runs its cleanup: it
     * goes in a folder of the test's own, removed below, not in /tmp for good. A short path:
     * a unix socket's name has room for ~107 bytes. */
    char sock_tmp[] = "/tmp/ember-launch-test.XXXXXX";
    const char *old_tmp = getenv("TMPDIR");
    char *saved_tmp = old_tmp ? strdup(old_tmp) : NULL;
    CHECK(mkdtemp(sock_tmp) != NULL);
    setenv("TMPDIR", sock_tmp, 1);
    pid = spawn(killed, "/dev/null");
    if (saved_tmp)
        setenv("TMPDIR", saved_tmp, 1);
    else
        unsetenv("TMPDIR");
    free(saved_tmp);
    before = wait_listed(run_kill, 2, &listed);
    quiet = 1;
    CHECK_MSG(before == 2, "%d of the job's %d processes running before SIGKILL", before, listed);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    int left = before;
    for (int i = 0; i < 100 && left > 0; i++) {
        usleep(50000);
        left = alive_from(run_kill, &listed);
    }
    quiet = 0;
    CHECK_MSG(left == 0, "%d processes still running 5 s after launch was killed",
              alive_from(run_kill, &listed));
    kill_listed(run_kill);
    char rm[200];
    snprintf(rm, sizeof rm, "rm -rf '%s'", sock_tmp);
    CHECK(system(rm) == 0);

    /* 4. SIGTERM while launch stops a failed job: worker 0 fails, the others ignore TERM (as
     * one busy writing a checkpoint may). The signal must KILL them at once; launch used to
     * return from its cleanup (already under way) and exit, leaving them running. */
    char fake_dir[4300], fake[4400], run_stop[4300];
    snprintf(fake_dir, sizeof fake_dir, "%s/fake", dir);
    snprintf(fake, sizeof fake, "%s/ember", fake_dir); /* comm "ember", as alive_from wants */
    snprintf(run_stop, sizeof run_stop, "%s/run-stop", dir);
    mkdir(fake_dir, 0755);
    FILE *f = fopen(fake, "w");
    CHECK(f != NULL);
    if (f) {
        fputs("#!/bin/sh\n"
              "case \"$*\" in *'--role worker --index 0'*) sleep 0.3; echo failed >&2; exit 3;; "
              "esac\n"
              "trap '' TERM\n"
              "while :; do sleep 0.1; done\n",
              f);
        fclose(f);
        chmod(fake, 0755);
    }
    char *stop[] = {(char *)launch, "--ps",  "1",      "--workers", "2",   "--ember",
                    fake,           "--out", run_stop, "--",        "--x", NULL};
    pid = spawn(stop, "/dev/null");
    usleep(1500000); /* worker 0 has failed; launch waits up to 5 s for the TERMs */
    quiet = 1;
    CHECK_MSG(alive_from(run_stop, &listed) == 2, "the fake ps and worker 1 are not running");
    quiet = 0;
    t_term = now_s();
    kill(pid, SIGTERM);
    rc = wait_bounded(pid, 30);
    took = now_s() - t_term;
    CHECK_MSG(rc != 0 && rc != -1, "launch exited %d after SIGTERM while stopping", rc);
    CHECK_MSG(took < 2, "launch took %.1f s to stop after a SIGTERM while stopping", took);
    usleep(200000);
    CHECK(alive_from(run_stop, &listed) == 0);
    CHECK(listed == 3);

    graceful_stop(train, false, false);
    graceful_stop(train, true, false);
    graceful_stop(train, false, true);
    graceful_stop(train, true, true);
    return check_done();
}
