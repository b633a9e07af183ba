/*
 * A worker of a cluster job killed outright (SIGKILL), with no --worker-timeout: the worker it
 * leaves waiting at a clock (--staleness 0) must fail within about --ps-timeout, naming the dead
 * worker, not hang 20 x --ps-timeout (a minute's barrier timeout of the client) and then blame
 * the PS ("is the PS running and reachable?"); and a worker restarted at once with --rejoin is
 * still taken back, the job finishing as if nothing had happened. One PS and two workers, each
 * its own process, over ipc://; every child is killed and reaped on every way out (ps_proc.h).
 */
#include <inttypes.h>

#include "cli_util.h"
#include "ps/ps_proc.h"

#define ARGS_FMT                                                                                   \
    "--train ds/train --model lr --batch 256 --epochs %d --staleness 0 --ps-timeout %d "           \
    "--no-progress --cluster c.ini --out %s"

/* Starts `ember train <ARGS> --role ROLE --index I [--rejoin]` in dir, its stderr to log. */
static pid_t start(const char *role, int index, int epochs, int ps_timeout, const char *out,
                   bool rejoin, const char *log)
{
    char args[2048], path[8192];
    snprintf(args, sizeof args, ARGS_FMT " --role %s --index %d%s", epochs, ps_timeout, out, role,
             index, rejoin ? " --rejoin" : "");
    char *argv[64];
    int n = 0;
    argv[n++] = (char *)bin;
    argv[n++] = "train";
    for (char *t = strtok(args, " "); t != NULL && n < 62; t = strtok(NULL, " "))
        argv[n++] = t;
    argv[n] = NULL;
    snprintf(path, sizeof path, "%s/%s", dir, log);
    unlink(path);
    if (chdir(dir) != 0) return -1;
    return psp_spawn_argv(argv, NULL, path);
}

/* The batch worker w's progress note names (its next one), or 0. */
static uint64_t progress_of(const char *out, int w)
{
    char name[256];
    snprintf(name, sizeof name, "%s/progress/worker-%d", out, w);
    char *t = slurp(name);
    unsigned long long step = 0;
    if (t == NULL || sscanf(t, "step %llu", &step) != 1) step = 0;
    free(t);
    return step;
}

/* Waits until worker w's note is at least `step`; false after limit_s. */
static bool wait_progress(const char *out, int w, uint64_t step, double limit_s)
{
    for (double end = psp_now() + limit_s; psp_now() < end; psp_sleep_ms(20))
        if (progress_of(out, w) >= step) return true;
    return false;
}

/* Waits up to limit_s for pid to exit: its exit code (128 + signal when killed), -1 on timeout
 * (it is then left running for psp_stop). Unregisters it when it exited. */
static int wait_exit(pid_t pid, double limit_s)
{
    for (double end = psp_now() + limit_s; psp_now() < end; psp_sleep_ms(10)) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            psp_forget(psp_find(pid));
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        }
    }
    return -1;
}

static void kill9(pid_t pid)
{
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    psp_forget(psp_find(pid));
}

int main(void)
{
    psp_watchdog(200);
    if (cli_init("train_worker_lost") != 0) return 1;
    if (make_criteo("ds", 30000, 1, 0.1) != 0) return check_done();
    char text[8192], path[8300];
    snprintf(text, sizeof text, "[cluster]\nps = ipc://%s/ps0.sock\nworkers = 2\n", dir);
    snprintf(path, sizeof path, "%s/c.ini", dir);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL && fputs(text, f) >= 0 && fclose(f) == 0);

    /* Worker 1 dies mid-run; worker 0 waits for it at its next clock. */
    const int ps_timeout = 1000;
    pid_t ps = start("ps", 0, 50, ps_timeout, "dead", false, "dead-ps.err");
    pid_t w0 = start("worker", 0, 50, ps_timeout, "dead", false, "dead-w0.err");
    pid_t w1 = start("worker", 1, 50, ps_timeout, "dead", false, "dead-w1.err");
    CHECK_MSG(wait_progress("dead", 1, 20, 60), "worker 1 made no progress (see dead-w1.err)");
    kill9(w1);
    double t0 = psp_now();
    int rc = wait_exit(w0, 60);
    double took = psp_now() - t0;
    char *err = slurp("dead-w0.err");
    fprintf(stderr,
            "worker 0 exited %d %.2f s after worker 1 was killed (--ps-timeout %d ms):\n%s\n", rc,
            took, ps_timeout, err ? err : "");
    CHECK_MSG(rc > 0 && rc < 128, "worker 0: exit %d, expected a failure", rc);
    /* Within about --ps-timeout of the death (plus the PS's 100 ms rounds and a loaded host's
     * slack), not 20 x --ps-timeout. */
    CHECK_MSG(took < 5.0 * ps_timeout / 1000, "worker 0 stopped %.2f s after the death", took);
    CHECK_MSG(err && strstr(err, "worker 1 "), "worker 0's error does not name worker 1");
    CHECK_MSG(err && !strstr(err, "is the PS running"), "worker 0 blames the PS");
    free(err);
    psp_stop(w0, SIGKILL, 5);
    psp_stop(ps, SIGKILL, 5);

    /* Worker 1 dies and is restarted at once with --rejoin: the job completes. */
    const int ps_timeout2 = 5000;
    ps = start("ps", 0, 8, ps_timeout2, "rejoin", false, "rejoin-ps.err");
    w0 = start("worker", 0, 8, ps_timeout2, "rejoin", false, "rejoin-w0.err");
    w1 = start("worker", 1, 8, ps_timeout2, "rejoin", false, "rejoin-w1.err");
    CHECK_MSG(wait_progress("rejoin", 1, 20, 60), "worker 1 made no progress (see rejoin-w1.err)");
    kill9(w1);
    w1 = start("worker", 1, 8, ps_timeout2, "rejoin", true, "rejoin-w1b.err");
    int rc0 = wait_exit(w0, 120), rc1 = wait_exit(w1, 30), rcp = wait_exit(ps, 30);
    CHECK_MSG(rc0 == 0 && rc1 == 0 && rcp == 0,
              "rejoined job: exit codes worker 0 %d, worker 1 %d, ps %d (see rejoin-*.err)", rc0,
              rc1, rcp);
    free(out_text);
    free(err_text);
    psp_stop_all();
    return check_done();
}
