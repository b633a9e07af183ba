/* `ember gen` as a user runs it ($EMBER_BIN): identical bytes for a seed and any thread count,
 * row and field counts, the truth file, exit 2 for usage errors and 1 for I/O failures. */
#include <sys/wait.h>

#include "check.h"
#include "common/common.h"

static const char *bin;
static const char *dir;

/* Runs `$EMBER_BIN args` with stdout and stderr to dir/out.txt; returns the exit code. */
static int run(const char *args)
{
    char cmd[16384];
    snprintf(cmd, sizeof cmd, "'%s' %s >'%s/out.txt' 2>&1", bin, args, dir);
    int st = system(cmd);
    if (st == -1 || !WIFEXITED(st)) return -1;
    return WEXITSTATUS(st);
}

static char *slurp(const char *name, size_t *len)
{
    char path[8192];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    void *buf = NULL;
    char *err = NULL;
    int rc = cm_read_file(path, &buf, len, &err);
    CHECK_OK(rc, err);
    if (buf == NULL) {
        *len = 0;
        return calloc(1, 1);
    }
    return buf;
}

static int output_has(const char *needle)
{
    size_t n;
    char *s = slurp("out.txt", &n);
    int ok = strstr(s, needle) != NULL;
    if (!ok) fprintf(stderr, "output lacks '%s':\n%s\n", needle, s);
    free(s);
    return ok;
}

int main(void)
{
    bin = getenv("EMBER_BIN");
    if (bin == NULL || access(bin, X_OK) != 0) {
        fprintf(stderr, "EMBER_BIN is not set to the ember binary\n");
        return 1;
    }
    static char dirbuf[4096];
    snprintf(dirbuf, sizeof dirbuf, "%s", check_tmpdir("gen_cli"));
    dir = dirbuf;
    char args[12000];

    /* Same seed twice (different thread counts) gives the same bytes; another seed differs. */
    snprintf(args, sizeof args, "gen --rows 30000 --seed 5 --out '%s/a.tsv' --truth '%s/a.p' --threads 1", dir, dir);
    CHECK(run(args) == 0);
    snprintf(args, sizeof args, "gen --rows=30000 --seed=5 --out='%s/b.tsv' --truth '%s/b.p' --threads 4", dir, dir);
    CHECK(run(args) == 0);
    snprintf(args, sizeof args, "gen --rows 30000 --seed 6 --out '%s/c.tsv'", dir);
    CHECK(run(args) == 0);
    size_t na, nb, nc, npa, npb;
    char *a = slurp("a.tsv", &na), *b = slurp("b.tsv", &nb), *c = slurp("c.tsv", &nc);
    char *pa = slurp("a.p", &npa), *pb = slurp("b.p", &npb);
    CHECK(na > 0 && na == nb && memcmp(a, b, na) == 0);
    CHECK(npa > 0 && npa == npb && memcmp(pa, pb, npa) == 0);
    CHECK(nc > 0 && (nc != na || memcmp(a, c, na) != 0));

    /* 30000 LF-terminated rows of 40 tab-separated fields; labels agree with a sane CTR. */
    size_t rows = 0, bad = 0, tabs = 0, clicks = 0, cr = 0;
    for (size_t i = 0; i < na; i++) {
        if (i == 0 || a[i - 1] == '\n') clicks += a[i] == '1';
        if (a[i] == '\t') tabs++;
        if (a[i] == '\r') cr++;
        if (a[i] == '\n') {
            bad += tabs != 39;
            tabs = 0;
            rows++;
        }
    }
    CHECK(na > 0 && a[na - 1] == '\n');
    CHECK_MSG(rows == 30000, "rows=%zu", rows);
    CHECK_MSG(bad == 0, "%zu rows without 40 fields", bad);
    CHECK(cr == 0);
    CHECK_MSG(clicks > 0.20 * rows && clicks < 0.25 * rows, "clicks=%zu", clicks);
    size_t plines = 0;
    for (size_t i = 0; i < npa; i++) plines += pa[i] == '\n';
    CHECK(plines == 30000);
    free(a);
    free(b);
    free(c);
    free(pa);
    free(pb);

    /* --stats reports the truth AUC. */
    snprintf(args, sizeof args, "gen --rows 20000 --out '%s/s.tsv' --stats --threads 2", dir);
    CHECK(run(args) == 0);
    CHECK(output_has("truth over 20000 rows: auc 0."));

    /* Usage errors: exit 2. */
    const char *usage[] = {
        "gen",
        "gen --rows 10",
        "gen --out x.tsv",
        "gen --rows abc --out x.tsv",
        "gen --rows -5 --out x.tsv",
        "gen --rows 10 --out x.tsv --threads 0",
        "gen --rows 10 --out x.tsv --seed 1.5",
        "gen --rows 10 --out x.tsv --bogus",
        "gen --rows 10 --out x.tsv --truth x.tsv",
        "gen --rows 10 --out",
    };
    for (size_t i = 0; i < sizeof usage / sizeof usage[0]; i++) {
        int rc = run(usage[i]);
        CHECK_MSG(rc == 2, "'%s' exited %d", usage[i], rc);
    }
    CHECK(run("gen --help") == 0 && output_has("--rows"));
    CHECK_MSG(run("gen --rowz 10 --out x.tsv") == 2 &&
                  output_has("unknown option '--rowz': did you mean '--rows'?"),
              "gen --rowz: the flag meant is not named");
    /* --truth naming --out's file by another spelling: refused, and an existing --out is
     * left as it was (the two writers used to interleave into it). */
    char path0[8192];
    snprintf(path0, sizeof path0, "%s/same.tsv", dir);
    FILE *f0 = fopen(path0, "w");
    if (f0) fputs("keep\n", f0), fclose(f0);
    const char *same[] = {"--out '%s/same.tsv' --truth '%s/./same.tsv'",
                          "--out '%s/new.tsv' --truth '%s/../%s/new.tsv'"};
    for (int i = 0; i < 2; i++) {
        char fmt[512];
        snprintf(fmt, sizeof fmt, "gen --rows 10 %s", same[i]);
        const char *base = strrchr(dir, '/') ? strrchr(dir, '/') + 1 : dir;
        snprintf(args, sizeof args, fmt, dir, dir, base);
        CHECK_MSG(run(args) == 2 && output_has("--truth must be a path other than --out"), "'%s'",
                  args);
    }
    size_t kept_len = 0;
    char *kept = slurp("same.tsv", &kept_len);
    CHECK_MSG(kept_len == 5 && memcmp(kept, "keep\n", 5) == 0, "same.tsv changed: %.40s", kept);
    free(kept);

    /* I/O failure: exit 1 naming the path; nothing written. */
    snprintf(args, sizeof args, "gen --rows 10 --out '%s/missing/dir/x.tsv'", dir);
    CHECK(run(args) == 1);
    CHECK(output_has("missing/dir/x.tsv"));
    snprintf(args, sizeof args, "gen --rows 10 --out '%s/ok.tsv' --truth '%s/missing/x.p'", dir, dir);
    CHECK(run(args) == 1);
    CHECK(output_has("missing/x.p"));
    char path[8192];
    snprintf(path, sizeof path, "%s/ok.tsv", dir);
    CHECK(access(path, F_OK) != 0); /* the TSV was not committed either */
    return check_done();
}
