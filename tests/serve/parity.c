/*
 * serve_parity: a bundle serves what the trainer evaluated. For lr, mlp and deepfm (40 steps on
 * 60k synthetic rows): `ember export` (fp32) + `ember predict` over the eval shards gives the
 * trainer's own run/eval_predictions.txt to within 1e-6 per row, and so does
 * ember_serve_predict called in-process with another batch size; fp16 and int8 bundles are
 * smaller and their AUC is within 0.001 of the fp32 bundle's (exact AUC, src/metrics.c).
 */
#include "serve_util.h"
#include "src/metrics.h"

static double auc_of(const float *p, const float *labels, size_t n)
{
    double auc = -1;
    char *err = NULL;
    int rc = metrics_auc(p, labels, n, &auc, &err);
    CHECK_MSG(rc == 0, "metrics_auc: %s", err ? err : "?");
    free(err);
    return auc;
}

static double max_abs_diff(const float *a, const float *b, size_t n, size_t *n_diff)
{
    double m = 0;
    *n_diff = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= m)) m = d; /* NaN propagates */
        *n_diff += a[i] != b[i];
    }
    return m;
}

static long file_size(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (long)st.st_size : -1;
}

static void check_model(const char *model, const su_data *eval, const float *labels)
{
    fprintf(stderr, "--- %s\n", model);
    if (su_train(model) != 0) return;
    char *train_out = su_slurp(su_path("out.txt"), NULL);
    const char *a = train_out ? strstr(train_out, "\"auc\":") : NULL;
    double train_auc = a ? atof(a + 6) : -1;
    free(train_out);

    char run_preds[256];
    snprintf(run_preds, sizeof run_preds, "run-%s/eval_predictions.txt", model);
    size_t n_ref = 0;
    float *ref = su_read_floats(su_path(run_preds), &n_ref);
    CHECK_MSG(ref != NULL && n_ref == eval->rows, "%s: %zu predictions, %llu eval rows", run_preds,
              n_ref, (unsigned long long)eval->rows);
    if (ref == NULL || n_ref != eval->rows) {
        free(ref);
        return;
    }

    static const char *precs[3] = {"fp32", "fp16", "int8"};
    double auc[3] = {-1, -1, -1};
    long tab_bytes[3] = {0};
    float *p32 = NULL;
    for (int k = 0; k < 3; k++) {
        int rc = su_ember("export --checkpoint run-%s --out b-%s-%s --precision %s", model, model,
                          precs[k], precs[k]);
        CHECK_MSG(rc == 0, "export %s %s: exit %d", model, precs[k], rc);
        if (rc != 0) continue;
        char name[256];
        snprintf(name, sizeof name, "b-%s-%s/MANIFEST", model, precs[k]);
        char *mf = su_slurp(su_path(name), NULL);
        char want[64];
        snprintf(want, sizeof want, "\nprecision %s\n", precs[k]);
        CHECK_MSG(mf && strstr(mf, want) && strstr(mf, "\ntype full\n") && strstr(mf, "\nstep 40\n"),
                  "%s: %s", name, mf ? mf : "(missing)");
        free(mf);
        snprintf(name, sizeof name, "b-%s-%s/table-%s.bin", model, precs[k],
                 strcmp(model, "lr") ? "emb" : "lin");
        tab_bytes[k] = file_size(su_path(name));

        rc = su_ember("predict --bundle b-%s-%s --data shards/eval --out p-%s-%s.txt", model,
                      precs[k], model, precs[k]);
        CHECK_MSG(rc == 0, "predict %s %s: exit %d", model, precs[k], rc);
        if (rc != 0) continue;
        snprintf(name, sizeof name, "p-%s-%s.txt", model, precs[k]);
        size_t n = 0;
        float *p = su_read_floats(su_path(name), &n);
        CHECK_MSG(p != NULL && n == eval->rows, "%s: %zu rows", name, n);
        if (p == NULL || n != eval->rows) {
            free(p);
            continue;
        }
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) bad += !(p[i] >= 0.0f && p[i] <= 1.0f);
        CHECK_MSG(bad == 0, "%s: %zu predictions outside [0,1]", name, bad);
        auc[k] = auc_of(p, labels, n);
        if (k == 0) {
            size_t nd = 0;
            double d = max_abs_diff(p, ref, n, &nd);
            fprintf(stderr, "    fp32 bundle vs trainer: max |diff| %.3g (%zu of %zu rows differ)\n",
                    d, nd, n);
            CHECK_MSG(d <= 1e-6, "%s: fp32 bundle vs trainer max |diff| %g", model, d);
            p32 = p;
        } else {
            free(p);
        }
    }
    fprintf(stderr, "    AUC trainer %.6f  fp32 %.6f  fp16 %.6f  int8 %.6f\n", train_auc, auc[0],
            auc[1], auc[2]);
    fprintf(stderr, "    table bytes fp32 %ld fp16 %ld int8 %ld\n", tab_bytes[0], tab_bytes[1],
            tab_bytes[2]);
    CHECK_MSG(fabs(auc[0] - train_auc) <= 1e-5, "%s: fp32 AUC %.6f, trainer reported %.6f",
              model, auc[0], train_auc);
    CHECK_MSG(auc[0] > 0.5 && fabs(auc[1] - auc[0]) <= 0.001, "%s: fp16 AUC %.6f vs fp32 %.6f",
              model, auc[1], auc[0]);
    CHECK_MSG(auc[0] > 0.5 && fabs(auc[2] - auc[0]) <= 0.001, "%s: int8 AUC %.6f vs fp32 %.6f",
              model, auc[2], auc[0]);
    CHECK_MSG(tab_bytes[0] > 0 && tab_bytes[1] > 0 && tab_bytes[2] > 0 &&
                  tab_bytes[1] < tab_bytes[0] && tab_bytes[2] != tab_bytes[1] &&
                  (tab_bytes[2] < tab_bytes[0]) == (strcmp(model, "lr") != 0), /* int8 of dim 1 is 5 B */
              "%s: table sizes fp32 %ld fp16 %ld int8 %ld", model, tab_bytes[0], tab_bytes[1],
              tab_bytes[2]);

    /* The C API in-process, in batches of 1000 rows (the CLI used 4096). */
    char bname[256];
    snprintf(bname, sizeof bname, "b-%s-fp32", model);
    ember_serve *h = su_open(su_path(bname), NULL);
    if (h != NULL && p32 != NULL) {
        CHECK(ember_serve_step(h) == 40);
        CHECK(ember_serve_model(h) != NULL && strstr(ember_serve_model(h), model) != NULL);
        float *p = malloc(eval->rows * sizeof *p);
        if (su_predict_all(h, eval, p) == 0) {
            size_t nd = 0;
            double d = max_abs_diff(p, ref, eval->rows, &nd);
            double d2 = max_abs_diff(p, p32, eval->rows, &nd);
            fprintf(stderr, "    API (batch 1000) vs trainer: max |diff| %.3g; vs CLI %.3g\n", d, d2);
            CHECK_MSG(d <= 1e-6 && d2 <= 1e-6, "%s: API predictions off by %g (trainer) %g (CLI)",
                      model, d, d2);
        }
        free(p);
    }
    ember_serve_close(h);
    free(p32);
    free(ref);
}

int main(void)
{
    if (su_init("serve_parity") != 0) return check_done();
    if (su_make_data(60000, 5) != 0) return check_done();
    su_data eval;
    if (su_data_load(su_path("shards/eval"), 1000, &eval) != 0) return check_done();
    float *labels = su_labels(&eval);
    CHECK(eval.rows > 10000);
    const char *models[] = {"mlp", "deepfm", "lr"};
    for (int i = 0; i < 3; i++) check_model(models[i], &eval, labels);
    free(labels);
    su_data_free(&eval);
    return check_done();
}
