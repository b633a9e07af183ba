/*
 * Issue #6's training check: `ember train --model mlp` on generated data, once with
 * --device cpu and once with --device cuda (the same seed, data and schedule); the cuda run's
 * AUC must reach the CPU run's within 0.001. gpu_parity compares single steps to 1e-5; this is
 * the end-to-end view of the same promise, through the PS path, where the GPU's other summation
 * order compounds over a few hundred steps.
 *
 * Without a usable device it prints "SKIPPED: ..." and exits 77 (ctest: skipped).
 */
#include <stdlib.h>

#include "src/model.h"
#include "train/cli_util.h"

#define AUC_GAP 0.001

/* The eval AUC of one run, NAN when it failed. */
static double train_auc(const char *device)
{
    int rc = run("train --train ds/train --eval ds/eval --model mlp --device %s --batch 1024 "
                 "--epochs 1 --seed 1 --out run-%s --no-progress",
                 device, device);
    CHECK_MSG(rc == 0, "train --device %s: exit %d", device, rc);
    return rc == 0 ? jnum(last_line(), "auc") : NAN;
}

int main(void)
{
    char *err = NULL;
    if (backend_cuda_probe(&err) != 0) {
        printf("SKIPPED: %s\n", err ? err : "no CUDA device");
        free(err);
        return 77;
    }
    if (cli_init("gpu_train") != 0) return 1;
    if (make_criteo("ds", 220000, 5, 0.1) != 0) return check_done();
    double cpu = train_auc("cpu"), gpu = train_auc("cuda");
    fprintf(stderr, "mlp AUC: cpu %.5f, cuda %.5f (%+.5f)\n", cpu, gpu, gpu - cpu);
    CHECK_MSG(gpu >= cpu - AUC_GAP, "cuda AUC %.5f is more than %.3f below the CPU's %.5f", gpu,
              AUC_GAP, cpu);
    CHECK_MSG(gpu > 0.6, "cuda AUC %.5f: the model did not learn", gpu);
    free(out_text);
    free(err_text);
    return check_done();
}
