/*
 * ember train refuses bad input with a clear message ($EMBER_BIN): a missing --train directory
 * (named), a missing --train flag, eval shards whose schema differs from the training shards
 * (criteo vs avazu: the field counts named), dlrm on shards without dense features, an unknown
 * model, bad flag values (exit 2, the flag named), --resume with no checkpoint, and a run whose
 * gradients go non-finite (huge --dense-lr): it stops with a non-finite error and non-zero exit,
 * and the checkpoints an earlier run left in the same directory are untouched. A --resume with
 * other settings than the checkpoint's is refused, naming them. When one of two embedded
 * workers fails, the other stops at once and the failing one's error is reported. A config file
 * given as --config=FILE or --conf FILE is read like --config FILE; a key
 * given twice in it, or in a cluster file, is refused, and so is one before any section header.
 * A metrics file on a full disk is reported once, and the run goes on to its result.
 */
#include <sys/stat.h>
#include <unistd.h>

#include <inttypes.h>

#include "cli_util.h"

/* A small file in the test directory. */
static void write_text(const char *name, const char *text)
{
    char path[8192];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f) fputs(text, f), fclose(f);
}

/* A small file with a checksum line, as ember writes a checkpoint's text files. */
static void write_sealed(const char *name, const char *text)
{
    char path[8192], *err = NULL;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    CHECK_MSG(cm_write_sealed(path, text, strlen(text), &err) == CM_OK, "%s", err ? err : "");
    free(err);
}

/* A small Avazu CSV (no dense features, 23 fields). */
static void write_avazu(const char *name, int rows)
{
    char path[8192];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (!f) return;
    fprintf(f, "id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,app_domain,"
               "app_category,device_id,device_ip,device_model,device_type,device_conn_type,C14,C15,"
               "C16,C17,C18,C19,C20,C21\n");
    for (int i = 0; i < rows; i++)
        fprintf(f, "%d,%d,141021%02d,1005,%d,s%x,d%x,c%x,a%x,ad%x,ac%x,dv%x,ip%x,m%x,1,%d,%d,320,50,"
                   "%d,0,35,-1,%d\n", 1000 + i, i % 4 == 0, i % 24, i % 2, i % 7, i % 5, i % 3, i % 11,
                i % 4, i % 2, i % 13, i % 97, i % 17, i % 3, 15700 + i % 9, 1700 + i % 19, 70 + i % 8);
    fclose(f);
}

/* The flag must be refused before any work: exit 2, the flag and the value named. */
static void bad_flag(const char *flag, const char *value)
{
    int rc = run("train --train ds/train --eval ds/eval --model lr --max-steps 2 --out bad %s %s",
                 flag, value);
    char want[256];
    snprintf(want, sizeof want, "'%s'", value);
    CHECK_MSG(rc == 2 && strstr(err_text, flag + 2) && strstr(err_text, want),
              "%s %s: exit %d, stderr: %s", flag, value, rc, err_text);
}

static char *ckpt_listing(const char *run)
{
    char cmd[16384];
    snprintf(cmd, sizeof cmd, "cd '%s/%s/ckpt' && find . -type f | sort | xargs md5sum > '%s/listing.txt'",
             dir, run, dir);
    CHECK(system(cmd) == 0);
    return slurp("listing.txt");
}

int main(void)
{
    if (cli_init("train_bad_input") != 0) return 1;
    if (make_criteo("ds", 20000, 5, 0.2) != 0) return check_done();
    write_avazu("av.csv", 300);
    int rc = run("ingest --format avazu --eval-fraction 0.3 --out av av.csv");
    CHECK_MSG(rc == 0, "avazu ingest: %s", err_text);

    /* Missing training data. */
    rc = run("train --train no/such/dir --out r1 --no-progress");
    CHECK_MSG((rc == 1 || rc == 2) && err_has("no/such/dir"), "missing --train dir: exit %d", rc);
    char empty[8192];
    snprintf(empty, sizeof empty, "%s/empty-train", dir);
    CHECK(mkdir(empty, 0755) == 0);
    rc = run("train --train empty-train --out r1 --no-progress");
    CHECK_MSG(rc == 1 && err_has("empty-train"), "empty --train dir: exit %d, stderr: %s", rc,
              err_text);
    rc = run("train --out r1");
    CHECK_MSG(rc == 2 && err_has("--train"), "no --train: exit %d", rc);
    rc = run("train --train ds/train --eval no/such/eval --model lr --max-steps 2 --out r1 --no-progress");
    CHECK_MSG(rc == 1 && err_has("--eval: ") && err_has("no/such/eval"),
              "missing --eval dir: exit %d", rc);
    /* A run that failed before writing anything leaves no run directory behind. */
    rc = run("train --train no/such/dir --out never-made --no-progress");
    CHECK_MSG(rc != 0 && !exists("never-made"), "a failed run left never-made/ (exit %d)", rc);
    /* ... nor the parents made for it, and only those. */
    rc = run("train --train no/such/dir --out never/made/here/ --no-progress");
    CHECK_MSG(rc != 0 && !exists("never"), "a failed run left never/ (exit %d)", rc);
    CHECK(mkdir(strcat(strcpy((char[8300]){0}, dir), "/kept"), 0755) == 0);
    rc = run("train --train no/such/dir --out kept/made/here --no-progress");
    CHECK_MSG(rc != 0 && exists("kept") && !exists("kept/made"), "kept/: exit %d", rc);
    /* An --out whose checkpoint paths exceed what a SAVE carries (1024 bytes) is refused before
     * any work, naming it: it trained to its first checkpoint and failed there, work lost,
     * saying only "checkpoint path must be 1..1024 bytes". */
    char deep[1200] = "deep";
    for (int i = 0; i < 4; i++)
        strcat(strcat(deep, "/"),
               "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
               "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
               "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
               "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx");
    rc =
        run("train --train ds/train --model lr --max-steps 2 --no-progress --out %s/%s", dir, deep);
    CHECK_MSG(rc == 1 && err_has("--out") && err_has("xxx/ckpt") && !exists("deep"),
              "an --out too long for its checkpoints: exit %d, %s", rc, err_text);
    rc = run("train --train ds/train --eval-every 5 --no-progress --out bad-ee");
    CHECK_MSG(rc != 0 && err_has("--eval-every needs --eval"),
              "--eval-every without --eval: exit %d", rc);
    /* Eval shards of one class (a small or filtered eval set): the AUC is undefined, the logloss
     * is not. The run failed at its first evaluation ("auc: undefined with 0 positives"), after
     * all its training when that was the final one, with no logloss and no predictions. */
    {
        char cmd[16384];
        snprintf(cmd, sizeof cmd,
                 "cd '%s' && awk -F'\\t' '$1 == 0' ds.tsv | head -n 2000 > neg.tsv", dir);
        CHECK(system(cmd) == 0);
        rc = run("ingest --format criteo --eval-fraction 0 --out neg neg.tsv");
        CHECK_MSG(rc == 0, "ingest neg.tsv: %s", err_text);
        rc = run("train --train ds/train --eval neg/train --model lr --max-steps 6 --eval-every 3 "
                 "--out one-class --no-progress");
        char auc[64] = "";
        CHECK_MSG(rc == 0 && json_raw(last_line(), "auc", auc, sizeof auc) == 0 &&
                      strcmp(auc, "null") == 0 && jnum(last_line(), "logloss") > 0 &&
                      jnum(last_line(), "eval_rows") == 2000,
                  "one-class eval: exit %d, auc %s, stdout %s, stderr %s", rc, auc, out_text,
                  err_text);
        char *m = slurp("one-class/metrics.jsonl");
        int evals = 0;
        for (const char *p = m; p && (p = strstr(p, "\"auc\":")) != NULL; p++, evals++)
            CHECK_MSG(strncmp(p, "\"auc\":null,", 11) == 0, "metrics.jsonl: %.40s", p);
        CHECK_MSG(evals == 2, "one-class eval: %d evaluations in metrics.jsonl: %s", evals,
                  m ? m : "(missing)");
        free(m);
        CHECK(exists("one-class/eval_predictions.txt"));
    }
    /* Shards ingested with --no-label (Criteo's test.txt) hold labels 0 that are no clicks: as
     * --train they trained a model toward 0, as --eval they gave a logloss against zeros, both
     * with exit 0. Refused before any work, the flag and directory named. */
    {
        char cmd[16384];
        snprintf(cmd, sizeof cmd, "cd '%s' && head -n 1000 ds.tsv | cut -f2- > nolabel.tsv", dir);
        CHECK(system(cmd) == 0);
        rc = run("ingest --format criteo --no-label --eval-fraction 0 --out nolabel nolabel.tsv");
        CHECK_MSG(rc == 0, "ingest --no-label: %s", err_text);
        rc = run("train --train nolabel/train --model lr --max-steps 2 --out nl1 --no-progress");
        CHECK_MSG(rc == 1 && err_has("--train") && err_has("nolabel/train") &&
                      err_has("no labels") && !exists("nl1"),
                  "unlabelled --train: exit %d, stderr %s", rc, err_text);
        rc = run("train --train ds/train --eval nolabel/train --model lr --max-steps 2 --out nl2 "
                 "--no-progress");
        CHECK_MSG(rc == 1 && err_has("--eval") && err_has("nolabel/train") &&
                      err_has("no labels") && !exists("nl2"),
                  "unlabelled --eval: exit %d, stderr %s", rc, err_text);
    }

    /* Schemas that do not match: criteo training shards, avazu eval shards. */
    rc = run("train --train ds/train --eval av/eval --model lr --max-steps 2 --out r2 --no-progress");
    CHECK_MSG(rc == 1 && err_has("fields") && err_has("23") && err_has("26") && err_has("av/eval"),
              "criteo train / avazu eval: exit %d", rc);
    /* Found before training: no checkpoint was written. */
    char ck[8192];
    snprintf(ck, sizeof ck, "%s/r2/ckpt/LATEST", dir);
    CHECK_MSG(access(ck, F_OK) != 0, "a bad --eval was found only after training (%s)", ck);
    snprintf(ck, sizeof ck, "%s/r1/ckpt/LATEST", dir);
    CHECK_MSG(access(ck, F_OK) != 0, "a missing --eval was found only after training (%s)", ck);
    rc = run("train --train av/train --eval ds/eval --model mlp --max-steps 2 --out r2b --no-progress");
    CHECK_MSG(rc == 1 && err_has("fields"), "avazu train / criteo eval: exit %d", rc);
    rc = run("train --train av/train --model dlrm --out r3 --no-progress");
    CHECK_MSG(rc == 1 && err_has("dense"), "dlrm without dense features: exit %d", rc);
    /* Avazu alone trains. */
    rc = run("train --train av/train --eval av/eval --model deepfm --batch 64 --out r3b --no-progress");
    CHECK_MSG(rc == 0, "avazu deepfm: exit %d", rc);
    /* --tf32 and [train] tf32 reach the backend; the cpu accepts and ignores them; tf32 is 0|1. */
    write_text("tf32.ini", "[train]\ntf32 = 1\n");
    rc = run("train --train av/train --model lr --device cpu --tf32 --config tf32.ini --batch 64 "
             "--max-steps 2 --out r3c --no-progress");
    CHECK_MSG(rc == 0, "--tf32 on the cpu: exit %d, stderr: %s", rc, err_text);
    /* Settings the model has no place for are refused, naming them, not ignored. */
    write_text("lr-hidden.ini", "[model]\nkind = lr\nhidden = 64,32\n");
    rc = run("train --train ds/train --config lr-hidden.ini --out r3e --no-progress");
    CHECK_MSG(rc == 1 && err_has("hidden does not apply to lr"), "lr with hidden: exit %d, %s", rc,
              err_text);
    write_text("mlp-bottom.ini", "[model]\nkind = mlp\nbottom = 32,16\n");
    rc = run("train --train ds/train --config mlp-bottom.ini --out r3e --no-progress");
    CHECK_MSG(rc == 1 && err_has("bottom applies to dlrm only, not mlp"),
              "mlp with bottom: exit %d, %s", rc, err_text);
    rc = run("train --train ds/train --model lr --dim 8 --out r3e --no-progress");
    CHECK_MSG(rc == 1 && err_has("does not apply to lr"), "lr with --dim: exit %d, %s", rc,
              err_text);
    write_text("comma.ini", "[model]\nkind = mlp\nhidden = 64,\n");
    rc = run("train --train ds/train --config comma.ini --max-steps 1 --out r3e --no-progress");
    CHECK_MSG(rc == 2 && err_has("comma.ini:3: bad value '64,' for hidden"),
              "hidden with a trailing comma: exit %d, %s", rc, err_text);
    /* A bad flag is named with what is wrong with it, and a misspelt one with the one meant. */
    static const char *const flag_errors[][2] = {
        {"--bacth 64", "ember train: unknown option '--bacth': did you mean '--batch'?"},
        {"--e 3", "ember train: option '--e' is ambiguous (--eval, --epochs,"},
        {"--no-progress=1", "ember train: option '--no-progress' takes no value"},
        {"--qqq", "ember train: unknown option '--qqq'\n"},
        {"--out", "ember train: option '--out' needs a value"},
        /* a cluster of short options, after a value: its own first letter is named */
        {"--batch 64 -xy", "ember train: unknown option '-x'"}};
    for (size_t i = 0; i < sizeof flag_errors / sizeof flag_errors[0]; i++) {
        rc = run("train --train ds/train --max-steps 1 --no-progress %s", flag_errors[i][0]);
        CHECK_MSG(rc == 2 && err_has(flag_errors[i][1]), "%s: exit %d, %s", flag_errors[i][0], rc,
                  err_text);
    }
    /* The messages' size limit: a batch's pull over it fails the run naming the limit and how
     * to raise it; under 4096 bytes it is refused as a value. (The default is sized from the
     * batch, the fields and the dim: a dim 1024 mlp with batches of 16,000 rows pulled 268.5 MB
     * from its one shard, over the PS's own 256 MiB default; too slow a run for this test.) */
    rc = run("train --train ds/train --model lr --batch 512 --max-steps 1 --max-message 8192 "
             "--out r3m --no-progress");
    CHECK_MSG(rc == 1 && err_has("exceeds max_message of 8192 bytes") &&
                  err_has("raise max_message"),
              "--max-message 8192: exit %d, %s", rc, err_text);
    write_text("maxmsg.ini", "[train]\nmax_message = 4095\n");
    rc = run("train --train ds/train --config maxmsg.ini --max-steps 1 --out r3m --no-progress");
    CHECK_MSG(rc == 2 && err_has("maxmsg.ini:2: bad value '4095' for max_message"),
              "max_message 4095: exit %d, %s", rc, err_text);
    write_text("maxmsg2.ini", "[model]\nkind = lr\n[train]\nbatch = 512\nmax_message = 1M\n");
    rc = run("train --train ds/train --config maxmsg2.ini --max-steps 1 --out r3m --no-progress");
    CHECK_MSG(rc == 0, "max_message 1M, batch 512: exit %d, %s", rc, err_text);
    /* A misspelt key names the one meant and the section's keys. */
    write_text("typo.ini", "[train]\nbach = 64\n[model]\nknd = lr\n");
    rc = run("train --train ds/train --config typo.ini --max-steps 1 --out r3e --no-progress");
    CHECK_MSG(rc == 2 && err_has("typo.ini:2: unknown key 'bach' in [train]: did you mean 'batch'? "
                                 "(keys: batch, epochs,"),
              "[train] bach: exit %d, %s", rc, err_text);
    write_text("typo2.ini", "[model]\nknd = lr\n");
    rc = run("train --train ds/train --config typo2.ini --max-steps 1 --out r3e --no-progress");
    CHECK_MSG(rc == 2 && err_has("typo2.ini:2: unknown key 'knd' in [model]: did you mean 'kind'? "
                                 "(keys: kind, dim, hidden, bottom, seed, pool)"),
              "[model] knd: exit %d, %s", rc, err_text);
    /* "[model x]" was "unknown section [model] (model, train)": the argument is named. */
    write_text("modelarg.ini", "[train]\nbatch = 64\n[model x]\nkind = lr\n");
    rc = run("train --train ds/train --config modelarg.ini --max-steps 1 --out r3e --no-progress");
    CHECK_MSG(rc == 2 && err_has("modelarg.ini:3: unknown section [model x] (model, train)"),
              "[model x]: exit %d, %s", rc, err_text);
    /* A key before any section header belongs to no section: it was read as [train]'s, so
     * "batch = 64" at the top of a file (a [train] header forgotten, or a [model] key written
     * above its header) trained silently. It is refused naming the file, the line and the key,
     * as ember ps's config and the cluster file refuse theirs, [train]'s keys too. */
    write_text("nosect.ini", "dim = 8\n[model]\nkind = lr\n");
    rc = run("train --train ds/train --config nosect.ini --max-steps 1 --out r3e --no-progress");
    CHECK_MSG(rc == 2 && err_has("nosect.ini:1: key 'dim' before any section header"),
              "dim before any section: exit %d, %s", rc, err_text);
    write_text("nosect2.ini", "# tuned\n\nbatch = 64\n[model]\nkind = lr\n");
    rc = run("train --train ds/train --config nosect2.ini --max-steps 1 --out r3e --no-progress");
    CHECK_MSG(rc == 2 && err_has("nosect2.ini:3: key 'batch' before any section header"),
              "batch before any section: exit %d, %s", rc, err_text);
    /* strtoul takes a sign: -18446744073709551615 wrapped around to a layer of width 1. */
    write_text("neg.ini", "[model]\nkind = mlp\nhidden = 64,-18446744073709551615\n");
    rc = run("train --train ds/train --config neg.ini --max-steps 1 --out r3e --no-progress");
    CHECK_MSG(rc == 2 && err_has("neg.ini:3: bad value '64,-18446744073709551615' for hidden"),
              "hidden with a negative width: exit %d, %s", rc, err_text);
    write_text("tf32-bad.ini", "[train]\ntf32 = 2\n");
    rc = run("train --train av/train --model lr --config tf32-bad.ini --out r3d --no-progress");
    CHECK_MSG(rc != 0 && err_has("bad value '2' for tf32"), "[train] tf32 = 2: exit %d", rc);
    /* A key given twice is refused with both lines, not decided by the last one. */
    write_text("dup.ini", "[train]\nbatch = 64\n[model]\nkind = lr\n[train]\nbatch = 128\n");
    rc = run("train --train av/train --config dup.ini --max-steps 2 --out r3d --no-progress");
    CHECK_MSG(rc == 2 && err_has("dup.ini:6: duplicate key 'batch' in [train] (first on line 2)"),
              "[train] batch twice: exit %d, %s", rc, err_text);
    /* Every key the config file takes is listed in --help. */
    rc = run("train --help");
    const char *keys[] = {"kind",
                          "dim",
                          "hidden",
                          "bottom",
                          "seed",
                          "pool",
                          "batch",
                          "epochs",
                          "emb_lr",
                          "dense_lr",
                          "emb_optimizer",
                          "dense_optimizer",
                          "push_codec",
                          "memory",
                          "shuffle",
                          "staleness",
                          "checkpoint_every",
                          "eval_every",
                          "worker_timeout",
                          "keep_checkpoints",
                          "tf32",
                          "bf16",
                          "dense_mirror",
                          "expected_rows",
                          "max_batch_keys"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        CHECK_MSG(rc == 0 && strstr(out_text, keys[i]), "train --help lacks config key %s",
                  keys[i]);
    /* --config=FILE and an abbreviation getopt accepts (--conf FILE) name the same option as
     * --config FILE: the file is read, not skipped for the defaults. */
    rc = run("train --train av/train --model lr --config=tf32-bad.ini --batch 64 --max-steps 2 "
             "--out r3d --no-progress");
    CHECK_MSG(rc == 2 && err_has("bad value '2' for tf32"), "--config=FILE: exit %d, %s", rc,
              err_text);
    rc = run("train --train av/train --model lr --conf tf32-bad.ini --batch 64 --max-steps 2 "
             "--out r3d --no-progress");
    CHECK_MSG(rc == 2 && err_has("bad value '2' for tf32"), "--conf FILE: exit %d, %s", rc,
              err_text);

    /* Unknown model, bad values. */
    rc = run("train --train ds/train --model bogus --out r4");
    CHECK_MSG(rc == 2 && err_has("bogus") && err_has("--model"), "unknown model: exit %d", rc);
    const char *bad[][2] = {
        {"--batch", "0"},
        {"--batch", "abc"},
        {"--batch", "-5"},
        {"--batch", "1000001"},
        {"--epochs", "0"},
        {"--workers", "0"},
        {"--workers", "100000"},
        {"--shards", "0"},
        {"--staleness", "-2"},
        {"--staleness", "1x"},
        {"--emb-lr", "0"},
        {"--emb-lr", "-1"},
        {"--emb-lr", "nan"},
        {"--dense-lr", "abc"},
        {"--threads", "0"},
        {"--threads", "257"},
        {"--dim", "0"},
        {"--dim", "2000"},
        {"--push-codec", "fp64"},
        {"--emb-optimizer", "nope"},
        {"--dense-optimizer", "rmsprop"},
        {"--max-steps", "-1"},
        {"--checkpoint-every", "x"},
        {"--seed", "-1"},
        {"--memory", "xyz"},
        {"--max-batch-keys", "0"},
        {"--max-batch-keys", "2000000000"},
        /* Values the parser should refuse but (at the time of writing) does not: see the report. */
        {"--emb-lr", "inf"},
        {"--dense-lr", "inf"},
        {"--dense-lr", "1e39"},
        {"--staleness", "4294967295"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) bad_flag(bad[i][0], bad[i][1]);
    /* A blank before a sign is not skipped: ' -1' is not 2^64 - 1 (unlimited steps). */
    const char *blank[] = {"--max-steps", "--checkpoint-every", "--seed", "--memory", "--batch"};
    for (size_t i = 0; i < sizeof blank / sizeof blank[0]; i++) {
        rc = run("train --train ds/train --model lr --out bad --no-progress %s ' -1'", blank[i]);
        CHECK_MSG(rc == 2 && err_has(blank[i]) && err_has("' -1'"), "%s ' -1': exit %d", blank[i],
                  rc);
    }
    /* The batch key bound: a batch with more distinct keys than it ends the run naming it; the
     * exact bound of a one-hot data set (batch x fields: 16 x 26) trains. */
    rc = run("train --train ds/train --model lr --batch 16 --max-steps 3 --max-batch-keys 100 "
             "--out r4k --no-progress");
    CHECK_MSG(rc == 1 && err_has("--max-batch-keys") && err_has("distinct keys"),
              "a batch over --max-batch-keys: exit %d, %s", rc, err_text);
    rc = run("train --train ds/train --model mlp --batch 16 --max-steps 3 --max-batch-keys 416 "
             "--out r4k2 --no-progress");
    CHECK_MSG(rc == 0, "--max-batch-keys batch x fields: exit %d, %s", rc, err_text);
    /* Without the flag the bound is batch x the most keys a row holds, from the ingest's
     * stats.json (26 here): it trains; a copy of the shards whose stats.json says 1 has a bound
     * of 16, under a batch's distinct keys, and the run ends naming it. */
    rc = run("train --train ds/train --model lr --batch 16 --max-steps 3 --out r4k3 --no-progress");
    CHECK_MSG(rc == 0, "bound from stats.json: exit %d, %s", rc, err_text);
    {
        char sp[8192], cp[16500];
        snprintf(cp, sizeof cp, "cp -r '%s/ds' '%s/ds1'", dir, dir);
        CHECK(system(cp) == 0);
        snprintf(sp, sizeof sp, "%s/ds1/stats.json", dir);
        void *buf = NULL;
        size_t n = 0;
        char *err = NULL;
        CHECK(cm_read_file(sp, &buf, &n, &err) == CM_OK);
        char *at = buf ? strstr(buf, "\"max_row_keys\": 26,") : NULL;
        CHECK_MSG(at != NULL, "ds/stats.json has no max_row_keys 26");
        if (at) {
            memcpy(at + 16, " 1", 2); /* "max_row_keys":  1, */
            CHECK(cm_write_file_atomic(sp, buf, n, &err) == CM_OK);
        }
        free(buf);
        free(err);
    }
    rc =
        run("train --train ds1/train --model lr --batch 16 --max-steps 3 --out r4k4 --no-progress");
    CHECK_MSG(rc == 1 && err_has("more than the bound of 16"),
              "bound 16 from a stats.json saying 1: exit %d, %s", rc, err_text);
    rc = run("train --train ds/train --frobnicate --out r4");
    CHECK_MSG(rc == 2, "unknown flag: exit %d", rc);
    rc = run("train --train ds/train stray-argument --out r4");
    CHECK_MSG(rc == 2, "stray argument: exit %d", rc);
    rc = run("train --train ds/train --device tpu --out r4 --no-progress");
    CHECK_MSG((rc == 1 || rc == 2) && err_has("tpu"), "unknown device: exit %d", rc);

    /* A worker whose PS is unreachable (nothing listens on port 1) or whose URL is not one:
     * a message naming the address and exit 1, not a crash. */
    write_text("dead.ini", "[cluster]\nps = tcp://127.0.0.1:1\nworkers = 1\n");
    rc = run("train --train ds/train --model lr --cluster dead.ini --role worker --index 0 "
             "--ps-timeout 1000 --out r4b --no-progress");
    CHECK_MSG(rc == 1 && err_has("127.0.0.1:1"), "unreachable PS: exit %d, stderr: %s", rc,
              err_text);
    /* --eval is read by worker 0 only (docs/CLUSTER.md): a PS on a host without the eval shards
     * (here: a relative --eval from another working directory) serves the job. It refused to
     * start ("--eval: ... cannot open"), and the job failed. */
    {
        char cmd[32768];
        snprintf(cmd, sizeof cmd, "[cluster]\nps = ipc://%s/evonly.sock\nworkers = 1\n", dir);
        write_text("evonly.ini", cmd);
        snprintf(
            cmd, sizeof cmd,
            "cd '%s' && mkdir -p hostb || exit 1; (cd hostb && exec timeout -k 5 60 '%s' train "
            "--train '%s/ds/train' --eval ds/eval --model lr --max-steps 4 --ps-timeout 5000 "
            "--cluster ../evonly.ini --role ps --index 0 --out '%s/evonly' >ps.out "
            "2>ps.err) & ps=$!; timeout -k 5 60 '%s' train --train '%s/ds/train' --eval "
            "ds/eval --model lr --max-steps 4 --ps-timeout 5000 --cluster evonly.ini --role "
            "worker --index 0 --out '%s/evonly' >w.out 2>w.err; w=$?; wait $ps; "
            "echo \"$w $?\" > evonly.rc",
            dir, bin, dir, dir, bin, dir, dir);
        CHECK(system(cmd) == 0);
        char *codes = slurp("evonly.rc"), *werr = slurp("w.err"), *perr = slurp("hostb/ps.err");
        CHECK_MSG(codes && strcmp(codes, "0 0\n") == 0,
                  "--eval missing on the PS host: exit codes (worker, ps) %s, worker: %s, ps: %s",
                  codes ? codes : "?", werr ? werr : "", perr ? perr : "");
        free(codes), free(werr), free(perr);
    }
    /* A worker's progress note is this job's from its start: an earlier job's note (step 7)
     * stood until the first batch, so a worker killed before it (here: waiting at the start
     * barrier for a worker 1 that never comes) rejoined at step 7 of a fresh job. */
    {
        char cmd[8192], note[128], head[32];
        snprintf(cmd, sizeof cmd, "[cluster]\nps = ipc://%s/stale.sock\nworkers = 2\n", dir);
        write_text("stale.ini", cmd);
        int hn = snprintf(head, sizeof head, "step %020d", 7);
        snprintf(note, sizeof note, "%s xxh3 %016" PRIx64 "\n", head, cm_xxh3(head, (size_t)hn));
        snprintf(cmd, sizeof cmd, "%s/stale/progress", dir);
        char *err = NULL;
        CHECK(cm_mkdirs(cmd, &err) == CM_OK);
        free(err);
        write_text("stale/progress/worker-0", note);
        snprintf(cmd, sizeof cmd,
                 "cd '%s' || exit 1; (exec timeout -k 2 6 '%s' train --train ds/train --model lr "
                 "--ps-timeout 1000 --cluster stale.ini --role ps --index 0 --out stale >/dev/null "
                 "2>&1) & timeout -k 2 3 '%s' train --train ds/train --model lr --ps-timeout 1000 "
                 "--cluster stale.ini --role worker --index 0 --out stale >/dev/null 2>&1; wait",
                 dir, bin, bin);
        /* Both end by timeout (the barrier waits 20 s): only the note they leave is checked. */
        if (system(cmd) == -1) CHECK_MSG(0, "cannot run the stale-note job");
        char *now = slurp("stale/progress/worker-0");
        CHECK_MSG(now && strstr(now, "step 00000000000000000000 "),
                  "a fresh job's worker 0, killed at its start barrier, left the note '%s'",
                  now ? now : "(none)");
        free(now);
    }
    /* A cluster file's ps line given twice: refused, not read as more shards. */
    write_text("twice.ini", "[cluster]\nps = tcp://127.0.0.1:1\nps = tcp://127.0.0.1:2\n");
    rc = run_limit(20, "train --train ds/train --model lr --cluster twice.ini --role ps --index 1 "
                       "--ps-timeout 1000 --out r4b --no-progress");
    CHECK_MSG(rc != 0 && rc != 124 && err_has("twice.ini:3: duplicate key 'ps'"),
              "ps given twice: exit %d, stderr: %s", rc, err_text);
    /* A role without --index is refused, not made index 0 (a second such process would be
     * another worker 0). */
    rc =
        run_limit(20, "train --train ds/train --model lr --cluster dead.ini --role bogus --index 0 "
                      "--out r-role --no-progress");
    CHECK_MSG(rc == 2 && err_has("--role bogus: want ps, backup or worker"),
              "--role bogus: exit %d", rc);
    rc = run_limit(20, "train --train ds/train --model lr --cluster dead.ini --role worker "
                       "--ps-timeout 1000 --out r4b --no-progress");
    CHECK_MSG(rc == 2 && err_has("--cluster needs --index"), "--role without --index: exit %d, %s",
              rc, err_text);
    /* An --index past the cluster file's entries names the file and how many it lists. */
    rc = run_limit(20, "train --train ds/train --model lr --cluster dead.ini --role worker "
                       "--index 3 --ps-timeout 1000 --out r4b --no-progress");
    CHECK_MSG(rc != 0 && err_has("--index 3 out of range: dead.ini lists 1 workers"),
              "--index 3 of 1 worker: exit %d, %s", rc, err_text);
    /* A tcp URL without a port (nng listens on one of the kernel's choosing, which no worker
     * dials): refused naming the file, line and URL, not served until killed. */
    write_text("noport.ini",
               "[cluster]\nworkers = 1\nps = tcp://127.0.0.1:7400, tcp://127.0.0.1\n");
    rc = run_limit(20, "train --train ds/train --model lr --cluster noport.ini --role ps --index 1 "
                       "--ps-timeout 1000 --out r4b --no-progress");
    CHECK_MSG(rc == 1 && err_has("noport.ini:3: bad URL 'tcp://127.0.0.1'"),
              "tcp URL without a port: exit %d, stderr: %s", rc, err_text);
    /* An empty entry in a URL list (a shard's URL left out) is refused naming the line, not
     * read as a shorter list. */
    static const char *const gap[] = {"ipc:///tmp/ember-a,,ipc:///tmp/ember-b",
                                      ", ipc:///tmp/ember-a", "ipc:///tmp/ember-a ,"};
    for (size_t i = 0; i < sizeof gap / sizeof *gap; i++) {
        char ini[256];
        snprintf(ini, sizeof ini, "[cluster]\nworkers = 1\nps = %s\n", gap[i]);
        write_text("gap.ini", ini);
        rc = run_limit(20, "train --train ds/train --model lr --cluster gap.ini --role worker "
                           "--index 0 --ps-timeout 1000 --out r4g --no-progress");
        CHECK_MSG(rc != 0 && rc != 124 && err_has("gap.ini:3") && err_has("empty entry"),
                  "ps = %s: exit %d, stderr: %s", gap[i], rc, err_text);
    }
    write_text("badurl.ini", "[cluster]\nps = foo://x\nworkers = 1\n");
    rc = run("train --train ds/train --model lr --cluster badurl.ini --role worker --index 0 "
             "--ps-timeout 1000 --out r4c --no-progress");
    CHECK_MSG(rc == 1 && err_has("foo://x"), "bad PS URL: exit %d, stderr: %s", rc, err_text);
    /* An empty value is a mistake, not a default: an empty tls_ca turned off the peer checks
     * its key asks for, "backups =" ran the job without backups, and "ps =" was named without
     * its line. Each is refused naming the file and line, as are the URLs below. */
    static const char *const blank_ini[][3] = {
        {"emptyca.ini", "[cluster]\nps = tls+tcp://127.0.0.1:1\nworkers = 1\ntls_ca =\n",
         "emptyca.ini:4: tls_ca: empty path"},
        {"emptybk.ini", "[cluster]\nps = tcp://127.0.0.1:1\nbackups = ,\nworkers = 1\n",
         "emptybk.ini:3: backups: no URL"},
        {"emptyps.ini", "[cluster]\nworkers = 1\nps =\n", "emptyps.ini:3: ps: no URL"},
        /* One URL for two roles: the second PS cannot listen, or workers reach the wrong one. */
        {"twinps.ini", "[cluster]\nps = tcp://127.0.0.1:1, tcp://127.0.0.1:1\nworkers = 1\n",
         "twinps.ini:2: URL 'tcp://127.0.0.1:1' given twice (already ps URL 0)"},
        {"twinbk.ini", "[cluster]\nps = ipc:///nowhere/a\nbackups = ipc:///nowhere/a\n",
         "twinbk.ini:3: URL 'ipc:///nowhere/a' given twice (already ps URL 0)"},
        /* Not a transport between processes: inproc:// served nobody (a PS waited forever), a
         * URL without a scheme failed only at listen or dial, without file or line. */
        {"inproc.ini", "[cluster]\nps = inproc://ps0\nworkers = 1\n",
         "inproc.ini:2: bad URL 'inproc://ps0'"},
        {"noscheme.ini", "[cluster]\nworkers = 1\nps = 127.0.0.1:1\n",
         "noscheme.ini:3: bad URL '127.0.0.1:1'"},
        /* One address in two spellings: a port's leading zero, a host's case, another tcp
         * variant listen on the same port as well. */
        {"twinport.ini", "[cluster]\nps = tcp://127.0.0.1:1, tcp://127.0.0.1:01\nworkers = 1\n",
         "twinport.ini:2: URL 'tcp://127.0.0.1:01' names ps URL 0's address ('tcp://127.0.0.1:1')"},
        {"twinhost.ini", "[cluster]\nps = tcp://LocalHost:7400\nbackups = tcp4://localhost:7400\n",
         "twinhost.ini:3: URL 'tcp4://localhost:7400' names ps URL 0's address"},
        /* An ipc path longer than a socket address holds: a worker dialed it until it timed
         * out. */
        {"longipc.ini",
         "[cluster]\nworkers = 1\nps = ipc:///nowhere/"
         "0123456789012345678901234567890123456789012345678901234567890123456789"
         "0123456789012345678901234567890123456789\n",
         "longipc.ini:3: bad URL 'ipc:///nowhere/"
         "0123456789012345678901234567890123456789012345678901234567890123456789"
         "0123456789012345678901234567890123456789': an ipc path of 119 bytes (at most 107"},
        /* TLS files are read for tls+tcp:// URLs only: with none they were ignored without a
         * word, and a tls+tcp:// PS without a certificate stopped only when it listened. */
        {"tlsplain.ini",
         "[cluster]\nps = tcp://127.0.0.1:1\nworkers = 1\ntls_ca = /nowhere/ca.pem\n",
         "tlsplain.ini:4: tls_ca but no tls+tcp:// URL"},
        {"tlsnocert.ini",
         "[cluster]\nworkers = 1\ntls_key = /nowhere/key.pem\nps = tls+tcp://127.0.0.1:1\n",
         "tlsnocert.ini:4: tls+tcp:// URLs need tls_cert"},
        /* Plain tcp:// beside tls+tcp://: that PS's traffic would cross the network
         * unencrypted in a cluster its file says is encrypted. */
        {"tlsmixed.ini",
         "[cluster]\nworkers = 1\ntls_cert = /nowhere/c.pem\nps = tls+tcp://127.0.0.1:1\n"
         "backups = tcp://127.0.0.1:2\n",
         "tlsmixed.ini:5: plain tcp:// URL beside the tls+tcp:// URLs of line 4"},
        /* nng's listen-anywhere host: a PS listened, and a worker dialing it failed (Address
         * invalid), without file or line. */
        {"star.ini", "[cluster]\nworkers = 1\nps = tcp://*:7400\n",
         "star.ini:3: bad URL 'tcp://*:7400': '*' (any address) is for listening"},
        /* The unspecified addresses are nng's wildcard in other spellings: a worker on another
         * machine dialed its own. */
        {"any4.ini", "[cluster]\nworkers = 1\nps = tcp://127.0.0.1:1, tcp://0.0.0.0:7400\n",
         "any4.ini:3: bad URL 'tcp://0.0.0.0:7400': '0.0.0.0' (any address) is for listening"},
        {"any6.ini", "[cluster]\nps = tcp://127.0.0.1:1\nbackups = tcp6://[0::0]:7400\n",
         "any6.ini:3: bad URL 'tcp6://[0::0]:7400': '[0::0]' (any address) is for listening"},
        /* A tab separates URLs as a space does (it made one URL of two, which passed as one
         * shard), and any other control character is no part of a URL. */
        {"tabps.ini", "[cluster]\nps = tcp://127.0.0.1:1\ttcp://127.0.0.1:1\nworkers = 1\n",
         "tabps.ini:2: URL 'tcp://127.0.0.1:1' given twice"},
        {"vtabps.ini", "[cluster]\nworkers = 1\nps = ipc:///nowhere/a\vipc:///nowhere/b\n",
         "vtabps.ini:3: bad URL 'ipc:///nowhere/a...': control character 0x0b"},
        /* A misspelt key: the one meant and the keys the file may have. */
        {"typocl.ini", "[cluster]\nworkers = 1\nbackup = tcp://127.0.0.1:1\n",
         "typocl.ini:3: unknown key 'backup' in [cluster]: did you mean 'backups'? (keys: ps, "
         "backups, workers, tls_cert, tls_key, tls_ca)"},
        /* A key above the header belongs to no section, and is named. */
        {"nosectcl.ini", "workers = 1\n[cluster]\nps = tcp://127.0.0.1:1\n",
         "nosectcl.ini:1: key 'workers' before any section header (keys go under [cluster])"},
        /* A section's argument is named: "[cluster] ... (cluster)" read as a contradiction. */
        {"sectarg.ini", "[cluster 2]\nps = tcp://127.0.0.1:1\n",
         "sectarg.ini:1: unknown section [cluster 2] (cluster)"},
    };
    for (size_t i = 0; i < sizeof blank_ini / sizeof blank_ini[0]; i++) {
        write_text(blank_ini[i][0], blank_ini[i][1]);
        rc = run_limit(20,
                       "train --train ds/train --model lr --cluster %s --role worker --index 0 "
                       "--ps-timeout 1000 --out r4d --no-progress",
                       blank_ini[i][0]);
        CHECK_MSG(rc == 1 && err_has(blank_ini[i][2]), "%s: exit %d, stderr: %s", blank_ini[i][0],
                  rc, err_text);
    }

    /* --resume with nothing to resume from. */
    rc = run("train --train ds/train --model lr --resume --out r5 --no-progress");
    CHECK_MSG(rc == 1 && err_has("checkpoint") && err_has("r5/ckpt"), "--resume without checkpoint: exit %d", rc);

    /* Non-finite gradients: a normal run leaves checkpoints; a diverging run in the same
     * directory stops with an error and leaves them as they were. */
    rc = run("train --train ds/train --eval ds/eval --model mlp --batch 512 --max-steps 20 "
             "--checkpoint-every 5 --out r6 --no-progress");
    CHECK_MSG(rc == 0, "normal run: exit %d", rc);
    char *latest0 = slurp_sealed("r6/ckpt/LATEST"), *list0 = ckpt_listing("r6");
    char *metrics0 = slurp("r6/metrics.jsonl"), *log0 = slurp("r6/logs/train.log");
    CHECK(latest0 && strcmp(latest0, "step-20\n") == 0);
    CHECK(metrics0 && strstr(metrics0, "{\"step\":20,") && log0 && strstr(log0, "done: "));
    CHECK(list0 && strstr(list0, "./step-5/") && strstr(list0, "./step-15/"));
    rc = run("train --train ds/train --eval ds/eval --model mlp --batch 512 --max-steps 20 "
             "--checkpoint-every 5 --dense-lr 1e30 --out r6 --no-progress");
    CHECK_MSG(rc != 0 && rc != 124 && err_has("non-finite"), "diverging run: exit %d", rc);
    CHECK(strstr(out_text, "\"auc\"") == NULL); /* no result line */
    char *log6 = slurp("r6/logs/train.log");
    CHECK_MSG(log6 && strstr(log6, "] failed: ") && strstr(log6, "non-finite"),
              "r6/logs/train.log of the diverging run: %s", log6 ? log6 : "(missing)");
    free(log6);
    char *latest1 = slurp_sealed("r6/ckpt/LATEST"), *list1 = ckpt_listing("r6");
    CHECK_MSG(latest1 && latest0 && strcmp(latest0, latest1) == 0, "LATEST changed: %s", latest1);
    CHECK_MSG(list0 && list1 && strcmp(list0, list1) == 0, "checkpoint files changed:\n%s\n---\n%s",
              list0, list1);
    /* And the intact checkpoint still resumes. */
    rc = run("train --train ds/train --eval ds/eval --model mlp --batch 512 --max-steps 25 "
             "--checkpoint-every 5 --resume --out r6 --no-progress");
    CHECK_MSG(rc == 0 && jnum(last_line(), "steps") == 25, "resume after the failed run: exit %d", rc);
    /* It continues the metrics and log of the run whose checkpoint it resumed: the failed fresh
     * run had truncated both, leaving the resumed run without its first 20 steps' lines. */
    char *metrics1 = slurp("r6/metrics.jsonl"), *log1 = slurp("r6/logs/train.log");
    CHECK_MSG(metrics0 && metrics1 && strncmp(metrics0, metrics1, strlen(metrics0)) == 0 &&
                  strstr(metrics1, "{\"step\":25,"),
              "r6/metrics.jsonl after the resume:\n%s\n--- before the failed run:\n%s",
              metrics1 ? metrics1 : "(missing)", metrics0 ? metrics0 : "(missing)");
    CHECK_MSG(log0 && log1 && strncmp(log0, log1, strlen(log0)) == 0 && strstr(log1, "non-finite"),
              "r6/logs/train.log lost the first run's lines or the failed run's: %s",
              log1 ? log1 : "(missing)");
    CHECK(!exists("r6/metrics.jsonl.prev"));
    free(metrics0);
    free(metrics1);
    free(log0);
    free(log1);

    /* --resume with other settings than the checkpoint's: refused before anything runs, every
     * difference named (another batch size would silently replay rows; another model would be
     * reported as a corrupt MANIFEST). Epochs and --max-steps may change. */
    rc = run("train --train ds/train --model mlp --batch 512 --max-steps 4 --checkpoint-every 2 "
             "--out r7 --no-progress");
    CHECK_MSG(rc == 0, "1-worker run: exit %d", rc);
    char *list7 = ckpt_listing("r7");
    rc = run("train --train ds/train --model mlp --batch 256 --max-steps 8 --resume --out r7 "
             "--no-progress");
    CHECK_MSG(rc == 1 && err_has("batch 256 (checkpoint 512)"),
              "--resume with another --batch: "
              "exit %d, stderr: %s",
              rc, err_text);
    rc = run("train --train ds/train --model dlrm --batch 512 --max-steps 8 --workers 2 --resume "
             "--out r7 --no-progress");
    CHECK_MSG(rc == 1 && err_has("model kind dlrm (checkpoint mlp)") &&
                  err_has("workers 2 (checkpoint 1)") && err_has("r7/ckpt/step-4"),
              "--resume with another model and worker count: exit %d, stderr: %s", rc, err_text);
    /* Other --train data: it would skip as many of its rows as the checkpoint had trained. */
    rc = run("train --train ds/eval --model mlp --batch 512 --max-steps 8 --resume --out r7 "
             "--no-progress");
    CHECK_MSG(rc == 1 && err_has("train_rows") && err_has("r7/ckpt/step-4"),
              "--resume on other data: exit %d, stderr: %s", rc, err_text);
    char *list7b = ckpt_listing("r7");
    CHECK_MSG(list7 && list7b && strcmp(list7, list7b) == 0, "refused resumes changed r7/ckpt");
    free(list7);
    free(list7b);
    rc = run("train --train ds/train --model mlp --batch 512 --max-steps 6 --epochs 2 --resume "
             "--out r7 --no-progress");
    CHECK_MSG(rc == 0 && jnum(last_line(), "steps") == 6,
              "--resume with more epochs: exit %d, "
              "stderr: %s",
              rc, err_text);

    /* One of two embedded workers meets a corrupt block mid-run (worker w reads blocks b with
     * b % 2 == w): the other must stop at once, not wait out its barrier (20 x --ps-timeout,
     * 600 s), and the error reported is the failing worker's, naming the shard. */
    rc = run("ingest --format criteo --eval-fraction 0.2 --block-rows 1024 --out blk ds.tsv");
    CHECK_MSG(rc == 0, "ingest with small blocks: %s", err_text);
    char shard[8192];
    snprintf(shard, sizeof shard, "%s/blk/train/part-00000.shard", dir);
    FILE *f = fopen(shard, "r+b");
    CHECK_MSG(f != NULL, "cannot open %s", shard);
    if (f) {
        fseek(f, 0, SEEK_END);
        long at = ftell(f) * 6 / 10; /* inside a block: the index is the file's last 600 bytes */
        fseek(f, at, SEEK_SET);
        int c = fgetc(f);
        fseek(f, at, SEEK_SET);
        fputc(c ^ 0x5a, f);
        fclose(f);
    }
    double t0 = cm_now();
    rc = run_limit(60, "train --train blk/train --model mlp --batch 256 --workers 2 --out r8 "
                       "--no-progress");
    double took = cm_now() - t0;
    CHECK_MSG(rc == 1 && err_has("part-00000.shard") && took < 20,
              "one of two workers failing: exit %d after %.1f s, stderr: %s", rc, took, err_text);

    /* The run directory's life across runs (ds/train: 32 batches of 512 an epoch). */
    const char *c9 = "--train ds/train --model mlp --batch 512 --no-progress --out r9";
    rc = run("train %s --max-steps 12 --checkpoint-every 4 --shards 2 --workers 2", c9);
    CHECK_MSG(rc == 0, "r9 2x2 run: exit %d, %s", rc, err_text);
    char *list9 = ckpt_listing("r9");
    /* A resume whose schedule ends at or before the checkpoint would write newer state under
     * an older name and prune the rest: refused, nothing touched. */
    rc = run("train %s --max-steps 12 --shards 2 --workers 2 --resume", c9);
    CHECK_MSG(rc == 1 && err_has("nothing to resume"), "resume at the end: exit %d, %s", rc,
              err_text);
    rc = run("train %s --max-steps 8 --shards 2 --workers 2 --resume", c9);
    CHECK_MSG(rc == 1 && err_has("checkpoint is at step 12"), "resume past the end: exit %d, %s",
              rc, err_text);
    /* Settings the shards' tables depend on are named too, not reported as a corrupt
     * MANIFEST. */
    rc = run("train %s --max-steps 16 --shards 2 --workers 2 --resume --emb-lr 0.2", c9);
    CHECK_MSG(rc == 1 && err_has("emb_lr 0.2 (checkpoint 0.05)"), "--emb-lr on resume: %d, %s", rc,
              err_text);
    /* A position past its checkpoint's step is refused. */
    write_text("r9/ckpt/step-12/worker-1.pos.bak", "");
    char *pos = slurp("r9/ckpt/step-12/worker-1.pos");
    write_sealed("r9/ckpt/step-12/worker-1.pos", "step 99999\n");
    rc = run("train %s --max-steps 16 --shards 2 --workers 2 --resume", c9);
    CHECK_MSG(rc == 1 && err_has("worker-1.pos says step 99999"), "bad position: %d, %s", rc,
              err_text);
    /* A damaged position (its step's first digit changed, its checksum line kept) is refused,
     * not resumed from: a step read too low would train batches twice. */
    if (pos && strncmp(pos, "step ", 5) == 0 && pos[5] >= '0' && pos[5] <= '9') {
        char *bad = strdup(pos);
        bad[5] = bad[5] == '1' ? '2' : '1';
        write_text("r9/ckpt/step-12/worker-1.pos", bad);
        free(bad);
        rc = run("train %s --max-steps 16 --shards 2 --workers 2 --resume", c9);
        CHECK_MSG(rc == 1 && err_has("worker-1.pos: checksum mismatch"), "damaged position: %d, %s",
                  rc, err_text);
    } else {
        CHECK_MSG(0, "worker-1.pos of step 12: %s", pos ? pos : "(missing)");
    }
    if (pos) write_text("r9/ckpt/step-12/worker-1.pos", pos);
    free(pos);
    unlink(strcat(strcpy((char[8300]){0}, dir), "/r9/ckpt/step-12/worker-1.pos.bak"));
    char *list9b = ckpt_listing("r9");
    CHECK_MSG(list9 && list9b && strcmp(list9, list9b) == 0, "refused resumes changed r9/ckpt");
    free(list9);
    free(list9b);
    /* A fresh 1x1 run into r9 saves step-4 where the 2x2 run did: its checkpoint must not keep
     * the earlier run's shard-1/ or worker-1.pos (exporting it then finds every row twice), and
     * its first checkpoint removes the earlier run's others. */
    rc = run("train %s --max-steps 6 --checkpoint-every 4", c9);
    CHECK_MSG(rc == 0, "fresh 1x1 run into r9: exit %d, %s", rc, err_text);
    CHECK_MSG(!exists("r9/ckpt/step-4/shard-1") && !exists("r9/ckpt/step-4/worker-1.pos") &&
                  exists("r9/ckpt/step-4/shard-0") && !exists("r9/ckpt/step-8") &&
                  !exists("r9/ckpt/step-12") && exists("r9/ckpt/step-6/model.txt"),
              "r9/ckpt after a fresh 1x1 run");
    CHECK_MSG(err_has("removing r9/ckpt/step-12"), "removed checkpoints not named: %s", err_text);
    rc = run("export --checkpoint r9/ckpt/step-4 --out r9-bundle");
    CHECK_MSG(rc == 0, "export of the fresh run's step-4: exit %d, %s", rc, err_text);
    /* One job a run directory: a second run into r9 while the first runs is refused. */
    char cmd[16384];
    snprintf(
        cmd, sizeof cmd,
        "cd '%s' && rm -f r9/metrics.jsonl && { timeout 60 '%s' train --train ds/train "
        "--model mlp --batch 256 --epochs 100 --no-progress --out r9 >/dev/null 2>&1 & echo "
        "$! > first.pid; } && for i in $(seq 100); do [ -s r9/metrics.jsonl ] && break; sleep 0.1; "
        "done; timeout 60 '%s' train --train ds/train --model lr --no-progress --out r9 "
        "2>lock.txt; echo $? > lock.rc; kill $(cat first.pid); wait",
        dir, bin, bin);
    CHECK(system(cmd) == 0);
    char *lrc = slurp("lock.rc"), *ltxt = slurp("lock.txt");
    CHECK_MSG(lrc && atoi(lrc) == 1 && ltxt && strstr(ltxt, "is in use by another ember train"),
              "a second run into a busy run directory: exit %s, %s", lrc ? lrc : "?",
              ltxt ? ltxt : "");
    free(lrc);
    free(ltxt);
    /* --role / --index without --cluster; a directory as --config; --dense-optimizer sgd's own
     * learning rate; train.log without --eval. */
    rc = run("train --train ds/train --role ps --index 1 --out r10 --no-progress");
    CHECK_MSG(rc == 2 && err_has("--cluster"), "--role without --cluster: exit %d", rc);
    rc = run("train --train ds/train --config ds --out r10 --no-progress");
    CHECK_MSG(rc == 2 && err_has("not a regular file"), "--config DIR: exit %d, %s", rc, err_text);
    rc = run("train --train ds/train --model mlp --dense-optimizer sgd --max-steps 2 --out r10 "
             "--no-progress");
    char *run10 = slurp_sealed("r10/ckpt/step-2/run.txt"), *log10 = slurp("r10/logs/train.log");
    CHECK_MSG(rc == 0 && run10 && strstr(run10, "dense_lr 0.1\n"), "sgd's lr: %s",
              run10 ? run10 : "(no run.txt)");
    CHECK_MSG(log10 && strstr(log10, "(no --eval)") && !strstr(log10, "auc 0.000000"),
              "train.log without --eval: %s", log10 ? log10 : "(missing)");
    free(run10);
    free(log10);
    /* A run killed after its step-2 checkpoint (LATEST set back to it: the later lines of
     * metrics.jsonl are the killed run's), then resumed: metrics.jsonl is cut back to step 2
     * first, so its training lines' steps only increase. */
    rc = run("train --train ds/train --eval ds/eval --model lr --batch 512 --max-steps 6 "
             "--checkpoint-every 2 --eval-every 2 --out r11 --no-progress");
    CHECK(rc == 0);
    /* A damaged LATEST is refused by --resume and by export, with the file named. */
    write_text("r11/ckpt/LATEST", "step-4\nxxh3 0000000000000000\n");
    rc = run("train --train ds/train --eval ds/eval --model lr --batch 512 --max-steps 6 "
             "--checkpoint-every 2 --eval-every 2 --out r11 --no-progress --resume");
    CHECK_MSG(rc == 1 && err_has("LATEST: checksum mismatch"), "damaged LATEST: %d, %s", rc,
              err_text);
    rc = run("export --checkpoint r11 --out r11x");
    CHECK_MSG(rc == 1 && err_has("LATEST: checksum mismatch"), "export, damaged LATEST: %d, %s", rc,
              err_text);
    write_sealed("r11/ckpt/LATEST", "step-2\n");
    rc = run("train --train ds/train --eval ds/eval --model lr --batch 512 --max-steps 6 "
             "--checkpoint-every 2 --eval-every 2 --out r11 --no-progress --resume");
    CHECK_MSG(rc == 0, "resume of r11: exit %d, %s", rc, err_text);
    /* A damaged model.txt is refused by export, which would otherwise build a bundle of the
     * wrong shape or fail on a "corrupt" tower. */
    char *model11 = slurp("r11/ckpt/step-6/model.txt");
    if (model11 && strncmp(model11, "kind lr\n", 8) == 0) {
        memcpy(model11 + 5, "fm", 2); /* kind fm: another model, as a bit flip could make it */
        write_text("r11/ckpt/step-6/model.txt", model11);
        rc = run("export --checkpoint r11 --out r11y");
        CHECK_MSG(rc == 1 && err_has("model.txt: checksum mismatch"), "damaged model.txt: %d, %s",
                  rc, err_text);
    } else {
        CHECK_MSG(0, "r11's step-6/model.txt: %s", model11 ? model11 : "(missing)");
    }
    free(model11);
    /* Ctrl-C on an embedded run: train.log says where it stopped (train_stop checks the
     * checkpoint it leaves). (The run is a job of the same shell, so `wait` waits for it before
     * the log is read.) */
    char cmd12[16384];
    snprintf(cmd12, sizeof cmd12,
             "cd '%s' && { timeout 60 '%s' train --train ds/train --model mlp --batch 256 --epochs "
             "100 --no-progress --out r12 >/dev/null 2>&1 & echo $! > r12.pid; } && for i in $(seq "
             "100); do [ -s r12/metrics.jsonl ] && break; sleep 0.1; done; pkill -INT -P $(cat "
             "r12.pid); wait",
             dir, bin);
    CHECK(system(cmd12) == 0);
    char *log12 = slurp("r12/logs/train.log");
    CHECK_MSG(log12 && strstr(log12, "stopped at step"), "train.log after SIGINT: %s",
              log12 ? log12 : "(missing)");
    free(log12);
    char *m11 = slurp("r11/metrics.jsonl");
    double prev = 0;
    int evals = 0;
    for (char *l = m11; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : l + strlen(l)) {
        double st = strtod(l + 8, NULL);
        size_t ll = strcspn(l, "\n");
        char line[512];
        snprintf(line, sizeof line, "%.*s", (int)ll, l);
        if (strstr(line, "\"auc\"")) {
            evals++;
            continue;
        }
        CHECK_MSG(st > prev, "r11/metrics.jsonl: step %g after %g:\n%s", st, prev, m11);
        prev = st;
    }
    CHECK_MSG(evals == 3, "r11/metrics.jsonl: %d eval lines (2, 4, 6 once each):\n%s", evals,
              m11 ? m11 : "");
    free(m11);

    /* A metrics file that cannot be written (a full disk: /dev/full answers every write with
     * ENOSPC) does not end the run, but is said, once, naming the file and why; the lines were
     * dropped without a word. */
    if (access("/dev/full", W_OK) == 0) {
        char full[8300], link[8400];
        snprintf(full, sizeof full, "%s/full-metrics", dir);
        snprintf(link, sizeof link, "%s/metrics.jsonl", full);
        CHECK(mkdir(full, 0755) == 0 && symlink("/dev/full", link) == 0);
        rc = run("train --train ds/train --eval ds/eval --model lr --max-steps 6 --eval-every 3 "
                 "--out full-metrics --no-progress");
        const char *w = strstr(err_text, "cannot write full-metrics/metrics.jsonl");
        CHECK_MSG(rc == 0 && w && strstr(w, "No space left on device") &&
                      !strstr(w + 1, "cannot write full-metrics/metrics.jsonl") &&
                      jnum(last_line(), "steps") == 6,
                  "metrics.jsonl on a full disk: exit %d, stderr: %s", rc, err_text);
    } else {
        fprintf(stderr, "train_bad_input: no writable /dev/full: full-disk metrics case skipped\n");
    }

    free(latest0);
    free(latest1);
    free(list0);
    free(list1);
    free(out_text);
    free(err_text);
    return check_done();
}
