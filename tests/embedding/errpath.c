/*
 * Calls on a spilling table whose RocksDB writes fail (a file size limit, SIGXFSZ ignored: every
 * write fails with "File too large" from the first failed flush on) must leave the table's
 * accounting as it was:
 *   A. emb_table_put_row of keys that live only in the spill store, into full sub-shards: the
 *      eviction that would make room fails, and the row must still count as spilled;
 *   B. emb_table_expire on that failing disk: it neither reads nor writes the spill store, so
 *      it succeeds, drops the never-pushed half (resident and spilled), and those rows, spill
 *      copies and all, read as absent; it used to delete them from RocksDB and fail here.
 * After each, with the limit lifted, the rows the stats count (in memory + spilled) must equal
 * the rows a walk finds, and a snapshot (which checks the same) must succeed.
 */
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include "emb_util.h"

#define NKEYS 50000u
#define BATCH 4096u
#define DIM 8u

static int count_row(const emb_row *r, void *arg)
{
    (void)r;
    (*(uint64_t *)arg)++;
    return 0;
}

/* Stats against a walk, and a snapshot. */
static void consistent(emb_table *t, const char *dir, const char *when)
{
    emb_table_stats st;
    emb_table_stats_get(t, &st);
    uint64_t walked = 0;
    char *err = NULL;
    CHECK_OK(emb_table_foreach(t, count_row, &walked, &err), err);
    CHECK_MSG(st.rows_mem + st.rows_spilled == walked,
              "%s: stats count %llu rows (%llu in memory, %llu spilled), a walk finds %llu", when,
              (unsigned long long)(st.rows_mem + st.rows_spilled), (unsigned long long)st.rows_mem,
              (unsigned long long)st.rows_spilled, (unsigned long long)walked);
    char snap[4300];
    snprintf(snap, sizeof snap, "%s/snap", dir);
    CHECK_OK(emb_table_snapshot(t, snap, &err), err);
}

static void run(const char *dir, int mode_b)
{
    char spill[4300];
    snprintf(spill, sizeof spill, "%s/spill", dir);
    emb_table_config c = eu_config(EMB_OPT_ADAGRAD, DIM);
    c.n_sub = 4;
    c.mem_budget_bytes = (uint64_t)(0.10 * NKEYS * emb_row_mem_bytes(&c));
    c.spill_path = spill;
    if (mode_b) c.ttl_steps = 3;
    emb_table *t = eu_create(&c);
    uint64_t *keys = eu_xmalloc(NKEYS * sizeof *keys), batch[BATCH];
    float *out = eu_xmalloc((size_t)NKEYS * DIM * sizeof *out);
    float *g = eu_xmalloc(BATCH * DIM * sizeof *g);
    for (uint32_t i = 0; i < NKEYS; i++)
        keys[i] = eu_key(i);
    char *err = NULL;
    CHECK_OK(emb_table_pull(t, keys, NKEYS, out, &err), err);
    for (uint32_t i = 0; i < BATCH * DIM; i++)
        g[i] = 0.01f;
    consistent(t, dir, "before");

    signal(SIGXFSZ, SIG_IGN);
    struct rlimit old, r;
    getrlimit(RLIMIT_FSIZE, &old);
    r = old;
    r.rlim_cur = 64 << 10;
    CHECK(setrlimit(RLIMIT_FSIZE, &r) == 0);
    /* Pushes of the first half of the keys until the spill store fails; the second half keeps
     * its first step (B: it expires). */
    uint64_t seed = 1;
    int pushes = 0, rc = CM_OK;
    while (pushes < 400 && rc == CM_OK) {
        for (uint32_t i = 0; i < BATCH; i++)
            batch[i] = keys[eu_below(&seed, NKEYS / 2)];
        rc = emb_table_push(t, batch, BATCH, g, &err);
        pushes += rc == CM_OK;
        free(err);
        err = NULL;
    }
    CHECK_MSG(rc != CM_OK, "%s: 400 pushes under a 64 KiB file limit all succeeded",
              mode_b ? "B" : "A");
    int failed = 0;
    if (!mode_b) {
        /* Rows of the never-pushed half that live only in the spill store, put back whole. */
        for (uint32_t i = NKEYS / 2; i < NKEYS && failed < 10; i++) {
            emb_table_stats st;
            emb_table_stats_get(t, &st);
            if (st.rows_spilled == 0) break;
            emb_row row;
            float w[DIM], s[DIM];
            if (emb_table_get_row(t, keys[i], &row, w, s, NULL) != CM_OK) continue;
            row.weights = w;
            row.state = s;
            if (emb_table_put_row(t, &row, &err) != CM_OK) failed++;
            free(err);
            err = NULL;
        }
        CHECK_MSG(failed > 0, "A: no put_row failed under the file limit");
    } else {
        uint64_t dropped = 0, step = emb_table_step(t);
        CHECK_OK(emb_table_expire(t, &dropped, &err), err);
        CHECK_MSG(step <= c.ttl_steps || dropped >= NKEYS / 4,
                  "B: expire at step %llu dropped %llu rows", (unsigned long long)step,
                  (unsigned long long)dropped);
        uint64_t back = 0;
        for (uint32_t i = NKEYS / 2; step > c.ttl_steps && i < NKEYS; i++) {
            emb_row row;
            float w[DIM], s[DIM];
            back += emb_table_get_row(t, keys[i], &row, w, s, NULL) == CM_OK;
        }
        CHECK_MSG(back == 0, "B: %llu expired rows read back", (unsigned long long)back);
    }
    CHECK(setrlimit(RLIMIT_FSIZE, &old) == 0); /* the snapshot's own files must fit */
    consistent(t, dir, mode_b ? "B: after a failed expire" : "A: after failed put_rows");
    emb_table_destroy(t);
    free(keys);
    free(out);
    free(g);
}

int main(void)
{
    const char *dir = check_tmpdir("emb_errpath");
    char a[4200], b[4200];
    snprintf(a, sizeof a, "%s/a", dir);
    snprintf(b, sizeof b, "%s/b", dir);
    CHECK(mkdir(a, 0700) == 0 && mkdir(b, 0700) == 0);
    run(a, 0);
    run(b, 1);
    return check_done();
}
