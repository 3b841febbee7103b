/* Clocks, randomness and small string helpers used across the library. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

uint64_t sx__wall_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

uint64_t sx__mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t sx__mono_ms(void) { return sx__mono_ns() / 1000000u; }

int sx__env_long(const char *name, long lo, long hi, long *out, int *bad) {
  const char *env = getenv(name);
  *bad = 0;
  if (env == NULL || *env == '\0')
    return 0;
  char *end;
  long v = strtol(env, &end, 10);
  if (*end != '\0' || v < lo || v > hi) {
    *bad = 1;
    return 0;
  }
  *out = v;
  return 1;
}

long sx__env_once(int64_t *cache, const char *name, long lo, long hi, long dflt) {
  int64_t v = __atomic_load_n(cache, __ATOMIC_RELAXED);
  if (v >= 0)
    return (long)v;
  long n;
  int bad;
  if (!sx__env_long(name, lo, hi, &n, &bad))
    n = dflt;
  if (bad)
    fprintf(stderr, "segxfer: %s=%s is not a whole number of %ld..%ld: %ld\n", name,
            getenv(name), lo, hi, dflt);
  __atomic_store_n(cache, (int64_t)n, __ATOMIC_RELAXED);
  return n;
}

int sx__spin_host(void) { return sysconf(_SC_NPROCESSORS_ONLN) >= 8; }

int sx__random(void *buf, size_t len) {
  uint8_t *p = buf;
  while (len > 0) {
    ssize_t n = getrandom(p, len, 0);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      return sx__err(SX_EIO, "getrandom: %s", strerror(errno));
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

int sx__ct_memcmp(const void *a, const void *b, size_t len) {
  const volatile uint8_t *x = a, *y = b;
  uint8_t acc = 0;
  for (size_t i = 0; i < len; i++)
    acc |= (uint8_t)(x[i] ^ y[i]);
  return acc;
}

int sx__strlcpy(char *dst, const char *src, size_t size) {
  size_t n = strnlen(src, size);
  if (n == size) {
    memcpy(dst, src, size - 1);
    dst[size - 1] = '\0';
    return SX_ELIMIT;
  }
  memcpy(dst, src, n + 1);
  return 0;
}

int sx__parse_num(const char *s, const char **end, uint64_t *out) {
  int hex = s[0] == '0' && (s[1] == 'x' || s[1] == 'X');
  const char *p = hex ? s + 2 : s;
  unsigned base = hex ? 16 : 10;
  uint64_t v = 0;
  int big = 0;
  if (!hex && s[0] == '0' && s[1] >= '0' && s[1] <= '9')
    return SX_EINVAL; /* 010: octal to strtoull, 10 to a reader; neither guessed */
  const char *q = p;
  for (;; q++) {
    unsigned d;
    if (*q >= '0' && *q <= '9')
      d = (unsigned)(*q - '0');
    else if (hex && *q >= 'a' && *q <= 'f')
      d = (unsigned)(*q - 'a' + 10);
    else if (hex && *q >= 'A' && *q <= 'F')
      d = (unsigned)(*q - 'A' + 10);
    else
      break;
    if (v > (UINT64_MAX - d) / base)
      big = 1;
    v = v * base + d;
  }
  if (q == p)
    return SX_EINVAL;
  if (big)
    return SX_EOVERFLOW;
  *end = q;
  *out = v;
  return 0;
}
