/*
 * emb_ttl_stress: TTL expiry running against everything else at once, as the PS now runs it
 * (ps/server.c ttl_after_push): worker threads pulling and pushing (plain, with the hints of
 * their own pull, or with stale hints from an earlier pull of other keys), a thread calling
 * emb_table_expire over and over, and a thread taking snapshots into fresh directories, reading
 * them back, restoring some and walking the live table. Configurations: every optimizer, a small
 * memory budget (rows spill and load back all the time) or none, admission on or off.
 *
 * Gradients are all ones, l2 0 and init_scale 0, so every row of a table starts from the same
 * zeros (of either sign) and a row's whole content is a function of its update count u: ref[u],
 * computed by pushing one key u times into a private table. Invariants checked whatever the
 * interleaving:
 *  - every row anyone sees (live walk, snapshot file, restored table, get_row) is ref[updates]
 *    exactly: weights, optimizer state and update count belong to the same step;
 *  - a walk never finds a key twice, and rows_mem + rows_spilled is the row count a walk finds,
 *    which is created - ttl_evictions, and ttl_evictions is the sum of what expire reported;
 *  - a restored snapshot holds the rows its manifest counts, its stats agree, its step is the
 *    snapshot's;
 *  - each worker owns a few keys no other thread pushes (others do pull them): after each push
 *    its own row has exactly the updates it gave it, never more (a hinted push that wrote into
 *    a slot now holding another key would show here) and never fewer unless an expire call
 *    that could drop it (its step more than ttl past the row's last touch) has run; and the
 *    row's last_step never falls below the step of the push that last touched it.
 * Duration per configuration: EMB_STRESS_MS (default 600 ms).
 *
 * Then a deterministic single-thread check: the same sequence of pulls, pushes (some hinted)
 * and expire calls on a table with a small budget and on one without gives the same rows, the
 * same drop counts and the same stats.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#include "emb_util.h"

#define DIM 4u
#define NW 3u   /* worker threads */
#define OWN 12u /* keys each worker owns */
#define NF 24u  /* keys of a pull of other workers' keys */
#define SHARED 3000u
#define BATCH 48u
#define TTL 40u
#define UMAX 65536u /* ref rows computed; rows with more updates are not compared */

static const char *g_dir;
static atomic_uint g_errors; /* check.h's counters are not atomic: threads count here */

#define TFAIL(...)                                                                                 \
    do {                                                                                           \
        if (atomic_fetch_add(&g_errors, 1) < 20) {                                                 \
            fprintf(stderr, "  " __VA_ARGS__);                                                     \
            fputc('\n', stderr);                                                                   \
        }                                                                                          \
    } while (0)

static void tcheck(int rc, char *err, const char *what)
{
    if (rc != 0) TFAIL("%s rc=%d err=%s", what, rc, err ? err : "(none)");
    free(err);
}

typedef struct run {
    emb_table *t;
    emb_table_config cfg;
    uint32_t slots;
    float *ref; /* UMAX+1 rows of dim weights then slots state */
    atomic_int stop;
    /* The expire thread: busy while a call is in flight; gen counts finished calls; hi is the
     * largest table step read after a call returned, an upper bound of the steps calls used. */
    atomic_int busy;
    atomic_uint_fast64_t gen, hi, dropped, calls;
    atomic_uint_fast64_t snaps, restores, walks, rows_checked, hinted, beyond_ref;
    uint64_t owned[NW][OWN];
} run;

static uint64_t owned_key(uint32_t w, uint32_t i)
{
    return eu_key(1000000u + w * OWN + i);
}

/* ref[u] for u = 0..UMAX: the row one key has after u pushes of ones. */
static void build_ref(run *r)
{
    emb_table_config c = r->cfg;
    c.mem_budget_bytes = 0;
    c.spill_path = NULL;
    c.admit_threshold = 0;
    c.ttl_steps = 0;
    emb_table *t = eu_create(&c);
    size_t stride = DIM + r->slots;
    r->ref = eu_xmalloc((UMAX + 1) * stride * sizeof(float));
    uint64_t key = 42;
    float g[DIM], w[DIM];
    for (uint32_t j = 0; j < DIM; j++)
        g[j] = 1.0f;
    eu_pull(t, &key, 1, w);
    char *err = NULL;
    for (uint32_t u = 0; u <= UMAX; u++) {
        emb_row row;
        float *dst = r->ref + u * stride;
        CHECK_OK(emb_table_get_row(t, key, &row, dst, dst + DIM, &err), err);
        CHECK(row.updates == u);
        if (u < UMAX) CHECK_OK(emb_table_push(t, &key, 1, g, &err), err);
    }
    emb_table_destroy(t);
}

/* Float equality, element by element: init_scale 0 draws zeros of either sign, which every
 * step treats alike, so -0 and 0 count as equal; anything else must match exactly. */
static int same_floats(const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (a[i] != b[i]) return 0;
    return 1;
}

/* A row is ref[updates], exactly. */
static void check_row(run *r, const emb_row *row, const char *where)
{
    atomic_fetch_add(&r->rows_checked, 1);
    if (row->updates > UMAX) {
        atomic_fetch_add(&r->beyond_ref, 1);
        return;
    }
    const float *ref = r->ref + row->updates * (DIM + r->slots);
    if (!same_floats(row->weights, ref, DIM))
        TFAIL("%s: row %016" PRIx64 " with %" PRIu64 " updates: weights of another step (w0 %a, "
              "ref %a)",
              where, row->key, row->updates, (double)row->weights[0], (double)ref[0]);
    else if (!same_floats(row->state, ref + DIM, r->slots))
        TFAIL("%s: row %016" PRIx64 " with %" PRIu64 " updates: state of another step", where,
              row->key, row->updates);
}

/* ---- walks: every row consistent, no key twice ---- */

typedef struct walk {
    run *r;
    const char *where;
    uint64_t *keys;
    size_t n, cap;
} walk;

static int walk_cb(const emb_row *row, void *arg)
{
    walk *wk = arg;
    check_row(wk->r, row, wk->where);
    if (wk->n == wk->cap) {
        wk->cap = wk->cap ? 2 * wk->cap : 4096;
        uint64_t *k = realloc(wk->keys, wk->cap * sizeof *k);
        if (k == NULL) return CM_ENOMEM;
        wk->keys = k;
    }
    wk->keys[wk->n++] = row->key;
    return 0;
}

/* Rows the walk found; fails on a key seen twice. */
static uint64_t walk_end(walk *wk)
{
    if (wk->n > 1) qsort(wk->keys, wk->n, sizeof *wk->keys, cm_u64_cmp); /* keys NULL when empty */
    for (size_t i = 1; i < wk->n; i++)
        if (wk->keys[i] == wk->keys[i - 1])
            TFAIL("%s: key %016" PRIx64 " found twice", wk->where, wk->keys[i]);
    free(wk->keys);
    return wk->n;
}

static uint64_t walk_table(run *r, emb_table *t, const char *where)
{
    walk wk = {r, where, NULL, 0, 0};
    char *err = NULL;
    tcheck(emb_table_foreach(t, walk_cb, &wk, &err), err, "foreach");
    return walk_end(&wk);
}

/* ---- the expire thread ---- */

static void *expirer(void *arg)
{
    run *r = arg;
    while (!atomic_load(&r->stop)) {
        uint64_t dropped = 0;
        char *err = NULL;
        atomic_store(&r->busy, 1);
        int rc = emb_table_expire(r->t, &dropped, &err);
        uint64_t hi = emb_table_step(r->t);
        if (hi > atomic_load(&r->hi)) atomic_store(&r->hi, hi); /* the only writer */
        atomic_fetch_add(&r->gen, 1);
        atomic_store(&r->busy, 0);
        tcheck(rc, err, "expire");
        atomic_fetch_add(&r->dropped, dropped);
        atomic_fetch_add(&r->calls, 1);
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

/* Whether an expire call that has run (or was running) could have dropped a row last touched
 * at step last: its step exceeded last + ttl. Waits for a call in flight to finish. */
static int expiry_could_drop(run *r, uint64_t last)
{
    uint64_t g0 = atomic_load(&r->gen);
    while (atomic_load(&r->busy) && atomic_load(&r->gen) == g0)
        sched_yield();
    return atomic_load(&r->hi) > last + TTL;
}

/* ---- the snapshot thread ---- */

static void check_restore(run *r, const char *snap, uint64_t rows, uint64_t step, uint64_t n)
{
    char spill[4300];
    emb_table_config c = r->cfg;
    if (c.mem_budget_bytes) {
        snprintf(spill, sizeof spill, "%s/restore_spill", g_dir);
        c.spill_path = spill;
    }
    emb_table *t = NULL;
    char *err = NULL;
    int rc = emb_table_restore(snap, &c, &t, &err);
    tcheck(rc, err, "restore");
    if (rc != 0) return;
    uint64_t found = walk_table(r, t, "restored table");
    emb_table_stats s = eu_stats(t);
    if (found != rows || s.rows_mem + s.rows_spilled != rows || s.step != step)
        TFAIL("snapshot %" PRIu64 ": restored %" PRIu64 " rows (stats %" PRIu64 " + %" PRIu64
              ", step %" PRIu64 "), snapshot has %" PRIu64 " at step %" PRIu64,
              n, found, s.rows_mem, s.rows_spilled, s.step, rows, step);
    emb_table_destroy(t);
    atomic_fetch_add(&r->restores, 1);
}

static void *snapshotter(void *arg)
{
    run *r = arg;
    for (uint64_t n = 0; !atomic_load(&r->stop); n++) {
        if (n % 2 == 1) { /* the live table, paused by the walk */
            walk_table(r, r->t, "live walk");
            atomic_fetch_add(&r->walks, 1);
            continue;
        }
        char snap[4300];
        snprintf(snap, sizeof snap, "%s/snap-%" PRIu64, g_dir, n);
        char *err = NULL;
        int rc = emb_table_snapshot(r->t, snap, &err);
        tcheck(rc, err, "snapshot");
        if (rc != 0) continue;
        atomic_fetch_add(&r->snaps, 1);
        walk wk = {r, "snapshot file", NULL, 0, 0};
        err = NULL;
        tcheck(emb_snapshot_foreach(snap, walk_cb, &wk, &err), err, "snapshot_foreach");
        uint64_t rows = walk_end(&wk), step = 0;
        err = NULL;
        tcheck(emb_snapshot_step(snap, &step, &err), err, "snapshot_step");
        if (n % 6 == 0) check_restore(r, snap, rows, step, n);
        cm_rmtree(snap, NULL);
    }
    return NULL;
}

/* ---- workers ---- */

typedef struct worker {
    run *r;
    uint32_t id;
    /* what this worker last saw of each owned key (get_row after its push) */
    int present[OWN];
    uint64_t prev_u[OWN], prev_last[OWN];
} worker;

/* After a push that named owned key i d times (the push's step above step_before). */
static void check_owned(worker *w, uint32_t i, uint32_t d, uint64_t step_before)
{
    run *r = w->r;
    uint64_t key = r->owned[w->id][i];
    emb_row row;
    float wt[DIM], st[2 * DIM];
    char *err = NULL;
    int rc = emb_table_get_row(r->t, key, &row, wt, st, &err);
    if (rc != 0 && rc != CM_ENOTFOUND) {
        tcheck(rc, err, "get_row");
        return;
    }
    free(err);
    int found = rc == 0;
    if (found) check_row(r, &row, "get_row");
    uint64_t base = w->present[i] ? w->prev_u[i] : 0;
    /* A loss needs an expire call past the row's last touch: what this worker saw last, or, for a
     * row it did not see, the pull that came before this push. A key not admitted yet may also
     * have had this push dropped. */
    uint64_t last = w->present[i] ? w->prev_last[i] : step_before;
    int may_lose = (!w->present[i] && r->cfg.admit_threshold > 1);
    if (found && row.updates > base + d) {
        TFAIL("owned key %016" PRIx64 ": %" PRIu64 " updates, its owner gave it %" PRIu64
              " (a push of another key wrote into its row)",
              key, row.updates, base + d);
    } else if (found && row.updates == base + d) {
        if (d > 0 && row.last_step <= step_before)
            TFAIL("owned key %016" PRIx64 ": last_step %" PRIu64 " after a push at a step above "
                  "%" PRIu64 " (a concurrent call set it back)",
                  key, row.last_step, step_before);
    } else if (!found && !w->present[i] && d == 0) {
        /* never held, not pushed now: nothing to lose */
    } else if (!may_lose && !expiry_could_drop(r, last)) {
        TFAIL("owned key %016" PRIx64 ": %s with %" PRIu64 " updates expected, last touched at "
              "step %" PRIu64 ", and no expire call went past step %" PRIu64,
              key, found ? "fewer updates" : "row gone", base + d, last, last + TTL);
    }
    w->present[i] = found;
    w->prev_u[i] = found ? row.updates : 0;
    w->prev_last[i] = found ? row.last_step : 0;
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    run *r = w->r;
    uint64_t rng = 0x1234 + w->id * 7919u + r->cfg.opt * 104729u;
    uint64_t keys[BATCH], hints[BATCH], old_hints[BATCH], foreign[NF];
    uint32_t times[OWN];
    float out[BATCH * DIM], g[BATCH * DIM], fout[NF * DIM];
    for (uint32_t j = 0; j < BATCH * DIM; j++)
        g[j] = 1.0f;
    for (uint32_t j = 0; j < BATCH; j++)
        old_hints[j] = EMB_NO_HINT;
    for (uint64_t it = 0; !atomic_load(&r->stop); it++) {
        memset(times, 0, sizeof times);
        size_t n = 0;
        uint32_t n_own = 1 + (uint32_t)eu_below(&rng, 6);
        for (uint32_t j = 0; j < n_own; j++) { /* duplicates allowed: applied in order */
            uint32_t i = (uint32_t)eu_below(&rng, OWN);
            times[i]++;
            keys[n++] = r->owned[w->id][i];
        }
        while (n < BATCH)
            keys[n++] = eu_key(eu_zipfish(&rng, SHARED));
        for (size_t j = n - 1; j > 0; j--) { /* owned keys anywhere in the batch */
            size_t k = eu_below(&rng, j + 1);
            uint64_t x = keys[j];
            keys[j] = keys[k];
            keys[k] = x;
        }
        uint64_t step_before = emb_table_step(r->t);
        int mode = (int)(it % 3); /* 0 plain, 1 own hints, 2 hints of the previous pull */
        char *err = NULL;
        if (mode == 0)
            tcheck(emb_table_pull(r->t, keys, n, out, &err), err, "pull");
        else
            tcheck(emb_table_pull_hinted(r->t, keys, n, out, hints, &err), err, "pull_hinted");
        for (size_t j = 0; j < n; j++) /* one row's elements all take the same steps */
            for (uint32_t e = 1; e < DIM; e++)
                if (out[j * DIM + e] != out[j * DIM])
                    TFAIL("pull of %016" PRIx64 ": elements differ (a torn row): %a %a", keys[j],
                          (double)out[j * DIM], (double)out[j * DIM + e]);
        if (eu_below(&rng, 4) == 0) sched_yield(); /* let hints go stale */
        err = NULL;
        if (mode == 0) {
            tcheck(emb_table_push(r->t, keys, n, g, &err), err, "push");
        } else {
            tcheck(emb_table_push_hinted(r->t, keys, n, g, mode == 1 ? hints : old_hints, &err),
                   err, "push_hinted");
            atomic_fetch_add(&r->hinted, 1);
            memcpy(old_hints, hints, sizeof hints);
        }
        for (uint32_t i = 0; i < OWN; i++)
            if (times[i] || eu_below(&rng, 8) == 0) check_owned(w, i, times[i], step_before);
        /* Pull and look up other workers' keys: calls that race with their owners' pushes (a pull
         * of many groups reads the step long before it reaches the last one). */
        for (uint32_t j = 0; j < NF; j++)
            foreign[j] = r->owned[eu_below(&rng, NW)][eu_below(&rng, OWN)];
        err = NULL;
        tcheck(emb_table_pull(r->t, foreign, NF, fout, &err), err, "pull foreign");
        err = NULL;
        tcheck(emb_table_lookup(r->t, foreign, NF, fout, NULL, &err), err, "lookup");
    }
    return NULL;
}

/* ---- one configuration ---- */

static unsigned g_ms = 600;

static void stress(emb_opt_kind opt, int budget, int admit)
{
    run *r = eu_xcalloc(1, sizeof *r);
    emb_table_config c = eu_config(opt, DIM);
    c.lr = opt == EMB_OPT_SGD ? 1.0f : 0.05f; /* SGD: weight = -updates exactly */
    c.init_scale = 0.0f;
    c.ttl_steps = TTL;
    c.n_sub = 8;
    c.admit_threshold = admit ? 2 : 0;
    char spill[4300];
    if (budget) {
        snprintf(spill, sizeof spill, "%s/spill", g_dir);
        /* a few hundred rows in memory out of the thousands touched */
        c.mem_budget_bytes = (uint64_t)(400 * emb_row_mem_bytes(&c));
        if (c.mem_budget_bytes < (uint64_t)c.n_sub * 2 * (emb_row_bytes(&c) + 1))
            c.mem_budget_bytes = (uint64_t)c.n_sub * 2 * (emb_row_bytes(&c) + 1);
        c.spill_path = spill;
    }
    r->cfg = c;
    r->slots = emb_row_slots(&c);
    build_ref(r);
    r->t = eu_create(&c);
    for (uint32_t w = 0; w < NW; w++)
        for (uint32_t i = 0; i < OWN; i++)
            r->owned[w][i] = owned_key(w, i);
    atomic_store(&g_errors, 0);
    pthread_t th[NW + 2];
    worker wk[NW];
    memset(wk, 0, sizeof wk);
    for (uint32_t w = 0; w < NW; w++) {
        wk[w].r = r;
        wk[w].id = w;
        CHECK(pthread_create(&th[w], NULL, worker_main, &wk[w]) == 0);
    }
    CHECK(pthread_create(&th[NW], NULL, expirer, r) == 0);
    CHECK(pthread_create(&th[NW + 1], NULL, snapshotter, r) == 0);
    struct timespec ts = {g_ms / 1000, (long)(g_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    atomic_store(&r->stop, 1);
    for (uint32_t i = 0; i < NW + 2; i++)
        pthread_join(th[i], NULL);

    /* Quiescent: the counts must add up. */
    uint64_t found = walk_table(r, r->t, "final walk");
    emb_table_stats s = eu_stats(r->t);
    uint64_t dropped = atomic_load(&r->dropped);
    CHECK_MSG(s.rows_mem + s.rows_spilled == found,
              "rows_mem %" PRIu64 " + rows_spilled %" PRIu64 " != %" PRIu64 " rows walked",
              s.rows_mem, s.rows_spilled, found);
    CHECK_MSG(s.created - s.ttl_evictions == found,
              "created %" PRIu64 " - ttl_evictions %" PRIu64 " != %" PRIu64 " rows walked",
              s.created, s.ttl_evictions, found);
    CHECK_MSG(s.ttl_evictions == dropped,
              "ttl_evictions %" PRIu64 " != %" PRIu64 " rows expire calls reported",
              s.ttl_evictions, dropped);
    CHECK_MSG(atomic_load(&g_errors) == 0, "%u failures in threads", atomic_load(&g_errors));
    CHECK(atomic_load(&r->calls) > 0 && dropped > 0);
    if (budget) CHECK(s.spill_evictions > 0 && s.spill_loads > 0);
    fprintf(stderr,
            "%-15s budget %d admit %d: step %" PRIu64 ", %" PRIu64 " expire calls dropped %" PRIu64
            ", %" PRIu64 " snapshots, %" PRIu64 " restores, %" PRIu64 " walks, %" PRIu64
            " hinted pushes, %" PRIu64 " rows checked (%" PRIu64 " past ref), spill %" PRIu64
            " out %" PRIu64 " in, %" PRIu64 " rows at end\n",
            emb_opt_name(opt), budget, admit, s.step, atomic_load(&r->calls), dropped,
            atomic_load(&r->snaps), atomic_load(&r->restores), atomic_load(&r->walks),
            atomic_load(&r->hinted), atomic_load(&r->rows_checked), atomic_load(&r->beyond_ref),
            s.spill_evictions, s.spill_loads, found);
    emb_table_destroy(r->t);
    free(r->ref);
    free(r);
}

/* ---- deterministic: expiry with spill gives the rows of expiry without ---- */

static void same_with_spill(emb_opt_kind opt, int admit, uint64_t ttl)
{
    emb_table_config c = eu_config(opt, DIM);
    c.ttl_steps = ttl;
    c.n_sub = 4;
    c.admit_threshold = admit ? 3 : 0;
    char spill[4300];
    snprintf(spill, sizeof spill, "%s/same_spill", g_dir);
    emb_table_config cs = c;
    cs.mem_budget_bytes = (uint64_t)(200 * emb_row_mem_bytes(&c));
    cs.spill_path = spill;
    emb_table *t[2] = {eu_create(&c), eu_create(&cs)};
    uint64_t rng = 99 + opt, keys[64], hints[2][64];
    float out[2][64 * DIM], g[64 * DIM];
    uint64_t drops = 0;
    for (uint32_t it = 0; it < 1500; it++) {
        size_t n = 1 + eu_below(&rng, 64);
        /* a moving window of keys: old ones go cold and expire, some come back */
        uint64_t base = it / 3;
        for (size_t j = 0; j < n; j++)
            keys[j] = eu_key(base + eu_zipfish(&rng, 2000));
        for (size_t j = 0; j < n * DIM; j++)
            g[j] = (float)(eu_unif(&rng) - 0.5);
        int hinted = it % 2;
        for (int k = 0; k < 2; k++) {
            char *err = NULL;
            if (hinted) {
                CHECK_OK(emb_table_pull_hinted(t[k], keys, n, out[k], hints[k], &err), err);
                CHECK_OK(emb_table_push_hinted(t[k], keys, n, g, hints[k], &err), err);
            } else {
                CHECK_OK(emb_table_pull(t[k], keys, n, out[k], &err), err);
                CHECK_OK(emb_table_push(t[k], keys, n, g, &err), err);
            }
        }
        CHECK(memcmp(out[0], out[1], n * DIM * sizeof(float)) == 0);
        if (it % 7 == 0) {
            uint64_t d[2];
            for (int k = 0; k < 2; k++) {
                char *err = NULL;
                CHECK_OK(emb_table_expire(t[k], &d[k], &err), err);
            }
            CHECK_MSG(d[0] == d[1],
                      "%s ttl %" PRIu64 ": expire at %u dropped %" PRIu64 " in memory, %" PRIu64
                      " with spill",
                      emb_opt_name(opt), ttl, it, d[0], d[1]);
            drops += d[0];
        }
    }
    CHECK_MSG(eu_diff_tables(t[0], t[1], 1) == 0, "%s admit %d: expiry with spill differs",
              emb_opt_name(opt), admit);
    emb_table_stats s0 = eu_stats(t[0]), s1 = eu_stats(t[1]);
    CHECK(s1.spill_evictions > 0 && drops > 0);
    CHECK(s0.ttl_evictions == s1.ttl_evictions && s0.created == s1.created);
    CHECK(s0.rows_mem == s1.rows_mem + s1.rows_spilled);
    CHECK(s0.admissions == s1.admissions && s0.push_dropped == s1.push_dropped);
    emb_table_destroy(t[0]);
    emb_table_destroy(t[1]);
}

int main(void)
{
    g_dir = check_tmpdir("emb_ttl_stress");
    const char *ms = getenv("EMB_STRESS_MS");
    if (ms != NULL && atoi(ms) > 0) g_ms = (unsigned)atoi(ms);
    for (int opt = EMB_OPT_SGD; opt <= EMB_OPT_FTRL; opt++)
        for (int admit = 0; admit < 2; admit++)
            same_with_spill((emb_opt_kind)opt, admit, 25);
    /* ttl 200: steps in buckets of 3, the spilled rows' counts in a ring that wraps */
    same_with_spill(EMB_OPT_ADAGRAD, 0, 200);
    same_with_spill(EMB_OPT_SGD, 1, 200);
    /* each optimizer at least once; SGD in all four storage x admission settings */
    static const struct {
        emb_opt_kind opt;
        int budget, admit;
    } cfgs[] = {
        {EMB_OPT_SGD, 1, 0},  {EMB_OPT_SGD, 0, 0},     {EMB_OPT_SGD, 1, 1},
        {EMB_OPT_SGD, 0, 1},  {EMB_OPT_ADAGRAD, 1, 0}, {EMB_OPT_ADAGRAD_ROWWISE, 0, 1},
        {EMB_OPT_ADAM, 1, 1}, {EMB_OPT_FTRL, 1, 0},    {EMB_OPT_FTRL, 0, 0},
    };
    int rounds = 1;
    const char *rs = getenv("EMB_STRESS_ROUNDS");
    if (rs != NULL && atoi(rs) > 0) rounds = atoi(rs);
    for (int k = 0; k < rounds; k++)
        for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++)
            stress(cfgs[i].opt, cfgs[i].budget, cfgs[i].admit);
    return check_done();
}
