/* Replication bookkeeping: the push de-duplication ring and the backup's reorder log. */
#include "ps/replica.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

struct ps_dedup {
    pthread_mutex_t mu;
    uint32_t n_workers;
    uint32_t *pos;  /* per worker: next ring slot */
    uint64_t *ring; /* per worker: PS_DEDUP_RING recent request ids (0 = empty) */
};

ps_dedup *ps_dedup_create(uint32_t n_workers)
{
    ps_dedup *d = calloc(1, sizeof *d);
    if (d == NULL) return NULL;
    d->n_workers = n_workers;
    d->pos = calloc(n_workers, sizeof *d->pos);
    d->ring = calloc((size_t)n_workers * PS_DEDUP_RING, sizeof *d->ring);
    if (d->pos == NULL || d->ring == NULL) {
        ps_dedup_destroy(d);
        return NULL;
    }
    pthread_mutex_init(&d->mu, NULL);
    return d;
}

void ps_dedup_destroy(ps_dedup *d)
{
    if (d == NULL) return;
    if (d->pos && d->ring) pthread_mutex_destroy(&d->mu);
    free(d->pos);
    free(d->ring);
    free(d);
}

bool ps_dedup_check_add(ps_dedup *d, uint32_t worker, uint64_t req_id)
{
    if (worker >= d->n_workers || req_id == 0) return false;
    uint64_t *r = d->ring + (size_t)worker * PS_DEDUP_RING;
    bool seen = false;
    pthread_mutex_lock(&d->mu);
    /* A linear scan of 8 KiB: cheap beside applying a push of thousands of rows. */
    for (uint32_t i = 0; i < PS_DEDUP_RING && !seen; i++)
        seen = r[i] == req_id;
    if (!seen) {
        r[d->pos[worker]] = req_id;
        d->pos[worker] = (d->pos[worker] + 1) % PS_DEDUP_RING;
    }
    pthread_mutex_unlock(&d->mu);
    return seen;
}

void ps_dedup_remove(ps_dedup *d, uint32_t worker, uint64_t req_id)
{
    if (worker >= d->n_workers || req_id == 0) return;
    uint64_t *r = d->ring + (size_t)worker * PS_DEDUP_RING;
    pthread_mutex_lock(&d->mu);
    for (uint32_t i = 0; i < PS_DEDUP_RING; i++)
        if (r[i] == req_id) r[i] = 0;
    pthread_mutex_unlock(&d->mu);
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
