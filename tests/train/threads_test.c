/*
 * The CPU backend gives the same bits for any compute thread count, at the shapes training
 * uses: each preset's default tower (26 fields, 13 dense, dim 16, hidden {256, 128}, dlrm
 * bottom {64, 16}) on random batches of 2048 rows (the default batch), 2047 and 1000 (a short
 * last batch), 33 and 1. Threads 2 and 3 (and 2 again, three calls: no state leaks between
 * steps) must reproduce threads 1 exactly: probs, loss, every dense gradient and every row
 * gradient. On a difference it says which output, which layer's weights or bias, and how many
 * elements differ, so a regression points at the computation that caused it. A few samples
 * run alone must also get the batch's probabilities (singles_agree). With an emb_ready hook
 * (the trainer's early push) every output is the same again, the hook runs once, and the row
 * gradients it sees are already the final ones. With A's columns (model_batch.t_ptr, built
 * here by a sort) the row gradients are summed per key instead of scattered: the same bits.
 * Three threads crowded onto one core (check_crowded), where pool threads are late and the
 * others take their parts, give the same bits too.
 *
 * With BACKEND_BF16 (AMX tiles, where the machine has them) the same holds for mlp and dlrm, and
 * each preset's outputs stay within bf16's precision of the fp32 backend's (check_bf16_close).
 *
 * The factorized first layer (mlp, deepfm) is held to the same with BACKEND_FACTORED, and to
 * the GEMM over pooled inputs (BACKEND_PLAIN) within summation-order rounding on the same
 * batches, its AVX-512 kernels to its portable ones bit for bit, and the backend's own choice
 * to one of the two (check_fact).
 *
 * gradcheck_test.c checks the same property on a small tower (B 256); this one exists because
 * OpenBLAS picks its kernel by the shape of each call, and only training's shapes reach the
 * small-matrix kernel that made threads 1 and 2 disagree.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>

#include "check.h"
#include "rng.h"
#include "src/model.h"

#define FIELDS 26
#define DENSE 13
#define MAX_B 2048
#define MAX_KEYS 3

/* batch_make's keys: drawn from key_pool keys (0, or not below U: a third of U, so that nearly
 * every slot is its own (field, key) pair), every field from the same ones; with weighted_keys the
 * pooling values carry a random key weight too. */
static uint32_t key_pool;
static int weighted_keys;

/* One random batch of B rows for a model: CSR of 0..MAX_KEYS keys per field, mean pooling. */
typedef struct batch {
    model_cfg m;
    model_layout l;
    uint32_t U;
    float *dense, *labels, *val, *params, *emb[MODEL_MAX_TABLES];
    uint32_t *row_ptr, *col;
    model_batch mb;
} batch;

static void batch_free(batch *t)
{
    free(t->dense);
    free(t->labels);
    free(t->val);
    free(t->params);
    free(t->row_ptr);
    free(t->col);
    for (int i = 0; i < MODEL_MAX_TABLES; i++)
        free(t->emb[i]);
    memset(t, 0, sizeof *t);
}

static int batch_make(batch *t, model_kind kind, uint32_t B, uint64_t seed)
{
    memset(t, 0, sizeof *t);
    rng_state = seed;
    model_cfg_preset(&t->m, kind, FIELDS, DENSE);
    char *err = NULL;
    int rc = model_layout_make(&t->m, &t->l, &err);
    CHECK_OK(rc, err);
    if (rc != 0) return -1;
    t->U = B * FIELDS + 1;
    size_t cap = (size_t)B * FIELDS * MAX_KEYS + 1;
    t->dense = malloc((size_t)B * DENSE * sizeof(float) + 1);
    t->labels = malloc(B * sizeof(float));
    t->row_ptr = malloc(((size_t)B * FIELDS + 1) * sizeof(uint32_t));
    t->col = malloc(cap * sizeof(uint32_t));
    t->val = malloc(cap * sizeof(float));
    t->params = malloc(t->l.n_params * sizeof(float));
    if (!t->dense || !t->labels || !t->row_ptr || !t->col || !t->val || !t->params) return -1;
    for (size_t i = 0; i < (size_t)B * DENSE; i++)
        t->dense[i] = unif(-2.0f, 5.0f);
    for (uint32_t i = 0; i < B; i++)
        t->labels[i] = unif(0, 1) < 0.25f ? 1.0f : 0.0f;
    /* Keys from a pool smaller than the batch, so rows repeat and their gradients sum. */
    uint32_t nnz = 0, pool = key_pool && key_pool < t->U ? key_pool : t->U / 3 + 1;
    t->row_ptr[0] = 0;
    for (size_t r = 0; r < (size_t)B * FIELDS; r++) {
        uint32_t n = (uint32_t)(rnd64() % (MAX_KEYS + 1));
        for (uint32_t k = 0; k < n; k++) {
            t->col[nnz] = (uint32_t)(rnd64() % pool);
            t->val[nnz++] = (weighted_keys ? unif(0.5f, 1.5f) : 1.0f) / (float)n;
        }
        t->row_ptr[r + 1] = nnz;
    }
    model_init_params(&t->m, &t->l, t->params);
    /* Non-zero biases too, so every gradient is exercised. */
    for (size_t i = 0; i < t->l.n_params; i++)
        t->params[i] += unif(-0.02f, 0.02f);
    for (uint32_t tb = 0; tb < t->l.n_tables; tb++) {
        size_t n = (size_t)t->U * t->l.table_dim[tb];
        t->emb[tb] = malloc(n * sizeof(float));
        if (t->emb[tb] == NULL) return -1;
        for (size_t i = 0; i < n; i++)
            t->emb[tb][i] = unif(-0.3f, 0.3f);
    }
    model_batch *mb = &t->mb;
    mb->B = B;
    mb->F = FIELDS;
    mb->D = DENSE;
    mb->U = t->U;
    mb->dense = t->dense;
    mb->labels = t->labels;
    mb->row_ptr = t->row_ptr;
    mb->col = t->col;
    mb->val = t->val;
    for (uint32_t tb = 0; tb < t->l.n_tables; tb++)
        mb->emb[tb] = t->emb[tb];
    return 0;
}

typedef struct outs {
    float *probs, *dparams, *demb[MODEL_MAX_TABLES];
    double loss;
} outs;

static int outs_alloc(outs *o, const batch *t)
{
    memset(o, 0, sizeof *o);
    o->probs = malloc(MAX_B * sizeof(float));
    o->dparams = malloc(t->l.n_params * sizeof(float));
    int ok = o->probs && o->dparams;
    for (uint32_t tb = 0; tb < t->l.n_tables; tb++) {
        o->demb[tb] = malloc((size_t)t->U * t->l.table_dim[tb] * sizeof(float));
        ok = ok && o->demb[tb];
    }
    return ok ? 0 : -1;
}

static void outs_free(outs *o)
{
    free(o->probs);
    free(o->dparams);
    for (int i = 0; i < MODEL_MAX_TABLES; i++)
        free(o->demb[i]);
}

/* The emb_ready hook's view: the row gradients as they stand when it runs. */
typedef struct hook {
    const batch *t;
    const outs *o;
    float *seen[MODEL_MAX_TABLES];
    int calls;
    int join;    /* 0: never; 1: from the hook; 2: from another thread, a moment later */
    void *state; /* the backend, for join */
    pthread_t th;
    int th_started;
} hook;

static void *late_join(void *arg)
{
    hook *h = arg;
    struct timespec ts = {0, 300 * 1000}; /* 0.3 ms: inside the dense gradients at B 2048 */
    nanosleep(&ts, NULL);
    backend_cpu_ops.join(h->state);
    return NULL;
}

static void hook_run(void *arg)
{
    hook *h = arg;
    h->calls++;
    if (h->join == 1) backend_cpu_ops.join(h->state);
    if (h->join == 2) h->th_started = pthread_create(&h->th, NULL, late_join, h) == 0;
    for (uint32_t tb = 0; tb < h->t->l.n_tables; tb++)
        memcpy(h->seen[tb], h->o->demb[tb],
               (size_t)h->t->U * h->t->l.table_dim[tb] * sizeof(float));
}

static int step_hooked(void *st, const batch *t, outs *o, hook *h)
{
    /* NaN first: an output the step forgets to write cannot match by accident. */
    for (uint32_t i = 0; i < t->mb.B; i++)
        o->probs[i] = NAN;
    for (size_t i = 0; i < t->l.n_params; i++)
        o->dparams[i] = NAN;
    for (uint32_t tb = 0; tb < t->l.n_tables; tb++)
        for (size_t i = 0; i < (size_t)t->U * t->l.table_dim[tb]; i++)
            o->demb[tb][i] = NAN;
    model_batch mb = t->mb;
    if (h != NULL) {
        mb.emb_ready = hook_run;
        mb.emb_ready_arg = h;
    }
    char *err = NULL;
    int rc =
        backend_cpu_ops.step(st, t->params, &mb, o->probs, &o->loss, o->dparams, o->demb, &err);
    CHECK_OK(rc, err);
    return rc;
}

static int step(void *st, const batch *t, outs *o)
{
    return step_hooked(st, t, o, NULL);
}

/* Elements of a[0..n) and b[0..n) whose bits differ. */
static size_t ndiff(const float *a, const float *b, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return k;
}

static void report(const char *what, const char *ctx, size_t k, size_t n)
{
    CHECK_MSG(k == 0, "%s: %s differs in %zu of %zu elements", ctx, what, k, n);
}

static void layers_same(const model_layer *ly, uint32_t n, const char *stack, const float *a,
                        const float *b, const char *ctx)
{
    for (uint32_t i = 0; i < n; i++) {
        char what[64];
        size_t nw = (size_t)ly[i].in * ly[i].out;
        snprintf(what, sizeof what, "%s layer %u (%u -> %u) dW", stack, i, ly[i].in, ly[i].out);
        report(what, ctx, ndiff(a + ly[i].w, b + ly[i].w, nw), nw);
        snprintf(what, sizeof what, "%s layer %u (%u -> %u) db", stack, i, ly[i].in, ly[i].out);
        report(what, ctx, ndiff(a + ly[i].b, b + ly[i].b, ly[i].out), ly[i].out);
    }
}

static void outs_same(const batch *t, const outs *a, const outs *b, const char *ctx)
{
    const model_layout *l = &t->l;
    report("probs", ctx, ndiff(a->probs, b->probs, t->mb.B), t->mb.B);
    CHECK_MSG(memcmp(&a->loss, &b->loss, sizeof a->loss) == 0, "%s: loss %.17g vs %.17g", ctx,
              a->loss, b->loss);
    layers_same(l->top, l->n_top, "top", a->dparams, b->dparams, ctx);
    layers_same(l->bot, l->n_bot, "bottom", a->dparams, b->dparams, ctx);
    if (l->lin_table >= 0)
        report("dense linear weights", ctx,
               ndiff(a->dparams + l->lin_w, b->dparams + l->lin_w, t->m.n_dense + 1),
               t->m.n_dense + 1);
    /* Whatever the layout holds beyond the named blocks is covered by the whole vector. */
    report("dparams", ctx, ndiff(a->dparams, b->dparams, l->n_params), l->n_params);
    for (uint32_t tb = 0; tb < l->n_tables; tb++) {
        char what[32];
        size_t n = (size_t)t->U * l->table_dim[tb];
        snprintf(what, sizeof what, "demb[%u]", tb);
        report(what, ctx, ndiff(a->demb[tb], b->demb[tb], n), n);
    }
}

static void hook_check_one(void *st, const batch *t, const outs *ref, outs *o, const char *ctx,
                           int join)
{
    hook h = {.t = t, .o = o, .join = join, .state = st};
    int ok = 1;
    for (uint32_t tb = 0; tb < t->l.n_tables; tb++)
        ok = ok && (h.seen[tb] = malloc((size_t)t->U * t->l.table_dim[tb] * sizeof(float)));
    CHECK_MSG(ok, "%s: out of memory", ctx);
    int rc = ok ? step_hooked(st, t, o, &h) : -1;
    if (h.th_started) pthread_join(h.th, NULL);
    if (rc == 0) {
        char c2[256];
        snprintf(c2, sizeof c2, "%s, emb_ready hook", ctx);
        outs_same(t, ref, o, c2);
        CHECK_MSG(h.calls == 1, "%s: the hook ran %d times", c2, h.calls);
        for (uint32_t tb = 0; tb < t->l.n_tables; tb++) {
            size_t n = (size_t)t->U * t->l.table_dim[tb];
            char what[64];
            snprintf(what, sizeof what, "demb[%u] at the hook", tb);
            report(what, c2, ndiff(h.seen[tb], ref->demb[tb], n), n);
        }
    }
    for (uint32_t tb = 0; tb < t->l.n_tables; tb++)
        free(h.seen[tb]);
}

/* With the hook: the same bits (the dense gradients then start on fewer threads, and the rest
 * join never, at once, or from another thread while they run), one call, and at that moment
 * every row gradient already final. */
static void hook_check(void *st, const batch *t, const outs *ref, outs *o, const char *ctx)
{
    for (int join = 0; join < 3; join++) {
        char c1[200];
        snprintf(c1, sizeof c1, "%s, join %d", ctx, join);
        hook_check_one(st, t, ref, o, c1, join);
    }
}

/* A's columns built here by sorting (column, row) pairs, independently of model.c's counting
 * sort: with them the row gradients are summed per key, and must come out the same bits. */
typedef struct entry {
    uint32_t col, row;
    float val;
} entry;

static int entry_cmp(const void *a, const void *b)
{
    const entry *x = a, *y = b;
    if (x->col != y->col) return x->col < y->col ? -1 : 1;
    return (x->row > y->row) - (x->row < y->row);
}

static void columns_check(void *st, const batch *t, const outs *ref, outs *o, const char *ctx)
{
    const model_batch *mb = &t->mb;
    size_t nnz = mb->row_ptr[(size_t)mb->B * FIELDS];
    entry *e = malloc(nnz * sizeof *e + 1);
    uint32_t *ptr = calloc(mb->U + 1, sizeof *ptr), *row = malloc(nnz * sizeof *row + 1);
    float *val = malloc(nnz * sizeof *val + 1);
    if (!e || !ptr || !row || !val) {
        CHECK_MSG(0, "%s: out of memory", ctx);
    } else {
        size_t n = 0;
        for (uint32_t r = 0; r < mb->B * FIELDS; r++)
            for (uint32_t k = mb->row_ptr[r]; k < mb->row_ptr[r + 1]; k++)
                e[n++] = (entry){mb->col[k], r, mb->val[k]};
        qsort(e, n, sizeof *e, entry_cmp);
        for (size_t i = 0; i < n; i++) {
            ptr[e[i].col + 1]++;
            row[i] = e[i].row;
            val[i] = e[i].val;
        }
        for (uint32_t u = 0; u < mb->U; u++)
            ptr[u + 1] += ptr[u];
        batch tc = *t;
        tc.mb.t_ptr = ptr;
        tc.mb.t_row = row;
        tc.mb.t_val = val;
        char c2[160];
        snprintf(c2, sizeof c2, "%s, with A's columns", ctx);
        if (step(st, &tc, o) == 0) outs_same(t, ref, o, c2);
    }
    free(e);
    free(ptr);
    free(row);
    free(val);
}

/* backend_ops.create flags of the backends create() makes: 0, or BACKEND_BF16 for the second
 * round of the same checks. */
static uint32_t be_flags;

static void *create(const batch *t, uint32_t threads)
{
    void *st = NULL;
    char *err = NULL;
    int rc = backend_cpu_ops.create(&t->m, &t->l, MAX_B, MAX_B * FIELDS + 1, threads, be_flags, &st,
                                    &err);
    CHECK_OK(rc, err);
    return rc == 0 ? st : NULL;
}

/*
 * Tiles compute the right products: each of a few samples alone (a batch of one, where every
 * GEMM is a single call) gets the probability the whole batch gave it, to float rounding.
 * Comparing thread counts alone would not see a tile at a wrong offset.
 */
static void singles_agree(void *st, const batch *t, const float *probs)
{
    const model_batch *mb = &t->mb;
    uint32_t picks[] = {0, 1, 2, mb->B / 2, mb->B - 1};
    for (size_t k = 0; k < sizeof picks / sizeof *picks; k++) {
        if (picks[k] >= mb->B) continue;
        uint32_t i = picks[k], rp[FIELDS + 1], base = mb->row_ptr[(size_t)i * FIELDS];
        for (uint32_t f = 0; f <= FIELDS; f++)
            rp[f] = mb->row_ptr[(size_t)i * FIELDS + f] - base;
        model_batch one = *mb;
        one.B = 1;
        one.dense = mb->dense + (size_t)i * DENSE;
        one.labels = mb->labels + i;
        one.row_ptr = rp;
        one.col = mb->col + base;
        one.val = mb->val + base;
        float p = NAN;
        double loss = NAN;
        char *err = NULL;
        int rc = backend_cpu_ops.step(st, t->params, &one, &p, &loss, NULL, NULL, &err);
        CHECK_OK(rc, err);
        CHECK_MSG(fabsf(p - probs[i]) <= 1e-5f, "%s B=%u: sample %u alone %.9g, in the batch %.9g",
                  model_kind_name(t->m.kind), mb->B, i, p, probs[i]);
    }
}

static void check_kind(model_kind kind)
{
    static const uint32_t sizes[] = {2048, 2047, 1000, 33, 1};
    static const uint32_t threads[] = {2, 3};
    void *st1 = NULL, *stn[2] = {NULL, NULL};
    batch t;
    memset(&t, 0, sizeof t);
    outs ref, o;
    memset(&ref, 0, sizeof ref);
    memset(&o, 0, sizeof o);
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
        batch_free(&t);
        if (batch_make(&t, kind, sizes[si], 77 + si * 1000 + (uint64_t)kind) != 0) {
            CHECK_MSG(0, "%s: cannot build a batch of %u", model_kind_name(kind), sizes[si]);
            break;
        }
        if (st1 == NULL) {
            /* One backend per thread count for every size: state must not leak between steps. */
            st1 = create(&t, 1);
            for (int i = 0; i < 2; i++)
                stn[i] = create(&t, threads[i]);
            if (st1 == NULL || stn[0] == NULL || stn[1] == NULL || outs_alloc(&ref, &t) != 0 ||
                outs_alloc(&o, &t) != 0) {
                CHECK_MSG(0, "%s: cannot create the backends", model_kind_name(kind));
                break;
            }
        }
        if (step(st1, &t, &ref) != 0) break;
        CHECK_MSG(isfinite(ref.loss), "%s B=%u: loss %g", model_kind_name(kind), sizes[si],
                  ref.loss);
        singles_agree(st1, &t, ref.probs);
        for (int i = 0; i < 2; i++)
            for (int rep = 0; rep < (i == 0 ? 2 : 1); rep++) {
                char ctx[96];
                snprintf(ctx, sizeof ctx, "%s B=%u threads %u (call %d) vs threads 1",
                         model_kind_name(kind), sizes[si], threads[i], rep);
                if (step(stn[i], &t, &o) == 0) outs_same(&t, &ref, &o, ctx);
                hook_check(stn[i], &t, &ref, &o, ctx);
                columns_check(stn[i], &t, &ref, &o, ctx);
            }
        char ctx1[96];
        snprintf(ctx1, sizeof ctx1, "%s B=%u threads 1", model_kind_name(kind), sizes[si]);
        hook_check(st1, &t, &ref, &o, ctx1);
        columns_check(st1, &t, &ref, &o, ctx1);
    }
    if (st1) backend_cpu_ops.destroy(st1);
    for (int i = 0; i < 2; i++)
        if (stn[i]) backend_cpu_ops.destroy(stn[i]);
    outs_free(&ref);
    outs_free(&o);
    batch_free(&t);
}

/* Three compute threads crowded onto one core (created while this thread is pinned to it, so
 * they inherit the mask): woken pool threads are late and the others take their parts. Every
 * output must still be threads 1's. */
static void check_crowded(model_kind kind)
{
    cpu_set_t old, one;
    if (sched_getaffinity(0, sizeof old, &old) != 0) return;
    int cpu = 0;
    while (cpu < CPU_SETSIZE && !CPU_ISSET(cpu, &old))
        cpu++;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    batch t;
    memset(&t, 0, sizeof t);
    outs ref, o;
    memset(&ref, 0, sizeof ref);
    memset(&o, 0, sizeof o);
    void *st1 = NULL, *st3 = NULL;
    if (batch_make(&t, kind, 2048, 4242) == 0 && outs_alloc(&ref, &t) == 0 &&
        outs_alloc(&o, &t) == 0 && (st1 = create(&t, 1)) != NULL && step(st1, &t, &ref) == 0) {
        CHECK(sched_setaffinity(0, sizeof one, &one) == 0);
        st3 = create(&t, 3);
        CHECK(st3 != NULL);
        char ctx[96];
        snprintf(ctx, sizeof ctx, "%s B=2048 threads 3 on one core", model_kind_name(kind));
        for (int rep = 0; st3 != NULL && rep < 3; rep++) {
            if (step(st3, &t, &o) == 0) outs_same(&t, &ref, &o, ctx);
            hook_check(st3, &t, &ref, &o, ctx);
            columns_check(st3, &t, &ref, &o, ctx);
        }
        CHECK(sched_setaffinity(0, sizeof old, &old) == 0);
    } else {
        CHECK_MSG(0, "%s: cannot set up the crowded run", model_kind_name(kind));
    }
    if (st1) backend_cpu_ops.destroy(st1);
    if (st3) backend_cpu_ops.destroy(st3);
    outs_free(&ref);
    outs_free(&o);
    batch_free(&t);
}

/* ||a - b|| / ||b|| over n floats. */
static double rel_l2(const float *a, const float *b, size_t n)
{
    double d = 0, r = 0;
    for (size_t i = 0; i < n; i++) {
        d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        r += (double)b[i] * b[i];
    }
    return r > 0 ? sqrt(d / r) : sqrt(d);
}

/*
 * bf16 GEMMs compute the same step as fp32 to bf16's precision (8 bits of mantissa in each
 * product's operands): probabilities within 0.01, the loss within 0.5%, every layer's dW and
 * the dense gradient within 3% and each table's row gradients within 12% (relative L2) of the
 * fp32 backend's. An operand packed wrong (a transposed tile, a lost K chunk) is off by ~100%.
 */
static void check_bf16_close(model_kind kind)
{
    batch t;
    memset(&t, 0, sizeof t);
    outs ref, o;
    memset(&ref, 0, sizeof ref);
    memset(&o, 0, sizeof o);
    void *st32 = NULL, *st16 = NULL;
    const char *name = model_kind_name(kind);
    if (batch_make(&t, kind, 2048, 9001) == 0 && outs_alloc(&ref, &t) == 0 &&
        outs_alloc(&o, &t) == 0) {
        be_flags = 0;
        st32 = create(&t, 2);
        be_flags = BACKEND_BF16;
        st16 = create(&t, 2);
        be_flags = 0;
    }
    if (st32 == NULL || st16 == NULL || step(st32, &t, &ref) != 0 || step(st16, &t, &o) != 0) {
        CHECK_MSG(0, "%s: cannot run the fp32 and bf16 backends", name);
    } else {
        float pmax = 0;
        for (uint32_t i = 0; i < t.mb.B; i++)
            pmax = fmaxf(pmax, fabsf(o.probs[i] - ref.probs[i]));
        CHECK_MSG(pmax <= 0.01f, "%s bf16: probabilities up to %g from fp32's", name, pmax);
        CHECK_MSG(fabs(o.loss - ref.loss) <= 0.005 * fabs(ref.loss),
                  "%s bf16: loss %.9g, fp32 %.9g", name, o.loss, ref.loss);
        const model_layout *l = &t.l;
        for (uint32_t i = 0; i < l->n_top; i++) {
            double e = rel_l2(o.dparams + l->top[i].w, ref.dparams + l->top[i].w,
                              (size_t)l->top[i].in * l->top[i].out);
            CHECK_MSG(e <= 0.03, "%s bf16: top layer %u dW %.4f from fp32's (relative L2)", name, i,
                      e);
        }
        double e = rel_l2(o.dparams, ref.dparams, l->n_params);
        CHECK_MSG(e <= 0.03, "%s bf16: dparams %.4f from fp32's (relative L2)", name, e);
        /* A row gradient sums 256 products of either sign (dY W): with that cancellation its
         * error relative to itself is ~16x an operand's rounding (measured 6-7%). */
        for (uint32_t tb = 0; tb < l->n_tables; tb++) {
            e = rel_l2(o.demb[tb], ref.demb[tb], (size_t)t.U * l->table_dim[tb]);
            CHECK_MSG(e <= 0.12, "%s bf16: demb[%u] %.4f from fp32's (relative L2)", name, tb, e);
        }
        /* Not the fp32 bits where there is a tower: the bf16 path did run (lr has no GEMM). */
        if (l->n_top > 0)
            CHECK_MSG(ndiff(o.dparams, ref.dparams, l->n_params) > 0,
                      "%s bf16: dparams identical to fp32's", name);
    }
    if (st32) backend_cpu_ops.destroy(st32);
    if (st16) backend_cpu_ops.destroy(st16);
    outs_free(&ref);
    outs_free(&o);
    batch_free(&t);
}

/* Relative L2 of a against b within tol, else a message naming what; close_worst keeps the
 * largest seen. */
static double close_worst;

static void close_l2(const float *a, const float *b, size_t n, double tol, const char *ctx,
                     const char *what)
{
    double e = rel_l2(a, b, n);
    close_worst = fmax(close_worst, e);
    CHECK_MSG(e <= tol, "%s: %s %.3g from the plain formulation's (relative L2)", ctx, what, e);
}

/*
 * The factorized first layer against the GEMM over pooled inputs, on the same batches: every
 * output within 1e-5 (relative L2, each layer's dW and db and each table's row gradients on
 * their own; measured up to 3.3e-7: the two differ in summation order only), probabilities
 * within 1e-6 (measured 1.8e-7), the loss within 1e-6 relative. The portable kernels
 * (BACKEND_NO_SIMD) and the AVX2 ones (BACKEND_NO_AVX512), the GEMMs' and the factorized
 * layer's, give the whole step the bits of the CPU's widest (on an AVX-512 CPU, AVX-512's).
 * Batches: keys from a pool of 500 (a unit per ~4 slots, as in training) or of a third of U (nearly
 * a unit a slot), mean pooling, with and without key weights, B 2048, 1000, 33, 1. And the
 * backend's own choice (no flag) gives the bits of one of the two: the factorized where units are
 * few, the GEMM where nearly every slot is its own unit.
 */
static void check_fact(model_kind kind)
{
    static const uint32_t sizes[] = {2048, 1000, 33, 1};
    const char *name = model_kind_name(kind);
    batch t;
    memset(&t, 0, sizeof t);
    outs ref, o, sc, su;
    memset(&ref, 0, sizeof ref);
    memset(&o, 0, sizeof o);
    memset(&sc, 0, sizeof sc);
    memset(&su, 0, sizeof su);
    model_units units;
    memset(&units, 0, sizeof units);
    /* plain, factorized, portable, the backend's choice, factorized at most AVX2 */
    void *st[5] = {NULL, NULL, NULL, NULL, NULL};
    const uint32_t flags[5] = {BACKEND_PLAIN, BACKEND_FACTORED, BACKEND_FACTORED | BACKEND_NO_SIMD,
                               0, BACKEND_FACTORED | BACKEND_NO_AVX512};
    const uint32_t threads[5] = {2, 2, 1, 2, 2};
    fprintf(stderr, "%s: factorized kernels %s, at most AVX2 %s, portable %s\n", name,
            backend_cpu_fact_kernels(flags[1]), backend_cpu_fact_kernels(flags[4]),
            backend_cpu_fact_kernels(flags[2]));
    CHECK_MSG(strcmp(backend_cpu_fact_kernels(flags[2]), "portable") == 0,
              "BACKEND_NO_SIMD runs the %s kernels", backend_cpu_fact_kernels(flags[2]));
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++)
        for (int var = 0; var < 3; var++) {
            key_pool = var < 2 ? 500 : 0;
            weighted_keys = var == 1;
            batch_free(&t);
            int rc = batch_make(&t, kind, sizes[si], 555 + si * 10 + (uint64_t)var);
            key_pool = 0;
            weighted_keys = 0;
            if (rc != 0) {
                CHECK_MSG(0, "%s: cannot build a batch of %u", name, sizes[si]);
                goto out;
            }
            if (st[0] == NULL) {
                for (int i = 0; i < 5; i++) {
                    be_flags = flags[i];
                    st[i] = create(&t, threads[i]);
                }
                be_flags = 0;
                if (!st[0] || !st[1] || !st[2] || !st[3] || !st[4] || outs_alloc(&ref, &t) != 0 ||
                    outs_alloc(&o, &t) != 0 || outs_alloc(&sc, &t) != 0 ||
                    outs_alloc(&su, &t) != 0) {
                    CHECK_MSG(0, "%s: cannot create the backends", name);
                    goto out;
                }
            }
            char ctx[128];
            snprintf(ctx, sizeof ctx, "%s B=%u keys from %s%s, factorized", name, sizes[si],
                     var < 2 ? "500" : "U/3", var == 1 ? ", weighted" : "");
            if (step(st[0], &t, &ref) != 0 || step(st[1], &t, &o) != 0 || step(st[2], &t, &sc))
                goto out;
            double pmax = 0;
            for (uint32_t i = 0; i < t.mb.B; i++)
                pmax = fmax(pmax, fabs((double)o.probs[i] - ref.probs[i]));
            CHECK_MSG(pmax <= 1e-6, "%s: probabilities up to %g from the plain formulation's", ctx,
                      pmax);
            CHECK_MSG(fabs(o.loss - ref.loss) <= 1e-6 * fabs(ref.loss), "%s: loss %.9g, plain %.9g",
                      ctx, o.loss, ref.loss);
            const model_layout *l = &t.l;
            for (uint32_t i = 0; i < l->n_top; i++) {
                char what[48];
                snprintf(what, sizeof what, "top layer %u dW", i);
                close_l2(o.dparams + l->top[i].w, ref.dparams + l->top[i].w,
                         (size_t)l->top[i].in * l->top[i].out, 1e-5, ctx, what);
                snprintf(what, sizeof what, "top layer %u db", i);
                close_l2(o.dparams + l->top[i].b, ref.dparams + l->top[i].b, l->top[i].out, 1e-5,
                         ctx, what);
            }
            close_l2(o.dparams, ref.dparams, l->n_params, 1e-5, ctx, "dparams");
            for (uint32_t tb = 0; tb < l->n_tables; tb++) {
                char what[32];
                snprintf(what, sizeof what, "demb[%u]", tb);
                close_l2(o.demb[tb], ref.demb[tb], (size_t)t.U * l->table_dim[tb], 1e-5, ctx, what);
            }
            /* Summation order does change bits: the factorized path did run (a batch of one
             * has too few terms a sum to be sure of it). */
            CHECK_MSG(sizes[si] == 1 || ndiff(o.dparams, ref.dparams, l->n_params) > 0,
                      "%s: dparams identical to the plain formulation's", ctx);
            fprintf(stderr, "%-56s probs %.2g, worst relative L2 %.2g\n", ctx, pmax, close_worst);
            close_worst = 0;
            char c2[256];
            snprintf(c2, sizeof c2, "%s, portable kernels vs %s", ctx,
                     backend_cpu_fact_kernels(flags[1]));
            outs_same(&t, &o, &sc, c2);
            snprintf(c2, sizeof c2, "%s, %s kernels vs %s", ctx, backend_cpu_fact_kernels(flags[4]),
                     backend_cpu_fact_kernels(flags[1]));
            if (step(st[4], &t, &sc) == 0) outs_same(&t, &o, &sc, c2);
            /* The backend's own choice, where it is clear: the factorized form for 2048
             * samples with keys from 500 (a unit per ~4 slots), the GEMM for keys from U/3
             * (more units than slots). */
            if ((var == 2 || sizes[si] == 2048) && step(st[3], &t, &sc) == 0) {
                bool fact = var < 2;
                snprintf(c2, sizeof c2, "%s, the backend's choice vs %s", ctx,
                         fact ? "factorized" : "plain");
                outs_same(&t, fact ? &o : &ref, &sc, c2);
            }
            /* The batch's units built outside the step, as the trainer's builder thread does
             * (model_batch.units, with the bound backend_ops.max_units gives): the same bits as
             * the step's own, forced and by the backend's choice. */
            for (int i = 1; i < 4; i += 2) {
                char *err = NULL;
                batch tu = t;
                uint32_t most = backend_cpu_ops.max_units(st[i], t.mb.B, FIELDS);
                CHECK_MSG(most > 0, "%s: max_units 0 with the factorized layer on", ctx);
                int rc2 = model_units_build(&units, &t.mb, most, &err);
                CHECK_OK(rc2, err);
                tu.mb.units = &units;
                snprintf(c2, sizeof c2, "%s, units built outside the step (%s)", ctx,
                         i == 1 ? "forced" : "the backend's choice");
                if (rc2 == 0 && step(st[i], &t, &sc) == 0 && step(st[i], &tu, &su) == 0)
                    outs_same(&t, &sc, &su, c2);
            }
        }
out:
    for (int i = 0; i < 5; i++)
        if (st[i]) backend_cpu_ops.destroy(st[i]);
    outs_free(&ref);
    outs_free(&o);
    outs_free(&sc);
    outs_free(&su);
    model_units_fini(&units);
    batch_free(&t);
}

/* backend_ops.columns: only the mlp's factorized first layer steps without A's columns (the
 * trainer then leaves them unbuilt, and a batch the cost model declines scans A in spmm_t:
 * check_kind's columns_check holds that path to the columns' bits). */
static void check_columns(void)
{
    const struct {
        model_kind kind;
        uint32_t flags;
        bool want;
    } cases[] = {{MODEL_MLP, 0, false},
                 {MODEL_MLP, BACKEND_FACTORED, false},
                 {MODEL_MLP, BACKEND_PLAIN, true},
                 {MODEL_LR, 0, true},
                 {MODEL_DLRM, 0, true},
                 {MODEL_DEEPFM, 0, true}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        batch t;
        if (batch_make(&t, cases[i].kind, 4, 1) != 0) continue;
        be_flags = cases[i].flags;
        void *st = create(&t, 1);
        if (st != NULL) {
            CHECK_MSG(backend_cpu_ops.columns(st) == cases[i].want,
                      "%s, flags %u: columns() should be %d", model_kind_name(cases[i].kind),
                      cases[i].flags, cases[i].want);
            backend_cpu_ops.destroy(st);
        }
        batch_free(&t);
    }
    be_flags = 0;
}

/* The backend's own choice takes the factorized layer only where vector kernels run it (dim 16
 * on an AVX2 or AVX-512 CPU): the portable kernels are a reference, a library call per
 * multiply-add without FMA instructions, and ran ~20x slower than the GEMM (dim 8 on any CPU,
 * before). BACKEND_FACTORED still forces it. */
static void check_fact_choice(void)
{
    static const uint32_t dims[] = {16, 8, 32};
    for (size_t i = 0; i < sizeof dims / sizeof *dims; i++) {
        model_cfg m;
        model_layout l;
        char *err = NULL;
        model_cfg_preset(&m, MODEL_MLP, FIELDS, DENSE);
        m.dim = dims[i];
        int rc = model_layout_make(&m, &l, &err);
        CHECK_OK(rc, err);
        const bool vec = dims[i] == 16 && strcmp(backend_cpu_fact_kernels(0), "portable") != 0;
        for (int forced = 0; rc == 0 && forced < 2; forced++) {
            void *st = NULL;
            rc = backend_cpu_ops.create(&m, &l, MAX_B, MAX_B * FIELDS + 1, 1,
                                        forced ? BACKEND_FACTORED : 0, &st, &err);
            CHECK_OK(rc, err);
            if (rc != 0) break;
            const bool fact = backend_cpu_ops.max_units(st, MAX_B, FIELDS) > 0;
            CHECK_MSG(fact == (forced || vec),
                      "mlp dim %u%s: the factorized layer %s (the CPU's kernels: %s)", dims[i],
                      forced ? ", forced" : "", fact ? "taken" : "not taken",
                      backend_cpu_fact_kernels(0));
            backend_cpu_ops.destroy(st);
        }
    }
}

int main(void)
{
    const model_kind kinds[] = {MODEL_MLP, MODEL_LR, MODEL_DLRM, MODEL_DEEPFM};
    check_columns();
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++)
        check_kind(kinds[k]);
    check_crowded(MODEL_MLP);
    check_crowded(MODEL_DLRM);
    /* The factorized first layer: the same properties on every batch, and its closeness to the
     * GEMM. */
    be_flags = BACKEND_FACTORED;
    check_kind(MODEL_MLP);
    check_kind(MODEL_DEEPFM);
    check_crowded(MODEL_MLP);
    be_flags = 0;
    check_fact(MODEL_MLP);
    check_fact(MODEL_DEEPFM);
    check_fact_choice();
    /* The same properties for bf16 GEMMs (AMX), and their closeness to fp32. */
    if (cm_gemm_bf16_available()) {
        be_flags = BACKEND_BF16;
        check_kind(MODEL_MLP);
        check_kind(MODEL_DLRM);
        check_crowded(MODEL_MLP);
        be_flags = 0;
        for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++)
            check_bf16_close(kinds[k]);
    } else {
        fprintf(stderr, "train_threads: SKIP the bf16 rounds: this CPU/OS has no AMX-BF16\n");
        /* Where it cannot run, asking for it is an error, not a silent fp32 run. */
        batch t;
        memset(&t, 0, sizeof t);
        if (batch_make(&t, MODEL_MLP, 33, 5) == 0) {
            void *st = NULL;
            char *err = NULL;
            CHECK(backend_cpu_ops.create(&t.m, &t.l, MAX_B, MAX_B * FIELDS + 1, 1, BACKEND_BF16,
                                         &st, &err) != 0 &&
                  st == NULL && err != NULL && strstr(err, "AMX") != NULL);
            free(err);
        }
        batch_free(&t);
    }
    return check_done();
}
