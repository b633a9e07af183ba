/* Column plans: the mapping from input columns to label / dense / fields, built from the
 * format, a schema file or a header line. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "datasets/ds_internal.h"

static const char *const format_names[] = {"criteo", "criteo-csv", "avazu",
                                           "libsvm", "libffm",     "csv"};

int ds_format_from_name(const char *name, ds_format *out)
{
    for (size_t i = 0; i < sizeof format_names / sizeof format_names[0]; i++)
        if (name && strcmp(name, format_names[i]) == 0) {
            *out = (ds_format)i;
            return CM_OK;
        }
    return CM_EINVAL;
}

const char *ds_format_name(ds_format fmt)
{
    return (unsigned)fmt < sizeof format_names / sizeof format_names[0] ? format_names[fmt] : "?";
}

void ds_parser_opts_init(ds_parser_opts *o)
{
    memset(o, 0, sizeof *o);
    o->format = DS_FMT_CRITEO;
}

/* Columns are collected with their names; slots and the name table are assigned at the end
 * so every way of describing columns shares one numbering rule: dense in column order, fields
 * in column order, then one bucket field per dense value. */
typedef struct builder {
    ds_plan *p;
    char **col_names;
    size_t cap;
} builder;

static int b_add(builder *b, int role, const char *name, size_t nlen, char msep)
{
    ds_plan *p = b->p;
    if (p->n_cols == b->cap) {
        size_t c = b->cap ? b->cap * 2 : 16;
        ds_col *cols = realloc(p->cols, c * sizeof *cols);
        if (cols == NULL) return CM_ENOMEM;
        p->cols = cols;
        char **names = realloc(b->col_names, c * sizeof *names);
        if (names == NULL) return CM_ENOMEM;
        b->col_names = names;
        b->cap = c;
    }
    char *n = strndup(name, nlen);
    if (n == NULL) return CM_ENOMEM;
    p->cols[p->n_cols] = (ds_col){.role = (uint8_t)role, .msep = msep, .slot = 0};
    b->col_names[p->n_cols++] = n;
    return CM_OK;
}

static void b_free(builder *b)
{
    for (uint32_t i = 0; b->col_names && i < b->p->n_cols; i++) free(b->col_names[i]);
    free(b->col_names);
    b->col_names = NULL;
}

static char *name_with(const char *a, const char *suffix)
{
    size_t n = strlen(a) + strlen(suffix) + 1;
    char *s = malloc(n);
    if (s) snprintf(s, n, "%s%s", a, suffix);
    return s;
}

static int fix_schema(ds_plan *p)
{
    p->n_fields = p->n_base_fields + (p->bucketize ? p->n_dense : 0);
    p->schema = (ds_schema){.n_dense = p->n_dense,
                            .n_fields = p->n_fields,
                            .has_label = p->has_label,
                            .has_weights = p->has_weights,
                            .dense_names = (const char *const *)p->names,
                            .field_names = (const char *const *)p->names + p->n_dense};
    return CM_OK;
}

static int b_finish(builder *b, char **errptr)
{
    ds_plan *p = b->p;
    uint32_t nd = 0, nf = 0, labels = 0;
    for (uint32_t i = 0; i < p->n_cols; i++) {
        ds_col *c = &p->cols[i];
        if (c->role == COL_DENSE) c->slot = nd++;
        else if (c->role == COL_CAT || c->role == COL_MULTI) c->slot = nf++;
        else if (c->role == COL_HOUR) c->slot = nf, nf += 2;
        else if (c->role == COL_LABEL) labels++;
    }
    if (labels > 1) return cm_err(errptr, CM_EINVAL, "more than one label column");
    p->has_label = labels == 1;
    p->n_dense = nd;
    p->n_base_fields = nf;
    size_t total = nd + nf + (p->bucketize ? nd : 0);
    p->names = calloc(total + 1, sizeof *p->names);
    if (p->names == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    for (uint32_t i = 0; i < p->n_cols; i++) {
        ds_col *c = &p->cols[i];
        const char *n = b->col_names[i];
        if (c->role == COL_DENSE) {
            p->names[c->slot] = strdup(n);
            if (p->bucketize) p->names[nd + nf + c->slot] = name_with(n, "_log2");
        } else if (c->role == COL_CAT || c->role == COL_MULTI) {
            p->names[nd + c->slot] = strdup(n);
        } else if (c->role == COL_HOUR) {
            p->names[nd + c->slot] = name_with(n, "_of_day");
            p->names[nd + c->slot + 1] = name_with(n, "_weekday");
        }
    }
    for (size_t i = 0; i < total; i++)
        if (p->names[i] == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    return fix_schema(p);
}

void ds_plan_destroy(ds_plan *p)
{
    if (p == NULL) return;
    if (p->names)
        for (size_t i = 0; p->names[i] || i < (size_t)p->n_dense + p->n_fields; i++)
            free(p->names[i]);
    free(p->names);
    free(p->cols);
    free(p);
}

static ds_plan *plan_new(const ds_parser_opts *o)
{
    ds_plan *p = calloc(1, sizeof *p);
    if (p == NULL) return NULL;
    p->fmt = o->format;
    p->bucketize = o->bucketize;
    p->scalar_scan = o->scalar_scan;
    p->sep = ',';
    return p;
}

/* Plans whose fields are not columns (libsvm, libffm) just name their fields. */
static int plan_sparse(ds_plan *p, uint32_t n_fields, char **errptr)
{
    p->has_label = 1;
    p->has_weights = 1;
    p->n_base_fields = n_fields;
    p->bucketize = 0;
    p->names = calloc((size_t)n_fields + 1, sizeof *p->names);
    if (p->names == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    for (uint32_t f = 0; f < n_fields; f++) {
        char tmp[32];
        if (n_fields == 1) snprintf(tmp, sizeof tmp, "features");
        else snprintf(tmp, sizeof tmp, "f%u", f);
        if ((p->names[f] = strdup(tmp)) == NULL)
            return cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    return fix_schema(p);
}

/* Criteo's TSV; without the label column (no_label) for its unlabelled test file, whose rows
 * would otherwise pass for labelled rows one column short, shifted: I1 read as the label. */
static int plan_criteo_tsv(builder *b, int no_label, char **errptr)
{
    char name[16];
    int rc = no_label ? CM_OK : b_add(b, COL_LABEL, "label", 5, 0);
    for (int i = 1; rc == CM_OK && i <= 13; i++)
        rc = b_add(b, COL_DENSE, name, (size_t)snprintf(name, sizeof name, "I%d", i), 0);
    for (int i = 1; rc == CM_OK && i <= 26; i++)
        rc = b_add(b, COL_CAT, name, (size_t)snprintf(name, sizeof name, "C%d", i), 0);
    if (rc != CM_OK) return cm_err(errptr, rc, "out of memory");
    b->p->sep = '\t';
    b->p->min_cols = no_label ? 13 : 14; /* (the label and) the 13 integer columns */
    return b_finish(b, errptr);
}

static const char *skip_ws(const char *s, const char *end)
{
    while (s < end && (*s == ' ' || *s == '\t' || *s == '\r')) s++;
    return s;
}

static const char *word_end(const char *s, const char *end)
{
    while (s < end && *s != ' ' && *s != '\t' && *s != '\r') s++;
    return s;
}

static int word_is(const char *w, size_t n, const char *lit)
{
    return strlen(lit) == n && memcmp(w, lit, n) == 0;
}

/* A one-character separator written literally or by name. */
static int parse_sep(const char *w, size_t n, char *out)
{
    static const struct { const char *name; char c; } named[] = {
        {"tab", '\t'}, {"comma", ','}, {"semicolon", ';'}, {"pipe", '|'}, {"space", ' '}};
    for (size_t i = 0; i < sizeof named / sizeof named[0]; i++)
        if (word_is(w, n, named[i].name)) {
            *out = named[i].c;
            return CM_OK;
        }
    if (n == 1 && w[0] != '"' && (unsigned char)w[0] > 0x20 && (unsigned char)w[0] < 0x7f) {
        *out = w[0];
        return CM_OK;
    }
    return CM_EINVAL;
}

static int plan_schema_text(builder *b, const char *text, size_t len, const char *src,
                            char **errptr)
{
    static const struct { const char *word; int role; } roles[] = {
        {"label", COL_LABEL}, {"dense", COL_DENSE}, {"cat", COL_CAT},
        {"multi", COL_MULTI}, {"skip", COL_SKIP},   {"hour", COL_HOUR}};
    ds_plan *p = b->p;
    const char *s = text, *end = text + len;
    p->header = 1;
    for (int line = 1; s < end; line++) {
        const char *eol = memchr(s, '\n', (size_t)(end - s));
        if (eol == NULL) eol = end;
        const char *w[4];
        size_t wl[4];
        int nw = 0;
        const char *q = skip_ws(s, eol);
        while (q < eol && *q != '#' && nw < 4) {
            const char *e = word_end(q, eol);
            w[nw] = q;
            wl[nw++] = (size_t)(e - q);
            q = skip_ws(e, eol);
        }
        s = eol + 1;
        if (nw == 0) continue;
        if (q < eol && *q != '#')
            return cm_err(errptr, CM_EINVAL, "%s:%d: too many words", src, line);
        if (word_is(w[0], wl[0], "separator")) {
            if (nw != 2 || parse_sep(w[1], wl[1], &p->sep) != CM_OK)
                return cm_err(errptr, CM_EINVAL,
                              "%s:%d: separator takes one character or tab|comma|semicolon|pipe",
                              src, line);
            continue;
        }
        if (word_is(w[0], wl[0], "header")) {
            if (nw != 2 || !(word_is(w[1], wl[1], "yes") || word_is(w[1], wl[1], "no")))
                return cm_err(errptr, CM_EINVAL, "%s:%d: header takes yes or no", src, line);
            p->header = word_is(w[1], wl[1], "yes");
            continue;
        }
        int role = -1;
        for (size_t i = 0; i < sizeof roles / sizeof roles[0]; i++)
            if (word_is(w[0], wl[0], roles[i].word)) role = roles[i].role;
        if (role < 0)
            return cm_err(errptr, CM_EINVAL, "%s:%d: unknown keyword '%.*s'%s", src, line,
                          (int)(wl[0] < 64 ? wl[0] : 64), w[0], wl[0] > 64 ? "..." : "");
        char msep = 0;
        if (role == COL_MULTI) {
            if (nw != 3 || parse_sep(w[2], wl[2], &msep) != CM_OK)
                return cm_err(errptr, CM_EINVAL, "%s:%d: multi takes a name and a separator",
                              src, line);
        } else if (nw != 2) {
            return cm_err(errptr, CM_EINVAL, "%s:%d: %.*s takes one column name", src, line,
                          (int)wl[0], w[0]);
        }
        if (b_add(b, role, w[1], wl[1], msep) != CM_OK)
            return cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    if (p->n_cols == 0) return cm_err(errptr, CM_EINVAL, "%s: no columns", src);
    for (uint32_t i = 0; i < p->n_cols; i++)
        if (p->cols[i].role == COL_MULTI && p->cols[i].msep == p->sep)
            return cm_err(errptr, CM_EINVAL, "%s: multi separator equals the column separator",
                          src);
    p->quoting = 1;
    p->min_cols = p->n_cols;
    return b_finish(b, errptr);
}

int ds_plan_create(const ds_parser_opts *o, ds_plan **out, char **errptr)
{
    builder b = {0};
    char *text = NULL;
    int rc = CM_OK;
    ds_plan *p = plan_new(o);
    if (p == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    b.p = p;
    if (o->no_label && o->format != DS_FMT_CRITEO) {
        ds_plan_destroy(p);
        return cm_err(errptr, CM_EINVAL,
                      "no label column is an option of the criteo TSV format only (criteo-csv and "
                      "csv find theirs by name; avazu, libsvm and libffm rows always have one)");
    }
    switch (o->format) {
    case DS_FMT_CRITEO:
        rc = plan_criteo_tsv(&b, o->no_label, errptr);
        break;
    case DS_FMT_CRITEO_CSV:
    case DS_FMT_AVAZU:
        p->header = 1;
        p->quoting = 1;
        break;
    case DS_FMT_LIBSVM:
        rc = plan_sparse(p, 1, errptr);
        break;
    case DS_FMT_LIBFFM:
        if (o->ffm_fields == 0 || o->ffm_fields > 1u << 20)
            rc = cm_err(errptr, CM_EINVAL, "libffm needs a field count in 1..%u", 1u << 20);
        else
            rc = plan_sparse(p, o->ffm_fields, errptr);
        break;
    case DS_FMT_CSV:
        if (o->schema_text) {
            rc = plan_schema_text(&b, o->schema_text, strlen(o->schema_text), "schema", errptr);
        } else if (o->schema_path) {
            size_t len;
            rc = cm_read_file(o->schema_path, (void **)&text, &len, errptr);
            if (rc == CM_OK) rc = plan_schema_text(&b, text, len, o->schema_path, errptr);
        } else {
            rc = cm_err(errptr, CM_EINVAL, "format csv needs a schema file");
        }
        break;
    default:
        rc = cm_err(errptr, CM_EINVAL, "unknown format %d", (int)o->format);
    }
    b_free(&b);
    free(text);
    if (rc != CM_OK) {
        ds_plan_destroy(p);
        return rc;
    }
    *out = p;
    return CM_OK;
}

static int is_prefixed_number(const char *s, size_t n, char c)
{
    if (n < 2 || s[0] != c) return 0;
    for (size_t i = 1; i < n; i++)
        if (!isdigit((unsigned char)s[i])) return 0;
    return 1;
}

/* Header names may be quoted; quotes are dropped (names with doubled quotes are not
 * supported as names). */
/* Where the header name starting at s ends: its separator, or end. A name that opens with a
 * quote runs to the closing one (a doubled quote inside is part of it), as a row's token does,
 * so a separator in it does not split it; NULL when the quote is never closed. */
static const char *header_name_end(const char *s, const char *end, char sep)
{
    if (s < end && *s == '"') {
        const char *q = s + 1;
        for (;; q += 2) {
            q = memchr(q, '"', (size_t)(end - q));
            if (q == NULL) return NULL;
            if (q + 1 == end || q[1] != '"') break;
        }
        s = q + 1;
    }
    const char *e = memchr(s, sep, (size_t)(end - s));
    return e != NULL ? e : end;
}

static void unquote_name(const char **s, size_t *n)
{
    if (*n >= 2 && (*s)[0] == '"' && (*s)[*n - 1] == '"') {
        (*s)++;
        *n -= 2;
    }
}

static int header_role(ds_format fmt, const char *s, size_t n)
{
    if (fmt == DS_FMT_AVAZU) {
        if (word_is(s, n, "id")) return COL_SKIP;
        if (word_is(s, n, "click")) return COL_LABEL;
        if (word_is(s, n, "hour")) return COL_HOUR;
        return COL_CAT;
    }
    if (word_is(s, n, "Id") || word_is(s, n, "id")) return COL_SKIP;
    if (word_is(s, n, "Label") || word_is(s, n, "label")) return COL_LABEL;
    if (is_prefixed_number(s, n, 'I')) return COL_DENSE;
    if (is_prefixed_number(s, n, 'C')) return COL_CAT;
    return -1;
}

int ds_plan_from_header(const ds_plan *base, const char *line, size_t len, ds_plan **out,
                        char **errptr)
{
    if (len && line[len - 1] == '\r') len--;
    if (base->fmt == DS_FMT_CSV) {
        /* the schema fixed the columns; the header must name the same ones */
        uint32_t col = 0;
        const char *s = line, *end = line + len;
        for (;;) {
            const char *e = header_name_end(s, end, base->sep);
            if (e == NULL)
                return cm_err(errptr, CM_EINVAL, "header column %u: unterminated quote", col + 1);
            const char *w = s;
            size_t n = (size_t)(e - s);
            unquote_name(&w, &n);
            col++;
            if (e == end) break;
            s = e + 1;
        }
        if (col != base->n_cols)
            return cm_err(errptr, CM_EINVAL, "header has %u columns, schema has %u", col,
                          base->n_cols);
        *out = NULL;
        return CM_OK;
    }
    ds_parser_opts o;
    ds_parser_opts_init(&o);
    o.format = base->fmt;
    o.bucketize = base->bucketize;
    o.scalar_scan = base->scalar_scan;
    ds_plan *p = plan_new(&o);
    if (p == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    builder b = {.p = p};
    int rc = CM_OK;
    const char *s = line, *end = line + len;
    for (uint32_t col = 1;; col++) {
        const char *e = header_name_end(s, end, ',');
        if (e == NULL) {
            rc = cm_err(errptr, CM_EINVAL, "header column %u: unterminated quote", col);
            break;
        }
        const char *w = s;
        size_t n = (size_t)(e - s);
        unquote_name(&w, &n);
        int role = header_role(base->fmt, w, n);
        if (role < 0) {
            rc = cm_err(errptr, CM_EINVAL,
                        "header column %u '%.*s' is not Id, Label, I<n> or C<n>", col,
                        (int)(n > 64 ? 64 : n), w);
            break;
        }
        if ((rc = b_add(&b, role, w, n, 0)) != CM_OK) {
            rc = cm_err(errptr, rc, "out of memory");
            break;
        }
        if (e == end) break;
        s = e + 1;
    }
    if (rc == CM_OK) {
        p->header = 1;
        p->quoting = 1;
        p->min_cols = p->n_cols;
        rc = b_finish(&b, errptr);
    }
    if (rc == CM_OK && p->n_dense + p->n_base_fields == 0)
        rc = cm_err(errptr, CM_EINVAL, "header names no feature columns");
    b_free(&b);
    if (rc != CM_OK) {
        ds_plan_destroy(p);
        return rc;
    }
    *out = p;
    return CM_OK;
}

int ds_schema_equal(const ds_schema *a, const ds_schema *b)
{
    if (a->n_dense != b->n_dense || a->n_fields != b->n_fields ||
        a->has_label != b->has_label || a->has_weights != b->has_weights)
        return 0;
    for (uint32_t i = 0; i < a->n_dense; i++)
        if (strcmp(a->dense_names[i], b->dense_names[i]) != 0) return 0;
    for (uint32_t i = 0; i < a->n_fields; i++)
        if (strcmp(a->field_names[i], b->field_names[i]) != 0) return 0;
    return 1;
}

int ds_plan_same_schema(const ds_plan *a, const ds_plan *b)
{
    return ds_schema_equal(&a->schema, &b->schema);
}

ds_plan *ds_plan_from_schema(const ds_schema *s)
{
    ds_plan *p = calloc(1, sizeof *p);
    if (p == NULL) return NULL;
    size_t total = (size_t)s->n_dense + s->n_fields;
    p->names = calloc(total + 1, sizeof *p->names);
    if (p->names == NULL) {
        free(p);
        return NULL;
    }
    p->n_dense = s->n_dense;
    p->n_base_fields = s->n_fields;
    p->has_label = s->has_label;
    p->has_weights = s->has_weights;
    fix_schema(p);
    for (size_t i = 0; i < total; i++) {
        const char *n = i < s->n_dense ? s->dense_names[i] : s->field_names[i - s->n_dense];
        if ((p->names[i] = strdup(n ? n : "")) == NULL) {
            ds_plan_destroy(p);
            return NULL;
        }
    }
    return p;
}
