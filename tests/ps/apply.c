/*
 * A PS whose shards apply large requests on a team of threads (ps_server_opts.apply_threads)
 * answers and stores exactly what one-thread shards do: two clusters of two in-process shards,
 * one with apply_threads 4 and one with 1, get the same sequence of large pulls and pushes
 * (12K keys a call, so every shard's share fans out; plain and elided pushes, new and known
 * keys, an Adagrad table and one with admission), then a SAVE, more updates, a LOAD of the
 * saved cut (the restored tables take the team again) and more updates. Every pull's rows must
 * be the same bits, and both clusters' checkpoints the same rows, step and optimizer state.
 * A bad apply_threads (over 256) is refused at create.
 */
#include "ps_test_util.h"
#include "rng.h"

#define DIM 16u
#define N 12000u

static const char conf[] = "[cluster]\nshards = 2\nworkers = 1\n"
                           "[table emb]\ndim = 16\noptimizer = adagrad\nlr = 0.05\n"
                           "[table adm]\ndim = 16\noptimizer = adagrad\nlr = 0.05\n"
                           "admit = 2\n";

typedef struct cluster {
    ps_server *srv[2];
    const char *urls[2];
    ps_client *c;
} cluster;

static void cluster_start(cluster *k, const ps_config *cfg, const char *dir, const char *tag,
                          uint32_t threads)
{
    char name[64];
    for (uint32_t s = 0; s < 2; s++) {
        snprintf(name, sizeof name, "%s-%u", tag, s);
        k->urls[s] = pt_ipc(dir, name);
        ps_server_opts o = {.cfg = cfg, .listen = k->urls[s], .shard = s, .apply_threads = threads};
        k->srv[s] = pt_server_with(&o);
    }
    k->c = pt_client(cfg, k->urls, 0, 20000);
}

static void cluster_stop(cluster *k)
{
    ps_client_destroy(k->c);
    for (uint32_t s = 0; s < 2; s++)
        ps_server_destroy(k->srv[s]);
}

/* One round on both clusters: keys half from a small hot set (seen again, and admitted),
 * half new, a pull of each table compared bit for bit, then a push of gradients. */
static void round_both(cluster *a, cluster *b, uint32_t round, uint64_t *keys, float *ra, float *rb,
                       float *g)
{
    for (uint32_t i = 0; i < N; i++) /* repeats within a call are merged by the client */
        keys[i] = i % 2 ? 1000000u * (round + 1) + i : rndu(4000) * 2 + 1;
    for (uint32_t i = 0; i < N * DIM; i++)
        g[i] = (float)((int)rndu(2001) - 1000) * 1e-4f;
    char *err = NULL;
    for (uint32_t t = 0; t < 2; t++) {
        CHECK_OK(ps_client_pull(a->c, t, keys, N, ra, &err), err);
        CHECK_OK(ps_client_pull(b->c, t, keys, N, rb, &err), err);
        CHECK_MSG(memcmp(ra, rb, (size_t)N * DIM * sizeof(float)) == 0,
                  "round %u table %u: the pulls differ", round, t);
        CHECK_OK(ps_client_push(a->c, t, keys, N, g, &err), err);
        CHECK_OK(ps_client_push(b->c, t, keys, N, g, &err), err);
    }
    CHECK_OK(ps_client_flush(a->c, &err), err);
    CHECK_OK(ps_client_flush(b->c, &err), err);
}

/* Every row of a table in a checkpoint, sorted by key. */
typedef struct row {
    emb_row r;
    float w[2 * DIM]; /* weights, then the Adagrad state */
} row;
typedef struct rows {
    row *v;
    size_t n, cap;
} rows;

static int collect(const emb_row *r, void *arg)
{
    rows *x = arg;
    if (x->n == x->cap) {
        x->cap = x->cap ? 2 * x->cap : 1024;
        x->v = realloc(x->v, x->cap * sizeof *x->v);
    }
    row *o = &x->v[x->n++];
    o->r = *r;
    o->r.weights = o->r.state = NULL;
    memcpy(o->w, r->weights, DIM * sizeof(float));
    memcpy(o->w + DIM, r->state, DIM * sizeof(float));
    return 0;
}

static int by_key(const void *p, const void *q)
{
    const row *a = p, *b = q;
    return (a->r.key > b->r.key) - (a->r.key < b->r.key);
}

static void same_checkpoints(const char *ca, const char *cb)
{
    const char *tables[] = {"emb", "adm"};
    for (int t = 0; t < 2; t++) {
        rows x = {0}, y = {0};
        char *err = NULL;
        CHECK_OK(ps_checkpoint_foreach_row(ca, tables[t], collect, &x, &err), err);
        CHECK_OK(ps_checkpoint_foreach_row(cb, tables[t], collect, &y, &err), err);
        CHECK_MSG(x.n == y.n && x.n > 1000, "table %s: %zu and %zu rows", tables[t], x.n, y.n);
        if (x.n > 0) qsort(x.v, x.n, sizeof *x.v, by_key);
        if (y.n > 0) qsort(y.v, y.n, sizeof *y.v, by_key);
        size_t bad = 0;
        for (size_t i = 0; i < x.n && i < y.n; i++)
            bad += x.v[i].r.key != y.v[i].r.key || x.v[i].r.updates != y.v[i].r.updates ||
                   x.v[i].r.last_step != y.v[i].r.last_step ||
                   memcmp(x.v[i].w, y.v[i].w, sizeof x.v[i].w) != 0;
        CHECK_MSG(bad == 0, "table %s: %zu of %zu rows differ", tables[t], bad, x.n);
        free(x.v);
        free(y.v);
    }
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_apply");
    ps_config cfg;
    pt_config(dir, "ps.conf", conf, &cfg);
    {
        ps_server_opts o = {.cfg = &cfg, .listen = pt_ipc(dir, "bad"), .apply_threads = 257};
        ps_server *s = NULL;
        char *err = NULL;
        CHECK(ps_server_create(&o, &s, &err) == CM_EINVAL && s == NULL && err &&
              strstr(err, "apply_threads"));
        free(err);
    }
    cluster a, b;
    cluster_start(&a, &cfg, dir, "team", 4);
    cluster_start(&b, &cfg, dir, "one", 1);
    uint64_t *keys = malloc(N * sizeof *keys);
    float *ra = malloc((size_t)N * DIM * sizeof *ra), *rb = malloc((size_t)N * DIM * sizeof *rb);
    float *g = malloc((size_t)N * DIM * sizeof *g);
    uint32_t round = 0;
    for (; round < 4; round++)
        round_both(&a, &b, round, keys, ra, rb, g);
    char *err = NULL;
    const char *ca = pt_path(dir, "ckpt-team"), *cb = pt_path(dir, "ckpt-one");
    CHECK_OK(ps_client_save(a.c, ca, &err), err);
    CHECK_OK(ps_client_save(b.c, cb, &err), err);
    same_checkpoints(ca, cb);
    for (; round < 6; round++)
        round_both(&a, &b, round, keys, ra, rb, g);
    /* Back to the cut; the restored tables are fanned out again. */
    CHECK_OK(ps_client_load(a.c, ca, &err), err);
    CHECK_OK(ps_client_load(b.c, cb, &err), err);
    for (; round < 9; round++)
        round_both(&a, &b, round, keys, ra, rb, g);
    const char *ca2 = pt_path(dir, "ckpt-team2"), *cb2 = pt_path(dir, "ckpt-one2");
    CHECK_OK(ps_client_save(a.c, ca2, &err), err);
    CHECK_OK(ps_client_save(b.c, cb2, &err), err);
    same_checkpoints(ca2, cb2);
    cluster_stop(&a);
    cluster_stop(&b);
    free(keys);
    free(ra);
    free(rb);
    free(g);
    return pt_finish(dir);
}
