/*
 * TLS: a CA and a localhost certificate made at test time with the openssl CLI; a server on
 * tls+tcp://127.0.0.1 with [cluster] tls_cert/tls_key/tls_ca serves a pull and a push. A
 * client that trusts a different CA is refused within its timeout (verification is on).
 */
#include "ps_test_util.h"

static int sh(const char *dir, const char *cmd)
{
    char full[4096];
    snprintf(full, sizeof full, "cd '%s' && (%s) >openssl.log 2>&1", dir, cmd);
    int rc = system(full);
    if (rc != 0) fprintf(stderr, "failed: %s (see %s/openssl.log)\n", cmd, dir);
    return rc;
}

/* ca.pem + srv.pem/srv.key (CN and SAN localhost, 127.0.0.1), and other-ca.pem. EC keys:
 * fast to make and to handshake. */
static int make_certs(const char *dir)
{
    if (system("command -v openssl >/dev/null 2>&1") != 0) {
        fprintf(stderr, "openssl CLI not found: apt-get install openssl (add it to setup.sh)\n");
        return -1;
    }
    const char *ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    char cmd[1024];
    pt_write(pt_path(dir, "ext.cnf"), "subjectAltName=DNS:localhost,IP:127.0.0.1,DNS:127.0.0.1\n"
                                      "extendedKeyUsage=serverAuth,clientAuth\n");
    snprintf(cmd, sizeof cmd,
             "openssl req -x509 %s -keyout ca.key -out ca.pem -days 2 -subj /CN=ember-test-ca", ec);
    if (sh(dir, cmd)) return -1;
    snprintf(cmd, sizeof cmd,
             "openssl req -x509 %s -keyout other.key -out other-ca.pem -days 2 -subj /CN=other-ca",
             ec);
    if (sh(dir, cmd)) return -1;
    snprintf(cmd, sizeof cmd, "openssl req %s -keyout srv.key -out srv.csr -subj /CN=localhost",
             ec);
    if (sh(dir, cmd)) return -1;
    return sh(dir, "openssl x509 -req -in srv.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
                   "-out srv.pem -days 2 -extfile ext.cnf");
}

static void tls_config(const char *dir, const char *ca, ps_config *cfg, const char *name)
{
    char text[4096];
    snprintf(text, sizeof text,
             "[cluster]\ntls_cert = %s/srv.pem\ntls_key = %s/srv.key\ntls_ca = %s/%s\n"
             "[table t]\ndim = 4\noptimizer = sgd\nlr = 1\ninit_scale = 0\n",
             dir, dir, dir, ca);
    pt_config(dir, name, text, cfg);
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_tls");
    int certs = make_certs(dir);
    CHECK_MSG(certs == 0, "cannot make test certificates");
    if (certs != 0) return pt_finish(dir);
    ps_config cfg, other;
    tls_config(dir, "ca.pem", &cfg, "ps.conf");
    tls_config(dir, "other-ca.pem", &other, "other.conf");

    /* A free port can be taken by someone else before we listen: try a few. */
    char url[64];
    ps_server *s = NULL;
    char *err = NULL;
    for (int i = 0; i < 5 && s == NULL; i++) {
        snprintf(url, sizeof url, "tls+tcp://127.0.0.1:%u", pt_free_port());
        ps_server_opts o = {.cfg = &cfg, .listen = url, .shard = 0};
        free(err), err = NULL;
        if (ps_server_create(&o, &s, &err) != CM_OK) s = NULL;
    }
    CHECK_MSG(s != NULL, "TLS server: %s", err ? err : "?");
    free(err), err = NULL;
    if (s == NULL) return pt_finish(dir);
    const char *urls[1] = {url};
    ps_client *c = pt_client(&cfg, urls, 0, 10000);
    uint64_t keys[3] = {1, 2, 3};
    float g[12], out[12];
    for (int i = 0; i < 12; i++)
        g[i] = (float)i;
    CHECK_OK(ps_client_push(c, 0, keys, 3, g, &err), err);
    CHECK_OK(ps_client_pull(c, 0, keys, 3, out, &err), err);
    for (int i = 0; i < 12; i++)
        CHECK(out[i] == -g[i]);
    ps_client_destroy(c);

    /* The wrong CA: the handshake fails, so HELLO times out (short timeout). */
    ps_client_opts o = {.cfg = &other, .urls = urls, .timeout_ms = 500};
    c = NULL;
    double t0 = psp_now();
    CHECK(ps_client_create(&o, &c, &err) != CM_OK && c == NULL);
    CHECK(psp_now() - t0 < 5.0);
    CHECK_MSG(err && strstr(err, url), "%s", err ? err : "(none)");
    free(err), err = NULL;
    ps_client_destroy(c);
    /* Plain tcp to a TLS listener gets nowhere either. */
    char plain[64];
    snprintf(plain, sizeof plain, "%s", url + 4);
    const char *purls[1] = {plain};
    ps_client_opts po = {.cfg = &cfg, .urls = purls, .timeout_ms = 500};
    c = NULL;
    CHECK(ps_client_create(&po, &c, &err) != CM_OK);
    free(err);
    ps_client_destroy(c);

    /* A host name longer than DNS allows is refused by name, not verified against another
     * name: the certificate check must never fall back to a default host. */
    char longurl[400];
    int at = snprintf(longurl, sizeof longurl, "tls+tcp://");
    memset(longurl + at, 'a', 300);
    snprintf(longurl + at + 300, sizeof longurl - (size_t)at - 300, ":7400");
    const char *lurls[1] = {longurl};
    ps_client_opts lo = {.cfg = &cfg, .urls = lurls, .timeout_ms = 500};
    c = NULL;
    err = NULL;
    CHECK(ps_client_create(&lo, &c, &err) != CM_OK && c == NULL);
    CHECK_MSG(err && strstr(err, "253"), "%s", err ? err : "(none)");
    free(err), err = NULL;
    CHECK(ps_url_check("tcp://[::1]:7400", 16, &err) == CM_OK);
    free(err), err = NULL;

    ps_server_stats st;
    ps_server_stats_get(s, &st);
    CHECK(st.rows_pushed == 3 && st.rows_pulled == 3);
    ps_server_destroy(s);
    return pt_finish(dir);
}
