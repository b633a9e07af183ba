/*
 * libFuzzer target: any bytes as ember train's cluster file (--cluster: [cluster] ps, backups,
 * workers, tls_*) through train_cluster_load and cm_ini_parse.
 *
 * Properties checked (abort on violation): a refused file gets an error that names the file
 * and leaves nothing allocated (LeakSanitizer sees the rest); a loaded one has 1 to
 * PS_MAX_SHARDS ps URLs, 1 to PS_MAX_WORKERS workers, a backup for every shard or none, and
 * URLs that each name a transport between processes (an ipc path a socket address holds), hold
 * no separator or control character, and name an address of their own (host case aside, port as a
 * number, whichever tcp variant), no unspecified host (0.0.0.0, [::]) and no host past 253
 * bytes; TLS files only beside tls+tcp:// URLs, which need tls_cert and no plain tcp:// beside.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/un.h>

#include "src/train.h"
#include "tests/fuzz_file.h"

/* The address u listens on, in a form two spellings of one address share (an oracle of its
 * own, not the parser's code): "tcp <host lowercased> <port>" or "ipc <path>". */
static void addr_of(const char *u, char *out, size_t n)
{
    const char *sep = strstr(u, "://");
    if (sep == NULL) abort();
    const char *rest = sep + 3;
    if (!strncmp(u, "ipc://", 6)) {
        snprintf(out, n, "ipc %s", rest);
        return;
    }
    const char *colon = strrchr(rest, ':');
    /* A tcp URL must name a host workers can dial, and a port. */
    if (colon == NULL || colon == rest || (colon == rest + 1 && *rest == '*')) abort();
    /* Nor an unspecified address, in the spellings a hand-written file uses. */
    static const char *const any[] = {"0.0.0.0", "[::]", "[0::0]", "[::0]", "[0:0:0:0:0:0:0:0]"};
    for (size_t i = 0; i < sizeof any / sizeof any[0]; i++)
        if ((size_t)(colon - rest) == strlen(any[i]) && !strncmp(rest, any[i], strlen(any[i])))
            abort();
    /* A host DNS can hold. */
    if (colon - rest > 253 + 2) abort();
    char *end;
    unsigned long port = strtoul(colon + 1, &end, 10);
    if (*end != '\0' || port == 0 || port > 65535) abort();
    int len = snprintf(out, n, "tcp %.*s %lu", (int)(colon - rest), rest, port);
    for (int i = 4; i < len && (size_t)i < n; i++)
        out[i] = (char)tolower((unsigned char)out[i]);
}

static void check_url(const char *u)
{
    static const char *const schemes[] = {"tcp://",      "tcp4://",     "tcp6://", "tls+tcp://",
                                          "tls+tcp4://", "tls+tcp6://", "ipc://"};
    int known = 0;
    for (size_t i = 0; i < sizeof schemes / sizeof schemes[0]; i++)
        known |= !strncmp(u, schemes[i], strlen(schemes[i])) && u[strlen(schemes[i])] != '\0';
    if (!known) abort();
    if (!strncmp(u, "ipc://", 6) && strlen(u + 6) >= sizeof((struct sockaddr_un *)0)->sun_path)
        abort();
    for (const char *p = u; *p; p++)
        if ((unsigned char)*p <= 0x20 || *p == 0x7f || *p == ',') abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = fuzz_file(data, size);
    train_cluster c;
    char *err = NULL;
    int rc = train_cluster_load(path, &c, &err);
    if (rc != CM_OK) {
        if (rc > 0 || err == NULL || strstr(err, path) == NULL || c.urls != NULL ||
            c.backups != NULL)
            abort();
        free(err);
        return 0;
    }
    if (c.n_shards == 0 || c.n_shards > PS_MAX_SHARDS || c.n_workers == 0 ||
        c.n_workers > PS_MAX_WORKERS || (c.n_backups != 0 && c.n_backups != c.n_shards) ||
        (c.n_backups == 0) != (c.backups == NULL))
        abort();
    const uint32_t n = c.n_shards + c.n_backups;
    char(*addr)[5000] = malloc(n * sizeof *addr);
    if (addr == NULL) abort();
    for (uint32_t i = 0; i < n; i++) {
        const char *u = i < c.n_shards ? c.urls[i] : c.backups[i - c.n_shards];
        check_url(u);
        addr_of(u, addr[i], sizeof addr[i]);
        for (uint32_t j = 0; j < i; j++)
            if (!strcmp(addr[i], addr[j])) abort();
    }
    free(addr);
    /* TLS files go with tls+tcp:// URLs, and those need a certificate; no plain tcp:// URL
     * beside them. */
    int tls_url = 0, plain_url = 0;
    for (uint32_t i = 0; i < n; i++) {
        const char *u = i < c.n_shards ? c.urls[i] : c.backups[i - c.n_shards];
        tls_url |= !strncmp(u, "tls+", 4);
        plain_url |= !strncmp(u, "tcp", 3);
    }
    if (tls_url && plain_url) abort();
    if (tls_url != (c.tls_cert[0] != '\0') || (!tls_url && (c.tls_key[0] || c.tls_ca[0]))) abort();
    train_cluster_free(&c);
    free(err);
    return 0;
}
