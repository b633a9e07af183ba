/*
 * Private to ps/: the int8 error-feedback residuals of a client (ps_client_push), and their file
 * (ps_client_residuals_save).
 *
 * Each table that pushes int8 has a ps_resid: a "memory" emb_store (created on the first push,
 * NULL until then and again after ps_resid_clear) of records laid out like a table's, so the
 * store's own expiry can drop them: {u64 key, u64 0, u64 stamp, dim f32}, padded to 8 bytes.
 * The stamp is the table's push clock (pushes of it so far, in this client's order) at the
 * record's last push.
 *
 * Bounded: a client is given bytes for its residuals (ps_client_opts.resid_memory), shared
 * evenly by its int8 tables. A table whose next push might pass its share first drops the rows
 * stamped longest ago, down to three quarters of what the share holds, so the walk that finds
 * them runs once per quarter of the share's rows, not per push. A dropped residual is at most
 * half an int8 step of a row's gradient that is never sent: the price of the bound, paid by
 * the rows pushed least recently. Which rows go depends only on the stamps, and the stamps
 * and clock are in the file, so a resumed run drops exactly what an uninterrupted one does.
 *
 * File, host byte order like the PS's own checkpoint files:
 *   header   {magic "EMBRESD1", u32 version (2), u32 worker, u32 n_tables, u32 0}
 *   n_tables x {name[PS_NAME_MAX] (NUL-padded), u32 table id, u32 dim, u64 rows, u64 clock,
 *               rows x {u64 key, u64 stamp, dim f32} packed, keys strictly ascending,
 *               stamps at most clock}
 * Version 1 (before the bound) had no clock and no stamps; it is read with both 0.
 * One section per table the config pushes int8, in id order, empty ones included, so a load
 * can tell a file of another configuration from one of a worker that had pushed nothing. Keys
 * ascending make the bytes a function of the residuals alone, not of the hash table's history
 * (a resumed run's checkpoint is then the same file as an uninterrupted one's).
 */
#ifndef EMBER_PS_RESIDUAL_H
#define EMBER_PS_RESIDUAL_H

#include "ps/ps.h"

/* A table's residuals and their bound. */
typedef struct ps_resid {
    emb_store *st;     /* NULL until the table's first int8 push */
    uint64_t clock;    /* the table's pushes so far: the newest records' stamp */
    uint64_t max_rows; /* the bound: 0 none */
    uint64_t dropped;  /* rows dropped to keep to it, over the client's life */
} ps_resid;

/* Where a record's stamp and floats start. */
#define PS_RESID_STAMP 16u
#define PS_RESID_FLOATS 24u
/* Bytes of one stored record of a dim-wide table. */
size_t ps_resid_rec_bytes(uint32_t dim);
/* Sets each int8 table's max_rows from the client's budget (ps_client_opts.resid_memory: 0 the
 * default, UINT64_MAX none, which max_rows 0 says). */
void ps_resid_bound(ps_resid *r, const ps_config *cfg, uint64_t resid_memory);
/* Stores one push's n records (distinct keys, stamped with r->clock) in r, creating its store
 * when NULL, within its bound: when the rows held plus n would pass it, the rows stamped
 * longest ago go first (every row of the oldest stamps taken), down to three quarters of the
 * bound or to the bound less n, whichever is lower, so the store never grows past the bound
 * even for a moment. A push of more rows than the bound keeps only its first max_rows records
 * (the rest count as dropped). */
int ps_resid_put(ps_resid *r, uint32_t dim, const void *recs, size_t n, char **errptr);
/* Drops every table's residuals (rs[PS_MAX_TABLES]: stores freed and NULL, clocks 0; bounds and
 * dropped counts stay). Allocates nothing, so it cannot fail. */
void ps_resid_clear(ps_resid *rs);
/* Writes the residuals of cfg's int8 tables (rs indexed by table id) to path, atomically.
 * Nothing is written, CM_OK, when no table pushes int8. */
int ps_resid_save(const ps_resid *rs, const ps_config *cfg, uint32_t worker, const char *path,
                  char **errptr);
/* Replaces rs's contents with path's (see ps_client_residuals_load), each table then kept to
 * its bound; on error they are left empty. */
int ps_resid_load(ps_resid *rs, const ps_config *cfg, uint32_t worker, const char *path,
                  char **errptr);

#endif
