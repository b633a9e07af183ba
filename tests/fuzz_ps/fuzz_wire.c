/*
 * libFuzzer target: the PS server's decoding of a received message, in the order the server
 * does it: ps_wire_open, then for PULL/PUSH the server's own count and length checks
 * (ps_rows_layout_get), the key list and the rows in the message's codec. A checksum stops random
 * bytes at the first step, so the first input byte picks a mode: odd = seal the rest first (a valid
 * frame with fuzzed fields and payload, reaching the key and codec decoders), even = the bytes as
 * they are (header checks).
 *
 * An elided PUSH (PS_FLAG_ELIDED) names a pull's key list instead of carrying keys: its length
 * check, its rows, and the lookup of the list it names in a key cache that holds one list.
 *
 * Properties checked (abort on violation): decoded keys are strictly increasing and re-encode
 * to the same bytes' length or less (overlong varints shrink); decoded rows are finite; a
 * successful open reports the length that arrived; a key list is handed out only for the
 * request id, count and checksum it was stored under, and unchanged.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ps/keycache.h"
#include "ps/wire.h"

#define MAX_BYTES (1u << 20) /* like the server's max_message, kept small for speed */

/* The one list the key cache holds: pull 7 of worker 0, table 0. */
static const uint64_t held[3] = {3, 40, 500};

static ps_keycache *cache(void)
{
    static ps_keycache *kc;
    if (kc == NULL) {
        kc = ps_keycache_create(2, 2);
        uint64_t *k = malloc(sizeof held);
        if (kc == NULL || k == NULL) abort();
        memcpy(k, held, sizeof held);
        ps_keycache_put(kc, 0, 0, 7, k, NULL, 3);
    }
    return kc;
}

static void elided_keys(const ps_hdr *h, const uint8_t *p, uint64_t *keys)
{
    uint64_t pull_id, sum;
    size_t have;
    memcpy(&pull_id, p, 8);
    memcpy(&sum, p + 8, 8);
    ps_keycache_result r = ps_keycache_get(cache(), h->worker % 3, h->table % 3, pull_id, h->count,
                                           sum, keys, NULL, &have);
    if (r == PS_KC_FOUND && (pull_id != 7 || h->count != 3 || sum != ps_keys_sum(held, 3) ||
                             memcmp(keys, held, sizeof held)))
        abort();
}

static void decode_rows(const ps_hdr *h, const uint8_t *p)
{
    const uint32_t dim = 1 + h->table % 17; /* as if the cluster had tables of dim 1..17 */
    ps_rows_layout lay;
    char msg[256];
    if (ps_rows_layout_get(h, p, dim, &lay, msg, sizeof msg) != CM_OK) {
        if (msg[0] == '\0') abort(); /* every refusal names its reason */
        return;
    }
    const size_t n = lay.n, key_bytes = lay.key_bytes;
    const int elided = lay.elided;
    if ((double)n * lay.row_bytes > MAX_BYTES) return; /* the server's reply_too_big */
    if (lay.keys_at < p || lay.rows_at != lay.keys_at + key_bytes ||
        lay.rows_at + (h->op == PS_OP_PUSH ? n * lay.row_bytes : 0) > p + h->payload_len)
        abort(); /* the layout stays inside the payload */
    p = lay.keys_at;
    uint64_t *keys = malloc(n * sizeof *keys);
    float *vals = malloc(n * dim * sizeof *vals);
    uint8_t *re = malloc(n * 10);
    char *err = NULL;
    if (elided) {
        elided_keys(h, p, keys);
        if (ps_codec_decode((ps_codec)h->codec, p + key_bytes, n, dim, vals, &err) == CM_OK)
            for (size_t i = 0; i < n * dim; i++)
                if (!isfinite(vals[i])) abort();
    } else if (ps_keys_decode(p, key_bytes, n, keys, &err) == CM_OK) {
        for (size_t i = 1; i < n; i++)
            if (keys[i] <= keys[i - 1]) abort();
        if (ps_keys_encode(keys, n, re) > key_bytes) abort();
        if (h->op == PS_OP_PUSH &&
            ps_codec_decode((ps_codec)h->codec, p + key_bytes, n, dim, vals, &err) == CM_OK)
            for (size_t i = 0; i < n * dim; i++)
                if (!isfinite(vals[i])) abort();
    }
    free(err);
    free(keys);
    free(vals);
    free(re);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > MAX_BYTES) return 0;
    const int seal = data[0] & 1;
    size--;
    uint8_t *buf = malloc(size ? size : 1);
    memcpy(buf, data + 1, size);
    if (seal && size >= PS_HDR_BYTES) ps_wire_seal(buf, size - PS_HDR_BYTES);
    ps_hdr h;
    char *err = NULL;
    if (ps_wire_open(buf, size, &h, &err) == CM_OK) {
        if (h.payload_len != size - PS_HDR_BYTES) abort();
        if (h.op == PS_OP_PULL || h.op == PS_OP_PUSH) decode_rows(&h, buf + PS_HDR_BYTES);
    } else if (err == NULL) {
        abort(); /* every refusal names its reason */
    }
    free(err);
    free(buf);
    return 0;
}
