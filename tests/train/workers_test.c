/*
 * Embedded multi-worker training ($EMBER_BIN): two workers on two PS shards reach an AUC within
 * 0.02 of one worker on one shard on the same data; the shard count alone changes nothing (one
 * worker: bit-identical numbers with 1 or 2 shards); synchronous mode (--staleness 0) with two
 * workers of unequal step counts completes (no deadlock) under a time limit, also with
 * checkpoints (collective barriers between clocks) and bounded staleness 1.
 * 120k training rows: with fewer (48k) the async runs lag by ~0.05 AUC (early training is steep
 * and two workers add staleness), see the report.
 */
#include "cli_util.h"

int main(void)
{
    if (cli_init("train_workers") != 0) return 1;
    if (make_criteo("ds", 150000, 3, 0.2) != 0) return check_done();
    const char *common = "train --train ds/train --eval ds/eval --model mlp --batch 512 --no-progress";
    double auc1 = NAN, auc2 = NAN;
    char a1[64] = "", a1s[64] = "";
    int rc = run_limit(240, "%s --workers 1 --shards 1 --out w1", common);
    CHECK(rc == 0);
    if (rc == 0) {
        auc1 = jnum(last_line(), "auc");
        json_raw(last_line(), "auc", a1, sizeof a1);
        fprintf(stderr, "    %s\n", last_line());
    }
    rc = run_limit(240, "%s --workers 1 --shards 2 --out w1s2", common);
    CHECK(rc == 0);
    if (rc == 0) json_raw(last_line(), "auc", a1s, sizeof a1s);
    CHECK_MSG(strcmp(a1, a1s) == 0, "one worker: auc %s with one shard, %s with two", a1, a1s);

    rc = run_limit(240, "%s --workers 2 --shards 2 --out w2", common);
    CHECK(rc == 0);
    if (rc == 0) {
        const char *j = last_line();
        fprintf(stderr, "    %s\n", j);
        auc2 = jnum(j, "auc");
        CHECK(jnum(j, "workers") == 2 && jnum(j, "shards") == 2);
        CHECK_MSG(jnum(j, "rows") == 119959 || jnum(j, "rows") > 100000, "rows %g", jnum(j, "rows"));
    }
    fprintf(stderr, "AUC 1 worker %.4f, 2 workers %.4f, gap %.4f\n", auc1, auc2, auc1 - auc2);
    CHECK_MSG(fabs(auc1 - auc2) <= 0.02, "2 workers AUC %.4f vs 1 worker %.4f", auc2, auc1);

    /* Synchronous and bounded-staleness modes finish; worker 0 has more steps than worker 1. */
    rc = run_limit(120, "%s --workers 2 --shards 2 --staleness 0 --out ws0", common);
    CHECK_MSG(rc == 0, "--staleness 0 --workers 2: exit %d%s", rc, rc == 124 ? " (timed out: deadlock?)" : "");
    if (rc == 0) CHECK(jnum(last_line(), "auc") > 0.6);
    rc = run_limit(120, "%s --workers 2 --shards 1 --staleness 0 --max-steps 60 --checkpoint-every 7 "
                   "--out ws0c", common);
    CHECK_MSG(rc == 0, "--staleness 0 with checkpoints: exit %d%s", rc, rc == 124 ? " (timed out)" : "");
    rc = run_limit(120, "%s --workers 2 --shards 2 --staleness 1 --epochs 1 --out ws1", common);
    CHECK_MSG(rc == 0, "--staleness 1: exit %d%s", rc, rc == 124 ? " (timed out)" : "");
    free(out_text);
    free(err_text);
    return check_done();
}
