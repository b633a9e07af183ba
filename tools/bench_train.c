/*
 * bench train: ember train end to end against the same model in PyTorch and against the
 * machine's sgemm roofline.
 *
 * Data: `ember gen --seed S` writes rows + eval rows of Criteo TSV (default 2M + 200K), and
 * ds_ingest_run holds out eval/(rows+eval) of them by row hash (--eval-fraction), so train and
 * eval come from the same planted click model (a second seed would be a different model).
 * Everything is cached under <dir>/train-<total>-s<seed>/ and reused.
 *
 * ember: `ember train` (embedded PS, 1 worker, 1 shard, batch 2048, Adagrad lr 0.05 embeddings,
 * Adam lr 0.001 tower, one epoch, file order) for each model of --models (default mlp,lr); mlp
 * runs with --threads 1 and --threads 2 and the faster is reported. Two rates are recorded:
 * ember's own samples_per_s (wall time from setup to the end, so it includes the final
 * checkpoint and the evaluation), and the training-loop rate from the last line of
 * metrics.jsonl (samples / seconds at the last step: reader, dedup, pulls, compute and pushes,
 * no eval). The loop rate is the one compared with PyTorch.
 *
 * PyTorch (tools/bench_train.py, Debian's python3-torch, CPU, 2 threads): the same rows, read
 * from a binary dump this program writes with the public datasets reader (labels; dense values
 * as sign(x)*log1p(|x|), as ember does; per-field keys remapped to rows of one table, every
 * distinct (field, token) its own row, row 0 a zero padding row for a missing field); the same
 * model (F x 16 + D -> 256 -> 128 -> 1, ReLU, Xavier-uniform weights, zero biases, embeddings
 * uniform +-0.05), BCE-with-logits, batch 2048, Adagrad lr 0.05 (eps 1e-8) on the embeddings,
 * Adam lr 0.001 on the MLP, one epoch in file order. Only the training loop is timed (data
 * already in tensors); then AUC and logloss on the held-out rows. A full run installs
 * python3-torch with apt-get when it is missing (and says so); --quick never installs and skips
 * PyTorch with a message when it is missing.
 *
 * Roofline: cblas_sgemm from OpenBLAS (dlopen'ed, 2 threads) on the mlp's own GEMMs at batch
 * 2048 (forward X W^T, backward dY W and dY^T X for every layer) gives GFLOP/s; divided by the
 * FLOPs a sample needs (6 * in * out summed over the layers, model_flops_per_sample's formula)
 * it gives the samples/s the dense tower alone would allow.
 *
 * Usage: tools/bench train [--quick] [--model M | --models M,M] [--rows N] [--eval-rows N]
 *        [--seed S] [--threads-list 1,2] [--no-torch] [--no-install] [--torch-own-init]
 *        [--pairs N] [--dir DIR] [--ember PATH] [--python PATH] [--train-arg ARG]...
 *   --quick       300K + 30K rows, no install
 *   --torch-own-init  PyTorch draws its own initial weights; by default it starts from exactly
 *                 ember's (embedding rows and tower, written next to the dump), because the
 *                 initial draw alone moves the mlp's AUC by up to 0.004 on these data
 *   --pairs N     AUC pairs (ember at the reported thread count and PyTorch, seeds 1..N, each
 *                 pair from the same weights; default 3, --quick 1): the AUC goal is judged on
 *                 the means, since one run's AUC moves by ~0.003 with float summation order
 *   --train-arg   one more argument for every `ember train` (repeatable), for experiments
 * Prints a table, then one JSON object as the last line.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <libgen.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/common.h"
#include "datasets/datasets.h"
#include "embedding/embedding.h"
#include "src/model.h"
#include "tools/bench_util.h"

#define BATCH 2048u
#define DIM 16u
#define HIDDEN0 256u
#define HIDDEN1 128u
#define EMB_LR "0.05"
#define DENSE_LR "0.001"
#define MAX_PAIRS 3 /* seeds 1..MAX_PAIRS: initial-weight files written with the dump */
#define GOAL_AUC_GAP 0.001
#define GOAL_SPEEDUP 3.0
#define MAX_MODELS 4
#define MAX_EXTRA 32

typedef struct opts {
    uint64_t rows, eval_rows, seed;
    int quick, no_torch, no_install;
    int torch_own_init; /* PyTorch draws its own initial weights instead of starting from ember's */
    uint32_t pairs;     /* seeds in the AUC comparison (1..MAX_PAIRS) */
    char models[128], threads_list[64];
    const char *dir, *ember, *python, *py_script;
    const char *extra[MAX_EXTRA];
    int n_extra;
} opts;

typedef struct ember_run {
    char model[16];
    int threads, ok;
    double auc, logloss, samples_per_s, seconds, train_loss;
    double loop_samples_per_s, loop_seconds; /* from metrics.jsonl's last line */
    uint64_t rows, eval_rows;
} ember_run;

/* The last non-empty line of a file into buf ("" when none). */
static void last_line(const char *path, char *buf, size_t n)
{
    buf[0] = '\0';
    FILE *f = fopen(path, "r");
    if (f == NULL) return;
    char line[8192];
    while (fgets(line, sizeof line, f))
        if (line[0] != '\n' && line[0] != '\0') snprintf(buf, n, "%s", line);
    fclose(f);
}

/* The number after "key": in a one-line JSON object; NAN when absent. */
static double json_num(const char *line, const char *key)
{
    char pat[96];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(line, pat);
    if (p == NULL) return NAN;
    p += strlen(pat);
    while (*p == ' ')
        p++;
    char *end;
    double v = strtod(p, &end);
    return end == p ? NAN : v;
}

/* ---- data: gen, ingest, binary dump for PyTorch ---- */

typedef struct keymap {
    uint64_t *keys;
    uint32_t *ids;
    uint64_t cap, n; /* n distinct keys; ids 1..n (0 = missing field) */
} keymap;

static uint32_t keymap_get(keymap *m, uint64_t key)
{
    if (2 * (m->n + 1) > m->cap) {
        uint64_t cap = m->cap ? m->cap * 2 : (1u << 20);
        uint64_t *k = bench_xmalloc(cap * sizeof *k);
        uint32_t *v = calloc(cap, sizeof *v);
        if (v == NULL) bench_die("out of memory", NULL);
        for (uint64_t i = 0; i < m->cap; i++)
            if (m->ids[i]) {
                uint64_t h = (m->keys[i] * 0x9E3779B97F4A7C15ull) >> 20 & (cap - 1);
                while (v[h])
                    h = (h + 1) & (cap - 1);
                k[h] = m->keys[i];
                v[h] = m->ids[i];
            }
        free(m->keys);
        free(m->ids);
        m->keys = k;
        m->ids = v;
        m->cap = cap;
    }
    uint64_t h = (key * 0x9E3779B97F4A7C15ull) >> 20 & (m->cap - 1);
    while (m->ids[h] && m->keys[h] != key)
        h = (h + 1) & (m->cap - 1);
    if (!m->ids[h]) {
        m->keys[h] = key;
        m->ids[h] = (uint32_t)++m->n;
    }
    return m->ids[h];
}

static inline float squash(float x)
{
    return x >= 0.0f ? log1pf(x) : -log1pf(-x);
}

typedef struct dump_part {
    uint64_t n;
    uint32_t F, D;
    float *labels, *dense;
    int32_t *idx;
} dump_part;

/* Reads every row of a shard directory in file order (what ember train reads, unshuffled). */
static void read_part(const char *dir, keymap *km, dump_part *p, uint64_t *multi)
{
    ds_reader_opts ro;
    ds_reader_opts_init(&ro);
    const char *paths[1] = {dir};
    ro.paths = paths;
    ro.n_paths = 1;
    ro.batch_size = 65536;
    ds_reader *r = NULL;
    char *err = NULL;
    if (ds_reader_open(&ro, &r, &err) != CM_OK) bench_die("ds_reader_open", err);
    const ds_schema *s = ds_reader_schema(r);
    p->F = s->n_fields;
    p->D = s->n_dense;
    uint64_t cap = ds_reader_rows(r);
    p->labels = bench_xmalloc(cap * sizeof(float));
    p->dense = bench_xmalloc(cap * p->D * sizeof(float));
    p->idx = bench_xmalloc(cap * p->F * sizeof(int32_t));
    p->n = 0;
    const ds_batch *b;
    int got;
    while ((got = ds_reader_next(r, &b, &err)) == 1) {
        if (p->n + b->n_rows > cap) bench_die("shards hold more rows than their index says", NULL);
        for (uint32_t i = 0; i < b->n_rows; i++) {
            uint64_t row = p->n + i;
            p->labels[row] = b->labels[i];
            for (uint32_t d = 0; d < p->D; d++)
                p->dense[row * p->D + d] = squash(b->dense[(size_t)i * p->D + d]);
            for (uint32_t f = 0; f < p->F; f++) {
                uint32_t lo = b->offsets[(size_t)i * p->F + f],
                         hi = b->offsets[(size_t)i * p->F + f + 1];
                if (hi > lo + 1) (*multi)++; /* Criteo has one key a field; keep the first */
                p->idx[row * p->F + f] = hi > lo ? (int32_t)keymap_get(km, b->keys[lo]) : 0;
            }
        }
        p->n += b->n_rows;
    }
    if (got < 0) bench_die("ds_reader_next", err);
    ds_reader_destroy(r);
}

static void write_all(FILE *f, const void *p, size_t n)
{
    if (fwrite(p, 1, n, f) != n) bench_die("writing the PyTorch dump failed", NULL);
}

/* ember's own initial weights for the mlp, so PyTorch can start from exactly them (--same-init):
 * "EMBRTI01", u64 table rows V, u32 dim, u32 layers, per layer u32 in, u32 out, f32 W[out*in]
 * (row-major, as torch.nn.Linear keeps it), f32 b[out]; then f32 emb[V*dim], row 0 zero and
 * row id the initial row of the key with that id. The embedding rows come from an emb_table with
 * the trainer's settings (the rows it would create), the tower from model_init_params. */
static void write_init(const char *path, const keymap *km, uint32_t F, uint32_t D, uint64_t seed)
{
    char *err = NULL;
    model_cfg m;
    model_layout l;
    model_cfg_preset(&m, MODEL_MLP, F, D);
    m.seed = seed; /* ember train --seed draws the tower and the rows */
    bench_check(model_layout_make(&m, &l, &err), err, "model layout");
    float *params = bench_xmalloc(l.n_params * sizeof(float));
    model_init_params(&m, &l, params);
    emb_table_config cfg;
    emb_table_config_init(&cfg);
    cfg.dim = m.dim;
    cfg.opt = EMB_OPT_ADAGRAD;
    cfg.init_scale = 0.05f; /* as src/train.c sets it */
    cfg.seed = seed;
    emb_table *t = NULL;
    bench_check(emb_table_create(&cfg, &t, &err), err, "emb_table_create");
    uint64_t V = km->n + 1;
    uint64_t *keys = bench_xmalloc(V * sizeof *keys);
    for (uint64_t i = 0; i < km->cap; i++)
        if (km->ids[i]) keys[km->ids[i]] = km->keys[i];
    float *emb = bench_xmalloc(V * cfg.dim * sizeof *emb);
    memset(emb, 0, cfg.dim * sizeof *emb);
    for (uint64_t i = 1; i < V; i += 65536) {
        size_t n = V - i < 65536 ? (size_t)(V - i) : 65536;
        bench_check(emb_table_pull(t, keys + i, n, emb + i * cfg.dim, &err), err, "init rows");
    }
    emb_table_destroy(t);
    char tmp[4500];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (f == NULL) bench_die("cannot create the initial-weights file", NULL);
    uint32_t layers = l.n_top;
    write_all(f, "EMBRTI01", 8);
    write_all(f, &V, 8);
    write_all(f, &cfg.dim, 4);
    write_all(f, &layers, 4);
    for (uint32_t i = 0; i < layers; i++) {
        write_all(f, &l.top[i].in, 4);
        write_all(f, &l.top[i].out, 4);
        write_all(f, params + l.top[i].w, (size_t)l.top[i].in * l.top[i].out * sizeof(float));
        write_all(f, params + l.top[i].b, l.top[i].out * sizeof(float));
    }
    write_all(f, emb, V * cfg.dim * sizeof *emb);
    if (fclose(f) != 0 || rename(tmp, path) != 0)
        bench_die("writing the initial-weights file failed", NULL);
    free(keys);
    free(emb);
    free(params);
}

/* Dump layout (little endian): "EMBRTB01", u64 n_train, u64 n_eval, u32 F, u32 D,
 * u64 table rows (distinct keys + 1), then for train and eval: f32 labels[n], f32 dense[n*D],
 * i32 idx[n*F]. */
static void init_path(const char *dir, uint32_t seed, char *out, size_t n)
{
    snprintf(out, n, "%s/torch-init-s%u.bin", dir, seed);
}

static void write_dump(const char *path, const char *dir, const char *train_dir,
                       const char *eval_dir, uint64_t *table_rows)
{
    keymap km = {0};
    dump_part tr, ev;
    uint64_t multi = 0;
    read_part(train_dir, &km, &tr, &multi);
    read_part(eval_dir, &km, &ev, &multi);
    if (multi)
        fprintf(stderr,
                "bench train: %" PRIu64 " fields held several keys; the dump keeps the first\n",
                multi);
    char tmp[4400];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (f == NULL) bench_die("cannot create the PyTorch dump", NULL);
    uint64_t V = km.n + 1;
    write_all(f, "EMBRTB01", 8);
    write_all(f, &tr.n, 8);
    write_all(f, &ev.n, 8);
    write_all(f, &tr.F, 4);
    write_all(f, &tr.D, 4);
    write_all(f, &V, 8);
    dump_part *parts[2] = {&tr, &ev};
    for (int i = 0; i < 2; i++) {
        dump_part *p = parts[i];
        write_all(f, p->labels, p->n * sizeof(float));
        write_all(f, p->dense, p->n * p->D * sizeof(float));
        write_all(f, p->idx, p->n * p->F * sizeof(int32_t));
        free(p->labels);
        free(p->dense);
        free(p->idx);
    }
    if (fclose(f) != 0 || rename(tmp, path) != 0)
        bench_die("writing the PyTorch dump failed", NULL);
    for (uint32_t seed = 1; seed <= MAX_PAIRS; seed++) {
        char ip[4400];
        init_path(dir, seed, ip, sizeof ip);
        write_init(ip, &km, tr.F, tr.D, seed);
    }
    free(km.keys);
    free(km.ids);
    *table_rows = V;
}

typedef struct dataset {
    char dir[4096], tsv[4200], shards[4200], train[4300], eval[4300], dump[4300];
    uint64_t rows_train, rows_eval, table_rows;
    uint32_t F, D;
    int cached;
    double gen_s, ingest_s, dump_s;
} dataset;

static void prepare_data(const opts *o, dataset *ds)
{
    uint64_t total = o->rows + o->eval_rows;
    snprintf(ds->dir, sizeof ds->dir, "%s/train-%" PRIu64 "-e%" PRIu64 "-s%" PRIu64, o->dir,
             o->rows, o->eval_rows, o->seed);
    snprintf(ds->tsv, sizeof ds->tsv, "%s/data.tsv", ds->dir);
    snprintf(ds->shards, sizeof ds->shards, "%s/shards", ds->dir);
    snprintf(ds->train, sizeof ds->train, "%s/train", ds->shards);
    snprintf(ds->eval, sizeof ds->eval, "%s/eval", ds->shards);
    snprintf(ds->dump, sizeof ds->dump, "%s/torch.bin", ds->dir);
    char last_init[4400];
    init_path(ds->dir, MAX_PAIRS, last_init, sizeof last_init);
    char ready[4300], line[512];
    snprintf(ready, sizeof ready, "%s/READY", ds->dir);
    FILE *f = fopen(ready, "r");
    if (f) {
        unsigned long long a, b, c, d, e;
        int ok = fgets(line, sizeof line, f) &&
                 sscanf(line, "%llu %llu %llu %llu %llu", &a, &b, &c, &d, &e) == 5 &&
                 bench_file_size(ds->dump) > 0 && bench_file_size(last_init) > 0;
        fclose(f);
        if (ok) {
            ds->rows_train = a, ds->rows_eval = b, ds->table_rows = c, ds->F = (uint32_t)d,
            ds->D = (uint32_t)e;
            ds->cached = 1;
            return;
        }
    }
    char *err = NULL;
    if (cm_mkdirs(ds->dir, &err) != CM_OK) bench_die("data directory", err);
    char rows_s[32], seed_s[32];
    snprintf(rows_s, sizeof rows_s, "%" PRIu64, total);
    snprintf(seed_s, sizeof seed_s, "%" PRIu64, o->seed);
    fprintf(stderr, "bench train: generating %s rows (seed %s) into %s\n", rows_s, seed_s, ds->tsv);
    double t0 = cm_now();
    /* --threads 1: see bench_ingest.c (ember gen's threaded writer can deadlock under load). */
    char *gen[] = {(char *)o->ember, "gen", "--rows", rows_s,  "--seed", seed_s,
                   "--threads",      "1",   "--out",  ds->tsv, NULL};
    if (bench_run_cmd(gen, "/dev/null", NULL) != 0) bench_die("ember gen failed", NULL);
    ds->gen_s = cm_now() - t0;
    ds_ingest_opts io;
    ds_ingest_opts_init(&io);
    io.parser.format = DS_FMT_CRITEO;
    const char *inputs[1] = {ds->tsv};
    io.inputs = inputs;
    io.n_inputs = 1;
    io.out_dir = ds->shards;
    io.eval_fraction = (double)o->eval_rows / (double)total;
    ds_ingest_result res;
    if (ds_ingest_run(&io, &res, &err) != CM_OK) bench_die("ds_ingest_run", err);
    ds->ingest_s = res.seconds;
    ds->rows_train = res.rows_train;
    ds->rows_eval = res.rows_eval;
    fprintf(stderr,
            "bench train: ingested %" PRIu64 " train + %" PRIu64
            " eval rows; writing the PyTorch dump\n",
            res.rows_train, res.rows_eval);
    t0 = cm_now();
    write_dump(ds->dump, ds->dir, ds->train, ds->eval, &ds->table_rows);
    ds->dump_s = cm_now() - t0;
    ds->F = 26, ds->D = 13;
    {
        /* F and D from the shards themselves. */
        ds_reader_opts ro;
        ds_reader_opts_init(&ro);
        const char *paths[1] = {ds->train};
        ro.paths = paths;
        ro.n_paths = 1;
        ds_reader *r = NULL;
        if (ds_reader_open(&ro, &r, &err) != CM_OK) bench_die("ds_reader_open", err);
        ds->F = ds_reader_schema(r)->n_fields;
        ds->D = ds_reader_schema(r)->n_dense;
        ds_reader_destroy(r);
    }
    unlink(ds->tsv); /* the shards and the dump are what later runs need */
    f = fopen(ready, "w");
    if (f == NULL) bench_die("cannot write READY", NULL);
    fprintf(f, "%" PRIu64 " %" PRIu64 " %" PRIu64 " %u %u\n", ds->rows_train, ds->rows_eval,
            ds->table_rows, ds->F, ds->D);
    fclose(f);
}

/* ---- ember train ---- */

static void run_ember(const opts *o, const dataset *ds, const char *model, int threads,
                      uint32_t seed, ember_run *er)
{
    memset(er, 0, sizeof *er);
    snprintf(er->model, sizeof er->model, "%s", model);
    er->threads = threads;
    char out[4400], so[4500], se[4500], mj[4500], th[16], sd[16];
    snprintf(out, sizeof out, "%s/run-%s-t%d-s%u", ds->dir, model, threads, seed);
    snprintf(sd, sizeof sd, "%u", seed);
    snprintf(so, sizeof so, "%s.stdout", out);
    snprintf(se, sizeof se, "%s.stderr", out);
    snprintf(mj, sizeof mj, "%s/metrics.jsonl", out);
    snprintf(th, sizeof th, "%d", threads);
    char *rm_err = NULL;
    cm_rmtree(out, &rm_err); /* a fresh run directory: no checkpoint to trip over */
    free(rm_err);
    const char *argv[64 + MAX_EXTRA];
    int n = 0;
    const char *fixed[] = {
        o->ember,       "train", "--train",    ds->train, "--eval",          ds->eval,
        "--model",      model,   "--out",      out,       "--device",        "cpu",
        "--batch",      "2048",  "--epochs",   "1",       "--workers",       "1",
        "--shards",     "1",     "--threads",  th,        "--emb-optimizer", "adagrad",
        "--emb-lr",     EMB_LR,  "--dense-lr", DENSE_LR,  "--seed",          sd,
        "--no-progress"};
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++)
        argv[n++] = fixed[i];
    for (int i = 0; i < o->n_extra; i++)
        argv[n++] = o->extra[i];
    argv[n] = NULL;
    fprintf(stderr, "bench train: ember train --model %s --threads %d --seed %u ...\n", model,
            threads, seed);
    int rc = bench_run_cmd((char *const *)argv, so, se);
    if (rc != 0) {
        fprintf(stderr,
                "bench train: ember train --model %s --threads %d failed (exit %d); see %s\n",
                model, threads, rc, se);
        return;
    }
    char line[8192];
    last_line(so, line, sizeof line);
    er->auc = json_num(line, "auc");
    er->logloss = json_num(line, "logloss");
    er->samples_per_s = json_num(line, "samples_per_s");
    er->seconds = json_num(line, "seconds");
    er->train_loss = json_num(line, "train_loss");
    er->rows = (uint64_t)json_num(line, "rows");
    er->eval_rows = (uint64_t)json_num(line, "eval_rows");
    last_line(mj, line, sizeof line);
    er->loop_seconds = json_num(line, "seconds");
    double samples = json_num(line, "samples");
    er->loop_samples_per_s = er->loop_seconds > 0 ? samples / er->loop_seconds : NAN;
    er->ok = isfinite(er->auc) && isfinite(er->loop_samples_per_s);
}

/* ---- PyTorch ---- */

typedef struct torch_run {
    int ran, installed;
    char why[4600], version[32];
    double samples_per_s, seconds, auc, logloss, train_loss, load_seconds;
} torch_run;

static int python_has_torch(const char *py)
{
    char *argv[] = {(char *)py, "-c", "import torch, numpy", NULL};
    return bench_run_cmd(argv, "/dev/null", "/dev/null") == 0;
}

static void run_torch(const opts *o, const dataset *ds, uint32_t seed, torch_run *t)
{
    memset(t, 0, sizeof *t);
    if (o->no_torch) {
        snprintf(t->why, sizeof t->why, "skipped (--no-torch)");
        return;
    }
    if (!python_has_torch(o->python)) {
        if (o->quick || o->no_install || geteuid() != 0 || access("/usr/bin/apt-get", X_OK) != 0) {
            snprintf(t->why, sizeof t->why,
                     "skipped: %s cannot import torch (apt-get install python3-torch%s)", o->python,
                     o->quick ? "; --quick never installs" : "");
            fprintf(stderr, "bench train: PyTorch %s\n", t->why);
            return;
        }
        fprintf(stderr,
                "bench train: %s cannot import torch: installing Debian's python3-torch "
                "(apt-get install -y python3-torch)\n",
                o->python);
        char *apt[] = {"apt-get", "install", "-y", "-q", "python3-torch", NULL};
        setenv("DEBIAN_FRONTEND", "noninteractive", 1);
        if (bench_run_cmd(apt, "/dev/null", NULL) != 0 || !python_has_torch(o->python)) {
            snprintf(t->why, sizeof t->why, "skipped: installing python3-torch failed");
            fprintf(stderr, "bench train: PyTorch %s\n", t->why);
            return;
        }
        t->installed = 1;
    }
    char out[4400], se[4400], ip[4400], sd[16];
    snprintf(out, sizeof out, "%s/torch-s%u.stdout", ds->dir, seed);
    snprintf(se, sizeof se, "%s/torch-s%u.stderr", ds->dir, seed);
    init_path(ds->dir, seed, ip, sizeof ip);
    snprintf(sd, sizeof sd, "%u", seed);
    char *argv[] = {(char *)o->python,
                    (char *)o->py_script,
                    "--data",
                    (char *)ds->dump,
                    "--threads",
                    "2",
                    "--batch",
                    "2048",
                    "--dim",
                    "16",
                    "--emb-lr",
                    EMB_LR,
                    "--dense-lr",
                    DENSE_LR,
                    "--seed",
                    sd,
                    o->torch_own_init ? NULL : "--init",
                    ip,
                    NULL};
    fprintf(stderr, "bench train: PyTorch (%s %s, 2 threads, %s) ...\n", o->python, o->py_script,
            o->torch_own_init ? "its own initial weights" : "ember's initial weights");
    int rc = bench_run_cmd(argv, out, se);
    char line[8192];
    last_line(out, line, sizeof line);
    if (rc != 0 || !isfinite(json_num(line, "auc"))) {
        snprintf(t->why, sizeof t->why, "failed (exit %d); see %s", rc, se);
        fprintf(stderr, "bench train: PyTorch %s\n", t->why);
        return;
    }
    t->ran = 1;
    t->samples_per_s = json_num(line, "samples_per_s");
    t->seconds = json_num(line, "seconds");
    t->auc = json_num(line, "auc");
    t->logloss = json_num(line, "logloss");
    t->train_loss = json_num(line, "train_loss");
    t->load_seconds = json_num(line, "load_seconds");
    const char *v = strstr(line, "\"torch\":\"");
    if (v) sscanf(v + 9, "%31[^\"]", t->version);
}

/* ---- sgemm roofline ---- */

typedef void (*sgemm_fn)(int order, int ta, int tb, int M, int N, int K, float alpha,
                         const float *A, int lda, const float *B, int ldb, float beta, float *C,
                         int ldc);
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef struct roofline {
    int ok;
    char lib[64];
    double gflops_model, gflops_peak, flops_per_sample, samples_per_s;
    double gflops_model_1t, samples_per_s_1t; /* OpenBLAS on 1 thread */
} roofline;

static void measure_roofline(uint32_t F, uint32_t D, double seconds, roofline *rf)
{
    memset(rf, 0, sizeof *rf);
    const char *libs[] = {"libopenblas.so.0", "libopenblas.so", "libblas.so.3"};
    void *h = NULL;
    for (size_t i = 0; i < 3 && h == NULL; i++)
        if ((h = dlopen(libs[i], RTLD_NOW | RTLD_LOCAL)) != NULL)
            snprintf(rf->lib, sizeof rf->lib, "%s", libs[i]);
    if (h == NULL) return;
    sgemm_fn sgemm = (sgemm_fn)dlsym(h, "cblas_sgemm");
    void (*set_threads)(int) = (void (*)(int))dlsym(h, "openblas_set_num_threads");
    if (sgemm == NULL) return;
    const uint32_t n_layers = 3, in[3] = {F * DIM + D, HIDDEN0, HIDDEN1},
                   outw[3] = {HIDDEN0, HIDDEN1, 1};
    const uint32_t B = BATCH;
    double fps = 0;
    for (uint32_t l = 0; l < n_layers; l++)
        fps += 6.0 * in[l] * outw[l];
    rf->flops_per_sample = fps;
    size_t maxw = (size_t)in[0] * outw[0];
    float *X = bench_xmalloc((size_t)B * in[0] * sizeof(float)),
          *W = bench_xmalloc(maxw * sizeof(float));
    float *Y = bench_xmalloc((size_t)B * in[0] * sizeof(float)),
          *dW = bench_xmalloc(maxw * sizeof(float));
    for (size_t i = 0; i < (size_t)B * in[0]; i++)
        X[i] = Y[i] = (float)((i * 7919u) % 1000u) * 1e-3f;
    for (size_t i = 0; i < maxw; i++)
        W[i] = (float)((i * 104729u) % 1000u) * 1e-3f;
    /* One "step": every layer forward (Y = X W^T) and backward (dX = dY W, dW = dY^T X); with
     * OpenBLAS on 2 threads (the roofline) and on 1 (for reference: 2 x that is what two
     * cores would give with no threading overhead). */
    for (int pass = 0; pass < 2; pass++) {
        if (set_threads) set_threads(pass == 0 ? 2 : 1);
        int steps = 0;
        double t0 = cm_now(), t;
        do {
            for (uint32_t l = 0; l < n_layers; l++) {
                int K = (int)in[l], N = (int)outw[l];
                sgemm(ROW_MAJOR, NO_TRANS, TRANS, (int)B, N, K, 1.0f, X, K, W, K, 0.0f, Y, N);
                sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, (int)B, K, N, 1.0f, Y, N, W, K, 0.0f, X, K);
                sgemm(ROW_MAJOR, TRANS, NO_TRANS, N, K, (int)B, 1.0f, Y, N, X, K, 0.0f, dW, K);
            }
            steps++;
            t = cm_now() - t0;
        } while (t < seconds || steps < 3);
        if (pass == 0) {
            rf->gflops_model = fps * B * steps / t / 1e9;
            rf->samples_per_s = (double)B * steps / t;
        } else {
            rf->gflops_model_1t = fps * B * steps / t / 1e9;
            rf->samples_per_s_1t = (double)B * steps / t;
        }
    }
    if (set_threads) set_threads(2);
    int steps;
    double t0, t;
    /* For reference: a large square sgemm, near the cores' peak. */
    const int S = 1024;
    float *A = bench_xmalloc((size_t)S * S * sizeof(float)),
          *Bm = bench_xmalloc((size_t)S * S * sizeof(float)),
          *C = bench_xmalloc((size_t)S * S * sizeof(float));
    for (size_t i = 0; i < (size_t)S * S; i++)
        A[i] = Bm[i] = (float)(i % 97) * 0.01f;
    sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, S, S, S, 1.0f, A, S, Bm, S, 0.0f, C, S);
    steps = 0;
    t0 = cm_now();
    do {
        sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, S, S, S, 1.0f, A, S, Bm, S, 0.0f, C, S);
        steps++;
        t = cm_now() - t0;
    } while (t < seconds / 2 || steps < 3);
    rf->gflops_peak = 2.0 * S * S * S * steps / t / 1e9;
    free(A), free(Bm), free(C), free(X), free(W), free(Y), free(dW);
    rf->ok = 1;
}

/* ---- main ---- */

static void default_paths(opts *o)
{
    static char py[4200];
    o->ember = bench_ember_path();
    /* bench_train.py sits beside this source file (__FILE__ is absolute under CMake). */
    snprintf(py, sizeof py, "%s", __FILE__);
    char *slash = strrchr(py, '/');
    if (slash)
        strcpy(slash + 1, "bench_train.py");
    else
        snprintf(py, sizeof py, "tools/bench_train.py");
    o->py_script = py;
    /* Debian's interpreter is the one python3-torch installs into. */
    o->python = access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3";
}

static int has_model(const opts *o, const char *m)
{
    char buf[128];
    snprintf(buf, sizeof buf, "%s", o->models);
    for (char *s = strtok(buf, ","); s; s = strtok(NULL, ","))
        if (!strcmp(s, m)) return 1;
    return 0;
}

static void usage(void)
{
    fprintf(
        stderr,
        "usage: bench_train [--quick] [--model M | --models M,M] [--rows N] [--eval-rows N]\n"
        "       [--seed S] [--threads-list 1,2] [--no-torch] [--no-install] [--torch-own-init]\n"
        "       [--dir DIR]\n"
        "       [--ember PATH] [--python PATH] [--train-arg ARG]...\n");
    exit(2);
}

static void loadavg(char *buf, size_t n)
{
    snprintf(buf, n, "?");
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%15s", buf) != 1) snprintf(buf, n, "?");
        fclose(f);
    }
}

int main(int argc, char **argv)
{
    bench_init("bench train", NULL);
    opts o = {.seed = 1};
    snprintf(o.models, sizeof o.models, "mlp,lr");
    snprintf(o.threads_list, sizeof o.threads_list, "1,2");
    default_paths(&o);
    o.dir = getenv("EMBER_BENCH_DIR") ? getenv("EMBER_BENCH_DIR") : "/tmp/ember-bench";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--quick"))
            o.quick = 1;
        else if (!strcmp(a, "--no-torch"))
            o.no_torch = 1;
        else if (!strcmp(a, "--no-install"))
            o.no_install = 1;
        else if (!strcmp(a, "--torch-own-init"))
            o.torch_own_init = 1;
        else if (v == NULL)
            usage();
        else if (!strcmp(a, "--model") || !strcmp(a, "--models"))
            snprintf(o.models, sizeof o.models, "%s", v), i++;
        else if (!strcmp(a, "--pairs"))
            o.pairs = (uint32_t)strtoul(v, NULL, 10), i++;
        else if (!strcmp(a, "--threads-list"))
            snprintf(o.threads_list, sizeof o.threads_list, "%s", v), i++;
        else if (!strcmp(a, "--rows"))
            o.rows = strtoull(v, NULL, 10), i++;
        else if (!strcmp(a, "--eval-rows"))
            o.eval_rows = strtoull(v, NULL, 10), i++;
        else if (!strcmp(a, "--seed"))
            o.seed = strtoull(v, NULL, 10), i++;
        else if (!strcmp(a, "--dir"))
            o.dir = v, i++;
        else if (!strcmp(a, "--ember"))
            o.ember = v, i++;
        else if (!strcmp(a, "--python"))
            o.python = v, i++;
        else if (!strcmp(a, "--train-arg") && o.n_extra < MAX_EXTRA)
            o.extra[o.n_extra++] = v, i++;
        else
            usage();
    }
    if (o.rows == 0) o.rows = o.quick ? 300000 : 2000000;
    if (o.eval_rows == 0) o.eval_rows = o.quick ? 30000 : 200000;
    if (o.pairs == 0) o.pairs = o.quick ? 1 : MAX_PAIRS;
    if (o.pairs > MAX_PAIRS) o.pairs = MAX_PAIRS;
    if (o.ember == NULL || access(o.ember, X_OK) != 0) {
        fprintf(stderr, "bench train: no ember binary at %s (build it, or --ember PATH)\n",
                o.ember ? o.ember : "?");
        return 1;
    }
    char *err = NULL;
    if (cm_mkdirs(o.dir, &err) != CM_OK) bench_die("bench directory", err);
    double t_start = cm_now();
    char load0[16], load1[16];
    loadavg(load0, sizeof load0);

    dataset ds;
    memset(&ds, 0, sizeof ds);
    prepare_data(&o, &ds);

    /* ember: every model, mlp with every thread count of the list. */
    ember_run runs[MAX_MODELS * 4];
    int n_runs = 0;
    const char *model_order[] = {"mlp", "lr", "dlrm", "deepfm"};
    for (int m = 0; m < 4; m++) {
        if (!has_model(&o, model_order[m])) continue;
        char tl[64];
        snprintf(tl, sizeof tl, "%s", !strcmp(model_order[m], "lr") ? "1" : o.threads_list);
        for (char *s = strtok(tl, ","); s && n_runs < MAX_MODELS * 4; s = strtok(NULL, ",")) {
            run_ember(&o, &ds, model_order[m], atoi(s) > 0 ? atoi(s) : 1, 1, &runs[n_runs]);
            n_runs++;
        }
    }
    torch_run tr;
    if (has_model(&o, "mlp"))
        run_torch(&o, &ds, 1, &tr);
    else {
        memset(&tr, 0, sizeof tr);
        snprintf(tr.why, sizeof tr.why, "skipped (the PyTorch side implements mlp only)");
    }
    roofline rf;
    measure_roofline(ds.F, ds.D, o.quick ? 1.0 : 3.0, &rf);

    /* The best (loop rate) run of each model. */
    const ember_run *best_mlp = NULL, *best_lr = NULL;
    for (int i = 0; i < n_runs; i++) {
        const ember_run *r = &runs[i];
        if (!r->ok) continue;
        const ember_run **b = !strcmp(r->model, "mlp")  ? &best_mlp
                              : !strcmp(r->model, "lr") ? &best_lr
                                                        : NULL;
        if (b && (*b == NULL || r->loop_samples_per_s > (*b)->loop_samples_per_s)) *b = r;
    }
    const ember_run *head = best_mlp ? best_mlp : best_lr;

    /* AUC pairs: ember (at the reported thread count) and PyTorch from the same initial weights
     * for seeds 1..pairs, seed 1 being the runs above. On these data one run's AUC moves by about
     * 0.003 with the float summation order alone, so the AUC goal is judged on the means. */
    double e_auc[MAX_PAIRS], t_auc[MAX_PAIRS], e_mean = NAN, t_mean = NAN;
    uint32_t n_pairs = 0;
    if (best_mlp && tr.ran) {
        e_auc[0] = best_mlp->auc;
        t_auc[0] = tr.auc;
        n_pairs = 1;
        for (uint32_t sd = 2; sd <= o.pairs; sd++) {
            ember_run er;
            torch_run t2;
            run_ember(&o, &ds, "mlp", best_mlp->threads, sd, &er);
            run_torch(&o, &ds, sd, &t2);
            if (!er.ok || !t2.ran) break;
            e_auc[n_pairs] = er.auc;
            t_auc[n_pairs] = t2.auc;
            n_pairs++;
        }
        e_mean = t_mean = 0;
        for (uint32_t i = 0; i < n_pairs; i++) {
            e_mean += e_auc[i] / n_pairs;
            t_mean += t_auc[i] / n_pairs;
        }
    }
    loadavg(load1, sizeof load1);

    printf("bench train: %" PRIu64 " train + %" PRIu64 " eval rows (seed %" PRIu64
           ", %s), %u fields x dim %u + %u dense,"
           " batch %u, 1 epoch; %" PRIu64 " distinct keys\n",
           ds.rows_train, ds.rows_eval, o.seed, ds.cached ? "cached" : "generated now", ds.F, DIM,
           ds.D, BATCH, ds.table_rows - 1);
    printf("%-22s %7s %12s %12s %9s %9s %9s\n", "run", "threads", "loop smp/s", "e2e smp/s",
           "train s", "auc", "logloss");
    for (int i = 0; i < n_runs; i++) {
        const ember_run *r = &runs[i];
        char name[80];
        snprintf(name, sizeof name, "ember %.16s%s", r->model,
                 r == best_mlp || r == best_lr ? " *" : "");
        if (!r->ok)
            printf("%-22s %7d %12s\n", name, r->threads, "FAILED");
        else
            printf("%-22s %7d %12.0f %12.0f %9.2f %9.4f %9.4f\n", name, r->threads,
                   r->loop_samples_per_s, r->samples_per_s, r->loop_seconds, r->auc, r->logloss);
    }
    if (tr.ran)
        printf("%-22s %7d %12.0f %12s %9.2f %9.4f %9.4f\n", "pytorch mlp", 2, tr.samples_per_s, "-",
               tr.seconds, tr.auc, tr.logloss);
    else
        printf("%-22s %s\n", "pytorch mlp", tr.why);
    if (rf.ok)
        printf("%-22s %7d %12.0f %12s %9s   sgemm %.1f GFLOP/s on the model's shapes (%.0f "
               "FLOP/sample), "
               "%.1f GFLOP/s at 1024^3\n",
               "sgemm roofline (mlp)", 2, rf.samples_per_s, "-", "-", rf.gflops_model,
               rf.flops_per_sample, rf.gflops_peak);
    else
        printf("%-22s no OpenBLAS to dlopen\n", "sgemm roofline");
    if (rf.ok)
        printf("%-22s %7d %12.0f %12s %9s   sgemm %.1f GFLOP/s on the model's shapes\n",
               "sgemm 1 thread (ref)", 1, rf.samples_per_s_1t, "-", "-", rf.gflops_model_1t);
    printf(
        "* = the faster thread count, reported. loop smp/s: samples / seconds at the last step of "
        "metrics.jsonl (ember) or of the timed loop (PyTorch); e2e: ember's own figure, setup to "
        "end "
        "with checkpoint and eval\n");
    double speedup = best_mlp && tr.ran ? best_mlp->loop_samples_per_s / tr.samples_per_s : NAN;
    if (best_mlp && tr.ran) {
        for (uint32_t i = 0; i < n_pairs; i++)
            printf("auc pair, seed %u (%s initial weights): ember %.4f, pytorch %.4f (%+.4f)\n",
                   i + 1, o.torch_own_init ? "each its own" : "the same", e_auc[i], t_auc[i],
                   e_auc[i] - t_auc[i]);
        printf("goal mlp auc >= torch - %.3f: %s (mean of %u: %.4f vs %.4f)\n", GOAL_AUC_GAP,
               e_mean >= t_mean - GOAL_AUC_GAP ? "met" : "NOT met", n_pairs, e_mean, t_mean);
        printf("goal ember >= %.0fx torch samples/s: %s (%.2fx)\n", GOAL_SPEEDUP,
               speedup >= GOAL_SPEEDUP ? "met" : "NOT met", speedup);
    }
    if (best_mlp && best_lr)
        printf("mlp vs lr auc: %.4f vs %.4f (%s)\n", best_mlp->auc, best_lr->auc,
               best_mlp->auc > best_lr->auc ? "mlp beats lr" : "mlp does NOT beat lr");
    if (best_mlp && rf.ok) {
        double frac = best_mlp->loop_samples_per_s / rf.samples_per_s;
        printf("ember mlp at %.0f%% of the sgemm roofline (2-thread OpenBLAS), %.0f%% of 2 x the "
               "1-thread "
               "figure%s\n",
               100.0 * frac, 50.0 * best_mlp->loop_samples_per_s / rf.samples_per_s_1t,
               frac > 1.0
                   ? " (above it: OpenBLAS's own 2-thread GEMMs lose to ember's row split into "
                     "single-threaded calls on these small shapes, more so under other load)"
                   : "");
    }
    printf("load average %s at start, %s at end (2 shared cores: other load skews the figures)\n",
           load0, load1);

#define JNUM(x) (isfinite((double)(x)) ? (x) : -1.0)
    printf("{\"bench\":\"train\",\"quick\":%s,\"model\":\"%s\",\"models\":\"%s\",\"rows\":%" PRIu64
           ",\"eval_rows\":%" PRIu64 ",\"seed\":%" PRIu64 ",\"batch\":%u,\"distinct_keys\":%" PRIu64
           ","
           "\"ember_threads\":%d,\"ember_samples_per_s\":%.0f,\"ember_e2e_samples_per_s\":%.0f,"
           "\"ember_auc\":%.6f,\"ember_logloss\":%.6f,\"ember_train_seconds\":%.3f,",
           o.quick ? "true" : "false", head ? head->model : "none", o.models, ds.rows_train,
           ds.rows_eval, o.seed, BATCH, ds.table_rows ? ds.table_rows - 1 : 0,
           head ? head->threads : 0, head ? JNUM(head->loop_samples_per_s) : -1,
           head ? JNUM(head->samples_per_s) : -1, head ? JNUM(head->auc) : -1,
           head ? JNUM(head->logloss) : -1, head ? JNUM(head->loop_seconds) : -1);
    for (int i = 0; i < n_runs; i++)
        printf("\"ember_%s_t%d_samples_per_s\":%.0f,\"ember_%s_t%d_auc\":%.6f,", runs[i].model,
               runs[i].threads, JNUM(runs[i].loop_samples_per_s), runs[i].model, runs[i].threads,
               JNUM(runs[i].auc));
    if (best_lr)
        printf("\"lr_auc\":%.6f,\"lr_logloss\":%.6f,\"lr_samples_per_s\":%.0f,", best_lr->auc,
               best_lr->logloss, best_lr->loop_samples_per_s);
    printf(
        "\"torch_init\":\"%s\",\"auc_pairs\":%u,\"ember_auc_mean\":%.6f,\"torch_auc_mean\":%.6f,",
        o.torch_own_init ? "own" : "ember", n_pairs, JNUM(e_mean), JNUM(t_mean));
    printf("\"ember_auc_seeds\":[");
    for (uint32_t i = 0; i < n_pairs; i++)
        printf("%s%.6f", i ? "," : "", e_auc[i]);
    printf("],\"torch_auc_seeds\":[");
    for (uint32_t i = 0; i < n_pairs; i++)
        printf("%s%.6f", i ? "," : "", t_auc[i]);
    printf("],");
    printf(
        "\"torch_ran\":%s,\"torch_installed_now\":%s,\"torch_version\":\"%s\",\"torch_threads\":2,"
        "\"torch_samples_per_s\":%.0f,\"torch_auc\":%.6f,\"torch_logloss\":%.6f,\"torch_train_"
        "seconds\":%.3f,"
        "\"speedup\":%.3f,\"sgemm_gflops\":%.2f,\"sgemm_gflops_1024\":%.2f,\"flops_per_sample\":%."
        "0f,"
        "\"roofline_samples_per_s\":%.0f,\"sgemm_gflops_1t\":%.2f,\"roofline_1t_samples_per_s\":%."
        "0f,\"goal_auc_met\":%s,\"goal_speedup_met\":%s,"
        "\"loadavg_start\":\"%s\",\"loadavg_end\":\"%s\",\"wall_seconds\":%.1f}\n",
        tr.ran ? "true" : "false", tr.installed ? "true" : "false", tr.version,
        tr.ran ? tr.samples_per_s : -1, tr.ran ? tr.auc : -1, tr.ran ? tr.logloss : -1,
        tr.ran ? tr.seconds : -1, isfinite(speedup) ? speedup : -1, rf.gflops_model, rf.gflops_peak,
        rf.flops_per_sample, rf.samples_per_s, rf.gflops_model_1t, rf.samples_per_s_1t,
        n_pairs ? (e_mean >= t_mean - GOAL_AUC_GAP ? "true" : "false") : "null",
        isfinite(speedup) ? (speedup >= GOAL_SPEEDUP ? "true" : "false") : "null", load0, load1,
        cm_now() - t_start);
    return head ? 0 : 1;
}
