/* ember predict: click probabilities for every row of some shards, from a serving bundle. */
#include <cblas.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "datasets/datasets.h"
#include "serve/ember_serve.h"
#include "src/cli.h"
#include "src/train.h"

static void predict_usage(FILE *to)
{
    fprintf(
        to,
        "usage: ember predict --bundle DIR [--delta DIR]... --data SHARDS --out FILE [--batch N]\n"
        "  writes one probability per row (in shard order) to FILE\n"
        "  --delta DIR  a delta bundle (ember export --since) applied on top, in order (<= 64)\n"
        "  --batch N    rows scored per call (default 4096, at most 1000000)\n");
}

int cmd_predict(int argc, char **argv)
{
    static const struct option opts[] = {{"bundle", 1, 0, 'b'}, {"delta", 1, 0, 'd'},
                                         {"data", 1, 0, 'D'},   {"out", 1, 0, 'o'},
                                         {"batch", 1, 0, 'n'},  {"help", 0, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *bundle = NULL, *data = NULL, *out = NULL, *deltas[64];
    int n_deltas = 0, o;
    uint64_t batch = 4096;
    optind = 1;
    while ((o = cli_getopt("predict", argc, argv, opts)) != -1) {
        switch (o) {
        case 'b': bundle = optarg; break;
        case 'd':
            if (n_deltas == 64) {
                fprintf(stderr, "ember predict: too many --delta\n");
                return 2;
            }
            deltas[n_deltas++] = optarg;
            break;
        case 'D': data = optarg; break;
        case 'o': out = optarg; break;
        case 'n':
            if (cm_parse_size(optarg, &batch) != 0 || batch == 0 || batch > 1000000) {
                fprintf(stderr, "ember predict: bad --batch '%s'\n", optarg);
                return 2;
            }
            break;
        case 'h': predict_usage(stdout); return 0;
        default: predict_usage(stderr); return 2;
        }
    }
    int bad = cli_args_complete("predict",
                                !bundle ? "--bundle"
                                : !data ? "--data"
                                : !out  ? "--out"
                                        : NULL,
                                optind, argc, argv, predict_usage);
    if (bad != 0) return bad;
    /* ember_serve_predict leaves OpenBLAS's threads as the process has them; this process is
     * ember's own, and scores as the trainer evaluates: one OpenBLAS thread a GEMM tile (the
     * trainer's bits where OpenBLAS computes the GEMMs; see serve/ember_serve.h, "Threads"). */
    openblas_set_num_threads(1);
    char *err = NULL;
    ember_serve *h = NULL;
    ds_reader *r = NULL;
    float *probs = NULL;
    uint64_t n = 0, rows = 0;
    double t0 = cm_now();
    int rc = ember_serve_open(bundle, &h, &err);
    for (int i = 0; rc == CM_OK && i < n_deltas; i++) rc = ember_serve_apply_delta(h, deltas[i], &err);
    if (rc == CM_OK) {
        ds_reader_opts ro;
        ds_reader_opts_init(&ro);
        const char *paths[1] = {data};
        ro.paths = paths;
        ro.n_paths = 1;
        ro.batch_size = (uint32_t)batch;
        rc = ds_reader_open(&ro, &r, &err);
    }
    if (rc == CM_OK) {
        /* Checked here, where both paths are known: ember_serve_predict sees only a batch, and
         * its message named neither the shards nor the bundle. */
        const ds_schema *sch = ds_reader_schema(r);
        model_cfg m;
        int mean_pool = 0;
        rc = model_cfg_parse(ember_serve_model(h), &m, &mean_pool, &err);
        if (rc == CM_OK && (sch->n_fields != m.n_fields || sch->n_dense != m.n_dense))
            rc = cm_err(&err, CM_EINVAL,
                        "%s holds %u fields and %u dense values a row; the model of bundle %s "
                        "expects %u and %u",
                        data, sch->n_fields, sch->n_dense, bundle, m.n_fields, m.n_dense);
    }
    if (rc == CM_OK) {
        rows = ds_reader_rows(r);
        probs = malloc((rows + 1) * sizeof(float));
        if (probs == NULL) rc = cm_err(&err, CM_ENOMEM, "out of memory for %" PRIu64 " rows", rows);
    }
    while (rc == CM_OK) {
        const ds_batch *b;
        int got = ds_reader_next(r, &b, &err);
        if (got <= 0) {
            rc = got;
            break;
        }
        if (n + b->n_rows > rows) {
            rc = cm_err(&err, CM_ECORRUPT, "%s holds more rows than its index says", data);
            break;
        }
        ember_serve_batch sb = {b->n_rows, b->n_dense, b->n_fields, b->dense, b->offsets, b->keys,
                                b->weights};
        rc = ember_serve_predict(h, &sb, probs + n, &err);
        n += b->n_rows;
    }
    if (rc == CM_OK) rc = write_probs(out, probs, n, &err);
    ds_reader_destroy(r);
    ember_serve_close(h);
    free(probs);
    if (rc != CM_OK) {
        fprintf(stderr, "ember predict: %s\n", err ? err : "failed");
        free(err);
        return 1;
    }
    double secs = cm_now() - t0;
    printf("{\"rows\":%" PRIu64 ",\"seconds\":%.3f,\"rows_per_s\":%.1f,\"out\":\"", n, secs,
           secs > 0 ? (double)n / secs : 0.0);
    cm_json_escape(stdout, out);
    fputs("\"}\n", stdout);
    return 0;
}
