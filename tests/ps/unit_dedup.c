/*
 * Unit tests of ps_dedup (ps/replica.h, private to ps/, tested directly: it decides whether a
 * push is applied or acknowledged as a resend). The case that matters: a resend that arrives
 * while its original is still being applied on another thread waits for the original's
 * outcome, so a push that then fails is never acknowledged.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "check.h"
#include "ps/replica.h"

typedef struct {
    ps_dedup *d;
    uint32_t worker;
    uint64_t req_id;
    atomic_int finished; /* 0 while check_add runs; 1 + its answer after */
} resend;

static void *resend_run(void *arg)
{
    resend *r = arg;
    bool seen = ps_dedup_check_add(r->d, r->worker, r->req_id);
    atomic_store(&r->finished, 1 + (int)seen);
    return NULL;
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Waits up to 5 s for the resend to answer; its answer (1 + seen) or 0. */
static int resend_wait(resend *r)
{
    for (int i = 0; i < 500 && atomic_load(&r->finished) == 0; i++)
        sleep_ms(10);
    return atomic_load(&r->finished);
}

/* The original settles with `applied`; the resend started while it was pending must not answer
 * before that, and then answers `applied`. */
static void test_resend_waits(ps_dedup *d, uint64_t id, bool applied)
{
    CHECK(!ps_dedup_check_add(d, 1, id)); /* the original: new, now pending */
    resend r = {.d = d, .worker = 1, .req_id = id};
    atomic_init(&r.finished, 0);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, resend_run, &r) == 0);
    sleep_ms(100);
    CHECK_MSG(atomic_load(&r.finished) == 0,
              "a resend answered (%s) while its original was still pending",
              atomic_load(&r.finished) == 2 ? "duplicate" : "new");
    if (applied)
        ps_dedup_done(d, 1, id);
    else
        ps_dedup_remove(d, 1, id);
    int got = resend_wait(&r);
    CHECK_MSG(got == 1 + (int)applied, "resend answered %d, want %d (original %s)", got,
              1 + (int)applied, applied ? "applied" : "failed");
    pthread_join(th, NULL);
    /* A resend of a failed push became the one applying it: it is pending now. */
    if (!applied) ps_dedup_done(d, 1, id);
    CHECK(ps_dedup_check_add(d, 1, id)); /* settled as applied: a duplicate from now on */
}

int main(void)
{
    ps_dedup *d = ps_dedup_create(3);
    CHECK(d != NULL);
    if (d == NULL) return check_done();

    /* Ids are per worker; out-of-range ones are never held. */
    CHECK(!ps_dedup_check_add(d, 0, 42));
    ps_dedup_done(d, 0, 42);
    CHECK(ps_dedup_check_add(d, 0, 42));
    CHECK(!ps_dedup_check_add(d, 2, 42));
    ps_dedup_done(d, 2, 42);
    CHECK(!ps_dedup_check_add(d, 3, 42));
    CHECK(!ps_dedup_check_add(d, 3, 42));
    CHECK(!ps_dedup_check_add(d, 0, 0));
    CHECK(!ps_dedup_check_add(d, 0, 0));

    /* A failed push is forgotten: its resend is applied. */
    CHECK(!ps_dedup_check_add(d, 0, 43));
    ps_dedup_remove(d, 0, 43);
    CHECK(!ps_dedup_check_add(d, 0, 43));
    ps_dedup_done(d, 0, 43);

    test_resend_waits(d, 1000, true);
    test_resend_waits(d, 1001, false);

    /* A pending id is not pushed out of the ring by a worker's later pushes. */
    CHECK(!ps_dedup_check_add(d, 1, 5000));
    for (uint64_t id = 5001; id < 5001 + 3 * PS_DEDUP_RING; id++) {
        CHECK(!ps_dedup_check_add(d, 1, id));
        ps_dedup_done(d, 1, id);
    }
    ps_dedup_done(d, 1, 5000);
    CHECK_MSG(ps_dedup_check_add(d, 1, 5000), "a pending push was forgotten by the ring");
    /* Settled ids age out: the oldest of the later ones is gone, the newest is held. */
    CHECK(!ps_dedup_check_add(d, 1, 5001));
    CHECK(ps_dedup_check_add(d, 1, 5000 + 3 * PS_DEDUP_RING));

    ps_dedup_destroy(d);
    return check_done();
}
