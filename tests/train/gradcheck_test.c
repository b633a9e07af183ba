/*
 * The CPU backend's analytic gradients against finite differences, for every preset.
 *
 * Each case is a small random batch (B = 7, F = 3..5 fields, D = 2..4 dense, dim 4, hidden
 * {8, 6}, dlrm bottom {5, 4}) in the model's layout: multi-hot CSR rows of 0..3 keys (empty
 * fields, one sample with every field empty, repeated keys, one key of the U never used), mean
 * or sum pooling values, optionally times a per-key weight. Parameters and rows are random.
 *
 * Two independent checks of dparams and demb[t]:
 *   1. against central differences (eps 1e-6) of a double-precision reference forward pass
 *      written here from the spec in src/model.h (so the forward semantics are checked too:
 *      probs and loss must match it);
 *   2. against central differences (eps 1e-3) of the backend's own float forward pass.
 * ReLU kinks: the reference records every hidden unit's sign; a coordinate whose +-eps
 * perturbation flips any sign is skipped (and at most 10% may be skipped).
 * Also: lr probs equal the sigmoid of a hand-computed logit; outputs are overwritten (buffers
 * start as NaN), unused keys get zero rows; forward-only probs equal the training call's;
 * threads 1 / 2 / 3 give bit-identical outputs (a small case and one large enough that the
 * backend splits its GEMMs); shape errors are reported.
 *
 * mlp and deepfm run every check twice: with the backend's choice of first layer (the GEMM
 * over pooled inputs on these batches) and with the factorized one forced (BACKEND_FACTORED,
 * its portable kernels at dim 4); two more cases at dim 16 and hidden {32, 6} run the
 * factorized layer's AVX-512 kernels (where the CPU has them) and its portable ones.
 */
#include <stdint.h>

#include "check.h"
#include "rng.h"
#include "src/model.h"

/* ---- a test case: model, batch, parameters ---- */

typedef struct tcase {
    const char *name;
    model_cfg m;
    model_layout l;
    uint32_t B, F, D, U, nnz;
    float *dense, *labels, *val;
    uint32_t *row_ptr, *col;
    float *params;
    float *emb[MODEL_MAX_TABLES];
    model_batch mb;
} tcase;

static void tcase_free(tcase *t)
{
    free(t->dense);
    free(t->labels);
    free(t->val);
    free(t->row_ptr);
    free(t->col);
    free(t->params);
    for (int i = 0; i < MODEL_MAX_TABLES; i++) free(t->emb[i]);
    memset(t, 0, sizeof *t);
}

typedef struct shape {
    uint32_t F, D, B, U, dim, max_keys;
    uint32_t n_hidden, hidden[3], n_bottom, bottom[3];
    double wscale; /* dense parameters uniform in +-wscale */
} shape;

static int tcase_make(tcase *t, model_kind kind, const shape *sh, int mean_pool, int weighted,
                      uint64_t seed)
{
    memset(t, 0, sizeof *t);
    rng_state = seed;
    t->name = model_kind_name(kind);
    model_cfg_preset(&t->m, kind, sh->F, sh->D);
    if (kind != MODEL_LR) {
        t->m.dim = sh->dim;
        t->m.n_hidden = sh->n_hidden;
        memcpy(t->m.hidden, sh->hidden, sizeof sh->hidden);
    }
    if (kind == MODEL_DLRM) {
        t->m.n_bottom = sh->n_bottom;
        memcpy(t->m.bottom, sh->bottom, sizeof sh->bottom);
    }
    char *err = NULL;
    int rc = model_layout_make(&t->m, &t->l, &err);
    CHECK_OK(rc, err);
    if (rc != 0) return -1;
    t->B = sh->B;
    t->F = sh->F;
    t->D = sh->D;
    t->U = sh->U;
    const uint32_t B = t->B, F = t->F, D = t->D, U = t->U;
    t->dense = malloc((size_t)B * D * sizeof(float) + 1);
    t->labels = malloc(B * sizeof(float));
    t->row_ptr = malloc(((size_t)B * F + 1) * sizeof(uint32_t));
    size_t cap = (size_t)B * F * sh->max_keys + 1;
    t->col = malloc(cap * sizeof(uint32_t));
    t->val = malloc(cap * sizeof(float));
    for (size_t i = 0; i < (size_t)B * D; i++) t->dense[i] = (float)unif(-1.5, 1.5);
    for (uint32_t i = 0; i < B; i++) t->labels[i] = unif(0, 1) < 0.4 ? 1.0f : 0.0f;
    t->labels[0] = 1.0f; /* both classes present */
    t->labels[B - 1] = 0.0f;
    uint32_t nnz = 0;
    t->row_ptr[0] = 0;
    for (uint32_t b = 0; b < B; b++)
        for (uint32_t f = 0; f < F; f++) {
            uint32_t n = b == 1 ? 0 : rndu(sh->max_keys + 1); /* sample 1: every field empty */
            if (b == 0 && f == 0) n = 2;
            for (uint32_t k = 0; k < n; k++) {
                /* Key U-1 never appears: its gradient rows must come back zero. */
                t->col[nnz] = b == 0 && f == 0 ? 3 : rndu(U - 1); /* sample 0 field 0: a repeat */
                float v = mean_pool ? 1.0f / (float)n : 1.0f;
                if (weighted) v *= (float)unif(0.5, 1.5);
                t->val[nnz++] = v;
            }
            t->row_ptr[(size_t)b * F + f + 1] = nnz;
        }
    t->nnz = nnz;
    t->params = malloc(t->l.n_params * sizeof(float) + 1);
    model_init_params(&t->m, &t->l, t->params);
    /* Random biases and weights too, so no gradient is trivially zero. */
    for (size_t i = 0; i < t->l.n_params; i++) t->params[i] = (float)unif(-sh->wscale, sh->wscale);
    for (uint32_t tb = 0; tb < t->l.n_tables; tb++) {
        size_t n = (size_t)U * t->l.table_dim[tb];
        t->emb[tb] = malloc(n * sizeof(float));
        for (size_t i = 0; i < n; i++) t->emb[tb][i] = (float)unif(-0.5, 0.5);
    }
    model_batch *mb = &t->mb;
    memset(mb, 0, sizeof *mb);
    mb->B = B;
    mb->F = F;
    mb->D = D;
    mb->U = U;
    mb->dense = t->dense;
    mb->labels = t->labels;
    mb->row_ptr = t->row_ptr;
    mb->col = t->col;
    mb->val = t->val;
    for (uint32_t tb = 0; tb < t->l.n_tables; tb++) mb->emb[tb] = t->emb[tb];
    return 0;
}

/* ---- the reference forward pass, in double, from model.h's description ---- */

#define REF_MAX 1024

typedef struct refst {
    unsigned char *mask; /* ReLU signs, in evaluation order */
    size_t n_mask, cap_mask;
} refst;

static void ref_layer(const model_layer *ly, const double *P, const double *x, double *y, refst *rs)
{
    for (uint32_t o = 0; o < ly->out; o++) {
        double s = P[ly->b + o];
        for (uint32_t i = 0; i < ly->in; i++) s += P[ly->w + (size_t)o * ly->in + i] * x[i];
        if (ly->relu) {
            if (rs->n_mask < rs->cap_mask) rs->mask[rs->n_mask] = s > 0;
            rs->n_mask++;
            y[o] = s > 0 ? s : 0;
        } else {
            y[o] = s;
        }
    }
}

/* Mean loss; logits[b] when non-NULL. */
static double ref_loss(const tcase *t, const double *P, double *const *E, double *logits, refst *rs)
{
    const model_cfg *m = &t->m;
    const model_layout *l = &t->l;
    const uint32_t F = t->F, D = t->D, d = m->dim;
    static double xe[REF_MAX], xl[REF_MAX], x[REF_MAX], in[REF_MAX], h1[REF_MAX], h2[REF_MAX];
    rs->n_mask = 0;
    double sum = 0;
    for (uint32_t b = 0; b < t->B; b++) {
        for (uint32_t k = 0; k < D; k++) x[k] = t->dense[(size_t)b * D + k];
        memset(xe, 0, sizeof xe);
        memset(xl, 0, sizeof xl);
        for (uint32_t f = 0; f < F; f++) {
            size_t r = (size_t)b * F + f;
            for (uint32_t k = t->row_ptr[r]; k < t->row_ptr[r + 1]; k++) {
                uint32_t u = t->col[k];
                double v = t->val[k];
                if (l->emb_table >= 0)
                    for (uint32_t j = 0; j < d; j++) xe[f * d + j] += v * E[l->emb_table][(size_t)u * d + j];
                if (l->lin_table >= 0) xl[f] += v * E[l->lin_table][u];
            }
        }
        double z = 0;
        if (l->lin_table >= 0) {
            z += P[l->lin_c];
            for (uint32_t f = 0; f < F; f++) z += xl[f];
            for (uint32_t k = 0; k < D; k++) z += P[l->lin_w + k] * x[k];
        }
        if (m->kind == MODEL_DEEPFM) /* sum over pairs f < g of <v_f, v_g> */
            for (uint32_t f = 0; f < F; f++)
                for (uint32_t g = f + 1; g < F; g++)
                    for (uint32_t j = 0; j < d; j++) z += xe[f * d + j] * xe[g * d + j];
        if (l->n_top > 0) {
            uint32_t ti = 0;
            if (m->kind == MODEL_DLRM) {
                const double *cur = x;
                double *bufs[2] = {h1, h2};
                for (uint32_t i = 0; i < l->n_bot; i++) {
                    ref_layer(&l->bot[i], P, cur, bufs[i & 1], rs);
                    cur = bufs[i & 1];
                }
                /* vectors: z0 then the F pooled embeddings; pairs i < j in order */
                const double *vec[REF_MAX / 4];
                vec[0] = cur;
                for (uint32_t f = 0; f < F; f++) vec[f + 1] = xe + f * d;
                for (uint32_t j = 0; j < d; j++) in[ti++] = cur[j];
                for (uint32_t a = 0; a <= F; a++)
                    for (uint32_t e = a + 1; e <= F; e++) {
                        double s = 0;
                        for (uint32_t j = 0; j < d; j++) s += vec[a][j] * vec[e][j];
                        in[ti++] = s;
                    }
            } else {
                for (uint32_t k = 0; k < F * d; k++) in[ti++] = xe[k];
                for (uint32_t k = 0; k < D; k++) in[ti++] = x[k];
            }
            CHECK(ti == l->top_in);
            const double *cur = in;
            double *bufs[2] = {h1, h2};
            for (uint32_t i = 0; i < l->n_top; i++) {
                ref_layer(&l->top[i], P, cur, bufs[i & 1], rs);
                cur = bufs[i & 1];
            }
            z += cur[0];
        }
        if (logits) logits[b] = z;
        double y = t->labels[b];
        sum += fmax(z, 0.0) - z * y + log1p(exp(-fabs(z)));
    }
    return sum / t->B;
}

/* ---- the backend ---- */

typedef struct outs {
    float *probs, *dparams, *demb[MODEL_MAX_TABLES];
    double loss;
} outs;

static void outs_alloc(outs *o, const tcase *t)
{
    o->probs = malloc(t->B * sizeof(float));
    o->dparams = malloc(t->l.n_params * sizeof(float) + 1);
    for (uint32_t tb = 0; tb < MODEL_MAX_TABLES; tb++)
        o->demb[tb] = tb < t->l.n_tables ? malloc((size_t)t->U * t->l.table_dim[tb] * sizeof(float)) : NULL;
}

static void outs_nan(outs *o, const tcase *t)
{
    for (uint32_t i = 0; i < t->B; i++) o->probs[i] = NAN;
    for (size_t i = 0; i < t->l.n_params; i++) o->dparams[i] = NAN;
    for (uint32_t tb = 0; tb < t->l.n_tables; tb++)
        for (size_t i = 0; i < (size_t)t->U * t->l.table_dim[tb]; i++) o->demb[tb][i] = NAN;
    o->loss = NAN;
}

static void outs_free(outs *o)
{
    free(o->probs);
    free(o->dparams);
    for (int i = 0; i < MODEL_MAX_TABLES; i++) free(o->demb[i]);
}

static int outs_same(const outs *a, const outs *b, const tcase *t)
{
    int same = memcmp(a->probs, b->probs, t->B * sizeof(float)) == 0 &&
               memcmp(&a->loss, &b->loss, sizeof a->loss) == 0 &&
               memcmp(a->dparams, b->dparams, t->l.n_params * sizeof(float)) == 0;
    for (uint32_t tb = 0; tb < t->l.n_tables; tb++)
        same = same && memcmp(a->demb[tb], b->demb[tb], (size_t)t->U * t->l.table_dim[tb] * sizeof(float)) == 0;
    return same;
}

/* backend_ops.create flags for the backends be_create makes. */
static uint32_t be_flags;

static void *be_create(const tcase *t, uint32_t threads)
{
    void *st = NULL;
    char *err = NULL;
    int rc = backend_cpu_ops.create(&t->m, &t->l, t->B + 5, t->U + 7, threads, be_flags, &st, &err);
    CHECK_OK(rc, err);
    return rc == 0 ? st : NULL;
}

static double be_loss(void *st, const tcase *t, float *probs)
{
    double loss = NAN;
    char *err = NULL;
    int rc = backend_cpu_ops.step(st, t->params, &t->mb, probs, &loss, NULL, NULL, &err);
    CHECK_OK(rc, err);
    return loss;
}

static int be_full(void *st, const tcase *t, outs *o)
{
    char *err = NULL;
    outs_nan(o, t);
    int rc = backend_cpu_ops.step(st, t->params, &t->mb, o->probs, &o->loss, o->dparams, o->demb, &err);
    CHECK_OK(rc, err);
    return rc;
}

/* ---- gradient checks ---- */

typedef struct stats {
    size_t coords, skipped, bad_ref, bad_fd;
    double max_err_ref, max_err_fd, max_grad;
} stats;

/* Tolerances. The reference differences are exact to ~1e-9, so the gap to a float analytic
 * gradient is float rounding only; the float differences carry ~1e-4 of rounding noise. */
#define REF_ATOL 1e-6
#define REF_RTOL 1e-4
#define FD_ATOL 2e-4
#define FD_RTOL 2e-3
#define EPS_REF 1e-6
#define EPS_FD 1e-3f

static int same_mask(const refst *a, const refst *b)
{
    return a->n_mask == b->n_mask && memcmp(a->mask, b->mask, a->n_mask < a->cap_mask ? a->n_mask : a->cap_mask) == 0;
}

/* One coordinate: x is the float the backend sees, xd its double twin in the reference. */
static void check_coord(const char *what, size_t idx, float *x, double *xd, float analytic, void *st,
                        const tcase *t, const double *P, double *const *E, const refst *base,
                        refst *tmp, float *probs, stats *s)
{
    s->coords++;
    const double x0 = *xd;
    const float xf = *x;
    /* Kink guard at the larger eps (it covers the smaller one for all but pathological cases). */
    float xp = xf + EPS_FD, xm = xf - EPS_FD;
    int kink = 0;
    *xd = xp;
    ref_loss(t, P, E, NULL, tmp);
    kink |= !same_mask(base, tmp);
    *xd = xm;
    ref_loss(t, P, E, NULL, tmp);
    kink |= !same_mask(base, tmp);
    *xd = x0 + EPS_REF;
    double lp = ref_loss(t, P, E, NULL, tmp);
    kink |= !same_mask(base, tmp);
    *xd = x0 - EPS_REF;
    double lm = ref_loss(t, P, E, NULL, tmp);
    kink |= !same_mask(base, tmp);
    *xd = x0;
    if (kink) {
        s->skipped++;
        return;
    }
    double nref = (lp - lm) / (2 * EPS_REF);
    double a = analytic;
    double e1 = fabs(a - nref);
    s->max_grad = fmax(s->max_grad, fabs(a));
    s->max_err_ref = fmax(s->max_err_ref, e1);
    if (!(e1 <= REF_ATOL + REF_RTOL * fmax(fabs(a), fabs(nref)))) {
        if (s->bad_ref++ < 5)
            fprintf(stderr, "  %s %s[%zu]: analytic %.7g, reference difference %.7g\n", t->name, what,
                    idx, a, nref);
    }
    *x = xp;
    double fp = be_loss(st, t, probs);
    *x = xm;
    double fm = be_loss(st, t, probs);
    *x = xf;
    double nfd = (fp - fm) / ((double)xp - (double)xm);
    double e2 = fabs(a - nfd);
    s->max_err_fd = fmax(s->max_err_fd, e2);
    if (!(e2 <= FD_ATOL + FD_RTOL * fmax(fabs(a), fabs(nfd)))) {
        if (s->bad_fd++ < 5)
            fprintf(stderr, "  %s %s[%zu]: analytic %.7g, float difference %.7g\n", t->name, what, idx,
                    a, nfd);
    }
}

static void gradcheck(tcase *t, const char *label)
{
    void *st = be_create(t, 1);
    if (st == NULL) return;
    outs o;
    outs_alloc(&o, t);
    if (be_full(st, t, &o) != 0) {
        outs_free(&o);
        backend_cpu_ops.destroy(st);
        return;
    }
    const model_layout *l = &t->l;
    /* Every output written. */
    int finite = isfinite(o.loss);
    for (uint32_t i = 0; i < t->B; i++) finite &= isfinite(o.probs[i]) && o.probs[i] > 0 && o.probs[i] < 1;
    for (size_t i = 0; i < l->n_params; i++) finite &= isfinite(o.dparams[i]);
    for (uint32_t tb = 0; tb < l->n_tables; tb++)
        for (size_t i = 0; i < (size_t)t->U * l->table_dim[tb]; i++) finite &= isfinite(o.demb[tb][i]);
    CHECK_MSG(finite, "%s: an output was left unwritten or is not finite", label);
    /* The unused key's gradient rows are zero. */
    for (uint32_t tb = 0; tb < l->n_tables; tb++)
        for (uint32_t j = 0; j < l->table_dim[tb]; j++)
            CHECK_MSG(o.demb[tb][(size_t)(t->U - 1) * l->table_dim[tb] + j] == 0.0f,
                      "%s: unused key has gradient %g in table %u", label,
                      o.demb[tb][(size_t)(t->U - 1) * l->table_dim[tb] + j], tb);

    /* The double twins. */
    double *P = malloc(l->n_params * sizeof(double) + 1), *E[MODEL_MAX_TABLES] = {0};
    for (size_t i = 0; i < l->n_params; i++) P[i] = t->params[i];
    for (uint32_t tb = 0; tb < l->n_tables; tb++) {
        size_t n = (size_t)t->U * l->table_dim[tb];
        E[tb] = malloc(n * sizeof(double));
        for (size_t i = 0; i < n; i++) E[tb][i] = t->emb[tb][i];
    }
    refst base = {malloc(4096), 0, 4096}, tmp = {malloc(4096), 0, 4096};
    double logits[64];
    double rl = ref_loss(t, P, E, logits, &base);
    CHECK(base.n_mask <= base.cap_mask);
    /* Forward: probs and loss agree with the reference. */
    CHECK_MSG(fabs(rl - o.loss) <= 1e-5 * fmax(1, rl), "%s: loss %.9g, reference %.9g", label, o.loss, rl);
    for (uint32_t i = 0; i < t->B; i++) {
        double p = 1 / (1 + exp(-logits[i]));
        CHECK_MSG(fabs(p - o.probs[i]) <= 2e-6, "%s: prob[%u] %.9g, reference %.9g (logit %.6g)", label,
                  i, o.probs[i], p, logits[i]);
    }
    /* Forward-only gives the same probs, bit for bit; a second call the same everything. */
    float *probs = malloc(t->B * sizeof(float));
    double fl = be_loss(st, t, probs);
    CHECK_MSG(memcmp(probs, o.probs, t->B * sizeof(float)) == 0 && fl == o.loss,
              "%s: forward-only pass differs from the training pass", label);
    outs o2;
    outs_alloc(&o2, t);
    be_full(st, t, &o2);
    CHECK_MSG(outs_same(&o, &o2, t), "%s: a repeated step differs", label);

    stats s;
    memset(&s, 0, sizeof s);
    for (size_t i = 0; i < l->n_params; i++)
        check_coord("dparams", i, &t->params[i], &P[i], o.dparams[i], st, t, P, E, &base, &tmp, probs, &s);
    for (uint32_t tb = 0; tb < l->n_tables; tb++)
        for (size_t i = 0; i < (size_t)t->U * l->table_dim[tb]; i++)
            check_coord(tb == (uint32_t)l->lin_table ? "demb[lin]" : "demb[emb]", i, &t->emb[tb][i],
                        &E[tb][i], o.demb[tb][i], st, t, P, E, &base, &tmp, probs, &s);
    fprintf(stderr, "%-28s coords %4zu skipped %2zu  max|g| %.3g  max err: ref %.2g, float fd %.2g\n",
            label, s.coords, s.skipped, s.max_grad, s.max_err_ref, s.max_err_fd);
    CHECK_MSG(s.bad_ref == 0, "%s: %zu gradients disagree with the double reference", label, s.bad_ref);
    CHECK_MSG(s.bad_fd == 0, "%s: %zu gradients disagree with float differences", label, s.bad_fd);
    CHECK_MSG(s.skipped * 10 <= s.coords, "%s: %zu of %zu coordinates sit on a ReLU kink", label,
              s.skipped, s.coords);
    CHECK(s.max_grad > 1e-3); /* the case is not degenerate */

    /* threads 2: the same bits */
    void *st2 = be_create(t, 2);
    if (st2) {
        be_full(st2, t, &o2);
        CHECK_MSG(outs_same(&o, &o2, t), "%s: threads 2 differs from threads 1", label);
        backend_cpu_ops.destroy(st2);
    }
    outs_free(&o2);
    free(probs);
    free(base.mask);
    free(tmp.mask);
    free(P);
    for (int i = 0; i < MODEL_MAX_TABLES; i++) free(E[i]);
    outs_free(&o);
    backend_cpu_ops.destroy(st);
}

/* lr by hand: logit = c + w . x + sum_f sum_k val_k lin[col_k]. */
static void lr_by_hand(void)
{
    shape sh = {.F = 4, .D = 3, .B = 7, .U = 10, .max_keys = 3, .wscale = 0.8};
    tcase t;
    if (tcase_make(&t, MODEL_LR, &sh, 1, 1, 99) != 0) return;
    CHECK(t.l.n_tables == 1 && t.l.lin_table == 0 && t.l.table_dim[0] == 1);
    CHECK(t.l.n_params == t.D + 1);
    void *st = be_create(&t, 1);
    float probs[16];
    double loss = 0;
    char *err = NULL;
    int rc = backend_cpu_ops.step(st, t.params, &t.mb, probs, &loss, NULL, NULL, &err);
    CHECK_OK(rc, err);
    double want_loss = 0;
    for (uint32_t b = 0; b < t.B; b++) {
        double z = t.params[t.l.lin_c];
        for (uint32_t k = 0; k < t.D; k++) z += (double)t.params[t.l.lin_w + k] * t.dense[b * t.D + k];
        for (uint32_t k = t.row_ptr[b * t.F]; k < t.row_ptr[(b + 1) * t.F]; k++)
            z += (double)t.val[k] * t.emb[0][t.col[k]];
        double p = 1 / (1 + exp(-z));
        CHECK_MSG(fabs(p - probs[b]) <= 1e-6, "lr prob[%u] %.9g, by hand %.9g", b, probs[b], p);
        want_loss += t.labels[b] ? -log(p) : -log1p(-p);
    }
    want_loss /= t.B;
    CHECK_MSG(fabs(loss - want_loss) <= 1e-6, "lr loss %.9g, by hand %.9g", loss, want_loss);
    /* Labels NULL: forward works; backward needs labels. */
    t.mb.labels = NULL;
    rc = backend_cpu_ops.step(st, t.params, &t.mb, probs, NULL, NULL, NULL, &err);
    CHECK_OK(rc, err);
    backend_cpu_ops.destroy(st);
    tcase_free(&t);
}

/* Batches that do not fit the model are refused. */
static void shape_errors(void)
{
    shape sh = {.F = 3, .D = 2, .B = 7, .U = 9, .dim = 4, .max_keys = 3, .n_hidden = 2,
                .hidden = {8, 6}, .wscale = 0.5};
    tcase t;
    if (tcase_make(&t, MODEL_MLP, &sh, 0, 0, 5) != 0) return;
    void *st = NULL;
    char *err = NULL;
    int rc = backend_cpu_ops.create(&t.m, &t.l, 4, 100, 1, 0, &st, &err); /* max_batch 4 < B 7 */
    CHECK_OK(rc, err);
    outs o;
    outs_alloc(&o, &t);
    rc = backend_cpu_ops.step(st, t.params, &t.mb, o.probs, &o.loss, o.dparams, o.demb, &err);
    CHECK_MSG(rc != 0 && err != NULL, "a batch larger than max_batch was accepted");
    free(err);
    err = NULL;
    backend_cpu_ops.destroy(st);
    st = be_create(&t, 1);
    model_batch mb = t.mb;
    mb.F = t.F + 1;
    rc = backend_cpu_ops.step(st, t.params, &mb, o.probs, &o.loss, o.dparams, o.demb, &err);
    CHECK_MSG(rc != 0 && err != NULL, "a batch with the wrong field count was accepted");
    free(err);
    err = NULL;
    mb = t.mb;
    mb.U = t.U + 100;
    rc = backend_cpu_ops.step(st, t.params, &mb, o.probs, &o.loss, o.dparams, o.demb, &err);
    CHECK_MSG(rc != 0 && err != NULL, "a batch with more keys than max_uniq was accepted");
    free(err);
    backend_cpu_ops.destroy(st);
    outs_free(&o);
    tcase_free(&t);
}

/* A batch large enough that the backend splits its GEMMs: every thread count, the same bits. */
static void threads_large(model_kind kind)
{
    shape sh = {.F = 5, .D = 4, .B = 256, .U = 400, .dim = 16, .max_keys = 3, .n_hidden = 2,
                .hidden = {256, 128}, .n_bottom = 2, .bottom = {64, 16}, .wscale = 0.1};
    tcase t;
    if (tcase_make(&t, kind, &sh, 1, 0, 1234 + kind) != 0) return;
    outs ref, o;
    outs_alloc(&ref, &t);
    outs_alloc(&o, &t);
    void *st = be_create(&t, 1);
    be_full(st, &t, &ref);
    backend_cpu_ops.destroy(st);
    for (uint32_t th = 2; th <= 3; th++) {
        st = be_create(&t, th);
        if (st == NULL) continue;
        for (int rep = 0; rep < 3; rep++) {
            be_full(st, &t, &o);
            CHECK_MSG(outs_same(&ref, &o, &t), "%s B=256: threads %u (call %d) differs from threads 1",
                      t.name, th, rep);
        }
        backend_cpu_ops.destroy(st);
    }
    outs_free(&ref);
    outs_free(&o);
    tcase_free(&t);
}

int main(void)
{
    const model_kind kinds[] = {MODEL_LR, MODEL_MLP, MODEL_DLRM, MODEL_DEEPFM};
    /* Shapes vary with the seed: F 3..5, D 2..4. */
    const uint64_t seeds[] = {11, 22, 33};
    for (int k = 0; k < 4; k++)
        for (int si = 0; si < 3; si++)
            for (int pool = 0; pool < 2; pool++) {
                uint64_t seed = seeds[si] * 7919 + (uint64_t)k * 131 + (uint64_t)pool;
                shape sh = {.F = 3 + (uint32_t)si, .D = 2 + (uint32_t)((si + k) % 3), .B = 7,
                            .U = 12, .dim = 4, .max_keys = 3, .n_hidden = 2, .hidden = {8, 6},
                            .n_bottom = 2, .bottom = {5, 4}, .wscale = 0.6};
                bool fact = kinds[k] == MODEL_MLP || kinds[k] == MODEL_DEEPFM;
                for (int fa = 0; fa < (fact ? 2 : 1); fa++) {
                    tcase t;
                    if (tcase_make(&t, kinds[k], &sh, pool, si == 2, seed) != 0) continue;
                    char label[96];
                    snprintf(label, sizeof label, "%s F%u D%u %s%s%s", t.name, sh.F, sh.D,
                             pool ? "mean" : "sum", si == 2 ? " weighted" : "",
                             fa ? " factorized" : "");
                    be_flags = fa ? BACKEND_FACTORED : 0;
                    gradcheck(&t, label);
                    be_flags = 0;
                    tcase_free(&t);
                }
            }
    /* The factorized layer's kernels for dim 16: the CPU's best (AVX-512 or AVX2), at most
     * AVX2, portable. */
    static const uint32_t kernels[3] = {0, BACKEND_NO_AVX512, BACKEND_NO_SIMD};
    for (int k = 0; k < 2; k++)
        for (int kv = 0; kv < 3; kv++) {
            model_kind kind = k ? MODEL_DEEPFM : MODEL_MLP;
            shape sh = {.F = 4,
                        .D = 3,
                        .B = 7,
                        .U = 12,
                        .dim = 16,
                        .max_keys = 3,
                        .n_hidden = 2,
                        .hidden = {32, 6},
                        .wscale = 0.3};
            tcase t;
            if (tcase_make(&t, kind, &sh, 1, 1, 4711 + (uint64_t)k) != 0) continue;
            char label[96];
            snprintf(label, sizeof label, "%s dim 16 factorized, %s kernels", t.name,
                     backend_cpu_fact_kernels(BACKEND_FACTORED | kernels[kv]));
            be_flags = BACKEND_FACTORED | kernels[kv];
            gradcheck(&t, label);
            be_flags = 0;
            tcase_free(&t);
        }
    lr_by_hand();
    shape_errors();
    for (int k = 0; k < 4; k++) threads_large(kinds[k]);
    be_flags = BACKEND_FACTORED;
    threads_large(MODEL_MLP);
    threads_large(MODEL_DEEPFM);
    be_flags = 0;
    return check_done();
}
