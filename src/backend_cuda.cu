/*
 * The CUDA backend: the same contract and the same math as backend_cpu.c, on one GPU.
 *
 * Design notes (why, not what):
 *
 * - A batch's inputs are packed into one pinned slot and sent with a single cudaMemcpyAsync
 *   (and the outputs come back the same way): per-copy latency, not bandwidth, dominates at
 *   CTR batch sizes. There are two slots: prefetch packs batch t+1 into one and copies it on
 *   a second stream (cp) while batch t's step computes from the other; the step then waits
 *   for that copy's event only (cudaStreamWaitEvent), not for the host. A slot is refilled
 *   only after its last copy (host event wait) and its last step (its `used` event, waited
 *   for by the copy stream) are done. Without prefetch (ticket 0) the step packs slot 0 and
 *   sends it on the compute stream itself, as before. The trainer hands a batch over in two
 *   calls (prefetch_begin, prefetch_end) where it pulls its rows in two parts: the slot is
 *   packed with all but the params and the rows pulled last while the step before runs, so
 *   only those stand between the last pull and the copy (on an H200 host, packing the whole
 *   slot took ~0.9 ms of each ~3.7 ms step, all of it on that path).
 *
 * - Everything is sized at create from max_batch and max_uniq (work buffers, both slots, the
 *   download, the SpMM workspace), with the device's free memory checked first, so the
 *   steady state allocates nothing and a device without room fails at create. cuSPARSE
 *   descriptors are kept and re-pointed; the generic API fixes a CSR's shape and entry count
 *   at creation, so A and A^T (whose nnz changes with every batch) are re-created once a step,
 *   not once an SpMM: host-side structs only, never device memory.
 *
 * - Pooling (X = A E) and its backward product (dE = A^T dX) run in k_pool, one thread per
 *   output adding its row in stored order, not in cusparseSpMM. On an H200 (2026-11-27) every
 *   cuSPARSE 13.0 SpMM algorithm (CSR_ALG1, CSR_ALG2, CSR_ALG3, ALG_DEFAULT) gave other bits
 *   in 28-29 of 29 repeats of one backward product at dim 16 (A^T of a Zipf batch: hot keys'
 *   rows hundreds of entries long, split and recombined in whatever order the blocks finish),
 *   so a training run could not be repeated bit for bit, and the CPU's promise that results
 *   do not depend on timing is worth keeping. k_pool sums in the CPU loops' order: A as
 *   staged, and A^T by a stable counting sort over columns, whose rows list samples in
 *   increasing order, the order the CPU accumulates dE in; so the bits depend neither on the
 *   run nor on the key order (the shard count). The batch is launch-bound at these sizes
 *   either way. EMBER_CUDA_SPMM_ALG=csr_alg1|csr_alg2|csr_alg3|alg_default pools with
 *   cusparseSpMM instead (tools/bench gpu measures it): cuSPARSE assumes canonical CSR (no
 *   repeated (row, column) pair) while a staged batch may repeat a key inside a field, so
 *   then the counting sort merges repeats and A is rebuilt from A^T the same way (two linear
 *   passes, both canonical), and the backward product is still a non-transposed SpMM.
 *
 * - Row-major everywhere, as the CPU backend: a row-major M x N matrix is a column-major
 *   N x M one, so every GEMM is issued transposed (Y = X W^T is Y^T = W X^T for cuBLAS) and
 *   the pooled X (B*F x dim) is the B x F*dim concatenation without any reshuffle.
 *
 * - The small kernels mirror the CPU loops' summation order (one thread owns one output and
 *   walks the same index sequence), and the file is built with --fmad=false so those loops
 *   round like the CPU's. Only cuBLAS / cuSPARSE reassociate sums; the parity test's 1e-5
 *   relative budget is for them. TF32 would not fit that budget, so it is opt-in
 *   (BACKEND_TF32: `ember train --tf32`; EMBER_CUDA_TF32=1 is an alias). Reductions (bias
 *   gradients, the loss) use fixed trees, never atomics, and each cuBLAS handle gets its own
 *   workspace, so a step is bit-reproducible.
 *
 * - Failures never exit: every runtime, cuBLAS, cuSPARSE call and kernel launch is checked and
 *   becomes a CM_* error naming the call. A machine without a driver or a device fails in
 *   create ("no CUDA device"), so a CPU-only host links and runs this file harmlessly.
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusparse.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "common/common.h"
#include "src/model.h"
}

#define ARENA_ALIGN 256
#define CUBLAS_WS_BYTES ((size_t)32 << 20) /* NVIDIA's recommendation for Hopper */

/* ---- error conversion ---- */

static int ck_cuda(cudaError_t e, const char *what, char **errptr)
{
    if (e == cudaSuccess) return CM_OK;
    return cm_err(errptr, e == cudaErrorMemoryAllocation ? CM_ENOMEM : CM_ERR, "cuda: %s: %s (%s)",
                  what, cudaGetErrorString(e), cudaGetErrorName(e));
}

static int ck_blas(cublasStatus_t s, const char *what, char **errptr)
{
    if (s == CUBLAS_STATUS_SUCCESS) return CM_OK;
    return cm_err(errptr, s == CUBLAS_STATUS_ALLOC_FAILED ? CM_ENOMEM : CM_ERR, "cuda: %s: %s",
                  what, cublasGetStatusString(s));
}

static int ck_sparse(cusparseStatus_t s, const char *what, char **errptr)
{
    if (s == CUSPARSE_STATUS_SUCCESS) return CM_OK;
    return cm_err(errptr, s == CUSPARSE_STATUS_ALLOC_FAILED ? CM_ENOMEM : CM_ERR, "cuda: %s: %s",
                  what, cusparseGetErrorString(s));
}

#define TRY(x)                                                                                     \
    do {                                                                                           \
        int rc_ = (x);                                                                             \
        if (rc_ != CM_OK) return rc_;                                                              \
    } while (0)
#define CUDA_TRY(call) TRY(ck_cuda((call), #call, errptr))
#define BLAS_TRY(call) TRY(ck_blas((call), #call, errptr))

/* Grid-stride launches: n is the number of work items (64-bit). n == 0 launches nothing. */
#define BLOCK 256
static unsigned grid_for(size_t n)
{
    size_t g = (n + BLOCK - 1) / BLOCK;
    return (unsigned)(g > 65536 * 16 ? 65536 * 16 : g);
}
#define LAUNCH(kernel, n, ...)                                                                     \
    do {                                                                                           \
        size_t n_ = (n);                                                                           \
        if (n_ > 0) {                                                                              \
            kernel<<<grid_for(n_), BLOCK, 0, c->st>>>(n_, __VA_ARGS__);                            \
            CUDA_TRY_LAUNCH(#kernel);                                                              \
        }                                                                                          \
    } while (0)
#define CUDA_TRY_LAUNCH(name) TRY(ck_cuda(cudaGetLastError(), "launch of " name, errptr))
#define GRID_LOOP(idx, n) for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < (n); \
                               idx += (size_t)gridDim.x * blockDim.x)

/* ---- kernels (each mirrors a loop of backend_cpu.c; see there for the math) ---- */

/* Y = M Z for a CSR M (rows x k, repeats allowed) and a row-major Z (k x d): one thread owns
 * Y[r, j] and adds M's row r in its stored order, as the CPU's pooling loops do, so the bits do
 * not depend on scheduling (cuSPARSE's SpMM gives other bits from run to run on the backward
 * product's long rows: see the note at the top). */
__global__ void k_pool(size_t n, uint32_t d, const int32_t *rp, const int32_t *ci, const float *v,
                       const float *Z, float *Y)
{
    GRID_LOOP(idx, n)
    {
        const size_t r = idx / d, j = idx - r * d;
        float acc = 0.0f;
        for (int32_t p = rp[r]; p < rp[r + 1]; p++)
            acc += v[p] * Z[(size_t)ci[p] * d + j];
        Y[idx] = acc;
    }
}

/* Y[i, j] = act(Y[i, j] + bias[j]), Y is rows x out. */
__global__ void k_bias_act(size_t n, float *Y, const float *bias, uint32_t out, int relu)
{
    GRID_LOOP(idx, n)
    {
        float v = Y[idx] + bias[idx % out];
        Y[idx] = relu && v < 0.0f ? 0.0f : v;
    }
}

/* dY = 0 where the ReLU output was not positive. */
__global__ void k_relu_mask(size_t n, float *dY, const float *Y)
{
    GRID_LOOP(idx, n)
    if (Y[idx] <= 0.0f) dY[idx] = 0.0f;
}

/* out[c] = sum_i (scale ? scale[i] : 1) * Y[i * ld + c] for c < ncols: a fixed-order tree
 * (32 strided partial sums per column, then summed in order), so no atomics. */
__global__ void k_colsum(const float *Y, size_t ld, uint32_t ncols, uint32_t rows,
                         const float *scale, float *out)
{
    __shared__ float sh[32][33];
    uint32_t col = blockIdx.x * 32 + threadIdx.x;
    float acc = 0.0f;
    if (col < ncols)
        for (uint32_t i = threadIdx.y; i < rows; i += 32) {
            float y = Y[(size_t)i * ld + col];
            acc += scale ? scale[i] * y : y;
        }
    sh[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && col < ncols) {
        float s = 0.0f;
        for (int k = 0; k < 32; k++) s += sh[k][threadIdx.x];
        out[col] = s;
    }
}

/* mlp / deepfm top input: in[i] = [xe[i] (F*d), dense[i] (D)]. */
__global__ void k_concat(size_t n, float *in, const float *xe, const float *dense, uint32_t fd,
                         uint32_t D, uint32_t ti)
{
    GRID_LOOP(idx, n)
    {
        size_t i = idx / ti;
        uint32_t k = (uint32_t)(idx % ti);
        in[idx] = k < fd ? xe[i * fd + k] : dense[i * D + (k - fd)];
    }
}

/* dlrm top input: in[i] = [z0[i] (d), <v_a, v_e> for the pairs a < e over (z0, fields)]. */
__global__ void k_dlrm_fwd(size_t n, float *in, const float *z0, const float *xe,
                           const uint32_t *pairs, uint32_t F, uint32_t d, uint32_t ti)
{
    GRID_LOOP(idx, n)
    {
        size_t i = idx / ti;
        uint32_t p = (uint32_t)(idx % ti);
        const float *v0 = z0 + i * d, *ve = xe + i * (size_t)F * d;
        if (p < d) {
            in[idx] = v0[p];
            continue;
        }
        uint32_t a = pairs[2 * (p - d)], e = pairs[2 * (p - d) + 1];
        const float *va = a ? ve + (size_t)(a - 1) * d : v0, *vb = ve + (size_t)(e - 1) * d;
        float s = 0.0f;
        for (uint32_t j = 0; j < d; j++) s += va[j] * vb[j];
        in[idx] = s;
    }
}

/* Index in a dlrm top-input row of the pair (a, e), a < e <= F: the CPU's loop order. */
__device__ __forceinline__ uint32_t pair_at(uint32_t a, uint32_t e, uint32_t F, uint32_t d)
{
    return d + a * F - a * (a - 1) / 2 + (e - a - 1);
}

/* dlrm interaction backward; one thread per (sample, vector x in 0..F, j), adding the pair
 * terms in the order the CPU's (a, e) loop reaches vector x. x == 0 is z0 (its gradient
 * starts from din's first d), x >= 1 is field x-1 (starts from 0). */
__global__ void k_dlrm_bwd(size_t n, const float *din, const float *z0, const float *xe,
                           float *dz0, float *dxe, uint32_t F, uint32_t d, uint32_t ti)
{
    GRID_LOOP(idx, n)
    {
        uint32_t j = (uint32_t)(idx % d);
        uint32_t x = (uint32_t)((idx / d) % (F + 1));
        size_t i = idx / ((size_t)d * (F + 1));
        const float *row = din + i * ti, *v0 = z0 + i * d, *ve = xe + i * (size_t)F * d;
        float acc = x == 0 ? row[j] : 0.0f;
        for (uint32_t a = 0; a < x; a++) {
            float va = a ? ve[(size_t)(a - 1) * d + j] : v0[j];
            acc += row[pair_at(a, x, F, d)] * va;
        }
        for (uint32_t e = x + 1; e <= F; e++) acc += row[pair_at(x, e, F, d)] * ve[(size_t)(e - 1) * d + j];
        if (x == 0) dz0[i * d + j] = acc;
        else dxe[i * (size_t)F * d + (size_t)(x - 1) * d + j] = acc;
    }
}

/* deepfm FM forward per (sample, j): 0.5 ((sum_f v)^2 - sum_f v^2); summed over j in k_head. */
__global__ void k_fm_fwd(size_t n, const float *xe, float *term, uint32_t F, uint32_t d)
{
    GRID_LOOP(idx, n)
    {
        size_t i = idx / d;
        uint32_t j = (uint32_t)(idx % d);
        const float *v = xe + i * (size_t)F * d;
        float s = 0.0f, q = 0.0f;
        for (uint32_t f = 0; f < F; f++) {
            s += v[(size_t)f * d + j];
            q += v[(size_t)f * d + j] * v[(size_t)f * d + j];
        }
        term[idx] = 0.5f * (s * s - q);
    }
}

/* mlp / deepfm: dxe[i, f, j] = (fm ? g_i (s_ij - v_ifj) : 0) + din[i, f*d + j], per (i, j). */
__global__ void k_emb_bwd(size_t n, const float *xe, const float *din, const float *g, float *dxe,
                          uint32_t F, uint32_t d, uint32_t ti, int fm)
{
    GRID_LOOP(idx, n)
    {
        size_t i = idx / d;
        uint32_t j = (uint32_t)(idx % d);
        const float *v = xe + i * (size_t)F * d;
        float *dv = dxe + i * (size_t)F * d;
        float s = 0.0f;
        if (fm)
            for (uint32_t f = 0; f < F; f++) s += v[(size_t)f * d + j];
        for (uint32_t f = 0; f < F; f++) {
            float val = 0.0f;
            if (fm) val += g[i] * (s - v[(size_t)f * d + j]);
            val += din[i * ti + (size_t)f * d + j];
            dv[(size_t)f * d + j] = val;
        }
    }
}

/* lr / deepfm: the pooled first-order weights' gradient is the sample's dlogit. */
__global__ void k_lin_bwd(size_t n, float *dxl, const float *g, uint32_t F)
{
    GRID_LOOP(idx, n)
    dxl[idx] = g[idx / F];
}

/* Per sample: logit = lin + fm + mlp, probability, loss term and dlogit. */
struct head_args {
    uint32_t B, F, D, d;
    const float *xl, *dense, *P; /* xl NULL: no first-order part */
    size_t lin_w, lin_c;
    const float *fmterm, *top, *labels; /* each optional */
    float *probs, *lterm, *dlogit;
};

__global__ void k_head(size_t n, head_args h)
{
    GRID_LOOP(i, n)
    {
        float z = 0.0f;
        if (h.xl) {
            float s = h.P[h.lin_c];
            for (uint32_t f = 0; f < h.F; f++) s += h.xl[i * h.F + f];
            for (uint32_t k = 0; k < h.D; k++) s += h.P[h.lin_w + k] * h.dense[i * h.D + k];
            z += s;
        }
        if (h.fmterm) {
            float fm = 0.0f;
            for (uint32_t j = 0; j < h.d; j++) fm += h.fmterm[i * h.d + j];
            z += fm;
        }
        if (h.top) z += h.top[i];
        float p = 1.0f / (1.0f + expf(-z));
        h.probs[i] = p;
        if (h.labels) {
            float y = h.labels[i];
            h.lterm[i] = fmaxf(z, 0.0f) - z * y + log1pf(expf(-fabsf(z)));
            h.dlogit[i] = (p - y) / (float)h.B;
        }
    }
}

/* *loss = mean of the loss terms, summed in double over a fixed tree (one block). */
#define LOSS_THREADS 256
__global__ void k_loss(const float *lterm, uint32_t B, double *loss)
{
    __shared__ double sh[LOSS_THREADS];
    double s = 0.0;
    for (uint32_t i = threadIdx.x; i < B; i += LOSS_THREADS) s += (double)lterm[i];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = LOSS_THREADS / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) *loss = B ? sh[0] / B : 0.0;
}

/* ---- state ---- */

/* A pinned host arena mirrored by a device arena of the same size. */
typedef struct mirror {
    char *h, *d;
    size_t cap;
} mirror;

/* Offsets of one step's upload and download in the mirrors. */
typedef struct plan {
    size_t params, rp, col, val, rpt, colt, valt, dense, labels, emb[MODEL_MAX_TABLES], up_bytes;
    size_t probs, loss, dparams, demb[MODEL_MAX_TABLES], down_bytes, down_fwd_bytes;
} plan;

/* One batch's inputs on their way to the device. There are two, so that batch t+1 is packed
 * and copied into one (by prefetch, on the copy stream) while batch t's step reads the other. */
typedef struct slot {
    mirror up;
    plan pl;
    uint32_t B, U, nnz; /* nnz: the canonical entries pack left */
    bool labels;
    uint64_t ticket;    /* the batch it holds; 0: none a step may take */
    cudaEvent_t copied; /* recorded after its upload, on the stream that made it */
    cudaEvent_t used;   /* recorded on the compute stream after the last step that read it */
} slot;

/* A cuSPARSE descriptor kept across steps. The generic API fixes a matrix's shape (and a
 * CSR's entry count) at creation, so it is re-created only when that changes and otherwise
 * re-pointed (cusparseCsrSetPointers, cusparseDnMatSetValues): no host allocation then. */
typedef struct sp_desc {
    cusparseSpMatDescr_t d;
    int64_t rows, cols, nnz;
} sp_desc;

typedef struct dn_desc {
    cusparseDnMatDescr_t d;
    int64_t rows, cols;
} dn_desc;

/* The SpMMs of a step; each keeps its own dense descriptors (E in, X out). */
enum { SP_FWD_EMB, SP_FWD_LIN, SP_BWD_EMB, SP_BWD_LIN, SP_SITES };

typedef struct cu {
    model_cfg m;
    model_layout l;
    uint32_t max_b, max_u, widest;
    int dev;
    cudaStream_t st; /* compute: every kernel, GEMM, SpMM and the download */
    cudaStream_t cp; /* prefetch uploads */
    cublasHandle_t blas;
    cusparseHandle_t sparse;
    cusparseSpMMAlg_t alg;
    bool cusparse_pool; /* pooling by cusparseSpMM (EMBER_CUDA_SPMM_ALG), else by k_pool */
    /* Work buffers, one device allocation sized by max_b at create. */
    char *work;
    void *blas_ws;
    float *xe, *dxe, *xl, *dxl, *in, *din, *act[MODEL_MAX_LAYERS + 1], *bact[MODEL_MAX_LAYERS];
    float *g1, *g2, *fmterm, *dz0, *lterm, *dlogit;
    uint32_t *pairs;
    /* Sized at create for max_b rows and max_u keys (and max_u pooling entries: a batch with
     * more grows its slot). */
    slot slots[2];
    uint64_t n_tickets; /* tickets handed out; only prefetch touches it (calls are serialized) */
    /* A prefetch begun (cuda_prefetch_begin) and not yet ended: its ticket-to-be, the rows it
     * packed, the batch's shape. */
    struct {
        bool on;
        uint64_t t;
        uint32_t ready, B, U;
    } begun;
    mirror down;
    sp_desc a, at; /* A and A^T */
    dn_desc dn[SP_SITES][2];
    void *spbuf; /* SpMM workspace: sized at create where cuSPARSE tells, grown if a shape asks */
    size_t spcap;
} cu;

static size_t align_up(size_t x)
{
    return (x + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
}

/* Hands out aligned offsets; pointers are fixed up once the base is known. */
static size_t carve(size_t *at, size_t bytes)
{
    size_t o = *at;
    *at = align_up(o + bytes);
    return o;
}

/* The module's two entry points, found by name (dlsym) by the registry in backend.c. */
extern "C" int backend_cuda_module_probe(char **errptr);

/* 0 when at least one device is usable; the error names why not. */
int backend_cuda_module_probe(char **errptr)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* not sticky, but leave no trace */
        return cm_err(errptr, CM_ERR, "cuda: no CUDA device (cudaGetDeviceCount: %s)",
                      cudaGetErrorString(e));
    }
    if (n <= 0) return cm_err(errptr, CM_ERR, "cuda: no CUDA device (cudaGetDeviceCount found none)");
    return CM_OK;
}

/* Layout of a batch of B rows, U keys and nnz raw pooling entries in the upload and download
 * arenas. */
static void plan_make(const cu *c, uint32_t B, uint32_t U, size_t nnz, plan *pl)
{
    const model_layout *l = &c->l;
    const size_t f4 = sizeof(float), BF = (size_t)B * c->m.n_fields;
    memset(pl, 0, sizeof *pl);
    size_t at = 0;
    pl->params = carve(&at, l->n_params * f4);
    pl->rp = carve(&at, (BF + 1) * sizeof(uint32_t));
    pl->col = carve(&at, nnz * sizeof(uint32_t));
    pl->val = carve(&at, nnz * f4);
    pl->rpt = carve(&at, ((size_t)U + 1) * sizeof(uint32_t));
    pl->colt = carve(&at, nnz * sizeof(uint32_t));
    pl->valt = carve(&at, nnz * f4);
    pl->dense = carve(&at, (size_t)B * c->m.n_dense * f4);
    pl->labels = carve(&at, B * f4);
    for (uint32_t t = 0; t < l->n_tables; t++)
        pl->emb[t] = carve(&at, (size_t)U * l->table_dim[t] * f4);
    pl->up_bytes = at;
    at = 0;
    pl->probs = carve(&at, B * f4);
    pl->loss = carve(&at, sizeof(double));
    pl->down_fwd_bytes = at;
    pl->dparams = carve(&at, l->n_params * f4);
    for (uint32_t t = 0; t < l->n_tables; t++)
        pl->demb[t] = carve(&at, (size_t)U * l->table_dim[t] * f4);
    pl->down_bytes = at;
}

static void mirror_free(mirror *mr)
{
    if (mr->h) cudaFreeHost(mr->h);
    if (mr->d) cudaFree(mr->d);
    memset(mr, 0, sizeof *mr);
}

/* Allocates both halves; the caller makes sure nothing uses the old ones (freed here). */
static int mirror_alloc(mirror *mr, size_t need, const char *what, char **errptr)
{
    mirror_free(mr);
    size_t cap = align_up(need);
    const char *call = "cudaHostAlloc";
    cudaError_t e = cudaHostAlloc((void **)&mr->h, cap, cudaHostAllocDefault);
    if (e == cudaSuccess) {
        call = "cudaMalloc";
        e = cudaMalloc((void **)&mr->d, cap);
    }
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        size_t fr = 0, tot = 0;
        if (mr->h) cudaMemGetInfo(&fr, &tot); /* the device half failed */
        mirror_free(mr);
        char where[96] = "pinned host memory";
        if (fr || tot) snprintf(where, sizeof where, "device: %zu of %zu bytes free", fr, tot);
        return cm_err(errptr, e == cudaErrorMemoryAllocation ? CM_ENOMEM : CM_ERR,
                      "cuda: %s of %zu bytes for the %s: %s (%s)", call, cap, what,
                      cudaGetErrorString(e), where);
    }
    mr->cap = cap;
    return CM_OK;
}

static int sp_bind(sp_desc *s, int64_t rows, int64_t cols, int64_t nnz, const int32_t *rp,
                   const int32_t *ci, const float *v, char **errptr)
{
    /* Non-const descriptors, because only those can be re-pointed; SpMM never writes A. */
    void *p_rp = (void *)rp, *p_ci = (void *)ci, *p_v = (void *)v;
    if (s->d && s->rows == rows && s->cols == cols && s->nnz == nnz)
        return ck_sparse(cusparseCsrSetPointers(s->d, p_rp, p_ci, p_v), "cusparseCsrSetPointers",
                         errptr);
    if (s->d) cusparseDestroySpMat(s->d);
    s->d = NULL;
    TRY(ck_sparse(cusparseCreateCsr(&s->d, rows, cols, nnz, p_rp, p_ci, p_v, CUSPARSE_INDEX_32I,
                                    CUSPARSE_INDEX_32I, CUSPARSE_INDEX_BASE_ZERO, CUDA_R_32F),
                  "cusparseCreateCsr", errptr));
    s->rows = rows;
    s->cols = cols;
    s->nnz = nnz;
    return CM_OK;
}

/* A row-major rows x cols matrix at p. */
static int dn_bind(dn_desc *s, int64_t rows, int64_t cols, const float *p, char **errptr)
{
    if (s->d && s->rows == rows && s->cols == cols)
        return ck_sparse(cusparseDnMatSetValues(s->d, (void *)p), "cusparseDnMatSetValues", errptr);
    if (s->d) cusparseDestroyDnMat(s->d);
    s->d = NULL;
    TRY(ck_sparse(
        cusparseCreateDnMat(&s->d, rows, cols, cols, (void *)p, CUDA_R_32F, CUSPARSE_ORDER_ROW),
        "cusparseCreateDnMat", errptr));
    s->rows = rows;
    s->cols = cols;
    return CM_OK;
}

/* A pooling SpMM: X (rows x d) = A E with A a canonical CSR (rows x cols) and E (cols x d). */
typedef struct csr_ref {
    int64_t rows, cols, nnz;
    const int32_t *rp, *ci;
    const float *v;
} csr_ref;

/* Binds the site's descriptors to this call's operands. */
static int spmm_bind(cu *c, sp_desc *A, const csr_ref *m, int site, const float *E, int64_t d,
                     float *X, char **errptr)
{
    TRY(sp_bind(A, m->rows, m->cols, m->nnz, m->rp, m->ci, m->v, errptr));
    TRY(dn_bind(&c->dn[site][0], m->cols, d, E, errptr));
    return dn_bind(&c->dn[site][1], m->rows, d, X, errptr);
}

/* The workspace cusparseSpMM asks for at a bound site, or 0 when it declines the shape. */
static size_t spmm_need(cu *c, sp_desc *A, int site)
{
    const float one = 1.0f, zero = 0.0f;
    size_t need = 0;
    if (cusparseSpMM_bufferSize(c->sparse, CUSPARSE_OPERATION_NON_TRANSPOSE,
                                CUSPARSE_OPERATION_NON_TRANSPOSE, &one, A->d, c->dn[site][0].d,
                                &zero, c->dn[site][1].d, CUDA_R_32F, c->alg,
                                &need) != CUSPARSE_STATUS_SUCCESS)
        return 0;
    return need;
}

static void cuda_destroy(void *state)
{
    cu *c = (cu *)state;
    if (c == NULL) return;
    cudaSetDevice(c->dev);
    /* Nothing may still read or write the buffers freed below. */
    if (c->cp) cudaStreamSynchronize(c->cp);
    if (c->st) cudaStreamSynchronize(c->st);
    if (c->a.d) cusparseDestroySpMat(c->a.d);
    if (c->at.d) cusparseDestroySpMat(c->at.d);
    for (int i = 0; i < SP_SITES; i++)
        for (int k = 0; k < 2; k++)
            if (c->dn[i][k].d) cusparseDestroyDnMat(c->dn[i][k].d);
    if (c->sparse) cusparseDestroy(c->sparse);
    if (c->blas) cublasDestroy(c->blas);
    for (int i = 0; i < 2; i++) {
        slot *s = &c->slots[i];
        mirror_free(&s->up);
        if (s->copied) cudaEventDestroy(s->copied);
        if (s->used) cudaEventDestroy(s->used);
    }
    mirror_free(&c->down);
    if (c->spbuf) cudaFree(c->spbuf);
    if (c->work) cudaFree(c->work);
    if (c->cp) cudaStreamDestroy(c->cp);
    if (c->st) cudaStreamDestroy(c->st);
    free(c);
}

/* The work buffers' layout for batches of max_b rows: their offsets into `work` (*o) and its
 * size (returned). */
typedef struct work_plan {
    size_t ws, xe, dxe, xl, dxl, in, din, act[MODEL_MAX_LAYERS + 1], bact[MODEL_MAX_LAYERS];
    size_t g1, g2, fm, dz0, pairs, lterm, dlogit;
} work_plan;

static size_t work_make(cu *c, work_plan *o)
{
    const model_cfg *m = &c->m;
    const model_layout *l = &c->l;
    const size_t B = c->max_b, F = m->n_fields, d = m->dim, ti = l->top_in, f4 = sizeof(float);
    uint32_t widest = 1;
    for (uint32_t i = 0; i < l->n_top; i++)
        widest = l->top[i].out > widest ? l->top[i].out : widest;
    for (uint32_t i = 0; i < l->n_bot; i++)
        widest = l->bot[i].out > widest ? l->bot[i].out : widest;
    c->widest = widest;
    memset(o, 0, sizeof *o);
    size_t at = 0;
    o->ws = carve(&at, CUBLAS_WS_BYTES);
    if (l->emb_table >= 0) {
        o->xe = carve(&at, B * F * d * f4);
        o->dxe = carve(&at, B * F * d * f4);
    }
    if (l->lin_table >= 0) {
        o->xl = carve(&at, B * F * f4);
        o->dxl = carve(&at, B * F * f4);
    }
    if (l->n_top > 0) {
        o->in = carve(&at, B * ti * f4);
        o->din = carve(&at, B * ti * f4);
    }
    for (uint32_t i = 0; i < l->n_top; i++)
        o->act[i] = carve(&at, B * l->top[i].out * f4);
    for (uint32_t i = 0; i < l->n_bot; i++)
        o->bact[i] = carve(&at, B * l->bot[i].out * f4);
    o->g1 = carve(&at, B * widest * f4);
    o->g2 = carve(&at, B * widest * f4);
    if (m->kind == MODEL_DEEPFM) o->fm = carve(&at, B * d * f4);
    if (m->kind == MODEL_DLRM) {
        o->dz0 = carve(&at, B * d * f4);
        o->pairs = carve(&at, (size_t)l->inter * 2 * sizeof(uint32_t));
    }
    o->lterm = carve(&at, B * f4);
    o->dlogit = carve(&at, B * f4);
    return at;
}

/* Sizes the SpMM workspace for the largest batch: the four sites bound to the largest
 * shapes (slot 0's and the download's device arenas, whose contents are not read). Where
 * cuSPARSE declines to say, the first SpMM that needs more grows it instead. */
static int spmm_presize(cu *c, const plan *pl, char **errptr)
{
    const model_layout *l = &c->l;
    const int64_t BF = (int64_t)c->max_b * c->m.n_fields, U = c->max_u, nnz = c->max_u;
    const char *up = c->slots[0].up.d, *down = c->down.d;
    csr_ref A = {BF,
                 U,
                 nnz,
                 (const int32_t *)(up + pl->rp),
                 (const int32_t *)(up + pl->col),
                 (const float *)(up + pl->val)};
    csr_ref At = {U,
                  BF,
                  nnz,
                  (const int32_t *)(up + pl->rpt),
                  (const int32_t *)(up + pl->colt),
                  (const float *)(up + pl->valt)};
    size_t need = 0, n;
    if (BF == 0 || U == 0 || !c->cusparse_pool) return CM_OK;
    if (l->emb_table >= 0) {
        const int64_t d = c->m.dim;
        TRY(spmm_bind(c, &c->a, &A, SP_FWD_EMB, (const float *)(up + pl->emb[l->emb_table]), d,
                      c->xe, errptr));
        need = (n = spmm_need(c, &c->a, SP_FWD_EMB)) > need ? n : need;
        TRY(spmm_bind(c, &c->at, &At, SP_BWD_EMB, c->dxe, d,
                      (float *)(down + pl->demb[l->emb_table]), errptr));
        need = (n = spmm_need(c, &c->at, SP_BWD_EMB)) > need ? n : need;
    }
    if (l->lin_table >= 0) {
        TRY(spmm_bind(c, &c->a, &A, SP_FWD_LIN, (const float *)(up + pl->emb[l->lin_table]), 1,
                      c->xl, errptr));
        need = (n = spmm_need(c, &c->a, SP_FWD_LIN)) > need ? n : need;
        TRY(spmm_bind(c, &c->at, &At, SP_BWD_LIN, c->dxl, 1,
                      (float *)(down + pl->demb[l->lin_table]), errptr));
        need = (n = spmm_need(c, &c->at, SP_BWD_LIN)) > need ? n : need;
    }
    if (need == 0) return CM_OK;
    size_t cap = align_up(need), fr = 0, tot = 0;
    CUDA_TRY(cudaMemGetInfo(&fr, &tot));
    if (cap > fr)
        return cm_err(errptr, CM_ENOMEM,
                      "cuda: not enough device memory for the SpMM workspace: "
                      "need %zu bytes, %zu of %zu free",
                      cap, fr, tot);
    CUDA_TRY(cudaMalloc(&c->spbuf, cap));
    c->spcap = cap;
    return CM_OK;
}

/* cuSPARSE's SpMM algorithms by their EMBER_CUDA_SPMM_ALG names. */
static const struct {
    const char *name;
    cusparseSpMMAlg_t alg;
} spmm_algs[] = {{"csr_alg1", CUSPARSE_SPMM_CSR_ALG1},
                 {"csr_alg2", CUSPARSE_SPMM_CSR_ALG2},
                 {"csr_alg3", CUSPARSE_SPMM_CSR_ALG3},
                 {"alg_default", CUSPARSE_SPMM_ALG_DEFAULT}};
#define N_SPMM_ALGS (sizeof spmm_algs / sizeof spmm_algs[0])

static const char *spmm_alg_name(cusparseSpMMAlg_t alg)
{
    for (size_t i = 0; i < N_SPMM_ALGS; i++)
        if (spmm_algs[i].alg == alg) return spmm_algs[i].name;
    return "?";
}

static int create_impl(cu *c, const model_cfg *m, const model_layout *l, uint32_t max_b,
                       uint32_t max_u, uint32_t flags, char **errptr)
{
    TRY(backend_cuda_module_probe(errptr));
    CUDA_TRY(cudaGetDevice(&c->dev));
    CUDA_TRY(cudaSetDevice(c->dev));
    /* A GPU this build has neither SASS nor PTX for would fail only at the first launch, mid
     * step; one kernel's attributes tell here, and the message says what to rebuild. */
    cudaFuncAttributes fa;
    cudaError_t ke = cudaFuncGetAttributes(&fa, k_head);
    if (ke != cudaSuccess) {
        (void)cudaGetLastError();
        cudaDeviceProp p;
        bool named = cudaGetDeviceProperties(&p, c->dev) == cudaSuccess;
        return cm_err(errptr, CM_ERR,
                      "cuda: device %d (%s, compute %d.%d) cannot run this build's "
                      "kernels: %s; rebuild with -DEMBER_CUDA_ARCHITECTURES including it",
                      c->dev, named ? p.name : "?", named ? p.major : 0, named ? p.minor : 0,
                      cudaGetErrorString(ke));
    }
    c->m = *m;
    c->l = *l;
    c->max_b = max_b;
    c->max_u = max_u;
    /* EMBER_CUDA_SPMM_ALG=csr_alg1|csr_alg2|csr_alg3|alg_default pools with cusparseSpMM and
     * that algorithm (not bit-reproducible: the note at the top); unset or "ember", k_pool. */
    c->alg = CUSPARSE_SPMM_CSR_ALG2;
    c->cusparse_pool = false;
    const char *alg = getenv("EMBER_CUDA_SPMM_ALG");
    if (alg != NULL && *alg != '\0' && strcmp(alg, "ember") != 0) {
        size_t i = 0;
        while (i < N_SPMM_ALGS && strcmp(alg, spmm_algs[i].name) != 0)
            i++;
        if (i == N_SPMM_ALGS)
            return cm_err(errptr, CM_EINVAL,
                          "cuda: EMBER_CUDA_SPMM_ALG '%s' is not ember, csr_alg1, csr_alg2, "
                          "csr_alg3 or alg_default",
                          alg);
        c->alg = spmm_algs[i].alg;
        c->cusparse_pool = true;
    }
    CUDA_TRY(cudaStreamCreateWithFlags(&c->st, cudaStreamNonBlocking));
    CUDA_TRY(cudaStreamCreateWithFlags(&c->cp, cudaStreamNonBlocking));
    for (int i = 0; i < 2; i++) {
        CUDA_TRY(cudaEventCreateWithFlags(&c->slots[i].copied, cudaEventDisableTiming));
        CUDA_TRY(cudaEventCreateWithFlags(&c->slots[i].used, cudaEventDisableTiming));
    }
    BLAS_TRY(cublasCreate(&c->blas));
    BLAS_TRY(cublasSetStream(c->blas, c->st));
    /* TF32 does not fit the parity budget (1e-5), hence opt-in; the variable is an alias of
     * --tf32 for callers that cannot pass flags. */
    const char *tf32 = getenv("EMBER_CUDA_TF32");
    bool use_tf32 = (flags & BACKEND_TF32) || (tf32 && tf32[0] == '1');
    BLAS_TRY(
        cublasSetMathMode(c->blas, use_tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
    TRY(ck_sparse(cusparseCreate(&c->sparse), "cusparseCreate", errptr));
    TRY(ck_sparse(cusparseSetStream(c->sparse, c->st), "cusparseSetStream", errptr));

    /* Everything a step uses, sized for the largest batch now, so that the steady state
     * allocates nothing and a device without room says so here rather than mid-run. The
     * slots hold max_u pooling entries: the trainer's key bound is one on entries anyway. */
    work_plan wp;
    size_t work = work_make(c, &wp);
    plan big;
    plan_make(c, max_b, max_u, max_u, &big);
    size_t need = work + 2 * align_up(big.up_bytes) + align_up(big.down_bytes), fr = 0, tot = 0;
    CUDA_TRY(cudaMemGetInfo(&fr, &tot));
    if (need > fr)
        return cm_err(errptr, CM_ENOMEM,
                      "cuda: not enough device memory for batches of %u rows "
                      "and %u keys: need %zu bytes, %zu of %zu free",
                      max_b, max_u, need, fr, tot);
    cudaError_t e = cudaMalloc((void **)&c->work, work);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        cudaMemGetInfo(&fr, &tot);
        return cm_err(errptr, CM_ENOMEM,
                      "cuda: not enough device memory for batches of %u: "
                      "cudaMalloc of %zu bytes: %s (%zu of %zu bytes free)",
                      max_b, work, cudaGetErrorString(e), fr, tot);
    }
    for (int i = 0; i < 2; i++)
        TRY(mirror_alloc(&c->slots[i].up, big.up_bytes, "batch upload", errptr));
    TRY(mirror_alloc(&c->down, big.down_bytes, "result download", errptr));
    char *w = c->work;
#define AT(o) ((float *)(w + (o)))
    c->blas_ws = w + wp.ws;
    if (l->emb_table >= 0) c->xe = AT(wp.xe), c->dxe = AT(wp.dxe);
    if (l->lin_table >= 0) c->xl = AT(wp.xl), c->dxl = AT(wp.dxl);
    if (l->n_top > 0) c->in = AT(wp.in), c->din = AT(wp.din);
    for (uint32_t i = 0; i < l->n_top; i++)
        c->act[i] = AT(wp.act[i]);
    for (uint32_t i = 0; i < l->n_bot; i++)
        c->bact[i] = AT(wp.bact[i]);
    c->g1 = AT(wp.g1);
    c->g2 = AT(wp.g2);
    if (m->kind == MODEL_DEEPFM) c->fmterm = AT(wp.fm);
    if (m->kind == MODEL_DLRM) c->dz0 = AT(wp.dz0), c->pairs = (uint32_t *)(w + wp.pairs);
    c->lterm = AT(wp.lterm);
    c->dlogit = AT(wp.dlogit);
#undef AT
    BLAS_TRY(cublasSetWorkspace(c->blas, c->blas_ws, CUBLAS_WS_BYTES));
    /* spmm_presize points descriptors at slot 0: give it defined contents (an empty CSR). */
    CUDA_TRY(cudaMemset(c->slots[0].up.d, 0, c->slots[0].up.cap));
    TRY(spmm_presize(c, &big, errptr));
    if (m->kind == MODEL_DLRM && l->inter > 0) {
        const size_t F = m->n_fields;
        uint32_t *pairs = (uint32_t *)malloc((size_t)l->inter * 2 * sizeof(uint32_t));
        if (pairs == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
        size_t p = 0;
        for (uint32_t a = 0; a <= F; a++)
            for (uint32_t b2 = a + 1; b2 <= F; b2++) {
                pairs[p++] = a;
                pairs[p++] = b2;
            }
        int rc = ck_cuda(cudaMemcpy(c->pairs, pairs, p * sizeof(uint32_t), cudaMemcpyHostToDevice),
                         "cudaMemcpy(pairs)", errptr);
        free(pairs);
        TRY(rc);
    }
    return CM_OK;
}

static int cuda_create(const model_cfg *m, const model_layout *l, uint32_t max_b, uint32_t max_u,
                       uint32_t threads, uint32_t flags, void **state, char **errptr)
{
    (void)threads; /* the GPU needs no host compute threads */
    if (flags & BACKEND_BF16)
        return cm_err(errptr, CM_EINVAL,
                      "--bf16 is the CPU's (AMX tiles); on the GPU use --tf32 for tensor cores");
    cu *c = (cu *)calloc(1, sizeof *c);
    if (c == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    int rc = create_impl(c, m, l, max_b, max_u, flags, errptr);
    if (rc != CM_OK) {
        /* Only touch the runtime again where it gave us something (a host without a driver). */
        if (c->st || c->cp || c->slots[0].copied || c->work || c->blas || c->sparse)
            cuda_destroy(c);
        else free(c);
        return rc;
    }
    *state = c;
    return CM_OK;
}

/* ---- step helpers ---- */

/* Row-major C (M x N) = op(A) op(B) with cuBLAS (column-major): computes C^T = op(B)^T op(A)^T,
 * i.e. swaps the operands. ta/tb say whether A / B are used transposed; lda etc. are the
 * row-major leading dimensions (row lengths). */
static int gemm_rm(cu *c, bool ta, bool tb, int M, int N, int K, const float *A, int lda,
                   const float *B, int ldb, float *C, int ldc, char **errptr)
{
    const float one = 1.0f, zero = 0.0f;
    return ck_blas(cublasSgemm(c->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                               N, M, K, &one, B, ldb > 0 ? ldb : 1, A, lda > 0 ? lda : 1, &zero, C,
                               ldc > 0 ? ldc : 1),
                   "cublasSgemm", errptr);
}

static int colsum(cu *c, const float *Y, size_t ld, uint32_t ncols, uint32_t rows, const float *scale,
                  float *out, char **errptr)
{
    if (ncols == 0) return CM_OK;
    k_colsum<<<dim3((ncols + 31) / 32), dim3(32, 32), 0, c->st>>>(Y, ld, ncols, rows, scale, out);
    CUDA_TRY_LAUNCH("k_colsum");
    return CM_OK;
}

/* Y = act(X W^T + b) for B rows (the CPU's layer_fwd). */
static int layer_fwd(cu *c, const model_layer *ly, const float *P, const float *X, float *Y,
                     uint32_t B, char **errptr)
{
    TRY(gemm_rm(c, false, true, (int)B, (int)ly->out, (int)ly->in, X, (int)ly->in, P + ly->w,
                (int)ly->in, Y, (int)ly->out, errptr));
    LAUNCH(k_bias_act, (size_t)B * ly->out, Y, P + ly->b, ly->out, ly->relu);
    return CM_OK;
}

/* The CPU's layer_bwd: masks dY in place, writes dW, db into dP and dX when non-NULL. */
static int layer_bwd(cu *c, const model_layer *ly, const float *P, const float *X, const float *Y,
                     float *dY, float *dP, float *dX, uint32_t B, char **errptr)
{
    if (ly->relu) LAUNCH(k_relu_mask, (size_t)B * ly->out, dY, Y);
    TRY(gemm_rm(c, true, false, (int)ly->out, (int)ly->in, (int)B, dY, (int)ly->out, X, (int)ly->in,
                dP + ly->w, (int)ly->in, errptr));
    TRY(colsum(c, dY, ly->out, ly->out, B, NULL, dP + ly->b, errptr));
    if (dX != NULL)
        TRY(gemm_rm(c, false, false, (int)B, (int)ly->in, (int)ly->out, dY, (int)ly->out, P + ly->w,
                    (int)ly->in, dX, (int)ly->in, errptr));
    return CM_OK;
}

static int stack_fwd(cu *c, const model_layer *ly, uint32_t n, float *const *act, const float *P,
                     const float *X, uint32_t B, char **errptr)
{
    const float *in = X;
    for (uint32_t i = 0; i < n; i++) {
        TRY(layer_fwd(c, &ly[i], P, in, act[i], B, errptr));
        in = act[i];
    }
    return CM_OK;
}

/* dOut is scratch we own (masked in place); intermediate gradients ping-pong in g1 / g2. */
static int stack_bwd(cu *c, const model_layer *ly, uint32_t n, float *const *act, const float *P,
                     const float *X, float *dOut, float *dP, float *dX, uint32_t B, char **errptr)
{
    float *g = dOut;
    for (uint32_t i = n; i-- > 0;) {
        const float *in = i ? act[i - 1] : X;
        float *dx = i ? (g == c->g1 ? c->g2 : c->g1) : dX;
        TRY(layer_bwd(c, &ly[i], P, in, act[i], g, dP, dx, B, errptr));
        g = dx;
    }
    return CM_OK;
}

/* X = A E at a site (see csr_ref), on the compute stream. */
static int spmm(cu *c, sp_desc *A, const csr_ref *m, int site, const float *E, int64_t d, float *X,
                char **errptr)
{
    if (m->rows == 0 || d == 0) return CM_OK;
    if (m->nnz == 0 || m->cols == 0) {
        CUDA_TRY(cudaMemsetAsync(X, 0, (size_t)m->rows * d * sizeof(float), c->st));
        return CM_OK;
    }
    if (!c->cusparse_pool) {
        LAUNCH(k_pool, (size_t)m->rows * d, (uint32_t)d, m->rp, m->ci, m->v, E, X);
        return CM_OK;
    }
    const float one = 1.0f, zero = 0.0f;
    int rc = spmm_bind(c, A, m, site, E, d, X, errptr);
    cusparseConstDnMatDescr_t Ed = c->dn[site][0].d;
    cusparseDnMatDescr_t Xd = c->dn[site][1].d;
    /* ALG2 is deterministic and tuned for row-major operands; a library that does not offer it
     * for some shape says NOT_SUPPORTED, and we settle for the default from then on. */
    for (int attempt = 0; rc == CM_OK; attempt++) {
        size_t need = 0;
        const char *call = "cusparseSpMM_bufferSize";
        cusparseStatus_t s = cusparseSpMM_bufferSize(c->sparse, CUSPARSE_OPERATION_NON_TRANSPOSE,
                                                     CUSPARSE_OPERATION_NON_TRANSPOSE, &one, A->d,
                                                     Ed, &zero, Xd, CUDA_R_32F, c->alg, &need);
        if (s == CUSPARSE_STATUS_SUCCESS && need > c->spcap) {
            /* Only where create could not size it (spmm_presize): the old one may be in use. */
            rc = ck_cuda(cudaStreamSynchronize(c->st), "cudaStreamSynchronize", errptr);
            if (rc != CM_OK) break;
            if (c->spbuf) cudaFree(c->spbuf);
            c->spbuf = NULL;
            c->spcap = 0;
            size_t cap = align_up(need + need / 2);
            rc = ck_cuda(cudaMalloc(&c->spbuf, cap), "cudaMalloc(SpMM workspace)", errptr);
            if (rc != CM_OK) break;
            c->spcap = cap;
        }
        if (s == CUSPARSE_STATUS_SUCCESS) {
            call = "cusparseSpMM";
            s = cusparseSpMM(c->sparse, CUSPARSE_OPERATION_NON_TRANSPOSE,
                             CUSPARSE_OPERATION_NON_TRANSPOSE, &one, A->d, Ed, &zero, Xd,
                             CUDA_R_32F, c->alg, c->spbuf);
        }
        if (s == CUSPARSE_STATUS_NOT_SUPPORTED && attempt == 0 && c->alg != CUSPARSE_SPMM_ALG_DEFAULT) {
            c->alg = CUSPARSE_SPMM_ALG_DEFAULT;
            continue;
        }
        if (s != CUSPARSE_STATUS_SUCCESS)
            rc = cm_err(errptr, s == CUSPARSE_STATUS_ALLOC_FAILED ? CM_ENOMEM : CM_ERR,
                        "cuda: %s (%s, %lld x %lld, %lld entries, dim %lld): %s", call,
                        spmm_alg_name(c->alg), (long long)m->rows, (long long)m->cols,
                        (long long)m->nnz, (long long)d, cusparseGetErrorString(s));
        break;
    }
    return rc;
}

/*
 * Packs the batch into a slot's pinned upload arena h: params, dense, labels, pulled rows, and
 * the pooling matrix twice (see the note at the top): A^T by a stable counting sort over
 * columns; for k_pool A as staged, for cuSPARSE repeated (row, column) pairs merged and A
 * rebuilt from A^T the same way. Returns the entry count through *nnz_out.
 */
/* The params and rows [from, to) of every table into the slot's host buffer. */
static void pack_rows(const cu *c, const plan *pl, char *h, const float *P, const model_batch *b,
                      uint32_t from, uint32_t to)
{
    if (P != NULL) memcpy(h + pl->params, P, c->l.n_params * sizeof(float));
    for (uint32_t t = 0; t < c->l.n_tables && from < to; t++) {
        const size_t d = c->l.table_dim[t], off = (size_t)from * d * sizeof(float);
        memcpy(h + pl->emb[t] + off, b->emb[t] + (size_t)from * d, (to - from) * d * sizeof(float));
    }
}

/* Everything of b but the params and rows [ready, U) (pack_rows) into the slot's host buffer. */
static int pack(cu *c, const plan *pl, char *h, const model_batch *b, uint32_t ready,
                uint32_t *nnz_out, char **errptr)
{
    const bool canonical = c->cusparse_pool;
    const uint32_t BF = b->B * b->F, U = b->U;
    if (b->D) memcpy(h + pl->dense, b->dense, (size_t)b->B * b->D * sizeof(float));
    if (b->labels) memcpy(h + pl->labels, b->labels, b->B * sizeof(float));
    pack_rows(c, pl, h, NULL, b, 0, ready);
    uint32_t *rp = (uint32_t *)(h + pl->rp), *col = (uint32_t *)(h + pl->col);
    uint32_t *rpt = (uint32_t *)(h + pl->rpt), *colt = (uint32_t *)(h + pl->colt);
    float *val = (float *)(h + pl->val), *valt = (float *)(h + pl->valt);
    const uint32_t base = b->row_ptr[0], raw = b->row_ptr[BF] - base;
    if (!canonical && b->t_ptr != NULL) {
        /* A^T as the staging built it (the same order: columns, then rows ascending), on the
         * trainer's builder thread, off the path from a batch's pull to its step. */
        memcpy(rpt, b->t_ptr, ((size_t)U + 1) * sizeof *rpt);
        memcpy(colt, b->t_row, (size_t)raw * sizeof *colt);
        memcpy(valt, b->t_val, (size_t)raw * sizeof *valt);
    } else {
        /* A^T: count per column, then place entries in row order (stable). */
        memset(rpt, 0, ((size_t)U + 1) * sizeof(uint32_t));
        for (uint32_t r = 0; r < BF; r++)
            for (uint32_t k = b->row_ptr[r]; k < b->row_ptr[r + 1]; k++)
                rpt[b->col[k] + 1]++;
        for (uint32_t u = 0; u < U; u++)
            rpt[u + 1] += rpt[u];
        for (uint32_t r = 0; r < BF; r++)
            for (uint32_t k = b->row_ptr[r]; k < b->row_ptr[r + 1]; k++) {
                uint32_t pos = rpt[b->col[k]]++;
                colt[pos] = r;
                valt[pos] = b->val[k];
            }
        if (!canonical) {
            for (uint32_t u = U; u > 0; u--)
                rpt[u] = rpt[u - 1]; /* back to the starts */
            rpt[0] = 0;
        }
    }
    if (!canonical) {
        for (uint32_t r = 0; r <= BF; r++)
            rp[r] = b->row_ptr[r] - base;
        memcpy(col, b->col + base, (size_t)raw * sizeof *col);
        memcpy(val, b->val + base, (size_t)raw * sizeof *val);
        *nnz_out = raw;
        (void)errptr;
        return CM_OK;
    }
    /* rpt[u] is now the end of column u; merge repeats (adjacent) while compacting. */
    uint32_t out = 0, start = 0;
    for (uint32_t u = 0; u < U; u++) {
        uint32_t end = rpt[u], first = out;
        for (uint32_t p = start; p < end; p++) {
            if (out > first && colt[out - 1] == colt[p]) {
                valt[out - 1] += valt[p];
            } else {
                colt[out] = colt[p];
                valt[out] = valt[p];
                out++;
            }
        }
        rpt[u] = first;
        start = end;
    }
    rpt[U] = out;
    /* A from A^T: columns come out sorted because u ascends. */
    memset(rp, 0, ((size_t)BF + 1) * sizeof(uint32_t));
    for (uint32_t p = 0; p < out; p++) rp[colt[p] + 1]++;
    for (uint32_t r = 0; r < BF; r++) rp[r + 1] += rp[r];
    for (uint32_t u = 0; u < U; u++)
        for (uint32_t p = rpt[u]; p < rpt[u + 1]; p++) {
            uint32_t q = rp[colt[p]]++;
            col[q] = u;
            val[q] = valt[p];
        }
    for (uint32_t r = BF; r > 0; r--) rp[r] = rp[r - 1];
    rp[0] = 0;
    *nnz_out = out;
    (void)errptr;
    return CM_OK;
}

/* The batch's shape against the model and create's bounds. */
static int check_shape(const cu *c, const model_batch *b, char **errptr)
{
    const model_cfg *m = &c->m;
    if (b->B > c->max_b || b->F != m->n_fields || b->D != m->n_dense || b->U > c->max_u)
        return cm_err(errptr, CM_EINVAL,
                      "batch shape (B %u, F %u, D %u, U %u) does not fit the model "
                      "(F %u, D %u, at most %u rows, %u keys)",
                      b->B, b->F, b->D, b->U, m->n_fields, m->n_dense, c->max_b, c->max_u);
    return CM_OK;
}

/* What the packing and cuSPARSE's 32-bit indices rely on. */
static int check_csr(const model_batch *b, char **errptr)
{
    const size_t BF = (size_t)b->B * b->F;
    const uint32_t U = b->U;
    for (size_t r = 0; r < BF; r++)
        if (b->row_ptr[r + 1] < b->row_ptr[r])
            return cm_err(errptr, CM_EINVAL, "cuda: batch CSR row_ptr decreases at row %zu", r);
    const uint32_t raw_nnz = b->row_ptr[BF];
    if (raw_nnz > INT32_MAX || U >= INT32_MAX || BF >= INT32_MAX)
        return cm_err(errptr, CM_EINVAL, "cuda: batch too large for 32-bit sparse indices "
                      "(%u entries, %u keys, %zu rows)", raw_nnz, U, BF);
    for (uint32_t k = b->row_ptr[0]; k < raw_nnz; k++)
        if (b->col[k] >= U)
            return cm_err(errptr, CM_EINVAL, "cuda: batch CSR column %u at %u is not below U %u",
                          b->col[k], k, U);
    return CM_OK;
}

/*
 * Fills slot s with b in two halves: slot_begin packs everything but the params and rows
 * [ready, U), slot_end those and sends the slot to the device on `stream`, recording s->copied.
 * The slot's pinned buffer may still feed its previous copy and its device buffer its previous
 * step: both are waited for (the step has returned by the prefetch contract, so that wait is
 * free; it only guards the contract).
 */
static int slot_begin(cu *c, slot *s, const model_batch *b, uint32_t ready, char **errptr)
{
    s->ticket = 0;
    s->B = s->U = 0; /* not filled until slot_end */
    TRY(check_csr(b, errptr));
    CUDA_TRY(cudaEventSynchronize(s->copied));
    plan_make(c, b->B, b->U, b->row_ptr[(size_t)b->B * b->F], &s->pl);
    if (s->pl.up_bytes > s->up.cap) {
        /* More pooling entries than create sized for (max_u): grow this slot once. */
        CUDA_TRY(cudaEventSynchronize(s->used));
        TRY(mirror_alloc(&s->up, s->pl.up_bytes + s->pl.up_bytes / 2, "batch upload", errptr));
    }
    return pack(c, &s->pl, s->up.h, b, ready, &s->nnz, errptr);
}

static int slot_end(cu *c, slot *s, const float *P, const model_batch *b, uint32_t ready,
                    cudaStream_t stream, char **errptr)
{
    pack_rows(c, &s->pl, s->up.h, P, b, ready, b->U);
    CUDA_TRY(cudaStreamWaitEvent(stream, s->used, 0));
    CUDA_TRY(cudaMemcpyAsync(s->up.d, s->up.h, s->pl.up_bytes, cudaMemcpyHostToDevice, stream));
    CUDA_TRY(cudaEventRecord(s->copied, stream));
    s->B = b->B;
    s->U = b->U;
    s->labels = b->labels != NULL;
    return CM_OK;
}

static int slot_fill(cu *c, slot *s, const float *P, const model_batch *b, cudaStream_t stream,
                     char **errptr)
{
    TRY(slot_begin(c, s, b, 0, errptr));
    return slot_end(c, s, P, b, 0, stream, errptr);
}

/* The slot holding b's inputs: the prefetched one (the compute stream waits for its copy
 * only), or, for ticket 0, slot 0 filled here (dropping what the slots held). */
static int slot_take(cu *c, const float *P, const model_batch *b, slot **out, char **errptr)
{
    if (b->ticket == 0) {
        c->slots[0].ticket = c->slots[1].ticket = 0;
        c->begun.on = false;
        TRY(slot_fill(c, &c->slots[0], P, b, c->st, errptr));
        *out = &c->slots[0];
        return CM_OK;
    }
    slot *s = &c->slots[b->ticket & 1];
    if (s->ticket != b->ticket)
        return cm_err(errptr, CM_EINVAL,
                      "cuda: batch ticket %llu is no longer held (two later "
                      "batches were prefetched, or a step without a ticket ran since)",
                      (unsigned long long)b->ticket);
    if (s->B != b->B || s->U != b->U || s->labels != (b->labels != NULL))
        return cm_err(errptr, CM_EINVAL,
                      "cuda: batch (B %u, U %u%s) is not the one prefetched as "
                      "ticket %llu (B %u, U %u%s)",
                      b->B, b->U, b->labels ? "" : ", no labels", (unsigned long long)b->ticket,
                      s->B, s->U, s->labels ? "" : ", no labels");
    CUDA_TRY(cudaStreamWaitEvent(c->st, s->copied, 0));
    *out = s;
    return CM_OK;
}

/* The whole step on a filled slot: forward (+ backward when dP and labels), download. */
static int step_impl(cu *c, const slot *s, const model_batch *b, float *probs, double *loss,
                     float *dP, float *const *demb, char **errptr)
{
    const model_cfg *m = &c->m;
    const model_layout *l = &c->l;
    const uint32_t B = b->B, F = m->n_fields, D = m->n_dense, d = m->dim, U = b->U;
    const bool bwd = dP != NULL && b->labels != NULL;
    const size_t f4 = sizeof(float), BF = (size_t)B * F;
    const plan *pl = &s->pl;
    if (pl->down_bytes > c->down.cap) /* create sized it for max_b and max_u */
        return cm_err(errptr, CM_ERR, "cuda: result download of %zu bytes exceeds its %zu",
                      pl->down_bytes, c->down.cap);

    const char *du = s->up.d;
    char *dd = c->down.d;
    const float *dP_in = (const float *)(du + pl->params);
    const csr_ref A = {(int64_t)BF,
                       U,
                       s->nnz,
                       (const int32_t *)(du + pl->rp),
                       (const int32_t *)(du + pl->col),
                       (const float *)(du + pl->val)};
    const csr_ref At = {U,
                        (int64_t)BF,
                        s->nnz,
                        (const int32_t *)(du + pl->rpt),
                        (const int32_t *)(du + pl->colt),
                        (const float *)(du + pl->valt)};
    const float *dense = (const float *)(du + pl->dense);
    const float *labels = b->labels ? (const float *)(du + pl->labels) : NULL;
    float *d_probs = (float *)(dd + pl->probs), *d_dP = (float *)(dd + pl->dparams);
    double *d_loss = (double *)(dd + pl->loss);

    /* Forward. */
    if (l->emb_table >= 0)
        TRY(spmm(c, &c->a, &A, SP_FWD_EMB, (const float *)(du + pl->emb[l->emb_table]), d, c->xe,
                 errptr));
    if (l->lin_table >= 0)
        TRY(spmm(c, &c->a, &A, SP_FWD_LIN, (const float *)(du + pl->emb[l->lin_table]), 1, c->xl,
                 errptr));
    if (m->kind == MODEL_DEEPFM) LAUNCH(k_fm_fwd, (size_t)B * d, c->xe, c->fmterm, F, d);
    const float *z0 = NULL;
    if (l->n_top > 0) {
        uint32_t ti = l->top_in;
        if (m->kind == MODEL_DLRM) {
            TRY(stack_fwd(c, l->bot, l->n_bot, c->bact, dP_in, dense, B, errptr));
            z0 = c->bact[l->n_bot - 1];
            LAUNCH(k_dlrm_fwd, (size_t)B * ti, c->in, z0, c->xe, c->pairs, F, d, ti);
        } else {
            LAUNCH(k_concat, (size_t)B * ti, c->in, c->xe, dense, F * d, D, ti);
        }
        TRY(stack_fwd(c, l->top, l->n_top, c->act, dP_in, c->in, B, errptr));
    }
    head_args h;
    memset(&h, 0, sizeof h);
    h.B = B;
    h.F = F;
    h.D = D;
    h.d = d;
    h.xl = l->lin_table >= 0 ? c->xl : NULL;
    h.dense = dense;
    h.P = dP_in;
    h.lin_w = l->lin_w;
    h.lin_c = l->lin_c;
    h.fmterm = m->kind == MODEL_DEEPFM ? c->fmterm : NULL;
    h.top = l->n_top > 0 ? c->act[l->n_top - 1] : NULL;
    h.labels = labels;
    h.probs = d_probs;
    h.lterm = c->lterm;
    h.dlogit = c->dlogit;
    LAUNCH(k_head, B, h);
    if (labels) {
        k_loss<<<1, LOSS_THREADS, 0, c->st>>>(c->lterm, B, d_loss);
        CUDA_TRY_LAUNCH("k_loss");
    } else {
        CUDA_TRY(cudaMemsetAsync(d_loss, 0, sizeof(double), c->st));
    }

    /* Backward (the CPU's order: first-order, FM, top stack, interaction, bottom stack). */
    if (bwd) {
        float *g = c->dlogit;
        CUDA_TRY(cudaMemsetAsync(d_dP, 0, l->n_params * f4, c->st)); /* as the CPU; all rewritten */
        if (l->lin_table >= 0) {
            LAUNCH(k_lin_bwd, BF, c->dxl, g, F);
            TRY(colsum(c, dense, D, D, B, g, d_dP + l->lin_w, errptr));
            TRY(colsum(c, g, 1, 1, B, NULL, d_dP + l->lin_c, errptr));
            TRY(spmm(c, &c->at, &At, SP_BWD_LIN, c->dxl, 1, (float *)(dd + pl->demb[l->lin_table]),
                     errptr));
        }
        if (l->n_top > 0) {
            uint32_t ti = l->top_in;
            TRY(stack_bwd(c, l->top, l->n_top, c->act, dP_in, c->in, g, d_dP, c->din, B, errptr));
            if (m->kind == MODEL_DLRM) {
                LAUNCH(k_dlrm_bwd, (size_t)B * (F + 1) * d, c->din, z0, c->xe, c->dz0, c->dxe, F, d, ti);
                TRY(stack_bwd(c, l->bot, l->n_bot, c->bact, dP_in, dense, c->dz0, d_dP, NULL, B, errptr));
            } else {
                LAUNCH(k_emb_bwd, (size_t)B * d, c->xe, c->din, g, c->dxe, F, d, ti,
                       m->kind == MODEL_DEEPFM);
            }
        }
        if (l->emb_table >= 0)
            TRY(spmm(c, &c->at, &At, SP_BWD_EMB, c->dxe, d, (float *)(dd + pl->demb[l->emb_table]),
                     errptr));
    }
    size_t down = bwd ? pl->down_bytes : pl->down_fwd_bytes;
    CUDA_TRY(cudaMemcpyAsync(c->down.h, c->down.d, down, cudaMemcpyDeviceToHost, c->st));
    CUDA_TRY(cudaStreamSynchronize(c->st));

    const char *hd = c->down.h;
    memcpy(probs, hd + pl->probs, B * f4);
    if (loss) memcpy(loss, hd + pl->loss, sizeof(double));
    if (bwd) {
        memcpy(dP, hd + pl->dparams, l->n_params * f4);
        for (uint32_t t = 0; t < l->n_tables; t++)
            if (U) memcpy(demb[t], hd + pl->demb[t], (size_t)U * l->table_dim[t] * f4);
        /* Last: one copy brings the row and dense gradients back together. */
        if (b->emb_ready) b->emb_ready(b->emb_ready_arg);
    }
    return CM_OK;
}

static int cuda_prefetch_begin(void *state, const model_batch *b, uint32_t ready, char **errptr)
{
    cu *c = (cu *)state;
    c->begun.on = false;
    TRY(check_shape(c, b, errptr));
    if (ready > b->U)
        return cm_err(errptr, CM_EINVAL, "cuda: %u rows ready of a batch of %u keys", ready, b->U);
    if (b->B == 0) return CM_OK; /* prefetch_end has nothing to move either */
    CUDA_TRY(cudaSetDevice(c->dev));
    uint64_t t = c->n_tickets + 1;
    TRY(slot_begin(c, &c->slots[t & 1], b, ready, errptr));
    c->begun.on = true;
    c->begun.t = t;
    c->begun.ready = ready;
    c->begun.B = b->B;
    c->begun.U = b->U;
    return CM_OK;
}

static int cuda_prefetch_end(void *state, const float *P, const model_batch *b, uint64_t *ticket,
                             char **errptr)
{
    cu *c = (cu *)state;
    *ticket = 0;
    if (b->B == 0) return CM_OK;
    if (!c->begun.on || c->begun.B != b->B || c->begun.U != b->U)
        return cm_err(errptr, CM_EINVAL,
                      "cuda: prefetch_end of a batch (B %u, U %u) whose prefetch_begin was not "
                      "the last prefetch call",
                      b->B, b->U);
    c->begun.on = false;
    CUDA_TRY(cudaSetDevice(c->dev));
    const uint64_t t = c->begun.t;
    slot *s = &c->slots[t & 1];
    TRY(slot_end(c, s, P, b, c->begun.ready, c->cp, errptr));
    c->n_tickets = t;
    s->ticket = t;
    *ticket = t;
    return CM_OK;
}

/* One call: the two halves back to back. Tickets alternate between the slots, so a step
 * finds its slot from the ticket alone and never reads the slot a concurrent prefetch is
 * filling. */
static int cuda_prefetch(void *state, const float *P, const model_batch *b, uint64_t *ticket,
                         char **errptr)
{
    *ticket = 0;
    TRY(cuda_prefetch_begin(state, b, 0, errptr));
    return cuda_prefetch_end(state, P, b, ticket, errptr);
}

static int cuda_step(void *state, const float *P, const model_batch *b, float *probs, double *loss,
                     float *dP, float *const *demb, char **errptr)
{
    cu *c = (cu *)state;
    const model_layout *l = &c->l;
    TRY(check_shape(c, b, errptr));
    if (b->B == 0) { /* nothing to launch; the CPU's answer */
        if (loss) *loss = 0.0;
        if (dP == NULL) return CM_OK;
        memset(dP, 0, l->n_params * sizeof(float));
        if (b->labels == NULL) return cm_err(errptr, CM_EINVAL, "backward pass needs labels");
        for (uint32_t t = 0; t < l->n_tables; t++)
            if (b->U) memset(demb[t], 0, (size_t)b->U * l->table_dim[t] * sizeof(float));
        if (b->emb_ready) b->emb_ready(b->emb_ready_arg);
        return CM_OK;
    }
    CUDA_TRY(cudaSetDevice(c->dev));
    slot *s = NULL;
    int rc = slot_take(c, P, b, &s, errptr);
    if (rc == CM_OK) rc = step_impl(c, s, b, probs, loss, dP, demb, errptr);
    /* The next fill of this slot waits for this (the copy stream, on the device). */
    if (s != NULL && rc == CM_OK)
        rc = ck_cuda(cudaEventRecord(s->used, c->st), "cudaEventRecord", errptr);
    if (rc != CM_OK) {
        /* Let nothing still in flight touch the buffers the next step rewrites. */
        cudaStreamSynchronize(c->st);
        return rc;
    }
    if (dP != NULL && b->labels == NULL) {
        memset(dP, 0, l->n_params * sizeof(float)); /* as the CPU leaves it */
        return cm_err(errptr, CM_EINVAL, "backward pass needs labels");
    }
    return CM_OK;
}

/* k_pool's A^T is the staging's columns, which pack copies instead of building them on the
 * path from a batch's pull to its step; cuSPARSE's must be canonical (repeats merged), which
 * pack builds itself, so then the staging's would go unread. */
static bool cuda_columns(const void *state)
{
    return !((const cu *)state)->cusparse_pool;
}

static const backend_ops cuda_ops = {
    "cuda", cuda_create,  cuda_destroy, cuda_prefetch,       cuda_step,
    NULL,   cuda_columns, NULL,         cuda_prefetch_begin, cuda_prefetch_end};

extern "C" const backend_ops *const backend_cuda_module_ops = &cuda_ops;
