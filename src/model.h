/*
 * Models and compute backends (private to src/).
 *
 * A model sees one mini-batch as:
 *   - dense features x: B x D floats (already log1p-transformed, missing = 0);
 *   - for each embedding table t, the pulled rows E_t: U x dim_t floats, one per distinct key
 *     of the batch (U distinct keys, the same for every table);
 *   - the pooling matrix A in CSR: (B*F) rows x U columns; row b*F+f holds field f of sample
 *     b, with values = pooling weights (1 for sum, 1/len for mean, times a key weight).
 * Pooling is X_t = A * E_t for every table (an SpMM), and the backward pass gives the row
 * gradients dE_t = A^T * dX_t: exactly the deduplicated gradients pushed to the PS. Both
 * backends (cpu, cuda) share this layout.
 *
 * Presets (tables: "emb" of dim d, "lin" of dim 1; dense params are one flat vector):
 *   lr      logit = sum_f X_lin[b,f] + w . x + c
 *   mlp     logit = MLP([X_emb[b,0..F), x])                      (F*d + D -> hidden -> 1)
 *   dlrm    z0 = MLP_bottom(x) (-> d); logit = MLP_top([z0, <v_i,v_j> for i<j over z0,X_emb])
 *   deepfm  logit = sum_f X_lin + w . x + c + FM(X_emb) + MLP([X_emb, x])
 * Hidden layers use ReLU; the loss is the mean sigmoid cross-entropy over the batch.
 */
#ifndef EMBER_SRC_MODEL_H
#define EMBER_SRC_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MODEL_MAX_LAYERS 8
#define MODEL_MAX_TABLES 2

typedef enum model_kind { MODEL_LR, MODEL_MLP, MODEL_DLRM, MODEL_DEEPFM } model_kind;

typedef struct model_cfg {
    model_kind kind;
    uint32_t n_fields, n_dense, dim;
    uint32_t n_hidden, hidden[MODEL_MAX_LAYERS]; /* top MLP widths (before the 1-unit output) */
    uint32_t n_bottom, bottom[MODEL_MAX_LAYERS]; /* dlrm bottom MLP widths (last must be dim) */
    uint64_t seed;
} model_cfg;

/* Parses "lr", "mlp", "dlrm", "deepfm". 0 or -1. */
int model_kind_parse(const char *name, model_kind *out);
const char *model_kind_name(model_kind k);
/* Fills the preset's default shape for F fields and D dense features. */
void model_cfg_preset(model_cfg *m, model_kind kind, uint32_t n_fields, uint32_t n_dense);

/* One fully connected layer: y = W x + b, W is out x in row-major, at params[w], b at params[b]. */
typedef struct model_layer {
    uint32_t in, out;
    size_t w, b;
    int relu;
} model_layer;

/* The flat parameter layout a config implies. */
typedef struct model_layout {
    uint32_t n_tables, table_dim[MODEL_MAX_TABLES]; /* table 0 "emb" or "lin"; table 1 "lin" */
    int emb_table, lin_table;                       /* index or -1 */
    uint32_t n_top, n_bot;
    model_layer top[MODEL_MAX_LAYERS + 1], bot[MODEL_MAX_LAYERS];
    size_t lin_w, lin_c; /* lr/deepfm: dense linear weights (D) and bias (1) */
    size_t n_params;
    uint32_t top_in, inter; /* top MLP input width; dlrm interaction pairs */
} model_layout;

/* Text form of a config ("name value" lines: kind, fields, dense, dim, hidden, bottom, seed,
 * pool) as stored beside checkpoints and in serving bundles. format returns the length
 * written (< n), or -1 when n is too small. parse rejects unknown or missing names. */
int model_cfg_format(const model_cfg *m, int mean_pool, char *out, size_t n);
int model_cfg_parse(const char *text, model_cfg *m, int *mean_pool, char **errptr);
/* Layer widths "256,128" ("-" for none) into w[0..*k). 0 or -1. */
int model_parse_widths(const char *v, uint32_t *w, uint32_t *k);

int model_layout_make(const model_cfg *m, model_layout *out, char **errptr);
/* Initial dense parameters (Xavier-uniform weights, zero biases) from the seed. */
void model_init_params(const model_cfg *m, const model_layout *l, float *params);
/* FLOPs of forward + backward per sample of the dense tower (GEMMs only): the roofline count. */
double model_flops_per_sample(const model_layout *l);

/*
 * A batch's units: its distinct (field, key) pairs, numbered field by field, in each field in
 * the order its samples first use them; each unit's entries in sample order; each key's units
 * in field order. The cpu backend's factorized first layer steps on them (backend_cpu.c, "The
 * factorized first layer"); the trainer builds them with the staging, on its builder thread,
 * so that the stepping thread does not walk the batch (model_units_build). Zero-initialise
 * before first use; the buffers grow and are reused.
 */
typedef struct model_units {
    uint32_t n;          /* units */
    bool over;           /* there were more than max_units: nothing else is valid */
    uint32_t *field_ptr; /* F + 1: field f's units are [field_ptr[f], field_ptr[f + 1]) */
    uint32_t *ent_unit;  /* each CSR entry's unit */
    uint32_t *unit_key, *unit_field, *unit_ptr; /* a unit's key, field, entries (n + 1) */
    uint32_t *ue_s;                /* the units' entries [unit_ptr[i], unit_ptr[i + 1]): sample */
    float *ue_v;                   /* ... and value */
    uint32_t *key_ptr, *key_units; /* key u's units [key_ptr[u], key_ptr[u + 1]), field order */
    /* private to model_units_build */
    uint32_t *stamp, *uid, gen;
    size_t cap_u, cap_f, cap_nnz;
} model_units;

struct model_batch;
/* Builds the units of b (its row_ptr, col and val; b->units is not read), or only sets over,
 * walking no further, at more than max_units. The result depends on the batch alone. CM_OK,
 * or CM_ENOMEM with the units left invalid. */
int model_units_build(model_units *x, const struct model_batch *b, uint32_t max_units,
                      char **errptr);
void model_units_fini(model_units *x);

/* A batch in the model's layout. Arrays are borrowed. */
typedef struct model_batch {
    uint32_t B, F, D, U;
    const float *dense;                 /* B x D */
    const float *labels;                /* B */
    const uint32_t *row_ptr;            /* B*F + 1 */
    const uint32_t *col;                /* nnz, < U */
    const float *val;                   /* nnz */
    const float *emb[MODEL_MAX_TABLES]; /* U x dim_t */
    uint64_t ticket; /* 0, or what backend_ops.prefetch returned for exactly this batch */
    /* Optional. In a backward step the backend calls it once, on the stepping thread, as soon
     * as every demb[t] is final and before it computes the dense gradients, so the caller can
     * push the row gradients while the step finishes (the cpu backend: before the dW GEMMs,
     * a third of the GEMM work). A backend may call it last; a failed step may not call it. */
    void (*emb_ready)(void *arg);
    void *emb_ready_arg;
    /* Optional: A's columns, so the row gradients A^T dX need no scatter. Key u's entries are
     * t_row[t_ptr[u] .. t_ptr[u+1]) (their CSR rows, sample*F + field, ascending) with values
     * t_val; NULL when the staging has not built them (model_staging_index). */
    const uint32_t *t_ptr, *t_row;
    const float *t_val;
    /* Optional: the batch's units, built with the bound backend_ops.max_units gave for it;
     * NULL where the staging has not built them (a backend that steps on units then does). */
    const model_units *units;
} model_batch;

/* Raw rows as a reader or a serving caller has them (datasets' ds_batch layout). */
typedef struct model_input {
    uint32_t n_rows, n_dense, n_fields;
    const float *labels;     /* n_rows, or NULL */
    const float *dense;      /* n_rows x n_dense raw values */
    const uint32_t *offsets; /* n_rows * n_fields + 1 */
    const uint64_t *keys;    /* offsets[n_rows * n_fields] keys */
    const float *weights;    /* per key, or NULL */
} model_input;

/* A batch turned into the model layout: dense values squashed (sign(x) log1p|x|), keys
 * deduplicated into ukeys[0..U) with CSR columns and pooling weights. Buffers grow and are
 * reused; the caller fills the pulled rows into emb[t] (U x dim_t, sized by
 * model_staging_build). Zero-initialise before first use. */
typedef struct model_staging {
    uint32_t B, F, D, U, nnz, cap_b, cap_nnz, n_tables, table_dim[MODEL_MAX_TABLES];
    float *labels, *dense, *val;
    uint32_t *row_ptr, *col;
    uint64_t *ukeys;
    float *emb[MODEL_MAX_TABLES];
    struct model_dedup_slot *hslot; /* dedup table: a slot is valid where its gen == cur */
    uint32_t hcap, cur;
    uint32_t *t_ptr, *t_row, cap_tu, cap_tn; /* model_staging_index; valid when indexed */
    float *t_val;
    bool indexed;
    model_units units; /* model_staging_units; valid when has_units */
    bool has_units;
} model_staging;

int model_staging_build(model_staging *s, const model_cfg *m, const model_layout *l, int mean_pool,
                        const model_input *in, char **errptr);
void model_staging_fini(model_staging *s);
/* Builds A's columns (model_batch.t_ptr) for the batch as it now stands: call it after any
 * reordering of ukeys and col. model_staging_build clears it. */
int model_staging_index(model_staging *s, char **errptr);
/* seen[i] = 1 where keys[i] is one of the distinct keys s was last built with, else 0: the
 * lookup of its dedup table, which stays valid until the next build. */
void model_staging_seen(const model_staging *s, const uint64_t *keys, uint32_t n, uint32_t *seen);
/* Builds the batch's units (model_batch.units) as it now stands, with the bound max_units:
 * call it after any reordering of ukeys and col. model_staging_build clears them. */
int model_staging_units(model_staging *s, uint32_t max_units, char **errptr);
/* The staged batch as the backends take it. */
void model_staging_view(const model_staging *s, model_batch *mb);

/* backend_ops.create flags. */
#define BACKEND_TF32 1u /* cuda: TF32 tensor-core GEMMs (faster, ~1e-3 relative); cpu: ignored */
/* cpu: every GEMM's operands rounded to bfloat16, products summed in fp32 on AMX tiles
 * (cm_gemm_bf16; ~3x OpenBLAS's fp32 on a Sapphire Rapids core); refused without AMX-BF16 and
 * by cuda. Deterministic like fp32: the same bits for any thread count. */
#define BACKEND_BF16 2u
/* cpu, fp32, mlp and deepfm: how the top MLP's first layer is computed. By default the backend
 * picks per batch, from the batch alone (so runs stay reproducible), between the GEMM over the
 * pooled inputs (the reference formulation) and the factorized form, which applies each field's
 * block of the weights once per distinct (field, key) pair of the batch instead of once per
 * sample (cheaper when keys repeat; see backend_cpu.c). PLAIN always takes the GEMM; FACTORED
 * takes the factorized form on every batch it can (tests, measurements). The two differ only
 * in summation order. */
#define BACKEND_PLAIN 4u
#define BACKEND_FACTORED 8u
/* cpu: the factorized layer's portable kernels even where its AVX-512 ones run (tests: they
 * must give the same bits). */
#define BACKEND_NO_SIMD 16u
/* cpu: the factorized layer's and the GEMMs' AVX2 kernels even where their AVX-512 ones run
 * (tests: the same bits again). */
#define BACKEND_NO_AVX512 128u
/* cpu: OpenBLAS's sgemm for the GEMMs even where ember's own GEMM runs (measurements:
 * tools/bench step --openblas). */
#define BACKEND_OPENBLAS 32u
/* cpu: leave OpenBLAS's thread count alone. Without it create sets it to 1, process-wide: every
 * GEMM tile is to be one single-threaded call (backend_cpu.c), which the trainer, owning its
 * process, may ask. A library inside another program's process may not (serve: a server that
 * runs OpenBLAS on several threads for its own work kept losing them to every predict); its
 * GEMMs then run as that program has OpenBLAS set (see serve/ember_serve.h, "Threads"). */
#define BACKEND_KEEP_BLAS_THREADS 64u

/* A compute backend: a static ops table per variant (cpu, cuda). */
typedef struct backend backend;
typedef struct backend_ops {
    const char *name;
    /* Creates per-backend state for batches of at most max_batch rows and max_uniq keys (the
     * cuda backend also sizes its pooling entries per batch by max_uniq; a batch with more
     * grows them once). Everything a step needs is allocated here, so a device without room
     * fails now, not mid-run. threads: CPU threads for the dense math (the cpu backend cuts
     * every GEMM into tiles fixed by its shape, so results are the same bits for any thread
     * count and timing). flags: BACKEND_*. */
    int (*create)(const model_cfg *m, const model_layout *l, uint32_t max_batch, uint32_t max_uniq,
                  uint32_t threads, uint32_t flags, void **state, char **errptr);
    void (*destroy)(void *state);
    /*
     * Hands the backend the batch a later step will take, as soon as its rows and params are
     * pulled, so it can start moving it to the device while the current step computes (cuda:
     * packed into one of two pinned slots and copied on a second stream; the step waits for
     * that copy only). *ticket is set to put into that batch's model_batch.ticket; the cpu
     * backend has nothing to move and sets 0. The contract:
     *   - It reads params and b's arrays only during the call: on return the caller may
     *     rewrite or free them (a re-pulled batch is simply handed over again).
     *   - Calls are serialized among themselves (one thread at a time: the trainer's prefetch
     *     thread, or the stepping thread between its steps) and may run concurrently with a
     *     step on another thread.
     *   - Two batches may be pending; a third call reuses the first one's slot, so it must
     *     come after that batch's step has returned (or that batch is never stepped: its
     *     ticket then fails the step). Stepping a batch again under its ticket is allowed
     *     until then.
     * A step under a ticket computes on the params and arrays prefetch was given (it checks
     * b->B, b->U and labels presence against them). A step with ticket 0 moves a non-empty
     * batch itself; with the cuda backend it must not run concurrently with prefetch, and it
     * drops the pending batches (their tickets then fail).
     */
    int (*prefetch)(void *state, const float *params, const model_batch *b, uint64_t *ticket,
                    char **errptr);
    /* Forward pass: probs (B) and, with labels, the mean loss. With dparams != NULL also the
     * backward pass: dparams (n_params, overwritten) and demb[t] (U x dim_t, overwritten).
     * Calls are serialized among themselves (one step at a time per state). */
    int (*step)(void *state, const float *params, const model_batch *b, float *probs, double *loss,
                float *dparams, float *const *demb, char **errptr);
    /* Optional (NULL: nothing to do). From another thread, once the work the caller ran beside
     * a step since its emb_ready hook is done: the step may use all its threads again for the
     * rest (the cpu backend runs the dense gradients on half of them until then). A call
     * after that step has returned does nothing. */
    void (*join)(void *state);
    /* Optional (NULL: yes). Whether backward steps read A's columns (model_batch.t_ptr), so
     * the trainer's staging builds them only for a backend that does; a step must take a batch
     * without them all the same. Fixed for the life of the state. */
    bool (*columns)(const void *state);
    /* Optional (NULL: none). The most units (model_units) for which a step of a batch of B
     * rows and F fields steps on its units, 0 where it never does: the trainer's staging
     * builds them, with this bound, only for a backend that takes them. */
    uint32_t (*max_units)(const void *state, uint32_t B, uint32_t F);
    /* Optional (NULL: the caller uses prefetch alone). prefetch in two calls, for a batch whose
     * rows [0, ready) of every table are pulled before the rest: prefetch_begin reads
     * everything of b but the params and the rows [ready, U), and starts moving it (cuda:
     * packs it into the batch's pinned slot); prefetch_end, given the same batch (its other
     * arrays unchanged since) and the params, reads those and the rows [ready, U) and ends as
     * prefetch does. Only the rows that come last then stand between their pull and the
     * batch's step. The two count as one prefetch call of the contract above, made at
     * prefetch_begin; any other prefetch call between them drops the begun one, whose
     * prefetch_end then fails. */
    int (*prefetch_begin)(void *state, const model_batch *b, uint32_t ready, char **errptr);
    int (*prefetch_end)(void *state, const float *params, const model_batch *b, uint64_t *ticket,
                        char **errptr);
} backend_ops;

extern const backend_ops backend_cpu_ops;

/* The kernels the cpu backend's fp32 GEMMs run by default: "ember-avx512" or "ember-avx2"
 * (cm_gemm_f32, the same bits either way) where the CPU has AVX-512 or AVX2 with FMA, else
 * OpenBLAS's core ("Haswell"...), whose sums are in another order. Static storage. */
const char *backend_cpu_kernels(void);
/* The vector kernels the factorized first layer runs with these backend flags on this CPU,
 * for a dim-16 table and a first layer a multiple of 32 wide: "avx512", "avx2" or "portable"
 * (all three give the same bits; tests say which they compared). Static storage. */
const char *backend_cpu_fact_kernels(uint32_t flags);
/* The core OpenBLAS detected or was given (OPENBLAS_CORETYPE). Static storage. */
const char *backend_cpu_blas_core(void);

/* The cpu backend's forward pass over a tower that does not change (serving): its weights
 * laid out for the backend's kernels once (backend_cpu_tower_make), where a step lays them out
 * again on every call. Made from params (n_params floats, which must stay as they are while the
 * tower is used) for states created with this model, layout and flags; read only, so any number
 * of states may step on it at once. backend_cpu_tower_bytes: what it holds (the params are not
 * copied). backend_cpu_forward: backend_ops.step without labels or gradients (probs only) on
 * the tower's params, the same bits; CM_EINVAL for a tower made with other flags. */
typedef struct backend_cpu_tower backend_cpu_tower;
int backend_cpu_tower_make(const model_cfg *m, const model_layout *l, uint32_t flags,
                           const float *params, backend_cpu_tower **out, char **errptr);
void backend_cpu_tower_free(backend_cpu_tower *t);
size_t backend_cpu_tower_bytes(const backend_cpu_tower *t);
int backend_cpu_forward(void *state, const backend_cpu_tower *t, const model_batch *b, float *probs,
                        char **errptr);

/* Tests: how many times steps on the calling thread have packed a layer's weight matrix (a
 * GEMM over the weights as they lie in params, or the factorized first layer's blocks of them),
 * since the thread started. */
uint64_t backend_cpu_weight_packs(void);

/* Whether this build has the cuda backend (nvcc was found). */
bool backend_cuda_built(void);

/* The cuda backend, or NULL with an error saying why (not built, its module not found or not
 * loadable). It lives in a module, libember_cuda.so beside the ember binary (or where
 * EMBER_CUDA_MODULE names it), loaded on the first call: the CUDA libraries map ~250 MB and
 * take ~80 ms to load, which a CPU run, a PS process and every other command never pay.
 * Thread-safe; the answer is the same for the life of the process. */
const backend_ops *backend_cuda(char **errptr);

/* 0 when a CUDA device is usable, else an error saying why (not built, module not loadable,
 * no driver, no device). Loads the module; creates nothing on the device. */
int backend_cuda_probe(char **errptr);

/* "cpu" or "cuda" (error when not built or no device). */
int backend_find(const char *name, const backend_ops **out, char **errptr);

#endif
