/*
 * Block reads given as arrays of block ids (sx_batch_add_block_ids).
 *
 * Engines keep a request's blocks as a row of a block table: an array of
 * ids, scattered over the pool.  Turning that into sx_block_read entries
 * one block at a time would cost the caller a loop per block (and, from
 * Python, a loop in the interpreter).  Here the arrays go down whole: each
 * run of ids consecutive on both sides becomes one entry, and the entries
 * are planned by one sx_batch_add_blocks() call, so the call is all or
 * nothing exactly like it.
 */
#include <stdlib.h>

#include "agent_int.h"

/* Does id i continue the run of i-1 on both sides?  Written so that
 * UINT64_MAX followed by 0 is not taken for a run. */
static int continues(const uint64_t *remote, const uint64_t *local, size_t i) {
  return remote[i - 1] != UINT64_MAX && remote[i] == remote[i - 1] + 1 &&
         local[i - 1] != UINT64_MAX && local[i] == local[i - 1] + 1;
}

int sx_batch_add_block_ids(sx_batch *b, uint32_t group, uint32_t layer_first,
                           uint32_t layer_count, uint64_t slots, const uint64_t *remote_ids,
                           const uint64_t *local_ids, size_t n) {
  if (b == NULL || (n > 0 && (remote_ids == NULL || local_ids == NULL)))
    return sx__err(SX_EINVAL, "sx_batch_add_block_ids: NULL argument");
  if (n == 0)
    return sx_batch_add_blocks(b, NULL, 0);
  size_t runs = 1;
  for (size_t i = 1; i < n; i++)
    runs += !continues(remote_ids, local_ids, i);
  if (runs > SIZE_MAX / sizeof(sx_block_read))
    return sx__err(SX_ELIMIT, "sx_batch_add_block_ids: %zu runs of block ids", runs);
  sx_block_read *e = malloc(runs * sizeof(*e));
  if (e == NULL)
    return sx__err(SX_ENOMEM, "sx_batch_add_block_ids: %zu runs of block ids", runs);
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    if (i > 0 && continues(remote_ids, local_ids, i)) {
      e[k - 1].count++;
      continue;
    }
    e[k++] = (sx_block_read){.group = group, .layer_first = layer_first,
                             .layer_count = layer_count, .slots = slots,
                             .remote_block = remote_ids[i], .local_block = local_ids[i],
                             .count = 1};
  }
  int rc = sx_batch_add_blocks(b, e, runs);
  free(e);
  return rc;
}
