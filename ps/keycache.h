/*
 * Private to ps/: the key lists of recent pulls, for key elision (docs/PROTOCOL.md, "Key
 * elision").
 *
 * A worker pushes gradients for exactly the keys it pulled just before, so a push may name that
 * pull (by request id) instead of carrying its keys again. Both ends remember the last
 * PS_KEYLIST_RING pulled key lists of each (owner, table) ring: the server per (worker, table),
 * the client per (shard, table). The oldest list of a ring makes way for a new one, so memory
 * is bounded by PS_KEYLIST_RING lists per ring; a push naming an evicted list is answered with
 * PS_STATUS_NO_KEYS and resent with its keys.
 */
#ifndef EMBER_PS_KEYCACHE_H
#define EMBER_PS_KEYCACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct ps_keycache ps_keycache;

/* n_owners x n_tables rings. NULL when out of memory. */
ps_keycache *ps_keycache_create(uint32_t n_owners, uint32_t n_tables);
void ps_keycache_destroy(ps_keycache *kc);

/* Remembers keys (n sorted keys, malloc'd; the cache takes them) as the list of request req_id,
 * evicting the ring's oldest; a list already held under req_id (a resent pull) is replaced.
 * hints (n, malloc'd, taken; NULL for none) are the table's slot hints for those keys
 * (emb_table_pull_hinted): the server hands them to the push that names the pull. Thread-safe. */
void ps_keycache_put(ps_keycache *kc, uint32_t owner, uint32_t table, uint64_t req_id,
                     uint64_t *keys, uint64_t *hints, size_t n);

typedef enum ps_keycache_result {
    PS_KC_FOUND = 0,
    PS_KC_UNKNOWN,  /* no list under that request id (never seen, or evicted) */
    PS_KC_COUNT,    /* held, with a different number of keys */
    PS_KC_CHECKSUM, /* held, with a different checksum */
} ps_keycache_result;

/* Copies the list of request req_id into out (n keys) when it has n keys and ps_keys_sum sum,
 * and, when hints is not NULL, its hints into hints (n; EMB_NO_HINT each where none were
 * kept); *have_n gets the count held (for error messages). Thread-safe. */
ps_keycache_result ps_keycache_get(ps_keycache *kc, uint32_t owner, uint32_t table, uint64_t req_id,
                                   size_t n, uint64_t sum, uint64_t *out, uint64_t *hints,
                                   size_t *have_n);

/* Finds a held list equal to keys (n sorted keys): its request id and checksum. Thread-safe. */
bool ps_keycache_match(ps_keycache *kc, uint32_t owner, uint32_t table, const uint64_t *keys,
                       size_t n, uint64_t *req_id, uint64_t *sum);

/* Bytes of keys and hints held (memory accounting). */
uint64_t ps_keycache_bytes(ps_keycache *kc);

#endif
