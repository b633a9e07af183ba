/*
 * Bounded staleness: with staleness k = 1 a fast worker is never more than k clocks ahead of
 * a slow one. An `ember ps` process serves two worker processes (this binary again, as
 * `ps_staleness worker I DIR NAME`). The slow worker publishes the clock it is about to send
 * before sending it, in a page both map; when the fast worker's clock(c) returns, the server had
 * seen the slow worker at >= c - k, so c - published <= k must hold at that moment. The same run
 * with staleness -1 (asynchronous) must see the fast worker run far ahead: the measurement
 * itself can fail.
 */
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ps_test_util.h"

#define STEPS 25u
#define SLOW_MS 15u

/* The page the two workers share (DIR/NAME.shm). */
typedef struct shared {
    uint64_t slow_sent; /* the clock the slow worker is sending or has sent */
    int64_t max_ahead;  /* fast worker: max of (its clock) - slow_sent after clock returns */
    int32_t errors;
} shared;

static shared *shared_map(const char *dir, const char *name, bool create)
{
    char file[300];
    snprintf(file, sizeof file, "%s.shm", name);
    int fd = open(pt_path(dir, file), O_RDWR | (create ? O_CREAT | O_TRUNC : 0), 0600);
    if (fd < 0 || (create && ftruncate(fd, sizeof(shared)) != 0)) pt_die("shared page", NULL);
    shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (sh == MAP_FAILED) pt_die("mmap of the shared page", NULL);
    return sh;
}

static char conf_name[64], conf_text[512];

static void conf_for(const char *name, int staleness)
{
    snprintf(conf_name, sizeof conf_name, "%s.conf", name);
    snprintf(
        conf_text, sizeof conf_text,
        "[cluster]\nworkers = 2\nstaleness = %d\n[table t]\ndim = 4\noptimizer = sgd\nlr = 0.1\n",
        staleness);
}

/* `ps_staleness worker I DIR NAME`: worker 0 is fast, 1 sleeps before each clock. */
static int worker_main(uint32_t id, const char *dir, const char *name)
{
    alarm(psp_bound_s(PT_WATCHDOG_S));
    ps_config cfg;
    char *err = NULL;
    snprintf(conf_name, sizeof conf_name, "%s.conf", name);
    if (ps_config_load(pt_path(dir, conf_name), &cfg, &err) != CM_OK) pt_die("config", err);
    const char *urls[1] = {pt_ipc(dir, name)};
    shared *sh = shared_map(dir, name, false);
    ps_client_opts o = {.cfg = &cfg, .urls = urls, .worker = id, .timeout_ms = 10000};
    ps_client *c = NULL;
    if (ps_client_create(&o, &c, &err) != CM_OK) goto fail;
    uint64_t key = 100 + id;
    float g[4] = {1, 1, 1, 1};
    for (uint32_t t = 0; t < STEPS; t++) {
        if (ps_client_push(c, 0, &key, 1, g, &err) != CM_OK) goto fail;
        uint64_t now;
        if (id == 1) {
            psp_sleep_ms(SLOW_MS);
            __atomic_store_n(&sh->slow_sent, (uint64_t)t + 1, __ATOMIC_SEQ_CST);
        }
        if (ps_client_clock(c, &now, &err) != CM_OK) goto fail;
        if (id == 0) {
            int64_t ahead =
                (int64_t)now - (int64_t)__atomic_load_n(&sh->slow_sent, __ATOMIC_SEQ_CST);
            if (ahead > sh->max_ahead) sh->max_ahead = ahead;
        }
    }
    ps_client_destroy(c);
    return 0;
fail:
    fprintf(stderr, "worker %u: %s\n", id, err ? err : "?");
    free(err);
    __atomic_add_fetch(&sh->errors, 1, __ATOMIC_SEQ_CST);
    ps_client_destroy(c);
    return 1;
}

/* Runs the fast (0) and slow (1) worker processes against one `ember ps`; returns the
 * server's staleness_max and the fast worker's furthest lead in *max_ahead. */
static uint64_t run_once(const char *dir, const char *name, int staleness, int64_t *max_ahead)
{
    conf_for(name, staleness);
    ps_config cfg;
    const char *path = pt_config(dir, conf_name, conf_text, &cfg);
    const char *urls[1] = {pt_ipc(dir, name)};
    pid_t ps;
    pt_spawn_cluster(path, 1, urls, &ps);
    shared *sh = shared_map(dir, name, true);
    pid_t w[2];
    for (int i = 0; i < 2; i++) {
        char *args[] = {"/proc/self/exe", "worker", i ? "1" : "0", (char *)dir, (char *)name, NULL};
        if ((w[i] = psp_spawn_argv(args, NULL, NULL)) < 0) pt_die("spawn a worker", NULL);
    }
    for (int i = 0; i < 2; i++) {
        int status = psp_stop(w[i], 0, 60.0);
        CHECK_MSG(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
                  "%s: worker %d status %d", name, i, status);
    }
    CHECK_MSG(sh->errors == 0, "%s: %d workers failed", name, sh->errors);
    *max_ahead = sh->max_ahead;
    munmap(sh, sizeof *sh);
    ps_client *c = pt_client(&cfg, urls, 0, 10000);
    ps_client_stats st;
    char *err = NULL;
    CHECK_OK(ps_client_stats_get(c, &st, &err), err);
    CHECK(st.shard_total.clocks_min == STEPS && st.shard_total.clocks_max == STEPS);
    CHECK_OK(ps_client_shutdown(c, &err), err);
    ps_client_destroy(c);
    int status = psp_stop(ps, 0, 10.0);
    CHECK_MSG(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "%s: ember ps did not exit cleanly (status %d)", name, status);
    return st.shard_total.staleness_max;
}

int main(int argc, char **argv)
{
    if (argc == 5 && strcmp(argv[1], "worker") == 0)
        return worker_main((uint32_t)atoi(argv[2]), argv[3], argv[4]);
    psp_watchdog(PT_WATCHDOG_S);
    const char *dir = check_tmpdir("ps_staleness");
    int64_t ahead;
    uint64_t smax = run_once(dir, "k1", 1, &ahead);
    CHECK_MSG(ahead <= 1, "k=1: fast worker got %lld clocks ahead", (long long)ahead);
    CHECK_MSG(ahead == 1, "k=1: fast worker never used its slack (max ahead %lld)",
              (long long)ahead);
    /* The server records a parked worker's clock too, so its gap can be k + 1. */
    CHECK_MSG(smax >= 1 && smax <= 2, "k=1: server staleness_max %llu", (unsigned long long)smax);

    smax = run_once(dir, "async", -1, &ahead);
    CHECK_MSG(ahead > 3, "async: fast worker only %lld ahead: the check cannot tell",
              (long long)ahead);
    CHECK(smax > 3);
    return pt_finish(dir);
}
