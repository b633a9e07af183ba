/*
 * The CUDA backend: the same contract and the same math as backend_cpu.c, on one GPU.
 *
 * Design notes (why, not what):
 *
 * - The step API is synchronous and hands us pageable host arrays, so a step is one upload,
 *   one stream of work and one download. Inputs are packed into one pinned staging arena and
 *   sent with a single cudaMemcpyAsync (and the outputs come back the same way): per-copy
 *   latency, not bandwidth, dominates at CTR batch sizes. Pinned memory, device arenas and the
 *   cuSPARSE workspace grow on demand and are kept, so the steady state allocates nothing;
 *   max_uniq is only a validation bound (the trainer passes a generous one), not a size.
 *
 * - cuSPARSE assumes canonical CSR (no repeated (row, column) pair; sorted columns) while a
 *   staged batch may repeat a key inside a field. The host therefore builds the transpose A^T
 *   by a stable counting sort (which puts repeats side by side, so they merge), and A back
 *   from A^T the same way: two linear passes, no comparisons, and both matrices come out
 *   canonical. Having A^T explicitly also lets the backward pass be a non-transposed SpMM:
 *   cuSPARSE's transposed SpMM is documented as run-to-run nondeterministic (atomics), and the
 *   CPU backend's promise that results do not depend on timing is worth keeping on the GPU.
 *   A^T's rows list samples in increasing order, the order the CPU accumulates dE in.
 *
 * - Row-major everywhere, as the CPU backend: a row-major M x N matrix is a column-major
 *   N x M one, so every GEMM is issued transposed (Y = X W^T is Y^T = W X^T for cuBLAS) and
 *   the pooled X (B*F x dim) is the B x F*dim concatenation without any reshuffle.
 *
 * - The small kernels mirror the CPU loops' summation order (one thread owns one output and
 *   walks the same index sequence), and the file is built with --fmad=false so those loops
 *   round like the CPU's. Only cuBLAS / cuSPARSE reassociate sums; the parity test's 1e-5
 *   relative budget is for them. TF32 would not fit that budget, so it is opt-in
 *   (EMBER_CUDA_TF32=1). Reductions (bias gradients, the loss) use fixed trees, never
 *   atomics, and each cuBLAS handle gets its own workspace, so a step is bit-reproducible.
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

typedef struct cu {
    model_cfg m;
    model_layout l;
    uint32_t max_b, max_u, widest;
    int dev;
    cudaStream_t st;
    cublasHandle_t blas;
    cusparseHandle_t sparse;
    cusparseSpMMAlg_t alg;
    /* Work buffers, one device allocation sized by max_b at create. */
    char *work;
    void *blas_ws;
    float *xe, *dxe, *xl, *dxl, *in, *din, *act[MODEL_MAX_LAYERS + 1], *bact[MODEL_MAX_LAYERS];
    float *g1, *g2, *fmterm, *dz0, *lterm, *dlogit;
    uint32_t *pairs;
    /* Grown on demand: the batch upload, the results download, the SpMM workspace. */
    mirror up, down;
    void *spbuf;
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

extern "C" int backend_cuda_probe(char **errptr);

/* 0 when at least one device is usable; the error names why not. */
int backend_cuda_probe(char **errptr)
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

static void mirror_free(mirror *mr)
{
    if (mr->h) cudaFreeHost(mr->h);
    if (mr->d) cudaFree(mr->d);
    memset(mr, 0, sizeof *mr);
}

/* Ensures cap >= need; the stream must be idle (the old buffers may be in flight otherwise). */
static int mirror_reserve(cu *c, mirror *mr, size_t need, const char *what, char **errptr)
{
    if (need <= mr->cap) return CM_OK;
    CUDA_TRY(cudaStreamSynchronize(c->st));
    mirror_free(mr);
    size_t cap = align_up(need + need / 2);
    const char *call = "cudaHostAlloc";
    cudaError_t e = cudaHostAlloc((void **)&mr->h, cap, cudaHostAllocDefault);
    if (e == cudaSuccess) {
        call = "cudaMalloc";
        e = cudaMalloc((void **)&mr->d, cap);
    }
    if (e != cudaSuccess) {
        mirror_free(mr);
        return cm_err(errptr, e == cudaErrorMemoryAllocation ? CM_ENOMEM : CM_ERR,
                      "cuda: %s of %zu bytes for the %s: %s", call, cap, what, cudaGetErrorString(e));
    }
    mr->cap = cap;
    return CM_OK;
}

static void cuda_destroy(void *state)
{
    cu *c = (cu *)state;
    if (c == NULL) return;
    cudaSetDevice(c->dev);
    if (c->st) cudaStreamSynchronize(c->st);
    if (c->sparse) cusparseDestroy(c->sparse);
    if (c->blas) cublasDestroy(c->blas);
    mirror_free(&c->up);
    mirror_free(&c->down);
    if (c->spbuf) cudaFree(c->spbuf);
    if (c->work) cudaFree(c->work);
    if (c->st) cudaStreamDestroy(c->st);
    free(c);
}

static int create_impl(cu *c, const model_cfg *m, const model_layout *l, uint32_t max_b,
                       uint32_t max_u, char **errptr)
{
    TRY(backend_cuda_probe(errptr));
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
    c->alg = CUSPARSE_SPMM_CSR_ALG2; /* deterministic, tuned for row-major dense operands */
    CUDA_TRY(cudaStreamCreateWithFlags(&c->st, cudaStreamNonBlocking));
    BLAS_TRY(cublasCreate(&c->blas));
    BLAS_TRY(cublasSetStream(c->blas, c->st));
    const char *tf32 = getenv("EMBER_CUDA_TF32");
    BLAS_TRY(cublasSetMathMode(c->blas, tf32 && tf32[0] == '1' ? CUBLAS_TF32_TENSOR_OP_MATH
                                                                : CUBLAS_DEFAULT_MATH));
    TRY(ck_sparse(cusparseCreate(&c->sparse), "cusparseCreate", errptr));
    TRY(ck_sparse(cusparseSetStream(c->sparse, c->st), "cusparseSetStream", errptr));

    size_t B = max_b, F = m->n_fields, d = m->dim, ti = l->top_in;
    uint32_t widest = 1;
    for (uint32_t i = 0; i < l->n_top; i++) widest = l->top[i].out > widest ? l->top[i].out : widest;
    for (uint32_t i = 0; i < l->n_bot; i++) widest = l->bot[i].out > widest ? l->bot[i].out : widest;
    c->widest = widest;
    const size_t f4 = sizeof(float);
    size_t at = 0, o_ws = carve(&at, CUBLAS_WS_BYTES), o_xe = 0, o_dxe = 0, o_xl = 0, o_dxl = 0,
           o_in = 0, o_din = 0, o_act[MODEL_MAX_LAYERS + 1] = {0}, o_bact[MODEL_MAX_LAYERS] = {0},
           o_fm = 0, o_dz0 = 0, o_pairs = 0;
    if (l->emb_table >= 0) {
        o_xe = carve(&at, B * F * d * f4);
        o_dxe = carve(&at, B * F * d * f4);
    }
    if (l->lin_table >= 0) {
        o_xl = carve(&at, B * F * f4);
        o_dxl = carve(&at, B * F * f4);
    }
    if (l->n_top > 0) {
        o_in = carve(&at, B * ti * f4);
        o_din = carve(&at, B * ti * f4);
    }
    for (uint32_t i = 0; i < l->n_top; i++) o_act[i] = carve(&at, B * l->top[i].out * f4);
    for (uint32_t i = 0; i < l->n_bot; i++) o_bact[i] = carve(&at, B * l->bot[i].out * f4);
    size_t o_g1 = carve(&at, B * widest * f4), o_g2 = carve(&at, B * widest * f4);
    if (m->kind == MODEL_DEEPFM) o_fm = carve(&at, B * d * f4);
    if (m->kind == MODEL_DLRM) {
        o_dz0 = carve(&at, B * d * f4);
        o_pairs = carve(&at, (size_t)l->inter * 2 * sizeof(uint32_t));
    }
    size_t o_lterm = carve(&at, B * f4), o_dlogit = carve(&at, B * f4);
    cudaError_t e = cudaMalloc((void **)&c->work, at);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        size_t fr = 0, tot = 0;
        cudaMemGetInfo(&fr, &tot);
        return cm_err(errptr, CM_ENOMEM, "cuda: not enough device memory for batches of %u: "
                      "cudaMalloc of %zu bytes: %s (%zu of %zu bytes free)", max_b, at,
                      cudaGetErrorString(e), fr, tot);
    }
    char *w = c->work;
#define AT(o) ((float *)(w + (o)))
    c->blas_ws = w + o_ws;
    if (l->emb_table >= 0) c->xe = AT(o_xe), c->dxe = AT(o_dxe);
    if (l->lin_table >= 0) c->xl = AT(o_xl), c->dxl = AT(o_dxl);
    if (l->n_top > 0) c->in = AT(o_in), c->din = AT(o_din);
    for (uint32_t i = 0; i < l->n_top; i++) c->act[i] = AT(o_act[i]);
    for (uint32_t i = 0; i < l->n_bot; i++) c->bact[i] = AT(o_bact[i]);
    c->g1 = AT(o_g1);
    c->g2 = AT(o_g2);
    if (m->kind == MODEL_DEEPFM) c->fmterm = AT(o_fm);
    if (m->kind == MODEL_DLRM) c->dz0 = AT(o_dz0), c->pairs = (uint32_t *)(w + o_pairs);
    c->lterm = AT(o_lterm);
    c->dlogit = AT(o_dlogit);
#undef AT
    BLAS_TRY(cublasSetWorkspace(c->blas, c->blas_ws, CUBLAS_WS_BYTES));
    if (m->kind == MODEL_DLRM && l->inter > 0) {
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
                       uint32_t threads, void **state, char **errptr)
{
    (void)threads; /* the GPU needs no host compute threads */
    cu *c = (cu *)calloc(1, sizeof *c);
    if (c == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    int rc = create_impl(c, m, l, max_b, max_u, errptr);
    if (rc != CM_OK) {
        if (c->st || c->work || c->blas || c->sparse) cuda_destroy(c);
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

/* X (rows x d, row-major) = A E for a canonical CSR A (rows x cols) and E (cols x d). */
static int spmm(cu *c, int64_t rows, int64_t cols, int64_t nnz, const int32_t *rp, const int32_t *ci,
                const float *v, const float *E, int64_t d, float *X, char **errptr)
{
    if (rows == 0 || d == 0) return CM_OK;
    if (nnz == 0 || cols == 0) {
        CUDA_TRY(cudaMemsetAsync(X, 0, (size_t)rows * d * sizeof(float), c->st));
        return CM_OK;
    }
    const float one = 1.0f, zero = 0.0f;
    cusparseConstSpMatDescr_t A = NULL;
    cusparseConstDnMatDescr_t Ed = NULL;
    cusparseDnMatDescr_t Xd = NULL;
    int rc = ck_sparse(cusparseCreateConstCsr(&A, rows, cols, nnz, rp, ci, v, CUSPARSE_INDEX_32I,
                                              CUSPARSE_INDEX_32I, CUSPARSE_INDEX_BASE_ZERO, CUDA_R_32F),
                       "cusparseCreateConstCsr", errptr);
    if (rc == CM_OK)
        rc = ck_sparse(cusparseCreateConstDnMat(&Ed, cols, d, d, E, CUDA_R_32F, CUSPARSE_ORDER_ROW),
                       "cusparseCreateConstDnMat", errptr);
    if (rc == CM_OK)
        rc = ck_sparse(cusparseCreateDnMat(&Xd, rows, d, d, X, CUDA_R_32F, CUSPARSE_ORDER_ROW),
                       "cusparseCreateDnMat", errptr);
    /* ALG2 is deterministic and tuned for row-major operands; a library that does not offer it
     * for some shape says NOT_SUPPORTED, and we settle for the default from then on. */
    for (int attempt = 0; rc == CM_OK; attempt++) {
        size_t need = 0;
        const char *call = "cusparseSpMM_bufferSize";
        cusparseStatus_t s = cusparseSpMM_bufferSize(c->sparse, CUSPARSE_OPERATION_NON_TRANSPOSE,
                                                     CUSPARSE_OPERATION_NON_TRANSPOSE, &one, A, Ed,
                                                     &zero, Xd, CUDA_R_32F, c->alg, &need);
        if (s == CUSPARSE_STATUS_SUCCESS && need > c->spcap) {
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
            s = cusparseSpMM(c->sparse, CUSPARSE_OPERATION_NON_TRANSPOSE, CUSPARSE_OPERATION_NON_TRANSPOSE,
                             &one, A, Ed, &zero, Xd, CUDA_R_32F, c->alg, c->spbuf);
        }
        if (s == CUSPARSE_STATUS_NOT_SUPPORTED && attempt == 0 && c->alg != CUSPARSE_SPMM_ALG_DEFAULT) {
            c->alg = CUSPARSE_SPMM_ALG_DEFAULT;
            continue;
        }
        if (s != CUSPARSE_STATUS_SUCCESS)
            rc = cm_err(errptr, s == CUSPARSE_STATUS_ALLOC_FAILED ? CM_ENOMEM : CM_ERR,
                        "cuda: %s (%s, %lld x %lld, %lld entries, dim %lld): %s", call,
                        c->alg == CUSPARSE_SPMM_CSR_ALG2 ? "CSR_ALG2" : "ALG_DEFAULT", (long long)rows,
                        (long long)cols, (long long)nnz, (long long)d, cusparseGetErrorString(s));
        break;
    }
    if (Xd) cusparseDestroyDnMat(Xd);
    if (Ed) cusparseDestroyDnMat(Ed);
    if (A) cusparseDestroySpMat(A);
    return rc;
}

/* Offsets of one step's upload and download in the mirrors. */
typedef struct plan {
    size_t params, rp, col, val, rpt, colt, valt, dense, labels, emb[MODEL_MAX_TABLES], up_bytes;
    size_t probs, loss, dparams, demb[MODEL_MAX_TABLES], down_bytes, down_fwd_bytes;
} plan;

/*
 * Packs the batch into the pinned upload arena: params, dense, labels, pulled rows, and the
 * pooling matrix twice in canonical CSR (see the note at the top): A^T by a stable counting
 * sort over columns with repeated (row, column) pairs merged, then A from A^T the same way.
 * Returns the canonical nnz through *nnz_out.
 */
static int pack(cu *c, const plan *pl, const float *P, const model_batch *b, uint32_t *nnz_out,
                char **errptr)
{
    char *h = c->up.h;
    const uint32_t BF = b->B * b->F, U = b->U;
    memcpy(h + pl->params, P, c->l.n_params * sizeof(float));
    if (b->D) memcpy(h + pl->dense, b->dense, (size_t)b->B * b->D * sizeof(float));
    if (b->labels) memcpy(h + pl->labels, b->labels, b->B * sizeof(float));
    for (uint32_t t = 0; t < c->l.n_tables; t++)
        if (U) memcpy(h + pl->emb[t], b->emb[t], (size_t)U * c->l.table_dim[t] * sizeof(float));
    uint32_t *rp = (uint32_t *)(h + pl->rp), *col = (uint32_t *)(h + pl->col);
    uint32_t *rpt = (uint32_t *)(h + pl->rpt), *colt = (uint32_t *)(h + pl->colt);
    float *val = (float *)(h + pl->val), *valt = (float *)(h + pl->valt);
    /* A^T: count per column, then place entries in row order (stable). */
    memset(rpt, 0, ((size_t)U + 1) * sizeof(uint32_t));
    for (uint32_t r = 0; r < BF; r++)
        for (uint32_t k = b->row_ptr[r]; k < b->row_ptr[r + 1]; k++) rpt[b->col[k] + 1]++;
    for (uint32_t u = 0; u < U; u++) rpt[u + 1] += rpt[u];
    for (uint32_t r = 0; r < BF; r++)
        for (uint32_t k = b->row_ptr[r]; k < b->row_ptr[r + 1]; k++) {
            uint32_t pos = rpt[b->col[k]]++;
            colt[pos] = r;
            valt[pos] = b->val[k];
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

/* The whole step: pack, upload, forward (+ backward when dP and labels), download. */
static int step_impl(cu *c, const float *P, const model_batch *b, float *probs, double *loss,
                     float *dP, float *const *demb, char **errptr)
{
    const model_cfg *m = &c->m;
    const model_layout *l = &c->l;
    const uint32_t B = b->B, F = m->n_fields, D = m->n_dense, d = m->dim, U = b->U;
    const bool bwd = dP != NULL && b->labels != NULL;
    const size_t f4 = sizeof(float), BF = (size_t)B * F;
    CUDA_TRY(cudaSetDevice(c->dev));

    /* Validate what the packing and cuSPARSE's 32-bit indices rely on. */
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

    /* Layout of this step's transfers. */
    plan pl;
    memset(&pl, 0, sizeof pl);
    size_t at = 0;
    pl.params = carve(&at, l->n_params * f4);
    pl.rp = carve(&at, (BF + 1) * sizeof(uint32_t));
    pl.col = carve(&at, (size_t)raw_nnz * sizeof(uint32_t));
    pl.val = carve(&at, (size_t)raw_nnz * f4);
    pl.rpt = carve(&at, ((size_t)U + 1) * sizeof(uint32_t));
    pl.colt = carve(&at, (size_t)raw_nnz * sizeof(uint32_t));
    pl.valt = carve(&at, (size_t)raw_nnz * f4);
    pl.dense = carve(&at, (size_t)B * D * f4);
    pl.labels = carve(&at, B * f4);
    for (uint32_t t = 0; t < l->n_tables; t++) pl.emb[t] = carve(&at, (size_t)U * l->table_dim[t] * f4);
    pl.up_bytes = at;
    at = 0;
    pl.probs = carve(&at, B * f4);
    pl.loss = carve(&at, sizeof(double));
    pl.down_fwd_bytes = at;
    pl.dparams = carve(&at, l->n_params * f4);
    for (uint32_t t = 0; t < l->n_tables; t++) pl.demb[t] = carve(&at, (size_t)U * l->table_dim[t] * f4);
    pl.down_bytes = at;
    TRY(mirror_reserve(c, &c->up, pl.up_bytes, "batch upload", errptr));
    TRY(mirror_reserve(c, &c->down, pl.down_bytes, "result download", errptr));

    uint32_t nnz = 0;
    TRY(pack(c, &pl, P, b, &nnz, errptr));
    CUDA_TRY(cudaMemcpyAsync(c->up.d, c->up.h, pl.up_bytes, cudaMemcpyHostToDevice, c->st));

    char *du = c->up.d, *dd = c->down.d;
    const float *dP_in = (const float *)(du + pl.params);
    const int32_t *rp = (const int32_t *)(du + pl.rp), *col = (const int32_t *)(du + pl.col);
    const int32_t *rpt = (const int32_t *)(du + pl.rpt), *colt = (const int32_t *)(du + pl.colt);
    const float *val = (const float *)(du + pl.val), *valt = (const float *)(du + pl.valt);
    const float *dense = (const float *)(du + pl.dense);
    const float *labels = b->labels ? (const float *)(du + pl.labels) : NULL;
    float *d_probs = (float *)(dd + pl.probs), *d_dP = (float *)(dd + pl.dparams);
    double *d_loss = (double *)(dd + pl.loss);

    /* Forward. */
    if (l->emb_table >= 0)
        TRY(spmm(c, (int64_t)BF, U, nnz, rp, col, val, (const float *)(du + pl.emb[l->emb_table]), d,
                 c->xe, errptr));
    if (l->lin_table >= 0)
        TRY(spmm(c, (int64_t)BF, U, nnz, rp, col, val, (const float *)(du + pl.emb[l->lin_table]), 1,
                 c->xl, errptr));
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
            TRY(spmm(c, U, (int64_t)BF, nnz, rpt, colt, valt, c->dxl, 1,
                     (float *)(dd + pl.demb[l->lin_table]), errptr));
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
            TRY(spmm(c, U, (int64_t)BF, nnz, rpt, colt, valt, c->dxe, d,
                     (float *)(dd + pl.demb[l->emb_table]), errptr));
    }
    size_t down = bwd ? pl.down_bytes : pl.down_fwd_bytes;
    CUDA_TRY(cudaMemcpyAsync(c->down.h, c->down.d, down, cudaMemcpyDeviceToHost, c->st));
    CUDA_TRY(cudaStreamSynchronize(c->st));

    const char *hd = c->down.h;
    memcpy(probs, hd + pl.probs, B * f4);
    if (loss) memcpy(loss, hd + pl.loss, sizeof(double));
    if (bwd) {
        memcpy(dP, hd + pl.dparams, l->n_params * f4);
        for (uint32_t t = 0; t < l->n_tables; t++)
            if (U) memcpy(demb[t], hd + pl.demb[t], (size_t)U * l->table_dim[t] * f4);
    }
    return CM_OK;
}

static int cuda_step(void *state, const float *P, const model_batch *b, float *probs, double *loss,
                     float *dP, float *const *demb, char **errptr)
{
    cu *c = (cu *)state;
    const model_cfg *m = &c->m;
    const model_layout *l = &c->l;
    const uint32_t B = b->B, F = m->n_fields, D = m->n_dense;
    if (B > c->max_b || b->F != F || b->D != D || b->U > c->max_u)
        return cm_err(errptr, CM_EINVAL, "batch shape (B %u, F %u, D %u, U %u) does not fit the model "
                      "(F %u, D %u, at most %u rows, %u keys)", B, b->F, b->D, b->U, F, D, c->max_b,
                      c->max_u);
    if (B == 0) { /* nothing to launch; the CPU's answer */
        if (loss) *loss = 0.0;
        if (dP == NULL) return CM_OK;
        memset(dP, 0, l->n_params * sizeof(float));
        if (b->labels == NULL) return cm_err(errptr, CM_EINVAL, "backward pass needs labels");
        for (uint32_t t = 0; t < l->n_tables; t++)
            if (b->U) memset(demb[t], 0, (size_t)b->U * l->table_dim[t] * sizeof(float));
        return CM_OK;
    }
    int rc = step_impl(c, P, b, probs, loss, dP, demb, errptr);
    if (rc != CM_OK) {
        /* Let nothing still in flight touch the staging buffers the next step rewrites. */
        cudaStreamSynchronize(c->st);
        return rc;
    }
    if (dP != NULL && b->labels == NULL) {
        memset(dP, 0, l->n_params * sizeof(float)); /* as the CPU leaves it */
        return cm_err(errptr, CM_EINVAL, "backward pass needs labels");
    }
    return CM_OK;
}

static const backend_ops cuda_ops = {"cuda", cuda_create, cuda_destroy, cuda_step};

extern "C" const backend_ops *const backend_cuda_ops = &cuda_ops;
