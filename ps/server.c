/*
 * The PS server: one rep socket, many contexts, each a recv -> handle -> send loop run from
 * nng's completion callbacks. CLOCK and BARRIER replies may be deferred: the context parks on
 * a wait list (it stops receiving) and whoever completes the condition sends its reply. A
 * worker has at most one of each parked (a newer one takes an older one's place: park), so
 * waits hold at most 2 x workers contexts, and the pool has more (ps_server_create): however
 * many waits a sender piles up under one worker id, the other workers are still served.
 *
 * Tables sit behind a read-write lock: every request holds it shared; LOAD takes it exclusive
 * only to swap in tables it has already built and verified, so a bad checkpoint never
 * replaces good state.
 *
 * Replication (ps/replica.h): a primary with a backup applies updates one at a time under
 * repl_mu, numbers them and ships each to the backup from the context's own request context;
 * the client's reply is held (state ST_REPL) until the backup acknowledges. A backup applies
 * what it receives in sequence order; the first request it gets from a client means the
 * clients have failed over: it applies everything it holds, becomes primary, and from then on
 * answers its old primary's REPLICATE with PS_STATUS_FENCED, which makes the old primary stop
 * (so no update is ever acknowledged by a primary that its backup does not have). A backup that
 * fails to apply an update its primary applied is diverged: it refuses every REPLICATE (its
 * primary drops it) and every client request from then on, rather than serve other rows.
 * A primary stopped by a SHUTDOWN that its backup did not take in the stream (dropped, or
 * diverged) tells the backup to stop as it goes (stop_backup), so no backup outlives its cluster.
 */
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <nng/protocol/reqrep0/req.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>
#include <time.h>

#include "ps/checkpoint.h"
#include "ps/dense.h"
#include "ps/keycache.h"
#include "ps/net.h"
#include "ps/replica.h"

enum { ST_RECV, ST_SEND, ST_PARKED, ST_REPL, ST_DUP };
enum { RS_SEND, RS_RECV };

typedef struct srv_ctx {
    struct ps_server *s;
    nng_ctx ctx;
    nng_aio *aio;
    int state;
    uint64_t wait_for; /* parked: the clock or barrier generation awaited */
    ps_hdr req;        /* parked, ST_REPL: the request's header */
    struct srv_ctx *next;
    nng_ctx rctx; /* primary with a backup: this context's requests to the backup */
    nng_aio *raio;
    int rstate;
    nng_msg *held;   /* ST_REPL, ST_DUP: the client's reply, sent once the backup acknowledged */
    bool stop_after; /* ST_REPL: the update was a SHUTDOWN */
    /* ST_REPL: resends of this update (ST_DUP, linked by next) whose replies wait for its
     * acknowledgement; state, req and dups move under repl_mu. */
    struct srv_ctx *dups;
    bool in_req; /* a request is in progress: from its dispatch until this receives again */
} srv_ctx;

struct ps_server {
    ps_config cfg;
    uint32_t shard;
    nng_socket sock;
    bool sock_open;
    uint32_t n_ctx;
    srv_ctx *ctxs;
    pthread_rwlock_t tables_lock;
    emb_table *tables[PS_MAX_TABLES];
    cm_team *team; /* applies large batches (ps_server_opts.apply_threads), or NULL */
    /* Per table with a TTL: the last period of table steps it was expired in (ttl_after_push);
     * atomics. */
    uint64_t ttl_epoch[PS_MAX_TABLES];
    ps_dense *dense[PS_MAX_DENSE]; /* NULL for blocks other shards own */
    pthread_mutex_t mu;            /* clocks, barrier, stop */
    pthread_cond_t stop_cv;
    bool stopping;
    uint64_t *clocks;    /* per worker */
    uint64_t *last_seen; /* per worker: ms (monotonic) its last request arrived (liveness) */
    uint8_t *arrived;    /* per worker: entered the barrier being gathered */
    uint64_t *polled;    /* per worker: the most steps it made a stop poll at (s->mu) */
    uint64_t poll_stop_at; /* the step stop polls fixed the job's stop at; 0: none (s->mu) */
    /* worker_lost_ms (shard 0): per worker, the id of the nng pipe its latest request came on
     * (read without mu, written under it, atomics), and when that pipe closed (ms, 0 while it
     * is open or none was seen; under mu) */
    uint32_t *pipe_of;
    uint64_t *gone_ms;
    pthread_t reaper;    /* re-checks waiters when workers time out */
    bool reaper_running;
    /* set by ps_server_destroy: the reaper ends with the server, not at a stop request (the
     * server serves until destroyed, and a clock deferred meanwhile needs the reaper) */
    bool reaper_stop;
    srv_ctx *clock_waiters, *barrier_waiters;
    uint64_t barrier_done; /* the highest barrier id completed */
    uint64_t barrier_want; /* the id being gathered; 0: none */
    /* PS_FLAG_STOP votes: the OR of those of the barrier being gathered, and barrier_done's
     * (what a resend of it is answered) */
    bool barrier_stop, done_stop;
    ps_server_stats st;    /* atomics */
    ps_dedup *dedup;
    ps_keycache *pulled; /* key lists of recent pulls, per (worker, table): key elision */
    /* replication */
    bool is_backup, has_backup;
    char replica_url[1024];
    char *ckpt_root; /* realpath of ps_server_opts.checkpoint_root, or NULL */
    nng_socket rsock;
    bool rsock_open;
    pthread_mutex_t repl_mu;        /* orders updates: primary apply + numbering, backup apply */
    uint64_t seq;                   /* primary: the last update shipped */
    uint64_t next_seq;              /* backup: the next update to apply */
    ps_replog log;                  /* backup: updates received, not yet applied */
    uint64_t log_max;               /* backup: bytes log may hold (contexts x max_message) */
    bool promoted, dropped, fenced; /* atomics */
    /* primary with a backup, atomics: a SHUTDOWN was accepted here, and the backup
     * acknowledged its forward (ps_server_destroy tells a backup that did not: stop_backup) */
    bool stop_asked, stop_forwarded;
    /* backup, diverged (st.replica_diverged_seq set, with release, after this is written once,
     * under repl_mu): the failed update and why, which every refusal says */
    char diverged_why[1024];
    uint32_t repl_inflight;         /* atomic: REPLICATEs the backup has not answered yet */
    uint32_t backup_pipe;           /* atomic: the id of the open connection to the backup, 0:
                                       none (it is down, or the dialer is between attempts) */
    uint32_t primary_pipe;          /* backup, atomic: the connection the latest REPLICATE
                                       came on while it stays open; 0: none seen, or closed */
    uint64_t last_reply_ms;         /* atomic: when a reply was last handed to nng */
    /* atomics: requests in progress (srv_ctx.in_req), and when one last finished (or the
     * server started): ps_server_idle_ms */
    uint32_t busy;
    uint64_t last_done_ms;
};

#define STAT_ADD(s, field, v) __atomic_add_fetch(&(s)->st.field, (v), __ATOMIC_RELAXED)

/* ---- replies ---- */

static uint64_t now_ms(void)
{
    return (uint64_t)(cm_now() * 1000.0);
}

static void ctx_send(srv_ctx *c, nng_msg *reply)
{
    ps_msg_seal(reply);
    __atomic_store_n(&c->s->last_reply_ms, now_ms(), __ATOMIC_RELAXED);
    STAT_ADD(c->s, bytes_out, nng_msg_len(reply));
    c->state = ST_SEND;
    nng_aio_set_msg(c->aio, reply);
    nng_ctx_send(c->ctx, c->aio);
}

/* An error reply: status < 0 and the message as payload. NULL when out of memory. */
static nng_msg *reply_error(struct ps_server *s, const ps_hdr *req, int code, const char *msg)
{
    STAT_ADD(s, errors, 1);
    size_t len = strlen(msg);
    nng_msg *m;
    uint8_t *p;
    if (ps_msg_new(req, len, &m, &p) != CM_OK) return NULL;
    memcpy(p, msg, len);
    ps_hdr h;
    memcpy(&h, nng_msg_body(m), sizeof h);
    h.status = (int16_t)(code < 0 ? code : CM_ERR);
    memcpy(nng_msg_body(m), &h, sizeof h);
    return m;
}

static nng_msg *reply_ok(const ps_hdr *req, size_t payload, uint8_t **p)
{
    nng_msg *m;
    uint8_t *dummy;
    if (ps_msg_new(req, payload, &m, p ? p : &dummy) != CM_OK) return NULL;
    return m;
}

/* NULL when a reply of `payload` bytes plus the wire header fits max_message (the clients'
 * receive limit: a reply over it is dropped there, and the request resent forever); otherwise
 * the error reply, naming the sizes. */
static nng_msg *reply_too_big(struct ps_server *s, const ps_hdr *h, double payload,
                              const char *what)
{
    char msg[256];
    if (payload + PS_HDR_BYTES <= (double)s->cfg.max_msg_bytes) return NULL;
    snprintf(msg, sizeof msg,
             "%s of %.0f bytes (%u header + %.0f payload) exceeds max_message of %" PRIu64
             " bytes: raise max_message or send fewer keys a call",
             what, payload + PS_HDR_BYTES, PS_HDR_BYTES, payload, s->cfg.max_msg_bytes);
    return reply_error(s, h, CM_EINVAL, msg);
}

/* ---- clocks and barriers (shard 0) ---- */

/* A worker silent for longer than worker_timeout_ms no longer holds back clocks and barriers
 * (it died; if it comes back, its next request makes it count again). */
static bool alive(const struct ps_server *s, uint32_t w)
{
    if (s->cfg.worker_timeout_ms == 0) return true;
    /* Its last request time is read first, and one later than now (stored by a request
     * handled meanwhile, stamped after this thread read its clock, as when this thread was
     * descheduled in between) is alive: unsigned, now - seen wrapped to nearly 2^64 ms, and a
     * busy worker counted as dead. */
    const uint64_t seen = __atomic_load_n(&s->last_seen[w], __ATOMIC_ACQUIRE), now = now_ms();
    return now <= seen || now - seen <= s->cfg.worker_timeout_ms;
}

static uint64_t min_clock(const struct ps_server *s)
{
    uint64_t m = UINT64_MAX;
    for (uint32_t w = 0; w < s->cfg.n_workers; w++)
        if (alive(s, w) && s->clocks[w] < m) m = s->clocks[w];
    return m;
}

static bool clock_ready(const struct ps_server *s, uint64_t c)
{
    if (s->cfg.staleness < 0) return true;
    /* With every worker silent past the timeout (a waiting one sends nothing, so it too goes
     * silent) none holds the clock back: min_clock is UINT64_MAX, and adding the staleness to
     * it would wrap to a bound no clock meets, parking the waiters for good. */
    const uint64_t lo = min_clock(s), k = (uint64_t)s->cfg.staleness;
    return lo > UINT64_MAX - k || c <= lo + k;
}

/* c receives its next request: the one it served, if any, is finished. */
static void ctx_recv(srv_ctx *c)
{
    if (c->in_req) {
        c->in_req = false;
        __atomic_store_n(&c->s->last_done_ms, now_ms(), __ATOMIC_RELAXED);
        __atomic_sub_fetch(&c->s->busy, 1, __ATOMIC_RELAXED);
    }
    c->state = ST_RECV;
    nng_ctx_recv(c->ctx, c->aio);
}

/* Sends a parked context's reply; with none (out of memory) the context goes back to
 * receiving, its request unanswered (the client's timeout tells), rather than leave the pool. */
static void ctx_send_deferred(srv_ctx *c, nng_msg *reply)
{
    if (reply != NULL) {
        ctx_send(c, reply);
        return;
    }
    ctx_recv(c);
}

/* Parks c, serving request h, on *list (the clock or the barrier waiters); s->mu held.
 * A worker waits on one clock and one barrier at a time (ps_client_clock and ps_client_barrier
 * return only once answered), so a wait of the same kind from the same worker that is parked
 * already is one its sender no longer waits for: a copy of this very request (the same request
 * id: nng resends it on the new connection after a reconnect, a client sends it again as a new
 * nng request after a failover; ps/client.c sends these ops with nng's resend timer off, so no
 * copy comes on the same connection as the same nng request), whose old copy's reply nobody
 * takes; or the wait of a worker restarted since. The old one is answered with an error and
 * counted (superseded); the new one parks in its place. So at most one clock and one barrier wait per worker hold a context (2 x workers
 * in all, beside those that serve: ps_server_create), however many a hostile or broken sender
 * sends under one worker id. */
static void park(struct ps_server *s, srv_ctx *c, const ps_hdr *h, srv_ctx **list)
{
    for (srv_ctx **pp = list; *pp; pp = &(*pp)->next) {
        srv_ctx *old = *pp;
        if (old->req.worker != h->worker) continue;
        *pp = old->next;
        const char *what = h->op == PS_OP_CLOCK ? "clock" : "barrier";
        char msg[256];
        snprintf(msg, sizeof msg,
                 "%s request %" PRIu64 " (%s %u) of worker %u superseded by its request %" PRIu64
                 " (%s %u): a worker has at most 1 %s request waiting at shard 0",
                 what, old->req.req_id, what, old->req.clock, h->worker, h->req_id, what, h->clock,
                 what);
        STAT_ADD(s, superseded, 1);
        ctx_send_deferred(old, reply_error(s, &old->req, CM_ERR, msg));
        break; /* there was at most one */
    }
    c->state = ST_PARKED;
    c->req = *h;
    c->next = *list;
    *list = c;
}

/*
 * Lost workers (worker_lost_ms, shard 0). Silence (worker_timeout) cannot tell a dead worker
 * from a live one busy elsewhere (a long save, an evaluation), so it only ever lets the others
 * go on. A worker's connection can: its process dies, its sockets close, and the PS sees its
 * pipe go within milliseconds; a live worker keeps its connection however long it computes. A
 * worker's client has one pipe to shard 0 at a time (one dialer), so the pipe its latest
 * request came on is its connection; once that closes and no request comes on another for
 * worker_lost_ms (time for a restart with --rejoin to dial in), the clock and barrier waits
 * that wait for it are answered with an error naming it, rather than hold the others until
 * their own timeouts (20 x theirs) blame no one. Requests a tool may send under a worker's id
 * (STATS) and the one a job's last client sends (SHUTDOWN) say nothing about the worker.
 */
static void note_pipe(struct ps_server *s, const ps_hdr *h, nng_msg *msg)
{
    if (s->pipe_of == NULL || h->worker >= s->cfg.n_workers || h->op == PS_OP_STATS ||
        h->op == PS_OP_SHUTDOWN || h->op == PS_OP_REPLICATE)
        return;
    const uint32_t id = (uint32_t)nng_pipe_id(nng_msg_get_pipe(msg));
    if (__atomic_load_n(&s->pipe_of[h->worker], __ATOMIC_RELAXED) == id) return;
    pthread_mutex_lock(&s->mu);
    __atomic_store_n(&s->pipe_of[h->worker], id, __ATOMIC_RELAXED);
    s->gone_ms[h->worker] = 0;
    pthread_mutex_unlock(&s->mu);
}

/* nng: a pipe closed. Its worker (if it was one's latest) is gone from now; a backup's
 * primary, if it was the primary's. */
static void pipe_closed(nng_pipe p, nng_pipe_ev ev, void *arg)
{
    (void)ev;
    struct ps_server *s = arg;
    const uint32_t id = (uint32_t)nng_pipe_id(p);
    uint32_t primary = id;
    __atomic_compare_exchange_n(&s->primary_pipe, &primary, 0, false, __ATOMIC_RELAXED,
                                __ATOMIC_RELAXED);
    if (s->pipe_of == NULL) return;
    pthread_mutex_lock(&s->mu);
    for (uint32_t w = 0; w < s->cfg.n_workers; w++)
        if (s->pipe_of[w] == id && s->gone_ms[w] == 0) s->gone_ms[w] = now_ms();
    pthread_mutex_unlock(&s->mu);
}

/* Backup: msg, a REPLICATE taken, came on the primary's connection. Stored, then checked still
 * open: one that closed before the store has had its pipe_closed already. */
static void note_primary(struct ps_server *s, nng_msg *msg)
{
    nng_pipe p = nng_msg_get_pipe(msg);
    uint32_t id = (uint32_t)nng_pipe_id(p);
    __atomic_store_n(&s->primary_pipe, id, __ATOMIC_RELAXED);
    nng_sockaddr sa;
    const int rv = nng_pipe_get_addr(p, NNG_OPT_LOCADDR, &sa); /* looks the pipe up first */
    if (rv == NNG_ENOENT || rv == NNG_ECLOSED)
        __atomic_compare_exchange_n(&s->primary_pipe, &id, 0, false, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED);
}

/* The lost worker that parked context c (a clock or barrier wait) waits for, or -1; s->mu
 * held. */
static int64_t lost_holder(const struct ps_server *s, const srv_ctx *c, uint64_t now)
{
    for (uint32_t w = 0; w < s->cfg.n_workers; w++) {
        const uint64_t gone = s->gone_ms[w];
        if (gone == 0 || now < gone || now - gone < s->cfg.worker_lost_ms || !alive(s, w)) continue;
        if (c->req.op == PS_OP_CLOCK ? s->clocks[w] + (uint64_t)s->cfg.staleness < c->wait_for
                                     : !s->arrived[w])
            return w;
    }
    return -1;
}

/* Whether parked wait c must be answered with an error now, and why (into msg); s->mu held. */
typedef bool wait_doomed(struct ps_server *s, const srv_ctx *c, uint64_t now, char *msg, size_t n);

/* Answers, with an error saying why, every parked clock or barrier wait doomed() picks; s->mu
 * held. */
static void fail_waits(struct ps_server *s, wait_doomed *doomed)
{
    const uint64_t now = now_ms();
    for (srv_ctx **list = &s->clock_waiters;; list = &s->barrier_waiters) {
        for (srv_ctx **pp = list; *pp;) {
            srv_ctx *c = *pp;
            char msg[512];
            if (!doomed(s, c, now, msg, sizeof msg)) {
                pp = &c->next;
                continue;
            }
            *pp = c->next;
            fprintf(stderr, "ember ps: shard %u: %s\n", s->shard, msg);
            ctx_send_deferred(c, reply_error(s, &c->req, CM_ERR, msg));
        }
        if (list == &s->barrier_waiters) break;
    }
}

static const char *wait_name(const srv_ctx *c)
{
    return c->req.op == PS_OP_CLOCK ? "clock" : "barrier";
}

/* fail_waits: a wait that waits for a lost worker. */
static bool lost_doomed(struct ps_server *s, const srv_ctx *c, uint64_t now, char *msg, size_t n)
{
    const int64_t w = lost_holder(s, c, now);
    if (w < 0) return false;
    snprintf(msg, n,
             "worker %u is gone: its connection to shard 0 closed %.1f s ago and it has "
             "not come back (worker_lost %u ms); worker %u's %s %u waits for it: restart "
             "it into the job (ember train --rejoin) or the whole job from its last "
             "checkpoint (--resume)",
             (unsigned)w, (double)(now - s->gone_ms[w]) / 1000.0, s->cfg.worker_lost_ms,
             c->req.worker, wait_name(c), c->req.clock);
    STAT_ADD(s, lost_waits, 1);
    return true;
}

/* Answers, with an error naming the lost worker, every parked wait that waits for one; s->mu
 * held. */
static void fail_lost_waits(struct ps_server *s)
{
    if (s->gone_ms != NULL) fail_waits(s, lost_doomed);
}

/* fail_waits: every wait, at a SHUTDOWN. */
static bool shutdown_doomed(struct ps_server *s, const srv_ctx *c, uint64_t now, char *msg,
                            size_t n)
{
    (void)now;
    snprintf(msg, n,
             "shard %u is shutting down (a SHUTDOWN ended the job): worker %u's %s %u cannot "
             "complete here",
             s->shard, c->req.worker, wait_name(c), c->req.clock);
    return true;
}

/* A SHUTDOWN was accepted: the server stops, and a wait still parked here would never be
 * answered (its worker would wait out its whole timeout, 20 x --ps-timeout for a barrier: a
 * worker that re-entered a stop vote's barrier at a backup after the others had stopped). */
static void stop_for_shutdown(struct ps_server *s)
{
    pthread_mutex_lock(&s->mu);
    fail_waits(s, shutdown_doomed);
    pthread_mutex_unlock(&s->mu);
    ps_server_stop(s);
}

/* Sends the replies of parked contexts whose condition now holds; s->mu held. */
static void release_clock_waiters(struct ps_server *s)
{
    srv_ctx **pp = &s->clock_waiters;
    while (*pp) {
        srv_ctx *c = *pp;
        if (!clock_ready(s, c->wait_for)) {
            pp = &c->next;
            continue;
        }
        *pp = c->next;
        ctx_send_deferred(c, reply_ok(&c->req, 0, NULL));
    }
}

static void note_clock(struct ps_server *s, uint32_t worker, uint64_t c)
{
    if (c > s->clocks[worker]) s->clocks[worker] = c;
    uint64_t lo = min_clock(s), hi = 0;
    for (uint32_t w = 0; w < s->cfg.n_workers; w++)
        if (s->clocks[w] > hi) hi = s->clocks[w];
    s->st.clocks_min = lo;
    s->st.clocks_max = hi;
    if (hi - lo > s->st.staleness_max) s->st.staleness_max = hi - lo;
}

/*
 * A clock no worker sends (s->mu held): true, with why, for a CLOCK that would move its worker
 * far ahead. note_clock keeps the highest clock a worker sent, so one such CLOCK (2^32 - 1, a
 * corrupt or hostile sender under that worker's id) would leave the worker counted far ahead
 * for the rest of the run: it would never again hold the others back, and the staleness bound
 * would be gone without a word.
 *
 * A worker sends its clocks one at a time, each once the one before was answered, so what it
 * sends here is its last clock again (a resend) or the next one. The exceptions are the first
 * clock this process sees from a worker: a worker resumed from a checkpoint (--resume; this
 * PS is as fresh, every clock 0) or one whose clients failed over to this backup (which never
 * saw a clock) starts where the job is. Its clock was answered by the process before, where
 * it was within the staleness window of the slowest worker: so it is within k + 1 of the
 * clocks the others send here. A rejoined worker (--rejoin) starts at its progress note, the
 * batch after its last clock: the next one. So a clock is accepted when it is at most its
 * worker's last clock here + 1, or within k + 1 of the fastest other worker seen here, or the
 * first one here of a job none of whose other workers has clocked here yet (nothing to check
 * it against; the first of a fresh process). With --worker-timeout a worker's first clock
 * here is not checked: the others may have gone on far past one that was silent.
 */
static bool clock_refused(const struct ps_server *s, const ps_hdr *h, char *why, size_t n)
{
    if (s->cfg.staleness < 0) return false; /* clocks hold nobody back */
    const uint64_t c = h->clock, own = s->clocks[h->worker], k = (uint64_t)s->cfg.staleness;
    if (own > 0 && c <= own + 1) return false;
    uint64_t top = 0;
    bool others = false;
    for (uint32_t w = 0; w < s->cfg.n_workers; w++)
        if (w != h->worker && s->clocks[w] > 0 && alive(s, w)) {
            others = true;
            if (s->clocks[w] > top) top = s->clocks[w];
        }
    if (others ? c <= top + k + 1 : own == 0) return false;
    if (own == 0 && s->cfg.worker_timeout_ms > 0) return false;
    int len = snprintf(
        why, n, "clock %" PRIu64 " of worker %u is ahead of its last clock here (%" PRIu64 ")", c,
        h->worker, own);
    if (others && len > 0 && (size_t)len < n)
        snprintf(why + len, n - (size_t)len,
                 " by more than 1 and of the fastest other worker's (%" PRIu64
                 ") by more than staleness + 1 (%" PRIu64 "): no worker sends it",
                 top, k + 1);
    else if (len > 0 && (size_t)len < n)
        snprintf(why + len, n - (size_t)len, " by more than 1: no worker sends it");
    return true;
}

/* Returns true when the context was parked (reply later). */
static bool handle_clock(struct ps_server *s, srv_ctx *c, const ps_hdr *h, nng_msg **reply)
{
    char why[320];
    pthread_mutex_lock(&s->mu);
    if (clock_refused(s, h, why, sizeof why)) {
        pthread_mutex_unlock(&s->mu);
        STAT_ADD(s, bad_messages, 1);
        *reply = reply_error(s, h, CM_EINVAL, why);
        return false;
    }
    note_clock(s, h->worker, h->clock);
    release_clock_waiters(s);
    bool parked = !clock_ready(s, h->clock);
    if (parked) {
        c->wait_for = h->clock;
        park(s, c, h, &s->clock_waiters);
        fail_lost_waits(s);
    }
    pthread_mutex_unlock(&s->mu);
    if (!parked) *reply = reply_ok(h, 0, NULL);
    return parked;
}

/* Barriers are named by increasing ids (the trainer derives them from its schedule). A
 * worker can only ask for id X + 1 once X has completed, so ids alone settle every case in
 * which workers disagree: a worker asking for an id at or below one completed, or below the
 * one being gathered, is resending or catching up on a barrier that completed (a restarted
 * worker, or a client that failed over to a backup that never saw it): it passes at once; a
 * worker asking for a higher id than the one being gathered proves that one complete.
 *
 * Stop votes (PS_FLAG_STOP): every reply that releases a barrier carries the OR of the votes
 * of the workers gathered in it. A resend of the last completed barrier gets that barrier's
 * OR again; a request that passes at once for an older barrier, or one this shard never
 * gathered (a backup that took over), gets only its own vote back: no other is known here.
 * That answer agrees with what the others learned whenever they could go on past the barrier
 * (had any voted there, none would have), so the one case it misses is a backup asked for the
 * barrier after its primary released it with a stop: those already told stop do not come, and
 * the asking worker waits at the backup until they count as gone (worker_timeout_ms) or the
 * cluster is shut down (docs/PROTOCOL.md, "Stop votes"). */

/* The reply releasing barrier request h: stop says whether any worker voted to stop there. */
static nng_msg *barrier_reply(const ps_hdr *h, bool stop)
{
    nng_msg *m = reply_ok(h, 0, NULL);
    if (m != NULL) {
        ps_hdr *r = nng_msg_body(m);
        r->flags = stop ? PS_FLAG_STOP : 0;
    }
    return m;
}

/* Answers every parked barrier request; s->mu held. */
static void barrier_release_all(struct ps_server *s)
{
    for (srv_ctx *w = s->barrier_waiters, *next; w; w = next) {
        next = w->next;
        ctx_send_deferred(w, barrier_reply(&w->req, s->barrier_stop));
    }
    s->barrier_waiters = NULL;
    s->barrier_done = s->barrier_want;
    s->barrier_want = 0;
    s->done_stop = s->barrier_stop;
    s->barrier_stop = false;
    memset(s->arrived, 0, s->cfg.n_workers);
}

/* Completes the barrier being gathered once every live worker has entered it; s->mu held. */
static bool barrier_try_release(struct ps_server *s)
{
    if (s->barrier_want == 0) return false;
    for (uint32_t w = 0; w < s->cfg.n_workers; w++)
        if (!s->arrived[w] && alive(s, w)) return false;
    barrier_release_all(s);
    return true;
}

/* Returns true when the context was parked (answered when the barrier completes); false
 * with *reply set when it is answered now. */
static bool handle_barrier(struct ps_server *s, srv_ctx *c, const ps_hdr *h, nng_msg **reply)
{
    const uint64_t id = h->clock;
    const bool vote = (h->flags & PS_FLAG_STOP) != 0;
    bool parked = false;
    pthread_mutex_lock(&s->mu);
    if (id <= s->barrier_done || (s->barrier_want != 0 && id < s->barrier_want)) {
        *reply = barrier_reply(h, id == s->barrier_done ? s->done_stop || vote : vote);
    } else {
        if (s->barrier_want != 0 && id > s->barrier_want) barrier_release_all(s);
        s->barrier_want = id;
        s->arrived[h->worker] = 1;
        s->barrier_stop = s->barrier_stop || vote;
        park(s, c, h, &s->barrier_waiters);
        if (!barrier_try_release(s)) fail_lost_waits(s);
        parked = true;
    }
    pthread_mutex_unlock(&s->mu);
    return parked;
}

/* A stop poll (PS_FLAG_POLL): answered at once with the stop step fixed so far. The first
 * vote fixes it at the most steps any worker has polled at plus the interval: each worker is
 * then short of its next poll, which is at most that step, so every one learns it in time and
 * stops there, a checkpoint all of them reach (ps_client_stop_poll). */
static nng_msg *handle_poll(struct ps_server *s, const ps_hdr *h)
{
    if (h->count == 0 || h->count > PS_POLL_MAX_EVERY || h->clock > PS_POLL_MAX_STEP) {
        STAT_ADD(s, bad_messages, 1);
        return reply_error(s, h, CM_EINVAL,
                           "stop poll: an interval of 1 to 2^20 steps and a step up to 2^31");
    }
    pthread_mutex_lock(&s->mu);
    if (h->clock > s->polled[h->worker]) s->polled[h->worker] = h->clock;
    if ((h->flags & PS_FLAG_STOP) && s->poll_stop_at == 0) {
        uint64_t most = 0;
        for (uint32_t w = 0; w < s->cfg.n_workers; w++)
            if (s->polled[w] > most) most = s->polled[w];
        s->poll_stop_at = most + h->count;
    }
    const uint32_t at = (uint32_t)s->poll_stop_at; /* at most 2^31 + 2^20 */
    pthread_mutex_unlock(&s->mu);
    nng_msg *m = barrier_reply(h, at != 0);
    if (m != NULL) ((ps_hdr *)nng_msg_body(m))->clock = at;
    return m;
}

/* Wakes every 100 ms while some worker may time out, to release what a dead worker holds. */
static void *reaper_main(void *arg)
{
    struct ps_server *s = arg;
    while (!__atomic_load_n(&s->reaper_stop, __ATOMIC_RELAXED)) {
        struct timespec ts = {0, 100 * 1000 * 1000};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&s->mu);
        release_clock_waiters(s);
        if (s->barrier_waiters) barrier_try_release(s);
        fail_lost_waits(s);
        pthread_mutex_unlock(&s->mu);
    }
    return NULL;
}

/* ---- tables ---- */

static int check_keys_owned(struct ps_server *s, const uint64_t *keys, size_t n, char *msg,
                            size_t msgn)
{
    if (s->cfg.n_shards == 1 && s->shard == 0) return CM_OK; /* every key maps to shard 0 */
    for (size_t i = 0; i < n; i++)
        if (ps_key_shard(keys[i], s->cfg.n_shards) != s->shard) {
            snprintf(msg, msgn, "key %" PRIu64 " belongs to shard %u, not %u", keys[i],
                     ps_key_shard(keys[i], s->cfg.n_shards), s->shard);
            return CM_EINVAL;
        }
    return CM_OK;
}

/* Resolves the keys of an elided push from the key list of the pull it names. NULL when found;
 * otherwise the error reply: PS_STATUS_NO_KEYS when the list is not held (a normal event: the
 * client resends with keys), a malformed-message error when it is held but does not match.
 * When the list is not held but the push was applied before (dup not NULL: a resend of an
 * update), *dup is set and the reply is its acknowledgement. */
static nng_msg *elided_keys(struct ps_server *s, const ps_hdr *h, const uint8_t *p, uint64_t *keys,
                            uint64_t *hints, bool *dup)
{
    char msg[200];
    uint64_t pull_id, sum;
    size_t have = 0;
    memcpy(&pull_id, p, 8);
    memcpy(&sum, p + 8, 8);
    switch (ps_keycache_get(s->pulled, h->worker, h->table, pull_id, h->count, sum, keys, hints,
                            &have)) {
    case PS_KC_FOUND:
        STAT_ADD(s, elided, 1);
        return NULL;
    case PS_KC_UNKNOWN:
        if (dup != NULL) {
            if (ps_dedup_check_add(s->dedup, h->worker, h->req_id)) {
                STAT_ADD(s, duplicates, 1);
                *dup = true;
                return reply_ok(h, 0, NULL);
            }
            ps_dedup_remove(s->dedup, h->worker, h->req_id); /* not applied: only checked */
        }
        STAT_ADD(s, elided_misses, 1);
        snprintf(msg, sizeof msg, "no key list of pull %" PRIu64 " by worker %u for table %u",
                 pull_id, h->worker, h->table);
        return reply_error(s, h, PS_STATUS_NO_KEYS, msg);
    case PS_KC_COUNT:
        snprintf(msg, sizeof msg, "elided push of %u rows names pull %" PRIu64 " of %zu keys",
                 h->count, pull_id, have);
        break;
    case PS_KC_CHECKSUM:
        snprintf(msg, sizeof msg, "elided push: key checksum does not match pull %" PRIu64,
                 pull_id);
        break;
    }
    STAT_ADD(s, bad_messages, 1);
    return reply_error(s, h, CM_ECORRUPT, msg);
}

/* A table's TTL (emb_table_config.ttl_steps) takes effect here: rows untouched for more than
 * ttl steps are dropped (emb_table_expire) once every ttl_period table steps, by the push that
 * brings the step into a new period, before it is acknowledged. A deterministic point of the
 * push sequence, so that a run, its resume and a backup applying the same pushes drop the same
 * rows at the same step; a walk of the table's resident rows (spilled ones are counted, not
 * read: embedding.h), so not after every push: a row goes between ttl and ttl + ttl_period
 * (plus a bucket of ttl/64 from ttl 64 on) steps after its last pull or push. */
static uint64_t ttl_period(uint64_t ttl)
{
    return ttl / 8 > 0 ? ttl / 8 : 1;
}

static void ttl_after_push(struct ps_server *s, uint32_t i, emb_table *t)
{
    const uint64_t ttl = emb_table_get_config(t)->ttl_steps;
    if (ttl == 0) return;
    uint64_t epoch = emb_table_step(t) / ttl_period(ttl);
    uint64_t seen = __atomic_load_n(&s->ttl_epoch[i], __ATOMIC_RELAXED);
    if (epoch <= seen || !__atomic_compare_exchange_n(&s->ttl_epoch[i], &seen, epoch, false,
                                                      __ATOMIC_RELAXED, __ATOMIC_RELAXED))
        return;
    char *err = NULL;
    if (emb_table_expire(t, NULL, &err) != CM_OK) {
        /* The push itself is applied; the rows stay until the next period tries again. */
        STAT_ADD(s, errors, 1);
        fprintf(stderr, "ember ps: shard %u: TTL expiry of table '%s' failed: %s\n", s->shard,
                s->cfg.tables[i].name, err ? err : "?");
        free(err);
    }
}

/* PULL payload: keys. Reply: rows in the requested codec. PUSH payload: u32 key bytes, keys,
 * rows; or, with PS_FLAG_ELIDED, u64 pull request id, u64 key checksum, rows. Everything is
 * validated before the table is touched. A successful pull's keys are kept for the pushes that
 * name it. When `with_keys` is not NULL and an elided push was applied, *with_keys gets the same
 * push with its keys (sealed): what a backup, which never saw the pull, can apply. `dup` (PUSH
 * only; NULL for no de-duplication): a valid push whose request id was applied before is
 * acknowledged without being applied again, and *dup set; the id is looked up only once the
 * push has passed every check, so a malformed resend is still answered as malformed. */
static nng_msg *handle_rows(struct ps_server *s, const ps_hdr *h, const uint8_t *p,
                            nng_msg **with_keys, bool *dup)
{
    char msg[256];
    char *err = NULL;
    nng_msg *reply = NULL;
    uint64_t *keys = NULL, *hints = NULL;
    float *vals = NULL;
    int rc = CM_OK;
    if (h->table >= s->cfg.n_tables) {
        STAT_ADD(s, bad_messages, 1);
        snprintf(msg, sizeof msg, "no table %u (the cluster has %u)", h->table, s->cfg.n_tables);
        return reply_error(s, h, CM_EINVAL, msg);
    }
    const uint32_t dim = s->cfg.tables[h->table].cfg.dim;
    ps_rows_layout lay;
    if (ps_rows_layout_get(h, p, dim, &lay, msg, sizeof msg) != CM_OK) {
        STAT_ADD(s, bad_messages, 1);
        return reply_error(s, h, CM_EINVAL, msg);
    }
    const size_t n = lay.n, row_bytes = lay.row_bytes, key_bytes = lay.key_bytes;
    const bool elided = lay.elided;
    p = lay.keys_at;
    /* A pull's reply is the header and the rows; a push carries at least as much, so the same
     * bound holds for it (it arrived within max_message). */
    if ((reply = reply_too_big(s, h, (double)n * row_bytes,
                               h->op == PS_OP_PULL ? "pull reply" : "push")) != NULL) {
        STAT_ADD(s, bad_messages, 1);
        return reply;
    }
    /* fp32 pulls gather straight into the reply and need no vals; an fp32 push is read where
     * its rows lie in the request when they are aligned for floats (an elided push's always
     * are: the body is, and 56 + 16 header bytes precede them), saving a copy of the batch. */
    const bool direct = h->op == PS_OP_PULL && h->codec == PS_CODEC_F32;
    const uint8_t *rows_at = p + key_bytes;
    const bool in_place = h->op == PS_OP_PUSH && h->codec == PS_CODEC_F32 &&
                          (uintptr_t)rows_at % _Alignof(float) == 0;
    /* A training pull keeps, with its key list, where the table found each row, and the elided
     * push that names it hands them back (emb_table_push_hinted): the push then touches the
     * rows without probing the hash table again. */
    const bool kept =
        h->op == PS_OP_PULL && !(h->flags & PS_FLAG_LOOKUP) && h->worker < s->cfg.n_workers;
    keys = malloc(n * sizeof *keys);
    vals = direct || in_place ? NULL : malloc(n * dim * sizeof *vals);
    if (kept || elided) hints = malloc(n * sizeof *hints);
    if (keys == NULL || (!direct && !in_place && vals == NULL) ||
        ((kept || elided) && hints == NULL)) {
        reply = reply_error(s, h, CM_ENOMEM, "server out of memory");
        goto out;
    }
    /* A push's rows are checked before its keys are resolved: a resent elided push whose key
     * list is gone is acknowledged by elided_keys, and must have been checked by then. */
    const float *grads = in_place ? (const float *)(const void *)rows_at : vals;
    if (h->op == PS_OP_PUSH)
        rc = in_place ? ps_f32_check(grads, n * dim, dim, &err)
                      : ps_codec_decode((ps_codec)h->codec, rows_at, n, dim, vals, &err);
    if (rc == CM_OK && elided && (reply = elided_keys(s, h, p, keys, hints, dup)) != NULL) goto out;
    if (rc == CM_OK && !elided) rc = ps_keys_decode(p, key_bytes, n, keys, &err);
    if (rc != CM_OK) {
        STAT_ADD(s, bad_messages, 1);
        reply = reply_error(s, h, rc, err);
        goto out;
    }
    /* An elided push's keys passed this check when they were pulled. */
    if (!elided && check_keys_owned(s, keys, n, msg, sizeof msg) != CM_OK) {
        STAT_ADD(s, bad_messages, 1);
        reply = reply_error(s, h, CM_EINVAL, msg);
        goto out;
    }
    /* Valid: only now is the request id consulted (a resend is acknowledged, not applied). */
    const bool dedup = h->op == PS_OP_PUSH && dup != NULL;
    if (dedup && ps_dedup_check_add(s->dedup, h->worker, h->req_id)) {
        STAT_ADD(s, duplicates, 1);
        *dup = true;
        reply = reply_ok(h, 0, NULL);
        goto out;
    }
    pthread_rwlock_rdlock(&s->tables_lock);
    emb_table *t = s->tables[h->table];
    if (h->op == PS_OP_PULL) {
        /* fp32 rows are gathered straight into the reply (one copy of the batch less); other
         * codecs are encoded from vals. */
        uint8_t *out = NULL;
        if ((reply = reply_ok(h, n * row_bytes, &out)) == NULL)
            rc = cm_err(&err, CM_ENOMEM, "server out of memory");
        float *dst = direct ? (float *)(void *)out : vals;
        if (rc == CM_OK)
            rc = h->flags & PS_FLAG_LOOKUP ? emb_table_lookup(t, keys, n, dst, NULL, &err)
                 : kept                    ? emb_table_pull_hinted(t, keys, n, dst, hints, &err)
                                           : emb_table_pull(t, keys, n, dst, &err);
        if (rc == CM_OK && !direct) ps_codec_encode((ps_codec)h->codec, vals, n, dim, out, NULL);
        if (rc != CM_OK && reply != NULL) {
            nng_msg_free(reply);
            reply = NULL;
        }
        if (rc == CM_OK) STAT_ADD(s, rows_pulled, n);
    } else {
        rc = hints ? emb_table_push_hinted(t, keys, n, grads, hints, &err)
                   : emb_table_push(t, keys, n, grads, &err);
        if (rc == CM_OK) ttl_after_push(s, h->table, t);
        if (rc == CM_OK) reply = reply_ok(h, 0, NULL);
        if (rc == CM_OK) STAT_ADD(s, rows_pushed, n);
        /* Not applied (or not acknowledged): a resend must be tried again. Either way a resend
         * waiting for this push (ps_dedup_check_add) may go on. */
        if (dedup && (rc != CM_OK || reply == NULL))
            ps_dedup_remove(s->dedup, h->worker, h->req_id);
        else if (dedup)
            ps_dedup_done(s->dedup, h->worker, h->req_id);
    }
    pthread_rwlock_unlock(&s->tables_lock);
    if (rc != CM_OK) {
        reply = reply_error(s, h, rc, err);
    } else if (kept) {
        /* Lookups are left out: evaluation pushes nothing, and would evict lists that
         * training pushes still name. */
        ps_keycache_put(s->pulled, h->worker, h->table, h->req_id, keys, hints, n);
        keys = NULL;
        hints = NULL;
    } else if (elided && with_keys != NULL) {
        ps_hdr e = *h;
        e.flags &= (uint8_t)~PS_FLAG_ELIDED;
        if (ps_msg_rows(&e, keys, n, p + PS_ELIDED_HEAD, row_bytes, with_keys) == CM_OK)
            ps_msg_seal(*with_keys);
        else
            *with_keys = NULL; /* the caller drops the backup rather than ship a bad update */
    }
out:
    free(err);
    free(keys);
    free(hints);
    free(vals);
    return reply;
}

/* A PUSH_DENSE's update and its reply, or (g NULL: a resent push not applied again) the reply
 * alone: empty; with PS_FLAG_READ_BACK the block's values after the update; with
 * PS_FLAG_DIGEST its step and the xxh3 of those values. The reply is allocated first, so an
 * update is never applied without its acknowledgement; the values and digest come from the
 * update's own pass, under its lock. */
static nng_msg *dense_reply(const ps_hdr *h, ps_dense *d, size_t n, const float *g)
{
    uint8_t *out;
    if (h->flags & PS_FLAG_DIGEST) {
        nng_msg *reply = reply_ok(h, PS_DIGEST_BYTES, &out);
        if (reply != NULL) {
            uint64_t step, digest;
            if (g != NULL)
                ps_dense_push_read(d, g, NULL, &digest, &step);
            else
                digest = ps_dense_digest(d, &step);
            memcpy(out, &step, 8);
            memcpy(out + 8, &digest, 8);
        }
        return reply;
    }
    if (h->flags & PS_FLAG_READ_BACK) {
        nng_msg *reply = reply_ok(h, n * sizeof(float), &out);
        if (reply != NULL && g != NULL) ps_dense_push_read(d, g, (float *)out, NULL, NULL);
        if (reply != NULL && g == NULL) ps_dense_pull(d, (float *)out);
        return reply;
    }
    nng_msg *reply = reply_ok(h, 0, NULL);
    if (reply != NULL && g != NULL) ps_dense_push(d, g);
    return reply;
}

/* PULL_DENSE, PUSH_DENSE, INIT_DENSE. `dup` as for handle_rows (PUSH_DENSE only): the request
 * id is looked up once the push has passed every check. */
static nng_msg *handle_dense(struct ps_server *s, const ps_hdr *h, const uint8_t *p, bool *dup)
{
    char msg[160];
    if (h->table >= s->cfg.n_dense || s->dense[h->table] == NULL) {
        snprintf(msg, sizeof msg, "dense block %u is not on shard %u", h->table, s->shard);
        STAT_ADD(s, bad_messages, 1);
        return reply_error(s, h, CM_EINVAL, msg);
    }
    size_t n = (size_t)s->cfg.dense[h->table].size;
    size_t want = h->op == PS_OP_PULL_DENSE ? 0 : n * sizeof(float);
    if (h->payload_len != want) {
        STAT_ADD(s, bad_messages, 1);
        snprintf(msg, sizeof msg, "dense payload of %" PRIu64 " bytes, expected %zu",
                 h->payload_len, want);
        return reply_error(s, h, CM_EINVAL, msg);
    }
    nng_msg *reply = NULL;
    if (h->op == PS_OP_PULL_DENSE &&
        (reply = reply_too_big(s, h,
                               h->flags & PS_FLAG_STATE
                                   ? (double)ps_dense_state_bytes(&s->cfg.dense[h->table])
                                   : (double)n * sizeof(float),
                               "dense pull reply")) != NULL)
        return reply;
    pthread_rwlock_rdlock(&s->tables_lock);
    ps_dense *d = s->dense[h->table];
    if (h->op == PS_OP_PULL_DENSE && (h->flags & PS_FLAG_STATE)) {
        uint8_t *out;
        if ((reply = reply_ok(h, ps_dense_state_bytes(&s->cfg.dense[h->table]), &out)) != NULL)
            ps_dense_state_get(d, out);
    } else if (h->op == PS_OP_PULL_DENSE) {
        uint8_t *out;
        if ((reply = reply_ok(h, n * sizeof(float), &out)) != NULL) ps_dense_pull(d, (float *)out);
    } else {
        const bool dedup = h->op == PS_OP_PUSH_DENSE && dup != NULL;
        /* Read where the values lie in the request when aligned for floats (the body is, and
         * the header is 56 bytes), else from an aligned copy. */
        float *copy = NULL;
        const float *g = (uintptr_t)p % _Alignof(float) == 0 ? (const float *)(const void *)p
                                                             : (copy = malloc(n * sizeof *copy));
        if (copy) memcpy(copy, p, n * sizeof *copy);
        bool finite = g != NULL && cm_f32_first_nonfinite(g, n) == n;
        if (g == NULL) {
            reply = reply_error(s, h, CM_ENOMEM, "server out of memory");
        } else if (!finite) {
            STAT_ADD(s, bad_messages, 1);
            reply = reply_error(s, h, CM_EINVAL, "non-finite value in a dense push");
        } else if (dedup && ps_dedup_check_add(s->dedup, h->worker, h->req_id)) {
            /* A resend: acknowledged (read back: with the block as it is), not applied. */
            STAT_ADD(s, duplicates, 1);
            *dup = true;
            reply = dense_reply(h, d, n, NULL);
        } else if (h->op == PS_OP_PUSH_DENSE) {
            reply = dense_reply(h, d, n, g);
            if (dedup && reply == NULL) ps_dedup_remove(s->dedup, h->worker, h->req_id);
            if (dedup && reply != NULL) ps_dedup_done(s->dedup, h->worker, h->req_id);
        } else {
            ps_hdr r = *h;
            r.flags = (uint8_t)ps_dense_init(d, g);
            reply = reply_ok(&r, 0, NULL);
        }
        free(copy);
    }
    pthread_rwlock_unlock(&s->tables_lock);
    return reply;
}

/* ---- checkpoints ---- */

static int shard_paths(const char *dir, uint32_t shard, char *out, size_t n, char *tmp, size_t tn)
{
    int a = snprintf(out, n, "%s/shard-%u", dir, shard);
    int b = snprintf(tmp, tn, "%s/shard-%u.tmp", dir, shard);
    return (a < 0 || (size_t)a >= n || b < 0 || (size_t)b >= tn) ? CM_EINVAL : CM_OK;
}

static int shard_manifest(struct ps_server *s, char *buf, size_t n)
{
    char body[16000];
    int len = 0;
    for (uint32_t i = 0; i < s->cfg.n_tables && len >= 0 && (size_t)len < sizeof body; i++)
        len += snprintf(body + len, sizeof body - (size_t)len, "table %s %016" PRIx64 "\n",
                        s->cfg.tables[i].name, ps_table_fingerprint(&s->cfg.tables[i]));
    for (uint32_t i = 0; i < s->cfg.n_dense && len >= 0 && (size_t)len < sizeof body; i++)
        len += snprintf(body + len, sizeof body - (size_t)len, "dense %s %016" PRIx64 "\n",
                        s->cfg.dense[i].name, ps_dense_fingerprint(&s->cfg.dense[i]));
    if (len < 0 || (size_t)len >= sizeof body) return -1;
    return ps_shard_manifest_text(s->shard, s->cfg.n_shards, body, buf, n);
}

static int save_shard(struct ps_server *s, const char *dir, char **errptr)
{
    char final[2048], tmp[2048], path[2300], manifest[16384];
    if (shard_paths(dir, s->shard, final, sizeof final, tmp, sizeof tmp) != CM_OK)
        return cm_err(errptr, CM_EINVAL, "checkpoint path too long: %s", dir);
    int rc = cm_rmtree(tmp, errptr);
    if (rc == CM_OK) rc = cm_mkdirs(tmp, errptr);
    for (uint32_t i = 0; rc == CM_OK && i < s->cfg.n_tables; i++) {
        snprintf(path, sizeof path, "%s/table-%s", tmp, s->cfg.tables[i].name);
        rc = emb_table_snapshot(s->tables[i], path, errptr);
    }
    for (uint32_t i = 0; rc == CM_OK && i < s->cfg.n_dense; i++) {
        if (s->dense[i] == NULL) continue;
        snprintf(path, sizeof path, "%s/dense-%s.bin", tmp, s->cfg.dense[i].name);
        rc = ps_dense_save(s->dense[i], path, errptr);
    }
    if (rc == CM_OK) {
        int len = shard_manifest(s, manifest, sizeof manifest);
        snprintf(path, sizeof path, "%s/MANIFEST", tmp);
        rc = len < 0 ? cm_err(errptr, CM_ERR, "shard manifest too long")
                     : cm_write_file_atomic(path, manifest, (size_t)len, errptr);
    }
    if (rc == CM_OK) rc = cm_fsync_dir(tmp, errptr);
    if (rc == CM_OK) rc = cm_dir_swap(tmp, final, errptr);
    if (rc != CM_OK) cm_rmtree(tmp, NULL);
    return rc;
}

static int load_shard(struct ps_server *s, const char *dir, char **errptr)
{
    char final[2048], tmp[2048], path[2300], manifest[16384];
    if (shard_paths(dir, s->shard, final, sizeof final, tmp, sizeof tmp) != CM_OK)
        return cm_err(errptr, CM_EINVAL, "checkpoint path too long: %s", dir);
    snprintf(path, sizeof path, "%s/MANIFEST", final);
    char *text = NULL;
    size_t len = 0;
    int rc = cm_read_file(path, (void **)&text, &len, errptr);
    if (rc != CM_OK) return rc;
    int want = shard_manifest(s, manifest, sizeof manifest);
    if (want < 0 || (size_t)want != len || memcmp(text, manifest, len) != 0)
        rc = cm_err(errptr, CM_ECORRUPT,
                    "%s does not match this shard (index, shard count, table configs) or is "
                    "corrupt",
                    path);
    free(text);
    emb_table *tables[PS_MAX_TABLES] = {0};
    ps_dense *dense[PS_MAX_DENSE] = {0};
    for (uint32_t i = 0; rc == CM_OK && i < s->cfg.n_tables; i++) {
        emb_table_config cfg = *emb_table_get_config(s->tables[i]);
        snprintf(path, sizeof path, "%s/table-%s", final, s->cfg.tables[i].name);
        /* The live table owns its spill path: the restored one gets the other of two
         * siblings, the configured path and it with "+load" (a character no table name has,
         * so no other table's path), so loads alternate between them instead of lengthening
         * the name on every load. */
        char spill[2100];
        if (cfg.spill_path) {
            size_t n = strlen(cfg.spill_path);
            if (n > 5 && strcmp(cfg.spill_path + n - 5, "+load") == 0)
                snprintf(spill, sizeof spill, "%.*s", (int)(n - 5), cfg.spill_path);
            else
                snprintf(spill, sizeof spill, "%s+load", cfg.spill_path);
            cfg.spill_path = spill;
        }
        rc = emb_table_restore(path, &cfg, &tables[i], errptr);
        if (rc == CM_OK) emb_table_set_team(tables[i], s->team);
    }
    for (uint32_t i = 0; rc == CM_OK && i < s->cfg.n_dense; i++) {
        if (s->dense[i] == NULL) continue;
        snprintf(path, sizeof path, "%s/dense-%s.bin", final, s->cfg.dense[i].name);
        rc = ps_dense_load(path, &s->cfg.dense[i], &dense[i], errptr);
    }
    if (rc == CM_OK) {
        pthread_rwlock_wrlock(&s->tables_lock);
        for (uint32_t i = 0; i < s->cfg.n_tables; i++) {
            emb_table *old = s->tables[i];
            s->tables[i] = tables[i];
            tables[i] = old;
            /* The restored step's period counts as expired: the next push into a new one
             * expires, as in the run that saved it. */
            uint64_t ttl = emb_table_get_config(s->tables[i])->ttl_steps;
            if (ttl > 0)
                __atomic_store_n(&s->ttl_epoch[i], emb_table_step(s->tables[i]) / ttl_period(ttl),
                                 __ATOMIC_RELAXED);
        }
        for (uint32_t i = 0; i < s->cfg.n_dense; i++) {
            if (dense[i] == NULL) continue;
            ps_dense *old = s->dense[i];
            s->dense[i] = dense[i];
            dense[i] = old;
        }
        pthread_rwlock_unlock(&s->tables_lock);
    }
    for (uint32_t i = 0; i < PS_MAX_TABLES; i++)
        emb_table_destroy(tables[i]);
    for (uint32_t i = 0; i < PS_MAX_DENSE; i++)
        ps_dense_destroy(dense[i]);
    return rc;
}

/* Whether dir lies within root (a realpath): no ".." component, and the deepest part of it
 * that exists resolves (links followed) to root or below; what does not exist yet is created
 * by SAVE as plain directories under it. */
static bool dir_within(const char *root, const char *dir)
{
    for (const char *c = dir; *c;) {
        size_t n = strcspn(c, "/");
        if (n == 2 && c[0] == '.' && c[1] == '.') return false;
        c += n;
        c += *c == '/';
    }
    char probe[1025], real[PATH_MAX];
    snprintf(probe, sizeof probe, "%s", dir);
    for (;;) {
        struct stat st;
        if (stat(probe, &st) == 0) break;
        char *slash = strrchr(probe, '/');
        if (slash == NULL) {
            snprintf(probe, sizeof probe, ".");
            break;
        }
        if (slash == probe) { /* "/x" with no /x */
            probe[1] = '\0';
            break;
        }
        *slash = '\0';
    }
    if (realpath(probe, real) == NULL) return false;
    size_t rl = strlen(root);
    return strncmp(real, root, rl) == 0 && (real[rl] == '\0' || real[rl] == '/' || rl == 1);
}

static nng_msg *handle_save_load(struct ps_server *s, const ps_hdr *h, const uint8_t *p)
{
    if (h->payload_len == 0 || h->payload_len > PS_CKPT_DIR_MAX ||
        memchr(p, '\0', h->payload_len)) {
        STAT_ADD(s, bad_messages, 1);
        return reply_error(s, h, CM_EINVAL, "checkpoint directory must be 1..1024 bytes, no NUL");
    }
    char dir[PS_CKPT_DIR_MAX + 1];
    memcpy(dir, p, h->payload_len);
    dir[h->payload_len] = '\0';
    char *err = NULL;
    int rc;
    if (s->ckpt_root != NULL && !dir_within(s->ckpt_root, dir)) {
        char msg[2200];
        snprintf(msg, sizeof msg, "checkpoint directory %s is outside this PS's checkpoint root %s",
                 dir, s->ckpt_root);
        return reply_error(s, h, CM_EINVAL, msg);
    }
    if (h->op == PS_OP_SAVE) {
        pthread_rwlock_rdlock(&s->tables_lock);
        rc = cm_mkdirs(dir, &err);
        if (rc == CM_OK) rc = save_shard(s, dir, &err);
        pthread_rwlock_unlock(&s->tables_lock);
    } else {
        rc = load_shard(s, dir, &err);
    }
    nng_msg *reply = rc == CM_OK ? reply_ok(h, 0, NULL) : reply_error(s, h, rc, err);
    free(err);
    return reply;
}

/* STATS reply: ps_server_stats, then n_tables emb_table_stats (native layout; both ends run
 * the same build). */
static nng_msg *handle_stats(struct ps_server *s, const ps_hdr *h)
{
    uint8_t *p;
    size_t n = s->cfg.n_tables;
    const size_t bytes = sizeof(ps_server_stats) + n * sizeof(emb_table_stats);
    nng_msg *m = reply_too_big(s, h, (double)bytes, "stats reply");
    if (m != NULL) return m;
    if ((m = reply_ok(h, bytes, &p)) == NULL) return NULL;
    ps_server_stats_get(s, (ps_server_stats *)(void *)p);
    pthread_rwlock_rdlock(&s->tables_lock);
    for (size_t i = 0; i < n; i++) {
        emb_table_stats ts;
        emb_table_stats_get(s->tables[i], &ts);
        memcpy(p + sizeof(ps_server_stats) + i * sizeof ts, &ts, sizeof ts);
    }
    pthread_rwlock_unlock(&s->tables_lock);
    return m;
}

/* HELLO payload: u32 shard, u32 shards, u32 workers, u32 tables, u32 dense, then a u64
 * fingerprint per table and per dense block. */
static nng_msg *handle_hello(struct ps_server *s, const ps_hdr *h, const uint8_t *p)
{
    char msg[256];
    uint32_t v[5];
    if (h->payload_len < sizeof v) goto bad;
    memcpy(v, p, sizeof v);
    if (v[3] > PS_MAX_TABLES || v[4] > PS_MAX_DENSE ||
        h->payload_len != sizeof v + 8ull * (v[3] + v[4]))
        goto bad;
    if (v[0] != s->shard || v[1] != s->cfg.n_shards || v[2] != s->cfg.n_workers) {
        snprintf(msg, sizeof msg,
                 "client expects shard %u of %u with %u workers; this is shard %u of %u with %u",
                 v[0], v[1], v[2], s->shard, s->cfg.n_shards, s->cfg.n_workers);
        return reply_error(s, h, CM_EINVAL, msg);
    }
    if (v[3] != s->cfg.n_tables || v[4] != s->cfg.n_dense) {
        snprintf(msg, sizeof msg, "client has %u tables and %u dense blocks; server %u and %u",
                 v[3], v[4], s->cfg.n_tables, s->cfg.n_dense);
        return reply_error(s, h, CM_EINVAL, msg);
    }
    for (uint32_t i = 0; i < v[3] + v[4]; i++) {
        uint64_t fp;
        memcpy(&fp, p + sizeof v + 8 * i, 8);
        bool table = i < v[3];
        uint64_t mine = table ? ps_table_fingerprint(&s->cfg.tables[i])
                              : ps_dense_fingerprint(&s->cfg.dense[i - v[3]]);
        if (fp != mine) {
            snprintf(msg, sizeof msg, "%s '%s' is configured differently on the client",
                     table ? "table" : "dense block",
                     table ? s->cfg.tables[i].name : s->cfg.dense[i - v[3]].name);
            return reply_error(s, h, CM_EINVAL, msg);
        }
    }
    /* A restarted worker learns the barrier id the others are at (or will use next). */
    uint8_t *out;
    nng_msg *m = reply_ok(h, 8, &out);
    if (m) {
        pthread_mutex_lock(&s->mu);
        uint64_t next = s->barrier_want ? s->barrier_want : s->barrier_done + 1;
        memcpy(out, &next, 8);
        pthread_mutex_unlock(&s->mu);
    }
    return m;
bad:
    STAT_ADD(s, bad_messages, 1);
    return reply_error(s, h, CM_EINVAL, "malformed HELLO");
}

/* ---- request checks ---- */

/* The checks of a request's header that every op shares (besides its framing): true, with
 * text, when it is refused as malformed. A backup applies them to the requests its primary
 * forwards too, which passed them there. */
static bool header_refused(const struct ps_server *s, const ps_hdr *h, char *text, size_t n)
{
    if ((h->op == PS_OP_CLOCK || h->op == PS_OP_BARRIER || h->op == PS_OP_STATS ||
         h->op == PS_OP_SHUTDOWN) &&
        h->payload_len != 0)
        snprintf(text, n, "this op carries no payload");
    else if (h->flags & ~ps_op_flags(h->op))
        /* A flag this server does not define for the op: a feature it would silently ignore
         * (a lookup applied as a creating pull, say) or garbage. */
        snprintf(text, n, "flags 0x%02x are not defined for op %u", h->flags, h->op);
    else if (h->op != PS_OP_REPLICATE &&
             PS_HDR_BYTES + (uint64_t)h->payload_len > s->cfg.max_msg_bytes)
        /* Only a backup's socket takes more (a forward's own header and sequence number). */
        snprintf(text, n, "a request of %llu bytes exceeds max_message (%llu)",
                 (unsigned long long)(PS_HDR_BYTES + (uint64_t)h->payload_len),
                 (unsigned long long)s->cfg.max_msg_bytes);
    else if (h->worker >= s->cfg.n_workers && h->op != PS_OP_REPLICATE && h->op != PS_OP_STATS)
        /* Its updates, clocks and de-duplication would be a worker the job does not have. */
        snprintf(text, n, "worker %u is not one of the cluster's %u known workers", h->worker,
                 s->cfg.n_workers);
    else
        return false;
    return true;
}

/* ---- replication ---- */

/* What a primary ships to its backup: whatever changes the shard's state. A stop poll does
 * (shard 0's record of each worker's poll steps and the stop fixed from them): a backup that
 * takes shard 0 over must answer the next poll with the stop the workers may have learnt. */
static bool is_update(const ps_hdr *h)
{
    return h->op == PS_OP_PUSH || h->op == PS_OP_PUSH_DENSE || h->op == PS_OP_INIT_DENSE ||
           h->op == PS_OP_LOAD || h->op == PS_OP_SHUTDOWN ||
           (h->op == PS_OP_BARRIER && (h->flags & PS_FLAG_POLL));
}

static int16_t reply_status(nng_msg *m)
{
    ps_hdr h;
    memcpy(&h, nng_msg_body(m), sizeof h);
    return h.status;
}

/* Applies one update. A push seen before (a resend) is acknowledged without being applied
 * again; *dup tells. with_keys: see handle_rows. */
static nng_msg *apply_update(struct ps_server *s, const ps_hdr *h, const uint8_t *p, bool *dup,
                             nng_msg **with_keys)
{
    *dup = false;
    /* Pushes are validated first and only then looked up among those applied (handle_rows,
     * handle_dense), so a malformed resend is answered as malformed, not acknowledged. */
    nng_msg *r;
    switch (h->op) {
    case PS_OP_PUSH:
        r = handle_rows(s, h, p, with_keys, dup);
        break;
    case PS_OP_PUSH_DENSE:
    case PS_OP_INIT_DENSE:
        r = handle_dense(s, h, p, dup);
        break;
    case PS_OP_LOAD:
        r = handle_save_load(s, h, p);
        break;
    case PS_OP_BARRIER: /* a stop poll (is_update) */
        r = handle_poll(s, h);
        break;
    default:
        r = reply_ok(h, 0, NULL);
        break; /* SHUTDOWN: the caller stops */
    }
    return r;
}

/* Backup: publishes what the log holds to STATS (read without repl_mu); s->repl_mu held. */
static void log_note(struct ps_server *s)
{
    __atomic_store_n(&s->st.replica_held, (uint64_t)s->log.n, __ATOMIC_RELAXED);
    __atomic_store_n(&s->st.replica_held_bytes, (uint64_t)s->log.bytes, __ATOMIC_RELAXED);
}

static const char *update_name(uint16_t op)
{
    switch (op) {
    case PS_OP_PUSH:
        return "PUSH";
    case PS_OP_PUSH_DENSE:
        return "PUSH_DENSE";
    case PS_OP_INIT_DENSE:
        return "INIT_DENSE";
    case PS_OP_LOAD:
        return "LOAD";
    case PS_OP_BARRIER:
        return "stop poll";
    default:
        return "SHUTDOWN";
    }
}

/* Backup: true once an update from the primary failed to apply here (diverge). */
static bool diverged(struct ps_server *s)
{
    return __atomic_load_n(&s->st.replica_diverged_seq, __ATOMIC_ACQUIRE) != 0;
}

/* Backup, s->repl_mu held: update seq (op) failed to apply here, for the reason in the error
 * reply r (NULL: out of memory). The primary applied it, so this backup's tables are no longer
 * its primary's: serving them after a takeover would train on rows nobody asked for, behind
 * acknowledgements that all is well. From now on the backup refuses every REPLICATE (its
 * primary drops it, as an unreachable one) and every client request (the clients fail, and the
 * run resumes from its last checkpoint). The first failure is the one reported. */
static void diverge(struct ps_server *s, uint64_t seq, uint16_t op, nng_msg *r)
{
    if (diverged(s)) return;
    char why[768] = "out of memory";
    if (r != NULL)
        ps_error_text((const uint8_t *)nng_msg_body(r) + PS_HDR_BYTES,
                      nng_msg_len(r) - PS_HDR_BYTES, why, sizeof why);
    snprintf(s->diverged_why, sizeof s->diverged_why,
             "shard %u backup diverged from its primary: update %" PRIu64
             " (%s) failed to apply here: %s; it serves nothing (resume from a checkpoint)",
             s->shard, seq, update_name(op), why);
    fprintf(stderr, "ember ps: %s\n", s->diverged_why);
    __atomic_store_n(&s->st.replica_diverged, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&s->st.replica_diverged_seq, seq, __ATOMIC_RELEASE);
}

/* Backup: applies a logged update (validated when it arrived); s->repl_mu held. */
static void apply_logged(struct ps_server *s, ps_replog_entry *e)
{
    ps_hdr h;
    bool dup;
    memcpy(&h, e->msg, sizeof h);
    nng_msg *r = apply_update(s, &h, e->msg + PS_HDR_BYTES, &dup, NULL);
    if (r == NULL || reply_status(r) != 0) diverge(s, e->seq, h.op, r);
    if (r) nng_msg_free(r);
    if (h.op == PS_OP_SHUTDOWN) ps_server_stop(s);
}

/* Backup: the clients have come over. Applies everything received, gaps and all (an update
 * missing from the sequence was never acknowledged to its client, which resends it here). A
 * backup diverged before or by one of these updates does not take over: it would fence a
 * primary that may be alive (a client can fail over on a timeout) for a shard that serves
 * nothing; its primary drops it on its next REPLICATE instead. */
static void promote(struct ps_server *s)
{
    pthread_mutex_lock(&s->repl_mu);
    ps_replog_entry *e;
    size_t n = s->log.n;
    while (!s->promoted && !diverged(s) && (e = ps_replog_pop(&s->log)) != NULL) {
        apply_logged(s, e);
        free(e);
    }
    log_note(s);
    if (!s->promoted && !diverged(s)) {
        __atomic_store_n(&s->promoted, true, __ATOMIC_RELAXED);
        s->st.promoted = 1;
        fprintf(stderr,
                "ember ps: shard %u backup takes over as primary (%" PRIu64
                " updates received, %zu applied out of order)\n",
                s->shard, s->next_seq - 1, n);
    }
    pthread_mutex_unlock(&s->repl_mu);
}

/* REPLICATE payload: u64 seq, then the primary's request as it arrived. Acknowledged on
 * receipt; applied once every earlier update has been. */
static nng_msg *handle_replicate(struct ps_server *s, const ps_hdr *h, const uint8_t *p)
{
    char *err = NULL;
    ps_hdr ih;
    uint64_t seq;
    if (!s->is_backup) {
        STAT_ADD(s, bad_messages, 1); /* no primary sends one here: a misdirected message */
        return reply_error(s, h, CM_EINVAL, "REPLICATE sent to a shard that is not a backup");
    }
    if (h->payload_len < 8 + PS_HDR_BYTES) goto bad;
    memcpy(&seq, p, 8);
    /* A primary resolves an elided push's keys before it ships it: the backup never saw the
     * pull it names. */
    if (ps_wire_open(p + 8, h->payload_len - 8, &ih, &err) != CM_OK || !is_update(&ih) ||
        (ih.op == PS_OP_PUSH && (ih.flags & PS_FLAG_ELIDED)))
        goto bad;
    /* Refused before it is acknowledged and takes its sequence number: the primary checked
     * the request it forwards, so one failing here is not its, and the genuine update under
     * that number must not be skipped as already held. */
    char text[96];
    if (header_refused(s, &ih, text, sizeof text)) {
        cm_err(&err, CM_EINVAL, "forwarded update: %s", text);
        goto bad;
    }
    nng_msg *reply;
    pthread_mutex_lock(&s->repl_mu);
    if (s->promoted) {
        pthread_mutex_unlock(&s->repl_mu);
        reply = reply_error(s, h, CM_EINVAL, "this backup has taken over the shard");
        if (reply) ((ps_hdr *)nng_msg_body(reply))->status = PS_STATUS_FENCED;
        return reply;
    }
    /* A primary has at most its contexts' updates in flight, so a sequence number far past
     * the next one is no primary's: holding it (until a gap that never fills) would let one
     * sender grow the log without bound. */
    const uint64_t ahead = 4 * (uint64_t)s->n_ctx > 4096 ? 4 * (uint64_t)s->n_ctx : 4096;
    if (seq >= s->next_seq + ahead) {
        pthread_mutex_unlock(&s->repl_mu);
        STAT_ADD(s, bad_messages, 1);
        return reply_error(s, h, CM_EINVAL, "forwarded update too far ahead of the next one");
    }
    /* Held ahead of a gap, a forward costs its bytes until the gap fills; a primary's held
     * forwards are fewer than its contexts, each within max_message (log_max), so more is no
     * primary's, and the log's memory stays bounded. Only a forward that would be held is
     * refused: the update next in line (which fills the gap) always goes through. */
    const size_t len = h->payload_len - 8;
    if (!diverged(s) && seq > s->next_seq && !ps_replog_has(&s->log, seq) &&
        (s->log.bytes > s->log_max || len > s->log_max - s->log.bytes)) {
        const uint64_t held = s->log.bytes, next = s->next_seq;
        pthread_mutex_unlock(&s->repl_mu);
        STAT_ADD(s, bad_messages, 1);
        char why[256];
        snprintf(why, sizeof why,
                 "forwarded update %" PRIu64 " (%zu bytes) would hold more than %" PRIu64
                 " bytes ahead of update %" PRIu64 " (%" PRIu64 " held; contexts x max_message)",
                 seq, len, s->log_max, next, held);
        return reply_error(s, h, CM_EINVAL, why);
    }
    bool ok = true;
    if (!diverged(s)) {
        STAT_ADD(s, replicated, 1);
        ok = seq < s->next_seq || ps_replog_put(&s->log, seq, p + 8, len);
        ps_replog_entry *e;
        while (!diverged(s) && s->log.head && s->log.head->seq == s->next_seq &&
               (e = ps_replog_pop(&s->log))) {
            apply_logged(s, e);
            free(e);
            s->next_seq++;
        }
        log_note(s);
    }
    pthread_mutex_unlock(&s->repl_mu);
    /* Diverged before, or by this update or one held before it that it let through: refused,
     * so that the primary drops this backup rather than count on it. An update applied on
     * arrival is answered after it is applied, so a failure of it is never acknowledged. */
    if (diverged(s)) return reply_error(s, h, CM_ECORRUPT, s->diverged_why);
    return ok ? reply_ok(h, 0, NULL) : reply_error(s, h, CM_ENOMEM, "backup out of memory");
bad:
    STAT_ADD(s, bad_messages, 1);
    nng_msg *m = reply_error(s, h, CM_ECORRUPT, err ? err : "malformed REPLICATE");
    free(err);
    return m;
}

/* The dialer's longest wait between attempts to reach the backup: a backup that is up has a
 * connection again within this of losing one. */
#define PS_BACKUP_REDIAL_MS 500

/* nng, primary: a connection to the backup opened or closed (there is one at a time: one
 * dialer). */
static void backup_pipe_event(nng_pipe p, nng_pipe_ev ev, void *arg)
{
    struct ps_server *s = arg;
    uint32_t id = (uint32_t)nng_pipe_id(p);
    if (ev == NNG_PIPE_EV_ADD_POST)
        __atomic_store_n(&s->backup_pipe, id, __ATOMIC_RELEASE);
    else
        __atomic_compare_exchange_n(&s->backup_pipe, &id, 0, false, __ATOMIC_ACQ_REL,
                                    __ATOMIC_RELAXED);
}

static bool backup_connected(struct ps_server *s)
{
    return __atomic_load_n(&s->backup_pipe, __ATOMIC_ACQUIRE) != 0;
}

/* Primary: the backup did not acknowledge; the shard goes on unreplicated. */
static void replica_lost(struct ps_server *s, const char *why)
{
    if (__atomic_exchange_n(&s->dropped, true, __ATOMIC_RELAXED)) return;
    s->st.replica_dropped = 1;
    fprintf(stderr, "ember ps: shard %u: backup %s lost (%s); continuing unreplicated\n", s->shard,
            s->replica_url, why);
}

/* What a REPLICATE adds to the request it carries. */
#define PS_FORWARD_OVERHEAD (PS_HDR_BYTES + 8u)

static nng_msg *forward_msg(const void *req, size_t len, uint64_t seq)
{
    ps_hdr h;
    memset(&h, 0, sizeof h);
    h.op = PS_OP_REPLICATE;
    nng_msg *m;
    uint8_t *p;
    if (ps_msg_new(&h, 8 + len, &m, &p) != CM_OK) return NULL;
    memcpy(p, &seq, 8);
    memcpy(p + 8, req, len);
    ps_msg_seal(m);
    return m;
}

/* Ends the wait of the resends parked on an update (dups, detached from it): their replies
 * go out when `send`, else (the update was not acknowledged) are dropped. */
static void dups_release(srv_ctx *dups, bool send)
{
    for (srv_ctx *d = dups, *next; d; d = next) {
        next = d->next;
        nng_msg *reply = d->held;
        d->held = NULL;
        if (send)
            ctx_send(d, reply);
        else
            nng_msg_free(reply);
    }
}

/* Completion of a context's REPLICATE: answer the client now. */
static void repl_cb(void *arg)
{
    srv_ctx *c = arg;
    struct ps_server *s = c->s;
    int rv = nng_aio_result(c->raio);
    if (c->rstate == RS_SEND && rv == 0) {
        c->rstate = RS_RECV;
        nng_ctx_recv(c->rctx, c->raio);
        return;
    }
    __atomic_sub_fetch(&s->repl_inflight, 1, __ATOMIC_RELAXED); /* every path below ends it */
    const bool answered = c->rstate == RS_RECV && rv == 0;
    int16_t st = 0;
    /* A refusal's reason goes to the log with the drop: a diverged backup's names the update
     * it failed to apply. */
    char why[600] = "it refused an update";
    if (answered) {
        nng_msg *m = ps_aio_msg_take(c->raio);
        ps_hdr h;
        const bool sound = ps_wire_open(nng_msg_body(m), nng_msg_len(m), &h, NULL) == CM_OK;
        st = sound ? h.status : CM_ECORRUPT;
        if (sound && st < 0 && st != PS_STATUS_FENCED && h.payload_len > 0) {
            char text[512];
            ps_error_text((const uint8_t *)nng_msg_body(m) + PS_HDR_BYTES, h.payload_len, text,
                          sizeof text);
            snprintf(why, sizeof why, "it refused an update: %s", text);
        }
        nng_msg_free(m);
    }
    /* No resend parks on this update any more: from here it is settled one way or another.
     * A fence is raised under the same lock: a resend that no longer finds this update
     * (repl_original) must find the fence instead (handle_update), or it would be taken for
     * a duplicate and acknowledged, an update the backup refused and will never have. */
    bool fenced_now = false;
    pthread_mutex_lock(&s->repl_mu);
    if (answered && st == PS_STATUS_FENCED)
        fenced_now = !__atomic_exchange_n(&s->fenced, true, __ATOMIC_RELAXED);
    srv_ctx *dups = c->dups;
    c->dups = NULL;
    c->state = ST_SEND;
    pthread_mutex_unlock(&s->repl_mu);
    if (rv == NNG_ECLOSED || rv == NNG_ECANCELED) {
        if (c->rstate == RS_SEND) nng_msg_free(ps_aio_msg_take(c->raio));
        nng_msg_free(c->held);
        c->held = NULL;
        dups_release(dups, false);
        return;
    }
    if (c->rstate == RS_SEND) {
        nng_msg_free(ps_aio_msg_take(c->raio));
        replica_lost(s, nng_strerror(rv));
    } else if (rv != 0) {
        replica_lost(s, nng_strerror(rv));
    } else {
        if (st == PS_STATUS_FENCED) {
            /* The clients have gone to the backup: this update must not be acknowledged
             * here, and nothing more may be served. The client resends it to the backup. */
            if (fenced_now)
                fprintf(stderr, "ember ps: shard %u: the backup has taken over; stopping\n",
                        s->shard);
            nng_msg_free(c->held);
            c->held = NULL;
            dups_release(dups, false);
            ps_server_stop(s);
            return;
        }
        if (st != 0)
            replica_lost(s, why);
        else
            STAT_ADD(s, replicated, 1);
        if (st == 0 && c->stop_after) __atomic_store_n(&s->stop_forwarded, true, __ATOMIC_RELAXED);
    }
    nng_msg *reply = c->held;
    c->held = NULL;
    if (c->stop_after) stop_for_shutdown(s);
    ctx_send(c, reply);
    dups_release(dups, true);
}

/* Primary with a backup, repl_mu held: the context whose update h is a resend of, while that
 * update waits for the backup's acknowledgement; NULL when none does (it was acknowledged, or
 * the backup dropped). */
static srv_ctx *repl_original(struct ps_server *s, const ps_hdr *h)
{
    for (uint32_t i = 0; i < s->n_ctx; i++) {
        srv_ctx *o = &s->ctxs[i];
        if (o->state == ST_REPL && o->req.op == h->op && o->req.worker == h->worker &&
            o->req.req_id == h->req_id)
            return o;
    }
    return NULL;
}

/* An update on a shard that may replicate it. Returns true when the reply waits for the
 * backup's acknowledgement. */
static bool handle_update(struct ps_server *s, srv_ctx *c, const ps_hdr *h, const uint8_t *body,
                          size_t len, nng_msg **reply)
{
    bool replicate = s->has_backup && !__atomic_load_n(&s->dropped, __ATOMIC_RELAXED), dup;
    /* A SHUTDOWN is not held for a backup with no connection (dead: its process's sockets
     * closed with it): the forward would wait replica_timeout for it, and the cluster's stop
     * with it. Dropped, it is told to stop on the way out if it is back by then (stop_backup). */
    if (replicate && h->op == PS_OP_SHUTDOWN && !backup_connected(s)) {
        replica_lost(s, "no connection to it at SHUTDOWN");
        replicate = false;
    }
    const bool elided = h->op == PS_OP_PUSH && (h->flags & PS_FLAG_ELIDED);
    nng_msg *fwd = NULL, *with_keys = NULL;
    srv_ctx *original = NULL;
    /* An elided push goes to the backup with its keys (their u32 length, then up to
     * PS_VARINT_MAX bytes a key, for the 16-byte head), and the
     * backup takes no forward of a request over max_message: one that might not fit is
     * refused as not held, before it is applied, so the client sends it with its keys (and
     * itself refuses one past max_message, naming the sizes). */
    if (replicate && elided &&
        len - PS_ELIDED_HEAD + 4 + (uint64_t)h->count * PS_VARINT_MAX > s->cfg.max_msg_bytes) {
        *reply = reply_error(s, h, PS_STATUS_NO_KEYS,
                             "elided push too large to forward with its keys: send the keys");
        return false;
    }
    if (replicate) {
        pthread_mutex_lock(&s->repl_mu);
        /* Fenced since handle() looked (repl_cb): neither applied nor answered here. */
        if (__atomic_load_n(&s->fenced, __ATOMIC_RELAXED)) {
            pthread_mutex_unlock(&s->repl_mu);
            *reply = NULL;
            return false;
        }
    }
    *reply = apply_update(s, h, body + PS_HDR_BYTES, &dup, replicate ? &with_keys : NULL);
    if (replicate && *reply && dup && reply_status(*reply) == 0 &&
        (original = repl_original(s, h)) != NULL) {
        /* A resend (nng's, after its resend interval or a reconnect) of an update the backup
         * has not acknowledged yet: acknowledged now, the client would take as safe an update
         * that dies with this process if the forward does. Its reply waits for the first
         * copy's acknowledgement (repl_cb). */
        c->held = *reply;
        *reply = NULL;
        c->state = ST_DUP;
        c->next = original->dups;
        original->dups = c;
    }
    if (replicate && *reply && !dup && reply_status(*reply) == 0) {
        /* An elided push goes to the backup with its keys (handle_rows re-encoded it). */
        if (!elided || with_keys != NULL)
            fwd = with_keys ? forward_msg(nng_msg_body(with_keys), nng_msg_len(with_keys), ++s->seq)
                            : forward_msg(body, len, ++s->seq);
        if (fwd == NULL) replica_lost(s, "out of memory");
    }
    if (fwd != NULL) {
        /* Marked under repl_mu, so a resend arriving from now on finds it (repl_original). */
        c->req = *h;
        c->dups = NULL;
        c->state = ST_REPL;
    }
    if (replicate) pthread_mutex_unlock(&s->repl_mu);
    if (h->op == PS_OP_SHUTDOWN && s->has_backup)
        __atomic_store_n(&s->stop_asked, true, __ATOMIC_RELAXED);
    if (with_keys) nng_msg_free(with_keys);
    if (original != NULL) return true;
    if (fwd == NULL) {
        if (h->op == PS_OP_SHUTDOWN) stop_for_shutdown(s);
        return false;
    }
    c->held = *reply;
    c->stop_after = h->op == PS_OP_SHUTDOWN;
    *reply = NULL;
    c->rstate = RS_SEND;
    __atomic_add_fetch(&s->repl_inflight, 1, __ATOMIC_RELAXED);
    nng_aio_set_msg(c->raio, fwd);
    nng_ctx_send(c->rctx, c->raio);
    return true;
}

/* Backup: a request from a client (anything but REPLICATE, STATS and SHUTDOWN) that passed the
 * header checks means the clients have failed over, and the backup takes over (promote); one
 * refused as malformed must not make it take over (and fence its primary). True when the request
 * must be refused instead: the backup diverged from its primary and serves nothing (diverge).
 * A SHUTDOWN is served in any state and makes no takeover: it serves no rows, and it is how a
 * cluster's shutdown reaches a backup its primary no longer replicates to (stop_backup), which
 * must stop, not take over a shard it may hold stale or diverged rows of. */
static bool backup_refuses(struct ps_server *s, const ps_hdr *h)
{
    if (!s->is_backup || h->op == PS_OP_REPLICATE || h->op == PS_OP_STATS ||
        h->op == PS_OP_SHUTDOWN)
        return false;
    if (!__atomic_load_n(&s->promoted, __ATOMIC_RELAXED)) promote(s);
    return diverged(s);
}

/* Handles one request; returns true when the context was parked. */
static bool handle(struct ps_server *s, srv_ctx *c, nng_msg *msg, nng_msg **reply)
{
    ps_hdr h;
    char *err = NULL;
    const uint8_t *body = nng_msg_body(msg);
    size_t len = nng_msg_len(msg);
    bool parked = false;
    STAT_ADD(s, requests, 1);
    STAT_ADD(s, bytes_in, len);
    if (ps_wire_open(body, len, &h, &err) != CM_OK) {
        STAT_ADD(s, bad_messages, 1);
        ps_hdr e;
        memset(&e, 0, sizeof e);
        if (len >= PS_HDR_BYTES) memcpy(&e, body, sizeof e); /* echo the request id if any */
        *reply = reply_error(s, &e, CM_ECORRUPT, err);
        free(err);
        nng_msg_free(msg);
        return false;
    }
    const uint8_t *p = body + PS_HDR_BYTES;
    if (__atomic_load_n(&s->fenced, __ATOMIC_RELAXED)) {
        nng_msg_free(msg); /* no reply: the client fails over when this process is gone */
        return false;
    }
    if (h.worker < s->cfg.n_workers && h.op != PS_OP_REPLICATE)
        __atomic_store_n(&s->last_seen[h.worker], now_ms(), __ATOMIC_RELAXED);
    note_pipe(s, &h, msg);
    char text[96];
    if (header_refused(s, &h, text, sizeof text)) {
        STAT_ADD(s, bad_messages, 1);
        *reply = reply_error(s, &h, CM_EINVAL, text);
    } else if ((h.op == PS_OP_CLOCK || h.op == PS_OP_BARRIER) && s->shard != 0) {
        STAT_ADD(s, bad_messages, 1); /* clients send these to shard 0 only */
        *reply = reply_error(s, &h, CM_EINVAL,
                             "clocks and barriers are served by shard 0 for "
                             "known workers only");
    } else if (backup_refuses(s, &h)) {
        *reply = reply_error(s, &h, CM_ECORRUPT, s->diverged_why);
    } else {
        switch ((ps_op)h.op) {
        case PS_OP_HELLO:
            *reply = handle_hello(s, &h, p);
            break;
        case PS_OP_PULL:
            *reply = handle_rows(s, &h, p, NULL, NULL);
            break;
        case PS_OP_PUSH:
        case PS_OP_PUSH_DENSE:
        case PS_OP_INIT_DENSE:
        case PS_OP_LOAD:
        case PS_OP_SHUTDOWN:
            parked = handle_update(s, c, &h, body, len, reply);
            break;
        case PS_OP_PULL_DENSE:
            *reply = handle_dense(s, &h, p, NULL);
            break;
        case PS_OP_REPLICATE:
            *reply = handle_replicate(s, &h, p);
            /* Only a forward taken counts as the primary's (a misdirected one is refused). */
            if (*reply != NULL && reply_status(*reply) == 0) note_primary(s, msg);
            break;
        case PS_OP_CLOCK:
            parked = handle_clock(s, c, &h, reply);
            break;
        case PS_OP_BARRIER:
            if (h.flags & PS_FLAG_POLL)
                parked = handle_update(s, c, &h, body, len, reply);
            else
                parked = handle_barrier(s, c, &h, reply);
            break;
        case PS_OP_SAVE:
            *reply = handle_save_load(s, &h, p);
            break;
        case PS_OP_STATS:
            *reply = handle_stats(s, &h);
            break;
        default:
            *reply = reply_error(s, &h, CM_EINVAL, "unknown op");
            break;
        }
    }
    nng_msg_free(msg);
    return parked;
}

static void ctx_cb(void *arg)
{
    srv_ctx *c = arg;
    struct ps_server *s = c->s;
    int rv = nng_aio_result(c->aio);
    if (c->state == ST_SEND) {
        if (rv != 0) nng_msg_free(ps_aio_msg_take(c->aio));
    } else if (c->state == ST_RECV) {
        if (rv == NNG_ECLOSED || rv == NNG_ECANCELED) return;
        if (rv == 0) {
            nng_msg *reply = NULL;
            c->in_req = true;
            __atomic_add_fetch(&s->busy, 1, __ATOMIC_RELAXED);
            if (handle(s, c, ps_aio_msg_take(c->aio), &reply)) return; /* parked */
            if (reply != NULL) {
                ctx_send(c, reply);
                return;
            }
        }
    }
    if (rv == NNG_ECLOSED) return;
    ctx_recv(c);
}

/* ---- life cycle ---- */

uint32_t ps_apply_threads_default(uint32_t n)
{
    long half = sysconf(_SC_NPROCESSORS_ONLN) / 2;
    uint32_t all = half < 1 ? 1 : half > 8 ? 8 : (uint32_t)half;
    return n > 0 && all / n > 1 ? all / n : 1;
}

int ps_server_create(const ps_server_opts *o, ps_server **out, char **errptr)
{
    int rc = ps_config_check(o->cfg, errptr);
    if (rc != CM_OK) return rc;
    /* Cut to fit, an ipc:// path could name another socket: refused instead. */
    if (o->replica_url != NULL &&
        strlen(o->replica_url) >= sizeof((struct ps_server *)0)->replica_url)
        return cm_err(errptr, CM_EINVAL, "backup URL too long (%zu bytes, at most %zu): %.64s...",
                      strlen(o->replica_url), sizeof((struct ps_server *)0)->replica_url - 1,
                      o->replica_url);
    if (o->shard >= o->cfg->n_shards)
        return cm_err(errptr, CM_EINVAL, "shard %u out of range (the cluster has %u)", o->shard,
                      o->cfg->n_shards);
    /* Shard 0 parks up to one clock and one barrier wait per worker (park), each holding a
     * context: with no more contexts than that, waiting workers would leave none to receive
     * the request that releases them. */
    if (o->shard == 0 && o->n_contexts != 0 && o->n_contexts <= 2 * o->cfg->n_workers)
        return cm_err(errptr, CM_EINVAL,
                      "%u contexts for shard 0 of %u workers: it needs more than 2 x workers "
                      "(each worker's clock and barrier wait holds one while it waits)",
                      o->n_contexts, o->cfg->n_workers);
    struct ps_server *s = calloc(1, sizeof *s);
    if (s == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    s->cfg = *o->cfg;
    s->shard = o->shard;
    s->n_ctx = o->n_contexts ? o->n_contexts : 64 + 2 * s->cfg.n_workers;
    s->is_backup = o->backup;
    s->has_backup = o->replica_url != NULL && !o->backup;
    s->next_seq = 1;
    s->last_done_ms = now_ms();
    /* A primary has at most its contexts' updates in flight, each a message within
     * max_message; so a backup with as many contexts never holds more than this for it. */
    s->log_max =
        s->cfg.max_msg_bytes > UINT64_MAX / s->n_ctx ? UINT64_MAX : s->n_ctx * s->cfg.max_msg_bytes;
    if (s->has_backup) snprintf(s->replica_url, sizeof s->replica_url, "%s", o->replica_url);
    pthread_rwlock_init(&s->tables_lock, NULL);
    pthread_mutex_init(&s->repl_mu, NULL);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->stop_cv, NULL);
    s->clocks = calloc(s->cfg.n_workers, sizeof *s->clocks);
    s->last_seen = calloc(s->cfg.n_workers, sizeof *s->last_seen);
    s->arrived = calloc(s->cfg.n_workers, 1);
    s->polled = calloc(s->cfg.n_workers, sizeof *s->polled);
    if (s->shard == 0 && s->cfg.worker_lost_ms > 0) {
        s->pipe_of = calloc(s->cfg.n_workers, sizeof *s->pipe_of);
        s->gone_ms = calloc(s->cfg.n_workers, sizeof *s->gone_ms);
    }
    for (uint32_t w = 0; s->last_seen && w < s->cfg.n_workers; w++)
        s->last_seen[w] = now_ms();
    s->ctxs = calloc(s->n_ctx, sizeof *s->ctxs);
    s->dedup = ps_dedup_create(s->cfg.n_workers);
    s->pulled = ps_keycache_create(s->cfg.n_workers, s->cfg.n_tables);
    if (s->clocks == NULL || s->ctxs == NULL || s->last_seen == NULL || s->arrived == NULL ||
        s->polled == NULL || s->dedup == NULL || s->pulled == NULL ||
        (s->shard == 0 && s->cfg.worker_lost_ms > 0 &&
         (s->pipe_of == NULL || s->gone_ms == NULL))) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        goto fail;
    }
    if (o->checkpoint_root != NULL) {
        rc = cm_mkdirs(o->checkpoint_root, errptr);
        if (rc == CM_OK && (s->ckpt_root = realpath(o->checkpoint_root, NULL)) == NULL)
            rc = cm_err_errno(errptr, CM_EIO, "checkpoint root %s", o->checkpoint_root);
        if (rc != CM_OK) goto fail;
    }
    if (o->apply_threads > 256) {
        rc = cm_err(errptr, CM_EINVAL, "apply_threads %u out of range (1..256)", o->apply_threads);
        goto fail;
    }
    if (o->apply_threads > 1 &&
        (rc = cm_team_create(o->apply_threads - 1, &s->team, errptr)) != CM_OK)
        goto fail;
    for (uint32_t i = 0; rc == CM_OK && i < s->cfg.n_tables; i++) {
        emb_table_config cfg = s->cfg.tables[i].cfg;
        char spill[2200];
        /* A backup may run beside its primary: it spills to a directory of its own. */
        snprintf(spill, sizeof spill, "%s/shard-%u%s/%s", s->cfg.spill_dir, s->shard,
                 s->is_backup ? "-backup" : "", s->cfg.tables[i].name);
        cfg.spill_path = cfg.mem_budget_bytes > 0 ? spill : NULL;
        char *err = NULL;
        rc = emb_table_create(&cfg, &s->tables[i], &err);
        if (rc == CM_OK) emb_table_set_team(s->tables[i], s->team);
        if (rc != CM_OK) cm_err(errptr, rc, "table '%s': %s", s->cfg.tables[i].name, err);
        free(err);
    }
    for (uint32_t i = 0; rc == CM_OK && i < s->cfg.n_dense; i++)
        if (i % s->cfg.n_shards == s->shard)
            rc = ps_dense_create(&s->cfg.dense[i], &s->dense[i], errptr);
    if (rc != CM_OK) goto fail;
    int rv = nng_rep0_open(&s->sock);
    if (rv != 0) {
        rc = cm_err(errptr, CM_EIO, "cannot open rep socket: %s", nng_strerror(rv));
        goto fail;
    }
    s->sock_open = true;
    /* A backup receives each update inside a REPLICATE: the client's request (within
     * max_message) behind a header and a sequence number of its own. */
    nng_socket_set_size(s->sock, NNG_OPT_RECVMAXSZ,
                        (size_t)s->cfg.max_msg_bytes + (o->backup ? PS_FORWARD_OVERHEAD : 0));
    if (s->has_backup) {
        if ((rv = nng_req0_open(&s->rsock)) != 0) {
            rc = cm_err(errptr, CM_EIO, "cannot open the replication socket: %s", nng_strerror(rv));
            goto fail;
        }
        s->rsock_open = true;
        nng_socket_set_size(s->rsock, NNG_OPT_RECVMAXSZ, (size_t)s->cfg.max_msg_bytes);
        nng_socket_set_ms(s->rsock, NNG_OPT_RECONNMINT, 20);
        nng_socket_set_ms(s->rsock, NNG_OPT_RECONNMAXT, PS_BACKUP_REDIAL_MS);
        if ((rv = nng_pipe_notify(s->rsock, NNG_PIPE_EV_ADD_POST, backup_pipe_event, s)) != 0 ||
            (rv = nng_pipe_notify(s->rsock, NNG_PIPE_EV_REM_POST, backup_pipe_event, s)) != 0) {
            rc = cm_err(errptr, CM_EIO, "cannot watch the connection to the backup: %s",
                        nng_strerror(rv));
            goto fail;
        }
        rc = ps_net_dial(s->rsock, s->replica_url, &s->cfg, NULL, errptr);
        if (rc != CM_OK) goto fail;
    }
    for (uint32_t i = 0; i < s->n_ctx; i++) {
        srv_ctx *c = &s->ctxs[i];
        c->s = s;
        if ((rv = nng_aio_alloc(&c->aio, ctx_cb, c)) != 0 ||
            (rv = nng_ctx_open(&c->ctx, s->sock)) != 0 ||
            (s->has_backup && ((rv = nng_aio_alloc(&c->raio, repl_cb, c)) != 0 ||
                               (rv = nng_ctx_open(&c->rctx, s->rsock)) != 0))) {
            rc = cm_err(errptr, CM_EIO, "cannot set up contexts: %s", nng_strerror(rv));
            goto fail;
        }
        if (c->raio) {
            /* Updates are numbered, so the backup ignores a resent one: resending is safe. */
            nng_aio_set_timeout(c->raio, (nng_duration)s->cfg.replica_timeout_ms);
            nng_ctx_set_ms(c->rctx, NNG_OPT_REQ_RESENDTIME,
                           (nng_duration)(s->cfg.replica_timeout_ms / 4 + 1));
        }
    }
    if ((s->gone_ms != NULL || s->is_backup) &&
        (rv = nng_pipe_notify(s->sock, NNG_PIPE_EV_REM_POST, pipe_closed, s)) != 0) {
        rc = cm_err(errptr, CM_EIO, "cannot watch the workers' connections: %s", nng_strerror(rv));
        goto fail;
    }
    rc = ps_net_listen(s->sock, o->listen, &s->cfg, errptr);
    if (rc != CM_OK) goto fail;
    for (uint32_t i = 0; i < s->n_ctx; i++) {
        s->ctxs[i].state = ST_RECV;
        nng_ctx_recv(s->ctxs[i].ctx, s->ctxs[i].aio);
    }
    if (s->shard == 0 && (s->cfg.worker_timeout_ms > 0 || s->cfg.worker_lost_ms > 0)) {
        if (pthread_create(&s->reaper, NULL, reaper_main, s) != 0) {
            rc = cm_err(errptr, CM_ERR, "cannot start the worker-liveness thread");
            goto fail;
        }
        s->reaper_running = true;
    }
    *out = s;
    return CM_OK;
fail:
    ps_server_destroy(s);
    return rc;
}

int ps_server_wait(ps_server *s)
{
    while (!ps_server_wait_for(s, 1000)) {
    }
    return CM_OK;
}

bool ps_server_wait_for(ps_server *s, uint32_t ms)
{
    const double end = cm_now() + ms / 1000.0;
    pthread_mutex_lock(&s->mu);
    while (!__atomic_load_n(&s->stopping, __ATOMIC_RELAXED) && cm_now() < end) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 20 * 1000 * 1000;
        if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
        pthread_cond_timedwait(&s->stop_cv, &s->mu, &ts);
    }
    const bool stopped = __atomic_load_n(&s->stopping, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&s->mu);
    return stopped;
}

uint64_t ps_server_idle_ms(ps_server *s)
{
    if (__atomic_load_n(&s->busy, __ATOMIC_RELAXED) != 0) return 0;
    const uint64_t done = __atomic_load_n(&s->last_done_ms, __ATOMIC_RELAXED), now = now_ms();
    return now > done ? now - done : 0;
}

bool ps_server_primary_connected(ps_server *s)
{
    return s->is_backup && !__atomic_load_n(&s->promoted, __ATOMIC_RELAXED) &&
           __atomic_load_n(&s->primary_pipe, __ATOMIC_RELAXED) != 0;
}

bool ps_server_fenced(ps_server *s)
{
    return __atomic_load_n(&s->fenced, __ATOMIC_RELAXED);
}

void ps_server_stop(ps_server *s)
{
    __atomic_store_n(&s->stopping, true, __ATOMIC_RELAXED);
}

/*
 * nng 1.5.2's stream transports (ipc, tcp, tls) lose a pipe for good when it is closed from
 * its own side just after a message's header was read and before its body is asked for
 * (nanomsg/nng#616): the pipe's receive never completes, its teardown blocks nng's only
 * reaper thread, and every later nng_close in the process hangs. Closing a socket while
 * messages are on their way to it does that here, and so does closing it while replies are on
 * their way to a peer, in the peer (its next send fails, and nng then closes the pipe it is
 * reading from). So a server stopped while clients and its backup still talk to it (a killed
 * primary in tests/ps/replica.c) first stops serving, then waits until nothing is in flight
 * either way before it closes anything: every REPLICATE answered (each is bounded by
 * replica_timeout anyway), and no reply handed to nng for PS_CLOSE_SETTLE_MS, long enough for
 * the clients to read it. Without replies the clients send nothing new, and each pipe stops
 * reading once it holds a request no context takes.
 */
#define PS_CLOSE_SETTLE_MS 100u

/* Primary being destroyed after a SHUTDOWN that its backup did not take in the replication
 * stream (dropped as unreachable or diverged, before or by that SHUTDOWN's forward): tells the
 * backup to stop with a SHUTDOWN of its own, which a backup serves in any state without taking
 * over (backup_refuses). Otherwise it would live on after its cluster stopped. Best effort and
 * bounded by replica_timeout (the backup may be gone): this process stops either way. A backup
 * with no connection (its process died, and its sockets with it) is known gone: after the
 * dialer's longest wait between attempts with none, this one stops at once rather than wait
 * replica_timeout for it. */
static void stop_backup(struct ps_server *s)
{
    const uint64_t redial_end = now_ms() + PS_BACKUP_REDIAL_MS;
    while (!backup_connected(s) && now_ms() < redial_end) {
        struct timespec ts = {0, 5 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (!backup_connected(s)) {
        fprintf(stderr,
                "ember ps: shard %u: backup %s is gone (no connection to it): not told to stop\n",
                s->shard, s->replica_url);
        return;
    }
    const uint64_t deadline = now_ms() + s->cfg.replica_timeout_ms;
    ps_hdr h;
    memset(&h, 0, sizeof h);
    h.op = PS_OP_SHUTDOWN; /* from worker 0, which every cluster has */
    h.req_id = 1;
    nng_ctx ctx;
    nng_aio *aio = NULL;
    nng_msg *m = NULL;
    uint8_t *p;
    int rv = nng_ctx_open(&ctx, s->rsock);
    const bool ctx_open = rv == 0;
    if (rv == 0 && (rv = nng_aio_alloc(&aio, NULL, NULL)) == 0 &&
        ps_msg_new(&h, 0, &m, &p) != CM_OK)
        rv = NNG_ENOMEM;
    if (rv == 0) {
        ps_msg_seal(m);
        nng_aio_set_msg(aio, m);
        nng_aio_set_timeout(aio, (nng_duration)s->cfg.replica_timeout_ms);
        nng_ctx_send(ctx, aio);
        nng_aio_wait(aio);
        if ((rv = nng_aio_result(aio)) != 0) nng_msg_free(ps_aio_msg_take(aio));
    }
    if (rv == 0) {
        /* Its reply says it took the SHUTDOWN (the rest of the time left). */
        const uint64_t now = now_ms();
        nng_aio_set_timeout(aio, (nng_duration)(deadline > now ? deadline - now : 1));
        nng_ctx_recv(ctx, aio);
        nng_aio_wait(aio);
        if ((rv = nng_aio_result(aio)) == 0) nng_msg_free(ps_aio_msg_take(aio));
    }
    if (aio != NULL) nng_aio_free(aio);
    if (ctx_open) nng_ctx_close(ctx);
    if (rv == 0)
        fprintf(stderr,
                "ember ps: shard %u: told backup %s (out of the replication stream) to stop\n",
                s->shard, s->replica_url);
    else
        fprintf(stderr, "ember ps: shard %u: could not tell backup %s to stop: %s\n", s->shard,
                s->replica_url, nng_strerror(rv));
}

static void wait_quiet(struct ps_server *s)
{
    const uint64_t deadline = now_ms() + s->cfg.replica_timeout_ms;
    for (;;) {
        uint64_t last = __atomic_load_n(&s->last_reply_ms, __ATOMIC_RELAXED), now = now_ms();
        /* A backup with no connection answers none of them. */
        bool replicating = __atomic_load_n(&s->repl_inflight, __ATOMIC_RELAXED) > 0 &&
                           now < deadline && backup_connected(s);
        bool replied = now - last < PS_CLOSE_SETTLE_MS;
        if (!replicating && !replied) return;
        struct timespec ts = {0, 5 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

void ps_server_destroy(ps_server *s)
{
    if (s == NULL) return;
    if (s->reaper_running) {
        ps_server_stop(s);
        __atomic_store_n(&s->reaper_stop, true, __ATOMIC_RELAXED);
        pthread_join(s->reaper, NULL);
    }
    if (s->ctxs) {
        for (uint32_t i = 0; i < s->n_ctx; i++)
            if (s->ctxs[i].aio) nng_aio_stop(s->ctxs[i].aio);
        wait_quiet(s);
        for (uint32_t i = 0; i < s->n_ctx; i++)
            if (s->ctxs[i].raio) nng_aio_stop(s->ctxs[i].raio);
    }
    /* A fenced primary's backup has taken over the shard: it is not this one's to stop. */
    if (s->rsock_open && __atomic_load_n(&s->stop_asked, __ATOMIC_RELAXED) &&
        !__atomic_load_n(&s->fenced, __ATOMIC_RELAXED) &&
        (__atomic_load_n(&s->dropped, __ATOMIC_RELAXED) ||
         !__atomic_load_n(&s->stop_forwarded, __ATOMIC_RELAXED)))
        stop_backup(s);
    if (s->sock_open) nng_close(s->sock);
    if (s->rsock_open) nng_close(s->rsock);
    if (s->ctxs)
        for (uint32_t i = 0; i < s->n_ctx; i++) {
            ps_aio_free_stopped(s->ctxs[i].aio);
            ps_aio_free_stopped(s->ctxs[i].raio);
            if (s->ctxs[i].held) nng_msg_free(s->ctxs[i].held);
        }
    ps_dedup_destroy(s->dedup);
    ps_keycache_destroy(s->pulled);
    ps_replog_clear(&s->log);
    pthread_mutex_destroy(&s->repl_mu);
    for (uint32_t i = 0; i < PS_MAX_TABLES; i++)
        emb_table_destroy(s->tables[i]);
    cm_team_destroy(s->team);
    for (uint32_t i = 0; i < PS_MAX_DENSE; i++)
        ps_dense_destroy(s->dense[i]);
    free(s->ctxs);
    free(s->ckpt_root);
    free(s->clocks);
    free(s->last_seen);
    free(s->arrived);
    free(s->polled);
    free(s->pipe_of);
    free(s->gone_ms);
    pthread_rwlock_destroy(&s->tables_lock);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->stop_cv);
    free(s);
}

void ps_server_stats_get(ps_server *s, ps_server_stats *out)
{
    /* Handlers add to the counters atomically without the lock (STAT_ADD): read them so too. */
    _Static_assert(sizeof(ps_server_stats) % sizeof(uint64_t) == 0, "all u64 counters");
    const uint64_t *from = (const uint64_t *)&s->st;
    uint64_t *to = (uint64_t *)out;
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < sizeof *out / sizeof(uint64_t); i++)
        to[i] = __atomic_load_n(&from[i], __ATOMIC_RELAXED);
    pthread_mutex_unlock(&s->mu);
    out->keylist_bytes = ps_keycache_bytes(s->pulled);
}
