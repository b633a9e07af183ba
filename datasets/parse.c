/* The hot path: hand-written tokenizers that turn one line into one row. Integers and short
 * decimals are parsed without strtod; keys are inline xxh3. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "datasets/ds_internal.h"

uint64_t ds_key(const char *tok, size_t len, uint32_t field)
{
    return XXH3_64bits_withSeed(tok, len, field);
}

/* ds_key in the parsers. XXH3_64bits_withSeed is not inlined (its long-input path is large)
 * and nearly every token is at most 16 bytes, so that case calls the routine xxh3 itself uses
 * for it (same secret, same seed: the same keys, tested against ds_key), inlined. */
static inline uint64_t tok_key(const char *tok, size_t len, uint32_t field)
{
#if XXH_VERSION_NUMBER >= 800 && XXH_VERSION_NUMBER < 900
    if (len <= 16) return XXH3_len_0to16_64b((const xxh_u8 *)tok, len, XXH3_kSecret, field);
#endif
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
    c->missing = calloc((size_t)plan->n_dense + 1, sizeof *c->missing);
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
 * strtod on a bounded copy. Only [0-9+-.eE] are accepted (no hex, inf, nan, spaces), and only
 * values that stay finite as a float. */
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
    /* rows hold binary32: a value at or above FLT_MAX + half an ulp would round to inf there
     * (the fast path's 15 digits never get near it) */
    if (endp != buf + n || !(fabs(d) < 0x1.ffffffp+127)) return -1;
    *out = d;
    return 0;
}

/* The value of the n (1..8) digits that end at e, read as one 8-byte word (the 8 bytes
 * before e must be readable), or -1 when one of them is not a digit. No loop: a loop's exit
 * mispredicted on nearly every number, since their lengths follow no pattern. The bytes
 * before the number are replaced by '0', then the digits are checked and combined in pairs,
 * fours and eights (the first digit is the lowest byte). */
static inline int64_t digits8(const char *e, size_t n)
{
    uint64_t v, lead = (~0ull >> (8 * n - 1)) >> 1; /* the 8 - n bytes before the number */
    memcpy(&v, e - 8, 8);
    v = (v & ~lead) | (0x3030303030303030ull & lead);
    if (((v & 0xf0f0f0f0f0f0f0f0ull) |
         (((v + 0x0606060606060606ull) & 0xf0f0f0f0f0f0f0f0ull) >> 4)) != 0x3333333333333333ull)
        return -1;
    v -= 0x3030303030303030ull;
    v = v * 10 + (v >> 8); /* byte 2i: digits 2i, 2i + 1 */
    v = ((v & 0x000000ff000000ffull) * (100 + (1000000ull << 32)) +
         ((v >> 16) & 0x000000ff000000ffull) * (1 + (10000ull << 32))) >>
        32;
    return (int64_t)v;
}

/* Most dense values are short integers: those are converted here, inline, as parse_num would
 * (up to 15 digits, so exact in a double, optional '-'); anything else goes to parse_num.
 * With swar, numbers of up to 8 digits whose 8 bytes before their end lie at or after
 * readable are read by digits8; otherwise (and with ds_parser_opts.scalar_scan) digit by
 * digit. */
static inline int parse_num_inline(const char *s, size_t n, const char *readable, int swar,
                                   double *out)
{
    const char *p = s, *e = s + n;
    int neg = p < e && *p == '-';
    p += neg;
    if (p == e || e - p > 15) return parse_num(s, n, out);
    if (swar && e - p <= 8 && e - readable >= 8) {
        int64_t d = digits8(e, (size_t)(e - p));
        if (d < 0) return parse_num(s, n, out);
        *out = neg ? -(double)d : (double)d;
        return 0;
    }
    uint64_t m = 0;
    for (; p < e; p++) {
        unsigned d = (unsigned)(unsigned char)*p - '0';
        if (d > 9) return parse_num(s, n, out);
        m = m * 10 + d;
    }
    double v = (double)m;
    *out = neg ? -v : v;
    return 0;
}

/* ---- row building: keys are appended field by field in increasing field order ---- */

/* Where the row being parsed puts its keys. Kept in locals rather than in the ds_rows: to the
 * compiler a key store (uint64_t) may change r's size_t fields, which forced a reload of
 * n_keys and n_rows around every key. Room for the whole row is reserved before it starts. */
typedef struct row_out {
    uint64_t *keys; /* r->keys */
    size_t nk;      /* keys so far; r->n_keys once the row is committed */
    uint32_t *o;    /* this row's offsets + 1: o[f] is where field f ends */
    uint32_t next;  /* fields below next are closed */
    float *label;   /* this row's label and dense values (for the same reason: r->n_rows
                     * and r->n_dense had to be reloaded after every key and flag store) */
    float *dense;
} row_out;

static inline row_out row_out_start(const ds_rows *r)
{
    return (row_out){.keys = r->keys,
                     .nk = r->n_keys,
                     .o = r->offsets + r->n_rows * r->n_fields + 1,
                     .label = r->labels + r->n_rows,
                     .dense = r->dense + r->n_rows * r->n_dense};
}

static inline void row_key(row_out *ro, uint64_t key)
{
    ro->keys[ro->nk++] = key;
}

/* Ends every field below f: their key lists are complete. */
static inline void close_fields(row_out *ro, uint32_t f)
{
    while (ro->next < f)
        ro->o[ro->next++] = (uint32_t)ro->nk;
}

static inline int reject(ds_pctx *c, int reason, uint32_t column)
{
    c->reason = reason;
    c->column = column;
    return 1;
}

static void stats_row(ds_stats *s, const ds_rows *r, size_t row, const uint32_t *missing,
                      int field_stats)
{
    s->rows++;
    s->clicks += r->labels[row] > 0;
    /* Without branches (whether a value is missing follows no pattern the predictor can
     * learn): a missing value adds 0 to the sum, which leaves it as it is (a sum that starts
     * at +0 is never -0), and +inf / -inf to the minimum / maximum. */
    const float *v = r->dense + row * r->n_dense;
    for (uint32_t d = 0; d < r->n_dense; d++) {
        int miss = missing[d] != 0;
        float lo = miss ? INFINITY : v[d], hi = miss ? -INFINITY : v[d];
        s->dense_missing[d] += (uint64_t)miss;
        s->dense_sum[d] += miss ? 0.0 : (double)v[d];
        s->dense_min[d] = lo < s->dense_min[d] ? lo : s->dense_min[d];
        s->dense_max[d] = hi > s->dense_max[d] ? hi : s->dense_max[d];
    }
    const uint32_t *o = r->offsets + row * r->n_fields, k = o[r->n_fields] - o[0];
    s->max_row_keys = k > s->max_row_keys ? k : s->max_row_keys;
    if (!field_stats) return;
    for (uint32_t f = 0; f < r->n_fields; f++)
        ds_stats_add_field(s, f, r->keys + o[f], o[f + 1] - o[f], o[f] == o[f + 1]);
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

/* Finishes the row: bucket fields (room reserved with the row's other keys), offsets,
 * statistics. */
static void row_commit(ds_pctx *c, ds_rows *r, row_out *ro)
{
    const ds_plan *pl = c->plan;
    size_t row = r->n_rows;
    if (pl->bucketize) {
        for (uint32_t d = 0; d < pl->n_dense; d++) {
            uint32_t f = pl->n_base_fields + d;
            int32_t b = log2_bucket(r->dense[row * pl->n_dense + d], c->missing[d]);
            close_fields(ro, f);
            row_key(ro, tok_key((const char *)&b, sizeof b, f));
        }
    }
    close_fields(ro, pl->n_fields);
    r->n_keys = ro->nk;
    if (c->stats) stats_row(c->stats, r, row, c->missing, !c->block_field_stats);
    r->n_rows++;
}

/* ---- delimited text (TSV, CSV) ---- */

static int day_of_week(int y, int m, int d)
{
    static const int t[] = {0, 3, 2, 5, 0, 3, 5, 1, 4, 6, 2, 4};
    if (m < 3) y -= 1;
    return (y + y / 4 - y / 100 + y / 400 + t[m - 1] + d) % 7;
}

static int days_in_month(int y, int m)
{
    static const int days[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    int leap = y % 4 == 0 && (y % 100 != 0 || y % 400 == 0);
    return days[m - 1] + (m == 2 && leap);
}

/* One column's token into the row; 0, 1 (rejected) or CM_ENOMEM. Always inlined into the
 * column loop: on Criteo a call per column cost more than its work (parsing ~5% faster). */
static inline __attribute__((always_inline)) int put_col(ds_pctx *c, const ds_col *col,
                                                         uint32_t colno, const char *tok, size_t tl,
                                                         const char *readable, int swar,
                                                         row_out *ro)
{
    double v;
    switch (col->role) {
    case COL_LABEL:
        /* a click label is a probability: the loss and metrics_logloss take [0, 1] only, so a
         * "2" or "-1" is refused here rather than a run later, far from its line */
        if (tl == 0 || parse_num_inline(tok, tl, readable, swar, &v) != 0 || !(v >= 0 && v <= 1))
            return reject(c, DS_REJ_LABEL, colno);
        *ro->label = (float)v;
        return 0;
    case COL_DENSE:
        c->missing[col->slot] = tl == 0;
        if (tl && parse_num_inline(tok, tl, readable, swar, &v) != 0)
            return reject(c, DS_REJ_NUMBER, colno);
        ro->dense[col->slot] = tl ? (float)v : 0.0f;
        return 0;
    case COL_CAT:
        if (tl == 0) return 0;
        close_fields(ro, col->slot);
        row_key(ro, tok_key(tok, tl, col->slot));
        return 0;
    case COL_MULTI: {
        close_fields(ro, col->slot);
        const char *p = tok, *end = tok + tl;
        while (p < end) {
            const char *q = memchr(p, col->msep, (size_t)(end - p));
            if (q == NULL) q = end;
            if (q > p) row_key(ro, tok_key(p, (size_t)(q - p), col->slot));
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
        int hh = (tok[6] - '0') * 10 + (tok[7] - '0');
        /* a date that does not exist (Feb 30, Apr 31) or hour 24..99 is damage: its weekday
         * and hour-of-day keys would look like real ones */
        if (mo < 1 || mo > 12 || d < 1 || d > days_in_month(y, mo) || hh > 23)
            return reject(c, DS_REJ_NUMBER, colno);
        char wd = (char)('0' + day_of_week(y, mo, d));
        close_fields(ro, col->slot);
        row_key(ro, tok_key(tok + 6, 2, col->slot));
        close_fields(ro, col->slot + 1);
        row_key(ro, tok_key(&wd, 1, col->slot + 1));
        return 0;
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

/* ---- separator search ----
 *
 * A stop is a byte that ends an unquoted token or rejects the line: the separator, a control
 * byte other than tab, and '"' when the format quotes. Stops are found 64 bytes at a time as a
 * bit mask, so a Criteo token of ~6 bytes costs a count-trailing-zeros instead of a compare and
 * a branch per byte. The mask comes from SSE2 (part of every x86-64) or from a byte loop (other
 * machines, and ds_parser_opts.scalar_scan); tests/datasets/test_parse.c checks that both
 * parse every line the same. */
typedef struct stop_scan {
    uintptr_t base; /* the window: mask bit i is the byte at base + i; 0 = no window yet */
    uint64_t mask;
    const unsigned char *line, *end;
    unsigned char sep, quote; /* quote = sep when the format does not quote */
    int scalar;
} stop_scan;

static uint64_t stop_mask_scalar(const unsigned char *p, unsigned char sep, unsigned char quote)
{
    uint64_t m = 0;
    for (unsigned i = 0; i < 64; i++) {
        unsigned char ch = p[i];
        m |= (uint64_t)(ch == sep || ch == quote || (ch < 0x20 && ch != '\t')) << i;
    }
    return m;
}

#if defined(__SSE2__)
static inline uint64_t stop_mask_sse2(const unsigned char *p, unsigned char sep,
                                      unsigned char quote)
{
    const __m128i vs = _mm_set1_epi8((char)sep), vq = _mm_set1_epi8((char)quote);
    const __m128i vc = _mm_set1_epi8(0x1f), vt = _mm_set1_epi8('\t');
    uint64_t m = 0;
    for (unsigned i = 0; i < 4; i++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(const void *)(p + 16 * i));
        /* unsigned v <= 0x1f, tab excepted */
        __m128i ctl =
            _mm_andnot_si128(_mm_cmpeq_epi8(v, vt), _mm_cmpeq_epi8(_mm_min_epu8(v, vc), v));
        __m128i st = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, vs), _mm_cmpeq_epi8(v, vq)), ctl);
        m |= (uint64_t)(uint16_t)_mm_movemask_epi8(st) << (16 * i);
    }
    return m;
}
#endif

static inline uint64_t stop_mask(const stop_scan *sc, const unsigned char *p)
{
#if defined(__SSE2__)
    if (!sc->scalar) return stop_mask_sse2(p, sc->sep, sc->quote);
#endif
    return stop_mask_scalar(p, sc->sep, sc->quote);
}

/* Sets the window to hold q. Never reads outside [line, end): a window that would pass the
 * end is moved back to end the line, and a line shorter than 64 bytes is copied first. */
static void stop_load(stop_scan *sc, const unsigned char *q)
{
    size_t n = (size_t)(sc->end - sc->line);
    if (sc->end - q >= 64) {
        sc->base = (uintptr_t)q;
        sc->mask = stop_mask(sc, q);
    } else if (n >= 64) {
        sc->base = (uintptr_t)(sc->end - 64);
        sc->mask = stop_mask(sc, sc->end - 64);
    } else {
        unsigned char tmp[64] = {0};
        memcpy(tmp, sc->line, n);
        sc->base = (uintptr_t)sc->line;
        sc->mask = stop_mask(sc, tmp) & ((1ull << n) - 1);
    }
}

/* The first stop at or after q, or end. */
static inline const unsigned char *next_stop(stop_scan *sc, const unsigned char *q)
{
    for (;;) {
        uintptr_t off = (uintptr_t)q - sc->base;
        if (off < 64) {
            uint64_t m = sc->mask >> off;
            if (m) return q + __builtin_ctzll(m);
            q = (const unsigned char *)(sc->base + 64);
        }
        if (q >= sc->end) return sc->end;
        stop_load(sc, q);
    }
}

/* One delimited line; quoting is a constant in each of the two copies parse_delimited makes,
 * so the unquoted formats (TSV) test for no opening quote per column. */
static inline __attribute__((always_inline)) int
parse_delimited_as(ds_pctx *c, const char *s, size_t len, ds_rows *r, const int quoting)
{
    const ds_plan *pl = c->plan;
    const char *p = s, *end = s + len;
    const unsigned char sep = (unsigned char)pl->sep;
    stop_scan sc = {.base = 0,
                    .line = (const unsigned char *)s,
                    .end = (const unsigned char *)end,
                    .sep = sep,
                    .quote = quoting ? (unsigned char)'"' : sep,
                    .scalar = pl->scalar_scan};
    /* in locals: the flag and offset stores of the row (uint32_t) may alias the plan's
     * fields as far as the compiler knows, which forced a reload per column */
    const uint32_t n_cols = pl->n_cols;
    const ds_col *cols = pl->cols;
    const int swar = !pl->scalar_scan; /* numbers too: the byte loop is the plain path */
    uint32_t col = 0;
    int rc = 0, padded = 0;
    /* keys of this row: one per cat column, two per hour column, at most one per two bytes of
     * a multi column, one per bucket field */
    size_t most = len + 2 * (size_t)pl->n_cols + pl->n_dense + 1;
    if (r->cap_keys - r->n_keys < most && ds_rows_reserve_keys(r, r->n_keys + most) != CM_OK)
        return CM_ENOMEM;
    row_out ro = row_out_start(r);
    *ro.label = 0.0f;
    for (;;) {
        const char *tok = p, *q = p;
        size_t tl;
        if (quoting && q < end && *q == '"') {
            if ((rc = scan_quoted(c, &q, end, pl->sep, &tl, col + 1)) != 0) return rc;
            tok = c->qbuf;
        } else {
            q = (const char *)next_stop(&sc, (const unsigned char *)p);
            if (q < end && (unsigned char)*q != sep) /* '"' or a control byte */
                return reject(c, (unsigned char)*q < 0x20 ? DS_REJ_JUNK : DS_REJ_QUOTE, col + 1);
            tl = (size_t)(q - p);
            if (tl > DS_MAX_TOKEN) return reject(c, DS_REJ_TOKEN_LONG, col + 1);
        }
        if (col >= n_cols) return reject(c, DS_REJ_COLUMNS, col + 1);
        /* a number may be read from the 8 bytes before its end where they are in the line
         * (for a quoted token, unescaped into qbuf: in the token) */
        const char *readable = tok == p ? s : tok;
        if ((rc = put_col(c, &cols[col], col + 1, tok, tl, readable, swar, &ro)) != 0) return rc;
        col++;
        if (q >= end) break;
        p = q + 1;
    }
    if (col < n_cols) {
        if (col < pl->min_cols) return reject(c, DS_REJ_COLUMNS, col);
        padded = 1;
        for (; col < n_cols; col++)
            if ((rc = put_col(c, &cols[col], col + 1, "", 0, "", 0, &ro)) != 0) return rc;
    }
    row_commit(c, r, &ro);
    return padded ? 2 : 0;
}

static int parse_delimited(ds_pctx *c, const char *s, size_t len, ds_rows *r)
{
    return c->plan->quoting ? parse_delimited_as(c, s, len, r, 1)
                            : parse_delimited_as(c, s, len, r, 0);
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
    /* SVMlight's own additions to libsvm lines: "# info" to the end of the line, and a query id
     * right after the label ("qid:17", for ranking data), neither of them a feature. */
    const char *hash = ffm ? NULL : memchr(s, '#', len);
    if (hash != NULL) end = hash;
    const char *tok = sparse_token(s, end, &te, &junk);
    if (junk) return reject(c, DS_REJ_JUNK, 1);
    if ((rc = sparse_label(c, tok, (size_t)(te - tok), r)) != 0) return rc;
    for (uint32_t feat = 2;; feat++) {
        tok = sparse_token(te, end, &te, &junk);
        if (junk) return reject(c, DS_REJ_JUNK, feat);
        if (tok == te) break;
        if (feat == 2 && !ffm && te - tok > 4 && !memcmp(tok, "qid:", 4)) {
            if (!all_digits(tok + 4, (size_t)(te - tok - 4)))
                return reject(c, DS_REJ_FEATURE, feat);
            continue;
        }
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
        /* the index is a number: 007 is feature 7 (as the field id already was), not a key
         * of its own */
        while (c1 - idx > 1 && *idx == '0')
            idx++;
        if (kv_push(c, field, tok_key(idx, (size_t)(c1 - idx), field), (float)v)) return CM_ENOMEM;
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
    row_out ro = row_out_start(r);
    ro.next = nf;
    row_commit(c, r, &ro);
    return 0;
}

int ds_parse_line(ds_pctx *c, const char *line, size_t len, ds_rows *r)
{
    if (ds_rows_room(r, r->n_rows + 1) != CM_OK) return CM_ENOMEM;
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
