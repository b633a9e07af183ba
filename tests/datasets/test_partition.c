/* Property test of the rows a training run sees, through the public reader API the way
 * src/train.c uses it: for W in {1,2,3,5} workers, E in {1,2,3} epochs, batch sizes that do and
 * do not divide a worker's rows, with and without a shuffle window, over shard sets with
 * uneven shards (one with fewer rows than workers, a one-row and an empty shard, ingest's
 * variable blocks):
 *  - every row is read E times over the run and, in each epoch, by exactly one worker exactly
 *    once; nothing is dropped at an epoch's end (its last batch may be partial, no other is);
 *  - a worker's batch count is the trainer's schedule, ceil(rows / batch) * E (steps_of);
 *  - the order is file order unshuffled, and shuffled it is a function of the seed and the
 *    epoch (repeatable, different for another seed or the next epoch);
 *  - skipping k batches (train.c's resume loop) leaves exactly the rest of the sequence, for
 *    every boundary k of small runs and a spread of them in longer ones;
 *  - the eval reader (one worker, one epoch, no shuffle) reads every eval row once, and ingest's
 *    train and eval sides together hold every input row once.
 * Rows carry their id: dense[0] in the shard-writer sets (with a key derived from it), the
 * key weight in the libsvm set. */
#include <xxhash.h>

#include "ds_test_util.h"

#define MAX_ROWS 2000
#define MAX_EPOCHS 3
#define KEY_MUL 1000003u

typedef struct shard_set {
    const char *name;
    const char *dir;
    uint32_t n_rows;       /* ids are 0 .. n_rows-1 */
    int file_ordered;      /* unshuffled, a worker reads its ids in increasing order */
    const uint8_t *member; /* ids the shards hold (NULL: all) */
} shard_set;

/* Shards under dir holding consecutive ids: rows[s] rows in part-<s>, blocks of block_rows. */
static uint32_t write_set(const char *dir, const uint32_t *rows, int n_shards, uint32_t block_rows)
{
    const char *dn[] = {"id"}, *fn[] = {"k"};
    ds_schema s = {
        .n_dense = 1, .n_fields = 1, .has_label = 1, .dense_names = dn, .field_names = fn};
    static float labels[MAX_ROWS], dense[MAX_ROWS];
    static uint32_t offsets[MAX_ROWS + 1];
    static uint64_t keys[MAX_ROWS];
    char *err = NULL;
    uint32_t id = 0;
    for (int sh = 0; sh < n_shards; sh++) {
        char name[64];
        snprintf(name, sizeof name, "part-%05d.shard", sh);
        ds_shard_writer *w = NULL;
        CHECK_OK(ds_shard_writer_create(join(dir, name), &s, block_rows, &w, &err), err);
        if (w == NULL) continue;
        for (uint32_t i = 0; i < rows[sh]; i++, id++) {
            labels[i] = (float)(id % 2);
            dense[i] = (float)id;
            keys[i] = (uint64_t)id * KEY_MUL;
            offsets[i + 1] = i + 1;
        }
        ds_batch b = {.n_rows = rows[sh],
                      .n_dense = 1,
                      .n_fields = 1,
                      .labels = labels,
                      .dense = dense,
                      .offsets = offsets,
                      .keys = keys,
                      .n_keys = rows[sh]};
        if (rows[sh]) CHECK_OK(ds_shard_writer_append(w, &b, &err), err);
        CHECK_OK(ds_shard_writer_commit(w, &err), err);
    }
    return id;
}

/* libsvm rows "label 7:<id>" through ds_ingest_run: 3 train shards, a quarter held out for eval,
 * small chunks so blocks end early at chunk ends. */
static uint32_t ingest_set(const char *dir, uint32_t n, ds_ingest_result *res)
{
    static char text[MAX_ROWS * 16];
    size_t len = 0;
    for (uint32_t i = 0; i < n; i++)
        len += (size_t)sprintf(text + len, "%u 7:%u\n", i % 2, i);
    const char *input = join(dir, "in.svm");
    write_text(input, text, len);
    ds_ingest_opts o;
    ds_ingest_opts_init(&o);
    o.parser.format = DS_FMT_LIBSVM;
    o.inputs = &input;
    o.n_inputs = 1;
    o.out_dir = dir;
    o.n_shards = 3;
    o.eval_fraction = 0.25;
    o.split_seed = 5;
    o.threads = 2;
    o.block_rows = 9;
    o.chunk_bytes = 1000;
    o.log = fopen("/dev/null", "w");
    char *err = NULL;
    CHECK_OK(ds_ingest_run(&o, res, &err), err);
    fclose(o.log);
    return n;
}

/* The id of row i of b; -1 when the row is not one the sets wrote. */
static int row_id(const ds_batch *b, uint32_t i, uint32_t n_rows)
{
    if (b->n_fields != 1 || b->offsets[i + 1] - b->offsets[i] != 1) return -1;
    uint32_t k = b->offsets[i];
    float v = b->weights ? b->weights[k] : b->dense[(size_t)i * b->n_dense];
    if (!(v >= 0 && v < (float)n_rows) || v != (float)(uint32_t)v) return -1;
    uint32_t id = (uint32_t)v;
    if (b->labels[i] != (float)(id % 2)) return -1;
    if (!b->weights && b->keys[k] != (uint64_t)id * KEY_MUL) return -1;
    return (int)id;
}

/* One reader's whole output: the ids in order, each batch's first row, size and epoch. */
typedef struct seq {
    int *ids;
    size_t n;
    uint32_t *bstart, *bsize, *bepoch;
    size_t nb;
    uint64_t rows; /* ds_reader_rows: this worker's rows an epoch */
} seq;

typedef struct cfg {
    const shard_set *set;
    uint32_t W, E, batch;
    uint64_t shuffle, seed;
} cfg;

static void seq_free(seq *s)
{
    free(s->ids);
    free(s->bstart);
    free(s->bsize);
    free(s->bepoch);
    memset(s, 0, sizeof *s);
}

/* Reads worker w's batches under c after skipping `skip` of them (as train.c's resume does)
 * into *out. 0, or -1 after a failed check. */
static int read_seq(const cfg *c, uint32_t w, uint64_t skip, seq *out)
{
    memset(out, 0, sizeof *out);
    ds_reader_opts o;
    ds_reader_opts_init(&o);
    o.paths = &c->set->dir;
    o.n_paths = 1;
    o.batch_size = c->batch;
    o.worker = w;
    o.n_workers = c->W;
    o.n_epochs = c->E;
    o.shuffle_rows = c->shuffle;
    o.seed = c->seed;
    ds_reader *r = NULL;
    char *err = NULL;
    int rc = ds_reader_open(&o, &r, &err);
    CHECK_OK(rc, err);
    if (rc != CM_OK) return -1;
    out->rows = ds_reader_rows(r);
    size_t cap = (size_t)out->rows * c->E + 1, bcap = cap + c->E;
    out->ids = malloc(cap * sizeof *out->ids);
    out->bstart = malloc(bcap * sizeof *out->bstart);
    out->bsize = malloc(bcap * sizeof *out->bsize);
    out->bepoch = malloc(bcap * sizeof *out->bepoch);
    const ds_batch *b;
    int bad = 0;
    rc = 1;
    for (uint64_t k = 0; k < skip && rc == 1; k++)
        rc = ds_reader_next(r, &b, &err);
    while (rc == 1 && (rc = ds_reader_next(r, &b, &err)) == 1) {
        if (out->n + b->n_rows > cap - 1 || out->nb == bcap) {
            bad++;
            break;
        }
        out->bstart[out->nb] = (uint32_t)out->n;
        out->bsize[out->nb] = b->n_rows;
        out->bepoch[out->nb++] = b->epoch;
        for (uint32_t i = 0; i < b->n_rows; i++) {
            int id = row_id(b, i, c->set->n_rows);
            bad += id < 0;
            out->ids[out->n++] = id;
        }
    }
    CHECK_MSG(rc == 0, "%s W=%u w=%u: reader rc %d (%s)", c->set->name, c->W, w, rc,
              err ? err : "");
    free(err);
    CHECK_MSG(bad == 0,
              "%s W=%u w=%u: %d rows without a valid id, or more rows than "
              "ds_reader_rows says",
              c->set->name, c->W, w, bad);
    ds_reader_destroy(r);
    return rc == 0 && bad == 0 ? 0 : -1;
}

/* Whether ids [a, a+n) and [b, b+n) are the same sequence. */
static int same_ids(const int *a, const int *b, size_t n)
{
    return memcmp(a, b, n * sizeof *a) == 0;
}

/* Checks one configuration over all its workers; returns the failed checks' count. */
static int check_cfg(const cfg *c)
{
    int before = check_failures_;
    static uint8_t reads[MAX_EPOCHS][MAX_ROWS]; /* reads of id in epoch e, all workers */
    static int8_t reader_of[MAX_EPOCHS][MAX_ROWS];
    memset(reads, 0, sizeof reads);
    memset(reader_of, -1, sizeof reader_of);
    const char *nm = c->set->name;
    for (uint32_t w = 0; w < c->W; w++) {
        seq s;
        if (read_seq(c, w, 0, &s) != 0) {
            seq_free(&s);
            continue;
        }
        /* the trainer's schedule (train.c setup: steps_of) is what the reader hands out */
        uint64_t per_epoch = (s.rows + c->batch - 1) / c->batch;
        CHECK_MSG(s.nb == per_epoch * c->E,
                  "%s W=%u w=%u E=%u batch=%u: %zu batches, schedule %llu", nm, c->W, w, c->E,
                  c->batch, s.nb, (unsigned long long)(per_epoch * c->E));
        CHECK_MSG(s.n == s.rows * c->E, "%s W=%u w=%u: %zu rows read, %llu an epoch", nm, c->W, w,
                  s.n, (unsigned long long)s.rows);
        /* batches: full but for each epoch's last, epochs in order, never spanning two */
        for (size_t k = 0; k < s.nb && s.nb == per_epoch * c->E; k++) {
            uint32_t e = (uint32_t)(k / per_epoch);
            int last = (k + 1) % per_epoch == 0;
            uint32_t want = last ? (uint32_t)(s.rows - (per_epoch - 1) * c->batch) : c->batch;
            CHECK_MSG(s.bepoch[k] == e && s.bsize[k] == want,
                      "%s W=%u w=%u E=%u batch=%u shuffle=%llu: batch %zu has %u rows of epoch %u, "
                      "expected %u of epoch %u",
                      nm, c->W, w, c->E, c->batch, (unsigned long long)c->shuffle, k, s.bsize[k],
                      s.bepoch[k], want, e);
        }
        for (size_t k = 0; k < s.nb; k++)
            for (uint32_t i = 0; i < s.bsize[k]; i++) {
                int id = s.ids[s.bstart[k] + i];
                uint32_t e = s.bepoch[k];
                if (id < 0 || e >= c->E) continue;
                reads[e][id]++;
                if (reader_of[e][id] >= 0 && reader_of[e][id] != (int8_t)w)
                    CHECK_MSG(0, "%s W=%u E=%u: row %d read by workers %d and %u in epoch %u", nm,
                              c->W, c->E, id, reader_of[e][id], w, e);
                reader_of[e][id] = (int8_t)w;
            }
        /* order: file order unshuffled; shuffled, the next epoch's order is another */
        size_t per = (size_t)s.rows;
        if (!c->shuffle && c->set->file_ordered) {
            int ordered = 1;
            for (size_t i = 0; i + 1 < s.n; i++)
                ordered &= (i + 1) % per == 0 || s.ids[i] < s.ids[i + 1];
            CHECK_MSG(ordered, "%s W=%u w=%u: unshuffled rows out of file order", nm, c->W, w);
        }
        if (c->shuffle && per >= 16 && s.n == per * c->E)
            for (uint32_t e = 0; e + 1 < c->E; e++)
                CHECK_MSG(!same_ids(s.ids + e * per, s.ids + (e + 1) * per, per),
                          "%s W=%u w=%u shuffle=%llu: epochs %u and %u in the same order", nm, c->W,
                          w, (unsigned long long)c->shuffle, e, e + 1);
        if (c->shuffle && per >= 16 && s.n == per * c->E) {
            cfg other = *c;
            other.seed = c->seed + 1;
            seq t;
            if (read_seq(&other, w, 0, &t) == 0 && t.n == s.n)
                CHECK_MSG(!same_ids(s.ids, t.ids, per),
                          "%s W=%u w=%u: seeds %llu and %llu give the same order", nm, c->W, w,
                          (unsigned long long)c->seed, (unsigned long long)other.seed);
            seq_free(&t);
        }
        /* resume: skip k batches, the rest is the same (k = 0: the same seed repeats it) */
        size_t stride = s.nb <= 24 ? 1 : s.nb / 12;
        for (size_t k = 0; k <= s.nb; k += k + 1 >= s.nb ? 1 : stride) {
            seq t;
            if (read_seq(c, w, k, &t) == 0) {
                size_t from = k < s.nb ? s.bstart[k] : s.n;
                int same =
                    t.nb == s.nb - k && t.n == s.n - from && same_ids(t.ids, s.ids + from, t.n);
                for (size_t j = 0; same && j < t.nb; j++)
                    same = t.bsize[j] == s.bsize[k + j] && t.bepoch[j] == s.bepoch[k + j];
                CHECK_MSG(same,
                          "%s W=%u w=%u E=%u batch=%u shuffle=%llu: skipping %zu of %zu "
                          "batches does not leave the rest",
                          nm, c->W, w, c->E, c->batch, (unsigned long long)c->shuffle, k, s.nb);
            }
            seq_free(&t);
        }
        seq_free(&s);
    }
    /* every row of the set E times in all, once an epoch, by one worker */
    for (uint32_t e = 0; e < c->E; e++) {
        uint32_t wrong = 0, first = 0;
        for (uint32_t id = 0; id < c->set->n_rows; id++) {
            uint8_t want = c->set->member == NULL || c->set->member[id];
            if (reads[e][id] != want && wrong++ == 0) first = id;
        }
        CHECK_MSG(wrong == 0,
                  "%s W=%u E=%u batch=%u shuffle=%llu: %u rows not read exactly once "
                  "in epoch %u (first: row %u, %u times)",
                  nm, c->W, c->E, c->batch, (unsigned long long)c->shuffle, wrong, e, first,
                  reads[e][first]);
    }
    return check_failures_ - before;
}

/* The eval reader as train.c's evaluate() opens it: every eval row once, none of train's. */
static void check_eval(const char *dir, const uint8_t *train, uint32_t n_rows, uint64_t n_eval)
{
    shard_set ev = {.name = "eval", .dir = dir, .n_rows = n_rows};
    static uint8_t count[MAX_ROWS];
    memset(count, 0, sizeof count);
    const uint32_t batches[] = {1, 10, 4096};
    for (size_t bi = 0; bi < sizeof batches / sizeof *batches; bi++) {
        cfg c = {.set = &ev, .W = 1, .E = 1, .batch = batches[bi]};
        seq s;
        if (read_seq(&c, 0, 0, &s) == 0) {
            CHECK(s.n == n_eval && s.rows == n_eval);
            uint32_t wrong = 0;
            memset(count, 0, sizeof count);
            for (size_t i = 0; i < s.n; i++)
                count[s.ids[i]]++;
            for (uint32_t id = 0; id < n_rows; id++)
                wrong += count[id] != (train[id] ? 0 : 1);
            CHECK_MSG(wrong == 0, "eval batch=%u: %u rows not read exactly once", c.batch, wrong);
        }
        seq_free(&s);
    }
}

int main(void)
{
    const char *root = check_tmpdir("ds_partition");
    char dirs[4][4096], svm_train[4200], svm_eval[4200];
    for (int i = 0; i < 4; i++) {
        snprintf(dirs[i], sizeof dirs[i], "%s/set%d", root, i);
        CHECK(cm_mkdirs(dirs[i], NULL) == CM_OK);
    }
    /* (not join(): its buffers rotate, and these must outlive many calls) */
    snprintf(svm_train, sizeof svm_train, "%s/train", dirs[2]);
    snprintf(svm_eval, sizeof svm_eval, "%s/eval", dirs[2]);
    /* 16 blocks of 7 or fewer rows; part 1 has fewer rows than 5 workers, part 3 one row */
    static const uint32_t uneven[] = {61, 3, 29, 1};
    /* an empty shard between others, and a last one of two rows */
    static const uint32_t holes[] = {23, 0, 17, 2};
    /* one block of two rows: fewer blocks than workers, some read nothing (the trainer refuses
     * such a split, "fewer blocks than workers?", but the reader's split still holds) */
    static const uint32_t tiny[] = {2};
    shard_set sets[4] = {
        {.name = "uneven", .dir = dirs[0], .file_ordered = 1},
        {.name = "holes", .dir = dirs[1], .file_ordered = 1},
        {.name = "ingest", .dir = svm_train},
        {.name = "tiny", .dir = dirs[3], .file_ordered = 1},
    };
    sets[0].n_rows = write_set(dirs[0], uneven, 4, 7);
    sets[1].n_rows = write_set(dirs[1], holes, 4, 6);
    sets[3].n_rows = write_set(dirs[3], tiny, 1, 8);
    /* the libsvm set's train side: the rows ingest's documented split keeps (docs/INGEST.md) */
    ds_ingest_result res;
    memset(&res, 0, sizeof res);
    uint32_t n_svm = ingest_set(dirs[2], 600, &res);
    static uint8_t train[MAX_ROWS];
    uint64_t n_eval = 0;
    for (uint32_t i = 0; i < n_svm; i++) {
        char line[32];
        int len = snprintf(line, sizeof line, "%u 7:%u", i % 2, i);
        train[i] = !((double)XXH3_64bits_withSeed(line, (size_t)len, 5) < 0.25 * 0x1p64);
        n_eval += !train[i];
    }
    CHECK(res.rows_eval == n_eval && res.rows_train == n_svm - n_eval);
    sets[2].n_rows = n_svm;
    sets[2].member = train;

    static const uint32_t workers[] = {1, 2, 3, 5}, batches[] = {3, 7, 32, 4096};
    static const uint64_t windows[] = {0, 5, 1000};
    int configs = 0, failed = 0;
    for (int si = 0; si < 4; si++)
        for (size_t wi = 0; wi < 4; wi++)
            for (uint32_t E = 1; E <= MAX_EPOCHS; E++)
                for (size_t bi = 0; bi < 4; bi++)
                    for (size_t hi = 0; hi < 3; hi++) {
                        cfg c = {.set = &sets[si],
                                 .W = workers[wi],
                                 .E = E,
                                 .batch = batches[bi],
                                 .shuffle = windows[hi],
                                 .seed = 11 + E};
                        configs++;
                        failed += check_cfg(&c) > 0;
                    }
    check_eval(svm_eval, train, n_svm, n_eval);
    printf("%d configurations, %d with failed checks\n", configs, failed);
    return check_done();
}
