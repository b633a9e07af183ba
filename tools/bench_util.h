/* Small pieces the benchmark programs share. */
#ifndef EMBER_TOOLS_BENCH_UTIL_H
#define EMBER_TOOLS_BENCH_UTIL_H

#include <errno.h>
#include <libgen.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/common.h"

/* A benchmark is one program that stops at its first failure: these helpers print what failed
 * under the program's name and exit(1). They live here, not in a library, because only the
 * tools/ programs may exit on error. */

/* The name messages start with ("bench train"), and a hook run before a fatal exit (to stop
 * child processes); both set once at the start of main. */
typedef struct bench_prog {
    const char *name;
    void (*on_die)(void);
} bench_prog;

static inline bench_prog *bench_self(void)
{
    static bench_prog p = {"bench", NULL};
    return &p;
}

static inline void bench_init(const char *name, void (*on_die)(void))
{
    bench_self()->name = name;
    bench_self()->on_die = on_die;
}

char *openblas_get_corename(void);

/* For the benchmarks that compute with OpenBLAS (and start PyTorch, which loads the same
 * library): the kernels ember itself would use (see cm_blas_core_reexec), inherited by every
 * child, so a side-by-side run compares the same kernels. First thing in main. */
static inline void bench_blas_core(char **argv)
{
    cm_blas_core_reexec(openblas_get_corename(), argv);
}

/* Prints "NAME: what: err" and exits 1; frees err (NULL: only what). */
__attribute__((noreturn)) static inline void bench_die(const char *what, char *err)
{
    fprintf(stderr, "%s: %s%s%s\n", bench_self()->name, what, err ? ": " : "", err ? err : "");
    free(err);
    if (bench_self()->on_die) bench_self()->on_die();
    exit(1);
}

/* bench_die when rc is not 0 (a library call's return code and its message). */
static inline void bench_check(int rc, char *err, const char *what)
{
    if (rc != 0) bench_die(what, err ? err : strdup("failed"));
}

static inline void *bench_xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p == NULL) bench_die("out of memory", NULL);
    return p;
}

/* Runs argv (no shell, PATH searched); stdout to out_path and stderr to err_path when given
 * ("/dev/null" to silence), else inherited. Returns the exit status, or -1. */
static inline int bench_run_cmd(char *const argv[], const char *out_path, const char *err_path)
{
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        if (out_path && freopen(out_path, "w", stdout) == NULL) _exit(127);
        if (err_path && freopen(err_path, "w", stderr) == NULL) _exit(127);
        execvp(argv[0], argv);
        _exit(127);
    }
    int st;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR) return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* The size of a file, 0 when it cannot be read. */
static inline int bench_dbl_cmp_(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of v[0..n), n > 0; sorts v in place. */
static inline double bench_median(double *v, size_t n)
{
    qsort(v, n, sizeof *v, bench_dbl_cmp_);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static inline uint64_t bench_file_size(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (uint64_t)st.st_size : 0;
}

/* The ember binary a benchmark drives: $EMBER_BIN, else build/ember beside this program's
 * build/tools/ directory; NULL when neither can be worked out. */
/* How busy the machine was with other work while a benchmark ran its children: CPU time of
 * the whole machine (/proc/stat) minus the CPU time of this process's waited-for children and
 * of itself, over cores x wall. Load average cannot say it: its one-minute mean counts the
 * benchmark's own threads. */
typedef struct bench_others {
    double t0, busy0, own0;
} bench_others;

static inline double bench_busy_seconds_(void)
{
    FILE *f = fopen("/proc/stat", "r");
    unsigned long long u = 0, n = 0, sy = 0, idle = 0, io = 0, irq = 0, sirq = 0, st = 0;
    int got = f ? fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &u, &n, &sy, &idle, &io,
                         &irq, &sirq, &st)
                : 0;
    if (f) fclose(f);
    (void)idle;
    (void)io;
    return got >= 7 ? (double)(u + n + sy + irq + sirq) / (double)sysconf(_SC_CLK_TCK) : 0;
}

static inline double bench_own_seconds_(void)
{
    struct rusage a, b;
    getrusage(RUSAGE_SELF, &a);
    getrusage(RUSAGE_CHILDREN, &b);
    return (double)(a.ru_utime.tv_sec + a.ru_stime.tv_sec + b.ru_utime.tv_sec + b.ru_stime.tv_sec) +
           (double)(a.ru_utime.tv_usec + a.ru_stime.tv_usec + b.ru_utime.tv_usec +
                    b.ru_stime.tv_usec) /
               1e6;
}

static inline void bench_others_begin(bench_others *m)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    m->t0 = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
    m->busy0 = bench_busy_seconds_();
    m->own0 = bench_own_seconds_();
}

/* Cores' worth of other work since bench_others_begin (0 = the machine was ours; 1 = one
 * core busy with others throughout). Negative values (tick rounding) read as 0. */
static inline double bench_others_end(const bench_others *m)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double wall = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9 - m->t0;
    double others = (bench_busy_seconds_() - m->busy0) - (bench_own_seconds_() - m->own0);
    return wall > 0 && others > 0 ? others / wall : 0;
}

static inline const char *bench_ember_path(void)
{
    static char buf[4096];
    const char *env = getenv("EMBER_BIN");
    if (env) return env;
    if (cm_self_exe(buf, sizeof buf - 16, NULL) != CM_OK) return NULL;
    char *d = dirname(dirname(buf)); /* build/tools/bench_x -> build */
    memmove(buf, d, strlen(d) + 1);
    strcat(buf, "/ember");
    return buf;
}

/* splitmix64's mixer: keys and random numbers the benchmarks make, the same in every one. */
static inline uint64_t bench_mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* splitmix64: the mixer over a counter. */
static inline uint64_t bench_rng_next(uint64_t *s)
{
    return bench_mix64((*s)++);
}

#endif
