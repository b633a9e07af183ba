/* Reader: W workers together read every row exactly once per epoch, with or without shuffle;
 * the shuffle is seeded and deterministic; batches have the requested size. */
#include "ds_test_util.h"

#define ROWS 5000

/* shards whose rows carry their id in dense[0] and one key = id */
static void write_shards(const char *dir)
{
    const char *dn[] = {"id"}, *fn[] = {"k"};
    ds_schema s = {.n_dense = 1, .n_fields = 1, .has_label = 1, .dense_names = dn, .field_names = fn};
    static float labels[ROWS], dense[ROWS];
    static uint32_t offsets[ROWS + 1];
    static uint64_t keys[ROWS];
    char *err = NULL;
    int id = 0;
    for (int sh = 0; sh < 3; sh++) {
        char name[64];
        snprintf(name, sizeof name, "part-%05d.shard", sh);
        ds_shard_writer *w = NULL;
        CHECK_OK(ds_shard_writer_create(join(dir, name), &s, 37, &w, &err), err);
        int n = sh == 2 ? ROWS - id : ROWS / 3;
        for (int i = 0; i < n; i++, id++) {
            labels[i] = (float)(id % 2);
            dense[i] = (float)id;
            keys[i] = (uint64_t)id * 1000003u;
            offsets[i + 1] = (uint32_t)(i + 1);
        }
        ds_batch b = {.n_rows = (uint32_t)n, .n_dense = 1, .n_fields = 1, .labels = labels,
                      .dense = dense, .offsets = offsets, .keys = keys, .n_keys = (uint64_t)n};
        if (w) CHECK_OK(ds_shard_writer_append(w, &b, &err), err);
        if (w) CHECK_OK(ds_shard_writer_commit(w, &err), err);
    }
}

/* Reads with the given setup; counts per row id and returns the sequence of ids seen. */
static size_t read_worker(const char *dir, uint32_t w, uint32_t W, uint64_t shuffle, uint64_t seed,
                          uint32_t epochs, int *count, int *seq)
{
    ds_reader_opts o;
    ds_reader_opts_init(&o);
    o.paths = &dir;
    o.n_paths = 1;
    o.worker = w;
    o.n_workers = W;
    o.shuffle_rows = shuffle;
    o.seed = seed;
    o.n_epochs = epochs;
    o.batch_size = 64;
    ds_reader *r = NULL;
    char *err = NULL;
    CHECK_OK(ds_reader_open(&o, &r, &err), err);
    if (r == NULL) return 0;
    CHECK(ds_reader_schema(r)->n_dense == 1 && strcmp(ds_reader_schema(r)->dense_names[0], "id") == 0);
    uint64_t expect = ds_reader_rows(r) * epochs;
    const ds_batch *b;
    size_t n = 0;
    int rc, bad = 0;
    while ((rc = ds_reader_next(r, &b, &err)) == 1) {
        if (b->n_rows > 64 || b->n_rows == 0) bad++;
        for (uint32_t i = 0; i < b->n_rows; i++) {
            int id = (int)b->dense[i];
            if (id < 0 || id >= ROWS || b->offsets[i + 1] - b->offsets[i] != 1 ||
                b->keys[b->offsets[i]] != (uint64_t)id * 1000003u || b->labels[i] != (float)(id % 2))
                bad++;
            else
                count[id]++;
            if (seq) seq[n] = id;
            n++;
        }
    }
    CHECK_OK(rc, err);
    CHECK(bad == 0);
    CHECK(n == expect);
    ds_reader_destroy(r);
    return n;
}

int main(void)
{
    const char *dir = check_tmpdir("ds_reader");
    write_shards(dir);
    static int count[ROWS], seq_a[ROWS * 2], seq_b[ROWS * 2], seq_c[ROWS * 2];
    for (uint32_t W = 1; W <= 5; W += 2) {
        for (int shuffle = 0; shuffle < 2; shuffle++) {
            memset(count, 0, sizeof count);
            size_t total = 0;
            for (uint32_t w = 0; w < W; w++)
                total += read_worker(dir, w, W, shuffle ? 300 : 0, 7, 1, count, NULL);
            int once = 1;
            for (int i = 0; i < ROWS; i++) once &= count[i] == 1;
            CHECK_MSG(once && total == ROWS, "W=%u shuffle=%d: rows not read exactly once", W, shuffle);
        }
    }
    /* unshuffled single worker reads in file order */
    memset(count, 0, sizeof count);
    read_worker(dir, 0, 1, 0, 0, 1, count, seq_a);
    int ordered = 1;
    for (int i = 0; i < ROWS; i++) ordered &= seq_a[i] == i;
    CHECK(ordered);
    /* seeded shuffle: same seed same order, other seed other order, epochs differ */
    memset(count, 0, sizeof count);
    read_worker(dir, 0, 1, 500, 42, 2, count, seq_a);
    read_worker(dir, 0, 1, 500, 42, 2, count, seq_b);
    read_worker(dir, 0, 1, 500, 43, 2, count, seq_c);
    CHECK(memcmp(seq_a, seq_b, sizeof seq_a) == 0);
    CHECK(memcmp(seq_a, seq_c, sizeof seq_a) != 0);
    CHECK(memcmp(seq_a, seq_a + ROWS, ROWS * sizeof(int)) != 0);
    int moved = 0;
    for (int i = 0; i < ROWS; i++) moved += seq_a[i] != i;
    CHECK(moved > ROWS / 2);
    int twice = 1;
    for (int i = 0; i < ROWS; i++) twice &= count[i] == 6;
    CHECK(twice);
    /* errors: bad worker index, missing path */
    ds_reader_opts o;
    ds_reader_opts_init(&o);
    o.paths = &dir;
    o.n_paths = 1;
    o.worker = 3;
    o.n_workers = 3;
    ds_reader *r = NULL;
    char *err = NULL;
    CHECK(ds_reader_open(&o, &r, &err) == CM_EINVAL);
    free(err);
    err = NULL;
    const char *missing = "/nonexistent/dir";
    o.paths = &missing;
    o.worker = 0;
    CHECK(ds_reader_open(&o, &r, &err) == CM_ENOTFOUND);
    free(err);
    return check_done();
}
