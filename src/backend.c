/* The backend registry: the one place that knows which compute backends this build has. It
 * lives outside ember_models so that the serving library, which needs only the CPU forward
 * pass, never links CUDA. */
#include <string.h>

#include "common/common.h"
#include "src/model.h"

int backend_find(const char *name, const backend_ops **out, char **errptr)
{
    if (strcmp(name, "cpu") == 0) {
        *out = &backend_cpu_ops;
        return CM_OK;
    }
    if (strcmp(name, "cuda") == 0) {
        if (backend_cuda_ops == NULL)
            return cm_err(errptr, CM_EINVAL, "this ember was built without CUDA (nvcc not found)");
        *out = backend_cuda_ops;
        return CM_OK;
    }
    return cm_err(errptr, CM_EINVAL, "unknown device '%s' (cpu, cuda)", name);
}

#ifndef EMBER_HAVE_CUDA
const backend_ops *const backend_cuda_ops = NULL;

int backend_cuda_probe(char **errptr)
{
    return cm_err(errptr, CM_EINVAL, "this ember was built without CUDA (nvcc not found)");
}
#endif
