/* Table configuration, row layout and the optimizer kernels. */
#include <math.h>

#include "embedding/internal.h"

static const char *const opt_names[] = {"sgd", "adagrad", "adagrad_rowwise", "adam", "ftrl"};
#define N_OPTS (sizeof opt_names / sizeof opt_names[0])

int emb_opt_parse(const char *name, emb_opt_kind *out)
{
    for (size_t i = 0; name != NULL && i < N_OPTS; i++)
        if (strcmp(name, opt_names[i]) == 0) {
            *out = (emb_opt_kind)i;
            return CM_OK;
        }
    return CM_EINVAL;
}

const char *emb_opt_name(emb_opt_kind kind)
{
    return (unsigned)kind < N_OPTS ? opt_names[kind] : "unknown";
}

void emb_table_config_init(emb_table_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->dim = 16;
    cfg->opt = EMB_OPT_ADAGRAD;
    cfg->lr = 0.05f;
    cfg->eps = 1e-8f;
    cfg->beta1 = 0.9f;
    cfg->beta2 = 0.999f;
    cfg->ftrl_beta = 1.0f;
    cfg->init_scale = 0.01f;
}

uint32_t emb_row_slots(const emb_table_config *cfg)
{
    switch (cfg->opt) {
    case EMB_OPT_SGD:
        return 0;
    case EMB_OPT_ADAGRAD:
        return cfg->dim;
    case EMB_OPT_ADAGRAD_ROWWISE:
        return 1;
    case EMB_OPT_ADAM:
    case EMB_OPT_FTRL:
        return 2 * cfg->dim;
    }
    return 0;
}

size_t emb_row_bytes(const emb_table_config *cfg)
{
    size_t b = EMB_REC_HDR + 4u * ((size_t)cfg->dim + emb_row_slots(cfg));
    return (b + 7u) & ~(size_t)7u;
}

double emb_row_mem_bytes(const emb_table_config *cfg)
{
    /* One ctrl byte beside each record, and 1/load of the slots are ever full. */
    return (double)(emb_row_bytes(cfg) + 1) * EMB_LOAD_DEN / EMB_LOAD_NUM;
}

static bool finite_nonneg(float x)
{
    return isfinite(x) && x >= 0.0f;
}

int emb_table_config_check(const emb_table_config *cfg, char **errptr)
{
    if (cfg->dim == 0 || cfg->dim > EMB_MAX_DIM)
        return cm_err(errptr, CM_EINVAL, "table dim %u out of range 1..%u", cfg->dim, EMB_MAX_DIM);
    if ((unsigned)cfg->opt >= N_OPTS)
        return cm_err(errptr, CM_EINVAL, "unknown optimizer %d", (int)cfg->opt);
    if (!finite_nonneg(cfg->lr) || (cfg->opt == EMB_OPT_FTRL && cfg->lr == 0.0f))
        return cm_err(errptr, CM_EINVAL, "learning rate %g must be finite and >= 0 (> 0 for ftrl)",
                      (double)cfg->lr);
    if (!finite_nonneg(cfg->l2))
        return cm_err(errptr, CM_EINVAL, "l2 %g must be >= 0", (double)cfg->l2);
    if (!(isfinite(cfg->eps) && cfg->eps > 0.0f) &&
        (cfg->opt == EMB_OPT_ADAGRAD || cfg->opt == EMB_OPT_ADAGRAD_ROWWISE ||
         cfg->opt == EMB_OPT_ADAM))
        return cm_err(errptr, CM_EINVAL, "eps %g must be > 0", (double)cfg->eps);
    if (!(cfg->beta1 >= 0.0f && cfg->beta1 < 1.0f && cfg->beta2 >= 0.0f && cfg->beta2 < 1.0f))
        return cm_err(errptr, CM_EINVAL, "adam betas (%g, %g) must be in [0, 1)",
                      (double)cfg->beta1, (double)cfg->beta2);
    if (!finite_nonneg(cfg->adagrad_init) || !finite_nonneg(cfg->ftrl_beta) ||
        !finite_nonneg(cfg->ftrl_l1))
        return cm_err(errptr, CM_EINVAL,
                      "adagrad_init, ftrl_beta and ftrl_l1 must be finite and >= 0");
    if (!finite_nonneg(cfg->init_scale))
        return cm_err(errptr, CM_EINVAL, "init_scale %g must be finite and >= 0",
                      (double)cfg->init_scale);
    /* The admission sketch's counters (uint16_t, table.c) saturate at 65535: a key's estimate
     * never reaches a larger threshold, and the table would admit no key, ever. */
    if (cfg->admit_threshold > UINT16_MAX)
        return cm_err(errptr, CM_EINVAL,
                      "admit %u above 65535, where the admission counters stop: no key would "
                      "ever be admitted",
                      cfg->admit_threshold);
    if (cfg->n_sub > 4096) return cm_err(errptr, CM_EINVAL, "n_sub %u > 4096", cfg->n_sub);
    if (cfg->mem_budget_bytes > 0) {
        if (cfg->spill_path == NULL || cfg->spill_path[0] == '\0')
            return cm_err(errptr, CM_EINVAL, "a memory budget needs a spill_path for cold rows");
        uint32_t n_sub = cfg->n_sub ? cfg->n_sub : EMB_DEFAULT_SUBS;
        uint64_t per_sub = cfg->mem_budget_bytes / n_sub;
        if (per_sub / (emb_row_bytes(cfg) + 1) < 2)
            return cm_err(errptr, CM_EINVAL,
                          "memory budget %llu bytes is too small: each of %u sub-shards needs room "
                          "for at least one row (%.0f bytes)",
                          (unsigned long long)cfg->mem_budget_bytes, n_sub,
                          2.0 * (double)(emb_row_bytes(cfg) + 1));
    }
    /* The reservation is allocated at creation. One beyond what a process can map (2^48 bytes,
     * x86-64's and arm64's address space with 4-level page tables) is a typo, and its slots
     * times the record size could wrap around 2^64 to a small block that creation then wrote
     * past (reserve_rows 19205585507227566 of dim 4096 adam: 33713 bytes). */
    const double max_bytes = 281474976710656.0;
    /* (No byte count in the message: emb_table_initial_bytes saturates at 2^64.) */
    if ((double)emb_table_initial_bytes(cfg) > max_bytes)
        return cm_err(errptr, CM_EINVAL,
                      "reserve_rows %llu needs more memory at creation than a process can map "
                      "(%.3g bytes)",
                      (unsigned long long)cfg->reserve_rows, max_bytes);
    return CM_OK;
}

static inline uint64_t splitmix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

void emb_opt_init_row(const emb_table_config *cfg, uint8_t *rec, uint64_t key)
{
    uint32_t dim = cfg->dim;
    float *w = emb_rec_weights(rec), *s = w + dim;
    uint64_t h = XXH3_64bits_withSeed(&key, sizeof key, cfg->seed);
    for (uint32_t j = 0; j < dim; j++) {
        /* 24 random bits give a float in [0, 1) exactly. */
        float u = (float)(splitmix64(h + j) >> 40) * (1.0f / 16777216.0f);
        w[j] = (2.0f * u - 1.0f) * cfg->init_scale;
    }
    switch (cfg->opt) {
    case EMB_OPT_SGD:
        break;
    case EMB_OPT_ADAGRAD:
        for (uint32_t j = 0; j < dim; j++)
            s[j] = cfg->adagrad_init;
        break;
    case EMB_OPT_ADAGRAD_ROWWISE:
        s[0] = cfg->adagrad_init;
        break;
    case EMB_OPT_ADAM:
        memset(s, 0, 2u * dim * sizeof(float));
        break;
    case EMB_OPT_FTRL: {
        /* With n = 0 the FTRL closed form gives back w exactly when z is set like this. */
        double d = (double)cfg->ftrl_beta / cfg->lr + cfg->l2;
        for (uint32_t j = 0; j < dim; j++) {
            double wj = w[j], sg = (wj > 0) - (wj < 0);
            s[j] = (float)(-wj * d - sg * cfg->ftrl_l1);
            s[dim + j] = 0.0f;
        }
        break;
    }
    }
}

/*
 * Adagrad over a row, in double. Built twice, the AVX2 copy chosen at load time where the CPU
 * has it: the loop is bound by double sqrt and division, which AVX2 does four at a time (SSE2
 * two). It vectorizes because the build does not let sqrt() set errno (-fno-math-errno), and
 * AVX2 alone brings no FMA, so nothing is contracted and every coordinate rounds the same in
 * both copies (and as the SSE2 intrinsics this replaced).
 */
CM_CLONES_AVX2 static void adagrad_row(float *restrict w, float *restrict s,
                                       const float *restrict g, uint32_t dim, double lr, double l2,
                                       double eps)
{
    for (uint32_t j = 0; j < dim; j++) {
        double gj = g[j] + l2 * w[j], a = s[j] + gj * gj;
        s[j] = (float)a;
        w[j] = (float)(w[j] - lr * gj / (sqrt(a) + eps));
    }
}

void emb_opt_apply(const emb_table_config *cfg, uint8_t *rec, const float *g)
{
    emb_rec_hdr *hdr = (emb_rec_hdr *)rec;
    uint32_t dim = cfg->dim;
    float *w = emb_rec_weights(rec), *s = w + dim;
    const double lr = cfg->lr, l2 = cfg->l2, eps = cfg->eps;
    switch (cfg->opt) {
    case EMB_OPT_SGD:
        for (uint32_t j = 0; j < dim; j++)
            w[j] = (float)(w[j] - lr * (g[j] + l2 * w[j]));
        break;
    case EMB_OPT_ADAGRAD:
        adagrad_row(w, s, g, dim, lr, l2, eps);
        break;
    case EMB_OPT_ADAGRAD_ROWWISE: {
        double sum = 0;
        for (uint32_t j = 0; j < dim; j++) {
            double gj = g[j] + l2 * w[j];
            sum += gj * gj;
        }
        double a = s[0] + sum / dim, scale = lr / (sqrt(a) + eps);
        s[0] = (float)a;
        for (uint32_t j = 0; j < dim; j++)
            w[j] = (float)(w[j] - scale * (g[j] + l2 * w[j]));
        break;
    }
    case EMB_OPT_ADAM: {
        double b1 = cfg->beta1, b2 = cfg->beta2, t = (double)(hdr->updates + 1);
        double bc1 = 1.0 - pow(b1, t), bc2 = 1.0 - pow(b2, t);
        float *m = s, *v = s + dim;
        for (uint32_t j = 0; j < dim; j++) {
            double gj = g[j] + l2 * w[j];
            double mj = b1 * m[j] + (1.0 - b1) * gj, vj = b2 * v[j] + (1.0 - b2) * gj * gj;
            m[j] = (float)mj;
            v[j] = (float)vj;
            w[j] = (float)(w[j] - lr * (mj / bc1) / (sqrt(vj / bc2) + eps));
        }
        break;
    }
    case EMB_OPT_FTRL: {
        double alpha = lr, beta = cfg->ftrl_beta, l1 = cfg->ftrl_l1;
        float *z = s, *nn = s + dim;
        for (uint32_t j = 0; j < dim; j++) {
            double gj = g[j], n0 = nn[j], n1 = n0 + gj * gj;
            double sigma = (sqrt(n1) - sqrt(n0)) / alpha;
            double zj = z[j] + gj - sigma * w[j];
            z[j] = (float)zj;
            nn[j] = (float)n1;
            double sg = (zj > 0) - (zj < 0);
            w[j] =
                fabs(zj) <= l1 ? 0.0f : (float)(-(zj - sg * l1) / ((beta + sqrt(n1)) / alpha + l2));
        }
        break;
    }
    }
    hdr->updates++;
}
