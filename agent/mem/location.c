/* Memory locations as regions name them: "cpu" or "cuda:N". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "mem.h"
#include "segxfer/agent.h"

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

int sx_mem_location(const void *addr, uint64_t length, char *out, size_t size) {
  if (addr == NULL || out == NULL)
    return sx__err(SX_EINVAL, "sx_mem_location: NULL %s", addr ? "out" : "addr");
  /* Ask the driver what the first byte is, then check the whole range as
   * sx_agent_register() will, so that an answer is always registrable. */
  sx__mem_info q, m;
  sx__mem_query(addr, &q);
  char loc[16] = "cpu";
  if (q.kind == SX__MEM_CUDA)
    snprintf(loc, sizeof(loc), "cuda:%d", q.device);
  int rc = sx__mem_check(addr, length, loc, &m);
  if (rc)
    return rc;
  size_t n = strlen(loc) + 1;
  if (size < n)
    return sx__err(SX_EINVAL, "sx_mem_location: %p is %s, which needs %zu bytes of out "
                   "(given %zu)", addr, loc, n, size);
  memcpy(out, loc, n);
  return 0;
}
