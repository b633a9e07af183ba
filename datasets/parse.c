/* The hot path: hand-written tokenizers that turn one line into one row. Integers and short
 * decimals are parsed without strtod; keys are inline xxh3. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "datasets/ds_internal.h"

uint64_t ds_key(const char *tok, size_t len, uint32_t field)
{
    return XXH3_64bits_withSeed(tok, len, field);
}

static const char *const reject_names[DS_REJ__COUNT] = {
    "columns", "number", "label", "token_too_long", "junk", "quoting", "line_too_long", "feature"};

const char *ds_reject_name(int reason)
{
    return reason >= 0 && reason < DS_REJ__COUNT ? reject_names[reason] : "unknown";
}

int ds_pctx_init(ds_pctx *c, const ds_plan *plan, ds_stats *stats)
{
    memset(c, 0, sizeof *c);
    c->plan = plan;
    c->stats = stats;
    c->missing = calloc((size_t)plan->n_dense + 1, 1);
    c->qbuf = malloc(DS_MAX_TOKEN + 1);
    c->cnt = calloc((size_t)plan->n_fields + 1, sizeof *c->cnt);
    if (c->missing == NULL || c->qbuf == NULL || c->cnt == NULL) {
        ds_pctx_free(c);
        return CM_ENOMEM;
    }
    return CM_OK;
}

void ds_pctx_free(ds_pctx *c)
{
    free(c->missing);
    free(c->qbuf);
    free(c->kv);
    free(c->cnt);
    memset(c, 0, sizeof *c);
}

/* ---- numbers ---- */

static const double pow10_tab[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7,
                                   1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15};

static inline int is_digit(unsigned char c)
{
    return c >= '0' && c <= '9';
}

/* Numbers with at most 15 significant digits and no exponent are exact in a double and
 * (m / 10^k) is correctly rounded, so the fast path agrees with strtod; anything else goes to
 * strtod on a bounded copy. Only [0-9+-.eE] are accepted (no hex, inf, nan, spaces). */
static int parse_num(const char *s, size_t n, double *out)
{
    const char *p = s, *e = s + n;
    int neg = 0, digits = 0, frac = 0;
    uint64_t m = 0;
    if (p < e && (*p == '-' || *p == '+')) neg = *p++ == '-';
    while (p < e && is_digit((unsigned char)*p)) {
        if (digits == 15) goto slow;
        m = m * 10 + (uint64_t)(*p++ - '0');
        digits += m != 0;
    }
    int any = p > s + (s < e && (*s == '-' || *s == '+'));
    if (p < e && *p == '.') {
        p++;
        while (p < e && is_digit((unsigned char)*p)) {
            if (digits == 15 || frac == 15) goto slow;
            m = m * 10 + (uint64_t)(*p++ - '0');
            digits += m != 0;
            frac++;
            any = 1;
        }
    }
    if (p != e || !any) goto slow;
    double v = (double)m;
    if (frac) v /= pow10_tab[frac];
    *out = neg ? -v : v;
    return 0;
slow:;
    char buf[72];
    if (n == 0 || n >= sizeof buf) return -1;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!is_digit((unsigned char)c) && c != '+' && c != '-' && c != '.' && c != 'e' &&
            c != 'E')
            return -1;
    }
    memcpy(buf, s, n);
    buf[n] = '\0';
    char *endp;
    double d = strtod(buf, &endp);
    if (endp != buf + n || !isfinite(d)) return -1;
    *out = d;
    return 0;
}

/* ---- row building: keys are appended field by field in increasing field order ---- */

static inline int row_key(ds_rows *r, uint64_t key, float w)
{
    if (r->n_keys == r->cap_keys && ds_rows_reserve_keys(r, r->n_keys + 1) != CM_OK)
        return CM_ENOMEM;
    r->keys[r->n_keys] = key;
    if (r->has_weights) r->weights[r->n_keys] = w;
    r->n_keys++;
    return CM_OK;
}

/* Ends every field below f: their key lists are complete. */
static inline void close_fields(ds_rows *r, uint32_t *next, uint32_t f)
{
    uint32_t *o = r->offsets + r->n_rows * r->n_fields + 1;
    while (*next < f) o[(*next)++] = (uint32_t)r->n_keys;
}

static inline int reject(ds_pctx *c, int reason, uint32_t column)
{
    c->reason = reason;
    c->column = column;
    return 1;
}

static void hll_add(uint8_t *reg, uint64_t h)
{
    uint32_t idx = (uint32_t)(h >> (64 - DS_HLL_BITS));
    uint64_t w = (h << DS_HLL_BITS) | (1ull << (DS_HLL_BITS - 1));
    uint8_t rank = (uint8_t)(__builtin_clzll(w) + 1);
    if (reg[idx] < rank) reg[idx] = rank;
}

static void stats_row(ds_stats *s, const ds_rows *r, size_t row, const uint8_t *missing)
{
    s->rows++;
    s->clicks += r->labels[row] > 0;
    for (uint32_t d = 0; d < r->n_dense; d++) {
        if (missing[d]) {
            s->dense_missing[d]++;
            continue;
        }
        float v = r->dense[row * r->n_dense + d];
        s->dense_sum[d] += v;
        if (v < s->dense_min[d]) s->dense_min[d] = v;
        if (v > s->dense_max[d]) s->dense_max[d] = v;
    }
    const uint32_t *o = r->offsets + row * r->n_fields;
    for (uint32_t f = 0; f < r->n_fields; f++) {
        if (o[f] == o[f + 1]) s->field_missing[f]++;
        for (uint32_t k = o[f]; k < o[f + 1]; k++)
            hll_add(s->hll + ((size_t)f << DS_HLL_BITS), r->keys[k]);
    }
}

/* log2 bucket of a dense value: 0 for |v| < 1, else the signed bit length of |v|; a missing
 * value has its own bucket. The key hashes the bucket as 4 little-endian bytes. */
static int32_t log2_bucket(float v, int missing)
{
    if (missing) return INT32_MIN;
    float m = fabsf(v);
    if (!(m >= 1.0f)) return 0;
    int e;
    frexpf(m, &e);
    return v < 0 ? -e : e;
}

/* Finishes the row: bucket fields, offsets, statistics. */
static int row_commit(ds_pctx *c, ds_rows *r, uint32_t next)
{
    const ds_plan *pl = c->plan;
    size_t row = r->n_rows;
    if (pl->bucketize) {
        for (uint32_t d = 0; d < pl->n_dense; d++) {
            uint32_t f = pl->n_base_fields + d;
            int32_t b = log2_bucket(r->dense[row * pl->n_dense + d], c->missing[d]);
            close_fields(r, &next, f);
            if (row_key(r, XXH3_64bits_withSeed(&b, sizeof b, f), 1.0f) != CM_OK)
                return CM_ENOMEM;
        }
    }
    close_fields(r, &next, pl->n_fields);
    if (c->stats) stats_row(c->stats, r, row, c->missing);
    r->n_rows++;
    return CM_OK;
}

/* ---- delimited text (TSV, CSV) ---- */

static int day_of_week(int y, int m, int d)
{
    static const int t[] = {0, 3, 2, 5, 0, 3, 5, 1, 4, 6, 2, 4};
    if (m < 3) y -= 1;
    return (y + y / 4 - y / 100 + y / 400 + t[m - 1] + d) % 7;
}

/* One column's token into the row; 0, 1 (rejected) or CM_ENOMEM. Always inlined into the
 * column loop: on Criteo a call per column cost more than its work (parsing ~5% faster). */
static inline __attribute__((always_inline)) int put_col(ds_pctx *c, ds_rows *r, const ds_col *col,
                                                         uint32_t colno, const char *tok, size_t tl,
                                                         uint32_t *next)
{
    size_t row = r->n_rows;
    double v;
    switch (col->role) {
    case COL_LABEL:
        if (tl == 0 || parse_num(tok, tl, &v) != 0) return reject(c, DS_REJ_LABEL, colno);
        r->labels[row] = (float)v;
        return 0;
    case COL_DENSE:
        c->missing[col->slot] = tl == 0;
        if (tl && parse_num(tok, tl, &v) != 0) return reject(c, DS_REJ_NUMBER, colno);
        r->dense[row * r->n_dense + col->slot] = tl ? (float)v : 0.0f;
        return 0;
    case COL_CAT:
        if (tl == 0) return 0;
        close_fields(r, next, col->slot);
        return row_key(r, XXH3_64bits_withSeed(tok, tl, col->slot), 1.0f);
    case COL_MULTI: {
        close_fields(r, next, col->slot);
        const char *p = tok, *end = tok + tl;
        while (p < end) {
            const char *q = memchr(p, col->msep, (size_t)(end - p));
            if (q == NULL) q = end;
            if (q > p && row_key(r, XXH3_64bits_withSeed(p, (size_t)(q - p), col->slot), 1.0f))
                return CM_ENOMEM;
            p = q + 1;
        }
        return 0;
    }
    case COL_HOUR: {
        if (tl == 0) return 0;
        int ok = tl == 8;
        for (size_t i = 0; ok && i < 8; i++) ok = is_digit((unsigned char)tok[i]);
        if (!ok) return reject(c, DS_REJ_NUMBER, colno);
        int y = 2000 + (tok[0] - '0') * 10 + (tok[1] - '0');
        int mo = (tok[2] - '0') * 10 + (tok[3] - '0');
        int d = (tok[4] - '0') * 10 + (tok[5] - '0');
        if (mo < 1 || mo > 12 || d < 1 || d > 31) return reject(c, DS_REJ_NUMBER, colno);
        char wd = (char)('0' + day_of_week(y, mo, d));
        close_fields(r, next, col->slot);
        if (row_key(r, XXH3_64bits_withSeed(tok + 6, 2, col->slot), 1.0f)) return CM_ENOMEM;
        close_fields(r, next, col->slot + 1);
        return row_key(r, XXH3_64bits_withSeed(&wd, 1, col->slot + 1), 1.0f);
    }
    default:
        return 0;
    }
}

/* RFC 4180 field starting at the opening quote; unescaped into c->qbuf. Embedded line breaks
 * cannot occur because lines are split first; an unterminated quote is invalid quoting. */
static int scan_quoted(ds_pctx *c, const char **pp, const char *end, char sep, size_t *tl,
                       uint32_t colno)
{
    const char *q = *pp + 1;
    size_t n = 0;
    for (;;) {
        if (q >= end) return reject(c, DS_REJ_QUOTE, colno);
        unsigned char ch = (unsigned char)*q;
        if (ch == '"') {
            if (q + 1 < end && q[1] == '"') {
                q++;
            } else {
                q++;
                break;
            }
        } else if (ch < 0x20 && ch != '\t') {
            return reject(c, DS_REJ_JUNK, colno);
        }
        if (n == DS_MAX_TOKEN) return reject(c, DS_REJ_TOKEN_LONG, colno);
        c->qbuf[n++] = (char)ch;
        q++;
    }
    if (q < end && *q != sep) return reject(c, DS_REJ_QUOTE, colno);
    *pp = q;
    *tl = n;
    return 0;
}

static int parse_delimited(ds_pctx *c, const char *s, size_t len, ds_rows *r)
{
    const ds_plan *pl = c->plan;
    const char *p = s, *end = s + len;
    const unsigned char sep = (unsigned char)pl->sep;
    unsigned thr = sep;
    if (pl->quoting && thr < '"') thr = '"';
    if (thr < 0x1f) thr = 0x1f;
    uint32_t col = 0, next = 0;
    int rc = 0, padded = 0;
    r->labels[r->n_rows] = 0.0f;
    for (;;) {
        const char *tok = p, *q = p;
        size_t tl;
        if (pl->quoting && q < end && *q == '"') {
            if ((rc = scan_quoted(c, &q, end, pl->sep, &tl, col + 1)) != 0) return rc;
            tok = c->qbuf;
        } else {
            while (q < end) {
                unsigned char ch = (unsigned char)*q;
                if (ch <= thr) {
                    if (ch == sep) break;
                    if (ch < 0x20 && ch != '\t') return reject(c, DS_REJ_JUNK, col + 1);
                    if (ch == '"' && pl->quoting) return reject(c, DS_REJ_QUOTE, col + 1);
                }
                q++;
            }
            tl = (size_t)(q - p);
            if (tl > DS_MAX_TOKEN) return reject(c, DS_REJ_TOKEN_LONG, col + 1);
        }
        if (col >= pl->n_cols) return reject(c, DS_REJ_COLUMNS, col + 1);
        if ((rc = put_col(c, r, &pl->cols[col], col + 1, tok, tl, &next)) != 0) return rc;
        col++;
        if (q >= end) break;
        p = q + 1;
    }
    if (col < pl->n_cols) {
        if (col < pl->min_cols) return reject(c, DS_REJ_COLUMNS, col);
        padded = 1;
        for (; col < pl->n_cols; col++)
            if ((rc = put_col(c, r, &pl->cols[col], col + 1, "", 0, &next)) != 0) return rc;
    }
    if ((rc = row_commit(c, r, next)) != CM_OK) return rc;
    return padded ? 2 : 0;
}

/* ---- libsvm / libffm ---- */

static const char *sparse_token(const char *p, const char *end, const char **tend, int *junk)
{
    while (p < end && (*p == ' ' || *p == '\t')) p++;
    const char *q = p;
    while (q < end && *q != ' ' && *q != '\t') {
        if ((unsigned char)*q < 0x20) *junk = 1;
        q++;
    }
    *tend = q;
    return p;
}

static int all_digits(const char *s, size_t n)
{
    if (n == 0) return 0;
    for (size_t i = 0; i < n; i++)
        if (!is_digit((unsigned char)s[i])) return 0;
    return 1;
}

static int sparse_label(ds_pctx *c, const char *tok, size_t tl, ds_rows *r)
{
    double v;
    if (tl == 0 || parse_num(tok, tl, &v) != 0) return reject(c, DS_REJ_LABEL, 1);
    /* binary labels come as 0/1 or -1/+1 */
    r->labels[r->n_rows] = v > 0 ? 1.0f : 0.0f;
    return 0;
}

static int kv_push(ds_pctx *c, uint32_t field, uint64_t key, float w)
{
    size_t n = c->cnt[c->plan->n_fields]; /* the spare last counter holds the length */
    if (n == c->kv_cap) {
        size_t cap = c->kv_cap ? c->kv_cap * 2 : 64;
        void *kv = realloc(c->kv, cap * sizeof *c->kv);
        if (kv == NULL) return CM_ENOMEM;
        c->kv = kv;
        c->kv_cap = cap;
    }
    c->kv[n] = (struct ffm_kv){.field = field, .key = key, .w = w};
    c->cnt[c->plan->n_fields] = (uint32_t)(n + 1);
    c->cnt[field]++;
    return CM_OK;
}

static int parse_sparse(ds_pctx *c, const char *s, size_t len, ds_rows *r)
{
    const ds_plan *pl = c->plan;
    const int ffm = pl->fmt == DS_FMT_LIBFFM;
    const char *end = s + len, *te;
    int junk = 0, rc;
    uint32_t nf = pl->n_fields;
    memset(c->cnt, 0, ((size_t)nf + 1) * sizeof *c->cnt);
    const char *tok = sparse_token(s, end, &te, &junk);
    if (junk) return reject(c, DS_REJ_JUNK, 1);
    if ((rc = sparse_label(c, tok, (size_t)(te - tok), r)) != 0) return rc;
    for (uint32_t feat = 2;; feat++) {
        tok = sparse_token(te, end, &te, &junk);
        if (junk) return reject(c, DS_REJ_JUNK, feat);
        if (tok == te) break;
        if ((size_t)(te - tok) > DS_MAX_TOKEN) return reject(c, DS_REJ_TOKEN_LONG, feat);
        const char *c1 = memchr(tok, ':', (size_t)(te - tok));
        if (c1 == NULL) return reject(c, DS_REJ_FEATURE, feat);
        uint32_t field = 0;
        const char *idx = tok;
        if (ffm) {
            if (!all_digits(tok, (size_t)(c1 - tok)) || c1 - tok > 7)
                return reject(c, DS_REJ_FEATURE, feat);
            for (const char *d = tok; d < c1; d++) field = field * 10 + (uint32_t)(*d - '0');
            if (field >= nf) return reject(c, DS_REJ_FEATURE, feat);
            idx = c1 + 1;
            c1 = memchr(idx, ':', (size_t)(te - idx));
            if (c1 == NULL) return reject(c, DS_REJ_FEATURE, feat);
        }
        double v;
        if (!all_digits(idx, (size_t)(c1 - idx)) || parse_num(c1 + 1, (size_t)(te - c1 - 1), &v))
            return reject(c, DS_REJ_FEATURE, feat);
        if (kv_push(c, field, XXH3_64bits_withSeed(idx, (size_t)(c1 - idx), field), (float)v))
            return CM_ENOMEM;
    }
    /* group by field (stable), since libffm fields come in any order */
    size_t n = c->cnt[nf];
    if (ds_rows_reserve_keys(r, r->n_keys + n) != CM_OK) return CM_ENOMEM;
    uint32_t *o = r->offsets + r->n_rows * nf;
    uint32_t pos = o[0];
    for (uint32_t f = 0; f < nf; f++) {
        uint32_t k = c->cnt[f];
        c->cnt[f] = pos;
        pos += k;
        o[f + 1] = pos;
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t at = c->cnt[c->kv[i].field]++;
        r->keys[at] = c->kv[i].key;
        r->weights[at] = c->kv[i].w;
    }
    r->n_keys += n;
    return row_commit(c, r, nf);
}

int ds_parse_line(ds_pctx *c, const char *line, size_t len, ds_rows *r)
{
    if (ds_rows_reserve_rows(r, r->n_rows + 1) != CM_OK) return CM_ENOMEM;
    size_t keys0 = r->n_keys;
    int rc;
    if (c->plan->fmt == DS_FMT_LIBSVM || c->plan->fmt == DS_FMT_LIBFFM)
        rc = parse_sparse(c, line, len, r);
    else
        rc = parse_delimited(c, line, len, r);
    if (rc == 1 || rc < 0) r->n_keys = keys0; /* drop the half-built row */
    return rc;
}

/* ---- the public one-buffer parser ---- */

struct ds_parser {
    ds_plan *base; /* from the options */
    ds_plan *cur;  /* base, or the plan of the last header */
    ds_pctx ctx;
    ds_rows rows;
    int ready;
};

static int parser_use(ds_parser *p, ds_plan *plan, char **errptr)
{
    ds_pctx_free(&p->ctx);
    if (ds_pctx_init(&p->ctx, plan, NULL) != CM_OK)
        return cm_err(errptr, CM_ENOMEM, "out of memory");
    ds_rows_free(&p->rows);
    ds_rows_init(&p->rows, plan->n_dense, plan->n_fields, plan->has_weights);
    p->cur = plan;
    p->ready = 1;
    return CM_OK;
}

int ds_parser_create(const ds_parser_opts *opts, ds_parser **out, char **errptr)
{
    ds_parser *p = calloc(1, sizeof *p);
    if (p == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    int rc = ds_plan_create(opts, &p->base, errptr);
    if (rc == CM_OK && !(p->base->header && p->base->fmt != DS_FMT_CSV))
        rc = parser_use(p, p->base, errptr);
    if (rc != CM_OK) {
        ds_parser_destroy(p);
        return rc;
    }
    *out = p;
    return CM_OK;
}

void ds_parser_destroy(ds_parser *p)
{
    if (p == NULL) return;
    ds_pctx_free(&p->ctx);
    ds_rows_free(&p->rows);
    if (p->cur != p->base) ds_plan_destroy(p->cur);
    ds_plan_destroy(p->base);
    free(p);
}

int ds_parser_wants_header(const ds_parser *p)
{
    return p->base->header;
}

int ds_parser_header(ds_parser *p, const char *line, size_t len, char **errptr)
{
    ds_plan *np = NULL;
    int rc = ds_plan_from_header(p->base, line, len, &np, errptr);
    if (rc != CM_OK || np == NULL) return rc;
    if (p->cur != NULL && p->cur != p->base && !ds_plan_same_schema(p->cur, np)) {
        ds_plan_destroy(np);
        return cm_err(errptr, CM_EINVAL, "header gives a different schema than before");
    }
    ds_plan *old = p->cur;
    rc = parser_use(p, np, errptr);
    if (rc != CM_OK) {
        ds_plan_destroy(np);
        return rc;
    }
    if (old != p->base) ds_plan_destroy(old);
    return CM_OK;
}

const ds_schema *ds_parser_schema(const ds_parser *p)
{
    return p->ready ? &p->cur->schema : NULL;
}

int ds_parser_parse(ds_parser *p, const char *text, size_t len, ds_batch *out,
                    ds_parse_report *rep, char **errptr)
{
    memset(rep, 0, sizeof *rep);
    if (!p->ready) return cm_err(errptr, CM_EINVAL, "parser needs the header line first");
    ds_rows_clear(&p->rows);
    const char *s = text, *end = text + len, *line;
    size_t n;
    for (uint64_t phys = 1; ds_next_line(&s, end, &line, &n); phys++) {
        if (n == 0) continue;
        rep->lines++;
        int rc = ds_parse_line(&p->ctx, line, n, &p->rows);
        if (rc < 0) return cm_err(errptr, rc, "out of memory");
        if (rc == 1) {
            if (rep->rejected++ == 0) {
                rep->first_bad = phys;
                rep->first_reason = p->ctx.reason;
                rep->first_column = p->ctx.column;
            }
        } else {
            rep->rows++;
            rep->padded += rc == 2;
        }
    }
    ds_rows_view(&p->rows, 0, p->rows.n_rows, out);
    return CM_OK;
}
