/*
 * sx-bench read --op write: the writer's side of the comparison.  read.c
 * runs the cases as it does for reads, with this process as a named
 * producer writing into the target's pool (docs/push.md); the baselines
 * are perftest's ib_write_bw on the same device and, for TCP, the raw
 * stream the other way round: this process sends chunks of its own
 * (filled) memory and the target receives them into its pool, with as many
 * connections and a thread per connection on each side (read_base.c).
 */
#include <stdlib.h>

#include "read.h"
#include "segxfer/push.h"

int bx_write_batch(sx_segment *seg, const sx_block_read *ent, size_t n, sx_batch **out) {
  sx_block_write *w = malloc((n ? n : 1) * sizeof(*w));
  if (w == NULL)
    return SX_ENOMEM;
  for (size_t i = 0; i < n; i++)
    w[i] = (sx_block_write){.group = ent[i].group, .layer_first = ent[i].layer_first,
                            .layer_count = ent[i].layer_count, .slots = ent[i].slots,
                            .local_block = ent[i].local_block,
                            .remote_block = ent[i].remote_block, .count = ent[i].count};
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = 30000;
  bp.flags = SX_BATCH_WRITE;
  int rc = sx_batch_create(seg, &bp, out);
  if (rc == 0 && (rc = sx_batch_add_block_writes(*out, w, n)) == 0)
    rc = sx_batch_submit(*out);
  free(w);
  return rc;
}
