/*
 * What the training benchmarks share (tools/bench_train.c on the CPU, tools/bench_gpu.c on a
 * GPU): the generated and cached data set with its PyTorch dump, one `ember train` run, one
 * tools/bench_train.py run, and reading their one-line JSON results. Built once into the
 * ember_bench_train library (tools/CMakeLists.txt) so both programs run the very same steps.
 *
 * Like bench_util.h, these stop the program (bench_die) on a failure of the benchmark itself;
 * a failed ember or PyTorch run is not one: it is reported in the result (ok / ran = 0).
 */
#ifndef EMBER_TOOLS_TRAIN_BENCH_H
#define EMBER_TOOLS_TRAIN_BENCH_H

#include <stddef.h>
#include <stdint.h>

/* The shape both sides train (ember's mlp preset; tools/bench_train.py builds the same). */
#define BENCH_BATCH 2048u
#define BENCH_DIM 16u
#define BENCH_HIDDEN0 256u
#define BENCH_HIDDEN1 128u
#define BENCH_EMB_LR "0.05"
#define BENCH_DENSE_LR "0.001"
/* Seeds 1..BENCH_MAX_PAIRS: the initial-weight files written with the dump. */
#define BENCH_MAX_PAIRS 8
#define BENCH_MAX_EXTRA 32

typedef struct bench_train_opts {
    uint64_t rows, eval_rows, seed;
    int quick, no_torch, no_install, no_bf16;
    int torch_own_init; /* PyTorch draws its own initial weights instead of starting from ember's */
    int no_dump;        /* data without the PyTorch dump (a table too large for PyTorch anyway) */
    uint32_t pairs;     /* bench_train: seeds in the AUC comparison (1..BENCH_MAX_PAIRS) */
    char models[128], threads_list[64];
    const char *dir, *ember, *python, *py_script;
    const char *launch; /* tools/launch, beside py_script */
    const char *device; /* `ember train --device` and bench_train.py --device: "cpu", "cuda" */
    int torch_threads;  /* torch.set_num_threads */
    int bf16;           /* mixed precision: `ember train --bf16` (AMX GEMMs), bench_train.py --bf16
                         * (torch.autocast); runs go to directories named -bf16 */
    /* The embedded run's layout: worker threads and PS shards (0 = 1 each); a run other than
     * 1 x 1 gets its own directory (-wW-sS). */
    uint32_t workers, shards;
    const char *extra[BENCH_MAX_EXTRA]; /* more arguments for every `ember train` */
    int n_extra;
} bench_train_opts;

/* Defaults: seed 1, device cpu, PyTorch on 2 threads, data under $EMBER_BENCH_DIR or
 * /tmp/ember-bench, build/ember beside this program, tools/bench_train.py beside its source,
 * Debian's python3; prog names the program in messages (also bench_init for this library). */
void bench_train_opts_init(bench_train_opts *o, const char *prog);
/* One command-line option both benchmarks take (--quick, --no-torch, --model(s), --rows,
 * --eval-rows, --seed, --dir, --ember, --python, --train-arg, at most max_extra of the last):
 * a is the word, v the next one or NULL. Returns the words used (1 or 2), 0 when a is none of
 * them, -1 when its value is missing or one --train-arg too many. */
int bench_train_opt(bench_train_opts *o, const char *a, const char *v, int max_extra);
/* Row counts left at 0 by the options: 2M + 200K, or 300K + 30K with --quick. */
void bench_train_opts_finish(bench_train_opts *o);

typedef struct bench_dataset {
    char dir[4096], tsv[4200], shards[4200], train[4300], eval[4300], dump[4300];
    uint64_t rows_train, rows_eval;
    uint64_t table_rows; /* distinct keys + 1 (the dump's padding row 0) */
    uint32_t F, D;
    int cached;
    double gen_s, ingest_s, dump_s;
} bench_dataset;

/* `ember gen` rows + eval_rows (seed), ingested with eval held out by row hash, plus the
 * PyTorch dump and initial weights unless no_dump; cached under
 * <dir>/train-<rows>-e<eval>-s<seed>/ and reused (a cached set lacking a wanted dump gets it). */
void bench_train_data(const bench_train_opts *o, bench_dataset *ds);

typedef struct bench_ember_run {
    char model[16];
    int threads, ok;
    double auc, logloss, samples_per_s, seconds, train_loss;
    double loop_samples_per_s, loop_seconds; /* from metrics.jsonl's last line */
    uint64_t rows, eval_rows;
    /* Where a step went, ms (ember train's JSON, in this order: step_ms, wait_batch_ms,
     * wait_push_ms, dense_ms, puller_early_ms, puller_push_ms, puller_late_ms, handover_ms);
     * NaN where the binary did not report it. */
    double step_parts[8];
} bench_ember_run;

/* The names of bench_ember_run.step_parts, as ember train's JSON has them. */
extern const char *const bench_step_part_names[8];

/* One `ember train` (o->workers x o->shards, 1 x 1 by default; batch 2048, Adagrad embeddings,
 * Adam tower, one epoch in file order) on o->device, into
 * <ds dir>/run-[device-]model-tT-sS[-ipc][-wW-sS]: the embedded PS, or with ipc `ember ps`
 * processes and worker processes over ipc:// (tools/launch). */
void bench_train_ember(const bench_train_opts *o, const bench_dataset *ds, const char *model,
                       int threads, uint32_t seed, int ipc, bench_ember_run *er);

typedef struct bench_torch_run {
    int ran, installed;
    char why[4600], version[32];
    double samples_per_s, seconds, auc, logloss, train_loss, load_seconds;
} bench_torch_run;

/* tools/bench_train.py on the dump (the mlp), on o->device; ran = 0 with why when skipped or
 * failed. On the CPU a full run installs Debian's python3-torch when missing; never for cuda
 * (Debian's build has no CUDA). */
void bench_train_torch(const bench_train_opts *o, const bench_dataset *ds, uint32_t seed,
                       bench_torch_run *t);

/* The last non-empty line of a file that contains `with` (NULL: any) into buf ("" when none). */
void bench_last_line(const char *path, const char *with, char *buf, size_t n);
/* The number after "key": in a one-line JSON object; NAN when absent. */
double bench_json_num(const char *line, const char *key);

#endif
