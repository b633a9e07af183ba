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
    if (*v == '-' || *v == '\0') return -1;
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
    int rc = CM_OK, lineno = 0;
    char *err = NULL;
    while (rc == CM_OK && fgets(line, sizeof line, f) != NULL) {
        lineno++;
        if (strchr(line, '\n') == NULL && !feof(f)) {
            rc = cm_err(errptr, CM_EINVAL, "%s:%d: line too long", path, lineno);
            break;
        }
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
            rc = cb(arg, section, sarg, NULL, NULL, &err);
        } else {
            char *eq = strchr(s, '=');
            if (eq == NULL) {
                rc = cm_err(errptr, CM_EINVAL, "%s:%d: expected key = value", path, lineno);
                break;
            }
            *eq = '\0';
            rc = cb(arg, section, sarg, trim(s), trim(eq + 1), &err);
        }
        if (rc != CM_OK)
            cm_err(errptr, rc < 0 ? rc : CM_EINVAL, "%s:%d: %s", path, lineno,
                   err ? err : "rejected");
        if (rc > 0) rc = CM_EINVAL;
    }
    free(err);
    fclose(f);
    return rc;
}
