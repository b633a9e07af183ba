/*
 * The HELLO handshake refuses a client whose cluster view differs from the server's (table
 * config, dense block, shard count or index, worker count) with an error naming what differs,
 * at once rather than at the timeout; storage-only settings may differ. A client of a PS that
 * is not there fails within its timeout, naming the URL.
 */
#include "ps_test_util.h"

static const char conf[] = "[cluster]\nshards = 2\nworkers = 2\n"
                           "[table t]\ndim = 4\nlr = 0.1\n"
                           "[dense d]\nsize = 10\n";

/* ps_client_create must fail within max_s with every string of want in the message. */
static void expect_refused(const char *name, const ps_config *cfg, const char *const *urls,
                           uint32_t timeout_ms, double max_s, const char *want1, const char *want2)
{
    ps_client_opts o = {.cfg = cfg, .urls = urls, .worker = 0, .timeout_ms = timeout_ms};
    ps_client *c = NULL;
    char *err = NULL;
    double t0 = psp_now();
    int rc = ps_client_create(&o, &c, &err);
    double dt = psp_now() - t0;
    CHECK_MSG(rc != CM_OK && c == NULL, "%s: accepted", name);
    CHECK_MSG(dt < max_s, "%s: took %.2f s (limit %.2f)", name, dt, max_s);
    CHECK_MSG(err && strstr(err, want1) && (!want2 || strstr(err, want2)),
              "%s: want '%s'%s%s in: %s", name, want1, want2 ? " and " : "", want2 ? want2 : "",
              err ? err : "(none)");
    if (rc == CM_OK) ps_client_destroy(c);
    free(err);
}

static void test_mismatch(const char *dir)
{
    ps_config cfg;
    pt_config(dir, "ps.conf", conf, &cfg);
    const char *urls[2] = {pt_ipc(dir, "s0"), pt_ipc(dir, "s1")};
    ps_server *s0 = pt_server(&cfg, urls[0], 0), *s1 = pt_server(&cfg, urls[1], 1);

    /* The same view, and one differing only in storage settings, are accepted. */
    ps_client *c = pt_client(&cfg, urls, 1, 5000);
    ps_client_destroy(c);
    ps_config v = cfg;
    v.tables[0].cfg.admit_threshold = 4;
    v.tables[0].cfg.ttl_steps = 100;
    c = pt_client(&v, urls, 0, 5000);
    ps_client_destroy(c);

    /* Refusals come back as error replies: well under the 10 s timeout. */
    v = cfg;
    v.tables[0].cfg.lr = 0.2f;
    expect_refused("lr", &v, urls, 10000, 2.0, "table 't' is configured differently", urls[0]);
    v = cfg;
    v.tables[0].pull_codec = PS_CODEC_F16;
    expect_refused("codec", &v, urls, 10000, 2.0, "table 't'", NULL);
    v = cfg;
    v.dense[0].size = 11;
    expect_refused("dense", &v, urls, 10000, 2.0, "dense block 'd'", NULL);
    v = cfg;
    v.n_tables = 2;
    v.tables[1] = cfg.tables[0];
    strcpy(v.tables[1].name, "extra");
    expect_refused("tables", &v, urls, 10000, 2.0, "2 tables", NULL);
    v = cfg;
    v.n_shards = 1;
    expect_refused("shard count", &v, urls, 10000, 2.0, "expects shard 0 of 1", "shard 0 of 2");
    v = cfg;
    v.n_workers = 3;
    expect_refused("workers", &v, urls, 10000, 2.0, "3 workers", NULL);
    const char *swapped[2] = {urls[1], urls[0]};
    expect_refused("shard order", &cfg, swapped, 10000, 2.0, "this is shard 1", NULL);

    ps_server_stats st;
    ps_server_stats_get(s0, &st);
    CHECK(st.errors >= 6 && st.bad_messages == 0); /* a mismatch is not a malformed message */
    ps_server_destroy(s0);
    ps_server_destroy(s1);
}

static void test_unreachable(const char *dir)
{
    ps_config cfg;
    pt_config(dir, "one.conf", "[table t]\ndim = 4\n", &cfg);
    char tcp[64];
    snprintf(tcp, sizeof tcp, "tcp://127.0.0.1:%u", pt_free_port());
    const char *u1[1] = {tcp};
    expect_refused("tcp nobody", &cfg, u1, 300, 3.0, tcp, "is the PS running");
    const char *u2[1] = {pt_ipc(dir, "nobody")};
    expect_refused("ipc nobody", &cfg, u2, 300, 3.0, u2[0], NULL);
    /* A window past what a server remembers of a worker's pushes (1,024 request ids) could
     * have a push resent after a failover applied twice: refused before anything is dialled;
     * 1,024 itself is not. */
    for (uint32_t w = 1024; w <= 1025; w++) {
        ps_client_opts o = {.cfg = &cfg, .urls = u2, .window = w, .timeout_ms = 300};
        ps_client *c = NULL;
        char *err = NULL;
        int rc = ps_client_create(&o, &c, &err);
        CHECK_MSG(rc != CM_OK && err && (strstr(err, "window") != NULL) == (w > 1024),
                  "window %u: %s", w, err ? err : "(accepted)");
        if (rc == CM_OK) ps_client_destroy(c);
        free(err);
    }
    const char *u3[1] = {"bogus://x"};
    expect_refused("bad url", &cfg, u3, 300, 1.0, "bogus://x", NULL);

    /* Shard 0 is up, shard 1 is not: the message names shard 1's URL. */
    ps_config two = cfg;
    two.n_shards = 2;
    const char *urls[2] = {pt_ipc(dir, "up"), pt_ipc(dir, "down")};
    ps_server *s = pt_server(&two, urls[0], 0);
    expect_refused("one down", &two, urls, 300, 3.0, urls[1], NULL);
    ps_server_destroy(s);
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_hello");
    test_mismatch(dir);
    test_unreachable(dir);
    return pt_finish(dir);
}
