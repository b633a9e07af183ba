/*
 * The "rocksdb" row store: one RocksDB database, key = the row key as 8 big-endian bytes (so
 * iteration is in key order), value = the whole record. It is a spill tier, not a durable
 * copy (snapshots are), so writes skip the WAL and values are stored uncompressed: float rows
 * barely compress and the spill's job is speed. Calls are thread-safe (RocksDB's handles are).
 */
#include <rocksdb/c.h>
#include <stdlib.h>

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
    /* Data blocks are read in place through mmap (below); a block cache would only copy each
     * 4 KiB block into an LRU that random point reads over a spill many times its size almost
     * never hit (measured: the copies and LRU upkeep were ~10% of a spilled pull). Index and
     * filter blocks are not cached either way: they live with the open table readers. */
    rocksdb_block_based_options_set_no_block_cache(r->tbl, 1);
    rocksdb_block_based_options_set_filter_policy(r->tbl, rocksdb_filterpolicy_create_bloom_full(10));
    /* A hash index inside each data block finds a key without the binary search over restart
     * points: every spill read is a point lookup. */
    rocksdb_block_based_options_set_data_block_index_type(
        r->tbl, rocksdb_block_based_table_data_block_index_type_binary_search_and_hash);
    rocksdb_options_set_block_based_table_factory(r->opts, r->tbl);
    rocksdb_options_set_compaction_filter(r->opts, r->filter);
    rocksdb_options_set_create_if_missing(r->opts, 1);
    rocksdb_options_set_compression(r->opts, rocksdb_no_compression);
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
    /* No info log beyond the header written at open (level 5, HEADER_LEVEL; the C API has no
     * name for it): on a full disk a log line fails like any write, and RocksDB 7.8 built with
     * assertions on (Debian's is) aborts the process at the log line after that. Errors reach
     * the caller through each call's status instead. */
    rocksdb_options_set_info_log_level(r->opts, 5);
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
