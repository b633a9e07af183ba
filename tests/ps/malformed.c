/*
 * Hostile input against a live server through a raw nng req socket: every malformed message
 * gets an error reply (status < 0, a message naming the problem), is counted in STATS
 * bad_messages, applies nothing, and the server keeps serving (a valid pull right after each
 * one works).
 */
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>

#include "ps/wire.h"
#include "ps_test_util.h"

#define DIM 4u

static const char conf[] = "[cluster]\nshards = 2\nworkers = 1\n"
                           "[table t]\ndim = 4\noptimizer = sgd\nlr = 1\ninit_scale = 0.1\n"
                           "[dense d]\nsize = 8\noptimizer = sgd\n";

static nng_socket raw;
static uint64_t owned[4], foreign_key; /* keys of shard 0 (this server) and of shard 1 */
static uint64_t bad_expected;          /* how many messages should have been counted bad */

typedef struct msg {
    uint8_t buf[4096];
    size_t len;
} msg;

/* A sealed message: header fields as given, then payload. */
static void build(msg *m, uint16_t op, uint32_t table, uint32_t count, uint8_t codec,
                  const void *payload, size_t plen)
{
    ps_hdr h;
    memset(&h, 0, sizeof h);
    h.op = op;
    h.table = table;
    h.count = count;
    h.codec = codec;
    h.req_id = 42;
    memcpy(m->buf, &h, sizeof h);
    if (plen) memcpy(m->buf + PS_HDR_BYTES, payload, plen);
    m->len = PS_HDR_BYTES + plen;
    ps_wire_seal(m->buf, plen);
}

/* A PULL of keys (sorted) or a PUSH of keys + rows in codec (rows given already encoded). */
static void build_rows(msg *m, uint16_t op, uint32_t table, const uint64_t *keys, uint32_t n,
                       uint8_t codec, const void *rows, size_t rows_bytes)
{
    uint8_t p[2048];
    size_t head = op == PS_OP_PUSH ? 4 : 0;
    uint32_t kb = (uint32_t)ps_keys_encode(keys, n, p + head);
    if (op == PS_OP_PUSH) {
        memcpy(p, &kb, 4);
        memcpy(p + head + kb, rows, rows_bytes);
    }
    build(m, op, table, n, codec, p, head + kb + (op == PS_OP_PUSH ? rows_bytes : 0));
}

/* Sends, receives, checks the reply's own framing and checksum; returns its status and copies
 * the payload (the error text) into text. */
static int call(const void *buf, size_t len, char *text, size_t textn, size_t *reply_payload)
{
    nng_msg *req, *rep = NULL;
    text[0] = '\0';
    if (nng_msg_alloc(&req, len) != 0) return 1;
    memcpy(nng_msg_body(req), buf, len);
    int rv = nng_sendmsg(raw, req, 0);
    if (rv == 0) rv = nng_recvmsg(raw, &rep, 0);
    if (rv != 0) {
        if (rv) nng_msg_free(req);
        snprintf(text, textn, "no reply: %s", nng_strerror(rv));
        return 1;
    }
    size_t rl = nng_msg_len(rep);
    ps_hdr h;
    int status = 1;
    if (rl >= PS_HDR_BYTES) {
        memcpy(&h, nng_msg_body(rep), sizeof h);
        /* Verify the checksum by resealing a copy (op may echo a bad one, so no wire_open). */
        uint8_t *copy = malloc(rl);
        memcpy(copy, nng_msg_body(rep), rl);
        ps_wire_seal(copy, rl - PS_HDR_BYTES);
        ps_hdr ch;
        memcpy(&ch, copy, sizeof ch);
        free(copy);
        if (h.magic == PS_MAGIC && h.payload_len == rl - PS_HDR_BYTES &&
            ch.checksum == h.checksum) {
            status = h.status;
            size_t n = rl - PS_HDR_BYTES < textn - 1 ? rl - PS_HDR_BYTES : textn - 1;
            memcpy(text, (uint8_t *)nng_msg_body(rep) + PS_HDR_BYTES, n);
            text[n] = '\0';
            if (reply_payload) *reply_payload = rl - PS_HDR_BYTES;
        } else {
            snprintf(text, textn, "reply framing broken");
        }
    }
    nng_msg_free(rep);
    return status;
}

/* The server still answers a valid pull of owned keys correctly. */
static void check_alive(const char *after)
{
    msg m;
    build_rows(&m, PS_OP_PULL, 0, owned, 4, PS_CODEC_F32, NULL, 0);
    char text[512];
    size_t plen = 0;
    int st = call(m.buf, m.len, text, sizeof text, &plen);
    CHECK_MSG(st == 0 && plen == 4 * DIM * 4, "valid pull after %s: status %d %s", after, st, text);
}

static void expect_error(const char *name, const void *buf, size_t len, const char *what, int bad)
{
    char text[512];
    int st = call(buf, len, text, sizeof text, NULL);
    CHECK_MSG(st < 0 && text[0] != '\0', "%s: status %d, message '%s'", name, st, text);
    CHECK_MSG(strstr(text, what) != NULL, "%s: want '%s' in '%s'", name, what, text);
    bad_expected += (uint64_t)bad;
    check_alive(name);
}

static void test_framing(void)
{
    msg m;
    build_rows(&m, PS_OP_PULL, 0, owned, 4, PS_CODEC_F32, NULL, 0);
    expect_error("tiny", m.buf, 20, "shorter", 1);
    expect_error("truncated payload", m.buf, m.len - 3, "payload length", 1);
    msg t = m;
    t.buf[t.len - 1] ^= 1;
    expect_error("payload bit flip", t.buf, t.len, "checksum", 1);
    t = m;
    t.buf[offsetof(ps_hdr, table)] ^= 1;
    expect_error("header bit flip", t.buf, t.len, "checksum", 1);
    t = m;
    t.buf[0] ^= 0xff;
    expect_error("magic", t.buf, t.len, "magic", 1);
    t = m;
    t.buf[offsetof(ps_hdr, version)] = 9;
    expect_error("version", t.buf, t.len, "version", 1);
    build(&t, 99, 0, 0, 0, NULL, 0);
    expect_error("unknown op", t.buf, t.len, "unknown op", 1);
    build(&t, 0, 0, 0, 0, NULL, 0);
    expect_error("op 0", t.buf, t.len, "unknown op", 1);
}

static void test_rows(void)
{
    msg m;
    uint8_t p[256];
    size_t kb = ps_keys_encode(owned, 4, p);
    build(&m, PS_OP_PULL, 0, 0xffffffffu, PS_CODEC_F32, p, kb);
    expect_error("huge count", m.buf, m.len, "count", 1);
    build(&m, PS_OP_PULL, 0, 0, PS_CODEC_F32, p, kb);
    expect_error("zero count", m.buf, m.len, "count", 1);
    build(&m, PS_OP_PULL, 0, 5, PS_CODEC_F32, p, kb);
    expect_error("count > key bytes", m.buf, m.len, "count 5", 1);
    build_rows(&m, PS_OP_PULL, 7, owned, 4, PS_CODEC_F32, NULL, 0);
    expect_error("wrong table", m.buf, m.len, "no table 7", 1);
    build_rows(&m, PS_OP_PULL, 0, owned, 4, 9, NULL, 0);
    expect_error("unknown codec", m.buf, m.len, "unknown codec", 1);
    /* Flags the op does not define (a pull with a push's or an unknown bit), and a request
     * from a worker the cluster does not have: refused and counted, never applied. */
    static const uint8_t bad_flags[] = {PS_FLAG_ELIDED, 0x80, PS_FLAG_LOOKUP | 0x40};
    for (size_t i = 0; i < sizeof bad_flags; i++) {
        build_rows(&m, PS_OP_PULL, 0, owned, 4, PS_CODEC_F32, NULL, 0);
        m.buf[offsetof(ps_hdr, flags)] = bad_flags[i];
        ps_wire_seal(m.buf, m.len - PS_HDR_BYTES);
        expect_error("pull with undefined flags", m.buf, m.len, "not defined for op", 1);
    }
    float grads[4 * 4] = {0};
    build_rows(&m, PS_OP_PUSH, 0, owned, 4, PS_CODEC_F32, grads, sizeof grads);
    m.buf[offsetof(ps_hdr, flags)] = PS_FLAG_READ_BACK;
    ps_wire_seal(m.buf, m.len - PS_HDR_BYTES);
    expect_error("push with a dense push's flag", m.buf, m.len, "not defined for op", 1);
    build_rows(&m, PS_OP_PUSH, 0, owned, 4, PS_CODEC_F32, grads, sizeof grads);
    uint16_t stranger = 5;
    memcpy(m.buf + offsetof(ps_hdr, worker), &stranger, sizeof stranger);
    ps_wire_seal(m.buf, m.len - PS_HDR_BYTES);
    expect_error("push from worker 5 of 1", m.buf, m.len, "known workers", 1);
    uint64_t desc[2] = {owned[1], owned[0]};
    build(&m, PS_OP_PULL, 0, 2, PS_CODEC_F32, p, ps_keys_encode(desc, 2, p));
    expect_error("unsorted keys", m.buf, m.len, "increasing", 1);
    uint64_t mixed[2] = {owned[0] < foreign_key ? owned[0] : foreign_key,
                         owned[0] < foreign_key ? foreign_key : owned[0]};
    build_rows(&m, PS_OP_PULL, 0, mixed, 2, PS_CODEC_F32, NULL, 0);
    expect_error("foreign key", m.buf, m.len, "belongs to shard 1", 1);

    /* PUSH framing: the key-bytes field disagreeing with the payload, and a 2-byte payload. */
    float rows[4 * DIM];
    for (uint32_t i = 0; i < 4 * DIM; i++)
        rows[i] = 0.5f;
    build_rows(&m, PS_OP_PUSH, 0, owned, 4, PS_CODEC_F32, rows, sizeof rows - 4);
    expect_error("push rows short", m.buf, m.len, "does not match", 1);
    build_rows(&m, PS_OP_PUSH, 0, owned, 4, PS_CODEC_F32, rows, sizeof rows);
    uint32_t kbf;
    memcpy(&kbf, m.buf + PS_HDR_BYTES, 4);
    kbf += 1;
    memcpy(m.buf + PS_HDR_BYTES, &kbf, 4);
    ps_wire_seal(m.buf, m.len - PS_HDR_BYTES);
    expect_error("push key bytes", m.buf, m.len, "does not match", 1);
    build(&m, PS_OP_PUSH, 0, 1, PS_CODEC_F32, "ab", 2);
    expect_error("push tiny", m.buf, m.len, "does not match", 1);

    /* Non-finite gradients in each codec; only the last row is bad, and nothing is applied. */
    rows[3 * DIM + 1] = NAN;
    build_rows(&m, PS_OP_PUSH, 0, owned, 4, PS_CODEC_F32, rows, sizeof rows);
    expect_error("NaN fp32", m.buf, m.len, "non-finite", 1);
    uint8_t enc[4 * DIM * 4];
    rows[3 * DIM + 1] = INFINITY;
    ps_codec_encode(PS_CODEC_F16, rows, 4, DIM, enc, NULL);
    build_rows(&m, PS_OP_PUSH, 0, owned, 4, PS_CODEC_F16, enc, 4 * DIM * 2);
    expect_error("inf fp16", m.buf, m.len, "non-finite", 1);
    rows[3 * DIM + 1] = 0.5f;
    ps_codec_encode(PS_CODEC_INT8, rows, 4, DIM, enc, NULL);
    const uint16_t nan_bf16 = 0x7fc0;
    memcpy(enc + 3 * (2 + DIM), &nan_bf16, 2);
    build_rows(&m, PS_OP_PUSH, 0, owned, 4, PS_CODEC_INT8, enc, 4 * (2 + DIM));
    expect_error("NaN int8 scale", m.buf, m.len, "scale", 1);
}

/* An elided PUSH (PS_FLAG_ELIDED): u64 pull request id, u64 key checksum, then rows. */
static void build_elided(msg *m, uint64_t pull_id, uint64_t sum, uint32_t n, const float *rows,
                         size_t rows_bytes)
{
    uint8_t p[1024];
    memcpy(p, &pull_id, 8);
    memcpy(p + 8, &sum, 8);
    memcpy(p + PS_ELIDED_HEAD, rows, rows_bytes);
    build(m, PS_OP_PUSH, 0, n, PS_CODEC_F32, p, PS_ELIDED_HEAD + rows_bytes);
    m->buf[offsetof(ps_hdr, flags)] = PS_FLAG_ELIDED;
    ps_wire_seal(m->buf, m->len - PS_HDR_BYTES);
}

/* Elided pushes naming a key list the server does not hold, or one that does not match. Every
 * check_alive pull is request 42 of worker 0 for the owned keys, so that list is held. */
static void test_elided(void)
{
    msg m;
    float rows[4 * DIM];
    for (uint32_t i = 0; i < 4 * DIM; i++)
        rows[i] = 0.5f;
    const uint64_t sum = ps_keys_sum(owned, 4);
    /* Unknown list: the distinct status the client answers by resending with keys; not a
     * malformed message. */
    build_elided(&m, 4242, sum, 4, rows, sizeof rows);
    char text[512];
    int st = call(m.buf, m.len, text, sizeof text, NULL);
    CHECK_MSG(st == PS_STATUS_NO_KEYS && strstr(text, "no key list"),
              "unknown list: status %d '%s'", st, text);
    check_alive("unknown list");
    build_elided(&m, 42, sum, 3, rows, 3 * DIM * 4);
    expect_error("elided count mismatch", m.buf, m.len, "names pull 42 of 4 keys", 1);
    build_elided(&m, 42, sum ^ 1, 4, rows, sizeof rows);
    expect_error("elided checksum mismatch", m.buf, m.len, "checksum", 1);
    build_elided(&m, 42, sum, 4, rows, sizeof rows - 4);
    expect_error("elided rows short", m.buf, m.len, "does not match", 1);
    build(&m, PS_OP_PUSH, 0, 1, PS_CODEC_F32, "0123456789", 10);
    m.buf[offsetof(ps_hdr, flags)] = PS_FLAG_ELIDED;
    ps_wire_seal(m.buf, m.len - PS_HDR_BYTES);
    expect_error("elided tiny", m.buf, m.len, "does not match", 1);
    rows[2] = NAN;
    build_elided(&m, 42, sum, 4, rows, sizeof rows);
    expect_error("elided NaN", m.buf, m.len, "non-finite", 1);
    /* A backup refuses a REPLICATE carrying an elided push: its primary must resolve keys. */
    rows[2] = 0.5f;
    build_elided(&m, 42, sum, 4, rows, sizeof rows);
    uint8_t rep_payload[1200];
    uint64_t seq = 1;
    memcpy(rep_payload, &seq, 8);
    memcpy(rep_payload + 8, m.buf, m.len);
    msg r;
    build(&r, PS_OP_REPLICATE, 0, 0, 0, rep_payload, 8 + m.len);
    /* This server is no backup: a misdirected message, counted bad (it was answered as an error
     * but not counted). */
    expect_error("replicate to a non-backup", r.buf, r.len, "not a backup", 1);
}

static void test_other_ops(void)
{
    msg m;
    build(&m, PS_OP_HELLO, 0, 0, 0, "abc", 3);
    expect_error("short hello", m.buf, m.len, "HELLO", 1);
    build(&m, PS_OP_SAVE, 0, 0, 0, "/tmp/a\0b", 8);
    expect_error("save NUL", m.buf, m.len, "NUL", 1);
    build(&m, PS_OP_LOAD, 0, 0, 0, NULL, 0);
    expect_error("load empty", m.buf, m.len, "directory", 1);
    float d[7] = {0};
    build(&m, PS_OP_PUSH_DENSE, 0, 0, 0, d, sizeof d);
    expect_error("dense size", m.buf, m.len, "expected 32", 1);
    float dn[8] = {0, 0, NAN, 0, 0, 0, 0, 0};
    build(&m, PS_OP_PUSH_DENSE, 0, 0, 0, dn, sizeof dn);
    expect_error("dense NaN", m.buf, m.len, "non-finite", 1);
    build(&m, PS_OP_PULL_DENSE, 5, 0, 0, NULL, 0);
    expect_error("dense id", m.buf, m.len, "dense block 5", 1);
    /* Ops that carry no payload refuse one (and SHUTDOWN with junk does not stop the server). */
    static const uint8_t junk[100] = {1, 2, 3};
    build(&m, PS_OP_STATS, 0, 0, 0, junk, sizeof junk);
    expect_error("stats payload", m.buf, m.len, "no payload", 1);
    build(&m, PS_OP_CLOCK, 0, 0, 0, junk, sizeof junk);
    expect_error("clock payload", m.buf, m.len, "no payload", 1);
    build(&m, PS_OP_BARRIER, 0, 0, 0, junk, sizeof junk);
    expect_error("barrier payload", m.buf, m.len, "no payload", 1);
    build(&m, PS_OP_SHUTDOWN, 0, 0, 0, junk, sizeof junk);
    expect_error("shutdown payload", m.buf, m.len, "no payload", 1);
    /* A stop poll's interval (count) of 0 or over 2^20, or a step (clock) over 2^31, whose sum
     * would not fit the reply's clock. */
    static const struct {
        uint32_t every, step;
    } polls[] = {{0, 100}, {(1u << 20) + 1, 100}, {100, (1u << 31) + 1}};
    for (size_t i = 0; i < sizeof polls / sizeof *polls; i++) {
        build(&m, PS_OP_BARRIER, 0, polls[i].every, 0, NULL, 0);
        m.buf[offsetof(ps_hdr, flags)] = PS_FLAG_POLL | PS_FLAG_STOP;
        uint32_t clock = polls[i].step;
        memcpy(m.buf + offsetof(ps_hdr, clock), &clock, sizeof clock);
        ps_wire_seal(m.buf, 0);
        expect_error("stop poll out of range", m.buf, m.len, "stop poll", 1);
    }
    /* A read-back push and its resend: both replies carry the block after the one update. */
    float ones[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    build(&m, PS_OP_PUSH_DENSE, 0, 0, 0, ones, sizeof ones);
    ps_hdr rb;
    memcpy(&rb, m.buf, sizeof rb);
    rb.flags = PS_FLAG_READ_BACK;
    rb.req_id = 77;
    memcpy(m.buf, &rb, sizeof rb);
    ps_wire_seal(m.buf, sizeof ones);
    char first[64], again[64], pulled[64];
    size_t n1 = 0, n2 = 0, n3 = 0;
    CHECK(call(m.buf, m.len, first, sizeof first, &n1) == 0 && n1 == sizeof ones);
    CHECK(call(m.buf, m.len, again, sizeof again, &n2) == 0 && n2 == sizeof ones);
    build(&m, PS_OP_PULL_DENSE, 0, 0, 0, NULL, 0);
    CHECK(call(m.buf, m.len, pulled, sizeof pulled, &n3) == 0 && n3 == sizeof ones);
    CHECK(memcmp(first, again, sizeof ones) == 0 && memcmp(first, pulled, sizeof ones) == 0);
    float v0;
    memcpy(&v0, first, sizeof v0);
    CHECK_MSG(v0 < 0.0f, "read back %g: the push was not applied", (double)v0);
    ps_hdr h;
    memset(&h, 0, sizeof h);
    h.op = PS_OP_CLOCK;
    h.worker = 3;
    h.clock = 1;
    memcpy(m.buf, &h, sizeof h);
    ps_wire_seal(m.buf, 0);
    expect_error("clock of unknown worker", m.buf, PS_HDR_BYTES, "known workers", 1);
}

/* Sets a built message's request id (build uses 42) and reseals it. */
static void set_req_id(msg *m, uint64_t id)
{
    memcpy(m->buf + offsetof(ps_hdr, req_id), &id, sizeof id);
    ps_wire_seal(m->buf, m->len - PS_HDR_BYTES);
}

/* A server with max_message = 4096 and a client-like socket whose receive limit is the same.
 * (a) A pull whose reply is the header plus rows must fit max_message: rows that fill it
 * exactly, without the header, make a reply the client drops (and resends forever); the server
 * must refuse such a pull with an error naming the sizes. (b) A malformed push (or dense push)
 * that reuses the request id of one already applied is answered as malformed, counted bad, and
 * does not disturb the de-duplication of the genuine resend. */
static void test_limits_and_resends(const char *dir)
{
    static const char small[] = "[cluster]\nshards = 1\nworkers = 1\nmax_message = 4096\n"
                                "[table t]\ndim = 4\noptimizer = sgd\nlr = 1\n"
                                "init_scale = 0.1\n"
                                "[dense d]\nsize = 8\noptimizer = sgd\n";
    static ps_config cfg2;
    pt_config(dir, "small.conf", small, &cfg2);
    const char *url = pt_ipc(dir, "small");
    ps_server *s2 = pt_server(&cfg2, url, 0);
    const nng_socket main_raw = raw;
    CHECK(nng_req0_open(&raw) == 0);
    nng_socket_set_size(raw, NNG_OPT_RECVMAXSZ, 4096);  /* as ps/client.c sets it */
    nng_socket_set_ms(raw, NNG_OPT_RECVTIMEO, 3000);    /* a dropped reply: fail, not hang */
    nng_socket_set_ms(raw, NNG_OPT_SENDTIMEO, 3000);
    CHECK(nng_dial(raw, url, NULL, 0) == 0);
    uint64_t bad = 0, dups = 0;
    char text[512];
    size_t plen = 0;
    msg m;

    /* (a) 256 rows of 16 bytes are exactly 4096: with the header, 4152 bytes. */
    uint64_t keys[256];
    pt_keys_of_shard(0, 1, 1, keys, 256);
    build_rows(&m, PS_OP_PULL, 0, keys, 256, PS_CODEC_F32, NULL, 0);
    int st = call(m.buf, m.len, text, sizeof text, NULL);
    CHECK_MSG(st < 0 && strstr(text, "4152") && strstr(text, "4096"),
              "pull filling max_message: status %d '%s'", st, text);
    bad++;
    build_rows(&m, PS_OP_PULL, 0, keys, 253, PS_CODEC_F32, NULL, 0); /* 4104 bytes */
    st = call(m.buf, m.len, text, sizeof text, NULL);
    CHECK_MSG(st < 0 && strstr(text, "4104"), "pull of 253 rows: status %d '%s'", st, text);
    bad++;
    build_rows(&m, PS_OP_PULL, 0, keys, 252, PS_CODEC_F32, NULL, 0); /* 4088 bytes: fits */
    st = call(m.buf, m.len, text, sizeof text, &plen);
    CHECK_MSG(st == 0 && plen == 252 * DIM * 4, "pull of 252 rows: status %d '%s'", st, text);

    /* (b) A push applied as request 42, then malformed messages reusing that id. */
    float rows[4 * DIM];
    for (uint32_t i = 0; i < 4 * DIM; i++)
        rows[i] = 0.5f;
    build_rows(&m, PS_OP_PUSH, 0, keys, 4, PS_CODEC_F32, rows, sizeof rows);
    const msg good = m;
    st = call(m.buf, m.len, text, sizeof text, NULL);
    CHECK_MSG(st == 0, "push 42: status %d '%s'", st, text);
    rows[1] = NAN;
    build_rows(&m, PS_OP_PUSH, 0, keys, 4, PS_CODEC_F32, rows, sizeof rows);
    st = call(m.buf, m.len, text, sizeof text, NULL);
    CHECK_MSG(st < 0 && strstr(text, "non-finite"), "NaN push reusing id 42: status %d '%s'",
              st, text);
    bad++;
    rows[1] = 0.5f;
    build_rows(&m, PS_OP_PUSH, 0, keys, 4, PS_CODEC_F32, rows, sizeof rows - 4);
    st = call(m.buf, m.len, text, sizeof text, NULL);
    CHECK_MSG(st < 0 && strstr(text, "does not match"),
              "short push reusing id 42: status %d '%s'", st, text);
    bad++;
    build_rows(&m, PS_OP_PUSH, 0, keys, 4, 9, rows, sizeof rows);
    st = call(m.buf, m.len, text, sizeof text, NULL);
    CHECK_MSG(st < 0 && strstr(text, "unknown codec"),
              "bad-codec push reusing id 42: status %d '%s'", st, text);
    bad++;
    build_rows(&m, PS_OP_PUSH, 7, keys, 4, PS_CODEC_F32, rows, sizeof rows);
    st = call(m.buf, m.len, text, sizeof text, NULL);
    CHECK_MSG(st < 0 && strstr(text, "no table 7"),
              "wrong-table push reusing id 42: status %d '%s'", st, text);
    bad++;
    rows[5] = INFINITY;
    build_elided(&m, 4242, ps_keys_sum(keys, 4), 4, rows, sizeof rows);
    st = call(m.buf, m.len, text, sizeof text, NULL);
    CHECK_MSG(st < 0 && strstr(text, "non-finite"),
              "elided inf push reusing id 42: status %d '%s'", st, text);
    bad++;
    rows[5] = 0.5f;
    /* The genuine resends are still recognised (the malformed ones did not forget id 42). */
    st = call(good.buf, good.len, text, sizeof text, NULL);
    CHECK_MSG(st == 0, "resend of push 42: status %d '%s'", st, text);
    dups++;
    build_elided(&m, 4242, ps_keys_sum(keys, 4), 4, rows, sizeof rows);
    st = call(m.buf, m.len, text, sizeof text, NULL);
    CHECK_MSG(st == 0, "elided resend of push 42 (key list unknown): status %d '%s'", st, text);
    dups++;

    /* The same for a dense push, as request 43 (request ids are per worker, not per op). */
    float ones[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    build(&m, PS_OP_PUSH_DENSE, 0, 0, 0, ones, sizeof ones);
    set_req_id(&m, 43);
    const msg dgood = m;
    CHECK(call(m.buf, m.len, text, sizeof text, NULL) == 0);
    ones[3] = NAN;
    build(&m, PS_OP_PUSH_DENSE, 0, 0, 0, ones, sizeof ones);
    set_req_id(&m, 43);
    st = call(m.buf, m.len, text, sizeof text, NULL);
    CHECK_MSG(st < 0 && strstr(text, "non-finite"), "NaN dense push reusing id 43: status %d '%s'",
              st, text);
    bad++;
    build(&m, PS_OP_PUSH_DENSE, 0, 0, 0, ones, sizeof ones - 4);
    set_req_id(&m, 43);
    st = call(m.buf, m.len, text, sizeof text, NULL);
    CHECK_MSG(st < 0 && strstr(text, "expected 32"),
              "short dense push reusing id 43: status %d '%s'", st, text);
    bad++;
    CHECK(call(dgood.buf, dgood.len, text, sizeof text, NULL) == 0);
    dups++;

    ps_server_stats ss;
    ps_server_stats_get(s2, &ss);
    CHECK_MSG(ss.bad_messages == bad, "small server: bad_messages %llu, expected %llu",
              (unsigned long long)ss.bad_messages, (unsigned long long)bad);
    CHECK_MSG(ss.duplicates == dups && ss.rows_pushed == 4,
              "small server: duplicates %llu (want %llu), rows_pushed %llu (want 4)",
              (unsigned long long)ss.duplicates, (unsigned long long)dups,
              (unsigned long long)ss.rows_pushed);

    /* (c) A client refuses a request over max_message before sending it (the server's
     * transport would drop it unanswered and nng resend it until the timeout), names the
     * limit, and carries on: a push of 400 rows is over 6 KB. */
    ps_client *cl = pt_client(&cfg2, &url, 0, 3000);
    static uint64_t many[400];
    static float grads[400 * DIM];
    pt_keys_of_shard(0, 1, 1, many, 400);
    char *err = NULL;
    int rc = ps_client_push(cl, 0, many, 400, grads, &err);
    if (rc == CM_OK) rc = ps_client_flush(cl, &err);
    CHECK_MSG(rc != CM_OK && err && strstr(err, "max_message"), "oversized push: rc %d '%s'", rc,
              err ? err : "");
    free(err), err = NULL;
    float one[DIM];
    CHECK_OK(ps_client_pull(cl, 0, many, 1, one, &err), err);
    ps_client_destroy(cl);
    ps_server_stats_get(s2, &ss);
    CHECK(ss.bad_messages == bad); /* nothing reached the server */

    nng_close(raw);
    raw = main_raw;
    ps_server_destroy(s2);
}

/* Sends the sealed pull m on the raw socket and copies the reply's first n bytes of rows to out.
 * Returns 0, or -1 (out untouched) when the round trip or the reply's size fails. */
static int pull_owned(const msg *m, float *out, size_t n)
{
    nng_msg *req = NULL, *rep = NULL;
    int rc = -1;
    if (nng_msg_alloc(&req, m->len) != 0) goto done;
    memcpy(nng_msg_body(req), m->buf, m->len);
    if (nng_sendmsg(raw, req, 0) != 0) {
        nng_msg_free(req);
        goto done;
    }
    if (nng_recvmsg(raw, &rep, 0) != 0 || nng_msg_len(rep) < PS_HDR_BYTES + n) goto done;
    memcpy(out, (uint8_t *)nng_msg_body(rep) + PS_HDR_BYTES, n);
    rc = 0;
done:
    if (rep != NULL) nng_msg_free(rep);
    return rc;
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_malformed");
    ps_config cfg;
    pt_config(dir, "ps.conf", conf, &cfg);
    const char *url = pt_ipc(dir, "s0");
    ps_server *s = pt_server(&cfg, url, 0);
    pt_keys_of_shard(0, 2, 1, owned, 4);
    pt_keys_of_shard(1, 2, 1, &foreign_key, 1);

    CHECK(nng_req0_open(&raw) == 0);
    nng_socket_set_ms(raw, NNG_OPT_RECVTIMEO, 5000);
    nng_socket_set_ms(raw, NNG_OPT_SENDTIMEO, 5000);
    CHECK(nng_dial(raw, url, NULL, 0) == 0);

    /* The rows of the owned keys before anything: rejected pushes must leave them alone. */
    float before[4 * DIM], after[4 * DIM];
    msg m;
    build_rows(&m, PS_OP_PULL, 0, owned, 4, PS_CODEC_F32, NULL, 0);
    CHECK(pull_owned(&m, before, sizeof before) == 0);

    test_framing();
    test_rows();
    test_elided();
    test_other_ops();
    test_limits_and_resends(dir);

    CHECK(pull_owned(&m, after, sizeof after) == 0);
    CHECK_MSG(memcmp(before, after, sizeof before) == 0, "a rejected push changed a row");

    ps_server_stats st;
    ps_server_stats_get(s, &st);
    CHECK_MSG(st.bad_messages == bad_expected, "bad_messages %llu, expected %llu",
              (unsigned long long)st.bad_messages, (unsigned long long)bad_expected);
    CHECK(st.rows_pushed == 0 && st.errors >= bad_expected);
    nng_close(raw);
    ps_server_destroy(s);
    return pt_finish(dir);
}
