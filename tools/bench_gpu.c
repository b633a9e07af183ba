/*
 * bench gpu: issue #6's benchmark on a CUDA host. In one run:
 *
 * - ember: `ember train --device cuda` of each model of --models (default mlp,dlrm) through the
 *   full PS path (embedded PS, 1 worker, 1 shard, batch 2048, Adagrad lr 0.05 embeddings, Adam
 *   lr 0.001 tower, one epoch in file order) on the data set tools/bench train uses (`ember gen`
 *   rows, cached; shared code in tools/train_bench.c). samples/s is the training loop's
 *   (metrics.jsonl's last line), as in bench train.
 * - PyTorch: tools/bench_train.py --device cuda, the same mlp (nn.Embedding + Linear) with its
 *   embeddings on the GPU, from ember's initial weights, on the same rows.
 * - the pooling SpMM (cusparseSpMM, CSR_ALG2, as src/backend_cuda.cu issues it under
 *   EMBER_CUDA_SPMM_ALG=csr_alg2; by default it pools with its own bit-reproducible k_pool) on a
 * real batch of the data (model_staging_build: the first 2048 training rows) against the device's
 * measured copy bandwidth (device-to-device cudaMemcpy, counted as bytes read + bytes written, as
 *   NVIDIA's bandwidthTest does). The SpMM's effective bytes are each operand once: A's CSR
 *   arrays, the pulled rows E (U x dim), the pooled X (B*F x dim). At dim 16 a batch's operands
 *   fit in the L2 cache, so that figure can pass the copy bandwidth; larger dims show the DRAM
 *   side.
 * - a table larger than the GPU: `ember train --device cuda --model mlp --dim D` on --big-rows
 *   generated rows. ember keeps its embeddings on the PS (host memory, RocksDB past
 *   --big-memory), so the table is keys x emb_row_mem_bytes (Adagrad) regardless of the GPU;
 *   --big-dim auto picks the smallest dim (multiple of 16, at most 1024) that makes it 1.25x the
 *   GPU's memory (10x the memory --big-gpu-free leaves the run), or 1024. Without
 *   --big-gpu-free PyTorch is not run there: it keeps nn.Embedding and its Adagrad state on the
 *   GPU, so a table past the GPU's memory cannot be trained by the same script (the JSON says
 *   which case it was).
 *
 * - --layouts (default 2x2): the mlp again with W worker threads and S embedded PS shards
 *   sharing the GPU, each worker on its own part of the data, asynchronous (the default
 *   staleness). The goal (1.5x PyTorch's samples/s at equal AUC, i.e. at least PyTorch's AUC -
 *   0.001) is judged on the fastest mlp run that keeps the AUC, one worker or a layout; the JSON
 *   keeps the one-worker figures under their old names (ember_samples_per_s, speedup).
 *
 * - --big-gpu-free BYTES: the big run on a smaller GPU, made by this process holding all of the
 *   device's free memory but BYTES (a ballast cudaMalloc) while the run goes on: a GPU whose
 *   memory a lent host's RAM and disk could hold ten times over. Then PyTorch's side is tried
 *   for real (an nn.Embedding of the table and its Adagrad state on cuda, in that memory) and
 *   the JSON says whether it ran out of memory. Either way, the run's peak device memory is
 *   sampled (the device's free memory every 20 ms while ember trains).
 *
 * No CUDA device: prints why and a JSON line with "error", exits 2, before touching any data.
 *
 * Usage: tools/bench gpu [--quick] [--rows N] [--eval-rows N] [--seed S] [--models M,M]
 *        [--big-rows N | --no-big | --big-only] [--big-dim D|auto] [--big-memory BYTES]
 *        [--no-torch] [--dir DIR] [--ember PATH] [--python PATH] [--train-arg ARG]...
 *        [--layouts WxS,...|none] [--big-gpu-free BYTES]
 *   --quick       300K + 30K rows, big table 1M rows at dim 64, shorter SpMM timing
 *   --big-rows N  generated rows of the big-table run (default 10M; eval 1/10 of it on top)
 *   --big-memory  per-shard PS memory budget of the big-table run (--memory): rows past it spill
 *                 to RocksDB under the run directory
 *   --no-big / --big-only  leave out / run only the big-table part (tools/gpu_check runs the two
 *                 separately, so that a slow big run cannot cost the main figures)
 * Prints a table, then one JSON object as the last line.
 */
#include <cuda_runtime_api.h>
#include <cusparse.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/common.h"
#include "datasets/datasets.h"
#include "embedding/embedding.h"
#include "src/model.h"
#include "tools/train_bench.h"
#include "tools/bench_util.h"

#define EXIT_NO_DEVICE 2
#define MAX_MODELS 4
#define N_SPMM_DIMS 3
#define BIG_RATIO 1.25 /* --big-dim auto: the table this many times the GPU's memory */
#define BIG_RATIO_FREE 10.0 /* and this many times what --big-gpu-free leaves the run */
#define MAX_LAYOUTS 6
#define BIG_EXTRA 6 /* `ember train` arguments of the big-table run's own */
/* "At equal AUC": ember's mlp at least PyTorch's AUC minus this (as bench train's goal). */
#define AUC_SLACK 0.001

/* One more mlp run of --layouts: worker threads x embedded PS shards, all on the one GPU. */
typedef struct layout {
    uint32_t workers, shards;
} layout;

/* "2x2,4x4" into out (at most MAX_LAYOUTS, each 1..64), "none" for no more runs: 0, or -1 on
 * anything else. */
static int parse_layouts(const char *v, layout *out, int *n)
{
    int k = 0;
    if (!strcmp(v, "none")) {
        *n = 0;
        return 0;
    }
    const char *p = v;
    while (*p) {
        char *end;
        unsigned long w = strtoul(p, &end, 10);
        if (end == p || *end != 'x' || k == MAX_LAYOUTS) return -1;
        p = end + 1;
        unsigned long sh = strtoul(p, &end, 10);
        if (end == p || (*end != ',' && *end != '\0')) return -1;
        if (w < 1 || w > 64 || sh < 1 || sh > 64) return -1;
        out[k].workers = (uint32_t)w, out[k].shards = (uint32_t)sh, k++;
        if (*end == ',' && end[1] == '\0') return -1; /* a trailing comma */
        p = *end ? end + 1 : end;
    }
    if (k == 0) return -1;
    *n = k;
    return 0;
}

/* A run's line of the table: loop and end-to-end samples/s, loop seconds, AUC, logloss. */
static void print_run(const char *label, const bench_ember_run *r)
{
    if (!r->ok)
        printf("%-26s %12s\n", label, "FAILED");
    else
        printf("%-26s %12.0f %12.0f %9.2f %9.4f %9.4f\n", label, r->loop_samples_per_s,
               r->samples_per_s, r->loop_seconds, r->auc, r->logloss);
}

static void print_parts(const char *label, const bench_ember_run *r)
{
    printf("%-26s", label);
    for (int k = 0; k < 8; k++)
        printf(" %8.3f", r->step_parts[k]);
    printf("\n");
}

/* line() for each model's run, then each layout's, labelled. */
static void print_runs(void (*line)(const char *, const bench_ember_run *),
                       const bench_ember_run *runs, int n_runs, const layout *layouts,
                       const bench_ember_run *lay_runs, int n_layouts)
{
    char label[64];
    for (int i = 0; i < n_runs; i++) {
        snprintf(label, sizeof label, "ember %.15s (cuda)", runs[i].model);
        line(label, &runs[i]);
    }
    for (int i = 0; i < n_layouts; i++) {
        snprintf(label, sizeof label, "ember mlp %uw x %us (cuda)", layouts[i].workers,
                 layouts[i].shards);
        line(label, &lay_runs[i]);
    }
}

/* A failed CUDA call ends the benchmark with the call and the runtime's words. */
static void ck_cuda(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        char msg[256];
        snprintf(msg, sizeof msg, "%s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
        bench_die(what, strdup(msg));
    }
}

static void ck_sparse(cusparseStatus_t s, const char *what)
{
    if (s != CUSPARSE_STATUS_SUCCESS) bench_die(what, strdup(cusparseGetErrorString(s)));
}

#define CK(call) ck_cuda((call), #call)
#define CKS(call) ck_sparse((call), #call)

typedef struct gpu_info {
    char name[256];
    size_t mem_total, mem_free;
    int sms, cc_major, cc_minor;
} gpu_info;

/* 0 and the device's description, or -1 and why not in why. */
static int gpu_probe(gpu_info *g, char *why, size_t n)
{
    memset(g, 0, sizeof *g);
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count <= 0) {
        snprintf(why, n, "no CUDA device (cudaGetDeviceCount: %s)",
                 e != cudaSuccess ? cudaGetErrorString(e) : "found none");
        return -1;
    }
    struct cudaDeviceProp p;
    e = cudaGetDeviceProperties(&p, 0);
    if (e == cudaSuccess) e = cudaMemGetInfo(&g->mem_free, &g->mem_total);
    if (e != cudaSuccess) {
        snprintf(why, n, "CUDA device 0 unusable: %s", cudaGetErrorString(e));
        return -1;
    }
    snprintf(g->name, sizeof g->name, "%s", p.name);
    g->sms = p.multiProcessorCount;
    g->cc_major = p.major;
    g->cc_minor = p.minor;
    return 0;
}

/* Seconds per call of fn over at least `seconds` (after one warm-up call), timed with events. */
typedef void (*timed_fn)(void *arg);
static double time_gpu(timed_fn fn, void *arg, double seconds)
{
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    fn(arg);
    CK(cudaDeviceSynchronize());
    int iters = 1;
    double per = 0;
    for (;;) {
        CK(cudaEventRecord(a, 0));
        for (int i = 0; i < iters; i++)
            fn(arg);
        CK(cudaEventRecord(b, 0));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        per = ms / 1e3 / iters;
        if (ms / 1e3 >= seconds || iters >= (1 << 24)) break;
        /* aim past the target in one more round */
        double want = seconds / (per > 0 ? per : 1e-7) * 1.2;
        iters = want > (1 << 24) ? (1 << 24) : (int)want + 1;
    }
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return per;
}

/* ---- copy bandwidth ---- */

typedef struct copy_arg {
    void *dst, *src;
    size_t bytes;
    enum cudaMemcpyKind kind;
} copy_arg;

static void copy_once(void *arg)
{
    copy_arg *c = arg;
    CK(cudaMemcpyAsync(c->dst, c->src, c->bytes, c->kind, 0));
}

/* Device-to-device GB/s (read + write) and pinned host-to-device GB/s. */
static void measure_copy(double seconds, double *d2d, double *h2d)
{
    const size_t bytes = (size_t)512 << 20;
    void *a = NULL, *b = NULL, *h = NULL;
    CK(cudaMalloc(&a, bytes));
    CK(cudaMalloc(&b, bytes));
    CK(cudaMemset(a, 1, bytes));
    copy_arg c = {b, a, bytes, cudaMemcpyDeviceToDevice};
    *d2d = 2.0 * (double)bytes / time_gpu(copy_once, &c, seconds) / 1e9;
    const size_t hbytes = (size_t)256 << 20;
    CK(cudaHostAlloc(&h, hbytes, cudaHostAllocDefault));
    memset(h, 1, hbytes);
    copy_arg ch = {a, h, hbytes, cudaMemcpyHostToDevice};
    *h2d = (double)hbytes / time_gpu(copy_once, &ch, seconds) / 1e9;
    CK(cudaFreeHost(h));
    CK(cudaFree(a));
    CK(cudaFree(b));
}

/* ---- the pooling SpMM ---- */

typedef struct spmm_arg {
    cusparseHandle_t h;
    cusparseConstSpMatDescr_t A;
    cusparseConstDnMatDescr_t E;
    cusparseDnMatDescr_t X;
    cusparseSpMMAlg_t alg;
    void *buf;
} spmm_arg;

static void spmm_once(void *arg)
{
    spmm_arg *s = arg;
    const float one = 1.0f, zero = 0.0f;
    CKS(cusparseSpMM(s->h, CUSPARSE_OPERATION_NON_TRANSPOSE, CUSPARSE_OPERATION_NON_TRANSPOSE, &one,
                     s->A, s->E, &zero, s->X, CUDA_R_32F, s->alg, s->buf));
}

/* A CSR matrix on the host, canonical (columns sorted and distinct within a row). */
typedef struct csr {
    uint32_t rows, cols, nnz;
    int32_t *rp, *ci;
    float *v;
} csr;

static void csr_free(csr *m)
{
    free(m->rp);
    free(m->ci);
    free(m->v);
}

/* The staged batch's A made canonical (cuSPARSE's requirement; the backend does the same with a
 * counting sort), and its transpose, the backward pass's operand. */
static void csr_from_batch(const model_batch *mb, csr *A, csr *At)
{
    uint32_t BF = mb->B * mb->F, raw = mb->row_ptr[BF];
    A->rows = BF, A->cols = mb->U;
    A->rp = bench_xmalloc((BF + 1) * sizeof(int32_t));
    A->ci = bench_xmalloc(raw * sizeof(int32_t));
    A->v = bench_xmalloc(raw * sizeof(float));
    uint32_t out = 0;
    for (uint32_t r = 0; r < BF; r++) {
        A->rp[r] = (int32_t)out;
        uint32_t first = out;
        for (uint32_t k = mb->row_ptr[r]; k < mb->row_ptr[r + 1]; k++) {
            uint32_t c = mb->col[k], p = out;
            while (p > first && (uint32_t)A->ci[p - 1] > c) /* insertion: rows hold a few keys */
                p--;
            if (p > first && (uint32_t)A->ci[p - 1] == c) {
                A->v[p - 1] += mb->val[k];
                continue;
            }
            memmove(A->ci + p + 1, A->ci + p, (out - p) * sizeof(int32_t));
            memmove(A->v + p + 1, A->v + p, (out - p) * sizeof(float));
            A->ci[p] = (int32_t)c;
            A->v[p] = mb->val[k];
            out++;
        }
    }
    A->rp[BF] = (int32_t)out;
    A->nnz = out;
    At->rows = mb->U, At->cols = BF, At->nnz = out;
    At->rp = calloc((size_t)mb->U + 1, sizeof(int32_t));
    At->ci = bench_xmalloc(out * sizeof(int32_t) + 4);
    At->v = bench_xmalloc(out * sizeof(float) + 4);
    if (At->rp == NULL) bench_die("out of memory", NULL);
    for (uint32_t p = 0; p < out; p++)
        At->rp[A->ci[p] + 1]++;
    for (uint32_t u = 0; u < mb->U; u++)
        At->rp[u + 1] += At->rp[u];
    int32_t *fill = bench_xmalloc(((size_t)mb->U + 1) * sizeof(int32_t));
    memcpy(fill, At->rp, ((size_t)mb->U + 1) * sizeof(int32_t));
    for (uint32_t r = 0; r < BF; r++)
        for (int32_t p = A->rp[r]; p < A->rp[r + 1]; p++) {
            int32_t q = fill[A->ci[p]]++;
            At->ci[q] = (int32_t)r;
            At->v[q] = A->v[p];
        }
    free(fill);
}

typedef struct spmm_result {
    uint32_t dim;
    double seconds, gb_per_s;
} spmm_result;

/* Y (m->rows x dim) = m (rows x cols) * Z (cols x dim): seconds per product and effective GB/s. */
static void spmm_measure(cusparseHandle_t h, const csr *m, uint32_t dim, double seconds,
                         spmm_result *r)
{
    int32_t *d_rp = NULL, *d_ci = NULL;
    float *d_v = NULL, *d_Z = NULL, *d_Y = NULL;
    size_t zb = (size_t)m->cols * dim * sizeof(float), yb = (size_t)m->rows * dim * sizeof(float);
    CK(cudaMalloc((void **)&d_rp, ((size_t)m->rows + 1) * sizeof(int32_t)));
    CK(cudaMalloc((void **)&d_ci, (size_t)m->nnz * sizeof(int32_t) + 4));
    CK(cudaMalloc((void **)&d_v, (size_t)m->nnz * sizeof(float) + 4));
    CK(cudaMalloc((void **)&d_Z, zb));
    CK(cudaMalloc((void **)&d_Y, yb));
    CK(cudaMemcpy(d_rp, m->rp, ((size_t)m->rows + 1) * sizeof(int32_t), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_ci, m->ci, (size_t)m->nnz * sizeof(int32_t), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_v, m->v, (size_t)m->nnz * sizeof(float), cudaMemcpyHostToDevice));
    float *hz = bench_xmalloc(zb);
    for (size_t i = 0; i < zb / sizeof(float); i++)
        hz[i] = (float)((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
    CK(cudaMemcpy(d_Z, hz, zb, cudaMemcpyHostToDevice));
    free(hz);
    spmm_arg s = {.h = h, .alg = CUSPARSE_SPMM_CSR_ALG2};
    CKS(cusparseCreateConstCsr(&s.A, m->rows, m->cols, m->nnz, d_rp, d_ci, d_v, CUSPARSE_INDEX_32I,
                               CUSPARSE_INDEX_32I, CUSPARSE_INDEX_BASE_ZERO, CUDA_R_32F));
    CKS(cusparseCreateConstDnMat(&s.E, m->cols, dim, dim, d_Z, CUDA_R_32F, CUSPARSE_ORDER_ROW));
    CKS(cusparseCreateDnMat(&s.X, m->rows, dim, dim, d_Y, CUDA_R_32F, CUSPARSE_ORDER_ROW));
    const float one = 1.0f, zero = 0.0f;
    size_t need = 0;
    /* ALG2 is what the backend asks for first; it falls back to the default the same way. */
    cusparseStatus_t st = cusparseSpMM_bufferSize(h, CUSPARSE_OPERATION_NON_TRANSPOSE,
                                                  CUSPARSE_OPERATION_NON_TRANSPOSE, &one, s.A, s.E,
                                                  &zero, s.X, CUDA_R_32F, s.alg, &need);
    if (st == CUSPARSE_STATUS_NOT_SUPPORTED) {
        s.alg = CUSPARSE_SPMM_ALG_DEFAULT;
        st = cusparseSpMM_bufferSize(h, CUSPARSE_OPERATION_NON_TRANSPOSE,
                                     CUSPARSE_OPERATION_NON_TRANSPOSE, &one, s.A, s.E, &zero, s.X,
                                     CUDA_R_32F, s.alg, &need);
    }
    ck_sparse(st, "cusparseSpMM_bufferSize");
    CK(cudaMalloc(&s.buf, need ? need : 16));
    r->dim = dim;
    r->seconds = time_gpu(spmm_once, &s, seconds);
    double bytes = ((double)m->rows + 1) * 4 + (double)m->nnz * 8 + (double)zb + (double)yb;
    r->gb_per_s = bytes / r->seconds / 1e9;
    cusparseDestroySpMat(s.A);
    cusparseDestroyDnMat(s.E);
    cusparseDestroyDnMat(s.X);
    CK(cudaFree(s.buf));
    CK(cudaFree(d_rp));
    CK(cudaFree(d_ci));
    CK(cudaFree(d_v));
    CK(cudaFree(d_Z));
    CK(cudaFree(d_Y));
}

typedef struct spmm_report {
    uint32_t B, F, U, nnz;
    spmm_result fwd[N_SPMM_DIMS], bwd; /* bwd: A^T dX at the benchmark's dim */
} spmm_report;

/* The first batch of the training shards, staged as ember's trainer stages it (mlp, sum
 * pooling), then its SpMMs at dims 16 (the benchmark's model), 64 and 256. */
static void measure_spmm(const bench_dataset *ds, double seconds, spmm_report *rep)
{
    static const uint32_t dims[N_SPMM_DIMS] = {BENCH_DIM, 64, 256};
    memset(rep, 0, sizeof *rep);
    char *err = NULL;
    ds_reader_opts ro;
    ds_reader_opts_init(&ro);
    const char *paths[1] = {ds->train};
    ro.paths = paths;
    ro.n_paths = 1;
    ro.batch_size = BENCH_BATCH;
    ds_reader *r = NULL;
    bench_check(ds_reader_open(&ro, &r, &err), err, "ds_reader_open");
    const ds_batch *b = NULL;
    if (ds_reader_next(r, &b, &err) != 1) bench_die("no first batch in the training shards", err);
    model_cfg m;
    model_layout l;
    model_cfg_preset(&m, MODEL_MLP, b->n_fields, b->n_dense);
    bench_check(model_layout_make(&m, &l, &err), err, "model layout");
    model_input in = {b->n_rows, b->n_dense, b->n_fields, b->labels,
                      b->dense,  b->offsets, b->keys,     b->weights};
    model_staging st;
    memset(&st, 0, sizeof st);
    bench_check(model_staging_build(&st, &m, &l, 0, &in, &err), err, "model_staging_build");
    model_batch mb;
    model_staging_view(&st, &mb);
    csr A, At;
    csr_from_batch(&mb, &A, &At);
    rep->B = mb.B, rep->F = mb.F, rep->U = mb.U, rep->nnz = A.nnz;
    cusparseHandle_t h;
    CKS(cusparseCreate(&h));
    for (int i = 0; i < N_SPMM_DIMS; i++)
        spmm_measure(h, &A, dims[i], seconds, &rep->fwd[i]);
    spmm_measure(h, &At, BENCH_DIM, seconds, &rep->bwd);
    cusparseDestroy(h);
    csr_free(&A);
    csr_free(&At);
    model_staging_fini(&st);
    ds_reader_destroy(r);
}

/* ---- the big table ---- */

typedef struct big_run {
    int ran;
    uint64_t rows, keys;
    uint32_t dim;
    double row_bytes, table_bytes, ratio; /* ratio: table / the GPU memory the job had */
    /* With --big-gpu-free: the device memory left to the run (the rest held by this process's
     * ballast allocation); else the GPU's whole memory. */
    double gpu_bytes, ballast_bytes;
    double ember_peak_bytes;    /* device memory in use at the run's peak beyond its start */
    int torch_tried, torch_oom; /* the same table as nn.Embedding + Adagrad state, on cuda */
    char torch_why[512];
    bench_ember_run er;
} big_run;

/* Samples the device's free memory while a run goes on (another process's use shows there). */
typedef struct mem_watch {
    pthread_t th;
    atomic_int stop;
    size_t min_free;
} mem_watch;

static void *mem_watch_main(void *arg)
{
    mem_watch *w = arg;
    while (!atomic_load(&w->stop)) {
        size_t fr = 0, tot = 0;
        if (cudaMemGetInfo(&fr, &tot) == cudaSuccess && fr < w->min_free) w->min_free = fr;
        usleep(20000);
    }
    return NULL;
}

/* PyTorch's side of the big table, for real: the rows and Adagrad's state (4 bytes each) as
 * CUDA tensors in the memory the run had; torch_oom when that fails for want of memory. */
static void torch_big_try(const bench_train_opts *o, const bench_dataset *ds, uint32_t dim,
                          big_run *br)
{
    if (o->no_torch || o->python == NULL) {
        snprintf(br->torch_why, sizeof br->torch_why, "not tried (--no-torch)");
        return;
    }
    char code[1024], errp[4400];
    snprintf(code, sizeof code,
             "import torch\n"
             "try:\n"
             "    e = torch.nn.Embedding(%" PRIu64 ", %u, device='cuda')\n"
             "    s = torch.zeros_like(e.weight)\n"
             "    torch.cuda.synchronize()\n"
             "    print('fits')\n"
             "except Exception as x:\n"
             "    m = (str(x).splitlines() or [''])[0][:300]\n"
             "    print(('oom: ' if 'out of memory' in m.lower() else 'error: ') + m)\n",
             ds->table_rows, dim);
    snprintf(errp, sizeof errp, "%s/torch-big.out", ds->dir);
    char *argv[] = {(char *)o->python, "-c", code, NULL};
    int rc = bench_run_cmd(argv, errp, "/dev/null");
    char line[480];
    bench_last_line(errp, NULL, line, sizeof line);
    br->torch_tried = 1;
    br->torch_oom = rc == 0 && strncmp(line, "oom: ", 5) == 0;
    snprintf(br->torch_why, sizeof br->torch_why, "%s",
             rc != 0                 ? "python failed (no torch?)"
             : !strcmp(line, "fits") ? "the table fits: nn.Embedding + Adagrad state allocated"
                                     : line);
}

static double row_mem_bytes(uint32_t dim)
{
    emb_table_config cfg;
    emb_table_config_init(&cfg);
    cfg.dim = dim;
    cfg.opt = EMB_OPT_ADAGRAD; /* as bench_train_ember trains */
    return emb_row_mem_bytes(&cfg);
}

static void run_big(const bench_train_opts *base, uint64_t rows, uint32_t dim_opt,
                    const char *memory, uint64_t gpu_free, const gpu_info *g, int threads,
                    big_run *br)
{
    memset(br, 0, sizeof *br);
    bench_train_opts o = *base;
    o.rows = rows;
    o.eval_rows = rows / 10;
    o.no_dump = 1; /* PyTorch does not run here: no dump to write */
    bench_dataset ds;
    bench_train_data(&o, &ds);
    br->rows = ds.rows_train;
    br->keys = ds.table_rows - 1;
    uint32_t dim = dim_opt;
    if (dim == 0) { /* auto: past the GPU's memory, or ten times what --big-gpu-free leaves */
        const double want =
            gpu_free > 0 ? BIG_RATIO_FREE * (double)gpu_free : BIG_RATIO * (double)g->mem_total;
        for (dim = 16; dim < 1024; dim += 16)
            if ((double)br->keys * row_mem_bytes(dim) >= want) break;
    }
    br->dim = dim;
    br->row_bytes = row_mem_bytes(dim);
    br->table_bytes = (double)br->keys * br->row_bytes;
    br->gpu_bytes = (double)g->mem_total;
    /* --big-gpu-free: a smaller GPU, made by holding the rest of this one. */
    void *ballast = NULL;
    size_t fr = 0, tot = 0;
    if (gpu_free > 0) {
        CK(cudaMemGetInfo(&fr, &tot));
        if (fr > gpu_free) {
            CK(cudaMalloc(&ballast, fr - gpu_free));
            br->ballast_bytes = (double)(fr - gpu_free);
        }
        CK(cudaMemGetInfo(&fr, &tot));
        br->gpu_bytes = (double)fr;
        torch_big_try(&o, &ds, dim, br);
    } else {
        /* What PyTorch would need on the GPU: the rows and Adagrad's state, 4 bytes each. */
        double torch_bytes = (double)ds.table_rows * dim * 8.0;
        snprintf(br->torch_why, sizeof br->torch_why,
                 torch_bytes > br->gpu_bytes
                     ? "skipped: nn.Embedding + Adagrad state would need %.1f GiB on a %.1f GiB "
                       "GPU"
                     : "not run: the table (%.1f GiB as nn.Embedding + Adagrad state) fits the "
                       "%.1f GiB GPU; --big-gpu-free or more --big-rows / --big-dim for the "
                       "out-of-memory case",
                 torch_bytes / 1073741824.0, br->gpu_bytes / 1073741824.0);
    }
    br->ratio = br->table_bytes / br->gpu_bytes;
    char dim_s[16], keys_s[16];
    snprintf(dim_s, sizeof dim_s, "%u", dim);
    /* The generated data is one-hot: a batch holds at most batch x fields distinct keys, and
     * the GPU's buffers, which grow with that bound times the dim, are sized by it. */
    snprintf(keys_s, sizeof keys_s, "%u", BENCH_BATCH * ds.F);
    if (o.n_extra + BIG_EXTRA > BENCH_MAX_EXTRA) bench_die("too many --train-arg", NULL);
    o.extra[o.n_extra++] = "--dim";
    o.extra[o.n_extra++] = dim_s;
    o.extra[o.n_extra++] = "--max-batch-keys";
    o.extra[o.n_extra++] = keys_s;
    if (memory) {
        o.extra[o.n_extra++] = "--memory";
        o.extra[o.n_extra++] = memory;
    }
    fprintf(stderr,
            "bench gpu: big table: %" PRIu64 " keys x %.0f bytes (dim %u) = %.1f GiB, %.2fx the "
            "%.2f GiB of GPU memory the run has%s%s\n",
            br->keys, br->row_bytes, dim, br->table_bytes / 1073741824.0, br->ratio,
            br->gpu_bytes / 1073741824.0, memory ? "; PS memory per shard " : "",
            memory ? memory : "");
    mem_watch w = {.min_free = SIZE_MAX};
    CK(cudaMemGetInfo(&fr, &tot));
    size_t free0 = fr;
    atomic_init(&w.stop, 0);
    int watching = pthread_create(&w.th, NULL, mem_watch_main, &w) == 0;
    bench_train_ember(&o, &ds, "mlp", threads, 1, 0, &br->er);
    if (watching) {
        atomic_store(&w.stop, 1);
        pthread_join(w.th, NULL);
        br->ember_peak_bytes = w.min_free < free0 ? (double)(free0 - w.min_free) : 0;
    } else
        br->ember_peak_bytes = NAN;
    if (ballast) CK(cudaFree(ballast));
    br->ran = 1;
}

/* ---- main ---- */

static void usage(void)
{
    fprintf(
        stderr,
        "usage: bench_gpu [--quick] [--rows N] [--eval-rows N] [--seed S] [--models M,M]\n"
        "       [--big-rows N | --no-big | --big-only] [--big-dim D|auto] [--big-memory BYTES]\n"
        "       [--big-gpu-free BYTES]\n"
        "       [--no-torch] [--dir DIR] [--ember PATH] [--python PATH] [--train-arg ARG]...\n"
        "       [--layouts WxS,...|none]\n");
    exit(64);
}

#define JNUM(x) (isfinite((double)(x)) ? (double)(x) : -1.0)

/* A string for JSON: quotes and backslashes dropped (device names and reasons have none that
 * matter). */
static const char *jstr(const char *s, char *buf, size_t n)
{
    size_t k = 0;
    for (; *s && k + 1 < n; s++)
        if (*s != '"' && *s != '\\' && (unsigned char)*s >= 0x20) buf[k++] = *s;
    buf[k] = '\0';
    return buf;
}

int main(int argc, char **argv)
{
    bench_blas_core(argv);
    bench_init("bench gpu", NULL);
    bench_train_opts o;
    bench_train_opts_init(&o, "bench gpu");
    o.device = "cuda";
    snprintf(o.models, sizeof o.models, "mlp,dlrm");
    uint64_t big_rows = 0;
    uint32_t big_dim = 0; /* 0: auto */
    const char *big_memory = NULL;
    uint64_t big_gpu_free = 0; /* --big-gpu-free: 0 = the whole GPU */
    int no_big = 0, big_only = 0;
    layout layouts[MAX_LAYOUTS] = {{2, 2}};
    int n_layouts = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        /* Places stay free for the big-table run's own arguments. */
        int used = bench_train_opt(&o, a, v, BENCH_MAX_EXTRA - BIG_EXTRA);
        if (used > 0)
            i += used - 1;
        else if (used < 0)
            usage();
        else if (!strcmp(a, "--no-big"))
            no_big = 1;
        else if (!strcmp(a, "--big-only"))
            big_only = 1;
        else if (v == NULL)
            usage();
        else if (!strcmp(a, "--big-rows"))
            big_rows = strtoull(v, NULL, 10), i++;
        else if (!strcmp(a, "--big-dim")) {
            big_dim = strcmp(v, "auto") ? (uint32_t)strtoul(v, NULL, 10) : 0, i++;
            if (big_dim > 1024 || (strcmp(v, "auto") && big_dim == 0)) usage();
        } else if (!strcmp(a, "--big-memory"))
            big_memory = v, i++;
        else if (!strcmp(a, "--big-gpu-free")) {
            if (cm_parse_size(v, &big_gpu_free) != 0 || big_gpu_free == 0) usage();
            i++;
        } else if (!strcmp(a, "--layouts")) {
            if (parse_layouts(v, layouts, &n_layouts) != 0) usage();
            i++;
        } else
            usage();
    }
    bench_train_opts_finish(&o);
    if (big_rows == 0) big_rows = o.quick ? 1000000 : 10000000;
    if (o.quick && big_dim == 0) big_dim = 64;
    if (no_big && big_only) usage();
    char buf[512], buf2[512];

    /* The device first: without one nothing else is worth doing. */
    gpu_info g;
    char why[512];
    if (gpu_probe(&g, why, sizeof why) != 0) {
        fprintf(stderr, "bench gpu: %s; this benchmark needs a CUDA GPU (and a driver)\n", why);
        printf("{\"bench\":\"gpu\",\"error\":\"%s\",\"gpu\":null}\n", jstr(why, buf, sizeof buf));
        return EXIT_NO_DEVICE;
    }
    if (o.ember == NULL || access(o.ember, X_OK) != 0) {
        fprintf(stderr, "bench gpu: no ember binary at %s (build it, or --ember PATH)\n",
                o.ember ? o.ember : "?");
        return 1;
    }
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = cores > 8 ? 8 : cores > 0 ? (int)cores : 1; /* ember's own default */
    o.torch_threads = threads;
    char *err = NULL;
    if (cm_mkdirs(o.dir, &err) != CM_OK) bench_die("bench directory", err);
    double t_start = cm_now(), secs = o.quick ? 0.3 : 1.0;
    fprintf(stderr, "bench gpu: %s, %.1f GiB, %d SMs, compute %d.%d\n", g.name,
            (double)g.mem_total / 1073741824.0, g.sms, g.cc_major, g.cc_minor);

    double copy_gbs = 0, h2d_gbs = 0;
    bench_dataset ds;
    spmm_report sp;
    bench_ember_run runs[MAX_MODELS], lay_runs[MAX_LAYOUTS];
    bench_torch_run tr;
    int n_runs = 0;
    memset(&ds, 0, sizeof ds);
    memset(&sp, 0, sizeof sp);
    memset(&tr, 0, sizeof tr);
    memset(lay_runs, 0, sizeof lay_runs);
    if (big_only) n_layouts = 0;
    snprintf(tr.why, sizeof tr.why, "skipped (--big-only)");
    if (!big_only) {
        measure_copy(secs, &copy_gbs, &h2d_gbs);
        bench_train_data(&o, &ds);
        measure_spmm(&ds, secs, &sp);
        char ml[128];
        snprintf(ml, sizeof ml, "%s", o.models);
        for (char *s = strtok(ml, ","); s && n_runs < MAX_MODELS; s = strtok(NULL, ","))
            bench_train_ember(&o, &ds, s, threads, 1, 0, &runs[n_runs++]);
        for (int i = 0; i < n_layouts; i++) {
            o.workers = layouts[i].workers, o.shards = layouts[i].shards;
            bench_train_ember(&o, &ds, "mlp", threads, 1, 0, &lay_runs[i]);
        }
        o.workers = o.shards = 0;
        bench_train_torch(&o, &ds, 1, &tr);
    }
    const bench_ember_run *mlp = NULL;
    for (int i = 0; i < n_runs; i++)
        if (!strcmp(runs[i].model, "mlp") && runs[i].ok) mlp = &runs[i];

    big_run br;
    memset(&br, 0, sizeof br);
    if (!no_big) run_big(&o, big_rows, big_dim, big_memory, big_gpu_free, &g, threads, &br);

    printf("bench gpu: %s (%.1f GiB, %d SMs), batch %u, 1 epoch, %d host threads", g.name,
           (double)g.mem_total / 1073741824.0, g.sms, BENCH_BATCH, threads);
    if (!big_only)
        printf("; %" PRIu64 " train + %" PRIu64 " eval rows (seed %" PRIu64 ", %s)", ds.rows_train,
               ds.rows_eval, o.seed, ds.cached ? "cached" : "generated now");
    printf("\n%-26s %12s %12s %9s %9s %9s\n", "run", "loop smp/s", "e2e smp/s", "train s", "auc",
           "logloss");
    print_runs(print_run, runs, n_runs, layouts, lay_runs, n_layouts);
    if (tr.ran)
        printf("%-26s %12.0f %12s %9.2f %9.4f %9.4f\n", "pytorch mlp (cuda)", tr.samples_per_s, "-",
               tr.seconds, tr.auc, tr.logloss);
    else if (!big_only)
        printf("%-26s %s\n", "pytorch mlp (cuda)", tr.why);
    if (n_runs > 0) { /* where a step went: the stepping thread's parts, then the puller's */
        printf("%-26s", "ms a step (ember train)");
        for (int k = 0; k < 8; k++)
            printf(" %8.8s", bench_step_part_names[k]);
        printf("\n");
        print_runs(print_parts, runs, n_runs, layouts, lay_runs, n_layouts);
    }
    if (br.ran) {
        snprintf(buf, sizeof buf, "ember mlp big (dim %u)", br.dim);
        print_run(buf, &br.er);
        printf("  big table: %" PRIu64 " keys x %.0f bytes = %.1f GiB on the PS, %.2fx the "
               "%.2f GiB of GPU memory the run had%s; ember's run used %.2f GiB of it at its "
               "peak\n  pytorch, the same table on the GPU: %s\n",
               br.keys, br.row_bytes, br.table_bytes / 1073741824.0, br.ratio,
               br.gpu_bytes / 1073741824.0,
               br.ballast_bytes > 0 ? " (the rest of the GPU held by a ballast allocation)" : "",
               br.ember_peak_bytes / 1073741824.0, br.torch_why);
    }
    if (!big_only) {
        printf(
            "copy bandwidth: %.0f GB/s device to device (read + write), %.1f GB/s pinned host to "
            "device\n",
            copy_gbs, h2d_gbs);
        printf("pooling SpMM on the first batch (%u x %u rows, %u keys, %u entries):\n", sp.B, sp.F,
               sp.U, sp.nnz);
        for (int i = 0; i < N_SPMM_DIMS; i++)
            printf("  X = A E, dim %3u: %8.1f us, %7.0f GB/s effective (%.0f%% of copy)\n",
                   sp.fwd[i].dim, sp.fwd[i].seconds * 1e6, sp.fwd[i].gb_per_s,
                   100.0 * sp.fwd[i].gb_per_s / copy_gbs);
        printf("  dE = A^T dX, dim %u: %8.1f us, %7.0f GB/s effective\n", sp.bwd.dim,
               sp.bwd.seconds * 1e6, sp.bwd.gb_per_s);
    }
    /* The goal is judged on the fastest mlp run at equal AUC: one worker, or a --layouts run
     * (several workers sharing the GPU train asynchronously, which can cost AUC). */
    double speedup = mlp && tr.ran ? mlp->loop_samples_per_s / tr.samples_per_s : NAN;
    double best = NAN;
    const char *best_name = "none";
    char best_buf[32];
    for (int i = -1; tr.ran && i < n_layouts; i++) {
        const bench_ember_run *r = i < 0 ? mlp : &lay_runs[i];
        if (r == NULL || !r->ok || !(r->auc >= tr.auc - AUC_SLACK)) continue;
        double x = r->loop_samples_per_s / tr.samples_per_s;
        if (isfinite(best) && x <= best) continue;
        best = x;
        snprintf(best_buf, sizeof best_buf, "%ux%u", i < 0 ? 1 : layouts[i].workers,
                 i < 0 ? 1 : layouts[i].shards);
        best_name = best_buf;
    }
    int met = isfinite(best) && best >= 1.5;
    if (mlp && tr.ran) {
        printf("ember mlp / pytorch: 1 worker x 1 shard %.2fx (auc %.4f vs %.4f)", speedup,
               mlp->auc, tr.auc);
        for (int i = 0; i < n_layouts; i++)
            if (lay_runs[i].ok)
                printf("; %ux%u %.2fx (auc %.4f)", layouts[i].workers, layouts[i].shards,
                       lay_runs[i].loop_samples_per_s / tr.samples_per_s, lay_runs[i].auc);
        printf("\ngoal ember >= 1.5x torch samples/s at equal auc (>= torch - %.3f): %s (best "
               "at equal auc: %s, %.2fx)\n",
               AUC_SLACK, met ? "met" : "NOT met", best_name, best);
    }

    printf("{\"bench\":\"gpu\",\"big_only\":%s,\"gpu\":\"%s\",\"gpu_mem_bytes\":%zu,\"gpu_sms\":%d,"
           "\"rows\":%" PRIu64 ",\"eval_rows\":%" PRIu64 ",\"seed\":%" PRIu64
           ",\"batch\":%u,\"distinct_keys\":%" PRIu64 ",\"host_threads\":%d,",
           big_only ? "true" : "false", jstr(g.name, buf, sizeof buf), g.mem_total, g.sms,
           ds.rows_train, ds.rows_eval, o.seed, BENCH_BATCH, ds.table_rows ? ds.table_rows - 1 : 0,
           threads);
    printf("\"ember_samples_per_s\":%.0f,\"ember_e2e_samples_per_s\":%.0f,\"ember_auc\":%.6f,"
           "\"ember_logloss\":%.6f,",
           mlp ? JNUM(mlp->loop_samples_per_s) : -1, mlp ? JNUM(mlp->samples_per_s) : -1,
           mlp ? JNUM(mlp->auc) : -1, mlp ? JNUM(mlp->logloss) : -1);
    for (int i = 0; i < n_runs; i++)
        printf("\"ember_%s_samples_per_s\":%.0f,\"ember_%s_auc\":%.6f,", runs[i].model,
               runs[i].ok ? JNUM(runs[i].loop_samples_per_s) : -1, runs[i].model,
               runs[i].ok ? JNUM(runs[i].auc) : -1);
    for (int i = 0; i < n_layouts; i++) {
        const bench_ember_run *r = &lay_runs[i];
        snprintf(buf, sizeof buf, "ember_w%us%u_", layouts[i].workers, layouts[i].shards);
        printf("\"%ssamples_per_s\":%.0f,\"%sauc\":%.6f,\"%sspeedup\":%.3f,", buf,
               r->ok ? JNUM(r->loop_samples_per_s) : -1, buf, r->ok ? JNUM(r->auc) : -1, buf,
               r->ok && tr.ran ? JNUM(r->loop_samples_per_s / tr.samples_per_s) : -1);
    }
    for (int k = 0; mlp != NULL && k < 8; k++) /* where the mlp's step went, ms */
        printf("\"ember_%s\":%.3f,", bench_step_part_names[k], JNUM(mlp->step_parts[k]));
    printf("\"torch_ran\":%s,\"torch_why\":\"%s\",\"torch_version\":\"%s\","
           "\"torch_samples_per_s\":%.0f,\"torch_auc\":%.6f,\"torch_logloss\":%.6f,"
           "\"speedup\":%.3f,",
           tr.ran ? "true" : "false", jstr(tr.why, buf, sizeof buf), tr.version,
           tr.ran ? JNUM(tr.samples_per_s) : -1, tr.ran ? JNUM(tr.auc) : -1,
           tr.ran ? JNUM(tr.logloss) : -1, JNUM(speedup));
    printf("\"copy_gb_per_s\":%.1f,\"h2d_gb_per_s\":%.1f,\"spmm_gb_per_s\":%.1f,\"spmm_us\":%.2f,"
           "\"spmm_bwd_gb_per_s\":%.1f,\"spmm_keys\":%u,\"spmm_nnz\":%u,",
           copy_gbs, h2d_gbs, sp.fwd[0].gb_per_s, sp.fwd[0].seconds * 1e6, sp.bwd.gb_per_s, sp.U,
           sp.nnz);
    for (int i = 0; i < N_SPMM_DIMS; i++) /* not measured (--big-only): no dims to name */
        if (sp.fwd[i].dim > 0)
            printf("\"spmm_dim%u_gb_per_s\":%.1f,", sp.fwd[i].dim, sp.fwd[i].gb_per_s);
    if (br.ran)
        printf(
            "\"big_rows\":%" PRIu64 ",\"big_keys\":%" PRIu64 ",\"big_dim\":%u,"
            "\"big_table_bytes\":%.0f,\"big_table_gpu_ratio\":%.3f,\"big_ok\":%s,"
            "\"big_samples_per_s\":%.0f,\"big_auc\":%.6f,\"big_torch\":\"%s\","
            "\"big_gpu_bytes\":%.0f,\"big_ballast_bytes\":%.0f,\"big_ember_gpu_peak_bytes\":%.0f,"
            "\"big_torch_tried\":%s,\"big_torch_oom\":%s,",
            br.rows, br.keys, br.dim, br.table_bytes, br.ratio, br.er.ok ? "true" : "false",
            br.er.ok ? JNUM(br.er.loop_samples_per_s) : -1, br.er.ok ? JNUM(br.er.auc) : -1,
            jstr(br.torch_why, buf2, sizeof buf2), br.gpu_bytes, br.ballast_bytes,
            JNUM(br.ember_peak_bytes), br.torch_tried ? "true" : "false",
            br.torch_oom ? "true" : "false");
    printf("\"best_layout\":\"%s\",\"speedup_best\":%.3f,\"goal_speedup_met\":%s,"
           "\"wall_seconds\":%.1f}\n",
           best_name, JNUM(best), mlp && tr.ran ? (met ? "true" : "false") : "null",
           cm_now() - t_start);
    int ok = big_only || n_runs > 0;
    for (int i = 0; i < n_runs; i++)
        ok = ok && runs[i].ok;
    for (int i = 0; i < n_layouts; i++)
        ok = ok && lay_runs[i].ok;
    return ok && (!br.ran || br.er.ok) ? 0 : 1;
}
