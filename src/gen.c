#include "src/gen.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"

/* Alias-table values per field; beyond them an analytic tail. Bigger heads mean fewer pow()
 * calls but tables that fall out of L2; these were the fastest in a sweep. */
#ifndef GEN_HEAD_MAX_CAT
#define GEN_HEAD_MAX_CAT 4096u
#endif
#ifndef GEN_HEAD_MAX_INT
#define GEN_HEAD_MAX_INT 4096u
#endif
/* Rows a worker formats at a time. Overridable so the ring test can wrap its slots hundreds
 * of times in a second; the output bytes do not depend on it. */
#ifndef GEN_CHUNK_ROWS
#define GEN_CHUNK_ROWS 8192u
#endif
#define GEN_STAGE_BYTES (4u << 20) /* direct-I/O stage per output file */
#define GEN_CAL_ROWS 32768u     /* rows of the bias-calibration stream */
#define GEN_INT_CAP 100000000.0 /* integer tails stop here (Criteo's largest are ~2e7) */
#define GEN_ID_MISSING 0xffffffffu /* id whose hashed weight is the weight of "missing" */
#define GEN_GOLDEN 0x9e3779b97f4a7c15ULL
/* Overall gains of the three logit parts, tuned (with the per-field scales below) so the truth
 * AUC is ~0.80 and the pairwise part is about as large as the first-order part. */
#define GEN_FIRST_GAIN 0.70f
#define GEN_PAIR_GAIN 0.70f
#define GEN_DENSE_GAIN 0.70f

/* ---- hashing and random numbers ------------------------------------------------------- */

/* splitmix64 finalizer: a strong 64-bit mixer, used both to key hashes and as the PRNG. */
static inline uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* splitmix64: one add and one mix a number; plenty for sampling, and cheap to seed per row. */
static inline uint64_t rng_next(uint64_t *s)
{
    *s += GEN_GOLDEN;
    return mix64(*s);
}

/* Uniform double in [0, 1) from the top 53 bits. */
static inline double rng_unit(uint64_t *s)
{
    return (double)(rng_next(s) >> 11) * 0x1.0p-53;
}

/* A keyed bijection on 32 bits (every step is invertible), so distinct ids of a field get
 * distinct, random-looking tokens without a table. */
static inline uint32_t token32(uint32_t x, uint64_t key)
{
    x ^= (uint32_t)key;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x += (uint32_t)(key >> 32);
    x *= 0x846ca68bu;
    x ^= x >> 16;
    x *= 0x2c1b3c6du;
    x ^= x >> 13;
    return x;
}

/* An approximately standard-normal value from 64 hash bits: the sum of four 16-bit uniforms
 * (Irwin-Hall), centred and scaled. Bounded at +-3.46, which keeps planted weights sane. */
static inline float hash_normal(uint64_t h)
{
    uint32_t s = (uint32_t)(h & 0xffff) + (uint32_t)((h >> 16) & 0xffff) +
                 (uint32_t)((h >> 32) & 0xffff) + (uint32_t)(h >> 48);
    return ((float)s - 2.0f * 65535.0f) * (1.7320508f / 65536.0f);
}

/* ---- sampling distributions: alias head + power-law tail -------------------------------- */

typedef struct gen_dist {
    uint32_t nb;      /* buckets: head values, plus one tail bucket when has_tail */
    uint32_t head;    /* values 0..head-1 come from the table */
    int has_tail;
    int lognormal_tail; /* 0: power-law tail (categoricals); 1: log-normal tail (integers) */
    /* coin < tab[b].thresh keeps bucket b, else tab[b].alias; interleaved so a draw touches
     * one cache line (the tables of the big fields outgrow L2, so this matters). */
    struct {
        uint32_t thresh, alias;
    } *tab;
    /* Tail: a continuous density x^-s on ranks [lo, hi), x = rank, value = round(x) - 1.
     * Inverse CDF: x = (a + u * (b - a))^inv with a = lo^(1-s), b = hi^(1-s), inv = 1/(1-s). */
    double ta, tb, tinv;
    /* Log-normal tail: log(value + 1) ~ N(mu, sigma) conditioned on exceeding the head;
     * tq = P(exceeding). Sampled by inverting the normal CDF, so the integer fields keep the
     * log-normal shape even where the head is cut near the median (Criteo's I5). */
    double mu, sigma, tq;
    uint32_t tmax; /* largest tail value */
} gen_dist;

/* Builds the alias table for weights w[0..nb-1] (any positive scale); Vose's method. */
static int dist_build(gen_dist *d, const double *w, uint32_t nb)
{
    d->nb = nb;
    d->tab = malloc(nb * sizeof *d->tab);
    double *q = malloc(nb * sizeof *q);
    uint32_t *small = malloc(nb * sizeof *small), *large = malloc(nb * sizeof *large);
    int rc = CM_ENOMEM;
    if (!d->tab || !q || !small || !large) goto out;
    double sum = 0;
    for (uint32_t i = 0; i < nb; i++) sum += w[i];
    uint32_t ns = 0, nl = 0;
    for (uint32_t i = 0; i < nb; i++) {
        q[i] = w[i] * nb / sum;
        if (q[i] < 1.0)
            small[ns++] = i;
        else
            large[nl++] = i;
    }
    while (ns > 0 && nl > 0) {
        uint32_t s = small[--ns], l = large[nl - 1];
        d->tab[s].thresh = (uint32_t)(q[s] * 4294967296.0);
        d->tab[s].alias = l;
        q[l] = q[l] + q[s] - 1.0;
        if (q[l] < 1.0) {
            nl--;
            small[ns++] = l;
        }
    }
    /* Leftovers are full buckets (up to rounding): always keep. */
    while (nl > 0) {
        uint32_t l = large[--nl];
        d->tab[l].thresh = UINT32_MAX;
        d->tab[l].alias = l;
    }
    while (ns > 0) {
        uint32_t s = small[--ns];
        d->tab[s].thresh = UINT32_MAX;
        d->tab[s].alias = s;
    }
    rc = CM_OK;
out:
    free(q);
    free(small);
    free(large);
    return rc;
}

static void dist_free(gen_dist *d)
{
    free(d->tab);
}

static void dist_set_tail(gen_dist *d, double s, double lo, double hi, uint32_t tmax)
{
    d->ta = pow(lo, 1.0 - s);
    d->tb = pow(hi, 1.0 - s);
    d->tinv = 1.0 / (1.0 - s);
    d->tmax = tmax;
}

/* The z with P(Z > z) = q for a standard normal Z, 0 < q < 1 (Acklam's rational
 * approximation, relative error < 1.2e-9). Takes the upper-tail mass so that tiny tails keep
 * their precision. */
static double norm_upper_quantile(double q)
{
    static const double a[6] = {-3.969683028665376e+01, 2.209460984245205e+02,
                                -2.759285104469687e+02, 1.383577518672690e+02,
                                -3.066479806614716e+01, 2.506628277459239e+00};
    static const double b[5] = {-5.447609879822406e+01, 1.615858368580409e+02,
                                -1.556989798598866e+02, 6.680131188771972e+01,
                                -1.328068155288572e+01};
    static const double c[6] = {-7.784894002430293e-03, -3.223964580411365e-01,
                                -2.400758277161838e+00, -2.549732539343734e+00,
                                4.374664141464968e+00, 2.938163982698783e+00};
    static const double d[4] = {7.784695709041462e-03, 3.224671290700398e-01,
                                2.445134137142996e+00, 3.754408661907416e+00};
    const double plow = 0.02425;
    double p = 1.0 - q; /* the lower-tail probability */
    if (q < plow) {
        double t = sqrt(-2.0 * log(q));
        return -(((((c[0] * t + c[1]) * t + c[2]) * t + c[3]) * t + c[4]) * t + c[5]) /
               ((((d[0] * t + d[1]) * t + d[2]) * t + d[3]) * t + 1.0);
    }
    if (p < plow) {
        double t = sqrt(-2.0 * log(p));
        return (((((c[0] * t + c[1]) * t + c[2]) * t + c[3]) * t + c[4]) * t + c[5]) /
               ((((d[0] * t + d[1]) * t + d[2]) * t + d[3]) * t + 1.0);
    }
    double t = p - 0.5, r = t * t;
    return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * t /
           (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1.0);
}

static inline uint32_t dist_sample(const gen_dist *d, uint64_t *rng)
{
    uint64_t r = rng_next(rng);
    uint32_t b = (uint32_t)(((r >> 32) * d->nb) >> 32);
    /* Select with a mask, not a branch: the coin is unpredictable, and the alias sits in the
     * same cache line as the threshold. */
    uint32_t keep = 0u - (uint32_t)((uint32_t)r < d->tab[b].thresh);
    uint32_t v = (b & keep) | (d->tab[b].alias & ~keep);
    if (v < d->head) return v;
    /* Tail: rare by construction (the head holds the likeliest values). */
    double x;
    if (d->lognormal_tail) {
        /* 1 - unit is in (0, 1], so q is in (0, tq]: never 0, never an infinite z. */
        double q = d->tq * (1.0 - rng_unit(rng));
        x = exp(d->mu + d->sigma * norm_upper_quantile(q));
    } else {
        x = pow(d->ta + rng_unit(rng) * (d->tb - d->ta), d->tinv);
    }
    double val = floor(x + 0.5) - 1.0;
    if (val < d->head) return d->head;
    if (val > d->tmax) return d->tmax;
    return (uint32_t)val;
}

/* ---- field specifications ------------------------------------------------------------- */

/* Categorical fields: Criteo Kaggle cardinalities, a Zipf exponent, a missing rate (or a
 * missing group: Criteo's C19/C20/C25/C26 and its big-id fields go missing together), and the
 * scale of the planted first-order weights. */
typedef struct {
    uint32_t card;
    double zipf_s;
    double miss;
    int group; /* 0: independent; 1, 2: shares the row's group-missing draw */
    float w_scale;
} cat_spec;

static const double group_miss[3] = {0, 0.034, 0.44};

static const cat_spec cat_specs[GEN_NUM_CAT] = {
    {1460, 1.20, 0, 0, 0.30},     /* C1 */
    {583, 1.10, 0, 0, 0.30},      /* C2 */
    {10131227, 1.05, 0, 1, 0.20}, /* C3 */
    {2202608, 1.05, 0, 1, 0.20},  /* C4 */
    {305, 1.30, 0, 0, 0.25},      /* C5 */
    {24, 1.50, 0.12, 0, 0.25},    /* C6 */
    {12517, 1.10, 0, 0, 0.25},    /* C7 */
    {633, 1.30, 0, 0, 0.20},      /* C8 */
    {3, 1.50, 0, 0, 0.20},        /* C9 */
    {93145, 1.10, 0, 0, 0.25},    /* C10 */
    {5683, 1.10, 0, 0, 0.25},     /* C11 */
    {8351593, 1.05, 0, 1, 0.20},  /* C12 */
    {3194, 1.10, 0, 0, 0.20},     /* C13 */
    {27, 1.40, 0, 0, 0.30},       /* C14 */
    {14992, 1.10, 0, 0, 0.20},    /* C15 */
    {5461306, 1.05, 0, 1, 0.20},  /* C16 */
    {10, 1.20, 0, 0, 0.25},       /* C17 */
    {5652, 1.10, 0, 0, 0.20},     /* C18 */
    {2173, 1.20, 0, 2, 0.20},     /* C19 */
    {4, 1.01, 0, 2, 0.20},        /* C20 */
    {7046547, 1.05, 0, 1, 0.20},  /* C21 */
    {18, 1.50, 0.76, 0, 0.20},    /* C22 */
    {15, 1.20, 0, 0, 0.25},       /* C23 */
    {286181, 1.10, 0, 1, 0.20},   /* C24 */
    {105, 1.30, 0, 2, 0.20},      /* C25 */
    {142572, 1.10, 0, 2, 0.25},   /* C26 */
};

/* Integer fields: log(value + 1) is normal(mu, sigma) (fitted to the quantiles of Criteo's
 * first 2000 rows), discretised, with a power-law tail beyond the alias head; a missing rate;
 * and a rate of -1 (Criteo's I2). */
typedef struct {
    double mu, sigma, miss, neg;
} int_spec;

static const int_spec int_specs[GEN_NUM_INT] = {
    {0.69, 1.17, 0.45, 0},    /* I1 */
    {1.80, 2.40, 0, 0.11},    /* I2 */
    {1.95, 1.56, 0.21, 0},    /* I3 */
    {1.61, 1.16, 0.22, 0},    /* I4 */
    {7.96, 1.87, 0.026, 0},   /* I5 */
    {3.78, 1.62, 0.22, 0},    /* I6 */
    {1.39, 1.57, 0.04, 0},    /* I7 */
    {2.20, 1.08, 0.0005, 0},  /* I8 */
    {3.78, 1.56, 0.04, 0},    /* I9 */
    {0.00, 0.60, 0.45, 0},    /* I10 */
    {0.69, 0.86, 0.04, 0},    /* I11 */
    {0.00, 1.00, 0.76, 0},    /* I12 */
    {1.79, 1.23, 0.22, 0},    /* I13 */
};

/* Latent interaction pairs (0-based categorical fields) and their strengths. Chosen among
 * small and medium vocabularies so that a factorised model sees each id often enough to learn
 * its vector; the last pair involves a 93K-id field and is harder. */
static const struct {
    int a, b;
    float lambda;
} pair_specs[GEN_NUM_PAIRS] = {
    {0, 5, 0.60},   /* C1 x C6 */
    {1, 13, 0.60},  /* C2 x C14 */
    {4, 7, 0.55},   /* C5 x C8 */
    {6, 16, 0.55},  /* C7 x C17 */
    {10, 22, 0.55}, /* C11 x C23 */
    {12, 24, 0.50}, /* C13 x C25 */
    {9, 8, 0.50},   /* C10 x C9 */
};

#define DENSE_PROD_A 5 /* I6 */
#define DENSE_PROD_B 8 /* I9 */

struct gen_model {
    uint64_t seed;
    uint64_t row_key, cal_key;
    uint64_t tok_key[GEN_NUM_CAT], w_key[GEN_NUM_CAT], lat_key[GEN_NUM_CAT];
    uint32_t cat_miss[GEN_NUM_CAT]; /* P(missing) * 2^32 */
    uint32_t group_miss[3];
    uint32_t int_miss[GEN_NUM_INT], int_neg[GEN_NUM_INT];
    uint32_t in_pair_mask; /* categorical fields whose latent vector is needed */
    gen_dist cat[GEN_NUM_CAT];
    gen_dist ints[GEN_NUM_INT];
    float phase[GEN_NUM_INT];
    float dense_missing[GEN_NUM_INT];
    /* dense_tab[j][v + 1] = dense term of field j at value v, for v in [-1, head); the
     * product factors likewise. Tail values are computed directly. */
    float *dense_tab[GEN_NUM_INT];
    float *prod_tab[2];
    double bias;
};

/* ---- model construction --------------------------------------------------------------- */

static uint32_t prob32(double p)
{
    if (p <= 0) return 0;
    if (p >= 1) return UINT32_MAX;
    return (uint32_t)(p * 4294967296.0);
}

static double norm_cdf(double z)
{
    return 0.5 * erfc(-z / sqrt(2.0));
}

/* The additive nonlinear dense term of field j at value v (v >= -1). Why these shapes: sines
 * and steps on log1p(v) are easy for an MLP and impossible for a linear model on the raw or
 * log value, and their amplitudes keep the dense share of the signal modest like Criteo's. */
static float dense_term(const gen_model *m, int j, int32_t v)
{
    double y = log1p(v > 0 ? (double)v : 0.0), ph = m->phase[j];
    switch (j) {
    case 0: return (float)(0.50 * sin(2.0 * y + ph));
    case 1: return v < 0 ? 0.40f : (float)(0.25 * sin(1.1 * y + ph));
    case 2: return y > 2.3 ? 0.35f : -0.15f;
    case 3: return (float)(0.30 * sin(1.7 * y + ph));
    case 4: return (float)(0.45 * sin(1.0 * y + ph));
    case 6: return (float)(-0.25 * (y - 1.4));
    case 7: return (y > 1.5 && y < 3.0) ? 0.30f : -0.10f;
    case 9: return v > 0 ? 0.30f : 0.0f;
    case 10: return (float)(0.35 * cos(2.2 * y + ph));
    case 11: return (float)(0.20 * sin(1.5 * y + ph));
    case 12: return (float)(0.30 * sin(1.3 * y + ph));
    default: return 0.0f; /* I6 and I9 act through their product */
    }
}

/* One factor of the I6 x I9 product: centred near the fields' medians so it changes sign. */
static float prod_factor(int32_t v)
{
    return (float)tanh(log1p(v > 0 ? (double)v : 0.0) - 3.8);
}

static int build_cat(gen_model *m, int f)
{
    const cat_spec *c = &cat_specs[f];
    gen_dist *d = &m->cat[f];
    uint32_t head = c->card <= GEN_HEAD_MAX_CAT ? c->card : GEN_HEAD_MAX_CAT;
    d->head = head;
    d->has_tail = c->card > head;
    d->nb = head + (uint32_t)d->has_tail;
    double *w = malloc(d->nb * sizeof *w);
    if (w == NULL) return CM_ENOMEM;
    for (uint32_t k = 0; k < head; k++) w[k] = pow(k + 1.0, -c->zipf_s);
    if (d->has_tail) {
        /* Mass of ranks head+1..card under the continuous approximation the tail samples. */
        double s = c->zipf_s, lo = head + 0.5, hi = c->card + 0.5;
        w[head] = (pow(hi, 1 - s) - pow(lo, 1 - s)) / (1 - s);
        dist_set_tail(d, s, lo, hi, c->card - 1);
    }
    int rc = dist_build(d, w, d->nb);
    free(w);
    return rc;
}

static int build_int(gen_model *m, int j)
{
    const int_spec *is = &int_specs[j];
    gen_dist *d = &m->ints[j];
    /* Head: values until the remaining mass is negligible, or GEN_HEAD_MAX_INT of them. */
    uint32_t head = 1;
    while (head < GEN_HEAD_MAX_INT &&
           1.0 - norm_cdf((log(head + 0.5) - is->mu) / is->sigma) > 1e-9)
        head++;
    double tail = 1.0 - norm_cdf((log(head + 0.5) - is->mu) / is->sigma);
    d->head = head;
    d->has_tail = tail > 1e-9;
    d->nb = head + (uint32_t)d->has_tail;
    double *w = malloc(d->nb * sizeof *w);
    if (w == NULL) return CM_ENOMEM;
    double prev = 0;
    for (uint32_t v = 0; v < head; v++) {
        double cdf = norm_cdf((log(v + 1.5) - is->mu) / is->sigma);
        w[v] = cdf - prev;
        if (w[v] < 1e-300) w[v] = 1e-300;
        prev = cdf;
    }
    if (d->has_tail) {
        w[head] = tail;
        d->lognormal_tail = 1;
        d->mu = is->mu;
        d->sigma = is->sigma;
        d->tq = tail;
        d->tmax = (uint32_t)GEN_INT_CAP;
    }
    int rc = dist_build(d, w, d->nb);
    free(w);
    return rc;
}

/* The logit without bias and the sampled fields of row `row` of the stream keyed by key. */
static void make_row(const gen_model *m, uint64_t key, uint64_t row, gen_row *r)
{
    uint64_t rng = mix64(key ^ mix64(row + 1));
    uint32_t gmiss = 0;
    for (int g = 1; g < 3; g++)
        if ((uint32_t)rng_next(&rng) < m->group_miss[g]) gmiss |= 1u << g;

    float dense = 0;
    float prod[2] = {0, 0};
    for (int j = 0; j < GEN_NUM_INT; j++) {
        uint64_t u = rng_next(&rng);
        r->int_present[j] = (uint32_t)u >= m->int_miss[j];
        if (!r->int_present[j]) {
            r->ints[j] = 0;
            dense += m->dense_missing[j];
            continue;
        }
        int32_t v;
        if ((uint32_t)(u >> 32) < m->int_neg[j])
            v = -1;
        else
            v = (int32_t)dist_sample(&m->ints[j], &rng);
        r->ints[j] = v;
        const gen_dist *d = &m->ints[j];
        int in_tab = v < (int32_t)d->head;
        dense += in_tab ? m->dense_tab[j][v + 1] : dense_term(m, j, v);
        if (j == DENSE_PROD_A) prod[0] = in_tab ? m->prod_tab[0][v + 1] : prod_factor(v);
        if (j == DENSE_PROD_B) prod[1] = in_tab ? m->prod_tab[1][v + 1] : prod_factor(v);
    }
    dense += 0.6f * prod[0] * prod[1];

    float first = 0;
    float lat[GEN_NUM_CAT][4];
    for (int f = 0; f < GEN_NUM_CAT; f++) {
        int g = cat_specs[f].group;
        int present;
        if (g)
            present = !(gmiss & (1u << g));
        else /* no draw for never-missing fields: most of them, and the draw is not free */
            present = m->cat_miss[f] == 0 || (uint32_t)rng_next(&rng) >= m->cat_miss[f];
        uint32_t id = present ? dist_sample(&m->cat[f], &rng) : GEN_ID_MISSING;
        r->cat_present[f] = (uint8_t)present;
        r->cat_id[f] = present ? id : 0;
        r->cat_token[f] = present ? token32(id, m->tok_key[f]) : 0;
        uint64_t wid = (uint64_t)id * GEN_GOLDEN;
        first += cat_specs[f].w_scale * hash_normal(mix64(m->w_key[f] ^ wid));
        if (m->in_pair_mask & (1u << f)) {
            if (present) {
                uint64_t h = mix64(m->lat_key[f] ^ wid);
                for (int k = 0; k < 4; k++)
                    lat[f][k] = ((float)((h >> (16 * k)) & 0xffff) - 32767.5f) *
                                (1.7320508f / 32768.0f);
            } else {
                memset(lat[f], 0, sizeof lat[f]); /* a missing id interacts with nothing */
            }
        }
    }
    float pair = 0;
    for (int p = 0; p < GEN_NUM_PAIRS; p++) {
        const float *a = lat[pair_specs[p].a], *b = lat[pair_specs[p].b];
        pair += pair_specs[p].lambda * 0.5f * (a[0] * b[0] + a[1] * b[1] + a[2] * b[2] + a[3] * b[3]);
    }
    r->logit_first = first * GEN_FIRST_GAIN;
    r->logit_pair = pair * GEN_PAIR_GAIN;
    r->logit_dense = dense * GEN_DENSE_GAIN;
    /* The label's uniform comes last so it never shifts the field draws. */
    double logit = m->bias + r->logit_first + r->logit_pair + r->logit_dense;
    double p = 1.0 / (1.0 + exp(-logit));
    r->prob = (float)p;
    r->label = rng_unit(&rng) < p;
}

/* Chooses the bias so the mean probability over a calibration stream is GEN_TARGET_CTR. */
static int calibrate(gen_model *m)
{
    float *lg = malloc(GEN_CAL_ROWS * sizeof *lg);
    if (lg == NULL) return CM_ENOMEM;
    gen_row r;
    m->bias = 0;
    for (uint32_t i = 0; i < GEN_CAL_ROWS; i++) {
        make_row(m, m->cal_key, i, &r);
        lg[i] = r.logit_first + r.logit_pair + r.logit_dense;
    }
    double lo = -20, hi = 20;
    for (int it = 0; it < 50; it++) {
        double mid = 0.5 * (lo + hi), sum = 0;
        for (uint32_t i = 0; i < GEN_CAL_ROWS; i++) sum += 1.0 / (1.0 + exp(-(lg[i] + mid)));
        if (sum / GEN_CAL_ROWS < GEN_TARGET_CTR)
            lo = mid;
        else
            hi = mid;
    }
    m->bias = 0.5 * (lo + hi);
    free(lg);
    return CM_OK;
}

int gen_model_create(uint64_t seed, gen_model **out, char **errptr)
{
    *out = NULL;
    gen_model *m = calloc(1, sizeof *m);
    if (m == NULL) return cm_err(errptr, CM_ENOMEM, "gen: out of memory");
    m->seed = seed;
    uint64_t k = mix64(seed ^ 0x656d626572ULL); /* "ember": keys differ from raw seeds */
    m->row_key = mix64(k + 1);
    m->cal_key = mix64(k + 2);
    for (int f = 0; f < GEN_NUM_CAT; f++) {
        m->tok_key[f] = mix64(k + 100 + (uint64_t)f);
        m->w_key[f] = mix64(k + 200 + (uint64_t)f);
        m->lat_key[f] = mix64(k + 300 + (uint64_t)f);
        m->cat_miss[f] = prob32(cat_specs[f].miss);
    }
    for (int g = 0; g < 3; g++) m->group_miss[g] = prob32(group_miss[g]);
    for (int p = 0; p < GEN_NUM_PAIRS; p++)
        m->in_pair_mask |= (1u << pair_specs[p].a) | (1u << pair_specs[p].b);
    for (int j = 0; j < GEN_NUM_INT; j++) {
        m->int_miss[j] = prob32(int_specs[j].miss);
        m->int_neg[j] = prob32(int_specs[j].neg);
        uint64_t h = mix64(k + 400 + (uint64_t)j);
        m->phase[j] = (float)((double)(h >> 11) * 0x1.0p-53 * 6.283185307179586);
        m->dense_missing[j] = 0.15f * hash_normal(mix64(h));
    }
    int rc = CM_OK;
    for (int f = 0; f < GEN_NUM_CAT && rc == CM_OK; f++) rc = build_cat(m, f);
    for (int j = 0; j < GEN_NUM_INT && rc == CM_OK; j++) rc = build_int(m, j);
    for (int j = 0; j < GEN_NUM_INT && rc == CM_OK; j++) {
        uint32_t n = m->ints[j].head + 1;
        m->dense_tab[j] = malloc(n * sizeof(float));
        if (m->dense_tab[j] == NULL) {
            rc = CM_ENOMEM;
            break;
        }
        for (uint32_t i = 0; i < n; i++) m->dense_tab[j][i] = dense_term(m, j, (int32_t)i - 1);
        if (j == DENSE_PROD_A || j == DENSE_PROD_B) {
            float *t = malloc(n * sizeof(float));
            if (t == NULL) {
                rc = CM_ENOMEM;
                break;
            }
            for (uint32_t i = 0; i < n; i++) t[i] = prod_factor((int32_t)i - 1);
            m->prod_tab[j == DENSE_PROD_A ? 0 : 1] = t;
        }
    }
    if (rc == CM_OK) rc = calibrate(m);
    if (rc != CM_OK) {
        gen_model_free(m);
        return cm_err(errptr, rc, "gen: out of memory building the model");
    }
    *out = m;
    return CM_OK;
}

void gen_model_free(gen_model *m)
{
    if (m == NULL) return;
    for (int f = 0; f < GEN_NUM_CAT; f++) dist_free(&m->cat[f]);
    for (int j = 0; j < GEN_NUM_INT; j++) {
        dist_free(&m->ints[j]);
        free(m->dense_tab[j]);
    }
    free(m->prod_tab[0]);
    free(m->prod_tab[1]);
    free(m);
}

double gen_model_bias(const gen_model *m)
{
    return m->bias;
}

uint32_t gen_cat_cardinality(int f)
{
    return (f >= 0 && f < GEN_NUM_CAT) ? cat_specs[f].card : 0;
}

void gen_make_row(const gen_model *m, uint64_t row, gen_row *out)
{
    make_row(m, m->row_key, row, out);
}

/* ---- formatting ------------------------------------------------------------------------ */

static const char digit_pairs[201] = "00010203040506070809"
                                     "10111213141516171819"
                                     "20212223242526272829"
                                     "30313233343536373839"
                                     "40414243444546474849"
                                     "50515253545556575859"
                                     "60616263646566676869"
                                     "70717273747576777879"
                                     "80818283848586878889"
                                     "90919293949596979899";

/* "00".."ff": two hex digits a byte, so a token is four 2-byte copies. */
static const char hex_pairs[513] =
    "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
    "202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f"
    "404142434445464748494a4b4c4d4e4f505152535455565758595a5b5c5d5e5f"
    "606162636465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7f"
    "808182838485868788898a8b8c8d8e8f909192939495969798999a9b9c9d9e9f"
    "a0a1a2a3a4a5a6a7a8a9aaabacadaeafb0b1b2b3b4b5b6b7b8b9babbbcbdbebf"
    "c0c1c2c3c4c5c6c7c8c9cacbcccdcecfd0d1d2d3d4d5d6d7d8d9dadbdcdddedf"
    "e0e1e2e3e4e5e6e7e8e9eaebecedeeeff0f1f2f3f4f5f6f7f8f9fafbfcfdfeff";

/* Decimal of v >= -1 at p; returns the end. Two digits a step, from the right. */
static inline char *put_int(char *p, int32_t v)
{
    if (v < 0) {
        *p++ = '-';
        v = -v;
    }
    uint32_t u = (uint32_t)v;
    if (u < 10) {
        *p++ = (char)('0' + u);
        return p;
    }
    char tmp[12];
    char *e = tmp + sizeof tmp, *s = e;
    while (u >= 100) {
        uint32_t q = u / 100, rem = u - q * 100;
        s -= 2;
        memcpy(s, digit_pairs + 2 * rem, 2);
        u = q;
    }
    if (u >= 10) {
        s -= 2;
        memcpy(s, digit_pairs + 2 * u, 2);
    } else {
        *--s = (char)('0' + u);
    }
    size_t n = (size_t)(e - s);
    memcpy(p, s, n);
    return p + n;
}

static inline char *put_hex8(char *p, uint32_t x)
{
    memcpy(p, hex_pairs + 2 * (x >> 24), 2);
    memcpy(p + 2, hex_pairs + 2 * ((x >> 16) & 0xff), 2);
    memcpy(p + 4, hex_pairs + 2 * ((x >> 8) & 0xff), 2);
    memcpy(p + 6, hex_pairs + 2 * (x & 0xff), 2);
    return p + 8;
}

size_t gen_format_row(const gen_row *r, char *buf)
{
    char *p = buf;
    *p++ = r->label ? '1' : '0';
    for (int j = 0; j < GEN_NUM_INT; j++) {
        *p++ = '\t';
        if (r->int_present[j]) p = put_int(p, r->ints[j]);
    }
    for (int f = 0; f < GEN_NUM_CAT; f++) {
        *p++ = '\t';
        if (r->cat_present[f]) p = put_hex8(p, r->cat_token[f]);
    }
    *p++ = '\n';
    return (size_t)(p - buf);
}

size_t gen_format_prob(float p, char *buf)
{
    double q = (double)p * 1e6 + 0.5;
    uint32_t u = q <= 0 ? 0 : (q >= 1e6 ? 1000000u : (uint32_t)q);
    if (u >= 1000000u) {
        memcpy(buf, "1.000000\n", 9);
        return 9;
    }
    buf[0] = '0';
    buf[1] = '.';
    for (int i = 7; i >= 2; i--) {
        buf[i] = (char)('0' + u % 10);
        u /= 10;
    }
    buf[8] = '\n';
    return 9;
}

/* ---- parallel writer ------------------------------------------------------------------- */

/* Workers claim chunks in order and fill slot chunk % nslots; the calling thread writes the
 * slots in chunk order. nslots = 2 * threads keeps workers busy while one chunk is written. */
typedef struct {
    char *out, *truth;
    size_t out_len, truth_len;
    uint64_t clicks;
    int64_t chunk; /* -1: free */
    int ready;
} gen_slot;

typedef struct {
    const gen_model *m;
    const gen_opts *o;
    uint64_t nchunks, next, written; /* chunks handed out; chunks the writer has consumed */
    gen_slot *slots;
    uint32_t nslots;
    int stop;
    pthread_mutex_t mu;
    pthread_cond_t ready, freed;
} gen_job;

static void fill_chunk(const gen_model *m, const gen_opts *o, uint64_t c, gen_slot *s)
{
    uint64_t lo = c * GEN_CHUNK_ROWS, hi = lo + GEN_CHUNK_ROWS;
    if (hi > o->rows) hi = o->rows;
    char *op = s->out, *tp = s->truth;
    uint64_t clicks = 0;
    gen_row r;
    for (uint64_t i = lo; i < hi; i++) {
        gen_make_row(m, i, &r);
        clicks += r.label;
        op += gen_format_row(&r, op);
        if (tp) tp += gen_format_prob(r.prob, tp);
    }
    s->out_len = (size_t)(op - s->out);
    s->truth_len = tp ? (size_t)(tp - s->truth) : 0;
    s->clicks = clicks;
}

static void *gen_worker(void *arg)
{
    gen_job *j = arg;
    pthread_mutex_lock(&j->mu);
    for (;;) {
        if (j->stop || j->next >= j->nchunks) break;
        uint64_t c = j->next++;
        gen_slot *s = &j->slots[c % j->nslots];
        /* The slot is c's only once chunk c - nslots has been written: waiting for "free" alone
         * lets a later chunk sharing the slot claim it first, and the writer, waiting for c,
         * would wait forever. */
        while ((s->chunk != -1 || c >= j->written + j->nslots) && !j->stop)
            pthread_cond_wait(&j->freed, &j->mu);
        if (j->stop) break;
        s->chunk = (int64_t)c;
        pthread_mutex_unlock(&j->mu);
        fill_chunk(j->m, j->o, c, s);
        pthread_mutex_lock(&j->mu);
        s->ready = 1;
        pthread_cond_broadcast(&j->ready);
    }
    pthread_mutex_unlock(&j->mu);
    return NULL;
}

static int write_slot(cm_afile *out, cm_afile *truth, const gen_slot *s, char **errptr)
{
    int rc = cm_afile_write(out, s->out, s->out_len, errptr);
    if (rc == CM_OK && truth) rc = cm_afile_write(truth, s->truth, s->truth_len, errptr);
    return rc;
}

int gen_write(const gen_model *m, const gen_opts *o, gen_stats *stats, char **errptr)
{
    if (o->out_path == NULL || o->threads < 1)
        return cm_err(errptr, CM_EINVAL, "gen: need an output path and at least one thread");
    double t0 = cm_now();
    uint64_t nchunks = (o->rows + GEN_CHUNK_ROWS - 1) / GEN_CHUNK_ROWS;
    uint32_t threads = (uint32_t)o->threads;
    if (threads > nchunks) threads = nchunks ? (uint32_t)nchunks : 1;
    uint32_t nslots = threads == 1 ? 1 : 2 * threads;
    int rc = CM_OK;
    uint64_t clicks = 0, bytes = 0;
    cm_afile out, truth;
    int have_out = 0, have_truth = 0;
    gen_slot *slots = calloc(nslots, sizeof *slots);
    if (slots == NULL) return cm_err(errptr, CM_ENOMEM, "gen: out of memory");
    for (uint32_t i = 0; i < nslots; i++) {
        slots[i].chunk = -1;
        slots[i].out = malloc((size_t)GEN_CHUNK_ROWS * GEN_ROW_MAX);
        slots[i].truth = o->truth_path ? malloc((size_t)GEN_CHUNK_ROWS * GEN_PROB_MAX) : NULL;
        if (slots[i].out == NULL || (o->truth_path && slots[i].truth == NULL)) {
            rc = cm_err(errptr, CM_ENOMEM, "gen: out of memory for chunk buffers");
            goto out;
        }
    }
    /* Direct I/O: buffered writes cost ~1 s of system time per GB on a VM (cm_afile_open_direct
     * says why), which alone would hold one core under 1M rows/s. */
    if ((rc = cm_afile_open_direct(&out, o->out_path, GEN_STAGE_BYTES, errptr)) != CM_OK) goto out;
    have_out = 1;
    if (o->truth_path) {
        if ((rc = cm_afile_open_direct(&truth, o->truth_path, GEN_STAGE_BYTES, errptr)) != CM_OK)
            goto out;
        have_truth = 1;
    }
    cm_afile *tf = have_truth ? &truth : NULL;

    if (threads == 1) {
        /* No worker thread: one core really means one core, for honest single-core rates. */
        for (uint64_t c = 0; c < nchunks && rc == CM_OK; c++) {
            fill_chunk(m, o, c, &slots[0]);
            clicks += slots[0].clicks;
            bytes += slots[0].out_len;
            rc = write_slot(&out, tf, &slots[0], errptr);
        }
    } else {
        gen_job j = {.m = m, .o = o, .nchunks = nchunks, .slots = slots, .nslots = nslots};
        pthread_mutex_init(&j.mu, NULL);
        pthread_cond_init(&j.ready, NULL);
        pthread_cond_init(&j.freed, NULL);
        pthread_t *tids = calloc(threads, sizeof *tids);
        uint32_t started = 0;
        if (tids == NULL) rc = cm_err(errptr, CM_ENOMEM, "gen: out of memory");
        for (; rc == CM_OK && started < threads; started++)
            if (pthread_create(&tids[started], NULL, gen_worker, &j) != 0) {
                rc = cm_err(errptr, CM_ERR, "gen: cannot start worker thread");
                break;
            }
        /* A failed pthread_create stops the run (rc set) rather than going on degraded. */
        for (uint64_t c = 0; c < nchunks && rc == CM_OK; c++) {
            gen_slot *s = &slots[c % nslots];
            pthread_mutex_lock(&j.mu);
            while (!(s->chunk == (int64_t)c && s->ready)) pthread_cond_wait(&j.ready, &j.mu);
            pthread_mutex_unlock(&j.mu);
            clicks += s->clicks;
            bytes += s->out_len;
            rc = write_slot(&out, tf, s, errptr);
            pthread_mutex_lock(&j.mu);
            s->chunk = -1;
            s->ready = 0;
            j.written = c + 1;
            pthread_cond_broadcast(&j.freed);
            pthread_mutex_unlock(&j.mu);
        }
        pthread_mutex_lock(&j.mu);
        j.stop = 1;
        pthread_cond_broadcast(&j.freed);
        pthread_mutex_unlock(&j.mu);
        for (uint32_t i = 0; i < started; i++) pthread_join(tids[i], NULL);
        free(tids);
        pthread_mutex_destroy(&j.mu);
        pthread_cond_destroy(&j.ready);
        pthread_cond_destroy(&j.freed);
    }
    if (rc == CM_OK) {
        rc = cm_afile_commit(&out, errptr);
        have_out = 0;
    }
    if (rc == CM_OK && have_truth) {
        rc = cm_afile_commit(&truth, errptr);
        have_truth = 0;
    }
out:
    if (have_out) cm_afile_abort(&out);
    if (have_truth) cm_afile_abort(&truth);
    for (uint32_t i = 0; i < nslots; i++) {
        free(slots[i].out);
        free(slots[i].truth);
    }
    free(slots);
    if (rc == CM_OK && stats) {
        stats->bytes = bytes;
        stats->clicks = clicks;
        stats->seconds = cm_now() - t0;
    }
    return rc;
}
