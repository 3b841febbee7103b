/*
 * The verification pattern in memory of any kind: device memory is filled
 * and checked through a host buffer and a copy (no GPU kernels), so
 * `sx-agent --location cuda:0 --fill` and `sxctl read --location cuda:0
 * --verify` work the same as on host memory.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "mem/mem.h"
#include "pattern.h"

#define BOUNCE (16u << 20)

int sx__pattern_fill_any(void *dst, uint64_t len, uint64_t seed, uint32_t region,
                         uint64_t offset) {
  sx__mem_info m;
  sx__mem_query(dst, &m);
  if (m.kind == SX__MEM_HOST) {
    sx__pattern_fill(dst, len, seed, region, offset);
    return 0;
  }
  uint8_t *buf = malloc(len < BOUNCE ? (size_t)len : BOUNCE);
  if (buf == NULL)
    return sx__err(SX_ENOMEM, "pattern: bounce buffer");
  int rc = 0;
  for (uint64_t done = 0; done < len && rc == 0;) {
    size_t n = len - done < BOUNCE ? (size_t)(len - done) : BOUNCE;
    sx__pattern_fill(buf, n, seed, region, offset + done);
    rc = sx__mem_copy((uint8_t *)dst + done, buf, n);
    done += n;
  }
  free(buf);
  return rc;
}

int sx__pattern_check_any(const void *src, uint64_t len, uint64_t seed, uint32_t region,
                          uint64_t offset, uint64_t *bad) {
  sx__mem_info m;
  sx__mem_query(src, &m);
  if (m.kind == SX__MEM_HOST)
    return sx__pattern_check(src, len, seed, region, offset, bad);
  uint8_t *buf = malloc(len < BOUNCE ? (size_t)len : BOUNCE);
  if (buf == NULL)
    return sx__err(SX_ENOMEM, "pattern: bounce buffer");
  int rc = 0;
  for (uint64_t done = 0; done < len && rc == 0;) {
    size_t n = len - done < BOUNCE ? (size_t)(len - done) : BOUNCE;
    uint64_t b;
    if ((rc = sx__mem_copy(buf, (const uint8_t *)src + done, n)) != 0)
      break;
    if (sx__pattern_check(buf, n, seed, region, offset + done, &b) != 0) {
      if (bad != NULL)
        *bad = done + b;
      rc = -1;
    }
    done += n;
  }
  free(buf);
  return rc;
}
