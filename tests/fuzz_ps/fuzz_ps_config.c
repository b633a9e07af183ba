/*
 * libFuzzer target: any bytes as the cluster config file, through cm_ini_parse and
 * ps_config_load (which runs ps_config_check), then what a loaded config offers without a
 * server: the check again, and the memory plan (ps_plan) of every table for a few row counts.
 *
 * Properties checked (abort on violation): a refused file gets an error that starts with the
 * file's name and, where it gives a line, a line that exists (not 0: a section's header line
 * is recorded as the parser reads it); a loaded config passes ps_config_check
 * again; a plan splits the rows it was given into rows in memory and spilled rows, and its byte
 * counts are finite and not negative.
 */
#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ps/ps.h"
#include "tests/fuzz_file.h"

static void check_plan(const ps_config *cfg, uint32_t t, uint64_t rows)
{
    ps_plan_row p;
    ps_plan(cfg, t, rows, &p);
    if (p.rows_in_memory + p.rows_spilled != rows || p.rows_in_memory > rows ||
        !(p.mem_bytes >= 0) || !isfinite(p.mem_bytes) || !(p.disk_bytes >= 0) ||
        !isfinite(p.disk_bytes) || !(p.mem_bytes_per_row > 0) || !(p.initial_bytes > 0) ||
        p.row_bytes == 0)
        abort();
}

/* "PATH: ..." or "PATH:LINE: ..." with LINE from 1 to the file's line count. */
static int names_file_and_line(const char *err, const char *path, const uint8_t *data, size_t size)
{
    size_t n = strlen(path);
    if (strncmp(err, path, n) != 0 || err[n] != ':') return 0;
    if (err[n + 1] == ' ') return 1;
    char *end;
    unsigned long line = strtoul(err + n + 1, &end, 10), lines = 1;
    for (size_t i = 0; i < size; i++)
        lines += data[i] == '\n';
    return isdigit((unsigned char)err[n + 1]) && *end == ':' && line >= 1 && line <= lines;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static ps_config cfg; /* about 80 KB: not on the stack */
    const char *path = fuzz_file(data, size);
    char *err = NULL;
    int rc = ps_config_load(path, &cfg, &err);
    if (rc != CM_OK) {
        if (rc > 0 || err == NULL || !names_file_and_line(err, path, data, size)) abort();
        free(err);
        return 0;
    }
    free(err);
    err = NULL;
    if (ps_config_check(&cfg, &err) != CM_OK) abort();
    const uint64_t rows[] = {0, 1, 1000, 123456789, 1ull << 40, UINT64_MAX};
    for (uint32_t t = 0; t < cfg.n_tables; t++)
        for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
            check_plan(&cfg, t, rows[i]);
    return 0;
}
