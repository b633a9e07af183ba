/*
 * Table snapshots: <dir>/rows.bin and <dir>/MANIFEST.
 *
 * rows.bin (little-endian): a 32-byte header {magic "EMBROWS1", u32 version, u32 dim,
 * u32 slots, u32 row_bytes, u64 rows}, the records, then the xxh3-64 of everything before it.
 * sketch.bin (a table with admission): the count-min sketch's u16 counters as they were at the
 * cut, so that a restored table admits a key at the sighting the uninterrupted one would have
 * (counted afresh, a resumed run would train other rows).
 * MANIFEST is text, one "name value" per line: the model config (floats in C99 hex, exact),
 * the step, the row count, "file rows.bin SIZE XXH3", "sketch sketch.bin SIZE XXH3" where there
 * is one, and last "checksum XXH3" over every byte before that line. Both are built in
 * "<dir>.tmp.<pid>.<n>" and swapped into place with one rename (RENAME_EXCHANGE when dir already
 * exists), so a crash leaves the old snapshot or the new one, never a mixture.
 * A snapshot writer (emb_snapshot_writer_*: no table behind it) builds the same files from rows
 * handed to it one at a time: rows.bin gets its header, whose row count is known only at the
 * end, last, and is then read back once to be hashed (xxh3 is over the header first).
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "embedding/internal.h"

#define ROWS_MAGIC "EMBROWS1"
#define ROWS_VERSION 1u
#define ROWS_HDR 32u
#define MANIFEST_TAG "ember-embedding-snapshot 1"

typedef struct rows_hdr {
    char magic[8];
    uint32_t version, dim, slots, row_bytes;
    uint64_t rows;
} rows_hdr;
_Static_assert(sizeof(rows_hdr) == ROWS_HDR, "rows.bin header is 32 bytes");

/* Why the values of a record (dim weights, then slots of optimizer state) cannot be in a
 * snapshot, or NULL. Weights must be finite: a restored non-finite one would spread through
 * every pull. Optimizer state may be infinite but not NaN: Adagrad's and Adam's sums of squared
 * gradients overflow to +inf from finite gradients (two pushes of 2e19), after which the row's
 * updates are 0 and its weights stay finite. The writer and the restore share it, so that every
 * snapshot written can be restored. */
static const char *rec_unstorable(const uint8_t *rec, size_t dim, size_t slots)
{
    const uint8_t *v = rec + EMB_REC_HDR; /* records are packed: floats may be unaligned */
    if (cm_f32_first_nonfinite((const float *)v, dim) != dim) return "a weight that is not finite";
    for (size_t i = dim; i < dim + slots; i++) {
        float x;
        memcpy(&x, v + 4 * i, sizeof x);
        if (isnan(x)) return "optimizer state that is NaN";
    }
    return NULL;
}

/* ---- writing ---- */

struct writer {
    cm_afile f;
    uint8_t *buf;
    size_t len;
    size_t rec, dim, slots;
    uint64_t rows;
    char **errptr;
    int rc;
};

static int writer_flush(struct writer *w)
{
    if (w->len == 0) return CM_OK;
    int rc = cm_afile_write(&w->f, w->buf, w->len, w->errptr);
    w->len = 0;
    return rc;
}

/* CM_EINVAL naming the key when a record to be written is one no restore takes (rec_unstorable):
 * refused now, it never becomes part of a checkpoint. */
static int rec_refuse(const uint8_t *rec, size_t dim, size_t slots, char **errptr)
{
    const char *bad = rec_unstorable(rec, dim, slots);
    if (bad == NULL) return CM_OK;
    return cm_err(errptr, CM_EINVAL,
                  "key %" PRIu64 " holds %s (the training diverged): not snapshotted",
                  emb_rec_key(rec), bad);
}

static int write_rec(const void *rec, void *arg)
{
    struct writer *w = arg;
    w->rc = rec_refuse(rec, w->dim, w->slots, w->errptr);
    if (w->rc != CM_OK) return w->rc;
    if (w->len + w->rec > EMB_SNAPSHOT_CHUNK) {
        w->rc = writer_flush(w);
        if (w->rc != CM_OK) return w->rc;
    }
    memcpy(w->buf + w->len, rec, w->rec);
    w->len += w->rec;
    w->rows++;
    return 0;
}

static void hdr_fill(rows_hdr *hdr, const emb_table_config *cfg, uint64_t rows)
{
    *hdr = (rows_hdr){.version = ROWS_VERSION,
                      .dim = cfg->dim,
                      .slots = emb_row_slots(cfg),
                      .row_bytes = (uint32_t)emb_row_bytes(cfg),
                      .rows = rows};
    memcpy(hdr->magic, ROWS_MAGIC, 8);
}

/* dir/name into out; a path too long for out is an error the caller reports. */
static int path_join(char *out, size_t n, const char *dir, const char *name, char **errptr)
{
    int len = snprintf(out, n, "%s/%s", dir, name);
    if (len < 0 || (size_t)len >= n) return cm_err(errptr, CM_EINVAL, "path too long: %s", dir);
    return CM_OK;
}

static int write_rows(emb_table *t, const char *tmpdir, uint64_t rows, uint64_t *size,
                      uint64_t *hash, char **errptr)
{
    const emb_table_config *cfg = emb_table_get_config(t);
    char path[4096];
    if (path_join(path, sizeof path, tmpdir, EMB_SNAP_ROWS, errptr) != CM_OK) return CM_EINVAL;
    struct writer w = {
        .rec = emb_row_bytes(cfg), .dim = cfg->dim, .slots = emb_row_slots(cfg), .errptr = errptr};
    w.buf = malloc(EMB_SNAPSHOT_CHUNK);
    if (w.buf == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    int rc = cm_afile_open(&w.f, path, errptr);
    if (rc != CM_OK) {
        free(w.buf);
        return rc;
    }
    rows_hdr hdr;
    hdr_fill(&hdr, cfg, rows);
    memcpy(w.buf, &hdr, sizeof hdr);
    w.len = sizeof hdr;
    rc = emb_table_foreach_record_locked(t, write_rec, &w, errptr);
    if (rc == CM_OK) rc = writer_flush(&w);
    if (rc == CM_OK && w.rows != rows)
        rc = cm_err(errptr, CM_ERR, "snapshot counted %" PRIu64 " rows but wrote %" PRIu64, rows,
                    w.rows);
    if (rc == CM_OK) {
        uint64_t digest = cm_afile_digest(&w.f);
        rc = cm_afile_write(&w.f, &digest, sizeof digest, errptr);
        *hash = digest;
        *size = w.f.bytes;
    }
    if (rc == CM_OK) rc = cm_afile_commit(&w.f, errptr);
    else cm_afile_abort(&w.f);
    free(w.buf);
    return rc;
}

static int manifest_format(const emb_table_config *c, uint64_t step, uint64_t rows, uint64_t size,
                           uint64_t hash, uint64_t sk_size, uint64_t sk_hash, char *out, size_t n)
{
    int len = snprintf(out, n,
                       MANIFEST_TAG "\n"
                                    "dim %u\nopt %s\nlr %a\nl2 %a\neps %a\nbeta1 %a\nbeta2 %a\n"
                                    "adagrad_init %a\nftrl_beta %a\nftrl_l1 %a\ninit_scale %a\n"
                                    "seed %" PRIu64 "\nrow_bytes %zu\nstep %" PRIu64
                                    "\nrows %" PRIu64 "\nfile " EMB_SNAP_ROWS " %" PRIu64
                                    " %016" PRIx64 "\n",
                       c->dim, emb_opt_name(c->opt), (double)c->lr, (double)c->l2,
                       (double)c->eps, (double)c->beta1, (double)c->beta2,
                       (double)c->adagrad_init, (double)c->ftrl_beta, (double)c->ftrl_l1,
                       (double)c->init_scale, c->seed, emb_row_bytes(c), step, rows, size, hash);
    if (len < 0 || (size_t)len >= n) return -1;
    if (sk_size > 0) {
        int k =
            snprintf(out + len, n - (size_t)len,
                     "sketch " EMB_SNAP_SKETCH " %" PRIu64 " %016" PRIx64 "\n", sk_size, sk_hash);
        if (k < 0 || (size_t)(len + k) >= n) return -1;
        len += k;
    }
    return cm_seal_append(out, (size_t)len, n, "checksum");
}

/* Whether dir may be replaced by a snapshot: absent, an empty directory, or one holding only
 * what a snapshot holds. Replacing removes the old tree whole, so anything else (a mistyped
 * path: a home or checkpoint root, a file) is refused instead of deleted. */
static int check_replaceable(const char *dir, char **errptr)
{
    struct stat st;
    if (stat(dir, &st) != 0)
        return errno == ENOENT ? CM_OK : cm_err_errno(errptr, CM_EIO, "cannot stat %s", dir);
    if (!S_ISDIR(st.st_mode))
        return cm_err(errptr, CM_EINVAL, "snapshot path %s exists and is not a directory", dir);
    static const char *const ours[] = {EMB_SNAP_MANIFEST, EMB_SNAP_ROWS, EMB_SNAP_SKETCH, NULL};
    char *other = NULL;
    int rc = cm_dir_other_entry(dir, ours, &other, errptr);
    if (rc == CM_OK && other != NULL)
        rc = cm_err(errptr, CM_EINVAL,
                    "refusing to replace %s with a snapshot: it holds %s, which no snapshot has",
                    dir, other);
    free(other);
    return rc;
}

/* The start of every snapshot write: dir (trailing slashes trimmed, a symbolic link followed)
 * into dcopy, checked replaceable, and an empty temporary directory beside it into tmpdir. */
static int snap_begin(const char *dir, char *dcopy, size_t dn, char *tmpdir, size_t tn,
                      char **errptr)
{
    size_t dlen = strlen(dir);
    while (dlen > 1 && dir[dlen - 1] == '/') dlen--;
    if (dlen >= dn) return cm_err(errptr, CM_EINVAL, "snapshot path too long: %s", dir);
    snprintf(dcopy, dn, "%.*s", (int)dlen, dir);
    /* A symbolic link to a directory (a snapshot area on another disk) is followed, as
     * cm_afile_open follows one to a file: swapped in at the link's own path, the snapshot
     * replaced the link with a directory on the link's disk and left the target stale. */
    struct stat lst;
    if (lstat(dcopy, &lst) == 0 && S_ISLNK(lst.st_mode)) {
        char *real = realpath(dcopy, NULL);
        if (real == NULL)
            return cm_err_errno(errptr, CM_EIO, "cannot follow the symbolic link %s", dcopy);
        int n = snprintf(dcopy, dn, "%s", real);
        free(real);
        if (n < 0 || (size_t)n >= dn)
            return cm_err(errptr, CM_EINVAL, "snapshot path too long: %s", dir);
    }
    /* The temporary directory is this call's own: two threads snapshotting into one dir at
     * once would otherwise remove and fill each other's files (the pid alone is shared). */
    static unsigned snap_seq; /* atomic */
    unsigned seq = __atomic_fetch_add(&snap_seq, 1, __ATOMIC_RELAXED);
    int tlen = snprintf(tmpdir, tn, "%s.tmp.%ld.%u", dcopy, (long)getpid(), seq);
    if (tlen < 0 || (size_t)tlen >= tn)
        return cm_err(errptr, CM_EINVAL, "snapshot path too long: %s", dir);
    int rc = check_replaceable(dcopy, errptr);
    if (rc == CM_OK) rc = cm_rmtree(tmpdir, errptr);
    if (rc == CM_OK) rc = cm_mkdirs(tmpdir, errptr);
    return rc;
}

/* Writes the n counters of an admission sketch to tmpdir's sketch.bin; its size and xxh3 go
 * into the manifest. */
static int sketch_write(const char *tmpdir, const uint16_t *sk, size_t n, uint64_t *size,
                        uint64_t *hash, char **errptr)
{
    char path[4096];
    *size = n * sizeof *sk;
    *hash = cm_xxh3(sk, *size);
    int rc = path_join(path, sizeof path, tmpdir, EMB_SNAP_SKETCH, errptr);
    if (rc == CM_OK) rc = cm_write_file_atomic(path, sk, *size, errptr);
    return rc;
}

/* The end of every snapshot write, once tmpdir holds the rows (and sketch): the MANIFEST, then
 * tmpdir swapped into dcopy. The caller removes tmpdir when this fails. */
static int snap_finish(const char *tmpdir, const char *dcopy, const emb_table_config *cfg,
                       uint64_t step, uint64_t rows, uint64_t size, uint64_t hash, uint64_t sk_size,
                       uint64_t sk_hash, char **errptr)
{
    char mpath[4096], manifest[2048];
    int len =
        manifest_format(cfg, step, rows, size, hash, sk_size, sk_hash, manifest, sizeof manifest);
    int rc = path_join(mpath, sizeof mpath, tmpdir, EMB_SNAP_MANIFEST, errptr);
    if (rc == CM_OK)
        rc = len < 0 ? cm_err(errptr, CM_ERR, "manifest too long")
                     : cm_write_file_atomic(mpath, manifest, (size_t)len, errptr);
    if (rc == CM_OK) rc = cm_fsync_dir(tmpdir, errptr);
    if (rc == CM_OK) rc = cm_dir_swap(tmpdir, dcopy, errptr);
    return rc;
}

int emb_table_snapshot(emb_table *t, const char *dir, char **errptr)
{
    char tmpdir[4096], dcopy[4096];
    int rc = snap_begin(dir, dcopy, sizeof dcopy, tmpdir, sizeof tmpdir, errptr);
    if (rc != CM_OK) return rc;
    uint64_t size = 0, hash = 0, sk_size = 0, sk_hash = 0, rows, step;
    emb_table_pause(t);
    rows = emb_table_rows_locked(t);
    step = emb_table_step(t);
    rc = write_rows(t, tmpdir, rows, &size, &hash, errptr);
    size_t nc = 0;
    const uint16_t *sk = emb_table_sketch(t, &nc);
    if (rc == CM_OK && sk != NULL) rc = sketch_write(tmpdir, sk, nc, &sk_size, &sk_hash, errptr);
    emb_table_resume(t);
    if (rc == CM_OK)
        rc = snap_finish(tmpdir, dcopy, emb_table_get_config(t), step, rows, size, hash, sk_size,
                         sk_hash, errptr);
    if (rc != CM_OK) cm_rmtree(tmpdir, NULL);
    return rc;
}

/* ---- writing without a table ---- */

struct emb_snapshot_writer {
    emb_table_config cfg; /* the model; storage fields unused */
    const uint16_t *sketch;
    size_t sketch_n;
    uint64_t step, rows;
    uint64_t size; /* bytes of rows.bin so far, the header's 32 (written at the commit) included */
    char *dir, *tmpdir, *path; /* dir as snap_begin resolved it; path: tmpdir's rows.bin */
    uint8_t *buf;
    size_t len, cap, rec, slots;
};

static void writer_free(emb_snapshot_writer *w)
{
    free(w->dir);
    free(w->tmpdir);
    free(w->path);
    free(w->buf);
    free(w);
}

int emb_snapshot_writer_open(const char *dir, const emb_table_config *cfg, uint64_t step,
                             const uint16_t *sketch, size_t n, size_t buf_bytes,
                             emb_snapshot_writer **out, char **errptr)
{
    char dcopy[4096], tmpdir[4096], path[4096];
    *out = NULL;
    int rc = emb_table_config_check(cfg, errptr);
    if (rc == CM_OK && sketch != NULL) rc = emb_sketch_fits(n, errptr);
    if (rc == CM_OK) rc = snap_begin(dir, dcopy, sizeof dcopy, tmpdir, sizeof tmpdir, errptr);
    if (rc != CM_OK) return rc;
    emb_snapshot_writer *w = calloc(1, sizeof *w);
    rc = w ? path_join(path, sizeof path, tmpdir, EMB_SNAP_ROWS, errptr) : CM_ENOMEM;
    if (w != NULL) {
        w->cfg = *cfg;
        w->cfg.spill_path = NULL;
        w->sketch = sketch;
        w->sketch_n = n;
        w->step = step;
        w->size = ROWS_HDR;
        w->rec = emb_row_bytes(cfg);
        w->slots = emb_row_slots(cfg);
        w->cap = buf_bytes > w->rec ? buf_bytes / w->rec * w->rec : w->rec;
        w->buf = malloc(w->cap);
        w->dir = strdup(dcopy);
        w->tmpdir = strdup(tmpdir);
        w->path = rc == CM_OK ? strdup(path) : NULL;
        if (rc == CM_OK && (!w->buf || !w->dir || !w->tmpdir || !w->path)) rc = CM_ENOMEM;
    }
    if (rc == CM_ENOMEM) cm_err(errptr, rc, "out of memory for a snapshot writer");
    if (rc != CM_OK) {
        if (w) writer_free(w);
        cm_rmtree(tmpdir, NULL);
        return rc;
    }
    *out = w;
    return CM_OK;
}

/* Appends the buffered rows to rows.bin, opened for this write only. */
static int writer_append(emb_snapshot_writer *w, char **errptr)
{
    if (w->len == 0) return CM_OK;
    int fd = open(w->path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return cm_err_errno(errptr, CM_EIO, "cannot open %s", w->path);
    int e = cm_pwrite_full(fd, w->buf, w->len, w->size);
    if (close(fd) != 0 && e == 0) e = errno;
    if (e != 0) {
        errno = e;
        return cm_err_errno(errptr, CM_EIO, "cannot write %s", w->path);
    }
    w->size += w->len;
    w->len = 0;
    return CM_OK;
}

int emb_snapshot_writer_add(emb_snapshot_writer *w, const emb_row *row, char **errptr)
{
    if (w->len + w->rec > w->cap) {
        int rc = writer_append(w, errptr);
        if (rc != CM_OK) return rc;
    }
    uint8_t *rec = w->buf + w->len;
    emb_rec_pack(rec, w->rec, row, w->cfg.dim, w->slots);
    int rc = rec_refuse(rec, w->cfg.dim, w->slots, errptr);
    if (rc != CM_OK) return rc;
    w->len += w->rec;
    w->rows++;
    return CM_OK;
}

/* cm_fd_each_chunk's step: this file's (inlined) xxh3 over one piece. */
static void hash_chunk(void *st, const void *buf, size_t n)
{
    XXH3_64bits_update(st, buf, n);
}

/* Completes rows.bin: the header (the row count known at last), then the xxh3 of all of it,
 * read back a chunk at a time, as its trailer; fsync'd. *hash gets the xxh3. */
static int writer_seal(emb_snapshot_writer *w, uint64_t *hash, char **errptr)
{
    rows_hdr hdr;
    hdr_fill(&hdr, &w->cfg, w->rows);
    XXH3_state_t *hs = XXH3_createState();
    int fd = open(w->path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    int rc = CM_OK, e = 0;
    if (hs == NULL) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        goto out;
    }
    if (fd < 0 || (e = cm_pwrite_full(fd, &hdr, sizeof hdr, 0)) != 0) {
        if (e) errno = e;
        rc = cm_err_errno(errptr, CM_EIO, "cannot write %s", w->path);
        goto out;
    }
    XXH3_64bits_reset(hs);
    rc = cm_fd_each_chunk(fd, w->path, w->size, hash_chunk, hs, errptr);
    if (rc != CM_OK) goto out;
    *hash = XXH3_64bits_digest(hs);
    if ((e = cm_pwrite_full(fd, hash, sizeof *hash, w->size)) != 0 || fsync(fd) != 0) {
        if (e) errno = e;
        rc = cm_err_errno(errptr, CM_EIO, "cannot write %s", w->path);
        goto out;
    }
    w->size += sizeof *hash;
out:
    if (fd >= 0 && close(fd) != 0 && rc == CM_OK)
        rc = cm_err_errno(errptr, CM_EIO, "cannot write %s", w->path);
    if (hs) XXH3_freeState(hs);
    return rc;
}

int emb_snapshot_writer_commit(emb_snapshot_writer *w, char **errptr)
{
    uint64_t hash = 0, sk_size = 0, sk_hash = 0;
    int rc = writer_append(w, errptr);
    if (rc == CM_OK) rc = writer_seal(w, &hash, errptr);
    if (rc == CM_OK && w->sketch != NULL)
        rc = sketch_write(w->tmpdir, w->sketch, w->sketch_n, &sk_size, &sk_hash, errptr);
    if (rc == CM_OK)
        rc = snap_finish(w->tmpdir, w->dir, &w->cfg, w->step, w->rows, w->size, hash, sk_size,
                         sk_hash, errptr);
    if (rc != CM_OK) cm_rmtree(w->tmpdir, NULL);
    writer_free(w);
    return rc;
}

void emb_snapshot_writer_abort(emb_snapshot_writer *w)
{
    if (w == NULL) return;
    cm_rmtree(w->tmpdir, NULL);
    writer_free(w);
}

/* ---- reading ---- */

typedef struct manifest {
    emb_table_config cfg;
    uint64_t step, rows, size, hash, row_bytes;
    uint64_t sk_size, sk_hash; /* sk_size 0: no sketch.bin */
} manifest;

/* Finds "name " at a line start and returns the value text after it, or NULL. */
static const char *mf_field(const char *text, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (strncmp(p, name, n) == 0 && p[n] == ' ') return p + n + 1;
    return NULL;
}

static int mf_u64(const char *text, const char *name, int base, uint64_t *out)
{
    const char *v = mf_field(text, name);
    if (v == NULL) return -1;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, base);
    if (errno || end == v || *end != '\n') return -1;
    *out = x;
    return 0;
}

static int mf_float(const char *text, const char *name, float *out)
{
    const char *v = mf_field(text, name);
    if (v == NULL) return -1;
    char *end;
    double x = strtod(v, &end);
    if (end == v || *end != '\n') return -1;
    *out = (float)x;
    return 0;
}

static int manifest_read(const char *dir, manifest *m, char **errptr)
{
    char path[4096];
    if (path_join(path, sizeof path, dir, EMB_SNAP_MANIFEST, errptr) != CM_OK) return CM_EINVAL;
    char *text = NULL;
    size_t len = 0;
    int rc = cm_read_file(path, (void **)&text, &len, errptr);
    if (rc != CM_OK) return rc;
    rc = CM_ECORRUPT;
    memset(m, 0, sizeof *m);
    emb_table_config_init(&m->cfg);
    /* The checksum line is last and covers everything before it. The writer ends the file
     * with that line's '\n', so nothing at all (not even a NUL byte) may follow it. */
    size_t body = 0;
    uint64_t dim64 = 0, seed = 0;
    char optname[32] = {0};
    const char *ov;
    if (strncmp(text, MANIFEST_TAG "\n", strlen(MANIFEST_TAG) + 1) != 0 ||
        cm_seal_check(text, len, "checksum", &body) != CM_OK) {
        cm_err(errptr, rc,
               "%s: not an ember embedding manifest, data after its checksum line, or checksum "
               "mismatch",
               path);
        goto out;
    }
    if (mf_u64(text, "dim", 10, &dim64) || mf_u64(text, "seed", 10, &seed) ||
        mf_u64(text, "row_bytes", 10, &m->row_bytes) || mf_u64(text, "step", 10, &m->step) ||
        mf_u64(text, "rows", 10, &m->rows) || mf_float(text, "lr", &m->cfg.lr) ||
        mf_float(text, "l2", &m->cfg.l2) || mf_float(text, "eps", &m->cfg.eps) ||
        mf_float(text, "beta1", &m->cfg.beta1) || mf_float(text, "beta2", &m->cfg.beta2) ||
        mf_float(text, "adagrad_init", &m->cfg.adagrad_init) ||
        mf_float(text, "ftrl_beta", &m->cfg.ftrl_beta) ||
        mf_float(text, "ftrl_l1", &m->cfg.ftrl_l1) ||
        mf_float(text, "init_scale", &m->cfg.init_scale) || (ov = mf_field(text, "opt")) == NULL ||
        sscanf(ov, "%31s", optname) != 1 || emb_opt_parse(optname, &m->cfg.opt) != CM_OK ||
        dim64 == 0 || dim64 > EMB_MAX_DIM) {
        cm_err(errptr, rc, "%s: missing or invalid field", path);
        goto out;
    }
    m->cfg.dim = (uint32_t)dim64;
    m->cfg.seed = seed;
    /* A config no table can have (eps 0, a NaN rate) is a damaged manifest: handed on, it
     * failed later in emb_table_create with a message naming no file. */
    char *why = NULL;
    if (emb_table_config_check(&m->cfg, &why) != CM_OK) {
        cm_err(errptr, rc, "%s: %s", path, why ? why : "invalid model config");
        free(why);
        goto out;
    }
    const char *fv = mf_field(text, "file");
    char fname[64];
    unsigned long long fsize, fhash;
    if (fv == NULL || sscanf(fv, "%63s %llu %llx", fname, &fsize, &fhash) != 3 ||
        strcmp(fname, EMB_SNAP_ROWS) != 0 || m->row_bytes != emb_row_bytes(&m->cfg)) {
        cm_err(errptr, rc, "%s: bad file entry or row size", path);
        goto out;
    }
    m->size = fsize;
    m->hash = fhash;
    const char *sv = mf_field(text, "sketch");
    if (sv != NULL && (sscanf(sv, "%63s %llu %llx", fname, &fsize, &fhash) != 3 ||
                       strcmp(fname, EMB_SNAP_SKETCH) != 0 || fsize == 0)) {
        cm_err(errptr, rc, "%s: bad sketch entry", path);
        goto out;
    }
    m->sk_size = sv ? fsize : 0;
    m->sk_hash = sv ? fhash : 0;
    rc = CM_OK;
out:
    free(text);
    return rc;
}

int emb_snapshot_read_config(const char *dir, emb_table_config *cfg, char **errptr)
{
    manifest m;
    int rc = manifest_read(dir, &m, errptr);
    if (rc == CM_OK) *cfg = m.cfg;
    return rc;
}

/* What a rows pass does with each chunk of records: nothing (verify only), load them into a
 * table, or hand each to a row callback. */
typedef struct rows_sink {
    emb_table *t;
    emb_row_cb cb;
    void *arg;
    const emb_table_config *cfg;
} rows_sink;

static int sink_chunk(const rows_sink *k, const char *path, const uint8_t *buf, size_t nrows,
                      size_t row_bytes, char **errptr)
{
    if (k->t) {
        /* The table's refusal (a key twice) says what, not where: the file goes in front. */
        int rc = emb_table_load_records(k->t, buf, nrows, errptr);
        if (rc != CM_OK)
            rc = cm_err(errptr, rc, "%s: %s", path, errptr && *errptr ? *errptr : "not loaded");
        return rc;
    }
    for (size_t i = 0; i < nrows; i++) {
        const uint8_t *rec = buf + i * row_bytes;
        const emb_rec_hdr *h = (const emb_rec_hdr *)rec;
        emb_row row = {h->key, h->updates, h->last_step, (const float *)(rec + EMB_REC_HDR),
                       (const float *)(rec + EMB_REC_HDR) + k->cfg->dim};
        int rc = k->cb(&row, k->arg);
        if (rc != 0) return rc;
    }
    return CM_OK;
}

/* Opens dir's rows.bin (its path into path) for the passes of one restore or export. They all
 * read this one descriptor, so the rows loaded are the bytes verified: opened by path per pass,
 * a snapshot swapped into dir in between (RENAME_EXCHANGE by a writer) was loaded unverified,
 * under the manifest of the one before. */
static int rows_open(const char *dir, char *path, size_t n, int *fd, char **errptr)
{
    if (path_join(path, n, dir, EMB_SNAP_ROWS, errptr) != CM_OK) return CM_EINVAL;
    *fd = open(path, O_RDONLY | O_CLOEXEC);
    if (*fd < 0) return cm_err_errno(errptr, CM_ECORRUPT, "snapshot file %s", path);
    return CM_OK;
}

/* Whether the nrows records at buf are ones a table at the manifest's step writes: none
 * stamped after that step (a restored TTL table would keep it past its time, and one with a
 * spill store refuses it only once half loaded), and none the writer refuses (rec_unstorable). */
static int recs_check(const manifest *m, const char *path, const uint8_t *buf, size_t nrows,
                      uint64_t off, char **errptr)
{
    const size_t dim = m->cfg.dim, slots = emb_row_slots(&m->cfg);
    for (size_t i = 0; i < nrows; i++) {
        const uint8_t *rec = buf + i * m->row_bytes;
        uint64_t stamp = emb_rec_last_step(rec);
        if (stamp > m->step)
            return cm_err(errptr, CM_ECORRUPT,
                          "%s: the record at offset %" PRIu64 " was touched at step %" PRIu64
                          ", after the snapshot's step %" PRIu64,
                          path, off + i * m->row_bytes, stamp, m->step);
        const char *bad = rec_unstorable(rec, dim, slots);
        if (bad != NULL)
            return cm_err(errptr, CM_ECORRUPT, "%s: the record at offset %" PRIu64 " holds %s",
                          path, off + i * m->row_bytes, bad);
    }
    return CM_OK;
}

/* Whether rows.bin (fd, from rows_open) is as large as the manifest's row count says. */
static int rows_size_check(int fd, const char *path, const manifest *m, char **errptr)
{
    /* A row count whose size wraps around 2^64 would match a small file, and the passes would
     * then read on for rows that are not there. */
    if (m->rows > (UINT64_MAX - ROWS_HDR - 8) / m->row_bytes)
        return cm_err(errptr, CM_ECORRUPT,
                      "%s: %" PRIu64 " rows of %" PRIu64 " bytes: more than a file can hold", path,
                      m->rows, m->row_bytes);
    uint64_t expect = ROWS_HDR + m->rows * m->row_bytes + 8;
    struct stat st;
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != expect || m->size != expect)
        return cm_err(errptr, CM_ECORRUPT, "%s: size %lld, expected %" PRIu64 " (truncated?)", path,
                      (long long)st.st_size, expect);
    return CM_OK;
}

/* Reads rows.bin (fd, from rows_open) in chunks; with sink NULL it only verifies size, header,
 * checksum and records (recs_check). */
static int rows_pass(int fd, const char *path, const manifest *m, const rows_sink *sink,
                     char **errptr)
{
    int rc = CM_OK;
    uint8_t *buf = NULL;
    void *hs = NULL;
    rc = rows_size_check(fd, path, m, errptr);
    if (rc != CM_OK) goto out;
    size_t chunk_rows = EMB_SNAPSHOT_CHUNK / m->row_bytes + 1;
    buf = malloc(chunk_rows * m->row_bytes + ROWS_HDR);
    hs = XXH3_createState();
    if (buf == NULL || hs == NULL) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        goto out;
    }
    XXH3_64bits_reset(hs);
    rows_hdr hdr;
    if (pread(fd, &hdr, sizeof hdr, 0) != (ssize_t)sizeof hdr || memcmp(hdr.magic, ROWS_MAGIC, 8) ||
        hdr.version != ROWS_VERSION || hdr.dim != m->cfg.dim ||
        hdr.slots != emb_row_slots(&m->cfg) || hdr.row_bytes != m->row_bytes ||
        hdr.rows != m->rows) {
        rc = cm_err(errptr, CM_ECORRUPT, "%s: bad header (magic, version or shape)", path);
        goto out;
    }
    XXH3_64bits_update(hs, &hdr, sizeof hdr);
    uint64_t off = ROWS_HDR, left = m->rows;
    while (left > 0) {
        size_t nrows = left < chunk_rows ? (size_t)left : chunk_rows;
        size_t bytes = nrows * m->row_bytes;
        if (pread(fd, buf, bytes, (off_t)off) != (ssize_t)bytes) {
            rc = cm_err_errno(errptr, CM_ECORRUPT, "%s: short read at offset %" PRIu64, path, off);
            goto out;
        }
        if (sink == NULL) {
            XXH3_64bits_update(hs, buf, bytes);
            rc = recs_check(m, path, buf, nrows, off, errptr);
        } else {
            rc = sink_chunk(sink, path, buf, nrows, m->row_bytes, errptr);
        }
        if (rc != CM_OK) goto out;
        off += bytes;
        left -= nrows;
    }
    if (sink == NULL) {
        uint64_t trailer, digest = XXH3_64bits_digest(hs);
        if (pread(fd, &trailer, 8, (off_t)off) != 8 || trailer != digest || digest != m->hash)
            rc = cm_err(errptr, CM_ECORRUPT, "%s: checksum mismatch", path);
    }
out:
    if (hs) XXH3_freeState(hs);
    free(buf);
    return rc;
}

const char *emb_table_config_differs(const emb_table_config *a, const emb_table_config *b)
{
    if (a->dim != b->dim) return "dim";
    if (a->opt != b->opt) return "opt";
    if (a->lr != b->lr) return "lr";
    if (a->l2 != b->l2) return "l2";
    if (a->eps != b->eps) return "eps";
    if (a->beta1 != b->beta1 || a->beta2 != b->beta2) return "adam betas";
    if (a->adagrad_init != b->adagrad_init) return "adagrad_init";
    if (a->ftrl_beta != b->ftrl_beta || a->ftrl_l1 != b->ftrl_l1) return "ftrl parameters";
    if (a->init_scale != b->init_scale) return "init_scale";
    if (a->seed != b->seed) return "seed";
    return NULL;
}

/* Reads dir's sketch.bin into *sk (caller frees; NULL with *len 0 when m names none), verified
 * against the manifest's size and checksum. */
static int sketch_read(const char *dir, const manifest *m, void **sk, size_t *len, char **errptr)
{
    *sk = NULL;
    *len = 0;
    if (m->sk_size == 0) return CM_OK;
    char sp[4096];
    int rc = path_join(sp, sizeof sp, dir, EMB_SNAP_SKETCH, errptr);
    if (rc == CM_OK) rc = cm_read_file(sp, sk, len, errptr);
    if (rc == CM_ENOTFOUND) rc = cm_err(errptr, CM_ECORRUPT, "%s: missing", sp);
    if (rc == CM_OK && (*len != m->sk_size || cm_xxh3(*sk, *len) != m->sk_hash))
        rc = cm_err(errptr, CM_ECORRUPT, "%s: size or checksum does not match the manifest", sp);
    if (rc != CM_OK) {
        free(*sk);
        *sk = NULL;
        *len = 0;
    }
    return rc;
}

int emb_table_restore(const char *dir, const emb_table_config *cfg, emb_table **out,
                      char **errptr)
{
    manifest m;
    int rc = manifest_read(dir, &m, errptr);
    if (rc != CM_OK) return rc;
    const char *bad = emb_table_config_differs(&m.cfg, cfg);
    if (bad != NULL)
        return cm_err(errptr, CM_EINVAL, "snapshot %s: %s differs from the table config", dir, bad);
    char path[4096];
    int fd = -1;
    emb_table *t = NULL;
    void *sk = NULL;
    size_t sk_len = 0;
    rc = rows_open(dir, path, sizeof path, &fd, errptr);
    if (rc == CM_OK) rc = rows_pass(fd, path, &m, NULL, errptr);
    /* The sketch, verified like the rows before anything is built. A table without admission
     * has no use for it; one with admission from a snapshot without a sketch (written before
     * there was one) starts counting afresh. */
    if (rc == CM_OK) rc = sketch_read(dir, &m, &sk, &sk_len, errptr);
    if (rc == CM_OK) rc = emb_table_create(cfg, &t, errptr);
    size_t nc = 0;
    if (rc == CM_OK && sk != NULL && emb_table_sketch(t, &nc) != NULL &&
        emb_table_set_sketch(t, sk, sk_len / sizeof(uint16_t), NULL) != CM_OK)
        rc = cm_err(errptr, CM_ECORRUPT, "snapshot %s: a sketch of %zu counters, the table has %zu",
                    dir, sk_len / sizeof(uint16_t), nc);
    free(sk);
    /* The step first: no row of the snapshot is stamped after it (emb_table_load_records). */
    if (rc == CM_OK) emb_table_set_step(t, m.step);
    rows_sink sink = {.t = t};
    if (rc == CM_OK) rc = rows_pass(fd, path, &m, &sink, errptr);
    if (fd >= 0) close(fd);
    if (rc != CM_OK) {
        emb_table_destroy(t);
        return rc;
    }
    *out = t;
    return CM_OK;
}

int emb_snapshot_foreach(const char *dir, emb_row_cb cb, void *arg, char **errptr)
{
    manifest m;
    char path[4096];
    int fd = -1;
    int rc = manifest_read(dir, &m, errptr);
    if (rc == CM_OK) rc = rows_open(dir, path, sizeof path, &fd, errptr);
    if (rc == CM_OK) rc = rows_pass(fd, path, &m, NULL, errptr);
    rows_sink sink = {.cb = cb, .arg = arg, .cfg = &m.cfg};
    if (rc == CM_OK) rc = rows_pass(fd, path, &m, &sink, errptr);
    if (fd >= 0) close(fd);
    return rc;
}

int emb_snapshot_step(const char *dir, uint64_t *step, char **errptr)
{
    manifest m;
    int rc = manifest_read(dir, &m, errptr);
    if (rc == CM_OK) *step = m.step;
    return rc;
}

int emb_snapshot_rows(const char *dir, uint64_t *rows, char **errptr)
{
    manifest m;
    char path[4096];
    int fd = -1;
    int rc = manifest_read(dir, &m, errptr);
    if (rc == CM_OK) rc = rows_open(dir, path, sizeof path, &fd, errptr);
    if (rc == CM_OK) rc = rows_size_check(fd, path, &m, errptr);
    if (fd >= 0) close(fd);
    if (rc == CM_OK) *rows = m.rows;
    return rc;
}

int emb_snapshot_sketch_add(const char *dir, uint16_t **acc, size_t *n, char **errptr)
{
    manifest m;
    void *sk = NULL;
    size_t len = 0;
    int rc = manifest_read(dir, &m, errptr);
    if (rc == CM_OK) rc = sketch_read(dir, &m, &sk, &len, errptr);
    if (rc != CM_OK || sk == NULL) return rc;
    size_t nc = len / sizeof(uint16_t);
    if (len % sizeof(uint16_t) != 0)
        rc = cm_err(errptr, CM_ECORRUPT, "%s/" EMB_SNAP_SKETCH ": %zu bytes, not whole counters",
                    dir, len);
    else if (*acc != NULL && nc != *n)
        rc = cm_err(errptr, CM_EINVAL,
                    "%s/" EMB_SNAP_SKETCH ": an admission sketch of %zu counters, the others have "
                    "%zu: count-min sketches of other dimensions cannot be added",
                    dir, nc, *n);
    else if (*acc == NULL && (*acc = calloc(nc, sizeof **acc)) == NULL)
        rc = cm_err(errptr, CM_ENOMEM, "out of memory for an admission sketch");
    if (rc == CM_OK) {
        *n = nc;
        emb_sketch_add(*acc, (const uint16_t *)sk, nc);
    }
    free(sk);
    return rc;
}
