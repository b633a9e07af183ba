/*
 * emb_snapcut: a snapshot taken while another thread pushes is a consistent cut.
 *
 * One thread pushes the same KEYS keys over and over (SGD, lr 1, zero init, gradient -1), so
 * after p whole pushes every row has updates == p and weights == p, and the table step is p. The
 * main thread meanwhile snapshots the table: in each snapshot every row must hold the same
 * number of updates, and that number must be the snapshot's step. A push caught half applied,
 * or a step that counts a push whose rows are not in the snapshot, breaks this.
 *
 * The table has many sub-shards, so a snapshot's pause (locking them in order) takes long
 * enough that the pushing thread, on the other core, reaches it several times per snapshot.
 * Run with and without admission: with it an in-memory push has no reservation pass, and goes
 * from taking its step straight to the locks of its groups, where it used to stop behind a
 * snapshot's pause (nearly every snapshot broke); without, about one snapshot in four did.
 *
 * Also: two threads snapshotting one table into one directory at once both succeed, and the
 * directory left restores to the table; a restore while another thread replaces the snapshot
 * builds one snapshot or the other, never a mixture of the two.
 */
#include <pthread.h>
#include <stdatomic.h>

#include "emb_util.h"

#define KEYS 64u
#define DIM 4u
#define SNAPS 40u

static const char *g_dir;

/* The pushing thread's job: the keys and their gradients, filled in by run(). */
typedef struct pusher {
    emb_table *t;
    uint64_t keys[KEYS];
    float g[KEYS * DIM];
    atomic_int stop;
    atomic_uint errors;
} pusher;

static void *push_main(void *arg)
{
    pusher *p = arg;
    while (!atomic_load(&p->stop)) {
        char *err = NULL;
        if (emb_table_push(p->t, p->keys, KEYS, p->g, &err) != 0) {
            fprintf(stderr, "  push failed: %s\n", err ? err : "(none)");
            atomic_fetch_add(&p->errors, 1);
        }
        free(err);
    }
    return NULL;
}

typedef struct cut {
    uint64_t rows, updates_min, updates_max;
    int weights_ok;
} cut;

static int cut_cb(const emb_row *row, void *arg)
{
    cut *c = arg;
    c->rows++;
    if (row->updates < c->updates_min) c->updates_min = row->updates;
    if (row->updates > c->updates_max) c->updates_max = row->updates;
    for (uint32_t d = 0; d < DIM; d++)
        c->weights_ok &= row->weights[d] == (float)row->updates;
    return 0;
}

static void run(uint32_t n_sub, uint32_t admit, const char *label)
{
    emb_table_config c = eu_config(EMB_OPT_SGD, DIM);
    c.lr = 1.0f;
    c.init_scale = 0;
    c.n_sub = n_sub;
    c.admit_threshold = admit;
    emb_table *t = eu_create(&c);
    uint64_t keys[KEYS];
    float w[KEYS * DIM];
    for (uint32_t i = 0; i < KEYS; i++)
        keys[i] = eu_key(i);
    eu_pull(t, keys, KEYS, w); /* the second sighting admits every key (admit 2) */
    eu_pull(t, keys, KEYS, w);
    CHECK(eu_count_rows(t) == KEYS);

    pusher p = {.t = t};
    memcpy(p.keys, keys, sizeof keys);
    for (uint32_t i = 0; i < KEYS * DIM; i++)
        p.g[i] = -1.0f;
    atomic_init(&p.stop, 0);
    atomic_init(&p.errors, 0);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, push_main, &p) == 0);
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/%s", g_dir, label);
    uint32_t bad = 0;
    for (uint32_t s = 0; s < SNAPS; s++) {
        char *err = NULL;
        CHECK_OK(emb_table_snapshot(t, dir, &err), err);
        uint64_t step = 0;
        CHECK_OK(emb_snapshot_step(dir, &step, &err), err);
        cut k = {0, UINT64_MAX, 0, 1};
        CHECK_OK(emb_snapshot_foreach(dir, cut_cb, &k, &err), err);
        int ok = k.rows == KEYS && k.updates_min == k.updates_max && k.updates_max == step &&
                 k.weights_ok;
        if (!ok && bad++ < 3)
            fprintf(stderr,
                    "  %s snapshot %u: step %" PRIu64 ", %" PRIu64 " rows with updates %" PRIu64
                    "..%" PRIu64 "%s\n",
                    label, s, step, k.rows, k.updates_min, k.updates_max,
                    k.weights_ok ? "" : ", weights off");
    }
    atomic_store(&p.stop, 1);
    pthread_join(th, NULL);
    CHECK_MSG(bad == 0, "%s: %u of %u snapshots taken during pushes are not a consistent cut",
              label, bad, SNAPS);
    CHECK(atomic_load(&p.errors) == 0);
    cm_rmtree(dir, NULL);
    emb_table_destroy(t);
}

/* A thread snapshotting one table into one directory, over and over. */
typedef struct snapper {
    emb_table *t;
    const char *dir;
    uint32_t failures;
} snapper;

static void *snap_main(void *arg)
{
    snapper *s = arg;
    for (uint32_t i = 0; i < SNAPS; i++) {
        char *err = NULL;
        if (emb_table_snapshot(s->t, s->dir, &err) != 0) {
            if (s->failures++ < 3) fprintf(stderr, "  snapshot failed: %s\n", err ? err : "(none)");
        }
        free(err);
    }
    return NULL;
}

/* Two threads snapshot the same table into the same directory at once (a periodic checkpoint
 * and one asked for on shutdown, say): each call must succeed, and what is left must restore to
 * the table. Both used to build their snapshot in the same "<dir>.tmp.<pid>", each removing and
 * filling the other's files. */
static void run_two_snapshotters(void)
{
    emb_table_config c = eu_config(EMB_OPT_ADAGRAD, DIM);
    emb_table *t = eu_create(&c);
    enum { ROWS = 20000 };
    uint64_t *keys = eu_xmalloc(ROWS * sizeof *keys);
    float *w = eu_xmalloc(ROWS * DIM * sizeof *w);
    for (uint32_t i = 0; i < ROWS; i++)
        keys[i] = eu_key(i);
    eu_pull(t, keys, ROWS, w);
    char dir[4200], *err = NULL;
    snprintf(dir, sizeof dir, "%s/two", g_dir);
    CHECK_OK(emb_table_snapshot(t, dir, &err), err); /* the directory exists from here on */
    snapper a = {t, dir, 0}, b = {t, dir, 0};
    pthread_t ta, tb;
    CHECK(pthread_create(&ta, NULL, snap_main, &a) == 0);
    CHECK(pthread_create(&tb, NULL, snap_main, &b) == 0);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    CHECK_MSG(a.failures == 0 && b.failures == 0,
              "concurrent snapshots into one directory: %u and %u of %u failed", a.failures,
              b.failures, SNAPS);
    emb_table *back = NULL;
    CHECK_OK(emb_table_restore(dir, &c, &back, &err), err);
    if (back != NULL) CHECK(eu_diff_tables(t, back, 1) == 0);
    emb_table_destroy(back);
    emb_table_destroy(t);
    free(keys);
    free(w);
}

/* Snapshots of two tables, one push apart, written in turn into one directory until told to
 * stop. */
typedef struct replacer {
    emb_table *a, *b;
    const char *dir;
    atomic_int stop;
    atomic_uint errors;
} replacer;

static void *replace_main(void *arg)
{
    replacer *r = arg;
    for (uint32_t i = 0; !atomic_load(&r->stop); i++) {
        char *err = NULL;
        if (emb_table_snapshot(i % 2 ? r->b : r->a, r->dir, &err) != 0) {
            fprintf(stderr, "  snapshot failed: %s\n", err ? err : "(none)");
            atomic_fetch_add(&r->errors, 1);
        }
        free(err);
    }
    return NULL;
}

/* A restore while another thread replaces the snapshot it reads: what it builds must be one
 * snapshot or the other (every row's updates equal to the step), never the rows of one with the
 * step of the other. A restore refused because the files changed under it is fine. Restore used
 * to open rows.bin by path twice (verify, then load), so a snapshot swapped in between was
 * loaded unverified, under the manifest of the one before. */
static void run_restore_while_replaced(void)
{
    emb_table_config c = eu_config(EMB_OPT_SGD, DIM);
    c.lr = 1.0f;
    c.init_scale = 0;
    emb_table *a = eu_create(&c), *b = eu_create(&c);
    enum { ROWS = 20000, RESTORES = 60 };
    uint64_t *keys = eu_xmalloc(ROWS * sizeof *keys);
    float *g = eu_xmalloc(ROWS * DIM * sizeof *g);
    for (uint32_t i = 0; i < ROWS; i++)
        keys[i] = eu_key(i);
    for (uint32_t i = 0; i < ROWS * DIM; i++)
        g[i] = -1.0f;
    eu_push(a, keys, ROWS, g); /* a: every row at 1 update, step 1 */
    eu_push(b, keys, ROWS, g);
    eu_push(b, keys, ROWS, g); /* b: 2 and 2, the same size on disk */
    char dir[4200], *err = NULL;
    snprintf(dir, sizeof dir, "%s/replaced", g_dir);
    CHECK_OK(emb_table_snapshot(a, dir, &err), err);
    replacer r = {.a = a, .b = b, .dir = dir};
    atomic_init(&r.stop, 0);
    atomic_init(&r.errors, 0);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, replace_main, &r) == 0);
    /* A large reservation in few sub-shards: each restore then spends a while creating its table
     * (the memory is touched at creation) between reading the snapshot and loading its rows. */
    emb_table_config rc = c;
    rc.n_sub = 4;
    rc.reserve_rows = 20 * ROWS;
    uint32_t mixed = 0, refused = 0;
    for (uint32_t i = 0; i < RESTORES; i++) {
        emb_table *t = NULL;
        if (emb_table_restore(dir, &rc, &t, &err) != 0) {
            refused++;
            free(err);
            err = NULL;
            continue;
        }
        cut k = {0, UINT64_MAX, 0, 1};
        CHECK_OK(emb_table_foreach(t, cut_cb, &k, &err), err);
        uint64_t step = emb_table_step(t);
        if (k.rows != ROWS || k.updates_min != step || k.updates_max != step || !k.weights_ok) {
            if (mixed++ < 3)
                fprintf(stderr,
                        "  restore %u: step %" PRIu64 " with rows at updates %" PRIu64 "..%" PRIu64
                        "\n",
                        i, step, k.updates_min, k.updates_max);
        }
        emb_table_destroy(t);
    }
    atomic_store(&r.stop, 1);
    pthread_join(th, NULL);
    fprintf(stderr, "  restores while replaced: %u mixed, %u refused of %u\n", mixed, refused,
            RESTORES);
    CHECK_MSG(mixed == 0, "%u of %u restores mixed two snapshots (%u refused)", mixed, RESTORES,
              refused);
    CHECK(atomic_load(&r.errors) == 0);
    emb_table_destroy(a);
    emb_table_destroy(b);
    free(keys);
    free(g);
}

int main(void)
{
    g_dir = check_tmpdir("emb_snapcut");
    run(4096, 2, "many_subs");
    run(64, 2, "default_subs");
    run(4096, 0, "many_subs_no_admission");
    run(64, 0, "default_subs_no_admission");
    run_two_snapshotters();
    run_restore_while_replaced();
    return check_done();
}
