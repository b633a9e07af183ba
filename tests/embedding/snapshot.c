/*
 * emb_snapshot: snapshot / restore.
 *  - a trained Adam table with most rows spilled is snapshotted and restored fully in memory
 *    and into a smaller budget: every row bit-identical, same step and model config; the three
 *    tables then train on identically (Adam's per-row t and state must have come back).
 *  - a snapshot over an existing one replaces it.
 *  - corruption (a flipped byte in rows.bin or MANIFEST, a truncated, extended or missing
 *    file, or anything after the MANIFEST checksum line) is refused with an error naming the
 *    file, and no table is returned.
 *  - consistent lies (contents wrong, every size and checksum recomputed to match): a row
 *    stamped after the snapshot's step, a non-finite weight or optimizer state, a key twice,
 *    a row count whose size wraps around 2^64, are refused by restore and export naming the
 *    file. A key twice is refused naming the key too when its first copy was spilled during
 *    the load (a restore into a small budget).
 *  - a model-config mismatch is refused naming the field.
 *  - a snapshot path that is a symbolic link is followed and stays a link.
 *  - a snapshot writer given a table's rows writes that table's snapshot, byte for byte.
 */
#include <dirent.h>
#include <math.h>
#include <sys/stat.h>

#include "emb_util.h"

#define N 30000u
#define DIM 8u
#define BATCH 2048u

static const char *g_dir;

static void path_in(char *buf, size_t n, const char *a, const char *b)
{
    if ((size_t)snprintf(buf, n, "%s/%s", a, b) >= n) {
        fprintf(stderr, "path too long: %s/%s\n", a, b);
        exit(2);
    }
}

/* Trains the tables with one identical sequence: Zipf-like pulls then pushes. */
static void train(emb_table **ts, size_t nt, uint32_t steps, uint64_t seed)
{
    uint64_t keys[BATCH];
    float *w = eu_xmalloc(BATCH * DIM * sizeof *w), *g = eu_xmalloc(BATCH * DIM * sizeof *g);
    for (uint32_t s = 0; s < steps; s++) {
        for (uint32_t i = 0; i < BATCH; i++) keys[i] = eu_key(eu_zipfish(&seed, N));
        for (size_t i = 0; i < (size_t)BATCH * DIM; i++) g[i] = (float)(eu_unif(&seed) - 0.5);
        for (size_t t = 0; t < nt; t++) {
            eu_pull(ts[t], keys, BATCH / 2, w);
            eu_push(ts[t], keys, BATCH, g);
        }
    }
    free(w);
    free(g);
}

static void check_same_model(const emb_table_config *a, const emb_table_config *b, const char *what)
{
    CHECK_MSG(a->dim == b->dim && a->opt == b->opt && a->lr == b->lr && a->l2 == b->l2 &&
                  a->eps == b->eps && a->beta1 == b->beta1 && a->beta2 == b->beta2 &&
                  a->adagrad_init == b->adagrad_init && a->ftrl_beta == b->ftrl_beta &&
                  a->ftrl_l1 == b->ftrl_l1 && a->init_scale == b->init_scale && a->seed == b->seed,
              "%s: model config differs", what);
}

static emb_table *restore_ok(const char *snap, const emb_table_config *cfg)
{
    emb_table *t = NULL;
    char *err = NULL;
    CHECK_OK(emb_table_restore(snap, cfg, &t, &err), err);
    if (t == NULL) exit(check_done()); /* nothing below can run without it */
    return t;
}

static void copy_dir(const char *src, const char *dst)
{
    char *err = NULL;
    cm_rmtree(dst, NULL);
    CHECK_OK(cm_mkdirs(dst, &err), err);
    DIR *d = opendir(src);
    CHECK(d != NULL);
    if (d == NULL) return;
    struct dirent *e;
    char a[4400], b[4400];
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        path_in(a, sizeof a, src, e->d_name);
        path_in(b, sizeof b, dst, e->d_name);
        void *buf = NULL;
        size_t len = 0;
        CHECK_OK(cm_read_file(a, &buf, &len, &err), err);
        CHECK_OK(cm_write_file_atomic(b, buf, len, &err), err);
        free(buf);
    }
    closedir(d);
}

static int count_cb(const emb_row *row, void *arg)
{
    (void)row;
    ++*(uint64_t *)arg;
    return 0;
}

typedef enum { FLIP, TRUNCATE, EXTEND, REMOVE, APPEND } damage;

/* Damages one file of a copy of the snapshot and checks that restore refuses it by name. */
static void corrupt_case(const char *snap, const emb_table_config *cfg, const char *file,
                         damage how, double where)
{
    char dst[4200], p[4400];
    snprintf(dst, sizeof dst, "%s/corrupt", g_dir);
    copy_dir(snap, dst);
    path_in(p, sizeof p, dst, file);
    void *buf = NULL;
    size_t len = 0;
    char *err = NULL;
    CHECK_OK(cm_read_file(p, &buf, &len, &err), err);
    size_t at = (size_t)(where * (double)(len ? len - 1 : 0));
    uint8_t *bytes = buf;
    switch (how) {
    case FLIP:
        bytes[at] ^= 0x01;
        CHECK_OK(cm_write_file_atomic(p, buf, len, &err), err);
        break;
    case TRUNCATE: CHECK(truncate(p, (off_t)at) == 0); break;
    case EXTEND: {
        uint8_t *more = eu_xmalloc(len + 1);
        memcpy(more, buf, len);
        more[len] = 0;
        CHECK_OK(cm_write_file_atomic(p, more, len + 1, &err), err);
        free(more);
        break;
    }
    case REMOVE: CHECK(unlink(p) == 0); break;
    case APPEND: { /* `echo garbage >> file` */
        static const char line[] = "garbage\n";
        uint8_t *more = eu_xmalloc(len + sizeof line - 1);
        memcpy(more, buf, len);
        memcpy(more + len, line, sizeof line - 1);
        CHECK_OK(cm_write_file_atomic(p, more, len + sizeof line - 1, &err), err);
        free(more);
        break;
    }
    }
    free(buf);
    static const char *const names[] = {"flip", "truncate", "extend", "remove", "append"};
    emb_table *t = NULL;
    int rc = emb_table_restore(dst, cfg, &t, &err);
    CHECK_MSG(rc < 0 && t == NULL && eu_has(err, file),
              "%s %s at %zu of %zu: restore rc=%d table=%p err=%s", names[how], file, at, len, rc,
              (void *)t, err ? err : "(none)");
    if (rc == 0) emb_table_destroy(t);
    free(err);
    err = NULL;
    if (strcmp(file, "MANIFEST") == 0) {
        emb_table_config back;
        rc = emb_snapshot_read_config(dst, &back, &err);
        CHECK_MSG(rc < 0 && eu_has(err, file), "%s MANIFEST: read_config rc=%d err=%s",
                  names[how], rc, err ? err : "(none)");
        free(err);
    }
    cm_rmtree(dst, NULL);
}

/* MANIFEST's "name value" line set to value, its checksum line recomputed. */
static void manifest_set(const char *dir, const char *name, const char *value)
{
    char p[4400], out[8192];
    path_in(p, sizeof p, dir, "MANIFEST");
    char *m = NULL;
    size_t len = 0, body = 0;
    char *err = NULL;
    CHECK_OK(cm_read_file(p, (void **)&m, &len, &err), err);
    CHECK(cm_seal_check(m, len, "checksum", &body) == CM_OK);
    size_t nl = strlen(name), at = 0;
    while (at < body && !(strncmp(m + at, name, nl) == 0 && m[at + nl] == ' '))
        at += strcspn(m + at, "\n") + 1;
    CHECK_MSG(at < body, "no %s line in %s", name, p);
    size_t end = at + strcspn(m + at, "\n") + 1;
    int n = snprintf(out, sizeof out, "%.*s%s %s\n%.*s", (int)at, m, name, value, (int)(body - end),
                     m + end);
    n = cm_seal_append(out, (size_t)n, sizeof out, "checksum");
    CHECK(n > 0);
    CHECK_OK(cm_write_file_atomic(p, out, (size_t)n, &err), err);
    free(m);
}

/* A copy of the snapshot at dst, its rows.bin read into *b (*len bytes; the caller frees) and
 * its header's record size and row count into *rb and *rows (checked against the length). */
static void copy_read_rows(const char *snap, const char *dst, uint8_t **b, size_t *len,
                           uint32_t *rb, uint64_t *rows)
{
    char p[4400];
    char *err = NULL;
    copy_dir(snap, dst);
    path_in(p, sizeof p, dst, "rows.bin");
    *b = NULL;
    *len = 0;
    CHECK_OK(cm_read_file(p, (void **)b, len, &err), err);
    CHECK(*b != NULL && *len >= 40);
    memcpy(rb, *b + 20, 4);
    memcpy(rows, *b + 24, 8);
    CHECK(*len == 32 + *rows * *rb + 8);
}

/* Writes b (len bytes, edited) back as dst's rows.bin with its trailer and the MANIFEST's file
 * line made to match, then frees it. */
static void reseal_rows(const char *dst, uint8_t *b, size_t len)
{
    char p[4400], v[64];
    char *err = NULL;
    path_in(p, sizeof p, dst, "rows.bin");
    uint64_t h = cm_xxh3(b, len - 8);
    memcpy(b + len - 8, &h, 8);
    CHECK_OK(cm_write_file_atomic(p, b, len, &err), err);
    snprintf(v, sizeof v, "rows.bin %zu %016" PRIx64, len, h);
    manifest_set(dst, "file", v);
    free(b);
}

typedef enum { LIE_LATE_STAMP, LIE_NAN_WEIGHT, LIE_NAN_STATE, LIE_DUP_KEY, LIE_WRAP } lie;

/* Rewrites a copy of the snapshot with one lie and every size and checksum made to match it,
 * then checks that restore and export refuse it naming rows.bin (want: a word the message must
 * hold too, or NULL). A key twice is left to restore: export does not keep every key. */
static void lie_case(const char *snap, const emb_table_config *cfg, lie what, const char *want)
{
    char dst[4200], v[64];
    snprintf(dst, sizeof dst, "%s/lie", g_dir);
    uint8_t *b;
    size_t len;
    uint32_t rb;
    uint64_t rows, step = 0;
    char *err = NULL;
    copy_read_rows(snap, dst, &b, &len, &rb, &rows);
    CHECK(rows >= 4);
    CHECK_OK(emb_snapshot_step(dst, &step, &err), err);
    uint8_t *rec = b + 32 + (rows / 2) * rb; /* a record from the middle */
    const float nan = check_f32_of(0x7fc00000u);
    switch (what) {
    case LIE_LATE_STAMP: {
        uint64_t late = step + 1;
        memcpy(rec + 16, &late, 8);
        break;
    }
    case LIE_NAN_WEIGHT:
        memcpy(rec + 24 + 4, &nan, 4);
        break;
    case LIE_NAN_STATE:
        memcpy(rec + 24 + 4 * cfg->dim, &nan, 4);
        break;
    case LIE_DUP_KEY:
        memcpy(rec, b + 32, 8);
        break;
    case LIE_WRAP: { /* rows * rb comes out the same modulo 2^64 */
        rows += 1ull << (64 - __builtin_ctz(rb));
        memcpy(b + 24, &rows, 8);
        snprintf(v, sizeof v, "%" PRIu64, rows);
        manifest_set(dst, "rows", v);
        break;
    }
    }
    reseal_rows(dst, b, len);
    static const char *const names[] = {"late stamp", "NaN weight", "NaN state", "duplicate key",
                                        "wrapped row count"};
    emb_table *t = NULL;
    int rc = emb_table_restore(dst, cfg, &t, &err);
    CHECK_MSG(rc < 0 && t == NULL && eu_has(err, "rows.bin") && (!want || eu_has(err, want)),
              "%s: restore rc=%d err=%s", names[what], rc, err ? err : "(none)");
    if (rc == 0) emb_table_destroy(t);
    free(err);
    err = NULL;
    if (what != LIE_DUP_KEY) {
        uint64_t n = 0;
        rc = emb_snapshot_foreach(dst, count_cb, &n, &err);
        CHECK_MSG(rc < 0 && n == 0 && eu_has(err, "rows.bin") && (!want || eu_has(err, want)),
                  "%s: export rc=%d after %" PRIu64 " rows, err=%s", names[what], rc, n,
                  err ? err : "(none)");
        free(err);
    }
    cm_rmtree(dst, NULL);
}

/* Record dst of a copy of the snapshot given record src's key (every size and checksum made to
 * match), restored into a table of one sub-shard whose budget holds a few hundred rows: the
 * first copy of the key has been spilled to RocksDB by the time the second arrives, where a
 * check against the rows in memory alone let both in (two rows for one key, the table's row
 * count one too many). The restore must refuse it naming rows.bin and the key. src and dst in
 * one 1 MiB read chunk or in two (the load reads the file in chunks). */
static void spilled_dup_case(const char *snap, const emb_table_config *model, uint64_t src,
                             uint64_t dst)
{
    char lie[4200], spill[4200];
    snprintf(lie, sizeof lie, "%s/lie-spill", g_dir);
    snprintf(spill, sizeof spill, "%s/spill-dup", g_dir);
    uint8_t *b;
    size_t len;
    uint32_t rb;
    uint64_t rows, key;
    char *err = NULL;
    copy_read_rows(snap, lie, &b, &len, &rb, &rows);
    CHECK(src < dst && dst < rows);
    memcpy(&key, b + 32 + src * rb, 8);
    memcpy(b + 32 + dst * rb, &key, 8);
    reseal_rows(lie, b, len);
    emb_table_config c = *model;
    c.n_sub = 1;
    c.mem_budget_bytes = (uint64_t)(256 * emb_row_mem_bytes(model));
    c.spill_path = spill;
    emb_table *t = NULL;
    char want[64];
    snprintf(want, sizeof want, "key %" PRIu64, key);
    int rc = emb_table_restore(lie, &c, &t, &err);
    emb_table_stats st = {0};
    if (t != NULL) st = eu_stats(t);
    CHECK_MSG(rc == CM_ECORRUPT && t == NULL && eu_has(err, "rows.bin") && eu_has(err, want),
              "key of record %" PRIu64 " again at %" PRIu64 " (first copy spilled): restore rc=%d "
              "err=%s; rows %" PRIu64 " in memory + %" PRIu64 " spilled for %" PRIu64 " keys",
              src, dst, rc, err ? err : "(none)", st.rows_mem, st.rows_spilled, rows - 1);
    if (t != NULL) emb_table_destroy(t);
    free(err);
    cm_rmtree(lie, NULL);
}

/* A MANIFEST line set to a value no table has (its checksum made to match): read_config and
 * restore refuse it naming the file, where read_config handed the config on (to a reshard,
 * whose emb_table_create then failed without naming any file). */
static void manifest_lie_case(const char *snap, const emb_table_config *cfg, const char *name,
                              const char *value, const char *want)
{
    char dst[4200];
    snprintf(dst, sizeof dst, "%s/lie", g_dir);
    copy_dir(snap, dst);
    manifest_set(dst, name, value);
    emb_table_config back;
    char *err = NULL;
    int rc = emb_snapshot_read_config(dst, &back, &err);
    CHECK_MSG(rc < 0 && eu_has(err, "MANIFEST") && eu_has(err, want),
              "%s %s: read_config rc=%d err=%s", name, value, rc, err ? err : "(none)");
    free(err);
    err = NULL;
    emb_table *t = NULL;
    rc = emb_table_restore(dst, cfg, &t, &err);
    CHECK_MSG(rc < 0 && t == NULL && eu_has(err, "MANIFEST"), "%s %s: restore rc=%d err=%s", name,
              value, rc, err ? err : "(none)");
    if (rc == 0) emb_table_destroy(t);
    free(err);
    cm_rmtree(dst, NULL);
}

static void mismatch_case(const char *snap, const emb_table_config *good, const char *field,
                          void (*edit)(emb_table_config *))
{
    emb_table_config c = *good;
    edit(&c);
    emb_table *t = NULL;
    char *err = NULL;
    int rc = emb_table_restore(snap, &c, &t, &err);
    CHECK_MSG(rc == CM_EINVAL && t == NULL && eu_has(err, field),
              "restore with a different %s: rc=%d err=%s", field, rc, err ? err : "(none)");
    if (rc == 0) emb_table_destroy(t);
    free(err);
}

static void edit_dim(emb_table_config *c) { c->dim++; }
static void edit_opt(emb_table_config *c) { c->opt = EMB_OPT_ADAGRAD; }
static void edit_lr(emb_table_config *c) { c->lr *= 2; }
static void edit_seed(emb_table_config *c) { c->seed++; }
static void edit_beta1(emb_table_config *c) { c->beta1 = 0.8f; }

/* Finite gradients can overflow a table's values: Adagrad's sum of squared gradients reaches
 * +inf after two pushes of 2e19 (its weights stay finite, its updates from then on are 0), and
 * SGD's weights reach -inf after two pushes of 3e38 at lr 1. The snapshot of the first was
 * written and then refused by every restore ("not finite"), a checkpoint that could never be
 * loaded; it must restore bit for bit. The second must be refused when written, naming the key,
 * with nothing left at the destination. */
static void diverged_case(void)
{
    char dir[4200], *err = NULL;
    const uint64_t key = 77;
    float g[4] = {2e19f, 2e19f, 2e19f, 2e19f}, w[4];
    emb_table_config ca = eu_config(EMB_OPT_ADAGRAD, 4);
    emb_table *a = eu_create(&ca);
    eu_push(a, &key, 1, g);
    eu_push(a, &key, 1, g);
    eu_row ra, rb;
    CHECK(eu_get(a, key, &ra) && isinf(ra.s[0]) && isfinite(ra.w[0]));
    path_in(dir, sizeof dir, g_dir, "inf-state");
    CHECK_OK(emb_table_snapshot(a, dir, &err), err);
    emb_table *b = NULL;
    int rc = emb_table_restore(dir, &ca, &b, &err);
    CHECK_MSG(rc == CM_OK, "restore of a table with +inf Adagrad state: %s", err ? err : "");
    free(err);
    err = NULL;
    if (rc == CM_OK) {
        CHECK(eu_get(b, key, &rb) && memcmp(ra.w, rb.w, sizeof ra.w) == 0 &&
              memcmp(ra.s, rb.s, sizeof ra.s) == 0 && ra.updates == rb.updates);
        emb_table_destroy(b);
    }
    emb_table_destroy(a);

    emb_table_config cs = eu_config(EMB_OPT_SGD, 4);
    cs.lr = 1;
    emb_table *s = eu_create(&cs);
    for (int i = 0; i < 4; i++)
        g[i] = 3e38f;
    eu_push(s, &key, 1, g);
    eu_push(s, &key, 1, g);
    eu_pull(s, &key, 1, w);
    CHECK(isinf(w[0]));
    path_in(dir, sizeof dir, g_dir, "inf-weight");
    rc = emb_table_snapshot(s, dir, &err);
    CHECK_MSG(rc != CM_OK && eu_has(err, "key 77") && eu_has(err, "not finite") &&
                  access(dir, F_OK) != 0,
              "snapshot of a table with an infinite weight: rc %d, %s", rc, err ? err : "");
    free(err);
    emb_table_destroy(s);
}

static int writer_add_cb(const emb_row *row, void *arg)
{
    char *err = NULL;
    int rc = emb_snapshot_writer_add(arg, row, &err);
    CHECK_OK(rc, err);
    return rc;
}

static int same_file(const char *a, const char *b, const char *name)
{
    char pa[4400], pb[4400];
    void *x = NULL, *y = NULL;
    size_t lx = 0, ly = 0;
    path_in(pa, sizeof pa, a, name);
    path_in(pb, sizeof pb, b, name);
    int same = cm_read_file(pa, &x, &lx, NULL) == CM_OK &&
               cm_read_file(pb, &y, &ly, NULL) == CM_OK && lx == ly && memcmp(x, y, lx) == 0;
    free(x);
    free(y);
    return same;
}

/* A snapshot writer handed a table's rows in the order its snapshot holds them (the order of
 * emb_table_foreach) writes the table's snapshot byte for byte: rows.bin, MANIFEST and the
 * admission sketch, with a buffer of a few rows (many appends) and of a chunk. A row that is not
 * finite is refused naming its key, and an aborted writer leaves nothing. */
static void writer_case(emb_table *t, const char *name)
{
    char ref[4200], out[4300];
    char *err = NULL;
    path_in(ref, sizeof ref, g_dir, name);
    CHECK_OK(emb_table_snapshot(t, ref, &err), err);
    uint16_t *sketch = NULL;
    size_t n = 0;
    CHECK_OK(emb_snapshot_sketch_add(ref, &sketch, &n, &err), err);
    const emb_table_config *cfg = emb_table_get_config(t);
    static const size_t bufs[2] = {100, EMB_SNAPSHOT_CHUNK};
    for (int b = 0; b < 2; b++) {
        emb_snapshot_writer *w = NULL;
        snprintf(out, sizeof out, "%s.written%d", ref, b);
        CHECK_OK(
            emb_snapshot_writer_open(out, cfg, emb_table_step(t), sketch, n, bufs[b], &w, &err),
            err);
        CHECK_OK(emb_table_foreach(t, writer_add_cb, w, &err), err);
        CHECK_OK(emb_snapshot_writer_commit(w, &err), err);
        CHECK_MSG(same_file(ref, out, "rows.bin") && same_file(ref, out, "MANIFEST"),
                  "%s: the writer's snapshot (buffer %zu) differs from the table's", name, bufs[b]);
        CHECK_MSG(sketch == NULL || same_file(ref, out, "sketch.bin"),
                  "%s: the writer's sketch.bin differs", name);
    }
    /* refused rows, and an abort */
    emb_snapshot_writer *w = NULL;
    snprintf(out, sizeof out, "%s.aborted", ref);
    CHECK_OK(emb_snapshot_writer_open(out, cfg, emb_table_step(t), NULL, 0, 0, &w, &err), err);
    float *v = eu_xcalloc(cfg->dim + emb_row_slots(cfg), sizeof *v);
    v[0] = NAN;
    emb_row bad = {77, 0, 0, v, v + cfg->dim};
    int rc = emb_snapshot_writer_add(w, &bad, &err);
    CHECK_MSG(rc == CM_EINVAL && eu_has(err, "77") && eu_has(err, "finite"),
              "a NaN weight: rc=%d err=%s", rc, err ? err : "(none)");
    free(err);
    err = NULL;
    emb_snapshot_writer_abort(w);
    DIR *d = opendir(g_dir);
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL)
        CHECK_MSG(strstr(e->d_name, ".aborted") == NULL, "an aborted writer left %s", e->d_name);
    if (d) closedir(d);
    free(v);
    free(sketch);
}

int main(void)
{
    g_dir = check_tmpdir("emb_snapshot");
    char spill0[4200], spill1[4200], snap[4200], p[4400];
    path_in(spill0, sizeof spill0, g_dir, "spill0");
    path_in(spill1, sizeof spill1, g_dir, "spill1");
    path_in(snap, sizeof snap, g_dir, "snap");

    emb_table_config model = eu_config(EMB_OPT_ADAM, DIM);
    model.seed = 11;
    model.l2 = 1e-3f;
    emb_table_config c = model;
    c.mem_budget_bytes = (uint64_t)(0.1 * N * emb_row_mem_bytes(&model));
    c.spill_path = spill0;
    emb_table *orig = eu_create(&c);
    uint64_t *keys = eu_xmalloc(N * sizeof *keys);
    float *w = eu_xmalloc((size_t)N * DIM * sizeof *w);
    for (uint32_t i = 0; i < N; i++) keys[i] = eu_key(i);
    eu_pull(orig, keys, N, w);
    train(&orig, 1, 20, 1);
    CHECK_MSG(eu_stats(orig).rows_spilled > 0, "nothing spilled before the snapshot");

    char *err = NULL;
    CHECK_OK(emb_table_snapshot(orig, snap, &err), err);
    path_in(p, sizeof p, snap, "rows.bin");
    CHECK(access(p, R_OK) == 0);
    path_in(p, sizeof p, snap, "MANIFEST");
    CHECK(access(p, R_OK) == 0);

    emb_table_config read_back;
    memset(&read_back, 0xff, sizeof read_back);
    CHECK_OK(emb_snapshot_read_config(snap, &read_back, &err), err);
    check_same_model(&read_back, &model, "read_config");
    CHECK(read_back.spill_path == NULL && read_back.mem_budget_bytes == 0);

    /* restore fully in memory, and into half the budget with other storage settings */
    emb_table *a = restore_ok(snap, &model);
    emb_table_config small = model;
    small.mem_budget_bytes = c.mem_budget_bytes / 2;
    small.spill_path = spill1;
    small.n_sub = 4;
    emb_table *b = restore_ok(snap, &small);
    emb_table *all[3] = {orig, a, b};
    for (int i = 1; i < 3; i++) {
        CHECK_MSG(eu_diff_tables(orig, all[i], 1) == 0, "restore %d: rows differ", i);
        CHECK_MSG(eu_diff_tables(all[i], orig, 1) == 0, "restore %d: rows differ (reverse)", i);
        CHECK(emb_table_step(all[i]) == emb_table_step(orig));
        check_same_model(emb_table_get_config(all[i]), &model, "restored table");
    }
    emb_table_stats sb = eu_stats(b);
    CHECK_MSG(sb.bytes_mem <= small.mem_budget_bytes && sb.rows_spilled > 0,
              "restore into a smaller budget: %" PRIu64 " bytes, %" PRIu64 " spilled", sb.bytes_mem,
              sb.rows_spilled);
    CHECK(emb_table_get_config(b)->mem_budget_bytes == small.mem_budget_bytes);

    /* training goes on identically from the restored state */
    train(all, 3, 10, 2);
    for (int i = 1; i < 3; i++)
        CHECK_MSG(eu_diff_tables(orig, all[i], 1) == 0, "restore %d diverges when training", i);

    /* a second snapshot into the same directory replaces the first */
    CHECK_OK(emb_table_snapshot(orig, snap, &err), err);
    emb_table_destroy(a);
    a = restore_ok(snap, &model);
    CHECK_MSG(eu_diff_tables(orig, a, 1) == 0 && emb_table_step(a) == emb_table_step(orig),
              "replaced snapshot does not hold the new state");
    emb_table_destroy(a);
    emb_table_destroy(b);

    /* corruption of any kind is refused, naming the file */
    static const double spots[] = {0.0, 0.5, 1.0};
    for (size_t i = 0; i < 3; i++) {
        corrupt_case(snap, &model, "rows.bin", FLIP, spots[i]);
        corrupt_case(snap, &model, "MANIFEST", FLIP, spots[i]);
    }
    corrupt_case(snap, &model, "rows.bin", TRUNCATE, 0.5);
    corrupt_case(snap, &model, "rows.bin", TRUNCATE, 1.0); /* one byte short */
    corrupt_case(snap, &model, "rows.bin", TRUNCATE, 0.0); /* empty */
    corrupt_case(snap, &model, "rows.bin", EXTEND, 0);
    corrupt_case(snap, &model, "MANIFEST", TRUNCATE, 0.5);
    corrupt_case(snap, &model, "MANIFEST", EXTEND, 0); /* a NUL byte after the checksum line */
    corrupt_case(snap, &model, "MANIFEST", APPEND, 0); /* a whole line after it */
    corrupt_case(snap, &model, "rows.bin", REMOVE, 0);
    corrupt_case(snap, &model, "MANIFEST", REMOVE, 0);

    diverged_case();
    lie_case(snap, &model, LIE_LATE_STAMP, "step");
    lie_case(snap, &model, LIE_NAN_WEIGHT, "finite");
    lie_case(snap, &model, LIE_NAN_STATE, "NaN");
    lie_case(snap, &model, LIE_DUP_KEY, "duplicate");
    lie_case(snap, &model, LIE_WRAP, "more than a file can hold");
    /* a key twice whose first copy the load had already spilled: the records 0 and N - 1 lie
     * in the first and last of the file's 1 MiB chunks, 1 and 5000 in the first, 9000 and
     * 12000 in the second */
    spilled_dup_case(snap, &model, 0, N - 1);
    spilled_dup_case(snap, &model, 1, 5000);
    spilled_dup_case(snap, &model, 9000, 12000);
    /* the last record of the first chunk, still in memory when the second chunk is checked,
     * then evicted while that chunk loads, before its second copy arrives */
    const uint64_t chunk_rows = (1u << 20) / emb_row_bytes(&model) + 1;
    spilled_dup_case(snap, &model, chunk_rows - 1, chunk_rows + 3000);
    manifest_lie_case(snap, &model, "eps", "0x0p+0", "eps");
    manifest_lie_case(snap, &model, "lr", "nan", "nan");

    mismatch_case(snap, &model, "dim", edit_dim);
    mismatch_case(snap, &model, "opt", edit_opt);
    mismatch_case(snap, &model, "lr", edit_lr);
    mismatch_case(snap, &model, "seed", edit_seed);
    mismatch_case(snap, &model, "beta", edit_beta1); /* the message says "betas" */

    /* no snapshot at all */
    emb_table *t = NULL;
    path_in(p, sizeof p, g_dir, "no_such_snapshot");
    int rc = emb_table_restore(p, &model, &t, &err);
    CHECK_MSG(rc < 0 && t == NULL && err != NULL, "restore of a missing dir: rc=%d", rc);
    free(err);
    err = NULL;

    /* a snapshot replaces only what a snapshot holds: an existing directory with anything else
     * in it (a mistyped path) and a regular file are refused and left as they were, where the
     * old tree used to be removed whole; an empty directory is fine */
    char other[4200], keep[4400];
    path_in(other, sizeof other, g_dir, "not_a_snapshot");
    path_in(keep, sizeof keep, other, "keep.txt");
    CHECK_OK(cm_mkdirs(other, &err), err);
    CHECK_OK(cm_write_file_atomic(keep, "mine\n", 5, &err), err);
    rc = emb_table_snapshot(orig, other, &err);
    CHECK_MSG(rc < 0 && eu_has(err, other) && eu_has(err, "keep.txt"),
              "snapshot into a directory of other files: rc=%d err=%s", rc, err ? err : "(none)");
    free(err);
    err = NULL;
    CHECK_MSG(access(keep, R_OK) == 0, "a refused snapshot removed %s", keep);
    rc = emb_table_snapshot(orig, keep, &err);
    CHECK_MSG(rc < 0 && eu_has(err, keep), "snapshot onto a regular file: rc=%d err=%s", rc,
              err ? err : "(none)");
    free(err);
    err = NULL;
    void *kept = NULL;
    size_t kept_len = 0;
    CHECK_OK(cm_read_file(keep, &kept, &kept_len, &err), err);
    CHECK(kept_len == 5 && kept != NULL && memcmp(kept, "mine\n", 5) == 0);
    free(kept);
    path_in(p, sizeof p, g_dir, "empty_dir");
    CHECK_OK(cm_mkdirs(p, &err), err);
    CHECK_OK(emb_table_snapshot(orig, p, &err), err);
    t = restore_ok(p, &model);
    CHECK(eu_diff_tables(orig, t, 1) == 0);
    emb_table_destroy(t);

    /* a snapshot path that is a symbolic link to a directory (a snapshot area on another disk)
     * is followed: the snapshot goes into the directory it names, built beside that directory,
     * and the link stays a link, also when a second snapshot replaces the first */
    char real[4200], link[4200], mf[4400];
    path_in(real, sizeof real, g_dir, "snap_real");
    path_in(link, sizeof link, g_dir, "snap_link");
    path_in(mf, sizeof mf, real, "MANIFEST");
    CHECK_OK(cm_mkdirs(real, &err), err);
    CHECK(symlink("snap_real", link) == 0);
    for (int round = 0; round < 2; round++) {
        CHECK_OK(emb_table_snapshot(orig, link, &err), err);
        struct stat lst;
        CHECK_MSG(lstat(link, &lst) == 0 && S_ISLNK(lst.st_mode),
                  "snapshot %d into a symbolic link replaced the link", round);
        CHECK_MSG(access(mf, R_OK) == 0, "snapshot %d did not land in the link's target", round);
        t = restore_ok(link, &model);
        CHECK(eu_diff_tables(orig, t, 1) == 0);
        emb_table_destroy(t);
    }

    /* a snapshot writer writes a table's snapshot: a spilled one, and one with admission */
    writer_case(orig, "by_writer");
    emb_table_config adm_cfg = model;
    adm_cfg.admit_threshold = 2;
    emb_table *adm = eu_create(&adm_cfg);
    eu_pull(adm, keys, 1000, w);
    eu_pull(adm, keys, 2000, w);
    writer_case(adm, "by_writer_admit");
    emb_table_destroy(adm);

    /* an empty table round-trips too */
    emb_table *empty = eu_create(&model);
    path_in(p, sizeof p, g_dir, "snap_empty");
    CHECK_OK(emb_table_snapshot(empty, p, &err), err);
    t = restore_ok(p, &model);
    CHECK(eu_count_rows(t) == 0 && emb_table_step(t) == 0);
    emb_table_destroy(t);
    emb_table_destroy(empty);

    emb_table_destroy(orig);
    free(keys);
    free(w);
    cm_rmtree(g_dir, NULL);
    return check_done();
}
