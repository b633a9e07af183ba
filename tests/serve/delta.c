/*
 * serve_delta: a base bundle plus deltas serves exactly what a full export of the newest
 * checkpoint serves.
 *   - deepfm (two tables: emb dim 16, lin dim 1) trained 40 steps with checkpoints every 10:
 *     `ember predict --bundle step-20 --delta (40 since 20)` writes the same bytes as
 *     `ember predict --bundle full step-40`, in fp32 and in int8; so does a chain
 *     step-10 + (20 since 10) + (30 since 20) + (40 since 30).
 *   - The C API: lookups of every key of the full export (and of the base's keys, and misses)
 *     on base + deltas equal lookups on the full bundle, value for value and found for found.
 *   - Refusals: a delta on the wrong base (or twice), a full bundle as a delta, a delta opened as
 *     a base, a delta of another model, a delta of another precision (fp32 on an int8 base), a
 *     delta of another run at the same steps (its base source differs); the handle keeps
 *     serving as before after a refusal.
 *   - Deletions (TTL-like), built with ember_serve_writer_*: keys a delta deletes read as zeros
 *     with found = 0; a later delta can bring them back; deleting an absent key is harmless.
 *   - A delta exported with a --memory the old checkpoint's key map does not fit in (spread
 *     over partition files) is the same bundle, byte for byte, and base + it serves the full
 *     export's rows; a --memory below the least that works is refused naming it.
 *   - ember_serve_predict refuses offsets that do not start at 0 or that go back.
 */
#include "serve_util.h"

static const char *tables[2] = {"emb", "lin"};

/* Lookups of keys on a and b agree exactly. */
static void same_lookups(const ember_serve *a, const ember_serve *b, const char *table,
                         const uint64_t *keys, size_t n, const char *what)
{
    int ta = ember_serve_table(a, table), tb = ember_serve_table(b, table);
    CHECK_MSG(ta >= 0 && tb >= 0, "%s: table %s missing", what, table);
    if (ta < 0 || tb < 0) return;
    uint32_t dim = ember_serve_table_dim(a, ta);
    CHECK(dim == ember_serve_table_dim(b, tb));
    float *oa = malloc(n * dim * sizeof(float) + 4), *ob = malloc(n * dim * sizeof(float) + 4);
    uint8_t *fa = malloc(n + 1), *fb = malloc(n + 1);
    memset(oa, 0x7f, n * dim * sizeof(float));
    memset(ob, 0x3c, n * dim * sizeof(float));
    /* uneven chunks so every batch size path runs */
    for (size_t i = 0, c = 1; i < n; i += c, c = c * 3 + 1 > 5000 ? 1 : c * 3 + 1) {
        size_t k = n - i < c ? n - i : c;
        CHECK(ember_serve_lookup(a, ta, keys + i, k, oa + i * dim, fa + i) == 0);
        CHECK(ember_serve_lookup(b, tb, keys + i, k, ob + i * dim, fb + i) == 0);
    }
    size_t bad_f = 0, bad_v = 0, zeros_ok = 0, found = 0;
    for (size_t i = 0; i < n; i++) {
        bad_f += fa[i] != fb[i];
        bad_v += memcmp(oa + i * dim, ob + i * dim, dim * sizeof(float)) != 0;
        found += fa[i];
        if (!fa[i]) {
            int z = 1;
            for (uint32_t j = 0; j < dim; j++) z &= oa[i * dim + j] == 0.0f;
            zeros_ok += z;
        }
    }
    fprintf(stderr, "    %s %s: %zu keys, %zu found, %zu found-flags differ, %zu rows differ\n", what,
            table, n, found, bad_f, bad_v);
    CHECK_MSG(bad_f == 0 && bad_v == 0, "%s table %s: %zu found flags, %zu rows differ", what,
              table, bad_f, bad_v);
    CHECK_MSG(zeros_ok == n - found, "%s table %s: absent keys not zero", what, table);
    free(oa);
    free(ob);
    free(fa);
    free(fb);
}

/* Every key of full's and base's table files plus misses, compared on h vs full. */
static void compare_all_keys(const ember_serve *h, const ember_serve *full, const char *full_dir,
                             const char *base_dir, const char *what)
{
    for (int t = 0; t < 2; t++) {
        uint64_t *kf = NULL, *kb = NULL, nf = 0, nb = 0;
        su_table_keys(full_dir, tables[t], &kf, &nf, NULL, NULL);
        su_table_keys(base_dir, tables[t], &kb, &nb, NULL, NULL);
        size_t n = nf + nb + 1000;
        uint64_t *keys = malloc(n * sizeof *keys);
        if (nf) memcpy(keys, kf, nf * 8);
        if (nb) memcpy(keys + nf, kb, nb * 8);
        uint64_t x = 12345;
        for (size_t i = nf + nb; i < n; i++) keys[i] = (x = x * 6364136223846793005ull + 1442695040888963407ull);
        keys[nf + nb] = 0;
        keys[nf + nb + 1] = UINT64_MAX;
        CHECK_MSG(nf > 1000, "%s: full table %s has %llu keys", what, tables[t], (unsigned long long)nf);
        same_lookups(h, full, tables[t], keys, n, what);
        /* every key of the full export is found */
        int ti = ember_serve_table(h, tables[t]);
        uint32_t dim = ti >= 0 ? ember_serve_table_dim(h, ti) : 1;
        float *o = malloc(nf * dim * sizeof(float) + 4);
        uint8_t *f = malloc(nf + 1);
        size_t nfound = 0;
        if (ti >= 0 && ember_serve_lookup(h, ti, kf, nf, o, f) == 0)
            for (uint64_t i = 0; i < nf; i++) nfound += f[i];
        CHECK_MSG(nfound == nf, "%s %s: %zu of %llu keys of the full export found", what, tables[t],
                  nfound, (unsigned long long)nf);
        free(o);
        free(f);
        free(keys);
        free(kf);
        free(kb);
    }
}

static int same_file(const char *a, const char *b)
{
    size_t la = 0, lb = 0;
    char *x = su_slurp(su_path(a), &la), *y = su_slurp(su_path(b), &lb);
    int same = x && y && la == lb && la > 0 && memcmp(x, y, la) == 0;
    free(x);
    free(y);
    return same;
}

static void expect_refused(int rc, char **errp, const char *what, const char *needle)
{
    char *err = *errp; /* read after the call that set it */
    *errp = NULL;
    CHECK_MSG(rc != 0, "%s was accepted", what);
    CHECK_MSG(rc == 0 || (err && (!needle || strstr(err, needle))), "%s: message '%s' lacks '%s'",
              what, err ? err : "(none)", needle ? needle : "");
    if (rc != 0) fprintf(stderr, "    refused as expected (%s): %s\n", what, err ? err : "(none)");
    free(err);
}

/* ---- deletions through the writer API ---- */

static float val(uint64_t key, int version, uint32_t j)
{
    return (float)(key % 1000) * 0.25f + (float)version + (float)j * 0.5f;
}

/* Writes a bundle of `keys` (values of version) and `del` deleted keys to both tables (lin gets
 * only the first n_del_lin deletions). */
static int write_bundle(const char *dir, int delta, uint64_t step, uint64_t base_step,
                        const char *model, const float *tower, uint64_t n_tower,
                        const uint64_t *keys, size_t n, int version, const uint64_t *del,
                        size_t n_del, size_t n_del_lin)
{
    ember_serve_writer *w = NULL;
    char *err = NULL;
    int rc = ember_serve_writer_create(dir, EMBER_SERVE_FP32, delta, step, base_step, &w, &err);
    if (rc == 0) rc = ember_serve_writer_model(w, model, &err);
    if (rc == 0) rc = ember_serve_writer_dense(w, tower, n_tower, &err);
    for (int t = 0; rc == 0 && t < 2; t++) {
        uint32_t dim = t == 0 ? 16 : 1;
        float *rows = malloc(n * dim * sizeof(float) + 4);
        for (size_t i = 0; i < n; i++)
            for (uint32_t j = 0; j < dim; j++) rows[i * dim + j] = val(keys[i], version, j) + (float)t;
        rc = ember_serve_writer_table(w, tables[t], dim, keys, rows, n, del,
                                      t == 0 ? n_del : n_del_lin, &err);
        free(rows);
    }
    if (rc == 0) {
        rc = ember_serve_writer_commit(w, &err);
        w = NULL;
    }
    ember_serve_writer_abort(w);
    CHECK_MSG(rc == 0, "writing %s: %s", dir, err ? err : "?");
    free(err);
    return rc;
}

static void deletions(const char *model, const float *tower, uint64_t n_tower)
{
    fprintf(stderr, "--- deletions through the writer API\n");
    /* base (step 100): keys 1..2000, version 0 */
    uint64_t base_keys[2000];
    for (int i = 0; i < 2000; i++) base_keys[i] = (uint64_t)i + 1;
    /* delta 1 (step 101): keys 1..100 changed (version 1), 3001..3100 new; deletes 500..699 from
     * emb (500..599 from lin) and 9999 (never present) */
    uint64_t d1_keys[200], d1_del[201];
    for (int i = 0; i < 100; i++) d1_keys[i] = (uint64_t)i + 1, d1_keys[100 + i] = 3001 + (uint64_t)i;
    for (int i = 0; i < 100; i++) d1_del[i] = 500 + (uint64_t)i; /* lin deletes these... */
    d1_del[100] = 9999;                                            /* ...and this one */
    for (int i = 0; i < 100; i++) d1_del[101 + i] = 600 + (uint64_t)i;
    /* delta 2 (step 102): 600..609 come back (version 2); 1..10 deleted */
    uint64_t d2_keys[10], d2_del[10];
    for (int i = 0; i < 10; i++) d2_keys[i] = 600 + (uint64_t)i, d2_del[i] = 1 + (uint64_t)i;

    int rc = write_bundle(su_path("w-base"), 0, 100, 0, model, tower, n_tower, base_keys, 2000, 0,
                          NULL, 0, 0);
    if (rc == 0) rc = write_bundle(su_path("w-d1"), 1, 101, 100, model, tower, n_tower, d1_keys, 200,
                                   1, d1_del, 201, 101);
    if (rc == 0) rc = write_bundle(su_path("w-d2"), 1, 102, 101, model, tower, n_tower, d2_keys, 10,
                                   2, d2_del, 10, 10);
    if (rc != 0) return;
    const char *deltas[] = {su_path("w-d1"), su_path("w-d2"), NULL};
    ember_serve *h = su_open(su_path("w-base"), deltas);
    if (h == NULL) return;
    CHECK(ember_serve_step(h) == 102);
    CHECK(ember_serve_table_rows(h, ember_serve_table(h, "emb")) == 2000);
    size_t n = 3200 + 2;
    uint64_t *keys = malloc(n * 8);
    for (size_t i = 0; i < 3200; i++) keys[i] = i + 1;
    keys[3200] = 9999;
    keys[3201] = 0;
    for (int t = 0; t < 2; t++) {
        int ti = ember_serve_table(h, tables[t]);
        uint32_t dim = t == 0 ? 16 : 1;
        CHECK(ti >= 0 && ember_serve_table_dim(h, ti) == dim);
        if (ti < 0) continue;
        float *o = malloc(n * dim * sizeof(float));
        uint8_t *f = malloc(n);
        memset(o, 0xff, n * dim * sizeof(float)); /* NaNs: absent rows must be written as zeros */
        memset(f, 7, n);
        CHECK(ember_serve_lookup(h, ti, keys, n, o, f) == 0);
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) {
            uint64_t k = keys[i];
            int version = -1; /* -1: absent */
            if (k >= 1 && k <= 10) version = -1;                       /* deleted by d2 */
            else if (k >= 11 && k <= 100) version = 1;                 /* changed by d1 */
            else if (k >= 500 && k <= 599) version = -1;               /* deleted by d1 */
            else if (k >= 600 && k <= 609) version = t == 0 ? 2 : 2;   /* back in d2 */
            else if (k >= 610 && k <= 699) version = t == 0 ? -1 : 0;  /* emb-only deletion */
            else if (k >= 1 && k <= 2000) version = 0;
            else if (k >= 3001 && k <= 3100) version = 1;
            int ok = f[i] == (version >= 0);
            for (uint32_t j = 0; ok && j < dim; j++)
                ok = o[i * dim + j] == (version >= 0 ? val(k, version, j) + (float)t : 0.0f);
            if (!ok && bad++ < 5)
                fprintf(stderr, "    table %s key %llu: found %d value %g, expected version %d\n",
                        tables[t], (unsigned long long)k, f[i], (double)o[i * dim], version);
        }
        CHECK_MSG(bad == 0, "table %s: %zu keys read wrong after deletions", tables[t], bad);
        free(o);
        free(f);
    }
    /* base alone and base + d1: the deletions of d1 only */
    ember_serve *h1 = su_open(su_path("w-base"), (const char *[]){su_path("w-d1"), NULL});
    if (h1) {
        uint64_t k[4] = {5, 550, 650, 3050};
        float o[4 * 16];
        uint8_t f[4];
        CHECK(ember_serve_lookup(h1, ember_serve_table(h1, "emb"), k, 4, o, f) == 0);
        CHECK(f[0] == 1 && o[0] == val(5, 1, 0) && f[1] == 0 && o[16] == 0 && f[2] == 0 &&
              f[3] == 1 && o[48] == val(3050, 1, 0));
    }
    ember_serve_close(h1);
    /* predict runs over deleted keys (they read as zeros) */
    uint32_t offs[27];
    uint64_t pk[26];
    float dense[13] = {0}, p = -1;
    for (int i = 0; i < 26; i++) offs[i] = (uint32_t)i, pk[i] = 500 + (uint64_t)i;
    offs[26] = 26;
    ember_serve_batch b = {1, 13, 26, dense, offs, pk, NULL};
    char *err = NULL;
    rc = ember_serve_predict(h, &b, &p, &err);
    CHECK_MSG(rc == 0 && p >= 0 && p <= 1, "predict over deleted keys: rc %d p %g %s", rc, (double)p,
              err ? err : "");
    free(err);
    /* Offsets that do not start at 0 or that go back are the caller's mistake, refused: taken as
     * given they name key ranges outside the batch's keys. */
    {
        uint32_t bad[2][27];
        for (int v = 0; v < 2; v++)
            memcpy(bad[v], offs, sizeof offs);
        bad[0][0] = 3;  /* does not start at 0 */
        bad[1][6] = 40; /* row 0 field 5 ends past field 6's end: goes back after it */
        for (int v = 0; v < 2; v++) {
            ember_serve_batch bb = {1, 13, 26, dense, bad[v], pk, NULL};
            err = NULL;
            float q = -1;
            rc = ember_serve_predict(h, &bb, &q, &err);
            CHECK_MSG(rc == CM_EINVAL && err && strstr(err, "offsets"),
                      "predict with bad offsets (%d): rc %d, %s", v, rc, err ? err : "(none)");
            free(err);
        }
    }
    /* wrong bases */
    ember_serve *hb = su_open(su_path("w-base"), NULL);
    if (hb) {
        err = NULL;
        expect_refused(ember_serve_apply_delta(hb, su_path("w-d2"), &err), &err,
                       "delta of step 101 on base step 100", "w-d2");
        err = NULL;
        CHECK_OK(ember_serve_apply_delta(hb, su_path("w-d1"), &err), err);
    }
    ember_serve_close(hb);
    free(keys);
    ember_serve_close(h);
}

static float *read_tower(const char *bundle, uint64_t *n)
{
    char path[8400];
    snprintf(path, sizeof path, "%s/dense-tower.bin", bundle);
    size_t len = 0;
    char *f = su_slurp(path, &len);
    *n = 0;
    if (f == NULL || len < 32) {
        free(f);
        return NULL;
    }
    memcpy(n, f + 16, 8);
    CHECK(len == 24 + *n * 4 + 8);
    float *t = malloc(*n * 4 + 4);
    memcpy(t, f + 24, *n * 4);
    free(f);
    return t;
}

/* The deleted-key count in a bundle's table header (tab_hdr.deleted, ember_serve.h), or 0. */
static uint64_t table_deleted(const char *bundle, const char *table)
{
    char path[8400];
    snprintf(path, sizeof path, "%s/table-%s.bin", bundle, table);
    size_t len = 0;
    char *f = su_slurp(path, &len);
    uint64_t n = 0;
    if (f != NULL && len >= 64) memcpy(&n, f + 40, 8);
    free(f);
    return n;
}

int main(void)
{
    if (su_init("serve_delta") != 0) return check_done();
    if (su_make_data(40000, 11) != 0) return check_done();
    /* --ttl: rows expire between the checkpoints, so the deltas delete keys too */
    int rc = su_ember("train --train shards/train --eval shards/eval --model deepfm --out run "
                      "--no-progress --max-steps 40 --checkpoint-every 10 --batch 512 --device cpu "
                      "--ttl 8");
    CHECK_MSG(rc == 0, "train: exit %d", rc);
    if (rc != 0) return check_done();

    /* exports */
    const char *precs[2] = {"fp32", "int8"};
    for (int k = 0; k < 2; k++) {
        const char *p = precs[k];
        rc = su_ember("export --checkpoint run/ckpt/step-20 --out base20-%s --precision %s", p, p);
        CHECK(rc == 0);
        rc = su_ember("export --checkpoint run/ckpt/step-40 --since run/ckpt/step-20 --out d40-%s "
                      "--precision %s", p, p);
        CHECK(rc == 0);
        rc = su_ember("export --checkpoint run --out full40-%s --precision %s", p, p);
        CHECK(rc == 0);
        rc = su_ember("predict --bundle base20-%s --delta d40-%s --data shards/eval --out pd-%s.txt",
                      p, p, p);
        CHECK(rc == 0);
        rc = su_ember("predict --bundle full40-%s --data shards/eval --out pf-%s.txt", p, p);
        CHECK(rc == 0);
        rc = su_ember("predict --bundle base20-%s --data shards/eval --out pb-%s.txt", p, p);
        CHECK(rc == 0);
        char a[64], b[64], c[64];
        snprintf(a, sizeof a, "pd-%s.txt", p);
        snprintf(b, sizeof b, "pf-%s.txt", p);
        snprintf(c, sizeof c, "pb-%s.txt", p);
        CHECK_MSG(same_file(a, b), "%s: base + delta predictions differ from the full export's", p);
        CHECK_MSG(!same_file(c, b), "%s: step-20 predicts what step-40 does (delta untested)", p);
    }
    char *mf = su_slurp(su_path("d40-fp32/MANIFEST"), NULL);
    CHECK_MSG(mf && strstr(mf, "\ntype delta\n") && strstr(mf, "\nstep 40\n") &&
                  strstr(mf, "\nbase_step 20\n"), "delta MANIFEST: %s", mf ? mf : "(missing)");
    free(mf);

    /* the delta in a --memory old's key map does not fit: the same bytes, the same rows */
    rc = su_ember("export --checkpoint run/ckpt/step-40 --since run/ckpt/step-20 --out d40-parts "
                  "--memory 150K");
    CHECK_MSG(rc == 0, "delta export in 150K: exit %d", rc);
    rc = rc == 0 ? su_shell(60, "diff -r d40-fp32 d40-parts") : rc;
    CHECK_MSG(rc == 0, "the delta differs when exported in 150K");
    /* ... deleted keys included: merged from the partitions' runs, ascending */
    const uint64_t dels = table_deleted(su_path("d40-parts"), "emb");
    CHECK_MSG(dels > 0, "the delta in 150K deletes no key of table emb (its merge untested)");
    {
        ember_serve *hf = su_open(su_path("full40-fp32"), NULL);
        ember_serve *hd =
            su_open(su_path("base20-fp32"), (const char *[]){su_path("d40-parts"), NULL});
        CHECK(hf && hd);
        if (hf && hd)
            compare_all_keys(hd, hf, su_path("full40-fp32"), su_path("base20-fp32"), "150K");
        ember_serve_close(hf);
        ember_serve_close(hd);
    }
    rc = su_ember("export --checkpoint run/ckpt/step-40 --since run/ckpt/step-20 --out d40-small "
                  "--memory 100K");
    char *small = su_slurp(su_path("err.txt"), NULL);
    CHECK_MSG(rc != 0 && small && strstr(small, "too small for a delta") &&
                  strstr(small, "it needs at least"),
              "a delta in 100K: exit %d, %s", rc, small ? small : "");
    free(small);

    /* a chain of three deltas */
    rc = su_ember("export --checkpoint run/ckpt/step-10 --out base10");
    for (int s = 20; rc == 0 && s <= 40; s += 10)
        rc = su_ember("export --checkpoint run/ckpt/step-%d --since run/ckpt/step-%d --out c%d", s,
                      s - 10, s);
    CHECK_MSG(rc == 0, "chain exports: exit %d", rc);
    rc = su_ember("predict --bundle base10 --delta c20 --delta c30 --delta c40 --data shards/eval "
                  "--out pc.txt");
    CHECK(rc == 0);
    CHECK_MSG(same_file("pc.txt", "pf-fp32.txt"), "chained deltas predict differently");

    /* the C API */
    fprintf(stderr, "--- C API lookups\n");
    for (int k = 0; k < 2; k++) {
        char full[64], base[64], d40[64];
        snprintf(full, sizeof full, "full40-%s", precs[k]);
        snprintf(base, sizeof base, "base20-%s", precs[k]);
        snprintf(d40, sizeof d40, "d40-%s", precs[k]);
        ember_serve *hf = su_open(su_path(full), NULL);
        ember_serve *hd = su_open(su_path(base), (const char *[]){su_path(d40), NULL});
        if (hf && hd) {
            CHECK(ember_serve_step(hd) == 40 && ember_serve_step(hf) == 40);
            compare_all_keys(hd, hf, su_path(full), su_path(base), precs[k]);
        }
        if (hd && k == 0) {
            char *err = NULL;
            expect_refused(ember_serve_apply_delta(hd, su_path(d40), &err), &err,
                           "the same delta twice", "d40-fp32");
            err = NULL;
            expect_refused(ember_serve_apply_delta(hd, su_path("full40-fp32"), &err), &err,
                           "a full bundle as a delta", "full40-fp32");
            compare_all_keys(hd, hf, su_path(full), su_path(base), "after refusals");
        }
        if (hf && k == 0) {
            char *err = NULL;
            expect_refused(ember_serve_apply_delta(hf, su_path(d40), &err), &err,
                           "delta since 20 on step 40", "d40-fp32");
        }
        ember_serve_close(hf);
        ember_serve_close(hd);
    }
    {
        ember_serve *h = NULL;
        char *err = NULL;
        expect_refused(ember_serve_open(su_path("d40-fp32"), &h, &err), &err, "opening a delta",
                       "d40-fp32");
        CHECK(h == NULL);
        /* a delta on step 10 (wrong base) and a chain with a gap */
        ember_serve *h10 = su_open(su_path("base10"), NULL);
        if (h10) {
            err = NULL;
            expect_refused(ember_serve_apply_delta(h10, su_path("d40-fp32"), &err), &err,
                           "delta since 20 on step 10", "d40-fp32");
            err = NULL;
            expect_refused(ember_serve_apply_delta(h10, su_path("c30"), &err), &err,
                           "delta since 20 on step 10 (chain gap)", "c30");
            CHECK(ember_serve_step(h10) == 10);
        }
        ember_serve_close(h10);
        /* A delta of another precision (an int8 base, the delta exported without --precision
         * int8) served its rows as fp32 beside the base's int8 rows: what no full export
         * serves. */
        ember_serve *h8 = su_open(su_path("base20-int8"), NULL);
        if (h8) {
            err = NULL;
            expect_refused(ember_serve_apply_delta(h8, su_path("d40-fp32"), &err), &err,
                           "an fp32 delta on an int8 base", "d40-fp32");
            CHECK_MSG(ember_serve_step(h8) == 20, "an fp32 delta on an int8 base: step %llu",
                      (unsigned long long)ember_serve_step(h8));
        }
        ember_serve_close(h8);
    }

    /* a delta of another model (same steps) is refused */
    ember_serve *hf = su_open(su_path("full40-fp32"), NULL);
    if (hf) {
        uint64_t n_tower = 0;
        float *tower = read_tower(su_path("full40-fp32"), &n_tower);
        const char *model = ember_serve_model(hf);
        CHECK(tower != NULL && n_tower > 0);
        if (tower) {
            char *other = malloc(strlen(model) + 32);
            snprintf(other, strlen(model) + 32, "%s\n", model); /* differs by a newline */
            uint64_t key = 1;
            float row[16] = {0};
            ember_serve_writer *w = NULL;
            char *err = NULL;
            int r2 = ember_serve_writer_create(su_path("other-d"), EMBER_SERVE_FP32, 1, 50, 40, &w, &err);
            if (r2 == 0) r2 = ember_serve_writer_model(w, other, &err);
            if (r2 == 0) r2 = ember_serve_writer_dense(w, tower, n_tower, &err);
            if (r2 == 0) r2 = ember_serve_writer_table(w, "emb", 16, &key, row, 1, NULL, 0, &err);
            if (r2 == 0) r2 = ember_serve_writer_table(w, "lin", 1, &key, row, 1, NULL, 0, &err);
            if (r2 == 0) {
                r2 = ember_serve_writer_commit(w, &err);
                w = NULL;
            }
            ember_serve_writer_abort(w);
            CHECK_OK(r2, err);
            err = NULL;
            expect_refused(ember_serve_apply_delta(hf, su_path("other-d"), &err), &err,
                           "a delta of another model", "other-d");
            free(other);
            deletions(model, tower, n_tower);
        }
        free(tower);
    }
    ember_serve_close(hf);

    /* A delta of another run (same model text, same steps, other batches): taken against
     * other content, it is refused on this run's step-20 base; and its own base takes it. */
    rc = su_ember("train --train shards/train --eval shards/eval --model deepfm --out run2 "
                  "--no-progress --max-steps 40 --checkpoint-every 20 --batch 256 --device cpu");
    if (rc == 0)
        rc =
            su_ember("export --checkpoint run2/ckpt/step-40 --since run2/ckpt/step-20 --out r2d40");
    if (rc == 0) rc = su_ember("export --checkpoint run2/ckpt/step-20 --out r2base20");
    CHECK_MSG(rc == 0, "the second run and its exports: exit %d", rc);
    ember_serve *h20 = su_open(su_path("base20-fp32"), NULL);
    if (rc == 0 && h20) {
        char *err = NULL;
        expect_refused(ember_serve_apply_delta(h20, su_path("r2d40"), &err), &err,
                       "another run's delta", "taken against checkpoint content");
        CHECK(ember_serve_step(h20) == 20);
        ember_serve *h2 = su_open(su_path("r2base20"), (const char *[]){su_path("r2d40"), NULL});
        CHECK_MSG(h2 && ember_serve_step(h2) == 40, "the second run's delta on its own base");
        ember_serve_close(h2);
    }
    ember_serve_close(h20);
    return check_done();
}
