/*
 * A cluster's SHUTDOWN stops every `ember ps` process of a replicated shard, including a backup
 * its primary no longer replicates to. The primary forwards a SHUTDOWN like any update, so a
 * backup in the stream stops in sequence (tests/ps/replica.c, 3); one the primary has dropped
 * would never see it and live on after the cluster stopped, for whoever launched it to find.
 * Two real processes each time, a client that knows only the primary:
 *   1. Dropped: the backup is paused (SIGSTOP) past replica_timeout while an update is
 *      forwarded, so the primary drops it and goes on unreplicated; resumed (SIGCONT), it is
 *      healthy but out of the stream. After SHUTDOWN through the primary both exit 0, and the
 *      backup does not take over on its way out (it would fence nothing, but its log would say
 *      it served).
 *   2. Diverged: a LOAD the backup cannot apply (outside its --checkpoint-root) leaves it
 *      diverged, and its primary drops it. After SHUTDOWN both exit 0.
 *   3. Dead: the backup killed (SIGKILL), its connection closed. SHUTDOWN through the primary
 *      is answered, and the primary exits 0, well within replica_timeout (4 s here): there is
 *      no backup to forward the SHUTDOWN to or to tell to stop. It waited replica_timeout for
 *      each, 8 s.
 */
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ps_test_util.h"

#define DIM 4u

static const char conf[] = "[cluster]\nshards = 1\nworkers = 1\nreplica_timeout = 500\n"
                           "[table t]\ndim = 4\noptimizer = sgd\nlr = 1\ninit_scale = 0\n";

/* replica_timeout long enough that waiting for it shows. */
static const char conf_slow[] = "[cluster]\nshards = 1\nworkers = 1\nreplica_timeout = 4000\n"
                                "[table t]\ndim = 4\noptimizer = sgd\nlr = 1\ninit_scale = 0\n";

/* Starts `ember ps` for shard 0 on url with the extra flags (NULL-terminated, at most 4), its
 * stderr to log, and waits until it listens. */
static pid_t spawn_ps(const char *config, const char *url, const char *log,
                      const char *const *extra)
{
    char *argv[16] = {getenv("EMBER_BIN"), "ps", "--config", (char *)config,
                      "--shard",           "0",  "--listen", (char *)url};
    int n = 8;
    for (int i = 0; i < 4 && extra[i] != NULL; i++)
        argv[n++] = (char *)extra[i];
    argv[n] = NULL;
    pid_t pid = psp_spawn_argv(argv, url, log);
    if (pid < 0 || psp_wait_ready(pid, url, 20.0) != 0) pt_die("ember ps did not come up", NULL);
    return pid;
}

/* Whether child pid exits within seconds, on its own; its wait status into *status. A child
 * still running is left to psp_stop_all. */
static bool exits_within(pid_t pid, double seconds, int *status)
{
    const double end = psp_now() + seconds;
    for (;;) {
        if (waitpid(pid, status, WNOHANG) == pid) {
            psp_child *c = psp_find(pid);
            if (c != NULL) psp_forget(c);
            return true;
        }
        if (psp_now() > end) return false;
        psp_sleep_ms(10);
    }
}

/* SHUTDOWN through the primary (pp): it exits 0, and so does its backup (bp) within a few
 * seconds (the primary waits at most replica_timeout, 0.5 s, for it). */
static void shutdown_stops_both(ps_client *c, pid_t pp, pid_t bp, const char *blog,
                                const char *when)
{
    char *err = NULL;
    CHECK_OK(ps_client_shutdown(c, &err), err);
    free(err);
    int pst = -1, bst = -1;
    CHECK_MSG(exits_within(pp, 10, &pst) && WIFEXITED(pst) && WEXITSTATUS(pst) == 0,
              "%s: the primary did not exit 0 after SHUTDOWN (status 0x%x)", when, pst);
    bool b_exited = exits_within(bp, 5, &bst);
    CHECK_MSG(b_exited && WIFEXITED(bst) && WEXITSTATUS(bst) == 0,
              "%s: the backup %s after the cluster's SHUTDOWN (status 0x%x)", when,
              b_exited ? "did not exit 0" : "was still running 5 s", bst);
    if (!b_exited) psp_stop(bp, SIGKILL, 5);
    FILE *f = fopen(blog, "r");
    char line[1024];
    while (f != NULL && fgets(line, sizeof line, f) != NULL)
        CHECK_MSG(strstr(line, "takes over") == NULL, "%s: the backup took over on SHUTDOWN: %s",
                  when, line);
    if (f != NULL) fclose(f);
}

/* Whether every thread of pid is stopped (SIGSTOP) within seconds: kill returns before they
 * all are, and one still running could acknowledge the very forward the test means to hold. */
static bool paused(pid_t pid, double seconds)
{
    char dir[64];
    snprintf(dir, sizeof dir, "/proc/%d/task", (int)pid);
    const double end = psp_now() + seconds;
    while (psp_now() < end) {
        DIR *d = opendir(dir);
        bool all = d != NULL;
        struct dirent *e;
        while (all && (e = readdir(d)) != NULL) {
            if (e->d_name[0] == '.') continue;
            char path[400], stat[512];
            snprintf(path, sizeof path, "%s/%s/stat", dir, e->d_name);
            FILE *f = fopen(path, "r");
            size_t n = f ? fread(stat, 1, sizeof stat - 1, f) : 0;
            if (f) fclose(f);
            stat[n] = '\0';
            /* "tid (comm) S ...": the state follows the last ')'. */
            const char *st = strrchr(stat, ')');
            all = st != NULL && st[1] == ' ' && (st[2] == 'T' || st[2] == 't');
        }
        if (d) closedir(d);
        if (all) return true;
        psp_sleep_ms(1);
    }
    return false;
}

static ps_client *client_of(const ps_config *cfg, const char *url)
{
    const char *urls[1] = {url};
    return pt_client(cfg, urls, 0, 10000);
}

/* The primary's STATS, through c. */
static ps_server_stats primary_stats(ps_client *c)
{
    ps_client_stats cs;
    char *err = NULL;
    memset(&cs, 0, sizeof cs);
    CHECK_OK(ps_client_stats_get(c, &cs, &err), err);
    free(err);
    return cs.shard_total;
}

/* A primary and its backup as processes (the backup's log at blog), and a client of the
 * primary alone (it must not fail over to the backup). */
typedef struct pair {
    pid_t pp, bp;
    const char *blog;
    ps_client *c;
} pair;

/* Starts pair tag; root: the backup's --checkpoint-root, or NULL. */
static pair start_pair(const char *config, const ps_config *cfg, const char *dir, const char *tag,
                       const char *root)
{
    char name[32];
    pair r;
    snprintf(name, sizeof name, "b%s", tag);
    const char *bu = pt_ipc(dir, name);
    snprintf(name, sizeof name, "p%s", tag);
    const char *pu = pt_ipc(dir, name);
    snprintf(name, sizeof name, "backup%s.log", tag);
    r.blog = pt_path(dir, name);
    const char *bflags[] = {"--backup", root ? "--checkpoint-root" : NULL, root, NULL};
    const char *pflags[] = {"--replica", bu, NULL};
    r.bp = spawn_ps(config, bu, r.blog, bflags);
    snprintf(name, sizeof name, "primary%s.log", tag);
    r.pp = spawn_ps(config, pu, pt_path(dir, name), pflags);
    r.c = client_of(cfg, pu);
    return r;
}

/* A push of key 1 (gradient 1), flushed. */
static void push_one(ps_client *c)
{
    uint64_t key = 1;
    float g[DIM] = {1, 1, 1, 1};
    char *err = NULL;
    CHECK_OK(ps_client_push(c, 0, &key, 1, g, &err), err);
    CHECK_OK(ps_client_flush(c, &err), err);
    free(err);
}

/* 1. A backup dropped for being slow. */
static void dropped(const char *config, const ps_config *cfg, const char *dir)
{
    pair r = start_pair(config, cfg, dir, "1", NULL);
    push_one(r.c);
    CHECK_MSG(primary_stats(r.c).replica_dropped == 0, "the primary dropped its backup at once");
    kill(r.bp, SIGSTOP);
    CHECK_MSG(paused(r.bp, 10), "the backup did not stop on SIGSTOP");
    push_one(r.c); /* answered after replica_timeout, unreplicated */
    kill(r.bp, SIGCONT);
    CHECK_MSG(primary_stats(r.c).replica_dropped == 1, "the primary kept its paused backup");
    shutdown_stops_both(r.c, r.pp, r.bp, r.blog, "dropped");
    ps_client_destroy(r.c);
}

/* 2. A diverged backup. */
static void diverged(const char *config, const ps_config *cfg, const char *dir)
{
    pair r = start_pair(config, cfg, dir, "2", pt_path(dir, "backup-root"));
    char *err = NULL;
    const char *ckpt = pt_path(dir, "ckpt2");
    push_one(r.c);
    CHECK_OK(ps_client_save(r.c, ckpt, &err), err);
    CHECK_OK(ps_client_load(r.c, ckpt, &err), err); /* the backup refuses it: outside its root */
    free(err);
    CHECK_MSG(primary_stats(r.c).replica_dropped == 1, "the primary kept its diverged backup");
    shutdown_stops_both(r.c, r.pp, r.bp, r.blog, "diverged");
    ps_client_destroy(r.c);
}

/* 3. A dead backup. */
static void dead(const char *config, const ps_config *cfg, const char *dir)
{
    pair r = start_pair(config, cfg, dir, "3", NULL);
    push_one(r.c);
    CHECK(psp_stop(r.bp, SIGKILL, 5) != 0);
    psp_sleep_ms(200); /* the primary sees the connection close */
    const double t0 = psp_now();
    char *err = NULL;
    CHECK_OK(ps_client_shutdown(r.c, &err), err);
    free(err);
    const double answered = psp_now() - t0;
    int pst = -1;
    bool exited = exits_within(r.pp, 20, &pst);
    const double took = psp_now() - t0;
    fprintf(stderr, "dead backup: SHUTDOWN answered in %.2f s, the primary exited in %.2f s\n",
            answered, took);
    CHECK_MSG(exited && WIFEXITED(pst) && WEXITSTATUS(pst) == 0,
              "dead backup: the primary did not exit 0 after SHUTDOWN (status 0x%x)", pst);
    CHECK_MSG(took < 2.0, "dead backup: the primary took %.2f s to stop (replica_timeout 4 s)",
              took);
    ps_client_destroy(r.c);
}

int main(void)
{
    psp_watchdog(PT_WATCHDOG_S);
    if (getenv("EMBER_BIN") == NULL) pt_die("EMBER_BIN not set", NULL);
    const char *dir = check_tmpdir("ps_replstop");
    ps_config cfg;
    const char *config = pt_config(dir, "replstop.ini", conf, &cfg);
    dropped(config, &cfg, dir);
    diverged(config, &cfg, dir);
    ps_config slow;
    dead(pt_config(dir, "replstop-slow.ini", conf_slow, &slow), &slow, dir);
    return pt_finish(dir);
}
