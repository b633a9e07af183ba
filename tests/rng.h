/*
 * The tests' random numbers: splitmix64 over one state per test program, so a test's inputs
 * are fixed by the seed it stores in rng_state. Header-only; each test includes it once.
 */
#ifndef EMBER_TESTS_RNG_H
#define EMBER_TESTS_RNG_H

#include <stdint.h>

static uint64_t rng_state;

static inline uint64_t rnd64(void)
{
    uint64_t x = (rng_state += 0x9E3779B97F4A7C15ull);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Uniform in [lo, hi), from the top 53 bits. */
static inline double unif(double lo, double hi)
{
    return lo + (hi - lo) * (double)(rnd64() >> 11) * (1.0 / 9007199254740992.0);
}

/* Uniform in [0, n), n > 0. */
static inline uint32_t rndu(uint32_t n)
{
    return (uint32_t)(rnd64() % n);
}

#endif
