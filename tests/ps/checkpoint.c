/*
 * Checkpoints survive the processes: train a little on 2 `ember ps` processes, SAVE, kill -9
 * both, start fresh ones (which hold only initial rows: checked, so the comparison has
 * teeth), LOAD, and every row of both tables and both dense blocks is bit-identical to what
 * was pulled before the save. A LOAD of a missing checkpoint fails and changes nothing. The
 * fresh processes run with `--checkpoint-root` (the test's directory): LOAD within it works,
 * a SAVE or LOAD outside it is refused. The offline reader refuses a row on another shard than
 * its key's, reshard a key twice, and table names that are no plain file names, even with every
 * checksum recomputed.
 */
#include <dirent.h>
#include <inttypes.h>

#include "ps_test_util.h"

#define NK 500u

/* Table q spills (a budget of ~100 of its 250 rows a shard): its rows come back bit for bit
 * from the checkpoint too, and repeated LOADs keep its spill under one of two names. */
static const char conf_fmt[] =
    "[cluster]\nshards = 2\nworkers = 1\nspill_dir = %s/spill\n"
    "[table t]\ndim = 8\noptimizer = sgd\nlr = 0.1\ninit_scale = 0.05\n"
    "[table q]\ndim = 4\noptimizer = adagrad\nlr = 0.05\npush_codec = int8\npull_codec = fp32\n"
    "memory = 8K\n"
    "[dense d0]\nsize = 100\noptimizer = adam\nlr = 0.01\n"
    "[dense d1]\nsize = 33\noptimizer = sgd\nlr = 0.5\n";

static const uint32_t dims[2] = {8, 4}, dsize[2] = {100, 33};

typedef struct state {
    float t[NK * 8], q[NK * 4], d0[100], d1[33];
} state;

static void pull_all(ps_client *c, const uint64_t *keys, state *s)
{
    char *err = NULL;
    CHECK_OK(ps_client_pull(c, 0, keys, NK, s->t, &err), err);
    CHECK_OK(ps_client_pull(c, 1, keys, NK, s->q, &err), err);
    CHECK_OK(ps_client_dense_pull(c, 0, s->d0, &err), err);
    CHECK_OK(ps_client_dense_pull(c, 1, s->d1, &err), err);
}

static void train(ps_client *c, const uint64_t *keys)
{
    char *err = NULL;
    float *g = malloc(NK * 8 * sizeof *g), dv[100];
    for (uint32_t i = 0; i < 100; i++)
        dv[i] = (float)i * 0.01f;
    int assigned = 0;
    CHECK_OK(ps_client_dense_init(c, 0, dv, &assigned, &err), err);
    CHECK_OK(ps_client_dense_init(c, 1, dv, &assigned, &err), err);
    for (uint32_t step = 0; step < 5; step++) {
        for (uint32_t tb = 0; tb < 2; tb++) {
            for (uint32_t i = 0; i < NK * dims[tb]; i++)
                g[i] = (float)((i * 7 + step * 13) % 17) * 0.01f - 0.08f;
            CHECK_OK(ps_client_push(c, tb, keys, NK, g, &err), err);
        }
        for (uint32_t b = 0; b < 2; b++) {
            for (uint32_t i = 0; i < dsize[b]; i++)
                g[i] = (float)((i + step) % 5) - 2.0f;
            CHECK_OK(ps_client_dense_push(c, b, g, &err), err);
        }
    }
    CHECK_OK(ps_client_flush(c, &err), err);
    free(g);
}

/* pt_spawn_cluster with `--checkpoint-root root`. */
static void spawn_rooted(const char *config, const char *const *urls, const char *root, pid_t *pids)
{
    for (uint32_t i = 0; i < 2; i++) {
        char shard[16];
        snprintf(shard, sizeof shard, "%u", i);
        char *argv[] = {getenv("EMBER_BIN"), "ps",         "--config", (char *)config,
                        "--shard",           shard,        "--listen", (char *)urls[i],
                        "--checkpoint-root", (char *)root, NULL};
        pids[i] = psp_spawn_argv(argv, urls[i], NULL);
        if (pids[i] < 0) pt_die("spawn ember ps", NULL);
    }
    for (uint32_t i = 0; i < 2; i++)
        if (psp_wait_ready(pids[i], urls[i], 20.0) != 0)
            pt_die("ember ps did not come up", strdup(urls[i]));
}

/* The offline reader (export, reshard) refuses a shard-0 MANIFEST with any byte changed before
 * its checksum, naming it, and reads it again once restored. */
static void check_manifest_damage(const char *ckpt)
{
    const char *path = pt_path(pt_path(ckpt, "shard-0"), "MANIFEST");
    FILE *f = fopen(path, "rb");
    char text[4096];
    size_t len = f ? fread(text, 1, sizeof text - 1, f) : 0;
    if (f) fclose(f);
    text[len] = '\0'; /* strstr below: the file's bytes only */
    CHECK_MSG(len > 40 && len < sizeof text - 1, "%s: %zu bytes", path, len);
    char tables[PS_MAX_TABLES][PS_NAME_MAX], dense[PS_MAX_DENSE][PS_NAME_MAX];
    uint32_t nt = 0, nd = 0;
    char *err = NULL;
    const char *end = strstr(text, "checksum ");
    size_t signed_len = end ? (size_t)(end - text) : 0;
    int missed = 0;
    for (size_t i = 0; i < signed_len; i += 3) {
        text[i] ^= 0x04;
        FILE *w = fopen(path, "wb");
        CHECK(w && fwrite(text, 1, len, w) == len && fclose(w) == 0);
        int rc = ps_checkpoint_names(ckpt, tables, &nt, dense, &nd, &err);
        if (rc != CM_ECORRUPT || !err || !strstr(err, "MANIFEST")) missed++;
        free(err), err = NULL;
        text[i] ^= 0x04;
    }
    CHECK_MSG(signed_len > 0 && missed == 0, "%d damaged manifests read as good", missed);
    FILE *w = fopen(path, "wb");
    CHECK(w && fwrite(text, 1, len, w) == len && fclose(w) == 0);
    CHECK_OK(ps_checkpoint_names(ckpt, tables, &nt, dense, &nd, &err), err);
    CHECK_MSG(nt == 2 && nd == 2, "%u tables, %u dense blocks", nt, nd);
}

static int count_row(const emb_row *row, void *arg)
{
    (void)row;
    ++*(uint64_t *)arg;
    return 0;
}

/* pt_with_key_lie on table t, then its rows read again. */
static void with_key_lie(const char *ckpt, size_t rec, uint64_t key,
                         void (*check)(const char *ckpt, const char *what), const char *what)
{
    pt_with_key_lie(ckpt, "t", rec, key, check, what);
    char *err = NULL;
    uint64_t seen = 0;
    CHECK_OK(ps_checkpoint_foreach_row(ckpt, "t", count_row, &seen, &err), err);
    CHECK(seen == NK);
}

/* Export refuses the lie naming shard-0's snapshot of t. */
static void export_refuses(const char *ckpt, const char *what)
{
    char *err = NULL;
    uint64_t seen = 0;
    int rc = ps_checkpoint_foreach_row(ckpt, "t", count_row, &seen, &err);
    CHECK_MSG(rc == CM_ECORRUPT && err && strstr(err, "shard-0/table-t"),
              "%s: export rc=%d after %" PRIu64 " rows, err=%s", what, rc, seen,
              err ? err : "(none)");
    free(err);
}

/* Reshard refuses it naming the checkpoint and table, and writes nothing. */
static void reshard_refuses(const char *ckpt, const char *what)
{
    char *err = NULL;
    char to[1024];
    snprintf(to, sizeof to, "%s.resharded", ckpt);
    int rc = ps_checkpoint_reshard(ckpt, to, 1, 0, &err);
    CHECK_MSG(rc == CM_ECORRUPT && err && strstr(err, ckpt) && strstr(err, "table t") &&
                  access(to, F_OK) != 0,
              "%s: reshard rc=%d err=%s", what, rc, err ? err : "(none)");
    free(err);
}

/* A row moved into another shard's snapshot (a key that shard 1 also holds: exported twice, and
 * resharded as whichever came last), and a key twice within one shard's snapshot (resharded as
 * one row, the other dropped). */
static void check_row_lies(const char *ckpt, const uint64_t *keys)
{
    uint64_t key = keys[0];
    for (uint32_t i = 0; i < NK && ps_key_shard(key, 2) != 1; i++)
        key = keys[i];
    CHECK(ps_key_shard(key, 2) == 1);
    with_key_lie(ckpt, 0, key, export_refuses, "a row on the wrong shard");
    char rows[1024];
    snprintf(rows, sizeof rows, "%s/shard-0/table-t/rows.bin", ckpt);
    uint8_t *b = NULL;
    size_t len = 0;
    char *err = NULL;
    CHECK_OK(cm_read_file(rows, (void **)&b, &len, &err), err);
    CHECK(b && len > 40);
    memcpy(&key, b + 32, 8);
    free(b);
    with_key_lie(ckpt, 1, key, reshard_refuses, "a key twice");
}

/* Shard 1's snapshot of t replaced by a valid one of a table with another dim (its own
 * checksums all good): its rows would be read with shard 0's layout, 8 floats from records of
 * 2 (past the buffer at the end of a chunk). Export and reshard refuse it naming the snapshot
 * and the field; the snapshot is put back afterwards. */
static void check_config_lie(const char *ckpt, const ps_config *cfg, const uint64_t *keys)
{
    char snap[1024], keep[1100];
    snprintf(snap, sizeof snap, "%s/shard-1/table-t", ckpt);
    snprintf(keep, sizeof keep, "%s.keep", snap);
    CHECK(rename(snap, keep) == 0);
    emb_table_config lie = cfg->tables[0].cfg;
    lie.dim = 2;
    lie.spill_path = NULL;
    lie.mem_budget_bytes = 0;
    emb_table *t = NULL;
    char *err = NULL;
    float w[2];
    uint64_t key = keys[0];
    for (uint32_t i = 0; i < NK && ps_key_shard(key, 2) != 1; i++)
        key = keys[i];
    CHECK_OK(emb_table_create(&lie, &t, &err), err);
    if (t != NULL) {
        CHECK_OK(emb_table_pull(t, &key, 1, w, &err), err);
        CHECK_OK(emb_table_snapshot(t, snap, &err), err);
        emb_table_destroy(t);
    }
    uint64_t seen = 0;
    int rc = ps_checkpoint_foreach_row(ckpt, "t", count_row, &seen, &err);
    CHECK_MSG(rc == CM_ECORRUPT && err && strstr(err, "shard-1/table-t") && strstr(err, "dim"),
              "another dim on shard 1: export rc=%d, err=%s", rc, err ? err : "(none)");
    free(err), err = NULL;
    reshard_refuses(ckpt, "another dim on shard 1");
    CHECK(cm_rmtree(snap, NULL) == CM_OK && rename(keep, snap) == 0);
    CHECK_OK(ps_checkpoint_foreach_row(ckpt, "t", count_row, &seen, &err), err);
}

/* A dense block is read from its owner, shard (its index) % shards, as reshard and the servers
 * do: a stray file of that name on another shard (here d0's 100 values copied to shard 0 as
 * d1) was read first, and export took it for d1's 33. */
static void check_dense_owner(const char *ckpt)
{
    char from[1024], stray[1024];
    snprintf(from, sizeof from, "%s/shard-0/dense-d0.bin", ckpt);
    snprintf(stray, sizeof stray, "%s/shard-0/dense-d1.bin", ckpt);
    void *b = NULL;
    size_t len = 0;
    char *err = NULL;
    CHECK_OK(cm_read_file(from, &b, &len, &err), err);
    CHECK_OK(cm_write_file_atomic(stray, b, len, &err), err);
    free(b);
    float *v = NULL;
    uint64_t n = 0;
    CHECK_OK(ps_checkpoint_dense(ckpt, "d1", &v, &n, &err), err);
    CHECK_MSG(n == dsize[1], "dense d1 read as %" PRIu64 " values, want %u", n, dsize[1]);
    free(v);
    CHECK(unlink(stray) == 0);
}

/* shard-0's MANIFEST with one more table line (its checksum recomputed): a name that is no
 * plain file name (reshard makes paths of it), or longer than a name can be (it was cut to 31
 * bytes), is refused naming the manifest; the manifest is put back afterwards. */
static void check_bad_names(const char *ckpt)
{
    char mfp[1024];
    snprintf(mfp, sizeof mfp, "%s/shard-0/MANIFEST", ckpt);
    static const char *const bad[] = {"../../escape", "a/b", ".hidden",
                                      "a_name_of_forty_bytes_is_too_long_for_it"};
    char *mf = NULL, *err = NULL;
    size_t mlen = 0, body = 0;
    CHECK_OK(cm_read_file(mfp, (void **)&mf, &mlen, &err), err);
    CHECK(mf && cm_seal_check(mf, mlen, "checksum", &body) == CM_OK);
    char tables[PS_MAX_TABLES][PS_NAME_MAX], dense[PS_MAX_DENSE][PS_NAME_MAX];
    uint32_t nt = 0, nd = 0;
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char out[4096];
        int n = snprintf(out, sizeof out, "%.*stable %s 0123456789abcdef\n", (int)body, mf, bad[i]);
        n = cm_seal_append(out, (size_t)n, sizeof out, "checksum");
        CHECK_OK(cm_write_file_atomic(mfp, out, (size_t)n, &err), err);
        int rc = ps_checkpoint_names(ckpt, tables, &nt, dense, &nd, &err);
        CHECK_MSG(rc == CM_ECORRUPT && err && strstr(err, "MANIFEST"),
                  "table name '%s': rc=%d err=%s", bad[i], rc, err ? err : "(none)");
        free(err), err = NULL;
    }
    CHECK_OK(cm_write_file_atomic(mfp, mf, mlen, &err), err);
    CHECK_OK(ps_checkpoint_names(ckpt, tables, &nt, dense, &nd, &err), err);
    free(mf);
}

/* Pushes a zero gradient to every key of table q (int8, adagrad) and pulls its rows into q:
 * what goes out is just the client's residuals (a zero row where it has none, which leaves
 * the row as it was). */
static void push_zeros(ps_client *c, const uint64_t *keys, float *q)
{
    static float zero[NK * 4];
    char *err = NULL;
    CHECK_OK(ps_client_push(c, 1, keys, NK, zero, &err), err);
    CHECK_OK(ps_client_pull(c, 1, keys, NK, q, &err), err);
}

/* The bytes of a file (NULL when unreadable). */
static void *file_bytes(const char *path, size_t *n)
{
    void *b = NULL;
    return cm_read_file(path, &b, n, NULL) == CM_OK ? b : NULL;
}

static void write_bytes(const char *path, const void *b, size_t n)
{
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL && fwrite(b, 1, n, f) == n && fclose(f) == 0);
}

/* A load of a residual file that must fail with `want`, naming the file, and leave none. */
static void load_refused(ps_client *c, const char *path, int want, const char *ckpt,
                         const uint64_t *keys, const float *saved)
{
    static float q[NK * 4];
    char *err = NULL;
    int rc = ps_client_residuals_load(c, path, &err);
    CHECK_MSG(rc == want && err && strstr(err, path), "load of %s: %d, %s", path, rc,
              err ? err : "(no message)");
    free(err), err = NULL;
    CHECK_OK(ps_client_load(c, ckpt, &err), err);
    push_zeros(c, keys, q);
    CHECK_MSG(memcmp(q, saved, sizeof q) == 0, "a refused residual file left residuals");
}

/* int8 error feedback (table q): a push leaves residuals in the client. ps_client_load empties
 * them, so a zero push to the loaded rows leaves them as saved (before, the residuals of
 * pushes to the replaced rows went out with it and moved them). Their file round-trips to the
 * same bytes, and loaded they go out with the next push; a damaged, truncated or missing file is
 * refused naming it, and leaves none. */
static void check_residuals(ps_client *c, const char *ckpt, const char *dir, const uint64_t *keys,
                            const float *saved)
{
    static float g[NK * 4], q[NK * 4];
    char *err = NULL;
    for (uint32_t i = 0; i < NK * 4; i++)
        g[i] = (float)((i * 11) % 23) * 0.013f - 0.1f;
    CHECK_OK(ps_client_push(c, 1, keys, NK, g, &err), err);
    const char *ef = pt_path(dir, "w0.ef"), *ef2 = pt_path(dir, "w0-again.ef");
    CHECK_OK(ps_client_residuals_save(c, ef, &err), err);
    CHECK_OK(ps_client_load(c, ckpt, &err), err);
    push_zeros(c, keys, q);
    CHECK_MSG(memcmp(q, saved, sizeof q) == 0,
              "a zero push after LOAD changed table q: the old rows' residuals went out");

    CHECK_OK(ps_client_load(c, ckpt, &err), err);
    CHECK_OK(ps_client_residuals_load(c, ef, &err), err);
    CHECK_OK(ps_client_residuals_save(c, ef2, &err), err);
    size_t n = 0, n2 = 0;
    unsigned char *b = file_bytes(ef, &n), *b2 = file_bytes(ef2, &n2);
    CHECK_MSG(b && b2 && n == n2 && n > (size_t)NK * (8 + 16) && memcmp(b, b2, n) == 0,
              "residuals saved, loaded and saved again: %zu bytes, then %zu", n, n2);
    push_zeros(c, keys, q);
    CHECK_MSG(memcmp(q, saved, sizeof q) != 0, "loaded residuals did not go out with a push");

    CHECK(ps_client_residuals_load(c, pt_path(dir, "none.ef"), &err) == CM_ENOTFOUND);
    free(err), err = NULL;
    if (b == NULL || n < 64) goto out;
    const char *bad = pt_path(dir, "bad.ef");
    b[n / 2] ^= 0x40;
    write_bytes(bad, b, n);
    b[n / 2] ^= 0x40;
    load_refused(c, bad, CM_ECORRUPT, ckpt, keys, saved);
    write_bytes(bad, b, n - 5);
    load_refused(c, bad, CM_ECORRUPT, ckpt, keys, saved);
    CHECK(ps_residuals_check(b, n, ef, &err) == CM_OK);
    CHECK(ps_residuals_check(b, 20, ef, &err) == CM_ECORRUPT);
    CHECK_MSG(err && strstr(err, "w0.ef") && strstr(err, "truncated"), "%s", err ? err : "-");
    free(err), err = NULL;
out:
    CHECK_OK(ps_client_load(c, ckpt, &err), err);
    free(b);
    free(b2);
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_checkpoint");
    ps_config cfg;
    static char conf[2048];
    snprintf(conf, sizeof conf, conf_fmt, dir);
    const char *path = pt_config(dir, "ps.conf", conf, &cfg);
    const char *urls[2] = {pt_ipc(dir, "s0"), pt_ipc(dir, "s1")};
    const char *ckpt = pt_path(dir, "ckpt");
    uint64_t keys[NK];
    for (uint32_t i = 0; i < NK; i++)
        keys[i] = (uint64_t)i * 1000003u + 17;
    static state before, fresh, after;
    char *err = NULL;

    pid_t pids[2];
    pt_spawn_cluster(path, 2, urls, pids);
    ps_client *c = pt_client(&cfg, urls, 0, 10000);
    train(c, keys);
    pull_all(c, keys, &before);
    CHECK_OK(ps_client_save(c, ckpt, &err), err);
    ps_client_destroy(c);
    check_manifest_damage(ckpt);
    check_row_lies(ckpt, keys);
    check_config_lie(ckpt, &cfg, keys);
    check_dense_owner(ckpt);
    check_bad_names(ckpt);

    for (int i = 0; i < 2; i++) {
        int st = psp_stop(pids[i], SIGKILL, 5.0);
        CHECK(st != -1 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    }
    spawn_rooted(path, urls, dir, pids);
    c = pt_client(&cfg, urls, 0, 10000);
    pull_all(c, keys, &fresh);
    CHECK_MSG(memcmp(fresh.t, before.t, sizeof fresh.t) != 0,
              "fresh PS already holds the trained rows");
    CHECK(memcmp(fresh.q, before.q, sizeof fresh.q) != 0);
    for (uint32_t i = 0; i < 33; i++)
        CHECK(fresh.d1[i] == 0.0f); /* uninitialised block */

    /* A missing checkpoint: error naming it, state untouched. */
    CHECK(ps_client_load(c, pt_path(dir, "nope"), &err) != CM_OK);
    CHECK_MSG(err && strstr(err, "nope"), "%s", err ? err : "(none)");
    free(err), err = NULL;
    pull_all(c, keys, &after);
    CHECK(memcmp(&after, &fresh, sizeof after) == 0);

    /* Outside the checkpoint root: refused, state untouched. */
    CHECK(ps_client_load(c, "/tmp", &err) == CM_EINVAL);
    CHECK_MSG(err && strstr(err, "outside this PS's checkpoint root"), "%s", err ? err : "(none)");
    free(err), err = NULL;
    CHECK(ps_client_save(c, "/tmp/ember-not-here", &err) == CM_EINVAL);
    free(err), err = NULL;
    pull_all(c, keys, &after);
    CHECK(memcmp(&after, &fresh, sizeof after) == 0);

    CHECK_OK(ps_client_load(c, ckpt, &err), err);
    pull_all(c, keys, &after);
    CHECK_MSG(memcmp(after.t, before.t, sizeof after.t) == 0, "table t differs after LOAD");
    CHECK_MSG(memcmp(after.q, before.q, sizeof after.q) == 0, "table q differs after LOAD");
    CHECK_MSG(memcmp(after.d0, before.d0, sizeof after.d0) == 0, "dense d0 differs after LOAD");
    CHECK_MSG(memcmp(after.d1, before.d1, sizeof after.d1) == 0, "dense d1 differs after LOAD");
    /* Training carries on from the restored rows (sgd: w - lr * g in double, lr a float). */
    float g[8] = {1, 1, 1, 1, 1, 1, 1, 1}, row[8];
    CHECK_OK(ps_client_push(c, 0, keys, 1, g, &err), err);
    CHECK_OK(ps_client_pull(c, 0, keys, 1, row, &err), err);
    for (int j = 0; j < 8; j++)
        CHECK(row[j] == (float)(before.t[j] - (double)0.1f * 1.0));
    check_residuals(c, ckpt, dir, keys, before.q);
    /* More LOADs: each restored table takes the other of its two spill names (it used to append
     * ".load" every time, until the name was too long and LOAD failed). */
    for (int i = 0; i < 5; i++)
        CHECK_OK(ps_client_load(c, ckpt, &err), err);
    pull_all(c, keys, &after);
    CHECK(memcmp(after.q, before.q, sizeof after.q) == 0);
    for (int sh = 0; sh < 2; sh++) {
        char sd[4200];
        snprintf(sd, sizeof sd, "%s/spill/shard-%d", dir, sh);
        DIR *d = opendir(sd);
        CHECK_MSG(d != NULL, "no spill directory %s", sd);
        int names = 0;
        for (struct dirent *e; d && (e = readdir(d)) != NULL;) {
            if (e->d_name[0] == '.') continue;
            names++;
            CHECK_MSG(!strcmp(e->d_name, "q") || !strcmp(e->d_name, "q+load"),
                      "unexpected spill name %s/%s", sd, e->d_name);
        }
        if (d) closedir(d);
        CHECK(names >= 1 && names <= 2);
    }
    ps_client_destroy(c);
    for (int i = 0; i < 2; i++) {
        int st = psp_stop(pids[i], SIGTERM, 10.0);
        CHECK_MSG(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard %d exit status %d", i,
                  st);
    }
    return pt_finish(dir);
}
