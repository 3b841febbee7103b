/* sx-bench read's insides: read.c (the agent side, cases, report) and
 * read_base.c (the spawned target, its control requests, the baselines). */
#ifndef SX_BENCH_READ_H
#define SX_BENCH_READ_H

#include <stdint.h>
#include <sys/types.h>

#include "segxfer/agent.h"

/* A running `sx-bench target`. */
typedef struct bx_tproc {
  pid_t pid;
  int in_fd, out_fd; /* its stdin (the lifeline) and stdout */
  uint16_t raw_port; /* its raw stream and control server */
  int ctl_fd;        /* control connection, 0 until used */
} bx_tproc;

/* What one measured case gives. */
typedef struct bx_caseres {
  double secs;       /* the window */
  uint64_t bytes, blocks, batches;
  double p50_ms, p99_ms;
  double cpu_reader, cpu_target; /* CPU seconds in the window; < 0 unknown */
} bx_caseres;

typedef struct bx_stream_req {
  uint64_t size;        /* chunk: the block size it stands for */
  uint32_t group;       /* which group's memory the target sends */
  uint32_t region;      /* its region id (for --verify) */
  uint64_t group_bytes;
  uint32_t conns;       /* connections, one thread each on both sides */
  uint64_t dst_bytes;   /* receive buffer per connection */
  double secs;
  int verify;
  uint64_t seed;
  int reverse;          /* this process sends, the target receives into its
                         * pool (the baseline of sx-bench read --op write) */
} bx_stream_req;

/* writable: the target's pool takes writes from any producer of the
 * namespace (sx-bench read --op write). */
int bx_target_spawn(bx_tproc *t, const char *url, const char *name, const uint64_t *sizes,
                    int n, uint64_t group_bytes, uint64_t seed, const char *transport,
                    int writable);
void bx_target_stop(bx_tproc *t);
/* The target's CPU seconds so far (user + system, all threads), or -1. */
double bx_target_cpu(bx_tproc *t);

int bx_raw_stream(bx_tproc *t, const bx_stream_req *q, bx_caseres *out, char *err,
                  size_t esize);
double bx_ib_read_bw(const char *dev, const char *ip, uint64_t size, uint32_t qps,
                     double secs, char *err, size_t esize);
/* The same with another perftest program (ib_write_bw). */
double bx_ib_bw(const char *prog, const char *dev, const char *ip, uint64_t size, uint32_t qps,
                double secs, char *err, size_t esize);

/* sx-bench read --op write (write.c): a write batch of n entries (local
 * blocks the sources, remote ones the destinations), submitted. */
int bx_write_batch(sx_segment *seg, const sx_block_read *ent, size_t n, sx_batch **out);

#endif
