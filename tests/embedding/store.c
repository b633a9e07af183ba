/*
 * emb_store: one conformance suite run over every row-store kind ("memory", "rocksdb") and a
 * few record sizes (16: the smallest this test can tag; 36: not a multiple of 8, as an SGD row
 * of dim 3 is; 152: an Adagrad row of dim 16).
 *
 * Records carry their own identity (key | universe index | version | filler derived from both),
 * so any record read back can be checked without a lookup, and a stale or torn record shows.
 */
#include <malloc.h>
#include <sys/resource.h>

#include "emb_util.h"

static const char *const KINDS[] = {"memory", "rocksdb"};
static const size_t REC_SIZES[] = {16, 36, 152};

#define UNIVERSE 3000u   /* keys the random-operation model draws from */
#define MANY 100000u     /* keys for the growth test */
#define RANDOM_ITERS 1500u

/* Key for universe index i; the first two are the edge keys a hash table likes to reserve. */
static uint64_t ukey(uint32_t i)
{
    if (i == 0) return 0;
    if (i == 1) return UINT64_MAX;
    return eu_key(i);
}

static void make_rec(uint8_t *rec, size_t rb, uint32_t idx, uint32_t ver)
{
    uint64_t key = ukey(idx);
    memcpy(rec, &key, 8);
    memcpy(rec + 8, &idx, 4);
    memcpy(rec + 12, &ver, 4);
    uint64_t s = key ^ ((uint64_t)ver << 32) ^ idx;
    for (size_t off = 16; off < rb; off += 8) {
        uint64_t v = eu_rand(&s);
        memcpy(rec + off, &v, rb - off < 8 ? rb - off : 8);
    }
}

/* 1 when rec is exactly the record (idx, ver). */
static int rec_is(const uint8_t *rec, size_t rb, uint32_t idx, uint32_t ver)
{
    uint8_t want[256];
    make_rec(want, rb, idx, ver);
    return memcmp(rec, want, rb) == 0;
}

static uint32_t rec_idx(const uint8_t *rec)
{
    uint32_t i;
    memcpy(&i, rec + 8, 4);
    return i;
}

static uint32_t rec_ver(const uint8_t *rec)
{
    uint32_t v;
    memcpy(&v, rec + 12, 4);
    return v;
}

static emb_store *open_store(const char *kind, const char *dir, size_t rb)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/%s_%zu", dir, kind, rb);
    emb_store *s = NULL;
    char *err = NULL;
    int rc = emb_store_create(kind, path, rb, &s, &err);
    CHECK_MSG(rc == 0 && s != NULL, "%s create rc=%d err=%s", kind, rc, err ? err : "(none)");
    free(err);
    if (rc == 0 && s != NULL) CHECK(strcmp(emb_store_kind(s), kind) == 0);
    return rc == 0 ? s : NULL;
}

static void put_one(emb_store *s, size_t rb, uint32_t idx, uint32_t ver)
{
    uint8_t rec[256];
    make_rec(rec, rb, idx, ver);
    char *err = NULL;
    CHECK_OK(emb_store_put(s, rec, 1, &err), err);
}

/* Reads one key: its version, or 0 when absent (the record buffer must then be untouched). */
static uint32_t get_one(emb_store *s, size_t rb, uint32_t idx)
{
    uint8_t rec[256];
    uint8_t found = 2;
    uint64_t key = ukey(idx);
    char *err = NULL;
    memset(rec, 0xa5, sizeof rec);
    CHECK_OK(emb_store_get(s, &key, 1, rec, &found, &err), err);
    CHECK(found == 0 || found == 1);
    if (found != 1) {
        uint8_t sentinel[256];
        memset(sentinel, 0xa5, sizeof sentinel);
        CHECK_MSG(memcmp(rec, sentinel, rb) == 0, "absent key wrote its record");
        return 0;
    }
    CHECK_MSG(rec_idx(rec) == idx && rec_is(rec, rb, idx, rec_ver(rec)), "torn record");
    return rec_ver(rec);
}

/* ---- foreach helpers ---- */
typedef struct walk {
    size_t rb;
    uint32_t n_idx;         /* size of seen/expect */
    const uint32_t *expect; /* expected version per index, 0 = absent */
    uint8_t *seen;
    uint64_t visits, bad;
    uint64_t stop_after; /* 0 = never stop */
} walk;

static int walk_cb(const void *record, void *arg)
{
    walk *w = arg;
    const uint8_t *rec = record;
    w->visits++;
    uint32_t idx = rec_idx(rec);
    if (idx >= w->n_idx || w->seen[idx] || !rec_is(rec, w->rb, idx, rec_ver(rec)) ||
        (w->expect != NULL && w->expect[idx] != rec_ver(rec))) {
        w->bad++;
    } else {
        w->seen[idx] = 1;
    }
    if (w->stop_after && w->visits == w->stop_after) return 7;
    return 0;
}

/* Walks the store and checks it holds exactly expect[] (every index with a non-zero version,
 * once, with that version). */
static void check_walk(emb_store *s, size_t rb, const uint32_t *expect, uint32_t n_idx)
{
    walk w = {.rb = rb, .n_idx = n_idx, .expect = expect, .seen = eu_xcalloc(n_idx, 1)};
    char *err = NULL;
    CHECK_OK(emb_store_foreach(s, walk_cb, &w, &err), err);
    uint64_t want = 0;
    for (uint32_t i = 0; i < n_idx; i++) {
        if (expect[i] == 0) continue;
        want++;
        if (!w.seen[i]) w.bad++;
    }
    CHECK_MSG(w.bad == 0 && w.visits == want, "%s foreach: %" PRIu64 " visits, %" PRIu64
              " expected, %" PRIu64 " bad", emb_store_kind(s), w.visits, want, w.bad);
    free(w.seen);
}

/* ---- the suite ---- */

static void test_basic(emb_store *s, size_t rb)
{
    uint32_t expect[UNIVERSE] = {0};
    char *err = NULL;
    CHECK(emb_store_count(s) == 0);
    check_walk(s, rb, expect, UNIVERSE);
    CHECK(get_one(s, rb, 5) == 0);
    CHECK(get_one(s, rb, 0) == 0);
    uint64_t k5 = ukey(5);
    CHECK_OK(emb_store_del(s, &k5, 1, &err), err); /* absent: fine */
    CHECK(emb_store_count(s) == 0);
    CHECK_OK(emb_store_get(s, NULL, 0, NULL, NULL, &err), err);
    CHECK_OK(emb_store_put(s, NULL, 0, &err), err);
    CHECK_OK(emb_store_del(s, NULL, 0, &err), err);

    /* put / get / replace / del, including the edge keys 0 and UINT64_MAX */
    for (uint32_t idx = 0; idx < 3; idx++) put_one(s, rb, idx, 1);
    CHECK(emb_store_count(s) == 3);
    for (uint32_t idx = 0; idx < 3; idx++) CHECK(get_one(s, rb, idx) == 1);
    CHECK(get_one(s, rb, 3) == 0);
    put_one(s, rb, 1, 2); /* replace keeps the count */
    CHECK(emb_store_count(s) == 3);
    CHECK(get_one(s, rb, 1) == 2);
    CHECK(get_one(s, rb, 0) == 1);
    expect[0] = 1, expect[1] = 2, expect[2] = 1;
    check_walk(s, rb, expect, UNIVERSE);
    uint64_t k0 = ukey(0);
    CHECK_OK(emb_store_del(s, &k0, 1, &err), err);
    CHECK(emb_store_count(s) == 2);
    CHECK(get_one(s, rb, 0) == 0);
    CHECK(get_one(s, rb, 1) == 2);

    /* duplicates inside one batch: a put applies in order (last wins, counted once), a delete
     * of a key twice removes it once */
    uint8_t recs[2 * 256];
    make_rec(recs, rb, 10, 1);
    make_rec(recs + rb, rb, 10, 2);
    CHECK_OK(emb_store_put(s, recs, 2, &err), err);
    CHECK(emb_store_count(s) == 3);
    CHECK(get_one(s, rb, 10) == 2);
    uint64_t dup[3] = {ukey(10), ukey(10), ukey(11)};
    CHECK_OK(emb_store_del(s, dup, 3, &err), err);
    CHECK(emb_store_count(s) == 2);

    /* a batched get with duplicates and absent keys */
    uint64_t keys[4] = {ukey(1), ukey(7), ukey(1), ukey(2)};
    uint8_t out[4 * 256], found[4];
    memset(out, 0xa5, sizeof out);
    CHECK_OK(emb_store_get(s, keys, 4, out, found, &err), err);
    CHECK(found[0] == 1 && found[1] == 0 && found[2] == 1 && found[3] == 1);
    CHECK(rec_is(out, rb, 1, 2) && rec_is(out + 2 * rb, rb, 1, 2) && rec_is(out + 3 * rb, rb, 2, 1));
    CHECK(out[rb] == 0xa5 && out[2 * rb - 1] == 0xa5);

    /* foreach stops on a non-zero return and hands it back */
    uint8_t seen[UNIVERSE] = {0};
    walk w = {.rb = rb, .n_idx = UNIVERSE, .seen = seen, .stop_after = 1};
    int rc = emb_store_foreach(s, walk_cb, &w, &err);
    CHECK_MSG(rc == 7 && w.visits == 1, "foreach stop: rc=%d visits=%" PRIu64, rc, w.visits);
    free(err);
    err = NULL;

    uint64_t rest[2] = {ukey(1), ukey(2)};
    CHECK_OK(emb_store_del(s, rest, 2, &err), err);
    CHECK(emb_store_count(s) == 0);
}

/* n keys in batches: growth far past any initial capacity, then delete half and re-put. */
static void many_keys(emb_store *s, size_t rb, uint32_t n)
{
    enum { BATCH = 1000 };
    uint8_t *recs = eu_xmalloc(BATCH * rb);
    uint8_t *out = eu_xmalloc(BATCH * rb);
    uint8_t found[BATCH];
    uint64_t keys[BATCH];
    uint32_t *expect = eu_xcalloc(n + 2, sizeof *expect);
    char *err = NULL;
    /* indices 2.. avoid the edge keys, which test_basic covered */
    for (uint32_t b = 0; b < n; b += BATCH) {
        for (uint32_t i = 0; i < BATCH; i++) {
            make_rec(recs + i * rb, rb, b + i + 2, 1);
            expect[b + i + 2] = 1;
        }
        CHECK_OK(emb_store_put(s, recs, BATCH, &err), err);
    }
    CHECK_MSG(emb_store_count(s) == n, "%s count %" PRIu64, emb_store_kind(s), emb_store_count(s));
    check_walk(s, rb, expect, n + 2);

    /* delete every odd index, replace every index divisible by 4 */
    for (uint32_t b = 0; b < n; b += BATCH) {
        size_t nd = 0, np = 0;
        for (uint32_t i = 0; i < BATCH; i++) {
            uint32_t idx = b + i + 2;
            if (idx % 2) {
                keys[nd++] = ukey(idx);
                expect[idx] = 0;
            } else if (idx % 4 == 0) {
                make_rec(recs + np++ * rb, rb, idx, 2);
                expect[idx] = 2;
            }
        }
        CHECK_OK(emb_store_del(s, keys, nd, &err), err);
        CHECK_OK(emb_store_put(s, recs, np, &err), err);
    }
    CHECK(emb_store_count(s) == n / 2);
    uint64_t bad = 0;
    for (uint32_t b = 0; b < n; b += BATCH) {
        for (uint32_t i = 0; i < BATCH; i++) keys[i] = ukey(b + i + 2);
        CHECK_OK(emb_store_get(s, keys, BATCH, out, found, &err), err);
        for (uint32_t i = 0; i < BATCH; i++) {
            uint32_t idx = b + i + 2;
            if (found[i] != (expect[idx] != 0) ||
                (found[i] && !rec_is(out + i * rb, rb, idx, expect[idx])))
                bad++;
        }
    }
    CHECK_MSG(bad == 0, "%s: %" PRIu64 " wrong reads after delete/replace", emb_store_kind(s), bad);
    check_walk(s, rb, expect, n + 2);

    for (uint32_t b = 0; b < n; b += BATCH) {
        for (uint32_t i = 0; i < BATCH; i++) keys[i] = ukey(b + i + 2);
        CHECK_OK(emb_store_del(s, keys, BATCH, &err), err);
    }
    CHECK(emb_store_count(s) == 0);
    free(recs);
    free(out);
    free(expect);
}

static void test_many(emb_store *s, size_t rb)
{
    many_keys(s, rb, MANY);
}

/* The same over 40 MiB of records: past the RocksDB store's 4 MiB memtables and its level-0
 * compaction trigger (8 files), so the walks and reads cross memtables, level-0 files and
 * compacted levels, with older versions and deletions of a key in other files than its newest
 * one. A walk that missed a file, or a row within one (a prefix-indexed table walked in prefix
 * order), shows as a missing visit. */
static void test_levels(emb_store *s, size_t rb)
{
    many_keys(s, rb, (uint32_t)((40u << 20) / rb / 1000 * 1000));
}

/* Rows on disk, then many versions of some keys in the memtable, then deletions on top: a walk
 * must skip the older versions of a key without losing its place. RocksDB's iterator re-seeks
 * after 8 skipped versions of one key, and a PlainTable in prefix-hash mode can neither seek
 * in total order (the walk fails) nor see other keys after a prefix seek (it would end early). */
static void test_versions(emb_store *s, size_t rb)
{
    enum { BATCH = 1000, KEYS = 40000, HOT = 1000, VERSIONS = 20 };
    uint8_t *recs = eu_xmalloc(BATCH * rb);
    uint32_t *expect = eu_xcalloc(KEYS + 2, sizeof *expect);
    uint64_t keys[BATCH];
    char *err = NULL;
    /* 6 MB of records at 152 bytes: more than one 4 MiB memtable, so some reach table files */
    for (uint32_t v = 1; v <= VERSIONS; v++) {
        for (uint32_t b = 0; b < (v == 1 ? KEYS : HOT); b += BATCH) {
            for (uint32_t i = 0; i < BATCH; i++) {
                make_rec(recs + i * rb, rb, b + i + 2, v);
                expect[b + i + 2] = v;
            }
            CHECK_OK(emb_store_put(s, recs, BATCH, &err), err);
        }
    }
    check_walk(s, rb, expect, KEYS + 2);
    for (uint32_t b = 0; b < KEYS; b += BATCH) {
        size_t nd = 0;
        for (uint32_t i = 0; i < BATCH; i++) {
            uint32_t idx = b + i + 2;
            if (idx % 3 == 0) continue;
            keys[nd++] = ukey(idx);
            expect[idx] = 0;
        }
        CHECK_OK(emb_store_del(s, keys, nd, &err), err);
    }
    check_walk(s, rb, expect, KEYS + 2);
    free(recs);
    free(expect);
}

/* Random puts, deletes and gets over a small universe, checked against an array model. */
static void test_random(emb_store *s, size_t rb, uint64_t seed)
{
    enum { MAXB = 64 };
    uint32_t model[UNIVERSE] = {0};
    uint32_t stamp[UNIVERSE] = {0}; /* de-duplicates put batches */
    uint8_t recs[MAXB * 256], found[MAXB];
    uint64_t keys[MAXB];
    uint32_t idxs[MAXB];
    uint32_t version = 0;
    uint64_t live = 0, bad_reads = 0, bad_counts = 0;
    const int scan_count = strcmp(emb_store_kind(s), "rocksdb") == 0;
    char *err = NULL;
    for (uint32_t it = 1; it <= RANDOM_ITERS; it++) {
        size_t m = 1 + eu_below(&seed, MAXB);
        uint64_t op = eu_below(&seed, 10);
        if (op < 4) { /* put distinct keys, a fresh version each */
            size_t np = 0;
            for (size_t i = 0; i < m; i++) {
                uint32_t idx = (uint32_t)eu_below(&seed, UNIVERSE);
                if (stamp[idx] == it) continue;
                stamp[idx] = it;
                ++version;
                make_rec(recs + np * rb, rb, idx, version);
                live += model[idx] == 0;
                model[idx] = version;
                np++;
            }
            CHECK_OK(emb_store_put(s, recs, np, &err), err);
        } else if (op < 7) { /* delete, duplicates and absent keys allowed */
            for (size_t i = 0; i < m; i++) {
                uint32_t idx = (uint32_t)eu_below(&seed, UNIVERSE);
                keys[i] = ukey(idx);
                live -= model[idx] != 0;
                model[idx] = 0;
            }
            CHECK_OK(emb_store_del(s, keys, m, &err), err);
        } else { /* batched get with duplicates */
            for (size_t i = 0; i < m; i++) {
                idxs[i] = (uint32_t)eu_below(&seed, UNIVERSE);
                keys[i] = ukey(idxs[i]);
            }
            memset(recs, 0xa5, m * rb);
            CHECK_OK(emb_store_get(s, keys, m, recs, found, &err), err);
            for (size_t i = 0; i < m; i++) {
                const uint8_t *r = recs + i * rb;
                int ok = model[idxs[i]] ? found[i] == 1 && rec_is(r, rb, idxs[i], model[idxs[i]])
                                        : found[i] == 0 && r[0] == 0xa5 && r[rb - 1] == 0xa5;
                bad_reads += !ok;
            }
        }
        /* A rocksdb count is a scan of every record and tombstone (the table keeps its own
         * count): every 8th state, which is still ~190 states a run, keeps this part at ~2 s
         * instead of ~13 s under ASan. */
        if (scan_count == 0 || it % 8 == 0) bad_counts += emb_store_count(s) != live;
        if (it % 250 == 0) check_walk(s, rb, model, UNIVERSE);
    }
    bad_counts += emb_store_count(s) != live;
    CHECK_MSG(bad_reads == 0 && bad_counts == 0, "%s random ops: %" PRIu64 " bad reads, %" PRIu64
              " bad counts", emb_store_kind(s), bad_reads, bad_counts);
    check_walk(s, rb, model, UNIVERSE);
}

/* A rocksdb store is created empty even where one existed: the spill is private scratch. */
static void test_reopen_wipes(const char *kind, const char *dir, size_t rb)
{
    emb_store *s = open_store(kind, dir, rb);
    if (s == NULL) return;
    put_one(s, rb, 42, 1);
    emb_store_destroy(s);
    s = open_store(kind, dir, rb);
    if (s == NULL) return;
    CHECK_MSG(emb_store_count(s) == 0 && get_one(s, rb, 42) == 0, "%s: reopened store not empty",
              kind);
    emb_store_destroy(s);
}

/* The expiry mark: records stamped (bytes 16..24) below it go, "memory" at once, "rocksdb" in a
 * compaction; a key rewritten with a later stamp stays, its newer version whole; records under
 * 24 bytes have no stamp and all stay. */
static void test_dead_below(emb_store *s, size_t rb)
{
    enum { N = 3000, MARK = 1000, REWRITTEN = 500 };
    uint8_t rec[256];
    char *err = NULL;
    for (uint32_t v = 1; v <= 2; v++)
        for (uint32_t i = 0; i < (v == 1 ? N : REWRITTEN); i++) {
            make_rec(rec, rb, i, v);
            uint64_t stamp = v == 1 ? i : MARK + i; /* version 2 of key i is live */
            if (rb >= 24) memcpy(rec + 16, &stamp, 8);
            CHECK_OK(emb_store_put(s, rec, 1, &err), err);
        }
    CHECK_OK(emb_store_set_dead_below(s, MARK, &err), err);
    CHECK_OK(emb_store_set_dead_below(s, MARK / 2, &err), err); /* lower: ignored */
    CHECK_OK(emb_store_compact(s, &err), err);
    uint32_t bad = 0, held = 0;
    for (uint32_t i = 0; i < N; i++) {
        uint64_t key = ukey(i);
        uint8_t found = 0;
        CHECK_OK(emb_store_get(s, &key, 1, rec, &found, &err), err);
        held += found;
        int live = rb < 24 || i < REWRITTEN || i >= MARK;
        uint32_t want_ver = i < REWRITTEN ? 2 : 1;
        bad += found != live || (found && (rec_idx(rec) != i || rec_ver(rec) != want_ver));
    }
    CHECK_MSG(bad == 0, "%s, %zu-byte records: %u keys wrong after the expiry mark (%u held)",
              emb_store_kind(s), rb, bad, held);
    CHECK_MSG(emb_store_count(s) == held, "%s: count %" PRIu64 ", %u held", emb_store_kind(s),
              emb_store_count(s), held);
}

#if !CHECK_ASAN && !CHECK_TSAN
/* The process's address space now, in bytes (VmSize), or 0. */
static uint64_t vm_size(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    uint64_t kb = 0;
    while (f != NULL && fgets(line, sizeof line, f) != NULL)
        if (sscanf(line, "VmSize: %" SCNu64, &kb) == 1) break;
    if (f != NULL) fclose(f);
    return kb * 1024;
}
#endif

/* A "memory" store's expiry that runs out of memory has removed nothing, and the same call
 * made again must remove the records (the mark may not rise before they are gone). Under
 * ASan or TSan the shadow memory makes an address-space limit meaningless: skipped there. */
static void test_dead_below_retry(const char *dir)
{
#if CHECK_ASAN || CHECK_TSAN
    (void)dir;
    fprintf(stderr, "  dead_below retry: skipped under a sanitizer (address-space limit)\n");
#else
    enum { N = 400000, MARK = N + 1 };
    const size_t rb = 36;
    /* Large blocks mapped and unmapped: no freed block in the heap to grow the list into. */
    mallopt(M_MMAP_THRESHOLD, 128 << 10);
    emb_store *s = open_store("memory", dir, rb);
    if (s == NULL) return;
    uint8_t rec[64];
    char *err = NULL;
    for (uint32_t i = 0; i < N; i++) {
        make_rec(rec, rb, i, 1);
        uint64_t stamp = i;
        memcpy(rec + 16, &stamp, 8);
        CHECK_OK(emb_store_put(s, rec, 1, &err), err);
    }
    struct rlimit old;
    CHECK_MSG(getrlimit(RLIMIT_AS, &old) == 0, "getrlimit");
    struct rlimit low = old;
    low.rlim_cur = vm_size() + (1u << 20); /* the expired keys' list needs 3.2 MB */
    CHECK_MSG(setrlimit(RLIMIT_AS, &low) == 0, "setrlimit");
    int rc = emb_store_set_dead_below(s, MARK, &err);
    setrlimit(RLIMIT_AS, &old);
    CHECK_MSG(rc == CM_ENOMEM, "expiry under a 1 MiB address-space margin returned %d (%s)", rc,
              err ? err : "no message");
    free(err);
    err = NULL;
    CHECK_MSG(emb_store_count(s) == N, "a failed expiry removed records: %" PRIu64 " of %d left",
              emb_store_count(s), N);
    CHECK_OK(emb_store_set_dead_below(s, MARK, &err), err);
    CHECK_MSG(emb_store_count(s) == 0, "the retried expiry left %" PRIu64 " of %d records",
              emb_store_count(s), N);
    emb_store_destroy(s);
#endif
}

typedef void (*store_test)(emb_store *s, size_t rb);

static void test_random_fixed_seed(emb_store *s, size_t rb)
{
    test_random(s, rb, 1000 + rb);
}

int main(void)
{
    /* each part gets a fresh store: a RocksDB count walks every record and tombstone, so the
     * random-operation model must not inherit the growth test's 100K deletions */
    static const store_test parts[] = {test_basic, test_many, test_random_fixed_seed,
                                       test_dead_below};
    const char *dir = check_tmpdir("emb_store");
    /* First, while the process has one malloc arena (RocksDB's threads add more, which grow
     * inside reserved space that an address-space limit does not catch). */
    test_dead_below_retry(dir);
    for (size_t k = 0; k < sizeof KINDS / sizeof *KINDS; k++) {
        for (size_t r = 0; r < sizeof REC_SIZES / sizeof *REC_SIZES; r++) {
            size_t rb = REC_SIZES[r];
            fprintf(stderr, "store %s, record %zu bytes\n", KINDS[k], rb);
            for (size_t p = 0; p < sizeof parts / sizeof *parts; p++) {
                emb_store *s = open_store(KINDS[k], dir, rb);
                if (s == NULL) continue;
                double t0 = cm_now();
                parts[p](s, rb);
                fprintf(stderr, "  part %zu: %.2f s\n", p, cm_now() - t0);
                emb_store_destroy(s);
            }
            test_reopen_wipes(KINDS[k], dir, rb);
        }
    }
    /* once, at the largest record size: the volume, not the record layout, is what it tests */
    size_t rb = REC_SIZES[sizeof REC_SIZES / sizeof *REC_SIZES - 1];
    fprintf(stderr, "store rocksdb, record %zu bytes, large\n", rb);
    static const store_test big_parts[] = {test_levels, test_versions};
    for (size_t p = 0; p < sizeof big_parts / sizeof *big_parts; p++) {
        emb_store *s = open_store("rocksdb", dir, rb);
        if (s == NULL) continue;
        double t0 = cm_now();
        big_parts[p](s, rb);
        fprintf(stderr, "  part %zu: %.2f s\n", p, cm_now() - t0);
        emb_store_destroy(s);
    }
    cm_rmtree(dir, NULL);
    return check_done();
}
