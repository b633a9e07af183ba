/* Serving bundles: writing (export) and mapping + lookup (serving). Format in ember_serve.h. */
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#define XXH_INLINE_ALL /* the same xxh3, inlined: lookups hash every key */
#include <xxhash.h>

#include "common/common.h"
#include "serve/ember_serve.h"
#include "serve/internal.h"

#define TAB_MAGIC "EMBSTAB1"
#define DNS_MAGIC "EMBSDNS1"
#define BUNDLE_VERSION 1u
#define EMPTY_ROW UINT32_MAX
#define MAX_DIM 65536u /* the widest row a table holds: the writer and the reader agree on it */

typedef struct tab_hdr {
    char magic[8];
    uint32_t version, dim, precision, row_bytes;
    uint64_t rows, slots, deleted, step;
    uint8_t reserved[8];
} tab_hdr;
_Static_assert(sizeof(tab_hdr) == 64, "table header is 64 bytes");

/* The layout cm_keyidx writes (the writer fills the index with one). */
typedef struct slot_ent {
    uint64_t key;
    uint32_t row, pad;
} slot_ent;
_Static_assert(sizeof(slot_ent) == 16 && EMPTY_ROW == CM_KEYIDX_EMPTY, "cm_keyidx's entries");

typedef struct dns_hdr {
    char magic[8];
    uint32_t version, zero;
    uint64_t n;
} dns_hdr;

static const char *const prec_names[] = {"fp32", "fp16", "int8"};

int ember_serve_precision_parse(const char *name, ember_serve_precision *out)
{
    for (int i = 0; name && i < 3; i++)
        if (!strcmp(name, prec_names[i])) {
            *out = (ember_serve_precision)i;
            return 0;
        }
    return -1;
}

static size_t row_bytes_of(ember_serve_precision p, uint32_t dim)
{
    return p == EMBER_SERVE_FP32   ? 4 * (size_t)dim
           : p == EMBER_SERVE_FP16 ? 2 * (size_t)dim
                                   : 4 + (size_t)dim;
}

static inline uint64_t key_hash(uint64_t key)
{
    return XXH3_64bits(&key, sizeof key);
}

/* ================= writing ================= */

#define MAX_FILES 16

struct ember_serve_writer {
    char *dir, *tmp;
    ember_serve_precision prec;
    int delta;
    uint64_t step, base_step;
    char manifest[8192];
    size_t mlen;
    int n_tables; /* at most SERVE_MAX_TABLES: what layer_open maps */
    bool has_model, has_dense; /* each once, and both before commit: layer_read needs them */
    char table_names[SERVE_MAX_TABLES][65]; /* each once: layer_open refuses a file listed twice */
    struct open_table *table;               /* between _table_begin and _table_end */
    bool has_dup;                           /* the last table refused dup as a key twice */
    uint64_t dup;
    uint64_t mem; /* a table's index's budget */
};

static void manifest_add(ember_serve_writer *w, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void manifest_add(ember_serve_writer *w, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(w->manifest + w->mlen, sizeof w->manifest - w->mlen, fmt, ap);
    va_end(ap);
    if (n > 0) w->mlen += (size_t)n < sizeof w->manifest - w->mlen ? (size_t)n : 0;
}

int ember_serve_writer_create(const char *dir, ember_serve_precision precision, int delta,
                              uint64_t step, uint64_t base_step, ember_serve_writer **out,
                              char **errptr)
{
    if ((unsigned)precision > EMBER_SERVE_INT8) return cm_err(errptr, CM_EINVAL, "bad precision");
    /* A delta stacked on its base must move the handle forward (apply_delta refuses one that
     * does not): --since a checkpoint that is not older is a mistake, caught here. */
    if (delta && step <= base_step)
        return cm_err(errptr, CM_EINVAL,
                      "%s: a delta must be since an older step, not from step %" PRIu64
                      " to step %" PRIu64,
                      dir, base_step, step);
    /* commit swaps the bundle in as a whole folder: never over a folder of anything else. */
    static const char *const ours[] = {"MANIFEST", NULL};
    int rc = cm_dir_replaceable(dir, ours, errptr);
    if (rc != CM_OK) return rc;
    ember_serve_writer *w = calloc(1, sizeof *w);
    if (w == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    size_t n = strlen(dir) + 48;
    w->dir = strdup(dir);
    w->tmp = malloc(n);
    if (w->dir == NULL || w->tmp == NULL) {
        ember_serve_writer_abort(w);
        return cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    /* Beside the bundle, not in it: "out/" + ".tmp" is out/.tmp, which cannot be swapped
     * with its own parent (EINVAL), so an --out of "out/" was never written. And this writer's
     * own: with one "<dir>.tmp" for all, a second export into dir removed the first's folder
     * while it wrote, and the first then swapped in a MANIFEST over the second's files (a
     * bundle that does not open, in place of a good one, the first exiting 0). Two at once now
     * both finish, and the bundle is whichever swapped in last. */
    static unsigned seq;
    cm_path_trim(w->dir);
    snprintf(w->tmp, n, "%s.tmp-%ld-%u", w->dir, (long)getpid(),
             __atomic_fetch_add(&seq, 1, __ATOMIC_RELAXED));
    w->prec = precision;
    w->mem = EMBER_SERVE_INDEX_MEMORY_DEFAULT;
    w->delta = delta;
    w->step = step;
    w->base_step = base_step;
    rc = cm_rmtree(w->tmp, errptr);
    if (rc == CM_OK) rc = cm_mkdirs(w->tmp, errptr);
    if (rc != CM_OK) {
        ember_serve_writer_abort(w);
        return rc;
    }
    manifest_add(w,
                 "ember-bundle 1\ntype %s\nstep %" PRIu64 "\nbase_step %" PRIu64 "\nprecision %s\n",
                 delta ? "delta" : "full", step, base_step, prec_names[precision]);
    *out = w;
    return CM_OK;
}

int ember_serve_writer_source(ember_serve_writer *w, uint64_t source, uint64_t base_source,
                              char **errptr)
{
    (void)errptr;
    manifest_add(w, "source %016" PRIx64 "\n", source);
    if (w->delta) manifest_add(w, "base_source %016" PRIx64 "\n", base_source);
    return CM_OK;
}

void ember_serve_writer_memory(ember_serve_writer *w, uint64_t bytes)
{
    w->mem = bytes;
}

const char *ember_serve_writer_scratch(const ember_serve_writer *w)
{
    return w->tmp;
}

static void table_close(ember_serve_writer *w, bool keep);

void ember_serve_writer_abort(ember_serve_writer *w)
{
    if (w == NULL) return;
    table_close(w, false);
    if (w->tmp) cm_rmtree(w->tmp, NULL);
    free(w->dir);
    free(w->tmp);
    free(w);
}

/* Writes parts as one file in the bundle with an xxh3 trailer; records it in the manifest. */
static int write_parts(ember_serve_writer *w, const char *name, const void *const *parts,
                       const size_t *lens, int n_parts, bool trailer, char **errptr)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", w->tmp, name);
    cm_afile f;
    int rc = cm_afile_open(&f, path, errptr);
    for (int i = 0; rc == CM_OK && i < n_parts; i++)
        if (lens[i]) rc = cm_afile_write(&f, parts[i], lens[i], errptr);
    if (rc == CM_OK && trailer) {
        uint64_t d = cm_afile_digest(&f);
        rc = cm_afile_write(&f, &d, sizeof d, errptr);
    }
    if (rc != CM_OK) {
        cm_afile_abort(&f);
        return rc;
    }
    uint64_t size = f.bytes, digest = cm_afile_digest(&f);
    rc = cm_afile_commit(&f, errptr);
    if (rc == CM_OK) manifest_add(w, "file %s %" PRIu64 " %016" PRIx64 "\n", name, size, digest);
    return rc;
}

int ember_serve_writer_model(ember_serve_writer *w, const char *text, char **errptr)
{
    if (w->has_model) return cm_err(errptr, CM_EINVAL, "%s: model.txt written twice", w->dir);
    const void *parts[1] = {text};
    size_t lens[1] = {strlen(text)};
    int rc = write_parts(w, "model.txt", parts, lens, 1, false, errptr);
    w->has_model = rc == CM_OK;
    return rc;
}

int ember_serve_writer_dense(ember_serve_writer *w, const float *values, uint64_t n, char **errptr)
{
    if (w->has_dense) return cm_err(errptr, CM_EINVAL, "%s: dense-tower.bin written twice", w->dir);
    dns_hdr h = {.version = BUNDLE_VERSION, .n = n};
    memcpy(h.magic, DNS_MAGIC, 8);
    const void *parts[2] = {&h, values};
    size_t lens[2] = {sizeof h, n * sizeof(float)};
    int rc = write_parts(w, "dense-tower.bin", parts, lens, 2, true, errptr);
    w->has_dense = rc == CM_OK;
    return rc;
}

static void encode_row(ember_serve_precision p, const float *x, uint32_t dim, uint8_t *out)
{
    if (p == EMBER_SERVE_FP32) {
        memcpy(out, x, dim * sizeof(float));
    } else if (p == EMBER_SERVE_FP16) {
        cm_f32_to_f16_n(x, out, dim);
    } else {
        cm_int8_row_encode(x, dim, out);
    }
}

/* The first value of x that p cannot hold (dim when all fit), rather than serve it changed:
 * fp16 rounds a magnitude of 65520 or more to inf; int8 quantizes a NaN to -127 (served as
 * -max), and an inf, or a max whose scale * 127 overflows, serves the row as NaN or inf. */
static uint32_t row_unfit(ember_serve_precision p, const float *x, uint32_t dim)
{
    for (uint32_t j = 0; p != EMBER_SERVE_FP32 && j < dim; j++) {
        float a = fabsf(x[j]);
        if (p == EMBER_SERVE_FP16 ? isfinite(a) && a >= 65520.0f
                                  : !isfinite(a) || !isfinite(127.0f * (a / 127.0f)))
            return j;
    }
    return dim;
}

/* The table being written (ember_serve_writer_table_begin .. _end): its file is made at full
 * size up front, the rows written in place as they come and the index region by a cm_keyidx at
 * _end, so the writer holds the index's budget and a chunk of rows, not the table. */
struct open_table {
    char name[65], path[4200], part[4208];
    uint32_t dim;
    size_t rb;
    uint64_t max_rows, n, slots;
    int fd;
    cm_keyidx *ix;
    uint8_t *enc; /* encoded rows not yet written: chunk rows of rb bytes */
    size_t chunk, held;
    uint64_t n_del, last_del; /* deleted keys written (after the rows), the last of them */
};
typedef struct open_table open_table;

#define ENC_CHUNK (1u << 20)

static uint64_t rows_offset(const open_table *t)
{
    return sizeof(tab_hdr) + t->slots * sizeof(slot_ent);
}

/* Writes the encoded rows held (they follow the t->n - t->held rows already in the file). */
static int enc_flush(open_table *t, char **errptr)
{
    if (t->held == 0) return CM_OK;
    if (cm_pwrite_full(t->fd, t->enc, t->held * t->rb, rows_offset(t) + (t->n - t->held) * t->rb) !=
        CM_OK)
        return cm_err_errno(errptr, CM_EIO, "cannot write %s", t->part);
    t->held = 0;
    return CM_OK;
}

static void table_close(ember_serve_writer *w, bool keep)
{
    open_table *t = w->table;
    if (t == NULL) return;
    cm_keyidx_close(t->ix);
    if (t->fd >= 0) close(t->fd);
    if (!keep) unlink(t->part);
    free(t->enc);
    free(t);
    w->table = NULL;
}

int ember_serve_writer_table_begin(ember_serve_writer *w, const char *name, uint32_t dim,
                                   uint64_t max_rows, char **errptr)
{
    /* What table_check would refuse is refused here, not written as a bundle no one opens. */
    if (dim == 0 || dim > MAX_DIM || max_rows >= EMPTY_ROW || strlen(name) > 64)
        return cm_err(errptr, CM_EINVAL, "table %s: dim %u or %" PRIu64 " rows out of range", name,
                      dim, max_rows);
    if (w->table != NULL)
        return cm_err(errptr, CM_EINVAL, "table %s: table %s is not ended", name, w->table->name);
    if (w->n_tables == SERVE_MAX_TABLES)
        return cm_err(errptr, CM_EINVAL, "table %s: a bundle holds at most %d tables", name,
                      SERVE_MAX_TABLES);
    for (int i = 0; i < w->n_tables; i++)
        if (!strcmp(w->table_names[i], name))
            return cm_err(errptr, CM_EINVAL, "table %s: written twice", name);
    open_table *t = calloc(1, sizeof *t);
    if (t == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    w->table = t;
    w->has_dup = false;
    snprintf(t->name, sizeof t->name, "%s", name);
    snprintf(t->path, sizeof t->path, "%s/table-%s.bin", w->tmp, name);
    snprintf(t->part, sizeof t->part, "%s.part", t->path);
    t->dim = dim;
    t->rb = row_bytes_of(w->prec, dim);
    t->max_rows = max_rows;
    t->slots = cm_keyidx_slots(max_rows);
    t->chunk = ENC_CHUNK / t->rb + 1;
    t->enc = malloc(t->chunk * t->rb);
    t->fd = open(t->part, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    int rc = t->enc ? CM_OK : cm_err(errptr, CM_ENOMEM, "out of memory");
    if (rc == CM_OK && t->fd < 0) rc = cm_err_errno(errptr, CM_EIO, "cannot create %s", t->part);
    if (rc == CM_OK && ftruncate(t->fd, (off_t)(rows_offset(t) + max_rows * t->rb)) != 0)
        rc = cm_err_errno(errptr, CM_EIO, "cannot size %s", t->part);
    /* Named by the table, not by the file in the writer's folder. */
    if (rc == CM_OK && w->mem < cm_keyidx_least(t->slots))
        rc = cm_err(errptr, CM_EINVAL,
                    "table %s: a memory budget of %" PRIu64 " bytes is too small for the index of "
                    "%" PRIu64 " rows: it needs at least %" PRIu64 " bytes",
                    name, w->mem, max_rows, cm_keyidx_least(t->slots));
    if (rc == CM_OK)
        rc = cm_keyidx_open(t->fd, t->part, sizeof(tab_hdr), t->slots, w->mem, w->tmp, &t->ix,
                            errptr);
    if (rc != CM_OK) table_close(w, false);
    return rc;
}

/* The index's refusal of a key twice, naming the table (and kept for _dup). */
static int table_dup(ember_serve_writer *w, int rc, char **errptr)
{
    uint64_t key;
    if (rc == CM_EINVAL && cm_keyidx_dup(w->table->ix, &key)) {
        w->has_dup = true;
        w->dup = key;
        rc = cm_err(errptr, CM_EINVAL, "table %s: key %" PRIu64 " twice", w->table->name, key);
    }
    return rc;
}

int ember_serve_writer_table_rows(ember_serve_writer *w, const uint64_t *keys, const float *rows,
                                  uint64_t n, char **errptr)
{
    open_table *t = w->table;
    if (t == NULL) return cm_err(errptr, CM_EINVAL, "%s: rows before a table is begun", w->dir);
    const uint32_t dim = t->dim;
    int rc = n > t->max_rows - t->n
                 ? cm_err(errptr, CM_EINVAL, "table %s: more than the %" PRIu64 " rows begun with",
                          t->name, t->max_rows)
             : t->n_del > 0
                 ? cm_err(errptr, CM_EINVAL, "table %s: rows after deleted keys", t->name)
                 : CM_OK;
    for (uint64_t i = 0; rc == CM_OK && i < n; i++) {
        uint32_t bad = row_unfit(w->prec, rows + i * dim, dim);
        if (bad < dim) {
            rc = cm_err(errptr, CM_EINVAL,
                        "table %s key %" PRIu64 ": value %g (column %u) cannot be stored as %s; "
                        "export it as fp32",
                        t->name, keys[i], (double)rows[i * dim + bad], bad, prec_names[w->prec]);
            break;
        }
        rc = table_dup(w, cm_keyidx_add(t->ix, keys[i], (uint32_t)t->n, errptr), errptr);
        if (rc != CM_OK) break;
        encode_row(w->prec, rows + i * dim, dim, t->enc + t->held * t->rb);
        t->n++;
        if (++t->held == t->chunk) rc = enc_flush(t, errptr);
    }
    if (rc != CM_OK) table_close(w, false);
    return rc;
}

/* cm_fd_each_chunk's step: this file's (inlined) xxh3 over one piece. */
static void hash_chunk(void *st, const void *buf, size_t n)
{
    XXH3_64bits_update(st, buf, n);
}

/* A table file's trailer, the xxh3 of its first len bytes read back (the index is written after
 * of order), and the manifest's digest of the file with that trailer appended. */
static int file_digest(int fd, const char *path, uint64_t len, uint64_t *trailer, uint64_t *whole,
                       char **errptr)
{
    XXH3_state_t *hs = XXH3_createState();
    int rc = hs ? CM_OK : cm_err(errptr, CM_ENOMEM, "out of memory");
    if (rc == CM_OK) XXH3_64bits_reset(hs);
    if (rc == CM_OK) rc = cm_fd_each_chunk(fd, path, len, hash_chunk, hs, errptr);
    if (rc == CM_OK) {
        *trailer = XXH3_64bits_digest(hs);
        XXH3_64bits_update(hs, trailer, sizeof *trailer);
        *whole = XXH3_64bits_digest(hs);
    }
    if (hs) XXH3_freeState(hs);
    return rc;
}

/* Appends n deleted keys, ascending after those written before, behind the rows. */
static int deleted_add(open_table *t, const uint64_t *deleted, uint64_t n, char **errptr)
{
    for (uint64_t i = 0; i < n; i++)
        if (i > 0 ? deleted[i] < deleted[i - 1] : t->n_del > 0 && deleted[0] < t->last_del)
            return cm_err(errptr, CM_EINVAL, "table %s: deleted keys not ascending", t->name);
    if (n && cm_pwrite_full(t->fd, deleted, n * 8, rows_offset(t) + t->n * t->rb + t->n_del * 8))
        return cm_err_errno(errptr, CM_EIO, "cannot write %s", t->part);
    if (n) t->last_del = deleted[n - 1];
    t->n_del += n;
    return CM_OK;
}

int ember_serve_writer_table_deleted(ember_serve_writer *w, const uint64_t *deleted, uint64_t n,
                                     char **errptr)
{
    open_table *t = w->table;
    if (t == NULL) return cm_err(errptr, CM_EINVAL, "%s: no table begun", w->dir);
    int rc = deleted_add(t, deleted, n, errptr);
    if (rc != CM_OK) table_close(w, false);
    return rc;
}

int ember_serve_writer_table_end(ember_serve_writer *w, const uint64_t *deleted, uint64_t n_deleted,
                                 char **errptr)
{
    open_table *t = w->table;
    if (t == NULL) return cm_err(errptr, CM_EINVAL, "%s: no table begun", w->dir);
    int rc = enc_flush(t, errptr);
    if (rc == CM_OK) rc = table_dup(w, cm_keyidx_finish(t->ix, errptr), errptr);
    if (rc == CM_OK) rc = deleted_add(t, deleted, n_deleted, errptr);
    n_deleted = t->n_del;
    tab_hdr h = {.version = BUNDLE_VERSION,
                 .dim = t->dim,
                 .precision = (uint32_t)w->prec,
                 .row_bytes = (uint32_t)t->rb,
                 .rows = t->n,
                 .slots = t->slots,
                 .deleted = n_deleted,
                 .step = w->step};
    memcpy(h.magic, TAB_MAGIC, 8);
    const uint64_t del_at = rows_offset(t) + t->n * t->rb, end = del_at + n_deleted * 8;
    uint64_t trailer = 0, digest = 0;
    if (rc == CM_OK &&
        (cm_pwrite_full(t->fd, &h, sizeof h, 0) != CM_OK || ftruncate(t->fd, (off_t)end) != 0))
        rc = cm_err_errno(errptr, CM_EIO, "cannot write %s", t->part);
    if (rc == CM_OK) rc = file_digest(t->fd, t->part, end, &trailer, &digest, errptr);
    if (rc == CM_OK && (cm_pwrite_full(t->fd, &trailer, 8, end) != CM_OK || fsync(t->fd) != 0))
        rc = cm_err_errno(errptr, CM_EIO, "cannot write %s", t->part);
    if (rc == CM_OK) {
        cm_keyidx_close(t->ix);
        t->ix = NULL;
        if (close(t->fd) != 0) rc = cm_err_errno(errptr, CM_EIO, "cannot close %s", t->part);
        t->fd = -1;
    }
    if (rc == CM_OK && rename(t->part, t->path) != 0)
        rc = cm_err_errno(errptr, CM_EIO, "cannot rename %s", t->part);
    if (rc == CM_OK) {
        manifest_add(w, "file table-%s.bin %" PRIu64 " %016" PRIx64 "\n", t->name, end + 8, digest);
        manifest_add(w, "table %s %u %" PRIu64 "\n", t->name, t->dim, t->n);
        snprintf(w->table_names[w->n_tables++], sizeof w->table_names[0], "%s", t->name);
    }
    table_close(w, rc == CM_OK);
    return rc;
}

int ember_serve_writer_table_dup(const ember_serve_writer *w, uint64_t *key)
{
    if (w->has_dup) *key = w->dup;
    return w->has_dup;
}

int ember_serve_writer_table(ember_serve_writer *w, const char *name, uint32_t dim,
                             const uint64_t *keys, const float *rows, uint64_t n,
                             const uint64_t *deleted, uint64_t n_deleted, char **errptr)
{
    uint64_t *del = malloc(n_deleted * sizeof *del + 1);
    if (del == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    if (n_deleted) memcpy(del, deleted, n_deleted * sizeof *del);
    qsort(del, n_deleted, sizeof *del, cm_u64_cmp);
    int rc = ember_serve_writer_table_begin(w, name, dim, n, errptr);
    if (rc == CM_OK) rc = ember_serve_writer_table_rows(w, keys, rows, n, errptr);
    if (rc == CM_OK) rc = ember_serve_writer_table_end(w, del, n_deleted, errptr);
    free(del);
    return rc;
}

int ember_serve_writer_commit(ember_serve_writer *w, char **errptr)
{
    /* ember_serve_open refuses a bundle without any of these (one written for lookups alone,
     * without its tower): refused here, not put in place over a good one. */
    if (!w->has_model || !w->has_dense || w->n_tables == 0 || w->table != NULL) {
        int rc = cm_err(errptr, CM_EINVAL,
                        "%s: a bundle needs model.txt, dense-tower.bin and a "
                        "table; it has no %s",
                        w->dir,
                        !w->has_model   ? "model.txt"
                        : !w->has_dense ? "dense-tower.bin"
                        : w->table      ? "end to its last table"
                                        : "table");
        ember_serve_writer_abort(w);
        return rc;
    }
    int sealed = cm_seal_append(w->manifest, w->mlen, sizeof w->manifest, "checksum");
    char path[4200];
    snprintf(path, sizeof path, "%s/MANIFEST", w->tmp);
    int rc = sealed < 0 ? cm_err(errptr, CM_ERR, "manifest too long")
                        : cm_write_file_atomic(path, w->manifest, (size_t)sealed, errptr);
    if (rc == CM_OK) rc = cm_fsync_dir(w->tmp, errptr);
    if (rc == CM_OK) rc = cm_dir_swap(w->tmp, w->dir, errptr);
    ember_serve_writer_abort(w);
    return rc;
}

/* ================= reading ================= */

/* Maps a file read-only and checks its size and xxh3 against the manifest. */
static int map_file(const char *dir, const char *name, uint64_t size, uint64_t digest, serve_map *m,
                    char **errptr)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return cm_err_errno(errptr, CM_ECORRUPT, "bundle file %s", path);
    struct stat st;
    int rc = CM_OK;
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != size || size == 0) {
        rc =
            cm_err(errptr, CM_ECORRUPT, "%s: size %lld, the manifest says %" PRIu64 " (truncated?)",
                   path, (long long)st.st_size, size);
        close(fd);
        return rc;
    }
    void *p = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return cm_err_errno(errptr, CM_EIO, "cannot map %s", path);
    if (cm_xxh3(p, size) != digest) {
        munmap(p, size);
        return cm_err(errptr, CM_ECORRUPT, "%s: checksum mismatch", path);
    }
    m->p = p;
    m->len = size;
    return CM_OK;
}

static void unmap(serve_map *m)
{
    if (m->p) munmap(m->p, m->len);
    m->p = NULL;
}

/* Checks a mapped table file's internal structure. */
static int table_check(const char *dir, const char *name, serve_table *t, uint64_t step,
                       char **errptr)
{
    const uint8_t *p = t->map.p;
    /* The manifest vouches for the size, not that it holds a header and trailer: check before
     * reading either, or a short file is read past its end (and before its start). */
    if (t->map.len < sizeof(tab_hdr) + 8)
        return cm_err(errptr, CM_ECORRUPT, "%s/%s: %zu bytes, too short for a table", dir, name,
                      t->map.len);
    tab_hdr h;
    memcpy(&h, p, sizeof h);
    uint64_t trailer;
    memcpy(&trailer, p + t->map.len - 8, 8);
    size_t rb = row_bytes_of((ember_serve_precision)h.precision, h.dim);
    if (memcmp(h.magic, TAB_MAGIC, 8) || h.version != BUNDLE_VERSION || h.precision > 2 ||
        h.dim == 0 || h.dim > MAX_DIM || h.row_bytes != rb || h.slots == 0 ||
        (h.slots & (h.slots - 1)) || h.rows >= h.slots || h.slots > (1ull << 40) ||
        h.deleted > (1ull << 40) || h.step != step ||
        t->map.len != sizeof h + h.slots * sizeof(slot_ent) + h.rows * rb + h.deleted * 8 + 8 ||
        cm_xxh3(p, t->map.len - 8) != trailer)
        return cm_err(errptr, CM_ECORRUPT, "%s/%s: bad table header or structure", dir, name);
    t->dim = h.dim;
    t->prec = (ember_serve_precision)h.precision;
    t->row_bytes = rb;
    t->rows = h.rows;
    t->mask = h.slots - 1;
    t->index = p + sizeof h;
    t->data = p + sizeof h + h.slots * sizeof(slot_ent);
    t->deleted = (const uint64_t *)(t->data + h.rows * rb);
    t->n_deleted = h.deleted;
    /* Every index entry must point at a row: a lookup never reads past the data. */
    const slot_ent *ix = t->index;
    for (uint64_t i = 0; i < h.slots; i++)
        if (ix[i].row != EMPTY_ROW && ix[i].row >= h.rows)
            return cm_err(errptr, CM_ECORRUPT, "%s/%s: index entry %" PRIu64 " out of range", dir,
                          name, i);
    return CM_OK;
}

/* Checks the mapped dense tower file (L->dense_map) and points L->dense at its values. */
static int dense_check(const char *dir, const char *name, serve_layer *L, char **errptr)
{
    const uint8_t *p = L->dense_map.p;
    const size_t len = L->dense_map.len;
    /* As for tables: the header and trailer must be inside the file before they are read. */
    if (len < sizeof(dns_hdr) + 8)
        return cm_err(errptr, CM_ECORRUPT, "%s/%s: %zu bytes, too short for a dense tower", dir,
                      name, len);
    dns_hdr h;
    memcpy(&h, p, sizeof h);
    uint64_t tr;
    memcpy(&tr, p + len - 8, 8);
    /* The count is compared with the values the file has room for, not its size in bytes
     * with the file's: n * 4 wraps for n >= 2^62, and such a count passed. */
    const size_t room = len - sizeof h - 8;
    if (memcmp(h.magic, DNS_MAGIC, 8) || h.version != BUNDLE_VERSION || room % 4 != 0 ||
        h.n != room / 4 || cm_xxh3(p, len - 8) != tr)
        return cm_err(errptr, CM_ECORRUPT, "%s/%s: bad dense header", dir, name);
    L->dense = (const float *)(p + sizeof h);
    L->n_dense = h.n;
    return CM_OK;
}

static const char *mf_value(const char *text, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (!strncmp(p, name, n) && p[n] == ' ') return p + n + 1;
    return NULL;
}

static void layer_close(serve_layer *L)
{
    for (int i = 0; i < L->n_tables; i++)
        unmap(&L->tables[i].map);
    unmap(&L->dense_map);
    free(L->model);
    memset(L, 0, sizeof *L);
}

/* "table-NAME.bin" with a NAME that fits serve_table's name whole (so file_listed, which
 * rebuilds the file name from it, recognises the file again). */
static bool is_table_file(const char *fname)
{
    size_t n = strlen(fname);
    return !strncmp(fname, "table-", 6) && n > 10 && n - 10 < sizeof(((serve_table *)0)->name) &&
           !strcmp(fname + n - 4, ".bin");
}

/* Whether the manifest's file fname is already in L. */
static bool file_listed(const serve_layer *L, const char *fname)
{
    if (!strcmp(fname, "model.txt")) return L->model != NULL;
    if (!strcmp(fname, "dense-tower.bin")) return L->dense_map.p != NULL;
    char tf[96];
    for (int i = 0; i < L->n_tables; i++) {
        snprintf(tf, sizeof tf, "table-%s.bin", L->tables[i].name);
        if (!strcmp(tf, fname)) return true;
    }
    return false;
}

/* Reads one bundle directory into a layer: manifest, every file verified. */
static int layer_read(const char *dir, serve_layer *L, char **errptr)
{
    memset(L, 0, sizeof *L);
    char path[4200];
    snprintf(path, sizeof path, "%s/MANIFEST", dir);
    char *text = NULL;
    size_t len;
    int rc = cm_read_file(path, (void **)&text, &len, errptr);
    if (rc != CM_OK)
        return rc == CM_ENOTFOUND
                   ? cm_err(errptr, CM_ECORRUPT, "%s: no MANIFEST (not a bundle?)", dir)
                   : rc;
    /* The checksum line must be the last: bytes after it are damage, not a bundle's. */
    size_t body = 0;
    bool sealed = cm_seal_check(text, len, "checksum", &body) == CM_OK;
    if (sealed) text[body] = '\0';
    unsigned long long step = 0, base = 0;
    char type[16] = "";
    if (!sealed || strncmp(text, "ember-bundle 1\n", 15) || !mf_value(text, "type") ||
        sscanf(mf_value(text, "type"), "%15s", type) != 1 || !mf_value(text, "step") ||
        sscanf(mf_value(text, "step"), "%llu", &step) != 1 || !mf_value(text, "base_step") ||
        sscanf(mf_value(text, "base_step"), "%llu", &base) != 1) {
        rc = cm_err(errptr, CM_ECORRUPT,
                    "%s: not a bundle manifest, or its checksum does not match", path);
        goto out;
    }
    L->delta = !strcmp(type, "delta");
    L->step = step;
    L->base_step = base;
    unsigned long long src = 0, bsrc = 0;
    const char *sv = mf_value(text, "source"), *bv = mf_value(text, "base_source");
    L->has_source = sv != NULL;
    if ((sv && sscanf(sv, "%llx", &src) != 1) || (L->has_source && L->delta && !bv) ||
        (bv && sscanf(bv, "%llx", &bsrc) != 1)) {
        rc = cm_err(errptr, CM_ECORRUPT, "%s: a bad source line", path);
        goto out;
    }
    L->source = src;
    L->base_source = bsrc;
    /* Files, then tables (each table names a file listed before it). */
    for (char *p = text; rc == CM_OK && p < text + body; p = strchr(p, '\n') + 1) {
        char fname[128];
        unsigned long long size, digest;
        unsigned dim;
        if (sscanf(p, "file %127s %llu %llx", fname, &size, &digest) == 3) {
            if (file_listed(L, fname)) {
                /* A second line would map the file again over the first (leaking it) or add
                 * a second table of one name: a manifest lists each file once. */
                rc = cm_err(errptr, CM_ECORRUPT, "%s: file %s listed twice", path, fname);
            } else if (!strcmp(fname, "model.txt") || !strcmp(fname, "dense-tower.bin")) {
                bool model = !strcmp(fname, "model.txt");
                serve_map m = {0};
                rc = map_file(dir, fname, size, digest, &m, errptr);
                if (rc != CM_OK) break;
                if (model) {
                    L->model = strndup(m.p, m.len);
                    unmap(&m);
                    if (L->model == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
                } else {
                    L->dense_map = m;
                    rc = dense_check(dir, fname, L, errptr);
                }
            } else if (is_table_file(fname) && L->n_tables < SERVE_MAX_TABLES) {
                serve_table *t = &L->tables[L->n_tables];
                rc = map_file(dir, fname, size, digest, &t->map, errptr);
                if (rc == CM_OK) {
                    L->n_tables++;
                    snprintf(t->name, sizeof t->name, "%.*s", (int)(strlen(fname) - 10), fname + 6);
                    rc = table_check(dir, fname, t, L->step, errptr);
                }
            } else {
                rc = cm_err(errptr, CM_ECORRUPT, "%s: unexpected file %s", path, fname);
            }
        } else if (sscanf(p, "table %127s %u %llu", fname, &dim, &size) == 3) {
            int found = 0;
            for (int i = 0; i < L->n_tables; i++)
                if (!strcmp(L->tables[i].name, fname))
                    found = L->tables[i].dim == dim && L->tables[i].rows == size;
            if (!found)
                rc = cm_err(errptr, CM_ECORRUPT, "%s: table %s does not match its file", path,
                            fname);
        }
    }
    if (rc == CM_OK && (L->model == NULL || L->dense == NULL || L->n_tables == 0))
        rc = cm_err(errptr, CM_ECORRUPT, "%s: model, dense tower or tables missing", path);
out:
    free(text);
    if (rc != CM_OK) layer_close(L);
    return rc;
}

/* How long layer_open keeps retrying while exports replace the bundle under it (a storm of
 * exports into one folder: each retry follows a replacement). */
#define LAYER_OPEN_RETRY_S 10.0

/* layer_read, again when the folder at dir was replaced meanwhile. An export puts a new bundle
 * in place by exchanging folders and then removing the old one (cm_dir_swap): an open that
 * read one's MANIFEST and the other's files, or found them removed, refused a good bundle as
 * damaged ("checksum mismatch", "no MANIFEST"). A failure with the same folder at dir
 * throughout stands. That folder is held open while it is read, so no other can take its inode
 * number meanwhile (ext4 hands a removed folder's number to the next one made, and ctime is
 * coarse: compared by inode and ctime alone, an export's new folder could pass for the one a
 * failed read had started on; not seen in a test, which the held folder rules out); and the
 * retries are bounded by time rather than by a count of 8, which a tight loop of exports into
 * one folder could use up. */
static int layer_open(const char *dir, serve_layer *L, char **errptr)
{
    const double give_up = cm_now() + LAYER_OPEN_RETRY_S;
    for (;;) {
        char *err = NULL;
        int held = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        int rc = layer_read(dir, L, &err);
        struct stat was, now;
        bool replaced = rc != CM_OK && held >= 0 && fstat(held, &was) == 0 &&
                        stat(dir, &now) == 0 &&
                        (was.st_dev != now.st_dev || was.st_ino != now.st_ino);
        if (held >= 0) close(held);
        if (!replaced || cm_now() > give_up) {
            if (err != NULL && errptr != NULL) {
                free(*errptr); /* as cm_err does */
                *errptr = err;
            } else {
                free(err);
            }
            return rc;
        }
        free(err);
    }
}

int ember_serve_open(const char *bundle, ember_serve **out, char **errptr)
{
    ember_serve *h = calloc(1, sizeof *h);
    if (h == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    int rc = layer_open(bundle, &h->layers[0], errptr);
    if (rc == CM_OK) h->n_layers = 1; /* from here on, close unmaps it */
    if (rc == CM_OK && h->layers[0].delta)
        rc =
            cm_err(errptr, CM_EINVAL, "%s is a delta bundle: open its base, then apply it", bundle);
    if (rc == CM_OK) rc = serve_model_init(h, bundle, errptr);
    if (rc != CM_OK) {
        ember_serve_close(h);
        return rc;
    }
    *out = h;
    return CM_OK;
}

int ember_serve_apply_delta(ember_serve *h, const char *delta, char **errptr)
{
    if (h->n_layers >= SERVE_MAX_LAYERS)
        return cm_err(errptr, CM_EINVAL, "too many deltas (%d); export a full bundle",
                      SERVE_MAX_LAYERS - 1);
    serve_layer L;
    int rc = layer_open(delta, &L, errptr);
    if (rc != CM_OK) return rc;
    const serve_layer *top = &h->layers[h->n_layers - 1];
    /* step <= base_step: a delta that would take the handle back (or nowhere). */
    if (!L.delta || L.step <= L.base_step || L.base_step != top->step ||
        strcmp(L.model, top->model) != 0 || L.n_dense != top->n_dense ||
        L.n_tables != h->layers[0].n_tables) {
        layer_close(&L);
        return cm_err(errptr, CM_EINVAL, "%s is not a delta on step %" PRIu64 " of this model",
                      delta, top->step);
    }
    /* Same step and model, but taken against other content (another run, or a run resumed
     * from elsewhere): its rows would silently mix with a base they do not belong to. */
    if (L.has_source && top->has_source && L.base_source != top->source) {
        const uint64_t against = L.base_source;
        layer_close(&L);
        return cm_err(errptr, CM_EINVAL,
                      "%s was taken against checkpoint content %016" PRIx64
                      ", but this handle serves %016" PRIx64 " (another run's step %" PRIu64 "?)",
                      delta, against, top->source, top->step);
    }
    for (int i = 0; i < L.n_tables; i++)
        if (strcmp(L.tables[i].name, h->layers[0].tables[i].name) ||
            L.tables[i].dim != h->layers[0].tables[i].dim) {
            layer_close(&L);
            return cm_err(errptr, CM_EINVAL, "%s: table %d differs from the base", delta, i);
        } else if (L.tables[i].prec != h->layers[0].tables[i].prec) {
            /* Its rows would be served at another precision beside the base's: neither the full
             * export at one precision nor at the other (an int8 base, a delta exported without
             * --precision int8). */
            const ember_serve_precision was = h->layers[0].tables[i].prec, is = L.tables[i].prec;
            char name[sizeof L.tables[i].name];
            snprintf(name, sizeof name, "%s", L.tables[i].name);
            layer_close(&L);
            return cm_err(errptr, CM_EINVAL,
                          "%s: table %s is %s, the base's is %s (export the delta with "
                          "--precision %s)",
                          delta, name, prec_names[is], prec_names[was], prec_names[was]);
        }
    /* The newest layer carries the current tower. */
    rc = serve_model_tower(h, L.dense, errptr);
    if (rc != CM_OK) {
        layer_close(&L);
        return rc;
    }
    h->layers[h->n_layers++] = L;
    return CM_OK;
}

void ember_serve_close(ember_serve *h)
{
    if (h == NULL) return;
    serve_model_fini(h);
    for (int i = 0; i < h->n_layers; i++)
        layer_close(&h->layers[i]);
    free(h);
}

uint64_t ember_serve_step(const ember_serve *h)
{
    return h->layers[h->n_layers - 1].step;
}

const char *ember_serve_model(const ember_serve *h)
{
    return h->layers[0].model;
}

int ember_serve_table(const ember_serve *h, const char *name)
{
    for (int i = 0; i < h->layers[0].n_tables; i++)
        if (!strcmp(h->layers[0].tables[i].name, name)) return i;
    return -1;
}

uint32_t ember_serve_table_dim(const ember_serve *h, int table)
{
    return h->layers[0].tables[table].dim;
}

uint64_t ember_serve_table_rows(const ember_serve *h, int table)
{
    return h->layers[0].tables[table].rows;
}

static void decode_row(const serve_table *t, uint32_t row, float *out)
{
    const uint8_t *r = t->data + (size_t)row * t->row_bytes;
    if (t->prec == EMBER_SERVE_FP32) {
        memcpy(out, r, t->dim * sizeof(float));
    } else if (t->prec == EMBER_SERVE_FP16) {
        cm_f16_to_f32_n(r, out, t->dim);
    } else {
        cm_int8_row_decode(r, t->dim, out);
    }
}

static int64_t table_find(const serve_table *t, uint64_t key, uint64_t hash)
{
    const slot_ent *ix = t->index;
    for (uint64_t s = hash & t->mask, probes = 0; probes <= t->mask; probes++) {
        if (ix[s].row == EMPTY_ROW) return -1;
        if (ix[s].key == key) return ix[s].row;
        s = (s + 1) & t->mask;
    }
    return -1;
}

static bool is_deleted(const serve_table *t, uint64_t key)
{
    uint64_t lo = 0, hi = t->n_deleted;
    while (lo < hi) {
        uint64_t mid = (lo + hi) / 2, v;
        memcpy(&v, t->deleted + mid, 8);
        if (v == key) return true;
        if (v < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    return false;
}

/*
 * Lookups are memory-latency bound (an index slot, then a row, both random), so they run as a
 * three-stage software pipeline over the batch: key i is hashed and its base index slot
 * prefetched; key i - D is resolved (newest layer first, as before) and its row prefetched;
 * key i - 2D is decoded. About 2D misses are in flight instead of one or two.
 */
#define LOOKUP_DIST 16
#define LOOKUP_RING 64 /* a power of two > 2 * LOOKUP_DIST */

/* The layer's table holding key (row >= 0), or row -1 when absent or deleted. */
static const serve_table *resolve(const ember_serve *h, int table, uint64_t key, uint64_t hash,
                                  int64_t *row)
{
    for (int l = h->n_layers - 1; l >= 0; l--) {
        const serve_table *lt = &h->layers[l].tables[table];
        *row = table_find(lt, key, hash);
        if (*row >= 0) return lt;
        if (l > 0 && is_deleted(lt, key)) break;
    }
    *row = -1;
    return NULL;
}

int ember_serve_lookup(const ember_serve *h, int table, const uint64_t *keys, size_t n, float *out,
                       uint8_t *found)
{
    if (table < 0 || table >= h->layers[0].n_tables) return CM_EINVAL;
    const uint32_t dim = h->layers[0].tables[table].dim;
    const serve_table *base = &h->layers[0].tables[table];
    const slot_ent *bix = base->index;
    uint64_t hashes[LOOKUP_RING];
    const serve_table *tabs[LOOKUP_RING];
    int64_t rows[LOOKUP_RING];
    const size_t d = n < LOOKUP_DIST ? (n ? n : 1) : LOOKUP_DIST;
    for (size_t i = 0; i < n + 2 * d; i++) {
        if (i < n) {
            uint64_t hv = key_hash(keys[i]);
            hashes[i % LOOKUP_RING] = hv;
            __builtin_prefetch(bix + (hv & base->mask));
        }
        if (i >= d && i - d < n) {
            size_t j = i - d, r = j % LOOKUP_RING;
            tabs[r] = resolve(h, table, keys[j], hashes[r], &rows[r]);
            if (rows[r] >= 0) {
                const uint8_t *p = tabs[r]->data + (size_t)rows[r] * tabs[r]->row_bytes;
                __builtin_prefetch(p);
                __builtin_prefetch(p + tabs[r]->row_bytes - 1);
            }
        }
        if (i >= 2 * d) {
            size_t j = i - 2 * d, r = j % LOOKUP_RING;
            if (rows[r] >= 0)
                decode_row(tabs[r], (uint32_t)rows[r], out + j * dim);
            else
                memset(out + j * dim, 0, dim * sizeof(float));
            if (found) found[j] = rows[r] >= 0;
        }
    }
    return CM_OK;
}
