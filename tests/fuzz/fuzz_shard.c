/* Any bytes as a shard file: verification refuses or accepts without crashing; the reader
 * does the same. The first call also writes a valid shard and fuzzes mutations of it when the
 * input starts with 'M' (byte 1..8: position, byte 9: xor). Both files live under $TMPDIR (or
 * /tmp) and are removed at exit. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "datasets/datasets.h"

static char path[4096], good[4096];
static void *good_bytes;
static size_t good_len;

static void make_good(void)
{
    const char *dn[] = {"d"}, *fn[] = {"f", "g"};
    ds_schema s = {.n_dense = 1, .n_fields = 2, .has_label = 1, .has_weights = 1,
                   .dense_names = dn, .field_names = fn};
    float labels[5] = {0, 1, 0, 1, 1}, dense[5] = {1, 2, 3, 4, 5}, w[7] = {1, 2, 3, 4, 5, 6, 7};
    uint32_t off[11] = {0, 1, 1, 2, 3, 3, 5, 6, 6, 7, 7};
    uint64_t keys[7] = {11, 22, 33, 44, 55, 66, 77};
    ds_batch b = {.n_rows = 5, .n_dense = 1, .n_fields = 2, .labels = labels, .dense = dense,
                  .offsets = off, .keys = keys, .weights = w, .n_keys = 7};
    ds_shard_writer *wr = NULL;
    if (ds_shard_writer_create(good, &s, 2, &wr, NULL) != 0) abort();
    if (ds_shard_writer_append(wr, &b, NULL) != 0 || ds_shard_writer_commit(wr, NULL) != 0) abort();
    FILE *f = fopen(good, "rb");
    good_bytes = malloc(1 << 16);
    good_len = fread(good_bytes, 1, 1 << 16, f);
    fclose(f);
}

static void remove_files(void)
{
    unlink(path);
    unlink(good);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (path[0] == '\0') {
        const char *tmp = getenv("TMPDIR");
        snprintf(path, sizeof path, "%s/ember_fuzz_shard.%d", tmp && *tmp ? tmp : "/tmp",
                 (int)getpid());
        snprintf(good, sizeof good, "%s/ember_fuzz_good.%d", tmp && *tmp ? tmp : "/tmp",
                 (int)getpid());
        make_good();
        atexit(remove_files);
    }
    FILE *f = fopen(path, "wb");
    if (size >= 10 && data[0] == 'M') {
        unsigned char *copy = malloc(good_len);
        memcpy(copy, good_bytes, good_len);
        uint64_t pos;
        memcpy(&pos, data + 1, 8);
        copy[pos % good_len] ^= data[9] ? data[9] : 1;
        fwrite(copy, 1, good_len, f);
        free(copy);
    } else {
        fwrite(data, 1, size, f);
    }
    fclose(f);
    uint64_t rows = 0;
    char *err = NULL;
    int rc = ds_shard_verify(path, &rows, &err);
    if (size >= 10 && data[0] == 'M' && rc == 0) abort(); /* a flipped byte must be caught */
    free(err);
    err = NULL;
    ds_reader_opts o;
    ds_reader_opts_init(&o);
    const char *p1[1] = {path};
    o.paths = p1;
    o.n_paths = 1;
    o.batch_size = 3;
    ds_reader *r = NULL;
    if (ds_reader_open(&o, &r, &err) == 0) {
        const ds_batch *b;
        while (ds_reader_next(r, &b, &err) == 1) {}
        ds_reader_destroy(r);
    }
    free(err);
    return 0;
}
