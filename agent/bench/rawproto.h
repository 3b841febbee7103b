/*
 * The control and raw-stream protocol between `sx-bench read` and
 * `sx-bench target`: not segxfer's data plane, but the baseline next to it.
 * A request is 32 bytes, integers big-endian:
 *   magic "SXBR", op, a, b, c
 *   STREAM: send group b's memory in chunks of a bytes, wrapping around,
 *           until the reader closes the connection
 *   SINK:   receive chunks of a bytes into group b's memory, wrapping
 *           around, until the writer closes the connection (the baseline
 *           of sx-bench read --op write)
 *   RUSAGE: answer 16 bytes: user and system CPU time of the target, ns
 *   QUIT:   unpublish and exit
 */
#ifndef SX_BENCH_RAWPROTO_H
#define SX_BENCH_RAWPROTO_H

#include <endian.h>
#include <stddef.h>
#include <stdint.h>

#define BX_RAW_MAGIC "SXBR"
#define BX_MAX_SIZES 16

enum { BX_RAW_STREAM = 1, BX_RAW_RUSAGE = 2, BX_RAW_QUIT = 3, BX_RAW_SINK = 4 };

typedef struct bx_rawreq {
  char magic[4];
  uint32_t op;
  uint64_t a, b, c;
} bx_rawreq;

/* Blocking socket I/O of exactly n bytes (EINTR retried): 0, or -1 when the
 * connection failed or ended first. */
int bx_send_all(int fd, const void *p, size_t n);
int bx_recv_all(int fd, void *p, size_t n);

#endif
