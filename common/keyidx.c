/* A key -> u32 index in a file region, filled in sorted batches (design in common.h). */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#define XXH_INLINE_ALL /* the bundle reader's hash, inlined: every key is hashed */
#include <xxhash.h>

#include "common/common.h"

/* Keys buffered between sweeps (24 bytes each: 1.5 MiB). A sweep touches up to this many
 * pages, each a minor fault once its page was handed back; fewer keys a batch means more
 * sweeps over an index larger than the batch. */
#define BATCH (1u << 16)
/* Pages behind the sweep are handed back once this many bytes of them are held. */
#define WINDOW (2u << 20)
#define FILL (64u << 10)

typedef struct slot_ent {
    uint64_t key;
    uint32_t val, pad;
} slot_ent;
_Static_assert(sizeof(slot_ent) == 16, "an index entry is 16 bytes");

typedef struct pending {
    uint64_t slot, key;
    uint32_t val;
} pending;

struct cm_keyidx {
    uint8_t *map;               /* from the page holding off */
    size_t map_len, page, lead; /* lead: off's distance into its page */
    slot_ent *ix;
    uint64_t mask, keys;
    const char *path;
    pending *batch;
    size_t n;
    bool has_dup;
    uint64_t dup;
};

uint64_t cm_keyidx_slots(uint64_t n)
{
    uint64_t slots = 16;
    while (slots < n + n / 4 + 1)
        slots <<= 1;
    return slots;
}

int cm_keyidx_open(int fd, const char *path, uint64_t off, uint64_t slots, cm_keyidx **out,
                   char **errptr)
{
    if (slots < 2 || (slots & (slots - 1)) || slots > (1ull << 40))
        return cm_err(errptr, CM_EINVAL, "%s: %" PRIu64 " index slots", path, slots);
    cm_keyidx *x = calloc(1, sizeof *x);
    slot_ent *fill = malloc(FILL);
    int rc = x && fill ? CM_OK : cm_err(errptr, CM_ENOMEM, "out of memory");
    if (rc == CM_OK) {
        x->batch = malloc(BATCH * sizeof *x->batch);
        if (x->batch == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    /* Written, not left as a hole: an empty entry is not zeros (row 0 is a row). */
    for (size_t i = 0; rc == CM_OK && i < FILL / sizeof *fill; i++)
        fill[i] = (slot_ent){0, CM_KEYIDX_EMPTY, 0};
    const uint64_t bytes = slots * sizeof(slot_ent);
    for (uint64_t at = 0; rc == CM_OK && at < bytes; at += FILL) {
        size_t k = bytes - at < FILL ? (size_t)(bytes - at) : FILL;
        if (cm_pwrite_full(fd, fill, k, off + at) != CM_OK)
            rc = cm_err_errno(errptr, CM_EIO, "cannot write %s", path);
    }
    free(fill);
    if (rc == CM_OK) {
        x->page = (size_t)sysconf(_SC_PAGESIZE);
        x->lead = (size_t)(off % x->page);
        x->map_len = x->lead + (size_t)bytes;
        x->map =
            mmap(NULL, x->map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)(off - x->lead));
        if (x->map == MAP_FAILED) {
            x->map = NULL;
            rc = cm_err_errno(errptr, CM_EIO, "cannot map %s", path);
        }
    }
    if (rc != CM_OK) {
        cm_keyidx_close(x);
        return rc;
    }
    x->ix = (slot_ent *)(x->map + x->lead);
    x->mask = slots - 1;
    x->path = path;
    *out = x;
    return CM_OK;
}

static int pending_cmp(const void *a, const void *b)
{
    const pending *p = a, *q = b;
    if (p->slot != q->slot) return p->slot < q->slot ? -1 : 1;
    return p->key < q->key ? -1 : p->key > q->key;
}

/* Hands the pages holding [from, to) of the mapping back to the page cache. */
static void drop(cm_keyidx *x, size_t from, size_t to)
{
    from -= from % x->page;
    to -= to % x->page;
    if (to > from) (void)madvise(x->map + from, to - from, MADV_DONTNEED);
}

int cm_keyidx_flush(cm_keyidx *x, char **errptr)
{
    int rc = CM_OK;
    qsort(x->batch, x->n, sizeof *x->batch, pending_cmp);
    size_t held = 0; /* the mapping below this offset was handed back */
    for (size_t i = 0; i < x->n; i++) {
        const pending *p = &x->batch[i];
        uint64_t s = p->slot;
        while (x->ix[s].val != CM_KEYIDX_EMPTY) {
            if (x->ix[s].key == p->key) {
                x->has_dup = true;
                x->dup = p->key;
                rc = cm_err(errptr, CM_EINVAL, "key %" PRIu64 " twice", p->key);
                goto out;
            }
            s = (s + 1) & x->mask;
        }
        x->ix[s] = (slot_ent){p->key, p->val, 0};
        const size_t at = x->lead + (size_t)p->slot * sizeof(slot_ent);
        if (at - held >= WINDOW) {
            drop(x, held, at);
            held = at - at % x->page;
        }
    }
out:
    drop(x, 0, x->map_len + x->page - 1);
    x->n = 0;
    return rc;
}

int cm_keyidx_add(cm_keyidx *x, uint64_t key, uint32_t val, char **errptr)
{
    if (x->keys == x->mask)
        return cm_err(errptr, CM_EINVAL, "%s: more keys than the index has room for", x->path);
    x->keys++;
    x->batch[x->n++] = (pending){XXH3_64bits(&key, sizeof key) & x->mask, key, val};
    return x->n == BATCH ? cm_keyidx_flush(x, errptr) : CM_OK;
}

int cm_keyidx_dup(const cm_keyidx *x, uint64_t *key)
{
    if (x->has_dup) *key = x->dup;
    return x->has_dup;
}

void cm_keyidx_close(cm_keyidx *x)
{
    if (x == NULL) return;
    if (x->map) munmap(x->map, x->map_len);
    free(x->batch);
    free(x);
}
