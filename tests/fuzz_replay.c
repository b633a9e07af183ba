/*
 * The main() of a libFuzzer target built without libFuzzer (fuzz_replay_<target> in ctest), so
 * that the GCC and ASan builds of tools/test run every target on what it was given:
 *
 *   fuzz_replay_<target> [--mutations N] [--seconds S] [--generate] [PATH...]
 *
 * Each PATH is a corpus folder (every file in it, in name order) or one file. A PATH that is
 * missing, or a folder with no file, is an error: a renamed corpus must not make the test pass
 * on nothing. Without a PATH (a target with no corpus), or with --generate, generated seeds are
 * added: empty, zeros, 0xff and random bytes of several lengths. Then up to N inputs mutated from
 * the seeds (byte flips, inserts, erases, truncations, splices of two seeds) with a fixed PRNG
 * seed, stopping early once S seconds have passed since the start, so a slow build (ASan) runs a
 * prefix of the same sequence. A crash, abort or sanitizer report fails the test, and the input
 * that did it is written to fuzz_replay_crash-<target> in the working directory, for the real
 * fuzzer to rerun.
 *
 * Each process gets a private temporary folder (under $EMBER_TEST_TMP, else $TMPDIR, else /tmp)
 * as its $TMPDIR, removed at exit, since targets write files and folders there.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/common.h"
#include "rng.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
/* Optional in a target, as with libFuzzer. */
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));
/* Present in sanitizer builds only: called before a sanitizer report ends the process. */
void __sanitizer_set_death_callback(void (*callback)(void)) __attribute__((weak));

#define MAX_MUTANT (1u << 20) /* mutations do not grow an input past this */

typedef struct seed {
    uint8_t *p;
    size_t n;
} seed;

static seed *seeds;
static size_t n_seeds;
static char tmp_dir[4096];
static char crash_path[4200];
/* The input running now, for the crash file. */
static const uint8_t *cur_p;
static size_t cur_n;

static void __attribute__((noreturn, format(printf, 1, 2))) die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fuzz_replay: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(1);
}

/* Async-signal-safe: open and write only. */
static void save_crash(void)
{
    if (cur_p == NULL) return;
    int fd = open(crash_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return;
    /* A dying process can do nothing about a failed write. */
    ssize_t w = cur_n > 0 ? write(fd, cur_p, cur_n) : 0;
    close(fd);
    static const char msg[] = "fuzz_replay: the failing input is in ";
    w = write(2, msg, sizeof msg - 1);
    w = write(2, crash_path, strlen(crash_path));
    w = write(2, "\n", 1);
    (void)w;
    cur_p = NULL;
}

static void on_signal(int sig)
{
    save_crash();
    signal(sig, SIG_DFL);
    raise(sig);
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

static void remove_tmp(void)
{
    nftw(tmp_dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* Registered before any target's own atexit handler, so it runs after them (they remove what
 * they made; this removes whatever is left). */
static void make_tmp(void)
{
    const char *parent = getenv("EMBER_TEST_TMP");
    if (parent == NULL || *parent == '\0') parent = getenv("TMPDIR");
    if (parent == NULL || *parent == '\0') parent = "/tmp";
    snprintf(tmp_dir, sizeof tmp_dir, "%s/fuzz_replay-XXXXXX", parent);
    if (mkdtemp(tmp_dir) == NULL) die("cannot make a folder under %s", parent);
    if (setenv("TMPDIR", tmp_dir, 1) != 0) die("cannot set TMPDIR to %s", tmp_dir);
    atexit(remove_tmp);
}

static void add_seed(uint8_t *p, size_t n)
{
    seeds = realloc(seeds, (n_seeds + 1) * sizeof *seeds);
    if (seeds == NULL) die("out of memory");
    seeds[n_seeds++] = (seed){p, n};
}

static void add_file(const char *path)
{
    void *p = NULL;
    size_t n = 0;
    char *err = NULL;
    if (cm_read_file(path, &p, &n, &err) != CM_OK) die("%s", err ? err : path);
    add_seed(p, n);
}

/* Every file of the folder, in name order; the number added. Hidden files are skipped. */
static size_t add_dir(const char *dir)
{
    struct dirent **ents = NULL;
    int n = scandir(dir, &ents, NULL, alphasort);
    if (n < 0) die("cannot read corpus folder %s", dir);
    size_t added = 0;
    for (int i = 0; i < n; i++) {
        char path[4400];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", dir, ents[i]->d_name);
        if (ents[i]->d_name[0] != '.' && stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
            add_file(path);
            added++;
        }
        free(ents[i]);
    }
    free(ents);
    return added;
}

static void add_generated(void)
{
    static const size_t lens[] = {1, 2, 3, 4, 7, 8, 16, 31, 64, 100, 256, 1000, 4096};
    add_seed(malloc(1), 0);
    for (int fill = 0; fill < 2; fill++) {
        uint8_t *p = malloc(64);
        if (p == NULL) die("out of memory");
        memset(p, fill ? 0xff : 0, 64);
        add_seed(p, 64);
    }
    for (size_t i = 0; i < sizeof lens / sizeof *lens; i++) {
        uint8_t *p = malloc(lens[i]);
        if (p == NULL) die("out of memory");
        for (size_t j = 0; j < lens[i]; j++)
            p[j] = (uint8_t)rnd64();
        add_seed(p, lens[i]);
    }
}

/* ---- mutations ---- */

typedef struct buf {
    uint8_t *p;
    size_t n, cap;
} buf;

static void reserve(buf *b, size_t n)
{
    if (n <= b->cap) return;
    b->cap = 2 * n;
    b->p = realloc(b->p, b->cap);
    if (b->p == NULL) die("out of memory");
}

/* Replaces [at, at + del) with n bytes of src (random ones when src is NULL). */
static void replace(buf *b, size_t at, size_t del, const uint8_t *src, size_t n)
{
    reserve(b, b->n - del + n);
    memmove(b->p + at + n, b->p + at + del, b->n - at - del);
    for (size_t i = 0; i < n; i++)
        b->p[at + i] = src ? src[i] : (uint8_t)rnd64();
    b->n = b->n - del + n;
}

/* A length in [0, max], mostly short: what a fuzzer's edits are. */
static size_t short_len(size_t max)
{
    size_t n = (size_t)rnd64() % (rnd64() % 4 == 0 ? 256 : 8) + 1;
    return n < max ? n : max;
}

static void mutate_once(buf *b)
{
    static const uint8_t edges[] = {0, 1, 0x7f, 0x80, 0xff, '\n', ' ', '=', '[', '0', '9', '-'};
    size_t at = b->n ? (size_t)(rnd64() % (b->n + 1)) : 0;
    switch (rnd64() % 8) {
    case 0: /* flip a bit */
        if (at < b->n) b->p[at] ^= (uint8_t)(1u << rnd64() % 8);
        break;
    case 1: /* a byte set to an edge value */
        if (at < b->n) b->p[at] = edges[rnd64() % sizeof edges];
        break;
    case 2: /* random bytes overwritten */
        replace(b, at, short_len(b->n - at), NULL, short_len(b->n - at));
        break;
    case 3: /* random bytes inserted */
        replace(b, at, 0, NULL, short_len(SIZE_MAX));
        break;
    case 4: /* bytes erased */
        replace(b, at, short_len(b->n - at), NULL, 0);
        break;
    case 5: /* truncated */
        b->n = at;
        break;
    case 6: { /* a chunk of itself copied elsewhere */
        if (b->n == 0) break;
        size_t from = (size_t)(rnd64() % b->n), n = short_len(b->n - from);
        uint8_t *chunk = malloc(n);
        if (chunk == NULL) die("out of memory");
        memcpy(chunk, b->p + from, n);
        replace(b, at, 0, chunk, n);
        free(chunk);
        break;
    }
    default: { /* spliced: from here on, another seed from a point of its own */
        const seed *o = &seeds[rnd64() % n_seeds];
        size_t from = o->n ? (size_t)(rnd64() % (o->n + 1)) : 0;
        replace(b, at, b->n - at, o->p + from, o->n - from);
        break;
    }
    }
    if (b->n > MAX_MUTANT) b->n = MAX_MUTANT;
}

/* ---- running ---- */

/* Runs one input from a heap block of exactly its size, as libFuzzer does, so that ASan sees a
 * read past its end. */
static void run_one(const uint8_t *p, size_t n)
{
    uint8_t *copy = malloc(n ? n : 1);
    if (copy == NULL) die("out of memory");
    if (n) memcpy(copy, p, n);
    cur_p = copy;
    cur_n = n;
    LLVMFuzzerTestOneInput(copy, n);
    cur_p = NULL;
    free(copy);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    const double t0 = now_s();
    const char *slash = strrchr(argv[0], '/');
    const char *name = slash ? slash + 1 : argv[0];
    if (strncmp(name, "fuzz_replay_", 12) == 0) name += 12; /* the target's own name */
    snprintf(crash_path, sizeof crash_path, "fuzz_replay_crash-%s", name);
    if (__sanitizer_set_death_callback) {
        __sanitizer_set_death_callback(save_crash);
    } else {
        /* A sanitizer keeps its own SEGV handler; this replaces none. */
        signal(SIGABRT, on_signal);
        signal(SIGSEGV, on_signal);
        signal(SIGBUS, on_signal);
        signal(SIGFPE, on_signal);
    }
    unsigned long mutations = 1000;
    double seconds = 10;
    int paths = 0, generate = 0;
    rng_state = 0x66757a7a7265706cull; /* "fuzzrepl" */
    make_tmp();
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (strcmp(argv[i], "--mutations") == 0 && i + 1 < argc) {
            mutations = strtoul(argv[++i], NULL, 10);
        } else if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc) {
            seconds = strtod(argv[++i], NULL);
        } else if (strcmp(argv[i], "--generate") == 0) {
            generate = 1;
        } else if (stat(argv[i], &st) != 0) {
            die("corpus %s is missing", argv[i]);
        } else if (S_ISDIR(st.st_mode)) {
            if (add_dir(argv[i]) == 0) die("corpus folder %s has no file", argv[i]);
            paths++;
        } else {
            add_file(argv[i]);
            paths++;
        }
    }
    const size_t files = n_seeds;
    if (paths == 0 || generate) add_generated();
    if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
    for (size_t i = 0; i < n_seeds; i++)
        run_one(seeds[i].p, seeds[i].n);
    unsigned long done = 0;
    buf b = {0};
    for (; done < mutations && now_s() - t0 < seconds; done++) {
        const seed *s = &seeds[rnd64() % n_seeds];
        b.n = 0;
        reserve(&b, s->n + 1);
        if (s->n) memcpy(b.p, s->p, s->n);
        b.n = s->n;
        for (int k = 1 + (int)(rnd64() % 4); k > 0; k--)
            mutate_once(&b);
        run_one(b.p, b.n);
    }
    free(b.p);
    printf("fuzz_replay: %s ran %zu inputs (%zu corpus files from %d paths, %zu generated, "
           "%lu of %lu mutations) in %.1f s\n",
           name, n_seeds + done, files, paths, n_seeds - files, done, mutations, now_s() - t0);
    for (size_t i = 0; i < n_seeds; i++)
        free(seeds[i].p);
    free(seeds);
    return 0;
}
