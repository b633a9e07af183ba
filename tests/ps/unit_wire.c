/*
 * Unit tests of ps/wire.h (private to ps/, tested directly because every byte a server reads
 * goes through it): header seal/open, varints and key deltas, value codecs against an exact
 * reference, and the jump hash that places keys on shards.
 */
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdint.h>

#include "check.h"
#include "ps/wire.h"

static uint64_t rng_state = 0x1234567;

static uint64_t rng(void)
{
    uint64_t x = (rng_state += 0x9e3779b97f4a7c15ull);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static float f_bits(uint32_t b)
{
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* ---------------- header ---------------- */

enum { PAY = 24 };

static void make_msg(uint8_t *buf)
{
    ps_hdr h;
    memset(&h, 0, sizeof h);
    h.op = PS_OP_PUSH;
    h.table = 3;
    h.count = 7;
    h.codec = PS_CODEC_INT8;
    h.flags = 1;
    h.worker = 9;
    h.clock = 11;
    h.req_id = 0x0102030405060708ull;
    memcpy(buf, &h, sizeof h);
    for (int i = 0; i < PAY; i++)
        buf[PS_HDR_BYTES + i] = (uint8_t)(i * 7 + 1);
    ps_wire_seal(buf, PAY);
}

/* Opens buf and expects an error whose message contains `what`. */
static void expect_open_error(const uint8_t *buf, size_t len, const char *what)
{
    ps_hdr h;
    char *err = NULL;
    int rc = ps_wire_open(buf, len, &h, &err);
    CHECK_MSG(rc == CM_ECORRUPT, "want error '%s', got rc %d", what, rc);
    CHECK_MSG(err != NULL && strstr(err, what) != NULL, "want '%s' in '%s'", what, err ? err : "");
    free(err);
}

static void set_hdr_field(uint8_t *buf, size_t off, const void *v, size_t n, bool reseal)
{
    memcpy(buf + off, v, n);
    if (reseal) {
        /* Recomputes the checksum without letting seal repair magic or version. */
        ps_hdr keep;
        memcpy(&keep, buf, sizeof keep);
        ps_wire_seal(buf, PAY);
        ps_hdr h;
        memcpy(&h, buf, sizeof h);
        keep.checksum = h.checksum;
        memcpy(buf, &keep, sizeof keep);
    }
}

static void test_header(void)
{
    uint8_t buf[PS_HDR_BYTES + PAY], bad[sizeof buf];
    make_msg(buf);
    ps_hdr h;
    char *err = NULL;
    CHECK_OK(ps_wire_open(buf, sizeof buf, &h, &err), err);
    CHECK(h.magic == PS_MAGIC && h.version == PS_PROTOCOL_VERSION && h.op == PS_OP_PUSH);
    CHECK(h.table == 3 && h.count == 7 && h.codec == PS_CODEC_INT8 && h.flags == 1);
    CHECK(h.worker == 9 && h.clock == 11 && h.req_id == 0x0102030405060708ull &&
          h.payload_len == PAY);

    /* Every op in range opens; 0 and PS_OP_MAX_ and beyond do not (checksum made valid). */
    for (uint16_t op = 0; op <= PS_OP_MAX_ + 1; op++) {
        memcpy(bad, buf, sizeof buf);
        set_hdr_field(bad, offsetof(ps_hdr, op), &op, 2, true);
        if (op >= 1 && op < PS_OP_MAX_) {
            CHECK_OK(ps_wire_open(bad, sizeof bad, &h, &err), err);
            CHECK(h.op == op);
        } else {
            expect_open_error(bad, sizeof bad, "unknown op");
        }
    }
    /* Magic and version are reported as such even with a checksum that matches. */
    uint32_t magic = 0x53504d46u;
    memcpy(bad, buf, sizeof buf);
    set_hdr_field(bad, offsetof(ps_hdr, magic), &magic, 4, true);
    expect_open_error(bad, sizeof bad, "magic");
    uint16_t ver = PS_PROTOCOL_VERSION + 1;
    memcpy(bad, buf, sizeof buf);
    set_hdr_field(bad, offsetof(ps_hdr, version), &ver, 2, true);
    expect_open_error(bad, sizeof bad, "version");
    ver = 0;
    set_hdr_field(bad, offsetof(ps_hdr, version), &ver, 2, true);
    expect_open_error(bad, sizeof bad, "version");

    /* Lengths: shorter than a header, payload shorter or longer than declared. */
    expect_open_error(buf, 0, "shorter");
    expect_open_error(buf, PS_HDR_BYTES - 1, "shorter");
    expect_open_error(buf, sizeof buf - 1, "payload length");
    expect_open_error(buf, PS_HDR_BYTES, "payload length");
    uint8_t longer[sizeof buf + 1];
    memcpy(longer, buf, sizeof buf);
    longer[sizeof buf] = 0;
    expect_open_error(longer, sizeof longer, "payload length");
    uint64_t plen = UINT64_MAX;
    memcpy(bad, buf, sizeof buf);
    set_hdr_field(bad, offsetof(ps_hdr, payload_len), &plen, 8, false);
    expect_open_error(bad, sizeof bad, "payload length");

    /* Checksum: a flipped bit in any header field or the payload, or in the checksum. */
    const size_t fields[] = {
        offsetof(ps_hdr, table),    offsetof(ps_hdr, count),    offsetof(ps_hdr, codec),
        offsetof(ps_hdr, flags),    offsetof(ps_hdr, status),   offsetof(ps_hdr, worker),
        offsetof(ps_hdr, reserved), offsetof(ps_hdr, clock),    offsetof(ps_hdr, reserved2),
        offsetof(ps_hdr, req_id),   offsetof(ps_hdr, checksum), PS_HDR_BYTES,
        PS_HDR_BYTES + PAY - 1};
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        memcpy(bad, buf, sizeof buf);
        bad[fields[i]] ^= 0x10;
        expect_open_error(bad, sizeof bad, "checksum");
    }
    /* An empty payload seals and opens. */
    uint8_t empty[PS_HDR_BYTES];
    memset(empty, 0, sizeof empty);
    ps_hdr eh = {.op = PS_OP_STATS};
    memcpy(empty, &eh, sizeof eh);
    ps_wire_seal(empty, 0);
    CHECK_OK(ps_wire_open(empty, sizeof empty, &h, &err), err);
}

/* ---------------- varints and keys ---------------- */

static void test_varint(void)
{
    const uint64_t vals[] = {0,
                             1,
                             127,
                             128,
                             16383,
                             16384,
                             (1ull << 35) - 1,
                             1ull << 35,
                             (1ull << 63) - 1,
                             1ull << 63,
                             UINT64_MAX};
    uint8_t b[16];
    for (size_t i = 0; i < sizeof vals / sizeof vals[0] + 1000; i++) {
        uint64_t v = i < sizeof vals / sizeof vals[0] ? vals[i] : rng() >> (rng() % 64);
        size_t n = ps_varint_put(b, v);
        size_t bits = v ? 64 - (size_t)__builtin_clzll(v) : 1;
        CHECK_MSG(n == (bits + 6) / 7, "%" PRIu64 ": %zu bytes", v, n);
        uint64_t got = 0;
        CHECK(ps_varint_get(b, n, &got) == n && got == v);
        CHECK(ps_varint_get(b, n + 3, &got) == n && got == v); /* trailing input is not read */
        CHECK(ps_varint_get(b, n - 1, &got) == 0);             /* truncated */
    }
    CHECK(ps_varint_get(b, 0, &(uint64_t){0}) == 0);
    /* Overlong: 11 bytes, and 10-byte values beyond 64 bits. */
    uint8_t over[11];
    memset(over, 0x80, sizeof over);
    over[10] = 0;
    uint64_t v;
    CHECK(ps_varint_get(over, sizeof over, &v) == 0);
    memset(over, 0xff, 9);
    over[9] = 0x02;
    CHECK(ps_varint_get(over, 10, &v) == 0);
    over[9] = 0x01;
    CHECK(ps_varint_get(over, 10, &v) == 10 && v == UINT64_MAX);
    over[9] = 0x81; /* continuation past the 10th byte */
    CHECK(ps_varint_get(over, 11, &v) == 0);
    /* The eight-byte path against byte-by-byte decoding, on random bytes (valid and not, with
     * continuation bits at every density) at every length and offset. */
    uint8_t r[64];
    size_t bad = 0;
    for (int t = 0; t < 200000; t++) {
        unsigned density = (unsigned)(rng() % 9); /* continuation bits in ~density/8 of bytes */
        for (size_t i = 0; i < sizeof r; i++) {
            uint8_t byte = (uint8_t)(rng() & 0x7f);
            r[i] = (uint8_t)(byte | (rng() % 8 < density ? 0x80 : 0));
        }
        size_t off = (size_t)(rng() % 16), len = (size_t)(rng() % 24);
        uint64_t want = 0, got = 0x5555;
        size_t wn = 0;
        for (size_t i = 0; i < len && i < 10; i++) {
            uint64_t b = r[off + i] & 0x7f;
            if (i == 9 && b > 1) break;
            want |= b << (7 * i);
            if ((r[off + i] & 0x80) == 0) {
                wn = i + 1;
                break;
            }
        }
        size_t gn = ps_varint_get(r + off, len, &got);
        bad += gn != wn || (wn != 0 && got != want);
    }
    CHECK_MSG(bad == 0, "ps_varint_get differs from byte-by-byte decoding in %zu of 200000", bad);
}

static void test_keys(void)
{
    enum { N = 5000 };
    uint64_t *keys = malloc(N * sizeof *keys), *got = malloc(N * sizeof *got);
    uint8_t *buf = malloc(N * 10 + 16);
    char *err = NULL;
    /* Sorted distinct keys spanning the whole range, 0 and UINT64_MAX included. */
    keys[0] = 0;
    for (size_t i = 1; i < N - 1; i++)
        keys[i] = keys[i - 1] + 1 + (rng() >> (i % 3 ? 50 : 14)); /* stays below 2^61 */
    keys[N - 1] = UINT64_MAX;
    CHECK(keys[N - 2] < UINT64_MAX);
    size_t len = ps_keys_encode(keys, N, buf);
    CHECK(len >= N && len <= N * 10);
    /* Byte for byte the deltas' ps_varint_put (the encoder writes eight bytes at a time). */
    uint8_t *ref = malloc(N * 10 + 16);
    size_t rlen = 0;
    for (size_t i = 0; ref != NULL && i < N; i++)
        rlen += ps_varint_put(ref + rlen, keys[i] - (i ? keys[i - 1] : 0));
    CHECK(ref != NULL && rlen == len && memcmp(ref, buf, len) == 0);
    free(ref);
    CHECK_OK(ps_keys_decode(buf, len, N, got, &err), err);
    CHECK(memcmp(keys, got, N * sizeof *keys) == 0);
    /* A single key, and an empty set. */
    CHECK_OK(ps_keys_decode(buf, 1, 1, got, &err), err);
    CHECK(got[0] == 0);
    CHECK_OK(ps_keys_decode(buf, 0, 0, got, &err), err);

    CHECK(ps_keys_decode(buf, len - 1, N, got, &err) == CM_ECORRUPT); /* truncated */
    CHECK(err && strstr(err, "truncated"));
    free(err), err = NULL;
    CHECK(ps_keys_decode(buf, len, N - 1, got, &err) == CM_ECORRUPT); /* trailing bytes */
    CHECK(err && strstr(err, "trailing"));
    free(err), err = NULL;
    CHECK(ps_keys_decode(buf, len, N + 1, got, &err) == CM_ECORRUPT); /* count too large */
    free(err), err = NULL;

    /* Non-increasing: a repeated key (delta 0), and a delta that wraps past 2^64. */
    uint64_t dup[3] = {5, 9, 9};
    len = ps_keys_encode(dup, 3, buf);
    CHECK(ps_keys_decode(buf, len, 3, got, &err) == CM_ECORRUPT);
    CHECK(err && strstr(err, "key 2") && strstr(err, "increasing"));
    free(err), err = NULL;
    uint64_t wrap[2] = {UINT64_MAX - 1, 0};
    len = ps_keys_encode(wrap, 1, buf);
    len += ps_varint_put(buf + len, 5);
    CHECK(ps_keys_decode(buf, len, 2, got, &err) == CM_ECORRUPT);
    CHECK(err && strstr(err, "increasing"));
    free(err), err = NULL;
    /* An overlong varint inside a key list. */
    memset(buf, 0x80, 11);
    buf[11] = 0;
    CHECK(ps_keys_decode(buf, 12, 1, got, &err) == CM_ECORRUPT);
    free(err);
    free(keys);
    free(got);
    free(buf);
}

/* ---------------- codecs ---------------- */

/* The exact value of a half, by arithmetic independent of the code under test. */
static double ref_f16(uint16_t h)
{
    int e = (h >> 10) & 31, m = h & 1023;
    double s = (h & 0x8000) ? -1.0 : 1.0;
    if (e == 0) return s * ldexp(m, -24);
    if (e == 31) return m ? NAN : s * INFINITY;
    return s * ldexp(1024 + m, e - 25);
}

/* Checks that h is the round-to-nearest-even half of f (f finite). */
static void check_f16_nearest(float f, uint16_t h)
{
    double x = fabs((double)f);
    uint16_t mag = h & 0x7fff;
    CHECK_MSG((h & 0x8000) == (signbit(f) ? 0x8000 : 0), "sign of %a", (double)f);
    if (x >= 65520.0) {
        CHECK_MSG(mag == 0x7c00, "%a should overflow to inf, got 0x%04x", (double)f, h);
        return;
    }
    if (mag >= 0x7c00) {
        CHECK_MSG(0, "%a encoded as inf/nan 0x%04x", (double)f, h);
        return;
    }
    double v = ref_f16(mag), err = fabs(v - x);
    /* Neighbours below and above (0x7bff's upper neighbour is the overflow point 65536). */
    double lo = mag > 0 ? ref_f16((uint16_t)(mag - 1)) : -1.0;
    double hi = mag < 0x7bff ? ref_f16((uint16_t)(mag + 1)) : 65536.0;
    bool ok = err <= fabs(x - hi) && (mag == 0 || err <= fabs(x - lo));
    bool tie = (err == fabs(x - hi)) || (mag > 0 && err == fabs(x - lo));
    if (ok && tie && x != v) ok = (mag & 1) == 0;
    CHECK_MSG(ok, "%a -> 0x%04x (%a) is not the nearest-even half", (double)f, h, v);
}

static void test_f16(void)
{
    /* Decode: every half against the reference. */
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float got = cm_f16_to_f32((uint16_t)h);
        double want = ref_f16((uint16_t)h);
        if (isnan(want) ? !isnan(got) : (got != (float)want || !signbit(got) != !signbit(want)))
            bad++;
    }
    CHECK_MSG(bad == 0, "%d halves decode wrongly", bad);
    /* Round trip of every finite half. */
    bad = 0;
    for (uint32_t h = 0; h < 65536; h++)
        if (((h >> 10) & 31) != 31 && cm_f32_to_f16(cm_f16_to_f32((uint16_t)h)) != h) bad++;
    CHECK_MSG(bad == 0, "%d halves do not round-trip", bad);

    /* Named special values. */
    struct {
        float f;
        uint16_t h;
    } sp[] = {
        {0.0f, 0x0000},
        {-0.0f, 0x8000},
        {1.0f, 0x3c00},
        {-2.0f, 0xc000},
        {65504.0f, 0x7bff},
        {65519.99f, 0x7bff},
        {65520.0f, 0x7c00}, /* tie at the top: to even = inf */
        {-65520.0f, 0xfc00},
        {1e10f, 0x7c00},
        {INFINITY, 0x7c00},
        {-INFINITY, 0xfc00},
        {FLT_MAX, 0x7c00},
        {0x1p-24f, 0x0001},
        {0x1p-25f, 0x0000}, /* tie 0 / 1: to even */
        {0x1.8p-25f, 0x0001},
        {0x3p-25f, 0x0002}, /* tie 1 / 2: to even */
        {0x5p-25f, 0x0002}, /* tie 2 / 3: to even */
        {0x3ffp-24f, 0x03ff},
        {0x1p-14f, 0x0400},
        {0x7ffp-25f, 0x0400}, /* tie 0x3ff/0x400 */
        {0x1p-26f, 0x0000},
        {-0x1p-26f, 0x8000},
        {FLT_MIN, 0x0000},
        {0x1p-149f, 0x0000},
        {1.0f + 0x1p-11f, 0x3c00},
        {1.0f + 0x3p-11f, 0x3c02},
        {1.0f + 0x1.8p-11f, 0x3c01},
    };
    for (size_t i = 0; i < sizeof sp / sizeof sp[0]; i++) {
        uint16_t h = cm_f32_to_f16(sp[i].f);
        CHECK_MSG(h == sp[i].h, "f16(%a) = 0x%04x, want 0x%04x", (double)sp[i].f, h, sp[i].h);
    }
    uint16_t hn = cm_f32_to_f16(NAN), hn2 = cm_f32_to_f16(-NAN);
    CHECK((hn & 0x7c00) == 0x7c00 && (hn & 0x3ff) != 0 && isnan(cm_f16_to_f32(hn)));
    CHECK((hn2 & 0x8000) && isnan(cm_f16_to_f32(hn2)));
    /* A signalling NaN whose payload sits in the low bits stays a NaN (not inf). */
    uint16_t hs = cm_f32_to_f16(f_bits(0x7f800001u));
    CHECK((hs & 0x7c00) == 0x7c00 && (hs & 0x3ff) != 0);

    /* Every midpoint between adjacent finite halves (exact in float): ties go to even. */
    bad = 0;
    for (uint16_t h = 0; h < 0x7bff; h++) {
        double mid = (ref_f16(h) + ref_f16((uint16_t)(h + 1))) / 2;
        uint16_t want = (h & 1) ? (uint16_t)(h + 1) : h;
        if (cm_f32_to_f16((float)mid) != want || cm_f32_to_f16(-(float)mid) != (want | 0x8000))
            bad++;
    }
    CHECK_MSG(bad == 0, "%d midpoints round wrongly", bad);
    /* Random floats across the half range and around it. */
    for (int i = 0; i < 300000; i++) {
        uint32_t e = 127 - 30 + (uint32_t)(rng() % 48); /* 2^-30 .. 2^17 */
        float f = f_bits((uint32_t)(rng() & 0x807fffffu) | e << 23);
        check_f16_nearest(f, cm_f32_to_f16(f));
    }
}

static void test_bf16(void)
{
    struct {
        float f;
        uint16_t h;
    } sp[] = {{0.0f, 0x0000},           {-0.0f, 0x8000},          {1.0f, 0x3f80},
              {1.0f + 0x1p-8f, 0x3f80}, {1.0f + 0x3p-8f, 0x3f82}, {1.0f + 0x1.8p-8f, 0x3f81},
              {INFINITY, 0x7f80},       {-INFINITY, 0xff80},      {FLT_MAX, 0x7f80}};
    for (size_t i = 0; i < sizeof sp / sizeof sp[0]; i++)
        CHECK_MSG(cm_f32_to_bf16(sp[i].f) == sp[i].h, "bf16(%a)", (double)sp[i].f);
    CHECK(isnan(cm_bf16_to_f32(cm_f32_to_bf16(NAN))));
    CHECK(isnan(cm_bf16_to_f32(cm_f32_to_bf16(f_bits(0x7f800001u)))));
    for (uint32_t h = 0; h < 65536; h++)
        if ((h & 0x7f80) != 0x7f80) CHECK(cm_f32_to_bf16(cm_bf16_to_f32((uint16_t)h)) == h);
}

/* Round trips of random rows through each codec; back must equal the decoded values. */
static void test_codec_roundtrip(void)
{
    const uint32_t dims[] = {1, 7, 16, 64};
    for (size_t di = 0; di < 4; di++) {
        uint32_t dim = dims[di];
        enum { ROWS = 300 };
        size_t n = (size_t)ROWS * dim;
        float *src = malloc(n * 4), *dst = malloc(n * 4), *back = malloc(n * 4);
        uint8_t *enc = malloc(ROWS * ps_codec_row_bytes(PS_CODEC_INT8, dim) + n * 4);
        for (size_t r = 0; r < ROWS; r++) {
            double mag = ldexp(1.0, (int)(rng() % 30) - 20); /* rows of very different scale */
            for (uint32_t j = 0; j < dim; j++)
                src[r * dim + j] =
                    r == 5 ? 0.0f : (float)(mag * ((double)(rng() >> 11) / 0x1p53 * 2 - 1));
        }
        for (int c = PS_CODEC_F32; c <= PS_CODEC_INT8; c++) {
            char *err = NULL;
            ps_codec_encode((ps_codec)c, src, ROWS, dim, enc, back);
            CHECK_OK(ps_codec_decode((ps_codec)c, enc, ROWS, dim, dst, &err), err);
            CHECK_MSG(memcmp(dst, back, n * 4) == 0, "codec %s: back differs from decode",
                      ps_codec_name((ps_codec)c));
            double worst = 0;
            for (size_t r = 0; r < ROWS; r++) {
                float amax = 0;
                for (uint32_t j = 0; j < dim; j++)
                    amax = fmaxf(amax, fabsf(src[r * dim + j]));
                for (uint32_t j = 0; j < dim; j++) {
                    double x = src[r * dim + j], e = fabs(dst[r * dim + j] - x), bound;
                    switch (c) {
                    case PS_CODEC_F32:
                        bound = 0;
                        break;
                    case PS_CODEC_F16: /* half an ulp relative, or half the subnormal step */
                        bound = fmax(fabs(x) * 0x1p-11, 0x1p-25);
                        break;
                    case PS_CODEC_BF16:
                        bound = fabs(x) * 0x1p-8;
                        break;
                    /* Half the scale, which is max|x|/127 rounded up to a bf16 (at most 2^-7
                     * relative above it). */
                    default:
                        bound = amax / 127.0 * 0.5 * (1 + 0x1p-7) * (1 + 1e-5);
                        break;
                    }
                    if (e > bound) worst = fmax(worst, e / fmax(bound, 1e-300));
                }
            }
            CHECK_MSG(worst == 0, "codec %s dim %u: error %.3g x the bound",
                      ps_codec_name((ps_codec)c), dim, worst);
            for (uint32_t j = 0; j < dim; j++)
                CHECK(dst[5 * dim + j] == 0.0f); /* zero row */
        }
        free(src);
        free(dst);
        free(back);
        free(enc);
    }
    CHECK(ps_codec_row_bytes(PS_CODEC_F32, 16) == 64 && ps_codec_row_bytes(PS_CODEC_F16, 16) == 32);
    CHECK(ps_codec_row_bytes(PS_CODEC_BF16, 16) == 32 &&
          ps_codec_row_bytes(PS_CODEC_INT8, 16) == 18);
    ps_codec c;
    CHECK(ps_codec_parse("int8", &c) == CM_OK && c == PS_CODEC_INT8);
    CHECK(ps_codec_parse("fp64", &c) == CM_EINVAL && ps_codec_parse(NULL, &c) == CM_EINVAL);
    for (int i = 0; i < 4; i++)
        CHECK(ps_codec_parse(ps_codec_name((ps_codec)i), &c) == CM_OK && c == (ps_codec)i);
}

/* Decoding refuses non-finite values and bad int8 scales, naming the row. */
static void test_codec_reject(void)
{
    enum { DIM = 4, ROWS = 3 };
    float src[ROWS * DIM], dst[ROWS * DIM];
    uint8_t enc[ROWS * DIM * 4];
    for (int i = 0; i < ROWS * DIM; i++)
        src[i] = (float)i * 0.25f;
    char *err = NULL;
    for (int c = PS_CODEC_F32; c <= PS_CODEC_BF16; c++) {
        const float poison[] = {NAN, INFINITY, -INFINITY};
        for (int p = 0; p < 3; p++) {
            src[1 * DIM + 2] = poison[p];
            ps_codec_encode((ps_codec)c, src, ROWS, DIM, enc, NULL);
            CHECK(ps_codec_decode((ps_codec)c, enc, ROWS, DIM, dst, &err) == CM_ECORRUPT);
            CHECK_MSG(err && strstr(err, "row 1"), "%s: %s", ps_codec_name((ps_codec)c),
                      err ? err : "");
            free(err), err = NULL;
        }
        src[1 * DIM + 2] = 1.0f;
    }
    /* fp16 overflow of a finite push value becomes inf on the wire: refused, not applied. */
    src[2 * DIM] = 1e6f;
    ps_codec_encode(PS_CODEC_F16, src, ROWS, DIM, enc, NULL);
    CHECK(ps_codec_decode(PS_CODEC_F16, enc, ROWS, DIM, dst, &err) == CM_ECORRUPT);
    free(err), err = NULL;
    src[2 * DIM] = 0;
    /* bf16 scales: NaN, inf, -1, -0, and the largest finite one (127 times it overflows). */
    const uint16_t scales[] = {0x7fc0, 0x7f80, 0xbf80, 0x8000, 0x7f7f};
    for (int s = 0; s < 5; s++) {
        src[2 * DIM + 1] = 1.0f; /* an int8 of 127 in row 2 */
        ps_codec_encode(PS_CODEC_INT8, src, ROWS, DIM, enc, NULL);
        memcpy(enc + 2 * (2 + DIM), &scales[s], 2);
        CHECK(ps_codec_decode(PS_CODEC_INT8, enc, ROWS, DIM, dst, &err) == CM_ECORRUPT);
        CHECK_MSG(err && strstr(err, "row 2"), "scale 0x%04x: %s", scales[s], err ? err : "");
        free(err), err = NULL;
    }
    CHECK(ps_codec_decode((ps_codec)7, enc, 1, DIM, dst, &err) == CM_ECORRUPT);
    free(err);
}

/* int8 rows of subnormal gradients: the bf16 scale keeps fp32's range, and a scale with no
 * finite inverse still quantises without overflow or sign flips. */
static void test_int8_tiny(void)
{
    enum { DIM = 8 };
    const float mags[] = {1e-39f, 1e-41f, 3e-38f, 1e-30f};
    for (int m = 0; m < 4; m++) {
        float src[DIM], dst[DIM], back[DIM];
        uint8_t enc[2 + DIM];
        for (int j = 0; j < DIM; j++)
            src[j] = mags[m] * (float)(j - 3);
        ps_codec_encode(PS_CODEC_INT8, src, 1, DIM, enc, back);
        char *err = NULL;
        CHECK_OK(ps_codec_decode(PS_CODEC_INT8, enc, 1, DIM, dst, &err), err);
        uint16_t sb;
        memcpy(&sb, enc, 2);
        uint32_t bits = (uint32_t)sb << 16;
        float scale;
        memcpy(&scale, &bits, 4);
        CHECK(scale > 0.0f);
        for (int j = 0; j < DIM; j++) {
            CHECK(dst[j] == back[j]);
            CHECK_MSG(fabsf(dst[j] - src[j]) <= scale * 0.5f, "mag %g elem %d: %g for %g",
                      (double)mags[m], j, (double)dst[j], (double)src[j]);
            CHECK(!(dst[j] > 0 && src[j] < 0) && !(dst[j] < 0 && src[j] > 0));
        }
    }
}

/* ---------------- jump hash ---------------- */

static void test_jump_hash(void)
{
    enum { N = 100000, MAXN = 40 };
    uint32_t *prev = malloc(N * sizeof *prev);
    uint64_t *keys = malloc(N * sizeof *keys);
    for (size_t i = 0; i < N; i++) {
        keys[i] = i < N / 2 ? i : rng(); /* dense ids and hashed ids */
        prev[i] = ps_key_shard(keys[i], 1);
        CHECK(prev[i] == 0);
    }
    for (uint32_t n = 2; n <= MAXN; n++) {
        size_t moved = 0, wrong = 0, count[MAXN] = {0};
        for (size_t i = 0; i < N; i++) {
            uint32_t s = ps_key_shard(keys[i], n);
            if (s >= n) {
                wrong++;
                continue;
            }
            count[s]++;
            /* Growing by one shard only moves keys onto the new shard. */
            if (s != prev[i]) {
                moved++;
                if (s != n - 1) wrong++;
            }
            prev[i] = s;
        }
        CHECK_MSG(wrong == 0, "n=%u: %zu keys moved between old shards or out of range", n, wrong);
        /* ~1/n of the keys move; binomial sd is about sqrt(N/n): allow 6 sd. */
        double want = (double)N / n, sd = sqrt(want);
        CHECK_MSG(fabs((double)moved - want) < 6 * sd, "n=%u: %zu keys moved, want ~%.0f", n, moved,
                  want);
        for (uint32_t s = 0; s < n; s++)
            CHECK_MSG(fabs((double)count[s] - want) < 6 * sd, "n=%u shard %u holds %zu", n, s,
                      count[s]);
    }
    CHECK(ps_key_shard(42, 1000) == ps_key_shard(42, 1000)); /* a pure function */
    free(prev);
    free(keys);
}

/* Fingerprints cover the model and codecs, not storage settings. */
static void test_fingerprint(void)
{
    ps_table_spec a;
    memset(&a, 0, sizeof a);
    strcpy(a.name, "emb");
    emb_table_config_init(&a.cfg);
    ps_table_spec b = a;
    b.cfg.mem_budget_bytes = 1 << 20;
    b.cfg.admit_threshold = 3;
    CHECK(ps_table_fingerprint(&a) == ps_table_fingerprint(&b));
    b = a;
    b.cfg.lr *= 2;
    CHECK(ps_table_fingerprint(&a) != ps_table_fingerprint(&b));
    b = a;
    b.push_codec = PS_CODEC_INT8;
    CHECK(ps_table_fingerprint(&a) != ps_table_fingerprint(&b));
    b = a;
    b.name[0] = 'E';
    CHECK(ps_table_fingerprint(&a) != ps_table_fingerprint(&b));
    ps_dense_spec d = {.size = 10, .lr = 0.1f}, e = d;
    e.size = 11;
    CHECK(ps_dense_fingerprint(&d) != ps_dense_fingerprint(&e));
}

int main(void)
{
    test_header();
    test_varint();
    test_keys();
    test_f16();
    test_bf16();
    test_codec_roundtrip();
    test_codec_reject();
    test_int8_tiny();
    test_jump_hash();
    test_fingerprint();
    return check_done();
}
