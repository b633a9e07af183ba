#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "common/common.h"
#include "src/cli.h"
#include "src/model.h"

static int cmd_version(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    const char *forced = getenv("OPENBLAS_CORETYPE");
    printf("ember %s (GEMM kernels: %s; OpenBLAS kernels: %s%s)\n", EMBER_VERSION,
           backend_cpu_kernels(), backend_cpu_blas_core(),
           forced != NULL ? ", set by OPENBLAS_CORETYPE" : "");
    return 0;
}

void cli_unknown_flag(const char *cmd, const char *arg, const char *const *flags, size_t n)
{
    const char *name = arg + (arg[0] == '-') + (arg[0] == '-' && arg[1] == '-');
    char want[128];
    snprintf(want, sizeof want, "%.*s", (int)strcspn(name, "="), name);
    const char *near = cm_nearest_name(want, flags, n);
    if (near != NULL)
        fprintf(stderr, "ember %s: unknown option '%s': did you mean '--%s'?\n", cmd, arg, near);
    else
        fprintf(stderr, "ember %s: unknown option '%s'\n", cmd, arg);
}

int cli_getopt(const char *cmd, int argc, char **argv, const struct option *opts)
{
    opterr = 0;
    int o = getopt_long(argc, argv, "", opts, NULL);
    opterr = 1;
    if (o != '?') return o;
    const char *arg = optind > 0 && optind <= argc ? argv[optind - 1] : "?";
    if (strncmp(arg, "--", 2) != 0) {
        /* No subcommand has short options: getopt stopped at a character of a "-xy" cluster,
         * and optind may still point at it or past an earlier argument (argv[optind - 1]). */
        char flag[3] = {'-', optopt > ' ' && optopt < 127 ? (char)optopt : '?', '\0'};
        fprintf(stderr, "ember %s: unknown option '%s'\n", cmd, flag);
        return '?';
    }
    const char *name = arg + 2;
    size_t len = strcspn(name, "=");
    enum { MAX_OPTS = 128 };
    const char *names[MAX_OPTS];
    size_t n = 0, fits = 0, exact = MAX_OPTS, fit = 0;
    char several[512] = "";
    for (size_t i = 0; opts[i].name != NULL && n < MAX_OPTS; i++, n++) {
        names[n] = opts[i].name;
        if (strncmp(opts[i].name, name, len) != 0 || len == 0) continue;
        if (strlen(opts[i].name) == len) exact = i;
        fit = i;
        size_t used = strlen(several);
        snprintf(several + used, sizeof several - used, "%s--%s", fits++ ? ", " : "", opts[i].name);
    }
    if (exact != MAX_OPTS || fits == 1) {
        /* getopt knew the option: a value it lacks, or one it does not take. */
        const struct option *it = &opts[exact != MAX_OPTS ? exact : fit];
        fprintf(stderr, "ember %s: option '--%s' %s\n", cmd, it->name,
                it->has_arg == no_argument ? "takes no value" : "needs a value");
    } else if (fits > 1) {
        fprintf(stderr, "ember %s: option '%.*s' is ambiguous (%s)\n", cmd, (int)(len + 2), arg,
                several);
    } else {
        cli_unknown_flag(cmd, arg, names, n);
    }
    return '?';
}

int cli_args_complete(const char *cmd, const char *missing, int optind, int argc, char **argv,
                      void (*usage)(FILE *to))
{
    if (missing == NULL && optind >= argc) return 0;
    if (missing != NULL)
        fprintf(stderr, "ember %s: %s is required\n", cmd, missing);
    else
        fprintf(stderr, "ember %s: unexpected argument '%s'\n", cmd, argv[optind]);
    usage(stderr);
    return 2;
}

static const struct {
    const char *name;
    cli_cmd_fn fn;
    const char *help;
} commands[] = {
    {"version", cmd_version, "print the version"},
    {"ingest", cmd_ingest, "convert click logs to checksummed binary shards"},
    {"gen", cmd_gen, "write synthetic Criteo-format click logs"},
    {"ps", cmd_ps, "serve one parameter-server shard"},
    {"train", cmd_train, "train a CTR model against the parameter servers"},
    {"export", cmd_export, "write a serving bundle (or safetensors, RocksDB) from a checkpoint"},
    {"predict", cmd_predict, "score shards with a serving bundle"},
    {"reshard", cmd_reshard, "redistribute a checkpoint over a new number of PS shards"},
};

static void usage(FILE *to)
{
    fprintf(to,
            "usage: ember COMMAND [options]   (ember COMMAND --help for a command's options)\n\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(to, "  %-10s %s\n", commands[i].name, commands[i].help);
}

/* A process tools/launch started (EMBER_LAUNCH_PID: the launcher's pid, its parent) ends with
 * the launcher, also when that is killed outright: SIGKILL runs none of its traps, and the job's
 * processes would otherwise run on. The variable is dropped, so nothing this process starts
 * takes it for its own parent. */
static void follow_launcher(void)
{
    const char *v = getenv("EMBER_LAUNCH_PID");
    if (v == NULL) return;
    char *end;
    long pid = strtol(v, &end, 10);
    if (*end == '\0' && end != v && pid > 1 && prctl(PR_SET_PDEATHSIG, SIGTERM) == 0 &&
        getppid() != (pid_t)pid)
        raise(SIGTERM); /* it was gone before the prctl */
    unsetenv("EMBER_LAUNCH_PID");
}

int main(int argc, char **argv)
{
    /* OpenBLAS chose its kernels as it loaded; where it fell back to pre-AVX2 ones, ember runs
     * again with the right ones (ember version says which it uses). */
    cm_blas_core_reexec(backend_cpu_blas_core(), argv);
    cm_malloc_tune();
    follow_launcher();
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "help") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (strcmp(argv[1], commands[i].name) == 0) return commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "ember: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
