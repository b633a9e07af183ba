/* How ingest writes, against the plain way:
 *
 *   - shards written with O_DIRECT through the writer's aligned stage (the default) are byte
 *     for byte the shards written through the page cache (ds_ingest_opts.buffered_output),
 *     with several files, an eval split, and with one file large enough that its stage is
 *     written out more than once before the end;
 *   - stats.json, whose field statistics are taken at block coding time (missing counts from
 *     the key counts, HyperLogLog over each field's distinct keys only), agrees with counts
 *     taken from the parsed rows: missing rates exactly, distinct estimates within HyperLogLog
 *     error, for one-key fields (Criteo) and for a multi-key column. */
#include "ds_test_util.h"

static uint64_t rng = 0x2545f4914f6cdd1dull;
static uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* Criteo TSV: label, 13 integers, 26 hex tokens; some fields empty, field f drawn from
 * about 2^(f % 12 + 2) values so that dictionaries and plain fields both occur. */
static size_t criteo_text(char *buf, size_t lines)
{
    size_t n = 0;
    for (size_t l = 0; l < lines; l++) {
        n += (size_t)sprintf(buf + n, "%d", (int)(next_rand() % 2));
        for (int d = 0; d < 13; d++) {
            uint64_t r = next_rand();
            if (r % 7 == 0)
                n += (size_t)sprintf(buf + n, "\t");
            else
                n += (size_t)sprintf(buf + n, "\t%d", (int)(r % 5000) - 2);
        }
        for (int f = 0; f < 26; f++) {
            uint64_t r = next_rand();
            if (r % 11 == 0)
                n += (size_t)sprintf(buf + n, "\t");
            else
                n += (size_t)sprintf(buf + n, "\t%08x", (unsigned)((r >> 8) % (4u << (f % 12))));
        }
        buf[n++] = '\n';
    }
    return n;
}

/* Removes a test directory when nothing has failed (else it is left to look at). */
static void remove_if_passed(const char *dir)
{
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (check_failures_ == 0 && system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", dir);
}

static int ingest(const char *in, const char *out, ds_format fmt, const char *schema,
                  uint32_t shards, double eval, int buffered, ds_ingest_result *res)
{
    ds_ingest_opts o;
    ds_ingest_opts_init(&o);
    o.parser.format = fmt;
    o.parser.schema_text = schema;
    o.inputs = &in;
    o.n_inputs = 1;
    o.out_dir = out;
    o.n_shards = shards;
    o.eval_fraction = eval;
    o.threads = 1; /* one worker: statistics summed in row order */
    o.block_rows = 997;
    o.buffered_output = buffered;
    char *err = NULL;
    int rc = ds_ingest_run(&o, res, &err);
    CHECK_OK(rc, err);
    return rc;
}

static void direct_vs_buffered(const char *tmp, const char *in, uint32_t shards, double eval)
{
    char d[4200], b[4200], name[64];
    snprintf(d, sizeof d, "%s/direct-%u", tmp, shards);
    snprintf(b, sizeof b, "%s/buffered-%u", tmp, shards);
    ds_ingest_result rd, rb;
    if (ingest(in, d, DS_FMT_CRITEO, NULL, shards, eval, 0, &rd) != 0 ||
        ingest(in, b, DS_FMT_CRITEO, NULL, shards, eval, 1, &rb) != 0)
        return;
    CHECK(rd.bytes_out == rb.bytes_out && rd.rows_written == rb.rows_written);
    for (int ev = 0; ev < (eval > 0 ? 2 : 1); ev++)
        for (uint32_t s = 0; s < shards; s++) {
            snprintf(name, sizeof name, "%s/part-%05u.shard", ev ? "eval" : "train", s);
            CHECK_MSG(same_file(join(d, name), join(b, name)), "%u shards: %s differs", shards,
                      name);
            uint64_t rows = 0;
            char *err = NULL;
            CHECK_OK(ds_shard_verify(join(d, name), &rows, &err), err);
        }
    CHECK(same_file(join(d, "stats.json"), join(b, "stats.json")));
}

static void test_direct_output(void)
{
    const char *tmp = check_tmpdir("ds_write");
    /* 90K lines, ~20 MB: its one shard (~9 MB) fills the 4 MiB stage twice */
    size_t lines = 90000;
    char *buf = malloc(lines * 400);
    size_t n = criteo_text(buf, lines);
    char *in = join(tmp, "in.tsv");
    write_text(in, buf, n);
    free(buf);
    direct_vs_buffered(tmp, in, 1, 0);
    direct_vs_buffered(tmp, in, 3, 0.2);
    direct_vs_buffered(tmp, in, 130, 0.1); /* 260 files: stages of 256 KiB */
    direct_vs_buffered(tmp, in, 300, 0);   /* more files than stages allow: buffered */
    remove_if_passed(tmp);                 /* ~150 MB */
}

/* The value after "key": in the line of stats.json that names name. */
static double stat_of(const char *json, const char *name, const char *key)
{
    char pat[128];
    snprintf(pat, sizeof pat, "{\"name\": \"%s\",", name);
    const char *p = strstr(json, pat);
    if (p == NULL) return -1;
    snprintf(pat, sizeof pat, "\"%s\": ", key);
    p = strstr(p, pat);
    return p ? atof(p + strlen(pat)) : -1;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Checks stats.json in out against the rows of text parsed with the public parser. */
static void check_field_stats(const char *out, ds_format fmt, const char *schema, const char *text,
                              size_t n)
{
    ds_parser_opts po;
    ds_parser_opts_init(&po);
    po.format = fmt;
    po.schema_text = schema;
    ds_parser *p = NULL;
    char *err = NULL;
    CHECK_OK(ds_parser_create(&po, &p, &err), err);
    if (p == NULL) return;
    ds_batch b;
    ds_parse_report rep;
    CHECK_OK(ds_parser_parse(p, text, n, &b, &rep, &err), err);
    const ds_schema *s = ds_parser_schema(p);
    FILE *f = fopen(join(out, "stats.json"), "rb");
    char *json = calloc(1, 1 << 20);
    size_t jn = f ? fread(json, 1, (1 << 20) - 1, f) : 0;
    if (f) fclose(f);
    CHECK(jn > 0);
    uint64_t *keys = malloc((b.n_keys + 1) * sizeof *keys);
    for (uint32_t fi = 0; fi < b.n_fields; fi++) {
        uint64_t missing = 0, m = 0;
        for (uint32_t i = 0; i < b.n_rows; i++) {
            uint32_t k0 = b.offsets[(size_t)i * b.n_fields + fi];
            uint32_t k1 = b.offsets[(size_t)i * b.n_fields + fi + 1];
            missing += k0 == k1;
            for (uint32_t k = k0; k < k1; k++)
                keys[m++] = b.keys[k];
        }
        qsort(keys, m, sizeof *keys, cmp_u64);
        uint64_t distinct = m > 0;
        for (uint64_t k = 1; k < m; k++)
            distinct += keys[k] != keys[k - 1];
        char want[32], got[32];
        snprintf(want, sizeof want, "%.6f", (double)missing / b.n_rows);
        snprintf(got, sizeof got, "%.6f", stat_of(json, s->field_names[fi], "missing_rate"));
        CHECK_MSG(strcmp(want, got) == 0, "field %s: missing rate %s, want %s", s->field_names[fi],
                  got, want);
        double est = stat_of(json, s->field_names[fi], "distinct_estimate");
        CHECK_MSG(fabs(est - (double)distinct) <= 0.06 * (double)distinct + 2,
                  "field %s: distinct estimate %.0f, counted %llu", s->field_names[fi], est,
                  (unsigned long long)distinct);
    }
    free(keys);
    free(json);
    ds_parser_destroy(p);
}

static void test_field_stats(void)
{
    const char *tmp = check_tmpdir("ds_write_stats");
    size_t lines = 20000;
    char *buf = malloc(lines * 400);
    size_t n = criteo_text(buf, lines);
    char *in = join(tmp, "criteo.tsv");
    write_text(in, buf, n);
    ds_ingest_result r;
    if (ingest(in, join(tmp, "criteo"), DS_FMT_CRITEO, NULL, 2, 0, 0, &r) == 0)
        check_field_stats(join(tmp, "criteo"), DS_FMT_CRITEO, NULL, buf, n);

    /* a multi-key column: rows with 0..3 keys, so the counts are not all 0 or 1 */
    static const char *schema = "separator ,\nheader no\nlabel y\ndense a\ncat b\nmulti c |\n";
    n = 0;
    for (size_t l = 0; l < lines; l++) {
        uint64_t r1 = next_rand();
        n += (size_t)sprintf(buf + n, "%d,%d,", (int)(r1 % 2), (int)(r1 >> 8) % 100);
        if (r1 % 5) n += (size_t)sprintf(buf + n, "b%u", (unsigned)(r1 >> 20) % 300);
        buf[n++] = ',';
        for (unsigned k = 0, nk = (unsigned)(r1 >> 40) % 4; k < nk; k++)
            n += (size_t)sprintf(buf + n, "%sc%u", k ? "|" : "", (unsigned)(next_rand() % 5000));
        buf[n++] = '\n';
    }
    in = join(tmp, "multi.csv");
    write_text(in, buf, n);
    if (ingest(in, join(tmp, "multi"), DS_FMT_CSV, schema, 1, 0, 0, &r) == 0)
        check_field_stats(join(tmp, "multi"), DS_FMT_CSV, schema, buf, n);
    free(buf);
    remove_if_passed(tmp);
}

int main(void)
{
    test_direct_output();
    test_field_stats();
    return check_done();
}
