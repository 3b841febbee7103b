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
#include <stdlib.h>
#include <string.h>

#include "agent_fixture.h"
#include "tcp_pair.h"

#define BATCH 20u /* ranges per batch */

static void pair_start(sxt_tcp_pair *x, uint32_t conns) {
  /* On the loop threads: the data-mover threads' own test is
   * test_tcp_threads. */
  sxt_tcp_pair_opts o = {.conns = conns, .batch = BATCH, .threads = 0, .stall = -1, .cut = -1};
  sxt_tcp_pair_start(x, &o);
}

static void run_rounds(uint32_t conns) {
  sxt_tcp_pair x;
  pair_start(&x, conns);
  sxt_tcp_pair_rounds(&x, 2);
  sxt_tcp_pair_stop(&x);
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
  sxt_tcp_pair x;
  pair_start(&x, 1);
  sx_range_read e[SXT_TCP_PAIR_DEPTH][BATCH];
  sx_batch *b[SXT_TCP_PAIR_DEPTH];
  for (uint32_t k = 0; k < SXT_TCP_PAIR_DEPTH; k++)
    b[k] = sxt_tcp_pair_submit(&x, k, 0, e[k], 10000, NULL, NULL);
  sxt_ok(sx_batch_cancel(b[1]));
  sx_batch_result res = sxt_batch_finish(b[1]);
  /* It may have landed whole before the cancel reached the loop. */
  assert_true(res.state == SX_BATCH_CANCELLED || res.state == SX_BATCH_COMPLETED);
  uint8_t *snap = malloc((size_t)BATCH * SXT_MIB);
  assert_non_null(snap);
  memcpy(snap, x.dst + (uint64_t)BATCH * SXT_MIB, (size_t)BATCH * SXT_MIB);
  for (uint32_t k = 0; k < SXT_TCP_PAIR_DEPTH; k += 2) {
    sx_batch_result r = sxt_batch_finish(b[k]);
    if (r.state != SX_BATCH_COMPLETED)
      fail_msg("batch %u: %s: %s", k, sx_batch_state_name(r.state), r.message);
    sxt_tcp_pair_check(&x, e[k]);
  }
  assert_memory_equal(snap, x.dst + (uint64_t)BATCH * SXT_MIB, (size_t)BATCH * SXT_MIB);
  /* The connection is still good for more. */
  sx_batch *again = sxt_tcp_pair_submit(&x, 1, 1, e[1], 10000, NULL, NULL);
  res = sxt_batch_finish(again);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  sxt_tcp_pair_check(&x, e[1]);
  free(snap);
  sxt_tcp_pair_stop(&x);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_tcp_window_refills_one_connection),
      cmocka_unit_test(test_tcp_window_refills_three_connections),
      cmocka_unit_test(test_tcp_window_cancel_while_refilling),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
