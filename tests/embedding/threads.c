/*
 * emb_threads: concurrent pulls and pushes.
 *  - disjoint key sets per thread: each row's history is then fixed by its own thread, so the
 *    final rows (weights, state, updates) must equal one thread running the same sequences one
 *    after another; run in memory and with a spilling budget.
 *  - overlapping keys: SGD with dyadic gradients and lr, zero init, so every sum is exact in
 *    float and order-free: each weight must end at exactly -lr * (sum of its gradients), and
 *    updates at the number of pushes of the key. A reader thread meanwhile walks, reads rows,
 *    takes stats and snapshots, to shake out lock-order and lifetime bugs (ASan build).
 *  - TTL expiry while a thread pushes: one emb_table_expire call drops every expired row,
 *    whatever the push in flight holds (an in-memory push reserves room in every sub-shard between
 *    its two passes; expiry used to skip such sub-shards, so under steady pushes rows could
 *    outlive their TTL indefinitely), and the pushes lose nothing.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#include "emb_util.h"

#define NT 4u
#define PER 4000u    /* keys per thread, disjoint test */
#define ROUNDS 120u
#define BATCH 256u
#define SHARED 3000u /* keys in the overlapping test */
#define DIM 8u

static const char *g_dir;

static void tpull(emb_table *t, const uint64_t *keys, size_t n, float *out)
{
    char *err = NULL;
    eu_tcheck(emb_table_pull(t, keys, n, out, &err), err, "pull");
}

static void tpush(emb_table *t, const uint64_t *keys, size_t n, const float *g)
{
    char *err = NULL;
    eu_tcheck(emb_table_push(t, keys, n, g, &err), err, "push");
}

static int tcount_cb(const emb_row *row, void *arg)
{
    (void)row;
    (*(uint64_t *)arg)++;
    return 0;
}

/* ---- disjoint ---- */

typedef struct job {
    emb_table *t;
    uint32_t tid;
} job;

/* One thread's fixed sequence: pull a batch of its own keys, push gradients from the weights. */
static void *disjoint_worker(void *arg)
{
    job *j = arg;
    uint64_t rng = 1000 + j->tid, keys[BATCH];
    float *w = eu_xmalloc(BATCH * DIM * sizeof *w), *g = eu_xmalloc(BATCH * DIM * sizeof *g);
    for (uint32_t r = 0; r < ROUNDS; r++) {
        for (uint32_t i = 0; i < BATCH; i++) keys[i] = eu_key(j->tid * PER + eu_below(&rng, PER));
        tpull(j->t, keys, BATCH, w);
        for (uint32_t i = 0; i < BATCH * DIM; i++)
            g[i] = 0.25f * w[i] + (float)(eu_unif(&rng) - 0.5);
        tpush(j->t, keys, BATCH, g);
    }
    free(w);
    free(g);
    return NULL;
}

static void run_disjoint(emb_opt_kind opt, int spill)
{
    emb_table_config c = eu_config(opt, DIM);
    c.n_sub = 8; /* few stripes: threads collide on locks even with disjoint keys */
    char path[2][4200];
    emb_table *t[2];
    for (int k = 0; k < 2; k++) {
        emb_table_config ck = c;
        if (spill) {
            snprintf(path[k], sizeof path[k], "%s/disjoint_%s_%d", g_dir, emb_opt_name(opt), k);
            ck.mem_budget_bytes = (uint64_t)(0.1 * NT * PER * emb_row_mem_bytes(&c));
            ck.spill_path = path[k];
        }
        t[k] = eu_create(&ck);
    }
    pthread_t th[NT];
    job jobs[NT];
    for (uint32_t i = 0; i < NT; i++) {
        jobs[i] = (job){t[0], i};
        CHECK(pthread_create(&th[i], NULL, disjoint_worker, &jobs[i]) == 0);
    }
    for (uint32_t i = 0; i < NT; i++) pthread_join(th[i], NULL);
    for (uint32_t i = 0; i < NT; i++) {
        job one = {t[1], i};
        disjoint_worker(&one);
    }
    /* last_step is global-step order, which interleaving legitimately changes */
    CHECK_MSG(eu_diff_tables(t[0], t[1], 0) == 0, "%s%s: %u threads differ from one",
              emb_opt_name(opt), spill ? " spilled" : "", NT);
    emb_table_stats s0 = eu_stats(t[0]), s1 = eu_stats(t[1]);
    CHECK(s0.step == NT * ROUNDS && s0.pushes == (uint64_t)NT * ROUNDS * BATCH);
    CHECK(s0.pulls == s1.pulls && s0.created == s1.created);
    if (spill) CHECK(s0.spill_evictions > 0 && s0.bytes_mem <= s0.bytes_budget);
    emb_table_destroy(t[0]);
    emb_table_destroy(t[1]);
}

/* ---- overlapping ---- */

typedef struct ojob {
    emb_table *t;
    uint32_t tid;
    int64_t gsum[SHARED][DIM]; /* sum of pushed gradients in units of 1/64 */
    uint64_t pushes[SHARED];
} ojob;

static void *overlap_worker(void *arg)
{
    ojob *j = arg;
    uint64_t rng = 77 + j->tid, keys[BATCH];
    uint32_t idx[BATCH];
    float *w = eu_xmalloc(BATCH * DIM * sizeof *w), *g = eu_xmalloc(BATCH * DIM * sizeof *g);
    for (uint32_t r = 0; r < ROUNDS; r++) {
        for (uint32_t i = 0; i < BATCH; i++) {
            idx[i] = (uint32_t)eu_below(&rng, SHARED);
            keys[i] = eu_key(idx[i]);
        }
        if (r % 2) tpull(j->t, keys, BATCH, w);
        for (uint32_t i = 0; i < BATCH; i++) {
            j->pushes[idx[i]]++;
            for (uint32_t d = 0; d < DIM; d++) {
                int64_t q = (int64_t)eu_below(&rng, 17) - 8;
                j->gsum[idx[i]][d] += q;
                g[i * DIM + d] = (float)q / 64.0f;
            }
        }
        tpush(j->t, keys, BATCH, g);
    }
    free(w);
    free(g);
    return NULL;
}

typedef struct reader {
    emb_table *t;
    atomic_int stop;
    uint32_t snapshots;
} reader;

static void *reader_main(void *arg)
{
    reader *rd = arg;
    uint64_t rng = 5;
    char dir[4200];
    eu_row *row = eu_xmalloc(sizeof *row);
    do { /* at least once, so snapshot 0 exists however fast the workers are */
        emb_table_stats s;
        emb_table_stats_get(rd->t, &s);
        if (s.step > NT * ROUNDS) eu_tcheck(-1, NULL, "stats step out of range");
        emb_row r;
        char *err = NULL;
        int rc = emb_table_get_row(rd->t, eu_key(eu_below(&rng, SHARED)), &r, row->w, row->s, &err);
        eu_tcheck(rc == CM_ENOTFOUND ? 0 : rc, err, "get_row");
        uint64_t n = 0, dropped = 1;
        err = NULL;
        eu_tcheck(emb_table_foreach(rd->t, tcount_cb, &n, &err), err, "foreach");
        if (n > SHARED) eu_tcheck(-1, NULL, "foreach walked too many rows");
        err = NULL;
        eu_tcheck(emb_table_expire(rd->t, &dropped, &err), err, "expire"); /* ttl 0: a no-op */
        if (dropped != 0) eu_tcheck(-1, NULL, "expire dropped rows with ttl 0");
        if (rd->snapshots < 3) {
            snprintf(dir, sizeof dir, "%s/overlap_snap%u", g_dir, rd->snapshots++);
            err = NULL;
            eu_tcheck(emb_table_snapshot(rd->t, dir, &err), err, "snapshot");
        }
    } while (!atomic_load(&rd->stop));
    free(row);
    return NULL;
}

static void run_overlap(int spill)
{
    emb_table_config c = eu_config(EMB_OPT_SGD, DIM);
    c.lr = 0.25f;
    c.init_scale = 0;
    c.n_sub = 8;
    char path[4200];
    if (spill) {
        snprintf(path, sizeof path, "%s/overlap_spill", g_dir);
        c.mem_budget_bytes = (uint64_t)(0.2 * SHARED * emb_row_mem_bytes(&c));
        c.spill_path = path;
    }
    emb_table *t = eu_create(&c);
    pthread_t th[NT], rth;
    ojob *jobs = eu_xcalloc(NT, sizeof *jobs);
    reader rd = {.t = t};
    atomic_init(&rd.stop, 0);
    CHECK(pthread_create(&rth, NULL, reader_main, &rd) == 0);
    for (uint32_t i = 0; i < NT; i++) {
        jobs[i].t = t;
        jobs[i].tid = i;
        CHECK(pthread_create(&th[i], NULL, overlap_worker, &jobs[i]) == 0);
    }
    for (uint32_t i = 0; i < NT; i++) pthread_join(th[i], NULL);
    atomic_store(&rd.stop, 1);
    pthread_join(rth, NULL);

    uint64_t bad = 0;
    eu_row *row = eu_xmalloc(sizeof *row);
    for (uint32_t k = 0; k < SHARED; k++) {
        uint64_t pushes = 0;
        for (uint32_t i = 0; i < NT; i++) pushes += jobs[i].pushes[k];
        if (!eu_get(t, eu_key(k), row)) {
            bad += pushes != 0;
            continue;
        }
        int ok = row->updates == pushes;
        for (uint32_t d = 0; d < DIM; d++) {
            int64_t sum = 0;
            for (uint32_t i = 0; i < NT; i++) sum += jobs[i].gsum[k][d];
            ok &= row->w[d] == -0.25f * (float)sum / 64.0f;
        }
        if (!ok && bad < 3)
            fprintf(stderr, "  key %u: updates %" PRIu64 " want %" PRIu64 "\n", k, row->updates, pushes);
        bad += !ok;
    }
    CHECK_MSG(bad == 0, "overlap%s: %" PRIu64 " rows lost or mis-summed updates", spill ? " spilled" : "", bad);
    CHECK(emb_table_step(t) == NT * ROUNDS);

    /* a snapshot taken mid-run restores to a consistent table */
    char snap[4200], *err = NULL;
    snprintf(snap, sizeof snap, "%s/overlap_snap0", g_dir);
    emb_table_config rc = c;
    rc.mem_budget_bytes = 0;
    rc.spill_path = NULL;
    emb_table *back = NULL;
    CHECK_OK(emb_table_restore(snap, &rc, &back, &err), err);
    if (back != NULL) CHECK(emb_table_step(back) <= NT * ROUNDS && eu_count_rows(back) <= SHARED);
    emb_table_destroy(back);
    for (uint32_t i = 0; i < 3; i++) {
        snprintf(snap, sizeof snap, "%s/overlap_snap%u", g_dir, i);
        cm_rmtree(snap, NULL);
    }
    emb_table_destroy(t);
    free(row);
    free(jobs);
}

/* ---- expiry under pushes ---- */

#define COLD 4096u /* rows pushed once, then left to expire */
#define HOT 512u   /* keys the pushing thread keeps pushing */

typedef struct hjob {
    emb_table *t;
    atomic_int *stop;
    uint64_t pushes;
} hjob;

static void *hot_pusher(void *arg)
{
    hjob *j = arg;
    uint64_t *keys = eu_xmalloc(HOT * sizeof *keys);
    float *g = eu_xcalloc(HOT * DIM, sizeof *g);
    for (uint32_t i = 0; i < HOT; i++)
        keys[i] = eu_key(1000000u + i);
    while (!atomic_load(j->stop)) {
        tpush(j->t, keys, HOT, g);
        j->pushes++;
    }
    free(keys);
    free(g);
    return NULL;
}

/* One pushing thread: its rows are stamped by every step, so only the cold ones expire. */
static void run_expire_under_pushes(void)
{
    emb_table_config c = eu_config(EMB_OPT_ADAGRAD, DIM);
    c.ttl_steps = 20;
    emb_table *t = eu_create(&c);
    uint64_t *keys = eu_xmalloc(COLD * sizeof *keys);
    float *g = eu_xcalloc(COLD * DIM, sizeof *g);
    for (uint32_t i = 0; i < COLD; i++)
        keys[i] = eu_key(i);
    tpush(t, keys, COLD, g);
    atomic_int stop;
    atomic_init(&stop, 0);
    hjob job = {t, &stop, 0};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, hot_pusher, &job) == 0);
    while (emb_table_step(t) < 1 + c.ttl_steps + 40) /* the cold rows' TTL long past */
        sched_yield();
    uint64_t dropped = 0;
    char *err = NULL;
    eu_tcheck(emb_table_expire(t, &dropped, &err), err, "expire");
    for (int round = 0; round < 20; round++) { /* more calls while the pushes go on */
        uint64_t more = 0;
        eu_tcheck(emb_table_expire(t, &more, &err), err, "expire");
        CHECK_MSG(more == 0, "expire round %d dropped %" PRIu64 " rows", round, more);
    }
    atomic_store(&stop, 1);
    pthread_join(th, NULL);
    CHECK_MSG(dropped == COLD, "one expire under pushes dropped %" PRIu64 " of %u expired rows",
              dropped, COLD);
    emb_table_stats st;
    emb_table_stats_get(t, &st);
    CHECK_MSG(st.rows_mem == HOT && st.ttl_evictions == COLD,
              "after expiry: %" PRIu64 " rows, %" PRIu64 " TTL evictions", st.rows_mem,
              st.ttl_evictions);
    eu_row *row = eu_xmalloc(sizeof *row);
    CHECK_MSG(eu_get(t, eu_key(1000000u), row) && row->updates == job.pushes,
              "a hot row has %" PRIu64 " updates after %" PRIu64 " pushes", row->updates,
              job.pushes);
    free(row);
    free(keys);
    free(g);
    emb_table_destroy(t);
}

int main(void)
{
    g_dir = check_tmpdir("emb_threads");
    fprintf(stderr, "disjoint sgd\n");
    run_disjoint(EMB_OPT_SGD, 0);
    fprintf(stderr, "disjoint sgd, spilled\n");
    run_disjoint(EMB_OPT_SGD, 1);
    fprintf(stderr, "disjoint adam\n");
    run_disjoint(EMB_OPT_ADAM, 0);
    fprintf(stderr, "overlapping sgd\n");
    run_overlap(0);
    fprintf(stderr, "overlapping sgd, spilled\n");
    run_overlap(1);
    fprintf(stderr, "expiry under pushes\n");
    run_expire_under_pushes();
    eu_check_threads();
    cm_rmtree(g_dir, NULL);
    return check_done();
}
