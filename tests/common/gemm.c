/*
 * cm_gemm_bf16 (bf16 GEMM on AMX tiles) and cm_gemm_f32 (fp32, its AVX-512, AVX2 and portable
 * paths) against a double reference of the (bf16-rounded) operands, and cm_gemm_f32 bit for bit
 * against its contract, the K products of each output summed in order by fmaf from 0: all four
 * transpose combinations over shapes that cross every 16 / 32 padding edge of M, N and K, with
 * leading-dimension slack (holding NaNs the kernel must never read) and C's padding columns and
 * tail left untouched; the training shapes (sampled); magnitudes over six decades; a NaN in A (in
 * B) reaching exactly its row (column); bit-identical repeats and concurrent calls from two
 * threads; K = 0 and empty outputs. Packed operands: cm_gemm_bf16_packed_size's zeros and growth;
 * packing in row ranges (in any order) writing every byte as one call does; and cm_gemm_bf16_pre
 * over inner sub-ranges with A, B or both packed (the float operand then poisoned) giving
 * cm_gemm_bf16's bits on the sub-matrices. Where AMX is missing, only the bf16 refusal is checked;
 * cm_gemm_f32's vector paths (AVX-512 and AVX2 where the CPU has it, AVX2 alone elsewhere) give the
 * portable path's bits on the training shapes (the portable one is run on the small shapes and NaNs
 * only: it is slow), and cm_gemm_f32_pre on an operand cm_gemm_f32_pack packed gives cm_gemm_f32's
 * bits on each.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>

#include "check.h"
#include "common/common.h"
#include "rng.h"

#define SENTINEL 0x7fa5a5a5u /* C's cells the call must leave alone: a NaN no product gives */
#define PAD_NAN 0x7fc0beefu  /* A's and B's leading-dimension slack: never to be read */
#define GUARD 16             /* sentinel floats after C's last row */
#define FULL_MAX 70000       /* outputs up to which every one is checked, else SAMPLE of them */
#define SAMPLE 2000
#define THREAD_ITERS 20

static const int V[10] = {1, 15, 16, 17, 31, 32, 33, 63, 64, 65};

static double worst_ratio; /* max |C - ref| / bound over every output compared */
static long n_compared;
static long n_unfused; /* cm_gemm_f32 outputs not the bits of the in-order fmaf sum */

/* Which GEMM is under test. */
enum { MODE_BF16, MODE_F32_SIMD, MODE_F32_PORTABLE, MODE_F32_AVX2 };
static int mode;
static const char *const mode_name[] = {"bf16", "f32 best", "f32 portable", "f32 avx2"};

/* An operand value as the GEMM under test multiplies it. */
static double bf(float x)
{
    return mode == MODE_BF16 ? (double)cm_bf16_to_f32(cm_f32_to_bf16(x)) : (double)x;
}

/* One product's operands: op(A) M x K, op(B) K x N, C M x ldc (+ GUARD). */
typedef struct gcase {
    int ta, tb, M, N, K, lda, ldb, ldc;
    float *A, *B;
    size_t nc;
    char desc[128];
} gcase;

static float *a_at(const gcase *g, int i, int k)
{
    return g->ta ? &g->A[(size_t)k * g->lda + i] : &g->A[(size_t)i * g->lda + k];
}

static float *b_at(const gcase *g, int k, int j)
{
    return g->tb ? &g->B[(size_t)j * g->ldb + k] : &g->B[(size_t)k * g->ldb + j];
}

static float value(int spread)
{
    if (!spread) return (float)unif(-1.0, 1.0);
    double m = pow(10.0, unif(-3.0, 3.0));
    return (float)(rnd64() & 1 ? m : -m);
}

static int imax(int a, int b)
{
    return a > b ? a : b;
}

/* Operands of a shape with leading dimensions xa / xb / xc over the minimum, values uniform in
 * [-1, 1) (or +-10^[-3, 3) when spread), the slack NaN. */
static void case_init(gcase *g, int ta, int tb, int M, int N, int K, int xa, int xb, int xc,
                      int spread)
{
    memset(g, 0, sizeof *g);
    g->ta = ta, g->tb = tb, g->M = M, g->N = N, g->K = K;
    g->lda = imax(1, (ta ? M : K) + xa);
    g->ldb = imax(1, (tb ? K : N) + xb);
    g->ldc = imax(1, N + xc);
    size_t na = (size_t)imax(1, ta ? K : M) * g->lda, nb = (size_t)imax(1, tb ? N : K) * g->ldb;
    g->nc = (size_t)M * g->ldc + GUARD;
    g->A = malloc(na * sizeof(float));
    g->B = malloc(nb * sizeof(float));
    if (g->A == NULL || g->B == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    for (size_t x = 0; x < na; x++)
        g->A[x] = check_f32_of(PAD_NAN);
    for (size_t x = 0; x < nb; x++)
        g->B[x] = check_f32_of(PAD_NAN);
    for (int i = 0; i < M; i++)
        for (int k = 0; k < K; k++)
            *a_at(g, i, k) = value(spread);
    for (int k = 0; k < K; k++)
        for (int j = 0; j < N; j++)
            *b_at(g, k, j) = value(spread);
    snprintf(g->desc, sizeof g->desc, "%s ta=%d tb=%d M=%d N=%d K=%d lda=%d ldb=%d ldc=%d%s",
             mode_name[mode], ta, tb, M, N, K, g->lda, g->ldb, g->ldc, spread ? " spread" : "");
}

static void case_free(gcase *g)
{
    free(g->A);
    free(g->B);
    g->A = g->B = NULL;
}

/* n floats, each with the bits `bits`. */
static float *filled(size_t n, uint32_t bits)
{
    float *c = malloc(n * sizeof(float));
    if (c == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    for (size_t x = 0; x < n; x++)
        c[x] = check_f32_of(bits);
    return c;
}

static float *c_new(size_t n)
{
    return filled(n, SENTINEL);
}

/* Cells of C outside the M x N block (ldc slack and the guard) that no longer hold SENTINEL. */
static size_t outside_changed(const gcase *g, const float *C)
{
    size_t bad = 0;
    for (int i = 0; i < g->M; i++)
        for (int j = g->N; j < g->ldc; j++)
            bad += check_u32_of(C[(size_t)i * g->ldc + j]) != SENTINEL;
    for (size_t x = (size_t)g->M * g->ldc; x < g->nc; x++)
        bad += check_u32_of(C[x]) != SENTINEL;
    return bad;
}

/* The double reference of output (i, j) and its fp32 summation bound. */
static double ref_at(const gcase *g, int i, int j, double *bound)
{
    double s = 0.0, sa = 0.0;
    for (int k = 0; k < g->K; k++) {
        double p = bf(*a_at(g, i, k)) * bf(*b_at(g, k, j));
        s += p;
        sa += fabs(p);
    }
    *bound = ldexp(1.0, -23) * g->K * sa + 1e-30;
    return s;
}

/* C against the reference: every output of a small product, SAMPLE of a big one (its four
 * corners included); row skip_row and column skip_col (-1: none) left out. */
static void check_values(const gcase *g, const float *C, int skip_row, int skip_col)
{
    int full = (size_t)g->M * g->N <= FULL_MAX;
    long n = full ? (long)g->M * g->N : SAMPLE, bad = 0;
    int bi = -1, bj = -1;
    double bgot = 0, bref = 0, bbound = 0, worst = 0.0;
    for (long x = 0; x < n; x++) {
        int i, j;
        if (full) {
            i = (int)(x / g->N), j = (int)(x % g->N);
        } else if (x < 4) {
            i = x & 1 ? g->M - 1 : 0, j = x & 2 ? g->N - 1 : 0;
        } else {
            i = (int)rndu((uint32_t)g->M), j = (int)rndu((uint32_t)g->N);
        }
        if (i == skip_row || j == skip_col) continue;
        if (mode != MODE_BF16) { /* the contract's own sum, to the bit */
            float c = 0.0f;
            for (int k = 0; k < g->K; k++)
                c = fmaf(*a_at(g, i, k), *b_at(g, k, j), c);
            float have = C[(size_t)i * g->ldc + j];
            if (check_u32_of(have) != check_u32_of(c) && !(isnan(have) && isnan(c)) &&
                n_unfused++ == 0)
                fprintf(stderr, "%s: (%d, %d) is %.9g, the in-order fmaf sum %.9g\n", g->desc, i, j,
                        have, c);
        }
        double bound, ref = ref_at(g, i, j, &bound), got = C[(size_t)i * g->ldc + j];
        double err = fabs(got - ref);
        n_compared++;
        if (!(err <= bound)) {
            if (bad++ == 0) bi = i, bj = j, bgot = got, bref = ref, bbound = bound;
            continue;
        }
        worst = err / bound > worst ? err / bound : worst;
    }
    worst_ratio = worst > worst_ratio ? worst : worst_ratio;
    CHECK_MSG(bad == 0,
              "%s: %ld of %ld outputs off, first (%d, %d): got %.9g, ref %.9g, bound %.3g", g->desc,
              bad, n, bi, bj, bgot, bref, bbound);
}

/* cm_gemm_f32's path under test. */
static int f32_path(void)
{
    return mode == MODE_F32_SIMD   ? CM_GEMM_F32_BEST
           : mode == MODE_F32_AVX2 ? CM_GEMM_F32_AVX2
                                   : CM_GEMM_F32_PORTABLE;
}

static int gemm_raw(int ta, int tb, int M, int N, int K, const float *A, int lda, const float *B,
                    int ldb, float *C, int ldc)
{
    if (mode == MODE_BF16) return cm_gemm_bf16(ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
    return cm_gemm_f32(f32_path(), ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
}

static int gemm(const gcase *g, float *C)
{
    return gemm_raw(g->ta, g->tb, g->M, g->N, g->K, g->A, g->lda, g->B, g->ldb, C, g->ldc);
}

/* Runs g, checks the return, C's outside, the values (row / column skips as check_values) and a
 * second call's bits; returns the C (the caller frees it). */
static float *run_checked(const gcase *g, int skip_row, int skip_col)
{
    float *C = c_new(g->nc), *C2 = c_new(g->nc);
    int rc = gemm(g, C);
    CHECK_MSG(rc == 0, "%s: rc=%d", g->desc, rc);
    size_t out = outside_changed(g, C);
    CHECK_MSG(out == 0, "%s: %zu cells outside the M x N block written", g->desc, out);
    check_values(g, C, skip_row, skip_col);
    rc = gemm(g, C2);
    CHECK_MSG(rc == 0 && memcmp(C, C2, g->nc * sizeof(float)) == 0,
              "%s: a second call gives other bits (rc=%d)", g->desc, rc);
    free(C2);
    return C;
}

/* Without AMX: the call refuses and leaves C alone. */
static void check_unavailable(void)
{
    gcase g;
    case_init(&g, 0, 1, 17, 15, 33, 3, 0, 2, 0);
    float *C = c_new(g.nc);
    int rc = gemm(&g, C);
    CHECK_MSG(rc == CM_EINVAL, "without AMX: rc=%d, want CM_EINVAL", rc);
    size_t changed = 0;
    for (size_t x = 0; x < g.nc; x++)
        changed += check_u32_of(C[x]) != SENTINEL;
    CHECK_MSG(changed == 0, "without AMX: %zu cells of C written", changed);
    free(C);
    case_free(&g);
    fprintf(stderr, "common_gemm: SKIP the AMX comparisons: this CPU/OS has no AMX-BF16\n");
}

/* K = 0 gives zeros in the block; M = 0 or N = 0 returns 0 and writes nothing. */
static void check_degenerate(void)
{
    static const int shapes[][5] = {{17, 33, 3, 0, 1}, {1, 1, 0, 0, 0}, {64, 16, 5, 1, 0}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        gcase g;
        case_init(&g, shapes[s][3], shapes[s][4], shapes[s][0], shapes[s][1], 0, 2, 1, shapes[s][2],
                  0);
        float *C = c_new(g.nc);
        int rc = gemm(&g, C);
        CHECK_MSG(rc == 0, "%s: rc=%d", g.desc, rc);
        size_t nz = 0;
        for (int i = 0; i < g.M; i++)
            for (int j = 0; j < g.N; j++)
                nz += check_u32_of(C[(size_t)i * g.ldc + j]) != 0; /* +0 */
        CHECK_MSG(nz == 0, "%s: %zu outputs not +0", g.desc, nz);
        size_t out = outside_changed(&g, C);
        CHECK_MSG(out == 0, "%s: %zu cells outside the M x N block written", g.desc, out);
        free(C);
        case_free(&g);
    }
    static const int empty[][3] = {{0, 17, 5}, {17, 0, 5}, {0, 0, 0}, {0, 33, 0}};
    for (size_t s = 0; s < sizeof empty / sizeof empty[0]; s++) {
        float A[64], B[64], C[64];
        for (int x = 0; x < 64; x++)
            A[x] = B[x] = 1.0f, C[x] = check_f32_of(SENTINEL);
        for (int t = 0; t < 4; t++) {
            int rc =
                gemm_raw(t >> 1, t & 1, empty[s][0], empty[s][1], empty[s][2], A, 8, B, 8, C, 8);
            size_t changed = 0;
            for (int x = 0; x < 64; x++)
                changed += check_u32_of(C[x]) != SENTINEL;
            CHECK_MSG(rc == 0 && changed == 0, "M=%d N=%d K=%d ta=%d tb=%d: rc=%d, %zu written",
                      empty[s][0], empty[s][1], empty[s][2], t >> 1, t & 1, rc, changed);
        }
    }
}

/* 60 (M, N, K) from V per transpose combination: six blocks of three permutations, so each
 * value of V comes six times in each dimension; leading dimensions 0, 3 or 17 over the minimum. */
static void check_small(void)
{
    static const int slack[4] = {0, 0, 3, 17};
    for (int t = 0; t < 4; t++)
        for (int blk = 0; blk < 6; blk++) {
            int p[3][10];
            for (int d = 0; d < 3; d++) {
                for (int x = 0; x < 10; x++)
                    p[d][x] = x;
                for (int x = 9; x > 0; x--) {
                    int y = (int)rndu((uint32_t)x + 1), tmp = p[d][x];
                    p[d][x] = p[d][y], p[d][y] = tmp;
                }
            }
            for (int x = 0; x < 10; x++) {
                gcase g;
                case_init(&g, t >> 1, t & 1, V[p[0][x]], V[p[1][x]], V[p[2][x]], slack[rndu(4)],
                          slack[rndu(4)], slack[rndu(4)], 0);
                free(run_checked(&g, -1, -1));
                case_free(&g);
            }
        }
}

/* A NaN in op(A) at (i0, k0): row i0 NaN wherever op(B) row k0 is nonzero, the other rows
 * right. A NaN in op(B) at (k1, j1): column j1 NaN wherever op(A) column k1 is nonzero. The
 * NaNs carry payloads that bf16 truncation alone would turn into infinities. */
static void check_nan(void)
{
    for (int t = 0; t < 4; t++) {
        gcase g;
        int i0 = 17, k0 = 40, zero_cols[3] = {0, 5, 46};
        case_init(&g, t >> 1, t & 1, 33, 47, 65, 3, 1, 2, 0);
        for (int z = 0; z < 3; z++)
            *b_at(&g, k0, zero_cols[z]) = 0.0f;
        *a_at(&g, i0, k0) = check_f32_of(0x7f800001u); /* signalling, low payload */
        float *C = run_checked(&g, i0, -1);
        int bad = 0, first = -1;
        for (int j = 0; j < g.N; j++)
            if (bf(*b_at(&g, k0, j)) != 0.0 && !isnan(C[(size_t)i0 * g.ldc + j]) && bad++ == 0)
                first = j;
        CHECK_MSG(bad == 0, "%s: NaN in A row %d: %d outputs of the row not NaN, first col %d",
                  g.desc, i0, bad, first);
        free(C);
        case_free(&g);

        int k1 = 33, j1 = 31, zero_rows[2] = {2, 32};
        case_init(&g, t >> 1, t & 1, 63, 33, 64, 0, 3, 17, 0);
        for (int z = 0; z < 2; z++)
            *a_at(&g, zero_rows[z], k1) = 0.0f;
        *b_at(&g, k1, j1) = check_f32_of(0xff800001u);
        C = run_checked(&g, -1, j1);
        bad = 0, first = -1;
        for (int i = 0; i < g.M; i++)
            if (bf(*a_at(&g, i, k1)) != 0.0 && !isnan(C[(size_t)i * g.ldc + j1]) && bad++ == 0)
                first = i;
        CHECK_MSG(bad == 0, "%s: NaN in B col %d: %d outputs of the column not NaN, first row %d",
                  g.desc, j1, bad, first);
        free(C);
        case_free(&g);
    }
}

/* Two threads at once, each over its own products into its own outputs, many times: every call
 * gives the single-thread bits. */
typedef struct tjob {
    const gcase *g[3];
    const float *want[3];
    float *C[3];
    pthread_barrier_t *bar;
    int calls, wrong;
} tjob;

static void *worker(void *p)
{
    tjob *t = p;
    pthread_barrier_wait(t->bar);
    for (int it = 0; it < THREAD_ITERS; it++)
        for (int c = 0; c < 3; c++) {
            const gcase *g = t->g[c];
            for (size_t x = 0; x < g->nc; x++)
                t->C[c][x] = check_f32_of(SENTINEL);
            int rc = gemm(g, t->C[c]);
            t->calls++;
            t->wrong += rc != 0 || memcmp(t->C[c], t->want[c], g->nc * sizeof(float)) != 0;
        }
    return NULL;
}

static void check_threads(gcase *const train[5], float *const train_c[5])
{
    gcase s[2];
    float *sc[2];
    case_init(&s[0], 1, 1, 65, 33, 63, 17, 3, 0, 0);
    case_init(&s[1], 0, 0, 17, 64, 31, 0, 17, 3, 0);
    for (int x = 0; x < 2; x++)
        sc[x] = run_checked(&s[x], -1, -1);
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, 2);
    tjob job[2] = {{.g = {train[0], &s[0], train[3]}, .want = {train_c[0], sc[0], train_c[3]}},
                   {.g = {train[2], &s[1], train[4]}, .want = {train_c[2], sc[1], train_c[4]}}};
    pthread_t th[2];
    int started[2];
    for (int w = 0; w < 2; w++) {
        job[w].bar = &bar;
        for (int c = 0; c < 3; c++)
            job[w].C[c] = c_new(job[w].g[c]->nc);
    }
    for (int w = 0; w < 2; w++) {
        started[w] = pthread_create(&th[w], NULL, worker, &job[w]) == 0;
        CHECK_MSG(started[w], "pthread_create %d", w);
    }
    if (!started[0] || !started[1]) {
        fprintf(stderr, "cannot start the threads\n");
        exit(2);
    }
    for (int w = 0; w < 2; w++) {
        pthread_join(th[w], NULL);
        CHECK_MSG(job[w].wrong == 0, "thread %d: %d of %d calls gave other bits than one thread", w,
                  job[w].wrong, job[w].calls);
        for (int c = 0; c < 3; c++)
            free(job[w].C[c]);
    }
    pthread_barrier_destroy(&bar);
    for (int x = 0; x < 2; x++) {
        free(sc[x]);
        case_free(&s[x]);
    }
}

/* Packed operands (cm_gemm_bf16_pack / cm_gemm_bf16_pre) ------------------------------------ */

/* A packed buffer of cm_gemm_bf16_packed_size(rows, K) bytes, 64-byte aligned, every byte
 * `fill` (so that a byte the packer leaves unwritten shows). */
static void *pk_new(int rows, int K, int fill)
{
    size_t n = cm_gemm_bf16_packed_size(rows, K), r = (n + 63) / 64 * 64;
    void *p = aligned_alloc(64, r ? r : 64);
    if (p == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    memset(p, fill, r ? r : 64);
    return p;
}

/* Floats in A's (B's) storage, slack included, as case_init allocates them. */
static size_t a_len(const gcase *g)
{
    return (size_t)imax(1, g->ta ? g->K : g->M) * g->lda;
}

static size_t b_len(const gcase *g)
{
    return (size_t)imax(1, g->tb ? g->N : g->K) * g->ldb;
}

static float *poisoned(size_t n)
{
    return filled(n, PAD_NAN);
}

/* 0 for an empty operand; growing in rows and in K; room for rows x K bf16 values at least. */
static void check_packed_size(void)
{
    static const int empty[][2] = {{0, 0},   {0, 32},    {32, 0}, {-1, 32},
                                   {32, -1}, {-32, -32}, {1, 0}};
    for (size_t e = 0; e < sizeof empty / sizeof empty[0]; e++)
        CHECK_MSG(cm_gemm_bf16_packed_size(empty[e][0], empty[e][1]) == 0,
                  "packed_size(%d, %d) = %zu, want 0", empty[e][0], empty[e][1],
                  cm_gemm_bf16_packed_size(empty[e][0], empty[e][1]));
    long bad = 0;
    int br = 0, bk = 0;
    for (int rows = 1; rows <= 300; rows++)
        for (int K = 1; K <= 300; K += K < 70 ? 1 : 7) {
            size_t s = cm_gemm_bf16_packed_size(rows, K);
            if (s < (size_t)rows * K * 2 || cm_gemm_bf16_packed_size(rows + 1, K) < s ||
                cm_gemm_bf16_packed_size(rows, K + 1) < s) {
                if (bad++ == 0) br = rows, bk = K;
            }
        }
    CHECK_MSG(bad == 0,
              "packed_size not >= 2 rows K or not monotonic at %ld points, first (%d, %d)", bad, br,
              bk);
}

/* Packing rows [0, rows) in one call writes every byte of the size (two buffers of other
 * garbage come out the same); rows [0, 32), [32, 64), [64, rows) in that order or backwards,
 * or [0, rows rounded up to 32) in one call, write the same bytes. */
static void check_pack_ranges(void)
{
    static const int shape[][2] = {{65, 33}, {81, 100}, {96, 1}, {100, 512}, {128, 64}, {215, 31}};
    static const int cut[4] = {0, 32, 64, -1}; /* -1: rows */
    for (int b = 0; b < 2; b++)
        for (int trans = 0; trans < 2; trans++)
            for (size_t s = 0; s < sizeof shape / sizeof shape[0]; s++) {
                int rows = shape[s][0], K = shape[s][1], up = (rows + 31) / 32 * 32;
                gcase g; /* the operand as A (b 0) or B (b 1) of a product with that K */
                case_init(&g, trans, trans, b ? 1 : rows, b ? rows : 1, K, 3, 5, 0, 0);
                const float *X = b ? g.B : g.A;
                int ld = b ? g.ldb : g.lda;
                size_t n = cm_gemm_bf16_packed_size(rows, K);
                void *one = pk_new(rows, K, 0xab), *two = pk_new(rows, K, 0xcd),
                     *fwd = pk_new(rows, K, 0x5a), *bwd = pk_new(rows, K, 0xff),
                     *upto = pk_new(rows, K, 0x00);
                cm_gemm_bf16_pack(b, trans, rows, K, X, ld, 0, rows, one);
                cm_gemm_bf16_pack(b, trans, rows, K, X, ld, 0, rows, two);
                for (int r = 0; r < 3; r++) {
                    cm_gemm_bf16_pack(b, trans, rows, K, X, ld, cut[r],
                                      cut[r + 1] < 0 ? rows : cut[r + 1], fwd);
                    cm_gemm_bf16_pack(b, trans, rows, K, X, ld, cut[2 - r],
                                      cut[3 - r] < 0 ? rows : cut[3 - r], bwd);
                }
                cm_gemm_bf16_pack(b, trans, rows, K, X, ld, 0, up, upto);
                int d_two = memcmp(one, two, n) != 0, d_fwd = memcmp(one, fwd, n) != 0,
                    d_bwd = memcmp(one, bwd, n) != 0, d_up = memcmp(one, upto, n) != 0;
                CHECK_MSG(!d_two,
                          "pack b=%d trans=%d rows=%d K=%d: [0,rows) leaves bytes of the "
                          "%zu unwritten",
                          b, trans, rows, K, n);
                CHECK_MSG(!d_fwd && !d_bwd && !d_up,
                          "pack b=%d trans=%d rows=%d K=%d: against [0,rows) in one call, "
                          "[0,32) [32,64) [64,rows) %s, backwards %s; [0,%d) %s",
                          b, trans, rows, K, d_fwd ? "differ" : "same", d_bwd ? "differ" : "same",
                          up, d_up ? "differs" : "same");
                free(one);
                free(two);
                free(fwd);
                free(bwd);
                free(upto);
                case_free(&g);
            }
}

/* Inner ranges [k0, k0 + K) of K0 that cm_gemm_bf16_pre takes: the whole; every chunk of 32,
 * 64 and 256 (the last one ending at K0); two more from a random multiple of 32 to K0 or to a
 * later multiple of 32. Returns the count (at most cap). */
static int sub_ranges(int K0, int (*r)[2], int cap)
{
    int n = 0, KT = (K0 + 31) / 32;
    r[n][0] = 0, r[n][1] = K0, n++;
    static const int chunk[3] = {32, 64, 256};
    for (int c = 0; c < 3; c++)
        for (int k0 = 0; k0 < K0 && chunk[c] < K0 && n < cap; k0 += chunk[c])
            r[n][0] = k0, r[n][1] = (k0 + chunk[c] < K0 ? k0 + chunk[c] : K0) - k0, n++;
    for (int x = 0; x < 2 && n < cap; x++) {
        int t0 = (int)rndu((uint32_t)KT), t1 = t0 + 1 + (int)rndu((uint32_t)(KT - t0));
        r[n][0] = t0 * 32, r[n][1] = (t1 == KT ? K0 : t1 * 32) - t0 * 32, n++;
    }
    return n;
}

/* One shape: A packed in one call, B in two or three row ranges (split at random multiples of
 * 32, packed last range first, the last one ending at N or N rounded up to 32); then for each
 * inner range, cm_gemm_bf16_pre with pa, with pb and with both (the unpacked float operand
 * there poisoned with NaNs: never to be read) gives cm_gemm_bf16's bits on the sub-matrices. */
static void check_pre_shape(int ta, int tb, int M, int N, int K0)
{
    gcase g;
    case_init(&g, ta, tb, M, N, K0, (int)rndu(2) * 3, (int)rndu(2) * 5, (int)rndu(2) * 2, 0);
    void *pa = pk_new(M, K0, 0xab), *pb = pk_new(N, K0, 0xcd);
    cm_gemm_bf16_pack(0, ta, M, K0, g.A, g.lda, 0, M, pa);
    int cut[4] = {0, 0, 0, 0}, nc = 1, NT = (N + 31) / 32;
    for (int x = 0; x < 2 && NT > 1; x++) {
        int c = 32 * (1 + (int)rndu((uint32_t)NT - 1));
        if (c != cut[1] && c != cut[2]) cut[++nc - 1] = c;
    }
    if (nc == 3 && cut[1] > cut[2]) {
        int t = cut[1];
        cut[1] = cut[2], cut[2] = t;
    }
    cut[nc] = rndu(2) ? N : NT * 32;
    for (int r = nc - 1; r >= 0; r--)
        cm_gemm_bf16_pack(1, tb, N, K0, g.B, g.ldb, cut[r], cut[r + 1], pb);
    float *PA = poisoned(a_len(&g)), *PB = poisoned(b_len(&g));
    float *want = c_new(g.nc), *got = c_new(g.nc);
    int rr[64][2], nr = sub_ranges(K0, rr, 64);
    static const char *mode[3] = {"pa", "pb", "pa+pb"};
    int bad[3] = {0, 0, 0}, first[3][3];
    for (int s = 0; s < nr; s++) {
        int k0 = rr[s][0], K = rr[s][1];
        size_t oa = ta ? (size_t)k0 * g.lda : (size_t)k0, ob = tb ? (size_t)k0 : (size_t)k0 * g.ldb;
        for (size_t x = 0; x < g.nc; x++)
            want[x] = check_f32_of(SENTINEL);
        int rc0 = cm_gemm_bf16(ta, tb, M, N, K, g.A + oa, g.lda, g.B + ob, g.ldb, want, g.ldc);
        for (int m = 0; m < 3; m++) {
            int use_a = m != 1, use_b = m != 0;
            for (size_t x = 0; x < g.nc; x++)
                got[x] = check_f32_of(SENTINEL);
            int rc = cm_gemm_bf16_pre(ta, tb, M, N, K, (use_a ? PA : g.A) + oa, g.lda,
                                      use_a ? pa : NULL, (use_b ? PB : g.B) + ob, g.ldb,
                                      use_b ? pb : NULL, K0, k0, got, g.ldc);
            size_t nonfinite = 0;
            for (int i = 0; i < M; i++)
                for (int j = 0; j < N; j++)
                    nonfinite += !isfinite(got[(size_t)i * g.ldc + j]);
            if ((rc0 != 0 || rc != 0 || nonfinite != 0 ||
                 memcmp(want, got, g.nc * sizeof(float)) != 0) &&
                bad[m]++ == 0)
                first[m][0] = k0, first[m][1] = K, first[m][2] = rc;
        }
    }
    char ranges[64];
    int at = 0;
    for (int r = 0; r < nc; r++)
        at += snprintf(ranges + at, sizeof ranges - (size_t)at, " [%d,%d)", cut[r], cut[r + 1]);
    for (int m = 0; m < 3; m++)
        CHECK_MSG(bad[m] == 0,
                  "%s, B packed in%s: pre with %s: %d of %d inner ranges differ from "
                  "cm_gemm_bf16, first k0=%d K=%d (rc=%d)",
                  g.desc, ranges, mode[m], bad[m], nr, bad[m] ? first[m][0] : 0,
                  bad[m] ? first[m][1] : 0, bad[m] ? first[m][2] : 0);
    free(want);
    free(got);
    free(PA);
    free(PB);
    free(pa);
    free(pb);
    case_free(&g);
}

/* Each transpose combination over every (M, N, K0) of the sets. */
static void check_pre(void)
{
    static const int Ms[4] = {1, 33, 100, 256}, Ns[4] = {1, 17, 54, 215},
                     K0s[5] = {32, 64, 100, 512, 1000};
    for (int t = 0; t < 4; t++)
        for (int kx = 0; kx < 5; kx++)
            for (int mx = 0; mx < 4; mx++)
                for (int nx = 0; nx < 4; nx++)
                    check_pre_shape(t >> 1, t & 1, Ms[mx], Ns[nx], K0s[kx]);
}

/* cm_gemm_f32_pack writes the documented layout (zeros past N); cm_gemm_f32_pre gives
 * cm_gemm_f32's bits over all columns and over column ranges from a panel's start, and refuses
 * (C untouched) a range that starts inside a panel. */
static void check_f32_pre_shape(int ta, int tb, int M, int N, int K)
{
    gcase g;
    case_init(&g, ta, tb, M, N, K, (int)rndu(2) * 3, (int)rndu(2) * 5, (int)rndu(2) * 2, 0);
    const size_t np = cm_gemm_f32_packed_floats(N, K);
    float *pb = aligned_alloc(64, (np * sizeof(float) + 63) / 64 * 64);
    cm_gemm_f32_pack(tb, N, K, g.B, g.ldb, pb);
    size_t misplaced = 0;
    for (int j = 0; j < (N + 31) / 32 * 32; j++)
        for (int k = 0; k < K; k++) {
            float want = j < N ? *b_at(&g, k, j) : 0.0f;
            misplaced += check_u32_of(pb[(size_t)(j / 32) * 32 * K + (size_t)k * 32 + j % 32]) !=
                         check_u32_of(want);
        }
    CHECK_MSG(np == (size_t)(N + 31) / 32 * 32 * K && misplaced == 0,
              "%s: packed %zu floats, %zu not where the layout puts them", g.desc, np, misplaced);
    float *want = c_new(g.nc), *got = c_new(g.nc);
    const int j0s[3] = {0, N > 32 ? 32 * (int)rndu((uint32_t)(N - 1) / 32 + 1) : 0, 1};
    for (int x = 0; x < 3; x++) {
        const int j0 = j0s[x], n = j0 >= N ? 1 : N - j0;
        for (size_t c = 0; c < g.nc; c++)
            want[c] = got[c] = check_f32_of(SENTINEL);
        int rc = cm_gemm_f32_pre(f32_path(), ta, M, n, K, g.A, g.lda, pb, j0, got + j0 % 32, g.ldc);
        if (j0 % 32 != 0) {
            CHECK_MSG(rc == CM_EINVAL && memcmp(want, got, g.nc * sizeof(float)) == 0,
                      "%s: columns from %d: rc=%d, want CM_EINVAL and C untouched", g.desc, j0, rc);
            continue;
        }
        const float *B = g.B + (tb ? (size_t)j0 * g.ldb : (size_t)j0);
        int rc0 = cm_gemm_f32(f32_path(), ta, tb, M, n, K, g.A, g.lda, B, g.ldb, want, g.ldc);
        CHECK_MSG(rc == 0 && rc0 == 0 && memcmp(want, got, g.nc * sizeof(float)) == 0,
                  "%s: columns [%d, %d): pre gives other bits than cm_gemm_f32 (rc %d, %d)", g.desc,
                  j0, j0 + n, rc, rc0);
    }
    free(want);
    free(got);
    free(pb);
    case_free(&g);
}

static void check_f32_pre(void)
{
    static const int Ms[3] = {1, 9, 100}, Ns[5] = {1, 17, 32, 54, 256}, Ks[4] = {1, 100, 256, 429};
    for (int t = 0; t < 4; t++)
        for (int kx = 0; kx < 4; kx++)
            for (int mx = 0; mx < 3; mx++)
                for (int nx = 0; nx < 5; nx++)
                    check_f32_pre_shape(t >> 1, t & 1, Ms[mx], Ns[nx], Ks[kx]);
}

/* Everything but the bf16 packing for the GEMM under `mode`. */
static void check_mode(void)
{
    check_degenerate();
    check_small();
    check_nan();
    if (mode == MODE_F32_PORTABLE) return;

    /* The training products (minimum leading dimensions, as the trainer calls them). */
    static const int train_shape[5][5] = {{2048, 256, 429, 0, 1},
                                          {2048, 429, 256, 0, 0},
                                          {256, 429, 2048, 1, 0},
                                          {2048, 1, 128, 0, 1},
                                          {2048, 128, 1, 0, 0}};
    gcase train[5];
    gcase *train_p[5];
    float *train_c[5];
    for (int s = 0; s < 5; s++) {
        const int *d = train_shape[s];
        case_init(&train[s], d[3], d[4], d[0], d[1], d[2], 0, 0, 0, 0);
        train_p[s] = &train[s];
        train_c[s] = run_checked(&train[s], -1, -1);
    }
    const int vec_mode = mode;
    if (mode != MODE_BF16) /* the portable path's bits on every output */
        for (int s = 0; s < 5; s++) {
            mode = MODE_F32_PORTABLE;
            float *C = c_new(train[s].nc);
            int rc = gemm(&train[s], C);
            mode = vec_mode;
            CHECK_MSG(rc == 0 && memcmp(C, train_c[s], train[s].nc * sizeof(float)) == 0,
                      "%s: the portable path gives other bits (rc=%d)", train[s].desc, rc);
            free(C);
        }

    /* Magnitudes over six decades: each combination on two shapes, and a training shape. */
    for (int t = 0; t < 4; t++) {
        gcase g;
        case_init(&g, t >> 1, t & 1, 65, 63, 65, 3, 0, 1, 1);
        free(run_checked(&g, -1, -1));
        case_free(&g);
        case_init(&g, t >> 1, t & 1, 33, 64, 17, 0, 17, 0, 1);
        free(run_checked(&g, -1, -1));
        case_free(&g);
    }
    {
        gcase g;
        case_init(&g, 0, 1, 2048, 256, 429, 0, 0, 3, 1);
        free(run_checked(&g, -1, -1));
        case_free(&g);
    }

    check_threads(train_p, train_c);
    for (int s = 0; s < 5; s++) {
        free(train_c[s]);
        case_free(&train[s]);
    }
}

int main(void)
{
    rng_state = 0x6e6d6d5f62663136ull;
    mode = MODE_BF16;
    if (cm_gemm_bf16_available()) {
        check_mode();
        check_packed_size();
        check_pack_ranges();
        check_pre();
    } else {
        check_unavailable();
    }
    mode = MODE_F32_PORTABLE;
    check_mode();
    /* The CPU's widest vector path, then AVX2 where that was AVX-512. */
    mode = MODE_F32_SIMD;
    if (cm_gemm_f32_simd_available()) {
        fprintf(stderr, "common_gemm: cm_gemm_f32's %s path\n",
                cm_gemm_f32_path_name(CM_GEMM_F32_BEST));
        check_mode();
        check_f32_pre();
    } else {
        fprintf(stderr, "common_gemm: SKIP cm_gemm_f32's vector paths: this CPU has neither "
                        "AVX-512 nor AVX2 with FMA\n");
    }
    mode = MODE_F32_AVX2;
    if (strcmp(cm_gemm_f32_path_name(CM_GEMM_F32_AVX2), "avx2") == 0 &&
        strcmp(cm_gemm_f32_path_name(CM_GEMM_F32_BEST), "avx2") != 0) {
        fprintf(stderr, "common_gemm: cm_gemm_f32's avx2 path\n");
        check_mode();
        check_f32_pre();
    }
    CHECK_MSG(n_unfused == 0, "cm_gemm_f32: %ld outputs not the in-order fmaf sum's bits",
              n_unfused);
    fprintf(stderr, "common_gemm: %ld outputs compared, worst |C - ref| / bound = %.4g\n",
            n_compared, worst_ratio);
    return check_done();
}
