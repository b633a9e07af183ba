/*
 * bench ps: parameter-server pull and push throughput against the transport's own limit.
 *
 * For 1, 2 and 4 `ember ps` processes over ipc:// and tcp://127.0.0.1, dim 16 rows, batches of
 * 40K distinct random 64-bit keys (hashed feature ids: ~7 bytes a key after delta-varint):
 *   - pull rows/s and GB/s of row payload (fp32 values returned), T client threads each with
 *     its own client and one blocking pull in flight (a pull fans out to every shard);
 *   - push rows/s for each push codec (fp32, fp16, int8) and the bytes on the wire per pushed
 *     row, keys and headers included (client push_bytes / rows pushed), with every push
 *     carrying its keys (a client with explicit_keys);
 *   - the same pushes as training sends them, each right after a pull of the same batch, so
 *     the push names that pull's key list instead of carrying keys (key elision): bytes per
 *     pushed row (PUSH messages only, headers included), and pushed rows/s of the pull + push
 *     loop;
 *   - raw nng: the same message sizes (what the pulls and pushes actually sent and received,
 *     per shard) between the same number of processes with the same requests in flight, served
 *     by a trivial rep server (this binary with --raw-server) that answers with a reply of the
 *     requested size and does nothing else: the transport limit a pull could reach.
 * Rows are created by an untimed pull of every batch first. PS and raw servers are children
 * killed and reaped on every exit path (tests/ps/ps_proc.h), the watchdog included.
 *
 * --cpu instead measures CPU-ns per pulled row with the server and a client in this process.
 *
 * Usage: tools/bench ps [--quick] [--cpu] [--threads T] [--ember PATH]   (default PATH: $EMBER_BIN,
 * else the ember next to this binary's build tree). Prints a table, then one JSON object.
 */
#include <inttypes.h>
#include <libgen.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <nng/protocol/reqrep0/req.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "tools/bench_util.h"
#include "ps/ps.h"
#include "tests/ps/ps_proc.h"

#define DIM 16u
#define BATCH 40000u
#define MAX_SHARDS 4u
#define MAX_THREADS 8u
#define HDR 56u /* wire header bytes (ps/wire.h is private to ps/) */

static const char *const codecs[3] = {"fp32", "fp16", "int8"};

typedef struct opts {
    int quick, cpu;
    uint32_t threads, batches;
    double seconds; /* per measurement */
    const char *ember;
} opts;

/* ---------------- raw rep server (child process) ---------------- */

typedef struct raw_ctx {
    nng_ctx ctx;
    nng_aio *aio;
    int sending;
} raw_ctx;

/* Each request's first 8 payload bytes say how big the reply must be. */
static void raw_cb(void *arg)
{
    raw_ctx *c = arg;
    int rv = nng_aio_result(c->aio);
    if (rv == NNG_ECLOSED) return;
    if (!c->sending && rv == 0) {
        nng_msg *req = nng_aio_get_msg(c->aio), *rep = NULL;
        uint64_t want = 0;
        if (nng_msg_len(req) >= 8) memcpy(&want, nng_msg_body(req), 8);
        nng_msg_free(req);
        if (want < 8 || want > (1u << 30) || nng_msg_alloc(&rep, want) != 0) want = 0;
        if (rep != NULL) {
            c->sending = 1;
            nng_aio_set_msg(c->aio, rep);
            nng_ctx_send(c->ctx, c->aio);
            return;
        }
    } else if (c->sending && rv != 0) {
        nng_msg_free(nng_aio_get_msg(c->aio));
    }
    c->sending = 0;
    nng_ctx_recv(c->ctx, c->aio);
}

static int raw_server(const char *url)
{
    enum { NCTX = 64 };
    static raw_ctx ctxs[NCTX];
    nng_socket s;
    if (nng_rep0_open(&s) != 0) return 1;
    nng_socket_set_size(s, NNG_OPT_RECVMAXSZ, 0); /* no limit */
    for (int i = 0; i < NCTX; i++)
        if (nng_aio_alloc(&ctxs[i].aio, raw_cb, &ctxs[i]) != 0 ||
            nng_ctx_open(&ctxs[i].ctx, s) != 0)
            return 1;
    int rv = nng_listen(s, url, NULL, 0);
    if (rv != 0) {
        fprintf(stderr, "raw server: cannot listen on %s: %s\n", url, nng_strerror(rv));
        return 1;
    }
    for (int i = 0; i < NCTX; i++)
        nng_ctx_recv(ctxs[i].ctx, ctxs[i].aio);
    for (;;)
        psp_sleep_ms(1000); /* killed by the parent */
}

/* ---------------- helpers ---------------- */

typedef struct cluster {
    uint32_t n;
    char urls[MAX_SHARDS][600];
    const char *url_ptrs[MAX_SHARDS];
    pid_t pids[MAX_SHARDS];
} cluster;

/* URLs for n servers: ipc sockets in dir, or free loopback ports. */
static void make_urls(cluster *cl, uint32_t n, int tcp, const char *dir, const char *tag)
{
    cl->n = n;
    for (uint32_t i = 0; i < n; i++) {
        if (tcp)
            snprintf(cl->urls[i], sizeof cl->urls[i], "tcp://127.0.0.1:%u", psp_free_port());
        else
            snprintf(cl->urls[i], sizeof cl->urls[i], "ipc://%s/%s%u", dir, tag, i);
        cl->url_ptrs[i] = cl->urls[i];
    }
}

static void cluster_wait(cluster *cl)
{
    for (uint32_t i = 0; i < cl->n; i++)
        if (psp_wait_ready(cl->pids[i], cl->urls[i], 20.0) != 0)
            bench_die("server did not come up", NULL);
}

static void cluster_stop(cluster *cl)
{
    for (uint32_t i = 0; i < cl->n; i++)
        psp_stop(cl->pids[i], SIGTERM, 5.0);
}

/* ---------------- timed loops ---------------- */

enum {
    OP_PULL,      /* pulls */
    OP_PUSH,      /* pushes with keys */
    OP_RAW_PULL,  /* raw nng, pull-shaped */
    OP_RAW_PUSH,  /* raw nng, push-shaped */
    OP_PULL_PUSH, /* pull then push of each batch: the push is elided */
};

typedef struct shared {
    const opts *o;
    const ps_config *cfg;
    cluster *cl;
    uint64_t *keys; /* batches x BATCH */
    float *grads;   /* BATCH x DIM */
    int op;         /* OP_* */
    uint32_t table;
    size_t raw_req[MAX_SHARDS], raw_rep[MAX_SHARDS];
    pthread_barrier_t start;
    double t0, deadline, t_end[MAX_THREADS];
    uint64_t calls[MAX_THREADS], sent[MAX_THREADS], recvd[MAX_THREADS], rows[MAX_THREADS];
} shared;

typedef struct targ {
    shared *sh;
    uint32_t id;
} targ;

static void *ps_thread(void *arg)
{
    targ *a = arg;
    shared *sh = a->sh;
    ps_client_opts co = {.cfg = sh->cfg,
                         .urls = sh->cl->url_ptrs,
                         /* each thread a worker of its own, as each training worker is:
                          * the PS keeps a few recent key lists per worker, and threads
                          * sharing one could push to a list the other's pulls pushed out
                          * (a fallback with keys, counted in the bytes a row) */
                         .worker = a->id,
                         .timeout_ms = 60000,
                         .explicit_keys = sh->op == OP_PUSH};
    ps_client *c = NULL;
    char *err = NULL;
    if (ps_client_create(&co, &c, &err) != CM_OK) bench_die("client", err);
    float *out = malloc((size_t)BATCH * DIM * sizeof *out);
    ps_client_stats s0, s1;
    pthread_barrier_wait(&sh->start);
    s0 = (ps_client_stats){0};
    uint64_t calls = 0;
    for (uint32_t b = a->id;; b++) {
        const uint64_t *k = sh->keys + (size_t)(b % sh->o->batches) * BATCH;
        int rc = sh->op == OP_PUSH ? CM_OK : ps_client_pull(c, sh->table, k, BATCH, out, &err);
        if (rc != CM_OK) bench_die("pull", err);
        if (sh->op != OP_PULL) rc = ps_client_push(c, sh->table, k, BATCH, sh->grads, &err);
        if (rc != CM_OK) bench_die("push", err);
        calls++;
        if (psp_now() >= sh->deadline) break;
    }
    if (ps_client_flush(c, &err) != CM_OK) bench_die("flush", err);
    sh->t_end[a->id] = psp_now();
    /* Client-side counters only (no STATS round trip needed): what went over the wire. */
    if (ps_client_stats_get(c, &s1, &err) != CM_OK) bench_die("stats", err);
    sh->calls[a->id] = calls;
    sh->rows[a->id] = sh->op == OP_PULL ? s1.rows_pulled : s1.rows_pushed;
    /* Pushes count PUSH messages only: the pull + push loop also sends pulls. */
    sh->sent[a->id] =
        sh->op == OP_PULL ? s1.bytes_sent - s0.bytes_sent : s1.push_bytes - s0.push_bytes;
    sh->recvd[a->id] = s1.bytes_received - s0.bytes_received;
    free(out);
    ps_client_destroy(c);
    return NULL;
}

/* One "call" = one request of the recorded size to every server at once, then all replies. */
static void *raw_thread(void *arg)
{
    targ *a = arg;
    shared *sh = a->sh;
    uint32_t n = sh->cl->n;
    nng_socket socks[MAX_SHARDS];
    nng_aio *aios[MAX_SHARDS];
    for (uint32_t i = 0; i < n; i++) {
        if (nng_req0_open(&socks[i]) != 0 || nng_aio_alloc(&aios[i], NULL, NULL) != 0)
            bench_die("raw socket", NULL);
        nng_socket_set_size(socks[i], NNG_OPT_RECVMAXSZ, 0);
        int rv = nng_dial(socks[i], sh->cl->urls[i], NULL, 0);
        if (rv != 0) bench_die("raw dial", strdup(nng_strerror(rv)));
    }
    pthread_barrier_wait(&sh->start);
    uint64_t calls = 0, sent = 0, recvd = 0;
    for (;;) {
        for (uint32_t i = 0; i < n; i++) {
            nng_msg *m;
            if (nng_msg_alloc(&m, sh->raw_req[i]) != 0) bench_die("raw alloc", NULL);
            uint64_t want = sh->raw_rep[i];
            memcpy(nng_msg_body(m), &want, 8);
            nng_aio_set_msg(aios[i], m);
            nng_send_aio(socks[i], aios[i]);
            sent += sh->raw_req[i];
        }
        for (uint32_t i = 0; i < n; i++) {
            nng_aio_wait(aios[i]);
            if (nng_aio_result(aios[i]) != 0)
                bench_die("raw send", strdup(nng_strerror(nng_aio_result(aios[i]))));
        }
        for (uint32_t i = 0; i < n; i++)
            nng_recv_aio(socks[i], aios[i]);
        for (uint32_t i = 0; i < n; i++) {
            nng_aio_wait(aios[i]);
            if (nng_aio_result(aios[i]) != 0)
                bench_die("raw recv", strdup(nng_strerror(nng_aio_result(aios[i]))));
            nng_msg *r = nng_aio_get_msg(aios[i]);
            recvd += nng_msg_len(r);
            nng_msg_free(r);
        }
        calls++;
        if (psp_now() >= sh->deadline) break;
    }
    sh->t_end[a->id] = psp_now();
    sh->calls[a->id] = calls;
    sh->rows[a->id] = calls * BATCH;
    sh->sent[a->id] = sent;
    sh->recvd[a->id] = recvd;
    for (uint32_t i = 0; i < n; i++) {
        nng_aio_free(aios[i]);
        nng_close(socks[i]);
    }
    return NULL;
}

typedef struct result {
    double rows_per_s, payload_gb_per_s, wire_bytes_per_row, sent_per_call, recvd_per_call;
} result;

static result measure(shared *sh)
{
    uint32_t t = sh->o->threads;
    pthread_t th[MAX_THREADS];
    targ args[MAX_THREADS];
    pthread_barrier_init(&sh->start, NULL, t + 1);
    for (uint32_t i = 0; i < t; i++) {
        args[i] = (targ){sh, i};
        pthread_create(&th[i], NULL,
                       sh->op == OP_RAW_PULL || sh->op == OP_RAW_PUSH ? raw_thread : ps_thread,
                       &args[i]);
    }
    sh->deadline = psp_now() + 1e9;
    /* Clients connect before the clock starts. */
    double now = psp_now();
    sh->t0 = now;
    sh->deadline = now + sh->o->seconds;
    pthread_barrier_wait(&sh->start);
    sh->t0 = psp_now();
    sh->deadline = sh->t0 + sh->o->seconds;
    for (uint32_t i = 0; i < t; i++)
        pthread_join(th[i], NULL);
    pthread_barrier_destroy(&sh->start);
    uint64_t rows = 0, sent = 0, recvd = 0, calls = 0;
    double end = sh->t0;
    for (uint32_t i = 0; i < t; i++) {
        rows += sh->rows[i];
        sent += sh->sent[i];
        recvd += sh->recvd[i];
        calls += sh->calls[i];
        if (sh->t_end[i] > end) end = sh->t_end[i];
    }
    double dt = end - sh->t0;
    result r;
    r.rows_per_s = (double)rows / dt;
    r.payload_gb_per_s = r.rows_per_s * DIM * 4 / 1e9; /* fp32 row values */
    r.wire_bytes_per_row =
        (double)(sh->op == OP_PULL || sh->op == OP_RAW_PULL ? recvd : sent) / (double)rows;
    r.sent_per_call = (double)sent / (double)calls;
    r.recvd_per_call = (double)recvd / (double)calls;
    return r;
}

/* ---------------- --cpu: CPU per pulled row, in one process ---------------- */

static double cpu_seconds(void)
{
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return (double)r.ru_utime.tv_sec + (double)r.ru_stime.tv_sec +
           1e-6 * (double)(r.ru_utime.tv_usec + r.ru_stime.tv_usec);
}

/* One shard and one client in this process over ipc, one pull of 40K distinct keys in flight:
 * the CPU both sides spend per pulled row (client split and scatter, server decode, lookup and
 * reply, the transport's copies), which the machine's other load hardly changes, unlike the
 * wall-clock rates above. Best of three rounds. */
static int cpu_mode(const opts *o, const char *dir)
{
    char cpath[600], url[700];
    snprintf(cpath, sizeof cpath, "%s/cpu.conf", dir);
    snprintf(url, sizeof url, "ipc://%s/cpu.ipc", dir);
    FILE *f = fopen(cpath, "w");
    if (f == NULL ||
        fprintf(f,
                "[cluster]\nshards = 1\nworkers = 1\n[table t]\ndim = %u\noptimizer = "
                "sgd\nlr = 0.01\n",
                DIM) < 0 ||
        fclose(f) != 0)
        bench_die("write config", NULL);
    ps_config cfg;
    char *err = NULL;
    bench_check(ps_config_load(cpath, &cfg, &err), err, "config");
    ps_server_opts so = {.cfg = &cfg, .listen = url, .shard = 0};
    ps_server *srv = NULL;
    bench_check(ps_server_create(&so, &srv, &err), err, "server");
    const char *urls[1] = {url};
    ps_client_opts co = {.cfg = &cfg, .urls = urls, .timeout_ms = 60000};
    ps_client *c = NULL;
    bench_check(ps_client_create(&co, &c, &err), err, "client");
    const uint32_t nb = o->batches, iters = o->quick ? 40 : 150;
    uint64_t *keys = bench_xmalloc((size_t)nb * BATCH * sizeof *keys);
    float *out = bench_xmalloc((size_t)BATCH * DIM * sizeof *out);
    for (size_t i = 0; i < (size_t)nb * BATCH; i++)
        keys[i] = bench_mix64(i + 777);
    for (uint32_t b = 0; b < nb; b++) /* create the rows, untimed */
        bench_check(ps_client_pull(c, 0, keys + (size_t)b * BATCH, BATCH, out, &err), err, "pull");
    double best_ns = 1e30, best_rate = 0;
    for (int round = 0; round < 3; round++) {
        double c0 = cpu_seconds(), t0 = psp_now();
        for (uint32_t i = 0; i < iters; i++)
            bench_check(ps_client_pull(c, 0, keys + (size_t)(i % nb) * BATCH, BATCH, out, &err),
                        err, "pull");
        double rows = (double)iters * BATCH, ns = (cpu_seconds() - c0) * 1e9 / rows;
        if (ns < best_ns) best_ns = ns, best_rate = rows / (psp_now() - t0);
    }
    ps_client_destroy(c);
    ps_server_destroy(srv);
    free(keys);
    free(out);
    printf("in-process pull, 1 shard over ipc, %u distinct keys a pull: %.1f CPU-ns a row (client "
           "+ server), %.2f M rows/s\n",
           BATCH, best_ns, best_rate / 1e6);
    printf(
        "{\"bench\":\"ps\",\"mode\":\"cpu\",\"dim\":%u,\"batch\":%u,\"pull_cpu_ns_per_row\":%.1f,"
        "\"pull_rows_per_s\":%.0f}\n",
        DIM, BATCH, best_ns, best_rate);
    return 0;
}

/* ---------------- main ---------------- */

typedef struct row {
    const char *transport;
    uint32_t shards;
    result pull, push[3], elided[3], raw_pull, raw_push;
} row;

static void default_ember(opts *o)
{
    o->ember = bench_ember_path();
}

int main(int argc, char **argv)
{
    bench_init("bench ps", psp_stop_all);
    cm_malloc_tune(); /* as in ember: the clients here and the raw server alike */
    if (argc == 3 && !strcmp(argv[1], "--raw-server")) return raw_server(argv[2]);
    opts o = {.threads = 2, .batches = 8, .seconds = 2.0};
    default_ember(&o);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            o.quick = 1;
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            o.threads = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ember") && i + 1 < argc)
            o.ember = argv[++i];
        else if (!strcmp(argv[i], "--cpu"))
            o.cpu = 1;
        else {
            fprintf(stderr, "usage: bench_ps [--quick] [--cpu] [--threads T] [--ember PATH]\n");
            return 2;
        }
    }
    if (o.threads < 1 || o.threads > MAX_THREADS) o.threads = 2;
    if (o.quick) {
        o.seconds = 0.4;
        o.batches = 4;
    }
    if (o.ember == NULL || access(o.ember, X_OK) != 0) {
        fprintf(stderr, "bench ps: no ember binary at %s (build it, or --ember PATH)\n",
                o.ember ? o.ember : "?");
        return 2;
    }
    psp_watchdog(o.quick ? 120 : 280);
    char self[4096], *serr = NULL;
    bench_check(cm_self_exe(self, sizeof self, &serr), serr, "own path");
    char dir[] = "/tmp/ember-bench-ps.XXXXXX";
    if (mkdtemp(dir) == NULL) bench_die("mkdtemp", NULL);
    if (o.cpu) {
        int rc = cpu_mode(&o, dir);
        char *err = NULL;
        if (cm_rmtree(dir, &err) != CM_OK) fprintf(stderr, "bench ps: %s\n", err);
        free(err);
        return rc;
    }

    uint64_t *keys = malloc((size_t)o.batches * BATCH * sizeof *keys);
    float *grads = malloc((size_t)BATCH * DIM * sizeof *grads);
    for (size_t i = 0; i < (size_t)o.batches * BATCH; i++)
        keys[i] = bench_mix64(i + 12345);
    for (size_t i = 0; i < (size_t)BATCH * DIM; i++)
        grads[i] = (float)((double)(bench_mix64(i) >> 11) / 0x1p53 - 0.5) * 1e-3f;

    const uint32_t shard_counts[3] = {1, 2, 4};
    row rows[6];
    int nrows = 0;
    printf("ps bench: dim %u, batches of %u distinct keys, %u client threads, %.1f s per "
           "measurement\n",
           DIM, BATCH, o.threads, o.seconds);
    printf("%-5s %6s  %-15s %12s %10s %12s %10s\n", "net", "shards", "op", "rows/s", "GB/s",
           "wire B/row", "vs raw");
    for (int tcp = 0; tcp < 2; tcp++)
        for (int si = 0; si < 3; si++) {
            row *r = &rows[nrows++];
            r->transport = tcp ? "tcp" : "ipc";
            r->shards = shard_counts[si];
            /* The cluster: one table per push codec, pulls in fp32. */
            char cpath[600], text[2048];
            snprintf(cpath, sizeof cpath, "%s/ps%u.conf", dir, r->shards);
            int len = snprintf(text, sizeof text, "[cluster]\nshards = %u\nworkers = %u\n",
                               r->shards, o.threads);
            for (int c = 0; c < 3; c++)
                len += snprintf(
                    text + len, sizeof text - (size_t)len,
                    "[table t_%s]\ndim = %u\noptimizer = sgd\nlr = 0.01\npush_codec = %s\n",
                    codecs[c], DIM, codecs[c]);
            FILE *f = fopen(cpath, "w");
            if (f == NULL || fputs(text, f) < 0 || fclose(f) != 0) bench_die("write config", NULL);
            ps_config cfg;
            char *err = NULL;
            if (ps_config_load(cpath, &cfg, &err) != CM_OK) bench_die("config", err);
            cluster cl;
            make_urls(&cl, r->shards, tcp, dir, "ps");
            for (uint32_t i = 0; i < cl.n; i++) {
                cl.pids[i] = psp_spawn(o.ember, cpath, i, cl.urls[i], NULL);
                if (cl.pids[i] < 0) bench_die("spawn ember ps", NULL);
            }
            cluster_wait(&cl);
            shared *sh = calloc(1, sizeof *sh);
            *sh = (shared){.o = &o, .cfg = &cfg, .cl = &cl, .keys = keys, .grads = grads};
            /* Warm-up: create every row of every table (untimed). */
            {
                ps_client_opts co = {.cfg = &cfg, .urls = cl.url_ptrs, .timeout_ms = 60000};
                ps_client *c = NULL;
                float *out = malloc((size_t)BATCH * DIM * sizeof *out);
                if (ps_client_create(&co, &c, &err) != CM_OK) bench_die("client", err);
                for (uint32_t t = 0; t < 3; t++)
                    for (uint32_t b = 0; b < o.batches; b++)
                        if (ps_client_pull(c, t, keys + (size_t)b * BATCH, BATCH, out, &err) !=
                            CM_OK)
                            bench_die("warm-up pull", err);
                ps_client_destroy(c);
                free(out);
            }
            sh->op = OP_PULL;
            sh->table = 0;
            r->pull = measure(sh);
            double pull_sent = r->pull.sent_per_call, pull_recvd = r->pull.recvd_per_call;
            for (uint32_t c = 0; c < 3; c++) {
                sh->op = OP_PUSH;
                sh->table = c;
                r->push[c] = measure(sh);
                sh->op = OP_PULL_PUSH;
                r->elided[c] = measure(sh);
            }
            double push_sent = r->push[0].sent_per_call;
            cluster_stop(&cl);

            /* Raw nng between the same number of processes, same per-shard sizes. */
            cluster raw;
            make_urls(&raw, r->shards, tcp, dir, "raw");
            for (uint32_t i = 0; i < raw.n; i++) {
                char *av[] = {self, "--raw-server", raw.urls[i], NULL};
                raw.pids[i] = psp_spawn_argv(av, raw.urls[i], NULL);
                if (raw.pids[i] < 0) bench_die("spawn raw server", NULL);
            }
            cluster_wait(&raw);
            sh->cl = &raw;
            for (uint32_t i = 0; i < raw.n; i++) {
                sh->raw_req[i] = (size_t)(pull_sent / raw.n);
                sh->raw_rep[i] = (size_t)(pull_recvd / raw.n);
            }
            sh->op = OP_RAW_PULL;
            r->raw_pull = measure(sh);
            for (uint32_t i = 0; i < raw.n; i++) {
                sh->raw_req[i] = (size_t)(push_sent / raw.n);
                sh->raw_rep[i] = HDR;
            }
            sh->op = OP_RAW_PUSH;
            r->raw_push = measure(sh);
            cluster_stop(&raw);
            free(sh);

            printf("%-5s %6u  %-15s %12.0f %10.3f %12.1f %9.0f%%\n", r->transport, r->shards,
                   "pull", r->pull.rows_per_s, r->pull.payload_gb_per_s, r->pull.wire_bytes_per_row,
                   100 * r->pull.payload_gb_per_s / r->raw_pull.payload_gb_per_s);
            printf("%-5s %6u  %-15s %12.0f %10.3f %12.1f\n", "", r->shards, "raw pull",
                   r->raw_pull.rows_per_s, r->raw_pull.payload_gb_per_s,
                   r->raw_pull.wire_bytes_per_row);
            for (int c = 0; c < 3; c++) {
                char name[16];
                snprintf(name, sizeof name, "push %s", codecs[c]);
                printf("%-5s %6u  %-15s %12.0f %10.3f %12.1f %9.0f%%\n", "", r->shards, name,
                       r->push[c].rows_per_s,
                       r->push[c].rows_per_s * r->push[c].wire_bytes_per_row / 1e9,
                       r->push[c].wire_bytes_per_row,
                       100 * r->push[c].rows_per_s / r->raw_push.rows_per_s);
            }
            for (int c = 0; c < 3; c++) {
                char name[24];
                snprintf(name, sizeof name, "pull+push %s", codecs[c]);
                printf("%-5s %6u  %-15s %12.0f %10.3f %12.1f  (elided)\n", "", r->shards, name,
                       r->elided[c].rows_per_s,
                       r->elided[c].rows_per_s * r->elided[c].wire_bytes_per_row / 1e9,
                       r->elided[c].wire_bytes_per_row);
            }
            printf("%-5s %6u  %-15s %12.0f %10.3f %12.1f\n", "", r->shards, "raw push",
                   r->raw_push.rows_per_s,
                   r->raw_push.rows_per_s * r->raw_push.wire_bytes_per_row / 1e9,
                   r->raw_push.wire_bytes_per_row);
            fflush(stdout);
        }
    char cmd[200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", dir);

    /* Headline: the best configuration for pulls and pushes, ratios from the same config. */
    int bp = 0, bq = 0;
    for (int i = 1; i < nrows; i++) {
        if (rows[i].pull.payload_gb_per_s > rows[bp].pull.payload_gb_per_s) bp = i;
        if (rows[i].push[0].rows_per_s > rows[bq].push[0].rows_per_s) bq = i;
    }
    const row *p = &rows[bp], *q = &rows[bq];
    /* Bytes per row: pushes as training sends them (elided: each names the pull before it),
     * and pushes with keys; each ratio compares like with like. */
    double b32 = q->elided[0].wire_bytes_per_row, b16 = q->elided[1].wire_bytes_per_row,
           b8 = q->elided[2].wire_bytes_per_row, k32 = q->push[0].wire_bytes_per_row,
           k16 = q->push[1].wire_bytes_per_row, k8 = q->push[2].wire_bytes_per_row;
    printf(
        "best pull: %s x%u; pull/raw %.2f; int8 push carries %.2fx fewer bytes per row than fp32 "
        "(elided keys; %.2fx with keys)\n",
        p->transport, p->shards, p->pull.payload_gb_per_s / p->raw_pull.payload_gb_per_s, b32 / b8,
        k32 / k8);
    printf("{\"bench\":\"ps\",\"dim\":%u,\"batch\":%u,\"threads\":%u,\"quick\":%s,"
           "\"pull_transport\":\"%s\",\"pull_shards\":%u,"
           "\"pull_rows_per_s\":%.0f,\"pull_gb_per_s\":%.4f,\"raw_nng_gb_per_s\":%.4f,"
           "\"pull_raw_ratio\":%.3f,\"push_rows_per_s\":%.0f,\"push_rows_per_s_fp16\":%.0f,"
           "\"push_rows_per_s_int8\":%.0f,\"push_transport\":\"%s\",\"push_shards\":%u,"
           "\"push_bytes_per_row_fp32\":%.2f,\"push_bytes_per_row_fp16\":%.2f,"
           "\"push_bytes_per_row_int8\":%.2f,\"int8_vs_fp32_bytes\":%.3f,"
           "\"push_bytes_per_row_fp32_keys\":%.2f,\"push_bytes_per_row_fp16_keys\":%.2f,"
           "\"push_bytes_per_row_int8_keys\":%.2f,\"int8_vs_fp32_bytes_keys\":%.3f}\n",
           DIM, BATCH, o.threads, o.quick ? "true" : "false", p->transport, p->shards,
           p->pull.rows_per_s, p->pull.payload_gb_per_s, p->raw_pull.payload_gb_per_s,
           p->pull.payload_gb_per_s / p->raw_pull.payload_gb_per_s, q->push[0].rows_per_s,
           q->push[1].rows_per_s, q->push[2].rows_per_s, q->transport, q->shards, b32, b16, b8,
           b32 / b8, k32, k16, k8, k32 / k8);
    free(keys);
    free(grads);
    return 0;
}
