/* Fuzz target: the push-mode notice decoder (meta/notice.h).  A notice that
 * decodes passes its own structural check and re-encodes to bytes that
 * decode to the same notice. */
#include <stdlib.h>
#include <string.h>

#include "notice.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int same(const sx_notice *a, const sx_notice *b) {
  return strcmp(a->producer, b->producer) == 0 &&
         memcmp(a->incarnation, b->incarnation, SX_INCARNATION_LEN) == 0 &&
         a->kind == b->kind && a->tag == b->tag && a->bytes == b->bytes &&
         a->n_blocks == b->n_blocks &&
         a->n_ranges == b->n_ranges &&
         memcmp(a->blocks, b->blocks, a->n_blocks * sizeof(*a->blocks)) == 0 &&
         memcmp(a->ranges, b->ranges, a->n_ranges * sizeof(*a->ranges)) == 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  sx_notice *n = NULL, *again = NULL;
  uint8_t *buf;
  size_t len;
  if (sx__notice_decode(data, size, &n) != 0)
    return 0;
  if (sx__notice_check(n) != 0 || n->n_blocks + n->n_ranges > SX_NOTICE_MAX_ENTRIES)
    abort();
  if (sx__notice_encode(n, &buf, &len) != 0 || len > SX_NOTICE_MAX_BYTES ||
      sx__notice_decode(buf, len, &again) != 0 || !same(n, again))
    abort();
  free(buf);
  sx_notice_free(again);
  sx_notice_free(n);
  return 0;
}
