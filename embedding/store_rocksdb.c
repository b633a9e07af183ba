/*
 * The "rocksdb" row store: one RocksDB database, key = the row key as 8 big-endian bytes (so
 * iteration is in key order), value = the whole record. It is a spill tier, not a durable
 * copy (snapshots are), so writes skip the WAL and values are stored uncompressed: float rows
 * barely compress and the spill's job is speed. Calls are thread-safe (RocksDB's handles are).
 */
#include <inttypes.h>
#include <rocksdb/c.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "embedding/internal.h"

typedef struct rdb {
    rocksdb_t *db;
    rocksdb_options_t *opts;
    rocksdb_block_based_table_options_t *tbl;
    rocksdb_column_family_handle_t *cf;
    rocksdb_readoptions_t *ropts;
    rocksdb_writeoptions_t *wopts;
    rocksdb_compactionfilter_t *filter;
    size_t rec;
    char *path;
    uint64_t dead_below; /* atomic: emb_store_set_dead_below's mark, read by compactions */
} rdb;

static void key_encode(uint64_t key, char out[8])
{
    for (int i = 7; i >= 0; i--, key >>= 8) out[i] = (char)(key & 0xff);
}

static void rdb_close(void *impl)
{
    rdb *r = impl;
    if (r == NULL) return;
    if (r->cf) rocksdb_column_family_handle_destroy(r->cf);
    if (r->db) rocksdb_close(r->db);
    if (r->opts) rocksdb_options_destroy(r->opts);
    if (r->filter) rocksdb_compactionfilter_destroy(r->filter); /* after the database */
    if (r->tbl) rocksdb_block_based_options_destroy(r->tbl);
    if (r->ropts) rocksdb_readoptions_destroy(r->ropts);
    if (r->wopts) rocksdb_writeoptions_destroy(r->wopts);
    free(r->path);
    free(r);
}

/* Removes the database at path the way RocksDB does (rocksdb_destroy_db): every file named as
 * RocksDB names its own, then the directory when that leaves it empty. Anything else there
 * stays, so a path shared with other files keeps them. A file it cannot remove is an error. */
static int rdb_remove(const rocksdb_options_t *opts, const char *path, const char *what,
                      char **errptr)
{
    char *err = NULL;
    rocksdb_destroy_db(opts, path, &err);
    if (err == NULL) return CM_OK;
    int rc = cm_err(errptr, CM_EIO, "cannot remove %s at %s: %s", what, path, err);
    free(err);
    return rc;
}

/* Closes the database first: RocksDB removes one only while it can take its lock. */
static int rdb_drop(void *impl, char **errptr)
{
    rdb *r = impl;
    if (r->cf) rocksdb_column_family_handle_destroy(r->cf);
    if (r->db) rocksdb_close(r->db);
    r->cf = NULL;
    r->db = NULL;
    int rc = rdb_remove(r->opts, r->path, "the RocksDB database", errptr);
    rdb_close(r);
    return rc;
}

/* Compactions drop records stamped below the expiry mark (emb_store_set_dead_below). A key's
 * older versions carry older stamps, so one the filter exposes is expired too. */
static unsigned char rdb_filter(void *state, int level, const char *key, size_t key_len,
                                const char *val, size_t val_len, char **new_val, size_t *new_len,
                                unsigned char *changed)
{
    (void)level, (void)key, (void)key_len, (void)new_val, (void)new_len;
    const rdb *r = state;
    *changed = 0;
    uint64_t below = __atomic_load_n(&r->dead_below, __ATOMIC_RELAXED);
    if (below == 0 || val_len < EMB_REC_HDR) return 0;
    return emb_rec_last_step(val) < below;
}

static const char *rdb_filter_name(void *state)
{
    (void)state;
    return "ember.expired";
}

static void rdb_filter_free(void *state)
{
    (void)state; /* the rdb outlives its filter */
}

static void rdb_set_dead_below(void *impl, uint64_t step)
{
    rdb *r = impl;
    __atomic_store_n(&r->dead_below, step, __ATOMIC_RELAXED);
}

static int rdb_compact(void *impl, char **errptr)
{
    rdb *r = impl;
    rocksdb_compact_range_cf(r->db, r->cf, NULL, 0, NULL, 0);
    (void)errptr; /* the C API reports nothing: a failed compaction leaves the files as they were */
    return CM_OK;
}

/* What a store and a writer (emb_store_writer) share: the table format, no compression, no
 * info log. */
static void rdb_base_options(rocksdb_options_t *o, rocksdb_block_based_table_options_t *tbl)
{
    /* Data blocks are read in place through mmap (rdb_open); a block cache would only copy each
     * 4 KiB block into an LRU that random point reads over a spill many times its size almost
     * never hit (measured: the copies and LRU upkeep were ~10% of a spilled pull). Index and
     * filter blocks are not cached either way: they live with the open table readers. */
    rocksdb_block_based_options_set_no_block_cache(tbl, 1);
    rocksdb_block_based_options_set_filter_policy(tbl, rocksdb_filterpolicy_create_bloom_full(10));
    /* A hash index inside each data block finds a key without the binary search over restart
     * points: every spill read is a point lookup. */
    rocksdb_block_based_options_set_data_block_index_type(
        tbl, rocksdb_block_based_table_data_block_index_type_binary_search_and_hash);
    rocksdb_options_set_block_based_table_factory(o, tbl);
    rocksdb_options_set_create_if_missing(o, 1);
    rocksdb_options_set_compression(o, rocksdb_no_compression);
    /* No info log beyond the header written at open (level 5, HEADER_LEVEL; the C API has no
     * name for it): on a full disk a log line fails like any write, and RocksDB 7.8 built with
     * assertions on (Debian's is) aborts the process at the log line after that. Errors reach
     * the caller through each call's status instead. */
    rocksdb_options_set_info_log_level(o, 5);
}

static int rdb_open(const char *path, size_t rec, void **impl, char **errptr)
{
    if (path == NULL || path[0] == '\0')
        return cm_err(errptr, CM_EINVAL, "rocksdb row store needs a path");
    rdb *r = calloc(1, sizeof *r);
    if (r == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    int rc = CM_OK;
    char *err = NULL;
    r->rec = rec;
    r->path = strdup(path);
    r->opts = rocksdb_options_create();
    r->tbl = rocksdb_block_based_options_create();
    r->ropts = rocksdb_readoptions_create();
    r->wopts = rocksdb_writeoptions_create();
    r->filter = rocksdb_compactionfilter_create(r, rdb_filter_free, rdb_filter, rdb_filter_name);
    if (r->path == NULL || !r->opts || !r->tbl || !r->ropts || !r->wopts || !r->filter) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        goto fail;
    }
    rdb_base_options(r->opts, r->tbl);
    rocksdb_options_set_compaction_filter(r->opts, r->filter);
    /* Point lookups and inserts dominate a spill tier, and a memtable skiplist costs a cache
     * miss per level: a small memtable stays in cache (measured: 64 MiB made every insert and
     * lookup several times slower on a 2-core box); flushed tables are found by bloom filter. */
    rocksdb_options_set_write_buffer_size(r->opts, 4u << 20);
    rocksdb_options_set_max_write_buffer_number(r->opts, 4);
    /* Almost every read misses all (up to 4) memtables, since they hold only the last few
     * thousand evictions: a whole-key bloom filter per memtable turns each of those skiplist
     * searches (~a third of a spill read) into one filter probe. */
    rocksdb_options_set_memtable_prefix_bloom_size_ratio(r->opts, 0.1);
    rocksdb_options_set_memtable_whole_key_filtering(r->opts, 1);
    rocksdb_options_set_level0_file_num_compaction_trigger(r->opts, 8);
    rocksdb_options_set_target_file_size_base(r->opts, 32u << 20);
    /* Reads through the page cache by mmap: no pread copy per block. */
    rocksdb_options_set_allow_mmap_reads(r->opts, 1);
    rocksdb_options_increase_parallelism(r->opts, 2);
    rocksdb_writeoptions_disable_WAL(r->wopts, 1);
    rocksdb_readoptions_set_verify_checksums(r->ropts, 1);
    if (cm_mkdirs(path, &err) != CM_OK) {
        rc = cm_err(errptr, CM_EIO, "cannot create spill directory %s: %s", path, err);
        goto fail;
    }
    /* Scratch from an earlier run is stale: start empty. A wipe that failed part way leaves
     * some of that run's files, which an open there could take up (a table of the same record
     * size would serve its records as rows), so it fails the open instead. */
    rc = rdb_remove(r->opts, path, "the earlier RocksDB database (to start empty)", errptr);
    if (rc != CM_OK) goto fail;
    const char *cf_names[1] = {"default"};
    const rocksdb_options_t *cf_opts[1] = {r->opts};
    r->db = rocksdb_open_column_families(r->opts, path, 1, cf_names, cf_opts, &r->cf, &err);
    if (err != NULL) {
        rc = cm_err(errptr, CM_EIO, "cannot open RocksDB spill database at %s: %s", path, err);
        r->db = NULL;
        r->cf = NULL;
        goto fail;
    }
    /* The wipe reports a file it could not remove, but takes a directory it could not list for
     * a missing one and removes nothing: a record here would be the earlier run's. */
    rocksdb_iterator_t *it = rocksdb_create_iterator_cf(r->db, r->ropts, r->cf);
    if (it == NULL) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        goto fail;
    }
    rocksdb_iter_seek_to_first(it);
    bool stale = rocksdb_iter_valid(it);
    rocksdb_iter_destroy(it);
    if (stale) {
        rc = cm_err(errptr, CM_EIO,
                    "RocksDB spill database at %s still holds records after the wipe", path);
        goto fail;
    }
    *impl = r;
    return CM_OK;
fail:
    free(err);
    rdb_close(r);
    return rc;
}

static int rdb_get(void *impl, const uint64_t *keys, size_t n, void *recs, uint8_t *found,
                   char **errptr)
{
    rdb *r = impl;
    if (n == 0) return CM_OK;
    int rc = CM_OK;
    char *kbuf = malloc(n * 8);
    const char **kptr = malloc(n * sizeof *kptr);
    size_t *klen = malloc(n * sizeof *klen);
    rocksdb_pinnableslice_t **vals = calloc(n, sizeof *vals);
    char **errs = calloc(n, sizeof *errs);
    if (!kbuf || !kptr || !klen || !vals || !errs) {
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        key_encode(keys[i], kbuf + i * 8);
        kptr[i] = kbuf + i * 8;
        klen[i] = 8;
    }
    rocksdb_batched_multi_get_cf(r->db, r->ropts, r->cf, n, kptr, klen, vals, errs, false);
    for (size_t i = 0; i < n; i++) {
        found[i] = 0;
        if (errs[i] != NULL) {
            if (rc == CM_OK)
                rc = cm_err(errptr, CM_EIO, "RocksDB read failed in %s: %s", r->path, errs[i]);
            continue;
        }
        if (vals[i] == NULL) continue;
        size_t vlen = 0;
        const char *v = rocksdb_pinnableslice_value(vals[i], &vlen);
        if (v == NULL) continue;
        if (vlen != r->rec) {
            if (rc == CM_OK)
                rc = cm_err(errptr, CM_ECORRUPT,
                            "RocksDB spill %s: record of %zu bytes, expected %zu", r->path, vlen,
                            r->rec);
            continue;
        }
        memcpy((char *)recs + i * r->rec, v, vlen);
        found[i] = 1;
    }
out:
    if (vals)
        for (size_t i = 0; i < n; i++)
            if (vals[i]) rocksdb_pinnableslice_destroy(vals[i]);
    if (errs)
        for (size_t i = 0; i < n; i++) free(errs[i]);
    free(kbuf);
    free(kptr);
    free(klen);
    free(vals);
    free(errs);
    return rc;
}

/* Writes one batch of puts (recs != NULL) or deletes (keys != NULL). */
static int rdb_write(rdb *r, const void *recs, const uint64_t *keys, size_t n, char **errptr)
{
    if (n == 0) return CM_OK;
    rocksdb_writebatch_t *wb = rocksdb_writebatch_create();
    if (wb == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        char k[8];
        if (recs != NULL) {
            const char *rec = (const char *)recs + i * r->rec;
            key_encode(emb_rec_key(rec), k);
            rocksdb_writebatch_put(wb, k, 8, rec, r->rec);
        } else {
            key_encode(keys[i], k);
            rocksdb_writebatch_delete(wb, k, 8);
        }
    }
    char *err = NULL;
    rocksdb_write(r->db, r->wopts, wb, &err);
    rocksdb_writebatch_destroy(wb);
    if (err != NULL) {
        int rc = cm_err(errptr, CM_EIO, "RocksDB write failed in %s: %s", r->path, err);
        free(err);
        return rc;
    }
    return CM_OK;
}

static int rdb_put(void *impl, const void *recs, size_t n, char **errptr)
{
    return rdb_write(impl, recs, NULL, n, errptr);
}

static int rdb_del(void *impl, const uint64_t *keys, size_t n, char **errptr)
{
    return rdb_write(impl, NULL, keys, n, errptr);
}

static int rdb_foreach(void *impl, emb_record_cb cb, void *arg, char **errptr)
{
    rdb *r = impl;
    rocksdb_iterator_t *it = rocksdb_create_iterator(r->db, r->ropts);
    if (it == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    int rc = CM_OK;
    for (rocksdb_iter_seek_to_first(it); rocksdb_iter_valid(it); rocksdb_iter_next(it)) {
        size_t vlen = 0;
        const char *v = rocksdb_iter_value(it, &vlen);
        if (vlen != r->rec) {
            rc = cm_err(errptr, CM_ECORRUPT, "RocksDB spill %s: record of %zu bytes, expected %zu",
                        r->path, vlen, r->rec);
            break;
        }
        rc = cb(v, arg);
        if (rc != 0) break;
    }
    char *err = NULL;
    if (rc == CM_OK) {
        rocksdb_iter_get_error(it, &err);
        if (err != NULL) rc = cm_err(errptr, CM_EIO, "RocksDB scan failed in %s: %s", r->path, err);
        free(err);
    }
    rocksdb_iter_destroy(it);
    return rc;
}

static int count_cb(const void *rec, void *arg)
{
    (void)rec;
    (*(uint64_t *)arg)++;
    return 0;
}

/* Exact, by a scan: the table keeps its own count on the hot path. */
static uint64_t rdb_count(const void *impl)
{
    uint64_t n = 0;
    rdb_foreach((void *)impl, count_cb, &n, NULL);
    return n;
}

/* RocksDB's own estimates of what it holds in memory: the memtables (live and those waiting to
 * be flushed) and the open tables' readers, whose index and filter blocks stay resident since
 * there is no block cache to hold them (rdb_open); the readers grow with the spilled rows. */
static uint64_t rdb_mem_bytes(const void *impl)
{
    const rdb *r = impl;
    uint64_t mem = 0, readers = 0;
    if (rocksdb_property_int(r->db, "rocksdb.cur-size-all-mem-tables", &mem) != 0) mem = 0;
    if (rocksdb_property_int(r->db, "rocksdb.estimate-table-readers-mem", &readers) != 0)
        readers = 0;
    return mem + readers;
}

const struct emb_store_ops emb_store_rocksdb_ops = {
    .kind = "rocksdb",
    .open = rdb_open,
    .close = rdb_close,
    .drop = rdb_drop,
    .get = rdb_get,
    .put = rdb_put,
    .del = rdb_del,
    .count = rdb_count,
    .mem_bytes = rdb_mem_bytes,
    .foreach = rdb_foreach,
    .set_dead_below = rdb_set_dead_below,
    .compact = rdb_compact,
};

/*
 * The writer (embedding.h). Memory, of the budget `mem`: while records come, a buffer of them
 * with a (key, index) entry each. A full buffer is sorted and appended to the runs' file as a
 * run (through the staging buffer: an eighth, at most 1 MiB). At the finish, a buffer that
 * never filled is the whole table: sorted, it goes straight into the table file, so a
 * buffered row is charged its cost there too. Else half the budget is the runs' read buffers,
 * for a merge of at most `fan` runs at a time (each read back WR_READ_LEAST bytes or more at a
 * time), and beside them the staging buffer (a merge into a longer run) or the table file being
 * built (the last merge). RocksDB's builder keeps 8 bytes of hash a key for the file's filter
 * until the file is finished, and its index: a file is cut every `file_rows` rows, WR_ROW_COST
 * bytes a row.
 */
#define WR_READ_LEAST 4096u
#define WR_ROW_COST 16u
#define WR_STAGE_MOST (1u << 20)

typedef struct wr_ent {
    uint64_t key, idx;
} wr_ent;

#define WR_LESS(x, y) ((x).key < (y).key)
CM_SORT_DEFINE(wr_sort, wr_ent, WR_LESS)

/* A run being merged: bytes [at, end) of the runs' file not read yet; buf[i, n) read and not
 * taken (cap bytes); its head's key. */
typedef struct wr_run {
    uint64_t at, end, key;
    uint8_t *buf;
    size_t i, n, cap;
} wr_run;

struct emb_store_writer {
    char *path;
    size_t rec;
    uint64_t mem;
    rocksdb_options_t *opts;
    rocksdb_block_based_table_options_t *tbl;
    rocksdb_envoptions_t *env;
    uint8_t *buf; /* cap records, n of them added since the last run */
    wr_ent *ord;
    size_t cap, n;
    uint8_t *stage; /* stage_n of stage_cap bytes waiting to be appended to a run */
    size_t stage_cap, stage_n;
    int fd, fd2;       /* the runs (-1 until the first); a merge pass's longer runs */
    uint64_t *run_end; /* run r: bytes [run_end[r - 1], run_end[r]) of fd */
    size_t runs, runs_cap;
    size_t fan;
    rocksdb_sstfilewriter_t *sst; /* the table file being built, file_rows rows a file */
    uint64_t file_rows, in_file;
    char **files; /* the table files, to be ingested */
    size_t n_files, files_cap;
    bool any, finished, has_twice;
    uint64_t last, twice;
};

/* Bytes a run is read back in at a time, at least: whole records, WR_READ_LEAST or more. */
static uint64_t wr_read_least(size_t rec)
{
    return (WR_READ_LEAST + rec - 1) / rec * rec;
}

uint64_t emb_store_writer_least(size_t record_bytes)
{
    /* A merge of 8 runs at least in half of it; runs of a few records at least. */
    return 16 * (wr_read_least(record_bytes ? record_bytes : 1) + sizeof(wr_run) + 4);
}

static int wr_no_mem(char **errptr)
{
    return cm_err(errptr, CM_ENOMEM, "out of memory");
}

int emb_store_writer_open(const char *path, size_t record_bytes, uint64_t mem,
                          emb_store_writer **out, char **errptr)
{
    if (path == NULL || path[0] == '\0')
        return cm_err(errptr, CM_EINVAL, "rocksdb writer needs a path");
    if (record_bytes < 8) return cm_err(errptr, CM_EINVAL, "record_bytes %zu < 8", record_bytes);
    if (mem < emb_store_writer_least(record_bytes))
        return cm_err(errptr, CM_EINVAL,
                      "%s: a memory budget of %" PRIu64 " bytes is too small for records of %zu "
                      "bytes: it needs at least %" PRIu64 " bytes",
                      path, mem, record_bytes, emb_store_writer_least(record_bytes));
    emb_store_writer *w = calloc(1, sizeof *w);
    if (w == NULL) return wr_no_mem(errptr);
    w->fd = w->fd2 = -1;
    w->rec = record_bytes;
    w->mem = mem;
    w->path = strdup(path);
    w->opts = rocksdb_options_create();
    w->tbl = rocksdb_block_based_options_create();
    w->env = rocksdb_envoptions_create();
    int rc = CM_OK;
    if (!w->path || !w->opts || !w->tbl || !w->env) rc = wr_no_mem(errptr);
    if (rc == CM_OK) {
        rdb_base_options(w->opts, w->tbl);
        /* Open only to take the table files in: nothing goes through a memtable, and with a
         * table cache of the least size (20 files, 10 for tables) the ingestion keeps few
         * tables' filters and indexes loaded (an unbounded cache loads every one). */
        rocksdb_options_set_write_buffer_size(w->opts, 64u << 10);
        rocksdb_options_set_max_open_files(w->opts, 20);
        rocksdb_options_set_disable_auto_compactions(w->opts, 1);
        w->stage_cap = (size_t)(mem / 8 < WR_STAGE_MOST ? mem / 8 : WR_STAGE_MOST);
        w->stage_cap = w->stage_cap / record_bytes * record_bytes;
        /* A row buffered costs its table file's builder too when the buffer, sorted, is the
         * whole table (no run written) and goes straight to the file. */
        w->cap = (size_t)((mem - w->stage_cap) / (record_bytes + sizeof(wr_ent) + WR_ROW_COST));
        w->fan = (size_t)(mem / 2 / (wr_read_least(record_bytes) + sizeof(wr_run) + 4));
        w->file_rows = mem / 2 / WR_ROW_COST;
        /* Pages are touched as records come: a small table takes little of a budget. */
        w->buf = malloc(w->cap * record_bytes);
        w->ord = malloc(w->cap * sizeof *w->ord);
        w->stage = malloc(w->stage_cap);
        if (!w->buf || !w->ord || !w->stage) rc = wr_no_mem(errptr);
    }
    /* A database there is an earlier one's (rdb_open): it goes, and the folder is made. */
    if (rc == CM_OK) rc = cm_mkdirs(path, errptr);
    if (rc == CM_OK) rc = rdb_remove(w->opts, path, "the earlier RocksDB database", errptr);
    if (rc == CM_OK) rc = cm_mkdirs(path, errptr);
    if (rc != CM_OK) {
        w->finished = true; /* nothing of its own to remove */
        emb_store_writer_close(w);
        return rc;
    }
    *out = w;
    return CM_OK;
}

/* Finishes the table file being built. */
static int wr_file_end(emb_store_writer *w, char **errptr)
{
    char *err = NULL;
    if (w->sst == NULL) return CM_OK;
    rocksdb_sstfilewriter_finish(w->sst, &err);
    rocksdb_sstfilewriter_destroy(w->sst);
    w->sst = NULL;
    int rc =
        err ? cm_err(errptr, CM_EIO, "cannot write %s: %s", w->files[w->n_files - 1], err) : CM_OK;
    free(err);
    return rc;
}

/* rec, the next in key order, into the table file being built (a new one when none is). */
static int wr_file_put(emb_store_writer *w, const uint8_t *rec, uint64_t key, char **errptr)
{
    char *err = NULL;
    if (w->sst == NULL) {
        if (w->n_files == w->files_cap) {
            size_t c = w->files_cap ? 2 * w->files_cap : 16;
            char **f = realloc(w->files, c * sizeof *f);
            if (f == NULL) return wr_no_mem(errptr);
            w->files = f;
            w->files_cap = c;
        }
        /* Not a name RocksDB gives its own files: it takes them in under names of its own. */
        size_t len = strlen(w->path) + 32;
        char *name = malloc(len);
        if (name == NULL) return wr_no_mem(errptr);
        snprintf(name, len, "%s/load-%06zu.sst", w->path, w->n_files);
        w->files[w->n_files++] = name;
        w->sst = rocksdb_sstfilewriter_create(w->env, w->opts);
        if (w->sst == NULL) return wr_no_mem(errptr);
        w->in_file = 0;
        rocksdb_sstfilewriter_open(w->sst, name, &err);
    }
    char k[8];
    key_encode(key, k);
    if (err == NULL) rocksdb_sstfilewriter_put(w->sst, k, 8, (const char *)rec, w->rec, &err);
    if (err != NULL) {
        int rc = cm_err(errptr, CM_EIO, "cannot write %s: %s", w->files[w->n_files - 1], err);
        free(err);
        return rc;
    }
    return ++w->in_file == w->file_rows ? wr_file_end(w, errptr) : CM_OK;
}

/* The staging buffer appended to fd at *off. */
static int wr_stage_flush(emb_store_writer *w, int fd, uint64_t *off, char **errptr)
{
    if (w->stage_n > 0 && cm_pwrite_full(fd, w->stage, w->stage_n, *off) != CM_OK)
        return cm_err_errno(errptr, CM_EIO, "cannot write a scratch file in %s", w->path);
    *off += w->stage_n;
    w->stage_n = 0;
    return CM_OK;
}

/* rec, the next of a sorted sequence (begun with w->any false), to a run in fd at *off through
 * the staging buffer, or (fd < 0) to the table files. A key equal to the one before is the
 * same key twice. */
static int wr_emit(emb_store_writer *w, int fd, uint64_t *off, const uint8_t *rec, char **errptr)
{
    const uint64_t key = emb_rec_key(rec);
    if (w->any && key == w->last) {
        w->has_twice = true;
        w->twice = key;
        return cm_err(errptr, CM_EINVAL, "key %" PRIu64 " twice", key);
    }
    w->any = true;
    w->last = key;
    if (fd < 0) return wr_file_put(w, rec, key, errptr);
    memcpy(w->stage + w->stage_n, rec, w->rec);
    w->stage_n += w->rec;
    return w->stage_n + w->rec > w->stage_cap ? wr_stage_flush(w, fd, off, errptr) : CM_OK;
}

/* Sorts the buffered records and emits them in order: to a new run at the end of fd, or (fd
 * < 0) to the table files. */
static int wr_spill(emb_store_writer *w, int fd, char **errptr)
{
    wr_sort(w->ord, w->n);
    int rc = CM_OK;
    if (fd >= 0 && w->runs == w->runs_cap) {
        size_t c = w->runs_cap ? 2 * w->runs_cap : 16;
        uint64_t *r = realloc(w->run_end, c * sizeof *r);
        if (r == NULL) return wr_no_mem(errptr);
        w->run_end = r;
        w->runs_cap = c;
    }
    uint64_t off = w->runs ? w->run_end[w->runs - 1] : 0;
    w->any = false;
    for (size_t i = 0; rc == CM_OK && i < w->n; i++)
        rc = wr_emit(w, fd, &off, w->buf + w->ord[i].idx * w->rec, errptr);
    if (rc == CM_OK && fd >= 0) rc = wr_stage_flush(w, fd, &off, errptr);
    if (rc == CM_OK && fd >= 0) w->run_end[w->runs++] = off;
    w->n = 0;
    return rc;
}

int emb_store_writer_add(emb_store_writer *w, const void *recs, size_t n, char **errptr)
{
    if (w->finished) return cm_err(errptr, CM_EINVAL, "%s: a record after the finish", w->path);
    int rc = CM_OK;
    for (size_t i = 0; rc == CM_OK && i < n; i++) {
        const uint8_t *r = (const uint8_t *)recs + i * w->rec;
        memcpy(w->buf + w->n * w->rec, r, w->rec);
        w->ord[w->n] = (wr_ent){emb_rec_key(r), w->n};
        if (++w->n < w->cap) continue;
        if (w->fd < 0) rc = cm_scratch_open(w->path, &w->fd, errptr);
        if (rc == CM_OK) rc = wr_spill(w, w->fd, errptr);
    }
    return rc;
}

/* r's head: the next part of the run read into buf once buf is used up (i == n: done). */
static int wr_run_head(const emb_store_writer *w, int fd, wr_run *r, char **errptr)
{
    if (r->i == r->n && r->at < r->end) {
        const size_t k = r->end - r->at < r->cap ? (size_t)(r->end - r->at) : r->cap;
        if (cm_pread_full(fd, r->buf, k, r->at) != CM_OK)
            return cm_err_errno(errptr, CM_EIO, "cannot read a scratch file in %s", w->path);
        r->at += k;
        r->i = 0;
        r->n = k;
    }
    if (r->i < r->n) r->key = emb_rec_key(r->buf + r->i);
    return CM_OK;
}

#define WR_RUN_LESS(a, b) ((a).key < (b).key)
CM_HEAP_SIFT_DEFINE(wr_sift, wr_run, WR_RUN_LESS)

/* Merges runs [r0, r1) of fd into one run at *off of out, or (out < 0) into the table files. */
static int wr_merge(emb_store_writer *w, int fd, size_t r0, size_t r1, int out, uint64_t *off,
                    char **errptr)
{
    const size_t k = r1 - r0;
    const uint64_t per = w->mem / 2 / k / w->rec * w->rec;
    wr_run *runs = calloc(k, sizeof *runs);
    uint32_t *h = malloc(k * sizeof *h);
    int rc = runs && h ? CM_OK : wr_no_mem(errptr);
    size_t live = 0;
    for (size_t r = 0; rc == CM_OK && r < k; r++) {
        wr_run *x = &runs[r];
        x->at = r0 + r ? w->run_end[r0 + r - 1] : 0;
        x->end = w->run_end[r0 + r];
        x->cap = (size_t)(x->end - x->at < per ? x->end - x->at : per);
        x->buf = malloc(x->cap ? x->cap : 1);
        rc = x->buf ? wr_run_head(w, fd, x, errptr) : wr_no_mem(errptr);
        if (rc == CM_OK && x->i < x->n) h[live++] = (uint32_t)r;
    }
    for (size_t i = live; rc == CM_OK && i-- > 0;)
        wr_sift(runs, h, live, i);
    w->any = false;
    while (rc == CM_OK && live > 0) {
        wr_run *x = &runs[h[0]];
        rc = wr_emit(w, out, off, x->buf + x->i, errptr);
        x->i += w->rec;
        if (rc == CM_OK) rc = wr_run_head(w, fd, x, errptr);
        if (x->i == x->n) h[0] = h[--live];
        wr_sift(runs, h, live, 0);
    }
    if (rc == CM_OK && out >= 0) rc = wr_stage_flush(w, out, off, errptr);
    for (size_t r = 0; runs && r < k; r++)
        free(runs[r].buf);
    free(runs);
    free(h);
    return rc;
}

/* Merges the runs, fan at a time, into longer runs until one merge of them all makes the
 * table files. */
static int wr_merge_all(emb_store_writer *w, char **errptr)
{
    int rc = CM_OK;
    while (rc == CM_OK && w->runs > w->fan) {
        const size_t groups = (w->runs + w->fan - 1) / w->fan;
        uint64_t *ends = malloc(groups * sizeof *ends), off = 0;
        if (ends == NULL) return wr_no_mem(errptr);
        if (w->fd2 < 0) rc = cm_scratch_open(w->path, &w->fd2, errptr);
        for (size_t g = 0; rc == CM_OK && g < groups; g++) {
            const size_t r1 = (g + 1) * w->fan < w->runs ? (g + 1) * w->fan : w->runs;
            rc = wr_merge(w, w->fd, g * w->fan, r1, w->fd2, &off, errptr);
            ends[g] = off;
        }
        free(w->run_end);
        w->run_end = ends;
        w->runs = w->runs_cap = groups;
        /* The longer runs are the runs now; the file of the shorter ones is emptied. */
        const int t = w->fd;
        w->fd = w->fd2;
        w->fd2 = t;
        if (rc == CM_OK && ftruncate(w->fd2, 0) != 0)
            rc = cm_err_errno(errptr, CM_EIO, "cannot truncate a scratch file in %s", w->path);
    }
    return rc == CM_OK ? wr_merge(w, w->fd, 0, w->runs, -1, NULL, errptr) : rc;
}

/* Opens the database (empty), takes the table files in (moved: linked under RocksDB's names,
 * then removed) and closes it. */
static int wr_ingest(emb_store_writer *w, char **errptr)
{
    char *err = NULL;
    int rc = CM_OK;
    rocksdb_t *db = rocksdb_open(w->opts, w->path, &err);
    if (err != NULL) {
        rc = cm_err(errptr, CM_EIO, "cannot create RocksDB database at %s: %s", w->path, err);
        free(err);
        return rc;
    }
    rocksdb_ingestexternalfileoptions_t *io = rocksdb_ingestexternalfileoptions_create();
    if (io == NULL) rc = wr_no_mem(errptr);
    if (rc == CM_OK && w->n_files > 0) {
        rocksdb_ingestexternalfileoptions_set_move_files(io, 1);
        rocksdb_ingest_external_file(db, (const char *const *)w->files, w->n_files, io, &err);
        if (err != NULL)
            rc = cm_err(errptr, CM_EIO, "cannot take the table files into %s: %s", w->path, err);
        free(err);
    }
    if (io) rocksdb_ingestexternalfileoptions_destroy(io);
    rocksdb_close(db);
    return rc;
}

int emb_store_writer_finish(emb_store_writer *w, char **errptr)
{
    if (w->finished) return cm_err(errptr, CM_EINVAL, "%s: finished already", w->path);
    int rc = CM_OK;
    if (w->runs == 0) {
        rc = wr_spill(w, -1, errptr); /* all in memory: straight to the table file */
    } else {
        if (w->n > 0) rc = wr_spill(w, w->fd, errptr);
        /* The buffer's memory becomes the runs' read buffers. */
        free(w->buf);
        free(w->ord);
        w->buf = NULL;
        w->ord = NULL;
        if (rc == CM_OK) rc = wr_merge_all(w, errptr);
    }
    if (rc == CM_OK) rc = wr_file_end(w, errptr);
    /* The runs are spent: their disk goes before the database is made. */
    if (w->fd >= 0) close(w->fd);
    if (w->fd2 >= 0) close(w->fd2);
    w->fd = w->fd2 = -1;
    if (rc == CM_OK) rc = wr_ingest(w, errptr);
    w->finished = rc == CM_OK;
    return rc;
}

int emb_store_writer_twice(const emb_store_writer *w, uint64_t *key)
{
    if (w->has_twice) *key = w->twice;
    return w->has_twice;
}

void emb_store_writer_close(emb_store_writer *w)
{
    if (w == NULL) return;
    if (w->sst) rocksdb_sstfilewriter_destroy(w->sst);
    if (w->fd >= 0) close(w->fd);
    if (w->fd2 >= 0) close(w->fd2);
    /* The table files' names: gone once ingested (moved), else ours to remove. */
    for (size_t i = 0; i < w->n_files; i++) {
        unlink(w->files[i]);
        free(w->files[i]);
    }
    if (!w->finished && w->opts) (void)rdb_remove(w->opts, w->path, "", NULL);
    if (!w->finished && w->path) rmdir(w->path); /* when that left it empty */
    if (w->opts) rocksdb_options_destroy(w->opts);
    if (w->tbl) rocksdb_block_based_options_destroy(w->tbl);
    if (w->env) rocksdb_envoptions_destroy(w->env);
    free(w->files);
    free(w->buf);
    free(w->ord);
    free(w->stage);
    free(w->run_end);
    free(w->path);
    free(w);
}
