/* Fuzz target: the TCP data-plane frame and HELLO parsers (agent/transport/conn/frame.h).
 * A header that parses re-encodes to the same bytes; a HELLO body that
 * parses re-encodes to the same body. */
#include <stdlib.h>
#include <string.h>

#include "transport/conn/frame.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  sx__frame f;
  uint8_t again[SX__FRAME_HDR];
  int rc = sx__frame_decode(data, size, &f);
  if (rc == SX__FRAME_HDR) {
    sx__frame_encode(&f, again);
    if (memcmp(again, data, SX__FRAME_HDR) != 0)
      abort();
  } else if (rc > 0 || (rc == 0 && size >= SX__FRAME_HDR)) {
    abort(); /* a whole header is either valid or an error */
  }
  /* The rest of the input (or all of it) as a HELLO body. */
  const uint8_t *body = size > SX__FRAME_HDR ? data + SX__FRAME_HDR : data;
  size_t blen = size > SX__FRAME_HDR ? size - SX__FRAME_HDR : size;
  sx__hello h;
  uint8_t out[SX__HELLO_MAX];
  if (sx__hello_decode(body, blen, &h) == 0) {
    int n = sx__hello_encode(&h, out, sizeof(out));
    if (n < 0 || (size_t)n != blen || memcmp(out, body, blen) != 0)
      abort();
  }
  return 0;
}
