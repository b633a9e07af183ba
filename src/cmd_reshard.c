/* ember reshard: redistribute a checkpoint over a new number of PS shards. */
#include <dirent.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ps/ps.h"
#include "src/cli.h"
#include "src/train.h"

static void reshard_usage(FILE *to)
{
    fprintf(to, "usage: ember reshard --from RUNDIR|CKPT --shards N --out RUNDIR\n"
                "  writes RUNDIR/ckpt/step-S (rows identical, spread over N shards) and points\n"
                "  RUNDIR/ckpt/LATEST at it; continue with ember train --out RUNDIR --shards N\n"
                "  --resume. RUNDIR must not be the run directory of --from.\n");
}

/* Copies the trainer's files that sit beside the shards (model.txt, worker-<i>.pos, and
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
        if (strncmp(e->d_name, "worker-", 7) && strcmp(e->d_name, "model.txt") && !run) continue;
        char src[4400], dst[4400];
        if (snprintf(src, sizeof src, "%s/%s", from, e->d_name) >= (int)sizeof src ||
            snprintf(dst, sizeof dst, "%s/%s", to, e->d_name) >= (int)sizeof dst) {
            rc = cm_err(errptr, CM_EINVAL, "path too long under %s", to);
            break;
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

int cmd_reshard(int argc, char **argv)
{
    static const struct option opts[] = {{"from", 1, 0, 'f'}, {"shards", 1, 0, 'n'},
                                         {"out", 1, 0, 'o'},  {"help", 0, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *from = NULL, *out = NULL;
    uint64_t shards = 0;
    int o;
    optind = 1;
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 'f': from = optarg; break;
        case 'o': out = optarg; break;
        case 'n':
            if (cm_parse_size(optarg, &shards) != 0 || shards == 0 || shards > PS_MAX_SHARDS) {
                fprintf(stderr, "ember reshard: bad --shards '%s'\n", optarg);
                return 2;
            }
            break;
        case 'h': reshard_usage(stdout); return 0;
        default: reshard_usage(stderr); return 2;
        }
    }
    if (!from || !out || !shards || optind != argc) {
        reshard_usage(stderr);
        return 2;
    }
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
    if (rc == CM_OK) {
        char parent[4400];
        snprintf(parent, sizeof parent, "%s/ckpt", out);
        rc = cm_mkdirs(parent, &err);
    }
    if (rc == CM_OK) rc = ps_checkpoint_reshard(ckpt, dst, (uint32_t)shards, &err);
    if (rc == CM_OK) rc = copy_side_files(ckpt, dst, (uint32_t)shards, &err);
    strcat(name, "\n");
    if (rc == CM_OK) rc = cm_write_sealed(latest, name, strlen(name), &err);
    if (rc != CM_OK) {
        fprintf(stderr, "ember reshard: %s\n", err ? err : "failed");
        free(err);
        return 1;
    }
    printf("{\"from\":\"%s\",\"to\":\"%s\",\"shards\":%" PRIu64 ",\"seconds\":%.3f}\n", ckpt, dst,
           shards, cm_now() - t0);
    return 0;
}
