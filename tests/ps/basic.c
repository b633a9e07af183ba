/*
 * One client against two in-process shards: a pull sees this client's earlier pushes without
 * an explicit flush (ps.h promises it), duplicates and caller order in pull and push, the
 * lossy codecs end to end with int8 error feedback, dense blocks (their optimizers against a
 * double-precision reference), and the STATS counters. A server with a checkpoint root
 * SAVEs and LOADs within it and refuses paths outside it (plainly, by "..", through a link).
 */
#include <math.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ps_test_util.h"

#define DIM 4u

static const char conf[] =
    "[cluster]\nshards = 2\nworkers = 1\n"
    "[table exact]\ndim = 4\noptimizer = sgd\nlr = 0.5\ninit_scale = 0\n"
    "[table lossy]\ndim = 4\noptimizer = sgd\nlr = 1\ninit_scale = 0\npush_codec = int8\n"
    "pull_codec = fp16\n"
    "[table init]\ndim = 4\noptimizer = sgd\nlr = 1\ninit_scale = 0.1\nseed = 5\n"
    "[dense d0]\nsize = 6\noptimizer = sgd\nlr = 0.25\n"
    "[dense d1]\nsize = 3\n"
    "[dense adam]\nsize = 64\noptimizer = adam\nlr = 0.01\nbeta1 = 0.9\nbeta2 = 0.999\n"
    "eps = 1e-8\n"
    "[dense adagrad]\nsize = 64\noptimizer = adagrad\nlr = 0.1\neps = 1e-8\n";

/* Push then pull at once, many times: every pull must see every earlier push. */
static void test_read_your_writes(ps_client *c)
{
    enum { K = 64, ITERS = 1000 };
    uint64_t keys[K];
    float g[K * DIM], out[K * DIM];
    for (int i = 0; i < K; i++)
        keys[i] = 1000 + (uint64_t)i; /* both shards */
    for (int i = 0; i < K * (int)DIM; i++)
        g[i] = 1.0f;
    char *err = NULL;
    int stale = 0;
    for (int it = 0; it < ITERS; it++) {
        CHECK_OK(ps_client_push(c, 0, keys, K, g, &err), err);
        CHECK_OK(ps_client_pull(c, 0, keys, K, out, &err), err);
        for (int i = 0; i < K * (int)DIM; i++)
            if (out[i] != -0.5f * (float)(it + 1)) {
                stale++;
                break;
            }
    }
    CHECK_MSG(stale == 0, "%d of %d pulls missed this client's own earlier push", stale, ITERS);
}

/* Duplicated keys: pushes sum them, pulls return each position its row. */
static void test_duplicates(ps_client *c)
{
    char *err = NULL;
    uint64_t keys[5] = {7, 3, 7, 99, 7};
    float g[5 * DIM], out[5 * DIM], init[5 * DIM];
    CHECK_OK(ps_client_pull(c, 2, keys, 5, init, &err), err);
    /* Rows initialise from the key: same key, same row; different keys differ. */
    CHECK(memcmp(init, init + 2 * DIM, DIM * 4) == 0 && memcmp(init, init + 4 * DIM, DIM * 4) == 0);
    CHECK(memcmp(init, init + DIM, DIM * 4) != 0);
    for (int i = 0; i < 5 * (int)DIM; i++)
        CHECK(fabsf(init[i]) <= 0.1f);
    for (int i = 0; i < 5; i++)
        for (uint32_t j = 0; j < DIM; j++)
            g[i * DIM + j] = (float)(i + 1) * 0.125f;
    CHECK_OK(ps_client_push(c, 2, keys, 5, g, &err), err);
    CHECK_OK(ps_client_pull(c, 2, keys, 5, out, &err), err);
    for (uint32_t j = 0; j < DIM; j++) {
        /* key 7: grads 0.125 + 0.375 + 0.625 summed by the client, one sgd step (lr 1). */
        float sum = 0.125f + 0.375f + 0.625f;
        CHECK(out[j] == (float)((double)init[j] - 1.0 * (double)sum));
        CHECK(out[2 * DIM + j] == out[j] && out[4 * DIM + j] == out[j]);
        CHECK(out[DIM + j] == (float)((double)init[DIM + j] - 0.25));
        CHECK(out[3 * DIM + j] == (float)((double)init[3 * DIM + j] - 0.5));
    }
    /* An empty batch is a no-op; a bad table id is an error naming it. */
    CHECK_OK(ps_client_pull(c, 2, keys, 0, out, &err), err);
    CHECK(ps_client_pull(c, 9, keys, 1, out, &err) == CM_EINVAL && err && strstr(err, "table 9"));
    free(err), err = NULL;
    float bad[DIM] = {0, NAN, 0, 0};
    CHECK(ps_client_push(c, 2, keys, 1, bad, &err) == CM_EINVAL && err &&
          strstr(err, "non-finite"));
    free(err);
}

/* int8 pushes with error feedback: a component too small to survive one quantisation still
 * arrives in full over many pushes, within one quantum. */
static void test_lossy(ps_client *c)
{
    enum { K = 40, PUSHES = 100 };
    uint64_t keys[K];
    float g[K * DIM], out[K * DIM];
    for (int i = 0; i < K; i++)
        keys[i] = 5000 + (uint64_t)i * 7919;
    for (int i = 0; i < K; i++) {
        g[i * DIM + 0] = 1.0f;
        g[i * DIM + 1] = 0.003f; /* < half an int8 step of 1/127: rounds to 0 alone */
        g[i * DIM + 2] = -0.25f;
        g[i * DIM + 3] = 0.0421f;
    }
    char *err = NULL;
    for (int p = 0; p < PUSHES; p++)
        CHECK_OK(ps_client_push(c, 1, keys, K, g, &err), err);
    CHECK_OK(ps_client_pull(c, 1, keys, K, out, &err), err);
    double worst = 0;
    for (int i = 0; i < K * (int)DIM; i++) {
        double want = -(double)PUSHES * g[i];
        /* one int8 step (1/127) of residual left behind, plus fp16 rounding of the pull */
        double tol = 1.0 / 127 + fabs(want) * 0x1p-10;
        worst = fmax(worst, fabs(out[i] - want) / tol);
    }
    CHECK_MSG(worst <= 1.0, "int8+fp16 path off by %.2f x the bound", worst);
    ps_client_stats st;
    CHECK_OK(ps_client_stats_get(c, &st, &err), err);
    CHECK(st.push_sq_norm > 0 && st.push_sq_error > 0 && st.push_sq_error < st.push_sq_norm * 1e-3);
}

/* ps_keys_order gives a permutation into shard order, ascending within each shard. */
static void check_order(uint32_t ns, const uint64_t *keys, size_t n)
{
    uint32_t *perm = malloc(n * sizeof *perm + 1);
    uint8_t *seen = calloc(n + 1, 1);
    char *err = NULL;
    CHECK_OK(ps_keys_order(ns, keys, n, perm, &err), err);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        bad += perm[i] >= n || seen[perm[i]]++;
        if (i == 0 || perm[i] >= n || perm[i - 1] >= n) continue;
        uint64_t a = keys[perm[i - 1]], b = keys[perm[i]];
        uint32_t sa = ps_key_shard(a, ns), sb = ps_key_shard(b, ns);
        bad += sb < sa || (sa == sb && b <= a);
    }
    CHECK_MSG(bad == 0, "ps_keys_order over %u shards: %zu misplaced of %zu", ns, bad, n);
    free(perm);
    free(seen);
}

/*
 * Keys in the client's own order (ps_keys_order) take the pull's and push's fast path (no
 * sort, decode straight into the caller's rows); any other order the sorting one. Both must
 * give every key its own row: pushes of per-key gradients in one order are read back in the
 * other, on the fp32 and the int8 (own copy for error feedback) tables.
 */
static void test_key_order(ps_client *c)
{
    enum { K = 997 };
    uint64_t keys[K], ordered[K];
    uint32_t perm[K];
    float g[K * DIM], out[K * DIM];
    char *err = NULL;
    for (int i = 0; i < K; i++)
        keys[i] = 0x9E3779B97F4A7C15ull * (uint64_t)(i + 11) >> 7; /* distinct, unordered */
    for (uint32_t ns = 1; ns <= 5; ns++)
        check_order(ns, keys, K);
    /* The sort's paths (client.c key_sort): hashed keys (buckets on their top bits, insertion-
     * sorted), a few clusters of them (buckets too large: LSD passes inside), keys within 22
     * bits (LSD passes alone), keys differing only in high bits, and sizes around the bucket
     * thresholds. */
    enum { BIG = 40000 };
    uint64_t *many = malloc(BIG * sizeof *many), x = 0x2545F4914F6CDD1Dull;
    for (int shape = 0; many != NULL && shape < 4; shape++)
        for (size_t n = 1; n <= BIG; n = n < 100 ? n + 33 : n * 7) {
            for (size_t i = 0; i < n; i++) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                many[i] = shape == 0   ? x
                          : shape == 1 ? ((uint64_t)(i % 3) << 60) | (x >> 24)
                          : shape == 2 ? (uint64_t)i * 2654435761u % (1u << 22) /* distinct */
                                       : ((uint64_t)i << 40) | 7;
            }
            check_order(1, many, n);
            check_order(3, many, n);
        }
    free(many);
    uint64_t dup[3] = {5, 9, 5};
    CHECK(ps_keys_order(2, dup, 3, perm, &err) == CM_EINVAL && err && strstr(err, "twice"));
    free(err), err = NULL;
    CHECK_OK(ps_keys_order(2, keys, K, perm, &err), err);
    for (int i = 0; i < K; i++)
        ordered[i] = keys[perm[i]];
    for (uint32_t t = 0; t < 2; t++) {
        /* Table 0 (sgd lr 0.5, fp32): push in shard order, pull in the caller's. */
        const uint64_t *push_keys = t == 0 ? ordered : keys, *pull_keys = t == 0 ? keys : ordered;
        for (int i = 0; i < K; i++)
            for (uint32_t j = 0; j < DIM; j++)
                g[i * DIM + j] = (float)((push_keys[i] >> 3) % 1000) * 0.25f + (float)j;
        CHECK_OK(ps_client_push(c, t, push_keys, K, g, &err), err);
        CHECK_OK(ps_client_pull(c, t, pull_keys, K, out, &err), err);
        size_t wrong = 0;
        for (int i = 0; i < K; i++)
            for (uint32_t j = 0; j < DIM; j++) {
                double want = -(t == 0 ? 0.5 : 1.0) *
                              ((double)((pull_keys[i] >> 3) % 1000) * 0.25 + (double)j);
                /* table 1: int8 push (a step is the row's largest value / 127), fp16 pull */
                double row_max = (double)((pull_keys[i] >> 3) % 1000) * 0.25 + (DIM - 1);
                double tol = t == 0 ? 0 : row_max / 127 + fabs(want) * 0x1p-10;
                wrong += fabs(out[i * DIM + j] - want) > tol;
            }
        CHECK_MSG(wrong == 0, "table %u: %zu of %d values not the key's own", t, wrong, K * DIM);
    }
    /* Nearly in order, which must not pass for it: two keys of one shard swapped, and one
     * key repeated; each position still gets its key's row (table 0 as it is now). */
    float want[K * DIM];
    CHECK_OK(ps_client_pull(c, 0, ordered, K, want, &err), err);
    int swap = 1;
    while (swap < K && ps_key_shard(ordered[swap], 2) != ps_key_shard(ordered[swap - 1], 2))
        swap++;
    for (int v = 0; v < 2 && swap < K; v++) {
        uint64_t near[K];
        memcpy(near, ordered, sizeof near);
        if (v == 0) {
            near[swap] = ordered[swap - 1];
            near[swap - 1] = ordered[swap];
        } else {
            near[swap] = ordered[swap - 1];
        }
        CHECK_OK(ps_client_pull(c, 0, near, K, out, &err), err);
        int src = swap - 1; /* position swap holds that key in both variants */
        CHECK_MSG(memcmp(out, want, (size_t)(swap - 1) * DIM * 4) == 0 &&
                      memcmp(out + (size_t)swap * DIM, want + (size_t)src * DIM, DIM * 4) == 0 &&
                      memcmp(out + (size_t)(swap + 1) * DIM, want + (size_t)(swap + 1) * DIM,
                             (size_t)(K - swap - 1) * DIM * 4) == 0,
                  "variant %d: a key list out of order by one got other keys' rows", v);
        if (v == 0)
            CHECK(memcmp(out + (size_t)(swap - 1) * DIM, want + (size_t)swap * DIM, DIM * 4) == 0);
    }
}

static void test_dense(ps_client *c)
{
    char *err = NULL;
    float v[6] = {1, 2, 3, 4, 5, 6}, w[6] = {9, 9, 9, 9, 9, 9}, out[6], g[6] = {4, 0, -4, 8, 1, 2};
    int assigned = -1;
    CHECK_OK(ps_client_dense_pull(c, 0, out, &err), err);
    for (int i = 0; i < 6; i++)
        CHECK(out[i] == 0.0f); /* uninitialised reads as zeros */
    CHECK_OK(ps_client_dense_init(c, 0, v, &assigned, &err), err);
    CHECK(assigned == 1);
    CHECK_OK(ps_client_dense_init(c, 0, w, &assigned, &err), err); /* the first one wins */
    CHECK(assigned == 0);
    CHECK_OK(ps_client_dense_pull(c, 0, out, &err), err);
    CHECK(memcmp(out, v, sizeof v) == 0);
    CHECK_OK(ps_client_dense_push(c, 0, g, &err), err);
    CHECK_OK(ps_client_dense_pull(c, 0, out, &err), err);
    for (int i = 0; i < 6; i++)
        CHECK(out[i] == v[i] - 0.25f * g[i]);
    /* A read-back push returns the block after its update: what a pull then returns. */
    float back[6], pulled[6];
    memset(back, 0xff, sizeof back);
    CHECK_OK(ps_client_dense_push_pull(c, 0, g, back, &err), err);
    CHECK_OK(ps_client_dense_pull(c, 0, pulled, &err), err);
    CHECK(memcmp(back, pulled, sizeof back) == 0);
    for (int i = 0; i < 6; i++)
        CHECK(back[i] == v[i] - 0.5f * g[i]);
    /* Block 1 lives on shard 1 (b % N). */
    float o1[3], b1[3];
    CHECK_OK(ps_client_dense_init(c, 1, v, &assigned, &err), err);
    CHECK_OK(ps_client_dense_pull(c, 1, o1, &err), err);
    CHECK(memcmp(o1, v, sizeof o1) == 0);
    CHECK_OK(ps_client_dense_push_pull(c, 1, g, b1, &err), err);
    CHECK_OK(ps_client_dense_pull(c, 1, o1, &err), err);
    CHECK(memcmp(o1, b1, sizeof o1) == 0 && b1[0] != v[0]);
    CHECK(ps_client_dense_pull(c, 4, o1, &err) == CM_EINVAL);
    free(err);
}

/* The dense blocks' optimizers against a straightforward double-precision reference of the
 * textbook update (Adam with bias correction; Adagrad with a running sum of squares), over
 * 40 steps of gradients whose scale changes: within 1e-5 relative (the PS computes in float,
 * as PyTorch does; the reference rounds nothing). */
static void test_dense_optimizers(ps_client *c)
{
    enum { N = 64, STEPS = 40 };
    char *err = NULL;
    float init[N], g[N], out[N];
    double w[2][N], m[N] = {0}, v[N] = {0}, a[N] = {0};
    for (int i = 0; i < N; i++)
        init[i] = (float)(i - N / 2) * 0.03f, w[0][i] = w[1][i] = init[i];
    int assigned = 0;
    for (uint32_t b = 2; b <= 3; b++) {
        CHECK_OK(ps_client_dense_init(c, b, init, &assigned, &err), err);
        CHECK(assigned == 1);
    }
    double worst = 0;
    for (int t = 1; t <= STEPS; t++) {
        for (int i = 0; i < N; i++)
            g[i] = (float)(sin(0.7 * i + 0.3 * t) * (t % 5 == 0 ? 10.0 : 0.1));
        const double bc1 = 1 - pow(0.9, t), bc2 = 1 - pow(0.999, t);
        for (int i = 0; i < N; i++) {
            m[i] = 0.9 * m[i] + 0.1 * g[i];
            v[i] = 0.999 * v[i] + 0.001 * (double)g[i] * g[i];
            w[0][i] -= 0.01 * (m[i] / bc1) / (sqrt(v[i] / bc2) + 1e-8);
            a[i] += (double)g[i] * g[i];
            w[1][i] -= 0.1 * g[i] / (sqrt(a[i]) + 1e-8);
        }
        for (int k = 0; k < 2; k++) {
            CHECK_OK(ps_client_dense_push_pull(c, 2 + (uint32_t)k, g, out, &err), err);
            for (int i = 0; i < N; i++) {
                double rel = fabs(out[i] - w[k][i]) / (fabs(w[k][i]) + 1e-3);
                worst = rel > worst ? rel : worst;
            }
        }
    }
    CHECK_MSG(worst <= 1e-5, "dense optimizers: %.3g relative from the reference", worst);
}

/* SAVE (or LOAD) of dir: 0, or the error's code with its message checked for "outside". */
static int save_at(ps_client *c, const char *dir, bool load)
{
    char *err = NULL;
    int rc = load ? ps_client_load(c, dir, &err) : ps_client_save(c, dir, &err);
    if (rc != CM_OK)
        CHECK_MSG(err && strstr(err, "outside this PS's checkpoint root"), "%s: %s", dir,
                  err ? err : "(no message)");
    free(err);
    return rc;
}

/* A tcp URL without a port: nng would listen on a random port no client can find (and dial
 * port 0). Refused, naming it, before anything listens. */
static void test_url_without_port(const char *dir)
{
    ps_config cfg;
    pt_config(dir, "port.conf", "[cluster]\nshards = 1\nworkers = 1\n[table t]\ndim = 4\n", &cfg);
    const char *bad[] = {"tcp://127.0.0.1", "tcp://127.0.0.1:", "tcp://127.0.0.1:0",
                         "tcp://127.0.0.1:70000", "tls+tcp://localhost"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        ps_server_opts o = {.cfg = &cfg, .listen = bad[i], .shard = 0};
        ps_server *s = NULL;
        char *err = NULL;
        int rc = ps_server_create(&o, &s, &err);
        CHECK_MSG(rc != CM_OK && err && strstr(err, bad[i]), "listen on %s: rc %d, %s", bad[i], rc,
                  err ? err : "(no message)");
        if (rc == CM_OK) ps_server_destroy(s);
        free(err);
    }
}

/* A backup URL too long for the server to keep: refused naming the length, where cut short it
 * could name another socket (an ipc:// path's prefix). */
static void test_long_backup_url(const char *dir)
{
    ps_config cfg;
    pt_config(dir, "long.conf", "[cluster]\nshards = 1\nworkers = 1\n[table t]\ndim = 4\n", &cfg);
    char url[1200];
    int n = snprintf(url, sizeof url, "ipc://%s/", dir);
    memset(url + n, 'b', sizeof url - (size_t)n - 1);
    url[sizeof url - 1] = '\0';
    ps_server_opts o = {.cfg = &cfg, .listen = pt_ipc(dir, "long"), .shard = 0, .replica_url = url};
    ps_server *s = NULL;
    char *err = NULL;
    int rc = ps_server_create(&o, &s, &err);
    CHECK_MSG(rc == CM_EINVAL && err && strstr(err, "backup URL too long"),
              "a %zu-byte backup URL: rc %d, %s", strlen(url), rc, err ? err : "(no message)");
    if (rc == CM_OK) ps_server_destroy(s);
    free(err);
}

static void test_checkpoint_root(const char *dir)
{
    ps_config cfg;
    pt_config(dir, "root.conf",
              "[cluster]\nshards = 1\nworkers = 1\n[table t]\ndim = 4\noptimizer = sgd\n", &cfg);
    const char *url = pt_ipc(dir, "root"), *urls[1] = {url};
    char root[1200], inside[1300], outside[1300], dotdot[1300], link[1300], via[1400];
    snprintf(root, sizeof root, "%s/ckroot", dir);
    ps_server_opts o = {.cfg = &cfg, .listen = url, .shard = 0, .checkpoint_root = root};
    ps_server *s = NULL;
    char *err = NULL;
    if (ps_server_create(&o, &s, &err) != CM_OK) pt_die("ps_server_create", err);
    ps_client *c = pt_client(&cfg, urls, 0, 10000);
    snprintf(inside, sizeof inside, "%s/step-1", root);
    snprintf(outside, sizeof outside, "%s/elsewhere", dir);
    snprintf(dotdot, sizeof dotdot, "%s/../elsewhere2", root);
    snprintf(link, sizeof link, "%s/out", root);
    snprintf(via, sizeof via, "%s/step-2", link);
    CHECK(mkdir(outside, 0755) == 0 && symlink(outside, link) == 0);
    CHECK(save_at(c, inside, false) == CM_OK && save_at(c, inside, true) == CM_OK);
    CHECK(save_at(c, root, false) == CM_OK); /* the root itself */
    CHECK(save_at(c, outside, false) == CM_EINVAL && save_at(c, outside, true) == CM_EINVAL);
    CHECK(save_at(c, dotdot, false) == CM_EINVAL && save_at(c, via, false) == CM_EINVAL);
    CHECK(save_at(c, "/", false) == CM_EINVAL);
    struct stat st;
    char probe[1500];
    snprintf(probe, sizeof probe, "%s/elsewhere2", dir);
    CHECK_MSG(stat(probe, &st) != 0, "a refused SAVE created %s", probe);
    snprintf(probe, sizeof probe, "%s/step-2", outside);
    CHECK_MSG(stat(probe, &st) != 0, "a refused SAVE created %s", probe);
    ps_client_destroy(c);
    ps_server_destroy(s);
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_basic");
    ps_config cfg;
    pt_config(dir, "ps.conf", conf, &cfg);
    const char *urls[2] = {pt_ipc(dir, "s0"), pt_ipc(dir, "s1")};
    ps_server *s0 = pt_server(&cfg, urls[0], 0), *s1 = pt_server(&cfg, urls[1], 1);
    ps_client *c = pt_client(&cfg, urls, 0, 10000);
    test_read_your_writes(c);
    test_duplicates(c);
    test_lossy(c);
    test_key_order(c);
    test_dense(c);
    test_dense_optimizers(c);
    char *err = NULL;
    CHECK_OK(ps_client_flush(c, &err), err);
    ps_client_stats st;
    CHECK_OK(ps_client_stats_get(c, &st, &err), err);
    CHECK(st.shard_total.bad_messages == 0);
    CHECK(st.rows_pulled > 0 && st.shard_total.rows_pulled == st.rows_pulled);
    CHECK(st.shard_total.rows_pushed == st.rows_pushed);
    CHECK(st.bytes_sent > 0 && st.shard_total.bytes_in > 0);
    ps_client_destroy(c);
    ps_server_destroy(s0);
    ps_server_destroy(s1);
    test_checkpoint_root(dir);
    test_url_without_port(dir);
    test_long_backup_url(dir);
    return pt_finish(dir);
}
