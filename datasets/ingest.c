#define _GNU_SOURCE /* memrchr */
/* ds_ingest_run: text in, shards out.
 *
 * One reader thread cuts the (decompressed) input into chunks that end at a line break, a pool
 * of workers parses each chunk and encodes its rows into compressed blocks, and the calling
 * thread takes finished chunks strictly in input order, reports malformed lines and appends the
 * blocks to the shard files round-robin. Chunks live in a ring of slots; a slot is reused only
 * after the writer is done with it, which bounds memory and keeps the output independent of the
 * number of threads. */
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "datasets/ds_internal.h"

#define MAX_DETAIL 32
enum { SLOT_EMPTY, SLOT_READY, SLOT_BUSY, SLOT_DONE };

typedef struct rej_detail {
    uint64_t line; /* physical line within the chunk, 1-based */
    int reason;
    uint32_t column;
} rej_detail;

typedef struct chunk {
    int state;
    uint64_t seq;
    uint32_t file;
    int overlong; /* the chunk is one line longer than chunk_bytes, already skipped */
    uint8_t *buf; /* the slot's own buffer, for input that is read */
    const uint8_t *data; /* the chunk's text: buf, or a range of a mapped input file */
    size_t len;
    /* results */
    ds_rows rows[2]; /* train, eval */
    ds_buf enc;
    ds_block_meta *metas; /* offset = position in enc */
    uint8_t *meta_eval;
    size_t n_metas, cap_metas;
    uint64_t phys_lines, lines, rejected, padded, rows_out[2];
    uint64_t rej_counts[DS_REJ__COUNT];
    rej_detail rej[MAX_DETAIL];
    uint32_t n_rej;
    int err;
    char *errmsg;
} chunk;

typedef struct worker {
    struct ingest *g;
    pthread_t tid;
    int started;
    ds_pctx ctx;
    ds_stats stats;
    ds_benc benc;
} worker;

typedef struct ingest {
    const ds_ingest_opts *o;
    size_t chunk_bytes;
    uint32_t block_rows;
    ds_plan *base;
    ds_plan **file_plans; /* per input; base or one built from the file's header */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    chunk *slots;
    size_t n_slots;
    uint64_t published, next_parse;
    int reader_done, stop;
    int reader_rc;
    char *reader_err;
    uint64_t bytes_in;
    worker *workers;
    int n_workers;
    int shrank; /* 1 + the input that shrank while mapped (map_guard); 0: none (atomic) */
} ingest;

static chunk *slot_of(ingest *g, uint64_t seq)
{
    return &g->slots[seq % g->n_slots];
}

/* ---- reader thread ---- */

/* Bytes of a UTF-8 byte order mark at the start of an input (0 or 3). Windows tools write one
 * before CSV text; left in place it would stick to the first header name (Avazu's id column
 * would become a field) or the first row's label. */
static size_t bom_len(const uint8_t *p, size_t n)
{
    return n >= 3 && p[0] == 0xef && p[1] == 0xbb && p[2] == 0xbf ? 3 : 0;
}

/* Reads until buf holds want bytes or the input ends. */
static int fill(ingest *g, ds_input *in, uint8_t *buf, size_t *len, size_t want, int *eof,
                char **errptr)
{
    while (*len < want && !*eof) {
        size_t got;
        int rc = ds_input_read(in, buf + *len, want - *len, &got, errptr);
        if (rc != CM_OK) return rc;
        if (got == 0) *eof = 1;
        *len += got;
        __atomic_add_fetch(&g->bytes_in, got, __ATOMIC_RELAXED);
    }
    return CM_OK;
}

static chunk *acquire_slot(ingest *g)
{
    pthread_mutex_lock(&g->mu);
    chunk *c = slot_of(g, g->published);
    while (!g->stop && c->state != SLOT_EMPTY) pthread_cond_wait(&g->cv, &g->mu);
    /* stop is read under the lock: the writer sets it under the lock while this thread runs. */
    if (g->stop) c = NULL;
    pthread_mutex_unlock(&g->mu);
    return c;
}

static void publish(ingest *g, chunk *c, uint32_t file)
{
    pthread_mutex_lock(&g->mu);
    c->file = file;
    c->seq = g->published++;
    c->state = SLOT_READY;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static int read_header(ingest *g, uint32_t f, ds_input *in, uint8_t *carry, size_t *carry_len,
                       int *eof, char **errptr)
{
    const char *path = g->o->inputs[f];
    int rc = fill(g, in, carry, carry_len, g->chunk_bytes, eof, errptr);
    if (rc != CM_OK) return rc;
    uint8_t *nl = memchr(carry, '\n', *carry_len);
    if (*carry_len == 0) return cm_err(errptr, CM_EINVAL, "%s: empty file, expected a header line", path);
    if (nl == NULL && !*eof) return cm_err(errptr, CM_EINVAL, "%s: header line too long", path);
    size_t hl = nl ? (size_t)(nl - carry) : *carry_len;
    ds_plan *p = NULL;
    char *err = NULL;
    rc = ds_plan_from_header(g->base, (const char *)carry, hl, &p, &err);
    if (rc != CM_OK) {
        rc = cm_err(errptr, rc, "%s:1: %s", path, err);
        free(err);
        return rc;
    }
    if (p != NULL) {
        g->file_plans[f] = p;
        for (uint32_t i = 0; i < f; i++)
            if (!ds_plan_same_schema(g->file_plans[i], p))
                return cm_err(errptr, CM_EINVAL, "%s: header gives a different schema than %s",
                              path, g->o->inputs[i]);
    }
    size_t used = nl ? hl + 1 : hl;
    memmove(carry, carry + used, *carry_len - used);
    *carry_len -= used;
    return CM_OK;
}

/* Discards the rest of an over-long line; what follows its line break goes to carry. */
static int skip_line(ingest *g, ds_input *in, uint8_t *tmp, uint8_t *carry, size_t *carry_len,
                     int *eof, char **errptr)
{
    for (;;) {
        size_t len = 0;
        int rc = fill(g, in, tmp, &len, g->chunk_bytes, eof, errptr);
        if (rc != CM_OK) return rc;
        uint8_t *nl = memchr(tmp, '\n', len);
        if (nl != NULL) {
            *carry_len = len - (size_t)(nl + 1 - tmp);
            memcpy(carry, nl + 1, *carry_len);
            return CM_OK;
        }
        if (*eof) return CM_OK;
    }
}

/* ---- a mapped input that shrinks ----
 * Another process that truncates an input file while it is mapped here turns every access past
 * the new end into SIGBUS, which kills the process. While a file is mapped, its range is
 * registered here; a SIGBUS inside a registered range maps a page of zeros over the faulting
 * page, so the access completes, and flags the ingest, which then fails naming the file: the
 * zeros never reach a shard, since the writer checks the flag before each chunk and a failed
 * run's outputs are removed. A SIGBUS anywhere else goes to the handler there was before (the
 * default one: the process ends as it would have). The handler is installed once, at the first
 * mapped input, and stays (a later one installed over it by the program is its own business). */
#define MAP_GUARDS 64
typedef struct map_guard {
    uintptr_t lo, hi;
    int *flag;
    int value;
    int used; /* atomic: lo, hi, flag and value are set before it */
} map_guard;
static map_guard map_guards[MAP_GUARDS];
static struct sigaction bus_prev;
static uintptr_t bus_page;
static pthread_once_t bus_once = PTHREAD_ONCE_INIT;
static int bus_installed;

static void bus_handler(int sig, siginfo_t *si, void *uc)
{
    uintptr_t a = (uintptr_t)si->si_addr;
    for (int i = 0; i < MAP_GUARDS; i++) {
        map_guard *m = &map_guards[i];
        if (!__atomic_load_n(&m->used, __ATOMIC_ACQUIRE) || a < m->lo || a >= m->hi) continue;
        void *page = (void *)(a & ~(bus_page - 1));
        if (mmap(page, bus_page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) ==
            MAP_FAILED)
            break;
        __atomic_store_n(m->flag, m->value, __ATOMIC_RELEASE);
        return;
    }
    if ((bus_prev.sa_flags & SA_SIGINFO) && bus_prev.sa_sigaction != NULL) {
        bus_prev.sa_sigaction(sig, si, uc);
    } else if (bus_prev.sa_handler != SIG_DFL && bus_prev.sa_handler != SIG_IGN) {
        bus_prev.sa_handler(sig);
    } else {
        /* The faulting access runs again on return and gets the default action. */
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigaction(SIGBUS, &dfl, NULL);
    }
}

static void bus_install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = bus_handler;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    bus_page = (uintptr_t)sysconf(_SC_PAGESIZE);
    bus_installed = sigaction(SIGBUS, &sa, &bus_prev) == 0;
}

/* Registers a mapping of input f; the index of its guard, or -1 (then the file is read, not
 * mapped). */
static int map_guard_add(ingest *g, uint32_t f, const void *map, size_t size)
{
    pthread_once(&bus_once, bus_install);
    if (!bus_installed) return -1;
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    int at = -1;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAP_GUARDS && at < 0; i++) {
        map_guard *m = &map_guards[i];
        if (__atomic_load_n(&m->used, __ATOMIC_ACQUIRE)) continue;
        m->lo = (uintptr_t)map;
        m->hi = (uintptr_t)map + size;
        m->flag = &g->shrank;
        m->value = (int)f + 1;
        __atomic_store_n(&m->used, 1, __ATOMIC_RELEASE);
        at = i;
    }
    pthread_mutex_unlock(&mu);
    return at;
}

static void map_guard_remove(int at)
{
    __atomic_store_n(&map_guards[at].used, 0, __ATOMIC_RELEASE);
}

/* The error of an input that shrank while it was read (map_guard). */
static int shrank_error(const ingest *g, uint32_t f, char **errptr)
{
    return cm_err(errptr, CM_EIO,
                  "%s: the file shrank while it was read (another process truncated or rewrote "
                  "it): nothing written; ingest it again once it is complete",
                  g->o->inputs[f]);
}

/* An uncompressed regular file is mapped and its chunks point into the mapping: no copy into
 * the slot buffers (about 3% of the CPU of an ingest). Chunks are cut exactly where
 * read_file cuts them (a full chunk_bytes window that holds no line end is an over-long line,
 * even at the end of the file), so the output is the same either way. Pages are faulted in
 * here, a chunk at a time, rather than one by one in the workers. Returns 1 when the file
 * cannot be mapped (read it instead). */
static int read_mapped(ingest *g, uint32_t f, int fd, char **errptr)
{
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0 ||
        (uint64_t)st.st_size > SIZE_MAX)
        return 1;
    size_t size = (size_t)st.st_size, pos = 0, cb = g->chunk_bytes;
    const uint8_t *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) return 1;
    int guard = map_guard_add(g, f, map, size);
    if (guard < 0) {
        munmap((void *)map, size);
        return 1;
    }
    madvise((void *)map, size, MADV_SEQUENTIAL);
    const char *path = g->o->inputs[f];
    int rc = CM_OK;
    g->file_plans[f] = g->base;
    pos = bom_len(map, size);
    __atomic_add_fetch(&g->bytes_in, pos, __ATOMIC_RELAXED);
    if (g->base->header) {
        const uint8_t *h = map + pos;
        size_t left = size - pos;
        const uint8_t *nl = memchr(h, '\n', left < cb ? left : cb);
        if (nl == NULL && left >= cb) {
            rc = cm_err(errptr, CM_EINVAL, "%s: header line too long", path);
            goto out;
        }
        size_t hl = nl ? (size_t)(nl - h) : left;
        ds_plan *p = NULL;
        char *err = NULL;
        rc = ds_plan_from_header(g->base, (const char *)h, hl, &p, &err);
        if (rc != CM_OK) {
            rc = cm_err(errptr, rc, "%s:1: %s", path, err);
            free(err);
            goto out;
        }
        if (p != NULL) {
            g->file_plans[f] = p;
            for (uint32_t i = 0; i < f; i++)
                if (!ds_plan_same_schema(g->file_plans[i], p)) {
                    rc = cm_err(errptr, CM_EINVAL, "%s: header gives a different schema than %s",
                                path, g->o->inputs[i]);
                    goto out;
                }
        }
        size_t used = nl ? hl + 1 : hl;
        pos += used;
        __atomic_add_fetch(&g->bytes_in, used, __ATOMIC_RELAXED);
    }
    /* A file found cut (map_guard) is read no further: each page past its end costs a signal. */
    while (pos < size && __atomic_load_n(&g->shrank, __ATOMIC_ACQUIRE) == 0) {
        chunk *c = acquire_slot(g);
        if (c == NULL) break;
        size_t len = size - pos < cb ? size - pos : cb, used = len;
        c->overlong = 0;
        c->data = map + pos;
        if (len == cb) { /* read_file sees no end of file yet: the chunk must end a line */
            const uint8_t *nl = memrchr(map + pos, '\n', len);
            if (nl == NULL) {
                c->overlong = 1;
                nl = memchr(map + pos + len, '\n', size - pos - len);
                used = nl ? (size_t)(nl + 1 - (map + pos)) : size - pos;
                len = 0;
            } else {
                len = used = (size_t)(nl + 1 - (map + pos));
            }
        }
#ifdef MADV_POPULATE_READ
        if (len) {
            uintptr_t a = (uintptr_t)(map + pos) & ~(uintptr_t)4095;
            /* EFAULT: pages past the file's end, which would raise SIGBUS when read */
            if (madvise((void *)a, (uintptr_t)(map + pos + len) - a, MADV_POPULATE_READ) != 0 &&
                errno == EFAULT)
                __atomic_store_n(&g->shrank, (int)f + 1, __ATOMIC_RELEASE);
        }
#endif
        c->len = len;
        pos += used;
        __atomic_add_fetch(&g->bytes_in, used, __ATOMIC_RELAXED);
        publish(g, c, f);
    }
    /* chunks of this file may still be queued or parsed: wait until every slot is empty
     * before unmapping, or, once the run is stopping (nothing is picked up or written any
     * more), until no worker is still parsing one */
    pthread_mutex_lock(&g->mu);
    for (size_t i = 0; i < g->n_slots;) {
        int st = g->slots[i].state;
        if (st == SLOT_BUSY || (st != SLOT_EMPTY && !g->stop))
            pthread_cond_wait(&g->cv, &g->mu);
        else
            i++;
    }
    pthread_mutex_unlock(&g->mu);
out:
    /* The size checked too: a file cut at a page boundary past every access faults nowhere. */
    if (rc == CM_OK && (__atomic_load_n(&g->shrank, __ATOMIC_ACQUIRE) == (int)f + 1 ||
                        fstat(fd, &st) != 0 || (uint64_t)st.st_size < size))
        rc = shrank_error(g, f, errptr);
    map_guard_remove(guard);
    munmap((void *)map, size);
    return rc;
}

static int read_file(ingest *g, uint32_t f, uint8_t *carry, char **errptr)
{
    ds_input *in = NULL;
    size_t carry_len = 0;
    int eof = 0;
    int rc = ds_input_open(g->o->inputs[f], &in, errptr);
    if (rc != CM_OK) return rc;
    if (ds_input_plain_fd(in) >= 0 &&
        (rc = read_mapped(g, f, ds_input_plain_fd(in), errptr)) != 1) {
        ds_input_close(in);
        return rc;
    }
    g->file_plans[f] = g->base;
    /* the first 3 bytes decide on a byte order mark; what is not one stays as carry, so the
     * chunks are cut where read_mapped cuts them */
    rc = fill(g, in, carry, &carry_len, 3, &eof, errptr);
    if (rc == CM_OK && bom_len(carry, carry_len)) carry_len = 0;
    if (rc == CM_OK && g->base->header) rc = read_header(g, f, in, carry, &carry_len, &eof, errptr);
    while (rc == CM_OK && (carry_len > 0 || !eof)) {
        chunk *c = acquire_slot(g);
        if (c == NULL) break;
        size_t len = carry_len;
        memcpy(c->buf, carry, carry_len);
        carry_len = 0;
        if ((rc = fill(g, in, c->buf, &len, g->chunk_bytes, &eof, errptr)) != CM_OK) break;
        if (len == 0) break;
        c->overlong = 0;
        c->data = c->buf;
        c->len = len;
        if (!eof) {
            uint8_t *nl = memrchr(c->buf, '\n', len);
            if (nl == NULL) {
                c->overlong = 1;
                c->len = 0;
                rc = skip_line(g, in, c->buf, carry, &carry_len, &eof, errptr);
                if (rc != CM_OK) break;
            } else {
                c->len = (size_t)(nl + 1 - c->buf);
                carry_len = len - c->len;
                memcpy(carry, nl + 1, carry_len);
            }
        }
        publish(g, c, f);
    }
    ds_input_close(in);
    return rc;
}

static void *reader_main(void *arg)
{
    ingest *g = arg;
    char *err = NULL;
    int rc = CM_OK;
    uint8_t *carry = malloc(g->chunk_bytes);
    if (carry == NULL) rc = cm_err(&err, CM_ENOMEM, "out of memory");
    for (size_t f = 0; rc == CM_OK && f < g->o->n_inputs && !g->stop; f++)
        rc = read_file(g, (uint32_t)f, carry, &err);
    free(carry);
    pthread_mutex_lock(&g->mu);
    g->reader_done = 1;
    g->reader_rc = rc;
    g->reader_err = err;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

/* ---- workers ---- */

static int push_meta(chunk *c, const ds_block_meta *m, int eval)
{
    if (c->n_metas == c->cap_metas) {
        size_t cap = c->cap_metas ? c->cap_metas * 2 : 16;
        ds_block_meta *metas = realloc(c->metas, cap * sizeof *metas);
        if (metas == NULL) return CM_ENOMEM;
        c->metas = metas;
        uint8_t *ev = realloc(c->meta_eval, cap);
        if (ev == NULL) return CM_ENOMEM;
        c->meta_eval = ev;
        c->cap_metas = cap;
    }
    c->metas[c->n_metas] = *m;
    c->meta_eval[c->n_metas++] = (uint8_t)eval;
    return CM_OK;
}

/* Points the worker and the chunk's row buffers at the file's plan. */
static int bind_plan(worker *w, chunk *c, const ds_plan *plan)
{
    if (w->ctx.plan != plan) {
        ds_pctx_free(&w->ctx);
        if (ds_pctx_init(&w->ctx, plan, NULL) != CM_OK) return CM_ENOMEM;
    }
    if (w->stats.hll == NULL && ds_stats_init(&w->stats, plan->n_dense, plan->n_fields))
        return CM_ENOMEM;
    w->ctx.stats = &w->stats;
    w->ctx.block_field_stats = 1; /* parse_chunk encodes every row it keeps */
    for (int i = 0; i < 2; i++) {
        ds_rows *r = &c->rows[i];
        if (r->n_dense != plan->n_dense || r->n_fields != plan->n_fields ||
            r->has_weights != plan->has_weights || r->offsets == NULL) {
            ds_rows_free(r);
            ds_rows_init(r, plan->n_dense, plan->n_fields, plan->has_weights);
        }
        ds_rows_clear(r);
    }
    return CM_OK;
}

static void note_reject(chunk *c, uint64_t line, int reason, uint32_t column)
{
    c->rejected++;
    c->rej_counts[reason]++;
    if (c->n_rej < MAX_DETAIL) c->rej[c->n_rej++] = (rej_detail){line, reason, column};
}

/* Encodes all rows of r as one block of chunk c and empties r. */
static int encode_rows(worker *w, chunk *c, ds_rows *r, int ev)
{
    ds_block_meta m;
    size_t at = c->enc.len;
    int rc = ds_block_encode(&w->benc, r, 0, r->n_rows, &w->stats, &c->enc, &m, &c->errmsg);
    if (rc != CM_OK) return rc;
    m.offset = at;
    ds_rows_clear(r);
    return push_meta(c, &m, ev);
}

static int parse_chunk(worker *w, chunk *c)
{
    ingest *g = w->g;
    const ds_ingest_opts *o = g->o;
    int rc = bind_plan(w, c, g->file_plans[c->file]);
    if (rc != CM_OK) return rc;
    if (c->overlong) {
        c->phys_lines = c->lines = 1;
        note_reject(c, 1, DS_REJ_LINE_LONG, 0);
        return CM_OK;
    }
    /* rows go to eval when their hash falls below F of the hash range */
    double thresh = o->eval_fraction * 0x1p64;
    const char *s = (const char *)c->data, *end = s + c->len, *line;
    size_t n;
    while (ds_next_line(&s, end, &line, &n)) {
        c->phys_lines++;
        if (n == 0) continue;
        c->lines++;
        int ev = o->eval_fraction > 0 && (double)XXH3_64bits_withSeed(line, n, o->split_seed) < thresh;
        rc = ds_parse_line(&w->ctx, line, n, &c->rows[ev]);
        if (rc < 0) return rc;
        if (rc == 1) {
            note_reject(c, c->phys_lines, w->ctx.reason, w->ctx.column);
            if (o->strict) break;
        } else {
            c->rows_out[ev]++;
            c->padded += rc == 2;
            /* a full block is encoded at once, while its rows are still in cache; the blocks
             * are the same as cutting the chunk's rows afterwards, and only the order of
             * train and eval blocks among each other changes, which the writer keeps apart */
            if (c->rows[ev].n_rows == g->block_rows &&
                (rc = encode_rows(w, c, &c->rows[ev], ev)) != CM_OK)
                return rc;
        }
    }
    for (int ev = 0; ev < 2; ev++)
        if (c->rows[ev].n_rows && (rc = encode_rows(w, c, &c->rows[ev], ev)) != CM_OK) return rc;
    return CM_OK;
}

static void chunk_reset_results(chunk *c)
{
    c->enc.len = 0;
    c->n_metas = 0;
    c->phys_lines = c->lines = c->rejected = c->padded = 0;
    c->rows_out[0] = c->rows_out[1] = 0;
    memset(c->rej_counts, 0, sizeof c->rej_counts);
    c->n_rej = 0;
    c->err = 0;
    free(c->errmsg);
    c->errmsg = NULL;
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    ingest *g = w->g;
    for (;;) {
        pthread_mutex_lock(&g->mu);
        chunk *c = NULL;
        for (;;) {
            if (g->stop) break;
            chunk *s = slot_of(g, g->next_parse);
            if (g->next_parse < g->published && s->state == SLOT_READY) {
                c = s;
                c->state = SLOT_BUSY;
                g->next_parse++;
                break;
            }
            if (g->reader_done && g->next_parse == g->published) break;
            pthread_cond_wait(&g->cv, &g->mu);
        }
        pthread_mutex_unlock(&g->mu);
        if (c == NULL) return NULL;
        chunk_reset_results(c);
        c->err = parse_chunk(w, c);
        pthread_mutex_lock(&g->mu);
        c->state = SLOT_DONE;
        pthread_cond_broadcast(&g->cv);
        pthread_mutex_unlock(&g->mu);
    }
}

/* ---- the writer (calling thread) ---- */

/* Shards are written into a staging folder per set, DIR/train.tmp-<pid> (eval alike), renamed
 * to DIR/train once every shard in it is committed: committed one by one into DIR/train, a
 * run killed halfway through left some of them there, and a reader took them for the set. */
typedef struct outset {
    ds_shard_writer **w; /* [2][n_shards] */
    uint64_t next_block[2];
    int opened;
    char *stage[2];   /* staging folders still to be renamed or removed */
    int published[2]; /* renamed to DIR/train, DIR/eval */
} outset;

static const char *const set_names[2] = {"train", "eval"};

static char *path_join(const char *a, const char *b)
{
    size_t n = strlen(a) + strlen(b) + 2;
    char *s = malloc(n);
    if (s) snprintf(s, n, "%s/%s", a, b);
    return s;
}

/* Direct-I/O stage of each shard file: 4 MiB (a few blocks, large writes), less when there are
 * many files so that all stages together stay within 64 MiB; below 256 KiB (over 256 files)
 * the writes would be small and the files are written buffered. */
#define STAGE_MAX ((size_t)4 << 20)
#define STAGE_MIN ((size_t)256 << 10)
#define STAGES_TOTAL ((size_t)64 << 20)

static int open_outputs(ingest *g, outset *os, const ds_schema *schema, char **errptr)
{
    const ds_ingest_opts *o = g->o;
    int rc = CM_OK;
    size_t files = (size_t)o->n_shards * (o->eval_fraction > 0 ? 2 : 1);
    size_t stage = STAGES_TOTAL / files < STAGE_MAX ? STAGES_TOTAL / files : STAGE_MAX;
    if (o->buffered_output || stage < STAGE_MIN) stage = 0;
    for (int ev = 0; rc == CM_OK && ev < (o->eval_fraction > 0 ? 2 : 1); ev++) {
        char sname[64];
        snprintf(sname, sizeof sname, "%s.tmp-%ld", set_names[ev], (long)getpid());
        char *dir = path_join(o->out_dir, sname);
        if (dir == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
        os->stage[ev] = dir; /* freed with the outset */
        rc = cm_mkdirs(dir, errptr);
        for (uint32_t s = 0; rc == CM_OK && s < o->n_shards; s++) {
            char name[64];
            snprintf(name, sizeof name, "part-%05u.shard", s);
            char *path = path_join(dir, name);
            if (path == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
            else
                rc = ds_shard_writer_create_staged(path, schema, g->block_rows, stage,
                                                   &os->w[ev * o->n_shards + s], errptr);
            free(path);
        }
    }
    os->opened = 1;
    return rc;
}

/* The plan of the first input: its header's where the format has one (the base plan's schema
 * is empty until a header is read), which every later input had to match. */
static const ds_plan *first_plan(const ingest *g)
{
    return g->file_plans[0] ? g->file_plans[0] : g->base;
}

static void report_rejects(ingest *g, const chunk *c, uint64_t line_base, uint64_t *reported,
                           FILE *log)
{
    for (uint32_t i = 0; i < c->n_rej && *reported < g->o->max_reports; i++, (*reported)++) {
        const rej_detail *d = &c->rej[i];
        fprintf(log, "%s:%llu: malformed line skipped: %s", g->o->inputs[c->file],
                (unsigned long long)(line_base + d->line), ds_reject_name(d->reason));
        if (d->column) fprintf(log, " (column %u)", d->column);
        fputc('\n', log);
    }
}

static int write_chunk(ingest *g, outset *os, const chunk *c, char **errptr)
{
    uint32_t ns = g->o->n_shards;
    for (size_t i = 0; i < c->n_metas; i++) {
        int ev = c->meta_eval[i];
        ds_shard_writer *w = os->w[ev * ns + os->next_block[ev]++ % ns];
        int rc = ds_shard_writer_add_encoded(w, c->enc.p + c->metas[i].offset, &c->metas[i], errptr);
        if (rc != CM_OK) return rc;
    }
    return CM_OK;
}

static void progress(ingest *g, const ds_ingest_result *res, double t0, FILE *log, int final)
{
    double dt = cm_now() - t0;
    if (dt <= 0) dt = 1e-9;
    uint64_t bytes = __atomic_load_n(&g->bytes_in, __ATOMIC_RELAXED);
    fprintf(log, "\ringest: %llu rows, %.0f rows/s, %.1f MB/s%s", (unsigned long long)res->rows_in,
            (double)res->rows_in / dt, (double)bytes / dt / 1e6, final ? "\n" : "");
    fflush(log);
}

static int run_writer(ingest *g, outset *os, ds_ingest_result *res, double t0, char **errptr)
{
    const ds_ingest_opts *o = g->o;
    FILE *log = o->log ? o->log : stderr;
    uint64_t *line_base = calloc(o->n_inputs + 1, sizeof *line_base);
    uint64_t reported = 0;
    double last = cm_now();
    int rc = CM_OK;
    if (line_base == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    for (size_t f = 0; f < o->n_inputs; f++) line_base[f] = g->base->header ? 1 : 0;
    for (uint64_t seq = 0;; seq++) {
        pthread_mutex_lock(&g->mu);
        chunk *c = slot_of(g, seq);
        while (!(c->state == SLOT_DONE && c->seq == seq) &&
               !(g->reader_done && seq == g->published))
            pthread_cond_wait(&g->cv, &g->mu);
        int finished = !(c->state == SLOT_DONE && c->seq == seq);
        pthread_mutex_unlock(&g->mu);
        if (finished) break;
        /* Before anything of the chunk is reported or written: its text may be the zeros that
         * stand for a cut file's missing pages. */
        int cut = __atomic_load_n(&g->shrank, __ATOMIC_ACQUIRE);
        if (cut != 0) {
            rc = shrank_error(g, (uint32_t)cut - 1, errptr);
            break;
        }
        if (c->err != CM_OK) {
            rc = cm_err(errptr, c->err, "%s: %s", o->inputs[c->file],
                        c->errmsg ? c->errmsg : "out of memory");
            break;
        }
        if (!os->opened && (rc = open_outputs(g, os, &g->file_plans[c->file]->schema, errptr)))
            break;
        res->rows_in += c->lines;
        res->rows_rejected += c->rejected;
        res->rows_train += c->rows_out[0];
        res->rows_eval += c->rows_out[1];
        res->rows_written = res->rows_train + res->rows_eval;
        res->rows_padded += c->padded;
        for (int r = 0; r < DS_REJ__COUNT; r++) res->rejected_by_reason[r] += c->rej_counts[r];
        report_rejects(g, c, line_base[c->file], &reported, log);
        if (o->strict && c->rejected) {
            const rej_detail *d = &c->rej[0];
            rc = cm_err(errptr, CM_ECORRUPT, "%s:%llu: malformed line (%s, column %u); --strict stops here",
                        o->inputs[c->file], (unsigned long long)(line_base[c->file] + d->line),
                        ds_reject_name(d->reason), d->column);
            break;
        }
        if ((rc = write_chunk(g, os, c, errptr)) != CM_OK) break;
        line_base[c->file] += c->phys_lines;
        if (o->progress && cm_now() - last >= 0.5) {
            last = cm_now();
            progress(g, res, t0, log, 0);
        }
        pthread_mutex_lock(&g->mu);
        c->state = SLOT_EMPTY;
        pthread_cond_broadcast(&g->cv);
        pthread_mutex_unlock(&g->mu);
    }
    if (o->progress) progress(g, res, t0, log, 1);
    if (rc == CM_OK && g->reader_rc != CM_OK)
        rc = cm_err(errptr, g->reader_rc, "%s", g->reader_err ? g->reader_err : "input failed");
    if (rc == CM_OK && !os->opened) /* no chunk at all: empty shards */
        rc = open_outputs(g, os, &first_plan(g)->schema, errptr);
    if (res->rows_rejected && reported < res->rows_rejected) {
        fprintf(log, "ingest: %llu malformed lines in all (", (unsigned long long)res->rows_rejected);
        const char *sep = "";
        for (int r = 0; r < DS_REJ__COUNT; r++)
            if (res->rejected_by_reason[r]) {
                fprintf(log, "%s%s: %llu", sep, ds_reject_name(r),
                        (unsigned long long)res->rejected_by_reason[r]);
                sep = ", ";
            }
        fprintf(log, ")\n");
    }
    free(line_base);
    return rc;
}

/* ---- libffm field count ---- */

/* libffm files do not declare their fields; one extra pass finds the largest field id below
 * FFM_AUTO_FIELDS. Above it, an id is far more likely a damaged line than a field (real FFM
 * data has tens of fields): counted, one such line would give every row of the dataset a
 * million fields of offsets; uncounted, its line is a `feature` reject, and --ffm-fields takes
 * any count up to 2^20 where the data really has that many. */
#define FFM_AUTO_FIELDS 4096u
static int ffm_scan_fields(const ds_ingest_opts *o, uint32_t *n_fields, char **errptr)
{
    uint32_t max = 0;
    int any = 0, rc = CM_OK;
    size_t cap = 1u << 20;
    uint8_t *buf = malloc(cap);
    if (buf == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    for (size_t f = 0; rc == CM_OK && f < o->n_inputs; f++) {
        /* this pass would drain a pipe (`<(zcat x.ffm.gz)`, /dev/stdin), leaving the ingest
         * nothing to read: no rows, and success */
        struct stat st;
        if (stat(o->inputs[f], &st) == 0 && !S_ISREG(st.st_mode)) {
            rc = cm_err(errptr, CM_EINVAL,
                        "%s: not a regular file, which the libffm field count would read twice; "
                        "give it with --ffm-fields N",
                        o->inputs[f]);
            break;
        }
        ds_input *in = NULL;
        if ((rc = ds_input_open(o->inputs[f], &in, errptr)) != CM_OK) break;
        int state = 0; /* 0 label, 1 between tokens, 2 field digits, 3 rest of token */
        uint32_t field = 0;
        for (;;) {
            size_t got;
            if ((rc = ds_input_read(in, buf, cap, &got, errptr)) != CM_OK || got == 0) break;
            for (size_t i = 0; i < got; i++) {
                uint8_t ch = buf[i];
                if (ch == '\n') state = 0;
                else if (ch == ' ' || ch == '\t') state = state == 0 || state >= 2 ? 1 : state;
                else if (state == 1) state = ch >= '0' && ch <= '9' ? (field = ch - '0', 2) : 3;
                else if (state == 2 && ch >= '0' && ch <= '9')
                    field = field < (1u << 20) ? field * 10 + (ch - '0') : field;
                else if (state == 2) {
                    if (ch == ':' && field < FFM_AUTO_FIELDS) {
                        any = 1;
                        if (field > max) max = field;
                    }
                    state = 3;
                }
            }
        }
        ds_input_close(in);
    }
    free(buf);
    *n_fields = any ? max + 1 : 1;
    return rc;
}

/* ---- driver ---- */

void ds_ingest_opts_init(ds_ingest_opts *o)
{
    memset(o, 0, sizeof *o);
    ds_parser_opts_init(&o->parser);
    o->n_shards = 1;
    o->max_reports = 20;
}

void ds_ingest_result_json(const ds_ingest_result *r, FILE *to)
{
    double s = r->seconds > 0 ? r->seconds : 1e-9;
    fprintf(to,
            "{\"rows_in\": %llu, \"rows_written\": %llu, \"rows_rejected\": %llu, "
            "\"rows_train\": %llu, \"rows_eval\": %llu, \"rows_padded\": %llu, ",
            (unsigned long long)r->rows_in, (unsigned long long)r->rows_written,
            (unsigned long long)r->rows_rejected, (unsigned long long)r->rows_train,
            (unsigned long long)r->rows_eval, (unsigned long long)r->rows_padded);
    fprintf(to, "\"rejected_by_reason\": {");
    for (int i = 0; i < DS_REJ__COUNT; i++)
        fprintf(to, "%s\"%s\": %llu", i ? ", " : "", ds_reject_name(i),
                (unsigned long long)r->rejected_by_reason[i]);
    fprintf(to,
            "}, \"clicks\": %llu, \"bytes_in\": %llu, \"bytes_out\": %llu, \"seconds\": %.3f, "
            "\"mb_per_s\": %.1f, \"rows_per_s\": %.0f, \"threads\": %d}\n",
            (unsigned long long)r->clicks, (unsigned long long)r->bytes_in,
            (unsigned long long)r->bytes_out, r->seconds, (double)r->bytes_in / s / 1e6,
            (double)r->rows_in / s, r->threads);
}

static int prepare_out_dir(const char *dir, char **errptr)
{
    int rc = cm_mkdirs(dir, errptr);
    char *stats = rc == CM_OK ? path_join(dir, "stats.json") : NULL;
    if (rc == CM_OK)
        rc = stats ? cm_rmtree(stats, errptr) : cm_err(errptr, CM_ENOMEM, "out of memory");
    free(stats);
    /* A previous set leaves in one rename, then goes with the staging folders below: removed in
     * place, file by file, a run killed meanwhile left part of it, which a reader took for the
     * whole set. */
    for (int ev = 0; rc == CM_OK && ev < 2; ev++) {
        char aside[64];
        snprintf(aside, sizeof aside, "%s.tmp-old-%ld", set_names[ev], (long)getpid());
        char *p = path_join(dir, set_names[ev]), *q = path_join(dir, aside);
        if (p == NULL || q == NULL)
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        else if (rename(p, q) != 0 && errno != ENOENT)
            rc = cm_err_errno(errptr, CM_EIO, "cannot move %s aside", p);
        free(q);
        free(p);
    }
    /* staging folders of killed runs (train.tmp-<pid>, eval.tmp-<pid>) and the previous sets
     * moved aside: a set's worth of disk each */
    DIR *d = rc == CM_OK ? opendir(dir) : NULL;
    struct dirent *e;
    while (d != NULL && rc == CM_OK && (e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "train.tmp-", 10) != 0 && strncmp(e->d_name, "eval.tmp-", 9) != 0)
            continue;
        char *p = path_join(dir, e->d_name);
        rc = p ? cm_rmtree(p, errptr) : cm_err(errptr, CM_ENOMEM, "out of memory");
        free(p);
    }
    if (d != NULL) closedir(d);
    return rc;
}

static int check_opts(const ds_ingest_opts *o, char **errptr)
{
    if (o->n_inputs == 0 || o->inputs == NULL) return cm_err(errptr, CM_EINVAL, "no input files");
    if (o->out_dir == NULL || !*o->out_dir) return cm_err(errptr, CM_EINVAL, "no output directory");
    if (o->n_shards == 0 || o->n_shards > 100000)
        return cm_err(errptr, CM_EINVAL, "shard count must be 1..100000");
    if (!(o->eval_fraction >= 0 && o->eval_fraction < 1))
        return cm_err(errptr, CM_EINVAL, "eval fraction must be in [0, 1)");
    if (o->chunk_bytes && o->chunk_bytes < 64)
        return cm_err(errptr, CM_EINVAL, "chunk size must be at least 64 bytes");
    return CM_OK;
}

typedef struct file_id {
    dev_t dev;
    ino_t ino;
    size_t input;
} file_id;

static int cmp_file_id(const void *a, const void *b)
{
    const file_id *x = a, *y = b;
    if (x->dev != y->dev) return x->dev < y->dev ? -1 : 1;
    if (x->ino != y->ino) return x->ino < y->ino ? -1 : 1;
    return x->input < y->input ? -1 : x->input > y->input;
}

/* The same regular file given twice (a repeated glob, "x" and "./x") would have every row
 * ingested twice without a word; it is refused, naming both. Files are told apart by device
 * and inode, not by name, so a/part.tsv and b/part.tsv are two inputs. Paths that cannot be
 * stat'ed are left to the reader, which names them when it opens them. */
static int check_distinct_inputs(const ds_ingest_opts *o, char **errptr)
{
    int rc = CM_OK;
    size_t n = 0;
    file_id *ids = malloc(o->n_inputs * sizeof *ids);
    if (ids == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    for (size_t i = 0; i < o->n_inputs; i++) {
        struct stat st;
        if (stat(o->inputs[i], &st) == 0 && S_ISREG(st.st_mode))
            ids[n++] = (file_id){st.st_dev, st.st_ino, i};
    }
    qsort(ids, n, sizeof *ids, cmp_file_id);
    for (size_t i = 1; i < n && rc == CM_OK; i++)
        if (ids[i].dev == ids[i - 1].dev && ids[i].ino == ids[i - 1].ino)
            rc = cm_err(errptr, CM_EINVAL, "input %s is %s again: a file given twice",
                        o->inputs[ids[i].input], o->inputs[ids[i - 1].input]);
    free(ids);
    return rc;
}

static void finish_outputs(ingest *g, outset *os, int ok, ds_ingest_result *res, int *rc,
                           char **errptr)
{
    size_t n = 2 * (size_t)g->o->n_shards;
    for (size_t i = 0; i < n; i++) {
        if (os->w[i] == NULL) continue;
        if (ok && *rc == CM_OK) {
            res->bytes_out += ds_shard_writer_bytes(os->w[i]);
            *rc = ds_shard_writer_commit(os->w[i], errptr);
        } else {
            ds_shard_writer_abort(os->w[i]);
        }
        os->w[i] = NULL;
    }
}

/* Renames each staging folder, its shards all committed, to DIR/train or DIR/eval. */
static int publish_outputs(const ds_ingest_opts *o, outset *os, char **errptr)
{
    int rc = CM_OK;
    for (int ev = 0; rc == CM_OK && ev < 2; ev++) {
        if (os->stage[ev] == NULL) continue;
        char *dst = path_join(o->out_dir, set_names[ev]);
        if (dst == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
        if (rename(os->stage[ev], dst) != 0) {
            rc = cm_err_errno(errptr, CM_EIO, "cannot rename %s to %s", os->stage[ev], dst);
        } else {
            os->published[ev] = 1;
            free(os->stage[ev]);
            os->stage[ev] = NULL;
        }
        free(dst);
    }
    if (rc == CM_OK) rc = cm_fsync_dir(o->out_dir, errptr);
    return rc;
}

/* After a failure: no staging folder, and no set this run published (a failed run leaves no
 * shards). */
static void remove_outputs(const ds_ingest_opts *o, outset *os, int failed)
{
    for (int ev = 0; ev < 2; ev++) {
        if (os->stage[ev] != NULL) cm_rmtree(os->stage[ev], NULL);
        free(os->stage[ev]);
        os->stage[ev] = NULL;
        char *dst = failed && os->published[ev] ? path_join(o->out_dir, set_names[ev]) : NULL;
        if (dst != NULL) cm_rmtree(dst, NULL);
        free(dst);
    }
}

int ds_ingest_run(const ds_ingest_opts *o, ds_ingest_result *res, char **errptr)
{
    ingest g = {0};
    outset os = {0};
    ds_stats total = {0};
    ds_parser_opts po;
    int rc, mu_ok = 0;
    double t0 = cm_now();
    pthread_t reader;
    int reader_started = 0;
    memset(res, 0, sizeof *res);
    if ((rc = check_opts(o, errptr)) != CM_OK || (rc = check_distinct_inputs(o, errptr)) != CM_OK)
        return rc;
    g.o = o;
    g.chunk_bytes = o->chunk_bytes ? o->chunk_bytes : (size_t)4 << 20;
    g.block_rows = o->block_rows ? o->block_rows : DS_DEFAULT_BLOCK_ROWS;
    g.n_workers = o->threads > 0 ? o->threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (g.n_workers < 1) g.n_workers = 1;
    res->threads = g.n_workers;
    po = o->parser;
    if (po.format == DS_FMT_LIBFFM && po.ffm_fields == 0 &&
        (rc = ffm_scan_fields(o, &po.ffm_fields, errptr)) != CM_OK)
        goto out;
    if ((rc = ds_plan_create(&po, &g.base, errptr)) != CM_OK) goto out;
    if ((rc = prepare_out_dir(o->out_dir, errptr)) != CM_OK) goto out;
    g.file_plans = calloc(o->n_inputs, sizeof *g.file_plans);
    g.n_slots = (size_t)g.n_workers + 3;
    g.slots = calloc(g.n_slots, sizeof *g.slots);
    g.workers = calloc((size_t)g.n_workers, sizeof *g.workers);
    os.w = calloc(2 * (size_t)o->n_shards, sizeof *os.w);
    if (!g.file_plans || !g.slots || !g.workers || !os.w) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < g.n_slots; i++)
        if ((g.slots[i].buf = malloc(g.chunk_bytes)) == NULL) {
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
            goto out;
        }
    pthread_mutex_init(&g.mu, NULL);
    pthread_cond_init(&g.cv, NULL);
    mu_ok = 1;
    for (int i = 0; i < g.n_workers; i++) {
        worker *w = &g.workers[i];
        w->g = &g;
        if (ds_benc_init(&w->benc) != CM_OK) {
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
            break;
        }
        if (pthread_create(&w->tid, NULL, worker_main, w) != 0) {
            rc = cm_err(errptr, CM_ERR, "cannot start worker thread");
            break;
        }
        w->started = 1;
    }
    if (rc == CM_OK) {
        if (pthread_create(&reader, NULL, reader_main, &g) != 0) rc = cm_err(errptr, CM_ERR, "cannot start reader thread");
        else reader_started = 1;
    }
    if (rc == CM_OK) rc = run_writer(&g, &os, res, t0, errptr);
    pthread_mutex_lock(&g.mu);
    g.stop = 1;
    if (!reader_started) g.reader_done = 1;
    pthread_cond_broadcast(&g.cv);
    pthread_mutex_unlock(&g.mu);
    if (reader_started) pthread_join(reader, NULL);
    for (int i = 0; i < g.n_workers; i++)
        if (g.workers[i].started) pthread_join(g.workers[i].tid, NULL);
    res->bytes_in = g.bytes_in;
    if (rc == CM_OK) {
        const ds_plan *p0 = first_plan(&g);
        if (ds_stats_init(&total, p0->n_dense, p0->n_fields) != CM_OK)
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        for (int i = 0; rc == CM_OK && i < g.n_workers; i++)
            if (g.workers[i].stats.hll) ds_stats_merge(&total, &g.workers[i].stats);
        res->clicks = total.clicks;
        finish_outputs(&g, &os, 1, res, &rc, errptr);
        if (rc == CM_OK) rc = publish_outputs(o, &os, errptr);
        if (rc == CM_OK) {
            char *sp = path_join(o->out_dir, "stats.json");
            rc = sp ? ds_stats_write_json(&total, &p0->schema, sp, errptr)
                    : cm_err(errptr, CM_ENOMEM, "out of memory");
            free(sp);
        }
    }
out:
    if (os.w) finish_outputs(&g, &os, 0, res, &rc, errptr);
    remove_outputs(o, &os, rc != CM_OK);
    free(os.w);
    ds_stats_free(&total);
    for (int i = 0; g.workers && i < g.n_workers; i++) {
        ds_pctx_free(&g.workers[i].ctx);
        ds_stats_free(&g.workers[i].stats);
        ds_benc_free(&g.workers[i].benc);
    }
    free(g.workers);
    for (size_t i = 0; g.slots && i < g.n_slots; i++) {
        chunk *c = &g.slots[i];
        free(c->buf);
        ds_rows_free(&c->rows[0]);
        ds_rows_free(&c->rows[1]);
        ds_buf_free(&c->enc);
        free(c->metas);
        free(c->meta_eval);
        free(c->errmsg);
    }
    free(g.slots);
    for (size_t f = 0; g.file_plans && f < o->n_inputs; f++)
        if (g.file_plans[f] != g.base) ds_plan_destroy(g.file_plans[f]);
    free(g.file_plans);
    ds_plan_destroy(g.base);
    free(g.reader_err);
    if (mu_ok) {
        pthread_mutex_destroy(&g.mu);
        pthread_cond_destroy(&g.cv);
    }
    res->seconds = cm_now() - t0;
    return rc;
}
