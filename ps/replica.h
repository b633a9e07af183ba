/*
 * Private to ps/: the bookkeeping of shard replication (docs/PROTOCOL.md, "Replication").
 *
 * A primary applies each update (PUSH, PUSH_DENSE, INIT_DENSE, LOAD, SHUTDOWN) under one lock,
 * numbers it, ships the whole request to its backup and answers the client only once the
 * backup has acknowledged it. The backup acknowledges on receipt and applies in sequence
 * order: ps_replog holds what arrived ahead of a gap. So the backup's tables go through the
 * same states as the primary's, and every acknowledged update is on both.
 *
 * ps_dedup recognises a push seen before, by (worker, request id): nng resends a request whose
 * connection died, and after a failover the backup receives again the pushes that were in
 * flight to the dead primary. Request ids start at a random base per client, so a restarted
 * worker's ids do not collide with its earlier life's.
 */
#ifndef EMBER_PS_REPLICA_H
#define EMBER_PS_REPLICA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PS_DEDUP_RING 1024u /* pushes remembered per worker */

/* An id added by ps_dedup_check_add is pending until its caller settles it: ps_dedup_done
 * (applied and acknowledged) or ps_dedup_remove (failed). A resend that finds its original
 * pending waits for that: acknowledged at once, it would tell the client a push succeeded that
 * may still fail (without a backup, the copies of one push run on different threads). */
typedef struct ps_dedup ps_dedup;
/* NULL when out of memory. */
ps_dedup *ps_dedup_create(uint32_t n_workers);
void ps_dedup_destroy(ps_dedup *d);
/* True when (worker, req_id) was applied before. While another caller holds it pending, waits
 * until that caller settles it, then answers for the settled state. Otherwise adds it as
 * pending, and the caller must settle it. Thread-safe. Ids out of range (worker >= n_workers,
 * req_id 0) are never held: false, nothing to settle. */
bool ps_dedup_check_add(ps_dedup *d, uint32_t worker, uint64_t req_id);
/* Settles a pending (worker, req_id) as applied: later resends are duplicates. */
void ps_dedup_done(ps_dedup *d, uint32_t worker, uint64_t req_id);
/* Forgets (worker, req_id): the push it named failed (or was only looked up), and a resend
 * must be tried again. */
void ps_dedup_remove(ps_dedup *d, uint32_t worker, uint64_t req_id);

/* Updates that arrived ahead of their predecessors, in sequence order. The server bounds it
 * (in sequence numbers and in bytes) before it puts an update in. */
typedef struct ps_replog_entry {
    uint64_t seq;
    size_t len;
    struct ps_replog_entry *next;
    uint8_t msg[]; /* one whole request: header and payload */
} ps_replog_entry;

typedef struct ps_replog {
    ps_replog_entry *head; /* ascending seq */
    size_t n, bytes;       /* entries, and the bytes of their messages */
} ps_replog;

/* Keeps a copy of msg under seq; false when out of memory. A seq already held is ignored
 * (true). */
bool ps_replog_put(ps_replog *l, uint64_t seq, const void *msg, size_t len);
/* True when seq is held. */
bool ps_replog_has(const ps_replog *l, uint64_t seq);
/* Removes and returns the lowest entry (caller frees), or NULL. */
ps_replog_entry *ps_replog_pop(ps_replog *l);
void ps_replog_clear(ps_replog *l);

#endif
