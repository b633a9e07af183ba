/*
 * Reading a cluster checkpoint without a running cluster (export, reshard): the layout is
 * <ckpt>/shard-<i>/{MANIFEST, table-<name>/ (an embedding snapshot), dense-<name>.bin}.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ps/dense.h"
#include "ps/ps.h"

int ps_checkpoint_shards(const char *ckpt, uint32_t *n, char **errptr)
{
    char path[4200];
    struct stat st;
    uint32_t i = 0;
    for (; i < PS_MAX_SHARDS; i++) {
        snprintf(path, sizeof path, "%s/shard-%u/MANIFEST", ckpt, i);
        if (stat(path, &st) != 0) break;
    }
    if (i == 0) return cm_err(errptr, CM_ENOTFOUND, "%s is not a checkpoint (no shard-0/MANIFEST)", ckpt);
    *n = i;
    return CM_OK;
}

int ps_checkpoint_table_config(const char *ckpt, const char *table, emb_table_config *cfg,
                               char **errptr)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/shard-0/table-%s", ckpt, table);
    return emb_snapshot_read_config(path, cfg, errptr);
}

int ps_checkpoint_foreach_row(const char *ckpt, const char *table, emb_row_cb cb, void *arg,
                              char **errptr)
{
    uint32_t n;
    int rc = ps_checkpoint_shards(ckpt, &n, errptr);
    for (uint32_t i = 0; rc == CM_OK && i < n; i++) {
        char path[4200];
        snprintf(path, sizeof path, "%s/shard-%u/table-%s", ckpt, i, table);
        rc = emb_snapshot_foreach(path, cb, arg, errptr);
    }
    return rc;
}

int ps_checkpoint_dense(const char *ckpt, const char *name, float **values, uint64_t *n,
                        char **errptr)
{
    uint32_t shards;
    int rc = ps_checkpoint_shards(ckpt, &shards, errptr);
    if (rc != CM_OK) return rc;
    for (uint32_t i = 0; i < shards; i++) {
        char path[4200];
        struct stat st;
        snprintf(path, sizeof path, "%s/shard-%u/dense-%s.bin", ckpt, i, name);
        if (stat(path, &st) == 0) return ps_dense_read_values(path, values, n, errptr);
    }
    return cm_err(errptr, CM_ENOTFOUND, "%s: no dense block '%s' in any shard", ckpt, name);
}

int ps_checkpoint_names(const char *ckpt, char (*tables)[PS_NAME_MAX], uint32_t *n_tables,
                        char (*dense)[PS_NAME_MAX], uint32_t *n_dense, char **errptr)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/shard-0/MANIFEST", ckpt);
    char *text = NULL;
    size_t len;
    int rc = cm_read_file(path, (void **)&text, &len, errptr);
    if (rc != CM_OK) return rc;
    *n_tables = *n_dense = 0;
    for (char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        char kind[8], name[PS_NAME_MAX];
        if (sscanf(p, "%7s %31s", kind, name) != 2) continue;
        if (!strcmp(kind, "table") && *n_tables < PS_MAX_TABLES) strcpy(tables[(*n_tables)++], name);
        if (!strcmp(kind, "dense") && *n_dense < PS_MAX_DENSE) strcpy(dense[(*n_dense)++], name);
    }
    free(text);
    return CM_OK;
}
