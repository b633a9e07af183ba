/*
 * emb_admit_ttl: admission (count-min threshold) and TTL expiry.
 *  - admit_threshold 3: the first two pulls of a key read zeros and store nothing, pushes to it
 *    are dropped and counted; the third pull creates the row with its normal initial weights.
 *  - the sketch's counts survive a snapshot: keys seen twice before it are admitted by the
 *    restored table at their third sighting, as by the uninterrupted one (a resumed run trains
 *    the same rows); a damaged sketch.bin is refused, naming it.
 *  - ttl_steps: expire drops rows whose last_step is more than ttl behind the step (exactly at
 *    the boundary), in memory and in the spill; rows kept alive by pulls or pushes stay and
 *    equal those of the same table without spill.
 *  - emb_table_put_row into a spilling TTL table: a row put over one with a spill copy, stamped
 *    before it, expires whole (the copy of the row it replaced does not come back); a row put
 *    stamped below the last expiry cut and then evicted is counted as the walk finds it (gone,
 *    and reported by the next expire).
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#include "emb_util.h"

#define D 4u

static int all_zero(const float *w, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (w[i] != 0.0f) return 0;
    return 1;
}

static void test_admission(void)
{
    emb_table_config c = eu_config(EMB_OPT_SGD, D);
    c.init_scale = 0.1f;
    emb_table *twin = eu_create(&c);
    c.admit_threshold = 3;
    emb_table *t = eu_create(&c);
    eu_row row;
    float w[D], want[D], g[2 * D];
    const uint64_t k = eu_key(1);
    eu_pull(twin, &k, 1, want);

    for (int i = 0; i < 2; i++) {
        memset(w, 0x7f, sizeof w);
        eu_pull(t, &k, 1, w);
        CHECK_MSG(all_zero(w, D), "pull %d of an unadmitted key is not zeros", i + 1);
        CHECK_MSG(!eu_get(t, k, &row), "pull %d stored an unadmitted key", i + 1);
    }
    emb_table_stats s = eu_stats(t);
    CHECK(s.admit_rejects == 2 && s.created == 0 && s.admissions == 0 && s.rows_mem == 0);
    for (size_t j = 0; j < D; j++) g[j] = 1.0f;
    eu_push(t, &k, 1, g);
    s = eu_stats(t);
    CHECK_MSG(s.push_dropped == 1 && !eu_get(t, k, &row), "push to an unadmitted key not dropped");
    CHECK(emb_table_step(t) == 1);

    eu_pull(t, &k, 1, w);
    CHECK_MSG(memcmp(w, want, sizeof w) == 0 && !all_zero(w, D),
              "third pull does not return the key's initial weights");
    CHECK(eu_get(t, k, &row) && row.updates == 0 && memcmp(row.w, want, sizeof want) == 0);
    s = eu_stats(t);
    CHECK(s.admissions == 1 && s.created == 1 && s.rows_mem == 1);

    /* a mixed push: the admitted key steps (plain SGD), the new one is dropped */
    const uint64_t mixed[2] = {k, eu_key(2)};
    for (size_t j = 0; j < 2 * D; j++) g[j] = 0.5f;
    eu_push(t, mixed, 2, g);
    CHECK(eu_get(t, k, &row) && row.updates == 1);
    for (size_t j = 0; j < D; j++)
        CHECK(row.w[j] == (float)((double)want[j] - (double)c.lr * 0.5));
    CHECK(!eu_get(t, mixed[1], &row));
    CHECK(eu_stats(t).push_dropped == 2);

    /* many keys: two pulls store none, pushes are all dropped, the third pull stores all */
    enum { N = 200 };
    uint64_t keys[N];
    float *out = eu_xmalloc(N * D * sizeof *out), *ref = eu_xmalloc(N * D * sizeof *ref);
    float *gr = eu_xcalloc(N * D, sizeof *gr);
    for (uint32_t i = 0; i < N; i++) keys[i] = eu_key(1000 + i);
    emb_table_stats before = eu_stats(t);
    for (int r = 0; r < 2; r++) {
        eu_pull(t, keys, N, out);
        CHECK_MSG(all_zero(out, N * D), "round %d: unadmitted keys read non-zero", r);
    }
    eu_push(t, keys, N, gr);
    s = eu_stats(t);
    CHECK_MSG(s.rows_mem == before.rows_mem && s.admit_rejects == before.admit_rejects + 2 * N &&
                  s.push_dropped == before.push_dropped + N,
              "after 2 pulls: rows %" PRIu64 " rejects %" PRIu64 " dropped %" PRIu64, s.rows_mem,
              s.admit_rejects, s.push_dropped);
    eu_pull(t, keys, N, out);
    eu_pull(twin, keys, N, ref);
    CHECK_MSG(memcmp(out, ref, N * D * sizeof *out) == 0, "admitted keys' initial weights differ");
    s = eu_stats(t);
    CHECK(s.rows_mem == before.rows_mem + N && s.admissions == before.admissions + N &&
          s.created == before.created + N);
    uint64_t dropped = 99;
    char *err = NULL;
    CHECK_OK(emb_table_expire(t, &dropped, &err), err); /* ttl 0: never expires */
    CHECK(dropped == 0 && eu_count_rows(t) == 1 + N);
    free(out);
    free(ref);
    free(gr);
    emb_table_destroy(t);
    emb_table_destroy(twin);
}

static uint64_t expire(emb_table *t)
{
    uint64_t dropped = UINT64_MAX;
    char *err = NULL;
    CHECK_OK(emb_table_expire(t, &dropped, &err), err);
    return dropped;
}

/* The boundary: a row last touched at step s survives expire at s + ttl, not at s + ttl + 1. */
static void test_ttl_boundary(void)
{
    emb_table_config c = eu_config(EMB_OPT_SGD, D);
    c.ttl_steps = 5;
    emb_table *t = eu_create(&c), *twin = eu_create(&c);
    const uint64_t stale = eu_key(7), live = eu_key(8);
    float w[D], w0[D], g[D] = {0.1f, 0.2f, 0.3f, 0.4f};
    eu_pull(t, &stale, 1, w0);
    for (int i = 0; i < 5; i++) eu_push(t, &live, 1, g);
    CHECK(emb_table_step(t) == 5);
    CHECK_MSG(expire(t) == 0, "a row exactly ttl steps behind was dropped");
    eu_row row;
    CHECK(eu_get(t, stale, &row) && eu_get(t, live, &row));
    eu_push(t, &live, 1, g);
    CHECK_MSG(expire(t) == 1, "a row ttl+1 steps behind was not dropped");
    CHECK(!eu_get(t, stale, &row) && eu_get(t, live, &row) && row.updates == 6);
    CHECK(eu_stats(t).ttl_evictions == 1);
    CHECK(expire(t) == 0);
    /* an expired key comes back as a fresh row */
    eu_pull(t, &stale, 1, w);
    CHECK(memcmp(w, w0, sizeof w) == 0 && eu_get(t, stale, &row) && row.updates == 0);
    eu_pull(twin, &stale, 1, w);
    CHECK(memcmp(w, w0, sizeof w) == 0);
    emb_table_destroy(t);
    emb_table_destroy(twin);
}

/* From ttl 64 on, steps count in buckets of ttl / 64 (embedding.h): with ttl 128 a row touched
 * at step 10 (bucket 5 of 2 steps) stays at step 139, where it is 129 steps behind, and goes at
 * 140, when the cut reaches bucket 6; a row is never dropped less than ttl steps behind. */
static void test_ttl_buckets(void)
{
    emb_table_config c = eu_config(EMB_OPT_SGD, D);
    c.ttl_steps = 128;
    emb_table *t = eu_create(&c);
    const uint64_t stale = eu_key(7), live = eu_key(8);
    float w[D], g[D] = {0.1f, 0.2f, 0.3f, 0.4f};
    for (int i = 0; i < 10; i++)
        eu_push(t, &live, 1, g);
    eu_pull(t, &stale, 1, w); /* stamped at step 10 */
    while (emb_table_step(t) < 138) {
        eu_push(t, &live, 1, g);
        CHECK_MSG(expire(t) == 0, "a row %llu steps behind was dropped",
                  (unsigned long long)(emb_table_step(t) - 10));
    }
    eu_push(t, &live, 1, g); /* 139 */
    CHECK_MSG(expire(t) == 0, "a row in the cut's own bucket was dropped");
    eu_push(t, &live, 1, g); /* 140 */
    CHECK_MSG(expire(t) == 1, "a row a whole bucket past its ttl stayed");
    eu_row row;
    CHECK(!eu_get(t, stale, &row) && eu_get(t, live, &row));
    emb_table_destroy(t);
}

/* Expiry of a spilling table does not read its spill store: with nothing to drop it costs a
 * walk of the resident rows, a small part of what filling the table cost. (It used to walk every
 * spilled record through RocksDB: ~11% of the fill.) Best of three calls, against the fill in
 * the same run, so that the machine's load scales both. */
static void test_ttl_spill_cost(const char *dir)
{
    enum { N = 100000, B = 4096, DM = 8 };
    emb_table_config c = eu_config(EMB_OPT_ADAGRAD, DM);
    c.ttl_steps = 1000;
    c.n_sub = 16;
    char path[4200];
    snprintf(path, sizeof path, "%s/ttl_cost", dir);
    c.mem_budget_bytes = (uint64_t)(0.1 * N * emb_row_mem_bytes(&c));
    c.spill_path = path;
    emb_table *t = eu_create(&c);
    uint64_t *keys = eu_xmalloc(B * sizeof *keys);
    float *out = eu_xmalloc((size_t)B * DM * sizeof *out);
    double t0 = cm_now();
    for (uint32_t i = 0; i < N; i += B) {
        for (uint32_t j = 0; j < B; j++)
            keys[j] = eu_key(i + j);
        eu_pull(t, keys, B, out);
    }
    double fill = cm_now() - t0, best = 1e30;
    CHECK(eu_stats(t).rows_spilled > N / 2);
    for (int k = 0; k < 3; k++) {
        t0 = cm_now();
        CHECK(expire(t) == 0);
        double e = cm_now() - t0;
        if (e < best) best = e;
    }
    CHECK_MSG(best < fill / 50, "expire took %.2f ms, filling the table %.1f ms", best * 1e3,
              fill * 1e3);
    free(keys);
    free(out);
    emb_table_destroy(t);
}

/* Expiry locks one sub-shard at a time: pulls go on while it walks the table. A thread runs
 * expire calls back to back over 400K resident rows (nothing to drop) while this one times
 * single-key pulls (for at most 3 s). With the whole table paused for each call, as it used to
 * be, the calls took turns with the pulls unevenly: one pull in ten waited 532 ms, against
 * 1.3 ms a call; now the slowest tenth take well under a call. */
struct expirer {
    emb_table *t;
    atomic_int stop;
    double busy; /* seconds in expire calls (read after the join) */
    atomic_uint_fast64_t calls;
};

static void *expire_loop(void *arg)
{
    struct expirer *e = arg;
    while (!atomic_load(&e->stop)) {
        double t0 = cm_now();
        char *err = NULL;
        eu_tcheck(emb_table_expire(e->t, NULL, &err), err, "expire");
        e->busy += cm_now() - t0;
        atomic_fetch_add(&e->calls, 1);
    }
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void test_ttl_expire_concurrent(void)
{
    enum { N = 400000, B = 8192, PULLS = 4000 };
    emb_table_config c = eu_config(EMB_OPT_SGD, D);
    c.ttl_steps = 1u << 30;
    emb_table *t = eu_create(&c);
    uint64_t *keys = eu_xmalloc(B * sizeof *keys);
    float *out = eu_xmalloc((size_t)B * D * sizeof *out);
    for (uint32_t i = 0; i < N; i += B) {
        for (uint32_t j = 0; j < B; j++)
            keys[j] = eu_key(i + j);
        eu_pull(t, keys, B, out);
    }
    struct expirer e = {.t = t};
    atomic_init(&e.stop, 0);
    atomic_init(&e.calls, 0);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, expire_loop, &e) == 0);
    double *lat = eu_xmalloc(PULLS * sizeof *lat);
    uint64_t rng = 5;
    while (atomic_load(&e.calls) == 0)
        sched_yield();
    uint32_t n = 0;
    for (double end = cm_now() + 3.0; n < PULLS && cm_now() < end; n++) {
        uint64_t k = eu_key(eu_below(&rng, N));
        double t0 = cm_now();
        eu_pull(t, &k, 1, out);
        lat[n] = cm_now() - t0;
    }
    atomic_store(&e.stop, 1);
    pthread_join(th, NULL);
    eu_check_threads();
    qsort(lat, n, sizeof *lat, cmp_double);
    uint64_t calls = atomic_load(&e.calls);
    double per_call = e.busy / (double)calls;
    double p90 = lat[n * 9 / 10];
    CHECK_MSG(p90 < per_call / 4,
              "%u pulls during expire calls of %.3f ms each (%llu calls): the slowest tenth "
              "took %.3f ms or more",
              n, per_call * 1e3, (unsigned long long)calls, p90 * 1e3);
    free(lat);
    free(keys);
    free(out);
    emb_table_destroy(t);
}

/* Stale rows mostly spilled; rows kept alive by pushes or by pulls only. */
static void test_ttl_spill(const char *dir)
{
    enum { STALE = 20000, LIVE = 500, READ = 100, TTL = 10, DM = 8 };
    emb_table_config c = eu_config(EMB_OPT_ADAGRAD, DM);
    c.ttl_steps = TTL;
    c.n_sub = 16;
    char path[4200];
    snprintf(path, sizeof path, "%s/ttl_spill", dir);
    emb_table_config cs = c;
    cs.mem_budget_bytes = (uint64_t)(0.1 * STALE * emb_row_mem_bytes(&c));
    cs.spill_path = path;
    emb_table *t = eu_create(&cs), *twin = eu_create(&c);
    uint64_t *keys = eu_xmalloc(STALE * sizeof *keys);
    float *out = eu_xmalloc((size_t)STALE * DM * sizeof *out);
    float *g = eu_xmalloc((size_t)LIVE * DM * sizeof *g);
    uint64_t live[LIVE], read[READ], rng = 3;
    for (uint32_t i = 0; i < STALE; i++) keys[i] = eu_key(i);
    for (uint32_t i = 0; i < LIVE; i++) live[i] = eu_key(STALE + i);
    for (uint32_t i = 0; i < READ; i++) read[i] = eu_key(STALE + LIVE + i);
    eu_pull(t, keys, STALE, out);
    eu_pull(twin, keys, STALE, out);
    for (uint32_t step = 0; step < 2 * TTL; step++) {
        for (size_t i = 0; i < (size_t)LIVE * DM; i++) g[i] = (float)(eu_unif(&rng) - 0.5);
        eu_push(t, live, LIVE, g);
        eu_push(twin, live, LIVE, g);
        eu_pull(t, read, READ, out);
        eu_pull(twin, read, READ, out);
    }
    emb_table_stats s = eu_stats(t);
    CHECK_MSG(s.rows_spilled > LIVE + READ, "stale rows not spilled (%" PRIu64 ")", s.rows_spilled);
    uint64_t dropped = expire(t);
    CHECK_MSG(dropped == STALE, "expire dropped %" PRIu64 " of %u stale rows", dropped, STALE);
    CHECK(expire(twin) == STALE);
    s = eu_stats(t);
    CHECK(s.ttl_evictions == STALE && s.rows_mem + s.rows_spilled == LIVE + READ);
    uint64_t found = 0;
    eu_row *row = eu_xmalloc(sizeof *row);
    for (uint32_t i = 0; i < STALE; i++) found += eu_get(t, keys[i], row);
    CHECK_MSG(found == 0, "%" PRIu64 " expired rows still readable", found);
    CHECK_MSG(eu_diff_tables(t, twin, 1) == 0, "surviving rows differ from the in-memory twin");
    free(row);
    free(keys);
    free(out);
    free(g);
    emb_table_destroy(t);
    emb_table_destroy(twin);
}

/* A spilling TTL table of one small sub-shard (about 50 rows fit), stamping key k at step 10
 * after `others` pulled keys have pushed it out of memory (all stamped 10 too); its pushes go
 * to a key that stays resident, so they evict nothing. */
enum { PUT_OTHERS = 400 };

static emb_table *put_row_table(const char *dir, const char *name, uint64_t k, const float *g)
{
    emb_table_config c = eu_config(EMB_OPT_SGD, D);
    c.ttl_steps = 4;
    c.n_sub = 1;
    c.mem_budget_bytes = 64 * (emb_row_bytes(&c) + 1);
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    c.spill_path = path;
    emb_table *t = eu_create(&c);
    uint64_t others[PUT_OTHERS];
    float *out = eu_xmalloc(PUT_OTHERS * D * sizeof *out);
    const uint64_t live = eu_key(2);
    for (int i = 0; i < 10; i++)
        eu_push(t, &live, 1, g);
    eu_pull(t, &k, 1, out);
    for (uint32_t i = 0; i < PUT_OTHERS; i++)
        others[i] = eu_key(100 + i);
    eu_pull(t, others, PUT_OTHERS, out);
    eu_pull(t, &live, 1, out);
    free(out);
    return t;
}

/* Stats against a walk, and a snapshot (which counts the same way). */
static void put_row_consistent(emb_table *t, const char *dir, const char *when)
{
    emb_table_stats s = eu_stats(t);
    uint64_t walked = eu_count_rows(t);
    CHECK_MSG(s.rows_mem + s.rows_spilled == walked,
              "%s: stats count %" PRIu64 " rows (%" PRIu64 " spilled), a walk finds %" PRIu64, when,
              s.rows_mem + s.rows_spilled, s.rows_spilled, walked);
    char snap[4300], *err = NULL;
    snprintf(snap, sizeof snap, "%s/put-row-snap", dir);
    CHECK_OK(emb_table_snapshot(t, snap, &err), err);
}

/* emb_table_put_row over a row with a spill copy, stamped before that copy: when the put row
 * expires, the older content's copy must not come back as the key's row. */
static void test_ttl_put_row_older(const char *dir)
{
    const uint64_t k = eu_key(1), live = eu_key(2);
    float g[D] = {0.1f, 0.2f, 0.3f, 0.4f}, w[D] = {1, 2, 3, 4};
    emb_table *t = put_row_table(dir, "put_older", k, g);
    emb_row row = {.key = k, .updates = 7, .last_step = 1, .weights = w, .state = w};
    char *err = NULL;
    CHECK_OK(emb_table_put_row(t, &row, &err), err);
    eu_row got;
    CHECK(eu_get(t, k, &got) && got.updates == 7 && got.last_step == 1);
    eu_push(t, &live, 1, g);
    eu_push(t, &live, 1, g); /* step 12: the put row (step 1) expires, its copy (10) would not */
    uint64_t before = eu_stats(t).ttl_evictions, dropped = expire(t);
    CHECK(dropped >= 1 && eu_stats(t).ttl_evictions == before + dropped);
    CHECK_MSG(!eu_get(t, k, &got),
              "an expired put row came back as its spill copy (updates %" PRIu64
              ", last_step %" PRIu64 ")",
              got.updates, got.last_step);
    put_row_consistent(t, dir, "put row expired");
    emb_table_destroy(t);
}

/* emb_table_put_row of a row stamped below the table's last expiry cut, then pushed out of
 * memory: whatever the walk then finds, the stats must count the same rows. */
static void test_ttl_put_row_below_mark(const char *dir)
{
    const uint64_t k = eu_key(1), live = eu_key(2), fresh = eu_key(3);
    float g[D] = {0.1f, 0.2f, 0.3f, 0.4f}, w[D] = {1, 2, 3, 4};
    emb_table *t = put_row_table(dir, "put_below", k, g);
    for (int i = 0; i < 10; i++)
        eu_push(t, &live, 1, g); /* step 20 */
    CHECK(expire(t) > 0);        /* every sub-shard's cut is step 16 */
    emb_row row = {.key = fresh, .updates = 7, .last_step = 2, .weights = w, .state = w};
    char *err = NULL;
    CHECK_OK(emb_table_put_row(t, &row, &err), err);
    uint64_t others[PUT_OTHERS];
    float *out = eu_xmalloc(PUT_OTHERS * D * sizeof *out);
    for (uint32_t i = 0; i < PUT_OTHERS; i++)
        others[i] = eu_key(1000 + i);
    eu_pull(t, others, PUT_OTHERS, out); /* pushes the put row out of memory */
    free(out);
    put_row_consistent(t, dir, "old put row evicted");
    eu_row got;
    CHECK(!eu_get(t, fresh, &got));
    uint64_t before = eu_stats(t).ttl_evictions, dropped = expire(t);
    CHECK_MSG(dropped >= 1 && eu_stats(t).ttl_evictions == before + dropped,
              "the next expire reported %" PRIu64 " dropped, ttl_evictions went %" PRIu64
              " -> %" PRIu64,
              dropped, before, eu_stats(t).ttl_evictions);
    put_row_consistent(t, dir, "after the next expire");
    emb_table_destroy(t);
}

static void test_admission_snapshot(const char *dir)
{
    emb_table_config c = eu_config(EMB_OPT_SGD, D);
    c.init_scale = 0.1f;
    c.admit_threshold = 3;
    emb_table *t = eu_create(&c);
    enum { N = 300 };
    uint64_t keys[N];
    float *a = eu_xmalloc(N * D * sizeof *a), *b = eu_xmalloc(N * D * sizeof *b);
    for (uint32_t i = 0; i < N; i++)
        keys[i] = eu_key(5000 + i);
    eu_pull(t, keys, N, a);
    eu_pull(t, keys, N, a); /* two sightings each: none admitted yet */
    char snap[1024];
    snprintf(snap, sizeof snap, "%s/admit-snap", dir);
    char *err = NULL;
    CHECK_OK(emb_table_snapshot(t, snap, &err), err);
    emb_table *r = NULL;
    CHECK_OK(emb_table_restore(snap, &c, &r, &err), err);
    if (r != NULL) {
        eu_pull(t, keys, N, a);
        eu_pull(r, keys, N, b);
        emb_table_stats st = eu_stats(t), sr = eu_stats(r);
        CHECK_MSG(sr.admissions == st.admissions && sr.admissions == N &&
                      memcmp(a, b, N * D * sizeof *a) == 0,
                  "third sighting after a restore: %" PRIu64 " admitted (uninterrupted %" PRIu64
                  ")",
                  sr.admissions, st.admissions);
        emb_table_destroy(r);
        r = NULL;
    }
    /* A flipped counter byte in sketch.bin: refused, naming the file. */
    char sk[1100];
    snprintf(sk, sizeof sk, "%s/sketch.bin", snap);
    FILE *f = fopen(sk, "r+b");
    CHECK(f != NULL);
    if (f) {
        fseek(f, 1000, SEEK_SET);
        int ch = fgetc(f);
        fseek(f, 1000, SEEK_SET);
        fputc(ch ^ 0x01, f);
        fclose(f);
        int rc = emb_table_restore(snap, &c, &r, &err);
        CHECK_MSG(rc != 0 && err && strstr(err, "sketch.bin"), "damaged sketch: rc %d, %s", rc,
                  err ? err : "(none)");
        free(err);
        err = NULL;
        emb_table_destroy(r);
    }
    free(a);
    free(b);
    emb_table_destroy(t);
}

int main(void)
{
    const char *dir = check_tmpdir("emb_admit_ttl");
    test_admission();
    test_admission_snapshot(dir);
    test_ttl_boundary();
    test_ttl_buckets();
    test_ttl_spill(dir);
    test_ttl_put_row_older(dir);
    test_ttl_put_row_below_mark(dir);
    test_ttl_spill_cost(dir);
    test_ttl_expire_concurrent();
    cm_rmtree(dir, NULL);
    return check_done();
}
