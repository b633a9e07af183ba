/*
 * embedding: the embedding store that each parameter-server shard keeps.
 *
 * Design
 * ------
 * A table maps a 64-bit feature key to a row. A row is a fixed-size record:
 *
 *     key (u64) | updates (u64) | last_step (u64) | weights[dim] (f32) | state[slots] (f32)
 *
 * `updates` counts optimizer steps applied to the row (it is also lazy Adam's per-row t);
 * `last_step` is the table step at which the row was last pulled or pushed (TTL eviction and
 * CLOCK use it). `state` holds the optimizer's slots: none for SGD, dim for Adagrad, 1 for
 * row-wise Adagrad, 2*dim for Adam (m then v) and FTRL (z then n).
 *
 * Keys are unbounded: rows live in open-addressing hash tables that grow (linear probing over
 * a capacity of any size, mapped with a multiply-shift of xxh3(key)), never key % size. The
 * table is split into sub-shards by the high bits of xxh3(key), each behind its own mutex; a
 * batched call groups its keys by sub-shard and takes each lock once.
 *
 * A key never seen is initialised from the key itself: weight j is uniform(-init_scale,
 * init_scale) drawn from xxh3(key, seed) and j, so a run is reproducible whatever the order in
 * which keys arrive or how they are sharded.
 *
 * Memory budget and spill: with mem_budget_bytes > 0 each sub-shard may hold at most
 * budget / n_sub bytes of hash table (capacity x (row bytes + 1 ctrl byte), exactly what is
 * allocated). RocksDB's own memory (memtables, index and filter blocks) is outside the budget
 * and reported apart (emb_table_stats.bytes_spill_mem). When a
 * sub-shard is full, a CLOCK sweep picks rows not touched since the last sweep and moves them
 * (whole records, bit for bit) into a RocksDB database at spill_path, then drops them from
 * memory. A pull of a spilled key reads it back with one batched MultiGet; a push reads it too,
 * but when the sub-shard has no free room it updates the row where it lies, in RocksDB, since
 * making room would mean writing rows out before the push is sure to succeed. Memory is
 * authoritative: a row's RocksDB copy counts only while the row is not in memory. Because records
 * move whole and the optimizer math does not depend on where a row lives, a table ten times its
 * budget ends a training sequence with exactly the rows the same table would have fully in memory.
 *
 * Admission (admit_threshold > 1): a key absent from the table is counted in a count-min
 * sketch each time it appears in a pull; only when its estimate reaches the threshold is the row
 * created. Until then a pull returns zeros and a push to it is dropped (both counted).
 * TTL (ttl_steps > 0): emb_table_expire drops rows whose last_step is more than ttl_steps
 * behind the table step, in memory and on disk. The table step advances by one per push call.
 * From ttl_steps 64 on, steps are counted in buckets of ttl_steps / 64 (a row goes once its
 * bucket is wholly more than ttl_steps behind: up to a bucket later, never sooner), so that a
 * sub-shard can keep its spilled rows' count per bucket in a ring of ~66 entries. With those
 * counts an expiry never reads or writes the spill store: it counts the spilled rows it drops,
 * and marks spill records stamped before the cut as expired, which every read then takes for
 * absent and RocksDB's compactions remove (emb_store_set_dead_below). Its cost is a walk of the
 * resident rows however much is spilled, one sub-shard locked at a time (the others serve calls
 * meanwhile), and a full disk cannot fail it.
 *
 * Snapshots: emb_table_snapshot pauses the table (all sub-shard locks, in order), writes every
 * row (in memory and spilled) to <dir>/rows.bin, the admission sketch's counts (with admission
 * on) to <dir>/sketch.bin, and a MANIFEST naming the config, step, row count and xxh3 of each
 * file, into a temporary directory that is fsync'd and renamed to dir.
 * emb_table_restore verifies every checksum and size before it builds anything, so a corrupted
 * or truncated snapshot is refused with an error naming the file and never half-loaded. A key
 * twice (a hand-made snapshot: the writer emits each row once, in no key order) can only be
 * seen while the rows load, memory or spill: the restore then refuses it naming the file and
 * the key, and frees the table it was building, so no caller ever holds one half loaded.
 *
 * Row stores: the two places a row can live (memory, rocksdb) implement one interface
 * (emb_store below, static ops tables inside); tests run one conformance suite over both.
 *
 * Thread safety: every emb_table_* call may be made from many threads at once, except
 * emb_table_destroy. A "memory" emb_store is not thread-safe; a
 * "rocksdb" one is.
 *
 * Errors: functions return 0 or a negative CM_* code (common/common.h) and store a message the
 * caller owns (free()) in *errptr when errptr is non-NULL. Library code never exits.
 */
#ifndef EMBER_EMBEDDING_H
#define EMBER_EMBEDDING_H

#include <stddef.h>
#include <stdint.h>

#include "common/common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EMB_MAX_DIM 4096u

typedef enum emb_opt_kind {
    EMB_OPT_SGD = 0,
    EMB_OPT_ADAGRAD = 1,         /* per-element accumulator */
    EMB_OPT_ADAGRAD_ROWWISE = 2, /* one accumulator per row: mean of squared grads */
    EMB_OPT_ADAM = 3,            /* lazy: only touched rows step, per-row t = updates */
    EMB_OPT_FTRL = 4,            /* FTRL-Proximal, per coordinate */
} emb_opt_kind;

/*
 * Optimizer update rules, applied per element to a pushed gradient g (float storage, double
 * arithmetic). For all but FTRL, g' = g + l2 * w first.
 *   sgd:              w -= lr * g'
 *   adagrad:          a += g'^2;           w -= lr * g' / (sqrt(a) + eps)
 *   adagrad_rowwise:  A += mean_j(g'_j^2); w -= lr * g' / (sqrt(A) + eps)
 *   adam:             t = updates + 1; m = b1 m + (1-b1) g'; v = b2 v + (1-b2) g'^2;
 *                     w -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
 *   ftrl (alpha=lr, beta=ftrl_beta, l1=ftrl_l1, l2=l2):
 *                     sigma = (sqrt(n + g^2) - sqrt(n)) / alpha; z += g - sigma w; n += g^2;
 *                     w = |z| <= l1 ? 0 : -(z - sgn(z) l1) / ((beta + sqrt(n)) / alpha + l2)
 *   A new FTRL row starts with n = 0 and z chosen so that w equals its initial value.
 * Adagrad accumulators start at adagrad_init.
 */

/* Parses "sgd", "adagrad", "adagrad_rowwise", "adam", "ftrl". 0 or CM_EINVAL. */
int emb_opt_parse(const char *name, emb_opt_kind *out);
/* Name of an optimizer kind (static string). */
const char *emb_opt_name(emb_opt_kind kind);

/* Everything that defines a table. Fill with emb_table_config_init, then override. */
typedef struct emb_table_config {
    /* model: must match across snapshot/restore */
    uint32_t dim;
    emb_opt_kind opt;
    float lr, l2;
    float eps;          /* adagrad, adam */
    float beta1, beta2; /* adam */
    float adagrad_init;
    float ftrl_beta, ftrl_l1;
    float init_scale; /* weights start uniform(-init_scale, init_scale); 0 gives zeros */
    uint64_t seed;
    /* storage: may differ between a snapshot and its restore */
    uint64_t mem_budget_bytes; /* 0 = unlimited (no spill) */
    const char *spill_path;    /* RocksDB directory; required when mem_budget_bytes > 0.
                                  Borrowed: copied by emb_table_create. Must not be in use. */
    uint32_t admit_threshold;  /* 0 or 1 = admit on first sight; at most 65535 */
    uint64_t ttl_steps;        /* 0 = never expire */
    uint32_t n_sub;            /* sub-shards (lock stripes), 1..4096; 0 = default (64) */
    /* Rows the table is expected to hold in memory; 0 = start small. The hash table is then
     * created at the capacity that holds them under its maximum load factor (capped by the
     * budget), so it never stops to double while they arrive: a doubling rehashes every row of
     * a sub-shard under its lock, and its old and new arrays briefly coexist. The capacity is
     * allocated at creation, and resident from then on where a sub-shard's block is 2 MiB or
     * more: reserve what the table would grow to anyway.
     * More rows than reserved still fit (it doubles). emb_table_config_check refuses a
     * reservation of more than 2^48 bytes. */
    uint64_t reserve_rows;
} emb_table_config;

/* Defaults: dim 16, adagrad, lr 0.05, l2 0, eps 1e-8, betas 0.9/0.999, adagrad_init 0,
 * ftrl_beta 1, ftrl_l1 0, init_scale 0.01, seed 0, unlimited memory, no admission, no TTL. */
void emb_table_config_init(emb_table_config *cfg);

/* Checks a config; 0 or CM_EINVAL with a message naming the bad field. */
int emb_table_config_check(const emb_table_config *cfg, char **errptr);

/* The first field of the model (dim, optimizer and its parameters, initializer, seed: what a
 * row's bytes and its updates depend on) in which a and b differ, as a static string ("dim",
 * "opt", ...), or NULL when they agree. Storage settings (memory, spill, admission, TTL,
 * sub-shards) are not compared. */
const char *emb_table_config_differs(const emb_table_config *a, const emb_table_config *b);

/* Optimizer slots (floats of state) per row for this config. */
uint32_t emb_row_slots(const emb_table_config *cfg);

/* Exact bytes one row takes in a record (what a row costs on disk and per hash slot). */
size_t emb_row_bytes(const emb_table_config *cfg);

/* Bytes a new table with this config allocates for its in-memory hash table at creation: the
 * capacity for reserve_rows (capped by the budget), or a small start without a reservation. */
uint64_t emb_table_initial_bytes(const emb_table_config *cfg);

/* Bytes of memory per resident row including the hash table's empty slots at its maximum
 * load factor: what a budget buys, row for row. A table that grew by doubling has more empty
 * slots than that (down to half the load): emb_table_plan gives what it really allocates. */
double emb_row_mem_bytes(const emb_table_config *cfg);

/* What a new table of this config holds once `rows` distinct keys have arrived (none expired):
 * where its rows are, and the memory its hash table has then allocated. */
typedef struct emb_table_plan {
    uint64_t rows_mem;     /* rows in memory, at most (a sub-shard at its budget evicts in
                              batches of 1/32 of its rows, so it holds up to that much less) */
    uint64_t rows_spilled; /* rows - rows_mem */
    /* Bytes the hash tables have allocated: each sub-shard's capacity is the reservation's or
     * has doubled from it until its share of the rows fits under the load factor, within the
     * budget. Keys spread over the sub-shards binomially, and this is the expectation over that
     * spread: emb_table_stats.bytes_mem will read within a few percent of it. */
    double bytes_mem;
} emb_table_plan;
void emb_table_plan_rows(const emb_table_config *cfg, uint64_t rows, emb_table_plan *out);

/* One row, as seen by emb_table_get_row and emb_table_foreach. weights and state point into
 * storage that is valid only for the duration of the call or callback. */
typedef struct emb_row {
    uint64_t key;
    uint64_t updates;
    uint64_t last_step;
    const float *weights; /* dim floats */
    const float *state;   /* emb_row_slots() floats */
} emb_row;

typedef struct emb_table emb_table;

/* Creates a table. On success *out is owned by the caller (emb_table_destroy). Fails with
 * CM_EINVAL on a bad config (dim 0 or > EMB_MAX_DIM, unknown optimizer, a budget smaller than
 * one row per sub-shard, no spill_path with a budget) and CM_EIO when the spill database cannot
 * be created. The spill database is private scratch: an existing one at spill_path is wiped, and
 * one that cannot be wiped whole (a file RocksDB cannot remove, a database in use) is CM_EIO
 * naming the path. */
int emb_table_create(const emb_table_config *cfg, emb_table **out, char **errptr);

/* Frees the table and removes its spill database (emb_store_drop): the spill directory goes
 * too when nothing else is in it, while files the table did not write stay where they are (a
 * spill_path may name a directory that holds other things). NULL is fine. */
void emb_table_destroy(emb_table *t);

/* The table's config (owned by the table). */
const emb_table_config *emb_table_get_config(const emb_table *t);

/* Reads weights of n keys into out (n * dim floats, caller's). Keys never seen are created
 * (initialised) unless admission holds them back, in which case their weights read as zero.
 * Duplicates are allowed. Advances no step, but marks each row touched at the current step. */
int emb_table_pull(emb_table *t, const uint64_t *keys, size_t n, float *out, char **errptr);

/* Applies one optimizer step per (key, gradient) pair: grads is n * dim floats. Duplicated
 * keys are applied in order, as separate steps. Keys not yet admitted are dropped and counted.
 * A non-finite gradient rejects the whole call with CM_EINVAL before any row changes. Advances
 * the table step by one.
 * All or nothing: when the push fails for any reason (an I/O error of the spill store, e.g. a
 * full disk: CM_EIO; out of memory), no row is created or changed and the step does not advance;
 * the message names the table's spill path and what failed. The same push may be sent again. */
int emb_table_push(emb_table *t, const uint64_t *keys, size_t n, const float *grads,
                   char **errptr);

/* Slot hints: a push usually names exactly the keys a pull served moments before, and finding
 * each key's row again costs a hash probe (a cache and TLB miss on a large table) per key.
 * emb_table_pull_hinted is emb_table_pull that also stores in hints[i] (n entries, caller's) where
 * keys[i]'s row sat when the pull was done with it, or EMB_NO_HINT. emb_table_push_hinted is
 * emb_table_push given those hints back: a hint is used only when its slot still holds that
 * key, else the key is looked up as usual, so stale hints (rows grown, evicted, spilled, expired
 * or replaced since; another table entirely) cost a probe and never change a result. */
#define EMB_NO_HINT UINT64_MAX
int emb_table_pull_hinted(emb_table *t, const uint64_t *keys, size_t n, float *out, uint64_t *hints,
                          char **errptr);
int emb_table_push_hinted(emb_table *t, const uint64_t *keys, size_t n, const float *grads,
                          const uint64_t *hints, char **errptr);

/* Reads the weights of n keys with no side effect: nothing is created, admitted or marked
 * touched, and spilled rows are read where they lie. A key the table does not hold reads as
 * zeros with found[i] = 0 (found may be NULL). This is what evaluation and serving see. */
int emb_table_lookup(emb_table *t, const uint64_t *keys, size_t n, float *out, uint8_t *found,
                     char **errptr);

/* Copies one row into *row; weights/state are copied into the caller's buffers (dim and
 * emb_row_slots floats). Returns CM_ENOTFOUND (no message) for a key the table does not hold;
 * never creates a row and does not mark it touched. */
int emb_table_get_row(emb_table *t, uint64_t key, emb_row *row, float *weights, float *state,
                      char **errptr);

/* Stores a whole row (weights, optimizer state, update count, last step) as given, replacing
 * any row the key had: for moving rows between tables (resharding) and for tests. A table with
 * TTL and a spill store refuses (CM_ECORRUPT) a row stamped after its step: set the step first
 * (emb_table_set_step). */
int emb_table_put_row(emb_table *t, const emb_row *row, char **errptr);

/* Lends the table a team of threads (borrowed: it must outlive the table, or be unset with
 * NULL first; common.h's cm_team): a pull or a push of an in-memory table with at least 2048
 * keys is then cut into parts of whole sub-shards run on the team beside the caller, which on
 * a many-core PS does a large batch several times sooner. The rows, the output and the stats
 * are the same bits as without the team. A fanned push holds every lock it needs from start to
 * end (snapshots still see it whole or not at all), so it does not overlap other calls on the
 * table; a push to a table with a spill store is never fanned out, nor is a pull of a table with
 * admission (its sketch is shared by the sub-shards, so the order of their groups decides which
 * keys are admitted). Not thread-safe: call it before the table is shared, or while no other
 * call is running on it. */
void emb_table_set_team(emb_table *t, cm_team *team);

/* Sets the table step (a resharded table continues from its old shards' step). */
void emb_table_set_step(emb_table *t, uint64_t step);

/* Calls cb once per stored row (memory and spilled), with the table paused (no concurrent
 * update). A non-zero return from cb stops the walk and is returned. */
typedef int (*emb_row_cb)(const emb_row *row, void *arg);
int emb_table_foreach(emb_table *t, emb_row_cb cb, void *arg, char **errptr);

/* Drops rows untouched for more than ttl_steps (in buckets from ttl 64 on: the design block);
 * *dropped (optional) gets the count. A no-op when ttl_steps is 0. Cannot fail (returns 0). */
int emb_table_expire(emb_table *t, uint64_t *dropped, char **errptr);

/* The table step (number of push calls so far, or as restored). */
uint64_t emb_table_step(const emb_table *t);

typedef struct emb_table_stats {
    uint64_t rows_mem;        /* rows resident in memory */
    uint64_t rows_spilled;    /* rows in the RocksDB spill */
    uint64_t bytes_mem;       /* hash-table bytes allocated (capacity x row bytes) */
    uint64_t bytes_budget;    /* mem_budget_bytes, 0 = unlimited */
    uint64_t row_bytes;       /* emb_row_bytes */
    uint64_t step;            /* table step */
    uint64_t pulls, pushes;   /* keys pulled and pushed */
    uint64_t created;         /* rows initialised */
    uint64_t admissions;      /* keys admitted by the sketch (admission on) */
    uint64_t admit_rejects;   /* pulled keys held back by admission */
    uint64_t push_dropped;    /* pushed keys dropped because not admitted */
    uint64_t spill_evictions; /* rows moved memory -> RocksDB */
    uint64_t spill_loads;     /* rows moved RocksDB -> memory */
    uint64_t ttl_evictions;   /* rows dropped by TTL */
    uint64_t bytes_spill_mem; /* memory the spill store holds beside the budget
                                 (emb_store_mem_bytes); 0 without a budget */
} emb_table_stats;

void emb_table_stats_get(emb_table *t, emb_table_stats *out);

/* Writes a consistent snapshot of the table into dir (created; an existing snapshot there is
 * replaced atomically). The table is paused for the duration. A dir that exists and is neither
 * empty nor a snapshot is refused (CM_EINVAL) and left alone. A dir that is a symbolic link is
 * followed: the snapshot replaces the directory it names, and the link stays. */
int emb_table_snapshot(emb_table *t, const char *dir, char **errptr);

/* Reads the model config stored in a snapshot's MANIFEST into *cfg (storage fields set to
 * defaults; spill_path NULL). Verifies the manifest's checksum. */
int emb_snapshot_read_config(const char *dir, emb_table_config *cfg, char **errptr);

/* The table step a snapshot was taken at (manifest verified). */
int emb_snapshot_step(const char *dir, uint64_t *step, char **errptr);

/* Snapshot files are read (and a snapshot writer's rows hashed) in chunks of this many bytes:
 * what emb_snapshot_foreach holds, one row more, however large the snapshot. */
#define EMB_SNAPSHOT_CHUNK (1u << 20)

/* Calls cb once per row of a snapshot without building a table (export). The manifest and
 * the rows file are verified in full before the first call. Memory: one chunk
 * (EMB_SNAPSHOT_CHUNK and a row), read twice (a verifying pass, then the calls). */
int emb_snapshot_foreach(const char *dir, emb_row_cb cb, void *arg, char **errptr);

/* The number of rows a snapshot holds (manifest verified, and rows.bin's size against it). */
int emb_snapshot_rows(const char *dir, uint64_t *rows, char **errptr);

/* Writing a snapshot row by row, with no table behind it (resharding: a table whose rows come
 * from other snapshots, and which built in memory would need their memory, or their spill's).
 * What it writes is what emb_table_snapshot writes for a table of cfg's model at `step`
 * holding exactly the rows added, in the order added, with admission sketch `sketch` (n
 * counters, borrowed until the commit; NULL for none, else a table's size: CM_EINVAL
 * otherwise). Rows are staged in a buffer of buf_bytes (at least one row is taken), appended to
 * a temporary directory beside dir whenever it fills, and hashed by reading them back at the
 * commit, which swaps the snapshot into dir as emb_table_snapshot does (dir: as there). The
 * writer keeps no file open between calls, so any number may be open at once. Memory: the
 * buffer and a few hundred bytes, and during the commit one chunk (EMB_SNAPSHOT_CHUNK) more to
 * hash the rows with. A row emb_table_snapshot would refuse (a weight not finite,
 * NaN state) is refused (CM_EINVAL naming the key). */
typedef struct emb_snapshot_writer emb_snapshot_writer;
int emb_snapshot_writer_open(const char *dir, const emb_table_config *cfg, uint64_t step,
                             const uint16_t *sketch, size_t n, size_t buf_bytes,
                             emb_snapshot_writer **out, char **errptr);
int emb_snapshot_writer_add(emb_snapshot_writer *w, const emb_row *row, char **errptr);
/* Writes the snapshot into dir and frees w, whether or not it succeeds (on failure dir is as
 * it was and the temporary directory is gone). */
int emb_snapshot_writer_commit(emb_snapshot_writer *w, char **errptr);
/* Removes what w wrote and frees it. NULL is fine. */
void emb_snapshot_writer_abort(emb_snapshot_writer *w);

/* Admission sketches across snapshots (resharding: one table's rows from several shards).
 * Count-min sketches of one width, depth and hashing are additive: the sum of the shards'
 * sketches counts every key at least as often as its own shard's did (the count-min
 * contract: estimates never fall short), so keys keep the sightings they had.
 * emb_snapshot_sketch_add adds dir's sketch.bin (verified against its MANIFEST) into *acc,
 * counter by counter, saturating; the first sketch allocates *acc (n counters into *n, the
 * caller frees *acc). A snapshot without a sketch adds nothing. A sketch of another size than
 * *acc's is refused (CM_EINVAL naming the file and both sizes). */
int emb_snapshot_sketch_add(const char *dir, uint16_t **acc, size_t *n, char **errptr);
/* Replaces a table's admission sketch with n counters (before the table is used). CM_EINVAL,
 * nothing changed, when the table has no sketch (admission off) or one of another size. */
int emb_table_set_sketch(emb_table *t, const uint16_t *counts, size_t n, char **errptr);

/* Builds a new table from a snapshot: the model part of cfg must equal the snapshot's (else
 * CM_EINVAL naming the field); the storage part (budget, spill path, admission, ttl, n_sub) is
 * taken from cfg. Every file is verified before any row is loaded (CM_ECORRUPT naming the file).
 * On success *out is the caller's. */
int emb_table_restore(const char *dir, const emb_table_config *cfg, emb_table **out,
                      char **errptr);

/*
 * Row stores. A store holds whole row records (emb_row_bytes each, laid out as in the design
 * block) by key. "memory" is an open-addressing hash table; "rocksdb" a RocksDB database.
 * A "memory" handle is not thread-safe; a "rocksdb" handle is (RocksDB's own guarantee).
 */
typedef struct emb_store emb_store;

/* kind: "memory" or "rocksdb"; path is used by rocksdb only (created, wiped if present; a
 * failed wipe is CM_EIO naming the path).
 * record_bytes >= 8 (the first 8 bytes of a record are its key). */
int emb_store_create(const char *kind, const char *path, size_t record_bytes, emb_store **out,
                     char **errptr);
/* Frees the store and keeps what it wrote: a "rocksdb" store's database stays at its path (an
 * export writes one this way). NULL is fine. */
void emb_store_destroy(emb_store *s);
/* Frees the store and removes what it wrote: for "rocksdb", RocksDB's own files at its path,
 * then the directory when that leaves it empty. Other files there are not the store's and
 * stay, and so does the directory holding them. The store is freed even when the removal
 * fails (CM_EIO naming the path). NULL is fine. */
int emb_store_drop(emb_store *s, char **errptr);
const char *emb_store_kind(const emb_store *s);
/* For each of n keys copies its record into recs + i*record_bytes and sets found[i] to 1, or
 * sets found[i] to 0 and leaves that record untouched. */
int emb_store_get(emb_store *s, const uint64_t *keys, size_t n, void *recs, uint8_t *found,
                  char **errptr);
/* Inserts or replaces n records (each carries its key). */
int emb_store_put(emb_store *s, const void *recs, size_t n, char **errptr);
/* Deletes n keys; absent keys are fine. */
int emb_store_del(emb_store *s, const uint64_t *keys, size_t n, char **errptr);
/* Number of records held. */
uint64_t emb_store_count(const emb_store *s);
/* The most records of record_bytes a "memory" store holds without its emb_store_mem_bytes
 * exceeding `bytes` (its hash table doubles as it fills, and while it doubles the old half-size
 * table is briefly held beside the new one); 0 when not even the smallest table fits. A caller
 * keeping a store under this many records keeps it within `bytes`. */
uint64_t emb_store_mem_max_records(size_t record_bytes, uint64_t bytes);
/* Bytes of memory the store holds: "memory" its hash table; "rocksdb" its memtables and the
 * index and filter blocks of its open tables, by RocksDB's own estimates (its data blocks are
 * read through mmap, as page cache, and are not counted). */
uint64_t emb_store_mem_bytes(const emb_store *s);
/* Calls cb(record, arg) for every record, in no particular order; non-zero stops and returns. */
typedef int (*emb_record_cb)(const void *record, void *arg);
int emb_store_foreach(emb_store *s, emb_record_cb cb, void *arg, char **errptr);
/* Records whose last_step (bytes 16..24 of a record, as in the design block) is below `step`
 * are expired from now on: the store removes them, "memory" at once, "rocksdb" as its
 * compactions rewrite the files that hold them, so get and foreach may still return one
 * until then (a table takes them for absent itself). The mark only rises; a lower one is
 * ignored, and so is any on records under 24 bytes. Two calls must not overlap (a table makes
 * them under its expiry lock), and on a "memory" store no other call may overlap one either.
 * CM_OK, or CM_ENOMEM ("memory" only). */
int emb_store_set_dead_below(emb_store *s, uint64_t step, char **errptr);
/* Rewrites the store's files now ("rocksdb": a full compaction, which removes expired
 * records; "memory": nothing). CM_OK or CM_EIO naming the database. */
int emb_store_compact(emb_store *s, char **errptr);

/*
 * Writing a "rocksdb" store's database once, from records in any order, in bounded memory (an
 * export of a table larger than memory). A store's puts go through RocksDB's memtables and
 * compactions, tuned for the spill: its memory grows with the rows (memtables, open tables'
 * filters, compaction inputs read through mmap). The writer instead sorts the records itself
 * in runs of its budget, spilled to scratch files in the database's folder (unlinked as made:
 * nothing stays, whatever happens), merges them (in several passes when there are too many runs
 * to read back 4 KiB at a time each) into sorted table files, cut to a size whose filter and
 * index fit the budget, and hands those to RocksDB whole (IngestExternalFile): no memtable, no
 * compaction, every table file at the last level. Memory: the budget given, however many
 * records, besides RocksDB's own fixed overhead while the database is open at the end; disk:
 * twice the records at most (the runs beside the longer runs a pass merges them into, or
 * beside the table files). Not thread-safe: one call at a time.
 * What it writes is what a "rocksdb" store (emb_store_create) holds after emb_store_put of the
 * same records: key = the record's key as 8 big-endian bytes, value = the whole record, the
 * same table format, no compression; a database any RocksDB reader opens as usual.
 */
typedef struct emb_store_writer emb_store_writer;
/* The least budget a writer of record_bytes records takes: 16 read buffers of 4 KiB (or of
 * one record, when larger) and a little, ~66 KiB for records up to 4 KiB. */
uint64_t emb_store_writer_least(size_t record_bytes);
/* A writer of a database at path (created; a RocksDB database there is removed first, as
 * emb_store_create does) holding at most mem bytes (CM_EINVAL naming emb_store_writer_least
 * when that is too little). record_bytes >= 8 (the first 8 bytes of a record are its key).
 * *out is the caller's (emb_store_writer_close). */
int emb_store_writer_open(const char *path, size_t record_bytes, uint64_t mem,
                          emb_store_writer **out, char **errptr);
/* Adds n records (recs: n x record_bytes, borrowed for the call). */
int emb_store_writer_add(emb_store_writer *w, const void *recs, size_t n, char **errptr);
/* After the last add: writes the database. Once. A key added twice is refused ("key K
 * twice", CM_EINVAL; emb_store_writer_twice names it), here or by the add that sorted both
 * into one run, and nothing is written. */
int emb_store_writer_finish(emb_store_writer *w, char **errptr);
/* 1 with the key in *key when a key added twice was refused, else 0. */
int emb_store_writer_twice(const emb_store_writer *w, uint64_t *key);
/* Frees the writer. Unless finish succeeded, what it wrote at path goes too (RocksDB's files
 * and its own; the folder when that leaves it empty). NULL is fine. */
void emb_store_writer_close(emb_store_writer *w);

#ifdef __cplusplus
}
#endif
#endif
