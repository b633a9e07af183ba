#include <stdlib.h>
#include <string.h>

#include "datasets/ds_internal.h"

/* Doubling keeps appends amortised O(1); callers check the result. */
static size_t grow_to(size_t cap, size_t need)
{
    size_t c = cap ? cap : 64;
    while (c < need) c *= 2;
    return c;
}

static int grow_array(void **p, size_t count, size_t elem)
{
    void *q = realloc(*p, count * elem + (count == 0));
    if (q == NULL) return CM_ENOMEM;
    *p = q;
    return CM_OK;
}

int ds_buf_reserve(ds_buf *b, size_t need)
{
    if (need <= b->cap) return CM_OK;
    size_t c = grow_to(b->cap, need);
    if (grow_array((void **)&b->p, c, 1) != CM_OK) return CM_ENOMEM;
    b->cap = c;
    return CM_OK;
}

int ds_buf_append(ds_buf *b, const void *src, size_t n)
{
    if (ds_buf_reserve(b, b->len + n) != CM_OK) return CM_ENOMEM;
    if (n) memcpy(b->p + b->len, src, n);
    b->len += n;
    return CM_OK;
}

void ds_buf_free(ds_buf *b)
{
    free(b->p);
    memset(b, 0, sizeof *b);
}

void ds_rows_init(ds_rows *r, uint32_t n_dense, uint32_t n_fields, int has_weights)
{
    memset(r, 0, sizeof *r);
    r->n_dense = n_dense;
    r->n_fields = n_fields;
    r->has_weights = has_weights;
}

void ds_rows_free(ds_rows *r)
{
    free(r->labels);
    free(r->dense);
    free(r->offsets);
    free(r->keys);
    free(r->weights);
    ds_rows_init(r, r->n_dense, r->n_fields, r->has_weights);
}

void ds_rows_clear(ds_rows *r)
{
    r->n_rows = 0;
    r->n_keys = 0;
    if (r->offsets) r->offsets[0] = 0;
}

int ds_rows_reserve_rows(ds_rows *r, size_t rows)
{
    if (rows <= r->cap_rows && r->offsets) return CM_OK;
    size_t c = grow_to(r->cap_rows, rows);
    if (grow_array((void **)&r->labels, c, sizeof(float)) ||
        grow_array((void **)&r->dense, c * r->n_dense, sizeof(float)) ||
        grow_array((void **)&r->offsets, c * r->n_fields + 1, sizeof(uint32_t)))
        return CM_ENOMEM;
    if (r->cap_rows == 0) r->offsets[0] = 0;
    r->cap_rows = c;
    return CM_OK;
}

int ds_rows_reserve_keys(ds_rows *r, size_t keys)
{
    if (keys <= r->cap_keys && r->keys) return CM_OK;
    /* offsets are 32-bit: one buffer never holds 4G keys */
    if (keys > UINT32_MAX) return CM_ENOMEM;
    size_t c = grow_to(r->cap_keys, keys);
    if (c > UINT32_MAX) c = UINT32_MAX;
    if (grow_array((void **)&r->keys, c, sizeof(uint64_t))) return CM_ENOMEM;
    if (r->has_weights && grow_array((void **)&r->weights, c, sizeof(float))) return CM_ENOMEM;
    r->cap_keys = c;
    return CM_OK;
}

int ds_rows_append_row(ds_rows *r, const ds_batch *b, size_t i)
{
    uint32_t nf = r->n_fields, nd = r->n_dense;
    uint32_t k0 = b->offsets[i * nf], k1 = b->offsets[(i + 1) * nf];
    if (ds_rows_reserve_rows(r, r->n_rows + 1) || ds_rows_reserve_keys(r, r->n_keys + (k1 - k0)))
        return CM_ENOMEM;
    size_t row = r->n_rows;
    r->labels[row] = b->labels[i];
    if (nd) memcpy(r->dense + row * nd, b->dense + i * nd, nd * sizeof(float));
    uint32_t base = (uint32_t)r->n_keys;
    for (uint32_t f = 0; f < nf; f++)
        r->offsets[row * nf + f + 1] = base + (b->offsets[i * nf + f + 1] - k0);
    if (k1 > k0) {
        memcpy(r->keys + base, b->keys + k0, (k1 - k0) * sizeof(uint64_t));
        if (r->has_weights)
            memcpy(r->weights + base, b->weights + k0, (k1 - k0) * sizeof(float));
    }
    r->n_keys += k1 - k0;
    r->n_rows++;
    return CM_OK;
}

void ds_rows_view(const ds_rows *r, size_t row0, size_t n, ds_batch *out)
{
    static const uint32_t zero_offset = 0;
    memset(out, 0, sizeof *out);
    out->n_rows = (uint32_t)n;
    out->n_dense = r->n_dense;
    out->n_fields = r->n_fields;
    out->labels = r->labels ? r->labels + row0 : NULL;
    out->dense = r->dense ? r->dense + row0 * r->n_dense : NULL;
    /* offsets stay absolute into keys, so a view of a sub-range needs keys from 0 */
    out->offsets = r->offsets ? r->offsets + row0 * r->n_fields : &zero_offset;
    out->keys = r->keys;
    out->weights = r->has_weights ? r->weights : NULL;
    out->n_keys = r->offsets ? r->offsets[(row0 + n) * r->n_fields] - r->offsets[row0 * r->n_fields]
                             : 0;
}
