/*
 * common_keyset: cm_keyset, whether a key comes twice in a stream, in bounded memory (the check
 * export and reshard make of a checkpoint's tables).
 *   - distinct keys are never taken for a key twice, with every key in memory and with keys
 *     spread over partition files;
 *   - a key twice is found (and named) in memory, in one partition's file, and when one copy
 *     went to a file and the other is still buffered;
 *   - the least memory cm_keyset_least names for n keys is taken, and less is refused naming it;
 *   - destroy removes the partition files' folder;
 *   - cm_parts (what cm_keyset spreads keys with) carries a payload: each record read back from
 *     the partition of its key, whole, in the order added, whether its buffer went to the file
 *     once, many times or never.
 */
#include <sys/stat.h>

#include "check.h"

/* Adds n distinct keys (and the key at dup_at again after them when dup_at < n) to a set of
 * mem bytes; *twice and the key found. */
static int run_set(const char *dir, uint64_t n, uint64_t mem, uint64_t dup_at, bool *twice,
                   uint64_t *key, bool *filed)
{
    cm_keyset *ks = NULL;
    char *err = NULL;
    int rc = cm_keyset_create(dir, n + 1, mem, &ks, &err);
    CHECK_MSG(rc == CM_OK, "create %llu keys in %llu bytes: %s", (unsigned long long)n,
              (unsigned long long)mem, err ? err : "");
    for (uint64_t i = 0; rc == CM_OK && i < n; i++)
        rc = cm_keyset_add(ks, i * 0x9E3779B97F4A7C15ull + 11, &err);
    if (rc == CM_OK && dup_at < n)
        rc = cm_keyset_add(ks, dup_at * 0x9E3779B97F4A7C15ull + 11, &err);
    struct stat st;
    *filed = stat(dir, &st) == 0;
    if (rc == CM_OK) rc = cm_keyset_twice(ks, twice, key, &err);
    CHECK_MSG(rc == CM_OK, "%s", err ? err : "");
    cm_keyset_destroy(ks);
    CHECK_MSG(stat(dir, &st) != 0, "%s left behind", dir);
    free(err);
    return rc;
}

/* n records {key, i, ~i} over parts partitions of cap records each: each read back as added. */
static void run_parts(const char *dir, uint64_t n, uint32_t parts, size_t cap, bool want_filed)
{
    typedef struct {
        uint64_t key, i, not_i;
    } rec;
    cm_parts *ps = NULL;
    char *err = NULL;
    int rc = cm_parts_create(dir, parts, sizeof(rec), cap, &ps, &err);
    for (uint64_t i = 0; rc == CM_OK && i < n; i++) {
        const rec r = {i * 0x9E3779B97F4A7C15ull + 11, i, ~i};
        rc = cm_parts_add(ps, &r, &err);
    }
    const bool filed = rc == CM_OK && cm_parts_filed(ps);
    if (rc == CM_OK) rc = cm_parts_flush(ps, &err);
    CHECK_MSG(rc == CM_OK, "%s", err ? err : "");
    CHECK_MSG(filed == want_filed, "%llu records in buffers of %zu: %s", (unsigned long long)n, cap,
              filed ? "filed" : "not filed");
    uint64_t seen = 0, bad = 0;
    rec *buf = malloc(n * sizeof *buf + 1);
    for (uint32_t p = 0; rc == CM_OK && p < parts; p++) {
        const uint64_t c = cm_parts_count(ps, p);
        /* In two reads: from the start, then from the middle on. */
        rc = cm_parts_read(ps, p, buf, 0, c / 2, &err);
        if (rc == CM_OK) rc = cm_parts_read(ps, p, buf + c / 2, c / 2, c - c / 2, &err);
        for (uint64_t j = 0; rc == CM_OK && j < c; j++) {
            const rec *r = &buf[j];
            bad += r->key != r->i * 0x9E3779B97F4A7C15ull + 11 || r->not_i != ~r->i ||
                   cm_part_of(r->key, parts) != p || (j > 0 && r->i <= buf[j - 1].i);
        }
        seen += c;
    }
    CHECK_MSG(rc == CM_OK, "%s", err ? err : "");
    CHECK_MSG(seen == n && bad == 0, "%u partitions: %llu of %llu records read, %llu wrong", parts,
              (unsigned long long)seen, (unsigned long long)n, (unsigned long long)bad);
    free(buf);
    cm_parts_destroy(ps);
    struct stat st;
    CHECK_MSG(stat(dir, &st) != 0, "%s left behind", dir);
    free(err);
}

int main(void)
{
    const char *tmp = check_tmpdir("common_keyset");
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/keys", tmp);
    const uint64_t n = 200000;
    bool twice = true, filed = false;
    uint64_t key = 0;
    /* In memory (16 bytes a key fit), then spread over files (64 KiB for 200,000 keys). */
    const uint64_t mems[2] = {64u << 20, cm_keyset_least(n + 1)};
    for (int m = 0; m < 2; m++) {
        CHECK(run_set(dir, n, mems[m], n, &twice, &key, &filed) == CM_OK);
        CHECK_MSG(!twice, "distinct keys taken for a key twice (%d)", m);
        CHECK_MSG(filed == (m == 1), "partition files %s with %llu bytes",
                  filed ? "made" : "not made", (unsigned long long)mems[m]);
        /* A key twice: early (its first copy long in a file when spread), and the last one. */
        const uint64_t at[2] = {3, n - 1};
        for (int k = 0; k < 2; k++) {
            twice = false;
            CHECK(run_set(dir, n, mems[m], at[k], &twice, &key, &filed) == CM_OK);
            CHECK_MSG(twice && key == at[k] * 0x9E3779B97F4A7C15ull + 11,
                      "key %llu twice not found with %llu bytes", (unsigned long long)at[k],
                      (unsigned long long)mems[m]);
        }
    }
    run_parts(dir, 50000, 7, 100, true);    /* each buffer filed many times */
    run_parts(dir, 50000, 1, 50000, false); /* all in memory until flush files it */
    run_parts(dir, 50000, 3, 10000, true);  /* filed once, the rest buffered */
    /* The least memory works for any count; less is refused, naming it. */
    for (uint64_t c = 1; c < (1ull << 32); c = c * 3 + 1) {
        cm_keyset *ks = NULL;
        char *err = NULL;
        int rc = cm_keyset_create(dir, c, cm_keyset_least(c), &ks, &err);
        CHECK_MSG(rc == CM_OK, "%llu keys in their least %llu bytes: %s", (unsigned long long)c,
                  (unsigned long long)cm_keyset_least(c), err ? err : "");
        cm_keyset_destroy(ks);
        free(err);
    }
    cm_keyset *ks = NULL;
    char *err = NULL, want[64];
    snprintf(want, sizeof want, "at least %llu bytes", (unsigned long long)cm_keyset_least(n));
    CHECK_MSG(cm_keyset_create(dir, n, cm_keyset_least(n) / 2, &ks, &err) == CM_EINVAL &&
                  ks == NULL && err && strstr(err, want),
              "half the least: %s", err ? err : "(accepted)");
    free(err);
    return check_done();
}
