/*
 * Reading a cluster checkpoint without a running cluster (export, reshard): the layout is
 * <ckpt>/shard-<i>/{MANIFEST, table-<name>/ (an embedding snapshot), dense-<name>.bin}.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ps/checkpoint.h"
#include "ps/dense.h"
#include "ps/ps.h"

/* Shard i's manifest text (caller frees), its checksum line (ps_shard_manifest_text) verified;
 * *body gets the length before that line. Shard 0's lists the tables and dense blocks: a
 * damaged name would otherwise send export and reshard after a table that is not there, or drop
 * one. */
static int read_manifest(const char *ckpt, uint32_t i, char **text, size_t *body, char **errptr)
{
    char path[4200];
    size_t len = 0;
    snprintf(path, sizeof path, "%s/shard-%u/MANIFEST", ckpt, i);
    int rc = cm_read_file(path, (void **)text, &len, errptr);
    if (rc != CM_OK) return rc;
    if (cm_seal_check(*text, len, "checksum", body) != CM_OK) {
        free(*text);
        *text = NULL;
        return cm_err(errptr, CM_ECORRUPT,
                      "%s: checksum mismatch or damaged (not a shard manifest)", path);
    }
    return CM_OK;
}

/* The shard count comes from shard-0's MANIFEST ("shards N"), and every shard below it must be
 * there and say so: counted by the directories present, a checkpoint missing shard-1 of 2 (a
 * partial copy) was exported and resharded as half its rows, silently. Each shard's manifest
 * must be the one the server writes for its index among N with shard-0's tables and blocks, so
 * a shard directory copied from another index is refused too (its rows would be read twice). */
int ps_checkpoint_shards(const char *ckpt, uint32_t *n, char **errptr)
{
    char path[4200];
    struct stat st;
    snprintf(path, sizeof path, "%s/shard-0/MANIFEST", ckpt);
    if (stat(path, &st) != 0)
        return cm_err(errptr, CM_ENOTFOUND, "%s is not a checkpoint (no shard-0/MANIFEST)", ckpt);
    char *text0 = NULL, *text = NULL, *want = NULL;
    size_t body0 = 0, body = 0;
    unsigned shards = 0;
    int rc = read_manifest(ckpt, 0, &text0, &body0, errptr);
    const char *at = rc == CM_OK ? strstr(text0, "\nshards ") : NULL;
    if (rc == CM_OK && (at == NULL || sscanf(at, "\nshards %u", &shards) != 1 || shards == 0 ||
                        shards > PS_MAX_SHARDS))
        rc = cm_err(errptr, CM_ECORRUPT, "%s: no shard count in 1..%u", path, PS_MAX_SHARDS);
    const char *rest = rc == CM_OK ? strchr(at + 1, '\n') : NULL;
    if (rc == CM_OK && rest == NULL)
        rc = cm_err(errptr, CM_ECORRUPT, "%s: no shard count in 1..%u", path, PS_MAX_SHARDS);
    /* The tables and blocks: what follows the shard count, up to the checksum line. */
    char *tail = NULL;
    if (rc == CM_OK) {
        tail = strndup(rest + 1, body0 - (size_t)(rest + 1 - text0));
        want = malloc(body0 + 64);
        if (tail == NULL || want == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    for (uint32_t i = 0; rc == CM_OK && i < shards; i++) {
        snprintf(path, sizeof path, "%s/shard-%u/MANIFEST", ckpt, i);
        if (stat(path, &st) != 0) {
            rc = cm_err(errptr, CM_ECORRUPT,
                        "%s: shard-%u/MANIFEST is missing (shard-0's says %u shards): an "
                        "incomplete checkpoint",
                        ckpt, i, shards);
            break;
        }
        rc = read_manifest(ckpt, i, &text, &body, errptr);
        int len = rc == CM_OK ? ps_shard_manifest_text(i, shards, tail, want, body0 + 64) : 0;
        if (rc == CM_OK && (len < 0 || strcmp(text, want) != 0))
            rc = cm_err(errptr, CM_ECORRUPT,
                        "%s: not shard %u of %u with shard-0's tables (a shard of another "
                        "index or checkpoint)",
                        path, i, shards);
        free(text);
        text = NULL;
    }
    free(tail);
    free(want);
    free(text0);
    if (rc == CM_OK) *n = shards;
    return rc;
}

int ps_checkpoint_table_config(const char *ckpt, const char *table, emb_table_config *cfg,
                               char **errptr)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/shard-0/table-%s", ckpt, table);
    return emb_snapshot_read_config(path, cfg, errptr);
}

int ps_checkpoint_table_rows(const char *ckpt, const char *table, uint64_t *rows, char **errptr)
{
    uint32_t n;
    uint64_t sum = 0;
    int rc = ps_checkpoint_shards(ckpt, &n, errptr);
    for (uint32_t i = 0; rc == CM_OK && i < n; i++) {
        char path[4200];
        uint64_t r = 0;
        snprintf(path, sizeof path, "%s/shard-%u/table-%s", ckpt, i, table);
        rc = emb_snapshot_rows(path, &r, errptr);
        sum += r;
    }
    if (rc == CM_OK) *rows = sum;
    return rc;
}

/* The caller's row callback behind a check that each row is on the shard its key hashes to: a
 * row on another (a snapshot copied or damaged, checksums and all) would be exported twice, or
 * resharded as whichever copy came last. */
typedef struct shard_rows {
    emb_row_cb cb;
    void *arg;
    uint32_t shard, n;
    const char *path;
    char **errptr;
} shard_rows;

static int shard_row(const emb_row *row, void *arg)
{
    shard_rows *s = arg;
    uint32_t home = ps_key_shard(row->key, s->n);
    if (home != s->shard)
        return cm_err(s->errptr, CM_ECORRUPT,
                      "%s: key %" PRIu64 " belongs on shard %u of %u, not on shard %u", s->path,
                      row->key, home, s->n, s->shard);
    return s->cb(row, s->arg);
}

int ps_checkpoint_foreach_row(const char *ckpt, const char *table, emb_row_cb cb, void *arg,
                              char **errptr)
{
    uint32_t n;
    int rc = ps_checkpoint_shards(ckpt, &n, errptr);
    emb_table_config first, cfg;
    for (uint32_t i = 0; rc == CM_OK && i < n; i++) {
        char path[4200];
        snprintf(path, sizeof path, "%s/shard-%u/table-%s", ckpt, i, table);
        /* Every shard's snapshot of a table has shard 0's model: rows are read, exported and
         * resharded with one layout (another dim would be read past its records). */
        rc = emb_snapshot_read_config(path, i == 0 ? &first : &cfg, errptr);
        const char *field = rc == CM_OK && i > 0 ? emb_table_config_differs(&first, &cfg) : NULL;
        if (field != NULL)
            rc = cm_err(errptr, CM_ECORRUPT, "%s: table %s's %s differs from shard 0's snapshot",
                        path, table, field);
        shard_rows s = {cb, arg, i, n, path, errptr};
        if (rc == CM_OK) rc = emb_snapshot_foreach(path, shard_row, &s, errptr);
    }
    return rc;
}

int ps_checkpoint_dense(const char *ckpt, const char *name, float **values, uint64_t *n,
                        char **errptr)
{
    /* Block b lives on shard b % shards (the servers' and reshard's rule), b its place in
     * shard 0's manifest: the first shard holding a file of that name could be a stray one. */
    uint32_t shards, n_tables, n_dense;
    char tables[PS_MAX_TABLES][PS_NAME_MAX], dense[PS_MAX_DENSE][PS_NAME_MAX];
    int rc = ps_checkpoint_shards(ckpt, &shards, errptr);
    if (rc == CM_OK) rc = ps_checkpoint_names(ckpt, tables, &n_tables, dense, &n_dense, errptr);
    if (rc != CM_OK) return rc;
    for (uint32_t b = 0; b < n_dense; b++) {
        if (strcmp(dense[b], name) != 0) continue;
        char path[4200];
        snprintf(path, sizeof path, "%s/shard-%u/dense-%s.bin", ckpt, b % shards, name);
        return ps_dense_read_values(path, values, n, errptr);
    }
    return cm_err(errptr, CM_ENOTFOUND, "%s: no dense block '%s' in any shard", ckpt, name);
}

int ps_checkpoint_names(const char *ckpt, char (*tables)[PS_NAME_MAX], uint32_t *n_tables,
                        char (*dense)[PS_NAME_MAX], uint32_t *n_dense, char **errptr)
{
    char *text = NULL;
    size_t body_len = 0;
    int rc = read_manifest(ckpt, 0, &text, &body_len, errptr);
    if (rc != CM_OK) return rc;
    *n_tables = *n_dense = 0;
    for (char *p = text; rc == CM_OK && p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        char kind[8], name[PS_NAME_MAX + 1];
        if (sscanf(p, "%7s %32s", kind, name) != 2) continue;
        bool tab = !strcmp(kind, "table");
        if (!tab && strcmp(kind, "dense") != 0) continue;
        /* Names become paths (reshard writes to them): one no server could have written (a
         * path, "..", longer than a name, one too many) is a damaged manifest, where it was
         * followed, cut to 31 bytes or dropped. */
        uint32_t *n = tab ? n_tables : n_dense;
        if (!ps_name_ok(name) || strlen(name) >= PS_NAME_MAX ||
            *n == (tab ? PS_MAX_TABLES : PS_MAX_DENSE)) {
            rc = cm_err(errptr, CM_ECORRUPT,
                        "shard-0/MANIFEST of %s: %s '%.*s' is not a name a checkpoint has, or one "
                        "too many",
                        ckpt, kind, (int)strcspn(p + strlen(kind) + 1, "\n"), p + strlen(kind) + 1);
            break;
        }
        strcpy(tab ? tables[(*n)++] : dense[(*n)++], name);
    }
    free(text);
    return rc;
}

int ps_shard_manifest_text(uint32_t shard, uint32_t shards, const char *body, char *out, size_t n)
{
    int len = snprintf(out, n, "ember-ps-shard 1\nshard %u\nshards %u\n%s", shard, shards, body);
    if (len < 0 || (size_t)len >= n) return -1;
    return cm_seal_append(out, (size_t)len, n, "checksum");
}

/* The table/dense fingerprint lines of a shard manifest (what does not depend on the layout). */
static int manifest_body(const char *ckpt, char *body, size_t n, char **errptr)
{
    char *text = NULL;
    size_t body_len = 0;
    int rc = read_manifest(ckpt, 0, &text, &body_len, errptr);
    if (rc != CM_OK) return rc;
    size_t out = 0;
    body[0] = '\0';
    for (char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        size_t l = strcspn(p, "\n");
        if ((!strncmp(p, "table ", 6) || !strncmp(p, "dense ", 6)) && out + l + 2 < n) {
            memcpy(body + out, p, l);
            out += l;
            body[out++] = '\n';
            body[out] = '\0';
        }
    }
    free(text);
    return CM_OK;
}

/* ---- resharding ---- */

/* How one table's reshard spends its memory budget (ps_checkpoint_reshard says on what). */
typedef struct reshard_plan {
    size_t wbuf;   /* each new shard's snapshot writer buffer */
    uint64_t keys; /* the table's keys' (cm_keyset) */
} reshard_plan;

/* What the reshard holds beside its plan's buffers: the shard manifests, the writers' own
 * state, paths. */
#define PLAN_SLACK (64u << 10)

static int reshard_plan_of(uint64_t mem, uint32_t n_new, size_t row, size_t sketch_bytes,
                           const char *table, reshard_plan *p, char **errptr)
{
    /* One chunk read at a time (emb_snapshot_foreach; a writer's commit hashes with one once
     * the reading is done) and the summed sketch while one old shard's is added to it. */
    uint64_t fixed =
        EMB_SNAPSHOT_CHUNK + row + 2 * (uint64_t)sketch_bytes + PLAN_SLACK + (uint64_t)n_new * 512;
    uint64_t least = fixed + (uint64_t)n_new * row;
    if (mem < least)
        return cm_err(errptr, CM_EINVAL,
                      "a memory budget of %" PRIu64 " bytes is too small to reshard table %s "
                      "(rows of %zu bytes) over %u shards: it needs at least %" PRIu64
                      " bytes (a read chunk, a row per new shard, the admission sketch) and "
                      "room for its keys",
                      mem, table, row, n_new, least);
    uint64_t avail = mem - fixed, wbuf = avail / 4 / n_new;
    if (wbuf > EMB_SNAPSHOT_CHUNK) wbuf = EMB_SNAPSHOT_CHUNK;
    p->wbuf = wbuf < row ? row : (size_t)(wbuf / row * row);
    p->keys = avail - (uint64_t)n_new * p->wbuf;
    return CM_OK;
}

typedef struct reshard_arg {
    emb_snapshot_writer **w;
    uint32_t n;
    cm_keyset *keys;
    char **errptr;
} reshard_arg;

static int reshard_row(const emb_row *row, void *arg)
{
    reshard_arg *ra = arg;
    int rc = cm_keyset_add(ra->keys, row->key, ra->errptr);
    if (rc == CM_OK)
        rc = emb_snapshot_writer_add(ra->w[ps_key_shard(row->key, ra->n)], row, ra->errptr);
    return rc;
}

/* Copies a file a chunk at a time (a dense block may be large), atomically. */
static int copy_file(const char *from, const char *to, char **errptr)
{
    int fd = open(from, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return cm_err_errno(errptr, CM_EIO, "cannot open %s", from);
    uint8_t *buf = malloc(EMB_SNAPSHOT_CHUNK);
    cm_afile f;
    int rc = buf ? cm_afile_open(&f, to, errptr) : cm_err(errptr, CM_ENOMEM, "out of memory");
    bool open_ok = rc == CM_OK;
    for (ssize_t k = 1; rc == CM_OK && k != 0;) {
        k = read(fd, buf, EMB_SNAPSHOT_CHUNK);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0)
            rc = cm_err_errno(errptr, CM_EIO, "cannot read %s", from);
        else if (k > 0)
            rc = cm_afile_write(&f, buf, (size_t)k, errptr);
    }
    if (open_ok && rc == CM_OK)
        rc = cm_afile_commit(&f, errptr);
    else if (open_ok)
        cm_afile_abort(&f);
    close(fd);
    free(buf);
    return rc;
}

int ps_checkpoint_reshard(const char *from, const char *to, uint32_t n_new, uint64_t mem,
                          char **errptr)
{
    if (mem == 0) mem = PS_RESHARD_MEMORY_DEFAULT;
    char tables[PS_MAX_TABLES][PS_NAME_MAX], dense[PS_MAX_DENSE][PS_NAME_MAX];
    uint32_t n_old = 0, n_t = 0, n_d = 0;
    char path[4400], src[4400], body[16000], text[16400];
    if (n_new == 0 || n_new > PS_MAX_SHARDS)
        return cm_err(errptr, CM_EINVAL, "shard count %u out of range 1..%u", n_new, PS_MAX_SHARDS);
    int rc = ps_checkpoint_shards(from, &n_old, errptr);
    if (rc == CM_OK) rc = ps_checkpoint_names(from, tables, &n_t, dense, &n_d, errptr);
    if (rc == CM_OK) rc = manifest_body(from, body, sizeof body, errptr);
    /* `to` is this call's to fill (and to remove on failure): the caller places it, after
     * adding what else a checkpoint holds, so a directory in place is never half written. */
    struct stat st;
    if (rc == CM_OK && lstat(to, &st) == 0)
        rc = cm_err(errptr, CM_EINVAL, "reshard output %s exists (it must be a new directory)", to);
    bool made = rc == CM_OK;
    for (uint32_t i = 0; rc == CM_OK && i < n_new; i++) {
        snprintf(path, sizeof path, "%s/shard-%u", to, i);
        rc = cm_mkdirs(path, errptr);
        int len = ps_shard_manifest_text(i, n_new, body, text, sizeof text);
        snprintf(path, sizeof path, "%s/shard-%u/MANIFEST", to, i);
        if (rc == CM_OK)
            rc = len < 0 ? cm_err(errptr, CM_ERR, "manifest too long")
                         : cm_write_file_atomic(path, text, (size_t)len, errptr);
    }
    /* Every row goes to the shard the key hashes to among n_new, streamed from the old shards'
     * snapshots into the new ones' writers, table by table; its key goes to a key set that finds
     * one twice (a damaged checkpoint, checksums and all, would otherwise carry both). */
    char scratch[4400];
    snprintf(scratch, sizeof scratch, "%s/" PS_RESHARD_SCRATCH, to);
    for (uint32_t t = 0; rc == CM_OK && t < n_t; t++) {
        emb_table_config cfg;
        uint64_t step = 0, rows = 0;
        uint16_t *sketch = NULL;
        size_t sketch_n = 0;
        rc = ps_checkpoint_table_config(from, tables[t], &cfg, errptr);
        /* The admission sketch is not split by key like the rows: every new shard gets the sum
         * of the old shards' (see emb_snapshot_sketch_add), so a key seen N-1 times is still
         * admitted at its next sighting wherever it now lives. */
        for (uint32_t i = 0; rc == CM_OK && i < n_old; i++) {
            uint64_t s = 0, r = 0;
            snprintf(path, sizeof path, "%s/shard-%u/table-%s", from, i, tables[t]);
            rc = emb_snapshot_step(path, &s, errptr);
            if (rc == CM_OK) rc = emb_snapshot_rows(path, &r, errptr);
            if (rc == CM_OK) rc = emb_snapshot_sketch_add(path, &sketch, &sketch_n, errptr);
            if (s > step) step = s;
            rows = r > UINT64_MAX - rows ? UINT64_MAX : rows + r;
        }
        reshard_plan plan = {0};
        if (rc == CM_OK)
            rc = reshard_plan_of(mem, n_new, emb_row_bytes(&cfg), sketch_n * sizeof *sketch,
                                 tables[t], &plan, errptr);
        cm_keyset *ks = NULL;
        char *why = NULL;
        if (rc == CM_OK && (rc = cm_keyset_create(scratch, rows, plan.keys, &ks, &why)) != CM_OK)
            cm_err(errptr, rc, "cannot reshard table %s over %u shards: %s", tables[t], n_new, why);
        free(why);
        emb_snapshot_writer **w = calloc(n_new, sizeof *w);
        if (rc == CM_OK && w == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        for (uint32_t i = 0; rc == CM_OK && i < n_new; i++) {
            snprintf(path, sizeof path, "%s/shard-%u/table-%s", to, i, tables[t]);
            rc = emb_snapshot_writer_open(path, &cfg, step, sketch, sketch_n, plan.wbuf, &w[i],
                                          errptr);
        }
        reshard_arg ra = {w, n_new, ks, errptr};
        if (rc == CM_OK) rc = ps_checkpoint_foreach_row(from, tables[t], reshard_row, &ra, errptr);
        bool twice = false;
        uint64_t key = 0;
        if (rc == CM_OK) rc = cm_keyset_twice(ks, &twice, &key, errptr);
        if (rc == CM_OK && twice)
            rc = cm_err(errptr, CM_ECORRUPT, "%s: table %s: key %" PRIu64 " twice", from, tables[t],
                        key);
        cm_keyset_destroy(ks);
        /* A commit frees its writer whatever happens; after a failure the rest are dropped. */
        for (uint32_t i = 0; w && i < n_new; i++) {
            if (rc == CM_OK)
                rc = emb_snapshot_writer_commit(w[i], errptr);
            else
                emb_snapshot_writer_abort(w[i]);
        }
        free(w);
        free(sketch);
    }
    /* Dense block b lives on shard b % shards. */
    for (uint32_t b = 0; rc == CM_OK && b < n_d; b++) {
        snprintf(src, sizeof src, "%s/shard-%u/dense-%s.bin", from, b % n_old, dense[b]);
        snprintf(path, sizeof path, "%s/shard-%u/dense-%s.bin", to, b % n_new, dense[b]);
        rc = copy_file(src, path, errptr);
    }
    if (rc != CM_OK && made) cm_rmtree(to, NULL);
    return rc;
}
