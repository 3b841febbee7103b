/*
 * The TCP reader's window at large blocks, inside one process (mem://
 * store, loopback): reads of 1 MiB ranges, several batches queued behind
 * each other, so that a connection's window (16 MiB) refills from the
 * read callback as soon as half of it is free (tcp_read.c, c_refill)
 * while the other half is still arriving.  Every byte is compared with
 * the target's memory; a batch cancelled while its requests are in flight
 * and refills go on for the others keeps its destination untouched after
 * it ended.
 *
 * That the refill keeps the pipe full (its reason) is a matter of timing
 * and is measured by sx-bench read, not here (docs/benchmarks.md).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent_fixture.h"
#include "internal.h"
#include "pattern.h"

#define MIB (1u << 20)
#define POOL_BLOCKS 24u /* the target's pool, in 1 MiB blocks */
#define BATCH 20u       /* ranges per batch */
#define DEPTH 3u        /* batches queued at once */

typedef struct pair {
  sx_agent *t, *r;
  uint8_t *pool, *dst;
  uint32_t region;
  sx_segment *seg;
} pair;

static void pair_start(pair *x, uint32_t conns) {
  char url[64];
  sxt_mem_url(url, sizeof(url), "tcpwin");
  memset(x, 0, sizeof(*x));
  sx_agent_params p;
  sxt_params(&p, url, "prefill-w");
  p.listen = "127.0.0.1:0";
  sxt_ok(sx_agent_create(&p, &x->t));
  x->pool = malloc((size_t)POOL_BLOCKS * MIB);
  assert_non_null(x->pool);
  sx_region_params rp = {.addr = x->pool, .length = (uint64_t)POOL_BLOCKS * MIB,
                         .layer_count = 1, .slot = SX_SLOT_K, .block_bytes = MIB,
                         .num_blocks = POOL_BLOCKS, .access = SX_ACCESS_REMOTE_READ};
  sxt_ok(sx_agent_register(x->t, &rp, &x->region));
  sx__pattern_fill(x->pool, (uint64_t)POOL_BLOCKS * MIB, 11, x->region, 0);
  sxt_ok(sx_agent_publish(x->t, 0));

  sxt_params(&p, url, "decode-w");
  p.conns_per_peer = conns;
  sxt_ok(sx_agent_create(&p, &x->r));
  x->dst = calloc((size_t)DEPTH * BATCH, MIB);
  assert_non_null(x->dst);
  sx_region_params lp = {.addr = x->dst, .length = (uint64_t)DEPTH * BATCH * MIB,
                         .layer_count = 1, .slot = SX_SLOT_K, .block_bytes = MIB,
                         .num_blocks = DEPTH * BATCH};
  uint32_t id;
  sxt_ok(sx_agent_register(x->r, &lp, &id));
  sxt_ok(sx_segment_open(x->r, "prefill-w", 5000, &x->seg));
  assert_int_equal(sx_segment_transport(x->seg), SX_TRANSPORT_TCP);
}

static void pair_stop(pair *x) {
  sx_segment_close(x->seg);
  sx_agent_destroy(x->r);
  sx_agent_destroy(x->t);
  free(x->pool);
  free(x->dst);
}

/* Batch k of round: BATCH ranges of 1 MiB from scattered pool blocks
 * into destination slot k, submitted. */
static sx_batch *submit(pair *x, uint32_t k, uint32_t round, sx_range_read *e) {
  for (uint32_t i = 0; i < BATCH; i++) {
    uint32_t b = (i * 7 + k * 5 + round * 3) % POOL_BLOCKS;
    e[i] = (sx_range_read){.local = x->dst + ((uint64_t)k * BATCH + i) * MIB,
                           .remote_region = x->region, .offset = (uint64_t)b * MIB,
                           .length = MIB};
  }
  sx_batch *b;
  sxt_ok(sx_batch_create(x->seg, NULL, &b));
  sxt_ok(sx_batch_add_ranges(b, e, BATCH));
  sxt_ok(sx_batch_submit(b));
  return b;
}

static void check_landed(const pair *x, const sx_range_read *e) {
  for (uint32_t i = 0; i < BATCH; i++)
    if (memcmp(e[i].local, x->pool + e[i].offset, MIB) != 0)
      fail_msg("range %u (pool offset %lu) differs", i, (unsigned long)e[i].offset);
}

static void run_rounds(uint32_t conns) {
  pair x;
  pair_start(&x, conns);
  sx_range_read e[DEPTH][BATCH];
  for (uint32_t round = 0; round < 2; round++) {
    memset(x.dst, 0, (size_t)DEPTH * BATCH * MIB);
    sx_batch *b[DEPTH];
    for (uint32_t k = 0; k < DEPTH; k++)
      b[k] = submit(&x, k, round, e[k]);
    for (uint32_t k = 0; k < DEPTH; k++) {
      sx_batch_result res = sxt_batch_finish(b[k]);
      if (res.state != SX_BATCH_COMPLETED)
        fail_msg("batch %u: %s: %s", k, sx_batch_state_name(res.state), res.message);
      assert_int_equal(res.bytes, (uint64_t)BATCH * MIB);
      check_landed(&x, e[k]);
    }
  }
  pair_stop(&x);
}

/* 60 MiB queued per round on one connection: the window refills in the
 * read callback many times, across batch boundaries. */
static void test_tcp_window_refills_one_connection(void **state) {
  (void)state;
  run_rounds(1);
}

/* The same spread over three connections, each refilling on its own. */
static void test_tcp_window_refills_three_connections(void **state) {
  (void)state;
  run_rounds(3);
}

/* The middle batch is cancelled while replies stream and refills carry
 * the last one: the others land whole, and the cancelled batch's
 * destination does not change after it ended (its payload in flight is
 * drained, its queued ranges are never requested). */
static void test_tcp_window_cancel_while_refilling(void **state) {
  (void)state;
  pair x;
  pair_start(&x, 1);
  sx_range_read e[DEPTH][BATCH];
  sx_batch *b[DEPTH];
  for (uint32_t k = 0; k < DEPTH; k++)
    b[k] = submit(&x, k, 0, e[k]);
  sxt_ok(sx_batch_cancel(b[1]));
  sx_batch_result res = sxt_batch_finish(b[1]);
  /* It may have landed whole before the cancel reached the loop. */
  assert_true(res.state == SX_BATCH_CANCELLED || res.state == SX_BATCH_COMPLETED);
  uint8_t *snap = malloc((size_t)BATCH * MIB);
  assert_non_null(snap);
  memcpy(snap, x.dst + (uint64_t)BATCH * MIB, (size_t)BATCH * MIB);
  for (uint32_t k = 0; k < DEPTH; k += 2) {
    sx_batch_result r = sxt_batch_finish(b[k]);
    if (r.state != SX_BATCH_COMPLETED)
      fail_msg("batch %u: %s: %s", k, sx_batch_state_name(r.state), r.message);
    check_landed(&x, e[k]);
  }
  assert_memory_equal(snap, x.dst + (uint64_t)BATCH * MIB, (size_t)BATCH * MIB);
  /* The connection is still good for more. */
  sx_batch *again = submit(&x, 1, 1, e[1]);
  res = sxt_batch_finish(again);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  check_landed(&x, e[1]);
  free(snap);
  pair_stop(&x);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_tcp_window_refills_one_connection),
      cmocka_unit_test(test_tcp_window_refills_three_connections),
      cmocka_unit_test(test_tcp_window_cancel_while_refilling),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
