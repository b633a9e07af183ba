/*
 * libFuzzer target: any bytes as ember train's config file ([model] and [train]) through
 * train_config_load and cm_ini_parse.
 *
 * Properties checked (abort on violation): a refused file gets an error that names the file;
 * a loaded one leaves every value train_entry range-checks within its range.
 */
#include <stdlib.h>
#include <string.h>

#include "src/train.h"
#include "tests/fuzz_file.h"

static int widths_ok(const uint32_t *w, uint32_t n)
{
    if (n > MODEL_MAX_LAYERS) return 0;
    for (uint32_t i = 0; i < n; i++)
        if (w[i] == 0 || w[i] > 65536) return 0;
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = fuzz_file(data, size);
    train_opts o;
    train_opts_init(&o);
    char *err = NULL;
    int rc = train_config_load(path, &o, &err);
    if (rc != CM_OK) {
        if (rc > 0 || err == NULL || strstr(err, path) == NULL) abort();
    } else if (o.batch == 0 || o.batch > 1000000 || o.epochs == 0 || o.epochs > 10000 ||
               o.staleness < -1 || o.staleness > 1000000 || o.dim_override > 1024 ||
               !(o.emb_lr > 0) || !(o.dense_lr >= 0) || o.keep_checkpoints > 100000 || o.tf32 > 1 ||
               o.bf16 > 1 || o.dense_mirror > 1 || !widths_ok(o.model.hidden, o.model.n_hidden) ||
               !widths_ok(o.model.bottom, o.model.n_bottom)) {
        abort();
    }
    free(err);
    return 0;
}
