/* The fast paths of ingest against their plain counterparts, which must agree byte for byte:
 *
 *   - the SIMD separator search (SSE2, 64 bytes a step) against the byte loop
 *     (ds_parser_opts.scalar_scan): random lines, and adversarial ones with separators, quotes,
 *     CR and control bytes at every position around the 16/32/64-byte boundaries, lines that
 *     end exactly at the end of their buffer (each input is copied into an allocation of its
 *     exact size, so ASan sees any read past it);
 *   - numbers read 8 bytes at a time against the digit loop (also ds_parser_opts.scalar_scan);
 *   - keys of tokens of every length around the 16-byte short-input cut against ds_key;
 *   - a mapped plain input against the same text read through zstd (chunks cut at the same
 *     places, including an over-long line and a last line without a line end). */
#include <xxhash.h>
#include <zstd.h>

#include "ds_test_util.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static const char *SCHEMA = "separator ,\n"
                            "header no\n"
                            "label y\n"
                            "dense a\n"
                            "cat b\n"
                            "multi c |\n"
                            "cat d\n"
                            "cat e\n";

static ds_parser *make(ds_format fmt, int scalar)
{
    ds_parser_opts o;
    ds_parser_opts_init(&o);
    o.format = fmt;
    o.schema_text = fmt == DS_FMT_CSV ? SCHEMA : NULL;
    o.scalar_scan = scalar;
    ds_parser *p = NULL;
    char *err = NULL;
    CHECK_OK(ds_parser_create(&o, &p, &err), err);
    if (p && ds_parser_wants_header(p)) {
        const char *h =
            fmt == DS_FMT_AVAZU ? "id,click,hour,C1,site_id,app_id" : "Id,Label,I1,I2,C1,C2,C3";
        CHECK_OK(ds_parser_header(p, h, strlen(h), &err), err);
    }
    return p;
}

static int same_batch(const ds_batch *a, const ds_batch *b)
{
    if (a->n_rows != b->n_rows || a->n_keys != b->n_keys || a->n_dense != b->n_dense ||
        a->n_fields != b->n_fields)
        return 0;
    size_t nr = a->n_rows;
    return memcmp(a->labels, b->labels, nr * 4) == 0 &&
           memcmp(a->dense, b->dense, nr * a->n_dense * 4) == 0 &&
           memcmp(a->offsets, b->offsets, (nr * a->n_fields + 1) * 4) == 0 &&
           memcmp(a->keys, b->keys, a->n_keys * 8) == 0;
}

/* Parses text with both parsers from an exact-size copy; counts a mismatch as a failure. */
static void both(ds_parser *simd, ds_parser *scalar, const char *text, size_t n)
{
    char *copy = malloc(n ? n : 1);
    memcpy(copy, text, n);
    ds_batch a, b;
    ds_parse_report ra, rb;
    char *err = NULL;
    CHECK_OK(ds_parser_parse(simd, copy, n, &a, &ra, &err), err);
    CHECK_OK(ds_parser_parse(scalar, copy, n, &b, &rb, &err), err);
    CHECK_MSG(ra.lines == rb.lines && ra.rows == rb.rows && ra.rejected == rb.rejected &&
                  ra.padded == rb.padded && ra.first_bad == rb.first_bad &&
                  ra.first_reason == rb.first_reason && ra.first_column == rb.first_column,
              "reports differ on %zu bytes: rows %llu/%llu rejected %llu/%llu reason %d/%d "
              "column %u/%u",
              n, (unsigned long long)ra.rows, (unsigned long long)rb.rows,
              (unsigned long long)ra.rejected, (unsigned long long)rb.rejected, ra.first_reason,
              rb.first_reason, ra.first_column, rb.first_column);
    CHECK_MSG(same_batch(&a, &b), "rows differ on %zu bytes", n);
    free(copy);
}

/* A valid line of the format with tokens of random lengths, into buf; returns its length. */
static size_t valid_line(ds_format fmt, char *buf)
{
    static const char tokc[] = "0123456789abcdef";
    int cols = fmt == DS_FMT_CRITEO ? 40 : fmt == DS_FMT_CSV ? 6 : fmt == DS_FMT_AVAZU ? 6 : 7;
    char sep = fmt == DS_FMT_CRITEO ? '\t' : ',';
    size_t n = 0;
    for (int c = 0; c < cols; c++) {
        if (c) buf[n++] = sep;
        int numeric = fmt == DS_FMT_CRITEO ? c < 14 : fmt == DS_FMT_CSV ? c < 2 : c < 4;
        if (fmt == DS_FMT_AVAZU && c == 2) {
            memcpy(buf + n, "14102100", 8);
            n += 8;
            continue;
        }
        size_t len = next_rand() % (numeric ? 6 : 24);
        int label = fmt == DS_FMT_CRITEO_CSV || fmt == DS_FMT_AVAZU ? c == 1 : c == 0;
        if (label) { /* labels are 0 or 1 (others are rejects) */
            buf[n++] = (char)('0' + next_rand() % 2);
            continue;
        }
        if (c == 0) len = 1 + len % 3;
        for (size_t i = 0; i < len; i++)
            buf[n++] = numeric ? (char)('0' + next_rand() % 10) : tokc[next_rand() % 16];
        if (!numeric && fmt != DS_FMT_CRITEO && next_rand() % 4 == 0) { /* quoted field */
            memmove(buf + n - len + 1, buf + n - len, len);
            buf[n - len] = '"';
            n++;
            if (next_rand() % 2) {
                buf[n++] = '"';
                buf[n++] = '"';
            }
            buf[n++] = fmt == DS_FMT_CSV && next_rand() % 2 ? '|' : ',';
            buf[n++] = '"';
        }
    }
    return n;
}

static const char SPECIAL[] = {'\t', ',', '"', '\r', '\n',       '\0',      0x01,
                               0x1f, '|', ' ', 0x7f, (char)0x80, (char)0xff};

static void test_tokenizer(void)
{
    ds_format fmts[] = {DS_FMT_CRITEO, DS_FMT_CSV, DS_FMT_CRITEO_CSV, DS_FMT_AVAZU};
    char *buf = malloc(1 << 16);
    for (size_t fi = 0; fi < sizeof fmts / sizeof fmts[0]; fi++) {
        ds_parser *simd = make(fmts[fi], 0), *scalar = make(fmts[fi], 1);
        if (!simd || !scalar) return;
        /* valid lines, then one special byte at every position 0..len (each line alone, with
         * and without a line end, so the line also ends at the end of the buffer) */
        for (int round = 0; round < 40; round++) {
            size_t n = valid_line(fmts[fi], buf);
            both(simd, scalar, buf, n);
            for (size_t pos = 0; pos <= n && pos < 200; pos++)
                for (size_t s = 0; s < sizeof SPECIAL; s++) {
                    char save = buf[pos];
                    buf[pos] = SPECIAL[s];
                    both(simd, scalar, buf, pos == n ? n + 1 : n);
                    buf[n] = '\n';
                    both(simd, scalar, buf, n + 1);
                    buf[pos] = save;
                }
        }
        /* lines of every length 0..130 ending in CRLF, LF or nothing, separators packed at
         * the 16/32/64-byte boundaries */
        for (size_t len = 0; len <= 130; len++)
            for (int tail = 0; tail < 3; tail++) {
                size_t n = valid_line(fmts[fi], buf);
                if (n > len) n = len;
                static const size_t edge[] = {15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 65, 127};
                for (size_t e = 0; e < sizeof edge / sizeof edge[0] && edge[e] < n; e++)
                    buf[edge[e]] = fmts[fi] == DS_FMT_CRITEO ? '\t' : ',';
                if (tail == 1) buf[n++] = '\n';
                if (tail == 2) {
                    buf[n++] = '\r';
                    buf[n++] = '\n';
                }
                both(simd, scalar, buf, n);
            }
        /* many random lines, valid and mutated, in one buffer */
        for (int round = 0; round < 200; round++) {
            size_t n = 0;
            int lines = 1 + (int)(next_rand() % 30);
            for (int l = 0; l < lines; l++) {
                size_t s = n;
                if (next_rand() % 5 == 0) {
                    size_t len = next_rand() % 150;
                    for (size_t i = 0; i < len; i++)
                        buf[n++] = SPECIAL[next_rand() % sizeof SPECIAL];
                } else {
                    n += valid_line(fmts[fi], buf + n);
                    for (int m = (int)(next_rand() % 3); m > 0 && n > s; m--)
                        buf[s + next_rand() % (n - s)] = SPECIAL[next_rand() % sizeof SPECIAL];
                }
                if (l + 1 < lines || next_rand() % 2) {
                    if (next_rand() % 3 == 0) buf[n++] = '\r';
                    buf[n++] = '\n';
                }
            }
            both(simd, scalar, buf, n);
        }
        ds_parser_destroy(simd);
        ds_parser_destroy(scalar);
    }
    free(buf);
}

/* Tokens of length 0..40 in a Criteo categorical field get ds_key(token, len, field). */
static void test_token_keys(void)
{
    ds_parser *p = make(DS_FMT_CRITEO, 0);
    if (!p) return;
    char line[256], tok[64];
    for (size_t len = 0; len <= 40; len++) {
        for (size_t i = 0; i < len; i++)
            tok[i] = (char)('a' + next_rand() % 26);
        int n = snprintf(line, sizeof line, "1\t1\t2\t3\t4\t5\t6\t7\t8\t9\t10\t11\t12\t13\t%.*s\tx",
                         (int)len, tok);
        ds_batch b;
        ds_parse_report rep;
        char *err = NULL;
        CHECK_OK(ds_parser_parse(p, line, (size_t)n, &b, &rep, &err), err);
        CHECK(b.n_rows == 1);
        if (b.n_rows != 1) continue;
        CHECK(b.offsets[1] - b.offsets[0] == (len ? 1u : 0u));
        if (len) CHECK_MSG(b.keys[0] == ds_key(tok, len, 0), "length %zu", len);
        CHECK(b.keys[b.offsets[1]] == XXH3_64bits_withSeed("x", 1, 1));
    }
    ds_parser_destroy(p);
}

/* Numbers read 8 bytes at a time (digits8) against digit by digit (scalar_scan): tokens of
 * 0..17 digits, signed or not, with a byte just outside '0'..'9' (or far from it) at any
 * position, in every dense column (the first ones start too near the line start for an
 * 8-byte read), unquoted and quoted (read from the unescaped copy); plus exact values. */
static void test_numbers(void)
{
    static const char odd[] = {'/',        ':',        ';',        '?', '@',     '.',
                               'e',        'E',        '+',        '-', ' ',     '\x7f',
                               (char)0xb0, (char)0xb9, (char)0xf9, 'a', '0' - 16};
    char *buf = malloc(1 << 16);
    for (int quoted = 0; quoted < 2; quoted++) {
        ds_format fmt = quoted ? DS_FMT_CRITEO_CSV : DS_FMT_CRITEO;
        ds_parser *simd = make(fmt, 0), *scalar = make(fmt, 1);
        if (!simd || !scalar) return;
        int dense = quoted ? 2 : 13, cats = quoted ? 3 : 26;
        for (int round = 0; round < 4000; round++) {
            size_t n = 0;
            if (quoted) n += (size_t)sprintf(buf, "%d,", round);
            n += (size_t)sprintf(buf + n, "%d", round % 2);
            for (int d = 0; d < dense; d++) {
                buf[n++] = quoted ? ',' : '\t';
                if (quoted) buf[n++] = '"';
                size_t t0 = n, len = next_rand() % 18;
                if (next_rand() % 4 == 0) buf[n++] = next_rand() % 2 ? '-' : '+';
                for (size_t i = 0; i < len; i++)
                    buf[n++] = (char)('0' + next_rand() % 10);
                if (n > t0 && next_rand() % 3 == 0)
                    buf[t0 + next_rand() % (n - t0)] = odd[next_rand() % sizeof odd];
                if (quoted) buf[n++] = '"';
            }
            for (int c = 0; c < cats; c++)
                n += (size_t)sprintf(buf + n, "%c%x", quoted ? ',' : '\t', (unsigned)next_rand());
            both(simd, scalar, buf, n);
        }
        ds_parser_destroy(simd);
        ds_parser_destroy(scalar);
    }
    /* exact values, each length 1..15, at the end of a line long enough for 8-byte reads */
    ds_parser *p = make(DS_FMT_CRITEO, 0);
    if (p == NULL) return;
    static const char *const nums[] = {
        "7",        "-7",       "10",        "09",        "-0",
        "123",      "4567",     "89012",     "345678",    "9012345",
        "67890123", "99999999", "100000000", "-12345678", "123456789012345"};
    for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++) {
        int n = sprintf(buf, "1\t1\t22\t333\t4444\t%s", nums[i]);
        for (int c = 5; c < 39; c++)
            n += sprintf(buf + n, "\t%d", c);
        ds_batch b;
        ds_parse_report rep;
        char *err = NULL;
        CHECK_OK(ds_parser_parse(p, buf, (size_t)n, &b, &rep, &err), err);
        CHECK_MSG(b.n_rows == 1 && b.dense[4] == (float)strtod(nums[i], NULL) &&
                      !!signbit(b.dense[4]) == (nums[i][0] == '-'),
                  "%s read as %g", nums[i], b.n_rows ? b.dense[4] : -1.0);
    }
    ds_parser_destroy(p);
    free(buf);
}

/* Ingests text as a plain file (mapped) and as zstd (read) with chunks of `chunk` bytes. */
static void mapped_vs_read(const char *tmp, ds_format fmt, const char *text, size_t n, size_t chunk)
{
    char plain[4200], zst[4200], out1[4200], out2[4200];
    snprintf(plain, sizeof plain, "%s/in.txt", tmp);
    snprintf(zst, sizeof zst, "%s/in.zst", tmp);
    snprintf(out1, sizeof out1, "%s/o1", tmp);
    snprintf(out2, sizeof out2, "%s/o2", tmp);
    write_text(plain, text, n);
    size_t cap = ZSTD_compressBound(n);
    void *z = malloc(cap);
    size_t zn = ZSTD_compress(z, cap, text, n, 1);
    CHECK(!ZSTD_isError(zn));
    write_text(zst, z, zn);
    free(z);
    ds_ingest_result r[2];
    const char *outs[2] = {out1, out2}, *ins[2] = {plain, zst};
    int rcs[2];
    for (int i = 0; i < 2; i++) {
        ds_ingest_opts o;
        ds_ingest_opts_init(&o);
        o.parser.format = fmt;
        o.inputs = &ins[i];
        o.n_inputs = 1;
        o.out_dir = outs[i];
        o.threads = 2;
        o.chunk_bytes = chunk;
        o.block_rows = 7;
        o.log = fopen("/dev/null", "w");
        char *err = NULL;
        rcs[i] = ds_ingest_run(&o, &r[i], &err);
        free(err);
        fclose(o.log);
    }
    CHECK_MSG(rcs[0] == rcs[1], "chunk %zu: rc %d vs %d", chunk, rcs[0], rcs[1]);
    if (rcs[0] != 0 || rcs[1] != 0) return;
    CHECK_MSG(r[0].rows_in == r[1].rows_in && r[0].rows_written == r[1].rows_written &&
                  r[0].bytes_in == r[1].bytes_in && r[0].bytes_in == n &&
                  memcmp(r[0].rejected_by_reason, r[1].rejected_by_reason,
                         sizeof r[0].rejected_by_reason) == 0,
              "chunk %zu: rows %llu/%llu bytes %llu/%llu", chunk, (unsigned long long)r[0].rows_in,
              (unsigned long long)r[1].rows_in, (unsigned long long)r[0].bytes_in,
              (unsigned long long)r[1].bytes_in);
    CHECK_MSG(same_file(join(out1, "train/part-00000.shard"), join(out2, "train/part-00000.shard")),
              "chunk %zu: shards differ", chunk);
    CHECK(same_file(join(out1, "stats.json"), join(out2, "stats.json")));
}

static void test_mapped_input(void)
{
    const char *tmp = check_tmpdir("ds_scan");
    char *buf = malloc(1 << 16);
    for (int variant = 0; variant < 4; variant++) {
        size_t n = 0;
        ds_format fmt = variant < 2 ? DS_FMT_CRITEO : DS_FMT_CRITEO_CSV;
        if (fmt == DS_FMT_CRITEO_CSV) n += (size_t)sprintf(buf, "Id,Label,I1,I2,C1,C2,C3\r\n");
        for (int l = 0; l < 60; l++) {
            n += valid_line(fmt, buf + n);
            if (l == 30) { /* one over-long line in the middle */
                memset(buf + n, 'z', 300);
                n += 300;
            }
            buf[n++] = '\n';
        }
        if (variant % 2) { /* an over-long last line without a line end */
            memset(buf + n, 'y', 200);
            n += 200;
        } else {
            n += valid_line(fmt, buf + n); /* a last line without a line end */
        }
        for (size_t chunk = 64; chunk <= 400; chunk += 17)
            mapped_vs_read(tmp, fmt, buf, n, chunk);
        /* a file of exactly one chunk, with and without a line end at its end */
        mapped_vs_read(tmp, fmt, buf, n, n);
        mapped_vs_read(tmp, fmt, buf, n, n + 1);
    }
    free(buf);
}

/* --strict stopping at a bad line of a mapped file while workers still parse later chunks:
 * the mapping must outlive them (ASan / a crash would tell). */
static void test_mapped_strict(void)
{
    const char *tmp = check_tmpdir("ds_scan_strict");
    size_t cap = 4 << 20, n = 0;
    char *buf = malloc(cap);
    for (int l = 0; n + 600 < cap; l++) {
        n += valid_line(DS_FMT_CRITEO, buf + n);
        if (l == 50) buf[n++] = '\x01'; /* junk: the first malformed line */
        buf[n++] = '\n';
    }
    char *path = join(tmp, "in.tsv");
    write_text(path, buf, n);
    free(buf);
    for (int round = 0; round < 5; round++) {
        ds_ingest_opts o;
        ds_ingest_opts_init(&o);
        o.parser.format = DS_FMT_CRITEO;
        const char *in = path;
        o.inputs = &in;
        o.n_inputs = 1;
        o.out_dir = join(tmp, "out");
        o.threads = 3;
        o.chunk_bytes = 4096;
        o.strict = 1;
        o.log = fopen("/dev/null", "w");
        ds_ingest_result r;
        char *err = NULL;
        CHECK(ds_ingest_run(&o, &r, &err) == CM_ECORRUPT);
        free(err);
        fclose(o.log);
    }
}

int main(void)
{
    test_tokenizer();
    test_numbers();
    test_token_keys();
    test_mapped_input();
    test_mapped_strict();
    return check_done();
}
