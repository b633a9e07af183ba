/* Small pieces the benchmark programs share. */
#ifndef EMBER_TOOLS_BENCH_UTIL_H
#define EMBER_TOOLS_BENCH_UTIL_H

#include <libgen.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The ember binary a benchmark drives: $EMBER_BIN, else build/ember beside this program's
 * build/tools/ directory; NULL when neither can be worked out. */
static inline const char *bench_ember_path(void)
{
    static char buf[4096];
    const char *env = getenv("EMBER_BIN");
    if (env) return env;
    ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 16);
    if (n <= 0) return NULL;
    buf[n] = '\0';
    char *d = dirname(dirname(buf)); /* build/tools/bench_x -> build */
    memmove(buf, d, strlen(d) + 1);
    strcat(buf, "/ember");
    return buf;
}

#endif
