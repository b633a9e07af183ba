/*
 * bf16 GEMM on AMX tiles (cm_gemm_bf16, contract in common.h).
 *
 * Both operands are rounded to bfloat16 (cm_f32_to_bf16's rounding) while they are packed into
 * the layouts the tile instructions read, and the products are summed in fp32 by TDPBF16PS:
 *  - A (M x K) as 16-row x 32-value tiles, a row's values along K in order;
 *  - B (K x N) as 16-row x 16-pair tiles, row p holding for each column n the pair
 *    (B[2p][n], B[2p+1][n]) in one 32-bit lane ("VNNI" order).
 * M and N are padded to 32 and K to 32 with zeros; C is computed in 32 x 32 blocks (four
 * accumulator tiles, two A and two B tiles), each block's K loop in order, so the result
 * depends on the shape and the inputs only, never on threads or timing.
 *
 * Each packer computes 16 32-bit lanes along the operand's contiguous direction, which is a
 * tile row for A NoTrans and B NoTrans, and a tile column for A Trans and B Trans (sixteen of
 * them transposed in registers: a scatter per column took ~2x as long, 0.78 against 0.43 ns a
 * value for a dW GEMM's A, 0.48 against 0.23 for a forward's B). Scratch for the packed
 * operands is per thread and grows as needed; an operand several calls share (a GEMM cut into
 * tiles) can be packed once by the caller instead (cm_gemm_bf16_pack / cm_gemm_bf16_pre).
 *
 * Packing moves ~6 bytes a value through memory and is bound by it: AVX512-BF16's conversion
 * instruction instead of the integer rounding measured no faster.
 */
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define CM_HAVE_F32_SIMD 1
#include <immintrin.h>
#define AVX512_TARGET __attribute__((target("avx512f")))
#define AVX2_TARGET __attribute__((target("avx2,fma")))
/* The register blocks' inner loops, left out of sanitizer builds' checks: each vector load would
 * carry a shadow-memory check and each pointer step an overflow check, which made the kernels
 * ~20x slower there and the suite's GEMM-heavy tests time out. What they read and write is
 * bounded by their callers' arithmetic, which stays instrumented, and tests/common/gemm.c checks
 * the bounds themselves (C's padding and tail left alone, operand slack holding NaNs never
 * read). */
#define KERNEL_UNCHECKED __attribute__((no_sanitize("address", "undefined")))

/* Transposes 16 rows of 16 32-bit lanes in registers (r[i] lane j becomes r[j] lane i):
 * pairs of lanes, then pairs of pairs, then 128-bit quarters twice. */
AVX512_TARGET static inline void transpose16(__m512i r[16])
{
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* u[4g + c], lane quarter L: rows 4g..4g+3 at column 4L + c. */
    __m512i u[16];
    for (int g = 0; g < 4; g++) {
        u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
        __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
        __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
        r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
        r[4 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
    }
}

/* The first n of 16 lanes (none for n <= 0, all for n >= 16): a row's tail for masked loads
 * and stores. */
static inline __mmask16 lanes16(int n)
{
    return n >= 16 ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1u);
}

#endif

/* C's M x N block set to zero: every GEMM's product over K = 0. */
static void zero_block(int M, int N, float *C, int ldc)
{
    for (int i = 0; i < M; i++)
        memset(C + (size_t)i * ldc, 0, (size_t)N * sizeof(float));
}

#if defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 11
#define CM_HAVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* The calling thread's packing scratch (released at thread exit). */
typedef struct scratch {
    void *a, *b;
    size_t na, nb;
} scratch;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p)
{
    scratch *s = p;
    free(s->a);
    free(s->b);
    free(s);
}

static void scratch_key_make(void)
{
    (void)pthread_key_create(&scratch_key, scratch_free);
}

static int grow(void **p, size_t *have, size_t need)
{
    if (*have >= need) return 0;
    void *q = NULL;
    if (posix_memalign(&q, 64, need) != 0) return -1;
    free(*p);
    *p = q;
    *have = need;
    return 0;
}

__attribute__((unused)) static scratch *scratch_get(size_t na, size_t nb)
{
    pthread_once(&scratch_once, scratch_key_make);
    scratch *s = pthread_getspecific(scratch_key);
    if (s == NULL) {
        s = calloc(1, sizeof *s);
        if (s == NULL || pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    if (grow(&s->a, &s->na, na) || grow(&s->b, &s->nb, nb)) return NULL;
    return s;
}

#ifdef CM_HAVE_AMX

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state; /* 1 usable, -1 not; set once */
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void amx_probe(void)
{
    unsigned a, b, c, d;
    amx_state = -1;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return;
    bool tile = d & (1u << 24), bf16 = d & (1u << 22), avx512bw = b & (1u << 30),
         avx512f = b & (1u << 16);
    if (!tile || !bf16 || !avx512f || !avx512bw) return;
    /* The OS must hand this process the tile data state (Linux 5.16+). */
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return;
    amx_state = 1;
}

typedef struct tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

/* 16 floats rounded to bf16 (cm_f32_to_bf16, lane by lane), each in its lane's low half. */
AMX_TARGET static inline __m512i bf16_round(__m512 x)
{
    __m512i u = _mm512_castps_si512(x);
    __m512i r = _mm512_add_epi32(
        u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                            _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_srli_epi32(r, 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

/* Up to 16 floats from p (n of them, the rest zero). */
AMX_TARGET static inline __m512 load16(const float *p, int n)
{
    if (n >= 16) return _mm512_loadu_ps(p);
    if (n <= 0) return _mm512_setzero_ps();
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
}

/* Pairs (lo[j], hi[j]) of 16 lanes: lo in the low half, as TDPBF16PS reads a pair. */
AMX_TARGET static inline __m512i pair16(__m512 lo, __m512 hi)
{
    return _mm512_or_si512(bf16_round(lo), _mm512_slli_epi32(bf16_round(hi), 16));
}

/* 32 consecutive values from p (n of them) as 16 pairs. */
AMX_TARGET static inline __m512i pack32(const float *p, int n)
{
    __m512i lo = bf16_round(load16(p, n)), hi = bf16_round(load16(p + 16, n - 16));
    /* Even values to the low halves: bf16 of value 2j and 2j+1 into lane j. */
    __m256i l = _mm512_cvtepi32_epi16(lo), h = _mm512_cvtepi32_epi16(hi);
    return _mm512_inserti64x4(_mm512_castsi256_si512(l), h, 1);
}

/*
 * Packs tiles [r0, r1) of an operand's 16-row tiles, each of 16 rows x 16 lanes (a lane is a
 * pair along K), tile (r, kk) at out + (r * KK + kk) * 256 lanes, KK = K/32 (padded):
 *  - A (b 0): row i of a tile is row r*16 + i of op(A) (rows = M);
 *  - B (b 1): row p of a tile holds the pairs of op(B)'s rows 2p, 2p+1 over columns r*16..+15
 *    (rows = N).
 * op(X) is X, or X^T where trans. The lanes are computed along the stored operand's contiguous
 * direction: a tile row for A NoTrans and B NoTrans, a tile column for A Trans and B Trans
 * (transposed in registers).
 */
AMX_TARGET static void pack_tiles(int b, bool trans, int rows, int K, const float *X, int ld,
                                  int r0, int r1, int KK, uint32_t *out)
{
    /* A NoTrans and B Trans read rows of X along K; A Trans and B NoTrans read pairs of rows of
     * X (along K) across 16 of the operand's rows. */
    bool along_k = b ? trans : !trans;
    for (int r = r0; r < r1; r++)
        for (int kk = 0; kk < KK; kk++) {
            uint32_t *t = out + ((size_t)r * KK + kk) * 256;
            int i0 = r * 16, k0 = kk * 32, n = rows - i0;
            __m512i v[16];
            if (along_k) {
                for (int i = 0; i < 16; i++)
                    v[i] = i < n ? pack32(X + (size_t)(i0 + i) * ld + k0, K - k0)
                                 : _mm512_setzero_si512();
            } else {
                for (int p = 0; p < 16; p++) {
                    int k = k0 + 2 * p;
                    __m512 lo = k < K ? load16(X + (size_t)k * ld + i0, n) : _mm512_setzero_ps();
                    __m512 hi =
                        k + 1 < K ? load16(X + (size_t)(k + 1) * ld + i0, n) : _mm512_setzero_ps();
                    v[p] = pair16(lo, hi);
                }
            }
            /* A wants rows along K (its lanes run along rows when read across); B wants rows
             * of pairs across N (its lanes run along K when read along K). */
            if (b ? along_k : !along_k) transpose16(v);
            for (int i = 0; i < 16; i++)
                _mm512_store_si512(t + i * 16, v[i]);
        }
}

/* Stores accumulator tile `t` (16 x 16) at C[i0][j0], clipped to M x N. */
#define STORE_TILE(t, i0, j0)                                                                      \
    do {                                                                                           \
        if ((i0) + 16 <= M && (j0) + 16 <= N)                                                      \
            _tile_stored(t, C + (size_t)(i0)*ldc + (j0), ldc * 4);                                 \
        else if ((i0) < M && (j0) < N) {                                                           \
            _tile_stored(t, edge, 64);                                                             \
            for (int i_ = 0; i_ < 16 && (i0) + i_ < M; i_++)                                       \
                for (int j_ = 0; j_ < 16 && (j0) + j_ < N; j_++)                                   \
                    C[(size_t)((i0) + i_) * ldc + (j0) + j_] = edge[i_ * 16 + j_];                 \
        }                                                                                          \
    } while (0)

/* A packed operand as amx_run reads it: tile (r, kk) at p + (r * stride + kk + off) * 256. */
typedef struct packed {
    const uint32_t *p;
    int stride, off;
} packed;

AMX_TARGET static void amx_run(int M, int N, packed A, packed B, int KK, float *C, int ldc)
{
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    float edge[256] __attribute__((aligned(64)));
    int MB = (M + 31) / 32, NB = (N + 31) / 32;
    for (int nb = 0; nb < NB; nb++)
        for (int mb = 0; mb < MB; mb++) {
            const uint32_t *a0 = A.p + ((size_t)(2 * mb) * A.stride + A.off) * 256,
                           *a1 = a0 + (size_t)A.stride * 256;
            const uint32_t *b0 = B.p + ((size_t)(2 * nb) * B.stride + B.off) * 256,
                           *b1 = b0 + (size_t)B.stride * 256;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int kk = 0; kk < KK; kk++) {
                _tile_loadd(4, a0 + (size_t)kk * 256, 64);
                _tile_loadd(5, a1 + (size_t)kk * 256, 64);
                _tile_loadd(6, b0 + (size_t)kk * 256, 64);
                _tile_loadd(7, b1 + (size_t)kk * 256, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            int i0 = mb * 32, j0 = nb * 32;
            STORE_TILE(0, i0, j0);
            STORE_TILE(1, i0, j0 + 16);
            STORE_TILE(2, i0 + 16, j0);
            STORE_TILE(3, i0 + 16, j0 + 16);
        }
    _tile_release();
}

int cm_gemm_bf16_available(void)
{
    pthread_once(&amx_once, amx_probe);
    return amx_state == 1;
}

size_t cm_gemm_bf16_packed_size(int rows, int K)
{
    if (rows <= 0 || K <= 0) return 0;
    return (size_t)((rows + 31) / 32 * 2) * (size_t)((K + 31) / 32) * 1024;
}

void cm_gemm_bf16_pack(int b, int trans, int rows, int K, const float *X, int ld, int r0, int r1,
                       void *out)
{
    if (rows <= 0 || K <= 0 || !cm_gemm_bf16_available()) return;
    int R = (rows + 31) / 32 * 2;
    r1 = r1 >= rows ? R : r1 / 16;
    pack_tiles(b != 0, trans != 0, rows, K, X, ld, r0 / 16, r1, (K + 31) / 32, out);
}

int cm_gemm_bf16_pre(int ta, int tb, int M, int N, int K, const float *A, int lda, const void *pa,
                     const float *B, int ldb, const void *pb, int K0, int k0, float *C, int ldc)
{
    if (M <= 0 || N <= 0) return CM_OK;
    if (!cm_gemm_bf16_available()) return CM_EINVAL;
    if (K <= 0) {
        zero_block(M, N, C, ldc);
        return CM_OK;
    }
    int RA = (M + 31) / 32 * 2, RB = (N + 31) / 32 * 2, KK = (K + 31) / 32;
    scratch *s = scratch_get(pa ? 0 : (size_t)RA * KK * 1024, pb ? 0 : (size_t)RB * KK * 1024);
    if (s == NULL) return CM_ENOMEM;
    packed Ap = {s->a, KK, 0}, Bp = {s->b, KK, 0};
    if (pa)
        Ap = (packed){pa, (K0 + 31) / 32, k0 / 32};
    else
        pack_tiles(0, ta != 0, M, K, A, lda, 0, RA, KK, s->a);
    if (pb)
        Bp = (packed){pb, (K0 + 31) / 32, k0 / 32};
    else
        pack_tiles(1, tb != 0, N, K, B, ldb, 0, RB, KK, s->b);
    amx_run(M, N, Ap, Bp, KK, C, ldc);
    return CM_OK;
}

int cm_gemm_bf16(int ta, int tb, int M, int N, int K, const float *A, int lda, const float *B,
                 int ldb, float *C, int ldc)
{
    return cm_gemm_bf16_pre(ta, tb, M, N, K, A, lda, NULL, B, ldb, NULL, K, 0, C, ldc);
}

#else /* no AMX build */

int cm_gemm_bf16_available(void)
{
    return 0;
}

size_t cm_gemm_bf16_packed_size(int rows, int K)
{
    (void)rows, (void)K;
    return 0;
}

void cm_gemm_bf16_pack(int b, int trans, int rows, int K, const float *X, int ld, int r0, int r1,
                       void *out)
{
    (void)b, (void)trans, (void)rows, (void)K, (void)X, (void)ld, (void)r0, (void)r1, (void)out;
}

int cm_gemm_bf16_pre(int ta, int tb, int M, int N, int K, const float *A, int lda, const void *pa,
                     const float *B, int ldb, const void *pb, int K0, int k0, float *C, int ldc)
{
    (void)ta, (void)tb, (void)M, (void)N, (void)K, (void)A, (void)lda, (void)pa, (void)B;
    (void)ldb, (void)pb, (void)K0, (void)k0, (void)C, (void)ldc;
    return CM_EINVAL;
}

int cm_gemm_bf16(int ta, int tb, int M, int N, int K, const float *A, int lda, const float *B,
                 int ldb, float *C, int ldc)
{
    (void)ta, (void)tb, (void)M, (void)N, (void)K, (void)A, (void)lda, (void)B, (void)ldb;
    (void)C, (void)ldc;
    return CM_EINVAL;
}

#endif

/*
 * fp32 GEMM (cm_gemm_f32, contract in common.h).
 *
 * Every element of C is its K products summed in order by fused multiply-adds from 0, so the
 * AVX-512, AVX2 and portable paths agree bit for bit, and no cut of the GEMM into tiles or K
 * blocks changes a bit: a K block after the first starts its accumulators from C's partial
 * sums. The vector paths are the classic packed one, each with its own register block (the
 * ops table f32_path_ops): op(A) in panels of the block's rows, op(B) in panels of columns, and
 * a B panel's part that one block reads stays in L1 while the A panels of an MC block (in L2)
 * stream past it. AVX-512: 8 x 32 (16 accumulators), one B panel row (32 values, two cache
 * lines) and 8 broadcasts of A a step for 16 FMAs, over 32-column B panels (KC x 32 floats,
 * 32 KiB). On an AMD EPYC (AVX-512) it runs at 0.96-1.07x OpenBLAS 0.3.21's Cooperlake kernel
 * and 1.5-2.0x its Haswell one on the mlp's shapes (docs/BENCHMARKS.md, stop 26); 12- and
 * 14-row blocks measured no faster. AVX2 (16 registers of 8 floats): 6 x 16 (12 accumulators),
 * A in panels of 6 rows, B packed in 16-column panels (16 KiB a K block); a B that
 * cm_gemm_f32_pack laid out once (32-column panels) is read in place, two blocks a panel. On an
 * AMD EPYC (Zen 3) about OpenBLAS's Zen kernel, both near the core's FMA peak (stop 38).
 */
#define F32_MR 8
#define F32_NR 32
#define F32_KC 256
#define F32_MC 256 /* a multiple of F32_MR */

static inline float f32_op(const float *X, int ld, int trans, int r, int k)
{
    return trans ? X[(size_t)k * ld + r] : X[(size_t)r * ld + k];
}

/* The portable path: each output's in-order fmaf chain, in plain loops. */
static inline __attribute__((always_inline)) void f32_loops(int ta, int tb, int M, int N, int K,
                                                            const float *A, int lda, const float *B,
                                                            int ldb, float *C, int ldc)
{
    for (int i = 0; i < M; i++) {
        float *c = C + (size_t)i * ldc;
        for (int j = 0; j < N; j++)
            c[j] = 0.0f;
        for (int k = 0; k < K; k++) {
            float a = f32_op(A, lda, ta, i, k);
            for (int j = 0; j < N; j++)
                c[j] = fmaf(a, f32_op(B, ldb, !tb, j, k), c[j]);
        }
    }
}

static void f32_portable_plain(int ta, int tb, int M, int N, int K, const float *A, int lda,
                               const float *B, int ldb, float *C, int ldc)
{
    f32_loops(ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
}

#ifdef CM_HAVE_F32_SIMD
/* The same loops where the CPU has FMA: fmaf is then one instruction (elsewhere a libm call per
 * multiply-add, ~20x slower, which the tests that run this path as the reference feel). Its
 * bits are the same: a fused multiply-add rounds once whatever computes it. */
AVX2_TARGET static void f32_portable_fma(int ta, int tb, int M, int N, int K, const float *A,
                                         int lda, const float *B, int ldb, float *C, int ldc)
{
    f32_loops(ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
}
#endif

static void f32_portable(int ta, int tb, int M, int N, int K, const float *A, int lda,
                         const float *B, int ldb, float *C, int ldc)
{
#ifdef CM_HAVE_F32_SIMD
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        f32_portable_fma(ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
        return;
    }
#endif
    f32_portable_plain(ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
}

#ifdef CM_HAVE_F32_SIMD

/* 8 rows of 8 floats transposed in registers (r[i] lane j becomes r[j] lane i). */
AVX2_TARGET static inline void transpose8(__m256 r[8])
{
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int g = 0; g < 8; g += 4) {
        u[g] = _mm256_shuffle_ps(t[g], t[g + 2], 0x44);
        u[g + 1] = _mm256_shuffle_ps(t[g], t[g + 2], 0xee);
        u[g + 2] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0x44);
        u[g + 3] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0xee);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
        r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
    }
}

/* Rows [i0, i0 + mc) of op(A) over inner indexes [k0, k0 + kc), in panels of F32_MR (8) rows
 * (rows past M zero): panel p's inner index k at out + (p * kc + k) * 8. Whole panels are
 * copied 8 values at a time (ta: a row of A holds a panel's 8 values of one k) or transposed
 * 8 x 8 in registers; the edges value by value. */
AVX2_TARGET static void f32_pack_a(int ta, int M, const float *A, int lda, int i0, int mc, int k0,
                                   int kc, float *out)
{
    for (int p = 0; p * F32_MR < mc; p++) {
        float *o = out + (size_t)p * kc * F32_MR;
        int r0 = i0 + p * F32_MR, n = M - r0 < F32_MR ? M - r0 : F32_MR, k = 0;
        if (n == F32_MR && ta) {
            for (; k < kc; k++)
                _mm256_store_ps(o + (size_t)k * F32_MR,
                                _mm256_loadu_ps(A + (size_t)(k0 + k) * lda + r0));
        } else if (n == F32_MR) {
            for (; k + 8 <= kc; k += 8) {
                __m256 v[8];
                for (int r = 0; r < 8; r++)
                    v[r] = _mm256_loadu_ps(A + (size_t)(r0 + r) * lda + k0 + k);
                transpose8(v);
                for (int q = 0; q < 8; q++)
                    _mm256_store_ps(o + (size_t)(k + q) * F32_MR, v[q]);
            }
        }
        for (; k < kc; k++)
            for (int r = 0; r < F32_MR; r++)
                o[(size_t)k * F32_MR + r] = r < n ? f32_op(A, lda, ta, r0 + r, k0 + k) : 0.0f;
    }
}

/* op(B) over inner indexes [k0, k0 + kc), all N columns, in panels of F32_NR (32) columns
 * (columns past N zero): panel q's inner index k at out + (q * kc + k) * 32. B's rows are
 * copied with masks; tb (a column of op(B) is a row of B) whole halves of a panel are
 * transposed 16 x 16 in registers, the edges value by value. */
AVX512_TARGET static void f32_pack_b(int tb, int N, const float *B, int ldb, int k0, int kc,
                                     float *out)
{
    for (int q = 0; q * F32_NR < N; q++) {
        float *o = out + (size_t)q * kc * F32_NR;
        int j0 = q * F32_NR, n = N - j0 < F32_NR ? N - j0 : F32_NR;
        if (!tb) {
            const __mmask16 m0 = lanes16(n), m1 = lanes16(n - 16);
            for (int k = 0; k < kc; k++) {
                const float *b = B + (size_t)(k0 + k) * ldb + j0;
                _mm512_store_ps(o + (size_t)k * F32_NR, _mm512_maskz_loadu_ps(m0, b));
                _mm512_store_ps(o + (size_t)k * F32_NR + 16, _mm512_maskz_loadu_ps(m1, b + 16));
            }
            continue;
        }
        for (int h = 0; h < F32_NR; h += 16) {
            int k = 0;
            if (n >= h + 16)
                for (; k + 16 <= kc; k += 16) {
                    __m512i v[16];
                    for (int j = 0; j < 16; j++)
                        v[j] = _mm512_castps_si512(
                            _mm512_loadu_ps(B + (size_t)(j0 + h + j) * ldb + k0 + k));
                    transpose16(v);
                    for (int t = 0; t < 16; t++)
                        _mm512_store_si512(o + (size_t)(k + t) * F32_NR + h, v[t]);
                }
            for (; k < kc; k++)
                for (int j = h; j < h + 16; j++)
                    o[(size_t)k * F32_NR + j] = j < n ? B[(size_t)(j0 + j) * ldb + k0 + k] : 0.0f;
        }
    }
}

/* C's mr x min(nr, F32_NR) block (mr <= F32_MR) = (load ? itself : 0) + a panel x b panel
 * over kc inner indexes, in order. */
KERNEL_UNCHECKED AVX512_TARGET static void f32_kernel(int kc, const float *restrict a,
                                                      const float *restrict b, int bs, float *C,
                                                      int ldc, int mr, int nr, int load)
{
    __m512 c0[F32_MR], c1[F32_MR];
    const __mmask16 m0 = lanes16(nr), m1 = lanes16(nr - 16);
#pragma GCC unroll 8
    for (int r = 0; r < F32_MR; r++) {
        bool in = load && r < mr;
        c0[r] = in ? _mm512_maskz_loadu_ps(m0, C + (size_t)r * ldc) : _mm512_setzero_ps();
        c1[r] = in ? _mm512_maskz_loadu_ps(m1, C + (size_t)r * ldc + 16) : _mm512_setzero_ps();
    }
    for (int k = 0; k < kc; k++) {
        __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16);
#pragma GCC unroll 8
        for (int r = 0; r < F32_MR; r++) {
            __m512 x = _mm512_set1_ps(a[r]);
            c0[r] = _mm512_fmadd_ps(x, b0, c0[r]);
            c1[r] = _mm512_fmadd_ps(x, b1, c1[r]);
        }
        a += F32_MR;
        b += bs;
    }
#pragma GCC unroll 8
    for (int r = 0; r < F32_MR; r++)
        if (r < mr) {
            _mm512_mask_storeu_ps(C + (size_t)r * ldc, m0, c0[r]);
            _mm512_mask_storeu_ps(C + (size_t)r * ldc + 16, m1, c1[r]);
        }
}

/* The first n of 8 lanes (none for n <= 0, all for n >= 8), as AVX2's masked loads and
 * stores take them. */
AVX2_TARGET static inline __m256i lanes8(int n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* op(B) over inner indexes [k0, k0 + kc) for the AVX2 path: f32_pack_b's layout but in panels
 * of F32_NR_AVX2 (16) columns, so that the part of a B panel that one register block reads is
 * contiguous (in 32-column panels its rows sit 128 bytes apart, which uses only half of L1's
 * sets). B's rows copied with masks; tb 8 x 8 blocks transposed. */
#define F32_NR_AVX2 16
AVX2_TARGET static void f32_pack_b_avx2(int tb, int N, const float *B, int ldb, int k0, int kc,
                                        float *out)
{
    for (int q = 0; q * F32_NR_AVX2 < N; q++) {
        float *o = out + (size_t)q * kc * F32_NR_AVX2;
        int j0 = q * F32_NR_AVX2, n = N - j0 < F32_NR_AVX2 ? N - j0 : F32_NR_AVX2;
        if (!tb) {
            const __m256i m0 = lanes8(n), m1 = lanes8(n - 8);
            for (int k = 0; k < kc; k++) {
                const float *b = B + (size_t)(k0 + k) * ldb + j0;
                _mm256_store_ps(o + (size_t)k * F32_NR_AVX2, _mm256_maskload_ps(b, m0));
                _mm256_store_ps(o + (size_t)k * F32_NR_AVX2 + 8, _mm256_maskload_ps(b + 8, m1));
            }
            continue;
        }
        for (int h = 0; h < F32_NR_AVX2; h += 8) {
            int k = 0;
            if (n >= h + 8)
                for (; k + 8 <= kc; k += 8) {
                    __m256 v[8];
                    for (int j = 0; j < 8; j++)
                        v[j] = _mm256_loadu_ps(B + (size_t)(j0 + h + j) * ldb + k0 + k);
                    transpose8(v);
                    for (int t = 0; t < 8; t++)
                        _mm256_store_ps(o + (size_t)(k + t) * F32_NR_AVX2 + h, v[t]);
                }
            for (; k < kc; k++)
                for (int j = h; j < h + 8; j++)
                    o[(size_t)k * F32_NR_AVX2 + j] =
                        j < n ? B[(size_t)(j0 + j) * ldb + k0 + k] : 0.0f;
        }
    }
}

/* f32_pack_a's layout in panels of F32_MR_AVX2 (6) rows: panel p's inner index k at
 * out + (p * kc + k) * 6. ta: 6 of a row of A a step; else 8 x 8 blocks of 6 rows (and 2 left
 * zero) transposed. Each step's 6 values are stored as 8, in order, the next step's store
 * overwriting the 2 extra: out has F32_PACK_SLACK floats past the last panel for them (masked
 * stores would not need it; they are the slow kind on AMD CPUs, as the kernel's C showed). */
#define F32_MR_AVX2 6
#define F32_MC_AVX2 252 /* a multiple of F32_MR_AVX2 */
#define F32_KC_AVX2 256
#define F32_PACK_SLACK 8
AVX2_TARGET static void f32_pack_a_avx2(int ta, int M, const float *A, int lda, int i0, int mc,
                                        int k0, int kc, float *out)
{
    const __m256i six = lanes8(F32_MR_AVX2);
    for (int p = 0; p * F32_MR_AVX2 < mc; p++) {
        float *o = out + (size_t)p * kc * F32_MR_AVX2;
        int r0 = i0 + p * F32_MR_AVX2, n = M - r0 < F32_MR_AVX2 ? M - r0 : F32_MR_AVX2, k = 0;
        if (n == F32_MR_AVX2 && ta) {
            for (; k < kc; k++)
                _mm256_storeu_ps(o + (size_t)k * F32_MR_AVX2,
                                 _mm256_maskload_ps(A + (size_t)(k0 + k) * lda + r0, six));
        } else if (n == F32_MR_AVX2) {
            for (; k + 8 <= kc; k += 8) {
                __m256 v[8];
                for (int r = 0; r < 8; r++)
                    v[r] = r < F32_MR_AVX2 ? _mm256_loadu_ps(A + (size_t)(r0 + r) * lda + k0 + k)
                                           : _mm256_setzero_ps();
                transpose8(v);
                for (int q = 0; q < 8; q++)
                    _mm256_storeu_ps(o + (size_t)(k + q) * F32_MR_AVX2, v[q]);
            }
        }
        for (; k < kc; k++)
            for (int r = 0; r < F32_MR_AVX2; r++)
                o[(size_t)k * F32_MR_AVX2 + r] = r < n ? f32_op(A, lda, ta, r0 + r, k0 + k) : 0.0f;
    }
}

/* f32_kernel with AVX2: C's mr x min(cols, 16) block (mr <= 6) from a 6-row A panel and 16
 * columns of a B panel (b: the first; F32_NR a step). 12 accumulators: more than the 8 that two
 * FMA pipes of 4 cycles' latency need in flight. */
KERNEL_UNCHECKED AVX2_TARGET static void f32_kernel_avx2_6x16(int kc, const float *restrict a,
                                                              const float *restrict b, int bs,
                                                              float *C, int ldc, int mr, int cols,
                                                              int load)
{
    __m256 c0[F32_MR_AVX2], c1[F32_MR_AVX2];
    /* Whole blocks load and store C plainly: on Zen 3 the kernel measured faster so than with
     * masked moves for every block (docs/BENCHMARKS.md, stop 38). */
    const bool whole = mr == F32_MR_AVX2 && cols >= 16;
    const __m256i m0 = lanes8(cols), m1 = lanes8(cols - 8);
#pragma GCC unroll 6
    for (int r = 0; r < F32_MR_AVX2; r++) {
        const float *c = C + (size_t)r * ldc;
        bool in = load && r < mr;
        c0[r] = !in ? _mm256_setzero_ps() : whole ? _mm256_loadu_ps(c) : _mm256_maskload_ps(c, m0);
        c1[r] = !in     ? _mm256_setzero_ps()
                : whole ? _mm256_loadu_ps(c + 8)
                        : _mm256_maskload_ps(c + 8, m1);
    }
    for (int k = 0; k < kc; k++) {
        __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 6
        for (int r = 0; r < F32_MR_AVX2; r++) {
            __m256 x = _mm256_broadcast_ss(a + r);
            c0[r] = _mm256_fmadd_ps(x, b0, c0[r]);
            c1[r] = _mm256_fmadd_ps(x, b1, c1[r]);
        }
        a += F32_MR_AVX2;
        b += bs;
    }
#pragma GCC unroll 6
    for (int r = 0; r < F32_MR_AVX2; r++) {
        float *c = C + (size_t)r * ldc;
        if (whole) {
            _mm256_storeu_ps(c, c0[r]);
            _mm256_storeu_ps(c + 8, c1[r]);
        } else if (r < mr) {
            _mm256_maskstore_ps(c, m0, c0[r]);
            _mm256_maskstore_ps(c + 8, m1, c1[r]);
        }
    }
}

/* A vector path: its A panels' rows and rows a block, its register block's columns (of a B
 * panel's F32_NR), its packings and its register block. */
typedef struct f32_path_ops {
    const char *name;
    int mr, mc, nr, kc, pack_nr;
    void (*pack_a)(int ta, int M, const float *A, int lda, int i0, int mc, int k0, int kc,
                   float *out);
    void (*pack_b)(int tb, int N, const float *B, int ldb, int k0, int kc, float *out);
    void (*kernel)(int kc, const float *restrict a, const float *restrict b, int bs, float *C,
                   int ldc, int mr, int nr, int load);
} f32_path_ops;

static const f32_path_ops f32_avx512 = {"avx512", F32_MR,     F32_MC,     F32_NR,    F32_KC,
                                        F32_NR,   f32_pack_a, f32_pack_b, f32_kernel};
static const f32_path_ops f32_avx2 = {"avx2",          F32_MR_AVX2,     F32_MC_AVX2,
                                      F32_NR_AVX2,     F32_KC_AVX2,     F32_NR_AVX2,
                                      f32_pack_a_avx2, f32_pack_b_avx2, f32_kernel_avx2_6x16};

/* pb: op(B) packed by cm_gemm_f32_pack (its panel holding this call's column 0), B not read;
 * NULL: B packed here, a K block at a time. */
static int f32_simd(const f32_path_ops *ops, int ta, int tb, int M, int N, int K, const float *A,
                    int lda, const float *B, int ldb, const float *pb, float *C, int ldc)
{
    const int MR = ops->mr, MC = ops->mc, KC = ops->kc;
    int NP = (N + F32_NR - 1) / F32_NR, kcmax = K < KC ? K : KC;
    int mcmax = M < MC ? (M + MR - 1) / MR * MR : MC;
    scratch *s = scratch_get(((size_t)mcmax * kcmax + F32_PACK_SLACK) * sizeof(float),
                             pb ? 0 : (size_t)NP * F32_NR * kcmax * sizeof(float));
    if (s == NULL) return CM_ENOMEM;
    float *ap = s->a;
    for (int k0 = 0; k0 < K; k0 += KC) {
        int kc = K - k0 < KC ? K - k0 : KC;
        /* op(B)'s panels are pw columns wide (cm_gemm_f32_pack's, or the path's own packing);
         * panel q's rows of this K block at bp + q * pstride. */
        const int pw = pb ? F32_NR : ops->pack_nr;
        const float *bp = pb ? pb + (size_t)k0 * F32_NR : s->b;
        const size_t pstride = (size_t)(pb ? K : kc) * pw;
        if (pb == NULL) ops->pack_b(tb, N, B, ldb, k0, kc, s->b);
        for (int i0 = 0; i0 < M; i0 += MC) {
            int mc = M - i0 < MC ? M - i0 : MC;
            ops->pack_a(ta, M, A, lda, i0, mc, k0, kc, ap);
            /* A narrower register block runs over all A panels for each part of a B panel:
             * its part (KC x 16 floats for AVX2) stays in L1 while they stream past. */
            for (int j0 = 0; j0 < N; j0 += ops->nr) {
                const float *b = bp + (size_t)(j0 / pw) * pstride + j0 % pw;
                for (int p = 0; p * MR < mc; p++) {
                    int r0 = p * MR, mr = mc - r0 < MR ? mc - r0 : MR;
                    ops->kernel(kc, ap + (size_t)p * kc * MR, b, pw,
                                C + (size_t)(i0 + r0) * ldc + j0, ldc, mr, N - j0, k0 > 0);
                }
            }
        }
    }
    return CM_OK;
}
#endif

/* The vector path a cm_gemm_f32 path runs on this build and CPU; NULL: the portable loops. */
static const void *f32_path_of(int path)
{
#ifdef CM_HAVE_F32_SIMD
    __builtin_cpu_init();
    if (path == CM_GEMM_F32_BEST && __builtin_cpu_supports("avx512f")) return &f32_avx512;
    if (path != CM_GEMM_F32_PORTABLE && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma"))
        return &f32_avx2;
#endif
    (void)path;
    return NULL;
}

const char *cm_gemm_f32_path_name(int path)
{
#ifdef CM_HAVE_F32_SIMD
    const f32_path_ops *ops = f32_path_of(path);
    if (ops != NULL) return ops->name;
#endif
    (void)path;
    return "portable";
}

int cm_gemm_f32_simd_available(void)
{
    return f32_path_of(CM_GEMM_F32_BEST) != NULL;
}

int cm_gemm_f32(int path, int ta, int tb, int M, int N, int K, const float *A, int lda,
                const float *B, int ldb, float *C, int ldc)
{
    if (M <= 0 || N <= 0) return CM_OK;
    if (K <= 0) {
        zero_block(M, N, C, ldc);
        return CM_OK;
    }
#ifdef CM_HAVE_F32_SIMD
    const f32_path_ops *ops = f32_path_of(path);
    if (ops != NULL) return f32_simd(ops, ta != 0, tb != 0, M, N, K, A, lda, B, ldb, NULL, C, ldc);
#endif
    f32_portable(ta != 0, tb != 0, M, N, K, A, lda, B, ldb, C, ldc);
    return CM_OK;
}

/* The vector paths' layout of a whole op(B), so that f32_simd reads it in place: each
 * F32_NR-column panel is its K blocks' panels (f32_pack_b's) one after another. */
size_t cm_gemm_f32_packed_floats(int N, int K)
{
    return N <= 0 || K <= 0 ? 0 : (size_t)(N + F32_NR - 1) / F32_NR * F32_NR * (size_t)K;
}

void cm_gemm_f32_pack(int tb, int N, int K, const float *B, int ldb, float *out)
{
    for (int j0 = 0; j0 < N; j0 += F32_NR) {
        float *o = out + (size_t)j0 * K;
        for (int k = 0; k < K; k++)
            for (int j = 0; j < F32_NR; j++)
                o[(size_t)k * F32_NR + j] = j0 + j < N ? f32_op(B, ldb, !tb, j0 + j, k) : 0.0f;
    }
}

int cm_gemm_f32_pre(int path, int ta, int M, int N, int K, const float *A, int lda, const float *pb,
                    int j0, float *C, int ldc)
{
    const void *ops = f32_path_of(path);
    if (ops == NULL || j0 % F32_NR != 0) return CM_EINVAL;
    if (M <= 0 || N <= 0) return CM_OK;
    if (K <= 0) {
        zero_block(M, N, C, ldc);
        return CM_OK;
    }
#ifdef CM_HAVE_F32_SIMD
    return f32_simd(ops, ta != 0, 0, M, N, K, A, lda, NULL, 0, pb + (size_t)j0 * K, C, ldc);
#else
    (void)ta, (void)A, (void)lda, (void)pb, (void)C, (void)ldc;
    return CM_EINVAL;
#endif
}
