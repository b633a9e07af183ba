/*
 * The cuda backend where no device can be used: it must fail in create with a clear message,
 * never crash or exit, and leave the caller free to fall back to the cpu backend.
 *
 * CUDA_VISIBLE_DEVICES=-1 is set before the CUDA runtime starts, so this runs the no-device
 * path on every machine, GPU or not. In a build without CUDA, backend_find("cuda") itself must
 * say so.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "src/model.h"

/* Whether this process maps a library whose path contains `name`. */
static bool mapped(const char *name)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[4600];
    bool found = false;
    while (f != NULL && !found && fgets(line, sizeof line, f) != NULL)
        found = strstr(line, name) != NULL;
    if (f != NULL) fclose(f);
    return found;
}

int main(void)
{
    setenv("CUDA_VISIBLE_DEVICES", "-1", 1);
    char *err = NULL;
    const backend_ops *ops = NULL;
    /* Linking the registry maps no CUDA library: only loading the backend does. */
    CHECK_MSG(!mapped("libcudart") && !mapped("libcublas"), "CUDA libraries mapped at start");
    int rc = backend_find("cuda", &ops, &err);
    if (!backend_cuda_built()) {
        CHECK(rc != 0 && ops == NULL && backend_cuda(NULL) == NULL);
        CHECK_MSG(err && strstr(err, "without CUDA"), "err=%s", err ? err : "(none)");
        free(err);
        return check_done();
    }
    /* The module loads (from beside the ember binary, or where this build put it). */
    CHECK_OK(rc, err);
    CHECK(ops != NULL && ops == backend_cuda(NULL));
    CHECK_MSG(mapped("libember_cuda.so") && mapped("libcudart"), "module not mapped once loaded");
    CHECK(ops && strcmp(ops->name, "cuda") == 0);
    if (ops == NULL) return check_done();

    const model_kind kinds[] = {MODEL_LR, MODEL_MLP, MODEL_DLRM, MODEL_DEEPFM};
    for (int k = 0; k < 4; k++) {
        model_cfg m;
        model_layout l;
        model_cfg_preset(&m, kinds[k], 4, 3);
        CHECK_OK(model_layout_make(&m, &l, &err), err);
        /* Twice: a failed create must leave nothing behind that breaks the next one. */
        for (int rep = 0; rep < 2; rep++) {
            void *state = NULL;
            rc = ops->create(&m, &l, 256, 4096, 1, 0, &state, &err);
            CHECK_MSG(rc != 0, "%s: create succeeded without a device", model_kind_name(kinds[k]));
            CHECK(state == NULL);
            CHECK_MSG(err && strstr(err, "no CUDA device"), "%s: err=%s", model_kind_name(kinds[k]),
                      err ? err : "(none)");
            if (k == 0 && rep == 0 && err) fprintf(stderr, "create: %s\n", err);
            free(err);
            err = NULL;
            if (state) ops->destroy(state);
        }
        /* No error pointer: still a clean failure. */
        void *state = NULL;
        CHECK(ops->create(&m, &l, 16, 16, 1, 0, &state, NULL) != 0 && state == NULL);
        /* bf16 is the CPU's (AMX): refused by name, before any device is asked for. */
        rc = ops->create(&m, &l, 16, 16, 1, BACKEND_BF16, &state, &err);
        CHECK_MSG(rc != 0 && state == NULL && err && strstr(err, "--bf16") && strstr(err, "--tf32"),
                  "%s with BACKEND_BF16: rc %d, err=%s", model_kind_name(kinds[k]), rc,
                  err ? err : "(none)");
        free(err);
        err = NULL;
    }
    ops->destroy(NULL); /* a no-op, as for the cpu backend */

    /* The cpu backend still works in the same process. */
    model_cfg m;
    model_layout l;
    model_cfg_preset(&m, MODEL_LR, 2, 1);
    CHECK_OK(model_layout_make(&m, &l, &err), err);
    void *cpu = NULL;
    CHECK_OK(backend_cpu_ops.create(&m, &l, 4, 8, 1, 0, &cpu, &err), err);
    if (cpu) {
        float params[2] = {0.5f, 0.25f}, dense[1] = {1.0f}, labels[1] = {1.0f}, val[1] = {1.0f},
              e0[1] = {0.5f}, probs[1];
        uint32_t row_ptr[3] = {0, 1, 1}, col[1] = {0};
        model_batch b = {.B = 1, .F = 2, .D = 1, .U = 1, .dense = dense, .labels = labels,
                         .row_ptr = row_ptr, .col = col, .val = val, .emb = {e0, NULL}};
        double loss = 0;
        CHECK_OK(backend_cpu_ops.step(cpu, params, &b, probs, &loss, NULL, NULL, &err), err);
        CHECK(fabsf(probs[0] - 1.0f / (1.0f + expf(-1.25f))) < 1e-6f);
        backend_cpu_ops.destroy(cpu);
    }
    return check_done();
}
