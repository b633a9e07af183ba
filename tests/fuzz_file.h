/*
 * For libFuzzer targets whose code under test reads a file by path (config files): the input
 * bytes, as they are, in one temporary file per process that each run rewrites. Creating a
 * file per run would cost more than most parses; the file is removed at exit.
 */
#ifndef EMBER_TESTS_FUZZ_FILE_H
#define EMBER_TESTS_FUZZ_FILE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static char fuzz_file_path_[4096];
static int fuzz_file_fd_ = -1;

static void fuzz_file_remove_(void)
{
    unlink(fuzz_file_path_);
}

/* The path of a file holding exactly data[0..size); aborts when the file cannot be written (a
 * fuzzer that silently tested nothing would be worse). */
static inline const char *fuzz_file(const uint8_t *data, size_t size)
{
    if (fuzz_file_fd_ < 0) {
        const char *tmp = getenv("TMPDIR");
        snprintf(fuzz_file_path_, sizeof fuzz_file_path_, "%s/ember-fuzz-XXXXXX",
                 tmp && *tmp ? tmp : "/tmp");
        fuzz_file_fd_ = mkstemp(fuzz_file_path_);
        if (fuzz_file_fd_ < 0) abort();
        atexit(fuzz_file_remove_);
    }
    if (ftruncate(fuzz_file_fd_, 0) != 0 ||
        (size > 0 && pwrite(fuzz_file_fd_, data, size, 0) != (ssize_t)size))
        abort();
    return fuzz_file_path_;
}

#endif
