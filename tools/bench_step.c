/*
 * bench step: the CPU backend's training step alone, without the PS or the data path, so the
 * compute's share of `ember train`'s step can be told from the loop's. For each preset (lr,
 * mlp, dlrm, deepfm: 26 fields x dim 16 + 13 dense, the defaults ember train uses) and each
 * thread count, one random batch of B rows whose fields each hold one key (default 2048 rows and
 * 13,000 keys: the mean distinct keys of the 2M bench data's batches) is stepped forward and
 * backward, first plainly, then with a model_batch.emb_ready hook as the trainer sets one
 * (the time to the hook is what the trainer's row push waits for; after it the dense
 * gradients run on half the threads). Times are medians over the timed steps, in ms; GFLOP/s
 * counts the tower's GEMM FLOPs (model_flops_per_sample).
 *
 * Field f draws its key uniformly from its own U/F keys, as the trainer's keys belong to one
 * field each (ingest hashes the field into the key): a batch then holds ~U distinct (field, key)
 * pairs, which is what the cpu backend's factorized first layer costs. --shared-keys draws
 * every field's key from all U instead (~B*F distinct pairs: the factorized form's worst case).
 *
 * With --bf16 the backend runs its GEMMs on AMX tiles (BACKEND_BF16, `ember train --bf16`).
 * --plain and --factored fix the mlp's and deepfm's first layer to one formulation
 * (BACKEND_PLAIN, BACKEND_FACTORED) instead of the backend's choice per batch. --openblas runs
 * the fp32 GEMMs on OpenBLAS even where ember's own GEMM would (BACKEND_OPENBLAS), for
 * the two side by side.
 *
 * Usage: tools/bench step [--batch B] [--keys U] [--steps N] [--threads-list 1,2] [--bf16]
 *                         [--shared-keys] [--plain | --factored] [--openblas] [--model NAME]
 * Prints a table, then one JSON object as the last line.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "tools/bench_util.h"
#include "src/model.h"

#define FIELDS 26
#define DENSE 13
#define MAX_THREADS 8

typedef struct timing {
    double plain, to_hook, after_hook; /* medians, ms */
} timing;

static double hook_at;
static uint32_t be_flags; /* backend_ops.create flags: BACKEND_BF16 with --bf16 */
static int shared_keys;   /* --shared-keys: every field draws from all U keys */
static const char *only;  /* --model NAME: that preset alone */

static void hook(void *arg)
{
    (void)arg;
    hook_at = cm_now();
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static uint64_t rnd(void)
{
    uint64_t z = (rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static float unif(float a, float b)
{
    return a + (b - a) * (float)(rnd() >> 40) / (float)(1u << 24);
}

/* Steps one preset at one thread count; 0, or -1 with a message printed. */
static int run(model_kind kind, uint32_t threads, uint32_t B, uint32_t U, int steps, timing *out,
               double *flops)
{
    model_cfg m;
    model_layout l;
    char *err = NULL;
    model_cfg_preset(&m, kind, FIELDS, DENSE);
    if (model_layout_make(&m, &l, &err) != CM_OK) {
        fprintf(stderr, "bench step: %s\n", err);
        free(err);
        return -1;
    }
    *flops = model_flops_per_sample(&l) * B;
    size_t nnz = (size_t)B * FIELDS;
    float *params = malloc(l.n_params * sizeof(float) + 1), *dparams = malloc(l.n_params * 4 + 1);
    float *dense = malloc((size_t)B * DENSE * 4), *labels = malloc(B * 4), *val = malloc(nnz * 4);
    float *probs = malloc(B * 4), *emb[MODEL_MAX_TABLES] = {0}, *demb[MODEL_MAX_TABLES] = {0};
    uint32_t *row_ptr = malloc((nnz + 1) * 4), *col = malloc(nnz * 4);
    double *t0 = malloc(steps * sizeof(double)), *t1 = malloc(steps * sizeof(double)),
           *t2 = malloc(steps * sizeof(double));
    void *st = NULL;
    model_units units = {0};
    int rc = -1;
    if (!params || !dparams || !dense || !labels || !val || !probs || !row_ptr || !col || !t0 ||
        !t1 || !t2)
        goto out;
    model_init_params(&m, &l, params);
    for (size_t i = 0; i < (size_t)B * DENSE; i++)
        dense[i] = unif(0.0f, 3.0f);
    for (uint32_t i = 0; i < B; i++)
        labels[i] = unif(0, 1) < 0.25f ? 1.0f : 0.0f;
    for (size_t r = 0; r <= nnz; r++)
        row_ptr[r] = (uint32_t)r;
    const uint32_t per_field = U / FIELDS ? U / FIELDS : 1;
    for (size_t k = 0; k < nnz; k++) {
        uint32_t f = (uint32_t)(k % FIELDS);
        col[k] = shared_keys ? (uint32_t)(rnd() % U)
                             : (f * per_field + (uint32_t)(rnd() % per_field)) % U;
        val[k] = 1.0f;
    }
    model_batch mb = {.B = B, .F = FIELDS, .D = DENSE, .U = U, .dense = dense, .labels = labels,
                      .row_ptr = row_ptr, .col = col, .val = val};
    for (uint32_t t = 0; t < l.n_tables; t++) {
        size_t n = (size_t)U * l.table_dim[t];
        emb[t] = malloc(n * 4);
        demb[t] = malloc(n * 4);
        if (!emb[t] || !demb[t]) goto out;
        for (size_t i = 0; i < n; i++)
            emb[t][i] = unif(-0.05f, 0.05f);
        mb.emb[t] = emb[t];
    }
    if (backend_cpu_ops.create(&m, &l, B, U, threads, be_flags, &st, &err) != CM_OK) {
        fprintf(stderr, "bench step: %s\n", err);
        goto out;
    }
    /* The batch's units, built once outside the timed steps, as the trainer's builder thread
     * builds each batch's beside its staging (model_batch.units). */
    uint32_t mu = backend_cpu_ops.max_units ? backend_cpu_ops.max_units(st, B, FIELDS) : 0;
    if (mu > 0 && model_units_build(&units, &mb, mu, &err) != CM_OK) {
        fprintf(stderr, "bench step: %s\n", err);
        goto out;
    }
    if (mu > 0) mb.units = &units;
    double loss;
    for (int pass = 0; pass < 2; pass++) {
        mb.emb_ready = pass ? hook : NULL;
        for (int i = -3; i < steps; i++) { /* three warm-up steps */
            hook_at = 0;
            double a = cm_now();
            if (backend_cpu_ops.step(st, params, &mb, probs, &loss, dparams, demb, &err) != CM_OK) {
                fprintf(stderr, "bench step: %s\n", err);
                goto out;
            }
            double b = cm_now();
            if (i < 0) continue;
            if (pass == 0) {
                t0[i] = (b - a) * 1e3;
            } else {
                t1[i] = (hook_at - a) * 1e3;
                t2[i] = (b - hook_at) * 1e3;
            }
        }
    }
    out->plain = bench_median(t0, (size_t)steps);
    out->to_hook = bench_median(t1, (size_t)steps);
    out->after_hook = bench_median(t2, (size_t)steps);
    rc = 0;
out:
    if (st) backend_cpu_ops.destroy(st);
    model_units_fini(&units);
    free(err);
    free(params);
    free(dparams);
    free(dense);
    free(labels);
    free(val);
    free(probs);
    free(row_ptr);
    free(col);
    free(t0);
    free(t1);
    free(t2);
    for (int t = 0; t < MODEL_MAX_TABLES; t++) {
        free(emb[t]);
        free(demb[t]);
    }
    return rc;
}

static void usage(void)
{
    fprintf(stderr,
            "usage: tools/bench step [--batch B] [--keys U] [--steps N] [--threads-list 1,2] "
            "[--bf16] [--shared-keys] [--plain | --factored] [--openblas] [--model NAME]\n");
}

int main(int argc, char **argv)
{
    uint32_t B = 2048, U = 13000, tl[MAX_THREADS], nt = 0;
    bench_blas_core(argv);
    int steps = 30;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--batch") && v) B = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(a, "--keys") && v) U = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(a, "--steps") && v) steps = atoi(argv[++i]);
        else if (!strcmp(a, "--bf16")) be_flags |= BACKEND_BF16;
        else if (!strcmp(a, "--shared-keys"))
            shared_keys = 1;
        else if (!strcmp(a, "--model") && v)
            only = argv[++i];
        else if (!strcmp(a, "--plain"))
            be_flags |= BACKEND_PLAIN;
        else if (!strcmp(a, "--factored"))
            be_flags |= BACKEND_FACTORED;
        else if (!strcmp(a, "--openblas"))
            be_flags |= BACKEND_OPENBLAS;
        else if (!strcmp(a, "--threads-list") && v) {
            char *s = argv[++i], *end;
            while (*s && nt < MAX_THREADS) {
                long t = strtol(s, &end, 10);
                if (end == s || t < 1 || t > MAX_THREADS) break;
                tl[nt++] = (uint32_t)t;
                s = *end == ',' ? end + 1 : end;
            }
        } else {
            usage();
            return 2;
        }
    }
    if (nt == 0) tl[nt++] = 1, tl[nt++] = 2;
    if (B == 0 || U == 0 || steps < 1) {
        usage();
        return 2;
    }
    const model_kind kinds[] = {MODEL_LR, MODEL_MLP, MODEL_DLRM, MODEL_DEEPFM};
    const char *gemms = be_flags & BACKEND_BF16       ? "bf16 on AMX"
                        : be_flags & BACKEND_OPENBLAS ? backend_cpu_blas_core()
                                                      : backend_cpu_kernels();
    printf("bench step: cpu backend, GEMMs %s, batch %u, %u keys (%s), %d timed steps (medians)\n",
           gemms, B, U, shared_keys ? "shared by the fields" : "U/F a field", steps);
    printf("%-8s %7s %10s %10s %10s %10s %12s\n", "model", "threads", "step ms", "to hook",
           "after hook", "GFLOP/s", "samples/s");
    char json[4096];
    int jn = snprintf(json, sizeof json,
                      "{\"bench\":\"step\",\"bf16\":%s,\"gemm\":\"%s\",\"batch\":%u,\"keys\":%u,"
                      "\"shared_keys\":%s",
                      be_flags & BACKEND_BF16 ? "true" : "false", gemms, B, U,
                      shared_keys ? "true" : "false");
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++)
        for (uint32_t ti = 0; ti < nt; ti++) {
            if (only != NULL && strcmp(only, model_kind_name(kinds[k])) != 0) continue;
            timing t = {0, 0, 0};
            double flops = 0;
            if (run(kinds[k], tl[ti], B, U, steps, &t, &flops) != 0) return 1;
            const char *name = model_kind_name(kinds[k]);
            double gf = t.plain > 0 ? flops / (t.plain * 1e6) : 0;
            printf("%-8s %7u %10.3f %10.3f %10.3f %10.1f %12.0f\n", name, tl[ti], t.plain,
                   t.to_hook, t.after_hook, gf, B / (t.plain * 1e-3));
            if (jn < (int)sizeof json - 200)
                jn += snprintf(json + jn, sizeof json - (size_t)jn,
                               ",\"%s_t%u_ms\":%.3f,\"%s_t%u_to_hook_ms\":%.3f,"
                               "\"%s_t%u_after_hook_ms\":%.3f,\"%s_t%u_gflops\":%.1f",
                               name, tl[ti], t.plain, name, tl[ti], t.to_hook, name, tl[ti],
                               t.after_hook, name, tl[ti], gf);
        }
    printf("%s}\n", json);
    return 0;
}
