/* Fuzz target: segment event decode; decoded events re-encode identically. */
#include <stdlib.h>
#include <string.h>

#include "segxfer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  sx_event ev, again;
  uint8_t *buf;
  size_t len;
  if (sx_event_decode(data, size, &ev) != 0)
    return 0;
  if (sx_name_validate(ev.name) != 0)
    abort();
  if (sx_event_encode(&ev, &buf, &len) != 0 || sx_event_decode(buf, len, &again) != 0 ||
      memcmp(&ev, &again, sizeof(ev)) != 0)
    abort();
  free(buf);
  return 0;
}
