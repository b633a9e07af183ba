/* ember ingest through the binary: exit codes, the JSON line, --strict leaving no shards,
 * compressed inputs, malformed-line reports naming file and line. */
#include <dirent.h>
#include <sys/wait.h>
#include <zlib.h>
#include <zstd.h>

#include "ds_test_util.h"

static const char *bin;
static const char *tmp;

/* Runs a shell command; returns the exit code, stdout in out (static). */
static int run(const char *args, char **out)
{
    static char buf[1 << 16];
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "%s %s 2>%s/stderr.txt", bin, args, tmp);
    FILE *p = popen(cmd, "r");
    size_t n = p ? fread(buf, 1, sizeof buf - 1, p) : 0;
    buf[n] = '\0';
    int st = p ? pclose(p) : -1;
    if (out) *out = buf;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static char *stderr_text(void)
{
    static char *s;
    size_t n;
    char *err = NULL;
    free(s);
    s = NULL;
    if (cm_read_file(join(tmp, "stderr.txt"), (void **)&s, &n, &err) != 0) free(err);
    return s ? s : "";
}

static long json_num(const char *js, const char *key)
{
    char k[128];
    snprintf(k, sizeof k, "\"%s\": ", key);
    const char *p = strstr(js, k);
    return p ? strtol(p + strlen(k), NULL, 10) : -1;
}

/* Files under dir whose name contains needle (recursively one level). */
static int count_files(const char *dir, const char *needle)
{
    int n = 0;
    DIR *d = opendir(dir);
    if (d == NULL) return 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        if (strstr(e->d_name, needle)) n++;
        char sub[4096];
        snprintf(sub, sizeof sub, "%s/%s", dir, e->d_name);
        DIR *s = opendir(sub);
        if (s) {
            closedir(s);
            n += count_files(sub, needle);
        }
    }
    closedir(d);
    return n;
}

static const char *GOOD = "1\t1\t2\t3\t4\t5\t6\t7\t8\t9\t10\t11\t12\t13\ta\tb\tc\n";

int main(void)
{
    bin = getenv("EMBER_BIN");
    if (bin == NULL) bin = "./ember";
    tmp = check_tmpdir("ds_cli");
    char args[8192], *out;

    /* usage errors exit 2 */
    CHECK(run("ingest", NULL) == 2);
    CHECK(run("ingest --format nope --out x y", NULL) == 2);
    CHECK(run("ingest --format criteo y", NULL) == 2);
    CHECK(run("ingest --format csv --out x y", NULL) == 2);
    CHECK(run("ingest --format criteo --out x --shards 0 y", NULL) == 2);
    CHECK(run("ingest --format criteo --out x --eval-fraction 1.5 y", NULL) == 2);
    /* an empty value is not 0 (it was: no eval split, and no word about the option) */
    CHECK(run("ingest --format criteo --out x --eval-fraction '' y", NULL) == 2);
    CHECK(strstr(stderr_text(), "--eval-fraction") != NULL);
    CHECK(run("ingest --format criteo --out x --shards 0 y", NULL) == 2 &&
          strstr(stderr_text(), "bad value '0' for --shards") != NULL);
    CHECK_MSG(run("ingest --fromat criteo --out x y", NULL) == 2 &&
                  strstr(stderr_text(), "unknown option '--fromat': did you mean '--format'?"),
              "stderr: %s", stderr_text());
    /* "--flag=value" as every other command takes it, and inputs before the options (both
     * were refused: "unknown option '--format=criteo'"). */
    char eq[8192];
    snprintf(eq, sizeof eq,
             "cd '%s' && printf '0\\t1\\t\\t\\t\\t\\t\\t\\t\\t\\t\\t\\t\\t\\ta\\n' > eq.tsv && "
             "'%s' ingest eq.tsv --format=criteo --out=eq --shards=2 >/dev/null 2>&1",
             tmp, bin);
    CHECK_MSG(system(eq) == 0 && count_files(join(tmp, "eq/train"), ".shard") == 2,
              "ingest eq.tsv --format=criteo --out=eq --shards=2 failed");
    CHECK(run("ingest --format criteo --out x --strict=1 y", NULL) == 2 &&
          strstr(stderr_text(), "'--strict' takes no value") != NULL);
    /* After "--" every argument is an input: a file named "--odd.tsv" can be given. */
    char *odd = join(tmp, "--odd.tsv");
    FILE *fo = fopen(odd, "w");
    CHECK(fo != NULL && fputs("0\t1\t\t\t\t\t\t\t\t\t\t\t\t\ta\n", fo) >= 0 && fclose(fo) == 0);
    char dd[8192];
    snprintf(dd, sizeof dd, "cd '%s' && '%s' ingest --format criteo --out dd -- --odd.tsv 2>&1",
             tmp, bin);
    CHECK_MSG(system(dd) == 0 && count_files(join(tmp, "dd/train"), ".shard") == 1,
              "ingest -- --odd.tsv did not ingest the file");
    CHECK(run("ingest --help", NULL) == 0);

    /* a file with 50 good lines and 3 bad ones at known lines */
    char *text = malloc(1 << 16);
    size_t n = 0;
    for (int i = 1; i <= 53; i++) {
        const char *l = i == 5    ? "1\tx\n"
                        : i == 20 ? "1\tabc\t2\t3\t4\t5\t6\t7\t8\t9\t10\t11\t12\t13\n"
                        : i == 40 ? "\x01\x02junk\n"
                                  : GOOD;
        memcpy(text + n, l, strlen(l));
        n += strlen(l);
    }
    char *in = join(tmp, "in.tsv");
    write_text(in, text, n);
    char outdir[4096];
    snprintf(outdir, sizeof outdir, "%s/out", tmp);
    snprintf(args, sizeof args, "ingest --format criteo --out %s --shards 2 %s", outdir, in);
    CHECK(run(args, &out) == 0);
    CHECK(json_num(out, "rows_in") == 53 && json_num(out, "rows_written") == 50 &&
          json_num(out, "rows_rejected") == 3);
    CHECK(strstr(out, "\"seconds\"") && strstr(out, "\"mb_per_s\"") && strstr(out, "\"threads\""));
    CHECK(strchr(out, '\n') == out + strlen(out) - 1); /* exactly one line */
    char want[4200];
    snprintf(want, sizeof want, "%s:20: malformed line skipped: number (column 2)", in);
    CHECK_MSG(strstr(stderr_text(), want) != NULL, "stderr: %s", stderr_text());
    snprintf(want, sizeof want, "%s:5:", in);
    CHECK(strstr(stderr_text(), want) != NULL);
    snprintf(want, sizeof want, "%s:40: malformed line skipped: junk", in);
    CHECK(strstr(stderr_text(), want) != NULL);
    CHECK(strstr(stderr_text(), "\r") == NULL); /* no progress when stderr is not a terminal */
    CHECK(count_files(outdir, ".shard") == 2 && count_files(outdir, "stats.json") == 1);

    /* --buffered (page-cache writes instead of O_DIRECT): the same files, byte for byte */
    char bufdir[4200], cmpcmd[9000];
    snprintf(bufdir, sizeof bufdir, "%s/out-buffered", tmp);
    snprintf(args, sizeof args, "ingest --format criteo --buffered --out %s --shards 2 %s", bufdir,
             in);
    CHECK(run(args, &out) == 0 && json_num(out, "rows_written") == 50);
    snprintf(cmpcmd, sizeof cmpcmd, "diff -r %s %s >/dev/null", outdir, bufdir);
    CHECK_MSG(system(cmpcmd) == 0, "--buffered wrote different files than the default");

    /* --strict: exit 1, the line named, no shards and no temporaries left */
    snprintf(args, sizeof args, "ingest --format criteo --strict --out %s %s", outdir, in);
    CHECK(run(args, &out) == 1);
    snprintf(want, sizeof want, "%s:5:", in);
    CHECK(strstr(stderr_text(), want) != NULL);
    CHECK_MSG(count_files(outdir, ".shard") == 0 && count_files(outdir, "stats.json") == 0,
              "strict run left %d shard files", count_files(outdir, ".shard"));
    CHECK(json_num(out, "rows_in") >= 0);

    /* missing input file: runtime failure, exit 1 */
    snprintf(args, sizeof args, "ingest --format criteo --out %s %s/none.tsv", outdir, tmp);
    CHECK(run(args, NULL) == 1);
    CHECK(strstr(stderr_text(), "none.tsv") != NULL);

    /* Criteo's unlabelled test file (39 columns, I1 first): without --no-label, rows whose I1
     * is not 0 or 1 are rejected and the run says what the file probably is; with it, every
     * row is kept and the shards say there is no label. */
    {
        char *t39 = malloc(1 << 14);
        size_t m = 0;
        for (int i = 0; i < 30; i++)
            m += (size_t)snprintf(t39 + m, (1 << 14) - m,
                                  "%d\t1\t2\t3\t4\t5\t6\t7\t8\t9\t10\t11\t12"
                                  "\ta%d\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\tz\n",
                                  i % 7, i);
        char *tin = join(tmp, "test.txt");
        write_text(tin, t39, m);
        char tdir[4200];
        snprintf(tdir, sizeof tdir, "%s/out-test", tmp);
        snprintf(args, sizeof args, "ingest --format criteo --out %s %s", tdir, tin);
        CHECK(run(args, &out) == 0 && json_num(out, "rows_written") < 30);
        CHECK_MSG(strstr(stderr_text(), "--no-label") != NULL, "stderr: %s", stderr_text());
        snprintf(args, sizeof args,
                 "ingest --format criteo --no-label --eval-fraction 0 --out %s %s", tdir, tin);
        CHECK(run(args, &out) == 0 && json_num(out, "rows_written") == 30 &&
              json_num(out, "rows_padded") == 0);
        CHECK(strstr(stderr_text(), "--no-label") == NULL);
        char *stats = join(tdir, "stats.json"), *js = NULL;
        size_t jn = 0;
        CHECK(cm_read_file(stats, (void **)&js, &jn, NULL) == CM_OK && js &&
              strstr(js, "\"has_label\": false") != NULL);
        free(js);
        /* A labelled format has no such option. */
        snprintf(args, sizeof args, "ingest --format avazu --no-label --out %s %s", tdir, tin);
        CHECK(run(args, NULL) != 0 && strstr(stderr_text(), "criteo TSV") != NULL);
        free(t39);
    }

    /* gzip and zstd inputs give the same rows */
    char *gzp = join(tmp, "in.tsv.gz");
    gzFile gz = gzopen(gzp, "wb");
    gzwrite(gz, text, (unsigned)n);
    gzclose(gz);
    size_t bound = ZSTD_compressBound(n);
    void *z = malloc(bound);
    size_t zn = ZSTD_compress(z, bound, text, n, 3);
    char *zp = join(tmp, "in.tsv.zst");
    write_text(zp, z, zn);
    snprintf(args, sizeof args, "ingest --format criteo --out %s/gz %s %s", tmp, gzp, zp);
    CHECK(run(args, &out) == 0);
    CHECK(json_num(out, "rows_in") == 106 && json_num(out, "rows_written") == 100);
    CHECK(json_num(out, "bytes_in") == (long)(2 * n));
    /* a truncated zstd file is an error, not silent data loss */
    write_text(zp, z, zn / 2);
    snprintf(args, sizeof args, "ingest --format criteo --out %s/gz %s", tmp, zp);
    CHECK(run(args, NULL) == 1);
    CHECK(strstr(stderr_text(), "zstd") != NULL);
    free(z);

    /* csv with a schema file through the CLI */
    char *schema = join(tmp, "schema.txt");
    write_text(schema, "label y\ncat a\nmulti b ;\n", 24);
    char *csv = join(tmp, "in.csv");
    write_text(csv, "y,a,b\n1,x,p;q\n0,\"y,z\",\n", 23);
    snprintf(args, sizeof args, "ingest --format csv --schema %s --out %s/csv %s", schema, tmp,
             csv);
    CHECK(run(args, &out) == 0);
    CHECK(json_num(out, "rows_written") == 2);
    free(text);
    return check_done();
}
