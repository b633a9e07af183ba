#include "ps/wire.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include "common/xxh.h"

static const char *const codec_names[] = {"fp32", "fp16", "bf16", "int8"};

int ps_codec_parse(const char *name, ps_codec *out)
{
    for (size_t i = 0; name != NULL && i < 4; i++)
        if (strcmp(name, codec_names[i]) == 0) {
            *out = (ps_codec)i;
            return CM_OK;
        }
    return CM_EINVAL;
}

const char *ps_codec_name(ps_codec c)
{
    return (unsigned)c < 4 ? codec_names[c] : "unknown";
}

size_t ps_codec_row_bytes(ps_codec c, uint32_t dim)
{
    switch (c) {
    case PS_CODEC_F32:
        return 4u * dim;
    case PS_CODEC_F16:
    case PS_CODEC_BF16:
        return 2u * dim;
    case PS_CODEC_INT8:
        return 2u + dim;
    }
    return 0;
}

static uint64_t seal_hash(const void *buf, size_t total)
{
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, buf, offsetof(ps_hdr, checksum));
    static const uint64_t zero = 0;
    XXH3_64bits_update(&st, &zero, sizeof zero);
    XXH3_64bits_update(&st, (const char *)buf + PS_HDR_BYTES, total - PS_HDR_BYTES);
    return XXH3_64bits_digest(&st);
}

void ps_wire_seal(void *buf, size_t payload_len)
{
    ps_hdr h;
    memcpy(&h, buf, sizeof h);
    h.magic = PS_MAGIC;
    h.version = PS_PROTOCOL_VERSION;
    h.payload_len = payload_len;
    h.checksum = 0;
    memcpy(buf, &h, sizeof h);
    h.checksum = seal_hash(buf, PS_HDR_BYTES + payload_len);
    memcpy(buf, &h, sizeof h);
}

int ps_wire_open(const void *buf, size_t len, ps_hdr *h, char **errptr)
{
    if (len < PS_HDR_BYTES)
        return cm_err(errptr, CM_ECORRUPT,
                      "message of %zu bytes is shorter than the %u-byte header", len, PS_HDR_BYTES);
    memcpy(h, buf, sizeof *h);
    if (h->magic != PS_MAGIC) return cm_err(errptr, CM_ECORRUPT, "bad magic 0x%08x", h->magic);
    if (h->version != PS_PROTOCOL_VERSION)
        return cm_err(errptr, CM_ECORRUPT, "protocol version %u, this side speaks %u", h->version,
                      PS_PROTOCOL_VERSION);
    if (h->op == 0 || h->op >= PS_OP_MAX_)
        return cm_err(errptr, CM_ECORRUPT, "unknown op %u", h->op);
    if (h->payload_len != len - PS_HDR_BYTES)
        return cm_err(errptr, CM_ECORRUPT, "payload length %llu but %zu bytes arrived",
                      (unsigned long long)h->payload_len, len - PS_HDR_BYTES);
    if (seal_hash(buf, len) != h->checksum)
        return cm_err(errptr, CM_ECORRUPT, "checksum mismatch (op %u, %zu bytes)", h->op, len);
    return CM_OK;
}

size_t ps_varint_put(uint8_t *out, uint64_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        out[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    out[n++] = (uint8_t)v;
    return n;
}

size_t ps_varint_get(const uint8_t *in, size_t len, uint64_t *v)
{
    uint64_t x = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* Eight bytes at once where the input has them and the varint ends inside them (every key
     * delta under 2^56): the bytes up to the first without a continuation bit, their 7-bit
     * groups packed together in three steps. A server decodes tens of thousands of keys a
     * pull; byte by byte this was ~7% of its CPU. The same values and lengths as the loop. */
    if (len >= 8) {
        uint64_t w;
        memcpy(&w, in, 8);
        uint64_t stop = ~w & 0x8080808080808080ull;
        if (stop != 0) {
            unsigned used = ((unsigned)__builtin_ctzll(stop) >> 3) + 1;
            if (used < 8) w &= (1ull << (8 * used)) - 1;
            w &= 0x7f7f7f7f7f7f7f7full;
            w = ((w & 0x7f007f007f007f00ull) >> 1) | (w & 0x007f007f007f007full);
            w = ((w & 0x3fff00003fff0000ull) >> 2) | (w & 0x00003fff00003fffull);
            w = ((w & 0x0fffffff00000000ull) >> 4) | (w & 0x000000000fffffffull);
            *v = w;
            return used;
        }
    }
#endif
    for (size_t i = 0; i < len && i < 10; i++) {
        uint64_t b = in[i] & 0x7f;
        if (i == 9 && b > 1) return 0; /* bits beyond 64 */
        x |= b << (7 * i);
        if ((in[i] & 0x80) == 0) {
            *v = x;
            return i + 1;
        }
    }
    return 0;
}

/* ps_varint_put for the keys' deltas, which may write all 8 bytes at out for a value under
 * 2^56 (the 7-bit groups spread to bytes in three steps, continuation bits on all but the
 * last): the encoder's output buffer has 10 bytes a key, so the spare bytes are overwritten by
 * the next key or ignored. The same bytes as ps_varint_put up to the length it returns. */
static inline size_t varint_put8(uint8_t *out, uint64_t v)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (v < (1ull << 56)) {
        size_t used = v ? ((size_t)(64 - __builtin_clzll(v)) + 6) / 7 : 1;
        uint64_t w = v;
        w = ((w & 0x00fffffff0000000ull) << 4) | (w & 0x000000000fffffffull);
        w = ((w & 0x0fffc0000fffc000ull) << 2) | (w & 0x00003fff00003fffull);
        w = ((w & 0x3f803f803f803f80ull) << 1) | (w & 0x007f007f007f007full);
        w |= ((1ull << (8 * (used - 1))) - 1) & 0x8080808080808080ull;
        memcpy(out, &w, 8);
        return used;
    }
#endif
    return ps_varint_put(out, v);
}

size_t ps_keys_encode(const uint64_t *keys, size_t n, uint8_t *out)
{
    size_t off = 0;
    uint64_t prev = 0;
    for (size_t i = 0; i < n; i++) {
        off += varint_put8(out + off, keys[i] - prev);
        prev = keys[i];
    }
    return off;
}

int ps_keys_decode(const uint8_t *in, size_t len, size_t n, uint64_t *keys, char **errptr)
{
    size_t off = 0;
    uint64_t prev = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t d;
        size_t used = ps_varint_get(in + off, len - off, &d);
        if (used == 0)
            return cm_err(errptr, CM_ECORRUPT, "key %zu of %zu: truncated or overlong varint", i,
                          n);
        if ((i > 0 && d == 0) || d > UINT64_MAX - prev)
            return cm_err(errptr, CM_ECORRUPT, "key %zu of %zu: keys not strictly increasing", i,
                          n);
        prev += d;
        keys[i] = prev;
        off += used;
    }
    if (off != len)
        return cm_err(errptr, CM_ECORRUPT, "%zu trailing bytes after %zu keys", len - off, n);
    return CM_OK;
}

uint64_t ps_keys_sum(const uint64_t *keys, size_t n)
{
    /* Both ends are little-endian (headers travel in native layout too). */
    return cm_xxh3(keys, n * sizeof *keys);
}

/* The smallest bf16 at or above a finite x >= 0: an int8 row quantised with a scale rounded up
 * never needs more than +-127. */
static uint16_t bf16_round_up(float x)
{
    uint32_t b;
    memcpy(&b, &x, 4);
    return (uint16_t)((b >> 16) + ((b & 0xffffu) != 0));
}

/* An int8 row: a 2-byte bf16 scale (about max|x|/127), then dim int8 values. The scale is bf16
 * rather than fp16 because gradients are small: fp16 goes subnormal below 6e-5 and to zero
 * below 6e-8, so rows of small gradients would lose their precision or vanish, while bf16 has
 * fp32's range. Values are quantised with the scale as decoded, so the 0.4% precision of a
 * bf16 only leaves part of the int8 range unused and error feedback sees the exact residual. */
static void int8_row_encode(const float *x, uint32_t dim, uint8_t *out, float *back)
{
    uint16_t sb = bf16_round_up(cm_absmax(x, dim) / 127.0f);
    float scale = cm_bf16_to_f32(sb);
    memcpy(out, &sb, 2);
    cm_int8_quantize(x, dim, scale, scale > 0.0f ? 1.0f / scale : 0.0f, out + 2, back);
}

void ps_codec_encode(ps_codec c, const float *src, size_t rows, uint32_t dim, uint8_t *dst,
                     float *back)
{
    size_t n = rows * dim;
    switch (c) {
    case PS_CODEC_F32:
        memcpy(dst, src, n * 4);
        if (back) memcpy(back, src, n * 4);
        break;
    case PS_CODEC_F16:
        cm_f32_to_f16_n(src, dst, n);
        if (back) cm_f16_to_f32_n(dst, back, n);
        break;
    case PS_CODEC_BF16:
        for (size_t i = 0; i < n; i++) {
            uint16_t v = cm_f32_to_bf16(src[i]);
            memcpy(dst + 2 * i, &v, 2);
            if (back) back[i] = cm_bf16_to_f32(v);
        }
        break;
    case PS_CODEC_INT8:
        for (size_t r = 0; r < rows; r++)
            int8_row_encode(src + r * dim, dim, dst + r * (2u + dim), back ? back + r * dim : NULL);
        break;
    }
}

/* The error of a first non-finite value at index i of n (none when i == n). */
static int f32_bad(size_t i, size_t n, uint32_t dim, char **errptr)
{
    if (i < n) return cm_err(errptr, CM_ECORRUPT, "row %zu: non-finite value", i / dim);
    return CM_OK;
}

bool ps_error_text(const uint8_t *p, size_t len, char *out, size_t cap)
{
    size_t n = 0;
    for (; n < len && n + 1 < cap && p[n] != 0; n++)
        out[n] = p[n] < 0x20 || p[n] == 0x7f ? '?' : (char)p[n];
    if (cap > 0) out[n] = '\0';
    return n < len && p[n] != 0;
}

int ps_f32_check(const float *x, size_t n, uint32_t dim, char **errptr)
{
    return f32_bad(cm_f32_first_nonfinite(x, n), n, dim, errptr);
}

int ps_codec_decode(ps_codec c, const uint8_t *src, size_t rows, uint32_t dim, float *dst,
                    char **errptr)
{
    size_t n = rows * dim;
    switch (c) {
    case PS_CODEC_F32: /* copied and checked in one pass */
        return f32_bad(cm_f32_copy_first_nonfinite(dst, src, n), n, dim, errptr);
    case PS_CODEC_F16:
        cm_f16_to_f32_n(src, dst, n);
        break;
    case PS_CODEC_BF16:
        for (size_t i = 0; i < n; i++) {
            uint16_t v;
            memcpy(&v, src + 2 * i, 2);
            dst[i] = cm_bf16_to_f32(v);
        }
        break;
    case PS_CODEC_INT8:
        for (size_t r = 0; r < rows; r++) {
            const uint8_t *in = src + r * (2u + dim);
            uint16_t sb;
            memcpy(&sb, in, 2);
            float scale = cm_bf16_to_f32(sb);
            if (!isfinite(scale) || (sb & 0x8000u))
                return cm_err(errptr, CM_ECORRUPT, "row %zu: bad int8 scale %g", r, (double)scale);
            cm_int8_dequantize(in + 2, dim, scale, dst + r * dim);
        }
        break; /* 127 times a huge finite scale is not finite: checked below */
    default:
        return cm_err(errptr, CM_ECORRUPT, "unknown codec %d", (int)c);
    }
    return ps_f32_check(dst, n, dim, errptr);
}

uint64_t ps_table_fingerprint(const ps_table_spec *t)
{
    const emb_table_config *c = &t->cfg;
    /* Only what both sides must agree on; storage settings are each shard's own business. */
    struct {
        char name[PS_NAME_MAX];
        uint32_t dim, opt, push, pull;
        float lr, l2, eps, b1, b2, ai, fb, fl1, init;
        uint64_t seed;
    } fp;
    memset(&fp, 0, sizeof fp);
    memcpy(fp.name, t->name, PS_NAME_MAX);
    fp.dim = c->dim;
    fp.opt = (uint32_t)c->opt;
    fp.push = (uint32_t)t->push_codec;
    fp.pull = (uint32_t)t->pull_codec;
    fp.lr = c->lr;
    fp.l2 = c->l2;
    fp.eps = c->eps;
    fp.b1 = c->beta1;
    fp.b2 = c->beta2;
    fp.ai = c->adagrad_init;
    fp.fb = c->ftrl_beta;
    fp.fl1 = c->ftrl_l1;
    fp.init = c->init_scale;
    fp.seed = c->seed;
    return XXH3_64bits(&fp, sizeof fp);
}

uint64_t ps_dense_fingerprint(const ps_dense_spec *d)
{
    struct {
        char name[PS_NAME_MAX];
        uint64_t size;
        uint32_t opt;
        float lr, b1, b2, eps;
    } fp;
    memset(&fp, 0, sizeof fp);
    memcpy(fp.name, d->name, PS_NAME_MAX);
    fp.size = d->size;
    fp.opt = (uint32_t)d->opt;
    fp.lr = d->lr;
    fp.b1 = d->beta1;
    fp.b2 = d->beta2;
    fp.eps = d->eps;
    return XXH3_64bits(&fp, sizeof fp);
}

uint8_t ps_op_flags(uint16_t op)
{
    switch (op) {
    case PS_OP_PULL:
        return PS_FLAG_LOOKUP;
    case PS_OP_PUSH:
        return PS_FLAG_ELIDED;
    case PS_OP_PUSH_DENSE:
        return PS_FLAG_READ_BACK | PS_FLAG_DIGEST;
    case PS_OP_PULL_DENSE:
        return PS_FLAG_STATE;
    case PS_OP_BARRIER:
        return PS_FLAG_STOP | PS_FLAG_POLL;
    default:
        return 0;
    }
}

int ps_rows_layout_get(const ps_hdr *h, const uint8_t *p, uint32_t dim, ps_rows_layout *out,
                       char *msg, size_t cap)
{
    memset(out, 0, sizeof *out);
    if (h->codec > PS_CODEC_INT8) {
        snprintf(msg, cap, "unknown codec %u", h->codec);
        return CM_EINVAL;
    }
    const size_t n = h->count, row_bytes = ps_codec_row_bytes((ps_codec)h->codec, dim);
    /* Every key takes at least one byte, so count is bounded by what arrived. */
    if (n == 0 || n > h->payload_len) {
        snprintf(msg, cap, "count %zu is zero or exceeds the %llu-byte payload", n,
                 (unsigned long long)h->payload_len);
        return CM_EINVAL;
    }
    size_t key_bytes = h->payload_len;
    const bool elided = h->op == PS_OP_PUSH && (h->flags & PS_FLAG_ELIDED);
    bool fits = true;
    if (elided) {
        fits = h->payload_len == PS_ELIDED_HEAD + (uint64_t)n * row_bytes;
        key_bytes = PS_ELIDED_HEAD;
    } else if (h->op == PS_OP_PUSH) {
        uint32_t kb = 0;
        fits = h->payload_len >= 4;
        if (fits) memcpy(&kb, p, 4);
        fits = fits && (uint64_t)kb + 4 + (uint64_t)n * row_bytes == h->payload_len;
        key_bytes = kb;
        p += 4;
    }
    if (!fits) {
        snprintf(msg, cap, "payload of %llu bytes does not match %zu rows of %s",
                 (unsigned long long)h->payload_len, n, ps_codec_name((ps_codec)h->codec));
        return CM_EINVAL;
    }
    *out = (ps_rows_layout){.n = n,
                            .row_bytes = row_bytes,
                            .key_bytes = key_bytes,
                            .keys_at = p,
                            .rows_at = p + key_bytes,
                            .elided = elided};
    return CM_OK;
}
