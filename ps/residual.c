/* int8 error-feedback residuals: their stores and their file (ps/residual.h). */
#include <inttypes.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "ps/keysort.h"
#include "ps/residual.h"

#define RESID_MAGIC "EMBRESD1"
#define RESID_VERSION 2u         /* 1: no clock, no stamps (read as 0) */
#define RESID_CHUNK 1024u        /* rows read from or put into a store at a time */
#define RESID_DIM_MAX (1u << 20) /* far above any table's; bounds what a file can claim */

typedef struct resid_hdr {
    char magic[8];
    uint32_t version, worker, n_tables, zero;
} resid_hdr;

typedef struct resid_sec {
    char name[PS_NAME_MAX];
    uint32_t table, dim;
    uint64_t rows, clock; /* clock: version 2 on */
} resid_sec;
#define RESID_SEC_V1 offsetof(resid_sec, clock)

/* A verified file's section: its header and where its rows start in the buffer. */
typedef struct resid_view {
    resid_sec sec;
    const uint8_t *rows;
    size_t row; /* bytes of one of its rows */
} resid_view;

/* Bytes of one row in a file of this version: key, (stamp,) floats. */
static size_t file_row_bytes(uint32_t version, uint32_t dim)
{
    return (version >= 2 ? 16 : 8) + 4 * (size_t)dim;
}

size_t ps_resid_rec_bytes(uint32_t dim)
{
    return (PS_RESID_FLOATS + 4 * (size_t)dim + 7) & ~(size_t)7;
}

static bool pushes_int8(const ps_config *cfg, uint32_t t)
{
    return cfg->tables[t].push_codec == PS_CODEC_INT8;
}

void ps_resid_bound(ps_resid *r, const ps_config *cfg, uint64_t resid_memory)
{
    const uint64_t bytes = resid_memory == 0            ? PS_RESID_MEMORY_DEFAULT
                           : resid_memory == UINT64_MAX ? 0
                                                        : resid_memory;
    uint32_t n = 0;
    for (uint32_t t = 0; t < cfg->n_tables; t++)
        n += pushes_int8(cfg, t);
    for (uint32_t t = 0; t < cfg->n_tables; t++) {
        uint64_t rows = emb_store_mem_max_records(ps_resid_rec_bytes(cfg->tables[t].cfg.dim),
                                                  n ? bytes / n : 0);
        /* A share too small for even the smallest table keeps one row rather than none:
         * "no bound" is 0. */
        r[t].max_rows = bytes == 0 ? 0 : rows > 0 ? rows : 1;
    }
}

uint64_t ps_plan_resid_rows(const ps_config *cfg, uint32_t table, uint64_t resid_memory)
{
    if (!pushes_int8(cfg, table)) return 0;
    ps_resid r[PS_MAX_TABLES]; /* bounds only: no store is made */
    ps_resid_bound(r, cfg, resid_memory);
    return r[table].max_rows == 0 ? UINT64_MAX : r[table].max_rows;
}

static int resid_store(ps_resid *r, uint32_t dim, char **errptr)
{
    return r->st != NULL
               ? CM_OK
               : emb_store_create("memory", NULL, ps_resid_rec_bytes(dim), &r->st, errptr);
}

void ps_resid_clear(ps_resid *rs)
{
    for (uint32_t i = 0; i < PS_MAX_TABLES; i++) {
        emb_store_destroy(rs[i].st);
        rs[i].st = NULL;
        rs[i].clock = 0;
    }
}

static uint64_t rec_stamp(const uint8_t *rec)
{
    uint64_t s;
    memcpy(&s, rec + PS_RESID_STAMP, 8);
    return s;
}

typedef struct stamp_list {
    uint64_t *s;
    size_t n;
} stamp_list;

static int collect_stamp(const void *record, void *arg)
{
    stamp_list *l = arg;
    l->s[l->n++] = rec_stamp(record);
    return 0;
}

static void swap_u64(uint64_t *a, uint64_t *b)
{
    uint64_t t = *a;
    *a = *b;
    *b = t;
}

/* The k-th smallest (from 0) of s[0, n), k < n; s is reordered. Selection with a three-way
 * partition round the median of three: linear on average, and a push stamps thousands of rows
 * alike, which a two-way partition would handle badly. */
static uint64_t select_kth(uint64_t *s, size_t n, size_t k)
{
    size_t lo = 0, hi = n;
    for (;;) {
        uint64_t a = s[lo], b = s[lo + (hi - lo) / 2], c = s[hi - 1];
        uint64_t piv = a < b ? (b < c ? b : a < c ? c : a) : (a < c ? a : b < c ? c : b);
        size_t lt = lo, i = lo, gt = hi; /* [lo, lt) < piv, [lt, gt) == piv, [gt, hi) > piv */
        while (i < gt) {
            if (s[i] < piv)
                swap_u64(&s[lt++], &s[i++]);
            else if (s[i] > piv)
                swap_u64(&s[i], &s[--gt]);
            else
                i++;
        }
        if (k < lt)
            hi = lt;
        else if (k >= gt)
            lo = gt;
        else
            return piv;
    }
}

/* How many of have rows to keep so that n more fit within max: none when n alone passes it,
 * else three quarters of max or max less n, the lower; have itself when all fit. */
static uint64_t rows_to_keep(uint64_t have, uint64_t max, size_t n)
{
    if (max == 0 || have + n <= max) return have;
    const uint64_t keep = max - max / 4;
    return n >= max ? 0 : keep < max - n ? keep : max - n;
}

/* The expiry mark that leaves at most keep of the have rows stamped s[0, have) (reordered):
 * every row stamped at most the (have - keep)-th oldest stamp goes. Ties go together, so which
 * rows stay does not depend on the order they are listed in. */
static uint64_t keep_mark(uint64_t *s, uint64_t have, uint64_t keep)
{
    return select_kth(s, have, have - keep - 1) + 1;
}

/* Makes room for n more rows under r's bound (ps_resid_put). */
static int make_room(ps_resid *r, size_t n, char **errptr)
{
    if (r->st == NULL) return CM_OK;
    const uint64_t have = emb_store_count(r->st), keep = rows_to_keep(have, r->max_rows, n);
    if (keep == have) return CM_OK;
    stamp_list l = {malloc(have * sizeof *l.s + 1), 0};
    if (l.s == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory bounding the residuals");
    int rc = emb_store_foreach(r->st, collect_stamp, &l, errptr);
    if (rc == CM_OK) rc = emb_store_set_dead_below(r->st, keep_mark(l.s, l.n, keep), errptr);
    if (rc == CM_OK) r->dropped += have - emb_store_count(r->st);
    free(l.s);
    return rc;
}

int ps_resid_put(ps_resid *r, uint32_t dim, const void *recs, size_t n, char **errptr)
{
    const size_t keep = r->max_rows != 0 && n > r->max_rows ? (size_t)r->max_rows : n;
    int rc = resid_store(r, dim, errptr);
    if (rc == CM_OK) rc = make_room(r, keep, errptr);
    if (rc == CM_OK) rc = emb_store_put(r->st, recs, keep, errptr);
    if (rc == CM_OK) r->dropped += n - keep;
    return rc;
}

typedef struct key_list {
    ps_kv *kv;
    size_t n;
} key_list;

static int collect_key(const void *record, void *arg)
{
    key_list *l = arg;
    memcpy(&l->kv[l->n].key, record, 8);
    l->kv[l->n++].idx = 0;
    return 0;
}

/* One table's section: header, then its rows in key order, RESID_CHUNK at a time. */
static int save_table(cm_afile *f, const ps_resid *r, const ps_config *cfg, uint32_t t,
                      char **errptr)
{
    const uint32_t dim = cfg->tables[t].cfg.dim;
    const size_t rec = ps_resid_rec_bytes(dim), row = file_row_bytes(RESID_VERSION, dim);
    emb_store *st = r->st;
    key_list l = {NULL, 0};
    uint64_t n = st ? emb_store_count(st) : 0;
    uint8_t *recs = malloc(RESID_CHUNK * rec), *found = malloc(RESID_CHUNK),
            *out = malloc(RESID_CHUNK * row);
    /* The keys are sorted, then their records fetched a chunk at a time: sorting the records
     * themselves would copy the whole store. */
    ps_kv *tmp = malloc(n * sizeof *tmp + 1);
    uint64_t *keys = malloc(RESID_CHUNK * sizeof *keys);
    l.kv = malloc(n * sizeof *l.kv + 1);
    int rc = CM_OK;
    if (!recs || !found || !out || !tmp || !keys || !l.kv) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory saving %" PRIu64 " residuals", n);
        goto out;
    }
    if (st) rc = emb_store_foreach(st, collect_key, &l, errptr);
    if (rc != CM_OK) goto out;
    ps_kv_sort(l.kv, tmp, l.n);
    resid_sec sec = {.table = t, .dim = dim, .rows = l.n, .clock = r->clock};
    snprintf(sec.name, sizeof sec.name, "%s", cfg->tables[t].name);
    rc = cm_afile_write(f, &sec, sizeof sec, errptr);
    for (size_t at = 0; rc == CM_OK && at < l.n; at += RESID_CHUNK) {
        size_t k = l.n - at < RESID_CHUNK ? l.n - at : RESID_CHUNK;
        for (size_t i = 0; i < k; i++)
            keys[i] = l.kv[at + i].key;
        rc = emb_store_get(st, keys, k, recs, found, errptr);
        for (size_t i = 0; rc == CM_OK && i < k; i++) {
            memcpy(out + i * row, recs + i * rec, 8);          /* the key */
            memcpy(out + i * row + 8, recs + i * rec + PS_RESID_STAMP, 8); /* its stamp */
            memcpy(out + i * row + 16, recs + i * rec + PS_RESID_FLOATS, row - 16);
        }
        if (rc == CM_OK) rc = cm_afile_write(f, out, k * row, errptr);
    }
out:
    free(l.kv);
    free(tmp);
    free(keys);
    free(recs);
    free(found);
    free(out);
    return rc;
}

int ps_resid_save(const ps_resid *rs, const ps_config *cfg, uint32_t worker, const char *path,
                  char **errptr)
{
    resid_hdr h = {.version = RESID_VERSION, .worker = worker};
    memcpy(h.magic, RESID_MAGIC, 8);
    for (uint32_t t = 0; t < cfg->n_tables; t++)
        h.n_tables += pushes_int8(cfg, t);
    if (h.n_tables == 0) return CM_OK;
    cm_afile f;
    int rc = cm_afile_open(&f, path, errptr);
    if (rc != CM_OK) return rc;
    rc = cm_afile_write(&f, &h, sizeof h, errptr);
    for (uint32_t t = 0; t < cfg->n_tables && rc == CM_OK; t++)
        if (pushes_int8(cfg, t)) rc = save_table(&f, &rs[t], cfg, t, errptr);
    return cm_afile_commit_digest(&f, rc, errptr);
}

/* Where a file row's floats start: after its key (8), and its stamp (8) from version 2 on. */
static size_t file_floats_at(const resid_view *v)
{
    return v->row - 4 * (size_t)v->sec.dim;
}

/* The stamp of a file's row (0 in version 1, which has none). */
static uint64_t file_stamp(const resid_view *v, uint64_t i)
{
    uint64_t stamp = 0;
    if (file_floats_at(v) > 8) memcpy(&stamp, v->rows + i * v->row + 8, 8);
    return stamp;
}

/* Whether a section's rows hold ascending keys, stamps at most its clock and finite values. */
static bool rows_ok(const resid_view *v, float *vals)
{
    const size_t fl = file_floats_at(v);
    const uint8_t *p = v->rows;
    uint64_t prev = 0;
    for (uint64_t i = 0; i < v->sec.rows; i++, p += v->row) {
        uint64_t key;
        memcpy(&key, p, 8);
        memcpy(vals, p + fl, 4 * (size_t)v->sec.dim); /* the file's floats need not be aligned */
        if ((i > 0 && key <= prev) || file_stamp(v, i) > v->sec.clock ||
            cm_f32_first_nonfinite(vals, v->sec.dim) < v->sec.dim)
            return false;
        prev = key;
    }
    return true;
}

/* Verifies a whole file and lists its sections (view: PS_MAX_TABLES entries; *worker its
 * worker). Every complaint is CM_ECORRUPT naming path. */
static int resid_parse(const uint8_t *buf, size_t len, const char *path, resid_view *view,
                       uint32_t *n_view, uint32_t *worker, char **errptr)
{
    resid_hdr h;
    uint64_t trailer;
    char why[128] = "";
    float *vals = NULL;
    size_t off = sizeof h, end = len - 8;
    if (len < sizeof h + 8) {
        snprintf(why, sizeof why, "truncated (%zu bytes, shorter than a header)", len);
        goto out;
    }
    memcpy(&h, buf, sizeof h);
    memcpy(&trailer, buf + end, 8);
    if (memcmp(h.magic, RESID_MAGIC, 8) != 0)
        snprintf(why, sizeof why, "not a residual file (bad magic)");
    else if (cm_xxh3(buf, end) != trailer)
        snprintf(why, sizeof why, "checksum mismatch: the file is damaged or truncated");
    else if (h.version == 0 || h.version > RESID_VERSION)
        snprintf(why, sizeof why, "version %u, this build reads %u", h.version, RESID_VERSION);
    else if (h.n_tables > PS_MAX_TABLES || h.zero != 0)
        snprintf(why, sizeof why, "bad header");
    for (uint32_t i = 0; !why[0] && i < h.n_tables; i++) {
        resid_sec sec = {0};
        const size_t sec_bytes = h.version >= 2 ? sizeof sec : RESID_SEC_V1;
        if (end - off < sec_bytes) {
            snprintf(why, sizeof why, "table section %u runs past the end", i);
            break;
        }
        memcpy(&sec, buf + off, sec_bytes);
        off += sec_bytes;
        size_t row = file_row_bytes(h.version, sec.dim);
        float *more = NULL;
        view[i] = (resid_view){sec, buf + off, row};
        if (memchr(sec.name, '\0', sizeof sec.name) == NULL || !ps_name_ok(sec.name) ||
            sec.dim == 0 || sec.dim > RESID_DIM_MAX || sec.table >= PS_MAX_TABLES ||
            (i > 0 && sec.table <= view[i - 1].sec.table))
            snprintf(why, sizeof why, "bad header of table section %u", i);
        else if (sec.rows > (end - off) / row)
            snprintf(why, sizeof why, "table '%s': its rows run past the end", sec.name);
        else if ((more = realloc(vals, 4 * (size_t)sec.dim)) == NULL)
            snprintf(why, sizeof why, "out of memory");
        else if (!rows_ok(&view[i], vals = more))
            snprintf(why, sizeof why,
                     "table '%s': keys out of order, a stamp past its clock or a value not "
                     "finite",
                     sec.name);
        off += why[0] ? 0 : (size_t)sec.rows * row;
    }
    if (!why[0] && off != end) snprintf(why, sizeof why, "bytes after the last table");
out:
    free(vals);
    if (why[0])
        return cm_err(errptr, strcmp(why, "out of memory") ? CM_ECORRUPT : CM_ENOMEM, "%s: %s",
                      path, why);
    *n_view = h.n_tables;
    *worker = h.worker;
    return CM_OK;
}

int ps_residuals_check(const void *buf, size_t len, const char *path, char **errptr)
{
    resid_view *view = malloc(PS_MAX_TABLES * sizeof *view);
    uint32_t n, worker;
    int rc = view ? resid_parse(buf, len, path, view, &n, &worker, errptr)
                  : cm_err(errptr, CM_ENOMEM, "out of memory");
    free(view);
    return rc;
}

/* Whether the file's sections are exactly cfg's int8 tables, by id, name and dim. */
static int match_config(const resid_view *view, uint32_t n, const ps_config *cfg, const char *path,
                        char **errptr)
{
    uint32_t i = 0;
    for (uint32_t t = 0; t < cfg->n_tables; t++) {
        if (!pushes_int8(cfg, t)) continue;
        const ps_table_spec *ts = &cfg->tables[t];
        if (i == n || view[i].sec.table != t || strcmp(view[i].sec.name, ts->name) != 0 ||
            view[i].sec.dim != ts->cfg.dim)
            return cm_err(errptr, CM_EINVAL,
                          "%s: no residuals of table %u '%s' (dim %u), which this config pushes "
                          "int8: written under another configuration",
                          path, t, ts->name, ts->cfg.dim);
        i++;
    }
    if (i < n)
        return cm_err(errptr, CM_EINVAL,
                      "%s: residuals of table %u '%s' (dim %u), which this config does not push "
                      "int8: written under another configuration",
                      path, view[i].sec.table, view[i].sec.name, view[i].sec.dim);
    return CM_OK;
}

/* Puts one section's rows into the table's store, RESID_CHUNK at a time, within r's bound: a
 * file written under a larger one may hold more, and then only the rows a bound applied at
 * that last push would have kept are loaded (the store never grows past the bound). */
static int load_table(ps_resid *r, const resid_view *v, char **errptr)
{
    const size_t rec = ps_resid_rec_bytes(v->sec.dim), fl = file_floats_at(v);
    const uint64_t keep = rows_to_keep(v->sec.rows, r->max_rows, 0);
    uint64_t mark = 0, put = 0;
    uint8_t *recs = calloc(RESID_CHUNK, rec); /* zeroed: the padding is never written */
    int rc = recs ? resid_store(r, v->sec.dim, errptr) : cm_err(errptr, CM_ENOMEM, "out of memory");
    if (rc == CM_OK && keep < v->sec.rows) {
        uint64_t *s = malloc(v->sec.rows * sizeof *s);
        if (s == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory bounding the residuals");
        for (uint64_t i = 0; s != NULL && i < v->sec.rows; i++)
            s[i] = file_stamp(v, i);
        if (s != NULL) mark = keep_mark(s, v->sec.rows, keep);
        free(s);
    }
    for (uint64_t i = 0; rc == CM_OK && i < v->sec.rows;) {
        size_t k = 0;
        for (; k < RESID_CHUNK && i < v->sec.rows; i++) {
            if (file_stamp(v, i) < mark) continue;
            const uint8_t *src = v->rows + i * v->row;
            uint8_t *dst = recs + k++ * rec;
            memcpy(dst, src, 8);
            if (fl > 8) memcpy(dst + PS_RESID_STAMP, src + 8, 8);
            memcpy(dst + PS_RESID_FLOATS, src + fl, v->row - fl);
        }
        rc = emb_store_put(r->st, recs, k, errptr);
        put += k;
    }
    r->clock = v->sec.clock;
    r->dropped += v->sec.rows - put;
    free(recs);
    return rc;
}

int ps_resid_load(ps_resid *rs, const ps_config *cfg, uint32_t worker, const char *path,
                  char **errptr)
{
    ps_resid_clear(rs);
    uint8_t *buf = NULL;
    size_t len = 0;
    resid_view *view = malloc(PS_MAX_TABLES * sizeof *view);
    uint32_t n = 0, owner = 0;
    int rc = view ? cm_read_file(path, (void **)&buf, &len, errptr)
                  : cm_err(errptr, CM_ENOMEM, "out of memory");
    if (rc == CM_OK) rc = resid_parse(buf, len, path, view, &n, &owner, errptr);
    if (rc == CM_OK && owner != worker)
        rc = cm_err(errptr, CM_EINVAL, "%s: worker %u's residuals, not worker %u's", path, owner,
                    worker);
    if (rc == CM_OK) rc = match_config(view, n, cfg, path, errptr);
    for (uint32_t i = 0; i < n && rc == CM_OK; i++)
        rc = load_table(&rs[view[i].sec.table], &view[i], errptr);
    if (rc != CM_OK) ps_resid_clear(rs);
    free(buf);
    free(view);
    return rc;
}
