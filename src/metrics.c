#include "src/metrics.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"

/* A score mapped to an unsigned key whose integer order is the float order, plus its label. */
typedef struct {
    uint32_t key;
    uint32_t pos; /* 1 for a positive */
} auc_item;

static uint32_t float_key(float f)
{
    if (f == 0.0f) f = 0.0f; /* -0.0 and +0.0 must land in one tie group */
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    /* Negative floats order backwards as integers: flip all bits; positives: set the sign. */
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/* LSD radix sort by key, 8 bits a pass; stable, O(n), scratch tmp of n items. */
static void radix_sort(auc_item *a, auc_item *tmp, size_t n)
{
    for (int shift = 0; shift < 32; shift += 8) {
        size_t count[257] = {0};
        for (size_t i = 0; i < n; i++) count[((a[i].key >> shift) & 0xff) + 1]++;
        int skip = 0; /* every key shares this byte: the pass would not move anything */
        for (int b = 1; b <= 256; b++) skip |= count[b] == n;
        if (skip) continue;
        for (int b = 0; b < 256; b++) count[b + 1] += count[b];
        for (size_t i = 0; i < n; i++) tmp[count[(a[i].key >> shift) & 0xff]++] = a[i];
        memcpy(a, tmp, n * sizeof *a);
    }
}

int metrics_auc(const float *scores, const float *labels, size_t n, double *auc, char **errptr)
{
    if (n == 0) return cm_err(errptr, CM_EINVAL, "auc: no examples");
    auc_item *a = malloc(n * sizeof *a), *tmp = malloc(n * sizeof *tmp);
    if (a == NULL || tmp == NULL) {
        free(a);
        free(tmp);
        return cm_err(errptr, CM_ENOMEM, "auc: out of memory for %zu examples", n);
    }
    uint64_t npos = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(scores[i])) {
            free(a);
            free(tmp);
            return cm_err(errptr, CM_EINVAL, "auc: score %zu is NaN", i);
        }
        a[i].key = float_key(scores[i]);
        a[i].pos = labels[i] > 0.5f;
        npos += a[i].pos;
    }
    uint64_t nneg = n - npos;
    if (npos == 0 || nneg == 0) {
        free(a);
        free(tmp);
        return cm_err(errptr, CM_EINVAL, "auc: undefined with %llu positives and %llu negatives",
                      (unsigned long long)npos, (unsigned long long)nneg);
    }
    radix_sort(a, tmp, n);
    /* Sum of the (1-based, tie-averaged) ranks of the positives; doubled to stay integral. */
    long double rank2_sum = 0;
    for (size_t i = 0; i < n;) {
        size_t j = i;
        uint64_t p = 0;
        while (j < n && a[j].key == a[i].key) p += a[j++].pos;
        /* ranks i+1..j average (i+1+j)/2; twice that is i+1+j */
        rank2_sum += (long double)p * (long double)(i + 1 + j);
        i = j;
    }
    long double u = rank2_sum / 2 - (long double)npos * (npos + 1) / 2;
    *auc = (double)(u / ((long double)npos * (long double)nneg));
    free(a);
    free(tmp);
    return CM_OK;
}

int metrics_logloss(const float *probs, const float *labels, size_t n, double *loss,
                    char **errptr)
{
    if (n == 0) return cm_err(errptr, CM_EINVAL, "logloss: no examples");
    double sum = 0;
    for (size_t i = 0; i < n; i++) {
        double p = probs[i], y = labels[i];
        if (isnan(p)) return cm_err(errptr, CM_EINVAL, "logloss: probability %zu is NaN", i);
        if (!(y >= 0 && y <= 1))
            return cm_err(errptr, CM_EINVAL, "logloss: label %zu is %g, not in [0, 1]", i, y);
        if (p < METRICS_EPS) p = METRICS_EPS;
        if (p > 1 - METRICS_EPS) p = 1 - METRICS_EPS;
        sum -= y * log(p) + (1 - y) * log1p(-p);
    }
    *loss = sum / (double)n;
    return CM_OK;
}
