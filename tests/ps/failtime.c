/*
 * A shard that cannot answer fails a call within about the client's timeout (T), failover
 * included, with an error naming the shard and every URL it was tried at. In-process servers
 * and raw nng sockets over ipc://; a "silent" server is a rep socket that accepts connections
 * and never answers (a hung process), a dead one is nothing listening.
 *   1. Silent primary, dead backup: the primary's attempt and the backup's share T (each used
 *      to get a full T, so the call took 2T).
 *   2. Primary and backup both dead when the client starts: HELLO fails within T.
 *   3. Both die after the client has worked with them: a pull fails within T naming both URLs.
 *   4. Silent primary, live backup: the call still fails over and succeeds within T.
 *   5. No backup, the shard's listener comes back (silent) late in the call: sending waited for
 *      a connection and then the reply got a fresh T of its own; now the call keeps one T.
 *   6. A pull behind a push to a dead shard: it waited for the push (T), then sent its own
 *      request (another T); now it reports the push's failure once the wait is over.
 *   7. A checkpoint whose first barrier times out (another worker never comes, as when it died
 *      with a PS): the worker then waited at the second barrier for the whole barrier timeout
 *      (20 T) again, so a job with one PS killed or stopped held its workers 2 x 20 T; now the
 *      call fails after one barrier timeout, and says that the barrier waits for every worker
 *      (it read as if shard 0 were not running). T = 200 ms here (4 s a barrier).
 *   8. A primary that answers HELLO and then goes silent, live backup: a barrier (a request
 *      nng does not resend by itself) is given up on the primary and sent to the backup, and
 *      passes there. Its resend went out on the primary's connection, still open until the
 *      failover closed it, and that close failed the call ("connection reset") with the backup
 *      up. T = 200 ms here (4 s a barrier, 2 s of it for the primary).
 *   9. A long T (2^31 / 20 ms or more, about 30 hours: a job that would rather wait out a slow
 *      peer than fail) still waits: the call's timeout was an int32 of milliseconds, and the
 *      20 T of a barrier (or T itself from 2^31 ms on) wrapped negative, a deadline already
 *      past, so every barrier failed at once while the other worker was on its way.
 * Bounds are 1.5 T against 2 T or more before, with T = 2 s: wide enough for a loaded machine.
 */
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <pthread.h>

#include "ps/wire.h"
#include "ps_test_util.h"

#define T_MS 2000u
#define BOUND_S (1.5 * T_MS / 1000.0)

static const char conf[] = "[cluster]\nshards = 1\nworkers = 1\nreplica_timeout = 20000\n"
                           "[table t]\ndim = 4\noptimizer = sgd\nlr = 1\ninit_scale = 0\n";

/* A rep socket listening on url that never answers. */
static nng_socket silent_at(const char *url)
{
    nng_socket s;
    if (nng_rep0_open(&s) != 0 || nng_listen(s, url, NULL, 0) != 0)
        pt_die("silent listener", strdup(url));
    return s;
}

static int client_at(const ps_config *cfg, const char *url, const char *backup, ps_client **c,
                     char **err)
{
    const char *urls[1] = {url}, *backups[1] = {backup};
    ps_client_opts o = {
        .cfg = cfg, .urls = urls, .timeout_ms = T_MS, .backup_urls = backup ? backups : NULL};
    *c = NULL;
    return ps_client_create(&o, c, err);
}

/* A failed call took at most BOUND_S and its error names shard 0 and the URLs given. */
static void check_failed(const char *what, int rc, double took, const char *err, const char *u1,
                         const char *u2)
{
    CHECK_MSG(rc != CM_OK, "%s: succeeded", what);
    CHECK_MSG(took < BOUND_S, "%s: failed after %.2f s, want under %.1f s (timeout %.1f s)", what,
              took, BOUND_S, T_MS / 1000.0);
    const char *e = err ? err : "";
    CHECK_MSG(strstr(e, "shard 0") && strstr(e, u1) && (!u2 || strstr(e, u2)),
              "%s: error does not name shard 0 and %s%s%s: %s", what, u1, u2 ? " and " : "",
              u2 ? u2 : "", e);
    fprintf(stderr, "%s: %.2f s: %s\n", what, took, e);
}

static void silent_primary_dead_backup(const ps_config *cfg, const char *dir)
{
    const char *pu = pt_ipc(dir, "p1"), *bu = pt_ipc(dir, "b1");
    nng_socket p = silent_at(pu);
    ps_client *c;
    char *err = NULL;
    double t0 = cm_now();
    int rc = client_at(cfg, pu, bu, &c, &err);
    check_failed("silent primary, dead backup", rc, cm_now() - t0, err, pu, bu);
    free(err);
    ps_client_destroy(c);
    nng_close(p);
}

static void both_dead_at_start(const ps_config *cfg, const char *dir)
{
    const char *pu = pt_ipc(dir, "p2"), *bu = pt_ipc(dir, "b2");
    ps_client *c;
    char *err = NULL;
    double t0 = cm_now();
    int rc = client_at(cfg, pu, bu, &c, &err);
    check_failed("both dead at start", rc, cm_now() - t0, err, pu, bu);
    free(err);
    ps_client_destroy(c);
}

static void both_die(const ps_config *cfg, const char *dir)
{
    const char *pu = pt_ipc(dir, "p3"), *bu = pt_ipc(dir, "b3");
    ps_server *b = pt_server_repl(cfg, bu, NULL, true), *p = pt_server_repl(cfg, pu, bu, false);
    ps_client *c;
    char *err = NULL;
    if (client_at(cfg, pu, bu, &c, &err) != CM_OK) pt_die("client", err);
    uint64_t key = 5;
    float g[4] = {1, 1, 1, 1}, row[4];
    CHECK_OK(ps_client_push(c, 0, &key, 1, g, &err), err);
    CHECK_OK(ps_client_pull(c, 0, &key, 1, row, &err), err);
    ps_server_destroy(p);
    ps_server_destroy(b);
    double t0 = cm_now();
    int rc = ps_client_pull(c, 0, &key, 1, row, &err);
    check_failed("both die", rc, cm_now() - t0, err, pu, bu);
    free(err);
    ps_client_destroy(c);
}

static void silent_primary_live_backup(const ps_config *cfg, const char *dir)
{
    const char *pu = pt_ipc(dir, "p4"), *bu = pt_ipc(dir, "b4");
    nng_socket p = silent_at(pu);
    ps_server *b = pt_server_repl(cfg, bu, NULL, true);
    ps_client *c;
    char *err = NULL;
    double t0 = cm_now();
    int rc = client_at(cfg, pu, bu, &c, &err);
    double took = cm_now() - t0;
    CHECK_MSG(rc == CM_OK, "silent primary, live backup: %s", err ? err : "?");
    CHECK_MSG(took < BOUND_S, "silent primary, live backup: HELLO took %.2f s", took);
    free(err);
    err = NULL;
    if (rc == CM_OK) {
        uint64_t key = 9;
        float row[4];
        CHECK_OK(ps_client_pull(c, 0, &key, 1, row, &err), err);
        ps_client_stats st;
        CHECK_OK(ps_client_stats_get(c, &st, &err), err);
        CHECK_MSG(st.failovers == 1, "failovers %llu, want 1", (unsigned long long)st.failovers);
    }
    ps_client_destroy(c);
    ps_server_destroy(b);
    nng_close(p);
}

/* A client of a shard without backup at url that has just gone away. */
static ps_client *client_of_gone(const ps_config *cfg, const char *url)
{
    ps_server *s = pt_server_repl(cfg, url, NULL, false);
    ps_client *c;
    char *err = NULL;
    if (client_at(cfg, url, NULL, &c, &err) != CM_OK) pt_die("client", err);
    ps_server_destroy(s);
    return c;
}

typedef struct late {
    const char *url;
    nng_socket sock;
} late;

static void *listen_late(void *arg)
{
    late *l = arg;
    psp_sleep_ms(T_MS * 9 / 10);
    l->sock = silent_at(l->url);
    return NULL;
}

static void late_listener(const ps_config *cfg, const char *dir)
{
    const char *u = pt_ipc(dir, "s5");
    ps_client *c = client_of_gone(cfg, u);
    char *err = NULL;
    late l = {.url = u};
    pthread_t th;
    if (pthread_create(&th, NULL, listen_late, &l) != 0) pt_die("pthread_create", NULL);
    uint64_t key = 5;
    float row[4];
    double t0 = cm_now();
    int rc = ps_client_pull(c, 0, &key, 1, row, &err);
    check_failed("listener back late", rc, cm_now() - t0, err, u, NULL);
    free(err);
    pthread_join(th, NULL);
    ps_client_destroy(c);
    nng_close(l.sock);
}

static void pull_behind_push(const ps_config *cfg, const char *dir)
{
    const char *u = pt_ipc(dir, "s6");
    ps_client *c = client_of_gone(cfg, u);
    char *err = NULL;
    uint64_t key = 5;
    float g[4] = {1, 1, 1, 1}, row[4];
    double t0 = cm_now();
    CHECK_OK(ps_client_push(c, 0, &key, 1, g, &err), err); /* queued: fails later */
    int rc = ps_client_pull(c, 0, &key, 1, row, &err);
    check_failed("pull behind a push", rc, cm_now() - t0, err, u, NULL);
    free(err);
    ps_client_destroy(c);
}

/* Worker 1 of 2 checkpoints alone on a live shard 0: its first barrier times out. */
static void checkpoint_alone(const char *dir)
{
    const uint32_t t_ms = 200;
    const double barrier_s = 20 * t_ms / 1000.0;
    ps_config cfg;
    pt_config(dir, "failtime2.ini",
              "[cluster]\nshards = 1\nworkers = 2\n"
              "[table t]\ndim = 4\noptimizer = sgd\nlr = 1\ninit_scale = 0\n",
              &cfg);
    const char *u = pt_ipc(dir, "s7"), *urls[1] = {u};
    ps_server *srv = pt_server(&cfg, u, 0);
    ps_client *c = pt_client(&cfg, urls, 1, t_ms);
    char *err = NULL;
    double t0 = cm_now();
    int rc = ps_client_save(c, pt_path(dir, "ckpt7"), &err);
    double s = cm_now() - t0;
    CHECK_MSG(rc != CM_OK, "checkpoint without worker 0: succeeded");
    CHECK_MSG(s < 1.5 * barrier_s,
              "checkpoint without worker 0: failed after %.2f s, want under %.1f s (one "
              "barrier timeout is %.1f s)",
              s, 1.5 * barrier_s, barrier_s);
    CHECK_MSG(err && strstr(err, "shard 0") && strstr(err, u),
              "error does not name shard 0 and %s: %s", u, err ? err : "");
    /* Shard 0 is up: the error must say that the barrier waits for the other workers. */
    CHECK_MSG(err && strstr(err, "barrier") && strstr(err, "every worker"),
              "error does not say that the barrier waits for every worker: %s", err ? err : "");
    fprintf(stderr, "checkpoint without worker 0: %.2f s: %s\n", s, err ? err : "");
    free(err);
    ps_client_destroy(c);
    ps_server_destroy(srv);
}

/* Answers the first request on s (a HELLO: the barrier generation 1), then nothing more. */
static void *answer_hello(void *arg)
{
    nng_socket *s = arg;
    nng_msg *m;
    if (nng_recvmsg(*s, &m, 0) != 0) return NULL;
    ps_hdr h;
    memcpy(&h, nng_msg_body(m), sizeof h);
    uint64_t gen = 1;
    if (nng_msg_realloc(m, PS_HDR_BYTES + 8) != 0) pt_die("nng_msg_realloc", NULL);
    memcpy((uint8_t *)nng_msg_body(m) + PS_HDR_BYTES, &gen, 8);
    memcpy(nng_msg_body(m), &h, sizeof h);
    ps_wire_seal(nng_msg_body(m), 8);
    if (nng_sendmsg(*s, m, 0) != 0) nng_msg_free(m);
    return NULL;
}

static void silent_after_hello(const ps_config *cfg, const char *dir)
{
    const uint32_t t_ms = 200;
    const char *pu = pt_ipc(dir, "p8"), *bu = pt_ipc(dir, "b8"), *urls[1] = {pu},
               *backups[1] = {bu};
    nng_socket p = silent_at(pu);
    nng_socket_set_ms(p, NNG_OPT_RECVTIMEO, 10000);
    pthread_t th;
    if (pthread_create(&th, NULL, answer_hello, &p) != 0) pt_die("pthread_create", NULL);
    ps_server *b = pt_server_repl(cfg, bu, NULL, true);
    ps_client_opts o = {.cfg = cfg, .urls = urls, .timeout_ms = t_ms, .backup_urls = backups};
    ps_client *c = pt_client_with(&o);
    pthread_join(th, NULL);
    char *err = NULL;
    double t0 = cm_now();
    int rc = ps_client_barrier(c, &err);
    double took = cm_now() - t0;
    CHECK_MSG(rc == CM_OK,
              "barrier with a silent primary and a live backup failed after %.2f s: %s", took,
              err ? err : "?");
    free(err);
    ps_server_stats bs;
    ps_server_stats_get(b, &bs);
    CHECK_MSG(bs.promoted == 1, "the backup did not take over");
    ps_client_destroy(c);
    ps_server_destroy(b);
    nng_close(p);
}

/* Two workers with a long timeout: b enters a barrier 300 ms after a, whose barrier must wait
 * for it and pass. */
static void *late_barrier(void *arg)
{
    usleep(300000);
    return (void *)(intptr_t)ps_client_barrier(arg, NULL);
}

static void long_timeout(const char *dir)
{
    ps_config cfg;
    pt_config(dir, "failtime3.ini",
              "[cluster]\nshards = 1\nworkers = 2\n"
              "[table t]\ndim = 4\noptimizer = sgd\nlr = 1\ninit_scale = 0\n",
              &cfg);
    const char *u = pt_ipc(dir, "s9"), *urls[1] = {u};
    ps_server *srv = pt_server(&cfg, u, 0);
    const uint32_t longs[] = {200u * 1000 * 1000, 3000u * 1000 * 1000, UINT32_MAX};
    for (size_t i = 0; i < sizeof longs / sizeof longs[0]; i++) {
        ps_client *a = NULL, *b = NULL;
        char *err = NULL;
        ps_client_opts o = {.cfg = &cfg, .urls = urls, .timeout_ms = longs[i]};
        int rc = ps_client_create(&o, &a, &err);
        CHECK_MSG(rc == CM_OK, "timeout %u ms: client 0: %s", longs[i], err ? err : "");
        free(err), err = NULL;
        o.worker = 1;
        if (rc == CM_OK) rc = ps_client_create(&o, &b, &err);
        CHECK_MSG(rc == CM_OK, "timeout %u ms: client 1: %s", longs[i], err ? err : "");
        free(err), err = NULL;
        if (rc != CM_OK) {
            ps_client_destroy(a);
            continue;
        }
        pthread_t th;
        if (pthread_create(&th, NULL, late_barrier, b) != 0) pt_die("pthread_create", NULL);
        double t0 = cm_now();
        rc = ps_client_barrier(a, &err);
        double t = cm_now() - t0;
        void *brc;
        pthread_join(th, &brc);
        CHECK_MSG(rc == CM_OK && (int)(intptr_t)brc == CM_OK && t > 0.2,
                  "timeout %u ms: a barrier the other worker enters 300 ms later: %d after %.3f s "
                  "(%s)",
                  longs[i], rc, t, err ? err : "");
        free(err);
        ps_client_destroy(a);
        ps_client_destroy(b);
    }
    ps_server_destroy(srv);
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_failtime");
    ps_config cfg;
    pt_config(dir, "failtime.ini", conf, &cfg);
    silent_primary_dead_backup(&cfg, dir);
    both_dead_at_start(&cfg, dir);
    both_die(&cfg, dir);
    silent_primary_live_backup(&cfg, dir);
    late_listener(&cfg, dir);
    pull_behind_push(&cfg, dir);
    checkpoint_alone(dir);
    silent_after_hello(&cfg, dir);
    long_timeout(dir);
    return pt_finish(dir);
}
