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

struct cm_parts {
    uint32_t parts;
    size_t rec, cap;
    uint8_t *buf;    /* parts x cap records */
    size_t *len;     /* records in each buffer */
    uint64_t *filed; /* records in each partition's file */
    char *dir;
};

struct cm_keyset {
    cm_parts *ps;
};

uint32_t cm_part_of(uint64_t key, uint32_t parts)
{
    return (uint32_t)(((cm_xxh3(&key, sizeof key) >> 32) * parts) >> 32);
}

int cm_parts_create(const char *dir, uint32_t parts, size_t rec, size_t cap, cm_parts **out,
                    char **errptr)
{
    cm_parts *ps = calloc(1, sizeof *ps);
    if (ps == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    ps->parts = parts > 0 ? parts : 1;
    ps->rec = rec;
    ps->cap = cap > 0 ? cap : 1;
    ps->buf = malloc((size_t)ps->parts * ps->cap * rec);
    ps->len = calloc(ps->parts, sizeof *ps->len);
    ps->filed = calloc(ps->parts, sizeof *ps->filed);
    ps->dir = strdup(dir);
    if (ps->buf == NULL || ps->len == NULL || ps->filed == NULL || ps->dir == NULL) {
        cm_parts_destroy(ps);
        return cm_err(errptr, CM_ENOMEM, "out of memory for %zu bytes of buffers",
                      (size_t)parts * cap * rec);
    }
    *out = ps;
    return CM_OK;
}

static void part_path(const cm_parts *ps, uint32_t p, char *out, size_t n)
{
    snprintf(out, n, "%s/part-%u", ps->dir, p);
}

/* Appends partition p's buffer to its file (opened for this write only: there may be many). */
static int spill(cm_parts *ps, uint32_t p, char **errptr)
{
    char path[4600];
    if (ps->len[p] == 0) return CM_OK;
    part_path(ps, p, path, sizeof path);
    int rc = ps->filed[p] == 0 ? cm_mkdirs(ps->dir, errptr) : CM_OK;
    int fd = rc == CM_OK ? open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644) : -1;
    if (rc == CM_OK && (fd < 0 || cm_write_full(fd, ps->buf + (size_t)p * ps->cap * ps->rec,
                                                ps->len[p] * ps->rec) != CM_OK))
        rc = cm_err_errno(errptr, CM_EIO, "cannot write %s", path);
    if (fd >= 0 && close(fd) != 0 && rc == CM_OK)
        rc = cm_err_errno(errptr, CM_EIO, "cannot write %s", path);
    if (rc == CM_OK) {
        ps->filed[p] += ps->len[p];
        ps->len[p] = 0;
    }
    return rc;
}

int cm_parts_add(cm_parts *ps, const void *rec, char **errptr)
{
    uint64_t key;
    memcpy(&key, rec, sizeof key);
    uint32_t p = cm_part_of(key, ps->parts);
    if (ps->len[p] == ps->cap) {
        int rc = spill(ps, p, errptr);
        if (rc != CM_OK) return rc;
    }
    memcpy(ps->buf + ((size_t)p * ps->cap + ps->len[p]++) * ps->rec, rec, ps->rec);
    return CM_OK;
}

bool cm_parts_filed(const cm_parts *ps)
{
    for (uint32_t p = 0; p < ps->parts; p++)
        if (ps->filed[p] > 0) return true;
    return false;
}

int cm_parts_flush(cm_parts *ps, char **errptr)
{
    int rc = CM_OK;
    for (uint32_t p = 0; rc == CM_OK && p < ps->parts; p++)
        rc = spill(ps, p, errptr);
    free(ps->buf);
    ps->buf = NULL;
    return rc;
}

uint64_t cm_parts_count(const cm_parts *ps, uint32_t p)
{
    return ps->filed[p] + ps->len[p];
}

int cm_parts_read(const cm_parts *ps, uint32_t p, void *buf, uint64_t at, size_t n, char **errptr)
{
    char path[4600];
    if (n == 0) return CM_OK;
    part_path(ps, p, path, sizeof path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    int rc = fd >= 0 ? cm_pread_full(fd, buf, n * ps->rec, (off_t)(at * ps->rec)) : CM_EIO;
    if (rc != CM_OK) rc = cm_err_errno(errptr, CM_EIO, "cannot read %s", path);
    if (fd >= 0) close(fd);
    return rc;
}

void cm_parts_destroy(cm_parts *ps)
{
    if (ps == NULL) return;
    free(ps->buf);
    free(ps->len);
    free(ps->filed);
    if (ps->dir != NULL) cm_rmtree(ps->dir, NULL);
    free(ps->dir);
    free(ps);
}

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
    int rc = ks ? cm_parts_create(dir, parts, sizeof(uint64_t), cap, &ks->ps, errptr)
                : cm_err(errptr, CM_ENOMEM, "out of memory");
    if (rc != CM_OK) {
        free(ks);
        return rc == CM_ENOMEM
                   ? cm_err(errptr, rc, "out of memory for the keys of %" PRIu64 " rows", n)
                   : rc;
    }
    *out = ks;
    return CM_OK;
}

int cm_keyset_add(cm_keyset *ks, uint64_t key, char **errptr)
{
    return cm_parts_add(ks->ps, &key, errptr);
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
    cm_parts *ps = ks->ps;
    *twice = false;
    if (ps->parts == 1 && ps->filed[0] == 0) {
        sorted_twice((uint64_t *)ps->buf, ps->len[0], twice, key);
        return CM_OK;
    }
    int rc = cm_parts_flush(ps, errptr);
    for (uint32_t p = 0; rc == CM_OK && !*twice && p < ps->parts; p++) {
        const uint64_t n = cm_parts_count(ps, p);
        uint64_t *keys = n ? malloc(n * sizeof *keys) : NULL;
        if (n == 0) continue;
        rc = keys ? cm_parts_read(ps, p, keys, 0, n, errptr)
                  : cm_err(errptr, CM_ENOMEM, "out of memory");
        if (rc == CM_OK) sorted_twice(keys, n, twice, key);
        free(keys);
    }
    return rc;
}

void cm_keyset_destroy(cm_keyset *ks)
{
    if (ks == NULL) return;
    cm_parts_destroy(ks->ps);
    free(ks);
}
