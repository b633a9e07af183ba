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
    CHECK_OK(ds_shard_writer_create(path, &s, 64, &w, &err), err);
    /* append in uneven batches */
    for (size_t r0 = 0; w && r0 < want.n_rows;) {
        size_t n = 1 + rnd() % 50;
        if (r0 + n > want.n_rows) n = want.n_rows - r0;
        ds_batch b = {.n_rows = (uint32_t)n, .n_dense = 2, .n_fields = 3,
                      .labels = want.labels + r0, .dense = want.dense + 2 * r0,
                      .offsets = want.offsets + 3 * r0, .keys = want.keys, .weights = want.weights,
                      .n_keys = want.offsets[3 * (r0 + n)] - want.offsets[3 * r0]};
        CHECK_OK(ds_shard_writer_append(w, &b, &err), err);
        r0 += n;
    }
    if (w) CHECK_OK(ds_shard_writer_commit(w, &err), err);
    uint64_t rows = 0;
    CHECK_OK(ds_shard_verify(path, &rows, &err), err);
    CHECK(rows == 300);

    rows_copy got = {0};
    read_all(path, &got);
    CHECK(got.n_rows == want.n_rows && got.n_keys == want.n_keys);
    if (got.n_rows == want.n_rows && got.n_keys == want.n_keys) {
        CHECK(memcmp(got.labels, want.labels, want.n_rows * 4) == 0);
        CHECK(memcmp(got.dense, want.dense, want.n_rows * 8) == 0);
        CHECK(memcmp(got.offsets, want.offsets, (want.n_rows * 3 + 1) * 4) == 0);
        CHECK(memcmp(got.keys, want.keys, want.n_keys * 8) == 0);
        CHECK(memcmp(got.weights, want.weights, want.n_keys * 4) == 0);
    }
    rows_copy_free(&got);

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
