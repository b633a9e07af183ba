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

/* zstd parameters of the block frames (any parameters give the same format; the reader does
 * not care). A negative "fast" level loses little on the dictionary payload (indices, counts
 * and dense values are the compressible part; dictionary keys are random). On top of level -2:
 * matches of at least 7 bytes (shorter ones are mostly chance hits in the float and index
 * columns and cost a probe each) and a 4096-entry hash table (16 KB, stays in L1). Measured on
 * 14 blocks of Criteo payload: 20% less zstd CPU than plain level -1, payload ratio 0.634
 * instead of 0.612 (shards ~3.5% larger). */
#define ZSTD_LEVEL (-2)
#define ZSTD_MIN_MATCH 7
#define ZSTD_HASH_LOG 12

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
        ZSTD_isError(ZSTD_CCtx_setParameter(e->cctx, ZSTD_c_compressionLevel, ZSTD_LEVEL)) ||
        ZSTD_isError(ZSTD_CCtx_setParameter(e->cctx, ZSTD_c_minMatch, ZSTD_MIN_MATCH)) ||
        ZSTD_isError(ZSTD_CCtx_setParameter(e->cctx, ZSTD_c_hashLog, ZSTD_HASH_LOG))) {
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

/* One field's dictionary while it is built: the table is open addressing over the field's
 * distinct keys, each slot (high 32 bits of the key) << 32 | (dictionary index + 1), 0 = empty.
 * The tag settles nearly every probe without a load from the dictionary itself. */
typedef struct fdict {
    uint64_t *slot;
    uint32_t mask, bits;
} fdict;

static inline size_t slot_of(uint64_t key, uint32_t bits)
{
    /* multiplicative hash: keys are usually xxh3 outputs, but a writer may be handed any */
    return (size_t)((key * 0x9e3779b97f4a7c15ull) >> (64 - bits));
}

/* Gives the field an empty table of 1 << bits slots (kept in fd between blocks). */
static int table_reset(ds_fdict *fd, fdict *t, uint32_t bits)
{
    size_t n = (size_t)1 << bits;
    if (n > fd->cap) {
        uint64_t *sl = realloc(fd->slot, n * sizeof *sl);
        if (sl == NULL) return CM_ENOMEM;
        fd->slot = sl;
        fd->cap = n;
    }
    memset(fd->slot, 0, n * sizeof *fd->slot);
    t->slot = fd->slot;
    t->bits = bits;
    t->mask = (uint32_t)(n - 1);
    return CM_OK;
}

static inline void table_put(fdict *t, uint64_t key, uint32_t v)
{
    size_t h = slot_of(key, t->bits);
    while (t->slot[h])
        h = (h + 1) & t->mask;
    t->slot[h] = (key >> 32) << 32 | v;
}

/* Doubles the table and re-inserts the dictionary: tables start at the size the previous
 * block needed, so they stay small (in L1/L2) for fields with few distinct keys. */
static int table_grow(ds_fdict *fd, fdict *t, const uint64_t *dict, uint32_t u)
{
    if (table_reset(fd, t, t->bits + 1) != CM_OK) return CM_ENOMEM;
    for (uint32_t i = 0; i < u; i++)
        table_put(t, dict[i], i + 1);
    return CM_OK;
}

static inline int dict_loses(uint64_t u, uint64_t m)
{
    return 4 + 8 * u + width_for(u ? u - 1 : 0) * m >= 8 * m;
}

/* Dictionary-codes the m keys of one field (keys, contiguous): distinct keys into dict in
 * first-seen order, each key's index into idx. Returns the dictionary size, or 0 when the
 * dictionary cannot be smaller than the plain keys (u and its index width only grow with
 * more keys, so the first time it loses it loses for good), or -1 without memory.
 * One field at a time keeps that field's table in cache; the next keys' slots are prefetched
 * because the table is usually larger than L1. */
#define PREFETCH_KEYS 8
static int64_t code_field(ds_fdict *fd, const uint64_t *keys, uint32_t m, uint64_t *dict,
                          uint32_t *idx)
{
    /* start at twice what the previous block needed, at most twice m */
    uint32_t want = fd->hint < m ? fd->hint : m, bits = 6;
    while (((size_t)1 << bits) < 2 * (size_t)want)
        bits++;
    fdict t;
    if (table_reset(fd, &t, bits) != CM_OK) return -1;
    uint32_t u = 0;
    for (uint32_t j = 0; j < m; j++) {
        if (j + PREFETCH_KEYS < m)
            __builtin_prefetch(&t.slot[slot_of(keys[j + PREFETCH_KEYS], t.bits)]);
        uint64_t key = keys[j], tag = key >> 32 << 32, e;
        size_t h = slot_of(key, t.bits);
        while ((e = t.slot[h]) != 0 &&
               ((e & ~(uint64_t)UINT32_MAX) != tag || dict[(uint32_t)e - 1] != key))
            h = (h + 1) & t.mask;
        if (e == 0) {
            dict[u++] = key;
            t.slot[h] = tag | u;
            if (dict_loses(u, m)) return 0;
            if (2 * (size_t)u > (size_t)t.mask + 1 && table_grow(fd, &t, dict, u) != CM_OK)
                return -1;
            e = u;
        }
        idx[j] = (uint32_t)e - 1;
    }
    return u;
}

int ds_block_encode(ds_benc *e, const ds_rows *r, size_t row0, size_t n, ds_stats *stats,
                    ds_buf *out, ds_block_meta *meta, char **errptr)
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
    /* The keys are gathered field by field (row order within a field), so that each field is
     * then coded in one pass with only its own table in cache. When no (row, field) has more
     * than one key (Criteo, Avazu) the gathering rides along with the counts pass, field f
     * at f * (n + 1): the spare slot takes the store of a row without a key, which is made
     * anyway to save a branch. A count above one sends the keys through a second pass. */
    const int one_pass = !r->has_weights && nk > 0;
    size_t gath_n = one_pass && (size_t)nf * (n + 1) > nk ? (size_t)nf * (n + 1) : nk;
    /* scratch: per field key count, fill position, rows without a key and where its gathered
     * keys start, counts (u32), then the gathered keys (u64), and per key a dictionary run
     * (u64), indices (u32), weights (f32), field f's runs at the field's first key */
    size_t st_b = ((size_t)nf * 4 * sizeof(uint32_t) + 7) & ~(size_t)7;
    size_t cnt_b = (nc * 4 + 7) & ~(size_t)7;
    if (ds_buf_reserve(&e->raw, max) != CM_OK ||
        ds_buf_reserve(&e->tmp, st_b + cnt_b + gath_n * 8 + (size_t)nk * (8 + 4 + 4) + 8) != CM_OK)
        return cm_err(errptr, CM_ENOMEM, "out of memory");
    uint32_t *fm = (uint32_t *)e->tmp.p, *fill = fm + nf, *fmiss = fill + nf, *gat = fmiss + nf;
    uint32_t *cnt = (uint32_t *)(e->tmp.p + st_b);
    uint64_t *gath = (uint64_t *)(e->tmp.p + st_b + cnt_b);
    uint64_t *dict = gath + gath_n;
    uint32_t *idx = (uint32_t *)(dict + nk);
    float *wfm = (float *)(idx + nk);

    uint8_t *p = e->raw.p;
    memcpy(p, r->labels + row0, n * 4);
    p += n * 4;
    memcpy(p, r->dense + row0 * nd, n * nd * 4);
    p += n * nd * 4;

    /* counts, row-major as the offsets are: one sequential pass that also sums each field.
     * In the one-pass loop the OR of the counts is kept per row, in a register (one
     * accumulator for the block was spilled, and its store-to-load chain paced the loop), and
     * rows without a key are not counted: with at most one key a row, they are the rows the
     * field's sum leaves out; otherwise a second pass over the counts finds them. */
    uint32_t any = 0;
    memset(fm, 0, nf * sizeof *fm);
    memset(fmiss, 0, nf * sizeof *fmiss);
    if (one_pass) {
        const uint64_t *keys = r->keys;
        const uint32_t klast = o[n * nf] - 1; /* reads of a row without a key stay in range */
        for (size_t i = 0; i < n; i++) {
            const uint32_t *oi = o + i * nf;
            uint32_t *ci = cnt + i * nf, row_any = 0;
            uint64_t *gf = gath;
            for (uint32_t f = 0; f < nf; f++, gf += n + 1) {
                uint32_t k = oi[f], c = oi[f + 1] - k;
                ci[f] = c;
                gf[fm[f] < n ? fm[f] : n] = keys[k < klast ? k : klast];
                fm[f] += c;
                row_any |= c;
            }
            any |= row_any;
        }
        if (any <= 1)
            for (uint32_t f = 0; f < nf; f++)
                fmiss[f] = (uint32_t)n - fm[f];
        else
            for (size_t i = 0; i < n; i++)
                for (uint32_t f = 0; f < nf; f++)
                    fmiss[f] += cnt[i * nf + f] == 0;
    } else {
        for (size_t i = 0; i < n; i++)
            for (uint32_t f = 0; f < nf; f++) {
                uint32_t c = o[i * nf + f + 1] - o[i * nf + f];
                cnt[i * nf + f] = c;
                fm[f] += c;
                fmiss[f] += c == 0;
                any |= c;
            }
    }
    unsigned cw = width_for(any);
    *p++ = (uint8_t)cw;
    p = put_narrow(p, cnt, nc, cw);

    if (one_pass && any <= 1) {
        for (uint32_t f = 0; f < nf; f++)
            gat[f] = f * (uint32_t)(n + 1);
    } else {
        for (uint32_t f = 0, at = 0; f < nf; f++) {
            gat[f] = fill[f] = at;
            at += fm[f];
        }
        for (size_t i = 0; i < n; i++)
            for (uint32_t f = 0; f < nf; f++)
                for (uint32_t k = o[i * nf + f], k1 = o[i * nf + f + 1]; k < k1; k++) {
                    if (r->has_weights) wfm[fill[f]] = r->weights[k];
                    gath[fill[f]++] = r->keys[k];
                }
    }
    for (uint32_t f = 0, at = 0; f < nf; f++) {
        uint32_t m = fm[f];
        /* statistics here, not per parsed row: the field's HLL registers stay in L1 */
        const uint64_t *g = gath + gat[f];
        int64_t u = m ? code_field(&e->fd[f], g, m, dict + at, idx + at) : 0;
        if (u < 0) return cm_err(errptr, CM_ENOMEM, "out of memory");
        /* HyperLogLog registers only keep maxima, so the distinct keys give the same
         * registers as all of them: ~4x fewer updates on Criteo-like data */
        if (stats) ds_stats_add_field(stats, f, u ? dict + at : g, u ? (size_t)u : m, fmiss[f]);
        e->fd[f].hint = u ? (uint32_t)u : m;
        if (u == 0) {
            *p++ = 0;
            memcpy(p, g, (size_t)m * 8);
            p += (size_t)m * 8;
        } else {
            unsigned w = width_for((uint64_t)u - 1);
            *p++ = (uint8_t)w;
            put32(p, (uint32_t)u);
            memcpy(p + 4, dict + at, (size_t)u * 8);
            p = put_narrow(p + 4 + (size_t)u * 8, idx + at, m, w);
        }
        if (r->has_weights) {
            memcpy(p, wfm + at, (size_t)m * 4);
            p += (size_t)m * 4;
        }
        at += m;
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
