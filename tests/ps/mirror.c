/*
 * Dense-block mirrors (ps_client_dense_mirror). A mirrored push-pull applies the update to the
 * client's copy with the PS's own optimizer code and returns at once, so a wrong copy would hand
 * the trainer wrong weights without a word; and the digest check is the only thing standing
 * between a second writer and silent divergence. Every case therefore compares a mirrored block
 * bit for bit with an unmirrored twin of the same spec that gets the same updates over the
 * network (PS_FLAG_READ_BACK, the PS's answer), over two in-process shards:
 *   1. Adam, Adagrad and SGD pairs, started from non-trivial state (random values, a few
 *      pushes: step > 0, slots non-zero): 50 push-pulls with fresh gradients give identical
 *      bits at every step, and both blocks pull as the last step returned (the mirrored one
 *      before any flush: a pull waits for the mirror's push in flight).
 *   2. Another writer (worker 1) pushes to the mirrored block: the next push-pull or the flush
 *      after it fails CM_ECORRUPT naming the block and the mirror, and drops the mirror: the
 *      push-pulls right after go to the PS and succeed, equal to the twin's (neither the stale
 *      copy's values nor a second error); mirroring again rebuilds the copy from the PS and the
 *      pair is bit-equal again.
 *   3. A non-finite gradient is refused and applies nothing, to the copy or the PS.
 *   4. pushes_in_flight counts a mirror's push until its reply is in, without a flush, and a
 *      flush leaves none (a 1M-float Adam block, so the reply cannot beat the caller).
 *   5. A push without read-back, or an init, drops the mirror: push-pulls go to the PS again
 *      and see another writer's pushes, still bit-equal to the twin.
 * Then over one shard and one worker (the three mirrored blocks on the same shard, a table),
 * each case under an alarm of its own, so a call that waits forever fails in seconds:
 *   6. Clients with a window of 1 and of 2 mirror the three blocks. Each round push-pulls all
 *      three (more mirrored pushes than the window), then, a mirror's push perhaps in flight,
 *      pulls and pushes table rows and pulls an unmirrored block, then push-pulls the twins: no
 *      call waits for a slot that only a reap would free, and the pairs stay bit-equal.
 *   7. ps_client_load of a checkpoint saved (ps_client_save) before the copies moved on, their
 *      last pushes perhaps in flight: the twins are the checkpoint's again, and the push-pulls
 *      after the load equal the twins' with no error (the PS served them, not the old copy);
 *      mirroring again works as before.
 *   8. A mirrored push that fails (its shard is gone until the push times out) is reported by
 *      the next push-pull and drops the mirror: the push-pulls after it go to the restarted
 *      shard (fresh blocks) and equal the twin's; mirroring again works as before.
 */
#include "ps_test_util.h"
#include "rng.h"

enum { N = 1000, BIG = 1 << 20, STEPS = 50, PRE_STEPS = 3, DIM = 4, ROUNDS = 5 };
/* Seconds each of cases 6-8 may take; the timeout of case 8's requests. */
enum { HANG_S = 10, FAIL_TIMEOUT_MS = 1000 };

/* The pairs' blocks (ids 0-5 in both configs). In the main config the mirrored block of a pair
 * and its twin alternate between the shards (block b lives on shard b % 2), so both shards
 * serve mirrors; the solo config has one shard, which serves all three mirrors. */
#define PAIR_BLOCKS                                                                                \
    "[dense adam_m]\nsize = 1000\noptimizer = adam\nlr = 0.01\n"                                   \
    "[dense adam_t]\nsize = 1000\noptimizer = adam\nlr = 0.01\n"                                   \
    "[dense adagrad_t]\nsize = 1000\noptimizer = adagrad\nlr = 0.01\n"                             \
    "[dense adagrad_m]\nsize = 1000\noptimizer = adagrad\nlr = 0.01\n"                             \
    "[dense sgd_m]\nsize = 1000\noptimizer = sgd\nlr = 0.01\n"                                     \
    "[dense sgd_t]\nsize = 1000\noptimizer = sgd\nlr = 0.01\n"

static const char conf[] = "[cluster]\nshards = 2\nworkers = 2\n" PAIR_BLOCKS
                           "[dense big]\nsize = 1048576\noptimizer = adam\nlr = 0.01\n";
static const char solo_conf[] = "[cluster]\nshards = 1\nworkers = 1\n" PAIR_BLOCKS
                                "[table rows]\ndim = 4\noptimizer = sgd\nlr = 0.5\n";

typedef struct pair {
    const char *name;
    uint32_t m, t; /* the mirrored block, its twin */
} pair;

static const pair pairs[] = {{"adam", 0, 1}, {"adagrad", 3, 2}, {"sgd", 4, 5}};
#define N_PAIRS (sizeof pairs / sizeof pairs[0])
enum { BIG_BLOCK = 6 };

static float grads[N], out_m[N], out_t[N], pull_m[N], pull_t[N];

/* Cases 6-8 each run under an alarm of HANG_S (bound); any alarm names the case it cut short. */
static char stage[64] = "1-5";

static void on_alarm(int sig)
{
    static const char msg[] = "ps_mirror: time limit reached in case ";
    if (write(2, msg, sizeof msg - 1) < 0 || write(2, stage, strlen(stage)) < 0 ||
        write(2, "\n", 1) < 0) {
        /* nothing left to report to */
    }
    psp_on_alarm(sig);
}

static void bound(const char *what)
{
    snprintf(stage, sizeof stage, "%s", what);
    alarm(HANG_S);
}

static void fill_random(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)unif(-1.0, 1.0);
}

/* c pushes the same gradients (no read-back) to both blocks of a pair. */
static void push_both(ps_client *c, const pair *p, const float *g)
{
    char *err = NULL;
    CHECK_OK(ps_client_dense_push(c, p->m, g, &err), err);
    CHECK_OK(ps_client_dense_push(c, p->t, g, &err), err);
}

static void mirror(ps_client *a, const pair *p)
{
    char *err = NULL;
    CHECK_OK(ps_client_dense_mirror(a, p->m, &err), err);
}

/* One push-pull of the same fresh gradients on both blocks: true when they return the same
 * bits (and both succeeded). */
static bool step_pair(ps_client *a, const pair *p)
{
    char *err = NULL;
    fill_random(grads, N);
    int rm = ps_client_dense_push_pull(a, p->m, grads, out_m, &err);
    CHECK_OK(rm, err);
    int rt = ps_client_dense_push_pull(a, p->t, grads, out_t, &err);
    CHECK_OK(rt, err);
    return rm == CM_OK && rt == CM_OK && memcmp(out_m, out_t, sizeof out_m) == 0;
}

static void run_steps(ps_client *a, const pair *p, int steps, const char *what)
{
    int differ = 0;
    for (int s = 0; s < steps; s++)
        differ += !step_pair(a, p);
    CHECK_MSG(differ == 0, "%s, %s: %d of %d push-pulls differ from the twin's", what, p->name,
              differ, steps);
}

/* The mirrored block pulls as its last push-pull returned, with no flush first (a pull waits
 * for the mirror's push in flight); a flush then finds no mismatch and leaves nothing in
 * flight, and the twin pulls the same bits. */
static void check_settled(ps_client *a, const pair *p, const char *what)
{
    char *err = NULL;
    CHECK_OK(ps_client_dense_pull(a, p->m, pull_m, &err), err);
    CHECK_MSG(memcmp(pull_m, out_m, sizeof pull_m) == 0,
              "%s, %s: the PS's block is not what the last push-pull returned", what, p->name);
    CHECK_OK(ps_client_flush(a, &err), err);
    CHECK(ps_client_pushes_in_flight(a) == 0);
    CHECK_OK(ps_client_dense_pull(a, p->t, pull_t, &err), err);
    CHECK_MSG(memcmp(pull_m, pull_t, sizeof pull_m) == 0, "%s, %s: the pair pulls differently",
              what, p->name);
}

/* After a mismatch or a failed push dropped a pair's mirror (or a load dropped them all): the
 * push-pulls go to the PS, succeed and equal the twin's; mirrored again, the pair is bit-equal
 * again. */
static void check_recovers(ps_client *a, const pair *p, const char *after)
{
    char what[96];
    snprintf(what, sizeof what, "unmirrored %s", after);
    run_steps(a, p, 3, what);
    check_settled(a, p, what);
    mirror(a, p);
    snprintf(what, sizeof what, "mirrored again %s", after);
    run_steps(a, p, 5, what);
    check_settled(a, p, what);
}

/* rc/err are a detected mismatch on block b: CM_ECORRUPT naming the block and the mirror. */
static void check_corrupt(int rc, char **err, uint32_t b, const char *what)
{
    char name[32];
    snprintf(name, sizeof name, "dense block %u", b);
    CHECK_MSG(rc == CM_ECORRUPT && *err && strstr(*err, name) && strstr(*err, "mirror"),
              "%s: rc=%d err=%s", what, rc, *err ? *err : "(none)");
    free(*err);
    *err = NULL;
}

/* 1. Same random values in both blocks, a few pushes (the caller then mirrors). */
static void init_pair(ps_client *a, const pair *p)
{
    char *err = NULL;
    int assigned = -1;
    fill_random(grads, N);
    CHECK_OK(ps_client_dense_init(a, p->m, grads, &assigned, &err), err);
    CHECK(assigned == 1);
    CHECK_OK(ps_client_dense_init(a, p->t, grads, &assigned, &err), err);
    CHECK(assigned == 1);
    for (int s = 0; s < PRE_STEPS; s++) {
        fill_random(grads, N);
        push_both(a, p, grads);
    }
}

static void test_bit_equal(ps_client *a)
{
    int differ[N_PAIRS] = {0};
    for (int s = 0; s < STEPS; s++)
        for (size_t i = 0; i < N_PAIRS; i++)
            differ[i] += !step_pair(a, &pairs[i]);
    for (size_t i = 0; i < N_PAIRS; i++) {
        CHECK_MSG(differ[i] == 0, "%s: %d of %d mirrored push-pulls differ from the twin's",
                  pairs[i].name, differ[i], STEPS);
        /* One more step of its own, so out_m is this pair's last. */
        bool same = step_pair(a, &pairs[i]);
        CHECK(same);
        check_settled(a, &pairs[i], "50 steps");
    }
}

/* 2. Worker 1 writes to a mirrored block: detected by a push-pull, then by a flush. */
static void test_another_writer(ps_client *a, ps_client *b, const pair *p)
{
    char *err = NULL;
    CHECK_OK(ps_client_flush(a, &err), err);
    fill_random(grads, N);
    push_both(b, p, grads);
    /* The first push-pull may pass (it checks the push before it); the twin gets what the
     * mirrored block got, so the pair stays in step on the PS. */
    int rc = CM_OK;
    for (int i = 0; i < 2 && rc == CM_OK; i++) {
        fill_random(grads, N);
        rc = ps_client_dense_push_pull(a, p->m, grads, out_m, &err);
        if (rc == CM_OK) CHECK_OK(ps_client_dense_push_pull(a, p->t, grads, out_t, &err), err);
    }
    check_corrupt(rc, &err, p->m, "push-pull after another writer");
    check_recovers(a, p, "after a push-pull's mismatch");

    fill_random(grads, N);
    push_both(b, p, grads);
    /* Served by the copy, which has not seen worker 1's push (the twin's reply has). */
    CHECK_MSG(!step_pair(a, p), "%s: a mirrored push-pull saw another writer's push", p->name);
    check_corrupt(ps_client_flush(a, &err), &err, p->m, "flush after another writer");
    CHECK(ps_client_pushes_in_flight(a) == 0);
    check_recovers(a, p, "after a flush's mismatch");
}

/* 3. A NaN or an infinity anywhere is refused; the twin never sees that step. */
static void test_non_finite(ps_client *a, const pair *p)
{
    static const float bad[] = {NAN, INFINITY, -INFINITY};
    static const size_t at[] = {N / 2, 0, N - 1};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        char *err = NULL;
        fill_random(grads, N);
        grads[at[k]] = bad[k];
        int rc = ps_client_dense_push_pull(a, p->m, grads, out_m, &err);
        CHECK_MSG(rc != CM_OK && err != NULL, "%s: a gradient of %g at %zu: rc=%d", p->name,
                  (double)bad[k], at[k], rc);
        free(err);
        run_steps(a, p, 3, "after a non-finite gradient");
    }
    check_settled(a, p, "after non-finite gradients");
}

/* 4. The big block's push is still in flight when push-pull returns (the PS has 4 MiB to
 * receive and a 1M-float Adam step to apply); a few tries stand in for a preempted caller. */
static void test_in_flight(ps_client *a)
{
    char *err = NULL;
    float *g = malloc(BIG * sizeof *g), *out = malloc(BIG * sizeof *out),
          *pulled = malloc(BIG * sizeof *pulled);
    CHECK(g != NULL && out != NULL && pulled != NULL);
    if (g == NULL || out == NULL || pulled == NULL) goto out;
    CHECK_OK(ps_client_flush(a, &err), err);
    CHECK_OK(ps_client_dense_mirror(a, BIG_BLOCK, &err), err);
    CHECK(ps_client_pushes_in_flight(a) == 0);
    bool seen = false;
    for (int i = 0; i < 5 && !seen; i++) {
        fill_random(g, BIG);
        CHECK_OK(ps_client_dense_push_pull(a, BIG_BLOCK, g, out, &err), err);
        uint32_t n = ps_client_pushes_in_flight(a);
        CHECK_MSG(n <= 1, "%u pushes in flight, one mirror", n);
        seen = n == 1;
    }
    CHECK_MSG(seen, "a mirrored push-pull's push was never counted in flight");
    /* The count drops when the reply arrives, with no call to collect it. */
    double deadline = cm_now() + 20.0;
    while (ps_client_pushes_in_flight(a) != 0 && cm_now() < deadline)
        usleep(1000);
    CHECK_MSG(ps_client_pushes_in_flight(a) == 0, "the mirror's push still counted after 20 s");
    CHECK_OK(ps_client_flush(a, &err), err);
    CHECK(ps_client_pushes_in_flight(a) == 0);
    CHECK_OK(ps_client_dense_pull(a, BIG_BLOCK, pulled, &err), err);
    CHECK(memcmp(out, pulled, BIG * sizeof *out) == 0);
out:
    free(g);
    free(out);
    free(pulled);
}

/* 5. After a plain push (or an init) worker 1's push shows in the very next push-pull, as the
 * twin's does: the PS served it, not a copy. */
static void test_dropped(ps_client *a, ps_client *b, const pair *p, bool by_init)
{
    const char *what = by_init ? "after an init" : "after a push without read-back";
    char *err = NULL;
    mirror(a, p);
    run_steps(a, p, 2, "mirrored");
    fill_random(grads, N);
    if (by_init) {
        int assigned = -1;
        CHECK_OK(ps_client_dense_init(a, p->m, grads, &assigned, &err), err);
        CHECK(assigned == 0);
        CHECK_OK(ps_client_dense_init(a, p->t, grads, &assigned, &err), err);
        CHECK(assigned == 0);
    } else {
        push_both(a, p, grads);
    }
    fill_random(grads, N);
    push_both(b, p, grads);
    run_steps(a, p, 3, what);
    check_settled(a, p, what);
}

/* A pull and a push of a few rows of the solo config's table. */
static void table_traffic(ps_client *c)
{
    static const uint64_t keys[] = {1, 2, 3, 4};
    enum { K = sizeof keys / sizeof keys[0] };
    float rows[K * DIM], g[K * DIM];
    char *err = NULL;
    CHECK_OK(ps_client_pull(c, 0, keys, K, rows, &err), err);
    fill_random(g, K * DIM);
    CHECK_OK(ps_client_push(c, 0, keys, K, g, &err), err);
}

/* 6. The three mirrored blocks share the only shard; a window of 1 or 2 slots is fewer. */
static void test_window(const ps_config *cfg, const char *const *urls, uint32_t window)
{
    static float g[N_PAIRS][N], out[N_PAIRS][N];
    char what[32];
    snprintf(what, sizeof what, "window %u", window);
    bound(what);
    ps_client_opts o = {.cfg = cfg, .urls = urls, .window = window, .timeout_ms = 10000};
    ps_client *w = pt_client_with(&o);
    char *err = NULL;
    for (size_t i = 0; i < N_PAIRS; i++)
        mirror(w, &pairs[i]);
    int differ = 0;
    for (int r = 0; r < ROUNDS; r++) {
        for (size_t i = 0; i < N_PAIRS; i++) {
            fill_random(g[i], N);
            CHECK_OK(ps_client_dense_push_pull(w, pairs[i].m, g[i], out[i], &err), err);
        }
        table_traffic(w);
        CHECK_OK(ps_client_dense_pull(w, pairs[0].t, pull_t, &err), err);
        for (size_t i = 0; i < N_PAIRS; i++) {
            CHECK_OK(ps_client_dense_push_pull(w, pairs[i].t, g[i], out_t, &err), err);
            differ += memcmp(out_t, out[i], sizeof out_t) != 0;
        }
    }
    CHECK_MSG(differ == 0, "%s: %d of %d mirrored push-pulls differ from the twin's", what, differ,
              ROUNDS * (int)N_PAIRS);
    for (size_t i = 0; i < N_PAIRS; i++) {
        memcpy(out_m, out[i], sizeof out_m);
        check_settled(w, &pairs[i], what);
    }
    ps_client_destroy(w);
}

/* 7. The copies move on past a checkpoint; loading it must not leave them serving. */
static void test_load(ps_client *c, const char *ckpt)
{
    static float saved[N_PAIRS][N];
    bound("load");
    char *err = NULL;
    for (size_t i = 0; i < N_PAIRS; i++) {
        mirror(c, &pairs[i]);
        run_steps(c, &pairs[i], 2, "before a save");
    }
    CHECK_OK(ps_client_save(c, ckpt, &err), err);
    for (size_t i = 0; i < N_PAIRS; i++) {
        CHECK_OK(ps_client_dense_pull(c, pairs[i].t, saved[i], &err), err);
        run_steps(c, &pairs[i], 3, "after a save");
    }
    CHECK_OK(ps_client_load(c, ckpt, &err), err);
    for (size_t i = 0; i < N_PAIRS; i++) {
        CHECK_OK(ps_client_dense_pull(c, pairs[i].t, pull_t, &err), err);
        CHECK_MSG(memcmp(pull_t, saved[i], sizeof pull_t) == 0,
                  "%s: the twin is not the checkpoint's after the load", pairs[i].name);
        check_recovers(c, &pairs[i], "after a load");
    }
}

/* 8. The solo shard goes away under a mirrored push and comes back empty (*s is replaced). */
static void test_failed_push(const ps_config *cfg, const char *const *urls, ps_server **s)
{
    bound("failed push");
    const pair *p = &pairs[0];
    char *err = NULL;
    ps_client *f = pt_client(cfg, urls, 0, FAIL_TIMEOUT_MS);
    mirror(f, p);
    run_steps(f, p, 2, "before the shard goes");
    CHECK_OK(ps_client_flush(f, &err), err);
    ps_server_destroy(*s);
    fill_random(grads, N);
    CHECK_OK(ps_client_dense_push_pull(f, p->m, grads, out_m, &err), err); /* the copy's */
    double deadline = cm_now() + 3.0;
    while (ps_client_pushes_in_flight(f) != 0 && cm_now() < deadline)
        usleep(1000);
    CHECK_MSG(ps_client_pushes_in_flight(f) == 0, "a push to a missing shard never timed out");
    /* Both blocks of the pair start again from zeros, so the pair is in step. */
    *s = pt_server(cfg, urls[0], 0);
    int rc;
    deadline = cm_now() + 3.0;
    do {
        rc = ps_client_dense_pull(f, p->t, pull_t, &err);
        free(err);
        err = NULL;
    } while (rc != CM_OK && cm_now() < deadline);
    CHECK_MSG(rc == CM_OK, "the client never reached the restarted shard");
    char name[32];
    snprintf(name, sizeof name, "dense block %u", p->m);
    rc = ps_client_dense_push_pull(f, p->m, grads, out_m, &err);
    CHECK_MSG(rc != CM_OK && err && strstr(err, name) && strstr(err, "mirror"),
              "the push-pull after a failed mirrored push: rc=%d err=%s", rc, err ? err : "(none)");
    free(err);
    err = NULL;
    check_recovers(f, p, "after a failed mirrored push");
    ps_client_destroy(f);
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    signal(SIGALRM, on_alarm);
    rng_state = 0x6d6972726f72ull;
    const char *dir = check_tmpdir("ps_mirror");
    ps_config cfg;
    pt_config(dir, "mirror.conf", conf, &cfg);
    const char *urls[2] = {pt_ipc(dir, "s0"), pt_ipc(dir, "s1")};
    ps_server *s0 = pt_server(&cfg, urls[0], 0), *s1 = pt_server(&cfg, urls[1], 1);
    ps_client *a = pt_client(&cfg, urls, 0, 10000), *b = pt_client(&cfg, urls, 1, 10000);
    char *err = NULL;
    CHECK(ps_client_dense_mirror(a, cfg.n_dense, &err) == CM_EINVAL && err != NULL);
    free(err);

    for (size_t i = 0; i < N_PAIRS; i++) {
        init_pair(a, &pairs[i]);
        mirror(a, &pairs[i]);
    }
    test_bit_equal(a);
    for (size_t i = 0; i < N_PAIRS; i++) {
        test_another_writer(a, b, &pairs[i]);
        test_non_finite(a, &pairs[i]);
        test_dropped(a, b, &pairs[i], false);
        test_dropped(a, b, &pairs[i], true);
    }
    test_in_flight(a);

    ps_client_destroy(a);
    ps_client_destroy(b);
    ps_server_destroy(s0);
    ps_server_destroy(s1);

    ps_config solo;
    pt_config(dir, "solo.conf", solo_conf, &solo);
    const char *solo_urls[1] = {pt_ipc(dir, "solo")};
    ps_server *s = pt_server(&solo, solo_urls[0], 0);
    ps_client *c = pt_client(&solo, solo_urls, 0, 10000);
    for (size_t i = 0; i < N_PAIRS; i++)
        init_pair(c, &pairs[i]);
    test_window(&solo, solo_urls, 1);
    test_window(&solo, solo_urls, 2);
    test_load(c, pt_path(dir, "ckpt"));
    ps_client_destroy(c);
    test_failed_push(&solo, solo_urls, &s);
    ps_server_destroy(s);
    return pt_finish(dir);
}
