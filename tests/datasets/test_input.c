/* Compressed inputs: a file of several gzip members or zstd frames is read whole, and bytes that
 * are not a complete member or frame (trailing garbage, a damaged second header, a cut file)
 * fail the ingest naming the file and the byte offset where that member or frame starts.
 * zlib's gzread ended the input quietly at a second member whose header was damaged, so its
 * rows were lost with exit status 0; each case below failed before the fix. */
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include "ds_test_util.h"
#include "rng.h"

typedef struct bytes {
    uint8_t *p;
    size_t n, cap;
} bytes;

static void put(bytes *b, const void *p, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2;
        b->p = realloc(b->p, b->cap);
        if (b->p == NULL) {
            fprintf(stderr, "out of memory\n");
            exit(2);
        }
    }
    if (n) memcpy(b->p + b->n, p, n);
    b->n += n;
}

/* n libsvm rows of random features (random enough that the compressed form spans several of
 * the reader's input buffers when n is large). */
static char *libsvm_rows(size_t n, size_t *len)
{
    bytes b = {0};
    for (size_t i = 0; i < n; i++) {
        char line[96];
        int k = snprintf(line, sizeof line, "%u %u:%.6f %u:1\n", rndu(2), 1 + rndu(1000000),
                         unif(0, 1), 1000001 + rndu(1000000));
        put(&b, line, (size_t)k);
    }
    put(&b, "", 1);
    *len = b.n - 1;
    return (char *)b.p;
}

/* Appends one gzip member holding text. */
static void gz_unit(bytes *b, const char *text, size_t n)
{
    z_stream s = {0};
    if (deflateInit2(&s, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK) exit(2);
    uLong bound = deflateBound(&s, (uLong)n);
    uint8_t *out = malloc(bound);
    s.next_in = (Bytef *)text;
    s.avail_in = (uInt)n;
    s.next_out = out;
    s.avail_out = (uInt)bound;
    if (out == NULL || deflate(&s, Z_FINISH) != Z_STREAM_END) exit(2);
    put(b, out, s.total_out);
    deflateEnd(&s);
    free(out);
}

/* Appends one zstd frame holding text. */
static void zstd_unit(bytes *b, const char *text, size_t n)
{
    size_t bound = ZSTD_compressBound(n);
    uint8_t *out = malloc(bound);
    size_t m = out ? ZSTD_compress(out, bound, text, n, 3) : 0;
    if (out == NULL || ZSTD_isError(m)) exit(2);
    put(b, out, m);
    free(out);
}

typedef struct codec {
    const char *name, *unit; /* as the error messages call them */
    void (*append)(bytes *b, const char *text, size_t n);
} codec;

static const char *tmp;

/* Ingests the bytes as the libsvm file tmp/name; returns the status, *err its message. */
static int ingest_bytes(const char *name, const bytes *b, ds_ingest_result *r, char **err)
{
    char out[64];
    snprintf(out, sizeof out, "out_%s", name);
    write_text(join(tmp, name), b->p, b->n);
    const char *inputs[1] = {join(tmp, name)};
    memset(r, 0, sizeof *r);
    return ingest_files(DS_FMT_LIBSVM, NULL, inputs, 1, join(tmp, out), 1, r, err);
}

/* The bytes must be refused as corrupt with a message naming the file, the codec, its unit and
 * "starting at byte off" (exactly that number). */
static void expect_refused(const codec *c, const char *name, const bytes *b, uint64_t off)
{
    ds_ingest_result r;
    char *err = NULL, want[64];
    int rc = ingest_bytes(name, b, &r, &err);
    const char *msg = err ? err : "(none)";
    snprintf(want, sizeof want, "starting at byte %llu", (unsigned long long)off);
    const char *at = strstr(msg, want);
    int named = strstr(msg, join(tmp, name)) && strstr(msg, c->name) && strstr(msg, c->unit) &&
                at && !(at[strlen(want)] >= '0' && at[strlen(want)] <= '9');
    CHECK_MSG(rc == CM_ECORRUPT && named,
              "%s: rc=%d (rows_in %llu) err=%s; want CM_ECORRUPT naming the file and '%s'", name,
              rc, (unsigned long long)r.rows_in, msg, want);
    free(err);
}

static void test_codec(const codec *c)
{
    size_t na, nb, nc;
    char *ta = libsvm_rows(3, &na), *tb = libsvm_rows(40000, &nb), *tc = libsvm_rows(5, &nc);
    bytes a = {0}, bb = {0}, cc = {0}, empty = {0};
    c->append(&a, ta, na);
    c->append(&bb, tb, nb);
    c->append(&cc, tc, nc);
    c->append(&empty, "", 0);
    char name[64];
#define NAME(what) (snprintf(name, sizeof name, "%s_%s", c->name, what), name)

    /* several units (one empty, one larger than the reader's buffers) are read whole */
    bytes f = {0};
    put(&f, a.p, a.n);
    put(&f, bb.p, bb.n);
    put(&f, empty.p, empty.n);
    put(&f, cc.p, cc.n);
    ds_ingest_result r;
    char *err = NULL;
    CHECK_OK(ingest_bytes(NAME("multi"), &f, &r, &err), err);
    CHECK_MSG(r.rows_in == 40008 && r.bytes_in == na + nb + nc, "%s: rows_in %llu bytes_in %llu",
              name, (unsigned long long)r.rows_in, (unsigned long long)r.bytes_in);

    /* text after the last unit */
    f.n = 0;
    put(&f, a.p, a.n);
    put(&f, bb.p, bb.n);
    put(&f, "1 2:3\n1 4:5\n", 12);
    expect_refused(c, NAME("trailing_text"), &f, a.n + bb.n);

    /* zero padding after the last unit (as tape and block tools leave) */
    f.n = 0;
    put(&f, a.p, a.n);
    uint8_t zeros[600] = {0};
    put(&f, zeros, sizeof zeros);
    expect_refused(c, NAME("trailing_zeros"), &f, a.n);

    /* one stray byte, the first of the magic */
    f.n = 0;
    put(&f, a.p, a.n);
    put(&f, cc.p, 1);
    expect_refused(c, NAME("trailing_byte"), &f, a.n);

    /* a second unit whose magic is damaged, after a small and after a large first unit */
    for (int big = 0; big < 2; big++) {
        const bytes *first = big ? &bb : &a;
        f.n = 0;
        put(&f, first->p, first->n);
        size_t at = f.n;
        put(&f, cc.p, cc.n);
        f.p[at] ^= 0x40;
        expect_refused(c, NAME(big ? "damaged_magic_big" : "damaged_magic"), &f, first->n);
        /* the byte after the magic (gzip: the method; zstd: the frame header descriptor) */
        f.p[at] ^= 0x40;
        f.p[at + (c->name[0] == 'g' ? 2 : 4)] = 0xff;
        expect_refused(c, NAME(big ? "damaged_header_big" : "damaged_header"), &f, first->n);
    }

    /* cut inside the second unit, and inside the last bytes of the only unit */
    f.n = 0;
    put(&f, a.p, a.n);
    put(&f, bb.p, bb.n / 2);
    expect_refused(c, NAME("cut_second"), &f, a.n);
    f.n = 0;
    put(&f, bb.p, bb.n - 1);
    expect_refused(c, NAME("cut_end"), &f, 0);
#undef NAME
    free(ta);
    free(tb);
    free(tc);
    free(a.p);
    free(bb.p);
    free(cc.p);
    free(empty.p);
    free(f.p);
}

/* Appends a zstd skippable frame (magic 0x184D2A5n) carrying n bytes of data, as pzstd writes
 * before every frame. */
static void zstd_skippable(bytes *b, uint8_t nibble, const void *data, uint32_t n)
{
    uint8_t hdr[8] = {(uint8_t)(0x50 | nibble), 0x2a, 0x4d, 0x18};
    memcpy(hdr + 4, &n, 4);
    put(b, hdr, sizeof hdr);
    put(b, data, n);
}

/* A zstd file that starts with a skippable frame (what pzstd writes: one before every frame)
 * was taken for plain text, since only the frame magic 28 b5 2f fd told zstd apart: its bytes
 * were parsed as lines, every row rejected, exit status 0. It is read as zstd, skipping the
 * skippable frames wherever they are. */
static void test_zstd_skippable(void)
{
    size_t na, nb;
    char *ta = libsvm_rows(3, &na), *tb = libsvm_rows(40000, &nb);
    bytes f = {0};
    uint32_t size = (uint32_t)na;
    zstd_skippable(&f, 0, &size, 4);
    zstd_unit(&f, ta, na);
    zstd_skippable(&f, 0xf, "pzstd", 5);
    zstd_unit(&f, tb, nb);
    ds_ingest_result r;
    char *err = NULL;
    CHECK_OK(ingest_bytes("zstd_skippable", &f, &r, &err), err);
    CHECK_MSG(r.rows_in == 40003 && r.rows_rejected == 0 && r.bytes_in == na + nb,
              "zstd after a skippable frame: rows_in %llu, rejected %llu, bytes_in %llu",
              (unsigned long long)r.rows_in, (unsigned long long)r.rows_rejected,
              (unsigned long long)r.bytes_in);
    /* a skippable frame cut short is a cut frame, not text */
    f.n = 6;
    expect_refused(&(codec){"zstd", "frame", zstd_unit}, "zstd_skippable_cut", &f, 0);
    free(ta);
    free(tb);
    free(f.p);
}

static void plain_unit(bytes *b, const char *text, size_t n)
{
    put(b, text, n);
}

/* The codec was told from the first bytes with pread, which a pipe refuses: a gzip or zstd
 * stream on a pipe (`ember ingest ... /dev/stdin < x.gz`, `<(cat x.zst)`) was parsed as plain
 * text, every line a junk reject, exit status 0. A pipe's first bytes are now read and given
 * back to the decoder (or, for plain text, to the lines). */
static void test_pipe(void)
{
    static const codec codecs[] = {
        {"plain", "", plain_unit}, {"gzip", "member", gz_unit}, {"zstd", "frame", zstd_unit}};
    size_t n;
    char *text = libsvm_rows(200, &n); /* well within a pipe's buffer */
    for (size_t i = 0; i < sizeof codecs / sizeof codecs[0]; i++) {
        bytes b = {0};
        codecs[i].append(&b, text, n);
        int fds[2];
        if (pipe(fds) != 0 || write(fds[1], b.p, b.n) != (ssize_t)b.n) {
            CHECK(0);
            return;
        }
        close(fds[1]);
        char in[64], out[64];
        snprintf(in, sizeof in, "/dev/fd/%d", fds[0]);
        snprintf(out, sizeof out, "out_pipe_%s", codecs[i].name);
        const char *inputs[1] = {in};
        ds_ingest_result r;
        char *err = NULL;
        int rc = ingest_files(DS_FMT_LIBSVM, NULL, inputs, 1, join(tmp, out), 1, &r, &err);
        CHECK_MSG(rc == CM_OK && r.rows_in == 200 && r.rows_written == 200 && r.bytes_in == n,
                  "%s on a pipe: rc %d, rows_in %llu, written %llu, bytes_in %llu: %s",
                  codecs[i].name, rc, (unsigned long long)r.rows_in,
                  (unsigned long long)r.rows_written, (unsigned long long)r.bytes_in,
                  err ? err : "");
        free(err);
        close(fds[0]);
        free(b.p);
    }
    free(text);
}

int main(void)
{
    rng_state = 0x1f8b28b5;
    tmp = check_tmpdir("ds_input");
    static const codec gz = {"gzip", "member", gz_unit}, zst = {"zstd", "frame", zstd_unit};
    test_codec(&gz);
    test_codec(&zst);
    test_zstd_skippable();
    test_pipe();
    return check_done();
}
