/*
 * GPU suite: set reads (segxfer/group.h) into GPU memory.  Into device
 * memory a set read feeds each member's ranges straight into its batch as
 * the plan expands (agent/group.c), which reads into host memory over TCP
 * do not do (they collect scattered ranges), so this is that path's test:
 * a TP=2 prefill in host memory (heads 0-1 and 2-3 of four, head-major
 * blocks of 8 tokens) read over TCP staging into a decode rank's cuda:0
 * pool that holds every head, in the same order and block size (one piece
 * per rank and block) or token-major blocks of 4 tokens (a piece per token
 * and rank).  Byte for byte against a reference written in the decode
 * layout; then with one rank gone, and with one rank whose regions refuse
 * remote reads, the read must name exactly the local blocks that rank fed,
 * in the order given, while the other rank's heads still arrive.  A
 * notifying read notes what it feeds: each rank gets its notice; with a
 * refusing rank it is refused before any byte moves.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_fixture.h"
#include "kv_ranks.h"
#include "segxfer/group.h"

static const uint64_t RB[] = {9, 3, 14, 0};              /* prefill blocks */
static const uint64_t LB[] = {5, 11, 2, 7, 13, 1, 8, 4}; /* decode blocks */
#define TOKENS 29

typedef struct world {
  char url[64];
  uint32_t nl; /* local blocks of the request */
  rank p[2], d;
} world;

/* Prefill ranks in host memory, `pre` order, blocks of 8 tokens; rank
 * `denied` (or none: -1) allows remote writes only.  The decode rank in
 * cuda:0 memory, `order` with `tokens`. */
static world *world_new(sx_kv_order pre, sx_kv_order order, uint32_t tokens, int denied) {
  static int seq;
  world *w = calloc(1, sizeof(*w));
  assert_non_null(w);
  snprintf(w->url, sizeof(w->url), "mem://gpu-group-%d-%d", (int)getpid(), seq++);
  for (int i = 0; i < 2; i++) {
    char name[16];
    snprintf(name, sizeof(name), "pf/tp%d", i);
    rank_start(&w->p[i], w->url, name, pre, 8, 2u * (uint32_t)i, 2, (uint32_t)i, 2,
               i == denied ? SX_ACCESS_REMOTE_WRITE : SX_ACCESS_REMOTE_READ);
    fill(&w->p[i], RB, TOKENS);
  }
  rank_start_at(&w->d, w->url, NULL, order, tokens, 0, HEADS, 0, 1, SX_ACCESS_REMOTE_READ, 0);
  w->nl = (TOKENS + tokens - 1) / tokens;
  return w;
}

static void world_free(world *w) {
  rank_stop(&w->d);
  for (int i = 0; i < 2; i++)
    if (w->p[i].a != NULL)
      rank_stop(&w->p[i]);
  free(w);
}

static sx_group *open_pf(const world *w) { return ranks_open(w->d.a, "pf", 2); }

/* Every local block of the request failed, named in the order given. */
static void expect_all_failed(const world *w, const sx_group_result *r) {
  assert_int_equal(r->state, SX_BATCH_FAILED);
  assert_int_equal(r->n_failed, w->nl);
  for (uint32_t i = 0; i < w->nl; i++)
    assert_int_equal(r->failed[i], LB[i]);
}

static void read_orders(sx_kv_order pre, sx_kv_order order, uint32_t tokens) {
  world *w = world_new(pre, order, tokens, -1);
  sx_group *g = open_pf(w);
  sx_group_result r;
  sxt_ok(sx_group_read(g, RB, 4, LB, w->nl, 5000, &r));
  if (r.state != SX_BATCH_COMPLETED)
    fail_msg("%s: %s", sx_batch_state_name(r.state), r.message);
  assert_int_equal(r.n_failed, 0);
  assert_int_equal(r.members, 2);
  assert_int_equal(r.bytes, 2ull * LAYERS * 32 * HEADS * HEAD_DIM * sizeof(float));
  expect_heads(&w->d, LB, TOKENS, 0xf);
  /* Rank 1 restarts (its listener and incarnation gone): every local
   * block had heads 2-3 from it. */
  rank_stop(&w->p[1]);
  sxt_ok(sx_group_read(g, RB, 4, LB, w->nl, 3000, &r));
  expect_all_failed(w, &r);
  assert_non_null(strstr(r.message, "pf/tp1"));
  sx_group_close(g);
  world_free(w);
}

static void test_gpu_group_hnd_into_hnd(void **state) {
  (void)state;
  read_orders(SX_KV_HND, SX_KV_HND, 8);
}

static void test_gpu_group_hnd_into_nhd(void **state) {
  (void)state;
  read_orders(SX_KV_HND, SX_KV_NHD, 4);
}

/* Token-major on both sides: each rank's piece of every token (its two
 * heads of a token row), at fixed strides, one strided range per unit. */
static void test_gpu_group_nhd_into_nhd(void **state) {
  (void)state;
  read_orders(SX_KV_NHD, SX_KV_NHD, 4);
}

/* A notifying read (what the vLLM and SGLang connectors call) notes each
 * fed range's remote bytes: each rank gets one notice with the tag, its
 * ranges summing to its bytes, all of them the read's bytes. */
static void test_gpu_group_read_notify(void **state) {
  (void)state;
  world *w = world_new(SX_KV_NHD, SX_KV_NHD, 4, -1);
  sx_group *g = open_pf(w);
  sx_group_result r;
  sxt_ok(sx_group_read_notify(g, RB, 4, LB, w->nl, 5000, 0x5e7ull, &r));
  if (r.state != SX_BATCH_COMPLETED)
    fail_msg("%s: %s", sx_batch_state_name(r.state), r.message);
  expect_heads(&w->d, LB, TOKENS, 0xf);
  uint64_t bytes = 0;
  for (int i = 0; i < 2; i++)
    bytes += take_read_notice(w->p[i].a, 0x5e7ull);
  assert_int_equal(bytes, r.bytes);
  sx_group_close(g);
  world_free(w);
}

/* Rank 1's regions refuse remote reads: its batch fails while it is
 * filled, after rank 0's was submitted.  Rank 0's heads arrive, rank 1's
 * stay zero, and every block is reported failed with rank 1's error. */
static void test_gpu_group_member_refusing_fails_its_blocks(void **state) {
  (void)state;
  world *w = world_new(SX_KV_HND, SX_KV_HND, 8, 1);
  sx_group *g = open_pf(w);
  sx_group_result r;
  sxt_ok(sx_group_read(g, RB, 4, LB, w->nl, 3000, &r));
  expect_all_failed(w, &r);
  assert_int_equal(r.error, SX_EDENIED);
  assert_non_null(strstr(r.message, "pf/tp1"));
  assert_int_equal(r.members, 1);
  assert_int_equal(r.bytes, 1ull * LAYERS * 32 * HEADS * HEAD_DIM * sizeof(float));
  expect_heads(&w->d, LB, TOKENS, 0x3);
  /* A notifying read fills every member before any starts: refused, and
   * rank 0 served nothing for it. */
  sx_agent_status before, after;
  sxt_ok(sx_agent_status_get(w->p[0].a, &before));
  sxt_rc(sx_group_read_notify(g, RB, 4, LB, w->nl, 3000, 9, &r), SX_EDENIED);
  assert_non_null(strstr(sx_errmsg(), "pf/tp1"));
  sxt_ok(sx_agent_status_get(w->p[0].a, &after));
  assert_int_equal(after.served_reads, before.served_reads);
  sx_group_close(g);
  world_free(w);
}

static int need_gpu(void **state) {
  (void)state;
  if (gpu_devices() == 0) {
    fprintf(stderr, "test_gpu_group: no CUDA device: %s\n", sx_errmsg());
    return -1;
  }
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gpu_group_hnd_into_hnd),
      cmocka_unit_test(test_gpu_group_hnd_into_nhd),
      cmocka_unit_test(test_gpu_group_nhd_into_nhd),
      cmocka_unit_test(test_gpu_group_read_notify),
      cmocka_unit_test(test_gpu_group_member_refusing_fails_its_blocks),
  };
  return cmocka_run_group_tests(tests, need_gpu, NULL);
}
