/*
 * serve_writer: the bundle writer (ember_serve_writer_*) on its own, without training: what it
 * accepts opens and serves what it was given, and what a bundle cannot hold is refused by the
 * writer with a message naming the table, never written as a bundle that ember_serve_open then
 * refuses (or serves wrongly).
 *   - a table dim past what the reader takes (65536).
 * Every bundle is a logistic regression ("kind lr", one "lin" table of dim 1, a tower of
 * dense + 1 values), so each case writes a few KB and runs in milliseconds.
 */
#include "serve_util.h"

static const char *model = "kind lr\nfields 2\ndense 1\ndim 1\n";
static const float tower[2] = {0.5f, -0.25f};

/* Writes dir at prec with the lin table plus, when extra_dim, a table "x" of extra_dim holding
 * n_extra rows (keys 1..n_extra) of extra. The writer's code; its message in *err. */
static int write_lr(const char *dir, ember_serve_precision prec, uint32_t extra_dim,
                    const float *extra, uint64_t n_extra, char **err)
{
    uint64_t keys[64];
    for (uint64_t i = 0; i < 64; i++)
        keys[i] = i + 1;
    const float lin[2] = {1.0f, 2.0f};
    ember_serve_writer *w = NULL;
    int rc = ember_serve_writer_create(dir, prec, 0, 7, 0, &w, err);
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
    return rc;
}

/* What the writer refused: its message names needle, and no bundle (nor its temp) is left. */
static void expect_writer_refused(const char *what, const char *dir, int rc, char *err,
                                  const char *needle)
{
    CHECK_MSG(rc != 0, "%s: the writer accepted it", what);
    CHECK_MSG(rc == 0 || (err && strstr(err, needle)), "%s: message '%s' does not name '%s'", what,
              err ? err : "(none)", needle);
    char tmp[8400];
    snprintf(tmp, sizeof tmp, "%s.tmp", dir);
    CHECK_MSG(access(dir, F_OK) != 0 && access(tmp, F_OK) != 0, "%s: %s left behind", what, dir);
    if (rc != 0) fprintf(stderr, "    refused as expected (%s): %s\n", what, err ? err : "(none)");
    if (rc == 0) {
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
    return check_done();
}
