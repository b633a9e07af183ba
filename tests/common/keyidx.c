/*
 * common_keyidx: cm_keyidx, the file-backed key index (the serving bundle's table index).
 *   - keys added in several batches, and one flush, are each found probing linearly from
 *     xxh3(key) with no empty entry between, with their values; the entry count is the keys';
 *   - keys whose home slots are the last ones wrap to the front;
 *   - a key twice is refused, in one batch or across two, and cm_keyidx_dup names it;
 *   - more keys than slots - 1 are refused.
 */
#include <fcntl.h>
#include <inttypes.h>
#include <sys/stat.h>
#include <xxhash.h>

#include "check.h"

typedef struct ent {
    uint64_t key;
    uint32_t val, pad;
} ent;

/* A scratch file of slots entries at offset 64; its fd. */
static int scratch(const char *name, uint64_t slots)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", check_tmpdir("common_keyidx"), name);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    CHECK(fd >= 0 && ftruncate(fd, (off_t)(64 + slots * 16)) == 0);
    return fd;
}

/* Every key i < n (key i * 7919 + 3, value i) found from its home; entries = n. */
static int check_index(int fd, uint64_t slots, uint64_t n)
{
    ent *ix = malloc(slots * sizeof *ix);
    CHECK(pread(fd, ix, slots * sizeof *ix, 64) == (ssize_t)(slots * sizeof *ix));
    uint64_t used = 0, bad = 0;
    for (uint64_t s = 0; s < slots; s++)
        used += ix[s].val != CM_KEYIDX_EMPTY;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t key = i * 7919 + 3, s = XXH3_64bits(&key, 8) & (slots - 1), probes = 0;
        while (ix[s].val != CM_KEYIDX_EMPTY && ix[s].key != key && probes++ < slots)
            s = (s + 1) & (slots - 1);
        bad += ix[s].key != key || ix[s].val != (uint32_t)i;
    }
    free(ix);
    CHECK_MSG(used == n && bad == 0,
              "%" PRIu64 " entries for %" PRIu64 " keys, %" PRIu64 " not found", used, n, bad);
    return bad == 0 && used == n;
}

int main(void)
{
    char *err = NULL;
    cm_keyidx *x = NULL;
    /* 200000 keys: several batches, into 262144 slots (a load of 0.76). */
    const uint64_t n = 200000, slots = cm_keyidx_slots(n);
    CHECK(slots == 262144);
    int fd = scratch("big", slots);
    CHECK_OK(cm_keyidx_open(fd, "big", 64, slots, &x, &err), err);
    err = NULL;
    int rc = 0;
    for (uint64_t i = 0; rc == 0 && i < n; i++)
        rc = cm_keyidx_add(x, i * 7919 + 3, (uint32_t)i, &err);
    if (rc == 0) rc = cm_keyidx_flush(x, &err);
    CHECK_OK(rc, err);
    err = NULL;
    cm_keyidx_close(x);
    check_index(fd, slots, n);
    close(fd);

    /* 15 keys in 16 slots: full but one, every probe wraps somewhere. */
    fd = scratch("full", 16);
    CHECK_OK(cm_keyidx_open(fd, "full", 64, 16, &x, &err), err);
    err = NULL;
    rc = 0;
    for (uint64_t i = 0; rc == 0 && i < 15; i++)
        rc = cm_keyidx_add(x, i * 7919 + 3, (uint32_t)i, &err);
    if (rc == 0) rc = cm_keyidx_flush(x, &err);
    CHECK_OK(rc, err);
    err = NULL;
    rc = cm_keyidx_add(x, 99, 99, &err);
    CHECK_MSG(rc == CM_EINVAL && err && strstr(err, "room"), "a 16th key in 16 slots: %d %s", rc,
              err ? err : "");
    free(err);
    err = NULL;
    cm_keyidx_close(x);
    check_index(fd, 16, 15);
    close(fd);

    /* A key twice: in one batch, and across a flush. */
    for (int across = 0; across < 2; across++) {
        uint64_t dup = 0;
        fd = scratch("dup", 1024);
        CHECK_OK(cm_keyidx_open(fd, "dup", 64, 1024, &x, &err), err);
        err = NULL;
        rc = 0;
        for (uint64_t i = 0; rc == 0 && i < 500; i++) {
            rc = cm_keyidx_add(x, i == 300 ? 77 : i + 1000, (uint32_t)i, &err);
            if (rc == 0 && i == 100) rc = cm_keyidx_add(x, 77, 5, &err);
            if (rc == 0 && across && i == 200) rc = cm_keyidx_flush(x, &err);
        }
        if (rc == 0) rc = cm_keyidx_flush(x, &err);
        CHECK_MSG(rc == CM_EINVAL && err && strstr(err, "key 77 twice") && cm_keyidx_dup(x, &dup) &&
                      dup == 77,
                  "a key twice (across %d): %d %s", across, rc, err ? err : "");
        free(err);
        err = NULL;
        cm_keyidx_close(x);
        close(fd);
    }
    return check_done();
}
