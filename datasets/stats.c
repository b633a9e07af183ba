/* Per-field statistics of the rows an ingest writes: missing rates, dense ranges, and a
 * HyperLogLog distinct-key estimate per field. Workers keep their own and merge at the end. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "datasets/ds_internal.h"

int ds_stats_init(ds_stats *s, uint32_t n_dense, uint32_t n_fields)
{
    memset(s, 0, sizeof *s);
    s->n_dense = n_dense;
    s->n_fields = n_fields;
    s->dense_missing = calloc((size_t)n_dense + 1, sizeof *s->dense_missing);
    s->field_missing = calloc((size_t)n_fields + 1, sizeof *s->field_missing);
    s->dense_sum = calloc((size_t)n_dense + 1, sizeof *s->dense_sum);
    s->dense_min = malloc(((size_t)n_dense + 1) * sizeof *s->dense_min);
    s->dense_max = malloc(((size_t)n_dense + 1) * sizeof *s->dense_max);
    s->hll = calloc(((size_t)n_fields << DS_HLL_BITS) + 1, 1);
    if (!s->dense_missing || !s->field_missing || !s->dense_sum || !s->dense_min ||
        !s->dense_max || !s->hll) {
        ds_stats_free(s);
        return CM_ENOMEM;
    }
    for (uint32_t d = 0; d < n_dense; d++) {
        s->dense_min[d] = FLT_MAX;
        s->dense_max[d] = -FLT_MAX;
    }
    return CM_OK;
}

void ds_stats_add_field(ds_stats *s, uint32_t f, const uint64_t *keys, size_t m, uint64_t missing)
{
    uint8_t *reg = s->hll + ((size_t)f << DS_HLL_BITS);
    s->field_missing[f] += missing;
    for (size_t i = 0; i < m; i++)
        ds_hll_add(reg, keys[i]);
}

void ds_stats_free(ds_stats *s)
{
    free(s->dense_missing);
    free(s->field_missing);
    free(s->dense_sum);
    free(s->dense_min);
    free(s->dense_max);
    free(s->hll);
    memset(s, 0, sizeof *s);
}

void ds_stats_merge(ds_stats *into, const ds_stats *from)
{
    into->rows += from->rows;
    into->clicks += from->clicks;
    if (from->max_row_keys > into->max_row_keys) into->max_row_keys = from->max_row_keys;
    for (uint32_t d = 0; d < into->n_dense; d++) {
        into->dense_missing[d] += from->dense_missing[d];
        into->dense_sum[d] += from->dense_sum[d];
        if (from->dense_min[d] < into->dense_min[d]) into->dense_min[d] = from->dense_min[d];
        if (from->dense_max[d] > into->dense_max[d]) into->dense_max[d] = from->dense_max[d];
    }
    for (uint32_t f = 0; f < into->n_fields; f++) into->field_missing[f] += from->field_missing[f];
    size_t n = (size_t)into->n_fields << DS_HLL_BITS;
    for (size_t i = 0; i < n; i++)
        if (from->hll[i] > into->hll[i]) into->hll[i] = from->hll[i];
}

double ds_stats_distinct(const ds_stats *s, uint32_t field)
{
    const double m = (double)(1u << DS_HLL_BITS);
    const uint8_t *reg = s->hll + ((size_t)field << DS_HLL_BITS);
    double sum = 0;
    unsigned zeros = 0;
    for (uint32_t i = 0; i < (1u << DS_HLL_BITS); i++) {
        sum += ldexp(1.0, -reg[i]);
        zeros += reg[i] == 0;
    }
    double e = 0.7213 / (1.0 + 1.079 / m) * m * m / sum;
    if (e <= 2.5 * m && zeros) e = m * log(m / zeros); /* linear counting for small sets */
    return e;
}

/* s as a JSON string, quotes included. */
static void json_str(FILE *f, const char *s)
{
    fputc('"', f);
    cm_json_escape(f, s);
    fputc('"', f);
}

static double rate(uint64_t a, uint64_t b)
{
    return b ? (double)a / (double)b : 0.0;
}

int ds_stats_write_json(const ds_stats *s, const ds_schema *schema, const char *path,
                        char **errptr)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (f == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    fprintf(f, "{\n  \"rows\": %llu,\n  \"clicks\": %llu,\n  \"ctr\": %.6f,\n",
            (unsigned long long)s->rows, (unsigned long long)s->clicks, rate(s->clicks, s->rows));
    fprintf(f, "  \"max_row_keys\": %u,\n", s->max_row_keys);
    fprintf(f, "  \"has_label\": %s,\n  \"dense\": [", schema->has_label ? "true" : "false");
    for (uint32_t d = 0; d < s->n_dense; d++) {
        uint64_t present = s->rows - s->dense_missing[d];
        fprintf(f, "%s\n    {\"name\": ", d ? "," : "");
        json_str(f, schema->dense_names[d]);
        fprintf(f, ", \"missing_rate\": %.6f", rate(s->dense_missing[d], s->rows));
        if (present)
            fprintf(f, ", \"mean\": %.6g, \"min\": %.9g, \"max\": %.9g",
                    s->dense_sum[d] / (double)present, s->dense_min[d], s->dense_max[d]);
        fputc('}', f);
    }
    fprintf(f, "%s],\n  \"fields\": [", s->n_dense ? "\n  " : "");
    for (uint32_t i = 0; i < s->n_fields; i++) {
        fprintf(f, "%s\n    {\"name\": ", i ? "," : "");
        json_str(f, schema->field_names[i]);
        fprintf(f, ", \"missing_rate\": %.6f, \"distinct_estimate\": %.0f}",
                rate(s->field_missing[i], s->rows), ds_stats_distinct(s, i));
    }
    fprintf(f, "%s]\n}\n", s->n_fields ? "\n  " : "");
    /* A memory stream fails only for want of memory, and then holds part of the text. */
    int rc = fclose(f) == 0 && buf != NULL
                 ? cm_write_file_atomic(path, buf, len, errptr)
                 : cm_err(errptr, CM_ENOMEM, "out of memory writing %s", path);
    free(buf);
    return rc;
}

int ds_stats_read_distinct(const char *path, uint64_t *total, uint32_t *n_fields, char **errptr)
{
    static const char tag[] = "\"distinct_estimate\":";
    void *buf = NULL;
    size_t len = 0;
    int rc = cm_read_file(path, &buf, &len, errptr);
    if (rc != CM_OK) return rc;
    uint64_t sum = 0;
    uint32_t n = 0;
    for (const char *p = strstr(buf, tag); p != NULL; p = strstr(p, tag)) {
        p += sizeof tag - 1;
        char *end = NULL;
        double v = strtod(p, &end);
        if (end == p || !(v >= 0) || v > 1e15) {
            rc = cm_err(errptr, CM_ECORRUPT, "%s: bad distinct_estimate of field %u", path, n);
            break;
        }
        sum += (uint64_t)v;
        n++;
        p = end;
    }
    if (rc == CM_OK && n == 0)
        rc = cm_err(errptr, CM_ECORRUPT, "%s: no distinct_estimate in it", path);
    if (rc == CM_OK) {
        *total = sum;
        *n_fields = n;
    }
    free(buf);
    return rc;
}

int ds_stats_read_max_row_keys(const char *path, uint32_t *out, char **errptr)
{
    static const char tag[] = "\"max_row_keys\":";
    void *buf = NULL;
    size_t len = 0;
    int rc = cm_read_file(path, &buf, &len, errptr);
    if (rc != CM_OK) return rc;
    const char *p = strstr(buf, tag);
    if (p == NULL)
        rc = cm_err(errptr, CM_ENOTFOUND, "%s: no max_row_keys (written by an older ingest)", path);
    else {
        p += sizeof tag - 1;
        while (*p == ' ')
            p++;
        char *end = NULL;
        unsigned long long v = (*p >= '0' && *p <= '9') ? strtoull(p, &end, 10) : 0;
        if (end == NULL || end == p || v > UINT32_MAX || (*end != ',' && *end != '\n'))
            rc = cm_err(errptr, CM_ECORRUPT, "%s: bad max_row_keys", path);
        else
            *out = (uint32_t)v;
    }
    free(buf);
    return rc;
}
