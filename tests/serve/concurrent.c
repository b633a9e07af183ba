/*
 * serve_concurrent: one handle (a deepfm base bundle with a delta applied) shared by 4 threads
 * that look up keys (every key of both tables plus misses, in chunks of varying sizes) and
 * predict every eval row, all at once, several rounds each: every result equals, bit for bit,
 * what one thread got alone beforehand.
 * And a bundle opened while exports replace it (one thread writes it again and again, two
 * versions in turn, while another opens it): every open succeeds and serves one version whole;
 * and two exports into one bundle at once both succeed, leaving one of them whole in place.
 */
#include "serve_util.h"

#define N_THREADS 4
#define ROUNDS 3

typedef struct ref_table {
    int t;
    uint32_t dim;
    uint64_t *keys;
    size_t n;
    float *out;
    uint8_t *found;
} ref_table;

static ember_serve *h;
static su_data eval;
static ref_table refs[2];
static float *ref_pred;

typedef struct worker {
    int id;
    size_t lookup_bad, pred_bad, errors, calls;
} worker;

static void *run_worker(void *arg)
{
    worker *w = arg;
    size_t maxdim = 16;
    float *out = malloc(8192 * maxdim * sizeof(float));
    uint8_t *found = malloc(8192);
    float *pred = malloc(eval.rows * sizeof(float) + 4);
    for (int round = 0; round < ROUNDS; round++) {
        for (int ti = 0; ti < 2; ti++) {
            const ref_table *r = &refs[(ti + w->id) % 2];
            size_t c = 1 + (size_t)w->id * 7 + (size_t)round * 13;
            for (size_t i = 0; i < r->n; i += c, c = c * 5 % 8191 + 1) {
                size_t k = r->n - i < c ? r->n - i : c;
                if (ember_serve_lookup(h, r->t, r->keys + i, k, out, found) != 0) {
                    w->errors++;
                    continue;
                }
                w->calls++;
                w->lookup_bad += memcmp(out, r->out + i * r->dim, k * r->dim * sizeof(float)) != 0 ||
                                 memcmp(found, r->found + i, k) != 0;
            }
        }
        /* predict every batch, starting at a thread-dependent batch */
        uint64_t *at = malloc(eval.n_b * sizeof *at);
        uint64_t pos = 0;
        for (size_t b = 0; b < eval.n_b; b++) at[b] = pos, pos += eval.b[b].n_rows;
        for (size_t j = 0; j < eval.n_b; j++) {
            size_t b = (j + (size_t)w->id * 3 + (size_t)round) % eval.n_b;
            ember_serve_batch sb = su_serve_batch(&eval.b[b]);
            char *err = NULL;
            if (ember_serve_predict(h, &sb, pred + at[b], &err) != 0) w->errors++;
            free(err);
            w->calls++;
        }
        w->pred_bad += memcmp(pred, ref_pred, eval.rows * sizeof(float)) != 0;
        free(at);
    }
    free(out);
    free(found);
    free(pred);
    return NULL;
}

/* ---- opening a bundle while an export replaces it ---- */

#define SWAP_ROWS 20000u
#define SWAP_WRITES 60
static volatile int swaps_done;

/* Bundle "live" at version v (1 or 2): an lr model whose tower and every lin row hold v. */
static int write_version(float v, char **err)
{
    /* The caller's own rows: two_exports runs this on two threads at once (static arrays were
     * filled by both, and a bundle of step 1 could hold version 2's rows). */
    uint64_t *keys = malloc(SWAP_ROWS * sizeof *keys);
    float *rows = malloc(SWAP_ROWS * sizeof *rows);
    if (keys == NULL || rows == NULL) {
        free(keys);
        free(rows);
        *err = strdup("out of memory");
        return -1;
    }
    for (uint32_t i = 0; i < SWAP_ROWS; i++) {
        keys[i] = i + 1;
        rows[i] = v;
    }
    const float tower[2] = {v, v};
    ember_serve_writer *w = NULL;
    int rc =
        ember_serve_writer_create(su_path("live"), EMBER_SERVE_FP32, 0, (uint64_t)v, 0, &w, err);
    if (rc == 0) rc = ember_serve_writer_model(w, "kind lr\nfields 2\ndense 1\ndim 1\n", err);
    if (rc == 0) rc = ember_serve_writer_dense(w, tower, 2, err);
    if (rc == 0) rc = ember_serve_writer_table(w, "lin", 1, keys, rows, SWAP_ROWS, NULL, 0, err);
    if (rc == 0) {
        rc = ember_serve_writer_commit(w, err);
        w = NULL;
    }
    ember_serve_writer_abort(w);
    free(keys);
    free(rows);
    return rc;
}

static void *swap_writer(void *arg)
{
    size_t *failed = arg;
    for (int i = 0; i < SWAP_WRITES; i++) {
        char *err = NULL;
        if (write_version((float)(1 + i % 2), &err) != 0) {
            if (*failed == 0) fprintf(stderr, "    export %d failed: %s\n", i, err ? err : "?");
            (*failed)++;
        }
        free(err);
    }
    __atomic_store_n(&swaps_done, 1, __ATOMIC_RELEASE);
    return NULL;
}

static void open_during_export(void)
{
    char *err = NULL;
    CHECK_OK(write_version(1, &err), err);
    size_t write_failed = 0, opens = 0, failed = 0, mixed = 0;
    pthread_t th;
    CHECK(pthread_create(&th, NULL, swap_writer, &write_failed) == 0);
    while (!__atomic_load_n(&swaps_done, __ATOMIC_ACQUIRE)) {
        ember_serve *hl = NULL;
        int rc = ember_serve_open(su_path("live"), &hl, &err);
        opens++;
        if (rc != 0) {
            if (failed++ == 0) fprintf(stderr, "    open failed: %s\n", err ? err : "?");
        } else {
            /* one version whole: its step, its rows */
            const uint64_t keys[2] = {1, SWAP_ROWS};
            float out[2];
            float v = (float)ember_serve_step(hl);
            if (ember_serve_lookup(hl, ember_serve_table(hl, "lin"), keys, 2, out, NULL) != 0 ||
                out[0] != v || out[1] != v)
                mixed++;
        }
        free(err);
        err = NULL;
        ember_serve_close(hl);
    }
    pthread_join(th, NULL);
    fprintf(stderr, "    %zu opens during %d exports: %zu failed, %zu mixed; %zu exports failed\n",
            opens, SWAP_WRITES, failed, mixed, write_failed);
    CHECK(opens > 0 && failed == 0 && mixed == 0 && write_failed == 0);
}

/* Two writers exporting into "live" at once, each its own version, several times. */
static void *version_writer(void *arg)
{
    size_t *failed = arg; /* [0]: the version, [1]: failures */
    for (int i = 0; i < 10; i++) {
        char *err = NULL;
        if (write_version((float)failed[0], &err) != 0) {
            if (failed[1] == 0) fprintf(stderr, "    export failed: %s\n", err ? err : "?");
            failed[1]++;
        }
        free(err);
    }
    return NULL;
}

static void two_exports(void)
{
    size_t st[2][2] = {{1, 0}, {2, 0}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        CHECK(pthread_create(&th[i], NULL, version_writer, st[i]) == 0);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    ember_serve *hl = su_open(su_path("live"), NULL);
    const uint64_t keys[2] = {1, SWAP_ROWS};
    float out[2] = {0, 0}, v = hl ? (float)ember_serve_step(hl) : 0;
    CHECK_MSG(st[0][1] == 0 && st[1][1] == 0 && hl &&
                  ember_serve_lookup(hl, ember_serve_table(hl, "lin"), keys, 2, out, NULL) == 0 &&
                  (v == 1 || v == 2) && out[0] == v && out[1] == v,
              "two exports at once: %zu and %zu failed; the bundle %s", st[0][1], st[1][1],
              hl ? "is not one version whole" : "does not open");
    ember_serve_close(hl);
}

int main(void)
{
    if (su_init("serve_concurrent") != 0) return check_done();
    open_during_export();
    two_exports();
    if (su_make_data(20000, 13) != 0 || su_train("deepfm") != 0) return check_done();
    int rc = su_ember("export --checkpoint run-deepfm/ckpt/step-20 --out base");
    if (rc == 0) rc = su_ember("export --checkpoint run-deepfm --since run-deepfm/ckpt/step-20 --out delta");
    CHECK(rc == 0);
    if (rc != 0) return check_done();
    h = su_open(su_path("base"), (const char *[]){su_path("delta"), NULL});
    if (h == NULL || su_data_load(su_path("shards/eval"), 512, &eval) != 0) return check_done();

    const char *names[2] = {"emb", "lin"};
    for (int ti = 0; ti < 2; ti++) {
        ref_table *r = &refs[ti];
        uint64_t *kb = NULL, *kd = NULL, nb = 0, nd = 0;
        su_table_keys(su_path("base"), names[ti], &kb, &nb, NULL, NULL);
        su_table_keys(su_path("delta"), names[ti], &kd, &nd, NULL, NULL);
        r->t = ember_serve_table(h, names[ti]);
        CHECK(r->t >= 0);
        r->dim = r->t >= 0 ? ember_serve_table_dim(h, r->t) : 1;
        CHECK(r->dim <= 16);
        r->n = nb + nd + 5000;
        r->keys = malloc(r->n * 8);
        memcpy(r->keys, kb, nb * 8);
        memcpy(r->keys + nb, kd, nd * 8);
        uint64_t x = 77;
        for (size_t i = nb + nd; i < r->n; i++) r->keys[i] = (x = x * 6364136223846793005ull + 1);
        for (size_t i = r->n - 1; i > 0; i--) { /* shuffle: hits and misses mixed */
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            size_t j = (size_t)((x >> 17) % (i + 1));
            uint64_t t = r->keys[i];
            r->keys[i] = r->keys[j];
            r->keys[j] = t;
        }
        r->out = malloc(r->n * r->dim * sizeof(float));
        r->found = malloc(r->n);
        CHECK(ember_serve_lookup(h, r->t, r->keys, r->n, r->out, r->found) == 0);
        size_t f = 0;
        for (size_t i = 0; i < r->n; i++) f += r->found[i];
        fprintf(stderr, "    %s: %zu keys, %zu found\n", names[ti], r->n, f);
        CHECK(f >= nb && f < r->n);
        free(kb);
        free(kd);
    }
    ref_pred = malloc(eval.rows * sizeof(float));
    if (su_predict_all(h, &eval, ref_pred) != 0) return check_done();

    double t0 = cm_now();
    worker ws[N_THREADS];
    for (int i = 0; i < N_THREADS; i++)
        ws[i] = (worker){.id = i};
    su_run_threads(N_THREADS, run_worker, ws, sizeof ws[0]);
    for (int i = 0; i < N_THREADS; i++) {
        fprintf(stderr, "    thread %d: %zu calls, %zu lookup chunks differ, %zu prediction rounds "
                        "differ, %zu errors\n", i, ws[i].calls, ws[i].lookup_bad, ws[i].pred_bad,
                ws[i].errors);
        CHECK(ws[i].calls > 0 && ws[i].lookup_bad == 0 && ws[i].pred_bad == 0 && ws[i].errors == 0);
    }
    fprintf(stderr, "    %d threads x %d rounds in %.2f s\n", N_THREADS, ROUNDS, cm_now() - t0);
    for (int ti = 0; ti < 2; ti++) {
        free(refs[ti].keys);
        free(refs[ti].out);
        free(refs[ti].found);
    }
    free(ref_pred);
    su_data_free(&eval);
    ember_serve_close(h);
    return check_done();
}
