/*
 * emb_team: a table lent a team of threads (emb_table_set_team) fans a pull or push of at least
 * 4096 keys out over parts of whole sub-shards, and embedding.h promises the same bits as
 * without the team: rows, outputs and stats, a fanned push all or nothing and whole or absent
 * in a snapshot. Checked here:
 *  - same bits: two tables of one config, one with a team of 3 threads (16 parts) and one
 *    without, fed one sequence of large batches (16K to 24K keys from a skewed stream, so keys
 *    repeat within and across batches and many are new) and small ones (< 4096, not fanned):
 *    pull_hinted + push_hinted with the pull's hints (as the PS does), pull + push, a push of
 *    half new keys with stale hints, a lone pull. After every call the return codes, outputs,
 *    hints, stats (every field) and step must be equal; at the end every row (weights, state,
 *    updates, last_step). Configs: Adagrad with rows reserved; Adam over 100 sub-shards (parts
 *    of uneven size) starting small so pushes grow the sub-shards; admission (threshold 2: the
 *    sketch is shared by the sub-shards, so a pull fanned out admitted keys in the threads'
 *    order, different rows from run to run; such a pull now runs in one part); Adam with a TTL
 *    and expiry between calls over 7 sub-shards (fewer than the parts); row-wise Adagrad over 1
 *    sub-shard (one part: the team unused).
 *  - concurrency: 4 threads pull and push large batches of disjoint key sets on one table with
 *    a team; every output, and at the end every row (not last_step: the steps interleave), must
 *    equal the same per-thread sequences run one after another on a table without a team.
 *  - snapshots during fanned pushes: a thread pushes every one of its keys in each batch; every
 *    snapshot taken meanwhile must restore to rows that all have the MANIFEST step as their
 *    `updates`, and be, bit for bit, a table without a team after that many pushes.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#include "emb_util.h"

#define DIM 16u
#define TEAM_THREADS 3u
#define BIG_MIN 16384u
#define BIG_MAX 24576u
#define ROUNDS 36u
#define UNIVERSE 4000000u

static const char *g_dir;

/* ---- same bits, one sequence on two tables ---- */

#define STAT_FIELDS(X)                                                                             \
    X(rows_mem)                                                                                    \
    X(rows_spilled)                                                                                \
    X(bytes_mem)                                                                                   \
    X(bytes_budget)                                                                                \
    X(row_bytes)                                                                                   \
    X(step)                                                                                        \
    X(pulls)                                                                                       \
    X(pushes)                                                                                      \
    X(created)                                                                                     \
    X(admissions)                                                                                  \
    X(admit_rejects)                                                                               \
    X(push_dropped)                                                                                \
    X(spill_evictions)                                                                             \
    X(spill_loads)                                                                                 \
    X(ttl_evictions)                                                                               \
    X(bytes_spill_mem)

/* Fields that differ between the two tables' stats, printed (up to a few calls' worth). */
static int stats_diff(emb_table *a, emb_table *b, const char *ctx)
{
    static int printed;
    emb_table_stats sa = eu_stats(a), sb = eu_stats(b);
    int bad = 0;
#define X(f)                                                                                       \
    if (sa.f != sb.f) {                                                                            \
        if (printed < 10)                                                                          \
            fprintf(stderr, "  %s: stats.%s %" PRIu64 " with the team, %" PRIu64 " without\n",     \
                    ctx, #f, sa.f, sb.f);                                                          \
        bad++;                                                                                     \
    }
    STAT_FIELDS(X)
#undef X
    /* every field, should one be added without a line above */
    if (bad == 0 && memcmp(&sa, &sb, sizeof sa) != 0) bad++;
    printed += bad > 0;
    return bad;
}

typedef struct twins {
    emb_table *a, *b; /* a: with the team */
    const char *name;
    uint32_t round;
    uint32_t bad_calls;
    float *wa, *wb, *g;
    uint64_t *ha, *hb, *keys;
} twins;

static void call_failed(twins *tw, const char *what, const char *why)
{
    if (tw->bad_calls++ < 8)
        fprintf(stderr, "  %s round %u, %s: %s\n", tw->name, tw->round, what, why);
}

/* Checks the two calls' return codes, then the step and the stats. */
static void after_call(twins *tw, const char *what, int ra, char *ea, int rb, char *eb)
{
    if (ra != 0 || rb != 0) {
        char msg[512];
        snprintf(msg, sizeof msg, "rc %d (%s) with the team, %d (%s) without", ra, ea ? ea : "-",
                 rb, eb ? eb : "-");
        call_failed(tw, what, msg);
    }
    free(ea);
    free(eb);
    if (emb_table_step(tw->a) != emb_table_step(tw->b)) call_failed(tw, what, "steps differ");
    char ctx[128];
    snprintf(ctx, sizeof ctx, "%s round %u, %s", tw->name, tw->round, what);
    if (stats_diff(tw->a, tw->b, ctx) != 0) call_failed(tw, what, "stats differ");
}

static void twin_pull(twins *tw, size_t n, int hinted)
{
    /* one fill in both: an output a fanned pull left unwritten shows */
    memset(tw->wa, 0xa5, n * DIM * sizeof(float));
    memset(tw->wb, 0xa5, n * DIM * sizeof(float));
    char *ea = NULL, *eb = NULL;
    int ra, rb;
    if (hinted) {
        memset(tw->ha, 0x5a, n * sizeof(uint64_t));
        memset(tw->hb, 0x5a, n * sizeof(uint64_t));
        ra = emb_table_pull_hinted(tw->a, tw->keys, n, tw->wa, tw->ha, &ea);
        rb = emb_table_pull_hinted(tw->b, tw->keys, n, tw->wb, tw->hb, &eb);
    } else {
        ra = emb_table_pull(tw->a, tw->keys, n, tw->wa, &ea);
        rb = emb_table_pull(tw->b, tw->keys, n, tw->wb, &eb);
    }
    const char *what = hinted ? "pull_hinted" : "pull";
    after_call(tw, what, ra, ea, rb, eb);
    if (memcmp(tw->wa, tw->wb, n * DIM * sizeof(float)) != 0) {
        size_t i = 0;
        while (memcmp(tw->wa + i * DIM, tw->wb + i * DIM, DIM * sizeof(float)) == 0)
            i++;
        char msg[160];
        snprintf(msg, sizeof msg, "outputs differ (first at key %zu of %zu)", i, n);
        call_failed(tw, what, msg);
    }
    if (hinted && memcmp(tw->ha, tw->hb, n * sizeof(uint64_t)) != 0)
        call_failed(tw, what, "hints differ");
}

/* hints: 0 none, 1 each table's own from its last pull_hinted. */
static void twin_push(twins *tw, size_t n, int hinted)
{
    char *ea = NULL, *eb = NULL;
    int ra, rb;
    if (hinted) {
        ra = emb_table_push_hinted(tw->a, tw->keys, n, tw->g, tw->ha, &ea);
        rb = emb_table_push_hinted(tw->b, tw->keys, n, tw->g, tw->hb, &eb);
    } else {
        ra = emb_table_push(tw->a, tw->keys, n, tw->g, &ea);
        rb = emb_table_push(tw->b, tw->keys, n, tw->g, &eb);
    }
    after_call(tw, hinted ? "push_hinted" : "push", ra, ea, rb, eb);
}

typedef struct same_case {
    const char *name;
    emb_opt_kind opt;
    uint32_t n_sub;
    uint64_t reserve_rows;
    uint32_t admit;
    uint64_t ttl;
} same_case;

static void run_same_bits(const same_case *sc, cm_team *team)
{
    emb_table_config c = eu_config(sc->opt, DIM);
    c.n_sub = sc->n_sub;
    c.reserve_rows = sc->reserve_rows;
    c.admit_threshold = sc->admit;
    c.ttl_steps = sc->ttl;
    twins tw = {.name = sc->name};
    tw.a = eu_create(&c);
    tw.b = eu_create(&c);
    emb_table_set_team(tw.a, team);
    tw.wa = eu_xmalloc(BIG_MAX * DIM * sizeof(float));
    tw.wb = eu_xmalloc(BIG_MAX * DIM * sizeof(float));
    tw.g = eu_xmalloc(BIG_MAX * DIM * sizeof(float));
    tw.ha = eu_xmalloc(BIG_MAX * sizeof(uint64_t));
    tw.hb = eu_xmalloc(BIG_MAX * sizeof(uint64_t));
    tw.keys = eu_xmalloc(BIG_MAX * sizeof(uint64_t));
    for (uint32_t i = 0; i < BIG_MAX; i++)
        tw.ha[i] = tw.hb[i] = EMB_NO_HINT;
    uint64_t rng = 12345, fresh = 1ull << 40, expired = 0;
    for (tw.round = 0; tw.round < ROUNDS; tw.round++) {
        const uint32_t r = tw.round;
        size_t n = r % 4 == 3 ? 1 + (size_t)eu_below(&rng, 4095)
                              : BIG_MIN + (size_t)eu_below(&rng, BIG_MAX - BIG_MIN + 1);
        const int mode = r % 3;
        for (size_t i = 0; i < n; i++)
            tw.keys[i] = eu_key(mode == 2 && i % 2 ? fresh++ : eu_zipfish(&rng, UNIVERSE));
        if (mode == 2) {
            /* a push of half new keys (pushes create the rows), with the hints of the last
             * pull: stale, for other keys */
            for (size_t i = 0; i < n * DIM; i++)
                tw.g[i] = (float)(eu_unif(&rng) - 0.5);
            twin_push(&tw, n, 1);
            twin_pull(&tw, n, r % 2); /* a lone pull of the same keys */
        } else {
            twin_pull(&tw, n, mode == 0);
            for (size_t i = 0; i < n * DIM; i++)
                tw.g[i] = 0.5f * tw.wa[i] + (float)(eu_unif(&rng) - 0.5) * 0.1f;
            twin_push(&tw, n, mode == 0);
        }
        if (sc->ttl && r % 3 == 2) {
            uint64_t da = 0, db = 0;
            char *ea = NULL, *eb = NULL;
            int ra = emb_table_expire(tw.a, &da, &ea), rb = emb_table_expire(tw.b, &db, &eb);
            after_call(&tw, "expire", ra, ea, rb, eb);
            if (da != db) call_failed(&tw, "expire", "dropped counts differ");
            expired += da;
        }
    }
    CHECK_MSG(tw.bad_calls == 0, "%s: %u calls differ with the team", sc->name, tw.bad_calls);
    CHECK_MSG(eu_diff_tables(tw.a, tw.b, 1) == 0, "%s: rows differ with the team", sc->name);
    CHECK_MSG(stats_diff(tw.a, tw.b, sc->name) == 0, "%s: stats differ with the team", sc->name);
    CHECK(emb_table_step(tw.a) == emb_table_step(tw.b));
    CHECK(emb_table_step(tw.a) == ROUNDS);
    /* the config's feature took part */
    emb_table_stats s = eu_stats(tw.a);
    CHECK(s.created > (sc->admit ? 10000u : 100000u));
    if (sc->admit) CHECK(s.admissions > 0 && s.admit_rejects > 0 && s.push_dropped > 0);
    if (sc->ttl)
        CHECK_MSG(expired > 0 && s.ttl_evictions == expired, "%s: expired %" PRIu64, sc->name,
                  expired);
    if (sc->reserve_rows == 0)
        CHECK_MSG(s.bytes_mem > 4 * emb_table_initial_bytes(&c), "%s: did not grow", sc->name);
    else
        CHECK(s.bytes_mem == emb_table_initial_bytes(&c));
    emb_table_destroy(tw.a);
    emb_table_destroy(tw.b);
    free(tw.wa);
    free(tw.wb);
    free(tw.g);
    free(tw.ha);
    free(tw.hb);
    free(tw.keys);
}

/* ---- concurrency: disjoint key sets ---- */

#define NT 4u
#define C_ROUNDS 16u

typedef struct worker {
    emb_table *t;
    uint32_t tid;
    uint64_t sums[C_ROUNDS]; /* a hash of each pull's output */
} worker;

static uint64_t fnv(const void *p, size_t n)
{
    const uint8_t *b = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* One thread's fixed sequence over its own keys: eu_key is a bijection, and the thread id sits
 * above the Zipf index's bits. */
static void *worker_main(void *arg)
{
    worker *w = arg;
    uint64_t rng = 1000 + w->tid;
    uint64_t *keys = eu_xmalloc(BIG_MAX * sizeof *keys), *hints = eu_xmalloc(BIG_MAX * 8);
    float *out = eu_xmalloc(BIG_MAX * DIM * sizeof *out), *g = eu_xmalloc(BIG_MAX * DIM * 4);
    for (uint32_t r = 0; r < C_ROUNDS; r++) {
        size_t n = r % 4 == 3 ? 1 + (size_t)eu_below(&rng, 4095)
                              : BIG_MIN + (size_t)eu_below(&rng, BIG_MAX - BIG_MIN + 1);
        for (size_t i = 0; i < n; i++)
            keys[i] = eu_key((uint64_t)(w->tid + 1) << 48 | eu_zipfish(&rng, 400000));
        char *err = NULL;
        eu_tcheck(emb_table_pull_hinted(w->t, keys, n, out, hints, &err), err, "pull_hinted");
        w->sums[r] = fnv(out, n * DIM * sizeof *out);
        for (size_t i = 0; i < n * DIM; i++)
            g[i] = 0.5f * out[i] + (float)(eu_unif(&rng) - 0.5) * 0.1f;
        err = NULL;
        if (r % 2)
            eu_tcheck(emb_table_push_hinted(w->t, keys, n, g, hints, &err), err, "push_hinted");
        else
            eu_tcheck(emb_table_push(w->t, keys, n, g, &err), err, "push");
    }
    free(keys);
    free(hints);
    free(out);
    free(g);
    return NULL;
}

static void run_concurrent(emb_opt_kind opt, cm_team *team)
{
    emb_table_config c = eu_config(opt, DIM);
    emb_table *a = eu_create(&c), *b = eu_create(&c);
    emb_table_set_team(a, team);
    worker *wa = eu_xcalloc(NT, sizeof *wa), *wb = eu_xcalloc(NT, sizeof *wb);
    pthread_t th[NT];
    for (uint32_t i = 0; i < NT; i++) {
        wa[i].t = a;
        wa[i].tid = i;
        CHECK(pthread_create(&th[i], NULL, worker_main, &wa[i]) == 0);
    }
    for (uint32_t i = 0; i < NT; i++)
        pthread_join(th[i], NULL);
    for (uint32_t i = 0; i < NT; i++) {
        wb[i].t = b;
        wb[i].tid = i;
        worker_main(&wb[i]);
    }
    uint32_t bad = 0;
    for (uint32_t i = 0; i < NT; i++)
        for (uint32_t r = 0; r < C_ROUNDS; r++)
            bad += wa[i].sums[r] != wb[i].sums[r];
    CHECK_MSG(bad == 0, "%s: %u of %u concurrent pulls differ from one thread's", emb_opt_name(opt),
              bad, NT * C_ROUNDS);
    /* last_step follows the order in which the threads' pushes took their steps */
    CHECK_MSG(eu_diff_tables(a, b, 0) == 0, "%s: %u threads with a team differ from one",
              emb_opt_name(opt), NT);
    emb_table_stats sa = eu_stats(a), sb = eu_stats(b);
    CHECK(sa.step == NT * C_ROUNDS && sb.step == sa.step);
    CHECK(sa.pulls == sb.pulls && sa.pushes == sb.pushes && sa.created == sb.created &&
          sa.rows_mem == sb.rows_mem);
    emb_table_destroy(a);
    emb_table_destroy(b);
    free(wa);
    free(wb);
}

/* ---- snapshots during fanned pushes ---- */

#define S_KEYS 12000u
#define S_SNAPS 16u
#define S_MAX_PUSHES 1000u

/* Push p: every key once, in an order and with gradients fixed by p. */
static void snap_batch(uint32_t p, uint64_t *keys, float *g)
{
    uint64_t rng = 777 + p;
    for (uint32_t i = 0; i < S_KEYS; i++)
        keys[i] = eu_key(5000000u + i);
    for (uint32_t i = S_KEYS - 1; i > 0; i--) {
        uint32_t j = (uint32_t)eu_below(&rng, i + 1);
        uint64_t k = keys[i];
        keys[i] = keys[j];
        keys[j] = k;
    }
    for (uint32_t i = 0; i < S_KEYS * DIM; i++)
        g[i] = (float)(eu_unif(&rng) - 0.5);
}

typedef struct spusher {
    emb_table *t;
    atomic_int stop;
    atomic_uint pushes;
} spusher;

static void *spush_main(void *arg)
{
    spusher *sp = arg;
    uint64_t *keys = eu_xmalloc(S_KEYS * sizeof *keys);
    float *g = eu_xmalloc(S_KEYS * DIM * sizeof *g);
    for (uint32_t p = 0; p < S_MAX_PUSHES && !atomic_load(&sp->stop); p++) {
        snap_batch(p, keys, g);
        char *err = NULL;
        eu_tcheck(emb_table_push(sp->t, keys, S_KEYS, g, &err), err, "push during snapshots");
        atomic_fetch_add(&sp->pushes, 1);
    }
    free(keys);
    free(g);
    return NULL;
}

typedef struct cut {
    uint64_t rows, updates_min, updates_max;
} cut;

static int cut_cb(const emb_row *row, void *arg)
{
    cut *c = arg;
    c->rows++;
    if (row->updates < c->updates_min) c->updates_min = row->updates;
    if (row->updates > c->updates_max) c->updates_max = row->updates;
    return 0;
}

static void run_snapshots(cm_team *team)
{
    emb_table_config c = eu_config(EMB_OPT_ADAGRAD, DIM);
    emb_table *t = eu_create(&c);
    emb_table_set_team(t, team);
    spusher sp = {.t = t};
    atomic_init(&sp.stop, 0);
    atomic_init(&sp.pushes, 0);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, spush_main, &sp) == 0);
    char dir[S_SNAPS][4200];
    for (uint32_t s = 0; s < S_SNAPS; s++) {
        /* a push or two between snapshots, so that they cut different pushes */
        uint64_t from = emb_table_step(t);
        for (int i = 0; i < 20000 && emb_table_step(t) < from + 1 + s % 2; i++)
            sched_yield();
        snprintf(dir[s], sizeof dir[s], "%s/snap%u", g_dir, s);
        char *err = NULL;
        CHECK_OK(emb_table_snapshot(t, dir[s], &err), err);
    }
    atomic_store(&sp.stop, 1);
    pthread_join(th, NULL);
    const uint32_t pushes = atomic_load(&sp.pushes);
    CHECK(emb_table_step(t) == pushes);
    CHECK_MSG(pushes < S_MAX_PUSHES, "the pusher ran out of pushes before the snapshots ended");

    /* Each snapshot against a table without a team replaying its pushes (in step order). */
    emb_table *ref = eu_create(&c);
    uint64_t *keys = eu_xmalloc(S_KEYS * sizeof *keys);
    float *g = eu_xmalloc(S_KEYS * DIM * sizeof *g);
    uint32_t done = 0, bad = 0, distinct = 0;
    uint64_t last = UINT64_MAX;
    for (uint32_t s = 0; s < S_SNAPS; s++) {
        char *err = NULL;
        uint64_t step = 0;
        CHECK_OK(emb_snapshot_step(dir[s], &step, &err), err);
        cut k = {0, UINT64_MAX, 0};
        CHECK_OK(emb_snapshot_foreach(dir[s], cut_cb, &k, &err), err);
        int ok = step <= pushes && k.rows == (step ? S_KEYS : 0) &&
                 (step == 0 || (k.updates_min == step && k.updates_max == step));
        if (!ok && bad < 3)
            fprintf(stderr,
                    "  snapshot %u: step %" PRIu64 ", %" PRIu64 " rows with updates %" PRIu64
                    "..%" PRIu64 "\n",
                    s, step, k.rows, k.rows ? k.updates_min : 0, k.updates_max);
        bad += !ok;
        distinct += step != last;
        last = step;
        fprintf(stderr, "  snapshot %u at step %" PRIu64 " of %u\n", s, step, pushes);
        emb_table *back = NULL;
        CHECK_OK(emb_table_restore(dir[s], &c, &back, &err), err);
        if (back == NULL || !ok) {
            emb_table_destroy(back);
            continue;
        }
        CHECK(emb_table_step(back) == step);
        for (; done < step; done++) {
            snap_batch(done, keys, g);
            eu_push(ref, keys, S_KEYS, g);
        }
        CHECK_MSG(eu_diff_tables(back, ref, 1) == 0,
                  "snapshot %u (step %" PRIu64 ") is not the table after its pushes", s, step);
        emb_table_destroy(back);
    }
    CHECK_MSG(bad == 0, "%u of %u snapshots during fanned pushes are not a whole number of pushes",
              bad, S_SNAPS);
    CHECK_MSG(distinct >= S_SNAPS / 2, "only %u distinct snapshot steps", distinct);
    emb_table_destroy(ref);
    emb_table_destroy(t);
    free(keys);
    free(g);
}

int main(void)
{
    g_dir = check_tmpdir("emb_team");
    cm_team *team = NULL;
    char *err = NULL;
    CHECK_OK(cm_team_create(TEAM_THREADS, &team, &err), err);
    if (team == NULL) return check_done();

    static const same_case cases[] = {
        {"adagrad, reserved", EMB_OPT_ADAGRAD, 0, 400000, 0, 0},
        {"adam, 100 sub-shards, growing", EMB_OPT_ADAM, 100, 0, 0, 0},
        {"adagrad, admission 2", EMB_OPT_ADAGRAD, 0, 0, 2, 0},
        {"adam, ttl 4, 7 sub-shards", EMB_OPT_ADAM, 7, 0, 0, 4},
        {"adagrad_rowwise, 1 sub-shard", EMB_OPT_ADAGRAD_ROWWISE, 1, 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        fprintf(stderr, "same bits: %s\n", cases[i].name);
        run_same_bits(&cases[i], team);
    }
    fprintf(stderr, "concurrent callers, disjoint keys: adam\n");
    run_concurrent(EMB_OPT_ADAM, team);
    fprintf(stderr, "snapshots during fanned pushes\n");
    run_snapshots(team);

    eu_check_threads();
    cm_team_destroy(team);
    return check_done();
}
