/* Memory locations as regions name them: "cpu" or "cuda:N". */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "mem.h"

#define MAX_DEVICE 1023

int sx__mem_parse_location(const char *location, sx__mem_info *out) {
  const char *loc = location ? location : "cpu";
  if (strcmp(loc, "cpu") == 0) {
    *out = (sx__mem_info){.kind = SX__MEM_HOST, .device = -1};
    return 0;
  }
  if (strncmp(loc, "cuda:", 5) == 0) {
    const char *s = loc + 5;
    size_t n = strspn(s, "0123456789");
    if (n > 0 && n <= 4 && s[n] == '\0' && (n == 1 || s[0] != '0')) {
      int dev = atoi(s);
      if (dev <= MAX_DEVICE) {
        *out = (sx__mem_info){.kind = SX__MEM_CUDA, .device = dev};
        return 0;
      }
    }
  }
  return sx__err(SX_EINVAL, "location '%.31s' is neither 'cpu' nor 'cuda:N' (N a device "
                 "ordinal 0..%d)", loc, MAX_DEVICE);
}
