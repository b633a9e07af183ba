/* Any bytes through any format: the parser must not crash, must balance its counts, and must
 * produce a consistent CSR batch. Byte 0 picks the format and bucketize; for header formats the
 * first line is the header. */
#include <stdlib.h>
#include <string.h>

#include "datasets/datasets.h"

static const char *SCHEMA = "label y\ndense a\ncat b\nmulti c |\nskip d\nhour e\n";

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
    ds_parser *p = NULL;
    if (ds_parser_create(&o, &p, NULL) != 0) abort();
    const char *text = (const char *)data;
    if (ds_parser_wants_header(p)) {
        const char *nl = memchr(text, '\n', size);
        size_t hl = nl ? (size_t)(nl - text) : size;
        if (ds_parser_header(p, text, hl, NULL) != 0) {
            ds_parser_destroy(p);
            return 0;
        }
        size_t skip = nl ? hl + 1 : hl;
        text += skip;
        size -= skip;
    }
    ds_batch b;
    ds_parse_report r;
    if (ds_parser_parse(p, text, size, &b, &r, NULL) != 0) abort();
    if (r.lines != r.rows + r.rejected || b.n_rows != r.rows) abort();
    if (b.offsets[(size_t)b.n_rows * b.n_fields] != b.n_keys) abort();
    for (size_t i = 0; i < (size_t)b.n_rows * b.n_fields; i++)
        if (b.offsets[i] > b.offsets[i + 1]) abort();
    ds_parser_destroy(p);
    return 0;
}
