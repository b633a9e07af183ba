/*
 * libFuzzer target: a worker's int8 residual file (worker-<i>.ef, ps/residual.h), as
 * `--resume` and `ember reshard` read it. The trailer checksum stops random bytes at once, so the
 * first input byte picks a mode: odd = the rest with its last 8 bytes replaced by the right
 * checksum (fuzzed sections, rows, stamps and clocks reach the parser), even = the rest as it is.
 *
 * Against a config of two int8 tables ("a" dim 3, "b" dim 1), under a bound small enough that a
 * seed's rows pass it, properties checked (abort on violation):
 *   - ps_residuals_check and ps_resid_load agree on whether the file is damaged (a load may
 *     also refuse a sound file written under another config, never accept a damaged one);
 *   - a refusal names the file; a refused load leaves no residuals;
 *   - a load keeps each table within its bound;
 *   - what a load holds saves to a file that loads again and saves to the same bytes.
 */
#include <stdlib.h>
#include <string.h>

#include "ps/residual.h"
#include "tests/fuzz_file.h"

static const char conf[] = "[cluster]\nshards = 1\nworkers = 1\n"
                           "[table a]\ndim = 3\npush_codec = int8\n"
                           "[table b]\ndim = 1\npush_codec = int8\n";

static const ps_config *config(void)
{
    static ps_config cfg;
    static int loaded;
    if (!loaded) {
        const char *path = fuzz_file((const uint8_t *)conf, sizeof conf - 1);
        if (ps_config_load(path, &cfg, NULL) != CM_OK) abort();
        loaded = 1;
    }
    return &cfg;
}

/* A saved file's bytes (NULL when none was written: no int8 table). */
static uint8_t *saved(const ps_resid *rs, const ps_config *cfg, const char *path, size_t *n)
{
    if (ps_resid_save(rs, cfg, 0, path, NULL) != CM_OK) abort();
    void *b = NULL;
    if (cm_read_file(path, &b, n, NULL) != CM_OK) abort();
    return b;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    const ps_config *cfg = config();
    uint8_t *buf = malloc(size);
    if (buf == NULL) abort();
    size_t n = size - 1;
    memcpy(buf, data + 1, n);
    if ((data[0] & 1) && n >= 8) {
        uint64_t sum = cm_xxh3(buf, n - 8);
        memcpy(buf + n - 8, &sum, 8);
    }
    const char *path = fuzz_file(buf, n);
    static ps_resid rs[PS_MAX_TABLES];
    ps_resid_bound(rs, cfg, 4096); /* ~50 rows of a, ~100 of b */
    char *err = NULL;
    const int sound = ps_residuals_check(buf, n, path, NULL) == CM_OK;
    const int rc = ps_resid_load(rs, cfg, 0, path, &err);
    if (rc != CM_OK) {
        if (err == NULL || strstr(err, path) == NULL) abort();
        for (uint32_t t = 0; t < PS_MAX_TABLES; t++)
            if (rs[t].st != NULL) abort();
        free(err);
        free(buf);
        return 0;
    }
    if (!sound) abort();
    for (uint32_t t = 0; t < cfg->n_tables; t++)
        if (rs[t].st != NULL && emb_store_count(rs[t].st) > rs[t].max_rows) abort();
    char again[4200];
    snprintf(again, sizeof again, "%s.again", path);
    size_t n1 = 0, n2 = 0;
    uint8_t *b1 = saved(rs, cfg, again, &n1);
    if (ps_resid_load(rs, cfg, 0, again, NULL) != CM_OK) abort();
    uint8_t *b2 = saved(rs, cfg, again, &n2);
    if (n1 != n2 || memcmp(b1, b2, n1) != 0) abort();
    unlink(again);
    ps_resid_clear(rs);
    free(b1);
    free(b2);
    free(buf);
    return 0;
}
