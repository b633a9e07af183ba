/*
 * emb_reserve: a table created with reserve_rows allocates its hash table once (the bytes
 * emb_table_initial_bytes promises), takes that many rows without growing, still grows past
 * them, ends a training sequence with exactly the rows of a table that started small, and
 * never reserves more than its memory budget.
 */
#include "emb_util.h"

#define ROWS 60000u
#define BATCH 2000u

/* Pulls and pushes `rounds` batches of keys [0, n) in a fixed pseudo-random order into both
 * tables (b may be NULL), gradients from the pulled weights. */
static void train(emb_table *a, emb_table *b, uint32_t dim, uint64_t n, uint32_t rounds,
                  uint64_t seed)
{
    uint64_t *keys = eu_xmalloc(BATCH * sizeof *keys);
    float *wa = eu_xmalloc((size_t)BATCH * dim * sizeof(float));
    float *wb = eu_xmalloc((size_t)BATCH * dim * sizeof(float));
    float *g = eu_xmalloc((size_t)BATCH * dim * sizeof(float));
    for (uint32_t r = 0; r < rounds; r++) {
        for (uint64_t base = 0; base < n; base += BATCH) {
            size_t m = n - base < BATCH ? (size_t)(n - base) : BATCH;
            for (size_t i = 0; i < m; i++)
                keys[i] = eu_key((base + i) * 2654435761u % n + seed);
            eu_pull(a, keys, m, wa);
            if (b != NULL) {
                eu_pull(b, keys, m, wb);
                CHECK(memcmp(wa, wb, m * dim * sizeof(float)) == 0);
            }
            for (size_t i = 0; i < m * dim; i++)
                g[i] = 0.5f * wa[i] - 0.01f * (float)(i % 7);
            eu_push(a, keys, m, g);
            if (b != NULL) eu_push(b, keys, m, g);
        }
    }
    free(keys);
    free(wa);
    free(wb);
    free(g);
}

static void test_same_rows_no_growth(void)
{
    emb_table_config rc = eu_config(EMB_OPT_ADAGRAD, 16);
    rc.reserve_rows = ROWS;
    emb_table_config sc = eu_config(EMB_OPT_ADAGRAD, 16);
    emb_table *res = eu_create(&rc), *small = eu_create(&sc);
    uint64_t start = eu_stats(res).bytes_mem, small_start = eu_stats(small).bytes_mem;
    CHECK(start == emb_table_initial_bytes(&rc));
    CHECK(small_start == emb_table_initial_bytes(&sc));
    /* The reservation holds ROWS rows (record + ctrl byte each) at the load factor at most. */
    CHECK(start >= (uint64_t)(emb_row_mem_bytes(&rc) * ROWS));
    CHECK(small_start < start / 4);

    train(res, small, 16, ROWS, 3, 11);
    emb_table_stats s = eu_stats(res);
    CHECK(s.rows_mem == ROWS);
    CHECK(s.bytes_mem == start); /* never grew */
    CHECK(eu_stats(small).bytes_mem > small_start);
    CHECK(eu_diff_tables(res, small, 1) == 0);

    /* Past the reservation it grows like any table, and stays equal. */
    train(res, small, 16, 3 * ROWS, 1, 11);
    CHECK(eu_stats(res).rows_mem == 3 * ROWS);
    CHECK(eu_stats(res).bytes_mem > start);
    CHECK(eu_diff_tables(res, small, 1) == 0);
    emb_table_destroy(res);
    emb_table_destroy(small);
}

static void test_budget_caps(const char *dir)
{
    emb_table_config c = eu_config(EMB_OPT_SGD, 8);
    c.mem_budget_bytes = 1u << 20;
    c.spill_path = dir;
    c.reserve_rows = 100000000; /* ~6 GB of rows: far past the 1 MiB budget */
    uint64_t initial = emb_table_initial_bytes(&c);
    CHECK(initial <= c.mem_budget_bytes);
    CHECK(initial >= c.mem_budget_bytes / 2);
    emb_table *t = eu_create(&c);
    CHECK(eu_stats(t).bytes_mem == initial);
    train(t, NULL, 8, 40000, 1, 5); /* more than the budget holds: spills, never grows */
    emb_table_stats s = eu_stats(t);
    CHECK(s.rows_spilled > 0);
    CHECK(s.bytes_mem == initial);
    emb_table_destroy(t);
}

int main(void)
{
    const char *dir = check_tmpdir("emb_reserve");
    test_same_rows_no_growth();
    test_budget_caps(dir);
    cm_rmtree(dir, NULL);
    return check_done();
}
