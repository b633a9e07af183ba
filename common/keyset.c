/* cm_keyset: whether a key comes twice in a stream of keys, in bounded memory (common.h). */
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/common.h"

/* The fewest keys a partition buffers when there are several (4 KiB writes). */
#define KEYS_LEAST 512u

struct cm_keyset {
    uint32_t parts;
    size_t cap;
    uint64_t *buf;   /* parts x cap */
    size_t *len;     /* keys in each buffer */
    uint64_t *filed; /* keys in each partition's file */
    char *dir;
};

uint64_t cm_keyset_least(uint64_t n)
{
    /* Sorting n keys takes 2n x 8 bytes: glibc's qsort merges through a copy. Partitions get
     * 5/4 of an even share (plan); mem / 8 / (1.25 x 16n / mem) >= KEYS_LEAST, solved for mem. */
    const double need = 2.0 * (double)n * sizeof(uint64_t);
    double least = sqrt(1.25 * need * KEYS_LEAST * sizeof(uint64_t));
    /* Rounding up the partitions' count takes a partition's share back: 1% and a page spare. */
    least = ceil(least * 1.01) + 4096;
    return least < need ? (uint64_t)least : (uint64_t)need;
}

/* Partitions and keys a partition buffers for n keys in mem bytes; 0, or CM_EINVAL when mem is
 * below cm_keyset_least. */
static int plan(uint64_t n, uint64_t mem, uint32_t *parts, size_t *cap)
{
    const uint64_t need = 2 * n * sizeof(uint64_t);
    if (need <= mem) {
        *parts = 1;
        *cap = n > 0 ? (size_t)n : 1;
        return CM_OK;
    }
    /* Each partition is read back whole and sorted: 5/4 of an even share leaves room for the
     * spread of a hash (a partition of 512 keys or more is within a few percent of its share). */
    double p = ceil((double)need * 1.25 / (double)mem);
    double c = (double)mem / sizeof(uint64_t) / p;
    if (p > UINT32_MAX || c < KEYS_LEAST) return CM_EINVAL;
    *parts = (uint32_t)p;
    *cap = (size_t)c;
    return CM_OK;
}

int cm_keyset_create(const char *dir, uint64_t n, uint64_t mem, cm_keyset **out, char **errptr)
{
    uint32_t parts = 1;
    size_t cap = 1;
    if (n > UINT64_MAX / 64) /* not on any disk: 2^58 keys */
        return cm_err(errptr, CM_EINVAL, "%" PRIu64 " keys is more than a key set takes", n);
    if (plan(n, mem, &parts, &cap) != CM_OK)
        return cm_err(errptr, CM_EINVAL,
                      "a memory budget of %" PRIu64 " bytes is too small for the keys of %" PRIu64
                      " rows: they need at least %" PRIu64 " bytes",
                      mem, n, cm_keyset_least(n));
    cm_keyset *ks = calloc(1, sizeof *ks);
    if (ks == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    ks->parts = parts;
    ks->cap = cap;
    ks->buf = malloc((size_t)parts * cap * sizeof *ks->buf);
    ks->len = calloc(parts, sizeof *ks->len);
    ks->filed = calloc(parts, sizeof *ks->filed);
    ks->dir = strdup(dir);
    if (ks->buf == NULL || ks->len == NULL || ks->filed == NULL || ks->dir == NULL) {
        cm_keyset_destroy(ks);
        return cm_err(errptr, CM_ENOMEM, "out of memory for the keys of %" PRIu64 " rows", n);
    }
    *out = ks;
    return CM_OK;
}

static void part_path(const cm_keyset *ks, uint32_t p, char *out, size_t n)
{
    snprintf(out, n, "%s/keys-%u", ks->dir, p);
}

/* Appends partition p's buffer to its file (opened for this write only: there may be many). */
static int spill(cm_keyset *ks, uint32_t p, char **errptr)
{
    char path[4600];
    if (ks->len[p] == 0) return CM_OK;
    part_path(ks, p, path, sizeof path);
    int rc = ks->filed[p] == 0 ? cm_mkdirs(ks->dir, errptr) : CM_OK;
    int fd = rc == CM_OK ? open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644) : -1;
    if (rc == CM_OK && (fd < 0 || cm_write_full(fd, ks->buf + (size_t)p * ks->cap,
                                                ks->len[p] * sizeof *ks->buf) != CM_OK))
        rc = cm_err_errno(errptr, CM_EIO, "cannot write %s", path);
    if (fd >= 0 && close(fd) != 0 && rc == CM_OK)
        rc = cm_err_errno(errptr, CM_EIO, "cannot write %s", path);
    if (rc == CM_OK) {
        ks->filed[p] += ks->len[p];
        ks->len[p] = 0;
    }
    return rc;
}

int cm_keyset_add(cm_keyset *ks, uint64_t key, char **errptr)
{
    uint32_t p = (uint32_t)(((cm_xxh3(&key, sizeof key) >> 32) * ks->parts) >> 32);
    if (ks->len[p] == ks->cap) {
        int rc = spill(ks, p, errptr);
        if (rc != CM_OK) return rc;
    }
    ks->buf[(size_t)p * ks->cap + ks->len[p]++] = key;
    return CM_OK;
}

/* Sorts n keys and sets *twice (and *key) when two are equal. */
static void sorted_twice(uint64_t *k, size_t n, bool *twice, uint64_t *key)
{
    qsort(k, n, sizeof *k, cm_u64_cmp);
    for (size_t i = 1; i < n && !*twice; i++)
        if (k[i] == k[i - 1]) {
            *twice = true;
            *key = k[i];
        }
}

int cm_keyset_twice(cm_keyset *ks, bool *twice, uint64_t *key, char **errptr)
{
    *twice = false;
    if (ks->parts == 1 && ks->filed[0] == 0) {
        sorted_twice(ks->buf, ks->len[0], twice, key);
        return CM_OK;
    }
    int rc = CM_OK;
    for (uint32_t p = 0; rc == CM_OK && p < ks->parts; p++)
        rc = spill(ks, p, errptr);
    free(ks->buf);
    ks->buf = NULL;
    for (uint32_t p = 0; rc == CM_OK && !*twice && p < ks->parts; p++) {
        char path[4600];
        void *keys = NULL;
        size_t len = 0;
        if (ks->filed[p] == 0) continue;
        part_path(ks, p, path, sizeof path);
        rc = cm_read_file(path, &keys, &len, errptr);
        if (rc == CM_OK && len != ks->filed[p] * sizeof(uint64_t))
            rc = cm_err(errptr, CM_EIO, "%s: %zu bytes, %" PRIu64 " keys were written", path, len,
                        ks->filed[p]);
        if (rc == CM_OK) sorted_twice(keys, ks->filed[p], twice, key);
        free(keys);
    }
    return rc;
}

void cm_keyset_destroy(cm_keyset *ks)
{
    if (ks == NULL) return;
    free(ks->buf);
    free(ks->len);
    free(ks->filed);
    if (ks->dir != NULL) cm_rmtree(ks->dir, NULL);
    free(ks->dir);
    free(ks);
}
