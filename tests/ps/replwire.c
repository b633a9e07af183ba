/*
 * Replication against a scripted backup: an in-process primary whose replica URL is a raw
 * rep0 socket driven by the test, and raw req0 clients, so the test decides exactly when the
 * backup acknowledges. SGD with lr 1 and gradients of 1: a row's value is minus the pushes
 * applied to it.
 *   1. A push resent while its first copy is still being forwarded (nng resends a request
 *      after its resend interval or a reconnect) must not be acknowledged before the backup
 *      has acknowledged the first copy: the client would take a push the backup may never get
 *      as safe. Its reply follows the backup's acknowledgement, and it is applied once.
 *   2. A request that a backup refuses as malformed (a worker index outside the cluster, a flag
 *      its op does not define, a payload on an op that carries none) is not a client that
 *      failed over: the backup must not take over for it, which would fence its healthy
 *      primary (and make `ember ps` exit) on one bad message.
 *   3. A REPLICATE whose update fails the checks its primary would have made (an undefined
 *      flag, a worker outside the cluster, a payload on a SHUTDOWN) is refused by the backup,
 *      not acknowledged: it would take the sequence number of the genuine update, which the
 *      backup would then skip as already held.
 *   4. A REPLICATE numbered far past the next update (no primary has that many in flight) is
 *      refused, not held: held, such forwards would grow the backup's log without bound. One
 *      a little ahead is held until the gap fills, then both apply in order.
 *   5. STATS shows what a backup holds ahead of a gap (count and bytes), in process and over
 *      the wire, and nothing once the gap fills: an operator sees a primary whose forwards
 *      arrive out of order, and what a takeover would apply at once.
 *   6. A forwarded update the backup cannot apply (a LOAD of a checkpoint that is not there)
 *      leaves it diverged from its primary, which did apply it: the backup refuses that
 *      REPLICATE and every later one (so the primary drops it), STATS says so, and a client
 *      that comes over gets an error naming the update, not rows that silently differ from
 *      what every acknowledgement promised. Three ways of meeting the failure: applied on
 *      arrival; held ahead of a gap and applied when the gap fills (acknowledged before it
 *      failed: the window docs/PROTOCOL.md describes); held and applied at a takeover.
 *   7. What a backup holds ahead of a gap is bounded in bytes too (contexts x max_message: no
 *      primary has more in flight), not only in sequence numbers, which let one sender park
 *      thousands of maximum-size messages: forwards up to the bound are held, the one past it
 *      is refused without taking its number, and once the gap fills everything held applies,
 *      and the genuine update under the refused number after it.
 */
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <nng/protocol/reqrep0/req.h>

#include "ps/wire.h"
#include "ps_test_util.h"

#define DIM 4u

static const char conf[] = "[cluster]\nshards = 1\nworkers = 1\nreplica_timeout = 20000\n"
                           "[table t]\ndim = 4\noptimizer = sgd\nlr = 1\ninit_scale = 0\n";

/* A sealed request of op under req_id from worker, with flags, carrying p (plen bytes; NULL:
 * zeros); count 1 and fp32 rows for a PULL or PUSH. */
static nng_msg *sealed(uint16_t op, uint64_t req_id, uint16_t worker, uint8_t flags, const void *p,
                       size_t plen)
{
    ps_hdr h;
    memset(&h, 0, sizeof h);
    h.op = op;
    h.count = op == PS_OP_PULL || op == PS_OP_PUSH;
    h.codec = PS_CODEC_F32;
    h.req_id = req_id;
    h.worker = worker;
    h.flags = flags;
    nng_msg *m;
    if (nng_msg_alloc(&m, PS_HDR_BYTES + plen) != 0) pt_die("nng_msg_alloc", NULL);
    uint8_t *b = nng_msg_body(m);
    memset(b, 0, PS_HDR_BYTES + plen);
    memcpy(b, &h, sizeof h);
    if (p != NULL) memcpy(b + PS_HDR_BYTES, p, plen);
    ps_wire_seal(b, plen);
    return m;
}

/* A sealed PUSH of one key with gradient 1 (fp32), from worker under req_id, with flags. */
static nng_msg *push_msg_as(uint64_t key, uint64_t req_id, uint16_t worker, uint8_t flags)
{
    uint8_t p[64];
    uint32_t kb = (uint32_t)ps_keys_encode(&key, 1, p + 4);
    memcpy(p, &kb, 4);
    float g[DIM] = {1, 1, 1, 1};
    memcpy(p + 4 + kb, g, sizeof g);
    return sealed(PS_OP_PUSH, req_id, worker, flags, p, 4 + kb + sizeof g);
}

/* A sealed PULL of one key (fp32) by worker 0. */
static nng_msg *pull_msg(uint64_t key, uint64_t req_id)
{
    uint8_t p[16];
    return sealed(PS_OP_PULL, req_id, 0, 0, p, ps_keys_encode(&key, 1, p));
}

/* A sealed LOAD of checkpoint dir by worker 0. */
static nng_msg *load_msg(const char *dir, uint64_t req_id)
{
    return sealed(PS_OP_LOAD, req_id, 0, 0, dir, strlen(dir));
}

/* The same from worker 0, no flags. */
static nng_msg *push_msg(uint64_t key, uint64_t req_id)
{
    return push_msg_as(key, req_id, 0, 0);
}

/* A raw client: resends off (a resend is the test's own doing), receives bounded. */
static nng_socket raw_client(const char *url, int recv_ms)
{
    nng_socket s;
    if (nng_req0_open(&s) != 0 || nng_dial(s, url, NULL, 0) != 0) pt_die("raw client", strdup(url));
    nng_socket_set_ms(s, NNG_OPT_REQ_RESENDTIME, NNG_DURATION_INFINITE);
    nng_socket_set_ms(s, NNG_OPT_RECVTIMEO, recv_ms);
    return s;
}

/* Status of a reply (freed) to req_id (1: none, or not a reply to it); an error's text into
 * text (n bytes; "" for none) unless text is NULL. */
static int reply_status_text(nng_msg *m, uint64_t req_id, char *text, size_t n)
{
    ps_hdr h;
    int st = 1;
    if (text != NULL) text[0] = '\0';
    if (ps_wire_open(nng_msg_body(m), nng_msg_len(m), &h, NULL) == CM_OK && h.req_id == req_id) {
        st = h.status;
        if (st < 0 && text != NULL)
            ps_error_text((const uint8_t *)nng_msg_body(m) + PS_HDR_BYTES, h.payload_len, text, n);
    }
    nng_msg_free(m);
    return st;
}

static int reply_status(nng_msg *m, uint64_t req_id)
{
    return reply_status_text(m, req_id, NULL, 0);
}

/* An aio's completion, seen by the test thread without waiting on it. */
static void note_done(void *arg)
{
    __atomic_store_n((int *)arg, 1, __ATOMIC_RELEASE);
}

/* Whether flag is set within ms (polled every millisecond). */
static bool done_within(const int *flag, int ms)
{
    for (int i = 0; i < ms && !__atomic_load_n(flag, __ATOMIC_ACQUIRE); i++)
        psp_sleep_ms(1);
    return __atomic_load_n(flag, __ATOMIC_ACQUIRE) != 0;
}

/* The scripted backup's side of one REPLICATE: receive it (bounded) on ctx. */
static nng_msg *backup_recv(nng_ctx ctx, nng_aio *aio)
{
    nng_aio_set_timeout(aio, 10000);
    nng_ctx_recv(ctx, aio);
    nng_aio_wait(aio);
    if (nng_aio_result(aio) != 0) return NULL;
    return nng_aio_get_msg(aio);
}

/* Acknowledges the REPLICATE req (freed) on ctx. */
static void backup_ack(nng_ctx ctx, nng_aio *aio, nng_msg *req)
{
    ps_hdr h;
    memcpy(&h, nng_msg_body(req), sizeof h);
    nng_msg_free(req);
    h.payload_len = 0;
    h.status = 0;
    nng_msg *m;
    if (nng_msg_alloc(&m, PS_HDR_BYTES) != 0) pt_die("nng_msg_alloc", NULL);
    memcpy(nng_msg_body(m), &h, sizeof h);
    ps_wire_seal(nng_msg_body(m), 0);
    nng_aio_set_msg(aio, m);
    nng_aio_set_timeout(aio, 10000);
    nng_ctx_send(ctx, aio);
    nng_aio_wait(aio);
    if (nng_aio_result(aio) != 0) nng_msg_free(nng_aio_get_msg(aio));
}

/* 1. A resend during the first copy's forward. */
static void resend_while_forwarding(const ps_config *cfg, const char *dir)
{
    const char *pu = pt_ipc(dir, "p1"), *bu = pt_ipc(dir, "b1");
    nng_socket fb;
    nng_ctx fctx = NNG_CTX_INITIALIZER;
    nng_aio *faio = NULL;
    if (nng_rep0_open(&fb) != 0 || nng_listen(fb, bu, NULL, 0) != 0 ||
        nng_ctx_open(&fctx, fb) != 0 || nng_aio_alloc(&faio, NULL, NULL) != 0)
        pt_die("scripted backup", NULL);
    ps_server_opts o = {.cfg = cfg, .listen = pu, .shard = 0, .replica_url = bu};
    ps_server *p = NULL;
    char *err = NULL;
    if (ps_server_create(&o, &p, &err) != CM_OK) pt_die("ps_server_create", err);
    nng_socket r1 = raw_client(pu, 10000), r2 = raw_client(pu, 10000);
    /* r2's reply is awaited on an aio, so the test can look whether it came without giving up
     * on it (a req socket's receive that times out abandons the request). */
    int r2_done = 0;
    nng_aio *r2aio;
    if (nng_aio_alloc(&r2aio, note_done, &r2_done) != 0) pt_die("nng_aio_alloc", NULL);
    nng_aio_set_timeout(r2aio, 10000);
    const uint64_t key = 7, req_id = 0x5150;

    CHECK(nng_sendmsg(r1, push_msg(key, req_id), 0) == 0);
    nng_msg *fwd = backup_recv(fctx, faio); /* the primary applied it and forwards it */
    CHECK_MSG(fwd != NULL, "the primary forwarded nothing");
    if (fwd != NULL) {
        ps_hdr h;
        memcpy(&h, nng_msg_body(fwd), sizeof h);
        CHECK_MSG(h.op == PS_OP_REPLICATE, "forwarded op %u", h.op);
    }
    /* The same push again while the backup holds its first copy unacknowledged. */
    CHECK(nng_sendmsg(r2, push_msg(key, req_id), 0) == 0);
    nng_recv_aio(r2, r2aio);
    /* A second is ample for a reply the server would give at once; the fixed server cannot
     * give it at all before the acknowledgement below, so this never fails wrongly. */
    CHECK_MSG(!done_within(&r2_done, 1000),
              "the resent push was answered before the backup acknowledged its first copy");
    if (fwd != NULL) backup_ack(fctx, faio, fwd);
    nng_msg *m = NULL;
    CHECK_MSG(nng_recvmsg(r1, &m, 0) == 0 && reply_status(m, req_id) == 0,
              "the push was not acknowledged once the backup had it");
    nng_aio_wait(r2aio);
    int rv = nng_aio_result(r2aio);
    CHECK_MSG(rv == 0 && reply_status(nng_aio_get_msg(r2aio), req_id) == 0,
              "the resent push was not acknowledged once the backup had the first copy: %s",
              nng_strerror(rv));
    ps_server_stats st;
    ps_server_stats_get(p, &st);
    CHECK_MSG(st.rows_pushed == 1 && st.duplicates == 1,
              "rows pushed %llu (want 1), duplicates %llu (want 1)",
              (unsigned long long)st.rows_pushed, (unsigned long long)st.duplicates);
    nng_close(r1);
    nng_close(r2);
    nng_aio_free(r2aio);
    ps_server_destroy(p);
    nng_aio_free(faio);
    nng_close(fb);
}

/* Sends the request m (freed) under req_id to url by a raw client; returns the reply's status
 * (1: no reply), its error text into text as reply_status_text. */
static int raw_request(const char *url, nng_msg *m, uint64_t req_id, char *text, size_t n)
{
    nng_socket r = raw_client(url, 10000);
    nng_msg *rep = NULL;
    int st = 1;
    if (text != NULL) text[0] = '\0';
    if (nng_sendmsg(r, m, 0) != 0)
        nng_msg_free(m);
    else if (nng_recvmsg(r, &rep, 0) == 0)
        st = reply_status_text(rep, req_id, text, n);
    nng_close(r);
    return st;
}

/* A request to url whose error reply is awaited; returns its status (1: no reply). */
static int raw_call(const char *url, uint16_t op, uint16_t worker, uint8_t flags, size_t plen)
{
    return raw_request(url, sealed(op, 99, worker, flags, NULL, plen), 99, NULL, 0);
}

/* 2. Malformed requests to a backup. */
static void malformed_to_backup(const ps_config *cfg, const char *dir)
{
    const char *pu = pt_ipc(dir, "p2"), *bu = pt_ipc(dir, "b2");
    ps_server_opts bo = {.cfg = cfg, .listen = bu, .shard = 0, .backup = true};
    ps_server_opts po = {.cfg = cfg, .listen = pu, .shard = 0, .replica_url = bu};
    ps_server *b = NULL, *p = NULL;
    char *err = NULL;
    if (ps_server_create(&bo, &b, &err) != CM_OK) pt_die("ps_server_create", err);
    if (ps_server_create(&po, &p, &err) != CM_OK) pt_die("ps_server_create", err);
    CHECK_MSG(raw_call(bu, PS_OP_PULL_DENSE, 7, 0, 0) < 0, "worker 7 of 1 was not refused");
    CHECK_MSG(raw_call(bu, PS_OP_PULL, 0, 0x80, 0) < 0, "an undefined flag was not refused");
    CHECK_MSG(raw_call(bu, PS_OP_BARRIER, 0, 0, 16) < 0, "a barrier's payload was not refused");
    ps_server_stats bs;
    ps_server_stats_get(b, &bs);
    CHECK_MSG(bs.promoted == 0, "the backup took over for a malformed request");
    /* The primary still replicates: a push is acknowledged through the backup, unfenced. */
    const char *urls[1] = {pu};
    ps_client *c = pt_client(cfg, urls, 0, 10000);
    uint64_t key = 11;
    float g[DIM] = {1, 1, 1, 1};
    CHECK_OK(ps_client_push(c, 0, &key, 1, g, &err), err);
    CHECK_OK(ps_client_flush(c, &err), err);
    free(err);
    CHECK_MSG(!ps_server_fenced(p), "the primary was fenced by a malformed request to its backup");
    ps_server_stats ps_st;
    ps_server_stats_get(p, &ps_st);
    CHECK_MSG(ps_st.replica_dropped == 0, "the primary dropped its backup");
    CHECK_MSG(ps_st.replicated == 1, "the primary replicated %llu updates, want 1",
              (unsigned long long)ps_st.replicated);
    ps_client_destroy(c);
    ps_server_destroy(p);
    ps_server_destroy(b);
}

/* A REPLICATE of update (freed) under seq to the backup at url; returns the reply's status,
 * its error text into text as reply_status_text. */
static int replicate_text(const char *url, uint64_t seq, nng_msg *update, char *text, size_t n)
{
    size_t ulen = nng_msg_len(update);
    uint8_t *p = malloc(8 + ulen);
    if (p == NULL) pt_die("out of memory", NULL);
    memcpy(p, &seq, 8);
    memcpy(p + 8, nng_msg_body(update), ulen);
    nng_msg_free(update);
    nng_msg *m = sealed(PS_OP_REPLICATE, seq, 0, 0, p, 8 + ulen);
    free(p);
    return raw_request(url, m, seq, text, n);
}

static int replicate(const char *url, uint64_t seq, nng_msg *update)
{
    return replicate_text(url, seq, update, NULL, 0);
}

/* A sealed SHUTDOWN carrying junk. */
static nng_msg *shutdown_with_junk(void)
{
    uint8_t junk[16];
    memset(junk, 0x5a, sizeof junk);
    return sealed(PS_OP_SHUTDOWN, 0, 0, 0, junk, sizeof junk);
}

/* A backup shard listening on url, nothing in front of it. */
static ps_server *backup_at(const ps_config *cfg, const char *url)
{
    ps_server_opts bo = {.cfg = cfg, .listen = url, .shard = 0, .backup = true};
    ps_server *b = NULL;
    char *err = NULL;
    if (ps_server_create(&bo, &b, &err) != CM_OK) pt_die("ps_server_create", err);
    return b;
}

/* 3. Forwards that fail the primary's checks. */
static void malformed_forwards(const ps_config *cfg, const char *dir)
{
    const char *bu = pt_ipc(dir, "b3");
    ps_server *b = backup_at(cfg, bu);
    char *err = NULL;
    CHECK_MSG(replicate(bu, 1, push_msg_as(21, 1, 0, 0x80)) < 0,
              "a forwarded push with an undefined flag was acknowledged");
    CHECK_MSG(replicate(bu, 1, push_msg_as(22, 2, 7, 0)) < 0,
              "a forwarded push from worker 7 of 1 was acknowledged");
    CHECK_MSG(replicate(bu, 1, shutdown_with_junk()) < 0,
              "a forwarded SHUTDOWN with a payload was acknowledged");
    /* The genuine update 1 is applied, not skipped as held. */
    CHECK_MSG(replicate(bu, 1, push_msg(23, 3)) == 0, "the genuine update 1 was refused");
    ps_server_stats bs;
    ps_server_stats_get(b, &bs);
    CHECK_MSG(bs.bad_messages == 3, "bad messages %llu, want 3",
              (unsigned long long)bs.bad_messages);
    CHECK_MSG(bs.rows_pushed == 1 && bs.promoted == 0,
              "backup: %llu rows pushed (want the genuine update's 1), promoted %llu",
              (unsigned long long)bs.rows_pushed, (unsigned long long)bs.promoted);
    /* Which one it applied: the genuine push's row, not the refused one's. */
    const char *urls[1] = {bu};
    ps_client *c = pt_client(cfg, urls, 0, 10000);
    uint64_t keys[2] = {21, 23};
    float rows[2 * DIM];
    CHECK_OK(ps_client_pull(c, 0, keys, 2, rows, &err), err);
    free(err);
    CHECK_MSG(rows[0] == 0 && rows[DIM] == -1, "key 21 at %.0f (want 0), key 23 at %.0f (want -1)",
              rows[0], rows[DIM]);
    ps_client_destroy(c);
    ps_server_destroy(b);
}

/* 4. Forwards past the window. */
static void far_ahead(const ps_config *cfg, const char *dir)
{
    const char *bu = pt_ipc(dir, "b4");
    ps_server *b = backup_at(cfg, bu);
    char *err = NULL;
    CHECK_MSG(replicate(bu, 1000000000, push_msg(31, 1)) < 0,
              "a forward numbered 10^9 past the next one was acknowledged");
    CHECK_MSG(replicate(bu, 3, push_msg(32, 2)) == 0, "forward 3 (a gap at 2) was refused");
    CHECK_MSG(replicate(bu, 1, push_msg(32, 3)) == 0 && replicate(bu, 2, push_msg(33, 4)) == 0,
              "forwards 1 and 2 were refused");
    ps_server_stats bs;
    ps_server_stats_get(b, &bs);
    CHECK_MSG(bs.bad_messages == 1 && bs.rows_pushed == 3,
              "bad messages %llu (want 1), rows pushed %llu (want 3)",
              (unsigned long long)bs.bad_messages, (unsigned long long)bs.rows_pushed);
    const char *urls[1] = {bu};
    ps_client *c = pt_client(cfg, urls, 0, 10000);
    uint64_t keys[3] = {31, 32, 33};
    float rows[3 * DIM];
    CHECK_OK(ps_client_pull(c, 0, keys, 3, rows, &err), err);
    free(err);
    CHECK_MSG(rows[0] == 0 && rows[DIM] == -2 && rows[2 * DIM] == -1,
              "keys 31/32/33 at %.0f/%.0f/%.0f, want 0/-2/-1", rows[0], rows[DIM], rows[2 * DIM]);
    ps_client_destroy(c);
    ps_server_destroy(b);
}

/* A STATS request to url by a raw client (a ps_client's HELLO would make a backup take over). */
static void raw_stats(const char *url, ps_server_stats *out)
{
    nng_socket r = raw_client(url, 10000);
    ps_hdr h;
    memset(&h, 0, sizeof h);
    h.op = PS_OP_STATS;
    h.req_id = 77;
    nng_msg *m, *rep = NULL;
    if (nng_msg_alloc(&m, PS_HDR_BYTES) != 0) pt_die("nng_msg_alloc", NULL);
    memcpy(nng_msg_body(m), &h, sizeof h);
    ps_wire_seal(nng_msg_body(m), 0);
    memset(out, 0xff, sizeof *out);
    if (nng_sendmsg(r, m, 0) != 0) {
        nng_msg_free(m);
    } else if (nng_recvmsg(r, &rep, 0) == 0) {
        if (nng_msg_len(rep) >= PS_HDR_BYTES + sizeof *out)
            memcpy(out, (uint8_t *)nng_msg_body(rep) + PS_HDR_BYTES, sizeof *out);
        nng_msg_free(rep);
    }
    nng_close(r);
}

/* 5. Held forwards in STATS. */
static void held_in_stats(const ps_config *cfg, const char *dir)
{
    const char *bu = pt_ipc(dir, "b5");
    ps_server *b = backup_at(cfg, bu);
    nng_msg *u3 = push_msg(41, 3), *u4 = push_msg(42, 4);
    const uint64_t bytes = nng_msg_len(u3) + nng_msg_len(u4);
    CHECK_MSG(replicate(bu, 3, u3) == 0 && replicate(bu, 4, u4) == 0,
              "forwards 3 and 4 (a gap at 1 and 2) were refused");
    ps_server_stats bs, ws;
    ps_server_stats_get(b, &bs);
    raw_stats(bu, &ws);
    CHECK_MSG(bs.replica_held == 2 && bs.replica_held_bytes == bytes,
              "held %llu updates of %llu bytes, want 2 of %llu",
              (unsigned long long)bs.replica_held, (unsigned long long)bs.replica_held_bytes,
              (unsigned long long)bytes);
    CHECK_MSG(ws.replica_held == 2 && ws.replica_held_bytes == bytes,
              "STATS over the wire: held %llu updates of %llu bytes, want 2 of %llu",
              (unsigned long long)ws.replica_held, (unsigned long long)ws.replica_held_bytes,
              (unsigned long long)bytes);
    CHECK_MSG(ws.promoted == 0, "STATS made the backup take over");
    CHECK_MSG(replicate(bu, 1, push_msg(43, 5)) == 0 && replicate(bu, 2, push_msg(44, 6)) == 0,
              "forwards 1 and 2 were refused");
    ps_server_stats_get(b, &bs);
    CHECK_MSG(bs.replica_held == 0 && bs.replica_held_bytes == 0 && bs.rows_pushed == 4,
              "after the gap filled: held %llu updates of %llu bytes (want none), %llu rows "
              "pushed (want 4)",
              (unsigned long long)bs.replica_held, (unsigned long long)bs.replica_held_bytes,
              (unsigned long long)bs.rows_pushed);
    ps_server_destroy(b);
}

/* The backup at url (in process: b) reports over the wire and in process that it diverged at
 * update seq. */
static void check_diverged(ps_server *b, const char *url, uint64_t seq, const char *when)
{
    ps_server_stats bs, ws;
    ps_server_stats_get(b, &bs);
    raw_stats(url, &ws);
    CHECK_MSG(bs.replica_diverged == 1 && bs.replica_diverged_seq == seq,
              "%s: STATS diverged %llu at update %llu, want 1 at %llu", when,
              (unsigned long long)bs.replica_diverged, (unsigned long long)bs.replica_diverged_seq,
              (unsigned long long)seq);
    CHECK_MSG(ws.replica_diverged == 1 && ws.replica_diverged_seq == seq,
              "%s: STATS over the wire: diverged %llu at update %llu, want 1 at %llu", when,
              (unsigned long long)ws.replica_diverged, (unsigned long long)ws.replica_diverged_seq,
              (unsigned long long)seq);
    CHECK_MSG(bs.promoted == 0, "%s: a diverged backup took over", when);
}

/* A client's PULL of key at url is refused, with a message naming shard 0 and what. */
static void check_pull_refused(const char *url, uint64_t key, const char *what, const char *when)
{
    char text[1024];
    int st = raw_request(url, pull_msg(key, 600), 600, text, sizeof text);
    CHECK_MSG(st < 0 && st != 1 && strstr(text, "shard 0") && strstr(text, what),
              "%s: a client's PULL from the diverged backup: status %d (%s), want an error "
              "naming shard 0 and %s",
              when, st, text, what);
}

/* 6. A forward the backup cannot apply. */
static void diverged(const ps_config *cfg, const char *dir)
{
    char missing[1024], text[1024];
    snprintf(missing, sizeof missing, "%s/no-such-checkpoint", dir);

    /* Applied on arrival: that very REPLICATE is refused. */
    const char *bu = pt_ipc(dir, "b6");
    ps_server *b = backup_at(cfg, bu);
    CHECK_MSG(replicate(bu, 1, push_msg(51, 1)) == 0, "forward 1 was refused");
    int st = replicate_text(bu, 2, load_msg(missing, 2), text, sizeof text);
    CHECK_MSG(st < 0 && strstr(text, "update 2 (LOAD)") && strstr(text, "no-such-checkpoint"),
              "a LOAD the backup could not apply: status %d (%s), want an error naming update 2 "
              "and the checkpoint",
              st, text);
    check_diverged(b, bu, 2, "applied on arrival");
    st = replicate_text(bu, 3, push_msg(52, 3), text, sizeof text);
    CHECK_MSG(st < 0 && strstr(text, "update 2 (LOAD)"),
              "the REPLICATE after the failed update: status %d (%s), want an error naming "
              "update 2",
              st, text);
    ps_server_stats bs;
    ps_server_stats_get(b, &bs);
    CHECK_MSG(bs.rows_pushed == 1 && bs.replicated == 2,
              "rows pushed %llu (want 1: nothing applied once diverged), updates received %llu "
              "(want 2)",
              (unsigned long long)bs.rows_pushed, (unsigned long long)bs.replicated);
    check_pull_refused(bu, 51, "update 2 (LOAD)", "applied on arrival");
    check_diverged(b, bu, 2, "after the refused PULL");
    ps_server_destroy(b);

    /* Held ahead of a gap (acknowledged on receipt) and applied when the gap fills: the
     * REPLICATE that filled it is refused. */
    bu = pt_ipc(dir, "b7");
    b = backup_at(cfg, bu);
    CHECK_MSG(replicate(bu, 2, load_msg(missing, 1)) == 0,
              "forward 2 (a gap at 1) was refused before it was applied");
    st = replicate_text(bu, 1, push_msg(53, 2), text, sizeof text);
    CHECK_MSG(st < 0 && strstr(text, "update 2 (LOAD)"),
              "the REPLICATE that let the held LOAD through: status %d (%s), want an error "
              "naming update 2",
              st, text);
    check_diverged(b, bu, 2, "when the gap filled");
    check_pull_refused(bu, 53, "update 2 (LOAD)", "when the gap filled");
    ps_server_destroy(b);

    /* Held, and applied at the takeover: the client's request that brought it is refused, and
     * so is the old primary's next REPLICATE (an error, not PS_STATUS_FENCED: the backup did not
     * take over, and a primary still alive goes on without it). */
    bu = pt_ipc(dir, "b8");
    b = backup_at(cfg, bu);
    CHECK_MSG(replicate(bu, 3, load_msg(missing, 1)) == 0,
              "forward 3 (a gap at 1 and 2) was refused before it was applied");
    check_pull_refused(bu, 54, "update 3 (LOAD)", "at the takeover");
    check_diverged(b, bu, 3, "at the takeover");
    st = replicate_text(bu, 1, push_msg(55, 2), text, sizeof text);
    CHECK_MSG(st < 0 && st != PS_STATUS_FENCED && strstr(text, "update 3 (LOAD)"),
              "the old primary's REPLICATE after the takeover: status %d (%s), want an error "
              "naming update 3",
              st, text);
    ps_server_stats_get(b, &bs);
    CHECK_MSG(bs.rows_pushed == 0, "rows pushed %llu, want 0", (unsigned long long)bs.rows_pushed);
    ps_server_destroy(b);
}

/* A sealed PUSH from worker 0 of the n keys from, from + 1, ... with gradient 1 (fp32). */
static nng_msg *push_run(uint64_t from, uint32_t n, uint64_t req_id)
{
    uint64_t keys[256];
    uint8_t p[4 + 256 * 10 + 256 * DIM * 4];
    if (n > 256) pt_die("push_run: too many keys", NULL);
    for (uint32_t i = 0; i < n; i++)
        keys[i] = from + i;
    uint32_t kb = (uint32_t)ps_keys_encode(keys, n, p + 4);
    memcpy(p, &kb, 4);
    for (uint32_t i = 0; i < n * DIM; i++) {
        const float one = 1;
        memcpy(p + 4 + kb + 4 * (size_t)i, &one, 4);
    }
    nng_msg *m = sealed(PS_OP_PUSH, req_id, 0, 0, p, 4 + kb + (size_t)n * DIM * 4);
    ps_hdr h;
    memcpy(&h, nng_msg_body(m), sizeof h);
    h.count = n;
    memcpy(nng_msg_body(m), &h, sizeof h);
    ps_wire_seal(nng_msg_body(m), h.payload_len);
    return m;
}

/* 7. The held forwards' bytes. A backup of 4 contexts with 4 KiB messages holds at most 16 KiB
 * ahead of a gap; pushes of 170 keys are 2950 bytes, so 5 are held and a sixth is refused. */
static void held_bytes_bound(const char *dir)
{
    enum { CTX = 4, KEYS = 170, HELD = 5 };
    static const char small[] = "[cluster]\nshards = 1\nworkers = 1\nmax_message = 4096\n"
                                "[table t]\ndim = 4\noptimizer = sgd\nlr = 1\ninit_scale = 0\n";
    ps_config cfg;
    pt_config(dir, "replwire-small.ini", small, &cfg);
    const char *bu = pt_ipc(dir, "b9");
    ps_server_opts bo = {.cfg = &cfg, .listen = bu, .shard = 0, .backup = true, .n_contexts = CTX};
    ps_server *b = pt_server_with(&bo);
    const uint64_t bound = CTX * 4096;
    nng_msg *probe = push_run(2000, KEYS, 1); /* as long as the held ones */
    const uint64_t one = nng_msg_len(probe);
    nng_msg_free(probe);
    CHECK_MSG(HELD * one <= bound && (HELD + 1) * one > bound,
              "a push of %u keys is %llu bytes: %u do not fit %llu bytes with a sixth past it",
              (unsigned)KEYS, (unsigned long long)one, (unsigned)HELD, (unsigned long long)bound);
    /* Updates 2..6 wait for update 1; key runs 1000 apart, one per update. */
    for (uint64_t seq = 2; seq < 2 + HELD; seq++)
        CHECK_MSG(replicate(bu, seq, push_run(1000 * seq, KEYS, seq)) == 0,
                  "forward %llu (a gap at 1, %llu bytes held) was refused", (unsigned long long)seq,
                  (unsigned long long)((seq - 2) * one));
    char text[1024];
    const uint64_t past = 2 + HELD;
    int st = replicate_text(bu, past, push_run(1000 * past, KEYS, past), text, sizeof text);
    CHECK_MSG(st < 0 && st != 1 && strstr(text, "16384 bytes"),
              "forward %llu, past %llu bytes held: status %d (%s), want a refusal naming the "
              "bound",
              (unsigned long long)past, (unsigned long long)bound, st, text);
    ps_server_stats bs;
    ps_server_stats_get(b, &bs);
    CHECK_MSG(bs.bad_messages == 1 && bs.replica_held == HELD &&
                  bs.replica_held_bytes == HELD * one && bs.rows_pushed == 0,
              "bad messages %llu (want 1), held %llu updates of %llu bytes (want %u of %llu), %llu "
              "rows pushed (want 0)",
              (unsigned long long)bs.bad_messages, (unsigned long long)bs.replica_held,
              (unsigned long long)bs.replica_held_bytes, (unsigned)HELD,
              (unsigned long long)(HELD * one), (unsigned long long)bs.rows_pushed);
    /* The gap fills: 1..6 apply; then the genuine update 7 (another key run) is taken, not
     * skipped as held. */
    CHECK_MSG(replicate(bu, 1, push_run(1000, KEYS, 1)) == 0, "forward 1 (the gap) was refused");
    CHECK_MSG(replicate(bu, past, push_run(50000, KEYS, 50)) == 0,
              "the genuine update %llu was refused after the gap filled", (unsigned long long)past);
    ps_server_stats_get(b, &bs);
    CHECK_MSG(bs.replica_held == 0 && bs.replica_held_bytes == 0 &&
                  bs.rows_pushed == (HELD + 2) * KEYS && bs.promoted == 0,
              "after the gap filled: held %llu updates of %llu bytes (want none), %llu rows "
              "pushed (want %u), promoted %llu",
              (unsigned long long)bs.replica_held, (unsigned long long)bs.replica_held_bytes,
              (unsigned long long)bs.rows_pushed, (unsigned)((HELD + 2) * KEYS),
              (unsigned long long)bs.promoted);
    /* Which update 7 it applied: the genuine one's keys, not the refused one's. */
    const char *urls[1] = {bu};
    ps_client *c = pt_client(&cfg, urls, 0, 10000);
    uint64_t keys[3] = {1000, 1000 * past, 50000};
    float rows[3 * DIM];
    char *err = NULL;
    CHECK_OK(ps_client_pull(c, 0, keys, 3, rows, &err), err);
    free(err);
    CHECK_MSG(rows[0] == -1 && rows[DIM] == 0 && rows[2 * DIM] == -1,
              "keys 1000/%llu/50000 at %.0f/%.0f/%.0f, want -1/0/-1", (unsigned long long)keys[1],
              rows[0], rows[DIM], rows[2 * DIM]);
    ps_client_destroy(c);
    ps_server_destroy(b);
}

/* 8. Forwards at the size limit. A request within max_message reaches the backup inside a
 * REPLICATE that is 72 bytes longer, and an elided push goes with its keys: neither may cost the
 * primary its backup. A push within 72 bytes of the limit is replicated; an elided push whose
 * keys would not fit is refused before it is applied (the client sends it with its keys, and
 * itself refuses that, naming max_message), so the backup stays in step. */
static void forwards_at_limit(const char *dir)
{
    static const char small[] = "[cluster]\nshards = 1\nworkers = 1\nmax_message = 4096\n"
                                "replica_timeout = 2000\n"
                                "[table t]\ndim = 4\noptimizer = sgd\nlr = 1\ninit_scale = 0\n";
    ps_config cfg;
    pt_config(dir, "replwire-limit.ini", small, &cfg);
    const char *bu = pt_ipc(dir, "b10"), *pu = pt_ipc(dir, "p10");
    ps_server_opts bo = {.cfg = &cfg, .listen = bu, .shard = 0, .backup = true};
    ps_server *b = pt_server_with(&bo);
    ps_server_opts po = {.cfg = &cfg, .listen = pu, .shard = 0, .replica_url = bu};
    ps_server *p = pt_server_with(&po);
    uint32_t n = 1;
    for (nng_msg *m; n < 256; n++) { /* the longest push of a run of keys within the limit */
        m = push_run(70000, n + 1, 1);
        size_t len = nng_msg_len(m);
        nng_msg_free(m);
        if (len > 4096) break;
    }
    nng_msg *m = push_run(70000, n, 1);
    const size_t len = nng_msg_len(m);
    CHECK_MSG(len <= 4096 && len + PS_HDR_BYTES + 8 > 4096, "a push of %u keys is %zu bytes", n,
              len);
    char text[1024];
    int st = raw_request(pu, m, 1, text, sizeof text);
    CHECK_MSG(st == 0, "a push of %zu bytes: status %d (%s)", len, st, text);
    ps_server_stats ps_, bs;
    ps_server_stats_get(p, &ps_);
    ps_server_stats_get(b, &bs);
    CHECK_MSG(ps_.replica_dropped == 0 && bs.rows_pushed == n,
              "a push of %zu bytes: backup dropped %llu, %llu of %u rows on it", len,
              (unsigned long long)ps_.replica_dropped, (unsigned long long)bs.rows_pushed, n);

    /* The backup's socket takes a forward's 72 bytes more, but no client request past the
     * limit: refused by the header checks, so it makes no takeover either. */
    m = push_run(80000, n + 1, 2);
    st = raw_request(bu, m, 2, text, sizeof text);
    ps_server_stats_get(b, &bs);
    CHECK_MSG(st < 0 && strstr(text, "exceeds max_message") && bs.promoted == 0,
              "a %u-key push to the backup: status %d (%s), promoted %llu", n + 1, st, text,
              (unsigned long long)bs.promoted);

    /* 200 spread keys: the elided push (3,280 bytes) fits, with its keys it does not. */
    enum { K = 200 };
    uint64_t keys[K];
    float rows[K * DIM];
    for (uint32_t i = 0; i < K; i++)
        keys[i] = (uint64_t)(i + 1) * 0x9e3779b97f4a7c15ull;
    const char *urls[1] = {pu};
    ps_client *c = pt_client(&cfg, urls, 0, 10000);
    char *err = NULL;
    CHECK_OK(ps_client_pull(c, 0, keys, K, rows, &err), err);
    free(err), err = NULL;
    for (uint32_t i = 0; i < K * DIM; i++)
        rows[i] = 1;
    int rc = ps_client_push(c, 0, keys, K, rows, &err);
    if (rc == CM_OK) rc = ps_client_flush(c, &err);
    CHECK_MSG(rc != CM_OK && err && strstr(err, "max_message"), "push: %d (%s)", rc,
              err ? err : "no error");
    free(err);
    ps_client_destroy(c);
    ps_server_stats_get(p, &ps_);
    ps_server_stats_get(b, &bs);
    CHECK_MSG(ps_.replica_dropped == 0 && ps_.rows_pushed == n && bs.rows_pushed == n,
              "after the elided push: backup dropped %llu, rows pushed %llu here, %llu on the "
              "backup (want %u: not applied)",
              (unsigned long long)ps_.replica_dropped, (unsigned long long)ps_.rows_pushed,
              (unsigned long long)bs.rows_pushed, n);
    ps_server_destroy(p);
    ps_server_destroy(b);
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_replwire");
    ps_config cfg;
    pt_config(dir, "replwire.ini", conf, &cfg);
    resend_while_forwarding(&cfg, dir);
    malformed_to_backup(&cfg, dir);
    malformed_forwards(&cfg, dir);
    far_ahead(&cfg, dir);
    held_in_stats(&cfg, dir);
    diverged(&cfg, dir);
    held_bytes_bound(dir);
    forwards_at_limit(dir);
    return pt_finish(dir);
}
