/*
 * Shard replication: a primary ships every applied update to its backup and acknowledges a
 * push only once the backup has it. The tests use SGD with lr 1 and gradients of 1, so every
 * row's final value is minus the number of pushes that reached it, exactly: a lost update or one
 * applied twice shows as a wrong number.
 *   1. The primary dies (its sockets close) while pushes are in flight: the client fails over
 *      to the backup, nng resends what was in flight, the backup does not apply twice what it
 *      already had from the primary, and every row ends at exactly -pushes.
 *      Run twice: pushes with keys, and pushes that name the pull just before them (key
 *      elision): the primary ships those to the backup with their keys, and the ones in flight
 *      at the death, which name pulls the backup never saw, are resent with keys.
 *   2. Fencing: once a client has come over to the backup, the old primary's next REPLICATE is
 *      refused; the primary stops without acknowledging, and the update reaches the backup
 *      through the client's failover.
 *   3. SHUTDOWN through the primary stops the backup too.
 *   4. A LOAD the backup cannot apply (its checkpoint root does not hold the directory, which
 *      its primary's does): the backup is diverged, refuses the REPLICATE, and the primary
 *      drops it and goes on; when the primary then dies, the client that comes over gets an
 *      error naming the failed update, not the rows from before the LOAD.
 *   5. Stop polls: the stop step a poll fixed on the primary is the one the backup answers
 *      with after taking shard 0 over (a worker that learnt it stops there; the others must
 *      learn the same step, not none).
 *   6. A backup knows whether its primary is there (ps_server_primary_connected: what lets a
 *      signalled backup serve on through a phase without updates): not before the primary's
 *      first update, then while its connection is open, not once the primary is gone.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdint.h>
#include <unistd.h>

#include "ps_test_util.h"

#define CONF                                                                                       \
    "[cluster]\nshards = 1\nworkers = 1\nreplica_timeout = 3000\n"                                 \
    "[table t]\ndim = 4\noptimizer = sgd\nlr = 1\ninit_scale = 0\n"                                \
    "[dense d]\nsize = 8\noptimizer = sgd\nlr = 1\n"

enum { N_KEYS = 2000, DIM = 4, PUSHES = 120 };

static ps_client *client(const ps_config *cfg, const char *url, const char *backup)
{
    const char *urls[1] = {url}, *backups[1] = {backup};
    ps_client_opts o = {.cfg = cfg,
                        .urls = urls,
                        .worker = 0,
                        .timeout_ms = 10000,
                        .backup_urls = backup ? backups : NULL};
    return pt_client_with(&o);
}

/* A primary and its backup on dir/p<tag> and dir/b<tag>, and a client that knows both. */
static ps_client *start_pair(const ps_config *cfg, const char *dir, const char *tag, ps_server **p,
                             ps_server **b, const char **bu)
{
    char pn[16], bn[16];
    snprintf(pn, sizeof pn, "p%s", tag);
    snprintf(bn, sizeof bn, "b%s", tag);
    const char *pu = pt_ipc(dir, pn);
    *bu = pt_ipc(dir, bn);
    *b = pt_server_repl(cfg, *bu, NULL, true);
    *p = pt_server_repl(cfg, pu, *bu, false);
    return client(cfg, pu, *bu);
}

static uint64_t keys[N_KEYS];
static float ones[N_KEYS * DIM], rows[N_KEYS * DIM], rows_pulled[N_KEYS * DIM];

typedef struct pusher {
    ps_client *c;
    bool pull_first;    /* pull the keys before each push, so the push is elided */
    int n_pushes, done; /* done: atomically, pushes issued */
    /* After hold_at pushes (0: never) the loop waits for released (atomically): the primary
     * dies with that push possibly still in flight, and the rest go to the backup whatever the
     * timing (unheld, the loop could finish on the primary while it was being closed). */
    int hold_at, released;
    int rc;
    char *err;
} pusher;

static void *push_loop(void *arg)
{
    pusher *p = arg;
    for (int i = 0; i < p->n_pushes && p->rc == CM_OK; i++) {
        if (p->pull_first) p->rc = ps_client_pull(p->c, 0, keys, N_KEYS, rows_pulled, &p->err);
        if (p->rc == CM_OK) p->rc = ps_client_push(p->c, 0, keys, N_KEYS, ones, &p->err);
        if (p->rc == CM_OK && i % 10 == 9) p->rc = ps_client_dense_push(p->c, 0, ones, &p->err);
        if (p->rc == CM_OK && i % 25 == 24) p->rc = ps_client_flush(p->c, &p->err);
        __atomic_store_n(&p->done, i + 1, __ATOMIC_RELAXED);
        while (i + 1 == p->hold_at && !__atomic_load_n(&p->released, __ATOMIC_ACQUIRE))
            usleep(1000);
    }
    if (p->rc == CM_OK) p->rc = ps_client_flush(p->c, &p->err);
    return NULL;
}

/* Every row element equals want exactly; so does every dense value. */
static void check_values(ps_client *c, float want_row, float want_dense, const char *what)
{
    char *err = NULL;
    CHECK_OK(ps_client_pull(c, 0, keys, N_KEYS, rows, &err), err);
    size_t bad = 0;
    for (size_t i = 0; i < (size_t)N_KEYS * DIM; i++)
        bad += rows[i] != want_row;
    CHECK_MSG(bad == 0, "%s: %zu of %d row values differ from %.0f (e.g. %.1f)", what, bad,
              N_KEYS * DIM, want_row, rows[0]);
    float d[8];
    CHECK_OK(ps_client_dense_pull(c, 0, d, &err), err);
    for (int i = 0; i < 8; i++)
        CHECK_MSG(d[i] == want_dense, "%s: dense[%d] = %.1f, want %.0f", what, i, d[i], want_dense);
}

/* 1. The primary dies with pushes in flight. */
static void failover(const ps_config *cfg, const char *dir, const char *tag, bool pull_first)
{
    char *err = NULL;
    ps_server *p, *b;
    const char *bu;
    ps_client *c = start_pair(cfg, dir, tag, &p, &b, &bu);
    pusher pp = {.c = c, .n_pushes = PUSHES, .pull_first = pull_first, .hold_at = PUSHES / 3};
    pthread_t th;
    if (pthread_create(&th, NULL, push_loop, &pp) != 0) pt_die("pthread_create", NULL);
    while (__atomic_load_n(&pp.done, __ATOMIC_RELAXED) < PUSHES / 3)
        usleep(1000);
    ps_server_stats ps_st;
    ps_server_stats_get(p, &ps_st);
    ps_server_destroy(p); /* its sockets close, as when the process is killed */
    __atomic_store_n(&pp.released, 1, __ATOMIC_RELEASE);
    pthread_join(th, NULL);
    CHECK_MSG(pp.rc == CM_OK, "pushes across the failover failed: %s", pp.err ? pp.err : "?");
    free(pp.err);
    CHECK_MSG(ps_st.replicated > 0, "the primary replicated nothing before it died");
    check_values(c, -(float)PUSHES, -(float)(PUSHES / 10), "after failover");
    ps_client_stats cs;
    CHECK_OK(ps_client_stats_get(c, &cs, &err), err);
    CHECK_MSG(cs.failovers == 1, "client failovers %llu, want 1", (unsigned long long)cs.failovers);
    ps_server_stats bs;
    ps_server_stats_get(b, &bs);
    CHECK_MSG(bs.promoted == 1, "the backup did not take over");
    if (pull_first)
        CHECK_MSG(ps_st.elided > 0 && bs.elided > 0 && cs.pushes_elided >= PUSHES - 2,
                  "elided pushes: primary %llu, backup %llu, client %llu",
                  (unsigned long long)ps_st.elided, (unsigned long long)bs.elided,
                  (unsigned long long)cs.pushes_elided);
    fprintf(stderr,
            "replica%s: primary acknowledged %llu replicated updates before dying; backup received "
            "%llu, skipped %llu resent pushes; %llu elided pushes resent with keys\n",
            pull_first ? " (elided)" : "", (unsigned long long)ps_st.replicated,
            (unsigned long long)bs.replicated, (unsigned long long)bs.duplicates,
            (unsigned long long)cs.push_fallbacks);
    ps_client_destroy(c);
    ps_server_destroy(b);
}

/* 4. A diverged backup. */
static void diverged_backup(const ps_config *cfg, const char *dir)
{
    char *err = NULL, ckpt[1024], root[1024];
    snprintf(ckpt, sizeof ckpt, "%s/ckpt4", dir);
    snprintf(root, sizeof root, "%s/backup-root4", dir);
    const char *pu = pt_ipc(dir, "p4"), *bu = pt_ipc(dir, "b4");
    ps_server_opts bo = {
        .cfg = cfg, .listen = bu, .shard = 0, .backup = true, .checkpoint_root = root};
    ps_server *b = pt_server_with(&bo);
    ps_server *p = pt_server_repl(cfg, pu, bu, false);
    ps_client *c = client(cfg, pu, bu);
    CHECK_OK(ps_client_push(c, 0, keys, N_KEYS, ones, &err), err);
    CHECK_OK(ps_client_save(c, ckpt, &err), err);
    CHECK_OK(ps_client_push(c, 0, keys, N_KEYS, ones, &err), err);
    CHECK_OK(ps_client_flush(c, &err), err);
    /* The primary loads it and answers once the backup has refused it. */
    CHECK_OK(ps_client_load(c, ckpt, &err), err);
    ps_server_stats ps_st, bs;
    ps_server_stats_get(p, &ps_st);
    ps_server_stats_get(b, &bs);
    CHECK_MSG(ps_st.replica_dropped == 1, "the primary kept its diverged backup");
    CHECK_MSG(bs.replica_diverged == 1 && bs.replica_diverged_seq > 0 && bs.promoted == 0,
              "backup: diverged %llu at update %llu, promoted %llu; want diverged, unpromoted",
              (unsigned long long)bs.replica_diverged, (unsigned long long)bs.replica_diverged_seq,
              (unsigned long long)bs.promoted);
    check_values(c, -1.0f, 0.0f, "on the primary after the LOAD");
    ps_server_destroy(p); /* the client fails over to the diverged backup */
    int rc = ps_client_pull(c, 0, keys, N_KEYS, rows, &err);
    CHECK_MSG(rc != CM_OK && err && strstr(err, "shard 0") && strstr(err, "(LOAD)") &&
                  strstr(err, "diverged"),
              "a pull from the diverged backup: rc %d, %s (rows at %.0f); want an error naming the "
              "failed LOAD",
              rc, err ? err : "no error", rows[0]);
    free(err);
    ps_client_destroy(c);
    ps_server_destroy(b);
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_replica");
    ps_config cfg;
    pt_config(dir, "replica.ini", CONF, &cfg);
    for (int i = 0; i < N_KEYS; i++)
        keys[i] = 1000003ull * (uint64_t)(i + 1);
    for (int i = 0; i < N_KEYS * DIM; i++)
        ones[i] = 1.0f;
    char *err = NULL;

    failover(&cfg, dir, "1", false);
    failover(&cfg, dir, "1e", true);
    ps_server *p, *b;
    const char *bu;
    ps_client *c;

    /* 2. Fencing. */
    c = start_pair(&cfg, dir, "2", &p, &b, &bu);
    for (int i = 0; i < 5; i++)
        CHECK_OK(ps_client_push(c, 0, keys, N_KEYS, ones, &err), err);
    CHECK_OK(ps_client_flush(c, &err), err);
    ps_client *usurper = client(&cfg, bu, NULL); /* its HELLO makes the backup take over */
    CHECK_OK(ps_client_push(c, 0, keys, N_KEYS, ones, &err), err);
    double t0 = cm_now();
    while (!ps_server_fenced(p) && cm_now() - t0 < 10)
        usleep(1000);
    CHECK_MSG(ps_server_fenced(p), "the old primary was not fenced");
    ps_server_destroy(p);
    CHECK_OK(ps_client_flush(c, &err), err);
    check_values(usurper, -6.0f, 0.0f, "after fencing");
    ps_client_destroy(usurper);
    ps_client_destroy(c);
    ps_server_destroy(b);

    /* 3. SHUTDOWN reaches the backup. */
    c = start_pair(&cfg, dir, "3", &p, &b, &bu);
    CHECK_OK(ps_client_shutdown(c, &err), err);
    ps_server_wait(b); /* returns only once the backup has been told to stop (else: watchdog) */
    ps_server_wait(p);
    ps_client_destroy(c);
    ps_server_destroy(p);
    ps_server_destroy(b);

    /* 5. Stop polls across a failover. */
    c = start_pair(&cfg, dir, "5", &p, &b, &bu);
    uint64_t at = 99;
    CHECK_OK(ps_client_stop_poll(c, 100, 100, false, &at, &err), err);
    CHECK_MSG(at == 0, "poll at step 100 without a vote: stop at %" PRIu64 ", want none", at);
    CHECK_OK(ps_client_stop_poll(c, 200, 100, true, &at, &err), err);
    CHECK_MSG(at == 300, "vote at step 200, interval 100: stop at %" PRIu64 ", want 300", at);
    ps_server_destroy(p);
    at = 99;
    CHECK_OK(ps_client_stop_poll(c, 300, 100, false, &at, &err), err);
    CHECK_MSG(at == 300, "after the failover: the backup answers stop at %" PRIu64 ", want 300",
              at);
    ps_server_stats bs5;
    ps_server_stats_get(b, &bs5);
    CHECK_MSG(bs5.promoted == 1, "the backup did not take over");
    ps_client_destroy(c);
    ps_server_destroy(b);

    /* 6. The primary's connection, seen from the backup. */
    c = start_pair(&cfg, dir, "6", &p, &b, &bu);
    CHECK_MSG(!ps_server_primary_connected(b), "a backup knew its primary before any update");
    CHECK_OK(ps_client_push(c, 0, keys, N_KEYS, ones, &err), err);
    CHECK_OK(ps_client_flush(c, &err), err);
    CHECK_MSG(ps_server_primary_connected(b), "a backup that took an update sees no primary");
    ps_server_destroy(p);
    double t6 = cm_now();
    while (ps_server_primary_connected(b) && cm_now() - t6 < 5)
        usleep(1000);
    ps_server_stats bs6;
    ps_server_stats_get(b, &bs6);
    CHECK_MSG(!ps_server_primary_connected(b) && bs6.promoted == 0,
              "the primary gone for %.1f s: connected %d, promoted %llu (want neither)",
              cm_now() - t6, ps_server_primary_connected(b), (unsigned long long)bs6.promoted);
    ps_client_destroy(c);
    ps_server_destroy(b);

    diverged_backup(&cfg, dir);
    return pt_finish(dir);
}
