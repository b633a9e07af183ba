/* Private to serve/: the mapped bundle layers and the model state predict uses. */
#ifndef EMBER_SERVE_INTERNAL_H
#define EMBER_SERVE_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>

#include "serve/ember_serve.h"
#include "src/model.h"

#define SERVE_MAX_TABLES 8
#define SERVE_MAX_LAYERS 64 /* a base and up to 63 deltas */

typedef struct serve_map {
    void *p;
    size_t len;
} serve_map;

typedef struct serve_table {
    char name[72];
    serve_map map;
    uint32_t dim;
    ember_serve_precision prec;
    size_t row_bytes;
    uint64_t rows, mask, n_deleted;
    const void *index;        /* slot entries */
    const uint8_t *data;      /* rows */
    const uint64_t *deleted;  /* sorted (possibly unaligned: read with memcpy) */
} serve_table;

typedef struct serve_layer {
    int delta, n_tables;
    uint64_t step, base_step;
    bool has_source; /* the MANIFEST names its source (ember_serve_writer_source) */
    uint64_t source, base_source;
    char *model;
    serve_map dense_map;
    const float *dense;
    uint64_t n_dense;
    serve_table tables[SERVE_MAX_TABLES];
} serve_layer;

/* What one predict call works in: the CPU backend's state, made for batches of up to max_b
 * rows and max_u distinct keys (state NULL: none yet), and the staging the batch is built in. */
typedef struct serve_scratch {
    struct serve_scratch *next;
    void *state;
    uint32_t max_b, max_u;
    model_staging ms;
} serve_scratch;

/* The scratches of a handle's predict calls not running now (a stack: the one used last is
 * taken first). There are as many as calls have run at once, each grown to the largest batch it
 * has taken. */
typedef struct serve_scratch_pool {
    pthread_mutex_t mu;
    serve_scratch *idle;
} serve_scratch_pool;

struct ember_serve {
    int n_layers;
    serve_layer layers[SERVE_MAX_LAYERS];
    model_cfg m;
    model_layout l;
    int mean_pool;
    int table_of[MODEL_MAX_TABLES]; /* layout table -> bundle table */
    /* Taken and given back by predict, which gets a const handle: hence a pointer (predict.c;
     * NULL until serve_model_init). */
    serve_scratch_pool *scratch;
    /* The newest layer's tower laid out for the backend once, shared read only by every
     * scratch's state (predict.c); remade by serve_model_tower when a delta brings another. */
    backend_cpu_tower *tower;
};

/* Parses the model config and checks the bundle's tables and tower fit it (predict.c); dir
 * (the bundle) names where in its messages. Makes the handle's (empty) scratch pool and its
 * laid out tower too. */
int serve_model_init(ember_serve *h, const char *dir, char **errptr);
/* Lays out the tower at dense (the newest layer's, or a delta's about to be) for predict, in
 * place of the handle's current one, which stays on failure (apply_delta: before it stacks the
 * layer, so that a delta refused for want of memory leaves the handle as it was). */
int serve_model_tower(ember_serve *h, const float *dense, char **errptr);
/* Releases what serve_model_init and predict made (close). */
void serve_model_fini(ember_serve *h);

#endif
