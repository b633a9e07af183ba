/* The cluster config parser: a full good file, and each kind of error naming file:line. Also
 * `ember ps --plan` on the good file. */
#include <sys/wait.h>

#include "ps_test_util.h"

static const char *dir;

static const char good[] = "# a comment line\n"
                           "[cluster]\n"
                           "shards = 3\n"
                           "workers = 4   # trailing comment\n"
                           "staleness = 2\n"
                           "max_message = 64M\n"
                           "spill_dir = /tmp/x y\n"
                           "tls_cert = /c.pem\n"
                           "tls_key = /k.pem\n"
                           "tls_ca = /ca.pem\n"
                           "\n"
                           "[table user]\n"
                           "dim = 8\n"
                           "optimizer = adam\n"
                           "lr = 0.01\n"
                           "l2 = 0.5\n"
                           "eps = 1e-6\n"
                           "beta1 = 0.8\n"
                           "beta2 = 0.99\n"
                           "adagrad_init = 0.1\n"
                           "ftrl_beta = 2\n"
                           "ftrl_l1 = 0.25\n"
                           "init_scale = 0.05\n"
                           "seed = 99\n"
                           "memory = 2M\n"
                           "admit = 3\n"
                           "ttl = 100\n"
                           "reserve_rows = 3M\n"
                           "push_codec = int8\n"
                           "pull_codec = fp16\n"
                           "  [ table item ]  \n"
                           "dim = 32\n"
                           "[dense mlp]\n"
                           "size = 1000\n"
                           "optimizer = sgd\n"
                           "lr = 0.5\n"
                           "beta1 = 0.5\n"
                           "beta2 = 0.6\n"
                           "eps = 1e-4\n";

static void test_good(void)
{
    ps_config c;
    /* A UTF-8 byte order mark (Windows editors write one) is no part of the first line: read
     * as text it made "[cluster]" line 1's "expected key = value". */
    char bom[sizeof good + 3] = "\xef\xbb\xbf";
    memcpy(bom + 3, good, sizeof good);
    pt_config(dir, "bom.conf", bom, &c);
    CHECK(c.n_shards == 3 && c.n_tables == 2 && c.n_dense == 1);
    pt_config(dir, "good.conf", good, &c);
    CHECK(c.n_shards == 3 && c.n_workers == 4 && c.staleness == 2);
    CHECK(c.max_msg_bytes == 64ull << 20);
    CHECK(!strcmp(c.spill_dir, "/tmp/x y") && !strcmp(c.tls_cert, "/c.pem"));
    CHECK(!strcmp(c.tls_key, "/k.pem") && !strcmp(c.tls_ca, "/ca.pem"));
    CHECK(c.n_tables == 2 && c.n_dense == 1);
    const ps_table_spec *u = &c.tables[0];
    CHECK(!strcmp(u->name, "user") && u->cfg.dim == 8 && u->cfg.opt == EMB_OPT_ADAM);
    CHECK(u->cfg.lr == 0.01f && u->cfg.l2 == 0.5f && u->cfg.eps == 1e-6f);
    CHECK(u->cfg.beta1 == 0.8f && u->cfg.beta2 == 0.99f && u->cfg.adagrad_init == 0.1f);
    CHECK(u->cfg.ftrl_beta == 2.0f && u->cfg.ftrl_l1 == 0.25f && u->cfg.init_scale == 0.05f);
    CHECK(u->cfg.seed == 99 && u->cfg.mem_budget_bytes == 2ull << 20 &&
          u->cfg.admit_threshold == 3);
    CHECK(u->cfg.ttl_steps == 100 && u->push_codec == PS_CODEC_INT8 &&
          u->pull_codec == PS_CODEC_F16);
    CHECK(u->cfg.reserve_rows == 3ull << 20);
    /* The plan's start size: the 2M budget caps the 3M-row reservation; item starts small. */
    ps_plan_row pu, pi;
    ps_plan(&c, 0, 1000, &pu);
    ps_plan(&c, 1, 1000, &pi);
    CHECK(pu.initial_bytes <= 2u << 20 && pu.initial_bytes >= 1u << 20);
    CHECK(pi.initial_bytes > 0 && pi.initial_bytes < pu.initial_bytes);
    /* Unset fields keep the documented defaults. */
    const ps_table_spec *it = &c.tables[1];
    emb_table_config def;
    emb_table_config_init(&def);
    CHECK(!strcmp(it->name, "item") && it->cfg.dim == 32 && it->cfg.opt == def.opt);
    CHECK(it->cfg.lr == def.lr && it->cfg.init_scale == def.init_scale);
    CHECK(it->cfg.reserve_rows == 0);
    CHECK(it->push_codec == PS_CODEC_F32 && it->pull_codec == PS_CODEC_F32);
    const ps_dense_spec *d = &c.dense[0];
    CHECK(!strcmp(d->name, "mlp") && d->size == 1000 && d->opt == PS_DENSE_SGD && d->lr == 0.5f);
    CHECK(d->beta1 == 0.5f && d->beta2 == 0.6f && d->eps == 1e-4f);

    /* Defaults of an empty file. */
    ps_config e;
    pt_config(dir, "empty.conf", "# nothing\n", &e);
    CHECK(e.n_shards == 1 && e.n_workers == 1 && e.staleness == -1 && e.n_tables == 0);
    CHECK(e.max_msg_bytes == 256ull << 20);
}

/* Loads len bytes of text (NULs included) and expects an error mentioning "<path>:<line>" and
 * `what`. */
static void expect_error_bytes(const char *text, size_t len, int line, const char *what)
{
    const char *path = pt_path(dir, "bad.conf");
    FILE *f = fopen(path, "w");
    if (f == NULL || fwrite(text, 1, len, f) != len || fclose(f) != 0)
        pt_die("cannot write", strdup(path));
    ps_config c;
    char *err = NULL;
    int rc = ps_config_load(path, &c, &err);
    char where[600];
    snprintf(where, sizeof where, "%s:%d:", path, line);
    CHECK_MSG(rc == CM_EINVAL, "rc %d for: %s", rc, text);
    CHECK_MSG(err && strstr(err, where) && strstr(err, what), "want '%s' and '%s' in: %s", where,
              what, err ? err : "(none)");
    free(err);
}

/* The same for a text without NULs. */
static void expect_error(const char *text, int line, const char *what)
{
    expect_error_bytes(text, strlen(text), line, what);
}

static void test_errors(void)
{
    expect_error("[cluster]\nshards = 2\nshard = 2\n", 3, "unknown key 'shard'");
    expect_error("[table t]\ndim = 4\nlearning_rate = 1\n", 3, "unknown key 'learning_rate'");
    expect_error("[dense d]\nsize = 4\nmomentum = 1\n", 3, "unknown key 'momentum'");
    /* An unknown key names its section and every key there, and the near one it may stand for:
     * a typo, or a name that starts the other. */
    expect_error("[table t]\ndim = 4\nmemory_budget = 1G\n", 3,
                 "unknown key 'memory_budget' in [table t]: did you mean 'memory'?");
    expect_error("[table t]\ndim = 4\nlr = 1\nopitmizer = sgd\n", 4, "did you mean 'optimizer'?");
    expect_error("[cluster]\nshards = 2\nshard = 2\n", 3,
                 "in [cluster]: did you mean 'shards'? (keys: shards, workers, staleness, "
                 "max_message, worker_timeout, worker_lost, replica_timeout, spill_dir, tls_cert, "
                 "tls_key, tls_ca)");
    expect_error("[dense d]\nsize = 4\nmomentum = 1\n", 3,
                 "unknown key 'momentum' in [dense d] (keys: size, lr, beta1, beta2, eps, "
                 "optimizer)");
    expect_error("[table t]\ndim = 4\nttl_steps = 9\n", 3, "did you mean 'ttl'?");
    expect_error("[table t]\ndim = 4\nxyz = 9\n", 3, "unknown key 'xyz' in [table t] (keys: dim,");
    expect_error("[tables t]\n", 1, "unknown section [tables t] (cluster, table NAME, dense NAME)");
    expect_error("dim = 4\n", 1, "key 'dim' before any section header");
    expect_error("[cluster]\nshards = two\n", 2, "bad value 'two' for shards");
    expect_error("[cluster]\nshards = -1\n", 2, "bad value");
    expect_error("[cluster]\nworkers = 5000000000\n", 2, "bad value");
    expect_error("[cluster]\nmax_message = 10Q\n", 2, "bad value");
    expect_error("[cluster]\nstaleness = 1.5\n", 2, "bad value");
    /* An empty path is no path: spill_dir = "" spilled to /shard-<s>/<name> at the root (and
     * removed it when the server stopped), where an absent spill_dir means /tmp/ember-spill. */
    expect_error("[cluster]\nspill_dir =\n", 2, "bad value '' for spill_dir");
    expect_error("[cluster]\nspill_dir = # where?\n", 2, "bad value '' for spill_dir");
    expect_error("[cluster]\ntls_ca = \n", 2, "bad value '' for tls_ca");
    expect_error("\n[table t]\ndim = 4\noptimizer = rmsprop\n", 4, "bad value 'rmsprop'");
    expect_error("[table t]\ndim = 4\nlr = fast\n", 3, "bad value 'fast' for lr");
    expect_error("[table t]\ndim = 4\nlr = inf\n", 3, "bad value");
    /* Finite as a double, infinite as the float it is stored in. */
    expect_error("[dense d]\nsize = 4\nlr = 1e39\n", 3, "bad value '1e39' for lr");
    expect_error("[table t]\ndim = 4\nbeta2 = -1e39\n", 3, "bad value '-1e39' for beta2");
    expect_error("[table t]\ndim = 4\npush_codec = fp8\n", 3, "bad value 'fp8'");
    expect_error("[dense d]\nsize = 4\noptimizer = adamw\n", 3, "bad value 'adamw'");
    expect_error("[cluster]\n[clusters]\n", 2, "unknown section [clusters]");
    expect_error("[cluster]\n[table]\n", 2, "unknown section");
    expect_error("[cluster]\n[cluster x]\n", 2, "unknown section");
    expect_error("[cluster\n", 1, "malformed section");
    expect_error("[cluster]\nshards\n", 2, "expected key = value");
    expect_error("[table t]\ndim = 4\n[table t]\ndim = 4\n", 3, "duplicate table 't'");
    /* A key given twice is refused, not decided by its last value. */
    expect_error("[cluster]\nshards = 2\nworkers = 1\nshards = 3\n", 4,
                 "duplicate key 'shards' in [cluster] (first on line 2)");
    expect_error("[table t]\ndim = 4\nlr = 0.1\n[cluster]\n[table u]\ndim = 4\n[table t]\n", 7,
                 "duplicate table 't'");
    expect_error("[dense d]\nsize = 4\nlr = 0.1\n  lr=0.2\n", 4, "duplicate key 'lr' in [dense d]");
    /* A table without dim: the error points at the table's section line. */
    expect_error("[cluster]\nshards = 2\n[table nodim]\nlr = 0.1\n[table ok]\ndim = 4\n", 3,
                 "nodim");
    expect_error("[table a]\ndim = 4\n\n[table last]\nlr = 0.1\n", 4, "'last'");
    /* Found after a byte order mark too (the line was 0: the search took the mark for text). */
    expect_error("\xef\xbb\xbf[table t]\nlr = 0.1\n", 1, "table 't' has no dim");
    /* A NUL byte is no text: it was "line too long" for a short line, and in a last line without
     * a newline it silently cut the value short (tls_ca = /ca.pem). */
    static const char nul_mid[] = "[cluster]\nshards = 2\0junk\nworkers = 1\n";
    expect_error_bytes(nul_mid, sizeof nul_mid - 1, 2, "NUL byte");
    static const char nul_end[] = "[cluster]\ntls_ca = /ca.pem\0/other.pem";
    expect_error_bytes(nul_end, sizeof nul_end - 1, 2, "NUL byte");
    /* Likewise a dense block without size (it said "size 0 out of range", naming no line). */
    expect_error("[dense ok]\nsize = 4\n[dense nosize]\nlr = 0.1\n", 3,
                 "dense 'nosize' has no size");

    /* Range checks after parsing name the file. */
    const char *path = pt_path(dir, "bad.conf");
    pt_write(path, "[cluster]\nshards = 0\n");
    ps_config c;
    char *err = NULL;
    CHECK(ps_config_load(path, &c, &err) == CM_EINVAL);
    CHECK_MSG(err && strstr(err, path) && strstr(err, "shards"), "%s", err ? err : "");
    free(err), err = NULL;
    /* replica_timeout becomes nng's int32 milliseconds, where -1 means "wait forever": 2^32-1
     * turned the timeout off instead of making it long, and 0 gave the backup no time at all. */
    const char *bad_timeouts[] = {"0", "2147483648", "4294967295"},
               *tpath = pt_path(dir, "timeout.conf");
    for (size_t i = 0; i < sizeof bad_timeouts / sizeof bad_timeouts[0]; i++) {
        char text[64];
        snprintf(text, sizeof text, "[cluster]\nreplica_timeout = %s\n", bad_timeouts[i]);
        pt_write(tpath, text);
        CHECK_MSG(ps_config_load(tpath, &c, &err) == CM_EINVAL && err &&
                      strstr(err, "replica_timeout") && strstr(err, bad_timeouts[i]),
                  "replica_timeout %s: %s", bad_timeouts[i], err ? err : "(accepted)");
        free(err), err = NULL;
    }
    pt_write(tpath, "[cluster]\nreplica_timeout = 2147483647\n");
    CHECK_MSG(ps_config_load(tpath, &c, &err) == CM_OK, "%s", err ? err : "");
    free(err), err = NULL;
    /* Names become file names (a spill database the server deletes when it stops): a path,
     * "..", or a hidden name is refused, naming the table. */
    const char *bad_names[] = {"..", "../x", "a/b", ".hidden", "sp ace"};
    path = pt_path(dir, "names.conf");
    for (size_t i = 0; i < sizeof bad_names / sizeof bad_names[0]; i++) {
        char text[128];
        snprintf(text, sizeof text, "[table %s]\ndim = 4\n", bad_names[i]);
        pt_write(path, text);
        CHECK_MSG(ps_config_load(path, &c, &err) == CM_EINVAL, "name '%s' accepted", bad_names[i]);
        CHECK_MSG(err && strstr(err, path) && strstr(err, bad_names[i]), "%s", err ? err : "");
        free(err), err = NULL;
    }
    pt_write(path, "[dense ..]\nsize = 4\n");
    CHECK(ps_config_load(path, &c, &err) == CM_EINVAL && err && strstr(err, "dense name"));
    free(err), err = NULL;
    pt_write(path, "[table user_2.a-b]\ndim = 4\n");
    CHECK(ps_config_load(path, &c, &err) == CM_OK);
    free(err), err = NULL;
    /* A reservation no machine holds is refused: this one's 64 sub-shards of 3.75e14 slots of
     * 49177 bytes wrapped around 2^64 to 33713 bytes, and the server's table creation wrote
     * past them (a wild memset) where it should have said "out of memory". */
    pt_write(path, "[table t]\ndim = 4096\noptimizer = adam\nreserve_rows = 19205585507227566\n");
    CHECK_MSG(ps_config_load(path, &c, &err) == CM_EINVAL && err && strstr(err, "table 't'") &&
                  strstr(err, "reserve_rows"),
              "%s", err ? err : "(accepted)");
    free(err), err = NULL;
    pt_write(path, "[table t]\ndim = 8\nreserve_rows = 1G\n");
    CHECK_MSG(ps_config_load(path, &c, &err) == CM_OK, "%s", err ? err : "");
    free(err), err = NULL;
    /* The admission sketch's counters stop at 65535: a larger threshold admitted no key ever,
     * a table that silently never learned (64K is 65536). */
    pt_write(path, "[table t]\ndim = 4\nadmit = 64K\n");
    CHECK_MSG(ps_config_load(path, &c, &err) == CM_EINVAL && err && strstr(err, "table 't'") &&
                  strstr(err, "admit 65536"),
              "%s", err ? err : "(accepted)");
    free(err), err = NULL;
    pt_write(path, "[table t]\ndim = 4\nadmit = 65535\n");
    CHECK_MSG(ps_config_load(path, &c, &err) == CM_OK, "%s", err ? err : "");
    free(err), err = NULL;
    /* A dense block whose whole state (Adam: values and two slots, 12 bytes a float, plus the
     * step and the 56-byte header) would not pass max_message is refused up front. */
    pt_write(path, "[cluster]\nmax_message = 4096\n[dense big]\nsize = 400\n");
    CHECK(ps_config_load(path, &c, &err) == CM_EINVAL && err && strstr(err, "'big'") &&
          strstr(err, "max_message 4096"));
    free(err), err = NULL;
    pt_write(path, "[cluster]\nmax_message = 4096\n[dense fits]\nsize = 330\n");
    CHECK_MSG(ps_config_load(path, &c, &err) == CM_OK, "%s", err ? err : "");
    free(err), err = NULL;
    path = pt_path(dir, "bad.conf");
    CHECK(ps_config_load(pt_path(dir, "missing.conf"), &c, &err) == CM_ENOTFOUND);
    CHECK(err && strstr(err, "missing.conf"));
    free(err);
}

/* `ember ps --plan` prints a line per table and exits 0; a bad config exits non-zero. */
static void test_plan_cli(void)
{
    const char *bin = getenv("EMBER_BIN");
    CHECK_MSG(bin != NULL, "EMBER_BIN not set");
    if (bin == NULL) return;
    pt_write(pt_path(dir, "plan.conf"), "[table user]\ndim = 16\nmemory = 1M\n");
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s' ps --config '%s' --plan 1000000 > '%s'", bin,
             pt_path(dir, "plan.conf"), pt_path(dir, "plan.out"));
    CHECK(system(cmd) == 0);
    FILE *f = fopen(pt_path(dir, "plan.out"), "r");
    char line[512];
    int rows = 0;
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "user", 4) == 0) rows++;
    if (f) fclose(f);
    CHECK(rows == 1);
    snprintf(cmd, sizeof cmd, "'%s' ps --config '%s' --plan 10 2>/dev/null", bin,
             pt_path(dir, "bad.conf"));
    int st = system(cmd);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 2);
    /* Numbers out of range are refused, not cast: a shard of 2^32 is not shard 0, and a
     * negative --plan does not start a server. */
    const char *bad_args[] = {"--plan -1", "--plan -7", "--shard 4294967296", "--shard -1",
                              "--shards 100000",
                              /* not clamped to the largest long: no plan for 2^63 - 1 rows */
                              "--plan 99999999999999999999", "--shard 99999999999999999999",
                              /* not "keep the config's count" */
                              "--shards 0",
                              /* junk and empty values name the flag too */
                              "--plan 12abc", "--contexts ''"};
    for (size_t i = 0; i < sizeof bad_args / sizeof bad_args[0]; i++) {
        snprintf(cmd, sizeof cmd, "timeout 10 '%s' ps --config '%s' %s 2>'%s'", bin,
                 pt_path(dir, "plan.conf"), bad_args[i], pt_path(dir, "range.err"));
        st = system(cmd);
        CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 2, "'%s' gave status %d", bad_args[i], st);
        /* The message names the flag given, and no other. */
        char flag[16], *msg = NULL;
        size_t len = 0;
        sscanf(bad_args[i], "%15s", flag);
        CHECK(cm_read_file(pt_path(dir, "range.err"), (void **)&msg, &len, NULL) == CM_OK);
        bool junk = strstr(bad_args[i], "abc") || strstr(bad_args[i], "''");
        CHECK_MSG(msg && strstr(msg, flag) && strstr(msg, junk ? "bad number" : "out of range") &&
                      (junk || !strstr(msg, "--contexts")),
                  "'%s': %s", bad_args[i], msg ? msg : "(no message)");
        free(msg);
    }
    /* A missing --config and conflicting flags are named, not left to the usage text. */
    const char *usage_errors[][2] = {
        {"--plan 10", "--config is required"},
        {"--config plan.conf --backup --replica ipc:///nowhere --plan 1",
         "--backup and --replica exclude each other"},
        {"--config plan.conf --plan 1 stray", "unexpected argument"}};
    for (size_t i = 0; i < sizeof usage_errors / sizeof usage_errors[0]; i++) {
        snprintf(cmd, sizeof cmd, "cd '%s' && timeout 10 '%s' ps %s 2>'%s'", dir, bin,
                 usage_errors[i][0], pt_path(dir, "usage.err"));
        st = system(cmd);
        char *msg = NULL;
        size_t len = 0;
        CHECK(cm_read_file(pt_path(dir, "usage.err"), (void **)&msg, &len, NULL) == CM_OK);
        CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 2 && msg && strstr(msg, usage_errors[i][1]),
                  "'%s': status %d, %s", usage_errors[i][0], st, msg ? msg : "(no message)");
        free(msg);
    }
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    dir = check_tmpdir("ps_config");
    test_good();
    test_errors();
    test_plan_cli();
    return pt_finish(dir);
}
