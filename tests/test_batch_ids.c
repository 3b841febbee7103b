/*
 * sx_batch_add_block_ids (include/segxfer/push.h) on read batches: block
 * reads given as arrays of ids, the way engines (and the Python package)
 * hand them over, between two agents on the mem:// store over loopback TCP.
 * Scattered ids land in the right local blocks, runs consecutive on both
 * sides become one entry, out-of-range ids are refused with nothing added,
 * and bad arguments fail cleanly.
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "agent_fixture.h"

static int url_seq;

typedef struct pair {
  char url[64];
  sxt_agent t, r;
  sx_segment *seg;
} pair;

static void pair_start(pair *p, uint64_t seed) {
  snprintf(p->url, sizeof(p->url), "mem://batch-ids-%d-%d", (int)getpid(), url_seq++);
  sxt_target_start(&p->t, p->url, "prefill-ids", NULL, seed);
  sxt_reader_start(&p->r, p->url, "decode-ids");
  sxt_ok(sx_segment_open(p->r.a, "prefill-ids", 1000, &p->seg));
}

static void pair_stop(pair *p) {
  sx_segment_close(p->seg);
  sxt_agent_stop(&p->r);
  sxt_agent_stop(&p->t);
}

/* The call as engines make it: one group, a layer range, a slot mask. */
static int add_ids(sx_batch *b, uint32_t layer_first, uint32_t layer_count, uint64_t slots,
                   const uint64_t *remote, const uint64_t *local, size_t n) {
  sx_block_ids ids = {.group = 0, .layer_first = layer_first, .layer_count = layer_count,
                      .slots = slots, .local = local, .n_local = n, .remote = remote,
                      .n_remote = n};
  return sx_batch_add_block_ids(b, &ids);
}

static void clear_reader(pair *p) {
  for (int s = 0; s < 2; s++)
    memset(p->r.mem[s], 0, SXT_LAYERS * SXT_READER_BLOCKS * SXT_BLOCK);
}

/* Add, submit, wait; the result (failed list cleared: it dies with the batch). */
static sx_batch_result run_ids(pair *p, uint32_t layer_first, uint32_t layer_count,
                               uint64_t slots, const uint64_t *remote, const uint64_t *local,
                               size_t n) {
  sx_batch *b;
  sxt_ok(sx_batch_create(p->seg, NULL, &b));
  sxt_ok(add_ids(b, layer_first, layer_count, slots, remote, local, n));
  sxt_ok(sx_batch_submit(b));
  sxt_ok(sx_batch_wait(b, -1));
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  res.failed = NULL;
  sx_batch_destroy(b);
  return res;
}

/* Each id pair, checked as a one-block entry against the target's pattern. */
static void verify_ids(pair *p, uint32_t layer_first, uint32_t layer_count, uint64_t slots,
                       const uint64_t *remote, const uint64_t *local, size_t n) {
  for (size_t i = 0; i < n; i++) {
    sx_block_read e = {.layer_first = layer_first, .layer_count = layer_count,
                       .slots = slots, .remote_block = remote[i], .local_block = local[i],
                       .count = 1};
    assert_int_equal(sxt_verify_blocks(&p->r, p->seg, p->t.seed, &e), 0);
  }
}

static void test_batch_ids_scattered_blocks_land_in_their_local_ids(void **state) {
  (void)state;
  pair p;
  pair_start(&p, 31);
  clear_reader(&p);
  const uint64_t remote[] = {5, 17, 3, 60, 41, 0};
  const uint64_t local[] = {0, 9, 31, 4, 12, 30};
  sx_batch_result res = run_ids(&p, 0, SXT_LAYERS, SXT_KV, remote, local, 6);
  if (res.state != SX_BATCH_COMPLETED)
    fail_msg("batch %s: %s", sx_batch_state_name(res.state), res.message);
  assert_int_equal(res.n_entries, 6);
  assert_int_equal(res.bytes, 6ull * SXT_LAYERS * 2 * SXT_BLOCK);
  verify_ids(&p, 0, SXT_LAYERS, SXT_KV, remote, local, 6);
  /* A block no id named stays as it was. */
  static const uint8_t zero[SXT_BLOCK];
  assert_memory_equal(p.r.mem[0] + 1 * SXT_BLOCK, zero, SXT_BLOCK);
  pair_stop(&p);
}

static void test_batch_ids_runs_become_one_entry_each(void **state) {
  (void)state;
  pair p;
  pair_start(&p, 32);
  clear_reader(&p);
  /* 10..13 -> 2..5 is one run; 40,41 -> 20,21 another; 50 -> 23 breaks the
   * local run; 51 -> 25 is consecutive remotely only. */
  const uint64_t remote[] = {10, 11, 12, 13, 40, 41, 50, 51};
  const uint64_t local[] = {2, 3, 4, 5, 20, 21, 23, 25};
  sx_batch_result res = run_ids(&p, 0, SXT_LAYERS, SXT_KV, remote, local, 8);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(res.n_entries, 4);
  verify_ids(&p, 0, SXT_LAYERS, SXT_KV, remote, local, 8);
  /* One region per slot spanning the layers: every (slot, layer) of a run
   * is one contiguous range, the four-block run included. */
  assert_int_equal(res.n_ranges, 4 * 2 * SXT_LAYERS);
  pair_stop(&p);
}

static void test_batch_ids_layer_and_slot_subset(void **state) {
  (void)state;
  pair p;
  pair_start(&p, 33);
  clear_reader(&p);
  const uint64_t remote[] = {7, 8};
  const uint64_t local[] = {1, 2};
  sx_batch_result res = run_ids(&p, 1, 2, 1ull << SX_SLOT_V, remote, local, 2);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(res.bytes, 2ull * 2 * SXT_BLOCK);
  verify_ids(&p, 1, 2, 1ull << SX_SLOT_V, remote, local, 2);
  static const uint8_t zero[SXT_BLOCK];
  /* K was not asked for; nor was layer 0 of V. */
  for (uint32_t l = 0; l < SXT_LAYERS; l++)
    assert_memory_equal(p.r.mem[SX_SLOT_K] + (l * SXT_READER_BLOCKS + 1) * SXT_BLOCK, zero,
                        SXT_BLOCK);
  assert_memory_equal(p.r.mem[SX_SLOT_V] + 1 * SXT_BLOCK, zero, SXT_BLOCK);
  pair_stop(&p);
}

static void test_batch_ids_out_of_range_ids_add_nothing(void **state) {
  (void)state;
  pair p;
  pair_start(&p, 34);
  sx_batch *b;
  sxt_ok(sx_batch_create(p.seg, NULL, &b));
  /* The last id lies past the target's pool: the whole call is refused. */
  const uint64_t remote[] = {1, 2, SXT_TARGET_BLOCKS};
  const uint64_t local[] = {1, 5, 6};
  sxt_rc(add_ids(b, 0, SXT_LAYERS, SXT_KV, remote, local, 3), SX_EBOUNDS);
  assert_non_null(strstr(sx_errmsg(), "outside region"));
  /* Past the reader's smaller pool. */
  const uint64_t local_bad[] = {1, SXT_READER_BLOCKS, 2};
  sxt_rc(add_ids(b, 0, SXT_LAYERS, SXT_KV, local, local_bad, 3),
         SX_EBOUNDS);
  /* UINT64_MAX then 0: refused, whether or not it is taken for a run. */
  const uint64_t wrap_r[] = {UINT64_MAX, 0};
  const uint64_t wrap_l[] = {UINT64_MAX, 0};
  sxt_rc(add_ids(b, 0, SXT_LAYERS, SXT_KV, wrap_r, wrap_l, 2),
         SX_EBOUNDS);
  /* A missing key. */
  const uint64_t one[] = {1};
  sxt_rc(add_ids(b, 0, SXT_LAYERS + 1, SXT_KV, one, one, 1),
         SX_ENOREGION);
  sxt_rc(add_ids(b, 0, 0, SXT_KV, one, one, 1), SX_EINVAL);
  sxt_rc(add_ids(b, 0, SXT_LAYERS, 0, one, one, 1), SX_EINVAL);
  /* Nothing of the refused calls is in the batch: one good id is all. */
  sxt_ok(add_ids(b, 0, SXT_LAYERS, SXT_KV, one, one, 1));
  sxt_ok(sx_batch_submit(b));
  sxt_ok(sx_batch_wait(b, -1));
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(res.n_entries, 1);
  assert_int_equal(res.bytes, (uint64_t)SXT_LAYERS * 2 * SXT_BLOCK);
  sx_batch_destroy(b);
  pair_stop(&p);
}

static void test_batch_ids_bad_arguments(void **state) {
  (void)state;
  pair p;
  pair_start(&p, 35);
  const uint64_t one[] = {1};
  sxt_rc(add_ids(NULL, 0, 1, SXT_KV, one, one, 1), SX_EINVAL);
  sx_batch *b;
  sxt_ok(sx_batch_create(p.seg, NULL, &b));
  sxt_rc(sx_batch_add_block_ids(b, NULL), SX_EINVAL);
  sxt_rc(add_ids(b, 0, 1, SXT_KV, NULL, one, 1), SX_EINVAL);
  sxt_rc(add_ids(b, 0, 1, SXT_KV, one, NULL, 1), SX_EINVAL);
  sxt_rc(add_ids(b, 0, 1, SXT_KV, one, one, 0), SX_EINVAL);   /* empty lists */
  /* Lists of different lengths: refused, never truncated. */
  const uint64_t two[] = {1, 2};
  sx_block_ids uneven = {.layer_count = 1, .slots = SXT_KV, .local = two, .n_local = 2,
                         .remote = one, .n_remote = 1};
  sxt_rc(sx_batch_add_block_ids(b, &uneven), SX_EINCOMPAT);
  sxt_ok(add_ids(b, 0, 1, SXT_KV, one, one, 1));
  sxt_ok(sx_batch_submit(b));
  /* Only before submit. */
  sxt_rc(add_ids(b, 0, 1, SXT_KV, one, one, 1), SX_EINVAL);
  sxt_ok(sx_batch_wait(b, -1));
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(res.n_entries, 1);
  sx_batch_destroy(b);
  pair_stop(&p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_batch_ids_scattered_blocks_land_in_their_local_ids),
      cmocka_unit_test(test_batch_ids_runs_become_one_entry_each),
      cmocka_unit_test(test_batch_ids_layer_and_slot_subset),
      cmocka_unit_test(test_batch_ids_out_of_range_ids_add_nothing),
      cmocka_unit_test(test_batch_ids_bad_arguments),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
