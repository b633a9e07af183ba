/* Replication bookkeeping: the push de-duplication ring and the backup's reorder log. */
#include "ps/replica.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

struct ps_dedup {
    pthread_mutex_t mu;
    pthread_cond_t settled; /* broadcast whenever a pending id is settled */
    uint32_t n_workers;
    uint32_t *pos;    /* per worker: next ring slot */
    uint64_t *ring;   /* per worker: PS_DEDUP_RING recent request ids (0 = empty) */
    uint8_t *pending; /* beside ring: 1 while the id's push is being applied */
};

ps_dedup *ps_dedup_create(uint32_t n_workers)
{
    ps_dedup *d = calloc(1, sizeof *d);
    if (d == NULL) return NULL;
    d->n_workers = n_workers;
    d->pos = calloc(n_workers, sizeof *d->pos);
    d->ring = calloc((size_t)n_workers * PS_DEDUP_RING, sizeof *d->ring);
    d->pending = calloc((size_t)n_workers * PS_DEDUP_RING, 1);
    if (d->pos == NULL || d->ring == NULL || d->pending == NULL) {
        ps_dedup_destroy(d);
        return NULL;
    }
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->settled, NULL);
    return d;
}

void ps_dedup_destroy(ps_dedup *d)
{
    if (d == NULL) return;
    if (d->pos && d->ring && d->pending) {
        pthread_cond_destroy(&d->settled);
        pthread_mutex_destroy(&d->mu);
    }
    free(d->pos);
    free(d->ring);
    free(d->pending);
    free(d);
}

/* The ring slot of (worker, req_id), or -1; d->mu held. A linear scan of 8 KiB: cheap beside
 * applying a push of thousands of rows. */
static int64_t dedup_find(const ps_dedup *d, uint32_t worker, uint64_t req_id)
{
    const uint64_t *r = d->ring + (size_t)worker * PS_DEDUP_RING;
    for (uint32_t i = 0; i < PS_DEDUP_RING; i++)
        if (r[i] == req_id) return i;
    return -1;
}

bool ps_dedup_check_add(ps_dedup *d, uint32_t worker, uint64_t req_id)
{
    if (worker >= d->n_workers || req_id == 0) return false;
    const size_t base = (size_t)worker * PS_DEDUP_RING;
    int64_t i;
    pthread_mutex_lock(&d->mu);
    while ((i = dedup_find(d, worker, req_id)) >= 0 && d->pending[base + (size_t)i])
        pthread_cond_wait(&d->settled, &d->mu);
    if (i < 0) {
        /* The oldest slot that is not pending: a pending id is never pushed out while its
         * resend may still come (unless a whole ring of this worker's pushes is pending). */
        uint32_t at = d->pos[worker];
        for (uint32_t k = 0; k < PS_DEDUP_RING && d->pending[base + at]; k++)
            at = (at + 1) % PS_DEDUP_RING;
        d->ring[base + at] = req_id;
        d->pending[base + at] = 1;
        d->pos[worker] = (at + 1) % PS_DEDUP_RING;
    }
    pthread_mutex_unlock(&d->mu);
    return i >= 0;
}

/* Settles (worker, req_id): kept as applied, or forgotten. */
static void dedup_settle(ps_dedup *d, uint32_t worker, uint64_t req_id, bool applied)
{
    if (worker >= d->n_workers || req_id == 0) return;
    const size_t base = (size_t)worker * PS_DEDUP_RING;
    pthread_mutex_lock(&d->mu);
    int64_t i = dedup_find(d, worker, req_id);
    if (i >= 0) {
        d->pending[base + (size_t)i] = 0;
        if (!applied) d->ring[base + (size_t)i] = 0;
        pthread_cond_broadcast(&d->settled);
    }
    pthread_mutex_unlock(&d->mu);
}

void ps_dedup_done(ps_dedup *d, uint32_t worker, uint64_t req_id)
{
    dedup_settle(d, worker, req_id, true);
}

void ps_dedup_remove(ps_dedup *d, uint32_t worker, uint64_t req_id)
{
    dedup_settle(d, worker, req_id, false);
}

bool ps_replog_put(ps_replog *l, uint64_t seq, const void *msg, size_t len)
{
    ps_replog_entry **pp = &l->head;
    while (*pp && (*pp)->seq < seq)
        pp = &(*pp)->next;
    if (*pp && (*pp)->seq == seq) return true;
    ps_replog_entry *e = malloc(sizeof *e + len);
    if (e == NULL) return false;
    e->seq = seq;
    e->len = len;
    memcpy(e->msg, msg, len);
    e->next = *pp;
    *pp = e;
    l->n++;
    l->bytes += len;
    return true;
}

bool ps_replog_has(const ps_replog *l, uint64_t seq)
{
    for (const ps_replog_entry *e = l->head; e && e->seq <= seq; e = e->next)
        if (e->seq == seq) return true;
    return false;
}

ps_replog_entry *ps_replog_pop(ps_replog *l)
{
    ps_replog_entry *e = l->head;
    if (e) {
        l->head = e->next;
        l->n--;
        l->bytes -= e->len;
    }
    return e;
}

void ps_replog_clear(ps_replog *l)
{
    ps_replog_entry *e;
    while ((e = ps_replog_pop(l)) != NULL)
        free(e);
}
