/*
 * libFuzzer target: damaged serving bundles through ember_serve_open, ember_serve_apply_delta,
 * ember_serve_lookup and ember_serve_predict.
 *
 * Checksums refuse random damage before anything else reads it, so mutating bytes alone only
 * tests the checksums. Here a small valid bundle and a delta on it (a deepfm model: tables
 * "emb" and "lin") are written once per precision with ember_serve_writer_*; each input picks
 * the precision and then a few mutations, each of one file of the base or the delta (overwrite,
 * truncate, insert or erase bytes; set a header integer, or a number in a text file, to a
 * chosen value; resize a file to what its header claims; edit an index slot; insert or delete a
 * text line; write a known key; remove the file). Then every digest the format carries is
 * recomputed: the table and tower trailers, the MANIFEST's "file NAME SIZE XXH3" and
 * "table NAME DIM ROWS" lines, and its checksum line (the input may skip any of these fixes),
 * so the contents' own checks are what refuse a lie.
 *
 * Properties checked (abort on violation): a refused bundle or delta gets a negative code and a
 * message that names the bundle's folder (a file in it, or the folder), and *out stays NULL; an
 * opened one serves lookups of every table (keys present and absent, 0 and UINT64_MAX) where a
 * key not found reads as zeros, predicts a small batch (an error only with a message), takes
 * the delta (or refuses it as above), serves again, and refuses the same delta a second time.
 */
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/common.h"
#include "serve/ember_serve.h"
#include "tests/fuzz_buf.h"
#include "tests/fuzz_input.h"
#include "src/model.h"

enum { N_FILES = 5, N_KEYS = 40, N_CHANGED = 10, N_NEW = 2, N_DELETED = 5, MAX_OPS = 8 };
enum { F_MANIFEST, F_MODEL, F_DENSE, F_EMB, F_LIN };
static const char *const file_names[N_FILES] = {"MANIFEST", "model.txt", "dense-tower.bin",
                                                "table-emb.bin", "table-lin.bin"};

typedef struct fz_bundle {
    fz_buf f[N_FILES];
} fz_bundle;

/* [precision][0 base, 1 delta], as written */
static fz_bundle good[3][2];
static char root[4096], dirs[2][4200];
static uint64_t keys[N_KEYS + N_NEW];
/* Lookup probes: every key written, absent ones, 0, UINT64_MAX, and one the input chooses. */
enum { N_PROBES = N_KEYS + N_NEW + 5 };
static uint64_t probes[N_PROBES];

/* ---- editing a file ---- */

static bool is_table(int file)
{
    return file == F_EMB || file == F_LIN;
}

/* The integer fields of the binary headers (ember_serve.h): offset and width. */
typedef struct hdr_field {
    uint8_t at, width;
} hdr_field;
static const hdr_field tab_fields[] = {{8, 4},  {12, 4}, {16, 4}, {20, 4}, {24, 8},
                                       {32, 8}, {40, 8}, {48, 8}, {56, 8}};
static const hdr_field dns_fields[] = {{8, 4}, {12, 4}, {16, 8}};

static uint64_t get_le(const uint8_t *p, int width)
{
    uint64_t v = 0;
    memcpy(&v, p, (size_t)width);
    return v;
}

static void set_le(uint8_t *p, int width, uint64_t v)
{
    memcpy(p, &v, (size_t)width);
}

/* The size a table or tower header claims for its file, or 0 when it overflows or is past
 * what the fuzzer writes (4 MiB). */
static size_t claimed_size(const fz_buf *b, int file)
{
    const uint64_t cap = 4u << 20;
    if (file == F_DENSE) {
        if (b->len < 24) return 0;
        uint64_t n = get_le(b->b + 16, 8);
        return n < cap / 4 ? (size_t)(24 + 4 * n + 8) : 0;
    }
    if (b->len < 64) return 0;
    uint64_t row_bytes = get_le(b->b + 20, 4), rows = get_le(b->b + 24, 8),
             slots = get_le(b->b + 32, 8), deleted = get_le(b->b + 40, 8);
    if (slots > cap || rows > cap || deleted > cap || row_bytes > cap) return 0;
    uint64_t need = 64 + slots * 16 + rows * row_bytes + deleted * 8 + 8;
    return need <= cap ? (size_t)need : 0;
}

/* Text files: the start of line k (mod the line count). */
static size_t line_start(const fz_buf *b, unsigned k)
{
    size_t lines = 1;
    for (size_t i = 0; i + 1 < b->len; i++)
        lines += b->b[i] == '\n';
    k %= (unsigned)lines;
    size_t at = 0;
    while (k > 0 && at < b->len)
        k -= b->b[at++] == '\n';
    return at;
}

/* Text files: replaces the k-th run of decimal digits (mod their count) with v. */
static void edit_number(fz_buf *b, unsigned k, uint64_t v, bool hex)
{
    size_t runs = 0;
    for (size_t i = 0; i < b->len; i++)
        runs += (b->b[i] >= '0' && b->b[i] <= '9') &&
                (i == 0 || b->b[i - 1] < '0' || b->b[i - 1] > '9');
    if (runs == 0) return;
    k %= (unsigned)runs;
    for (size_t i = 0; i < b->len; i++) {
        if (!(b->b[i] >= '0' && b->b[i] <= '9') ||
            (i > 0 && b->b[i - 1] >= '0' && b->b[i - 1] <= '9'))
            continue;
        if (k-- > 0) continue;
        size_t e = i;
        while (e < b->len && b->b[e] >= '0' && b->b[e] <= '9')
            e++;
        char num[32];
        int len = snprintf(num, sizeof num, hex ? "%016llx" : "%llu", (unsigned long long)v);
        fz_splice(b, i, e, num, (size_t)len);
        return;
    }
}

static const char *const text_lines[] = {
    "type delta\n",
    "type full\n",
    "step 0\n",
    "base_step 9\n",
    "source 0\n",
    "base_source 1111\n",
    "table emb 4 40\n",
    "table lin 1 40\n",
    "table ghost 4 1\n",
    "file table-x.bin 80 0\n",
    "file model.txt 1 0\n",
    "file dense-tower.bin 32 0\n",
    "file table-emb.bin 64 0\n",
    "file table-lin.bin 64 0\n",
    "precision int8\n",
    "ember-bundle 1\n",
    "checksum 0000000000000000\n",
    "kind lr\n",
    "kind mlp\n",
    "kind dlrm\n",
    "fields 1\n",
    "fields 4194304\n",
    "dense 0\n",
    "dim 1024\n",
    "hidden -\n",
    "hidden 65536\n",
    "bottom 4\n",
    "pool mean\n",
    "seed 5\n",
    "dim 1\n",
};

/* One mutation of one file of w, chosen by the input. */
static void mutate(fz_bundle *w, fz_in *in)
{
    uint8_t op = fz_u8(in);
    int file = (op >> 4) % N_FILES;
    fz_buf *b = &w->f[file];
    bool text = file == F_MANIFEST || file == F_MODEL;
    size_t at = (size_t)fz_uint(in, 2) % (b->len + 1);
    switch (op % 10) {
    case 0: { /* overwrite, possibly past the end */
        uint8_t bytes[16];
        size_t k = fz_u8(in) % sizeof bytes + 1;
        fz_bytes(in, bytes, k);
        fz_splice(b, at, at + (b->len - at < k ? b->len - at : k), bytes, k);
        break;
    }
    case 1: /* truncate */
        fz_splice(b, at, b->len, NULL, 0);
        break;
    case 2: { /* insert */
        uint8_t bytes[16];
        size_t k = fz_u8(in) % sizeof bytes + 1;
        fz_bytes(in, bytes, k);
        fz_splice(b, at, at, bytes, k);
        break;
    }
    case 3: { /* erase */
        size_t k = fz_u8(in) + 1u;
        fz_splice(b, at, at + (b->len - at < k ? b->len - at : k), NULL, 0);
        break;
    }
    case 4: /* a header integer (binary) or a number (text) to a chosen value */
        if (text) {
            unsigned k = fz_u8(in);
            bool hex = fz_u8(in) & 1;
            edit_number(b, k, fz_value(in, 0), hex);
        } else {
            const hdr_field *fl = file == F_DENSE ? dns_fields : tab_fields;
            size_t n_fl = file == F_DENSE ? 3 : 9;
            hdr_field f = fl[fz_u8(in) % n_fl];
            if (b->len >= (size_t)f.at + f.width)
                set_le(b->b + f.at, f.width, fz_value(in, get_le(b->b + f.at, f.width)));
        }
        break;
    case 5: /* binary: the size the header claims, keeping the trailer last; text: a line */
        if (text) {
            const char *l = text_lines[fz_u8(in) % (sizeof text_lines / sizeof text_lines[0])];
            size_t ls = line_start(b, fz_u8(in));
            fz_splice(b, ls, ls, l, strlen(l));
        } else {
            size_t want = claimed_size(b, file);
            if (want && b->len >= 8) {
                if (want > b->len)
                    fz_splice(b, b->len - 8, b->len - 8, NULL, want - b->len);
                else
                    fz_splice(b, want - 8, b->len - 8, NULL, 0);
            }
        }
        break;
    case 6: /* tables: an index slot's row or key; text: a line removed */
        if (text) {
            size_t s = line_start(b, fz_u8(in)), e = s;
            while (e < b->len && b->b[e++] != '\n')
                ;
            fz_splice(b, s, e, NULL, 0);
        } else if (is_table(file) && b->len >= 64) {
            uint64_t slots = get_le(b->b + 32, 8);
            uint64_t s = slots ? fz_uint(in, 2) % slots : 0;
            if (64 + (s + 1) * 16 > b->len) break;
            uint8_t *e = b->b + 64 + s * 16;
            if (fz_u8(in) & 1)
                set_le(e + 8, 4, fz_value(in, get_le(e + 8, 4)));
            else
                set_le(e, 8, probes[fz_u8(in) % N_PROBES]);
        }
        break;
    case 7: /* a known key, anywhere (the deleted list, a slot) */
        if (b->len >= 8) {
            at = at > b->len - 8 ? b->len - 8 : at;
            set_le(b->b + at, 8, probes[fz_u8(in) % N_PROBES]);
        }
        break;
    case 8: /* removed */
        b->gone = true;
        break;
    default: /* binary files: an integer anywhere (index, rows, deleted keys) */
        if (!text && b->len >= 8) {
            uint64_t v = fz_value(in, get_le(b->b + at % (b->len - 7), 8));
            set_le(b->b + at % (b->len - 7), (fz_u8(in) & 1) ? 8 : 4, v);
        }
        break;
    }
}

/* ---- making the bundle consistent again ---- */

enum { SKIP_TRAILERS = 1, SKIP_FILE_LINES = 2, SKIP_TABLE_LINES = 4, SKIP_SEAL = 8 };

static void append(fz_buf *out, const void *p, size_t n)
{
    fz_splice(out, out->len, out->len, p, n);
}

/* Rewrites the MANIFEST of w: its file lines with each file's true size and digest, its table
 * lines with the table headers' dim and rows, and its checksum line over the result. */
static void fix_manifest(fz_bundle *w, unsigned skip)
{
    fz_buf *m = &w->f[F_MANIFEST], out = {0};
    size_t end = m->len;
    /* the last checksum line goes: a new one is appended */
    if (!(skip & SKIP_SEAL))
        for (size_t i = m->len; i-- > 0;)
            if ((i == 0 || m->b[i - 1] == '\n') && m->len - i >= 9 &&
                !memcmp(m->b + i, "checksum ", 9)) {
                end = i;
                break;
            }
    for (size_t s = 0, e; s < end; s = e) {
        for (e = s; e < end && m->b[e++] != '\n';)
            ;
        char line[256], name[128], out_line[320];
        unsigned long long size, digest;
        unsigned dim;
        int len = -1;
        if (e - s < sizeof line) {
            memcpy(line, m->b + s, e - s);
            line[e - s] = '\0';
            for (int f = 1; f < N_FILES; f++) {
                const fz_buf *b = &w->f[f];
                if (!(skip & SKIP_FILE_LINES) &&
                    sscanf(line, "file %127s %llu %llx", name, &size, &digest) == 3 &&
                    !strcmp(name, file_names[f]) && !b->gone)
                    len = snprintf(out_line, sizeof out_line, "file %s %zu %016llx\n", name, b->len,
                                   (unsigned long long)cm_xxh3(b->b, b->len));
                if (!(skip & SKIP_TABLE_LINES) && is_table(f) &&
                    sscanf(line, "table %127s %u %llu", name, &dim, &size) == 3 &&
                    !strcmp(name, f == F_EMB ? "emb" : "lin") && b->len >= 64)
                    len = snprintf(out_line, sizeof out_line, "table %s %u %llu\n", name,
                                   (unsigned)get_le(b->b + 12, 4),
                                   (unsigned long long)get_le(b->b + 24, 8));
            }
        }
        if (len > 0)
            append(&out, out_line, (size_t)len);
        else
            append(&out, m->b + s, e - s);
    }
    if (!(skip & SKIP_SEAL)) {
        char seal[64];
        append(&out, NULL, sizeof seal);
        int n = cm_seal_append((char *)out.b, out.len - sizeof seal, out.len, "checksum");
        if (n < 0) abort();
        out.len = (size_t)n;
    } else {
        append(&out, m->b + end, m->len - end);
    }
    out.gone = m->gone;
    free(m->b);
    *m = out;
}

static void fix(fz_bundle *w, unsigned skip)
{
    if (!(skip & SKIP_TRAILERS))
        for (int f = F_DENSE; f < N_FILES; f++) {
            fz_buf *b = &w->f[f];
            if (b->len < 8) continue;
            uint64_t d = cm_xxh3(b->b, b->len - 8);
            memcpy(b->b + b->len - 8, &d, 8);
        }
    fix_manifest(w, skip);
}

/* ---- files ---- */

static void write_bundle(const fz_bundle *w, const char *dir)
{
    char path[4400];
    for (int f = 0; f < N_FILES; f++) {
        snprintf(path, sizeof path, "%s/%s", dir, file_names[f]);
        fz_store(&w->f[f], path);
    }
}

static void copy_bundle(fz_bundle *to, const fz_bundle *from)
{
    for (int f = 0; f < N_FILES; f++) {
        to->f[f] = (fz_buf){0};
        fz_set(&to->f[f], from->f[f].b, from->f[f].len);
    }
}

static void free_bundle(fz_bundle *w)
{
    for (int f = 0; f < N_FILES; f++)
        free(w->f[f].b);
}

static void remove_root(void)
{
    cm_rmtree(root, NULL);
}

/* Writes the base (step 7) and the delta (step 9) at precision p and reads their files. */
static void setup_precision(ember_serve_precision p, const char *model, const float *tower,
                            uint64_t n_tower)
{
    float emb[(N_KEYS + N_NEW) * 4], lin[N_KEYS + N_NEW];
    for (int i = 0; i < N_KEYS + N_NEW; i++) {
        lin[i] = 0.01f * (float)(i - 20);
        for (int j = 0; j < 4; j++)
            emb[i * 4 + j] = 0.05f * (float)((i * 7 + j * 3) % 23 - 11);
    }
    for (int d = 0; d < 2; d++) {
        char dir[4300];
        snprintf(dir, sizeof dir, "%s/good-%d-%d", root, (int)p, d);
        ember_serve_writer *w = NULL;
        char *err = NULL;
        /* the delta: rows 0..N_CHANGED changed, N_NEW new keys, N_DELETED keys deleted */
        const uint64_t *k = d ? keys + N_KEYS - N_CHANGED : keys;
        const uint64_t n = d ? N_CHANGED + N_NEW : N_KEYS;
        const uint64_t *del = d ? keys : NULL;
        const uint64_t n_del = d ? N_DELETED : 0;
        const size_t from = d ? N_KEYS - N_CHANGED : 0;
        int rc = ember_serve_writer_create(dir, p, d, d ? 9 : 7, d ? 7 : 0, &w, &err);
        if (rc == 0) rc = ember_serve_writer_source(w, d ? 0x2222 : 0x1111, 0x1111, &err);
        if (rc == 0) rc = ember_serve_writer_model(w, model, &err);
        if (rc == 0) rc = ember_serve_writer_dense(w, tower, n_tower, &err);
        if (rc == 0)
            rc = ember_serve_writer_table(w, "emb", 4, k, emb + from * 4, n, del, n_del, &err);
        if (rc == 0) rc = ember_serve_writer_table(w, "lin", 1, k, lin + from, n, del, n_del, &err);
        if (rc == 0) rc = ember_serve_writer_commit(w, &err);
        for (int f = 0; rc == 0 && f < N_FILES; f++) {
            char path[4400];
            snprintf(path, sizeof path, "%s/%s", dir, file_names[f]);
            fz_load(&good[p][d].f[f], path);
        }
        if (rc != 0) {
            fprintf(stderr, "fuzz_serve_bundle: writing %s: %s\n", dir, err ? err : "?");
            abort();
        }
    }
}

static void setup(void)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(root, sizeof root, "%s/ember-fuzz-serve-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (mkdtemp(root) == NULL) abort();
    atexit(remove_root);
    for (int d = 0; d < 2; d++) {
        snprintf(dirs[d], sizeof dirs[d], "%s/%s", root, d ? "delta" : "base");
        if (cm_mkdirs(dirs[d], NULL) != 0) abort();
    }
    for (int i = 0; i < N_KEYS + N_NEW; i++)
        keys[i] = (uint64_t)i * 0x9e3779b97f4a7c15ull + 17;
    for (int i = 0; i < N_KEYS + N_NEW; i++)
        probes[i] = keys[i];
    probes[N_KEYS + N_NEW] = 0;
    probes[N_KEYS + N_NEW + 1] = UINT64_MAX;
    probes[N_KEYS + N_NEW + 2] = 12345;
    probes[N_KEYS + N_NEW + 3] = keys[3] + 1;
    model_cfg m;
    model_cfg_preset(&m, MODEL_DEEPFM, 3, 2);
    m.dim = 4;
    m.n_hidden = 1;
    m.hidden[0] = 8;
    char model[512];
    model_layout l;
    if (model_cfg_format(&m, 0, model, sizeof model) < 0 || model_layout_make(&m, &l, NULL) != 0)
        abort();
    float *tower = malloc(l.n_params * sizeof *tower);
    if (tower == NULL) abort();
    for (size_t i = 0; i < l.n_params; i++)
        tower[i] = 0.01f * (float)((int)(i % 17) - 8);
    for (int p = 0; p < 3; p++)
        setup_precision((ember_serve_precision)p, model, tower, l.n_params);
    free(tower);
}

/* ---- what an open handle serves ---- */

static void expect_named(const char *what, int rc, const char *err, const char *dir)
{
    if (rc < 0 && err != NULL && strstr(err, dir) != NULL) return;
    fprintf(stderr, "%s: rc %d, message '%s' does not name %s\n", what, rc, err ? err : "(none)",
            dir);
    abort();
}

static void exercise_lookups(const ember_serve *h, fz_in *in)
{
    probes[N_PROBES - 1] = fz_uint(in, 8);
    for (int t = 0; t < 16; t++) {
        float one;
        if (ember_serve_lookup(h, t, probes, 0, &one, NULL) != 0) break;
        uint32_t dim = ember_serve_table_dim(h, t);
        float *out = malloc((size_t)N_PROBES * dim * sizeof *out);
        uint8_t found[N_PROBES];
        if (out == NULL) abort();
        memset(found, 7, sizeof found);
        if (ember_serve_lookup(h, t, probes, N_PROBES, out, found) != 0) abort();
        for (int i = 0; i < N_PROBES; i++) {
            if (found[i] > 1) abort();
            for (uint32_t j = 0; !found[i] && j < dim; j++)
                if (out[(size_t)i * dim + j] != 0.0f) abort(); /* absent keys read as zeros */
        }
        /* one key at a time: the pipeline's edges */
        if (ember_serve_lookup(h, t, probes + (fz_u8(in) % N_PROBES), 1, out, NULL) != 0) abort();
        free(out);
    }
}

static void exercise_predict(const ember_serve *h, fz_in *in)
{
    model_cfg m;
    int mean_pool = 0;
    if (model_cfg_parse(ember_serve_model(h), &m, &mean_pool, NULL) != 0) abort();
    enum { ROWS = 3 };
    /* a model whose batch would be large is served, but not scored here */
    if ((size_t)ROWS * m.n_fields > 4096 || m.n_dense > 4096) return;
    const size_t slots = (size_t)ROWS * m.n_fields;
    uint32_t *offsets = malloc((slots + 1) * sizeof *offsets);
    uint64_t *bkeys = malloc((slots * 2 + 1) * sizeof *bkeys);
    float *weights = malloc((slots * 2 + 1) * sizeof *weights);
    float *dense = malloc(((size_t)ROWS * m.n_dense + 1) * sizeof *dense), out[ROWS];
    if (!offsets || !bkeys || !weights || !dense) abort();
    uint32_t nnz = 0;
    offsets[0] = 0;
    for (size_t s = 0; s < slots; s++) {
        for (int k = fz_u8(in) % 3; k > 0; k--) {
            weights[nnz] = 0.5f;
            bkeys[nnz++] = probes[fz_u8(in) % N_PROBES];
        }
        offsets[s + 1] = nnz;
    }
    for (size_t i = 0; i < (size_t)ROWS * m.n_dense; i++)
        dense[i] = (float)fz_u8(in) - 8.0f;
    ember_serve_batch b = {
        ROWS, m.n_dense, m.n_fields, dense, offsets, bkeys, (fz_u8(in) & 1) ? weights : NULL};
    char *err = NULL;
    int rc = ember_serve_predict(h, &b, out, &err);
    if (rc != 0 && (rc > 0 || err == NULL)) abort();
    free(err);
    free(offsets);
    free(bkeys);
    free(weights);
    free(dense);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (root[0] == '\0') setup();
    fz_in in = {data, size};
    uint8_t head = fz_u8(&in), flags = fz_u8(&in);
    int prec = head % 3;
    unsigned skip = flags & 0x80 ? flags & 15 : 0; /* fixes skipped: half of such inputs */
    fz_bundle w[2];
    copy_bundle(&w[0], &good[prec][0]);
    copy_bundle(&w[1], &good[prec][1]);
    int n_ops = (head >> 2) % (MAX_OPS + 1);
    for (int i = 0; i < n_ops; i++) {
        int d = fz_u8(&in) & 1;
        mutate(&w[d], &in);
    }
    for (int d = 0; d < 2; d++) {
        fix(&w[d], skip);
        write_bundle(&w[d], dirs[d]);
    }
    ember_serve *h = NULL;
    char *err = NULL;
    int rc = ember_serve_open(dirs[0], &h, &err);
    if (rc != 0) {
        expect_named("open", rc, err, dirs[0]);
        if (h != NULL) abort();
    } else {
        exercise_lookups(h, &in);
        exercise_predict(h, &in);
        rc = ember_serve_apply_delta(h, dirs[1], &err);
        if (rc != 0) {
            expect_named("apply_delta", rc, err, dirs[1]);
        } else {
            exercise_lookups(h, &in);
            exercise_predict(h, &in);
            rc = ember_serve_apply_delta(h, dirs[1], &err); /* the handle is past its base */
            expect_named("apply_delta twice", rc, err, dirs[1]);
        }
    }
    ember_serve_close(h);
    free(err);
    free_bundle(&w[0]);
    free_bundle(&w[1]);
    return 0;
}
