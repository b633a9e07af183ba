/* ember ingest: a thin shell over ds_ingest_run (datasets/datasets.h). */
#include <dlfcn.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "datasets/datasets.h"
#include "src/cli.h"

static void ingest_usage(FILE *to)
{
    fprintf(
        to,
        "usage: ember ingest --format criteo|criteo-csv|avazu|libsvm|libffm|csv [--schema FILE]\n"
        "                    --out DIR [--shards N] [--eval-fraction F] [--split-seed S]\n"
        "                    [--strict] [--bucketize] [--threads N] [--block-rows N]\n"
        "                    [--ffm-fields N] [--buffered] [--no-label] [--] FILE...\n"
        "Converts click logs (plain, .gz or .zst) into checksummed shards in DIR/train and\n"
        "DIR/eval, writes DIR/stats.json, and prints one JSON line of counts on stdout.\n"
        "Malformed lines are reported on stderr and skipped (--strict: stop, exit 1).\n"
        "--no-label: criteo TSV rows without the label column (Criteo's test.txt).\n"
        "Shards are written with O_DIRECT where the file system allows it (--buffered: through\n"
        "the page cache, so a trainer started right after reads them from memory).\n"
        "See docs/INGEST.md.\n");
}

/* Parses an unsigned decimal option value; 0 when it is not one. */
static int parse_u64(const char *s, unsigned long long max, unsigned long long *out)
{
    char *end;
    if (s == NULL || *s == '\0' || *s == '-') return 0;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end != '\0' || v > max) return 0;
    *out = v;
    return 1;
}

/* The ember binary links OpenBLAS for the trainer, and OpenBLAS's pthread build starts its
 * worker threads when it is loaded; idle, they spin in sched_yield for a while (~2^28 cycles
 * each) before they sleep: 2-5% of the CPU of an ingest, which does no BLAS at all, and more
 * when other processes share the cores. openblas_set_num_threads(1) does not stop threads
 * that already run; blas_thread_shutdown_ (what OpenBLAS calls before a fork) does. It is
 * looked up rather than linked because it is internal to that build: other BLAS builds lack
 * it, and then there is nothing to stop. A later BLAS call would start the threads again. */
static void stop_blas_threads(void)
{
    int (*shutdown)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "blas_thread_shutdown_");
    if (shutdown != NULL) shutdown();
}

int cmd_ingest(int argc, char **argv)
{
    ds_ingest_opts o;
    ds_ingest_opts_init(&o);
    const char *format = NULL;
    const char **inputs = calloc((size_t)argc + 1, sizeof *inputs);
    size_t n_inputs = 0;
    int rc = 2;
    if (inputs == NULL) {
        fprintf(stderr, "ember ingest: out of memory\n");
        return 1;
    }
    bool files_only = false; /* after "--": every argument is an input, "--x" too */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        unsigned long long n;
        if (files_only) {
            inputs[n_inputs++] = a;
            continue;
        } else if (strcmp(a, "--") == 0) {
            files_only = true;
            continue;
        } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            ingest_usage(stdout);
            rc = 0;
            goto out;
        } else if (strcmp(a, "--strict") == 0) {
            o.strict = 1;
            continue;
        } else if (strcmp(a, "--buffered") == 0) {
            o.buffered_output = 1;
            continue;
        } else if (strcmp(a, "--bucketize") == 0) {
            o.parser.bucketize = 1;
            continue;
        } else if (strcmp(a, "--no-label") == 0) {
            o.parser.no_label = 1;
            continue;
        } else if (strncmp(a, "--", 2) != 0) {
            inputs[n_inputs++] = a;
            continue;
        }
        if (v == NULL) {
            fprintf(stderr, "ember ingest: %s needs a value\n", a);
            goto usage;
        }
        i++;
        if (strcmp(a, "--format") == 0) {
            format = v;
        } else if (strcmp(a, "--schema") == 0) {
            o.parser.schema_path = v;
        } else if (strcmp(a, "--out") == 0) {
            o.out_dir = v;
        } else if (strcmp(a, "--shards") == 0 && parse_u64(v, 100000, &n) && n > 0) {
            o.n_shards = (uint32_t)n;
        } else if (strcmp(a, "--threads") == 0 && parse_u64(v, 4096, &n)) {
            o.threads = (int)n;
        } else if (strcmp(a, "--block-rows") == 0 && parse_u64(v, 1u << 24, &n) && n > 0) {
            o.block_rows = (uint32_t)n;
        } else if (strcmp(a, "--ffm-fields") == 0 && parse_u64(v, 1u << 20, &n) && n > 0) {
            o.parser.ffm_fields = (uint32_t)n;
        } else if (strcmp(a, "--split-seed") == 0 && parse_u64(v, UINT64_MAX, &n)) {
            o.split_seed = n;
        } else if (strcmp(a, "--eval-fraction") == 0) {
            char *end;
            o.eval_fraction = strtod(v, &end);
            /* end == v: an empty value, which strtod reads as 0 */
            if (end == v || *end != '\0' || !(o.eval_fraction >= 0 && o.eval_fraction < 1)) {
                fprintf(stderr, "ember ingest: --eval-fraction takes a number in [0, 1)\n");
                goto usage;
            }
        } else {
            /* Every flag, to tell a bad value from a flag misspelt. */
            static const char *const flags[] = {
                "format",     "schema",     "out",        "shards",        "threads",
                "block-rows", "ffm-fields", "split-seed", "eval-fraction", "strict",
                "buffered",   "bucketize",  "no-label"};
            const size_t n_flags = sizeof flags / sizeof flags[0];
            if (cm_ini_key_find(a + 2, flags, n_flags) >= 0) {
                fprintf(stderr, "ember ingest: bad value '%s' for %s\n", v, a);
            } else {
                cli_unknown_flag("ingest", a, flags, n_flags);
            }
            goto usage;
        }
    }
    if (format == NULL || ds_format_from_name(format, &o.parser.format) != CM_OK) {
        fprintf(stderr, "ember ingest: --format must be criteo, criteo-csv, avazu, libsvm, "
                        "libffm or csv\n");
        goto usage;
    }
    if (o.parser.format == DS_FMT_CSV && o.parser.schema_path == NULL) {
        fprintf(stderr, "ember ingest: --format csv needs --schema FILE\n");
        goto usage;
    }
    if (o.out_dir == NULL || n_inputs == 0) {
        fprintf(stderr, "ember ingest: needs --out DIR and at least one input file\n");
        goto usage;
    }
    o.inputs = inputs;
    o.n_inputs = n_inputs;
    o.progress = isatty(STDERR_FILENO);
    stop_blas_threads();
    ds_ingest_result res;
    char *err = NULL;
    int r = ds_ingest_run(&o, &res, &err);
    ds_ingest_result_json(&res, stdout);
    fflush(stdout);
    if (r != CM_OK) {
        fprintf(stderr, "ember ingest: %s\n", err ? err : "failed");
        free(err);
        rc = 1;
    } else {
        rc = 0;
    }
    /* Criteo's unlabelled test file reads as labelled rows one column short: I1 taken for the
     * label, and rows whose I1 is not 0 or 1 rejected. */
    if (o.parser.format == DS_FMT_CRITEO && !o.parser.no_label &&
        res.rejected_by_reason[DS_REJ_LABEL] > 0 &&
        res.rows_padded + res.rows_rejected == res.rows_in)
        fprintf(stderr,
                "ember ingest: no row had all 40 columns, and %llu were rejected for their label "
                "(column 1): an unlabelled file (Criteo's test.txt)? Ingest it with --no-label\n",
                (unsigned long long)res.rejected_by_reason[DS_REJ_LABEL]);
    goto out;
usage:
    ingest_usage(stderr);
    rc = 2;
out:
    free(inputs);
    return rc;
}
