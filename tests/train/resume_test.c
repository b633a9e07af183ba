/*
 * Checkpoint and resume ($EMBER_BIN): run A trains 40 steps with a checkpoint every 20; run B
 * trains 20 steps, then `--resume --max-steps 40` in the same directory. B's final AUC and
 * logloss equal A's to the last printed digit (a one-worker run is deterministic and resuming
 * replays exactly the pulls A made after its checkpoint), for a one-table model (mlp), a
 * two-table model (deepfm) and lr. Also: A's checkpoint directories and LATEST, the resumed
 * run's step and row counts, and metrics.jsonl appended across the two halves of B.
 */
#include "cli_util.h"

static void check_latest(const char *run, const char *want)
{
    char path[256];
    snprintf(path, sizeof path, "%s/ckpt/LATEST", run);
    char *s = slurp(path);
    CHECK_MSG(s && strcmp(s, want) == 0, "%s is '%s', expected '%s'", path, s ? s : "(missing)", want);
    free(s);
}

static void same_field(const char *a, const char *b, const char *key, const char *model)
{
    char x[64] = "?", y[64] = "?";
    CHECK(json_raw(a, key, x, sizeof x) == 0);
    CHECK(json_raw(b, key, y, sizeof y) == 0);
    CHECK_MSG(strcmp(x, y) == 0, "%s: %s %s straight through, %s resumed", model, key, x, y);
}

static void resume_case(const char *model, unsigned batch)
{
    char a[4096] = "", b[4096] = "";
    const char *common = "--train ds/train --eval ds/eval --no-progress";
    int rc = run("train %s --model %s --batch %u --max-steps 40 --checkpoint-every 20 --out A-%s",
                 common, model, batch, model);
    CHECK_MSG(rc == 0, "%s: run A exit %d", model, rc);
    snprintf(a, sizeof a, "%s", last_line());
    fprintf(stderr, "    A: %s\n", a);
    char p[256];
    snprintf(p, sizeof p, "A-%s/ckpt/step-20", model);
    CHECK_MSG(exists(p), "%s missing", p);
    snprintf(p, sizeof p, "A-%s/ckpt/step-40", model);
    CHECK_MSG(exists(p), "%s missing", p);
    snprintf(p, sizeof p, "A-%s", model);
    check_latest(p, "step-40\n");
    CHECK(jnum(a, "steps") == 40 && jnum(a, "rows") == 40.0 * batch);

    rc = run("train %s --model %s --batch %u --max-steps 20 --out B-%s", common, model, batch, model);
    CHECK_MSG(rc == 0, "%s: run B (first half) exit %d", model, rc);
    CHECK(jnum(last_line(), "steps") == 20);
    snprintf(p, sizeof p, "B-%s", model);
    check_latest(p, "step-20\n");
    rc = run("train %s --model %s --batch %u --resume --max-steps 40 --out B-%s", common, model,
             batch, model);
    CHECK_MSG(rc == 0, "%s: run B (resumed) exit %d", model, rc);
    snprintf(b, sizeof b, "%s", last_line());
    fprintf(stderr, "    B: %s\n", b);
    same_field(a, b, "auc", model);
    same_field(a, b, "logloss", model);
    same_field(a, b, "eval_rows", model);
    CHECK_MSG(jnum(b, "steps") == 40, "%s: resumed run ends at step %g", model, jnum(b, "steps"));
    CHECK_MSG(jnum(b, "rows") == 20.0 * batch, "%s: resumed run trained %g rows", model, jnum(b, "rows"));
    check_latest(p, "step-40\n");

    /* metrics.jsonl: the first half's lines, then the resumed half's, steps increasing. */
    snprintf(p, sizeof p, "B-%s/metrics.jsonl", model);
    char *m = slurp(p);
    CHECK_MSG(m != NULL, "%s missing", p);
    if (m) {
        int saw20 = 0, saw40 = 0;
        double prev = 0;
        for (char *s = m; (s = strstr(s, "{\"step\":")) != NULL; s++) {
            double st = strtod(s + 8, NULL);
            CHECK_MSG(st > prev, "%s: step %g after %g", p, st, prev);
            prev = st;
            saw20 |= st == 20;
            saw40 |= st == 40;
        }
        CHECK_MSG(saw20 && saw40, "%s lacks step 20 or step 40:\n%s", p, m);
    }
    free(m);
}

int main(void)
{
    if (cli_init("train_resume") != 0) return 1;
    if (make_criteo("ds", 40000, 11, 0.2) != 0) return check_done();
    resume_case("mlp", 512);
    resume_case("deepfm", 512);
    resume_case("lr", 256);
    free(out_text);
    free(err_text);
    return check_done();
}
