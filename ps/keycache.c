#include "ps/keycache.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "embedding/embedding.h"
#include "ps/wire.h"

typedef struct entry {
    uint64_t req_id, sum;
    uint64_t *keys;  /* NULL: empty */
    uint64_t *hints; /* NULL: none kept */
    size_t n;
} entry;

static size_t entry_bytes(const entry *e)
{
    return e->n * sizeof *e->keys * (e->hints ? 2 : 1);
}

struct ps_keycache {
    uint32_t n_owners, n_tables;
    pthread_mutex_t mu;
    uint64_t bytes;
    entry *rings;   /* n_owners * n_tables * PS_KEYLIST_RING */
    uint32_t *next; /* per ring: the slot the next list replaces */
};

ps_keycache *ps_keycache_create(uint32_t n_owners, uint32_t n_tables)
{
    ps_keycache *kc = calloc(1, sizeof *kc);
    if (kc == NULL) return NULL;
    size_t rings = (size_t)n_owners * n_tables;
    kc->n_owners = n_owners;
    kc->n_tables = n_tables;
    /* Zeroed pages cost nothing until a ring is used, so a large cluster pays only for the
     * (worker, table) pairs that pull. */
    kc->rings = calloc(rings * PS_KEYLIST_RING, sizeof *kc->rings);
    kc->next = calloc(rings ? rings : 1, sizeof *kc->next);
    if ((rings && kc->rings == NULL) || kc->next == NULL) {
        free(kc->rings);
        free(kc->next);
        free(kc);
        return NULL;
    }
    pthread_mutex_init(&kc->mu, NULL);
    return kc;
}

void ps_keycache_destroy(ps_keycache *kc)
{
    if (kc == NULL) return;
    for (size_t i = 0; i < (size_t)kc->n_owners * kc->n_tables * PS_KEYLIST_RING; i++) {
        free(kc->rings[i].keys);
        free(kc->rings[i].hints);
    }
    free(kc->rings);
    free(kc->next);
    pthread_mutex_destroy(&kc->mu);
    free(kc);
}

/* The ring of (owner, table), or NULL when either is out of range; *index (optional) gets its
 * number. */
static entry *ring(ps_keycache *kc, uint32_t owner, uint32_t table, size_t *index)
{
    if (owner >= kc->n_owners || table >= kc->n_tables) return NULL;
    size_t i = (size_t)owner * kc->n_tables + table;
    if (index) *index = i;
    return kc->rings + i * PS_KEYLIST_RING;
}

void ps_keycache_put(ps_keycache *kc, uint32_t owner, uint32_t table, uint64_t req_id,
                     uint64_t *keys, uint64_t *hints, size_t n)
{
    size_t ri;
    entry *r = ring(kc, owner, table, &ri);
    if (r == NULL) {
        free(keys);
        free(hints);
        return;
    }
    uint64_t sum = ps_keys_sum(keys, n); /* outside the lock: it reads every key */
    pthread_mutex_lock(&kc->mu);
    uint32_t slot = kc->next[ri];
    bool resent = false;
    for (uint32_t i = 0; i < PS_KEYLIST_RING; i++)
        if (r[i].keys && r[i].req_id == req_id) {
            slot = i;
            resent = true;
        }
    entry old = r[slot];
    r[slot] = (entry){req_id, sum, keys, hints, n};
    kc->bytes += entry_bytes(&r[slot]);
    kc->bytes -= entry_bytes(&old);
    if (!resent) kc->next[ri] = (slot + 1) % PS_KEYLIST_RING;
    pthread_mutex_unlock(&kc->mu);
    free(old.keys);
    free(old.hints);
}

ps_keycache_result ps_keycache_get(ps_keycache *kc, uint32_t owner, uint32_t table, uint64_t req_id,
                                   size_t n, uint64_t sum, uint64_t *out, uint64_t *hints,
                                   size_t *have_n)
{
    entry *r = ring(kc, owner, table, NULL);
    ps_keycache_result res = PS_KC_UNKNOWN;
    *have_n = 0;
    if (r == NULL) return res;
    pthread_mutex_lock(&kc->mu);
    for (uint32_t i = 0; i < PS_KEYLIST_RING && res == PS_KC_UNKNOWN; i++) {
        if (r[i].keys == NULL || r[i].req_id != req_id) continue;
        *have_n = r[i].n;
        if (r[i].n != n)
            res = PS_KC_COUNT;
        else if (r[i].sum != sum)
            res = PS_KC_CHECKSUM;
        else {
            memcpy(out, r[i].keys, n * sizeof *out);
            if (hints && r[i].hints)
                memcpy(hints, r[i].hints, n * sizeof *hints);
            else if (hints)
                for (size_t j = 0; j < n; j++)
                    hints[j] = EMB_NO_HINT;
            res = PS_KC_FOUND;
        }
    }
    pthread_mutex_unlock(&kc->mu);
    return res;
}

bool ps_keycache_match(ps_keycache *kc, uint32_t owner, uint32_t table, const uint64_t *keys,
                       size_t n, uint64_t *req_id, uint64_t *sum)
{
    size_t ri;
    entry *r = ring(kc, owner, table, &ri);
    bool found = false;
    if (r == NULL) return false;
    pthread_mutex_lock(&kc->mu);
    /* Newest first: a worker that pulls the same keys again and again must name its latest
     * pull, the one the shard most likely still holds (after a failover, the only one). */
    for (uint32_t i = 1; i <= PS_KEYLIST_RING && !found; i++) {
        entry *e = &r[(kc->next[ri] + PS_KEYLIST_RING - i) % PS_KEYLIST_RING];
        if (e->keys && e->n == n && memcmp(e->keys, keys, n * sizeof *keys) == 0) {
            *req_id = e->req_id;
            *sum = e->sum;
            found = true;
        }
    }
    pthread_mutex_unlock(&kc->mu);
    return found;
}

uint64_t ps_keycache_bytes(ps_keycache *kc)
{
    pthread_mutex_lock(&kc->mu);
    uint64_t b = kc->bytes;
    pthread_mutex_unlock(&kc->mu);
    return b;
}
