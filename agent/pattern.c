/* The verification pattern (see pattern.h).  Generated and checked a word
 * at a time: one splitmix64 per 8 bytes keeps filling a pool of gigabytes
 * and verifying every byte read cheap next to the transfer itself. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "pattern.h"

static uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static uint64_t key_of(uint64_t seed, uint32_t region) {
  return seed ^ ((uint64_t)region * 0xD1B54A32D192ED03ull);
}

static uint64_t word(uint64_t key, uint64_t k) {
  return splitmix64(key + k * 0x9E3779B97F4A7C15ull);
}

/* The word as it lies in memory: the pattern is little-endian. */
static uint64_t le64(uint64_t w) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  return __builtin_bswap64(w);
#else
  return w;
#endif
}

static uint8_t byte_at(uint64_t key, uint64_t o) {
  return (uint8_t)(word(key, o / 8) >> (8 * (o % 8)));
}

void sx__pattern_fill(void *dst, uint64_t len, uint64_t seed, uint32_t region,
                      uint64_t offset) {
  uint8_t *p = dst;
  uint64_t key = key_of(seed, region), o = offset, end = offset + len;
  for (; o < end && (o % 8) != 0; o++)
    *p++ = byte_at(key, o);
  for (; o + 8 <= end; o += 8, p += 8) {
    uint64_t w = le64(word(key, o / 8));
    memcpy(p, &w, 8);
  }
  for (; o < end; o++)
    *p++ = byte_at(key, o);
}

int sx__pattern_check(const void *src, uint64_t len, uint64_t seed, uint32_t region,
                      uint64_t offset, uint64_t *bad) {
  const uint8_t *p = src;
  uint64_t key = key_of(seed, region);
  uint64_t o = offset, end = offset + len;
  for (; o < end; o++) {
    if ((o % 8) == 0 && o + 8 <= end) {
      uint64_t w = le64(word(key, o / 8)), got;
      memcpy(&got, p + (o - offset), 8);
      if (w == got) {
        o += 7;
        continue;
      }
    }
    if (p[o - offset] != byte_at(key, o)) {
      if (bad)
        *bad = o - offset;
      return -1;
    }
  }
  return 0;
}

int sx__pattern_parse(const char *s, uint64_t *seed) {
  /* Digits only: strtoull would also take blanks, a sign and octal
   * (--fill 010 would be 8). */
  const char *end;
  uint64_t v;
  int rc = sx__parse_num(s, &end, &v);
  if (rc == SX_EOVERFLOW)
    return sx__err(SX_EINVAL, "pattern seed '%.32s' is out of range (at most 2^64-1)", s);
  if (rc == 0 && *end != '\0')
    rc = SX_EINVAL;
  if (rc)
    return sx__err(SX_EINVAL, "pattern seed '%.32s' is not a number (decimal without "
                   "leading zeros, or 0x hex)", s);
  *seed = v;
  return 0;
}
