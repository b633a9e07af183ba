/* Sorting keys with their positions (ps/keysort.h). */
#include <stdlib.h>
#include <string.h>

#include "ps/keysort.h"

/* LSD radix sort of a[0..n) by the key bits [0, bits), stable: 11-bit digits, a pass skipped
 * where all keys share its digit, the two buffers taking turns. Small digits keep the 2048
 * counters and scatter targets in L1 (16-bit digits cleared and scanned 65536 counters a pass,
 * and were a fifth of a pull's client CPU). */
#define LSD_BITS 11
static void lsd_sort(ps_kv *a, ps_kv *tmp, size_t n, int bits)
{
    uint32_t c[1u << LSD_BITS];
    const uint64_t mask = (1u << LSD_BITS) - 1;
    ps_kv *src = a, *dst = tmp;
    for (int shift = 0; shift < bits; shift += LSD_BITS) {
        memset(c, 0, sizeof c);
        for (size_t i = 0; i < n; i++)
            c[(src[i].key >> shift) & mask]++;
        if (c[(src[0].key >> shift) & mask] == n) continue; /* one digit value */
        uint32_t sum = 0;
        for (size_t v = 0; v <= mask; v++) {
            uint32_t x = c[v];
            c[v] = sum;
            sum += x;
        }
        for (size_t i = 0; i < n; i++)
            dst[c[(src[i].key >> shift) & mask]++] = src[i];
        ps_kv *t = src;
        src = dst;
        dst = t;
    }
    if (src != a) memcpy(a, src, n * sizeof *a);
}

/* Buckets of at most this many keys are insertion-sorted; larger ones get LSD passes, each of
 * which clears and scans 2048 counters: not worth it below ~64 keys. At 32, 700K keys (buckets
 * of ~43 once d stops at SORT_MSD_MAX: a worker's int8 residuals, or a very large pull) took
 * 95-102 ns a key, 400K 29-34; at 64, 23 and 24; 40K keys (~2 a bucket) 10 either way. */
#define SORT_SMALL 64

/*
 * Sorts a[0..n) by key, stably (tmp: n entries of scratch). Keys are hashes, so the highest bits
 * in which they differ spread them evenly: one counting pass on the top d of those bits (d about
 * log2(n) - 1, at most 14: ~2 keys a bucket) leaves buckets that an insertion sort finishes,
 * with LSD passes over the bits below for a bucket of more than SORT_SMALL keys. Keys that
 * differ only in their low 22 bits take the two LSD passes alone. 40K random keys: 13.5-17 ns
 * a key, against 24-30 for LSD passes over all 64 bits (all six had distinct digits).
 */
#define SORT_MSD_MAX 14
void ps_kv_sort(ps_kv *a, ps_kv *tmp, size_t n)
{
    if (n < 2) return;
    uint64_t diff = 0;
    for (size_t i = 1; i < n; i++)
        diff |= a[i].key ^ a[0].key;
    if (diff == 0) return;
    int top = 64 - __builtin_clzll(diff); /* keys agree on every bit from top up */
    int d = 63 - __builtin_clzll((uint64_t)n) - 1;
    d = d < 1 ? 1 : d > SORT_MSD_MAX ? SORT_MSD_MAX : d;
    uint32_t *c = top > 2 * LSD_BITS ? malloc(((2u << d) + 1) * sizeof *c) : NULL;
    if (c == NULL) { /* (or out of memory: no bucket pass, the same order) */
        lsd_sort(a, tmp, n, top);
        return;
    }
    int shift = top - d;
    const uint64_t mask = (1u << d) - 1;
    uint32_t *pos = c + (1u << d) + 1;
    memset(c, 0, ((1u << d) + 1) * sizeof *c);
    for (size_t i = 0; i < n; i++)
        c[((a[i].key >> shift) & mask) + 1]++;
    for (size_t v = 1; v <= mask + 1; v++)
        c[v] += c[v - 1];
    memcpy(pos, c, (mask + 1) * sizeof *pos);
    for (size_t i = 0; i < n; i++)
        tmp[pos[(a[i].key >> shift) & mask]++] = a[i];
    memcpy(a, tmp, n * sizeof *a);
    for (size_t v = 0; v <= mask; v++) {
        size_t b0 = c[v], m = c[v + 1] - b0;
        ps_kv *s = a + b0;
        if (m > SORT_SMALL) {
            lsd_sort(s, tmp + b0, m, shift);
            continue;
        }
        for (size_t i = 1; i < m; i++) {
            ps_kv x = s[i];
            size_t j = i;
            for (; j > 0 && s[j - 1].key > x.key; j--)
                s[j] = s[j - 1];
            s[j] = x;
        }
    }
    free(c);
}
