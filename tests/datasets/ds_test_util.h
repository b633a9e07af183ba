/* Helpers shared by the datasets tests. */
#ifndef EMBER_TESTS_DS_TEST_UTIL_H
#define EMBER_TESTS_DS_TEST_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "datasets/datasets.h"

static inline void write_text(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(data, 1, n, f) != n) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(2);
    }
    fclose(f);
}

/* A parser for fmt (schema text for csv; libffm with 4 fields); NULL, with a failed check,
 * when it cannot be made. */
static inline ds_parser *make_parser(ds_format fmt, const char *schema, int bucketize)
{
    ds_parser_opts o;
    ds_parser_opts_init(&o);
    o.format = fmt;
    o.schema_text = schema;
    o.bucketize = bucketize;
    o.ffm_fields = 4;
    ds_parser *p = NULL;
    char *err = NULL;
    CHECK_OK(ds_parser_create(&o, &p, &err), err);
    return p;
}

/* 1 when both files can be read and hold the same bytes. */
static inline int same_file(const char *a, const char *b)
{
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    int same = fa && fb;
    while (same) {
        int ca = fgetc(fa), cb = fgetc(fb);
        if (ca != cb) same = 0;
        if (ca == EOF) break;
    }
    if (fa) fclose(fa);
    if (fb) fclose(fb);
    return same;
}

/* a + "/" + b in one of 8 rotating static buffers (so calls can nest). */
static inline char *join(const char *a, const char *b)
{
    static char buf[8][4096];
    static int k;
    char *s = buf[k++ % 8];
    size_t na = strlen(a), nb = strlen(b);
    if (na + nb + 2 > sizeof buf[0]) {
        fprintf(stderr, "path too long\n");
        exit(2);
    }
    memmove(s, a, na);
    s[na] = '/';
    memcpy(s + na + 1, b, nb + 1);
    return s;
}

/* All rows of the shards under paths, in reader order, flattened into one growing copy. */
typedef struct rows_copy {
    size_t n_rows, n_keys;
    uint32_t n_dense, n_fields;
    float *labels, *dense, *weights;
    uint32_t *offsets; /* n_rows*n_fields+1 */
    uint64_t *keys;
} rows_copy;

static inline void rows_copy_free(rows_copy *c)
{
    free(c->labels);
    free(c->dense);
    free(c->weights);
    free(c->offsets);
    free(c->keys);
    memset(c, 0, sizeof *c);
}

static inline void rows_copy_add(rows_copy *c, const ds_batch *b)
{
    c->n_dense = b->n_dense;
    c->n_fields = b->n_fields;
    size_t nr = c->n_rows + b->n_rows, nk = c->n_keys + b->n_keys;
    c->labels = realloc(c->labels, (nr + 1) * sizeof(float));
    c->dense = realloc(c->dense, (nr * b->n_dense + 1) * sizeof(float));
    c->offsets = realloc(c->offsets, (nr * b->n_fields + 1) * sizeof(uint32_t));
    c->keys = realloc(c->keys, (nk + 1) * sizeof(uint64_t));
    c->weights = realloc(c->weights, (nk + 1) * sizeof(float));
    if (c->n_rows == 0) c->offsets[0] = 0;
    memcpy(c->labels + c->n_rows, b->labels, b->n_rows * sizeof(float));
    memcpy(c->dense + c->n_rows * b->n_dense, b->dense, (size_t)b->n_rows * b->n_dense * sizeof(float));
    for (size_t i = 1; i <= (size_t)b->n_rows * b->n_fields; i++)
        c->offsets[c->n_rows * b->n_fields + i] = (uint32_t)c->n_keys + b->offsets[i] - b->offsets[0];
    memcpy(c->keys + c->n_keys, b->keys + b->offsets[0], b->n_keys * sizeof(uint64_t));
    for (size_t i = 0; i < b->n_keys; i++) c->weights[c->n_keys + i] = b->weights ? b->weights[b->offsets[0] + i] : 1.0f;
    c->n_rows = nr;
    c->n_keys = nk;
}

/* Reads every row (one worker, file order) into c; returns the reader rc. */
static inline int read_all(const char *path, rows_copy *c)
{
    ds_reader_opts o;
    ds_reader_opts_init(&o);
    o.paths = &path;
    o.n_paths = 1;
    o.batch_size = 77;
    ds_reader *r = NULL;
    char *err = NULL;
    int rc = ds_reader_open(&o, &r, &err);
    CHECK_OK(rc, err);
    if (rc) return rc;
    const ds_batch *b;
    while ((rc = ds_reader_next(r, &b, &err)) == 1) rows_copy_add(c, b);
    CHECK_OK(rc, err);
    ds_reader_destroy(r);
    return rc;
}

/* Runs ds_ingest_run with common test settings (small chunks and blocks to cross boundaries). */
static inline int ingest_files(ds_format fmt, const char *schema_text, const char **inputs, size_t n,
                               const char *out, int threads, ds_ingest_result *res, char **err)
{
    ds_ingest_opts o;
    ds_ingest_opts_init(&o);
    o.parser.format = fmt;
    o.parser.schema_text = schema_text;
    o.inputs = inputs;
    o.n_inputs = n;
    o.out_dir = out;
    o.threads = threads;
    o.chunk_bytes = 16 << 10;
    o.block_rows = 100;
    o.log = fopen("/dev/null", "w");
    int rc = ds_ingest_run(&o, res, err);
    fclose(o.log);
    return rc;
}

#endif
