/*
 * libFuzzer target: the offline readers of a PS cluster checkpoint (ps_checkpoint_shards,
 * ps_checkpoint_names, ps_checkpoint_table_config, ps_checkpoint_foreach_row,
 * ps_checkpoint_dense, ps_checkpoint_reshard) and the dense block files they read.
 *
 * A valid 2-shard checkpoint is written once the way the server's SAVE writes one (save_shard
 * in ps/server.c): per shard an embedding snapshot of each table (emb_table_snapshot of a table
 * holding the keys ps_key_shard gives that shard), dense blocks with ps_dense_save (block b on
 * shard b % 2) and the shard MANIFEST from ps_shard_manifest_text. Tables: "t" (sgd, dim 4) and
 * "a" (adagrad, dim 2, with an admission sketch); dense blocks "d" (adam, 10 floats) and "e"
 * (sgd, 3). Each input applies up to 8 mutations to files it picks (fuzz_ckpt.h, plus dense
 * header fields and values) and recomputes every size and checksum.
 *
 * Properties checked (abort on violation): every failure is a negative code with a message
 * naming the checkpoint (or the reshard output); names read back are plain names (what
 * ps_config_check allows: reshard makes paths of them); the rows of a table each come from the
 * shard its key hashes to; a failed reshard leaves no output; a resharded
 * checkpoint reads back with the new shard count, the same names and every row once.
 */
#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "ps/checkpoint.h"
#include "ps/dense.h"
#include "ps/ps.h"
#include "tests/fuzz_ckpt/fuzz_ckpt.h"

#define SHARDS 2u
#define NT 2u
#define ND 2u
#define NKEYS 40u

static const char *const g_tables[NT] = {"t", "a"};
static const char *const g_dense[ND] = {"d", "e"};
static const uint64_t g_dense_size[ND] = {10, 3};

typedef struct ckpt {
    fz_buf mf[SHARDS];        /* shard MANIFESTs, unsealed */
    fz_snap snap[SHARDS][NT]; /* shard-i/table-<name> */
    fz_buf dense[ND];         /* shard-(b % SHARDS)/dense-<name>.bin */
} ckpt;

static char g_base[4096], g_ckpt[4200], g_out[4200];
static ckpt g_orig, g_cur;

static void rmtree_at_exit(void)
{
    cm_rmtree(g_base, NULL);
}

static void snap_dir(char *p, size_t n, const char *root, uint32_t shard, const char *table)
{
    snprintf(p, n, "%s/shard-%u/table-%s", root, shard, table);
}

static void dense_path(char *p, size_t n, const char *root, uint32_t b)
{
    snprintf(p, n, "%s/shard-%u/dense-%s.bin", root, b % SHARDS, g_dense[b]);
}

static void write_checkpoint(const char *root)
{
    char p[4400];
    for (uint32_t t = 0; t < NT; t++) {
        emb_table_config cfg;
        emb_table_config_init(&cfg);
        cfg.dim = t == 0 ? 4 : 2;
        cfg.opt = t == 0 ? EMB_OPT_SGD : EMB_OPT_ADAGRAD;
        cfg.n_sub = 2;
        cfg.admit_threshold = t == 0 ? 0 : 2;
        emb_table *tab[SHARDS];
        for (uint32_t s = 0; s < SHARDS; s++)
            if (emb_table_create(&cfg, &tab[s], NULL) != CM_OK) abort();
        float w[4], g[4] = {0.5f, -0.25f, 0.125f, 1.0f};
        for (uint32_t round = 0; round < 2; round++)
            for (uint32_t k = 0; k < NKEYS - 10 * round; k++) {
                uint64_t key = 7919ull * k + 3;
                emb_table *e = tab[ps_key_shard(key, SHARDS)];
                if (emb_table_pull(e, &key, 1, w, NULL) != CM_OK ||
                    emb_table_push(e, &key, 1, g, NULL) != CM_OK)
                    abort();
            }
        for (uint32_t s = 0; s < SHARDS; s++) {
            snap_dir(p, sizeof p, root, s, g_tables[t]);
            if (emb_table_snapshot(tab[s], p, NULL) != CM_OK) abort();
            emb_table_destroy(tab[s]);
        }
    }
    for (uint32_t b = 0; b < ND; b++) {
        ps_dense_spec spec = {.size = g_dense_size[b],
                              .opt = b == 0 ? PS_DENSE_ADAM : PS_DENSE_SGD,
                              .lr = 0.1f,
                              .beta1 = 0.9f,
                              .beta2 = 0.999f,
                              .eps = 1e-8f};
        snprintf(spec.name, sizeof spec.name, "%s", g_dense[b]);
        ps_dense *d = NULL;
        float v[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, grad[10] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
        if (ps_dense_create(&spec, &d, NULL) != CM_OK) abort();
        ps_dense_init(d, v);
        ps_dense_push(d, grad);
        dense_path(p, sizeof p, root, b);
        if (ps_dense_save(d, p, NULL) != CM_OK) abort();
        ps_dense_destroy(d);
    }
    /* The fingerprints stand for the configs; the readers compare them only across shards. */
    char body[512], text[1024];
    int len = 0;
    for (uint32_t t = 0; t < NT; t++)
        len += snprintf(body + len, sizeof body - (size_t)len, "table %s %016" PRIx64 "\n",
                        g_tables[t], cm_xxh3(g_tables[t], 1));
    for (uint32_t b = 0; b < ND; b++)
        len += snprintf(body + len, sizeof body - (size_t)len, "dense %s %016" PRIx64 "\n",
                        g_dense[b], cm_xxh3(g_dense[b], 1));
    for (uint32_t s = 0; s < SHARDS; s++) {
        int n = ps_shard_manifest_text(s, SHARDS, body, text, sizeof text);
        snprintf(p, sizeof p, "%s/shard-%u/MANIFEST", root, s);
        if (n < 0 || cm_write_file_atomic(p, text, (size_t)n, NULL) != CM_OK) abort();
    }
}

static void ckpt_load(ckpt *c, const char *root)
{
    char p[4400];
    for (uint32_t s = 0; s < SHARDS; s++) {
        snprintf(p, sizeof p, "%s/shard-%u/MANIFEST", root, s);
        fz_load(&c->mf[s], p);
        fz_mf_unseal(&c->mf[s]);
        for (uint32_t t = 0; t < NT; t++) {
            snap_dir(p, sizeof p, root, s, g_tables[t]);
            fz_snap_load(&c->snap[s][t], p);
        }
    }
    for (uint32_t b = 0; b < ND; b++) {
        dense_path(p, sizeof p, root, b);
        fz_load(&c->dense[b], p);
    }
}

static void ckpt_copy(ckpt *to, const ckpt *from)
{
    for (uint32_t s = 0; s < SHARDS; s++) {
        fz_set(&to->mf[s], from->mf[s].b, from->mf[s].len);
        for (uint32_t t = 0; t < NT; t++)
            fz_snap_copy(&to->snap[s][t], &from->snap[s][t]);
    }
    for (uint32_t b = 0; b < ND; b++)
        fz_set(&to->dense[b], from->dense[b].b, from->dense[b].len);
}

/* Header of a dense file: magic 0, version 8 and opt 12 (u32), size 16, step 24, initialised
 * 32 (u64); the values from 40. */
static void dense_op(fz_buf *f, fz_in *in)
{
    switch (fz_u8(in) % 3) {
    case 0:
        fz_raw_op(f, in);
        break;
    case 1: {
        static const uint8_t off[] = {8, 12, 16, 24, 32};
        size_t k = fz_u8(in) % sizeof off;
        int w = off[k] < 16 ? 4 : 8;
        uint64_t v = fz_value(in, fz_get(f, off[k], w));
        fz_put(f, off[k], &v, (size_t)w);
        break;
    }
    default: {
        static const uint32_t bits[] = {0x7fc00000u, 0x7f800000u, 0xff800000u};
        uint32_t x = bits[fz_u8(in) % 3];
        if (f->len >= 52) fz_put(f, 40 + 4 * (fz_u8(in) % ((f->len - 48) / 4)), &x, 4);
        break;
    }
    }
}

static void ckpt_op(ckpt *c, fz_in *in)
{
    uint8_t k = fz_u8(in);
    uint32_t s = (k >> 4) % SHARDS;
    switch (k % 4) {
    case 0:
        fz_mf_op(&c->mf[s], in);
        break;
    case 1:
        dense_op(&c->dense[(k >> 5) % ND], in);
        break;
    default:
        fz_snap_op(&c->snap[s][(k >> 5) % NT], in);
        break;
    }
}

static void ckpt_fix_store(ckpt *c, const char *root)
{
    char p[4400];
    for (uint32_t s = 0; s < SHARDS; s++) {
        fz_mf_seal(&c->mf[s]);
        snprintf(p, sizeof p, "%s/shard-%u/MANIFEST", root, s);
        fz_store(&c->mf[s], p);
        for (uint32_t t = 0; t < NT; t++) {
            fz_snap_fix(&c->snap[s][t]);
            snap_dir(p, sizeof p, root, s, g_tables[t]);
            fz_snap_store(&c->snap[s][t], p);
        }
    }
    for (uint32_t b = 0; b < ND; b++) {
        fz_fix_trailer(&c->dense[b]);
        dense_path(p, sizeof p, root, b);
        fz_store(&c->dense[b], p);
    }
}

static void init(void)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(g_base, sizeof g_base, "%s/ember-fuzz-ckpt-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (mkdtemp(g_base) == NULL) abort();
    atexit(rmtree_at_exit);
    char orig[4200];
    snprintf(orig, sizeof orig, "%s/orig", g_base);
    write_checkpoint(orig);
    ckpt_load(&g_orig, orig);
    snprintf(g_ckpt, sizeof g_ckpt, "%s/ckpt", g_base);
    write_checkpoint(g_ckpt); /* the directories; the files are rewritten per input */
    snprintf(g_out, sizeof g_out, "%s/out", g_base);
}

/* What ps_config_check allows a table or dense name to be (config.c, name_ok). */
static bool plain_name(const char *name)
{
    if (name[0] == '\0' || name[0] == '.') return false;
    for (const char *p = name; *p; p++)
        if (!(isalnum((unsigned char)*p) || *p == '_' || *p == '-' || *p == '.')) return false;
    return true;
}

typedef struct rows {
    uint64_t *keys;
    size_t n, cap;
} rows;

static int collect(const emb_row *row, void *arg)
{
    rows *r = arg;
    if (r->n == r->cap) {
        r->cap = r->cap ? 2 * r->cap : 64;
        r->keys = realloc(r->keys, r->cap * sizeof *r->keys);
        if (r->keys == NULL) abort();
    }
    r->keys[r->n++] = row->key;
    return 0;
}

/* The rows of one table of a checkpoint of n shards, checked: each on its shard (the shards
 * come in order, so the shard a key hashes to never goes down). A key twice within a shard is
 * not checked: foreach keeps no set of keys; reshard must refuse it (the row counts after it
 * are compared). Returns the foreach result; *count gets the rows. */
static int table_rows(const char *root, const char *table, uint32_t n, size_t *count, char **err)
{
    rows r = {0};
    int rc = ps_checkpoint_foreach_row(root, table, collect, &r, err);
    if (rc == CM_OK) {
        for (size_t i = 0; i < r.n; i++) /* shard order: the shard index never goes down */
            if (i > 0 && ps_key_shard(r.keys[i], n) < ps_key_shard(r.keys[i - 1], n)) {
                fprintf(stderr, "table %s: key %" PRIu64 " not on its shard\n", table, r.keys[i]);
                abort();
            }
    }
    *count = r.n;
    free(r.keys);
    return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static bool ready;
    if (!ready) init();
    ready = true;
    fz_in in = {data, size};
    uint32_t n_new = fz_u8(&in) % 3 + 1;
    ckpt_copy(&g_cur, &g_orig);
    int ops = fz_u8(&in) % 8 + 1;
    for (int i = 0; i < ops && in.n > 0; i++)
        ckpt_op(&g_cur, &in);
    ckpt_fix_store(&g_cur, g_ckpt);

    char *err = NULL;
    uint32_t n = 0;
    int rc = ps_checkpoint_shards(g_ckpt, &n, &err);
    fz_check_err(rc, &err, g_ckpt);
    if (rc == CM_OK && (n == 0 || n > SHARDS)) abort(); /* shard-2 and up do not exist */

    static char tables[PS_MAX_TABLES][PS_NAME_MAX], dense[PS_MAX_DENSE][PS_NAME_MAX];
    uint32_t nt = 0, nd = 0;
    rc = ps_checkpoint_names(g_ckpt, tables, &nt, dense, &nd, &err);
    fz_check_err(rc, &err, g_ckpt);
    if (rc != CM_OK) nt = nd = 0;
    size_t counts[PS_MAX_TABLES];
    int rows_rc[PS_MAX_TABLES];
    for (uint32_t t = 0; t < nt; t++) {
        if (!plain_name(tables[t])) {
            fprintf(stderr, "table name '%s' read from a checkpoint\n", tables[t]);
            abort();
        }
        emb_table_config cfg;
        rc = ps_checkpoint_table_config(g_ckpt, tables[t], &cfg, &err);
        fz_check_err(rc, &err, g_ckpt);
        rows_rc[t] = table_rows(g_ckpt, tables[t], n, &counts[t], &err);
        fz_check_err(rows_rc[t], &err, g_ckpt);
    }
    for (uint32_t b = 0; b < nd; b++) {
        if (!plain_name(dense[b])) {
            fprintf(stderr, "dense name '%s' read from a checkpoint\n", dense[b]);
            abort();
        }
        float *v = NULL;
        uint64_t len = 0;
        rc = ps_checkpoint_dense(g_ckpt, dense[b], &v, &len, &err);
        fz_check_err(rc, &err, g_ckpt);
        if (rc == CM_OK) free(v);
    }

    cm_rmtree(g_out, NULL);
    rc = ps_checkpoint_reshard(g_ckpt, g_out, n_new, 0, &err);
    fz_check_err(rc, &err, g_base);
    if (rc != CM_OK) {
        if (access(g_out, F_OK) == 0) abort(); /* a failed reshard leaves nothing */
        return 0;
    }
    uint32_t n2 = 0, nt2 = 0, nd2 = 0;
    static char tables2[PS_MAX_TABLES][PS_NAME_MAX], dense2[PS_MAX_DENSE][PS_NAME_MAX];
    if (ps_checkpoint_shards(g_out, &n2, &err) != CM_OK || n2 != n_new ||
        ps_checkpoint_names(g_out, tables2, &nt2, dense2, &nd2, &err) != CM_OK || nt2 != nt ||
        nd2 != nd) {
        fprintf(stderr, "resharded checkpoint: %s\n", err ? err : "shards or names differ");
        abort();
    }
    for (uint32_t t = 0; t < nt; t++) {
        size_t c2 = 0;
        rc = table_rows(g_out, tables2[t], n_new, &c2, &err);
        if (strcmp(tables[t], tables2[t]) != 0 || rc != CM_OK || rows_rc[t] != CM_OK ||
            c2 != counts[t]) {
            fprintf(stderr, "resharded table %s: rc %d (%s), %zu rows of %zu (rc %d)\n", tables[t],
                    rc, err ? err : "", c2, counts[t], rows_rc[t]);
            abort();
        }
    }
    return 0;
}
