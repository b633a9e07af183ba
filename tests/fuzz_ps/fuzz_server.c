/*
 * libFuzzer target: a live in-process `ember ps` server fed hostile but correctly sealed
 * requests. fuzz_wire stops at the decoder, since random bytes never pass the checksum; here
 * every message is sealed after the fuzzer has chosen its fields, so the request handlers behind
 * the checksum (rows, elided pushes, dense blocks, clocks and barriers, HELLO, STATS, SAVE and
 * LOAD, REPLICATE on a backup) see well-formed lies.
 *
 * One primary (shard 0 of 2, two workers, staleness 1, a 100 ms worker timeout so that deferred
 * clocks and barriers are released) and a backup of it (which only ever gets REPLICATE: a client
 * request would make it take over) live for the whole process, in a temporary directory under
 * $TMPDIR that holds the checkpoint root. SAVE and LOAD name a directory inside the root, or the
 * root's path followed by raw bytes (the root check must refuse what leaves it). Tables: a (dim
 * 4, sgd), b (dim 8, adagrad, a memory budget that spills to RocksDB), c (dim 3, adam, admission
 * and a TTL); dense blocks d (8 floats, adam), e (shard 1's) and f (5 floats, adagrad). An
 * accepted SHUTDOWN recreates the primary, and a backup that diverged (a forwarded update
 * failed) or took over is recreated, so that later inputs reach its apply path again.
 *
 * An input is a short sequence of requests read front to back (fuzz_input.h): the op (one of
 * 0..15, invalid ones included), table, codec, flags, worker, request id and clock chosen by
 * the fuzzer; a payload built for the op (keys from pools of this shard's and the other shard's,
 * rows in the codec, for an elided push the key list of a pull made earlier, the request inside
 * a REPLICATE) or raw bytes; the count the payload's or a lie; sealed, and now and then damaged
 * after (a flipped byte, a cut). server_seeds.py spells valid sequences in this format.
 *
 * Properties (abort on violation): every request is answered within 5 s (a deferred CLOCK or
 * BARRIER stays in flight while later requests go on, and is checked when answered; it may
 * rightly wait while another worker is live, so once one has waited a second the harness goes
 * quiet until every worker has timed out, and then it must be answered); the reply
 * opens with ps_wire_open (a request whose op is out of range, or that had no whole header, is
 * answered with that op, so then only the framing and checksum are checked) and carries the
 * request id as it arrived; an error reply has status < 0 and a text and is counted in STATS
 * errors, and a refused update pushed no row; an acknowledged push pushed its rows or was a
 * resend; a successful pull returns count rows in its codec; each request is counted once;
 * after each input a STATS request is answered in full. FUZZ_SERVER_TRACE=1 prints each reply.
 */
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../fuzz_input.h"
#include "../req_flight.h"
#include "ps/wire.h"

#define MAX_REQS 8
#define POOL 64 /* keys of each shard the requests draw from: the tables stay small */
#define MAX_KEYS 12
#define REPLY_WAIT_MS 5000
#define BUF_BYTES (64u << 10)

static const uint32_t dims[] = {4, 8, 3};    /* tables a, b, c */
static const uint32_t dense_n[] = {8, 4, 5}; /* dense d, e (shard 1), f */

typedef struct pull_note {
    uint64_t req_id;
    uint64_t keys[MAX_KEYS];
    uint32_t n;
} pull_note;

static struct {
    char dir[512], root[600], url[600], burl[600];
    ps_config cfg;
    ps_server *srv, *backup;
    nng_socket sock, bsock;
    uint64_t own[POOL], foreign[POOL];
    uint64_t next_id, bseq;
    pull_note pulls[2][3]; /* the last successful training pull of each (worker, table) */
} W;

__attribute__((noreturn, format(printf, 1, 2))) static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fuzz_server: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    abort();
}

static nng_socket dial(const char *url)
{
    nng_socket s;
    if (nng_req0_open(&s) != 0) die("nng_req0_open");
    nng_socket_set_ms(s, NNG_OPT_RECVTIMEO, REPLY_WAIT_MS);
    nng_socket_set_ms(s, NNG_OPT_SENDTIMEO, REPLY_WAIT_MS);
    nng_socket_set_size(s, NNG_OPT_RECVMAXSZ, (size_t)W.cfg.max_msg_bytes);
    if (nng_dial(s, url, NULL, 0) != 0) die("cannot dial %s", url);
    return s;
}

static ps_server *start(const char *url, bool backup)
{
    ps_server_opts o = {.cfg = &W.cfg,
                        .listen = url,
                        .shard = 0,
                        .n_contexts = 8,
                        .backup = backup,
                        .checkpoint_root = W.root};
    ps_server *s = NULL;
    char *err = NULL;
    if (ps_server_create(&o, &s, &err) != CM_OK) die("ps_server_create: %s", err);
    return s;
}

static void drop_parked(void);

/* After an accepted SHUTDOWN: a fresh primary, so that later inputs reach one that is not
 * stopping; requests deferred on the old one are dropped with it. */
static void restart_primary(void)
{
    nng_close(W.sock);
    drop_parked();
    ps_server_destroy(W.srv);
    W.srv = start(W.url, false);
    W.sock = dial(W.url);
    memset(W.pulls, 0, sizeof W.pulls);
}

static void restart_backup(void)
{
    nng_close(W.bsock);
    ps_server_destroy(W.backup);
    W.backup = start(W.burl, true);
    W.bsock = dial(W.burl);
    W.bseq = 1;
}

static void cleanup(void)
{
    nng_close(W.sock);
    drop_parked();
    nng_close(W.bsock);
    ps_server_destroy(W.srv);
    ps_server_destroy(W.backup);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", W.dir);
    if (system(cmd) != 0) fprintf(stderr, "fuzz_server: cannot remove %s\n", W.dir);
}

static void setup(void)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(W.dir, sizeof W.dir, "%s/ember-fuzz-server-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (mkdtemp(W.dir) == NULL) die("cannot make %s", W.dir);
    snprintf(W.root, sizeof W.root, "%s/ckpt", W.dir);
    char path[700], text[2048];
    snprintf(path, sizeof path, "%s/ps.conf", W.dir);
    snprintf(text, sizeof text,
             "[cluster]\nshards = 2\nworkers = 2\nstaleness = 1\nworker_timeout = 100\n"
             "max_message = 1048576\nspill_dir = %s/spill\n"
             "[table a]\ndim = 4\noptimizer = sgd\nlr = 0.5\ninit_scale = 0.1\n"
             "[table b]\ndim = 8\noptimizer = adagrad\nlr = 0.1\nmemory = 16K\n"
             "[table c]\ndim = 3\noptimizer = adam\nadmit = 2\nttl = 16\n"
             "[dense d]\nsize = 8\noptimizer = adam\n"
             "[dense e]\nsize = 4\noptimizer = sgd\n"
             "[dense f]\nsize = 5\noptimizer = adagrad\n",
             W.dir);
    FILE *f = fopen(path, "w");
    if (f == NULL || fputs(text, f) < 0 || fclose(f) != 0) die("cannot write %s", path);
    char *err = NULL;
    if (ps_config_load(path, &W.cfg, &err) != CM_OK) die("config: %s", err);
    size_t a = 0, b = 0;
    for (uint64_t k = 1; a < POOL || b < POOL; k++) {
        if (ps_key_shard(k, 2) == 0 && a < POOL) W.own[a++] = k;
        if (ps_key_shard(k, 2) == 1 && b < POOL) W.foreign[b++] = k;
    }
    snprintf(W.url, sizeof W.url, "inproc://ember-fuzz-server-%d", (int)getpid());
    snprintf(W.burl, sizeof W.burl, "inproc://ember-fuzz-backup-%d", (int)getpid());
    W.srv = start(W.url, false);
    W.backup = start(W.burl, true);
    W.sock = dial(W.url);
    W.bsock = dial(W.burl);
    W.next_id = 1000;
    W.bseq = 1;
    atexit(cleanup);
}

/* ---- building requests ---- */

typedef struct req {
    uint8_t buf[BUF_BYTES];
    size_t len; /* bytes sent */
    ps_hdr h;   /* the header as built (before any damage) */
    uint64_t keys[MAX_KEYS];
    uint32_t n; /* keys of a structured PULL (remembered for elided pushes) */
} req;

/* n bytes of the input (zeros past its end). */
static void take(fz_in *in, uint8_t *out, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = fz_u8(in);
}

/* Sorted distinct keys from the pools (now and then any u64); returns how many. */
static uint32_t pick_keys(fz_in *in, uint64_t *keys)
{
    uint32_t want = 1 + fz_u8(in) % MAX_KEYS, n = 0;
    for (uint32_t i = 0; i < want; i++) {
        uint8_t b = fz_u8(in);
        uint64_t k = b < 0xe0 ? W.own[b % POOL] : b < 0xf0 ? W.foreign[b % POOL] : fz_uint(in, 8);
        uint32_t j = n;
        while (j > 0 && keys[j - 1] > k)
            j--;
        if (j > 0 && keys[j - 1] == k) continue;
        memmove(keys + j + 1, keys + j, (n - j) * sizeof *keys);
        keys[j] = k;
        n++;
    }
    return n;
}

/* rows of dim values in codec at out: sane values encoded, or raw bytes. Returns the bytes. */
static size_t put_rows(fz_in *in, uint8_t codec, uint32_t rows, uint32_t dim, uint8_t *out)
{
    if (codec > PS_CODEC_INT8) { /* refused anyway: some bytes */
        size_t n = fz_u8(in);
        take(in, out, n);
        return n;
    }
    const size_t bytes = ps_codec_row_bytes((ps_codec)codec, dim) * rows;
    if (fz_u8(in) < 0xe0) {
        float v[MAX_KEYS * 8];
        for (uint32_t i = 0; i < rows * dim; i++)
            v[i] = (float)(int8_t)fz_u8(in) / 16.0f;
        ps_codec_encode((ps_codec)codec, v, rows, dim, out, NULL);
    } else {
        take(in, out, bytes);
    }
    return bytes;
}

static size_t put_floats(fz_in *in, size_t n, uint8_t *out)
{
    const bool sane = fz_u8(in) < 0xe0;
    for (size_t i = 0; i < n; i++) {
        float v = (float)(int8_t)fz_u8(in) / 8.0f;
        if (sane)
            memcpy(out + 4 * i, &v, 4);
        else
            take(in, out + 4 * i, 4);
    }
    return 4 * n;
}

/* A checkpoint directory: one of a few names in the root (so a LOAD finds what a SAVE wrote),
 * or raw bytes below it or below a sibling of it (".." and all: the root check must refuse what
 * leaves it; the temporary directory holds whatever it wrongly let through). */
static size_t put_path(fz_in *in, uint8_t *out, size_t cap)
{
    uint8_t m = fz_u8(in);
    int n;
    if (m < 0xc0) {
        n = snprintf((char *)out, cap, "%s/c%u", W.root, m % 4);
    } else { /* "<root>/..." or a sibling whose name starts with the root's ("<root>X") */
        n = snprintf((char *)out, cap, "%s", W.root);
        size_t raw = fz_u8(in) % 48;
        take(in, out + n, raw);
        n += (int)raw;
    }
    return (size_t)n;
}

/* The HELLO a client of this cluster sends, then maybe one lie in it. */
static size_t put_hello(fz_in *in, uint8_t *out)
{
    uint32_t v[5] = {0, W.cfg.n_shards, W.cfg.n_workers, W.cfg.n_tables, W.cfg.n_dense};
    memcpy(out, v, sizeof v);
    size_t n = sizeof v;
    for (uint32_t i = 0; i < W.cfg.n_tables; i++, n += 8) {
        uint64_t fp = ps_table_fingerprint(&W.cfg.tables[i]);
        memcpy(out + n, &fp, 8);
    }
    for (uint32_t i = 0; i < W.cfg.n_dense; i++, n += 8) {
        uint64_t fp = ps_dense_fingerprint(&W.cfg.dense[i]);
        memcpy(out + n, &fp, 8);
    }
    uint8_t lie = fz_u8(in);
    if (lie >= 0x80) {
        uint32_t at = fz_u8(in) % 5, x = (uint32_t)fz_value(in, v[at]);
        memcpy(out + 4 * at, &x, 4);
    } else if (lie >= 0x60) {
        out[fz_u8(in) % n] ^= (uint8_t)(1 + fz_u8(in) % 255);
    } else if (lie >= 0x50) {
        n = fz_u8(in) % (n + 1);
    }
    return n;
}

static void build(fz_in *in, req *r, int depth);

/* The payload of r->h's op at p (room for cap bytes); returns its length. */
static size_t payload(fz_in *in, req *r, uint8_t *p, size_t cap, int depth)
{
    ps_hdr *h = &r->h;
    const uint8_t mode = fz_u8(in);
    if (mode >= 0xf0) { /* raw bytes, whatever the op */
        size_t n = fz_u8(in) | (size_t)(mode >= 0xf8 ? fz_u8(in) : 0) << 8;
        take(in, p, n < cap ? n : cap);
        return n < cap ? n : cap;
    }
    const uint32_t dim = dims[h->table < 3 ? h->table : mode % 3];
    switch (h->op) {
    case PS_OP_HELLO:
        return put_hello(in, p);
    case PS_OP_PULL:
    case PS_OP_PUSH: {
        uint32_t n;
        size_t at = 0;
        if (h->op == PS_OP_PUSH && (h->flags & PS_FLAG_ELIDED)) {
            pull_note *pn = &W.pulls[h->worker % 2][h->table % 3];
            uint64_t id = pn->req_id, sum = ps_keys_sum(pn->keys, pn->n);
            n = pn->n ? pn->n : 1;
            if (mode & 1) id = fz_value(in, id);
            if (mode & 2) sum = fz_value(in, sum);
            memcpy(p, &id, 8);
            memcpy(p + 8, &sum, 8);
            at = PS_ELIDED_HEAD;
        } else {
            n = pick_keys(in, r->keys);
            r->n = n;
            at = h->op == PS_OP_PUSH ? 4 : 0;
            uint32_t kb = (uint32_t)ps_keys_encode(r->keys, n, p + at);
            if (h->op == PS_OP_PUSH) memcpy(p, &kb, 4);
            at += kb;
        }
        h->count = (mode & 0x0c) == 0x0c ? (uint32_t)fz_value(in, n) : n;
        if (h->op == PS_OP_PUSH) at += put_rows(in, h->codec, n, dim, p + at);
        return at;
    }
    case PS_OP_PUSH_DENSE:
    case PS_OP_INIT_DENSE: {
        size_t n = dense_n[h->table < 3 ? h->table : mode % 3];
        if ((mode & 0x0c) == 0x0c) n = fz_u8(in) % 16;
        return put_floats(in, n, p);
    }
    case PS_OP_SAVE:
    case PS_OP_LOAD:
        return put_path(in, p, cap);
    case PS_OP_REPLICATE: {
        uint64_t seq = (mode & 3) == 3 ? fz_value(in, W.bseq) : W.bseq;
        memcpy(p, &seq, 8);
        if (depth > 0) return 8;
        req *inner = malloc(sizeof *inner);
        if (inner == NULL) die("out of memory");
        build(in, inner, depth + 1);
        size_t n = inner->len < cap - 8 ? inner->len : cap - 8;
        memcpy(p + 8, inner->buf, n);
        free(inner);
        return 8 + n;
    }
    default: /* no payload */
        return 0;
    }
}

/* One request: header fields, payload, seal, then maybe damage. depth 1: the request inside a
 * REPLICATE, mostly an update. */
static void build(fz_in *in, req *r, int depth)
{
    static const uint16_t updates[] = {PS_OP_PUSH, PS_OP_PUSH_DENSE, PS_OP_INIT_DENSE, PS_OP_LOAD,
                                       PS_OP_SHUTDOWN};
    memset(&r->h, 0, sizeof r->h);
    r->n = 0;
    ps_hdr *h = &r->h;
    uint8_t o = fz_u8(in);
    h->op = depth > 0 && o < 0xc0 ? updates[o % 5] : o % 16;
    /* An accepted SHUTDOWN costs a restart of the server (a tenth of a second): only from one
     * value of the byte. */
    if (depth == 0 && h->op == PS_OP_SHUTDOWN && o != PS_OP_SHUTDOWN) h->op = PS_OP_STATS;
    uint8_t t = fz_u8(in);
    h->table = t < 0xf0 ? t % 4 : (uint32_t)fz_value(in, t % 4);
    uint8_t c = fz_u8(in);
    h->codec = c < 0xf0 ? c % 4 : c;
    uint8_t f = fz_u8(in);
    h->flags = f < 0xc0 ? (uint8_t)(f & ps_op_flags(h->op)) : f;
    uint8_t w = fz_u8(in);
    h->worker = w < 0xf0 ? w % 2 : w < 0xf8 ? 2 : (uint16_t)fz_uint(in, 2);
    uint8_t id = fz_u8(in);
    h->req_id = id < 0x80 ? W.next_id++ : id < 0xf0 ? id % 16 : fz_uint(in, 8);
    uint8_t k = fz_u8(in);
    h->clock = k < 0xf0 ? k % 8 : (uint32_t)fz_uint(in, 4);
    const size_t plen = payload(in, r, r->buf + PS_HDR_BYTES, BUF_BYTES - PS_HDR_BYTES, depth);
    memcpy(r->buf, h, sizeof *h);
    ps_wire_seal(r->buf, plen);
    memcpy(&r->h, r->buf, sizeof r->h);
    r->len = PS_HDR_BYTES + plen;
    uint8_t d = fz_u8(in);
    if (d == 0xfe) { /* a flipped byte: the checksum (or a field before it) no longer holds */
        r->buf[fz_uint(in, 2) % r->len] ^= (uint8_t)(1 + fz_u8(in) % 255);
    } else if (d == 0xff) { /* cut short, maybe into the header */
        r->len = fz_uint(in, 2) % r->len;
    }
}

/* ---- sending and checking ---- */

/* A request on the wire: its own context of the socket, so that a CLOCK or BARRIER the server
 * defers can stay parked (until the other worker catches up or times out) while later requests
 * and inputs go on; it must still be answered within REPLY_WAIT_MS. */
typedef struct flight {
    rf_flight w;
    double sent;
    req *r;
} flight;

#define MAX_PARKED 4

static struct {
    flight *parked[MAX_PARKED];
} F;

static flight *flight_start(nng_socket sock, const req *r)
{
    flight *f = calloc(1, sizeof *f);
    nng_msg *m = NULL;
    if (f == NULL || (f->r = malloc(sizeof *r)) == NULL || nng_msg_alloc(&m, r->len) != 0)
        die("out of memory");
    memcpy(f->r, r, sizeof *r);
    memcpy(nng_msg_body(m), r->buf, r->len);
    f->sent = cm_now();
    if (rf_start(&f->w, sock, m) != 0) die("cannot open a context");
    return f;
}

/* Whether f is answered by `until` (cm_now() seconds). */
static bool flight_wait(flight *f, double until)
{
    return rf_wait(&f->w, until);
}

static ps_hdr check_reply(const req *r, nng_msg *rep);

/* The checked header of an answered flight's reply, which goes to *rep (the caller's); the
 * flight is freed. No reply at all is a failure. */
static ps_hdr flight_end(flight *f, nng_msg **rep)
{
    if (f->w.rv != 0) die("no reply to op %u: %s", f->r->h.op, nng_strerror(f->w.rv));
    *rep = rf_reply(&f->w);
    const ps_hdr h = check_reply(f->r, *rep);
    rf_end(&f->w);
    free(f->r);
    free(f);
    return h;
}

/* Drops a flight that will never be answered (its server was shut down). */
static void flight_drop(flight *f)
{
    rf_end(&f->w);
    free(f->r);
    free(f);
}

/* The reply's header, checked: it opens (or, for a request whose op is out of range, which the
 * reply echoes, or that had no whole header, answered with op 0, at least its framing and
 * checksum hold), it answers this request, and an error says what it is. */
static ps_hdr check_reply(const req *r, nng_msg *rep)
{
    const uint8_t *b = nng_msg_body(rep);
    const size_t len = nng_msg_len(rep);
    ps_hdr h, sent; /* sent: the header as it arrived (a flipped byte may have hit it) */
    memset(&sent, 0, sizeof sent);
    if (r->len >= PS_HDR_BYTES) memcpy(&sent, r->buf, sizeof sent);
    char *err = NULL;
    if (ps_wire_open(b, len, &h, &err) != CM_OK) {
        const bool bad_op = sent.op == 0 || sent.op >= PS_OP_MAX_;
        if (!bad_op || len < PS_HDR_BYTES) die("reply to op %u does not open: %s", r->h.op, err);
        free(err);
        uint8_t *copy = malloc(len);
        if (copy == NULL) die("out of memory");
        memcpy(copy, b, len);
        memcpy(&h, b, sizeof h);
        ps_wire_seal(copy, len - PS_HDR_BYTES);
        const bool sound = memcmp(copy, b, PS_HDR_BYTES) == 0;
        free(copy);
        if (!sound || h.op != sent.op) die("reply to bad op %u: framing broken", sent.op);
    }
    if (h.req_id != sent.req_id)
        die("reply to op %u has request id %llu, not %llu (reply: op %u, status %d)", r->h.op,
            (unsigned long long)h.req_id, (unsigned long long)sent.req_id, h.op, h.status);
    if (h.status > 0) die("reply to op %u has status %d", r->h.op, h.status);
    if (h.status < 0 && (h.payload_len == 0 || b[PS_HDR_BYTES] == '\0'))
        die("error reply %d to op %u without a message", h.status, r->h.op);
    return h;
}

/* Whether r arrived as built (sealed, whole): what the server then sees is r->h. */
static bool intact(const req *r)
{
    ps_hdr h;
    return ps_wire_open(r->buf, r->len, &h, NULL) == CM_OK;
}

static void drop_parked(void)
{
    for (size_t i = 0; i < MAX_PARKED; i++) {
        if (F.parked[i] != NULL) flight_drop(F.parked[i]);
        F.parked[i] = NULL;
    }
}

/* Checks the parked flights that have been answered; one parked longer than REPLY_WAIT_MS is a
 * hang. With `oldest`, waits for the oldest one first (to free its slot). */
static void reap_parked(bool oldest)
{
    if (oldest && F.parked[0] != NULL &&
        !flight_wait(F.parked[0], F.parked[0]->sent + REPLY_WAIT_MS / 1000.0))
        die("deferred op %u (worker %u, clock %u) not answered within %d ms", F.parked[0]->r->h.op,
            F.parked[0]->r->h.worker, F.parked[0]->r->h.clock, REPLY_WAIT_MS);
    size_t k = 0;
    for (size_t i = 0; i < MAX_PARKED && F.parked[i] != NULL; i++) {
        flight *f = F.parked[i];
        if (flight_wait(f, 0)) {
            nng_msg *rep;
            flight_end(f, &rep);
            nng_msg_free(rep);
        } else if (cm_now() > f->sent + REPLY_WAIT_MS / 1000.0) {
            die("deferred op %u (worker %u, clock %u) not answered within %d ms", f->r->h.op,
                f->r->h.worker, f->r->h.clock, REPLY_WAIT_MS);
        } else {
            F.parked[k++] = f;
        }
    }
    for (size_t i = k; i < MAX_PARKED; i++)
        F.parked[i] = NULL;
}

/* A deferred CLOCK or BARRIER waits, rightly, for as long as a slower worker stays live, and
 * an input can keep one live (its pulls and pushes) while it never catches up. Once the oldest
 * parked flight is a second old, the harness sends nothing for QUIET_MS: every worker is then
 * silent past the 100 ms timeout, so the server must release every wait, and the 5 s limit
 * still catches one it never releases. */
#define QUIET_MS 300
static void quiet_if_waiting(void)
{
    double oldest = 0;
    for (size_t i = 0; i < MAX_PARKED && F.parked[i] != NULL; i++)
        if (oldest == 0 || F.parked[i]->sent < oldest) oldest = F.parked[i]->sent;
    if (oldest == 0 || cm_now() - oldest < 1.0) return;
    struct timespec ts = {0, QUIET_MS * 1000000L};
    nanosleep(&ts, NULL);
    reap_parked(false);
}

static void park(flight *f)
{
    reap_parked(F.parked[MAX_PARKED - 1] != NULL);
    for (size_t i = 0; i < MAX_PARKED; i++)
        if (F.parked[i] == NULL) {
            F.parked[i] = f;
            return;
        }
    die("no room to park");
}

/* The payload of a valid request the fuzzer makes itself to the primary (STATS, or PULL_DENSE of
 * a block's whole state) into out (cap bytes); returns its length. */
static size_t probe(uint16_t op, uint32_t table, uint8_t flags, uint8_t *out, size_t cap)
{
    req *r = malloc(sizeof *r);
    if (r == NULL) die("out of memory");
    memset(&r->h, 0, sizeof r->h);
    r->h.op = op;
    r->h.table = table;
    r->h.flags = flags;
    r->h.req_id = W.next_id++;
    memcpy(r->buf, &r->h, sizeof r->h);
    ps_wire_seal(r->buf, 0);
    memcpy(&r->h, r->buf, sizeof r->h);
    r->len = PS_HDR_BYTES;
    flight *f = flight_start(W.sock, r);
    if (!flight_wait(f, f->sent + REPLY_WAIT_MS / 1000.0)) die("no reply to op %u", op);
    nng_msg *rep;
    const ps_hdr h = flight_end(f, &rep);
    if (h.status != 0 || h.payload_len > cap)
        die("op %u answered with status %d, %llu bytes", op, h.status,
            (unsigned long long)h.payload_len);
    memcpy(out, (uint8_t *)nng_msg_body(rep) + PS_HDR_BYTES, h.payload_len);
    nng_msg_free(rep);
    free(r);
    return h.payload_len;
}

/* After every input the primary still answers STATS, in full. */
static void check_stats(void)
{
    uint8_t buf[4096];
    const size_t want = sizeof(ps_server_stats) + W.cfg.n_tables * sizeof(emb_table_stats);
    if (probe(PS_OP_STATS, 0, 0, buf, sizeof buf) != want) die("STATS answered short");
}

/* What a request to table or block `table` may change, as the primary reports it: a table's
 * step and the keys it pulled, pushed, created and admitted (op PULL, PUSH), or a block's whole
 * state (PUSH_DENSE, INIT_DENSE). A refused request must leave it as it was. */
static size_t state_of(uint16_t op, uint32_t table, uint8_t *out)
{
    if (op == PS_OP_PUSH_DENSE || op == PS_OP_INIT_DENSE)
        return probe(PS_OP_PULL_DENSE, table, PS_FLAG_STATE, out, 1024);
    uint8_t buf[4096];
    probe(PS_OP_STATS, 0, 0, buf, sizeof buf);
    emb_table_stats t;
    memcpy(&t, buf + sizeof(ps_server_stats) + table * sizeof t, sizeof t);
    const uint64_t v[] = {t.step,       t.pulls,         t.pushes,      t.created,
                          t.admissions, t.admit_rejects, t.push_dropped};
    memcpy(out, v, sizeof v);
    return sizeof v;
}

/* Sends r, waits for its reply (a clock or barrier the server defers is parked instead) and
 * checks it and what the server counted. */
static void send_one(const req *r)
{
    const bool to_backup = r->h.op == PS_OP_REPLICATE;
    ps_server *s = to_backup ? W.backup : W.srv;
    const bool whole = intact(r);
    const uint16_t op = r->h.op;
    const bool quiet = F.parked[0] == NULL; /* nothing else in flight that the server counts */
    const bool rows_op = whole && (op == PS_OP_PULL || op == PS_OP_PUSH) && r->h.table < 3;
    const bool dense_op = whole && (op == PS_OP_PUSH_DENSE || op == PS_OP_INIT_DENSE) &&
                          (r->h.table == 0 || r->h.table == 2);
    uint8_t before[1024], after[1024];
    const size_t nb = rows_op || dense_op ? state_of(op, r->h.table, before) : 0;
    ps_server_stats a, z;
    ps_server_stats_get(s, &a);
    flight *f = flight_start(to_backup ? W.bsock : W.sock, r);
    if (whole && (op == PS_OP_CLOCK || op == PS_OP_BARRIER) && !flight_wait(f, f->sent + 0.002)) {
        park(f);
        return;
    }
    if (!flight_wait(f, f->sent + REPLY_WAIT_MS / 1000.0))
        die("no reply to op %u (table %u, worker %u, %zu bytes) within %d ms", op, r->h.table,
            r->h.worker, r->len, REPLY_WAIT_MS);
    nng_msg *rep;
    const ps_hdr h = flight_end(f, &rep);
    ps_server_stats_get(s, &z);
    if (quiet ? z.requests != a.requests + 1 : z.requests <= a.requests)
        die("op %u counted as %llu requests", op, (unsigned long long)(z.requests - a.requests));
    if (h.status < 0 && z.errors == a.errors) die("error reply to op %u not counted", op);
    /* (A backup may refuse a REPLICATE whose own update applied, for an update held before it
     * that then failed: docs/PROTOCOL.md, "Divergence".) */
    if (h.status < 0 && op != PS_OP_REPLICATE && z.rows_pushed != a.rows_pushed)
        die("refused op %u (%d) pushed %llu rows", op, h.status,
            (unsigned long long)(z.rows_pushed - a.rows_pushed));
    if (h.status < 0 && (rows_op || dense_op) &&
        (state_of(op, r->h.table, after) != nb || memcmp(before, after, nb) != 0))
        die("refused op %u (%d) changed table or block %u", op, h.status, r->h.table);
    if (whole && h.status == 0 && op == PS_OP_PULL) {
        const size_t rb = ps_codec_row_bytes((ps_codec)r->h.codec, dims[r->h.table]);
        if (h.payload_len != (uint64_t)r->h.count * rb)
            die("pull of %u rows of table %u answered with %llu bytes", r->h.count, r->h.table,
                (unsigned long long)h.payload_len);
        if (!(r->h.flags & PS_FLAG_LOOKUP) && r->n == r->h.count) {
            pull_note *pn = &W.pulls[r->h.worker][r->h.table];
            pn->req_id = r->h.req_id;
            pn->n = r->n;
            memcpy(pn->keys, r->keys, r->n * sizeof *r->keys);
        }
    }
    if (whole && h.status == 0 && op == PS_OP_PUSH && z.rows_pushed != a.rows_pushed + r->h.count &&
        z.duplicates != a.duplicates + 1)
        die("push of %u rows acknowledged, %llu pushed", r->h.count,
            (unsigned long long)(z.rows_pushed - a.rows_pushed));
    if (getenv("FUZZ_SERVER_TRACE")) /* to check what an input (a seed) sends */
        fprintf(stderr, "op %u table %u worker %u count %u: status %d, %llu bytes\n", op,
                r->h.table, r->h.worker, r->h.count, h.status, (unsigned long long)h.payload_len);
    /* The backup's next sequence number, as far as its counters tell: an update next in line
     * is applied on arrival, with any it held that follow it. */
    uint64_t seq = 0;
    if (whole && op == PS_OP_REPLICATE && r->len >= PS_HDR_BYTES + 8)
        memcpy(&seq, r->buf + PS_HDR_BYTES, 8);
    if (whole && op == PS_OP_REPLICATE && h.status == 0 && seq == W.bseq &&
        z.replica_held <= a.replica_held)
        W.bseq += 1 + (a.replica_held - z.replica_held);
    nng_msg_free(rep);
    if (whole && op == PS_OP_SHUTDOWN && h.status == 0) restart_primary();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (W.srv == NULL) setup();
    fz_in in = {data, size};
    req *r = malloc(sizeof *r);
    if (r == NULL) die("out of memory");
    quiet_if_waiting();
    const uint32_t n = 1 + fz_u8(&in) % MAX_REQS;
    for (uint32_t i = 0; i < n && (i == 0 || in.n > 0); i++) {
        build(&in, r, 0);
        send_one(r);
    }
    free(r);
    reap_parked(false);
    check_stats();
    ps_server_stats bs;
    ps_server_stats_get(W.backup, &bs);
    /* A restart costs a tenth of a second (ps_server_destroy lets replies settle): a diverged
     * backup goes on refusing for a few inputs, and one holding many updates ahead of a gap
     * that will never fill is started afresh. */
    static unsigned inputs;
    if ((bs.replica_diverged && ++inputs % 8 == 0) || bs.promoted || bs.replica_held > 64)
        restart_backup();
    return 0;
}
