/*
 * ember train --admit N and --ttl STEPS, the embedding store's admission and TTL as a training
 * run uses them: against the same run without them, a checkpoint holds fewer rows (counted by
 * the offline checkpoint reader), every admitted key is a row, keys held back and rows expired
 * are counted in train.log, and the config file's keys do what the flags do. A run resumed
 * half-way with both on ends where the run straight through does (the admission sketch and
 * the rows' last steps are in the checkpoint). Values out of range are refused by name.
 */
#include <inttypes.h>

#include "cli_util.h"
#include "ps/ps.h"

#define COMMON                                                                                     \
    "train --train ds/train --eval ds/eval --model lr --batch 256 --no-progress --device cpu "     \
    "--checkpoint-every 25"

static uint64_t ckpt_rows(const char *run_dir, unsigned step)
{
    char p[8300];
    snprintf(p, sizeof p, "%s/%s/ckpt/step-%u", dir, run_dir, step);
    uint64_t rows = 0;
    char *err = NULL;
    CHECK_OK(ps_checkpoint_table_rows(p, "lin", &rows, &err), err);
    return rows;
}

typedef struct counts {
    unsigned long long rows, spilled, admitted, held, dropped, expired;
} counts;

/* The last checkpoint's line for table lin in run_dir's train.log. */
static counts log_counts(const char *run_dir)
{
    counts c = {0};
    char p[8300];
    snprintf(p, sizeof p, "%s/logs/train.log", run_dir);
    char *log = slurp(p), *at = NULL;
    for (char *s = log; s && (s = strstr(s, "table lin: ")) != NULL; s++)
        at = s;
    CHECK_MSG(at && sscanf(at,
                           "table lin: %llu rows (%llu spilled), %llu admitted, %llu pulled keys "
                           "and %llu pushed held back by --admit, %llu expired by --ttl",
                           &c.rows, &c.spilled, &c.admitted, &c.held, &c.dropped, &c.expired) == 6,
              "%s: no table line", p);
    free(log);
    return c;
}

int main(void)
{
    if (cli_init("train_admit_ttl") != 0) return 1;
    if (make_criteo("ds", 20000, 7, 0.2) != 0) return check_done();

    CHECK(run(COMMON " --max-steps 50 --out base") == 0);
    CHECK(run(COMMON " --max-steps 50 --admit 3 --out admit") == 0);
    CHECK(run(COMMON " --max-steps 50 --ttl 3 --out ttl") == 0);
    const uint64_t r0 = ckpt_rows("base", 50), ra = ckpt_rows("admit", 50),
                   rt = ckpt_rows("ttl", 50);
    counts c0 = log_counts("base"), ca = log_counts("admit"), ct = log_counts("ttl");
    fprintf(stderr,
            "    rows: %" PRIu64 " plain, %" PRIu64 " with --admit 3, %" PRIu64 " with --ttl 3\n",
            r0, ra, rt);
    CHECK_MSG(c0.rows == r0 && c0.admitted == 0 && c0.held == 0 && c0.expired == 0,
              "plain run: log says %llu rows (checkpoint %" PRIu64 "), %llu admitted, %llu held, "
              "%llu expired",
              c0.rows, r0, c0.admitted, c0.held, c0.expired);
    CHECK_MSG(ra > 0 && ra < r0 / 2, "--admit 3 kept %" PRIu64 " rows of %" PRIu64, ra, r0);
    CHECK_MSG(ca.rows == ra && ca.admitted == ra && ca.held > 0 && ca.dropped > 0,
              "--admit 3: log says %llu rows, %llu admitted, %llu held back, %llu dropped", ca.rows,
              ca.admitted, ca.held, ca.dropped);
    CHECK_MSG(rt > 0 && rt < r0 / 2 && ct.rows == rt && ct.expired > 0,
              "--ttl 3: %" PRIu64 " rows of %" PRIu64 ", %llu expired", rt, r0, ct.expired);

    /* --ttl counts the job's steps: two workers' --ttl 3 keeps the rows of the last 3 job
     * steps, 6 batches, as many as one worker's --ttl 6 (and more than its --ttl 3). Were the
     * shard's own table steps taken for job steps (each worker's step pushes a table twice),
     * the two workers would keep 1.5 job steps' rows. */
    CHECK(run(COMMON " --max-steps 40 --ttl 3 --out ttl1") == 0);
    CHECK(run(COMMON " --max-steps 40 --ttl 6 --out ttl6") == 0);
    CHECK(run(COMMON " --max-steps 40 --ttl 3 --workers 2 --out ttl2") == 0);
    const uint64_t rt1 = ckpt_rows("ttl1", 40), rt6 = ckpt_rows("ttl6", 40),
                   rt2 = ckpt_rows("ttl2", 40);
    CHECK_MSG(rt2 > rt1 + rt1 / 4 && rt2 >= rt6 - rt6 / 10 && rt2 <= rt6 + rt6 / 10,
              "--ttl 3: %" PRIu64 " rows with 2 workers; one worker: %" PRIu64
              " (--ttl 3), %" PRIu64 " (--ttl 6)",
              rt2, rt1, rt6);

    /* The config file's keys are the flags'. */
    char cfg[8300];
    snprintf(cfg, sizeof cfg, "%s/at.ini", dir);
    FILE *f = fopen(cfg, "w");
    CHECK(f && fputs("[train]\nadmit = 3\nttl = 3\n", f) >= 0 && fclose(f) == 0);
    CHECK(run(COMMON " --max-steps 50 --admit 3 --ttl 3 --out both") == 0);
    CHECK(run(COMMON " --max-steps 50 --config at.ini --out both-ini") == 0);
    CHECK_MSG(ckpt_rows("both", 50) == ckpt_rows("both-ini", 50),
              "config keys: %" PRIu64 " rows, flags: %" PRIu64, ckpt_rows("both-ini", 50),
              ckpt_rows("both", 50));

    /* Resumed half-way with both on: the same end as straight through. */
    CHECK(run(COMMON " --max-steps 25 --admit 2 --ttl 6 --out half") == 0);
    CHECK(run(COMMON " --max-steps 50 --admit 2 --ttl 6 --resume --out half") == 0);
    char b[4096];
    snprintf(b, sizeof b, "%s", last_line());
    CHECK(run(COMMON " --max-steps 50 --admit 2 --ttl 6 --out whole") == 0);
    const char *a = last_line();
    CHECK_MSG(jnum(a, "auc") == jnum(b, "auc") && jnum(a, "logloss") == jnum(b, "logloss"),
              "resumed with --admit 2 --ttl 6: %s\n  straight through: %s", b, a);
    CHECK(ckpt_rows("half", 50) == ckpt_rows("whole", 50));

    CHECK(run(COMMON " --max-steps 5 --admit 65536 --out bad") == 2 && err_has("--admit"));
    CHECK(run(COMMON " --max-steps 5 --ttl soon --out bad") == 2 && err_has("--ttl"));
    return check_done();
}
