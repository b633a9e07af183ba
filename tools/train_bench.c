/* The training benchmarks' shared steps: see tools/train_bench.h. */
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/common.h"
#include "datasets/datasets.h"
#include "embedding/embedding.h"
#include "src/model.h"
#include "tools/train_bench.h"
#include "tools/bench_util.h"

void bench_last_line(const char *path, const char *with, char *buf, size_t n)
{
    buf[0] = '\0';
    FILE *f = fopen(path, "r");
    if (f == NULL) return;
    char line[8192];
    while (fgets(line, sizeof line, f))
        if (line[0] != '\n' && line[0] != '\0' && (with == NULL || strstr(line, with)))
            snprintf(buf, n, "%s", line);
    fclose(f);
}

double bench_json_num(const char *line, const char *key)
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

/* A reader over one shard directory, in file order (what ember train reads, unshuffled). */
static ds_reader *open_dir(const char *dir)
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
    return r;
}

/* Reads every row of a shard directory. */
static void read_part(const char *dir, keymap *km, dump_part *p, uint64_t *multi)
{
    ds_reader *r = open_dir(dir);
    char *err = NULL;
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
        fprintf(stderr, "%s: %" PRIu64 " fields held several keys; the dump keeps the first\n",
                bench_self()->name, multi);
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
    for (uint32_t seed = 1; seed <= BENCH_MAX_PAIRS; seed++) {
        char ip[4400];
        init_path(dir, seed, ip, sizeof ip);
        write_init(ip, &km, tr.F, tr.D, seed);
    }
    free(km.keys);
    free(km.ids);
    *table_rows = V;
}

/* Distinct keys of a shard directory into km (every key of a multi-key field counts: each is
 * a row on the PS). Only keys are kept, so it scales to data sets the dump could not hold. */
static void count_keys(const char *dir, keymap *km)
{
    ds_reader *r = open_dir(dir);
    char *err = NULL;
    const ds_batch *b;
    int got;
    while ((got = ds_reader_next(r, &b, &err)) == 1) {
        for (uint64_t k = 0; k < b->n_keys; k++)
            keymap_get(km, b->keys[k]);
    }
    if (got < 0) bench_die("ds_reader_next", err);
    ds_reader_destroy(r);
}

/* The dump (or, without one, the key count) and F, D from existing shards; then READY. */
static void finish_data(const bench_train_opts *o, bench_dataset *ds, const char *ready)
{
    double t0 = cm_now();
    if (o->no_dump) {
        keymap km = {0};
        count_keys(ds->train, &km);
        count_keys(ds->eval, &km);
        ds->table_rows = km.n + 1;
        free(km.keys);
        free(km.ids);
    } else {
        fprintf(stderr, "%s: writing the PyTorch dump\n", bench_self()->name);
        write_dump(ds->dump, ds->dir, ds->train, ds->eval, &ds->table_rows);
    }
    ds->dump_s = cm_now() - t0;
    /* F and D from the shards themselves. */
    ds_reader *r = open_dir(ds->train);
    ds->F = ds_reader_schema(r)->n_fields;
    ds->D = ds_reader_schema(r)->n_dense;
    ds_reader_destroy(r);
    FILE *f = fopen(ready, "w");
    if (f == NULL) bench_die("cannot write READY", NULL);
    fprintf(f, "%" PRIu64 " %" PRIu64 " %" PRIu64 " %u %u\n", ds->rows_train, ds->rows_eval,
            ds->table_rows, ds->F, ds->D);
    fclose(f);
}

void bench_train_data(const bench_train_opts *o, bench_dataset *ds)
{
    memset(ds, 0, sizeof *ds);
    uint64_t total = o->rows + o->eval_rows;
    snprintf(ds->dir, sizeof ds->dir, "%s/train-%" PRIu64 "-e%" PRIu64 "-s%" PRIu64, o->dir,
             o->rows, o->eval_rows, o->seed);
    snprintf(ds->tsv, sizeof ds->tsv, "%s/data.tsv", ds->dir);
    snprintf(ds->shards, sizeof ds->shards, "%s/shards", ds->dir);
    snprintf(ds->train, sizeof ds->train, "%s/train", ds->shards);
    snprintf(ds->eval, sizeof ds->eval, "%s/eval", ds->shards);
    snprintf(ds->dump, sizeof ds->dump, "%s/torch.bin", ds->dir);
    char last_init[4400];
    init_path(ds->dir, BENCH_MAX_PAIRS, last_init, sizeof last_init);
    char ready[4300], line[512];
    snprintf(ready, sizeof ready, "%s/READY", ds->dir);
    FILE *f = fopen(ready, "r");
    if (f) {
        unsigned long long a, b, c, d, e;
        int ok = fgets(line, sizeof line, f) &&
                 sscanf(line, "%llu %llu %llu %llu %llu", &a, &b, &c, &d, &e) == 5;
        fclose(f);
        if (ok) {
            ds->rows_train = a, ds->rows_eval = b, ds->table_rows = c, ds->F = (uint32_t)d,
            ds->D = (uint32_t)e;
            ds->cached = 1;
            /* Shards cached without the dump (a no_dump run made them): add it now. */
            if (!o->no_dump && (bench_file_size(ds->dump) == 0 || bench_file_size(last_init) == 0))
                finish_data(o, ds, ready);
            return;
        }
    }
    char *err = NULL;
    if (cm_mkdirs(ds->dir, &err) != CM_OK) bench_die("data directory", err);
    char rows_s[32], seed_s[32];
    snprintf(rows_s, sizeof rows_s, "%" PRIu64, total);
    snprintf(seed_s, sizeof seed_s, "%" PRIu64, o->seed);
    fprintf(stderr, "%s: generating %s rows (seed %s) into %s\n", bench_self()->name, rows_s,
            seed_s, ds->tsv);
    double t0 = cm_now();
    /* --threads 1: see bench_ingest.c (the other core stays with the rest of the machine). */
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
    fprintf(stderr, "%s: ingested %" PRIu64 " train + %" PRIu64 " eval rows\n", bench_self()->name,
            res.rows_train, res.rows_eval);
    unlink(ds->tsv); /* the shards and the dump are what later runs need */
    finish_data(o, ds, ready);
}

/* ---- ember train ---- */

const char *const bench_step_part_names[8] = {"step_ms",        "wait_batch_ms",   "wait_push_ms",
                                              "dense_ms",       "puller_early_ms", "puller_push_ms",
                                              "puller_late_ms", "handover_ms"};

void bench_train_ember(const bench_train_opts *o, const bench_dataset *ds, const char *model,
                       int threads, uint32_t seed, int ipc, bench_ember_run *er)
{
    memset(er, 0, sizeof *er);
    snprintf(er->model, sizeof er->model, "%s", model);
    er->threads = threads;
    const char *dev = o->device ? o->device : "cpu";
    int on_cpu = strcmp(dev, "cpu") == 0;
    char out[4400], so[4500], se[4500], mj[4500], th[16], sd[16], wk[16], sh[16], lay[40] = "";
    uint32_t workers = o->workers ? o->workers : 1, shards = o->shards ? o->shards : 1;
    snprintf(wk, sizeof wk, "%u", workers);
    snprintf(sh, sizeof sh, "%u", shards);
    if (workers != 1 || shards != 1) snprintf(lay, sizeof lay, "-w%u-s%u", workers, shards);
    /* The CPU runs keep the directory names they always had. */
    snprintf(out, sizeof out, "%s/run-%s%s%s-t%d-s%u%s%s%s", ds->dir, on_cpu ? "" : dev,
             on_cpu ? "" : "-", model, threads, seed, ipc ? "-ipc" : "", o->bf16 ? "-bf16" : "",
             lay);
    snprintf(sd, sizeof sd, "%u", seed);
    snprintf(so, sizeof so, "%s.stdout", out);
    snprintf(se, sizeof se, "%s.stderr", out);
    snprintf(mj, sizeof mj, "%s/metrics.jsonl", out);
    snprintf(th, sizeof th, "%d", threads);
    char *rm_err = NULL;
    cm_rmtree(out, &rm_err); /* a fresh run directory: no checkpoint to trip over */
    free(rm_err);
    const char *argv[80 + BENCH_MAX_EXTRA];
    int n = 0;
    /* ipc: the same job as processes, `ember ps` shards and workers over ipc://, through
     * tools/launch (which adds --out and the cluster file to both). */
    const char *launch[] = {o->launch, "--ps",    sh,       "--workers", wk,  "--transport",
                            "ipc",     "--ember", o->ember, "--out",     out, "--"};
    const char *fixed[] = {"--train",   ds->train,    "--eval",          ds->eval,
                           "--model",   model,        "--device",        dev,
                           "--batch",   "2048",       "--epochs",        "1",
                           "--threads", th,           "--emb-optimizer", "adagrad",
                           "--emb-lr",  BENCH_EMB_LR, "--dense-lr",      BENCH_DENSE_LR,
                           "--seed",    sd,           "--no-progress"};
    const char *embedded[] = {"--out", out, "--workers", wk, "--shards", sh};
    if (ipc) {
        for (size_t i = 0; i < sizeof launch / sizeof launch[0]; i++)
            argv[n++] = launch[i];
    } else {
        argv[n++] = o->ember;
        argv[n++] = "train";
        for (size_t i = 0; i < sizeof embedded / sizeof embedded[0]; i++)
            argv[n++] = embedded[i];
    }
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++)
        argv[n++] = fixed[i];
    if (o->bf16) argv[n++] = "--bf16";
    for (int i = 0; i < o->n_extra; i++)
        argv[n++] = o->extra[i];
    argv[n] = NULL;
    fprintf(stderr, "%s: ember train --device %s --model %s --threads %d --seed %u%s%s%s ...\n",
            bench_self()->name, dev, model, threads, seed, o->bf16 ? " --bf16" : "",
            ipc ? " (tools/launch: PS and worker processes over ipc://)" : "", lay);
    int rc = bench_run_cmd((char *const *)argv, so, se);
    if (rc != 0) {
        fprintf(stderr,
                "%s: ember train --device %s --model %s --threads %d failed (exit %d); see %s\n",
                bench_self()->name, dev, model, threads, rc, se);
        return;
    }
    char line[8192];
    bench_last_line(so, NULL, line, sizeof line);
    er->auc = bench_json_num(line, "auc");
    er->logloss = bench_json_num(line, "logloss");
    er->samples_per_s = bench_json_num(line, "samples_per_s");
    er->seconds = bench_json_num(line, "seconds");
    er->train_loss = bench_json_num(line, "train_loss");
    er->rows = (uint64_t)bench_json_num(line, "rows");
    er->eval_rows = (uint64_t)bench_json_num(line, "eval_rows");
    for (int i = 0; i < 8; i++)
        er->step_parts[i] = bench_json_num(line, bench_step_part_names[i]);
    bench_last_line(mj, "\"samples_per_s\"", line, sizeof line); /* the loop's, not an eval's */
    /* The loop's own clock, from its first step as PyTorch's timer starts at its loop (ember's
     * setup, connection and first pull left out, as PyTorch's model and data loading are);
     * "seconds" (from the process's setup) where a run directory predates it. */
    er->loop_seconds = bench_json_num(line, "loop_seconds");
    if (!isfinite(er->loop_seconds)) er->loop_seconds = bench_json_num(line, "seconds");
    double samples = bench_json_num(line, "samples");
    er->loop_samples_per_s = er->loop_seconds > 0 ? samples / er->loop_seconds : NAN;
    er->ok = isfinite(er->auc) && isfinite(er->loop_samples_per_s);
}

/* ---- PyTorch ---- */

/* 0: python imports torch and numpy (and, for cuda, torch sees a GPU); 1: it cannot import
 * them; 2: torch has no usable CUDA device. */
static int python_torch_status(const char *py, int cuda)
{
    char *argv[] = {
        (char *)py, "-c",
        cuda ? "import sys, torch, numpy; sys.exit(0 if torch.cuda.is_available() else 3)"
             : "import torch, numpy",
        NULL};
    int rc = bench_run_cmd(argv, "/dev/null", "/dev/null");
    return rc == 0 ? 0 : rc == 3 ? 2 : 1;
}

void bench_train_torch(const bench_train_opts *o, const bench_dataset *ds, uint32_t seed,
                       bench_torch_run *t)
{
    memset(t, 0, sizeof *t);
    const char *name = bench_self()->name, *dev = o->device ? o->device : "cpu";
    int on_cpu = strcmp(dev, "cpu") == 0;
    if (o->no_torch) {
        snprintf(t->why, sizeof t->why, "skipped (--no-torch)");
        return;
    }
    int st = python_torch_status(o->python, !on_cpu);
    if (st == 2) {
        snprintf(t->why, sizeof t->why, "skipped: %s's torch sees no CUDA device", o->python);
        fprintf(stderr, "%s: PyTorch %s\n", name, t->why);
        return;
    }
    if (st != 0) {
        /* Debian's python3-torch is CPU-only: installing it cannot help a cuda run. */
        if (!on_cpu || o->quick || o->no_install || geteuid() != 0 ||
            access("/usr/bin/apt-get", X_OK) != 0) {
            snprintf(t->why, sizeof t->why, "skipped: %s cannot import torch and numpy%s",
                     o->python,
                     !on_cpu    ? " (a CUDA build of PyTorch is needed)"
                     : o->quick ? " (apt-get install python3-torch; --quick never installs)"
                                : " (apt-get install python3-torch)");
            fprintf(stderr, "%s: PyTorch %s\n", name, t->why);
            return;
        }
        fprintf(stderr,
                "%s: %s cannot import torch: installing Debian's python3-torch "
                "(apt-get install -y python3-torch)\n",
                name, o->python);
        char *apt[] = {"apt-get", "install", "-y", "-q", "python3-torch", NULL};
        setenv("DEBIAN_FRONTEND", "noninteractive", 1);
        if (bench_run_cmd(apt, "/dev/null", NULL) != 0 || python_torch_status(o->python, 0) != 0) {
            snprintf(t->why, sizeof t->why, "skipped: installing python3-torch failed");
            fprintf(stderr, "%s: PyTorch %s\n", name, t->why);
            return;
        }
        t->installed = 1;
    }
    char out[4400], se[4400], ip[4400], sd[16], th[16];
    const char *pr = o->bf16 ? "bf16-" : "";
    snprintf(out, sizeof out, "%s/torch-%s%s%ss%u.stdout", ds->dir, pr, on_cpu ? "" : dev,
             on_cpu ? "" : "-", seed);
    snprintf(se, sizeof se, "%s/torch-%s%s%ss%u.stderr", ds->dir, pr, on_cpu ? "" : dev,
             on_cpu ? "" : "-", seed);
    init_path(ds->dir, seed, ip, sizeof ip);
    snprintf(sd, sizeof sd, "%u", seed);
    snprintf(th, sizeof th, "%d", o->torch_threads > 0 ? o->torch_threads : 2);
    const char *argv[32];
    int n = 0;
    const char *fixed[] = {o->python,  o->py_script, "--data",     ds->dump,       "--threads",
                           th,         "--batch",    "2048",       "--dim",        "16",
                           "--emb-lr", BENCH_EMB_LR, "--dense-lr", BENCH_DENSE_LR, "--seed",
                           sd};
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++)
        argv[n++] = fixed[i];
    if (!on_cpu) argv[n++] = "--device", argv[n++] = dev;
    if (!o->torch_own_init) argv[n++] = "--init", argv[n++] = ip;
    if (o->bf16) argv[n++] = "--bf16";
    argv[n] = NULL;
    fprintf(stderr, "%s: PyTorch (%s %s, %s, %s threads, %s%s) ...\n", name, o->python,
            o->py_script, dev, th,
            o->torch_own_init ? "its own initial weights" : "ember's initial weights",
            o->bf16 ? ", bf16 autocast" : "");
    int rc = bench_run_cmd((char *const *)argv, out, se);
    char line[8192];
    bench_last_line(out, NULL, line, sizeof line);
    if (rc != 0 || !isfinite(bench_json_num(line, "auc"))) {
        snprintf(t->why, sizeof t->why, "failed (exit %d); see %s", rc, se);
        fprintf(stderr, "%s: PyTorch %s\n", name, t->why);
        return;
    }
    t->ran = 1;
    t->samples_per_s = bench_json_num(line, "samples_per_s");
    t->seconds = bench_json_num(line, "seconds");
    t->auc = bench_json_num(line, "auc");
    t->logloss = bench_json_num(line, "logloss");
    t->train_loss = bench_json_num(line, "train_loss");
    t->load_seconds = bench_json_num(line, "load_seconds");
    const char *v = strstr(line, "\"torch\":\"");
    if (v) sscanf(v + 9, "%31[^\"]", t->version);
}

/* tools/<name> as a path: beside this source file, else relative to the project root. */
static const char *beside_source(const char *name, char *buf, size_t n)
{
    const char *slash = strrchr(__FILE__, '/');
    if (slash)
        snprintf(buf, n, "%.*s/%s", (int)(slash - __FILE__), __FILE__, name);
    else
        snprintf(buf, n, "tools/%s", name);
    return buf;
}

void bench_train_opts_init(bench_train_opts *o, const char *prog)
{
    static char py[4200], launch[4200];
    memset(o, 0, sizeof *o);
    /* bench_util.h's program name lives in each translation unit: set this one's too, so the
     * library's messages and failures name the program. */
    bench_init(prog, NULL);
    o->seed = 1;
    o->device = "cpu";
    o->torch_threads = 2;
    o->dir = getenv("EMBER_BENCH_DIR") ? getenv("EMBER_BENCH_DIR") : "/tmp/ember-bench";
    o->ember = bench_ember_path();
    /* bench_train.py and launch sit beside this source file (__FILE__ is absolute under CMake). */
    o->py_script = beside_source("bench_train.py", py, sizeof py);
    o->launch = beside_source("launch", launch, sizeof launch);
    /* Debian's interpreter is the one python3-torch installs into. */
    o->python = access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3";
}

int bench_train_opt(bench_train_opts *o, const char *a, const char *v, int max_extra)
{
    if (!strcmp(a, "--quick")) {
        o->quick = 1;
        return 1;
    }
    if (!strcmp(a, "--no-torch")) {
        o->no_torch = 1;
        return 1;
    }
    bool models = !strcmp(a, "--model") || !strcmp(a, "--models");
    bool extra = !strcmp(a, "--train-arg");
    uint64_t *num = !strcmp(a, "--rows")        ? &o->rows
                    : !strcmp(a, "--eval-rows") ? &o->eval_rows
                    : !strcmp(a, "--seed")      ? &o->seed
                                                : NULL;
    const char **str = !strcmp(a, "--dir")      ? &o->dir
                       : !strcmp(a, "--ember")  ? &o->ember
                       : !strcmp(a, "--python") ? &o->python
                                                : NULL;
    if (!models && !extra && num == NULL && str == NULL) return 0;
    if (v == NULL || (extra && o->n_extra >= max_extra)) return -1;
    if (models)
        snprintf(o->models, sizeof o->models, "%s", v);
    else if (num)
        *num = strtoull(v, NULL, 10);
    else if (str)
        *str = v;
    else
        o->extra[o->n_extra++] = v;
    return 2;
}

void bench_train_opts_finish(bench_train_opts *o)
{
    if (o->rows == 0) o->rows = o->quick ? 300000 : 2000000;
    if (o->eval_rows == 0) o->eval_rows = o->quick ? 30000 : 200000;
}
