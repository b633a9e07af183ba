/*
 * bench ingest: Criteo TSV -> shards throughput (ds_ingest_run) against the machine's own
 * read limit.
 *
 *   - input: a synthetic Criteo TSV of >= 1 GB (4.2M rows, ~244 bytes a row) written by
 *     `ember gen --seed 1`, cached as <dir>/criteo-<rows>-s<seed>.tsv with a .size file beside
 *     it: a later run reuses it when the file still has the recorded size;
 *   - I/O limit: `cat FILE > /dev/null`, run twice, the second timed, so the file is in the page
 *     cache (nothing is dropped from the cache): what reading the bytes costs at best, one core;
 *   - ds_ingest_run (the library call behind `ember ingest --format criteo`) over the same file
 *     with threads = all cores and with 1 thread, shards written to <dir>/out (removed after).
 * MB are 10^6 bytes of input text. Per-core figures divide by the cores actually used: the
 * process CPU time (user + system, all threads: reader, parse workers, writer, and any time
 * spent spinning or waiting in the kernel) over the run, so MB/s per core = MB / CPU-seconds.
 * Dividing by the thread count instead would flatter or punish a run depending on how busy
 * the shared cores were; CPU time charges exactly what the ingest consumed.
 *
 * Usage: tools/bench ingest [--quick] [--rows N] [--seed S] [--dir DIR] [--ember PATH] [--buffered]
 *   --quick   300K rows (~73 MB) instead of 4.2M
 *   --buffered  shards written through the page cache (ds_ingest_opts.buffered_output), as
 *               before direct I/O became the default: shows what the page-cache writes cost
 *   --dir     cache directory (default $EMBER_BENCH_DIR, else /tmp/ember-bench)
 * Prints a table, then one JSON object as the last line.
 */
#include <errno.h>
#include <inttypes.h>
#include <libgen.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tools/bench_util.h"
#include "common/common.h"
#include "datasets/datasets.h"

#define FULL_ROWS 4200000ull
#define QUICK_ROWS 300000ull
#define GOAL_MB_PER_S_PER_CORE 300.0

typedef struct opts {
    uint64_t rows, seed;
    int quick, buffered;
    const char *dir, *ember;
} opts;

/* The cached TSV: reused when its .size file matches; else generated with ember gen. */
static void ensure_tsv(const opts *o, const char *tsv, double *gen_s, int *reused)
{
    char sizefile[4200], buf[64] = {0};
    snprintf(sizefile, sizeof sizefile, "%s.size", tsv);
    FILE *f = fopen(sizefile, "r");
    uint64_t want = 0;
    if (f) {
        if (fgets(buf, sizeof buf, f)) want = strtoull(buf, NULL, 10);
        fclose(f);
    }
    *gen_s = 0;
    *reused = want > 0 && bench_file_size(tsv) == want;
    if (*reused) return;
    char rows[32], seed[32];
    snprintf(rows, sizeof rows, "%" PRIu64, o->rows);
    snprintf(seed, sizeof seed, "%" PRIu64, o->seed);
    /* --threads 1 leaves the other core to the rest of the machine; the output is the same
     * for any thread count. */
    char *argv[] = {(char *)o->ember, "gen", "--rows", rows,        "--seed", seed,
                    "--threads",      "1",   "--out",  (char *)tsv, NULL};
    fprintf(stderr, "bench ingest: generating %s rows (seed %s) into %s\n", rows, seed, tsv);
    double t0 = cm_now();
    if (bench_run_cmd(argv, "/dev/null", NULL) != 0) bench_die("ember gen failed", NULL);
    *gen_s = cm_now() - t0;
    f = fopen(sizefile, "w");
    if (f == NULL) bench_die("cannot write the size file", NULL);
    fprintf(f, "%" PRIu64 "\n", bench_file_size(tsv));
    fclose(f);
}

/* `cat FILE > /dev/null` twice; returns the seconds of the second run. */
static double time_cat(const char *tsv)
{
    char *argv[] = {"/bin/cat", (char *)tsv, NULL};
    double t = 0;
    for (int i = 0; i < 2; i++) {
        double t0 = cm_now();
        if (bench_run_cmd(argv, "/dev/null", NULL) != 0) bench_die("cat failed", NULL);
        t = cm_now() - t0;
    }
    return t;
}

/* User + system CPU seconds of this process so far (all its threads). */
static double cpu_seconds(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec * 1e-6;
}

/* One ds_ingest_run; *cpu_s gets the CPU time it consumed (nothing else runs meanwhile). */
static void ingest(const opts *o, const char *tsv, const char *out, int threads,
                   ds_ingest_result *res, double *cpu_s)
{
    ds_ingest_opts io;
    ds_ingest_opts_init(&io);
    io.parser.format = DS_FMT_CRITEO;
    const char *inputs[1] = {tsv};
    io.inputs = inputs;
    io.n_inputs = 1;
    io.out_dir = out;
    io.threads = threads;
    io.progress = 0;
    io.buffered_output = o->buffered;
    char *err = NULL;
    double c0 = cpu_seconds();
    if (ds_ingest_run(&io, res, &err) != CM_OK) bench_die("ds_ingest_run", err);
    *cpu_s = cpu_seconds() - c0;
}

static void default_ember(opts *o)
{
    o->ember = bench_ember_path();
}

static void loadavg(char *buf, size_t n)
{
    snprintf(buf, n, "?");
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%15s", buf) != 1) snprintf(buf, n, "?");
        fclose(f);
    }
}

int main(int argc, char **argv)
{
    bench_init("bench ingest", NULL);
    opts o = {.rows = 0, .seed = 1};
    default_ember(&o);
    o.dir = getenv("EMBER_BENCH_DIR") ? getenv("EMBER_BENCH_DIR") : "/tmp/ember-bench";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            o.quick = 1;
        else if (!strcmp(argv[i], "--rows") && i + 1 < argc)
            o.rows = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
            o.seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--dir") && i + 1 < argc)
            o.dir = argv[++i];
        else if (!strcmp(argv[i], "--ember") && i + 1 < argc)
            o.ember = argv[++i];
        else if (!strcmp(argv[i], "--buffered"))
            o.buffered = 1;
        else {
            fprintf(stderr, "usage: bench_ingest [--quick] [--rows N] [--seed S] [--dir DIR] "
                            "[--ember PATH] [--buffered]\n");
            return 2;
        }
    }
    if (o.rows == 0) o.rows = o.quick ? QUICK_ROWS : FULL_ROWS;
    if (o.ember == NULL || access(o.ember, X_OK) != 0) {
        fprintf(stderr, "bench ingest: no ember binary at %s (build it, or --ember PATH)\n",
                o.ember ? o.ember : "?");
        return 1;
    }
    char *err = NULL;
    if (cm_mkdirs(o.dir, &err) != CM_OK) bench_die("cache directory", err);
    char tsv[4096], out[4200];
    snprintf(tsv, sizeof tsv, "%s/criteo-%" PRIu64 "-s%" PRIu64 ".tsv", o.dir, o.rows, o.seed);
    snprintf(out, sizeof out, "%s/ingest-out-%ld", o.dir, (long)getpid());

    double gen_s;
    int reused;
    ensure_tsv(&o, tsv, &gen_s, &reused);
    uint64_t bytes = bench_file_size(tsv);
    if (!o.quick && bytes < 1000000000ull)
        fprintf(stderr,
                "bench ingest: note: input is %.2f GB, below the 1 GB the full run asks for "
                "(use --rows)\n",
                bytes / 1e9);
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int cores = ncpu > 0 ? (int)ncpu : 1;

    char load0[16], load1[16];
    loadavg(load0, sizeof load0);
    double cat_s = time_cat(tsv);
    ds_ingest_result all, one;
    double cpu_all, cpu_one;
    ingest(&o, tsv, out, cores, &all, &cpu_all);
    ingest(&o, tsv, out, 1, &one, &cpu_one);
    loadavg(load1, sizeof load1);
    char *rm[] = {"/bin/rm", "-rf", out, NULL};
    bench_run_cmd(rm, NULL, NULL);

    double mb = (double)bytes / 1e6;
    double cat_mbs = mb / cat_s;
    double mbs = all.bytes_in / 1e6 / all.seconds, rps = all.rows_in / all.seconds;
    double mbs1 = one.bytes_in / 1e6 / one.seconds, rps1 = one.rows_in / one.seconds;
    /* per core = MB per CPU-second; cores used = CPU-seconds per wall second */
    double per_core = cpu_all > 0 ? all.bytes_in / 1e6 / cpu_all : 0;
    double per_core1 = cpu_one > 0 ? one.bytes_in / 1e6 / cpu_one : 0;
    double used = cpu_all / all.seconds, used1 = cpu_one / one.seconds;

    printf("bench ingest: %s, %" PRIu64 " rows, %.1f MB (%s), %d cores, shards written %s\n", tsv,
           o.rows, mb, reused ? "cached" : "generated now", cores,
           o.buffered ? "buffered (--buffered)" : "with O_DIRECT where possible");
    printf("%-34s %7s %9s %8s %10s %11s %9s %10s\n", "what", "threads", "seconds", "cpu s",
           "cores used", "rows/s", "MB/s", "MB/s/core");
    printf("%-34s %7d %9.3f %8s %10s %11s %9.1f %10s\n", "cat FILE > /dev/null (2nd, cached)", 1,
           cat_s, "-", "-", "-", cat_mbs, "-");
    printf("%-34s %7d %9.3f %8.3f %10.2f %11.0f %9.1f %10.1f\n", "ds_ingest_run (all cores)",
           all.threads, all.seconds, cpu_all, used, rps, mbs, per_core);
    printf("%-34s %7d %9.3f %8.3f %10.2f %11.0f %9.1f %10.1f\n", "ds_ingest_run (1 thread)",
           one.threads, one.seconds, cpu_one, used1, rps1, mbs1, per_core1);
    printf("MB/s/core = MB / CPU-seconds of the run (user + system, every thread of it)\n");
    printf("rows: in %" PRIu64 ", written %" PRIu64 ", rejected %" PRIu64 "; shard bytes %.1f MB "
           "(%.2fx smaller)\n",
           all.rows_in, all.rows_written, all.rows_rejected, all.bytes_out / 1e6,
           all.bytes_out ? (double)all.bytes_in / all.bytes_out : 0);
    printf("ingest / cat: %.2f (all cores), %.2f (1 thread)\n", mbs / cat_mbs, mbs1 / cat_mbs);
    printf(
        "goal >= %.0f MB/s per core: %s (all cores %.1f, 1 thread %.1f)\n", GOAL_MB_PER_S_PER_CORE,
        per_core >= GOAL_MB_PER_S_PER_CORE && per_core1 >= GOAL_MB_PER_S_PER_CORE   ? "met"
        : per_core >= GOAL_MB_PER_S_PER_CORE || per_core1 >= GOAL_MB_PER_S_PER_CORE ? "partly met"
                                                                                    : "NOT met",
        per_core, per_core1);
    printf("load average %s at start, %s at end (other load on the cores skews the figures)\n",
           load0, load1);
    printf("{\"bench\":\"ingest\",\"quick\":%s,\"rows\":%" PRIu64 ",\"seed\":%" PRIu64
           ",\"bytes\":%" PRIu64 ",\"cached_input\":%s,\"gen_seconds\":%.3f,\"cores\":%d,"
           "\"threads\":%d,\"seconds\":%.3f,\"mb_per_s\":%.1f,\"rows_per_s\":%.0f,"
           "\"mb_per_s_per_core\":%.1f,\"cpu_seconds\":%.3f,\"cores_used\":%.2f,"
           "\"per_core_note\":\"MB per CPU-second (user+system, all threads)\",\"seconds_1t\":%.3f,"
           "\"mb_per_s_1t\":%.1f,\"rows_per_s_1t\":%.0f,\"cpu_seconds_1t\":%.3f,"
           "\"mb_per_s_per_core_1t\":%.1f,"
           "\"cat_seconds\":%.3f,\"cat_mb_per_s\":%.1f,\"cat_note\":\"second of two runs, file in "
           "page cache\","
           "\"shard_bytes\":%" PRIu64 ",\"buffered_output\":%s,"
           "\"goal_mb_per_s_per_core\":%.0f,\"goal_met\":%s,"
           "\"loadavg_start\":\"%s\",\"loadavg_end\":\"%s\"}\n",
           o.quick ? "true" : "false", o.rows, o.seed, bytes, reused ? "true" : "false", gen_s,
           cores, all.threads, all.seconds, mbs, rps, per_core, cpu_all, used, one.seconds, mbs1,
           rps1, cpu_one, per_core1, cat_s, cat_mbs, all.bytes_out, o.buffered ? "true" : "false",
           GOAL_MB_PER_S_PER_CORE, per_core >= GOAL_MB_PER_S_PER_CORE ? "true" : "false", load0,
           load1);
    return 0;
}
