/*
 * serve_predict_state: what ember_serve_predict keeps between calls, and what it leaves alone.
 * A deepfm bundle written with the writer API (a random tower and rows, no training), batches
 * of 1, 16, 256 and 2048 rows (multi-hot, keys repeating, some absent):
 *   - predict leaves OpenBLAS's process-wide thread count as the process set it (every call
 *     reset it to 1: a server that ran OpenBLAS on several threads for its own work lost them);
 *   - each batch scores the same bits on a fresh handle, on a handle that scored larger and
 *     smaller batches before it, and from 4 threads at once mixing the sizes on one handle;
 *   - where ember's own GEMM runs (AVX-512) the same bits for any OpenBLAS thread count (its
 *     GEMMs call no OpenBLAS); elsewhere within 1e-6 (OpenBLAS's threads sum in another order).
 * It prints a digest of each batch's predictions: compare them across builds for the same bits.
 */
#include <cblas.h>

#include "serve_util.h"
#include "src/model.h"

#define N_SIZES 4
#define N_THREADS 4
#define ROUNDS 3
#define TABLE_ROWS 5000u

static const uint32_t sizes[N_SIZES] = {1, 16, 256, 2048};
static const char *model_text = "kind deepfm\nfields 8\ndense 4\ndim 16\nhidden 64,32\n"
                                "bottom -\nseed 7\npool sum\n";

static uint64_t rng_next(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    uint64_t x = *s;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    return x ^ (x >> 33);
}

static float rng_unit(uint64_t *s)
{
    return (float)(rng_next(s) >> 40) * (1.0f / 16777216.0f);
}

/* Key i of the tables (i < TABLE_ROWS); larger i are absent. */
static uint64_t key_of(uint64_t i)
{
    return i * 0x9e3779b97f4a7c15ull + 1;
}

/* The bundle "b": a random tower (model_init_params' scale) and random rows. 0 or -1. */
static int write_bundle(void)
{
    model_cfg m;
    model_layout l;
    int mean_pool = 0;
    char *err = NULL;
    int rc = model_cfg_parse(model_text, &m, &mean_pool, &err);
    if (rc == 0) rc = model_layout_make(&m, &l, &err);
    CHECK_OK(rc, err);
    if (rc != 0) return -1;
    float *tower = malloc(l.n_params * sizeof *tower);
    uint64_t *keys = malloc(TABLE_ROWS * sizeof *keys);
    float *rows = malloc((size_t)TABLE_ROWS * m.dim * sizeof *rows);
    model_init_params(&m, &l, tower);
    uint64_t s = 3;
    for (size_t i = 0; i < l.n_params; i++) /* non-zero biases too */
        tower[i] += 0.01f * (rng_unit(&s) - 0.5f);
    for (uint32_t i = 0; i < TABLE_ROWS; i++) {
        keys[i] = key_of(i);
        for (uint32_t j = 0; j < m.dim; j++)
            rows[(size_t)i * m.dim + j] = 0.2f * (rng_unit(&s) - 0.5f);
    }
    ember_serve_writer *w = NULL;
    rc = ember_serve_writer_create(su_path("b"), EMBER_SERVE_FP32, 0, 1, 0, &w, &err);
    if (rc == 0) rc = ember_serve_writer_model(w, model_text, &err);
    if (rc == 0) rc = ember_serve_writer_dense(w, tower, l.n_params, &err);
    if (rc == 0)
        rc = ember_serve_writer_table(w, "emb", m.dim, keys, rows, TABLE_ROWS, NULL, 0, &err);
    if (rc == 0) /* first-order weights: any values will do */
        rc = ember_serve_writer_table(w, "lin", 1, keys, rows, TABLE_ROWS, NULL, 0, &err);
    if (rc == 0) {
        rc = ember_serve_writer_commit(w, &err);
        w = NULL;
    }
    ember_serve_writer_abort(w);
    CHECK_OK(rc, err);
    free(tower);
    free(keys);
    free(rows);
    return rc == 0 ? 0 : -1;
}

/* A batch of n rows: 8 fields of 1-3 keys each, drawn so that keys repeat and ~5% are absent. */
static su_batch make_batch(uint32_t n, uint64_t seed)
{
    su_batch b = {.n_rows = n, .n_dense = 4, .n_fields = 8};
    size_t slots = (size_t)n * b.n_fields;
    b.offsets = malloc((slots + 1) * sizeof *b.offsets);
    b.keys = malloc(slots * 3 * sizeof *b.keys);
    b.dense = malloc((size_t)n * b.n_dense * sizeof *b.dense);
    b.labels = NULL;
    b.weights = NULL;
    uint64_t s = seed;
    b.offsets[0] = 0;
    for (size_t r = 0; r < slots; r++) {
        uint32_t k = 1 + (uint32_t)(rng_next(&s) % 3);
        for (uint32_t j = 0; j < k; j++) {
            uint64_t u = rng_next(&s), i = u % 20 < 1 ? TABLE_ROWS + u % 1000 /* absent */
                                                      : (u >> 8) % (u % 2 ? 50 : TABLE_ROWS);
            b.keys[b.n_keys++] = key_of(i);
        }
        b.offsets[r + 1] = (uint32_t)b.n_keys;
    }
    for (size_t i = 0; i < (size_t)n * b.n_dense; i++)
        b.dense[i] = (float)(rng_next(&s) % 1000);
    return b;
}

static uint64_t digest(const float *p, size_t n)
{
    return cm_xxh3(p, n * sizeof *p);
}

/* Scores batch b on h into out; 0 or the error (reported). */
static int predict(const ember_serve *h, const su_batch *b, float *out)
{
    ember_serve_batch sb = su_serve_batch(b);
    char *err = NULL;
    int rc = ember_serve_predict(h, &sb, out, &err);
    CHECK_MSG(rc == 0, "ember_serve_predict (%u rows): %s", b->n_rows, err ? err : "?");
    free(err);
    return rc;
}

static su_batch batches[N_SIZES];
static float *ref[N_SIZES];
static ember_serve *shared;

typedef struct worker {
    int id;
    size_t bad, errors;
} worker;

static void *run_worker(void *arg)
{
    worker *w = arg;
    float *out = malloc(sizes[N_SIZES - 1] * sizeof *out);
    for (int round = 0; round < ROUNDS; round++)
        for (int j = 0; j < N_SIZES; j++) {
            int i = (j + w->id + round) % N_SIZES;
            if (predict(shared, &batches[i], out) != 0) {
                w->errors++;
                continue;
            }
            w->bad += memcmp(out, ref[i], sizes[i] * sizeof *out) != 0;
        }
    free(out);
    return NULL;
}

int main(void)
{
    if (su_init("serve_predict_state") != 0 || write_bundle() != 0) return check_done();
    for (int i = 0; i < N_SIZES; i++) {
        batches[i] = make_batch(sizes[i], 100 + (uint64_t)i);
        ref[i] = malloc(sizes[i] * sizeof(float));
    }
    float *out = malloc(sizes[N_SIZES - 1] * sizeof *out);

    /* A server's own OpenBLAS setting (read back: OpenBLAS may cap it). */
    openblas_set_num_threads(2);
    const int blas_threads = openblas_get_num_threads();
    fprintf(stderr, "    OpenBLAS threads %d, GEMMs: %s\n", blas_threads, backend_cpu_kernels());

    /* Each batch on a handle of its own: the references. */
    for (int i = 0; i < N_SIZES; i++) {
        ember_serve *h = su_open(su_path("b"), NULL);
        if (h == NULL || predict(h, &batches[i], ref[i]) != 0) return check_done();
        ember_serve_close(h);
        const int now = openblas_get_num_threads();
        CHECK_MSG(now == blas_threads,
                  "predict (%u rows) changed OpenBLAS's thread count from %d to %d", sizes[i],
                  blas_threads, now);
        openblas_set_num_threads(blas_threads);
        fprintf(stderr, "    %4u rows: predictions digest %016llx\n", sizes[i],
                (unsigned long long)digest(ref[i], sizes[i]));
    }

    /* One handle, sizes up and down: the same bits as each alone. */
    shared = su_open(su_path("b"), NULL);
    if (shared == NULL) return check_done();
    static const int order[] = {3, 0, 2, 1, 3, 1, 0, 2};
    for (size_t k = 0; k < sizeof order / sizeof order[0]; k++) {
        int i = order[k];
        if (predict(shared, &batches[i], out) != 0) break;
        CHECK_MSG(memcmp(out, ref[i], sizes[i] * sizeof *out) == 0,
                  "%u rows (call %zu on one handle) differ from a fresh handle's", sizes[i], k);
    }
    CHECK(openblas_get_num_threads() == blas_threads);

    /* 4 threads at once on that handle. */
    worker ws[N_THREADS];
    for (int i = 0; i < N_THREADS; i++)
        ws[i] = (worker){.id = i};
    su_run_threads(N_THREADS, run_worker, ws, sizeof ws[0]);
    for (int i = 0; i < N_THREADS; i++)
        CHECK_MSG(ws[i].bad == 0 && ws[i].errors == 0,
                  "thread %d: %zu predictions differ from one thread's, %zu errors", i, ws[i].bad,
                  ws[i].errors);
    CHECK(openblas_get_num_threads() == blas_threads);

    /* OpenBLAS on one thread instead. */
    openblas_set_num_threads(1);
    const bool own = strncmp(backend_cpu_kernels(), "ember-", 6) == 0;
    for (int i = 0; i < N_SIZES; i++) {
        if (predict(shared, &batches[i], out) != 0) break;
        double worst = 0;
        for (uint32_t r = 0; r < sizes[i]; r++)
            worst = fmax(worst, fabs((double)out[r] - (double)ref[i][r]));
        if (own)
            CHECK_MSG(memcmp(out, ref[i], sizes[i] * sizeof *out) == 0,
                      "%u rows: OpenBLAS on 1 thread changed the bits (by up to %g)", sizes[i],
                      worst);
        else
            CHECK_MSG(worst <= 1e-6, "%u rows: OpenBLAS on 1 thread: off by %g", sizes[i], worst);
    }
    CHECK(openblas_get_num_threads() == 1);

    ember_serve_close(shared);
    for (int i = 0; i < N_SIZES; i++) {
        free(batches[i].offsets);
        free(batches[i].keys);
        free(batches[i].dense);
        free(ref[i]);
    }
    free(out);
    return check_done();
}
