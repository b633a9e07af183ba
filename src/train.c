/* The training job; train.h explains the design. */
#include "src/train.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "datasets/datasets.h"
#include "src/metrics.h"

#define DENSE_BLOCK 0
/* An earlier run's metrics.jsonl while a fresh run has no checkpoint yet (metrics_set_aside). */
#define METRICS_PREV "metrics.jsonl.prev"

void train_opts_init(train_opts *o)
{
    memset(o, 0, sizeof *o);
    o->batch = 2048;
    o->epochs = 1;
    o->workers = 1;
    o->shards = 1;
    /* Compute threads: every core (the GEMMs and the pooling split by rows; the results are
     * the same bits for any count). */
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    o->threads = ncpu < 1 ? 1 : ncpu > 8 ? 8 : (uint32_t)ncpu;
    o->keep_checkpoints = TRAIN_KEEP_DEFAULT;
    o->staleness = -1;
    o->emb_lr = 0.05f;
    o->dense_lr = 0; /* the optimizer's default (setup_make) */
    o->emb_opt = EMB_OPT_ADAGRAD;
    o->push_codec = PS_CODEC_F32;
    o->progress = -1;
    o->seed = 1;
    o->model.kind = MODEL_MLP;
    o->expected_rows = -1;
    o->dense_mirror = 1;
    o->resid_memory = PS_RESID_MEMORY_DEFAULT;
}

/* ---- config file ---- */

/* Each section's keys, one list for the lookup and for the message that names them. */
enum { MK_KIND, MK_DIM, MK_HIDDEN, MK_BOTTOM, MK_SEED, MK_POOL, MK_N_ };
static const char *const model_keys[MK_N_] = {
    [MK_KIND] = "kind",     [MK_DIM] = "dim",   [MK_HIDDEN] = "hidden",
    [MK_BOTTOM] = "bottom", [MK_SEED] = "seed", [MK_POOL] = "pool"};

enum {
    RK_BATCH,
    RK_EPOCHS,
    RK_EMB_LR,
    RK_DENSE_LR,
    RK_EMB_OPTIMIZER,
    RK_DENSE_OPTIMIZER,
    RK_PUSH_CODEC,
    RK_MEMORY,
    RK_SHUFFLE,
    RK_STALENESS,
    RK_CHECKPOINT_EVERY,
    RK_EVAL_EVERY,
    RK_WORKER_TIMEOUT,
    RK_KEEP_CHECKPOINTS,
    RK_TF32,
    RK_BF16,
    RK_DENSE_MIRROR,
    RK_EXPECTED_ROWS,
    RK_MAX_MESSAGE,
    RK_RESID_MEMORY,
    RK_ADMIT,
    RK_TTL,
    RK_MAX_BATCH_KEYS,
    RK_N_
};
static const char *const train_keys[RK_N_] = {[RK_BATCH] = "batch",
                                              [RK_EPOCHS] = "epochs",
                                              [RK_EMB_LR] = "emb_lr",
                                              [RK_DENSE_LR] = "dense_lr",
                                              [RK_EMB_OPTIMIZER] = "emb_optimizer",
                                              [RK_DENSE_OPTIMIZER] = "dense_optimizer",
                                              [RK_PUSH_CODEC] = "push_codec",
                                              [RK_MEMORY] = "memory",
                                              [RK_SHUFFLE] = "shuffle",
                                              [RK_STALENESS] = "staleness",
                                              [RK_CHECKPOINT_EVERY] = "checkpoint_every",
                                              [RK_EVAL_EVERY] = "eval_every",
                                              [RK_WORKER_TIMEOUT] = "worker_timeout",
                                              [RK_KEEP_CHECKPOINTS] = "keep_checkpoints",
                                              [RK_TF32] = "tf32",
                                              [RK_BF16] = "bf16",
                                              [RK_DENSE_MIRROR] = "dense_mirror",
                                              [RK_EXPECTED_ROWS] = "expected_rows",
                                              [RK_MAX_MESSAGE] = "max_message",
                                              [RK_RESID_MEMORY] = "residual_memory",
                                              [RK_ADMIT] = "admit",
                                              [RK_TTL] = "ttl",
                                              [RK_MAX_BATCH_KEYS] = "max_batch_keys"};

static int train_entry(void *arg, int line, const char *section, const char *sarg, const char *k,
                       const char *v, char **errptr)
{
    train_opts *o = arg;
    (void)line; /* every check here can name its line at once: cm_ini_parse prefixes it */
    if (k == NULL)
        return (!strcmp(section, "model") || !strcmp(section, "train")) && !*sarg
                   ? CM_OK
                   : cm_ini_unknown_section(errptr, section, sarg, "model, train");
    /* A key above every header was read as [train]'s: "batch = 64" with its header forgotten
     * (or a [model] key written above [model]) then trained as if it were meant, or not at
     * all. It is refused, as ember ps's config and the cluster file refuse theirs. */
    if (!*section) return cm_ini_key_outside(errptr, k, "[model] or [train]");
    uint64_t u = 0;
    char *end = NULL;
    int bad = 0;
    if (!strcmp(section, "model")) {
        switch (cm_ini_key_find(k, model_keys, MK_N_)) {
        case MK_KIND:
            bad = model_kind_parse(v, &o->model.kind), o->model_set = !bad;
            break;
        case MK_DIM:
            bad = cm_parse_size(v, &u) || u == 0 || u > 1024, o->dim_override = (uint32_t)u;
            break;
        case MK_HIDDEN:
            bad = model_parse_widths(v, o->model.hidden, &o->model.n_hidden) || !o->model.n_hidden;
            o->hidden_override = 1;
            break;
        case MK_BOTTOM:
            bad = model_parse_widths(v, o->model.bottom, &o->model.n_bottom);
            break;
        case MK_SEED:
            bad = cm_parse_size(v, &o->model.seed);
            break;
        case MK_POOL:
            o->mean_pool = !strcmp(v, "mean"), bad = strcmp(v, "mean") && strcmp(v, "sum");
            break;
        default:
            return cm_ini_unknown_key(errptr, k, "[model]", model_keys, MK_N_);
        }
    } else {
        switch (cm_ini_key_find(k, train_keys, RK_N_)) {
        case RK_BATCH:
            bad = cm_parse_size(v, &u) || u == 0 || u > 1000000, o->batch = (uint32_t)u;
            break;
        case RK_EPOCHS:
            bad = cm_parse_size(v, &u) || u == 0 || u > 10000, o->epochs = (uint32_t)u;
            break;
        case RK_EMB_LR:
            o->emb_lr = strtof(v, &end), bad = *end || !(o->emb_lr > 0) || !isfinite(o->emb_lr);
            break;
        case RK_DENSE_LR:
            o->dense_lr = strtof(v, &end);
            bad = *end || !(o->dense_lr > 0) || !isfinite(o->dense_lr);
            break;
        case RK_EMB_OPTIMIZER:
            bad = emb_opt_parse(v, &o->emb_opt);
            break;
        case RK_DENSE_OPTIMIZER:
            bad = ps_dense_opt_parse(v, &o->dense_opt);
            break;
        case RK_PUSH_CODEC:
            bad = ps_codec_parse(v, &o->push_codec);
            break;
        case RK_MEMORY:
            bad = cm_parse_size(v, &o->memory);
            break;
        case RK_SHUFFLE:
            bad = cm_parse_size(v, &o->shuffle_rows);
            break;
        case RK_STALENESS: {
            long x = strtol(v, &end, 10);
            bad = *end || end == v || x < -1 || x > 1000000;
            o->staleness = (int32_t)x;
            break;
        }
        case RK_CHECKPOINT_EVERY:
            bad = cm_parse_size(v, &o->ckpt_every);
            break;
        case RK_EVAL_EVERY:
            bad = cm_parse_size(v, &o->eval_every);
            break;
        case RK_WORKER_TIMEOUT:
            bad = cm_parse_size(v, &u) || u > UINT32_MAX, o->worker_timeout_ms = (uint32_t)u;
            break;
        case RK_KEEP_CHECKPOINTS:
            bad = cm_parse_size(v, &u) || u > 100000, o->keep_checkpoints = (uint32_t)u;
            break;
        case RK_TF32:
            bad = cm_parse_size(v, &u) || u > 1, o->tf32 = (int)u;
            break;
        case RK_BF16:
            bad = cm_parse_size(v, &u) || u > 1, o->bf16 = (int)u;
            break;
        case RK_DENSE_MIRROR:
            bad = cm_parse_size(v, &u) || u > 1, o->dense_mirror = (int)u;
            break;
        case RK_EXPECTED_ROWS:
            bad = cm_parse_size(v, &u) || u > INT64_MAX, o->expected_rows = (int64_t)u;
            break;
        case RK_MAX_MESSAGE:
            bad = cm_parse_size(v, &o->max_message) || o->max_message < 4096;
            break;
        case RK_RESID_MEMORY:
            bad = cm_parse_size(v, &o->resid_memory);
            break;
        case RK_ADMIT:
            bad = cm_parse_size(v, &u) || u > UINT16_MAX, o->admit = (uint32_t)u;
            break;
        case RK_TTL:
            bad = cm_parse_size(v, &o->ttl) || o->ttl > TRAIN_TTL_MAX;
            break;
        case RK_MAX_BATCH_KEYS:
            bad = cm_parse_size(v, &u) || u > TRAIN_MAX_BATCH_KEYS_MAX,
            o->max_batch_keys = (uint32_t)u;
            break;
        default:
            return cm_ini_unknown_key(errptr, k, "[train]", train_keys, RK_N_);
        }
    }
    return bad ? cm_err(errptr, CM_EINVAL, "bad value '%s' for %s", v, k) : CM_OK;
}

int train_config_load(const char *path, train_opts *o, char **errptr)
{
    return cm_ini_parse(path, train_entry, o, errptr);
}

/* ---- the job's shared setup ---- */

typedef struct setup {
    const train_opts *o;
    ps_config ps;
    model_cfg m;
    model_layout l;
    const backend_ops *be;
    char **urls;
    uint32_t n_urls;
    char **backups; /* NULL, or n_urls URLs of the shards' backups */
    uint32_t n_backups;
    const char *train_paths[1], *eval_paths[1];
    uint64_t *steps_of; /* per worker: total steps */
    uint64_t min_steps, max_steps;
    uint64_t train_rows; /* rows of --train, all workers' parts */
    /* The most distinct keys a batch may have (setup_make: train_opts.max_batch_keys, else
     * batch x the data's most keys in a row, else a guess): the backends size their buffers by
     * it (the cuda backend's device memory grows with it times the dim). */
    uint32_t batch_keys;
    char ckpt_root[2048];
    uint64_t resume_step;
    FILE *metrics;       /* worker 0 */
    bool metrics_failed; /* a write to it failed, and was reported (metrics_flush) */
    FILE *log;     /* embedded runs: logs/train.log in the run directory (train_log) */
    int lock_fd;   /* RUNDIR/lock, held while this job's worker 0 runs here (run_lock) */
    bool locked;
    double t0;
    /* This process's workers, and the first of them to fail (-1: none): its error is the job's,
     * and the others' clients are aborted (job_abort). Under abort_mu. */
    struct worker *workers;
    uint32_t n_workers;
    int first_failed;
    pthread_mutex_t abort_mu;
    /* A stop a signal asked for (stop_after): the step every worker of this process stops at,
     * after a checkpoint there (UINT64_MAX: none; 0: asked too late, the run ends on its own).
     * Under stop_mu with each worker's done_steps; read atomically (stop_at) off it. */
    pthread_mutex_t stop_mu;
    uint64_t stop_at;
    bool pruned_foreign; /* worker 0: a fresh run's first checkpoint removed the older ones */
    double t_eval;       /* worker 0's seconds in evaluate(), left out of the samples/s it logs */
    /* When worker 0's loop began (its setup, connection and first pull done) and t_eval then:
     * the loop's own clock, the one a training-loop rate is measured on (loop_seconds). */
    double t_loop0, t_eval_loop0;
    double last_auc; /* worker 0's latest evaluation, NAN before the first */
} setup;

/* Whether the worker loop checkpoints once `steps` batches are done: every --checkpoint-every
 * steps short of the end (the end always checkpoints after the loop), and only at steps every
 * worker passes in this run: after the resumed checkpoint's step. Workers of unequal step
 * counts start a run resumed from a final checkpoint at different positions (each at its own
 * count, all at most the checkpoint's step), and a checkpoint is collective. */
static bool ckpt_after(const setup *S, uint64_t steps)
{
    uint64_t every = S->o->ckpt_every;
    uint64_t floor = S->o->resume ? S->resume_step : 0;
    return every && steps % every == 0 && steps > floor && steps < S->min_steps;
}

/* A cluster job without --checkpoint-every has no barrier its workers could vote to stop at
 * (checkpoint): they poll shard 0 every TRAIN_STOP_POLL steps instead (ps_client_stop_poll,
 * which never waits for the others), and a signal's stop is fixed at a later poll step that
 * every worker reaches, where they checkpoint together. 100 steps: a poll is a cut (the next
 * batch's pull waits for it, ~1-3 ms here), so ~0.3% of the loop, and a stop comes within
 * ~200 steps of the signal. */
#define TRAIN_STOP_POLL 100

/* Whether the worker polls for a stop once `steps` batches are done: at the multiples of
 * TRAIN_STOP_POLL every worker passes in this run, as ckpt_after's. */
static bool poll_after(const setup *S, uint64_t steps)
{
    uint64_t floor = S->o->resume ? S->resume_step : 0;
    return S->o->cluster_path && S->o->ckpt_every == 0 && steps % TRAIN_STOP_POLL == 0 &&
           steps > floor && steps < S->min_steps;
}

/* The log's descriptor for interrupt_note (-1: none): a signal handler may only write(2). */
static volatile sig_atomic_t log_fd_for_signal = -1;
/* The first SIGINT / SIGTERM the process got (0: none). An embedded run's workers stop at a step
 * they all reach, after a checkpoint there (stop_after); a cluster worker votes to stop at its
 * next periodic checkpoint's last barrier, and every worker stops after the first checkpoint
 * one voted at (checkpoint); a PS process serves on until worker 0 shuts the cluster down after
 * that checkpoint. As a scheduler's preemption or a Ctrl-C asks: without it a run lost
 * everything since its last checkpoint. */
static int stop_signal; /* read and written with __atomic (lock-free: safe in a handler) */
/* What interrupt_note says at the first signal (stop_on_signal sets it before installing). */
static const char *stop_note;

/* SIGINT / SIGTERM: the first asks for a stop after a checkpoint (stop_note says how); a second
 * stops the process at once (a last line in train.log, then the default action: the
 * checkpoints are atomic, so the last complete one is what --resume takes). */
static void interrupt_note(int sig)
{
    static const char text[] = "[ interrupted] stopped by a signal (SIGINT or SIGTERM): --resume "
                               "continues from ckpt/LATEST\n";
    const bool first = __atomic_load_n(&stop_signal, __ATOMIC_RELAXED) == 0;
    const char *note = __atomic_load_n(&stop_note, __ATOMIC_RELAXED);
    const char *t = first ? note : text;
    size_t n = first ? strlen(note) : sizeof text - 1;
    if (log_fd_for_signal >= 0 && write(log_fd_for_signal, t, n) < 0) {
        /* nothing left to tell */
    }
    if (write(STDERR_FILENO, t, n) < 0) {
        /* likewise */
    }
    if (first) {
        __atomic_store_n(&stop_signal, sig, __ATOMIC_RELAXED);
        return;
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

/* Installs interrupt_note for SIGINT and SIGTERM, whose first signal then says `note`. A
 * cluster role (cluster) whose SIGINT was ignored when it started keeps ignoring it: it is a
 * background job of a launcher's script, and a Ctrl-C at the terminal reaches the launcher,
 * which passes a SIGTERM on; caught here too, it would be the second signal, which stops the
 * process at once. */
static void stop_on_signal(const char *note, bool cluster)
{
    struct sigaction old;
    __atomic_store_n(&stop_note, note, __ATOMIC_RELAXED);
    if (!cluster || sigaction(SIGINT, NULL, &old) != 0 || old.sa_handler != SIG_IGN)
        signal(SIGINT, interrupt_note);
    signal(SIGTERM, interrupt_note);
}

/* Once the final checkpoint is written only worker 0's evaluation is left, and a first signal
 * has nothing to stop: its note says that the run finishes (before, it promised a checkpoint
 * and an exit that never came, and the run ended as usual). */
static void stop_note_finishing(void)
{
    __atomic_store_n(&stop_note,
                     "[ finishing] signal: the training is done and its last checkpoint written; "
                     "the final evaluation finishes and the run ends as usual (a second signal "
                     "stops at once)\n",
                     __ATOMIC_RELAXED);
}

/* A line in the run's own log (embedded runs, where no launcher keeps the output), stamped with
 * the seconds since the start. */
static void train_log(const setup *S, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void train_log(const setup *S, const char *fmt, ...)
{
    if (S->log == NULL) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(S->log, "[%9.3f] ", cm_now() - S->t0);
    vfprintf(S->log, fmt, ap);
    va_end(ap);
    fputc('\n', S->log);
    fflush(S->log);
}

/* Flushes the run's metrics lines (worker 0's thread only). One that cannot be written (a full
 * disk, say) does not end the run, whose result and checkpoints are what a run is for, but it is
 * said once, on stderr and in the log, rather than lost without a word: a plot of the run would
 * otherwise just stop. */
static void metrics_flush(setup *S)
{
    if (fflush(S->metrics) == 0 && !ferror(S->metrics)) return;
    int e = errno;
    if (S->metrics_failed) return;
    S->metrics_failed = true;
    fprintf(stderr,
            "ember train: warning: cannot write %s/metrics.jsonl: %s; its later lines are lost\n",
            S->o->out_dir, strerror(e));
    train_log(S, "warning: cannot write metrics.jsonl: %s; its later lines are lost", strerror(e));
}

/* Whether worker w evaluates once `steps` batches are done: worker 0, every --eval-every steps
 * short of its end (the end always evaluates after the loop). */
static bool eval_after(const setup *S, uint32_t w, uint64_t steps)
{
    uint64_t every = S->o->eval_every;
    return w == 0 && every && steps % every == 0 && steps < S->steps_of[0];
}

/* Whether the model is read once `steps` batches are done (a checkpoint, an evaluation): the
 * next batch's pull must not create its rows before that. */
/* The step a signal's stop was fixed at (setup.stop_at). */
static uint64_t stop_step(const setup *S)
{
    return __atomic_load_n(&S->stop_at, __ATOMIC_ACQUIRE);
}

static bool cut_after(const setup *S, uint32_t w, uint64_t steps)
{
    return ckpt_after(S, steps) || poll_after(S, steps) || eval_after(S, w, steps) ||
           steps == stop_step(S);
}

/* ---- batches in the model's layout ---- */

typedef struct stage {
    int status; /* 1 batch, 0 end of data, < 0 error */
    model_staging ms;
    float *params;
    uint64_t ticket; /* what the backend's prefetch returned for this batch (model.h) */
    uint32_t *perm, *pos, cap_order; /* stage_order's scratch */
    uint64_t *okeys;
    /* ukeys[0, n_new) are keys the worker's batch before did not have, [n_new, U) keys it had
     * (stage_order): only the second part must wait for that batch's push (pull_stage). */
    uint32_t n_new;
    bool new_pulled; /* rows [0, n_new) are pulled already */
    bool begun;      /* handed to the backend but for the rest of its rows (prefetch_begin) */
} stage;

static void stage_free(stage *s)
{
    model_staging_fini(&s->ms);
    free(s->params);
    free(s->perm);
    free(s->pos);
    free(s->okeys);
    memset(s, 0, sizeof *s);
}

/* Puts the stage's distinct keys in the order the PS client sends them (ps_keys_order), so
 * the pull and the push skip their sort, merge and scatter on the critical path, in two parts:
 * first the keys `prev` (the batch before, or NULL) did not have, then those it had; a part of
 * an ordered list is ordered too. The CSR columns follow. Nothing computed depends on this
 * order: pooling sums a sample's entries in CSR order, and each row gradient sums its entries
 * in sample order. */
static int stage_order(stage *s, const setup *S, const model_staging *prev, char **errptr)
{
    model_staging *m = &s->ms;
    if (m->U > s->cap_order) {
        free(s->perm);
        free(s->pos);
        free(s->okeys);
        s->perm = malloc(m->U * sizeof *s->perm);
        s->pos = malloc(m->U * sizeof *s->pos);
        s->okeys = malloc(m->U * sizeof *s->okeys);
        s->cap_order = m->U;
        if (!s->perm || !s->pos || !s->okeys) {
            s->cap_order = 0;
            return cm_err(errptr, CM_ENOMEM, "out of memory");
        }
    }
    int rc = ps_keys_order(S->ps.n_shards, m->ukeys, m->U, s->perm, errptr);
    if (rc != CM_OK) return rc;
    /* pos[k] first says whether prev had key k, then where key k goes. */
    if (prev != NULL)
        model_staging_seen(prev, m->ukeys, m->U, s->pos);
    else
        memset(s->pos, 0, m->U * sizeof *s->pos);
    uint32_t n_new = 0;
    for (uint32_t k = 0; k < m->U; k++)
        n_new += !s->pos[k];
    for (uint32_t i = 0, at_new = 0, at_old = n_new; i < m->U; i++) {
        uint32_t k = s->perm[i], j = s->pos[k] ? at_old++ : at_new++;
        s->okeys[j] = m->ukeys[k];
        s->pos[k] = j;
    }
    s->n_new = n_new;
    s->new_pulled = false;
    s->begun = false;
    memcpy(m->ukeys, s->okeys, m->U * sizeof *m->ukeys);
    for (uint32_t k = 0; k < m->nnz; k++)
        m->col[k] = s->pos[m->col[k]];
    return CM_OK;
}

/* Copies a reader batch into the model layout and deduplicates its keys. */
static int stage_keys(stage *s, const setup *S, const ds_batch *b, char **errptr)
{
    model_input in = {b->n_rows, b->n_dense, b->n_fields, b->labels,
                      b->dense,  b->offsets, b->keys,     b->weights};
    int rc = model_staging_build(&s->ms, &S->m, &S->l, S->o->mean_pool, &in, errptr);
    if (rc == CM_OK && s->ms.U > S->batch_keys)
        rc = cm_err(errptr, CM_EINVAL,
                    "a batch of %u rows has %u distinct keys, more than the bound of %u "
                    "(--max-batch-keys / [train] max_batch_keys)",
                    s->ms.B, s->ms.U, S->batch_keys);
    return rc;
}

/* stage_keys, then the order its keys are pulled and pushed in; prev: the batch before it
 * (stage_order), or NULL. For the backend be steps on: A's columns, for a backward
 * step (bwd) on a backend that reads them (backend_ops.columns), and the batch's units where
 * it takes them (backend_ops.max_units), so its stepping thread need not walk the batch. */
static int stage_build(stage *s, const setup *S, const ds_batch *b, const model_staging *prev,
                       void *be, bool bwd, char **errptr)
{
    if (s->params == NULL && (s->params = malloc(S->l.n_params * sizeof(float) + 1)) == NULL)
        return cm_err(errptr, CM_ENOMEM, "out of memory");
    int rc = stage_keys(s, S, b, errptr);
    if (rc == CM_OK) rc = stage_order(s, S, prev, errptr);
    const bool columns = bwd && (S->be->columns == NULL || S->be->columns(be));
    if (rc == CM_OK && columns) rc = model_staging_index(&s->ms, errptr);
    const uint32_t mu = S->be->max_units ? S->be->max_units(be, s->ms.B, s->ms.F) : 0;
    if (rc == CM_OK && mu > 0) rc = model_staging_units(&s->ms, mu, errptr);
    return rc;
}

/* Pulls the rows of the stage's keys [lo, hi); for evaluation read only (lookup), so unseen
 * keys read as zeros exactly as in a serving bundle. */
static int stage_pull_part(stage *s, const setup *S, ps_client *c, bool lookup, uint32_t lo,
                           uint32_t hi, char **errptr)
{
    int rc = CM_OK;
    const model_staging *m = &s->ms;
    for (uint32_t t = 0; t < S->l.n_tables && rc == CM_OK && hi > lo; t++) {
        float *out = m->emb[t] + (size_t)lo * S->l.table_dim[t];
        rc = lookup ? ps_client_lookup(c, t, m->ukeys + lo, hi - lo, out, errptr)
                    : ps_client_pull(c, t, m->ukeys + lo, hi - lo, out, errptr);
    }
    return rc;
}

/* Pulls the stage's rows not pulled yet: both parts (stage_order), each one pull the push
 * names later (key elision). */
static int stage_pull_rows(stage *s, const setup *S, ps_client *c, bool lookup, char **errptr)
{
    int rc = s->new_pulled ? CM_OK : stage_pull_part(s, S, c, lookup, 0, s->n_new, errptr);
    return rc == CM_OK ? stage_pull_part(s, S, c, lookup, s->n_new, s->ms.U, errptr) : rc;
}

static int stage_pull_dense(stage *s, const setup *S, ps_client *c, char **errptr)
{
    return S->l.n_params > 0 ? ps_client_dense_pull(c, DENSE_BLOCK, s->params, errptr) : CM_OK;
}

/* The stage's rows and the dense tower. */
static int stage_pull(stage *s, const setup *S, ps_client *c, bool lookup, char **errptr)
{
    int rc = stage_pull_rows(s, S, c, lookup, errptr);
    return rc == CM_OK ? stage_pull_dense(s, S, c, errptr) : rc;
}

/* The push calls a table gets from one worker's step (push_rows), which --ttl counts in. */
#define TRAIN_PUSH_PARTS 2u

/* Pushes a stepped stage's row gradients (demb[t]: U x dim_t) in the two parts it was pulled
 * in (each names its pull: key elision). The second goes out once the first is applied: the
 * PS serves requests on many contexts at once, and each push call advances a table's step, so
 * two pushes in flight together could stamp their rows' last_step in either order. */
static int push_rows(const setup *S, ps_client *c, const stage *s, float *const *demb,
                     char **errptr)
{
    int rc = CM_OK;
    const model_staging *m = &s->ms;
    const uint32_t cut[3] = {0, s->n_new, m->U};
    for (int part = 0; part < 2 && rc == CM_OK; part++) {
        if (cut[part + 1] == cut[part]) continue;
        if (part == 1 && cut[1] > 0) rc = ps_client_flush(c, errptr);
        for (uint32_t t = 0; t < S->l.n_tables && rc == CM_OK; t++) {
            size_t off = (size_t)cut[part] * S->l.table_dim[t];
            rc = ps_client_push(c, t, m->ukeys + cut[part], cut[part + 1] - cut[part],
                                demb[t] + off, errptr);
        }
    }
    return rc;
}

/* Hands the pulled stage to the backend, which may start moving it to the device now (the
 * cuda backend copies it while the current step computes). It reads the stage only during
 * the call, so a later re-pull needs just another call. */
static int stage_send(stage *s, const setup *S, void *be, char **errptr)
{
    model_batch mb;
    model_staging_view(&s->ms, &mb);
    s->ticket = 0;
    const bool begun = s->begun;
    s->begun = false;
    return begun ? S->be->prefetch_end(be, s->params, &mb, &s->ticket, errptr)
                 : S->be->prefetch(be, s->params, &mb, &s->ticket, errptr);
}

/* Hands the backend all of a built stage but its params and rows (which the puller may be
 * pulling meanwhile), where it takes batches in two calls: stage_send then adds those. */
static int stage_begin(stage *s, const setup *S, void *be, char **errptr)
{
    s->begun = false;
    if (S->be->prefetch_begin == NULL) return CM_OK;
    model_batch mb;
    model_staging_view(&s->ms, &mb);
    int rc = S->be->prefetch_begin(be, &mb, 0, errptr);
    s->begun = rc == CM_OK;
    return rc;
}

/* ---- prefetch: builds and pulls batch t+1 while t computes ---- */

/*
 * Two threads fill a ring of stages ahead of the stepping thread. The builder reads and stages
 * batches (dedup, key order, A's columns) as background work (cm_thread_background), so that
 * work fills the moments the compute leaves a core idle instead of slowing its GEMMs. The puller
 * pulls each built stage; the stepping thread hands stages to the backend, so the puller (on a
 * GPU the busiest thread) only pulls and pushes: where the backend takes a batch in two calls,
 * it hands over the next batch but for its rows and params right after a step, while it would
 * wait for the push anyway, and the rest when it takes that batch.
 *
 * With fresh pulls batch t+1 must see batch t's updates, so its pull waits for t's pushes.
 * To keep that wait short the step hands its row push over as soon as the row gradients are
 * final (model_batch.emb_ready): the puller pushes them and pulls t+1's rows while the
 * stepping thread computes the dense gradients; t+1's dense tower is the reply to t's dense
 * push (ps_client_dense_push_pull: no second round trip; under a staleness bound it is pulled
 * after the clock instead). The PS applies the same updates in the same order either way, so
 * results are the same bits. Not on steps followed by a checkpoint or an evaluation (the cut
 * must come before t+1's pull creates rows) or with a staleness bound (t+1's pull must wait for the
 * clock).
 */
enum { JOB_NONE, JOB_HANDED, JOB_TAKEN, JOB_DONE };
/* A stage's life: built, pulled, taken by the stepping thread, released. */
enum { ST_FREE, ST_BUILT, ST_READY, ST_TAKEN };
#define N_STAGES 4

typedef struct prefetch {
    const setup *S;
    ds_reader *r;
    ps_client *c;
    void *be; /* the worker's backend: the puller hands it each stage (stage_send) */
    stage st[N_STAGES];
    int state[N_STAGES];                  /* ST_* */
    int next_build, next_pull, next_take; /* ring positions */
    bool stop;
    uint64_t left;  /* batches still to build: nothing is read past the schedule */
    uint64_t built; /* batches built (builder only) */
    bool prev_ok;   /* the stage before next_build holds the batch before it (builder only) */
    uint64_t first; /* the worker's step of the first batch */
    uint32_t worker;
    uint64_t pulled, granted; /* batches pulled; batches allowed to pull rows (fresh pulls) */
    uint64_t dense_granted;   /* batches allowed to pull the dense tower */
    /* The tower as the stepping thread's dense push read it back (ps_client_dense_push_pull):
     * the next stage takes it instead of pulling it (fresh_ok: not taken yet). NULL where the
     * next stage pulls it (stale pulls, a staleness bound, no tower). */
    float *fresh;
    bool fresh_ok;
    int job; /* JOB_*: the row push handed over by the stepping thread */
    const stage *job_stage;
    float *const *job_demb;
    int job_rc;
    char *job_err;
    bool exited; /* the puller has returned: it takes no more jobs */
    /* The puller's seconds: pulling new keys early, running handed-over pushes, pulling the
     * rest (and the tower) (train_result's puller_*_ms). */
    double t_early, t_push, t_late;
    char *err;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t builder, puller;
    bool builder_started, puller_started;
} prefetch;

/* Waits (p->mu held) until `ok` or stop; returns !stop. */
#define PF_WAIT(p, ok)                                                                             \
    ({                                                                                             \
        while (!(ok) && !(p)->stop)                                                                \
            pthread_cond_wait(&(p)->cv, &(p)->mu);                                                 \
        !(p)->stop;                                                                                \
    })

/* Moves stage i on to `state` and the ring position *next past it; the first failed stage's
 * message is kept (taken from *err). */
static void pf_advance(prefetch *p, int i, int state, int *next, char **err)
{
    pthread_mutex_lock(&p->mu);
    if (p->st[i].status < 0 && p->err == NULL) p->err = *err, *err = NULL;
    p->state[i] = state;
    *next = (i + 1) % N_STAGES;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void *builder_main(void *arg)
{
    prefetch *p = arg;
    cm_thread_background();
    for (;;) {
        pthread_mutex_lock(&p->mu);
        int i = p->next_build;
        bool go = PF_WAIT(p, p->state[i] == ST_FREE);
        pthread_mutex_unlock(&p->mu);
        if (!go) break;
        stage *s = &p->st[i];
        const ds_batch *b = NULL;
        char *err = NULL;
        int got = p->left == 0 ? 0 : ds_reader_next(p->r, &b, &err), rc = got < 0 ? got : CM_OK;
        if (got == 1) p->left--;
        /* The stage before holds the batch before (built by this thread, rebuilt by no other). */
        const stage *prev = &p->st[(i + N_STAGES - 1) % N_STAGES];
        if (got == 1)
            rc = stage_build(s, p->S, b, p->prev_ok ? &prev->ms : NULL, p->be, true, &err);
        p->built += got == 1 && rc == CM_OK;
        p->prev_ok = got == 1 && rc == CM_OK;
        s->status = rc != CM_OK ? rc : got;
        pf_advance(p, i, ST_BUILT, &p->next_build, &err);
        free(err);
        if (s->status <= 0) break;
    }
    return NULL;
}

/* Stages pulled and not yet released (the backend holds at most two: model.h). */
static int pf_pending(const prefetch *p)
{
    int n = 0;
    for (int i = 0; i < N_STAGES; i++)
        n += p->state[i] == ST_READY || p->state[i] == ST_TAKEN;
    return n;
}

/* Whether the next batch's new keys (stage_order) may be pulled before the batch before it
 * is pushed: that push leaves their rows unchanged, and the batch before that is applied
 * (this client's pulls wait for its pushes in flight). Not under a staleness bound (the pull
 * waits for the clock) nor across a checkpoint or an evaluation (cut_after: the cut comes before
 * the batch's pull creates rows). The puller pulls them before it takes that push, so the PS sees
 * the same order on every run. */
static bool early_pull_ok(const prefetch *p)
{
    uint64_t step = p->first + p->pulled;
    return p->S->o->staleness < 0 && !(step > p->first && cut_after(p->S, p->worker, step));
}

/* Pulls stage s under the fresh-pull protocol (design note above), running a handed-over push
 * first. *stopped: prefetch_stop interrupted it. */
static int pull_stage(prefetch *p, stage *s, bool *stopped, char **err)
{
    int rc = CM_OK;
    double t0 = cm_now();
    if (early_pull_ok(p)) {
        rc = stage_pull_part(s, p->S, p->c, false, 0, s->n_new, err);
        s->new_pulled = rc == CM_OK;
    }
    p->t_early += cm_now() - t0;
    pthread_mutex_lock(&p->mu);
    bool go = PF_WAIT(p, p->pulled < p->granted);
    bool job = go && p->job == JOB_HANDED;
    if (job) p->job = JOB_TAKEN;
    pthread_mutex_unlock(&p->mu);
    if ((*stopped = !go)) return CM_OK;
    if (job) {
        char *jerr = NULL;
        t0 = cm_now();
        int jrc = push_rows(p->S, p->c, p->job_stage, p->job_demb, &jerr);
        p->t_push += cm_now() - t0;
        if (jrc != CM_OK) rc = cm_err(err, jrc, "%s", jerr ? jerr : "push failed");
        pthread_mutex_lock(&p->mu);
        p->job = JOB_DONE;
        p->job_rc = jrc;
        p->job_err = jerr;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    t0 = cm_now();
    if (rc == CM_OK) rc = stage_pull_rows(s, p->S, p->c, false, err);
    p->t_late += cm_now() - t0;
    /* The step computing the dense gradients meanwhile may take this core back. */
    if (job && p->S->be->join) p->S->be->join(p->be);
    pthread_mutex_lock(&p->mu);
    go = PF_WAIT(p, p->pulled < p->dense_granted);
    bool fresh = go && p->fresh_ok;
    if (fresh) { /* the buffers trade places: no copy */
        float *t = s->params;
        s->params = p->fresh;
        p->fresh = t;
        p->fresh_ok = false;
    }
    pthread_mutex_unlock(&p->mu);
    if ((*stopped = !go)) return rc;
    t0 = cm_now();
    if (rc == CM_OK && !fresh) rc = stage_pull_dense(s, p->S, p->c, err);
    p->t_late += cm_now() - t0;
    p->pulled++;
    return rc;
}

static void *puller_main(void *arg)
{
    prefetch *p = arg;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        int i = p->next_pull;
        bool go = PF_WAIT(p, p->state[i] == ST_BUILT && pf_pending(p) < 2);
        pthread_mutex_unlock(&p->mu);
        if (!go) break;
        stage *s = &p->st[i];
        char *err = NULL;
        bool stopped = false;
        int rc = s->status == 1 ? pull_stage(p, s, &stopped, &err) : CM_OK;
        if (stopped) {
            free(err);
            break;
        }
        if (rc != CM_OK) s->status = rc;
        pf_advance(p, i, ST_READY, &p->next_pull, &err);
        free(err);
        if (s->status <= 0) break;
    }
    pthread_mutex_lock(&p->mu);
    p->exited = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void prefetch_stop(prefetch *p);

/* before: the batch before `first` (a resumed or rejoined worker's last skipped one), or NULL. */
static int prefetch_start(prefetch *p, const setup *S, ds_reader *r, ps_client *c, void *be,
                          uint32_t worker, uint64_t first, uint64_t left, const ds_batch *before,
                          char **errptr)
{
    memset(p, 0, sizeof *p);
    p->first = first;
    p->worker = worker;
    p->left = left;
    p->granted = p->dense_granted = S->o->stale_pull ? UINT64_MAX : 1;
    p->S = S;
    p->r = r;
    p->c = c;
    p->be = be;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    /* The first batch's keys are split against the batch before it, as they were in a run that
     * did not stop there: each part is its own push, and every push advances the tables' step
     * (the rows' last_step), so without that a resumed run's tables were one step behind the
     * straight run's for every restart. */
    if (before != NULL) {
        int rc = stage_keys(&p->st[N_STAGES - 1], S, before, errptr);
        if (rc != CM_OK) {
            prefetch_stop(p);
            return rc;
        }
        p->prev_ok = true;
    }
    /* Asynchronous fresh pulls take the tower from the dense push's reply (with a staleness
     * bound the next batch must see the clock's updates, so it pulls). */
    if (!S->o->stale_pull && S->o->staleness < 0 && S->l.n_params > 0 &&
        (p->fresh = malloc(S->l.n_params * sizeof(float))) == NULL) {
        prefetch_stop(p);
        return cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    /* A lone worker is the tower's only writer: it mirrors the block, so that the next step
     * starts as soon as this one's update is applied here, not after the PS's round trip
     * (about 10% of a step over ipc). The same bits either way (ps.h). */
    if (p->fresh != NULL && S->o->workers == 1 && S->o->dense_mirror) {
        int rc = ps_client_dense_mirror(c, DENSE_BLOCK, errptr);
        if (rc != CM_OK) {
            prefetch_stop(p);
            return rc;
        }
    }
    p->builder_started = pthread_create(&p->builder, NULL, builder_main, p) == 0;
    p->puller_started = p->builder_started && pthread_create(&p->puller, NULL, puller_main, p) == 0;
    if (!p->puller_started) {
        prefetch_stop(p);
        return cm_err(errptr, CM_ERR, "cannot start the prefetch threads");
    }
    return CM_OK;
}

/* The next ready stage (status 1), or NULL at the end (*rc 0) or on error (*rc < 0). */
static stage *prefetch_take(prefetch *p, int *rc, char **errptr)
{
    pthread_mutex_lock(&p->mu);
    int i = p->next_take;
    while (p->state[i] != ST_READY)
        pthread_cond_wait(&p->cv, &p->mu);
    p->state[i] = ST_TAKEN;
    stage *s = &p->st[i];
    *rc = s->status > 0 ? CM_OK : s->status;
    if (s->status < 0) cm_err(errptr, s->status, "%s", p->err ? p->err : "prefetch failed");
    pthread_mutex_unlock(&p->mu);
    return s->status > 0 ? s : NULL;
}

/* The stage after the taken one when it is built (its batch, not its rows: the puller may be
 * pulling them), else NULL. Its batch arrays do not change until it is released. */
static stage *prefetch_next_built(prefetch *p)
{
    pthread_mutex_lock(&p->mu);
    int i = (p->next_take + 1) % N_STAGES;
    stage *s = (p->state[i] == ST_BUILT || p->state[i] == ST_READY) && p->st[i].status == 1
                   ? &p->st[i]
                   : NULL;
    pthread_mutex_unlock(&p->mu);
    return s;
}

/* Gives the taken stage back for refilling. */
static void prefetch_release(prefetch *p)
{
    char *none = NULL; /* a taken stage had status 1 */
    pf_advance(p, p->next_take, ST_FREE, &p->next_take, &none);
}

/* Allows the next batch to be pulled (fresh pulls: called once this batch is pushed); its
 * rows only if the step's emb_ready hook has not allowed them already; its tower from
 * p->fresh when fresh (the push read it back). */
static void prefetch_grant(prefetch *p, bool rows_granted, bool fresh)
{
    pthread_mutex_lock(&p->mu);
    if (p->granted != UINT64_MAX && !rows_granted) p->granted++;
    if (p->dense_granted != UINT64_MAX) p->dense_granted++;
    p->fresh_ok = fresh;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* model_batch.emb_ready of a stepped stage (p->job_ms, p->job_demb set before the step): hands
 * its row push to the puller and lets the next batch's rows be pulled after it. */
static void prefetch_emb_ready(void *arg)
{
    prefetch *p = arg;
    pthread_mutex_lock(&p->mu);
    p->job = JOB_HANDED;
    if (p->granted != UINT64_MAX) p->granted++;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* After a step that may have handed over its row push: waits until the push is sent.
 * *handed: the hook ran (the next batch's rows are granted already); *done: the puller
 * pushed (else nothing was handed, or the puller had ended and took no job: the caller
 * pushes). Returns the push's error. */
static int prefetch_job_wait(prefetch *p, bool *handed, bool *done, char **errptr)
{
    int rc = CM_OK;
    pthread_mutex_lock(&p->mu);
    *handed = p->job != JOB_NONE;
    while (p->job == JOB_TAKEN || (p->job == JOB_HANDED && !p->exited))
        pthread_cond_wait(&p->cv, &p->mu);
    *done = p->job == JOB_DONE;
    if (*done && p->job_rc != CM_OK)
        rc = cm_err(errptr, p->job_rc, "%s", p->job_err ? p->job_err : "push failed");
    free(p->job_err);
    p->job_err = NULL;
    p->job = JOB_NONE;
    pthread_mutex_unlock(&p->mu);
    return rc;
}

/* Waits until the stage after the one taken is pulled (or the prefetcher has stopped). */
static void prefetch_wait_next(prefetch *p)
{
    pthread_mutex_lock(&p->mu);
    int i = (p->next_take + 1) % N_STAGES;
    while (p->state[i] != ST_READY)
        pthread_cond_wait(&p->cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

/* Pulls the stage after the one taken again, so it reflects every update applied so far, and
 * hands it to the backend again (the puller is idle until the release: two stages are
 * pending, so this thread may call prefetch now). */
static int prefetch_refresh(prefetch *p, char **errptr)
{
    prefetch_wait_next(p);
    stage *s = &p->st[(p->next_take + 1) % N_STAGES];
    if (s->status <= 0) return CM_OK;
    s->new_pulled = false;
    int rc = stage_pull(s, p->S, p->c, false, errptr);
    return rc == CM_OK ? stage_send(s, p->S, p->be, errptr) : rc;
}

static void prefetch_stop(prefetch *p)
{
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    if (p->puller_started) pthread_join(p->puller, NULL);
    if (p->builder_started) pthread_join(p->builder, NULL);
    for (int i = 0; i < N_STAGES; i++)
        stage_free(&p->st[i]);
    free(p->err);
    free(p->job_err);
    free(p->fresh);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
}

/* ---- readers ---- */

static int reader_open(const setup *S, const char *path, uint32_t worker, uint32_t n_workers,
                       uint32_t epochs, uint64_t shuffle, ds_reader **out, char **errptr)
{
    ds_reader_opts ro;
    ds_reader_opts_init(&ro);
    const char *paths[1] = {path};
    ro.paths = paths;
    ro.n_paths = 1;
    ro.batch_size = S->o->batch;
    ro.worker = worker;
    ro.n_workers = n_workers;
    ro.n_epochs = epochs;
    ro.shuffle_rows = shuffle;
    ro.seed = S->o->seed;
    ro.background = true; /* as the builder */
    return ds_reader_open(&ro, out, errptr);
}

/* ---- evaluation ---- */

int write_probs(const char *path, const float *p, uint64_t n, char **errptr)
{
    char *buf = malloc(n * 20 + 1);
    if (buf == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    size_t len = 0;
    for (uint64_t i = 0; i < n; i++)
        len += (size_t)snprintf(buf + len, 20, "%.9g\n", (double)p[i]);
    int rc = cm_write_file_atomic(path, buf, len, errptr);
    free(buf);
    return rc;
}

/* Exact AUC and logloss of the model as the PS holds it now over all the eval shards, with
 * read-only pulls (nothing is created or marked touched, so training is not disturbed: a run
 * with --eval-every is bit-for-bit the run without). `be` is a backend state no prefetch is
 * pending on. Worker 0 only: the result goes to metrics.jsonl (tagged with the step) and
 * S->last_auc, and with `final` the probabilities to eval_predictions.txt. */
static int evaluate(setup *S, ps_client *c, void *be, uint64_t step, bool final, train_result *res,
                    char **errptr)
{
    double t0 = cm_now();
    ds_reader *r = NULL;
    int rc = reader_open(S, S->o->eval_path, 0, 1, 1, 0, &r, errptr);
    if (rc != CM_OK) return rc;
    uint64_t rows = ds_reader_rows(r), n = 0;
    float *probs = malloc((rows + 1) * sizeof(float)), *labels = malloc((rows + 1) * sizeof(float));
    stage s;
    memset(&s, 0, sizeof s);
    if (probs == NULL || labels == NULL)
        rc = cm_err(errptr, CM_ENOMEM, "out of memory for %" PRIu64 " eval rows", rows);
    /* Every pushed update is applied before the first pull, so the cut is this step's. */
    if (rc == CM_OK) rc = ps_client_flush(c, errptr);
    while (rc == CM_OK) {
        const ds_batch *b;
        int got = ds_reader_next(r, &b, errptr);
        if (got <= 0) {
            rc = got;
            break;
        }
        if (n + b->n_rows > rows) {
            rc = cm_err(errptr, CM_ECORRUPT, "eval shards hold more rows than their index says");
            break;
        }
        rc = stage_build(&s, S, b, NULL, be, false, errptr); /* forward only: no columns */
        if (rc == CM_OK) rc = stage_pull_rows(&s, S, c, true, errptr);
        if (rc == CM_OK && n == 0) rc = stage_pull_dense(&s, S, c, errptr); /* once */
        model_batch mb;
        model_staging_view(&s.ms, &mb);
        mb.labels = NULL;
        if (rc == CM_OK) rc = S->be->step(be, s.params, &mb, probs + n, NULL, NULL, NULL, errptr);
        if (rc == CM_OK) {
            memcpy(labels + n, s.ms.labels, s.ms.B * sizeof(float));
            n += s.ms.B;
        }
    }
    if (rc == CM_OK && n == 0)
        rc = cm_err(errptr, CM_EINVAL, "no eval rows in %s", S->o->eval_path);
    /* Eval rows of one class leave the AUC undefined (reported as null), not the run failed:
     * a small or filtered eval set has them, and the logloss and predictions still hold. */
    uint64_t npos = 0;
    for (uint64_t i = 0; rc == CM_OK && i < n; i++)
        npos += labels[i] > 0.5f; /* metrics_auc's positives */
    res->auc = NAN;
    if (rc == CM_OK && npos > 0 && npos < n) rc = metrics_auc(probs, labels, n, &res->auc, errptr);
    if (rc == CM_OK) rc = metrics_logloss(probs, labels, n, &res->logloss, errptr);
    if (rc == CM_OK && final) {
        /* One probability per eval row, in reader order: what `ember predict` must reproduce. */
        char path[2300];
        snprintf(path, sizeof path, "%s/eval_predictions.txt", S->o->out_dir);
        rc = write_probs(path, probs, n, errptr);
    }
    res->eval_rows = n;
    stage_free(&s);
    free(probs);
    free(labels);
    ds_reader_destroy(r);
    double t = cm_now() - t0;
    S->t_eval += t;
    if (rc == CM_OK) {
        train_log(
            S, "eval at step %" PRIu64 "%s: auc %.6f logloss %.6f over %" PRIu64 " rows in %.3f s",
            step, final ? " (final)" : "", res->auc, res->logloss, n, t);
        S->last_auc = res->auc;
        if (S->metrics) {
            char auc[32] = "null";
            if (!isnan(res->auc)) snprintf(auc, sizeof auc, "%.6f", res->auc);
            fprintf(S->metrics,
                    "{\"step\":%" PRIu64 ",\"seconds\":%.3f,\"auc\":%s,\"logloss\":%.6f"
                    ",\"eval_rows\":%" PRIu64 ",\"eval_seconds\":%.3f,\"final\":%s}\n",
                    step, cm_now() - S->t0, auc, res->logloss, n, t, final ? "true" : "false");
            metrics_flush(S);
        }
    }
    return rc;
}

/* ---- checkpoints ---- */

static void prune_checkpoints(setup *S, uint32_t keep, uint64_t latest);

static int ckpt_dir(const setup *S, uint64_t step, char *out, size_t n)
{
    int len = snprintf(out, n, "%s/step-%" PRIu64, S->ckpt_root, step);
    return len > 0 && (size_t)len < n ? CM_OK : CM_EINVAL;
}

/* Barrier ids from the schedule, so a worker restarted at any moment (--rejoin) meets the
 * others at the right barrier (ps.h, ps_client_barrier): the checkpoint at step s uses
 * barrier_base(s) + 1..3, a start or resume at step s + 4..6, the last barrier + 7. */
static uint64_t barrier_base(uint64_t step)
{
    return 8 * step + 8;
}

/* A tag with ember's own kernels' instruction set left out ("cpu/ember-avx2+bf16" ->
 * "cpu/ember+bf16"): the one rule for this run's tag and for a checkpoint's, which those
 * written before the AVX2 GEMM spell "cpu/ember-avx512". */
static void kernels_tag_collapse(char *tag)
{
    static const char own[] = "cpu/ember-";
    if (strncmp(tag, own, sizeof own - 1) != 0) return;
    char *isa = tag + sizeof own - 2, *rest = isa + strcspn(isa, "+");
    memmove(isa, rest, strlen(rest) + 1);
}

/* What computed the run: the bits depend on it (another OpenBLAS core sums in another order;
 * bf16 and TF32 GEMMs round their operands). ember's own kernels give the same bits with AVX-512
 * and with AVX2 (tests/train/threads_test.c holds them equal), so both are "cpu/ember": a run
 * resumed on the other kind of CPU goes on bit for bit. */
static void kernels_tag(const setup *S, char *out, size_t n)
{
    if (S->be == &backend_cpu_ops)
        snprintf(out, n, "cpu/%s%s", backend_cpu_kernels(), S->o->bf16 ? "+bf16" : "");
    else
        snprintf(out, n, "%s%s", S->be->name, S->o->tf32 ? "+tf32" : "");
    kernels_tag_collapse(out);
}

/* --dense-lr, or the tower optimizer's default: Adam and Adagrad 0.001, SGD 0.1 (the best of
 * 0.03, 0.1 and 0.3 on generated Criteo-like data; Adam's 0.001 as measured for the presets). */
static float dense_lr_of(const train_opts *o)
{
    if (o->dense_lr > 0) return o->dense_lr;
    return o->dense_opt == PS_DENSE_SGD ? 0.1f : 0.001f;
}

/* What a checkpoint's data positions and rows depend on besides the model (run.txt): a resume
 * with another batch size, shuffle, seed or worker or shard count would replay or skip rows, or
 * find the rows on other shards; one on other --train data (told by its row count) would skip
 * as many of its rows as the checkpoint had trained on. Epochs and --max-steps may change (a
 * run is extended). A key the checkpoint's run.txt lacks (an older run's) is not compared. */
static int run_format(const setup *S, char *out, size_t n)
{
    const train_opts *o = S->o;
    int len = snprintf(out, n,
                       "batch %u\nshuffle %" PRIu64 "\nseed %" PRIu64
                       "\nworkers %u\nshards %u\nemb_optimizer %s\ndense_optimizer %s"
                       "\nemb_lr %.7g\ndense_lr %.7g\npush_codec %s\ntrain_rows %" PRIu64 "\n",
                       o->batch, o->shuffle_rows, o->seed, o->workers, o->shards,
                       emb_opt_name(o->emb_opt), ps_dense_opt_name(o->dense_opt), (double)o->emb_lr,
                       (double)dense_lr_of(o), ps_codec_name(o->push_codec), S->train_rows);
    return len < 0 || (size_t)len >= n ? 0 : len;
}

/* Appends to msg (cap bytes) every "key value" line of `then` whose key `now` has with another
 * value, as "key NOW (checkpoint THEN)"; prefix names the file. */
static void diff_settings(const char *then, const char *now, const char *prefix, char *msg,
                          size_t cap)
{
    for (const char *l = then; *l; l += strcspn(l, "\n"), l += *l == '\n') {
        size_t kl = strcspn(l, " \n"), ll = strcspn(l, "\n");
        if (l[kl] != ' ') continue;
        for (const char *m = now; *m; m += strcspn(m, "\n"), m += *m == '\n') {
            size_t ml = strcspn(m, "\n");
            if (strncmp(m, l, kl + 1) == 0 && (ml != ll || strncmp(m, l, ll) != 0)) {
                size_t at = strlen(msg);
                snprintf(msg + at, cap - at, "%s%s%.*s %.*s (checkpoint %.*s)", at ? "; " : "",
                         prefix, (int)kl, l, (int)(ml - kl - 1), m + kl + 1, (int)(ll - kl - 1),
                         l + kl + 1);
            }
        }
    }
}

/* --resume: the checkpoint's model.txt and run.txt must describe this run. Every difference is
 * named. Both must be there: every checkpoint a resume can read (text files with a checksum
 * line) was written with a run.txt, so one without has lost it, and resuming without its checks
 * would replay or skip rows under another batch size or worker count. */
static int resume_check(const setup *S, char **errptr)
{
    char dir[2200], path[2400], now[1024], msg[2048] = "";
    if (ckpt_dir(S, S->resume_step, dir, sizeof dir) != CM_OK)
        return cm_err(errptr, CM_EINVAL, "path too long");
    const char *file[2] = {"model.txt", "run.txt"};
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, file[i]);
        char *then = NULL;
        size_t len;
        char *err = NULL;
        int rc = cm_read_sealed(path, &then, &len, &err);
        if (rc != CM_OK) {
            rc = cm_err(errptr, rc, "--resume: %s", err ? err : path);
            free(err);
            return rc;
        }
        free(err);
        if (i == 0)
            model_cfg_format(&S->m, S->o->mean_pool, now, sizeof now);
        else
            run_format(S, now, sizeof now);
        diff_settings(then, now, i == 0 ? "model " : "", msg, sizeof msg);
        free(then);
    }
    return msg[0] ? cm_err(errptr, CM_EINVAL,
                           "--resume: this run differs from the checkpoint %s: %s; resume with the "
                           "checkpoint's settings, or train into a new --out",
                           dir, msg)
                  : CM_OK;
}

/* A checkpoint's staging directory may hold what an earlier run's save at the same step left
 * (one that failed or was killed): entries of more shards or workers, which would make this one
 * unreadable (two copies of a row), and the temporaries that save was writing (a position cut
 * short, which reshard refuses; a shard's half-written tables), which stayed in the checkpoint
 * for good. Only this checkpoint's own entries stay. */
train_worker_file train_ckpt_worker_file(const char *name, uint32_t *w)
{
    static const char *const ext[] = {[TRAIN_WF_POS] = "pos", [TRAIN_WF_EF] = "ef"};
    unsigned i;
    char own[32];
    if (sscanf(name, "worker-%u", &i) != 1) return TRAIN_WF_NONE;
    *w = i;
    for (int k = TRAIN_WF_POS; k <= TRAIN_WF_EF; k++) {
        snprintf(own, sizeof own, "worker-%u.%s", i, ext[k]);
        if (strcmp(own, name) == 0) return (train_worker_file)k;
    }
    return TRAIN_WF_NONE;
}

static int drop_foreign(const setup *S, const char *dir, char **errptr)
{
    DIR *d = opendir(dir);
    if (d == NULL) return cm_err_errno(errptr, CM_EIO, "cannot read %s", dir);
    struct dirent *e;
    int rc = CM_OK;
    while (rc == CM_OK && (e = readdir(d)) != NULL) {
        const char *n = e->d_name;
        unsigned i;
        uint32_t w;
        char own[64] = "";
        if (sscanf(n, "shard-%u", &i) == 1 && i < S->ps.n_shards)
            snprintf(own, sizeof own, "shard-%u", i);
        bool ours = !strcmp(n, ".") || !strcmp(n, "..") || !strcmp(n, "model.txt") ||
                    !strcmp(n, "run.txt") || !strcmp(n, own) ||
                    (train_ckpt_worker_file(n, &w) != TRAIN_WF_NONE && w < S->o->workers);
        if (!ours) {
            char path[2600];
            snprintf(path, sizeof path, "%s/%s", dir, n);
            rc = cm_rmtree(path, errptr);
        }
    }
    closedir(d);
    return rc;
}

/* Whether a directory name is a checkpoint's staging one ("step-N" TRAIN_CKPT_STAGING). */
static bool is_staging(const char *name)
{
    size_t len = strlen(name), sl = strlen(TRAIN_CKPT_STAGING);
    return len > sl && strcmp(name + len - sl, TRAIN_CKPT_STAGING) == 0;
}

/* What the log says at each checkpoint: the tables' rows and what admission and TTL did with
 * them (worker 0: the counts are the whole cluster's), this worker's int8 residuals, and any
 * PS replies that arrived damaged (a transport fault the run survived, or a sign of one). */
static void log_tables(const setup *S, ps_client *c, uint32_t w)
{
    const bool int8 = S->o->push_codec == PS_CODEC_INT8;
    ps_client_stats cs;
    /* Only worker 0 logs the tables, so only it asks the shards. */
    if (w != 0)
        ps_client_stats_local(c, &cs);
    else if (ps_client_stats_get(c, &cs, NULL) != CM_OK)
        return;
    if (cs.replies_damaged > 0) { /* rare, and a cluster worker's stderr is its log */
        fprintf(stderr,
                "ember train: worker %u: %" PRIu64 " replies from the PS arrived damaged (failed "
                "their length or checksum check); requests sent again: %" PRIu64 "\n",
                w, cs.replies_damaged, cs.replies_resent);
        train_log(S, "worker %u: %" PRIu64 " replies from the PS arrived damaged", w,
                  cs.replies_damaged);
    }
    for (uint32_t t = 0; w == 0 && t < S->ps.n_tables; t++) {
        const emb_table_stats *ts = &cs.table_total[t];
        train_log(S,
                  "table %s: %" PRIu64 " rows (%" PRIu64 " spilled), %" PRIu64 " admitted, %" PRIu64
                  " pulled keys and %" PRIu64 " pushed held back by --admit, %" PRIu64
                  " expired by --ttl",
                  S->ps.tables[t].name, ts->rows_mem + ts->rows_spilled, ts->rows_spilled,
                  ts->admissions, ts->admit_rejects, ts->push_dropped, ts->ttl_evictions);
    }
    if (int8)
        train_log(S,
                  "worker %u: int8 residuals: %" PRIu64 " rows, %" PRIu64 " bytes, %" PRIu64
                  " dropped to stay within --residual-memory",
                  w, cs.resid_rows, cs.resid_bytes, cs.resid_dropped);
}

/* Collective: PS snapshot named by tag (the same for every worker), each worker's int8 residuals
 * (worker-<w>.ef, from a run that pushes int8: without them a resume would push other values)
 * and own data position (batches consumed, the kernels that computed them, and the rows and
 * summed loss of this run so far: job_totals), then LATEST (worker 0).
 *
 * Everybody writes into step-<tag>.tmp, which worker 0 swaps into step-<tag> whole once every
 * file is there: a fresh run's checkpoint may have the step of the one LATEST names (an earlier
 * run's, in the same directory), and a save that failed on one shard, or was killed, after
 * another shard had replaced its part there left LATEST naming a mixture of two runs. A
 * step-<n> directory only ever holds a complete checkpoint. */
typedef struct resid_job {
    ps_client *c;
    char path[2400];
    int rc;
    char *err;
} resid_job;

static void *resid_main(void *arg)
{
    resid_job *j = arg;
    j->rc = ps_client_residuals_save(j->c, j->path, &j->err);
    return NULL;
}

static int checkpoint(setup *S, ps_client *c, uint32_t w, uint64_t tag, uint64_t own,
                      uint64_t samples, double loss_sum, bool *stop, char **errptr)
{
    *stop = false;
    char final[2200], dir[2300], path[2400], text[256];
    const double t_start = cm_now();
    if (ckpt_dir(S, tag, final, sizeof final) != CM_OK)
        return cm_err(errptr, CM_EINVAL, "path too long");
    snprintf(dir, sizeof dir, "%s" TRAIN_CKPT_STAGING, final);
    ps_client_barrier_seek(c, barrier_base(tag) + 1);
    /* The int8 residuals are written beside the PS's SAVE, not after it (training waits for
     * both; at the default --residual-memory they take as long as the table): they are final
     * already, every push of this worker before the cut having left its residual and none after
     * (the last step's push is sent before this call, and the puller pushes the next batch only
     * once the checkpoint is through: prefetch_grant), and the SAVE touches them not. */
    resid_job rj = {.c = c, .rc = CM_OK};
    pthread_t rt;
    snprintf(rj.path, sizeof rj.path, "%s/worker-%u.ef", dir, w);
    int rc = cm_mkdirs(dir, errptr);
    const bool rj_started = rc == CM_OK && pthread_create(&rt, NULL, resid_main, &rj) == 0;
    if (rc == CM_OK) rc = ps_client_save(c, dir, errptr);
    if (rj_started)
        pthread_join(rt, NULL);
    else if (rc == CM_OK)
        resid_main(&rj);
    if (rc == CM_OK && rj.rc != CM_OK) {
        rc = rj.rc;
        cm_err(errptr, rc, "%s", rj.err ? rj.err : "cannot save the int8 residuals");
    }
    free(rj.err);
    if (rc != CM_OK) return rc;
    log_tables(S, c, w);
    snprintf(path, sizeof path, "%s/worker-%u.pos", dir, w);
    char kern[64];
    kernels_tag(S, kern, sizeof kern);
    int len = snprintf(text, sizeof text,
                       "step %" PRIu64 "\nkernels %s\nsamples %" PRIu64 "\nloss_sum %.17g\n", own,
                       kern, samples, loss_sum);
    if (rc == CM_OK) rc = cm_write_sealed(path, text, (size_t)len, errptr);
    /* Every file is written: a cluster worker that had a signal votes here to stop after this
     * checkpoint, and each learns the same answer (ps_client_barrier_vote), at the same
     * checkpoint, whatever step the signals found each at. */
    const bool vote = S->o->cluster_path && __atomic_load_n(&stop_signal, __ATOMIC_RELAXED);
    if (rc == CM_OK) rc = ps_client_barrier_vote(c, vote, stop, errptr);
    if (rc == CM_OK && w == 0) {
        /* The model's shape travels with its weights: export and serving read it. */
        char model[1024];
        snprintf(path, sizeof path, "%s/model.txt", dir);
        len = model_cfg_format(&S->m, S->o->mean_pool, model, sizeof model);
        rc = len < 0 ? cm_err(errptr, CM_ERR, "model config too long")
                     : cm_write_sealed(path, model, (size_t)len, errptr);
        snprintf(path, sizeof path, "%s/run.txt", dir);
        len = run_format(S, model, sizeof model);
        if (rc == CM_OK) rc = cm_write_sealed(path, model, (size_t)len, errptr);
    }
    if (rc == CM_OK && w == 0) rc = drop_foreign(S, dir, errptr);
    if (rc == CM_OK && w == 0) rc = cm_dir_swap(dir, final, errptr);
    if (rc == CM_OK && w == 0) {
        snprintf(path, sizeof path, "%s/LATEST", S->ckpt_root);
        len = snprintf(text, sizeof text, "step-%" PRIu64 "\n", tag);
        rc = cm_write_sealed(path, text, (size_t)len, errptr);
        if (rc == CM_OK) prune_checkpoints(S, S->o->keep_checkpoints, tag);
    }
    /* Training waits for a checkpoint whole: how long is the user's to know. */
    if (rc == CM_OK && w == 0)
        train_log(S, "checkpoint step-%" PRIu64 ": %.0f ms", tag, (cm_now() - t_start) * 1000.0);
    return rc;
}

/* Removes one directory prune_checkpoints gave up, saying why (what), or says why it could not
 * and returns false. */
static bool prune_one(setup *S, const char *dir, const char *what)
{
    if (what != NULL) {
        fprintf(stderr, "ember train: removing %s: %s\n", dir, what);
        train_log(S, "removing %s: %s", dir, what);
    }
    char *err = NULL;
    if (cm_rmtree(dir, &err) == CM_OK) return true;
    fprintf(stderr, "ember train: warning: %s (kept; tried again at the next checkpoint)\n", err);
    train_log(S, "warning: %s (kept; tried again at the next checkpoint)", err);
    free(err);
    return false;
}

/* Runs once step-<latest> is complete and LATEST names it, so the checkpoint a resume would use
 * is never touched and a crash midway leaves only extra checkpoints. No checkpoint newer than it
 * survives (an earlier, longer run's in the same directory; left there, a later prune would
 * delete this run's checkpoints before them), nor what a save that never completed assembled
 * (step-<n>.tmp), and of the rest only the newest `keep` (0: all). A fresh run's first
 * checkpoint also removes every older one: they are an earlier run's (kept until now, so a fresh
 * run that fails first leaves them as they were).
 *
 * Best effort: the checkpoint is in place, and a directory that cannot be removed (permissions,
 * a busy or read-only mount) costs disk, not the run, which a failed prune used to end after
 * its checkpoint had been written. Each failure is a warning, and the next checkpoint's prune
 * tries again (an earlier run's too: they stay "earlier" until all are gone). */
static void prune_checkpoints(setup *S, uint32_t keep, uint64_t latest)
{
    bool earlier = !S->o->resume && !S->o->rejoin && !S->pruned_foreign;
    if (earlier) {
        keep = 1;
        /* The earlier run's metrics go with its checkpoints (metrics_set_aside). */
        char prev[2300];
        snprintf(prev, sizeof prev, "%s/" METRICS_PREV, S->o->out_dir);
        unlink(prev);
    }
    DIR *d = opendir(S->ckpt_root);
    if (d == NULL) {
        fprintf(stderr, "ember train: warning: cannot read %s to prune it: %s\n", S->ckpt_root,
                strerror(errno));
        return;
    }
    /* Every step-<n>, however many: a fixed 4096 left the rest unlisted, so neither pruned
     * (--keep-checkpoints takes up to 100000) nor removed as an earlier run's. */
    uint64_t *steps = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    bool all = true, listed = true;
    char dir[2400]; /* ckpt_root, a slash and a directory entry's name */
    while ((e = readdir(d)) != NULL) {
        unsigned long long v;
        char tail;
        int got = sscanf(e->d_name, "step-%llu%c", &v, &tail);
        /* Only the trainer's own spelling of a step is that step's checkpoint: a step-010 (a
         * copy) counted as step-10's duplicate, and pruning it removed step-10 itself. */
        char own[32];
        if (got == 1 && (snprintf(own, sizeof own, "step-%llu", v) < 0 || strcmp(own, e->d_name)))
            got = 0;
        if (got == 1 && n == cap) {
            uint64_t *more = realloc(steps, (cap = cap ? 2 * cap : 256) * sizeof *steps);
            if (more == NULL) {
                listed = false;
                break;
            }
            steps = more;
        }
        if (got == 1) steps[n++] = v;
        /* What a save that failed or was killed was assembling (checkpoint): no checkpoint is
         * being assembled now, this one is in place. */
        if (got == 2 && is_staging(e->d_name)) {
            snprintf(dir, sizeof dir, "%s/%s", S->ckpt_root, e->d_name);
            all &= prune_one(S, dir, NULL);
        }
    }
    closedir(d);
    if (!listed) {
        fprintf(stderr, "ember train: warning: out of memory listing %s to prune it\n",
                S->ckpt_root);
        n = 0;
        all = false;
    }
    if (n > 0) qsort(steps, n, sizeof steps[0], cm_u64_cmp);
    char why[160];
    snprintf(why, sizeof why,
             "newer than this run's checkpoint step-%" PRIu64
             " (left by an earlier run in this directory, or a save that never completed)",
             latest);
    while (n > 0 && steps[n - 1] > latest)
        if (ckpt_dir(S, steps[--n], dir, sizeof dir) == CM_OK) all &= prune_one(S, dir, why);
    for (size_t i = 0; keep > 0 && i + keep < n; i++)
        if (ckpt_dir(S, steps[i], dir, sizeof dir) == CM_OK)
            all &= prune_one(S, dir, earlier ? "an earlier run's, in this directory" : NULL);
    if (earlier && all) S->pruned_foreign = true;
    free(steps);
}

/* Reads "<prefix><number>" from a small file; the whole text goes to *keep (the caller frees
 * it) where keep is not NULL, else it is freed. */
static int read_tagged(const char *path, const char *fmt, uint64_t *out, char **keep, char **errptr)
{
    char *text = NULL;
    size_t len;
    int rc = cm_read_sealed(path, &text, &len, errptr);
    if (rc != CM_OK) return rc;
    unsigned long long v;
    if (sscanf(text, fmt, &v) != 1)
        rc = cm_err(errptr, CM_ECORRUPT, "%s: unexpected contents", path);
    else
        *out = v;
    if (keep != NULL && rc == CM_OK)
        *keep = text;
    else
        free(text);
    return rc;
}

/* A resume computed by other kernels than the checkpoint's continues correctly but not bit
 * for bit as the run straight through would have: said once, on stderr. A position file from
 * before the kernels were written says nothing. */
static void warn_kernels(const setup *S, const char *pos_text)
{
    char now[64], then[64];
    const char *k = strstr(pos_text, "\nkernels ");
    kernels_tag(S, now, sizeof now);
    if (k == NULL || sscanf(k, "\nkernels %63s", then) != 1) return;
    kernels_tag_collapse(then);
    if (strcmp(then, now) != 0)
        fprintf(stderr,
                "ember train: resuming with %s kernels; the checkpoint was computed with %s: the "
                "run goes on, but not bit for bit as it would have without the restart\n",
                now, then);
}

static int latest_step(const char *root, uint64_t *step, char **errptr)
{
    char path[4400];
    snprintf(path, sizeof path, "%s/LATEST", root);
    return read_tagged(path, "step-%llu", step, NULL, errptr);
}

/* ---- a cluster worker's progress note (train.h, "Worker restart") ---- */

static void progress_path(const setup *S, uint32_t w, char *out, size_t n)
{
    snprintf(out, n, "%s/progress/worker-%u", S->o->out_dir, w);
}

static int progress_open(const setup *S, uint32_t w, int *fd, char **errptr)
{
    char path[2300];
    snprintf(path, sizeof path, "%s/progress", S->o->out_dir);
    int rc = cm_mkdirs(path, errptr);
    progress_path(S, w, path, sizeof path);
    if (rc == CM_OK && (*fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644)) < 0)
        rc = cm_err(errptr, CM_EIO, "%s: %s", path, strerror(errno));
    return rc;
}

/* One fixed-size pwrite: a killed process never leaves half of it; the checksum catches a
 * torn write after a machine crash. */
static void progress_note(int fd, uint64_t step)
{
    char line[64];
    char head[32];
    int n = snprintf(head, sizeof head, "step %020" PRIu64, step);
    snprintf(line, sizeof line, "%s xxh3 %016" PRIx64 "\n", head, cm_xxh3(head, (size_t)n));
    if (pwrite(fd, line, strlen(line), 0) < 0) { /* best effort: the checkpoint is the fallback */
    }
}

/* Where a rejoining worker starts: its progress note, else its position in ckpt/LATEST, else
 * the beginning. */
static uint64_t rejoin_position(const setup *S, uint32_t w, const char **from)
{
    char path[2300], *text = NULL;
    size_t len;
    unsigned long long v;
    char head[32];
    uint64_t sum, step = 0;
    progress_path(S, w, path, sizeof path);
    *from = "the beginning";
    if (cm_read_file(path, (void **)&text, &len, NULL) == CM_OK &&
        sscanf(text, "step %llu xxh3 %" SCNx64, &v, &sum) == 2 &&
        sum == cm_xxh3(head, (size_t)snprintf(head, sizeof head, "step %020llu", v))) {
        *from = "its progress note";
        step = v;
    } else {
        uint64_t latest = 0;
        char pos[2400];
        if (latest_step(S->ckpt_root, &latest, NULL) == CM_OK) {
            ckpt_dir(S, latest, path, sizeof path);
            snprintf(pos, sizeof pos, "%s/worker-%u.pos", path, w);
            if (read_tagged(pos, "step %llu", &step, NULL, NULL) == CM_OK) *from = "ckpt/LATEST";
        }
    }
    free(text);
    return step;
}

/* A checkpoint directory: the one given, or a run directory's ckpt/LATEST. */
int train_resolve_checkpoint(const char *in, char *out, size_t n, uint64_t *step, char **errptr)
{
    struct stat st;
    char path[4200];
    snprintf(path, sizeof path, "%s/shard-0", in);
    if (stat(path, &st) == 0) {
        snprintf(out, n, "%s", in);
    } else {
        snprintf(path, sizeof path, "%s/ckpt", in);
        uint64_t latest = 0;
        int rc = latest_step(path, &latest, errptr);
        if (rc == CM_ENOTFOUND)
            return cm_err(errptr, CM_ENOTFOUND,
                          "%s is neither a checkpoint (shard-0/) nor a run "
                          "directory (ckpt/LATEST)",
                          in);
        if (rc != CM_OK) return rc;
        snprintf(out, n, "%s/ckpt/step-%" PRIu64, in, latest);
    }
    /* "run/ckpt/step-40/" (as shell completion gives it) named the empty string after its
     * last slash: step 0 (export wrote a bundle of step 0, reshard a step-0 checkpoint). */
    cm_path_trim(out);
    const char *base = strrchr(out, '/');
    base = base ? base + 1 : out;
    if (is_staging(base))
        return cm_err(errptr, CM_EINVAL,
                      "%s is a checkpoint being assembled, or one an interrupted save left: give "
                      "the checkpoint it would have become, once its save has finished",
                      out);
    /* The step is the name's: the trainer names a checkpoint by its schedule's step, which
     * the workers' own positions need not equal (a final checkpoint of workers that ran out of
     * data unevenly). A copy under another name (run/best) was taken as step 0, which stacks
     * no delta: it goes by worker 0's position instead, and without one (a PS SAVE of its own)
     * is step 0. */
    unsigned long long named = 0;
    if (sscanf(base, "step-%llu", &named) == 1) {
        *step = named;
        return CM_OK;
    }
    uint64_t own = 0;
    char *err = NULL;
    snprintf(path, sizeof path, "%s/worker-0.pos", out);
    int rc = read_tagged(path, "step %llu", &own, NULL, &err);
    if (rc != CM_OK && rc != CM_ENOTFOUND) {
        cm_err(errptr, rc, "%s", err);
        free(err);
        return rc;
    }
    free(err);
    *step = rc == CM_OK ? own : 0;
    return CM_OK;
}

/* ---- one worker ---- */

typedef struct worker {
    setup *S;
    uint32_t index;
    int rc;
    char *err;
    uint64_t start, steps, samples; /* batches consumed before this run, and in total */
    int progress_fd;                /* cluster: progress/worker-<i>, else -1 */
    double loss_sum;
    double t_step, t_wait_batch, t_wait_push, t_dense; /* seconds (train_result's *_ms) */
    double t_pf[3];                                    /* its puller's t_early, t_push, t_late */
    double t_handover; /* handing batches to the backend (stage_begin, stage_send) */
    train_result res;  /* worker 0: eval */
    void *eval_be;     /* worker 0: the state evaluations step on (eval_backend), or NULL */
    ps_client *live;   /* its client while it may be waiting (S->abort_mu): job_abort's to stop */
    uint64_t job_samples; /* worker 0: every worker's rows this run (job_totals) */
    double job_loss;      /* ... and their summed loss */
    /* Under S->stop_mu: steps done (the loop's count), once its loop has begun (in_loop). */
    uint64_t done_steps;
    bool in_loop;
    bool stopped; /* it stopped at S->stop_at, after that checkpoint */
} worker;

/* Records that W has done `step` steps and says whether it stops here (its caller then
 * checkpoints and leaves the loop). A stop a signal asked for is fixed the first time a worker
 * passes here with every worker of the process in its loop: at the most steps any has done plus
 * three. Each worker's puller is at most two batches ahead of its steps (a stage being stepped,
 * the next one pulled early), so none has yet decided how to pull or push around that step
 * (cut_after), and each reaches it: the stop is a checkpoint like --checkpoint-every's, at a
 * step no worker had passed. A stop past the steps every worker reaches (S->min_steps) is
 * dropped: the run ends on its own by then, with its final checkpoint. */
static bool stop_after(worker *W, uint64_t step)
{
    setup *S = W->S;
    pthread_mutex_lock(&S->stop_mu);
    W->done_steps = step;
    W->in_loop = true;
    /* A cluster's workers are other processes: they agree at a checkpoint instead. */
    if (__atomic_load_n(&stop_signal, __ATOMIC_RELAXED) != 0 && S->stop_at == UINT64_MAX &&
        !S->o->cluster_path) {
        uint64_t most = 0;
        bool all = true;
        for (uint32_t i = 0; i < S->n_workers; i++) {
            all = all && S->workers[i].in_loop;
            if (S->workers[i].done_steps > most) most = S->workers[i].done_steps;
        }
        if (all) {
            const uint64_t at = most + 3 < S->min_steps ? most + 3 : 0;
            __atomic_store_n(&S->stop_at, at, __ATOMIC_RELEASE);
            if (at != 0)
                train_log(S, "stopping at step %" PRIu64 " (a signal asked): checkpoint, then exit",
                          at);
            else
                train_log(S, "a signal asked to stop, within 3 steps of the end: the run finishes");
        }
    }
    const bool here = S->stop_at == step;
    pthread_mutex_unlock(&S->stop_mu);
    return here;
}

/* Why a cluster worker stops, for its stderr. */
static const char *stop_cause(void)
{
    return __atomic_load_n(&stop_signal, __ATOMIC_RELAXED) != 0
               ? "this worker had a signal"
               : "another process of the cluster had a signal";
}

/* A cluster worker learnt at the checkpoint of `step` that a worker voted to stop there
 * (checkpoint): it stops after it, as every other worker does. Returns true. */
static bool cluster_stop(worker *W, uint64_t step)
{
    setup *S = W->S;
    __atomic_store_n(&S->stop_at, step, __ATOMIC_RELEASE);
    /* tools/launch reads this line: a worker that stopped here was not a failure */
    fprintf(stderr,
            "ember train: worker %u: stopping after the checkpoint at step %" PRIu64 " (%s)\n",
            W->index, step, stop_cause());
    return true;
}

/* A cluster worker's stop poll at `step` (poll_after): votes when this process had a signal,
 * and takes the stop step shard 0 answers, once one is fixed, as its own (stop_after then stops
 * there). A stop at or past the steps every worker reaches is left alone: the run ends first,
 * with its final checkpoint. */
static int stop_poll(worker *W, ps_client *c, uint64_t step, char **errptr)
{
    setup *S = W->S;
    const bool vote = __atomic_load_n(&stop_signal, __ATOMIC_RELAXED) != 0;
    uint64_t at = 0;
    int rc = ps_client_stop_poll(c, step, TRAIN_STOP_POLL, vote, &at, errptr);
    if (rc != CM_OK || at == 0 || at >= S->min_steps) return rc;
    if (at < step) /* shard 0 broke its own rule: the others will wait at `at` for this one */
        return cm_err(errptr, CM_ERR,
                      "worker %u: shard 0 fixed the stop at step %" PRIu64
                      ", which this worker has passed (step %" PRIu64 ")",
                      W->index, at, step);
    pthread_mutex_lock(&S->stop_mu);
    const bool news = S->stop_at != at;
    __atomic_store_n(&S->stop_at, at, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&S->stop_mu);
    if (news)
        fprintf(stderr,
                "ember train: worker %u: stopping at step %" PRIu64
                " (%s): checkpoint, then exit\n",
                W->index, at, stop_cause());
    return CM_OK;
}

/* Every worker's rows and summed loss this run, from the final checkpoint's position files
 * (each worker writes its own before the checkpoint's last barrier): in a cluster the other
 * workers are other processes, and the job's figures are theirs too. */
static int job_totals(const setup *S, uint64_t *samples, double *loss, char **errptr)
{
    char dir[2200], path[2400];
    if (ckpt_dir(S, S->max_steps, dir, sizeof dir) != CM_OK)
        return cm_err(errptr, CM_EINVAL, "path too long");
    *samples = 0;
    *loss = 0;
    int rc = CM_OK;
    for (uint32_t w = 0; w < S->o->workers && rc == CM_OK; w++) {
        snprintf(path, sizeof path, "%s/worker-%u.pos", dir, w);
        char *text = NULL;
        size_t len;
        rc = cm_read_sealed(path, &text, &len, errptr);
        if (rc != CM_OK) break;
        const char *a = strstr(text, "\nsamples "), *b = strstr(text, "\nloss_sum ");
        unsigned long long n;
        double l;
        if (a == NULL || b == NULL || sscanf(a, "\nsamples %llu", &n) != 1 ||
            sscanf(b, "\nloss_sum %lf", &l) != 1)
            rc = cm_err(errptr, CM_ECORRUPT, "%s: no samples or loss_sum line", path);
        else
            *samples += n, *loss += l;
        free(text);
    }
    return rc;
}

/* Publishes (c) or withdraws (NULL) worker W's client for job_abort; a client published after
 * the job failed is aborted at once. */
static void job_client(worker *W, ps_client *c)
{
    setup *S = W->S;
    pthread_mutex_lock(&S->abort_mu);
    W->live = c;
    if (c && S->first_failed >= 0) ps_client_abort(c);
    pthread_mutex_unlock(&S->abort_mu);
}

/* Worker W failed: the job cannot succeed, so the other workers of this process stop now (their
 * waits at a barrier or clock would otherwise last out 20 x --ps-timeout) and W's error is the
 * one reported. */
static void job_abort(worker *W)
{
    setup *S = W->S;
    pthread_mutex_lock(&S->abort_mu);
    if (S->first_failed < 0) {
        S->first_failed = (int)(W - S->workers);
        for (uint32_t i = 0; i < S->n_workers; i++)
            if (&S->workers[i] != W) ps_client_abort(S->workers[i].live);
    }
    pthread_mutex_unlock(&S->abort_mu);
}

/* A backend state for worker batches (the run's device, batch and flags). Evaluation's (eval)
 * runs the tower in fp32 whatever --bf16 and --tf32 say: what it reports (AUC, logloss,
 * eval_predictions.txt) is then what the exported bundle serves, which is fp32; on bf16 GEMMs
 * the two differed by up to ~2e-3 a prediction. */
static int backend_open(const setup *S, bool eval, void **be, char **errptr)
{
    const train_opts *o = S->o;
    unsigned flags = eval ? 0 : (o->tf32 ? BACKEND_TF32 : 0) | (o->bf16 ? BACKEND_BF16 : 0);
    return S->be->create(&S->m, &S->l, o->batch, S->batch_keys, o->threads, flags, be, errptr);
}

/* The state an evaluation steps on: its own (W->eval_be, opened on first use), since the
 * training state may have the next batches pending (backend_ops.prefetch), which a step without
 * a ticket would drop, and may compute in lower precision; after the last step (final), the
 * training state where its precision is fp32. */
static int eval_backend(worker *W, void *be, bool final, void **out, char **errptr)
{
    const train_opts *o = W->S->o;
    if (final && !o->bf16 && !o->tf32) {
        *out = be;
        return CM_OK;
    }
    int rc = W->eval_be ? CM_OK : backend_open(W->S, true, &W->eval_be, errptr);
    *out = W->eval_be;
    return rc;
}

/* A periodic evaluation mid-run. */
static int evaluate_periodic(worker *W, ps_client *c, uint64_t step, char **errptr)
{
    void *ebe = NULL;
    int rc = eval_backend(W, NULL, false, &ebe, errptr);
    train_result r = {0};
    return rc == CM_OK ? evaluate(W->S, c, ebe, step, false, &r, errptr) : rc;
}

/* Worker 0's progress: a bar on a terminal (redrawn in place), a log line otherwise, and a
 * JSON line in metrics.jsonl. samples/s leaves out the time spent evaluating. */
static void log_progress(setup *S, uint64_t step, uint64_t samples, double loss, bool final)
{
    double now = cm_now(), el = now - S->t0, busy = el - S->t_eval,
           rate = busy > 0 ? (double)samples / busy : 0,
           loop = now - S->t_loop0 - (S->t_eval - S->t_eval_loop0);
    /* rate is the job's (every worker's rows), and each worker has the steps left. */
    double eta = rate > 0 && S->max_steps > step
                     ? (double)(S->max_steps - step) * S->o->batch * S->o->workers / rate
                     : 0;
    char auc[32] = "";
    if (!isnan(S->last_auc)) snprintf(auc, sizeof auc, "  auc %.4f", S->last_auc);
    bool tty = S->o->progress == 1 || (S->o->progress < 0 && isatty(2));
    if (tty) {
        enum { WIDTH = 24 };
        char bar[WIDTH + 1];
        uint64_t filled = S->max_steps ? step * WIDTH / S->max_steps : WIDTH;
        for (int i = 0; i < WIDTH; i++)
            bar[i] = (uint64_t)i < filled ? '#' : '-';
        bar[WIDTH] = '\0';
        fprintf(stderr,
                "\r[%s] %3.0f%%  %" PRIu64 "/%" PRIu64
                "  %.0f samples/s  loss %.5f%s  ETA %.0fs  %s",
                bar, S->max_steps ? 100.0 * (double)step / (double)S->max_steps : 100.0, step,
                S->max_steps, rate, loss, auc, eta, final ? "\n" : "");
    }
    char line[160];
    snprintf(line, sizeof line, "step %" PRIu64 "/%" PRIu64 " samples/s %.0f loss %.5f%s eta %.0fs",
             step, S->max_steps, rate, loss, auc, eta);
    if (!tty) fprintf(stderr, "%s\n", line);
    train_log(S, "%s", line);
    if (S->metrics) {
        fprintf(S->metrics,
                "{\"step\":%" PRIu64 ",\"samples\":%" PRIu64
                ",\"seconds\":%.3f,\"loss\":%.6f,\"samples_per_s\":%.1f,\"loop_seconds\":%.3f}\n",
                step, samples, el, loss, rate, loop);
        metrics_flush(S);
    }
}

/* Threads each of the n PS shards this process runs applies a large batch on: --apply-threads,
 * else half the cores up to 8, shared among the shards, where the host's cores are the PS's (a
 * PS-only process, or workers computing on a GPU), and 1 beside workers on the cpu backend,
 * whose compute keeps every core busy. */
static uint32_t apply_threads(const train_opts *o, const setup *S, uint32_t n, bool workers)
{
    if (o->apply_threads > 0) return o->apply_threads;
    return workers && S->be == &backend_cpu_ops ? 1 : ps_apply_threads_default(n);
}

static int worker_loop(worker *W, ps_client *c, void *be, char **errptr)
{
    setup *S = W->S;
    const train_opts *o = S->o;
    const uint32_t w = W->index;
    uint64_t step = W->start, total = S->steps_of[w];
    int rc = CM_OK;
    ds_reader *r = NULL;
    float *probs = NULL, *dparams = NULL, *demb[MODEL_MAX_TABLES] = {0};
    prefetch pf;
    bool pf_started = false;
    /* Every worker skips the batches it consumed before the checkpoint. */
    rc = reader_open(S, o->train_path, w, o->workers, o->epochs, o->shuffle_rows, &r, errptr);
    if (rc != CM_OK) goto out;
    const ds_batch *before = NULL;
    for (uint64_t i = 0; i < step && rc == CM_OK; i++) {
        const ds_batch *b;
        int got = ds_reader_next(r, &b, errptr);
        if (got < 0) rc = got;
        before = got == 1 ? b : NULL;
    }
    probs = malloc(o->batch * sizeof(float));
    dparams = malloc(S->l.n_params * sizeof(float) + 1);
    if (probs == NULL || dparams == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
    if (rc != CM_OK) goto out;
    rc = prefetch_start(&pf, S, r, c, be, w, step, total > step ? total - step : 0, before, errptr);
    if (rc != CM_OK) goto out;
    pf_started = true;
    uint32_t cap_u = 0;
    double loss_window = 0, last_log = cm_now();
    if (w == 0) {
        S->t_loop0 = last_log;
        S->t_eval_loop0 = S->t_eval;
    }
    uint64_t window_n = 0;
    while (rc == CM_OK && (o->max_steps == 0 || step < o->max_steps)) {
        int trc;
        double t0 = cm_now();
        stage *s = prefetch_take(&pf, &trc, errptr);
        double t1 = cm_now();
        W->t_wait_batch += t1 - t0;
        if (s == NULL) {
            rc = trc;
            break;
        }
        /* The stepping thread hands every batch to the backend (its prefetch calls are then
         * serialized by construction); what stage_begin packed after the step before is left
         * out here. */
        rc = stage_send(s, S, be, errptr);
        t0 = cm_now();
        W->t_handover += t0 - t1;
        if (W->progress_fd >= 0 && ps_client_pushes_in_flight(c) == 0)
            progress_note(W->progress_fd, step);
        if (s->ms.U > cap_u) {
            for (uint32_t t = 0; t < S->l.n_tables; t++) {
                free(demb[t]);
                demb[t] = malloc((size_t)s->ms.U * S->l.table_dim[t] * sizeof(float));
                if (demb[t] == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
            }
            cap_u = s->ms.U;
        }
        model_batch mb;
        model_staging_view(&s->ms, &mb);
        mb.ticket = s->ticket;
        /* Hand the row push over early (prefetch's design note), except before a checkpoint
         * or an evaluation, or under a staleness bound. */
        if (!o->stale_pull && o->staleness < 0 && !cut_after(S, w, step + 1)) {
            pf.job_stage = s;
            pf.job_demb = demb;
            mb.emb_ready = prefetch_emb_ready;
            mb.emb_ready_arg = &pf;
        }
        double loss = 0;
        t0 = cm_now();
        if (rc == CM_OK) rc = S->be->step(be, s->params, &mb, probs, &loss, dparams, demb, errptr);
        t1 = cm_now();
        W->t_step += t1 - t0;
        /* While the puller pushes this batch's rows and pulls the next one's, that batch is
         * handed over but for its rows and params (this thread would only wait meanwhile). */
        stage *next = prefetch_next_built(&pf);
        if (rc == CM_OK && next != NULL) rc = stage_begin(next, S, be, errptr);
        t0 = cm_now();
        W->t_handover += t0 - t1;
        t1 = t0;
        /* Whatever the step's outcome, a handed-over push must be finished before this stage
         * and demb can change. */
        bool handed = false, pushed = false;
        char *jerr = NULL;
        int jrc = prefetch_job_wait(&pf, &handed, &pushed, &jerr);
        t0 = cm_now();
        W->t_wait_push += t0 - t1;
        if (rc == CM_OK && jrc != CM_OK) rc = cm_err(errptr, jrc, "%s", jerr);
        free(jerr);
        if (rc == CM_OK &&
            (!isfinite(loss) || cm_f32_first_nonfinite(dparams, S->l.n_params) < S->l.n_params))
            rc = cm_err(errptr, CM_EINVAL,
                        "non-finite loss or gradient at step %" PRIu64 " (worker %u)", step, w);
        /* Stale pulls: push only once batch t+1 is pulled, so t+1 always sees the updates up
         * to t-1 and never t's, whatever the thread timing: a one-worker run stays
         * deterministic. (Fresh pulls wait for this push instead.) */
        if (o->stale_pull) prefetch_wait_next(&pf);
        if (rc == CM_OK && !pushed) rc = push_rows(S, c, s, demb, errptr);
        bool read_back = pf.fresh != NULL; /* prefetch_start decided */
        if (rc == CM_OK && S->l.n_params > 0)
            rc = read_back ? ps_client_dense_push_pull(c, DENSE_BLOCK, dparams, pf.fresh, errptr)
                           : ps_client_dense_push(c, DENSE_BLOCK, dparams, errptr);
        W->t_dense += cm_now() - t0;
        uint32_t B = s->ms.B;
        if (rc == CM_OK && o->staleness >= 0) rc = ps_client_clock(c, NULL, errptr);
        if (rc != CM_OK) {
            prefetch_grant(&pf, handed, false);
            prefetch_release(&pf);
            break;
        }
        step++;
        W->steps++;
        W->samples += B;
        W->loss_sum += loss * B;
        loss_window += loss * B;
        window_n += B;
        if (w == 0 && (cm_now() - last_log > 1.0 || step == total)) {
            log_progress(S, step, W->samples * o->workers, loss_window / (double)window_n,
                         step == total);
            loss_window = 0;
            window_n = 0;
            last_log = cm_now();
        }
        if (rc == CM_OK && poll_after(S, step)) rc = stop_poll(W, c, step, errptr);
        /* Checkpoint while this stage is still held: the prefetcher has pulled exactly batch
         * step+1 and nothing later, so the cut is the same on every run. A resumed run pulls
         * batch step+1 after the checkpoint; so does this one. */
        bool stop = rc == CM_OK && stop_after(W, step);
        if (rc == CM_OK && (ckpt_after(S, step) || stop)) {
            bool voted;
            rc = checkpoint(S, c, w, step, step, W->samples, W->loss_sum, &voted, errptr);
            if (rc == CM_OK && voted) stop = cluster_stop(W, step);
            if (rc == CM_OK && stop) {
                W->stopped = true;
                prefetch_grant(&pf, handed, false);
                prefetch_release(&pf);
                break;
            }
            if (rc == CM_OK && o->stale_pull) rc = prefetch_refresh(&pf, errptr);
        }
        /* An evaluation at the same cut: it sees exactly what a checkpoint here would hold. */
        if (rc == CM_OK && eval_after(S, w, step)) rc = evaluate_periodic(W, c, step, errptr);
        prefetch_grant(&pf, handed, read_back); /* after the cut: no pull races it */
        prefetch_release(&pf);
    }
    /* Synchronous mode: keep clocking until the slowest worker is through. */
    for (uint64_t s = step; rc == CM_OK && !W->stopped && o->staleness >= 0 && s < S->max_steps;
         s++)
        rc = ps_client_clock(c, NULL, errptr);
out:
    if (pf_started) {
        prefetch_stop(&pf);
        W->t_pf[0] += pf.t_early;
        W->t_pf[1] += pf.t_push;
        W->t_pf[2] += pf.t_late;
    }
    ds_reader_destroy(r);
    free(probs);
    free(dparams);
    for (int t = 0; t < MODEL_MAX_TABLES; t++)
        free(demb[t]);
    if (rc == CM_OK) rc = ps_client_flush(c, errptr);
    W->steps = step;
    return rc;
}

/* --resume: worker w's int8 residuals from checkpoint dir (ps_client_load emptied them). A
 * checkpoint without them (of an fp32 run, or written before they were saved) leaves them
 * empty; one of an int8 run says that the resume is not bit for bit. */
static int load_residuals(const setup *S, ps_client *c, const char *dir, uint32_t w, char **errptr)
{
    char path[2400];
    snprintf(path, sizeof path, "%s/worker-%u.ef", dir, w);
    char *err = NULL;
    int rc = ps_client_residuals_load(c, path, &err);
    if (rc != CM_OK && rc != CM_ENOTFOUND) cm_err(errptr, rc, "--resume: %s", err);
    free(err);
    if (rc != CM_ENOTFOUND) return rc;
    if (S->o->push_codec == PS_CODEC_INT8) {
        fprintf(stderr,
                "ember train: worker %u: %s is missing (a checkpoint written before residuals "
                "were saved): its int8 residuals start at zero, and the run continues, but not "
                "bit for bit\n",
                w, path);
        train_log(S, "worker %u: %s missing: int8 residuals start at zero", w, path);
    }
    return CM_OK;
}

/* A whole worker: connect, initialise the tower, (resume), train, checkpoint, evaluate. */
static void *worker_main(void *arg)
{
    worker *W = arg;
    setup *S = W->S;
    const train_opts *o = S->o;
    ps_client *c = NULL;
    void *be = NULL;
    char **errptr = &W->err;
    ps_client_opts co = {.cfg = &S->ps,
                         .urls = (const char *const *)S->urls,
                         .worker = W->index,
                         .backup_urls = (const char *const *)S->backups,
                         .timeout_ms = o->ps_timeout_ms,
                         .resid_memory = o->resid_memory ? o->resid_memory : UINT64_MAX};
    int rc = ps_client_create(&co, &c, errptr);
    if (rc == CM_OK) job_client(W, c);
    if (rc == CM_OK) rc = backend_open(S, false, &be, errptr);
    if (rc == CM_OK && W->index == 0 && S->l.n_params > 0) {
        float *p = malloc(S->l.n_params * sizeof(float));
        int assigned;
        if (p == NULL)
            rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        else
            model_init_params(&S->m, &S->l, p);
        if (rc == CM_OK) rc = ps_client_dense_init(c, DENSE_BLOCK, p, &assigned, errptr);
        free(p);
    }
    if (rc == CM_OK && o->rejoin) {
        /* The others are mid-run: nothing to load, no start barrier to meet. Its int8 residuals
         * start empty (a new client's): the PS kept the rows its pushes after its last
         * checkpoint made, and those pushes already carried that checkpoint's residuals. */
        const char *from;
        W->start = rejoin_position(S, W->index, &from);
        fprintf(stderr, "ember train: worker %u rejoins at batch %" PRIu64 " (from %s)\n", W->index,
                W->start, from);
    } else if (rc == CM_OK && o->resume) {
        char dir[2200], pos[2400];
        ckpt_dir(S, S->resume_step, dir, sizeof dir);
        ps_client_barrier_seek(c, barrier_base(S->resume_step) + 4);
        rc = ps_client_load(c, dir, errptr);
        snprintf(pos, sizeof pos, "%s/worker-%u.pos", dir, W->index);
        char *pos_text = NULL;
        if (rc == CM_OK) rc = read_tagged(pos, "step %llu", &W->start, &pos_text, errptr);
        /* A worker is never past the checkpoint's step, nor past its own schedule. */
        if (rc == CM_OK && (W->start > S->resume_step || W->start > S->steps_of[W->index]))
            rc = cm_err(errptr, CM_ECORRUPT,
                        "%s says step %" PRIu64 ", past the checkpoint's step %" PRIu64
                        " or this worker's %" PRIu64 " steps",
                        pos, W->start, S->resume_step, S->steps_of[W->index]);
        if (rc == CM_OK) warn_kernels(S, pos_text);
        free(pos_text);
        if (rc == CM_OK) rc = load_residuals(S, c, dir, W->index, errptr);
    }
    /* Clocks count batches, so a rejoined worker's clock is where the others expect it. */
    if (rc == CM_OK) ps_client_clock_seek(c, W->start);
    if (rc == CM_OK && o->cluster_path) rc = progress_open(S, W->index, &W->progress_fd, errptr);
    /* The note says where this job's worker is from the start: an earlier job's in the same run
     * directory stood until the first batch, so a worker killed before it rejoined there
     * (skipping rows of a fresh job, repeating them of a resumed one). */
    if (rc == CM_OK && W->progress_fd >= 0) progress_note(W->progress_fd, W->start);
    if (rc == CM_OK) ps_client_barrier_seek(c, barrier_base(o->resume ? S->resume_step : 0) + 6);
    if (rc == CM_OK && !o->rejoin) rc = ps_client_barrier(c, errptr);
    if (rc == CM_OK) rc = worker_loop(W, c, be, errptr);
    if (W->stopped) goto done; /* checkpointed where the stop was fixed: nothing more to do */
    /* The final checkpoint is named after the longest schedule, so every worker agrees. */
    bool late = false; /* a vote at the final checkpoint: the job is done anyway */
    if (rc == CM_OK)
        rc = checkpoint(S, c, W->index, S->max_steps, W->steps, W->samples, W->loss_sum, &late,
                        errptr);
    if (rc == CM_OK && W->index == 0) rc = job_totals(S, &W->job_samples, &W->job_loss, errptr);
    if (rc == CM_OK) stop_note_finishing();
    void *ebe = NULL;
    if (rc == CM_OK && W->index == 0 && o->eval_path) rc = eval_backend(W, be, true, &ebe, errptr);
    if (rc == CM_OK && W->index == 0 && o->eval_path)
        rc = evaluate(S, c, ebe, W->steps, true, &W->res, errptr);
    /* Nobody leaves before worker 0's evaluation is done: then worker 0 may stop the PS. */
    if (rc == CM_OK) ps_client_barrier_seek(c, barrier_base(S->max_steps) + 7);
    if (rc == CM_OK) rc = ps_client_barrier(c, errptr);
done:
    if (rc != CM_OK && rc != CM_ECANCELED) job_abort(W);
    if (be) S->be->destroy(be);
    if (W->eval_be) S->be->destroy(W->eval_be);
    if (c && rc != CM_OK) ps_client_flush(c, NULL);
    job_client(W, NULL);
    ps_client_destroy(c);
    if (W->progress_fd >= 0) close(W->progress_fd);
    W->rc = rc;
    return NULL;
}

/* ---- the job ---- */

/* The PS messages' size limit a run needs: a batch's pull reply or push to one shard, all its
 * keys on that shard, with row_keys keys a row (the data's most, or 0: one a field; more in a
 * row may then need --max-message): 4 dim bytes a row, up to 10 of a key's varint, 4 of a
 * scale or weight, and a quarter more; never under the PS's own default. A limit only:
 * nothing is allocated at that size. */
static uint64_t batch_message_bytes(uint32_t batch, uint32_t row_keys, const model_cfg *m,
                                    const model_layout *l)
{
    uint64_t dim = 0;
    for (uint32_t t = 0; t < l->n_tables; t++)
        if (l->table_dim[t] > dim) dim = l->table_dim[t];
    const uint64_t per_row = row_keys > m->n_fields ? row_keys : m->n_fields;
    uint64_t need = (uint64_t)batch * per_row * (4 * dim + 10 + 4);
    need += need / 4;
    return need > PS_MAX_MESSAGE_DEFAULT ? need : PS_MAX_MESSAGE_DEFAULT;
}

/* The stats.json `ember ingest` wrote beside the shards at path (in the shards' directory or
 * its parent, as ingest lays them out), or NULL when there is none. The caller frees it. */
static char *ingest_stats_path(const char *shards)
{
    struct stat st;
    if (shards == NULL || stat(shards, &st) != 0) return NULL;
    char *dir = strdup(shards), *found = NULL;
    if (dir == NULL) return NULL;
    if (!S_ISDIR(st.st_mode)) {
        char *slash = strrchr(dir, '/');
        if (slash == NULL)
            strcpy(dir, ".");
        else if (slash == dir)
            dir[1] = '\0';
        else
            *slash = '\0';
    }
    static const char *const where[] = {"%s/stats.json", "%s/../stats.json"};
    for (size_t i = 0; i < sizeof where / sizeof where[0] && found == NULL; i++) {
        char path[4200];
        snprintf(path, sizeof path, where[i], dir);
        if (access(path, F_OK) == 0) found = strdup(path);
    }
    free(dir);
    return found;
}

/* train_opts.expected_rows resolved: the flag's value, else the sum of the ingest's per-field
 * distinct-key estimates in the training shards' stats.json at path (ingest_stats_path; NULL:
 * none) plus 5% for the estimate's error, else 0. A stats.json that does not parse or describes
 * another field count is only a missing hint: warned about. */
static uint64_t expected_rows(const train_opts *o, uint32_t n_fields, const char *path)
{
    if (o->expected_rows >= 0) return (uint64_t)o->expected_rows;
    char *err = NULL;
    if (path == NULL) return 0;
    uint64_t rows = 0, total = 0;
    uint32_t fields = 0;
    int rc = ds_stats_read_distinct(path, &total, &fields, &err);
    if (rc != CM_OK)
        fprintf(stderr, "ember train: ignoring %s as a size hint: %s\n", path, err);
    else if (fields != n_fields)
        fprintf(stderr, "ember train: ignoring %s as a size hint: %u fields, the shards have %u\n",
                path, fields, n_fields);
    else
        rows = total + total / 20;
    free(err);
    return rows;
}

/* The most keys one row of some shards holds, from their ingest's stats.json at path
 * (ingest_stats_path; NULL: none); 0 when it does not say (no file, an older ingest, or one
 * that does not parse, warned about). */
static uint32_t data_row_keys(const char *path)
{
    char *err = NULL;
    uint32_t k = 0;
    int rc = path ? ds_stats_read_max_row_keys(path, &k, &err) : CM_ENOTFOUND;
    if (rc != CM_OK && rc != CM_ENOTFOUND)
        fprintf(stderr, "ember train: ignoring %s for the batch key bound: %s\n", path, err);
    free(err);
    return rc != CM_OK ? 0 : k > 0 ? k : 1;
}

/* The whole of a flag's shards, for a check before training; an error names the flag. */
static int reader_open_flag(const setup *S, const char *flag, const char *path, ds_reader **r,
                            char **errptr)
{
    char *err = NULL;
    int rc = reader_open(S, path, 0, 1, 1, 0, r, &err);
    if (rc != CM_OK) cm_err(errptr, rc, "%s: %s", flag, err ? err : "cannot open");
    free(err);
    /* Shards ingested with --no-label hold 0 for every label, which is no click: training
     * would fit them and an evaluation would score against them. */
    if (rc == CM_OK && !ds_reader_schema(*r)->has_label) {
        rc = cm_err(errptr, CM_EINVAL,
                    "%s: the shards in %s have no labels (ingested with --no-label): nothing to "
                    "train or evaluate against",
                    flag, path);
        ds_reader_destroy(*r);
        *r = NULL;
    }
    return rc;
}

static int setup_make(setup *S, const train_opts *o, char **errptr)
{
    memset(S, 0, sizeof *S);
    S->o = o;
    ds_reader *r = NULL;
    int rc = reader_open_flag(S, "--train", o->train_path, &r, errptr);
    if (rc != CM_OK) return rc;
    const ds_schema *sch = ds_reader_schema(r);
    model_cfg_preset(&S->m, o->model.kind, sch->n_fields, sch->n_dense);
    uint32_t n_fields = sch->n_fields, n_dense = sch->n_dense;
    ds_reader_destroy(r);
    /* The eval shards are checked before training, not found wanting after it, where they are
     * read: by worker 0 (docs/CLUSTER.md: other hosts need not have them). */
    const bool evaluates =
        !o->cluster_path || (o->role && !strcmp(o->role, "worker") && o->index == 0);
    if (o->eval_path != NULL && evaluates) {
        rc = reader_open_flag(S, "--eval", o->eval_path, &r, errptr);
        if (rc != CM_OK) return rc;
        sch = ds_reader_schema(r);
        if (sch->n_fields != n_fields || sch->n_dense != n_dense)
            rc =
                cm_err(errptr, CM_EINVAL,
                       "eval shards %s have %u fields and %u dense values; the training shards "
                       "%s have %u and %u",
                       o->eval_path, sch->n_fields, sch->n_dense, o->train_path, n_fields, n_dense);
        ds_reader_destroy(r);
        if (rc != CM_OK) return rc;
    }
    if (o->hidden_override) {
        S->m.n_hidden = o->model.n_hidden;
        memcpy(S->m.hidden, o->model.hidden, sizeof S->m.hidden);
    }
    /* A setting the model has no place for is refused, not ignored: the run would not be the
     * one asked for. */
    const char *kind = model_kind_name(o->model.kind);
    if (o->hidden_override && o->model.kind == MODEL_LR)
        return cm_err(errptr, CM_EINVAL, "[model] hidden does not apply to %s (no tower)", kind);
    if (o->model.n_bottom && o->model.kind != MODEL_DLRM)
        return cm_err(errptr, CM_EINVAL, "[model] bottom applies to dlrm only, not %s", kind);
    if (o->dim_override && o->model.kind == MODEL_LR)
        return cm_err(errptr, CM_EINVAL,
                      "--dim / [model] dim does not apply to lr (one weight a key)");
    if (o->model.n_bottom) {
        S->m.n_bottom = o->model.n_bottom;
        memcpy(S->m.bottom, o->model.bottom, sizeof S->m.bottom);
    }
    if (o->dim_override) {
        S->m.dim = o->dim_override;
        if (o->model.kind == MODEL_DLRM && S->m.n_bottom) S->m.bottom[S->m.n_bottom - 1] = S->m.dim;
    }
    /* --seed draws the whole model (embedding rows and tower) unless [model] seed is given. */
    S->m.seed = o->model.seed ? o->model.seed : o->seed;
    if (S->m.kind == MODEL_DLRM && S->m.n_dense == 0)
        return cm_err(errptr, CM_EINVAL, "dlrm needs dense features; the shards have none");
    rc = model_layout_make(&S->m, &S->l, errptr);
    if (rc != CM_OK) return rc;
    if (o->device != NULL) {
        rc = backend_find(o->device, &S->be, errptr);
    } else if (o->bf16) {
        /* --bf16 names the CPU's AMX GEMMs: on a host with a GPU too, the run asked for the CPU. */
        S->be = &backend_cpu_ops;
    } else {
        /* Auto: CUDA when built in and a device answers, else the CPU. */
        S->be = backend_cuda_probe(NULL) == CM_OK ? backend_cuda(NULL) : &backend_cpu_ops;
    }
    if (rc != CM_OK) return rc;
    /* The PS cluster this model needs. */
    ps_config *p = &S->ps;
    ps_config_init(p);
    p->n_shards = o->shards;
    p->n_workers = o->workers;
    p->staleness = o->staleness;
    p->worker_timeout_ms = o->worker_timeout_ms;
    /* Without a --worker-timeout (wait for every worker), a worker that died fails the others'
     * waits on it within --ps-timeout, naming it, as a dead PS fails their requests: unless it
     * is back by then (--rejoin), the job cannot complete (every checkpoint and the job's
     * totals need its position), and its peers would otherwise wait 20 x --ps-timeout at their
     * next clock or barrier and then blame no one. */
    p->worker_lost_ms = o->worker_timeout_ms != 0 ? 0
                        : o->ps_timeout_ms        ? o->ps_timeout_ms
                                                  : PS_TIMEOUT_DEFAULT_MS;
    snprintf(p->spill_dir, sizeof p->spill_dir, "%s/spill", o->out_dir);
    /* The training shards' stats.json, found once for both hints it gives. */
    char *train_stats = ingest_stats_path(o->train_path);
    uint64_t reserve = expected_rows(o, S->m.n_fields, train_stats) / p->n_shards;
    /* A batch's bound covers the eval shards too; the PS's message limit, which every role
     * works out alike, only the training shards, which every role reads. */
    char *eval_stats = o->eval_path ? ingest_stats_path(o->eval_path) : NULL;
    const uint32_t train_row_keys = data_row_keys(train_stats),
                   eval_row_keys = o->eval_path ? data_row_keys(eval_stats) : train_row_keys,
                   row_keys = !train_row_keys || !eval_row_keys ? 0
                              : train_row_keys > eval_row_keys  ? train_row_keys
                                                                : eval_row_keys;
    free(train_stats);
    free(eval_stats);
    const uint64_t bound = o->max_batch_keys ? o->max_batch_keys
                           : row_keys        ? (uint64_t)o->batch * row_keys
                                             : (uint64_t)o->batch * S->m.n_fields * 8 + 1024;
    S->batch_keys = bound < TRAIN_MAX_BATCH_KEYS_MAX ? (uint32_t)bound : TRAIN_MAX_BATCH_KEYS_MAX;
    for (uint32_t t = 0; t < S->l.n_tables; t++) {
        ps_table_spec *ts = &p->tables[p->n_tables++];
        memset(ts, 0, sizeof *ts);
        snprintf(ts->name, sizeof ts->name, "%s", (int)t == S->l.lin_table ? "lin" : "emb");
        emb_table_config_init(&ts->cfg);
        ts->cfg.dim = S->l.table_dim[t];
        ts->cfg.opt = o->emb_opt;
        ts->cfg.lr = o->emb_lr;
        ts->cfg.init_scale = (int)t == S->l.lin_table ? 0.0f : 0.05f;
        ts->cfg.seed = o->seed;
        ts->cfg.mem_budget_bytes = o->memory;
        ts->cfg.reserve_rows = reserve;
        ts->cfg.admit_threshold = o->admit;
        /* A shard's table counts a step per push it receives: each worker's job step pushes
         * a table in push_rows' two parts. */
        ts->cfg.ttl_steps = o->ttl * o->workers * TRAIN_PUSH_PARTS;
        ts->push_codec = o->push_codec;
        ts->pull_codec = PS_CODEC_F32;
    }
    if (S->l.n_params > 0) {
        ps_dense_spec *d = &p->dense[p->n_dense++];
        memset(d, 0, sizeof *d);
        snprintf(d->name, sizeof d->name, "tower");
        d->size = S->l.n_params;
        d->opt = o->dense_opt;
        d->lr = dense_lr_of(o);
        d->beta1 = 0.9f;
        d->beta2 = 0.999f;
        d->eps = 1e-8f;
    }
    p->max_msg_bytes = o->max_message ? o->max_message
                                      : batch_message_bytes(o->batch, train_row_keys, &S->m, &S->l);
    rc = ps_config_check(p, errptr);
    if (rc != CM_OK) return rc;
    /* Everyone's schedule, from the shard indexes. */
    S->steps_of = calloc(o->workers, sizeof *S->steps_of);
    if (S->steps_of == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
    S->min_steps = UINT64_MAX;
    for (uint32_t w = 0; w < o->workers && rc == CM_OK; w++) {
        rc = reader_open(S, o->train_path, w, o->workers, 1, 0, &r, errptr);
        if (rc != CM_OK) break;
        uint64_t rows = ds_reader_rows(r);
        S->train_rows += rows;
        ds_reader_destroy(r);
        uint64_t steps = (rows + o->batch - 1) / o->batch * o->epochs;
        if (o->max_steps && steps > o->max_steps) steps = o->max_steps;
        S->steps_of[w] = steps;
        if (steps < S->min_steps) S->min_steps = steps;
        if (steps > S->max_steps) S->max_steps = steps;
    }
    if (rc == CM_OK && S->max_steps >= (1ull << 28)) /* barrier ids are u32 on the wire */
        rc = cm_err(errptr, CM_EINVAL, "%" PRIu64 " steps a worker: at most 2^28", S->max_steps);
    if (rc == CM_OK && S->min_steps == 0)
        rc = cm_err(errptr, CM_EINVAL,
                    "a worker has no training rows in %s (fewer blocks than workers?)",
                    o->train_path);
    /* Every checkpoint's directory goes to the PS in a SAVE (PS_CKPT_DIR_MAX bytes at most): a
     * longer --out trained to its first checkpoint and failed only there, the work lost. Refused
     * now, which also keeps ckpt_root and the spill directory from being cut short. */
    int ckpt_len =
        snprintf(NULL, 0, "%s/ckpt/step-%" PRIu64 TRAIN_CKPT_STAGING, o->out_dir, S->max_steps);
    if (rc == CM_OK && (ckpt_len < 0 || (size_t)ckpt_len > PS_CKPT_DIR_MAX))
        rc =
            cm_err(errptr, CM_EINVAL,
                   "--out %s is too long: its checkpoints (%s/ckpt/step-%" PRIu64 TRAIN_CKPT_STAGING
                   ", %d bytes) must fit in %u bytes",
                   o->out_dir, o->out_dir, S->max_steps, ckpt_len, PS_CKPT_DIR_MAX);
    snprintf(S->ckpt_root, sizeof S->ckpt_root, "%s/ckpt", o->out_dir);
    if (rc == CM_OK) rc = cm_mkdirs(S->ckpt_root, errptr);
    if (rc == CM_OK && o->resume) {
        char *err = NULL;
        int lr = latest_step(S->ckpt_root, &S->resume_step, &err);
        if (lr != CM_OK) rc = cm_err(errptr, lr, "--resume: no checkpoint to resume from: %s", err);
        free(err);
    }
    if (rc == CM_OK && o->resume) rc = resume_check(S, errptr);
    /* The final checkpoint is named after the schedule's end: one that ends at or before the
     * checkpoint's step would overwrite newer state under an older name. */
    if (rc == CM_OK && o->resume && S->resume_step >= S->max_steps)
        rc = cm_err(errptr, CM_EINVAL,
                    "--resume: the checkpoint is at step %" PRIu64 " and this run's schedule ends "
                    "at step %" PRIu64 ": nothing to resume (raise --epochs or --max-steps, or "
                    "use the same --train data)",
                    S->resume_step, S->max_steps);
    return rc;
}

static void setup_free(setup *S)
{
    pthread_mutex_destroy(&S->abort_mu); /* zeroed storage is an unlocked mutex too */
    for (uint32_t i = 0; S->urls && i < S->n_urls; i++)
        free(S->urls[i]);
    free(S->urls);
    for (uint32_t i = 0; S->backups && i < S->n_backups; i++)
        free(S->backups[i]);
    free(S->backups);
    free(S->steps_of);
    if (S->metrics) fclose(S->metrics);
    if (S->log) {
        log_fd_for_signal = -1;
        fclose(S->log);
    }
    if (S->locked) close(S->lock_fd);
}

/* One job a run directory: the process that runs worker 0 holds an exclusive flock on
 * RUNDIR/lock (released by the kernel however the process ends), so a second job cannot
 * overwrite or prune the first one's checkpoints. */
static int run_lock(setup *S, const char *out_dir, char **errptr)
{
    char path[2300];
    snprintf(path, sizeof path, "%s/lock", out_dir);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return cm_err_errno(errptr, CM_EIO, "cannot open %s", path);
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        char pid[32] = "";
        ssize_t n = read(fd, pid, sizeof pid - 1);
        pid[n > 0 ? strcspn(pid, "\n") : 0] = '\0';
        close(fd);
        return cm_err(errptr, CM_EINVAL,
                      "run directory %s is in use by another ember train (pid %s): wait for it "
                      "to end, or use another --out",
                      out_dir, pid[0] ? pid : "?");
    }
    char text[32];
    int len = snprintf(text, sizeof text, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, text, (size_t)len, 0) != len) {
        /* the pid is only a hint for the message above */
    }
    S->lock_fd = fd;
    S->locked = true;
    return CM_OK;
}

/* A resumed run (or a rejoining worker 0) continues metrics.jsonl from where it starts again:
 * lines of steps after it are the interrupted run's, which it computes again. */
static int metrics_trim(const char *path, uint64_t step, char **errptr)
{
    char *text = NULL;
    size_t len = 0;
    char *err = NULL;
    int rc = cm_read_file(path, (void **)&text, &len, &err);
    free(err);
    if (rc != CM_OK) return CM_OK; /* none yet */
    char *out = malloc(len + 1);
    size_t n = 0;
    if (out == NULL) {
        free(text);
        return cm_err(errptr, CM_ENOMEM, "out of memory");
    }
    for (size_t at = 0; at < len;) {
        size_t end = at;
        while (end < len && text[end] != '\n')
            end++;
        unsigned long long st;
        /* A last line without its newline is half a line a killed run left: kept, it read as
         * the step it began with and stayed for good (no strict JSONL reader takes it). */
        bool keep = end < len && (sscanf(text + at, "{\"step\":%llu", &st) != 1 || st <= step);
        if (keep && end > at) {
            memcpy(out + n, text + at, end - at);
            n += end - at;
            out[n++] = '\n';
        }
        at = end + 1;
    }
    rc = n == len ? CM_OK : cm_write_file_atomic(path, out, n, errptr);
    free(out);
    free(text);
    return rc;
}

/* A fresh run into a run directory whose checkpoints an earlier run left: that run's
 * metrics.jsonl is moved to METRICS_PREV, not truncated, since its checkpoints stay until this
 * run's first one (prune_checkpoints, which then removes it). A fresh run that fails before that
 * leaves the directory's LATEST naming the earlier run's checkpoint, and a --resume of it gets
 * that run's metrics back (metrics_restore), not the failed run's lines, which no checkpoint
 * holds. Where METRICS_PREV is there already, an earlier fresh run failed the same way: it still
 * holds the metrics of the run LATEST names, and stays. */
static int metrics_set_aside(const setup *S, const char *path, char **errptr)
{
    char latest[2300], prev[2300];
    snprintf(latest, sizeof latest, "%s/LATEST", S->ckpt_root);
    snprintf(prev, sizeof prev, "%s/" METRICS_PREV, S->o->out_dir);
    if (access(latest, F_OK) != 0 || access(prev, F_OK) == 0 || access(path, F_OK) != 0)
        return CM_OK;
    if (rename(path, prev) != 0)
        return cm_err_errno(errptr, CM_EIO, "cannot move %s to %s", path, prev);
    return CM_OK;
}

/* A --resume after a fresh run that failed before its first checkpoint: see metrics_set_aside. */
static int metrics_restore(const setup *S, const char *path, char **errptr)
{
    char prev[2300];
    snprintf(prev, sizeof prev, "%s/" METRICS_PREV, S->o->out_dir);
    if (access(prev, F_OK) != 0) return CM_OK;
    if (rename(prev, path) != 0)
        return cm_err_errno(errptr, CM_EIO, "cannot move %s back to %s", prev, path);
    return CM_OK;
}

int train_run(const train_opts *o, train_result *res, char **errptr)
{
    memset(res, 0, sizeof *res);
    setup S;
    train_opts oc = *o;
    int rc = CM_OK;
    train_cluster cl;
    if (o->cluster_path) {
        /* The cluster file fixes shards and workers for every role. */
        rc = train_cluster_load(o->cluster_path, &cl, errptr);
        if (rc != CM_OK) return rc;
        oc.shards = cl.n_shards;
        oc.workers = cl.n_workers;
    }
    rc = setup_make(&S, &oc, errptr);
    if (o->cluster_path) {
        /* setup_make builds S.ps from the model: the cluster file's URLs (S frees them) and TLS
         * files join it, whether it failed or not. */
        S.urls = cl.urls;
        S.n_urls = cl.n_shards;
        S.backups = cl.backups;
        S.n_backups = cl.n_backups;
        memcpy(S.ps.tls_cert, cl.tls_cert, sizeof S.ps.tls_cert);
        memcpy(S.ps.tls_key, cl.tls_key, sizeof S.ps.tls_key);
        memcpy(S.ps.tls_ca, cl.tls_ca, sizeof S.ps.tls_ca);
    }
    ps_server **servers = NULL;
    worker *workers = NULL;
    uint32_t n_w = oc.workers; /* before the first goto: the cleanup reads it */
    if (rc != CM_OK) goto out;
    S.o = &oc;
    S.t0 = cm_now();
    S.last_auc = NAN;
    S.first_failed = -1;
    pthread_mutex_init(&S.abort_mu, NULL);
    S.stop_at = UINT64_MAX;
    pthread_mutex_init(&S.stop_mu, NULL);
    bool run_ps = !o->cluster_path, run_workers = !o->cluster_path, is_backup = false;
    uint32_t first_w = 0, first_s = 0, n_s = oc.shards;
    if (o->cluster_path) {
        is_backup = !strcmp(o->role, "backup");
        run_ps = !strcmp(o->role, "ps") || is_backup;
        run_workers = !strcmp(o->role, "worker");
        if (!run_ps && !run_workers) {
            rc = cm_err(errptr, CM_EINVAL, "--role must be ps, backup or worker");
            goto out;
        }
        if (is_backup && S.backups == NULL) {
            rc = cm_err(errptr, CM_EINVAL, "--role backup: the cluster file names no backups");
            goto out;
        }
        if (o->index >= (run_ps ? oc.shards : oc.workers)) {
            rc = cm_err(errptr, CM_EINVAL, "--index %u out of range: %s lists %u %s (0 to %u)",
                        o->index, o->cluster_path, run_ps ? oc.shards : oc.workers,
                        run_ps ? "ps URLs" : "workers", (run_ps ? oc.shards : oc.workers) - 1);
            goto out;
        }
        first_w = first_s = o->index;
        n_w = n_s = 1;
    } else {
        S.urls = calloc(oc.shards, sizeof *S.urls);
        S.n_urls = S.urls ? oc.shards : 0;
        for (uint32_t i = 0; S.urls && i < oc.shards; i++) {
            S.urls[i] = malloc(64);
            if (S.urls[i] == NULL) break;
            snprintf(S.urls[i], 64, "inproc://ember-%ld-%u", (long)getpid(), i);
        }
        if (S.urls == NULL || (oc.shards > 0 && S.urls[oc.shards - 1] == NULL)) {
            rc = cm_err(errptr, CM_ENOMEM, "out of memory for %u shard URLs", oc.shards);
            goto out;
        }
    }
    if (run_ps) {
        servers = calloc(oc.shards, sizeof *servers);
        if (servers == NULL) {
            rc = cm_err(errptr, CM_ENOMEM, "out of memory for %u shards", oc.shards);
            goto out;
        }
        for (uint32_t i = first_s; rc == CM_OK && i < first_s + n_s; i++) {
            /* A PS serves SAVE and LOAD for this run's checkpoints only. */
            ps_server_opts so = {.cfg = &S.ps,
                                 .listen = S.urls[i],
                                 .shard = i,
                                 .checkpoint_root = S.ckpt_root,
                                 .apply_threads = apply_threads(o, &S, n_s, run_workers)};
            if (S.backups && is_backup) {
                so.listen = S.backups[i];
                so.backup = true;
            } else if (S.backups) {
                so.replica_url = S.backups[i];
            }
            rc = ps_server_create(&so, &servers[i], errptr);
        }
    }
    if (rc == CM_OK && run_workers) {
        char path[2300];
        snprintf(path, sizeof path, "%s/metrics.jsonl", oc.out_dir);
        if (first_w == 0) rc = run_lock(&S, oc.out_dir, errptr);
        if (rc == CM_OK && first_w == 0 && oc.resume) rc = metrics_restore(&S, path, errptr);
        if (rc == CM_OK && first_w == 0 && oc.resume)
            rc = metrics_trim(path, S.resume_step, errptr);
        if (rc == CM_OK && first_w == 0 && oc.rejoin) {
            /* Worker 0 computes its batches from its rejoin position again: the killed
             * process's lines after it (and a half line it was writing) go. */
            const char *from;
            rc = metrics_trim(path, rejoin_position(&S, 0, &from), errptr);
        }
        if (rc == CM_OK && first_w == 0 && !oc.resume && !oc.rejoin) {
            /* A fresh run's: an earlier run's predictions would pass for this one's. */
            char pred[2300];
            snprintf(pred, sizeof pred, "%s/eval_predictions.txt", oc.out_dir);
            unlink(pred);
            rc = metrics_set_aside(&S, path, errptr);
        }
        if (rc != CM_OK) goto out;
        if (first_w == 0) S.metrics = fopen(path, oc.resume || oc.rejoin ? "a" : "w");
        snprintf(path, sizeof path, "%s/logs", oc.out_dir);
        if (!o->cluster_path && cm_mkdirs(path, NULL) == CM_OK) {
            snprintf(path, sizeof path, "%s/logs/train.log", oc.out_dir);
            /* Appended to, fresh run or not: a failed run's log is what tells why, and the run
             * before it (whose checkpoints a fresh run keeps until its first) keeps its own. */
            S.log = fopen(path, "a");
            if (S.log != NULL) {
                log_fd_for_signal = fileno(S.log);
                stop_on_signal("[ stopping] signal: a checkpoint at a step every worker "
                               "reaches, then exit (a second signal stops at once)\n",
                               false);
            }
        }
        /* A cluster worker's log is its stderr (tools/launch keeps it). It votes at its next
         * periodic checkpoint, or without --checkpoint-every at its next stop poll
         * (poll_after). */
        if (o->cluster_path && oc.ckpt_every > 0)
            stop_on_signal("[ stopping] signal: this worker votes to stop at the next periodic "
                           "checkpoint; every worker stops after it, then exits (a second "
                           "signal stops at once)\n",
                           true);
        else if (o->cluster_path)
            stop_on_signal("[ stopping] signal: this worker votes to stop at its next stop poll "
                           "(every 100 steps); every worker checkpoints at a step they all "
                           "reach and stops, then exits (a second signal stops at once)\n",
                           true);
        train_log(&S,
                  "ember train %s: model %s, %u worker(s), %u shard(s), batch %u, epochs %u, "
                  "%" PRIu64 " steps, train %s, eval %s, device %s",
                  oc.resume ? "resumed" : "started", model_kind_name(S.m.kind), oc.workers,
                  oc.shards, oc.batch, oc.epochs, S.max_steps, oc.train_path,
                  oc.eval_path ? oc.eval_path : "-", S.be->name);
        workers = calloc(n_w, sizeof *workers);
        pthread_t *th = calloc(n_w, sizeof *th);
        if (workers == NULL || th == NULL) rc = cm_err(errptr, CM_ENOMEM, "out of memory");
        S.workers = workers;
        S.n_workers = workers ? n_w : 0;
        for (uint32_t i = 0; rc == CM_OK && i < n_w; i++) {
            workers[i].S = &S;
            workers[i].index = first_w + i;
            workers[i].progress_fd = -1;
            if (pthread_create(&th[i], NULL, worker_main, &workers[i]) != 0) {
                rc = cm_err(errptr, CM_ERR, "cannot start worker threads");
                n_w = i;
            }
        }
        for (uint32_t i = 0; th && i < n_w; i++)
            pthread_join(th[i], NULL);
        free(th);
        uint64_t samples = 0;
        double loss = 0;
        /* The first worker to fail caused the rest (job_abort). */
        if (rc == CM_OK && S.first_failed >= 0) {
            const worker *f = &workers[S.first_failed];
            rc = cm_err(errptr, f->rc, "worker %u: %s", f->index, f->err ? f->err : "failed");
        }
        for (uint32_t i = 0; workers && i < n_w; i++) {
            if (workers[i].rc != CM_OK && rc == CM_OK)
                rc = cm_err(errptr, workers[i].rc, "worker %u: %s", workers[i].index,
                            workers[i].err ? workers[i].err : "failed");
            samples += workers[i].samples;
            loss += workers[i].loss_sum;
        }
        if (rc == CM_OK && workers[0].stopped) {
            /* Every worker stopped there (a checkpoint is collective): no final evaluation. */
            memset(res, 0, sizeof *res);
            res->stopped_at = S.stop_at;
            res->stop_signal = __atomic_load_n(&stop_signal, __ATOMIC_RELAXED);
            res->seconds = cm_now() - S.t0;
            train_log(&S,
                      "stopped at step %" PRIu64 " by a signal: ckpt/step-%" PRIu64
                      " written, --resume continues from it",
                      S.stop_at, S.stop_at);
        } else if (rc == CM_OK) {
            *res = workers[0].res;
            res->seconds = cm_now() - S.t0;
            if (first_w == 0) { /* the job's figures, cluster workers included */
                samples = workers[0].job_samples;
                loss = workers[0].job_loss;
            }
            res->rows = samples;
            res->steps = workers[0].steps;
            res->samples_per_s = res->seconds > 0 ? (double)samples / res->seconds : 0;
            res->train_loss = samples ? loss / (double)samples : 0;
            res->eval_seconds = S.t_eval;
            res->workers = oc.workers;
            res->shards = oc.shards;
            res->device = S.be->name;
            const worker *w0 = &workers[0];
            double per = w0->steps > w0->start ? 1e3 / (double)(w0->steps - w0->start) : 0;
            res->step_ms = w0->t_step * per;
            res->wait_batch_ms = w0->t_wait_batch * per;
            res->wait_push_ms = w0->t_wait_push * per;
            res->dense_ms = w0->t_dense * per;
            res->puller_early_ms = w0->t_pf[0] * per;
            res->puller_push_ms = w0->t_pf[1] * per;
            res->puller_late_ms = w0->t_pf[2] * per;
            res->handover_ms = w0->t_handover * per;
        }
        if (o->cluster_path && first_w == 0 && rc == CM_OK) {
            /* The job is done: worker 0 takes the cluster down. */
            ps_client *c = NULL;
            ps_client_opts co = {.cfg = &S.ps,
                                 .urls = (const char *const *)S.urls,
                                 .worker = 0,
                                 .backup_urls = (const char *const *)S.backups,
                                 .timeout_ms = oc.ps_timeout_ms};
            if (ps_client_create(&co, &c, NULL) == CM_OK) ps_client_shutdown(c, NULL);
            ps_client_destroy(c);
        }
    } else if (rc == CM_OK && run_ps) {
        /* The workers still need this shard for the checkpoint they stop after, and worker 0
         * shuts the cluster down once it is written: a first signal only says so. */
        stop_on_signal("[ stopping] signal: serving on until the workers have written their "
                       "stop checkpoint and worker 0 shuts the cluster down (a second signal "
                       "stops at once)\n",
                       true);
        /* A signal with no worker there to stop (they are gone, or never came): a live worker
         * sends requests every step, and one at a checkpoint or a barrier has a request in
         * progress, so --ps-timeout without any after the signal means none is left to shut
         * this shard down. Not for a backup whose primary is connected: it sees only the
         * primary's updates, none in a phase without pushes (a long evaluation), and its
         * primary passes the shutdown on when it comes. */
        const uint32_t lone_ms = oc.ps_timeout_ms ? oc.ps_timeout_ms : PS_TIMEOUT_DEFAULT_MS;
        while (!ps_server_wait_for(servers[first_s], 100)) {
            const uint64_t idle = ps_server_idle_ms(servers[first_s]);
            if (__atomic_load_n(&stop_signal, __ATOMIC_RELAXED) != 0 && idle >= lone_ms &&
                !ps_server_primary_connected(servers[first_s])) {
                fprintf(stderr,
                        "ember train: shard %u: no worker request for %" PRIu64
                        " ms with a signal pending (--ps-timeout %u): no worker is left to shut "
                        "it down; stopping\n",
                        first_s, idle, lone_ms);
                ps_server_stop(servers[first_s]);
            }
        }
        res->stop_signal = __atomic_load_n(&stop_signal, __ATOMIC_RELAXED);
        if (ps_server_fenced(servers[first_s]))
            rc = cm_err(errptr, CM_ERR, "shard %u: its backup took over; this primary stopped",
                        first_s);
    }
out:
    if (rc == CM_OK && res->stopped_at != 0)
        ; /* said above */
    else if (rc == CM_OK && oc.eval_path)
        train_log(&S, "done: %" PRIu64 " rows in %.3f s, auc %.6f logloss %.6f", res->rows,
                  res->seconds, res->auc, res->logloss);
    else if (rc == CM_OK)
        train_log(&S, "done: %" PRIu64 " rows in %.3f s (no --eval)", res->rows, res->seconds);
    else
        train_log(&S, "failed: %s", errptr && *errptr ? *errptr : "(no message)");
    for (uint32_t i = 0; servers && i < oc.shards; i++)
        ps_server_destroy(servers[i]);
    free(servers);
    for (uint32_t i = 0; workers && i < n_w; i++)
        free(workers[i].err);
    free(workers);
    setup_free(&S);
    return rc;
}

/* ---- cluster file: [cluster] ps = url, ...  backups = url, ...  workers = N ---- */

/* The longest ipc:// path: a socket address's sun_path, less its NUL. A longer one was refused
 * by nng only when a PS listened on it; a worker dialed it until its PS timeout, asking whether
 * the PS was running. */
#define CLUSTER_IPC_PATH_MAX (sizeof((struct sockaddr_un *)0)->sun_path - 1)

/* Where a URL that passed ps_url_check (len bytes) listens: the host (*n bytes at *host) and
 * port of a tcp:// URL, whichever of its variants (tls+, 4, 6) spells it, or an ipc:// path
 * and port 0. */
static void cluster_url_addr(const char *url, size_t len, const char **host, size_t *n,
                             unsigned long *port)
{
    size_t at = strcspn(url, ":") + 3; /* past "scheme://" */
    *host = url + at;
    *n = len - at;
    *port = 0;
    if (!strncmp(url, "ipc://", 6)) return;
    size_t colon = len;
    while (url[colon - 1] != ':')
        colon--;
    *n = colon - 1 - at;
    for (size_t i = colon; i < len; i++)
        *port = *port * 10 + (unsigned long)(url[i] - '0');
}

/* Whether two checked URLs name one address: "tcp://h:7400", "tcp://H:07400" and
 * "tls+tcp4://h:7400" all listen on h's port 7400 (host names are not case-sensitive). */
static bool cluster_url_same(const char *a, size_t alen, const char *b, size_t blen)
{
    const char *ha, *hb;
    size_t na, nb;
    unsigned long pa, pb;
    cluster_url_addr(a, alen, &ha, &na, &pa);
    cluster_url_addr(b, blen, &hb, &nb, &pb);
    bool ipc_a = !strncmp(a, "ipc://", 6), ipc_b = !strncmp(b, "ipc://", 6);
    if (ipc_a != ipc_b || na != nb || pa != pb) return false;
    return ipc_a ? !memcmp(ha, hb, na) : !strncasecmp(ha, hb, na);
}

/* Whether a URL's host (n bytes, an IPv6 address in its brackets) is nng's wildcard or an
 * unspecified address in any spelling (0.0.0.0, [::], [0::0]...): a PS listens on every
 * interface with it, but a worker that dials it reaches its own machine. */
static bool cluster_host_any(const char *host, size_t n)
{
    if (n == 1 && *host == '*') return true;
    char a[64];
    bool v6 = n >= 2 && host[0] == '[' && host[n - 1] == ']';
    if (v6) host++, n -= 2;
    if (n == 0 || n >= sizeof a) return false;
    memcpy(a, host, n), a[n] = 0;
    uint8_t addr[16];
    size_t bytes = v6 ? 16 : 4;
    if (inet_pton(v6 ? AF_INET6 : AF_INET, a, addr) != 1) return false;
    for (size_t i = 0; i < bytes; i++)
        if (addr[i] != 0) return false;
    return true;
}

/* Whether url (len bytes) can join a cluster: every role is a process of its own, so only a
 * transport between processes serves (inproc:// is one process's; nng refused any other
 * scheme, or none, only when it listened or dialed, with no file or line), and no other shard
 * or backup may have its address (the second could not listen beside the first, and workers would
 * send one shard's keys to another's PS). */
static int cluster_url_check(const train_cluster *c, const char *url, size_t len, char **errptr)
{
    static const char *const schemes[] = {"tcp://",      "tcp4://",     "tcp6://", "tls+tcp://",
                                          "tls+tcp4://", "tls+tcp6://", "ipc://"};
    bool known = false;
    for (size_t i = 0; i < sizeof schemes / sizeof schemes[0]; i++)
        known |= len > strlen(schemes[i]) && !strncmp(url, schemes[i], strlen(schemes[i]));
    if (!known)
        return cm_err(errptr, CM_EINVAL,
                      "bad URL '%.*s': want tcp://HOST:PORT, tls+tcp://HOST:PORT or ipc://PATH",
                      (int)len, url);
    /* A control character is no part of a host or a path: it made one URL of what was meant
     * as two ("a<VT>b"), which a worker dialed until it timed out. */
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)url[i] < 0x20 || url[i] == 0x7f)
            return cm_err(errptr, CM_EINVAL, "bad URL '%.*s...': control character 0x%02x", (int)i,
                          url, (unsigned char)url[i]);
    if (!strncmp(url, "ipc://", 6) && len - 6 > CLUSTER_IPC_PATH_MAX)
        return cm_err(errptr, CM_EINVAL,
                      "bad URL '%.*s': an ipc path of %zu bytes (at most %zu, a socket's)",
                      (int)len, url, len - 6, (size_t)CLUSTER_IPC_PATH_MAX);
    int rc = ps_url_check(url, len, errptr);
    if (rc != CM_OK) return rc;
    /* Workers dial the URL their PS listens on, so it must name the PS host: nng's wildcard
     * host is for listening only. */
    const char *host;
    size_t host_len;
    unsigned long port;
    cluster_url_addr(url, len, &host, &host_len, &port);
    if (port != 0 && cluster_host_any(host, host_len))
        return cm_err(errptr, CM_EINVAL,
                      "bad URL '%.*s': '%.*s' (any address) is for listening, and workers dial "
                      "the URL: name the PS host",
                      (int)len, url, (int)host_len, host);
    char *const *lists[2] = {c->urls, c->backups};
    const uint32_t counts[2] = {c->n_shards, c->n_backups};
    static const char *const keys[2] = {"ps", "backups"};
    for (int l = 0; l < 2; l++)
        for (uint32_t i = 0; i < counts[l]; i++) {
            const char *u = lists[l][i];
            if (!cluster_url_same(u, strlen(u), url, len)) continue;
            if (strlen(u) == len && !strncmp(u, url, len))
                return cm_err(errptr, CM_EINVAL,
                              "URL '%.*s' given twice (already %s URL %u): every shard and "
                              "backup needs its own",
                              (int)len, url, keys[l], i);
            return cm_err(errptr, CM_EINVAL,
                          "URL '%.*s' names %s URL %u's address ('%s'): every shard and backup "
                          "needs its own",
                          (int)len, url, keys[l], i, u);
        }
    return CM_OK;
}

/* What separates a list's URLs: commas and blanks (a tab is as much a blank as a space:
 * without it "a<TAB>b" read as one URL). */
#define CLUSTER_URL_SEP " \t,"

/* Appends the comma- or blank-separated URLs of v, key k's value, to *list. */
static int url_list(const train_cluster *c, const char *k, const char *v, char ***list, uint32_t *n,
                    char **errptr)
{
    /* A value without a URL is a mistake, not a list of none: "backups =" would run the job
     * without the backups the key asks for. */
    const size_t lead = strspn(v, CLUSTER_URL_SEP);
    if (v[lead] == '\0') return cm_err(errptr, CM_EINVAL, "%s: no URL in the value", k);
    for (const char *p = v; *p;) {
        /* "a,,b" or a comma at either end: an entry left out (a shard's URL forgotten), not a
         * shorter list. */
        int commas = 0;
        while (*p != '\0' && strchr(CLUSTER_URL_SEP, *p) != NULL)
            commas += *p++ == ',';
        if (commas > 1 || (commas == 1 && (p == v + lead || *p == '\0')))
            return cm_err(errptr, CM_EINVAL, "%s: an empty entry in the list '%s'", k, v);
        size_t len = strcspn(p, CLUSTER_URL_SEP);
        if (len == 0) break;
        if (*n >= PS_MAX_SHARDS) return cm_err(errptr, CM_EINVAL, "too many URLs");
        int rc = cluster_url_check(c, p, len, errptr);
        if (rc != CM_OK) return rc;
        char **l = realloc(*list, (*n + 1) * sizeof *l);
        if (l == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
        *list = l;
        if ((l[*n] = strndup(p, len)) == NULL) return cm_err(errptr, CM_ENOMEM, "out of memory");
        (*n)++;
        p += len;
    }
    return CM_OK;
}

/* A parse in progress: what the checks of the whole file name. */
typedef struct cluster_parse {
    train_cluster *c;
    int tls_url_line;     /* the first list with a tls+tcp:// URL, 0 when none has one */
    int plain_url_line;   /* the first list with a plain tcp:// URL (4 and 6 too), or 0 */
    int tls_line;         /* the first tls_* key, and its name */
    const char *tls_name; /* static */
} cluster_parse;

static int cluster_entry(void *arg, int line, const char *section, const char *sarg, const char *k,
                         const char *v, char **errptr)
{
    cluster_parse *P = arg;
    train_cluster *c = P->c;
    if (!*section && k != NULL) return cm_ini_key_outside(errptr, k, "[cluster]");
    if (strcmp(section, "cluster") || *sarg)
        return cm_ini_unknown_section(errptr, section, sarg, "cluster");
    if (k == NULL) return CM_OK;
    if (!strcmp(k, "workers")) {
        uint64_t n;
        if (cm_parse_size(v, &n) || n == 0 || n > PS_MAX_WORKERS)
            return cm_err(errptr, CM_EINVAL, "bad workers '%s'", v);
        c->n_workers = (uint32_t)n;
        return CM_OK;
    }
    /* PEM files for tls+tcp:// URLs, as in ember ps's [cluster] (the three are the same size). */
    static const char *const tls_keys[] = {"tls_cert", "tls_key", "tls_ca"};
    char *const tls_paths[] = {c->tls_cert, c->tls_key, c->tls_ca};
    for (size_t i = 0; i < sizeof tls_keys / sizeof tls_keys[0]; i++) {
        if (strcmp(k, tls_keys[i])) continue;
        /* An empty path names nothing, and an empty tls_ca would turn off the peer checks its
         * key asks for (ember ps's config refuses it too). */
        if (v[0] == '\0') return cm_err(errptr, CM_EINVAL, "%s: empty path", k);
        if (strlen(v) >= sizeof c->tls_cert)
            return cm_err(errptr, CM_EINVAL, "%s: path too long", k);
        snprintf(tls_paths[i], sizeof c->tls_cert, "%s", v);
        if (P->tls_line == 0) P->tls_line = line, P->tls_name = tls_keys[i];
        return CM_OK;
    }
    char ***list = !strcmp(k, "ps") ? &c->urls : !strcmp(k, "backups") ? &c->backups : NULL;
    if (list == NULL) {
        static const char *const keys[] = {"ps",       "backups", "workers",
                                           "tls_cert", "tls_key", "tls_ca"};
        return cm_ini_unknown_key(errptr, k, "[cluster]", keys, sizeof keys / sizeof keys[0]);
    }
    uint32_t *n = list == &c->urls ? &c->n_shards : &c->n_backups;
    int rc = url_list(c, k, v, list, n, errptr);
    for (uint32_t i = 0; rc == CM_OK && i < *n; i++) {
        int *first = !strncmp((*list)[i], "tls+", 4)  ? &P->tls_url_line
                     : !strncmp((*list)[i], "tcp", 3) ? &P->plain_url_line
                                                      : NULL;
        if (first && *first == 0) *first = line;
    }
    return rc;
}

/* The checks of the whole file: the lists' lengths agree, and the TLS files go with tls+tcp://
 * URLs (they are read for those only: given with none they were ignored without a word, and a
 * tls+tcp:// PS without a certificate stopped only when it listened, the file not named). */
static int cluster_check(const cluster_parse *P, const char *path, char **errptr)
{
    const train_cluster *c = P->c;
    if (c->n_shards == 0) return cm_err(errptr, CM_EINVAL, "%s: no ps URLs", path);
    if (c->n_backups != 0 && c->n_backups != c->n_shards)
        return cm_err(errptr, CM_EINVAL, "%s: %u backups for %u ps URLs (one per shard, or none)",
                      path, c->n_backups, c->n_shards);
    if (P->tls_line != 0 && P->tls_url_line == 0)
        return cm_err(errptr, CM_EINVAL, "%s:%d: %s but no tls+tcp:// URL (it would be ignored)",
                      path, P->tls_line, P->tls_name);
    /* ipc:// stays on one machine; a plain tcp:// PS would be the one unencrypted link. */
    if (P->tls_url_line != 0 && P->plain_url_line != 0) {
        bool plain_later = P->plain_url_line > P->tls_url_line;
        return cm_err(errptr, CM_EINVAL,
                      "%s:%d: %s URL beside the %s URLs of line %d (a plain link in an encrypted "
                      "cluster)",
                      path, plain_later ? P->plain_url_line : P->tls_url_line,
                      plain_later ? "plain tcp://" : "tls+tcp://",
                      plain_later ? "tls+tcp://" : "plain tcp://",
                      plain_later ? P->tls_url_line : P->plain_url_line);
    }
    if (P->tls_url_line != 0 && c->tls_cert[0] == '\0')
        return cm_err(errptr, CM_EINVAL,
                      "%s:%d: tls+tcp:// URLs need tls_cert (every process presents it)", path,
                      P->tls_url_line);
    return CM_OK;
}

int train_cluster_load(const char *path, train_cluster *c, char **errptr)
{
    memset(c, 0, sizeof *c);
    c->n_workers = 1;
    cluster_parse P = {.c = c};
    int rc = cm_ini_parse(path, cluster_entry, &P, errptr);
    if (rc == CM_OK) rc = cluster_check(&P, path, errptr);
    if (rc != CM_OK) train_cluster_free(c);
    return rc;
}

void train_cluster_free(train_cluster *c)
{
    for (uint32_t i = 0; i < c->n_shards; i++)
        free(c->urls[i]);
    free(c->urls);
    for (uint32_t i = 0; i < c->n_backups; i++)
        free(c->backups[i]);
    free(c->backups);
    c->urls = c->backups = NULL;
    c->n_shards = c->n_backups = 0;
}
