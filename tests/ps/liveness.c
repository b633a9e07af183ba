/*
 * Worker death: with worker_timeout set, shard 0 stops waiting for a worker that has gone
 * silent, so a barrier and a synchronous clock release the live workers instead of hanging;
 * a restarted worker learns the current barrier generation from HELLO and counts again.
 * Without the timeout the same barrier must still be waiting (the control: the release is the
 * timeout's doing). And ps_client_abort releases a waiting client at once. A busy worker is
 * never taken for a silent one, whatever moment the liveness thread looks at it.
 */
#include <pthread.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "ps_test_util.h"

/* The server's liveness thread (the one that sleeps 100 ms a round) is delayed this long right
 * after every clock reading while it is not 0 (the last section of main); the server's code
 * calls these two, not libc's. */
static int reaper_lag_ms;
static __thread int is_reaper;

int nanosleep(const struct timespec *req, struct timespec *rem)
{
    if (req->tv_sec == 0 && req->tv_nsec == 100 * 1000 * 1000) is_reaper = 1;
    return (int)syscall(SYS_nanosleep, req, rem);
}

int clock_gettime(clockid_t id, struct timespec *ts)
{
    int rc = (int)syscall(SYS_clock_gettime, id, ts);
    int lag = __atomic_load_n(&reaper_lag_ms, __ATOMIC_RELAXED);
    if (rc == 0 && is_reaper && lag > 0) {
        struct timespec d = {0, lag * 1000L * 1000L};
        syscall(SYS_nanosleep, &d, NULL);
    }
    return rc;
}

static void *enter_barrier(void *c)
{
    return (void *)(intptr_t)ps_client_barrier(c, NULL);
}

static void *enter_clock(void *c)
{
    return (void *)(intptr_t)ps_client_clock(c, NULL, NULL);
}

static int clock_returned;

static void *enter_clock_noting(void *c)
{
    void *rc = enter_clock(c);
    __atomic_store_n(&clock_returned, 1, __ATOMIC_RELEASE);
    return rc;
}

/* Worker c calls fn (enter_barrier, enter_clock) on a thread of its own (the call blocks until
 * the others let it through). */
static pthread_t run_async(ps_client *c, void *(*fn)(void *))
{
    pthread_t th;
    if (pthread_create(&th, NULL, fn, c) != 0) pt_die("pthread_create", NULL);
    return th;
}

static pthread_t barrier_async(ps_client *c)
{
    return run_async(c, enter_barrier);
}

static int joined(pthread_t th)
{
    void *ret;
    pthread_join(th, &ret);
    return (int)(intptr_t)ret;
}

#define CONF                                                                                       \
    "[cluster]\nshards = 1\nworkers = 2\nstaleness = 0\n%s\n[table t]\ndim = 4\noptimizer = sgd\n"

static double barrier_seconds(ps_client *c, int *rc)
{
    char *err = NULL;
    double t0 = cm_now();
    *rc = ps_client_barrier(c, &err);
    if (*rc != CM_OK) fprintf(stderr, "barrier: %s\n", err ? err : "?");
    free(err);
    return cm_now() - t0;
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_liveness");
    char text[512];
    ps_config cfg, cfg_forever;
    snprintf(text, sizeof text, CONF, "worker_timeout = 400");
    pt_config(dir, "live.ini", text, &cfg);
    snprintf(text, sizeof text, CONF, "");
    pt_config(dir, "forever.ini", text, &cfg_forever);
    CHECK(cfg.worker_timeout_ms == 400 && cfg_forever.worker_timeout_ms == 0);

    const char *urls[1] = {pt_ipc(dir, "ps0")};
    ps_server *s = pt_server(&cfg, urls[0], 0);
    ps_client *a = pt_client(&cfg, urls, 0, 5000);
    ps_client *b = pt_client(&cfg, urls, 1, 5000);
    int rc;
    /* Both alive: a barrier needs both. */
    pthread_t th = barrier_async(b);
    double t = barrier_seconds(a, &rc);
    CHECK_MSG(rc == CM_OK && t < 0.3, "live barrier took %.3f s", t);
    CHECK(joined(th) == CM_OK);
    /* b goes silent: a's barrier and clocks are released once b has been quiet 400 ms. */
    ps_client_destroy(b);
    t = barrier_seconds(a, &rc);
    CHECK_MSG(rc == CM_OK && t > 0.2 && t < 3.0, "barrier with a dead worker took %.3f s", t);
    char *err = NULL;
    uint64_t clk = 0;
    double t0 = cm_now();
    for (int i = 0; i < 3; i++)
        CHECK_OK(ps_client_clock(a, &clk, &err), err);
    CHECK_MSG(clk == 3 && cm_now() - t0 < 3.0, "clocks without the dead worker: %llu in %.3f s",
              (unsigned long long)clk, cm_now() - t0);
    /* b restarts: HELLO tells it the generation, and the barrier needs it again. */
    b = pt_client(&cfg, urls, 1, 5000);
    th = barrier_async(b);
    t = barrier_seconds(a, &rc);
    CHECK_MSG(rc == CM_OK && t < 0.3, "barrier with the restarted worker took %.3f s", t);
    CHECK_MSG(joined(th) == CM_OK, "the restarted worker's barrier failed");
    ps_client_destroy(a);
    ps_client_destroy(b);
    ps_server_destroy(s);

    /* Control: no timeout, the dead worker holds the barrier (it times out client-side). */
    const char *urls2[1] = {pt_ipc(dir, "ps1")};
    s = pt_server(&cfg_forever, urls2[0], 0);
    a = pt_client(&cfg_forever, urls2, 0, 150);
    t = barrier_seconds(a, &rc);
    CHECK_MSG(rc != CM_OK, "a barrier with a silent worker and no timeout returned (%.3f s)", t);
    ps_client_destroy(a);
    ps_server_destroy(s);

    /* Barrier ids: a worker restarted in the middle of a checkpoint (between its two barriers)
     * asks again for the first one, which has completed: it passes at once and meets the other
     * at the second, instead of pairing its first with the other's second. */
    const char *urls3[1] = {pt_ipc(dir, "ps2")};
    s = pt_server(&cfg_forever, urls3[0], 0);
    a = pt_client(&cfg_forever, urls3, 0, 5000);
    b = pt_client(&cfg_forever, urls3, 1, 5000);
    ps_client_barrier_seek(a, 20);
    ps_client_barrier_seek(b, 20);
    th = barrier_async(b);
    t = barrier_seconds(a, &rc); /* both through barrier 20 */
    CHECK(rc == CM_OK && joined(th) == CM_OK);
    ps_client_destroy(b);
    th = barrier_async(a); /* a waits at 21 */
    b = pt_client(&cfg_forever, urls3, 1, 5000);
    ps_client_barrier_seek(b, 20);
    t = barrier_seconds(b, &rc);
    CHECK_MSG(rc == CM_OK && t < 0.3, "a completed barrier took %.3f s for the restarted worker",
              t);
    t = barrier_seconds(b, &rc); /* 21: releases a */
    CHECK_MSG(rc == CM_OK && joined(th) == CM_OK && t < 1.0, "barrier 21 after the restart: %.3f s",
              t);
    /* A worker asking for 23 while the other waits at 22 proves 22 complete. */
    th = barrier_async(a); /* 22 */
    usleep(100000);
    ps_client_barrier_seek(b, 23);
    pthread_t th2 = barrier_async(b);
    CHECK_MSG(joined(th) == CM_OK, "barrier 22 was not released by a worker at 23");
    t = barrier_seconds(a, &rc); /* 23 */
    CHECK(rc == CM_OK && joined(th2) == CM_OK);
    ps_client_destroy(a);
    ps_client_destroy(b);
    ps_server_destroy(s);

    /* ps_client_abort: a waits at a barrier the silent b never enters (no timeout: it would
     * wait 20 x 5 s); aborted from another thread it returns CM_ECANCELED at once, and so does
     * every later request, without hanging; the client is still destroyed cleanly. */
    const char *urls4[1] = {pt_ipc(dir, "ps3")};
    s = pt_server(&cfg_forever, urls4[0], 0);
    a = pt_client(&cfg_forever, urls4, 0, 5000);
    th = barrier_async(a);
    usleep(200000);
    t0 = cm_now();
    ps_client_abort(a);
    rc = joined(th);
    t = cm_now() - t0;
    CHECK_MSG(rc == CM_ECANCELED && t < 1.0, "an aborted barrier returned %d after %.3f s", rc, t);
    float row[4] = {0};
    uint64_t key = 7;
    t0 = cm_now();
    rc = ps_client_pull(a, 0, &key, 1, row, &err);
    CHECK_MSG(rc == CM_ECANCELED && err && strstr(err, "aborted") && cm_now() - t0 < 1.0,
              "a pull after the abort: %d (%s)", rc, err ? err : "no message");
    free(err);
    err = NULL;
    rc = ps_client_push(a, 0, &key, 1, row, &err);
    rc = rc == CM_OK ? ps_client_flush(a, &err) : rc;
    CHECK_MSG(rc == CM_ECANCELED, "a push after the abort: %d (%s)", rc, err ? err : "no message");
    free(err);
    err = NULL;
    ps_client_destroy(a);
    ps_server_destroy(s);

    /* A worker whose clock is deferred sends nothing while it waits, so it goes silent too.
     * b's clock 2 waits for a at 0 (staleness 1); a is seen after b, so b times out first and a
     * last. Then no live worker holds the clock back and b is released (the slowest live clock
     * is UINT64_MAX: plus the staleness it once wrapped to 0, and b waited for good). Found by
     * tests/fuzz_ps/fuzz_server. */
    ps_config cfg_stale;
    pt_config(dir, "stale.ini",
              "[cluster]\nshards = 1\nworkers = 2\nstaleness = 1\nworker_timeout = 200\n"
              "[table t]\ndim = 4\noptimizer = sgd\n",
              &cfg_stale);
    const char *urls5[1] = {pt_ipc(dir, "ps4")};
    s = pt_server(&cfg_stale, urls5[0], 0);
    a = pt_client(&cfg_stale, urls5, 0, 1000);
    b = pt_client(&cfg_stale, urls5, 1, 1000);
    CHECK_OK(ps_client_clock(b, &clk, &err), err); /* 1: within the staleness of a's 0 */
    th = run_async(b, enter_clock);                /* 2: waits for a */
    usleep(50000);
    CHECK_OK(ps_client_pull(a, 0, &key, 1, row, &err), err); /* a is seen after b */
    t0 = cm_now();
    rc = joined(th);
    t = cm_now() - t0;
    CHECK_MSG(rc == CM_OK && t < 3.0,
              "a clock waiting once every worker was silent: %d after %.3f s", rc, t);
    ps_client_destroy(a);
    ps_client_destroy(b);
    ps_server_destroy(s);

    /* A server asked to stop (a SHUTDOWN, ps_server_stop) serves until it is destroyed, and
     * so must release what a silent worker holds: the liveness thread once ended at the stop,
     * and a clock deferred after it waited for good. Found by tests/fuzz_ps/fuzz_server. */
    const char *urls6[1] = {pt_ipc(dir, "ps5")};
    s = pt_server(&cfg_stale, urls6[0], 0);
    a = pt_client(&cfg_stale, urls6, 0, 3000);
    b = pt_client(&cfg_stale, urls6, 1, 3000);
    CHECK_OK(ps_client_clock(b, &clk, &err), err); /* 1 */
    ps_server_stop(s);
    t0 = cm_now();
    th = run_async(b, enter_clock_noting); /* 2: waits for the silent a */
    while (!__atomic_load_n(&clock_returned, __ATOMIC_ACQUIRE) && cm_now() - t0 < 2.0)
        usleep(10000);
    t = cm_now() - t0;
    if (!__atomic_load_n(&clock_returned, __ATOMIC_ACQUIRE)) ps_client_abort(b); /* bounded */
    rc = joined(th);
    CHECK_MSG(rc == CM_OK && t < 2.0, "a clock deferred after the stop: %d after %.3f s", rc, t);
    ps_client_destroy(a);
    ps_client_destroy(b);
    ps_server_destroy(s);

    /* A worker that sends requests all along is alive. The liveness thread read the clock,
     * then the worker's last request time: one stored between the two, stamped after the
     * clock it had read, made now - last_seen wrap to nearly 2^64 ms, past any timeout, and
     * the busy worker counted as dead: a synchronous clock (or a barrier: a checkpoint's cut)
     * went on without it. The window is a few instructions, or as long as the thread is
     * descheduled there on a busy host; here it is delayed 20 ms after each clock reading. b
     * pulls all along (at clock 0), so a's clock 1 (staleness 0) must wait for b's. */
    ps_config cfg_busy;
    pt_config(dir, "busy.ini",
              "[cluster]\nshards = 1\nworkers = 2\nstaleness = 0\nworker_timeout = 60000\n"
              "[table t]\ndim = 4\noptimizer = sgd\n",
              &cfg_busy);
    const char *urls7[1] = {pt_ipc(dir, "ps6")};
    s = pt_server(&cfg_busy, urls7[0], 0);
    a = pt_client(&cfg_busy, urls7, 0, 5000);
    b = pt_client(&cfg_busy, urls7, 1, 5000);
    __atomic_store_n(&clock_returned, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&reaper_lag_ms, 20, __ATOMIC_RELAXED);
    th = run_async(a, enter_clock_noting);
    t0 = cm_now();
    while (!__atomic_load_n(&clock_returned, __ATOMIC_ACQUIRE) && cm_now() - t0 < 1.5)
        CHECK_OK(ps_client_pull(b, 0, &key, 1, row, &err), err);
    const int early = __atomic_load_n(&clock_returned, __ATOMIC_ACQUIRE);
    __atomic_store_n(&reaper_lag_ms, 0, __ATOMIC_RELAXED);
    CHECK_MSG(!early, "a's clock 1 passed after %.3f s while b, at clock 0, was busy pulling",
              cm_now() - t0);
    CHECK_OK(ps_client_clock(b, &clk, &err), err); /* b's 1 lets a's through */
    CHECK(joined(th) == CM_OK);
    ps_client_destroy(a);
    ps_client_destroy(b);
    ps_server_destroy(s);
    return pt_finish(dir);
}
