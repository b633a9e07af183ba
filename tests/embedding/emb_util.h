/*
 * Helpers shared by the emb_* tests (tests/embedding/ only): a deterministic RNG, key mixing,
 * a Zipf-like sampler, table wrappers that record failures through check.h, and a row-by-row
 * bit comparison of two tables. Everything is static inline so each test includes only what
 * it uses without unused-function warnings.
 */
#ifndef EMBER_TESTS_EMB_UTIL_H
#define EMBER_TESTS_EMB_UTIL_H

#include <inttypes.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "embedding/embedding.h"

/* Failed calls on threads other than main: check.h's counters are plain ints, so threads count
 * here (eu_tcheck) and main checks the total once they are joined (eu_check_threads). */
static inline atomic_uint *eu_thread_errors(void)
{
    static atomic_uint n;
    return &n;
}

/* On a thread: counts and reports a call that returned rc != 0; frees err. */
static inline void eu_tcheck(int rc, char *err, const char *what)
{
    if (rc != 0) {
        atomic_fetch_add(eu_thread_errors(), 1);
        fprintf(stderr, "  thread: %s rc=%d err=%s\n", what, rc, err ? err : "(none)");
    }
    free(err);
}

static inline void eu_check_threads(void)
{
    unsigned n = atomic_load(eu_thread_errors());
    CHECK_MSG(n == 0, "%u failed calls in threads", n);
}

/* splitmix64: tiny, fast, and identical on every platform, so a failing seed reproduces. */
static inline uint64_t eu_mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static inline uint64_t eu_rand(uint64_t *state)
{
    *state += 0x9e3779b97f4a7c15ull;
    uint64_t x = *state;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Uniform in [0, 1). */
static inline double eu_unif(uint64_t *state)
{
    return (double)(eu_rand(state) >> 11) * (1.0 / 9007199254740992.0);
}

/* Uniform in [0, n). */
static inline uint64_t eu_below(uint64_t *state, uint64_t n)
{
    return eu_rand(state) % n;
}

/* Key of the i-th item: scattered over all 64 bits so tests do not rely on small or dense keys
 * (a store that used key % size or key 0 as "empty" would show it). */
static inline uint64_t eu_key(uint64_t i)
{
    return eu_mix(i ^ 0x5eedf00dull);
}

/* Index in [0, n) with P(i) roughly proportional to 1/(i+1): floor(n^u) is log-uniform, the
 * continuous Zipf(1). Good enough for a skewed test stream; the benchmark has an exact sampler. */
static inline uint64_t eu_zipfish(uint64_t *state, uint64_t n)
{
    double x = exp(eu_unif(state) * log((double)n + 1.0));
    uint64_t i = (uint64_t)x;
    return i == 0 ? 0 : (i - 1 < n ? i - 1 : n - 1);
}

static inline void *eu_xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p == NULL) {
        fprintf(stderr, "out of memory (%zu bytes)\n", n);
        exit(2);
    }
    return p;
}

static inline void *eu_xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (p == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

/* A small-budget-friendly default config for the tests. */
static inline emb_table_config eu_config(emb_opt_kind opt, uint32_t dim)
{
    emb_table_config c;
    emb_table_config_init(&c);
    c.opt = opt;
    c.dim = dim;
    c.seed = 7;
    return c;
}

/* Creates a table or ends the test: nothing after a failed create could run meaningfully. */
static inline emb_table *eu_create(const emb_table_config *cfg)
{
    emb_table *t = NULL;
    char *err = NULL;
    int rc = emb_table_create(cfg, &t, &err);
    CHECK_MSG(rc == 0 && t != NULL, "emb_table_create rc=%d err=%s", rc, err ? err : "(none)");
    free(err);
    if (rc != 0 || t == NULL) exit(check_done()); /* non-zero: the CHECK above failed */
    return t;
}

static inline void eu_pull(emb_table *t, const uint64_t *keys, size_t n, float *out)
{
    char *err = NULL;
    CHECK_OK(emb_table_pull(t, keys, n, out, &err), err);
}

static inline void eu_push(emb_table *t, const uint64_t *keys, size_t n, const float *grads)
{
    char *err = NULL;
    CHECK_OK(emb_table_push(t, keys, n, grads, &err), err);
}

static inline emb_table_stats eu_stats(emb_table *t)
{
    emb_table_stats s;
    memset(&s, 0, sizeof s);
    emb_table_stats_get(t, &s);
    return s;
}

/* One row copied out of a table; found is 0 when the table does not hold the key. */
typedef struct eu_row {
    int found;
    uint64_t updates, last_step;
    float w[EMB_MAX_DIM];
    float s[2 * EMB_MAX_DIM];
} eu_row;

static inline int eu_get(emb_table *t, uint64_t key, eu_row *r)
{
    emb_row row;
    char *err = NULL;
    memset(r, 0, sizeof *r);
    int rc = emb_table_get_row(t, key, &row, r->w, r->s, &err);
    if (rc == CM_ENOTFOUND) {
        CHECK_MSG(err == NULL, "get_row NOTFOUND carried a message: %s", err);
        free(err);
        return 0;
    }
    CHECK_OK(rc, err);
    if (rc != 0) return 0;
    CHECK(row.key == key);
    r->found = 1;
    r->updates = row.updates;
    r->last_step = row.last_step;
    return 1;
}

static inline int eu_count_cb(const emb_row *row, void *arg)
{
    (void)row;
    (*(uint64_t *)arg)++;
    return 0;
}

/* Rows the table holds, counted by a foreach walk (memory and spilled). */
static inline uint64_t eu_count_rows(emb_table *t)
{
    uint64_t n = 0;
    char *err = NULL;
    CHECK_OK(emb_table_foreach(t, eu_count_cb, &n, &err), err);
    return n;
}

/* Walks table a and compares every row, bit for bit, with the same key in table b. */
typedef struct eu_cmp {
    emb_table *other;
    uint32_t dim, slots;
    int with_last_step;
    uint64_t rows, mismatches;
    eu_row buf;
} eu_cmp;

static inline int eu_cmp_cb(const emb_row *row, void *arg)
{
    eu_cmp *c = arg;
    eu_row *o = &c->buf;
    c->rows++;
    const char *what = NULL;
    if (!eu_get(c->other, row->key, o)) what = "missing";
    else if (o->updates != row->updates) what = "updates";
    else if (c->with_last_step && o->last_step != row->last_step) what = "last_step";
    else if (memcmp(o->w, row->weights, c->dim * sizeof(float)) != 0) what = "weights";
    else if (c->slots && memcmp(o->s, row->state, c->slots * sizeof(float)) != 0) what = "state";
    if (what != NULL) {
        if (c->mismatches < 5)
            fprintf(stderr, "  row %016" PRIx64 " differs: %s\n", row->key, what);
        c->mismatches++;
    }
    return 0;
}

/* Number of rows that differ (including rows only one table holds); prints the first few. */
static inline uint64_t eu_diff_tables(emb_table *a, emb_table *b, int with_last_step)
{
    const emb_table_config *cfg = emb_table_get_config(a);
    eu_cmp *c = eu_xcalloc(1, sizeof *c);
    c->other = b;
    c->dim = cfg->dim;
    c->slots = emb_row_slots(cfg);
    c->with_last_step = with_last_step;
    char *err = NULL;
    CHECK_OK(emb_table_foreach(a, eu_cmp_cb, c, &err), err);
    uint64_t nb = eu_count_rows(b);
    uint64_t bad = c->mismatches;
    if (nb != c->rows) {
        fprintf(stderr, "  row counts differ: %" PRIu64 " vs %" PRIu64 "\n", c->rows, nb);
        bad += nb > c->rows ? nb - c->rows : c->rows - nb;
    }
    free(c);
    return bad;
}

/* 1 when s contains needle (NULL-safe): error messages must name what failed. */
static inline int eu_has(const char *s, const char *needle)
{
    return s != NULL && strstr(s, needle) != NULL;
}

#endif
