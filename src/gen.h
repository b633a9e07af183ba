/*
 * gen: synthetic Criteo Display Advertising click logs with a planted, known click model.
 *
 * Output rows look like Criteo's train.txt: label \t I1..I13 \t C1..C26 \n, integers in
 * decimal (I2 may be -1), categoricals as 8 lowercase hex digits, an empty field for a missing
 * value. The marginals imitate Criteo: per-field cardinalities from 3 to ~10M (Criteo's own
 * counts), Zipf-like id frequencies, Criteo's per-field missing rates, log-normal integer
 * fields with heavy tails.
 *
 * Sampling. Every field draws from a gen_dist: an alias table (Vose) over the K most likely
 * values (K <= 4096) plus one "tail" bucket. A categorical tail draw inverts a continuous power
 * law over the remaining ranks (one pow()); an integer tail draw inverts the log-normal beyond
 * the head. The head table makes the common case one random number and one table load, and
 * the analytic tail means a 10M-id vocabulary costs no more memory than a 4K one. Categorical ids are ranks (0 = most frequent); the written token
 * is a keyed 32-bit bijection of the rank, so tokens are unique per field and look random.
 *
 * Click model (the truth). logit = bias + first + pair + dense, p = sigmoid(logit):
 *  - first: a per-(field, id) weight, a hashed approximately-normal value times a per-field
 *    scale; derived from hash(seed, field, id), so no table exists even for 10M ids. A missing
 *    value has its own weight (missingness is informative in Criteo too).
 *  - pair: for GEN_NUM_PAIRS field pairs (a, b), lambda_ab * <u_a(id_a), u_b(id_b)> / 2 with
 *    4-dim latent vectors of unit-variance components from hash(seed, field, id). Each term has
 *    zero mean for any fixed id, so it is invisible to a model that is linear in one-hot
 *    features and learnable by FM / DeepFM / DCN style models.
 *  - dense: an additive nonlinear function of log1p of the integers (sines, steps) plus one
 *    dense x dense product, again beyond a linear model on raw or log values.
 *  - bias: calibrated at model creation so the mean click probability is GEN_TARGET_CTR, from
 *    a fixed calibration stream that depends only on the seed.
 * Labels are Bernoulli(p). Scales are set so that the AUC of p itself is about 0.80.
 *
 * Determinism. Row r is a pure function of (seed, r): its PRNG is seeded from hash(seed, r).
 * So output is byte-identical for any thread count, and `--rows 1000` is a prefix of
 * `--rows 2000` with the same seed.
 */
#ifndef EMBER_SRC_GEN_H
#define EMBER_SRC_GEN_H

#include <stddef.h>
#include <stdint.h>

#define GEN_NUM_INT 13
#define GEN_NUM_CAT 26
#define GEN_NUM_FIELDS (1 + GEN_NUM_INT + GEN_NUM_CAT) /* 40 tab-separated fields a row */
#define GEN_NUM_PAIRS 7
#define GEN_TARGET_CTR 0.225
#define GEN_ROW_MAX 512    /* upper bound on one formatted row, newline included */
#define GEN_PROB_MAX 16    /* upper bound on one formatted truth line */

/* A model: the sampling tables and the calibrated bias for one seed. Immutable after
 * creation, so any number of threads may share one. */
typedef struct gen_model gen_model;

/* One generated row, decoded. */
typedef struct gen_row {
    uint8_t label;                     /* 0 or 1 */
    float prob;                        /* true click probability */
    float logit_first, logit_pair, logit_dense; /* parts of the logit (bias excluded) */
    uint8_t int_present[GEN_NUM_INT];  /* 0: field is empty */
    int32_t ints[GEN_NUM_INT];         /* >= -1; meaningful when present */
    uint8_t cat_present[GEN_NUM_CAT];  /* 0: field is empty */
    uint32_t cat_id[GEN_NUM_CAT];      /* frequency rank, 0 = most frequent */
    uint32_t cat_token[GEN_NUM_CAT];   /* the 8-hex-digit token written */
} gen_row;

/* Builds the model for seed into *out (owned by the caller; release with gen_model_free).
 * Takes ~20 ms (tables plus bias calibration). CM_ENOMEM on allocation failure. */
int gen_model_create(uint64_t seed, gen_model **out, char **errptr);

/* Releases a model; NULL is fine. */
void gen_model_free(gen_model *m);

/* The calibrated bias of the logit. */
double gen_model_bias(const gen_model *m);

/* Vocabulary size of categorical field f (0-based, C1 is 0). */
uint32_t gen_cat_cardinality(int f);

/* Generates row number row into *out (caller's storage). Pure: same (model seed, row), same
 * row. Thread-safe. */
void gen_make_row(const gen_model *m, uint64_t row, gen_row *out);

/* Formats r as one TSV line with its '\n' into buf (at least GEN_ROW_MAX bytes); returns the
 * number of bytes written (no NUL). */
size_t gen_format_row(const gen_row *r, char *buf);

/* Formats p as "0.dddddd\n" (6 decimals; "1.000000\n" when it rounds up) into buf (at least
 * GEN_PROB_MAX bytes); returns the bytes written. */
size_t gen_format_prob(float p, char *buf);

/* What gen_write produces. Strings are borrowed. */
typedef struct gen_opts {
    uint64_t rows;
    int threads;            /* >= 1 */
    const char *out_path;   /* TSV, required */
    const char *truth_path; /* one probability a line, or NULL for none */
} gen_opts;

/* Summary of a gen_write run. */
typedef struct gen_stats {
    uint64_t bytes;  /* TSV bytes written */
    uint64_t clicks; /* rows with label 1 */
    double seconds;  /* wall time of generation and writing */
} gen_stats;

/* Writes rows 0..opts->rows-1 of model m, generated by opts->threads threads in chunks and
 * written in order, to the output files. Each file is committed atomically (cm_afile): a
 * failure before the commits leaves both targets untouched; the TSV is committed first, so a
 * failing truth commit leaves the new TSV beside the old truth file. stats may be NULL.
 * CM_EIO with a message naming the failing path; CM_EINVAL for bad opts; CM_ENOMEM. */
int gen_write(const gen_model *m, const gen_opts *opts, gen_stats *stats, char **errptr);

#endif
