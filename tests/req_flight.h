/*
 * A request on a req context of its own, for tests that keep requests in flight while others go
 * on (a CLOCK or BARRIER the PS defers stays unanswered until its condition holds): nng's
 * callback receives once the send is done; the test polls or waits for the reply.
 */
#ifndef EMBER_TESTS_REQ_FLIGHT_H
#define EMBER_TESTS_REQ_FLIGHT_H

#include <nng/nng.h>
#include <pthread.h>
#include <stdbool.h>
#include <time.h>

#include "common/common.h"

typedef struct rf_flight {
    nng_ctx ctx;
    nng_aio *aio;
    int stage; /* 0 sending, 1 receiving, 2 done (under rf_mu) */
    int rv;    /* done: 0 with the reply on aio, or nng's error */
} rf_flight;

static pthread_mutex_t rf_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t rf_cv = PTHREAD_COND_INITIALIZER;

static void rf_cb(void *arg)
{
    rf_flight *f = arg;
    int rv = nng_aio_result(f->aio);
    /* stage moves under rf_mu: the test thread polls it (rf_stage) while this runs. */
    pthread_mutex_lock(&rf_mu);
    const int stage = f->stage;
    if (stage == 0 && rv == 0) f->stage = 1;
    pthread_mutex_unlock(&rf_mu);
    if (stage == 0 && rv == 0) {
        nng_ctx_recv(f->ctx, f->aio);
        return;
    }
    if (stage == 0) {
        nng_msg_free(nng_aio_get_msg(f->aio));
        nng_aio_set_msg(f->aio, NULL);
    }
    pthread_mutex_lock(&rf_mu);
    f->rv = rv;
    f->stage = 2;
    pthread_cond_broadcast(&rf_cv);
    pthread_mutex_unlock(&rf_mu);
}

/* Sends m (the flight's from now on) on a new context of sock. 0, or nng's error (m freed). */
static inline int rf_start(rf_flight *f, nng_socket sock, nng_msg *m)
{
    int rv;
    f->stage = 0;
    f->rv = 0;
    f->aio = NULL;
    if ((rv = nng_ctx_open(&f->ctx, sock)) != 0) {
        nng_msg_free(m);
        return rv;
    }
    if ((rv = nng_aio_alloc(&f->aio, rf_cb, f)) != 0) {
        nng_ctx_close(f->ctx);
        nng_msg_free(m);
        return rv;
    }
    nng_aio_set_msg(f->aio, m);
    nng_ctx_send(f->ctx, f->aio);
    return 0;
}

static inline int rf_stage(rf_flight *f)
{
    pthread_mutex_lock(&rf_mu);
    int st = f->stage;
    pthread_mutex_unlock(&rf_mu);
    return st;
}

/* Whether f is answered (or failed) by `until` (cm_now() seconds). */
static inline bool rf_wait(rf_flight *f, double until)
{
    pthread_mutex_lock(&rf_mu);
    while (f->stage != 2) {
        double left = until - cm_now();
        if (left <= 0) break;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        long ns = ts.tv_nsec + (long)(left * 1e9);
        ts.tv_sec += ns / 1000000000L;
        ts.tv_nsec = ns % 1000000000L;
        pthread_cond_timedwait(&rf_cv, &rf_mu, &ts);
    }
    bool done = f->stage == 2;
    pthread_mutex_unlock(&rf_mu);
    return done;
}

/* A done flight's reply, the caller's from now on; NULL when it has none. */
static inline nng_msg *rf_reply(rf_flight *f)
{
    nng_msg *m = rf_stage(f) == 2 && f->rv == 0 ? nng_aio_get_msg(f->aio) : NULL;
    if (m != NULL) nng_aio_set_msg(f->aio, NULL);
    return m;
}

/* Stops f, answered or not, and frees what it holds. */
static inline void rf_end(rf_flight *f)
{
    nng_aio_stop(f->aio);
    if (nng_aio_get_msg(f->aio) != NULL) nng_msg_free(nng_aio_get_msg(f->aio));
    nng_aio_free(f->aio);
    nng_ctx_close(f->ctx);
}

#endif
