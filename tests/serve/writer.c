/*
 * serve_writer: the bundle writer (ember_serve_writer_*) on its own, without training: what it
 * accepts opens and serves what it was given, and what a bundle cannot hold is refused by the
 * writer with a message naming the table, never written as a bundle that ember_serve_open then
 * refuses (or serves wrongly).
 *   - a table dim past what the reader takes (65536);
 *   - values the precision cannot hold (fp16 past 65504, int8 NaN / inf / FLT_MAX), beside the
 *     edge values it can (the largest half, a row of zeros, a subnormal or a 3e38 maximum);
 *   - a ninth table (a bundle maps at most 8), and one table name written twice;
 *   - a bundle without model.txt, dense tower or table, or with the model or tower twice;
 *   - a delta that does not go forward (step <= base_step): refused by the writer and, edited
 *     into a bundle, by ember_serve_apply_delta;
 *   - a table of 100,000 rows written in the least index memory its index takes (its keys in
 *     sorted runs on disk) is the same file as in the default budget and serves every row; a
 *     budget below that is refused naming the table and the least.
 *   - a delta's deleted keys given in pieces (ember_serve_writer_table_deleted, then _end's)
 *     make the same bundle as given at once to _end; keys going back across pieces, and rows
 *     after deleted keys, are refused.
 * Every bundle is a logistic regression ("kind lr", one "lin" table of dim 1, a tower of
 * dense + 1 values), so each case writes a few KB and runs in milliseconds.
 */
#include <float.h>
#include <math.h>

#include "serve_util.h"

static const char *model = "kind lr\nfields 2\ndense 1\ndim 1\n";
static const float tower[2] = {0.5f, -0.25f};

/* Writes dir at prec with the lin table plus, when extra_dim, a table "x" of extra_dim holding
 * n_extra rows (keys 1..n_extra) of extra, its index in mem bytes. The writer's code; its
 * message in *err. */
static int write_lr_mem(const char *dir, ember_serve_precision prec, uint32_t extra_dim,
                        const float *extra, uint64_t n_extra, uint64_t mem, char **err)
{
    const uint64_t n_keys = n_extra > 2 ? n_extra : 2;
    uint64_t *keys = malloc(n_keys * sizeof *keys);
    for (uint64_t i = 0; keys && i < n_keys; i++)
        keys[i] = i + 1;
    const float lin[2] = {1.0f, 2.0f};
    ember_serve_writer *w = NULL;
    int rc = keys ? ember_serve_writer_create(dir, prec, 0, 7, 0, &w, err) : -1;
    if (rc == 0) ember_serve_writer_memory(w, mem);
    if (rc == 0) rc = ember_serve_writer_model(w, model, err);
    if (rc == 0) rc = ember_serve_writer_dense(w, tower, 2, err);
    if (rc == 0) rc = ember_serve_writer_table(w, "lin", 1, keys, lin, 2, NULL, 0, err);
    if (rc == 0 && extra_dim)
        rc = ember_serve_writer_table(w, "x", extra_dim, keys, extra, n_extra, NULL, 0, err);
    if (rc == 0) {
        rc = ember_serve_writer_commit(w, err);
        w = NULL;
    }
    ember_serve_writer_abort(w);
    free(keys);
    return rc;
}

static int write_lr(const char *dir, ember_serve_precision prec, uint32_t extra_dim,
                    const float *extra, uint64_t n_extra, char **err)
{
    return write_lr_mem(dir, prec, extra_dim, extra, n_extra, EMBER_SERVE_INDEX_MEMORY_DEFAULT,
                        err);
}

/* What the writer refused (rc < 0; rc >= 0 is accepted): its message names needle, and no
 * bundle (nor its temp) is left. */
static void expect_writer_refused(const char *what, const char *dir, int rc, char *err,
                                  const char *needle)
{
    CHECK_MSG(rc < 0, "%s: the writer accepted it", what);
    CHECK_MSG(rc >= 0 || (err && strstr(err, needle)), "%s: message '%s' does not name '%s'", what,
              err ? err : "(none)", needle);
    char tmp[8400];
    snprintf(tmp, sizeof tmp, "ls -d '%s'.tmp* >/dev/null 2>&1", dir);
    CHECK_MSG(access(dir, F_OK) != 0 && system(tmp) != 0, "%s: %s or its temp left behind", what,
              dir);
    if (rc < 0) fprintf(stderr, "    refused as expected (%s): %s\n", what, err ? err : "(none)");
    if (rc >= 0) {
        /* what the reader says of the bundle the writer should not have written */
        ember_serve *h = NULL;
        char *e2 = NULL;
        int r2 = ember_serve_open(dir, &h, &e2);
        fprintf(stderr, "    %s: written; ember_serve_open: %s\n", what, r2 ? e2 : "opened");
        ember_serve_close(h);
        free(e2);
    }
    free(err);
}

static void dim_too_large(void)
{
    fprintf(stderr, "--- a table dim the reader does not take\n");
    const uint32_t dim = 65537;
    float *row = calloc(dim, sizeof(float));
    for (int p = 0; p < 3; p++) {
        char name[64], what[96];
        snprintf(name, sizeof name, "dim-%d", p);
        snprintf(what, sizeof what, "dim %u at precision %d", dim, p);
        char *err = NULL;
        int rc = write_lr(su_path(name), (ember_serve_precision)p, dim, row, 1, &err);
        expect_writer_refused(what, su_path(name), rc, err, "table x");
    }
    free(row);
}

/* Writes one row of table x at prec; 0 when the writer took it and the bundle serves it back
 * within tol (relative to the row's largest magnitude), 1 (reported) when it was written but
 * serves something else, or the writer's (negative) code with its message in *err. */
static int round_trip(const char *name, ember_serve_precision prec, const float *row, uint32_t dim,
                      float tol, char **err)
{
    int rc = write_lr(su_path(name), prec, dim, row, 1, err);
    if (rc != 0) return rc;
    ember_serve *h = su_open(su_path(name), NULL);
    int t = h ? ember_serve_table(h, "x") : -1;
    const uint64_t key = 1;
    float out[16];
    uint8_t found = 0;
    rc =
        t >= 0 && dim <= 16 && ember_serve_lookup(h, t, &key, 1, out, &found) == 0 && found ? 0 : 1;
    float amax = 0;
    for (uint32_t j = 0; j < dim; j++)
        amax = fabsf(row[j]) > amax ? fabsf(row[j]) : amax;
    for (uint32_t j = 0; rc == 0 && j < dim; j++)
        if (!(fabsf(out[j] - row[j]) <= tol * amax)) { /* a NaN or an inf fails too */
            fprintf(stderr, "    %s: value %u is %g, written %g\n", name, j, (double)out[j],
                    (double)row[j]);
            rc = 1;
        }
    ember_serve_close(h);
    return rc;
}

/* Values a precision cannot hold are refused, naming the table and key, not served changed:
 * fp16 past 65504 (rounds to inf); int8 with a NaN (quantized to -127, served as -max) or an
 * inf (scale inf, the whole row served as NaN), or a max so large the scale * 127 overflows. */
static void unrepresentable(void)
{
    fprintf(stderr, "--- values a precision cannot hold\n");
    const float big = 70000.0f, inf = INFINITY, nan = NAN, huge = FLT_MAX;
    const struct {
        ember_serve_precision prec;
        float v;
        int ok;
        float tol;
        const char *what;
    } cases[] = {
        {EMBER_SERVE_FP16, 65504.0f, 1, 0.0f, "fp16 65504 (the largest half)"},
        {EMBER_SERVE_FP16, -65519.0f, 1, 1e-3f, "fp16 -65519 (rounds to -65504)"},
        {EMBER_SERVE_FP16, big, 0, 0, "fp16 70000"},
        {EMBER_SERVE_FP16, -big, 0, 0, "fp16 -70000"},
        {EMBER_SERVE_INT8, 0.0f, 1, 0.0f, "int8 a row of zeros"},
        {EMBER_SERVE_INT8, 3e38f, 1, 0.01f, "int8 3e38"},
        {EMBER_SERVE_INT8, 1e-40f, 1, 0.01f, "int8 a subnormal max"},
        {EMBER_SERVE_INT8, huge, 0, 0, "int8 FLT_MAX"},
        {EMBER_SERVE_INT8, inf, 0, 0, "int8 inf"},
        {EMBER_SERVE_INT8, nan, 0, 0, "int8 NaN"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        /* the value beside ordinary ones (zeros when the case is the zero row) */
        float row[4] = {0.5f, cases[i].v, -0.25f, 0.125f};
        if (cases[i].v == 0.0f) row[0] = row[2] = row[3] = 0.0f;
        if (cases[i].v == 1e-40f) row[0] = row[2] = row[3] = 1e-41f;
        char name[32];
        snprintf(name, sizeof name, "val-%zu", i);
        char *err = NULL;
        int rc = round_trip(name, cases[i].prec, row, 4, cases[i].tol, &err);
        if (cases[i].ok) {
            CHECK_MSG(rc == 0, "%s: %s", cases[i].what, rc > 0 || !err ? "served changed" : err);
            free(err);
        } else {
            expect_writer_refused(cases[i].what, su_path(name), rc, err, "table x key 1");
        }
    }
}

/* Writes dir (fp32) with one 1-row table of dim 1 per name, in order. The writer's code; its
 * message in *err. */
static int write_named(const char *dir, const char *const *names, int n, char **err)
{
    const uint64_t key = 1;
    const float one = 1.0f;
    ember_serve_writer *w = NULL;
    int rc = ember_serve_writer_create(dir, EMBER_SERVE_FP32, 0, 7, 0, &w, err);
    if (rc == 0) rc = ember_serve_writer_model(w, model, err);
    if (rc == 0) rc = ember_serve_writer_dense(w, tower, 2, err);
    for (int i = 0; rc == 0 && i < n; i++)
        rc = ember_serve_writer_table(w, names[i], 1, &key, &one, 1, NULL, 0, err);
    if (rc == 0) {
        rc = ember_serve_writer_commit(w, err);
        w = NULL;
    }
    ember_serve_writer_abort(w);
    return rc;
}

/* A bundle holds at most 8 tables (what ember_serve_open maps): the writer refuses a ninth,
 * naming it, rather than commit a bundle the reader refuses as a whole. */
static void too_many_tables(void)
{
    fprintf(stderr, "--- more tables than a bundle holds\n");
    const char *names[9] = {"lin", "t0", "t1", "t2", "t3", "t4", "t5", "t6", "t7"};
    char *err = NULL;
    int rc = write_named(su_path("tables-9"), names, 9, &err);
    expect_writer_refused("a ninth table", su_path("tables-9"), rc, err, "table t7");
}

/* A table written twice under one name would be listed twice, which the reader refuses. */
static void same_table_twice(void)
{
    fprintf(stderr, "--- one table name twice\n");
    const char *names[2] = {"lin", "lin"};
    char *err = NULL;
    int rc = write_named(su_path("lin-twice"), names, 2, &err);
    expect_writer_refused("table lin twice", su_path("lin-twice"), rc, err, "table lin");
}

/* A bundle holds model.txt, the dense tower and a table, each file once (ember_serve_open
 * refuses it otherwise): a bundle written for lookups alone, without the tower, or with the
 * model written twice, was committed and then refused by the reader as a whole. The writer
 * refuses it, naming what is wrong, and leaves nothing. */
static void incomplete(void)
{
    fprintf(stderr, "--- bundles lacking a part, or with one written twice\n");
    const uint64_t key = 1;
    const float one = 1.0f;
    for (int c = 0; c < 5; c++) {
        static const char *const what[5] = {"no model", "no dense tower", "no table",
                                            "the model twice", "the dense tower twice"};
        static const char *const needle[5] = {"model.txt", "dense-tower.bin", "table", "model.txt",
                                              "dense-tower.bin"};
        char name[32];
        snprintf(name, sizeof name, "part-%d", c);
        ember_serve_writer *w = NULL;
        char *err = NULL;
        int rc = ember_serve_writer_create(su_path(name), EMBER_SERVE_FP32, 0, 7, 0, &w, &err);
        for (int k = 0; rc == 0 && k < 1 + (c == 3); k++)
            if (c != 0) rc = ember_serve_writer_model(w, model, &err);
        for (int k = 0; rc == 0 && k < 1 + (c == 4); k++)
            if (c != 1) rc = ember_serve_writer_dense(w, tower, 2, &err);
        if (rc == 0 && c != 2)
            rc = ember_serve_writer_table(w, "lin", 1, &key, &one, 1, NULL, 0, &err);
        if (rc == 0) {
            rc = ember_serve_writer_commit(w, &err);
            w = NULL;
        }
        ember_serve_writer_abort(w);
        expect_writer_refused(what[c], su_path(name), rc, err, needle[c]);
    }
}

/* Rewrites dir's table-NAME.bin with step in its header (valid trailer) and its MANIFEST with
 * "step STEP" and the files' new digests, re-signed: a delta that claims another step. */
static void restep(const char *dir, const char *const *tables, int n, uint64_t from, uint64_t to)
{
    char path[8400];
    snprintf(path, sizeof path, "%s/MANIFEST", dir);
    char *m = su_slurp(path, NULL);
    CHECK(m != NULL);
    if (m == NULL) return;
    for (int i = 0; i < n; i++) {
        char tp[8400];
        snprintf(tp, sizeof tp, "%s/table-%s.bin", dir, tables[i]);
        size_t len = 0;
        char *b = su_slurp(tp, &len);
        CHECK(b != NULL && len > 72);
        if (b == NULL) continue;
        memcpy(b + 48, &to, 8); /* tab_hdr.step */
        uint64_t d = cm_xxh3(b, len - 8);
        memcpy(b + len - 8, &d, 8);
        FILE *f = fopen(tp, "wb");
        CHECK(f && fwrite(b, 1, len, f) == len && fclose(f) == 0);
        /* "file table-NAME.bin SIZE DIGEST\n": the digest is the 16 hex digits before '\n' */
        char line[128];
        snprintf(line, sizeof line, "file table-%s.bin ", tables[i]);
        char *l = strstr(m, line), *nl = l ? strchr(l, '\n') : NULL;
        CHECK(nl != NULL);
        char hex[17];
        snprintf(hex, sizeof hex, "%016llx", (unsigned long long)cm_xxh3(b, len));
        if (nl) memcpy(nl - 16, hex, 16);
        free(b);
    }
    char was[64], now[64];
    snprintf(was, sizeof was, "\nstep %llu\n", (unsigned long long)from);
    snprintf(now, sizeof now, "\nstep %llu\n", (unsigned long long)to);
    char *at = strstr(m, was);
    CHECK(at != NULL && strlen(was) == strlen(now));
    if (at) memcpy(at, now, strlen(now));
    char *cl = strstr(m, "checksum ");
    sprintf(cl, "checksum %016llx\n", (unsigned long long)cm_xxh3(m, (size_t)(cl - m)));
    FILE *f = fopen(path, "wb");
    CHECK(f && fputs(m, f) >= 0 && fclose(f) == 0);
    free(m);
}

/* A delta goes forward: step > base_step. The writer refuses one that does not (`ember export
 * --checkpoint step-20 --since step-40` swapped, or --since the same checkpoint), and so does
 * apply_delta (a bundle edited, or from an older writer), so a handle never steps back. */
static void backward_delta(void)
{
    fprintf(stderr, "--- deltas that do not go forward\n");
    const uint64_t steps[2][2] = {{5, 7}, {7, 7}}; /* {step, base_step} */
    for (int i = 0; i < 2; i++) {
        ember_serve_writer *w = NULL;
        char *err = NULL, name[32], what[64];
        snprintf(name, sizeof name, "back-%d", i);
        snprintf(what, sizeof what, "a delta from step %llu to %llu",
                 (unsigned long long)steps[i][1], (unsigned long long)steps[i][0]);
        int rc = ember_serve_writer_create(su_path(name), EMBER_SERVE_FP32, 1, steps[i][0],
                                           steps[i][1], &w, &err);
        ember_serve_writer_abort(w);
        expect_writer_refused(what, su_path(name), rc, err, "step");
    }
    /* the reader: a good delta 7 -> 8, edited to claim step 6 */
    char *err = NULL;
    const uint64_t key = 1;
    const float v = 4.0f;
    ember_serve_writer *w = NULL;
    int rc = ember_serve_writer_create(su_path("d8"), EMBER_SERVE_FP32, 1, 8, 7, &w, &err);
    if (rc == 0) rc = ember_serve_writer_model(w, model, &err);
    if (rc == 0) rc = ember_serve_writer_dense(w, tower, 2, &err);
    if (rc == 0) rc = ember_serve_writer_table(w, "lin", 1, &key, &v, 1, NULL, 0, &err);
    if (rc == 0) {
        rc = ember_serve_writer_commit(w, &err);
        w = NULL;
    }
    ember_serve_writer_abort(w);
    CHECK_OK(rc, err);
    rc = write_lr(su_path("base7"), EMBER_SERVE_FP32, 0, NULL, 0, &err);
    CHECK_OK(rc, err);
    ember_serve *h = su_open(su_path("base7"), (const char *[]){su_path("d8"), NULL});
    CHECK(h != NULL && ember_serve_step(h) == 8);
    ember_serve_close(h);
    const char *lin[1] = {"lin"};
    restep(su_path("d8"), lin, 1, 8, 6);
    h = su_open(su_path("base7"), NULL);
    if (h) {
        rc = ember_serve_apply_delta(h, su_path("d8"), &err);
        CHECK_MSG(rc != 0, "a delta from step 7 to 6 was applied (step now %llu)",
                  (unsigned long long)ember_serve_step(h));
        CHECK_MSG(rc == 0 || (err && strstr(err, "d8")), "message '%s' does not name d8",
                  err ? err : "(none)");
        if (rc != 0) fprintf(stderr, "    refused as expected: %s\n", err ? err : "(none)");
        CHECK(ember_serve_step(h) == 7);
        free(err);
    }
    ember_serve_close(h);
}

/* The writer swaps a bundle in as a whole folder: over a folder of other files it is refused
 * and the files stay; over an earlier bundle it replaces it. */
static void foreign_folder(void)
{
    ember_serve_writer *w = NULL;
    char *err = NULL;
    int rc = su_shell(10, "mkdir -p mine");
    FILE *f = fopen(su_path("mine/notes"), "w");
    CHECK(rc == 0 && f != NULL);
    if (f) {
        fputs("keep\n", f);
        fclose(f);
    }
    rc = ember_serve_writer_create(su_path("mine"), EMBER_SERVE_FP32, 0, 10, 0, &w, &err);
    char *keep = su_slurp(su_path("mine/notes"), NULL);
    CHECK_MSG(rc != 0 && err && strstr(err, "not replacing it") && keep && !strcmp(keep, "keep\n"),
              "a bundle over a folder of other files: rc %d, %s", rc, err ? err : "(none)");
    free(keep);
    free(err);
    ember_serve_writer_abort(w);
    const float x[2] = {1.0f, 2.0f};
    err = NULL;
    CHECK_OK(write_lr(su_path("ok"), EMBER_SERVE_FP32, 2, x, 1, &err), err);
}

/* A bundle path with a trailing slash ("out/", as shell completion gives a folder) names the
 * folder: written fresh and over an earlier bundle, with nothing left inside it. */
static void trailing_slash(void)
{
    const float x[2] = {1.0f, 2.0f};
    for (int round = 0; round < 2; round++) {
        char *err = NULL;
        char dir[8400];
        snprintf(dir, sizeof dir, "%s/", su_path("slash"));
        int rc = write_lr(dir, EMBER_SERVE_FP32, 2, x, 1, &err);
        CHECK_MSG(rc == 0, "round %d: writing %s: %s", round, dir, err ? err : "?");
        free(err);
        ember_serve *h = rc == 0 ? su_open(su_path("slash"), NULL) : NULL;
        CHECK_MSG(h && ember_serve_table(h, "x") >= 0, "round %d: slash/ does not open", round);
        ember_serve_close(h);
        CHECK_MSG(access(su_path("slash/.tmp"), F_OK) != 0, "round %d: slash/.tmp left", round);
    }
}

/* Table x of 100,000 rows (key i + 1: i / 4) in the least index budget and the default. */
static void index_budget(void)
{
    const uint64_t n = 100000, least = cm_keyidx_least(cm_keyidx_slots(n));
    float *x = malloc(n * sizeof *x);
    for (uint64_t i = 0; x && i < n; i++)
        x[i] = (float)i / 4;
    char *err = NULL;
    CHECK_OK(write_lr(su_path("budget-all"), EMBER_SERVE_FP32, 1, x, n, &err), err);
    CHECK_OK(write_lr_mem(su_path("budget-least"), EMBER_SERVE_FP32, 1, x, n, least, &err), err);
    size_t la = 0, lb = 0;
    char *a = su_slurp(su_path("budget-all/table-x.bin"), &la);
    char *b = su_slurp(su_path("budget-least/table-x.bin"), &lb);
    CHECK_MSG(a && b && la == lb && !memcmp(a, b, la),
              "table x in %llu bytes is not the file written in the default budget",
              (unsigned long long)least);
    free(a);
    free(b);
    ember_serve *h = su_open(su_path("budget-least"), NULL);
    int t = h ? ember_serve_table(h, "x") : -1;
    CHECK(t >= 0);
    uint64_t bad = 0;
    for (uint64_t i = 0; t >= 0 && i < n + 10; i++) {
        const uint64_t key = i + 1;
        float v = -1;
        uint8_t found = 0;
        CHECK(ember_serve_lookup(h, t, &key, 1, &v, &found) == 0);
        bad += i < n ? !found || v != (float)i / 4 : found || v != 0;
    }
    CHECK_MSG(bad == 0, "%llu keys served wrong from the index built in runs",
              (unsigned long long)bad);
    ember_serve_close(h);
    char want[128];
    snprintf(want, sizeof want, "table x: a memory budget of %llu bytes is too small",
             (unsigned long long)(least - 1));
    int rc = write_lr_mem(su_path("budget-small"), EMBER_SERVE_FP32, 1, x, n, least - 1, &err);
    expect_writer_refused("an index budget below the least", su_path("budget-small"), rc, err,
                          want);
    free(x);
}

/* A delta of the lin table deleting keys 2, 5, 9, 12: in pieces (split) or at once. With bad,
 * a piece goes back (1 after 5) or (bad == 2) a row follows the deleted keys. The writer's code. */
static int write_deleted(const char *dir, int split, int bad, char **err)
{
    static const uint64_t del[4] = {2, 5, 9, 12}, back = 1, keys[2] = {1, 3};
    const float lin[2] = {1.0f, 2.0f};
    ember_serve_writer *w = NULL;
    int rc = ember_serve_writer_create(dir, EMBER_SERVE_FP32, 1, 9, 7, &w, err);
    if (rc == 0) rc = ember_serve_writer_model(w, model, err);
    if (rc == 0) rc = ember_serve_writer_dense(w, tower, 2, err);
    if (rc == 0) rc = ember_serve_writer_table_begin(w, "lin", 1, 3, err);
    if (rc == 0) rc = ember_serve_writer_table_rows(w, keys, lin, 2, err);
    if (rc == 0 && split) rc = ember_serve_writer_table_deleted(w, del, 2, err);
    if (rc == 0 && bad == 1) rc = ember_serve_writer_table_deleted(w, &back, 1, err);
    if (rc == 0 && bad == 2) rc = ember_serve_writer_table_rows(w, keys, lin, 1, err);
    if (rc == 0 && split) rc = ember_serve_writer_table_deleted(w, del + 2, 1, err);
    if (rc == 0) rc = ember_serve_writer_table_end(w, split ? del + 3 : del, split ? 1 : 4, err);
    if (rc == 0) {
        rc = ember_serve_writer_commit(w, err);
        w = NULL;
    }
    ember_serve_writer_abort(w);
    return rc;
}

static void deleted_in_pieces(void)
{
    char *err = NULL;
    int rc = write_deleted(su_path("del-once"), 0, 0, &err);
    CHECK_OK(rc, err);
    rc = write_deleted(su_path("del-split"), 1, 0, &err);
    CHECK_OK(rc, err);
    CHECK_MSG(su_shell(10, "diff -r del-once del-split") == 0,
              "deleted keys in pieces make another bundle");
    rc = write_deleted(su_path("del-back"), 1, 1, &err);
    expect_writer_refused("deleted keys going back", su_path("del-back"), rc, err, "not ascending");
    err = NULL;
    rc = write_deleted(su_path("del-rows"), 1, 2, &err);
    expect_writer_refused("rows after deleted keys", su_path("del-rows"), rc, err,
                          "rows after deleted keys");
}

int main(void)
{
    if (su_init("serve_writer") != 0) return check_done();
    {
        /* the base case opens and serves what was written */
        char *err = NULL;
        const float x[4] = {1.5f, -2.0f, 0.0f, 3.25f};
        int rc = write_lr(su_path("ok"), EMBER_SERVE_FP32, 2, x, 2, &err);
        CHECK_OK(rc, err);
        ember_serve *h = su_open(su_path("ok"), NULL);
        int t = h ? ember_serve_table(h, "x") : -1;
        CHECK(h != NULL && t >= 0);
        if (t >= 0) {
            const uint64_t keys[3] = {1, 2, 3};
            float out[6];
            uint8_t found[3];
            CHECK(ember_serve_lookup(h, t, keys, 3, out, found) == 0);
            CHECK(memcmp(out, x, sizeof x) == 0 && out[4] == 0 && out[5] == 0);
            CHECK(found[0] == 1 && found[1] == 1 && found[2] == 0);
        }
        ember_serve_close(h);
    }
    dim_too_large();
    unrepresentable();
    too_many_tables();
    same_table_twice();
    incomplete();
    backward_delta();
    foreign_folder();
    trailing_slash();
    index_budget();
    deleted_in_pieces();
    return check_done();
}
