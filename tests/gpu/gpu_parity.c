/*
 * The cuda backend against the cpu backend (the reference), for every preset.
 *
 * Without a usable device (cudaGetDeviceCount fails or finds none) it prints "SKIPPED: no
 * CUDA device" and exits 77, which ctest reports as skipped.
 *
 * Each case is a random batch in the model's layout: multi-hot CSR rows of 0..4 keys (empty
 * fields, one sample with every field empty, keys repeated inside a field, keys of the U never
 * used), mean or sum pooling values, optionally times a per-key weight; random parameters
 * (biases too), dense values and pulled rows. Every CUDA output (probs, loss, dparams, demb) is
 * filled with NaN before each step, so an element the backend does not write fails. Elements
 * must agree within 1e-5 relative; the absolute floor is 1e-5 of the largest magnitude in that
 * output, because cuBLAS, cuSPARSE and the tree reductions sum in other orders than OpenBLAS and
 * the CPU loops, and a sum that cancels (a bias gradient: the sum of p - y over the batch) keeps
 * the absolute error of its terms, not a relative one.
 *
 * Also on the device: several batch sizes through one state (sized at create, then reused),
 * a batch with more distinct keys than the first, the forward-only call, a batch without
 * labels (loss 0; backward refused), bit-identical repeats, shape errors, an empty batch.
 *
 * And the trainer's path, backend_ops.prefetch (model.h): two batches pending at once, each
 * stepped under its ticket; a prefetch on another thread while a step computes (the copy
 * stream against the compute stream, slots reused); the batch's host arrays poisoned right
 * after prefetch (it must not read them again); stale tickets refused; a step without a
 * ticket dropping what is pending; more pooling entries than create sized the slots for.
 */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdint.h>

#include "check.h"
#include "rng.h"
#include "src/model.h"

static const backend_ops *cuda; /* the cuda backend, loaded in main */

typedef struct batch {
    uint32_t B, F, D, U;
    float *dense, *labels, *val, *emb[MODEL_MAX_TABLES];
    uint32_t *row_ptr, *col;
    model_batch mb;
} batch;

static void batch_free(batch *b)
{
    free(b->dense);
    free(b->labels);
    free(b->val);
    free(b->row_ptr);
    free(b->col);
    for (int t = 0; t < MODEL_MAX_TABLES; t++) free(b->emb[t]);
    memset(b, 0, sizeof *b);
}

/* A random batch of B rows over U distinct keys (the last few never used). */
static void batch_make(batch *b, const model_layout *l, uint32_t B, uint32_t F, uint32_t D,
                       uint32_t U, int mean, int key_weights)
{
    memset(b, 0, sizeof *b);
    b->B = B;
    b->F = F;
    b->D = D;
    b->U = U;
    size_t rows = (size_t)B * F;
    b->row_ptr = malloc((rows + 1) * sizeof(uint32_t));
    b->col = malloc(rows * 4 * sizeof(uint32_t) + 4);
    b->val = malloc(rows * 4 * sizeof(float) + 4);
    b->dense = malloc((size_t)B * D * sizeof(float) + 4);
    b->labels = malloc(B * sizeof(float) + 4);
    uint32_t used = U > 3 ? U - 2 : U, nnz = 0;
    b->row_ptr[0] = 0;
    for (size_t r = 0; r < rows; r++) {
        uint32_t len = used ? rndu(5) : 0; /* 0..4; 0 is an empty field */
        if (r / F == 1) len = 0;        /* sample 1: every field empty */
        float w = mean && len ? 1.0f / (float)len : 1.0f;
        for (uint32_t k = 0; k < len; k++) {
            /* Sometimes repeat the previous key of this field (a key listed twice). */
            uint32_t c = k && rndu(4) == 0 ? b->col[nnz - 1] : rndu(used);
            b->col[nnz] = c;
            b->val[nnz] = key_weights ? w * unif(0.2f, 2.0f) : w;
            nnz++;
        }
        b->row_ptr[r + 1] = nnz;
    }
    for (size_t i = 0; i < (size_t)B * D; i++) b->dense[i] = unif(-2.0f, 2.0f);
    for (uint32_t i = 0; i < B; i++) b->labels[i] = rndu(2) ? 1.0f : 0.0f;
    for (uint32_t t = 0; t < l->n_tables; t++) {
        size_t n = (size_t)U * l->table_dim[t];
        b->emb[t] = malloc(n * sizeof(float) + 4);
        for (size_t i = 0; i < n; i++) b->emb[t][i] = unif(-0.5f, 0.5f);
    }
    model_batch *mb = &b->mb;
    mb->B = B;
    mb->F = F;
    mb->D = D;
    mb->U = U;
    mb->dense = b->dense;
    mb->labels = b->labels;
    mb->row_ptr = b->row_ptr;
    mb->col = b->col;
    mb->val = b->val;
    for (uint32_t t = 0; t < l->n_tables; t++) mb->emb[t] = b->emb[t];
}

/* One step's outputs. */
typedef struct outs {
    float *probs, *dparams, *demb[MODEL_MAX_TABLES];
    double loss;
} outs;

/* Every table slot not allocated stays NULL, so outs_free can free all of them. */
static void outs_alloc(outs *o, const model_layout *l, uint32_t B, uint32_t U)
{
    memset(o, 0, sizeof *o);
    o->probs = malloc(B * sizeof(float) + 4);
    o->dparams = malloc(l->n_params * sizeof(float) + 4);
    for (uint32_t t = 0; t < l->n_tables; t++)
        o->demb[t] = malloc((size_t)U * l->table_dim[t] * sizeof(float) + 4);
}

static void outs_free(outs *o)
{
    free(o->probs);
    free(o->dparams);
    for (int t = 0; t < MODEL_MAX_TABLES; t++) free(o->demb[t]);
    memset(o, 0, sizeof *o);
}

static void outs_poison(outs *o, const model_layout *l, uint32_t B, uint32_t U)
{
    for (uint32_t i = 0; i < B; i++) o->probs[i] = NAN;
    for (size_t i = 0; i < l->n_params; i++) o->dparams[i] = NAN;
    for (uint32_t t = 0; t < l->n_tables; t++)
        for (size_t i = 0; i < (size_t)U * l->table_dim[t]; i++) o->demb[t][i] = NAN;
    o->loss = NAN;
}

/* Elementwise |got - want| <= 1e-5 (|want| + max|want|); NaN never passes. */
static int close_arrays(const char *what, const float *got, const float *want, size_t n)
{
    float mx = 0;
    for (size_t i = 0; i < n; i++) mx = fabsf(want[i]) > mx ? fabsf(want[i]) : mx;
    double floor = 1e-5 * mx + 1e-30, worst = 0;
    size_t bad = 0, first = n;
    for (size_t i = 0; i < n; i++) {
        double diff = fabs((double)got[i] - (double)want[i]);
        double tol = 1e-5 * fabs((double)want[i]) + floor;
        if (!(diff <= tol)) {
            if (bad++ == 0) first = i;
        }
        double used = diff / tol; /* the share of the budget this element uses */
        if (used > worst || used != used) worst = used;
    }
    if (bad)
        fprintf(stderr, "  %s: %zu of %zu elements differ; first [%zu] cuda %.9g cpu %.9g (max|cpu| %g)\n",
                what, bad, n, first, got[first], want[first], mx);
    else
        fprintf(stderr, "  %s: %zu elements, at most %.3g of the tolerance used\n", what, n, worst);
    return bad == 0;
}

static int same_bits(const float *a, const float *b, size_t n)
{
    return n == 0 || memcmp(a, b, n * sizeof(float)) == 0;
}

/* A's columns for mb->t_ptr/t_row/t_val, built as the trainer's staging builds them
 * (model_staging_index): per key, its entries' CSR rows ascending. The caller frees the three. */
static void batch_columns(const batch *b, model_batch *mb)
{
    const size_t rows = (size_t)b->B * b->F, nnz = b->row_ptr[rows];
    uint32_t *ptr = calloc((size_t)b->U + 1, sizeof *ptr), *row = malloc(nnz * sizeof *row + 4);
    float *val = malloc(nnz * sizeof *val + 4);
    for (size_t k = 0; k < nnz; k++)
        ptr[b->col[k] + 1]++;
    for (uint32_t u = 0; u < b->U; u++)
        ptr[u + 1] += ptr[u];
    uint32_t *at = malloc(((size_t)b->U + 1) * sizeof *at);
    memcpy(at, ptr, ((size_t)b->U + 1) * sizeof *at);
    for (size_t r = 0; r < rows; r++)
        for (uint32_t k = b->row_ptr[r]; k < b->row_ptr[r + 1]; k++) {
            row[at[b->col[k]]] = (uint32_t)r;
            val[at[b->col[k]]++] = b->val[k];
        }
    free(at);
    mb->t_ptr = ptr;
    mb->t_row = row;
    mb->t_val = val;
}

/* Whether two training steps' outputs (B rows, U keys) are the same bits, loss included. */
static int same_outs(const model_layout *l, const outs *a, const outs *b, uint32_t B, uint32_t U)
{
    int same = same_bits(a->probs, b->probs, B) && same_bits(a->dparams, b->dparams, l->n_params) &&
               memcmp(&a->loss, &b->loss, sizeof a->loss) == 0;
    for (uint32_t t = 0; t < l->n_tables; t++)
        same = same && same_bits(a->demb[t], b->demb[t], (size_t)U * l->table_dim[t]);
    return same;
}

/* Runs both backends on one batch and compares everything; with_bwd 0 is forward only. */
static void compare_step(const char *name, const model_layout *l, void *gpu, void *cpu,
                         const float *params, const batch *b, int with_bwd)
{
    char *err = NULL;
    outs g, c;
    outs_alloc(&g, l, b->B, b->U);
    outs_alloc(&c, l, b->B, b->U);
    int rc = backend_cpu_ops.step(cpu, params, &b->mb, c.probs, &c.loss, with_bwd ? c.dparams : NULL,
                                  with_bwd ? c.demb : NULL, &err);
    CHECK_OK(rc, err);
    /* First (so that the slot holds another batch's inputs), a training step given A's
     * columns as the trainer stages them, which pack then copies instead of building. */
    outs gc;
    outs_alloc(&gc, l, b->B, b->U);
    model_batch mc = b->mb;
    if (with_bwd) {
        batch_columns(b, &mc);
        outs_poison(&gc, l, b->B, b->U);
        rc = cuda->step(gpu, params, &mc, gc.probs, &gc.loss, gc.dparams, gc.demb, &err);
        CHECK_OK(rc, err);
    }
    outs_poison(&g, l, b->B, b->U);
    rc = cuda->step(gpu, params, &b->mb, g.probs, &g.loss, with_bwd ? g.dparams : NULL,
                                with_bwd ? g.demb : NULL, &err);
    CHECK_OK(rc, err);
    if (with_bwd) {
        int same = same_outs(l, &g, &gc, b->B, b->U);
        CHECK_MSG(same, "%s: a step given A's columns is not bit-identical", name);
        free((void *)mc.t_ptr);
        free((void *)mc.t_row);
        free((void *)mc.t_val);
    }
    outs_free(&gc);
    fprintf(stderr, "%s B %u U %u %s:\n", name, b->B, b->U, with_bwd ? "train" : "forward");
    CHECK_MSG(close_arrays("probs", g.probs, c.probs, b->B), "%s probs", name);
    double ldiff = fabs(g.loss - c.loss);
    CHECK_MSG(ldiff <= 1e-5 * fabs(c.loss) + 1e-7, "%s loss cuda %.9g cpu %.9g", name, g.loss, c.loss);
    if (with_bwd) {
        CHECK_MSG(close_arrays("dparams", g.dparams, c.dparams, l->n_params), "%s dparams", name);
        for (uint32_t t = 0; t < l->n_tables; t++) {
            char what[32];
            snprintf(what, sizeof what, "demb[%u]", t);
            CHECK_MSG(close_arrays(what, g.demb[t], c.demb[t], (size_t)b->U * l->table_dim[t]),
                      "%s %s", name, what);
        }
        /* The same step again: bit-identical (no atomics, fixed reduction orders). */
        outs g2;
        outs_alloc(&g2, l, b->B, b->U);
        outs_poison(&g2, l, b->B, b->U);
        rc = cuda->step(gpu, params, &b->mb, g2.probs, &g2.loss, g2.dparams, g2.demb, &err);
        CHECK_OK(rc, err);
        int same = same_outs(l, &g, &g2, b->B, b->U);
        CHECK_MSG(same, "%s: a repeated step is not bit-identical", name);
        outs_free(&g2);
    }
    outs_free(&g);
    outs_free(&c);
}

/* A prefetch on its own thread, as the trainer's prefetch thread makes it. */
typedef struct pf_job {
    void *gpu;
    const float *params;
    model_batch *mb;
    int rc;
    char *err;
} pf_job;

static void *pf_main(void *arg)
{
    pf_job *j = arg;
    j->rc = cuda->prefetch(j->gpu, j->params, j->mb, &j->mb->ticket, &j->err);
    return NULL;
}

static void prefetch_ok(void *gpu, const float *params, batch *b)
{
    char *err = NULL;
    b->mb.ticket = 0;
    CHECK_OK(cuda->prefetch(gpu, params, &b->mb, &b->mb.ticket, &err), err);
    CHECK(b->mb.ticket != 0);
}

/* A step that must fail with an error mentioning `what`. */
static void step_fails(void *gpu, const float *params, const batch *b, const char *what)
{
    char *err = NULL;
    float *probs = malloc(b->B * sizeof(float) + 4);
    double loss;
    int rc = cuda->step(gpu, params, &b->mb, probs, &loss, NULL, NULL, &err);
    CHECK_MSG(rc != 0 && err && strstr(err, what), "expected an error about '%s', got rc %d: %s",
              what, rc, err ? err : "(none)");
    free(err);
    free(probs);
}

static void run_prefetch(const char *name, const model_layout *l, void *gpu, void *cpu,
                         const float *params, uint32_t F, uint32_t D, int mean, int key_weights)
{
    const uint32_t shapes[][2] = {{300, 700}, {128, 1500}, {64, 40}, {300, 2000}};
    batch b[4];
    for (int i = 0; i < 4; i++)
        batch_make(&b[i], l, shapes[i][0], F, D, shapes[i][1], mean, key_weights);
    char *err = NULL;

    /* Two pending, then stepped in order (compare_step repeats each under its ticket). */
    prefetch_ok(gpu, params, &b[0]);
    prefetch_ok(gpu, params, &b[1]);
    CHECK(b[0].mb.ticket != b[1].mb.ticket);
    compare_step(name, l, gpu, cpu, params, &b[0], 1);
    /* b[2] reuses b[0]'s slot on another thread while b[1] steps here. */
    pf_job job = {gpu, params, &b[2].mb, -1, NULL};
    b[2].mb.ticket = 0;
    pthread_t th;
    CHECK(pthread_create(&th, NULL, pf_main, &job) == 0);
    compare_step(name, l, gpu, cpu, params, &b[1], 1);
    pthread_join(th, NULL);
    CHECK_OK(job.rc, job.err);
    compare_step(name, l, gpu, cpu, params, &b[2], 0);
    compare_step(name, l, gpu, cpu, params, &b[2], 1);
    step_fails(gpu, params, &b[0], "ticket"); /* its slot holds b[2] now */

    /* Prefetch reads the batch during the call only: poison it afterwards. */
    {
        outs c;
        outs_alloc(&c, l, b[3].B, b[3].U);
        CHECK_OK(
            backend_cpu_ops.step(cpu, params, &b[3].mb, c.probs, &c.loss, c.dparams, c.demb, &err),
            err);
        prefetch_ok(gpu, params, &b[3]);
        float *pz = malloc(l->n_params * sizeof(float) + 4);
        for (size_t i = 0; i < l->n_params; i++)
            pz[i] = NAN;
        for (size_t i = 0; i < (size_t)b[3].B * D; i++)
            b[3].dense[i] = NAN;
        for (uint32_t i = 0; i < b[3].B; i++)
            b[3].labels[i] = NAN;
        for (uint32_t k = 0; k < b[3].row_ptr[b[3].B * F]; k++)
            b[3].val[k] = NAN, b[3].col[k] = 0;
        for (uint32_t t = 0; t < l->n_tables; t++)
            for (size_t i = 0; i < (size_t)b[3].U * l->table_dim[t]; i++)
                b[3].emb[t][i] = NAN;
        outs g;
        outs_alloc(&g, l, b[3].B, b[3].U);
        outs_poison(&g, l, b[3].B, b[3].U);
        CHECK_OK(
            cuda->step(gpu, pz, &b[3].mb, g.probs, &g.loss, g.dparams, g.demb, &err),
            err);
        fprintf(stderr, "%s B %u U %u prefetched, then poisoned:\n", name, b[3].B, b[3].U);
        CHECK_MSG(close_arrays("probs", g.probs, c.probs, b[3].B), "%s poisoned probs", name);
        CHECK_MSG(close_arrays("dparams", g.dparams, c.dparams, l->n_params), "%s poisoned dparams",
                  name);
        for (uint32_t t = 0; t < l->n_tables; t++)
            CHECK_MSG(close_arrays("demb", g.demb[t], c.demb[t], (size_t)b[3].U * l->table_dim[t]),
                      "%s poisoned demb[%u]", name, t);
        free(pz);
        outs_free(&g);
        outs_free(&c);
    }

    /* In two calls, as the trainer hands a batch over when it pulls its rows in two parts:
     * prefetch_begin reads all but the params and the rows from `ready` on, prefetch_end reads
     * those. Rows past `ready` are NaN during the first call and everything is NaN after the
     * second: the step must still give the bits one prefetch gives. */
    if (cuda->prefetch_begin != NULL) {
        batch x;
        batch_make(&x, l, 300, F, D, 1500, mean, key_weights);
        outs g1, g2;
        outs_alloc(&g1, l, x.B, x.U);
        outs_alloc(&g2, l, x.B, x.U);
        prefetch_ok(gpu, params, &x);
        outs_poison(&g1, l, x.B, x.U);
        CHECK_OK(cuda->step(gpu, params, &x.mb, g1.probs, &g1.loss, g1.dparams, g1.demb, &err),
                 err);
        const uint32_t ready = x.U / 3;
        float *keep[MODEL_MAX_TABLES] = {0};
        for (uint32_t t = 0; t < l->n_tables; t++) {
            size_t off = (size_t)ready * l->table_dim[t], n = (size_t)x.U * l->table_dim[t] - off;
            keep[t] = malloc(n * sizeof(float) + 4);
            memcpy(keep[t], x.emb[t] + off, n * sizeof(float));
            for (size_t i = 0; i < n; i++)
                x.emb[t][off + i] = NAN;
        }
        x.mb.ticket = 0;
        CHECK_OK(cuda->prefetch_begin(gpu, &x.mb, ready, &err), err);
        for (uint32_t t = 0; t < l->n_tables; t++) {
            size_t off = (size_t)ready * l->table_dim[t], n = (size_t)x.U * l->table_dim[t] - off;
            memcpy(x.emb[t] + off, keep[t], n * sizeof(float));
            free(keep[t]);
        }
        float *pz = malloc(l->n_params * sizeof(float) + 4);
        memcpy(pz, params, l->n_params * sizeof(float));
        CHECK_OK(cuda->prefetch_end(gpu, pz, &x.mb, &x.mb.ticket, &err), err);
        CHECK(x.mb.ticket != 0);
        for (size_t i = 0; i < l->n_params; i++)
            pz[i] = NAN;
        for (uint32_t t = 0; t < l->n_tables; t++)
            for (size_t i = 0; i < (size_t)x.U * l->table_dim[t]; i++)
                x.emb[t][i] = NAN;
        for (size_t i = 0; i < (size_t)x.B * D; i++)
            x.dense[i] = NAN;
        for (uint32_t k = 0; k < x.row_ptr[x.B * F]; k++)
            x.val[k] = NAN;
        outs_poison(&g2, l, x.B, x.U);
        CHECK_OK(cuda->step(gpu, pz, &x.mb, g2.probs, &g2.loss, g2.dparams, g2.demb, &err), err);
        int same = same_outs(l, &g1, &g2, x.B, x.U);
        CHECK_MSG(same, "%s: a batch handed over in two calls is not the same bits", name);
        /* prefetch_end needs its prefetch_begin as the last prefetch call. */
        uint64_t tk = 0;
        CHECK(cuda->prefetch_end(gpu, params, &x.mb, &tk, &err) != 0 && err && tk == 0);
        free(err);
        err = NULL;
        CHECK_OK(cuda->prefetch_begin(gpu, &b[1].mb, 0, &err), err);
        prefetch_ok(gpu, params, &b[1]);
        CHECK(cuda->prefetch_end(gpu, params, &b[1].mb, &tk, &err) != 0 && err);
        free(err);
        err = NULL;
        free(pz);
        outs_free(&g1);
        outs_free(&g2);
        batch_free(&x);
    }

    /* A step without a ticket drops the pending batches. */
    prefetch_ok(gpu, params, &b[1]);
    uint64_t t1 = b[1].mb.ticket;
    b[1].mb.ticket = 0;
    compare_step(name, l, gpu, cpu, params, &b[1], 1);
    b[1].mb.ticket = t1;
    step_fails(gpu, params, &b[1], "ticket");
    /* A ticket's batch must be the one prefetched. */
    prefetch_ok(gpu, params, &b[1]);
    b[2].mb.ticket = b[1].mb.ticket;
    step_fails(gpu, params, &b[2], "not the one prefetched");
    for (int i = 0; i < 4; i++)
        batch_free(&b[i]);
}

static void run_model(model_kind kind, int mean, int key_weights)
{
    char name[64];
    snprintf(name, sizeof name, "%s/%s%s", model_kind_name(kind), mean ? "mean" : "sum",
             key_weights ? "+weights" : "");
    const uint32_t F = 6, D = 5, max_b = 300, max_u = 5000;
    model_cfg m;
    model_layout l;
    char *err = NULL;
    model_cfg_preset(&m, kind, F, D);
    CHECK_OK(model_layout_make(&m, &l, &err), err);
    float *params = malloc(l.n_params * sizeof(float));
    model_init_params(&m, &l, params);
    /* Non-zero biases and first-order weights, so every parameter's path matters. */
    for (size_t i = 0; i < l.n_params; i++)
        if (params[i] == 0.0f) params[i] = unif(-0.1f, 0.1f);
    void *gpu = NULL, *cpu = NULL;
    CHECK_OK(cuda->create(&m, &l, max_b, max_u, 1, 0, &gpu, &err), err);
    CHECK_OK(backend_cpu_ops.create(&m, &l, max_b, max_u, 1, 0, &cpu, &err), err);
    if (gpu == NULL || cpu == NULL) goto out;

    /* Growing, shrinking, then growing U past everything seen before. */
    const uint32_t shapes[][2] = {{64, 40}, {300, 700}, {37, 20}, {300, 700}, {128, 4000}, {1, 3}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        batch b;
        batch_make(&b, &l, shapes[s][0], F, D, shapes[s][1], mean, key_weights);
        compare_step(name, &l, gpu, cpu, params, &b, 1);
        if (s == 1) compare_step(name, &l, gpu, cpu, params, &b, 0);
        batch_free(&b);
    }

    /* No labels: probs and loss 0 forward; backward refused with probs still written. */
    {
        batch b;
        batch_make(&b, &l, 50, F, D, 30, mean, key_weights);
        b.mb.labels = NULL;
        float *pg = malloc(50 * sizeof(float)), *pc = malloc(50 * sizeof(float));
        float *dp = malloc(l.n_params * sizeof(float));
        float *de[MODEL_MAX_TABLES] = {0};
        for (uint32_t t = 0; t < l.n_tables; t++) de[t] = malloc(30 * l.table_dim[t] * sizeof(float));
        double lg = NAN, lc = NAN;
        for (int i = 0; i < 50; i++) pg[i] = NAN;
        CHECK_OK(backend_cpu_ops.step(cpu, params, &b.mb, pc, &lc, NULL, NULL, &err), err);
        CHECK_OK(cuda->step(gpu, params, &b.mb, pg, &lg, NULL, NULL, &err), err);
        CHECK(lg == 0.0 && lc == 0.0);
        CHECK_MSG(close_arrays("probs (no labels)", pg, pc, 50), "%s unlabelled probs", name);
        int rc = cuda->step(gpu, params, &b.mb, pg, &lg, dp, de, &err);
        CHECK(rc != 0 && err && strstr(err, "labels"));
        free(err);
        err = NULL;
        free(pg);
        free(pc);
        free(dp);
        for (uint32_t t = 0; t < l.n_tables; t++) free(de[t]);
        batch_free(&b);
    }

    run_prefetch(name, &l, gpu, cpu, params, F, D, mean, key_weights);

    /* More pooling entries than create sized the slots for (max_u 800; about 3600 here): the
     * slot grows, synchronously and prefetched. */
    {
        void *small = NULL;
        CHECK_OK(cuda->create(&m, &l, max_b, 800, 1, 0, &small, &err), err);
        batch b;
        batch_make(&b, &l, 300, F, D, 700, mean, key_weights);
        if (small) {
            compare_step(name, &l, small, cpu, params, &b, 1);
            prefetch_ok(small, params, &b);
            compare_step(name, &l, small, cpu, params, &b, 1);
            cuda->destroy(small);
        }
        batch_free(&b);
    }

    /* Shape errors come back as errors, and the state stays usable. */
    {
        batch b;
        batch_make(&b, &l, 10, F, D, max_u + 1, mean, key_weights);
        float probs[10];
        double loss;
        int rc = cuda->step(gpu, params, &b.mb, probs, &loss, NULL, NULL, &err);
        CHECK(rc != 0 && err != NULL);
        free(err);
        err = NULL;
        b.mb.F = F + 1;
        b.mb.U = 5;
        rc = cuda->step(gpu, params, &b.mb, probs, &loss, NULL, NULL, &err);
        CHECK(rc != 0 && err != NULL);
        free(err);
        err = NULL;
        /* A column not below U: rejected, not read out of bounds. */
        b.mb.F = F;
        b.mb.U = 2;
        if (b.row_ptr[b.B * F] > 0) {
            rc = cuda->step(gpu, params, &b.mb, probs, &loss, NULL, NULL, &err);
            CHECK(rc != 0 && err != NULL);
            free(err);
            err = NULL;
        }
        batch_free(&b);
        batch_make(&b, &l, 20, F, D, 10, mean, key_weights);
        compare_step(name, &l, gpu, cpu, params, &b, 1);
        batch_free(&b);
    }

    /* An empty batch. */
    {
        batch b;
        batch_make(&b, &l, 0, F, D, 0, mean, key_weights);
        float probs[1];
        double loss = NAN;
        float *dp = malloc(l.n_params * sizeof(float));
        float *de[MODEL_MAX_TABLES] = {0};
        for (size_t i = 0; i < l.n_params; i++) dp[i] = NAN;
        CHECK_OK(cuda->step(gpu, params, &b.mb, probs, &loss, dp, de, &err), err);
        CHECK(loss == 0.0);
        int zero = 1;
        for (size_t i = 0; i < l.n_params; i++) zero = zero && dp[i] == 0.0f;
        CHECK(zero);
        free(dp);
        batch_free(&b);
    }
out:
    if (gpu) cuda->destroy(gpu);
    if (cpu) backend_cpu_ops.destroy(cpu);
    free(params);
}

int main(void)
{
    rng_state = 12345;
    int n = 0;
    char *err = NULL;
    if (backend_cuda_probe(&err) != 0 || (cuda = backend_cuda(&err)) == NULL) {
        printf("SKIPPED: %s\n", err ? err : "no CUDA device");
        free(err);
        return 77;
    }
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n <= 0) {
        if (e != cudaSuccess) printf("SKIPPED: no CUDA device (%s)\n", cudaGetErrorString(e));
        else printf("SKIPPED: no CUDA device\n");
        return 77;
    }
    const model_kind kinds[] = {MODEL_LR, MODEL_MLP, MODEL_DLRM, MODEL_DEEPFM};
    for (int k = 0; k < 4; k++) {
        run_model(kinds[k], 1, 0);
        run_model(kinds[k], 0, 1);
    }
    return check_done();
}
