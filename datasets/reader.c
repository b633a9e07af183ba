/* ds_reader: batches from shards. A prefetch thread decodes this worker's blocks (optionally in
 * a seeded order, through a seeded shuffle window) into a small ring of batch buffers that are
 * reused, so steady-state reading allocates nothing. */
#include <dirent.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "datasets/ds_internal.h"

typedef struct blk_ref {
    uint32_t file, block;
} blk_ref;

typedef struct slot {
    ds_rows rows;
    ds_batch view;
} slot;

struct ds_reader {
    ds_reader_opts o;
    char **paths;
    size_t n_paths, cap_paths;
    ds_shard_file *files;
    size_t n_files;
    blk_ref *mine;
    size_t n_mine;
    uint64_t rows;
    /* prefetch ring: produced counts filled slots, consumed those handed out, released those
     * given back (all but the one the caller holds) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t tid;
    int started;
    slot *slots;
    size_t n_slots;
    uint64_t produced, consumed, released;
    int done, stop, err_rc;
    char *err;
};

void ds_reader_opts_init(ds_reader_opts *o)
{
    memset(o, 0, sizeof *o);
    o->batch_size = 1024;
    o->n_workers = 1;
    o->n_epochs = 1;
    o->prefetch = 2;
}

static int add_path(ds_reader *r, const char *p)
{
    if (r->n_paths == r->cap_paths) {
        size_t c = r->cap_paths ? r->cap_paths * 2 : 16;
        char **np = realloc(r->paths, c * sizeof *np);
        if (np == NULL) return CM_ENOMEM;
        r->paths = np;
        r->cap_paths = c;
    }
    if ((r->paths[r->n_paths] = strdup(p)) == NULL) return CM_ENOMEM;
    r->n_paths++;
    return CM_OK;
}

static int ends_with(const char *s, const char *suf)
{
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

static int collect(ds_reader *r, const char *path, char **errptr)
{
    struct stat st;
    if (stat(path, &st) != 0) return cm_err_errno(errptr, CM_ENOTFOUND, "cannot open %s", path);
    if (!S_ISDIR(st.st_mode))
        return add_path(r, path) ? cm_err(errptr, CM_ENOMEM, "out of memory") : CM_OK;
    DIR *d = opendir(path);
    if (d == NULL) return cm_err_errno(errptr, CM_EIO, "cannot open directory %s", path);
    int rc = CM_OK;
    struct dirent *e;
    while (rc == CM_OK && (e = readdir(d)) != NULL) {
        if (!ends_with(e->d_name, ".shard")) continue;
        size_t n = strlen(path) + strlen(e->d_name) + 2;
        char *full = malloc(n);
        if (full == NULL) {
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
            break;
        }
        snprintf(full, n, "%s/%s", path, e->d_name);
        if (add_path(r, full)) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        free(full);
    }
    closedir(d);
    return rc;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* splitmix64: a tiny seeded generator; quality is ample for shuffling. */
static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rng_below(uint64_t *s, uint64_t n)
{
    return (uint64_t)(((unsigned __int128)rng_next(s) * n) >> 64);
}

/* Waits for a free slot; NULL when asked to stop. */
static slot *produce_slot(ds_reader *r)
{
    pthread_mutex_lock(&r->mu);
    while (!r->stop && r->produced - r->released >= r->n_slots) pthread_cond_wait(&r->cv, &r->mu);
    slot *s = r->stop ? NULL : &r->slots[r->produced % r->n_slots];
    pthread_mutex_unlock(&r->mu);
    if (s) ds_rows_clear(&s->rows);
    return s;
}

static void publish_slot(ds_reader *r, slot *s, uint32_t epoch)
{
    ds_rows_view(&s->rows, 0, s->rows.n_rows, &s->view);
    s->view.epoch = epoch;
    pthread_mutex_lock(&r->mu);
    r->produced++;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

static int run_epoch(ds_reader *r, uint32_t epoch, blk_ref *order, ds_rows *pool,
                     uint32_t **perm, size_t *perm_cap, ZSTD_DCtx *dctx, ds_buf *cbuf,
                     ds_buf *raw, char **errptr)
{
    const ds_reader_opts *o = &r->o;
    uint64_t rng = o->seed ^ (0xd1b54a32d192ed03ull * (epoch + 1));
    memcpy(order, r->mine, r->n_mine * sizeof *order);
    if (o->shuffle_rows)
        for (size_t i = r->n_mine; i > 1; i--) {
            size_t j = rng_below(&rng, i);
            blk_ref t = order[i - 1];
            order[i - 1] = order[j];
            order[j] = t;
        }
    slot *cur = NULL;
    size_t i = 0;
    while (i < r->n_mine) {
        ds_rows_clear(pool);
        do {
            const blk_ref *b = &order[i++];
            int rc = ds_shard_file_read_block(&r->files[b->file], b->block, dctx, cbuf, raw, pool,
                                              errptr);
            if (rc != CM_OK) return rc;
        } while (o->shuffle_rows && i < r->n_mine && pool->n_rows < o->shuffle_rows);
        size_t n = pool->n_rows;
        if (o->shuffle_rows) {
            if (n > *perm_cap) {
                uint32_t *p = realloc(*perm, n * sizeof *p);
                if (p == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
                *perm = p;
                *perm_cap = n;
            }
            for (size_t k = 0; k < n; k++) (*perm)[k] = (uint32_t)k;
            for (size_t k = n; k > 1; k--) {
                size_t j = rng_below(&rng, k);
                uint32_t t = (*perm)[k - 1];
                (*perm)[k - 1] = (*perm)[j];
                (*perm)[j] = t;
            }
        }
        ds_batch pv;
        ds_rows_view(pool, 0, n, &pv);
        for (size_t k = 0; k < n; k++) {
            if (cur == NULL && (cur = produce_slot(r)) == NULL) return CM_OK;
            size_t row = o->shuffle_rows ? (*perm)[k] : k;
            if (ds_rows_append_row(&cur->rows, &pv, row) != CM_OK)
                return cm_err(errptr, CM_ENOMEM, "out of memory");
            if (cur->rows.n_rows == o->batch_size) {
                publish_slot(r, cur, epoch);
                cur = NULL;
            }
        }
    }
    if (cur != NULL && cur->rows.n_rows > 0) publish_slot(r, cur, epoch);
    return CM_OK;
}

static void *prefetch_main(void *arg)
{
    ds_reader *r = arg;
    if (r->o.background) cm_thread_background();
    const ds_schema *s = ds_reader_schema(r);
    ds_rows pool;
    ds_buf cbuf = {0}, raw = {0};
    uint32_t *perm = NULL;
    size_t perm_cap = 0;
    char *err = NULL;
    int rc = CM_OK;
    ds_rows_init(&pool, s->n_dense, s->n_fields, s->has_weights);
    blk_ref *order = malloc((r->n_mine + 1) * sizeof *order);
    ZSTD_DCtx *dctx = ZSTD_createDCtx();
    if (order == NULL || dctx == NULL) rc = cm_err(&err, CM_ENOMEM, "out of memory");
    /* stop is read here without the lock (ds_reader_destroy sets it under the lock, atomically
     * for this read): only to skip the remaining epochs, produce_slot answers it under the lock. */
    for (uint32_t e = 0;
         rc == CM_OK && e < r->o.n_epochs && !__atomic_load_n(&r->stop, __ATOMIC_RELAXED); e++)
        rc = run_epoch(r, r->o.first_epoch + e, order, &pool, &perm, &perm_cap, dctx, &cbuf, &raw,
                       &err);
    ZSTD_freeDCtx(dctx);
    free(order);
    free(perm);
    ds_rows_free(&pool);
    ds_buf_free(&cbuf);
    ds_buf_free(&raw);
    pthread_mutex_lock(&r->mu);
    r->done = 1;
    r->err_rc = rc;
    r->err = err;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

static int assign_blocks(ds_reader *r, char **errptr)
{
    size_t total = 0;
    for (size_t f = 0; f < r->n_files; f++) total += r->files[f].n_blocks;
    r->mine = malloc((total / r->o.n_workers + 1) * sizeof *r->mine);
    if (r->mine == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    uint64_t b = 0;
    for (size_t f = 0; f < r->n_files; f++)
        for (uint32_t k = 0; k < r->files[f].n_blocks; k++, b++)
            if (b % r->o.n_workers == r->o.worker) {
                r->mine[r->n_mine++] = (blk_ref){(uint32_t)f, k};
                r->rows += r->files[f].idx[k].n_rows;
            }
    return CM_OK;
}

int ds_reader_open(const ds_reader_opts *opts, ds_reader **out, char **errptr)
{
    int rc = CM_OK;
    ds_reader *r = calloc(1, sizeof *r);
    if (r == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    r->o = *opts;
    if (r->o.batch_size == 0) r->o.batch_size = 1024;
    if (r->o.n_workers == 0) r->o.n_workers = 1;
    if (r->o.prefetch == 0) r->o.prefetch = 1;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    if (r->o.worker >= r->o.n_workers) {
        rc = cm_err(errptr, CM_EINVAL, "worker %u is not below worker count %u", r->o.worker,
                    r->o.n_workers);
        goto out;
    }
    for (size_t i = 0; rc == CM_OK && i < opts->n_paths; i++) rc = collect(r, opts->paths[i], errptr);
    if (rc != CM_OK) goto out;
    if (r->n_paths == 0) {
        rc = cm_err(errptr, CM_ENOTFOUND, "no shard files (*.shard) found in %s%s",
                    opts->n_paths ? opts->paths[0] : "(no path given)",
                    opts->n_paths > 1 ? " and the other paths given" : "");
        goto out;
    }
    qsort(r->paths, r->n_paths, sizeof *r->paths, cmp_str);
    r->files = calloc(r->n_paths, sizeof *r->files);
    if (r->files == NULL) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < r->n_paths; i++) {
        if ((rc = ds_shard_file_open(r->paths[i], &r->files[i], errptr)) != CM_OK) goto out;
        r->n_files++;
        if (!ds_schema_equal(&r->files[0].plan->schema, &r->files[i].plan->schema)) {
            rc = cm_err(errptr, CM_EINVAL, "shard %s has a different schema than %s",
                        r->paths[i], r->paths[0]);
            goto out;
        }
    }
    if ((rc = assign_blocks(r, errptr)) != CM_OK) goto out;
    r->n_slots = (size_t)r->o.prefetch + 1;
    r->slots = calloc(r->n_slots, sizeof *r->slots);
    if (r->slots == NULL) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        goto out;
    }
    const ds_schema *s = ds_reader_schema(r);
    for (size_t i = 0; i < r->n_slots; i++) {
        ds_rows *rows = &r->slots[i].rows;
        ds_rows_init(rows, s->n_dense, s->n_fields, s->has_weights);
        if (ds_rows_reserve_rows(rows, r->o.batch_size) != CM_OK) {
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
            goto out;
        }
    }
    if (pthread_create(&r->tid, NULL, prefetch_main, r) != 0) {
        rc = cm_err(errptr, CM_ERR, "cannot start prefetch thread");
        goto out;
    }
    r->started = 1;
out:
    if (rc != CM_OK) {
        ds_reader_destroy(r);
        return rc;
    }
    *out = r;
    return CM_OK;
}

const ds_schema *ds_reader_schema(const ds_reader *r)
{
    return &r->files[0].plan->schema;
}

uint64_t ds_reader_rows(const ds_reader *r)
{
    return r->rows;
}

int ds_reader_next(ds_reader *r, const ds_batch **out, char **errptr)
{
    int rc;
    pthread_mutex_lock(&r->mu);
    if (r->released < r->consumed) {
        r->released = r->consumed; /* the caller is done with the previous batch */
        pthread_cond_broadcast(&r->cv);
    }
    while (r->consumed == r->produced && !r->done) pthread_cond_wait(&r->cv, &r->mu);
    if (r->consumed < r->produced) {
        *out = &r->slots[r->consumed++ % r->n_slots].view;
        rc = 1;
    } else if (r->err_rc != CM_OK) {
        rc = cm_err(errptr, r->err_rc, "%s", r->err ? r->err : "read failed");
    } else {
        *out = NULL;
        rc = 0;
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

void ds_reader_destroy(ds_reader *r)
{
    if (r == NULL) return;
    if (r->started) {
        pthread_mutex_lock(&r->mu);
        /* Atomic: prefetch_main's epoch loop reads it without the lock. */
        __atomic_store_n(&r->stop, 1, __ATOMIC_RELAXED);
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
        pthread_join(r->tid, NULL);
    }
    for (size_t i = 0; r->slots && i < r->n_slots; i++) ds_rows_free(&r->slots[i].rows);
    free(r->slots);
    for (size_t i = 0; i < r->n_files; i++) ds_shard_file_close(&r->files[i]);
    free(r->files);
    for (size_t i = 0; i < r->n_paths; i++) free(r->paths[i]);
    free(r->paths);
    free(r->mine);
    free(r->err);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}
