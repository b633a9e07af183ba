/*
 * A signal stops an embedded run after a checkpoint ($EMBER_BIN), as a scheduler's preemption
 * (SIGTERM) or a Ctrl-C (SIGINT) asks, instead of losing what was trained since the last one
 * (everything, without --checkpoint-every):
 *
 * - one worker, SIGTERM mid-run: exit status 143, no JSON line, LATEST names a checkpoint before
 *   the end, train.log says where it stopped; `--resume` then ends with the same evaluation,
 *   prediction for prediction, as the run straight through;
 * - two workers (asynchronous, so each may be at another step when the signal comes), SIGINT:
 *   both stop at one checkpoint (130), and the resumed run completes its schedule;
 * - a second signal stops the process at once, by that signal.
 */
#include <signal.h>

#include "cli_util.h"

/* Starts `ember train <args> --out <out>` in dir, stdout and stderr to <out>.stdout/.stderr. */
static pid_t start(const char *args, const char *out)
{
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "cd '%s' && exec '%s' train %s --out %s >%s.stdout 2>%s.stderr", dir,
             bin, args, out, out, out);
    pid_t pid = fork();
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    CHECK(pid > 0);
    return pid;
}

/* Waits until dir/<out>/logs/train.log holds `what` (true), or the process has ended or 60 s
 * have passed (false). */
static bool wait_log(pid_t pid, const char *out, const char *what)
{
    char name[512];
    snprintf(name, sizeof name, "%s/logs/train.log", out);
    for (int i = 0; i < 30000; i++) {
        char *log = slurp(name);
        bool has = log && strstr(log, what);
        free(log);
        if (has) return true;
        if (waitpid(pid, NULL, WNOHANG) == pid) return false;
        usleep(2000);
    }
    return false;
}

/* The process's wait status, after at most 120 s (then it is killed: -1). */
static int reap(pid_t pid)
{
    int st = 0;
    for (int i = 0; i < 12000; i++) {
        if (waitpid(pid, &st, WNOHANG) == pid) return st;
        usleep(10000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    return -1;
}

/* The step LATEST names in dir/<out> (0: none). */
static unsigned long latest(const char *out)
{
    char name[512];
    snprintf(name, sizeof name, "%s/ckpt/LATEST", out);
    char *s = slurp_sealed(name);
    unsigned long step = 0;
    if (s == NULL || sscanf(s, "step-%lu", &step) != 1) step = 0;
    free(s);
    return step;
}

/* Signals a run once it is training, and checks it stopped at a checkpoint before its end. */
static unsigned long stopped_run(const char *args, const char *out, int sig, unsigned total)
{
    pid_t pid = start(args, out);
    /* Once started, its loop soon begins: a stop asked for before waits for every worker's. */
    bool started = wait_log(pid, out, "ember train started");
    CHECK_MSG(started, "%s: never started", out);
    usleep(50000);
    CHECK(kill(pid, sig) == 0);
    int st = reap(pid);
    char name[512];
    snprintf(name, sizeof name, "%s.stderr", out);
    char *err = slurp(name);
    snprintf(name, sizeof name, "%s.stdout", out);
    char *std_out = slurp(name);
    CHECK_MSG(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 128 + sig,
              "%s: status %d (exit %d), expected exit %d; stderr: %.400s", out, st,
              WIFEXITED(st) ? WEXITSTATUS(st) : -1, 128 + sig, err ? err : "");
    CHECK_MSG(err && strstr(err, sig == SIGTERM ? "stopped by SIGTERM at step"
                                                : "stopped by SIGINT at step"),
              "%s: stderr %.400s", out, err ? err : "(none)");
    CHECK_MSG(std_out && strstr(std_out, "\"auc\"") == NULL, "%s printed a result: %s", out,
              std_out ? std_out : "");
    unsigned long at = latest(out);
    CHECK_MSG(at > 0 && at < total, "%s: LATEST names step %lu of %u", out, at, total);
    snprintf(name, sizeof name, "%s/logs/train.log", out);
    char *log = slurp(name), want[64];
    snprintf(want, sizeof want, "stopped at step %lu by a signal", at);
    CHECK_MSG(log && strstr(log, want), "%s: train.log lacks '%s'", out, want);
    free(log);
    free(err);
    free(std_out);
    return at;
}

int main(void)
{
    if (cli_init("train_stop") != 0) return 1;
    if (make_criteo("ds", 20000, 11, 0.1) != 0) return check_done();
    const unsigned total = 800; /* 18K rows of batch 128: 141 steps an epoch, 6 epochs */
    const char *one = "--train ds/train --eval ds/eval --no-progress --model mlp --batch 128 "
                      "--epochs 6 --max-steps 800 --threads 1";

    CHECK(run("train %s --out S", one) == 0);
    char straight[4096];
    snprintf(straight, sizeof straight, "%s", last_line());
    CHECK(jnum(straight, "steps") == total);
    char *pred_s = slurp("S/eval_predictions.txt");

    stopped_run(one, "P", SIGTERM, total);
    CHECK(run("train %s --out P --resume", one) == 0);
    const char *resumed = last_line();
    CHECK(jnum(resumed, "steps") == total);
    char *pred_p = slurp("P/eval_predictions.txt");
    CHECK_MSG(pred_s && pred_p && strcmp(pred_s, pred_p) == 0,
              "the resumed run's predictions differ from the straight run's (%s / %s)", straight,
              resumed);
    free(pred_s);
    free(pred_p);

    char two[512];
    snprintf(two, sizeof two, "%s --workers 2", one);
    unsigned long at = stopped_run(two, "W", SIGINT, total);
    CHECK(run("train %s --out W --resume", two) == 0);
    CHECK_MSG(jnum(last_line(), "steps") > (double)at, "resumed from step %lu: %s", at,
              last_line());

    /* A second signal does not wait for the checkpoint (steps of 4096 rows: the stop, three
     * steps away, normally comes well after the second signal). On a loaded machine this test
     * may see the first signal's note only once that stop is through (the process then exits
     * 143): tried up to three times, each of which a second signal that waited would fail. */
    int st = -1;
    for (int attempt = 0; attempt < 3; attempt++) {
        char out[16];
        snprintf(out, sizeof out, "K%d", attempt);
        pid_t pid = start("--train ds/train --no-progress --model mlp --batch 4096 --epochs 10 "
                          "--threads 1",
                          out);
        CHECK(wait_log(pid, out, "ember train started"));
        CHECK(kill(pid, SIGTERM) == 0);
        CHECK(wait_log(pid, out, "[ stopping]")); /* two at once may arrive as one */
        kill(pid, SIGTERM);                       /* ESRCH when it is gone already */
        st = reap(pid);
        if (st != -1 && WIFSIGNALED(st)) break;
        fprintf(stderr, "stop_test: %s stopped before its second signal (status %d); again\n", out,
                st);
    }
    CHECK_MSG(st != -1 && WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM,
              "a second SIGTERM: status %d (exit %d)", st, WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    return check_done();
}
