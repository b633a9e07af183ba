/*
 * Private to ps/: the wire format (docs/PROTOCOL.md) and the value codecs.
 *
 * Every message is a 56-byte little-endian header followed by the payload. Decoding never
 * trusts a field: lengths are checked against the received size before anything is read, and
 * the checksum covers header and payload.
 */
#ifndef EMBER_PS_WIRE_H
#define EMBER_PS_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ps/ps.h"

#define PS_MAGIC 0x53504d45u /* "EMPS" */
#define PS_HDR_BYTES 56u

typedef enum ps_op {
    PS_OP_HELLO = 1,
    PS_OP_PULL = 2,
    PS_OP_PUSH = 3,
    PS_OP_PULL_DENSE = 4,
    PS_OP_PUSH_DENSE = 5,
    PS_OP_INIT_DENSE = 6,
    PS_OP_CLOCK = 7,
    PS_OP_BARRIER = 8,
    PS_OP_SAVE = 9,
    PS_OP_LOAD = 10,
    PS_OP_STATS = 11,
    PS_OP_SHUTDOWN = 12,
    PS_OP_REPLICATE = 13, /* primary -> backup: u64 sequence number, then one whole request */
    PS_OP_MAX_ = 14,
} ps_op;

/* PULL flag: read only (emb_table_lookup): nothing created, absent keys read as zeros. */
#define PS_FLAG_LOOKUP 0x01u
/* PUSH flag: the payload names the key list of an earlier PULL by the same worker (u64 pull
 * request id, u64 ps_keys_sum of its keys) instead of carrying keys: a worker pushes gradients
 * for exactly the keys it has just pulled, so the keys need not cross the wire twice. */
#define PS_FLAG_ELIDED 0x02u
#define PS_ELIDED_HEAD 16u /* bytes before the rows of an elided push */
/* PUSH_DENSE flag: the reply carries the block as it is after this update (what a PULL_DENSE
 * right after would return), saving the worker that round trip before its next step. A
 * resent push, acknowledged without being applied again, returns the current block. */
#define PS_FLAG_READ_BACK 0x04u
/* PULL_DENSE flag: the reply carries the block's whole state (u64 optimizer step, the values,
 * then each optimizer slot: adam m and v, adagrad's sums), from which a client builds its
 * mirror of the block (ps_client_dense_mirror). */
#define PS_FLAG_STATE 0x08u
/* PUSH_DENSE flag: the reply carries u64 optimizer step and u64 xxh3-64 of the values after
 * this update (a resent push not applied again: of the values now), which a mirroring client
 * checks its own copy against. */
#define PS_FLAG_DIGEST 0x10u
#define PS_DIGEST_BYTES 16u
/* BARRIER flag, request: this worker votes to stop the job after this barrier (it had a
 * SIGTERM or SIGINT: ps_client_barrier_vote). Reply: some worker voted so at this barrier
 * (shard 0 ORs the votes of the barrier it gathers; every reply releasing it carries the OR),
 * so every worker that passes it learns the same answer at the same point. */
#define PS_FLAG_STOP 0x20u
/* BARRIER flag: a stop poll, which never waits (ps_client_stop_poll): clock is the worker's
 * step, count the steps between its polls; with PS_FLAG_STOP it votes to stop. Shard 0 answers
 * with the step the job stops at in the reply's clock and PS_FLAG_STOP (0: none fixed yet): the
 * first vote fixes it at the most steps any worker has polled at plus that interval, a poll
 * step every worker still reaches, and each learns it at its next poll. For a job without
 * periodic checkpoints, whose workers have no barrier to vote at. */
#define PS_FLAG_POLL 0x40u
#define PS_POLL_MAX_EVERY (1u << 20)
#define PS_POLL_MAX_STEP (1u << 31)
/* Key lists of recent PULLs each server keeps per (worker, table), and each client per
 * (table, shard): enough for a worker that prefetches the next batch while pushing this one. */
#define PS_KEYLIST_RING 4u

/* The request flags op may carry (those above); the server refuses any other bit. */
uint8_t ps_op_flags(uint16_t op);

/* Reply status of a backup that has taken over, to its old primary's REPLICATE: the old
 * primary is fenced and must stop serving. */
#define PS_STATUS_FENCED (-100)
/* Reply status to an elided PUSH whose key list this server does not hold (evicted, or a backup
 * that took over and never saw the pull): nothing was applied; the client sends the push again
 * with explicit keys. */
#define PS_STATUS_NO_KEYS (-101)

typedef struct ps_hdr {
    uint32_t magic;
    uint16_t version;
    uint16_t op;
    uint32_t table; /* table or dense block id */
    uint32_t count; /* keys, or values for dense ops */
    uint8_t codec;
    uint8_t flags;
    int16_t status; /* replies: 0 ok, < 0 error (payload = message) */
    uint16_t worker;
    uint16_t reserved;
    uint32_t clock;
    uint32_t reserved2;
    uint64_t req_id;
    uint64_t payload_len;
    uint64_t checksum; /* xxh3-64 of header (this field zero) + payload */
} ps_hdr;
_Static_assert(sizeof(ps_hdr) == PS_HDR_BYTES, "wire header is 56 bytes");

/* Seals a message in place: buf holds the header then payload_len bytes; fills magic, version,
 * payload_len and checksum. */
void ps_wire_seal(void *buf, size_t payload_len);

/* Checks a received message: size >= header, magic, version, op range, payload_len equal to
 * what arrived, checksum. On success copies the header into *h. Errors name the field. */
int ps_wire_open(const void *buf, size_t len, ps_hdr *h, char **errptr);

/* The most bytes one varint takes. */
#define PS_VARINT_MAX 10u

/* Unsigned LEB128. put returns bytes written (<= PS_VARINT_MAX). get returns bytes read, 0 when the
 * input ends first or the value overflows 64 bits. */
size_t ps_varint_put(uint8_t *out, uint64_t v);
size_t ps_varint_get(const uint8_t *in, size_t len, uint64_t *v);

/* Keys, strictly increasing, as delta varints (ps_varint_put's bytes). out must hold 10 bytes
 * a key, the worst case: bytes past the returned length may be overwritten. */
size_t ps_keys_encode(const uint64_t *keys, size_t n, uint8_t *out);
/* Decodes exactly n strictly increasing keys from exactly len bytes. */
int ps_keys_decode(const uint8_t *in, size_t len, size_t n, uint64_t *keys, char **errptr);

/* The checksum an elided push carries of the key list it names: xxh3-64 of the keys as
 * little-endian u64s. */
uint64_t ps_keys_sum(const uint64_t *keys, size_t n);

/* Rows of dim floats to a codec and back. encode may write the decoded (lossy) values into
 * back (optional) so the caller can keep the quantisation residual. */
void ps_codec_encode(ps_codec c, const float *src, size_t rows, uint32_t dim, uint8_t *dst,
                     float *back);
/* Decodes rows; fails (naming the row) on a non-finite value, or a negative or non-finite
 * int8 scale. */
int ps_codec_decode(ps_codec c, const uint8_t *src, size_t rows, uint32_t dim, float *dst,
                    char **errptr);

/* Checks n fp32 values as ps_codec_decode checks a decoded batch of rows of dim floats (same
 * code and message), for a caller that reads fp32 rows where they lie in the message. */
int ps_f32_check(const float *x, size_t n, uint32_t dim, char **errptr);

/* Where a PULL's or PUSH's parts lie in its payload p (h->payload_len bytes, checked by
 * ps_wire_open), for a table of `dim`: keys at keys_at (key_bytes of varints, or for an elided
 * push its 16-byte head), then for a push n rows of row_bytes at rows_at. Checks the codec, the
 * count against the payload, and that the lengths add up; a failure is CM_EINVAL with a message
 * naming the field in msg (cap bytes). The server and the fuzz target both use it. */
typedef struct ps_rows_layout {
    size_t n, row_bytes, key_bytes;
    const uint8_t *keys_at, *rows_at;
    bool elided; /* a PUSH with PS_FLAG_ELIDED */
} ps_rows_layout;
int ps_rows_layout_get(const ps_hdr *h, const uint8_t *p, uint32_t dim, ps_rows_layout *out,
                       char *msg, size_t cap);

/* An error reply's text (payload p of len bytes) for a terminal or log: at most cap - 1 bytes
 * of it, up to a NUL, with control characters (escape sequences, line breaks of the sender's
 * choosing) shown as '?', NUL-terminated in out. True when the text was cut. */
bool ps_error_text(const uint8_t *p, size_t len, char *out, size_t cap);

/* A fingerprint of everything about a table or dense block that client and server must
 * agree on (name, model config, codecs). */
uint64_t ps_table_fingerprint(const ps_table_spec *t);
uint64_t ps_dense_fingerprint(const ps_dense_spec *d);

#endif
