/*
 * The int8 error-feedback residuals a client keeps stay within ps_client_opts.resid_memory:
 * pushing ever new keys, the client's residual memory (ps_client_stats.resid_bytes) never
 * passes its budget, the rows dropped are counted, and the ones kept are those pushed most
 * recently (read back from the residual file, whose layout docs/PROTOCOL.md gives). Without a
 * bound nothing is dropped. Because what is dropped depends only on the pushes, a client that
 * loads a residual file mid-way and pushes the rest ends with the same file, byte for byte, as
 * one that never stopped. A file holding more than a smaller budget is cut to it on load, the
 * newest kept; a budget below one push keeps part of it; and a file of the first version (no
 * stamps) still loads.
 *
 * One in-process shard; residuals are the client's alone (the PS's rows do not enter them).
 */
#include <inttypes.h>

#include "ps_test_util.h"

#define DIM 4u
#define ROUND 256u         /* keys a push */
#define ROUNDS 40u         /* pushes, each of new keys */
#define BUDGET (64u << 10) /* 819 rows of dim 4: three rounds and a fifth */

static const char conf[] = "[cluster]\nshards = 1\nworkers = 1\n"
                           "[table q]\ndim = 4\noptimizer = sgd\nlr = 0.1\npush_codec = int8\n";

/* Round r's keys: new ones every round. */
static void round_keys(uint32_t r, uint64_t *k)
{
    for (uint32_t i = 0; i < ROUND; i++)
        k[i] = ((uint64_t)r << 32) + i * 7919u + 1;
}

/* Gradients that leave a residual in every value (none a multiple of the int8 step). */
static void round_grads(uint32_t r, float *g)
{
    for (uint32_t i = 0; i < ROUND * DIM; i++)
        g[i] = (float)((i * 37u + r * 11u) % 101u) * 0.0137f - 0.61f;
}

/* Pushes rounds [from, to), checking the budget after each. */
static void push_rounds(ps_client *c, uint32_t from, uint32_t to, uint64_t budget)
{
    static uint64_t k[ROUND];
    static float g[ROUND * DIM];
    char *err = NULL;
    for (uint32_t r = from; r < to; r++) {
        round_keys(r, k);
        round_grads(r, g);
        CHECK_OK(ps_client_push(c, 0, k, ROUND, g, &err), err);
        ps_client_stats st;
        CHECK_OK(ps_client_stats_get(c, &st, &err), err);
        CHECK_MSG(budget == 0 || st.resid_bytes <= budget,
                  "round %u: residuals take %" PRIu64 " bytes, over the budget of %" PRIu64, r,
                  st.resid_bytes, budget);
    }
    CHECK_OK(ps_client_flush(c, &err), err);
}

/* A v2 residual file's single section, as docs/PROTOCOL.md lays it out. */
typedef struct ef_file {
    uint8_t *b;
    size_t n;
    uint64_t rows, clock;
    const uint8_t *row0; /* rows of {u64 key, u64 stamp, DIM f32} */
} ef_file;

#define EF_HDR 24u                          /* magic, version, worker, n_tables, zero */
#define EF_SEC (PS_NAME_MAX + 8u + 8u + 8u) /* name, table, dim, rows, clock */
#define EF_ROW (16u + 4u * DIM)

static ef_file ef_read(const char *path)
{
    ef_file f = {0};
    CHECK_MSG(cm_read_file(path, (void **)&f.b, &f.n, NULL) == CM_OK, "cannot read %s", path);
    if (f.b == NULL || f.n < EF_HDR + EF_SEC + 8) return f;
    uint32_t version;
    memcpy(&version, f.b + 8, 4);
    CHECK_MSG(version == 2, "%s: version %u", path, version);
    memcpy(&f.rows, f.b + EF_HDR + PS_NAME_MAX + 8, 8);
    memcpy(&f.clock, f.b + EF_HDR + PS_NAME_MAX + 16, 8);
    f.row0 = f.b + EF_HDR + EF_SEC;
    CHECK(f.n == EF_HDR + EF_SEC + f.rows * EF_ROW + 8);
    return f;
}

/* Whether the file holds key. */
static bool ef_has(const ef_file *f, uint64_t key)
{
    for (uint64_t i = 0; i < f->rows; i++) {
        uint64_t k;
        memcpy(&k, f->row0 + i * EF_ROW, 8);
        if (k == key) return true;
    }
    return false;
}

/* The rounds whose keys are all in the file, all absent, or split (-1, -1 when none split):
 * a bound drops the oldest first, so kept rounds must be the newest and at most one split. */
static void check_newest_kept(const ef_file *f, uint32_t rounds, const char *what)
{
    static uint64_t k[ROUND];
    int seen_kept = 0;
    for (uint32_t r = 0; r < rounds; r++) {
        round_keys(r, k);
        uint32_t held = 0;
        for (uint32_t i = 0; i < ROUND; i++)
            held += ef_has(f, k[i]);
        CHECK_MSG(held == 0 || held == ROUND, "%s: round %u partly kept (%u of %u rows)", what, r,
                  held, ROUND);
        CHECK_MSG(!seen_kept || held == ROUND, "%s: round %u dropped after a newer one was kept",
                  what, r);
        seen_kept |= held > 0;
    }
    round_keys(rounds - 1, k);
    CHECK_MSG(ef_has(f, k[0]), "%s: the newest push's rows were dropped", what);
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_resid_bound");
    ps_config cfg;
    const char *path = pt_config(dir, "ps.conf", conf, &cfg);
    const char *url = pt_ipc(dir, "s0");
    const char *urls[1] = {url};
    ps_server *s = pt_server(&cfg, url, 0);
    char *err = NULL;
    ps_client_stats st;
    (void)path;

    /* Unbounded: every key of every round is kept. */
    ps_client_opts o = {.cfg = &cfg, .urls = urls, .timeout_ms = 10000, .resid_memory = UINT64_MAX};
    ps_client *c = pt_client_with(&o);
    push_rounds(c, 0, ROUNDS, 0);
    CHECK_OK(ps_client_stats_get(c, &st, &err), err);
    CHECK_MSG(st.resid_rows == (uint64_t)ROUNDS * ROUND && st.resid_dropped == 0,
              "unbounded: %" PRIu64 " rows, %" PRIu64 " dropped", st.resid_rows, st.resid_dropped);
    CHECK_MSG(st.resid_bytes > BUDGET, "the test's budget (%u) binds nothing: %" PRIu64 " bytes",
              BUDGET, st.resid_bytes);
    ps_client_destroy(c);

    /* Bounded, straight through: the reference file. */
    o.resid_memory = BUDGET;
    c = pt_client_with(&o);
    push_rounds(c, 0, ROUNDS, BUDGET);
    CHECK_OK(ps_client_stats_get(c, &st, &err), err);
    CHECK_MSG(st.resid_dropped > 0 && st.resid_rows + st.resid_dropped >= (uint64_t)ROUNDS * ROUND,
              "bounded: %" PRIu64 " rows kept, %" PRIu64 " dropped of %u", st.resid_rows,
              st.resid_dropped, ROUNDS * ROUND);
    /* The plan names the bound the client kept to: after 40 rounds it is full to within the
     * quarter a drop frees. */
    const uint64_t plan = ps_plan_resid_rows(&cfg, 0, BUDGET);
    CHECK_MSG(st.resid_rows <= plan && st.resid_rows >= plan - plan / 4 - ROUND,
              "bounded: %" PRIu64 " rows held, the plan's bound %" PRIu64, st.resid_rows, plan);
    CHECK(ps_plan_resid_rows(&cfg, 0, UINT64_MAX) == UINT64_MAX);
    const char *ref = pt_path(dir, "ref.ef"), *half = pt_path(dir, "half.ef");
    CHECK_OK(ps_client_residuals_save(c, ref, &err), err);
    ps_client_destroy(c);
    ef_file fr = ef_read(ref);
    CHECK_MSG(fr.rows == st.resid_rows && fr.clock == ROUNDS,
              "file: %" PRIu64 " rows, clock %" PRIu64, fr.rows, fr.clock);
    check_newest_kept(&fr, ROUNDS, "bounded");

    /* Stopped half-way, resumed from its file: the same bytes at the end. */
    c = pt_client_with(&o);
    push_rounds(c, 0, ROUNDS / 2, BUDGET);
    CHECK_OK(ps_client_residuals_save(c, half, &err), err);
    ps_client_destroy(c);
    c = pt_client_with(&o);
    CHECK_OK(ps_client_residuals_load(c, half, &err), err);
    push_rounds(c, ROUNDS / 2, ROUNDS, BUDGET);
    const char *resumed = pt_path(dir, "resumed.ef");
    CHECK_OK(ps_client_residuals_save(c, resumed, &err), err);
    ps_client_destroy(c);
    ef_file fs = ef_read(resumed);
    CHECK_MSG(fs.b && fr.b && fs.n == fr.n && memcmp(fs.b, fr.b, fs.n) == 0,
              "resumed from half-way: %zu bytes against %zu straight through, or other bytes", fs.n,
              fr.n);

    /* Half the budget cuts the file to it on load, the newest kept. */
    o.resid_memory = BUDGET / 2;
    c = pt_client_with(&o);
    CHECK_OK(ps_client_residuals_load(c, ref, &err), err);
    CHECK_OK(ps_client_stats_get(c, &st, &err), err);
    CHECK_MSG(st.resid_bytes <= BUDGET / 2 && st.resid_rows < fr.rows && st.resid_rows > 0,
              "loaded under half the budget: %" PRIu64 " rows, %" PRIu64 " bytes", st.resid_rows,
              st.resid_bytes);
    const char *cut = pt_path(dir, "cut.ef");
    CHECK_OK(ps_client_residuals_save(c, cut, &err), err);
    ef_file fc = ef_read(cut);
    check_newest_kept(&fc, ROUNDS, "cut on load");
    ps_client_destroy(c);

    /* A budget smaller than one push: the push keeps what fits, and says it dropped the rest. */
    o.resid_memory = 2048;
    c = pt_client_with(&o);
    push_rounds(c, 0, 3, 2048);
    CHECK_OK(ps_client_stats_get(c, &st, &err), err);
    CHECK_MSG(st.resid_rows > 0 && st.resid_rows < ROUND &&
                  st.resid_rows + st.resid_dropped == 3 * ROUND,
              "a 2 KiB budget: %" PRIu64 " rows kept, %" PRIu64 " dropped of %u", st.resid_rows,
              st.resid_dropped, 3 * ROUND);
    ps_client_destroy(c);

    /* A version-1 file (no clock, no stamps) loads: its rows are kept, then aged out first. */
    if (fr.b != NULL && fr.rows > 0) {
        size_t n1 = EF_HDR + (EF_SEC - 8) + fr.rows * (EF_ROW - 8) + 8;
        uint8_t *v1 = calloc(1, n1), *p = v1 + EF_HDR + EF_SEC - 8;
        memcpy(v1, fr.b, EF_HDR + EF_SEC - 8);
        uint32_t one = 1;
        memcpy(v1 + 8, &one, 4);
        for (uint64_t i = 0; i < fr.rows; i++, p += EF_ROW - 8) {
            memcpy(p, fr.row0 + i * EF_ROW, 8);
            memcpy(p + 8, fr.row0 + i * EF_ROW + 16, 4 * DIM);
        }
        uint64_t sum = cm_xxh3(v1, n1 - 8);
        memcpy(v1 + n1 - 8, &sum, 8);
        const char *old = pt_path(dir, "v1.ef");
        CHECK_OK(cm_write_file_atomic(old, v1, n1, &err), err);
        o.resid_memory = BUDGET;
        c = pt_client_with(&o);
        CHECK_OK(ps_client_residuals_load(c, old, &err), err);
        CHECK_OK(ps_client_stats_get(c, &st, &err), err);
        CHECK_MSG(st.resid_rows == fr.rows, "v1 file: %" PRIu64 " rows of %" PRIu64, st.resid_rows,
                  fr.rows);
        push_rounds(c, ROUNDS, ROUNDS + 8, BUDGET);
        ps_client_destroy(c);
        free(v1);
    }

    free(fr.b);
    free(fs.b);
    free(fc.b);
    ps_server_destroy(s);
    return pt_finish(dir);
}
