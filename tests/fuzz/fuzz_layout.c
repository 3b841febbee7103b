/* Fuzz target: layout files (JSON).  Accepted layouts print and parse back
 * to a compatible layout. */
#include <stdlib.h>
#include <string.h>

#include "segxfer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  sx_desc d, back;
  char *json;
  if (sx_layout_parse((const char *)data, size, &d) != 0)
    return 0;
  if (sx_desc_to_json(&d, 1, &json) != 0)
    abort();
  if (sx_layout_parse(json, strlen(json), &back) != 0)
    abort();
  if (sx_layout_check(&d, &back, 0, NULL) != 0 || back.n_regions != d.n_regions)
    abort();
  sx_desc_free(&back);
  sx_desc_free(&d);
  free(json);
  return 0;
}
