/*
 * emb_opt: every optimizer against a double-precision reference written here from the update
 * rules in embedding.h, plus updates / last_step / state slots / stats, and the deterministic
 * initialisation (key + seed, whatever the arrival order or sharding).
 *
 * The reference keeps rows the way the header specifies storage: float weights and state,
 * double arithmetic within a step. It starts each row from the table's own initial row (taken
 * from a twin table), so the initial-state checks and the step checks fail independently.
 */
#include "emb_util.h"

#define MAXD 16u
#define NKEYS 6u
#define STEPS 20u
#define MAXBATCH 12u

/* Relative 1e-6 with an absolute floor for values near 0 (float state such as an Adam m that
 * cancels to ~0 is only meaningful to about one float ulp of the terms that produced it). */
static int close_enough(double a, double b)
{
    return fabs(a - b) <= 1e-6 * fmax(fabs(a), fabs(b)) + 1e-7;
}

typedef struct ref_row {
    int exists;
    uint64_t updates, last_step;
    float w[MAXD];
    float s[2 * MAXD];
} ref_row;

static double ftrl_weight(const emb_table_config *c, double z, double n)
{
    double l1 = c->ftrl_l1;
    if (fabs(z) <= l1) return 0.0;
    double sgn = z < 0 ? -1.0 : 1.0;
    return -(z - sgn * l1) / ((c->ftrl_beta + sqrt(n)) / c->lr + c->l2);
}

/* One optimizer step on the reference row, straight from the header's formulas. */
static void ref_step(const emb_table_config *c, ref_row *r, const float *g)
{
    const uint32_t d = c->dim;
    const double lr = c->lr, l2 = c->l2, eps = c->eps;
    double gp[MAXD];
    for (uint32_t j = 0; j < d; j++) gp[j] = (double)g[j] + l2 * (double)r->w[j];
    switch (c->opt) {
    case EMB_OPT_SGD:
        for (uint32_t j = 0; j < d; j++) r->w[j] = (float)(r->w[j] - lr * gp[j]);
        break;
    case EMB_OPT_ADAGRAD:
        for (uint32_t j = 0; j < d; j++) {
            double a = (double)r->s[j] + gp[j] * gp[j];
            r->s[j] = (float)a;
            r->w[j] = (float)(r->w[j] - lr * gp[j] / (sqrt(a) + eps));
        }
        break;
    case EMB_OPT_ADAGRAD_ROWWISE: {
        double mean = 0;
        for (uint32_t j = 0; j < d; j++) mean += gp[j] * gp[j];
        double a = (double)r->s[0] + mean / d;
        r->s[0] = (float)a;
        for (uint32_t j = 0; j < d; j++) r->w[j] = (float)(r->w[j] - lr * gp[j] / (sqrt(a) + eps));
        break;
    }
    case EMB_OPT_ADAM: {
        const double b1 = c->beta1, b2 = c->beta2;
        const double t = (double)(r->updates + 1);
        for (uint32_t j = 0; j < d; j++) {
            double m = b1 * r->s[j] + (1 - b1) * gp[j];
            double v = b2 * r->s[d + j] + (1 - b2) * gp[j] * gp[j];
            r->s[j] = (float)m;
            r->s[d + j] = (float)v;
            double mhat = m / (1 - pow(b1, t)), vhat = v / (1 - pow(b2, t));
            r->w[j] = (float)(r->w[j] - lr * mhat / (sqrt(vhat) + eps));
        }
        break;
    }
    case EMB_OPT_FTRL:
        for (uint32_t j = 0; j < d; j++) {
            double gj = g[j], w = r->w[j], z = r->s[j], n = r->s[d + j];
            double sigma = (sqrt(n + gj * gj) - sqrt(n)) / lr;
            z += gj - sigma * w;
            n += gj * gj;
            r->s[j] = (float)z;
            r->s[d + j] = (float)n;
            r->w[j] = (float)ftrl_weight(c, z, n);
        }
        break;
    }
    r->updates++;
}

/* The initial optimizer state the header promises, checked on a freshly created row. */
static void check_initial_state(const emb_table_config *c, const eu_row *r, const char *name)
{
    const uint32_t d = c->dim;
    int ok = r->updates == 0;
    switch (c->opt) {
    case EMB_OPT_SGD: break;
    case EMB_OPT_ADAGRAD:
        for (uint32_t j = 0; j < d; j++) ok &= r->s[j] == c->adagrad_init;
        break;
    case EMB_OPT_ADAGRAD_ROWWISE: ok &= r->s[0] == c->adagrad_init; break;
    case EMB_OPT_ADAM:
        for (uint32_t j = 0; j < 2 * d; j++) ok &= r->s[j] == 0.0f;
        break;
    case EMB_OPT_FTRL:
        for (uint32_t j = 0; j < d; j++) {
            ok &= r->s[d + j] == 0.0f;
            ok &= close_enough(ftrl_weight(c, r->s[j], 0.0), r->w[j]);
        }
        break;
    }
    CHECK_MSG(ok, "%s: initial row state is not what the header specifies", name);
}

typedef struct opt_case {
    const char *name;
    emb_opt_kind opt;
    uint32_t dim;
    float l2, adagrad_init, eps, ftrl_l1, ftrl_beta, lr;
} opt_case;

static const opt_case CASES[] = {
    {"sgd", EMB_OPT_SGD, 5, 0, 0, 1e-8f, 0, 1, 0.05f},
    {"sgd+l2", EMB_OPT_SGD, 16, 0.1f, 0, 1e-8f, 0, 1, 0.05f},
    {"adagrad", EMB_OPT_ADAGRAD, 7, 0, 0.1f, 1e-8f, 0, 1, 0.05f},
    {"adagrad+l2 init0", EMB_OPT_ADAGRAD, 16, 0.01f, 0, 1e-8f, 0, 1, 0.1f},
    {"adagrad_rowwise", EMB_OPT_ADAGRAD_ROWWISE, 7, 0, 0.1f, 1e-8f, 0, 1, 0.05f},
    {"adagrad_rowwise+l2", EMB_OPT_ADAGRAD_ROWWISE, 16, 0.05f, 0, 1e-6f, 0, 1, 0.1f},
    {"adam", EMB_OPT_ADAM, 8, 0, 0, 1e-8f, 0, 1, 0.01f},
    {"adam+l2", EMB_OPT_ADAM, 13, 0.01f, 0, 1e-6f, 0, 1, 0.05f},
    {"ftrl", EMB_OPT_FTRL, 8, 0, 0, 1e-8f, 0, 1, 0.05f},
    {"ftrl+l1+l2", EMB_OPT_FTRL, 16, 0.1f, 0, 1e-8f, 0.05f, 1, 0.1f},
    {"ftrl big l1", EMB_OPT_FTRL, 4, 0.01f, 0, 1e-8f, 0.5f, 0.5f, 0.2f},
};

/* How pushes stamp last_step relative to the step after the call (0 or 1 behind): the header
 * leaves it open, so the first push decides and every later push must agree. -1 = unknown. */
static int push_stamp_lag = -1;

/* Brings a key into the reference model from the twin table (its initial row). */
static void ref_touch(emb_table *twin, const emb_table_config *c, ref_row *r, uint64_t key,
                      const char *name)
{
    if (r->exists) return;
    float w[MAXD];
    eu_row row;
    eu_pull(twin, &key, 1, w);
    eu_get(twin, key, &row);
    CHECK(row.found && memcmp(row.w, w, c->dim * sizeof(float)) == 0);
    check_initial_state(c, &row, name);
    memcpy(r->w, row.w, sizeof r->w);
    memcpy(r->s, row.s, sizeof r->s);
    r->updates = 0;
    r->exists = 1;
}

/* Every stored row against the reference: weights/state to tolerance, counters exactly. */
static void compare_rows(emb_table *t, const emb_table_config *c, const uint64_t *keys,
                         const ref_row *ref, const char *name, uint32_t step)
{
    const uint32_t slots = emb_row_slots(c);
    for (uint32_t k = 0; k < NKEYS; k++) {
        eu_row row;
        int found = eu_get(t, keys[k], &row);
        CHECK_MSG(found == ref[k].exists, "%s step %u key %u: found=%d", name, step, k, found);
        if (!found || !ref[k].exists) continue;
        CHECK_MSG(row.updates == ref[k].updates, "%s step %u key %u: updates %" PRIu64
                  " want %" PRIu64, name, step, k, row.updates, ref[k].updates);
        CHECK_MSG(row.last_step == ref[k].last_step, "%s step %u key %u: last_step %" PRIu64
                  " want %" PRIu64, name, step, k, row.last_step, ref[k].last_step);
        for (uint32_t j = 0; j < c->dim; j++)
            CHECK_MSG(close_enough(row.w[j], ref[k].w[j]), "%s step %u key %u w[%u]: %.9g want %.9g",
                      name, step, k, j, row.w[j], ref[k].w[j]);
        for (uint32_t j = 0; j < slots; j++)
            CHECK_MSG(close_enough(row.s[j], ref[k].s[j]), "%s step %u key %u s[%u]: %.9g want %.9g",
                      name, step, k, j, row.s[j], ref[k].s[j]);
    }
}

static void run_case(const opt_case *oc, uint64_t seed)
{
    emb_table_config c = eu_config(oc->opt, oc->dim);
    c.l2 = oc->l2;
    c.adagrad_init = oc->adagrad_init;
    c.eps = oc->eps;
    c.ftrl_l1 = oc->ftrl_l1;
    c.ftrl_beta = oc->ftrl_beta;
    c.lr = oc->lr;
    c.init_scale = 0.1f;
    emb_table *t = eu_create(&c), *twin = eu_create(&c);
    const uint64_t keys[NKEYS] = {0, 1, eu_key(1), eu_key(2), UINT64_MAX, eu_key(3)};
    ref_row ref[NKEYS];
    memset(ref, 0, sizeof ref);
    uint64_t pulled = 0, pushed = 0;
    for (uint32_t step = 0; step < STEPS; step++) {
        /* a pull of a few keys on most steps: creates rows and stamps last_step */
        if (eu_below(&seed, 3) != 0) {
            uint64_t pk[NKEYS];
            uint32_t idx[NKEYS];
            float out[NKEYS * MAXD];
            size_t np = 1 + eu_below(&seed, NKEYS);
            for (size_t i = 0; i < np; i++) {
                idx[i] = (uint32_t)eu_below(&seed, NKEYS);
                pk[i] = keys[idx[i]];
                ref_touch(twin, &c, &ref[idx[i]], pk[i], oc->name);
            }
            eu_pull(t, pk, np, out);
            pulled += np;
            for (size_t i = 0; i < np; i++) {
                ref[idx[i]].last_step = emb_table_step(t);
                for (uint32_t j = 0; j < c.dim; j++)
                    CHECK_MSG(close_enough(out[i * c.dim + j], ref[idx[i]].w[j]),
                              "%s step %u: pulled weight differs", oc->name, step);
            }
        }
        /* a push with repeated keys (applied in order), some keys never pulled before */
        uint64_t bk[MAXBATCH];
        uint32_t idx[MAXBATCH];
        float g[MAXBATCH * MAXD];
        size_t nb = 1 + eu_below(&seed, MAXBATCH);
        for (size_t i = 0; i < nb; i++) {
            idx[i] = (uint32_t)eu_below(&seed, NKEYS - (step < 10)); /* last key: late */
            bk[i] = keys[idx[i]];
            double scale = eu_below(&seed, 8) == 0 ? 5.0 : 1.0;
            for (uint32_t j = 0; j < c.dim; j++)
                g[i * c.dim + j] = (float)(scale * (2 * eu_unif(&seed) - 1));
            ref_touch(twin, &c, &ref[idx[i]], bk[i], oc->name);
            ref_step(&c, &ref[idx[i]], g + i * c.dim);
        }
        eu_push(t, bk, nb, g);
        pushed += nb;
        uint64_t now = emb_table_step(t);
        CHECK_MSG(now == step + 1, "%s: step %" PRIu64 " after %u pushes", oc->name, now, step + 1);
        eu_row first;
        eu_get(t, bk[0], &first);
        if (push_stamp_lag < 0 && first.found && (first.last_step == now || first.last_step + 1 == now))
            push_stamp_lag = (int)(now - first.last_step);
        CHECK_MSG(push_stamp_lag >= 0, "%s: pushed row last_step %" PRIu64 " at step %" PRIu64,
                  oc->name, first.last_step, now);
        for (size_t i = 0; i < nb; i++) ref[idx[i]].last_step = now - (uint64_t)push_stamp_lag;
        compare_rows(t, &c, keys, ref, oc->name, step);
    }
    emb_table_stats st = eu_stats(t);
    uint64_t live = 0;
    for (uint32_t k = 0; k < NKEYS; k++) live += ref[k].exists;
    CHECK_MSG(st.pulls == pulled && st.pushes == pushed && st.created == live &&
                  st.rows_mem == live && st.rows_spilled == 0 && st.step == STEPS,
              "%s stats: pulls %" PRIu64 "/%" PRIu64 " pushes %" PRIu64 "/%" PRIu64
              " created %" PRIu64 " rows %" PRIu64 "/%" PRIu64,
              oc->name, st.pulls, pulled, st.pushes, pushed, st.created, st.rows_mem, live);
    emb_table_destroy(t);
    emb_table_destroy(twin);
}

static void test_slots_and_names(void)
{
    static const uint32_t want_slots[5] = {0, 7, 1, 14, 14};
    for (int k = 0; k < 5; k++) {
        emb_table_config c = eu_config((emb_opt_kind)k, 7);
        uint32_t slots = emb_row_slots(&c);
        size_t min_bytes = 24 + 4 * (size_t)(7 + want_slots[k]);
        CHECK_MSG(slots == want_slots[k], "opt %d: %u slots", k, slots);
        CHECK(emb_row_bytes(&c) >= min_bytes && emb_row_bytes(&c) < min_bytes + 8);
        CHECK(emb_row_mem_bytes(&c) >= (double)emb_row_bytes(&c));
        emb_opt_kind back = (emb_opt_kind)99;
        const char *name = emb_opt_name((emb_opt_kind)k);
        CHECK(name != NULL && emb_opt_parse(name, &back) == 0 && back == (emb_opt_kind)k);
    }
    static const char *const names[5] = {"sgd", "adagrad", "adagrad_rowwise", "adam", "ftrl"};
    for (int k = 0; k < 5; k++) {
        emb_opt_kind o = (emb_opt_kind)99;
        CHECK_MSG(emb_opt_parse(names[k], &o) == 0 && o == (emb_opt_kind)k, "parse %s", names[k]);
    }
    emb_table_config d;
    emb_table_config_init(&d);
    CHECK(d.dim == 16 && d.opt == EMB_OPT_ADAGRAD && d.lr == 0.05f && d.l2 == 0 &&
          d.eps == 1e-8f && d.beta1 == 0.9f && d.beta2 == 0.999f && d.adagrad_init == 0 &&
          d.ftrl_beta == 1 && d.ftrl_l1 == 0 && d.init_scale == 0.01f && d.seed == 0 &&
          d.mem_budget_bytes == 0 && d.admit_threshold <= 1 && d.ttl_steps == 0);
}

/* Initial weights depend on key and seed only: not on arrival order, batching or sharding. */
static void test_init(void)
{
    enum { N = 2000, D = 16 };
    emb_table_config c = eu_config(EMB_OPT_ADAGRAD, D);
    c.seed = 42;
    c.init_scale = 0.05f;
    emb_table_config c1 = c;
    c1.n_sub = 1;
    emb_table_config c2 = c;
    c2.seed = 43;
    emb_table *a = eu_create(&c), *b = eu_create(&c1), *other = eu_create(&c2);
    uint64_t *keys = eu_xmalloc(N * sizeof *keys);
    float *wa = eu_xmalloc(N * D * sizeof *wa), *wb = eu_xmalloc(N * D * sizeof *wb);
    for (uint32_t i = 0; i < N; i++) keys[i] = eu_key(i);
    for (uint32_t i = 0; i < N; i += 100) eu_pull(a, keys + i, 100, wa + (size_t)i * D);
    /* b: reversed, one batch, each key twice */
    uint64_t *rev = eu_xmalloc(2 * N * sizeof *rev);
    float *wrev = eu_xmalloc(2 * (size_t)N * D * sizeof *wrev);
    for (uint32_t i = 0; i < N; i++) rev[i] = rev[N + i] = keys[N - 1 - i];
    eu_pull(b, rev, 2 * N, wrev);
    for (uint32_t i = 0; i < N; i++) memcpy(wb + (size_t)i * D, wrev + (size_t)(N - 1 - i) * D, D * sizeof(float));
    CHECK_MSG(memcmp(wa, wb, (size_t)N * D * sizeof(float)) == 0, "initial weights depend on order");
    CHECK(memcmp(wrev, wrev + (size_t)N * D, (size_t)N * D * sizeof(float)) == 0);
    CHECK_MSG(eu_diff_tables(a, b, 1) == 0, "tables built in different orders differ");

    float *wo = eu_xmalloc(N * D * sizeof *wo);
    eu_pull(other, keys, N, wo);
    uint64_t same_rows = 0, same_elems = 0, out_of_range = 0, same_in_row = 0;
    double sum = 0, lo = 0, hi = 0;
    for (uint32_t i = 0; i < N; i++) {
        int row_same = 1;
        for (uint32_t j = 0; j < D; j++) {
            float w = wa[(size_t)i * D + j];
            same_elems += w == wo[(size_t)i * D + j];
            row_same &= w == wo[(size_t)i * D + j];
            out_of_range += !(fabsf(w) <= c.init_scale) + !(fabsf(wo[(size_t)i * D + j]) <= c.init_scale);
            sum += w;
            lo = fmin(lo, w);
            hi = fmax(hi, w);
            if (j) same_in_row += w == wa[(size_t)i * D + j - 1];
        }
        same_rows += row_same;
    }
    CHECK_MSG(same_rows == 0 && same_elems < N * D / 100, "seed does not change init: %" PRIu64
              " rows, %" PRIu64 " elements equal", same_rows, same_elems);
    CHECK_MSG(out_of_range == 0, "%" PRIu64 " weights outside [-init_scale, init_scale]", out_of_range);
    CHECK_MSG(fabs(sum / (N * D)) < 0.05 * c.init_scale && lo < -0.9 * c.init_scale &&
                  hi > 0.9 * c.init_scale && same_in_row < N,
              "init not uniform(-s, s): mean %g min %g max %g", sum / (N * D), lo, hi);

    /* init_scale 0 gives zeros */
    emb_table_config cz = c;
    cz.init_scale = 0;
    emb_table *z = eu_create(&cz);
    eu_pull(z, keys, N, wo);
    uint64_t nonzero = 0;
    for (size_t i = 0; i < (size_t)N * D; i++) nonzero += wo[i] != 0.0f;
    CHECK_MSG(nonzero == 0, "init_scale 0: %" PRIu64 " non-zero weights", nonzero);

    emb_table_destroy(a);
    emb_table_destroy(b);
    emb_table_destroy(other);
    emb_table_destroy(z);
    free(keys);
    free(wa);
    free(wb);
    free(wo);
    free(rev);
    free(wrev);
}

int main(void)
{
    test_slots_and_names();
    test_init();
    for (size_t i = 0; i < sizeof CASES / sizeof *CASES; i++) {
        fprintf(stderr, "optimizer case %s\n", CASES[i].name);
        run_case(&CASES[i], 100 + i);
    }
    fprintf(stderr, "pushes stamp last_step = step after the call - %d\n", push_stamp_lag);
    return check_done();
}
