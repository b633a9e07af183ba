/* Every real sample ingests with its listed row count and no rejects, and every value read back
 * from the shards equals what a slow, obvious reference parse of the raw text gives. */
#include <time.h>
#include <xxhash.h>

#include "ds_test_util.h"

/* column roles for the reference parser */
enum { R_SKIP, R_LABEL, R_DENSE, R_CAT, R_HOUR };

typedef struct sample {
    const char *file;
    ds_format fmt;
    size_t rows;
    int header;
    char sep;
    int roles[48]; /* by column; ignored for libffm */
    int n_cols;
    int has_label;
} sample;

static void criteo_roles(sample *s, int id, int label)
{
    int c = 0;
    if (id) s->roles[c++] = R_SKIP;
    if (label) s->roles[c++] = R_LABEL;
    for (int i = 0; i < 13; i++) s->roles[c++] = R_DENSE;
    for (int i = 0; i < 26; i++) s->roles[c++] = R_CAT;
    s->n_cols = c;
    s->has_label = label;
}

static void avazu_roles(sample *s)
{
    int c = 0;
    s->roles[c++] = R_SKIP;
    s->roles[c++] = R_LABEL;
    s->roles[c++] = R_HOUR;
    for (int i = 0; i < 21; i++) s->roles[c++] = R_CAT;
    s->n_cols = c;
    s->has_label = 1;
}

/* Splits line at sep into at most max tokens (no quoting in the real samples). */
static int split(char *line, char sep, char **tok, int max)
{
    int n = 0;
    char *p = line;
    for (;;) {
        char *q = strchr(p, sep);
        if (n < max) tok[n] = p;
        n++;
        if (q == NULL) break;
        *q = '\0';
        p = q + 1;
    }
    return n;
}

static int weekday(const char *hh)
{
    struct tm tm = {0};
    tm.tm_year = 100 + (hh[0] - '0') * 10 + (hh[1] - '0');
    tm.tm_mon = (hh[2] - '0') * 10 + (hh[3] - '0') - 1;
    tm.tm_mday = (hh[4] - '0') * 10 + (hh[5] - '0');
    tm.tm_hour = 12;
    timegm(&tm);
    return tm.tm_wday;
}

/* Compares row r of got with the reference parse of line; returns mismatches. */
static int check_delimited(const sample *s, char *line, const rows_copy *got, size_t r)
{
    char *tok[64];
    int n = split(line, s->sep, tok, 64), bad = 0;
    float label = 0;
    uint32_t d = 0, f = 0;
    const uint32_t *o = got->offsets + r * got->n_fields;
    for (int c = 0; c < s->n_cols; c++) {
        const char *t = c < n ? tok[c] : "";
        size_t tl = strlen(t);
        switch (s->roles[c]) {
        case R_LABEL:
            label = (float)strtod(t, NULL);
            break;
        case R_DENSE: {
            float want = tl ? (float)strtod(t, NULL) : 0.0f;
            bad += got->dense[r * got->n_dense + d++] != want;
            break;
        }
        case R_CAT:
            if (tl == 0) {
                bad += o[f + 1] != o[f];
            } else {
                bad += o[f + 1] - o[f] != 1 || got->keys[o[f]] != XXH3_64bits_withSeed(t, tl, f);
            }
            f++;
            break;
        case R_HOUR: {
            char wd = (char)('0' + weekday(t));
            bad += o[f + 1] - o[f] != 1 || got->keys[o[f]] != XXH3_64bits_withSeed(t + 6, 2, f);
            bad += o[f + 2] - o[f + 1] != 1 || got->keys[o[f + 1]] != XXH3_64bits_withSeed(&wd, 1, f + 1);
            f += 2;
            break;
        }
        }
    }
    bad += got->labels[r] != label;
    bad += d != got->n_dense || f != got->n_fields;
    return bad;
}

static int check_ffm(char *line, const rows_copy *got, size_t r)
{
    char *tok[256];
    int n = split(line, ' ', tok, 256), bad = 0;
    bad += got->labels[r] != (strtod(tok[0], NULL) > 0 ? 1.0f : 0.0f);
    const uint32_t *o = got->offsets + r * got->n_fields;
    uint32_t seen[64] = {0};
    for (int i = 1; i < n && i < 256; i++) {
        if (!*tok[i]) continue;
        unsigned field = (unsigned)strtoul(tok[i], NULL, 10);
        char *idx = strchr(tok[i], ':') + 1;
        char *val = strchr(idx, ':');
        uint64_t key = XXH3_64bits_withSeed(idx, (size_t)(val - idx), field);
        uint32_t at = o[field] + seen[field]++;
        bad += at >= o[field + 1] || got->keys[at] != key ||
               got->weights[at] != (float)strtod(val + 1, NULL);
    }
    for (uint32_t fi = 0; fi < got->n_fields && fi < 64; fi++) bad += o[fi + 1] - o[fi] != seen[fi];
    return bad;
}

static void run_sample(const char *dir, sample *s, const char *tmp)
{
    char path[4096], out[4096], name[512];
    snprintf(path, sizeof path, "%s", join(dir, s->file));
    snprintf(name, sizeof name, "%.500s.out", s->file);
    snprintf(out, sizeof out, "%s", join(tmp, name));
    const char *in[1] = {path};
    ds_ingest_result res;
    char *err = NULL;
    CHECK_OK(ingest_files(s->fmt, NULL, in, 1, out, 3, &res, &err), err);
    CHECK_MSG(res.rows_written == s->rows && res.rows_rejected == 0 && res.rows_in == s->rows,
              "%s: in %llu written %llu rejected %llu, want %zu", s->file,
              (unsigned long long)res.rows_in, (unsigned long long)res.rows_written,
              (unsigned long long)res.rows_rejected, s->rows);
    rows_copy got = {0};
    read_all(join(out, "train"), &got);
    CHECK_MSG(got.n_rows == s->rows, "%s: read back %zu rows", s->file, got.n_rows);
    char *text = NULL;
    size_t len;
    int rrc = cm_read_file(path, (void **)&text, &len, &err);
    CHECK_OK(rrc, err);
    if (rrc != 0) {
        rows_copy_free(&got);
        return;
    }
    char *save = NULL, *line = strtok_r(text, "\n", &save);
    if (s->header) line = strtok_r(NULL, "\n", &save);
    size_t r = 0, mismatched = 0;
    for (; line && r < got.n_rows; line = strtok_r(NULL, "\n", &save), r++) {
        size_t l = strlen(line);
        if (l && line[l - 1] == '\r') line[l - 1] = '\0';
        int bad = s->fmt == DS_FMT_LIBFFM ? check_ffm(line, &got, r) : check_delimited(s, line, &got, r);
        if (bad && mismatched++ < 3) fprintf(stderr, "%s: row %zu differs (%d values)\n", s->file, r, bad);
    }
    CHECK_MSG(mismatched == 0, "%s: %zu rows differ from the reference parse", s->file, mismatched);
    CHECK(r == s->rows);
    free(text);
    rows_copy_free(&got);
}

int main(void)
{
    const char *dir = getenv("EMBER_SHARED_DATA");
    if (dir == NULL) dir = "../../shared/data/real";
    const char *tmp = check_tmpdir("ds_real");
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/SOURCES.md", dir);
    if (access(probe, R_OK) != 0) {
        /* The samples live in shared/ beside the checkout; without them this test proves
         * nothing, so it fails loudly rather than passing. */
        fprintf(stderr, "ds_real: the real data samples are missing: %s (set EMBER_SHARED_DATA)\n",
                probe);
        return 1;
    }
    sample s[9] = {
        {.file = "paddlerec_criteo_raw_sample.tsv", .fmt = DS_FMT_CRITEO, .rows = 100, .sep = '\t'},
        {.file = "criteo_paddlerec_raw_100.tsv", .fmt = DS_FMT_CRITEO, .rows = 100, .sep = '\t'},
        {.file = "criteo_kaggle_train_first1000_stripped.tsv", .fmt = DS_FMT_CRITEO, .rows = 1000, .sep = '\t'},
        {.file = "criteo_kaggle_train_tiny_1999.csv", .fmt = DS_FMT_CRITEO_CSV, .rows = 1999, .header = 1, .sep = ','},
        {.file = "criteo_kaggle_test_tiny_1999_nolabel.csv", .fmt = DS_FMT_CRITEO_CSV, .rows = 1999, .header = 1, .sep = ','},
        {.file = "deepctr_criteo_sample.txt", .fmt = DS_FMT_CRITEO_CSV, .rows = 200, .header = 1, .sep = ','},
        {.file = "criteo_libffm_xlearn_train_200.ffm", .fmt = DS_FMT_LIBFFM, .rows = 200, .sep = ' '},
        {.file = "deepctr_avazu_sample.txt", .fmt = DS_FMT_AVAZU, .rows = 100, .header = 1, .sep = ','},
        {.file = "avazu_kaggle_rx_2994.csv", .fmt = DS_FMT_AVAZU, .rows = 2994, .header = 1, .sep = ','},
    };
    criteo_roles(&s[0], 0, 1);
    criteo_roles(&s[1], 0, 1);
    criteo_roles(&s[2], 0, 1);
    criteo_roles(&s[3], 1, 1);
    criteo_roles(&s[4], 1, 0);
    criteo_roles(&s[5], 0, 1);
    avazu_roles(&s[7]);
    avazu_roles(&s[8]);
    for (int i = 0; i < 9; i++) run_sample(dir, &s[i], tmp);

    /* spot checks against the raw text, by hand */
    rows_copy got = {0};
    read_all(join(join(tmp, "criteo_kaggle_train_first1000_stripped.tsv.out"), "train"), &got);
    if (got.n_rows >= 1) {
        /* 0\t1\t1\t5\t0\t1382\t4\t15\t2\t181\t1\t2\t\t2\t68fd1e64... */
        CHECK(got.labels[0] == 0.0f);
        CHECK(got.dense[0] == 1.0f && got.dense[4] == 1382.0f && got.dense[11] == 0.0f);
        CHECK(got.keys[got.offsets[0]] == XXH3_64bits_withSeed("68fd1e64", 8, 0));
    }
    rows_copy_free(&got);
    read_all(join(join(tmp, "deepctr_criteo_sample.txt.out"), "train"), &got);
    if (got.n_rows >= 2) {
        /* 0,,-1,19.0,35.0,30251.0,... */
        CHECK(got.dense[13 + 1] == -1.0f && got.dense[13 + 2] == 19.0f && got.dense[13 + 4] == 30251.0f);
        CHECK(got.dense[0 + 2] == 260.0f);
    }
    rows_copy_free(&got);

    /* the stripped TSV holds the first 1000 rows of the Kaggle CSV: both must parse the same */
    {
        rows_copy a = {0}, b = {0};
        read_all(join(join(tmp, "criteo_kaggle_train_first1000_stripped.tsv.out"), "train"), &a);
        read_all(join(join(tmp, "criteo_kaggle_train_tiny_1999.csv.out"), "train"), &b);
        CHECK(a.n_rows == 1000 && b.n_rows == 1999);
        if (a.n_rows == 1000 && b.n_rows == 1999) {
            size_t nk = a.offsets[1000 * 26];
            CHECK(memcmp(a.labels, b.labels, 1000 * 4) == 0);
            CHECK(memcmp(a.dense, b.dense, 1000 * 13 * 4) == 0);
            CHECK(memcmp(a.offsets, b.offsets, (1000 * 26 + 1) * 4) == 0);
            CHECK(memcmp(a.keys, b.keys, nk * 8) == 0);
        }
        rows_copy_free(&a);
        rows_copy_free(&b);
    }

    /* the stripped Criteo file: missing trailing columns are taken as empty and counted */
    {
        char path[4096];
        snprintf(path, sizeof path, "%s/criteo_kaggle_train_first1000_stripped.tsv", dir);
        const char *in[1] = {path};
        ds_ingest_result res;
        char *err = NULL;
        CHECK_OK(ingest_files(DS_FMT_CRITEO, NULL, in, 1, join(tmp, "stripped"), 1, &res, &err), err);
        CHECK_MSG(res.rows_padded == 498, "padded %llu", (unsigned long long)res.rows_padded);
    }
    return check_done();
}
