/*
 * Private to ps/: the int8 error-feedback residuals of a client (ps_client_push), one "memory"
 * emb_store per table that pushes int8, created on the first push (NULL until then, and again
 * after ps_resid_clear), holding records {u64 key, dim f32} padded to 8 bytes; and their file
 * (ps_client_residuals_save).
 *
 * File, host byte order like the PS's own checkpoint files:
 *   header   {magic "EMBRESD1", u32 version, u32 worker, u32 n_tables, u32 0}
 *   n_tables x {name[PS_NAME_MAX] (NUL-padded), u32 table id, u32 dim, u64 rows,
 *               rows x {u64 key, dim f32} packed, keys strictly ascending}
 *   trailer  u64 xxh3-64 of every byte before it
 * One section per table the config pushes int8, in id order, empty ones included, so a load
 * can tell a file of another configuration from one of a worker that had pushed nothing. Keys
 * ascending make the bytes a function of the residuals alone, not of the hash table's history
 * (a resumed run's checkpoint is then the same file as an uninterrupted one's).
 */
#ifndef EMBER_PS_RESIDUAL_H
#define EMBER_PS_RESIDUAL_H

#include "ps/ps.h"

/* Bytes of one stored record of a dim-wide table. */
size_t ps_resid_rec_bytes(uint32_t dim);
/* *slot, the table's store, created empty when NULL. */
int ps_resid_store(emb_store **slot, uint32_t dim, char **errptr);
/* Drops every table's residuals (stores[PS_MAX_TABLES], each left NULL). Allocates nothing, so
 * it cannot fail. */
void ps_resid_clear(emb_store **stores);
/* Writes the residuals of cfg's int8 tables (stores indexed by table id) to path, atomically.
 * Nothing is written, CM_OK, when no table pushes int8. */
int ps_resid_save(emb_store *const *stores, const ps_config *cfg, uint32_t worker, const char *path,
                  char **errptr);
/* Replaces stores' contents with path's (see ps_client_residuals_load); on error they are
 * left empty. */
int ps_resid_load(emb_store **stores, const ps_config *cfg, uint32_t worker, const char *path,
                  char **errptr);

#endif
