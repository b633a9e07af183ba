/*
 * datasets: click logs in, checksummed columnar shards out, mini-batches back.
 *
 * Design
 * ------
 * Text formats (Criteo TSV/CSV, Avazu, libsvm, libffm, schema-driven CSV) are parsed by
 * hand-written tokenizers into rows of three parts:
 *
 *   label   one float (0/1 for clicks; 0 for files without a label column),
 *   dense   n_dense floats (a missing value is stored as 0),
 *   keys    for each of n_fields categorical fields, a variable-length list of 64-bit keys
 *           (empty for a missing value, several for a multi-valued column), optionally each
 *           with a float weight (libsvm/libffm values).
 *
 * A categorical token becomes ds_key(token, len, field): xxh3-64 seeded with the field index,
 * so equal tokens in different fields never collide and no dictionary is needed.
 *
 * Rows are held column-wise as a ds_batch: keys in CSR layout per (row, field), i.e. the keys
 * of row r, field f are keys[offsets[r*n_fields+f] .. offsets[r*n_fields+f+1]). The same layout
 * is what the parser produces, what a shard block stores and what the reader hands out, so a
 * batch never needs per-row allocation.
 *
 * Shards (docs/SHARD_FORMAT.md) are files of zstd-compressed, xxh3-checksummed blocks of rows,
 * with the schema in a header and a block index in a footer so a writer can stream and a
 * reader can seek. Every byte is covered by a checksum; a reader names the file and block of
 * any damage. Files are committed with write-temp/fsync/rename (cm_afile).
 *
 * ds_ingest_run is `ember ingest` as a library call: a reader thread splits (optionally gz/zstd
 * compressed) input into chunks at line boundaries, a pool of workers parses and encodes
 * blocks, and the calling thread writes the blocks in input order, so the output does not
 * depend on the number of threads. docs/INGEST.md gives the formats and the decisions taken on
 * malformed input.
 *
 * ds_reader streams batches from shards with a prefetch thread, an optional seeded shuffle
 * window, and a split of blocks among workers (worker w of W reads global block b when
 * b % W == w, blocks numbered across the sorted shard list).
 *
 * Errors: functions return 0 (or a documented non-negative value) or a negative CM_* code,
 * storing a caller-owned message (free()) in *errptr when errptr is non-NULL. Library code
 * never exits and never crashes on malformed input.
 */
#ifndef EMBER_DATASETS_H
#define EMBER_DATASETS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- keys ---------------------------------------------------------------------------- */

/* The key of categorical token [tok, tok+len) in field `field` (xxh3-64 seeded by field). */
uint64_t ds_key(const char *tok, size_t len, uint32_t field);

/* ---- schema and batches -------------------------------------------------------------- */

/* What a row holds. Names are borrowed from whoever returned the schema and live as long as
 * that object. */
typedef struct ds_schema {
    uint32_t n_dense;               /* dense float values per row */
    uint32_t n_fields;              /* categorical fields per row */
    int has_label;                  /* 0: input had no label column; labels are all 0 */
    int has_weights;                /* 1: every key carries a float weight */
    const char *const *dense_names; /* n_dense names */
    const char *const *field_names; /* n_fields names */
} ds_schema;

/* A read-only view of rows. The arrays belong to the object that returned the batch and stay
 * valid until that object's next call (documented at each producer). */
typedef struct ds_batch {
    uint32_t n_rows, n_dense, n_fields;
    uint32_t epoch;           /* reader epoch this batch belongs to */
    uint64_t n_keys;
    const float *labels;      /* n_rows */
    const float *dense;       /* n_rows * n_dense, row-major */
    const uint32_t *offsets;  /* n_rows * n_fields + 1, offsets[0] == 0 */
    const uint64_t *keys;     /* n_keys */
    const float *weights;     /* n_keys, or NULL when the schema has no weights */
} ds_batch;

/* ---- formats and parsing ------------------------------------------------------------- */

typedef enum ds_format {
    DS_FMT_CRITEO = 0, /* Criteo TSV: label, I1..I13, C1..C26 */
    DS_FMT_CRITEO_CSV, /* Criteo CSV with header (optional Id / Label columns) */
    DS_FMT_AVAZU,      /* Avazu CSV with header (id, click, hour, categoricals) */
    DS_FMT_LIBSVM,     /* label idx:val ... */
    DS_FMT_LIBFFM,     /* label field:idx:val ... */
    DS_FMT_CSV,        /* generic CSV described by a schema file */
} ds_format;

/* Maps "criteo", "criteo-csv", "avazu", "libsvm", "libffm", "csv" to a format. 0 or CM_EINVAL. */
int ds_format_from_name(const char *name, ds_format *out);
const char *ds_format_name(ds_format fmt);

/* Why a line was rejected. */
enum {
    DS_REJ_COLUMNS = 0, /* wrong number of columns */
    DS_REJ_NUMBER,      /* a dense value is not a number */
    DS_REJ_LABEL,       /* label missing or not a number */
    DS_REJ_TOKEN_LONG,  /* a token longer than DS_MAX_TOKEN bytes */
    DS_REJ_JUNK,        /* NUL or other control bytes */
    DS_REJ_QUOTE,       /* invalid RFC 4180 quoting */
    DS_REJ_LINE_LONG,   /* a line longer than the chunk size */
    DS_REJ_FEATURE,     /* malformed libsvm/libffm feature or field out of range */
    DS_REJ__COUNT
};
#define DS_MAX_TOKEN 4096

/* Short snake_case name of a DS_REJ_* reason ("columns", "number", ...). */
const char *ds_reject_name(int reason);

typedef struct ds_parser_opts {
    ds_format format;
    const char *schema_path; /* DS_FMT_CSV: schema file (docs/INGEST.md) */
    const char *schema_text; /* DS_FMT_CSV: schema text instead of a file (wins over path) */
    int bucketize;           /* add a log2-bucket categorical field per dense field */
    uint32_t ffm_fields;     /* DS_FMT_LIBFFM: number of fields (field ids must be below) */
    int no_label;            /* DS_FMT_CRITEO: rows are I1..I13, C1..C26 without the label
                              * (Criteo's test.txt); labels are 0 and has_label false */
    int scalar_scan;         /* 1: find separators byte by byte instead of 64 bytes at a time
                              * (SSE2); same results, slower. For tests and comparisons. */
} ds_parser_opts;

void ds_parser_opts_init(ds_parser_opts *o);

typedef struct ds_parser ds_parser;

/* Creates a parser. For formats whose columns come from a header line (criteo-csv, avazu,
 * csv with `header yes`), ds_parser_header must be given the header before parsing.
 * *out is owned by the caller (ds_parser_destroy). */
int ds_parser_create(const ds_parser_opts *opts, ds_parser **out, char **errptr);
void ds_parser_destroy(ds_parser *p);

/* 1 when the format expects a header line at the top of every file. */
int ds_parser_wants_header(const ds_parser *p);

/* Feeds the header line (without its line end). Fails (CM_EINVAL) when the header does not
 * describe a usable layout, or when it differs from a schema already fixed. */
int ds_parser_header(ds_parser *p, const char *line, size_t len, char **errptr);

/* The output schema; valid once the header (if any) was given, borrowed from p. NULL before. */
const ds_schema *ds_parser_schema(const ds_parser *p);

typedef struct ds_parse_report {
    uint64_t lines;      /* non-blank lines seen */
    uint64_t rows;       /* rows accepted */
    uint64_t rejected;   /* lines rejected */
    uint64_t padded;     /* Criteo TSV rows with missing trailing columns, taken as empty */
    uint64_t first_bad;  /* 1-based physical line in text of the first rejected line, or 0 */
    int first_reason;    /* DS_REJ_* of that line */
    uint32_t first_column; /* 1-based column (or feature) of that line's problem */
} ds_parse_report;

/* Parses every line of text (LF or CRLF ends; the last line needs none; blank lines are
 * skipped) into a batch owned by p, valid until the next ds_parser_parse or destroy.
 * Malformed lines are skipped and counted in *rep. Never fails on bad text; fails only on
 * missing header or out of memory. */
int ds_parser_parse(ds_parser *p, const char *text, size_t len, ds_batch *out,
                    ds_parse_report *rep, char **errptr);

/* ---- shards -------------------------------------------------------------------------- */

typedef struct ds_shard_writer ds_shard_writer;

/* Starts writing a shard at path (a temporary beside it until commit). block_rows is the most
 * rows per block (0 = 8192). The schema is copied. *out is owned by the caller: exactly one of
 * ds_shard_writer_commit or ds_shard_writer_abort releases it. */
int ds_shard_writer_create(const char *path, const ds_schema *schema, uint32_t block_rows,
                           ds_shard_writer **out, char **errptr);
/* Appends the rows of a batch whose n_dense/n_fields/weights match the schema (copied). */
int ds_shard_writer_append(ds_shard_writer *w, const ds_batch *b, char **errptr);
/* Flushes, writes the index and commits the file atomically; releases w even on error. */
int ds_shard_writer_commit(ds_shard_writer *w, char **errptr);
/* Discards the temporary file and releases w. NULL is fine. */
void ds_shard_writer_abort(ds_shard_writer *w);

/* Reads and checks a whole shard: header, index, every block's checksum and contents.
 * On success stores the row count in *rows (may be NULL). CM_ECORRUPT names file and block. */
int ds_shard_verify(const char *path, uint64_t *rows, char **errptr);

/* ---- reader -------------------------------------------------------------------------- */

typedef struct ds_reader_opts {
    const char *const *paths; /* shard files or directories (their *.shard files); borrowed */
    size_t n_paths;
    uint32_t batch_size;   /* rows per batch (default 1024); each epoch's last batch may be
                            * smaller: a batch never spans two epochs and no row is dropped, so
                            * a worker reads ceil(ds_reader_rows / batch_size) batches an epoch */
    uint32_t worker;       /* this worker's index, < n_workers */
    uint32_t n_workers;    /* default 1 */
    uint64_t shuffle_rows; /* shuffle window in rows; 0 = file order */
    uint64_t seed;         /* shuffle seed (combined with the epoch) */
    uint32_t first_epoch;  /* epoch number of the first pass (varies the shuffle) */
    uint32_t n_epochs;     /* passes over the data (default 1) */
    uint32_t prefetch;     /* batches prepared ahead (default 2) */
    bool background;       /* the prefetch thread runs as background work (cm_thread_background) */
} ds_reader_opts;

void ds_reader_opts_init(ds_reader_opts *o);

typedef struct ds_reader ds_reader;

/* Opens every shard (sorted by path), checks headers, index and that schemas agree, and starts
 * the prefetch thread. *out is owned by the caller (ds_reader_destroy). */
int ds_reader_open(const ds_reader_opts *opts, ds_reader **out, char **errptr);
/* Schema shared by the shards, borrowed from r. */
const ds_schema *ds_reader_schema(const ds_reader *r);
/* Rows this worker reads per epoch. */
uint64_t ds_reader_rows(const ds_reader *r);
/* Next batch: 1 and *out set (valid until the next call or destroy), 0 after the last epoch,
 * or a negative code (a corrupted block names its file and block). */
int ds_reader_next(ds_reader *r, const ds_batch **out, char **errptr);
/* Stops the prefetch thread and frees everything. NULL is fine. */
void ds_reader_destroy(ds_reader *r);

/* ---- ingest -------------------------------------------------------------------------- */

typedef struct ds_ingest_opts {
    ds_parser_opts parser;
    const char *const *inputs; /* plain, .gz or .zst files (detected by magic); borrowed */
    size_t n_inputs;
    const char *out_dir;       /* gets train/, eval/ (when eval_fraction > 0), stats.json */
    uint32_t n_shards;         /* train (and eval) shard files (default 1) */
    double eval_fraction;      /* share of rows held out by row hash, [0, 1) */
    uint64_t split_seed;       /* seed of the eval row hash (default 0) */
    int strict;                /* stop at the first malformed line, commit nothing */
    int threads;               /* parse workers (0 = all cores) */
    uint32_t block_rows;       /* rows per shard block (0 = 8192) */
    size_t chunk_bytes;        /* input chunk per work item, also the longest line (0 = 4 MiB) */
    int progress;              /* print rows/s, MB/s to log every half second */
    FILE *log;                 /* malformed-line reports and progress (NULL = stderr) */
    uint32_t max_reports;      /* malformed lines reported one by one (default 20) */
    int buffered_output;       /* 1: write shards through the page cache; 0 (default): with
                                * O_DIRECT where the file system allows it, which costs less
                                * CPU but leaves the shards out of the page cache */
} ds_ingest_opts;

void ds_ingest_opts_init(ds_ingest_opts *o);

typedef struct ds_ingest_result {
    uint64_t rows_in;       /* non-blank data lines read (header lines excluded) */
    uint64_t rows_written;  /* rows_train + rows_eval */
    uint64_t rows_rejected; /* rows_in - rows_written */
    uint64_t rows_train, rows_eval, rows_padded;
    uint64_t rejected_by_reason[DS_REJ__COUNT];
    uint64_t bytes_in;      /* uncompressed input bytes */
    uint64_t bytes_out;     /* shard bytes written */
    uint64_t clicks;        /* rows with label > 0 among those written */
    double seconds;
    int threads;
} ds_ingest_result;

/* Converts the inputs into shards in out_dir (replacing train/, eval/ and stats.json there).
 * *res is filled as far as the run got, also on failure. A strict run that meets a malformed
 * line returns CM_ECORRUPT naming the file and line, leaving no shard files behind. */
int ds_ingest_run(const ds_ingest_opts *opts, ds_ingest_result *res, char **errptr);

/* From an ingest's stats.json at path: the sum over its fields of the distinct-key estimates
 * (*total) and the number of fields (*n_fields). The estimates (HyperLogLog, ~2% error) cover
 * train and eval rows together. 0, CM_ENOTFOUND when there is no such file, or CM_ECORRUPT /
 * CM_EIO naming the file. */
int ds_stats_read_distinct(const char *path, uint64_t *total, uint32_t *n_fields, char **errptr);

/* From an ingest's stats.json at path: the most keys any one row held (train and eval rows,
 * all fields together), which bounds a batch's distinct keys by batch x *out. 0; CM_ENOTFOUND
 * when there is no such file or it predates the figure; CM_ECORRUPT / CM_EIO naming the file. */
int ds_stats_read_max_row_keys(const char *path, uint32_t *out, char **errptr);

/* Writes res as one JSON object line (rows_in, rows_written, rows_rejected, seconds, ...). */
void ds_ingest_result_json(const ds_ingest_result *res, FILE *to);

#ifdef __cplusplus
}
#endif
#endif
