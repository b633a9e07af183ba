/*
 * The CPU backend: OpenBLAS sgemm for the dense layers, plain loops for the CSR pooling and
 * its transpose, the interactions and the loss. This is the reference the CUDA backend is
 * tested against, so it favours the obvious formulation over cleverness, with one exception
 * for speed: the mlp's and deepfm's first layer, which on batches whose keys repeat is
 * computed per distinct (field, key) pair ("The factorized first layer" below; BACKEND_PLAIN
 * keeps the obvious GEMM over pooled inputs, and the tests hold the two together).
 */
#include <cblas.h>
#include <pthread.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "common/common.h"
#include "src/model.h"

/*
 * A small pool that runs one function over parts of a job, the caller taking part too. Every
 * GEMM is cut into tiles of its output, each tile a single-threaded OpenBLAS call (OpenBLAS's
 * own threads are not deterministic, and they spin on cores the PS and prefetch threads need).
 * The tiles depend on the GEMM's shape only, never on the thread count (see gemm_tiles), so the
 * results are the same bits for any number of threads and any timing.
 *
 * The parts of a job are dealt out in contiguous blocks, one a thread (a thread's rows stay
 * in its cache from one layer to the next), but a thread that has finished its block takes
 * the rest of another's from its far end: the cores are shared with the PS and the prefetch
 * threads, so a woken pool thread may wait milliseconds for a core, and the caller then does
 * its parts instead of waiting for it. The job ends when every part is taken and every thread
 * that entered it has left; a thread that wakes after that skips it. A part computes the
 * same bits whoever runs it. pool_run_threads is the other kind of job: one part per thread,
 * all of them taking part (the dense-gradient phase, which holds some threads back until it
 * is joined).
 */
typedef void (*part_fn)(void *arg, int part, int nparts);

/* Parts per thread of a shared job: enough to even out a late thread, few enough to stay
 * coarse (each part of a GEMM is one tile). */
#define POOL_PARTS_PER_THREAD 4

/* A thread's block of parts still to run: [lo, hi) packed as lo << 32 | hi, taken from the
 * front by its owner and from the back by others; a cache line each. */
typedef struct pool_block {
    uint64_t w;
    char pad[56];
} pool_block;

/*
 * Which code computes a GEMM's tiles. ember's own fp32 GEMM (cm_gemm_f32) where the CPU has
 * AVX-512 or AVX2 with FMA: its sums do not depend on the tile sizes nor on the kind of CPU, it
 * takes the forward layers' weights packed once (serving's tower), and on the mlp's shapes it
 * runs at least as fast as OpenBLAS 0.3.21: AVX-512 1.5-2.0x the Haswell kernels a user's
 * OPENBLAS_CORETYPE=Haswell gives, 0.96-1.07x OpenBLAS's own AVX-512 ones (docs/BENCHMARKS.md,
 * stop 26); AVX2 on an AMD EPYC (Zen 3) about OpenBLAS's Zen kernels on one thread and 1.6-6.2%
 * shorter training steps on two (stop 38). Elsewhere OpenBLAS. GEMM_OWN_AVX2 (BACKEND_NO_AVX512)
 * and GEMM_OWN_PORTABLE (BACKEND_NO_SIMD) give GEMM_OWN's bits with narrower vectors and with plain
 * loops (tests).
 */
typedef enum gemm_kind {
    GEMM_BLAS,
    GEMM_OWN,
    GEMM_OWN_AVX2,
    GEMM_OWN_PORTABLE,
    GEMM_BF16
} gemm_kind;

/* cm_gemm_f32's path for an own kind. */
static int own_path(gemm_kind k)
{
    return k == GEMM_OWN        ? CM_GEMM_F32_BEST
           : k == GEMM_OWN_AVX2 ? CM_GEMM_F32_AVX2
                                : CM_GEMM_F32_PORTABLE;
}

typedef struct pool {
    int n;
    pthread_t *th;
    pool_block *blocks; /* n */
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    uint64_t gen;
    bool shared; /* the job's parts are dealt in blocks (else one part a thread) */
    bool open;   /* shared job: threads may still enter it */
    int nparts;
    int pending; /* threads jobs: pool threads still running their part */
    int active;  /* shared jobs: pool threads inside the job */
    part_fn fn;
    void *arg;
    bool stop;
    gemm_kind kind; /* how the GEMMs run for this pool are computed */
    /* bf16: where gemm_run packs the operand every tile of a GEMM shares (NULL: each tile
     * packs its own), bf16_pk_cap bytes */
    void *bf16_pk;
    size_t bf16_pk_cap;
} pool;

typedef struct pool_arg {
    pool *p;
    int part;
} pool_arg;

/* One part from block b: its front when taken by its owner, else its back; -1 if empty. */
static int pool_take(pool_block *b, bool front)
{
    uint64_t w = __atomic_load_n(&b->w, __ATOMIC_ACQUIRE);
    for (;;) {
        uint32_t lo = (uint32_t)(w >> 32), hi = (uint32_t)w;
        if (lo >= hi) return -1;
        uint64_t nw = front ? w + (1ull << 32) : w - 1;
        if (__atomic_compare_exchange_n(&b->w, &w, nw, true, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return (int)(front ? lo : hi - 1);
    }
}

/* Runs parts of the current shared job as thread `self`: its own block, then the others'. */
static void pool_take_parts(pool *p, int self, part_fn fn, void *arg, int nparts)
{
    for (int k = 0; k < p->n; k++) {
        pool_block *b = &p->blocks[(self + k) % p->n];
        for (int part; (part = pool_take(b, k == 0)) >= 0;)
            fn(arg, part, nparts);
    }
}

static void *pool_main(void *v)
{
    pool_arg *pa = v;
    pool *p = pa->p;
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        while (p->gen == seen && !p->stop)
            pthread_cond_wait(&p->go, &p->mu);
        if (p->stop) {
            pthread_mutex_unlock(&p->mu);
            break;
        }
        seen = p->gen;
        part_fn fn = p->fn;
        void *arg = p->arg;
        bool shared = p->shared, enter = p->open;
        int nparts = p->nparts;
        if (shared && enter) p->active++;
        pthread_mutex_unlock(&p->mu);
        if (shared) {
            if (!enter) continue; /* woken too late: the job is over */
            pool_take_parts(p, pa->part, fn, arg, nparts);
            pthread_mutex_lock(&p->mu);
            if (--p->active == 0) pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
            continue;
        }
        fn(arg, pa->part, p->n);
        pthread_mutex_lock(&p->mu);
        if (--p->pending == 0) pthread_cond_signal(&p->done);
        pthread_mutex_unlock(&p->mu);
    }
    free(pa);
    return NULL;
}

/* Starts job fn(arg): the pool threads wake to it. */
static void pool_start(pool *p, part_fn fn, void *arg, bool shared, int nparts)
{
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    p->shared = shared;
    p->nparts = nparts;
    p->gen++;
    if (shared) {
        for (int t = 0; t < p->n; t++) {
            uint64_t lo = (uint64_t)nparts * (uint64_t)t / (uint64_t)p->n;
            uint64_t hi = (uint64_t)nparts * (uint64_t)(t + 1) / (uint64_t)p->n;
            __atomic_store_n(&p->blocks[t].w, lo << 32 | hi, __ATOMIC_RELAXED);
        }
        p->open = true;
    } else {
        p->pending = p->n - 1;
    }
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
}

/* Runs fn over nparts parts, taken as in pool_run. */
static void pool_run_parts(pool *p, part_fn fn, void *arg, int nparts)
{
    if (p->n <= 1 || nparts <= 1) {
        fn(arg, 0, 1);
        return;
    }
    pool_start(p, fn, arg, true, nparts);
    pool_take_parts(p, 0, fn, arg, nparts);
    /* Every part is taken, by this thread or by one that entered: once those have left, all
     * are done. */
    pthread_mutex_lock(&p->mu);
    p->open = false;
    while (p->active > 0)
        pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

/* Runs fn over POOL_PARTS_PER_THREAD parts a thread (see the design note above). */
static void pool_run(pool *p, part_fn fn, void *arg)
{
    pool_run_parts(p, fn, arg, p->n * POOL_PARTS_PER_THREAD);
}

/* Runs fn(arg, i, n) once on each of the n threads (the caller is part 0). */
static void pool_run_threads(pool *p, part_fn fn, void *arg)
{
    if (p->n <= 1) {
        fn(arg, 0, 1);
        return;
    }
    pool_start(p, fn, arg, false, p->n);
    fn(arg, 0, p->n);
    pthread_mutex_lock(&p->mu);
    while (p->pending > 0)
        pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

static void pool_fini(pool *p)
{
    if (p->th == NULL) return;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n; i++)
        pthread_join(p->th[i], NULL);
    free(p->th);
    free(p->blocks);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->go);
    pthread_cond_destroy(&p->done);
}

static int pool_init(pool *p, int n)
{
    memset(p, 0, sizeof *p);
    p->n = n < 1 ? 1 : n;
    if (p->n == 1) return CM_OK;
    p->th = calloc((size_t)p->n, sizeof *p->th);
    p->blocks = aligned_alloc(64, (size_t)p->n * sizeof *p->blocks);
    if (p->th == NULL || p->blocks == NULL) {
        free(p->th);
        free(p->blocks);
        p->th = NULL;
        p->blocks = NULL;
        return CM_ENOMEM;
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    for (int i = 1; i < p->n; i++) {
        pool_arg *pa = malloc(sizeof *pa);
        if (pa == NULL) return CM_ENOMEM;
        pa->p = p;
        pa->part = i;
        if (pthread_create(&p->th[i], NULL, pool_main, pa) != 0) {
            free(pa);
            p->n = i;
            return CM_ERR;
        }
    }
    return CM_OK;
}

/* Part `part` of `nparts` of [0, n): a contiguous range. */
static void part_range(size_t n, int part, int nparts, size_t *i0, size_t *i1)
{
    *i0 = n * (size_t)part / (size_t)nparts;
    *i1 = n * (size_t)(part + 1) / (size_t)nparts;
}

/*
 * Element-wise work on whole rows of a row-major matrix Y (B x n): a layer's bias and ReLU, or
 * the ReLU mask of its gradient. It runs on the rows of each GEMM tile right after the tile,
 * by the same thread while they are in cache; each element is transformed alone, so neither
 * who runs it nor when can change a bit.
 */
typedef struct rows_op {
    void (*fn)(const struct rows_op *op, size_t i0, size_t i1);
    float *Y;
    const float *aux; /* bias_act: the bias (n); relu_mask: the layer's output (B x n) */
    uint32_t n;
    float floor_; /* bias_act: 0 with ReLU, -inf without */
} rows_op;

/* Y = max(Y + bias, floor): one vectorisable loop for ReLU and identity. */
static void bias_act(const rows_op *op, size_t i0, size_t i1)
{
    for (size_t i = i0; i < i1; i++) {
        float *y = op->Y + i * op->n;
        for (uint32_t j = 0; j < op->n; j++) {
            float v = y[j] + op->aux[j];
            y[j] = v < op->floor_ ? op->floor_ : v; /* NaN passes through, as it must */
        }
    }
}

/* dY = 0 where the ReLU's output was not positive: a select, not a branch (half the signs are
 * unpredictable). */
static void relu_mask(const rows_op *op, size_t i0, size_t i1)
{
    for (size_t i = i0 * op->n; i < i1 * op->n; i++)
        op->Y[i] = op->aux[i] <= 0.0f ? 0.0f : op->Y[i];
}

typedef struct rows_job {
    const rows_op *op;
    size_t rows;
} rows_job;

static void rows_part(void *arg, int part, int nparts)
{
    const rows_job *j = arg;
    size_t i0, i1;
    part_range(j->rows, part, nparts, &i0, &i1);
    j->op->fn(j->op, i0, i1);
}

static void rows_run(pool *p, const rows_op *op, size_t rows)
{
    rows_job j = {op, rows};
    pool_run(p, rows_part, &j);
}

/* C (M x N) = op(A) op(B), row-major, computed as `tiles` calls over equal ranges of whole rows
 * (by_cols 0) or whole columns (by_cols 1) of C; then epi (optional) on every row of C. */
typedef struct gemm {
    enum CBLAS_TRANSPOSE ta, tb;
    int M, N, K, lda, ldb, ldc;
    const float *A, *B;
    float *C;
    const rows_op *epi;
    int tiles, by_cols;
    gemm_kind kind;
    /* bf16: the operand all tiles share (A when by_cols, else B), packed over the whole K by
     * gemm_share; NULL: each call packs both */
    const void *pk;
    /* GEMM_OWN, a forward layer of a packed tower: op(B), the layer's W^T, as cm_gemm_f32_pack
     * lays it out (backend_cpu_tower); NULL: each call packs B */
    const float *pw;
} gemm;

/* Below this many multiply-adds a GEMM is one call: not worth waking threads for. */
#define GEMM_SPLIT_MIN 2e5
/* A tile is at least this many rows (columns) wide: each tile packs the whole of the other
 * operand again, a cost of 1/width per multiply-add (measured: halving the dW GEMMs' 128-wide
 * tiles to 64 costs ~8%, cutting forward GEMMs from 2048 rows into 8 tiles ~2%). */
#define GEMM_MIN_TILE 128
#define GEMM_MAX_TILES 8

/*
 * How a GEMM is cut: from its shape alone. OpenBLAS picks its kernel per call from the call's
 * shape (its small-matrix and direct kernels below ~1e6 multiply-adds sum in another order
 * than the packed kernel: C = X W^T of the 128 -> 1 output layer differed in most rows between
 * one call of 2048 rows and two of 1024), so cutting by the thread count made the bits depend
 * on it. Fixed tiles make the same calls for any count; threads only share them out. The cut
 * runs along the longer side of C, into a power of two of tiles (balanced for 1, 2, 4, 8
 * threads).
 */
static void gemm_tiles(gemm *g)
{
    g->by_cols = g->N > g->M;
    int len = g->by_cols ? g->N : g->M;
    g->tiles = 1;
    if ((double)g->M * g->N * g->K < GEMM_SPLIT_MIN) return;
    while (g->tiles < GEMM_MAX_TILES && len / (g->tiles * 2) >= GEMM_MIN_TILE)
        g->tiles *= 2;
}

/* Tile t of the GEMM over its inner indexes [k0, k1), into C (g->C, or a buffer of its
 * shape); the epilogue runs only over the whole inner range. */
static void gemm_tile_part(const gemm *g, int t, int k0, int k1, float *C)
{
    int len = g->by_cols ? g->N : g->M;
    int i0 = (int)((int64_t)len * t / g->tiles), i1 = (int)((int64_t)len * (t + 1) / g->tiles);
    if (i1 <= i0) return;
    const float *A = g->A + (g->ta == CblasNoTrans ? (size_t)k0 : (size_t)k0 * g->lda);
    const float *B = g->B + (g->tb == CblasNoTrans ? (size_t)k0 * g->ldb : (size_t)k0);
    int M = g->M, N = g->N;
    if (g->by_cols) {
        B += g->tb == CblasNoTrans ? (size_t)i0 : (size_t)i0 * g->ldb;
        C += i0;
        N = i1 - i0;
    } else {
        A += g->ta == CblasNoTrans ? (size_t)i0 * g->lda : (size_t)i0;
        C += (size_t)i0 * g->ldc;
        M = i1 - i0;
    }
    /* cm_gemm_bf16 and cm_gemm_f32 fail only for their packing scratch (a few hundred KiB a
     * thread, kept): then OpenBLAS sums this tile, as correct and only not the same bits. */
    const void *pa = g->pk && g->by_cols ? g->pk : NULL, *pb = g->pk && !g->by_cols ? g->pk : NULL;
    int ta = g->ta == CblasTrans, tb = g->tb == CblasTrans, rc = CM_EINVAL;
    if (g->kind == GEMM_BF16)
        rc = cm_gemm_bf16_pre(ta, tb, M, N, k1 - k0, A, g->lda, pa, B, g->ldb, pb, g->K, k0, C,
                              g->ldc);
    else if (g->pw != NULL && (!g->by_cols || i0 % CM_GEMM_F32_PANEL == 0)) /* else pack B */
        rc = cm_gemm_f32_pre(own_path(g->kind), ta, M, N, k1 - k0, A, g->lda, g->pw,
                             g->by_cols ? i0 : 0, C, g->ldc);
    else if (g->kind != GEMM_BLAS)
        rc = cm_gemm_f32(own_path(g->kind), ta, tb, M, N, k1 - k0, A, g->lda, B, g->ldb, C, g->ldc);
    if (rc != CM_OK)
        cblas_sgemm(CblasRowMajor, g->ta, g->tb, M, N, k1 - k0, 1.0f, A, g->lda, B, g->ldb, 0.0f, C,
                    g->ldc);
    if (g->epi != NULL && !g->by_cols && k0 == 0 && k1 == g->K)
        g->epi->fn(g->epi, (size_t)i0, (size_t)i1);
}

static void gemm_tile(const gemm *g, int t)
{
    gemm_tile_part(g, t, 0, g->K, g->C);
}

/* Part `part` of `nparts` runs a contiguous range of the tiles. */
static void gemm_part(void *arg, int part, int nparts)
{
    const gemm *g = arg;
    size_t t0, t1;
    part_range((size_t)g->tiles, part, nparts, &t0, &t1);
    for (size_t t = t0; t < t1; t++)
        gemm_tile(g, (int)t);
}

/* The operand every tile of a GEMM shares, packed for cm_gemm_bf16_pre into out (rows in
 * blocks of 32 dealt to the parts): A when the tiles are column ranges, else B. */
typedef struct share_job {
    const gemm *g;
    void *out;
} share_job;

static void share_rows(const gemm *g, int *b, int *trans, int *rows, const float **X, int *ld)
{
    *b = !g->by_cols;
    *trans = g->by_cols ? g->ta == CblasTrans : g->tb == CblasTrans;
    *rows = g->by_cols ? g->M : g->N;
    *X = g->by_cols ? g->A : g->B;
    *ld = g->by_cols ? g->lda : g->ldb;
}

static void share_part(void *arg, int part, int nparts)
{
    const share_job *j = arg;
    int b, trans, rows, ld;
    const float *X;
    share_rows(j->g, &b, &trans, &rows, &X, &ld);
    size_t r0, r1;
    part_range((size_t)(rows + 31) / 32, part, nparts, &r0, &r1);
    if (r1 > r0)
        cm_gemm_bf16_pack(b, trans, rows, j->g->K, X, ld, (int)r0 * 32, (int)r1 * 32, j->out);
}

/* bf16, more than one tile: packs the shared operand once into out (cap bytes) on the pool
 * and points g->pk at it, where it fits; otherwise every tile packs its own. Without it each
 * of a forward GEMM's 8 tiles packed the whole weight matrix again, and each of a dW GEMM's
 * column tiles the whole output gradient. */
static void gemm_share(pool *p, gemm *g, void *out, size_t cap)
{
    g->pk = NULL;
    if (g->kind != GEMM_BF16 || g->tiles < 2 || out == NULL) return;
    int b, trans, rows, ld;
    const float *X;
    share_rows(g, &b, &trans, &rows, &X, &ld);
    if (cm_gemm_bf16_packed_size(rows, g->K) > cap) return;
    share_job j = {g, out};
    pool_run(p, share_part, &j);
    g->pk = out;
}

/* Runs a GEMM cut by gemm_tiles: its tiles on the pool, then the epilogue where the tiles
 * held no whole row. */
static void gemm_run(pool *p, const gemm *g0)
{
    gemm g = *g0;
    gemm_share(p, &g, p->bf16_pk, p->bf16_pk_cap);
    if (g.tiles == 1)
        gemm_tile(&g, 0);
    else
        pool_run(p, gemm_part, &g);
    if (g.epi != NULL && g.by_cols) rows_run(p, g.epi, (size_t)g.M);
}

/* pw: B packed (gemm.pw), or NULL. */
static void sgemm(pool *p, enum CBLAS_TRANSPOSE ta, enum CBLAS_TRANSPOSE tb, int M, int N, int K,
                  const float *A, int lda, const float *B, int ldb, float *C, int ldc,
                  const rows_op *epi, const float *pw)
{
    gemm g = {ta, tb, M, N, K, lda, ldb, ldc, A, B, C, epi, 1, 0, p->kind, NULL, pw};
    gemm_tiles(&g);
    gemm_run(p, &g);
}

/* The layer's dW = dY^T X (out x in) for a batch of B: its shape and tiles, no operands. */
static gemm dw_shape(const model_layer *ly, uint32_t B)
{
    gemm g = {.ta = CblasTrans,
              .tb = CblasNoTrans,
              .M = (int)ly->out,
              .N = (int)ly->in,
              .K = (int)B,
              .lda = (int)ly->out,
              .ldb = (int)ly->in,
              .ldc = (int)ly->in,
              .tiles = 1};
    gemm_tiles(&g);
    return g;
}

/*
 * The dense-gradient phase also cuts each dW GEMM along its inner index (the batch) into
 * chunks of ~DW_UNIT_MACS multiply-adds a tile, so that its units are small: the phase runs on
 * whichever threads have a core (dw_phase_part, gap_main), and a thread that finds the list
 * empty waits for the last unit another is running (one tile of the first layer's dW was
 * ~2.3 ms). Unlike narrower tiles, chunks pack nothing twice. Chunk 0 writes dW, chunk j its own
 * buffer, added into dW in chunk order once the phase is over: fixed by the GEMM's shape, so
 * the same bits for any thread count.
 */
#define DW_UNIT_MACS 2.5e7
#define DW_MIN_CHUNK 256
#define DW_MAX_CHUNKS 8

static int dw_chunks(const gemm *g)
{
    int n = 1;
    double per_tile = (double)g->M * g->N * g->K / g->tiles;
    while (n < DW_MAX_CHUNKS && g->K / (n * 2) >= DW_MIN_CHUNK &&
           per_tile / (n * 2) >= DW_UNIT_MACS)
        n *= 2;
    return n;
}

/*
 * The factorized first layer's state (see "The factorized first layer" below). Per key arrays
 * are sized at create; the per-batch ones grow with the batch (a failed growth just leaves
 * that batch to the GEMM).
 */
/* The factorized layer's kernel sets (fact_sets): each gives the portable set's bits. */
typedef enum fact_isa { FACT_ISA_PORTABLE, FACT_ISA_AVX2, FACT_ISA_AVX512 } fact_isa;

typedef struct fact {
    bool on;    /* the model and flags allow it (fact_init) */
    bool force; /* BACKEND_FACTORED: on every batch, whatever the cost model says */
    /* the vector kernels that run (d 16, H a multiple of FACT_COLS, the CPU has them), or the
     * portable ones */
    fact_isa isa;
    uint32_t F, d, D, H, in, wb, nblk; /* wb: a forward column block's width; nblk = H / wb */
    uint32_t gb, ngb;                  /* the backward's column blocks: gb wide, ngb = H / gb */
    float *wt; /* W1^T in column blocks: W1[h][i] at wt[((h / wb) * in + i) * wb + h % wb] */
    float *wf; /* the fields' blocks of W1, row by row: W1[h][f d + q] at wf[(f H + h) d + q] */
    model_units own; /* a batch's units where it comes without (model_batch.units) */
    /* The step's batch's units (model_units; its own, or fact.own): */
    const uint32_t *field_ptr, *ent_unit, *unit_key, *unit_field, *unit_ptr, *ue_s, *key_ptr,
        *key_units;
    const float *ue_v;
    /* cap_pg floats: P by column blocks of wb (forward), then, for the portable kernels, G
     * by column blocks of 16 (backward: G[unit][h] at pg[(h / 16 * n_units + unit) * 16 +
     * h % 16]) */
    float *pg;
    float *dep; /* in pg after G: each unit's row gradient part of each backward block */
    size_t cap_pg;
    uint32_t n_units;
} fact;

/* n bytes on 2 MiB pages where the kernel has them (transparent huge pages, advised): for
 * buffers read at random rows, where nearly every row is another 4 KiB page's TLB miss. */
#define HUGE_PAGE ((size_t)2 << 20)
static void *huge_alloc(size_t n)
{
    if (n < HUGE_PAGE / 2) return aligned_alloc(64, (n + 63) / 64 * 64);
    size_t len = (n + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    void *p = aligned_alloc(HUGE_PAGE, len);
    if (p != NULL) (void)madvise(p, len, MADV_HUGEPAGE);
    return p;
}

typedef struct cpu {
    pool pool;
    /* The dense-gradient phase of a hooked step (dw_phase): phase_gen counts phases, joined_gen
     * is the phase backend_ops.join released all threads into. */
    pthread_mutex_t jmu;
    pthread_cond_t jcv;
    uint64_t phase_gen, joined_gen;
    /* The gap filler (gap_main): a background thread that takes dense-gradient units of a
     * hooked phase until it is joined, only when nothing else wants a core. */
    pthread_t gap_th;
    bool gap_started, gap_stop, gap_busy;
    struct dw_phase *gap_ph; /* the phase it may work on (jmu) */
    model_cfg m;
    model_layout l;
    uint32_t max_b, max_u;
    float *xe, *dxe;         /* B rows of F*d pooled embeddings and their gradient, stride ldxe */
    float *own_xe, *own_dxe; /* their buffers when they are not in and din (dlrm) */
    float *dz0;              /* dlrm: B x d, the bottom MLP's output gradient */
    uint32_t ldxe;
    float *xl, *dxl; /* B x F pooled first-order weights (lr, deepfm) */
    float *in, *din; /* B x top_in: the top MLP's input */
    float *act[MODEL_MAX_LAYERS + 1], *bact[MODEL_MAX_LAYERS]; /* layer outputs */
    /* Their gradients, one buffer a layer: the backward pass computes every dX first (the
     * row gradients need only those) and the dW GEMMs after, from these. */
    float *gact[MODEL_MAX_LAYERS + 1], *gbact[MODEL_MAX_LAYERS];
    float *logit, *dlogit;            /* B */
    float *dw_part[MODEL_MAX_LAYERS]; /* top layer i's dW chunks 1.. (dw_chunks) */
    /* bf16: top layer i's output gradient packed for its dW units (gemm_share), dw_pk_cap[i]
     * bytes */
    void *dw_pk[MODEL_MAX_LAYERS];
    size_t dw_pk_cap[MODEL_MAX_LAYERS];
    fact fx;
} cpu;

static int fact_init(cpu *c, uint32_t flags);
static void fact_free(fact *x);

static void cpu_destroy(void *state)
{
    cpu *c = state;
    if (c == NULL) return;
    if (c->gap_started) {
        pthread_mutex_lock(&c->jmu);
        c->gap_stop = true;
        pthread_cond_broadcast(&c->jcv);
        pthread_mutex_unlock(&c->jmu);
        pthread_join(c->gap_th, NULL);
    }
    pool_fini(&c->pool);
    pthread_mutex_destroy(&c->jmu);
    pthread_cond_destroy(&c->jcv);
    free(c->own_xe);
    free(c->own_dxe);
    free(c->dz0);
    free(c->xl);
    free(c->dxl);
    free(c->in);
    free(c->din);
    for (int i = 0; i < MODEL_MAX_LAYERS + 1; i++)
        free(c->act[i]);
    for (int i = 0; i < MODEL_MAX_LAYERS; i++)
        free(c->bact[i]);
    for (int i = 0; i < MODEL_MAX_LAYERS + 1; i++)
        free(c->gact[i]);
    for (int i = 0; i < MODEL_MAX_LAYERS; i++)
        free(c->gbact[i]);
    free(c->logit);
    free(c->dlogit);
    for (int i = 0; i < MODEL_MAX_LAYERS; i++) {
        free(c->dw_part[i]);
        free(c->dw_pk[i]);
    }
    free(c->pool.bf16_pk);
    fact_free(&c->fx);
    free(c);
}

char *openblas_get_corename(void);

const char *backend_cpu_blas_core(void)
{
    return openblas_get_corename();
}

const char *backend_cpu_kernels(void)
{
    if (!cm_gemm_f32_simd_available()) return openblas_get_corename();
    return strcmp(cm_gemm_f32_path_name(CM_GEMM_F32_BEST), "avx512") == 0 ? "ember-avx512"
                                                                          : "ember-avx2";
}

static void *gap_main(void *arg);

/* The GEMMs a state created with these flags runs (backend_cpu_kernels). */
static gemm_kind gemm_kind_of(uint32_t flags)
{
    bool own = cm_gemm_f32_simd_available() && !(flags & BACKEND_OPENBLAS);
    return (flags & BACKEND_BF16)               ? GEMM_BF16
           : own && (flags & BACKEND_NO_SIMD)   ? GEMM_OWN_PORTABLE
           : own && (flags & BACKEND_NO_AVX512) ? GEMM_OWN_AVX2
           : own                                ? GEMM_OWN
                                                : GEMM_BLAS;
}

static int cpu_create(const model_cfg *m, const model_layout *l, uint32_t max_b, uint32_t max_u,
                      uint32_t threads, uint32_t flags, void **state, char **errptr)
{
    /* BACKEND_TF32 is the GPU's; BACKEND_BF16 is refused where it would not run as asked. */
    if ((flags & BACKEND_BF16) && !cm_gemm_bf16_available())
        return cm_err(errptr, CM_EINVAL,
                      "bf16 GEMMs need a CPU with AMX-BF16 and Linux 5.16 or later, which this "
                      "machine lacks; train in fp32 (without --bf16)");
    cpu *c = calloc(1, sizeof *c);
    if (c == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    pthread_mutex_init(&c->jmu, NULL);
    pthread_cond_init(&c->jcv, NULL);
    /* Each GEMM tile one single-threaded OpenBLAS call (above), unless the caller may not
     * change the process's setting (serve). */
    if (!(flags & BACKEND_KEEP_BLAS_THREADS)) openblas_set_num_threads(1);
    if (pool_init(&c->pool, (int)threads) != CM_OK) {
        cpu_destroy(c);
        return cm_err(errptr, CM_ERR, "cannot start %u compute threads", threads);
    }
    c->pool.kind = gemm_kind_of(flags);
    c->m = *m;
    c->l = *l;
    c->max_b = max_b;
    c->max_u = max_u;
    size_t B = max_b, F = m->n_fields, d = m->dim;
    bool ok = true;
#define ALLOC(p, n) ok = ok && ((p) = malloc((n) * sizeof(float) + 1)) != NULL
    /* mlp and deepfm feed the pooled embeddings to the top MLP as the first F*d inputs of each
     * row, so they are pooled straight into `in` and their gradient read from `din`: no copy,
     * clear and add over B x F*d floats a step. dlrm's top MLP takes their interactions. */
    c->ldxe = (uint32_t)(F * d);
    if (m->kind == MODEL_DLRM) {
        ALLOC(c->own_xe, B * F * d);
        ALLOC(c->own_dxe, B * F * d);
        ALLOC(c->dz0, B * d);
    }
    ALLOC(c->xl, B * F);
    ALLOC(c->dxl, B * F);
    ALLOC(c->in, B * (l->top_in + 1));
    ALLOC(c->din, B * (l->top_in + 1));
    for (uint32_t i = 0; i < l->n_top; i++) {
        ALLOC(c->act[i], B * l->top[i].out);
        ok = ok && (c->gact[i] = huge_alloc(B * l->top[i].out * sizeof(float) + 1)) != NULL;
    }
    for (uint32_t i = 0; i < l->n_bot; i++) {
        ALLOC(c->bact[i], B * l->bot[i].out);
        ALLOC(c->gbact[i], B * l->bot[i].out);
    }
    ALLOC(c->logit, B);
    ALLOC(c->dlogit, B);
    for (uint32_t i = 0; i < l->n_top; i++) { /* chunks grow with the batch: max_b's are most */
        gemm g = dw_shape(&l->top[i], max_b);
        int n = dw_chunks(&g);
        if (n > 1) ALLOC(c->dw_part[i], (size_t)(n - 1) * l->top[i].out * l->top[i].in);
    }
#undef ALLOC
    ok = ok && fact_init(c, flags) == CM_OK;
    if (ok && c->pool.kind == GEMM_BF16) {
        /* Shared operands (gemm_share): a layer's weights, or its input or output gradient for
         * batches too small to cut by rows; a dW GEMM's output gradient (or input). */
        const model_layer *ls[2] = {l->top, l->bot};
        uint32_t ns[2] = {l->n_top, l->n_bot};
        size_t cap = 0;
        for (int s = 0; s < 2; s++)
            for (uint32_t i = 0; i < ns[s]; i++) {
                int in = (int)ls[s][i].in, out = (int)ls[s][i].out, mb = (int)max_b;
                size_t v[4] = {cm_gemm_bf16_packed_size(out, in), cm_gemm_bf16_packed_size(in, out),
                               cm_gemm_bf16_packed_size(mb, in), cm_gemm_bf16_packed_size(mb, out)};
                for (int k = 0; k < 4; k++)
                    cap = v[k] > cap ? v[k] : cap;
            }
        c->pool.bf16_pk_cap = cap;
        ok = (c->pool.bf16_pk = aligned_alloc(64, (cap + 63) / 64 * 64 + 64)) != NULL;
        for (uint32_t i = 0; ok && i < l->n_top; i++) {
            size_t a = cm_gemm_bf16_packed_size((int)l->top[i].out, (int)max_b),
                   b = cm_gemm_bf16_packed_size((int)l->top[i].in, (int)max_b);
            c->dw_pk_cap[i] = a > b ? a : b;
            ok = (c->dw_pk[i] = aligned_alloc(64, (c->dw_pk_cap[i] + 63) / 64 * 64 + 64)) != NULL;
        }
    }
    if (!ok) {
        cpu_destroy(c);
        return cm_err(errptr, CM_ENOMEM, "out of memory for batches of %u", max_b);
    }
    if (c->pool.n > 1) c->gap_started = pthread_create(&c->gap_th, NULL, gap_main, c) == 0;
    c->xe = c->own_xe;
    c->dxe = c->own_dxe;
    if (m->kind != MODEL_DLRM && l->emb_table >= 0) {
        c->xe = c->in;
        c->dxe = c->din;
        c->ldxe = l->top_in;
    }
    *state = c;
    return CM_OK;
}

/* X = A * E over the batch's CSR rows; CSR row s*F+f (sample s, field f) is the d floats at
 * X + s*ldx + f*d, so a sample's pooled fields can be part of a wider row. */
typedef struct spmm_job {
    const model_batch *b;
    const float *E;
    uint32_t d, ldx;
    float *X;
} spmm_job;

/* Entries of A ahead whose row of E spmm asks the cache for. */
#define SPMM_AHEAD 16

/* Samples are independent: each part pools its own range. */
static void spmm_part(void *arg, int part, int nparts)
{
    const spmm_job *j = arg;
    const model_batch *b = j->b;
    const uint32_t d = j->d, F = b->F;
    size_t s0, s1;
    part_range(b->B, part, nparts, &s0, &s1);
    const float *E = j->E;
    if (d == 16) { /* the common dim: the sum stays in registers (same adds, same order) */
        /* The rows were written by the puller on another core, and X's rows were last touched
         * a step ago: ask for both a little ahead. */
        const uint32_t kend = b->row_ptr[s1 * F];
        for (size_t s = s0; s < s1; s++) {
            if (s + 2 < s1)
                for (uint32_t f = 0; f <= F; f++) /* one more: a row need not start a line */
                    __builtin_prefetch(j->X + (s + 2) * j->ldx + (size_t)f * 16, 1);
            for (uint32_t f = 0; f < F; f++) {
                size_t r = s * F + f;
                float acc[16] = {0};
                for (uint32_t k = b->row_ptr[r]; k < b->row_ptr[r + 1]; k++) {
                    if (k + SPMM_AHEAD < kend)
                        __builtin_prefetch(E + (size_t)b->col[k + SPMM_AHEAD] * 16);
                    const float *e = E + (size_t)b->col[k] * 16;
                    float v = b->val[k];
                    for (int q = 0; q < 16; q++)
                        acc[q] += v * e[q];
                }
                memcpy(j->X + s * j->ldx + (size_t)f * 16, acc, sizeof acc);
            }
        }
        return;
    }
    for (size_t s = s0; s < s1; s++)
        for (uint32_t f = 0; f < F; f++) {
            size_t r = s * F + f;
            float *x = j->X + s * j->ldx + (size_t)f * d;
            memset(x, 0, d * sizeof(float));
            for (uint32_t k = b->row_ptr[r]; k < b->row_ptr[r + 1]; k++) {
                const float *e = E + (size_t)b->col[k] * d;
                float v = b->val[k];
                for (uint32_t q = 0; q < d; q++)
                    x[q] += v * e[q];
            }
        }
}

static void spmm(pool *p, const model_batch *b, const float *E, uint32_t d, float *X, uint32_t ldx)
{
    spmm_job j = {b, E, d, ldx, X};
    pool_run(p, spmm_part, &j);
}

/* dE = A^T * dX (dE overwritten), dX laid out as spmm's X. */
typedef struct spmm_t_job {
    const model_batch *b;
    const float *dX;
    uint32_t d, ldx;
    float *dE;
} spmm_t_job;

/* Each part owns a range of dE's rows and adds into them in sample order: the sums are the same
 * bits for any number of parts, and no two threads write a line. With A's columns (t_ptr) a
 * row is summed in registers and stored once; without, every part reads all of A. */
static void spmm_t_part(void *arg, int part, int nparts)
{
    const spmm_t_job *j = arg;
    const model_batch *b = j->b;
    const uint32_t d = j->d, F = b->F;
    size_t u0, u1;
    part_range(b->U, part, nparts, &u0, &u1);
    if (b->t_ptr != NULL && d == 16) {
        const uint32_t eend = b->t_ptr[u1];
        for (size_t u = u0; u < u1; u++) {
            float acc[16] = {0};
            for (uint32_t e = b->t_ptr[u]; e < b->t_ptr[u + 1]; e++) {
                if (e + SPMM_AHEAD < eend) { /* the gradient rows lie all over dX */
                    uint32_t ra = b->t_row[e + SPMM_AHEAD], sa = ra / F;
                    __builtin_prefetch(j->dX + (size_t)sa * j->ldx + (size_t)(ra - sa * F) * 16);
                }
                uint32_t r = b->t_row[e], s = r / F;
                const float *g = j->dX + (size_t)s * j->ldx + (size_t)(r - s * F) * 16;
                float v = b->t_val[e];
                for (int q = 0; q < 16; q++)
                    acc[q] += v * g[q];
            }
            memcpy(j->dE + u * 16, acc, sizeof acc);
        }
        return;
    }
    if (b->t_ptr != NULL) {
        for (size_t u = u0; u < u1; u++) {
            float *o = j->dE + u * d;
            memset(o, 0, d * sizeof(float));
            for (uint32_t e = b->t_ptr[u]; e < b->t_ptr[u + 1]; e++) {
                uint32_t r = b->t_row[e], s = r / F;
                const float *g = j->dX + (size_t)s * j->ldx + (size_t)(r - s * F) * d;
                float v = b->t_val[e];
                for (uint32_t q = 0; q < d; q++)
                    o[q] += v * g[q];
            }
        }
        return;
    }
    memset(j->dE + u0 * d, 0, (u1 - u0) * d * sizeof(float));
    for (size_t s = 0; s < b->B; s++)
        for (uint32_t f = 0; f < b->F; f++) {
            size_t r = s * b->F + f;
            const float *g = j->dX + s * j->ldx + (size_t)f * d;
            for (uint32_t k = b->row_ptr[r]; k < b->row_ptr[r + 1]; k++) {
                uint32_t u = b->col[k];
                if (u < u0 || u >= u1) continue;
                float *e = j->dE + (size_t)u * d;
                float v = b->val[k];
                for (uint32_t q = 0; q < d; q++)
                    e[q] += v * g[q];
            }
        }
}

static void spmm_t(pool *p, const model_batch *b, const float *dX, uint32_t d, uint32_t ldx,
                   float *dE)
{
    spmm_t_job j = {b, dX, d, ldx, dE};
    /* Without A's columns every part scans all of A: one part a thread, not several. */
    if (b->t_ptr != NULL)
        pool_run(p, spmm_t_part, &j);
    else
        pool_run_threads(p, spmm_t_part, &j);
}

/* Layer weight matrices handed to a GEMM on this thread as they lie in params (which the GEMM
 * packs into its own layout in the call: ember's, or OpenBLAS's), plus one for each step that
 * laid out the factorized first layer's blocks from them (backend_cpu_weight_packs). A thread
 * counts its own: the forward pass's all fall to the stepping thread. */
static __thread uint64_t weight_packs;

uint64_t backend_cpu_weight_packs(void)
{
    return weight_packs;
}

/* Y = act(X W^T + b) for B rows; pw: W^T packed (gemm.pw), or NULL. */
static void layer_fwd(pool *pl, const model_layer *ly, const float *P, const float *X, float *Y,
                      uint32_t B, const float *pw)
{
    rows_op epi = {bias_act, Y, P + ly->b, ly->out, ly->relu ? 0.0f : -INFINITY};
    if (pw == NULL) weight_packs++;
    sgemm(pl, CblasNoTrans, CblasTrans, (int)B, (int)ly->out, (int)ly->in, X, (int)ly->in,
          P + ly->w, (int)ly->in, Y, (int)ly->out, &epi, pw);
}

/* The layer's input gradient dX (B x in) from its masked dY (B x out); `below`, when dX is the
 * output gradient of a ReLU layer below whose output is Y_below, masks it on the way. */
static void layer_bwd_dx(pool *pl, const model_layer *ly, const float *P, const float *dY,
                         float *dX, const model_layer *below, const float *Y_below, uint32_t B)
{
    rows_op epi = {relu_mask, dX, Y_below, ly->in, 0.0f};
    weight_packs++;
    sgemm(pl, CblasNoTrans, CblasNoTrans, (int)B, (int)ly->in, (int)ly->out, dY, (int)ly->out,
          P + ly->w, (int)ly->in, dX, (int)ly->in, below && below->relu ? &epi : NULL, NULL);
}

/* db[j] = sum over rows of dY[., j], each column summed in row order by one part. */
typedef struct colsum_job {
    const float *dY;
    float *db;
    uint32_t B, n;
} colsum_job;

static void colsum_part(void *arg, int part, int nparts)
{
    const colsum_job *j = arg;
    size_t j0, j1;
    part_range(j->n, part, nparts, &j0, &j1);
    memset(j->db + j0, 0, (j1 - j0) * sizeof(float));
    for (size_t i = 0; i < j->B; i++)
        for (size_t q = j0; q < j1; q++)
            j->db[q] += j->dY[i * j->n + q];
}

/* The layer's dW = dY^T X (out x in, into dP), cut into its tiles. */
static gemm dw_gemm(const model_layer *ly, const float *X, const float *dY, float *dP, uint32_t B)
{
    gemm g = dw_shape(ly, B);
    g.A = dY;
    g.B = X;
    g.C = dP + ly->w;
    return g;
}

/* dW and db of the layer into dP (overwritten) from its input X and its masked dY. */
static void layer_bwd_dw(pool *pl, const model_layer *ly, const float *X, const float *dY,
                         float *dP, uint32_t B)
{
    gemm g = dw_gemm(ly, X, dY, dP, B);
    g.kind = pl->kind;
    gemm_run(pl, &g);
    colsum_job j = {dY, dP + ly->b, B, ly->out};
    if (ly->out < 64)
        colsum_part(&j, 0, 1);
    else
        pool_run(pl, colsum_part, &j);
}

/* Runs the MLP stack ly[0..n) on X; returns the last layer's output buffer. pw: the layers'
 * W^T packed (gemm.pw), or NULL. */
static const float *stack_fwd(pool *pl, const model_layer *ly, uint32_t n, float *const *act,
                              const float *P, const float *X, uint32_t B, float *const *pw)
{
    const float *in = X;
    for (uint32_t i = 0; i < n; i++) {
        layer_fwd(pl, &ly[i], P, in, act[i], B, pw ? pw[i] : NULL);
        in = act[i];
    }
    return in;
}

/* Backward through the stack from dOut (B x last out) to its input gradient dX (B x ly[0].in,
 * skipped when NULL), leaving each layer's masked output gradient in g[i] for stack_bwd_dw. */
static void stack_bwd_dx(pool *pl, const model_layer *ly, uint32_t n, float *const *act,
                         float *const *g, const float *P, const float *dOut, float *dX, uint32_t B)
{
    memcpy(g[n - 1], dOut, (size_t)B * ly[n - 1].out * sizeof(float));
    rows_op mask = {relu_mask, g[n - 1], act[n - 1], ly[n - 1].out, 0.0f};
    if (ly[n - 1].relu) rows_run(pl, &mask, B);
    for (uint32_t i = n; i-- > 1;)
        layer_bwd_dx(pl, &ly[i], P, g[i], g[i - 1], &ly[i - 1], act[i - 1], B);
    if (dX != NULL) layer_bwd_dx(pl, &ly[0], P, g[0], dX, NULL, NULL, B);
}

/* Every layer's dW and db after stack_bwd_dx; X is the stack's input. */
static void stack_bwd_dw(pool *pl, const model_layer *ly, uint32_t n, float *const *act,
                         float *const *g, const float *X, float *dP, uint32_t B)
{
    for (uint32_t i = n; i-- > 0;)
        layer_bwd_dw(pl, &ly[i], i ? act[i - 1] : X, g[i], dP, B);
}

/*
 * The per-sample terms between the pooling and the towers: dlrm's pairwise dot products (top
 * MLP input: z0, then every pair's dot) and deepfm's FM term, forward and backward. Samples
 * are independent, so parts take ranges of them and no bit depends on the split.
 */
typedef enum {
    INTER_DLRM_FWD,
    INTER_DLRM_BWD,
    INTER_FM_FWD,
    INTER_FM_BWD,    /* adds to dxe (the top MLP's input gradient) */
    INTER_FM_BWD_SET /* writes dxe: the factorized first layer leaves it unwritten */
} inter_kind;

typedef struct inter_job {
    const cpu *c;
    inter_kind kind;
    uint32_t B;
    const float *z0; /* dlrm: bottom MLP output, B x d */
    const float *g;  /* backward: dloss/dlogit, B */
} inter_job;

static void inter_part(void *arg, int part, int nparts)
{
    const inter_job *j = arg;
    const cpu *c = j->c;
    const uint32_t F = c->m.n_fields, d = c->m.dim, ti = c->l.top_in;
    const size_t lde = c->ldxe;
    size_t i0, i1;
    part_range(j->B, part, nparts, &i0, &i1);
    for (size_t i = i0; i < i1; i++) {
        const float *ve = c->xe + i * lde;
        switch (j->kind) {
        case INTER_DLRM_FWD: {
            float *row = c->in + i * ti;
            const float *v0 = j->z0 + i * d;
            memcpy(row, v0, d * sizeof(float));
            uint32_t p = d;
            for (uint32_t a = 0; a <= F; a++)
                for (uint32_t e = a + 1; e <= F; e++) {
                    const float *va = a ? ve + (a - 1) * d : v0, *vb = ve + (e - 1) * d;
                    float s = 0;
                    for (uint32_t q = 0; q < d; q++)
                        s += va[q] * vb[q];
                    row[p++] = s;
                }
            break;
        }
        case INTER_DLRM_BWD: {
            const float *row = c->din + i * ti, *v0 = j->z0 + i * d;
            float *dve = c->dxe + i * lde, *dv0 = c->dz0 + i * d;
            memset(dve, 0, (size_t)F * d * sizeof(float));
            memcpy(dv0, row, d * sizeof(float));
            uint32_t p = d;
            for (uint32_t a = 0; a <= F; a++)
                for (uint32_t e = a + 1; e <= F; e++) {
                    const float *va = a ? ve + (a - 1) * d : v0, *vb = ve + (e - 1) * d;
                    float gp = row[p++];
                    float *dva = a ? dve + (a - 1) * d : dv0, *dvb = dve + (e - 1) * d;
                    for (uint32_t q = 0; q < d; q++) {
                        dva[q] += gp * vb[q];
                        dvb[q] += gp * va[q];
                    }
                }
            break;
        }
        case INTER_FM_FWD: {
            float fm = 0;
            for (uint32_t q = 0; q < d; q++) {
                float s = 0, sq = 0;
                for (uint32_t f = 0; f < F; f++) {
                    s += ve[f * d + q];
                    sq += ve[f * d + q] * ve[f * d + q];
                }
                fm += 0.5f * (s * s - sq);
            }
            c->logit[i] += fm;
            break;
        }
        case INTER_FM_BWD:
        case INTER_FM_BWD_SET: {
            float *dv = c->dxe + i * lde;
            const bool set = j->kind == INTER_FM_BWD_SET;
            for (uint32_t q = 0; q < d; q++) {
                float s = 0;
                for (uint32_t f = 0; f < F; f++)
                    s += ve[f * d + q];
                for (uint32_t f = 0; f < F; f++)
                    dv[f * d + q] = (set ? 0.0f : dv[f * d + q]) + j->g[i] * (s - ve[f * d + q]);
            }
            break;
        }
        }
    }
}

static void inter_run(cpu *c, inter_kind kind, uint32_t B, const float *z0, const float *g)
{
    inter_job j = {c, kind, B, z0, g};
    pool_run(&c->pool, inter_part, &j);
}

/*
 * The factorized first layer (mlp, deepfm; fp32). The top MLP's first layer computes, for
 * sample s, Y1[s] = relu(b1 + Wd x[s] + sum_f W_f X_f[s]), X_f[s] = sum of val[k] E[col[k]]
 * over the CSR entries k of row s*F+f, W_f the H x d block of W1 that field f's inputs meet.
 * By associativity the sum is sum_f sum_k val[k] P[(f, col[k])], P[(f, u)] = W_f E[u]: each
 * W_f is applied once per distinct (field, key) pair of the batch, a "unit", instead of once
 * per sample. Backward, with dY1 the layer's masked output gradient and G[(f, u)] the sum of
 * val[k] dY1[s] over the unit's entries:
 *   dE[u] = sum over u's units, in field order, of W_f^T G[(f, u)]    (the row gradients)
 *   dW_f = sum over f's units of G[(f, u)] E[u]^T;  dWd = dY1^T x;  db1 = dY1's column sums.
 * A batch of 2048 samples x 26 fields holds ~53K slots but ~13K units, so the layer's three
 * GEMMs (forward, dX, dW: 2048 x 429 x 256 each) shrink ~4x; for the mlp the pooling (spmm)
 * and its transpose (spmm_t) go as well (deepfm's FM term still needs them).
 *
 * P and G are applied and formed by kernels written for their shapes (OpenBLAS runs GEMMs of
 * K 16 or N 16 at a third of its speed, and a materialized P of 13 MB gathered from L3 cost
 * more than the GEMMs it saved): the forward runs by column blocks of FACT_COLS, a block's P
 * for all units computed and then gathered by every sample while it sits in L2; the backward
 * runs by (column block, field) tasks, eight units of the field at a time, gathering their G
 * rows from dY (in L2) and, while they are in L1, multiplying them by W_f (the row gradients'
 * parts) and adding their terms to dW_f's rows of the block (in L1 too); then it sums each
 * key's units' parts. G itself is never stored (the portable kernels keep it in pg). Summing
 * dW_f there rather than in the dense-gradient phase moves ~1/8 of the layer's work before the
 * emb_ready hook but saves G's 13 MB round trip through L3: whole ipc runs ~+18%. A batch
 * steps on its units (model_units: its (field, key) pairs, their entries, each key's units),
 * which the trainer builds on its builder thread (model_batch.units; ~1 ms a batch that the
 * stepping thread walked alone while the pool waited); a batch without them is indexed here.
 *
 * Each output element has one fixed summation order (below), so the results are the same bits
 * for any thread count; the AVX-512 kernels, the AVX2 ones and the portable ones compute the
 * same bits (fmaf where the vectors fuse, the same orders; the test runs all three):
 *   P[(f,u)][h] = fma chain over q < d from 0 of E[u][q] * W1[h][f d + q];
 *   Y1[s][h]: from b1[h], fma over j < D of x[s][j] W1[h][F d + j], then over the sample's
 *     entries in CSR order of val[k] P[unit k][h]; then max(., 0) (NaN passes);
 *   G[unit][h] = fma chain over the unit's entries (sample order) from 0;
 *   dE of a unit [q]: for each backward column block (gb columns) an fma chain over its h
 *     from 0 of G[h] W1[h][f d + q], the blocks' sums added in block order; the key's row: the
 *     FM term's part (deepfm) or 0, plus its units' in field order;
 *   dW_f[h][q] = fma chain over f's units in unit order from 0 of G[unit][h] E[u][q].
 */
#if defined(__x86_64__) && defined(__GNUC__)
#define FACT_X86 1
#include <immintrin.h>
#endif

/* A forward column block: its P rows for 13,000 units (1.6 MiB) stay in a core's 2 MiB L2
 * while every sample gathers from them. */
#define FACT_COLS 32
#define FACT_NV (FACT_COLS / 16)

static void fact_free(fact *x)
{
    free(x->wt);
    free(x->wf);
    free(x->pg);
    model_units_fini(&x->own);
    memset(x, 0, sizeof *x);
}

/* The factorized layer's shape for the model and flags, no buffers (x->on false: not taken). */
static void fact_shape(fact *x, const model_cfg *m, const model_layout *l, uint32_t flags)
{
    memset(x, 0, sizeof *x);
    x->on = !(flags & (BACKEND_PLAIN | BACKEND_BF16)) &&
            (m->kind == MODEL_MLP || m->kind == MODEL_DEEPFM) && l->emb_table >= 0 &&
            l->n_top >= 2 && l->top[0].in == m->n_fields * m->dim + m->n_dense;
    if (!x->on) return;
    x->force = (flags & BACKEND_FACTORED) != 0;
    x->F = m->n_fields;
    x->d = m->dim;
    x->D = m->n_dense;
    x->H = l->top[0].out;
    x->in = l->top[0].in;
    x->wb = x->H % FACT_COLS == 0 ? FACT_COLS : x->H;
    x->nblk = x->H / x->wb;
    x->gb = x->wb; /* the widest of 256, 128, 64 that H takes */
    for (uint32_t w = 256; w > x->wb; w /= 2)
        if (x->H % w == 0) {
            x->gb = w;
            break;
        }
    x->ngb = x->H / x->gb;
#ifdef FACT_X86
    if (!(flags & BACKEND_NO_SIMD) && x->d == 16 && x->H % FACT_COLS == 0) {
        if (!(flags & BACKEND_NO_AVX512) && __builtin_cpu_supports("avx512f"))
            x->isa = FACT_ISA_AVX512;
        else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
            x->isa = FACT_ISA_AVX2;
    }
#endif
    /* The portable kernels are the vector ones' reference, not a fast path (without FMA in
     * the instruction set fmaf is a library call per multiply-add): where no vector set runs,
     * the backend's own choice is the GEMM, whose BLAS kernels suit the CPU. */
    if (x->isa == FACT_ISA_PORTABLE && !x->force && !(flags & BACKEND_NO_SIMD)) x->on = false;
}

static int fact_init(cpu *c, uint32_t flags)
{
    fact *x = &c->fx;
    fact_shape(x, &c->m, &c->l, flags);
    if (!x->on) return CM_OK;
    x->wt = malloc((size_t)x->in * x->H * sizeof *x->wt);
    x->wf = aligned_alloc(64, ((size_t)x->F * x->H * x->d * sizeof *x->wf + 63) / 64 * 64);
    if (!x->wt || !x->wf) return CM_ENOMEM;
    return CM_OK;
}

/*
 * The cost model: the factorized layer's work grows with the units (P, the row gradients and
 * dW_f cost ~H d multiply-adds a unit, besides the gathers a slot), the GEMM's with the samples
 * (3 H (F d + D) a sample), so it takes the factorized form where units <= FACT_MAX_UNITS of
 * the slots (B F). Measured (tools/bench step, mlp, B 2048, 26 one-hot fields, 2 threads,
 * --plain against --factored, two runs each): 12.8K units (0.24 of the slots) 9.7 against
 * 12.0 ms, 22.6K (0.42) 13.0 against 13.2, 33K (0.62) 16.8 against 13.4, 49K (shared keys,
 * 0.92) 24-35 against 15-16: the step grows ~0.33 ms a thousand units, and the two meet at
 * ~0.39 of the slots. Below it, a little, to stay on the side that wins.
 */
#define FACT_MAX_UNITS 0.35

/* The most units for which a batch of B rows of F fields takes the factorized layer (0:
 * never), the cost model's bound: the batch alone decides, so a run is reproducible. */
static uint32_t fact_max_units(const fact *x, uint32_t B, uint32_t F)
{
    if (!x->on) return 0;
    if (x->force) return UINT32_MAX;
    double most = FACT_MAX_UNITS * (double)B * F;
    return most < 1 ? 0 : (uint32_t)most;
}

/* Whether this batch takes the factorized layer: takes or builds its units (model_units),
 * applies the cost model and sizes its buffers. */
static bool fact_plan(cpu *c, const model_batch *b)
{
    fact *x = &c->fx;
    const uint32_t most = fact_max_units(x, b->B, x->F);
    if (most == 0 || b->B == 0) return false;
    const model_units *u = b->units;
    if (u == NULL) {
        if (model_units_build(&x->own, b, most, NULL) != CM_OK) return false;
        u = &x->own;
    }
    if (u->over || u->n > most) return false;
    x->field_ptr = u->field_ptr;
    x->ent_unit = u->ent_unit;
    x->unit_key = u->unit_key;
    x->unit_field = u->unit_field;
    x->unit_ptr = u->unit_ptr;
    x->ue_s = u->ue_s;
    x->ue_v = u->ue_v;
    x->key_ptr = u->key_ptr;
    x->key_units = u->key_units;
    x->n_units = u->n;
    /* G's blocks of 16 columns are whole even where H is not a multiple of 16. */
    const size_t hg = (x->H + 15) / 16 * 16;
    size_t need = (size_t)x->n_units * (hg + (size_t)x->ngb * x->d) + 16;
    if (need > x->cap_pg) {
        free(x->pg);
        size_t cap = need + need / 4;
        x->pg = huge_alloc(cap * sizeof(float));
        x->cap_pg = x->pg ? cap : 0;
        if (x->pg == NULL) return false;
    }
    x->dep = x->pg + (size_t)x->n_units * hg;
    return true;
}

/* W1^T's column block blk (wb columns of W1's rows) into wt (fact.wt's layout), and those
 * rows' field blocks into wf (fact.wf's), for the backward, unless wf is NULL. */
static void fact_wt_block(const fact *x, const float *W, uint32_t blk, float *wt, float *wf)
{
    float *w = wt + (size_t)blk * x->in * x->wb;
    for (uint32_t o = 0; o < x->wb; o++) {
        const uint32_t h = blk * x->wb + o;
        const float *row = W + (size_t)h * x->in;
        for (uint32_t i = 0; i < x->in; i++)
            w[(size_t)i * x->wb + o] = row[i];
        for (uint32_t f = 0; wf != NULL && f < x->F; f++)
            memcpy(wf + ((size_t)f * x->H + h) * x->d, row + (size_t)f * x->d,
                   x->d * sizeof(float));
    }
}

/* A column block of P: P_b[unit][o] for the block's wb columns, w its block of W1^T. */
static void fact_p_scalar(const fact *x, const float *E, const float *w, float *Pb)
{
    const uint32_t d = x->d, wb = x->wb;
    for (uint32_t i = 0; i < x->n_units; i++) {
        const float *e = E + (size_t)x->unit_key[i] * d;
        const float *wf = w + (size_t)x->unit_field[i] * d * wb;
        for (uint32_t o = 0; o < wb; o++) {
            float acc = 0;
            for (uint32_t q = 0; q < d; q++)
                acc = fmaf(e[q], wf[(size_t)q * wb + o], acc);
            Pb[(size_t)i * wb + o] = acc;
        }
    }
}

/* A column block of Y1 (columns col0..col0+wb of every sample) from P_b. */
static void fact_y_scalar(const fact *x, const model_batch *b, const float *bias, const float *w,
                          const float *Pb, float *Y, uint32_t col0)
{
    const uint32_t F = x->F, D = x->D, wb = x->wb;
    const float *wd = w + (size_t)F * x->d * wb;
    for (uint32_t s = 0; s < b->B; s++)
        for (uint32_t o = 0; o < wb; o++) {
            float acc = bias[col0 + o];
            for (uint32_t j = 0; j < D; j++)
                acc = fmaf(b->dense[(size_t)s * D + j], wd[(size_t)j * wb + o], acc);
            for (uint32_t k = b->row_ptr[(size_t)s * F]; k < b->row_ptr[(size_t)(s + 1) * F]; k++)
                acc = fmaf(b->val[k], Pb[(size_t)x->ent_unit[k] * wb + o], acc);
            Y[(size_t)s * x->H + col0 + o] = acc < 0.0f ? 0.0f : acc;
        }
}

/* G[unit][h] in pg's blocked layout. */
static inline size_t fact_g(const fact *x, uint32_t un, uint32_t h)
{
    return ((size_t)(h / 16) * x->n_units + un) * 16 + h % 16;
}

/* Backward column block b of unit un: its G columns, the block's part of its row gradient:
 * dep[(b * n_units + un) * d + q] = an fma chain over the block's columns h of
 * G[h] W1[h][f d + q], and its term of dW_f's rows of the block: W (dP's first layer weights)
 * [h][f d + q] = fma(G[h], E[u][q], W[h][f d + q]). */
static void fact_gblk_scalar(const fact *x, const float *dY, const float *E, float *W, uint32_t un,
                             uint32_t b)
{
    const uint32_t H = x->H, f = x->unit_field[un], c0 = b * x->gb, c1 = c0 + x->gb;
    for (uint32_t h = c0; h < c1; h++) {
        float acc = 0;
        for (uint32_t e = x->unit_ptr[un]; e < x->unit_ptr[un + 1]; e++)
            acc = fmaf(x->ue_v[e], dY[(size_t)x->ue_s[e] * H + h], acc);
        x->pg[fact_g(x, un, h)] = acc;
    }
    for (uint32_t q = 0; q < x->d; q++) {
        float acc = 0;
        for (uint32_t h = c0; h < c1; h++)
            acc = fmaf(x->pg[fact_g(x, un, h)], x->wf[((size_t)f * H + h) * x->d + q], acc);
        x->dep[((size_t)b * x->n_units + un) * x->d + q] = acc;
    }
    const float *e = E + (size_t)x->unit_key[un] * x->d;
    for (uint32_t h = c0; h < c1; h++)
        for (uint32_t q = 0; q < x->d; q++) {
            float *w = W + (size_t)h * x->in + (size_t)f * x->d + q;
            *w = fmaf(x->pg[fact_g(x, un, h)], e[q], *w);
        }
}

#ifdef FACT_X86
#define FACT_INLINE __attribute__((always_inline)) inline

/* Entries ahead whose rows of dY the backward's gather asks the cache for: rows at random,
 * waited for otherwise (~8% of fact_gblk_avx512's time; the same for P's rows in the forward
 * measured slower). */
#define FACT_AHEAD 4
/* Units ahead whose embedding rows P's kernels ask the cache for (a forward column block takes
 * every unit's row at random from E, which outgrows a 512 KiB L2). */
#define FACT_P_AHEAD 16
/* Units ahead whose row gradient parts the backward's sum by key asks the cache for. */
#define FACT_E_AHEAD 8

/* The vector kernels, once per instruction set (backend_cpu_fact.h). The counts fill each
 * set's registers: 32 of 16 floats, 16 of 8. Sanitizer builds leave them unchecked, as
 * cm_gemm_f32's kernels: checked, every vector load and index step made them the bulk of the
 * suite's longest test under ASan (train_threads, ~200 s of a 300 s limit), and that test
 * holds them to the portable kernels' bits on every batch, which stay checked (an element read
 * out of bounds would show as other bits). */
#define FV_UNCHECKED no_sanitize("address", "undefined")
#define FV(name) name##_avx512
#define FV_TARGET __attribute__((target("avx512f"), FV_UNCHECKED))
#define FV_AVX512 1
#define FV_NU_P 8
#define FV_NU_G 8
#define FV_ROWS 4
#define FV_GCH 8
#include "backend_cpu_fact.h"

#define FV(name) name##_avx2
#define FV_TARGET __attribute__((target("avx2,fma"), FV_UNCHECKED))
#define FV_AVX512 0
#define FV_NU_P 3
#define FV_NU_G 2
#define FV_ROWS 2
#define FV_GCH 4
#include "backend_cpu_fact.h"
#endif

/* fact_gblk_scalar over field f's units, column block b: dW_f's rows of the block from 0. */
static void fact_gblk_portable(const fact *x, const float *dY, const float *E, float *W, uint32_t f,
                               uint32_t b)
{
    for (uint32_t h = b * x->gb; h < (b + 1) * x->gb; h++)
        memset(W + (size_t)h * x->in + (size_t)f * x->d, 0, x->d * sizeof(float));
    for (uint32_t un = x->field_ptr[f]; un < x->field_ptr[f + 1]; un++)
        fact_gblk_scalar(x, dY, E, W, un, b);
}

/* The kernel sets by fact.isa, one interface: a forward column block's P and Y1 columns, and
 * a backward (column block, field) task. */
typedef struct fact_kernels {
    const char *name;
    void (*p)(const fact *x, const float *E, const float *w, float *Pb);
    void (*y)(const fact *x, const model_batch *b, const float *bias, const float *w,
              const float *Pb, float *Y, uint32_t col0);
    void (*gblk)(const fact *x, const float *dY, const float *E, float *W, uint32_t f, uint32_t b);
} fact_kernels;

static const fact_kernels fact_sets[] = {
    [FACT_ISA_PORTABLE] = {"portable", fact_p_scalar, fact_y_scalar, fact_gblk_portable},
#ifdef FACT_X86
    [FACT_ISA_AVX2] = {"avx2", fact_p_avx2, fact_y_avx2, fact_gblk_avx2},
    [FACT_ISA_AVX512] = {"avx512", fact_p_avx512, fact_y_avx512, fact_gblk_avx512},
#endif
};

const char *backend_cpu_fact_kernels(uint32_t flags)
{
    const model_cfg m = {.kind = MODEL_MLP, .n_fields = 1, .dim = 16};
    const model_layout l = {.emb_table = 0, .n_top = 2, .top = {{.in = 16, .out = FACT_COLS}}};
    fact x;
    fact_shape(&x, &m, &l, flags & ~(uint32_t)BACKEND_PLAIN);
    return fact_sets[x.isa].name;
}

typedef struct fact_job {
    cpu *c;
    const float *P;
    const model_batch *b;
    float *demb;     /* backward: the row gradients */
    float *dP;       /* backward: the parameters' gradients (dW_f) */
    bool add;        /* backward: demb holds the FM term's part, to add to (deepfm) */
    uint32_t next;   /* forward: the next column block to take */
    const float *wt; /* forward: W1^T laid out as fact.wt already (backend_cpu_tower), or NULL */
} fact_job;

/* The forward by column blocks, taken in turn by the threads: each block's W1^T, P and Y1
 * columns. A thread writes its blocks' P over one another (its own nth of pg), so that its
 * stores find the lines in L2 rather than asking L3 for a fresh 1.6 MiB a block. */
static void fact_fwd_part(void *arg, int part, int nparts)
{
    (void)nparts;
    fact_job *j = arg;
    cpu *c = j->c;
    const fact *x = &c->fx;
    const model_layer *ly = &c->l.top[0];
    const float *E = j->b->emb[c->l.emb_table];
    if ((uint32_t)part >= x->nblk) return; /* pg holds nblk blocks */
    float *Pb = x->pg + (size_t)part * x->n_units * x->wb;
    for (;;) {
        const uint32_t blk = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (blk >= x->nblk) break;
        const float *w = (j->wt ? j->wt : x->wt) + (size_t)blk * x->in * x->wb;
        if (j->wt == NULL) fact_wt_block(x, j->P + ly->w, blk, x->wt, x->wf);
        fact_sets[x->isa].p(x, E, w, Pb);
        fact_sets[x->isa].y(x, j->b, j->P + ly->b, w, Pb, c->act[0], blk * x->wb);
    }
}

/* The backward, first by (column block, field) tasks, as many parts: G, the block's row
 * gradient parts and dW_f's rows of the block (a field's units in one task, so that each dW_f
 * row is one chain over them in unit order). */
static void fact_bwd_g_part(void *arg, int part, int nparts)
{
    const fact_job *j = arg;
    const cpu *c = j->c;
    const fact *x = &c->fx;
    const float *E = j->b->emb[c->l.emb_table];
    float *W = j->dP + c->l.top[0].w;
    size_t t0, t1;
    part_range((size_t)x->ngb * x->F, part, nparts, &t0, &t1);
    for (size_t t = t0; t < t1; t++) {
        const uint32_t b = (uint32_t)(t / x->F), f = (uint32_t)(t % x->F);
        fact_sets[x->isa].gblk(x, c->gact[0], E, W, f, b);
    }
}

/* Then by key: a unit's part is the sum of its blocks' in block order; the key's row, the FM
 * term's part (deepfm) or 0 plus its units' parts in field order. Element by element: the
 * compiler's vectors add the same bits. */
static void fact_bwd_e_part(void *arg, int part, int nparts)
{
    const fact_job *j = arg;
    const fact *x = &j->c->fx;
    const uint32_t d = x->d;
    size_t u0, u1;
    part_range(j->b->U, part, nparts, &u0, &u1);
    for (size_t u = u0; u < u1; u++) {
        float *row = j->demb + u * d;
        if (!j->add) memset(row, 0, d * sizeof(float));
        for (uint32_t i = x->key_ptr[u]; i < x->key_ptr[u + 1]; i++) {
            const uint32_t un = x->key_units[i];
#ifdef FACT_X86
            /* A key's units are anywhere among the batch's: ask for a later one's part */
            if (i + FACT_E_AHEAD < x->key_ptr[u1])
                _mm_prefetch((const char *)(x->dep + (size_t)x->key_units[i + FACT_E_AHEAD] * d),
                             _MM_HINT_T0);
#endif
            for (uint32_t q = 0; q < d; q++) {
                float t = x->dep[(size_t)un * d + q];
                for (uint32_t b = 1; b < x->ngb; b++)
                    t += x->dep[((size_t)b * x->n_units + un) * d + q];
                row[q] += t;
            }
        }
    }
}

/* The first layer's dWd = dY1^T x (H x D, beside the dW_f in dP) as a dW GEMM of the phase. */
static gemm fact_dense_dw(const cpu *c, const model_batch *b, float *dP)
{
    const fact *x = &c->fx;
    gemm g = {.ta = CblasTrans,
              .tb = CblasNoTrans,
              .M = (int)x->H,
              .N = (int)x->D,
              .K = (int)b->B,
              .lda = (int)x->H,
              .ldb = x->D ? (int)x->D : 1,
              .ldc = (int)x->in,
              .A = c->gact[0],
              .B = b->dense,
              .C = dP + c->l.top[0].w + (size_t)x->F * x->d,
              .tiles = 1};
    gemm_tiles(&g);
    return g;
}

/*
 * A step's dense gradients, after the row gradients: a list of units taken in order from a
 * shared counter (each tile of each layer's dW GEMM, each layer's bias gradient, dlrm's whole
 * bottom MLP). A unit computes the same bits whoever runs it. With an emb_ready hook the
 * caller's push of the rows (and with an in-process PS, its update and the next pull) runs
 * meanwhile on one core, so the phase starts on half the threads and the rest join when the
 * caller says that work is done (backend_ops.join); without one, all start at once.
 */
#define DW_MAX_UNITS (MODEL_MAX_LAYERS * (GEMM_MAX_TILES * DW_MAX_CHUNKS + 1) + 1)

typedef struct dw_phase {
    cpu *c;
    const float *P;
    const model_batch *b;
    float *dP;
    gemm g[MODEL_MAX_LAYERS];
    int chunks[MODEL_MAX_LAYERS]; /* dw_chunks of g */
    struct dw_unit {
        uint16_t layer; /* top layer, or n_top: the bottom MLP */
        int16_t tile;   /* dW tile, or -1: the bias gradient */
        uint8_t chunk;  /* dW tile's inner chunk */
    } unit[DW_MAX_UNITS];
    int n_units, next, early;
    uint64_t gen;
} dw_phase;

static void dw_unit_run(const dw_phase *ph, int u)
{
    const cpu *c = ph->c;
    const model_layout *l = &c->l;
    const struct dw_unit *un = &ph->unit[u];
    uint32_t i = un->layer, B = ph->b->B;
    pool one = {.n = 1, .kind = c->pool.kind};
    if (i == l->n_top) {
        stack_bwd_dx(&one, l->bot, l->n_bot, c->bact, c->gbact, ph->P, c->dz0, NULL, B);
        stack_bwd_dw(&one, l->bot, l->n_bot, c->bact, c->gbact, ph->b->dense, ph->dP, B);
    } else if (un->tile >= 0) {
        const gemm *g = &ph->g[i];
        int j = un->chunk, n = ph->chunks[i];
        float *C = j == 0 ? g->C : c->dw_part[i] + (size_t)(j - 1) * g->M * g->N;
        gemm_tile_part(g, un->tile, (int)((int64_t)g->K * j / n),
                       (int)((int64_t)g->K * (j + 1) / n), C);
    } else {
        colsum_job j = {c->gact[i], ph->dP + l->top[i].b, B, l->top[i].out};
        colsum_part(&j, 0, 1);
    }
}

/* Multiply-adds of unit u (the bottom MLP's backward counted as its dW GEMMs twice over). */
static double dw_unit_cost(const dw_phase *ph, int u, uint32_t B)
{
    const model_layout *l = &ph->c->l;
    uint32_t i = ph->unit[u].layer;
    if (i == l->n_top) {
        double f = 0;
        for (uint32_t k = 0; k < l->n_bot; k++)
            f += 2.0 * l->bot[k].in * l->bot[k].out * B;
        return f;
    }
    if (ph->unit[u].tile < 0) return (double)l->top[i].out * B;
    const gemm *g = &ph->g[i];
    return (double)g->M * g->N * g->K / g->tiles / ph->chunks[i];
}

/* Orders the units largest first, so the phase ends on small ones: a thread that finds the
 * list empty waits at most for a small unit another thread is still running. Each unit writes
 * its own outputs, so the order changes no bit. */
static void dw_units_sort(dw_phase *ph, uint32_t B)
{
    double cost[DW_MAX_UNITS];
    for (int u = 0; u < ph->n_units; u++)
        cost[u] = dw_unit_cost(ph, u, B);
    for (int u = 1; u < ph->n_units; u++) /* insertion sort, stable: at most a few dozen */
        for (int v = u; v > 0 && cost[v] > cost[v - 1]; v--) {
            double tc = cost[v];
            cost[v] = cost[v - 1];
            cost[v - 1] = tc;
            struct dw_unit tu = ph->unit[v];
            ph->unit[v] = ph->unit[v - 1];
            ph->unit[v - 1] = tu;
        }
}

/* Takes the next unit of the list and runs it; false when none is left. */
static bool dw_run_next(dw_phase *ph)
{
    int u = __atomic_fetch_add(&ph->next, 1, __ATOMIC_ACQ_REL);
    if (u >= ph->n_units) return false;
    dw_unit_run(ph, u);
    return true;
}

static void dw_phase_part(void *arg, int part, int nparts)
{
    (void)nparts;
    dw_phase *ph = arg;
    cpu *c = ph->c;
    if (part >= ph->early) {
        pthread_mutex_lock(&c->jmu);
        while (c->joined_gen != ph->gen &&
               __atomic_load_n(&ph->next, __ATOMIC_ACQUIRE) < ph->n_units)
            pthread_cond_wait(&c->jcv, &c->jmu);
        pthread_mutex_unlock(&c->jmu);
    }
    while (dw_run_next(ph)) {
    }
    /* The list is taken: threads still waiting to join have nothing left. */
    pthread_mutex_lock(&c->jmu);
    pthread_cond_broadcast(&c->jcv);
    pthread_mutex_unlock(&c->jmu);
}

/*
 * While a hooked phase waits to be joined, one core runs the caller's push and pull, which
 * block on each other and on the PS in turns and leave that core idle in between. The gap
 * filler runs at background priority (cm_thread_background: any other thread preempts it at
 * once) and takes units in those moments; it stops taking them when the phase is joined.
 */
static void *gap_main(void *arg)
{
    cpu *c = arg;
    cm_thread_background();
    uint64_t seen = 0;
    pthread_mutex_lock(&c->jmu);
    for (;;) {
        while (!c->gap_stop && (c->gap_ph == NULL || c->gap_ph->gen == seen))
            pthread_cond_wait(&c->jcv, &c->jmu);
        if (c->gap_stop) break;
        dw_phase *ph = c->gap_ph;
        seen = ph->gen;
        c->gap_busy = true;
        pthread_mutex_unlock(&c->jmu);
        while (__atomic_load_n(&c->joined_gen, __ATOMIC_ACQUIRE) != ph->gen && dw_run_next(ph)) {
        }
        pthread_mutex_lock(&c->jmu);
        c->gap_busy = false;
        pthread_cond_broadcast(&c->jcv);
    }
    pthread_mutex_unlock(&c->jmu);
    return NULL;
}

/* Adds each dW's chunks 1.. into it (chunk 0), in chunk order, over a part of its elements. */
static void dw_sum_part(void *arg, int part, int nparts)
{
    const dw_phase *ph = arg;
    for (uint32_t i = 0; i < ph->c->l.n_top; i++) {
        const gemm *g = &ph->g[i];
        if (ph->chunks[i] == 1) continue;
        size_t n = (size_t)g->M * g->N, e0, e1;
        part_range(n, part, nparts, &e0, &e1);
        for (int j = 1; j < ph->chunks[i]; j++) {
            const float *src = ph->c->dw_part[i] + (size_t)(j - 1) * n;
            for (size_t e = e0; e < e1; e++)
                g->C[e] += src[e];
        }
    }
}

/* fact: this step computed the first layer factorized (its dW_f is done: only dWd is left). */
static void dw_phase_run(cpu *c, const float *P, const model_batch *b, float *dP, bool fact)
{
    const model_layout *l = &c->l;
    const uint32_t B = b->B;
    dw_phase ph = {.c = c, .P = P, .b = b, .dP = dP};
    for (uint32_t k = l->n_top; k-- > 0;) {
        const gemm *g = &ph.g[k];
        /* Factorized, the first layer's GEMM is left with the dense inputs' columns (dWd; one
         * chunk: dw_sum_part adds chunks as if dW were contiguous, which dWd is not). */
        bool dense_only = k == 0 && fact;
        ph.g[k] = dense_only ? fact_dense_dw(c, b, dP)
                             : dw_gemm(&l->top[k], k ? c->act[k - 1] : c->in, c->gact[k], dP, B);
        ph.g[k].kind = c->pool.kind;
        ph.chunks[k] = dense_only ? 1 : dw_chunks(g);
        for (int t = 0; t <= g->tiles; t++) /* the tiles' chunks, then the bias gradient */
            for (int j = 0; j < (t < g->tiles ? ph.chunks[k] : 1); j++) {
                ph.unit[ph.n_units++] =
                    (struct dw_unit){(uint16_t)k, (int16_t)(t < g->tiles ? t : -1), (uint8_t)j};
            }
    }
    if (c->m.kind == MODEL_DLRM) ph.unit[ph.n_units++] = (struct dw_unit){(uint16_t)l->n_top, 0, 0};
    /* bf16: each dW's shared operand packed once for its tiles, where every chunk starts on a
     * 32-value step of the packed K (cm_gemm_bf16_pre); before any unit can run. */
    for (uint32_t k = 0; k < l->n_top; k++) {
        bool aligned = true;
        for (int j = 1; j < ph.chunks[k]; j++)
            aligned = aligned && (int64_t)ph.g[k].K * j / ph.chunks[k] % 32 == 0;
        if (aligned) gemm_share(&c->pool, &ph.g[k], c->dw_pk[k], c->dw_pk_cap[k]);
    }
    dw_units_sort(&ph, B);
    ph.early = c->pool.n;
    if (b->emb_ready) {
        ph.early = c->pool.n / 2 > 1 ? c->pool.n / 2 : 1;
        pthread_mutex_lock(&c->jmu);
        ph.gen = ++c->phase_gen;
        if (c->gap_started) {
            c->gap_ph = &ph;
            pthread_cond_broadcast(&c->jcv);
        }
        pthread_mutex_unlock(&c->jmu);
        b->emb_ready(b->emb_ready_arg);
    }
    pool_run_threads(&c->pool, dw_phase_part, &ph);
    if (b->emb_ready && c->gap_started) { /* its last unit may still be running */
        pthread_mutex_lock(&c->jmu);
        c->gap_ph = NULL;
        while (c->gap_busy)
            pthread_cond_wait(&c->jcv, &c->jmu);
        pthread_mutex_unlock(&c->jmu);
    }
    pool_run(&c->pool, dw_sum_part, &ph);
}

/*
 * A tower packed once (backend_cpu_tower; serving, whose tower does not change). A step lays
 * out its weights from params every time: each forward GEMM's cm_gemm_f32 packs W^T in the call
 * (every tile of it), and the factorized layer lays out W1's column blocks; for a batch of a
 * few rows that is most of the work. The tower holds them laid out already: each forward
 * layer's W^T in cm_gemm_f32_pack's layout where the GEMMs are ember's (GEMM_OWN; OpenBLAS packs
 * inside its own calls), and W1^T in the factorized layer's blocks where the model takes it.
 * Blocks FACT_COLS wide are the first layer's packed W^T to the float (cm_gemm_f32_pack's panels
 * are as wide), so then the two forms share one copy. Read only once made: any number of states
 * may step on it at once.
 */
struct backend_cpu_tower {
    const float *params;
    gemm_kind kind;   /* the GEMMs of the states it serves */
    uint32_t fact_wb; /* their factorized layer's block width; 0: not taken */
    float *top[MODEL_MAX_LAYERS + 1], *bot[MODEL_MAX_LAYERS]; /* W^T packed, or NULL */
    const float *wt; /* W1^T as fact.wt; NULL where fact_wb is 0 */
    float *own_wt;   /* wt's buffer where it is not top[0] */
    size_t bytes;
};

/* The layer's W^T packed for cm_gemm_f32_pre (64-byte aligned); NULL when out of memory. */
static float *tower_layer(const model_layer *ly, const float *P, size_t *bytes)
{
    const size_t n = cm_gemm_f32_packed_floats((int)ly->out, (int)ly->in) * sizeof(float);
    float *w = aligned_alloc(64, (n + 63) / 64 * 64);
    if (w == NULL) return NULL;
    cm_gemm_f32_pack(1, (int)ly->out, (int)ly->in, P + ly->w, (int)ly->in, w);
    *bytes += n;
    return w;
}

void backend_cpu_tower_free(backend_cpu_tower *t)
{
    if (t == NULL) return;
    for (int i = 0; i < MODEL_MAX_LAYERS + 1; i++)
        free(t->top[i]);
    for (int i = 0; i < MODEL_MAX_LAYERS; i++)
        free(t->bot[i]);
    free(t->own_wt);
    free(t);
}

int backend_cpu_tower_make(const model_cfg *m, const model_layout *l, uint32_t flags,
                           const float *params, backend_cpu_tower **out, char **errptr)
{
    *out = NULL;
    backend_cpu_tower *t = calloc(1, sizeof *t);
    if (t == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    t->params = params;
    t->kind = gemm_kind_of(flags);
    bool ok = true, packed = t->kind == GEMM_OWN || t->kind == GEMM_OWN_AVX2;
    for (uint32_t i = 0; ok && packed && i < l->n_top; i++)
        ok = (t->top[i] = tower_layer(&l->top[i], params, &t->bytes)) != NULL;
    for (uint32_t i = 0; ok && packed && i < l->n_bot; i++)
        ok = (t->bot[i] = tower_layer(&l->bot[i], params, &t->bytes)) != NULL;
    fact x;
    fact_shape(&x, m, l, flags);
    if (ok && x.on) {
        t->fact_wb = x.wb;
        t->wt = x.wb == CM_GEMM_F32_PANEL ? t->top[0] : NULL;
        if (t->wt == NULL) {
            const size_t n = (size_t)x.in * x.H * sizeof(float);
            ok = (t->own_wt = aligned_alloc(64, (n + 63) / 64 * 64)) != NULL;
            for (uint32_t blk = 0; ok && blk < x.nblk; blk++)
                fact_wt_block(&x, params + l->top[0].w, blk, t->own_wt, NULL);
            t->wt = t->own_wt;
            t->bytes += n;
        }
    }
    if (!ok) {
        backend_cpu_tower_free(t);
        return cm_err(errptr, CM_ENOMEM, "out of memory for the packed tower");
    }
    *out = t;
    return CM_OK;
}

size_t backend_cpu_tower_bytes(const backend_cpu_tower *t)
{
    return t->bytes;
}

/* A step (backend_ops.step); t: the tower packed from P, or NULL (P laid out as it goes). */
static int cpu_run(cpu *c, const float *P, const backend_cpu_tower *t, const model_batch *b,
                   float *probs, double *loss, float *dP, float *const *demb, char **errptr)
{
    const model_cfg *m = &c->m;
    const model_layout *l = &c->l;
    const uint32_t B = b->B, F = m->n_fields, D = m->n_dense, d = m->dim;
    if (B > c->max_b || b->F != F || b->D != D || b->U > c->max_u)
        return cm_err(errptr, CM_EINVAL,
                      "batch shape (B %u, F %u, D %u, U %u) does not fit the model "
                      "(F %u, D %u, at most %u rows, %u keys)",
                      B, b->F, b->D, b->U, F, D, c->max_b, c->max_u);
    const bool bwd = dP != NULL;
    const bool fact = fact_plan(c, b);
    /* The mlp's factorized first layer reads the rows themselves, not their pooled sums. */
    const bool pooled = l->emb_table >= 0 && !(fact && m->kind == MODEL_MLP);
    /* Every layer overwrites its own dW and db; only the first-order terms accumulate. */
    if (bwd && l->lin_table >= 0) memset(dP + l->lin_w, 0, (m->n_dense + 1) * sizeof(float));
    float *logit = c->logit;
    memset(logit, 0, B * sizeof(float));
    if (pooled) spmm(&c->pool, b, b->emb[l->emb_table], d, c->xe, c->ldxe);
    if (l->lin_table >= 0) {
        spmm(&c->pool, b, b->emb[l->lin_table], 1, c->xl, F);
        for (uint32_t i = 0; i < B; i++) {
            float s = P[l->lin_c];
            for (uint32_t f = 0; f < F; f++)
                s += c->xl[(size_t)i * F + f];
            for (uint32_t k = 0; k < D; k++)
                s += P[l->lin_w + k] * b->dense[(size_t)i * D + k];
            logit[i] += s;
        }
    }
    if (m->kind == MODEL_DEEPFM) inter_run(c, INTER_FM_FWD, B, NULL, NULL);
    const float *z0 = NULL;
    if (l->n_top > 0) {
        /* Build the top MLP's input. */
        uint32_t ti = l->top_in;
        if (m->kind == MODEL_DLRM) {
            z0 = stack_fwd(&c->pool, l->bot, l->n_bot, c->bact, P, b->dense, B, t ? t->bot : NULL);
            inter_run(c, INTER_DLRM_FWD, B, z0, NULL);
        } else if (!fact) {
            /* The pooled embeddings are in place already (cpu_create). */
            for (uint32_t i = 0; i < B; i++)
                memcpy(c->in + (size_t)i * ti + (size_t)F * d, b->dense + (size_t)i * D,
                       D * sizeof(float));
        }
        const float *out;
        if (fact) {
            fact_job fj = {c, P, b, NULL, NULL, false, 0, t ? t->wt : NULL};
            if (fj.wt == NULL) weight_packs++;
            pool_run_threads(&c->pool, fact_fwd_part, &fj);
            out = stack_fwd(&c->pool, l->top + 1, l->n_top - 1, c->act + 1, P, c->act[0], B,
                            t ? t->top + 1 : NULL);
        } else {
            out = stack_fwd(&c->pool, l->top, l->n_top, c->act, P, c->in, B, t ? t->top : NULL);
        }
        for (uint32_t i = 0; i < B; i++)
            logit[i] += out[i];
    }
    /* Loss and its gradient: mean of softplus(z) - y z, computed without overflow. */
    double sum = 0;
    for (uint32_t i = 0; i < B; i++) {
        float z = logit[i];
        probs[i] = 1.0f / (1.0f + expf(-z));
        if (b->labels) {
            float y = b->labels[i];
            sum += fmaxf(z, 0.0f) - z * y + log1pf(expf(-fabsf(z)));
            c->dlogit[i] = (probs[i] - y) / (float)B;
        }
    }
    if (loss) *loss = B ? sum / B : 0.0;
    if (!bwd) return CM_OK;
    if (b->labels == NULL) return cm_err(errptr, CM_EINVAL, "backward pass needs labels");
    const float *g = c->dlogit;
    if (l->lin_table >= 0) {
        for (uint32_t i = 0; i < B; i++) {
            for (uint32_t f = 0; f < F; f++)
                c->dxl[(size_t)i * F + f] = g[i];
            for (uint32_t k = 0; k < D; k++)
                dP[l->lin_w + k] += g[i] * b->dense[(size_t)i * D + k];
            dP[l->lin_c] += g[i];
        }
        spmm_t(&c->pool, b, c->dxl, 1, F, demb[l->lin_table]);
    }
    /* Every model with embeddings has a top MLP (model_layout_make); for mlp and deepfm its
     * input gradient din holds the pooled embeddings' gradient dxe in place (factorized, the
     * first layer has no input gradient: its row gradients come from fact_bwd_g_part and
     * fact_bwd_e_part). */
    if (l->n_top > 0) {
        stack_bwd_dx(&c->pool, l->top, l->n_top, c->act, c->gact, P, g, fact ? NULL : c->din, B);
        if (m->kind == MODEL_DLRM) inter_run(c, INTER_DLRM_BWD, B, z0, NULL);
    }
    /* The FM term's gradient adds to the top MLP's (already in dxe = din). */
    if (m->kind == MODEL_DEEPFM) inter_run(c, fact ? INTER_FM_BWD_SET : INTER_FM_BWD, B, NULL, g);
    if (pooled) spmm_t(&c->pool, b, c->dxe, d, c->ldxe, demb[l->emb_table]);
    if (fact) {
        fact_job fj = {c, P, b, demb[l->emb_table], dP, pooled, 0, NULL};
        pool_run_parts(&c->pool, fact_bwd_g_part, &fj, (int)(c->fx.ngb * c->fx.F));
        pool_run(&c->pool, fact_bwd_e_part, &fj);
    }
    /* The dense gradients: nothing above reads them. */
    dw_phase_run(c, P, b, dP, fact);
    return CM_OK;
}

static int cpu_step(void *state, const float *P, const model_batch *b, float *probs, double *loss,
                    float *dP, float *const *demb, char **errptr)
{
    return cpu_run(state, P, NULL, b, probs, loss, dP, demb, errptr);
}

int backend_cpu_forward(void *state, const backend_cpu_tower *t, const model_batch *b, float *probs,
                        char **errptr)
{
    cpu *c = state;
    if (t->kind != c->pool.kind || t->fact_wb != (c->fx.on ? c->fx.wb : 0))
        return cm_err(errptr, CM_EINVAL, "the tower was packed for other backend flags");
    return cpu_run(c, t->params, t, b, probs, NULL, NULL, NULL, errptr);
}

/* Releases the rest of the threads into the current dense-gradient phase. */
static void cpu_join(void *state)
{
    cpu *c = state;
    pthread_mutex_lock(&c->jmu);
    __atomic_store_n(&c->joined_gen, c->phase_gen, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&c->jcv);
    pthread_mutex_unlock(&c->jmu);
}

/* The step reads the batch from host memory where it lies: nothing to move ahead of it. */
static int cpu_prefetch(void *state, const float *params, const model_batch *b, uint64_t *ticket,
                        char **errptr)
{
    (void)state, (void)params, (void)b, (void)errptr;
    *ticket = 0;
    return CM_OK;
}

/* Only spmm_t reads A's columns, and the mlp's factorized first layer has no spmm_t (it steps
 * on the batch's units, model_units); a batch the cost model declines scans A instead
 * (spmm_t_part: the same bits). */
static bool cpu_columns(const void *state)
{
    const cpu *c = state;
    return !(c->fx.on && c->m.kind == MODEL_MLP);
}

static uint32_t cpu_max_units(const void *state, uint32_t B, uint32_t F)
{
    const cpu *c = state;
    return F == c->fx.F ? fact_max_units(&c->fx, B, F) : 0;
}

const backend_ops backend_cpu_ops = {
    .name = "cpu",
    .create = cpu_create,
    .destroy = cpu_destroy,
    .prefetch = cpu_prefetch,
    .step = cpu_step,
    .join = cpu_join,
    .columns = cpu_columns,
    .max_units = cpu_max_units,
};
