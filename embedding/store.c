/* emb_store: one handle over the static ops table of each row-store variant. */
#include <stdlib.h>
#include <string.h>

#include "embedding/internal.h"

struct emb_store {
    const struct emb_store_ops *ops;
    void *impl;
    size_t rec;
    uint64_t dead_below;
};

static const struct emb_store_ops *const store_kinds[] = {&emb_store_mem_ops,
                                                          &emb_store_rocksdb_ops};

int emb_store_create(const char *kind, const char *path, size_t record_bytes, emb_store **out,
                     char **errptr)
{
    if (record_bytes < 8) return cm_err(errptr, CM_EINVAL, "record_bytes %zu < 8", record_bytes);
    const struct emb_store_ops *ops = NULL;
    for (size_t i = 0; i < sizeof store_kinds / sizeof store_kinds[0]; i++)
        if (kind != NULL && strcmp(kind, store_kinds[i]->kind) == 0) ops = store_kinds[i];
    if (ops == NULL)
        return cm_err(errptr, CM_EINVAL, "unknown row store kind '%s' (memory, rocksdb)",
                      kind ? kind : "(null)");
    emb_store *s = calloc(1, sizeof *s);
    if (s == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    s->ops = ops;
    s->rec = record_bytes;
    int rc = ops->open(path, record_bytes, &s->impl, errptr);
    if (rc != CM_OK) {
        free(s);
        return rc;
    }
    *out = s;
    return CM_OK;
}

void emb_store_destroy(emb_store *s)
{
    if (s == NULL) return;
    s->ops->close(s->impl);
    free(s);
}

int emb_store_drop(emb_store *s, char **errptr)
{
    if (s == NULL) return CM_OK;
    int rc = CM_OK;
    if (s->ops->drop != NULL)
        rc = s->ops->drop(s->impl, errptr);
    else
        s->ops->close(s->impl);
    free(s);
    return rc;
}

const char *emb_store_kind(const emb_store *s)
{
    return s->ops->kind;
}

int emb_store_get(emb_store *s, const uint64_t *keys, size_t n, void *recs, uint8_t *found,
                  char **errptr)
{
    return s->ops->get(s->impl, keys, n, recs, found, errptr);
}

int emb_store_put(emb_store *s, const void *recs, size_t n, char **errptr)
{
    return s->ops->put(s->impl, recs, n, errptr);
}

int emb_store_del(emb_store *s, const uint64_t *keys, size_t n, char **errptr)
{
    return s->ops->del(s->impl, keys, n, errptr);
}

uint64_t emb_store_count(const emb_store *s)
{
    return s->ops->count(s->impl);
}

uint64_t emb_store_mem_bytes(const emb_store *s)
{
    return s->ops->mem_bytes(s->impl);
}

int emb_store_foreach(emb_store *s, emb_record_cb cb, void *arg, char **errptr)
{
    return s->ops->foreach(s->impl, cb, arg, errptr);
}

struct dead_keys {
    uint64_t below, *keys;
    size_t n, cap;
};

static int collect_dead(const void *rec, void *arg)
{
    struct dead_keys *d = arg;
    if (emb_rec_last_step(rec) >= d->below) return 0;
    if (d->n == d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 256;
        uint64_t *k = realloc(d->keys, cap * sizeof *k);
        if (k == NULL) return CM_ENOMEM;
        d->keys = k;
        d->cap = cap;
    }
    d->keys[d->n++] = emb_rec_key(rec);
    return 0;
}

int emb_store_set_dead_below(emb_store *s, uint64_t step, char **errptr)
{
    if (s->rec < EMB_REC_HDR || step <= s->dead_below) return CM_OK;
    if (s->ops->set_dead_below != NULL) {
        s->ops->set_dead_below(s->impl, step);
        s->dead_below = step;
        return CM_OK;
    }
    struct dead_keys d = {step, NULL, 0, 0};
    int rc = s->ops->foreach (s->impl, collect_dead, &d, errptr);
    if (rc == CM_ENOMEM) rc = cm_err(errptr, CM_ENOMEM, "out of memory expiring records");
    if (rc == CM_OK) rc = s->ops->del(s->impl, d.keys, d.n, errptr);
    /* Raised only once its records are gone: after a failure the same call must try again. */
    if (rc == CM_OK) s->dead_below = step;
    free(d.keys);
    return rc;
}

int emb_store_compact(emb_store *s, char **errptr)
{
    return s->ops->compact != NULL ? s->ops->compact(s->impl, errptr) : CM_OK;
}
