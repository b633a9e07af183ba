/*
 * emb_pushfail: a push that meets an I/O error of the spill store (issue #2: a full disk) is all
 * or nothing. It returns an error whose message names the table (its spill path) and the
 * failure, every row reads back bit for bit as before it (weights, optimizer state, update
 * count, last step), through get_row, lookup and a walk, and the step does not advance. Once the
 * disk has room again, the same push goes through, and the table then equals a twin held fully
 * in memory that got every successful push once.
 *
 * The full disk is real, no mock: the test enters its own user and mount namespaces, puts the
 * spill database on a small tmpfs and fills that with a file, so that RocksDB's writes fail
 * with ENOSPC (its memtable flush fails, and from then on every write). Removing the file gives
 * the room back; RocksDB resumes by itself (its SstFileManager looks at the free space every
 * 5 s). Where user namespaces are not available (or EMB_PUSHFAIL_FSIZE is set), a file size
 * limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes the writes fail with EFBIG instead; RocksDB 7.8
 * never resumes after that error (DB::Resume is not in its C API), so that mode checks that a
 * push sent again after the limit is lifted still fails cleanly, not that it succeeds.
 *
 * Every push before the failure is also checked to be applied whole (the twin agrees), and the
 * batches repeat keys, so a row updated where it lies takes its updates in order. First, pushes
 * to a spilling table still below its budget, which grow sub-shards as they go, must land on the
 * right rows too (a push finds its rows before it grows a sub-shard for new ones).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "emb_util.h"

#define NKEYS 50000u
#define BATCH 4096u
#define DIM 8u
#define DISK_MB 64
#define MAX_PUSHES 400
#define RECOVER_S 60.0

static int write_file(const char *path, const char *s)
{
    int fd = open(path, O_WRONLY);
    if (fd < 0) return -1;
    ssize_t len = (ssize_t)strlen(s), w = write(fd, s, (size_t)len);
    close(fd);
    return w == len ? 0 : -1;
}

/* New user and mount namespaces (this process as root in them) and a tmpfs of DISK_MB at mnt.
 * Only a single-threaded process may do this: call it before any table exists. */
static int enter_disk(const char *mnt)
{
    char map[64];
    uid_t uid = getuid();
    gid_t gid = getgid();
    if (unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) return -1;
    if (write_file("/proc/self/setgroups", "deny") != 0) return -1;
    snprintf(map, sizeof map, "0 %u 1", (unsigned)uid);
    if (write_file("/proc/self/uid_map", map) != 0) return -1;
    snprintf(map, sizeof map, "0 %u 1", (unsigned)gid);
    if (write_file("/proc/self/gid_map", map) != 0) return -1;
    if (mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) return -1;
    char opts[32];
    snprintf(opts, sizeof opts, "size=%dm", DISK_MB);
    return mount("tmpfs", mnt, "tmpfs", 0, opts);
}

/* Whether enter_disk works here, tried in a child so that a half-entered namespace (a mount
 * refused by a security module, say) does not strand this process. */
static int disk_possible(const char *mnt)
{
    pid_t pid = fork();
    if (pid < 0) return 0;
    if (pid == 0) _exit(enter_disk(mnt) == 0 ? 0 : 1);
    int status = 0;
    if (waitpid(pid, &status, 0) != pid) return 0;
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/* Fills the file system of path with a file until it has no room left. */
static void fill_disk(const char *path)
{
    int fd = open(path, O_CREAT | O_WRONLY | O_TRUNC, 0600);
    CHECK_MSG(fd >= 0, "cannot create %s: %s", path, strerror(errno));
    if (fd < 0) return;
    static char block[1 << 16];
    memset(block, 0x5a, sizeof block);
    size_t total = 0;
    for (;;) {
        ssize_t w = write(fd, block, sizeof block);
        if (w <= 0) break;
        total += (size_t)w;
    }
    CHECK_MSG(errno == ENOSPC, "filling the disk stopped with %s", strerror(errno));
    close(fd);
    fprintf(stderr, "pushfail: disk filled with %zu KiB\n", total >> 10);
}

/* Sets the soft file size limit and returns the one it replaces. */
static rlim_t set_fsize(rlim_t limit)
{
    struct rlimit r;
    CHECK(getrlimit(RLIMIT_FSIZE, &r) == 0);
    rlim_t old = r.rlim_cur;
    r.rlim_cur = limit;
    CHECK_MSG(setrlimit(RLIMIT_FSIZE, &r) == 0, "setrlimit: %s", strerror(errno));
    return old;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Rows of t and twin agree bit for bit, both ways (a walk of one, get_row of the other), and so
 * do lookups of every key and the steps. */
static void check_same(emb_table *t, emb_table *twin, const uint64_t *keys, const char *when)
{
    CHECK_MSG(eu_diff_tables(t, twin, 1) == 0, "%s: the spilled table's rows differ", when);
    CHECK_MSG(eu_diff_tables(twin, t, 1) == 0, "%s: rows differ from the twin's", when);
    float *a = eu_xmalloc((size_t)NKEYS * DIM * sizeof(float));
    float *b = eu_xmalloc((size_t)NKEYS * DIM * sizeof(float));
    uint8_t *fa = eu_xmalloc(NKEYS), *fb = eu_xmalloc(NKEYS);
    char *err = NULL;
    CHECK_OK(emb_table_lookup(t, keys, NKEYS, a, fa, &err), err);
    CHECK_OK(emb_table_lookup(twin, keys, NKEYS, b, fb, &err), err);
    size_t absent = 0;
    for (size_t i = 0; i < NKEYS; i++)
        absent += !fa[i] || !fb[i];
    CHECK_MSG(absent == 0, "%s: %zu keys not found", when, absent);
    CHECK_MSG(memcmp(a, b, (size_t)NKEYS * DIM * sizeof(float)) == 0,
              "%s: lookups return different weights", when);
    CHECK_MSG(emb_table_step(t) == emb_table_step(twin),
              "%s: step %" PRIu64 ", the twin's %" PRIu64, when, emb_table_step(t),
              emb_table_step(twin));
    free(a);
    free(b);
    free(fa);
    free(fb);
}

/* A batch of random keys (repeats included) and gradients. */
static void make_batch(uint64_t *seed, const uint64_t *keys, uint64_t *batch, float *g)
{
    for (size_t i = 0; i < BATCH; i++)
        batch[i] = keys[eu_below(seed, NKEYS)];
    for (size_t i = 0; i < (size_t)BATCH * DIM; i++)
        g[i] = (float)(eu_unif(seed) - 0.5);
}

/* A push to a spilling table still below its budget may have to grow a sub-shard for the rows it
 * brings in, after it has found the others: each must still be updated where it then lies. */
static void growing(const char *dir)
{
    emb_table_config c = eu_config(EMB_OPT_ADAGRAD, DIM);
    emb_table_config cs = c;
    char path[4300];
    snprintf(path, sizeof path, "%s/growing", dir);
    cs.mem_budget_bytes = (uint64_t)(4.0 * NKEYS * emb_row_mem_bytes(&c));
    cs.spill_path = path;
    emb_table *t = eu_create(&cs), *twin = eu_create(&c);

    uint64_t seed = 5;
    uint64_t *keys = eu_xmalloc(NKEYS * sizeof *keys);
    uint64_t *batch = eu_xmalloc(BATCH * sizeof *batch);
    float *g = eu_xmalloc((size_t)BATCH * DIM * sizeof(float));
    for (uint32_t i = 0; i < NKEYS; i++)
        keys[i] = eu_key(i);
    /* Each push names rows it has seen and rows it creates: the sub-shards grow as they come. */
    for (uint32_t done = 0; done + BATCH / 2 <= NKEYS; done += BATCH / 2) {
        for (size_t i = 0; i < BATCH; i++)
            batch[i] = i % 2 && done > 0 ? keys[eu_below(&seed, done)] : keys[done + i / 2];
        for (size_t i = 0; i < (size_t)BATCH * DIM; i++)
            g[i] = (float)(eu_unif(&seed) - 0.5);
        eu_push(t, batch, BATCH, g);
        eu_push(twin, batch, BATCH, g);
    }
    CHECK_MSG(eu_diff_tables(t, twin, 1) == 0, "growing: rows differ from the twin's");
    CHECK_MSG(eu_diff_tables(twin, t, 1) == 0, "growing: the twin's rows differ");
    emb_table_destroy(t);
    emb_table_destroy(twin);
    free(keys);
    free(batch);
    free(g);
}

/*
 * A failed push takes its step back, and no call may have seen it meanwhile: a pull reads the
 * step before it waits for its sub-shard, and one that read the step of a push about to fail
 * stamped its rows with it once that push had given it back, so the table held rows touched
 * after its own step (a snapshot then is refused by restore: "touched at step S + 1, after the
 * snapshot's step S"; put_row's and the TTL ring's bound no longer held). A thread pulls a few
 * resident keys (no I/O) at random moments while the main thread sends pushes that fail; the
 * pulled rows' last_step must never pass the table's step.
 */
#define RACE_KEYS 20000u
#define RACE_HOT 8u
#define RACE_TRIES 600

typedef struct race {
    emb_table *t;
    const uint64_t *hot;
    atomic_int stop;
    unsigned failed;
} race;

static void *race_puller(void *arg)
{
    race *r = arg;
    float out[RACE_HOT * DIM];
    uint64_t seed = 3;
    while (!atomic_load(&r->stop)) {
        /* arrive at any point of a push (a few ms each), not only right after one lets the
         * sub-shard go */
        usleep((useconds_t)eu_below(&seed, 8000));
        char *err = NULL;
        if (emb_table_pull(r->t, r->hot, RACE_HOT, out, &err) != 0) r->failed++;
        free(err);
    }
    return NULL;
}

/* t: a table of one sub-shard, its budget full, created (and filled) before the disk was. */
static void step_race(emb_table *t, const uint64_t *keys)
{
    uint64_t *batch = eu_xmalloc(BATCH * sizeof *batch);
    float *g = eu_xmalloc((size_t)BATCH * DIM * sizeof(float));
    uint64_t seed = 23;
    char *err = NULL;
    int rc = 0;
    for (int i = 0; i < MAX_PUSHES && rc == 0; i++) { /* until the spill store fails */
        for (size_t j = 0; j < BATCH; j++)
            batch[j] = keys[RACE_HOT + eu_below(&seed, RACE_KEYS - RACE_HOT)];
        for (size_t j = 0; j < (size_t)BATCH * DIM; j++)
            g[j] = (float)(eu_unif(&seed) - 0.5);
        rc = emb_table_push(t, batch, BATCH, g, &err);
        free(err);
        err = NULL;
    }
    CHECK_MSG(rc != 0, "step race: no push failed");
    race r = {.t = t, .hot = keys};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, race_puller, &r) == 0);
    uint64_t step = emb_table_step(t), late = 0;
    int tries = 0, failed = 0;
    eu_row *row = eu_xmalloc(sizeof *row);
    while (tries < RACE_TRIES && late == 0) {
        tries++;
        failed += emb_table_push(t, batch, BATCH, g, &err) != 0;
        free(err);
        err = NULL;
        for (size_t i = 0; i < RACE_HOT; i++)
            late += eu_get(t, keys[i], row) && row->last_step > step;
    }
    atomic_store(&r.stop, 1);
    pthread_join(th, NULL);
    CHECK_MSG(r.failed == 0, "step race: %u pulls of resident rows failed", r.failed);
    CHECK_MSG(failed == tries && emb_table_step(t) == step,
              "step race: %d of %d pushes failed, step %" PRIu64 " -> %" PRIu64, failed, tries,
              step, emb_table_step(t));
    CHECK_MSG(late == 0,
              "step race: after %d failed pushes, %" PRIu64 " rows touched after the table's "
              "step %" PRIu64,
              tries, late, step);
    free(row);
    free(batch);
    free(g);
}

int main(void)
{
    const char *dir = check_tmpdir("emb_pushfail");
    char mnt[4200], spill[4300], filler[4300];
    snprintf(mnt, sizeof mnt, "%s/disk", dir);
    CHECK_MSG(mkdir(mnt, 0700) == 0, "mkdir %s: %s", mnt, strerror(errno));
    const char *force_fsize = getenv("EMB_PUSHFAIL_FSIZE");
    int on_tmpfs = (force_fsize == NULL || force_fsize[0] == '\0') && disk_possible(mnt);
    if (on_tmpfs && enter_disk(mnt) != 0) {
        CHECK_MSG(0, "entering the namespaces failed after a probe succeeded: %s", strerror(errno));
        return check_done();
    }
    fprintf(stderr, "pushfail: %s\n",
            on_tmpfs ? "spill on a full tmpfs (ENOSPC)" : "spill under a file size limit (EFBIG)");
    snprintf(spill, sizeof spill, "%s/spill", mnt);
    snprintf(filler, sizeof filler, "%s/filler", mnt);
    growing(dir);

    emb_table_config c = eu_config(EMB_OPT_ADAGRAD, DIM);
    c.lr = 0.05f;
    emb_table_config cs = c;
    cs.mem_budget_bytes = (uint64_t)(0.10 * NKEYS * emb_row_mem_bytes(&c));
    cs.spill_path = spill;
    emb_table *t = eu_create(&cs), *twin = eu_create(&c);

    /* The step race's table: one sub-shard (a pull waits for the push's lock), its budget
     * full, the hot keys pulled last so that they are resident. */
    char spill2[4300];
    snprintf(spill2, sizeof spill2, "%s/spill2", mnt);
    emb_table_config cr = c;
    cr.n_sub = 1;
    cr.mem_budget_bytes = (uint64_t)(2000 * emb_row_mem_bytes(&c));
    cr.spill_path = spill2;
    emb_table *tr = eu_create(&cr);
    uint64_t *rkeys = eu_xmalloc(RACE_KEYS * sizeof *rkeys);
    float *rout = eu_xmalloc((size_t)RACE_KEYS * DIM * sizeof(float));
    for (uint32_t i = 0; i < RACE_KEYS; i++)
        rkeys[i] = eu_key(1000000 + i);
    eu_pull(tr, rkeys, RACE_KEYS, rout);
    eu_pull(tr, rkeys, RACE_HOT, rout);

    uint64_t seed = 11;
    uint64_t *keys = eu_xmalloc(NKEYS * sizeof *keys);
    uint64_t *batch = eu_xmalloc(BATCH * sizeof *batch);
    float *g = eu_xmalloc((size_t)BATCH * DIM * sizeof(float));
    float *out = eu_xmalloc((size_t)NKEYS * DIM * sizeof(float));
    for (uint32_t i = 0; i < NKEYS; i++)
        keys[i] = eu_key(i);

    /* Every row created and most spilled, then trained a little, while the disk has room. */
    eu_pull(t, keys, NKEYS, out);
    eu_pull(twin, keys, NKEYS, out);
    for (int i = 0; i < 4; i++) {
        make_batch(&seed, keys, batch, g);
        eu_push(t, batch, BATCH, g);
        eu_push(twin, batch, BATCH, g);
    }
    emb_table_stats s0 = eu_stats(t);
    CHECK_MSG(s0.rows_spilled > NKEYS / 2, "only %" PRIu64 " rows spilled", s0.rows_spilled);
    check_same(t, twin, keys, "before the disk filled");

    /* No room left for RocksDB: every push below writes the rows it updates where they lie,
     * so one of them meets the failed flush. */
    rlim_t fsize = 0;
    if (on_tmpfs) {
        fill_disk(filler);
    } else {
        signal(SIGXFSZ, SIG_IGN);
        fsize = set_fsize(64 << 10);
    }
    char *err = NULL;
    int rc = 0, pushes = 0;
    while (pushes < MAX_PUSHES) {
        make_batch(&seed, keys, batch, g);
        rc = emb_table_push(t, batch, BATCH, g, &err);
        if (rc != 0) break;
        eu_push(twin, batch, BATCH, g);
        pushes++;
    }
    fprintf(stderr, "pushfail: push %d failed: rc %d: %s\n", pushes, rc, err ? err : "(none)");
    CHECK_MSG(rc != 0, "%d pushes to a full disk all succeeded", pushes);
    CHECK_MSG(rc == CM_EIO, "rc %d, not CM_EIO", rc);
    CHECK_MSG(eu_has(err, spill), "the message does not name the table's spill path: %s", err);
    CHECK_MSG(eu_has(err, on_tmpfs ? "No space left on device" : "File too large"),
              "the message does not name the failure: %s", err);
    free(err);
    err = NULL;
    CHECK_MSG(emb_table_step(t) == emb_table_step(twin), "the failed push advanced the step");
    step_race(tr, rkeys);
    emb_table_destroy(tr);
    free(rkeys);
    free(rout);

    /* Room again (reads never needed it): nothing of the failed push may show. */
    if (on_tmpfs)
        CHECK_MSG(unlink(filler) == 0, "unlink %s: %s", filler, strerror(errno));
    else
        set_fsize(fsize);
    check_same(t, twin, keys, "after the failed push");

    /* The same push again: it fails whole until RocksDB has resumed, then goes through once. */
    double start = now_s();
    int tries = 0;
    for (;;) {
        tries++;
        rc = emb_table_push(t, batch, BATCH, g, &err);
        if (rc == 0) break;
        CHECK_MSG(emb_table_step(t) == emb_table_step(twin), "a failed retry advanced the step");
        free(err);
        err = NULL;
        if (!on_tmpfs || now_s() - start > RECOVER_S) break;
        usleep(200 * 1000);
    }
    free(err);
    err = NULL;
    if (on_tmpfs)
        CHECK_MSG(rc == 0, "the push still fails %.0f s after the disk had room again",
                  now_s() - start);
    if (rc == 0) {
        fprintf(stderr, "pushfail: the push went through after %d tries, %.1f s\n", tries,
                now_s() - start);
        eu_push(twin, batch, BATCH, g);
        check_same(t, twin, keys, "after the push went through");
        for (int i = 0; i < 3; i++) {
            make_batch(&seed, keys, batch, g);
            eu_push(t, batch, BATCH, g);
            eu_push(twin, batch, BATCH, g);
        }
        check_same(t, twin, keys, "after later pushes");
    } else {
        fprintf(stderr, "pushfail: RocksDB did not resume after EFBIG: recovery not checked\n");
        check_same(t, twin, keys, "after the push was sent again");
    }

    emb_table_destroy(t);
    emb_table_destroy(twin);
    if (on_tmpfs) CHECK_MSG(umount2(mnt, MNT_DETACH) == 0, "umount %s: %s", mnt, strerror(errno));
    free(keys);
    free(batch);
    free(g);
    free(out);
    return check_done();
}
