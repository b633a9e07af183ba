/*
 * The input of a libFuzzer target that damages files, read front to back as the choices it
 * makes (past its end every read gives zeros, so any input is a complete recipe), and the
 * integer values it writes into a file's fields.
 */
#ifndef EMBER_TESTS_FUZZ_INPUT_H
#define EMBER_TESTS_FUZZ_INPUT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct fz_in {
    const uint8_t *p;
    size_t n;
} fz_in;

static inline uint8_t fz_u8(fz_in *in)
{
    if (in->n == 0) return 0;
    in->n--;
    return *in->p++;
}

/* n bytes of the input into out, as n calls of fz_u8 would give them (zeros past its end). */
static inline void fz_bytes(fz_in *in, uint8_t *out, size_t n)
{
    size_t k = n < in->n ? n : in->n;
    if (k) memcpy(out, in->p, k);
    memset(out + k, 0, n - k);
    in->p += k;
    in->n -= k;
}

/* `bytes` bytes of the input, little-endian. */
static inline uint64_t fz_uint(fz_in *in, int bytes)
{
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++)
        v |= (uint64_t)fz_u8(in) << (8 * i);
    return v;
}

/* A value for an integer field: an edge that size arithmetic trips on, the input's own, or the
 * current one nudged (off by one, doubled, halved: what a lying writer's arithmetic gives). */
static inline uint64_t fz_value(fz_in *in, uint64_t cur)
{
    static const uint64_t edges[] = {0,
                                     1,
                                     2,
                                     3,
                                     4,
                                     8,
                                     15,
                                     16,
                                     64,
                                     65535,
                                     65536,
                                     65537,
                                     0x7fffffffull,
                                     0xfffffffeull,
                                     0xffffffffull,
                                     1ull << 32,
                                     (1ull << 32) + 1,
                                     1ull << 40,
                                     (1ull << 40) + 1,
                                     1ull << 44,
                                     1ull << 56,
                                     1ull << 60,
                                     1ull << 61,
                                     1ull << 62,
                                     1ull << 63,
                                     UINT64_MAX / 16 + 1,
                                     UINT64_MAX / 8 + 1,
                                     UINT64_MAX - 1,
                                     UINT64_MAX};
    const uint8_t sel = fz_u8(in);
    if (sel < sizeof edges / sizeof edges[0]) return edges[sel];
    switch (sel % 8) {
    case 0:
        return fz_uint(in, 8);
    case 1:
        return fz_uint(in, 1);
    case 2:
        return cur + 1;
    case 3:
        return cur - 1;
    case 4:
        return cur * 2;
    case 5:
        return cur / 2;
    case 6:
        return cur + (uint64_t)(int8_t)fz_u8(in);
    default:
        return UINT64_MAX - fz_u8(in);
    }
}

#endif
