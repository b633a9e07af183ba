/*
 * The ember CLI: one binary, git-style subcommands. Each subcommand lives in src/cmd_NAME.c
 * and is listed in the table in src/main.c. A subcommand gets argv starting at its own name,
 * returns the process exit code (0 ok, 1 runtime failure, 2 usage error), and prints errors to
 * stderr naming what and where.
 */
#ifndef EMBER_SRC_CLI_H
#define EMBER_SRC_CLI_H

#define EMBER_VERSION "0.1.0"

#include <stdio.h>

typedef int (*cli_cmd_fn)(int argc, char **argv);

/* "ember CMD: unknown option 'ARG'", with the one of flags[0..n) (names without their
 * dashes) that ARG likely stands for: "...: did you mean '--batch'?". */
void cli_unknown_flag(const char *cmd, const char *arg, const char *const *flags, size_t n);

struct option;
/* getopt_long over opts (long options only) that reports a bad option itself, naming the
 * command: an unknown one with the option it most likely stands for ("ember train: unknown
 * option '--bacth': did you mean '--batch'?"), an abbreviation that fits several, or one
 * missing its value. Returns what getopt_long returns ('?' after such a report). */
int cli_getopt(const char *cmd, int argc, char **argv, const struct option *opts);

/* The last check of a subcommand's options: missing names the first required option not given
 * (NULL when all are), and argv[optind..argc) must be empty. Returns 0 when the arguments are
 * complete; else prints "ember CMD: --X is required" (or the stray argument), then the usage,
 * to stderr and returns 2, the usage exit code. */
int cli_args_complete(const char *cmd, const char *missing, int optind, int argc, char **argv,
                      void (*usage)(FILE *to));

int cmd_gen(int argc, char **argv);
int cmd_ingest(int argc, char **argv);
int cmd_ps(int argc, char **argv);
int cmd_train(int argc, char **argv);
int cmd_export(int argc, char **argv);
int cmd_predict(int argc, char **argv);
int cmd_reshard(int argc, char **argv);

#endif
