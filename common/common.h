/*
 * common: the few primitives every ember module shares.
 *
 * Errors follow the RocksDB C API: a function returns 0 on success or a negative code, and on
 * failure stores a heap-allocated message in *errptr (freeing any message already there). The
 * caller owns that message and releases it with free(). errptr may be NULL when the caller
 * does not want the text.
 *
 * Files are written the Redis rdb.c way: into a temporary file beside the target, fsync'd, then
 * renamed over the target and the directory fsync'd, so a reader sees either the old file or
 * the complete new one, never a prefix. cm_afile hashes everything written with xxh3-64 so the
 * caller can record the checksum in a trailer or manifest without a second pass.
 */
#ifndef EMBER_COMMON_H
#define EMBER_COMMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    CM_OK = 0,
    CM_ERR = -1,       /* generic failure */
    CM_EINVAL = -2,    /* bad argument or configuration */
    CM_EIO = -3,       /* operating-system I/O failure */
    CM_ECORRUPT = -4,  /* data failed a magic, version, size or checksum check */
    CM_ENOMEM = -5,    /* allocation failed */
    CM_ENOTFOUND = -6, /* a named file or object does not exist */
    CM_ECANCELED = -7, /* abandoned on request (ps_client_abort) */
};

/* Formats a message into *errptr (if errptr is non-NULL) and returns code. */
int cm_err(char **errptr, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* An AVX2 copy of a function besides the baseline one, picked at load time. Not under
 * ThreadSanitizer: it instruments the picking function (an ifunc resolver), which the dynamic
 * loader runs while relocating, before the TSan runtime is set up, and every program then
 * crashes at startup. */
#if defined(__SANITIZE_THREAD__)
#define CM_CLONES_AVX2
#else
#define CM_CLONES_AVX2 __attribute__((target_clones("avx2", "default")))
#endif

/* sqrtf without errno: GCC then vectorises it (the result is the same correctly rounded value).
 * Clang has no per-function optimize attribute and warns about it: none there. */
#if defined(__GNUC__) && !defined(__clang__)
#define CM_NO_MATH_ERRNO __attribute__((optimize("no-math-errno")))
#else
#define CM_NO_MATH_ERRNO
#endif

/* Like cm_err, appending ": strerror(errno)" (errno read at entry). */
int cm_err_errno(char **errptr, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* For clang's static analyzer only (tools/analyze runs its checks through clang-tidy): it
 * sees each translation unit alone, and without this it takes an error branch's
 * `rc = cm_err(errptr, CM_ENOMEM, ...)` to possibly return CM_OK, then walks on into the
 * success path with the NULL it just failed to allocate: ~60 false reports a run. The
 * definitions in common/err.c name the functions in parentheses, so these do not expand there. */
#ifdef __clang_analyzer__
#define cm_err(errptr, code, ...) ((void)cm_err(errptr, code, __VA_ARGS__), (int)(code))
#define cm_err_errno(errptr, code, ...) ((void)cm_err_errno(errptr, code, __VA_ARGS__), (int)(code))
#endif

/* xxh3-64 of a buffer with seed 0: the checksum every ember file and message uses. */
uint64_t cm_xxh3(const void *buf, size_t len);

/* IEEE half and bfloat16, rounding to nearest even; NaN stays NaN, overflow goes to inf. */
uint16_t cm_f32_to_f16(float f);
float cm_f16_to_f32(uint16_t h);
uint16_t cm_f32_to_bf16(float f);
float cm_bf16_to_f32(uint16_t h);
/* n values at a time, bit for bit what the one-value functions give (a NaN decodes quiet, and
 * encodes to the quiet NaN 0x7e00 with its sign): with F16C where the CPU has it, else the
 * _scalar loops, which stay public so tests can hold the two paths equal. The halves are n
 * little-endian pairs of bytes at any alignment (a wire payload); src and dst do not overlap. */
void cm_f32_to_f16_n(const float *src, void *dst, size_t n);
void cm_f16_to_f32_n(const void *src, float *dst, size_t n);
void cm_f32_to_f16_n_scalar(const float *src, void *dst, size_t n);
void cm_f16_to_f32_n_scalar(const void *src, float *dst, size_t n);

/* Index of the first non-finite of n floats, n when all are finite; vectorised for the common
 * case (all finite): gradients are checked on every push. */
size_t cm_f32_first_nonfinite(const float *x, size_t n);
/* Copies n floats from src to dst (not overlapping) and returns the index of the first
 * non-finite, n when all are finite: one pass over the data where a copy and a check would make
 * two (a pulled batch is ~1 MB, past the caches). */
size_t cm_f32_copy_first_nonfinite(float *dst, const void *src, size_t n);

/* C (M x N, leading dimension ldc) = op(A) op(B), op(X) = X or X^T by ta / tb, row-major like
 * cblas_sgemm with alpha 1 and beta 0: A is M x K (K x M when ta), B is K x N (N x K when tb).
 * Every value of A and B is rounded to bfloat16 (as cm_f32_to_bf16) and the products are summed
 * in fp32 on AMX tiles, in an order fixed by the shape: the same inputs give the same bits on
 * any thread. Packing scratch is the calling thread's own (kept until it exits). Returns 0,
 * CM_EINVAL where cm_gemm_bf16_available() is 0 (C untouched), or CM_ENOMEM. */
int cm_gemm_bf16(int ta, int tb, int M, int N, int K, const float *A, int lda, const float *B,
                 int ldb, float *C, int ldc);
/* 1 when this CPU has AMX-BF16 and the OS grants the process its tile state (asked once). */
int cm_gemm_bf16_available(void);
/* One operand packed once for several cm_gemm_bf16_pre calls that share it (a GEMM cut into
 * row or column tiles, or into chunks of K): cm_gemm_bf16_packed_size(rows, K) bytes (64-byte
 * aligned) hold op(A) (b 0, rows = M) or op(B) (b 1, rows = N, the columns of op(B)) over inner
 * indexes [0, K). cm_gemm_bf16_pack fills rows [r0, r1) of it (r0 a multiple of 32, r1 a
 * multiple of 32 or >= rows), so that threads can share the packing; X, ld, trans as A, lda, ta
 * (or B, ldb, tb) of cm_gemm_bf16. Does nothing where cm_gemm_bf16_available() is 0. */
size_t cm_gemm_bf16_packed_size(int rows, int K);
void cm_gemm_bf16_pack(int b, int trans, int rows, int K, const float *X, int ld, int r0, int r1,
                       void *out);
/* cm_gemm_bf16 where A (pa non-NULL) and/or B (pb non-NULL) comes packed over K0 inner values
 * and the whole of its M (or N): this call multiplies over inner indexes [k0, k0 + K) of it, k0
 * a multiple of 32 and k0 + K either K0 or a multiple of 32. A (B) is not read when pa (pb) is
 * given. The same bits as cm_gemm_bf16 on the same values. */
int cm_gemm_bf16_pre(int ta, int tb, int M, int N, int K, const float *A, int lda, const void *pa,
                     const float *B, int ldb, const void *pb, int K0, int k0, float *C, int ldc);

/* C (M x N, leading dimension ldc) = op(A) op(B) in fp32, arguments as cm_gemm_bf16's. Each
 * element of C is its K products summed in order by fused multiply-adds from 0
 * (c = fmaf(a_k, b_k, c)), so the result depends on the values only: not on a cut of the GEMM
 * into tiles, nor on the thread, nor on the path. path: CM_GEMM_F32_BEST takes the CPU's
 * widest vector path (AVX-512, else AVX2 with FMA), CM_GEMM_F32_AVX2 the AVX2 one even where
 * AVX-512 is (tests), CM_GEMM_F32_PORTABLE the plain loops; a path the CPU lacks falls back to
 * the loops. All give the same bits (tests hold them equal); the loops are only slower.
 * Packing scratch is the calling thread's own, as cm_gemm_bf16's. Returns 0, or CM_ENOMEM (C
 * untouched). */
#define CM_GEMM_F32_PORTABLE 0
#define CM_GEMM_F32_BEST 1
#define CM_GEMM_F32_AVX2 2
int cm_gemm_f32(int path, int ta, int tb, int M, int N, int K, const float *A, int lda,
                const float *B, int ldb, float *C, int ldc);
/* 1 when this build and CPU run a vector path of cm_gemm_f32 (CM_GEMM_F32_BEST is not the
 * loops). */
int cm_gemm_f32_simd_available(void);
/* What a path runs here: "avx512", "avx2" or "portable". Static storage. */
const char *cm_gemm_f32_path_name(int path);
/* op(B) (K x N) packed once for the cm_gemm_f32_pre calls that share it (a layer's weights
 * that do not change: serving), so that they skip the packing cm_gemm_f32 does in every call
 * (for a GEMM of few rows, most of its time). The layout is fixed: panels of
 * CM_GEMM_F32_PANEL columns, op(B)'s inner index k of column j at
 * out[(j / 32) * 32 * K + k * 32 + j % 32], columns past N zero; out holds
 * cm_gemm_f32_packed_floats(N, K) floats and is 64-byte aligned. tb, B, ldb as cm_gemm_f32's. */
#define CM_GEMM_F32_PANEL 32
size_t cm_gemm_f32_packed_floats(int N, int K);
void cm_gemm_f32_pack(int tb, int N, int K, const float *B, int ldb, float *out);
/* cm_gemm_f32 (on path) with op(B) from pb, packed over all its K inner indexes: C (M x N) =
 * op(A) times op(B)'s columns [j0, j0 + N), j0 a multiple of CM_GEMM_F32_PANEL. The same bits as
 * cm_gemm_f32 on the same values. CM_EINVAL (C untouched) where the path runs the loops here
 * or j0 is not so; else as cm_gemm_f32. */
int cm_gemm_f32_pre(int path, int ta, int M, int N, int K, const float *A, int lda, const float *pb,
                    int j0, float *C, int ldc);

/* int8 quantisation, shared by serving bundles (fp32 scale) and the PS wire (bf16 scale).
 * cm_int8_quantize: q[j] = x[j] * inv rounded to nearest and clamped to +-127, where inv is the
 * caller's 1/scale (when it is not finite, as for a subnormal scale, x[j] / scale instead);
 * back (optional) gets q[j] * scale, what a reader decodes, so a caller can keep the residual. */
float cm_absmax(const float *x, uint32_t dim);
void cm_int8_quantize(const float *x, uint32_t dim, float scale, float inv, uint8_t *q,
                      float *back);
void cm_int8_dequantize(const uint8_t *q, uint32_t dim, float scale, float *out);
/* One row of dim floats as 4 bytes of fp32 scale (max|x|/127), then dim int8 values. */
void cm_int8_row_encode(const float *x, uint32_t dim, uint8_t *out);
void cm_int8_row_decode(const uint8_t *in, uint32_t dim, float *out);

/* Monotonic seconds, for timing and rates. */
double cm_now(void);

/* Sets glibc's malloc so that the multi-megabyte buffers every pull, push and message needs
 * are reused from the heap instead of being mapped and unmapped (or trimmed) per request: each
 * fresh mapping costs a page fault and a zeroed page per 4 KiB, about a third of a pull's CPU.
 * Blocks above 32 MiB are still mapped; up to 64 MiB of free heap top is kept. Called once
 * by programs (ember's main, benchmarks), never by the libraries. */
void cm_malloc_tune(void);

/* The OpenBLAS core (an OPENBLAS_CORETYPE value) this CPU should use, or NULL when `detected`
 * (openblas_get_corename()) is fine. A DYNAMIC_ARCH OpenBLAS that does not know a CPU model
 * falls back to a pre-AVX2 core (Debian 12's 0.3.21 runs SSE3 "Prescott" kernels on a Sapphire
 * Rapids Xeon: 31 against 142 GFLOP/s a core); this names the newest core the CPU and OS
 * support instead. OPENBLAS_CORETYPE is read when the library loads, so a program applies the
 * answer by setting it before OpenBLAS is loaded (a child's environment, a dlopen) or by
 * re-executing itself. */
const char *cm_blas_core_pick(const char *detected);

/* Where cm_blas_core_pick(detected) names a core and OPENBLAS_CORETYPE is unset, sets it and
 * runs this program again (its own binary, /proc/self/exe) with argv, so that OpenBLAS loads
 * with it; returns when nothing needs doing or the exec failed (the run then goes on, only
 * slower). Call first thing in main, before any thread starts; `detected` is
 * openblas_get_corename(). */
void cm_blas_core_reexec(const char *detected, char **argv);

/* Makes the calling thread background work (reading, staging) that should take the cores only
 * when the compute leaves them idle: SCHED_IDLE, which any other thread preempts at once on
 * wake-up (a niceness of +10 still let the trainer's woken puller wait out the background
 * thread's time slice, up to 2 ms a step), else niceness +10. Best effort: lowering one's own
 * priority needs no privilege, and failing changes nothing but timing. */
void cm_thread_background(void);

/*
 * A team of threads that runs the parts of a job beside the caller: the embedding table's
 * fan-out of one large pull or push over its sub-shards. Several callers may run jobs on one
 * team at once; each caller runs parts of its own job too, so a job finishes even when every
 * team thread is busy elsewhere (the team only adds help), and cm_team_run returns once every
 * part has run and every team thread that entered the job has left it. Parts must not wait for
 * one another. What a part computes must not depend on which thread runs it; the team only
 * changes when.
 */
typedef struct cm_team cm_team;
typedef void (*cm_team_fn)(void *arg, uint32_t part);
/* Starts `threads` team threads (1..256; the caller of each job is one more). */
int cm_team_create(uint32_t threads, cm_team **out, char **errptr);
/* Stops and joins the threads; no job may be running. NULL is fine. */
void cm_team_destroy(cm_team *t);
/* Threads a job can use: the team's plus its caller (1 for a NULL team). */
uint32_t cm_team_size(const cm_team *t);
/* Runs fn(arg, i) for every i < n_parts, each once, the caller taking part; a NULL team or a
 * single part runs them all on the caller, in order. */
void cm_team_run(cm_team *t, uint32_t n_parts, cm_team_fn fn, void *arg);

/* Creates dir and its parents (mode 0755); an existing directory is fine. */
int cm_mkdirs(const char *dir, char **errptr);

/* fsyncs a directory so renames inside it are durable. */
int cm_fsync_dir(const char *dir, char **errptr);

/* Removes a directory tree (like rm -rf); a missing path is fine. */
int cm_rmtree(const char *path, char **errptr);

/* Drops a path's trailing slashes in place ("/" stays): "out/" (as shell completion gives a
 * folder) names the folder out, but a name made by appending to it ("out/" ".tmp") lies inside
 * it instead of beside it, and what follows its last slash is empty. */
void cm_path_trim(char *path);

/* Puts directory tmpdir at dir: a plain rename when dir does not exist, else an atomic
 * exchange (renameat2 RENAME_EXCHANGE) followed by removal of the old tree. Either way a
 * reader sees the old dir or the new one, never a mixture. fsyncs dir's parent. */
int cm_dir_swap(const char *tmpdir, const char *dir, char **errptr);
/* Whether cm_dir_swap may replace dir, which deletes what was there: dir absent, an empty
 * directory, or one holding every name of markers (NULL-terminated: an earlier output of the
 * same kind, such as an earlier export). Anything else, named by mistake (a home, a run directory),
 * is refused with CM_EINVAL naming dir and the first missing marker. */
int cm_dir_replaceable(const char *dir, const char *const *markers, char **errptr);
/* The stricter test, by what dir holds rather than what it lacks: *other (heap, the caller
 * frees) gets the name of the first entry of dir ("." and ".." aside) that is not in names
 * (NULL-terminated), or NULL when dir holds nothing else. CM_EIO naming dir when it cannot be
 * read. */
int cm_dir_other_entry(const char *dir, const char *const *names, char **other, char **errptr);

/* Writes all n bytes to fd, retrying on EINTR and short writes. 0 or CM_EIO (errno set). */
int cm_write_full(int fd, const void *buf, size_t n);
/* pwrite of all n bytes at off, retrying on EINTR and short writes; 0 or an errno value. */
int cm_pwrite_full(int fd, const void *buf, size_t n, uint64_t off);
/* pread of all n bytes at off, retrying on EINTR and short reads; 0 or an errno value (EIO
 * when the file ends first). */
int cm_pread_full(int fd, void *buf, size_t n, uint64_t off);
/* A scratch file in dir (open for reading and writing, close-on-exec) into *fd, unlinked as
 * soon as it is made: what is written there goes when fd is closed, on any way out. CM_OK, or
 * CM_EIO naming dir. */
int cm_scratch_open(const char *dir, int *fd, char **errptr);
/* Reads the first len bytes of fd back (pread, a MiB at a time), handing each piece to fn in
 * order: how a file written out of order (its header last, an index in place) gets its checksum,
 * in the caller's own xxh3 state (the library's, or one XXH_INLINE_ALL makes its own type). */
int cm_fd_each_chunk(int fd, const char *path, uint64_t len,
                     void (*fn)(void *arg, const void *buf, size_t n), void *arg, char **errptr);

/*
 * A key -> u32 open-addressing index in a region of a file: `slots` (a power of two, at most
 * 2^40) 16-byte entries {u64 key, u32 val (CM_KEYIDX_EMPTY: none), u32 0}, each key in the
 * first empty entry probing linearly (wrapping) from xxh3-64(the key's 8 bytes) & (slots - 1).
 * It is the serving bundle's table index (serve/ember_serve.h), and export's check that no key
 * is in a table twice.
 * Why a file, written in order: the index of a table larger than memory is larger than memory
 * too, and filling it in place (random writes) faults its pages in from disk over and over.
 * Keys are buffered, up to a memory budget, as (home slot, key, val); a full buffer is sorted by
 * (home slot, key) and appended to a scratch file in the directory given (unlinked as soon as it
 * is made: nothing is left behind, whatever happens) as a sorted run. cm_keyidx_finish merges
 * the runs (or sorts the buffer, when no run was written) in home-slot order and writes the
 * region front to back in chunks, empty entries included, each key at max(its home, the
 * previous key's entry + 1): where linear probing puts keys inserted in that order. The keys
 * that run past the last slot then take the first empty entries from slot 0. A key twice meets
 * itself as a neighbour in that order. Memory: the budget, however many keys; disk: 16 bytes a
 * key for the runs, only when the keys do not fit. Not byte for byte what adding the keys one at
 * a time would give (keys sharing a cluster sit in another order): a valid index for any reader
 * probing from the hash.
 */
#define CM_KEYIDX_EMPTY UINT32_MAX
typedef struct cm_keyidx cm_keyidx;
/* Slots for n keys at a load factor of at most 0.8 (at least 16). */
uint64_t cm_keyidx_slots(uint64_t n);
/* The least memory budget an index of `slots` slots is built in: 64 KiB, or once its keys do
 * not fit, ~sqrt(110,000 x slots) bytes (each run is read back 4 KiB at a time or more): 15 MiB
 * for 2^31 slots (10^9 keys), 317 MiB for the most, 2^40. */
uint64_t cm_keyidx_least(uint64_t slots);
/* An index to be written to [off, off + 16 * slots) of fd (open for reading and writing, at
 * least that long; nothing is written before cm_keyidx_finish), holding at most `mem` bytes
 * (CM_EINVAL, naming cm_keyidx_least, when that is too little), its sorted runs in a scratch
 * file under dir. *out is the caller's (cm_keyidx_close). path names fd in messages. */
int cm_keyidx_open(int fd, const char *path, uint64_t off, uint64_t slots, uint64_t mem,
                   const char *dir, cm_keyidx **out, char **errptr);
/* Adds key -> val (val != CM_KEYIDX_EMPTY). A key added before is refused ("key K twice",
 * CM_EINVAL) here, when a run holding both is sorted, or at cm_keyidx_finish; cm_keyidx_dup
 * names it. More keys than slots - 1 are refused too, and any key after finish. */
int cm_keyidx_add(cm_keyidx *x, uint64_t key, uint32_t val, char **errptr);
/* After the last add: writes the whole region (the keys, and every other entry empty). Once. */
int cm_keyidx_finish(cm_keyidx *x, char **errptr);
/* 1 with the key in *key when a key was refused as added twice, else 0. */
int cm_keyidx_dup(const cm_keyidx *x, uint64_t *key);
/* Frees the index and closes its scratch file (what finish wrote stays). NULL is fine. */
void cm_keyidx_close(cm_keyidx *x);

/*
 * Whether a key comes twice among a stream of keys (a table's rows read from a checkpoint: a
 * damaged one, checksums and all, could hold a key twice), in bounded memory: keys are spread
 * over partitions by a hash, each gathered in a buffer that is appended to a file of its own
 * under dir whenever it fills; at the end each partition is read back whole, sorted and scanned
 * for equal neighbours. Memory: the budget given, however many keys; disk: 8 bytes a key, only
 * when they do not fit. With room for every key no file is touched. Unlike cm_keyidx, which
 * must place keys where readers probe for them, the writes and reads here are sequential.
 */
typedef struct cm_keyset cm_keyset;
/* The partitions under it: fixed-size records, each starting with its u64 key (native order),
 * spread over `parts` partitions by cm_part_of(key), each gathered in a buffer of `cap` records
 * that is appended to the partition's file under dir whenever it fills. A delta export spreads
 * two checkpoints' (key, fingerprint) pairs over the same partitions so that each partition of
 * one is compared with the same partition of the other alone. Memory: parts x cap x rec bytes
 * until cm_parts_flush, then none. */
typedef struct cm_parts cm_parts;
/* The partition of parts a key goes to: a hash's (the keys of trained tables are hashes, but
 * a table's keys may be anything) high bits scaled, not the key's. */
uint32_t cm_part_of(uint64_t key, uint32_t parts);
int cm_parts_create(const char *dir, uint32_t parts, size_t rec, size_t cap, cm_parts **out,
                    char **errptr);
/* Adds one record of rec bytes (its first 8 the key). */
int cm_parts_add(cm_parts *ps, const void *rec, char **errptr);
/* Whether any partition has gone to its file. */
bool cm_parts_filed(const cm_parts *ps);
/* After the last add: every buffer to its file, and the buffers freed. */
int cm_parts_flush(cm_parts *ps, char **errptr);
/* The records added to partition p. */
uint64_t cm_parts_count(const cm_parts *ps, uint32_t p);
/* After cm_parts_flush: n records of partition p from record `at` on, in the order added. */
int cm_parts_read(const cm_parts *ps, uint32_t p, void *buf, uint64_t at, size_t n, char **errptr);
/* Frees the partitions and removes dir. NULL is fine. */
void cm_parts_destroy(cm_parts *ps);
/* A set for up to n keys in mem bytes (CM_EINVAL, naming the least that would do, when mem is
 * too small); its files go under dir, which destroy removes. *out is the caller's. */
int cm_keyset_create(const char *dir, uint64_t n, uint64_t mem, cm_keyset **out, char **errptr);
/* The least memory a set for n keys takes (~sqrt(80,000 n) bytes once they do not fit). */
uint64_t cm_keyset_least(uint64_t n);
int cm_keyset_add(cm_keyset *ks, uint64_t key, char **errptr);
/* After the last add: *twice, and one such key in *key. */
int cm_keyset_twice(cm_keyset *ks, bool *twice, uint64_t *key, char **errptr);
/* Frees the set and removes dir. NULL is fine. */
void cm_keyset_destroy(cm_keyset *ks);

/* The running program's own binary (readlink of /proc/self/exe) into buf, NUL-terminated. */
int cm_self_exe(char *buf, size_t n, char **errptr);

/* Writes s to f as the body of a JSON string (no quotes around it): quotes, backslashes and
 * control characters escaped. Paths, names and model text in ember's JSON can hold any. */
void cm_json_escape(FILE *f, const char *s);

/* Reads a whole file into a heap buffer (*buf, owned by the caller, free()), length in *len.
 * A NUL byte follows the data (not counted in *len), so a text file reads as a C string. */
int cm_read_file(const char *path, void **buf, size_t *len, char **errptr);

/* An atomically-committed output file. Storage is the caller's (cm_afile_init/...); the
 * members are private. */
typedef struct cm_afile {
    int fd;
    char *path; /* final path (owned) */
    char *tmp;  /* temporary path (owned) */
    void *hash; /* XXH3 state (owned) */
    uint64_t bytes;
    int in_place; /* the target is no regular file: written directly, not renamed */
    /* direct I/O: the stage being filled and the one being written (owned; NULL = buffered
     * writes), the file offset of the stage's first byte, the write in flight (an aiocb) */
    uint8_t *stage, *spare;
    size_t stage_cap, staged;
    uint64_t off;
    void *aio;
    int in_flight;
} cm_afile;

/* Opens "<path>.tmp.<pid>" for writing. On error nothing is left on disk. A path that exists
 * and is not a regular file (/dev/null, a pipe) is written in place, with no rename; a symbolic
 * link is followed (the file it names is replaced, the link kept; a dangling one: CM_EIO). */
int cm_afile_open(cm_afile *f, const char *path, char **errptr);
/* cm_afile_open, but the file is written with O_DIRECT through two aligned stages of `stage`
 * bytes each (rounded down to CM_DIRECT_ALIGN; the caller's writes are copied into one while
 * the other is written in the background), where the file system takes it; where it does
 * not, or stage < CM_DIRECT_ALIGN, writes are buffered.
 * Why: a buffered write copies every byte into page-cache pages the kernel allocates for the
 * new file, and on a VM that hands freed memory back to its host each page is a fresh host
 * fault (~1-1.5 s of system time per GB here). The file's bytes are the same either way; it
 * is just not left in the page cache, so a reader right after reads it from the device. */
#define CM_DIRECT_ALIGN 4096u
int cm_afile_open_direct(cm_afile *f, const char *path, size_t stage, char **errptr);
/* Appends bytes, folding them into the running xxh3. */
int cm_afile_write(cm_afile *f, const void *buf, size_t n, char **errptr);
/* Bytes written so far (staged bytes included): the next write's file offset. */
uint64_t cm_afile_size(const cm_afile *f);
/* xxh3-64 of everything written so far. */
uint64_t cm_afile_digest(const cm_afile *f);
/* fsync, close, rename over the target, fsync the directory; releases f. On error the
 * temporary is removed and the target is untouched. */
int cm_afile_commit(cm_afile *f, char **errptr);
/* Closes and removes the temporary; releases f. Safe after a failed open or commit. */
void cm_afile_abort(cm_afile *f);
/* Ends a binary file whose last 8 bytes are the xxh3-64 of every byte before them: when rc (the
 * writes' outcome) is CM_OK, appends that digest and commits; otherwise aborts. Returns the
 * outcome (rc, or the append's or commit's error). */
int cm_afile_commit_digest(cm_afile *f, int rc, char **errptr);

/* Writes a whole buffer atomically (open + write + commit). */
int cm_write_file_atomic(const char *path, const void *buf, size_t n, char **errptr);

/*
 * Small text files that carry their own checksum: a checkpoint's model.txt, run.txt, worker
 * positions and LATEST. The text (n bytes, ending in a newline) is followed by one last line
 * "xxh3 <16 hex digits>" over every byte before it. These files steer a resume (which step,
 * which position, which settings), and a damaged digit would otherwise point a run at another
 * step or position and go on silently. Written atomically like cm_write_file_atomic.
 */
#define CM_SEAL_LINE 22 /* "xxh3 " + 16 hex digits + "\n" */
int cm_write_sealed(const char *path, const char *text, size_t n, char **errptr);
/* Reads such a file: *text (heap, NUL-terminated, owned by the caller) is its text without
 * the checksum line, *len its length. A file whose last line is not a checksum line (cut short,
 * or not written by ember) or whose checksum does not match is refused with CM_ECORRUPT naming
 * the path; a missing file is CM_ENOTFOUND. */
int cm_read_sealed(const char *path, char **text, size_t *len, char **errptr);
/* The check behind cm_read_sealed, for any such trailer: whether buf[0, n) ends in the line
 * "<tag> <16 hex digits>\n" (tag "xxh3" for sealed text, "checksum" for the snapshot and shard
 * manifests) holding the xxh3 of every byte before it. CM_OK with *body the length before that
 * line; CM_ENOTFOUND when the last line is no such line; CM_ECORRUPT when its checksum does not
 * match. Text only: a buffer holding a NUL byte is CM_ENOTFOUND too. */
int cm_seal_check(const char *buf, size_t n, const char *tag, size_t *body);
/* Appends that line to the len bytes of text at out (cap bytes of room): the new length, or -1
 * when it does not fit. */
int cm_seal_append(char *out, size_t len, size_t cap, const char *tag);

/*
 * INI files: "[name]" or "[name arg]" section headers, "key = value" lines, '#' comments.
 * cb is called with key == NULL at each section header, then once per key, with the line's
 * number (from 1) for what it can only check later; a non-zero return stops the parse. Messages
 * from cb are prefixed with "path:line: ". A key given twice in the same section ([name arg]) is
 * refused, naming both lines: cb never sees the second value. A UTF-8 byte order mark before the
 * first line is skipped.
 */
#define CM_UTF8_BOM "\xef\xbb\xbf"
typedef int (*cm_ini_cb)(void *arg, int line, const char *section, const char *section_arg,
                         const char *key, const char *value, char **errptr);
int cm_ini_parse(const char *path, cm_ini_cb cb, void *arg, char **errptr);
/* For a cm_ini_cb refusing a section header: "unknown section [name arg] (known)", the
 * argument named too; known (the sections the file may have) may be NULL. Returns CM_EINVAL. */
int cm_ini_unknown_section(char **errptr, const char *section, const char *section_arg,
                           const char *known);
/* For a cm_ini_cb refusing a key above every section header, which no file may have (a
 * forgotten header would give its keys to no section, or the wrong one): "key 'key' before any
 * section header (keys go under where)". Returns CM_EINVAL. */
int cm_ini_key_outside(char **errptr, const char *key, const char *where);

/* A section's keys as one list, so that lookup and the message naming them cannot disagree:
 * the index of key in keys[0..n), or -1. */
int cm_ini_key_find(const char *key, const char *const *keys, size_t n);
/* The one of names[0..n) that name most likely stands for (a typo: within two edits; or one
 * word of the other's name: "memory" for "memory_budget"), or NULL when none is near. */
const char *cm_nearest_name(const char *name, const char *const *names, size_t n);
/* For a cm_ini_cb refusing a key its section does not have: "unknown key 'key' in where", then
 * the closest of keys[0..n) when one is near (a typo, or one name the prefix of the other: "did
 * you mean 'memory'?") and every key the section has. Returns CM_EINVAL. */
int cm_ini_unknown_key(char **errptr, const char *key, const char *where, const char *const *keys,
                       size_t n);

/* Defines `static void NAME(T *a, uint64_t n)`, sorting a in place, ascending by LESS(x, y) (x
 * and y two T values): glibc's qsort sorts through a copy of the array when it can get one (a
 * merge sort), which doubles the memory of what is sorted, and calls a comparator each time.
 * Quicksort, median of three, the smaller side recursed (depth log n), insertion sort below 16. */
#define CM_SORT_DEFINE(NAME, T, LESS)                                                              \
    static void NAME(T *a, uint64_t n)                                                             \
    {                                                                                              \
        T t_;                                                                                      \
        while (n > 16) {                                                                           \
            const uint64_t m = n / 2;                                                              \
            if (LESS(a[m], a[0])) t_ = a[m], a[m] = a[0], a[0] = t_;                               \
            if (LESS(a[n - 1], a[0])) t_ = a[n - 1], a[n - 1] = a[0], a[0] = t_;                   \
            if (LESS(a[n - 1], a[m])) t_ = a[n - 1], a[n - 1] = a[m], a[m] = t_;                   \
            const T p_ = a[m];                                                                     \
            uint64_t i = 0, j = n - 1;                                                             \
            for (;;) { /* Hoare: the pivot's value stops both scans inside a */                    \
                while (LESS(a[i], p_))                                                             \
                    i++;                                                                           \
                while (LESS(p_, a[j]))                                                             \
                    j--;                                                                           \
                if (i >= j) break;                                                                 \
                t_ = a[i], a[i] = a[j], a[j] = t_;                                                 \
                i++;                                                                               \
                j--;                                                                               \
            }                                                                                      \
            const uint64_t left = j + 1; /* [0, left) <= pivot <= [left, n) */                     \
            if (left < n - left) {                                                                 \
                NAME(a, left);                                                                     \
                a += left;                                                                         \
                n -= left;                                                                         \
            } else {                                                                               \
                NAME(a + left, n - left);                                                          \
                n = left;                                                                          \
            }                                                                                      \
        }                                                                                          \
        for (uint64_t i = 1; i < n; i++) {                                                         \
            T v_ = a[i];                                                                           \
            uint64_t j = i;                                                                        \
            for (; j > 0 && LESS(v_, a[j - 1]); j--)                                               \
                a[j] = a[j - 1];                                                                   \
            a[j] = v_;                                                                             \
        }                                                                                          \
    }

/* Defines `static void NAME(const T *items, uint32_t *h, size_t k, size_t i)`, restoring the
 * min-heap h[0, k) (indexes into items, ordered by LESS(x, y) of two T values) below position
 * i: a k-way merge's heap of runs, whose heads move in place as they are taken. Build with
 * i = k - 1 down to 0; after the top's run moves on (or ends: h[0] = h[--k]), i = 0. */
#define CM_HEAP_SIFT_DEFINE(NAME, T, LESS)                                                         \
    static void NAME(const T *items, uint32_t *h, size_t k, size_t i)                              \
    {                                                                                              \
        for (;;) {                                                                                 \
            size_t c = 2 * i + 1;                                                                  \
            if (c >= k) return;                                                                    \
            if (c + 1 < k && LESS(items[h[c + 1]], items[h[c]])) c++;                              \
            if (!LESS(items[h[c]], items[h[i]])) return;                                           \
            const uint32_t t_ = h[c];                                                              \
            h[c] = h[i];                                                                           \
            h[i] = t_;                                                                             \
            i = c;                                                                                 \
        }                                                                                          \
    }

/* qsort and bsearch order of uint64_t values, ascending. */
static inline int cm_u64_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Parses an unsigned decimal with an optional K/M/G/T (binary) suffix: digits from the first
 * character (no blanks, no sign), nothing after the suffix, no overflow. 0 or -1. */
int cm_parse_size(const char *v, uint64_t *out);

#ifdef __cplusplus
}
#endif
#endif
