/*
 * Helpers for the tests that run `ember` as a user does ($EMBER_BIN): commands under a time
 * limit with stdout and stderr captured, the JSON line train prints, small files.
 */
#ifndef EMBER_TESTS_TRAIN_CLI_UTIL_H
#define EMBER_TESTS_TRAIN_CLI_UTIL_H

#include <stdarg.h>
#include <sys/wait.h>

#include "check.h"
#include "common/common.h"

static const char *bin;
static char dir[4096];
static char *out_text, *err_text; /* the last command's stdout and stderr */

static inline char *slurp_path(const char *path)
{
    void *buf = NULL;
    size_t len = 0;
    char *err = NULL;
    if (cm_read_file(path, &buf, &len, &err) != 0) {
        free(err);
        return NULL;
    }
    char *s = malloc(len + 1);
    if (len) memcpy(s, buf, len);
    s[len] = '\0';
    free(buf);
    return s;
}

/* dir/name's contents (NUL-terminated) or NULL. */
static inline char *slurp(const char *name)
{
    char path[8192];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return slurp_path(path);
}

/* dir/name's text without its checksum line (cm_read_sealed: a checkpoint's LATEST, model.txt,
 * run.txt, worker positions), or NULL when it is missing or fails its checksum. */
static inline char *slurp_sealed(const char *name)
{
    char path[8192], *text = NULL, *err = NULL;
    size_t len;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (cm_read_sealed(path, &text, &len, &err) != 0) {
        fprintf(stderr, "%s\n", err ? err : path);
        free(err);
        return NULL;
    }
    return text;
}

static inline int exists(const char *name)
{
    char path[8192];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return access(path, F_OK) == 0;
}

/* Runs `cd dir && timeout LIMIT $EMBER_BIN <args>`; returns its exit code (124: timed out). */
static inline int run_limit(int limit_s, const char *fmt, ...)
{
    char args[12000], cmd[16384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "cd '%s' && timeout -k 5 %d '%s' %s >out.txt 2>err.txt", dir, limit_s,
             bin, args);
    double t0 = cm_now();
    int st = system(cmd);
    free(out_text);
    free(err_text);
    out_text = slurp("out.txt");
    err_text = slurp("err.txt");
    if (!out_text) out_text = calloc(1, 1);
    if (!err_text) err_text = calloc(1, 1);
    int rc = st == -1 || !WIFEXITED(st) ? -1 : WEXITSTATUS(st);
    fprintf(stderr, "[%5.2fs rc %d] ember %s\n", cm_now() - t0, rc, args);
    if (rc != 0 && rc != 2) {
        /* stderr's last lines help when a check fails */
        size_t n = strlen(err_text);
        fprintf(stderr, "    stderr: %s\n", n > 600 ? err_text + n - 600 : err_text);
    }
    return rc;
}

#define run(...) run_limit(300, __VA_ARGS__)

static inline int err_has(const char *needle)
{
    int ok = strstr(err_text, needle) != NULL;
    if (!ok) fprintf(stderr, "stderr lacks '%s':\n%s\n", needle, err_text);
    return ok;
}

/* The last non-empty line of the last stdout (a static copy). */
static inline const char *last_line(void)
{
    static char line[8192];
    const char *s = out_text, *end = s + strlen(s);
    while (end > s && (end[-1] == '\n' || end[-1] == '\r')) end--;
    const char *start = end;
    while (start > s && start[-1] != '\n') start--;
    size_t n = (size_t)(end - start) < sizeof line - 1 ? (size_t)(end - start) : sizeof line - 1;
    memcpy(line, start, n);
    line[n] = '\0';
    return line;
}

/* The raw text of "key": value in a one-line JSON object (number or string); 0 or -1. */
static inline int json_raw(const char *json, const char *key, char *out, size_t cap)
{
    char pat[256];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(json, pat);
    if (p == NULL) return -1;
    p += strlen(pat);
    while (*p == ' ') p++;
    size_t n = strcspn(p, ",}");
    if (n == 0 || n >= cap) return -1;
    memcpy(out, p, n);
    out[n] = '\0';
    return 0;
}

static inline int json_num(const char *json, const char *key, double *v)
{
    char raw[256], *end;
    if (json_raw(json, key, raw, sizeof raw) != 0) return -1;
    *v = strtod(raw, &end);
    return end != raw && *end == '\0' && isfinite(*v) ? 0 : -1;
}

/* Fails the check (and returns NaN) when the key is missing. */
static inline double jnum(const char *json, const char *key)
{
    double v = NAN;
    CHECK_MSG(json_num(json, key, &v) == 0, "no number \"%s\" in %s", key, json);
    return v;
}

/* `ember gen` + `ember ingest --format criteo` into dir/<name>/{train,eval}. */
static inline int make_criteo(const char *name, unsigned rows, unsigned seed, double eval_fraction)
{
    int rc = run("gen --rows %u --seed %u --out %s.tsv", rows, seed, name);
    CHECK(rc == 0);
    if (rc) return rc;
    rc = run("ingest --format criteo --eval-fraction %g --out %s %s.tsv", eval_fraction, name, name);
    CHECK_MSG(rc == 0, "ingest failed: %s", err_text);
    return rc;
}

/* Start-up shared by the CLI tests: $EMBER_BIN and a fresh directory. */
static inline int cli_init(const char *name)
{
    bin = getenv("EMBER_BIN");
    if (bin == NULL || access(bin, X_OK) != 0) {
        fprintf(stderr, "EMBER_BIN is not set to the ember binary\n");
        return -1;
    }
    snprintf(dir, sizeof dir, "%s", check_tmpdir(name));
    return 0;
}

#endif
