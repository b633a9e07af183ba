/* ember ps: serve one shard of every table in a cluster config, or print its memory plan. */
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps/ps.h"
#include "src/cli.h"

static ps_server *volatile running;

static void on_signal(int sig)
{
    (void)sig;
    if (running) ps_server_stop(running);
}

static void ps_usage(FILE *to)
{
    fprintf(to,
            "usage: ember ps --config FILE [--listen URL] [--shard I] [--shards N]\n"
            "       ember ps --config FILE --plan ROWS\n"
            "  --config FILE  cluster config (tables, dense blocks; see docs/PROTOCOL.md)\n"
            "  --listen URL   nng URL to serve on (default tcp://127.0.0.1:7400+I; loopback\n"
            "                 unless you name another address; tls+tcp:// uses [cluster] tls_*)\n"
            "  --shard I      which shard this process serves (default 0)\n"
            "  --shards N     override the config's shard count\n"
            "  --contexts K   requests served concurrently (default 64 + 2 x workers; shard 0\n"
            "                 needs more than 2 x workers: waiting clocks and barriers hold one)\n"
            "  --apply-threads N  threads one large pull or push is applied on (same results;\n"
            "                 default: half the cores, up to 8)\n"
            "  --replica URL  ship every applied update to this shard's backup at URL\n"
            "  --backup       serve as the backup of shard I (takes over when clients come)\n"
            "  --checkpoint-root DIR  SAVE and LOAD only within DIR (default: any path this\n"
            "                 process may write or read)\n"
            "  --plan ROWS    print each table's memory and disk cost for ROWS rows per shard\n"
            "                 (start_GiB: what a shard allocates at start, see reserve_rows)\n");
}

static int print_plan(const ps_config *cfg, uint64_t rows)
{
    printf("%-16s %6s %10s %14s %14s %14s %12s %12s %12s\n", "table", "dim", "row_bytes",
           "mem_bytes/row", "rows_in_mem", "rows_spilled", "mem_GiB", "disk_GiB", "start_GiB");
    for (uint32_t i = 0; i < cfg->n_tables; i++) {
        ps_plan_row p;
        ps_plan(cfg, i, rows, &p);
        printf("%-16s %6u %10" PRIu64 " %14.2f %14" PRIu64 " %14" PRIu64 " %12.3f %12.3f %12.3f\n",
               cfg->tables[i].name, cfg->tables[i].cfg.dim, p.row_bytes, p.mem_bytes_per_row,
               p.rows_in_memory, p.rows_spilled, p.mem_bytes / (1 << 30), p.disk_bytes / (1 << 30),
               p.initial_bytes / (1 << 30));
    }
    /* The workers' side: what int8 error feedback keeps in each of them. */
    for (uint32_t i = 0; i < cfg->n_tables; i++) {
        uint64_t r = ps_plan_resid_rows(cfg, i, 0);
        if (r > 0)
            printf("table %s pushes int8: each worker keeps error-feedback residuals for at most "
                   "%" PRIu64 " of its rows (ember train --residual-memory, default %llu MiB a "
                   "worker, shared by the int8 tables)\n",
                   cfg->tables[i].name, r, PS_RESID_MEMORY_DEFAULT >> 20);
    }
    return 0;
}

/* A whole decimal number for flag within lo..hi. An overflowing or out-of-range value is
 * refused by name (strtol would clamp 99999999999999999999 to LONG_MAX, and a cast would make a
 * shard of 2^32 shard 0), as is an empty one or one with junk after the digits. */
static int ps_arg_num(const char *flag, const char *s, long long lo, long long hi, long long *out)
{
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end != '\0' || isspace((unsigned char)*s)) {
        fprintf(stderr, "ember ps: bad number '%s' for %s\n", s, flag);
        return -1;
    }
    if (errno == ERANGE || v < lo || v > hi) {
        fprintf(stderr, "ember ps: %s %s out of range (%lld..%lld)\n", flag, s, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

int cmd_ps(int argc, char **argv)
{
    static const struct option opts[] = {
        {"config", required_argument, 0, 'c'},   {"listen", required_argument, 0, 'l'},
        {"shard", required_argument, 0, 's'},    {"shards", required_argument, 0, 'n'},
        {"contexts", required_argument, 0, 'k'}, {"apply-threads", required_argument, 0, 'a'},
        {"plan", required_argument, 0, 'p'},     {"replica", required_argument, 0, 'r'},
        {"backup", no_argument, 0, 'b'},         {"checkpoint-root", required_argument, 0, 'C'},
        {"help", no_argument, 0, 'h'},           {0, 0, 0, 0}};
    const char *config = NULL, *listen = NULL, *replica = NULL, *ckroot = NULL;
    bool backup = false;
    /* shards 0: the config's count; plan -1: serve. Given flags must be in range (--shards 0
     * is not "no override"). */
    long long shard = 0, shards = 0, contexts = 0, apply = 0, plan = -1;
    int o;
    optind = 1;
    while ((o = cli_getopt("ps", argc, argv, opts)) != -1) {
        int bad = 0;
        switch (o) {
        case 'c': config = optarg; break;
        case 'l': listen = optarg; break;
        case 'C':
            ckroot = optarg;
            break;
        case 's':
            bad = ps_arg_num("--shard", optarg, 0, PS_MAX_SHARDS - 1, &shard);
            break;
        case 'n':
            bad = ps_arg_num("--shards", optarg, 1, PS_MAX_SHARDS, &shards);
            break;
        case 'k':
            bad = ps_arg_num("--contexts", optarg, 0, 1024, &contexts);
            break;
        case 'a':
            bad = ps_arg_num("--apply-threads", optarg, 1, 256, &apply);
            break;
        case 'p':
            bad = ps_arg_num("--plan", optarg, 0, INT64_MAX, &plan);
            break;
        case 'r': replica = optarg; break;
        case 'b': backup = true; break;
        case 'h': ps_usage(stdout); return 0;
        default: ps_usage(stderr); return 2;
        }
        if (bad) return 2;
    }
    if (config == NULL || optind != argc || (backup && replica)) {
        fprintf(stderr, "ember ps: %s\n",
                config == NULL   ? "--config is required"
                : optind != argc ? "unexpected argument"
                                 : "--backup and --replica exclude each other");
        ps_usage(stderr);
        return 2;
    }
    ps_config *cfg = malloc(sizeof *cfg);
    char *err = NULL;
    if (cfg == NULL || ps_config_load(config, cfg, &err) != CM_OK) {
        fprintf(stderr, "ember ps: %s\n", err ? err : "out of memory");
        free(err);
        free(cfg);
        return 2;
    }
    if (shards > 0) cfg->n_shards = (uint32_t)shards;
    int rc = 0;
    if (plan >= 0) {
        rc = print_plan(cfg, (uint64_t)plan);
        free(cfg);
        return rc;
    }
    char url[64];
    if (listen == NULL) {
        snprintf(url, sizeof url, "tcp://127.0.0.1:%lld", 7400 + shard);
        listen = url;
    }
    ps_server_opts so = {.cfg = cfg,
                         .listen = listen,
                         .shard = (uint32_t)shard,
                         .n_contexts = (uint32_t)contexts,
                         .apply_threads =
                             (uint32_t)(apply > 0 ? apply : ps_apply_threads_default(1)),
                         .replica_url = replica,
                         .backup = backup,
                         .checkpoint_root = ckroot};
    ps_server *s = NULL;
    if (ps_server_create(&so, &s, &err) != CM_OK) {
        fprintf(stderr, "ember ps: shard %lld on %s: %s\n", shard, listen, err);
        free(err);
        free(cfg);
        return 1;
    }
    running = s;
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    fprintf(stderr, "ember ps: shard %lld of %u (%s) serving %u tables on %s\n", shard,
            cfg->n_shards,
            backup    ? "backup"
            : replica ? "primary, replicated"
                      : "primary",
            cfg->n_tables, listen);
    ps_server_wait(s);
    running = NULL;
    if (ps_server_fenced(s)) rc = 3;
    ps_server_stats st;
    ps_server_stats_get(s, &st);
    fprintf(stderr,
            "ember ps: shard %lld stopping: %" PRIu64 " requests, %" PRIu64 " errors, %" PRIu64
            " bad messages\n",
            shard, st.requests, st.errors, st.bad_messages);
    ps_server_destroy(s);
    free(cfg);
    return rc;
}
