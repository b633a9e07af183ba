/* Model presets, parameter layout and initialisation; the backend registry. */
#include "src/model.h"

#include <ctype.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"

/* A slot of the staging's dedup table: key, its column, and the batch it was set in. */
typedef struct model_dedup_slot {
    uint64_t key;
    uint32_t gen, col;
} model_dedup_slot;

#define DEDUP_AHEAD 16

static inline uint32_t dedup_hash(uint64_t key)
{
    return (uint32_t)((key * 0x9E3779B97F4A7C15ull) >> 32);
}

/* The slot of s's dedup table holding key in the current batch, or the free one where it would
 * go (linear probing; a slot of an earlier batch counts as free). */
static inline uint32_t dedup_slot(const model_staging *s, uint64_t key)
{
    const uint32_t mask = s->hcap - 1;
    uint32_t h = dedup_hash(key) & mask;
    while (s->hslot[h].gen == s->cur && s->hslot[h].key != key)
        h = (h + 1) & mask;
    return h;
}

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

static int format_widths(char *out, size_t n, const uint32_t *w, uint32_t k)
{
    int len = 0;
    out[0] = '\0';
    for (uint32_t i = 0; i < k && len >= 0 && (size_t)len < n; i++)
        len += snprintf(out + len, n - (size_t)len, "%s%u", i ? "," : "", w[i]);
    return len;
}

int model_cfg_format(const model_cfg *m, int mean_pool, char *out, size_t n)
{
    char hidden[128], bottom[128];
    format_widths(hidden, sizeof hidden, m->hidden, m->n_hidden);
    format_widths(bottom, sizeof bottom, m->bottom, m->n_bottom);
    int len = snprintf(out, n,
                       "kind %s\nfields %u\ndense %u\ndim %u\nhidden %s\nbottom %s\nseed %llu\n"
                       "pool %s\n",
                       model_kind_name(m->kind), m->n_fields, m->n_dense, m->dim,
                       m->n_hidden ? hidden : "-", m->n_bottom ? bottom : "-",
                       (unsigned long long)m->seed, mean_pool ? "mean" : "sum");
    return len < 0 || (size_t)len >= n ? -1 : len;
}

int model_parse_widths(const char *v, uint32_t *w, uint32_t *k)
{
    *k = 0;
    if (strcmp(v, "-") == 0) return 0;
    for (const char *p = v; *p;) {
        char *end;
        /* strtoul takes a sign: "-18446744073709551615" would read as a width of 1. Blanks may
         * still come first ("64, 32"). */
        if (!isdigit((unsigned char)p[strspn(p, " \t")])) return -1;
        unsigned long x = strtoul(p, &end, 10);
        /* a trailing comma names a layer that is not there: "64," is not "64" */
        if (end == p || x == 0 || x > 65536 || *k >= MODEL_MAX_LAYERS ||
            (*end == ',' && end[1] == '\0'))
            return -1;
        w[(*k)++] = (uint32_t)x;
        p = *end == ',' ? end + 1 : end;
        if (end == p && *p) return -1;
    }
    return 0;
}

int model_cfg_parse(const char *text, model_cfg *m, int *mean_pool, char **errptr)
{
    memset(m, 0, sizeof *m);
    int seen = 0;
    const char *line = text;
    while (line && *line) {
        const char *nl = strchr(line, '\n');
        size_t len = nl ? (size_t)(nl - line) : strlen(line);
        char buf[256], name[32], val[200];
        if (len >= sizeof buf) return cm_err(errptr, CM_ECORRUPT, "model config: line too long");
        memcpy(buf, line, len);
        buf[len] = '\0';
        line = nl ? nl + 1 : NULL;
        if (len == 0) continue;
        if (sscanf(buf, "%31s %199s", name, val) != 2)
            return cm_err(errptr, CM_ECORRUPT, "model config: bad line '%s'", buf);
        unsigned long long u = strtoull(val, NULL, 10);
        int bad = 0;
        if (!strcmp(name, "kind")) bad = model_kind_parse(val, &m->kind), seen |= 1;
        else if (!strcmp(name, "fields")) m->n_fields = (uint32_t)u, seen |= 2;
        else if (!strcmp(name, "dense")) m->n_dense = (uint32_t)u, seen |= 4;
        else if (!strcmp(name, "dim")) m->dim = (uint32_t)u, seen |= 8;
        else if (!strcmp(name, "hidden")) bad = model_parse_widths(val, m->hidden, &m->n_hidden);
        else if (!strcmp(name, "bottom")) bad = model_parse_widths(val, m->bottom, &m->n_bottom);
        else if (!strcmp(name, "seed")) m->seed = u;
        else if (!strcmp(name, "pool")) *mean_pool = !strcmp(val, "mean"), bad = strcmp(val, "mean") && strcmp(val, "sum");
        else return cm_err(errptr, CM_ECORRUPT, "model config: unknown name '%s'", name);
        if (bad) return cm_err(errptr, CM_ECORRUPT, "model config: bad value '%s' for %s", val, name);
    }
    if (seen != 15) return cm_err(errptr, CM_ECORRUPT, "model config: kind, fields, dense or dim missing");
    return CM_OK;
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
    /* The top MLP's input width is a uint32_t, and the backends size a row of it from the
     * width while pooling fields x dim floats into it: a width that wraps (4194304 fields of
     * dim 1024) made a layout of a few values that predict overflowed. The dlrm interactions
     * ((F + 1) F / 2 pairs) wrap the same way. */
    const uint64_t wide = (uint64_t)m->n_fields * m->dim + m->n_dense,
                   pairs = ((uint64_t)m->n_fields + 1) * m->n_fields / 2;
    if (wide > UINT32_MAX || (m->kind == MODEL_DLRM && pairs + m->dim > UINT32_MAX))
        return cm_err(errptr, CM_EINVAL,
                      "model %s: %u fields of dim %u and %u dense values: the top MLP's input is "
                      "past 2^32 values",
                      model_kind_name(m->kind), m->n_fields, m->dim, m->n_dense);
    uint32_t in = (uint32_t)wide;
    if (m->kind == MODEL_DLRM) {
        if (m->n_bottom == 0 || m->bottom[m->n_bottom - 1] != m->dim)
            return cm_err(errptr, CM_EINVAL, "dlrm: the bottom MLP must end at dim %u", m->dim);
        uint32_t bin = m->n_dense;
        for (uint32_t i = 0; i < m->n_bottom; i++) {
            at = add_layer(&l->bot[i], bin, m->bottom[i], 1, at);
            bin = m->bottom[i];
        }
        l->n_bot = m->n_bottom;
        l->inter = (uint32_t)pairs; /* in 64 bits: (F + 1) F wraps first */
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

void model_staging_fini(model_staging *s)
{
    free(s->labels);
    free(s->dense);
    free(s->val);
    free(s->row_ptr);
    free(s->col);
    free(s->ukeys);
    for (int t = 0; t < MODEL_MAX_TABLES; t++) free(s->emb[t]);
    free(s->hslot);
    free(s->t_ptr);
    free(s->t_row);
    free(s->t_val);
    model_units_fini(&s->units);
    memset(s, 0, sizeof *s);
}

static int staging_reserve(model_staging *s, const model_layout *l, uint32_t B, uint32_t F,
                           uint32_t D, uint32_t nnz, char **errptr)
{
    if (B > s->cap_b) {
        free(s->labels);
        free(s->dense);
        free(s->row_ptr);
        s->labels = malloc(B * sizeof(float));
        s->dense = malloc((size_t)B * D * sizeof(float) + 1);
        s->row_ptr = malloc(((size_t)B * F + 1) * sizeof(uint32_t));
        if (!s->labels || !s->dense || !s->row_ptr) return cm_err(errptr, CM_ENOMEM, "out of memory");
        s->cap_b = B;
    }
    if (nnz > s->cap_nnz || s->hslot == NULL) {
        uint32_t cap = nnz > 1024 ? nnz : 1024;
        free(s->val);
        free(s->col);
        free(s->ukeys);
        for (int t = 0; t < MODEL_MAX_TABLES; t++) free(s->emb[t]);
        memset(s->emb, 0, sizeof s->emb);
        free(s->hslot);
        s->val = malloc(cap * sizeof(float));
        s->col = malloc(cap * sizeof(uint32_t));
        s->ukeys = malloc(cap * sizeof(uint64_t));
        int ok = s->val && s->col && s->ukeys;
        for (uint32_t t = 0; t < l->n_tables; t++)
            ok = ok && (s->emb[t] = malloc((size_t)cap * l->table_dim[t] * sizeof(float))) != NULL;
        s->hcap = 1;
        while (s->hcap < 2 * cap) s->hcap <<= 1;
        s->hslot = calloc(s->hcap, sizeof *s->hslot);
        s->cur = 0;
        if (!ok || !s->hslot) return cm_err(errptr, CM_ENOMEM, "out of memory for %u keys", cap);
        s->cap_nnz = cap;
    }
    s->n_tables = l->n_tables;
    memcpy(s->table_dim, l->table_dim, sizeof s->table_dim);
    return CM_OK;
}

/* Integer features are heavy-tailed: sign(x) log1p(|x|) keeps them in a small range. Most of
 * them are small counts, whose log1p comes from a table of log1pf's own values (the same
 * bits, a load instead of a libm call for each of B x 13 values a batch). */
#define SQUASH_TABLE 4096
static float squash_table[SQUASH_TABLE];
static pthread_once_t squash_once = PTHREAD_ONCE_INIT;

static void squash_init(void)
{
    for (int i = 0; i < SQUASH_TABLE; i++)
        squash_table[i] = log1pf((float)i);
}

static inline float squash(float x)
{
    float a = fabsf(x);
    if (a < (float)SQUASH_TABLE && a == (float)(int)a) { /* false for NaN: no cast */
        if (a == 0.0f) return x; /* log1pf(-0) is -0 */
        float v = squash_table[(int)a];
        return x >= 0.0f ? v : -v;
    }
    return x >= 0.0f ? log1pf(x) : -log1pf(-x);
}

int model_staging_build(model_staging *s, const model_cfg *m, const model_layout *l,
                        int mean_pool, const model_input *b, char **errptr)
{
    const uint32_t F = m->n_fields, D = m->n_dense;
    if (b->n_fields != F || b->n_dense != D)
        return cm_err(errptr, CM_EINVAL,
                      "batch has %u fields and %u dense values; the model expects "
                      "%u and %u",
                      b->n_fields, b->n_dense, F, D);
    uint32_t nnz = b->offsets[(size_t)b->n_rows * F];
    pthread_once(&squash_once, squash_init);
    int rc = staging_reserve(s, l, b->n_rows, F, D, nnz, errptr);
    if (rc != CM_OK) return rc;
    s->B = b->n_rows;
    s->F = F;
    s->D = D;
    s->nnz = nnz;
    s->indexed = false;
    s->has_units = false;
    if (b->labels) memcpy(s->labels, b->labels, s->B * sizeof(float));
    else memset(s->labels, 0, s->B * sizeof(float));
    for (size_t i = 0; i < (size_t)s->B * D; i++) s->dense[i] = squash(b->dense[i]);
    memcpy(s->row_ptr, b->offsets, ((size_t)s->B * F + 1) * sizeof(uint32_t));
    if (++s->cur == 0) {
        memset(s->hslot, 0, s->hcap * sizeof *s->hslot);
        s->cur = 1;
    }
    uint32_t U = 0, mask = s->hcap - 1;
    model_dedup_slot *hs = s->hslot;
    for (uint32_t k = 0; k < nnz; k++) {
        if (k + DEDUP_AHEAD < nnz) /* one slot a key, ahead: the table outgrows L2 */
            __builtin_prefetch(hs + (dedup_hash(b->keys[k + DEDUP_AHEAD]) & mask), 1);
        uint64_t key = b->keys[k];
        uint32_t h = dedup_slot(s, key);
        if (hs[h].gen != s->cur) {
            hs[h].gen = s->cur;
            hs[h].key = key;
            hs[h].col = U;
            s->ukeys[U++] = key;
        }
        s->col[k] = hs[h].col;
    }
    s->U = U;
    for (size_t r = 0; r < (size_t)s->B * F; r++) {
        uint32_t lo = s->row_ptr[r], hi = s->row_ptr[r + 1];
        float w = mean_pool && hi > lo ? 1.0f / (float)(hi - lo) : 1.0f;
        for (uint32_t k = lo; k < hi; k++) s->val[k] = b->weights ? w * b->weights[k] : w;
    }
    return CM_OK;
}

void model_staging_seen(const model_staging *s, const uint64_t *keys, uint32_t n, uint32_t *seen)
{
    const uint32_t mask = s->hcap - 1;
    for (uint32_t i = 0; i < n; i++) {
        if (i + DEDUP_AHEAD < n)
            __builtin_prefetch(s->hslot + (dedup_hash(keys[i + DEDUP_AHEAD]) & mask));
        seen[i] = s->hslot[dedup_slot(s, keys[i])].gen == s->cur;
    }
}

/* A counting sort of the entries by column; walking the CSR rows in order keeps each column's
 * entries in row order, the order A^T dX must add them in. */
int model_staging_index(model_staging *s, char **errptr)
{
    if (s->U + 1 > s->cap_tu) {
        free(s->t_ptr);
        s->cap_tu = s->U + 1;
        if ((s->t_ptr = malloc(s->cap_tu * sizeof *s->t_ptr)) == NULL) s->cap_tu = 0;
    }
    if (s->nnz > s->cap_tn || s->t_row == NULL) {
        free(s->t_row);
        free(s->t_val);
        s->cap_tn = s->nnz > 1024 ? s->nnz : 1024;
        s->t_row = malloc(s->cap_tn * sizeof *s->t_row);
        s->t_val = malloc(s->cap_tn * sizeof *s->t_val);
        if (s->t_row == NULL || s->t_val == NULL) s->cap_tn = 0;
    }
    if (s->cap_tu == 0 || s->cap_tn == 0) return cm_err(errptr, CM_ENOMEM, "out of memory");
    uint32_t *ptr = s->t_ptr;
    memset(ptr, 0, (s->U + 1) * sizeof *ptr);
    for (uint32_t k = 0; k < s->nnz; k++)
        ptr[s->col[k] + 1]++;
    for (uint32_t u = 0; u < s->U; u++)
        ptr[u + 1] += ptr[u];
    /* ptr[u] walks key u's slots; afterwards ptr[u] is where key u+1 starts. */
    for (size_t r = 0; r < (size_t)s->B * s->F; r++)
        for (uint32_t k = s->row_ptr[r]; k < s->row_ptr[r + 1]; k++) {
            uint32_t e = ptr[s->col[k]]++;
            s->t_row[e] = (uint32_t)r;
            s->t_val[e] = s->val[k];
        }
    memmove(ptr + 1, ptr, s->U * sizeof *ptr);
    ptr[0] = 0;
    s->indexed = true;
    return CM_OK;
}

/* Room for a batch of U keys, F fields and nnz entries (units <= entries). */
static int units_reserve(model_units *x, uint32_t U, uint32_t F, size_t nnz, char **errptr)
{
    if (U + 1 > x->cap_u) {
        size_t cap = (size_t)U + U / 4 + 64;
        uint32_t *st = calloc(cap + 1, sizeof *st), *uid = malloc((cap + 1) * sizeof *uid),
                 *kp = malloc((cap + 2) * sizeof *kp);
        if (!st || !uid || !kp) {
            free(st);
            free(uid);
            free(kp);
            return cm_err(errptr, CM_ENOMEM, "out of memory for the units of %u keys", U);
        }
        free(x->stamp);
        free(x->uid);
        free(x->key_ptr);
        x->stamp = st, x->uid = uid, x->key_ptr = kp;
        x->gen = 0; /* fresh stamps */
        x->cap_u = cap;
    }
    if (F + 1 > x->cap_f) {
        uint32_t *fp = malloc((F + 1) * sizeof *fp);
        if (fp == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
        free(x->field_ptr);
        x->field_ptr = fp;
        x->cap_f = F + 1;
    }
    if (nnz > x->cap_nnz || x->ent_unit == NULL) {
        size_t cap = nnz + nnz / 4 + 64;
        uint32_t **u32[] = {&x->ent_unit, &x->unit_key, &x->unit_field,
                            &x->unit_ptr, &x->ue_s,     &x->key_units};
        bool ok = true;
        for (size_t i = 0; i < sizeof u32 / sizeof *u32; i++) {
            free(*u32[i]);
            ok = (*u32[i] = malloc((cap + 1) * sizeof(uint32_t))) != NULL && ok;
        }
        free(x->ue_v);
        ok = (x->ue_v = malloc(cap * sizeof(float))) != NULL && ok;
        x->cap_nnz = ok ? cap : 0;
        if (!ok)
            return cm_err(errptr, CM_ENOMEM, "out of memory for the units of %zu entries", nnz);
    }
    return CM_OK;
}

/* The units, field by field (a generation of stamps a field, so a key used by two fields is a
 * unit of each); then each unit's entries, field by field too; then each key's units. The
 * first walk stops at more than max_units: a batch where nearly every slot is its own unit
 * then pays for a third of it, not for the index. */
int model_units_build(model_units *x, const model_batch *b, uint32_t max_units, char **errptr)
{
    const uint32_t F = b->F, B = b->B;
    const size_t nnz = b->row_ptr[(size_t)B * F];
    int rc = units_reserve(x, b->U, F, nnz, errptr);
    if (rc != CM_OK) return rc;
    if (x->gen > UINT32_MAX - F - 1) { /* a stamp could repeat: start the generations over */
        memset(x->stamp, 0, (x->cap_u + 1) * sizeof *x->stamp);
        x->gen = 0;
    }
    x->over = false;
    /* Locals, not x's fields: the stores below are all uint32_t, and the compiler reloaded
     * x's pointers around them. */
    const uint32_t *rp = b->row_ptr, *col = b->col;
    uint32_t *stamp = x->stamp, *uid = x->uid, *ent = x->ent_unit, *ukey = x->unit_key,
             *ufield = x->unit_field, *uptr = x->unit_ptr;
    uint32_t n = 0;
    for (uint32_t f = 0; f < F; f++) {
        x->field_ptr[f] = n;
        const uint32_t g = ++x->gen;
        for (uint32_t s = 0; s < B; s++) {
            size_t r = (size_t)s * F + f;
            for (uint32_t k = rp[r]; k < rp[r + 1]; k++) {
                const uint32_t u = col[k];
                if (stamp[u] != g) {
                    if (n == max_units) {
                        x->over = true;
                        return CM_OK;
                    }
                    stamp[u] = g;
                    uid[u] = n;
                    ukey[n] = u;
                    ufield[n] = f;
                    uptr[n + 1] = 0;
                    n++;
                }
                const uint32_t i = uid[u];
                ent[k] = i;
                uptr[i + 1]++;
            }
        }
    }
    x->field_ptr[F] = n;
    x->n = n;
    uptr[0] = 0;
    for (uint32_t i = 0; i < n; i++)
        uptr[i + 1] += uptr[i];
    /* The entries by unit (key_units is the fill cursor until its own turn). */
    uint32_t *cur = x->key_units, *ue_s = x->ue_s;
    float *ue_v = x->ue_v;
    const float *val = b->val;
    memcpy(cur, uptr, n * sizeof *cur);
    for (uint32_t f = 0; f < F; f++)
        for (uint32_t s = 0; s < B; s++) {
            size_t r = (size_t)s * F + f;
            for (uint32_t k = rp[r]; k < rp[r + 1]; k++) {
                uint32_t e = cur[ent[k]]++;
                ue_s[e] = s;
                ue_v[e] = val[k];
            }
        }
    /* Each key's units (uid is the fill cursor now). */
    memset(x->key_ptr, 0, ((size_t)b->U + 1) * sizeof *x->key_ptr);
    for (uint32_t i = 0; i < n; i++)
        x->key_ptr[x->unit_key[i] + 1]++;
    for (uint32_t u = 0; u < b->U; u++) {
        x->key_ptr[u + 1] += x->key_ptr[u];
        x->uid[u] = x->key_ptr[u];
    }
    for (uint32_t i = 0; i < n; i++)
        x->key_units[x->uid[x->unit_key[i]]++] = i;
    return CM_OK;
}

void model_units_fini(model_units *x)
{
    free(x->field_ptr);
    free(x->ent_unit);
    free(x->unit_key);
    free(x->unit_field);
    free(x->unit_ptr);
    free(x->ue_s);
    free(x->ue_v);
    free(x->key_ptr);
    free(x->key_units);
    free(x->stamp);
    free(x->uid);
    memset(x, 0, sizeof *x);
}

int model_staging_units(model_staging *s, uint32_t max_units, char **errptr)
{
    model_batch mb;
    model_staging_view(s, &mb);
    int rc = model_units_build(&s->units, &mb, max_units, errptr);
    s->has_units = rc == CM_OK;
    return rc;
}

void model_staging_view(const model_staging *s, model_batch *mb)
{
    memset(mb, 0, sizeof *mb);
    mb->B = s->B;
    mb->F = s->F;
    mb->D = s->D;
    mb->U = s->U;
    mb->dense = s->dense;
    mb->labels = s->labels;
    mb->row_ptr = s->row_ptr;
    mb->col = s->col;
    mb->val = s->val;
    for (uint32_t t = 0; t < s->n_tables; t++) mb->emb[t] = s->emb[t];
    if (s->indexed) {
        mb->t_ptr = s->t_ptr;
        mb->t_row = s->t_row;
        mb->t_val = s->t_val;
    }
    if (s->has_units) mb->units = &s->units;
}

