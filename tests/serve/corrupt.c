/*
 * serve_corrupt: a damaged bundle is refused by ember_serve_open with a message naming the file,
 * never served and never a crash (this test also runs under ASan + UBSan, which also checks that
 * the failure paths leak nothing).
 *   - flipped bytes in table-emb.bin (header, index, rows, trailer) and dense-tower.bin;
 *   - every byte of the MANIFEST up to its checksum flipped, one at a time; bytes after its
 *     checksum line (which must be the last);
 *   - truncated and empty files, missing files, a missing bundle;
 *   - edited MANIFEST values, with the old checksum and with a recomputed one (a consistent
 *     manifest that lies about sizes, digests, rows or tables);
 *   - table and model files rewritten with valid checksums but impossible contents (an index
 *     entry past the rows, a wrong row count, a model whose tower does not fit, a model text
 *     the model code refuses: named by the bundle's folder and file, not as "model config";
 *     a model whose input width (fields x dim + dense) wraps 32 bits, its tower sized to match);
 *   - `ember predict` on a damaged bundle exits 1 naming the file.
 * And on a good bundle: keys it does not hold read as zeros with found = 0; bad table indices
 * are refused.
 */
#include "serve_util.h"

static char *good_manifest;
static size_t good_manifest_len;

static int write_file(const char *path, const void *buf, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (f == NULL) return -1;
    int ok = fwrite(buf, 1, len, f) == len;
    return fclose(f) == 0 && ok ? 0 : -1;
}

static void fresh_copy(void)
{
    int rc = su_shell(30, "rm -rf bad && cp -r good bad");
    CHECK_MSG(rc == 0, "copying the bundle: exit %d", rc);
}

/* Opening bad must fail with a message holding needle. */
static void expect_refused(const char *what, const char *needle)
{
    ember_serve *h = NULL;
    char *err = NULL;
    int rc = ember_serve_open(su_path("bad"), &h, &err);
    CHECK_MSG(rc != 0, "%s: the damaged bundle was opened", what);
    CHECK_MSG(rc == 0 || h == NULL, "%s: *out set on failure", what);
    CHECK_MSG(rc == 0 || (err && strstr(err, needle)), "%s: message '%s' does not name '%s'", what,
              err ? err : "(none)", needle);
    if (rc == 0) ember_serve_close(h);
    free(err);
}

static int quiet; /* many flips: print only failures */

static void flip(const char *file, long off, uint8_t mask, const char *needle)
{
    char path[8400];
    snprintf(path, sizeof path, "%s/bad/%s", su_dir, file);
    size_t len = 0;
    char *b = su_slurp(path, &len);
    CHECK_MSG(b != NULL, "read %s", path);
    if (b == NULL) return;
    size_t at = off < 0 ? len + (size_t)off : (size_t)off;
    CHECK(at < len);
    if (at >= len) {
        free(b);
        return;
    }
    b[at] ^= (char)mask;
    CHECK(write_file(path, b, len) == 0);
    char what[256];
    snprintf(what, sizeof what, "%s byte %zu ^ 0x%02x", file, at, mask);
    if (!quiet) fprintf(stderr, "    %s\n", what);
    expect_refused(what, needle);
    b[at] ^= (char)mask; /* restore */
    CHECK(write_file(path, b, len) == 0);
    free(b);
}

static void truncate_to(const char *file, long keep, const char *needle)
{
    fresh_copy();
    char path[8400];
    snprintf(path, sizeof path, "%s/bad/%s", su_dir, file);
    size_t len = 0;
    char *b = su_slurp(path, &len);
    if (b == NULL) return;
    size_t k = keep < 0 ? len + (size_t)keep : (size_t)keep;
    CHECK(write_file(path, b, k) == 0);
    free(b);
    char what[256];
    snprintf(what, sizeof what, "%s truncated to %zu of %zu bytes", file, k, len);
    fprintf(stderr, "    %s\n", what);
    expect_refused(what, needle);
}

static void missing(const char *file, const char *needle)
{
    fresh_copy();
    char path[8400];
    snprintf(path, sizeof path, "%s/bad/%s", su_dir, file);
    CHECK(unlink(path) == 0);
    char what[256];
    snprintf(what, sizeof what, "%s missing", file);
    fprintf(stderr, "    %s\n", what);
    expect_refused(what, needle);
}

/* text with its first `from` replaced by `to`, with room for `extra` more bytes (heap); NULL
 * when text lacks `from` (reported). */
static char *replaced(const char *text, const char *from, const char *to, size_t extra)
{
    const char *p = strstr(text, from);
    CHECK_MSG(p != NULL, "'%s' not found", from);
    if (p == NULL) return NULL;
    char *m = malloc(strlen(text) + strlen(to) + extra + 1);
    size_t at = (size_t)(p - text);
    memcpy(m, text, at);
    strcpy(m + at, to);
    strcat(m, p + strlen(from));
    return m;
}

/* Replaces the first `from` in the MANIFEST with `to`; with resign, recomputes the checksum
 * line so the manifest is self-consistent. */
static void edit_manifest(const char *from, const char *to, int resign, const char *needle)
{
    fresh_copy();
    char *m = replaced(good_manifest, from, to, 64);
    if (m == NULL) return;
    if (resign) {
        char *cl = strstr(m, "checksum ");
        if (cl) sprintf(cl, "checksum %016llx\n", (unsigned long long)cm_xxh3(m, (size_t)(cl - m)));
    }
    CHECK(write_file(su_path("bad/MANIFEST"), m, strlen(m)) == 0);
    char what[256];
    snprintf(what, sizeof what, "MANIFEST '%s' -> '%s'%s", from, to, resign ? " (re-signed)" : "");
    fprintf(stderr, "    %s\n", what);
    expect_refused(what, needle);
    free(m);
}

/* Rewrites bad/<file> (already modified in buf, possibly to another length) with a valid xxh3
 * trailer when trailer is set, and re-signs the MANIFEST to match (size and digest), so only
 * the contents' own checks can refuse it. */
static void rewrite_signed(const char *file, char *buf, size_t len, int trailer)
{
    if (trailer) {
        uint64_t d = cm_xxh3(buf, len - 8);
        memcpy(buf + len - 8, &d, 8);
    }
    char path[8400];
    snprintf(path, sizeof path, "%s/bad/%s", su_dir, file);
    CHECK(write_file(path, buf, len) == 0);
    char *m = su_slurp(su_path("bad/MANIFEST"), NULL);
    char line[256];
    snprintf(line, sizeof line, "file %s ", file);
    char *l = m ? strstr(m, line) : NULL;
    CHECK(l != NULL);
    if (l == NULL) {
        free(m);
        return;
    }
    /* "file NAME SIZE DIGEST\n": replace the digest (16 hex digits before the newline) */
    /* "file NAME SIZE DIGEST\n": the line rebuilt with the new size and digest */
    char *nl = strchr(l, '\n');
    size_t at = (size_t)(l - m), mlen = strlen(m);
    char *out = malloc(mlen + 64);
    memcpy(out, m, at);
    int k =
        sprintf(out + at, "file %s %zu %016llx", file, len, (unsigned long long)cm_xxh3(buf, len));
    strcpy(out + at + (size_t)k, nl);
    char *cl = strstr(out, "checksum ");
    sprintf(cl, "checksum %016llx\n", (unsigned long long)cm_xxh3(out, (size_t)(cl - out)));
    CHECK(write_file(su_path("bad/MANIFEST"), out, strlen(out)) == 0);
    free(out);
    free(m);
}

/* Lookups on the good bundle against the rows read straight from table-emb.bin (the documented
 * layout): hits and misses shuffled together, in calls of every size from 1 to 40 keys and in
 * one call of all; absent keys read as zeros with found = 0. */
static void absent_keys(const char *tab, size_t tab_len)
{
    fprintf(stderr, "--- lookups vs the table file; absent keys\n");
    ember_serve *h = su_open(su_path("good"), NULL);
    if (h == NULL) return;
    int t = ember_serve_table(h, "emb");
    CHECK(t >= 0 && ember_serve_table(h, "nope") == -1);
    if (t < 0) {
        ember_serve_close(h);
        return;
    }
    uint32_t dim = ember_serve_table_dim(h, t);
    su_tab_hdr th;
    memcpy(&th, tab, sizeof th);
    CHECK(th.dim == dim && th.row_bytes == 4 * dim && tab_len > 64 + th.slots * 16);
    const char *data = tab + 64 + th.slots * 16;
    enum { N = 6000 };
    uint64_t *keys = malloc(N * 8);
    float *want = calloc((size_t)N * dim, sizeof(float));
    uint8_t *want_found = calloc(N, 1);
    uint64_t x = 99, s = 0;
    for (int i = 0; i < N; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        if ((x >> 60) & 1) { /* a hit: the next used slot */
            for (uint32_t row = UINT32_MAX; row == UINT32_MAX; s = (s + 1 + (x >> 40) % 7) % th.slots) {
                memcpy(&row, tab + 64 + s * 16 + 8, 4);
                if (row != UINT32_MAX) {
                    memcpy(&keys[i], tab + 64 + s * 16, 8);
                    memcpy(want + (size_t)i * dim, data + (size_t)row * 4 * dim, 4 * dim);
                    want_found[i] = 1;
                }
            }
        } else {
            keys[i] = x ^ 0x5bd1e995ull; /* random 64-bit keys: absent (checked below) */
        }
    }
    keys[1] = want_found[1] ? keys[1] : 0;
    keys[3] = want_found[3] ? keys[3] : UINT64_MAX;
    float *out = malloc((size_t)N * dim * sizeof(float));
    uint8_t *found = malloc(N);
    for (int pass = 0; pass < 2; pass++) {
        memset(out, 0xff, (size_t)N * dim * sizeof(float)); /* NaNs */
        memset(found, 9, N);
        int rc = 0;
        if (pass == 0)
            rc = ember_serve_lookup(h, t, keys, N, out, found);
        for (size_t i = 0, c = 1; pass == 1 && rc == 0 && i < N; i += c, c = c % 40 + 1) {
            size_t k = N - i < c ? N - i : c;
            rc = ember_serve_lookup(h, t, keys + i, k, out + i * dim, found + i);
        }
        CHECK(rc == 0);
        size_t bad = 0, hits = 0;
        for (int i = 0; i < N; i++) {
            hits += want_found[i];
            if (found[i] != want_found[i] ||
                memcmp(out + (size_t)i * dim, want + (size_t)i * dim, dim * sizeof(float)) != 0) {
                if (bad++ < 5)
                    fprintf(stderr, "    key %d: found %d (want %d), value %g (want %g)\n", i,
                            found[i], want_found[i], (double)out[(size_t)i * dim],
                            (double)want[(size_t)i * dim]);
            }
        }
        fprintf(stderr, "    %s: %d keys, %zu hits, %zu wrong\n",
                pass ? "calls of 1..40 keys" : "one call", N, hits, bad);
        CHECK_MSG(bad == 0 && hits > N / 4 && hits < N * 3 / 4, "%zu wrong of %d (%zu hits)", bad,
                  N, hits);
    }
    /* found may be NULL; n = 0 writes nothing; bad tables are refused */
    memset(out, 0xff, (size_t)N * dim * sizeof(float));
    CHECK(ember_serve_lookup(h, t, keys, N, out, NULL) == 0);
    CHECK(memcmp(out, want, (size_t)N * dim * sizeof(float)) == 0);
    float one = 5.0f;
    CHECK(ember_serve_lookup(h, t, keys, 0, &one, NULL) == 0 && one == 5.0f);
    CHECK(ember_serve_lookup(h, -1, keys, 1, out, found) != 0);
    CHECK(ember_serve_lookup(h, 7, keys, 1, out, found) != 0);
    free(keys);
    free(want);
    free(want_found);
    free(out);
    free(found);
    ember_serve_close(h);
}

/* A consistent lie no checksum catches: a model whose top MLP input (fields x dim + dense) is
 * past 2^32, with a tower sized for that count wrapped to 32 bits (4194304 x 1024 + 1 is 1:
 * two values). Opened, predict pooled 2^32 floats a row into a buffer of two. */
static void wrapped_layout(void)
{
    fprintf(stderr, "--- a model whose input width wraps 32 bits\n");
    static const char model[] = "kind mlp\nfields 4194304\ndense 1\ndim 1024\nhidden -\n"
                                "bottom -\nseed 1\npool sum\n";
    static const float tower[2] = {0.5f, 0.25f};
    const uint64_t key = 1;
    float *row = calloc(1024, sizeof *row);
    ember_serve_writer *w = NULL;
    char *err = NULL;
    int rc = ember_serve_writer_create(su_path("bad"), EMBER_SERVE_FP32, 0, 1, 0, &w, &err);
    if (rc == 0) rc = ember_serve_writer_model(w, model, &err);
    if (rc == 0) rc = ember_serve_writer_dense(w, tower, 2, &err);
    if (rc == 0) rc = ember_serve_writer_table(w, "emb", 1024, &key, row, 1, NULL, 0, &err);
    if (rc == 0) {
        rc = ember_serve_writer_commit(w, &err);
        w = NULL;
    }
    ember_serve_writer_abort(w);
    free(row);
    const int written = rc == 0;
    CHECK_OK(rc, err);
    if (written) expect_refused("fields 4194304 x dim 1024 + 1 dense", "bad/model.txt");
}

int main(void)
{
    if (su_init("serve_corrupt") != 0) return check_done();
    if (su_make_data(20000, 3) != 0 || su_train("mlp") != 0) return check_done();
    int rc = su_ember("export --checkpoint run-mlp --out good");
    CHECK(rc == 0);
    if (rc != 0) return check_done();
    good_manifest = su_slurp(su_path("good/MANIFEST"), &good_manifest_len);
    CHECK(good_manifest != NULL);
    if (good_manifest == NULL) return check_done();
    size_t tab_len = 0, dns_len = 0;
    char *tab = su_slurp(su_path("good/table-emb.bin"), &tab_len);
    char *dns = su_slurp(su_path("good/dense-tower.bin"), &dns_len);
    CHECK(tab && dns && tab_len > 4096 && dns_len > 64);
    if (!tab || !dns) return check_done();
    su_tab_hdr th;
    memcpy(&th, tab, sizeof th);
    long index_at = 64, rows_at = 64 + (long)th.slots * 16;

    fprintf(stderr, "--- flipped bytes\n");
    fresh_copy();
    const long tab_offs[] = {0, 7, 8, 12, 16, 20, 24, 32, 40, 48, 56, 63, index_at, index_at + 8,
                             index_at + (long)th.slots * 8 + 3, rows_at, rows_at + 1,
                             (rows_at + (long)tab_len) / 2, -9, -8, -1};
    for (size_t i = 0; i < sizeof tab_offs / sizeof *tab_offs; i++) {
        flip("table-emb.bin", tab_offs[i], 0x01, "table-emb.bin");
        flip("table-emb.bin", tab_offs[i], 0x80, "table-emb.bin");
    }
    const long dns_offs[] = {0, 8, 12, 16, 23, 24, 25, (long)dns_len / 2, -9, -8, -1};
    for (size_t i = 0; i < sizeof dns_offs / sizeof *dns_offs; i++) {
        flip("dense-tower.bin", dns_offs[i], 0x01, "dense-tower.bin");
        flip("dense-tower.bin", dns_offs[i], 0xff, "dense-tower.bin");
    }
    flip("model.txt", 0, 0x01, "model.txt");
    flip("model.txt", -1, 0x20, "model.txt");
    /* every MANIFEST byte up to the end of the checksum's hex digits (what follows it, the final
     * newline, is outside what the checksum covers and carries no meaning) */
    const char *cl = strstr(good_manifest, "checksum ");
    CHECK(cl != NULL);
    size_t signed_end = cl ? (size_t)(cl - good_manifest) + 9 + 16 : 0;
    fprintf(stderr, "    MANIFEST bytes 0..%zu flipped one at a time (^0x01, ^0x40)\n", signed_end - 1);
    quiet = 1;
    for (size_t i = 0; i < signed_end; i++) {
        flip("MANIFEST", (long)i, 0x01, "MANIFEST");
        flip("MANIFEST", (long)i, 0x40, "MANIFEST");
    }
    quiet = 0;
    /* Bytes after the checksum line are damage too: a stray byte, and lines that would lie about
     * the bundle were they read (the checksum line must be the last). */
    {
        static const char *const tails[] = {"x", "\n", "type delta\n",
                                            "table ghost 16 3\nchecksum 0000000000000000\n"};
        for (size_t i = 0; i < sizeof tails / sizeof *tails; i++) {
            fresh_copy();
            char *m = malloc(good_manifest_len + strlen(tails[i]) + 1);
            memcpy(m, good_manifest, good_manifest_len);
            memcpy(m + good_manifest_len, tails[i], strlen(tails[i]) + 1);
            CHECK(write_file(su_path("bad/MANIFEST"), m, strlen(m)) == 0);
            char what[128];
            snprintf(what, sizeof what, "MANIFEST with %zu bytes after its checksum line",
                     strlen(tails[i]));
            fprintf(stderr, "    %s\n", what);
            expect_refused(what, "MANIFEST");
            free(m);
        }
    }

    fprintf(stderr, "--- truncated, empty and missing files\n");
    truncate_to("table-emb.bin", -1, "table-emb.bin");
    truncate_to("table-emb.bin", rows_at, "table-emb.bin");
    truncate_to("table-emb.bin", 32, "table-emb.bin");
    truncate_to("table-emb.bin", 0, "table-emb.bin");
    truncate_to("dense-tower.bin", -4, "dense-tower.bin");
    truncate_to("dense-tower.bin", 0, "dense-tower.bin");
    truncate_to("model.txt", 0, "model.txt");
    truncate_to("MANIFEST", -10, "MANIFEST");
    truncate_to("MANIFEST", (long)(cl - good_manifest), "MANIFEST");
    truncate_to("MANIFEST", 0, "MANIFEST");
    missing("table-emb.bin", "table-emb.bin");
    missing("dense-tower.bin", "dense-tower.bin");
    missing("model.txt", "model.txt");
    missing("MANIFEST", "MANIFEST");
    {
        ember_serve *h = NULL;
        char *err = NULL;
        CHECK(ember_serve_open(su_path("no-such-bundle"), &h, &err) != 0 && h == NULL);
        CHECK_MSG(err && strstr(err, "no-such-bundle"), "missing bundle: %s", err ? err : "(none)");
        free(err);
    }

    fprintf(stderr, "--- edited MANIFEST values\n");
    char rows_line[128], rows_bad[128], size_line[128], size_bad[128];
    snprintf(rows_line, sizeof rows_line, "table emb 16 %llu\n", (unsigned long long)th.rows);
    snprintf(rows_bad, sizeof rows_bad, "table emb 16 %llu\n", (unsigned long long)th.rows - 1);
    snprintf(size_line, sizeof size_line, "file table-emb.bin %zu ", tab_len);
    snprintf(size_bad, sizeof size_bad, "file table-emb.bin %zu ", tab_len + 64);
    char step_line[64], step_bad[64];
    snprintf(step_line, sizeof step_line, "\nstep %llu\n", (unsigned long long)th.step);
    snprintf(step_bad, sizeof step_bad, "\nstep %llu\n", (unsigned long long)th.step + 1);
    edit_manifest(step_line, step_bad, 0, "MANIFEST");
    edit_manifest(step_line, step_bad, 1, "table-emb.bin"); /* the table says which step it is */
    edit_manifest("base_step 0", "base_step 1", 0, "MANIFEST");
    edit_manifest("precision fp32", "precision fp16", 0, "MANIFEST");
    edit_manifest(rows_line, rows_bad, 0, "MANIFEST");
    edit_manifest(rows_line, rows_bad, 1, "MANIFEST");
    edit_manifest("table emb 16", "table emb 17", 1, "MANIFEST");
    {
        char more[256];
        snprintf(more, sizeof more, "%stable other 16 5\n", rows_line);
        edit_manifest(rows_line, more, 1, "MANIFEST");
    }
    edit_manifest(size_line, size_bad, 1, "table-emb.bin");
    edit_manifest("file table-emb.bin", "file table-zzz.bin", 1, "table-zzz.bin");
    edit_manifest("file dense-tower.bin", "file dense-towel.bin", 1, "dense-towel.bin");
    edit_manifest("ember-bundle 1", "ember-bundle 2", 1, "MANIFEST");
    {
        /* a file listed twice (re-signed): refused, not mapped a second time over the first
         * (which leaked: the model's copy, the tower's mapping) */
        const char *names[] = {"file dense-tower.bin ", "file model.txt ", "file table-emb.bin "};
        for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
            const char *l = strstr(good_manifest, names[i]);
            const char *nl = l ? strchr(l, '\n') : NULL;
            CHECK(nl != NULL);
            if (nl == NULL) continue;
            char line[256], twice[512];
            snprintf(line, sizeof line, "%.*s", (int)(nl + 1 - l), l);
            snprintf(twice, sizeof twice, "%s%s", line, line);
            edit_manifest(line, twice, 1, "listed twice");
        }
    }
    {
        /* the digest of table-emb.bin, re-signed */
        const char *l = strstr(good_manifest, "file table-emb.bin ");
        const char *nl = l ? strchr(l, '\n') : NULL;
        if (nl) {
            char from[32], to[32];
            memcpy(from, nl - 16, 16);
            from[16] = '\0';
            snprintf(to, sizeof to, "%016llx", (unsigned long long)(strtoull(from, NULL, 16) ^ 1));
            edit_manifest(from, to, 1, "table-emb.bin");
        }
    }

    fprintf(stderr, "--- valid checksums, impossible contents\n");
    {
        /* an index entry pointing past the rows */
        char *b = malloc(tab_len);
        memcpy(b, tab, tab_len);
        uint64_t s = 0;
        for (uint32_t row; s < th.slots; s++) {
            memcpy(&row, b + 64 + s * 16 + 8, 4);
            if (row != UINT32_MAX) break;
        }
        uint32_t past = (uint32_t)th.rows + 3;
        memcpy(b + 64 + s * 16 + 8, &past, 4);
        fresh_copy();
        rewrite_signed("table-emb.bin", b, tab_len, 1);
        fprintf(stderr, "    index slot %llu -> row %u of %llu\n", (unsigned long long)s, past,
                (unsigned long long)th.rows);
        expect_refused("index entry past the rows", "table-emb.bin");
        /* header fields that disagree with the layout */
        const struct { size_t at; uint64_t v; int w; const char *what; } hdr[] = {
            {8, 2, 4, "version 2"},           {12, 15, 4, "dim 15"},
            {16, 3, 4, "precision 3"},        {20, 60, 4, "row_bytes 60"},
            {24, th.rows + 1, 8, "rows + 1"}, {32, th.slots * 2, 8, "slots * 2"},
            {32, th.slots - 1, 8, "slots - 1"}, {32, 0, 8, "slots 0"},
            {40, 1, 8, "deleted 1"},          {40, 1ull << 61, 8, "deleted 2^61"},
            {24, 1ull << 62, 8, "rows 2^62"},
        };
        for (size_t i = 0; i < sizeof hdr / sizeof *hdr; i++) {
            memcpy(b, tab, tab_len);
            memcpy(b + hdr[i].at, &hdr[i].v, (size_t)hdr[i].w);
            fresh_copy();
            rewrite_signed("table-emb.bin", b, tab_len, 1);
            fprintf(stderr, "    table header %s\n", hdr[i].what);
            expect_refused(hdr[i].what, "table-emb.bin");
        }
        free(b);
        /* dense tower with a count that does not match its size */
        b = malloc(dns_len);
        memcpy(b, dns, dns_len);
        uint64_t n = 0;
        memcpy(&n, b + 16, 8);
        n -= 1;
        memcpy(b + 16, &n, 8);
        fresh_copy();
        rewrite_signed("dense-tower.bin", b, dns_len, 1);
        fprintf(stderr, "    dense count - 1\n");
        expect_refused("dense count - 1", "dense-tower.bin");
        /* a count whose size in bytes wraps to the file's (n * 4 mod 2^64): the tower's own
         * check must refuse it, naming the file */
        n += 1 + (1ull << 62);
        memcpy(b + 16, &n, 8);
        fresh_copy();
        rewrite_signed("dense-tower.bin", b, dns_len, 1);
        fprintf(stderr, "    dense count + 2^62\n");
        expect_refused("dense count + 2^62", "dense-tower.bin");
        free(b);
        /* files shorter than their header and trailer, listed with their true size and digest:
         * refused without reading outside the file */
        const struct {
            const char *file;
            const char *src;
            size_t len;
        } tiny[] = {
            {"table-emb.bin", tab, 1},    {"table-emb.bin", tab, 7},    {"table-emb.bin", tab, 40},
            {"table-emb.bin", tab, 71},   {"dense-tower.bin", dns, 1},  {"dense-tower.bin", dns, 7},
            {"dense-tower.bin", dns, 20}, {"dense-tower.bin", dns, 31},
        };
        for (size_t i = 0; i < sizeof tiny / sizeof *tiny; i++) {
            b = malloc(tiny[i].len);
            memcpy(b, tiny[i].src, tiny[i].len);
            fresh_copy();
            rewrite_signed(tiny[i].file, b, tiny[i].len, 0);
            char what[128];
            snprintf(what, sizeof what, "%s of %zu bytes (signed)", tiny[i].file, tiny[i].len);
            fprintf(stderr, "    %s\n", what);
            expect_refused(what, tiny[i].file);
            free(b);
        }
        /* a model whose tower does not fit the file */
        size_t ml = 0;
        char *model = su_slurp(su_path("good/model.txt"), &ml);
        char *hp = model ? strstr(model, "hidden ") : NULL;
        CHECK(hp != NULL);
        if (hp) {
            const char was = hp[7];
            hp[7] = hp[7] == '1' ? '2' : '1'; /* "256,128" -> "156,128" */
            fresh_copy();
            rewrite_signed("model.txt", model, ml, 0);
            fprintf(stderr, "    model.txt hidden edited\n");
            expect_refused("model that does not fit the tower", "tower");
            /* the model's own checks say what is wrong: the message must also say where */
            expect_refused("model that does not fit the tower, named", su_path("bad"));
            hp[7] = was;
        }
        /* model texts the model code refuses (re-signed): named by file, not only as "model
         * config" (a server opening several bundles could not tell which) */
        const struct {
            const char *from, *to;
        } bad_models[] = {
            {"pool ", "type full\npool "}, /* an unknown name */
            {"kind mlp", "kind mlx"},      /* a bad value */
            {"pool ", "dim 2000\npool "},  /* a layout out of range */
        };
        for (size_t i = 0; model && i < sizeof bad_models / sizeof *bad_models; i++) {
            char *edited = replaced(model, bad_models[i].from, bad_models[i].to, 0);
            if (edited == NULL) continue;
            fresh_copy();
            rewrite_signed("model.txt", edited, strlen(edited), 0);
            char what[128];
            snprintf(what, sizeof what, "model.txt '%s' -> '%s'", bad_models[i].from,
                     bad_models[i].to);
            fprintf(stderr, "    %s\n", what);
            expect_refused(what, "bad/model.txt");
            free(edited);
        }
        free(model);
    }

    fprintf(stderr, "--- ember predict on a damaged bundle\n");
    fresh_copy();
    {
        char path[8400];
        snprintf(path, sizeof path, "%s/bad/table-emb.bin", su_dir);
        size_t len = 0;
        char *b = su_slurp(path, &len);
        if (b) {
            b[rows_at + 5] ^= 0x10;
            CHECK(write_file(path, b, len) == 0);
        }
        free(b);
        rc = su_ember("predict --bundle bad --data shards/eval --out p.txt");
        char *err = su_slurp(su_path("err.txt"), NULL);
        CHECK_MSG(rc == 1, "predict on a damaged bundle: exit %d (1 expected, -1 = crash)", rc);
        CHECK_MSG(err && strstr(err, "table-emb.bin"), "predict's message: %s", err ? err : "(none)");
        CHECK(access(su_path("p.txt"), F_OK) != 0);
        free(err);
    }
    /* Every option predict takes is in its --help. */
    rc = su_ember("predict --help");
    char *help = su_slurp(su_path("out.txt"), NULL);
    const char *opts[] = {"--bundle", "--delta", "--data", "--out", "--batch"};
    for (size_t i = 0; i < sizeof opts / sizeof opts[0]; i++)
        CHECK_MSG(rc == 0 && help && strstr(help, opts[i]), "predict --help lacks %s: %s", opts[i],
                  help ? help : "(none)");
    free(help);
    wrapped_layout();
    absent_keys(tab, tab_len);
    free(tab);
    free(dns);
    free(good_manifest);
    return check_done();
}
