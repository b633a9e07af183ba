/* Parser edge cases: schema CSV with multi-valued fields and RFC 4180 quoting, malformed lines
 * of every kind, random junk, bucketize, libsvm/libffm, eval split and determinism. */
#include <xxhash.h>

#include "ds_test_util.h"

static uint64_t K(const char *s, uint32_t f)
{
    return XXH3_64bits_withSeed(s, strlen(s), f);
}

static ds_parser *make(ds_format fmt, const char *schema, int bucketize)
{
    return make_parser(fmt, schema, bucketize);
}

/* Parses text; returns rows accepted, fills rep and b. */
static uint64_t parse(ds_parser *p, const char *text, ds_batch *b, ds_parse_report *rep)
{
    char *err = NULL;
    CHECK_OK(ds_parser_parse(p, text, strlen(text), b, rep, &err), err);
    CHECK(rep->lines == rep->rows + rep->rejected);
    return rep->rows;
}

static const char *SCHEMA = "# test schema\n"
                            "separator ,\n"
                            "header yes\n"
                            "label y\n"
                            "dense price\n"
                            "cat user\n"
                            "multi tags |\n"
                            "skip note\n"
                            "cat city   # trailing comment\n";

static void test_csv_quoting_multi(void)
{
    ds_parser *p = make(DS_FMT_CSV, SCHEMA, 0);
    if (!p) return;
    CHECK(ds_parser_wants_header(p));
    char *err = NULL;
    CHECK_OK(ds_parser_header(p, "y,price,user,tags,note,city", 27, &err), err);
    const ds_schema *s = ds_parser_schema(p);
    CHECK(s && s->n_dense == 1 && s->n_fields == 3 && s->has_label);
    CHECK(s && strcmp(s->field_names[1], "tags") == 0);
    ds_batch b;
    ds_parse_report rep;
    const char *text = "1,2.5,u1,a|b||c,\"note, with \"\"quotes\"\"\",NYC\r\n"
                       "0,,\"u,2\",,x,\"New \"\"York\"\"\"\n"
                       "\n"
                       "1,3,\"\",\"p|q\",\"\",\"\"";
    CHECK(parse(p, text, &b, &rep) == 3);
    CHECK(rep.rejected == 0 && rep.lines == 3);
    CHECK(b.n_rows == 3 && b.n_fields == 3);
    if (b.n_rows == 3) {
        const uint32_t *o = b.offsets;
        CHECK(b.labels[0] == 1.0f && b.dense[0] == 2.5f);
        CHECK(o[1] - o[0] == 1 && b.keys[o[0]] == K("u1", 0));
        CHECK(o[2] - o[1] == 3 && b.keys[o[1]] == K("a", 1) && b.keys[o[1] + 1] == K("b", 1) &&
              b.keys[o[1] + 2] == K("c", 1));
        CHECK(o[3] - o[2] == 1 && b.keys[o[2]] == K("NYC", 2));
        /* row 1: quoted separator kept in the token, empty multi, doubled quotes unescaped */
        CHECK(b.labels[1] == 0.0f && b.dense[1] == 0.0f);
        CHECK(o[4] - o[3] == 1 && b.keys[o[3]] == K("u,2", 0));
        CHECK(o[5] == o[4]);
        CHECK(o[6] - o[5] == 1 && b.keys[o[5]] == K("New \"York\"", 2));
        /* row 2: quoted empties are missing values; quoted multi still splits */
        CHECK(o[7] == o[6] && o[8] - o[7] == 2 && b.keys[o[7]] == K("p", 1) && o[9] == o[8]);
        CHECK(o[9] == b.n_keys);
    }
    /* malformed lines, each with its reason */
    struct { const char *line; int reason; } bad[] = {
        {"1,2,u,t,n", DS_REJ_COLUMNS},               /* too few */
        {"1,2,u,t,n,c,extra", DS_REJ_COLUMNS},       /* too many */
        {"1,abc,u,t,n,c", DS_REJ_NUMBER},            /* non-numeric dense */
        {"1,1e,u,t,n,c", DS_REJ_NUMBER},
        {"1,nan,u,t,n,c", DS_REJ_NUMBER},
        {"x,2,u,t,n,c", DS_REJ_LABEL},
        {",2,u,t,n,c", DS_REJ_LABEL},
        {"1,2,\"u,t,n,c", DS_REJ_QUOTE},             /* unterminated */
        {"1,2,\"u\"x,t,n,c", DS_REJ_QUOTE},          /* text after closing quote */
        {"1,2,u\"v,t,n,c", DS_REJ_QUOTE},            /* quote inside unquoted field */
        {"1,2,u\001,t,n,c", DS_REJ_JUNK},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        parse(p, bad[i].line, &b, &rep);
        CHECK_MSG(rep.rejected == 1 && rep.first_reason == bad[i].reason && rep.first_bad == 1,
                  "line %zu '%s': rejected %llu reason %s", i, bad[i].line,
                  (unsigned long long)rep.rejected, ds_reject_name(rep.first_reason));
    }
    /* NUL byte inside a line, and an over-long token */
    char nul[] = "1,2,u\0v,t,n,c";
    CHECK_OK(ds_parser_parse(p, nul, sizeof nul - 1, &b, &rep, &err), err);
    CHECK(rep.rejected == 1 && rep.first_reason == DS_REJ_JUNK);
    char *longl = malloc(DS_MAX_TOKEN + 64);
    strcpy(longl, "1,2,");
    memset(longl + 4, 'a', DS_MAX_TOKEN + 1);
    strcpy(longl + 4 + DS_MAX_TOKEN + 1, ",t,n,c\n1,2,u,t,n,c");
    parse(p, longl, &b, &rep);
    CHECK(rep.rejected == 1 && rep.first_reason == DS_REJ_TOKEN_LONG && rep.rows == 1);
    /* exactly DS_MAX_TOKEN bytes is fine */
    memset(longl + 4, 'a', DS_MAX_TOKEN);
    strcpy(longl + 4 + DS_MAX_TOKEN, ",t,n,c");
    parse(p, longl, &b, &rep);
    CHECK(rep.rows == 1);
    free(longl);
    /* a header with the wrong column count is refused */
    CHECK(ds_parser_header(p, "y,price", 7, &err) == CM_EINVAL);
    free(err);
    err = NULL;
    /* a quoted name's separators and doubled quotes are inside the name (RFC 4180, as in the
     * rows): still six columns */
    const char *qh = "y,\"price, \"\"USD\"\"\",user,tags,\"note\",city";
    CHECK_OK(ds_parser_header(p, qh, strlen(qh), &err), err);
    /* an unterminated quote runs to the end of the line: one name, too few columns */
    CHECK(ds_parser_header(p, "y,\"price,user,tags,note,city", 28, &err) == CM_EINVAL);
    free(err);
    err = NULL;
    ds_parser_destroy(p);

    /* schema errors name the line */
    ds_parser_opts o;
    ds_parser_opts_init(&o);
    o.format = DS_FMT_CSV;
    o.schema_text = "label y\nbogus z\n";
    ds_parser *q = NULL;
    CHECK(ds_parser_create(&o, &q, &err) == CM_EINVAL && err && strstr(err, ":2:"));
    free(err);
    err = NULL;
    o.schema_text = "multi t ,\n";
    CHECK(ds_parser_create(&o, &q, &err) == CM_EINVAL);
    free(err);
    err = NULL;
    /* an unknown keyword is quoted, but not a 100,000-byte one whole */
    char *big = malloc(100002);
    if (big == NULL) return;
    memset(big, 'k', 100000);
    memcpy(big + 100000, "\n", 2);
    o.schema_text = big;
    CHECK(ds_parser_create(&o, &q, &err) == CM_EINVAL && err && strstr(err, "'kkkk") &&
          strlen(err) < 200);
    free(err);
    free(big);
}

static void test_criteo_tsv(void)
{
    ds_parser *p = make(DS_FMT_CRITEO, NULL, 1);
    if (!p) return;
    const ds_schema *s = ds_parser_schema(p);
    CHECK(s->n_dense == 13 && s->n_fields == 26 + 13 && strcmp(s->field_names[26], "I1_log2") == 0);
    ds_batch b;
    ds_parse_report rep;
    /* full row with negatives and empties, then a truncated row (only 10 columns) */
    const char *text = "1\t5\t-3\t\t0\t1\t1\t1\t1\t1\t1\t1\t1\t0.5\ta\t\tc\n"
                       "0\t1\t2\t3\t4\t5\t6\t7\t8\t9\n";
    parse(p, text, &b, &rep);
    CHECK(rep.rows == 1 && rep.padded == 1 && rep.rejected == 1 && rep.first_bad == 2 &&
          rep.first_reason == DS_REJ_COLUMNS);
    if (b.n_rows == 1) {
        CHECK(b.dense[0] == 5.0f && b.dense[1] == -3.0f && b.dense[2] == 0.0f && b.dense[12] == 0.5f);
        const uint32_t *o = b.offsets;
        CHECK(o[1] - o[0] == 1 && b.keys[o[0]] == K("a", 0) && o[2] == o[1]);
        CHECK(o[3] - o[2] == 1 && b.keys[o[2]] == K("c", 2));
        for (int f = 3; f < 26; f++) CHECK(o[f + 1] == o[f]);
        /* log2 buckets: 5 -> 3, -3 -> -2, missing -> INT32_MIN, 0.5 -> 0 */
        int32_t b5 = 3, bm3 = -2, bmiss = INT32_MIN, bhalf = 0;
        CHECK(b.keys[o[26]] == XXH3_64bits_withSeed(&b5, 4, 26));
        CHECK(b.keys[o[27]] == XXH3_64bits_withSeed(&bm3, 4, 27));
        CHECK(b.keys[o[28]] == XXH3_64bits_withSeed(&bmiss, 4, 28));
        CHECK(b.keys[o[38]] == XXH3_64bits_withSeed(&bhalf, 4, 38));
        CHECK(o[39] == b.n_keys && b.n_keys == 2 + 13);
    }
    /* 41 columns: too many; a quote is data in TSV */
    parse(p, "1\t1\t1\t1\t1\t1\t1\t1\t1\t1\t1\t1\t1\t1\ta\"b\tb\tc\td\te\tf\tg\th\ti\tj\tk\tl\tm\tn\to\tp\tq\tr\ts\tt\tu\tv\tw\tx\ty\tz\textra", &b, &rep);
    CHECK(rep.rejected == 1 && rep.first_reason == DS_REJ_COLUMNS && rep.first_column == 41);
    parse(p, "1\t1\t1\t1\t1\t1\t1\t1\t1\t1\t1\t1\t1\t1\ta\"b", &b, &rep);
    CHECK(rep.rows == 1);
    ds_parser_destroy(p);
}

/* Criteo's unlabelled TSV (--no-label): 39 columns are I1..I13 and C1..C26, shifted by none;
 * 13 to 39 columns are rows (short ones padded), 12 or 40 are not; only criteo takes it. */
static void test_criteo_no_label(void)
{
    ds_parser_opts o;
    ds_parser_opts_init(&o);
    o.format = DS_FMT_CRITEO;
    o.no_label = 1;
    ds_parser *p = NULL;
    char *err = NULL;
    CHECK_OK(ds_parser_create(&o, &p, &err), err);
    if (!p) return;
    const ds_schema *s = ds_parser_schema(p);
    CHECK(!s->has_label && s->n_dense == 13 && s->n_fields == 26);
    ds_batch b;
    ds_parse_report rep;
    /* I1 = 3 (a labelled parse would reject it as a label), I13 = 0.5, C1 = a, C26 = z */
    const char *row = "3\t-3\t\t0\t1\t1\t1\t1\t1\t1\t1\t1\t0.5\ta\t\tc\t\t\t\t\t\t\t\t\t\t\t\t\t\t"
                      "\t\t\t\t\t\t\t\t\tz\n";
    parse(p, row, &b, &rep);
    CHECK(rep.rows == 1 && rep.padded == 0 && rep.rejected == 0);
    if (b.n_rows == 1) {
        CHECK(b.dense[0] == 3.0f && b.dense[1] == -3.0f && b.dense[12] == 0.5f);
        CHECK(b.labels == NULL || b.labels[0] == 0.0f);
        const uint32_t *off = b.offsets;
        CHECK(off[1] - off[0] == 1 && b.keys[off[0]] == K("a", 0));
        CHECK(off[26] - off[25] == 1 && b.keys[off[25]] == K("z", 25) && b.n_keys == 3);
    }
    /* 13 columns: the dense part alone, padded; 12 and 40 columns: rejected */
    parse(p, "1\t2\t3\t4\t5\t6\t7\t8\t9\t10\t11\t12\t13\n", &b, &rep);
    CHECK(rep.rows == 1 && rep.padded == 1);
    parse(p, "1\t2\t3\t4\t5\t6\t7\t8\t9\t10\t11\t12\n", &b, &rep);
    CHECK(rep.rejected == 1 && rep.first_reason == DS_REJ_COLUMNS);
    parse(p,
          "1\t1\t1\t1\t1\t1\t1\t1\t1\t1\t1\t1\t1\ta\tb\tc\td\te\tf\tg\th\ti\tj\tk\tl\tm\tn\to\tp"
          "\tq\tr\ts\tt\tu\tv\tw\tx\ty\tz\textra\n",
          &b, &rep);
    CHECK(rep.rejected == 1 && rep.first_reason == DS_REJ_COLUMNS && rep.first_column == 40);
    ds_parser_destroy(p);
    /* Formats that name or always have their label refuse it. */
    const ds_format others[] = {DS_FMT_CRITEO_CSV, DS_FMT_AVAZU, DS_FMT_LIBSVM, DS_FMT_CSV};
    for (size_t i = 0; i < sizeof others / sizeof others[0]; i++) {
        o.format = others[i];
        o.schema_text = SCHEMA;
        p = NULL;
        CHECK(ds_parser_create(&o, &p, &err) == CM_EINVAL && p == NULL && err &&
              strstr(err, "criteo TSV"));
        free(err);
        err = NULL;
    }
}

static uint64_t rng = 88172645463325252ull;
static uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static void test_junk(void)
{
    /* random bytes and mutated valid lines never crash and always balance */
    ds_format fmts[] = {DS_FMT_CRITEO, DS_FMT_LIBSVM, DS_FMT_LIBFFM, DS_FMT_CSV};
    const char *valid[] = {"1\t2\t3\t\t5\t6\t7\t8\t9\t10\t11\t12\t13\t14\tab\tcd\t\tef",
                           "1 3:0.5 7:1 12:2.25", "0 1:3:0.5 0:7:1 3:12:2", "1,2.5,u1,a|b,n,c"};
    char *buf = malloc(1 << 16);
    for (size_t fi = 0; fi < 4; fi++) {
        ds_parser *p = make(fmts[fi], SCHEMA, fi == 0);
        if (!p) continue;
        char *err = NULL;
        if (ds_parser_wants_header(p)) CHECK_OK(ds_parser_header(p, "a,b,c,d,e,f", 11, &err), err);
        for (int round = 0; round < 300; round++) {
            size_t n = 0;
            int lines = 1 + (int)(next_rand() % 20);
            for (int l = 0; l < lines; l++) {
                if (next_rand() % 2) {
                    size_t len = next_rand() % 200;
                    for (size_t i = 0; i < len; i++) buf[n++] = (char)(next_rand() & 0xff);
                } else {
                    size_t vl = strlen(valid[fi]);
                    memcpy(buf + n, valid[fi], vl);
                    for (int m = 0; m < 3; m++) buf[n + next_rand() % vl] = (char)(next_rand() & 0xff);
                    n += next_rand() % 3 ? vl : next_rand() % vl; /* sometimes truncated */
                }
                buf[n++] = '\n';
            }
            ds_batch b;
            ds_parse_report rep;
            CHECK_OK(ds_parser_parse(p, buf, n, &b, &rep, &err), err);
            CHECK(rep.lines == rep.rows + rep.rejected && b.n_rows == rep.rows);
            CHECK(b.offsets[(size_t)b.n_rows * b.n_fields] == b.n_keys);
        }
        ds_parser_destroy(p);
    }
    free(buf);
}

static void test_sparse(void)
{
    ds_parser *p = make(DS_FMT_LIBSVM, NULL, 0);
    ds_batch b;
    ds_parse_report rep;
    if (p) {
        parse(p, "+1 3:0.5 10:1\n-1 2:1e2\n0\n1 abc\n1 3:x\n", &b, &rep);
        CHECK(rep.rows == 3 && rep.rejected == 2 && rep.first_bad == 4 && rep.first_reason == DS_REJ_FEATURE);
        CHECK(b.n_fields == 1 && b.weights != NULL);
        if (b.n_rows == 3) {
            CHECK(b.labels[0] == 1.0f && b.labels[1] == 0.0f && b.labels[2] == 0.0f);
            CHECK(b.offsets[1] == 2 && b.keys[0] == K("3", 0) && b.weights[0] == 0.5f);
            CHECK(b.keys[2] == K("2", 0) && b.weights[2] == 100.0f && b.offsets[3] == 3);
        }
        /* SVMlight's ranking lines: a qid after the label, and a comment to the end of the
         * line, both once `feature` rejects (a LETOR file lost every row). Neither is a
         * feature: a qid elsewhere still is a reject, as is one without a number. */
        parse(p,
              "2 qid:17 3:0.5 10:1 # doc 4 of q17\n0 qid:17 2:1e2#x\n1 3:1 qid:3\n1 qid:x 3:1\n"
              "1 # all comment\n",
              &b, &rep);
        CHECK_MSG(rep.rows == 3 && rep.rejected == 2 && rep.first_bad == 3 &&
                      rep.first_reason == DS_REJ_FEATURE,
                  "rows %llu rejected %llu first_bad %llu", (unsigned long long)rep.rows,
                  (unsigned long long)rep.rejected, (unsigned long long)rep.first_bad);
        if (b.n_rows == 3) {
            CHECK(b.labels[0] == 1.0f && b.labels[1] == 0.0f && b.labels[2] == 1.0f);
            CHECK(b.offsets[1] == 2 && b.keys[0] == K("3", 0) && b.keys[1] == K("10", 0));
            CHECK(b.offsets[2] == 3 && b.keys[2] == K("2", 0) && b.weights[2] == 100.0f);
            CHECK(b.offsets[3] == 3);
        }
        ds_parser_destroy(p);
    }
    p = make(DS_FMT_LIBFFM, NULL, 0);
    if (p) {
        parse(p, "1 2:7:0.5 0:3:1 2:8:2\n0 4:1:1\n0 1:2\n", &b, &rep);
        CHECK(rep.rows == 1 && rep.rejected == 2);
        if (b.n_rows == 1) {
            const uint32_t *o = b.offsets;
            CHECK(o[1] - o[0] == 1 && b.keys[o[0]] == K("3", 0));
            CHECK(o[3] - o[2] == 2 && b.keys[o[2]] == K("7", 2) && b.keys[o[2] + 1] == K("8", 2) &&
                  b.weights[o[2] + 1] == 2.0f);
        }
        ds_parser_destroy(p);
    }
}

/* Many distinct Criteo lines, for split and determinism checks. */
static void write_synthetic(const char *path, int rows, int junk_every)
{
    FILE *f = fopen(path, "w");
    for (int i = 0; i < rows; i++) {
        if (junk_every && i % junk_every == 7) {
            fprintf(f, "junk line %d\n", i);
            continue;
        }
        fprintf(f, "%d", i % 4 == 0);
        for (int d = 0; d < 13; d++) fprintf(f, "\t%d", (i * 7 + d) % 1000 - 3);
        for (int c = 0; c < 26; c++) fprintf(f, "\t%08x", (unsigned)(i * 2654435761u + (unsigned)c) % 5000);
        fputc('\n', f);
    }
    fclose(f);
}

static void test_ingest_split(const char *tmp)
{
    char *in = join(tmp, "syn.tsv");
    write_synthetic(in, 20000, 1000);
    const char *inputs[1] = {in};
    ds_ingest_opts o;
    ds_ingest_result r1, r3;
    char *err = NULL;
    ds_ingest_opts_init(&o);
    o.parser.format = DS_FMT_CRITEO;
    o.inputs = inputs;
    o.n_inputs = 1;
    o.eval_fraction = 0.25;
    o.n_shards = 2;
    o.chunk_bytes = 32 << 10;
    o.block_rows = 500;
    o.log = fopen("/dev/null", "w");
    o.threads = 1;
    o.out_dir = join(tmp, "split1");
    CHECK_OK(ds_ingest_run(&o, &r1, &err), err);
    o.threads = 3;
    o.out_dir = join(tmp, "split3");
    CHECK_OK(ds_ingest_run(&o, &r3, &err), err);
    fclose(o.log);
    CHECK(r1.rows_in == 20000 && r1.rows_rejected == 20 && r1.rows_written == 19980);
    CHECK(r1.rows_in == r1.rows_written + r1.rows_rejected);
    CHECK(r1.rejected_by_reason[DS_REJ_LABEL] == 20); /* "junk line N": the label fails first */
    double frac = (double)r1.rows_eval / (double)r1.rows_written;
    CHECK_MSG(frac > 0.23 && frac < 0.27, "eval fraction %.4f", frac);
    CHECK(r1.rows_eval == r3.rows_eval && r1.rows_train == r3.rows_train);
    /* the output does not depend on the number of threads */
    const char *parts[] = {"train/part-00000.shard", "train/part-00001.shard",
                           "eval/part-00000.shard", "eval/part-00001.shard"};
    for (int i = 0; i < 4; i++)
        CHECK_MSG(same_file(join(join(tmp, "split1"), parts[i]), join(join(tmp, "split3"), parts[i])),
                  "%s differs between 1 and 3 threads", parts[i]);
    uint64_t rows = 0, total = 0;
    for (int i = 0; i < 4; i++) {
        CHECK_OK(ds_shard_verify(join(join(tmp, "split1"), parts[i]), &rows, &err), err);
        total += rows;
    }
    CHECK(total == r1.rows_written);
    /* stats.json exists and holds the row count */
    char *js = NULL;
    size_t n;
    CHECK_OK(cm_read_file(join(join(tmp, "split1"), "stats.json"), (void **)&js, &n, &err), err);
    CHECK(js && strstr(js, "\"rows\": 19980") && strstr(js, "\"distinct_estimate\""));
    if (js) {
        /* field C1 has 5000 distinct values at most: the HLL estimate should be near */
        const char *c1 = strstr(js, "\"name\": \"C1\"");
        const char *de = c1 ? strstr(c1, "distinct_estimate\": ") : NULL;
        double est = de ? strtod(de + 20, NULL) : 0;
        CHECK_MSG(est > 4500 && est < 5500, "C1 distinct estimate %.0f", est);
        /* ds_stats_read_distinct sums the 26 fields' estimates, found here by field name */
        double sum = 0;
        for (int f = 1; f <= 26; f++) {
            char name[32];
            snprintf(name, sizeof name, "\"name\": \"C%d\"", f);
            const char *at = strstr(js, name);
            const char *v = at ? strstr(at, "distinct_estimate\": ") : NULL;
            CHECK_MSG(v != NULL, "field C%d in stats.json", f);
            if (v) sum += strtod(v + 20, NULL);
        }
        uint64_t got = 0;
        uint32_t fields = 0;
        CHECK_OK(
            ds_stats_read_distinct(join(join(tmp, "split1"), "stats.json"), &got, &fields, &err),
            err);
        CHECK(fields == 26 && got == (uint64_t)sum && got > 4500);
        /* a damaged estimate, a file without any, and no file: each refused by name */
        const char *bad[] = {"{\"fields\": [{\"distinct_estimate\": x}]}", "{\"rows\": 3}"};
        for (int i = 0; i < 2; i++) {
            const char *path = join(tmp, "stats-bad.json");
            CHECK_OK(cm_write_file_atomic(path, bad[i], strlen(bad[i]), &err), err);
            CHECK(ds_stats_read_distinct(path, &got, &fields, &err) == CM_ECORRUPT);
            CHECK_MSG(err && strstr(err, "stats-bad.json"), "error names the file: %s",
                      err ? err : "(none)");
            free(err);
            err = NULL;
        }
        CHECK(ds_stats_read_distinct(join(tmp, "absent.json"), &got, &fields, &err) ==
              CM_ENOTFOUND);
        free(err);
        err = NULL;
        /* The most keys a row held: one a field here (Criteo, no field empty in some row). */
        uint32_t k = 0;
        CHECK_OK(ds_stats_read_max_row_keys(join(join(tmp, "split1"), "stats.json"), &k, &err),
                 err);
        CHECK_MSG(k == 26, "max_row_keys %u, want 26", k);
        /* damaged: refused by name; absent from the file (an older ingest) or no file: not
         * found, so the trainer falls back to its guess */
        const char *bad_k[] = {"{\"max_row_keys\": x,\n}", "{\"max_row_keys\": 5000000000,\n}"};
        for (int i = 0; i < 2; i++) {
            const char *path = join(tmp, "stats-bad.json");
            CHECK_OK(cm_write_file_atomic(path, bad_k[i], strlen(bad_k[i]), &err), err);
            CHECK(ds_stats_read_max_row_keys(path, &k, &err) == CM_ECORRUPT);
            CHECK_MSG(err && strstr(err, "stats-bad.json"), "error names the file: %s",
                      err ? err : "(none)");
            free(err);
            err = NULL;
        }
        const char *old_file = join(tmp, "stats-old.json");
        CHECK_OK(cm_write_file_atomic(old_file, "{\"rows\": 3}", 12, &err), err);
        CHECK(ds_stats_read_max_row_keys(old_file, &k, &err) == CM_ENOTFOUND);
        free(err);
        err = NULL;
        CHECK(ds_stats_read_max_row_keys(join(tmp, "absent.json"), &k, &err) == CM_ENOTFOUND);
        free(err);
        err = NULL;
    }
    free(js);
}

int main(void)
{
    const char *tmp = check_tmpdir("ds_parse");
    test_csv_quoting_multi();
    test_criteo_tsv();
    test_criteo_no_label();
    test_junk();
    test_sparse();
    test_ingest_split(tmp);
    return check_done();
}
