/*
 * emb_badinput: every malformed request returns an error code with a message (never a crash,
 * never a half-built object): bad configs, unknown optimizer names and store kinds, budgets
 * that cannot hold a row, unusable spill paths, and non-finite gradients (which must leave every
 * row untouched).
 */
#include <fcntl.h>

#include "emb_util.h"

static const char *g_dir;

/* Expects create to fail with code want, a message naming what (if given), and no table. The
 * error pointer starts out holding a stale message: the library must free it (LSan checks). */
static void create_fails(const emb_table_config *c, int want, const char *what, const char *label)
{
    emb_table *t = NULL;
    char *err = strdup("stale message");
    int rc = emb_table_create(c, &t, &err);
    CHECK_MSG(rc == want && t == NULL && err != NULL && strcmp(err, "stale message") != 0 &&
                  (what == NULL || eu_has(err, what)),
              "%s: create rc=%d (want %d) err=%s", label, rc, want, err ? err : "(none)");
    if (t != NULL) emb_table_destroy(t);
    free(err);
    if (want == CM_EINVAL) {
        err = NULL;
        rc = emb_table_config_check(c, &err);
        CHECK_MSG(rc == CM_EINVAL && (what == NULL || eu_has(err, what)),
                  "%s: config_check rc=%d err=%s", label, rc, err ? err : "(none)");
        free(err);
    }
}

static void test_configs(void)
{
    emb_table_config c = eu_config(EMB_OPT_ADAGRAD, 16);
    char *err = NULL;
    CHECK_OK(emb_table_config_check(&c, &err), err);

    c.dim = 0;
    create_fails(&c, CM_EINVAL, "dim", "dim 0");
    c.dim = EMB_MAX_DIM + 1;
    create_fails(&c, CM_EINVAL, "dim", "dim > max");
    c.dim = EMB_MAX_DIM; /* the largest dim works end to end */
    c.opt = EMB_OPT_ADAM;
    emb_table *t = eu_create(&c);
    uint64_t k = 5;
    float *w = eu_xmalloc(EMB_MAX_DIM * sizeof *w), *g = eu_xcalloc(EMB_MAX_DIM, sizeof *g);
    eu_pull(t, &k, 1, w);
    eu_push(t, &k, 1, g);
    eu_row *row = eu_xmalloc(sizeof *row);
    CHECK(eu_get(t, k, row) && row->updates == 1);
    emb_table_destroy(t);
    free(w);
    free(g);
    free(row);

    c = eu_config(EMB_OPT_ADAGRAD, 16);
    c.opt = (emb_opt_kind)17;
    create_fails(&c, CM_EINVAL, "opt", "optimizer out of range");
    c = eu_config(EMB_OPT_ADAGRAD, 16);
    c.n_sub = 4097;
    create_fails(&c, CM_EINVAL, "n_sub", "n_sub 4097");

    emb_opt_kind o = EMB_OPT_SGD;
    CHECK(emb_opt_parse("adamw", &o) == CM_EINVAL && o == EMB_OPT_SGD);
    CHECK(emb_opt_parse("", &o) == CM_EINVAL);
    CHECK(emb_opt_parse("adagrad_rowwise_", &o) == CM_EINVAL);

    /* budgets */
    char spill[4200];
    snprintf(spill, sizeof spill, "%s/spill", g_dir);
    c = eu_config(EMB_OPT_ADAGRAD, 16);
    c.mem_budget_bytes = 1 << 20;
    create_fails(&c, CM_EINVAL, "spill_path", "budget without spill_path");
    c.spill_path = spill;
    c.mem_budget_bytes = 1;
    create_fails(&c, CM_EINVAL, "budget", "budget of 1 byte");
    c.mem_budget_bytes = emb_row_bytes(&c); /* one row for 64 sub-shards */
    create_fails(&c, CM_EINVAL, "budget", "budget of one row");
    c.n_sub = 1;
    c.mem_budget_bytes = 64 * emb_row_bytes(&c);
    t = eu_create(&c); /* a small but sufficient budget is fine */
    emb_table_destroy(t);

    /* unusable spill paths: below a regular file, inside /proc */
    char file[4200], below[4300];
    snprintf(file, sizeof file, "%s/plainfile", g_dir);
    int fd = open(file, O_CREAT | O_WRONLY, 0644);
    CHECK(fd >= 0);
    if (fd >= 0) close(fd);
    snprintf(below, sizeof below, "%s/spill", file);
    c = eu_config(EMB_OPT_ADAGRAD, 16);
    c.mem_budget_bytes = 1 << 20;
    c.spill_path = below;
    create_fails(&c, CM_EIO, NULL, "spill under a file");
    c.spill_path = "/proc/x/spill";
    create_fails(&c, CM_EIO, NULL, "spill under /proc");
}

static void test_stores(void)
{
    emb_store *s = NULL;
    char *err = NULL;
    int rc = emb_store_create("redis", NULL, 32, &s, &err);
    CHECK_MSG(rc < 0 && s == NULL && err != NULL, "unknown store kind: rc=%d", rc);
    free(err);
    err = NULL;
    rc = emb_store_create("memory", NULL, 4, &s, &err);
    CHECK_MSG(rc == CM_EINVAL && s == NULL && err != NULL, "record_bytes 4: rc=%d", rc);
    free(err);
    err = NULL;
    rc = emb_store_create("rocksdb", "/proc/x/db", 32, &s, &err);
    CHECK_MSG(rc < 0 && s == NULL && err != NULL, "rocksdb under /proc: rc=%d", rc);
    free(err);
}

/* A push carrying one non-finite value is rejected whole: no row changes, nothing created. */
static void test_nonfinite(void)
{
    enum { D = 4 };
    emb_table_config c = eu_config(EMB_OPT_ADAGRAD, D);
    emb_table *t = eu_create(&c);
    const uint64_t keys[3] = {eu_key(1), eu_key(2), eu_key(3)};
    float w[3 * D], g[3 * D];
    eu_pull(t, keys, 2, w);
    eu_row before[2], after;
    for (int i = 0; i < 2; i++) eu_get(t, keys[i], &before[i]);
    const float bad_values[] = {NAN, INFINITY, -INFINITY};
    for (size_t b = 0; b < 3; b++) {
        for (size_t i = 0; i < 3 * D; i++) g[i] = 0.5f;
        g[D + 2] = bad_values[b]; /* the second key's gradient; the first is fine */
        char *err = NULL;
        int rc = emb_table_push(t, keys, 3, g, &err);
        CHECK_MSG(rc == CM_EINVAL && err != NULL, "non-finite gradient %zu: rc=%d", b, rc);
        free(err);
        for (int i = 0; i < 2; i++) {
            eu_get(t, keys[i], &after);
            CHECK_MSG(after.updates == before[i].updates &&
                          memcmp(after.w, before[i].w, D * sizeof(float)) == 0 &&
                          memcmp(after.s, before[i].s, D * sizeof(float)) == 0,
                      "rejected push changed row %d", i);
        }
    }
    emb_table_stats s = eu_stats(t);
    CHECK(s.pushes == 0 && s.rows_mem == 2);
    /* empty batches are fine */
    eu_pull(t, NULL, 0, NULL);
    eu_push(t, NULL, 0, NULL);
    emb_table_destroy(t);
    emb_table_destroy(NULL);
}

static void test_misc(void)
{
    emb_table_config c = eu_config(EMB_OPT_SGD, 4);
    emb_table *t = eu_create(&c);
    eu_row row;
    CHECK(!eu_get(t, 12345, &row)); /* CM_ENOTFOUND, no message (checked in eu_get) */
    CHECK(eu_count_rows(t) == 0);   /* get_row created nothing */
    emb_table_destroy(t);
    emb_table_config back;
    char *err = NULL, p[4300];
    snprintf(p, sizeof p, "%s/none", g_dir);
    int rc = emb_snapshot_read_config(p, &back, &err);
    CHECK_MSG(rc < 0 && err != NULL, "read_config of a missing snapshot: rc=%d", rc);
    free(err);
}

int main(void)
{
    g_dir = check_tmpdir("emb_badinput");
    test_configs();
    test_stores();
    test_nonfinite();
    test_misc();
    cm_rmtree(g_dir, NULL);
    return check_done();
}
