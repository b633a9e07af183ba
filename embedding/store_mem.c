/* The "memory" row store: open addressing with linear probing over a capacity of any size. */
#include <stdlib.h>
#include <sys/mman.h>

#include "embedding/internal.h"

/* Transparent huge page size on x86-64 and most arm64 kernels. */
#define HUGE_PAGE (2u << 20)

uint64_t emb_mem_limit_of(uint64_t cap)
{
    if (cap < 2) return 0;
    uint64_t lim = cap / EMB_LOAD_DEN * EMB_LOAD_NUM + cap % EMB_LOAD_DEN * EMB_LOAD_NUM / EMB_LOAD_DEN;
    return lim == 0 ? 1 : lim;
}

/*
 * Records and ctrl bytes of cap slots in one block (records first, then ctrl zeroed): *recs
 * gets the block, *ctrl points into it, *mapped its mapping's length (0: malloc'd). A lookup
 * is a random access to both arrays, and with 4 KiB pages nearly every one also misses the
 * TLB (a table of millions of rows spans hundreds of thousands of pages), so a large block is
 * its own mapping, 2 MiB-aligned, advised for transparent huge pages, and touched whole now:
 * from the heap it would reuse freed memory already faulted in as 4 KiB pages (only half of a
 * training run's table ended up on huge pages), and faulted in row by row it would stall the
 * table's first inserts on page clearing and compaction. Touching it now also makes the
 * table's memory resident at creation, so a machine without room fails then, not mid-run.
 * Only the whole 2 MiB pages inside are advised, so resident memory never exceeds what was
 * asked for (the budget counts exactly cap x (rec + 1) bytes); where THP is off, madvise fails
 * harmlessly and the block is ordinary memory.
 */
static int block_alloc(uint64_t cap, size_t rec, uint8_t **recs, uint8_t **ctrl, size_t *mapped)
{
    size_t bytes = (size_t)cap * (rec + 1);
    uint8_t *p = NULL;
    *mapped = 0;
    if (bytes >= HUGE_PAGE) {
        size_t len = (bytes + 4095) & ~(size_t)4095;
        uint8_t *m =
            mmap(NULL, len + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) return CM_ENOMEM;
        p = (uint8_t *)(((uintptr_t)m + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
        if (p > m) munmap(m, (size_t)(p - m));
        munmap(p + len, (size_t)(m + len + HUGE_PAGE - (p + len)));
        (void)madvise(p, bytes / HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE);
        for (size_t off = 0; off < len; off += 4096)
            ((volatile uint8_t *)p)[off] = 0;
        *mapped = len;
    } else if ((p = malloc(bytes)) == NULL) {
        return CM_ENOMEM;
    }
    *recs = p;
    *ctrl = *recs + (size_t)cap * rec;
    memset(*ctrl, 0, cap);
    return CM_OK;
}

static void block_free(uint8_t *recs, size_t mapped)
{
    if (mapped)
        munmap(recs, mapped);
    else
        free(recs);
}

int emb_mem_init(emb_mem *m, size_t rec, uint64_t initial_cap, uint64_t max_cap, char **errptr)
{
    memset(m, 0, sizeof *m);
    m->rec = rec;
    m->max_cap = max_cap;
    if (initial_cap < 2) initial_cap = 2;
    if (initial_cap > max_cap) initial_cap = max_cap;
    m->cap = initial_cap;
    if (block_alloc(initial_cap, rec, &m->recs, &m->ctrl, &m->mapped) != CM_OK) {
        emb_mem_fini(m);
        return cm_err(errptr, CM_ENOMEM, "out of memory allocating %llu rows",
                      (unsigned long long)initial_cap);
    }
    return CM_OK;
}

void emb_mem_fini(emb_mem *m)
{
    block_free(m->recs, m->mapped); /* the block; ctrl lies inside it */
    memset(m, 0, sizeof *m);
}

int64_t emb_mem_find(const emb_mem *m, uint64_t key, uint64_t h)
{
    uint64_t cap = m->cap, i = emb_mem_home(h, cap);
    uint8_t tag = emb_mem_tag(h);
    for (uint64_t probes = 0; probes < cap; probes++) {
        uint8_t c = m->ctrl[i];
        if (c == 0) return -1;
        if ((c & (EMB_CTRL_USED | EMB_CTRL_TAG)) == tag &&
            emb_rec_key(m->recs + i * m->rec) == key)
            return (int64_t)i;
        if (++i == cap) i = 0;
    }
    return -1;
}

uint64_t emb_mem_limit(const emb_mem *m)
{
    return emb_mem_limit_of(m->cap);
}

bool emb_mem_full(const emb_mem *m)
{
    return m->cap >= m->max_cap && m->count + m->reserved >= emb_mem_limit_of(m->cap);
}

/* Places a record whose key is absent into the first free slot of its probe sequence. */
static uint64_t place(uint8_t *ctrl, uint64_t cap, uint64_t h)
{
    uint64_t i = emb_mem_home(h, cap);
    while (ctrl[i] != 0)
        if (++i == cap) i = 0;
    return i;
}

int emb_mem_grow(emb_mem *m)
{
    if (m->cap >= m->max_cap) return CM_ENOMEM;
    uint64_t ncap = m->cap * 2;
    if (ncap > m->max_cap) ncap = m->max_cap;
    uint8_t *nctrl, *nrecs;
    size_t nmapped;
    if (block_alloc(ncap, m->rec, &nrecs, &nctrl, &nmapped) != CM_OK) return CM_ENOMEM;
    for (uint64_t i = 0; i < m->cap; i++) {
        if (m->ctrl[i] == 0) continue;
        const uint8_t *r = m->recs + i * m->rec;
        uint64_t j = place(nctrl, ncap, emb_key_hash(emb_rec_key(r)));
        nctrl[j] = m->ctrl[i];
        memcpy(nrecs + j * m->rec, r, m->rec);
    }
    block_free(m->recs, m->mapped);
    m->ctrl = nctrl;
    m->recs = nrecs;
    m->mapped = nmapped;
    m->cap = ncap;
    m->hand = 0;
    return CM_OK;
}

int64_t emb_mem_insert(emb_mem *m, uint64_t key, uint64_t h)
{
    if (m->count + m->reserved >= emb_mem_limit_of(m->cap)) {
        if (m->cap >= m->max_cap || emb_mem_grow(m) != CM_OK) return -1;
    }
    uint64_t i = place(m->ctrl, m->cap, h);
    m->ctrl[i] = emb_mem_tag(h);
    uint8_t *r = m->recs + i * m->rec;
    memset(r, 0, m->rec);
    memcpy(r, &key, 8);
    m->count++;
    return (int64_t)i;
}

void emb_mem_delete(emb_mem *m, int64_t slot)
{
    uint64_t cap = m->cap, i = (uint64_t)slot, j = i;
    for (;;) {
        if (++j == cap) j = 0;
        if (m->ctrl[j] == 0) break;
        uint64_t k = emb_mem_home(emb_key_hash(emb_rec_key(m->recs + j * m->rec)), cap);
        /* j's record may fill hole i only if its home is not cyclically within (i, j]. */
        bool stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (stays) continue;
        m->ctrl[i] = m->ctrl[j];
        memcpy(m->recs + i * m->rec, m->recs + j * m->rec, m->rec);
        i = j;
    }
    m->ctrl[i] = 0;
    m->count--;
}

/* A store opens with this many slots (mem_open) and doubles from there (emb_mem_grow). */
#define MEM_FIRST_CAP 16u

uint64_t emb_store_mem_max_records(size_t record_bytes, uint64_t bytes)
{
    const uint64_t slot = record_bytes + 1; /* emb_mem_bytes: a record and its ctrl byte */
    uint64_t cap = MEM_FIRST_CAP;
    if (cap * slot > bytes) return 0;
    while (cap <= bytes / slot / 2)
        cap *= 2;
    /* emb_mem_insert grows only an insert that finds the table at its limit. */
    return emb_mem_limit_of(cap);
}

/* ---- emb_store ops for the memory kind ---- */

static int mem_open(const char *path, size_t rec, void **impl, char **errptr)
{
    (void)path;
    emb_mem *m = malloc(sizeof *m);
    if (m == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    int rc = emb_mem_init(m, rec, MEM_FIRST_CAP, UINT64_MAX, errptr);
    if (rc != CM_OK) {
        free(m);
        return rc;
    }
    *impl = m;
    return CM_OK;
}

static void mem_close(void *impl)
{
    if (impl == NULL) return;
    emb_mem_fini(impl);
    free(impl);
}

/* Batches run in chunks of this many keys, their hashes on the stack, looked up pipelined. */
#define MEM_CHUNK 256

static int mem_get(void *impl, const uint64_t *keys, size_t n, void *recs, uint8_t *found,
                   char **errptr)
{
    (void)errptr;
    emb_mem *m = impl;
    uint64_t h[MEM_CHUNK];
    emb_lookahead la;
    for (size_t c0 = 0; c0 < n; c0 += MEM_CHUNK) {
        size_t c = n - c0 < MEM_CHUNK ? n - c0 : MEM_CHUNK;
        const uint64_t *ck = keys + c0;
        for (size_t i = 0; i < c; i++)
            h[i] = emb_key_hash(ck[i]);
        for (size_t i = 0; i < c; i++) {
            emb_la_ahead(m, &la, h, NULL, NULL, c, i, m->rec);
            int64_t s = emb_la_find(m, &la, ck, h, NULL, i, i);
            found[c0 + i] = s >= 0;
            if (s >= 0) memcpy((char *)recs + (c0 + i) * m->rec, emb_mem_rec(m, s), m->rec);
        }
    }
    return CM_OK;
}

static int mem_put(void *impl, const void *recs, size_t n, char **errptr)
{
    emb_mem *m = impl;
    uint64_t key[MEM_CHUNK], h[MEM_CHUNK];
    emb_lookahead la;
    for (size_t c0 = 0; c0 < n; c0 += MEM_CHUNK) {
        size_t c = n - c0 < MEM_CHUNK ? n - c0 : MEM_CHUNK;
        const uint8_t *cr = (const uint8_t *)recs + c0 * m->rec;
        for (size_t i = 0; i < c; i++) {
            key[i] = emb_rec_key(cr + i * m->rec);
            h[i] = emb_key_hash(key[i]);
        }
        for (size_t i = 0; i < c; i++) {
            emb_la_ahead(m, &la, h, NULL, NULL, c, i, m->rec);
            int64_t s = emb_la_find(m, &la, key, h, NULL, i, i);
            if (s < 0) s = emb_mem_insert(m, key[i], h[i]);
            if (s < 0) return cm_err(errptr, CM_ENOMEM, "out of memory growing the memory store");
            memcpy(emb_mem_rec(m, s), cr + i * m->rec, m->rec);
        }
    }
    return CM_OK;
}

static int mem_del(void *impl, const uint64_t *keys, size_t n, char **errptr)
{
    (void)errptr;
    emb_mem *m = impl;
    for (size_t i = 0; i < n; i++) {
        int64_t s = emb_mem_find(m, keys[i], emb_key_hash(keys[i]));
        if (s >= 0) emb_mem_delete(m, s);
    }
    return CM_OK;
}

static uint64_t mem_count(const void *impl)
{
    return ((const emb_mem *)impl)->count;
}

static uint64_t mem_mem_bytes(const void *impl)
{
    return emb_mem_bytes(impl);
}

static int mem_foreach(void *impl, emb_record_cb cb, void *arg, char **errptr)
{
    (void)errptr;
    emb_mem *m = impl;
    for (uint64_t i = 0; i < m->cap; i++) {
        if (m->ctrl[i] == 0) continue;
        int rc = cb(m->recs + i * m->rec, arg);
        if (rc != 0) return rc;
    }
    return CM_OK;
}

const struct emb_store_ops emb_store_mem_ops = {
    .kind = "memory",
    .open = mem_open,
    .close = mem_close,
    .get = mem_get,
    .put = mem_put,
    .del = mem_del,
    .count = mem_count,
    .mem_bytes = mem_mem_bytes,
    .foreach = mem_foreach,
};
