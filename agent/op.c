/* Batch completion as a counter: each range settles once, the first error
 * sticks, done runs at zero. */
#include <stdio.h>
#include <string.h>

#include "transport/transport.h"

void sx__op_error(sx_op *op, int status, const char *msg) {
  if (status != 0 && op->first_error == 0) {
    op->first_error = status;
    snprintf(op->message, sizeof(op->message), "%s", msg ? msg : sx_strerror(status));
  }
}

/* n ranges of bytes settled with status: count them, keep the first error,
 * run done at zero. */
static void settled(sx_op *op, size_t n, uint64_t bytes, int status, const char *msg) {
  if (status == 0)
    op->bytes += bytes;
  else
    sx__op_error(op, status, msg);
  op->pending -= n;
  if (op->pending == 0 && op->done != NULL)
    op->done(op);
}

void sx__op_xfer_done(sx_op *op, size_t idx, int status, const char *msg) {
  sx_xfer *x = &op->xfers[idx];
  if (x->status != 1)
    return; /* already settled: a late completion after an abort */
  x->status = status;
  settled(op, 1, x->length, status, msg);
}

void sx__op_xfers_done(sx_op *op, int status, const char *msg) {
  if (op->tab != NULL) {
    if (op->pending > 0)
      settled(op, op->pending, op->total, status, msg);
    return;
  }
  size_t n = 0;
  uint64_t bytes = 0;
  for (size_t i = 0; i < op->n && n < op->pending; i++) {
    sx_xfer *x = &op->xfers[i];
    if (x->status != 1)
      continue; /* settled before (an abort, a range that failed alone) */
    x->status = status;
    bytes += x->length;
    n++;
  }
  if (n > 0)
    settled(op, n, bytes, status, msg);
}
