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

static int check_failures_;
static int check_count_;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        check_count_++;                                                                            \
        if (!(cond)) {                                                                             \
            check_failures_++;                                                                     \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);               \
        }                                                                                          \
    } while (0)

#define CHECK_MSG(cond, ...)                                                                       \
    do {                                                                                           \
        check_count_++;                                                                            \
        if (!(cond)) {                                                                             \
            check_failures_++;                                                                     \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);               \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
        }                                                                                          \
    } while (0)

/* Fails the check when rc != 0, printing and freeing err. */
#define CHECK_OK(rc, err)                                                                          \
    do {                                                                                           \
        int rc_ = (rc);                                                                            \
        CHECK_MSG(rc_ == 0, "rc=%d err=%s", rc_, (err) ? (err) : "(none)");                        \
        free(err);                                                                                 \
        (err) = NULL;                                                                              \
    } while (0)

/* The test's directory from check_tmpdir: check_done removes it when every check passed (a
 * failed test leaves it for a look). */
static char check_tmpdir_[4096];

/* A fresh directory for this test: $EMBER_TEST_TMP/<name>.<pid>, created empty. */
static inline const char *check_tmpdir(const char *name)
{
    char *buf = check_tmpdir_;
    const char *base = getenv("EMBER_TEST_TMP");
    if (base == NULL) base = "/tmp";
    snprintf(buf, sizeof check_tmpdir_, "%s/%s.%ld", base, name, (long)getpid());
    char cmd[8400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s'", buf, buf);
    if (system(cmd) != 0) {
        fprintf(stderr, "cannot create %s\n", buf);
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
    if (check_failures_ == 0 && check_tmpdir_[0] != '\0') {
        char cmd[8400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", check_tmpdir_);
        if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", check_tmpdir_);
    }
    return check_failures_ ? 1 : 0;
}

#endif
