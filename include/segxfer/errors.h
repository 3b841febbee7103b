/*
 * segxfer error codes.
 *
 * Every segxfer call returns 0 on success or one of the negative SX_E* codes
 * below.  The table is the single source of the enum, sx_err_name() and
 * sx_strerror(); add a code by adding one line to SX_ERRNO_MAP.
 *
 * Where a failure has context (which field of a descriptor was wrong, which
 * holder owns a name, what the store answered), the failing call also leaves
 * a one-line message for the calling thread, read with sx_errmsg().
 */
#ifndef SEGXFER_ERRORS_H
#define SEGXFER_ERRORS_H

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define SX_EXTERN __attribute__((visibility("default")))
#else
#define SX_EXTERN
#endif

/* XX(name, value, message) */
#define SX_ERRNO_MAP(XX)                                                       \
  XX(INVAL, -1, "invalid argument")                                            \
  XX(NOMEM, -2, "out of memory")                                               \
  XX(NOTSUP, -3, "operation not supported")                                    \
  XX(NOENT, -4, "segment not found")                                           \
  XX(HELD, -5, "name is held by another live incarnation")                     \
  XX(FENCED, -6, "fenced: another incarnation took over this segment")         \
  XX(STALE, -7, "stale: the segment's owner restarted or republished")         \
  XX(INCOMPAT, -8, "layouts are incompatible")                                 \
  XX(DISCONN, -9, "peer disconnected")                                         \
  XX(TIMEDOUT, -10, "timed out")                                               \
  XX(CANCELED, -11, "canceled")                                                \
  XX(ACCESS, -12, "access denied: bad or missing access token")                \
  XX(PROTO, -13, "protocol error")                                             \
  XX(VERSION, -14, "unknown schema or protocol version")                       \
  XX(NAME, -15, "invalid name")                                                \
  XX(LIMIT, -16, "documented limit exceeded")                                  \
  XX(STRIDE, -17, "block_stride is smaller than block_bytes")                  \
  XX(OVERFLOW, -18, "size arithmetic overflows 64 bits")                       \
  XX(BOUNDS, -19, "range lies outside its region")                             \
  XX(LAYERS, -20, "layer_count is zero")                                       \
  XX(OVERLAP, -21, "regions overlap on a (group, layer, slot) key")            \
  XX(RKEYS, -22, "rkey count differs from the RDMA devices published")         \
  XX(MISSING, -23, "required field missing")                                   \
  XX(DECODE, -24, "malformed encoding")                                        \
  XX(STORE, -25, "metadata store error")                                       \
  XX(AUTH, -26, "metadata store authentication failed")                        \
  XX(URL, -27, "malformed metadata URL")                                       \
  XX(UNREACH, -28, "unreachable")                                              \
  XX(IO, -29, "I/O error")                                                     \
  XX(RDMA, -30, "RDMA work completion error")                                  \
  XX(NODEV, -31, "no usable RDMA device")                                      \
  XX(BUSY, -32, "resource busy")                                               \
  XX(GENERATION, -33, "generation must grow")                                  \
  XX(DENIED, -34, "region does not allow this remote access (read or write)") \
  XX(SHUTDOWN, -35, "agent is shutting down")                                  \
  XX(NOREGION, -36, "no such region")                                          \
  XX(GONE, -37, "lease lost: the segment expired or was removed")              \
  XX(DUPLICATE, -38, "duplicate id")

typedef enum sx_errno {
  SX_OK = 0,
#define SX__ERR_ENUM(name, val, msg) SX_E##name = (val),
  SX_ERRNO_MAP(SX__ERR_ENUM)
#undef SX__ERR_ENUM
  SX_ERRNO_MIN = -38
} sx_errno_t;

/* "SX_EINVAL" for SX_EINVAL; "SX_UNKNOWN" for a value not in the table. */
SX_EXTERN const char *sx_err_name(int err);

/* The fixed human text of a code ("invalid argument"); never NULL. */
SX_EXTERN const char *sx_strerror(int err);

/*
 * The message the last failing segxfer call left on the calling thread, or
 * the empty string.  The pointer stays valid until the next segxfer call on
 * this thread.  Successful calls do not clear it.  Messages never contain
 * passwords or access tokens.
 */
SX_EXTERN const char *sx_errmsg(void);

#ifdef __cplusplus
}
#endif
#endif /* SEGXFER_ERRORS_H */
