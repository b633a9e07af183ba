/*
 * The batched half conversions (F16C where the CPU has it) equal the scalar ones bit for bit:
 * every one of the 65536 halves decoded, and encoded floats covering every half, the ties
 * between neighbouring halves and a float either side of each, a sweep of all exponents, the
 * subnormal and overflow edges, infinities and NaNs with payloads, at odd byte offsets and with
 * tails shorter than a vector. Plus a few conversions known by hand, so the scalar reference is
 * itself held to IEEE rounding. And the copy that checks for non-finite values as it goes
 * (cm_f32_copy_first_nonfinite) against a copy and a check.
 */
#include <math.h>

#include "check.h"
#include "common/common.h"

/* Encodes src[0..n) both ways into buffers at byte offset off and compares every half. */
static void check_encode(const float *src, size_t n, size_t off)
{
    uint8_t *a = malloc(2 * n + 8), *b = malloc(2 * n + 8);
    CHECK(a != NULL && b != NULL);
    if (a && b) {
        cm_f32_to_f16_n(src, a + off, n);
        cm_f32_to_f16_n_scalar(src, b + off, n);
        size_t bad = 0, first = n;
        for (size_t i = 0; i < n; i++)
            if (memcmp(a + off + 2 * i, b + off + 2 * i, 2) != 0 && bad++ == 0) first = i;
        CHECK_MSG(bad == 0, "%zu of %zu encodings differ, first for 0x%08x (offset %zu)", bad, n,
                  first < n ? check_u32_of(src[first]) : 0u, off);
    }
    free(a);
    free(b);
}

/* cm_f32_copy_first_nonfinite against memcpy plus cm_f32_first_nonfinite: the copy whole, and
 * the first bad index, for bad values (NaN, +-Inf) at block edges and elsewhere, one or two,
 * from an odd source offset, and none. */
static void check_copy_nonfinite(void)
{
    enum { N = 5000 };
    const size_t at[] = {0, 1, 1023, 1024, 1025, 2047, 2048, 4095, N - 1};
    const float bad[] = {NAN, INFINITY, -INFINITY};
    uint8_t *raw = malloc(N * sizeof(float) + 8);
    float *src = malloc(N * sizeof *src), *got = malloc(N * sizeof *got);
    CHECK(raw && src && got);
    if (!raw || !src || !got) return;
    for (size_t off = 0; off < 2; off++)
        for (size_t n = 0; n <= N; n += n < 8 ? 1 : 997) {
            for (size_t a = 0; a <= sizeof at / sizeof at[0]; a++) {
                for (size_t i = 0; i < N; i++)
                    src[i] = (float)i * 0.5f - 7.0f;
                size_t want = n;
                if (a < sizeof at / sizeof at[0] && at[a] < n) {
                    src[at[a]] = bad[a % 3];
                    if (at[a] + 3 < n) src[at[a] + 3] = bad[(a + 1) % 3]; /* a second one */
                    want = at[a];
                }
                memcpy(raw + off, src, n * sizeof *src);
                for (size_t i = 0; i < N; i++)
                    got[i] = 12345.0f;
                size_t i = cm_f32_copy_first_nonfinite(got, raw + off, n);
                CHECK_MSG(i == want && i == cm_f32_first_nonfinite(src, n),
                          "n %zu offset %zu: first non-finite at %zu, want %zu", n, off, i, want);
                CHECK_MSG(memcmp(got, src, n * sizeof *src) == 0 && (n == N || got[n] == 12345.0f),
                          "n %zu offset %zu: copy differs or overran", n, off);
            }
        }
    free(raw);
    free(src);
    free(got);
}

int main(void)
{
    check_copy_nonfinite();
    /* hand-checked scalar anchors */
    CHECK(cm_f32_to_f16(1.0f) == 0x3c00);
    CHECK(cm_f32_to_f16(65504.0f) == 0x7bff);
    CHECK(cm_f32_to_f16(65520.0f) == 0x7c00);          /* the tie past the largest rounds up */
    CHECK(cm_f32_to_f16(ldexpf(1.0f, -24)) == 0x0001); /* smallest subnormal */
    CHECK(cm_f32_to_f16(ldexpf(1.0f, -25)) == 0x0000); /* tie to even: down */
    CHECK(cm_f32_to_f16(ldexpf(3.0f, -25)) == 0x0002); /* tie to even: up */
    CHECK(cm_f32_to_f16(check_f32_of(0xffc12345u)) == 0xfe00); /* NaN: quiet, sign kept */
    CHECK(check_u32_of(cm_f16_to_f32(0x7c01)) == 0x7fc02000u); /* signalling NaN decodes quiet */

    /* decode: all halves, from an aligned and an odd start */
    enum { H = 65536 };
    uint8_t *hs = malloc(2 * H + 2);
    float *fa = malloc((H + 8) * sizeof *fa), *fb = malloc((H + 8) * sizeof *fb);
    CHECK(hs && fa && fb);
    if (!hs || !fa || !fb) return check_done();
    for (size_t off = 0; off < 2; off++) {
        for (uint32_t h = 0; h < H; h++) {
            uint16_t v = (uint16_t)h;
            memcpy(hs + off + 2 * h, &v, 2);
        }
        size_t n = H - off; /* the odd start also leaves a tail of 7 */
        cm_f16_to_f32_n(hs + off, fa, n);
        cm_f16_to_f32_n_scalar(hs + off, fb, n);
        size_t bad = 0;
        for (size_t i = 0; i < n; i++)
            bad += check_u32_of(fa[i]) != check_u32_of(fb[i]);
        CHECK_MSG(bad == 0, "%zu of %zu decodings differ (offset %zu)", bad, n, off);
    }

    /* encode: every half, the ties between neighbours and a float either side of each */
    size_t cap = (size_t)H * 4 + 4096, n = 0;
    float *src = malloc(cap * sizeof *src);
    CHECK(src != NULL);
    if (src == NULL) return check_done();
    for (uint32_t h = 0; h < H; h++) {
        float f = cm_f16_to_f32((uint16_t)h);
        src[n++] = f;
        if (((h >> 10) & 31) == 31 || (h & 0x7fff) == 0x7bff) continue;
        float mid = (f + cm_f16_to_f32((uint16_t)(h + 1))) * 0.5f; /* exact: one more bit */
        src[n++] = mid;
        src[n++] = nextafterf(mid, 0.0f);
        src[n++] = nextafterf(mid, INFINITY * (h & 0x8000 ? -1.0f : 1.0f));
    }
    /* every exponent with a few mantissas, the subnormal and overflow edges, NaN payloads */
    for (uint32_t e = 0; e < 256; e++)
        for (uint32_t m = 0; m < 8; m++) {
            uint32_t mant = m == 7 ? 0x7fffffu : m * 0x123457u % 0x800000u;
            src[n++] = check_f32_of(e << 23 | mant);
            src[n++] = check_f32_of(0x80000000u | e << 23 | mant);
        }
    static const uint32_t special[] = {0x33000000u, 0x33000001u, 0x387fe000u, 0x387ff000u,
                                       0x38800000u, 0x477fe000u, 0x477fefffu, 0x477ff000u,
                                       0x7f800000u, 0xff800000u, 0x7f800001u, 0x7fc12345u,
                                       0xffa00000u, 0x7fffffffu, 0x80000000u, 0x00000001u};
    for (size_t i = 0; i < sizeof special / sizeof *special; i++)
        src[n++] = check_f32_of(special[i]);
    CHECK(n <= cap);
    for (size_t off = 0; off < 2; off++)
        check_encode(src, n, off);
    for (size_t len = 0; len <= 17; len++) /* tails around the vector width */
        check_encode(src + 3 * H, len, 1);
    free(src);
    free(hs);
    free(fa);
    free(fb);
    return check_done();
}
