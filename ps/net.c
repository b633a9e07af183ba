#include "ps/net.h"

#include <nng/supplemental/tls/tls.h>
#include <stdlib.h>
#include <string.h>

/* Our certificate and key. nng_tls_config_cert_key_file wants both PEM blocks in one file
 * (its third argument is the key's password), so separate files are read and passed as text. */
static int own_cert(nng_tls_config *tls, const ps_config *cfg)
{
    if (!cfg->tls_key[0]) return nng_tls_config_cert_key_file(tls, cfg->tls_cert, NULL);
    void *cert = NULL, *key = NULL;
    size_t n;
    int rv = NNG_ENOENT;
    if (cm_read_file(cfg->tls_cert, &cert, &n, NULL) == CM_OK &&
        cm_read_file(cfg->tls_key, &key, &n, NULL) == CM_OK) /* both NUL-terminated */
        rv = nng_tls_config_own_cert(tls, cert, key, NULL);
    free(cert);
    free(key);
    return rv;
}

static int tls_config(const ps_config *cfg, nng_tls_mode mode, const char *url,
                      nng_tls_config **out, char **errptr)
{
    nng_tls_config *tls = NULL;
    int rv = nng_tls_config_alloc(&tls, mode);
    if (rv != 0) return cm_err(errptr, CM_EIO, "TLS unavailable: %s", nng_strerror(rv));
    const char *what = NULL;
    if (cfg->tls_cert[0] && (rv = own_cert(tls, cfg)) != 0)
        what = cfg->tls_cert;
    else if (cfg->tls_ca[0] && (rv = nng_tls_config_ca_file(tls, cfg->tls_ca)) != 0)
        what = cfg->tls_ca;
    else if ((rv = nng_tls_config_auth_mode(tls, cfg->tls_ca[0] ? NNG_TLS_AUTH_MODE_REQUIRED
                                                                : NNG_TLS_AUTH_MODE_NONE)) != 0)
        what = "auth mode";
    else if (mode == NNG_TLS_MODE_CLIENT && cfg->tls_ca[0]) {
        /* The name the PS certificate must carry: the URL's host (tls+tcp://HOST:PORT), which
         * ps_url_check has bounded; there is no default name to fall back on. */
        char host[PS_URL_HOST_MAX + 1];
        const char *h = strstr(url, "://");
        size_t n = 0;
        if (h != NULL) {
            h += 3;
            n = *h == '[' ? strcspn(++h, "]") : strcspn(h, ":/");
        }
        if (n == 0 || n >= sizeof host)
            rv = NNG_EADDRINVAL;
        else {
            memcpy(host, h, n), host[n] = 0;
            rv = nng_tls_config_server_name(tls, host);
        }
    }
    if (rv != 0) {
        nng_tls_config_free(tls);
        return cm_err(errptr, CM_EIO, "TLS setup failed at %s: %s", what ? what : "server name",
                      nng_strerror(rv));
    }
    *out = tls;
    return CM_OK;
}

static int is_tls(const char *url)
{
    return strncmp(url, "tls+", 4) == 0;
}

/* TLS for an endpoint, from cfg: set on the listener (l != NULL) or the dialer d. */
static int endpoint_tls(const ps_config *cfg, const char *url, nng_listener *l, nng_dialer *d,
                        char **errptr)
{
    if (l && !cfg->tls_cert[0])
        return cm_err(errptr, CM_EINVAL, "%s needs tls_cert and tls_key in [cluster]", url);
    nng_tls_config *tls;
    int rc = tls_config(cfg, l ? NNG_TLS_MODE_SERVER : NNG_TLS_MODE_CLIENT, url, &tls, errptr);
    if (rc != CM_OK) return rc;
    int rv = l ? nng_listener_set_ptr(*l, NNG_OPT_TLS_CONFIG, tls)
               : nng_dialer_set_ptr(*d, NNG_OPT_TLS_CONFIG, tls);
    nng_tls_config_free(tls); /* the endpoint holds its own reference */
    if (rv != 0) return cm_err(errptr, CM_EIO, "cannot set TLS on %s: %s", url, nng_strerror(rv));
    return CM_OK;
}

int ps_url_check(const char *url, size_t len, char **errptr)
{
    static const char *const tcp[] = {"tcp://",     "tcp4://",     "tcp6://",
                                      "tls+tcp://", "tls+tcp4://", "tls+tcp6://"};
    size_t at = 0;
    for (size_t i = 0; at == 0 && i < sizeof tcp / sizeof tcp[0]; i++)
        if (len >= strlen(tcp[i]) && strncmp(url, tcp[i], strlen(tcp[i])) == 0) at = strlen(tcp[i]);
    if (at == 0) return CM_OK;
    size_t colon = len;
    while (colon > at && url[colon - 1] != ':' && url[colon - 1] != ']')
        colon--;
    unsigned long port = 0;
    size_t digits = 0;
    for (size_t i = colon; i < len && digits < 6 && url[i] >= '0' && url[i] <= '9'; i++, digits++)
        port = port * 10 + (unsigned long)(url[i] - '0');
    if (colon <= at + 1 || url[colon - 1] != ':' || colon + digits != len || digits == 0 ||
        port == 0 || port > 65535)
        return cm_err(errptr, CM_EINVAL, "bad URL '%.*s': want %.*sHOST:PORT (port 1..65535)",
                      (int)len, url, (int)at, url);
    size_t host = colon - 1 - at; /* brackets of an IPv6 address included */
    if (host > PS_URL_HOST_MAX + 2 || (url[at] != '[' && host > PS_URL_HOST_MAX))
        return cm_err(errptr, CM_EINVAL, "bad URL '%.60s...': host longer than %d bytes", url,
                      PS_URL_HOST_MAX);
    return CM_OK;
}

int ps_net_listen(nng_socket sock, const char *url, const ps_config *cfg, char **errptr)
{
    nng_listener l;
    int rc = ps_url_check(url, strlen(url), errptr);
    if (rc != CM_OK) return rc;
    int rv = nng_listener_create(&l, sock, url);
    if (rv != 0) return cm_err(errptr, CM_EIO, "cannot listen on %s: %s", url, nng_strerror(rv));
    rc = is_tls(url) ? endpoint_tls(cfg, url, &l, NULL, errptr) : CM_OK;
    if (rc == CM_OK && (rv = nng_listener_start(l, 0)) != 0)
        rc = cm_err(errptr, CM_EIO, "cannot listen on %s: %s", url, nng_strerror(rv));
    if (rc != CM_OK) nng_listener_close(l); /* not left in the socket, half set up */
    return rc;
}

int ps_net_dial(nng_socket sock, const char *url, const ps_config *cfg, nng_dialer *dialer,
                char **errptr)
{
    nng_dialer d;
    int rc = ps_url_check(url, strlen(url), errptr);
    if (rc != CM_OK) return rc;
    int rv = nng_dialer_create(&d, sock, url);
    if (rv != 0) return cm_err(errptr, CM_EIO, "cannot dial %s: %s", url, nng_strerror(rv));
    rc = is_tls(url) ? endpoint_tls(cfg, url, NULL, &d, errptr) : CM_OK;
    /* Non-blocking: the dialer keeps retrying in the background, so a PS that starts later
     * (or restarts) is picked up; requests time out on their own. */
    if (rc == CM_OK && (rv = nng_dialer_start(d, NNG_FLAG_NONBLOCK)) != 0)
        rc = cm_err(errptr, CM_EIO, "cannot dial %s: %s", url, nng_strerror(rv));
    if (rc != CM_OK)
        nng_dialer_close(d); /* a failover dials again: failed dialers would pile up */
    else if (dialer)
        *dialer = d;
    return rc;
}

int ps_msg_new(const ps_hdr *h, size_t payload_len, nng_msg **out, uint8_t **payload)
{
    nng_msg *m;
    if (nng_msg_alloc(&m, PS_HDR_BYTES + payload_len) != 0) return CM_ENOMEM;
    ps_hdr hdr;
    memset(&hdr, 0, sizeof hdr);
    if (h != NULL) {
        hdr.op = h->op;
        hdr.table = h->table;
        hdr.count = h->count;
        hdr.codec = h->codec;
        hdr.worker = h->worker;
        hdr.clock = h->clock;
        hdr.req_id = h->req_id;
        hdr.flags = h->flags;
    }
    memcpy(nng_msg_body(m), &hdr, sizeof hdr);
    *out = m;
    *payload = (uint8_t *)nng_msg_body(m) + PS_HDR_BYTES;
    return CM_OK;
}

void ps_msg_seal(nng_msg *m)
{
    ps_wire_seal(nng_msg_body(m), nng_msg_len(m) - PS_HDR_BYTES);
}

int ps_msg_rows(const ps_hdr *h, const uint64_t *keys, size_t n, const uint8_t *rows,
                size_t row_bytes, nng_msg **out)
{
    const bool push = h->op == PS_OP_PUSH;
    const size_t head = push ? 4 : 0, vals = push ? n * row_bytes : 0;
    nng_msg *m;
    uint8_t *p;
    /* Sized for the worst case (10 bytes a key), then trimmed to what the keys took. */
    if (ps_msg_new(h, head + PS_VARINT_MAX * n + vals, &m, &p) != CM_OK) return CM_ENOMEM;
    uint32_t kb = (uint32_t)ps_keys_encode(keys, n, p + head);
    if (push) {
        memcpy(p, &kb, 4);
        memcpy(p + head + kb, rows, vals);
    }
    nng_msg_realloc(m, PS_HDR_BYTES + head + kb + vals);
    *out = m;
    return CM_OK;
}

nng_msg *ps_aio_msg_take(nng_aio *aio)
{
    nng_msg *m = nng_aio_get_msg(aio);
    nng_aio_set_msg(aio, NULL);
    return m;
}

void ps_aio_free_stopped(nng_aio *aio)
{
    if (aio == NULL) return;
    nng_msg *m = ps_aio_msg_take(aio);
    if (m) nng_msg_free(m);
    nng_aio_free(aio);
}
