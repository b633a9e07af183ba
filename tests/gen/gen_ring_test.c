/* gen_write's threaded ring (workers fill slots, the caller writes them in chunk order) under
 * many short runs: every run must give the bytes of the single-thread run, and none may hang.
 * Built with GEN_CHUNK_ROWS = 16, so one run of a few thousand rows is hundreds of chunks and
 * wraps the ring dozens of times; at the real 8192 rows a chunk the same interleavings need
 * gigabytes. With a worker claiming its slot out of turn (the bug 3a65cab fixed) the first run
 * hung, every time in 5 tries. */
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "common/common.h"
#include "src/gen.h"

#define RUNS 240  /* threaded runs: ~6-10 s on a loaded 2-core machine, ~25 s with ASan */
#define ROWS 3203 /* 201 chunks of 16, the last one partial */
/* One run takes milliseconds; a run still going after this long has hung. Armed per run, so a
 * slow (sanitizer, loaded) build does not trip it, and a hang fails the test with a message
 * instead of waiting for ctest's timeout. */
#define WATCHDOG_S 20

/* What the alarm reports: the run going on, formatted before it starts (the handler may only
 * write). */
static char hang_msg[160];
static size_t hang_len;

static void on_alarm(int sig)
{
    (void)sig;
    ssize_t w = write(2, hang_msg, hang_len);
    (void)w;
    _exit(1);
}

/* gen_write under the watchdog. */
static int write_watched(const gen_model *m, const gen_opts *o, gen_stats *st, char **errptr,
                         int run)
{
    int n = snprintf(hang_msg, sizeof hang_msg,
                     "gen_ring_test: run %d (%d threads, %llu rows) did not finish in %d s: "
                     "the ring hung\n",
                     run, o->threads, (unsigned long long)o->rows, WATCHDOG_S);
    hang_len = n > 0 && (size_t)n < sizeof hang_msg ? (size_t)n : 0;
    alarm(WATCHDOG_S);
    int rc = gen_write(m, o, st, errptr);
    alarm(0);
    return rc;
}

static char *slurp(const char *path, size_t *len)
{
    void *buf = NULL;
    char *err = NULL;
    CHECK_OK(cm_read_file(path, &buf, len, &err), err);
    return buf;
}

/* Writes rows with `threads` threads (and a truth file when tpath is set); 1 when the bytes,
 * truth and stats equal the reference's. */
static int run_matches(int run, const gen_model *m, uint64_t rows, int threads, const char *path,
                       const char *tpath, const char *ref, size_t nref, const char *tref,
                       size_t ntref, const gen_stats *st_ref)
{
    char *err = NULL;
    gen_stats st;
    gen_opts o = {.rows = rows, .threads = threads, .out_path = path, .truth_path = tpath};
    int rc = write_watched(m, &o, &st, &err, run);
    CHECK_OK(rc, err);
    if (rc != CM_OK) return 0;
    size_t n = 0, nt = 0;
    char *d = slurp(path, &n), *t = tpath ? slurp(tpath, &nt) : NULL;
    int same = d && n == nref && memcmp(d, ref, n) == 0 && st.bytes == st_ref->bytes &&
               st.clicks == st_ref->clicks;
    if (tpath) same = same && t && nt == ntref && memcmp(t, tref, nt) == 0;
    free(d);
    free(t);
    return same;
}

int main(void)
{
    signal(SIGALRM, on_alarm);
    const char *dir = check_tmpdir("gen_ring");
    char ref[4200], tref[4200], out[4200], tout[4200];
    snprintf(ref, sizeof ref, "%s/ref.tsv", dir);
    snprintf(tref, sizeof tref, "%s/ref.truth", dir);
    snprintf(out, sizeof out, "%s/out.tsv", dir);
    snprintf(tout, sizeof tout, "%s/out.truth", dir);
    gen_model *m = NULL;
    char *err = NULL;
    CHECK_OK(gen_model_create(7, &m, &err), err);
    if (m == NULL) return check_done();

    gen_stats st_ref;
    gen_opts o1 = {.rows = ROWS, .threads = 1, .out_path = ref, .truth_path = tref};
    CHECK_OK(gen_write(m, &o1, &st_ref, &err), err);
    size_t nref = 0, ntref = 0;
    char *dref = slurp(ref, &nref), *dtref = slurp(tref, &ntref);
    CHECK(dref && nref == st_ref.bytes && ntref == (size_t)ROWS * 9);

    /* Thread counts around the ring's sizes (2 * threads slots): 2, 3, 4 and 8 as asked of the
     * CLI, 5 and 7 for odd rings. Each run is compared whole, so a lost, doubled or swapped
     * chunk fails it. */
    static const int threads[] = {2, 3, 4, 5, 7, 8};
    const int nthreads = (int)(sizeof threads / sizeof threads[0]);
    int bad = 0;
    for (int r = 0; r < RUNS && dref && dtref; r++) {
        int t = threads[r % nthreads];
        /* Every third run also writes the truth file: a second output in the writer's loop. */
        if (!run_matches(r, m, ROWS, t, out, r % 3 == 0 ? tout : NULL, dref, nref, dtref, ntref,
                         &st_ref))
            bad++;
    }
    CHECK_MSG(bad == 0, "%d of %d threaded runs differ from the single-thread bytes", bad, RUNS);

    /* Fewer chunks than threads (the thread count is cut to the chunks), and exactly one ring
     * of chunks: the prefix of the reference. */
    gen_stats st_few;
    gen_opts of = {.rows = 3 * 16 + 1, .threads = 1, .out_path = out};
    CHECK_OK(gen_write(m, &of, &st_few, &err), err);
    CHECK(run_matches(RUNS, m, 3 * 16 + 1, 8, out, NULL, dref, st_few.bytes, NULL, 0, &st_few));
    gen_stats st_ring;
    gen_opts orr = {.rows = 2 * 4 * 16, .threads = 1, .out_path = out};
    CHECK_OK(gen_write(m, &orr, &st_ring, &err), err);
    CHECK(
        run_matches(RUNS + 1, m, 2 * 4 * 16, 4, out, NULL, dref, st_ring.bytes, NULL, 0, &st_ring));

    /* A write error with workers running (no space on /dev/full) stops them and returns the
     * error: the writer must not wait for chunks nobody will hand over. */
    if (access("/dev/full", W_OK) == 0) {
        for (int t = 2; t <= 8; t *= 2) {
            gen_opts oe = {.rows = ROWS, .threads = t, .out_path = "/dev/full"};
            CHECK(write_watched(m, &oe, NULL, &err, RUNS + t) == CM_EIO && err &&
                  strstr(err, "/dev/full"));
            free(err);
            err = NULL;
        }
    }
    free(dref);
    free(dtref);
    gen_model_free(m);
    return check_done();
}
