/*
 * emb_spill: a table whose memory budget is ~10% of what its rows need (the rest spilled to
 * RocksDB) must end a long training sequence with exactly the rows of the same table held fully
 * in memory. Every pull is compared bit for bit between the two as it happens, and gradients
 * are computed from the pulled weights, so a wrong read anywhere changes everything after it.
 * Also: pushes given slot hints (hinted below) end exactly like plain ones.
 */
#include "emb_util.h"

#define NKEYS 200000u
#define BATCH 4096u
#define STEPS 60u

typedef struct pair {
    emb_table *full, *spill;
    uint32_t dim;
    float *out_full, *out_spill, *grads;
    uint64_t pull_mismatch;
} pair;

/* Pulls the same keys from both tables and records any difference in what they return. */
static void pull_both(pair *p, const uint64_t *keys, size_t n)
{
    eu_pull(p->full, keys, n, p->out_full);
    eu_pull(p->spill, keys, n, p->out_spill);
    p->pull_mismatch += memcmp(p->out_full, p->out_spill, n * p->dim * sizeof(float)) != 0;
}

static void run(emb_opt_kind opt, uint32_t dim, const char *dir, uint64_t seed)
{
    emb_table_config c = eu_config(opt, dim);
    c.lr = 0.02f;
    c.l2 = 1e-4f;
    const uint64_t budget = (uint64_t)(0.10 * NKEYS * emb_row_mem_bytes(&c));
    char path[4200];
    snprintf(path, sizeof path, "%s/spill_%s_%u", dir, emb_opt_name(opt), dim);
    emb_table_config cs = c;
    cs.mem_budget_bytes = budget;
    cs.spill_path = path;
    pair p = {.full = eu_create(&c), .spill = eu_create(&cs), .dim = dim};
    fprintf(stderr, "spill %s dim %u: budget %" PRIu64 " bytes for %u rows of %.1f bytes\n",
            emb_opt_name(opt), dim, budget, NKEYS, emb_row_mem_bytes(&c));
    p.out_full = eu_xmalloc((size_t)BATCH * dim * sizeof(float));
    p.out_spill = eu_xmalloc((size_t)BATCH * dim * sizeof(float));
    p.grads = eu_xmalloc((size_t)BATCH * dim * sizeof(float));
    uint64_t *keys = eu_xmalloc(NKEYS * sizeof *keys);

    /* first touch of every key, in a shuffled order: creates all rows, forces evictions */
    for (uint32_t i = 0; i < NKEYS; i++) keys[i] = eu_key(i);
    for (uint32_t i = NKEYS - 1; i > 0; i--) {
        uint32_t j = (uint32_t)eu_below(&seed, i + 1);
        uint64_t tmp = keys[i];
        keys[i] = keys[j];
        keys[j] = tmp;
    }
    for (uint32_t i = 0; i < NKEYS; i += BATCH)
        pull_both(&p, keys + i, NKEYS - i < BATCH ? NKEYS - i : BATCH);

    /* training: Zipf-like keys (duplicates included), gradients from the pulled weights */
    uint64_t batch[BATCH];
    for (uint32_t step = 0; step < STEPS; step++) {
        int uniform = step % 10 == 9; /* now and then a cold, uniform batch: mostly spilled rows */
        for (uint32_t i = 0; i < BATCH; i++)
            batch[i] = eu_key(uniform ? eu_below(&seed, NKEYS) : eu_zipfish(&seed, NKEYS));
        pull_both(&p, batch, BATCH);
        for (size_t i = 0; i < (size_t)BATCH * dim; i++)
            p.grads[i] = 0.5f * p.out_full[i] + (float)(eu_unif(&seed) - 0.5);
        eu_push(p.full, batch, BATCH, p.grads);
        eu_push(p.spill, batch, BATCH, p.grads);
    }
    CHECK_MSG(p.pull_mismatch == 0, "%" PRIu64 " pulls returned different weights", p.pull_mismatch);

    emb_table_stats sf = eu_stats(p.full), ss = eu_stats(p.spill);
    fprintf(stderr, "  spill table: %" PRIu64 " rows in memory, %" PRIu64 " spilled, %" PRIu64
            " evictions, %" PRIu64 " loads, %" PRIu64 " of %" PRIu64 " bytes\n",
            ss.rows_mem, ss.rows_spilled, ss.spill_evictions, ss.spill_loads, ss.bytes_mem, budget);
    CHECK(sf.rows_mem == NKEYS && sf.rows_spilled == 0 && sf.spill_evictions == 0);
    CHECK(ss.rows_spilled > 0 && ss.spill_evictions > 0 && ss.spill_loads > 0);
    CHECK_MSG(ss.bytes_mem <= budget, "bytes_mem %" PRIu64 " > budget %" PRIu64, ss.bytes_mem, budget);
    CHECK(ss.bytes_budget == budget && sf.bytes_budget == 0);
    CHECK(ss.rows_mem + ss.rows_spilled == NKEYS && ss.created == NKEYS && sf.created == NKEYS);
    CHECK(ss.step == sf.step && ss.step == STEPS);
    CHECK(ss.row_bytes == emb_row_bytes(&c));
    /* both directions: the walk reads spilled rows in one, get_row reads them in the other */
    CHECK_MSG(eu_diff_tables(p.spill, p.full, 1) == 0, "spilled table differs from in-memory one");
    CHECK_MSG(eu_diff_tables(p.full, p.spill, 1) == 0, "in-memory table differs from spilled one");
    emb_table_stats after = eu_stats(p.spill);
    CHECK_MSG(after.bytes_mem <= budget, "bytes_mem over budget after reads");

    emb_table_destroy(p.full);
    emb_table_destroy(p.spill);
    CHECK_MSG(access(path, F_OK) != 0, "destroy left the spill database at %s", path);
    free(p.out_full);
    free(p.out_spill);
    free(p.grads);
    free(keys);
}

/* A batch as a server receives one: n sorted distinct keys (fewer when draws repeat). */
static size_t sorted_batch(uint64_t *batch, size_t n, uint64_t *seed, int uniform)
{
    for (size_t i = 0; i < n; i++)
        batch[i] = eu_key(uniform ? eu_below(seed, NKEYS) : eu_zipfish(seed, NKEYS));
    qsort(batch, n, sizeof *batch, cm_u64_cmp);
    size_t u = 0;
    for (size_t i = 0; i < n; i++)
        if (u == 0 || batch[u - 1] != batch[i]) batch[u++] = batch[i];
    return u;
}

/*
 * Slot hints (emb_table_pull_hinted / emb_table_push_hinted): a table pushed with the hints of
 * its pulls must end exactly like one pushed plainly, whatever moved rows between the pull and
 * the push: rows created (the sub-shards grow and rehash), evicted to the spill store and loaded
 * back (deletion shifts clusters), expired by TTL, replaced by put_row; hints taken from another
 * table; garbage hints. A push applied through a stale hint lands on another key's row (or a
 * freed slot) and shows as a row that differs.
 */
static void hinted(const char *dir, uint64_t seed)
{
    const uint32_t dim = 8;
    emb_table_config c = eu_config(EMB_OPT_ADAGRAD, dim);
    c.lr = 0.02f;
    c.ttl_steps = 40;
    char pa[4200], pb[4200], pc[4200];
    snprintf(pa, sizeof pa, "%s/hint_plain", dir);
    snprintf(pb, sizeof pb, "%s/hint_hinted", dir);
    snprintf(pc, sizeof pc, "%s/hint_other", dir);
    emb_table_config ca = c, cb = c, cc = c;
    ca.mem_budget_bytes = cb.mem_budget_bytes = cc.mem_budget_bytes =
        (uint64_t)(0.10 * NKEYS * emb_row_mem_bytes(&c));
    ca.spill_path = pa;
    cb.spill_path = pb;
    cc.spill_path = pc;
    emb_table *a = eu_create(&ca), *b = eu_create(&cb), *other = eu_create(&cc);
    float *oa = eu_xmalloc((size_t)BATCH * dim * sizeof(float));
    float *ob = eu_xmalloc((size_t)BATCH * dim * sizeof(float));
    float *g = eu_xmalloc((size_t)BATCH * dim * sizeof(float));
    float *ocold = eu_xmalloc((size_t)BATCH * dim * sizeof(float));
    uint64_t *batch = eu_xmalloc(BATCH * sizeof *batch), *cold = eu_xmalloc(BATCH * sizeof *cold);
    uint64_t *hints = eu_xmalloc(BATCH * sizeof *hints);
    uint64_t pull_mismatch = 0, dropped_a = 0, dropped_b = 0;
    char *err = NULL;
    for (uint32_t step = 0; step < 3 * STEPS; step++) {
        size_t n = sorted_batch(batch, BATCH, &seed, 0);
        eu_pull(a, batch, n, oa);
        CHECK_OK(emb_table_pull_hinted(b, batch, n, ob, hints, &err), err);
        pull_mismatch += memcmp(oa, ob, n * dim * sizeof(float)) != 0;
        switch (step % 6) {
        case 0: /* nothing in between: every hint holds */
            break;
        case 1: /* cold rows created or loaded: growth, evictions, loads */
        case 2: {
            size_t m = sorted_batch(cold, BATCH, &seed, 1);
            eu_pull(a, cold, m, ocold);
            eu_pull(b, cold, m, ocold);
            break;
        }
        case 3: { /* TTL drops rows (a push step apart keeps some batch rows stale) */
            uint64_t da = 0, db = 0;
            CHECK_OK(emb_table_expire(a, &da, &err), err);
            CHECK_OK(emb_table_expire(b, &db, &err), err);
            dropped_a += da;
            dropped_b += db;
            break;
        }
        case 4: { /* whole rows replaced */
            eu_row r;
            for (size_t i = 0; i < n; i += 7) {
                if (!eu_get(a, batch[i], &r)) continue;
                emb_row row = {batch[i], r.updates + 1, r.last_step, r.w, r.s};
                CHECK_OK(emb_table_put_row(a, &row, &err), err);
                CHECK_OK(emb_table_put_row(b, &row, &err), err);
            }
            break;
        }
        case 5: /* hints that are not this table's: another table's, then garbage */
            CHECK_OK(emb_table_pull_hinted(other, batch, n, ob, hints, &err), err);
            for (size_t i = 0; i < n; i += 3)
                hints[i] = i % 2 ? eu_rand(&seed) : eu_below(&seed, 4 * NKEYS / 64);
            break;
        }
        for (size_t i = 0; i < n * dim; i++)
            g[i] = 0.5f * oa[i] + (float)(eu_unif(&seed) - 0.5);
        eu_push(a, batch, n, g);
        CHECK_OK(emb_table_push_hinted(b, batch, n, g, hints, &err), err);
    }
    CHECK_MSG(pull_mismatch == 0, "%" PRIu64 " hinted pulls returned different weights",
              pull_mismatch);
    emb_table_stats sa = eu_stats(a), sb = eu_stats(b);
    fprintf(stderr,
            "hints: %" PRIu64 " rows, %" PRIu64 " spilled, %" PRIu64 " evictions, %" PRIu64
            " loads, %" PRIu64 " expired\n",
            sb.rows_mem, sb.rows_spilled, sb.spill_evictions, sb.spill_loads, dropped_b);
    CHECK(sb.spill_evictions > 0 && sb.spill_loads > 0 && dropped_b > 0);
    CHECK(dropped_a == dropped_b && sa.pushes == sb.pushes && sa.created == sb.created &&
          sa.spill_evictions == sb.spill_evictions && sa.spill_loads == sb.spill_loads &&
          sa.rows_mem == sb.rows_mem && sa.rows_spilled == sb.rows_spilled && sa.step == sb.step);
    CHECK_MSG(eu_diff_tables(a, b, 1) == 0, "hinted table differs from the plain one");
    CHECK_MSG(eu_diff_tables(b, a, 1) == 0, "plain table differs from the hinted one");
    emb_table_destroy(a);
    emb_table_destroy(b);
    emb_table_destroy(other);
    free(oa);
    free(ob);
    free(g);
    free(ocold);
    free(batch);
    free(cold);
    free(hints);
}

int main(void)
{
    const char *dir = check_tmpdir("emb_spill");
    hinted(dir, 3);
    run(EMB_OPT_ADAGRAD, 8, dir, 1);
    run(EMB_OPT_ADAM, 16, dir, 2);
    cm_rmtree(dir, NULL);
    return check_done();
}
