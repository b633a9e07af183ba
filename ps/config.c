/* The cluster config file (INI-style; the grammar is in ps.h) and the memory plan. */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps/ps.h"

void ps_config_init(ps_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->n_shards = 1;
    cfg->n_workers = 1;
    cfg->staleness = -1;
    cfg->max_msg_bytes = 256u << 20;
    snprintf(cfg->spill_dir, sizeof cfg->spill_dir, "/tmp/ember-spill");
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s)) s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1])) *--e = '\0';
    return s;
}

static int parse_u64(const char *v, uint64_t *out)
{
    char *end;
    errno = 0;
    if (*v == '-') return -1;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || end == v) return -1;
    uint64_t mult = 1;
    if (*end == 'K' || *end == 'k') mult = 1ull << 10, end++;
    else if (*end == 'M' || *end == 'm') mult = 1ull << 20, end++;
    else if (*end == 'G' || *end == 'g') mult = 1ull << 30, end++;
    else if (*end == 'T' || *end == 't') mult = 1ull << 40, end++;
    if (*end != '\0' || (x != 0 && mult > UINT64_MAX / x)) return -1;
    *out = x * mult;
    return 0;
}

static int parse_float(const char *v, float *out)
{
    char *end;
    double x = strtod(v, &end);
    if (end == v || *end != '\0' || !isfinite(x)) return -1;
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

static int copy_str(char *dst, size_t n, const char *v)
{
    if (strlen(v) >= n) return -1;
    memcpy(dst, v, strlen(v) + 1);
    return 0;
}

enum section { SEC_NONE, SEC_CLUSTER, SEC_TABLE, SEC_DENSE };

static int set_cluster(ps_config *c, const char *k, const char *v)
{
    if (!strcmp(k, "shards")) return parse_u32(v, &c->n_shards);
    if (!strcmp(k, "workers")) return parse_u32(v, &c->n_workers);
    if (!strcmp(k, "staleness")) return parse_i32(v, &c->staleness);
    if (!strcmp(k, "max_message")) return parse_u64(v, &c->max_msg_bytes);
    if (!strcmp(k, "spill_dir")) return copy_str(c->spill_dir, sizeof c->spill_dir, v);
    if (!strcmp(k, "tls_cert")) return copy_str(c->tls_cert, sizeof c->tls_cert, v);
    if (!strcmp(k, "tls_key")) return copy_str(c->tls_key, sizeof c->tls_key, v);
    if (!strcmp(k, "tls_ca")) return copy_str(c->tls_ca, sizeof c->tls_ca, v);
    return 1;
}

static int set_table(ps_table_spec *t, const char *k, const char *v)
{
    emb_table_config *c = &t->cfg;
    if (!strcmp(k, "dim")) return parse_u32(v, &c->dim);
    if (!strcmp(k, "optimizer")) return emb_opt_parse(v, &c->opt) == CM_OK ? 0 : -1;
    if (!strcmp(k, "lr")) return parse_float(v, &c->lr);
    if (!strcmp(k, "l2")) return parse_float(v, &c->l2);
    if (!strcmp(k, "eps")) return parse_float(v, &c->eps);
    if (!strcmp(k, "beta1")) return parse_float(v, &c->beta1);
    if (!strcmp(k, "beta2")) return parse_float(v, &c->beta2);
    if (!strcmp(k, "adagrad_init")) return parse_float(v, &c->adagrad_init);
    if (!strcmp(k, "ftrl_beta")) return parse_float(v, &c->ftrl_beta);
    if (!strcmp(k, "ftrl_l1")) return parse_float(v, &c->ftrl_l1);
    if (!strcmp(k, "init_scale")) return parse_float(v, &c->init_scale);
    if (!strcmp(k, "seed")) return parse_u64(v, &c->seed);
    if (!strcmp(k, "memory")) return parse_u64(v, &c->mem_budget_bytes);
    if (!strcmp(k, "admit")) return parse_u32(v, &c->admit_threshold);
    if (!strcmp(k, "ttl")) return parse_u64(v, &c->ttl_steps);
    if (!strcmp(k, "push_codec")) return ps_codec_parse(v, &t->push_codec) == CM_OK ? 0 : -1;
    if (!strcmp(k, "pull_codec")) return ps_codec_parse(v, &t->pull_codec) == CM_OK ? 0 : -1;
    return 1;
}

static int set_dense(ps_dense_spec *d, const char *k, const char *v)
{
    if (!strcmp(k, "size")) return parse_u64(v, &d->size);
    if (!strcmp(k, "lr")) return parse_float(v, &d->lr);
    if (!strcmp(k, "beta1")) return parse_float(v, &d->beta1);
    if (!strcmp(k, "beta2")) return parse_float(v, &d->beta2);
    if (!strcmp(k, "eps")) return parse_float(v, &d->eps);
    if (!strcmp(k, "optimizer")) {
        if (!strcmp(v, "adam")) d->opt = PS_DENSE_ADAM;
        else if (!strcmp(v, "adagrad")) d->opt = PS_DENSE_ADAGRAD;
        else if (!strcmp(v, "sgd")) d->opt = PS_DENSE_SGD;
        else return -1;
        return 0;
    }
    return 1;
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

int ps_config_load(const char *path, ps_config *cfg, char **errptr)
{
    ps_config_init(cfg);
    FILE *f = fopen(path, "r");
    if (f == NULL) return cm_err_errno(errptr, CM_ENOTFOUND, "cannot open config %s", path);
    char line[2048];
    int rc = CM_OK, lineno = 0;
    enum section sec = SEC_NONE;
    while (rc == CM_OK && fgets(line, sizeof line, f) != NULL) {
        lineno++;
        if (strchr(line, '\n') == NULL && !feof(f)) {
            rc = cm_err(errptr, CM_EINVAL, "%s:%d: line too long", path, lineno);
            break;
        }
        char *hash = strchr(line, '#');
        if (hash) *hash = '\0';
        char *s = trim(line);
        if (*s == '\0') continue;
        if (*s == '[') {
            char *close = strchr(s, ']');
            if (close == NULL || close[1] != '\0') {
                rc = cm_err(errptr, CM_EINVAL, "%s:%d: malformed section header", path, lineno);
                break;
            }
            *close = '\0';
            char *name = trim(s + 1), *arg = name;
            while (*arg && !isspace((unsigned char)*arg)) arg++;
            if (*arg) *arg++ = '\0';
            arg = trim(arg);
            if (!strcmp(name, "cluster") && *arg == '\0') {
                sec = SEC_CLUSTER;
            } else if ((!strcmp(name, "table") || !strcmp(name, "dense")) && *arg != '\0') {
                bool table = !strcmp(name, "table");
                uint32_t *n = table ? &cfg->n_tables : &cfg->n_dense;
                if (*n >= (table ? PS_MAX_TABLES : PS_MAX_DENSE) || strlen(arg) >= PS_NAME_MAX) {
                    rc = cm_err(errptr, CM_EINVAL, "%s:%d: too many %s sections or name too long",
                                path, lineno, name);
                    break;
                }
                for (uint32_t i = 0; i < *n; i++)
                    if (!strcmp(table ? cfg->tables[i].name : cfg->dense[i].name, arg))
                        rc = cm_err(errptr, CM_EINVAL, "%s:%d: duplicate %s '%s'", path, lineno,
                                    name, arg);
                if (rc != CM_OK) break;
                if (table) {
                    ps_table_spec *t = &cfg->tables[*n];
                    memset(t, 0, sizeof *t);
                    emb_table_config_init(&t->cfg);
                    t->cfg.dim = 0; /* required */
                    copy_str(t->name, sizeof t->name, arg);
                    sec = SEC_TABLE;
                } else {
                    dense_spec_init(&cfg->dense[*n]);
                    copy_str(cfg->dense[*n].name, sizeof cfg->dense[*n].name, arg);
                    sec = SEC_DENSE;
                }
                (*n)++;
            } else {
                rc = cm_err(errptr, CM_EINVAL, "%s:%d: unknown section [%s%s%s]", path, lineno,
                            name, *arg ? " " : "", arg);
            }
            continue;
        }
        char *eq = strchr(s, '=');
        if (eq == NULL) {
            rc = cm_err(errptr, CM_EINVAL, "%s:%d: expected key = value", path, lineno);
            break;
        }
        *eq = '\0';
        char *k = trim(s), *v = trim(eq + 1);
        int r = 1;
        if (sec == SEC_CLUSTER) r = set_cluster(cfg, k, v);
        else if (sec == SEC_TABLE) r = set_table(&cfg->tables[cfg->n_tables - 1], k, v);
        else if (sec == SEC_DENSE) r = set_dense(&cfg->dense[cfg->n_dense - 1], k, v);
        if (r > 0)
            rc = cm_err(errptr, CM_EINVAL, "%s:%d: unknown key '%s'%s", path, lineno, k,
                        sec == SEC_NONE ? " outside any section" : "");
        else if (r < 0)
            rc = cm_err(errptr, CM_EINVAL, "%s:%d: bad value '%s' for %s", path, lineno, v, k);
    }
    fclose(f);
    if (rc == CM_OK) {
        char *err = NULL;
        rc = ps_config_check(cfg, &err);
        if (rc != CM_OK) cm_err(errptr, rc, "%s: %s", path, err);
        free(err);
    }
    return rc;
}

int ps_config_check(const ps_config *cfg, char **errptr)
{
    if (cfg->n_shards == 0 || cfg->n_shards > PS_MAX_SHARDS)
        return cm_err(errptr, CM_EINVAL, "shards %u out of range 1..%u", cfg->n_shards, PS_MAX_SHARDS);
    if (cfg->n_workers == 0 || cfg->n_workers > PS_MAX_WORKERS)
        return cm_err(errptr, CM_EINVAL, "workers %u out of range 1..%u", cfg->n_workers,
                      PS_MAX_WORKERS);
    if (cfg->staleness < -1) return cm_err(errptr, CM_EINVAL, "staleness %d < -1", cfg->staleness);
    if (cfg->max_msg_bytes < 4096)
        return cm_err(errptr, CM_EINVAL, "max_message %llu is below 4096 bytes",
                      (unsigned long long)cfg->max_msg_bytes);
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
    }
    return CM_OK;
}

void ps_plan(const ps_config *cfg, uint32_t table, uint64_t rows, ps_plan_row *out)
{
    const emb_table_config *c = &cfg->tables[table].cfg;
    memset(out, 0, sizeof *out);
    out->row_bytes = emb_row_bytes(c);
    out->mem_bytes_per_row = emb_row_mem_bytes(c);
    uint64_t fit = rows;
    if (c->mem_budget_bytes > 0) {
        uint64_t cap = (uint64_t)((double)c->mem_budget_bytes / out->mem_bytes_per_row);
        if (cap < fit) fit = cap;
    }
    out->rows_in_memory = fit;
    out->rows_spilled = rows - fit;
    out->mem_bytes = (double)fit * out->mem_bytes_per_row;
    /* RocksDB stores each spilled record uncompressed with an 8-byte key and ~20 bytes of
     * per-entry overhead in its SST format. */
    out->disk_bytes = (double)out->rows_spilled * (double)(out->row_bytes + 8 + 20);
}
