/* Helpers shared by the PS tests: configs, URLs, clusters of `ember ps` processes or
 * in-process servers, and clients. Setup failures exit(2) (a failed test) after cleanup. */
#ifndef EMBER_TESTS_PS_TEST_UTIL_H
#define EMBER_TESTS_PS_TEST_UTIL_H

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "ps/ps.h"
#include "ps_proc.h"

/* Every PS test runs under this bound (ctest's TIMEOUT is the outer one). */
#define PT_WATCHDOG_S 55u

static inline void pt_die(const char *what, char *err)
{
    fprintf(stderr, "setup failed: %s: %s\n", what, err ? err : "?");
    free(err);
    psp_stop_all();
    exit(2);
}

/* a + "/" + b in one of 16 rotating static buffers (so calls can nest). */
static inline const char *pt_path(const char *a, const char *b)
{
    static char buf[16][512];
    static int k;
    char *s = buf[k++ % 16];
    if ((size_t)snprintf(s, sizeof buf[0], "%s/%s", a, b) >= sizeof buf[0])
        pt_die("path too long", NULL);
    return s;
}

static inline void pt_write(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (f == NULL || fputs(text, f) < 0 || fclose(f) != 0) pt_die("cannot write", strdup(path));
}

/* Writes text to dir/name and loads it into *cfg; returns the path. */
static inline const char *pt_config(const char *dir, const char *name, const char *text,
                                    ps_config *cfg)
{
    const char *path = pt_path(dir, name);
    pt_write(path, text);
    char *err = NULL;
    if (ps_config_load(path, cfg, &err) != CM_OK) pt_die("config", err);
    return path;
}

/* "ipc://dir/name" in a rotating static buffer. */
static inline const char *pt_ipc(const char *dir, const char *name)
{
    static char buf[16][512];
    static int k;
    char *s = buf[k++ % 16];
    snprintf(s, sizeof buf[0], "ipc://%s", pt_path(dir, name));
    return s;
}

static inline uint16_t pt_free_port(void)
{
    uint16_t port = psp_free_port();
    if (port == 0) pt_die("cannot find a free port", NULL);
    return port;
}

/* Starts shards 0..n-1 of config as `ember ps` processes ($EMBER_BIN) and waits for each to
 * listen; pids[] gets their ids. */
static inline void pt_spawn_cluster(const char *config, uint32_t n, const char *const *urls,
                                    pid_t *pids)
{
    const char *bin = getenv("EMBER_BIN");
    for (uint32_t i = 0; i < n; i++) {
        pids[i] = psp_spawn(bin, config, i, urls[i], NULL);
        if (pids[i] < 0) pt_die("spawn ember ps", NULL);
    }
    for (uint32_t i = 0; i < n; i++)
        if (psp_wait_ready(pids[i], urls[i], 20.0) != 0)
            pt_die("ember ps did not come up", strdup(urls[i]));
}

/* An in-process server with these options, or the test dies. */
static inline ps_server *pt_server_with(const ps_server_opts *o)
{
    ps_server *s = NULL;
    char *err = NULL;
    if (ps_server_create(o, &s, &err) != CM_OK) pt_die("ps_server_create", err);
    return s;
}

/* An in-process server for shard s. */
static inline ps_server *pt_server(const ps_config *cfg, const char *url, uint32_t shard)
{
    ps_server_opts o = {.cfg = cfg, .listen = url, .shard = shard};
    return pt_server_with(&o);
}

/* Shard 0 of a replicated pair: a primary whose backup listens on replica, or the backup. */
static inline ps_server *pt_server_repl(const ps_config *cfg, const char *url, const char *replica,
                                        bool backup)
{
    ps_server_opts o = {
        .cfg = cfg, .listen = url, .shard = 0, .replica_url = replica, .backup = backup};
    return pt_server_with(&o);
}

/* A client with these options, or the test dies. */
static inline ps_client *pt_client_with(const ps_client_opts *o)
{
    ps_client *c = NULL;
    char *err = NULL;
    if (ps_client_create(o, &c, &err) != CM_OK) pt_die("ps_client_create", err);
    return c;
}

static inline ps_client *pt_client(const ps_config *cfg, const char *const *urls, uint32_t worker,
                                   uint32_t timeout_ms)
{
    ps_client_opts o = {.cfg = cfg, .urls = urls, .worker = worker, .timeout_ms = timeout_ms};
    return pt_client_with(&o);
}

/* Fills out[0..n) with the smallest keys >= from that belong to shard of n_shards. */
static inline void pt_keys_of_shard(uint32_t shard, uint32_t n_shards, uint64_t from, uint64_t *out,
                                    size_t n)
{
    for (uint64_t k = from; n > 0; k++)
        if (ps_key_shard(k, n_shards) == shard) {
            *out++ = k;
            n--;
        }
}

/* Ends a test: kills leftover children, removes its directory (ipc sockets included), and
 * returns check_done()'s verdict. */
/* Sets the key of record `rec` of shard-0's snapshot of table to key, every checksum made to
 * match (a consistent lie), runs check on the checkpoint, then puts the files back. */
static inline void pt_with_key_lie(const char *ckpt, const char *table, size_t rec, uint64_t key,
                                   void (*check)(const char *ckpt, const char *what),
                                   const char *what)
{
    char rows[1024], mfp[1024];
    snprintf(rows, sizeof rows, "%s/shard-0/table-%s/rows.bin", ckpt, table);
    snprintf(mfp, sizeof mfp, "%s/shard-0/table-%s/MANIFEST", ckpt, table);
    uint8_t *b = NULL, *keep = NULL;
    char *mf = NULL, *err = NULL;
    size_t len = 0, mlen = 0, body = 0;
    CHECK_OK(cm_read_file(rows, (void **)&b, &len, &err), err);
    CHECK_OK(cm_read_file(rows, (void **)&keep, &len, &err), err);
    CHECK_OK(cm_read_file(mfp, (void **)&mf, &mlen, &err), err);
    CHECK(len > 32 + (rec + 1) * 40 + 8 && mf &&
          cm_seal_check(mf, mlen, "checksum", &body) == CM_OK);
    uint32_t rb;
    memcpy(&rb, b + 20, 4);
    memcpy(b + 32 + rec * rb, &key, 8);
    uint64_t h = cm_xxh3(b, len - 8);
    memcpy(b + len - 8, &h, 8);
    CHECK_OK(cm_write_file_atomic(rows, b, len, &err), err);
    char out[4096];
    const char *file = strstr(mf, "\nfile rows.bin ");
    CHECK(file != NULL);
    size_t at = (size_t)(file - mf) + 1, end = at + strcspn(mf + at, "\n") + 1;
    int n = snprintf(out, sizeof out, "%.*sfile rows.bin %zu %016" PRIx64 "\n%.*s", (int)at, mf,
                     len, h, (int)(body - end), mf + end);
    n = cm_seal_append(out, (size_t)n, sizeof out, "checksum");
    CHECK_OK(cm_write_file_atomic(mfp, out, (size_t)n, &err), err);
    check(ckpt, what);
    CHECK_OK(cm_write_file_atomic(rows, keep, len, &err), err);
    CHECK_OK(cm_write_file_atomic(mfp, mf, mlen, &err), err);
    free(b);
    free(keep);
    free(mf);
}

static inline int pt_finish(const char *dir)
{
    psp_stop_all();
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", dir);
    return check_done();
}

#endif
