/*
 * xxHash for checksums (files, shards, PS messages). On x86 the library's runtime-dispatched
 * builds replace XXH3_64bits and XXH3_64bits_update: AVX2 or AVX-512 where the CPU has them,
 * SSE2 otherwise, the same values either way (tests/common/xxh.c checks them against the
 * scalar code). Checksums of megabyte messages ran at SSE2 speed before. Keys are hashed by an
 * inlined copy (embedding/internal.h): 8-byte inputs gain nothing from wide vectors.
 */
#ifndef EMBER_COMMON_XXH_H
#define EMBER_COMMON_XXH_H

#include <xxhash.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xxh_x86dispatch.h>
#endif

#endif
