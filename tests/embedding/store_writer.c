/*
 * emb_store_writer: a RocksDB database written once from records in any order, in a budget.
 *   - records of 24 and 37 bytes (not a multiple of 8) added in a scrambled order, in calls
 *     of several sizes: few enough to sort in memory, and (in the least budget) so many that
 *     the runs are merged in several passes; the database, opened read-only with the RocksDB
 *     C API, holds each record once under its key (8 big-endian bytes), in key order, byte
 *     for byte, with the edge keys 0 and UINT64_MAX, and an absent key is absent;
 *   - a "rocksdb" store given the same records (emb_store_put) iterates to the same pairs;
 *   - no table is written: the folder holds RocksDB's files only (the scratch runs and the
 *     writer's own table files are gone);
 *   - a second writer at the same path replaces the first's database; no records give an
 *     empty database;
 *   - a key twice (in two runs, and within one sorted buffer) is refused naming the key
 *     (emb_store_writer_twice) and the folder is removed; so is a writer closed unfinished;
 *   - a budget under emb_store_writer_least is refused naming the least.
 */
#include <rocksdb/c.h>
#include <sys/stat.h>
#include <xxhash.h>

#include "emb_util.h"

static char dir[4096];

static uint64_t rec_key(uint64_t i)
{
    if (i == 0) return 0;
    if (i == 1) return UINT64_MAX;
    return eu_key(i);
}

/* The record of a key: the key, then bytes derived from it. */
static void key_rec(uint8_t *rec, size_t rb, uint64_t key)
{
    memcpy(rec, &key, 8);
    uint64_t s = key ^ 0x5bd1e995u;
    for (size_t off = 8; off < rb; off++)
        rec[off] = (uint8_t)(eu_rand(&s) >> 56);
}

static void make_rec(uint8_t *rec, size_t rb, uint64_t i)
{
    key_rec(rec, rb, rec_key(i));
}

static int key_cmp(const void *a, const void *b)
{
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Adds records 0..n-1 in a scrambled order (a multiplicative step coprime to n), in calls of
 * 1, 2, ... 1000 records, and with extra_dup < n record extra_dup again last. */
static int add_all(emb_store_writer *w, size_t rb, uint64_t n, uint64_t extra_dup, char **err)
{
    uint8_t *buf = malloc(1000 * rb);
    uint64_t step = 7919;
    while (n > 1 && (n % step == 0 || step % n == 0))
        step += 2;
    uint64_t j = 0;
    int rc = 0;
    for (uint64_t c = 1; rc == 0 && j < n + (extra_dup != UINT64_MAX); c = c % 1000 + 1) {
        size_t k = 0;
        for (; k < c && j < n + (extra_dup != UINT64_MAX); k++, j++)
            make_rec(buf + k * rb, rb, j < n ? (j * step) % n : extra_dup);
        rc = emb_store_writer_add(w, buf, k, err);
    }
    free(buf);
    return rc;
}

static uint64_t be_key(const char *k)
{
    uint64_t key = 0;
    for (int i = 0; i < 8; i++)
        key = key << 8 | (uint8_t)k[i];
    return key;
}

/* The database at path holds exactly records 0..n-1 of rb bytes; 0 or -1 (reported). */
static int check_db(const char *path, size_t rb, uint64_t n)
{
    rocksdb_options_t *o = rocksdb_options_create();
    char *err = NULL;
    rocksdb_t *db = rocksdb_open_for_read_only(o, path, 0, &err);
    CHECK_MSG(db != NULL, "open %s: %s", path, err ? err : "?");
    free(err);
    err = NULL;
    if (db == NULL) {
        rocksdb_options_destroy(o);
        return -1;
    }
    /* The keys of 0..n-1 in order: the seen-th record read has the seen-th smallest. */
    uint64_t *keys = malloc((n + 1) * sizeof *keys);
    for (uint64_t i = 0; i < n; i++)
        keys[i] = rec_key(i);
    qsort(keys, n, sizeof *keys, key_cmp);
    uint8_t *want = malloc(rb);
    rocksdb_readoptions_t *ro = rocksdb_readoptions_create();
    rocksdb_iterator_t *it = rocksdb_create_iterator(db, ro);
    uint64_t seen = 0, bad = 0;
    for (rocksdb_iter_seek_to_first(it); rocksdb_iter_valid(it); rocksdb_iter_next(it)) {
        size_t kl = 0, vl = 0;
        const char *k = rocksdb_iter_key(it, &kl);
        const char *v = rocksdb_iter_value(it, &vl);
        bool ok = kl == 8 && vl == rb && seen < n && be_key(k) == keys[seen];
        if (ok) key_rec(want, rb, keys[seen]);
        ok = ok && memcmp(v, want, rb) == 0;
        if (!ok && bad++ < 3) fprintf(stderr, "%s: record %" PRIu64 " wrong\n", path, seen);
        seen++;
    }
    rocksdb_iter_get_error(it, &err);
    CHECK_MSG(err == NULL, "iterating %s: %s", path, err ? err : "");
    free(err);
    err = NULL;
    CHECK_MSG(seen == n && bad == 0, "%s: %" PRIu64 " records of %" PRIu64 ", %" PRIu64 " wrong",
              path, seen, n, bad);
    char kb[8] = {0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5b};
    size_t vl = 0;
    char *v = rocksdb_get(db, ro, kb, 8, &vl, &err);
    CHECK(v == NULL && err == NULL);
    free(v);
    free(err);
    rocksdb_iter_destroy(it);
    rocksdb_readoptions_destroy(ro);
    rocksdb_close(db);
    rocksdb_options_destroy(o);
    free(want);
    free(keys);
    return seen == n && bad == 0 ? 0 : -1;
}

/* Every name in path is one RocksDB gives its files: no scratch run, no table of the writer's
 * own naming left. */
static void check_only_rocksdb(const char *path)
{
    char cmd[4400];
    snprintf(cmd, sizeof cmd,
             "ls '%s' | grep -Ev '^([0-9]+\\.(sst|log)|CURRENT|IDENTITY|LOCK|LOG|MANIFEST-[0-9]+|"
             "OPTIONS-[0-9]+)$' >&2",
             path);
    CHECK_MSG(system(cmd) != 0, "%s holds files other than RocksDB's (above)", path);
}

/* Writes records 0..n-1 of rb bytes at path in mem bytes; 0 or -1. */
static int write_db(const char *path, size_t rb, uint64_t n, uint64_t mem)
{
    emb_store_writer *w = NULL;
    char *err = NULL;
    int rc = emb_store_writer_open(path, rb, mem, &w, &err);
    CHECK_MSG(rc == 0, "open %s: %s", path, err ? err : "?");
    if (rc == 0) rc = add_all(w, rb, n, UINT64_MAX, &err);
    if (rc == 0) rc = emb_store_writer_finish(w, &err);
    CHECK_MSG(rc == 0, "writing %s: %s", path, err ? err : "?");
    free(err);
    emb_store_writer_close(w);
    return rc;
}

/* The same records through a "rocksdb" store iterate to the same pairs as the writer's. */
static int store_cb(const void *rec, void *arg)
{
    uint64_t *h = arg;
    h[0] = XXH3_64bits_withSeed(rec, (size_t)h[1], h[0]);
    return 0;
}

static void check_same_as_store(const char *path, size_t rb, uint64_t n)
{
    char spath[4200];
    snprintf(spath, sizeof spath, "%s/store", dir);
    emb_store *s = NULL;
    char *err = NULL;
    int rc = emb_store_create("rocksdb", spath, rb, &s, &err);
    uint8_t *rec = malloc(rb);
    for (uint64_t i = 0; rc == 0 && i < n; i++) {
        make_rec(rec, rb, i);
        rc = emb_store_put(s, rec, 1, &err);
    }
    uint64_t hs[2] = {0, rb}, hw = 0;
    if (rc == 0) rc = emb_store_foreach(s, store_cb, hs, &err);
    CHECK_MSG(rc == 0, "store: %s", err ? err : "?");
    free(err);
    emb_store_drop(s, NULL);
    rocksdb_options_t *o = rocksdb_options_create();
    err = NULL;
    rocksdb_t *db = rocksdb_open_for_read_only(o, path, 0, &err);
    rocksdb_readoptions_t *ro = rocksdb_readoptions_create();
    rocksdb_iterator_t *it = db ? rocksdb_create_iterator(db, ro) : NULL;
    for (rocksdb_iter_seek_to_first(it); it && rocksdb_iter_valid(it); rocksdb_iter_next(it)) {
        size_t vl = 0;
        const char *v = rocksdb_iter_value(it, &vl);
        hw = XXH3_64bits_withSeed(v, vl, hw);
    }
    CHECK_MSG(db != NULL && hw == hs[0], "%s: the writer's records differ from a store's", path);
    if (it) rocksdb_iter_destroy(it);
    rocksdb_readoptions_destroy(ro);
    if (db) rocksdb_close(db);
    rocksdb_options_destroy(o);
    free(err);
    free(rec);
}

/* A key twice: refused at finish naming it, and the folder gone. */
static void check_twice(size_t rb, uint64_t n, uint64_t mem, uint64_t dup)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/twice", dir);
    emb_store_writer *w = NULL;
    char *err = NULL;
    int rc = emb_store_writer_open(path, rb, mem, &w, &err);
    CHECK(rc == 0);
    if (rc == 0) rc = add_all(w, rb, n, dup, &err); /* refused here, or by the finish */
    if (rc == 0) rc = emb_store_writer_finish(w, &err);
    uint64_t key = 0;
    CHECK_MSG(rc == CM_EINVAL && w && emb_store_writer_twice(w, &key) && key == rec_key(dup) &&
                  err && strstr(err, "twice"),
              "a key twice (%" PRIu64 " records, memory %" PRIu64 "): rc %d, key %" PRIu64
              " of %" PRIu64 ": %s",
              n, mem, rc, key, rec_key(dup), err ? err : "(no message)");
    free(err);
    emb_store_writer_close(w);
    CHECK_MSG(access(path, F_OK) != 0, "%s left behind a refused writer", path);
}

int main(void)
{
    snprintf(dir, sizeof dir, "%s", check_tmpdir("emb_store_writer"));
    char path[4200], *err = NULL;
    snprintf(path, sizeof path, "%s/db", dir);
    static const size_t rbs[] = {24, 37};
    for (size_t r = 0; r < 2; r++) {
        const size_t rb = rbs[r];
        const uint64_t least = emb_store_writer_least(rb);
        /* In memory, then in the least budget: ~140 runs of ~1,400, merged 7 at a time. */
        fprintf(stderr, "--- records of %zu bytes (least budget %" PRIu64 ")\n", rb, least);
        if (write_db(path, rb, 3000, 64u << 20) == 0) check_db(path, rb, 3000);
        check_only_rocksdb(path);
        check_same_as_store(path, rb, 3000);
        const uint64_t many = 200000;
        if (write_db(path, rb, many, least) == 0) check_db(path, rb, many);
        check_only_rocksdb(path);
        check_twice(rb, many, least, many / 3);
        check_twice(rb, 3000, 64u << 20, 17);
    }
    fprintf(stderr, "--- no records; a writer closed unfinished; too little memory\n");
    if (write_db(path, 24, 0, 1u << 20) == 0) check_db(path, 24, 0);
    emb_store_writer *w = NULL;
    int rc = emb_store_writer_open(path, 24, 1u << 20, &w, &err);
    CHECK(rc == 0);
    if (rc == 0) rc = add_all(w, 24, 50000, UINT64_MAX, &err);
    CHECK(rc == 0);
    emb_store_writer_close(w);
    CHECK_MSG(access(path, F_OK) != 0, "%s left behind a writer closed unfinished", path);
    w = NULL;
    rc = emb_store_writer_open(path, 24, emb_store_writer_least(24) - 1, &w, &err);
    char least[64];
    snprintf(least, sizeof least, "%" PRIu64, emb_store_writer_least(24));
    CHECK_MSG(rc == CM_EINVAL && w == NULL && err && strstr(err, least),
              "a budget under the least: rc %d: %s", rc, err ? err : "(no message)");
    free(err);
    return check_done();
}
