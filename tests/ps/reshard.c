/*
 * Offline resharding keeps admission state (ps_checkpoint_reshard): with admit = 3, keys
 * pulled twice on 2 in-process shards are saved, the checkpoint is resharded 2 -> 1 and then
 * 1 -> 2, and after each LOAD one more pull admits them (the rows a LOAD of the original gives),
 * while keys pulled once stay held back, as without resharding. The 1-shard sketch is the one a
 * 1-shard cluster that saw the same pulls saves, byte for byte (count-min sketches add). Old
 * shards' sketches of different sizes are refused, naming the file, and nothing is written.
 */
#include <inttypes.h>
#include <sys/stat.h>

#include "ps_test_util.h"

#define K 64u
#define DIM 4u

static const char conf_fmt[] = "[cluster]\nshards = %u\nworkers = 1\n"
                               "[table t]\ndim = 4\noptimizer = sgd\nlr = 0.1\ninit_scale = 0.05\n"
                               "admit = 3\n";

typedef struct cluster {
    ps_config cfg;
    ps_server *srv[2];
    ps_client *c;
    uint32_t n;
} cluster;

static void cluster_start(cluster *cl, const char *dir, uint32_t n)
{
    char name[32], text[512];
    snprintf(name, sizeof name, "ps%u.conf", n);
    snprintf(text, sizeof text, conf_fmt, n);
    pt_config(dir, name, text, &cl->cfg);
    /* Fresh socket names per cluster: a stopped server's socket file may linger. */
    static int gen;
    const char *urls[2];
    for (uint32_t i = 0; i < n; i++) {
        snprintf(name, sizeof name, "g%d-s%u", gen, i);
        urls[i] = pt_ipc(dir, name);
        cl->srv[i] = pt_server(&cl->cfg, urls[i], i);
    }
    gen++;
    cl->n = n;
    cl->c = pt_client(&cl->cfg, urls, 0, 10000);
}

static void cluster_stop(cluster *cl)
{
    ps_client_destroy(cl->c);
    for (uint32_t i = 0; i < cl->n; i++)
        ps_server_destroy(cl->srv[i]);
}

static void pull(cluster *cl, const uint64_t *keys, float *out)
{
    char *err = NULL;
    CHECK_OK(ps_client_pull(cl->c, 0, keys, K, out, &err), err);
}

/* Keys of keys[] whose pulled row is not all zeros (admitted; init_scale makes a row nonzero). */
static unsigned admitted(const float *rows)
{
    unsigned n = 0;
    for (uint32_t i = 0; i < K; i++) {
        int any = 0;
        for (uint32_t j = 0; j < DIM; j++)
            any |= rows[i * DIM + j] != 0.0f;
        n += (unsigned)any;
    }
    return n;
}

/* Loads ckpt into a fresh n-shard cluster and pulls `twice` and `once` one more time each:
 * every key of `twice` must be admitted with the rows `want`, none of `once`. */
static void check_after(const char *dir, const char *ckpt, uint32_t n, const uint64_t *twice,
                        const uint64_t *once, const float *want, const char *what)
{
    cluster cl;
    cluster_start(&cl, dir, n);
    char *err = NULL;
    CHECK_OK(ps_client_load(cl.c, ckpt, &err), err);
    float got[K * DIM];
    pull(&cl, twice, got);
    CHECK_MSG(admitted(got) == K,
              "%s: %u of %u keys seen twice before were admitted by a third "
              "sighting (admit = 3)",
              what, admitted(got), K);
    if (want) CHECK_MSG(memcmp(got, want, sizeof got) == 0, "%s: admitted rows differ", what);
    pull(&cl, once, got);
    CHECK_MSG(admitted(got) == 0, "%s: %u keys seen once before were admitted by a second sighting",
              what, admitted(got));
    cluster_stop(&cl);
}

/* Whole file into a heap buffer (the test dies without it). */
static void *slurp(const char *path, size_t *len)
{
    void *buf = NULL;
    char *err = NULL;
    if (cm_read_file(path, &buf, len, &err) != CM_OK) pt_die("read", err);
    return buf;
}

static void put(const char *path, const void *buf, size_t len)
{
    char *err = NULL;
    if (cm_write_file_atomic(path, buf, len, &err) != CM_OK) pt_die("write", err);
}

/* Halves the sketch of ckpt/shard-1/table-t, its MANIFEST rewritten to match (a consistent
 * snapshot whose sketch has other dimensions). */
static void halve_sketch(const char *ckpt)
{
    char snap[1024], p[1100];
    snprintf(snap, sizeof snap, "%s/shard-1/table-t", ckpt);
    snprintf(p, sizeof p, "%s/sketch.bin", snap);
    size_t len = 0, mlen = 0;
    void *sk = slurp(p, &len);
    put(p, sk, len / 2);
    snprintf(p, sizeof p, "%s/MANIFEST", snap);
    char *m = slurp(p, &mlen), *line = strstr(m, "\nsketch "), *sum = strstr(m, "\nchecksum ");
    if (line == NULL || sum == NULL || line > sum) pt_die("no sketch line in", strdup(p));
    const char *ls = line + 1, *le = strchr(ls, '\n') + 1, *cs = sum + 1;
    char out[4096];
    int n = snprintf(out, sizeof out, "%.*ssketch sketch.bin %zu %016" PRIx64 "\n%.*s",
                     (int)(ls - m), m, len / 2, cm_xxh3(sk, len / 2), (int)(cs - le), le);
    n += snprintf(out + n, sizeof out - (size_t)n, "checksum %016" PRIx64 "\n",
                  cm_xxh3(out, (size_t)n));
    put(p, out, (size_t)n);
    free(m);
    free(sk);
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_reshard");
    uint64_t twice[K], once[K];
    for (uint32_t i = 0; i < K; i++) {
        twice[i] = 1000 + (uint64_t)i * 7919; /* both shards */
        once[i] = 500000 + (uint64_t)i * 7919;
    }
    /* Own copies: pt_path's buffers rotate. */
    char c2[600], c1[600], c2b[600], ref1[600], bad[600], badout[600];
    snprintf(c2, sizeof c2, "%s/c2", dir);
    snprintf(c1, sizeof c1, "%s/c1", dir);
    snprintf(c2b, sizeof c2b, "%s/c2b", dir);
    snprintf(ref1, sizeof ref1, "%s/ref1", dir);
    snprintf(bad, sizeof bad, "%s/bad", dir);
    snprintf(badout, sizeof badout, "%s/badout", dir);
    char *err = NULL;
    float rows[K * DIM];

    /* The same sightings on 2 shards and on 1, each saved. */
    for (uint32_t n = 2; n >= 1; n--) {
        cluster cl;
        cluster_start(&cl, dir, n);
        pull(&cl, twice, rows);
        pull(&cl, twice, rows);
        pull(&cl, once, rows);
        CHECK_MSG(admitted(rows) == 0, "a key seen once was admitted (admit = 3)");
        CHECK_OK(ps_client_save(cl.c, n == 2 ? c2 : ref1, &err), err);
        cluster_stop(&cl);
    }

    /* Without resharding: the third sighting admits; these rows are the reference. */
    float want[K * DIM];
    {
        cluster cl;
        cluster_start(&cl, dir, 2);
        CHECK_OK(ps_client_load(cl.c, c2, &err), err);
        pull(&cl, twice, want);
        CHECK_MSG(admitted(want) == K, "without resharding: %u of %u admitted", admitted(want), K);
        cluster_stop(&cl);
    }
    check_after(dir, c2, 2, twice, once, want, "no reshard");

    CHECK_OK(ps_checkpoint_reshard(c2, c1, 1, 0, &err), err);
    check_after(dir, c1, 1, twice, once, want, "reshard 2 -> 1");
    CHECK_OK(ps_checkpoint_reshard(c1, c2b, 2, 0, &err), err);
    check_after(dir, c2b, 2, twice, once, want, "reshard 2 -> 1 -> 2");

    /* Two shards' sketches summed are the sketch one shard that counted every key keeps. */
    size_t la = 0, lb = 0;
    void *a = NULL, *b = NULL;
    int ra = cm_read_file(pt_path(c1, "shard-0/table-t/sketch.bin"), &a, &la, NULL);
    int rb = cm_read_file(pt_path(ref1, "shard-0/table-t/sketch.bin"), &b, &lb, NULL);
    CHECK_MSG(ra == CM_OK && rb == CM_OK && la == lb && memcmp(a, b, la) == 0,
              "the 2 -> 1 sketch (%s) is not the sketch of a 1-shard cluster with the same pulls",
              ra == CM_OK ? "present" : "missing");
    free(a);
    free(b);

    /* Sketches of other dimensions do not add: refused by name, nothing written. */
    CHECK_OK(ps_checkpoint_reshard(c2, bad, 2, 0, &err), err);
    halve_sketch(bad);
    int rc = ps_checkpoint_reshard(bad, badout, 1, 0, &err);
    CHECK_MSG(rc == CM_EINVAL && err && strstr(err, "shard-1/table-t/sketch.bin") &&
                  strstr(err, "counters"),
              "sketches of two sizes: rc %d, %s", rc, err ? err : "(no message)");
    free(err);
    err = NULL;
    struct stat st;
    CHECK_MSG(stat(badout, &st) != 0, "a refused reshard left %s", badout);
    return pt_finish(dir);
}
