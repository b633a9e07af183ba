/* Any bytes through any format: the parser must not crash, must balance its counts, and must
 * produce a consistent CSR batch, and the SIMD separator search must give exactly what the
 * byte loop gives (ds_parser_opts.scalar_scan). Byte 0 picks the format and bucketize; for
 * header formats the first line is the header. */
#include <stdlib.h>
#include <string.h>

#include "datasets/datasets.h"

static const char *SCHEMA = "label y\ndense a\ncat b\nmulti c |\nskip d\nhour e\n";

/* memcmp of n bytes, where an empty batch's arrays may be NULL (memcmp's may not). */
static int same(const void *a, const void *b, size_t n)
{
    return n == 0 || memcmp(a, b, n) == 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    ds_parser_opts o;
    ds_parser_opts_init(&o);
    o.format = (ds_format)(data[0] % 6);
    o.bucketize = (data[0] >> 3) & 1;
    o.ffm_fields = 1 + (data[0] >> 4);
    o.schema_text = SCHEMA;
    data++;
    size--;
    const char *text = (const char *)data;
    ds_parser *p[2] = {NULL, NULL};
    ds_batch b[2];
    ds_parse_report r[2];
    for (int k = 0; k < 2; k++) {
        o.scalar_scan = k;
        if (ds_parser_create(&o, &p[k], NULL) != 0) abort();
        const char *t = text;
        size_t n = size;
        if (ds_parser_wants_header(p[k])) {
            const char *nl = memchr(t, '\n', n);
            size_t hl = nl ? (size_t)(nl - t) : n;
            if (ds_parser_header(p[k], t, hl, NULL) != 0) {
                ds_parser_destroy(p[0]);
                ds_parser_destroy(p[1]);
                return 0;
            }
            size_t skip = nl ? hl + 1 : hl;
            t += skip;
            n -= skip;
        }
        if (ds_parser_parse(p[k], t, n, &b[k], &r[k], NULL) != 0) abort();
        if (r[k].lines != r[k].rows + r[k].rejected || b[k].n_rows != r[k].rows) abort();
        if (b[k].offsets[(size_t)b[k].n_rows * b[k].n_fields] != b[k].n_keys) abort();
        for (size_t i = 0; i < (size_t)b[k].n_rows * b[k].n_fields; i++)
            if (b[k].offsets[i] > b[k].offsets[i + 1]) abort();
    }
    if (memcmp(&r[0], &r[1], sizeof r[0]) != 0 || b[0].n_rows != b[1].n_rows ||
        b[0].n_keys != b[1].n_keys || !same(b[0].labels, b[1].labels, (size_t)b[0].n_rows * 4) ||
        !same(b[0].dense, b[1].dense, (size_t)b[0].n_rows * b[0].n_dense * 4) ||
        !same(b[0].offsets, b[1].offsets, ((size_t)b[0].n_rows * b[0].n_fields + 1) * 4) ||
        !same(b[0].keys, b[1].keys, b[0].n_keys * 8))
        abort();
    ds_parser_destroy(p[0]);
    ds_parser_destroy(p[1]);
    return 0;
}
