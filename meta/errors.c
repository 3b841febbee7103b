/* The error table, and the per-thread message behind sx_errmsg(). */
#include <stdio.h>
#include <string.h>

#include "internal.h"

static _Thread_local char sx__msg[1024];

const char *sx_err_name(int err) {
  switch (err) {
  case SX_OK:
    return "SX_OK";
#define SX__ERR_NAME(name, val, msg)                                           \
  case SX_E##name:                                                             \
    return "SX_E" #name;
    SX_ERRNO_MAP(SX__ERR_NAME)
#undef SX__ERR_NAME
  }
  return "SX_UNKNOWN";
}

const char *sx_strerror(int err) {
  switch (err) {
  case SX_OK:
    return "success";
#define SX__ERR_STR(name, val, msg)                                            \
  case SX_E##name:                                                             \
    return msg;
    SX_ERRNO_MAP(SX__ERR_STR)
#undef SX__ERR_STR
  }
  return "unknown error";
}

const char *sx_errmsg(void) { return sx__msg; }

int sx__verr(int code, const char *fmt, va_list ap) {
  /* Format aside, then copy: callers add context to a failure from below
   * by passing sx_errmsg() itself, which must not be written while read. */
  char buf[sizeof(sx__msg)];
  vsnprintf(buf, sizeof(buf), fmt, ap);
  memcpy(sx__msg, buf, sizeof(buf));
  return code;
}

int sx__err(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  sx__verr(code, fmt, ap);
  va_end(ap);
  return code;
}

int sx__errwrap(int code, const char *fmt, ...) {
  char prev[sizeof(sx__msg)], prefix[256];
  va_list ap;
  memcpy(prev, sx__msg, sizeof(prev));
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof(prefix), fmt, ap);
  va_end(ap);
  snprintf(sx__msg, sizeof(sx__msg), "%s: %s", prefix, prev);
  return code;
}

#include "segxfer.h"

#define SX__STR2(x) #x
#define SX__STR(x) SX__STR2(x)

const char *sx_version(void) {
  return SX__STR(SX_VERSION_MAJOR) "." SX__STR(SX_VERSION_MINOR) "." SX__STR(
      SX_VERSION_PATCH);
}
