/*
 * metrics: exact evaluation metrics for binary click prediction, shared by `ember gen` (to
 * report the AUC of its planted truth) and by training/evaluation code.
 *
 * AUC is the exact Mann-Whitney statistic: the probability that a random positive outranks a
 * random negative, ties counting one half. It is computed from one sort of the scores (an LSD
 * radix sort on the float bit patterns, so 10M scores take well under a second) and average
 * ranks over tie groups, never by binning, so two models that differ in the fourth decimal can
 * be compared honestly. Log loss is the mean binary cross-entropy with probabilities clipped to
 * [METRICS_EPS, 1 - METRICS_EPS] so a single confident mistake gives a large but finite value.
 *
 * Labels are floats because trainers keep them that way; for AUC a label > 0.5 is a positive,
 * for log loss the label is used as a (possibly soft) target in [0, 1].
 * Errors follow common/common.h: 0 or a negative CM_* code with a message in *errptr.
 */
#ifndef EMBER_SRC_METRICS_H
#define EMBER_SRC_METRICS_H

#include <stddef.h>
#include <stdint.h>

#define METRICS_EPS 1e-7

/* Exact ROC AUC of scores against labels (n entries each; both borrowed, not modified).
 * Equal scores share their average rank, so ties count 1/2. -0.0 and +0.0 tie.
 * Fails with CM_EINVAL when n == 0, when all labels are of one class (AUC undefined), or when a
 * score is NaN; CM_ENOMEM when the O(n) scratch cannot be allocated. On success *auc is in
 * [0, 1]. */
int metrics_auc(const float *scores, const float *labels, size_t n, double *auc, char **errptr);

/* Mean log loss of predicted probabilities probs against labels (n entries each; borrowed).
 * probs are clipped to [METRICS_EPS, 1 - METRICS_EPS]. Fails with CM_EINVAL when n == 0 or a
 * probability or label is NaN or a label lies outside [0, 1]. */
int metrics_logloss(const float *probs, const float *labels, size_t n, double *loss,
                    char **errptr);

#endif
