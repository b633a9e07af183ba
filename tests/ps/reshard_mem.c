/*
 * `ember reshard` runs in bounded memory: a checkpoint of NR rows (dim 16, Adagrad: ~30 MB of
 * rows) resharded 2 -> 3 with --memory 2M grows the child's peak RSS (wait4's ru_maxrss) by
 * well under a quarter of the rows' bytes over a reshard of a tiny checkpoint in the same build
 * (so the bound holds under ASan too). It rebuilt every table in memory, which grew it by
 * about the table's size. The output holds every row of the input, bit for bit (weights,
 * optimizer state, update count, last step), each on the shard its key hashes to, at the
 * input's step, and is the same bytes with the default memory as with 2M. A budget too small
 * for one row is refused with a message, nothing written, and so is a key twice in a snapshot
 * whose first copy went to a scratch file long before the second came.
 */
#include <inttypes.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "embedding/embedding.h"
#include "ps/checkpoint.h"
#include "ps_test_util.h"

/* ThreadSanitizer's shadow memory grows the reshard's RSS with every byte it touches (several
 * times over), so the peak RSS bound holds only without it (ASan's shadow is an eighth). */
#define RSS_CHECK (!CHECK_TSAN)

#define NR 200000u
#define DIM 16u
#define STEP 1000u
#define REC (24u + 2u * DIM * 4u) /* key, updates, last_step, weights, Adagrad state */

static void make_config(emb_table_config *c)
{
    emb_table_config_init(c);
    c->dim = DIM;
    c->opt = EMB_OPT_ADAGRAD;
}

/* A checkpoint of n rows over 2 shards at dir (rows built off to the side, snapshotted). */
static void make_ckpt(const char *dir, uint32_t n)
{
    emb_table_config c;
    make_config(&c);
    emb_table *t[2];
    char *err = NULL;
    for (uint32_t s = 0; s < 2; s++) {
        CHECK_OK(emb_table_create(&c, &t[s], &err), err);
        emb_table_set_step(t[s], STEP);
    }
    float w[DIM], st[DIM];
    for (uint32_t i = 0; i < n; i++) {
        uint64_t key = (uint64_t)i * 0x9E3779B97F4A7C15ull + 12345;
        for (uint32_t j = 0; j < DIM; j++) {
            w[j] = (float)(i % 977) * 1e-3f - (float)j * 0.25f;
            st[j] = (float)(i % 31 + j);
        }
        emb_row r = {key, i % 50, i % STEP, w, st};
        CHECK_OK(emb_table_put_row(t[ps_key_shard(key, 2)], &r, &err), err);
    }
    char text[512];
    for (uint32_t s = 0; s < 2; s++) {
        CHECK_OK(
            emb_table_snapshot(t[s], pt_path(dir, s ? "shard-1/table-t" : "shard-0/table-t"), &err),
            err);
        emb_table_destroy(t[s]);
        int len = ps_shard_manifest_text(s, 2, "table t 0123456789abcdef\n", text, sizeof text);
        CHECK(len > 0);
        CHECK_OK(cm_write_file_atomic(pt_path(dir, s ? "shard-1/MANIFEST" : "shard-0/MANIFEST"),
                                      text, (size_t)len, &err),
                 err);
    }
}

/* The reshards run in children of a launcher forked before the test allocates anything: a
 * child's ru_maxrss counts the RSS of the process it was forked from (Linux keeps it across
 * exec), and the test's own, once it has built tables, could hide a child's whole peak. */
typedef struct job {
    char from[600], out[600], mem[16], log[600];
} job;
typedef struct result {
    int status;
    long maxrss; /* KiB */
} result;
static int to_launcher = -1, from_launcher = -1;

static void launcher(int in, int out)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    const char *bin = getenv("EMBER_BIN"), *asan = getenv("ASAN_OPTIONS");
    /* Under ASan, freed blocks stay resident in its quarantine (256 MB by default), which would
     * count every buffer the reshard ever freed as held at once. */
    char opts[2048];
    snprintf(opts, sizeof opts, "%s%squarantine_size_mb=0", asan ? asan : "",
             asan && *asan ? ":" : "");
    setenv("ASAN_OPTIONS", opts, 1);
    job j;
    while (read(in, &j, sizeof j) == (ssize_t)sizeof j) {
        char *argv[] = {(char *)bin, "reshard", "--from",   j.from, "--shards", "3",
                        "--out",     j.out,     "--memory", j.mem,  NULL};
        if (j.mem[0] == '\0') argv[8] = NULL;
        result r = {-1, 0};
        pid_t pid = fork();
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (freopen(j.log, "w", stderr) == NULL) _exit(126);
            execv(bin, argv);
            _exit(127);
        }
        struct rusage ru;
        if (pid > 0 && wait4(pid, &r.status, 0, &ru) == pid) r.maxrss = ru.ru_maxrss;
        if (write(out, &r, sizeof r) != (ssize_t)sizeof r) break;
    }
    _exit(0);
}

static void launcher_start(void)
{
    int a[2], b[2];
    if (pipe(a) != 0 || pipe(b) != 0) pt_die("pipe", NULL);
    pid_t pid = fork();
    if (pid < 0) pt_die("fork", NULL);
    if (pid == 0) {
        close(a[1]);
        close(b[0]);
        launcher(a[0], b[1]);
    }
    close(a[0]);
    close(b[1]);
    to_launcher = a[1];
    from_launcher = b[0];
}

/* Runs `ember reshard --from from --shards 3 --out out [--memory mem]`, stderr to log; returns
 * the wait status, and the child's peak RSS in KiB into *maxrss. */
static int reshard(const char *from, const char *out, const char *mem, const char *log,
                   long *maxrss)
{
    job j;
    memset(&j, 0, sizeof j);
    snprintf(j.from, sizeof j.from, "%s", from);
    snprintf(j.out, sizeof j.out, "%s", out);
    snprintf(j.mem, sizeof j.mem, "%s", mem ? mem : "");
    snprintf(j.log, sizeof j.log, "%s", log);
    result r;
    if (write(to_launcher, &j, sizeof j) != (ssize_t)sizeof j ||
        read(from_launcher, &r, sizeof r) != (ssize_t)sizeof r)
        pt_die("the launcher is gone", NULL);
    *maxrss = r.maxrss;
    return r.status;
}

typedef struct rows {
    uint8_t *recs; /* REC bytes each */
    size_t n, cap;
} rows;

static int collect(const emb_row *r, void *arg)
{
    rows *x = arg;
    if (x->n == x->cap) {
        x->cap = x->cap ? 2 * x->cap : 4096;
        x->recs = realloc(x->recs, x->cap * REC);
        if (x->recs == NULL) pt_die("out of memory", NULL);
    }
    uint8_t *p = x->recs + x->n++ * REC;
    memcpy(p, &r->key, 8);
    memcpy(p + 8, &r->updates, 8);
    memcpy(p + 16, &r->last_step, 8);
    memcpy(p + 24, r->weights, DIM * 4);
    memcpy(p + 24 + DIM * 4, r->state, DIM * 4);
    return 0;
}

/* Every row of ckpt, sorted by key (foreach_row checks each is on its key's shard). */
static rows all_rows(const char *ckpt)
{
    rows x = {0};
    char *err = NULL;
    CHECK_OK(ps_checkpoint_foreach_row(ckpt, "t", collect, &x, &err), err);
    if (x.n) qsort(x.recs, x.n, REC, cm_u64_cmp) /* a record starts with its key */;
    return x;
}

static int same_file(const char *a, const char *b)
{
    void *x = NULL, *y = NULL;
    size_t lx = 0, ly = 0;
    int same = cm_read_file(a, &x, &lx, NULL) == CM_OK && cm_read_file(b, &y, &ly, NULL) == CM_OK &&
               lx == ly && memcmp(x, y, lx) == 0;
    free(x);
    free(y);
    return same;
}

static char g_lie_out[600], g_log[600];
static uint64_t g_lie_key;

/* A key twice, its copies far apart in shard 0's snapshot: with --memory 2M the keys go to
 * several scratch files, the first copy written out long before the second comes. */
static void refuses_twice(const char *ckpt, const char *what)
{
    long unused = 0;
    unlink(g_log);
    int st = reshard(ckpt, g_lie_out, "2M", g_log, &unused);
    void *msg = NULL;
    size_t len = 0;
    char key[32];
    snprintf(key, sizeof key, "key %" PRIu64 " twice", g_lie_key);
    cm_read_file(g_log, &msg, &len, NULL);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 1 && msg && strstr(msg, key),
              "%s: status %d, stderr: %.*s", what, st, (int)len, msg ? (char *)msg : "");
    free(msg);
    char out[700];
    struct stat sb;
    snprintf(out, sizeof out, "%s/ckpt/step-%u", g_lie_out, STEP);
    CHECK_MSG(stat(out, &sb) != 0, "%s: a refused reshard left %s", what, out);
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    launcher_start();
    const char *dir = check_tmpdir("ps_reshard_mem");
    char tiny[600], big[600], o_tiny[600], o_big[600], o_def[600], o_bad[600], log[600];
    snprintf(tiny, sizeof tiny, "%s/tiny/step-%u", dir, STEP);
    snprintf(big, sizeof big, "%s/big/step-%u", dir, STEP);
    snprintf(o_tiny, sizeof o_tiny, "%s/o_tiny", dir);
    snprintf(o_big, sizeof o_big, "%s/o_big", dir);
    snprintf(o_def, sizeof o_def, "%s/o_def", dir);
    snprintf(o_bad, sizeof o_bad, "%s/o_bad", dir);
    snprintf(log, sizeof log, "%s/reshard.log", dir);
    make_ckpt(tiny, 100);
    make_ckpt(big, NR);

    long base = 0, peak = 0, unused = 0;
    double t0 = psp_now();
    int st = reshard(tiny, o_tiny, "2M", log, &base);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "tiny reshard: status %d (see %s)", st, log);
    double t1 = psp_now();
    st = reshard(big, o_big, "2M", log, &peak);
    double t2 = psp_now();
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "big reshard: status %d (see %s)", st, log);
    /* A table rebuilt in memory takes at least its rows' bytes (its hash table more). */
    double grew_mb = (double)(peak - base) / 1024.0, rows_mb = (double)NR * REC / 1048576.0;
    fprintf(stderr,
            "peak RSS: tiny %ld KiB (%.2f s), %u rows %ld KiB (%.2f s): %.1f MiB more, rows "
            "%.1f MiB\n",
            base, t1 - t0, NR, peak, t2 - t1, grew_mb, rows_mb);
    if (!RSS_CHECK)
        fprintf(stderr, "ps_reshard_mem: ThreadSanitizer build: the peak RSS bound is skipped\n");
    CHECK_MSG(!RSS_CHECK || grew_mb < rows_mb / 4,
              "a reshard with --memory 2M grew the peak RSS by %.1f MiB for %.1f MiB of rows",
              grew_mb, rows_mb);

    /* Every row, bit for bit, on its key's shard (checked by foreach_row), at the same step. */
    char out[700];
    snprintf(out, sizeof out, "%s/ckpt/step-%u", o_big, STEP);
    rows a = all_rows(big), b = all_rows(out);
    CHECK_MSG(a.n == NR && b.n == a.n && memcmp(a.recs, b.recs, a.n * REC) == 0,
              "resharded rows differ: %zu rows in, %zu out", a.n, b.n);
    free(a.recs);
    free(b.recs);
    for (uint32_t s = 0; s < 3; s++) {
        char sub[64];
        uint64_t step = 0;
        char *err = NULL;
        snprintf(sub, sizeof sub, "shard-%u/table-t", s);
        CHECK_OK(emb_snapshot_step(pt_path(out, sub), &step, &err), err);
        CHECK_MSG(step == STEP, "shard %u of the reshard is at step %" PRIu64, s, step);
    }

    /* The default memory writes the same bytes. */
    st = reshard(big, o_def, NULL, log, &unused);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "default reshard: status %d", st);
    char def[700];
    snprintf(def, sizeof def, "%s/ckpt/step-%u", o_def, STEP);
    for (uint32_t s = 0; s < 3; s++) {
        static const char *const files[] = {"rows.bin", "MANIFEST"};
        for (uint32_t f = 0; f < 2; f++) {
            char p[64];
            snprintf(p, sizeof p, "shard-%u/table-t/%s", s, files[f]);
            CHECK_MSG(same_file(pt_path(out, p), pt_path(def, p)),
                      "%s differs between --memory 2M and the default", p);
        }
    }

    /* Too small for one row: a message and a failed status (not a signal), no checkpoint. */
    unlink(log);
    st = reshard(big, o_bad, "100", log, &unused);
    void *msg = NULL;
    size_t len = 0;
    cm_read_file(log, &msg, &len, NULL);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) != 0 && msg && strstr(msg, "too small"),
              "--memory 100: status %d, stderr: %.*s", st, (int)len, msg ? (char *)msg : "");
    free(msg);
    struct stat sb;
    snprintf(out, sizeof out, "%s/ckpt/step-%u", o_bad, STEP);
    CHECK_MSG(stat(out, &sb) != 0, "a refused reshard left %s", out);

    /* Shard 0's first key given to its last row too. */
    uint8_t *file = NULL;
    size_t blen = 0;
    char *err = NULL;
    CHECK_OK(cm_read_file(pt_path(big, "shard-0/table-t/rows.bin"), (void **)&file, &blen, &err),
             err);
    CHECK(file != NULL && blen > 32 + 8 + 2 * REC);
    memcpy(&g_lie_key, file + 32, 8);
    free(file);
    snprintf(g_lie_out, sizeof g_lie_out, "%s/o_lie", dir);
    snprintf(g_log, sizeof g_log, "%s", log);
    pt_with_key_lie(big, "t", (blen - 40) / REC - 1, g_lie_key, refuses_twice, "a key twice");
    return pt_finish(dir);
}
