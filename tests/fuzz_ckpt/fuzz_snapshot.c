/*
 * libFuzzer target: the embedding snapshot readers (emb_snapshot_read_config, emb_snapshot_step,
 * emb_snapshot_foreach, emb_table_restore, emb_snapshot_sketch_add) on "consistent lies".
 *
 * Two small valid snapshots are written once with the library's own writer (an Adam table of
 * dim 4, one with an admission sketch, one without). Each input picks one, applies up to 8
 * mutations (fuzz_ckpt.h: bytes overwritten, files truncated, extended or removed, rows.bin
 * header integers and record fields set, manifest lines edited) and then recomputes every size
 * and checksum, so the readers see contents that are wrong but verify.
 *
 * Properties checked (abort on violation): every failure is a negative code with a message
 * naming the snapshot directory; a config read back passes emb_table_config_check (a table
 * could have been written with it); rows handed out by foreach have finite weights and no
 * last_step after the snapshot's step; a restored table holds exactly the rows foreach gives
 * (so no key twice) and the snapshot's step; a failed restore returns no table; sketch_add refuses
 * a sketch of another size than the one accumulated.
 */
#include <stdlib.h>
#include <string.h>

#include "embedding/internal.h"
#include "tests/fuzz_ckpt/fuzz_ckpt.h"

#define DIM 4u
#define NKEYS 24u

static char g_work[4200];
static fz_snap g_orig[2], g_cur;
static emb_table_config g_cfg[2];
static size_t g_sketch_n; /* counters of a table's admission sketch */

static void rmtree_at_exit(void)
{
    char base[4200];
    snprintf(base, sizeof base, "%.*s", (int)(strrchr(g_work, '/') - g_work), g_work);
    cm_rmtree(base, NULL);
}

/* A trained table (admission: keys pulled twice are admitted, the rest only counted) and its
 * snapshot in dir, loaded into *s. */
static void make_snapshot(const emb_table_config *cfg, const char *dir, fz_snap *s)
{
    emb_table *t = NULL;
    uint64_t keys[NKEYS];
    float w[NKEYS * DIM], g[NKEYS * DIM];
    for (uint32_t i = 0; i < NKEYS; i++)
        keys[i] = 1000003ull * i + 17;
    for (uint32_t i = 0; i < NKEYS * DIM; i++)
        g[i] = (float)(i % 7) * 0.1f - 0.3f;
    if (emb_table_create(cfg, &t, NULL) != CM_OK) abort();
    for (int round = 0; round < 3; round++) {
        if (emb_table_pull(t, keys, NKEYS - 4 * (size_t)round, w, NULL) != CM_OK ||
            emb_table_push(t, keys, NKEYS - 4 * (size_t)round, g, NULL) != CM_OK)
            abort();
    }
    size_t n = 0;
    if (emb_table_sketch(t, &n) != NULL) g_sketch_n = n;
    if (emb_table_snapshot(t, dir, NULL) != CM_OK) abort();
    emb_table_destroy(t);
    fz_snap_load(s, dir);
}

static void init(void)
{
    const char *tmp = getenv("TMPDIR");
    char base[4096];
    snprintf(base, sizeof base, "%s/ember-fuzz-snap-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (mkdtemp(base) == NULL) abort();
    char dir[4200];
    for (int i = 0; i < 2; i++) {
        emb_table_config_init(&g_cfg[i]);
        g_cfg[i].dim = DIM;
        g_cfg[i].opt = EMB_OPT_ADAM;
        g_cfg[i].seed = 5;
        g_cfg[i].n_sub = 4;
        g_cfg[i].admit_threshold = i == 0 ? 2 : 0;
        snprintf(dir, sizeof dir, "%s/orig%d", base, i);
        make_snapshot(&g_cfg[i], dir, &g_orig[i]);
    }
    snprintf(g_work, sizeof g_work, "%s/work", base);
    if (cm_mkdirs(g_work, NULL) != CM_OK) abort();
    atexit(rmtree_at_exit);
}

typedef struct seen {
    uint64_t *keys;
    size_t n, cap;
    uint64_t step; /* the snapshot's; rows must not be stamped after it */
    uint32_t dim;
} seen;

static int collect(const emb_row *row, void *arg)
{
    seen *s = arg;
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 64;
        s->keys = realloc(s->keys, s->cap * sizeof *s->keys);
        if (s->keys == NULL) abort();
    }
    s->keys[s->n++] = row->key;
    if (row->last_step > s->step) {
        fprintf(stderr, "row %" PRIu64 " stamped at %" PRIu64 ", after the step %" PRIu64 "\n",
                row->key, row->last_step, s->step);
        abort();
    }
    if (cm_f32_first_nonfinite(row->weights, s->dim) != s->dim) {
        fprintf(stderr, "row %" PRIu64 " has a non-finite weight\n", row->key);
        abort();
    }
    return 0;
}

static int count_row(const emb_row *row, void *arg)
{
    (void)row;
    ++*(size_t *)arg;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static bool ready;
    if (!ready) init();
    ready = true;
    fz_in in = {data, size};
    int which = fz_u8(&in) & 1;
    fz_snap_copy(&g_cur, &g_orig[which]);
    int ops = fz_u8(&in) % 8 + 1;
    for (int i = 0; i < ops && in.n > 0; i++)
        fz_snap_op(&g_cur, &in);
    fz_snap_fix(&g_cur);
    fz_snap_store(&g_cur, g_work);

    char *err = NULL;
    emb_table_config cfg;
    int rc = emb_snapshot_read_config(g_work, &cfg, &err);
    fz_check_err(rc, &err, g_work);
    if (rc == CM_OK && emb_table_config_check(&cfg, &err) != CM_OK) {
        fprintf(stderr, "read_config accepted a config no table has: %s\n", err);
        abort();
    }
    uint64_t step = 0;
    int step_rc = emb_snapshot_step(g_work, &step, &err);
    fz_check_err(step_rc, &err, g_work);

    seen s = {.step = step, .dim = DIM};
    int each_rc = emb_snapshot_foreach(g_work, collect, &s, &err);
    fz_check_err(each_rc, &err, g_work);
    /* A key twice is not checked here: export keeps no set of the keys it has seen (8 bytes a
     * row); restore refuses it, and the restore below must give as many rows as foreach. */
    if (each_rc == CM_OK && step_rc != CM_OK) abort(); /* it read a step that could not be */

    emb_table *t = NULL;
    rc = emb_table_restore(g_work, &g_cfg[which], &t, &err);
    fz_check_err(rc, &err, g_work);
    if (rc != CM_OK && t != NULL) abort();
    if (rc == CM_OK) {
        size_t rows = 0;
        if (emb_table_foreach(t, count_row, &rows, NULL) != CM_OK) abort();
        if (each_rc != CM_OK || rows != s.n || emb_table_step(t) != step) {
            fprintf(stderr, "restored %zu rows at step %" PRIu64 "; foreach rc %d, %zu rows\n",
                    rows, emb_table_step(t), each_rc, s.n);
            abort();
        }
        emb_table_destroy(t);
    }
    free(s.keys);

    /* Into nothing (takes the sketch's size), then into a table-sized accumulator. */
    uint16_t *acc = NULL;
    size_t n = 0;
    rc = emb_snapshot_sketch_add(g_work, &acc, &n, &err);
    fz_check_err(rc, &err, g_work);
    if (rc == CM_OK && (acc == NULL) != (n == 0)) abort();
    free(acc);
    acc = calloc(g_sketch_n, sizeof *acc);
    if (acc == NULL) abort();
    size_t n2 = g_sketch_n;
    rc = emb_snapshot_sketch_add(g_work, &acc, &n2, &err);
    fz_check_err(rc, &err, g_work);
    if (n2 != g_sketch_n || (rc == CM_OK && n != 0 && n != g_sketch_n)) abort();
    free(acc);
    return 0;
}
