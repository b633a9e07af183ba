/*
 * Minimal test harness shared by ember's C tests: CHECK records a failure with file and line
 * and continues; the test's main returns check_done(), non-zero when anything failed.
 * Temporary files go under $EMBER_TEST_TMP (set by ctest) via check_tmpdir().
 */
#ifndef EMBER_TESTS_CHECK_H
#define EMBER_TESTS_CHECK_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/common.h"

#include "san.h"

/* Counted atomically: tests check from several threads at once (serve_predict_state). */
static int check_failures_;
static int check_count_;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        __atomic_add_fetch(&check_count_, 1, __ATOMIC_RELAXED);                                    \
        if (!(cond)) {                                                                             \
            __atomic_add_fetch(&check_failures_, 1, __ATOMIC_RELAXED);                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);               \
        }                                                                                          \
    } while (0)

#define CHECK_MSG(cond, ...)                                                                       \
    do {                                                                                           \
        __atomic_add_fetch(&check_count_, 1, __ATOMIC_RELAXED);                                    \
        if (!(cond)) {                                                                             \
            __atomic_add_fetch(&check_failures_, 1, __ATOMIC_RELAXED);                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);               \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
        }                                                                                          \
    } while (0)

/* A float from its bits and back (memcpy: no aliasing through pointers). */
static inline float check_f32_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t check_u32_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* Fails the check when rc != 0, printing and freeing err. */
#define CHECK_OK(rc, err)                                                                          \
    do {                                                                                           \
        int rc_ = (rc);                                                                            \
        CHECK_MSG(rc_ == 0, "rc=%d err=%s", rc_, (err) ? (err) : "(none)");                        \
        free(err);                                                                                 \
        (err) = NULL;                                                                              \
    } while (0)

/* The test's directories from check_tmpdir: check_done removes them when every check passed
 * (a failed test leaves them for a look). */
#define CHECK_MAX_TMPDIRS 8
static char check_tmpdirs_[CHECK_MAX_TMPDIRS][4096];
static int check_n_tmpdirs_;

/* A fresh directory for this test: $EMBER_TEST_TMP/<name>.<pid>, created empty. */
static inline const char *check_tmpdir(const char *name)
{
    if (check_n_tmpdirs_ == CHECK_MAX_TMPDIRS) {
        fprintf(stderr, "more than %d check_tmpdir calls\n", CHECK_MAX_TMPDIRS);
        exit(2);
    }
    char *buf = check_tmpdirs_[check_n_tmpdirs_++];
    const char *base = getenv("EMBER_TEST_TMP");
    if (base == NULL) base = "/tmp";
    snprintf(buf, sizeof check_tmpdirs_[0], "%s/%s.%ld", base, name, (long)getpid());
    char *err = NULL;
    if (cm_rmtree(buf, &err) != 0 || cm_mkdirs(buf, &err) != 0) {
        fprintf(stderr, "cannot create %s: %s\n", buf, err ? err : "?");
        exit(2);
    }
    return buf;
}

static inline int check_done(void)
{
    if (check_count_ == 0) {
        fprintf(stderr, "no checks ran\n");
        return 1;
    }
    fprintf(stderr, "%d checks, %d failed\n", check_count_, check_failures_);
    for (int i = 0; check_failures_ == 0 && i < check_n_tmpdirs_; i++) {
        char *err = NULL;
        if (cm_rmtree(check_tmpdirs_[i], &err) != 0)
            fprintf(stderr, "cannot remove %s: %s\n", check_tmpdirs_[i], err ? err : "?");
        free(err);
    }
    return check_failures_ ? 1 : 0;
}

#endif
