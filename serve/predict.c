/* ember_serve_predict: the model's forward pass over rows looked up in the bundle. */
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "serve/internal.h"

/* How predict runs the backend. One thread: the caller's (concurrent callers each have their
 * own scratch). The process's OpenBLAS setting left alone (ember_serve.h, "Threads"). */
#define SERVE_THREADS 1
#define SERVE_FLAGS BACKEND_KEEP_BLAS_THREADS

/*
 * The tower is laid out for the backend's kernels once (backend_cpu_tower), at open and when a
 * delta brings a new one: a backend step lays it out on every call (~60% of a one-row batch's
 * predict, ~35% of a 16-row one's). One copy for the handle, read only by every call at once,
 * rather than one a scratch: there are as many of those as calls have run at once, and each
 * would hold the same bytes (the mlp preset's: 586,752; backend_cpu_tower_bytes). Making it at
 * open rather than on the first call keeps that call as fast as the rest and needs no lock.
 */
int serve_model_tower(ember_serve *h, const float *dense, char **errptr)
{
    backend_cpu_tower *t = NULL;
    int rc = backend_cpu_tower_make(&h->m, &h->l, SERVE_FLAGS, dense, &t, errptr);
    if (rc != CM_OK) return rc;
    backend_cpu_tower_free(h->tower);
    h->tower = t;
    return CM_OK;
}

int serve_model_init(ember_serve *h, const char *dir, char **errptr)
{
    const serve_layer *L = &h->layers[0];
    h->scratch = calloc(1, sizeof *h->scratch);
    if (h->scratch == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    pthread_mutex_init(&h->scratch->mu, NULL);
    int rc = model_cfg_parse(L->model, &h->m, &h->mean_pool, errptr);
    if (rc == CM_OK) rc = model_layout_make(&h->m, &h->l, errptr);
    /* The model code says what is wrong ("model config: ..."), not in which file: a server
     * opening several bundles could not tell which one is damaged. */
    if (rc != CM_OK)
        return errptr && *errptr ? cm_err(errptr, rc, "%s/model.txt: %s", dir, *errptr) : rc;
    if (L->n_dense != h->l.n_params)
        return cm_err(errptr, CM_ECORRUPT,
                      "%s/dense-tower.bin: the tower has %llu values; model.txt needs %zu", dir,
                      (unsigned long long)L->n_dense, h->l.n_params);
    for (uint32_t t = 0; t < h->l.n_tables; t++) {
        const char *name = (int)t == h->l.lin_table ? "lin" : "emb";
        h->table_of[t] = ember_serve_table(h, name);
        if (h->table_of[t] < 0 || ember_serve_table_dim(h, h->table_of[t]) != h->l.table_dim[t])
            return cm_err(errptr, CM_ECORRUPT,
                          "%s: the bundle lacks table '%s' of dim %u that model.txt needs", dir,
                          name, h->l.table_dim[t]);
    }
    return serve_model_tower(h, L->dense, errptr);
}

static void scratch_free(serve_scratch *s)
{
    if (s->state != NULL) backend_cpu_ops.destroy(s->state);
    model_staging_fini(&s->ms);
    free(s);
}

void serve_model_fini(ember_serve *h)
{
    backend_cpu_tower_free(h->tower);
    h->tower = NULL;
    serve_scratch_pool *p = h->scratch;
    if (p == NULL) return;
    for (serve_scratch *s = p->idle, *next; s != NULL; s = next) {
        next = s->next;
        scratch_free(s);
    }
    pthread_mutex_destroy(&p->mu);
    free(p);
    h->scratch = NULL;
}

/* An idle scratch of the handle's, or a new empty one; NULL when out of memory. */
static serve_scratch *scratch_take(serve_scratch_pool *p)
{
    pthread_mutex_lock(&p->mu);
    serve_scratch *s = p->idle;
    if (s != NULL) p->idle = s->next;
    pthread_mutex_unlock(&p->mu);
    return s != NULL ? s : calloc(1, sizeof *s);
}

static void scratch_give(serve_scratch_pool *p, serve_scratch *s)
{
    pthread_mutex_lock(&p->mu);
    s->next = p->idle;
    p->idle = s;
    pthread_mutex_unlock(&p->mu);
}

/* A capacity of at least need: have where it suffices, else need or twice have, the larger (a
 * caller whose batches grow a little at a time remakes the state a few times, not every call). */
static uint32_t grow(uint32_t have, uint32_t need)
{
    if (need <= have) return have;
    return have > UINT32_MAX / 2 || need > 2 * have ? need : 2 * have;
}

/* Makes s's backend state take batches of B rows and U distinct keys: a new one where it is too
 * small. The results do not depend on the state's size: the backend cuts its GEMMs by the
 * batch's shape and picks its first layer's form from the batch alone. */
static int scratch_fit(const ember_serve *h, serve_scratch *s, uint32_t B, uint32_t U,
                       char **errptr)
{
    if (s->state != NULL && B <= s->max_b && U <= s->max_u) return CM_OK;
    const uint32_t max_b = grow(s->max_b, B), max_u = grow(s->max_u, U);
    if (s->state != NULL) backend_cpu_ops.destroy(s->state);
    s->state = NULL;
    s->max_b = s->max_u = 0;
    int rc = backend_cpu_ops.create(&h->m, &h->l, max_b, max_u, SERVE_THREADS, SERVE_FLAGS,
                                    &s->state, errptr);
    if (rc == CM_OK) {
        s->max_b = max_b;
        s->max_u = max_u;
    }
    return rc;
}

int ember_serve_predict(const ember_serve *h, const ember_serve_batch *b, float *out,
                        char **errptr)
{
    if (b->n_rows == 0) return CM_OK;
    /* The caller's offsets, checked here, at the library's edge: ranges that do not start at 0
     * or that go back name keys outside the batch (a crash in the pooling). Batches the
     * trainer stages come from the shard reader, which builds offsets from counts. */
    const size_t slots = (size_t)b->n_rows * b->n_fields;
    if (b->offsets[0] != 0)
        return cm_err(errptr, CM_EINVAL, "batch offsets start at %u, not 0", b->offsets[0]);
    for (size_t r = 0; r < slots; r++)
        if (b->offsets[r + 1] < b->offsets[r])
            return cm_err(errptr, CM_EINVAL,
                          "batch offsets go back at row %zu field %zu (%u after %u)",
                          r / b->n_fields, r % b->n_fields, b->offsets[r + 1], b->offsets[r]);
    serve_scratch *s = scratch_take(h->scratch);
    if (s == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    model_staging *ms = &s->ms;
    model_input in = {b->n_rows, b->n_dense, b->n_fields, NULL, b->dense, b->offsets, b->keys,
                      b->weights};
    int rc = model_staging_build(ms, &h->m, &h->l, h->mean_pool, &in, errptr);
    for (uint32_t t = 0; rc == CM_OK && t < h->l.n_tables; t++)
        rc = ember_serve_lookup(h, h->table_of[t], ms->ukeys, ms->U, ms->emb[t], NULL);
    if (rc == CM_OK) rc = scratch_fit(h, s, ms->B, ms->U, errptr);
    if (rc == CM_OK) {
        model_batch mb;
        model_staging_view(ms, &mb);
        mb.labels = NULL;
        rc = backend_cpu_forward(s->state, h->tower, &mb, out, errptr);
    }
    scratch_give(h->scratch, s);
    return rc;
}
