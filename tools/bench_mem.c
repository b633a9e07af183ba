/*
 * bench mem: does a table's memory match what ember promises before it runs?
 *
 * For one table configuration, fills a fresh emb_table with a known number of distinct rows
 * (pulls of new keys, in batches) and compares three figures:
 *   - predicted: what `ember ps --plan ROWS` prints for the same table (ps_plan: mem_bytes, and
 *     start_GiB's initial_bytes);
 *   - reported: the table's own emb_table_stats.bytes_mem (what the PS's STATS reports);
 *   - measured: the process's resident memory growth over the fill (/proc/self/status RssAnon,
 *     RssFile, and VmHWM, the peak, reset before the table is created via clear_refs), and
 *     /proc/self/smaps_rollup's Anonymous.
 * With --memory B the table spills to RocksDB beyond B (under a temporary directory, removed at
 * the end), and the figures show what the budget holds and what RocksDB adds beside it.
 *
 * Usage: tools/bench mem [--dim N] [--opt NAME] [--rows N] [--memory BYTES] [--reserve N]
 *                        [--pushes N]
 * --pushes N: after the fill, N batches of pushes over keys drawn uniformly from the rows (so a
 * spilling table reads spilled rows back and writes dirty ones out). Run each configuration in
 * a fresh process: resident memory is the process's.
 * Prints a table, then one JSON object as the last line.
 */
#include <inttypes.h>
#include <malloc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/common.h"
#include "tools/bench_util.h"
#include "embedding/embedding.h"
#include "ps/ps.h"

#define BATCH 65536u

typedef struct mem_sample {
    long long rss_anon, rss_file, hwm, anon_rollup; /* KiB */
} mem_sample;

/* The value of "name:   N kB" in a /proc file, or -1. */
static long long proc_kb(const char *path, const char *name)
{
    FILE *f = fopen(path, "r");
    if (f == NULL) return -1;
    char line[256];
    size_t nl = strlen(name);
    long long v = -1;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, name, nl) == 0 && line[nl] == ':') {
            v = strtoll(line + nl + 1, NULL, 10);
            break;
        }
    fclose(f);
    return v;
}

static void sample(mem_sample *s)
{
    s->rss_anon = proc_kb("/proc/self/status", "RssAnon");
    s->rss_file = proc_kb("/proc/self/status", "RssFile");
    s->hwm = proc_kb("/proc/self/status", "VmHWM");
    s->anon_rollup = proc_kb("/proc/self/smaps_rollup", "Anonymous");
}

/* Resets VmHWM to the current RSS, so the next peak is this phase's. */
static void reset_peak(void)
{
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (f == NULL) return;
    fputs("5", f);
    fclose(f);
}

static unsigned long long num_arg(const char *flag, const char *s)
{
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s) {
        fprintf(stderr, "bench mem: bad number '%s' for %s\n", s, flag);
        exit(2);
    }
    if (*end == 'K' || *end == 'k')
        v <<= 10;
    else if (*end == 'M')
        v <<= 20;
    else if (*end == 'G')
        v <<= 30;
    return v;
}

static double mib(double bytes)
{
    return bytes / (1 << 20);
}

int main(int argc, char **argv)
{
    unsigned dim = 16;
    const char *opt = "adagrad";
    unsigned long long rows = 1000000, memory = 0, reserve = 0, pushes = 0;
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL) {
            fprintf(stderr, "usage: bench_mem [--dim N] [--opt NAME] [--rows N] [--memory B] "
                            "[--reserve N] [--pushes N]\n");
            return 2;
        }
        if (strcmp(a, "--dim") == 0)
            dim = (unsigned)num_arg(a, v);
        else if (strcmp(a, "--opt") == 0)
            opt = v;
        else if (strcmp(a, "--rows") == 0)
            rows = num_arg(a, v);
        else if (strcmp(a, "--memory") == 0)
            memory = num_arg(a, v);
        else if (strcmp(a, "--reserve") == 0)
            reserve = num_arg(a, v);
        else if (strcmp(a, "--pushes") == 0)
            pushes = num_arg(a, v);
        else {
            fprintf(stderr, "bench mem: unknown flag %s\n", a);
            return 2;
        }
    }

    /* The table as a one-table cluster config declares it, so the prediction is --plan's. */
    static ps_config pc;
    ps_config_init(&pc);
    pc.n_tables = 1;
    snprintf(pc.tables[0].name, sizeof pc.tables[0].name, "t");
    emb_table_config *cfg = &pc.tables[0].cfg;
    emb_table_config_init(cfg);
    cfg->dim = dim;
    if (emb_opt_parse(opt, &cfg->opt) != CM_OK) {
        fprintf(stderr, "bench mem: unknown optimizer %s\n", opt);
        return 2;
    }
    cfg->mem_budget_bytes = memory;
    cfg->reserve_rows = reserve;
    char spill[] = "/tmp/ember-bench-mem-XXXXXX";
    if (memory > 0) {
        if (mkdtemp(spill) == NULL) {
            perror("bench mem: mkdtemp");
            return 1;
        }
        cfg->spill_path = spill;
    }
    ps_plan_row plan;
    ps_plan(&pc, 0, rows, &plan);

    uint64_t *keys = malloc(sizeof *keys * BATCH);
    float *out = malloc(sizeof *out * BATCH * dim);
    if (keys == NULL || out == NULL) return 1;
    memset(out, 0, sizeof *out * BATCH * dim); /* resident before the baseline */

    mem_sample s0, s1, s2, s3, s4;
    reset_peak();
    sample(&s0);
    emb_table *t = NULL;
    char *err = NULL;
    if (emb_table_create(cfg, &t, &err) != CM_OK) {
        fprintf(stderr, "bench mem: %s\n", err);
        return 1;
    }
    sample(&s1);
    for (uint64_t done = 0; done < rows;) {
        size_t n = rows - done < BATCH ? (size_t)(rows - done) : BATCH;
        for (size_t i = 0; i < n; i++)
            keys[i] = bench_mix64(done + i);
        if (emb_table_pull(t, keys, n, out, &err) != CM_OK) {
            fprintf(stderr, "bench mem: pull: %s\n", err);
            return 1;
        }
        done += n;
    }
    sample(&s2);
    uint64_t rng = 12345;
    for (unsigned long long b = 0; b < pushes; b++) {
        for (size_t i = 0; i < BATCH; i++)
            keys[i] = bench_mix64(bench_mix64(rng++) % rows);
        if (emb_table_pull(t, keys, BATCH, out, &err) != CM_OK ||
            emb_table_push(t, keys, BATCH, out, &err) != CM_OK) {
            fprintf(stderr, "bench mem: push: %s\n", err);
            return 1;
        }
    }
    sample(&s3);
    emb_table_stats st;
    emb_table_stats_get(t, &st);
    /* What the allocator holds freed but not returned (the fill's per-call scratch, RocksDB's
     * flushed memtables in its background threads' arenas) is not the table's. */
    malloc_trim(0);
    sample(&s4);

    double grow_anon = (double)(s3.rss_anon - s0.rss_anon) * 1024;
    double grow_file = (double)(s3.rss_file - s0.rss_file) * 1024;
    double peak = (double)(s3.hwm - (s0.rss_anon + s0.rss_file)) * 1024;
    printf("bench mem: dim %u, %s, %llu rows, budget %llu, reserve_rows %llu, %llu push batches\n",
           dim, opt, rows, memory, reserve, pushes);
    printf("  row_bytes %zu, plan mem_bytes/row %.2f\n", emb_row_bytes(cfg),
           plan.mem_bytes_per_row);
    printf("  %-34s %12s\n", "figure", "MiB");
    printf("  %-34s %12.1f\n", "plan: start (start_GiB)", mib(plan.initial_bytes));
    printf("  %-34s %12.1f\n", "measured: RssAnon after create",
           mib((s1.rss_anon - s0.rss_anon) * 1024.0));
    printf("  %-34s %12.1f\n", "plan: mem for ROWS (mem_GiB)", mib(plan.mem_bytes));
    printf("  %-34s %12.1f\n", "reported: stats bytes_mem", mib((double)st.bytes_mem));
    printf("  %-34s %12.1f\n", "reported: stats bytes_spill_mem", mib((double)st.bytes_spill_mem));
    printf("  %-34s %12.1f\n", "measured: RssAnon growth", mib(grow_anon));
    printf("  %-34s %12.1f\n", "measured: RssAnon growth, trimmed",
           mib((s4.rss_anon - s0.rss_anon) * 1024.0));
    printf("  %-34s %12.1f\n", "measured: smaps Anonymous growth",
           mib((s3.anon_rollup - s0.anon_rollup) * 1024.0));
    printf("  %-34s %12.1f\n", "measured: RssFile growth", mib(grow_file));
    printf("  %-34s %12.1f\n", "measured: peak RSS growth (VmHWM)", mib(peak));
    printf("  rows in memory %" PRIu64 " (plan %" PRIu64 "), spilled %" PRIu64 " (plan %" PRIu64
           ")\n",
           st.rows_mem, plan.rows_in_memory, st.rows_spilled, plan.rows_spilled);
    printf("{\"bench\":\"mem\",\"dim\":%u,\"opt\":\"%s\",\"rows\":%llu,\"budget\":%llu,"
           "\"reserve_rows\":%llu,\"pushes\":%llu,\"row_bytes\":%zu,\"plan_mem_bytes\":%.0f,"
           "\"plan_initial_bytes\":%.0f,\"plan_rows_in_memory\":%" PRIu64 ",\"bytes_mem\":%" PRIu64
           ",\"bytes_spill_mem\":%" PRIu64 ",\"rows_mem\":%" PRIu64 ",\"rows_spilled\":%" PRIu64
           ",\"rss_anon_create\":%.0f,\"rss_anon_growth\":%.0f,\"rss_anon_trimmed\":%.0f,"
           "\"rss_file_growth\":%.0f,"
           "\"peak_growth\":%.0f}\n",
           dim, opt, rows, memory, reserve, pushes, emb_row_bytes(cfg), plan.mem_bytes,
           plan.initial_bytes, plan.rows_in_memory, st.bytes_mem, st.bytes_spill_mem, st.rows_mem,
           st.rows_spilled, (s1.rss_anon - s0.rss_anon) * 1024.0, grow_anon,
           (s4.rss_anon - s0.rss_anon) * 1024.0, grow_file, peak);
    const char *smaps = getenv("BENCH_MEM_SMAPS");
    if (smaps != NULL) {
        char cmd[512];
        snprintf(cmd, sizeof cmd, "cp /proc/%d/smaps %s", (int)getpid(), smaps);
        if (system(cmd) != 0) fprintf(stderr, "bench mem: could not copy smaps\n");
    }
    emb_table_destroy(t);
    if (memory > 0) rmdir(spill);
    free(keys);
    free(out);
    free(err);
    return 0;
}
