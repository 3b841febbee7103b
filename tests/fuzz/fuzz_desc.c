/* Fuzz target: descriptor decode + validate.  Whatever decodes must be valid,
 * re-encode, and decode again to the same descriptor. */
#include <stdlib.h>
#include <string.h>

#include "segxfer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  sx_desc d, again;
  uint8_t *buf;
  size_t len;
  if (sx_desc_decode(data, size, &d) != 0)
    return 0;
  if (sx_desc_validate(&d) != 0)
    abort();
  if (sx_desc_encode(&d, &buf, &len) != 0)
    abort();
  if (sx_desc_decode(buf, len, &again) != 0)
    abort();
  if (again.n_regions != d.n_regions || again.n_endpoints != d.n_endpoints ||
      (d.n_regions && memcmp(again.regions, d.regions, d.n_regions * sizeof(sx_region))) ||
      memcmp(again.incarnation, d.incarnation, SX_INCARNATION_LEN) != 0 ||
      strcmp(again.host_id, d.host_id) != 0 || strcmp(again.hostname, d.hostname) != 0 ||
      again.process != d.process || memcmp(&again.layout, &d.layout, sizeof(d.layout)))
    abort();
  /* A valid descriptor plans against itself (block descriptions whose
   * numbers passed validation cut blocks inside them), and its plan has
   * words. */
  const sx_desc *self[1] = {&d};
  sx_plan *plan;
  char *words;
  int prc = sx_layout_plan(&d, self, 1, 0, &plan, NULL);
  if (prc != 0 && prc != SX_ELIMIT)
    abort();
  if (prc == 0) {
    if (sx_plan_text(plan, &words) != 0)
      abort();
    free(words);
    sx_plan_free(plan);
  }
  /* The JSON form must parse back as a layout with the same regions. */
  char *json;
  sx_desc lay;
  if (sx_desc_to_json(&d, 1, &json) == 0) {
    if (sx_layout_parse(json, strlen(json), &lay) != 0)
      abort();
    if (sx_layout_check(&d, &lay, 0, NULL) != 0)
      abort();
    sx_desc_free(&lay);
    free(json);
  }
  free(buf);
  sx_desc_free(&again);
  sx_desc_free(&d);
  return 0;
}
