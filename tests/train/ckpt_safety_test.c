/*
 * What a failed or interrupted checkpoint leaves ($EMBER_BIN):
 *
 * - A SAVE that fails on one shard of two (that shard's directory made unremovable) fails the
 *   run with an error naming the shard and the path, and the checkpoint LATEST names keeps every
 *   byte: also when the failing run is a fresh one whose checkpoint has LATEST's step (it wrote
 *   the other shard into LATEST's directory, leaving a mixture of two runs to resume from).
 * - A checkpoint without its run.txt is refused by --resume, the file named (it was resumed
 *   without the batch, shard and worker checks run.txt carries).
 */
#include <sys/stat.h>

#include "cli_util.h"

/* md5 of every file under dir/<sub> but <skip>, one line each, sorted. */
static char *listing(const char *sub, const char *skip)
{
    char cmd[16384];
    snprintf(cmd, sizeof cmd,
             "cd '%s/%s' && find . -type f -not -path './%s/*' | sort | xargs md5sum > "
             "'%s/listing.txt'",
             dir, sub, skip, dir);
    CHECK(system(cmd) == 0);
    return slurp("listing.txt");
}

/* dir/<name>/x, made unremovable: its directory read-only (enough without root) and the file
 * immutable (root). 1 when unlink(x) then fails, 0 when it cannot be pinned here. */
static int pin(const char *name)
{
    char path[8192], cmd[16384], *err = NULL;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    CHECK(cm_mkdirs(path, &err) == CM_OK);
    free(err);
    snprintf(path, sizeof path, "%s/%s/x", dir, name);
    FILE *f = fopen(path, "w");
    if (f) fclose(f);
    snprintf(cmd, sizeof cmd, "chattr +i '%s' 2>/dev/null; chmod 0555 '%s/%s'", path, dir, name);
    if (system(cmd) == -1) return 0;
    return unlink(path) != 0;
}

static void unpin(const char *name)
{
    char cmd[16384];
    snprintf(cmd, sizeof cmd, "chattr -i '%s/%s/x' 2>/dev/null; chmod 0755 '%s/%s'", dir, name, dir,
             name);
    CHECK(system(cmd) != -1);
}

static void failed_save(void)
{
    const char *c = "--train ds/train --model mlp --batch 256 --no-progress --device cpu "
                    "--shards 2 --max-steps 20";
    int rc = run("train %s --checkpoint-every 10 --out r1", c);
    CHECK_MSG(rc == 0, "r1: exit %d", rc);
    char *list0 = listing("r1/ckpt/step-20", "shard-1.tmp");
    /* Shard 1's temporary directory, where a save puts it now (the checkpoint's own directory)
     * and where it goes while a checkpoint is assembled aside. */
    const char *pins[2] = {"r1/ckpt/step-20/shard-1.tmp", "r1/ckpt/step-20.tmp/shard-1.tmp"};
    if (!pin(pins[0]) || !pin(pins[1])) {
        fprintf(stderr, "cannot make a file unremovable here: the failed SAVE case is skipped\n");
        unpin(pins[0]);
        unpin(pins[1]);
        free(list0);
        return;
    }
    /* A fresh run (another seed: other rows) whose only checkpoint is step-20, LATEST's. */
    rc = run("train %s --seed 9 --out r1", c);
    unpin(pins[0]);
    unpin(pins[1]);
    CHECK_MSG(rc == 1 && err_has("shard 1") && err_has("shard-1.tmp"),
              "a SAVE failing on shard 1: exit %d, %s", rc, err_text);
    char *latest = slurp_sealed("r1/ckpt/LATEST"),
         *list1 = listing("r1/ckpt/step-20", "shard-1.tmp");
    CHECK_MSG(latest && strcmp(latest, "step-20\n") == 0, "LATEST: %s", latest ? latest : "-");
    CHECK_MSG(list0 && list1 && strcmp(list0, list1) == 0,
              "the failed save changed the checkpoint LATEST names:\n%s\n---\n%s", list0, list1);
    free(latest);
    free(list0);
    free(list1);
    rc = run("train %s --max-steps 30 --resume --out r1", c);
    CHECK_MSG(rc == 0 && jnum(last_line(), "steps") == 30, "resume after the failed save: %d, %s",
              rc, err_text);
}

static void missing_run_txt(void)
{
    const char *c = "--train ds/train --model mlp --no-progress --device cpu --max-steps 10";
    int rc = run("train %s --batch 256 --out r2", c);
    CHECK_MSG(rc == 0, "r2: exit %d", rc);
    char path[8192];
    snprintf(path, sizeof path, "%s/r2/ckpt/step-10/run.txt", dir);
    CHECK(unlink(path) == 0);
    /* Another batch size: run.txt would have named it. */
    rc = run("train %s --batch 128 --max-steps 20 --resume --out r2", c);
    CHECK_MSG(rc == 1 && err_has("step-10/run.txt"), "resume without run.txt: exit %d, %s", rc,
              err_text);
}

int main(void)
{
    if (cli_init("train_ckpt_safety") != 0) return 1;
    if (make_criteo("ds", 12000, 4, 0.2) != 0) return check_done();
    failed_save();
    missing_run_txt();
    free(out_text);
    free(err_text);
    return check_done();
}
