/*
 * serve_prepack: a serving handle lays out its tower's weights once, not on every predict call.
 * For each model kind a bundle supports (lr, mlp, dlrm, deepfm, and an mlp whose widths are
 * not multiples of 32), a bundle written with the writer API (random tower and rows), then a
 * delta with another tower stacked on it:
 *   - every prediction, for batches of 1, 16 and 256 rows with keys spread over the table (the
 *     top MLP's first layer as a GEMM) and with keys repeating (the factorized first layer
 *     where the model takes it), is the same bits as the training backend's forward pass
 *     (backend_cpu_ops.step on 2 threads, flags 0) over the same rows and tower;
 *   - once a handle has scored each batch, scoring them again packs no weight matrix
 *     (backend_cpu_weight_packs on the calling thread); every call packed the tower's layers
 *     before (the 3 GEMMs and W1's blocks of an mlp, for each call).
 * The delta's checks catch packed weights left over from the base.
 */
#include "rng.h"
#include "serve_util.h"
#include "src/model.h"

#define F 8u
#define D 4u
#define TABLE_ROWS 3000u
#define N_SIZES 3
#define N_SHAPES 2 /* keys spread, keys repeating */

static const uint32_t sizes[N_SIZES] = {1, 16, 256};

typedef struct preset {
    const char *name;
    model_kind kind;
    uint32_t hidden[2]; /* 0: the preset's default */
} preset;

static const preset presets[] = {
    {"lr", MODEL_LR, {0, 0}},        {"mlp", MODEL_MLP, {64, 32}},
    {"dlrm", MODEL_DLRM, {64, 32}},  {"deepfm", MODEL_DEEPFM, {64, 32}},
    {"mlp-48", MODEL_MLP, {48, 24}}, /* the factorized layer's portable kernels; padded panels */
};

/* Key i of the tables (i < TABLE_ROWS); larger i are absent. */
static uint64_t key_of(uint64_t i)
{
    return i * 0x9e3779b97f4a7c15ull + 1;
}

typedef struct model {
    model_cfg m;
    model_layout l;
    int mean_pool;
    char text[512];
    float *tower[2]; /* the base's, the delta's */
} model;

static int model_make(const preset *p, model *md)
{
    memset(md, 0, sizeof *md);
    model_cfg_preset(&md->m, p->kind, F, D);
    if (p->hidden[0]) {
        md->m.hidden[0] = p->hidden[0];
        md->m.hidden[1] = p->hidden[1];
    }
    if (p->kind == MODEL_DLRM) md->m.bottom[0] = 32;
    md->m.seed = 7;
    char *err = NULL;
    int rc = model_cfg_format(&md->m, 0, md->text, sizeof md->text) < 0 ? -1 : 0;
    if (rc == 0) rc = model_layout_make(&md->m, &md->l, &err);
    CHECK_OK(rc, err);
    for (int v = 0; rc == 0 && v < 2; v++) {
        md->tower[v] = malloc(md->l.n_params * sizeof(float));
        model_init_params(&md->m, &md->l, md->tower[v]);
        for (size_t i = 0; i < md->l.n_params; i++) /* non-zero biases; the delta's differ */
            md->tower[v][i] += (float)unif(-0.01, 0.01);
    }
    return rc;
}

static const char *table_name(const model *md, uint32_t t)
{
    return (int)t == md->l.lin_table ? "lin" : "emb";
}

/* Bundle dir: version v's tower and random rows for keys [0, n) of each table (the base: all
 * of them; the delta: some). */
static int write_bundle(const model *md, const char *dir, int v, uint32_t n)
{
    ember_serve_writer *w = NULL;
    char *err = NULL;
    int rc =
        ember_serve_writer_create(dir, EMBER_SERVE_FP32, v, 1 + (uint64_t)v, (uint64_t)v, &w, &err);
    if (rc == 0) rc = ember_serve_writer_model(w, md->text, &err);
    if (rc == 0) rc = ember_serve_writer_dense(w, md->tower[v], md->l.n_params, &err);
    uint64_t *keys = malloc(n * sizeof *keys);
    float *rows = malloc((size_t)n * md->m.dim * sizeof *rows);
    for (uint32_t t = 0; rc == 0 && t < md->l.n_tables; t++) {
        const uint32_t dim = md->l.table_dim[t];
        for (uint32_t i = 0; i < n; i++) {
            keys[i] = key_of(v ? i * 7 % TABLE_ROWS : i);
            for (uint32_t j = 0; j < dim; j++)
                rows[(size_t)i * dim + j] = (float)unif(-0.1, 0.1);
        }
        rc = ember_serve_writer_table(w, table_name(md, t), dim, keys, rows, n, NULL, 0, &err);
    }
    if (rc == 0) {
        rc = ember_serve_writer_commit(w, &err);
        w = NULL;
    }
    ember_serve_writer_abort(w);
    CHECK_OK(rc, err);
    free(keys);
    free(rows);
    return rc;
}

/* n rows of 1-3 keys a field, ~5% absent: drawn from the whole table (spread), or from 3 keys
 * a field (repeating: the factorized layer's kind of batch). */
static su_batch make_batch(uint32_t n, int repeating)
{
    su_batch b = {.n_rows = n, .n_dense = D, .n_fields = F};
    const size_t slots = (size_t)n * F;
    b.offsets = malloc((slots + 1) * sizeof *b.offsets);
    b.keys = malloc(slots * 3 * sizeof *b.keys);
    b.dense = malloc((size_t)n * D * sizeof *b.dense);
    b.offsets[0] = 0;
    for (size_t r = 0; r < slots; r++) {
        const uint32_t k = repeating ? 1 : 1 + rndu(3), f = (uint32_t)(r % F);
        for (uint32_t j = 0; j < k; j++) {
            uint64_t i = repeating ? f * 100 + rndu(3) : rndu(TABLE_ROWS);
            if (!repeating && rndu(20) == 0) i = TABLE_ROWS + rndu(1000);
            b.keys[b.n_keys++] = key_of(i);
        }
        b.offsets[r + 1] = (uint32_t)b.n_keys;
    }
    for (size_t i = 0; i < (size_t)n * D; i++)
        b.dense[i] = (float)unif(-5.0, 500.0);
    return b;
}

/* The training backend's forward pass over b with rows looked up in h: probs (b->n_rows). */
static int reference(const model *md, const float *tower, const ember_serve *h, const su_batch *b,
                     float *probs)
{
    model_staging ms = {0};
    const model_input in = {b->n_rows, b->n_dense, b->n_fields, NULL,
                            b->dense,  b->offsets, b->keys,     b->weights};
    char *err = NULL;
    int rc = model_staging_build(&ms, &md->m, &md->l, md->mean_pool, &in, &err);
    for (uint32_t t = 0; rc == 0 && t < md->l.n_tables; t++)
        rc = ember_serve_lookup(h, ember_serve_table(h, table_name(md, t)), ms.ukeys, ms.U,
                                ms.emb[t], NULL);
    void *state = NULL;
    if (rc == 0) rc = backend_cpu_ops.create(&md->m, &md->l, ms.B, ms.U, 2, 0, &state, &err);
    if (rc == 0) {
        model_batch mb;
        model_staging_view(&ms, &mb);
        mb.labels = NULL;
        rc = backend_cpu_ops.step(state, tower, &mb, probs, NULL, NULL, NULL, &err);
    }
    CHECK_OK(rc, err);
    if (state) backend_cpu_ops.destroy(state);
    model_staging_fini(&ms);
    return rc;
}

static su_batch batches[N_SIZES][N_SHAPES];

/* Scores every batch on h twice: each time the reference's bits; the second round packs no
 * weights. */
static void check_handle(const preset *p, const model *md, const float *tower, const ember_serve *h,
                         const char *what)
{
    float *ref = malloc(sizes[N_SIZES - 1] * sizeof *ref);
    float *out = malloc(sizes[N_SIZES - 1] * sizeof *out);
    uint64_t packs[2] = {0, 0};
    for (int round = 0; round < 2; round++)
        for (int i = 0; i < N_SIZES; i++)
            for (int s = 0; s < N_SHAPES; s++) {
                const su_batch *b = &batches[i][s];
                if (reference(md, tower, h, b, ref) != 0) goto out;
                ember_serve_batch sb = su_serve_batch(b);
                char *err = NULL;
                const uint64_t p0 = backend_cpu_weight_packs();
                int rc = ember_serve_predict(h, &sb, out, &err);
                packs[round] += backend_cpu_weight_packs() - p0;
                CHECK_OK(rc, err);
                if (rc != 0) goto out;
                uint32_t diff = 0;
                for (uint32_t r = 0; r < b->n_rows; r++)
                    diff += check_u32_of(out[r]) != check_u32_of(ref[r]);
                CHECK_MSG(diff == 0,
                          "%s %s, %u rows (keys %s, round %d): %u predictions differ from the "
                          "training backend's (row 0: %.9g against %.9g)",
                          p->name, what, b->n_rows, s ? "repeating" : "spread", round, diff,
                          (double)out[0], (double)ref[0]);
            }
    fprintf(stderr,
            "    %-6s %-5s: weight matrices packed: %llu by the first round of %d calls, "
            "%llu by the second\n",
            p->name, what, (unsigned long long)packs[0], N_SIZES * N_SHAPES,
            (unsigned long long)packs[1]);
    /* OpenBLAS (a CPU with neither AVX-512 nor AVX2) packs inside each of its GEMMs, and the
     * count takes those too: there only the bits are checked. */
    CHECK_MSG(packs[1] == 0 || strncmp(backend_cpu_kernels(), "ember-", 6) != 0,
              "%s %s: predicting batches the handle has scored before packed weight matrices "
              "%llu times (every call repacks the tower)",
              p->name, what, (unsigned long long)packs[1]);
out:
    free(ref);
    free(out);
}

int main(void)
{
    if (su_init("serve_prepack") != 0) return check_done();
    rng_state = 11;
    fprintf(stderr, "    GEMMs: %s\n", backend_cpu_kernels());
    for (int i = 0; i < N_SIZES; i++)
        for (int s = 0; s < N_SHAPES; s++)
            batches[i][s] = make_batch(sizes[i], s);
    for (size_t k = 0; k < sizeof presets / sizeof presets[0]; k++) {
        const preset *p = &presets[k];
        model md;
        char base[64], delta[64];
        snprintf(base, sizeof base, "%s-base", p->name);
        snprintf(delta, sizeof delta, "%s-delta", p->name);
        if (model_make(p, &md) != 0 || write_bundle(&md, su_path(base), 0, TABLE_ROWS) != 0 ||
            write_bundle(&md, su_path(delta), 1, TABLE_ROWS / 10) != 0)
            return check_done();
        ember_serve *h = su_open(su_path(base), NULL);
        if (h == NULL) return check_done();
        check_handle(p, &md, md.tower[0], h, "base");
        char *err = NULL;
        int rc = ember_serve_apply_delta(h, su_path(delta), &err);
        CHECK_OK(rc, err);
        if (rc == 0) check_handle(p, &md, md.tower[1], h, "delta");
        ember_serve_close(h);
        free(md.tower[0]);
        free(md.tower[1]);
    }
    for (int i = 0; i < N_SIZES; i++)
        for (int s = 0; s < N_SHAPES; s++) {
            free(batches[i][s].offsets);
            free(batches[i][s].keys);
            free(batches[i][s].dense);
        }
    return check_done();
}
