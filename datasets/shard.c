/* Shard files (docs/SHARD_FORMAT.md): header with schema, zstd blocks, checksummed index
 * footer, fixed trailer. Every byte is covered by a checksum or a cross-check. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "datasets/ds_internal.h"

#define SHARD_MAGIC "EMBSHARD"
#define SHARD_END "EMBSHEND"
/* 2: dictionary-coded block payloads (block.c); version 1 stored counts and keys plainly */
#define SHARD_VERSION 2u
#define HDR_FIXED 32u
#define FOOTER_FIXED 24u
#define INDEX_ENTRY 32u
#define TRAILER 32u
#define FLAG_LABEL 1u
#define FLAG_WEIGHTS 2u

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static uint16_t get16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* ---- writer ---- */

struct ds_shard_writer {
    cm_afile f; /* the temporary file; direct I/O when created staged */
    ds_plan *plan;
    uint32_t block_rows;
    ds_block_meta *idx;
    uint32_t n_blocks, cap_blocks;
    uint64_t rows, keys;
    ds_rows pending;
    ds_benc benc; /* set up on the first block */
    ds_buf enc;
};

static void writer_free(ds_shard_writer *w)
{
    ds_plan_destroy(w->plan);
    free(w->idx);
    ds_rows_free(&w->pending);
    ds_benc_free(&w->benc);
    ds_buf_free(&w->enc);
    free(w);
}

int ds_shard_writer_create(const char *path, const ds_schema *schema, uint32_t block_rows,
                           ds_shard_writer **out, char **errptr)
{
    return ds_shard_writer_create_staged(path, schema, block_rows, 0, out, errptr);
}

int ds_shard_writer_create_staged(const char *path, const ds_schema *schema, uint32_t block_rows,
                                  size_t stage, ds_shard_writer **out, char **errptr)
{
    ds_buf hdr = {0};
    int rc = CM_OK;
    ds_shard_writer *w = calloc(1, sizeof *w);
    if (w == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    w->f.fd = -1;
    w->block_rows = block_rows ? block_rows : DS_DEFAULT_BLOCK_ROWS;
    w->plan = ds_plan_from_schema(schema);
    if (w->plan == NULL || ds_buf_reserve(&hdr, HDR_FIXED) != CM_OK) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        goto out;
    }
    ds_rows_init(&w->pending, schema->n_dense, schema->n_fields, schema->has_weights);
    uint8_t fixed[HDR_FIXED];
    memcpy(fixed, SHARD_MAGIC, 8);
    put32(fixed + 8, SHARD_VERSION);
    put32(fixed + 16, schema->n_dense);
    put32(fixed + 20, schema->n_fields);
    put32(fixed + 24, (schema->has_label ? FLAG_LABEL : 0) | (schema->has_weights ? FLAG_WEIGHTS : 0));
    put32(fixed + 28, w->block_rows);
    ds_buf_append(&hdr, fixed, HDR_FIXED);
    for (uint32_t i = 0; i < schema->n_dense + schema->n_fields; i++) {
        const char *n = w->plan->names[i];
        size_t len = strlen(n);
        if (len > UINT16_MAX) {
            rc = cm_err(errptr, CM_EINVAL, "field name longer than 65535 bytes");
            goto out;
        }
        uint16_t l16 = (uint16_t)len;
        if (ds_buf_append(&hdr, &l16, 2) || ds_buf_append(&hdr, n, len)) {
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
            goto out;
        }
    }
    put32(hdr.p + 12, (uint32_t)(hdr.len + 8));
    uint64_t sum = cm_xxh3(hdr.p, hdr.len);
    if (ds_buf_append(&hdr, &sum, 8) != CM_OK) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        goto out;
    }
    if ((rc = cm_afile_open_direct(&w->f, path, stage, errptr)) != CM_OK) goto out;
    if ((rc = cm_afile_write(&w->f, hdr.p, hdr.len, errptr)) != CM_OK) cm_afile_abort(&w->f);
out:
    ds_buf_free(&hdr);
    if (rc != CM_OK) {
        writer_free(w);
        return rc;
    }
    *out = w;
    return CM_OK;
}

int ds_shard_writer_add_encoded(ds_shard_writer *w, const uint8_t *bytes,
                                const ds_block_meta *meta, char **errptr)
{
    if (w->n_blocks == w->cap_blocks) {
        uint32_t c = w->cap_blocks ? w->cap_blocks * 2 : 64;
        ds_block_meta *idx = realloc(w->idx, c * sizeof *idx);
        if (idx == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
        w->idx = idx;
        w->cap_blocks = c;
    }
    ds_block_meta m = *meta;
    m.offset = cm_afile_size(&w->f);
    int rc = cm_afile_write(&w->f, bytes, DS_BLOCK_HDR + m.comp_len, errptr);
    if (rc != CM_OK) return rc;
    w->idx[w->n_blocks++] = m;
    w->rows += m.n_rows;
    w->keys += m.n_keys;
    return CM_OK;
}

uint64_t ds_shard_writer_bytes(const ds_shard_writer *w)
{
    return cm_afile_size(&w->f);
}

static int writer_flush(ds_shard_writer *w, char **errptr)
{
    if (w->pending.n_rows == 0) return CM_OK;
    if (w->benc.cctx == NULL && ds_benc_init(&w->benc) != CM_OK)
        return cm_err(errptr, CM_ENOMEM, "out of memory");
    ds_block_meta m;
    w->enc.len = 0;
    int rc =
        ds_block_encode(&w->benc, &w->pending, 0, w->pending.n_rows, NULL, &w->enc, &m, errptr);
    if (rc == CM_OK) rc = ds_shard_writer_add_encoded(w, w->enc.p, &m, errptr);
    ds_rows_clear(&w->pending);
    return rc;
}

int ds_shard_writer_append(ds_shard_writer *w, const ds_batch *b, char **errptr)
{
    const ds_schema *s = &w->plan->schema;
    if (b->n_dense != s->n_dense || b->n_fields != s->n_fields ||
        (s->has_weights && b->n_keys && b->weights == NULL))
        return cm_err(errptr, CM_EINVAL, "batch layout does not match the shard schema");
    for (uint32_t i = 0; i < b->n_rows; i++) {
        if (ds_rows_append_row(&w->pending, b, i) != CM_OK)
            return cm_err(errptr, CM_ENOMEM, "out of memory");
        if (w->pending.n_rows >= w->block_rows) {
            int rc = writer_flush(w, errptr);
            if (rc != CM_OK) return rc;
        }
    }
    return CM_OK;
}

int ds_shard_writer_commit(ds_shard_writer *w, char **errptr)
{
    ds_buf foot = {0};
    int rc = writer_flush(w, errptr);
    if (rc != CM_OK) goto out;
    size_t flen = FOOTER_FIXED + (size_t)w->n_blocks * INDEX_ENTRY;
    if (ds_buf_reserve(&foot, flen + TRAILER) != CM_OK) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        goto out;
    }
    uint8_t *p = foot.p;
    put32(p, w->n_blocks);
    put32(p + 4, 0);
    put64(p + 8, w->rows);
    put64(p + 16, w->keys);
    p += FOOTER_FIXED;
    for (uint32_t b = 0; b < w->n_blocks; b++, p += INDEX_ENTRY) {
        const ds_block_meta *m = &w->idx[b];
        put64(p, m->offset);
        put32(p + 8, m->n_rows);
        put32(p + 12, m->n_keys);
        put32(p + 16, m->raw_len);
        put32(p + 20, m->comp_len);
        put64(p + 24, m->checksum);
    }
    put64(p, cm_afile_size(&w->f));
    put64(p + 8, flen);
    put64(p + 16, cm_xxh3(foot.p, flen));
    memcpy(p + 24, SHARD_END, 8);
    if ((rc = cm_afile_write(&w->f, foot.p, flen + TRAILER, errptr)) != CM_OK) goto out;
    rc = cm_afile_commit(&w->f, errptr);
    w->f.fd = -1;
out:
    if (w->f.fd >= 0) cm_afile_abort(&w->f);
    ds_buf_free(&foot);
    writer_free(w);
    return rc;
}

void ds_shard_writer_abort(ds_shard_writer *w)
{
    if (w == NULL) return;
    cm_afile_abort(&w->f);
    writer_free(w);
}

/* ---- reading ---- */

static int pread_full(int fd, void *buf, size_t n, uint64_t off)
{
    uint8_t *p = buf;
    while (n > 0) {
        ssize_t r = pread(fd, p, n, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return CM_EIO;
        if (r == 0) return CM_ECORRUPT; /* file shorter than its index says */
        p += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return CM_OK;
}

static int read_at(const ds_shard_file *f, void *buf, size_t n, uint64_t off, const char *what,
                   char **errptr)
{
    int rc = pread_full(f->fd, buf, n, off);
    if (rc == CM_EIO) return cm_err_errno(errptr, rc, "shard %s: cannot read %s", f->path, what);
    if (rc != CM_OK)
        return cm_err(errptr, rc, "shard %s: truncated while reading %s", f->path, what);
    return CM_OK;
}

static int parse_header(ds_shard_file *f, const uint8_t *h, uint32_t hlen, char **errptr)
{
    uint32_t nd = get32(h + 16), nf = get32(h + 20), flags = get32(h + 24);
    f->block_rows = get32(h + 28);
    if (cm_xxh3(h, hlen - 8) != get64(h + hlen - 8))
        return cm_err(errptr, CM_ECORRUPT, "shard %s: header checksum mismatch", f->path);
    if ((uint64_t)nd + nf > (hlen - HDR_FIXED - 8) / 2 || f->block_rows == 0 || flags > 3)
        return cm_err(errptr, CM_ECORRUPT, "shard %s: header fields out of range", f->path);
    char **names = calloc((size_t)nd + nf + 1, sizeof *names);
    int rc = names ? CM_OK : cm_err(errptr, CM_ENOMEM, "out of memory");
    size_t pos = HDR_FIXED;
    for (uint32_t i = 0; rc == CM_OK && i < nd + nf; i++) {
        uint16_t len = pos + 2 <= hlen - 8 ? get16(h + pos) : UINT16_MAX;
        if (pos + 2 + len > hlen - 8) {
            rc = cm_err(errptr, CM_ECORRUPT, "shard %s: header names overrun", f->path);
            break;
        }
        if ((names[i] = strndup((const char *)h + pos + 2, len)) == NULL)
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        pos += 2 + (size_t)len;
    }
    if (rc == CM_OK && pos != hlen - 8)
        rc = cm_err(errptr, CM_ECORRUPT, "shard %s: header length mismatch", f->path);
    if (rc == CM_OK) {
        ds_schema s = {.n_dense = nd,
                       .n_fields = nf,
                       .has_label = (flags & FLAG_LABEL) != 0,
                       .has_weights = (flags & FLAG_WEIGHTS) != 0,
                       .dense_names = (const char *const *)names,
                       .field_names = (const char *const *)names + nd};
        if ((f->plan = ds_plan_from_schema(&s)) == NULL)
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    for (uint32_t i = 0; names && i < nd + nf; i++) free(names[i]);
    free(names);
    return rc;
}

static int parse_footer(ds_shard_file *f, const uint8_t *ft, uint64_t flen, uint64_t hlen,
                        uint64_t foot_off, char **errptr)
{
    const ds_schema *s = &f->plan->schema;
    f->n_blocks = get32(ft);
    f->rows = get64(ft + 8);
    f->keys = get64(ft + 16);
    if (flen != FOOTER_FIXED + (uint64_t)f->n_blocks * INDEX_ENTRY)
        return cm_err(errptr, CM_ECORRUPT, "shard %s: index size mismatch", f->path);
    f->idx = calloc((size_t)f->n_blocks + 1, sizeof *f->idx);
    if (f->idx == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    uint64_t off = hlen, rows = 0, keys = 0;
    for (uint32_t b = 0; b < f->n_blocks; b++) {
        const uint8_t *p = ft + FOOTER_FIXED + (size_t)b * INDEX_ENTRY;
        ds_block_meta *m = &f->idx[b];
        *m = (ds_block_meta){.offset = get64(p),
                             .n_rows = get32(p + 8),
                             .n_keys = get32(p + 12),
                             .raw_len = get32(p + 16),
                             .comp_len = get32(p + 20),
                             .checksum = get64(p + 24)};
        if (m->offset != off || m->n_rows == 0 || m->n_rows > f->block_rows ||
            m->raw_len > ds_block_raw_max(s->n_dense, s->n_fields, s->has_weights, m->n_rows,
                                          m->n_keys))
            return cm_err(errptr, CM_ECORRUPT, "shard %s: index entry of block %u is invalid",
                          f->path, b);
        off += DS_BLOCK_HDR + (uint64_t)m->comp_len;
        rows += m->n_rows;
        keys += m->n_keys;
    }
    if (off != foot_off || rows != f->rows || keys != f->keys)
        return cm_err(errptr, CM_ECORRUPT, "shard %s: index does not cover the file", f->path);
    return CM_OK;
}

int ds_shard_file_open(const char *path, ds_shard_file *f, char **errptr)
{
    uint8_t *hdr = NULL, *foot = NULL;
    uint8_t fixed[HDR_FIXED], tr[TRAILER];
    struct stat st;
    int rc = CM_OK;
    memset(f, 0, sizeof *f);
    f->fd = -1;
    if ((f->path = strdup(path)) == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    f->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (f->fd < 0) {
        rc = cm_err_errno(errptr, errno == ENOENT ? CM_ENOTFOUND : CM_EIO,
                          "cannot open shard %s", path);
        goto out;
    }
    if (fstat(f->fd, &st) != 0) {
        rc = cm_err_errno(errptr, CM_EIO, "cannot stat shard %s", path);
        goto out;
    }
    uint64_t size = (uint64_t)st.st_size;
    if (size < HDR_FIXED + 8 + FOOTER_FIXED + TRAILER) {
        rc = cm_err(errptr, CM_ECORRUPT, "shard %s: %llu bytes, too short (truncated?)", path,
                    (unsigned long long)size);
        goto out;
    }
    if ((rc = read_at(f, fixed, HDR_FIXED, 0, "header", errptr)) != CM_OK) goto out;
    if (memcmp(fixed, SHARD_MAGIC, 8) != 0) {
        rc = cm_err(errptr, CM_ECORRUPT, "shard %s: bad magic, not an ember shard", path);
        goto out;
    }
    if (get32(fixed + 8) != SHARD_VERSION) {
        rc = cm_err(errptr, CM_ECORRUPT,
                    "shard %s: format version %u, this build reads version %u only (ingest the "
                    "input again)",
                    path, get32(fixed + 8), SHARD_VERSION);
        goto out;
    }
    uint32_t hlen = get32(fixed + 12);
    if (hlen < HDR_FIXED + 8 || hlen > size - FOOTER_FIXED - TRAILER) {
        rc = cm_err(errptr, CM_ECORRUPT, "shard %s: header length out of range", path);
        goto out;
    }
    if ((hdr = malloc(hlen)) == NULL) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        goto out;
    }
    if ((rc = read_at(f, hdr, hlen, 0, "header", errptr)) != CM_OK) goto out;
    if ((rc = parse_header(f, hdr, hlen, errptr)) != CM_OK) goto out;
    if ((rc = read_at(f, tr, TRAILER, size - TRAILER, "trailer", errptr)) != CM_OK) goto out;
    uint64_t foot_off = get64(tr), flen = get64(tr + 8);
    if (memcmp(tr + 24, SHARD_END, 8) != 0 || foot_off < hlen || flen < FOOTER_FIXED ||
        flen > size || foot_off + flen + TRAILER != size) {
        rc = cm_err(errptr, CM_ECORRUPT, "shard %s: bad trailer (truncated or not finished)",
                    path);
        goto out;
    }
    if ((foot = malloc(flen)) == NULL) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        goto out;
    }
    if ((rc = read_at(f, foot, flen, foot_off, "index", errptr)) != CM_OK) goto out;
    if (cm_xxh3(foot, flen) != get64(tr + 16)) {
        rc = cm_err(errptr, CM_ECORRUPT, "shard %s: index checksum mismatch", path);
        goto out;
    }
    rc = parse_footer(f, foot, flen, hlen, foot_off, errptr);
out:
    free(hdr);
    free(foot);
    if (rc != CM_OK) ds_shard_file_close(f);
    return rc;
}

void ds_shard_file_close(ds_shard_file *f)
{
    if (f->fd >= 0) close(f->fd);
    free(f->path);
    ds_plan_destroy(f->plan);
    free(f->idx);
    memset(f, 0, sizeof *f);
    f->fd = -1;
}

int ds_shard_file_read_block(const ds_shard_file *f, uint32_t b, ZSTD_DCtx *dctx, ds_buf *cbuf,
                             ds_buf *raw, ds_rows *dst, char **errptr)
{
    const ds_block_meta *m = &f->idx[b];
    size_t clen = DS_BLOCK_HDR + (size_t)m->comp_len;
    if (ds_buf_reserve(cbuf, clen) || ds_buf_reserve(raw, m->raw_len) ||
        ds_rows_reserve_rows(dst, dst->n_rows + m->n_rows) ||
        ds_rows_reserve_keys(dst, dst->n_keys + m->n_keys))
        return cm_err(errptr, CM_ENOMEM, "out of memory reading shard %s block %u", f->path, b);
    int rc = pread_full(f->fd, cbuf->p, clen, m->offset);
    if (rc == CM_EIO)
        return cm_err_errno(errptr, rc, "shard %s: cannot read block %u", f->path, b);
    if (rc != CM_OK)
        return cm_err(errptr, rc, "shard %s: block %u truncated", f->path, b);
    const uint8_t *h = cbuf->p;
    if (cm_xxh3(h, clen) != m->checksum)
        return cm_err(errptr, CM_ECORRUPT, "shard %s: block %u (offset %llu) checksum mismatch",
                      f->path, b, (unsigned long long)m->offset);
    if (get32(h) != m->n_rows || get32(h + 4) != m->n_keys || get32(h + 8) != m->raw_len ||
        get32(h + 12) != m->comp_len)
        return cm_err(errptr, CM_ECORRUPT, "shard %s: block %u header disagrees with the index",
                      f->path, b);
    size_t got = ZSTD_decompressDCtx(dctx, raw->p, m->raw_len, h + DS_BLOCK_HDR, m->comp_len);
    if (ZSTD_isError(got) || got != m->raw_len)
        return cm_err(errptr, CM_ECORRUPT, "shard %s: block %u does not decompress", f->path, b);
    char *why = NULL;
    rc = ds_block_decode(raw->p, m->raw_len, m->n_rows, m->n_keys, dst, &why);
    if (rc != CM_OK) {
        rc = cm_err(errptr, rc, "shard %s: block %u (offset %llu): %s", f->path, b,
                    (unsigned long long)m->offset, why ? why : "out of memory");
        free(why);
        return rc;
    }
    return CM_OK;
}

int ds_shard_verify(const char *path, uint64_t *rows, char **errptr)
{
    ds_shard_file f;
    int rc = ds_shard_file_open(path, &f, errptr);
    if (rc != CM_OK) return rc;
    ds_buf cbuf = {0}, raw = {0};
    ds_rows tmp;
    const ds_schema *s = &f.plan->schema;
    ds_rows_init(&tmp, s->n_dense, s->n_fields, s->has_weights);
    ZSTD_DCtx *dctx = ZSTD_createDCtx();
    if (dctx == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
    for (uint32_t b = 0; rc == CM_OK && b < f.n_blocks; b++) {
        ds_rows_clear(&tmp);
        rc = ds_shard_file_read_block(&f, b, dctx, &cbuf, &raw, &tmp, errptr);
    }
    if (rc == CM_OK && rows) *rows = f.rows;
    ZSTD_freeDCtx(dctx);
    ds_rows_free(&tmp);
    ds_buf_free(&cbuf);
    ds_buf_free(&raw);
    ds_shard_file_close(&f);
    return rc;
}
