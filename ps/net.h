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
 * count, codec, worker, clock and req_id taken from h (NULL: all zero). *payload points into it.
 */
int ps_msg_new(const ps_hdr *h, size_t payload_len, nng_msg **out, uint8_t **payload);
/* Seals a message built by ps_msg_new (magic, version, length, checksum). */
void ps_msg_seal(nng_msg *m);

#endif
