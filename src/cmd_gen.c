/* ember gen: writes synthetic Criteo-format click logs (see src/gen.h for the model). */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/common.h"
#include "src/cli.h"
#include "src/gen.h"
#include "src/metrics.h"

#define GEN_STATS_ROWS 1000000u /* --stats evaluates the truth on at most this many rows */

static void gen_usage(FILE *to)
{
    fprintf(to,
            "usage: ember gen --rows N --out FILE [--seed S] [--truth FILE] [--threads T] "
            "[--stats]\n"
            "  --rows N       rows to write (required)\n"
            "  --out FILE     Criteo TSV: label, I1..I13, C1..C26 (required)\n"
            "  --seed S       model and data seed, unsigned 64-bit (default 1)\n"
            "  --truth FILE   also write each row's true click probability, one a line\n"
            "  --threads T    generator threads (default: all cores); output is the same for "
            "any T\n"
            "  --stats        print the AUC and log loss of the true probabilities (first %u "
            "rows)\n",
            GEN_STATS_ROWS);
}

/* Parses a whole unsigned decimal; 0 on success. */
static int parse_u64(const char *s, uint64_t *out)
{
    if (s == NULL || *s == '\0' || *s == '-' || *s == '+') return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || *end != '\0') return -1;
    *out = v;
    return 0;
}

/* Whether paths a and b name one file however spelt ("x.tsv", "./x.tsv", "d/../x.tsv", a
 * link): the same file once both exist, else the same name in the same directory. */
static bool gen_same_file(const char *a, const char *b)
{
    struct stat sa, sb;
    if (stat(a, &sa) == 0 && stat(b, &sb) == 0)
        return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
    char *res[2] = {NULL, NULL};
    const char *path[2] = {a, b};
    for (int i = 0; i < 2; i++) {
        const char *slash = strrchr(path[i], '/');
        char *d = slash ? strndup(path[i], (size_t)(slash - path[i]) + 1) : strdup(".");
        char *real = d ? realpath(d, NULL) : NULL;
        const char *base = slash ? slash + 1 : path[i];
        if (real && (res[i] = malloc(strlen(real) + strlen(base) + 2)) != NULL)
            sprintf(res[i], "%s/%s", real, base);
        free(real);
        free(d);
    }
    bool same = res[0] && res[1] ? strcmp(res[0], res[1]) == 0 : strcmp(a, b) == 0;
    free(res[0]);
    free(res[1]);
    return same;
}

/* Truth AUC / log loss over the first rows of the stream, regenerated in memory. */
static int print_truth_stats(const gen_model *m, uint64_t rows)
{
    size_t n = rows < GEN_STATS_ROWS ? (size_t)rows : GEN_STATS_ROWS;
    float *p = malloc(n * sizeof *p), *y = malloc(n * sizeof *y);
    if (n == 0 || p == NULL || y == NULL) {
        free(p);
        free(y);
        fprintf(stderr, "ember gen: %s\n", n == 0 ? "no rows for --stats" : "out of memory");
        return 1;
    }
    gen_row r;
    double first = 0, pair = 0, dense = 0;
    for (size_t i = 0; i < n; i++) {
        gen_make_row(m, i, &r);
        p[i] = r.prob;
        y[i] = r.label;
        first += r.logit_first * r.logit_first;
        pair += r.logit_pair * r.logit_pair;
        dense += r.logit_dense * r.logit_dense;
    }
    double auc = 0, ll = 0;
    char *err = NULL;
    int rc = metrics_auc(p, y, n, &auc, &err);
    if (rc == CM_OK) rc = metrics_logloss(p, y, n, &ll, &err);
    if (rc != CM_OK) {
        fprintf(stderr, "ember gen: %s\n", err);
        free(err);
    } else {
        printf("truth over %zu rows: auc %.4f logloss %.4f; logit rms: first %.3f pair %.3f "
               "dense %.3f; bias %.3f\n",
               n, auc, ll, sqrt(first / n), sqrt(pair / n), sqrt(dense / n), gen_model_bias(m));
    }
    free(p);
    free(y);
    return rc == CM_OK ? 0 : 1;
}

int cmd_gen(int argc, char **argv)
{
    uint64_t rows = 0, seed = 1, threads = 0;
    int have_rows = 0, stats = 0;
    const char *out = NULL, *truth = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            gen_usage(stdout);
            return 0;
        }
        if (strcmp(a, "--stats") == 0) {
            stats = 1;
            continue;
        }
        /* Every other option takes a value: "--opt V" or "--opt=V". */
        const char *val = NULL;
        size_t nlen = strlen(a);
        const char *eq = strchr(a, '=');
        if (strncmp(a, "--", 2) == 0 && eq) {
            nlen = (size_t)(eq - a);
            val = eq + 1;
        } else if (i + 1 < argc) {
            val = argv[++i];
        }
#define OPT(name) (nlen == strlen(name) && strncmp(a, name, nlen) == 0)
        if (!(OPT("--rows") || OPT("--seed") || OPT("--out") || OPT("--truth") ||
              OPT("--threads"))) {
            static const char *const flags[] = {"rows", "seed", "out", "truth", "threads", "stats"};
            cli_unknown_flag("gen", a, flags, sizeof flags / sizeof flags[0]);
            gen_usage(stderr);
            return 2;
        }
        if (val == NULL) {
            fprintf(stderr, "ember gen: %.*s needs a value\n", (int)nlen, a);
            return 2;
        }
        if (OPT("--rows")) {
            if (parse_u64(val, &rows) != 0) {
                fprintf(stderr, "ember gen: --rows '%s' is not a non-negative integer\n", val);
                return 2;
            }
            have_rows = 1;
        } else if (OPT("--seed")) {
            if (parse_u64(val, &seed) != 0) {
                fprintf(stderr, "ember gen: --seed '%s' is not an unsigned 64-bit integer\n",
                        val);
                return 2;
            }
        } else if (OPT("--threads")) {
            if (parse_u64(val, &threads) != 0 || threads < 1 || threads > 1024) {
                fprintf(stderr, "ember gen: --threads '%s' must be an integer in 1..1024\n",
                        val);
                return 2;
            }
        } else if (OPT("--out")) {
            out = val;
        } else {
            truth = val;
        }
#undef OPT
    }
    if (!have_rows || out == NULL || *out == '\0') {
        fprintf(stderr, "ember gen: --rows and --out are required\n");
        gen_usage(stderr);
        return 2;
    }
    if (truth && (*truth == '\0' || gen_same_file(truth, out))) {
        fprintf(stderr, "ember gen: --truth must be a path other than --out\n");
        return 2;
    }
    if (threads == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        threads = n > 0 ? (uint64_t)n : 1;
    }

    char *err = NULL;
    gen_model *m = NULL;
    if (gen_model_create(seed, &m, &err) != CM_OK) {
        fprintf(stderr, "ember gen: %s\n", err);
        free(err);
        return 1;
    }
    gen_opts o = {.rows = rows, .threads = (int)threads, .out_path = out, .truth_path = truth};
    gen_stats st;
    int rc = gen_write(m, &o, &st, &err);
    if (rc != CM_OK) {
        fprintf(stderr, "ember gen: %s\n", err);
        free(err);
        gen_model_free(m);
        return rc == CM_EINVAL ? 2 : 1;
    }
    fprintf(stderr,
            "ember gen: wrote %" PRIu64 " rows (%.1f MB, CTR %.4f) to %s in %.2f s, %.0f rows/s, "
            "%" PRIu64 " threads\n",
            rows, st.bytes / 1e6, rows ? (double)st.clicks / rows : 0.0, out, st.seconds,
            st.seconds > 0 ? rows / st.seconds : 0.0, threads);
    int ret = stats ? print_truth_stats(m, rows) : 0;
    gen_model_free(m);
    return ret;
}
