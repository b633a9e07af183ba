/*
 * The PS client. Each shard has a req socket and a window of contexts ("slots"). A slot runs
 * send -> recv from nng callbacks; a synchronous caller waits on the client's condition
 * variable, an asynchronous push frees its slot from the callback and leaves any error for a
 * later call to report. nng resends a request after a reconnect or a resend interval; the
 * server recognises a push it has seen by (worker, request id) and does not apply it twice.
 *
 * Failover: a shard with a backup is watched through nng's pipe events. When the connection to
 * the primary goes away, a thread closes the primary's dialer and dials the backup on the same
 * socket; nng then resends every request that was in flight to the new connection, so callers
 * see a pause, not an error. A shard fails over once; its backup has no backup of its own.
 * A request has one deadline, the call's timeout, whatever happens on the way: a primary that
 * stays connected but silent is given up early enough for the backup's attempt to fit, and a
 * request that neither answers fails naming both URLs.
 *
 * Key elision: the client remembers the key lists of its recent pulls per (shard, table); a
 * push of exactly one of them names the pull instead of carrying the keys. Its slot keeps the
 * keys and rows until the push is acknowledged: a shard that no longer holds the list (evicted,
 * or a backup that took over) answers PS_STATUS_NO_KEYS, and the slot sends the push again with
 * its keys, under the same request id (the failed attempt applied nothing).
 *
 * Dense mirrors (ps_client_dense_mirror): the client holds a copy of a dense block and its
 * optimizer state, built from the block's state on the PS. A push-pull on a mirrored block
 * applies the update to the copy with the PS's own code (ps_dense_push) and returns at once;
 * the push goes out asynchronously and its reply carries the PS's step and xxh3 of its values
 * after that update, which the next dense call (or a flush) compares with the copy's. At most
 * one push per mirrored block is in flight, so the PS applies them in the order the copy did.
 * The caller pays for the update and a copy of the gradient; a sender thread builds, seals and
 * sends the message (~0.25 ms for the mlp's tower) off its critical path.
 */
#include <inttypes.h>
#include <math.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ps/dense.h"
#include "ps/keycache.h"
#include "ps/keysort.h"
#include "ps/net.h"
#include "ps/replica.h"
#include "ps/residual.h"
#include "ps/wire.h"

enum { SL_FREE, SL_SEND, SL_RECV, SL_DONE };
/* K_MIRROR: a mirrored block's push; its slot frees itself and leaves the reply's digest in
 * the mirror (dense_mirror.done), so it never holds a window slot until someone reaps it. */
enum { K_SYNC, K_ASYNC, K_MIRROR };
/* The most of a request's timeout kept for its shard's backup (slot_send). */
#define FAILOVER_RESERVE_MS 5000
/* The largest request kept whole to send again after a damaged reply: copying it costs the
 * sender a memcpy on every call for an event seen once in tens of runs. */
#define PS_RESEND_COPY_MAX (64u << 10)

typedef struct slot {
    struct ps_client *c;
    uint32_t shard;
    nng_ctx ctx;
    nng_aio *aio;
    int state, kind;
    uint16_t op;
    /* The request's table, count and codec, which a shard's reply repeats: rows of another
     * table or codec, or of another count, are not the rows asked for. */
    uint32_t table, count;
    uint8_t codec;
    uint64_t req_id;
    /* The call's, for its error message: milliseconds, up to 20 x UINT32_MAX (a barrier's),
     * which an nng_duration (int32) cannot hold: nng is only ever given what is left of it
     * (ms_until, capped). */
    uint64_t timeout;
    /* cm_now() seconds: when the call must have its answer (deadline), and when the current
     * attempt is given up (attempt_end: before the deadline while the backup is still to be
     * tried, so that the backup's attempt fits in the same timeout). */
    double deadline, attempt_end;
    nng_msg *copy; /* while the shard may still fail over: the request, to send again */
    struct dense_mirror *mirror; /* K_MIRROR: where the reply goes */
    /* An elided push in flight: its header, keys and encoded rows, to send it again with the
     * keys if the shard no longer holds the list it names. */
    ps_hdr fb_hdr;
    uint64_t *fb_keys;
    uint8_t *fb_rows;
    size_t fb_row_bytes;
    /* What sends a request again, once, when its reply arrives damaged (it fails the wire
     * checks, so whether the shard served it is unknown; every request resent this way is one
     * a shard may see twice: reads, and pushes it de-duplicates by request id). A pull is
     * rebuilt from its header and its keys, the caller's, who waits for the reply (no copy on
     * the hot path); another small request is kept whole (again). An elided push resends with
     * its fb_ keys instead; a large one without them (a dense or keyed push of more than
     * PS_RESEND_COPY_MAX) is not kept, and its damaged reply fails it. */
    ps_hdr pull_hdr;
    const uint64_t *pull_keys;
    nng_msg *again;
    bool resent;
    nng_msg *reply;
    int rc;
    char *err;
} slot;

typedef struct shard_conn {
    struct ps_client *c;
    uint32_t index;
    nng_socket sock;
    nng_dialer dialer;
    int primary_dialer; /* nng id of the primary's dialer: which server sent a reply */
    char *url, *backup_url;
    bool fail_pending, failed_over; /* under the client's mu */
    /* The primary's dialer is closed (under mu): from then on no request can go out on its
     * connection, and a request needs no copy to send again. */
    bool switched;
    bool open;
    slot *slots;
    uint32_t busy;
    uint32_t pushing; /* asynchronous pushes in flight: a pull to this shard waits for them */
} shard_conn;

struct ps_client {
    ps_config cfg;
    uint32_t worker, window, timeout_ms;
    shard_conn *shards;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t next_req;
    pthread_cond_t fail_cv; /* wakes the failover thread */
    pthread_t failover;
    bool failover_running, closing;
    int async_rc;
    char *async_err;
    uint64_t clock, barrier_gen;
    ps_resid residual[PS_MAX_TABLES]; /* int8 error feedback, per table (ps/residual.h) */
    ps_keycache *pulled; /* recent pulls' key lists per (shard, table); NULL: never elide */
    ps_client_stats st;
    /* Dense mirrors, per block (NULL: none); mirror_mu serialises their calls (taken before
     * mu, never from an nng callback). */
    struct dense_mirror *mirror[PS_MAX_DENSE];
    pthread_mutex_t mirror_mu;
    uint32_t mirror_inflight; /* mirror pushes without their reply yet (mu) */
    /* The mirrors' pushes wait here for the sender thread (mu, mirror_cv), which builds,
     * seals and sends them off the caller's critical path, in queue order. */
    struct dense_mirror *sendq[PS_MAX_DENSE];
    uint32_t n_sendq;
    pthread_cond_t mirror_cv;
    pthread_t sender;
    bool sender_running;
    int aborted; /* ps_client_abort (atomic) */
};

typedef struct dense_mirror {
    ps_dense *d;
    uint32_t block;
    float *gbuf;              /* the gradient the sender thread sends (mirror_sender) */
    bool pending;             /* a push was queued and not reaped yet (mirror_mu) */
    uint64_t want_step, want; /* the copy's step and digest after that push */
    /* Filled by the push's slot when its reply is in (c->mu): */
    bool done;
    int rc;
    char *err;
    uint64_t got_step, got;
} dense_mirror;

/* ---- slots ---- */

static void slot_send(slot *s, nng_msg *m, bool idempotent, uint64_t timeout);
static void slot_transmit(slot *s, nng_msg *m, bool idempotent, double deadline);
static bool slot_send_with_keys(slot *s);
static nng_duration ms_until(double t);
static void mirror_drop(ps_client *c, uint32_t block);
static int mirrors_reap(ps_client *c, char **errptr);
static const char *reply_from(const struct ps_client *c, uint32_t shard, nng_msg *m, char *buf,
                              size_t cap);

/* A slot's state moves under c->mu, which its waiters (slot_wait, slot_acquire) read it under;
 * only its own aio callback moves it between SEND and RECV, but they must see each move. */
static void slot_set_state(slot *s, int state)
{
    pthread_mutex_lock(&s->c->mu);
    s->state = state;
    pthread_mutex_unlock(&s->c->mu);
}

static void slot_drop_fallback(slot *s)
{
    free(s->fb_keys);
    free(s->fb_rows);
    s->fb_keys = NULL;
    s->fb_rows = NULL;
}

static void slot_drop_resend(slot *s)
{
    if (s->again) nng_msg_free(s->again);
    s->again = NULL;
    s->pull_keys = NULL;
}

/* Sends a request whose reply arrived damaged again, once (see slot.pull_hdr). False when it
 * keeps nothing to send or was sent again already: the reply's error then stands. */
static bool slot_resend(slot *s)
{
    if (s->resent) return false;
    if (s->fb_keys) {
        if (!slot_send_with_keys(s)) return false;
        __atomic_add_fetch(&s->c->st.replies_resent, 1, __ATOMIC_RELAXED);
        return true;
    }
    nng_msg *m = s->again;
    s->again = NULL;
    if (m == NULL && s->pull_keys &&
        ps_msg_rows(&s->pull_hdr, s->pull_keys, s->pull_hdr.count, NULL, 0, &m) != CM_OK)
        m = NULL;
    if (m == NULL) return false;
    s->resent = true;
    if (s->copy) nng_msg_free(s->copy);
    s->copy = NULL;
    __atomic_add_fetch(&s->c->st.replies_resent, 1, __ATOMIC_RELAXED);
    slot_set_state(s, SL_SEND);
    slot_transmit(s, m, true, s->deadline); /* what is left of the call's time */
    return true;
}

/* The shard did not hold the key list an elided push named: sends the push again with its
 * keys. False when that cannot be built (the push then fails with the shard's error). */
static bool slot_send_with_keys(slot *s)
{
    nng_msg *m;
    if (ps_msg_rows(&s->fb_hdr, s->fb_keys, s->fb_hdr.count, s->fb_rows, s->fb_row_bytes, &m) !=
        CM_OK)
        return false;
    slot_drop_fallback(s);
    if (s->copy) nng_msg_free(s->copy);
    s->copy = NULL;
    s->resent = true; /* with its keys, it is an ordinary push: never sent a third time */
    __atomic_add_fetch(&s->c->st.push_fallbacks, 1, __ATOMIC_RELAXED);
    slot_set_state(s, SL_SEND);
    /* The same call: what is left of its time, not a fresh timeout. */
    slot_transmit(s, m, true, s->deadline);
    return true;
}

static void slot_finish(slot *s, int rc, char *err)
{
    struct ps_client *c = s->c;
    if (s->copy) nng_msg_free(s->copy);
    s->copy = NULL;
    slot_drop_fallback(s);
    slot_drop_resend(s);
    pthread_mutex_lock(&c->mu);
    if (s->kind == K_MIRROR) {
        dense_mirror *mi = s->mirror;
        mi->rc = rc;
        mi->err = err;
        err = NULL;
        ps_hdr h;
        if (rc == CM_OK) memcpy(&h, nng_msg_body(s->reply), sizeof h);
        if (rc == CM_OK && h.payload_len == PS_DIGEST_BYTES) {
            memcpy(&mi->got_step, (uint8_t *)nng_msg_body(s->reply) + PS_HDR_BYTES, 8);
            memcpy(&mi->got, (uint8_t *)nng_msg_body(s->reply) + PS_HDR_BYTES + 8, 8);
        } else if (rc == CM_OK) {
            char from[1024];
            mi->rc = cm_err(&mi->err, CM_ECORRUPT,
                            "%s: a digest reply of %" PRIu64 " bytes, expected %u",
                            reply_from(c, s->shard, s->reply, from, sizeof from), h.payload_len,
                            PS_DIGEST_BYTES);
        }
        if (s->reply) nng_msg_free(s->reply);
        s->reply = NULL;
        s->mirror = NULL;
        s->state = SL_FREE;
        c->shards[s->shard].busy--;
        c->mirror_inflight--;
        mi->done = true;
    } else if (s->kind == K_ASYNC) {
        if (rc != CM_OK && c->async_rc == CM_OK) {
            c->async_rc = rc;
            c->async_err = err;
            err = NULL;
        }
        if (s->reply) nng_msg_free(s->reply);
        s->reply = NULL;
        s->state = SL_FREE;
        c->shards[s->shard].busy--;
        c->shards[s->shard].pushing--;
    } else {
        s->rc = rc;
        s->err = err;
        err = NULL;
        s->state = SL_DONE;
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    free(err);
}

/* "shard S (URL)" for an error about a reply, into buf: with a backup, the shard's index alone
 * does not say whether its primary or its backup sent the bytes, and the operator must know
 * which process to look at. A reply arrives on a pipe of the primary's dialer or, after a
 * failover, of the backup's. */
static const char *reply_from(const struct ps_client *c, uint32_t shard, nng_msg *m, char *buf,
                              size_t cap)
{
    const shard_conn *sc = &c->shards[shard];
    const char *url = sc->url;
    if (sc->backup_url && nng_dialer_id(nng_pipe_dialer(nng_msg_get_pipe(m))) != sc->primary_dialer)
        url = sc->backup_url;
    snprintf(buf, cap, "shard %u (%s)", shard, url);
    return buf;
}

/* An operation started after ps_client_abort's sweep of the slots is cancelled here: the flag
 * is set before the sweep, so every operation is either swept or sees it. */
static void abort_recheck(slot *s)
{
    if (__atomic_load_n(&s->c->aborted, __ATOMIC_ACQUIRE)) nng_aio_cancel(s->aio);
}

/* *damaged: the reply failed the wire checks (its length or checksum), as a message damaged in
 * transit would, rather than answering wrongly. */
static int reply_check(slot *s, nng_msg *m, bool *damaged, char **errptr)
{
    ps_hdr h;
    char *err = NULL, from[1024];
    reply_from(s->c, s->shard, m, from, sizeof from);
    int rc = ps_wire_open(nng_msg_body(m), nng_msg_len(m), &h, &err);
    *damaged = rc != CM_OK;
    if (rc != CM_OK) {
        /* What the damaged header says beside what was asked: whose header it carries (this
         * request's, another's, none) is what tells a damaged reply from a misrouted one. */
        char said[160] = "";
        if (nng_msg_len(m) >= PS_HDR_BYTES)
            snprintf(said, sizeof said,
                     "; its header: op %u, request %" PRIu64 ", table %u, count %u, status %d",
                     h.op, h.req_id, h.table, h.count, h.status);
        rc =
            cm_err(errptr, rc, "%s sent a bad reply to request %" PRIu64 " (op %u, count %u): %s%s",
                   from, s->req_id, s->op, s->count, err, said);
        free(err);
        return rc;
    }
    if (h.req_id != s->req_id || h.op != s->op)
        return cm_err(errptr, CM_ECORRUPT,
                      "%s replied to request %" PRIu64 " op %u, expected %" PRIu64 " op %u", from,
                      h.req_id, h.op, s->req_id, s->op);
    if (h.status < 0) {
        /* The server's text goes to the operator's terminal and logs: at most 768 bytes of
         * it, cleaned (ps_error_text). (A length cast to int for "%.*s" also read past the
         * message for a text over 2 GiB, which a max_message that large lets in.) */
        char text[769];
        bool cut = ps_error_text((const uint8_t *)nng_msg_body(m) + PS_HDR_BYTES, h.payload_len,
                                 text, sizeof text);
        return cm_err(errptr, h.status, "%s: %s%s", from, text, cut ? " [cut]" : "");
    }
    /* A pull's rows are decoded in the request's codec and given to its keys: a reply for
     * another table, count or codec (a fp16 and a bf16 row are the same size) would be taken
     * as the rows asked for, wrong values and all. */
    if (h.table != s->table || h.count != s->count || h.codec != s->codec)
        return cm_err(errptr, CM_ECORRUPT,
                      "%s answered table %u, count %u, codec %s to a request (op %u) for table "
                      "%u, count %u, codec %s",
                      from, h.table, h.count, ps_codec_name((ps_codec)h.codec), h.op, s->table,
                      s->count, ps_codec_name((ps_codec)s->codec));
    return CM_OK;
}

/* Asks the failover thread to move a shard to its backup (once). */
static void want_failover(struct ps_client *c, shard_conn *sc)
{
    pthread_mutex_lock(&c->mu);
    if (!c->closing && !sc->failed_over && sc->backup_url) {
        sc->failed_over = true;
        sc->fail_pending = true;
        pthread_cond_signal(&c->fail_cv);
    }
    pthread_mutex_unlock(&c->mu);
}

/* Fails a slot whose transport gave up (rv), naming the shard and every URL the request may
 * have gone to: with a backup the operator must know that both were tried. */
static void slot_fail_io(slot *s, int rv, const char *what)
{
    const shard_conn *sc = &s->c->shards[s->shard];
    char *err = NULL, within[48] = "";
    bool to = rv == NNG_ETIMEDOUT;
    if (to) snprintf(within, sizeof within, " within %" PRIu64 " ms", s->timeout);
    if (sc->backup_url)
        cm_err(&err, CM_EIO, "%s shard %u (primary %s, backup %s)%s: %s%s", what, s->shard, sc->url,
               sc->backup_url, within, nng_strerror(rv),
               to ? " (are they running and reachable?)" : "");
    else
        cm_err(&err, CM_EIO, "%s shard %u (%s)%s: %s%s", what, s->shard, sc->url, within,
               nng_strerror(rv), to ? " (is the PS running and reachable?)" : "");
    slot_finish(s, CM_EIO, err);
}

static void slot_cb(void *arg)
{
    slot *s = arg;
    int rv = nng_aio_result(s->aio);
    char *err = NULL;
    if (rv != 0 && __atomic_load_n(&s->c->aborted, __ATOMIC_ACQUIRE)) {
        if (s->state == SL_SEND) nng_msg_free(ps_aio_msg_take(s->aio));
        cm_err(&err, CM_ECANCELED, "request to shard %u abandoned: the client was aborted",
               s->shard);
        slot_finish(s, CM_ECANCELED, err);
        return;
    }
    if (rv != 0 && rv != NNG_ECLOSED && rv != NNG_ECANCELED && s->copy && cm_now() < s->deadline) {
        /* The primary failed this request (its connection reset, or it went silent): fail
         * over and send the request again, to the backup. A push the primary had applied is
         * recognised there and not applied twice. */
        if (s->state == SL_SEND) nng_msg_free(ps_aio_msg_take(s->aio));
        shard_conn *sc = &s->c->shards[s->shard];
        want_failover(s->c, sc);
        nng_msg *m = s->copy;
        s->copy = NULL;
        /* Until the failover thread has closed the primary's dialer, a silent primary's
         * connection is still up and the resend goes out on it; that close then fails it
         * (a request nng does not resend by itself gets "connection reset"): a copy is kept
         * to send it again, then to the backup. */
        pthread_mutex_lock(&s->c->mu);
        bool switched = sc->switched;
        pthread_mutex_unlock(&s->c->mu);
        if (!switched && nng_msg_dup(&s->copy, m) != 0) s->copy = NULL;
        slot_set_state(s, SL_SEND);
        s->attempt_end = s->deadline;
        nng_aio_set_timeout(s->aio, ms_until(s->deadline));
        nng_aio_set_msg(s->aio, m);
        nng_ctx_send(s->ctx, s->aio);
        abort_recheck(s);
        return;
    }
    if (s->state == SL_SEND) {
        if (rv != 0) {
            nng_msg_free(ps_aio_msg_take(s->aio));
            slot_fail_io(s, rv, "cannot send to");
            return;
        }
        slot_set_state(s, SL_RECV);
        /* nng times each operation from its start: the receive gets what is left of the
         * attempt, not a timeout of its own after a send that waited for a connection. */
        nng_aio_set_timeout(s->aio, ms_until(s->attempt_end));
        nng_ctx_recv(s->ctx, s->aio);
        abort_recheck(s);
        return;
    }
    if (rv != 0) {
        slot_fail_io(s, rv, "no reply from");
        return;
    }
    nng_msg *m = ps_aio_msg_take(s->aio);
    __atomic_add_fetch(&s->c->st.bytes_received, nng_msg_len(m), __ATOMIC_RELAXED);
    bool damaged;
    int rc = reply_check(s, m, &damaged, &err);
    if (damaged) __atomic_add_fetch(&s->c->st.replies_damaged, 1, __ATOMIC_RELAXED);
    /* A damaged reply leaves unknown whether a push was applied; sent again (once), the shard
     * applies it or, having applied it, recognises its request id and only acknowledges it
     * (ps_dedup); a read is simply served again. */
    if (((rc == PS_STATUS_NO_KEYS && s->fb_keys && slot_send_with_keys(s)) ||
         (damaged && slot_resend(s)))) {
        nng_msg_free(m);
        free(err);
        return;
    }
    s->reply = m;
    slot_finish(s, rc, err);
}

/* Milliseconds from now to t (cm_now() seconds), at least 1: nng reads 0 as "do not wait". */
static nng_duration ms_until(double t)
{
    double ms = (t - cm_now()) * 1000.0;
    return ms < 1 ? 1 : ms > INT32_MAX ? INT32_MAX : (nng_duration)ms;
}

/* Waits for a free slot of a shard and claims it. */
static slot *slot_acquire(struct ps_client *c, uint32_t shard, int kind)
{
    shard_conn *sc = &c->shards[shard];
    pthread_mutex_lock(&c->mu);
    while (sc->busy == c->window)
        pthread_cond_wait(&c->cv, &c->mu);
    slot *s = NULL;
    for (uint32_t i = 0; i < c->window && s == NULL; i++)
        if (sc->slots[i].state == SL_FREE) s = &sc->slots[i];
    s->state = SL_SEND;
    s->kind = kind;
    sc->busy++;
    if (kind == K_ASYNC) sc->pushing++;
    s->req_id = ++c->next_req;
    s->resent = false;
    pthread_mutex_unlock(&c->mu);
    return s;
}

/* Sends a message built with ps_msg_new: fills the request id, seals, sends. Idempotent
 * requests may be resent by nng after a reconnect; long-waiting ones get a long timeout: the
 * whole call's, failover included. */
static void slot_send(slot *s, nng_msg *m, bool idempotent, uint64_t timeout)
{
    s->timeout = timeout;
    slot_transmit(s, m, idempotent, cm_now() + timeout / 1000.0);
}

/* slot_send's work, for a call that must be answered by deadline (cm_now() seconds). */
static void slot_transmit(slot *s, nng_msg *m, bool idempotent, double deadline)
{
    struct ps_client *c = s->c;
    ps_hdr h;
    memcpy(&h, nng_msg_body(m), sizeof h);
    h.req_id = s->req_id;
    h.worker = (uint16_t)c->worker;
    s->op = h.op;
    s->table = h.table;
    s->count = h.count;
    s->codec = h.codec;
    memcpy(nng_msg_body(m), &h, sizeof h);
    ps_msg_seal(m);
    if (__atomic_load_n(&c->aborted, __ATOMIC_ACQUIRE)) {
        char *err = NULL;
        cm_err(&err, CM_ECANCELED, "request to shard %u not sent: the client was aborted",
               s->shard);
        nng_msg_free(m);
        slot_finish(s, CM_ECANCELED, err);
        return;
    }
    if (nng_msg_len(m) > c->cfg.max_msg_bytes) {
        /* The server's transport would drop it unanswered (and nng resend it until the
         * timeout): refused here, naming the sizes. */
        char *err = NULL;
        cm_err(&err, CM_EINVAL,
               "request to shard %u of %zu bytes exceeds max_message of %llu bytes (op %u): "
               "send fewer keys a call or raise max_message",
               s->shard, nng_msg_len(m), (unsigned long long)c->cfg.max_msg_bytes, (unsigned)h.op);
        nng_msg_free(m);
        slot_finish(s, CM_EINVAL, err);
        return;
    }
    if (idempotent && !s->resent && !s->fb_keys && !s->pull_keys && s->again == NULL &&
        nng_msg_len(m) <= PS_RESEND_COPY_MAX && nng_msg_dup(&s->again, m) != 0)
        s->again = NULL;
    __atomic_add_fetch(&c->st.bytes_sent, nng_msg_len(m), __ATOMIC_RELAXED);
    if (h.op == PS_OP_PUSH) __atomic_add_fetch(&c->st.push_bytes, nng_msg_len(m), __ATOMIC_RELAXED);
    nng_ctx_set_ms(s->ctx, NNG_OPT_REQ_RESENDTIME,
                   idempotent ? (nng_duration)(c->timeout_ms / 4 + 1) : NNG_DURATION_INFINITE);
    s->deadline = deadline;
    shard_conn *sc = &c->shards[s->shard];
    pthread_mutex_lock(&c->mu);
    bool may_fail_over = sc->backup_url && !sc->switched;
    pthread_mutex_unlock(&c->mu);
    if (may_fail_over && nng_msg_dup(&s->copy, m) != 0) s->copy = NULL;
    /* A primary that went silent (connected, not answering) is given up with part of the
     * timeout left for its backup, which answers within milliseconds of being dialled when
     * it is up: both together stay within the call's timeout. A primary whose connection
     * drops fails over at once (pipe_removed) and needs none of this. */
    double reserve = (deadline - cm_now()) / 2;
    if (reserve > FAILOVER_RESERVE_MS / 1000.0) reserve = FAILOVER_RESERVE_MS / 1000.0;
    s->attempt_end = s->copy && reserve > 0 ? deadline - reserve : deadline;
    nng_aio_set_timeout(s->aio, ms_until(s->attempt_end));
    nng_aio_set_msg(s->aio, m);
    nng_ctx_send(s->ctx, s->aio);
    abort_recheck(s);
}

/* Waits for a synchronous slot; hands over its reply (caller frees) and frees the slot. */
static int slot_wait(struct ps_client *c, slot *s, nng_msg **reply, char **errptr)
{
    pthread_mutex_lock(&c->mu);
    while (s->state != SL_DONE)
        pthread_cond_wait(&c->cv, &c->mu);
    int rc = s->rc;
    char *err = s->err;
    nng_msg *m = s->reply;
    s->err = NULL;
    s->reply = NULL;
    s->state = SL_FREE;
    c->shards[s->shard].busy--;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (rc != CM_OK) {
        if (errptr) {
            free(*errptr);
            *errptr = err;
        } else {
            free(err);
        }
        if (m) nng_msg_free(m);
        return rc;
    }
    free(err);
    if (reply)
        *reply = m;
    else if (m)
        nng_msg_free(m);
    return CM_OK;
}

/* One synchronous request to one shard. */
static int request(struct ps_client *c, uint32_t shard, nng_msg *m, bool idempotent,
                   uint64_t timeout, nng_msg **reply, char **errptr)
{
    slot *s = slot_acquire(c, shard, K_SYNC);
    slot_send(s, m, idempotent, timeout);
    return slot_wait(c, s, reply, errptr);
}

static int take_async_error(struct ps_client *c, char **errptr)
{
    pthread_mutex_lock(&c->mu);
    int rc = c->async_rc;
    char *err = c->async_err;
    c->async_rc = CM_OK;
    c->async_err = NULL;
    pthread_mutex_unlock(&c->mu);
    if (rc != CM_OK) cm_err(errptr, rc, "earlier push failed: %s", err ? err : "?");
    free(err);
    return rc;
}

static nng_msg *msg_simple(uint16_t op, uint32_t table, uint32_t clock, const void *payload,
                           size_t len)
{
    ps_hdr h;
    memset(&h, 0, sizeof h);
    h.op = op;
    h.table = table;
    h.clock = clock;
    nng_msg *m;
    uint8_t *p;
    if (ps_msg_new(&h, len, &m, &p) != CM_OK) return NULL;
    if (len) memcpy(p, payload, len);
    return m;
}

/* ---- life cycle ---- */

/* ---- failover ---- */

/* Moves a shard's socket from its primary to its backup. */
static int fail_over(struct ps_client *c, uint32_t shard, char **errptr)
{
    shard_conn *sc = &c->shards[shard];
    nng_dialer_close(sc->dialer);
    pthread_mutex_lock(&c->mu);
    sc->switched = true;
    pthread_mutex_unlock(&c->mu);
    int rc = ps_net_dial(sc->sock, sc->backup_url, &c->cfg, &sc->dialer, errptr);
    __atomic_add_fetch(&c->st.failovers, 1, __ATOMIC_RELAXED);
    fprintf(stderr,
            "ember: worker %u: shard %u primary %s is gone; failing over to its backup %s\n",
            c->worker, shard, sc->url, sc->backup_url);
    return rc;
}

/* nng pipe event: the connection to a primary went away. Only flags it (this runs on nng's
 * thread, which must not block on closing a dialer). */
static void pipe_removed(nng_pipe p, nng_pipe_ev ev, void *arg)
{
    (void)p;
    (void)ev;
    shard_conn *sc = arg;
    want_failover(sc->c, sc);
}

static void *failover_main(void *arg)
{
    struct ps_client *c = arg;
    pthread_mutex_lock(&c->mu);
    while (!c->closing) {
        uint32_t i = 0;
        while (i < c->cfg.n_shards && !c->shards[i].fail_pending)
            i++;
        if (i == c->cfg.n_shards) {
            pthread_cond_wait(&c->fail_cv, &c->mu);
            continue;
        }
        c->shards[i].fail_pending = false;
        pthread_mutex_unlock(&c->mu);
        char *err = NULL;
        if (fail_over(c, i, &err) != CM_OK)
            fprintf(stderr, "ember: worker %u: failover of shard %u failed: %s\n", c->worker, i,
                    err);
        free(err);
        pthread_mutex_lock(&c->mu);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static int hello(struct ps_client *c, uint32_t shard, char **errptr)
{
    const ps_config *cfg = &c->cfg;
    size_t len = 5 * 4 + 8ull * (cfg->n_tables + cfg->n_dense);
    uint8_t buf[5 * 4 + 8 * (PS_MAX_TABLES + PS_MAX_DENSE)];
    uint32_t v[5] = {shard, cfg->n_shards, cfg->n_workers, cfg->n_tables, cfg->n_dense};
    memcpy(buf, v, sizeof v);
    for (uint32_t i = 0; i < cfg->n_tables + cfg->n_dense; i++) {
        uint64_t fp = i < cfg->n_tables ? ps_table_fingerprint(&cfg->tables[i])
                                        : ps_dense_fingerprint(&cfg->dense[i - cfg->n_tables]);
        memcpy(buf + sizeof v + 8 * i, &fp, 8);
    }
    nng_msg *m = msg_simple(PS_OP_HELLO, 0, 0, buf, len), *reply = NULL;
    if (m == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    int rc = request(c, shard, m, true, c->timeout_ms, &reply, errptr);
    /* Shard 0 says which barrier generation the cluster is in (a restarted worker joins it).
     * Every shard sends it: a reply without it is not a shard's, and a client left at
     * generation 0 would pass its first barrier at once (shard 0 takes 0 as long completed). */
    char from[1024];
    if (rc == CM_OK && nng_msg_len(reply) != PS_HDR_BYTES + 8)
        rc = cm_err(errptr, CM_ECORRUPT,
                    "%s: a HELLO reply of %zu bytes, expected 8 (the barrier generation)",
                    reply_from(c, shard, reply, from, sizeof from),
                    nng_msg_len(reply) - PS_HDR_BYTES);
    if (rc == CM_OK && shard == 0)
        memcpy(&c->barrier_gen, (uint8_t *)nng_msg_body(reply) + PS_HDR_BYTES, 8);
    if (reply) nng_msg_free(reply);
    return rc;
}

int ps_client_create(const ps_client_opts *o, ps_client **out, char **errptr)
{
    int rc = ps_config_check(o->cfg, errptr);
    if (rc != CM_OK) return rc;
    /* A server recognises a resent push by the last PS_DEDUP_RING request ids of its worker;
     * a window wider than that could have a resend after a failover applied twice. */
    if (o->window > PS_DEDUP_RING)
        return cm_err(errptr, CM_EINVAL,
                      "window %u above %u, the pushes a server remembers a worker by", o->window,
                      PS_DEDUP_RING);
    if (o->worker >= o->cfg->n_workers)
        return cm_err(errptr, CM_EINVAL, "worker %u out of range (the cluster has %u)", o->worker,
                      o->cfg->n_workers);
    struct ps_client *c = calloc(1, sizeof *c);
    if (c == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    c->cfg = *o->cfg;
    c->worker = o->worker;
    c->window = o->window ? o->window : 8;
    c->timeout_ms = o->timeout_ms ? o->timeout_ms : PS_TIMEOUT_DEFAULT_MS;
    ps_resid_bound(c->residual, &c->cfg, o->resid_memory);
    /* Request ids start at a random base, so a restarted worker's ids are new to the server's
     * duplicate check. */
    double t = cm_now();
    uint64_t seed[2] = {(uint64_t)getpid() ^ ((uint64_t)o->worker << 32), 0};
    memcpy(&seed[1], &t, sizeof t);
    c->next_req = (cm_xxh3(seed, sizeof seed) & 0xffffffffull) << 24;
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->mirror_mu, NULL);
    pthread_cond_init(&c->mirror_cv, NULL);
    pthread_cond_init(&c->cv, NULL);
    pthread_cond_init(&c->fail_cv, NULL);
    c->shards = calloc(c->cfg.n_shards, sizeof *c->shards);
    if (c->shards == NULL) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        goto fail;
    }
    if (!o->explicit_keys &&
        (c->pulled = ps_keycache_create(c->cfg.n_shards, c->cfg.n_tables)) == NULL)
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
    for (uint32_t i = 0; i < c->cfg.n_shards && rc == CM_OK; i++) {
        shard_conn *sc = &c->shards[i];
        sc->c = c;
        sc->index = i;
        sc->url = strdup(o->urls[i]);
        if (o->backup_urls && o->backup_urls[i]) sc->backup_url = strdup(o->backup_urls[i]);
        if (sc->url == NULL || (o->backup_urls && o->backup_urls[i] && sc->backup_url == NULL)) {
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
            break;
        }
        int rv = nng_req0_open(&sc->sock);
        if (rv != 0) {
            rc = cm_err(errptr, CM_EIO, "cannot open req socket: %s", nng_strerror(rv));
            break;
        }
        sc->open = true;
        nng_socket_set_size(sc->sock, NNG_OPT_RECVMAXSZ, (size_t)c->cfg.max_msg_bytes);
        nng_socket_set_ms(sc->sock, NNG_OPT_RECONNMINT, 20);
        nng_socket_set_ms(sc->sock, NNG_OPT_RECONNMAXT, 500);
        sc->slots = calloc(c->window, sizeof *sc->slots);
        if (sc->slots == NULL) {
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
            break;
        }
        for (uint32_t j = 0; j < c->window && rc == CM_OK; j++) {
            slot *s = &sc->slots[j];
            s->c = c;
            s->shard = i;
            if ((rv = nng_aio_alloc(&s->aio, slot_cb, s)) != 0 ||
                (rv = nng_ctx_open(&s->ctx, sc->sock)) != 0)
                rc = cm_err(errptr, CM_EIO, "cannot set up contexts: %s", nng_strerror(rv));
        }
        if (rc == CM_OK) rc = ps_net_dial(sc->sock, o->urls[i], &c->cfg, &sc->dialer, errptr);
        if (rc == CM_OK) sc->primary_dialer = nng_dialer_id(sc->dialer);
    }
    /* Watch the primaries before the HELLOs: a restarted worker whose primary is gone finds
     * the backup through the same failover as a running one. */
    for (uint32_t i = 0; i < c->cfg.n_shards && rc == CM_OK; i++) {
        shard_conn *sc = &c->shards[i];
        if (sc->backup_url == NULL) continue;
        int rv = nng_pipe_notify(sc->sock, NNG_PIPE_EV_REM_POST, pipe_removed, sc);
        if (rv != 0) rc = cm_err(errptr, CM_EIO, "cannot watch shard %u: %s", i, nng_strerror(rv));
        if (rc == CM_OK && !c->failover_running) {
            if (pthread_create(&c->failover, NULL, failover_main, c) != 0)
                rc = cm_err(errptr, CM_ERR, "cannot start the failover thread");
            else
                c->failover_running = true;
        }
    }
    for (uint32_t i = 0; i < c->cfg.n_shards && rc == CM_OK; i++) {
        char *err = NULL;
        rc = hello(c, i, &err);
        /* Every error names the shard and the URL that failed (or both, with a backup). */
        if (rc != CM_OK) cm_err(errptr, rc, "HELLO failed: %s", err);
        free(err);
    }
    if (rc != CM_OK) goto fail;
    *out = c;
    return CM_OK;
fail:
    ps_client_destroy(c);
    return rc;
}

void ps_client_abort(ps_client *c)
{
    if (c == NULL || c->shards == NULL) return;
    __atomic_store_n(&c->aborted, 1, __ATOMIC_RELEASE);
    for (uint32_t i = 0; i < c->cfg.n_shards; i++) {
        shard_conn *sc = &c->shards[i];
        for (uint32_t j = 0; sc->slots && j < c->window; j++)
            if (sc->slots[j].aio) nng_aio_cancel(sc->slots[j].aio);
    }
}

void ps_client_destroy(ps_client *c)
{
    if (c == NULL) return;
    if (c->shards) ps_client_flush(c, NULL);
    pthread_mutex_lock(&c->mu);
    c->closing = true;
    pthread_cond_broadcast(&c->fail_cv);
    pthread_cond_broadcast(&c->mirror_cv);
    pthread_mutex_unlock(&c->mu);
    if (c->failover_running) pthread_join(c->failover, NULL);
    if (c->sender_running) pthread_join(c->sender, NULL);
    if (c->shards) {
        for (uint32_t i = 0; i < c->cfg.n_shards; i++) {
            shard_conn *sc = &c->shards[i];
            for (uint32_t j = 0; sc->slots && j < c->window; j++)
                if (sc->slots[j].aio) nng_aio_stop(sc->slots[j].aio);
            if (sc->open) nng_close(sc->sock);
            for (uint32_t j = 0; sc->slots && j < c->window; j++) {
                ps_aio_free_stopped(sc->slots[j].aio);
                if (sc->slots[j].reply) nng_msg_free(sc->slots[j].reply);
                if (sc->slots[j].copy) nng_msg_free(sc->slots[j].copy);
                slot_drop_fallback(&sc->slots[j]);
                slot_drop_resend(&sc->slots[j]);
                free(sc->slots[j].err);
            }
            free(sc->slots);
            free(sc->url);
            free(sc->backup_url);
        }
    }
    ps_resid_clear(c->residual);
    for (uint32_t b = 0; b < PS_MAX_DENSE; b++)
        mirror_drop(c, b);
    pthread_mutex_destroy(&c->mirror_mu);
    pthread_cond_destroy(&c->mirror_cv);
    ps_keycache_destroy(c->pulled);
    free(c->shards);
    free(c->async_err);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    pthread_cond_destroy(&c->fail_cv);
    free(c);
}

/* ---- batching: sort, dedup, split by shard ---- */

/* A batch split by shard: skeys are the distinct keys grouped by shard (shard s owns positions
 * start[s] .. start[s+1]), each group sorted; inv[i] is the position of the caller's key i
 * there, so rows and gradients are laid out in the order the messages carry them. identity:
 * the caller's keys were in that order already (inv[i] == i, skeys a copy of them). */
typedef struct split {
    uint32_t *inv, *start;
    size_t n_uniq;
    uint64_t *skeys;
    bool identity;
} split;

static void split_free(split *sp)
{
    free(sp->inv);
    free(sp->start);
    free(sp->skeys);
}

/* Places sorted distinct keys u[0..n) in split order: start (ns + 1, zeroed) gets each shard's
 * first position, place[k] key k's position; fill is ns + 1 entries of scratch. (u is only
 * read; not const because GCC 12 then warns on freshly malloc'd arrays the caller filled.) */
static void shard_places(uint32_t ns, uint64_t *u, size_t n, uint32_t *start, uint32_t *fill,
                         uint32_t *place)
{
    for (size_t k = 0; k < n; k++) {
        place[k] = ns == 1 ? 0 : ps_key_shard(u[k], ns);
        start[place[k] + 1]++;
    }
    for (uint32_t s = 0; s < ns; s++)
        start[s + 1] += start[s];
    memcpy(fill, start, (ns + 1) * sizeof *fill);
    for (size_t k = 0; k < n; k++)
        place[k] = fill[place[k]]++;
}

/* One pass: are keys distinct and in split order (ps_keys_order)? Counts each shard's keys
 * into start[s + 1] (start: ns + 1 zeroed entries) on the way. */
static bool in_split_order(uint32_t ns, const uint64_t *keys, size_t n, uint32_t *start)
{
    uint32_t prev = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t s = ns == 1 ? 0 : ps_key_shard(keys[i], ns);
        if (i > 0 && (s < prev || (s == prev && keys[i] <= keys[i - 1]))) return false;
        start[s + 1]++;
        prev = s;
    }
    return true;
}

/* The shard whose range of a split holds position p. */
static uint32_t split_shard(const split *sp, uint32_t ns, uint32_t p)
{
    uint32_t lo = 0, hi = ns - 1;
    while (lo < hi) {
        uint32_t mid = (lo + hi + 1) / 2;
        if (sp->start[mid] <= p)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

static int split_keys(const struct ps_client *c, const uint64_t *keys, size_t n, split *sp,
                      char **errptr)
{
    memset(sp, 0, sizeof *sp);
    uint32_t ns = c->cfg.n_shards;
    sp->start = calloc(ns + 1, sizeof *sp->start);
    if (sp->start != NULL && in_split_order(ns, keys, n, sp->start)) {
        sp->inv = malloc(n * sizeof *sp->inv + 1);
        sp->skeys = malloc(n * sizeof *sp->skeys + 1);
        if (sp->inv == NULL || sp->skeys == NULL) {
            split_free(sp);
            return cm_err(errptr, CM_ENOMEM, "out of memory splitting %zu keys", n);
        }
        for (size_t i = 0; i < n; i++)
            sp->inv[i] = (uint32_t)i;
        memcpy(sp->skeys, keys, n * sizeof *keys);
        for (uint32_t s = 0; s < ns; s++)
            sp->start[s + 1] += sp->start[s];
        sp->n_uniq = n;
        sp->identity = true;
        return CM_OK;
    }
    if (sp->start != NULL) memset(sp->start, 0, (ns + 1) * sizeof *sp->start);
    ps_kv *a = malloc(n * sizeof *a), *tmp = malloc(n * sizeof *tmp);
    uint64_t *uniq = malloc(n * sizeof *uniq);
    uint32_t *owner = malloc(n * sizeof *owner), *fill = malloc((ns + 1) * sizeof *fill);
    sp->inv = malloc(n * sizeof *sp->inv);
    sp->skeys = malloc(n * sizeof *sp->skeys);
    int rc = CM_OK;
    if (!a || !tmp || !uniq || !owner || !fill || !sp->inv || !sp->skeys || !sp->start) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory splitting %zu keys", n);
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        a[i] = (ps_kv){keys[i], (uint32_t)i};
    ps_kv_sort(a, tmp, n);
    size_t u = 0;
    for (size_t i = 0; i < n; i++) {
        if (u == 0 || uniq[u - 1] != a[i].key) uniq[u++] = a[i].key;
        sp->inv[a[i].idx] = (uint32_t)(u - 1);
    }
    sp->n_uniq = u;
    shard_places(ns, uniq, u, sp->start, fill, owner);
    for (size_t k = 0; k < u; k++)
        sp->skeys[owner[k]] = uniq[k];
    for (size_t i = 0; i < n; i++)
        sp->inv[i] = owner[sp->inv[i]];
out:
    free(a);
    free(tmp);
    free(uniq);
    free(owner);
    free(fill);
    if (rc != CM_OK) split_free(sp);
    return rc;
}

int ps_keys_order(uint32_t ns, const uint64_t *keys, size_t n, uint32_t *perm, char **errptr)
{
    if (ns == 0) return cm_err(errptr, CM_EINVAL, "no shards");
    ps_kv *a = malloc(n * sizeof *a + 1), *tmp = malloc(n * sizeof *tmp + 1);
    uint64_t *sorted = malloc(n * sizeof *sorted + 1);
    uint32_t *place = malloc(n * sizeof *place + 1), *start = calloc(ns + 1, sizeof *start),
             *fill = malloc((ns + 1) * sizeof *fill);
    int rc = CM_OK;
    if (!a || !tmp || !sorted || !place || !start || !fill) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory ordering %zu keys", n);
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        a[i] = (ps_kv){keys[i], (uint32_t)i};
    ps_kv_sort(a, tmp, n);
    for (size_t i = 0; i < n; i++) {
        if (i > 0 && a[i].key == a[i - 1].key) {
            rc = cm_err(errptr, CM_EINVAL, "key %" PRIu64 " appears twice", a[i].key);
            goto out;
        }
        sorted[i] = a[i].key;
    }
    shard_places(ns, sorted, n, start, fill, place);
    for (size_t i = 0; i < n; i++)
        perm[place[i]] = a[i].idx;
out:
    free(a);
    free(tmp);
    free(sorted);
    free(place);
    free(start);
    free(fill);
    return rc;
}

static int check_table(const struct ps_client *c, uint32_t table, size_t n, char **errptr)
{
    if (table >= c->cfg.n_tables)
        return cm_err(errptr, CM_EINVAL, "no table %u (the cluster has %u)", table,
                      c->cfg.n_tables);
    if (n > UINT32_MAX) return cm_err(errptr, CM_EINVAL, "batch of %zu keys is too large", n);
    return CM_OK;
}

static ps_hdr rows_hdr(uint16_t op, uint32_t table, ps_codec codec, size_t n, uint8_t flags)
{
    ps_hdr h;
    memset(&h, 0, sizeof h);
    h.op = op;
    h.table = table;
    h.count = (uint32_t)n;
    h.codec = (uint8_t)codec;
    h.flags = flags;
    return h;
}

/* Builds a PULL or PUSH message for one shard's keys (and rows, for PUSH). */
static nng_msg *rows_msg(uint16_t op, uint32_t table, ps_codec codec, const uint64_t *keys,
                         size_t n, const uint8_t *rows, size_t row_bytes, uint8_t flags)
{
    ps_hdr h = rows_hdr(op, table, codec, n, flags);
    nng_msg *m;
    return ps_msg_rows(&h, keys, n, rows, row_bytes, &m) == CM_OK ? m : NULL;
}

/* Keeps the key list a shard has just served for a pull, for the push that follows (the
 * server keeps it too). Lookups are left out, as on the server. Best effort: without memory the
 * push carries its keys. */
static void remember_pull(struct ps_client *c, uint32_t shard, uint32_t table, uint64_t req_id,
                          const uint64_t *keys, size_t n, uint8_t flags)
{
    if (c->pulled == NULL || (flags & PS_FLAG_LOOKUP)) return;
    uint64_t *copy = malloc(n * sizeof *copy);
    if (copy == NULL) return;
    memcpy(copy, keys, n * sizeof *copy);
    ps_keycache_put(c->pulled, shard, table, req_id, copy, NULL, n);
}

/* One shard's part of a push: elided when the shard served a pull of exactly these keys
 * recently, the slot then keeping keys and rows for a resend with keys; else with its keys. */
static int push_shard(struct ps_client *c, uint32_t shard, uint32_t table, ps_codec codec,
                      const uint64_t *keys, size_t n, const uint8_t *rows, size_t rb)
{
    uint64_t pull_id, sum;
    if (c->pulled == NULL || !ps_keycache_match(c->pulled, shard, table, keys, n, &pull_id, &sum)) {
        nng_msg *m = rows_msg(PS_OP_PUSH, table, codec, keys, n, rows, rb, 0);
        if (m == NULL) return CM_ENOMEM;
        slot_send(slot_acquire(c, shard, K_ASYNC), m, true, c->timeout_ms);
        return CM_OK;
    }
    ps_hdr h = rows_hdr(PS_OP_PUSH, table, codec, n, PS_FLAG_ELIDED);
    nng_msg *m;
    uint8_t *p;
    uint64_t *fb_keys = malloc(n * sizeof *fb_keys);
    uint8_t *fb_rows = malloc(n * rb);
    if (fb_keys == NULL || fb_rows == NULL ||
        ps_msg_new(&h, PS_ELIDED_HEAD + n * rb, &m, &p) != CM_OK) {
        free(fb_keys);
        free(fb_rows);
        return CM_ENOMEM;
    }
    memcpy(p, &pull_id, 8);
    memcpy(p + 8, &sum, 8);
    memcpy(p + PS_ELIDED_HEAD, rows, n * rb);
    memcpy(fb_keys, keys, n * sizeof *fb_keys);
    memcpy(fb_rows, rows, n * rb);
    slot *s = slot_acquire(c, shard, K_ASYNC);
    s->fb_hdr = h;
    s->fb_hdr.flags = 0;
    s->fb_keys = fb_keys;
    s->fb_rows = fb_rows;
    s->fb_row_bytes = rb;
    __atomic_add_fetch(&c->st.pushes_elided, 1, __ATOMIC_RELAXED);
    slot_send(s, m, true, c->timeout_ms);
    return CM_OK;
}

static int pull_rows(ps_client *c, uint32_t table, const uint64_t *keys, size_t n, float *out,
                     uint8_t flags, char **errptr)
{
    int rc = check_table(c, table, n, errptr);
    if (rc != CM_OK || n == 0) return rc;
    const uint32_t dim = c->cfg.tables[table].cfg.dim, ns = c->cfg.n_shards;
    const ps_codec codec = c->cfg.tables[table].pull_codec;
    const size_t rb = ps_codec_row_bytes(codec, dim);
    split sp;
    rc = split_keys(c, keys, n, &sp, errptr);
    if (rc != CM_OK) return rc;
    /* Replies are decoded in shard order into rows: each caller's key is one copy away from its
     * row; keys already in that order decode straight into out. fp32 replies need no decoding:
     * they are kept, each caller's key copies its row straight out of its shard's reply (one
     * copy of the batch instead of two), and out is checked for non-finite values after. */
    const bool direct = codec == PS_CODEC_F32 && !sp.identity;
    float *rows = sp.identity ? out : direct ? NULL : malloc(sp.n_uniq * dim * sizeof *rows + 1);
    slot **slots = calloc(ns, sizeof *slots);
    uint64_t *req_ids = calloc(ns, sizeof *req_ids);
    nng_msg **replies = direct ? calloc(ns, sizeof *replies) : NULL;
    if ((!rows && !direct) || !slots || !req_ids || (direct && !replies))
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
    /* Read your writes: the server serves requests on many contexts at once, so a pull sent
     * while this client's push to the same shard is in flight could overtake it. */
    pthread_mutex_lock(&c->mu);
    for (uint32_t s = 0; s < ns; s++)
        while (sp.start[s + 1] > sp.start[s] && c->shards[s].pushing > 0)
            pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    /* A push that failed cannot be read back, and its shard has just had the whole timeout to
     * answer it: reported now, not after the pull's own request has waited as long again. */
    if (rc == CM_OK) rc = take_async_error(c, errptr);
    for (uint32_t s = 0; s < ns && rc == CM_OK; s++) {
        size_t cnt = sp.start[s + 1] - sp.start[s];
        if (cnt == 0) continue;
        nng_msg *m =
            rows_msg(PS_OP_PULL, table, codec, sp.skeys + sp.start[s], cnt, NULL, 0, flags);
        if (m == NULL) {
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
            break;
        }
        slots[s] = slot_acquire(c, s, K_SYNC);
        req_ids[s] = slots[s]->req_id;
        slots[s]->pull_hdr = rows_hdr(PS_OP_PULL, table, codec, cnt, flags);
        slots[s]->pull_keys = sp.skeys + sp.start[s];
        slot_send(slots[s], m, true, c->timeout_ms);
    }
    /* Every slot sent must be waited for, even after an error. */
    for (uint32_t s = 0; s < ns; s++) {
        if (slots == NULL || slots[s] == NULL) continue;
        nng_msg *reply = NULL;
        char *err = NULL;
        int r = slot_wait(c, slots[s], &reply, &err);
        size_t cnt = sp.start[s + 1] - sp.start[s];
        char from[1024];
        if (r == CM_OK) reply_from(c, s, reply, from, sizeof from);
        if (r == CM_OK && nng_msg_len(reply) != PS_HDR_BYTES + cnt * rb)
            r = cm_err(&err, CM_ECORRUPT, "%s returned %zu bytes for %zu rows of table %u", from,
                       nng_msg_len(reply) - PS_HDR_BYTES, cnt, table);
        if (r == CM_OK && !direct &&
            (r = ps_codec_decode(codec, (const uint8_t *)nng_msg_body(reply) + PS_HDR_BYTES, cnt,
                                 dim, rows + (size_t)sp.start[s] * dim, &err)) != CM_OK)
            cm_err(&err, r, "%s: pull of table %u: %s (the shard's order)", from, table,
                   err ? err : "?");
        if (r == CM_OK) remember_pull(c, s, table, req_ids[s], sp.skeys + sp.start[s], cnt, flags);
        if (r != CM_OK && rc == CM_OK) {
            rc = r;
            cm_err(errptr, r, "%s", err ? err : "pull failed");
        }
        free(err);
        if (reply && r == CM_OK && direct)
            replies[s] = reply;
        else if (reply)
            nng_msg_free(reply);
    }
    if (rc == CM_OK && direct) {
        /* Each block of rows is checked where it was just written, still in cache. */
        enum { CHECK_ROWS = 64 };
        size_t bad = n * dim;
        for (size_t i = 0; i < n; i++) {
            uint32_t p = sp.inv[i], s = split_shard(&sp, ns, p);
            const uint8_t *src = (const uint8_t *)nng_msg_body(replies[s]) + PS_HDR_BYTES +
                                 (size_t)(p - sp.start[s]) * dim * sizeof(float);
            memcpy(out + i * dim, src, dim * sizeof(float));
            if ((i + 1) % CHECK_ROWS != 0 && i + 1 != n) continue;
            size_t i0 = i / CHECK_ROWS * CHECK_ROWS, m = (i + 1 - i0) * dim;
            size_t j = bad == n * dim ? cm_f32_first_nonfinite(out + i0 * dim, m) : m;
            if (j < m) bad = i0 * dim + j;
        }
        if (bad < n * dim) {
            char from[1024];
            uint32_t s = split_shard(&sp, ns, sp.inv[bad / dim]);
            rc = cm_err(errptr, CM_ECORRUPT,
                        "%s: pull of table %u: non-finite value in the row of key %" PRIu64,
                        reply_from(c, s, replies[s], from, sizeof from), table, keys[bad / dim]);
        }
    } else if (rc == CM_OK) {
        for (size_t i = 0; i < n && !sp.identity; i++)
            memcpy(out + i * dim, rows + (size_t)sp.inv[i] * dim, dim * sizeof(float));
    }
    if (rc == CM_OK) __atomic_add_fetch(&c->st.rows_pulled, sp.n_uniq, __ATOMIC_RELAXED);
    for (uint32_t s = 0; replies != NULL && s < ns; s++)
        if (replies[s]) nng_msg_free(replies[s]);
    free(replies);
    free(slots);
    free(req_ids);
    if (!sp.identity) free(rows);
    split_free(&sp);
    return rc;
}

int ps_client_pull(ps_client *c, uint32_t table, const uint64_t *keys, size_t n, float *out,
                   char **errptr)
{
    return pull_rows(c, table, keys, n, out, 0, errptr);
}

int ps_client_lookup(ps_client *c, uint32_t table, const uint64_t *keys, size_t n, float *out,
                     char **errptr)
{
    return pull_rows(c, table, keys, n, out, PS_FLAG_LOOKUP, errptr);
}

/* int8 error feedback: adds each key's stored residual into g and keeps the new residual. */
static int error_feedback(struct ps_client *c, uint32_t table, const uint64_t *keys, size_t n,
                          float *g, const float *back, int phase, char **errptr)
{
    ps_resid *res = &c->residual[table];
    if (phase == 0 && res->st == NULL) return CM_OK; /* none kept yet */
    const uint32_t dim = c->cfg.tables[table].cfg.dim;
    const size_t rec = ps_resid_rec_bytes(dim);
    uint8_t *recs = calloc(n, rec), *found = malloc(n);
    int rc = CM_OK;
    if (recs == NULL || found == NULL) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        goto out;
    }
    if (phase == 0) {
        rc = emb_store_get(res->st, keys, n, recs, found, errptr);
        for (size_t i = 0; rc == CM_OK && i < n; i++) {
            if (!found[i]) continue;
            const float *r = (const float *)(recs + i * rec + PS_RESID_FLOATS);
            for (uint32_t j = 0; j < dim; j++)
                g[i * dim + j] += r[j];
        }
    } else {
        double sq_error = 0, sq_norm = 0; /* in registers, not through c on every value */
        const uint64_t stamp = ++res->clock;
        for (size_t i = 0; i < n; i++) {
            memcpy(recs + i * rec, &keys[i], 8);
            memcpy(recs + i * rec + PS_RESID_STAMP, &stamp, 8);
            float *r = (float *)(recs + i * rec + PS_RESID_FLOATS);
            for (uint32_t j = 0; j < dim; j++) {
                r[j] = g[i * dim + j] - back[i * dim + j];
                sq_error += (double)r[j] * r[j];
                sq_norm += (double)g[i * dim + j] * g[i * dim + j];
            }
        }
        c->st.push_sq_error += sq_error;
        c->st.push_sq_norm += sq_norm;
        rc = ps_resid_put(res, dim, recs, n, errptr);
    }
out:
    free(recs);
    free(found);
    return rc;
}

int ps_client_push(ps_client *c, uint32_t table, const uint64_t *keys, size_t n, const float *grads,
                   char **errptr)
{
    int rc = check_table(c, table, n, errptr);
    if (rc == CM_OK) rc = take_async_error(c, errptr);
    if (rc != CM_OK || n == 0) return rc;
    const uint32_t dim = c->cfg.tables[table].cfg.dim, ns = c->cfg.n_shards;
    const ps_codec codec = c->cfg.tables[table].push_codec;
    const size_t rb = ps_codec_row_bytes(codec, dim);
    size_t bad = cm_f32_first_nonfinite(grads, n * dim);
    if (bad < n * dim)
        return cm_err(errptr, CM_EINVAL, "non-finite gradient for key %" PRIu64 " (element %zu)",
                      keys[bad / dim], bad % dim);
    split sp;
    rc = split_keys(c, keys, n, &sp, errptr);
    if (rc != CM_OK) return rc;
    /* Sum duplicates into shard-grouped order; keys in that order already are encoded as they
     * are (int8's error feedback rewrites its copy). */
    const bool own = !sp.identity || codec == PS_CODEC_INT8;
    float *gs = own ? calloc(sp.n_uniq * dim + 1, sizeof *gs) : (float *)grads;
    float *back = codec == PS_CODEC_INT8 ? malloc(sp.n_uniq * dim * sizeof *back + 1) : NULL;
    /* fp32 rows are sent as they lie in gs; other codecs are encoded into enc first. */
    uint8_t *enc = codec == PS_CODEC_F32 ? NULL : malloc(sp.n_uniq * rb + 1);
    if (!gs || (codec == PS_CODEC_INT8 && !back) || (codec != PS_CODEC_F32 && !enc)) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        goto out;
    }
    if (sp.identity && own)
        memcpy(gs, grads, n * dim * sizeof *gs);
    else if (own)
        for (size_t i = 0; i < n; i++)
            for (uint32_t j = 0; j < dim; j++)
                gs[(size_t)sp.inv[i] * dim + j] += grads[i * dim + j];
    if (codec == PS_CODEC_INT8)
        rc = error_feedback(c, table, sp.skeys, sp.n_uniq, gs, NULL, 0, errptr);
    if (rc != CM_OK) goto out;
    if (enc != NULL)
        ps_codec_encode(codec, gs, sp.n_uniq, dim, enc, codec == PS_CODEC_INT8 ? back : NULL);
    if (codec == PS_CODEC_INT8)
        rc = error_feedback(c, table, sp.skeys, sp.n_uniq, gs, back, 1, errptr);
    const uint8_t *rows = enc != NULL ? enc : (const uint8_t *)gs;
    for (uint32_t s = 0; s < ns && rc == CM_OK; s++) {
        size_t cnt = sp.start[s + 1] - sp.start[s];
        if (cnt == 0) continue;
        if (push_shard(c, s, table, codec, sp.skeys + sp.start[s], cnt,
                       rows + (size_t)sp.start[s] * rb, rb) != CM_OK)
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    if (rc == CM_OK) __atomic_add_fetch(&c->st.rows_pushed, sp.n_uniq, __ATOMIC_RELAXED);
out:
    if (own) free(gs);
    free(back);
    free(enc);
    split_free(&sp);
    return rc;
}

int ps_client_flush(ps_client *c, char **errptr)
{
    int rc = mirrors_reap(c, errptr);
    pthread_mutex_lock(&c->mu);
    for (uint32_t s = 0; s < c->cfg.n_shards; s++)
        while (c->shards[s].busy > 0)
            pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    if (rc != CM_OK) {
        take_async_error(c, NULL);
        return rc;
    }
    return take_async_error(c, errptr);
}

uint32_t ps_client_pushes_in_flight(ps_client *c)
{
    pthread_mutex_lock(&c->mu);
    uint32_t n = c->mirror_inflight; /* a mirror's push counts until its reply is in */
    for (uint32_t s = 0; s < c->cfg.n_shards; s++)
        n += c->shards[s].pushing;
    pthread_mutex_unlock(&c->mu);
    return n;
}

/* ---- dense blocks ---- */

static int dense_call(ps_client *c, uint16_t op, uint8_t flags, uint32_t block, const float *in,
                      float *out, int *assigned, char **errptr)
{
    if (block >= c->cfg.n_dense)
        return cm_err(errptr, CM_EINVAL, "no dense block %u (the cluster has %u)", block,
                      c->cfg.n_dense);
    size_t bytes = (size_t)c->cfg.dense[block].size * sizeof(float);
    nng_msg *m = msg_simple(op, block, 0, in, in ? bytes : 0), *reply = NULL;
    if (m == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    ((ps_hdr *)nng_msg_body(m))->flags = flags;
    /* Every dense op may be resent: pushes are de-duplicated, init and pull are idempotent. */
    int rc = request(c, block % c->cfg.n_shards, m, true, c->timeout_ms, &reply, errptr);
    if (rc != CM_OK) return rc;
    ps_hdr h;
    memcpy(&h, nng_msg_body(reply), sizeof h);
    if (out != NULL) {
        char from[1024];
        if (h.payload_len != bytes)
            rc = cm_err(errptr, CM_ECORRUPT, "%s: dense block %u: %" PRIu64 " bytes, expected %zu",
                        reply_from(c, block % c->cfg.n_shards, reply, from, sizeof from), block,
                        h.payload_len, bytes);
        else
            memcpy(out, (uint8_t *)nng_msg_body(reply) + PS_HDR_BYTES, bytes);
    }
    if (assigned) *assigned = h.flags & 1;
    nng_msg_free(reply);
    return rc;
}

static void mirror_drop(ps_client *c, uint32_t block)
{
    dense_mirror *mi = c->mirror[block];
    if (mi == NULL) return;
    ps_dense_destroy(mi->d);
    free(mi->gbuf);
    free(mi->err);
    free(mi);
    c->mirror[block] = NULL;
}

/* Waits for a mirrored block's push in flight, if any, and checks the PS's step and digest
 * after it against the copy's (mirror_mu held). A mismatch means another writer (or a lost
 * update): the block's values on the PS are no longer what this client computes with, so the
 * mirror is dropped (later calls go to the PS) and the error returned. So is a failed push:
 * the copy holds an update the PS may not. */
static int mirror_reap(ps_client *c, uint32_t block, char **errptr)
{
    dense_mirror *mi = c->mirror[block];
    if (mi == NULL || !mi->pending) return CM_OK;
    pthread_mutex_lock(&c->mu);
    while (!mi->done)
        pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    mi->pending = false;
    int rc = mi->rc;
    if (rc != CM_OK)
        cm_err(errptr, rc, "dense block %u: the mirror's push failed: %s", block,
               mi->err ? mi->err : "?");
    else if (mi->got_step != mi->want_step || mi->got != mi->want)
        rc = cm_err(errptr, CM_ECORRUPT,
                    "dense block %u: the PS's values after its step %" PRIu64
                    " differ from this worker's mirror at step %" PRIu64
                    " (another writer of the block?); the mirror is dropped",
                    block, mi->got_step, mi->want_step);
    if (rc != CM_OK) mirror_drop(c, block);
    return rc;
}

/* A push (and read-back into out) on a mirrored block: applied to the copy now, queued for the
 * sender thread (mirror_mu held). */
static int mirror_push(ps_client *c, uint32_t block, const float *grads, float *out, char **errptr)
{
    dense_mirror *mi = c->mirror[block];
    size_t n = (size_t)c->cfg.dense[block].size;
    int rc = mirror_reap(c, block, errptr);
    if (rc != CM_OK) return rc;
    /* What the PS refuses must not reach the copy either. */
    size_t bad = cm_f32_first_nonfinite(grads, n);
    if (bad < n)
        return cm_err(errptr, CM_EINVAL, "dense block %u: non-finite gradient at %zu", block, bad);
    ps_dense_push_read(mi->d, grads, out, &mi->want, &mi->want_step);
    memcpy(mi->gbuf, grads, n * sizeof(float));
    pthread_mutex_lock(&c->mu);
    mi->done = false;
    mi->pending = true;
    free(mi->err);
    mi->err = NULL;
    c->mirror_inflight++;
    c->sendq[c->n_sendq++] = mi;
    pthread_cond_signal(&c->mirror_cv);
    pthread_mutex_unlock(&c->mu);
    return CM_OK;
}

/* The sender thread: sends each queued mirror push (its slot, K_MIRROR, completes it). */
static void *mirror_sender(void *arg)
{
    ps_client *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (c->n_sendq == 0 && !c->closing)
            pthread_cond_wait(&c->mirror_cv, &c->mu);
        if (c->n_sendq == 0) break;
        dense_mirror *mi = c->sendq[0];
        memmove(c->sendq, c->sendq + 1, --c->n_sendq * sizeof c->sendq[0]);
        pthread_mutex_unlock(&c->mu);
        size_t bytes = (size_t)c->cfg.dense[mi->block].size * sizeof(float);
        nng_msg *m = msg_simple(PS_OP_PUSH_DENSE, mi->block, 0, mi->gbuf, bytes);
        if (m == NULL) {
            pthread_mutex_lock(&c->mu);
            mi->rc = cm_err(&mi->err, CM_ENOMEM, "out of memory");
            mi->done = true;
            c->mirror_inflight--;
            pthread_cond_broadcast(&c->cv);
            continue;
        }
        ((ps_hdr *)nng_msg_body(m))->flags = PS_FLAG_DIGEST;
        slot *sl = slot_acquire(c, mi->block % c->cfg.n_shards, K_MIRROR);
        sl->mirror = mi; /* the slot is ours until slot_send */
        slot_send(sl, m, true, c->timeout_ms);
        pthread_mutex_lock(&c->mu);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Reaps every mirror's push in flight; the first error is kept. */
static int mirrors_reap(ps_client *c, char **errptr)
{
    int rc = CM_OK;
    pthread_mutex_lock(&c->mirror_mu);
    for (uint32_t b = 0; b < c->cfg.n_dense; b++) {
        char *err = NULL;
        int r = mirror_reap(c, b, &err);
        if (r != CM_OK && rc == CM_OK) rc = cm_err(errptr, r, "%s", err);
        free(err);
    }
    pthread_mutex_unlock(&c->mirror_mu);
    return rc;
}

int ps_client_dense_mirror(ps_client *c, uint32_t block, char **errptr)
{
    if (block >= c->cfg.n_dense)
        return cm_err(errptr, CM_EINVAL, "no dense block %u (the cluster has %u)", block,
                      c->cfg.n_dense);
    pthread_mutex_lock(&c->mirror_mu);
    int rc = mirror_reap(c, block, errptr);
    mirror_drop(c, block);
    nng_msg *reply = NULL,
            *m = rc == CM_OK ? msg_simple(PS_OP_PULL_DENSE, block, 0, NULL, 0) : NULL;
    dense_mirror *mi = NULL;
    if (rc == CM_OK && m == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
    if (rc == CM_OK) {
        ((ps_hdr *)nng_msg_body(m))->flags = PS_FLAG_STATE;
        rc = request(c, block % c->cfg.n_shards, m, true, c->timeout_ms, &reply, errptr);
    }
    if (rc == CM_OK && ((mi = calloc(1, sizeof *mi)) == NULL ||
                        (mi->gbuf = malloc(c->cfg.dense[block].size * sizeof(float) + 1)) == NULL))
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
    if (rc == CM_OK && !c->sender_running) {
        if (pthread_create(&c->sender, NULL, mirror_sender, c) == 0)
            c->sender_running = true;
        else
            rc = cm_err(errptr, CM_ERR, "cannot start the mirror's sender thread");
    }
    if (rc == CM_OK) rc = ps_dense_create(&c->cfg.dense[block], &mi->d, errptr);
    if (rc == CM_OK) {
        ps_hdr h;
        memcpy(&h, nng_msg_body(reply), sizeof h);
        char *err = NULL, from[1024];
        rc = ps_dense_state_set(mi->d, (uint8_t *)nng_msg_body(reply) + PS_HDR_BYTES,
                                (size_t)h.payload_len, &err);
        if (rc != CM_OK)
            cm_err(errptr, rc, "%s: dense block %u's state: %s",
                   reply_from(c, block % c->cfg.n_shards, reply, from, sizeof from), block,
                   err ? err : "?");
        free(err);
    }
    if (rc == CM_OK) {
        mi->block = block;
        c->mirror[block] = mi;
    } else if (mi != NULL) {
        ps_dense_destroy(mi->d);
        free(mi->gbuf);
        free(mi);
    }
    if (reply) nng_msg_free(reply);
    pthread_mutex_unlock(&c->mirror_mu);
    return rc;
}

/* A dense call that reads or replaces the PS's block itself waits for the mirror's push in
 * flight first (so it sees it); an init or a plain push drops the mirror (the block is no
 * longer what the copy computed). Then the call proper, unless the mirror serves it. */
static int dense_op(ps_client *c, uint16_t op, uint8_t flags, uint32_t block, const float *in,
                    float *out, int *assigned, char **errptr)
{
    if (block >= c->cfg.n_dense) return dense_call(c, op, flags, block, in, out, assigned, errptr);
    pthread_mutex_lock(&c->mirror_mu);
    int rc = CM_OK;
    if (c->mirror[block] != NULL) {
        if (op == PS_OP_PUSH_DENSE && (flags & PS_FLAG_READ_BACK)) {
            rc = mirror_push(c, block, in, out, errptr);
            pthread_mutex_unlock(&c->mirror_mu);
            return rc;
        }
        rc = mirror_reap(c, block, errptr);
        if (op != PS_OP_PULL_DENSE) mirror_drop(c, block);
    }
    pthread_mutex_unlock(&c->mirror_mu);
    return rc == CM_OK ? dense_call(c, op, flags, block, in, out, assigned, errptr) : rc;
}

int ps_client_dense_pull(ps_client *c, uint32_t block, float *out, char **errptr)
{
    return dense_op(c, PS_OP_PULL_DENSE, 0, block, NULL, out, NULL, errptr);
}

int ps_client_dense_push(ps_client *c, uint32_t block, const float *grads, char **errptr)
{
    return dense_op(c, PS_OP_PUSH_DENSE, 0, block, grads, NULL, NULL, errptr);
}

int ps_client_dense_push_pull(ps_client *c, uint32_t block, const float *grads, float *out,
                              char **errptr)
{
    return dense_op(c, PS_OP_PUSH_DENSE, PS_FLAG_READ_BACK, block, grads, out, NULL, errptr);
}

int ps_client_dense_init(ps_client *c, uint32_t block, const float *values, int *assigned,
                         char **errptr)
{
    return dense_op(c, PS_OP_INIT_DENSE, 0, block, values, NULL, assigned, errptr);
}

/* ---- coordination ---- */

/* Waits on shard 0; a slow peer is not an error until the (long) barrier timeout. A wait that
 * fails says what it waited for: shard 0 is usually up, and the worker it waited for is the one
 * that died (a PS's death stops the others first), which the bare transport error hides. */
static int coord(ps_client *c, uint16_t op, uint32_t value, uint32_t count, uint8_t flags,
                 ps_hdr *got, char **errptr)
{
    nng_msg *m = msg_simple(op, 0, value, NULL, 0), *reply = NULL;
    if (m == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    ((ps_hdr *)nng_msg_body(m))->flags = flags;
    ((ps_hdr *)nng_msg_body(m))->count = count;
    char *err = NULL;
    int rc = request(c, 0, m, false, (uint64_t)c->timeout_ms * 20, &reply, &err);
    if (rc == CM_OK && got != NULL) memcpy(got, nng_msg_body(reply), sizeof *got);
    if (reply != NULL) nng_msg_free(reply);
    const char *what = op == PS_OP_CLOCK        ? "clock"
                       : (flags & PS_FLAG_POLL) ? "stop poll at step"
                                                : "barrier";
    if (rc == CM_ECANCELED) /* aborted: the error that aborted it is the one reported */
        cm_err(errptr, rc, "%s", err ? err : "?");
    else if (rc != CM_OK)
        cm_err(errptr, rc, "%s %u (it waits for every worker at shard 0: did another fail?): %s",
               what, (unsigned)value, err ? err : "?");
    free(err);
    return rc;
}

int ps_client_clock(ps_client *c, uint64_t *clock, char **errptr)
{
    int rc = ps_client_flush(c, errptr);
    if (rc != CM_OK) return rc;
    rc = coord(c, PS_OP_CLOCK, (uint32_t)(c->clock + 1), 0, 0, NULL, errptr);
    if (rc != CM_OK) return rc;
    c->clock++;
    if (clock) *clock = c->clock;
    return CM_OK;
}

void ps_client_clock_seek(ps_client *c, uint64_t clock)
{
    c->clock = clock;
}

void ps_client_barrier_seek(ps_client *c, uint64_t id)
{
    c->barrier_gen = id;
}

int ps_client_barrier(ps_client *c, char **errptr)
{
    bool any;
    return ps_client_barrier_vote(c, false, &any, errptr);
}

int ps_client_barrier_vote(ps_client *c, bool stop, bool *any, char **errptr)
{
    ps_hdr got;
    int rc =
        coord(c, PS_OP_BARRIER, (uint32_t)c->barrier_gen, 0, stop ? PS_FLAG_STOP : 0, &got, errptr);
    if (rc == CM_OK) c->barrier_gen++;
    *any = rc == CM_OK && (stop || (got.flags & PS_FLAG_STOP));
    return rc;
}

int ps_client_stop_poll(ps_client *c, uint64_t step, uint32_t every, bool stop, uint64_t *at,
                        char **errptr)
{
    *at = 0;
    if (every == 0 || every > PS_POLL_MAX_EVERY || step > PS_POLL_MAX_STEP)
        return cm_err(errptr, CM_EINVAL, "stop poll: step %" PRIu64 " every %u steps: out of range",
                      step, every);
    ps_hdr got;
    int rc = coord(c, PS_OP_BARRIER, (uint32_t)step, every,
                   PS_FLAG_POLL | (stop ? PS_FLAG_STOP : 0), &got, errptr);
    if (rc == CM_OK && (got.flags & PS_FLAG_STOP)) *at = got.clock;
    return rc;
}

/* Sends the same request to every shard at once and waits for all. */
static int broadcast(ps_client *c, uint16_t op, const void *payload, size_t len, bool idempotent,
                     char **errptr)
{
    uint32_t ns = c->cfg.n_shards;
    slot **slots = calloc(ns, sizeof *slots);
    if (slots == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    int rc = CM_OK;
    for (uint32_t s = 0; s < ns && rc == CM_OK; s++) {
        nng_msg *m = msg_simple(op, 0, 0, payload, len);
        if (m == NULL) {
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
            break;
        }
        slots[s] = slot_acquire(c, s, K_SYNC);
        slot_send(slots[s], m, idempotent, (uint64_t)c->timeout_ms * 20);
    }
    for (uint32_t s = 0; s < ns; s++) {
        if (slots[s] == NULL) continue;
        char *err = NULL;
        int r = slot_wait(c, slots[s], NULL, &err);
        if (r != CM_OK && rc == CM_OK) {
            rc = r;
            cm_err(errptr, r, "%s", err ? err : "request failed");
        }
        free(err);
    }
    free(slots);
    return rc;
}

static int checkpoint(ps_client *c, uint16_t op, const char *dir, char **errptr)
{
    size_t len = strlen(dir);
    if (len == 0 || len > PS_CKPT_DIR_MAX)
        return cm_err(errptr, CM_EINVAL, "checkpoint path %s is %zu bytes: it must be 1..%u", dir,
                      len, PS_CKPT_DIR_MAX);
    int rc = ps_client_flush(c, errptr);
    if (rc == CM_OK) rc = ps_client_barrier(c, errptr);
    /* A worker that did not pass the first barrier cannot meet the others at the second (they
     * cannot all have passed the first): it would only wait out another whole barrier timeout. */
    if (rc != CM_OK) return rc;
    if (c->worker == 0) rc = broadcast(c, op, dir, len, false, errptr);
    /* The second barrier holds every worker until worker 0's snapshot is complete; worker 0
     * enters it even when the snapshot failed, which releases the others. */
    int rc2 = ps_client_barrier(c, rc == CM_OK ? errptr : NULL);
    return rc != CM_OK ? rc : rc2;
}

int ps_client_save(ps_client *c, const char *dir, char **errptr)
{
    return checkpoint(c, PS_OP_SAVE, dir, errptr);
}

int ps_client_load(ps_client *c, const char *dir, char **errptr)
{
    /* The blocks become the checkpoint's: no copy of the old ones stays, and what the last
     * mirrored pushes did no longer matters (their errors are dropped: the load must still
     * enter the collective, or the other workers would wait for it at its barriers). */
    mirrors_reap(c, NULL);
    pthread_mutex_lock(&c->mirror_mu);
    for (uint32_t b = 0; b < PS_MAX_DENSE; b++)
        mirror_drop(c, b);
    pthread_mutex_unlock(&c->mirror_mu);
    /* Likewise the int8 residuals: they are what this client's pushes to the old rows left
     * unsent, and added into the loaded rows' next pushes they would carry updates from a
     * timeline the checkpoint never saw. */
    ps_resid_clear(c->residual);
    return checkpoint(c, PS_OP_LOAD, dir, errptr);
}

int ps_client_residuals_save(ps_client *c, const char *path, char **errptr)
{
    return ps_resid_save(c->residual, &c->cfg, c->worker, path, errptr);
}

int ps_client_residuals_load(ps_client *c, const char *path, char **errptr)
{
    return ps_resid_load(c->residual, &c->cfg, c->worker, path, errptr);
}

/* The client's own counters: those nng's callbacks and other threads add to atomically are read
 * atomically (a plain copy of the struct raced with them). */
void ps_client_stats_local(ps_client *c, ps_client_stats *out)
{
    const ps_client_stats *st = &c->st;
    memset(out, 0, sizeof *out);
#define ST_LOAD(f) out->f = __atomic_load_n(&st->f, __ATOMIC_RELAXED)
    ST_LOAD(bytes_sent);
    ST_LOAD(bytes_received);
    ST_LOAD(rows_pulled);
    ST_LOAD(rows_pushed);
    ST_LOAD(failovers);
    ST_LOAD(push_bytes);
    ST_LOAD(pushes_elided);
    ST_LOAD(push_fallbacks);
    ST_LOAD(replies_damaged);
    ST_LOAD(replies_resent);
#undef ST_LOAD
    out->push_sq_error = st->push_sq_error; /* the pushing thread's own (ps_client_push) */
    out->push_sq_norm = st->push_sq_norm;
    for (uint32_t t = 0; t < c->cfg.n_tables; t++) {
        const ps_resid *r = &c->residual[t];
        out->resid_rows += r->st ? emb_store_count(r->st) : 0;
        out->resid_bytes += r->st ? emb_store_mem_bytes(r->st) : 0;
        out->resid_dropped += r->dropped;
    }
}

int ps_client_stats_get(ps_client *c, ps_client_stats *out, char **errptr)
{
    ps_client_stats_local(c, out);
    for (uint32_t s = 0; s < c->cfg.n_shards; s++) {
        nng_msg *m = msg_simple(PS_OP_STATS, 0, 0, NULL, 0), *reply = NULL;
        if (m == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
        int rc = request(c, s, m, true, c->timeout_ms, &reply, errptr);
        if (rc != CM_OK) return rc;
        size_t want = sizeof(ps_server_stats) + c->cfg.n_tables * sizeof(emb_table_stats);
        if (nng_msg_len(reply) != PS_HDR_BYTES + want) {
            char from[1024];
            rc = cm_err(errptr, CM_ECORRUPT,
                        "%s: STATS reply of %zu bytes, expected %zu (%u tables; another build?)",
                        reply_from(c, s, reply, from, sizeof from),
                        nng_msg_len(reply) - PS_HDR_BYTES, want, c->cfg.n_tables);
            nng_msg_free(reply);
            return rc;
        }
        const uint8_t *p = (const uint8_t *)nng_msg_body(reply) + PS_HDR_BYTES;
        ps_server_stats ss;
        memcpy(&ss, p, sizeof ss);
        ps_server_stats *t = &out->shard_total;
        t->requests += ss.requests;
        t->errors += ss.errors;
        t->bad_messages += ss.bad_messages;
        t->bytes_in += ss.bytes_in;
        t->bytes_out += ss.bytes_out;
        t->rows_pulled += ss.rows_pulled;
        t->rows_pushed += ss.rows_pushed;
        t->elided += ss.elided;
        t->elided_misses += ss.elided_misses;
        t->keylist_bytes += ss.keylist_bytes;
        t->superseded += ss.superseded;
        t->lost_waits += ss.lost_waits;
        t->duplicates += ss.duplicates;
        t->replicated += ss.replicated;
        t->replica_dropped += ss.replica_dropped;
        t->promoted += ss.promoted;
        t->replica_held += ss.replica_held;
        t->replica_held_bytes += ss.replica_held_bytes;
        t->replica_diverged += ss.replica_diverged;
        if (ss.replica_diverged_seq > t->replica_diverged_seq)
            t->replica_diverged_seq = ss.replica_diverged_seq;
        if (s == 0) { /* clocks and barriers are shard 0's alone */
            t->clocks_min = ss.clocks_min;
            t->clocks_max = ss.clocks_max;
            t->staleness_max = ss.staleness_max;
        }
        for (uint32_t i = 0; i < c->cfg.n_tables; i++) {
            emb_table_stats ts;
            memcpy(&ts, p + sizeof ss + i * sizeof ts, sizeof ts);
            emb_table_stats *o = &out->table_total[i];
            uint64_t step = s == 0 || ts.step > o->step ? ts.step : o->step;
            uint64_t *dst = (uint64_t *)o;
            const uint64_t *src = (const uint64_t *)&ts;
            for (size_t k = 0; k < sizeof ts / sizeof(uint64_t); k++)
                dst[k] += src[k];
            /* Counts and bytes add up over shards (bytes_budget: the table's whole budget);
             * a row's size is every shard's, and the step is the furthest shard's. */
            o->row_bytes = ts.row_bytes;
            o->step = step;
        }
        nng_msg_free(reply);
    }
    return CM_OK;
}

int ps_client_shutdown(ps_client *c, char **errptr)
{
    ps_client_flush(c, NULL);
    return broadcast(c, PS_OP_SHUTDOWN, NULL, 0, false, errptr);
}
