/*
 * Synchronous training, 2 `ember ps` processes x 2 worker processes (this binary run again as
 * `ps_sync worker I DIR`, each with its own client):
 * staleness 0, sgd, fp32 pushes with duplicated keys, a clock after every step. The test
 * replays the same float arithmetic (client sums duplicates in float; the table applies
 * w = (float)(w - lr * g) in double) to know every row after every step. At each step a worker
 * must read exactly the rows left by everyone's previous step, and at the end both see the
 * final rows bit for bit (a worker's exit status says which of these failed). Then SHUTDOWN
 * stops both PS processes cleanly.
 */
#include <unistd.h>

#include "ps_test_util.h"

#define DIM 8u
#define NKEYS 400u
#define STEPS 20u
#define WORKERS 2u

static const char conf[] = "[cluster]\nshards = 2\nworkers = 2\nstaleness = 0\n"
                           "[table t]\ndim = 8\noptimizer = sgd\nlr = 0.1\ninit_scale = 0.05\n"
                           "seed = 3\npush_codec = fp32\npull_codec = fp32\n";

static ps_config cfg;
static const char *urls[2];
static float *expect; /* (STEPS + 1) x NKEYS x DIM: rows before each step, and at the end */

static float grad(uint32_t step, uint32_t worker, uint64_t key, uint32_t dup, uint32_t j)
{
    uint64_t x =
        ((uint64_t)step << 40) ^ ((uint64_t)worker << 36) ^ (key << 8) ^ ((uint64_t)dup << 5) ^ j;
    x *= 0x9e3779b97f4a7c15ull;
    x ^= x >> 29;
    return (float)((double)(x >> 11) / 0x1p53 * 2.0 - 1.0);
}

/* Worker w updates keys k with (k + step) % WORKERS == w at each step: no key is updated by
 * two workers in one step, so the order of applied pushes (and the float result) is fixed. */
static uint32_t batch(uint32_t step, uint32_t w, uint64_t *keys, float *g)
{
    uint32_t n = 0;
    for (uint64_t k = 1; k <= NKEYS; k++)
        if ((k + step) % WORKERS == w) keys[n++] = k;
    /* Each key twice: once in order, once in reverse, with different gradients. */
    for (uint32_t i = 0; i < n; i++) {
        keys[2 * n - 1 - i] = keys[i];
        for (uint32_t j = 0; j < DIM; j++) {
            g[i * DIM + j] = grad(step, w, keys[i], 0, j);
            g[(2 * n - 1 - i) * DIM + j] = grad(step, w, keys[i], 1, j);
        }
    }
    return 2 * n;
}

static void compute_expected(void)
{
    const double lr = cfg.tables[0].cfg.lr, l2 = cfg.tables[0].cfg.l2;
    for (uint32_t t = 0; t < STEPS; t++) {
        float *cur = expect + (size_t)t * NKEYS * DIM, *next = cur + NKEYS * DIM;
        memcpy(next, cur, NKEYS * DIM * sizeof(float));
        for (uint32_t w = 0; w < WORKERS; w++)
            for (uint64_t k = 1; k <= NKEYS; k++) {
                if ((k + t) % WORKERS != w) continue;
                float *row = next + (k - 1) * DIM;
                for (uint32_t j = 0; j < DIM; j++) {
                    float sum = 0.0f; /* the client's duplicate sum, in caller order */
                    sum += grad(t, w, k, 0, j);
                    sum += grad(t, w, k, 1, j);
                    row[j] = (float)(row[j] - lr * (sum + l2 * row[j]));
                }
            }
    }
}

typedef struct worker_res {
    uint32_t id;
    int errors;         /* failed calls */
    int stale_rows;     /* rows read at a step that differ from the expected */
    int final_mismatch; /* rows differing after the last step */
    uint64_t last_clock;
} worker_res;

/* A worker's exit status: a bit for each kind of failure. */
enum { W_ERRORS = 1, W_STALE = 2, W_FINAL = 4, W_CLOCK = 8 };

static void worker(worker_res *r)
{
    ps_client_opts o = {.cfg = &cfg, .urls = urls, .worker = r->id, .timeout_ms = 10000};
    ps_client *c = NULL;
    char *err = NULL;
    uint64_t *keys = malloc(2 * NKEYS * sizeof *keys);
    float *g = malloc(2 * NKEYS * DIM * sizeof *g), *out = malloc(NKEYS * DIM * sizeof *out);
    if (ps_client_create(&o, &c, &err) != CM_OK) {
        fprintf(stderr, "worker %u: %s\n", r->id, err);
        r->errors++;
        goto out;
    }
    for (uint32_t t = 0; t < STEPS && r->errors == 0; t++) {
        uint32_t n = batch(t, r->id, keys, g);
        /* The first half of the batch lists each key once. */
        if (ps_client_pull(c, 0, keys, n / 2, out, &err) != CM_OK) {
            fprintf(stderr, "worker %u pull: %s\n", r->id, err);
            r->errors++;
            break;
        }
        for (uint32_t i = 0; i < n / 2; i++)
            if (memcmp(out + i * DIM, expect + ((size_t)t * NKEYS + keys[i] - 1) * DIM, DIM * 4) !=
                0)
                r->stale_rows++;
        if (ps_client_push(c, 0, keys, n, g, &err) != CM_OK ||
            ps_client_clock(c, &r->last_clock, &err) != CM_OK) {
            fprintf(stderr, "worker %u step %u: %s\n", r->id, t, err);
            r->errors++;
        }
    }
    for (uint64_t k = 1; k <= NKEYS; k++)
        keys[k - 1] = k;
    if (r->errors == 0 && ps_client_pull(c, 0, keys, NKEYS, out, &err) == CM_OK) {
        for (uint32_t i = 0; i < NKEYS; i++)
            if (memcmp(out + i * DIM, expect + ((size_t)STEPS * NKEYS + i) * DIM, DIM * 4) != 0)
                r->final_mismatch++;
    } else {
        r->errors++;
    }
out:
    free(err);
    ps_client_destroy(c);
    free(keys);
    free(g);
    free(out);
}

/* `ps_sync worker I DIR`: the rows to expect come from DIR/expect.bin, which the parent wrote. */
static int worker_main(uint32_t id, const char *dir)
{
    alarm(psp_bound_s(PT_WATCHDOG_S));
    char *err = NULL;
    if (ps_config_load(pt_path(dir, "ps.conf"), &cfg, &err) != CM_OK) pt_die("worker config", err);
    urls[0] = pt_ipc(dir, "s0");
    urls[1] = pt_ipc(dir, "s1");
    size_t len = 0;
    if (cm_read_file(pt_path(dir, "expect.bin"), (void **)&expect, &len, &err) != CM_OK ||
        len != (STEPS + 1) * NKEYS * DIM * sizeof *expect)
        pt_die("worker expect.bin", err);
    worker_res r = {.id = id};
    worker(&r);
    fprintf(stderr, "worker %u: %d errors, %d stale rows, %d final mismatches, clock %llu\n", id,
            r.errors, r.stale_rows, r.final_mismatch, (unsigned long long)r.last_clock);
    free(expect);
    return (r.errors ? W_ERRORS : 0) | (r.stale_rows ? W_STALE : 0) |
           (r.final_mismatch ? W_FINAL : 0) | (r.last_clock != STEPS ? W_CLOCK : 0);
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "worker") == 0)
        return worker_main((uint32_t)atoi(argv[2]), argv[3]);
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_sync");
    const char *path = pt_config(dir, "ps.conf", conf, &cfg);
    urls[0] = pt_ipc(dir, "s0");
    urls[1] = pt_ipc(dir, "s1");
    pid_t pids[2];
    pt_spawn_cluster(path, 2, urls, pids);

    /* Learn the initial rows (the PS initialises them from the key) with a throwaway client. */
    expect = malloc((STEPS + 1) * NKEYS * DIM * sizeof *expect);
    uint64_t keys[NKEYS];
    for (uint64_t k = 1; k <= NKEYS; k++)
        keys[k - 1] = k;
    ps_client *c = pt_client(&cfg, urls, 0, 10000);
    char *err = NULL;
    CHECK_OK(ps_client_pull(c, 0, keys, NKEYS, expect, &err), err);
    int nonzero = 0;
    for (uint32_t i = 0; i < NKEYS * DIM; i++)
        nonzero += expect[i] != 0.0f;
    CHECK(nonzero > (int)(NKEYS * DIM) / 2); /* init_scale > 0: a real starting point */
    ps_client_destroy(c);
    compute_expected();

    CHECK_OK(cm_write_file_atomic(pt_path(dir, "expect.bin"), expect,
                                  (STEPS + 1) * NKEYS * DIM * sizeof *expect, &err),
             err);
    pid_t wp[WORKERS];
    for (uint32_t w = 0; w < WORKERS; w++) {
        char id[16];
        snprintf(id, sizeof id, "%u", w);
        char *args[] = {"/proc/self/exe", "worker", id, (char *)dir, NULL};
        wp[w] = psp_spawn_argv(args, NULL, NULL);
        if (wp[w] < 0) pt_die("spawn a worker", NULL);
    }
    for (uint32_t w = 0; w < WORKERS; w++) {
        int status = psp_stop(wp[w], 0, 60.0);
        int code = status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        CHECK_MSG(code == 0, "worker process %u: status %d (%s%s%s%s)", w, status,
                  code > 0 && (code & W_ERRORS) ? "failed calls " : "",
                  code > 0 && (code & W_STALE) ? "rows not matching the previous step " : "",
                  code > 0 && (code & W_FINAL) ? "final rows differ " : "",
                  code > 0 && (code & W_CLOCK) ? "clock not at the last step" : "");
    }

    c = pt_client(&cfg, urls, 0, 10000);
    ps_client_stats st;
    CHECK_OK(ps_client_stats_get(c, &st, &err), err);
    CHECK(st.shard_total.clocks_min == STEPS && st.shard_total.clocks_max == STEPS);
    CHECK_MSG(st.shard_total.staleness_max <= 1, "staleness_max %llu with staleness 0",
              (unsigned long long)st.shard_total.staleness_max);
    CHECK(st.shard_total.rows_pushed == (uint64_t)STEPS * NKEYS);
    CHECK(st.shard_total.bad_messages == 0 && st.shard_total.errors == 0);
    /* Over the two shards: a row's size is one row's, the step the furthest shard's (every
     * push step reaches both shards here), not their sums. */
    CHECK_MSG(st.table_total[0].row_bytes == emb_row_bytes(&cfg.tables[0].cfg), "row_bytes %llu",
              (unsigned long long)st.table_total[0].row_bytes);
    CHECK_MSG(st.table_total[0].step > 0 && st.table_total[0].step <= (uint64_t)STEPS * WORKERS,
              "step %llu", (unsigned long long)st.table_total[0].step);
    /* SHUTDOWN: both processes exit 0 on their own. */
    CHECK_OK(ps_client_shutdown(c, &err), err);
    ps_client_destroy(c);
    for (int i = 0; i < 2; i++) {
        int status = psp_stop(pids[i], 0, 10.0);
        CHECK_MSG(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
                  "shard %d did not exit cleanly after SHUTDOWN (status %d)", i, status);
    }
    free(expect);
    return pt_finish(dir);
}
