/*
 * ps: the parameter server and its client.
 *
 * Design
 * ------
 * A cluster has N shards. Each `ember ps` process serves one shard of every embedding table
 * (an emb_table from embedding/) and the dense parameter blocks assigned to it. A key belongs
 * to shard jump_consistent_hash(xxh3(key), N): every client computes the same function, and
 * growing N moves only ~1/N of the keys. Dense block b lives on shard b % N.
 *
 * Transport is nng req/rep. The server opens one rep socket with many contexts, each an
 * independent recv -> handle -> send state machine, so requests from many workers are served
 * on all cores and a worker can keep several requests in flight per shard. The client opens a
 * req socket per shard with a window of contexts; pull() fans out to every shard at once and
 * gathers, push() returns as soon as its messages are queued and blocks only when the window is
 * full (back-pressure instead of unbounded memory).
 *
 * The wire format (docs/PROTOCOL.md) is a 56-byte header {magic, version, op, table, count,
 * codec, flags, status, worker, clock, request id, payload length, checksum} and a payload.
 * The checksum is xxh3-64 over the header (checksum field zeroed) and payload. The server
 * validates every field and length before it touches a table; a bad message gets an error
 * reply (status < 0 and a text payload) and is counted; nothing is applied in part.
 *
 * Codecs: keys travel sorted and delta-varint encoded; values as fp32, fp16, bf16, or int8 with
 * a per-row bf16 scale. With int8 the client keeps each row's quantisation residual and adds it
 * into that row's next push (error feedback). A push of exactly the keys the worker pulled just
 * before names that pull instead of carrying the keys again (key elision); a server that no
 * longer holds the pull's key list says so, and the client resends the push with its keys.
 *
 * Consistency: asynchronous by default. With staleness k >= 0 a worker's clock() blocks until
 * it is at most k clocks ahead of the slowest worker (k = 0 is synchronous); shard 0 keeps the
 * clocks and defers its replies. Workers flush their
 * pushes before they clock, so clock c means "all my updates of iterations < c are applied".
 *
 * Checkpoints are collective: every worker flushes and meets the others at a barrier (served by
 * shard 0, named by an id), so all updates issued before the checkpoint are applied and none after;
 * worker 0 has every shard snapshot its tables (each table paused while it is copied), and all meet
 * again. The same cut on every shard, no update half applied, no optimizer slot ahead of its
 * weights. Training pauses for the length of the snapshot (docs/PROTOCOL.md).
 *
 * Errors: 0 or a negative CM_* code, message in *errptr (caller frees). Network and RocksDB
 * errors are converted at the boundary. The server never exits on bad input.
 */
#ifndef EMBER_PS_H
#define EMBER_PS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/common.h"
#include "embedding/embedding.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PS_PROTOCOL_VERSION 3u
#define PS_MAX_TABLES 64u
#define PS_MAX_DENSE 64u
#define PS_MAX_SHARDS 1024u
#define PS_MAX_WORKERS 1024u
#define PS_NAME_MAX 32u
#define PS_CKPT_DIR_MAX 1024u /* bytes of a SAVE's or LOAD's directory (ps_client_save) */
#define PS_MAX_MESSAGE_DEFAULT (256u << 20) /* ps_config_init's max_msg_bytes */
#define PS_TIMEOUT_DEFAULT_MS 30000u        /* ps_client_opts.timeout_ms 0 */

typedef enum ps_codec {
    PS_CODEC_F32 = 0,
    PS_CODEC_F16 = 1,
    PS_CODEC_BF16 = 2,
    PS_CODEC_INT8 = 3, /* per-row bf16 scale + dim int8 */
} ps_codec;

/* "fp32", "fp16", "bf16", "int8". 0 or CM_EINVAL. */
int ps_codec_parse(const char *name, ps_codec *out);
const char *ps_codec_name(ps_codec c);
/* Bytes one row of dim values takes in a codec. */
size_t ps_codec_row_bytes(ps_codec c, uint32_t dim);

/* The longest host name DNS allows; a TLS client checks the PS certificate against it. */
#define PS_URL_HOST_MAX 253
/* Whether url (len bytes) can be served and found: a tcp:// or tls+tcp:// URL (4 and 6 too)
 * must name a host of at most PS_URL_HOST_MAX bytes and a port 1..65535 (nng listens on a
 * random port for a URL without one, which no client can find); other schemes pass. CM_OK or
 * CM_EINVAL naming the URL. */
int ps_url_check(const char *url, size_t len, char **errptr);

/* Whether a table or dense name is a plain file name (letters, digits, '_', '-', '.'; not
 * starting with '.'): names become file and directory names, so ps_config_check refuses any
 * other, and so does a checkpoint reader. */
bool ps_name_ok(const char *name);

/* The shard a key belongs to among n (jump consistent hash of xxh3(key)). */
uint32_t ps_key_shard(uint64_t key, uint32_t n_shards);
/* The order in which pull and push send n distinct keys to n_shards shards: grouped by shard
 * in shard order, ascending within a shard. perm (n entries, the caller's) receives that order
 * as positions in keys (keys is not changed). Pull and push recognise a key list already in
 * this order in one pass and skip their sort, duplicate merge and scatter; a trainer that
 * orders each batch's keys once, ahead of time, takes that work off its critical path.
 * 0, or CM_ENOMEM / CM_EINVAL (a duplicate key) with a message. */
int ps_keys_order(uint32_t n_shards, const uint64_t *keys, size_t n, uint32_t *perm, char **errptr);

typedef enum ps_dense_opt {
    PS_DENSE_ADAM = 0,
    PS_DENSE_ADAGRAD = 1,
    PS_DENSE_SGD = 2
} ps_dense_opt;
/* "adam", "adagrad", "sgd" <-> ps_dense_opt; parse returns CM_EINVAL for another name. */
int ps_dense_opt_parse(const char *name, ps_dense_opt *out);
const char *ps_dense_opt_name(ps_dense_opt opt);

typedef struct ps_table_spec {
    char name[PS_NAME_MAX];
    emb_table_config cfg; /* spill_path is derived per shard; mem budget is per shard */
    ps_codec push_codec, pull_codec;
} ps_table_spec;

typedef struct ps_dense_spec {
    char name[PS_NAME_MAX];
    uint64_t size; /* floats */
    ps_dense_opt opt;
    float lr, beta1, beta2, eps;
} ps_dense_spec;

/* A whole cluster's configuration: the same file for every PS and worker. */
typedef struct ps_config {
    uint32_t n_shards;
    uint32_t n_workers;
    int32_t staleness;           /* -1 = asynchronous */
    uint64_t max_msg_bytes;      /* receive limit, default 256 MiB */
    uint32_t worker_timeout_ms;  /* a worker silent this long stops holding back clocks and
                                    barriers (shard 0); 0 = wait for it forever */
    uint32_t worker_lost_ms;     /* a worker whose connection to shard 0 closed (its process
                                    died) and has not come back this long fails the clocks and
                                    barriers that wait for it, with an error naming it (shard
                                    0); 0 = wait for it (until the clients' own timeouts) */
    uint32_t replica_timeout_ms; /* a primary whose backup has not acknowledged an update this
                                    long drops the backup and goes on unreplicated
                                    (1..2^31-1) */
    char spill_dir[1024];        /* shard s, table t spills to <spill_dir>/shard-<s>/<name> */
    char tls_cert[1024], tls_key[1024], tls_ca[1024]; /* PEM files for tls+tcp:// */
    uint32_t n_tables, n_dense;
    ps_table_spec tables[PS_MAX_TABLES];
    ps_dense_spec dense[PS_MAX_DENSE];
} ps_config;

/* Defaults: 1 shard, 1 worker, asynchronous, 256 MiB messages, spill under /tmp/ember-spill,
 * replica timeout 5 s, no tables. */
void ps_config_init(ps_config *cfg);

/*
 * Parses an INI-style config file:
 *   [cluster]  shards, workers, staleness, max_message (bytes; K/M/G suffixes), spill_dir,
 *              tls_cert, tls_key, tls_ca, worker_timeout (ms), worker_lost (ms),
 *              replica_timeout (ms)
 *   [table NAME]  dim, optimizer, lr, l2, eps, beta1, beta2, adagrad_init, ftrl_beta, ftrl_l1,
 *              init_scale, seed, memory (per-shard budget, K/M/G), admit, ttl, push_codec,
 *              pull_codec, reserve_rows (rows a shard's table is created for, K/M/G; see
 *              emb_table_config.reserve_rows)
 *   [dense NAME]  size, optimizer (adam|adagrad|sgd), lr, beta1, beta2, eps
 * '#' starts a comment. An unknown section or key, a key given twice in a section, a bad
 * value, or a missing required field is an error naming the file and line. Tables and dense blocks
 * get ids in file order.
 */
int ps_config_load(const char *path, ps_config *cfg, char **errptr);
/* Validates a config (also run by ps_config_load). */
int ps_config_check(const ps_config *cfg, char **errptr);

/* Memory and disk cost of holding `rows` rows of table t in one shard: exact bytes per row
 * (record + hash slot overhead at the maximum load factor) and totals. */
typedef struct ps_plan_row {
    uint64_t row_bytes;       /* one record */
    double mem_bytes_per_row; /* record + ctrl byte, over the maximum load factor */
    uint64_t rows_in_memory;  /* rows the budget holds (all when unlimited) */
    uint64_t rows_spilled;
    double mem_bytes, disk_bytes;
    double initial_bytes; /* allocated when the shard starts (reserve_rows; else small) */
} ps_plan_row;
void ps_plan(const ps_config *cfg, uint32_t table, uint64_t rows, ps_plan_row *out);
/* The most rows of table whose int8 error-feedback residuals a worker keeps within
 * resid_memory bytes (ps_client_opts.resid_memory's meaning, 0 the default); 0 for a table
 * that does not push int8, UINT64_MAX for no bound. The worker-side line of a memory plan. */
uint64_t ps_plan_resid_rows(const ps_config *cfg, uint32_t table, uint64_t resid_memory);

/* ---------------- server ---------------- */

typedef struct ps_server ps_server;

typedef struct ps_server_opts {
    const ps_config *cfg; /* borrowed for the server's life */
    const char *listen;   /* nng URL, e.g. tcp://127.0.0.1:7000, ipc:///tmp/ps0 */
    uint32_t shard;
    /* Concurrent requests in service; 0 = 64 + 2 x workers. Shard 0 needs more than 2 x
     * workers: each worker's clock and barrier wait holds one while it waits. */
    uint32_t n_contexts;
    const char *replica_url; /* primary with a backup: the backup's URL (NULL: none) */
    bool backup;             /* this process is the backup of its shard (see Replication) */
    /* SAVE and LOAD only within this directory (created if missing): a request naming a path
     * outside it, by ".." or through a symbolic link, is refused. NULL: any path the process
     * may use (docs/PROTOCOL.md, "Trust"). ember train sets its run directory's ckpt/. */
    const char *checkpoint_root;
    /* Threads that apply one large pull or push (emb_table_set_team), the thread serving the
     * request among them: 0 or 1 = that thread alone. The same rows and replies whatever the
     * count; more make a large batch sooner on a many-core host. */
    uint32_t apply_threads;
} ps_server_opts;

/* apply_threads for each of n shards one process serves on a host whose cores are the PS's:
 * half the cores up to 8, shared among the shards (at least 1). */
uint32_t ps_apply_threads_default(uint32_t n);

/* Creates the shard's tables and starts listening. *out is the caller's (ps_server_destroy). */
int ps_server_create(const ps_server_opts *opts, ps_server **out, char **errptr);
/* Blocks until a SHUTDOWN request arrives or ps_server_stop is called. */
int ps_server_wait(ps_server *s);
/* ps_server_wait for at most ms milliseconds: true once the server has stopped. */
bool ps_server_wait_for(ps_server *s, uint32_t ms);
/* Milliseconds since a request was last in progress here (0 while one is: being handled,
 * parked at a clock or barrier, or its reply being sent), or since the server started. */
uint64_t ps_server_idle_ms(ps_server *s);
/* Asks the server to stop (async-signal-safe apart from being a store). */
void ps_server_stop(ps_server *s);
/* Stops serving and frees everything. */
void ps_server_destroy(ps_server *s);
/* True when this primary stopped because its backup had taken over (it must not serve). */
bool ps_server_fenced(ps_server *s);
/* True while this is a backup that has not taken over and the connection its primary's latest
 * update (REPLICATE) came on is open: the primary is alive, and will pass its cluster's
 * SHUTDOWN on (or tell this backup to stop). False before the primary's first update (its
 * connection is not known until then). */
bool ps_server_primary_connected(ps_server *s);

typedef struct ps_server_stats {
    uint64_t requests, errors, bad_messages;
    uint64_t bytes_in, bytes_out;
    uint64_t rows_pulled, rows_pushed;
    uint64_t clocks_min, clocks_max; /* slowest and fastest worker clock seen */
    uint64_t staleness_max;          /* largest observed clock gap */
    uint64_t duplicates;             /* resent pushes recognised and not applied again */
    uint64_t replicated;             /* primary: updates the backup acknowledged;
                                        backup: updates received from the primary */
    uint64_t replica_dropped;        /* primary: 1 once it dropped an unreachable backup */
    uint64_t promoted;               /* backup: 1 once it took over as primary */
    uint64_t replica_held;           /* backup: updates received ahead of a gap in the sequence,
                                        held until it fills (all applied at a takeover) */
    uint64_t replica_held_bytes;     /* ... the bytes of those requests */
    uint64_t replica_diverged;       /* backup: 1 once an update from its primary failed to apply
                                        here: its tables are no longer the primary's, so it
                                        refuses every REPLICATE and client request since */
    uint64_t replica_diverged_seq;   /* ... that update's sequence number (0: none) */
    uint64_t elided;                 /* pushes applied with the keys of a pull they named */
    uint64_t elided_misses;          /* ... answered PS_STATUS_NO_KEYS (list not held) */
    uint64_t keylist_bytes;          /* memory the recent pulls' key lists (and, on the server,
                                        their row slot hints) take */
    uint64_t superseded;             /* shard 0: CLOCK and BARRIER waits answered with an error
                                        because a newer one of the same worker took their place
                                        (at most one of each waits per worker) */
    uint64_t lost_waits;             /* shard 0: CLOCK and BARRIER waits answered with an error
                                        because a worker they wait for is lost (worker_lost) */
} ps_server_stats;
void ps_server_stats_get(ps_server *s, ps_server_stats *out);

/* ---------------- client ---------------- */

typedef struct ps_client ps_client;

typedef struct ps_client_opts {
    const ps_config *cfg;           /* borrowed for the client's life */
    const char *const *urls;        /* cfg->n_shards URLs, shard order */
    uint32_t worker;                /* this worker's index < cfg->n_workers */
    uint32_t window;                /* in-flight requests per shard; 0 = 8; at most 1024 */
    /* A call's bound on each shard, failover included (0 = PS_TIMEOUT_DEFAULT_MS): a shard that
     * cannot answer (its primary and backup both gone or hung) fails the call within about this
     * long, with an error naming the shard and its URLs. A primary silent for this less
     * min(half of it, 5 s) is given up for its backup, which gets the rest. Clock, barrier,
     * save, load and shutdown wait 20 times as long (they wait for other workers). A call
     * that must first wait for a free slot of the shard's window, or for earlier requests
     * (a pull for this client's pushes), waits for those too. */
    uint32_t timeout_ms;
    const char *const *backup_urls; /* NULL, or cfg->n_shards URLs of the shards' backups
                                       (an entry may be NULL: that shard has none) */
    bool explicit_keys; /* every push carries its keys, none names a pull (key elision off:
                           benchmarks and tests compare the two) */
    /* Bytes the int8 error-feedback residuals may take, all tables together (0 =
     * PS_RESID_MEMORY_DEFAULT; UINT64_MAX: no bound). Each int8 table gets an even share; one
     * about to pass its share first drops the residuals of the rows it pushed least recently
     * (ps_client_stats.resid_dropped): those rows' unsent quantisation error, at most half an
     * int8 step a value, is lost. The same pushes drop the same rows, so a resumed run still
     * matches an uninterrupted one bit for bit. */
    uint64_t resid_memory;
} ps_client_opts;
#define PS_RESID_MEMORY_DEFAULT (256ull << 20)

/* Connects to every shard and runs the HELLO handshake (protocol version, shard index and
 * count, table configs); a mismatch is an error naming the shard and field. */
int ps_client_create(const ps_client_opts *opts, ps_client **out, char **errptr);
/* Waits for in-flight pushes, then disconnects. NULL is fine. */
void ps_client_destroy(ps_client *c);
/* Gives up on everything in flight and to come: every waiting call (a barrier, a clock, a
 * pull, a flush) returns CM_ECANCELED at once, and so does every later request. For a job that
 * has already failed elsewhere (another worker's error), so the rest stop now instead of
 * waiting out the barrier timeout. Thread-safe, from any thread, while others use c; the
 * client must still be destroyed by its owner. Requests already on the wire may or may not be
 * applied by the PS. */
void ps_client_abort(ps_client *c);

/* Pulls n keys of a table into out (n * dim floats, caller's order). Duplicates are fetched
 * once. Waits for this client's earlier pushes to the same shards to be applied first; an
 * earlier push that failed is then reported instead (nothing is pulled). */
int ps_client_pull(ps_client *c, uint32_t table, const uint64_t *keys, size_t n, float *out,
                   char **errptr);
/* Like pull, but read only: no row is created or marked touched, and keys the PS does not
 * hold read as zeros (emb_table_lookup). Evaluation uses it, so it sees what serving sees. */
int ps_client_lookup(ps_client *c, uint32_t table, const uint64_t *keys, size_t n, float *out,
                     char **errptr);
/* Pushes gradients for n keys (n * dim floats); duplicated keys are summed first. Returns once
 * queued; an error of an earlier asynchronous push is reported by a later call. */
int ps_client_push(ps_client *c, uint32_t table, const uint64_t *keys, size_t n, const float *grads,
                   char **errptr);
/* Waits until every queued push is acknowledged. */
int ps_client_flush(ps_client *c, char **errptr);
/* Pushes queued and not yet acknowledged (0: every earlier push is applied on its shards). */
uint32_t ps_client_pushes_in_flight(ps_client *c);

/* Dense blocks: whole-block pull; push of a gradient (applied by the block's optimizer).
 * ps_client_dense_init assigns initial values unless the block was already initialised (the
 * first worker wins); *assigned tells which happened. */
int ps_client_dense_pull(ps_client *c, uint32_t block, float *out, char **errptr);
int ps_client_dense_push(ps_client *c, uint32_t block, const float *grads, char **errptr);
/* A push whose reply carries the block as it is right after this update (out: the block's
 * size in floats), in one round trip instead of a push and a pull. Later updates by other
 * workers are not in it, as they would not be in a pull sent at that moment. */
int ps_client_dense_push_pull(ps_client *c, uint32_t block, const float *grads, float *out,
                              char **errptr);
int ps_client_dense_init(ps_client *c, uint32_t block, const float *values, int *assigned,
                         char **errptr);
/*
 * Mirrors a dense block in this client, for a client that is the block's only writer (one
 * worker): the next step need not wait a round trip for the PS to apply the update.
 * Fetches the block's whole state (values, optimizer slots, step) from the PS; from then on
 * ps_client_dense_push_pull applies the update to this copy with the PS's own optimizer code
 * (the same bits), fills `out` from it and returns, while the push travels asynchronously;
 * the PS's reply carries its step and a digest of its values after the update, which the next
 * dense call or flush compares with the copy's: a mismatch (another writer, a lost update) is
 * an error naming the block, CM_ECORRUPT, and so is a failed push; either drops the mirror
 * (later calls go to the PS). At most one push per block is in flight, so the PS applies them
 * in the copy's order; its slot frees itself when the reply is in, so a mirror never holds one
 * of the window's requests. A flush (and so a SAVE, a clock) waits for it, and
 * ps_client_pushes_in_flight counts it. dense_pull waits for it, then pulls; dense_push
 * (without read-back) and dense_init drop the mirror and go to the PS; ps_client_load drops
 * every mirror (ignoring what their last pushes reported). Calling it again rebuilds the
 * mirror from the PS's state.
 */
int ps_client_dense_mirror(ps_client *c, uint32_t block, char **errptr);

/* Flushes, then advances this worker's clock; blocks while it is more than staleness clocks
 * ahead of the slowest worker. Returns the new clock in *clock (optional). */
int ps_client_clock(ps_client *c, uint64_t *clock, char **errptr);
/* Sets this worker's clock (the iterations it has completed) without telling the server: a
 * worker restarted into a running job continues from its data position, not from 0. */
void ps_client_clock_seek(ps_client *c, uint64_t clock);

/* Waits until all live workers have entered the same barrier. Barriers are named by
 * increasing ids (u32 on the wire): each call uses the next id, starting from the one HELLO
 * reported (a restarted worker thus joins the others). A worker asking for an id that has
 * completed passes at once, so ids derived from a schedule (ps_client_barrier_seek) keep a
 * restarted worker in step with the rest whatever moment it died at. */
int ps_client_barrier(ps_client *c, char **errptr);
/* ps_client_barrier with a vote: stop says this worker asks the job to stop after this barrier
 * (it had a SIGTERM or SIGINT). On success *any says whether any worker entering this barrier
 * voted so (stop included): shard 0 ORs the votes of the barrier it gathers and each reply
 * releasing it carries the result, so every worker learns the same answer at the same barrier
 * and can stop there together. A barrier that passes at once (a resend, a worker catching up, a
 * backup that took over after the barrier: ps_client_barrier) answers with the votes shard 0
 * knows of: for the last barrier it completed, all of them; otherwise this worker's own (the
 * others, having gone on past it, cannot have voted). *any is false on failure. */
int ps_client_barrier_vote(ps_client *c, bool stop, bool *any, char **errptr);
/* The id the next barrier (or save/load's first of two) uses; ids must increase. */
void ps_client_barrier_seek(ps_client *c, uint64_t id);
/* A stop poll, for a job without periodic checkpoints to vote at (ps_client_barrier_vote): this
 * worker has done `step` steps, polls every `every` steps (every worker alike, at the multiples
 * of it) and, with stop, votes to stop the job (it had a SIGTERM or SIGINT). Never waits for
 * the others. On success *at is the step the job stops at, a multiple of every that no worker
 * has passed (each one's next poll comes at or before it), or 0 while no worker has voted: the
 * first vote fixes it at the most steps any worker polled at plus every. Every worker then
 * checkpoints there together and stops. *at is 0 on failure. A replicated shard 0 answers
 * once its backup holds the poll, so a backup that takes over answers with the same stop. */
int ps_client_stop_poll(ps_client *c, uint64_t step, uint32_t every, bool stop, uint64_t *at,
                        char **errptr);

/* Collective: every worker calls it at the same point. All flush and meet at a barrier, so
 * every update issued before the call is applied and none after; worker 0 then has every shard
 * snapshot into dir/shard-<i>; all meet again and continue. The result is one consistent cut.
 * dir is 1..PS_CKPT_DIR_MAX bytes. */
int ps_client_save(ps_client *c, const char *dir, char **errptr);
/* Collective like save: every shard replaces its tables and dense blocks with a checkpoint's.
 * This client's int8 residuals are emptied first, whatever the outcome (see below): they belong
 * to pushes to rows the checkpoint replaces. */
int ps_client_load(ps_client *c, const char *dir, char **errptr);

/*
 * int8 error feedback (Codecs above) keeps, in the client, each pushed row's quantisation
 * residual for that row's next push: training state that a PS checkpoint does not hold, so a
 * run resumed without it pushes other values than one that never stopped. A trainer writes
 * each worker's beside the checkpoint and loads them after ps_client_load.
 * save writes them to path (temp + fsync + rename; magic, version, the worker, every int8
 * table's name, dim, push clock and rows in key order with the push each was last in, an
 * xxh3 trailer: ps/residual.h), so the same residuals are the same bytes; a client none of
 * whose tables pushes int8 writes no file.
 * load replaces them with path's: the file must be this worker's and hold exactly the tables
 * this config pushes int8, with their dims (CM_EINVAL naming the file otherwise); a damaged or
 * truncated file is CM_ECORRUPT naming it, a missing one CM_ENOTFOUND. A file holding more
 * than this client's resid_memory allows is cut to it as pushes would (the oldest go). A file
 * of the first version (no push clock) loads as if every row were from before the first push.
 * On any error the residuals are left empty. Neither call may overlap a push on c. A new client
 * starts empty.
 */
int ps_client_residuals_save(ps_client *c, const char *path, char **errptr);
int ps_client_residuals_load(ps_client *c, const char *path, char **errptr);
/* The check load makes of a residual file, without a client: buf[0, len) read from path (which
 * messages name). CM_OK, or CM_ECORRUPT. For a tool that copies one (ember reshard). */
int ps_residuals_check(const void *buf, size_t len, const char *path, char **errptr);

typedef struct ps_client_stats {
    uint64_t bytes_sent, bytes_received;
    uint64_t rows_pulled, rows_pushed;
    double push_sq_error, push_sq_norm;         /* quantisation error of pushes (sum of squares) */
    uint64_t failovers;                         /* shards this client moved to their backup */
    uint64_t push_bytes;                        /* bytes of PUSH requests sent, resends included */
    uint64_t pushes_elided;                     /* per-shard pushes sent naming a pull's key list */
    uint64_t push_fallbacks;                    /* ... sent again with keys (PS_STATUS_NO_KEYS,
                                                   or a damaged reply: below) */
    uint64_t replies_damaged; /* replies that failed the wire checks (length, checksum) */
    uint64_t replies_resent;  /* requests sent again, once each, after a damaged reply: pulls,
                                 small requests (up to 64 KiB), and elided pushes (with their
                                 keys, also counted in push_fallbacks); a large dense or keyed
                                 push is not kept, and its damaged reply fails it */
    uint64_t resid_rows, resid_bytes;           /* int8 residuals held, and their memory */
    uint64_t resid_dropped;                     /* ... dropped to keep within resid_memory */
    ps_server_stats shard_total;                /* counters summed over shards; clocks and
                                                   staleness shard 0's, which serves them;
                                                   replica_diverged_seq the highest */
    emb_table_stats table_total[PS_MAX_TABLES]; /* counts and bytes summed over shards
                                                   (bytes_budget: the table's whole budget);
                                                   row_bytes one row's, step the highest */
} ps_client_stats;
/* Local counters plus every shard's STATS reply. When a shard's STATS fails, *out still holds
 * the local counters (the shards' sums are then partial). */
int ps_client_stats_get(ps_client *c, ps_client_stats *out, char **errptr);
/* The local counters alone (shard_total and table_total zero): no request is sent. */
void ps_client_stats_local(ps_client *c, ps_client_stats *out);

/* Asks every shard to exit. */
int ps_client_shutdown(ps_client *c, char **errptr);

/* ---------------- reading a checkpoint offline ---------------- */

/* Number of shards in a checkpoint directory (shard-0 .. shard-(n-1)), as shard-0's MANIFEST
 * says: a shard below it that is missing, or whose MANIFEST is not that index's of the same
 * count and tables, is refused (CM_ECORRUPT, naming it). */
int ps_checkpoint_shards(const char *ckpt, uint32_t *n, char **errptr);
/* The table and dense block names of a checkpoint (arrays of PS_MAX_TABLES / PS_MAX_DENSE). */
int ps_checkpoint_names(const char *ckpt, char (*tables)[PS_NAME_MAX], uint32_t *n_tables,
                        char (*dense)[PS_NAME_MAX], uint32_t *n_dense, char **errptr);
/* The model config of a table as saved. */
int ps_checkpoint_table_config(const char *ckpt, const char *table, emb_table_config *cfg,
                               char **errptr);
/* The rows of a table across all shards, as the snapshots' manifests say (no rows read: what
 * export sizes its output by before streaming them). */
int ps_checkpoint_table_rows(const char *ckpt, const char *table, uint64_t *rows, char **errptr);
/* Calls cb for every row of a table across all shards (each shard verified first). The rows are
 * read in chunks: memory does not grow with the table. */
int ps_checkpoint_foreach_row(const char *ckpt, const char *table, emb_row_cb cb, void *arg,
                              char **errptr);
/* Writes checkpoint `from` redistributed over n_new shards into `to`, a directory that must not
 * exist yet (CM_EINVAL; on failure nothing is left there): the caller adds the trainer's files
 * and swaps it into place (ember reshard), so no checkpoint in place is ever half written. Every
 * row to the shard its key hashes to (jump consistent hash moves
 * only ~1/n of them when growing by one), dense blocks to their new owners, manifests
 * rewritten. Rows are identical: weights, optimizer state, update count and last step, bit for
 * bit, at the old shards' step. A table with admission gives every new shard the sum of its
 * old shards' sketches (no key counted less than before); sketches of other sizes are refused
 * (CM_EINVAL) and nothing is written. A key twice in a table is a damaged checkpoint
 * (CM_ECORRUPT naming it).
 * Memory: at most about `mem` bytes (0: PS_RESHARD_MEMORY_DEFAULT) whatever the tables' sizes,
 * since rows are streamed from the old snapshots into the new ones (emb_snapshot_writer), never
 * held: per table, one read chunk (EMB_SNAPSHOT_CHUNK), the admission sketch (2 MiB, summed),
 * a write buffer per new shard (up to a chunk each, a quarter of the rest between them), and
 * the rest for the table's keys (8 bytes a row, 16 while sorted), which find a key twice. Keys
 * that do not fit are spread over files in to/PS_RESHARD_SCRATCH, read back one part at a time
 * and removed before the call returns; the output does not depend on mem. A budget too small
 * for that (under ~1.2 MiB, a row per new shard and the sketch; or, for the keys to go in parts
 * of 4 KiB or more, under sqrt(81920 x rows) bytes: 9 MB for 10^9 rows) is CM_EINVAL saying
 * how much is needed, before any row is read. Rows in a new rows.bin come in the old shards'
 * order (shard 0's first), not a rebuilt table's. */
#define PS_RESHARD_MEMORY_DEFAULT (256ull << 20)
#define PS_RESHARD_SCRATCH "keys.tmp"
int ps_checkpoint_reshard(const char *from, const char *to, uint32_t n_new, uint64_t mem,
                          char **errptr);
/* The values of a dense block (caller frees *values). */
int ps_checkpoint_dense(const char *ckpt, const char *name, float **values, uint64_t *n,
                        char **errptr);

#ifdef __cplusplus
}
#endif
#endif
