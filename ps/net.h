/*
 * Private to ps/: nng endpoints (TLS set up from the cluster config for tls+tcp:// URLs) and
 * message helpers shared by server and client.
 */
#ifndef EMBER_PS_NET_H
#define EMBER_PS_NET_H

#include <nng/nng.h>

#include "ps/wire.h"

/* Starts a listener (server) or dialer (client) on url. For tls+tcp:// the config's cert/key
 * (and CA, which turns on peer verification) are loaded. nng errors become CM_EIO with the URL. */
int ps_net_listen(nng_socket sock, const char *url, const ps_config *cfg, char **errptr);
/* The dialer goes to *dialer when that is not NULL (the client closes it to fail over). */
int ps_net_dial(nng_socket sock, const char *url, const ps_config *cfg, nng_dialer *dialer,
                char **errptr);

/* Allocates a message of header + payload_len bytes with the header zeroed but for op, table,
 * count, codec, flags, worker, clock and req_id taken from h (NULL: all zero). *payload points
 * into it. */
int ps_msg_new(const ps_hdr *h, size_t payload_len, nng_msg **out, uint8_t **payload);
/* A PULL (keys) or, when h->op is PUSH, a PUSH with explicit keys (u32 key bytes, keys, n rows
 * of row_bytes) for n sorted keys; header fields as ps_msg_new, not sealed. CM_ENOMEM. */
int ps_msg_rows(const ps_hdr *h, const uint64_t *keys, size_t n, const uint8_t *rows,
                size_t row_bytes, nng_msg **out);
/* Seals a message built by ps_msg_new (magic, version, length, checksum). */
void ps_msg_seal(nng_msg *m);

/* Takes the message off an aio (a received one, or a send nng handed back), leaving the aio
 * without one: the caller owns it. Every hand-off goes through here, so that a message still
 * on an aio at teardown is one nng never took and ps_aio_free_stopped may free it. */
nng_msg *ps_aio_msg_take(nng_aio *aio);
/* Frees an aio already stopped (nng_aio_stop) and its socket closed, with any message still on
 * it: an operation started from a callback after the stop fails without calling back, so its
 * message is left there (nng 1.5). NULL is ignored. */
void ps_aio_free_stopped(nng_aio *aio);

#endif
