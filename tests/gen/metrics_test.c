/* metrics_auc and metrics_logloss against hand-computed values, ties included. */
#include "check.h"
#include "common/common.h"
#include "src/metrics.h"

static double auc_of(const float *s, const float *y, size_t n)
{
    double auc = -1;
    char *err = NULL;
    int rc = metrics_auc(s, y, n, &auc, &err);
    CHECK_OK(rc, err);
    return auc;
}

int main(void)
{
    char *err = NULL;
    /* Perfect and reversed ranking. */
    {
        float s[] = {0.1f, 0.2f, 0.8f, 0.9f}, y[] = {0, 0, 1, 1};
        CHECK(fabs(auc_of(s, y, 4) - 1.0) < 1e-12);
        float r[] = {0.9f, 0.8f, 0.2f, 0.1f};
        CHECK(fabs(auc_of(r, y, 4) - 0.0) < 1e-12);
    }
    /* One inversion of four pairs: positives {0.35, 0.8}, negatives {0.1, 0.4}:
     * pairs (0.35>0.1 yes, 0.35>0.4 no, 0.8>0.1 yes, 0.8>0.4 yes) = 3/4. */
    {
        float s[] = {0.1f, 0.4f, 0.35f, 0.8f}, y[] = {0, 0, 1, 1};
        CHECK(fabs(auc_of(s, y, 4) - 0.75) < 1e-12);
    }
    /* Ties count one half: all scores equal gives 0.5. */
    {
        float s[] = {0.3f, 0.3f, 0.3f, 0.3f, 0.3f}, y[] = {1, 0, 0, 1, 0};
        CHECK(fabs(auc_of(s, y, 5) - 0.5) < 1e-12);
    }
    /* Mixed ties: pos {0.5, 0.5, 0.9}, neg {0.5, 0.2}.
     * Pairs: 0.5 vs 0.5 tie (0.5) x2, 0.5 vs 0.2 win x2, 0.9 vs both win x2 -> (1 + 2 + 2)/6. */
    {
        float s[] = {0.5f, 0.5f, 0.9f, 0.5f, 0.2f}, y[] = {1, 1, 1, 0, 0};
        CHECK(fabs(auc_of(s, y, 5) - 5.0 / 6.0) < 1e-12);
    }
    /* Negative scores (logits), -0.0 ties +0.0, order is numeric not bitwise. */
    {
        float s[] = {-3.0f, -0.5f, -0.0f, 0.0f, 2.0f, -1.0f}, y[] = {0, 1, 1, 0, 1, 0};
        /* pos {-0.5, -0.0, 2}, neg {-3, 0.0, -1}:
         * -0.5: beats -3, -1 (2), loses to 0 -> 2; -0.0: beats -3, -1, ties 0.0 -> 2.5;
         * 2: beats all -> 3. Total 7.5 / 9. */
        CHECK(fabs(auc_of(s, y, 6) - 7.5 / 9.0) < 1e-12);
    }
    /* A larger case against the O(P*N) definition. */
    {
        enum { N = 3000 };
        static float s[N], y[N];
        uint64_t x = 12345;
        for (int i = 0; i < N; i++) {
            x = x * 6364136223846793005ULL + 1442695040888963407ULL;
            s[i] = (float)((x >> 40) % 97) / 97.0f; /* many ties */
            y[i] = ((x >> 20) % 3 == 0) ^ (s[i] > 0.6f);
        }
        double num = 0, np = 0, nn = 0;
        for (int i = 0; i < N; i++) {
            if (y[i] > 0.5f) np++; else nn++;
            if (y[i] < 0.5f) continue;
            for (int j = 0; j < N; j++)
                if (y[j] < 0.5f) num += s[i] > s[j] ? 1.0 : (s[i] == s[j] ? 0.5 : 0.0);
        }
        CHECK(fabs(auc_of(s, y, N) - num / (np * nn)) < 1e-9);
    }
    /* Undefined AUC and bad input are errors, not numbers. */
    {
        float s[] = {0.1f, 0.2f}, y1[] = {1, 1};
        double auc;
        CHECK(metrics_auc(s, y1, 2, &auc, &err) == CM_EINVAL && err != NULL);
        free(err);
        err = NULL;
        CHECK(metrics_auc(s, y1, 0, &auc, NULL) == CM_EINVAL);
        float sn[] = {NAN, 0.2f}, y2[] = {1, 0};
        CHECK(metrics_auc(sn, y2, 2, &auc, NULL) == CM_EINVAL);
    }
    /* Log loss: -(log 0.8 + log 0.6 + log 0.5 + log 0.9) / 4, soft label 0.5 on 0.5 = log 2. */
    {
        float p[] = {0.8f, 0.4f, 0.5f, 0.9f}, y[] = {1, 0, 0, 1};
        double ll = -1;
        CHECK_OK(metrics_logloss(p, y, 4, &ll, &err), err);
        double want = -(log(0.8) + log(0.6) + log(0.5) + log(0.9)) / 4;
        CHECK_MSG(fabs(ll - want) < 1e-6, "ll=%f want=%f", ll, want);
        float ps[] = {0.5f}, ys[] = {0.5f};
        CHECK_OK(metrics_logloss(ps, ys, 1, &ll, &err), err);
        CHECK(fabs(ll - log(2.0)) < 1e-9);
        /* Clipping keeps a confident mistake finite: -log(1e-7). */
        float pc[] = {0.0f}, yc[] = {1};
        CHECK_OK(metrics_logloss(pc, yc, 1, &ll, &err), err);
        CHECK_MSG(fabs(ll + log(METRICS_EPS)) < 1e-6, "ll=%f", ll);
        float yb[] = {2};
        CHECK(metrics_logloss(ps, yb, 1, &ll, NULL) == CM_EINVAL);
        CHECK(metrics_logloss(ps, ys, 0, &ll, NULL) == CM_EINVAL);
    }
    return check_done();
}
