/*
 * bench table: throughput of the embedding table against the machine's own limit.
 *
 * Measures, for dim 16 rows, batches of 32K keys drawn Zipf(1.1) over 10M distinct keys, with
 * 1 and 2 threads:
 *   - pull and push (Adagrad) rows/s with the whole table in memory;
 *   - the same with a memory budget of 10% of the table and the rest spilled to RocksDB (under a
 *     temporary directory, removed at the end);
 *   - the random 64-byte-row gather rate over a plain 10M x 64 B array (uniform indices, same
 *     batches and threads): the physical limit for a pull that returns 64 bytes per key.
 * All key streams are generated before any timing. Each table is warmed in two reported steps:
 * a first touch of every key (in a scrambled order, so neither the hot nor the cold end of the
 * distribution is favoured by what happens to be resident afterwards), then a warm-up run of
 * training batches (pull + push) drawn from the same Zipf stream, so that the timed batches,
 * which follow on in the stream, meet a steady-state table rather than a freshly filled one.
 * Each thread count gets its own, fresh segment of the stream, pulled and then pushed (as a
 * training step does): re-pulling a segment would find every key of it already resident and
 * hide the spill's cost.
 *
 * Usage: tools/bench table [--quick] [--keys N] [--batches N] [--warm-batches N]
 * Prints a table, then one JSON object as the last line.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/bench_gather.h"
#include "common/common.h"
#include "tools/bench_util.h"
#include "embedding/embedding.h"

#define DIM 16u
#define ZIPF_S 1.1
#define GATHER_ROW 64u /* bytes: DIM floats, what a pull returns per key */
#define MAX_THREADS 2u
#define GOAL_PULL_OVER_GATHER 0.5
#define GOAL_SPILL_OVER_PULL 0.25

typedef struct opts {
    uint64_t keys;         /* distinct keys (table rows) */
    uint32_t batch;        /* keys per call */
    uint32_t batches;      /* timed batches per measurement, split over the threads */
    uint32_t warm_batches; /* training batches run untimed before the timed ones */
    int quick;
} opts;

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p == NULL) {
        fprintf(stderr, "bench table: out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

/* ---- random numbers ---- */

static double rng_unif(uint64_t *s)
{
    return (double)(bench_rng_next(s) >> 11) * (1.0 / 9007199254740992.0);
}

/* Key of Zipf rank r (1 = most frequent): scattered, as real feature hashes are. */
static uint64_t rank_key(uint64_t r)
{
    return bench_mix64(r * 0x2545f4914f6cdd1dull);
}

/*
 * Zipf(s) over ranks 1..n by rejection-inversion (Hörmann & Derflinger 1996, as in Apache
 * Commons' RejectionInversionZipfSampler): O(1) per sample with no table, which is what makes
 * 10M ranks cheap, and exact rather than a continuous approximation.
 */
typedef struct zipf {
    double s, n, h_x1, h_n, threshold;
} zipf;

/* log1p(x)/x and expm1(x)/x, continuous through 0. */
static double helper1(double x)
{
    return fabs(x) > 1e-8 ? log1p(x) / x : 1 - x * (0.5 - x * (1.0 / 3 - 0.25 * x));
}
static double helper2(double x)
{
    return fabs(x) > 1e-8 ? expm1(x) / x : 1 + x * 0.5 * (1 + x / 3 * (1 + 0.25 * x));
}
static double zipf_h(const zipf *z, double x)
{
    return exp(-z->s * log(x));
}
static double zipf_hint(const zipf *z, double x)
{
    double lx = log(x);
    return helper2((1 - z->s) * lx) * lx;
}
static double zipf_hint_inv(const zipf *z, double x)
{
    double t = x * (1 - z->s);
    if (t < -1) t = -1;
    return exp(helper1(t) * x);
}

static void zipf_init(zipf *z, double s, uint64_t n)
{
    z->s = s;
    z->n = (double)n;
    z->h_x1 = zipf_hint(z, 1.5) - 1;
    z->h_n = zipf_hint(z, z->n + 0.5);
    z->threshold = 2 - zipf_hint_inv(z, zipf_hint(z, 2.5) - zipf_h(z, 2));
}

static uint64_t zipf_sample(const zipf *z, uint64_t *rng)
{
    for (;;) {
        double u = z->h_n + rng_unif(rng) * (z->h_x1 - z->h_n);
        double x = zipf_hint_inv(z, u);
        double k = floor(x + 0.5);
        if (k < 1) k = 1;
        if (k > z->n) k = z->n;
        if (k - x <= z->threshold || u >= zipf_hint(z, k + 0.5) - zipf_h(z, k)) return (uint64_t)k;
    }
}

static uint64_t gcd64(uint64_t a, uint64_t b)
{
    while (b) {
        uint64_t r = a % b;
        a = b;
        b = r;
    }
    return a;
}

/* Every rank once, scrambled by i -> i * step mod n (a bijection when gcd(step, n) = 1), padded
 * with repeats to whole batches. */
static uint64_t *touch_stream(uint64_t n, uint32_t batch, uint32_t *batches)
{
    uint64_t step = 2654435761u;
    while (gcd64(step, n) != 1) step += 2;
    *batches = (uint32_t)((n + batch - 1) / batch);
    size_t total = (size_t)*batches * batch;
    uint64_t *keys = xmalloc(total * sizeof *keys);
    for (size_t i = 0; i < total; i++)
        keys[i] = rank_key((uint64_t)(((unsigned __int128)(i % n) * step) % n) + 1);
    return keys;
}

/* ---- timed work on 1..MAX_THREADS threads ---- */

typedef enum work_kind { WORK_PULL, WORK_PUSH, WORK_GATHER, WORK_GATHER_PF } work_kind;

typedef struct work {
    work_kind kind;
    emb_table *table;
    const uint64_t *stream; /* batches x batch keys (or row indices for gathers) */
    const float *grads;     /* batch x DIM, shared read-only */
    const uint8_t *rows;    /* gather source */
    uint32_t batch, batches, nthreads;
    int failed;
} work;

typedef struct worker {
    work *w;
    uint32_t tid;
    float *out; /* batch x DIM */
    float sink; /* keeps the gathered data live */
} worker;



/* Thread tid takes batches tid, tid + nthreads, ... of the shared stream. */
static void *worker_main(void *arg)
{
    worker *k = arg;
    work *w = k->w;
    char *err = NULL;
    for (uint32_t b = k->tid; b < w->batches; b += w->nthreads) {
        const uint64_t *keys = w->stream + (size_t)b * w->batch;
        int rc = 0;
        switch (w->kind) {
        case WORK_PULL: rc = emb_table_pull(w->table, keys, w->batch, k->out, &err); break;
        case WORK_PUSH: rc = emb_table_push(w->table, keys, w->batch, w->grads, &err); break;
        case WORK_GATHER:
        case WORK_GATHER_PF:
            bench_gather_batch(w->rows, keys, w->batch, (uint8_t *)k->out, w->kind == WORK_GATHER_PF);
            break;
        }
        k->sink += k->out[b % w->batch];
        if (rc != 0) {
            fprintf(stderr, "bench table: %s\n", err ? err : "call failed");
            free(err);
            w->failed = 1;
            break;
        }
    }
    return NULL;
}

/* Runs w on nthreads threads; returns rows per second (0 on failure, reported). */
static double run_work(work *w, uint32_t nthreads, float *outs[MAX_THREADS])
{
    pthread_t th[MAX_THREADS];
    worker ks[MAX_THREADS];
    w->nthreads = nthreads;
    w->failed = 0;
    double t0 = cm_now();
    for (uint32_t i = 0; i < nthreads; i++) {
        ks[i] = (worker){.w = w, .tid = i, .out = outs[i]};
        if (pthread_create(&th[i], NULL, worker_main, &ks[i]) != 0) {
            fprintf(stderr, "bench table: pthread_create failed\n");
            exit(1);
        }
    }
    float sink = 0;
    for (uint32_t i = 0; i < nthreads; i++) {
        pthread_join(th[i], NULL);
        sink += ks[i].sink;
    }
    double dt = cm_now() - t0;
    if (sink == 12345.678f) fputc(' ', stderr); /* observe the sink */
    return w->failed ? 0 : (double)w->batches * w->batch / dt;
}

/* ---- the table measurements ---- */

enum { M_PULL, M_PUSH, M_KINDS };

typedef struct table_result {
    double touch_s, warm_s;
    double rate[M_KINDS][MAX_THREADS];      /* rows/s by kind and thread count - 1 */
    double load_frac[M_KINDS][MAX_THREADS]; /* spill loads per key in that measurement */
    emb_table_stats end;
} table_result;

static void die_on(int rc, char *err, const char *what)
{
    if (rc == 0) return;
    fprintf(stderr, "bench table: %s: %s\n", what, err ? err : "failed");
    free(err);
    exit(1);
}

static void die_if_failed(const work *w, const char *what)
{
    if (!w->failed) return;
    fprintf(stderr, "bench table: %s failed\n", what);
    exit(1);
}

/* One timed measurement, with the spill loads it caused. */
static void measure(work *w, work_kind kind, uint32_t nt, float *outs[MAX_THREADS],
                    table_result *r)
{
    emb_table_stats a, b;
    emb_table_stats_get(w->table, &a);
    w->kind = kind;
    double rate = run_work(w, nt, outs);
    die_if_failed(w, kind == WORK_PULL ? "timed pull" : "timed push");
    emb_table_stats_get(w->table, &b);
    int m = kind == WORK_PULL ? M_PULL : M_PUSH;
    r->rate[m][nt - 1] = rate;
    r->load_frac[m][nt - 1] =
        (double)(b.spill_loads - a.spill_loads) / ((double)w->batches * w->batch);
}

static void bench_table(const opts *o, const emb_table_config *cfg, const uint64_t *touch,
                        uint32_t touch_batches, const uint64_t *stream, const float *grads,
                        float *outs[MAX_THREADS], table_result *r)
{
    emb_table *t = NULL;
    char *err = NULL;
    die_on(emb_table_create(cfg, &t, &err), err, "create");
    work w = {.table = t, .grads = grads, .batch = o->batch};

    w.stream = touch;
    w.batches = touch_batches;
    w.kind = WORK_PULL;
    double t0 = cm_now();
    run_work(&w, MAX_THREADS, outs);
    r->touch_s = cm_now() - t0;
    die_if_failed(&w, "first touch");

    w.stream = stream;
    w.batches = o->warm_batches;
    t0 = cm_now();
    w.kind = WORK_PULL;
    run_work(&w, MAX_THREADS, outs);
    w.kind = WORK_PUSH;
    run_work(&w, MAX_THREADS, outs);
    r->warm_s = cm_now() - t0;
    die_if_failed(&w, "warm-up");

    w.batches = o->batches;
    for (uint32_t nt = 1; nt <= MAX_THREADS; nt++) {
        w.stream = stream + (size_t)(o->warm_batches + (nt - 1) * o->batches) * o->batch;
        measure(&w, WORK_PULL, nt, outs, r);
        measure(&w, WORK_PUSH, nt, outs, r);
    }
    emb_table_stats_get(t, &r->end);
    emb_table_destroy(t);
}

/* ---- the gather limit ---- */

/* Best of 3 for each thread count and for plain / prefetching loops: the limit is what the
 * machine can do, not one noisy sample of it. */
static void bench_gather(const opts *o, const uint64_t *idx, float *outs[MAX_THREADS],
                         double gather[2][MAX_THREADS])
{
    uint8_t *rows = xmalloc((size_t)o->keys * GATHER_ROW);
    for (size_t i = 0; i < (size_t)o->keys * GATHER_ROW; i += 8) memcpy(rows + i, &i, 8);
    work w = {.rows = rows, .stream = idx, .batch = o->batch, .batches = o->batches};
    for (int pf = 0; pf < 2; pf++)
        for (uint32_t nt = 0; nt < MAX_THREADS; nt++) gather[pf][nt] = 0;
    for (int rep = 0; rep < 3; rep++) {
        for (uint32_t nt = 1; nt <= MAX_THREADS; nt++) {
            for (int pf = 0; pf < 2; pf++) {
                w.kind = pf ? WORK_GATHER_PF : WORK_GATHER;
                gather[pf][nt - 1] = fmax(gather[pf][nt - 1], run_work(&w, nt, outs));
            }
        }
    }
    free(rows);
}

/* ---- main ---- */

static void usage(void)
{
    fprintf(stderr, "usage: tools/bench table [--quick] [--keys N] [--batches N] "
                    "[--warm-batches N]\n");
    exit(2);
}

static void parse_args(int argc, char **argv, opts *o)
{
    *o = (opts){.keys = 10000000, .batch = 32768, .batches = 96, .warm_batches = 64};
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) {
            o->quick = 1;
            o->keys = 1000000;
            o->batches = 48;
            o->warm_batches = 16;
        } else if (strcmp(argv[i], "--keys") == 0 && i + 1 < argc) {
            o->keys = strtoull(argv[++i], NULL, 10);
        } else if (strcmp(argv[i], "--batches") == 0 && i + 1 < argc) {
            o->batches = (uint32_t)strtoul(argv[++i], NULL, 10);
        } else if (strcmp(argv[i], "--warm-batches") == 0 && i + 1 < argc) {
            o->warm_batches = (uint32_t)strtoul(argv[++i], NULL, 10);
        } else {
            usage();
        }
    }
    if (o->keys < o->batch || o->batches < MAX_THREADS) usage();
}

static void print_row(const char *name, const double v[MAX_THREADS], const double *loads)
{
    printf("%-34s", name);
    for (uint32_t i = 0; i < MAX_THREADS; i++) printf(" %14.2f", v[i] / 1e6);
    if (loads != NULL) {
        printf("   loads/key");
        for (uint32_t i = 0; i < MAX_THREADS; i++) printf(" %.4f", loads[i]);
    }
    printf("\n");
}

int main(int argc, char **argv)
{
    opts o;
    parse_args(argc, argv, &o);
    /* The 1-minute load average at start and end goes into the report: on a shared machine a
     * figure means little without it. */
    double load_start = -1, load_end = -1;
    if (getloadavg(&load_start, 1) != 1) load_start = -1;

    /* streams, all made before any timing: the first touch (every key once), the training
     * stream (warm-up batches, then one timed segment per thread count), and uniform row
     * indices for the gathers */
    double t0 = cm_now();
    uint32_t touch_batches = 0;
    uint64_t *touch = touch_stream(o.keys, o.batch, &touch_batches);
    const size_t timed_n = (size_t)o.batches * o.batch;
    const size_t stream_n = (size_t)(MAX_THREADS * o.batches + o.warm_batches) * o.batch;
    uint64_t *stream = xmalloc(stream_n * sizeof *stream);
    uint64_t *gidx = xmalloc(timed_n * sizeof *gidx);
    zipf z;
    zipf_init(&z, ZIPF_S, o.keys);
    uint64_t rng = 42, top = 0;
    for (size_t i = 0; i < stream_n; i++) {
        uint64_t r = zipf_sample(&z, &rng);
        top += r == 1;
        stream[i] = rank_key(r);
    }
    for (size_t i = 0; i < timed_n; i++)
        gidx[i] = bench_rng_next(&rng) % o.keys;
    float *grads = xmalloc((size_t)o.batch * DIM * sizeof *grads);
    for (size_t i = 0; i < (size_t)o.batch * DIM; i++)
        grads[i] = (float)(rng_unif(&rng) - 0.5) * 0.01f;
    float *outs[MAX_THREADS];
    for (uint32_t i = 0; i < MAX_THREADS; i++) outs[i] = xmalloc((size_t)o.batch * DIM * sizeof(float));
    double gen_s = cm_now() - t0;

    double gather[2][MAX_THREADS]; /* [plain, prefetch][threads - 1] */
    bench_gather(&o, gidx, outs, gather);
    double glimit[MAX_THREADS];
    for (uint32_t i = 0; i < MAX_THREADS; i++) glimit[i] = fmax(gather[0][i], gather[1][i]);

    emb_table_config cfg;
    emb_table_config_init(&cfg);
    cfg.dim = DIM;
    cfg.opt = EMB_OPT_ADAGRAD;
    table_result mem = {0}, spill = {0};
    bench_table(&o, &cfg, touch, touch_batches, stream, grads, outs, &mem);

    const char *tmp = getenv("TMPDIR");
    char dir[4096], spill_path[4200];
    snprintf(dir, sizeof dir, "%s/ember_bench_table.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (mkdtemp(dir) == NULL) {
        fprintf(stderr, "bench table: mkdtemp %s: %s\n", dir, strerror(errno));
        return 1;
    }
    snprintf(spill_path, sizeof spill_path, "%s/spill", dir);
    emb_table_config scfg = cfg;
    scfg.mem_budget_bytes = (uint64_t)(0.10 * (double)o.keys * emb_row_mem_bytes(&cfg));
    scfg.spill_path = spill_path;
    bench_table(&o, &scfg, touch, touch_batches, stream, grads, outs, &spill);
    cm_rmtree(dir, NULL);
    if (getloadavg(&load_end, 1) != 1) load_end = -1;

    printf("bench table: dim %u, %" PRIu64 " keys Zipf(%.1f) (rank 1 = %.2f%% of draws), batch %u,"
           " %u timed batches after %u warm-up%s\n", DIM, o.keys, ZIPF_S,
           100.0 * (double)top / (double)stream_n, o.batch, o.batches, o.warm_batches,
           o.quick ? " (--quick)" : "");
    printf("streams generated in %.2f s; row %zu bytes, %.1f bytes/row in memory\n", gen_s,
           emb_row_bytes(&cfg), emb_row_mem_bytes(&cfg));
    const table_result *both[2] = {&mem, &spill};
    for (int i = 0; i < 2; i++)
        printf("%-9s first touch of %" PRIu64 " keys %.2f s (%.2f M rows/s), warm-up %u batches "
               "%.2f s\n", i ? "spill:" : "memory:", o.keys, both[i]->touch_s,
               (double)o.keys / both[i]->touch_s / 1e6, o.warm_batches, both[i]->warm_s);
    printf("load average (1 min): %.2f at start, %.2f at end\n", load_start, load_end);
    printf("spill: budget %" PRIu64 " B; at the end %" PRIu64 " rows in memory (%" PRIu64
           " B), %" PRIu64 " spilled\n", scfg.mem_budget_bytes, spill.end.rows_mem,
           spill.end.bytes_mem, spill.end.rows_spilled);

    printf("\n%-34s %14s %14s\n", "M rows/s", "1 thread", "2 threads");
    print_row("gather 64 B rows (plain)", gather[0], NULL);
    print_row("gather 64 B rows (prefetch)", gather[1], NULL);
    print_row("pull, in memory", mem.rate[M_PULL], NULL);
    print_row("push adagrad, in memory", mem.rate[M_PUSH], NULL);
    print_row("pull, 10% budget + spill", spill.rate[M_PULL], spill.load_frac[M_PULL]);
    print_row("push adagrad, 10% budget + spill", spill.rate[M_PUSH], spill.load_frac[M_PUSH]);

    double pg[MAX_THREADS], sp[MAX_THREADS];
    for (uint32_t i = 0; i < MAX_THREADS; i++) {
        pg[i] = glimit[i] > 0 ? mem.rate[M_PULL][i] / glimit[i] : 0;
        sp[i] = mem.rate[M_PULL][i] > 0 ? spill.rate[M_PULL][i] / mem.rate[M_PULL][i] : 0;
    }
    int goals = pg[0] >= GOAL_PULL_OVER_GATHER && pg[1] >= GOAL_PULL_OVER_GATHER &&
                sp[0] >= GOAL_SPILL_OVER_PULL && sp[1] >= GOAL_SPILL_OVER_PULL;
    printf("\npull / gather limit: %.2f (1t) %.2f (2t)   goal >= %.2f\n", pg[0], pg[1],
           GOAL_PULL_OVER_GATHER);
    printf("spill pull / pull:   %.2f (1t) %.2f (2t)   goal >= %.2f\n", sp[0], sp[1],
           GOAL_SPILL_OVER_PULL);
    printf("goals %s\n", goals ? "met" : "NOT met");

    printf("{\"bench\":\"table\",\"quick\":%s,\"keys\":%" PRIu64 ",\"dim\":%u,\"batch\":%u,"
           "\"batches\":%u,\"warm_batches\":%u,\"zipf_s\":%.2f,\"opt\":\"adagrad\","
           "\"touch_mem_s\":%.3f,\"touch_spill_s\":%.3f,\"warm_mem_s\":%.3f,\"warm_spill_s\":%.3f,"
           "\"spill_budget_bytes\":%" PRIu64 ","
           "\"spill_pull_loads_per_key\":%.5f,\"spill_pull_loads_per_key_2t\":%.5f,"
           "\"pull_rows_per_s\":%.0f,\"push_rows_per_s\":%.0f,\"spill_pull_rows_per_s\":%.0f,"
           "\"spill_push_rows_per_s\":%.0f,\"gather_limit_rows_per_s\":%.0f,"
           "\"pull_rows_per_s_2t\":%.0f,\"push_rows_per_s_2t\":%.0f,"
           "\"spill_pull_rows_per_s_2t\":%.0f,\"spill_push_rows_per_s_2t\":%.0f,"
           "\"gather_limit_rows_per_s_2t\":%.0f,"
           "\"pull_over_gather\":%.4f,\"pull_over_gather_2t\":%.4f,"
           "\"spill_pull_over_pull\":%.4f,\"spill_pull_over_pull_2t\":%.4f,"
           "\"goal_pull_over_gather\":%.2f,\"goal_spill_pull_over_pull\":%.2f,\"goals_met\":%s,"
           "\"loadavg_start\":%.2f,\"loadavg_end\":%.2f}\n",
           o.quick ? "true" : "false", o.keys, DIM, o.batch, o.batches, o.warm_batches, ZIPF_S,
           mem.touch_s, spill.touch_s, mem.warm_s, spill.warm_s, scfg.mem_budget_bytes,
           spill.load_frac[M_PULL][0], spill.load_frac[M_PULL][1], mem.rate[M_PULL][0],
           mem.rate[M_PUSH][0], spill.rate[M_PULL][0], spill.rate[M_PUSH][0], glimit[0],
           mem.rate[M_PULL][1], mem.rate[M_PUSH][1], spill.rate[M_PULL][1], spill.rate[M_PUSH][1],
           glimit[1], pg[0], pg[1], sp[0], sp[1], GOAL_PULL_OVER_GATHER, GOAL_SPILL_OVER_PULL,
           goals ? "true" : "false", load_start, load_end);
    free(touch);
    free(stream);
    free(gidx);
    free(grads);
    for (uint32_t i = 0; i < MAX_THREADS; i++) free(outs[i]);
    return 0;
}
