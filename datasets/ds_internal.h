/*
 * Private to datasets/: the pieces the public calls are built from. Row buffers (rows.c),
 * column plans and the line parser (plan.c, parse.c), field statistics (stats.c), block and
 * shard coding (shard.c), decompressing input (input.c).
 */
#ifndef EMBER_DATASETS_INTERNAL_H
#define EMBER_DATASETS_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <zstd.h>

#include "datasets/datasets.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "shards are little-endian and written with memcpy; port the block coder first"
#endif

#define DS_DEFAULT_BLOCK_ROWS 8192u

/* ---- growable byte buffer ---- */
typedef struct ds_buf {
    uint8_t *p;
    size_t len, cap;
} ds_buf;
int ds_buf_reserve(ds_buf *b, size_t need); /* capacity >= need; CM_ENOMEM */
int ds_buf_append(ds_buf *b, const void *src, size_t n);
void ds_buf_free(ds_buf *b);

/* ---- rows in batch layout ---- */
typedef struct ds_rows {
    uint32_t n_dense, n_fields;
    int has_weights;
    size_t n_rows, cap_rows;
    size_t n_keys, cap_keys;
    float *labels;
    float *dense;
    uint32_t *offsets; /* cap_rows * n_fields + 1 */
    uint64_t *keys;
    float *weights; /* NULL unless has_weights */
} ds_rows;

void ds_rows_init(ds_rows *r, uint32_t n_dense, uint32_t n_fields, int has_weights);
void ds_rows_free(ds_rows *r);
void ds_rows_clear(ds_rows *r);
int ds_rows_reserve_rows(ds_rows *r, size_t rows);
/* ds_rows_reserve_rows with the common case (room already there) inlined, for per-line use. */
static inline int ds_rows_room(ds_rows *r, size_t rows)
{
    return rows <= r->cap_rows && r->offsets ? CM_OK : ds_rows_reserve_rows(r, rows);
}
int ds_rows_reserve_keys(ds_rows *r, size_t keys);
/* Appends row i of b (same layout). */
int ds_rows_append_row(ds_rows *r, const ds_batch *b, size_t i);
void ds_rows_view(const ds_rows *r, size_t row0, size_t n, ds_batch *out);

/* ---- column plan: how each input column maps onto the row ---- */
enum { COL_SKIP, COL_LABEL, COL_DENSE, COL_CAT, COL_MULTI, COL_HOUR };

typedef struct ds_col {
    uint8_t role;
    char msep;     /* COL_MULTI value separator */
    uint32_t slot; /* dense index (COL_DENSE) or first field (COL_CAT, COL_MULTI, COL_HOUR) */
} ds_col;

typedef struct ds_plan {
    ds_format fmt;
    char sep;
    int quoting;   /* RFC 4180 quotes */
    int header;    /* files start with a header line */
    int bucketize;
    int scalar_scan; /* ds_parser_opts.scalar_scan */
    uint32_t n_cols, min_cols;
    ds_col *cols;
    uint32_t n_dense, n_base_fields, n_fields; /* n_fields = base + (bucketize ? n_dense : 0) */
    int has_label, has_weights;
    char **names; /* n_dense dense names, then n_fields field names */
    ds_schema schema;
} ds_plan;

/* Plan for a format that needs no header (criteo, libsvm, libffm, csv). For header formats
 * returns a plan whose n_cols is 0 until ds_plan_from_header. */
int ds_plan_create(const ds_parser_opts *o, ds_plan **out, char **errptr);
/* For criteo-csv / avazu: a new plan built from a header line; for csv: checks the names. */
int ds_plan_from_header(const ds_plan *base, const char *line, size_t len, ds_plan **out,
                        char **errptr);
int ds_plan_same_schema(const ds_plan *a, const ds_plan *b);
/* A plan holding only a copy of schema s (names owned); NULL when out of memory. */
ds_plan *ds_plan_from_schema(const ds_schema *s);
void ds_plan_destroy(ds_plan *p);

/* ---- statistics of written rows ---- */
#define DS_HLL_BITS 12
typedef struct ds_stats {
    uint32_t n_dense, n_fields;
    uint64_t rows, clicks;
    uint64_t *dense_missing, *field_missing;
    double *dense_sum;
    float *dense_min, *dense_max;
    uint8_t *hll; /* n_fields << DS_HLL_BITS registers */
    uint32_t max_row_keys; /* the most keys one row held, all its fields together */
} ds_stats;
int ds_stats_init(ds_stats *s, uint32_t n_dense, uint32_t n_fields);
void ds_stats_free(ds_stats *s);
void ds_stats_merge(ds_stats *into, const ds_stats *from);
double ds_stats_distinct(const ds_stats *s, uint32_t field);
/* Adds field f of some rows: their m keys and how many of the rows have none. */
void ds_stats_add_field(ds_stats *s, uint32_t f, const uint64_t *keys, size_t m, uint64_t missing);

static inline void ds_hll_add(uint8_t *reg, uint64_t h)
{
    uint32_t idx = (uint32_t)(h >> (64 - DS_HLL_BITS));
    uint64_t w = (h << DS_HLL_BITS) | (1ull << (DS_HLL_BITS - 1));
    uint8_t rank = (uint8_t)(__builtin_clzll(w) + 1);
    if (reg[idx] < rank) reg[idx] = rank;
}
int ds_stats_write_json(const ds_stats *s, const ds_schema *schema, const char *path,
                        char **errptr);

/* ---- the line parser ---- */
typedef struct ds_pctx {
    const ds_plan *plan;
    ds_stats *stats;      /* NULL: no statistics */
    int block_field_stats; /* 1: the field statistics (missing, HLL) are left to
                            * ds_block_encode, which sees each field's keys together */
    uint32_t *missing;     /* n_dense flags of the row being parsed; not bytes, whose stores
                            * may alias anything and forced reloads in the column loop */
    char *qbuf;           /* unquoted token */
    struct ffm_kv { uint32_t field; uint32_t pad; uint64_t key; float w; } *kv;
    size_t kv_cap;
    uint32_t *cnt;        /* n_fields counters (libffm) */
    /* where the last rejection was */
    int reason;
    uint32_t column;
} ds_pctx;

int ds_pctx_init(ds_pctx *c, const ds_plan *plan, ds_stats *stats);
void ds_pctx_free(ds_pctx *c);
/* Parses one line (no line end) onto dst. 0 = row appended; 1 = rejected (c->reason,
 * c->column); 2 = accepted after padding missing trailing columns; CM_ENOMEM. */
int ds_parse_line(ds_pctx *c, const char *line, size_t len, ds_rows *dst);

/* Next physical line of [*p, end) without its LF or CRLF; advances *p. 0 when none is left. */
static inline int ds_next_line(const char **p, const char *end, const char **line, size_t *len)
{
    const char *s = *p;
    if (s >= end) return 0;
    const char *nl = (const char *)memchr(s, '\n', (size_t)(end - s));
    const char *le = nl ? nl : end;
    size_t n = (size_t)(le - s);
    if (n && s[n - 1] == '\r') n--;
    *line = s;
    *len = n;
    *p = nl ? nl + 1 : end;
    return 1;
}

/* ---- blocks and shard files ---- */
typedef struct ds_block_meta {
    uint64_t offset; /* in the shard file (writer fills) */
    uint32_t n_rows, n_keys, raw_len, comp_len;
    uint64_t checksum; /* xxh3 of the 16-byte block header + compressed bytes */
} ds_block_meta;

#define DS_BLOCK_HDR 16u

/* Block coder state, one per thread (block.c): the zstd context set up once, and scratch
 * buffers and a dictionary hash table that are reused from block to block. */
typedef struct ds_fdict {
    uint64_t *slot; /* a field's dictionary hash table, reused from block to block */
    size_t cap;
    uint32_t hint; /* distinct keys of the field in the previous block: the table's start size */
} ds_fdict;

typedef struct ds_benc {
    ZSTD_CCtx *cctx;
    ds_buf raw; /* the payload before compression */
    ds_buf tmp; /* counts, dictionaries, indices, weights of one block */
    ds_fdict *fd;
    uint32_t n_fd;
} ds_benc;

int ds_benc_init(ds_benc *e);  /* CM_ENOMEM */
void ds_benc_free(ds_benc *e); /* also fine on a zeroed ds_benc */
/* Encodes rows [row0, row0+n) of r as a block appended to out (header + zstd payload); adds
 * the rows' field statistics to stats unless it is NULL. */
int ds_block_encode(ds_benc *e, const ds_rows *r, size_t row0, size_t n, ds_stats *stats,
                    ds_buf *out, ds_block_meta *meta, char **errptr);
/* The largest payload a block of rows/keys can have; an index entry claiming more is corrupt. */
uint64_t ds_block_raw_max(uint32_t n_dense, uint32_t n_fields, int weights, uint64_t rows,
                          uint64_t keys);
/* Decodes a decompressed payload of n rows and n_keys keys onto dst (rows and keys already
 * reserved). CM_ECORRUPT with a short reason when the payload does not add up. */
int ds_block_decode(const uint8_t *raw, size_t len, uint32_t n, uint32_t n_keys, ds_rows *dst,
                    char **errptr);

/* ds_shard_writer_create, but with stage >= CM_DIRECT_ALIGN the file is written with O_DIRECT
 * through an aligned buffer of that many bytes, where the file system takes it (else
 * buffered): no page-cache pages for the shard (cm_afile_open_direct says why). */
int ds_shard_writer_create_staged(const char *path, const ds_schema *schema, uint32_t block_rows,
                                  size_t stage, ds_shard_writer **out, char **errptr);
/* Appends already-encoded blocks; the index entries are taken from metas. */
int ds_shard_writer_add_encoded(ds_shard_writer *w, const uint8_t *bytes,
                                const ds_block_meta *meta, char **errptr);
uint64_t ds_shard_writer_bytes(const ds_shard_writer *w);

/* A shard opened for reading: header and index checked. */
typedef struct ds_shard_file {
    char *path;
    int fd;
    ds_plan *plan; /* owns the schema names */
    uint32_t n_blocks, block_rows;
    ds_block_meta *idx;
    uint64_t rows, keys;
} ds_shard_file;

int ds_shard_file_open(const char *path, ds_shard_file *f, char **errptr);
void ds_shard_file_close(ds_shard_file *f);
/* Reads, checks and appends block b to dst (whose layout must match). */
int ds_shard_file_read_block(const ds_shard_file *f, uint32_t b, ZSTD_DCtx *dctx, ds_buf *cbuf,
                             ds_buf *raw, ds_rows *dst, char **errptr);
int ds_schema_equal(const ds_schema *a, const ds_schema *b);

/* ---- decompressing input ---- */
typedef struct ds_input ds_input;
int ds_input_open(const char *path, ds_input **out, char **errptr);
/* Reads up to n bytes; *got == 0 at end of file. A gzip / zstd file must consist of whole
 * members / frames: anything else (trailing bytes, a damaged or cut one) is CM_ECORRUPT naming
 * the file and the byte offset where that member / frame starts. */
int ds_input_read(ds_input *in, void *buf, size_t n, size_t *got, char **errptr);
void ds_input_close(ds_input *in);
/* The file descriptor of an uncompressed input (which ds_ingest_run maps instead of reading),
 * or -1 for gzip / zstd input. */
int ds_input_plain_fd(const ds_input *in);

#endif
