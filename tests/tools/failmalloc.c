/*
 * LD_PRELOAD library for tools_oom: fails one allocation, the FAILMALLOC_AT-th malloc, calloc or
 * realloc called from the main executable's own code (ember's static libraries and its CLI;
 * RocksDB, nng and libc allocate through the same functions from their own code and are left
 * alone, since a C++ library out of memory throws rather than returns NULL). With FAILMALLOC_COUNT
 * set it prints "failmalloc: total N" (the executable's own calls) to stderr at exit, and with
 * FAILMALLOC_BT the failing call's backtrace. Without FAILMALLOC_AT it only counts. glibc only
 * (__libc_malloc and friends).
 */
#define _GNU_SOURCE
#include <execinfo.h>
#include <link.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);

static atomic_long n_calls;
static long fail_at = -2; /* -2: not read yet; -1: count only */
static uintptr_t lo, hi;  /* the executable's code */

/* The first object dl_iterate_phdr reports is the executable: its executable segment. */
static int find_exe(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size;
    (void)arg;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type == PT_LOAD && (ph->p_flags & PF_X)) {
            lo = info->dlpi_addr + ph->p_vaddr;
            hi = lo + ph->p_memsz;
        }
    }
    return 1;
}

/* Allocations start before main (the loader, libc): reading the environment then is safe, and
 * racing threads at worst read it twice. */
static int should_fail(void *caller)
{
    if (fail_at == -2) {
        const char *e = getenv("FAILMALLOC_AT");
        dl_iterate_phdr(find_exe, NULL);
        fail_at = e ? atol(e) : -1;
    }
    if ((uintptr_t)caller < lo || (uintptr_t)caller >= hi) return 0;
    long k = atomic_fetch_add(&n_calls, 1) + 1;
    if (k != fail_at) return 0;
    if (getenv("FAILMALLOC_BT")) {
        void *b[16];
        backtrace_symbols_fd(b, backtrace(b, 16), 2);
    }
    return 1;
}

void *malloc(size_t n)
{
    return should_fail(__builtin_return_address(0)) ? NULL : __libc_malloc(n);
}

void *calloc(size_t a, size_t b)
{
    return should_fail(__builtin_return_address(0)) ? NULL : __libc_calloc(a, b);
}

void *realloc(void *p, size_t n)
{
    return should_fail(__builtin_return_address(0)) ? NULL : __libc_realloc(p, n);
}

__attribute__((destructor)) static void report(void)
{
    if (getenv("FAILMALLOC_COUNT")) fprintf(stderr, "failmalloc: total %ld\n", (long)n_calls);
}
