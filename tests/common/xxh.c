/*
 * cm_xxh3 (the library's dispatched SIMD XXH3 on x86, common/xxh.h) equals the scalar XXH3
 * compiled here, for every length from 0 to 4 KiB (all of XXH3's short, medium and long-input
 * paths and their tails) and a few large ones, at several alignments.
 */
#define XXH_INLINE_ALL
#define XXH_VECTOR 0 /* XXH_SCALAR */
#include <xxhash.h>

#include "check.h"
#include "common/common.h"

int main(void)
{
    enum { MAX = 1 << 20 };
    uint8_t *buf = malloc(MAX + 64);
    CHECK(buf != NULL);
    if (buf == NULL) return check_done();
    uint64_t x = 7;
    for (size_t i = 0; i < MAX + 64; i++) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        buf[i] = (uint8_t)(x >> 56);
    }
    static const size_t big[] = {8191, 65536, 100003, MAX};
    for (size_t off = 0; off < 3; off++) {
        for (size_t n = 0; n <= 4096; n++)
            CHECK_MSG(cm_xxh3(buf + off, n) == XXH3_64bits(buf + off, n),
                      "length %zu at offset %zu", n, off);
        for (size_t k = 0; k < sizeof big / sizeof *big; k++)
            CHECK_MSG(cm_xxh3(buf + off, big[k]) == XXH3_64bits(buf + off, big[k]),
                      "length %zu at offset %zu", big[k], off);
    }
    free(buf);
    return check_done();
}
