/*
 * CLOCK requests far ahead, against a live shard 0 (2 workers, no worker timeout):
 *   - hostile: a CLOCK under worker 1's id far past its last clock (0xffffff01, as a corrupt or
 *     hostile sender would send) is refused with an error, counted in STATS bad_messages, and
 *     changes nothing: worker 1 still holds worker 0 back (staleness 0), and shard 0 goes on
 *     serving. Before, it set worker 1's clock there for good (the highest clock is kept): from
 *     then on worker 0 was never held back again;
 *   - the same far clock as a worker's first clock here, once another has clocked: refused;
 * and the legitimate jumps are all accepted:
 *   - a job resumed from a checkpoint (every worker seeks to its position, the PS process is
 *     fresh: clocks 0): the first clocks, 5001, thousands past anything this process saw;
 *   - a worker rejoined at its progress note (its next clock);
 *   - clients failed over to a backup, which never sees a CLOCK (only updates are replicated),
 *     so it knows what a fresh process knows: a worker k + 1 ahead of the other (staleness k =
 *     2, as the old primary allowed) sends its first clock there.
 */
#include <pthread.h>

#include "ps_test_util.h"

typedef struct clock_call {
    ps_client *c;
    pthread_t th;
    int rc, done;
    uint64_t clk;
    char *err;
} clock_call;

static void *clock_main(void *arg)
{
    clock_call *k = arg;
    k->rc = ps_client_clock(k->c, &k->clk, &k->err);
    __atomic_store_n(&k->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

/* Starts c's next clock on a thread of its own (it blocks until the others let it through). */
static void clock_start(clock_call *k, ps_client *c)
{
    memset(k, 0, sizeof *k);
    k->c = c;
    if (pthread_create(&k->th, NULL, clock_main, k) != 0) pt_die("pthread_create", NULL);
}

/* Whether the clock returned within ms. */
static bool clock_within(clock_call *k, unsigned ms)
{
    for (double end = cm_now() + ms / 1000.0; cm_now() < end; psp_sleep_ms(5))
        if (__atomic_load_n(&k->done, __ATOMIC_ACQUIRE)) return true;
    return __atomic_load_n(&k->done, __ATOMIC_ACQUIRE) != 0;
}

/* Joins the clock: its rc; err (if any) printed and freed. */
static int clock_join(clock_call *k, const char *what)
{
    pthread_join(k->th, NULL);
    if (k->rc != CM_OK) fprintf(stderr, "%s: %s\n", what, k->err ? k->err : "?");
    free(k->err);
    k->err = NULL;
    return k->rc;
}

static uint64_t bad_messages(ps_client *c)
{
    ps_client_stats st;
    char *err = NULL;
    CHECK_OK(ps_client_stats_get(c, &st, &err), err);
    return st.shard_total.bad_messages;
}

/* Worker a's and b's next clocks together; both must pass. */
static void clock_both(ps_client *a, ps_client *b, uint64_t want, const char *what)
{
    clock_call ka, kb;
    clock_start(&ka, a);
    clock_start(&kb, b);
    CHECK_MSG(clock_within(&ka, 5000) && clock_within(&kb, 5000), "%s: clocks hang", what);
    CHECK_MSG(clock_join(&ka, what) == CM_OK && clock_join(&kb, what) == CM_OK, "%s failed", what);
    CHECK_MSG(ka.clk == want && kb.clk == want, "%s: clocks %llu and %llu, want %llu", what,
              (unsigned long long)ka.clk, (unsigned long long)kb.clk, (unsigned long long)want);
}

#define CONF                                                                                       \
    "[cluster]\nshards = 1\nworkers = 2\nstaleness = %d\n[table t]\ndim = 4\noptimizer = sgd\n"

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_clock_jump");
    char text[256];
    ps_config cfg, cfg2;
    snprintf(text, sizeof text, CONF, 0);
    pt_config(dir, "k0.ini", text, &cfg);
    snprintf(text, sizeof text, CONF, 2);
    pt_config(dir, "k2.ini", text, &cfg2);

    /* A resumed job on a fresh PS process: both workers continue at batch 5000. */
    const char *urls[1] = {pt_ipc(dir, "ps0")};
    ps_server *s = pt_server(&cfg, urls[0], 0);
    ps_client *a = pt_client(&cfg, urls, 0, 2000), *b = pt_client(&cfg, urls, 1, 2000);
    ps_client_clock_seek(a, 5000);
    ps_client_clock_seek(b, 5000);
    clock_both(a, b, 5001, "resumed clocks at 5001");
    clock_both(a, b, 5002, "clocks 5002");

    /* Hostile: worker 1's id, far ahead. */
    const uint64_t bad0 = bad_messages(a);
    ps_client *rogue = pt_client(&cfg, urls, 1, 2000);
    ps_client_clock_seek(rogue, 0xffffff00u);
    clock_call kr;
    clock_start(&kr, rogue);
    bool answered = clock_within(&kr, 2000);
    CHECK_MSG(answered, "a far-future clock was parked, not refused");
    /* Worker 0's clock 5003 must wait for worker 1's. */
    clock_call ka, kb;
    clock_start(&ka, a);
    CHECK_MSG(!clock_within(&ka, 300),
              "worker 0's clock 5003 passed while worker 1 is at 5002: the far clock counted");
    clock_start(&kb, b);
    CHECK_MSG(clock_within(&ka, 5000) && clock_within(&kb, 5000), "clocks 5003 hang");
    CHECK(clock_join(&ka, "worker 0's clock 5003") == CM_OK);
    CHECK(clock_join(&kb, "worker 1's clock 5003") == CM_OK);
    pthread_join(kr.th, NULL);
    CHECK_MSG(kr.rc == CM_EINVAL && kr.err && strstr(kr.err, "worker 1") &&
                  strstr(kr.err, "ahead of its last clock here (5002)"),
              "far clock: rc %d, '%s'", kr.rc, kr.err ? kr.err : "");
    free(kr.err);
    CHECK_MSG(bad_messages(a) == bad0 + 1, "bad_messages %llu, want %llu",
              (unsigned long long)bad_messages(a), (unsigned long long)(bad0 + 1));
    ps_client_destroy(rogue);

    /* Worker 1 dies and rejoins at its progress note, batch 5003 (the one after its last
     * clock): its first clock is the next one. */
    ps_client_destroy(b);
    b = pt_client(&cfg, urls, 1, 2000);
    ps_client_clock_seek(b, 5003);
    clock_both(a, b, 5004, "the rejoined worker's clock 5004");
    ps_client_destroy(a);
    ps_client_destroy(b);
    ps_server_destroy(s);

    /* Failover (a backup knows no clocks, as a fresh process): worker 0 comes over at 7001,
     * worker 1 at 7004 = 7001 + staleness 2 + 1; a far first clock under worker 1's id is
     * refused once worker 0 has clocked. */
    const char *urls2[1] = {pt_ipc(dir, "ps1")};
    s = pt_server(&cfg2, urls2[0], 0);
    a = pt_client(&cfg2, urls2, 0, 2000);
    b = pt_client(&cfg2, urls2, 1, 2000);
    rogue = pt_client(&cfg2, urls2, 1, 2000);
    ps_client_clock_seek(a, 7000);
    ps_client_clock_seek(b, 7003);
    ps_client_clock_seek(rogue, 0xffffff00u);
    clock_start(&ka, a); /* parks: worker 1 has not clocked here */
    CHECK_MSG(!clock_within(&ka, 200), "worker 0's first clock did not wait for worker 1");
    clock_start(&kr, rogue);
    CHECK_MSG(clock_within(&kr, 2000), "a far first clock was parked, not refused");
    pthread_join(kr.th, NULL);
    CHECK_MSG(kr.rc == CM_EINVAL, "far first clock: rc %d, '%s'", kr.rc, kr.err ? kr.err : "");
    free(kr.err);
    clock_start(&kb, b); /* 7004: accepted, parks until worker 0 is at 7002 */
    CHECK_MSG(clock_within(&ka, 5000), "worker 0's 7001 was not released by worker 1's 7004");
    CHECK(clock_join(&ka, "worker 0's 7001") == CM_OK);
    clock_start(&ka, a);
    CHECK_MSG(clock_within(&ka, 5000) && clock_within(&kb, 5000), "clocks 7002 and 7004 hang");
    CHECK(clock_join(&ka, "worker 0's 7002") == CM_OK);
    CHECK_MSG(clock_join(&kb, "worker 1's first clock 7004") == CM_OK && kb.clk == 7004,
              "worker 1's first clock here, k + 1 ahead of worker 0's, refused");
    ps_client_destroy(rogue);
    ps_client_destroy(a);
    ps_client_destroy(b);
    ps_server_destroy(s);
    return pt_finish(dir);
}
