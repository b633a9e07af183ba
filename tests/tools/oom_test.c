/*
 * Out of memory, one allocation at a time: `ember ingest`, `train`, `export`, `predict`, `gen`
 * and `reshard` are run again and again with the n-th allocation of ember's own code failing
 * (failmalloc.c, LD_PRELOAD), for every n up to the command's count, or every second n (ingest,
 * gen) or fourth (train), which would cost the suite more than ~10 s each. Each run must either
 *  - fail with a message that says "out of memory" and a non-zero exit, or
 *  - succeed with exactly the output of the run without a failure (a fallback such as buffered
 *    writes where direct I/O's buffers could not be had is fine; a wrong result is not),
 * and never die of a signal or hang (60 s a run). A run that crashed or wrote a wrong result
 * leaves its n in the message; FAILMALLOC_AT=n FAILMALLOC_BT=1 shows where.
 * Release build only: the sanitizers' runtimes own malloc, and a preloaded one cannot go first.
 * argv[1]: the failmalloc library.
 */
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../train/cli_util.h"

extern char **environ;

/* Runs $EMBER_BIN argv in dir with FAILMALLOC_AT=at (0: count only), stdout and stderr to
 * oom.out and oom.err; returns the wait status, or -1 when it did not end within 60 s. */
static int run_failing(const char *lib, char *const *argv, long at)
{
    char pre[4200], fail[64];
    snprintf(pre, sizeof pre, "LD_PRELOAD=%s", lib);
    snprintf(fail, sizeof fail, at > 0 ? "FAILMALLOC_AT=%ld" : "FAILMALLOC_COUNT=1", at);
    size_t n = 0;
    while (environ[n])
        n++;
    char **env = calloc(n + 4, sizeof *env);
    if (env == NULL) return -1;
    for (size_t i = 0; i < n; i++)
        env[i] = environ[i];
    env[n] = pre;
    env[n + 1] = fail;
    env[n + 2] =
        "OPENBLAS_NUM_THREADS=1"; /* its start-up, hundreds of times: a third of the time */
    char out[8300], err[8300];
    snprintf(out, sizeof out, "%s/oom.out", dir);
    snprintf(err, sizeof err, "%s/oom.err", dir);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&fa, 2, err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    pid_t pid;
    int st = -1;
    if (chdir(dir) == 0 && posix_spawn(&pid, bin, &fa, NULL, argv, env) == 0) {
        double t0 = cm_now();
        pid_t w;
        while ((w = waitpid(pid, &st, WNOHANG)) == 0 && cm_now() - t0 < 60)
            nanosleep(&(struct timespec){0, 2000000}, NULL);
        if (w == 0) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
            st = -1;
        }
    }
    posix_spawn_file_actions_destroy(&fa);
    free(env);
    return st;
}

/* One command: its arguments (OUT, a file or a directory, is what it writes; removed before
 * each run), whether OUT must equal the reference run's byte for byte (else, train, its final
 * line's auc and logloss must), and the stride over n. */
typedef struct {
    const char *name;
    char *argv[20];
    bool same_out;
    long stride;
} subject;

/* *text replaced by the file name in dir ("" when unreadable). */
static void reread(char **text, const char *name)
{
    free(*text);
    *text = slurp(name);
    if (*text == NULL) *text = calloc(1, 1);
}

/* The last run's final line's figures that its result is (train). */
static void result_of(char *out, size_t cap)
{
    reread(&out_text, "oom.out");
    char auc[64] = "", ll[64] = "";
    json_raw(last_line(), "auc", auc, sizeof auc);
    json_raw(last_line(), "logloss", ll, sizeof ll);
    snprintf(out, cap, "auc %s logloss %s", auc, ll);
}

static void sweep(const char *lib, subject *s)
{
    char ref[64], cmd[8400];
    snprintf(ref, sizeof ref, "ref-%s", s->name);
    snprintf(cmd, sizeof cmd, "rm -rf '%s/OUT' '%s/%s'", dir, dir, ref);
    CHECK(system(cmd) == 0);
    int st = run_failing(lib, s->argv, 0);
    reread(&err_text, "oom.err");
    long total = 0;
    const char *t = strstr(err_text, "failmalloc: total ");
    if (t) total = atol(t + 18);
    CHECK_MSG(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0 && total >= 10,
              "%s without a failure: status %d, %ld allocations counted; stderr: %s", s->name, st,
              total, err_text);
    if (total < 10) return;
    char want[256] = "";
    result_of(want, sizeof want);
    snprintf(cmd, sizeof cmd, "mv '%s/OUT' '%s/%s'", dir, dir, ref);
    if (s->same_out) CHECK(system(cmd) == 0);
    long failed = 0, fell_back = 0;
    for (long n = 1; n <= total; n += s->stride) {
        snprintf(cmd, sizeof cmd, "rm -rf '%s/OUT'", dir);
        CHECK(system(cmd) == 0);
        st = run_failing(lib, s->argv, n);
        reread(&err_text, "oom.err");
        size_t el = strlen(err_text);
        const char *tail = el > 300 ? err_text + el - 300 : err_text;
        if (st == -1 || WIFSIGNALED(st)) {
            CHECK_MSG(0, "%s, allocation %ld failed: %s %d; stderr: %s", s->name, n,
                      st == -1 ? "no end within 60 s" : "killed by signal",
                      st == -1 ? 0 : WTERMSIG(st), tail);
            continue;
        }
        if (WEXITSTATUS(st) != 0) {
            failed++;
            CHECK_MSG(strstr(err_text, "out of memory") != NULL,
                      "%s, allocation %ld failed: exit %d without saying out of memory: %s",
                      s->name, n, WEXITSTATUS(st), tail);
            continue;
        }
        fell_back++;
        if (!s->same_out) {
            char got[256];
            result_of(got, sizeof got);
            CHECK_MSG(strcmp(got, want) == 0, "%s, allocation %ld failed: exit 0 with %s, not %s",
                      s->name, n, got, want);
        }
        snprintf(cmd, sizeof cmd, "diff -r '%s/OUT' '%s/%s' >/dev/null", dir, dir, ref);
        if (s->same_out)
            CHECK_MSG(system(cmd) == 0, "%s, allocation %ld failed: exit 0 but its output differs",
                      s->name, n);
    }
    fprintf(stderr,
            "%s: %ld allocations, every %ld failed in turn: %ld runs said out of memory, "
            "%ld fell back and matched\n",
            s->name, total, s->stride, failed, fell_back);
    CHECK_MSG(failed > 0, "%s: no run failed: the library failed nothing", s->name);
}

int main(int argc, char **argv)
{
    if (CHECK_ASAN || CHECK_TSAN) {
        fprintf(stderr, "tools_oom: a sanitizer's runtime owns malloc here: skipped\n");
        return 77;
    }
    if (argc < 2 || cli_init("tools_oom") != 0) return 1;
    const char *lib = argv[1];
    if (make_criteo("ds", 3000, 3, 0.2) != 0) return check_done();
    int rc = run("train --train ds/train --eval ds/eval --model lr --max-steps 4 --threads 1 "
                 "--out base --no-progress");
    CHECK_MSG(rc == 0, "base run: %s", err_text);
    rc = run("export --checkpoint base --out bundle");
    CHECK_MSG(rc == 0, "export: %s", err_text);
    if (rc != 0) return check_done();
    char *b = (char *)bin;
    subject s[] = {
        {"ingest",
         {b, "ingest", "--format", "criteo", "--eval-fraction", "0.2", "--out", "OUT", "ds.tsv",
          NULL},
         true,
         2},
        {"train",
         {b, "train", "--train", "ds/train", "--eval", "ds/eval", "--model", "lr", "--max-steps",
          "3", "--threads", "1", "--out", "OUT", "--no-progress", NULL},
         false,
         4},
        {"export", {b, "export", "--checkpoint", "base", "--out", "OUT", NULL}, true, 1},
        {"predict",
         {b, "predict", "--bundle", "bundle", "--data", "ds/eval", "--out", "OUT", NULL},
         true,
         1},
        {"gen", {b, "gen", "--rows", "500", "--seed", "7", "--out", "OUT", NULL}, true, 2},
        {"reshard",
         {b, "reshard", "--from", "base", "--shards", "3", "--out", "OUT", NULL},
         true,
         1},
    };
    for (size_t i = 0; i < sizeof s / sizeof s[0]; i++)
        sweep(lib, &s[i]);
    free(out_text);
    free(err_text);
    return check_done();
}
