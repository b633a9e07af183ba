/*
 * Checkpoint and resume ($EMBER_BIN): run A trains 40 steps with a checkpoint every 20; run B
 * trains 20 steps, then `--resume --max-steps 40 --checkpoint-every 20` in the same directory. B's
 * final AUC and logloss equal A's to the last printed digit (a one-worker run is deterministic and
 * resuming replays exactly the pulls A made after its checkpoint), for a one-table model (mlp), a
 * two-table model (deepfm) and lr. Also: A's checkpoint directories and LATEST, the resumed
 * run's step and row counts, and metrics.jsonl appended across the two halves of B. A resume
 * under other OpenBLAS kernels than its checkpoint's (or with --bf16 added or dropped) says so.
 *
 * Early pulls: a worker pulls the keys its previous batch did not have before that batch is
 * pushed, except across a checkpoint. A run checkpointing after every step (no early pulls)
 * must end with the same checkpoint, byte for byte, as one checkpointing only at its end.
 * Likewise a run with the tower mirrored in the worker (the default for one worker) and one
 * without (--no-dense-mirror), and one evaluating every few steps (--eval-every).
 */
#include <stdbool.h>
#include <sys/stat.h>

#include "cli_util.h"

static void check_latest(const char *run, const char *want)
{
    char path[256];
    snprintf(path, sizeof path, "%s/ckpt/LATEST", run);
    char *s = slurp_sealed(path);
    CHECK_MSG(s && strcmp(s, want) == 0, "%s is '%s', expected '%s'", path, s ? s : "(missing)",
              want);
    free(s);
}

static void same_field(const char *a, const char *b, const char *key, const char *model)
{
    char x[64] = "?", y[64] = "?";
    CHECK(json_raw(a, key, x, sizeof x) == 0);
    CHECK(json_raw(b, key, y, sizeof y) == 0);
    CHECK_MSG(strcmp(x, y) == 0, "%s: %s %s straight through, %s resumed", model, key, x, y);
}

/* More arguments for every run of resume_case ("--bf16" for its bf16 round), and what its run
 * directories' names get for them (each round its own). */
static const char *resume_extra = "", *resume_tag = "";

static void resume_case(const char *model, unsigned batch, unsigned epochs, unsigned mid,
                        unsigned total)
{
    char tag[64];
    snprintf(tag, sizeof tag, "%s-%u-%u%s%s", model, batch, mid, *resume_extra ? "-" : "",
             resume_tag);
    char a[4096] = "", b[4096] = "", common[256];
    snprintf(common, sizeof common, "--train ds/train --eval ds/eval --no-progress %s",
             resume_extra);
    int rc = run("train %s --model %s --batch %u --epochs %u --max-steps %u --checkpoint-every %u "
                 "--out A-%s",
                 common, model, batch, epochs, total, mid, tag);
    CHECK_MSG(rc == 0, "%s: run A exit %d", model, rc);
    snprintf(a, sizeof a, "%s", last_line());
    fprintf(stderr, "    A: %s\n", a);
    char p[256];
    char want[64];
    snprintf(p, sizeof p, "A-%s/ckpt/step-%u", tag, mid);
    CHECK_MSG(exists(p), "%s missing", p);
    snprintf(p, sizeof p, "A-%s/ckpt/step-%u", tag, total);
    CHECK_MSG(exists(p), "%s missing", p);
    snprintf(p, sizeof p, "A-%s", tag);
    snprintf(want, sizeof want, "step-%u\n", total);
    check_latest(p, want);
    CHECK(jnum(a, "steps") == total);

    rc = run("train %s --model %s --batch %u --epochs %u --max-steps %u --out B-%s", common, model,
             batch, epochs, mid, tag);
    CHECK_MSG(rc == 0, "%s: run B (first half) exit %d", model, rc);
    CHECK(jnum(last_line(), "steps") == mid);
    /* Half a line, as a run killed while writing one leaves it: the resume drops it. */
    char mp[8192];
    snprintf(mp, sizeof mp, "%s/B-%s/metrics.jsonl", dir, tag);
    FILE *mf = fopen(mp, "a");
    CHECK(mf != NULL && fputs("{\"step\":1", mf) >= 0 && fclose(mf) == 0);
    double rows_first = jnum(last_line(), "rows");
    snprintf(p, sizeof p, "B-%s", tag);
    snprintf(want, sizeof want, "step-%u\n", mid);
    check_latest(p, want);
    /* The same --checkpoint-every as A: a checkpoint also refreshes the next batch's pull. */
    rc = run(
        "train %s --model %s --batch %u --epochs %u --resume --max-steps %u --checkpoint-every %u "
        "--out B-%s",
        common, model, batch, epochs, total, mid, tag);
    CHECK_MSG(rc == 0, "%s: run B (resumed) exit %d", model, rc);
    snprintf(b, sizeof b, "%s", last_line());
    fprintf(stderr, "    B: %s\n", b);
    same_field(a, b, "auc", model);
    same_field(a, b, "logloss", model);
    same_field(a, b, "eval_rows", model);
    CHECK_MSG(jnum(b, "steps") == total, "%s: resumed run ends at step %g", model,
              jnum(b, "steps"));
    CHECK_MSG(jnum(b, "rows") + rows_first == jnum(a, "rows"),
              "%s: resumed run trained %g rows after %g, straight through %g", model,
              jnum(b, "rows"), rows_first, jnum(a, "rows"));
    snprintf(want, sizeof want, "step-%u\n", total);
    check_latest(p, want);

    /* metrics.jsonl: the first half's lines, then the resumed half's, steps increasing. */
    snprintf(p, sizeof p, "B-%s/metrics.jsonl", tag);
    char *m = slurp(p);
    CHECK_MSG(m != NULL, "%s missing", p);
    if (m) {
        int saw20 = 0, saw40 = 0;
        double prev = 0;
        for (char *s = m; (s = strstr(s, "{\"step\":")) != NULL; s++) {
            const char *nl = strchr(s, '\n'), *auc = strstr(s, "\"auc\":");
            if (auc && (!nl || auc < nl)) continue; /* an evaluation: the step it followed */
            double st = strtod(s + 8, NULL);
            CHECK_MSG(st > prev, "%s: step %g after %g", p, st, prev);
            prev = st;
            saw20 |= st == mid;
            saw40 |= st == total;
        }
        CHECK_MSG(saw20 && saw40, "%s lacks step 20 or step 40:\n%s", p, m);
        for (char *s = m; *s;) { /* every line a whole object */
            char *nl = strchr(s, '\n');
            size_t n = nl ? (size_t)(nl - s) : strlen(s);
            CHECK_MSG(nl != NULL && n > 1 && s[0] == '{' && s[n - 1] == '}',
                      "%s: a line that is not a whole object: %.*s", p, (int)n, s);
            s += n + (nl != NULL);
        }
    }
    free(m);
}

/* The "rows N" line of a snapshot's table MANIFEST (-1 when missing). */
static long snapshot_rows(const char *run, unsigned step, const char *table)
{
    char p[512];
    snprintf(p, sizeof p, "%s/ckpt/step-%u/shard-0/table-%s/MANIFEST", run, step, table);
    char *m = slurp(p);
    const char *r = m ? strstr(m, "\nrows ") : NULL;
    long n = r ? strtol(r + 6, NULL, 10) : -1;
    free(m);
    return n;
}

/* The same command five times: the same AUC and logloss, and the same snapshots (row counts). A
 * run that stops at --max-steps must not leave state that depends on how far the prefetch
 * thread got (see the report: speculative pulls create rows that evaluation then reads). */
static void repeatable(void)
{
    char first[4096] = "";
    long r10 = -2, r20 = -2;
    int same_json = 1, same_rows = 1;
    for (int i = 0; i < 5; i++) {
        char out[64];
        snprintf(out, sizeof out, "R%d", i);
        int rc = run("train --train ds/train --eval ds/eval --no-progress --model mlp --batch 1024 "
                     "--max-steps 20 --checkpoint-every 10 --out %s",
                     out);
        CHECK(rc == 0);
        char a[64] = "", l[64] = "";
        json_raw(last_line(), "auc", a, sizeof a);
        json_raw(last_line(), "logloss", l, sizeof l);
        char key[160];
        snprintf(key, sizeof key, "auc %s logloss %s", a, l);
        long n10 = snapshot_rows(out, 10, "emb"), n20 = snapshot_rows(out, 20, "emb");
        fprintf(stderr, "    run %d: %s, snapshot rows step-10 %ld step-20 %ld\n", i, key, n10,
                n20);
        CHECK(n10 > 0 && n20 > 0);
        if (i == 0) {
            snprintf(first, sizeof first, "%s", key);
            r10 = n10;
            r20 = n20;
        } else {
            same_json &= strcmp(first, key) == 0;
            same_rows &= n10 == r10 && n20 == r20;
        }
    }
    CHECK_MSG(same_json, "the same one-worker command gave different AUC/logloss");
    CHECK_MSG(same_rows, "the same one-worker command left snapshots with different row counts");
}

/* Whether dir/a and dir/b hold the same bytes. */
static int same_bytes(const char *a, const char *b)
{
    char pa[8192], pb[8192];
    snprintf(pa, sizeof pa, "%s/%s", dir, a);
    snprintf(pb, sizeof pb, "%s/%s", dir, b);
    void *x = NULL, *y = NULL;
    size_t nx = 0, ny = 0;
    char *err = NULL;
    int ok = cm_read_file(pa, &x, &nx, &err) == 0 && cm_read_file(pb, &y, &ny, &err) == 0 &&
             nx == ny && memcmp(x, y, nx) == 0;
    if (!ok) fprintf(stderr, "    %s and %s differ%s%s\n", a, b, err ? ": " : "", err ? err : "");
    free(err);
    free(x);
    free(y);
    return ok;
}

/* Runs ra and rb left the same bytes in `files` of each checkpoint every `every` steps up to
 * `steps`; `what` names the difference between the runs. */
static void same_ckpts(const char *ra, const char *rb, unsigned every, unsigned steps,
                       const char *const *files, const char *what)
{
    for (unsigned step = every; step <= steps; step += every)
        for (const char *const *f = files; *f; f++) {
            char a[256], b[256];
            snprintf(a, sizeof a, "%s/ckpt/step-%u/%s", ra, step, *f);
            snprintf(b, sizeof b, "%s/ckpt/step-%u/%s", rb, step, *f);
            CHECK_MSG(same_bytes(a, b), "%s changed %s", what, b);
        }
}

static void early_pulls(const char *model, const char *const *files)
{
    const unsigned steps = 12;
    for (int every_step = 0; every_step < 2; every_step++) {
        int rc = run("train --train ds/train --eval ds/eval --no-progress --model %s --batch 1024 "
                     "--max-steps %u --checkpoint-every %u --keep-checkpoints 1 --out E%d-%s",
                     model, steps, every_step ? 1 : steps, every_step, model);
        CHECK_MSG(rc == 0, "%s: run exit %d", model, rc);
    }
    char ra[64], rb[64], what[64];
    snprintf(ra, sizeof ra, "E0-%s", model);
    snprintf(rb, sizeof rb, "E1-%s", model);
    snprintf(what, sizeof what, "%s: early pulls", model);
    same_ckpts(ra, rb, steps, steps, files, what);
}

/* A lone worker mirrors the tower (ps_client_dense_mirror): applying the update to its own
 * copy must give the PS's bits, so a run without the mirror ends with the same checkpoint,
 * byte for byte (the tower and its Adam state included), and the same AUC. */
static void dense_mirror(const char *model, const char *const *files)
{
    const unsigned steps = 12;
    char line[2][8192];
    for (int off = 0; off < 2; off++) {
        int rc = run("train --train ds/train --eval ds/eval --no-progress --model %s --batch 1024 "
                     "--max-steps %u --checkpoint-every 6 %s --out M%d-%s",
                     model, steps, off ? "--no-dense-mirror" : "", off, model);
        CHECK_MSG(rc == 0, "%s: run exit %d", model, rc);
        snprintf(line[off], sizeof line[off], "%s", last_line());
    }
    same_field(line[0], line[1], "auc", model);
    same_field(line[0], line[1], "logloss", model);
    char ra[64], rb[64], what[64];
    snprintf(ra, sizeof ra, "M0-%s", model);
    snprintf(rb, sizeof rb, "M1-%s", model);
    snprintf(what, sizeof what, "%s: the dense mirror", model);
    same_ckpts(ra, rb, 6, steps, files, what);
}

/* The metrics.jsonl line of an evaluation at `step` (NULL when none): a pointer into m. */
static const char *eval_line(const char *m, unsigned step)
{
    char pat[64];
    snprintf(pat, sizeof pat, "{\"step\":%u,", step);
    for (const char *s = m; s && (s = strstr(s, pat)) != NULL; s++) {
        const char *nl = strchr(s, '\n'), *a = strstr(s, "\"auc\":");
        if (a && (!nl || a < nl)) return s;
    }
    return NULL;
}

/* --eval-every: worker 0 evaluates every N steps with read-only pulls, so training is not
 * disturbed (the checkpoints are the same bytes as M0-<model>'s, dense_mirror's run without
 * it), and each evaluation is exact: the one at step 6 gives the AUC and logloss of a run that
 * stops at step 6. metrics.jsonl gets an eval line for steps 4, 8 and the final 12, the final
 * one's figures are the printed result's, and the progress lines show the AUC so far. */
static void periodic_eval(const char *model, const char *const *files)
{
    const unsigned steps = 12;
    const char *common = "--train ds/train --eval ds/eval --no-progress --batch 1024 "
                         "--checkpoint-every 6";
    int rc = run("train %s --model %s --max-steps %u --eval-every 4 --out V-%s", common, model,
                 steps, model);
    CHECK_MSG(rc == 0, "%s: run with --eval-every exit %d", model, rc);
    char final[8192];
    snprintf(final, sizeof final, "%s", last_line());
    CHECK_MSG(err_has(" auc 0."), "%s: the progress lines show no AUC so far", model);
    char ra[64], rb[64], what[64];
    snprintf(ra, sizeof ra, "M0-%s", model);
    snprintf(rb, sizeof rb, "V-%s", model);
    snprintf(what, sizeof what, "%s: --eval-every", model);
    same_ckpts(ra, rb, 6, steps, files, what);
    char p[256];
    snprintf(p, sizeof p, "V-%s/metrics.jsonl", model);
    char *m = slurp(p);
    CHECK_MSG(m != NULL, "%s missing", p);
    const char *e4 = eval_line(m, 4), *e8 = eval_line(m, 8), *e12 = eval_line(m, 12);
    CHECK_MSG(e4 && e8 && e12, "%s: no eval line at step 4, 8 or 12:\n%s", p, m ? m : "");
    CHECK_MSG(!eval_line(m, 6), "%s: an eval line at step 6 without --eval-every 6", p);
    if (e12) {
        char line[512];
        snprintf(line, sizeof line, "%.*s", (int)strcspn(e12, "\n"), e12);
        same_field(final, line, "auc", model);
        same_field(final, line, "logloss", model);
        CHECK_MSG(strstr(line, "\"final\":true") != NULL, "%s: final eval line %s", p, line);
    }
    free(m);
    /* Exact mid-run: the step-6 evaluation of a run with --eval-every 6 is a 6-step run's. */
    rc = run("train %s --model %s --max-steps 6 --out V6-%s", common, model, model);
    CHECK_MSG(rc == 0, "%s: 6-step run exit %d", model, rc);
    snprintf(final, sizeof final, "%s", last_line());
    rc = run("train %s --model %s --max-steps %u --eval-every 6 --out V12-%s", common, model, steps,
             model);
    CHECK_MSG(rc == 0, "%s: run with --eval-every 6 exit %d", model, rc);
    snprintf(p, sizeof p, "V12-%s/metrics.jsonl", model);
    m = slurp(p);
    const char *e6 = m ? eval_line(m, 6) : NULL;
    CHECK_MSG(e6 != NULL, "%s: no eval line at step 6", p);
    if (e6) {
        char line[512];
        snprintf(line, sizeof line, "%.*s", (int)strcspn(e6, "\n"), e6);
        same_field(final, line, "auc", model);
        same_field(final, line, "logloss", model);
    }
    free(m);
}

/* Replaces the kernels line of dir/name (a worker's position file) with `tag`, sealed again. */
static void set_kernels(const char *name, const char *tag)
{
    char *text = NULL, *err = NULL, path[8192];
    size_t n = 0;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    CHECK_MSG(cm_read_sealed(path, &text, &n, &err) == CM_OK, "%s", err ? err : "");
    const char *k = text ? strstr(text, "\nkernels ") : NULL;
    CHECK_MSG(k != NULL, "%s has no kernels line", path);
    if (k != NULL) {
        const char *end = strchr(k + 1, '\n');
        char out[4096];
        int m = snprintf(out, sizeof out, "%.*s\nkernels %s%s", (int)(k - text), text, tag,
                         end ? end : "\n");
        CHECK(m > 0 && (size_t)m < sizeof out &&
              cm_write_sealed(path, out, (size_t)m, &err) == CM_OK);
    }
    free(text);
    free(err);
}

/* ember's own kernels are one tag, cpu/ember, with AVX-512 or AVX2 (the same bits): a checkpoint
 * from before the AVX2 GEMM, which says cpu/ember-avx512, resumes silently; one computed by
 * OpenBLAS's kernels does not. */
static void kernels_own_tag(void)
{
    /* The CPU's kernels (a host with a GPU would train on it by default). */
    const char *common = "--train ds/train --model mlp --batch 512 --checkpoint-every 2 --out KT "
                         "--no-progress --device cpu";
    CHECK(run("train %s --max-steps 2", common) == 0);
    char *pos = slurp_sealed("KT/ckpt/step-2/worker-0.pos");
    bool own = pos != NULL && strstr(pos, "\nkernels cpu/ember\n") != NULL;
    free(pos);
    if (!own) {
        fprintf(stderr, "train_resume: SKIP the cpu/ember tag: ember's own GEMM does not run on "
                        "this CPU\n");
        return;
    }
    set_kernels("KT/ckpt/step-2/worker-0.pos", "cpu/ember-avx512");
    CHECK(run("train %s --max-steps 4 --resume", common) == 0);
    CHECK_MSG(!err_has("not bit for bit"), "a checkpoint tagged cpu/ember-avx512 warned");
    set_kernels("KT/ckpt/step-4/worker-0.pos", "cpu/Haswell");
    CHECK(run("train %s --max-steps 6 --resume", common) == 0);
    CHECK_MSG(err_has("not bit for bit"), "a checkpoint of OpenBLAS's kernels did not warn");
}

/* A resume under the checkpoint's OpenBLAS kernels is silent; under others it says that the run
 * goes on but not bit for bit (OPENBLAS_CORETYPE, which ember keeps when it is set: Prescott
 * and Core2 run on any x86-64). Where ember's own GEMM runs (the kernels recorded as
 * cpu/ember, AVX-512 or AVX2), OpenBLAS's core changes no bit, and the resume stays silent. */
static void kernels_warning(void)
{
    const char *common = "--train ds/train --model mlp --batch 512 --checkpoint-every 2 --out K "
                         "--no-progress --device cpu";
    CHECK(run("train %s --max-steps 4", common) == 0);
    CHECK(run("train %s --max-steps 6 --resume", common) == 0);
    CHECK_MSG(!err_has("not bit for bit"), "a resume under the same kernels warned");
    char *pos = slurp_sealed("K/ckpt/step-6/worker-0.pos");
    CHECK_MSG(pos != NULL && strstr(pos, "\nkernels cpu/") != NULL, "position file: %s",
              pos ? pos : "(missing)");
    const char *other = pos != NULL && strstr(pos, "cpu/Prescott") ? "Core2" : "Prescott";
    /* Where ember's own GEMM runs, OpenBLAS's core computes nothing of the model. */
    bool own = pos != NULL && strstr(pos, "\nkernels cpu/ember") != NULL;
    free(pos);
    setenv("OPENBLAS_CORETYPE", other, 1);
    CHECK(run("train %s --max-steps 8 --resume", common) == 0);
    if (own)
        CHECK_MSG(!err_has("not bit for bit"),
                  "a resume under OpenBLAS's %s kernels warned, but ember's own GEMM ran", other);
    else
        CHECK_MSG(err_has("not bit for bit"), "a resume under %s kernels did not say so", other);
    unsetenv("OPENBLAS_CORETYPE");
    /* bf16 GEMMs are other kernels too: recorded, silent when kept, said when dropped. */
    if (cm_gemm_bf16_available()) {
        CHECK(run("train %s --max-steps 10 --resume --bf16", common) == 0);
        CHECK(run("train %s --max-steps 12 --resume --bf16", common) == 0);
        CHECK_MSG(!err_has("not bit for bit"), "a bf16 resume of a bf16 checkpoint warned");
        pos = slurp_sealed("K/ckpt/step-12/worker-0.pos");
        CHECK_MSG(pos != NULL && strstr(pos, "+bf16\n") != NULL, "position file: %s",
                  pos ? pos : "(missing)");
        free(pos);
        CHECK(run("train %s --max-steps 14 --resume", common) == 0);
        CHECK_MSG(err_has("not bit for bit"), "an fp32 resume of a bf16 checkpoint did not say so");
    }
}

/* Rows in a checkpoint's table over its shards (the snapshots' MANIFEST "rows" lines). */
static long ckpt_rows(const char *ckpt, unsigned shards, const char *table)
{
    long total = 0;
    for (unsigned i = 0; i < shards; i++) {
        char p[512];
        snprintf(p, sizeof p, "%s/shard-%u/table-%s/MANIFEST", ckpt, i, table);
        char *m = slurp(p);
        const char *r = m ? strstr(m, "\nrows ") : NULL;
        total = r && total >= 0 ? total + strtol(r + 6, NULL, 10) : -1;
        free(m);
    }
    return total;
}

/* Whether run/ckpt/step-8 is spread over exactly n shards. */
static int shards_of_step8(const char *run, unsigned n)
{
    char a[256], b[256];
    snprintf(a, sizeof a, "%s/ckpt/step-8/shard-%u", run, n - 1);
    snprintf(b, sizeof b, "%s/ckpt/step-8/shard-%u", run, n);
    return exists(a) && !exists(b);
}

/* reshard --out (S3 holds `reshard --from S2 --shards 3`): a directory holding another run's
 * checkpoints (T: its own step-8, which the reshard would replace whole, and a LATEST it would
 * repoint) or a reshard of another checkpoint is refused, naming it, and left as it was; an
 * empty directory is written, and so is the same reshard's earlier output (again, with another
 * shard count and back). */
static void reshard_out_case(const char *common)
{
    CHECK(run("train %s --shards 1 --max-steps 8 --out T", common) == 0);
    char *t_pos = slurp("T/ckpt/step-8/worker-0.pos");
    int rc = run("reshard --from S2 --shards 3 --out T");
    CHECK_MSG(rc == 2 && err_has("T is a folder that holds") && err_has("not replacing it"),
              "reshard into another run's directory: exit %d", rc);
    char *latest = slurp_sealed("T/ckpt/LATEST"), *pos = slurp("T/ckpt/step-8/worker-0.pos");
    CHECK_MSG(shards_of_step8("T", 1) && latest && !strcmp(latest, "step-8\n") && t_pos && pos &&
                  !strcmp(t_pos, pos) && exists("T/ckpt/step-4"),
              "a refused reshard changed T's checkpoints");
    free(latest);
    free(pos);
    free(t_pos);
    rc = run("reshard --from T --shards 2 --out S3");
    CHECK_MSG(rc == 2 && err_has("--out S3 holds a reshard of another checkpoint"),
              "reshard of T into S2's reshard: exit %d", rc);
    CHECK_MSG(shards_of_step8("S3", 3), "a refused reshard replaced S3/ckpt/step-8");
    char p[8300];
    snprintf(p, sizeof p, "%s/E", dir);
    CHECK(mkdir(p, 0755) == 0);
    CHECK_MSG(run("reshard --from S2 --shards 2 --out E") == 0, "into an empty directory: %s",
              err_text);
    CHECK(shards_of_step8("E", 2) && exists("E/ckpt/step-8/model.txt"));
    CHECK_MSG(run("reshard --from ./S2/ckpt/step-8 --shards 4 --out S3") == 0,
              "the same reshard again (4 shards): %s", err_text);
    CHECK(shards_of_step8("S3", 4));
    CHECK_MSG(run("reshard --from S2 --shards 3 --out S3/") == 0,
              "the same reshard again (3 shards): %s", err_text);
    CHECK(shards_of_step8("S3", 3));
    long r2 = ckpt_rows("S2/ckpt/step-8", 2, "emb"), r3 = ckpt_rows("S3/ckpt/step-8", 3, "emb");
    CHECK_MSG(r2 > 0 && r2 == r3, "rows after resharding again: %ld on 2 shards, %ld on 3", r2, r3);
    /* A reshard that fails after its shards are written (here: the source's model.txt is
     * damaged, found when the side files are copied) leaves the checkpoint in place whole: the
     * new one is assembled aside. Before, its shards had already replaced S3's step-8, which
     * LATEST names, leaving it without model.txt, run.txt or positions. */
    char *model = slurp("S2/ckpt/step-8/model.txt");
    snprintf(p, sizeof p, "%s/S2/ckpt/step-8/model.txt", dir);
    FILE *f = model ? fopen(p, "w") : NULL;
    CHECK(f && fprintf(f, "X%s", model + 1) > 0 && fclose(f) == 0);
    rc = run("reshard --from S2 --shards 4 --out S3");
    CHECK_MSG(rc == 1 && err_has("model.txt"), "reshard with a damaged model.txt: exit %d, %s", rc,
              err_text);
    CHECK_MSG(shards_of_step8("S3", 3) && exists("S3/ckpt/step-8/model.txt") &&
                  exists("S3/ckpt/step-8/run.txt") && exists("S3/ckpt/step-8/worker-0.pos") &&
                  !exists("S3/ckpt/step-8.tmp"),
              "a failed reshard left S3/ckpt/step-8 changed or incomplete");
    f = model ? fopen(p, "w") : NULL;
    CHECK(f && fputs(model, f) >= 0 && fclose(f) == 0);
    free(model);
}

/* ember reshard: a 2-shard checkpoint spread over 3 shards keeps every row, carries model.txt,
 * the positions and run.txt (its shard count made 3, so a resume still checks the rest), and
 * resumes on 3 shards to the same AUC and logloss as the 2-shard run resumed (each row's
 * updates do not depend on which shard holds it). Damaged side files are refused, not copied,
 * and so is an --out that is --from's own run directory. */
static void reshard_case(void)
{
    const char *common = "--train ds/train --eval ds/eval --model mlp --batch 512 --no-progress "
                         "--checkpoint-every 4";
    CHECK(run("train %s --shards 2 --max-steps 8 --out S2", common) == 0);
    CHECK_MSG(run("reshard --from S2 --shards 3 --out S3") == 0, "reshard: %s", err_text);
    char *latest = slurp_sealed("S3/ckpt/LATEST"), *run3 = slurp_sealed("S3/ckpt/step-8/run.txt");
    char *run2 = slurp_sealed("S2/ckpt/step-8/run.txt");
    CHECK_MSG(latest && strcmp(latest, "step-8\n") == 0, "S3 LATEST: %s", latest ? latest : "-");
    CHECK_MSG(run3 && strstr(run3, "\nshards 3\n") && run2 && strstr(run2, "\nshards 2\n"),
              "run.txt after reshard: %s", run3 ? run3 : "(missing)");
    CHECK(exists("S3/ckpt/step-8/model.txt") && exists("S3/ckpt/step-8/worker-0.pos"));
    long r2 = ckpt_rows("S2/ckpt/step-8", 2, "emb"), r3 = ckpt_rows("S3/ckpt/step-8", 3, "emb");
    CHECK_MSG(r2 > 0 && r2 == r3, "rows: %ld on 2 shards, %ld on 3", r2, r3);
    free(latest);
    free(run2);
    free(run3);
    /* --out naming --from's own run directory (however spelt) would replace the checkpoint
     * being read by one without model.txt, run.txt or positions: refused, nothing touched. */
    const char *same[] = {"--from S2 --out S2", "--from S2/ckpt/step-8 --out ./S2/"};
    for (int i = 0; i < 2; i++) {
        int rs = run("reshard %s --shards 3", same[i]);
        CHECK_MSG(rs == 2 && err_has("--out") && err_has("write over the checkpoint"),
                  "reshard %s: exit %d, %s", same[i], rs, err_text);
    }
    CHECK_MSG(exists("S2/ckpt/step-8/model.txt") && exists("S2/ckpt/step-8/run.txt") &&
                  exists("S2/ckpt/step-8/worker-0.pos") && !exists("S2/ckpt/step-8/shard-2"),
              "a refused reshard into S2 changed S2/ckpt/step-8");
    reshard_out_case(common);
    CHECK(run("train %s --shards 3 --max-steps 12 --resume --out S3", common) == 0);
    char *a3 = strdup(last_line());
    CHECK(run("train %s --shards 2 --max-steps 12 --resume --out S2", common) == 0);
    same_field(last_line(), a3, "auc", "reshard 2 -> 3");
    same_field(last_line(), a3, "logloss", "reshard 2 -> 3");
    free(a3);
    int rc = run("train %s --shards 3 --max-steps 16 --resume --out S3 --batch 256", common);
    CHECK_MSG(rc == 1 && err_has("batch 256 (checkpoint 512)"),
              "resharded resume, other batch: "
              "%d",
              rc);
    rc = run("train %s --shards 2 --max-steps 16 --resume --out S3", common);
    CHECK_MSG(rc == 1 && err_has("shards 2 (checkpoint 3)"), "resharded resume, 2 shards: %d", rc);
    /* S3 is a run now (step-12, metrics.jsonl): no longer an earlier reshard to replace. */
    rc = run("reshard --from S2/ckpt/step-8 --shards 3 --out S3");
    CHECK_MSG(rc == 2 && err_has("--out S3 holds") && err_has("not writing into it"),
              "reshard into a resumed run: exit %d", rc);
    latest = slurp_sealed("S3/ckpt/LATEST");
    CHECK_MSG(latest && !strcmp(latest, "step-12\n"), "a refused reshard repointed S3's LATEST: %s",
              latest ? latest : "(missing)");
    free(latest);
    char *pos = slurp("S2/ckpt/step-12/worker-0.pos");
    if (pos && strlen(pos) > 5 && pos[5] >= '0' && pos[5] <= '9') {
        pos[5] = pos[5] == '1' ? '2' : '1';
        char p[8300];
        snprintf(p, sizeof p, "%s/S2/ckpt/step-12/worker-0.pos", dir);
        FILE *f = fopen(p, "w");
        if (f) fputs(pos, f), fclose(f);
        rc = run("reshard --from S2 --shards 3 --out S4");
        CHECK_MSG(rc == 1 && err_has("worker-0.pos: checksum mismatch"), "damaged pos: %d", rc);
    } else {
        CHECK_MSG(0, "S2's step-12 position: %s", pos ? pos : "(missing)");
    }
    free(pos);
}

/* A worker's position in a checkpoint (worker-<w>.pos), or -1. */
static long pos_of(const char *ckpt, unsigned w)
{
    char path[256];
    snprintf(path, sizeof path, "%s/worker-%u.pos", ckpt, w);
    char *s = slurp_sealed(path);
    unsigned long v = 0;
    long step = s && sscanf(s, "step %lu", &v) == 1 ? (long)v : -1;
    free(s);
    return step;
}

/* Workers of unequal step counts (3 blocks of 100 rows, batch 50: worker 0 reads 4 batches an
 * epoch, worker 1 2) end a run at different positions: the final checkpoint step-4 holds 4 and
 * 2. Resuming from it with more epochs and --checkpoint-every 3 must checkpoint only at steps
 * every worker passes (after 4): before, worker 1 checkpointed alone at step 3, which worker 0
 * (starting at 4) never reached, and the run failed ("cannot create .../step-3.tmp/..."). */
static void uneven_final_resume(void)
{
    CHECK(run("gen --rows 300 --seed 5 --out uneven.tsv") == 0);
    CHECK(run("ingest --format criteo --block-rows 100 --out uneven uneven.tsv") == 0);
    const char *common =
        "train --train uneven/train --model lr --batch 50 --workers 2 --no-progress";
    int rc = run("%s --epochs 1 --out U", common);
    CHECK_MSG(rc == 0, "first run: exit %d: %s", rc, err_text);
    CHECK(pos_of("U/ckpt/step-4", 0) == 4 && pos_of("U/ckpt/step-4", 1) == 2);
    rc = run("%s --epochs 5 --checkpoint-every 3 --resume --out U", common);
    CHECK_MSG(rc == 0, "resume with more epochs: exit %d: %s", rc, err_text);
    CHECK_MSG(!exists("U/ckpt/step-3"), "a checkpoint at step 3, before worker 0's start");
    CHECK(pos_of("U/ckpt/step-9", 0) == 9 && pos_of("U/ckpt/step-9", 1) == 9);
    CHECK(pos_of("U/ckpt/step-20", 0) == 20 && pos_of("U/ckpt/step-20", 1) == 10);
}

/* The bytes of dir/name (NULL when missing; *n its length). */
static void *bytes_of(const char *name, size_t *n)
{
    char p[8300];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    void *b = NULL;
    return cm_read_file(p, &b, n, NULL) == CM_OK ? b : NULL;
}

/* Writes n bytes to dir/name (plainly: a damaged copy). */
static void put_bytes(const char *name, const void *b, size_t n)
{
    char p[8300];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    CHECK(f != NULL && fwrite(b, 1, n, f) == n && fclose(f) == 0);
}

/* --push-codec int8: the worker keeps each row's quantisation residual and adds it into that
 * row's next push (error feedback), so the checkpoint holds them (worker-<w>.ef) and a resume
 * continues bit for bit: with zero residuals it did not (AUC and logloss differed in the last
 * digits). deepfm: two tables, so two sets of residuals. An fp32 checkpoint has no such file. A
 * damaged or truncated one is refused, naming it; ember reshard carries it along, and refuses it
 * damaged. An int8 checkpoint without it (written before it was) resumes with zero residuals,
 * saying so. */
static void int8_resume(void)
{
    /* A residual budget that binds (8 MiB a table: ~52K rows of the emb table's dim 16, a few
     * steps' keys), so rows are dropped before and after the resume, and the same ones. */
    resume_extra = "--push-codec int8 --residual-memory 16M";
    resume_tag = "int8";
    resume_case("deepfm", 512, 1, 20, 40);
    resume_extra = resume_tag = "";
    size_t ln = 0;
    char *log = (char *)bytes_of("A-deepfm-512-20-int8/logs/train.log", &ln), *at = NULL;
    for (char *p = log; p && (p = strstr(p, "int8 residuals: ")) != NULL; p++)
        at = p; /* the last checkpoint's */
    unsigned long long held = 0, bytes = 0, dropped = 0;
    CHECK_MSG(at &&
                  sscanf(at, "int8 residuals: %llu rows, %llu bytes, %llu dropped", &held, &bytes,
                         &dropped) == 3 &&
                  held > 0 && bytes <= (16ull << 20) && dropped > 0,
              "train.log of an int8 run with --residual-memory 16M: %s",
              at ? at : "(no residual line)");
    free(log);
    CHECK_MSG(exists("A-deepfm-512-20-int8/ckpt/step-20/worker-0.ef") &&
                  exists("B-deepfm-512-20-int8/ckpt/step-40/worker-0.ef"),
              "an int8 run's checkpoint has no worker-0.ef");
    CHECK_MSG(!exists("A-deepfm-512-20/ckpt/step-40/worker-0.ef"), "an fp32 checkpoint has a .ef");
    /* Straight through and resumed, the last checkpoint's residuals are the same bytes. */
    CHECK(same_bytes("A-deepfm-512-20-int8/ckpt/step-40/worker-0.ef",
                     "B-deepfm-512-20-int8/ckpt/step-40/worker-0.ef"));

    const char *ef = "B-deepfm-512-20-int8/ckpt/step-40/worker-0.ef";
    size_t n = 0;
    unsigned char *good = bytes_of(ef, &n);
    CHECK_MSG(good != NULL && n > 64, "%s: %zu bytes", ef, n);
    if (good == NULL || n <= 64) return;
    fprintf(stderr, "    worker-0.ef of deepfm after 40 steps: %zu bytes\n", n);
    const char *resume = "train --train ds/train --eval ds/eval --no-progress --model deepfm "
                         "--batch 512 --epochs 1 --push-codec int8 --resume --max-steps 42 "
                         "--out B-deepfm-512-20-int8";
    unsigned char *bad = malloc(n);
    memcpy(bad, good, n);
    bad[n / 2] ^= 0x10;
    put_bytes(ef, bad, n);
    int rc = run("%s", resume);
    CHECK_MSG(rc == 1 && err_has("worker-0.ef"), "a damaged worker-0.ef: exit %d, %s", rc,
              err_text);
    put_bytes(ef, good, n - 7);
    rc = run("%s", resume);
    CHECK_MSG(rc == 1 && err_has("worker-0.ef"), "a truncated worker-0.ef: exit %d, %s", rc,
              err_text);
    put_bytes(ef, good, n);

    CHECK_MSG(run("reshard --from B-deepfm-512-20-int8 --shards 2 --out R-int8") == 0,
              "reshard: %s", err_text);
    CHECK(same_bytes(ef, "R-int8/ckpt/step-40/worker-0.ef"));
    put_bytes(ef, bad, n);
    rc = run("reshard --from B-deepfm-512-20-int8 --shards 3 --out R3-int8");
    CHECK_MSG(rc == 1 && err_has("worker-0.ef"), "reshard of a damaged worker-0.ef: exit %d, %s",
              rc, err_text);
    /* A checkpoint written before residuals were saved: resumed with none, and said so. */
    char p[8300];
    snprintf(p, sizeof p, "%s/%s", dir, ef);
    CHECK(unlink(p) == 0);
    rc = run("%s", resume);
    CHECK_MSG(rc == 0 && err_has("worker-0.ef is missing") && err_has("not bit for bit"),
              "resume without worker-0.ef: exit %d, %s", rc, err_text);
    free(bad);
    free(good);
}

int main(void)
{
    if (cli_init("train_resume") != 0) return 1;
    uneven_final_resume();
    if (make_criteo("ds", 40000, 11, 0.2) != 0) return check_done();
    resume_case("mlp", 512, 1, 20, 40);
    resume_case("deepfm", 512, 1, 20, 40);
    resume_case("dlrm", 512, 1, 20, 40);
    resume_case("lr", 256, 1, 20, 40);
    /* 32k train rows in batches of 2048: 16 steps an epoch. Resume across the epoch boundary,
     * and from a checkpoint inside the second epoch. */
    resume_case("mlp", 2048, 2, 10, 24);
    resume_case("lr", 2048, 2, 20, 28);
    /* bf16 GEMMs resume bit for bit too. */
    if (cm_gemm_bf16_available()) {
        resume_extra = "--bf16";
        resume_tag = "bf16";
        resume_case("mlp", 512, 1, 20, 40);
        resume_extra = resume_tag = "";
    }
    int8_resume();
    repeatable();
    kernels_warning();
    kernels_own_tag();
    reshard_case();
    static const char *const one_table[] = {"shard-0/MANIFEST", "shard-0/dense-tower.bin",
                                            "shard-0/table-emb/MANIFEST",
                                            "shard-0/table-emb/rows.bin", NULL};
    static const char *const two_tables[] = {"shard-0/MANIFEST", "shard-0/table-emb/rows.bin",
                                             "shard-0/table-lin/rows.bin", NULL};
    early_pulls("mlp", one_table);
    early_pulls("deepfm", two_tables);
    static const char *const dlrm_files[] = {"shard-0/dense-tower.bin",
                                             "shard-0/table-emb/rows.bin", NULL};
    dense_mirror("mlp", one_table);
    dense_mirror("dlrm", dlrm_files);
    periodic_eval("mlp", one_table);
    periodic_eval("dlrm", dlrm_files);
    free(out_text);
    free(err_text);
    return check_done();
}
