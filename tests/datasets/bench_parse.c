#define _GNU_SOURCE /* memrchr */
/* Single-core parse throughput: ds_bench_parse [FILE] (Criteo TSV; default: a synthetic
 * 64 MB). Prints MB/s and rows/s of ds_parser_parse alone, then one JSON line. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "datasets/datasets.h"

int main(int argc, char **argv)
{
    char *text = NULL, *err = NULL;
    size_t len = 0;
    if (argc > 1) {
        if (cm_read_file(argv[1], (void **)&text, &len, &err) != 0) {
            fprintf(stderr, "%s\n", err);
            return 1;
        }
    } else {
        size_t cap = 64u << 20;
        text = malloc(cap + 512);
        uint64_t x = 1;
        for (int i = 0; len < cap; i++) {
            len += (size_t)sprintf(text + len, "%d", i % 4 == 0);
            for (int d = 0; d < 13; d++) {
                x = x * 6364136223846793005ull + 1442695040888963407ull;
                if ((x >> 60) == 0) len += (size_t)sprintf(text + len, "\t");
                else len += (size_t)sprintf(text + len, "\t%u", (unsigned)(x >> 33) % (d == 4 ? 100000 : 300));
            }
            for (int c = 0; c < 26; c++) {
                x = x * 6364136223846793005ull + 1442695040888963407ull;
                if ((x >> 61) == 0) len += (size_t)sprintf(text + len, "\t");
                else len += (size_t)sprintf(text + len, "\t%08x", (unsigned)(x >> 32));
            }
            text[len++] = '\n';
        }
    }
    ds_parser_opts o;
    ds_parser_opts_init(&o);
    ds_parser *p = NULL;
    if (ds_parser_create(&o, &p, &err) != 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    /* parse in 4 MB pieces cut at line ends, as ingest workers do */
    double best = 1e9;
    uint64_t rows = 0;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = cm_now();
        rows = 0;
        for (size_t off = 0; off < len;) {
            size_t n = len - off < (4u << 20) ? len - off : (4u << 20);
            const char *nl = memrchr(text + off, '\n', n);
            if (nl && off + n < len) n = (size_t)(nl - (text + off)) + 1;
            ds_batch b;
            ds_parse_report r;
            ds_parser_parse(p, text + off, n, &b, &r, &err);
            rows += r.rows;
            off += n;
        }
        double dt = cm_now() - t0;
        if (dt < best) best = dt;
    }
    printf("parse: %zu bytes, %llu rows, %.3f s, %.1f MB/s, %.0f rows/s (one core)\n", len,
           (unsigned long long)rows, best, (double)len / best / 1e6, (double)rows / best);
    printf("{\"bytes\": %zu, \"rows\": %llu, \"seconds\": %.4f, \"mb_per_s\": %.1f, \"rows_per_s\": %.0f}\n",
           len, (unsigned long long)rows, best, (double)len / best / 1e6, (double)rows / best);
    ds_parser_destroy(p);
    free(text);
    return 0;
}
