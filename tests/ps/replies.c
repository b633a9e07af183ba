/*
 * The client against hostile replies from a fake shard: a rep0 socket in this process that
 * answers HELLO as a shard does and every other request as a scripted mode says, with bytes
 * crafted after docs/PROTOCOL.md. Each bad reply (a wrong checksum, another request's id, an
 * error status, a NaN row, a row short, rows of another codec, table or count than the
 * request's, a HELLO without the barrier generation, an error text of 1 MiB of control
 * characters) must fail the call with an error naming what
 * was wrong and the URL of the server that sent it, after a failover the backup's; the client goes
 * on serving the next call.
 */
#include <inttypes.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <pthread.h>

#include "ps/wire.h"
#include "ps_test_util.h"

#define DIM 8u
/* keys of a push larger than the client keeps to send again (64 KiB): 96 KiB of rows */
#define PS_RESEND_KEYS 3072u

static const char conf[] = "[cluster]\nshards = 1\nworkers = 1\n"
                           "[table f32]\ndim = 8\noptimizer = sgd\nlr = 1\n"
                           "[table f16]\ndim = 8\noptimizer = sgd\nlr = 1\npull_codec = fp16\n";

enum {
    GOOD,         /* what a shard answers: rows of 0.5 in the requested codec */
    CHECKSUM,     /* one payload byte changed after sealing */
    STALE,        /* the answer to this client's previous request (its request id) */
    ERR,          /* status CM_EINVAL with a short message */
    NAN_ROW,      /* the last row's last value NaN (fp16: 0x7e01) */
    SHORT,        /* one row short */
    CODEC,        /* rows of another codec of the same size (bf16 for fp16), the header naming it */
    TABLE,        /* the header names another table */
    COUNT,        /* the header's count one less than the request's, every row there */
    HELLO_EMPTY,  /* HELLO answered OK without the barrier generation */
    ERR_CTRL,     /* an error whose 1 MiB text holds terminal escapes and newlines, no NUL */
    DAMAGED,      /* a push's reply whose header claims 601,368 bytes more than arrive */
    DAMAGED_ONCE, /* ... the next push reply only, then GOOD */
    CHECKSUM_ONCE /* CHECKSUM on the next reply but a HELLO's, then GOOD */
};

typedef struct fake {
    nng_socket sock;
    pthread_t thread;
    volatile int mode;
    volatile int pushes; /* push requests received */
    volatile int pulls;  /* pull requests received */
} fake;

static nng_msg *craft(const fake *f, const ps_hdr *req)
{
    ps_hdr h = *req;
    h.status = 0;
    size_t payload = 0;
    int mode = f->mode;
    if (req->op == PS_OP_HELLO) {
        payload = mode == HELLO_EMPTY ? 0 : 8;
    } else if (mode == ERR || mode == ERR_CTRL) {
        h.status = CM_EINVAL;
        payload = mode == ERR ? 20 : 1u << 20;
    } else if (req->op == PS_OP_PULL) {
        payload = (size_t)req->count * ps_codec_row_bytes((ps_codec)req->codec, DIM);
        if (mode == STALE) h.req_id--;
        if (mode == SHORT) payload -= ps_codec_row_bytes((ps_codec)req->codec, DIM);
        if (mode == CODEC) h.codec = PS_CODEC_BF16;
        if (mode == TABLE) h.table = req->table ^ 1u;
        if (mode == COUNT) h.count = req->count - 1;
    }
    nng_msg *m;
    if (nng_msg_alloc(&m, PS_HDR_BYTES + payload) != 0) return NULL;
    uint8_t *b = nng_msg_body(m), *p = b + PS_HDR_BYTES;
    memset(p, 0, payload);
    if (req->op == PS_OP_HELLO && payload == 8) {
        uint64_t gen = 1;
        memcpy(p, &gen, 8);
    } else if (h.status != 0) {
        for (size_t i = 0; i < payload; i++)
            p[i] = mode == ERR  ? "no such table, sorry"[i]
                   : i % 8 == 0 ? 0x1b
                   : i % 8 == 1 ? '\n'
                                : 'x';
    } else if (req->op == PS_OP_PULL) {
        const float half = 0.5f;
        const size_t vb = h.codec == PS_CODEC_F32 ? 4 : 2;
        for (size_t i = 0; i < payload / vb; i++)
            ps_codec_encode((ps_codec)h.codec, &half, 1, 1, p + i * vb, NULL);
        if (mode == NAN_ROW && vb == 2) memcpy(p + payload - 2, "\x01\x7e", 2);
        if (mode == NAN_ROW && vb == 4) memcpy(p + payload - 4, "\x01\x00\xc0\x7f", 4);
    }
    memcpy(b, &h, sizeof h);
    ps_wire_seal(b, payload);
    if ((mode == CHECKSUM || mode == CHECKSUM_ONCE) && payload > 0) p[payload - 1] ^= 1;
    if ((mode == DAMAGED || mode == DAMAGED_ONCE) && req->op == PS_OP_PUSH) {
        h.payload_len = payload + 601368; /* after the seal: the length check fails */
        memcpy(b, &h, sizeof h);
    }
    return m;
}

static void *fake_main(void *arg)
{
    fake *f = arg;
    for (;;) {
        nng_msg *req;
        if (nng_recvmsg(f->sock, &req, 0) != 0) return NULL;
        ps_hdr h;
        char *err = NULL;
        nng_msg *m = NULL;
        if (ps_wire_open(nng_msg_body(req), nng_msg_len(req), &h, &err) == CM_OK) m = craft(f, &h);
        if (h.op == PS_OP_PUSH && f->mode == DAMAGED_ONCE) f->mode = GOOD;
        if (h.op == PS_OP_PUSH) f->pushes++;
        if (h.op == PS_OP_PULL) f->pulls++;
        if (h.op != PS_OP_HELLO && f->mode == CHECKSUM_ONCE) f->mode = GOOD;
        free(err);
        nng_msg_free(req);
        if (m != NULL && nng_sendmsg(f->sock, m, 0) != 0) nng_msg_free(m);
    }
}

static void fake_start(fake *f, const char *url)
{
    memset(f, 0, sizeof *f);
    if (nng_rep0_open(&f->sock) != 0 || nng_listen(f->sock, url, NULL, 0) != 0)
        pt_die("fake shard socket", strdup(url));
    if (pthread_create(&f->thread, NULL, fake_main, f) != 0) pt_die("fake shard thread", NULL);
}

static void fake_stop(fake *f)
{
    nng_close(f->sock);
    pthread_join(f->thread, NULL);
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_replies");
    ps_config cfg;
    pt_config(dir, "ps.conf", conf, &cfg);
    const char *url = pt_ipc(dir, "fake0");
    fake f;
    fake_start(&f, url);
    ps_client *c = pt_client(&cfg, &url, 0, 5000);

    enum { K = 50 };
    uint64_t keys[K];
    for (int i = 0; i < K; i++)
        keys[i] = 1000 + 7 * (uint64_t)i;
    float got[K * DIM];
    char *err = NULL;
    CHECK_OK(ps_client_pull(c, 1, keys, K, got, &err), err);
    CHECK(got[0] == 0.5f && got[K * DIM - 1] == 0.5f);

    static const struct {
        int mode;
        uint32_t table;
        const char *what;
    } bad[] = {
        {CHECKSUM, 0, "checksum"},  {STALE, 0, "request"},      {ERR, 0, "no such table"},
        {NAN_ROW, 0, "non-finite"}, {NAN_ROW, 1, "non-finite"}, {SHORT, 0, "bytes"},
        {SHORT, 1, "bytes"},        {CODEC, 1, "codec"},        {TABLE, 0, "table"},
        {COUNT, 0, "count"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        f.mode = bad[i].mode;
        const int pulls = f.pulls;
        int rc = ps_client_pull(c, bad[i].table, keys, K, got, &err);
        /* A damaged reply (checksum) is asked for again, once; a wrong answer is not. */
        CHECK_MSG(f.pulls - pulls == (bad[i].mode == CHECKSUM ? 2 : 1), "mode %d: %d pull requests",
                  bad[i].mode, f.pulls - pulls);
        CHECK_MSG(rc != CM_OK && err && strstr(err, bad[i].what) && strstr(err, url),
                  "mode %d: rc %d, %.300s", bad[i].mode, rc, err ? err : "(no message)");
        /* A reply that fails its checks says what its header claimed beside what was asked. */
        if (bad[i].mode == CHECKSUM)
            CHECK_MSG(err && strstr(err, "its header: op 2, request") && strstr(err, "(op 2,"),
                      "a damaged reply's error: %.300s", err ? err : "(no message)");
        /* (A reply of another codec, taken, decodes to other values than the server's.) */
        CHECK_MSG(rc != CM_OK || got[0] == 0.5f, "mode %d: row value %g", bad[i].mode,
                  (double)got[0]);
        free(err), err = NULL;
    }
    f.mode = GOOD;
    CHECK_OK(ps_client_pull(c, 1, keys, K, got, &err), err);
    /* A pull's reply damaged once: the pull is sent again and succeeds. */
    f.mode = CHECKSUM_ONCE;
    int pulls = f.pulls;
    CHECK_OK(ps_client_pull(c, 0, keys, K, got, &err), err);
    CHECK_MSG(f.pulls - pulls == 2 && got[0] == 0.5f && got[K * DIM - 1] == 0.5f,
              "a pull damaged once: %d requests, row value %g", f.pulls - pulls, (double)got[0]);

    /* A server's error text is the operator's to read: no terminal escapes or line breaks of
     * the server's choosing reach it, and a long one is cut. */
    f.mode = ERR_CTRL;
    int rc = ps_client_pull(c, 0, keys, K, got, &err);
    size_t ctrl = 0;
    for (const char *e = err; e && *e; e++)
        ctrl += (unsigned char)*e < 0x20 || *e == 0x7f;
    CHECK_MSG(rc != CM_OK && err && strstr(err, url) && ctrl == 0 && strlen(err) < 1024,
              "rc %d, %zu control characters in %zu bytes: %.100s", rc, ctrl, err ? strlen(err) : 0,
              err ? err : "(no message)");
    free(err), err = NULL;
    f.mode = GOOD;
    CHECK_OK(ps_client_pull(c, 1, keys, K, got, &err), err);

    /* A push whose reply arrives damaged (its header claims more bytes than came: a bench run
     * saw one): it may or may not have been applied, and the shard's dedup makes a resend of
     * either harmless, so an elided push (which keeps its keys and rows for PS_STATUS_NO_KEYS)
     * is sent again with them, once, and succeeds; a second damaged reply fails it, naming the
     * shard. */
    static float grads[K * DIM];
    ps_client_stats st0, st;
    /* The fake answers STATS with nothing: the call fails, and leaves the client's own counts. */
    CHECK(ps_client_stats_get(c, &st0, NULL) != CM_OK);
    for (int round = 0; round < 2; round++) {
        CHECK_OK(ps_client_pull(c, 0, keys, K, got, &err), err); /* the list the push names */
        f.mode = round == 0 ? DAMAGED_ONCE : DAMAGED;
        const int before = f.pushes;
        rc = ps_client_push(c, 0, keys, K, grads, &err);
        if (rc == CM_OK) rc = ps_client_flush(c, &err);
        CHECK_MSG(round == 0 ? rc == CM_OK
                             : rc != CM_OK && err && strstr(err, url) && strstr(err, "bad reply"),
                  "round %d (%s): rc %d, %.300s", round, round ? "damaged twice" : "once", rc,
                  err ? err : "(no message)");
        CHECK_MSG(f.pushes - before == 2, "round %d: %d push requests, expected 2 (a resend)",
                  round, f.pushes - before);
        free(err), err = NULL;
    }
    /* A push with its keys (none of these was pulled), damaged once: kept whole while small,
     * sent again and applied once (the shard's dedup); a large one is not kept, and fails. */
    static uint64_t big[PS_RESEND_KEYS];
    static float big_grads[PS_RESEND_KEYS * DIM];
    for (size_t i = 0; i < PS_RESEND_KEYS; i++)
        big[i] = 900000 + 13 * (uint64_t)i;
    for (int round = 0; round < 2; round++) {
        f.mode = DAMAGED_ONCE;
        const int before = f.pushes;
        rc = ps_client_push(c, 0, round ? big : big + 1, round ? PS_RESEND_KEYS : K,
                            round ? big_grads : grads, &err);
        if (rc == CM_OK) rc = ps_client_flush(c, &err);
        CHECK_MSG(round == 0
                      ? rc == CM_OK && f.pushes - before == 2
                      : rc != CM_OK && err && strstr(err, "bad reply") && f.pushes - before == 1,
                  "keyed push, %s: rc %d, %d requests, %.300s", round ? "large" : "small", rc,
                  f.pushes - before, err ? err : "(no message)");
        free(err), err = NULL;
    }
    CHECK(ps_client_stats_get(c, &st, NULL) != CM_OK);
    CHECK_MSG(st.replies_damaged - st0.replies_damaged == 5 &&
                  st.push_fallbacks - st0.push_fallbacks == 2 &&
                  st.replies_resent - st0.replies_resent == 3,
              "%" PRIu64 " damaged replies, %" PRIu64 " pushes sent again with keys, %" PRIu64
              " requests sent again",
              st.replies_damaged - st0.replies_damaged, st.push_fallbacks - st0.push_fallbacks,
              st.replies_resent - st0.replies_resent);
    f.mode = GOOD;
    ps_client_destroy(c);

    /* After a failover the backup sent the reply, and the error says so: a primary that never
     * came up, the fake as its backup. */
    const char *nobody = pt_ipc(dir, "nobody");
    ps_client_opts o = {
        .cfg = &cfg, .urls = &nobody, .backup_urls = &url, .worker = 0, .timeout_ms = 2000};
    c = pt_client_with(&o);
    f.mode = ERR;
    rc = ps_client_pull(c, 0, keys, K, got, &err);
    CHECK_MSG(rc != CM_OK && err && strstr(err, url) && !strstr(err, nobody), "rc %d, %s", rc,
              err ? err : "(no message)");
    free(err), err = NULL;
    ps_client_destroy(c);

    /* A HELLO reply without the barrier generation: taken, the client would enter barrier 0,
     * which shard 0 answers at once as long completed, so a checkpoint's barrier would not
     * wait for the other workers. Refused, naming the URL. */
    f.mode = HELLO_EMPTY;
    o.urls = &url;
    o.backup_urls = NULL;
    c = NULL;
    rc = ps_client_create(&o, &c, &err);
    CHECK_MSG(rc != CM_OK && err && strstr(err, "HELLO") && strstr(err, url), "rc %d, %s", rc,
              err ? err : "(no message)");
    free(err), err = NULL;
    if (rc == CM_OK) ps_client_destroy(c);
    fake_stop(&f);
    return pt_finish(dir);
}
