/*
 * OpenBLAS kernel choice: cm_blas_core_pick leaves a core OpenBLAS knows alone and replaces a
 * pre-AVX2 fallback with one this CPU runs; `ember version` (which re-executes itself with
 * OPENBLAS_CORETYPE where needed) then reports AVX2-or-newer kernels on any CPU that has AVX2,
 * whatever OpenBLAS detected by itself, and keeps a core the user set.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/common.h"

static int cpu_has_avx2(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* The kernels `ember version` reports, into out; 0 when it ran and said. */
static int ember_kernels(char *out, size_t n)
{
    const char *bin = getenv("EMBER_BIN");
    if (bin == NULL) return -1;
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "'%s' version", bin);
    FILE *p = popen(cmd, "r");
    if (p == NULL) return -1;
    char line[512] = "";
    char *got = fgets(line, sizeof line, p);
    int rc = pclose(p);
    const char *k = got ? strstr(line, "OpenBLAS kernels: ") : NULL;
    if (rc != 0 || k == NULL) return -1;
    k += strlen("OpenBLAS kernels: ");
    size_t len = strcspn(k, ",)");
    snprintf(out, n, "%.*s", (int)len, k);
    return 0;
}

int main(void)
{
    static const char *const known[] = {"Haswell", "SkylakeX", "Cooperlake", "Zen", "Neoverse N1"};
    for (size_t i = 0; i < sizeof known / sizeof *known; i++)
        CHECK_MSG(cm_blas_core_pick(known[i]) == NULL, "%s replaced", known[i]);
    CHECK(cm_blas_core_pick(NULL) == NULL);

    static const char *const legacy[] = {"Prescott", "Core2", "Nehalem", "Sandybridge"};
    for (size_t i = 0; i < sizeof legacy / sizeof *legacy; i++) {
        const char *c = cm_blas_core_pick(legacy[i]);
        CHECK_MSG((c != NULL) == cpu_has_avx2(), "%s -> %s", legacy[i], c ? c : "(none)");
        if (c == NULL) continue;
        CHECK_MSG(!strcmp(c, "Haswell") || !strcmp(c, "SkylakeX") || !strcmp(c, "Cooperlake"),
                  "%s -> %s", legacy[i], c);
        if (!strcmp(c, "SkylakeX") || !strcmp(c, "Cooperlake"))
            CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"));
        if (!strcmp(c, "Cooperlake")) CHECK(__builtin_cpu_supports("avx512bf16"));
    }

    char k[128];
    unsetenv("OPENBLAS_CORETYPE");
    CHECK_MSG(ember_kernels(k, sizeof k) == 0, "ember version did not name its kernels");
    printf("ember version, OPENBLAS_CORETYPE unset: %s kernels\n", k);
    if (cpu_has_avx2())
        CHECK_MSG(cm_blas_core_pick(k) == NULL, "ember runs pre-AVX2 kernels (%s) on an AVX2 CPU",
                  k);
    if (cpu_has_avx2()) {
        setenv("OPENBLAS_CORETYPE", "Haswell", 1);
        CHECK_MSG(ember_kernels(k, sizeof k) == 0 && !strcmp(k, "Haswell"),
                  "OPENBLAS_CORETYPE=Haswell not kept: %s", k);
    }
    return check_done();
}
