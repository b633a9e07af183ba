/*
 * emb_table: sub-shards of in-memory rows, a spill store for cold rows, admission and TTL.
 * The design block in embedding.h explains the layout; this file is the mechanism.
 *
 * A batched call hashes its keys once and groups them by sub-shard with a counting sort. A pull
 * processes each group under that sub-shard's lock in three phases:
 *   1. (only when the sub-shard has spilled rows) find which keys are absent from memory and
 *      mark the present ones referenced, so the CLOCK spares them while this group evicts;
 *   2. read the absent keys from the spill store with one batched get;
 *   3. walk the keys in the caller's order: find, else fault in (spilled record, new row, or
 *      held back by admission), then copy out.
 * A push is all or nothing (push_memory, push_spill): everything that can fail is done for every
 * group before the first row changes.
 * A row read back from the spill store keeps its copy there (no delete, so no tombstone) and
 * is marked DISK|CLEAN; any change to the row clears CLEAN. Evicting a clean row writes
 * nothing. Memory is authoritative: a key resident in memory is never read from the spill
 * store, and whole-table walks skip spill records whose key is resident. rows_spilled counts
 * rows whose current copy exists only in the spill store.
 *
 * TTL with a spill store: expiry never reads the spill. Each sub-shard counts its spilled rows
 * by TTL bucket of their last_step (ttl_count), so emb_table_expire knows how many spilled
 * rows it drops; it then raises the sub-shard's dead_below, and from there on a spill record of
 * an older bucket is expired: every read of the store (spill_get, whole-table walks) takes it
 * for absent, and RocksDB's compactions remove it (emb_store_set_dead_below, the lowest mark). A
 * row's last_step only grows, so an older copy of a record whose newest copy is expired is
 * expired too. Expiry takes one sub-shard's lock at a time: the rest of the table serves calls.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "embedding/internal.h"

#define CMS_DEPTH 4
#define CMS_BITS 18

typedef struct sub {
    pthread_mutex_t mu;
    emb_mem mem;
    uint64_t spilled; /* this sub-shard's rows in the spill store */
    uint64_t pulls, pushes, created, admissions, admit_rejects, push_dropped;
    uint64_t spill_evictions, spill_loads, ttl_evictions;
    /* TTL with a spill store: `spilled` by bucket of last_step (ttl_count). ttl_cnt[b % ring]
     * counts bucket b for b in [ttl_lo, ttl_lo + ring); ttl_doomed counts the buckets below
     * ttl_lo, rows any expiry from now on drops. */
    uint64_t *ttl_cnt;
    uint64_t ttl_lo, ttl_doomed;
    uint64_t dead_below; /* bucket below which this sub-shard's spill records are expired */
    uint64_t ttl_gone;   /* rows stamped below dead_below that evict dropped, for expire to count */
} __attribute__((aligned(64))) sub;

struct emb_table {
    emb_table_config cfg;
    char *spill_path;
    size_t rec;
    uint32_t dim, n_sub;
    sub *subs;
    emb_store *spill;
    uint64_t step; /* atomic */
    uint16_t *cms; /* admission sketch, CMS_DEPTH x 2^CMS_BITS, atomic saturating counters */
    cm_team *team; /* borrowed (emb_table_set_team), or NULL */
    /* TTL: steps a bucket (ttl_bucket), buckets a sub-shard's ring holds, the counts (n_sub
     * rings, with a spill store only); expire_mu serializes emb_table_expire calls. */
    uint64_t ttl_g;
    uint32_t ttl_ring;
    uint64_t *ttl_cnt;
    pthread_mutex_t expire_mu;
    /* Held by a push to a spill store from the step it will take to that step's publication
     * (push_spill): the step is published only once the push cannot fail. */
    pthread_mutex_t step_mu;
};

/* Per-call scratch for the groups of one batched call; grown, never shrunk. */
typedef struct scratch {
    /* phase 1/2: absent keys, sorted and unique, with what the spill store held */
    uint64_t *miss;
    uint8_t *miss_found, *miss_used;
    uint8_t *miss_recs;
    size_t n_miss, cap_miss;
    /* eviction buffer, and the ctrl byte each dirty row had */
    uint8_t *ev, *ev_ctrl;
    size_t cap_ev, cap_ev_ctrl;
    /* rows still reserved for the group being pushed (push_memory), or NULL */
    uint64_t *resv;
} scratch;

static int grow_buf(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return CM_OK;
    size_t ncap = *cap ? *cap : 64;
    while (ncap < need)
        ncap *= 2;
    void *np = realloc(*p, ncap * elem);
    if (np == NULL) return CM_ENOMEM;
    *p = np;
    *cap = ncap;
    return CM_OK;
}

static void scratch_fini(scratch *sc)
{
    free(sc->miss);
    free(sc->miss_found);
    free(sc->miss_used);
    free(sc->miss_recs);
    free(sc->ev);
    free(sc->ev_ctrl);
}

static inline uint32_t sub_of(const emb_table *t, uint64_t h)
{
    return (uint32_t)(((h & 0xffffffffu) * t->n_sub) >> 32);
}

/* ---- admission sketch ---- */

static inline size_t cms_index(uint64_t h, int d)
{
    static const uint64_t mult[CMS_DEPTH] = {0x9E3779B97F4A7C15ull, 0xC2B2AE3D27D4EB4Full,
                                             0x165667B19E3779F9ull, 0xD6E8FEB86659FD93ull};
    return (size_t)d << CMS_BITS | (size_t)((h * mult[d]) >> (64 - CMS_BITS));
}

/* Counts one sighting and returns the new estimate (min over rows). */
static uint32_t cms_add(emb_table *t, uint64_t h)
{
    uint32_t est = UINT32_MAX;
    for (int d = 0; d < CMS_DEPTH; d++) {
        uint16_t *c = &t->cms[cms_index(h, d)];
        /* Saturating: a load then an add could let two threads both pass 65534 and wrap the
         * counter to 0, so the add is a compare-and-swap from what was seen. */
        uint16_t v = __atomic_load_n(c, __ATOMIC_RELAXED);
        while (v < UINT16_MAX && !__atomic_compare_exchange_n(c, &v, (uint16_t)(v + 1), true,
                                                              __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
        }
        if (v < UINT16_MAX) v++;
        if (v < est) est = v;
    }
    return est;
}

/* ---- spill traffic ---- */

/* ---- TTL buckets ----
 * A row expires at an emb_table_expire call at step E when ttl_bucket(last_step) <
 * ttl_cut(E): for ttl under 64 that is exactly E - last_step > ttl; beyond, steps are counted
 * in buckets of ttl / 64, and a row may stay up to a bucket longer. The buckets keep the
 * per-sub-shard counts of spilled rows to a ring of ttl / g + 3 entries: rows in buckets below
 * ttl_cut(now) expire at the next call whatever its step, and are counted together. */
static inline uint64_t ttl_bucket(const emb_table *t, uint64_t step)
{
    return step / t->ttl_g;
}

static uint64_t ttl_cut(const emb_table *t, uint64_t step)
{
    uint64_t ttl = t->cfg.ttl_steps;
    return step > ttl ? ttl_bucket(t, step - ttl) : 0;
}

/* Moves the ring's buckets below ttl_cut(step) into ttl_doomed; the caller holds s->mu. */
static void ttl_advance(const emb_table *t, sub *s, uint64_t step)
{
    uint64_t lo = ttl_cut(t, step);
    if (lo <= s->ttl_lo) return;
    uint64_t n = lo - s->ttl_lo < t->ttl_ring ? lo - s->ttl_lo : t->ttl_ring;
    for (uint64_t b = s->ttl_lo; b < s->ttl_lo + n; b++) {
        uint64_t *c = &s->ttl_cnt[b % t->ttl_ring];
        s->ttl_doomed += *c;
        *c = 0;
    }
    s->ttl_lo = lo;
}

/* A spilled row stamped last_step comes into the spill store (delta 1) or leaves it (-1);
 * the caller holds s->mu. A last_step is never past the table's step (emb_table_put_row
 * refuses one), so its bucket is inside the ring or below it. */
static void ttl_count(const emb_table *t, sub *s, uint64_t last_step, int delta)
{
    if (t->ttl_cnt == NULL) return;
    ttl_advance(t, s, __atomic_load_n(&t->step, __ATOMIC_RELAXED));
    uint64_t b = ttl_bucket(t, last_step);
    uint64_t *c = b < s->ttl_lo ? &s->ttl_doomed : &s->ttl_cnt[b % t->ttl_ring];
    *c += (uint64_t)(int64_t)delta;
}

/* Whether a record of sub-shard s is stamped below its mark: a spill record so stamped has
 * expired (see the design note above); the caller holds s->mu or every lock. */
static inline bool spill_dead(const emb_table *t, const sub *s, const void *rec)
{
    return s->dead_below > 0 && ttl_bucket(t, emb_rec_last_step(rec)) < s->dead_below;
}

/* emb_store_get on the spill store for keys of sub-shard s (its lock held), expired records
 * taken for absent. */
static int spill_get(emb_table *t, const sub *s, const uint64_t *keys, size_t n, uint8_t *recs,
                     uint8_t *found, char **errptr)
{
    int rc = emb_store_get(t->spill, keys, n, recs, found, errptr);
    for (size_t i = 0; rc == CM_OK && s->dead_below > 0 && i < n; i++)
        if (found[i] && spill_dead(t, s, recs + i * t->rec)) found[i] = 0;
    return rc;
}

/* Moves a batch of unreferenced rows from memory to the spill store (CLOCK sweep). */
static int evict(emb_table *t, sub *s, scratch *sc, char **errptr)
{
    emb_mem *m = &s->mem;
    uint64_t target = emb_mem_limit(m) / 32;
    if (target == 0) target = 1;
    if (grow_buf((void **)&sc->ev, &sc->cap_ev, target, t->rec) != CM_OK ||
        grow_buf((void **)&sc->ev_ctrl, &sc->cap_ev_ctrl, target, 1) != CM_OK)
        return cm_err(errptr, CM_ENOMEM, "out of memory for the eviction buffer");
    uint64_t n = 0, n_dirty = 0, n_gone = 0;
    for (uint64_t scanned = 0; n < target && m->count > 0 && scanned <= 2 * m->cap; scanned++) {
        if (m->hand >= m->cap) m->hand = 0;
        uint8_t c = m->ctrl[m->hand];
        if (c == 0) {
            m->hand++;
        } else if (c & EMB_CTRL_REF) {
            m->ctrl[m->hand] = (uint8_t)(c & ~EMB_CTRL_REF);
            m->hand++;
        } else if (spill_dead(t, s, emb_mem_rec(m, (int64_t)m->hand))) {
            /* Stamped below the mark (emb_table_put_row of an old row, or a pull whose step
             * fell more than ttl behind while it waited for the lock): expired already, and
             * once spilled it would read as absent yet count as spilled. It goes now, and the
             * next expire counts it; its spill copy, if any, is older and expired too. */
            emb_mem_delete(m, (int64_t)m->hand);
            s->ttl_gone++;
            n_gone++;
            n++;
        } else {
            /* A clean row's spill copy is current: it leaves memory without a write. The
             * cluster shifts back into this slot, so the hand stays to look at it. */
            if ((c & (EMB_CTRL_DISK | EMB_CTRL_CLEAN)) != (EMB_CTRL_DISK | EMB_CTRL_CLEAN)) {
                sc->ev_ctrl[n_dirty] = c;
                memcpy(sc->ev + n_dirty++ * t->rec, emb_mem_rec(m, (int64_t)m->hand), t->rec);
            }
            ttl_count(t, s, emb_rec_last_step(emb_mem_rec(m, (int64_t)m->hand)), 1);
            emb_mem_delete(m, (int64_t)m->hand);
            n++;
        }
    }
    int rc = emb_store_put(t->spill, sc->ev, n_dirty, errptr);
    if (rc != CM_OK) {
        /* Put the unwritten rows back rather than lose them; room exists since they left. A
         * row keeps its DISK flag: its stale spill copy must still go when the row expires. */
        for (uint64_t i = 0; i < n_dirty; i++) {
            uint8_t *r = sc->ev + i * t->rec;
            uint64_t k = emb_rec_key(r);
            ttl_count(t, s, emb_rec_last_step(r), -1);
            int64_t slot = emb_mem_insert(m, k, emb_key_hash(k));
            if (slot < 0) continue;
            memcpy(emb_mem_rec(m, slot), r, t->rec);
            m->ctrl[slot] |= sc->ev_ctrl[i] & EMB_CTRL_DISK;
        }
        s->spilled += n - n_gone - n_dirty;
        s->spill_evictions += n - n_gone - n_dirty;
        return rc;
    }
    s->spilled += n - n_gone;
    s->spill_evictions += n - n_gone;
    return CM_OK;
}

/* Inserts an absent key into memory, evicting first when the sub-shard is at its budget. */
static int insert_room(emb_table *t, sub *s, scratch *sc, uint64_t key, uint64_t h, int64_t *slot,
                       char **errptr)
{
    if (sc->resv != NULL && *sc->resv > 0) {
        (*sc->resv)--;
        s->mem.reserved--;
    }
    if (emb_mem_full(&s->mem)) {
        int rc = evict(t, s, sc, errptr);
        if (rc != CM_OK) return rc;
    }
    *slot = emb_mem_insert(&s->mem, key, h);
    if (*slot < 0)
        return cm_err(errptr, CM_ENOMEM,
                      "out of memory growing an embedding sub-shard to %llu rows",
                      (unsigned long long)s->mem.count);
    return CM_OK;
}

/* Sorts n keys and drops repeats; returns how many distinct keys remain at the front. */
static size_t sort_unique(uint64_t *k, size_t n)
{
    if (n == 0) return 0;
    qsort(k, n, sizeof *k, cm_u64_cmp);
    size_t u = 1;
    for (size_t i = 1; i < n; i++)
        if (k[u - 1] != k[i]) k[u++] = k[i];
    return u;
}

/* Phases 1 and 2: which keys of the group are absent, and what the spill store holds of them. */
static int prefetch_spilled(emb_table *t, sub *s, scratch *sc, const uint64_t *keys,
                            const uint64_t *h, const uint64_t *hints, const uint32_t *idx, size_t m,
                            size_t want, char **errptr)
{
    emb_lookahead la;
    sc->n_miss = 0;
    for (size_t i = 0; i < m; i++) {
        emb_la_ahead(&s->mem, &la, h, hints, idx, m, i, want);
        uint32_t k = idx[i];
        int64_t slot = emb_la_find(&s->mem, &la, keys, h, hints, k, i);
        if (slot >= 0) {
            s->mem.ctrl[slot] |= EMB_CTRL_REF;
            continue;
        }
        if (grow_buf((void **)&sc->miss, &sc->cap_miss, sc->n_miss + 1, sizeof(uint64_t)) != CM_OK)
            return cm_err(errptr, CM_ENOMEM, "out of memory");
        sc->miss[sc->n_miss++] = keys[k];
    }
    if (sc->n_miss == 0) return CM_OK;
    size_t u = sc->n_miss = sort_unique(sc->miss, sc->n_miss);
    free(sc->miss_found);
    free(sc->miss_used);
    free(sc->miss_recs);
    sc->miss_found = malloc(u);
    sc->miss_used = calloc(u, 1);
    sc->miss_recs = malloc(u * t->rec);
    if (!sc->miss_found || !sc->miss_used || !sc->miss_recs)
        return cm_err(errptr, CM_ENOMEM, "out of memory");
    return spill_get(t, s, sc->miss, u, sc->miss_recs, sc->miss_found, errptr);
}

enum { OP_PULL, OP_PUSH };

/* Marks a row touched at step; true when last_step moved. Only forward: a call's step can be
 * older than one a concurrent call already wrote (a pull reads the step before it locks its
 * groups; an in-memory push takes its step under its first group's lock, and another push with a
 * later step can reach a shared group first). Set back, last_step would let expiry drop a row up
 * to that many steps before its TTL from the push that really touched it last. */
static inline bool touch(emb_rec_hdr *hdr, uint64_t step)
{
    if (hdr->last_step >= step) return false;
    hdr->last_step = step;
    return true;
}

/* Brings an absent key into memory: from the spill store, as a new row, or not at all (held
 * back by admission: *slot = -1). */
static int fault_in(emb_table *t, sub *s, scratch *sc, uint64_t key, uint64_t h, int op,
                    int64_t *slot, char **errptr)
{
    int rc = CM_OK;
    *slot = -1;
    if (t->spill != NULL && s->spilled > 0) {
        const uint8_t *src = NULL;
        uint64_t *hit =
            sc->n_miss ? bsearch(&key, sc->miss, sc->n_miss, sizeof key, cm_u64_cmp) : NULL;
        size_t u = hit ? (size_t)(hit - sc->miss) : 0;
        uint8_t one_found = 0;
        if (hit != NULL && !sc->miss_used[u]) {
            sc->miss_used[u] = 1;
            if (sc->miss_found[u]) src = sc->miss_recs + u * t->rec;
        } else {
            /* Not looked up in phase 2, or evicted again since: ask the store now. */
            if (grow_buf((void **)&sc->ev, &sc->cap_ev, 1, t->rec) != CM_OK)
                return cm_err(errptr, CM_ENOMEM, "out of memory");
            rc = spill_get(t, s, &key, 1, sc->ev, &one_found, errptr);
            if (rc != CM_OK) return rc;
            if (one_found) src = sc->ev;
        }
        if (src != NULL) {
            uint8_t row[t->rec];
            memcpy(row, src, t->rec); /* the eviction inside insert_room may reuse src's buffer */
            rc = insert_room(t, s, sc, key, h, slot, errptr);
            if (rc != CM_OK) return rc;
            memcpy(emb_mem_rec(&s->mem, *slot), row, t->rec);
            s->mem.ctrl[*slot] |= EMB_CTRL_DISK | EMB_CTRL_CLEAN;
            s->spilled--;
            ttl_count(t, s, emb_rec_last_step(row), -1);
            s->spill_loads++;
            return CM_OK;
        }
    }
    if (t->cms != NULL) {
        if (op == OP_PUSH) {
            s->push_dropped++;
            return CM_OK;
        }
        if (cms_add(t, h) < t->cfg.admit_threshold) {
            s->admit_rejects++;
            return CM_OK;
        }
        s->admissions++;
    }
    rc = insert_room(t, s, sc, key, h, slot, errptr);
    if (rc != CM_OK) return rc;
    emb_opt_init_row(&t->cfg, emb_mem_rec(&s->mem, *slot), key);
    s->created++;
    return CM_OK;
}

/* Phase 3 for one sub-shard's group; the caller holds s->mu. A push may come with hints (see
 * emb_table_push_hinted); a pull with hints_out records where each of its keys ended up. */
static int process_group(emb_table *t, sub *s, scratch *sc, const uint64_t *keys, const uint64_t *h,
                         const uint32_t *idx, size_t m, int op, float *out, const float *grads,
                         const uint64_t *hints, uint64_t *hints_out, uint64_t step, char **errptr)
{
    int rc = CM_OK;
    const size_t dim = t->dim;
    const size_t want = op == OP_PULL ? EMB_REC_HDR + dim * sizeof(float) : t->rec;
    sc->n_miss = 0;
    if (t->spill != NULL && s->spilled > 0) {
        rc = prefetch_spilled(t, s, sc, keys, h, hints, idx, m, want, errptr);
        if (rc != CM_OK) return rc;
    }
    emb_lookahead la;
    for (size_t i = 0; i < m; i++) {
        emb_la_ahead(&s->mem, &la, h, hints, idx, m, i, want);
        uint32_t k = idx[i];
        int64_t slot = emb_la_find(&s->mem, &la, keys, h, hints, k, i);
        if (slot < 0) {
            rc = fault_in(t, s, sc, keys[k], h[k], op, &slot, errptr);
            if (rc != CM_OK) break;
        }
        if (hints_out) hints_out[k] = slot >= 0 ? (uint64_t)slot : EMB_NO_HINT;
        if (slot < 0) {
            if (op == OP_PULL) memset(out + k * dim, 0, dim * sizeof(float));
            continue;
        }
        uint8_t *rec = emb_mem_rec(&s->mem, slot);
        emb_rec_hdr *hdr = (emb_rec_hdr *)rec;
        uint8_t ctrl = s->mem.ctrl[slot] | EMB_CTRL_REF;
        if (op == OP_PULL) {
            if (dim == 16) /* the common dim: a copy of fixed size, inlined */
                memcpy(out + k * 16, emb_rec_weights(rec), 16 * sizeof(float));
            else
                memcpy(out + k * dim, emb_rec_weights(rec), dim * sizeof(float));
        } else {
            emb_opt_apply(&t->cfg, rec, grads + k * dim);
            ctrl &= (uint8_t)~EMB_CTRL_CLEAN;
        }
        if (touch(hdr, step)) ctrl &= (uint8_t)~EMB_CTRL_CLEAN;
        s->mem.ctrl[slot] = ctrl;
    }
    if (op == OP_PULL)
        s->pulls += m;
    else
        s->pushes += m;
    return rc;
}

/* Batches of at least this many keys fan out over the table's team (emb_table_set_team):
 * below it, waking the team costs more than the groups' work. */
#define FAN_MIN_KEYS 2048u
/* Parts a team thread gets, so that uneven groups even out. */
#define FAN_PARTS_PER_THREAD 4u

/* Parts for a batch of n keys: 1 (the caller alone) without a team or below FAN_MIN_KEYS. */
static uint32_t fan_parts(const emb_table *t, size_t n)
{
    uint32_t threads = cm_team_size(t->team);
    if (threads < 2 || n < FAN_MIN_KEYS) return 1;
    uint32_t p = threads * FAN_PARTS_PER_THREAD;
    return p < t->n_sub ? p : t->n_sub;
}

/* Grouping a batch, cut into parts of consecutive keys for the team: each part hashes its keys
 * and counts them by sub-shard; once every part has counted, each places its keys after the
 * earlier parts' keys of the same sub-shard, so every group lists its keys in the caller's
 * order, whatever the parts. */
typedef struct grouping {
    const emb_table *t;
    const uint64_t *keys;
    size_t n;
    uint32_t parts;
    bool place;       /* second pass */
    uint64_t *h;      /* by key */
    uint32_t *sub_id; /* by key */
    uint32_t *ord;
    uint32_t *at; /* parts x n_sub: the part's count of each sub-shard, then its next slot */
} grouping;

static void group_part(void *arg, uint32_t p)
{
    grouping *g = arg;
    const size_t i1 = (size_t)((p + 1) * (uint64_t)g->n / g->parts);
    uint32_t *at = g->at + (size_t)p * g->t->n_sub;
    for (size_t i = (size_t)(p * (uint64_t)g->n / g->parts); i < i1; i++) {
        if (g->place) {
            g->ord[at[g->sub_id[i]]++] = (uint32_t)i;
            continue;
        }
        g->h[i] = emb_key_hash(g->keys[i]);
        g->sub_id[i] = sub_of(g->t, g->h[i]);
        at[g->sub_id[i]]++;
    }
}

/* Hashes the keys and groups their indices by sub-shard (on the team for a large batch);
 * *hash, *order and *starts are the caller's (free()). */
static int group_keys(const emb_table *t, const uint64_t *keys, size_t n, uint64_t **hash,
                      uint32_t **order, uint32_t **starts, char **errptr)
{
    grouping g = {.t = t, .keys = keys, .n = n, .parts = fan_parts(t, n)};
    g.h = malloc(n * sizeof *g.h + 1);
    g.sub_id = malloc(n * sizeof *g.sub_id + 1);
    g.ord = malloc(n * sizeof *g.ord + 1);
    g.at = calloc((size_t)g.parts * t->n_sub, sizeof *g.at);
    uint32_t *st = calloc(t->n_sub + 1, sizeof *st);
    if (!g.h || !g.sub_id || !g.ord || !g.at || !st) {
        free(g.h);
        free(g.sub_id);
        free(g.ord);
        free(g.at);
        free(st);
        return cm_err(errptr, CM_ENOMEM, "out of memory for a batch of %zu keys", n);
    }
    cm_team_run(g.parts > 1 ? t->team : NULL, g.parts, group_part, &g);
    uint32_t next = 0;
    for (uint32_t b = 0; b < t->n_sub; b++) {
        for (uint32_t p = 0; p < g.parts; p++) {
            uint32_t *at = &g.at[(size_t)p * t->n_sub + b], c = *at;
            *at = next;
            next += c;
        }
        st[b + 1] = next;
    }
    g.place = true;
    cm_team_run(g.parts > 1 ? t->team : NULL, g.parts, group_part, &g);
    free(g.sub_id);
    free(g.at);
    *hash = g.h;
    *order = g.ord;
    *starts = st;
    return CM_OK;
}

/* ---- pushes: all or nothing ---- */

/* The message of a push that failed having changed nothing: which table, and what failed (why,
 * which is freed). */
static int push_failed(const emb_table *t, size_t n, int rc, char *why, char **errptr)
{
    const char *what = why != NULL ? why : "unknown error";
    if (t->spill_path != NULL)
        cm_err(errptr, rc,
               "push of %zu keys to the table spilling to %s not applied (no row changed): %s", n,
               t->spill_path, what);
    else
        cm_err(errptr, rc,
               "push of %zu keys to an in-memory table not applied (no row changed): %s", n, what);
    free(why);
    return rc;
}

/* Reserves room in a sub-shard without a spill store for the rows a push's group may create: as
 * many as it has keys when they fit without a doubling (the usual case, a mere count), else its
 * distinct absent keys, doubling until they fit, so that the table grows when it must and not
 * earlier. The caller holds s->mu. */
static int reserve_rows(sub *s, scratch *sc, const uint64_t *keys, const uint64_t *h,
                        const uint32_t *idx, size_t m, uint64_t *got, char **errptr)
{
    emb_mem *mem = &s->mem;
    uint64_t need = m;
    if (mem->count + mem->reserved + need > emb_mem_limit(mem)) {
        sc->n_miss = 0;
        for (size_t i = 0; i < m; i++) {
            uint32_t k = idx[i];
            if (emb_mem_find(mem, keys[k], h[k]) >= 0) continue;
            if (grow_buf((void **)&sc->miss, &sc->cap_miss, sc->n_miss + 1, sizeof(uint64_t)) !=
                CM_OK)
                return cm_err(errptr, CM_ENOMEM, "out of memory");
            sc->miss[sc->n_miss++] = keys[k];
        }
        need = sort_unique(sc->miss, sc->n_miss);
        sc->n_miss = 0;
        while (mem->count + mem->reserved + need > emb_mem_limit(mem))
            if (emb_mem_grow(mem) != CM_OK)
                return cm_err(errptr, CM_ENOMEM,
                              "out of memory growing an embedding sub-shard of %llu rows for %llu "
                              "new ones",
                              (unsigned long long)mem->count, (unsigned long long)need);
    }
    mem->reserved += need;
    *got = need;
    return CM_OK;
}

/* ---- fanning a batch out over the team ---- */

enum { FAN_PROCESS, FAN_RESERVE };

/* One batched call's groups, cut into parts of consecutive sub-shards. A part runs its groups
 * in sub-shard order with its own scratch, each group under its lock unless the caller holds
 * them all (`locked`: a fanned push); its first failure ends the part. A group's work is the
 * same whichever part, thread or order runs it, so a fanned call gives the same rows, the same
 * output and the same stats as the same call run in one part. */
typedef struct fan {
    emb_table *t;
    const uint64_t *keys, *h, *hints;
    const uint32_t *ord, *st;
    int op, phase;
    bool locked;
    float *out;
    const float *grads;
    uint64_t *hints_out, *resv; /* resv: a push's rows reserved by group */
    uint64_t step;
    uint32_t parts;
    int *rc;    /* by part */
    char **why; /* by part: the message of its failure (fan_run frees all but the first) */
    int rc1;    /* (rc and why of a call in one part) */
    char *why1;
} fan;

static void fan_part(void *arg, uint32_t i)
{
    fan *f = arg;
    emb_table *t = f->t;
    scratch sc = {0};
    int rc = CM_OK;
    char *why = NULL;
    const uint32_t b1 = (uint32_t)((uint64_t)(i + 1) * t->n_sub / f->parts);
    for (uint32_t b = (uint32_t)((uint64_t)i * t->n_sub / f->parts); b < b1 && rc == CM_OK; b++) {
        const uint32_t *idx = f->ord + f->st[b];
        const size_t m = f->st[b + 1] - f->st[b];
        if (m == 0) continue;
        sub *s = &t->subs[b];
        if (!f->locked) pthread_mutex_lock(&s->mu);
        if (f->phase == FAN_RESERVE) {
            rc = reserve_rows(s, &sc, f->keys, f->h, idx, m, &f->resv[b], &why);
        } else {
            sc.resv = f->resv != NULL ? &f->resv[b] : NULL;
            rc = process_group(t, s, &sc, f->keys, f->h, idx, m, f->op, f->out, f->grads, f->hints,
                               f->hints_out, f->step, &why);
            if (f->resv != NULL) s->mem.reserved -= f->resv[b];
        }
        if (!f->locked) pthread_mutex_unlock(&s->mu);
    }
    scratch_fini(&sc);
    f->rc[i] = rc;
    f->why[i] = why;
}

/* Sets f up for a call's groups in `parts` parts (its other fields are the caller's to set). */
static int fan_init(fan *f, emb_table *t, const uint64_t *keys, const uint64_t *h,
                    const uint32_t *ord, const uint32_t *st, uint32_t parts)
{
    *f = (fan){.t = t, .keys = keys, .h = h, .ord = ord, .st = st, .parts = parts};
    f->rc = parts > 1 ? malloc(parts * sizeof *f->rc) : &f->rc1;
    f->why = parts > 1 ? malloc(parts * sizeof *f->why) : &f->why1;
    if (f->rc != NULL && f->why != NULL) return CM_OK;
    if (f->rc != &f->rc1) {
        free(f->rc);
        free(f->why);
    }
    return CM_ENOMEM;
}

static void fan_fini(fan *f)
{
    if (f->rc == &f->rc1) return;
    free(f->rc);
    free(f->why);
}

/* Runs every part of f (phase set) and returns the first failing part's code, its message in
 * *why (the caller's) and the others' freed. */
static int fan_run(fan *f, char **why)
{
    for (uint32_t i = 0; i < f->parts; i++) {
        f->rc[i] = CM_OK;
        f->why[i] = NULL;
    }
    cm_team_run(f->parts > 1 ? f->t->team : NULL, f->parts, fan_part, f);
    int rc = CM_OK;
    for (uint32_t i = 0; i < f->parts; i++) {
        if (rc == CM_OK && f->rc[i] != CM_OK) {
            rc = f->rc[i];
            *why = f->why[i];
        } else {
            free(f->why[i]);
        }
    }
    return rc;
}

/*
 * A push to a table without a spill store. The one thing that can fail there is growing a
 * sub-shard for the rows the push creates, so a first pass reserves that room in every group
 * before the update pass, which then never has to grow and cannot fail: a push that fails has
 * changed nothing. The reservation pass locks one group at a time, as a pull does, so that
 * concurrent pushes overlap as before (holding every lock to the end would serialise them); the
 * reservation keeps other inserts out of the promised room in between. A row TTL expiry drops in
 * between frees the slot the update pass then re-creates it in (emb_table_expire).
 * The update pass takes the step under its first group's lock and locks each next group before
 * it releases the one before (in sub-shard order, as pause_all): a snapshot, which pauses the
 * table in that order, then sees the push whole or not at all. Released one at a time, a snapshot
 * could take the locks between the step and the first group, or between two groups, and record a
 * step whose push it lacks, or half a push.
 */
static int push_memory(emb_table *t, size_t n, const uint64_t *keys, const float *grads,
                       const uint64_t *hints, const uint64_t *h, const uint32_t *ord,
                       const uint32_t *st, char **errptr)
{
    scratch sc = {0};
    char *why = NULL;
    uint64_t *resv = calloc(t->n_sub, sizeof *resv);
    int rc = resv != NULL ? CM_OK : cm_err(&why, CM_ENOMEM, "out of memory");
    /* Backwards: a reservation would otherwise wait at each group for another push's update
     * pass, which holds it far longer, and trail it; going the other way the two cross once.
     * With admission a push creates no row (a key not yet admitted is dropped). */
    uint32_t b = t->n_sub;
    while (rc == CM_OK && t->cms == NULL && b-- > 0) {
        if (st[b] == st[b + 1]) continue;
        sub *s = &t->subs[b];
        pthread_mutex_lock(&s->mu);
        rc = reserve_rows(s, &sc, keys, h, ord + st[b], st[b + 1] - st[b], &resv[b], &why);
        pthread_mutex_unlock(&s->mu);
    }
    if (rc != CM_OK) {
        for (uint32_t j = b + 1; resv != NULL && j < t->n_sub; j++) {
            if (resv[j] == 0) continue;
            pthread_mutex_lock(&t->subs[j].mu);
            t->subs[j].mem.reserved -= resv[j];
            pthread_mutex_unlock(&t->subs[j].mu);
        }
        free(resv);
        scratch_fini(&sc);
        return push_failed(t, n, rc, why, errptr);
    }
    uint64_t step = 0;
    sub *held = NULL;
    for (b = 0; b < t->n_sub; b++) {
        if (st[b] == st[b + 1]) continue;
        sub *s = &t->subs[b];
        pthread_mutex_lock(&s->mu);
        if (held != NULL)
            pthread_mutex_unlock(&held->mu);
        else
            step = __atomic_add_fetch(&t->step, 1, __ATOMIC_RELAXED);
        held = s;
        sc.resv = &resv[b];
        int r = process_group(t, s, &sc, keys, h, ord + st[b], st[b + 1] - st[b], OP_PUSH, NULL,
                              grads, hints, NULL, step, &why);
        s->mem.reserved -= resv[b];
        if (rc == CM_OK) rc = r; /* unreachable: the rows it inserts have their room */
    }
    if (held != NULL) pthread_mutex_unlock(&held->mu);
    free(resv);
    scratch_fini(&sc);
    if (rc != CM_OK) cm_err(errptr, rc, "%s", why != NULL ? why : "push failed");
    free(why);
    return rc;
}

/*
 * push_memory fanned out over the team (a large batch). The caller takes every touched group's
 * lock in sub-shard order (as pause_all) and holds them all to the end, so the team's parts
 * work on the groups without locking and a snapshot sees the push whole or not at all; then
 * the parts reserve the rows each group may create, and, once every group has its room, the
 * step is taken and the parts apply the push, which cannot fail. Holding every lock means a
 * fanned push does not overlap other calls on this table; it is over sooner instead.
 */
static int push_fanned(emb_table *t, size_t n, const uint64_t *keys, const float *grads,
                       const uint64_t *hints, const uint64_t *h, const uint32_t *ord,
                       const uint32_t *st, uint32_t parts, char **errptr)
{
    char *why = NULL;
    fan f;
    uint64_t *resv = calloc(t->n_sub, sizeof *resv);
    if (resv == NULL || fan_init(&f, t, keys, h, ord, st, parts) != CM_OK) {
        free(resv);
        int rc = cm_err(&why, CM_ENOMEM, "out of memory");
        return push_failed(t, n, rc, why, errptr);
    }
    f.hints = hints;
    f.op = OP_PUSH;
    f.locked = true;
    f.grads = grads;
    f.resv = resv;
    for (uint32_t b = 0; b < t->n_sub; b++)
        if (st[b] != st[b + 1]) pthread_mutex_lock(&t->subs[b].mu);
    /* With admission a push creates no row (a key not yet admitted is dropped). */
    f.phase = FAN_RESERVE;
    int rc = t->cms == NULL ? fan_run(&f, &why) : CM_OK;
    if (rc == CM_OK) {
        f.step = __atomic_add_fetch(&t->step, 1, __ATOMIC_RELAXED);
        f.phase = FAN_PROCESS;
        rc = fan_run(&f, &why); /* unreachable failure: the rows it inserts have their room */
    } else {
        for (uint32_t b = 0; b < t->n_sub; b++)
            t->subs[b].mem.reserved -= f.resv[b];
    }
    for (uint32_t b = 0; b < t->n_sub; b++)
        if (st[b] != st[b + 1]) pthread_mutex_unlock(&t->subs[b].mu);
    free(resv);
    fan_fini(&f);
    if (rc != CM_OK) return push_failed(t, n, rc, why, errptr);
    return CM_OK;
}

enum { FATE_DROP, FATE_MEM, FATE_STAGE };

/* State of one push_spill: where each key's row is, and the rows absent from memory. */
typedef struct spush {
    int64_t *where; /* by key index: its slot, or -1 - j for absent row j */
    size_t *first;  /* by group: its first absent row (n_sub + 1 entries) */
    uint64_t *akey; /* absent rows' keys, sorted and distinct within each group */
    uint8_t *found; /* read back from the spill store (else new) */
    uint8_t *fate;  /* FATE_DROP (not admitted), FATE_MEM or FATE_STAGE (updated on disk) */
    int64_t *slot;  /* FATE_MEM: its slot once inserted, else -1 */
    uint8_t *recs;  /* its record: as read back, or new */
    uint8_t *stage; /* the FATE_STAGE records, updated, for one write */
    size_t n_abs, cap_akey, cap_abs;
} spush;

static void spush_fini(spush *p)
{
    free(p->where);
    free(p->first);
    free(p->akey);
    free(p->found);
    free(p->fate);
    free(p->slot);
    free(p->recs);
    free(p->stage);
}

/* Room for n absent rows in every array but akey. */
static int spush_grow(spush *p, size_t n, size_t rec)
{
    if (n <= p->cap_abs) return CM_OK;
    size_t cap = p->cap_abs ? p->cap_abs : 64;
    while (cap < n)
        cap *= 2;
    uint8_t *found = realloc(p->found, cap);
    if (found != NULL) p->found = found;
    uint8_t *fate = realloc(p->fate, cap);
    if (fate != NULL) p->fate = fate;
    int64_t *slot = realloc(p->slot, cap * sizeof *slot);
    if (slot != NULL) p->slot = slot;
    uint8_t *recs = realloc(p->recs, cap * rec);
    if (recs != NULL) p->recs = recs;
    if (!found || !fate || !slot || !recs) return CM_ENOMEM;
    p->cap_abs = cap;
    return CM_OK;
}

/* First pass of push_spill over one group, its lock held: where each key's row is, the absent
 * rows read back from the spill store (or made new), and where each of those will live. */
static int prepare_group(emb_table *t, sub *s, spush *p, const uint64_t *keys, const uint64_t *h,
                         const uint64_t *hints, const uint32_t *idx, size_t m, char **errptr)
{
    emb_mem *mem = &s->mem;
    const size_t first = p->n_abs;
    emb_lookahead la;
    for (size_t i = 0; i < m; i++) {
        emb_la_ahead(mem, &la, h, hints, idx, m, i, EMB_REC_HDR);
        uint32_t k = idx[i];
        int64_t slot = emb_la_find(mem, &la, keys, h, hints, k, i);
        p->where[k] = slot;
        if (slot >= 0) continue;
        if (grow_buf((void **)&p->akey, &p->cap_akey, p->n_abs + 1, sizeof(uint64_t)) != CM_OK)
            return cm_err(errptr, CM_ENOMEM, "out of memory");
        p->akey[p->n_abs++] = keys[k];
    }
    if (p->n_abs == first) return CM_OK;
    const size_t u = sort_unique(p->akey + first, p->n_abs - first);
    p->n_abs = first + u;
    if (spush_grow(p, p->n_abs, t->rec) != CM_OK) return cm_err(errptr, CM_ENOMEM, "out of memory");
    for (size_t i = 0; i < m; i++) {
        uint32_t k = idx[i];
        if (p->where[k] >= 0) continue;
        const uint64_t *a = bsearch(&keys[k], p->akey + first, u, sizeof(uint64_t), cm_u64_cmp);
        p->where[k] = -1 - (int64_t)(a - p->akey);
    }
    memset(p->found + first, 0, u);
    if (s->spilled > 0) {
        int rc =
            spill_get(t, s, p->akey + first, u, p->recs + first * t->rec, p->found + first, errptr);
        if (rc != CM_OK) return rc;
    }
    /* Rows the push reads back or creates go into memory while the sub-shard has room under its
     * budget (grown now, while a failure still changes nothing); the rest are updated where they
     * lie. Making room instead would write evicted rows before the push is sure to succeed. */
    uint64_t homes = 0;
    for (size_t j = first; j < p->n_abs; j++)
        homes += p->found[j] || t->cms == NULL;
    bool grew = false;
    while (mem->count + mem->reserved + homes > emb_mem_limit(mem) && mem->cap < mem->max_cap) {
        if (emb_mem_grow(mem) != CM_OK)
            return cm_err(errptr, CM_ENOMEM,
                          "out of memory growing an embedding sub-shard of %llu rows",
                          (unsigned long long)mem->count);
        grew = true;
    }
    for (size_t i = 0; grew && i < m; i++) { /* the rows found above have moved */
        uint32_t k = idx[i];
        if (p->where[k] >= 0) p->where[k] = emb_mem_find(mem, keys[k], h[k]);
    }
    uint64_t used = mem->count + mem->reserved, limit = emb_mem_limit(mem);
    uint64_t room = limit > used ? limit - used : 0;
    for (size_t j = first; j < p->n_abs; j++) {
        p->slot[j] = -1;
        if (!p->found[j] && t->cms != NULL) {
            p->fate[j] = FATE_DROP;
            continue;
        }
        if (!p->found[j]) {
            uint8_t *rec = p->recs + j * t->rec;
            memset(rec, 0, t->rec);
            memcpy(rec, &p->akey[j], sizeof(uint64_t));
            emb_opt_init_row(&t->cfg, rec, p->akey[j]);
        }
        p->fate[j] = room > 0 ? FATE_MEM : FATE_STAGE;
        if (room > 0) room--;
    }
    return CM_OK;
}

/* The rows updated where they lie: their gradients applied in the caller's order (ord lists each
 * key's occurrences in it), then all written in one batch, which RocksDB applies whole or not
 * at all. This is the push's only write. */
static int stage_commit(emb_table *t, spush *p, const uint32_t *ord, size_t n, const float *grads,
                        uint64_t step, char **errptr)
{
    size_t n_stage = 0;
    for (size_t j = 0; j < p->n_abs; j++)
        n_stage += p->fate[j] == FATE_STAGE;
    if (n_stage == 0) return CM_OK;
    /* The staged rows' stamps before the push, for their TTL counts once it is written. */
    uint64_t *was = t->ttl_cnt != NULL ? malloc(n_stage * sizeof *was) : NULL;
    if (t->ttl_cnt != NULL && was == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    for (size_t j = 0, at = 0; was != NULL && j < p->n_abs; j++)
        if (p->fate[j] == FATE_STAGE) was[at++] = emb_rec_last_step(p->recs + j * t->rec);
    for (size_t i = 0; i < n; i++) {
        uint32_t k = ord[i];
        if (p->where[k] >= 0) continue;
        size_t j = (size_t)(-1 - p->where[k]);
        if (p->fate[j] != FATE_STAGE) continue;
        uint8_t *rec = p->recs + j * t->rec;
        emb_opt_apply(&t->cfg, rec, grads + (size_t)k * t->dim);
        touch((emb_rec_hdr *)rec, step);
    }
    p->stage = malloc(n_stage * t->rec);
    if (p->stage == NULL) {
        free(was);
        return cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    size_t at = 0;
    for (size_t j = 0; j < p->n_abs; j++)
        if (p->fate[j] == FATE_STAGE)
            memcpy(p->stage + at++ * t->rec, p->recs + j * t->rec, t->rec);
    int rc = emb_store_put(t->spill, p->stage, n_stage, errptr);
    /* Every group is locked (push_spill): a row read back moves from its old bucket to its
     * new one, a created one comes in. */
    for (size_t j = 0, k = 0; rc == CM_OK && was != NULL && j < p->n_abs; j++) {
        if (p->fate[j] != FATE_STAGE) continue;
        sub *s = &t->subs[sub_of(t, emb_key_hash(p->akey[j]))];
        if (p->found[j]) ttl_count(t, s, was[k], -1);
        ttl_count(t, s, emb_rec_last_step(p->recs + j * t->rec), 1);
        k++;
    }
    free(was);
    return rc;
}

/* Last pass of push_spill over group b, its lock held since prepare_group: nothing here can fail
 * (the rows going into memory have their room, the staged ones are written). */
static void apply_group(emb_table *t, sub *s, spush *p, uint32_t b, const uint64_t *keys,
                        const uint64_t *h, const uint32_t *idx, size_t m, const float *grads,
                        uint64_t step)
{
    emb_mem *mem = &s->mem;
    for (size_t i = 0; i < m; i++) {
        if (i + EMB_LA_FAR < m && p->where[idx[i + EMB_LA_FAR]] >= 0)
            emb_mem_prefetch_slot(mem, (uint64_t)p->where[idx[i + EMB_LA_FAR]], t->rec);
        uint32_t k = idx[i];
        int64_t slot = p->where[k];
        if (slot < 0) {
            size_t j = (size_t)(-1 - slot);
            if (p->fate[j] == FATE_DROP) s->push_dropped++;
            if (p->fate[j] != FATE_MEM) continue;
            if (p->slot[j] < 0) {
                p->slot[j] = emb_mem_insert(mem, keys[k], h[k]);
                if (p->slot[j] < 0) continue; /* unreachable: prepare_group made the room */
                memcpy(emb_mem_rec(mem, p->slot[j]), p->recs + j * t->rec, t->rec);
                if (p->found[j]) {
                    mem->ctrl[p->slot[j]] |= EMB_CTRL_DISK;
                    s->spilled--;
                    ttl_count(t, s, emb_rec_last_step(p->recs + j * t->rec), -1);
                    s->spill_loads++;
                } else {
                    s->created++;
                }
            }
            slot = p->slot[j];
        }
        uint8_t *rec = emb_mem_rec(mem, slot);
        emb_opt_apply(&t->cfg, rec, grads + (size_t)k * t->dim);
        touch((emb_rec_hdr *)rec, step);
        mem->ctrl[slot] = (uint8_t)((mem->ctrl[slot] | EMB_CTRL_REF) & ~EMB_CTRL_CLEAN);
    }
    for (size_t j = p->first[b]; j < p->first[b + 1]; j++) {
        if (p->fate[j] != FATE_STAGE || p->found[j]) continue;
        s->spilled++;
        s->created++;
    }
    s->pushes += m;
}

/*
 * A push to a table with a spill store, all or nothing: everything that can fail (reading rows
 * back, growing a sub-shard, the one write) is done for every group before the first row changes:
 *   1. per group (prepare_group): find each key's row; read the absent ones back or make them
 *      new, each to live in memory while there is room, else to be updated on disk;
 *   2. step; the rows updated on disk get their gradients and are written in one batch;
 *   3. per group (apply_group): every other row is updated in memory; unlock.
 * On a failure in 1 or 2 the locks are released with no row changed and the step unchanged.
 * Each group's lock is held from 1 to 3 (taken in sub-shard order, as pause_all does): released
 * in between, another call could evict or load the rows found in 1, and 3 would have to do I/O
 * again, after other groups had changed. The price is that on such a table a push does not
 * overlap other calls on the sub-shards it holds.
 */
static int push_spill(emb_table *t, size_t n, const uint64_t *keys, const float *grads,
                      const uint64_t *hints, const uint64_t *h, const uint32_t *ord,
                      const uint32_t *st, char **errptr)
{
    spush p = {0};
    char *why = NULL;
    int rc = CM_OK;
    p.where = malloc(n * sizeof *p.where);
    p.first = malloc(((size_t)t->n_sub + 1) * sizeof *p.first);
    if (p.where == NULL || p.first == NULL)
        rc = cm_err(&why, CM_ENOMEM, "out of memory for a batch of %zu keys", n);
    uint32_t locked = 0; /* groups before this one are locked (the empty ones aside) */
    for (; rc == CM_OK && locked < t->n_sub; locked++) {
        uint32_t b = locked;
        p.first[b] = p.n_abs;
        if (st[b] == st[b + 1]) continue;
        pthread_mutex_lock(&t->subs[b].mu);
        rc =
            prepare_group(t, &t->subs[b], &p, keys, h, hints, ord + st[b], st[b + 1] - st[b], &why);
    }
    /* The step is the next one, published only once the write went through: taken at once
     * and given back on a failure, it was seen meanwhile by calls that read the step without
     * this push's locks (a pull reads it before it waits for its groups), which then stamped
     * rows after the table's step. step_mu keeps two pushes from taking the same one. */
    uint64_t step = 0;
    if (rc == CM_OK) {
        p.first[t->n_sub] = p.n_abs;
        pthread_mutex_lock(&t->step_mu);
        step = __atomic_load_n(&t->step, __ATOMIC_RELAXED) + 1;
        rc = stage_commit(t, &p, ord, n, grads, step, &why);
        if (rc == CM_OK) __atomic_store_n(&t->step, step, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&t->step_mu);
    }
    for (uint32_t b = 0; b < locked; b++) {
        if (st[b] == st[b + 1]) continue;
        if (rc == CM_OK)
            apply_group(t, &t->subs[b], &p, b, keys, h, ord + st[b], st[b + 1] - st[b], grads,
                        step);
        pthread_mutex_unlock(&t->subs[b].mu);
    }
    spush_fini(&p);
    if (rc != CM_OK) return push_failed(t, n, rc, why, errptr);
    return CM_OK;
}

static int table_batch(emb_table *t, const uint64_t *keys, size_t n, int op, float *out,
                       const float *grads, const uint64_t *hints, uint64_t *hints_out,
                       char **errptr)
{
    if (n == 0) return CM_OK;
    if (keys == NULL || (op == OP_PULL ? out == NULL : grads == NULL))
        return cm_err(errptr, CM_EINVAL, "NULL keys or values for a batch of %zu", n);
    if (n > UINT32_MAX) return cm_err(errptr, CM_EINVAL, "batch of %zu keys is too large", n);
    if (op == OP_PUSH) {
        size_t i = cm_f32_first_nonfinite(grads, n * t->dim);
        if (i < n * t->dim)
            return cm_err(errptr, CM_EINVAL,
                          "non-finite gradient for key %llu (element %zu): push rejected",
                          (unsigned long long)keys[i / t->dim], i % t->dim);
    }
    uint64_t *h = NULL;
    uint32_t *ord = NULL, *st = NULL;
    int rc = group_keys(t, keys, n, &h, &ord, &st, errptr);
    if (rc != CM_OK) return rc;
    /* A pull of a table with admission runs in one part: the admission sketch is shared by
     * every sub-shard (keys of two groups can share a counter), so the order in which a pull's
     * groups count their absent keys decides which keys reach the threshold; in parts run at
     * once that order would be the threads' timing, and the rows admitted, the output and the
     * stats would vary from run to run. A push does not count in the sketch (a key not yet
     * admitted is dropped), so it still fans out. */
    const uint32_t parts = op == OP_PULL && t->cms != NULL ? 1 : fan_parts(t, n);
    if (op == OP_PUSH && t->spill != NULL) {
        rc = push_spill(t, n, keys, grads, hints, h, ord, st, errptr);
    } else if (op == OP_PUSH) {
        rc = parts > 1 ? push_fanned(t, n, keys, grads, hints, h, ord, st, parts, errptr)
                       : push_memory(t, n, keys, grads, hints, h, ord, st, errptr);
    } else {
        char *why = NULL;
        fan f;
        if (fan_init(&f, t, keys, h, ord, st, parts) != CM_OK)
            fan_init(&f, t, keys, h, ord, st, 1); /* (out of memory: one part, the same result) */
        f.op = op;
        f.phase = FAN_PROCESS;
        f.out = out;
        f.hints_out = hints_out;
        f.step = __atomic_load_n(&t->step, __ATOMIC_RELAXED);
        rc = fan_run(&f, &why);
        fan_fini(&f);
        if (rc != CM_OK) cm_err(errptr, rc, "%s", why != NULL ? why : "pull failed");
        free(why);
    }
    free(h);
    free(ord);
    free(st);
    return rc;
}

int emb_table_lookup(emb_table *t, const uint64_t *keys, size_t n, float *out, uint8_t *found,
                     char **errptr)
{
    if (n == 0) return CM_OK;
    uint64_t *h = NULL;
    uint32_t *ord = NULL, *st = NULL;
    int rc = group_keys(t, keys, n, &h, &ord, &st, errptr);
    if (rc != CM_OK) return rc;
    const size_t dim = t->dim;
    uint64_t *miss = malloc(n * sizeof *miss);
    uint32_t *miss_at = malloc(n * sizeof *miss_at);
    uint8_t *recs = NULL, *got = malloc(n);
    if (miss == NULL || miss_at == NULL || got == NULL)
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
    for (uint32_t b = 0; b < t->n_sub && rc == CM_OK; b++) {
        sub *s = &t->subs[b];
        size_t n_miss = 0;
        pthread_mutex_lock(&s->mu);
        for (uint32_t i = st[b]; i < st[b + 1]; i++) {
            uint32_t k = ord[i];
            int64_t slot = emb_mem_find(&s->mem, keys[k], h[k]);
            if (found) found[k] = slot >= 0;
            if (slot >= 0) {
                memcpy(out + k * dim, emb_rec_weights(emb_mem_rec(&s->mem, slot)),
                       dim * sizeof(float));
                continue;
            }
            memset(out + k * dim, 0, dim * sizeof(float));
            miss[n_miss] = keys[k];
            miss_at[n_miss++] = k;
        }
        if (n_miss > 0 && t->spill != NULL && s->spilled > 0) {
            if (recs == NULL && (recs = malloc(n * t->rec)) == NULL)
                rc = cm_err(errptr, CM_ENOMEM, "out of memory");
            if (rc == CM_OK) rc = spill_get(t, s, miss, n_miss, recs, got, errptr);
            for (size_t j = 0; rc == CM_OK && j < n_miss; j++) {
                if (!got[j]) continue;
                uint32_t k = miss_at[j];
                memcpy(out + k * dim, emb_rec_weights(recs + j * t->rec), dim * sizeof(float));
                if (found) found[k] = 1;
            }
        }
        pthread_mutex_unlock(&s->mu);
    }
    free(miss);
    free(miss_at);
    free(recs);
    free(got);
    free(h);
    free(ord);
    free(st);
    return rc;
}

int emb_table_pull(emb_table *t, const uint64_t *keys, size_t n, float *out, char **errptr)
{
    return table_batch(t, keys, n, OP_PULL, out, NULL, NULL, NULL, errptr);
}

int emb_table_pull_hinted(emb_table *t, const uint64_t *keys, size_t n, float *out, uint64_t *hints,
                          char **errptr)
{
    return table_batch(t, keys, n, OP_PULL, out, NULL, NULL, hints, errptr);
}

int emb_table_push(emb_table *t, const uint64_t *keys, size_t n, const float *grads, char **errptr)
{
    return table_batch(t, keys, n, OP_PUSH, NULL, grads, NULL, NULL, errptr);
}

int emb_table_push_hinted(emb_table *t, const uint64_t *keys, size_t n, const float *grads,
                          const uint64_t *hints, char **errptr)
{
    return table_batch(t, keys, n, OP_PUSH, NULL, grads, hints, NULL, errptr);
}

/* ---- life cycle ---- */

static void table_free(emb_table *t, uint32_t n_subs);

/* The capacity a sub-shard starts with so that its share of `rows` fits under the maximum load
 * factor. Keys spread over the sub-shards binomially (standard deviation ~sqrt(share)), so the
 * share gets 4 deviations of slack: the fullest of 4096 sub-shards still fits. */
static uint64_t reserve_cap(uint64_t rows, uint32_t n_sub)
{
    const uint64_t least = 64;
    if (rows == 0) return least;
    double share = (double)rows / n_sub;
    double need = (share + 4.0 * sqrt(share) + 1.0) * EMB_LOAD_DEN / EMB_LOAD_NUM + 1.0;
    if (need > (double)(UINT64_MAX / 2)) return UINT64_MAX / 2;
    return need < (double)least ? least : (uint64_t)need;
}

/* A sub-shard's largest capacity: what the budget buys (unlimited without one). */
static uint64_t budget_cap(const emb_table_config *cfg, uint32_t n_sub)
{
    if (cfg->mem_budget_bytes == 0) return UINT64_MAX;
    return cfg->mem_budget_bytes / n_sub / (emb_row_bytes(cfg) + 1);
}

/* The capacity each sub-shard starts with: the reservation's, within the budget. */
static uint64_t start_cap(const emb_table_config *cfg, uint32_t n_sub)
{
    uint64_t cap = reserve_cap(cfg->reserve_rows, n_sub), max_cap = budget_cap(cfg, n_sub);
    if (cap > max_cap) cap = max_cap;
    return cap < 2 ? 2 : cap; /* emb_mem_init's least */
}

uint64_t emb_table_initial_bytes(const emb_table_config *cfg)
{
    uint32_t n_sub = cfg->n_sub ? cfg->n_sub : EMB_DEFAULT_SUBS;
    double bytes = (double)start_cap(cfg, n_sub) * (double)(emb_row_bytes(cfg) + 1) * n_sub;
    return bytes >= 1.8e19 ? UINT64_MAX : (uint64_t)bytes;
}

/* P(X > x) for a sub-shard's share X of the rows, Binomial(rows, 1/n_sub), by the normal
 * approximation with continuity correction: exact enough where the share is large enough to
 * matter for memory. */
static double share_above(double mean, double sd, uint64_t x)
{
    if (sd == 0) return mean > (double)x ? 1.0 : 0.0;
    return 0.5 * erfc(((double)x + 0.5 - mean) / (sd * sqrt(2.0)));
}

void emb_table_plan_rows(const emb_table_config *cfg, uint64_t rows, emb_table_plan *out)
{
    uint32_t n_sub = cfg->n_sub ? cfg->n_sub : EMB_DEFAULT_SUBS;
    uint64_t cap = start_cap(cfg, n_sub), max_cap = budget_cap(cfg, n_sub);
    double mean = (double)rows / n_sub, sd = sqrt(mean * (1.0 - 1.0 / n_sub));
    /* A sub-shard doubles (emb_mem_grow) when a row arrives with its capacity's limit already
     * used, so it ends at the first capacity of its sequence whose limit holds its share. */
    double slots = (double)cap;
    while (cap < max_cap && cap <= UINT64_MAX / 2) {
        double p = share_above(mean, sd, emb_mem_limit_of(cap));
        if (p < 1e-12) break;
        uint64_t next = cap * 2 < max_cap ? cap * 2 : max_cap;
        slots += p * (double)(next - cap);
        cap = next;
    }
    memset(out, 0, sizeof *out);
    out->bytes_mem = slots * (double)(emb_row_bytes(cfg) + 1) * n_sub;
    out->rows_mem = rows;
    if (max_cap != UINT64_MAX) {
        double fit = (double)emb_mem_limit_of(max_cap) * n_sub;
        if (fit < (double)rows) out->rows_mem = (uint64_t)fit;
    }
    out->rows_spilled = rows - out->rows_mem;
}

int emb_table_create(const emb_table_config *cfg, emb_table **out, char **errptr)
{
    int rc = emb_table_config_check(cfg, errptr);
    if (rc != CM_OK) return rc;
    emb_table *t = calloc(1, sizeof *t);
    if (t == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    t->cfg = *cfg;
    t->cfg.spill_path = NULL;
    t->n_sub = cfg->n_sub ? cfg->n_sub : EMB_DEFAULT_SUBS;
    t->cfg.n_sub = t->n_sub;
    t->dim = cfg->dim;
    t->rec = emb_row_bytes(cfg);
    t->subs = aligned_alloc(64, sizeof(sub) * t->n_sub);
    if (t->subs == NULL) {
        free(t);
        return cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    memset(t->subs, 0, sizeof(sub) * t->n_sub);
    uint64_t max_cap = budget_cap(cfg, t->n_sub);
    if (cfg->mem_budget_bytes > 0) {
        t->spill_path = strdup(cfg->spill_path);
        t->cfg.spill_path = t->spill_path;
        if (t->spill_path == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        if (rc == CM_OK)
            rc = emb_store_create("rocksdb", cfg->spill_path, t->rec, &t->spill, errptr);
    }
    uint64_t initial_cap = start_cap(cfg, t->n_sub);
    uint32_t inited = 0;
    for (; rc == CM_OK && inited < t->n_sub; inited++) {
        pthread_mutex_init(&t->subs[inited].mu, NULL);
        rc = emb_mem_init(&t->subs[inited].mem, t->rec, initial_cap, max_cap, errptr);
        if (rc != CM_OK) pthread_mutex_destroy(&t->subs[inited].mu);
    }
    pthread_mutex_init(&t->expire_mu, NULL);
    pthread_mutex_init(&t->step_mu, NULL);
    t->ttl_g = cfg->ttl_steps >= 64 ? cfg->ttl_steps / 64 : 1;
    t->ttl_ring = (uint32_t)(cfg->ttl_steps / t->ttl_g + 3);
    if (rc == CM_OK && cfg->ttl_steps > 0 && t->spill != NULL) {
        t->ttl_cnt = calloc((size_t)t->n_sub * t->ttl_ring, sizeof *t->ttl_cnt);
        if (t->ttl_cnt == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        for (uint32_t i = 0; rc == CM_OK && i < t->n_sub; i++)
            t->subs[i].ttl_cnt = t->ttl_cnt + (size_t)i * t->ttl_ring;
    }
    if (rc == CM_OK && cfg->admit_threshold > 1) {
        t->cms = calloc((size_t)CMS_DEPTH << CMS_BITS, sizeof *t->cms);
        if (t->cms == NULL)
            rc = cm_err(errptr, CM_ENOMEM, "out of memory for the admission sketch");
    }
    if (rc != CM_OK) {
        table_free(t, inited < t->n_sub ? inited : t->n_sub);
        return rc;
    }
    *out = t;
    return CM_OK;
}

void emb_table_destroy(emb_table *t)
{
    if (t != NULL) table_free(t, t->n_sub);
}

/* Frees a table whose first n_subs sub-shards were initialised. */
static void table_free(emb_table *t, uint32_t n_subs)
{
    for (uint32_t i = 0; i < n_subs; i++) {
        if (t->subs[i].mem.ctrl == NULL) continue;
        emb_mem_fini(&t->subs[i].mem);
        pthread_mutex_destroy(&t->subs[i].mu);
    }
    /* Only a spill database this table opened is its own to remove: when the open failed,
     * the path may hold another live table's database (RocksDB refused its lock), whose files
     * a removal here would delete from under it. Even then only the database's files are the
     * table's: spill_path may be a directory holding other files, which stay. Nothing can
     * report a failed removal from here (destroy returns nothing); what is left is scratch. */
    (void)emb_store_drop(t->spill, NULL);
    free(t->spill_path);
    free(t->subs);
    free(t->cms);
    free(t->ttl_cnt);
    pthread_mutex_destroy(&t->expire_mu);
    pthread_mutex_destroy(&t->step_mu);
    free(t);
}

const emb_table_config *emb_table_get_config(const emb_table *t)
{
    return &t->cfg;
}

uint64_t emb_table_step(const emb_table *t)
{
    return __atomic_load_n(&t->step, __ATOMIC_RELAXED);
}

/* ---- whole-table operations (the table paused) ---- */

static void pause_all(emb_table *t)
{
    for (uint32_t i = 0; i < t->n_sub; i++)
        pthread_mutex_lock(&t->subs[i].mu);
}

static void resume_all(emb_table *t)
{
    for (uint32_t i = t->n_sub; i-- > 0;)
        pthread_mutex_unlock(&t->subs[i].mu);
}

static void row_view(const emb_table *t, const uint8_t *rec, emb_row *row)
{
    const emb_rec_hdr *hdr = (const emb_rec_hdr *)rec;
    row->key = hdr->key;
    row->updates = hdr->updates;
    row->last_step = hdr->last_step;
    row->weights = (const float *)(rec + EMB_REC_HDR);
    row->state = row->weights + t->dim;
}

int emb_table_get_row(emb_table *t, uint64_t key, emb_row *row, float *weights, float *state,
                      char **errptr)
{
    uint64_t h = emb_key_hash(key);
    sub *s = &t->subs[sub_of(t, h)];
    uint64_t rec_words[(t->rec + 7) / 8]; /* aligned for the header view */
    uint8_t *rec = (uint8_t *)rec_words;
    uint8_t found = 0;
    int rc = CM_OK;
    pthread_mutex_lock(&s->mu);
    int64_t slot = emb_mem_find(&s->mem, key, h);
    if (slot >= 0) {
        memcpy(rec, emb_mem_rec(&s->mem, slot), t->rec);
        found = 1;
    } else if (t->spill != NULL && s->spilled > 0) {
        rc = spill_get(t, s, &key, 1, rec, &found, errptr);
    }
    pthread_mutex_unlock(&s->mu);
    if (rc != CM_OK) return rc;
    if (!found) return CM_ENOTFOUND;
    emb_row view;
    row_view(t, rec, &view);
    *row = view;
    if (weights) memcpy(weights, view.weights, t->dim * sizeof(float));
    if (state) memcpy(state, view.state, emb_row_slots(&t->cfg) * sizeof(float));
    row->weights = weights;
    row->state = state;
    return CM_OK;
}

/* True when key is resident in memory (its spill copy, if any, is not the current row). */
static bool resident(const emb_table *t, uint64_t key)
{
    uint64_t h = emb_key_hash(key);
    return emb_mem_find(&t->subs[sub_of(t, h)].mem, key, h) >= 0;
}

struct spill_walk {
    const emb_table *t;
    emb_record_cb cb;
    void *arg;
};

static int spill_walk_rec(const void *rec, void *arg)
{
    struct spill_walk *sw = arg;
    const emb_table *t = sw->t;
    uint64_t key = emb_rec_key(rec);
    const sub *s = &t->subs[sub_of(t, emb_key_hash(key))];
    return spill_dead(t, s, rec) || resident(t, key) ? 0 : sw->cb(rec, sw->arg);
}

/* Calls rec_cb on every row once, memory first, then rows that live only in the spill store;
 * the caller holds every lock. */
int emb_table_foreach_record_locked(emb_table *t, emb_record_cb cb, void *arg, char **errptr)
{
    for (uint32_t i = 0; i < t->n_sub; i++) {
        emb_mem *m = &t->subs[i].mem;
        for (uint64_t j = 0; j < m->cap; j++) {
            if (m->ctrl[j] == 0) continue;
            int rc = cb(emb_mem_rec(m, (int64_t)j), arg);
            if (rc != 0) return rc;
        }
    }
    if (t->spill == NULL) return CM_OK;
    struct spill_walk sw = {t, cb, arg};
    return emb_store_foreach(t->spill, spill_walk_rec, &sw, errptr);
}

struct foreach_arg {
    emb_table *t;
    emb_row_cb cb;
    void *arg;
};

static int foreach_rec(const void *rec, void *arg)
{
    struct foreach_arg *fa = arg;
    /* Spilled records come from RocksDB at any alignment: view an aligned copy. */
    uint64_t copy[(fa->t->rec + 7) / 8];
    memcpy(copy, rec, fa->t->rec);
    emb_row row;
    row_view(fa->t, (const uint8_t *)copy, &row);
    return fa->cb(&row, fa->arg);
}

int emb_table_foreach(emb_table *t, emb_row_cb cb, void *arg, char **errptr)
{
    struct foreach_arg fa = {t, cb, arg};
    pause_all(t);
    int rc = emb_table_foreach_record_locked(t, foreach_rec, &fa, errptr);
    resume_all(t);
    return rc;
}

/*
 * One sub-shard at a time, each under its own lock, so that the rest of the table serves calls
 * meanwhile: the step is read under the lock, after every call that stamped a row of it (or
 * counted one, ttl_count), so no row is stamped past it and the ring holds no bucket past the
 * cut. Spilled rows are counted by bucket, and raising the sub-shard's mark expires the older
 * ones where they lie, spill copies of the resident rows dropped here included (a copy is never
 * stamped after its row). The store's compactions get the lowest mark of the call.
 */
int emb_table_expire(emb_table *t, uint64_t *dropped, char **errptr)
{
    (void)errptr; /* nothing here can fail: the spill store is neither read nor written */
    uint64_t total = 0;
    if (t->cfg.ttl_steps == 0) goto out;
    pthread_mutex_lock(&t->expire_mu);
    uint64_t mark = UINT64_MAX;
    for (uint32_t i = 0; i < t->n_sub; i++) {
        sub *s = &t->subs[i];
        pthread_mutex_lock(&s->mu);
        uint64_t step = emb_table_step(t), cut = ttl_cut(t, step);
        if (t->ttl_cnt != NULL) {
            ttl_advance(t, s, step);
            s->spilled -= s->ttl_doomed;
            s->ttl_evictions += s->ttl_doomed + s->ttl_gone;
            total += s->ttl_doomed + s->ttl_gone;
            s->ttl_doomed = s->ttl_gone = 0;
        }
        if (cut > s->dead_below) s->dead_below = cut;
        if (s->dead_below < mark) mark = s->dead_below;
        emb_mem *m = &s->mem;
        /* A push between its passes (push_memory) may find a row of its gone when its update
         * pass comes: it then creates the row again, in the slot the deletion freed (its
         * reservation assumed the row present), so it still cannot run out of room. That row
         * expired before the push touched it, as if the push had come after this call.
         * Skipping sub-shards with a reservation instead let steady pushes keep rows past
         * their TTL indefinitely. */
        for (uint64_t j = 0; j < m->cap;) {
            /* A deletion shifts the cluster back into slot j: look at it again. */
            uint8_t *rec = m->ctrl[j] ? emb_mem_rec(m, (int64_t)j) : NULL;
            if (rec && ttl_bucket(t, ((emb_rec_hdr *)rec)->last_step) < cut) {
                emb_mem_delete(m, (int64_t)j);
                s->ttl_evictions++;
                total++;
                continue;
            }
            j++;
        }
        pthread_mutex_unlock(&s->mu);
    }
    /* (A rocksdb store only sets its compactions' mark: nothing to fail.) */
    if (t->spill != NULL && mark > 0) /* (n_sub >= 1: mark is a sub-shard's) */
        (void)emb_store_set_dead_below(t->spill, mark * t->ttl_g, NULL);
    pthread_mutex_unlock(&t->expire_mu);
out:
    if (dropped) *dropped = total;
    return CM_OK;
}

void emb_table_stats_get(emb_table *t, emb_table_stats *out)
{
    memset(out, 0, sizeof *out);
    for (uint32_t i = 0; i < t->n_sub; i++) {
        sub *s = &t->subs[i];
        pthread_mutex_lock(&s->mu);
        out->rows_mem += s->mem.count;
        out->bytes_mem += emb_mem_bytes(&s->mem);
        out->rows_spilled += s->spilled;
        out->pulls += s->pulls;
        out->pushes += s->pushes;
        out->created += s->created;
        out->admissions += s->admissions;
        out->admit_rejects += s->admit_rejects;
        out->push_dropped += s->push_dropped;
        out->spill_evictions += s->spill_evictions;
        out->spill_loads += s->spill_loads;
        out->ttl_evictions += s->ttl_evictions;
        pthread_mutex_unlock(&s->mu);
    }
    out->bytes_budget = t->cfg.mem_budget_bytes;
    if (t->spill != NULL) out->bytes_spill_mem = emb_store_mem_bytes(t->spill);
    out->row_bytes = t->rec;
    out->step = emb_table_step(t);
}

/* ---- used by snapshot.c ---- */

void emb_table_pause(emb_table *t)
{
    pause_all(t);
}

void emb_table_resume(emb_table *t)
{
    resume_all(t);
}

uint64_t emb_table_rows_locked(emb_table *t)
{
    uint64_t n = 0;
    for (uint32_t i = 0; i < t->n_sub; i++)
        n += t->subs[i].mem.count + t->subs[i].spilled;
    return n;
}

const uint16_t *emb_table_sketch(const emb_table *t, size_t *n)
{
    *n = t->cms ? (size_t)CMS_DEPTH << CMS_BITS : 0;
    return t->cms;
}

int emb_sketch_fits(size_t n, char **errptr)
{
    size_t have = (size_t)CMS_DEPTH << CMS_BITS;
    if (n != have)
        return cm_err(errptr, CM_EINVAL,
                      "an admission sketch of %zu counters, the table's has %zu: count-min "
                      "sketches of other dimensions do not fit",
                      n, have);
    return CM_OK;
}

int emb_table_set_sketch(emb_table *t, const uint16_t *c, size_t n, char **errptr)
{
    if (t->cms == NULL)
        return cm_err(errptr, CM_EINVAL, "the table has no admission sketch (admission is off)");
    int rc = emb_sketch_fits(n, errptr);
    if (rc == CM_OK) memcpy(t->cms, c, n * sizeof *c);
    return rc;
}

void emb_sketch_add(uint16_t *acc, const uint16_t *c, size_t n)
{
    /* Saturating, as cms_add counts: a sum past the counter's range stays at its top, which
     * still over-counts no key less than its true count. */
    for (size_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)acc[i] + c[i];
        acc[i] = v > UINT16_MAX ? UINT16_MAX : (uint16_t)v;
    }
}

void emb_table_set_team(emb_table *t, cm_team *team)
{
    t->team = team;
}

void emb_table_set_step(emb_table *t, uint64_t step)
{
    __atomic_store_n(&t->step, step, __ATOMIC_RELAXED);
}

/* A row put into a TTL table with a spill store may not be stamped past the table's step (the
 * step is set first: emb_table_set_step): its spilled copy's TTL bucket must lie in the ring. */
static int stamp_check(const emb_table *t, uint64_t key, uint64_t last_step, char **errptr)
{
    uint64_t step = __atomic_load_n(&t->step, __ATOMIC_RELAXED);
    if (t->ttl_cnt == NULL || last_step <= step) return CM_OK;
    return cm_err(errptr, CM_ECORRUPT,
                  "row of key %llu was last touched at step %llu, after the table's step %llu",
                  (unsigned long long)key, (unsigned long long)last_step, (unsigned long long)step);
}

int emb_table_put_row(emb_table *t, const emb_row *row, char **errptr)
{
    int rc = stamp_check(t, row->key, row->last_step, errptr);
    if (rc != CM_OK) return rc;
    uint8_t rec[t->rec];
    emb_rec_pack(rec, t->rec, row, t->dim, emb_row_slots(&t->cfg));
    uint64_t h = emb_key_hash(row->key);
    sub *s = &t->subs[sub_of(t, h)];
    scratch sc = {0};
    pthread_mutex_lock(&s->mu);
    int64_t slot = emb_mem_find(&s->mem, row->key, h);
    uint8_t on_disk = 0;
    uint64_t old_last = 0;
    if (slot < 0 && t->spill != NULL && s->spilled > 0) {
        /* Replacing a spilled row: the new row becomes resident and its old copy is stale. */
        uint8_t old[t->rec];
        rc = spill_get(t, s, &row->key, 1, old, &on_disk, errptr);
        if (on_disk) old_last = emb_rec_last_step(old);
    }
    /* Expiry drops a resident row and leaves its spill copy to the mark, which holds only while
     * no copy is stamped after its row (see the top of this file): a row stamped before the one
     * it replaces takes the place of that row's copy, or the copy would outlive it. */
    bool copied = on_disk || (slot >= 0 && (s->mem.ctrl[slot] & EMB_CTRL_DISK));
    uint64_t was = slot >= 0 ? emb_rec_last_step(emb_mem_rec(&s->mem, slot)) : old_last;
    if (rc == CM_OK && copied && row->last_step < was) {
        rc = emb_store_put(t->spill, rec, 1, errptr);
        if (rc == CM_OK && on_disk) { /* counted in its new bucket, resident or not */
            ttl_count(t, s, old_last, -1);
            ttl_count(t, s, row->last_step, 1);
            old_last = row->last_step;
        }
    }
    if (rc == CM_OK && slot < 0) {
        rc = insert_room(t, s, &sc, row->key, h, &slot, errptr);
        /* Counted resident only once it is: a failed eviction leaves it spilled. */
        if (rc == CM_OK && on_disk) {
            s->mem.ctrl[slot] |= EMB_CTRL_DISK;
            s->spilled--;
            ttl_count(t, s, old_last, -1);
        }
    }
    if (rc == CM_OK) {
        memcpy(emb_mem_rec(&s->mem, slot), rec, t->rec);
        s->mem.ctrl[slot] &= (uint8_t)~EMB_CTRL_CLEAN;
    }
    pthread_mutex_unlock(&s->mu);
    scratch_fini(&sc);
    return rc;
}

/* Whether a key of the n records at recs is held twice among them, or already held (in memory or
 * spilled), before any of them is inserted: with a spill store a row loaded earlier may have left
 * memory (evicted to make room), so the check in memory alone (emb_table_load_records) let a
 * snapshot's second copy of such a key in beside the first: two rows for one key. A key is
 * looked up in the spill store only when its sub-shard has spilled rows, so a load that fits its
 * budget reads nothing; the rest costs one batched get per call (a read chunk of the file),
 * beside the eviction writes such a load makes anyway. The table is the load's alone. */
static int load_dup_check(emb_table *t, const uint8_t *recs, size_t n, scratch *sc, char **errptr)
{
    if (grow_buf((void **)&sc->miss, &sc->cap_miss, n, sizeof *sc->miss) != CM_OK)
        return cm_err(errptr, CM_ENOMEM, "out of memory checking a snapshot's keys");
    for (size_t i = 0; i < n; i++)
        sc->miss[i] = emb_rec_key(recs + i * t->rec);
    /* Twice among these records: one may be evicted before the other is inserted. */
    qsort(sc->miss, n, sizeof *sc->miss, cm_u64_cmp);
    for (size_t i = 1; i < n; i++)
        if (sc->miss[i] == sc->miss[i - 1])
            return cm_err(errptr, CM_ECORRUPT, "duplicate key %llu in snapshot",
                          (unsigned long long)sc->miss[i]);
    /* Held already in memory or in the spill store (the keys to look up there kept in front).
     * Memory is checked here too, not only where emb_table_load_records inserts: a row of an
     * earlier call resident now may be evicted by this call's inserts before its second copy
     * comes, and would then be found nowhere. */
    size_t n_get = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t key = sc->miss[i], h = emb_key_hash(key);
        sub *s = &t->subs[sub_of(t, h)];
        pthread_mutex_lock(&s->mu);
        bool spilled = s->spilled > 0, held = emb_mem_find(&s->mem, key, h) >= 0;
        pthread_mutex_unlock(&s->mu);
        if (held)
            return cm_err(errptr, CM_ECORRUPT, "duplicate key %llu in snapshot",
                          (unsigned long long)key);
        if (spilled) sc->miss[n_get++] = key;
    }
    if (n_get == 0) return CM_OK;
    sc->miss_found = malloc(n_get);
    sc->miss_recs = malloc(n_get * t->rec);
    if (sc->miss_found == NULL || sc->miss_recs == NULL)
        return cm_err(errptr, CM_ENOMEM, "out of memory checking a snapshot's keys");
    int rc = emb_store_get(t->spill, sc->miss, n_get, sc->miss_recs, sc->miss_found, errptr);
    for (size_t i = 0; rc == CM_OK && i < n_get; i++) {
        /* An expired copy is no row (spill_dead); a fresh table has none, but the rule holds. */
        const sub *s = &t->subs[sub_of(t, emb_key_hash(sc->miss[i]))];
        if (sc->miss_found[i] && !spill_dead(t, s, sc->miss_recs + i * t->rec))
            rc = cm_err(errptr, CM_ECORRUPT,
                        "duplicate key %llu in snapshot (its first row was already spilled)",
                        (unsigned long long)sc->miss[i]);
    }
    return rc;
}

/* Inserts whole records (a restore); keys must be new to the table. */
int emb_table_load_records(emb_table *t, const uint8_t *recs, size_t n, char **errptr)
{
    scratch sc = {0};
    int rc = t->spill != NULL ? load_dup_check(t, recs, n, &sc, errptr) : CM_OK;
    for (size_t i = 0; i < n && rc == CM_OK; i++) {
        const uint8_t *r = recs + i * t->rec;
        uint64_t key = emb_rec_key(r), h = emb_key_hash(key);
        if ((rc = stamp_check(t, key, emb_rec_last_step(r), errptr)) != CM_OK) break;
        sub *s = &t->subs[sub_of(t, h)];
        pthread_mutex_lock(&s->mu);
        int64_t slot = emb_mem_find(&s->mem, key, h);
        if (slot >= 0) {
            rc = cm_err(errptr, CM_ECORRUPT, "duplicate key %llu in snapshot",
                        (unsigned long long)key);
        } else {
            rc = insert_room(t, s, &sc, key, h, &slot, errptr);
            if (rc == CM_OK) memcpy(emb_mem_rec(&s->mem, slot), r, t->rec);
        }
        pthread_mutex_unlock(&s->mu);
    }
    scratch_fini(&sc);
    return rc;
}
