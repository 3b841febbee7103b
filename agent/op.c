/* Batch completion as a counter: each range settles once, the first error
 * sticks, done runs at zero. */
#include <stdio.h>
#include <string.h>

#include "transport/transport.h"

void sx__op_xfer_done(sx_op *op, size_t idx, int status, const char *msg) {
  sx_xfer *x = &op->xfers[idx];
  if (x->status != 1)
    return; /* already settled: a late completion after an abort */
  x->status = status;
  if (status == 0) {
    op->bytes += x->length;
  } else if (op->first_error == 0) {
    op->first_error = status;
    snprintf(op->message, sizeof(op->message), "%s", msg ? msg : sx_strerror(status));
  }
  if (--op->pending == 0 && op->done != NULL)
    op->done(op);
}
