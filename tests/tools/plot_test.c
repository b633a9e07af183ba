/*
 * tools/plot: draws a PNG from a run directory's metrics.jsonl (training lines and eval lines
 * with "auc"). Needs gnuplot (or python3-matplotlib): without either, exits 77, which ctest
 * reports as skipped (SKIP_RETURN_CODE), never as passed. The test never installs anything
 * (EMBER_PLOT_NO_INSTALL=1).
 *
 * argv[1] is tools/plot.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "check.h"

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: plot_test PATH/tools/plot\n");
        return 2;
    }
    if (system("command -v gnuplot >/dev/null 2>&1 || python3 -c 'import matplotlib' 2>/dev/null") != 0) {
        printf("SKIPPED: gnuplot not installed (apt-get install gnuplot-nox), nor python3-matplotlib\n");
        return 77;
    }
    const char *dir = check_tmpdir("tools_plot");
    char path[4200], png[4200], cmd[9000];
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f == NULL) return check_done();
    for (int s = 10; s <= 200; s += 10)
        fprintf(f, "{\"step\":%d,\"samples\":%d,\"seconds\":%.3f,\"loss\":%.6f,\"samples_per_s\":%.1f}\n", s,
                s * 2048, s * 0.04, 0.45 + 0.2 / s, 51200.0 - s);
    fprintf(f, "{\"step\":100,\"auc\":0.7012,\"logloss\":0.4601}\n{\"step\":200,\"auc\":0.7204,\"logloss\":0.4532}\n");
    fclose(f);
    snprintf(png, sizeof png, "%s/out.png", dir);
    snprintf(cmd, sizeof cmd, "EMBER_PLOT_NO_INSTALL=1 '%s' '%s' '%s' >/dev/null", argv[1], dir, png);
    int st = system(cmd);
    int rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    CHECK_MSG(rc == 0, "tools/plot exited %d", rc);
    struct stat sb;
    CHECK(stat(png, &sb) == 0 && sb.st_size > 1000);
    unsigned char sig[8] = {0};
    f = fopen(png, "rb");
    if (f) {
        CHECK(fread(sig, 1, 8, f) == 8);
        fclose(f);
    }
    CHECK(memcmp(sig, "\x89PNG\r\n\x1a\n", 8) == 0);
    /* A loss that is no number ("nan") is a gap at its step, drawn as a line without the key:
     * it was read as an empty field, which moved samples/s into the loss column. Both runs are
     * named "run" (the title), so their PNGs must be the same bytes. */
    const char *kinds[2] = {"\"loss\":nan,\"samples_per_s\":640.0}",
                            "\"samples_per_s\":640.0,\"x\":\"loss\"}"};
    char pngs[2][4300];
    for (int k = 0; k < 2; k++) {
        snprintf(path, sizeof path, "%s/%c", dir, 'a' + k);
        mkdir(path, 0755);
        snprintf(path, sizeof path, "%s/%c/run", dir, 'a' + k);
        mkdir(path, 0755);
        snprintf(path, sizeof path, "%s/%c/run/metrics.jsonl", dir, 'a' + k);
        f = fopen(path, "w");
        CHECK(f != NULL);
        if (f == NULL) return check_done();
        for (int s = 10; s <= 40; s += 10) {
            fprintf(f, "{\"step\":%d,\"samples\":%d,\"seconds\":%d.0,", s, s * 64, s / 10);
            if (s == 30)
                fprintf(f, "%s\n", kinds[k]);
            else
                fprintf(f, "\"loss\":0.%d,\"samples_per_s\":640.0}\n", 60 - s);
        }
        fclose(f);
        snprintf(pngs[k], sizeof pngs[k], "%s/%c/out.png", dir, 'a' + k);
        snprintf(cmd, sizeof cmd, "EMBER_PLOT_NO_INSTALL=1 '%s' '%s/%c/run' '%s' >/dev/null",
                 argv[1], dir, 'a' + k, pngs[k]);
        CHECK(system(cmd) == 0);
    }
    snprintf(cmd, sizeof cmd, "cmp -s '%s' '%s'", pngs[0], pngs[1]);
    CHECK_MSG(system(cmd) == 0, "a \"loss\":nan line drew other curves than a line without loss");
    /* No metrics: an error, not a PNG. */
    snprintf(cmd, sizeof cmd, "EMBER_PLOT_NO_INSTALL=1 '%s' '%s/nothing-here' 2>/dev/null", argv[1], dir);
    st = system(cmd);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 1);
    return check_done();
}
