/*
 * Private to ps/: a dense parameter block (e.g. an MLP's weights) held by one shard and
 * updated there by its optimizer. A block is uninitialised until the first INIT_DENSE (workers
 * race; the first one's values win) and reads as zeros until then.
 */
#ifndef EMBER_PS_DENSE_H
#define EMBER_PS_DENSE_H

#include "ps/ps.h"

typedef struct ps_dense ps_dense;

int ps_dense_create(const ps_dense_spec *spec, ps_dense **out, char **errptr);
void ps_dense_destroy(ps_dense *d);
/* Copies the values (spec->size floats) into out. Thread-safe. */
void ps_dense_pull(ps_dense *d, float *out);
/* One optimizer step with gradient g (spec->size floats). Thread-safe. */
void ps_dense_push(ps_dense *d, const float *g);
/* The same step, and what ps_dense_pull and ps_dense_digest would say right after it, in the
 * same pass and under the same lock: the values into out, their xxh3 into *digest, the step
 * into *step (each optional: NULL). */
void ps_dense_push_read(ps_dense *d, const float *g, float *out, uint64_t *digest, uint64_t *step);
/* Assigns values unless already initialised; returns 1 when assigned, 0 otherwise. */
int ps_dense_init(ps_dense *d, const float *values);
/* Writes/reads the block (values, optimizer state, step) as one checksummed file. load builds
 * a new block and fails with CM_ECORRUPT naming the file on any mismatch. */
int ps_dense_save(ps_dense *d, const char *path, char **errptr);
int ps_dense_load(const char *path, const ps_dense_spec *spec, ps_dense **out, char **errptr);

/* The block's whole state as PULL_DENSE with PS_FLAG_STATE carries it: u64 step, values,
 * then the optimizer's slots; state_bytes is its length for a spec. get copies it out under
 * the lock; set replaces the block's state with it (len must be state_bytes: CM_ECORRUPT
 * otherwise) and marks it initialised. */
size_t ps_dense_state_bytes(const ps_dense_spec *spec);
void ps_dense_state_get(ps_dense *d, uint8_t *out);
int ps_dense_state_set(ps_dense *d, const uint8_t *in, size_t len, char **errptr);
/* xxh3-64 of the values and the optimizer step, read together under the lock. */
uint64_t ps_dense_digest(ps_dense *d, uint64_t *step);

/* Reads only the values of a saved block (any size and optimizer), verified. */
int ps_dense_read_values(const char *path, float **values, uint64_t *n, char **errptr);

#endif
