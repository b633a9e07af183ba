/*
 * ember gen -> ingest -> train, as a user runs them ($EMBER_BIN): every model trains on 48k
 * synthetic rows (one epoch, batch 512) and reports a sane final JSON line (auc, logloss,
 * samples_per_s, rows, seconds, steps, eval_rows, model, device, cpu_kernels, and the stepping
 * thread's step_ms, wait_batch_ms, wait_push_ms, dense_ms) and a
 * metrics.jsonl; every model beats chance clearly (AUC > 0.6); the mlp finds the planted feature interactions that lr cannot
 * (AUC mlp > lr); a one-worker run is deterministic (same AUC and logloss twice); so is an
 * mlp run with --bf16, within 0.01 AUC of fp32's (or, without AMX-BF16, it is refused).
 */
#include <math.h>
#include <sys/stat.h>

#include "cli_util.h"

static void check_run(const char *model, const char *out, const char *json, double rows_train,
                      double rows_eval, unsigned batch)
{
    fprintf(stderr, "    %s\n", json);
    double auc = jnum(json, "auc"), ll = jnum(json, "logloss"), sps = jnum(json, "samples_per_s");
    double rows = jnum(json, "rows"), secs = jnum(json, "seconds"), steps = jnum(json, "steps");
    double erows = jnum(json, "eval_rows");
    CHECK_MSG(auc > 0.6 && auc < 1.0, "%s: auc %g", model, auc);
    CHECK_MSG(ll > 0.3 && ll < 0.69, "%s: logloss %g", model, ll); /* CTR ~0.23: chance is ~0.54 */
    CHECK_MSG(sps > 0 && secs > 0, "%s: samples_per_s %g seconds %g", model, sps, secs);
    CHECK_MSG(rows == rows_train, "%s: rows %g, ingest wrote %g train rows", model, rows, rows_train);
    CHECK_MSG(erows == rows_eval, "%s: eval_rows %g, ingest wrote %g eval rows", model, erows, rows_eval);
    CHECK_MSG(steps == ceil(rows_train / batch), "%s: steps %g", model, steps);
    char name[64];
    CHECK(json_raw(json, "model", name, sizeof name) == 0);
    char want[64];
    snprintf(want, sizeof want, "\"%s\"", model);
    CHECK_MSG(strcmp(name, want) == 0, "model %s, expected %s", name, want);
    char dev[32] = "";
    CHECK_MSG(json_raw(json, "device", dev, sizeof dev) == 0 &&
                  (strcmp(dev, "\"cpu\"") == 0 || strcmp(dev, "\"cuda\"") == 0),
              "%s: device %s, expected \"cpu\" or \"cuda\"", model, dev);
    char kern[64] = "";
    CHECK_MSG(json_raw(json, "cpu_kernels", kern, sizeof kern) == 0 && strlen(kern) > 2 &&
                  kern[0] == '"',
              "%s: cpu_kernels %s", model, kern);
    /* The stepping thread's time a step: the backend's step takes most of it (a sum of the
     * parts over the wall time per step would exceed it only if a part were counted twice). */
    double step_ms = jnum(json, "step_ms"), wb = jnum(json, "wait_batch_ms"),
           wp = jnum(json, "wait_push_ms"), dn = jnum(json, "dense_ms");
    CHECK_MSG(step_ms > 0 && wb >= 0 && wp >= 0 && dn >= 0 &&
                  (step_ms + wb + wp + dn) * steps <= secs * 1e3,
              "%s: step_ms %g wait_batch_ms %g wait_push_ms %g dense_ms %g over %g steps in %g s",
              model, step_ms, wb, wp, dn, steps, secs);

    /* metrics.jsonl: one JSON object a line; the last training line at the final step, then
     * the final evaluation with the printed AUC and logloss. */
    char path[256];
    snprintf(path, sizeof path, "%s/metrics.jsonl", out);
    char *m = slurp(path);
    CHECK_MSG(m != NULL && *m, "%s missing or empty", path);
    if (m) {
        size_t lines = 0;
        const char *last = NULL, *eval = NULL;
        for (char *p = m; *p;) {
            char *nl = strchr(p, '\n');
            CHECK_MSG(nl != NULL, "%s: unterminated line", path);
            if (!nl) break;
            *nl = '\0';
            int is_eval = strstr(p, "\"auc\":") != NULL;
            CHECK_MSG(p[0] == '{' && nl[-1] == '}' && strstr(p, "\"step\":") &&
                          strstr(p, is_eval ? "\"logloss\":" : "\"loss\":"),
                      "%s: bad line %s", path, p);
            CHECK_MSG(!eval, "%s: a line after the final evaluation: %s", path, p);
            if (is_eval)
                eval = p;
            else
                last = p;
            lines++;
            p = nl + 1;
        }
        CHECK(lines >= 2);
        if (last) {
            CHECK_MSG(jnum(last, "step") == steps, "%s: last step %s", path, last);
            double loss = jnum(last, "loss");
            CHECK(loss > 0 && loss < 1);
            /* The loop's clock holds every step and starts after the process's setup. */
            double loop = jnum(last, "loop_seconds"), el = jnum(last, "seconds");
            CHECK_MSG(loop * 1e3 >= step_ms * steps && loop <= el,
                      "%s: loop_seconds %g, seconds %g, %g steps of %g ms", path, loop, el, steps,
                      step_ms);
        }
        CHECK_MSG(eval != NULL && strstr(eval, "\"final\":true"), "%s: no final evaluation line",
                  path);
        if (eval) {
            CHECK_MSG(jnum(eval, "step") == steps, "%s: final evaluation at %s", path, eval);
            CHECK_MSG(fabs(jnum(eval, "auc") - jnum(json, "auc")) < 1e-6 &&
                          fabs(jnum(eval, "logloss") - jnum(json, "logloss")) < 1e-6,
                      "%s: final evaluation %s, printed %s", path, eval, json);
        }
    }
    free(m);
    /* logs/train.log: the embedded run's own log, from start to result. */
    snprintf(path, sizeof path, "%s/logs/train.log", out);
    char *log = slurp(path);
    CHECK_MSG(log && strstr(log, "ember train started: model ") && strstr(log, "eval at step") &&
                  strstr(log, "\n[") && strstr(log, "] done: "),
              "%s: %s", path, log ? log : "(missing)");
    free(log);
    snprintf(path, sizeof path, "%s/ckpt/LATEST", out);
    char *latest = slurp_sealed(path), wantl[64];
    snprintf(wantl, sizeof wantl, "step-%.0f\n", steps);
    CHECK_MSG(latest && strcmp(latest, wantl) == 0, "%s: %s", path, latest ? latest : "(missing)");
    free(latest);
}

int main(void)
{
    if (cli_init("train_e2e") != 0) return 1;
    const unsigned batch = 512;
    if (make_criteo("ds", 60000, 3, 0.2) != 0) return check_done();
    double rows_train = jnum(last_line(), "rows_train"), rows_eval = jnum(last_line(), "rows_eval");
    CHECK(rows_train + rows_eval == 60000 && rows_eval > 10000 && rows_eval < 14000);
    CHECK(exists("ds/train") && exists("ds/eval"));

    const char *models[] = {"lr", "mlp", "dlrm", "deepfm"};
    double auc[4] = {0};
    char json0[4096] = "";
    for (int i = 0; i < 4; i++) {
        int rc = run("train --train ds/train --eval ds/eval --model %s --batch %u --epochs 1 "
                     "--out run-%s --no-progress", models[i], batch, models[i]);
        CHECK_MSG(rc == 0, "train --model %s: exit %d", models[i], rc);
        if (rc != 0) continue;
        const char *json = last_line();
        if (i == 1) snprintf(json0, sizeof json0, "%s", json);
        char out[64];
        snprintf(out, sizeof out, "run-%s", models[i]);
        check_run(models[i], out, json, rows_train, rows_eval, batch);
        auc[i] = jnum(json, "auc");
    }
    fprintf(stderr, "AUC lr %.4f mlp %.4f dlrm %.4f deepfm %.4f\n", auc[0], auc[1], auc[2], auc[3]);
    CHECK_MSG(auc[1] > auc[0] + 0.005, "mlp AUC %.4f does not beat lr AUC %.4f", auc[1], auc[0]);

    /* One worker: the same run twice gives the same numbers. */
    int rc = run("train --train ds/train --eval ds/eval --model mlp --batch %u --out run-mlp2 "
                 "--no-progress", batch);
    CHECK(rc == 0);
    char a1[64], a2[64], l1[64], l2[64];
    if (rc == 0 && json_raw(json0, "auc", a1, sizeof a1) == 0 &&
        json_raw(json0, "logloss", l1, sizeof l1) == 0 &&
        json_raw(last_line(), "auc", a2, sizeof a2) == 0 &&
        json_raw(last_line(), "logloss", l2, sizeof l2) == 0)
        CHECK_MSG(strcmp(a1, a2) == 0 && strcmp(l1, l2) == 0,
                  "mlp rerun differs: auc %s vs %s, logloss %s vs %s", a1, a2, l1, l2);
    else
        CHECK(0);

    /* --bf16 (AMX GEMMs): deterministic too, and within bf16's precision of the fp32 run's AUC;
     * where the machine has no AMX-BF16 it is refused with a message naming it. */
    if (cm_gemm_bf16_available()) {
        double b[2] = {0, 0};
        for (int k = 0; k < 2; k++) {
            rc = run("train --train ds/train --eval ds/eval --model mlp --batch %u --bf16 "
                     "--out run-mlp-bf16-%d --no-progress",
                     batch, k);
            CHECK_MSG(rc == 0, "train --bf16: exit %d", rc);
            char out[64];
            snprintf(out, sizeof out, "run-mlp-bf16-%d", k);
            if (rc == 0) check_run("mlp", out, last_line(), rows_train, rows_eval, batch);
            b[k] = rc == 0 ? jnum(last_line(), "auc") : NAN;
        }
        fprintf(stderr, "AUC mlp --bf16 %.6f, %.6f (fp32 %.6f)\n", b[0], b[1], auc[1]);
        CHECK_MSG(b[0] == b[1], "mlp --bf16 rerun differs: auc %.9g vs %.9g", b[0], b[1]);
        CHECK_MSG(fabs(b[0] - auc[1]) < 0.01, "mlp --bf16 auc %.6f, fp32 %.6f", b[0], auc[1]);
        /* Its evaluation is the tower a bundle serves (fp32): the trainer's predictions and
         * `ember predict`'s over the exported bundle agree to 1e-6 a row, as for an fp32 run.
         * The eval ran on bf16 GEMMs, and differed from what serving gives by up to ~1e-3. */
        rc = run("export --checkpoint run-mlp-bf16-0 --out bundle-bf16");
        if (rc == 0) rc = run("predict --bundle bundle-bf16 --data ds/eval --out pred-bf16.txt");
        CHECK_MSG(rc == 0, "export/predict of the --bf16 run: exit %d: %s", rc, err_text);
        char *mine = slurp("run-mlp-bf16-0/eval_predictions.txt"), *served = slurp("pred-bf16.txt");
        double worst = mine && served ? 0 : INFINITY;
        size_t rows = 0;
        for (char *p = mine, *q = served; p && q && *p && *q; rows++) {
            char *pe, *qe;
            double a = strtod(p, &pe), c = strtod(q, &qe);
            if (pe == p || qe == q) break;
            if (!(fabs(a - c) <= worst)) worst = fabs(a - c);
            p = pe + strspn(pe, "\n "), q = qe + strspn(qe, "\n ");
        }
        CHECK_MSG(rows == rows_eval && worst <= 1e-6,
                  "--bf16 run: %zu of %u eval predictions compared, max |trainer - served| %g",
                  rows, (unsigned)rows_eval, worst);
        free(mine);
        free(served);
    } else {
        fprintf(stderr, "train_e2e: no AMX-BF16 here: checking that --bf16 is refused\n");
        rc = run("train --train ds/train --eval ds/eval --model mlp --batch %u --bf16 "
                 "--out run-mlp-bf16 --no-progress",
                 batch);
        CHECK_MSG(rc != 0 && err_text && strstr(err_text, "AMX"),
                  "train --bf16 without AMX: exit %d, stderr %s", rc, err_text ? err_text : "");
    }

    /* --dense-optimizer reaches the tower's block on the PS: its checkpoint holds the values
     * plus two Adam slots, one Adagrad slot, or none for SGD (and a small header). */
    long bytes[3] = {0};
    const char *opts[3] = {"adam", "adagrad", "sgd"};
    for (int k = 0; k < 3; k++) {
        rc = run("train --train ds/train --model mlp --batch %u --max-steps 3 --dense-optimizer %s "
                 "--out run-dense-%s --no-progress",
                 batch, opts[k], opts[k]);
        CHECK_MSG(rc == 0, "--dense-optimizer %s: exit %d, stderr %s", opts[k], rc, err_text);
        char path[8192];
        snprintf(path, sizeof path, "%s/run-dense-%s/ckpt/step-3/shard-0/dense-tower.bin", dir,
                 opts[k]);
        struct stat st;
        bytes[k] = stat(path, &st) == 0 ? (long)st.st_size : -1;
    }
    long per = bytes[0] - bytes[1]; /* one slot */
    CHECK_MSG(per > 0 && labs(bytes[1] - bytes[2] - per) < 64 && labs(bytes[2] - per) < 256,
              "dense-tower.bin bytes: adam %ld, adagrad %ld, sgd %ld", bytes[0], bytes[1],
              bytes[2]);
    free(out_text);
    free(err_text);
    return check_done();
}
