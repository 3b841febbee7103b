/* Built against the installed copy of segxfer with pkg-config only. */
#include <segxfer.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(void) {
  sx_desc a, b;
  sx_mismatch m;
  sx_desc_init(&a);
  strcpy(a.layout.dtype, "bf16");
  sx_region r = {.id = 0, .layer_count = 1, .block_bytes = 4096, .block_stride = 4096,
                 .num_blocks = 8, .length = 8 * 4096};
  strcpy(r.location, "cpu");
  if (sx_desc_add_region(&a, &r) != 0 || sx_desc_copy(&b, &a) != 0)
    return 1;
  b.regions[0].block_bytes = b.regions[0].block_stride = 2048;
  int rc = sx_layout_check(&a, &b, 0, &m);
  printf("segxfer %s: %s: %s\n", sx_version(), sx_err_name(rc), m.message);
  sx_desc_free(&a);
  sx_desc_free(&b);
  return rc == SX_EINCOMPAT && m.kind == SX_MISMATCH_BLOCK_BYTES ? 0 : 1;
}
