/*
 * The physical limit the table and serving benchmarks compare against: gathering random
 * 64-byte rows from a large array, batched, with or without software prefetch. One definition,
 * so both benchmarks measure the same thing.
 */
#ifndef EMBER_TOOLS_BENCH_GATHER_H
#define EMBER_TOOLS_BENCH_GATHER_H

#include <stdint.h>
#include <string.h>

#define BENCH_GATHER_ROW 64u
/* Prefetch distance: enough misses in flight to cover DRAM latency. */
#define BENCH_GATHER_PF_DIST 16u

static inline void bench_gather_batch(const uint8_t *rows, const uint64_t *idx, uint32_t n,
                                      uint8_t *out, int prefetch)
{
    for (uint32_t i = 0; i < n; i++) {
        if (prefetch && i + BENCH_GATHER_PF_DIST < n)
            __builtin_prefetch(rows + idx[i + BENCH_GATHER_PF_DIST] * BENCH_GATHER_ROW);
        memcpy(out + (size_t)i * BENCH_GATHER_ROW, rows + idx[i] * BENCH_GATHER_ROW,
               BENCH_GATHER_ROW);
    }
}

#endif
