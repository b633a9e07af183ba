/*
 * A table's TTL takes effect on a PS: a row no pull or push touched for more than `ttl` table
 * steps (one step a push call) is dropped, counted in STATS, and comes back as a fresh row
 * (initialised from its key) when touched again; a touched row stays, however many steps pass;
 * a table without TTL keeps every row. Also a push that names a pull whose rows expired in
 * between (key elision hands the server the rows' old slots) updates fresh rows, not stale
 * slots. The server (ps/server.c ttl_after_push) expires once every ttl/8 steps (at least 1),
 * so with ttl 8 every push checks.
 */
#include <unistd.h>

#include "ps_test_util.h"

#define DIM 4u
#define TTL 8u

static const char conf[] = "[cluster]\nshards = 1\nworkers = 1\n"
                           "[table ttl]\ndim = 4\noptimizer = sgd\nlr = 1\ninit_scale = 0.1\n"
                           "seed = 3\nttl = 8\n"
                           "[table keep]\ndim = 4\noptimizer = sgd\nlr = 1\ninit_scale = 0.1\n"
                           "seed = 3\n";

static void fill(float *g, float v)
{
    for (uint32_t j = 0; j < DIM; j++)
        g[j] = v;
}

/* One push of gradient 1 for `key` to table t (one table step). */
static void push1(ps_client *c, uint32_t t, uint64_t key)
{
    float g[DIM];
    fill(g, 1.0f);
    char *err = NULL;
    CHECK_OK(ps_client_push(c, t, &key, 1, g, &err), err);
}

static void pull1(ps_client *c, uint32_t t, uint64_t key, float *out)
{
    char *err = NULL;
    CHECK_OK(ps_client_pull(c, t, &key, 1, out, &err), err);
}

static uint64_t ttl_evictions(ps_client *c, uint32_t t)
{
    ps_client_stats st;
    char *err = NULL;
    /* Pushes are asynchronous: the expiry they bring is counted once they are applied. */
    CHECK_OK(ps_client_flush(c, &err), err);
    CHECK_OK(ps_client_stats_get(c, &st, &err), err);
    return st.table_total[t].ttl_evictions;
}

/* Whether got is want after `steps` SGD steps (lr 1) of gradient g, rounded as the table does. */
static bool row_after(const float *got, const float *want, uint32_t steps, float g)
{
    for (uint32_t j = 0; j < DIM; j++) {
        float w = want[j];
        for (uint32_t i = 0; i < steps; i++)
            w -= g;
        if (got[j] != w) return false;
    }
    return true;
}

/* One in-process server for the config text, at ipc socket `sock`, and a client of it. */
static ps_client *start(const char *dir, const char *name, const char *text, const char *sock,
                        ps_config *cfg, ps_server **srv)
{
    pt_config(dir, name, text, cfg);
    const char *url = pt_ipc(dir, sock);
    *srv = pt_server(cfg, url, 0);
    const char *urls[1] = {url};
    return pt_client(cfg, urls, 0, 10000);
}

/* The same through a spilling table: when the rows expire most of them live in RocksDB. STATS
 * counts every one, a pull brings each back as a fresh row (init, not its trained value), and
 * the row still in use keeps its updates. */
static void spilled(const char *dir)
{
    enum { N = 4000 };
    char text[1024];
    snprintf(text, sizeof text,
             "[cluster]\nshards = 1\nworkers = 1\nspill_dir = %s/spill\n"
             "[table s]\ndim = 4\noptimizer = sgd\nlr = 1\ninit_scale = 0.1\nseed = 3\n"
             "ttl = 8\nmemory = 32768\n",
             dir);
    ps_config cfg;
    ps_server *srv;
    ps_client *c = start(dir, "spill.ini", text, "s1", &cfg, &srv);
    uint64_t *keys = malloc(N * sizeof *keys);
    float *init = malloc((size_t)N * DIM * sizeof *init), *row = malloc((size_t)N * DIM * sizeof *row),
          *g = malloc((size_t)N * DIM * sizeof *g);
    for (uint32_t i = 0; i < N; i++)
        keys[i] = 1000 + 7 * (uint64_t)i;
    for (uint32_t i = 0; i < N * DIM; i++)
        g[i] = 1.0f;
    char *err = NULL;
    const uint64_t busy = 3;
    float b[DIM], b0[DIM];
    pull1(c, 0, busy, b0);
    CHECK_OK(ps_client_pull(c, 0, keys, N, init, &err), err);
    CHECK_OK(ps_client_push(c, 0, keys, N, g, &err), err); /* step 1: every row trained */
    CHECK_OK(ps_client_flush(c, &err), err);
    ps_client_stats st;
    CHECK_OK(ps_client_stats_get(c, &st, &err), err);
    CHECK_MSG(st.table_total[0].rows_spilled > N / 2, "only %llu of %u rows spilled",
              (unsigned long long)st.table_total[0].rows_spilled, N);
    for (uint32_t i = 0; i < TTL + 1; i++)
        push1(c, 0, busy); /* steps 2..10: the N rows are 9 steps behind */
    CHECK_MSG(ttl_evictions(c, 0) == N, "%llu rows expired, want %u",
              (unsigned long long)ttl_evictions(c, 0), N);
    CHECK_OK(ps_client_stats_get(c, &st, &err), err);
    CHECK_MSG(st.table_total[0].rows_spilled + st.table_total[0].rows_mem == 1,
              "%llu rows in memory and %llu spilled after the expiry, want busy's alone",
              (unsigned long long)st.table_total[0].rows_mem,
              (unsigned long long)st.table_total[0].rows_spilled);
    CHECK_OK(ps_client_pull(c, 0, keys, N, row, &err), err);
    CHECK_MSG(memcmp(row, init, (size_t)N * DIM * sizeof *row) == 0,
              "expired spilled rows did not come back fresh");
    pull1(c, 0, busy, b);
    CHECK_MSG(row_after(b, b0, TTL + 1, 1.0f), "the row in use lost updates");
    free(keys);
    free(init);
    free(row);
    free(g);
    ps_client_destroy(c);
    ps_server_destroy(srv);
}

int main(void)
{
    char tmpl[] = "/tmp/ember-ps-ttl-XXXXXX";
    const char *dir = mkdtemp(tmpl);
    if (dir == NULL) return 2;
    psp_watchdog(PT_WATCHDOG_S);
    ps_config cfg;
    ps_server *srv;
    ps_client *c = start(dir, "ps.ini", conf, "s0", &cfg, &srv);

    const uint64_t stale = 11, busy = 22, kept = 33;
    float init_stale[DIM], init_kept[DIM], init_busy[DIM], row[DIM];
    /* Initial values, read from the table without TTL (same seed and init: the same rows). */
    pull1(c, 1, stale, init_stale);
    pull1(c, 1, kept, init_kept);
    pull1(c, 1, busy, init_busy);

    /* step 1: `stale` trained once; then `busy` alone, while `kept` is pulled every step.
     * Pushes are asynchronous, and the server's contexts may apply two in flight in either
     * order: the flush makes `stale`'s push step 1. Without it `busy`'s push took step 1 about
     * once in 50 runs; `stale`'s was step 2, only ttl steps behind at step 10, and the expiry
     * check below failed. */
    push1(c, 0, stale);
    push1(c, 1, stale);
    char *ferr = NULL;
    CHECK_OK(ps_client_flush(c, &ferr), ferr);
    for (uint32_t i = 0; i < TTL - 1; i++) { /* steps 2..TTL */
        push1(c, 0, busy);
        push1(c, 1, busy);
        pull1(c, 0, kept, row);
    }
    /* step TTL: `stale` last touched at step 1, TTL - 1 steps ago: still there. */
    pull1(c, 1, stale, row);
    CHECK_MSG(row_after(row, init_stale, 1, 1.0f), "table without TTL lost a trained row");
    CHECK_MSG(ttl_evictions(c, 0) == 0, "expired before ttl steps passed: %llu rows",
              (unsigned long long)ttl_evictions(c, 0));
    /* Two more steps: stale is now more than TTL steps behind. */
    for (uint32_t i = 0; i < 2; i++) {
        push1(c, 0, busy);
        push1(c, 1, busy);
        pull1(c, 0, kept, row);
    }
    CHECK_MSG(ttl_evictions(c, 0) == 1, "%llu rows expired, want 1 (the untouched one)",
              (unsigned long long)ttl_evictions(c, 0));
    CHECK_MSG(ttl_evictions(c, 1) == 0, "a table without TTL expired rows");
    pull1(c, 0, stale, row);
    CHECK_MSG(row_after(row, init_stale, 0, 0), "an expired row did not come back as a fresh one");
    pull1(c, 0, kept, row);
    CHECK_MSG(row_after(row, init_kept, 0, 0), "a row pulled every step was dropped");
    pull1(c, 0, busy, row);
    CHECK_MSG(row_after(row, init_busy, TTL + 1, 1.0f), "the pushed row lost updates");

    /* A pull, then TTL + 2 steps of other keys' pushes expire its row, then a push that names the
     * pull (elided: the server holds the row's old slot as a hint) must update a fresh row. */
    const uint64_t named = 44;
    float init_named[DIM];
    pull1(c, 1, named, init_named);
    pull1(c, 0, named, row);
    uint64_t before = ttl_evictions(c, 0);
    for (uint32_t i = 0; i < TTL + 2; i++)
        push1(c, 0, busy);
    CHECK_MSG(ttl_evictions(c, 0) > before, "the named row did not expire");
    float g[DIM];
    fill(g, 2.0f);
    char *err = NULL;
    CHECK_OK(ps_client_push(c, 0, &named, 1, g, &err), err);
    pull1(c, 0, named, row);
    CHECK_MSG(row_after(row, init_named, 1, 2.0f), "push after expiry: %g %g %g %g, want init - 2",
              row[0], row[1], row[2], row[3]);

    ps_client_destroy(c);
    ps_server_destroy(srv);
    spilled(dir);
    return pt_finish(dir);
}
