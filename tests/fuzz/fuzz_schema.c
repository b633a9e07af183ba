/* Any bytes as a CSV schema file: refused cleanly or usable on a line. */
#include <stdlib.h>
#include <string.h>

#include "datasets/datasets.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    memcpy(text, data, size);
    text[size] = '\0';
    ds_parser_opts o;
    ds_parser_opts_init(&o);
    o.format = DS_FMT_CSV;
    o.schema_text = text;
    ds_parser *p = NULL;
    char *err = NULL;
    if (ds_parser_create(&o, &p, &err) == 0) {
        const char *line = "1,2,a|b,\"c\"\"d\",14102100,x\n";
        ds_batch b;
        ds_parse_report r;
        if (ds_parser_header(p, "y,a,b,c,d,e", 11, NULL) == 0 &&
            ds_parser_parse(p, line, strlen(line), &b, &r, NULL) != 0)
            abort();
        ds_parser_destroy(p);
    } else if (err == NULL) {
        abort(); /* a refusal always says why */
    }
    free(err);
    free(text);
    return 0;
}
