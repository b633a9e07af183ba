/*
 * Shared by the checkpoint fuzz targets: files held in memory, mutations the input chooses, and
 * the fix-up that recomputes every size and checksum the formats carry afterwards, so that a
 * mutation reaches the readers as a "consistent lie" instead of being stopped by a checksum.
 *
 * Binary files (rows.bin, dense-*.bin) end in the xxh3-64 of everything before them; text
 * manifests end in a "checksum XXH3" line over everything before it (cm_seal_append). A
 * manifest is held without that line while it is edited and sealed again at the end.
 */
#ifndef EMBER_TESTS_FUZZ_CKPT_H
#define EMBER_TESTS_FUZZ_CKPT_H

#include <fcntl.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/common.h"
#include "tests/fuzz_buf.h"
#include "tests/fuzz_input.h"

/* The generic damage of any file: overwrite a few bytes, truncate, extend, remove. */
static inline void fz_raw_op(fz_buf *f, fz_in *in)
{
    uint8_t op = fz_u8(in) % 4;
    size_t at = (size_t)fz_uint(in, 2) % (f->len + 1);
    switch (op) {
    case 0: {
        uint8_t bytes[16];
        size_t n = fz_u8(in) % sizeof bytes + 1;
        fz_bytes(in, bytes, n);
        fz_put(f, at, bytes, n);
        break;
    }
    case 1:
        f->len = at;
        break;
    case 2: {
        size_t n = fz_u8(in) + 1u;
        uint8_t fill = fz_u8(in);
        fz_reserve(f, n);
        memset(f->b + f->len, fill, n);
        f->len += n;
        break;
    }
    default:
        f->gone = fz_u8(in) < 16;
        break; /* rarely: most inputs should reach the readers */
    }
}

/* The xxh3 trailer of a binary file, recomputed over what now precedes it. */
static inline void fz_fix_trailer(fz_buf *f)
{
    if (f->gone || f->len < 8) return;
    uint64_t h = cm_xxh3(f->b, f->len - 8);
    memcpy(f->b + f->len - 8, &h, 8);
}

/* ---- manifests ---- */

/* Drops the seal line of a manifest just read (a pristine one always has it). */
static inline void fz_mf_unseal(fz_buf *m)
{
    size_t body = 0;
    if (cm_seal_check((const char *)m->b, m->len, "checksum", &body) != CM_OK) abort();
    m->len = body;
}

static inline void fz_mf_seal(fz_buf *m)
{
    fz_reserve(m, 64);
    int n = cm_seal_append((char *)m->b, m->len, m->cap, "checksum");
    if (n < 0) abort();
    m->len = (size_t)n;
}

/* Start and end (past its '\n', or the text's end) of line `idx`, or of the line starting
 * "name " when name is given; false when there is none. */
static inline bool fz_mf_line(const fz_buf *m, const char *name, size_t idx, size_t *s, size_t *e)
{
    size_t line = 0, nl = name ? strlen(name) : 0;
    for (size_t at = 0; at < m->len; line++) {
        const uint8_t *nlp = memchr(m->b + at, '\n', m->len - at);
        size_t end = nlp ? (size_t)(nlp - m->b) + 1 : m->len;
        if (name ? end - at > nl && memcmp(m->b + at, name, nl) == 0 && m->b[at + nl] == ' '
                 : line == idx) {
            *s = at;
            *e = end;
            return true;
        }
        at = end;
    }
    return false;
}

static inline size_t fz_mf_lines(const fz_buf *m)
{
    size_t n = 0;
    for (size_t i = 0; i < m->len; i++)
        n += m->b[i] == '\n';
    return n;
}

/* Sets "name value\n" in place of the first line of that name, or appends it. */
static inline void fz_mf_set(fz_buf *m, const char *name, const char *value)
{
    char line[512];
    int n = snprintf(line, sizeof line, "%s %s\n", name, value);
    size_t s = m->len, e = m->len;
    fz_mf_line(m, name, 0, &s, &e);
    fz_splice(m, s, e, line, (size_t)n);
}

/* The first word after "name " of that line, as a number (0 when there is none). */
static inline uint64_t fz_mf_u64(const fz_buf *m, const char *name)
{
    size_t s, e;
    if (!fz_mf_line(m, name, 0, &s, &e)) return 0;
    char tmp[128];
    snprintf(tmp, sizeof tmp, "%.*s", (int)(e - s), (const char *)m->b + s);
    return strtoull(tmp + strlen(name) + 1, NULL, 10);
}

/* One edit of a line the input picks: its value (the words after the first) replaced by a
 * number, a float in C99 hex, a nudged number or raw input bytes; the line removed, doubled,
 * or a raw line inserted before it. */
static inline void fz_mf_op(fz_buf *m, fz_in *in)
{
    size_t lines = fz_mf_lines(m), s = m->len, e = m->len;
    fz_mf_line(m, NULL, lines ? fz_u8(in) % lines : 0, &s, &e);
    const uint8_t *sp = memchr(m->b + s, ' ', e - s);
    size_t vs = sp ? (size_t)(sp - m->b) + 1 : e - (e > s && m->b[e - 1] == '\n');
    size_t ve = e > s && m->b[e - 1] == '\n' ? e - 1 : e;
    char val[128] = "";
    int n = 0;
    switch (fz_u8(in) % 8) {
    case 0:
        n = snprintf(val, sizeof val, "%" PRIu64, fz_value(in, 0));
        break;
    case 1: { /* nudge the first number of the value */
        char cur[64];
        snprintf(cur, sizeof cur, "%.*s", (int)(ve - vs < 63 ? ve - vs : 63),
                 (const char *)m->b + vs);
        char *rest;
        uint64_t v = fz_value(in, strtoull(cur, &rest, 10));
        n = snprintf(val, sizeof val, "%" PRIu64 "%s", v, rest);
        break;
    }
    case 2: {
        double d;
        uint64_t bits = fz_uint(in, 8);
        memcpy(&d, &bits, sizeof d);
        n = snprintf(val, sizeof val, "%a", d);
        break;
    }
    case 3: {
        static const char *const odd[] = {
            "nan", "inf",  "-inf", "-0x0p+0",         "-1", "0", "0x1p+128", "18446744073709551616",
            "sgd", "adam", "ftrl", "adagrad_rowwise", " ",  ""};
        n = snprintf(val, sizeof val, "%s", odd[fz_u8(in) % (sizeof odd / sizeof *odd)]);
        break;
    }
    case 4: {
        n = fz_u8(in) % 24;
        for (int i = 0; i < n; i++)
            val[i] = (char)fz_u8(in);
        break;
    }
    case 5:
        fz_splice(m, s, e, "", 0);
        return;
    case 6: {
        uint8_t copy[512];
        size_t l = e - s < sizeof copy ? e - s : sizeof copy;
        memcpy(copy, m->b + s, l);
        fz_splice(m, s, s, copy, l);
        return;
    }
    default: {
        n = fz_u8(in) % 40;
        for (int i = 0; i < n; i++)
            val[i] = (char)fz_u8(in);
        val[n++] = '\n';
        fz_splice(m, s, s, val, (size_t)n);
        return;
    }
    }
    fz_splice(m, vs, ve, val, (size_t)n);
}

/* ---- an embedding snapshot: MANIFEST, rows.bin, sketch.bin ---- */

enum { FZ_MF, FZ_ROWS, FZ_SKETCH, FZ_SNAP_FILES };
static const char *const fz_snap_names[FZ_SNAP_FILES] = {"MANIFEST", "rows.bin", "sketch.bin"};
#define FZ_ROWS_HDR 32u

typedef struct fz_snap {
    fz_buf f[FZ_SNAP_FILES];
    bool has_sketch;
} fz_snap;

static inline void fz_snap_load(fz_snap *s, const char *dir)
{
    char p[4608]; /* callers' folder paths are under 4400 bytes */
    for (int i = 0; i < FZ_SNAP_FILES; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, fz_snap_names[i]);
        if (i == FZ_SKETCH && access(p, R_OK) != 0) {
            s->f[i].gone = true;
            continue;
        }
        fz_load(&s->f[i], p);
    }
    s->has_sketch = !s->f[FZ_SKETCH].gone;
    fz_mf_unseal(&s->f[FZ_MF]);
}

static inline void fz_snap_copy(fz_snap *to, const fz_snap *from)
{
    for (int i = 0; i < FZ_SNAP_FILES; i++) {
        fz_set(&to->f[i], from->f[i].b, from->f[i].len);
        to->f[i].gone = from->f[i].gone;
    }
    to->has_sketch = from->has_sketch;
}

static inline void fz_snap_free(fz_snap *s)
{
    for (int i = 0; i < FZ_SNAP_FILES; i++)
        free(s->f[i].b);
}

/* One mutation of the snapshot. Header fields of rows.bin at their offsets: version 8, dim 12,
 * slots 16, row_bytes 20 (u32), rows 24 (u64). */
static inline void fz_snap_op(fz_snap *s, fz_in *in)
{
    fz_buf *rows = &s->f[FZ_ROWS], *mf = &s->f[FZ_MF];
    uint64_t rb = fz_get(rows, 20, 4), nrec = 0;
    if (rb > 0 && rows->len >= FZ_ROWS_HDR + 8) nrec = (rows->len - FZ_ROWS_HDR - 8) / rb;
    switch (fz_u8(in) % 8) {
    case 0:
        fz_raw_op(&s->f[fz_u8(in) % FZ_SNAP_FILES], in);
        break;
    case 1:
    case 2:
        fz_mf_op(mf, in);
        break;
    case 3: { /* a header field */
        static const uint8_t off[] = {8, 12, 16, 20, 24};
        size_t k = fz_u8(in) % sizeof off;
        int w = off[k] == 24 ? 8 : 4;
        uint64_t v = fz_value(in, fz_get(rows, off[k], w));
        fz_put(rows, off[k], &v, (size_t)w);
        break;
    }
    case 4: { /* a record field: key, updates, last_step, or a float after them */
        if (nrec == 0) break;
        size_t at = FZ_ROWS_HDR + (size_t)(fz_u8(in) % nrec) * rb;
        uint8_t k = fz_u8(in);
        if (k % 4 == 3) {
            static const uint32_t bits[] = {0x7fc00000u, 0x7f800000u, 0xff800000u, 0x80000000u,
                                            0x7f7fffffu};
            uint32_t f = bits[fz_u8(in) % 5];
            size_t fo = 24 + 4 * (size_t)(fz_u8(in) % ((rb - 24) / 4));
            fz_put(rows, at + fo, &f, 4);
        } else {
            uint64_t v = fz_value(in, fz_get(rows, at + 8 * (k % 4u), 8));
            fz_put(rows, at + 8 * (k % 4u), &v, 8);
        }
        break;
    }
    case 5: { /* a record's key made another's: a duplicate */
        if (nrec < 2) break;
        size_t a = fz_u8(in) % nrec, b = fz_u8(in) % nrec;
        /* Through a copy: the two records may overlap (a row_bytes under 8, or a == b), and
         * fz_put may move the buffer it reads from. */
        uint64_t key = fz_get(rows, FZ_ROWS_HDR + b * rb, 8);
        fz_put(rows, FZ_ROWS_HDR + a * rb, &key, 8);
        break;
    }
    case 6: { /* the row count in header and manifest: wrapped around 2^64, or nudged */
        uint64_t n = fz_get(rows, 24, 8);
        if (fz_u8(in) & 1) {
            /* n * rb unchanged mod 2^64 (an odd rb has no such step short of 2^64) */
            if (rb > 0 && rb % 2 == 0) n += 1ull << (64 - __builtin_ctzll(rb));
        } else {
            n = fz_value(in, n);
        }
        fz_put(rows, 24, &n, 8);
        char v[32];
        snprintf(v, sizeof v, "%" PRIu64, n);
        fz_mf_set(mf, "rows", v);
        break;
    }
    default: { /* the last_step of a record past the manifest's step */
        if (nrec == 0) break;
        uint64_t v = fz_mf_u64(mf, "step") + 1 + fz_u8(in) % 4;
        fz_put(rows, FZ_ROWS_HDR + (size_t)(fz_u8(in) % nrec) * rb + 16, &v, 8);
        break;
    }
    }
}

/* Recomputes what the checksums cover: rows.bin's trailer, the manifest's "file" and "sketch"
 * lines (sizes and hashes of the files as they now are; a sketch line the mutations removed
 * stays removed), and the manifest's seal. */
static inline void fz_snap_fix(fz_snap *s)
{
    char v[128];
    fz_buf *rows = &s->f[FZ_ROWS], *sk = &s->f[FZ_SKETCH], *mf = &s->f[FZ_MF];
    size_t ls, le;
    fz_fix_trailer(rows);
    if (!rows->gone) {
        uint64_t h = rows->len >= 8 ? fz_get(rows, rows->len - 8, 8) : 0;
        snprintf(v, sizeof v, "rows.bin %zu %016" PRIx64, rows->len, h);
        if (fz_mf_line(mf, "file", 0, &ls, &le)) fz_mf_set(mf, "file", v);
    }
    if (!sk->gone && sk->len > 0 && fz_mf_line(mf, "sketch", 0, &ls, &le)) {
        snprintf(v, sizeof v, "sketch.bin %zu %016" PRIx64, sk->len, cm_xxh3(sk->b, sk->len));
        fz_mf_set(mf, "sketch", v);
    }
    fz_mf_seal(mf);
}

static inline void fz_snap_store(const fz_snap *s, const char *dir)
{
    char p[4608]; /* callers' folder paths are under 4400 bytes */
    for (int i = 0; i < FZ_SNAP_FILES; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, fz_snap_names[i]);
        fz_store(&s->f[i], p);
    }
}

/* ---- what every reader must do with its errors ---- */

/* A failure is a negative code with a message naming `what` (a directory or file path). */
static inline void fz_check_err(int rc, char **err, const char *what)
{
    if (rc == CM_OK) return;
    if (rc > 0 || *err == NULL || strstr(*err, what) == NULL) {
        fprintf(stderr, "reader failed badly: rc=%d err=%s (must name %s)\n", rc,
                *err ? *err : "(none)", what);
        abort();
    }
    free(*err);
    *err = NULL;
}

#endif
