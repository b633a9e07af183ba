/*
 * Checkpoint retention: --keep-checkpoints K keeps the newest K step-N directories and never
 * the one LATEST points at loses; the default keeps the newest five and 0 every one; a resume
 * from the pruned run continues from the newest. A fresh run into a directory with an older run's
 * checkpoints removes those newer than its own, so they can neither outlive its own nor be resumed,
 * however many there are.
 */
#include <fcntl.h>
#include <sys/stat.h>

#include "cli_util.h"

/* A chain of directories under parent deeper than PATH_MAX: nothing that works by whole paths
 * (cm_rmtree) can remove it, which stands in for a checkpoint that cannot be removed (a
 * read-only or busy mount, permissions) for a test that runs as root. */
static int make_deep(const char *parent)
{
    char name[201];
    memset(name, 'd', 200);
    name[200] = '\0';
    int fd = open(parent, O_RDONLY | O_DIRECTORY);
    for (int i = 0; fd >= 0 && i < 25; i++) {
        int next = mkdirat(fd, name, 0755) == 0 ? openat(fd, name, O_RDONLY | O_DIRECTORY) : -1;
        close(fd);
        fd = next;
    }
    if (fd < 0) return -1;
    close(fd);
    return 0;
}

int main(void)
{
    if (cli_init("train_retention") != 0) return 1;
    if (make_criteo("ds", 12000, 4, 0.0) != 0) return check_done();
    const char *common = "train --train ds/train --model lr --batch 256 --no-progress --device cpu "
                         "--checkpoint-every 5 --max-steps 30";
    CHECK(run("%s --keep-checkpoints 2 --out keep2", common) == 0);
    char *latest = slurp_sealed("keep2/ckpt/LATEST");
    CHECK_MSG(latest && strcmp(latest, "step-30\n") == 0, "LATEST is %s", latest ? latest : "(none)");
    free(latest);
    CHECK(exists("keep2/ckpt/step-30/shard-0/MANIFEST") && exists("keep2/ckpt/step-25/model.txt"));
    CHECK(!exists("keep2/ckpt/step-20") && !exists("keep2/ckpt/step-5"));
    CHECK(run("%s --keep-checkpoints 0 --out all", common) == 0);
    for (int s = 5; s <= 30; s += 5) {
        char name[64];
        snprintf(name, sizeof name, "all/ckpt/step-%d/model.txt", s);
        CHECK_MSG(exists(name), "--keep-checkpoints 0 lost %s", name);
    }
    /* The default keeps the newest five. */
    CHECK(run("%s --out five", common) == 0);
    for (int s = 5; s <= 30; s += 5) {
        char name[64];
        snprintf(name, sizeof name, "five/ckpt/step-%d/model.txt", s);
        CHECK_MSG(exists(name) == (s > 5), "default run: %s %s", name,
                  exists(name) ? "kept" : "gone");
    }
    /* Resuming the pruned run continues from its newest checkpoint. */
    CHECK(run("train --train ds/train --model lr --batch 256 --no-progress --device cpu "
              "--checkpoint-every 5 --max-steps 40 --keep-checkpoints 2 --resume --out keep2") == 0);
    latest = slurp_sealed("keep2/ckpt/LATEST");
    CHECK_MSG(latest && strcmp(latest, "step-40\n") == 0, "LATEST is %s", latest ? latest : "(none)");
    free(latest);
    CHECK(exists("keep2/ckpt/step-35") && !exists("keep2/ckpt/step-30"));
    CHECK(run("train --train ds/train --model lr --keep-checkpoints -1 --out bad") == 2);
    /* A fresh, shorter run into keep2 (whose checkpoints reach step 40): the older run's newer
     * checkpoints go (said on stderr), so --keep-checkpoints prunes this run's oldest, never
     * its LATEST, and a resume continues this run. */
    CHECK(run("train --train ds/train --model lr --batch 256 --no-progress --device cpu "
              "--checkpoint-every 5 --max-steps 15 --keep-checkpoints 2 --out keep2") == 0);
    CHECK_MSG(err_has("removing") && err_has("step-40"), "stale checkpoints not named: %s",
              err_text);
    latest = slurp_sealed("keep2/ckpt/LATEST");
    CHECK_MSG(latest && strcmp(latest, "step-15\n") == 0, "LATEST is %s",
              latest ? latest : "(none)");
    free(latest);
    CHECK_MSG(exists("keep2/ckpt/step-15/model.txt") && exists("keep2/ckpt/step-10/model.txt") &&
                  !exists("keep2/ckpt/step-5") && !exists("keep2/ckpt/step-35") &&
                  !exists("keep2/ckpt/step-40"),
              "keep2/ckpt after a shorter fresh run: step-10/15 kept, 5, 35, 40 gone");
    CHECK(run("train --train ds/train --model lr --batch 256 --no-progress --device cpu "
              "--checkpoint-every 5 --max-steps 20 --keep-checkpoints 2 --resume --out keep2") ==
          0);
    CHECK(jnum(last_line(), "steps") == 20 && exists("keep2/ckpt/step-20/model.txt"));
    char path[8192], *err = NULL;
    /* A directory whose name reads as a step but is not the trainer's spelling of it (a copy
     * named step-010) is not a checkpoint of that step: counted as one, it made step-10, the
     * one LATEST names, an older duplicate to prune, and the run failed reading it back. */
    snprintf(path, sizeof path, "%s/pad/ckpt/step-010", dir);
    CHECK(cm_mkdirs(path, &err) == CM_OK);
    CHECK(run("train --train ds/train --model lr --batch 256 --no-progress --device cpu "
              "--checkpoint-every 5 --max-steps 10 --keep-checkpoints 1 --out pad") == 0);
    CHECK_MSG(exists("pad/ckpt/step-10/model.txt") && exists("pad/ckpt/step-010"),
              "a step-010 beside the run's checkpoints: step-10 or step-010 removed");
    /* More checkpoints than the prune once read (4096: --keep-checkpoints takes up to 100000):
     * a fresh run's first checkpoint removes every earlier one, not the first 4096 it lists. */
    for (int s = 1; s <= 4200; s++) {
        snprintf(path, sizeof path, "%s/many/ckpt/step-%d/shard-0", dir, s * 10);
        CHECK(cm_mkdirs(path, &err) == CM_OK);
    }
    free(err);
    CHECK(run("train --train ds/train --model lr --batch 256 --no-progress --device cpu "
              "--max-steps 5 --out many") == 0);
    int left = 0;
    for (int s = 1; s <= 4200; s++) {
        char name[64];
        snprintf(name, sizeof name, "many/ckpt/step-%d", s * 10);
        left += exists(name);
    }
    CHECK_MSG(left == 0 && exists("many/ckpt/step-5/model.txt"),
              "%d of an earlier run's 4200 checkpoints left beside a fresh run's step-5", left);
    /* A prune that fails is a warning, not the run's end: the checkpoint is in place (a run
     * that had trained to the end failed on it). The earlier run's checkpoint it could not
     * remove is tried again at the next checkpoint, and the rest are pruned as usual. */
    snprintf(path, sizeof path, "%s/stuck/ckpt/step-1", dir);
    CHECK(cm_mkdirs(path, NULL) == CM_OK && make_deep(path) == 0);
    CHECK_MSG(run("train --train ds/train --model lr --batch 256 --no-progress --device cpu "
                  "--checkpoint-every 5 --max-steps 15 --keep-checkpoints 1 --out stuck") == 0,
              "a run whose prune failed: %s", err_text);
    CHECK_MSG(err_has("warning") && err_has("step-1") && err_has("tried again"),
              "the failed prune not named: %s", err_text);
    latest = slurp_sealed("stuck/ckpt/LATEST");
    CHECK(latest && strcmp(latest, "step-15\n") == 0);
    free(latest);
    CHECK(exists("stuck/ckpt/step-15/model.txt") && !exists("stuck/ckpt/step-10") &&
          !exists("stuck/ckpt/step-5") && exists("stuck/ckpt/step-1"));
    char cmd[8300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s/stuck'", dir);
    CHECK(system(cmd) == 0);
    return check_done();
}
