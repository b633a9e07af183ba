/* ember train: end-to-end CTR training against the PS (src/train.h). */
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "src/cli.h"
#include "src/train.h"

static void train_usage(FILE *to)
{
    fprintf(
        to,
        "usage: ember train --train DIR [--eval DIR] [--model lr|mlp|dlrm|deepfm] [--out RUNDIR]\n"
        "                   [options]\n"
        "  --train DIR          training shards (ember ingest's train/)\n"
        "  --eval DIR           held-out shards: exact AUC and logloss at the end\n"
        "  --eval-every N       ... and every N steps of worker 0 (metrics.jsonl, progress)\n"
        "  --model NAME         lr, mlp (default), dlrm, deepfm\n"
        "  --out RUNDIR         checkpoints, metrics.jsonl (default runs/train)\n"
        "  --config FILE        INI with [model] (kind, dim, hidden, bottom, seed, pool) and\n"
        "                       [train] (batch, epochs, emb_lr, dense_lr, emb_optimizer,\n"
        "                       push_codec, memory, shuffle, staleness, checkpoint_every,\n"
        "                       eval_every, tf32, bf16, expected_rows, dense_mirror,\n"
        "                       dense_optimizer, worker_timeout, keep_checkpoints,\n"
        "                       max_message, residual_memory, admit, ttl,\n"
        "                       max_batch_keys); every\n"
        "                       key under its section's header\n"
        "  --device cpu|cuda    default: cuda when built with it and a device is present\n"
        "                       (cpu with --bf16)\n"
        "  --tf32               cuda: TF32 tensor-core GEMMs (faster, ~1e-3 relative; default\n"
        "                       fp32; EMBER_CUDA_TF32=1 too); cpu: ignored\n"
        "  --bf16               cpu: GEMMs on AMX tiles, operands rounded to bfloat16 and\n"
        "                       summed in fp32 (~3x faster GEMMs; needs AMX-BF16; default fp32)\n"
        "  --batch N --epochs N --workers N --shards N --staleness K (-1 async)\n"
        "  --checkpoint-every N --keep-checkpoints K (default 5; 0 = all) --resume\n"
        "                       (a run without --cluster that gets SIGTERM or SIGINT\n"
        "                       checkpoints at a step every worker reaches and exits with\n"
        "                       128 + the signal's number (once the final checkpoint is\n"
        "                       written the run finishes as usual); a second signal stops\n"
        "                       it at once.\n"
        "                       In a cluster job a worker that gets one votes at its next\n"
        "                       periodic checkpoint (without --checkpoint-every: at its next\n"
        "                       stop poll of shard 0, every 100 steps, which fixes a step\n"
        "                       every worker reaches and checkpoints at); every worker stops\n"
        "                       after that checkpoint and exits 128 + its signal (143 if it\n"
        "                       had none), the PS processes serve until worker 0 shuts them\n"
        "                       down)\n"
        "  --rejoin             cluster worker: restart into the running job from its last\n"
        "                       progress note (run dir progress/worker-<i>)\n"
        "  --ps-timeout MS      a PS request unanswered this long fails the worker (30000)\n"
        "  --max-steps N --seed S --memory BYTES (per shard)\n"
        "  --expected-rows N    rows each embedding table will reach (all shards): tables are\n"
        "                       created that large instead of doubling (default: the distinct-\n"
        "                       key estimate in the ingest's stats.json, +5%%; 0: start small)\n"
        "  --max-batch-keys N   most distinct keys a batch may hold; buffers (the GPU's too) are\n"
        "                       sized by it (default: batch x the most keys in a row, from the\n"
        "                       ingest's stats.json; without one batch x fields x 8 + 1024)\n"
        "  --emb-lr X --dense-lr X --emb-optimizer NAME --push-codec fp32|fp16|bf16|int8\n"
        "  --dense-optimizer adam|adagrad|sgd   the tower's, on the PS (default adam; its\n"
        "                       --dense-lr defaults to 0.001, sgd's to 0.1)\n"
        "  --dim D --shuffle ROWS --threads T (compute threads per worker, default: cores, at most "
        "8)\n"
        "  --stale-pull         pull batch t+1 before batch t's push (faster, one step stale)\n"
        "  --apply-threads N    threads each PS shard of this process applies a large pull or\n"
        "                       push on (same results; default: half the cores up to 8, shared\n"
        "                       by the process's shards; 1 beside workers on --device cpu)\n"
        "  --no-dense-mirror    a lone worker waits for the PS's tower update instead of\n"
        "                       applying the same update to its own copy (same results)\n"
        "  --worker-timeout MS  a worker silent this long no longer holds back clocks and\n"
        "                       barriers: the others go on without it (default 0: wait for\n"
        "                       it; a worker that died, its connection closed, and is not\n"
        "                       back (--rejoin) within --ps-timeout stops the others with an\n"
        "                       error naming it)\n"
        "  --max-message BYTES  largest message between workers and PS (default: what a batch's\n"
        "                       pull or push to one shard needs with one key a field, at\n"
        "                       least 256 MiB; raise it for multi-valued fields)\n"
        "  --residual-memory BYTES  --push-codec int8: memory for each worker's error-feedback\n"
        "                       residuals (default 256M; 0: no bound); past it the residuals\n"
        "                       of the rows pushed least recently are dropped\n"
        "  --admit N            feature admission: a key gets an embedding row once it was in N\n"
        "                       batches (a count-min sketch on each shard, in checkpoints);\n"
        "                       until then it reads as zeros and its gradients are dropped\n"
        "                       (default 0: at once)\n"
        "  --ttl STEPS          a row no batch touched for about STEPS of the job's steps is\n"
        "                       dropped, in memory and spilled (default 0: never)\n"
        "  --progress | --no-progress\n"
        "  --cluster FILE --role ps|backup|worker --index I   one role of a multi-process job\n"
        "                       (the three together)\n");
}

static int parse_uint(const char *s, uint64_t max, uint64_t *out)
{
    uint64_t v;
    if (cm_parse_size(s, &v) != 0 || v > max) return -1;
    *out = v;
    return 0;
}

/* Cuts path back to its parent directory ("a/b/c" -> "a/b"); false when it has none to cut to
 * ("a", "/a"). */
static bool train_path_parent(char *path)
{
    char *slash = strrchr(path, '/');
    if (slash == NULL || slash == path) return false;
    *slash = '\0';
    return true;
}

int cmd_train(int argc, char **argv)
{
    int index_set = 0;
    enum {
        O_TRAIN = 256,
        O_EVAL,
        O_MODEL,
        O_OUT,
        O_CONFIG,
        O_DEVICE,
        O_BATCH,
        O_EPOCHS,
        O_WORKERS,
        O_SHARDS,
        O_STALE,
        O_CKPT,
        O_EVAL_EVERY,
        O_MAXSTEPS,
        O_RESUME,
        O_SEED,
        O_MEMORY,
        O_EMBLR,
        O_DENSELR,
        O_EMBOPT,
        O_DENSEOPT,
        O_CODEC,
        O_DIM,
        O_SHUFFLE,
        O_PROGRESS,
        O_NOPROGRESS,
        O_CLUSTER,
        O_ROLE,
        O_INDEX,
        O_THREADS,
        O_STALEPULL,
        O_APPLY,
        O_KEEP,
        O_WTIMEOUT,
        O_REJOIN,
        O_PSTIMEOUT,
        O_TF32,
        O_BF16,
        O_NOMIRROR,
        O_EXPECTED,
        O_MAXMSG,
        O_RESIDMEM,
        O_ADMIT,
        O_TTL,
        O_MAXBKEYS,
        O_HELP
    };
    static const struct option opts[] = {{"train", 1, 0, O_TRAIN},
                                         {"eval", 1, 0, O_EVAL},
                                         {"model", 1, 0, O_MODEL},
                                         {"out", 1, 0, O_OUT},
                                         {"config", 1, 0, O_CONFIG},
                                         {"device", 1, 0, O_DEVICE},
                                         {"batch", 1, 0, O_BATCH},
                                         {"epochs", 1, 0, O_EPOCHS},
                                         {"workers", 1, 0, O_WORKERS},
                                         {"shards", 1, 0, O_SHARDS},
                                         {"staleness", 1, 0, O_STALE},
                                         {"checkpoint-every", 1, 0, O_CKPT},
                                         {"eval-every", 1, 0, O_EVAL_EVERY},
                                         {"max-steps", 1, 0, O_MAXSTEPS},
                                         {"resume", 0, 0, O_RESUME},
                                         {"seed", 1, 0, O_SEED},
                                         {"memory", 1, 0, O_MEMORY},
                                         {"emb-lr", 1, 0, O_EMBLR},
                                         {"dense-lr", 1, 0, O_DENSELR},
                                         {"emb-optimizer", 1, 0, O_EMBOPT},
                                         {"dense-optimizer", 1, 0, O_DENSEOPT},
                                         {"push-codec", 1, 0, O_CODEC},
                                         {"dim", 1, 0, O_DIM},
                                         {"shuffle", 1, 0, O_SHUFFLE},
                                         {"progress", 0, 0, O_PROGRESS},
                                         {"no-progress", 0, 0, O_NOPROGRESS},
                                         {"cluster", 1, 0, O_CLUSTER},
                                         {"role", 1, 0, O_ROLE},
                                         {"index", 1, 0, O_INDEX},
                                         {"threads", 1, 0, O_THREADS},
                                         {"stale-pull", 0, 0, O_STALEPULL},
                                         {"apply-threads", 1, 0, O_APPLY},
                                         {"keep-checkpoints", 1, 0, O_KEEP},
                                         {"worker-timeout", 1, 0, O_WTIMEOUT},
                                         {"rejoin", 0, 0, O_REJOIN},
                                         {"ps-timeout", 1, 0, O_PSTIMEOUT},
                                         {"tf32", 0, 0, O_TF32},
                                         {"bf16", 0, 0, O_BF16},
                                         {"no-dense-mirror", 0, 0, O_NOMIRROR},
                                         {"expected-rows", 1, 0, O_EXPECTED},
                                         {"max-message", 1, 0, O_MAXMSG},
                                         {"residual-memory", 1, 0, O_RESIDMEM},
                                         {"admit", 1, 0, O_ADMIT},
                                         {"ttl", 1, 0, O_TTL},
                                         {"max-batch-keys", 1, 0, O_MAXBKEYS},
                                         {"help", 0, 0, O_HELP},
                                         {0, 0, 0, 0}};
    train_opts o;
    train_opts_init(&o);
    o.out_dir = "runs/train";
    /* The config file first, so flags override it wherever they appear. getopt finds it, as
     * it finds the flags below: --config=FILE and abbreviations (--conf FILE) are the same
     * option and must not be skipped. Bad flags are reported by the second pass. */
    int opt;
    opterr = 0;
    optind = 1;
    while ((opt = getopt_long(argc, argv, "", opts, NULL)) != -1)
        if (opt == O_CONFIG) {
            char *err = NULL;
            if (train_config_load(optarg, &o, &err) != CM_OK) {
                fprintf(stderr, "ember train: %s\n", err);
                free(err);
                return 2;
            }
        }
    optind = 0; /* 0: glibc and musl start the scan afresh */
    while ((opt = cli_getopt("train", argc, argv, opts)) != -1) {
        uint64_t u = 0;
        int bad = 0;
        char *end = NULL;
        switch (opt) {
        case O_TRAIN:
            o.train_path = optarg;
            break;
        case O_EVAL:
            o.eval_path = optarg;
            break;
        case O_MODEL:
            bad = model_kind_parse(optarg, &o.model.kind);
            o.model_set = 1;
            break;
        case O_OUT:
            o.out_dir = optarg;
            break;
        case O_CONFIG:
            break;
        case O_DEVICE:
            o.device = optarg;
            break;
        case O_BATCH:
            bad = parse_uint(optarg, 1000000, &u) || !u;
            o.batch = (uint32_t)u;
            break;
        case O_EPOCHS:
            bad = parse_uint(optarg, 10000, &u) || !u;
            o.epochs = (uint32_t)u;
            break;
        case O_WORKERS:
            bad = parse_uint(optarg, PS_MAX_WORKERS, &u) || !u;
            o.workers = (uint32_t)u;
            break;
        case O_APPLY:
            bad = parse_uint(optarg, 256, &u) || !u;
            o.apply_threads = (uint32_t)u;
            break;
        case O_SHARDS:
            bad = parse_uint(optarg, PS_MAX_SHARDS, &u) || !u;
            o.shards = (uint32_t)u;
            break;
        case O_STALE: {
            long v = strtol(optarg, &end, 10);
            bad = *end || end == optarg || v < -1 || v > 1000000;
            o.staleness = (int32_t)v;
            break;
        }
        case O_CKPT:
            bad = parse_uint(optarg, UINT64_MAX, &o.ckpt_every);
            break;
        case O_RESIDMEM:
            bad = parse_uint(optarg, UINT64_MAX, &o.resid_memory);
            break;
        case O_ADMIT:
            bad = parse_uint(optarg, UINT16_MAX, &u);
            o.admit = (uint32_t)u;
            break;
        case O_TTL:
            bad = parse_uint(optarg, TRAIN_TTL_MAX, &o.ttl);
            break;
        case O_EVAL_EVERY:
            bad = parse_uint(optarg, UINT64_MAX, &o.eval_every);
            break;
        case O_MAXSTEPS:
            bad = parse_uint(optarg, UINT64_MAX, &o.max_steps);
            break;
        case O_RESUME:
            o.resume = 1;
            break;
        case O_REJOIN:
            o.rejoin = 1;
            break;
        case O_SEED:
            bad = parse_uint(optarg, UINT64_MAX, &o.seed);
            break;
        case O_MEMORY:
            bad = parse_uint(optarg, UINT64_MAX, &o.memory);
            break;
        case O_MAXMSG:
            bad = parse_uint(optarg, UINT64_MAX, &o.max_message) || o.max_message < 4096;
            break;
        case O_EXPECTED:
            bad = parse_uint(optarg, INT64_MAX, &u);
            o.expected_rows = (int64_t)u;
            break;
        case O_MAXBKEYS:
            bad = parse_uint(optarg, TRAIN_MAX_BATCH_KEYS_MAX, &u) || u == 0;
            o.max_batch_keys = (uint32_t)u;
            break;
        case O_EMBLR:
            o.emb_lr = strtof(optarg, &end);
            bad = *end || !(o.emb_lr > 0) || !isfinite(o.emb_lr);
            break;
        case O_DENSELR:
            o.dense_lr = strtof(optarg, &end);
            bad = *end || !(o.dense_lr > 0) || !isfinite(o.dense_lr);
            break;
        case O_EMBOPT:
            bad = emb_opt_parse(optarg, &o.emb_opt);
            break;
        case O_DENSEOPT:
            bad = ps_dense_opt_parse(optarg, &o.dense_opt);
            break;
        case O_CODEC:
            bad = ps_codec_parse(optarg, &o.push_codec);
            break;
        case O_DIM:
            bad = parse_uint(optarg, 1024, &u) || !u;
            o.dim_override = (uint32_t)u;
            break;
        case O_SHUFFLE:
            bad = parse_uint(optarg, UINT64_MAX, &o.shuffle_rows);
            break;
        case O_PROGRESS:
            o.progress = 1;
            break;
        case O_NOPROGRESS:
            o.progress = 0;
            break;
        case O_CLUSTER:
            o.cluster_path = optarg;
            break;
        case O_ROLE:
            o.role = optarg;
            break;
        case O_INDEX:
            bad = parse_uint(optarg, UINT32_MAX, &u);
            o.index = (uint32_t)u;
            index_set = 1;
            break;
        case O_STALEPULL:
            o.stale_pull = 1;
            break;
        case O_NOMIRROR:
            o.dense_mirror = 0;
            break;
        case O_TF32:
            o.tf32 = 1;
            break;
        case O_BF16:
            o.bf16 = 1;
            break;
        case O_WTIMEOUT:
            bad = parse_uint(optarg, UINT32_MAX, &u);
            o.worker_timeout_ms = (uint32_t)u;
            break;
        case O_PSTIMEOUT:
            bad = parse_uint(optarg, UINT32_MAX, &u) || !u;
            o.ps_timeout_ms = (uint32_t)u;
            break;
        case O_KEEP:
            bad = parse_uint(optarg, 100000, &u);
            o.keep_checkpoints = (uint32_t)u;
            break;
        case O_THREADS:
            bad = parse_uint(optarg, 256, &u) || !u;
            o.threads = (uint32_t)u;
            break;
        case O_HELP:
            train_usage(stdout);
            return 0;
        default:
            train_usage(stderr);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "ember train: bad value '%s' for --%s\n", optarg,
                    opts[opt - O_TRAIN].name);
            return 2;
        }
    }
    if (optind != argc || o.train_path == NULL || (o.cluster_path && o.role == NULL)) {
        fprintf(stderr, "ember train: %s\n",
                optind != argc         ? "unexpected argument"
                : o.train_path == NULL ? "--train is required"
                                       : "--cluster needs --role");
        train_usage(stderr);
        return 2;
    }
    if (o.cluster_path == NULL && (o.role != NULL || index_set)) {
        fprintf(stderr, "ember train: --role and --index are for one role of a cluster job: "
                        "give --cluster FILE too (without it the whole job runs here)\n");
        return 2;
    }
    /* Named before anything is read (the cluster file, the shards), as a usage error. */
    if (o.role && strcmp(o.role, "ps") && strcmp(o.role, "backup") && strcmp(o.role, "worker")) {
        fprintf(stderr, "ember train: --role %s: want ps, backup or worker\n", o.role);
        return 2;
    }
    /* No default index: two processes started without one would both be shard or worker 0. */
    if (o.cluster_path != NULL && !index_set) {
        fprintf(stderr, "ember train: --cluster needs --index (which %s this process is)\n",
                o.role);
        return 2;
    }
    if (o.eval_every && o.eval_path == NULL) {
        fprintf(stderr, "ember train: --eval-every needs --eval (the held-out shards)\n");
        return 2;
    }
    if (o.rejoin && (o.resume || o.cluster_path == NULL || strcmp(o.role, "worker") != 0)) {
        fprintf(stderr, "ember train: --rejoin is for a cluster worker (--role worker), without "
                        "--resume\n");
        return 2;
    }
    char *err = NULL;
    struct stat st;
    /* The shallowest directory of --out that does not exist yet ("" when --out does): what a
     * failed run removes again, parents that cm_mkdirs made for it included. */
    char made[4200] = "", path[4200];
    snprintf(path, sizeof path, "%s", o.out_dir);
    for (bool up = true; up && stat(path, &st) != 0; up = train_path_parent(path))
        snprintf(made, sizeof made, "%s", path);
    train_result r;
    int rc = cm_mkdirs(o.out_dir, &err);
    if (rc == CM_OK) rc = train_run(&o, &r, &err);
    if (rc != CM_OK) {
        fprintf(stderr, "ember train: %s\n", err ? err : "failed");
        free(err);
        if (made[0] != '\0') {
            /* A run that failed before writing anything leaves no run directory behind (only
             * empty directories go: rmdir refuses the others). */
            const char *sub[] = {"ckpt", "logs"};
            for (int i = 0; i < 2; i++) {
                snprintf(path, sizeof path, "%s/%s", o.out_dir, sub[i]);
                rmdir(path);
            }
            snprintf(path, sizeof path, "%s", o.out_dir);
            for (bool up = true; up && strlen(path) >= strlen(made); up = train_path_parent(path))
                rmdir(path);
        }
        return 1;
    }
    const char *sig_name = r.stop_signal == SIGINT ? "SIGINT" : "SIGTERM";
    if (r.stopped_at != 0) {
        /* No JSON line: the run did not finish, and a script reading one must not take it for
         * a result. The status a shell gives a process the signal ended; a cluster worker
         * stopped by another's vote exits as if it had the SIGTERM a scheduler sends (the job
         * stopped, to be resumed), not 0 (done) nor 1 (failed). */
        if (r.stop_signal != 0)
            fprintf(stderr, "ember train: stopped by %s at step %" PRIu64, sig_name, r.stopped_at);
        else
            fprintf(stderr,
                    "ember train: stopped at step %" PRIu64 " (another process of the cluster "
                    "had SIGTERM or SIGINT)",
                    r.stopped_at);
        fprintf(stderr,
                ": checkpoint %s/ckpt/step-%" PRIu64 " written; --resume continues from it\n",
                o.out_dir, r.stopped_at);
        return 128 + (r.stop_signal != 0 ? r.stop_signal : SIGTERM);
    }
    if (o.cluster_path && strcmp(o.role, "worker") != 0 && r.stop_signal != 0) {
        /* A PS process that had a signal served on until worker 0 shut the cluster down. */
        fprintf(stderr, "ember train: %s %u: stopped by %s once worker 0 shut the cluster down\n",
                o.role, o.index, sig_name);
        return 128 + r.stop_signal;
    }
    if (o.cluster_path && strcmp(o.role, "worker") == 0 && o.index != 0) return 0;
    if (o.cluster_path && strcmp(o.role, "worker") != 0) return 0;
    char auc[32] = "null", logloss[32] = "null"; /* no --eval: nothing measured */
    if (o.eval_path) {
        if (!isnan(r.auc)) snprintf(auc, sizeof auc, "%.6f", r.auc); /* one class: undefined */
        snprintf(logloss, sizeof logloss, "%.6f", r.logloss);
    }
    printf(
        "{\"auc\":%s,\"logloss\":%s,\"samples_per_s\":%.1f,\"rows\":%" PRIu64
        ",\"seconds\":%.3f,\"steps\":%" PRIu64 ",\"eval_rows\":%" PRIu64
        ",\"eval_seconds\":%.3f,\"train_loss\":%.6f,\"model\":\"%s\",\"workers\":%u,\"shards\":%u"
        ",\"device\":\"%s\",\"cpu_kernels\":\"%s\",\"step_ms\":%.3f,\"wait_batch_ms\":%.3f"
        ",\"wait_push_ms\":%.3f,\"dense_ms\":%.3f,\"puller_early_ms\":%.3f,\"puller_push_ms\":%.3f"
        ",\"puller_late_ms\":%.3f,\"handover_ms\":%.3f}\n",
        auc, logloss, r.samples_per_s, r.rows, r.seconds, r.steps, r.eval_rows, r.eval_seconds,
        r.train_loss, model_kind_name(o.model.kind), r.workers, r.shards,
        r.device ? r.device : "cpu", backend_cpu_kernels(), r.step_ms, r.wait_batch_ms,
        r.wait_push_ms, r.dense_ms, r.puller_early_ms, r.puller_push_ms, r.puller_late_ms,
        r.handover_ms);
    return 0;
}
