/*
 * ember export: a training checkpoint to a serving bundle (or safetensors, or RocksDB).
 * A delta (--since OLD) holds the rows whose weights changed since OLD, the rows OLD had that
 * are gone, and the new tower: stacked on OLD's bundle it serves what a full export serves.
 */
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "ps/ps.h"
#include "serve/ember_serve.h"
#include "src/cli.h"
#include "src/train.h"

/*
 * Memory: export streams each table (ps_checkpoint_foreach_row reads snapshots in chunks) into
 * its output a chunk of rows at a time, so a table larger than memory (the PS spills cold rows
 * to RocksDB) exports in memory that does not grow with its rows. What needs every key is kept
 * on disk: the bundle writer's index (cm_keyidx, common.h), which refuses a key twice, for
 * safetensors a cm_keyset of the keys, and for RocksDB the sorted runs of the rows that its
 * writer (emb_store_writer, embedding.h) merges into table files, which refuses a key twice
 * too; each in --memory bytes and scratch files beside (or in) the output when they do not
 * fit. Sizes
 * come from the snapshots' manifests (ps_checkpoint_table_rows). A delta compares the new
 * checkpoint's rows, as they stream, against a map of the OLD checkpoint's keys to fingerprints
 * of their weights (fp_map: ~17 bytes a row), held when it fits --memory. When it does not
 * (fp_parts), both checkpoints' (key, fingerprint) pairs are spread over partitions by a hash
 * of the key (cm_parts, common.h), into scratch files in the bundle's folder; each partition
 * of OLD, sized to fit, is then held and the same partition of the new checkpoint streamed
 * against it, which leaves a byte a row saying whether the row changed (in the new stream's
 * order within the partition: the partition of a key is known from the key alone) and OLD's
 * keys not seen, the deleted ones. The new checkpoint's rows are then streamed a second time,
 * as they are with the map, each taking the next flag of its key's partition: the changed rows
 * reach the writer in the same order as with the map, and the bundle is the same bytes.
 * OLD's keys not seen, ascending within each partition, go to a scratch file and reach the
 * writer merged (ember_serve_writer_table_deleted, a piece at a time). Memory: --memory for
 * the pairs' buffers, then a partition of OLD, then the flags' (and the deleted keys') buffers
 * of at most 64 KiB a partition beside the bundle's index; disk: 16 bytes a row of both
 * checkpoints, a byte a row of the new one and 8 a deleted key.
 */

/* A chunk of streamed rows, handed on when full (and last when the table ends). */
typedef struct chunk {
    uint32_t dim;
    size_t cap, n;
    uint64_t *keys;
    float *w;
} chunk;

#define CHUNK_BYTES (1u << 20)

/* The delta's view of OLD: its rows' keys (ascending) with the xxh3 of their weights, a
 * directory of where each value of the keys' top `bits` bits starts (keys of trained tables are
 * hashes, so a few entries each; a binary search within copes with any), and which keys the new
 * checkpoint has (seen). ~17 bytes a row of OLD: the one thing export keeps per row. */
typedef struct fp_ent {
    uint64_t key, fp;
} fp_ent;

typedef struct fp_map {
    fp_ent *e;
    uint64_t n, cap, *dir;
    unsigned bits;
    uint8_t *seen;
} fp_map;

static void fp_map_free(fp_map *m)
{
    free(m->e);
    free(m->dir);
    free(m->seen);
    memset(m, 0, sizeof *m);
}

/* Sorts a by key in place (CM_SORT_DEFINE: glibc's qsort would double the map's memory). */
#define FP_LESS(x, y) ((x).key < (y).key)
CM_SORT_DEFINE(fp_sort, fp_ent, FP_LESS)

/* The index of key in m, or -1. */
static int64_t fp_map_find(const fp_map *m, uint64_t key)
{
    uint64_t b = m->bits ? key >> (64 - m->bits) : 0, lo = m->dir[b], hi = m->dir[b + 1];
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (m->e[mid].key == key) return (int64_t)mid;
        if (m->e[mid].key < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    return -1;
}

/* A key twice in a table: a snapshot is input (hand-made, another tool's), checksums and all,
 * and the reader keeps no set of keys (ps_checkpoint_foreach_row). A row is read only from the
 * shard its key hashes to, so both copies are in that shard's snapshot, which is named. */
static int dup_err(const char *ckpt, const char *name, uint64_t key, char **errptr)
{
    uint32_t shards = 0;
    int rc = ps_checkpoint_shards(ckpt, &shards, errptr);
    if (rc == CM_OK)
        rc = cm_err(errptr, CM_ECORRUPT, "%s/shard-%u/table-%s: key %" PRIu64 " twice", ckpt,
                    ps_key_shard(key, shards), name, key);
    return rc;
}

/* What refuses a key twice where the output has no index of its own (safetensors):
 * a cm_keyset of the table's keys in mem bytes (--memory), its files, when they do not fit, in
 * a scratch folder beside the output. */
static int keys_open(const char *out, uint64_t n, uint64_t mem, cm_keyset **ks, char **errptr)
{
    static unsigned seq;
    char dir[4300];
    snprintf(dir, sizeof dir, "%s.keys-%ld-%u", out, (long)getpid(), seq++);
    return cm_keyset_create(dir, n, mem, ks, errptr);
}

/* One pass over a table of a checkpoint. Every row is counted and summed into the table's
 * order-free digest, and its key into an order-bound hash (two passes over one checkpoint see
 * the rows in one order); with old, rows unchanged since old are passed over (and, with mark,
 * the keys seen marked there); with check, keys go into it; with fn, the rows left are handed
 * on in chunks. */
typedef struct stream {
    const char *ckpt, *name;
    uint32_t dim;
    uint64_t rows, sum, order, changed;
    fp_map *old;
    bool mark;
    struct fp_parts *parts;
    cm_keyset *check;
    int (*fn)(const chunk *c, void *arg, char **errptr);
    void *arg;
    chunk c;
    char **errptr;
} stream;

/* The delta's view of OLD spread over partitions (the design above). */
typedef struct fp_parts {
    uint32_t n;          /* partitions (0: OLD is held whole, as an fp_map) */
    cm_parts *old, *new; /* (key, fingerprint) pairs of each checkpoint */
    bool flagged;        /* the flags are made: the second pass over the new rows takes them */
    char flags_path[4400];
    int fd;        /* the flags: each partition's, one after the other */
    uint64_t *off; /* where each partition's flags start in the file */
    uint64_t *at;  /* flags of each partition taken into its buffer */
    uint8_t *buf;  /* n x cap flags */
    size_t cap, *pos, *len;
    /* OLD's keys the new checkpoint has not: each partition's, ascending, one after the other
     * in a scratch file, merged to the writer at the end. */
    char del_path[4400];
    int del_fd;
    uint64_t *del_off, *del_n, n_del;
} fp_parts;

/* Refills partition p's part of f->buf (f->cap bytes: items of `size` bytes) from fd, where its
 * `count` items start at item `first`: f->len[p] of them (0 when none is left). */
static int part_refill(fp_parts *f, uint32_t p, int fd, const char *path, size_t size,
                       uint64_t first, uint64_t count, char **errptr)
{
    const size_t per = f->cap / size;
    const uint64_t left = count - f->at[p];
    f->len[p] = left < per ? (size_t)left : per;
    f->pos[p] = 0;
    if (f->len[p] && cm_pread_full(fd, f->buf + (size_t)p * per * size, f->len[p] * size,
                                   (first + f->at[p]) * size))
        return cm_err_errno(errptr, CM_EIO, "cannot read %s", path);
    f->at[p] += f->len[p];
    return CM_OK;
}

/* Whether the next row of s's table, of key `key`, changed (*changed): the next flag of its
 * partition. CM_ECORRUPT when the partition has none left (the rows changed since they were
 * spread). */
static int fp_parts_flag(const stream *s, uint64_t key, bool *changed)
{
    fp_parts *f = s->parts;
    const uint32_t p = cm_part_of(key, f->n);
    if (f->pos[p] == f->len[p]) {
        int rc = part_refill(f, p, f->fd, f->flags_path, 1, f->off[p], cm_parts_count(f->new, p),
                             s->errptr);
        if (rc != CM_OK) return rc;
        if (f->len[p] == 0)
            return cm_err(s->errptr, CM_ECORRUPT, "%s: table %s changed while it was exported",
                          s->ckpt, s->name);
    }
    *changed = f->buf[(size_t)p * f->cap + f->pos[p]++];
    return CM_OK;
}

static int stream_row(const emb_row *r, void *arg)
{
    stream *s = arg;
    const size_t bytes = s->dim * sizeof(float);
    s->rows++;
    s->sum += XXH3_64bits_withSeed(r->weights, bytes, r->key);
    s->order = XXH3_64bits_withSeed(&r->key, sizeof r->key, s->order);
    if (s->check != NULL) {
        int rc = cm_keyset_add(s->check, r->key, s->errptr);
        if (rc != CM_OK) return rc;
    }
    if (s->parts != NULL && !s->parts->flagged) {
        /* The first pass: the pairs spread (and nothing handed on). */
        const fp_ent e = {r->key, XXH3_64bits(r->weights, bytes)};
        return cm_parts_add(s->parts->new, &e, s->errptr);
    }
    if (s->parts != NULL) {
        bool changed = false;
        int rc = fp_parts_flag(s, r->key, &changed);
        if (rc != CM_OK || !changed) return rc;
        s->changed++;
    }
    if (s->old != NULL) {
        int64_t i = fp_map_find(s->old, r->key);
        if (i >= 0 && s->mark) {
            /* A key the old checkpoint has, twice in the new: the writer never sees an
             * unchanged row, so it is caught here. */
            uint8_t *b = &s->old->seen[i / 8], bit = (uint8_t)(1u << (i % 8));
            if (*b & bit) return dup_err(s->ckpt, s->name, r->key, s->errptr);
            *b |= bit;
        }
        if (i >= 0 && s->old->e[i].fp == XXH3_64bits(r->weights, bytes)) return 0;
        s->changed++;
    }
    if (s->fn == NULL) return 0;
    s->c.keys[s->c.n] = r->key;
    memcpy(s->c.w + s->c.n * s->dim, r->weights, bytes);
    if (++s->c.n < s->c.cap) return 0;
    int rc = s->fn(&s->c, s->arg, s->errptr);
    s->c.n = 0;
    return rc;
}

/* Streams table name of ckpt through s (set up by the caller past ckpt, name and errptr). */
static int stream_table(stream *s, char **errptr)
{
    emb_table_config cfg;
    int rc = ps_checkpoint_table_config(s->ckpt, s->name, &cfg, errptr);
    if (rc != CM_OK) return rc;
    s->dim = cfg.dim;
    s->rows = s->sum = s->order = s->changed = 0;
    s->errptr = errptr;
    s->c = (chunk){.dim = cfg.dim, .cap = CHUNK_BYTES / (8 + 4 * (size_t)cfg.dim) + 1};
    if (s->fn != NULL) {
        s->c.keys = malloc(s->c.cap * sizeof *s->c.keys);
        s->c.w = malloc(s->c.cap * cfg.dim * sizeof *s->c.w);
        if (s->c.keys == NULL || s->c.w == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    if (rc == CM_OK) rc = ps_checkpoint_foreach_row(s->ckpt, s->name, stream_row, s, errptr);
    if (rc == CM_OK && s->fn != NULL && s->c.n > 0) rc = s->fn(&s->c, s->arg, errptr);
    bool twice = false;
    uint64_t key = 0;
    if (rc == CM_OK && s->check != NULL) rc = cm_keyset_twice(s->check, &twice, &key, errptr);
    if (rc == CM_OK && twice) rc = dup_err(s->ckpt, s->name, key, errptr);
    if (rc == CM_ENOMEM) rc = cm_err(errptr, rc, "out of memory reading table %s", s->name);
    free(s->c.keys);
    free(s->c.w);
    s->c.keys = NULL;
    s->c.w = NULL;
    return rc;
}

/* A table's part of a checkpoint's identity: its name, dim, row count and the sum of its rows'
 * hashes (free of order: a resharded checkpoint holds the same). */
static uint64_t table_digest(const stream *s)
{
    uint64_t v[3] = {s->dim, s->rows, s->sum};
    return XXH3_64bits_withSeed(v, sizeof v, XXH3_64bits(s->name, strlen(s->name)));
}

/* A checkpoint's identity (ember_serve_writer_source): its tables' digests and its tower. */
static uint64_t content_id(const uint64_t *digests, uint32_t n, const float *tower,
                           uint64_t n_tower)
{
    return XXH3_64bits_withSeed(digests, n * sizeof *digests,
                                XXH3_64bits(tower, n_tower * sizeof *tower));
}

static int fp_add(const emb_row *r, void *arg)
{
    stream *s = arg;
    const size_t bytes = s->dim * sizeof(float);
    const fp_ent e = {r->key, XXH3_64bits(r->weights, bytes)};
    if (s->rows == s->changed) /* more rows than the manifests say: the reader refuses that */
        return cm_err(s->errptr, CM_ECORRUPT, "%s: table %s has more rows than its manifests say",
                      s->ckpt, s->name);
    s->rows++;
    s->sum += XXH3_64bits_withSeed(r->weights, bytes, r->key);
    if (s->parts != NULL) return cm_parts_add(s->parts->old, &e, s->errptr);
    s->old->e[s->old->n++] = e;
    return 0;
}

/* The directory's bits for n keys: a few keys a value. */
static unsigned fp_bits(uint64_t n)
{
    unsigned bits = 0;
    while (bits < 40 && (n >> bits) > 8)
        bits++;
    return bits;
}

/* The bytes an fp_map of n keys takes. */
static uint64_t fp_map_bytes(uint64_t n)
{
    return n * sizeof(fp_ent) + 1 + ((1ull << fp_bits(n)) + 1) * sizeof(uint64_t) + n / 8 + 1;
}

/* Makes m's n entries (of table name of ckpt) a map: sorted, a key twice refused, the
 * directory and the seen bits made. */
static int fp_map_index(fp_map *m, const char *ckpt, const char *name, char **errptr)
{
    fp_sort(m->e, m->n);
    for (uint64_t i = 1; i < m->n; i++)
        if (m->e[i].key == m->e[i - 1].key) return dup_err(ckpt, name, m->e[i].key, errptr);
    m->bits = fp_bits(m->n);
    const uint64_t nb = 1ull << m->bits;
    m->dir = malloc((nb + 1) * sizeof *m->dir);
    m->seen = calloc(m->n / 8 + 1, 1);
    if (m->dir == NULL || m->seen == NULL)
        return cm_err(errptr, CM_ENOMEM, "out of memory for %" PRIu64 " keys of %s", m->n, ckpt);
    for (uint64_t b = 0, i = 0; b <= nb; b++) {
        while (i < m->n && (m->bits ? m->e[i].key >> (64 - m->bits) : 0) < b)
            i++;
        m->dir[b] = b == nb ? m->n : i;
    }
    return CM_OK;
}

/* The old keys the new checkpoint does not have, ascending, in place of m's entries. */
static uint64_t *fp_map_unseen(fp_map *m, uint64_t *n)
{
    uint64_t *out = (uint64_t *)m->e, k = 0;
    for (uint64_t i = 0; i < m->n; i++)
        if (!(m->seen[i / 8] & (1u << (i % 8)))) out[k++] = m->e[i].key;
    *n = k;
    return out;
}

/* Pairs of the new checkpoint a partition streams against OLD's at once (with their flags:
 * 68 KiB), and the least a partition buffers (4 KiB writes and reads). */
#define FLAG_CHUNK 4096u
#define FLAG_CHUNK_BYTES (FLAG_CHUNK * (sizeof(fp_ent) + 1))
#define PART_LEAST 4096u
#define FLAG_READ (64u << 10)

/* How the delta's view of n rows of OLD keeps to mem bytes: 1 partition (the map, whole), or
 * n_parts of a partition's buffers of *cap bytes each; 0 when mem is too little. A partition's
 * map is given 5/4 of an even share: the spread of a hash. */
static uint32_t fp_plan(uint64_t n, uint64_t mem, size_t *cap)
{
    *cap = 0;
    if (fp_map_bytes(n) <= mem) return 1;
    if (mem <= 2 * FLAG_CHUNK_BYTES) return 0;
    const double parts = ceil(1.25 * (double)fp_map_bytes(n) / (double)(mem - FLAG_CHUNK_BYTES));
    if (parts > UINT32_MAX || (double)mem / parts < PART_LEAST) return 0;
    *cap = (size_t)((double)mem / parts);
    return (uint32_t)parts;
}

/* The least mem fp_plan takes for n rows. */
static uint64_t fp_least(uint64_t n)
{
    size_t cap;
    uint64_t lo = 1, hi = fp_map_bytes(n);
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (fp_plan(n, mid, &cap) != 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return hi;
}

static void fp_parts_free(fp_parts *f)
{
    cm_parts_destroy(f->old);
    cm_parts_destroy(f->new);
    if (f->fd >= 0) close(f->fd);
    free(f->off);
    free(f->at);
    free(f->buf);
    free(f->pos);
    free(f->len);
    if (f->del_fd >= 0) close(f->del_fd);
    free(f->del_off);
    free(f->del_n);
    memset(f, 0, sizeof *f);
    f->fd = f->del_fd = -1;
}

/* Reads table name of the old checkpoint: into m when its map fits mem, else (f->n > 1) over
 * f's partitions (their folders under scratch). Its digest into *digest. */
static int old_load(const char *ckpt, const char *name, uint64_t mem, const char *scratch,
                    fp_map *m, fp_parts *f, uint64_t *digest, char **errptr)
{
    emb_table_config cfg;
    stream s = {.ckpt = ckpt, .name = name, .old = m, .errptr = errptr};
    uint64_t rows = 0;
    size_t cap = 0;
    int rc = ps_checkpoint_table_config(ckpt, name, &cfg, errptr);
    if (rc == CM_OK) rc = ps_checkpoint_table_rows(ckpt, name, &rows, errptr);
    s.dim = cfg.dim;
    s.changed = rows; /* fp_add's limit */
    if (rc == CM_OK && (f->n = fp_plan(rows, mem, &cap)) == 0)
        rc = cm_err(errptr, CM_EINVAL,
                    "table %s: a memory budget of %" PRIu64 " bytes is too small for a delta "
                    "against the %" PRIu64 " rows of %s: it needs at least %" PRIu64 " bytes",
                    name, mem, rows, ckpt, fp_least(rows));
    if (rc == CM_OK && f->n == 1) {
        f->n = 0;
        m->cap = rows;
        if ((m->e = malloc(m->cap * sizeof *m->e + 1)) == NULL)
            rc = cm_err(errptr, CM_ENOMEM, "out of memory for %" PRIu64 " keys of %s", rows, ckpt);
    } else if (rc == CM_OK) {
        char dir[4400];
        s.parts = f;
        f->cap = cap;
        snprintf(dir, sizeof dir, "%s/delta-old", scratch);
        rc = cm_parts_create(dir, f->n, sizeof(fp_ent), cap / sizeof(fp_ent), &f->old, errptr);
        snprintf(dir, sizeof dir, "%s/delta-new", scratch);
        if (rc == CM_OK)
            rc = cm_parts_create(dir, f->n, sizeof(fp_ent), cap / sizeof(fp_ent), &f->new, errptr);
        snprintf(f->flags_path, sizeof f->flags_path, "%s/delta-flags", scratch);
        snprintf(f->del_path, sizeof f->del_path, "%s/delta-deleted", scratch);
    }
    if (rc == CM_OK) rc = ps_checkpoint_foreach_row(ckpt, name, fp_add, &s, errptr);
    if (rc == CM_OK && f->n == 0) rc = fp_map_index(m, ckpt, name, errptr);
    if (rc == CM_OK && f->n > 0) rc = cm_parts_flush(f->old, errptr);
    if (rc == CM_OK) *digest = table_digest(&s);
    return rc;
}

/* Partition p of the new checkpoint (ckpt) against OLD's (old_ckpt), both table name: its
 * flags appended to f's file, OLD's keys it does not have to f's; the changed rows counted
 * in *changed. */
static int fp_part(fp_parts *f, uint32_t p, const char *ckpt, const char *old_ckpt,
                   const char *name, fp_ent *ents, uint8_t *flags, uint64_t *changed, char **errptr)
{
    fp_map m = {.n = cm_parts_count(f->old, p)};
    int rc =
        (m.e = malloc(m.n * sizeof *m.e + 1)) != NULL
            ? CM_OK
            : cm_err(errptr, CM_ENOMEM, "out of memory for %" PRIu64 " keys of %s", m.n, old_ckpt);
    if (rc == CM_OK) rc = cm_parts_read(f->old, p, m.e, 0, m.n, errptr);
    if (rc == CM_OK) rc = fp_map_index(&m, old_ckpt, name, errptr);
    const uint64_t n = cm_parts_count(f->new, p);
    for (uint64_t at = 0; rc == CM_OK && at < n;) {
        const size_t k = n - at < FLAG_CHUNK ? (size_t)(n - at) : FLAG_CHUNK;
        rc = cm_parts_read(f->new, p, ents, at, k, errptr);
        for (size_t j = 0; rc == CM_OK && j < k; j++) {
            const int64_t i = fp_map_find(&m, ents[j].key);
            if (i >= 0) {
                /* A key old has, twice in the new checkpoint: the writer never sees an
                 * unchanged row, so it is caught here. */
                uint8_t *b = &m.seen[i / 8], bit = (uint8_t)(1u << (i % 8));
                if (*b & bit) rc = dup_err(ckpt, name, ents[j].key, errptr);
                *b |= bit;
            }
            flags[j] = i < 0 || m.e[i].fp != ents[j].fp;
            *changed += flags[j];
        }
        if (rc == CM_OK && cm_write_full(f->fd, flags, k) != CM_OK)
            rc = cm_err_errno(errptr, CM_EIO, "cannot write %s", f->flags_path);
        at += k;
    }
    uint64_t n_del = 0, *del = rc == CM_OK ? fp_map_unseen(&m, &n_del) : NULL;
    if (rc == CM_OK && cm_write_full(f->del_fd, del, n_del * sizeof *del) != CM_OK)
        rc = cm_err_errno(errptr, CM_EIO, "cannot write %s", f->del_path);
    f->del_off[p] = f->n_del;
    f->del_n[p] = n_del;
    f->n_del += n_del;
    fp_map_free(&m);
    return rc;
}

/* A scratch file at path, open for reading and writing in *fd and unlinked at once: nothing is
 * left behind, however the export ends. */
static int scratch_open(const char *path, int *fd, char **errptr)
{
    *fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (*fd < 0 || unlink(path) != 0) return cm_err_errno(errptr, CM_EIO, "cannot create %s", path);
    return CM_OK;
}

/* After the new checkpoint's pairs are spread: every partition compared (fp_part), the flags'
 * buffers made for the second pass, the deleted keys sorted. The changed rows into *changed. */
static int fp_parts_flags(fp_parts *f, const char *ckpt, const char *old_ckpt, const char *name,
                          uint64_t *changed, char **errptr)
{
    fp_ent *ents = malloc(FLAG_CHUNK * sizeof *ents);
    uint8_t *flags = malloc(FLAG_CHUNK);
    f->off = calloc(f->n, sizeof *f->off);
    f->at = calloc(f->n, sizeof *f->at);
    f->pos = calloc(f->n, sizeof *f->pos);
    f->len = calloc(f->n, sizeof *f->len);
    f->del_off = calloc(f->n, sizeof *f->del_off);
    f->del_n = calloc(f->n, sizeof *f->del_n);
    int rc = ents && flags && f->off && f->at && f->pos && f->len && f->del_off && f->del_n
                 ? cm_parts_flush(f->new, errptr)
                 : cm_err(errptr, CM_ENOMEM, "out of memory");
    if (rc == CM_OK) rc = scratch_open(f->flags_path, &f->fd, errptr);
    if (rc == CM_OK) rc = scratch_open(f->del_path, &f->del_fd, errptr);
    *changed = 0;
    for (uint32_t p = 0; rc == CM_OK && p < f->n; p++) {
        f->off[p] = p ? f->off[p - 1] + cm_parts_count(f->new, p - 1) : 0;
        rc = fp_part(f, p, ckpt, old_ckpt, name, ents, flags, changed, errptr);
    }
    free(ents);
    free(flags);
    /* The flags' buffers are held beside the bundle's index (its own --memory): a partition
     * reads 64 KiB at a time at most, in what the pairs' buffers took. */
    f->cap = f->cap < FLAG_READ ? f->cap : FLAG_READ;
    if (rc == CM_OK && (f->buf = malloc((size_t)f->n * f->cap)) == NULL)
        rc = cm_err(errptr, CM_ENOMEM, "out of memory");
    f->flagged = true;
    return rc;
}

static int bundle_rows(const chunk *c, void *arg, char **errptr)
{
    return ember_serve_writer_table_rows(arg, c->keys, c->w, c->n, errptr);
}

/* Partition p's next deleted key: 1, or 0 when it has none left; -1 (*rc) when it cannot be
 * read. */
static int del_next(fp_parts *f, uint32_t p, uint64_t *key, int *rc, char **errptr)
{
    if (f->pos[p] == f->len[p]) {
        *rc = part_refill(f, p, f->del_fd, f->del_path, sizeof *key, f->del_off[p], f->del_n[p],
                          errptr);
        if (*rc != CM_OK) return -1;
        if (f->len[p] == 0) return 0;
    }
    const size_t per = f->cap / sizeof *key;
    memcpy(key, f->buf + ((size_t)p * per + f->pos[p]++) * sizeof *key, sizeof *key);
    return 1;
}

/* OLD's keys the new checkpoint has not, to the writer ascending: the partitions' runs merged
 * through a heap of their next keys, each read through its part of the flags' buffers (done
 * with by now), so memory does not grow with the keys deleted. */
#define DEL_LESS(a, b) ((a) < (b))
CM_HEAP_SIFT_DEFINE(del_sift, uint64_t, DEL_LESS)

static int fp_parts_deleted(fp_parts *f, ember_serve_writer *w, char **errptr)
{
    enum { OUT = 4096 };
    uint64_t *next = malloc(f->n * sizeof *next); /* partition p's next key */
    uint32_t *h = malloc(f->n * sizeof *h);
    uint64_t *out = malloc(OUT * sizeof *out);
    size_t live = 0, k = 0;
    int rc = next && h && out ? CM_OK : cm_err(errptr, CM_ENOMEM, "out of memory");
    for (uint32_t p = 0; rc == CM_OK && p < f->n; p++)
        f->pos[p] = f->len[p] = f->at[p] = 0;
    for (uint32_t p = 0; rc == CM_OK && p < f->n; p++)
        if (del_next(f, p, &next[p], &rc, errptr) > 0) h[live++] = p;
    for (size_t i = live; rc == CM_OK && i-- > 0;)
        del_sift(next, h, live, i);
    while (rc == CM_OK && live > 0) {
        const uint32_t p = h[0];
        out[k++] = next[p];
        if (k == OUT) {
            rc = ember_serve_writer_table_deleted(w, out, k, errptr);
            k = 0;
        }
        const int got = rc == CM_OK ? del_next(f, p, &next[p], &rc, errptr) : -1;
        if (got < 0) break;
        if (got == 0) h[0] = h[--live]; /* p is done: the last takes its place */
        del_sift(next, h, live, 0);
    }
    if (rc == CM_OK) rc = ember_serve_writer_table_deleted(w, out, k, errptr);
    free(next);
    free(h);
    free(out);
    return rc;
}

/* One table into the bundle: every row, or (old) those new or changed since old's, and the
 * keys old had that are gone, in mem bytes (--memory) for old's keys. The stream's digest and
 * rows are the checkpoint table's. */
static int bundle_table(ember_serve_writer *w, const char *ckpt, const char *name,
                        const char *old_ckpt, uint64_t mem, uint64_t *digest, uint64_t *old_digest,
                        uint64_t *exported, uint64_t *deleted, char **errptr)
{
    fp_map m = {0};
    fp_parts f = {.fd = -1, .del_fd = -1};
    stream s = {.ckpt = ckpt, .name = name};
    uint64_t n = 0, n_del = 0, *del = NULL, order = 0;
    int rc = CM_OK;
    if (old_ckpt) {
        /* Two passes over the new table: the changed rows counted (and old's keys seen
         * marked), then written; the bundle's file is sized by the count. */
        rc = old_load(old_ckpt, name, mem, ember_serve_writer_scratch(w), &m, &f, old_digest,
                      errptr);
        if (f.n > 0) {
            s.parts = &f;
            if (rc == CM_OK) rc = stream_table(&s, errptr);
            if (rc == CM_OK) rc = fp_parts_flags(&f, ckpt, old_ckpt, name, &n, errptr);
            order = s.order;
        } else {
            s.old = &m;
            s.mark = true;
            if (rc == CM_OK) rc = stream_table(&s, errptr);
            n = s.changed;
            s.mark = false;
        }
    } else {
        rc = ps_checkpoint_table_rows(ckpt, name, &n, errptr);
    }
    emb_table_config cfg;
    if (rc == CM_OK) rc = ps_checkpoint_table_config(ckpt, name, &cfg, errptr);
    if (rc == CM_OK) rc = ember_serve_writer_table_begin(w, name, cfg.dim, n, errptr);
    s.fn = bundle_rows;
    s.arg = w;
    if (rc == CM_OK) rc = stream_table(&s, errptr);
    if (rc == CM_OK && ((old_ckpt ? s.changed : s.rows) != n || (f.n > 0 && s.order != order)))
        rc = cm_err(errptr, CM_ECORRUPT, "%s: table %s changed while it was exported", ckpt, name);
    if (rc == CM_OK && old_ckpt && f.n > 0) {
        rc = fp_parts_deleted(&f, w, errptr);
        n_del = f.n_del;
    } else if (rc == CM_OK && old_ckpt) {
        del = fp_map_unseen(&m, &n_del);
    }
    if (rc == CM_OK) rc = ember_serve_writer_table_end(w, del, del ? n_del : 0, errptr);
    uint64_t key;
    if (rc != CM_OK && ember_serve_writer_table_dup(w, &key)) rc = dup_err(ckpt, name, key, errptr);
    *digest = table_digest(&s);
    *exported = n;
    *deleted = n_del;
    fp_map_free(&m);
    fp_parts_free(&f);
    return rc;
}

static int write_afile(const chunk *c, void *arg, char **errptr)
{
    return cm_afile_write(arg, c->keys, c->n * sizeof *c->keys, errptr);
}

static int write_afile_w(const chunk *c, void *arg, char **errptr)
{
    return cm_afile_write(arg, c->w, c->n * c->dim * sizeof *c->w, errptr);
}

/* safetensors: u64 header length, JSON header, then the tensors' bytes. The header gives every
 * table's rows before any data, from the manifests; each table is then streamed twice (its
 * keys, then its weights: two tensors), the rows checked to come in one order both times. */
static int write_safetensors(const char *out, const char *model, const char *ckpt,
                             char (*names)[PS_NAME_MAX], uint32_t n_tabs, const float *tower,
                             uint64_t n_tower, uint64_t step, uint64_t mem, uint64_t *total,
                             char **errptr)
{
    uint64_t rows[PS_MAX_TABLES];
    uint32_t dims[PS_MAX_TABLES];
    int rc = CM_OK;
    for (uint32_t i = 0; rc == CM_OK && i < n_tabs; i++) {
        emb_table_config cfg;
        rc = ps_checkpoint_table_config(ckpt, names[i], &cfg, errptr);
        dims[i] = cfg.dim;
        if (rc == CM_OK) rc = ps_checkpoint_table_rows(ckpt, names[i], &rows[i], errptr);
    }
    if (rc != CM_OK) return rc;
    char *hdr = NULL;
    size_t len = 0;
    FILE *h = open_memstream(&hdr, &len);
    if (h == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    uint64_t off = 0;
    fputc('{', h);
    for (uint32_t i = 0; i < n_tabs; i++) {
        uint64_t kb = rows[i] * 8, wb = rows[i] * dims[i] * 4;
        fputc('"', h);
        cm_json_escape(h, names[i]);
        fprintf(h,
                ".keys\":{\"dtype\":\"U64\",\"shape\":[%" PRIu64 "],\"data_offsets\":[%" PRIu64
                ",%" PRIu64 "]},\"",
                rows[i], off, off + kb);
        cm_json_escape(h, names[i]);
        fprintf(h,
                ".weights\":{\"dtype\":\"F32\",\"shape\":[%" PRIu64
                ",%u],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]},",
                rows[i], dims[i], off + kb, off + kb + wb);
        off += kb + wb;
    }
    fprintf(h,
            "\"tower\":{\"dtype\":\"F32\",\"shape\":[%" PRIu64 "],\"data_offsets\":[%" PRIu64
            ",%" PRIu64 "]},\"__metadata__\":{\"step\":\"%" PRIu64 "\",\"model\":\"",
            n_tower, off, off + n_tower * 4, step);
    cm_json_escape(h, model);
    fputs("\"}}", h);
    while (ftell(h) % 8)
        fputc(' ', h); /* the format pads the header with spaces */
    bool ok = !ferror(h);
    if (fclose(h) != 0) ok = false;
    if (!ok) {
        free(hdr);
        return cm_err(errptr, CM_ENOMEM, "out of memory for the safetensors header");
    }
    cm_afile f;
    uint64_t hl = len;
    rc = cm_afile_open(&f, out, errptr);
    if (rc == CM_OK) rc = cm_afile_write(&f, &hl, 8, errptr);
    if (rc == CM_OK) rc = cm_afile_write(&f, hdr, len, errptr);
    for (uint32_t i = 0; rc == CM_OK && i < n_tabs; i++) {
        cm_keyset *ks = NULL;
        rc = keys_open(out, rows[i], mem, &ks, errptr);
        stream s = {.ckpt = ckpt, .name = names[i], .check = ks, .fn = write_afile, .arg = &f};
        if (rc == CM_OK) rc = stream_table(&s, errptr);
        cm_keyset_destroy(ks);
        const uint64_t order = s.order;
        s.check = NULL;
        s.fn = write_afile_w;
        if (rc == CM_OK && s.rows == rows[i]) rc = stream_table(&s, errptr);
        if (rc == CM_OK && (s.rows != rows[i] || s.order != order))
            rc = cm_err(errptr, CM_ECORRUPT,
                        "%s: table %s changed while it was exported (%" PRIu64
                        " rows, the manifests say %" PRIu64 ")",
                        ckpt, names[i], s.rows, rows[i]);
        *total += s.rows;
    }
    if (rc == CM_OK) rc = cm_afile_write(&f, tower, n_tower * 4, errptr);
    if (rc == CM_OK) rc = cm_afile_commit(&f, errptr);
    else cm_afile_abort(&f);
    free(hdr);
    return rc;
}

typedef struct rdb_sink {
    emb_store_writer *w;
    uint8_t *buf; /* a chunk's records */
} rdb_sink;

static int rdb_put(const chunk *c, void *arg, char **errptr)
{
    rdb_sink *k = arg;
    const size_t rec = 8 + 4 * (size_t)c->dim;
    for (size_t j = 0; j < c->n; j++) {
        memcpy(k->buf + j * rec, &c->keys[j], 8);
        memcpy(k->buf + j * rec + 8, c->w + j * c->dim, rec - 8);
    }
    return emb_store_writer_add(k->w, k->buf, c->n, errptr);
}

/* RocksDB: out/<table>/ maps the key (8 bytes big-endian) to a record {key, dim fp32};
 * out/model.txt and out/tower.f32 beside them. Built in a folder beside out and swapped in
 * whole (cm_dir_swap), as a bundle is: a failed export leaves out as it was, and a table of an
 * earlier export into out does not stay beside this one's. Each table's database is written
 * by an emb_store_writer in --memory (it sorts the rows itself, and so refuses a key twice). */
static int write_rocksdb(const char *out, const char *model, const char *ckpt,
                         char (*names)[PS_NAME_MAX], uint32_t n_tabs, const float *tower,
                         uint64_t n_tower, uint64_t mem, uint64_t *total, char **errptr)
{
    char dir[4200], tmp[4200], path[8400];
    /* The folder beside out, not in it ("rdb/" + ".tmp-<pid>" cannot be swapped with rdb). */
    if ((size_t)snprintf(dir, sizeof dir, "%s", out) >= sizeof dir)
        return cm_err(errptr, CM_EINVAL, "--out path too long");
    cm_path_trim(dir);
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp-%ld", dir, (long)getpid()) >= sizeof tmp)
        return cm_err(errptr, CM_EINVAL, "--out path too long");
    int rc = cm_rmtree(tmp, errptr);
    if (rc == CM_OK) rc = cm_mkdirs(tmp, errptr);
    for (uint32_t i = 0; rc == CM_OK && i < n_tabs; i++) {
        emb_table_config cfg;
        rdb_sink k = {0};
        rc = ps_checkpoint_table_config(ckpt, names[i], &cfg, errptr);
        stream s = {.ckpt = ckpt, .name = names[i], .fn = rdb_put, .arg = &k};
        const size_t rec = 8 + 4 * (size_t)cfg.dim;
        snprintf(path, sizeof path, "%s/%s", tmp, names[i]);
        if (rc == CM_OK) rc = emb_store_writer_open(path, rec, mem, &k.w, errptr);
        if (rc == CM_OK && (k.buf = malloc((CHUNK_BYTES / rec + 1) * rec)) == NULL)
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        if (rc == CM_OK) rc = stream_table(&s, errptr);
        free(k.buf);
        uint64_t key = 0;
        if (rc == CM_OK) rc = emb_store_writer_finish(k.w, errptr);
        if (rc != CM_OK && k.w && emb_store_writer_twice(k.w, &key))
            rc = dup_err(ckpt, names[i], key, errptr);
        *total += s.rows;
        emb_store_writer_close(k.w);
    }
    snprintf(path, sizeof path, "%s/model.txt", tmp);
    if (rc == CM_OK) rc = cm_write_file_atomic(path, model, strlen(model), errptr);
    snprintf(path, sizeof path, "%s/tower.f32", tmp);
    if (rc == CM_OK) rc = cm_write_file_atomic(path, tower, n_tower * 4, errptr);
    if (rc == CM_OK) rc = cm_dir_swap(tmp, dir, errptr);
    if (rc != CM_OK) (void)cm_rmtree(tmp, NULL);
    return rc;
}

static void export_usage(FILE *to)
{
    fprintf(to,
            "usage: ember export --checkpoint DIR --out PATH [--precision fp32|fp16|int8]\n"
            "                    [--since OLD_CHECKPOINT] [--format bundle|safetensors|rocksdb]\n"
            "                    [--memory BYTES]\n"
            "  DIR is a checkpoint (ckpt/step-N) or a run directory (its ckpt/LATEST)\n"
            "  --precision and --since are for bundles (safetensors and RocksDB hold fp32)\n"
            "  Rows are streamed, never all held: --memory (K/M/G suffixes; default %lluM)\n"
            "  bounds what export holds for a table's keys (a bundle's index, a delta's map\n"
            "  of OLD, the check that no key comes twice, or the sort of a RocksDB table's\n"
            "  rows), however large the table; less only spreads them over more scratch\n"
            "  files beside --out. The output is the same with any --memory (RocksDB: the\n"
            "  same rows, in table files of a size that follows --memory).\n",
            (unsigned long long)(EMBER_SERVE_INDEX_MEMORY_DEFAULT >> 20));
}

int cmd_export(int argc, char **argv)
{
    static const struct option opts[] = {{"checkpoint", 1, 0, 'c'}, {"out", 1, 0, 'o'},
                                         {"precision", 1, 0, 'p'},  {"since", 1, 0, 's'},
                                         {"format", 1, 0, 'f'},     {"memory", 1, 0, 'm'},
                                         {"help", 0, 0, 'h'},       {0, 0, 0, 0}};
    const char *in = NULL, *out = NULL, *since = NULL, *format = "bundle", *prec_name = NULL;
    ember_serve_precision prec = EMBER_SERVE_FP32;
    uint64_t memory = EMBER_SERVE_INDEX_MEMORY_DEFAULT;
    int o;
    optind = 1;
    while ((o = cli_getopt("export", argc, argv, opts)) != -1) {
        switch (o) {
        case 'c': in = optarg; break;
        case 'o': out = optarg; break;
        case 's': since = optarg; break;
        case 'f': format = optarg; break;
        case 'p':
            if (ember_serve_precision_parse(optarg, &prec) != 0) {
                fprintf(stderr, "ember export: unknown precision '%s'\n", optarg);
                return 2;
            }
            prec_name = optarg;
            break;
        case 'm':
            if (cm_parse_size(optarg, &memory) != 0 || memory == 0) {
                fprintf(stderr, "ember export: bad --memory '%s'\n", optarg);
                return 2;
            }
            break;
        case 'h': export_usage(stdout); return 0;
        default: export_usage(stderr); return 2;
        }
    }
    bool bundle = !strcmp(format, "bundle"), st = !strcmp(format, "safetensors"),
         rdb = !strcmp(format, "rocksdb");
    /* Each mistake named; safetensors and RocksDB store fp32 only, so another precision would
     * be silently ignored. */
    char why[256] = "";
    if (in == NULL || out == NULL)
        snprintf(why, sizeof why, "%s is required", in == NULL ? "--checkpoint" : "--out");
    else if (optind != argc)
        snprintf(why, sizeof why, "unexpected argument '%s'", argv[optind]);
    else if (!(bundle || st || rdb))
        snprintf(why, sizeof why, "unknown --format '%s' (bundle, safetensors, rocksdb)", format);
    else if (since && !bundle)
        snprintf(why, sizeof why, "--since needs --format bundle");
    else if (prec != EMBER_SERVE_FP32 && !bundle)
        snprintf(why, sizeof why, "--precision %s needs --format bundle (%s stores fp32)",
                 prec_name, format);
    if (why[0] != '\0') {
        fprintf(stderr, "ember export: %s\n", why);
        export_usage(stderr);
        return 2;
    }
    char ckpt[4200], old_ckpt[4200], path[4300];
    char tnames[PS_MAX_TABLES][PS_NAME_MAX], dnames[PS_MAX_DENSE][PS_NAME_MAX];
    uint32_t n_t = 0, n_d = 0;
    uint64_t step = 0, old_step = 0, n_tower = 0;
    char *err = NULL, *model = NULL;
    size_t mlen;
    float *tower = NULL;
    ember_serve_writer *w = NULL;
    /* --out is checked before the checkpoint is read: a RocksDB export is swapped in as a
     * whole folder (the bundle writer, created here, checks its own), safetensors is one file
     * replaced by rename. */
    static const char *const rdb_ours[] = {"model.txt", "tower.f32", NULL};
    struct stat ost;
    int rc = rdb ? cm_dir_replaceable(out, rdb_ours, &err)
             : st && lstat(out, &ost) == 0 && S_ISDIR(ost.st_mode)
                 ? cm_err(&err, CM_EINVAL, "--out %s is a folder", out)
                 : CM_OK;
    if (rc == CM_OK) rc = train_resolve_checkpoint(in, ckpt, sizeof ckpt, &step, &err);
    if (rc == CM_OK && since) rc = train_resolve_checkpoint(since, old_ckpt, sizeof old_ckpt, &old_step, &err);
    if (rc == CM_OK && bundle)
        rc = ember_serve_writer_create(out, prec, since != NULL, step, old_step, &w, &err);
    if (rc == CM_OK && bundle) ember_serve_writer_memory(w, memory);
    if (rc == CM_OK) rc = ps_checkpoint_names(ckpt, tnames, &n_t, dnames, &n_d, &err);
    snprintf(path, sizeof path, "%s/model.txt", ckpt);
    if (rc == CM_OK) rc = cm_read_sealed(path, &model, &mlen, &err);
    if (rc == CM_OK) rc = ps_checkpoint_dense(ckpt, "tower", &tower, &n_tower, &err);
    uint64_t dig[PS_MAX_TABLES], old_dig[PS_MAX_TABLES];
    if (rc == CM_OK && bundle) rc = ember_serve_writer_model(w, model, &err);
    if (rc == CM_OK && bundle) rc = ember_serve_writer_dense(w, tower, n_tower, &err);
    uint64_t total = 0, total_deleted = 0;
    for (uint32_t i = 0; rc == CM_OK && bundle && i < n_t; i++) {
        uint64_t n = 0, n_deleted = 0;
        rc = bundle_table(w, ckpt, tnames[i], since ? old_ckpt : NULL, memory, &dig[i], &old_dig[i],
                          &n, &n_deleted, &err);
        total += n;
        total_deleted += n_deleted;
    }
    if (rc == CM_OK && bundle) {
        /* The base's tower too: the delta's base is the whole checkpoint it was taken against. */
        float *old_tower = NULL;
        uint64_t n_old_tower = 0;
        if (since) rc = ps_checkpoint_dense(old_ckpt, "tower", &old_tower, &n_old_tower, &err);
        if (rc == CM_OK)
            rc = ember_serve_writer_source(
                w, content_id(dig, n_t, tower, n_tower),
                since ? content_id(old_dig, n_t, old_tower, n_old_tower) : 0, &err);
        free(old_tower);
    }
    if (rc == CM_OK && bundle) {
        rc = ember_serve_writer_commit(w, &err);
        w = NULL;
    }
    if (rc == CM_OK && st)
        rc = write_safetensors(out, model, ckpt, tnames, n_t, tower, n_tower, step, memory, &total,
                               &err);
    if (rc == CM_OK && rdb)
        rc = write_rocksdb(out, model, ckpt, tnames, n_t, tower, n_tower, memory, &total, &err);
    ember_serve_writer_abort(w);
    free(tower);
    free(model);
    if (rc != CM_OK) {
        fprintf(stderr, "ember export: %s\n", err ? err : "failed");
        free(err);
        return 1;
    }
    fputs("{\"out\":\"", stdout);
    cm_json_escape(stdout, out);
    printf("\",\"format\":\"%s\",\"precision\":\"%s\",\"step\":%" PRIu64 ",\"rows\":%" PRIu64
           ",\"deleted\":%" PRIu64 ",\"delta\":%s}\n",
           format, bundle ? (const char *[]){"fp32", "fp16", "int8"}[prec] : "fp32", step, total,
           total_deleted, since ? "true" : "false");
    return 0;
}
