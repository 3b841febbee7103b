/* sx-bench read's insides: read.c (the agent side, the cases), read_opts.c
 * (its command line), read_base.c (the spawned target, its control
 * requests, the baselines), read_report.c (rows and targets) and write.c
 * (--op write). */
#ifndef SX_BENCH_READ_H
#define SX_BENCH_READ_H

#include <stdint.h>
#include <sys/types.h>

#include "bench.h"
#include "rawproto.h"
#include "segxfer/agent.h"

/* A running `sx-bench target`. */
typedef struct bx_tproc {
  pid_t pid;
  int in_fd, out_fd; /* its stdin (the lifeline) and stdout */
  struct bx_errfwd *err; /* its stderr: held until it started, then passed on */
  uint16_t raw_port; /* its raw stream and control server */
  int ctl_fd;        /* control connection, 0 until used */
} bx_tproc;

/* What one measured case gives. */
typedef struct bx_caseres {
  double secs;       /* the window */
  uint64_t bytes, blocks, batches;
  double p50_ms, p99_ms;
  double cpu_reader, cpu_target; /* CPU seconds in the window; < 0 unknown */
  double runq;       /* seconds both processes' threads waited for a CPU; < 0 unknown */
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
/* 1 when the target has ended (reaped; why says how), else 0. */
int bx_target_exited(bx_tproc *t, char *why, size_t size);
/* The target's CPU seconds so far (user + system, all threads), or -1. */
double bx_target_cpu(bx_tproc *t);

int bx_raw_stream(bx_tproc *t, const bx_stream_req *q, bx_caseres *out, char *err,
                  size_t esize);
/* prog: "ib_read_bw" or "ib_write_bw"; the client counts as the reader,
 * the server as the target.  0, or -1 with err filled. */
int bx_ib_bw(const char *prog, const char *dev, const char *ip, uint64_t size, uint32_t qps,
             double secs, bx_caseres *out, char *err, size_t esize);

/* sx-bench read --op write (write.c): a write batch of n entries (local
 * blocks the sources, remote ones the destinations), submitted. */
int bx_write_batch(sx_segment *seg, const sx_block_read *ent, size_t n, sx_batch **out);

/* read_opts.c: the options of sx-bench read. */
enum { BASE_STREAM, BASE_IB, BASE_NONE };

typedef struct ropts {
  const char *url;
  int rdma;
  uint64_t sizes[BX_MAX_SIZES];
  int n_sizes;
  uint64_t batches[16];
  int n_batches;
  int contig, scattered;
  uint64_t conns[8];
  int n_conns;
  uint32_t depth;
  uint64_t group_bytes, max_batch_bytes, target_batch, rounds;
  uint64_t stream_bytes; /* --stream-bytes: raw stream buffer per connection (0: sized) */
  int verify, baseline;
  const char *rdma_dev, *rdma_ip;
  int write; /* --op write (write.c) */
} ropts;

/* Parse argv into o (its defaults already set): 0 or BX_USAGE (said on
 * stderr). */
int bx_read_parse(ropts *o, int argc, char **argv);

/* read_report.c: a case's totals, the table's rows, the targets. */
typedef struct bx_judged {
  double ratio[2], cpu[2]; /* [64K, 1M]: GB/s and CPU-per-GB ratios; < 0 not run */
  double tail;             /* worst p99/p50 of batches of 16-128 blocks of 64K-1M */
  char tail_case[64];      /* which case that was */
} bx_judged;

/* Add one window's figures to a running total (CPU unknown stays unknown). */
void bx_accumulate(bx_caseres *acc, const bx_caseres *r);
double bx_gbps(const bx_caseres *r);
/* CPU seconds per GB of both processes, or -1 when unknown. */
double bx_cpu_gb(const bx_caseres *r);
extern const bx_col bx_read_cols[];
extern const int bx_read_ncols;
/* A row of the table, with its GB/s ratio to base and its CPU-per-GB ratio
 * to base_cpu (NULL: none).  GB/s is judged against the windows next to the
 * case's own (drift); CPU per GB against all the baseline's windows of the
 * size: one window's CPU per GB is noisy where the baseline moves few bytes
 * (perftest busy-polls, so its CPU per GB follows its rate). */
bx_row *bx_read_row(bx_table *t, const char *tr, uint64_t size, uint64_t batch,
                    const char *ids, uint32_t conns, const bx_caseres *r,
                    const bx_caseres *base, const bx_caseres *base_cpu);
bx_row *bx_read_base_row(bx_table *t, const char *name, uint64_t size, uint32_t conns,
                         const bx_caseres *r);
/* The targets, from one bx_judged per --conns value. */
void bx_read_targets(bx_report *rep, const bx_judged *j, const uint64_t *conns, int n,
                     int rdma, int write, uint64_t target_batch, int scattered,
                     int no_baseline);

#endif
