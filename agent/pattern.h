/*
 * The verification pattern: a deterministic byte for every (seed, region
 * id, offset), so a reader that knows the seed can check every byte it read
 * from a segment filled with it (`sx-agent --fill SEED`,
 * `sxctl read --verify SEED`).  Not installed.
 *
 *   word(k)  = splitmix64(seed ^ (region * 0xD1B54A32D192ED03)
 *                         + k * 0x9E3779B97F4A7C15)
 *   byte(o)  = (word(o / 8) >> (8 * (o % 8))) & 0xff     (little-endian)
 *
 * where region is the region id in the target's descriptor and o the byte
 * offset inside that region.  Neighbouring regions, offsets and seeds all
 * give unrelated bytes, so misplaced or stale data does not verify.
 */
#ifndef SX_AGENT_PATTERN_H
#define SX_AGENT_PATTERN_H

#include <stddef.h>
#include <stdint.h>

/* Write the pattern for bytes [offset, offset+len) of region into dst. */
void sx__pattern_fill(void *dst, uint64_t len, uint64_t seed, uint32_t region,
                      uint64_t offset);

/* Compare src against the pattern: 0 when every byte matches, else -1 and
 * *bad (may be NULL) is the first offset (relative to src) that differs. */
int sx__pattern_check(const void *src, uint64_t len, uint64_t seed, uint32_t region,
                      uint64_t offset, uint64_t *bad);

/* The same for memory of any kind (pattern_mem.c): device memory goes
 * through a host buffer.  Fill: 0 or an error from the copy.  Check: 0,
 * -1 with *bad as above, or an error from the copy. */
int sx__pattern_fill_any(void *dst, uint64_t len, uint64_t seed, uint32_t region,
                         uint64_t offset);
int sx__pattern_check_any(const void *src, uint64_t len, uint64_t seed, uint32_t region,
                          uint64_t offset, uint64_t *bad);

/* Parse a seed: decimal or 0x-hex.  0 or SX_EINVAL. */
int sx__pattern_parse(const char *s, uint64_t *seed);

#endif
