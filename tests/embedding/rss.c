/*
 * emb_rss: the memory a table reports is the memory the process spends on it. Fills tables with
 * and without a reservation and with a budget, and checks the process's resident anonymous
 * memory (RssAnon) against emb_table_stats: growth tracks bytes_mem (the hash tables are all
 * a table allocates per row), and a table eight times its budget stays within the budget plus
 * what its spill store reports (bytes_spill_mem) plus a fixed allowance for RocksDB's own
 * structures and the calls' scratch (docs/PROTOCOL.md, "Memory"). Bounds are generous (other
 * allocations move RSS by a few MiB) but each would fail by far if the table held twice what it
 * reports or ignored its budget. Under AddressSanitizer or ThreadSanitizer, whose shadow memory
 * (and ASan's quarantine) change RSS, the RSS checks are skipped (the fills still run).
 */
#include "emb_util.h"

#define RSS_CHECKS (!CHECK_ASAN && !CHECK_TSAN)

#define BATCH 4096u
#define MIB (1024.0 * 1024.0)
/* RocksDB's structures beyond its reported memtables and readers, allocator slack and the
 * calls' scratch: measured 13-31 MiB at 1-8M rows (docs/BENCHMARKS.md), allowed 48. */
#define SPILL_SLACK (48.0 * MIB)

/* The process's resident anonymous memory in bytes, or -1. */
static double rss_anon(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (f == NULL) return -1;
    char line[256];
    double v = -1;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "RssAnon:", 8) == 0) v = strtod(line + 8, NULL) * 1024.0;
    fclose(f);
    return v;
}

static void fill(emb_table *t, uint32_t dim, uint64_t rows)
{
    uint64_t *keys = eu_xmalloc(BATCH * sizeof *keys);
    float *out = eu_xmalloc((size_t)BATCH * dim * sizeof(float));
    for (uint64_t done = 0; done < rows;) {
        size_t n = rows - done < BATCH ? (size_t)(rows - done) : BATCH;
        for (size_t i = 0; i < n; i++)
            keys[i] = eu_key(done + i);
        eu_pull(t, keys, n, out);
        done += n;
    }
    free(keys);
    free(out);
}

/* A table of n_sub sub-shards filled with rows: RSS growth against bytes_mem. */
static void test_tracks_bytes_mem(uint64_t reserve, uint64_t rows)
{
    emb_table_config c = eu_config(EMB_OPT_ADAGRAD, 16);
    c.n_sub = 4; /* blocks of several MiB: mapped on their own, returned when freed */
    c.reserve_rows = reserve;
    double before = rss_anon();
    emb_table *t = eu_create(&c);
    double created = rss_anon();
    fill(t, 16, rows);
    double after = rss_anon();
    emb_table_stats s = eu_stats(t);
    CHECK(s.rows_mem == rows);
    printf("reserve %llu, %llu rows: bytes_mem %.1f MiB, RssAnon +%.1f MiB at create, +%.1f "
           "MiB filled\n",
           (unsigned long long)reserve, (unsigned long long)rows, s.bytes_mem / MIB,
           (created - before) / MIB, (after - before) / MIB);
    if (RSS_CHECKS && before >= 0) {
        double grew = after - before, b = (double)s.bytes_mem;
        /* A reservation is resident from creation, where its blocks are 2 MiB or more. */
        if (reserve > 0)
            CHECK_MSG(created - before >= 0.95 * emb_table_initial_bytes(&c),
                      "+%.1f MiB at create for a %.1f MiB reservation", (created - before) / MIB,
                      emb_table_initial_bytes(&c) / MIB);
        CHECK_MSG(grew >= 0.9 * b && grew <= 1.05 * b + 8 * MIB,
                  "RssAnon grew %.1f MiB for a table reporting %.1f MiB", grew / MIB, b / MIB);
    }
    emb_table_destroy(t);
}

/* A table eight times its budget: resident memory stays near the budget while rows spill. */
static void test_budget_holds(const char *dir)
{
    emb_table_config c = eu_config(EMB_OPT_ADAGRAD, 16);
    c.mem_budget_bytes = 12u << 20;
    c.spill_path = dir;
    const uint64_t rows = 500000; /* ~92 MiB in memory without the budget */
    double before = rss_anon();
    emb_table *t = eu_create(&c);
    fill(t, 16, rows);
    double after = rss_anon();
    emb_table_stats s = eu_stats(t);
    CHECK(s.rows_spilled > rows / 2 && s.rows_mem + s.rows_spilled == rows);
    CHECK(s.bytes_mem <= c.mem_budget_bytes);
    CHECK(s.bytes_spill_mem > 0); /* RocksDB's memtables and readers are reported */
    printf("budget %.1f MiB, %llu rows (%llu spilled): bytes_mem %.1f MiB, bytes_spill_mem %.1f "
           "MiB, RssAnon +%.1f MiB\n",
           c.mem_budget_bytes / MIB, (unsigned long long)rows, (unsigned long long)s.rows_spilled,
           s.bytes_mem / MIB, s.bytes_spill_mem / MIB, (after - before) / MIB);
    if (RSS_CHECKS && before >= 0) {
        double allowed = (double)c.mem_budget_bytes + (double)s.bytes_spill_mem + SPILL_SLACK;
        CHECK_MSG(after - before <= allowed, "RssAnon grew %.1f MiB, allowed %.1f MiB",
                  (after - before) / MIB, allowed / MIB);
    }
    emb_table_destroy(t);
}

int main(void)
{
    if (!RSS_CHECKS) printf("emb_rss: sanitizer build: RSS checks skipped\n");
    const char *dir = check_tmpdir("emb_rss");
    test_tracks_bytes_mem(300000, 300000);
    test_tracks_bytes_mem(0, 300000);
    test_budget_holds(dir);
    return check_done();
}
