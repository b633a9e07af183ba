/*
 * common_team: cm_team (common/team.c), the thread team the embedding table fans a large pull
 * or push out over. The table's "same bits" claim rests on it, so this holds the team to its
 * contract (common.h) directly:
 *  - every part of a job runs exactly once (an atomic count per part), for 0, 1, 2, 3, 7, 64
 *    and 1000 parts on teams of 1, 2, 4 and 8 threads, and cm_team_size is the threads + 1;
 *  - what parts wrote on team threads (plain stores) is all there when cm_team_run returns:
 *    it returns only after every team thread that entered the job has left it. Parts take
 *    uneven time (some sleep) so that a caller done with its own share would outrun a helper
 *    still inside a part; the job lives on the caller's stack, so returning early is also a
 *    use after scope under ASan;
 *  - several callers (4 threads) run many jobs on one team at once, each checking its own;
 *  - a job finishes with no help when every team thread is busy in another job (its caller
 *    takes part), and a part may wait on another caller's job;
 *  - teams created and destroyed many times (with and without jobs in between, destroyed at
 *    once after creation, while its threads may still be starting);
 *  - cm_team_create with 0 or 257 threads fails with CM_EINVAL, a message and *out NULL; 256
 *    works;
 *  - a NULL team, or a single part, runs the parts in order on the caller;
 *  - a team whose thread cannot start fails with CM_ENOMEM, *out NULL and a message naming
 *    that thread.
 */
#define _GNU_SOURCE /* pthread_setattr_default_np */
#include <malloc.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#include "check.h"
#include "common/common.h"

/* check.h's counters are plain ints: other threads count failures here, main CHECKs it. */
static atomic_uint g_thread_errors;

#define TFAIL(...)                                                                                 \
    do {                                                                                           \
        atomic_fetch_add(&g_thread_errors, 1);                                                     \
        fprintf(stderr, "  thread: " __VA_ARGS__);                                                 \
        fputc('\n', stderr);                                                                       \
    } while (0)

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void sleep_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

/* ---- one job: counts and plain results per part ---- */

#define VALS 4 /* words a part writes: a torn or missing write shows in any of them */

typedef struct job {
    uint32_t n_parts;
    uint64_t id;
    int uneven; /* 1: some parts sleep, others spin a little */
    atomic_uint *count;
    uint64_t (*val)[VALS];
    pthread_t *who;  /* the thread that ran each part (NULL: not recorded) */
    uint32_t *order; /* parts in the order they started (NULL: not recorded), under `seq` */
    atomic_uint seq;
} job;

static void job_part(void *arg, uint32_t part)
{
    job *j = arg;
    if (part >= j->n_parts) {
        TFAIL("job %llu: part %u of %u", (unsigned long long)j->id, part, j->n_parts);
        return;
    }
    uint32_t at = atomic_fetch_add(&j->seq, 1);
    if (j->order != NULL && at < j->n_parts) j->order[at] = part;
    if (j->who != NULL) j->who[part] = pthread_self();
    if (j->uneven) {
        uint64_t r = mix(j->id * 1000003u + part);
        if (r % 16 == 0)
            sleep_us(200 + (long)(r >> 40) % 800); /* a slow part: 0.2 to 1 ms */
        else
            for (volatile uint32_t k = 0; k < (uint32_t)(r >> 56) * 40; k++) {
            }
    }
    /* Plain stores, read by the caller after cm_team_run returns: visible only if the run
     * waited for this part and synchronised with the thread that ran it. */
    for (int v = 0; v < VALS; v++)
        j->val[part][v] = mix(j->id ^ ((uint64_t)part << 20) ^ (uint64_t)v);
    atomic_fetch_add_explicit(&j->count[part], 1, memory_order_relaxed);
}

static void job_init(job *j, uint32_t n_parts, uint64_t id, int uneven)
{
    memset(j, 0, sizeof *j);
    j->n_parts = n_parts;
    j->id = id;
    j->uneven = uneven;
    j->count = calloc(n_parts ? n_parts : 1, sizeof *j->count);
    j->val = calloc(n_parts ? n_parts : 1, sizeof *j->val);
    if (j->count == NULL || j->val == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    for (uint32_t i = 0; i < n_parts; i++)
        atomic_init(&j->count[i], 0);
    atomic_init(&j->seq, 0);
}

static void job_fini(job *j)
{
    free(j->count);
    free(j->val);
}

/* Parts that did not run exactly once, or whose results are not all there. */
static uint32_t job_bad(const job *j)
{
    uint32_t bad = 0;
    for (uint32_t i = 0; i < j->n_parts; i++) {
        unsigned c = atomic_load_explicit(&j->count[i], memory_order_relaxed);
        int ok = c == 1;
        for (int v = 0; v < VALS; v++)
            ok &= j->val[i][v] == mix(j->id ^ ((uint64_t)i << 20) ^ (uint64_t)v);
        if (!ok && bad < 3)
            fprintf(stderr, "  job %llu (%u parts): part %u ran %u times%s\n",
                    (unsigned long long)j->id, j->n_parts, i, c, c == 1 ? ", results missing" : "");
        bad += !ok;
    }
    if (atomic_load(&j->seq) != j->n_parts) bad++;
    return bad;
}

/* ---- every part once, results visible ---- */

static void test_parts_once(void)
{
    static const uint32_t sizes[] = {1, 2, 4, 8};
    static const uint32_t parts[] = {0, 1, 2, 3, 7, 64, 1000};
    uint64_t id = 1;
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
        cm_team *t = NULL;
        char *err = NULL;
        CHECK_OK(cm_team_create(sizes[s], &t, &err), err);
        if (t == NULL) continue;
        CHECK(cm_team_size(t) == sizes[s] + 1);
        for (int rep = 0; rep < 20; rep++) {
            for (size_t p = 0; p < sizeof parts / sizeof *parts; p++) {
                job j;
                job_init(&j, parts[p], id++, rep % 2);
                cm_team_run(t, parts[p], job_part, &j);
                uint32_t bad = job_bad(&j);
                CHECK_MSG(bad == 0, "team of %u threads, %u parts, rep %d: %u parts wrong",
                          sizes[s], parts[p], rep, bad);
                job_fini(&j);
            }
        }
        cm_team_destroy(t);
    }
}

/* ---- several callers at once ---- */

#define CALLERS 4u
#define CALLER_JOBS 300u

typedef struct caller {
    cm_team *t;
    uint32_t tid;
    uint32_t bad_jobs;
} caller;

static void *caller_main(void *arg)
{
    caller *c = arg;
    uint64_t r = 99 + c->tid;
    for (uint32_t k = 0; k < CALLER_JOBS; k++) {
        r = mix(r);
        /* mostly a few parts (fewer than the team: the signal path), sometimes many */
        uint32_t n = r % 5 == 0 ? (uint32_t)(r >> 32) % 300 : (uint32_t)(r >> 32) % 9;
        job j;
        job_init(&j, n, ((uint64_t)c->tid << 32) | k, (r >> 8) % 3 == 0);
        cm_team_run(c->t, n, job_part, &j);
        if (job_bad(&j) != 0) c->bad_jobs++;
        job_fini(&j);
    }
    return NULL;
}

static void test_callers(void)
{
    cm_team *t = NULL;
    char *err = NULL;
    CHECK_OK(cm_team_create(3, &t, &err), err);
    if (t == NULL) return;
    pthread_t th[CALLERS];
    caller cs[CALLERS];
    for (uint32_t i = 0; i < CALLERS; i++) {
        cs[i] = (caller){t, i, 0};
        CHECK(pthread_create(&th[i], NULL, caller_main, &cs[i]) == 0);
    }
    for (uint32_t i = 0; i < CALLERS; i++) {
        pthread_join(th[i], NULL);
        CHECK_MSG(cs[i].bad_jobs == 0, "caller %u: %u of %u jobs wrong", i, cs[i].bad_jobs,
                  CALLER_JOBS);
    }
    cm_team_destroy(t);
}

/* ---- a job finishes while the team is busy in another ---- */

typedef struct busy {
    cm_team *t;
    atomic_int b_done;
    atomic_int a_parts_started;
    atomic_int timed_out;
} busy;

/* A's parts wait for B's job to be over; A holds the one team thread (or its own caller). */
static void busy_a_part(void *arg, uint32_t part)
{
    (void)part;
    busy *b = arg;
    atomic_fetch_add(&b->a_parts_started, 1);
    for (int i = 0; i < 20000 && !atomic_load(&b->b_done); i++) /* 20 s at most */
        sleep_us(1000);
    if (!atomic_load(&b->b_done)) atomic_store(&b->timed_out, 1);
}

static void *busy_a_main(void *arg)
{
    busy *b = arg;
    cm_team_run(b->t, 2, busy_a_part, b);
    return NULL;
}

static void test_busy_team(void)
{
    busy b = {0};
    atomic_init(&b.b_done, 0);
    atomic_init(&b.a_parts_started, 0);
    atomic_init(&b.timed_out, 0);
    char *err = NULL;
    CHECK_OK(cm_team_create(1, &b.t, &err), err);
    if (b.t == NULL) return;
    pthread_t a;
    CHECK(pthread_create(&a, NULL, busy_a_main, &b) == 0);
    /* Wait until A is stuck in its job (one part on its caller, maybe one on the team thread). */
    for (int i = 0; i < 10000 && atomic_load(&b.a_parts_started) == 0; i++)
        sleep_us(1000);
    sleep_us(20000);
    job j;
    job_init(&j, 50, 777, 1);
    cm_team_run(b.t, 50, job_part, &j);
    CHECK_MSG(job_bad(&j) == 0, "a job beside a team stuck in another");
    job_fini(&j);
    atomic_store(&b.b_done, 1);
    pthread_join(a, NULL);
    CHECK_MSG(!atomic_load(&b.timed_out), "a job waited for team threads busy elsewhere");
    CHECK(atomic_load(&b.a_parts_started) == 2);
    cm_team_destroy(b.t);
}

/* ---- create, destroy, bad sizes ---- */

static void test_create_destroy(void)
{
    uint64_t id = 1u << 30, r = 5;
    for (int k = 0; k < 200; k++) {
        r = mix(r);
        uint32_t threads = 1 + (uint32_t)(r % 8);
        cm_team *t = NULL;
        char *err = NULL;
        int rc = cm_team_create(threads, &t, &err);
        CHECK_OK(rc, err);
        if (t == NULL) continue;
        if (k % 3 != 0) { /* every third team is destroyed untouched, threads maybe starting */
            uint32_t n = (uint32_t)(r >> 32) % 40;
            job j;
            job_init(&j, n, id++, 0);
            cm_team_run(t, n, job_part, &j);
            CHECK_MSG(job_bad(&j) == 0, "create/destroy round %d", k);
            job_fini(&j);
        }
        cm_team_destroy(t);
    }
    cm_team_destroy(NULL);

    const uint32_t bad[] = {0, 257};
    for (int i = 0; i < 2; i++) {
        cm_team *t = (cm_team *)&id; /* must be set to NULL */
        char *err = NULL;
        int rc = cm_team_create(bad[i], &t, &err);
        CHECK_MSG(rc == CM_EINVAL, "cm_team_create(%u) rc=%d", bad[i], rc);
        CHECK_MSG(t == NULL, "cm_team_create(%u) left *out set", bad[i]);
        CHECK_MSG(err != NULL && strstr(err, "thread") != NULL, "cm_team_create(%u): message %s",
                  bad[i], err ? err : "(none)");
        free(err);
    }

    cm_team *t = NULL;
    char *err = NULL;
    CHECK_OK(cm_team_create(256, &t, &err), err);
    if (t != NULL) {
        CHECK(cm_team_size(t) == 257);
        job j;
        job_init(&j, 1000, id++, 0);
        cm_team_run(t, 1000, job_part, &j);
        CHECK(job_bad(&j) == 0);
        job_fini(&j);
        cm_team_destroy(t);
    }
}

/* ---- no team: in order, on the caller ---- */

static void check_in_order_on_caller(cm_team *t, uint32_t n, const char *what)
{
    job j;
    job_init(&j, n, 4242 + n, 0);
    j.who = calloc(n ? n : 1, sizeof *j.who);
    j.order = calloc(n ? n : 1, sizeof *j.order);
    if (j.who == NULL || j.order == NULL) exit(2);
    cm_team_run(t, n, job_part, &j);
    CHECK_MSG(job_bad(&j) == 0, "%s, %u parts", what, n);
    uint32_t off = 0;
    for (uint32_t i = 0; i < n; i++)
        off += j.order[i] != i || !pthread_equal(j.who[i], pthread_self());
    CHECK_MSG(off == 0, "%s, %u parts: %u parts out of order or not on the caller", what, n, off);
    free(j.who);
    free(j.order);
    job_fini(&j);
}

static void test_null_team(void)
{
    CHECK(cm_team_size(NULL) == 1);
    static const uint32_t parts[] = {0, 1, 2, 3, 7, 64, 1000};
    for (size_t p = 0; p < sizeof parts / sizeof *parts; p++)
        check_in_order_on_caller(NULL, parts[p], "NULL team");
    cm_team *t = NULL;
    char *err = NULL;
    CHECK_OK(cm_team_create(4, &t, &err), err);
    if (t != NULL) {
        check_in_order_on_caller(t, 1, "a team, one part");
        check_in_order_on_caller(t, 0, "a team, no part");
        cm_team_destroy(t);
    }
}

/* ---- a thread that cannot start ---- */

/* Every thread's stack made larger than the address space (the default attributes, which
 * cm_team_create's threads take), so the first pthread_create fails. cm_team_create formatted
 * its message after freeing the half-built team, reading its thread count from freed memory: ASan
 * reports that; M_PERTURB (glibc) fills freed memory, so a plain build shows it in the message too.
 * 256 threads: a team too large for the tcache, which M_PERTURB does not fill. */
static void test_create_fails(void)
{
    pthread_attr_t saved, huge;
    if (pthread_getattr_default_np(&saved) != 0) {
        CHECK_MSG(0, "pthread_getattr_default_np failed");
        return;
    }
    pthread_attr_init(&huge);
    int set = pthread_attr_setstacksize(&huge, (size_t)1 << 50) == 0 &&
              pthread_setattr_default_np(&huge) == 0;
    CHECK_MSG(set, "cannot set a default stack of 2^50 bytes");
    cm_team *t = (cm_team *)&saved; /* must be set to NULL */
    char *err = NULL;
    int rc = CM_OK;
    if (set) {
        mallopt(M_PERTURB, 0xa5);
        rc = cm_team_create(256, &t, &err);
        mallopt(M_PERTURB, 0);
        CHECK_MSG(pthread_setattr_default_np(&saved) == 0, "default attributes not restored");
    }
    pthread_attr_destroy(&huge);
    pthread_attr_destroy(&saved);
    if (!set) return;
    CHECK_MSG(rc == CM_ENOMEM, "cm_team_create with no stack to give: rc=%d", rc);
    CHECK_MSG(t == NULL, "cm_team_create failed and left *out set");
    CHECK_MSG(err != NULL && strstr(err, "thread 1 of 256") != NULL, "message %s",
              err ? err : "(none)");
    if (rc == CM_OK) cm_team_destroy(t);
    free(err);
}

int main(void)
{
    atomic_init(&g_thread_errors, 0);
    fprintf(stderr, "every part once\n");
    test_parts_once();
    fprintf(stderr, "no team\n");
    test_null_team();
    fprintf(stderr, "%u callers at once\n", CALLERS);
    test_callers();
    fprintf(stderr, "a job beside a busy team\n");
    test_busy_team();
    fprintf(stderr, "create and destroy\n");
    test_create_destroy();
    fprintf(stderr, "a thread that cannot start\n");
    test_create_fails();
    CHECK_MSG(atomic_load(&g_thread_errors) == 0, "%u failures in threads",
              atomic_load(&g_thread_errors));
    return check_done();
}
