/*
 * emb_spillpath: a table's spill directory is its own only once it has opened the database
 * there. A second table given the path of a live table's spill (two shards or processes
 * configured alike) must fail to create and leave the live database alone: the live table
 * keeps every row and keeps spilling. Nor may a failed create remove a file it was pointed at.
 * A spill path that already holds other files is shared, not the table's: destroying the table
 * removes its database and leaves those files. An earlier database there that cannot be wiped
 * fails the create rather than being half reused.
 */
#include <errno.h>
#include <sys/stat.h>

#include "emb_util.h"

static void test_in_use(const char *dir)
{
    /* Enough rows through a one-sub-shard budget that the spill's memtables flush after the
     * failed create: a flush into a directory emptied under RocksDB fails every later write. */
    enum { D = 8, N = 60000 };
    char spill[4200], cur[4300];
    snprintf(spill, sizeof spill, "%s/spill", dir);
    snprintf(cur, sizeof cur, "%s/CURRENT", spill);
    emb_table_config c = eu_config(EMB_OPT_ADAGRAD, D);
    c.n_sub = 1;
    c.mem_budget_bytes = 64 * (emb_row_bytes(&c) + 1);
    c.spill_path = spill;
    emb_table *a = eu_create(&c);
    uint64_t *keys = eu_xmalloc(N * sizeof *keys);
    float *g = eu_xcalloc((size_t)N * D, sizeof *g);
    for (size_t i = 0; i < N; i++)
        keys[i] = eu_key(i);
    for (size_t i = 0; i < (size_t)N * D; i++)
        g[i] = 0.25f;
    eu_push(a, keys, N, g);

    emb_table *b = NULL;
    char *err = NULL;
    int rc = emb_table_create(&c, &b, &err);
    CHECK_MSG(rc == CM_EIO && b == NULL && err != NULL && eu_has(err, spill),
              "second table on a live spill path: rc=%d err=%s", rc, err ? err : "(none)");
    free(err);
    emb_table_destroy(b);

    struct stat st;
    CHECK_MSG(stat(cur, &st) == 0, "the live table's spill database %s lost its CURRENT", spill);
    eu_push(a, keys, N, g);
    eu_push(a, keys, N, g);
    CHECK(eu_count_rows(a) == N);
    eu_row *r = eu_xmalloc(sizeof *r);
    for (size_t i = 0; i < N; i += 997)
        CHECK_MSG(eu_get(a, keys[i], r) && r->updates == 3, "row %zu after the failed create", i);
    free(r);
    emb_table_destroy(a);
    free(keys);
    free(g);
}

/* A spill path naming an existing regular file cannot hold a database: the create fails and the
 * file, which was never the table's, is left as it was (it used to be removed). */
static void test_file(const char *dir)
{
    char file[4200];
    snprintf(file, sizeof file, "%s/precious.txt", dir);
    char *err = NULL;
    CHECK_OK(cm_write_file_atomic(file, "keep me\n", 8, &err), err);
    emb_table_config c = eu_config(EMB_OPT_SGD, 4);
    c.mem_budget_bytes = 1 << 20;
    c.spill_path = file;
    emb_table *t = NULL;
    int rc = emb_table_create(&c, &t, &err);
    CHECK_MSG(rc == CM_EIO && t == NULL && err != NULL && eu_has(err, file),
              "spill path on a regular file: rc=%d err=%s", rc, err ? err : "(none)");
    free(err);
    err = NULL;
    emb_table_destroy(t);
    void *data = NULL;
    size_t len = 0;
    CHECK_OK(cm_read_file(file, &data, &len, &err), err);
    CHECK_MSG(len == 8 && data != NULL && memcmp(data, "keep me\n", 8) == 0,
              "a failed create changed %s", file);
    free(data);
}

/* Creates a table spilling to spill, with rows pushed through a small budget so that some
 * live in its database. */
static emb_table *spilling_table(const char *spill, emb_table_config *c)
{
    enum { N = 20000 };
    *c = eu_config(EMB_OPT_SGD, 4);
    c->n_sub = 1;
    c->mem_budget_bytes = 64 * (emb_row_bytes(c) + 1);
    c->spill_path = spill;
    emb_table *t = eu_create(c);
    uint64_t *keys = eu_xmalloc(N * sizeof *keys);
    float *g = eu_xcalloc((size_t)N * 4, sizeof *g);
    for (size_t i = 0; i < N; i++)
        keys[i] = eu_key(i);
    eu_push(t, keys, N, g);
    free(keys);
    free(g);
    CHECK(eu_stats(t).rows_spilled > 0);
    return t;
}

static int exists(const char *dir, const char *name)
{
    char p[4400];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    struct stat st;
    return lstat(p, &st) == 0;
}

/* A spill path pointed at a directory that holds other files (RocksDB opens there fine):
 * destroying the table used to remove the whole directory, the other files with it. */
static void test_shared_dir(const char *dir)
{
    char shared[4200], sub[4300], file[4300], nested[4400];
    snprintf(shared, sizeof shared, "%s/shared", dir);
    snprintf(sub, sizeof sub, "%s/keep", shared);
    snprintf(file, sizeof file, "%s/notes.txt", shared);
    snprintf(nested, sizeof nested, "%s/nested.txt", sub);
    char *err = NULL;
    CHECK_OK(cm_mkdirs(sub, &err), err);
    CHECK_OK(cm_write_file_atomic(file, "notes\n", 6, &err), err);
    CHECK_OK(cm_write_file_atomic(nested, "nested\n", 7, &err), err);
    emb_table_config c;
    emb_table_destroy(spilling_table(shared, &c));
    CHECK_MSG(exists(shared, "notes.txt") && exists(shared, "keep/nested.txt"),
              "destroying a table removed files in %s that were not its own", shared);
    /* Its own files are gone: nothing of the database is left behind. */
    CHECK_MSG(!exists(shared, "CURRENT") && !exists(shared, "LOCK") && !exists(shared, "LOG") &&
                  !exists(shared, "IDENTITY"),
              "destroying a table left its spill database in %s", shared);

    /* A path that did not exist is the table's own, and goes whole (ps and the trainer point
     * each table at a directory of its own and rely on this). */
    char own[4200];
    snprintf(own, sizeof own, "%s/own/spill", dir);
    emb_table_destroy(spilling_table(own, &c));
    CHECK_MSG(access(own, F_OK) != 0, "destroy left the spill directory %s", own);
}

/* An earlier database at the spill path (same record size) that the create cannot wipe: an
 * entry under a RocksDB file name that unlink refuses, even for root (a directory). The create
 * used to ignore the failed wipe and open there anyway; it must fail naming the path. */
static void test_unwipeable(const char *dir)
{
    char stale[4200], blocker[4300];
    snprintf(stale, sizeof stale, "%s/stale", dir);
    snprintf(blocker, sizeof blocker, "%s/000999.log", stale);
    emb_table_config c = eu_config(EMB_OPT_SGD, 4);
    char *err = NULL;
    emb_store *s = NULL;
    CHECK_OK(emb_store_create("rocksdb", stale, emb_row_bytes(&c), &s, &err), err);
    if (s == NULL) return;
    uint64_t rec[64] = {0};
    rec[0] = 42;
    CHECK_OK(emb_store_put(s, rec, 1, &err), err);
    emb_store_destroy(s);
    CHECK_MSG(mkdir(blocker, 0755) == 0, "mkdir %s: %s", blocker, strerror(errno));

    c.mem_budget_bytes = 1 << 20;
    c.spill_path = stale;
    emb_table *t = NULL;
    int rc = emb_table_create(&c, &t, &err);
    CHECK_MSG(rc == CM_EIO && t == NULL && err != NULL && eu_has(err, stale),
              "spill path with an unwipeable earlier database: rc=%d err=%s", rc,
              err ? err : "(none)");
    free(err);
    emb_table_destroy(t);
    CHECK_MSG(exists(stale, "000999.log"), "a failed create removed %s", blocker);
}

int main(void)
{
    const char *dir = check_tmpdir("emb_spillpath");
    test_in_use(dir);
    test_file(dir);
    test_shared_dir(dir);
    test_unwipeable(dir);
    return check_done();
}
