/* int8 error-feedback residuals: their stores and their file (ps/residual.h). */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "ps/keysort.h"
#include "ps/residual.h"

#define RESID_MAGIC "EMBRESD1"
#define RESID_VERSION 1u
#define RESID_CHUNK 1024u        /* rows read from or put into a store at a time */
#define RESID_DIM_MAX (1u << 20) /* far above any table's; bounds what a file can claim */

typedef struct resid_hdr {
    char magic[8];
    uint32_t version, worker, n_tables, zero;
} resid_hdr;

typedef struct resid_sec {
    char name[PS_NAME_MAX];
    uint32_t table, dim;
    uint64_t rows;
} resid_sec;

/* A verified file's section: its header and where its rows start in the buffer. */
typedef struct resid_view {
    resid_sec sec;
    const uint8_t *rows;
} resid_view;

size_t ps_resid_rec_bytes(uint32_t dim)
{
    return (8 + 4 * (size_t)dim + 7) & ~(size_t)7;
}

int ps_resid_store(emb_store **slot, uint32_t dim, char **errptr)
{
    return *slot != NULL ? CM_OK
                         : emb_store_create("memory", NULL, ps_resid_rec_bytes(dim), slot, errptr);
}

void ps_resid_clear(emb_store **stores)
{
    for (uint32_t i = 0; i < PS_MAX_TABLES; i++) {
        emb_store_destroy(stores[i]);
        stores[i] = NULL;
    }
}

static bool pushes_int8(const ps_config *cfg, uint32_t t)
{
    return cfg->tables[t].push_codec == PS_CODEC_INT8;
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
static int save_table(cm_afile *f, emb_store *st, const ps_config *cfg, uint32_t t, char **errptr)
{
    const uint32_t dim = cfg->tables[t].cfg.dim;
    const size_t rec = ps_resid_rec_bytes(dim), row = 8 + 4 * (size_t)dim;
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
    resid_sec sec = {.table = t, .dim = dim, .rows = l.n};
    snprintf(sec.name, sizeof sec.name, "%s", cfg->tables[t].name);
    rc = cm_afile_write(f, &sec, sizeof sec, errptr);
    for (size_t at = 0; rc == CM_OK && at < l.n; at += RESID_CHUNK) {
        size_t k = l.n - at < RESID_CHUNK ? l.n - at : RESID_CHUNK;
        for (size_t i = 0; i < k; i++)
            keys[i] = l.kv[at + i].key;
        rc = emb_store_get(st, keys, k, recs, found, errptr);
        for (size_t i = 0; rc == CM_OK && i < k; i++)
            memcpy(out + i * row, recs + i * rec, row); /* the key, then the floats */
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

int ps_resid_save(emb_store *const *stores, const ps_config *cfg, uint32_t worker, const char *path,
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
        if (pushes_int8(cfg, t)) rc = save_table(&f, stores[t], cfg, t, errptr);
    return cm_afile_commit_digest(&f, rc, errptr);
}

/* Whether one section's rows (sec->rows of them at p) hold ascending keys and finite values. */
static bool rows_ok(const resid_sec *sec, const uint8_t *p, float *vals)
{
    const size_t row = 8 + 4 * (size_t)sec->dim;
    uint64_t prev = 0;
    for (uint64_t i = 0; i < sec->rows; i++, p += row) {
        uint64_t key;
        memcpy(&key, p, 8);
        memcpy(vals, p + 8, 4 * (size_t)sec->dim); /* the file's floats need not be aligned */
        if ((i > 0 && key <= prev) || cm_f32_first_nonfinite(vals, sec->dim) < sec->dim)
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
    else if (h.version != RESID_VERSION)
        snprintf(why, sizeof why, "version %u, this build reads %u", h.version, RESID_VERSION);
    else if (h.n_tables > PS_MAX_TABLES || h.zero != 0)
        snprintf(why, sizeof why, "bad header");
    for (uint32_t i = 0; !why[0] && i < h.n_tables; i++) {
        resid_sec sec;
        if (end - off < sizeof sec) {
            snprintf(why, sizeof why, "table section %u runs past the end", i);
            break;
        }
        memcpy(&sec, buf + off, sizeof sec);
        off += sizeof sec;
        size_t row = 8 + 4 * (size_t)sec.dim;
        float *more = NULL;
        if (memchr(sec.name, '\0', sizeof sec.name) == NULL || !ps_name_ok(sec.name) ||
            sec.dim == 0 || sec.dim > RESID_DIM_MAX || sec.table >= PS_MAX_TABLES ||
            (i > 0 && sec.table <= view[i - 1].sec.table))
            snprintf(why, sizeof why, "bad header of table section %u", i);
        else if (sec.rows > (end - off) / row)
            snprintf(why, sizeof why, "table '%s': its rows run past the end", sec.name);
        else if ((more = realloc(vals, 4 * (size_t)sec.dim)) == NULL)
            snprintf(why, sizeof why, "out of memory");
        else if (!rows_ok(&sec, buf + off, vals = more))
            snprintf(why, sizeof why, "table '%s': keys out of order or a value not finite",
                     sec.name);
        view[i] = (resid_view){sec, buf + off};
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

/* Puts one section's rows into the table's store, RESID_CHUNK at a time. */
static int load_table(emb_store **slot, const resid_view *v, char **errptr)
{
    const size_t rec = ps_resid_rec_bytes(v->sec.dim), row = 8 + 4 * (size_t)v->sec.dim;
    uint8_t *recs = calloc(RESID_CHUNK, rec); /* zeroed: the padding is never written */
    int rc = recs ? ps_resid_store(slot, v->sec.dim, errptr)
                  : cm_err(errptr, CM_ENOMEM, "out of memory");
    for (uint64_t at = 0; rc == CM_OK && at < v->sec.rows; at += RESID_CHUNK) {
        size_t k = v->sec.rows - at < RESID_CHUNK ? (size_t)(v->sec.rows - at) : RESID_CHUNK;
        for (size_t i = 0; i < k; i++)
            memcpy(recs + i * rec, v->rows + (at + i) * row, row);
        rc = emb_store_put(*slot, recs, k, errptr);
    }
    free(recs);
    return rc;
}

int ps_resid_load(emb_store **stores, const ps_config *cfg, uint32_t worker, const char *path,
                  char **errptr)
{
    ps_resid_clear(stores);
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
        rc = load_table(&stores[view[i].sec.table], &view[i], errptr);
    if (rc != CM_OK) ps_resid_clear(stores);
    free(buf);
    free(view);
    return rc;
}
