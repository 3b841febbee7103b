/*
 * sx-rdma-test (see sx_rdma_test.c): what its parts share.  The program
 * plays the agent's part itself around sx__rdma_ops: a fake sx_tctx with
 * registered regions on the target side ("node"), ops of xfers on the
 * reader side ("opx"), one uv loop per process.
 *
 *   sx_rdma_test.c      options, main, serve and bench
 *   sx_rdma_node.c      pattern, node, opx, descriptor files
 *   sx_rdma_loopback.c  selftest: in-process tests over the loopback
 *   sx_rdma_remote.c    read and killtest: against a serve process
 *   sx_rdma_wpush.c     wselftest: push mode, consumer and producer on two loops
 *   sx_rdma_nics.c      nictest: one segment on two NICs, read and written through both
 *
 * Tests are `int test_x(void)`: 0, or -1 after printing why (FAIL, CHECK).
 */
#ifndef SX_RDMA_TEST_H
#define SX_RDMA_TEST_H

#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include "segxfer.h"
#include "transport/rdma/rdma_int.h"

/* ------------------------------------------------------------------ options */

typedef struct rdma_test_opts {
  const char *desc, *stop, *dir;
  int port;
  uint32_t regions, layers, blocks, block_bytes;
  uint32_t slice, conns;
  uint64_t seed;
  int wait_s;
  uint64_t size, total;
  uint32_t depth, batch;
  double seconds;
  int verbose;
  int expect_reissue;
} rdma_test_opts;

extern rdma_test_opts opt;
/* Tests that failed so far (a command exits non-zero if any did). */
extern int test_failures;

#define FAIL(...)                                                              \
  do {                                                                         \
    fprintf(stderr, "    %s:%d: ", __FILE__, __LINE__);                        \
    fprintf(stderr, __VA_ARGS__);                                              \
    fputc('\n', stderr);                                                       \
    return -1;                                                                 \
  } while (0)
#define CHECK(cond, ...)                                                       \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "    %s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                            \
      fputc('\n', stderr);                                                     \
      return -1;                                                               \
    }                                                                          \
  } while (0)

static inline uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static inline double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* One PASS/FAIL line; a failure counts in test_failures. */
void test_report(const char *name, int rc, double secs);
/* Whether the test of that name is to run (the command line's filters). */
int test_selected(const char *name);

#define RUN(fn, ...)                                                           \
  if (test_selected(#fn)) {                                                    \
    double t0_ = now_s();                                                      \
    int rc_ = fn(__VA_ARGS__);                                                 \
    test_report(#fn, rc_, now_s() - t0_);                                      \
  }

/* ------------------------------------------------------------------ pattern */

/* Fill len bytes of region id with the pattern for seed. */
void pattern_fill(uint8_t *p, uint64_t len, uint64_t seed, uint32_t id);
/* 0 when [off, off+len) of a copy of region id holds the pattern. */
int pattern_verify(const uint8_t *p, uint64_t off, uint64_t len, uint64_t seed, uint32_t id);

/* ------------------------------------------------------------------ a fake agent */

typedef struct node {
  uv_loop_t *loop;
  sx_agent_params params;
  sx_tctx ctx;
  uint8_t inc[SX_INCARNATION_LEN], token[SX_TOKEN_LEN];
  char name[64];
  char listen[32];
  sx_transport *t;
  sx_lregion regs[16];
  uint8_t *mem[16];
  uint32_t n_regs;
  int gpu; /* node_regions allocates CUDA device 0 memory (the stand-in) */
  /* Push mode, as a consumer (node_grant): the one producer it knows. */
  const char *grantee;
  const uint8_t *grantee_inc;
  const int *granted;
} node;

/* Open the RDMA transport as node name on loop, listening on port (0: any);
 * slice and conns: the reader's READ slice size and QPs per peer (0:
 * defaults). */
int node_open(node *n, uv_loop_t *loop, const char *name, int port, uint32_t slice,
              uint32_t conns);
/* Register count regions: id i is group i/2, slot i%2, layers x blocks of
 * block_bytes; access: SX_ACCESS_* (0: local only); filled with the pattern
 * for seed, or with fill_byte when seed is 0.  In host memory, or in
 * "cuda:0" when n->gpu is set (copied in through the memory layer). */
int node_regions(node *n, uint32_t count, uint32_t layers, uint32_t blocks,
                 uint32_t block_bytes, uint32_t access, uint64_t seed, int fill_byte);
/* Push mode: consumer c authorizes producer (its name and incarnation)
 * while *granted, answering from c's loop as the agent's store lookup does;
 * transports look again whenever *epoch moves. */
void node_grant(node *c, const node *producer, const int *granted, const uint64_t *epoch);
/* The descriptor this node would publish, through encode and decode so
 * that it passes validation exactly as a store's copy would. */
int node_desc(node *n, sx_desc *out, uint64_t seed);
void node_close(node *n);
/* The pattern seed a descriptor carries (its "pattern-seed" label). */
uint64_t desc_seed(const sx_desc *d);

/* ------------------------------------------------------------------ ops */

typedef struct opx {
  sx_op op;
  sx_xfer *x;
  size_t cap;
  int done;
  int done_calls;
  uint64_t done_ms;
} opx;

void opx_init(opx *o, size_t cap);
/* Add an xfer of len bytes from rreg at roff to local (in lreg). */
void opx_add(opx *o, uint8_t *local, const sx_lregion *lreg, const sx_region *rreg,
             uint64_t roff, uint64_t len);
/* Ready an op for (re)posting. */
void opx_arm(opx *o);
void opx_free(opx *o);

/* Run the loop until *flag or ms pass.  Returns 1 if the flag was set. */
int run_until(uv_loop_t *loop, const int *flag, uint64_t ms);
/* Post an op and wait for it; at the deadline abort it (as the agent does)
 * and wait for the abort to settle it. */
int run_op(node *r, sx_tpeer *p, opx *o, uint64_t deadline_ms);

/* ------------------------------------------------------------------ descriptor files */

/* Write d to path (atomically: a temporary file renamed). */
int write_desc(const sx_desc *d, const char *path);
/* Wait up to wait_s for path holding a descriptor whose incarnation is not
 * not_inc (NULL: any), then decode it. */
int read_desc(const char *path, int wait_s, const uint8_t *not_inc, sx_desc *out);
/* A reader node mirroring the remote regions (same lengths). */
int mirror_open(node *r, uv_loop_t *loop, const char *name, const sx_desc *d);
/* Read every region of d whole, in ranges that are not slice-aligned, and
 * check every byte. */
int read_everything(node *r, sx_tpeer *p, const sx_desc *d, uint64_t deadline_ms);

/* ------------------------------------------------------------------ commands */

int cmd_selftest(void); /* sx_rdma_loopback.c */
int cmd_wselftest(void); /* sx_rdma_wpush.c */
int cmd_nictest(int gpu); /* sx_rdma_nics.c; gpu: the target's regions in cuda:0 */
int cmd_read(void);     /* sx_rdma_remote.c */
int cmd_killtest(void); /* sx_rdma_remote.c */

#endif
