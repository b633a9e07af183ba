/*
 * Waits parked at shard 0 against a live `ember ps` (3 workers, staleness 0, no worker timeout,
 * so nothing is released behind the test's back): CLOCK and BARRIER requests it defers hold a
 * server context each until answered.
 *   - A flood of CLOCK requests with a far-future clock from one worker id, through a raw req
 *     socket, more than the server has contexts: each one but the last is answered with an
 *     error naming the worker and the bound, and counted in STATS (superseded); meanwhile
 *     another worker still pulls and pushes within a short timeout. The same for BARRIER.
 *   - The same request resent (same worker, op and request id, as nng or a failover resends
 *     it) takes its copy's place: the earlier copy is answered, only one stays parked.
 *   - A worker restarted while its wait was parked: the new client's wait replaces the old
 *     one and is released as usual once the others catch up.
 *   - Worker ids beyond the cluster's never park (refused at once), so the contexts parked are
 *     at most one clock and one barrier wait per worker; and shard 0 is refused a pool of
 *     contexts no larger than that.
 */
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <pthread.h>

#include "ps/wire.h"
#include "ps_test_util.h"
#include "req_flight.h"

static const char conf[] = "[cluster]\nshards = 1\nworkers = 3\nstaleness = 0\n"
                           "[table t]\ndim = 4\noptimizer = sgd\nlr = 1\ninit_scale = 0.1\n";

/* More than the server's 64 + 2 x workers contexts. */
#define FLOOD 300u
#define FAR_CLOCK 0xfffffff0u

typedef rf_flight flight;

static void flight_send(nng_socket sock, flight *f, uint16_t op, uint16_t worker, uint32_t clock,
                        uint64_t req_id)
{
    nng_msg *m;
    if (nng_msg_alloc(&m, PS_HDR_BYTES) != 0) pt_die("nng_msg_alloc", NULL);
    ps_hdr h;
    memset(&h, 0, sizeof h);
    h.op = op;
    h.worker = worker;
    h.clock = clock;
    h.req_id = req_id;
    memcpy(nng_msg_body(m), &h, sizeof h);
    ps_wire_seal(nng_msg_body(m), 0);
    if (rf_start(f, sock, m) != 0) pt_die("cannot open a context", NULL);
}

/* Waits until `want` of the n flights are at least at `stage` (1: sent, 2: answered) or
 * `seconds` pass; returns how many are. */
static uint32_t wait_for(flight *f, uint32_t n, uint32_t want, int stage, double seconds)
{
    const double end = cm_now() + seconds;
    uint32_t k;
    for (;;) {
        k = 0;
        for (uint32_t i = 0; i < n; i++)
            k += rf_stage(&f[i]) >= stage;
        if (k >= want || cm_now() > end) return k;
        psp_sleep_ms(5);
    }
}

static uint32_t wait_stage(flight *f, uint32_t n, int stage, double seconds)
{
    return wait_for(f, n, n, stage, seconds);
}

/* An answered flight's status (1 when it has no reply) and its error text. */
static int reply_of(flight *f, char *text, size_t cap)
{
    text[0] = '\0';
    nng_msg *rep = rf_reply(f);
    if (rep == NULL) return 1;
    ps_hdr h;
    char *err = NULL;
    int st = 1;
    if (ps_wire_open(nng_msg_body(rep), nng_msg_len(rep), &h, &err) == CM_OK) {
        st = h.status;
        ps_error_text((const uint8_t *)nng_msg_body(rep) + PS_HDR_BYTES, h.payload_len, text, cap);
    } else {
        snprintf(text, cap, "reply does not open: %s", err);
        free(err);
    }
    nng_msg_free(rep);
    return st;
}

/* A pull and a push of worker c, within its short timeout. */
static void serves(ps_client *c, const char *after)
{
    uint64_t keys[4] = {1, 2, 3, 4};
    float rows[16] = {0};
    char *err = NULL;
    const double t0 = cm_now();
    int rc = ps_client_pull(c, 0, keys, 4, rows, &err);
    if (rc == CM_OK) rc = ps_client_push(c, 0, keys, 4, rows, &err);
    if (rc == CM_OK) rc = ps_client_flush(c, &err);
    CHECK_MSG(rc == CM_OK, "pull and push after %s: %s", after, err ? err : "?");
    CHECK_MSG(cm_now() - t0 < 2.0, "pull and push after %s took %.2f s", after, cm_now() - t0);
    free(err);
}

/* Sends FLOOD requests of op from worker `worker` with request ids from id0 (all distinct), while
 * worker 0 keeps being served; all but one are answered with an error naming the worker and
 * the bound. Returns how many are answered with that error. */
static uint32_t flood(nng_socket raw, ps_client *c, uint16_t op, uint16_t worker, uint32_t clock,
                      uint64_t id0, const char *name)
{
    static flight f[FLOOD];
    for (uint32_t i = 0; i < FLOOD; i++)
        flight_send(raw, &f[i], op, worker, clock, id0 + i);
    CHECK_MSG(wait_stage(f, FLOOD, 1, 10.0) == FLOOD, "%s: not all sent", name);
    serves(c, name);
    uint32_t answered = wait_for(f, FLOOD, FLOOD - 1, 2, 5.0);
    psp_sleep_ms(50); /* the last one stays parked */
    answered = wait_stage(f, FLOOD, 2, 0);
    CHECK_MSG(answered == FLOOD - 1, "%s: %u of %u answered, want all but the one parked", name,
              answered, FLOOD);
    char text[512], want[64];
    snprintf(want, sizeof want, "worker %u", worker);
    uint32_t refused = 0;
    for (uint32_t i = 0; i < FLOOD; i++) {
        if (rf_stage(&f[i]) != 2) continue;
        int st = reply_of(&f[i], text, sizeof text);
        if (st < 0 && strstr(text, want) && strstr(text, "at most 1")) {
            refused++;
        } else if (refused == 0) {
            CHECK_MSG(0, "%s: request %u answered %d '%s'", name, i, st, text);
            refused = UINT32_MAX / 2; /* one report is enough */
        }
    }
    for (uint32_t i = 0; i < FLOOD; i++)
        rf_end(&f[i]);
    return refused;
}

static ps_server_stats server_stats(ps_client *c)
{
    ps_client_stats st;
    char *err = NULL;
    CHECK_OK(ps_client_stats_get(c, &st, &err), err);
    return st.shard_total;
}

static void *clock_thread(void *c)
{
    uint64_t clk = 0;
    char *err = NULL;
    int rc = ps_client_clock(c, &clk, &err);
    if (rc != CM_OK) fprintf(stderr, "restarted worker's clock: %s\n", err ? err : "?");
    free(err);
    return (void *)(intptr_t)(rc == CM_OK && clk == 1 ? 0 : 1);
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_parked");
    ps_config cfg;
    const char *config = pt_config(dir, "parked.ini", conf, &cfg);
    const char *urls[1] = {pt_ipc(dir, "ps0")};
    pid_t pid;
    pt_spawn_cluster(config, 1, urls, &pid);
    ps_client *c0 = pt_client(&cfg, urls, 0, 3000);
    nng_socket raw;
    CHECK(nng_req0_open(&raw) == 0);
    CHECK(nng_dial(raw, urls[0], NULL, 0) == 0);
    serves(c0, "start");
    const ps_server_stats a = server_stats(c0);

    /* Floods of CLOCK (worker 1, a clock no one reaches) and BARRIER (worker 2, a generation
     * the others never enter). */
    uint32_t n = flood(raw, c0, PS_OP_CLOCK, 1, FAR_CLOCK, 1000, "CLOCK flood");
    CHECK_MSG(n == FLOOD - 1, "CLOCK flood: %u refusals naming worker 1 and the bound", n);
    n = flood(raw, c0, PS_OP_BARRIER, 2, 5, 5000, "BARRIER flood");
    CHECK_MSG(n == FLOOD - 1, "BARRIER flood: %u refusals naming worker 2 and the bound", n);
    const ps_server_stats b = server_stats(c0);
    CHECK_MSG(b.superseded - a.superseded == 2 * (FLOOD - 1),
              "STATS superseded moved by %llu, want %u",
              (unsigned long long)(b.superseded - a.superseded), 2 * (FLOOD - 1));
    CHECK(b.errors - a.errors >= 2 * (FLOOD - 1));

    /* Worker ids beyond the cluster's are refused at once: they never park. */
    static flight s[FLOOD];
    for (uint32_t i = 0; i < FLOOD; i++)
        flight_send(raw, &s[i], PS_OP_CLOCK, (uint16_t)(3 + i), FAR_CLOCK, 9000 + i);
    CHECK_MSG(wait_stage(s, FLOOD, 2, 10.0) == FLOOD, "strangers' clocks not all answered");
    uint32_t strangers = 0;
    for (uint32_t i = 0; i < FLOOD; i++) {
        char text[512];
        strangers += reply_of(&s[i], text, sizeof text) < 0 && strstr(text, "known workers");
        rf_end(&s[i]);
    }
    CHECK_MSG(strangers == FLOOD, "%u of %u strangers refused", strangers, FLOOD);
    serves(c0, "strangers' clocks");

    /* A resend (same worker, op and request id): the earlier copy is answered, the resend
     * parks in its place. Worker 2 waits on clock 1 (worker 0 is at 0). */
    flight r[2];
    flight_send(raw, &r[0], PS_OP_CLOCK, 2, 1, 777);
    CHECK(wait_stage(&r[0], 1, 1, 5.0) == 1);
    psp_sleep_ms(100);
    CHECK_MSG(rf_stage(&r[0]) == 1, "worker 2's clock 1 was not deferred");
    flight_send(raw, &r[1], PS_OP_CLOCK, 2, 1, 777);
    CHECK_MSG(wait_stage(&r[0], 1, 2, 5.0) == 1, "the earlier copy of a resent clock unanswered");
    char text[512];
    int st = reply_of(&r[0], text, sizeof text);
    CHECK_MSG(st < 0 && strstr(text, "worker 2"), "earlier copy: %d '%s'", st, text);
    psp_sleep_ms(100);
    CHECK_MSG(rf_stage(&r[1]) == 1, "the resend was not deferred");

    /* Worker 2 restarts while its wait is parked: the new client's clock 1 replaces it, and
     * worker 0's clock 1 releases it. */
    ps_client *c2 = pt_client(&cfg, urls, 2, 5000);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, clock_thread, c2) == 0);
    CHECK_MSG(wait_stage(&r[1], 1, 2, 5.0) == 1, "the restarted worker's clock left the old one");
    st = reply_of(&r[1], text, sizeof text);
    CHECK_MSG(st < 0 && strstr(text, "worker 2"), "old wait: %d '%s'", st, text);
    uint64_t clk = 0;
    char *err = NULL;
    CHECK_OK(ps_client_clock(c0, &clk, &err), err);
    void *trc;
    pthread_join(th, &trc);
    CHECK_MSG(trc == NULL, "the restarted worker's clock failed");
    serves(c0, "the restart");
    rf_end(&r[0]);
    rf_end(&r[1]);

    nng_close(raw);
    ps_client_destroy(c2);
    ps_client_destroy(c0);
    CHECK(psp_stop(pid, SIGTERM, 10.0) == 0);

    /* Shard 0 with no more contexts than its workers' waits could hold them all, and leave
     * none to receive the request that releases them: refused; one more is enough. */
    ps_server_opts o = {.cfg = &cfg, .listen = pt_ipc(dir, "few"), .shard = 0, .n_contexts = 6};
    ps_server *few = NULL;
    err = NULL;
    CHECK(ps_server_create(&o, &few, &err) == CM_EINVAL && few == NULL);
    CHECK_MSG(err && strstr(err, "6 contexts") && strstr(err, "2 x workers"), "'%s'",
              err ? err : "");
    free(err);
    o.n_contexts = 7;
    ps_server_destroy(pt_server_with(&o));
    return pt_finish(dir);
}
