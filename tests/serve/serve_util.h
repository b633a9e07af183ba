/*
 * Helpers for the serving tests: `ember` commands ($EMBER_BIN) under a time limit in the test's
 * own directory, the gen -> ingest -> train workflow, prediction files, eval rows held in memory
 * as owned batches, and the bundle's documented table-file layout (to list a table's keys).
 */
#ifndef EMBER_TESTS_SERVE_UTIL_H
#define EMBER_TESTS_SERVE_UTIL_H

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "check.h"
#include "common/common.h"
#include "datasets/datasets.h"
#include "serve/ember_serve.h"

static const char *su_bin;
static char su_dir[4096];

/* Makes the test directory; 0 or -1 (reported). */
static inline int su_init(const char *name)
{
    su_bin = getenv("EMBER_BIN");
    if (su_bin == NULL || access(su_bin, X_OK) != 0) {
        fprintf(stderr, "EMBER_BIN (%s) is not an executable: run through ctest\n",
                su_bin ? su_bin : "unset");
        CHECK(0);
        return -1;
    }
    snprintf(su_dir, sizeof su_dir, "%s", check_tmpdir(name));
    return 0;
}

/* su_dir/name */
static inline const char *su_path(const char *name)
{
    /* Per thread: serve_concurrent's export thread and its opening thread both call this, and
     * with one ring for both the export's calls overwrote the path the other was opening (read
     * as "" or half a path: "no MANIFEST", 1 open in ~90,000). */
    static __thread char buf[4][8192];
    static __thread int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", su_dir, name);
    return buf[k];
}

/* Runs a shell command in su_dir under a time limit; its exit code, -1 when it died of a
 * signal (a crash), 124 when it timed out. Output goes to su_dir/out.txt and err.txt. */
static inline int su_shell(int limit_s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static inline int su_shell(int limit_s, const char *fmt, ...)
{
    char args[12000], cmd[16384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "cd '%s' && timeout -k 5 %d %s >out.txt 2>err.txt", su_dir, limit_s,
             args);
    double t0 = cm_now();
    int st = system(cmd);
    int rc = st == -1 || !WIFEXITED(st) ? -1 : WEXITSTATUS(st);
    if (rc > 128) rc = -1; /* the shell reports a child killed by a signal as 128 + signal */
    fprintf(stderr, "[%5.2fs rc %d] %s\n", cm_now() - t0, rc, args);
    return rc;
}

/* `ember ARGS` in su_dir; prints stderr's tail when it fails. */
#define su_ember(...) su_ember_limit(240, __VA_ARGS__)
static inline int su_ember_limit(int limit_s, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static inline int su_ember_limit(int limit_s, const char *fmt, ...)
{
    char args[12000];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    int rc = su_shell(limit_s, "'%s' %s", su_bin, args);
    if (rc != 0) {
        char cmd[8400];
        snprintf(cmd, sizeof cmd, "tail -c 800 '%s/err.txt' >&2", su_dir);
        if (system(cmd) != 0) fprintf(stderr, "(no stderr)\n");
    }
    return rc;
}

/* A whole file (NUL-terminated) or NULL; *len gets its size when len is not NULL. */
static inline char *su_slurp(const char *path, size_t *len)
{
    void *buf = NULL;
    size_t n = 0;
    char *err = NULL;
    if (cm_read_file(path, &buf, &n, &err) != 0) {
        free(err);
        return NULL;
    }
    char *s = malloc(n + 1);
    if (n) memcpy(s, buf, n);
    s[n] = '\0';
    free(buf);
    if (len) *len = n;
    return s;
}

/* One float per line (a predictions file); NULL when missing. */
static inline float *su_read_floats(const char *path, size_t *n)
{
    char *text = su_slurp(path, NULL);
    *n = 0;
    if (text == NULL) return NULL;
    size_t cap = 1024;
    float *v = malloc(cap * sizeof *v);
    for (char *p = text, *end; *p; p = end) {
        float x = strtof(p, &end);
        if (end == p) break;
        if (*n == cap) v = realloc(v, (cap *= 2) * sizeof *v);
        v[(*n)++] = x;
        while (*end == '\n' || *end == ' ') end++;
    }
    free(text);
    return v;
}

/* gen ROWS rows (seed) -> ingest to shards/{train,eval}; 0 or the failing exit code. */
static inline int su_make_data(unsigned rows, unsigned seed)
{
    int rc = su_ember("gen --rows %u --seed %u --out g.tsv", rows, seed);
    if (rc == 0) rc = su_ember("ingest --format criteo --out shards --eval-fraction 0.2 g.tsv");
    CHECK_MSG(rc == 0, "gen/ingest: exit %d", rc);
    return rc;
}

/* train MODEL 40 steps (checkpoints at 20 and 40) into run-MODEL. */
static inline int su_train(const char *model)
{
    int rc = su_ember("train --train shards/train --eval shards/eval --model %s --out run-%s "
                      "--no-progress --max-steps 40 --checkpoint-every 20 --batch 512 --device cpu",
                      model, model);
    CHECK_MSG(rc == 0, "train %s: exit %d", model, rc);
    return rc;
}

/* ---- eval rows in memory ---- */

typedef struct su_batch {
    uint32_t n_rows, n_dense, n_fields;
    uint64_t n_keys;
    float *labels, *dense, *weights;
    uint32_t *offsets;
    uint64_t *keys;
} su_batch;

typedef struct su_data {
    su_batch *b;
    size_t n_b;
    uint64_t rows;
} su_data;

/* Reads every row of shards (in file order) in batches of `batch` rows. 0 or -1. */
static inline int su_data_load(const char *shards, uint32_t batch, su_data *d)
{
    memset(d, 0, sizeof *d);
    ds_reader_opts ro;
    ds_reader_opts_init(&ro);
    const char *paths[1] = {shards};
    ro.paths = paths;
    ro.n_paths = 1;
    ro.batch_size = batch;
    ds_reader *r = NULL;
    char *err = NULL;
    int rc = ds_reader_open(&ro, &r, &err);
    CHECK_MSG(rc == 0, "ds_reader_open %s: %s", shards, err ? err : "?");
    free(err);
    err = NULL;
    if (rc != 0) return -1;
    const ds_batch *b;
    while ((rc = ds_reader_next(r, &b, &err)) > 0) {
        d->b = realloc(d->b, (d->n_b + 1) * sizeof *d->b);
        su_batch *o = &d->b[d->n_b++];
        o->n_rows = b->n_rows;
        o->n_dense = b->n_dense;
        o->n_fields = b->n_fields;
        o->n_keys = b->n_keys;
        size_t no = (size_t)b->n_rows * b->n_fields + 1;
        o->labels = malloc(b->n_rows * sizeof(float) + 1);
        o->dense = malloc((size_t)b->n_rows * b->n_dense * sizeof(float) + 1);
        o->offsets = malloc(no * sizeof(uint32_t));
        o->keys = malloc(b->n_keys * sizeof(uint64_t) + 1);
        o->weights = b->weights ? malloc(b->n_keys * sizeof(float) + 1) : NULL;
        memcpy(o->labels, b->labels, b->n_rows * sizeof(float));
        memcpy(o->dense, b->dense, (size_t)b->n_rows * b->n_dense * sizeof(float));
        memcpy(o->offsets, b->offsets, no * sizeof(uint32_t));
        memcpy(o->keys, b->keys, b->n_keys * sizeof(uint64_t));
        if (b->weights) memcpy(o->weights, b->weights, b->n_keys * sizeof(float));
        d->rows += b->n_rows;
    }
    CHECK_MSG(rc == 0, "ds_reader_next: %s", err ? err : "?");
    free(err);
    ds_reader_destroy(r);
    return rc == 0 ? 0 : -1;
}

static inline void su_data_free(su_data *d)
{
    for (size_t i = 0; i < d->n_b; i++) {
        su_batch *b = &d->b[i];
        free(b->labels);
        free(b->dense);
        free(b->weights);
        free(b->offsets);
        free(b->keys);
    }
    free(d->b);
    memset(d, 0, sizeof *d);
}

static inline ember_serve_batch su_serve_batch(const su_batch *b)
{
    return (ember_serve_batch){b->n_rows, b->n_dense, b->n_fields, b->dense, b->offsets, b->keys,
                               b->weights};
}

/* Predictions for every row of d into out (d->rows floats); 0 or the error code (reported). */
static inline int su_predict_all(const ember_serve *h, const su_data *d, float *out)
{
    uint64_t at = 0;
    for (size_t i = 0; i < d->n_b; i++) {
        ember_serve_batch sb = su_serve_batch(&d->b[i]);
        char *err = NULL;
        int rc = ember_serve_predict(h, &sb, out + at, &err);
        if (rc != 0) {
            CHECK_MSG(rc == 0, "ember_serve_predict: %s", err ? err : "?");
            free(err);
            return rc;
        }
        at += d->b[i].n_rows;
    }
    return 0;
}

static inline float *su_labels(const su_data *d)
{
    float *l = malloc(d->rows * sizeof *l + 1);
    uint64_t at = 0;
    for (size_t i = 0; i < d->n_b; i++) {
        memcpy(l + at, d->b[i].labels, d->b[i].n_rows * sizeof(float));
        at += d->b[i].n_rows;
    }
    return l;
}

/* ---- threads sharing a handle ---- */

typedef struct su_gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int open;
} su_gate;

typedef struct su_thread {
    su_gate *gate;
    void *(*fn)(void *);
    void *arg;
} su_thread;

static inline void *su_thread_main(void *p)
{
    su_thread *t = p;
    pthread_mutex_lock(&t->gate->mu);
    while (!t->gate->open)
        pthread_cond_wait(&t->gate->cv, &t->gate->mu);
    pthread_mutex_unlock(&t->gate->mu);
    return t->fn(t->arg);
}

/* Runs fn((char *)args + i * size) for each i < n on a thread of its own, all released at once
 * when every one has started (so that their calls overlap), and joins them. 0, or -1 (reported)
 * when a thread did not start (those that did still run). */
static inline int su_run_threads(int n, void *(*fn)(void *), void *args, size_t size)
{
    su_gate gate = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
    pthread_t *th = calloc((size_t)n, sizeof *th);
    su_thread *ts = calloc((size_t)n, sizeof *ts);
    int started = 0;
    for (; th && ts && started < n; started++) {
        ts[started] = (su_thread){&gate, fn, (char *)args + (size_t)started * size};
        if (pthread_create(&th[started], NULL, su_thread_main, &ts[started]) != 0) break;
    }
    CHECK_MSG(started == n, "%d of %d threads started", started, n);
    pthread_mutex_lock(&gate.mu);
    gate.open = 1;
    pthread_cond_broadcast(&gate.cv);
    pthread_mutex_unlock(&gate.mu);
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    free(th);
    free(ts);
    return started == n ? 0 : -1;
}

/* ---- the table file layout documented in serve/ember_serve.h ---- */

typedef struct su_tab_hdr {
    char magic[8];
    uint32_t version, dim, precision, row_bytes;
    uint64_t rows, slots, deleted, step;
    uint8_t reserved[8];
} su_tab_hdr;

/* Every key a table file indexes (and the keys it lists as deleted). 0 or -1. */
static inline int su_table_keys(const char *bundle, const char *table, uint64_t **keys,
                                uint64_t *n, uint64_t **deleted, uint64_t *n_deleted)
{
    char path[8400];
    snprintf(path, sizeof path, "%s/table-%s.bin", bundle, table);
    size_t len = 0;
    char *f = su_slurp(path, &len);
    *keys = NULL;
    *n = 0;
    if (deleted) *deleted = NULL;
    if (n_deleted) *n_deleted = 0;
    if (f == NULL || len < sizeof(su_tab_hdr)) {
        CHECK_MSG(0, "cannot read %s", path);
        free(f);
        return -1;
    }
    su_tab_hdr h;
    memcpy(&h, f, sizeof h);
    size_t need = sizeof h + h.slots * 16 + h.rows * h.row_bytes + h.deleted * 8 + 8;
    if (memcmp(h.magic, "EMBSTAB1", 8) || len != need) {
        CHECK_MSG(0, "%s: unexpected layout", path);
        free(f);
        return -1;
    }
    *keys = malloc(h.rows * 8 + 8);
    for (uint64_t s = 0; s < h.slots; s++) {
        uint64_t k;
        uint32_t row;
        memcpy(&k, f + sizeof h + s * 16, 8);
        memcpy(&row, f + sizeof h + s * 16 + 8, 4);
        if (row != UINT32_MAX && *n < h.rows) (*keys)[(*n)++] = k;
    }
    CHECK_MSG(*n == h.rows, "%s: %llu keys indexed, header says %llu rows", path,
              (unsigned long long)*n, (unsigned long long)h.rows);
    if (deleted) {
        *deleted = malloc(h.deleted * 8 + 8);
        memcpy(*deleted, f + sizeof h + h.slots * 16 + h.rows * h.row_bytes, h.deleted * 8);
        *n_deleted = h.deleted;
    }
    free(f);
    return 0;
}

/* Opens a bundle (and deltas, NULL-terminated); NULL on failure (reported). */
static inline ember_serve *su_open(const char *bundle, const char *const *deltas)
{
    ember_serve *h = NULL;
    char *err = NULL;
    int rc = ember_serve_open(bundle, &h, &err);
    CHECK_MSG(rc == 0, "open %s: %s", bundle, err ? err : "?");
    free(err);
    err = NULL;
    for (int i = 0; rc == 0 && deltas && deltas[i]; i++) {
        rc = ember_serve_apply_delta(h, deltas[i], &err);
        CHECK_MSG(rc == 0, "apply_delta %s: %s", deltas[i], err ? err : "?");
        free(err);
        err = NULL;
    }
    if (rc != 0) {
        ember_serve_close(h);
        return NULL;
    }
    return h;
}

#endif
