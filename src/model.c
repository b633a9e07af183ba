/* Model presets, parameter layout and initialisation; the backend registry. */
#include "src/model.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/common.h"

static const char *const kind_names[] = {"lr", "mlp", "dlrm", "deepfm"};

int model_kind_parse(const char *name, model_kind *out)
{
    for (int i = 0; name && i < 4; i++)
        if (strcmp(name, kind_names[i]) == 0) {
            *out = (model_kind)i;
            return 0;
        }
    return -1;
}

const char *model_kind_name(model_kind k)
{
    return (unsigned)k < 4 ? kind_names[k] : "unknown";
}

void model_cfg_preset(model_cfg *m, model_kind kind, uint32_t n_fields, uint32_t n_dense)
{
    memset(m, 0, sizeof *m);
    m->kind = kind;
    m->n_fields = n_fields;
    m->n_dense = n_dense;
    m->dim = kind == MODEL_LR ? 1 : 16;
    m->seed = 1;
    if (kind != MODEL_LR) {
        m->n_hidden = 2;
        m->hidden[0] = 256;
        m->hidden[1] = 128;
    }
    if (kind == MODEL_DLRM) {
        m->n_bottom = 2;
        m->bottom[0] = 64;
        m->bottom[1] = m->dim;
    }
}

static size_t add_layer(model_layer *l, uint32_t in, uint32_t out, int relu, size_t at)
{
    l->in = in;
    l->out = out;
    l->relu = relu;
    l->w = at;
    l->b = at + (size_t)in * out;
    return l->b + out;
}

int model_layout_make(const model_cfg *m, model_layout *l, char **errptr)
{
    memset(l, 0, sizeof *l);
    l->emb_table = l->lin_table = -1;
    if (m->n_fields == 0 || m->dim == 0 || m->dim > 1024 || m->n_hidden > MODEL_MAX_LAYERS ||
        m->n_bottom > MODEL_MAX_LAYERS)
        return cm_err(errptr, CM_EINVAL, "model %s: fields %u, dim %u, %u hidden, %u bottom layers "
                      "out of range", model_kind_name(m->kind), m->n_fields, m->dim, m->n_hidden,
                      m->n_bottom);
    for (uint32_t i = 0; i < m->n_hidden; i++)
        if (m->hidden[i] == 0 || m->hidden[i] > 65536)
            return cm_err(errptr, CM_EINVAL, "hidden layer %u width %u out of range", i, m->hidden[i]);
    size_t at = 0;
    if (m->kind == MODEL_LR || m->kind == MODEL_DEEPFM) {
        l->lin_w = at;
        l->lin_c = at + m->n_dense;
        at += m->n_dense + 1;
    }
    if (m->kind == MODEL_LR) {
        l->n_tables = 1;
        l->table_dim[0] = 1;
        l->lin_table = 0;
        l->n_params = at;
        return CM_OK;
    }
    l->emb_table = 0;
    l->table_dim[0] = m->dim;
    l->n_tables = 1;
    if (m->kind == MODEL_DEEPFM) {
        l->lin_table = 1;
        l->table_dim[1] = 1;
        l->n_tables = 2;
    }
    uint32_t in = m->n_fields * m->dim + m->n_dense;
    if (m->kind == MODEL_DLRM) {
        if (m->n_bottom == 0 || m->bottom[m->n_bottom - 1] != m->dim)
            return cm_err(errptr, CM_EINVAL, "dlrm: the bottom MLP must end at dim %u", m->dim);
        uint32_t bin = m->n_dense;
        for (uint32_t i = 0; i < m->n_bottom; i++) {
            at = add_layer(&l->bot[i], bin, m->bottom[i], 1, at);
            bin = m->bottom[i];
        }
        l->n_bot = m->n_bottom;
        l->inter = (m->n_fields + 1) * m->n_fields / 2;
        in = m->dim + l->inter;
    }
    l->top_in = in;
    for (uint32_t i = 0; i < m->n_hidden; i++) {
        at = add_layer(&l->top[i], in, m->hidden[i], 1, at);
        in = m->hidden[i];
    }
    at = add_layer(&l->top[m->n_hidden], in, 1, 0, at);
    l->n_top = m->n_hidden + 1;
    l->n_params = at;
    return CM_OK;
}

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t x = (*s += 0x9E3779B97F4A7C15ull);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static void init_layer(const model_layer *ly, float *p, uint64_t *rng)
{
    float lim = sqrtf(6.0f / (float)(ly->in + ly->out));
    for (size_t i = 0; i < (size_t)ly->in * ly->out; i++) {
        float u = (float)(splitmix64(rng) >> 40) * (1.0f / 16777216.0f);
        p[ly->w + i] = (2.0f * u - 1.0f) * lim;
    }
    memset(p + ly->b, 0, ly->out * sizeof(float));
}

void model_init_params(const model_cfg *m, const model_layout *l, float *params)
{
    uint64_t rng = m->seed * 0x2545F4914F6CDD1Dull + 7;
    memset(params, 0, l->n_params * sizeof(float));
    for (uint32_t i = 0; i < l->n_bot; i++) init_layer(&l->bot[i], params, &rng);
    for (uint32_t i = 0; i < l->n_top; i++) init_layer(&l->top[i], params, &rng);
}

double model_flops_per_sample(const model_layout *l)
{
    /* Forward 2*in*out per layer; backward twice that (dX and dW). */
    double f = 0;
    for (uint32_t i = 0; i < l->n_bot; i++) f += 6.0 * l->bot[i].in * l->bot[i].out;
    for (uint32_t i = 0; i < l->n_top; i++) f += 6.0 * l->top[i].in * l->top[i].out;
    return f;
}

int backend_find(const char *name, const backend_ops **out, char **errptr)
{
    if (strcmp(name, "cpu") == 0) {
        *out = &backend_cpu_ops;
        return CM_OK;
    }
    if (strcmp(name, "cuda") == 0) {
        if (backend_cuda_ops == NULL)
            return cm_err(errptr, CM_EINVAL, "this ember was built without CUDA (nvcc not found)");
        *out = backend_cuda_ops;
        return CM_OK;
    }
    return cm_err(errptr, CM_EINVAL, "unknown device '%s' (cpu, cuda)", name);
}

#ifndef EMBER_HAVE_CUDA
const backend_ops *const backend_cuda_ops = NULL;
#endif
