/* ember ingest: a thin shell over ds_ingest_run (datasets/datasets.h). */
#include <dlfcn.h>
#include <errno.h>
#include <getopt.h>
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
    /* getopt_long, as every other command: "--flag=value", inputs between options, "--" before
     * inputs named like options (a hand-written loop had none of the first, and listed the
     * flags a second time for its messages). */
    enum {
        O_FORMAT = 1,
        O_SCHEMA,
        O_OUT,
        O_SHARDS,
        O_THREADS,
        O_BLOCK_ROWS,
        O_FFM_FIELDS,
        O_SPLIT_SEED,
        O_EVAL_FRACTION,
        O_STRICT,
        O_BUFFERED,
        O_BUCKETIZE,
        O_NO_LABEL,
        O_HELP
    };
    static const struct option opts[] = {{"format", 1, 0, O_FORMAT},
                                         {"schema", 1, 0, O_SCHEMA},
                                         {"out", 1, 0, O_OUT},
                                         {"shards", 1, 0, O_SHARDS},
                                         {"threads", 1, 0, O_THREADS},
                                         {"block-rows", 1, 0, O_BLOCK_ROWS},
                                         {"ffm-fields", 1, 0, O_FFM_FIELDS},
                                         {"split-seed", 1, 0, O_SPLIT_SEED},
                                         {"eval-fraction", 1, 0, O_EVAL_FRACTION},
                                         {"strict", 0, 0, O_STRICT},
                                         {"buffered", 0, 0, O_BUFFERED},
                                         {"bucketize", 0, 0, O_BUCKETIZE},
                                         {"no-label", 0, 0, O_NO_LABEL},
                                         {"help", 0, 0, O_HELP},
                                         {0, 0, 0, 0}};
    ds_ingest_opts o;
    ds_ingest_opts_init(&o);
    const char *format = NULL;
    int rc = 2, c;
    optind = 1;
    while ((c = cli_getopt("ingest", argc, argv, opts)) != -1) {
        unsigned long long n = 0;
        bool ok = true;
        switch (c) {
        case O_FORMAT:
            format = optarg;
            break;
        case O_SCHEMA:
            o.parser.schema_path = optarg;
            break;
        case O_OUT:
            o.out_dir = optarg;
            break;
        case O_SHARDS:
            ok = parse_u64(optarg, 100000, &n) && n > 0;
            o.n_shards = (uint32_t)n;
            break;
        case O_THREADS:
            ok = parse_u64(optarg, 4096, &n);
            o.threads = (int)n;
            break;
        case O_BLOCK_ROWS:
            ok = parse_u64(optarg, 1u << 24, &n) && n > 0;
            o.block_rows = (uint32_t)n;
            break;
        case O_FFM_FIELDS:
            ok = parse_u64(optarg, 1u << 20, &n) && n > 0;
            o.parser.ffm_fields = (uint32_t)n;
            break;
        case O_SPLIT_SEED:
            ok = parse_u64(optarg, UINT64_MAX, &n);
            o.split_seed = n;
            break;
        case O_EVAL_FRACTION: {
            char *end;
            o.eval_fraction = strtod(optarg, &end);
            /* end == optarg: an empty value, which strtod reads as 0 */
            if (end == optarg || *end != '\0' || !(o.eval_fraction >= 0 && o.eval_fraction < 1)) {
                fprintf(stderr, "ember ingest: --eval-fraction takes a number in [0, 1)\n");
                goto usage;
            }
            break;
        }
        case O_STRICT:
            o.strict = 1;
            break;
        case O_BUFFERED:
            o.buffered_output = 1;
            break;
        case O_BUCKETIZE:
            o.parser.bucketize = 1;
            break;
        case O_NO_LABEL:
            o.parser.no_label = 1;
            break;
        case O_HELP:
            ingest_usage(stdout);
            return 0;
        default:
            goto usage;
        }
        if (!ok) {
            fprintf(stderr, "ember ingest: bad value '%s' for --%s\n", optarg, opts[c - 1].name);
            goto usage;
        }
    }
    const char *const *inputs = (const char *const *)argv + optind;
    size_t n_inputs = (size_t)(argc - optind);
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
    return rc;
}
