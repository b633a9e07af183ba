/*
 * common_keyidx: cm_keyidx, the key index the serving bundle's tables carry, built in bounded
 * memory: keys past the budget go to sorted runs in a scratch file, merged into the region in
 * order at finish. For each key set below, built in the least budget its index takes (many
 * runs) and in one that holds every key (no run):
 *   - every key is found probing linearly from xxh3(key) & (slots - 1) with no empty entry
 *     between, with its value, and the region holds no other entry;
 *   - both builds write the same bytes (the output does not depend on the budget);
 *   - key sets: 200,000 keys in 262,144 slots, 40 of them homed in the last 4 slots (some
 *     wrap to the front); an empty index; 52,428 keys in 65,536 (the most cm_keyidx_slots
 *     gives that size: its load factor); 65,535 in 65,536 (full but one); 15 in 16;
 *   - a key twice is refused ("key 77 twice", cm_keyidx_dup naming it): both in one run, in
 *     two runs, and with no run;
 *   - no scratch file is left in the folder given, while building, after, and after a refusal;
 *     a folder a scratch file cannot be made in fails the build, naming it;
 *   - a budget below cm_keyidx_least is refused naming it; more keys than slots - 1, and a key
 *     after finish, are refused.
 */
#include <dirent.h>
#include <fcntl.h>
#include <inttypes.h>
#include <sys/stat.h>
#include <xxhash.h>

#include "check.h"

typedef struct ent {
    uint64_t key;
    uint32_t val, pad;
} ent;

static char dir[4096], scratch[4200];

/* Entries in the scratch folder. */
static int scratch_files(void)
{
    DIR *d = opendir(scratch);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d)) != NULL;)
        n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    if (d) closedir(d);
    return n;
}

static uint64_t home(uint64_t key, uint64_t slots)
{
    return XXH3_64bits(&key, 8) & (slots - 1);
}

/* keys[i] -> i into an index of slots in mem bytes, at offset 64 of a fresh file; its entries
 * (the caller's) into *ix. The rc, the message in *err (the caller's). */
static int build(uint64_t slots, uint64_t mem, const char *sdir, const uint64_t *keys, uint64_t n,
                 ent **ix, char **err)
{
    char path[4300];
    snprintf(path, sizeof path, "%s/index", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    CHECK(fd >= 0 && ftruncate(fd, (off_t)(64 + slots * 16)) == 0);
    cm_keyidx *x = NULL;
    int rc = cm_keyidx_open(fd, "index", 64, slots, mem, sdir, &x, err);
    for (uint64_t i = 0; rc == 0 && i < n; i++) {
        rc = cm_keyidx_add(x, keys[i], (uint32_t)i, err);
        if (i % 16384 == 0) CHECK_MSG(scratch_files() == 0, "a scratch file while building");
    }
    if (rc == 0) rc = cm_keyidx_finish(x, err);
    if (rc == 0) {
        CHECK(cm_keyidx_add(x, 1, 1, NULL) == CM_EINVAL); /* a key after finish */
        *ix = malloc(slots * sizeof **ix);
        CHECK(pread(fd, *ix, slots * sizeof **ix, 64) == (ssize_t)(slots * sizeof **ix));
    }
    cm_keyidx_close(x);
    close(fd);
    CHECK_MSG(scratch_files() == 0, "a scratch file left after a build (rc %d)", rc);
    return rc;
}

/* ix is a valid linear-probing index of keys[i] -> i and nothing else; the keys placed before
 * their home (gone round the end). */
static uint64_t check_index(const ent *ix, uint64_t slots, const uint64_t *keys, uint64_t n)
{
    uint64_t used = 0, bad = 0, wrapped = 0;
    for (uint64_t s = 0; s < slots; s++)
        used += ix[s].val != CM_KEYIDX_EMPTY;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t h = home(keys[i], slots), s = h, probes = 0;
        while (ix[s].val != CM_KEYIDX_EMPTY && ix[s].key != keys[i] && probes++ < slots)
            s = (s + 1) & (slots - 1);
        bad += ix[s].val == CM_KEYIDX_EMPTY || ix[s].key != keys[i] || ix[s].val != (uint32_t)i ||
               ix[s].pad != 0;
        wrapped += s < h;
    }
    CHECK_MSG(used == n && bad == 0,
              "%" PRIu64 " entries for %" PRIu64 " keys, %" PRIu64 " not found", used, n, bad);
    return wrapped;
}

/* keys into slots in the least budget and in one that holds them all: both valid and alike.
 * The least budget's run count at least min_runs (keys x 24 bytes over the budget). The keys
 * gone round the end. */
static uint64_t check_keys(const char *what, uint64_t slots, const uint64_t *keys, uint64_t n,
                           uint64_t min_runs)
{
    const uint64_t least = cm_keyidx_least(slots), all = 64 * slots + (1u << 20);
    CHECK_MSG(n * 24 / least >= min_runs, "%s: %" PRIu64 " bytes of budget holds the keys", what,
              least);
    ent *a = NULL, *b = NULL;
    char *err = NULL;
    CHECK_OK(build(slots, least, scratch, keys, n, &a, &err), err);
    CHECK_OK(build(slots, all, scratch, keys, n, &b, &err), err);
    uint64_t wrapped = 0;
    if (a && b) {
        wrapped = check_index(a, slots, keys, n);
        CHECK_MSG(check_index(b, slots, keys, n) == wrapped && !memcmp(a, b, slots * sizeof *a),
                  "%s: the index in %" PRIu64 " bytes differs from the one in memory", what, least);
    }
    free(a);
    free(b);
    return wrapped;
}

/* Key i: spread over u64 (as trained keys are, hashed). */
static uint64_t key_of(uint64_t i)
{
    uint64_t x = i + 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

int main(void)
{
    snprintf(dir, sizeof dir, "%s", check_tmpdir("common_keyidx"));
    snprintf(scratch, sizeof scratch, "%s/scratch", dir);
    CHECK(mkdir(scratch, 0700) == 0);
    char *err = NULL;

    /* 200,000 keys in 262,144 slots (a load of 0.76), 40 homed in the last 4 slots. */
    const uint64_t n = 200000, slots = cm_keyidx_slots(n);
    CHECK(slots == 262144);
    uint64_t *keys = malloc(n * sizeof *keys), m = 0;
    for (uint64_t i = 0; m < 40; i++)
        if (home(key_of(i), slots) >= slots - 4) keys[m++] = key_of(i);
    for (uint64_t i = 1u << 30; m < n; i++)
        keys[m++] = key_of(i);
    CHECK_MSG(check_keys("200000 keys", slots, keys, n, 16) > 0, "no key went round the end");

    /* No key; the most keys 65,536 slots are sized for; full but one; 15 in 16. */
    check_keys("no key", 16, keys, 0, 0);
    CHECK(cm_keyidx_slots(52428) == 65536 && cm_keyidx_slots(52429) > 65536);
    check_keys("52428 keys", 65536, keys + 40, 52428, 4);
    CHECK_MSG(check_keys("65535 keys", 65536, keys + 40, 65535, 4) > 0, "full: none went round");
    check_keys("15 keys", 16, keys + 40, 15, 0);

    /* A key twice: in one run (next to each other), in two, with no run. */
    static const struct {
        uint64_t first, second, mem;
    } dups[] = {{100, 101, 0}, {100, 150000, 0}, {100, 150000, 64u << 20}};
    for (size_t d = 0; d < sizeof dups / sizeof dups[0]; d++) {
        const uint64_t k0 = keys[dups[d].first], k1 = keys[dups[d].second];
        keys[dups[d].first] = keys[dups[d].second] = 77;
        uint64_t mem = dups[d].mem ? dups[d].mem : cm_keyidx_least(slots), dup = 0;
        ent *ix = NULL;
        cm_keyidx *x = NULL;
        int fd = open(dir, O_RDONLY); /* any fd: the build is refused before it is written */
        int rc = build(slots, mem, scratch, keys, n, &ix, &err);
        CHECK_MSG(rc == CM_EINVAL && err && strstr(err, "key 77 twice"),
                  "a key twice (%" PRIu64 ", %" PRIu64 "): %d %s", dups[d].first, dups[d].second,
                  rc, err ? err : "");
        free(err);
        err = NULL;
        free(ix);
        /* cm_keyidx_dup names it (a build of its own: build closes the index). */
        CHECK_OK(cm_keyidx_open(fd, "dup", 0, 1024, 1u << 20, scratch, &x, &err), err);
        rc = cm_keyidx_add(x, 77, 0, &err);
        if (rc == 0) rc = cm_keyidx_add(x, 77, 1, &err);
        if (rc == 0) rc = cm_keyidx_finish(x, &err);
        CHECK(rc == CM_EINVAL && cm_keyidx_dup(x, &dup) && dup == 77);
        free(err);
        err = NULL;
        cm_keyidx_close(x);
        close(fd);
        keys[dups[d].first] = k0;
        keys[dups[d].second] = k1;
    }

    /* A scratch folder that does not exist: the first run cannot be written. */
    char nowhere[4300];
    snprintf(nowhere, sizeof nowhere, "%s/nowhere", dir);
    ent *ix = NULL;
    int rc = build(slots, cm_keyidx_least(slots), nowhere, keys, n, &ix, &err);
    CHECK_MSG(rc == CM_EIO && err && strstr(err, nowhere), "no scratch folder: %d %s", rc,
              err ? err : "");
    free(err);
    err = NULL;
    free(ix);

    /* A budget below the least; more keys than slots - 1. */
    cm_keyidx *x = NULL;
    char want[64];
    snprintf(want, sizeof want, "at least %" PRIu64 " bytes", cm_keyidx_least(slots));
    rc = cm_keyidx_open(0, "small", 0, slots, cm_keyidx_least(slots) - 1, scratch, &x, &err);
    CHECK_MSG(rc == CM_EINVAL && err && strstr(err, want), "a budget below the least: %d %s", rc,
              err ? err : "");
    free(err);
    err = NULL;
    CHECK_OK(cm_keyidx_open(0, "full", 0, 16, 1u << 20, scratch, &x, &err), err);
    rc = 0;
    for (uint64_t i = 0; rc == 0 && i < 15; i++)
        rc = cm_keyidx_add(x, i, (uint32_t)i, &err);
    CHECK_OK(rc, err);
    rc = cm_keyidx_add(x, 99, 99, &err);
    CHECK_MSG(rc == CM_EINVAL && err && strstr(err, "room"), "a 16th key in 16 slots: %d %s", rc,
              err ? err : "");
    free(err);
    cm_keyidx_close(x);
    free(keys);
    return check_done();
}
