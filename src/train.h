/*
 * ember train: the worker loop and its embedded or cluster deployment (private to src/).
 *
 * Worker loop: reader -> dedup the batch's keys -> pull the touched rows (and the dense
 * tower) -> forward/backward on the backend -> push row gradients and dense gradients. A
 * builder thread reads and stages batches ahead at a lower priority (dedup, keys in the PS
 * client's order, A's columns); a puller thread pulls batch t+1 as soon as batch t's pushes
 * are acknowledged, so every batch of a worker sees all of that worker's earlier updates (as
 * synchronous SGD does). The row push of batch t goes out once its row gradients are final
 * (model_batch.emb_ready), and t+1's rows are pulled while the step computes the dense
 * gradients; only t+1's dense tower waits for t's dense push, whose reply carries it (a lone
 * worker mirrors the tower, ps_client_dense_mirror: it applies the same update to its own copy
 * and does not wait for the PS; --no-dense-mirror turns that off, same bits). Only the
 * keys t+1 shares with t must wait for t's push at all (about a quarter of them on the bench
 * data): the rest are pulled while t computes, and each batch is pulled and pushed in those two
 * parts (two push calls, so a table's step advances by two a batch).
 * --stale-pull pulls t+1 during the compute of t as well: more overlap, but t+1 misses t's
 * update (one step stale), which costs some AUC.
 *
 * Deployment: with no cluster file the PS shards run inside the process (nng inproc://) and
 * the workers are threads, all through the same PS protocol as a cluster. With --cluster the
 * same code runs as one role (ps or worker) of a multi-process job.
 *
 * Schedule: every worker computes every worker's step count from the shard indexes, so all
 * agree on when to checkpoint (only at steps every worker passes: below the smallest count and,
 * in a resumed run, after the checkpoint's step, since a final checkpoint holds workers of
 * unequal counts at unequal positions) and, in synchronous mode, a worker that runs out of data
 * keeps clocking until the slowest is done. Step counts differ where the workers' blocks hold
 * different row counts; each epoch's last batch may be partial, and no row is dropped.
 *
 * Determinism: a one-worker run is bit-for-bit repeatable, and `--resume` reproduces the
 * uninterrupted run bit for bit. (With --stale-pull the pushes of batch t wait until t+1 is
 * pulled, so t+1 always sees exactly the updates up to t-1; a checkpoint re-pulls batch t+1
 * after the cut as a resumed run must, so resume is bitwise equal when both runs use the same
 * --checkpoint-every.)
 *
 * Evaluation: worker 0 computes the exact AUC and logloss over all the eval shards at the end
 * and, with --eval-every N, after every N of its steps, with read-only pulls (emb_table_lookup:
 * nothing created or marked touched) on a backend state of its own. A periodic evaluation is
 * taken at the same cut as a checkpoint (every push of the batches before it applied, the next
 * batch not yet pulled), so it gives what a run stopped at that step would, and the run's bits
 * are those of a run without it. Each evaluation appends a line with "auc" and "logloss" to
 * metrics.jsonl ("final": true for the last); the progress line shows the latest AUC, and its
 * samples/s leaves out the time spent evaluating. With several workers the progress lines'
 * "samples" are worker 0's rows times the worker count and "loss" is worker 0's (the other
 * workers may be other processes); the final JSON's rows and train_loss are every worker's.
 *
 * Run directory (--out): ckpt/step-<N>/ (PS shards, model.txt, run.txt: batch, shuffle, seed,
 * worker and shard counts, which --resume must match, worker-<i>.pos: the batches each worker
 * had consumed), ckpt/LATEST (atomically replaced once a checkpoint is complete,
 * so a crashed save never replaces a good one), metrics.jsonl, eval_predictions.txt, and for an
 * embedded run logs/train.log (start, progress, evaluations, the result or the error). Only the
 * newest --keep-checkpoints are kept. --resume continues from ckpt/LATEST (refused when the new
 * schedule ends at or before it; metrics.jsonl is first cut back to its step). A fresh run's
 * first checkpoint removes the checkpoints an earlier run left in the directory (kept until
 * then, so a fresh run that fails first leaves them as they were). The process running worker 0
 * holds RUNDIR/lock (flock): a second job into the same directory is refused.
 *
 * Stopping (embedded runs): the first SIGTERM or SIGINT fixes a step every worker of the process
 * reaches (three past the furthest, within the schedule), and each checkpoints there as
 * --checkpoint-every would, then exits (train_result.stopped_at; the CLI's status is 128 + the
 * signal). A one-worker run resumed from it ends with the bits of the run straight through. A
 * second signal stops the process at once.
 *
 * Stopping (cluster jobs with --checkpoint-every): the workers are separate processes, each
 * maybe at another step when the signals come, so they agree at a collective point: a worker
 * that had SIGTERM or SIGINT votes at the last barrier of its next periodic checkpoint (the one
 * after every worker wrote its files; ps_client_barrier_vote), and every worker learns there
 * whether any voted. All then stop after that checkpoint (worker 0 first completes it: swap,
 * LATEST) with no final checkpoint or evaluation, worker 0 shuts the cluster down as at a job's
 * end, and each exits 128 + its signal, or 143 (as if it had the SIGTERM a scheduler sends) one
 * that stopped because another voted. A PS or backup process that had a signal serves on until
 * that shutdown, then exits 128 + the signal. A signal after the last periodic checkpoint lets
 * the job finish (exit 0). A second signal stops a process at once. A cluster role started
 * with SIGINT ignored (a launcher script's background job) keeps it ignored: the launcher
 * passes a SIGTERM on. Without --checkpoint-every there is nothing to agree at: every role
 * keeps the default action, and --resume takes the last checkpoint there is.
 *
 * Worker restart (cluster mode): each worker keeps progress/worker-<i> in the run directory,
 * the batch it is about to compute, rewritten in place whenever none of its pushes is in
 * flight (so every earlier batch is applied on every shard). `--rejoin` restarts one worker
 * into the running job from that batch (else from its position in ckpt/LATEST, else from the
 * start), without loading anything and without waiting at the start barrier. Guarantee: no
 * batch is skipped; the batches after the last progress note up to the death (at most the
 * window of pushes then in flight, normally one batch) may be applied twice. Without
 * --worker-timeout the others wait for it at their next clock or barrier for --ps-timeout from
 * its death (ps_config.worker_lost_ms), then stop with an error naming it.
 */
#ifndef EMBER_SRC_TRAIN_H
#define EMBER_SRC_TRAIN_H

#include <stdint.h>

#include "ps/ps.h"
#include "src/model.h"

/* The largest --ttl: far beyond any run, and ttl x workers (PS_MAX_WORKERS at most) x 2 stays far
 * inside 64 bits. */
#define TRAIN_TTL_MAX (1ull << 40)
/* Checkpoints a run keeps by default, as TensorFlow's Saver does: a table's checkpoint is as
 * large as the table, and keeping every one fills a disk in a long run. */
#define TRAIN_KEEP_DEFAULT 5u

typedef struct train_opts {
    const char *train_path, *eval_path; /* shard directories or files */
    const char *out_dir;
    const char *config_path;  /* optional INI: [model], [train] */
    const char *cluster_path; /* optional: [cluster] ps = url,url...; workers = N */
    const char *role;         /* with cluster: "ps", "backup" or "worker" */
    uint32_t index;           /* role index */
    const char *device;       /* "cpu", "cuda", NULL = cuda when available */
    model_cfg model;          /* kind set by the caller; shape filled from the shards */
    int model_set;            /* model.kind given */
    uint32_t batch, epochs, workers, shards;
    uint32_t threads;           /* compute threads per worker */
    uint32_t keep_checkpoints;  /* newest checkpoints kept (TRAIN_KEEP_DEFAULT); 0 keeps all */
    uint32_t worker_timeout_ms; /* a silent worker stops holding back clocks and barriers */
    int32_t staleness;          /* -1 async */
    uint64_t ckpt_every, max_steps, shuffle_rows, seed, memory;
    uint64_t max_message; /* the PS messages' size limit; 0: what a batch needs (setup) */
    uint64_t resid_memory; /* bytes for each worker's int8 residuals (default
                              PS_RESID_MEMORY_DEFAULT); 0: no bound */
    uint32_t admit; /* a key's row is created once it was in this many batches (0, 1: at once) */
    uint64_t ttl;   /* a row no batch touched for this many of the job's steps is dropped (0:
                       never): ttl x workers x 2 pushes to its shard (ttl_steps; train.c) */
    uint64_t eval_every; /* worker 0 evaluates every N of its steps (needs eval_path); 0: at the
                            end only */
    uint32_t hidden_override, dim_override; /* 0 = preset */
    float emb_lr, dense_lr;
    emb_opt_kind emb_opt;
    ps_dense_opt dense_opt; /* the tower's optimizer on the PS (default Adam) */
    ps_codec push_codec;
    int mean_pool, resume, progress; /* progress: -1 auto (terminal) */
    int rejoin;                      /* cluster worker restarted into a running job */
    uint32_t ps_timeout_ms;          /* per PS request (0: the client's default, 30 s) */
    uint32_t apply_threads; /* per PS shard this process runs (ps_server_opts.apply_threads) */
    int stale_pull;   /* pull batch t+1 before batch t's push (more overlap, one step stale) */
    int tf32;         /* cuda: TF32 tensor-core GEMMs (BACKEND_TF32); the cpu ignores it */
    int bf16;         /* cpu: bf16 GEMMs on AMX tiles (BACKEND_BF16); cuda refuses it */
    int dense_mirror; /* 1 (default): a lone worker mirrors the tower (ps_client_dense_mirror) */
    /* Rows each embedding table is expected to reach over the whole job (all shards): the PS
     * tables are created that large (emb_table_config.reserve_rows) instead of doubling as rows
     * arrive. -1 (default): the ingest's distinct-key estimate from the stats.json next to the
     * training shards, plus 5%, or 0 without one; 0: start small. */
    int64_t expected_rows;
    /* The most distinct keys one batch may hold; the backends size their buffers by it (the
     * cuda backend's device memory: about 8 buffers of this many rows x dim floats, 1.05 GB
     * for 53,248 keys at dim 640 as measured on an H200). A batch
     * with more fails the run, naming the bound. 0 (default): batch x the most keys a row of
     * the data holds, from the train and eval shards' stats.json (ember ingest writes it);
     * where either lacks it, batch x fields x 8 + 1024 (multi-hot fields of 8 keys on
     * average). */
    uint32_t max_batch_keys;
} train_opts;
#define TRAIN_MAX_BATCH_KEYS_MAX (1u << 30)

void train_opts_init(train_opts *o);

/* Applies a config file's [model] and [train] sections to o. Every key must be under one of
 * them: a key before the first header is refused (CM_EINVAL, the file and line named), as in
 * ember ps's config and the cluster file. */
int train_config_load(const char *path, train_opts *o, char **errptr);

/* A cluster file (--cluster, docs/CLUSTER.md): [cluster] ps = URL, ... (shard i's PS is the
 * i-th); backups = URL, ... (one a shard, or none); workers = N; tls_cert, tls_key, tls_ca =
 * PEM files. Every role of a job reads the same file. */
typedef struct train_cluster {
    char **urls;    /* n_shards PS URLs */
    char **backups; /* NULL, or n_shards backup URLs (n_backups) */
    uint32_t n_shards, n_backups, n_workers;
    char tls_cert[sizeof((ps_config *)0)->tls_cert]; /* "" when not given */
    char tls_key[sizeof((ps_config *)0)->tls_key];
    char tls_ca[sizeof((ps_config *)0)->tls_ca];
} train_cluster;

/* Reads and checks a cluster file, starting nothing: everything train_run refuses of the file
 * itself is refused here, with the file (and line) named. On error c holds nothing to free. */
int train_cluster_load(const char *path, train_cluster *c, char **errptr);
void train_cluster_free(train_cluster *c);

typedef struct train_result {
    double auc, logloss, seconds, samples_per_s, train_loss;
    double eval_seconds; /* worker 0's time in evaluations, periodic and final (in seconds) */
    /* Worker 0's stepping thread, ms per step on average: in the backend's step, waiting for
     * the next batch to be pulled, waiting for the row push handed over at emb_ready, and in the
     * dense push after it (with the tower's read-back, or the mirror's update). Where a step's
     * time goes besides the compute, without a profiler. */
    double step_ms, wait_batch_ms, wait_push_ms, dense_ms;
    /* Its puller thread, ms per step: pulling the next batch's new keys before this batch's
     * push, running the row push handed over, pulling the rest of the next batch (and the
     * tower, where it is pulled). And the stepping thread's handing of batches to the backend
     * (a GPU: packing pinned memory, starting the copy). */
    double puller_early_ms, puller_push_ms, puller_late_ms, handover_ms;
    uint64_t rows, eval_rows, steps;
    uint32_t workers, shards; /* of the whole job (a cluster file may set them) */
    const char *device;       /* the backend that ran the dense math ("cpu", "cuda"); static */
    /* A run a SIGINT or SIGTERM stopped (stop_signal, its number; 0 for a cluster worker that
     * stopped because another voted): every worker checkpointed at step stopped_at (ckpt/LATEST
     * names it) and nothing else above is set but seconds. 0 otherwise. A PS role sets only
     * stop_signal, when it had one (it served until worker 0 shut the cluster down). */
    uint64_t stopped_at;
    int stop_signal;
} train_result;

/* The suffix of the directory a checkpoint is assembled in before it is swapped into place as
 * ckpt/step-<n> (by the trainer, or ember reshard); the trainer's pruning after each checkpoint
 * removes those an interrupted save left. */
#define TRAIN_CKPT_STAGING ".tmp"

/* A checkpoint's own files of each worker w: worker-<w>.pos, its data position (and kernels,
 * rows and summed loss), and worker-<w>.ef, its int8 error-feedback residuals
 * (ps_client_residuals_save; only from a run that pushes int8). */
typedef enum train_worker_file {
    TRAIN_WF_NONE = 0, /* none of them */
    TRAIN_WF_POS,
    TRAIN_WF_EF,
} train_worker_file;
/* Which of them name is, spelled exactly as the trainer writes it (*w gets w): a killed save's
 * worker-<w>.pos.tmp.<pid> is none. */
train_worker_file train_ckpt_worker_file(const char *name, uint32_t *w);

/* A checkpoint directory from `in`: in itself when it holds shard-0/, else the run directory's
 * ckpt/LATEST. *step is parsed from the "step-N" name; under another name it is worker 0's
 * position (worker-0.pos), else 0. A staging folder ("...<n>.tmp") is refused. */
int train_resolve_checkpoint(const char *in, char *out, size_t n, uint64_t *step, char **errptr);

/* Writes one probability per line ("%.9g"), atomically. */
int write_probs(const char *path, const float *p, uint64_t n, char **errptr);

/* Runs the whole job (embedded) or this process's role (cluster). */
int train_run(const train_opts *o, train_result *res, char **errptr);

#endif
