/*
 * ember export: a training checkpoint to a serving bundle (or safetensors, or RocksDB).
 * A delta (--since OLD) holds the rows whose weights changed since OLD, the rows OLD had that
 * are gone, and the new tower: stacked on OLD's bundle it serves what a full export serves.
 */
#include <getopt.h>
#include <inttypes.h>
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

typedef struct rows {
    uint32_t dim;
    uint64_t n, cap;
    uint64_t *keys;
    float *w;
} rows;

static int rows_add(const emb_row *r, void *arg)
{
    rows *t = arg;
    if (t->n == t->cap) {
        uint64_t cap = t->cap ? t->cap * 2 : 4096;
        uint64_t *k = realloc(t->keys, cap * sizeof *k);
        if (k) t->keys = k;
        float *w = realloc(t->w, cap * t->dim * sizeof *w);
        if (w) t->w = w;
        if (!k || !w) return CM_ENOMEM;
        t->cap = cap;
    }
    t->keys[t->n] = r->key;
    memcpy(t->w + t->n * t->dim, r->weights, t->dim * sizeof(float));
    t->n++;
    return 0;
}

static void rows_free(rows *t)
{
    free(t->keys);
    free(t->w);
    memset(t, 0, sizeof *t);
}

/* Open-addressing map key -> xxh3 of the row's weights, for the delta comparison. */
typedef struct fp_map {
    uint64_t cap, *keys, *fps;
    uint8_t *used, *seen;
} fp_map;

static void fp_map_free(fp_map *m)
{
    free(m->keys);
    free(m->fps);
    free(m->used);
    free(m->seen);
}

static int fp_map_build(fp_map *m, const rows *old)
{
    m->cap = 16;
    while (m->cap < old->n * 2) m->cap <<= 1;
    m->keys = malloc(m->cap * 8);
    m->fps = malloc(m->cap * 8);
    m->used = calloc(m->cap, 1);
    m->seen = calloc(m->cap, 1);
    if (!m->keys || !m->fps || !m->used || !m->seen) return CM_ENOMEM;
    for (uint64_t i = 0; i < old->n; i++) {
        uint64_t s = XXH3_64bits(&old->keys[i], 8) & (m->cap - 1);
        while (m->used[s]) s = (s + 1) & (m->cap - 1);
        m->used[s] = 1;
        m->keys[s] = old->keys[i];
        m->fps[s] = XXH3_64bits(old->w + i * old->dim, old->dim * sizeof(float));
    }
    return CM_OK;
}

/* Keeps only rows new or changed since old; fills deleted with old keys now gone. */
static int delta_rows(rows *cur, const rows *old, uint64_t **deleted, uint64_t *n_deleted,
                      char **errptr)
{
    fp_map m = {0};
    int rc = fp_map_build(&m, old) == CM_OK ? CM_OK : cm_err(errptr, CM_ENOMEM, "out of memory");
    uint64_t kept = 0;
    for (uint64_t i = 0; rc == CM_OK && i < cur->n; i++) {
        uint64_t s = XXH3_64bits(&cur->keys[i], 8) & (m.cap - 1);
        bool changed = true;
        while (m.used[s]) {
            if (m.keys[s] == cur->keys[i]) {
                m.seen[s] = 1;
                changed = m.fps[s] != XXH3_64bits(cur->w + i * cur->dim, cur->dim * sizeof(float));
                break;
            }
            s = (s + 1) & (m.cap - 1);
        }
        if (!changed) continue;
        cur->keys[kept] = cur->keys[i];
        memmove(cur->w + kept * cur->dim, cur->w + i * cur->dim, cur->dim * sizeof(float));
        kept++;
    }
    cur->n = kept;
    *n_deleted = 0;
    *deleted = malloc((old->n + 1) * sizeof **deleted);
    if (rc == CM_OK && *deleted == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
    for (uint64_t s = 0; rc == CM_OK && s < m.cap; s++)
        if (m.used[s] && !m.seen[s]) (*deleted)[(*n_deleted)++] = m.keys[s];
    fp_map_free(&m);
    return rc;
}

/* A table's part of a checkpoint's identity: its name, dim, row count and the sum of its rows'
 * hashes (free of order: a resharded checkpoint holds the same). */
static uint64_t table_digest(const char *name, const rows *t)
{
    uint64_t sum = 0;
    for (uint64_t i = 0; i < t->n; i++)
        sum += XXH3_64bits_withSeed(t->w + i * t->dim, t->dim * sizeof(float), t->keys[i]);
    uint64_t v[3] = {t->dim, t->n, sum};
    return XXH3_64bits_withSeed(v, sizeof v, XXH3_64bits(name, strlen(name)));
}

/* A checkpoint's identity (ember_serve_writer_source): its tables' digests and its tower. */
static uint64_t content_id(const uint64_t *digests, uint32_t n, const float *tower,
                           uint64_t n_tower)
{
    return XXH3_64bits_withSeed(digests, n * sizeof *digests,
                                XXH3_64bits(tower, n_tower * sizeof *tower));
}

/* A key twice in a table's rows: a snapshot is input (hand-made, another tool's), checksums and
 * all, and the reader keeps no set of keys (ps_checkpoint_foreach_row), so safetensors held the
 * key twice, RocksDB its last copy, and the bundle's writer refused it naming no file. A row is
 * read only from the shard its key hashes to, so both copies are in that shard's snapshot,
 * which is named. The rows are all in memory here anyway: a sorted copy of the keys is cheap. */
static int keys_unique(const char *ckpt, const char *name, const rows *t, char **errptr)
{
    uint64_t *k = malloc(t->n * sizeof *k + 1);
    if (k == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory checking table %s's keys", name);
    memcpy(k, t->keys, t->n * sizeof *k);
    qsort(k, t->n, sizeof *k, cm_u64_cmp);
    uint64_t i = 1;
    while (i < t->n && k[i] != k[i - 1])
        i++;
    int rc = CM_OK;
    uint32_t shards = 0;
    if (i < t->n && (rc = ps_checkpoint_shards(ckpt, &shards, errptr)) == CM_OK)
        rc = cm_err(errptr, CM_ECORRUPT, "%s/shard-%u/table-%s: key %" PRIu64 " twice", ckpt,
                    ps_key_shard(k[i], shards), name, k[i]);
    free(k);
    return rc;
}

static int load_table(const char *ckpt, const char *name, rows *t, char **errptr)
{
    emb_table_config cfg;
    int rc = ps_checkpoint_table_config(ckpt, name, &cfg, errptr);
    if (rc != CM_OK) return rc;
    t->dim = cfg.dim;
    rc = ps_checkpoint_foreach_row(ckpt, name, rows_add, t, errptr);
    if (rc == CM_ENOMEM) rc = cm_err(errptr, rc, "out of memory reading table %s", name);
    if (rc == CM_OK) rc = keys_unique(ckpt, name, t, errptr);
    return rc;
}

/* safetensors: u64 header length, JSON header, then the tensors' bytes. */
static int write_safetensors(const char *out, const char *model, char (*names)[PS_NAME_MAX],
                             const rows *tabs, uint32_t n_tabs, const float *tower, uint64_t n_tower,
                             uint64_t step, char **errptr)
{
    char *hdr = NULL;
    size_t len = 0;
    FILE *h = open_memstream(&hdr, &len);
    if (h == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    uint64_t off = 0;
    fputc('{', h);
    for (uint32_t i = 0; i < n_tabs; i++) {
        uint64_t kb = tabs[i].n * 8, wb = tabs[i].n * tabs[i].dim * 4;
        fputc('"', h);
        cm_json_escape(h, names[i]);
        fprintf(h,
                ".keys\":{\"dtype\":\"U64\",\"shape\":[%" PRIu64 "],\"data_offsets\":[%" PRIu64
                ",%" PRIu64 "]},\"",
                tabs[i].n, off, off + kb);
        cm_json_escape(h, names[i]);
        fprintf(h,
                ".weights\":{\"dtype\":\"F32\",\"shape\":[%" PRIu64
                ",%u],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]},",
                tabs[i].n, tabs[i].dim, off + kb, off + kb + wb);
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
    int rc = cm_afile_open(&f, out, errptr);
    if (rc == CM_OK) rc = cm_afile_write(&f, &hl, 8, errptr);
    if (rc == CM_OK) rc = cm_afile_write(&f, hdr, len, errptr);
    for (uint32_t i = 0; rc == CM_OK && i < n_tabs; i++) {
        rc = cm_afile_write(&f, tabs[i].keys, tabs[i].n * 8, errptr);
        if (rc == CM_OK) rc = cm_afile_write(&f, tabs[i].w, tabs[i].n * tabs[i].dim * 4, errptr);
    }
    if (rc == CM_OK) rc = cm_afile_write(&f, tower, n_tower * 4, errptr);
    if (rc == CM_OK) rc = cm_afile_commit(&f, errptr);
    else cm_afile_abort(&f);
    free(hdr);
    return rc;
}

/* RocksDB: out/<table>/ maps the key (8 bytes big-endian) to a record {key, dim fp32};
 * out/model.txt and out/tower.f32 beside them. Built in a folder beside out and swapped in
 * whole (cm_dir_swap), as a bundle is: a failed export leaves out as it was, and a table of an
 * earlier export into out does not stay beside this one's. */
static int write_rocksdb(const char *out, const char *model, char (*names)[PS_NAME_MAX],
                         const rows *tabs, uint32_t n_tabs, const float *tower, uint64_t n_tower,
                         char **errptr)
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
        size_t rec = 8 + 4 * (size_t)tabs[i].dim;
        snprintf(path, sizeof path, "%s/%s", tmp, names[i]);
        emb_store *st = NULL;
        rc = emb_store_create("rocksdb", path, rec, &st, errptr);
        uint8_t *buf = rc == CM_OK ? malloc(4096 * rec) : NULL;
        if (rc == CM_OK && buf == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        for (uint64_t r = 0; rc == CM_OK && r < tabs[i].n; r += 4096) {
            uint64_t k = tabs[i].n - r < 4096 ? tabs[i].n - r : 4096;
            for (uint64_t j = 0; j < k; j++) {
                memcpy(buf + j * rec, &tabs[i].keys[r + j], 8);
                memcpy(buf + j * rec + 8, tabs[i].w + (r + j) * tabs[i].dim, rec - 8);
            }
            rc = emb_store_put(st, buf, k, errptr);
        }
        free(buf);
        emb_store_destroy(st);
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
            "  DIR is a checkpoint (ckpt/step-N) or a run directory (its ckpt/LATEST)\n"
            "  --precision and --since are for bundles (safetensors and RocksDB hold fp32)\n");
}

int cmd_export(int argc, char **argv)
{
    static const struct option opts[] = {{"checkpoint", 1, 0, 'c'}, {"out", 1, 0, 'o'},
                                         {"precision", 1, 0, 'p'},  {"since", 1, 0, 's'},
                                         {"format", 1, 0, 'f'},     {"help", 0, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *in = NULL, *out = NULL, *since = NULL, *format = "bundle", *prec_name = NULL;
    ember_serve_precision prec = EMBER_SERVE_FP32;
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
    rows tabs[PS_MAX_TABLES];
    memset(tabs, 0, sizeof tabs);
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
    if (rc == CM_OK) rc = ps_checkpoint_names(ckpt, tnames, &n_t, dnames, &n_d, &err);
    snprintf(path, sizeof path, "%s/model.txt", ckpt);
    if (rc == CM_OK) rc = cm_read_sealed(path, &model, &mlen, &err);
    if (rc == CM_OK) rc = ps_checkpoint_dense(ckpt, "tower", &tower, &n_tower, &err);
    uint64_t dig[PS_MAX_TABLES], old_dig[PS_MAX_TABLES];
    for (uint32_t i = 0; rc == CM_OK && i < n_t; i++) {
        rc = load_table(ckpt, tnames[i], &tabs[i], &err);
        dig[i] = rc == CM_OK ? table_digest(tnames[i], &tabs[i]) : 0;
    }
    if (rc == CM_OK && bundle) rc = ember_serve_writer_model(w, model, &err);
    if (rc == CM_OK && bundle) rc = ember_serve_writer_dense(w, tower, n_tower, &err);
    uint64_t total = 0, total_deleted = 0;
    for (uint32_t i = 0; rc == CM_OK && bundle && i < n_t; i++) {
        uint64_t *deleted = NULL, n_deleted = 0;
        if (since) {
            rows old = {0};
            rc = load_table(old_ckpt, tnames[i], &old, &err);
            old_dig[i] = rc == CM_OK ? table_digest(tnames[i], &old) : 0;
            if (rc == CM_OK) rc = delta_rows(&tabs[i], &old, &deleted, &n_deleted, &err);
            rows_free(&old);
        }
        if (rc == CM_OK)
            rc = ember_serve_writer_table(w, tnames[i], tabs[i].dim, tabs[i].keys, tabs[i].w, tabs[i].n,
                                          deleted, n_deleted, &err);
        total += tabs[i].n;
        total_deleted += n_deleted;
        free(deleted);
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
    if (rc == CM_OK && st) rc = write_safetensors(out, model, tnames, tabs, n_t, tower, n_tower, step, &err);
    if (rc == CM_OK && rdb) rc = write_rocksdb(out, model, tnames, tabs, n_t, tower, n_tower, &err);
    for (uint32_t i = 0; !bundle && i < n_t; i++) total += tabs[i].n;
    ember_serve_writer_abort(w);
    for (uint32_t i = 0; i < PS_MAX_TABLES; i++) rows_free(&tabs[i]);
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
