/* Helpers shared inside libsegxfer.  Not installed. */
#ifndef SX_META_INTERNAL_H
#define SX_META_INTERNAL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "segxfer/descriptor.h"
#include "segxfer/errors.h"

#if defined(__GNUC__)
#define SX__PRINTF(a, b) __attribute__((format(printf, a, b)))
#define SX__UNUSED __attribute__((unused))
#else
#define SX__PRINTF(a, b)
#define SX__UNUSED
#endif

#define SX__ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

/*
 * Record a message for sx_errmsg() on this thread and return code, so a
 * failure reads `return sx__err(SX_EBOUNDS, "region %u: ...", id);`.
 */
int sx__err(int code, const char *fmt, ...) SX__PRINTF(2, 3);
int sx__verr(int code, const char *fmt, va_list ap);
/* Prefix the current message with more context: "<fmt>: <previous>". */
int sx__errwrap(int code, const char *fmt, ...) SX__PRINTF(2, 3);

/* Overflow-checked arithmetic; return 0 on overflow, 1 otherwise. */
static inline int sx__add_ok(uint64_t a, uint64_t b, uint64_t *r) {
  return !__builtin_add_overflow(a, b, r);
}
static inline int sx__mul_ok(uint64_t a, uint64_t b, uint64_t *r) {
  return !__builtin_mul_overflow(a, b, r);
}

/* Milliseconds: wall clock (Unix epoch) and monotonic. */
uint64_t sx__wall_ms(void);
uint64_t sx__mono_ms(void);
uint64_t sx__mono_ns(void);

/* The environment variable name as a number lo..hi: 1 and *out; 0 when it
 * is unset or empty, or (then *bad is 1) not such a number. */
int sx__env_long(const char *name, long lo, long hi, long *out, int *bad);

/* A setting read once per process, for hot paths: *cache (static, -1
 * before the first call, so lo must be >= 0) when set, else the variable
 * as a number lo..hi, or dflt when it is unset or (said once on stderr)
 * not such a number, which it stores in *cache.  Racing first calls agree:
 * each stores the same value. */
long sx__env_once(int64_t *cache, const char *name, long lo, long hi, long dflt);

/* Whether a thread may spin-wait beside the agent's loop by default: on
 * hosts of 8 or more online CPUs (on fewer, a spinning thread takes the
 * core the loop needs). */
int sx__spin_host(void);

/* One turn of a spin-wait (the CPU's pause hint). */
static inline void sx__cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* Fill buf with random bytes from the kernel.  0 or SX_EIO. */
int sx__random(void *buf, size_t len);

/* Constant-time comparison; 0 when equal. */
int sx__ct_memcmp(const void *a, const void *b, size_t len);

/* A number at the start of s: decimal digits (no leading zero but "0"
 * itself) or 0x and hex digits, nothing before them (no blank, no sign).
 * 0 with *out and *end just past the digits; SX_EINVAL when s does not
 * start so, SX_EOVERFLOW when it does not fit 64 bits.  Callers check what
 * follows (*end). */
int sx__parse_num(const char *s, const char **end, uint64_t *out);

/* Bounded copy that always terminates; returns 0 or SX_ELIMIT if cut. */
int sx__strlcpy(char *dst, const char *src, size_t size);

/* Allocate a descriptor array (endpoints, regions, labels) of n zeroed
 * elements with the capacity the sx_desc_add_*() helpers expect. */
void *sx__desc_array(size_t n, size_t size);

/* The layout and region rules of sx_desc_validate() without the identity
 * fields (name, incarnation, token, endpoints): used for layout files. */
int sx__layout_validate(const sx_desc *d);

/* Block descriptions (blockdesc.c): their rules (called by
 * sx__layout_validate), the slots one covers, its block size (0 or
 * SX_EINVAL on an unknown dtype or overflow), and a group's, or NULL. */
int sx__blocks_validate(const sx_desc *d);
uint64_t sx__block_slots(const sx_block_desc *b);
int sx__block_bytes(const sx_block_desc *b, uint64_t *out);
const sx_block_desc *sx__block_desc(const sx_layout *l, uint32_t group);

/* Encode without validating (sx_desc_encode() validates, then calls this).
 * Tests use it to build descriptors that break one rule. */
int sx__desc_pack(const sx_desc *d, uint8_t **out, size_t *out_len);

#endif
