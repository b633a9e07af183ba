/* Shard integrity: a round trip through the public writer and reader, then every single-byte
 * flip and every truncation of the file is detected and names the file. */
#include "ds_test_util.h"

static uint64_t rng = 0x1234567887654321ull;
static uint64_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* n rows, 2 dense, 3 fields of 0..3 keys each, with weights. */
static void make_rows(rows_copy *c, size_t n)
{
    memset(c, 0, sizeof *c);
    c->n_dense = 2;
    c->n_fields = 3;
    c->labels = malloc(n * sizeof(float));
    c->dense = malloc(n * 2 * sizeof(float));
    c->offsets = malloc((n * 3 + 1) * sizeof(uint32_t));
    c->keys = malloc(n * 9 * sizeof(uint64_t) + 8);
    c->weights = malloc(n * 9 * sizeof(float) + 4);
    c->offsets[0] = 0;
    for (size_t r = 0; r < n; r++) {
        c->labels[r] = (float)(rnd() % 2);
        c->dense[2 * r] = (float)r;
        c->dense[2 * r + 1] = (float)(rnd() % 1000) / 7.0f;
        for (int f = 0; f < 3; f++) {
            int k = (int)(rnd() % 4);
            for (int j = 0; j < k; j++) {
                c->keys[c->n_keys] = rnd();
                c->weights[c->n_keys++] = (float)(rnd() % 100) / 10.0f;
            }
            c->offsets[r * 3 + f + 1] = (uint32_t)c->n_keys;
        }
    }
    c->n_rows = n;
}

/* Writes the rows of c to a shard at path, appended in uneven batches. */
static void write_rows(const char *path, const ds_schema *s, uint32_t block_rows,
                       const rows_copy *c)
{
    ds_shard_writer *w = NULL;
    char *err = NULL;
    uint32_t nd = s->n_dense, nf = s->n_fields;
    CHECK_OK(ds_shard_writer_create(path, s, block_rows, &w, &err), err);
    for (size_t r0 = 0; w && r0 < c->n_rows;) {
        size_t n = 1 + rnd() % 50;
        if (r0 + n > c->n_rows) n = c->n_rows - r0;
        ds_batch b = {.n_rows = (uint32_t)n,
                      .n_dense = nd,
                      .n_fields = nf,
                      .labels = c->labels + r0,
                      .dense = c->dense + nd * r0,
                      .offsets = c->offsets + nf * r0,
                      .keys = c->keys,
                      .weights = s->has_weights ? c->weights : NULL,
                      .n_keys = c->offsets[nf * (r0 + n)] - c->offsets[nf * r0]};
        CHECK_OK(ds_shard_writer_append(w, &b, &err), err);
        r0 += n;
    }
    if (w) CHECK_OK(ds_shard_writer_commit(w, &err), err);
}

/* Reads path back and compares every value with want (weights only when the schema has them). */
static void check_round_trip(const char *path, const rows_copy *want, int weights)
{
    uint64_t rows = 0;
    char *err = NULL;
    CHECK_OK(ds_shard_verify(path, &rows, &err), err);
    CHECK(rows == want->n_rows);
    rows_copy got = {0};
    read_all(path, &got);
    size_t nf = want->n_fields;
    CHECK(got.n_rows == want->n_rows && got.n_keys == want->n_keys);
    if (got.n_rows == want->n_rows && got.n_keys == want->n_keys) {
        CHECK(memcmp(got.labels, want->labels, want->n_rows * 4) == 0);
        CHECK(memcmp(got.dense, want->dense, want->n_rows * want->n_dense * 4) == 0);
        CHECK(memcmp(got.offsets, want->offsets, (want->n_rows * nf + 1) * 4) == 0);
        CHECK(memcmp(got.keys, want->keys, want->n_keys * 8) == 0);
        if (weights) CHECK(memcmp(got.weights, want->weights, want->n_keys * 4) == 0);
    }
    rows_copy_free(&got);
}

/* Rows that exercise every block coding choice (docs/SHARD_FORMAT.md, block payload): a field
 * of 5 distinct keys (1-byte indices), one of all-distinct keys (plain), a multi-valued one
 * with up to 299 keys a row (2-byte counts, 2-byte indices), one empty except for a row of
 * 70000 keys (4-byte counts), and one of 100 keys a row from 90000 (4-byte indices). */
static void make_dict_rows(rows_copy *c, size_t n)
{
    static const uint32_t per_row_max[5] = {1, 1, 299, 0, 100};
    static const uint64_t pool[5] = {5, 0, 1000, 10, 90000};
    memset(c, 0, sizeof *c);
    c->n_dense = 1;
    c->n_fields = 5;
    size_t cap = n * 401 + 70000;
    c->labels = malloc(n * sizeof(float));
    c->dense = malloc(n * sizeof(float));
    c->offsets = malloc((n * 5 + 1) * sizeof(uint32_t));
    c->keys = malloc(cap * sizeof(uint64_t));
    c->weights = malloc(cap * sizeof(float));
    c->offsets[0] = 0;
    for (size_t r = 0; r < n; r++) {
        c->labels[r] = (float)(r % 2);
        c->dense[r] = (float)r / 3.0f;
        for (int f = 0; f < 5; f++) {
            uint32_t k = f == 2 ? (uint32_t)(rnd() % 300) : per_row_max[f];
            if (f == 3 && r == 7) k = 70000;
            for (uint32_t j = 0; j < k; j++) {
                uint64_t x = pool[f] ? rnd() % pool[f] : rnd();
                c->weights[c->n_keys] = 1.0f;
                c->keys[c->n_keys++] = pool[f] ? x * 0x100000001b3ull + (uint64_t)f : x;
            }
            c->offsets[r * 5 + f + 1] = (uint32_t)c->n_keys;
        }
    }
    c->n_rows = n;
}

static void test_dictionary_coding(const char *tmp)
{
    const char *dn[] = {"d"}, *fn[] = {"few", "unique", "multi", "huge_row", "wide"};
    ds_schema s = {
        .n_dense = 1, .n_fields = 5, .has_label = 1, .dense_names = dn, .field_names = fn};
    rows_copy want;
    make_dict_rows(&want, 2000);
    /* one block, then many small blocks (the tables are reused and resized between blocks) */
    write_rows(join(tmp, "dict1.shard"), &s, 4096, &want);
    check_round_trip(join(tmp, "dict1.shard"), &want, 0);
    write_rows(join(tmp, "dict2.shard"), &s, 37, &want);
    check_round_trip(join(tmp, "dict2.shard"), &want, 0);
    rows_copy_free(&want);
}

/* A shard of another format version is refused by name and version, not misread. */
static void test_version(const char *tmp, const void *orig, size_t len)
{
    unsigned char *copy = malloc(len);
    memcpy(copy, orig, len);
    copy[8] = 1; /* version field, little-endian u32 at offset 8 */
    char *old = join(tmp, "v1.shard");
    write_text(old, copy, len);
    free(copy);
    char *err = NULL;
    CHECK(ds_shard_verify(old, NULL, &err) == CM_ECORRUPT);
    CHECK_MSG(err && strstr(err, old) && strstr(err, "version 1"), "got: %s", err ? err : "-");
    free(err);
}

int main(void)
{
    const char *tmp = check_tmpdir("ds_shard");
    const char *dn[] = {"d0", "d1"}, *fn[] = {"f0", "f1", "f2"};
    ds_schema s = {.n_dense = 2, .n_fields = 3, .has_label = 1, .has_weights = 1,
                   .dense_names = dn, .field_names = fn};
    rows_copy want;
    make_rows(&want, 300);
    char *path = join(tmp, "a.shard");
    ds_shard_writer *w = NULL;
    char *err = NULL;
    uint64_t rows = 0;
    write_rows(path, &s, 64, &want);
    check_round_trip(path, &want, 1);
    test_dictionary_coding(tmp);

    /* every byte flipped, and every truncation, is refused with the file named */
    void *orig;
    size_t len;
    CHECK_OK(cm_read_file(path, &orig, &len, &err), err);
    char *bad = join(tmp, "bad.shard");
    unsigned missed = 0, unnamed = 0, block_named = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char *copy = malloc(len);
        memcpy(copy, orig, len);
        copy[i] ^= (unsigned char)(1u << (i % 8));
        write_text(bad, copy, len);
        free(copy);
        int rc = ds_shard_verify(bad, NULL, &err);
        if (rc != CM_ECORRUPT) missed++;
        if (err == NULL || strstr(err, bad) == NULL) unnamed++;
        if (err && strstr(err, "block")) block_named++;
        free(err);
        err = NULL;
    }
    CHECK_MSG(missed == 0, "%u of %zu byte flips not detected", missed, len);
    CHECK(unnamed == 0);
    CHECK(block_named > len / 2); /* most bytes are block payload, and those name the block */
    missed = 0;
    for (size_t n = 0; n < len; n++) {
        write_text(bad, orig, n);
        if (ds_shard_verify(bad, NULL, &err) != CM_ECORRUPT) missed++;
        free(err);
        err = NULL;
    }
    CHECK_MSG(missed == 0, "%u truncations not detected", missed);
    test_version(tmp, orig, len);

    /* the reader reports a damaged block through ds_reader_next */
    {
        unsigned char *copy = malloc(len);
        memcpy(copy, orig, len);
        copy[len / 2] ^= 0x40;
        write_text(bad, copy, len);
        free(copy);
        ds_reader_opts o;
        ds_reader_opts_init(&o);
        const char *p1[1] = {bad};
        o.paths = p1;
        o.n_paths = 1;
        ds_reader *r = NULL;
        CHECK_OK(ds_reader_open(&o, &r, &err), err);
        const ds_batch *b;
        int rc;
        while (r && (rc = ds_reader_next(r, &b, &err)) == 1) {}
        CHECK(r == NULL || (rc == CM_ECORRUPT && err && strstr(err, "block") && strstr(err, bad)));
        free(err);
        err = NULL;
        ds_reader_destroy(r);
    }
    /* an empty shard is valid */
    CHECK_OK(ds_shard_writer_create(join(tmp, "empty.shard"), &s, 0, &w, &err), err);
    CHECK_OK(ds_shard_writer_commit(w, &err), err);
    CHECK_OK(ds_shard_verify(join(tmp, "empty.shard"), &rows, &err), err);
    CHECK(rows == 0);
    free(orig);
    rows_copy_free(&want);
    return check_done();
}
