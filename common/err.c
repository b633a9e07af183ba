#define _GNU_SOURCE /* SCHED_IDLE */
#include "common/common.h"

#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include "common/xxh.h"

/* The message is formatted whole, at any length (paths reach 4 KiB), before *errptr is freed:
 * a caller may quote the message it replaces. */
static void err_vset(char **errptr, const char *suffix, const char *fmt, va_list ap)
{
    if (errptr == NULL) return;
    va_list ap2;
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap2);
    va_end(ap2);
    if (n < 0) n = 0;
    size_t len = (size_t)n + (suffix ? strlen(suffix) + 2 : 0) + 1;
    char *msg = malloc(len);
    if (msg == NULL) return; /* keep any older message rather than lose both */
    vsnprintf(msg, (size_t)n + 1, fmt, ap);
    if (suffix) snprintf(msg + n, len - (size_t)n, ": %s", suffix);
    free(*errptr);
    *errptr = msg;
}

int(cm_err)(char **errptr, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    err_vset(errptr, NULL, fmt, ap);
    va_end(ap);
    return code;
}

int(cm_err_errno)(char **errptr, int code, const char *fmt, ...)
{
    int saved = errno;
    va_list ap;
    va_start(ap, fmt);
    err_vset(errptr, strerror(saved), fmt, ap);
    va_end(ap);
    errno = saved;
    return code;
}

uint64_t cm_xxh3(const void *buf, size_t len)
{
    return XXH3_64bits(buf, len);
}

double cm_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void cm_thread_background(void)
{
    struct sched_param sp = {0};
    if (pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp) == 0) return;
    id_t tid = (id_t)syscall(SYS_gettid);
    errno = 0;
    int cur = getpriority(PRIO_PROCESS, tid);
    if (errno == 0) (void)setpriority(PRIO_PROCESS, tid, cur + 10);
}

void cm_malloc_tune(void)
{
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 64 << 20);
}
