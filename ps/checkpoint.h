/* Private to ps/: the shard manifest text shared by the server's SAVE and offline resharding. */
#ifndef EMBER_PS_CHECKPOINT_H
#define EMBER_PS_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

/* "ember-ps-shard 1", the shard index and count, body (the table/dense fingerprint lines),
 * then "checksum XXH3" over all before it. Returns the length, or -1 when n is too small. */
int ps_shard_manifest_text(uint32_t shard, uint32_t shards, const char *body, char *out, size_t n);

#endif
