/* The cluster config file (INI-style; the grammar is in ps.h) and the memory plan. */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps/dense.h"
#include "ps/ps.h"
#include "ps/wire.h"

void ps_config_init(ps_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->n_shards = 1;
    cfg->n_workers = 1;
    cfg->staleness = -1;
    cfg->max_msg_bytes = PS_MAX_MESSAGE_DEFAULT;
    cfg->replica_timeout_ms = 5000;
    snprintf(cfg->spill_dir, sizeof cfg->spill_dir, "/tmp/ember-spill");
}

static int parse_u64(const char *v, uint64_t *out)
{
    return cm_parse_size(v, out);
}

static int parse_float(const char *v, float *out)
{
    char *end;
    double x = strtod(v, &end);
    /* Finite as a float too: 1e39 is a finite double but an infinite float, which a dense
     * block's lr would then be. */
    if (end == v || *end != '\0' || !isfinite(x) || !isfinite((float)x)) return -1;
    *out = (float)x;
    return 0;
}

static int parse_i32(const char *v, int32_t *out)
{
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end != '\0' || x < INT32_MIN || x > INT32_MAX) return -1;
    *out = (int32_t)x;
    return 0;
}

static int parse_u32(const char *v, uint32_t *out)
{
    uint64_t x;
    if (parse_u64(v, &x) != 0 || x > UINT32_MAX) return -1;
    *out = (uint32_t)x;
    return 0;
}

/* An empty value is refused: every string here is a path or a name, and an empty path names
 * nothing. Taken as given, spill_dir = "" put each table's spill database at the root,
 * /shard-<s>/<name> (an absent spill_dir means /tmp/ember-spill), and an empty tls_ca asked for
 * no peer verification where the key's presence says one was meant. */
static int copy_str(char *dst, size_t n, const char *v)
{
    if (v[0] == '\0' || strlen(v) >= n) return -1;
    memcpy(dst, v, strlen(v) + 1);
    return 0;
}

/* Each section's keys, one list for the lookup and for the message that names them. */
enum {
    CK_SHARDS,
    CK_WORKERS,
    CK_STALENESS,
    CK_MAX_MESSAGE,
    CK_WORKER_TIMEOUT,
    CK_WORKER_LOST,
    CK_REPLICA_TIMEOUT,
    CK_SPILL_DIR,
    CK_TLS_CERT,
    CK_TLS_KEY,
    CK_TLS_CA,
    CK_N_
};
static const char *const cluster_keys[CK_N_] = {[CK_SHARDS] = "shards",
                                                [CK_WORKERS] = "workers",
                                                [CK_STALENESS] = "staleness",
                                                [CK_MAX_MESSAGE] = "max_message",
                                                [CK_WORKER_TIMEOUT] = "worker_timeout",
                                                [CK_WORKER_LOST] = "worker_lost",
                                                [CK_REPLICA_TIMEOUT] = "replica_timeout",
                                                [CK_SPILL_DIR] = "spill_dir",
                                                [CK_TLS_CERT] = "tls_cert",
                                                [CK_TLS_KEY] = "tls_key",
                                                [CK_TLS_CA] = "tls_ca"};

enum {
    TK_DIM,
    TK_OPTIMIZER,
    TK_LR,
    TK_L2,
    TK_EPS,
    TK_BETA1,
    TK_BETA2,
    TK_ADAGRAD_INIT,
    TK_FTRL_BETA,
    TK_FTRL_L1,
    TK_INIT_SCALE,
    TK_SEED,
    TK_MEMORY,
    TK_ADMIT,
    TK_TTL,
    TK_RESERVE_ROWS,
    TK_PUSH_CODEC,
    TK_PULL_CODEC,
    TK_N_
};
static const char *const table_keys[TK_N_] = {[TK_DIM] = "dim",
                                              [TK_OPTIMIZER] = "optimizer",
                                              [TK_LR] = "lr",
                                              [TK_L2] = "l2",
                                              [TK_EPS] = "eps",
                                              [TK_BETA1] = "beta1",
                                              [TK_BETA2] = "beta2",
                                              [TK_ADAGRAD_INIT] = "adagrad_init",
                                              [TK_FTRL_BETA] = "ftrl_beta",
                                              [TK_FTRL_L1] = "ftrl_l1",
                                              [TK_INIT_SCALE] = "init_scale",
                                              [TK_SEED] = "seed",
                                              [TK_MEMORY] = "memory",
                                              [TK_ADMIT] = "admit",
                                              [TK_TTL] = "ttl",
                                              [TK_RESERVE_ROWS] = "reserve_rows",
                                              [TK_PUSH_CODEC] = "push_codec",
                                              [TK_PULL_CODEC] = "pull_codec"};

enum { DK_SIZE, DK_LR, DK_BETA1, DK_BETA2, DK_EPS, DK_OPTIMIZER, DK_N_ };
static const char *const dense_keys[DK_N_] = {
    [DK_SIZE] = "size",   [DK_LR] = "lr",   [DK_BETA1] = "beta1",
    [DK_BETA2] = "beta2", [DK_EPS] = "eps", [DK_OPTIMIZER] = "optimizer"};

/* The setters: 0 set, -1 a bad value, 1 not a key of the section. */
static int set_cluster(ps_config *c, const char *k, const char *v)
{
    switch (cm_ini_key_find(k, cluster_keys, CK_N_)) {
    case CK_SHARDS:
        return parse_u32(v, &c->n_shards);
    case CK_WORKERS:
        return parse_u32(v, &c->n_workers);
    case CK_STALENESS:
        return parse_i32(v, &c->staleness);
    case CK_MAX_MESSAGE:
        return parse_u64(v, &c->max_msg_bytes);
    case CK_WORKER_TIMEOUT:
        return parse_u32(v, &c->worker_timeout_ms);
    case CK_WORKER_LOST:
        return parse_u32(v, &c->worker_lost_ms);
    case CK_REPLICA_TIMEOUT:
        return parse_u32(v, &c->replica_timeout_ms);
    case CK_SPILL_DIR:
        return copy_str(c->spill_dir, sizeof c->spill_dir, v);
    case CK_TLS_CERT:
        return copy_str(c->tls_cert, sizeof c->tls_cert, v);
    case CK_TLS_KEY:
        return copy_str(c->tls_key, sizeof c->tls_key, v);
    case CK_TLS_CA:
        return copy_str(c->tls_ca, sizeof c->tls_ca, v);
    default:
        return 1;
    }
}

static int set_table(ps_table_spec *t, const char *k, const char *v)
{
    emb_table_config *c = &t->cfg;
    switch (cm_ini_key_find(k, table_keys, TK_N_)) {
    case TK_DIM:
        return parse_u32(v, &c->dim);
    case TK_OPTIMIZER:
        return emb_opt_parse(v, &c->opt) == CM_OK ? 0 : -1;
    case TK_LR:
        return parse_float(v, &c->lr);
    case TK_L2:
        return parse_float(v, &c->l2);
    case TK_EPS:
        return parse_float(v, &c->eps);
    case TK_BETA1:
        return parse_float(v, &c->beta1);
    case TK_BETA2:
        return parse_float(v, &c->beta2);
    case TK_ADAGRAD_INIT:
        return parse_float(v, &c->adagrad_init);
    case TK_FTRL_BETA:
        return parse_float(v, &c->ftrl_beta);
    case TK_FTRL_L1:
        return parse_float(v, &c->ftrl_l1);
    case TK_INIT_SCALE:
        return parse_float(v, &c->init_scale);
    case TK_SEED:
        return parse_u64(v, &c->seed);
    case TK_MEMORY:
        return parse_u64(v, &c->mem_budget_bytes);
    case TK_ADMIT:
        return parse_u32(v, &c->admit_threshold);
    case TK_TTL:
        return parse_u64(v, &c->ttl_steps);
    case TK_RESERVE_ROWS:
        return parse_u64(v, &c->reserve_rows);
    case TK_PUSH_CODEC:
        return ps_codec_parse(v, &t->push_codec) == CM_OK ? 0 : -1;
    case TK_PULL_CODEC:
        return ps_codec_parse(v, &t->pull_codec) == CM_OK ? 0 : -1;
    default:
        return 1;
    }
}

static int set_dense(ps_dense_spec *d, const char *k, const char *v)
{
    switch (cm_ini_key_find(k, dense_keys, DK_N_)) {
    case DK_SIZE:
        return parse_u64(v, &d->size);
    case DK_LR:
        return parse_float(v, &d->lr);
    case DK_BETA1:
        return parse_float(v, &d->beta1);
    case DK_BETA2:
        return parse_float(v, &d->beta2);
    case DK_EPS:
        return parse_float(v, &d->eps);
    case DK_OPTIMIZER:
        return ps_dense_opt_parse(v, &d->opt) == CM_OK ? 0 : -1;
    default:
        return 1;
    }
}

static const char *const dense_opt_names[] = {"adam", "adagrad", "sgd"};

int ps_dense_opt_parse(const char *name, ps_dense_opt *out)
{
    for (size_t i = 0; name != NULL && i < 3; i++)
        if (strcmp(name, dense_opt_names[i]) == 0) {
            *out = (ps_dense_opt)i;
            return CM_OK;
        }
    return CM_EINVAL;
}

const char *ps_dense_opt_name(ps_dense_opt opt)
{
    return (unsigned)opt < 3 ? dense_opt_names[opt] : "unknown";
}

static void dense_spec_init(ps_dense_spec *d)
{
    memset(d, 0, sizeof *d);
    d->opt = PS_DENSE_ADAM;
    d->lr = 0.001f;
    d->beta1 = 0.9f;
    d->beta2 = 0.999f;
    d->eps = 1e-8f;
}

/* A parse in progress: the config, and the line of each section's header, for a required key
 * that is only known to be missing once the whole file has been read. */
typedef struct config_parse {
    ps_config *cfg;
    int table_line[PS_MAX_TABLES], dense_line[PS_MAX_DENSE];
} config_parse;

/* The cm_ini_parse callback: sections open tables and dense blocks, keys fill them. */
static int config_entry(void *arg, int line, const char *section, const char *sarg, const char *k,
                        const char *v, char **errptr)
{
    config_parse *cp = arg;
    ps_config *cfg = cp->cfg;
    bool table = !strcmp(section, "table"), dense = !strcmp(section, "dense");
    if (k == NULL) {
        if (!strcmp(section, "cluster") && *sarg == '\0') return CM_OK;
        if (!(table || dense) || *sarg == '\0')
            return cm_ini_unknown_section(errptr, section, sarg, "cluster, table NAME, dense NAME");
        uint32_t *n = table ? &cfg->n_tables : &cfg->n_dense;
        if (*n >= (table ? PS_MAX_TABLES : PS_MAX_DENSE) || strlen(sarg) >= PS_NAME_MAX)
            return cm_err(errptr, CM_EINVAL, "too many %s sections or name too long", section);
        for (uint32_t i = 0; i < *n; i++)
            if (!strcmp(table ? cfg->tables[i].name : cfg->dense[i].name, sarg))
                return cm_err(errptr, CM_EINVAL, "duplicate %s '%s'", section, sarg);
        if (table) {
            ps_table_spec *t = &cfg->tables[*n];
            memset(t, 0, sizeof *t);
            emb_table_config_init(&t->cfg);
            t->cfg.dim = 0; /* required */
            copy_str(t->name, sizeof t->name, sarg);
            cp->table_line[*n] = line;
        } else {
            dense_spec_init(&cfg->dense[*n]);
            copy_str(cfg->dense[*n].name, sizeof cfg->dense[*n].name, sarg);
            cp->dense_line[*n] = line;
        }
        (*n)++;
        return CM_OK;
    }
    if (!*section) return cm_ini_key_outside(errptr, k, "[cluster], [table NAME] or [dense NAME]");
    int r = 1;
    if (!strcmp(section, "cluster"))
        r = set_cluster(cfg, k, v);
    else if (table)
        r = set_table(&cfg->tables[cfg->n_tables - 1], k, v);
    else if (dense)
        r = set_dense(&cfg->dense[cfg->n_dense - 1], k, v);
    if (r > 0) {
        char where[PS_NAME_MAX + 16];
        snprintf(where, sizeof where, "[%s%s%s]", section, *sarg ? " " : "", sarg);
        return table   ? cm_ini_unknown_key(errptr, k, where, table_keys, TK_N_)
               : dense ? cm_ini_unknown_key(errptr, k, where, dense_keys, DK_N_)
                       : cm_ini_unknown_key(errptr, k, where, cluster_keys, CK_N_);
    }
    if (r < 0) return cm_err(errptr, CM_EINVAL, "bad value '%s' for %s", v, k);
    return CM_OK;
}

int ps_config_load(const char *path, ps_config *cfg, char **errptr)
{
    ps_config_init(cfg);
    config_parse cp = {.cfg = cfg};
    int rc = cm_ini_parse(path, config_entry, &cp, errptr);
    /* A table's dim and a dense block's size are required: name the section that lacks one
     * (before the range checks below, which would only say "dim 0" or "size 0 out of range",
     * naming no line). */
    for (uint32_t i = 0; rc == CM_OK && i < cfg->n_tables; i++)
        if (cfg->tables[i].cfg.dim == 0)
            rc = cm_err(errptr, CM_EINVAL, "%s:%d: table '%s' has no dim", path, cp.table_line[i],
                        cfg->tables[i].name);
    for (uint32_t i = 0; rc == CM_OK && i < cfg->n_dense; i++)
        if (cfg->dense[i].size == 0)
            rc = cm_err(errptr, CM_EINVAL, "%s:%d: dense '%s' has no size", path, cp.dense_line[i],
                        cfg->dense[i].name);
    if (rc == CM_OK) {
        char *err = NULL;
        rc = ps_config_check(cfg, &err);
        if (rc != CM_OK) cm_err(errptr, rc, "%s: %s", path, err);
        free(err);
    }
    return rc;
}

/* Table and dense names become file and directory names (a table's spill database is
 * <spill_dir>/shard-<s>/<name>, which the server deletes when it stops; checkpoint files are
 * named after them): only a plain file name is safe, never "..", a path or a hidden name. */
bool ps_name_ok(const char *name)
{
    if (name[0] == '\0' || name[0] == '.') return false;
    for (const char *p = name; *p; p++)
        if (!(isalnum((unsigned char)*p) || *p == '_' || *p == '-' || *p == '.')) return false;
    return true;
}

int ps_config_check(const ps_config *cfg, char **errptr)
{
    for (uint32_t i = 0; i < cfg->n_tables + cfg->n_dense; i++) {
        bool tab = i < cfg->n_tables;
        const char *name = tab ? cfg->tables[i].name : cfg->dense[i - cfg->n_tables].name;
        if (!ps_name_ok(name))
            return cm_err(errptr, CM_EINVAL,
                          "%s name '%s' is not a plain name (letters, digits, '_', '-', '.'; "
                          "not starting with '.'): it names files on disk",
                          tab ? "table" : "dense", name);
    }
    if (cfg->n_shards == 0 || cfg->n_shards > PS_MAX_SHARDS)
        return cm_err(errptr, CM_EINVAL, "shards %u out of range 1..%u", cfg->n_shards,
                      PS_MAX_SHARDS);
    if (cfg->n_workers == 0 || cfg->n_workers > PS_MAX_WORKERS)
        return cm_err(errptr, CM_EINVAL, "workers %u out of range 1..%u", cfg->n_workers,
                      PS_MAX_WORKERS);
    if (cfg->staleness < -1) return cm_err(errptr, CM_EINVAL, "staleness %d < -1", cfg->staleness);
    if (cfg->max_msg_bytes < 4096)
        return cm_err(errptr, CM_EINVAL, "max_message %llu is below 4096 bytes",
                      (unsigned long long)cfg->max_msg_bytes);
    /* The server hands it to nng as an nng_duration, int32 milliseconds where -1 means "wait
     * forever" and 0 "do not wait": 4294967295 turned the timeout off, and 0 gave the backup no
     * time to acknowledge anything. */
    if (cfg->replica_timeout_ms == 0 || cfg->replica_timeout_ms > INT32_MAX)
        return cm_err(errptr, CM_EINVAL, "replica_timeout %u ms out of range 1..%d",
                      cfg->replica_timeout_ms, INT32_MAX);
    for (uint32_t i = 0; i < cfg->n_tables; i++) {
        const ps_table_spec *t = &cfg->tables[i];
        emb_table_config c = t->cfg;
        if (c.mem_budget_bytes > 0) c.spill_path = "(per shard)";
        char *err = NULL;
        int rc = emb_table_config_check(&c, &err);
        if (rc != CM_OK) {
            rc = cm_err(errptr, rc, "table '%s': %s", t->name, err);
            free(err);
            return rc;
        }
    }
    for (uint32_t i = 0; i < cfg->n_dense; i++) {
        const ps_dense_spec *d = &cfg->dense[i];
        if (d->size == 0 || d->size > (1ull << 32))
            return cm_err(errptr, CM_EINVAL, "dense '%s': size %llu out of range 1..2^32", d->name,
                          (unsigned long long)d->size);
        if (!(d->lr >= 0) || !(d->beta1 >= 0 && d->beta1 < 1) || !(d->beta2 >= 0 && d->beta2 < 1) ||
            !(d->eps > 0))
            return cm_err(errptr, CM_EINVAL, "dense '%s': bad optimizer parameters", d->name);
        /* Its largest message, the whole state a mirroring client pulls, must pass the
         * receive limit, or every such pull would fail at run time. */
        uint64_t need = (uint64_t)ps_dense_state_bytes(d) + PS_HDR_BYTES;
        if (need > cfg->max_msg_bytes)
            return cm_err(errptr, CM_EINVAL,
                          "dense '%s': its state of %llu bytes (with the message header) exceeds "
                          "max_message %llu: raise max_message or split the block",
                          d->name, (unsigned long long)need,
                          (unsigned long long)cfg->max_msg_bytes);
    }
    return CM_OK;
}

void ps_plan(const ps_config *cfg, uint32_t table, uint64_t rows, ps_plan_row *out)
{
    const emb_table_config *c = &cfg->tables[table].cfg;
    memset(out, 0, sizeof *out);
    out->row_bytes = emb_row_bytes(c);
    out->mem_bytes_per_row = emb_row_mem_bytes(c);
    emb_table_plan p;
    emb_table_plan_rows(c, rows, &p);
    out->rows_in_memory = p.rows_mem;
    out->rows_spilled = p.rows_spilled;
    out->mem_bytes = p.bytes_mem;
    /* RocksDB stores each spilled record uncompressed with an 8-byte key and ~20 bytes of
     * per-entry overhead in its SST format. */
    out->disk_bytes = (double)out->rows_spilled * (double)(out->row_bytes + 8 + 20);
    out->initial_bytes = (double)emb_table_initial_bytes(c);
}
