/*
 * Private to ps/: sorting 64-bit keys, each with a 32-bit position, fast for hashed keys (a
 * counting pass on their top bits, then LSD radix passes or insertion sorts in the buckets:
 * ps/keysort.c). The client sorts every pull's and push's keys with it, and a residual file's
 * keys are written in its order.
 */
#ifndef EMBER_PS_KEYSORT_H
#define EMBER_PS_KEYSORT_H

#include <stddef.h>
#include <stdint.h>

typedef struct ps_kv {
    uint64_t key;
    uint32_t idx; /* the caller's: typically the key's position before the sort */
} ps_kv;

/* Sorts a[0..n) by key, stably, n < 2^32 (tmp: n entries of scratch, contents lost). */
void ps_kv_sort(ps_kv *a, ps_kv *tmp, size_t n);

#endif
