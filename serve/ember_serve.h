/*
 * ember_serve: trained embeddings and the dense tower, served from a memory-mapped bundle.
 *
 * Design
 * ------
 * A bundle is a directory written by `ember export`:
 *   MANIFEST          "name value" lines: type (full|delta), step, base_step, precision,
 *                     source (and for a delta base_source: digests of the checkpoint contents
 *                     it was taken from and against), one "file NAME SIZE XXH3" per file, one
 *                     "table NAME DIM ROWS" per table, and last "checksum XXH3" over every
 *                     byte before it.
 *   model.txt         the model's shape (kind, fields, dense, dim, hidden, bottom, seed, pool).
 *   dense-tower.bin   {magic "EMBSDNS1", u32 version, u32 0, u64 n} n floats, xxh3 trailer.
 *   table-NAME.bin    a 64-byte header {magic "EMBSTAB1", u32 version, dim, precision,
 *                     row_bytes, u64 rows, slots, deleted, step, 8 reserved bytes}, then an
 *                     open-addressing index of `slots` (a power of two) 16-byte entries
 *                     {u64 key, u32 row (UINT32_MAX = empty), u32 0} probed linearly from
 *                     xxh3(key), then the rows (fp32; fp16; or int8 after a per-row fp32
 *                     scale), then `deleted` sorted u64 keys (delta bundles: rows removed since
 *                     the base), then the xxh3 of everything before it.
 * Opening maps the files and verifies every size and checksum: there is no load step, and a
 * damaged bundle is refused with an error naming the file.
 *
 * Deltas: ember_serve_apply_delta stacks a delta bundle (rows changed since a base checkpoint,
 * rows deleted, the new dense tower) on an open handle; lookups consult the newest delta first.
 * A base plus its deltas serves exactly what a full export of the newest checkpoint serves.
 *
 * A key the bundle does not hold reads as zeros (the same convention evaluation uses in
 * training, so predictions match the trainer's).
 *
 * Concurrency: after open (and any apply_delta), lookup and predict may be called from any
 * number of threads at once: they only read the mappings, and each predict call works in a
 * scratch of its own (the CPU backend's state and the batch's staging), taken from the handle's
 * idle ones (or made) and given back: made once, not per call (its allocations, and its page
 * faults where the allocator returns the memory, on every call). A handle so keeps as many
 * scratches as predict calls have run on it at once, each sized for the largest batch it has
 * taken (the forward pass touches ~B x (the tower's input width + its layers' widths) floats
 * of a B-row one), until close. A scratch changes no bit of a result: the backend cuts its work
 * by the batch alone. Beside them the handle keeps one copy of the newest tower laid out for
 * the backend's kernels (the mlp preset's: 573 KiB), made by open and apply_delta and read by
 * every call at once. apply_delta and close must not run concurrently with anything else on
 * the handle. Opening a bundle (or applying a delta) that an export is replacing meanwhile gets
 * the old one or the new one, whole.
 *
 * Threads: predict runs on the calling thread and leaves OpenBLAS's thread count, which is
 * process-wide, as the program has it (every call set it to 1 before: a program running
 * OpenBLAS on several threads for its own work lost them). Setting it for the call and putting
 * it back after is no way out: concurrent predicts, and the program's own threads, would set
 * and restore the one global over each other. Where ember's own GEMM runs (CPUs with AVX-512)
 * predict calls OpenBLAS only where that GEMM runs out of memory, and the count changes no
 * bit. Elsewhere its GEMMs are OpenBLAS's: on one OpenBLAS thread (OPENBLAS_NUM_THREADS=1,
 * openblas_set_num_threads(1); `ember predict` sets it) they give the trainer's bits; on more
 * OpenBLAS may split a GEMM over them and sum in another order (as correct, not the same
 * bits).
 *
 * Speed: predict's tower runs on ember's own GEMM where the CPU has AVX-512 or AVX2 (the
 * trainer's: the same bits), else on OpenBLAS, whose kernels are chosen when the library loads. The
 * tower's weights are laid out for those kernels once, by open and apply_delta: a training
 * step lays them out on every call (its weights change every step), which was ~60% of
 * predict's time for one-row batches and ~35% for 16 rows (OpenBLAS packs inside its own
 * calls, so there only the factorized first layer's blocks are laid out ahead). A
 * DYNAMIC_ARCH OpenBLAS that does not know the CPU falls back to SSE3 kernels (Debian 12's
 * 0.3.21 on a Sapphire Rapids: ~4.5x slower GEMMs); `ember predict` fixes that by itself, a
 * program linking this library should set OPENBLAS_CORETYPE (`ember version` names the
 * kernels to use) in the environment it starts with.
 *
 * Errors: 0 or a negative code, with a message the caller owns (free()) in *errptr.
 */
#ifndef EMBER_SERVE_H
#define EMBER_SERVE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ember_serve ember_serve;

/* Maps and verifies a full bundle. *out is the caller's (ember_serve_close). */
int ember_serve_open(const char *bundle, ember_serve **out, char **errptr);
/* Stacks a delta bundle whose base_step equals the handle's current step (and, where both
 * carry one, whose base source equals the handle's current source), of the base's precision. */
int ember_serve_apply_delta(ember_serve *h, const char *delta, char **errptr);
/* Unmaps everything. NULL is fine. */
void ember_serve_close(ember_serve *h);

/* The training step of the newest bundle applied. */
uint64_t ember_serve_step(const ember_serve *h);
/* The model config text (model.txt), owned by the handle. */
const char *ember_serve_model(const ember_serve *h);
/* Index of a table by name ("emb", "lin"), or -1. */
int ember_serve_table(const ember_serve *h, const char *name);
uint32_t ember_serve_table_dim(const ember_serve *h, int table);
/* Rows in the base bundle's table (deltas not counted). */
uint64_t ember_serve_table_rows(const ember_serve *h, int table);

/* Rows of n keys as fp32 into out (n * dim, caller's); absent keys read as zeros and get
 * found[i] = 0 (found may be NULL). */
int ember_serve_lookup(const ember_serve *h, int table, const uint64_t *keys, size_t n,
                       float *out, uint8_t *found);

/* Raw rows to score, in the layout `ember ingest` shards hold (datasets' ds_batch): keys of
 * row r, field f at keys[offsets[r*n_fields+f] .. offsets[r*n_fields+f+1]). All borrowed. */
typedef struct ember_serve_batch {
    uint32_t n_rows, n_dense, n_fields;
    const float *dense;      /* n_rows x n_dense, raw (the model applies its own transform) */
    const uint32_t *offsets; /* n_rows * n_fields + 1 */
    const uint64_t *keys;
    const float *weights; /* per key, or NULL */
} ember_serve_batch;

/* Click probabilities for every row into out (n_rows floats, caller's). Offsets that do not
 * start at 0 or that go back are refused (CM_EINVAL, naming the row and field). */
int ember_serve_predict(const ember_serve *h, const ember_serve_batch *b, float *out,
                        char **errptr);

/* ---- writing (ember export) ---- */

typedef enum ember_serve_precision {
    EMBER_SERVE_FP32 = 0,
    EMBER_SERVE_FP16 = 1,
    EMBER_SERVE_INT8 = 2,
} ember_serve_precision;

/* "fp32", "fp16", "int8". 0 or -1. */
int ember_serve_precision_parse(const char *name, ember_serve_precision *out);

typedef struct ember_serve_writer ember_serve_writer;

/* Starts a bundle at dir (built in "<dir>.tmp-<pid>-<n>", swapped into place by commit: exports
 * into one dir at once each finish, the last to commit in place; one killed leaves its folder
 * behind). A delta names the step of the checkpoint it is relative to. */
int ember_serve_writer_create(const char *dir, ember_serve_precision precision, int delta,
                              uint64_t step, uint64_t base_step, ember_serve_writer **out,
                              char **errptr);
/* What the bundle holds, as a digest of the checkpoint content it was taken from (source),
 * and for a delta the digest of the base checkpoint it was taken against (base_source):
 * apply_delta stacks a delta only on a handle that serves exactly that base. Without it a
 * delta of another run at the same step (same model text) would stack on the wrong base.
 * Optional: bundles without it are stacked by step and model alone. */
int ember_serve_writer_source(ember_serve_writer *w, uint64_t source, uint64_t base_source,
                              char **errptr);
/* The memory a table's index may take while it is written (cm_keyidx, common.h): from the next
 * table begun on; EMBER_SERVE_INDEX_MEMORY_DEFAULT until set. Less only spreads the keys of a
 * large table over more sorted runs in a scratch file beside the bundle (16 bytes a key); a
 * table whose index needs more than that (cm_keyidx_least: ~15 MiB for 10^9 rows) is refused
 * by _table_begin saying how much. The bundle is the same whatever the budget. */
#define EMBER_SERVE_INDEX_MEMORY_DEFAULT (256ull << 20)
void ember_serve_writer_memory(ember_serve_writer *w, uint64_t bytes);
/* The folder the bundle is written in before commit puts it in place: a caller's scratch
 * files go in a folder of their own under it, removed with the bundle's when it is aborted
 * (and by the caller before commit: what is left then is in the bundle). */
const char *ember_serve_writer_scratch(const ember_serve_writer *w);
int ember_serve_writer_model(ember_serve_writer *w, const char *model_text, char **errptr);
int ember_serve_writer_dense(ember_serve_writer *w, const float *values, uint64_t n,
                             char **errptr);
/* One table, streamed: begin with at most max_rows rows (the file is sized, and its index made,
 * for that many: a table of fewer rows has a sparser index than it needs), add the rows (keys
 * unique, dim fp32 values each, converted to the bundle's precision) in any number of calls,
 * end with the deleted keys (delta bundles: removed from what the base serves), ascending.
 * The writer holds a chunk of rows and the index's memory budget (ember_serve_writer_memory),
 * never the table: rows go to the file as they come, the index's keys to sorted runs on disk
 * when they do not fit, and the index is written in order at _end (cm_keyidx, common.h), so a
 * table larger than memory is written.
 * A key twice is refused (CM_EINVAL) by _rows or _end, whichever finds it, and
 * ember_serve_writer_table_dup names it. After a failure the table is dropped (the bundle can
 * still be aborted, or committed without it). */
int ember_serve_writer_table_begin(ember_serve_writer *w, const char *name, uint32_t dim,
                                   uint64_t max_rows, char **errptr);
int ember_serve_writer_table_rows(ember_serve_writer *w, const uint64_t *keys, const float *rows,
                                  uint64_t n, char **errptr);
int ember_serve_writer_table_end(ember_serve_writer *w, const uint64_t *deleted, uint64_t n_deleted,
                                 char **errptr);
/* Deleted keys of the table begun, after its last rows and before _end, in any number of calls:
 * ascending across them all (and _end's after them). For more keys than are held at once. */
int ember_serve_writer_table_deleted(ember_serve_writer *w, const uint64_t *deleted, uint64_t n,
                                     char **errptr);
/* 1 with the key in *key when the last table begun was refused for a key twice, else 0. */
int ember_serve_writer_table_dup(const ember_serve_writer *w, uint64_t *key);
/* One table at once (begin, rows, end): n rows, deleted keys in any order. */
int ember_serve_writer_table(ember_serve_writer *w, const char *name, uint32_t dim,
                             const uint64_t *keys, const float *rows, uint64_t n,
                             const uint64_t *deleted, uint64_t n_deleted, char **errptr);
/* Writes the MANIFEST and puts the bundle in place; releases w either way. A bundle without
 * the model, the dense tower or a table (each written once) is refused, nothing put in place. */
int ember_serve_writer_commit(ember_serve_writer *w, char **errptr);
void ember_serve_writer_abort(ember_serve_writer *w);

#ifdef __cplusplus
}
#endif
#endif
