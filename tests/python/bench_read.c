/*
 * The C side of the Python binding benchmark (tests/python/bench.py): the
 * same batches of scattered block reads the Python side runs, through the C
 * API, so the two can be compared in one run.
 *
 * Usage: bench_read URL SEGMENT IDS_FILE
 * IDS_FILE holds uint64 values: n, batches, block_bytes, then per batch n
 * remote ids and n local ids.  The reader registers n local blocks (one
 * layer, slot K), opens SEGMENT, runs one batch to connect, then times the
 * batches one after another (create, add, submit, wait, destroy) and prints
 * "seconds bytes call_seconds", the last being the time spent outside the
 * wait (building, submitting, reading the result, destroying).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "segxfer.h"

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int fail(const char *what, int rc) {
  fprintf(stderr, "bench_read: %s: %s (%s)\n", what, sx_err_name(rc), sx_errmsg());
  return 1;
}

/* One batch of n blocks: 0 when it completed, and its bytes. */
static int run_batch(sx_segment *seg, const uint64_t *remote, const uint64_t *local,
                     uint64_t n, sx_block_read *e, uint64_t *bytes, double *calls) {
  double t0 = now();
  for (uint64_t i = 0; i < n; i++)
    e[i] = (sx_block_read){.layer_count = 1, .slots = 1u << SX_SLOT_K,
                           .remote_block = remote[i], .local_block = local[i], .count = 1};
  sx_batch *b;
  int rc = sx_batch_create(seg, NULL, &b);
  if (rc)
    return fail("batch", rc);
  if ((rc = sx_batch_add_blocks(b, e, n)) || (rc = sx_batch_submit(b))) {
    sx_batch_destroy(b);
    return fail("batch", rc);
  }
  double t1 = now();
  if ((rc = sx_batch_wait(b, -1))) {
    sx_batch_destroy(b);
    return fail("batch", rc);
  }
  double t2 = now();
  sx_batch_result res;
  sx_batch_result_get(b, &res);
  sx_batch_destroy(b);
  *calls += (t1 - t0) + (now() - t2);
  if (res.state != SX_BATCH_COMPLETED) {
    fprintf(stderr, "bench_read: batch %s: %s\n", sx_batch_state_name(res.state),
            res.message);
    return 1;
  }
  *bytes += res.bytes;
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: bench_read URL SEGMENT IDS_FILE\n");
    return 2;
  }
  FILE *f = fopen(argv[3], "rb");
  uint64_t head[3];
  if (f == NULL || fread(head, sizeof(head), 1, f) != 1) {
    fprintf(stderr, "bench_read: cannot read %s\n", argv[3]);
    return 2;
  }
  uint64_t n = head[0], batches = head[1], block = head[2];
  uint64_t *ids = malloc(batches * 2 * n * sizeof(*ids));
  sx_block_read *e = malloc(n * sizeof(*e));
  uint8_t *mem = aligned_alloc(4096, n * block);
  if (ids == NULL || e == NULL || mem == NULL ||
      fread(ids, sizeof(*ids), batches * 2 * n, f) != batches * 2 * n) {
    fprintf(stderr, "bench_read: %s is short\n", argv[3]);
    return 2;
  }
  fclose(f);
  memset(mem, 0, n * block);

  sx_agent_params p;
  sx_agent_params_init(&p);
  p.metadata_url = argv[1];
  p.log_level = SX_LOG_WARN;
  sx_agent *a;
  int rc = sx_agent_create(&p, &a);
  if (rc)
    return fail("agent", rc);
  sx_region_params rp = {.addr = mem, .length = n * block, .layer_count = 1,
                         .slot = SX_SLOT_K, .block_bytes = block, .num_blocks = n};
  uint32_t id;
  sx_segment *seg = NULL;
  if ((rc = sx_agent_register(a, &rp, &id)) || (rc = sx_segment_open(a, argv[2], 5000, &seg)))
    return fail("setup", rc);
  uint64_t bytes = 0;
  double calls = 0;
  if (run_batch(seg, ids, ids + n, n, e, &bytes, &calls))   /* connect */
    return 1;
  bytes = 0;
  calls = 0;
  double t0 = now();
  for (uint64_t i = 0; i < batches; i++)
    if (run_batch(seg, ids + 2 * n * i, ids + 2 * n * i + n, n, e, &bytes, &calls))
      return 1;
  double secs = now() - t0;
  printf("%.6f %llu %.6f\n", secs, (unsigned long long)bytes, calls);
  sx_segment_close(seg);
  sx_agent_destroy(a);
  free(mem);
  free(e);
  free(ids);
  return 0;
}
