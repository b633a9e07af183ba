/* The backend registry: the one place that knows which compute backends this build has. It
 * lives outside ember_models so that the serving library, which needs only the CPU forward
 * pass, never links CUDA. The cuda backend is a module (libember_cuda.so) loaded on first use,
 * so that only a run that computes on a GPU maps the CUDA libraries. */
#include <string.h>

#include "common/common.h"
#include "src/model.h"

#ifdef EMBER_HAVE_CUDA
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;
static const backend_ops *cuda_ops;
static int (*cuda_probe)(char **errptr);
static char cuda_why[2048]; /* why the module did not load */

/* Tries one path; appends why it failed to cuda_why. */
static bool cuda_try(const char *path)
{
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    const char *why = NULL;
    if (h != NULL) {
        const backend_ops *const *ops = dlsym(h, "backend_cuda_module_ops");
        int (*probe)(char **) = (int (*)(char **))dlsym(h, "backend_cuda_module_probe");
        if (ops != NULL && *ops != NULL && probe != NULL) {
            cuda_ops = *ops;
            cuda_probe = probe;
            return true;
        }
        why = "not an ember CUDA module";
        dlclose(h);
    } else {
        why = dlerror();
    }
    size_t n = strlen(cuda_why);
    snprintf(cuda_why + n, sizeof cuda_why - n, "%s%s", n ? "; " : "", why ? why : path);
    return false;
}

/* EMBER_CUDA_MODULE, else beside the running binary, else where this build put it. */
static void cuda_load(void)
{
    const char *env = getenv("EMBER_CUDA_MODULE");
    if (env != NULL && *env != '\0') {
        cuda_try(env);
        return;
    }
    char self[PATH_MAX];
    if (cm_self_exe(self, sizeof self, NULL) == CM_OK) {
        char *slash = strrchr(self, '/');
        if (slash != NULL && (size_t)(slash - self) + sizeof "/libember_cuda.so" <= sizeof self) {
            strcpy(slash, "/libember_cuda.so");
            if (access(self, F_OK) == 0) {
                if (cuda_try(self)) return;
                /* The same file, where the binary runs from its build: tried once. */
                if (strcmp(self, EMBER_CUDA_MODULE_PATH) == 0) return;
            }
        }
    }
    cuda_try(EMBER_CUDA_MODULE_PATH);
}

bool backend_cuda_built(void)
{
    return true;
}

const backend_ops *backend_cuda(char **errptr)
{
    pthread_once(&cuda_once, cuda_load);
    if (cuda_ops == NULL)
        cm_err(errptr, CM_EINVAL, "cannot load the CUDA backend module libember_cuda.so (%s)",
               cuda_why);
    return cuda_ops;
}

int backend_cuda_probe(char **errptr)
{
    /* No driver, no device: said without loading the module and the CUDA libraries. */
    void *drv = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (drv == NULL)
        return cm_err(errptr, CM_ERR,
                      "cuda: no CUDA device (no NVIDIA driver: libcuda.so.1 not found)");
    dlclose(drv);
    if (backend_cuda(errptr) == NULL) return CM_ERR;
    return cuda_probe(errptr);
}
#else
bool backend_cuda_built(void)
{
    return false;
}

const backend_ops *backend_cuda(char **errptr)
{
    cm_err(errptr, CM_EINVAL, "this ember was built without CUDA (nvcc not found)");
    return NULL;
}

int backend_cuda_probe(char **errptr)
{
    return cm_err(errptr, CM_EINVAL, "this ember was built without CUDA (nvcc not found)");
}
#endif

int backend_find(const char *name, const backend_ops **out, char **errptr)
{
    if (strcmp(name, "cpu") == 0) {
        *out = &backend_cpu_ops;
        return CM_OK;
    }
    if (strcmp(name, "cuda") == 0) {
        *out = backend_cuda(errptr);
        return *out != NULL ? CM_OK : CM_EINVAL;
    }
    return cm_err(errptr, CM_EINVAL, "unknown device '%s' (cpu, cuda)", name);
}
