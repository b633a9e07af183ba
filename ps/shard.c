/* Key -> shard, in a file of its own: the key's xxh3 is inlined here (an 8-byte input), while
 * wire.c's checksums go through the library's dispatched XXH3 (common/xxh.h), whose call cost
 * as much as the hash on every key a client splits. Both compute the same XXH3. */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "ps/ps.h"

uint32_t ps_key_shard(uint64_t key, uint32_t n_shards)
{
    /* Jump consistent hash (Lamping & Veach) over xxh3 of the key. */
    uint64_t h = XXH3_64bits(&key, sizeof key);
    int64_t b = -1, j = 0;
    while (j < (int64_t)n_shards) {
        b = j;
        h = h * 2862933555777941757ull + 1;
        j = (int64_t)((double)(b + 1) * ((double)(1ull << 31) / (double)((h >> 33) + 1)));
    }
    return (uint32_t)b;
}
