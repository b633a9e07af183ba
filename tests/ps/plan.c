/*
 * ps_plan: what `ember ps --plan ROWS` predicts is what a table holding ROWS rows reports.
 * For tables with and without a reservation and a budget, of several row sizes, fills a real
 * emb_table with ROWS distinct keys and compares the plan's memory (mem_bytes, initial_bytes)
 * and row split (rows_in_memory, rows_spilled) with the table's own stats. The hash table's
 * bytes are exact (capacity x (record + ctrl byte)); a plan that assumed every table sat at its
 * maximum load factor was 30-70% low for a table that grew by doubling.
 */
#include "check.h"
#include "ps/ps.h"

static const char *dir;

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

typedef struct plan_case {
    uint32_t dim;
    emb_opt_kind opt;
    uint32_t n_sub; /* 0: the default */
    uint64_t rows, budget, reserve;
} plan_case;

static void check_case(const plan_case *pc)
{
    static ps_config c;
    ps_config_init(&c);
    c.n_tables = 1;
    snprintf(c.tables[0].name, sizeof c.tables[0].name, "t");
    emb_table_config *tc = &c.tables[0].cfg;
    emb_table_config_init(tc);
    tc->dim = pc->dim;
    tc->opt = pc->opt;
    tc->n_sub = pc->n_sub;
    tc->mem_budget_bytes = pc->budget;
    tc->reserve_rows = pc->reserve;
    if (pc->budget > 0) tc->spill_path = dir;
    ps_plan_row p;
    ps_plan(&c, 0, pc->rows, &p);

    emb_table *t = NULL;
    char *err = NULL;
    CHECK_OK(emb_table_create(tc, &t, &err), err);
    if (t == NULL) return;
    emb_table_stats s0;
    emb_table_stats_get(t, &s0);
    enum { BATCH = 4096 };
    uint64_t keys[BATCH];
    float *out = malloc(sizeof(float) * BATCH * pc->dim);
    for (uint64_t done = 0; done < pc->rows && out != NULL;) {
        size_t n = pc->rows - done < BATCH ? (size_t)(pc->rows - done) : BATCH;
        for (size_t i = 0; i < n; i++)
            keys[i] = mix(done + i + 77);
        CHECK_OK(emb_table_pull(t, keys, n, out, &err), err);
        done += n;
    }
    free(out);
    emb_table_stats s;
    emb_table_stats_get(t, &s);
    emb_table_destroy(t);

    char what[160];
    snprintf(what, sizeof what, "dim %u %s n_sub %u, %llu rows, budget %llu, reserve %llu", pc->dim,
             emb_opt_name(pc->opt), pc->n_sub, (unsigned long long)pc->rows,
             (unsigned long long)pc->budget, (unsigned long long)pc->reserve);
    CHECK_MSG((double)s0.bytes_mem == p.initial_bytes, "%s: start %llu bytes, plan %.0f", what,
              (unsigned long long)s0.bytes_mem, p.initial_bytes);
    /* Which sub-shards have doubled depends on how the keys fell; the plan gives the
     * expectation, and these keys land within 3% of it. */
    double rel = p.mem_bytes / (double)s.bytes_mem - 1;
    CHECK_MSG(fabs(rel) <= 0.03, "%s: table holds %llu bytes, plan says %.0f (%+.1f%%)", what,
              (unsigned long long)s.bytes_mem, p.mem_bytes, 100 * rel);
    if (pc->budget > 0) CHECK(s.bytes_mem <= pc->budget && p.mem_bytes <= (double)pc->budget);
    /* Spilling evicts in batches of 1/32 of a sub-shard, so memory holds up to that much less
     * than it can. */
    CHECK_MSG(s.rows_mem <= p.rows_in_memory && s.rows_mem >= p.rows_in_memory * 0.96,
              "%s: %llu rows in memory, plan %llu", what, (unsigned long long)s.rows_mem,
              (unsigned long long)p.rows_in_memory);
    CHECK(s.rows_mem + s.rows_spilled == pc->rows && p.rows_in_memory + p.rows_spilled == pc->rows);
}

int main(void)
{
    dir = check_tmpdir("ps_plan");
    const uint64_t R = 150000;
    const plan_case cases[] = {
        {8, EMB_OPT_SGD, 0, R, 0, 0},           /* grown by doubling, half full */
        {16, EMB_OPT_ADAGRAD, 0, 100000, 0, 0}, /* a few sub-shards past a doubling */
        {16, EMB_OPT_ADAGRAD_ROWWISE, 0, R, 0, 0},
        {16, EMB_OPT_ADAM, 0, R, 0, R},     /* reserved: never grows */
        {16, EMB_OPT_FTRL, 4, R, 0, R / 2}, /* reserved half, then doubles */
        {64, EMB_OPT_ADAM, 8, 40000, 0, 0},
        {16, EMB_OPT_ADAGRAD, 0, R, 64u << 20, 0}, /* a budget it never reaches */
        {16, EMB_OPT_ADAGRAD, 0, R, 8u << 20, 0},  /* spills */
        {8, EMB_OPT_SGD, 16, R, 4u << 20, R},      /* reserved past the budget */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        check_case(&cases[i]);
    return check_done();
}
