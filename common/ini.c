#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/common.h"

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1]))
        *--e = '\0';
    return s;
}

int cm_parse_size(const char *v, uint64_t *out)
{
    char *end;
    errno = 0;
    /* Digits first: strtoull skips leading blanks and takes a sign, so " -1" would read as
     * 2^64 - 1 (an unlimited --max-steps) and " 5" or "+5" as 5. */
    if (*v < '0' || *v > '9') return -1;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || end == v) return -1;
    uint64_t mult = 1;
    switch (*end) {
    case 'K':
    case 'k':
        mult = 1ull << 10;
        end++;
        break;
    case 'M':
    case 'm':
        mult = 1ull << 20;
        end++;
        break;
    case 'G':
    case 'g':
        mult = 1ull << 30;
        end++;
        break;
    case 'T':
    case 't':
        mult = 1ull << 40;
        end++;
        break;
    default:
        break;
    }
    if (*end != '\0' || (x != 0 && mult > UINT64_MAX / x)) return -1;
    *out = x * mult;
    return 0;
}

/* Reads one line, its '\n' included when it has one, into buf (n bytes, NUL-terminated) and its
 * length, NUL bytes counted, into *len: fgets hides a NUL (the line seems to end there), which
 * made a short line with one "too long" and cut a last line without '\n' short in silence.
 * 1: a line; 0: end of file; -1: the line does not fit in n - 1 bytes. */
static int read_line(FILE *f, char *buf, size_t n, size_t *len)
{
    size_t i = 0;
    int c = EOF;
    while (i + 1 < n && (c = getc(f)) != EOF) {
        buf[i++] = (char)c;
        if (c == '\n') break;
    }
    buf[i] = '\0';
    *len = i;
    /* A full buffer holds the whole line only if the file ends there. */
    if (i + 1 == n && c != '\n' && getc(f) != EOF) return -1;
    return i > 0;
}

int cm_ini_unknown_section(char **errptr, const char *section, const char *section_arg,
                           const char *known)
{
    return cm_err(errptr, CM_EINVAL, "unknown section [%s%s%s]%s%s%s", section,
                  *section_arg ? " " : "", section_arg, known ? " (" : "", known ? known : "",
                  known ? ")" : "");
}

int cm_ini_key_outside(char **errptr, const char *key, const char *where)
{
    return cm_err(errptr, CM_EINVAL, "key '%s' before any section header (keys go under %s)", key,
                  where);
}

int cm_ini_key_find(const char *key, const char *const *keys, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(key, keys[i]) == 0) return (int)i;
    return -1;
}

/* Edit distance (insert, delete, substitute) of a and b, counted up to 9: keys are short. */
static size_t edit_distance(const char *a, const char *b)
{
    enum { CAP = 48 };
    size_t la = strlen(a), lb = strlen(b);
    if (la >= CAP || lb >= CAP) return 9;
    size_t row[CAP];
    for (size_t j = 0; j <= lb; j++)
        row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t up = row[j], best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            diag = up;
            row[j] = best;
        }
    }
    return row[lb] < 9 ? row[lb] : 9;
}

const char *cm_nearest_name(const char *name, const char *const *names, size_t n)
{
    /* Within two edits, or one word (three letters or more) of the other's name
     * ("memory_budget" for "memory", "ttl" for "ttl_steps"). */
    const char *near = NULL;
    size_t best = 3, ln = strlen(name);
    for (size_t i = 0; i < n; i++) {
        size_t d = edit_distance(name, names[i]), l = strlen(names[i]);
        size_t shorter = l < ln ? l : ln;
        const char *longer = l < ln ? name : names[i];
        if (d > 2 && shorter >= 3 && strncmp(name, names[i], shorter) == 0 &&
            (longer[shorter] == '_' || longer[shorter] == '-'))
            d = 2;
        if (d < best) best = d, near = names[i];
    }
    return near;
}

int cm_ini_unknown_key(char **errptr, const char *key, const char *where, const char *const *keys,
                       size_t n)
{
    const char *near = cm_nearest_name(key, keys, n);
    char list[1024];
    size_t len = 0;
    list[0] = '\0';
    for (size_t i = 0; i < n && len < sizeof list; i++)
        len += (size_t)snprintf(list + len, sizeof list - len, "%s%s", i ? ", " : "", keys[i]);
    if (near != NULL)
        return cm_err(errptr, CM_EINVAL, "unknown key '%s' in %s: did you mean '%s'? (keys: %s)",
                      key, where, near, list);
    return cm_err(errptr, CM_EINVAL, "unknown key '%s' in %s (keys: %s)", key, where, list);
}

/* A key seen in a parse: "section\narg\nkey" and its line, for the duplicate check. */
typedef struct ini_key {
    char *id;
    int line;
} ini_key;

/* Records key in section [name arg] at lineno; the line it was first seen on when it was seen
 * before (a second value would silently win), 0 when new, -1 when out of memory. */
static int ini_key_seen(ini_key **keys, size_t *n, const char *name, const char *arg,
                        const char *key, int lineno)
{
    size_t len = strlen(name) + strlen(arg) + strlen(key) + 3;
    char *id = malloc(len);
    if (id == NULL) return -1;
    snprintf(id, len, "%s\n%s\n%s", name, arg, key);
    for (size_t i = 0; i < *n; i++)
        if (strcmp((*keys)[i].id, id) == 0) {
            free(id);
            return (*keys)[i].line;
        }
    ini_key *k = realloc(*keys, (*n + 1) * sizeof *k);
    if (k == NULL) {
        free(id);
        return -1;
    }
    *keys = k;
    k[(*n)++] = (ini_key){id, lineno};
    return 0;
}

int cm_ini_parse(const char *path, cm_ini_cb cb, void *arg, char **errptr)
{
    FILE *f = fopen(path, "r");
    if (f == NULL) return cm_err_errno(errptr, CM_ENOTFOUND, "cannot open %s", path);
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(f);
        return cm_err(errptr, CM_EINVAL, "%s is not a regular file", path);
    }
    char line[4096], section[256] = "", sarg[256] = "";
    int rc = CM_OK, lineno = 0, got;
    char *err = NULL;
    ini_key *keys = NULL;
    size_t n_keys = 0, len;
    while (rc == CM_OK && (got = read_line(f, line, sizeof line, &len)) != 0) {
        lineno++;
        if (got < 0) {
            rc = cm_err(errptr, CM_EINVAL, "%s:%d: line too long", path, lineno);
            break;
        }
        if (memchr(line, '\0', len) != NULL) {
            rc = cm_err(errptr, CM_EINVAL, "%s:%d: NUL byte in the line (not a text file?)", path,
                        lineno);
            break;
        }
        /* A UTF-8 byte order mark (some editors start every file with one) is not text. */
        if (lineno == 1 && !strncmp(line, CM_UTF8_BOM, 3))
            memmove(line, line + 3, strlen(line) - 2);
        char *hash = strchr(line, '#');
        if (hash) *hash = '\0';
        char *s = trim(line);
        if (*s == '\0') continue;
        if (*s == '[') {
            char *close = strchr(s, ']');
            if (close == NULL || close[1] != '\0') {
                rc = cm_err(errptr, CM_EINVAL, "%s:%d: malformed section header", path, lineno);
                break;
            }
            *close = '\0';
            char *name = trim(s + 1), *a = name;
            while (*a && !isspace((unsigned char)*a))
                a++;
            if (*a) *a++ = '\0';
            a = trim(a);
            if (strlen(name) >= sizeof section || strlen(a) >= sizeof sarg) {
                rc = cm_err(errptr, CM_EINVAL, "%s:%d: section name too long", path, lineno);
                break;
            }
            strcpy(section, name);
            strcpy(sarg, a);
            rc = cb(arg, lineno, section, sarg, NULL, NULL, &err);
        } else {
            char *eq = strchr(s, '=');
            if (eq == NULL) {
                rc = cm_err(errptr, CM_EINVAL, "%s:%d: expected key = value", path, lineno);
                break;
            }
            *eq = '\0';
            char *key = trim(s);
            int first = ini_key_seen(&keys, &n_keys, section, sarg, key, lineno);
            if (first != 0) {
                rc = first < 0 ? cm_err(errptr, CM_ENOMEM, "out of memory")
                               : cm_err(errptr, CM_EINVAL,
                                        "%s:%d: duplicate key '%s' in [%s%s%s] (first on line %d)",
                                        path, lineno, key, section, *sarg ? " " : "", sarg, first);
                break;
            }
            rc = cb(arg, lineno, section, sarg, key, trim(eq + 1), &err);
        }
        if (rc != CM_OK)
            cm_err(errptr, rc < 0 ? rc : CM_EINVAL, "%s:%d: %s", path, lineno,
                   err ? err : "rejected");
        if (rc > 0) rc = CM_EINVAL;
    }
    /* A read error ends the lines as end of file does: without this it read as a shorter file. */
    if (rc == CM_OK && ferror(f)) rc = cm_err_errno(errptr, CM_EIO, "cannot read %s", path);
    free(err);
    for (size_t i = 0; i < n_keys; i++)
        free(keys[i].id);
    free(keys);
    fclose(f);
    return rc;
}
