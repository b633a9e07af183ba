/*
 * Starting and stopping `ember ps` processes, shared by the PS tests and tools/bench_ps.c.
 *
 * Every child is registered so that it is killed and reaped on every way out: the normal
 * path (psp_stop / psp_stop_all, also run atexit), a hang (psp_watchdog's alarm kills the
 * children, removes their ipc sockets and exits), and the parent dying outright (the child asks
 * the kernel for SIGKILL when its parent exits, PR_SET_PDEATHSIG), so a crashed or timed-out
 * test leaves no stray server behind.
 */
#ifndef EMBER_TESTS_PS_PROC_H
#define EMBER_TESTS_PS_PROC_H

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PSP_MAX 64

typedef struct psp_child {
    pid_t pid;           /* 0: free slot */
    char ipc_path[256];  /* socket file to remove after a kill, "" for tcp */
} psp_child;

static psp_child psp_children[PSP_MAX];

static inline void psp_sleep_ms(uint32_t ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static inline double psp_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Kills every registered child and removes its ipc socket; only async-signal-safe calls, so
 * the watchdog can run it. Reaping is left to the caller (or to init after we exit). */
static void psp_kill_all_raw(void)
{
    for (int i = 0; i < PSP_MAX; i++) {
        if (psp_children[i].pid > 0) kill(psp_children[i].pid, SIGKILL);
        if (psp_children[i].ipc_path[0]) unlink(psp_children[i].ipc_path);
    }
}

/* Kills and reaps every child still registered. */
static void psp_stop_all(void)
{
    psp_kill_all_raw();
    for (int i = 0; i < PSP_MAX; i++) {
        if (psp_children[i].pid > 0) waitpid(psp_children[i].pid, NULL, 0);
        memset(&psp_children[i], 0, sizeof psp_children[i]);
    }
}

static void psp_on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "watchdog: time limit reached, killing PS children\n";
    if (write(2, msg, sizeof msg - 1) < 0) {
        /* nothing left to report to */
    }
    psp_kill_all_raw();
    _exit(3);
}

/* A time bound of `seconds` as this build needs it: scaled as the build's ctest timeouts are
 * (EMBER_TEST_TIME_SCALE, from tests/CMakeLists.txt: 4 under ThreadSanitizer). */
#ifndef EMBER_TEST_TIME_SCALE
#define EMBER_TEST_TIME_SCALE 1
#endif
static inline unsigned psp_bound_s(unsigned seconds)
{
    return EMBER_TEST_TIME_SCALE * seconds;
}

/* Bounds the whole run: after psp_bound_s(seconds) the children are killed and the process
 * exits 3. Also arranges for psp_stop_all at a normal exit. */
static inline void psp_watchdog(unsigned seconds)
{
    static int registered;
    if (!registered) {
        atexit(psp_stop_all);
        registered = 1;
    }
    signal(SIGALRM, psp_on_alarm);
    signal(SIGTERM, psp_on_alarm); /* a timeout from outside (ctest) cleans up the same way */
    signal(SIGINT, psp_on_alarm);
    alarm(psp_bound_s(seconds));
}

static inline psp_child *psp_find(pid_t pid)
{
    for (int i = 0; i < PSP_MAX; i++)
        if (psp_children[i].pid == pid) return &psp_children[i];
    return NULL;
}

/* Starts argv[0] with argv, stderr to log (NULL: ours); ipc_url (NULL for none) names the
 * socket it will listen on, removed after it is killed. Returns the pid, or -1 (message on
 * stderr). */
static inline pid_t psp_spawn_argv(char *const argv[], const char *ipc_url, const char *log)
{
    psp_child *slot = psp_find(0);
    if (argv[0] == NULL || slot == NULL) {
        fprintf(stderr, "psp_spawn: %s\n", argv[0] ? "too many children" : "no binary (EMBER_BIN)");
        return -1;
    }
    pid_t parent = getpid();
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        return -1;
    }
    if (pid == 0) {
        /* Die with the parent, even when it is SIGKILLed; re-check in case it already died. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(126);
        alarm(0);
        if (log != NULL) {
            FILE *f = freopen(log, "a", stderr);
            (void)f;
        }
        execv(argv[0], argv);
        fprintf(stderr, "cannot exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    slot->pid = pid;
    slot->ipc_path[0] = '\0';
    if (ipc_url && strncmp(ipc_url, "ipc://", 6) == 0)
        snprintf(slot->ipc_path, sizeof slot->ipc_path, "%s", ipc_url + 6);
    return pid;
}

/* Starts `bin ps --config CONFIG --shard SHARD --listen URL` (see psp_spawn_argv). */
static inline pid_t psp_spawn(const char *bin, const char *config, uint32_t shard, const char *url,
                              const char *log)
{
    char shard_s[16];
    snprintf(shard_s, sizeof shard_s, "%u", shard);
    char *argv[] = {(char *)bin, "ps", "--config", (char *)config, "--shard", shard_s, "--listen",
                    (char *)url, NULL};
    return psp_spawn_argv(argv, url, log);
}

/* A TCP port on 127.0.0.1 the kernel just handed out (free at the time of the call), so
 * concurrent runs do not collide the way fixed or pid-derived ports can. 0 on failure. */
static inline uint16_t psp_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    uint16_t port = 0;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0) close(fd);
    return port;
}

/* Waits until something accepts connections at url (a plain dial succeeds) or the child exits.
 * 0 when ready, -1 when the child died or timeout_s passed. */
static inline int psp_wait_ready(pid_t pid, const char *url, double timeout_s)
{
    double end = psp_now() + timeout_s;
    while (psp_now() < end) {
        int st;
        if (pid > 0 && waitpid(pid, &st, WNOHANG) == pid) {
            fprintf(stderr, "PS %d on %s exited early (status 0x%x)\n", (int)pid, url, st);
            psp_child *c = psp_find(pid);
            if (c) memset(c, 0, sizeof *c);
            return -1;
        }
        nng_socket s;
        if (nng_req0_open(&s) == 0) {
            int rv = nng_dial(s, url, NULL, 0);
            nng_close(s);
            if (rv == 0) return 0;
        }
        psp_sleep_ms(10);
    }
    fprintf(stderr, "PS %d on %s not ready after %.0f s\n", (int)pid, url, timeout_s);
    return -1;
}

/* Unregisters a reaped child and removes its ipc socket. */
static inline void psp_forget(psp_child *c)
{
    if (c->ipc_path[0]) unlink(c->ipc_path);
    memset(c, 0, sizeof *c);
}

/* Sends sig, waits up to timeout_s for the exit, then SIGKILLs; always reaps and unregisters
 * the child and removes its ipc socket. Returns the wait status, or -1 when it had to be
 * SIGKILLed after the grace period (or was not ours). */
static inline int psp_stop(pid_t pid, int sig, double timeout_s)
{
    psp_child *c = psp_find(pid);
    if (pid <= 0 || c == NULL) return -1;
    kill(pid, sig);
    int st = 0, rc = -1;
    double end = psp_now() + timeout_s;
    for (;;) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) {
            rc = st;
            break;
        }
        if (r < 0 && errno != EINTR) break;
        if (psp_now() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
            break;
        }
        psp_sleep_ms(5);
    }
    psp_forget(c);
    return rc;
}

#endif
