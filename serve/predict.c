/* ember_serve_predict: the model's forward pass over rows looked up in the bundle. */
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "serve/internal.h"

int serve_model_init(ember_serve *h, const char *dir, char **errptr)
{
    const serve_layer *L = &h->layers[0];
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
    return CM_OK;
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
    model_staging ms;
    memset(&ms, 0, sizeof ms);
    model_input in = {b->n_rows, b->n_dense, b->n_fields, NULL, b->dense, b->offsets, b->keys,
                      b->weights};
    void *state = NULL;
    int rc = model_staging_build(&ms, &h->m, &h->l, h->mean_pool, &in, errptr);
    for (uint32_t t = 0; rc == CM_OK && t < h->l.n_tables; t++)
        rc = ember_serve_lookup(h, h->table_of[t], ms.ukeys, ms.U, ms.emb[t], NULL);
    if (rc == CM_OK) rc = backend_cpu_ops.create(&h->m, &h->l, ms.B, ms.U, 1, 0, &state, errptr);
    if (rc == CM_OK) {
        model_batch mb;
        model_staging_view(&ms, &mb);
        mb.labels = NULL;
        /* The newest layer carries the current tower. */
        const float *params = h->layers[h->n_layers - 1].dense;
        rc = backend_cpu_ops.step(state, params, &mb, out, NULL, NULL, NULL, errptr);
    }
    if (state) backend_cpu_ops.destroy(state);
    model_staging_fini(&ms);
    return rc;
}
