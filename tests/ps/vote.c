/*
 * Stop votes at a barrier (ps_client_barrier_vote), against an in-process shard 0 of 2 workers:
 *   - one worker votes to stop, the other not: both learn that one voted, at that barrier;
 *   - at the next barrier nobody votes: both learn none did (the OR is per barrier);
 *   - a barrier entered again after it completed (a resend: the same id) answers its votes
 *     again, whether the one entering it again voted or not;
 *   - an older barrier entered again (passes at once) answers only the caller's own vote;
 *   - ps_client_barrier still passes as before (a vote of false);
 *   - stop polls (ps_client_stop_poll) answer at once: none before a vote, then the step the
 *     first vote fixed (the most steps polled at plus the interval), to every worker after;
 *   - a barrier still parked when a SHUTDOWN comes is answered with an error at once.
 */
#include <pthread.h>

#include "ps_test_util.h"

static const char conf[] = "[cluster]\nshards = 1\nworkers = 2\nstaleness = 0\n"
                           "[table t]\ndim = 4\noptimizer = sgd\n";

typedef struct voter {
    ps_client *c;
    uint64_t id;
    bool stop, any;
    int rc;
    pthread_t th;
} voter;

static void *vote_main(void *arg)
{
    voter *v = arg;
    char *err = NULL;
    ps_client_barrier_seek(v->c, v->id);
    v->rc = ps_client_barrier_vote(v->c, v->stop, &v->any, &err);
    if (v->rc != CM_OK) fprintf(stderr, "barrier %" PRIu64 ": %s\n", v->id, err ? err : "?");
    free(err);
    return NULL;
}

/* Both workers enter barrier id with these votes; checks both learn `want`. */
static void both(ps_client *a, ps_client *b, uint64_t id, bool stop_a, bool stop_b, bool want)
{
    voter va = {.c = a, .id = id, .stop = stop_a}, vb = {.c = b, .id = id, .stop = stop_b};
    if (pthread_create(&va.th, NULL, vote_main, &va) != 0) pt_die("pthread_create", NULL);
    vote_main(&vb);
    pthread_join(va.th, NULL);
    CHECK_MSG(va.rc == CM_OK && vb.rc == CM_OK && va.any == want && vb.any == want,
              "barrier %" PRIu64 " (votes %d, %d): rc %d, %d, answers %d, %d; expected %d", id,
              stop_a, stop_b, va.rc, vb.rc, va.any, vb.any, want);
}

/* One worker enters barrier id alone (it has completed: it passes at once). */
static bool again(ps_client *c, uint64_t id, bool stop)
{
    voter v = {.c = c, .id = id, .stop = stop};
    vote_main(&v);
    CHECK_MSG(v.rc == CM_OK, "barrier %" PRIu64 " entered again: rc %d", id, v.rc);
    return v.any;
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_vote");
    ps_config cfg;
    pt_config(dir, "vote.ini", conf, &cfg);
    const char *urls[1] = {pt_ipc(dir, "ps0")};
    ps_server *s = pt_server(&cfg, urls[0], 0);
    ps_client *a = pt_client(&cfg, urls, 0, 5000), *b = pt_client(&cfg, urls, 1, 5000);

    both(a, b, 10, true, false, true);
    both(a, b, 11, false, false, false);
    CHECK_MSG(!again(b, 11, false), "barrier 11 (no votes) entered again answered stop");
    CHECK_MSG(!again(b, 10, false), "barrier 10 (older) entered again without a vote: stop");
    CHECK_MSG(again(b, 10, true), "barrier 10 (older) entered again with a vote: no stop");
    both(a, b, 12, false, true, true);
    CHECK_MSG(again(a, 12, false), "barrier 12 (b voted) entered again by a: no stop");
    /* The plain barrier: a vote of false, as before. */
    ps_client_barrier_seek(a, 13);
    ps_client_barrier_seek(b, 13);
    voter vb = {.c = b, .id = 13};
    if (pthread_create(&vb.th, NULL, vote_main, &vb) != 0) pt_die("pthread_create", NULL);
    CHECK(ps_client_barrier(a, NULL) == CM_OK);
    pthread_join(vb.th, NULL);
    CHECK(vb.rc == CM_OK && !vb.any);

    /* Stop polls (ps_client_stop_poll) never wait for the other worker; the first vote fixes
     * the stop at the most steps either polled at plus the interval, and every later poll,
     * voting or not, answers that step. */
    struct {
        ps_client *c;
        uint64_t step;
        bool vote;
        uint64_t want;
    } polls[] = {{a, 100, false, 0},   {b, 300, false, 0},  {a, 200, true, 400},
                 {b, 400, false, 400}, {a, 300, true, 400}, {b, 500, true, 400}};
    for (size_t i = 0; i < sizeof polls / sizeof *polls; i++) {
        uint64_t at = 99;
        char *perr = NULL;
        const double tp = cm_now();
        int rc = ps_client_stop_poll(polls[i].c, polls[i].step, 100, polls[i].vote, &at, &perr);
        CHECK_OK(rc, perr);
        CHECK_MSG(rc == CM_OK && at == polls[i].want && cm_now() - tp < 2,
                  "poll %zu (worker %d, step %" PRIu64 ", vote %d): stop at %" PRIu64
                  " after %.2f s; expected %" PRIu64 " at once",
                  i, polls[i].c == b, polls[i].step, polls[i].vote, at, cm_now() - tp,
                  polls[i].want);
    }
    uint64_t at = 99;
    char *perr = NULL;
    CHECK(ps_client_stop_poll(a, 100, 0, true, &at, &perr) != CM_OK && at == 0 && perr != NULL);
    free(perr);

    /* A SHUTDOWN answers every wait still parked, with an error, at once: a worker that entered
     * a stop vote's barrier again at a backup after the others had stopped would otherwise
     * wait out its barrier timeout (here 20 x 5 s) for workers that never come. */
    voter late = {.c = b, .id = 20};
    if (pthread_create(&late.th, NULL, vote_main, &late) != 0) pt_die("pthread_create", NULL);
    usleep(300 * 1000); /* parked */
    const double t0 = cm_now();
    char *err = NULL;
    CHECK_OK(ps_client_shutdown(a, &err), err);
    pthread_join(late.th, NULL);
    const double waited = cm_now() - t0;
    CHECK_MSG(late.rc != CM_OK && waited < 5,
              "a barrier parked at a SHUTDOWN: rc %d after %.1f s (expected an error at once)",
              late.rc, waited);

    ps_client_destroy(a);
    ps_client_destroy(b);
    ps_server_destroy(s);
    return pt_finish(dir);
}
