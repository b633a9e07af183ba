/*
 * Concurrent pushes to the same rows: 2 in-process shards, 4 worker threads (each its own
 * client), asynchronous (no clocks), all pulling and pushing the very same keys and the one
 * dense block at every step, with up to a window of pushes in flight each, so the shards apply
 * updates of the same rows from several contexts at once. Gradients are small multiples of
 * 1/64, so every sum is exact in float and the result does not depend on the order in which
 * the pushes were applied: a lost, doubled or torn update shows as a wrong number. A race
 * shows only when two updates of one row actually overlap, so the test is probabilistic: with
 * the sub-shard lock taken out of emb_table_push it failed 4 runs of 5 on 2 busy cores (fewer
 * workers or steps made it 1 in 3 or less), in about 1.5 s.
 *   - sgd table (lr 1, rows start at 0): every row is exactly minus the sum of its gradients;
 *   - adagrad table: every accumulator is exactly the sum of the squared pushed gradients and
 *     every row counts exactly WORKERS x STEPS updates (read from a collective checkpoint);
 *   - sgd dense block (lr 1): exactly minus the sum of every worker's gradients.
 * Even steps push exactly the keys just pulled (elided pushes, as training sends them); odd
 * steps push every key twice (explicit keys, duplicates summed by the client).
 */
#include <pthread.h>

#include "ps_test_util.h"

enum { WORKERS = 4, STEPS = 150, NK = 2000, DIM = 8, DSIZE = 4096 };

static const char conf[] = "[cluster]\nshards = 2\nworkers = 4\n"
                           "[table sgd]\ndim = 8\noptimizer = sgd\nlr = 1\ninit_scale = 0\n"
                           "[table ada]\ndim = 8\noptimizer = adagrad\nlr = 0.5\ninit_scale = 0\n"
                           "[dense tower]\nsize = 4096\noptimizer = sgd\nlr = 1\n";

static ps_config cfg;
static const char *urls[2];
static const char *ckpt;
static uint64_t keys[NK];
static pthread_barrier_t start;

/* A multiple of 1/64 in [-1/8, 1/8]: exact in float, and so is every sum and square of them. */
static float grad(uint32_t step, uint32_t worker, uint64_t slot, uint32_t dup, uint32_t j)
{
    uint64_t x =
        ((uint64_t)step << 44) ^ ((uint64_t)worker << 40) ^ (slot << 8) ^ ((uint64_t)dup << 5) ^ j;
    x *= 0x9e3779b97f4a7c15ull;
    x ^= x >> 31;
    return (float)((int)(x % 17) - 8) / 64.0f;
}

/* The gradient of key i, element j, as the shard receives it at (step, worker): duplicates
 * summed by the client (exact). */
static float pushed(uint32_t step, uint32_t worker, size_t i, uint32_t j)
{
    float g = grad(step, worker, i, 0, j);
    if (step % 2) g += grad(step, worker, i, 1, j);
    return g;
}

typedef struct worker_res {
    uint32_t id;
    int errors;
} worker_res;

static void *worker(void *arg)
{
    worker_res *r = arg;
    ps_client *c = pt_client(&cfg, urls, r->id, 20000);
    uint64_t *bk = malloc(2 * NK * sizeof *bk);
    float *g = malloc(2 * NK * DIM * sizeof *g), *rows = malloc(NK * DIM * sizeof *rows);
    float *dg = malloc(DSIZE * sizeof *dg);
    char *err = NULL;
    pthread_barrier_wait(&start);
    for (uint32_t t = 0; t < STEPS && r->errors == 0; t++) {
        size_t n = NK;
        memcpy(bk, keys, NK * sizeof *bk);
        for (size_t i = 0; i < NK; i++)
            for (uint32_t j = 0; j < DIM; j++)
                g[i * DIM + j] = grad(t, r->id, i, 0, j);
        if (t % 2) { /* every key again, in reverse order, with its second gradient */
            for (size_t i = 0; i < NK; i++) {
                bk[2 * NK - 1 - i] = keys[i];
                for (uint32_t j = 0; j < DIM; j++)
                    g[(2 * NK - 1 - i) * DIM + j] = grad(t, r->id, i, 1, j);
            }
            n = 2 * NK;
        }
        for (uint32_t tb = 0; tb < 2 && r->errors == 0; tb++)
            if (ps_client_pull(c, tb, keys, NK, rows, &err) != CM_OK ||
                ps_client_push(c, tb, bk, n, g, &err) != CM_OK)
                r->errors++;
        for (uint32_t i = 0; i < DSIZE; i++)
            dg[i] = grad(t, r->id, NK + i, 0, 0);
        if (r->errors == 0 && ps_client_dense_push(c, 0, dg, &err) != CM_OK) r->errors++;
    }
    /* Collective, so it waits for the other workers too: every push of all is applied. */
    if (r->errors == 0 && ps_client_save(c, ckpt, &err) != CM_OK) r->errors++;
    if (err) fprintf(stderr, "worker %u: %s\n", r->id, err);
    free(err);
    ps_client_destroy(c);
    free(bk);
    free(g);
    free(rows);
    free(dg);
    return NULL;
}

/* Expected per key: sgd weights (minus the sum) and adagrad accumulators (sum of squares). */
static float *want_w, *want_a;

typedef struct row_check {
    int is_ada;
    size_t rows, bad_updates, bad_values;
} row_check;

static int check_row(const emb_row *row, void *arg)
{
    row_check *rc = arg;
    size_t i = 0;
    while (i < NK && keys[i] != row->key)
        i++;
    rc->rows++;
    if (i == NK) return 0; /* counted as an extra row by the caller */
    rc->bad_updates += row->updates != (uint64_t)WORKERS * STEPS;
    for (uint32_t j = 0; j < DIM; j++)
        rc->bad_values += rc->is_ada ? row->state[j] != want_a[i * DIM + j]
                                     : row->weights[j] != want_w[i * DIM + j];
    return 0;
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_concurrent");
    pt_config(dir, "concurrent.ini", conf, &cfg);
    urls[0] = pt_ipc(dir, "s0");
    urls[1] = pt_ipc(dir, "s1");
    ckpt = pt_path(dir, "ckpt");
    ps_server *srv[2] = {pt_server(&cfg, urls[0], 0), pt_server(&cfg, urls[1], 1)};
    for (size_t i = 0; i < NK; i++)
        keys[i] = 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1); /* spread like hashed ids */

    want_w = calloc(NK * DIM, sizeof *want_w);
    want_a = calloc(NK * DIM, sizeof *want_a);
    float *want_d = calloc(DSIZE, sizeof *want_d);
    for (uint32_t t = 0; t < STEPS; t++)
        for (uint32_t w = 0; w < WORKERS; w++) {
            for (size_t i = 0; i < NK; i++)
                for (uint32_t j = 0; j < DIM; j++) {
                    float g = pushed(t, w, i, j);
                    want_w[i * DIM + j] -= g;
                    want_a[i * DIM + j] += g * g;
                }
            for (uint32_t i = 0; i < DSIZE; i++)
                want_d[i] -= grad(t, w, NK + i, 0, 0);
        }

    pthread_barrier_init(&start, NULL, WORKERS);
    pthread_t th[WORKERS];
    worker_res res[WORKERS];
    for (uint32_t w = 0; w < WORKERS; w++) {
        res[w] = (worker_res){.id = w};
        pthread_create(&th[w], NULL, worker, &res[w]);
    }
    for (uint32_t w = 0; w < WORKERS; w++)
        pthread_join(th[w], NULL);
    pthread_barrier_destroy(&start);
    for (uint32_t w = 0; w < WORKERS; w++)
        CHECK_MSG(res[w].errors == 0, "worker %u had %d errors", w, res[w].errors);

    /* Live values: the sgd rows and the dense block. */
    char *err = NULL;
    ps_client *c = pt_client(&cfg, urls, 0, 20000);
    float *rows = malloc(NK * DIM * sizeof *rows), *d = malloc(DSIZE * sizeof *d);
    CHECK_OK(ps_client_lookup(c, 0, keys, NK, rows, &err), err);
    size_t bad = 0;
    for (size_t i = 0; i < NK * DIM; i++)
        bad += rows[i] != want_w[i];
    CHECK_MSG(bad == 0, "%zu of %d sgd values are not minus the sum of their gradients", bad,
              NK * DIM);
    CHECK_OK(ps_client_dense_pull(c, 0, d, &err), err);
    bad = 0;
    for (size_t i = 0; i < DSIZE; i++)
        bad += d[i] != want_d[i];
    CHECK_MSG(bad == 0, "%zu of %d dense values are not minus the sum of the gradients", bad,
              DSIZE);
    ps_client_stats st;
    CHECK_OK(ps_client_stats_get(c, &st, &err), err);
    CHECK(st.shard_total.rows_pushed == 2ull * WORKERS * STEPS * NK);
    CHECK(st.shard_total.errors == 0 && st.shard_total.bad_messages == 0);
    CHECK_MSG(st.shard_total.elided > 0, "no elided push: the training path was not exercised");
    ps_client_destroy(c);

    /* Per-row update counts and adagrad accumulators, from the checkpoint. */
    for (int is_ada = 0; is_ada < 2; is_ada++) {
        row_check rc = {.is_ada = is_ada};
        CHECK_OK(ps_checkpoint_foreach_row(ckpt, is_ada ? "ada" : "sgd", check_row, &rc, &err),
                 err);
        CHECK_MSG(rc.rows == NK, "table %d: %zu rows, expected %d", is_ada, rc.rows, NK);
        CHECK_MSG(rc.bad_updates == 0, "table %d: %zu rows without %d updates", is_ada,
                  rc.bad_updates, WORKERS * STEPS);
        CHECK_MSG(rc.bad_values == 0, "table %d: %zu values differ from the exact sums", is_ada,
                  rc.bad_values);
    }

    free(rows);
    free(d);
    free(want_w);
    free(want_a);
    free(want_d);
    ps_server_destroy(srv[0]);
    ps_server_destroy(srv[1]);
    return pt_finish(dir);
}
