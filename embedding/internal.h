/*
 * Private to embedding/: record layout, the in-memory hash table the table uses in place, the
 * row-store ops table, and the optimizer kernels.
 */
#ifndef EMBER_EMBEDDING_INTERNAL_H
#define EMBER_EMBEDDING_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "embedding/embedding.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

/* Record header; weights and state follow, then zero padding to a multiple of 8 bytes. */
typedef struct emb_rec_hdr {
    uint64_t key;
    uint64_t updates;
    uint64_t last_step;
} emb_rec_hdr;

#define EMB_REC_HDR sizeof(emb_rec_hdr)

static inline uint64_t emb_rec_key(const void *rec)
{
    uint64_t k;
    memcpy(&k, rec, 8);
    return k;
}
/* The table step the row was last touched at (records in a store need not be aligned). */
static inline uint64_t emb_rec_last_step(const void *rec)
{
    uint64_t s;
    memcpy(&s, (const char *)rec + offsetof(emb_rec_hdr, last_step), sizeof s);
    return s;
}
static inline float *emb_rec_weights(void *rec)
{
    return (float *)((char *)rec + EMB_REC_HDR);
}
/* A row into a record of rec_bytes (its header, dim weights, slots of optimizer state, the
 * padding zeroed): what a table stores and a snapshot holds. */
static inline void emb_rec_pack(uint8_t *rec, size_t rec_bytes, const emb_row *row, size_t dim,
                                size_t slots)
{
    const emb_rec_hdr hdr = {row->key, row->updates, row->last_step};
    const size_t wb = dim * sizeof(float), sb = slots * sizeof(float);
    memcpy(rec, &hdr, sizeof hdr);
    memcpy(rec + EMB_REC_HDR, row->weights, wb);
    memcpy(rec + EMB_REC_HDR + wb, row->state, sb);
    memset(rec + EMB_REC_HDR + wb + sb, 0, rec_bytes - EMB_REC_HDR - wb - sb);
}

/* The one hash of a key: its low half picks the sub-shard, its high half the slot, bits 8..13
 * the ctrl tag. Inlined: it runs once per key on the hot path. */
static inline uint64_t emb_key_hash(uint64_t key)
{
    return XXH3_64bits(&key, sizeof key);
}

/* ---- in-memory open-addressing table (store_mem.c) ----
 * ctrl[i]: 0 = empty; else EMB_CTRL_USED | tag (4 bits of the hash), plus flags the table
 * keeps per resident row: EMB_CTRL_REF, the CLOCK reference bit; EMB_CTRL_DISK, a copy of the
 * row exists in the spill store; EMB_CTRL_CLEAN, that copy equals the row in memory. Probing
 * reads the dense ctrl bytes and touches a record only on a tag match. Deletion shifts the
 * cluster back, so there are no tombstones. */
#define EMB_CTRL_USED 0x80u
#define EMB_CTRL_REF 0x40u
#define EMB_CTRL_DISK 0x20u
#define EMB_CTRL_CLEAN 0x10u
#define EMB_CTRL_TAG 0x0fu
/* Maximum load factor, as a fraction: 4/5. */
#define EMB_LOAD_NUM 4u
#define EMB_LOAD_DEN 5u
/* Sub-shards of a table whose config leaves n_sub 0. */
#define EMB_DEFAULT_SUBS 64u

typedef struct emb_mem {
    size_t rec;       /* record bytes */
    uint64_t cap;     /* slots */
    uint64_t count;   /* used slots */
    uint64_t max_cap; /* growth limit (budget), UINT64_MAX = none */
    uint8_t *ctrl; /* points into the recs allocation (one block: records, then ctrl) */
    uint8_t *recs;
    size_t mapped; /* the block's mapping length; 0: malloc'd */
    uint64_t hand; /* CLOCK hand */
    /* Rows promised to pushes between their two passes (table.c, push_memory): other inserts
     * count them as used, so the promised room is still free when the push comes to use it. */
    uint64_t reserved;
} emb_mem;

int emb_mem_init(emb_mem *m, size_t rec, uint64_t initial_cap, uint64_t max_cap, char **errptr);
void emb_mem_fini(emb_mem *m);
/* Slot holding key, or -1. */
int64_t emb_mem_find(const emb_mem *m, uint64_t key, uint64_t h);
/* Rows the table may hold before it must grow, or, at max_cap, evict; of a capacity cap. */
uint64_t emb_mem_limit(const emb_mem *m);
uint64_t emb_mem_limit_of(uint64_t cap);
/* True when one more row needs eviction first (at max_cap and at the load limit). */
bool emb_mem_full(const emb_mem *m);
/* Doubles the capacity (up to max_cap): CM_OK, or CM_ENOMEM (also at max_cap) with m unchanged. */
int emb_mem_grow(emb_mem *m);
/* Inserts a key known to be absent, growing if allowed (when count + reserved is at the load
 * limit); returns the slot (record zeroed except the key) or -1 on allocation failure. The caller
 * ensures !emb_mem_full(); one using a reserved row takes it out of `reserved` first. */
int64_t emb_mem_insert(emb_mem *m, uint64_t key, uint64_t h);
static inline uint8_t *emb_mem_rec(const emb_mem *m, int64_t slot)
{
    return m->recs + (size_t)slot * m->rec;
}
/* Hints the cache about slot: its ctrl byte and the first `bytes` of its record. */
static inline void emb_mem_prefetch_slot(const emb_mem *m, uint64_t slot, size_t bytes)
{
    const uint8_t *r = emb_mem_rec(m, (int64_t)slot);
    __builtin_prefetch(m->ctrl + slot);
    for (size_t off = 0; off < bytes; off += 64)
        __builtin_prefetch(r + off);
    __builtin_prefetch(r + bytes - 1);
}
/* The slot a hash starts probing at, and the ctrl byte a row of that hash carries. */
static inline uint64_t emb_mem_home(uint64_t h, uint64_t cap)
{
    return (uint64_t)(((unsigned __int128)h * cap) >> 64);
}
static inline uint8_t emb_mem_tag(uint64_t h)
{
    return (uint8_t)(EMB_CTRL_USED | ((h >> 8) & EMB_CTRL_TAG));
}
/* The two stages of a pipelined lookup, issued some keys ahead of it. Far ahead: the ctrl
 * byte of the key's home slot. Nearer: reads the ctrl bytes (in cache by then) to the first slot
 * whose tag matches, hints the first `bytes` of its record and returns the slot, the lookup's
 * candidate (EMB_NO_HINT when an empty slot or a line's worth of others came first). The home
 * record alone is not enough: at the load limit a key sits on average two slots past its
 * home, in another cache line. */
static inline void emb_mem_prefetch_ctrl(const emb_mem *m, uint64_t h)
{
    __builtin_prefetch(m->ctrl + emb_mem_home(h, m->cap));
}
#define EMB_PROBE_AHEAD_MAX 8
static inline uint64_t emb_mem_prefetch_probe(const emb_mem *m, uint64_t h, size_t bytes)
{
    uint64_t cap = m->cap, i = emb_mem_home(h, cap);
    uint8_t tag = emb_mem_tag(h);
    for (int probes = 0; probes < EMB_PROBE_AHEAD_MAX; probes++) {
        uint8_t c = m->ctrl[i];
        if (c == 0) break;
        if ((c & (EMB_CTRL_USED | EMB_CTRL_TAG)) == tag) {
            emb_mem_prefetch_slot(m, i, bytes);
            return i;
        }
        if (++i == cap) i = 0;
    }
    return EMB_NO_HINT;
}
/* The slot a hint names when it still holds key, else -1. Memory holds a key in at most one
 * slot, so a hint that passes is exactly what emb_mem_find would return: whatever moved rows
 * since the hint was taken (growth, eviction, TTL, a restore) at worst makes it fail here. */
static inline int64_t emb_mem_hinted(const emb_mem *m, uint64_t key, uint64_t hint)
{
    if (hint >= m->cap || !(m->ctrl[hint] & EMB_CTRL_USED) ||
        emb_rec_key(emb_mem_rec(m, (int64_t)hint)) != key)
        return -1;
    return (int64_t)hint;
}

/*
 * Pipelined lookups of a batch of keys: before lookup i, emb_la_ahead issues the prefetch
 * stages of the keys EMB_LA_FAR and EMB_LA_NEAR positions on (lookup 0 also those of the first
 * keys), and emb_la_find then looks key i up. The keys are keys[idx[i]] (idx may be NULL: keys[i])
 * with their hashes in h, likewise indexed; a key with a hint in range (hints may be NULL, else
 * indexed like keys; EMB_NO_HINT for none) has its hinted record prefetched at once and tried
 * first, one without its home ctrl byte far ahead and, nearer, the record its ctrl bytes lead
 * to, whose slot is kept as its candidate (the lookup does not probe again). A stale hint or
 * candidate (rows inserted or moved in between) costs a useless prefetch, never a wrong answer.
 * `bytes`: how much of each record the caller reads (a pull the header and weights, a push all).
 */
#define EMB_LA_FAR 16
#define EMB_LA_NEAR 8
#define EMB_LA_RING 16 /* a power of two above EMB_LA_NEAR */
typedef struct emb_lookahead {
    uint64_t cand[EMB_LA_RING]; /* by position modulo EMB_LA_RING */
} emb_lookahead;

static inline void emb_la_stage(const emb_mem *m, emb_lookahead *la, const uint64_t *h,
                                const uint64_t *hints, const uint32_t *idx, size_t j, size_t bytes,
                                bool far)
{
    size_t k = idx ? idx[j] : j;
    bool hinted = hints != NULL && hints[k] < m->cap;
    if (far && hinted)
        emb_mem_prefetch_slot(m, hints[k], bytes);
    else if (far)
        emb_mem_prefetch_ctrl(m, h[k]);
    else if (hints == NULL)
        la->cand[j % EMB_LA_RING] = emb_mem_prefetch_probe(m, h[k], bytes);
    else if (!hinted)
        emb_mem_prefetch_probe(m, h[k], bytes);
}

static inline void emb_la_ahead(const emb_mem *m, emb_lookahead *la, const uint64_t *h,
                                const uint64_t *hints, const uint32_t *idx, size_t n, size_t i,
                                size_t bytes)
{
    if (i == 0) {
        for (size_t j = 0; j < EMB_LA_FAR && j < n; j++)
            emb_la_stage(m, la, h, hints, idx, j, bytes, true);
        for (size_t j = 0; j < EMB_LA_NEAR && j < n; j++)
            emb_la_stage(m, la, h, hints, idx, j, bytes, false);
    }
    if (i + EMB_LA_FAR < n) emb_la_stage(m, la, h, hints, idx, i + EMB_LA_FAR, bytes, true);
    if (i + EMB_LA_NEAR < n) emb_la_stage(m, la, h, hints, idx, i + EMB_LA_NEAR, bytes, false);
}

/* Slot of lookup i, whose key is keys[k] (k = idx[i], or i), or -1 when absent. */
static inline int64_t emb_la_find(const emb_mem *m, const emb_lookahead *la, const uint64_t *keys,
                                  const uint64_t *h, const uint64_t *hints, size_t k, size_t i)
{
    uint64_t guess = hints ? hints[k] : la->cand[i % EMB_LA_RING];
    int64_t slot = guess != EMB_NO_HINT ? emb_mem_hinted(m, keys[k], guess) : -1;
    return slot >= 0 ? slot : emb_mem_find(m, keys[k], h[k]);
}

/* Removes the record at slot; later records of its cluster shift back one slot. */
void emb_mem_delete(emb_mem *m, int64_t slot);
/* Bytes allocated. */
static inline uint64_t emb_mem_bytes(const emb_mem *m)
{
    return m->cap * (m->rec + 1);
}

/* ---- row-store variants ---- */
struct emb_store_ops {
    const char *kind;
    int (*open)(const char *path, size_t rec, void **impl, char **errptr);
    void (*close)(void *impl);
    /* Closes, then removes what the store keeps outside the process; NULL where that is
     * nothing (memory), and emb_store_drop only closes. */
    int (*drop)(void *impl, char **errptr);
    int (*get)(void *impl, const uint64_t *keys, size_t n, void *recs, uint8_t *found,
               char **errptr);
    int (*put)(void *impl, const void *recs, size_t n, char **errptr);
    int (*del)(void *impl, const uint64_t *keys, size_t n, char **errptr);
    uint64_t (*count)(const void *impl);
    uint64_t (*mem_bytes)(const void *impl);
    int (*foreach)(void *impl, emb_record_cb cb, void *arg, char **errptr);
    /* Optional: the expiry mark (emb_store_set_dead_below) and a full rewrite of the files
     * (emb_store_compact). Without set_dead_below, store.c deletes the expired records at once
     * (foreach, then del); without compact there is nothing to rewrite. */
    void (*set_dead_below)(void *impl, uint64_t step);
    int (*compact)(void *impl, char **errptr);
};
extern const struct emb_store_ops emb_store_mem_ops;
extern const struct emb_store_ops emb_store_rocksdb_ops;

/* ---- optimizers (opt.c) ---- */
/* Initialises a new record for key: weights from the key and seed, optimizer state. */
void emb_opt_init_row(const emb_table_config *cfg, uint8_t *rec, uint64_t key);
/* Applies one step of the configured optimizer with gradient g (dim floats). */
void emb_opt_apply(const emb_table_config *cfg, uint8_t *rec, const float *g);

/* ---- table internals used by snapshot.c (table.c) ---- */
/* Locks every sub-shard in order / unlocks them. */
void emb_table_pause(emb_table *t);
void emb_table_resume(emb_table *t);
/* Rows held, memory and spill; the caller has paused the table. */
uint64_t emb_table_rows_locked(emb_table *t);
/* Every record, memory first, then spill; the caller has paused the table. */
int emb_table_foreach_record_locked(emb_table *t, emb_record_cb cb, void *arg, char **errptr);
/* Inserts whole records into a fresh table (restore); a key the table already holds, in memory
 * or spilled during the load, is corrupt (CM_ECORRUPT naming the key), and so is a record
 * stamped after the table's step where it has TTL and a spill store (the restore sets the step
 * first). The load is the table's only caller while it runs. */
int emb_table_load_records(emb_table *t, const uint8_t *recs, size_t n, char **errptr);
/* The admission sketch's counters and their count, or NULL without admission (read it paused:
 * pulls count under the sub-shard locks). */
const uint16_t *emb_table_sketch(const emb_table *t, size_t *n);
/* acc[i] += c[i] for n counters, saturating at UINT16_MAX (summing shards' sketches). */
void emb_sketch_add(uint16_t *acc, const uint16_t *c, size_t n);
/* CM_OK when n counters are a table's admission sketch (its size), else CM_EINVAL saying so. */
int emb_sketch_fits(size_t n, char **errptr);

/* ---- snapshot files (snapshot.c) ---- */
#define EMB_SNAP_ROWS "rows.bin"
#define EMB_SNAP_SKETCH "sketch.bin"
#define EMB_SNAP_MANIFEST "MANIFEST"

#endif
