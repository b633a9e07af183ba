/* The generator library: determinism, row format, marginals, the planted model's strength,
 * and gen_write (thread-count invariance, prefix property, truth file). */
#include <stdint.h>

#include "check.h"
#include "common/common.h"
#include "src/gen.h"
#include "src/metrics.h"

#define NROWS 200000

static gen_model *make_model(uint64_t seed)
{
    gen_model *m = NULL;
    char *err = NULL;
    CHECK_OK(gen_model_create(seed, &m, &err), err);
    if (m == NULL) exit(check_done() ? 1 : 1);
    return m;
}

/* Checks one formatted row field by field; returns 1 when well-formed. */
static int row_well_formed(const char *line, size_t len)
{
    if (len < 2 || line[len - 1] != '\n') return 0;
    if (line[0] != '0' && line[0] != '1') return 0;
    int field = 0;
    const char *p = line, *end = line + len - 1;
    while (p <= end) {
        const char *q = p;
        while (q < end && *q != '\t') q++;
        size_t n = (size_t)(q - p);
        if (field >= 1 && field <= GEN_NUM_INT && n > 0) {
            const char *d = p;
            if (*d == '-') {
                if (n != 2 || d[1] != '1') return 0; /* only -1 is negative */
            } else {
                for (size_t i = 0; i < n; i++)
                    if (d[i] < '0' || d[i] > '9') return 0;
            }
        }
        if (field > GEN_NUM_INT && n > 0) {
            if (n != 8) return 0;
            for (size_t i = 0; i < 8; i++)
                if (!((p[i] >= '0' && p[i] <= '9') || (p[i] >= 'a' && p[i] <= 'f'))) return 0;
        }
        field++;
        p = q + 1;
    }
    return field == GEN_NUM_FIELDS;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void test_determinism(void)
{
    gen_model *a = make_model(7), *b = make_model(7), *c = make_model(8);
    CHECK(gen_model_bias(a) == gen_model_bias(b));
    char la[GEN_ROW_MAX], lb[GEN_ROW_MAX], lc[GEN_ROW_MAX];
    int same_ab = 1, diff_ac = 0, formed = 1;
    gen_row ra, rb, rc;
    for (uint64_t i = 0; i < 5000; i++) {
        gen_make_row(a, i, &ra);
        gen_make_row(b, i, &rb);
        gen_make_row(c, i, &rc);
        size_t na = gen_format_row(&ra, la), nb = gen_format_row(&rb, lb),
               nc = gen_format_row(&rc, lc);
        same_ab &= na == nb && memcmp(la, lb, na) == 0 && ra.prob == rb.prob;
        diff_ac += na != nc || memcmp(la, lc, na) != 0;
        formed &= row_well_formed(la, na) && na <= GEN_ROW_MAX;
    }
    CHECK(same_ab);
    CHECK_MSG(diff_ac > 4900, "only %d of 5000 rows differ across seeds", diff_ac);
    CHECK(formed);
    /* Rows are independent of the order they are asked for. */
    gen_make_row(a, 4242, &ra);
    gen_make_row(b, 17, &rb);
    gen_make_row(b, 4242, &rb);
    size_t n1 = gen_format_row(&ra, la), n2 = gen_format_row(&rb, lb);
    CHECK(n1 == n2 && memcmp(la, lb, n1) == 0 && ra.prob == rb.prob);
    gen_model_free(a);
    gen_model_free(b);
    gen_model_free(c);
}

static void test_prob_format(void)
{
    char buf[GEN_PROB_MAX];
    CHECK(gen_format_prob(0.0f, buf) == 9 && memcmp(buf, "0.000000\n", 9) == 0);
    CHECK(gen_format_prob(0.5f, buf) == 9 && memcmp(buf, "0.500000\n", 9) == 0);
    CHECK(gen_format_prob(0.0123456f, buf) == 9 && memcmp(buf, "0.012346\n", 9) == 0);
    CHECK(gen_format_prob(0.9999996f, buf) == 9 && memcmp(buf, "1.000000\n", 9) == 0);
    CHECK(gen_format_prob(1.0f, buf) == 9 && memcmp(buf, "1.000000\n", 9) == 0);
}

/* Marginals and the strength of the planted model over NROWS rows. */
static void test_statistics(void)
{
    gen_model *m = make_model(1);
    float *p = malloc(NROWS * sizeof *p), *y = malloc(NROWS * sizeof *y);
    float *p_nopair = malloc(NROWS * sizeof *p_nopair), *p_pair = malloc(NROWS * sizeof *p);
    uint64_t *tok = malloc(NROWS * sizeof *tok);
    int64_t miss_i12 = 0, miss_c22 = 0, miss_c19 = 0, c19_c25_together = 0, neg_i2 = 0;
    uint64_t clicks = 0, big_ids = 0, bad_ids = 0;
    gen_row r;
    for (size_t i = 0; i < NROWS; i++) {
        gen_make_row(m, i, &r);
        p[i] = r.prob;
        y[i] = r.label;
        clicks += r.label;
        double l = gen_model_bias(m) + r.logit_first + r.logit_dense;
        p_nopair[i] = (float)(1 / (1 + exp(-l)));
        p_pair[i] = r.logit_pair;
        miss_i12 += !r.int_present[11];
        neg_i2 += r.int_present[1] && r.ints[1] == -1;
        miss_c22 += !r.cat_present[21];
        miss_c19 += !r.cat_present[18];
        c19_c25_together += r.cat_present[18] == r.cat_present[24];
        for (int f = 0; f < GEN_NUM_CAT; f++)
            bad_ids += r.cat_present[f] && r.cat_id[f] >= gen_cat_cardinality(f);
        big_ids += r.cat_present[2] && r.cat_id[2] >= 1000000;
        /* (token, id) of C3 packed to check that tokens never collide across ids */
        tok[i] = r.cat_present[2] ? ((uint64_t)r.cat_token[2] << 32) | r.cat_id[2] : 0;
    }
    CHECK(bad_ids == 0);
    double ctr = (double)clicks / NROWS;
    CHECK_MSG(ctr > 0.20 && ctr < 0.25, "ctr=%f", ctr);
    CHECK_MSG(fabs((double)miss_i12 / NROWS - 0.76) < 0.01, "I12 missing %f", (double)miss_i12 / NROWS);
    CHECK_MSG(fabs((double)miss_c22 / NROWS - 0.76) < 0.01, "C22 missing %f", (double)miss_c22 / NROWS);
    CHECK_MSG(fabs((double)miss_c19 / NROWS - 0.44) < 0.01, "C19 missing %f", (double)miss_c19 / NROWS);
    CHECK(c19_c25_together == NROWS); /* one missing group, like Criteo's */
    CHECK_MSG(fabs((double)neg_i2 / NROWS - 0.11) < 0.01, "I2 -1 rate %f", (double)neg_i2 / NROWS);
    CHECK_MSG(big_ids > 1000, "C3 ids >= 1M drawn %llu times: tail not sampled?",
              (unsigned long long)big_ids);

    qsort(tok, NROWS, sizeof *tok, cmp_u64);
    int collide = 0;
    for (size_t i = 1; i < NROWS; i++)
        collide += tok[i] != tok[i - 1] && (tok[i] >> 32) == (tok[i - 1] >> 32);
    CHECK_MSG(collide == 0, "%d C3 token collisions", collide);

    char *err = NULL;
    double auc = 0, auc_nopair = 0, auc_pair = 0, ll = 0;
    CHECK_OK(metrics_auc(p, y, NROWS, &auc, &err), err);
    CHECK_OK(metrics_auc(p_nopair, y, NROWS, &auc_nopair, &err), err);
    CHECK_OK(metrics_auc(p_pair, y, NROWS, &auc_pair, &err), err);
    CHECK_OK(metrics_logloss(p, y, NROWS, &ll, &err), err);
    fprintf(stderr, "truth auc %.4f (without pairs %.4f, pairs alone %.4f) logloss %.4f ctr %.4f\n",
            auc, auc_nopair, auc_pair, ll, ctr);
    CHECK_MSG(auc > 0.75 && auc < 0.85, "truth auc %f", auc);
    /* Interactions carry a real share of the signal: dropping them costs > 0.03 AUC, and they
     * alone rank clearly better than chance. */
    CHECK_MSG(auc - auc_nopair > 0.03, "pairs add only %f", auc - auc_nopair);
    CHECK_MSG(auc_pair > 0.60, "pairs alone %f", auc_pair);
    free(p);
    free(y);
    free(p_nopair);
    free(p_pair);
    free(tok);
    gen_model_free(m);
}

static char *slurp(const char *path, size_t *len)
{
    void *buf = NULL;
    char *err = NULL;
    int rc = cm_read_file(path, &buf, len, &err);
    CHECK_OK(rc, err);
    return buf;
}

static void test_write(void)
{
    const char *dir = check_tmpdir("gen_write");
    char a[4200], b[4200], ta[4200], tb[4200], c[4200];
    snprintf(a, sizeof a, "%s/a.tsv", dir);
    snprintf(b, sizeof b, "%s/b.tsv", dir);
    snprintf(c, sizeof c, "%s/c.tsv", dir);
    snprintf(ta, sizeof ta, "%s/a.truth", dir);
    snprintf(tb, sizeof tb, "%s/b.truth", dir);
    gen_model *m = make_model(3);
    char *err = NULL;
    gen_stats st;
    /* 20000 rows: several chunks, the last one partial. */
    gen_opts o1 = {.rows = 20000, .threads = 1, .out_path = a, .truth_path = ta};
    gen_opts o3 = {.rows = 20000, .threads = 3, .out_path = b, .truth_path = tb};
    gen_opts op = {.rows = 12345, .threads = 2, .out_path = c, .truth_path = NULL};
    CHECK_OK(gen_write(m, &o1, &st, &err), err);
    uint64_t bytes1 = st.bytes, clicks1 = st.clicks;
    CHECK_OK(gen_write(m, &o3, &st, &err), err);
    CHECK(st.bytes == bytes1 && st.clicks == clicks1);
    CHECK_OK(gen_write(m, &op, &st, &err), err);
    size_t na, nb, nta, ntb, nc;
    char *da = slurp(a, &na), *db = slurp(b, &nb), *dta = slurp(ta, &nta), *dtb = slurp(tb, &ntb),
         *dc = slurp(c, &nc);
    CHECK(da && db && na == nb && na == bytes1 && memcmp(da, db, na) == 0);
    CHECK(dta && dtb && nta == ntb && memcmp(dta, dtb, nta) == 0);
    CHECK(nta == 20000u * 9); /* "0.dddddd\n" a row */
    CHECK(dc && nc < na && memcmp(dc, da, nc) == 0); /* fewer rows: a prefix */
    size_t lines = 0, ones = 0;
    for (size_t i = 0; i < na; i++) lines += da[i] == '\n';
    for (size_t i = 0, bol = 1; i < na; i++) {
        if (bol) ones += da[i] == '1';
        bol = da[i] == '\n';
    }
    CHECK(lines == 20000);
    CHECK(ones == clicks1);
    /* No temporaries left behind. */
    char cmd[8600];
    snprintf(cmd, sizeof cmd, "test -z \"$(ls '%s' | grep tmp)\"", dir);
    CHECK(system(cmd) == 0);
    /* An unwritable target fails with CM_EIO naming the path, leaving nothing. */
    char bad[4300];
    snprintf(bad, sizeof bad, "%s/no/such/dir/x.tsv", dir);
    gen_opts ob = {.rows = 10, .threads = 1, .out_path = bad};
    CHECK(gen_write(m, &ob, NULL, &err) == CM_EIO && err && strstr(err, bad));
    free(err);
    err = NULL;
    gen_opts oz = {.rows = 0, .threads = 4, .out_path = c};
    CHECK_OK(gen_write(m, &oz, &st, &err), err);
    free(dc);
    dc = slurp(c, &nc);
    CHECK(nc == 0);
    free(da);
    free(db);
    free(dta);
    free(dtb);
    free(dc);
    gen_model_free(m);
}

int main(void)
{
    test_prob_format();
    test_determinism();
    test_statistics();
    test_write();
    return check_done();
}
