/* Compact number formats shared by the wire codecs and the serving bundle: fp16 and bf16
 * (round to nearest even) and int8 quantisation with a per-row scale; and the finiteness scan
 * every gradient goes through. */
#include <math.h>
#include <stdbool.h>
#include <string.h>

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
    if (e == 31)
        x = sign | 0x7f800000u | (m << 13);
    else
        x = sign | ((e + 112u) << 23) | (m << 13);
    float f;
    memcpy(&f, &x, 4);
    return f;
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
    for (uint32_t j = 0; j < dim; j++)
        amax = fmaxf(amax, fabsf(x[j]));
    return amax;
}

void cm_int8_quantize(const float *x, uint32_t dim, float scale, float inv, uint8_t *q, float *back)
{
    /* A subnormal scale has no finite inverse: divide instead (rare, so the common path keeps
     * its multiply). */
    const bool divide = !isfinite(inv);
    for (uint32_t j = 0; j < dim; j++) {
        long v = lrintf(divide ? x[j] / scale : x[j] * inv);
        v = v > 127 ? 127 : v < -127 ? -127 : v;
        q[j] = (uint8_t)(int8_t)v;
        if (back) back[j] = (float)v * scale;
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
