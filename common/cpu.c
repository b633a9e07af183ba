/* Which OpenBLAS kernels this CPU should run, when OpenBLAS's own detection falls short. */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/common.h"

/* Cores of a DYNAMIC_ARCH OpenBLAS that predate AVX2: what its detection falls back to on a
 * CPU model it does not know (Debian 12's 0.3.21 names a Sapphire Rapids "Prescott"). */
static const char *const pre_avx2[] = {"Prescott", "Core2",      "Penryn",      "Dunnington",
                                       "Nehalem",  "Atom",       "Northwood",   "Banias",
                                       "Katmai",   "Coppermine", "Sandybridge", "Unknown"};

const char *cm_blas_core_pick(const char *detected)
{
    if (detected == NULL) return NULL;
    bool legacy = false;
    for (size_t i = 0; i < sizeof pre_avx2 / sizeof pre_avx2[0]; i++)
        legacy = legacy || strcmp(detected, pre_avx2[i]) == 0;
    if (!legacy) return NULL;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    /* libgcc sets these only where the OS saves the registers too (XCR0). */
    bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                  __builtin_cpu_supports("avx512cd");
    if (avx512 && __builtin_cpu_supports("avx512bf16")) return "Cooperlake";
    if (avx512) return "SkylakeX";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
#endif
    return NULL;
}

void cm_blas_core_reexec(const char *detected, char **argv)
{
    if (getenv("OPENBLAS_CORETYPE") != NULL) return;
    const char *core = cm_blas_core_pick(detected);
    if (core == NULL || setenv("OPENBLAS_CORETYPE", core, 1) != 0) return;
    /* The binary's own path, not /proc/self/exe: the process keeps its name (ps, pkill). */
    char self[4096];
    if (cm_self_exe(self, sizeof self, NULL) == CM_OK) execv(self, argv);
    unsetenv("OPENBLAS_CORETYPE");
}
