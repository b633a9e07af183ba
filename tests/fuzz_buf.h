/*
 * For libFuzzer targets that damage files: one file's bytes held in memory while the input's
 * mutations edit it, then written out (or left out, when a mutation removed it). Every helper
 * aborts without memory or when a file cannot be written: a fuzzer that silently tested nothing
 * would be worse.
 */
#ifndef EMBER_TESTS_FUZZ_BUF_H
#define EMBER_TESTS_FUZZ_BUF_H

#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/common.h"

typedef struct fz_buf {
    uint8_t *b;
    size_t len, cap;
    bool gone; /* removed: not written */
} fz_buf;

/* Room for len + extra bytes, and one more (a text may be terminated in place). */
static inline void fz_reserve(fz_buf *f, size_t extra)
{
    if (f->len + extra + 1 <= f->cap) return;
    f->cap = 2 * (f->len + extra + 1);
    f->b = realloc(f->b, f->cap);
    if (f->b == NULL) abort();
}

static inline void fz_set(fz_buf *f, const void *data, size_t len)
{
    f->len = 0;
    f->gone = false;
    fz_reserve(f, len);
    if (len) memcpy(f->b, data, len);
    f->len = len;
}

/* Writes n bytes at off, growing the file (zero filled) as needed. */
static inline void fz_put(fz_buf *f, size_t off, const void *src, size_t n)
{
    if (off + n > f->len) {
        fz_reserve(f, off + n - f->len);
        if (off > f->len) memset(f->b + f->len, 0, off - f->len);
        f->len = off + n;
    }
    memcpy(f->b + off, src, n);
}

static inline uint64_t fz_get(const fz_buf *f, size_t off, int bytes)
{
    uint64_t v = 0;
    if (off + (size_t)bytes <= f->len) memcpy(&v, f->b + off, (size_t)bytes);
    return v;
}

/* Replaces bytes [s, e) with n bytes of src, or n zeros when src is NULL. */
static inline void fz_splice(fz_buf *f, size_t s, size_t e, const void *src, size_t n)
{
    fz_reserve(f, n);
    memmove(f->b + s + n, f->b + e, f->len - e);
    if (src)
        memcpy(f->b + s, src, n);
    else
        memset(f->b + s, 0, n);
    f->len = f->len - (e - s) + n;
}

static inline void fz_load(fz_buf *f, const char *path)
{
    void *buf = NULL;
    size_t len = 0;
    if (cm_read_file(path, &buf, &len, NULL) != CM_OK) abort();
    fz_set(f, buf, len);
    free(buf);
}

/* The file at path as f holds it; none when f is gone. */
static inline void fz_store(const fz_buf *f, const char *path)
{
    unlink(path);
    if (f->gone) return;
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0 || (f->len > 0 && write(fd, f->b, f->len) != (ssize_t)f->len) || close(fd) != 0)
        abort();
}

#endif
