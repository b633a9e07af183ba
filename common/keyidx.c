/* A key -> u32 index in a file region, built from sorted runs in order (design in common.h). */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#define XXH_INLINE_ALL /* the bundle reader's hash, inlined: every key is hashed */
#include <xxhash.h>

#include "common/common.h"

/* Entries the region is written in at a time (1 MiB), fewer in a small budget (an eighth). */
#define OUT_MOST (1u << 16)
/* Entries each run reads back at a time, at least (4 KiB). */
#define READ_LEAST 256u
/* The least budget of any index: a buffer of a few thousand keys. */
#define MEM_LEAST (64u << 10)

typedef struct slot_ent { /* an index entry, and a run's entry in the scratch file */
    uint64_t key;
    uint32_t val, pad;
} slot_ent;
_Static_assert(sizeof(slot_ent) == 16, "an index entry is 16 bytes");

typedef struct pending {
    uint64_t slot, key;
    uint32_t val;
} pending;

/* A sorted source being merged: a run in the scratch file, entries [at, end) not read yet, or
 * the buffer itself (at == end); buf[i, n) read and not taken; its head's slot and key. */
typedef struct run {
    uint64_t at, end;
    slot_ent *buf;
    size_t i, n, cap;
    uint64_t slot, key;
} run;

/* A run's memory besides its read buffer: itself, its end, its place in the merge's heap. */
#define RUN_OVERHEAD (sizeof(run) + sizeof(uint64_t) + sizeof(uint32_t))

struct cm_keyidx {
    int fd, tmp;      /* tmp: the runs' scratch file (-1 until a run is written) */
    const char *path; /* the caller's, for messages */
    char *dir;        /* where tmp is made */
    uint64_t off, mask, keys, mem;
    pending *buf;       /* cap keys, n of them buffered */
    size_t n, cap, out; /* out: entries written at a time */
    uint64_t *run_end;  /* run r: entries [run_end[r - 1], run_end[r]) of tmp */
    size_t runs, runs_cap;
    bool has_dup, done;
    uint64_t dup;
};

uint64_t cm_keyidx_slots(uint64_t n)
{
    uint64_t slots = 16;
    while (slots < n + n / 4 + 1)
        slots <<= 1;
    return slots;
}

/* Entries written at a time with a budget of mem bytes. */
static size_t out_entries(uint64_t slots, uint64_t mem)
{
    uint64_t k = mem / 8 / sizeof(slot_ent);
    if (k > OUT_MOST) k = OUT_MOST;
    return (size_t)(k < slots ? k : slots);
}

/* Keys buffered, for slots slots in mem bytes; 0 when mem is too little: below MEM_LEAST, or
 * the runs that many keys can come to (slots - 1 keys at most) would each read back fewer
 * than READ_LEAST entries at a time from what is left beside the output chunk. */
static size_t buffered(uint64_t slots, uint64_t mem)
{
    if (mem < MEM_LEAST) return 0;
    const uint64_t spare = mem - out_entries(slots, mem) * sizeof(slot_ent);
    const uint64_t cap = spare / sizeof(pending), keys = slots - 1;
    if (cap >= keys) return (size_t)(keys > 0 ? keys : 1);
    const uint64_t runs = (keys + cap - 1) / cap;
    return spare / runs >= READ_LEAST * sizeof(slot_ent) + RUN_OVERHEAD ? (size_t)cap : 0;
}

uint64_t cm_keyidx_least(uint64_t slots)
{
    uint64_t lo = MEM_LEAST, hi = MEM_LEAST; /* buffered(slots, hi) grows with hi */
    while (buffered(slots, hi) == 0)
        hi *= 2;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (buffered(slots, mid) == 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return hi;
}

int cm_keyidx_open(int fd, const char *path, uint64_t off, uint64_t slots, uint64_t mem,
                   const char *dir, cm_keyidx **out, char **errptr)
{
    if (slots < 2 || (slots & (slots - 1)) || slots > (1ull << 40))
        return cm_err(errptr, CM_EINVAL, "%s: %" PRIu64 " index slots", path, slots);
    const size_t cap = buffered(slots, mem);
    if (cap == 0)
        return cm_err(errptr, CM_EINVAL,
                      "%s: a memory budget of %" PRIu64
                      " bytes is too small for an index of %" PRIu64
                      " slots: it needs at least %" PRIu64 " bytes",
                      path, mem, slots, cm_keyidx_least(slots));
    cm_keyidx *x = calloc(1, sizeof *x);
    if (x == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    x->fd = fd;
    x->tmp = -1;
    x->path = path;
    x->off = off;
    x->mask = slots - 1;
    x->mem = mem;
    x->cap = cap;
    x->out = out_entries(slots, mem);
    /* Pages of the buffer are touched as keys come: a small table takes little of a budget. */
    x->buf = malloc(cap * sizeof *x->buf);
    x->dir = strdup(dir);
    if (x->buf == NULL || x->dir == NULL) {
        cm_keyidx_close(x);
        return cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    *out = x;
    return CM_OK;
}

static int dup_err(cm_keyidx *x, uint64_t key, char **errptr)
{
    x->has_dup = true;
    x->dup = key;
    return cm_err(errptr, CM_EINVAL, "key %" PRIu64 " twice", key);
}

#define PENDING_LESS(p, q) ((p).slot < (q).slot || ((p).slot == (q).slot && (p).key < (q).key))
CM_SORT_DEFINE(pending_sort, pending, PENDING_LESS)

/* Sorts the buffer and rewrites it in place as index entries (16 bytes a key, in its first
 * n x 16 bytes: entry i is written after pending i is read, and lies below pending i + 1); a
 * key twice is refused. */
static int buf_sort(cm_keyidx *x, char **errptr)
{
    pending_sort(x->buf, x->n);
    slot_ent *e = (slot_ent *)(void *)x->buf;
    for (size_t i = 0; i < x->n; i++) {
        const pending p = x->buf[i];
        if (i > 0 && e[i - 1].key == p.key) return dup_err(x, p.key, errptr);
        e[i] = (slot_ent){p.key, p.val, 0};
    }
    return CM_OK;
}

/* The buffer, sorted, appended to the scratch file as a run. */
static int spill(cm_keyidx *x, char **errptr)
{
    int rc = buf_sort(x, errptr);
    if (rc == CM_OK && x->tmp < 0) rc = cm_scratch_open(x->dir, &x->tmp, errptr);
    if (rc == CM_OK && x->runs == x->runs_cap) {
        size_t c = x->runs_cap ? 2 * x->runs_cap : 16;
        uint64_t *r = realloc(x->run_end, c * sizeof *r);
        if (r == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        if (r != NULL) x->run_end = r;
        if (r != NULL) x->runs_cap = c;
    }
    const uint64_t at = x->runs ? x->run_end[x->runs - 1] : 0;
    if (rc == CM_OK &&
        cm_pwrite_full(x->tmp, x->buf, x->n * sizeof(slot_ent), at * sizeof(slot_ent)) != CM_OK)
        rc = cm_err_errno(errptr, CM_EIO, "cannot write a scratch file in %s", x->dir);
    if (rc == CM_OK) x->run_end[x->runs++] = at + x->n;
    x->n = 0;
    return rc;
}

int cm_keyidx_add(cm_keyidx *x, uint64_t key, uint32_t val, char **errptr)
{
    if (x->done) return cm_err(errptr, CM_EINVAL, "%s: a key after the index was written", x->path);
    if (x->keys == x->mask)
        return cm_err(errptr, CM_EINVAL, "%s: more keys than the index has room for", x->path);
    x->keys++;
    x->buf[x->n++] = (pending){XXH3_64bits(&key, sizeof key) & x->mask, key, val};
    return x->n == x->cap ? spill(x, errptr) : CM_OK;
}

/* r's head: buf[i], the next part of the run read into buf when buf is used up (i == n: the
 * source is done). */
static int run_head(cm_keyidx *x, run *r, char **errptr)
{
    if (r->i == r->n && r->at < r->end) {
        const size_t k = r->end - r->at < r->cap ? (size_t)(r->end - r->at) : r->cap;
        ssize_t got =
            pread(x->tmp, r->buf, k * sizeof(slot_ent), (off_t)(r->at * sizeof(slot_ent)));
        if (got != (ssize_t)(k * sizeof(slot_ent)))
            return cm_err_errno(errptr, CM_EIO, "cannot read a scratch file in %s", x->dir);
        r->at += k;
        r->i = 0;
        r->n = k;
    }
    if (r->i < r->n) {
        r->key = r->buf[r->i].key;
        r->slot = XXH3_64bits(&r->key, sizeof r->key) & x->mask;
    }
    return CM_OK;
}

#define RUN_LESS(a, b) ((a).slot < (b).slot || ((a).slot == (b).slot && (a).key < (b).key))
CM_HEAP_SIFT_DEFINE(sift, run, RUN_LESS)

/* The region being written: entries [base, base + len) in chunk, the key last placed at next - 1.
 */
typedef struct writer {
    cm_keyidx *x;
    slot_ent *chunk;
    uint64_t base, next;
    size_t len;
    bool wrapped; /* the keys past the last slot: chunk holds [base, base + len) as written */
} writer;

static int chunk_write(writer *w, char **errptr)
{
    if (cm_pwrite_full(w->x->fd, w->chunk, w->len * sizeof(slot_ent),
                       w->x->off + w->base * sizeof(slot_ent)) != CM_OK)
        return cm_err_errno(errptr, CM_EIO, "cannot write %s", w->x->path);
    return CM_OK;
}

/* Moves the chunk to the entries after it: empty, or (wrapped) as written. */
static int chunk_next(writer *w, char **errptr)
{
    w->base += w->len;
    const uint64_t slots = w->x->mask + 1, left = slots - w->base;
    w->len = left < w->x->out ? (size_t)left : w->x->out;
    if (!w->wrapped) {
        for (size_t i = 0; i < w->len; i++)
            w->chunk[i] = (slot_ent){0, CM_KEYIDX_EMPTY, 0};
        return CM_OK;
    }
    ssize_t got = pread(w->x->fd, w->chunk, w->len * sizeof(slot_ent),
                        (off_t)(w->x->off + w->base * sizeof(slot_ent)));
    if (got != (ssize_t)(w->len * sizeof(slot_ent)))
        return cm_err_errno(errptr, CM_EIO, "cannot read %s", w->x->path);
    return CM_OK;
}

/* Places the next key in home-slot order: at max(home, next), written chunk by chunk; past the
 * last slot, in the first empty entry from slot 0 on (next counts from 0 again then). */
static int place(writer *w, uint64_t slot, uint64_t key, uint32_t val, char **errptr)
{
    const uint64_t slots = w->x->mask + 1;
    uint64_t pos = slot > w->next ? slot : w->next;
    int rc = CM_OK;
    if (!w->wrapped && pos >= slots) { /* the region is written: the rest go round */
        rc = chunk_write(w, errptr);
        w->wrapped = true;
        w->base = w->len = w->next = 0;
        if (rc == CM_OK) rc = chunk_next(w, errptr);
    }
    if (w->wrapped) pos = w->next;
    while (rc == CM_OK && pos >= w->base + w->len) {
        rc = chunk_write(w, errptr);
        if (rc == CM_OK) rc = chunk_next(w, errptr);
    }
    while (rc == CM_OK && w->wrapped && w->chunk[pos - w->base].val != CM_KEYIDX_EMPTY)
        if (++pos == w->base + w->len) { /* room there is: at most slots - 1 keys */
            rc = chunk_write(w, errptr);
            if (rc == CM_OK) rc = chunk_next(w, errptr);
        }
    if (rc == CM_OK) {
        w->chunk[pos - w->base] = (slot_ent){key, val, 0};
        w->next = pos + 1;
    }
    return rc;
}

/* Merges the k sorted sources into the region. */
static int merge(cm_keyidx *x, run *runs, size_t k, slot_ent *chunk, char **errptr)
{
    int rc = CM_OK;
    uint32_t *h = malloc((k ? k : 1) * sizeof *h);
    if (h == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    size_t live = 0;
    for (size_t r = 0; r < k; r++)
        if (runs[r].i < runs[r].n) h[live++] = (uint32_t)r;
    for (size_t i = live; i-- > 0;)
        sift(runs, h, live, i);
    writer w = {.x = x, .chunk = chunk, .len = 0};
    rc = chunk_next(&w, errptr); /* the first, empty */
    bool first = true;
    uint64_t last = 0;
    while (rc == CM_OK && live > 0) {
        run *r = &runs[h[0]];
        if (!first && r->key == last) {
            rc = dup_err(x, r->key, errptr);
            break;
        }
        first = false;
        last = r->key;
        rc = place(&w, r->slot, r->key, r->buf[r->i++].val, errptr);
        if (rc == CM_OK) rc = run_head(x, r, errptr);
        if (rc == CM_OK && r->i == r->n) h[0] = h[--live];
        sift(runs, h, live, 0);
    }
    /* The rest of the region (empty), or of the keys gone round (as written). */
    while (rc == CM_OK && (rc = chunk_write(&w, errptr)) == CM_OK && !w.wrapped &&
           w.base + w.len < x->mask + 1)
        rc = chunk_next(&w, errptr);
    free(h);
    return rc;
}

int cm_keyidx_finish(cm_keyidx *x, char **errptr)
{
    if (x->done) return cm_err(errptr, CM_EINVAL, "%s: the index was written", x->path);
    x->done = true;
    int rc = CM_OK;
    const size_t k = x->runs ? x->runs + (x->n > 0) : 1;
    run *runs = calloc(k, sizeof *runs);
    slot_ent *chunk = malloc(x->out * sizeof *chunk);
    if (runs == NULL || chunk == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
    if (rc == CM_OK && x->runs == 0) {
        /* All in memory: the buffer, sorted, is the one source. */
        rc = buf_sort(x, errptr);
        runs[0] = (run){.buf = (slot_ent *)(void *)x->buf, .n = x->n};
    } else if (rc == CM_OK) {
        /* The last keys a run too; the buffer's memory becomes the runs' read buffers. */
        if (x->n > 0) rc = spill(x, errptr);
        free(x->buf);
        x->buf = NULL;
        const uint64_t per = (x->mem - x->out * sizeof(slot_ent)) / k - RUN_OVERHEAD;
        for (size_t r = 0; rc == CM_OK && r < k; r++) {
            runs[r] = (run){.at = r ? x->run_end[r - 1] : 0, .end = x->run_end[r]};
            const uint64_t len = runs[r].end - runs[r].at, cap = per / sizeof(slot_ent);
            runs[r].cap = (size_t)(len < cap ? len : cap);
            runs[r].buf = malloc(runs[r].cap * sizeof(slot_ent));
            if (runs[r].buf == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        }
    }
    for (size_t r = 0; rc == CM_OK && r < k; r++)
        rc = run_head(x, &runs[r], errptr);
    if (rc == CM_OK) rc = merge(x, runs, k, chunk, errptr);
    for (size_t r = 0; runs && x->runs > 0 && r < k; r++)
        free(runs[r].buf);
    free(runs);
    free(chunk);
    free(x->buf);
    x->buf = NULL;
    if (x->tmp >= 0) close(x->tmp);
    x->tmp = -1;
    x->n = 0;
    return rc;
}

int cm_keyidx_dup(const cm_keyidx *x, uint64_t *key)
{
    if (x->has_dup) *key = x->dup;
    return x->has_dup;
}

void cm_keyidx_close(cm_keyidx *x)
{
    if (x == NULL) return;
    if (x->tmp >= 0) close(x->tmp);
    free(x->buf);
    free(x->run_end);
    free(x->dir);
    free(x);
}
