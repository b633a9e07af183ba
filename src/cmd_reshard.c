/* ember reshard: redistribute a checkpoint over a new number of PS shards. */
#include <dirent.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ps/ps.h"
#include "src/cli.h"
#include "src/train.h"

static void reshard_usage(FILE *to)
{
    fprintf(to,
            "usage: ember reshard --from RUNDIR|CKPT --shards N --out RUNDIR [--memory BYTES]\n"
            "  writes RUNDIR/ckpt/step-S (rows identical, spread over N shards) and points\n"
            "  RUNDIR/ckpt/LATEST at it; continue with ember train --out RUNDIR --shards N\n"
            "  --resume. RUNDIR must be absent, empty, or an earlier reshard of the same\n"
            "  checkpoint (replaced): never --from's or another run's directory.\n"
            "  Rows are streamed, never all held: --memory (K/M/G suffixes; default %lluM)\n"
            "  bounds what the reshard holds, however large the tables; less only spreads\n"
            "  each table's keys (8 bytes a row, to find a key twice) over more scratch\n"
            "  files. The output is the same bytes with any --memory.\n",
            (unsigned long long)(PS_RESHARD_MEMORY_DEFAULT >> 20));
}

/* Copies a worker's int8 residuals (worker-<i>.ef) as they are, verified: they are keyed by row,
 * not by shard, so any shard count takes them. */
static int copy_residuals(const char *src, const char *dst, char **errptr)
{
    void *buf = NULL;
    size_t len = 0;
    int rc = cm_read_file(src, &buf, &len, errptr);
    if (rc == CM_OK) rc = ps_residuals_check(buf, len, src, errptr);
    if (rc == CM_OK) rc = cm_write_file_atomic(dst, buf, len, errptr);
    free(buf);
    return rc;
}

/* Copies the trainer's files that sit beside the shards (model.txt, worker-<i>.pos and .ef, and
 * run.txt with its shard count made the new one, so that a resume still checks the other
 * settings against it), each checksum verified on the way. */
static int copy_side_files(const char *from, const char *to, uint32_t shards, char **errptr)
{
    DIR *d = opendir(from);
    if (d == NULL) return cm_err_errno(errptr, CM_EIO, "cannot read %s", from);
    struct dirent *e;
    int rc = CM_OK;
    while (rc == CM_OK && (e = readdir(d)) != NULL) {
        bool run = !strcmp(e->d_name, "run.txt");
        /* A checkpoint written before ember train cleared its staging directory may hold a
         * killed save's worker temporary, cut short, which is no part of the checkpoint. */
        uint32_t w;
        train_worker_file kind = train_ckpt_worker_file(e->d_name, &w);
        if (kind == TRAIN_WF_NONE && strcmp(e->d_name, "model.txt") && !run) continue;
        char src[4400], dst[4400];
        if (snprintf(src, sizeof src, "%s/%s", from, e->d_name) >= (int)sizeof src ||
            snprintf(dst, sizeof dst, "%s/%s", to, e->d_name) >= (int)sizeof dst) {
            rc = cm_err(errptr, CM_EINVAL, "path too long under %s", to);
            break;
        }
        if (kind == TRAIN_WF_EF) {
            rc = copy_residuals(src, dst, errptr);
            continue;
        }
        char *text = NULL, *out = NULL;
        size_t len;
        rc = cm_read_sealed(src, &text, &len, errptr);
        if (rc == CM_OK && run) {
            char *at = strstr(text, "\nshards ");
            size_t cap = len + 32;
            out = at ? malloc(cap) : NULL;
            if (at == NULL)
                rc = cm_err(errptr, CM_ECORRUPT, "%s: no shards line", src);
            else if (out == NULL)
                rc = cm_err(errptr, CM_ENOMEM, "out of memory");
            else {
                at++;
                const char *rest = at + strcspn(at, "\n");
                len = (size_t)snprintf(out, cap, "%.*sshards %u%s", (int)(at - text), text, shards,
                                       rest);
            }
        }
        if (rc == CM_OK) rc = cm_write_sealed(dst, out ? out : text, len, errptr);
        free(out);
        free(text);
    }
    closedir(d);
    return rc;
}

/* What a reshard writes into --out besides the checkpoint: which checkpoint it came from, so a
 * later reshard can tell its own earlier output (replaceable) from another run's. Written
 * before the checkpoint, so an interrupted reshard is recognised too. */
#define RESHARD_MARK "reshard.txt"

/* Refuses (CM_EINVAL) an entry of dir whose name is not in names (NULL-terminated). */
static int holds_only(const char *dir, const char *const *names, const char *out, const char *from,
                      char **errptr)
{
    char *other = NULL;
    int rc = cm_dir_other_entry(dir, names, &other, errptr);
    if (rc == CM_OK && other != NULL)
        rc = cm_err(errptr, CM_EINVAL,
                    "--out %s holds %s/%s, which no reshard of %s wrote: not writing into it "
                    "(give an absent or empty directory)",
                    out, dir, other, from);
    free(other);
    return rc;
}

/* Whether this reshard may write into out: out absent or empty, or the earlier output of a
 * reshard of the same checkpoint (mark: the RESHARD_MARK text this one writes) holding nothing
 * but what this one replaces. Writing replaces ckpt/<name> whole and repoints ckpt/LATEST, so
 * another run's directory (a checkpoint of the same step, or a later one LATEST would stop
 * naming) is refused instead. from names the checkpoint in messages. */
static int check_out(const char *out, const char *mark, const char *from, const char *name,
                     char **errptr)
{
    static const char *const ours[] = {RESHARD_MARK, NULL};
    char path[4400], tmp[128], *why = NULL;
    int rc = cm_dir_replaceable(out, ours, &why);
    if (rc != CM_OK) {
        rc = cm_err(errptr, rc,
                    "--out %s (give an absent or empty directory, or an earlier reshard of the "
                    "same checkpoint)",
                    why ? why : out);
        free(why);
        return rc;
    }
    snprintf(path, sizeof path, "%s/" RESHARD_MARK, out);
    char *text = NULL;
    size_t len;
    rc = cm_read_sealed(path, &text, &len, &why);
    if (rc == CM_ENOTFOUND)
        rc = CM_OK; /* absent or empty */
    else if (rc != CM_OK)
        rc = cm_err(errptr, rc, "%s", why);
    free(why);
    if (rc != CM_OK || text == NULL) return rc;
    if (strcmp(text, mark) != 0)
        rc = cm_err(errptr, CM_EINVAL,
                    "--out %s holds a reshard of another checkpoint (%s: %.*s), not of %s: not "
                    "replacing it (give another directory)",
                    out, RESHARD_MARK, (int)strcspn(text, "\n"), text, from);
    free(text);
    const char *top[] = {RESHARD_MARK, "ckpt", NULL}, *ck[] = {"LATEST", name, tmp, NULL};
    snprintf(tmp, sizeof tmp, "%s" TRAIN_CKPT_STAGING, name); /* left by an interrupted reshard */
    if (rc == CM_OK) rc = holds_only(out, top, out, from, errptr);
    snprintf(path, sizeof path, "%s/ckpt", out);
    struct stat st;
    if (rc == CM_OK && stat(path, &st) == 0) rc = holds_only(path, ck, out, from, errptr);
    return rc;
}

int cmd_reshard(int argc, char **argv)
{
    static const struct option opts[] = {{"from", 1, 0, 'f'}, {"shards", 1, 0, 'n'},
                                         {"out", 1, 0, 'o'},  {"memory", 1, 0, 'm'},
                                         {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    const char *from = NULL, *out = NULL;
    uint64_t shards = 0, memory = PS_RESHARD_MEMORY_DEFAULT;
    int o;
    optind = 1;
    while ((o = cli_getopt("reshard", argc, argv, opts)) != -1) {
        switch (o) {
        case 'f': from = optarg; break;
        case 'o': out = optarg; break;
        case 'n':
            if (cm_parse_size(optarg, &shards) != 0 || shards == 0 || shards > PS_MAX_SHARDS) {
                fprintf(stderr, "ember reshard: bad --shards '%s'\n", optarg);
                return 2;
            }
            break;
        case 'm':
            if (cm_parse_size(optarg, &memory) != 0 || memory == 0) {
                fprintf(stderr, "ember reshard: bad --memory '%s'\n", optarg);
                return 2;
            }
            break;
        case 'h': reshard_usage(stdout); return 0;
        default: reshard_usage(stderr); return 2;
        }
    }
    int bad = cli_args_complete("reshard",
                                !from     ? "--from"
                                : !out    ? "--out"
                                : !shards ? "--shards"
                                          : NULL,
                                optind, argc, argv, reshard_usage);
    if (bad != 0) return bad;
    char ckpt[4200], dst[4400], latest[4400], name[64];
    uint64_t step = 0;
    char *err = NULL;
    double t0 = cm_now();
    int rc = train_resolve_checkpoint(from, ckpt, sizeof ckpt, &step, &err);
    snprintf(name, sizeof name, "step-%" PRIu64, step);
    snprintf(dst, sizeof dst, "%s/ckpt/%s", out, name);
    snprintf(latest, sizeof latest, "%s/ckpt/LATEST", out);
    /* The new checkpoint replaces dst whole, and the side files are read from ckpt after that:
     * when they are one directory (--out is --from's run directory, however spelt), the
     * checkpoint would be replaced by one without model.txt, run.txt or positions. */
    struct stat a, b;
    if (rc == CM_OK && stat(ckpt, &a) == 0 && stat(dst, &b) == 0 && a.st_dev == b.st_dev &&
        a.st_ino == b.st_ino) {
        fprintf(stderr,
                "ember reshard: --out %s would write over the checkpoint it reads (%s): give "
                "another run directory\n",
                out, ckpt);
        return 2;
    }
    /* The checkpoint's real path names it in --out's RESHARD_MARK, however --from is spelt. */
    char real[PATH_MAX] = "", mark[PATH_MAX + 8], mark_path[4400];
    if (rc == CM_OK && realpath(ckpt, real) == NULL)
        rc = cm_err_errno(&err, CM_EIO, "cannot resolve %s", ckpt);
    snprintf(mark, sizeof mark, "from %s\n", real);
    if (rc == CM_OK && (rc = check_out(out, mark, ckpt, name, &err)) == CM_EINVAL) {
        fprintf(stderr, "ember reshard: %s\n", err);
        free(err);
        return 2;
    }
    if (rc == CM_OK) {
        char parent[4400];
        snprintf(parent, sizeof parent, "%s/ckpt", out);
        rc = cm_mkdirs(parent, &err);
    }
    snprintf(mark_path, sizeof mark_path, "%s/" RESHARD_MARK, out);
    if (rc == CM_OK) rc = cm_write_sealed(mark_path, mark, strlen(mark), &err);
    /* The whole checkpoint, side files too, is assembled beside dst and swapped in: written in
     * place, a crash between the shards and the side files left a step-S without model.txt,
     * run.txt or positions, which LATEST could already name. */
    char tmp[4500];
    snprintf(tmp, sizeof tmp, "%s" TRAIN_CKPT_STAGING, dst);
    if (rc == CM_OK) rc = cm_rmtree(tmp, &err);
    if (rc == CM_OK) rc = ps_checkpoint_reshard(ckpt, tmp, (uint32_t)shards, memory, &err);
    if (rc == CM_OK) rc = copy_side_files(ckpt, tmp, (uint32_t)shards, &err);
    if (rc == CM_OK) rc = cm_fsync_dir(tmp, &err);
    if (rc == CM_OK) rc = cm_dir_swap(tmp, dst, &err);
    if (rc != CM_OK) cm_rmtree(tmp, NULL);
    strcat(name, "\n");
    if (rc == CM_OK) rc = cm_write_sealed(latest, name, strlen(name), &err);
    if (rc != CM_OK) {
        fprintf(stderr, "ember reshard: %s\n", err ? err : "failed");
        free(err);
        return 1;
    }
    fputs("{\"from\":\"", stdout);
    cm_json_escape(stdout, ckpt);
    fputs("\",\"to\":\"", stdout);
    cm_json_escape(stdout, dst);
    printf("\",\"shards\":%" PRIu64 ",\"seconds\":%.3f}\n", shards, cm_now() - t0);
    return 0;
}
