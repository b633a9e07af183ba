/* Compact number formats shared by the wire codecs and the serving bundle: fp16 and bf16
 * (round to nearest even) and int8 quantisation with a per-row scale; and the finiteness scan
 * every gradient goes through. */
#include <math.h>
#include <stdbool.h>
#include <string.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "common/common.h"

uint16_t cm_f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) return (uint16_t)(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past the largest half */
    if (a < 0x38800000u) {
        /* Below the smallest normal half: the subnormal's mantissa is f * 2^24, rounded to
         * nearest even (the default rounding mode). */
        float af;
        memcpy(&af, &a, 4);
        return (uint16_t)(sign | (uint16_t)lrintf(af * 16777216.0f));
    }
    uint32_t h = ((a >> 23) - 112u) << 10 | ((a >> 13) & 0x3ffu);
    uint32_t rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

float cm_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, x;
    if (e == 0) {
        float f = (float)m * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    if (e == 31) /* a NaN comes back quiet, as the F16C instruction returns it */
        x = sign | 0x7f800000u | (m ? 0x400000u : 0u) | (m << 13);
    else
        x = sign | ((e + 112u) << 23) | (m << 13);
    float f;
    memcpy(&f, &x, 4);
    return f;
}

void cm_f32_to_f16_n_scalar(const float *src, void *dst, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint16_t v = cm_f32_to_f16(src[i]);
        memcpy((uint8_t *)dst + 2 * i, &v, 2);
    }
}

void cm_f16_to_f32_n_scalar(const void *src, float *dst, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint16_t v;
        memcpy(&v, (const uint8_t *)src + 2 * i, 2);
        dst[i] = cm_f16_to_f32(v);
    }
}

#if defined(__x86_64__)
/* 8 lanes at a time with F16C; the instruction rounds to nearest even like the scalar code.
 * It keeps a NaN's payload where the scalar code returns the one quiet NaN 0x7e00 (with the
 * sign), so NaN lanes are rewritten to match. */
__attribute__((target("f16c"))) static void f32_to_f16_n_f16c(const float *src, void *dst, size_t n)
{
    const __m128i exp = _mm_set1_epi16(0x7c00), man = _mm_set1_epi16(0x3ff),
                  sign = _mm_set1_epi16((short)0x8000), qnan = _mm_set1_epi16(0x7e00);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
        __m128i is_nan =
            _mm_andnot_si128(_mm_cmpeq_epi16(_mm_and_si128(h, man), _mm_setzero_si128()),
                             _mm_cmpeq_epi16(_mm_and_si128(h, exp), exp));
        __m128i fixed = _mm_or_si128(_mm_and_si128(h, sign), qnan);
        h = _mm_or_si128(_mm_and_si128(is_nan, fixed), _mm_andnot_si128(is_nan, h));
        _mm_storeu_si128((__m128i *)(void *)((uint8_t *)dst + 2 * i), h);
    }
    cm_f32_to_f16_n_scalar(src + i, (uint8_t *)dst + 2 * i, n - i);
}

__attribute__((target("f16c"))) static void f16_to_f32_n_f16c(const void *src, float *dst, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i,
                         _mm256_cvtph_ps(_mm_loadu_si128(
                             (const __m128i *)(const void *)((const uint8_t *)src + 2 * i))));
    cm_f16_to_f32_n_scalar((const uint8_t *)src + 2 * i, dst + i, n - i);
}

/* 1 when the CPU has F16C, 0 when not, -1 before the first look. */
static int f16c_state = -1;

static bool have_f16c(void)
{
    int v = __atomic_load_n(&f16c_state, __ATOMIC_RELAXED);
    if (v < 0) {
        /* cpuid rather than __builtin_cpu_supports("f16c"), which clang 14 does not know. */
        unsigned a, b, c, d;
        v = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) ? 1 : 0;
        __atomic_store_n(&f16c_state, v, __ATOMIC_RELAXED);
    }
    return v == 1;
}
#endif

void cm_f32_to_f16_n(const float *src, void *dst, size_t n)
{
#if defined(__x86_64__)
    if (have_f16c()) {
        f32_to_f16_n_f16c(src, dst, n);
        return;
    }
#endif
    cm_f32_to_f16_n_scalar(src, dst, n);
}

void cm_f16_to_f32_n(const void *src, float *dst, size_t n)
{
#if defined(__x86_64__)
    if (have_f16c()) {
        f16_to_f32_n_f16c(src, dst, n);
        return;
    }
#endif
    cm_f16_to_f32_n_scalar(src, dst, n);
}

uint16_t cm_f32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

float cm_bf16_to_f32(uint16_t h)
{
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

float cm_absmax(const float *x, uint32_t dim)
{
    float amax = 0.0f;
    for (uint32_t j = 0; j < dim; j++) { /* fmaxf is a libm call here; a NaN is skipped alike */
        float a = fabsf(x[j]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

/* Rounds with rintf (to nearest even, as lrintf did) and clamps in float, which the compiler
 * vectorises (the AVX2 clone rounds 8 values an instruction); clamped, the rounded value is a
 * whole number of magnitude at most 127, so q and back are the same bits as with lrintf (a NaN,
 * which callers reject before, still gives -127). */
#if defined(__clang__) /* clang 14 emits the clones of an external function but no resolver */
#define QUANTIZE_CLONES
#else
#define QUANTIZE_CLONES CM_CLONES_AVX2
#endif
QUANTIZE_CLONES void cm_int8_quantize(const float *x, uint32_t dim, float scale, float inv,
                                      uint8_t *q, float *back)
{
    /* A subnormal scale has no finite inverse: divide instead (rare, so the common path keeps
     * its multiply). */
    const bool divide = !isfinite(inv);
    for (uint32_t j = 0; j < dim; j++) {
        float r = rintf(divide ? x[j] / scale : x[j] * inv);
        int v = (int)(r >= -127.0f ? (r <= 127.0f ? r : 127.0f) : -127.0f); /* NaN: -127 */
        q[j] = (uint8_t)(int8_t)v;
        if (back) back[j] = (float)v * scale; /* from v, not r: a rounded -0.0 decodes as +0 */
    }
}

void cm_int8_dequantize(const uint8_t *q, uint32_t dim, float scale, float *out)
{
    for (uint32_t j = 0; j < dim; j++)
        out[j] = (float)(int8_t)q[j] * scale;
}

void cm_int8_row_encode(const float *x, uint32_t dim, uint8_t *out)
{
    float amax = cm_absmax(x, dim), scale = amax / 127.0f;
    memcpy(out, &scale, 4);
    cm_int8_quantize(x, dim, scale, amax > 0.0f ? 127.0f / amax : 0.0f, out + 4, NULL);
}

void cm_int8_row_decode(const uint8_t *in, uint32_t dim, float *out)
{
    float scale;
    memcpy(&scale, in, 4);
    cm_int8_dequantize(in + 4, dim, scale, out);
}

size_t cm_f32_copy_first_nonfinite(float *dst, const void *src, size_t n)
{
    /* A block at a time: each block is checked where it was just written, still in L1. */
    enum { BLOCK = 1024 };
    size_t bad = n;
    for (size_t b = 0; b < n; b += BLOCK) {
        size_t m = n - b < BLOCK ? n - b : BLOCK;
        memcpy(dst + b, (const char *)src + b * sizeof *dst, m * sizeof *dst);
        if (bad == n) {
            size_t i = cm_f32_first_nonfinite(dst + b, m);
            if (i < m) bad = b + i;
        }
    }
    return bad;
}

size_t cm_f32_first_nonfinite(const float *x, size_t n)
{
    /* A block at a time with no early exit, so the compiler can vectorise the common case (all
     * finite); a block that holds a bad value is searched again for its first one. */
    enum { BLOCK = 1024 };
    for (size_t b = 0; b < n; b += BLOCK) {
        size_t e = n - b < BLOCK ? n : b + BLOCK;
        uint32_t bad = 0;
        for (size_t i = b; i < e; i++) {
            uint32_t u;
            memcpy(&u, &x[i], 4);
            bad |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
        }
        if (bad)
            for (size_t i = b; i < e; i++)
                if (!isfinite(x[i])) return i;
    }
    return n;
}
