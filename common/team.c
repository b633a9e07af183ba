/*
 * cm_team: see common.h. A job lives on its caller's stack in the team's list of open jobs.
 * Parts are dealt by an atomic counter. A team thread enters the first open job that has parts
 * left (counted in `inside`, under the team's mutex) and leaves it when none are left; the caller,
 * having run out of parts itself, closes the job (takes it off the list, so no thread enters it
 * after) and waits until `inside` is 0, after which nothing refers to the job.
 */
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>

#include "common/common.h"

typedef struct team_job {
    cm_team_fn fn;
    void *arg;
    uint32_t n_parts;
    uint32_t next;   /* atomic: the next part to deal */
    uint32_t inside; /* team threads in the job; the team's mutex */
    struct team_job *link;
} team_job;

struct cm_team {
    pthread_mutex_t mu;
    pthread_cond_t work, left;
    team_job *open; /* jobs with parts possibly left */
    bool stop;
    uint32_t n;
    pthread_t th[];
};

/* Runs parts of j until none are left. */
static void run_parts(team_job *j)
{
    for (;;) {
        uint32_t i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (i >= j->n_parts) return;
        j->fn(j->arg, i);
    }
}

static team_job *first_open(cm_team *t)
{
    for (team_job *j = t->open; j != NULL; j = j->link)
        if (__atomic_load_n(&j->next, __ATOMIC_RELAXED) < j->n_parts) return j;
    return NULL;
}

static void *team_main(void *arg)
{
    cm_team *t = arg;
    pthread_mutex_lock(&t->mu);
    for (;;) {
        team_job *j = NULL;
        while (!t->stop && (j = first_open(t)) == NULL)
            pthread_cond_wait(&t->work, &t->mu);
        if (t->stop) break;
        j->inside++;
        pthread_mutex_unlock(&t->mu);
        run_parts(j);
        pthread_mutex_lock(&t->mu);
        if (--j->inside == 0) pthread_cond_broadcast(&t->left);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

int cm_team_create(uint32_t threads, cm_team **out, char **errptr)
{
    *out = NULL;
    if (threads < 1 || threads > 256)
        return cm_err(errptr, CM_EINVAL, "a team of %u threads (1..256)", threads);
    cm_team *t = calloc(1, sizeof *t + threads * sizeof(pthread_t));
    if (t == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory for a team of %u", threads);
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->work, NULL);
    pthread_cond_init(&t->left, NULL);
    for (; t->n < threads; t->n++)
        if (pthread_create(&t->th[t->n], NULL, team_main, t) != 0) {
            /* The message before the team goes: it names t->n, freed with t. */
            int rc =
                cm_err(errptr, CM_ENOMEM, "cannot start team thread %u of %u", t->n + 1, threads);
            cm_team_destroy(t);
            return rc;
        }
    *out = t;
    return CM_OK;
}

void cm_team_destroy(cm_team *t)
{
    if (t == NULL) return;
    pthread_mutex_lock(&t->mu);
    t->stop = true;
    pthread_cond_broadcast(&t->work);
    pthread_mutex_unlock(&t->mu);
    for (uint32_t i = 0; i < t->n; i++)
        pthread_join(t->th[i], NULL);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->work);
    pthread_cond_destroy(&t->left);
    free(t);
}

uint32_t cm_team_size(const cm_team *t)
{
    return t != NULL ? t->n + 1 : 1;
}

void cm_team_run(cm_team *t, uint32_t n_parts, cm_team_fn fn, void *arg)
{
    team_job j = {.fn = fn, .arg = arg, .n_parts = n_parts};
    if (t == NULL || n_parts < 2) {
        for (uint32_t i = 0; i < n_parts; i++)
            fn(arg, i);
        return;
    }
    pthread_mutex_lock(&t->mu);
    j.link = t->open;
    t->open = &j;
    if (n_parts - 1 >= t->n)
        pthread_cond_broadcast(&t->work);
    else
        for (uint32_t i = 0; i + 1 < n_parts; i++)
            pthread_cond_signal(&t->work);
    pthread_mutex_unlock(&t->mu);
    run_parts(&j);
    pthread_mutex_lock(&t->mu);
    team_job **p = &t->open;
    while (*p != &j)
        p = &(*p)->link;
    *p = j.link;
    while (j.inside > 0)
        pthread_cond_wait(&t->left, &t->mu);
    pthread_mutex_unlock(&t->mu);
}
