/*
 * serve_export_mem: `ember export` runs in memory that does not grow with a table's rows.
 * Tables larger than memory are ember's promise (the PS spills cold rows to RocksDB); export
 * once held every row of a checkpoint (keys and fp32 weights) in RAM, so exporting such a table
 * ran out of memory.
 *   - the "emb" table of a small trained checkpoint is replaced by one of ROWS rows (new) and of
 *     ROWS rows a tenth of them other keys and a quarter other weights (old);
 *   - each export (bundle, safetensors, RocksDB, and a delta new since old) runs in a child
 *     with --memory 2M (what it may hold for a table's keys: less than they take, so the
 *     bundle's index goes through sorted runs on disk), whose peak RSS may exceed that of the
 *     same export of the small checkpoint by far less than the table's ROWS x (8 + 4 dim)
 *     bytes (relative, so it holds under ASan too; not checked under TSan, whose shadow
 *     memory grows with every byte touched); the delta
 *     holds no more than its --memory twice (the old checkpoint's keys and fingerprints, and
 *     the bundle's index), where a map of the old checkpoint's keys (~17 bytes a row) took
 *     2.5 times that;
 *   - the delta is the same bundle, byte for byte, with a --memory its map of old fits in;
 *   - the bundle serves every row as the checkpoint holds it, and old's bundle with the delta
 *     stacked serves new's rows and zeros for the keys new no longer has.
 */
#include <inttypes.h>
#include <sys/resource.h>

#include "embedding/embedding.h"
#include "ps/ps.h"
#include "serve_util.h"

#define ROWS 300000u

/* Row i's key: spread over u64 (as trained keys are, hashed). */
static uint64_t row_key(uint64_t i)
{
    uint64_t x = i + 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Row i's weight j in the old (gen 0) or new (gen 1) checkpoint: a quarter of the rows moved. */
static float row_weight(uint64_t i, uint32_t j, int gen)
{
    float v = (float)((i * 31 + j * 7) % 1000) / 1000.0f - 0.5f;
    return gen == 1 && i % 4 == 0 ? v + 0.25f : v;
}

/* Old holds rows [0, ROWS), new rows [ROWS / 10, ROWS + ROWS / 10). */
static uint64_t first_row(int gen)
{
    return gen == 1 ? ROWS / 10 : 0;
}

/* Rewrites ckpt's table-emb snapshots (every shard, each its keys) with generation gen's rows,
 * keeping the table's config and step. The table's dim into *dim. 0 or -1. */
static int fill_table(const char *ckpt, int gen, uint32_t *dim)
{
    char *err = NULL, path[8400];
    uint32_t shards = 0;
    int rc = ps_checkpoint_shards(su_path(ckpt), &shards, &err);
    for (uint32_t s = 0; rc == 0 && s < shards; s++) {
        snprintf(path, sizeof path, "%s/shard-%u/table-emb", su_path(ckpt), s);
        emb_table_config cfg;
        uint64_t step = 0;
        emb_table *t = NULL;
        rc = emb_snapshot_read_config(path, &cfg, &err);
        if (rc == 0) rc = emb_snapshot_step(path, &step, &err);
        if (rc == 0) rc = emb_table_create(&cfg, &t, &err);
        float *w = rc == 0 ? calloc(cfg.dim + emb_row_slots(&cfg) + 1, sizeof *w) : NULL;
        if (t != NULL) emb_table_set_step(t, step);
        for (uint64_t i = first_row(gen); rc == 0 && w && i < first_row(gen) + ROWS; i++) {
            const uint64_t key = row_key(i);
            if (ps_key_shard(key, shards) != s) continue;
            for (uint32_t j = 0; j < cfg.dim; j++)
                w[j] = row_weight(i, j, gen);
            emb_row r = {key, 1, step, w, w + cfg.dim};
            rc = emb_table_put_row(t, &r, &err);
        }
        if (rc == 0) rc = emb_table_snapshot(t, path, &err);
        *dim = cfg.dim;
        free(w);
        emb_table_destroy(t);
    }
    CHECK_MSG(rc == 0, "filling %s: %s", ckpt, err ? err : "?");
    free(err);
    return rc == 0 ? 0 : -1;
}

/* Peak RSS of `ember ARGS`, measured by a process forked before this one grew. A process's
 * peak RSS (ru_maxrss) outlives exec: a child forked from this test once its rows were built
 * (and, under ASan, held in quarantine) reported their size for every command it ran. So a
 * "zygote" is forked first; for each command it forks a child, which runs the command and sends
 * back {exit code, the largest RSS among its children (KiB)}: the shell and timeout are small,
 * the largest is ember's. */
static int zy_cmd = -1, zy_res = -1;

static void zygote_start(void)
{
    int c[2], r[2];
    if (pipe(c) != 0 || pipe(r) != 0) return;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        close(c[1]);
        close(r[0]);
        /* Under ASan, freed memory waits in a quarantine of up to 256 MiB before reuse: RSS
         * then grows with the bytes an export allocates and frees over its run (RocksDB's
         * write batches and memtables), not with what it holds. The exports measured here keep
         * a small one (the other serve tests run them with the full quarantine). */
        const char *o = getenv("ASAN_OPTIONS");
        char opts[1024];
        snprintf(opts, sizeof opts, "%s%squarantine_size_mb=1", o ? o : "", o && *o ? ":" : "");
        setenv("ASAN_OPTIONS", opts, 1);
        char args[2048];
        size_t len;
        while (read(c[0], &len, sizeof len) == (ssize_t)sizeof len && len < sizeof args &&
               read(c[0], args, len) == (ssize_t)len) {
            args[len] = '\0';
            pid_t k = fork();
            if (k == 0) {
                struct rusage ru;
                long v[2] = {su_ember("%s", args), -1};
                if (getrusage(RUSAGE_CHILDREN, &ru) == 0) v[1] = ru.ru_maxrss;
                _exit(write(r[1], v, sizeof v) == (ssize_t)sizeof v ? 0 : 1);
            }
            if (k > 0) waitpid(k, NULL, 0);
            if (k < 0) {
                long v[2] = {-1, -1};
                if (write(r[1], v, sizeof v) != (ssize_t)sizeof v) break;
            }
        }
        _exit(0);
    }
    close(c[0]);
    close(r[1]);
    zy_cmd = c[1];
    zy_res = r[0];
}

/* Peak RSS (KiB) of `ember ARGS`, or -1 when it failed. */
static long export_rss(const char *args)
{
    size_t len = strlen(args);
    long v[2] = {-1, -1};
    if (zy_cmd < 0 || write(zy_cmd, &len, sizeof len) != (ssize_t)sizeof len ||
        write(zy_cmd, args, len) != (ssize_t)len || read(zy_res, v, sizeof v) != (ssize_t)sizeof v)
        return -1;
    return v[0] == 0 ? v[1] : -1;
}

/* Every row of generation gen served by h as written; with gone, generation 0's rows that
 * generation 1 does not have read as absent. 0 or -1 (reported). */
static int check_rows(const ember_serve *h, uint32_t dim, int gen, int gone)
{
    int t = ember_serve_table(h, "emb");
    CHECK_MSG(t >= 0 && ember_serve_table_dim(h, t) == dim, "table emb of dim %u", dim);
    if (t < 0) return -1;
    enum { B = 4096 };
    uint64_t *keys = malloc(B * sizeof *keys);
    float *out = malloc((size_t)B * dim * sizeof *out);
    uint8_t *found = malloc(B);
    uint64_t bad = 0, first = first_row(gen);
    for (uint64_t i0 = first; i0 < first + ROWS; i0 += B) {
        uint64_t n = first + ROWS - i0 < B ? first + ROWS - i0 : B;
        for (uint64_t k = 0; k < n; k++)
            keys[k] = row_key(i0 + k);
        ember_serve_lookup(h, t, keys, n, out, found);
        for (uint64_t k = 0; k < n; k++) {
            int ok = found[k];
            for (uint32_t j = 0; ok && j < dim; j++)
                ok = out[k * dim + j] == row_weight(i0 + k, j, gen);
            if (!ok && bad++ < 3)
                fprintf(stderr, "row %" PRIu64 " (key %" PRIu64 "): found %d, weight 0 %g\n",
                        i0 + k, keys[k], found[k], (double)out[k * dim]);
        }
    }
    for (uint64_t i0 = 0; gone && i0 < first_row(1); i0 += B) {
        uint64_t n = first_row(1) - i0 < B ? first_row(1) - i0 : B;
        for (uint64_t k = 0; k < n; k++)
            keys[k] = row_key(i0 + k);
        ember_serve_lookup(h, t, keys, n, out, found);
        for (uint64_t k = 0; k < n; k++)
            if (found[k] && bad++ < 3) fprintf(stderr, "deleted row %" PRIu64 " served\n", i0 + k);
    }
    CHECK_MSG(bad == 0, "%" PRIu64 " rows served wrong", bad);
    free(keys);
    free(out);
    free(found);
    return bad == 0 ? 0 : -1;
}

int main(void)
{
    if (su_init("serve_export_mem") != 0) return check_done();
    zygote_start();
    if (su_make_data(4000, 3) != 0) return check_done();
    int rc = su_ember("train --train shards/train --eval shards/eval --model deepfm --dim 16 "
                      "--out run --no-progress --max-steps 20 --checkpoint-every 10 --batch 128 "
                      "--device cpu");
    CHECK_MSG(rc == 0, "train: exit %d", rc);
    if (rc != 0) return check_done();
    uint32_t dim = 0;
    rc = su_shell(60, "cp -r run/ckpt/step-10 old && cp -r run/ckpt/step-20 new");
    CHECK(rc == 0);
    if (rc != 0 || fill_table("old", 0, &dim) != 0 || fill_table("new", 1, &dim) != 0)
        return check_done();

    /* The same export of the small checkpoint first: the program, its libraries, RocksDB's
     * threads (and ASan's shadow) are not the table's. */
    /* Allowed (KiB): a third of the table, RocksDB's writer too (it once wrote through the
     * spill store's memtables, compactions and mmap reads: 12 MiB more here, 250 MiB at 3M
     * rows); the delta, --memory twice. */
    const double table_kib = (double)ROWS * (8 + 4.0 * dim) / 1024;
    const struct {
        const char *name, *args;
        double bound_kib;
    } ex[] = {
        {"bundle", "--format bundle", table_kib / 3},
        {"safetensors", "--format safetensors", table_kib / 3},
        {"rocksdb", "--format rocksdb", table_kib / 3},
        {"delta", "--since %s", 2 * 2048},
    };
    for (size_t i = 0; i < sizeof ex / sizeof ex[0]; i++) {
        char args[4][1024], opt[256];
        for (int big = 0; big < 2; big++) {
            snprintf(opt, sizeof opt, ex[i].args, big ? "old" : "run/ckpt/step-10");
            snprintf(args[big], sizeof args[big],
                     "export --checkpoint %s --out %s-%s --memory 2M %s",
                     big ? "new" : "run/ckpt/step-20", big ? "big" : "small", ex[i].name, opt);
        }
        const long small = export_rss(args[0]), big = export_rss(args[1]);
        if (CHECK_TSAN) fprintf(stderr, "export_mem: ThreadSanitizer build: RSS bound skipped\n");
        fprintf(stderr, "%-11s peak RSS %ld KiB small, %ld KiB with %u rows of dim %u (%.0f KiB)\n",
                ex[i].name, small, big, ROWS, dim, table_kib);
        CHECK_MSG(small > 0 && big > 0, "export %s failed", ex[i].name);
        CHECK_MSG(CHECK_TSAN || big - small < ex[i].bound_kib,
                  "export %s grew by %ld KiB for a table of %.0f KiB (at most %.0f): it holds "
                  "the table",
                  ex[i].name, big - small, table_kib, ex[i].bound_kib);
    }
    /* The delta with room for old's map in memory: the same bytes. */
    rc = su_ember("export --checkpoint new --out big-delta-mem --since old");
    CHECK(rc == 0);
    rc = rc == 0 ? su_shell(60, "diff -r big-delta big-delta-mem") : rc;
    CHECK_MSG(rc == 0, "the delta differs with --memory 2M and 256M");

    /* What the bundles serve. */
    ember_serve *h = su_open(su_path("big-bundle"), NULL);
    CHECK(h != NULL);
    if (h) check_rows(h, dim, 1, 0);
    ember_serve_close(h);
    rc = su_ember("export --checkpoint old --out big-old");
    CHECK(rc == 0);
    h = rc == 0 ? su_open(su_path("big-old"), (const char *[]){su_path("big-delta"), NULL}) : NULL;
    CHECK(h != NULL);
    if (h) check_rows(h, dim, 1, 1);
    ember_serve_close(h);
    close(zy_cmd); /* the zygote exits */
    close(zy_res);
    wait(NULL);
    return check_done();
}
