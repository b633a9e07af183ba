/*
 * Key elision: a push of exactly the keys a worker has just pulled names that pull instead of
 * carrying the keys. SGD with lr 1 and initial rows of 0, so every row ends at exactly minus the
 * sum of the gradients pushed to it: a push applied to the wrong keys, lost, or applied twice
 * shows as a wrong number.
 *   1. Pull then push over 2 shards: every per-shard push is elided, rows are exact, and the
 *      pushes are smaller than the same pushes with keys (explicit_keys client).
 *   2. Fallback: the server has evicted the key list (another client of the same worker index
 *      pulled PS_KEYLIST_RING times since); the elided push is answered PS_STATUS_NO_KEYS and
 *      sent again with keys under the same request id: applied exactly once.
 *   3. A different key set, a lookup, or a push of a subset is never elided.
 *   4. Rows moved (the table grew) between a pull and the elided push naming it: the push
 *      lands on its own keys, not on whatever now sits where they were (the server hands the
 *      table the pull's row slots as hints).
 */
#include "ps/wire.h" /* PS_KEYLIST_RING */
#include "ps_test_util.h"

#define CONF                                                                                       \
    "[cluster]\nshards = 2\nworkers = 1\n"                                                         \
    "[table t]\ndim = 4\noptimizer = sgd\nlr = 1\ninit_scale = 0\n"

enum { N = 3000, DIM = 4 };

static uint64_t keys[N];
static float grads[N * DIM], rows[N * DIM];

static ps_client *client(const ps_config *cfg, const char *const *urls, bool explicit_keys)
{
    ps_client_opts o = {
        .cfg = cfg, .urls = urls, .worker = 0, .timeout_ms = 10000, .explicit_keys = explicit_keys};
    return pt_client_with(&o);
}

/* Every element of the first n keys' rows equals want. */
static void check_rows(ps_client *c, size_t n, float want, const char *what)
{
    char *err = NULL;
    CHECK_OK(ps_client_lookup(c, 0, keys, n, rows, &err), err);
    size_t bad = 0;
    for (size_t i = 0; i < n * DIM; i++)
        bad += rows[i] != want;
    CHECK_MSG(bad == 0, "%s: %zu values differ from %.1f (e.g. %.2f)", what, bad, want, rows[0]);
}

static ps_client_stats stats(ps_client *c)
{
    ps_client_stats st;
    char *err = NULL;
    CHECK_OK(ps_client_stats_get(c, &st, &err), err);
    return st;
}

/* Three rounds of pull then push of every key, as training sends them; then a flush. */
static void pull_push_3(ps_client *c)
{
    char *err = NULL;
    for (int it = 0; it < 3; it++) {
        CHECK_OK(ps_client_pull(c, 0, keys, N, rows, &err), err);
        CHECK_OK(ps_client_push(c, 0, keys, N, grads, &err), err);
    }
    CHECK_OK(ps_client_flush(c, &err), err);
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_elide");
    ps_config cfg;
    pt_config(dir, "elide.ini", CONF, &cfg);
    const char *urls[2] = {pt_ipc(dir, "s0"), pt_ipc(dir, "s1")};
    ps_server *srv[2] = {pt_server(&cfg, urls[0], 0), pt_server(&cfg, urls[1], 1)};
    for (int i = 0; i < N; i++)
        keys[i] = 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1); /* spread like hashed ids */
    for (int i = 0; i < N * DIM; i++)
        grads[i] = 1.0f;
    char *err = NULL;

    /* 1. Elided pushes; then the same pushes with keys, for the byte count. */
    ps_client *c = client(&cfg, urls, false), *x = client(&cfg, urls, true);
    pull_push_3(c);
    check_rows(c, N, -3.0f, "elided pushes");
    ps_client_stats st = stats(c);
    CHECK_MSG(st.pushes_elided == 6 && st.push_fallbacks == 0, "elided %llu, fallbacks %llu",
              (unsigned long long)st.pushes_elided, (unsigned long long)st.push_fallbacks);
    CHECK(st.shard_total.elided == 6 && st.shard_total.elided_misses == 0);
    CHECK(st.shard_total.keylist_bytes > 0);
    pull_push_3(x);
    check_rows(x, N, -6.0f, "pushes with keys");
    ps_client_stats sx = stats(x);
    CHECK(sx.pushes_elided == 0);
    fprintf(stderr, "elide: %.2f bytes per pushed row elided, %.2f with keys\n",
            (double)st.push_bytes / (3.0 * N), (double)sx.push_bytes / (3.0 * N));
    CHECK_MSG(st.push_bytes + 3ull * N * 5 < sx.push_bytes, "elided %llu bytes, with keys %llu",
              (unsigned long long)st.push_bytes, (unsigned long long)sx.push_bytes);

    /* 2. The server evicts the list (x has the same worker index); c still holds it. */
    CHECK_OK(ps_client_pull(c, 0, keys, N, rows, &err), err);
    for (uint32_t i = 0; i < PS_KEYLIST_RING; i++)
        CHECK_OK(ps_client_pull(x, 0, keys + 1 + i, N - 1 - i, rows, &err), err);
    CHECK_OK(ps_client_push(c, 0, keys, N, grads, &err), err);
    CHECK_OK(ps_client_flush(c, &err), err);
    check_rows(c, N, -7.0f, "pushes resent with keys");
    ps_client_stats s2 = stats(c);
    CHECK_MSG(s2.pushes_elided == 8 && s2.push_fallbacks == 2, "elided %llu, fallbacks %llu",
              (unsigned long long)s2.pushes_elided, (unsigned long long)s2.push_fallbacks);
    CHECK(s2.shard_total.elided_misses == 2 && s2.shard_total.bad_messages == 0);

    /* 3. Not elided: a subset of the pulled keys, and keys only looked up. */
    CHECK_OK(ps_client_pull(c, 0, keys, N, rows, &err), err);
    CHECK_OK(ps_client_push(c, 0, keys, N / 2, grads, &err), err);
    CHECK_OK(ps_client_lookup(c, 0, keys + N / 2, N - N / 2, rows, &err), err);
    CHECK_OK(ps_client_push(c, 0, keys + N / 2, N - N / 2, grads, &err), err);
    CHECK_OK(ps_client_flush(c, &err), err);
    check_rows(c, N, -8.0f, "pushes with keys after a pull of others");
    CHECK(stats(c).pushes_elided == 8);

    /* 4. Rows moved between a pull and the elided push that names it: another pull creates
     * NEW rows, so every sub-shard grows and rehashes, and the slots the server kept with the
     * pull's key list now hold other keys or nothing. The push must still land on its keys
     * (the new rows stay 0). */
    enum { NEW = 60000 };
    uint64_t *fresh = malloc(NEW * sizeof *fresh);
    float *fresh_rows = malloc((size_t)NEW * DIM * sizeof *fresh_rows);
    CHECK(fresh != NULL && fresh_rows != NULL);
    for (int i = 0; i < NEW; i++)
        fresh[i] = 0x2545f4914f6cdd1dull * (uint64_t)(i + 1) + 12345;
    CHECK_OK(ps_client_pull(c, 0, keys, N, rows, &err), err);
    CHECK_OK(ps_client_pull(x, 0, fresh, NEW, fresh_rows, &err), err);
    CHECK_OK(ps_client_push(c, 0, keys, N, grads, &err), err);
    CHECK_OK(ps_client_flush(c, &err), err);
    check_rows(c, N, -9.0f, "elided push after the table grew");
    CHECK(stats(c).pushes_elided == 10);
    CHECK_OK(ps_client_lookup(c, 0, fresh, NEW, fresh_rows, &err), err);
    size_t moved = 0;
    for (size_t i = 0; i < (size_t)NEW * DIM; i++)
        moved += fresh_rows[i] != 0.0f;
    CHECK_MSG(moved == 0, "%zu values of rows created between pull and push changed", moved);
    free(fresh);
    free(fresh_rows);

    ps_client_destroy(c);
    ps_client_destroy(x);
    ps_server_destroy(srv[0]);
    ps_server_destroy(srv[1]);
    return pt_finish(dir);
}
