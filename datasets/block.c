/* The payload of a shard block (docs/SHARD_FORMAT.md, "Block payload"): labels and dense values
 * as they are, counts narrowed to the fewest bytes that hold them, and keys field by field,
 * each field either plain or as a dictionary of its distinct keys plus narrow indices.
 *
 * Why a dictionary: click-log fields repeat heavily within a block (on Criteo-like data about
 * 20% of a block's keys per field are distinct), and 64-bit hashed keys are what zstd spends
 * its time on. Deduplicating with one hash probe per key costs a few ns; letting zstd find the
 * same repeats costs about 18 ns per key at level 1, and the payload it has to scan shrinks
 * by half. The encoder keeps whichever of plain or dictionary is smaller for each field. */
#include <stdlib.h>
#include <string.h>

#include "datasets/ds_internal.h"

/* zstd level of the block frames: negative "fast" levels lose little on the dictionary payload
 * (indices and counts are the compressible part) and save compression time. */
#define ZSTD_LEVEL (-1)

static void put32(uint8_t *p, uint32_t v)
{
    memcpy(p, &v, 4);
}
static uint32_t get32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static uint64_t get64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* Bytes per value for numbers up to max: 1, 2 or 4. */
static unsigned width_for(uint64_t max)
{
    return max <= UINT8_MAX ? 1 : max <= UINT16_MAX ? 2 : 4;
}

/* Stores v[0..n) in w bytes each (little-endian); returns the end. */
static uint8_t *put_narrow(uint8_t *p, const uint32_t *v, size_t n, unsigned w)
{
    if (w == 1)
        for (size_t i = 0; i < n; i++)
            p[i] = (uint8_t)v[i];
    else if (w == 2)
        for (size_t i = 0; i < n; i++) {
            uint16_t x = (uint16_t)v[i];
            memcpy(p + 2 * i, &x, 2);
        }
    else
        memcpy(p, v, n * 4);
    return p + n * w;
}

static inline uint32_t get_narrow(const uint8_t *p, size_t i, unsigned w)
{
    if (w == 1) return p[i];
    if (w == 2) {
        uint16_t x;
        memcpy(&x, p + 2 * i, 2);
        return x;
    }
    return get32(p + 4 * i);
}

uint64_t ds_block_raw_max(uint32_t n_dense, uint32_t n_fields, int weights, uint64_t rows,
                          uint64_t keys)
{
    /* labels, dense, width byte, 4-byte counts, one encoding byte per field, keys never larger
     * than plain (a dictionary is only kept when it is smaller), weights */
    return rows * 4 * (1 + (uint64_t)n_dense) + 1 + rows * 4 * n_fields + n_fields + keys * 8 +
           (weights ? keys * 4 : 0);
}

int ds_benc_init(ds_benc *e)
{
    memset(e, 0, sizeof *e);
    e->cctx = ZSTD_createCCtx();
    if (e->cctx == NULL ||
        ZSTD_isError(ZSTD_CCtx_setParameter(e->cctx, ZSTD_c_compressionLevel, ZSTD_LEVEL))) {
        ds_benc_free(e);
        return CM_ENOMEM;
    }
    return CM_OK;
}

void ds_benc_free(ds_benc *e)
{
    ZSTD_freeCCtx(e->cctx);
    ds_buf_free(&e->raw);
    ds_buf_free(&e->tmp);
    for (uint32_t f = 0; e->fd && f < e->n_fd; f++)
        free(e->fd[f].slot);
    free(e->fd);
    memset(e, 0, sizeof *e);
}

/* One field's coding state within a block. The dictionary and the indices (or, once the field
 * turned plain, its keys) live in the field's own run of the scratch arrays. */
typedef struct fstate {
    uint64_t *dict; /* distinct keys in first-seen order; the plain keys when plain */
    uint32_t *idx;  /* dictionary index of each key */
    uint32_t *slot; /* open addressing: dictionary index + 1, 0 = empty */
    uint32_t mask, bits;
    uint32_t u, pos, m;
    int plain;
} fstate;

static inline size_t slot_of(uint64_t key, uint32_t bits)
{
    /* multiplicative hash: keys are usually xxh3 outputs, but a writer may be handed any */
    return (size_t)((key * 0x9e3779b97f4a7c15ull) >> (64 - bits));
}

/* Gives the field an empty table of 1 << bits slots (kept in fd between blocks). */
static int table_reset(ds_fdict *fd, fstate *s, uint32_t bits)
{
    size_t n = (size_t)1 << bits;
    if (n > fd->cap) {
        uint32_t *t = realloc(fd->slot, n * sizeof *t);
        if (t == NULL) return CM_ENOMEM;
        fd->slot = t;
        fd->cap = n;
    }
    memset(fd->slot, 0, n * sizeof *fd->slot);
    s->slot = fd->slot;
    s->bits = bits;
    s->mask = (uint32_t)(n - 1);
    return CM_OK;
}

/* Doubles the table and re-inserts the dictionary: tables start at the size the previous
 * block needed, so they stay small (in L1/L2) for fields with few distinct keys. */
static int table_grow(ds_fdict *fd, fstate *s)
{
    if (table_reset(fd, s, s->bits + 1) != CM_OK) return CM_ENOMEM;
    for (uint32_t i = 0; i < s->u; i++) {
        size_t h = slot_of(s->dict[i], s->bits);
        while (s->slot[h])
            h = (h + 1) & s->mask;
        s->slot[h] = i + 1;
    }
    return CM_OK;
}

/* The dictionary cannot be smaller than plain keys any more (u and its index width only grow):
 * turn the keys coded so far back into keys, in place. Going down is safe because key j's
 * index is at most j, so dict[j] is only needed by keys at j or later, already turned. */
static void to_plain(fstate *s)
{
    for (uint32_t j = s->pos; j-- > 0;)
        s->dict[j] = s->dict[s->idx[j]];
    s->plain = 1;
}

static inline int dict_loses(uint64_t u, uint64_t m)
{
    return 4 + 8 * u + width_for(u ? u - 1 : 0) * m >= 8 * m;
}

/* Adds one key to field state s; CM_ENOMEM when a table cannot grow. */
static inline int code_key(ds_fdict *fd, fstate *s, uint64_t key)
{
    if (s->plain) {
        s->dict[s->pos++] = key;
        return CM_OK;
    }
    size_t h = slot_of(key, s->bits);
    uint32_t v;
    while ((v = s->slot[h]) != 0 && s->dict[v - 1] != key)
        h = (h + 1) & s->mask;
    if (v == 0) {
        v = ++s->u;
        s->dict[v - 1] = key;
        s->slot[h] = v;
        if (dict_loses(s->u, s->m)) {
            s->idx[s->pos++] = v - 1;
            to_plain(s);
            return CM_OK;
        }
        if (2 * (size_t)s->u > (size_t)s->mask + 1 && table_grow(fd, s) != CM_OK) return CM_ENOMEM;
    }
    s->idx[s->pos++] = v - 1;
    return CM_OK;
}

int ds_block_encode(ds_benc *e, const ds_rows *r, size_t row0, size_t n, ds_buf *out,
                    ds_block_meta *meta, char **errptr)
{
    const uint32_t nd = r->n_dense, nf = r->n_fields;
    const uint32_t *o = r->offsets + row0 * nf;
    const uint32_t nk = o[n * nf] - o[0];
    const size_t nc = (size_t)n * nf;
    uint64_t max = ds_block_raw_max(nd, nf, r->has_weights, n, nk);
    if (max > UINT32_MAX) return cm_err(errptr, CM_EINVAL, "block of %zu rows too large", n);
    if (nf > e->n_fd) {
        ds_fdict *fd = realloc(e->fd, nf * sizeof *fd);
        if (fd == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
        memset(fd + e->n_fd, 0, (nf - e->n_fd) * sizeof *fd);
        e->fd = fd;
        e->n_fd = nf;
    }
    /* scratch: per field state, counts (u32), dictionaries or plain keys (u64, a run of m per
     * field), indices (u32), weights (f32), each field at its key start */
    size_t st_b = ((size_t)nf * sizeof(fstate) + 7) & ~(size_t)7;
    size_t cnt_b = (nc * 4 + 7) & ~(size_t)7;
    if (ds_buf_reserve(&e->raw, max) != CM_OK ||
        ds_buf_reserve(&e->tmp, st_b + cnt_b + (size_t)nk * (8 + 4 + 4) + 8) != CM_OK)
        return cm_err(errptr, CM_ENOMEM, "out of memory");
    fstate *st = (fstate *)e->tmp.p;
    uint32_t *cnt = (uint32_t *)(e->tmp.p + st_b);
    uint64_t *dict = (uint64_t *)(e->tmp.p + st_b + cnt_b);
    uint32_t *idx = (uint32_t *)(dict + nk);
    float *wfm = (float *)(idx + nk);

    uint8_t *p = e->raw.p;
    memcpy(p, r->labels + row0, n * 4);
    p += n * 4;
    memcpy(p, r->dense + row0 * nd, n * nd * 4);
    p += n * nd * 4;

    /* counts, row-major as the offsets are: one sequential pass that also sums each field */
    uint32_t any = 0;
    for (uint32_t f = 0; f < nf; f++)
        st[f].m = 0;
    for (size_t i = 0; i < n; i++)
        for (uint32_t f = 0; f < nf; f++) {
            uint32_t c = o[i * nf + f + 1] - o[i * nf + f];
            cnt[i * nf + f] = c;
            st[f].m += c;
            any |= c;
        }
    unsigned cw = width_for(any);
    *p++ = (uint8_t)cw;
    p = put_narrow(p, cnt, nc, cw);

    /* keys: one row-major pass, each key into its field's dictionary */
    uint32_t at = 0;
    for (uint32_t f = 0; f < nf; f++) {
        fstate *s = &st[f];
        s->dict = dict + at;
        s->idx = idx + at;
        s->u = s->pos = 0;
        s->plain = s->m == 0;
        at += s->m;
        if (s->plain) continue;
        /* start at twice what the previous block needed, at most twice m */
        uint32_t want = e->fd[f].hint < s->m ? e->fd[f].hint : s->m, bits = 6;
        while (((size_t)1 << bits) < 2 * (size_t)want)
            bits++;
        if (table_reset(&e->fd[f], s, bits) != CM_OK)
            return cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < n; i++)
        for (uint32_t f = 0; f < nf; f++) {
            uint32_t k = o[i * nf + f], k1 = o[i * nf + f + 1];
            if (k == k1) continue;
            fstate *s = &st[f];
            for (; k < k1; k++) {
                if (r->has_weights) wfm[s->dict - dict + s->pos] = r->weights[k];
                if (code_key(&e->fd[f], s, r->keys[k]) != CM_OK)
                    return cm_err(errptr, CM_ENOMEM, "out of memory");
            }
        }
    for (uint32_t f = 0; f < nf; f++) {
        fstate *s = &st[f];
        e->fd[f].hint = s->plain ? s->m : s->u;
        if (s->plain) {
            *p++ = 0;
            memcpy(p, s->dict, (size_t)s->m * 8);
            p += (size_t)s->m * 8;
        } else {
            unsigned w = width_for(s->u - 1);
            *p++ = (uint8_t)w;
            put32(p, s->u);
            memcpy(p + 4, s->dict, (size_t)s->u * 8);
            p = put_narrow(p + 4 + (size_t)s->u * 8, s->idx, s->m, w);
        }
        if (r->has_weights) {
            memcpy(p, wfm + (s->dict - dict), (size_t)s->m * 4);
            p += (size_t)s->m * 4;
        }
    }
    size_t raw = (size_t)(p - e->raw.p);

    size_t bound = ZSTD_compressBound(raw);
    if (ds_buf_reserve(out, out->len + DS_BLOCK_HDR + bound) != CM_OK)
        return cm_err(errptr, CM_ENOMEM, "out of memory");
    uint8_t *h = out->p + out->len;
    size_t cs = ZSTD_compress2(e->cctx, h + DS_BLOCK_HDR, bound, e->raw.p, raw);
    if (ZSTD_isError(cs))
        return cm_err(errptr, CM_ERR, "zstd compression failed: %s", ZSTD_getErrorName(cs));
    *meta = (ds_block_meta){
        .n_rows = (uint32_t)n, .n_keys = nk, .raw_len = (uint32_t)raw, .comp_len = (uint32_t)cs};
    put32(h, meta->n_rows);
    put32(h + 4, meta->n_keys);
    put32(h + 8, meta->raw_len);
    put32(h + 12, meta->comp_len);
    meta->checksum = cm_xxh3(h, DS_BLOCK_HDR + cs);
    out->len += DS_BLOCK_HDR + cs;
    return CM_OK;
}

/* ---- decoding ---- */

#define NEED(nbytes)                                                                               \
    do {                                                                                           \
        if ((uint64_t)(end - p) < (uint64_t)(nbytes))                                              \
            return cm_err(errptr, CM_ECORRUPT, "payload shorter than its contents");               \
    } while (0)

int ds_block_decode(const uint8_t *p, size_t len, uint32_t n, uint32_t n_keys, ds_rows *dst,
                    char **errptr)
{
    const uint8_t *end = p + len;
    const uint32_t nd = dst->n_dense, nf = dst->n_fields;
    const size_t row0 = dst->n_rows;
    const uint64_t kbase = dst->n_keys, kend = kbase + n_keys;
    NEED((uint64_t)n * 4 * (1 + (uint64_t)nd) + 1);
    memcpy(dst->labels + row0, p, (size_t)n * 4);
    p += (size_t)n * 4;
    memcpy(dst->dense + row0 * nd, p, (size_t)n * nd * 4);
    p += (size_t)n * nd * 4;
    unsigned cw = *p++;
    if (cw != 1 && cw != 2 && cw != 4) return cm_err(errptr, CM_ECORRUPT, "bad count width %u", cw);
    NEED((uint64_t)n * nf * cw);
    const uint8_t *cp = p;
    p += (size_t)n * nf * cw;
    uint32_t *o = dst->offsets + row0 * nf;
    uint64_t at = kbase;
    for (size_t i = 0; i < n; i++)
        for (uint32_t f = 0; f < nf; f++) {
            at += get_narrow(cp, i * nf + f, cw);
            if (at > kend) return cm_err(errptr, CM_ECORRUPT, "key counts overrun");
            o[i * nf + f + 1] = (uint32_t)at;
        }
    if (at != kend) return cm_err(errptr, CM_ECORRUPT, "key counts disagree");
    for (uint32_t f = 0; f < nf; f++) {
        uint64_t m = 0;
        for (size_t i = 0; i < n; i++)
            m += o[i * nf + f + 1] - o[i * nf + f];
        NEED(1);
        unsigned w = *p++;
        const uint8_t *dict = NULL, *ks;
        uint32_t u = 0;
        if (w == 0) {
            NEED(m * 8);
            ks = p;
            p += m * 8;
        } else if (w == 1 || w == 2 || w == 4) {
            NEED(4);
            u = get32(p);
            p += 4;
            if (u == 0 || u > m || width_for(u - 1) != w)
                return cm_err(errptr, CM_ECORRUPT, "field %u: bad dictionary size", f);
            NEED((uint64_t)u * 8 + m * w);
            dict = p;
            ks = p + (size_t)u * 8;
            p += (size_t)u * 8 + m * w;
        } else {
            return cm_err(errptr, CM_ECORRUPT, "field %u: bad key encoding %u", f, w);
        }
        const uint8_t *ws = NULL;
        if (dst->has_weights) {
            NEED(m * 4);
            ws = p;
            p += m * 4;
        }
        size_t j = 0;
        for (size_t i = 0; i < n; i++) {
            for (uint32_t k = o[i * nf + f]; k < o[i * nf + f + 1]; k++, j++) {
                if (dict) {
                    uint32_t x = get_narrow(ks, j, w);
                    if (x >= u)
                        return cm_err(errptr, CM_ECORRUPT, "field %u: index out of range", f);
                    dst->keys[k] = get64(dict + (size_t)x * 8);
                } else {
                    dst->keys[k] = get64(ks + j * 8);
                }
                if (ws) memcpy(&dst->weights[k], ws + j * 4, 4);
            }
        }
    }
    if (p != end) return cm_err(errptr, CM_ECORRUPT, "payload longer than its contents");
    dst->n_rows += n;
    dst->n_keys = kend;
    return CM_OK;
}
