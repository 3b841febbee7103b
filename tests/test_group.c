/*
 * Segment sets (agent/group.c): real agents in this process, a mem://
 * store, TCP on loopback.  Two prefill ranks (HND, blocks of 8 tokens, two
 * KV heads each of four) and one decode reader (NHD, blocks of 4 tokens,
 * all four heads): the set is opened by engine name and tp size, one read
 * fills the reader's blocks, and they must equal byte for byte a reference
 * written directly in the reader's layout.  Refusals before any byte moves
 * (a rank missing, heads missing, a block outside a region), and a member
 * gone since the open failing exactly the blocks it was filling.  With
 * read notices, each member gets its own.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_ranks.h"
#include "procs.h"
#include "segxfer/group.h"

static const uint64_t RB[] = {9, 3, 14, 0};       /* the request on the prefill ranks */
static const uint64_t LB[] = {5, 11, 2, 7, 13, 1, 8, 4}; /* and here */
#define TOKENS 29

typedef struct world {
  int scattered;
  int denied; /* the prefill rank whose regions allow no remote reads, or -1 */
  char url[128];
  rank p[2], d;
} world;

static int setup_world(void **state, sx_kv_order pre, uint32_t pre_tokens, int denied) {
  world *w = calloc(1, sizeof(*w));
  sxt_mem_url(w->url, sizeof(w->url), "group");
  w->scattered = pre == SX_KV_NHD;
  w->denied = denied;
  for (int i = 0; i < 2; i++) {
    char name[16];
    snprintf(name, sizeof(name), "pf/tp%d", i);
    rank_start(&w->p[i], w->url, name, pre, pre_tokens, 2u * (uint32_t)i, 2, (uint32_t)i, 2,
               i == denied ? SX_ACCESS_REMOTE_WRITE : SX_ACCESS_REMOTE_READ);
    fill(&w->p[i], RB, TOKENS);
  }
  rank_start(&w->d, w->url, NULL, SX_KV_NHD, 4, 0, HEADS, 0, 1, SX_ACCESS_REMOTE_READ);
  *state = w;
  return 0;
}

static int setup_orders(void **state, sx_kv_order pre, uint32_t pre_tokens) {
  return setup_world(state, pre, pre_tokens, -1);
}

/* HND blocks of 8 tokens into NHD blocks of 4: pieces read directly. */
static int setup(void **state) { return setup_orders(state, SX_KV_HND, 8); }

/* NHD blocks of 8 into NHD blocks of 4: each rank's half of a token is a
 * piece, but its whole block is contiguous remotely: over TCP one request
 * per remote block, received scattered into the pieces. */
static int setup_scattered(void **state) { return setup_orders(state, SX_KV_NHD, 8); }

/* HND and NHD sets whose rank 1, or rank 0, serves no reads: its regions
 * are published for remote writes only. */
static int setup_denied1(void **state) { return setup_world(state, SX_KV_HND, 8, 1); }
static int setup_denied1_scattered(void **state) { return setup_world(state, SX_KV_NHD, 8, 1); }
static int setup_denied0(void **state) { return setup_world(state, SX_KV_HND, 8, 0); }

static int teardown(void **state) {
  world *w = *state;
  rank_stop(&w->d);
  for (int i = 0; i < 2; i++)
    if (w->p[i].a)
      rank_stop(&w->p[i]);
  free(w);
  return 0;
}

/* The request's 29 tokens fill 8 local blocks of 4 (the last has 1); the
 * rest of the remote blocks' last unit is zeros on both sides. */
static void expect_reference(world *w) { expect_heads(&w->d, LB, TOKENS, 0xf); }

/* The set of both prefill ranks, by engine name and tp size. */
static sx_group *open_pf(const world *w) { return ranks_open(w->d.a, "pf", 2); }

static void test_group_tp2_into_tp1_by_engine_name(void **state) {
  world *w = *state;
  sx_group *g = open_pf(w);
  /* The same set by pattern: the same members, in name order. */
  sx_group_params gp;
  sx_group_params_init(&gp);
  gp.pattern = "pf/tp*";
  sx_group *byp;
  sxt_ok(sx_group_open(w->d.a, &gp, &byp, NULL));
  assert_int_equal(sx_group_size(byp), 2);
  assert_string_equal(sx_segment_desc(sx_group_segment(byp, 0))->name, "pf/tp0");
  sx_group_close(byp);
  assert_int_equal(sx_group_size(g), 2);
  assert_string_equal(sx_segment_desc(sx_group_segment(g, 1))->name, "pf/tp1");
  assert_null(sx_group_segment(g, 2));
  sx_plan_info info;
  sxt_ok(sx_plan_info_get(sx_group_plan(g), &info));
  assert_int_equal(info.used, 2);
  sx_group_result r;
  sxt_ok(sx_group_read(g, RB, 4, LB, 8, 5000, &r));
  if (r.state != SX_BATCH_COMPLETED)
    fail_msg("%s: %s", sx_batch_state_name(r.state), r.message);
  assert_int_equal(r.n_failed, 0);
  assert_int_equal(r.members, 2);
  assert_int_equal(r.bytes, 2ull * LAYERS * 32 * HEADS * HEAD_DIM * sizeof(float));
  /* Scattered: a request per remote block, layer and slot (16 per rank),
   * not one per token piece (128 per rank). */
  if (w->scattered)
    assert_true(r.n_ranges <= 32);
  else
    assert_true(r.n_ranges >= 256);
  expect_reference(w);
  /* Again into the same blocks: the same bytes (reads are idempotent). */
  sxt_ok(sx_group_read(g, RB, 4, LB, 8, 5000, &r));
  assert_int_equal(r.state, SX_BATCH_COMPLETED);
  expect_reference(w);
  sx_group_close(g);
}

/* sx_group_read_notify: each member read from gets one read notice of its
 * own, with the tag and the bytes of its memory the read took; a plain
 * sx_group_read sends none.  Scattered reads (NHD here) list the remote
 * bytes of each request: the bytes must still equal the reference. */
static void test_group_read_notify_tells_each_member(void **state) {
  world *w = *state;
  sx_group *g = open_pf(w);
  sx_group_result r;
  sx_notice *n;
  sxt_ok(sx_group_read(g, RB, 4, LB, 8, 5000, &r));
  assert_int_equal(r.state, SX_BATCH_COMPLETED);
  for (int i = 0; i < 2; i++)
    sxt_rc(sx_agent_notice_next(w->p[i].a, 0, &n), SX_ETIMEDOUT);
  memset(w->d.mem[0], 0, rank_bytes(&w->d));
  sxt_ok(sx_group_read_notify(g, RB, 4, LB, 8, 5000, 0xfeedf00dull, &r));
  if (r.state != SX_BATCH_COMPLETED)
    fail_msg("%s: %s", sx_batch_state_name(r.state), r.message);
  assert_int_equal(r.members, 2);
  if (w->scattered)
    assert_true(r.n_ranges <= 32);
  expect_reference(w);
  /* Each notice was accepted before the read completed. */
  uint64_t bytes = 0;
  for (int i = 0; i < 2; i++)
    bytes += take_read_notice(w->p[i].a, 0xfeedf00dull);
  assert_int_equal(bytes, r.bytes);
  sx_group_close(g);
}

/* From the agent thread (an open callback), the waiting calls refuse. */
typedef struct on_loop {
  sx_group *g;
  sx_agent *a;
  int read_rc, open_rc, done;
} on_loop;

static void on_open(void *arg, int status, sx_segment *seg) {
  on_loop *o = arg;
  sx_group_result r;
  sx_group_params gp;
  sx_group *g = NULL;
  sx_group_params_init(&gp);
  gp.engine = "pf";
  gp.tp_size = 2;
  o->read_rc = sx_group_read(o->g, RB, 1, LB, 1, 1000, &r);
  o->open_rc = sx_group_open(o->a, &gp, &g, NULL);
  (void)status;
  sx_segment_close(seg);
  __atomic_store_n(&o->done, 1, __ATOMIC_RELEASE);
}

static void test_group_refuses_on_the_agent_thread(void **state) {
  world *w = *state;
  on_loop o = {open_pf(w), w->d.a, 0, 0, 0};
  sxt_ok(sx_segment_open_async(w->d.a, "pf/tp0", 1000, on_open, &o));
  for (int i = 0; i < 500 && !__atomic_load_n(&o.done, __ATOMIC_ACQUIRE); i++)
    sxt_sleep_ms(10);
  assert_true(o.done);
  assert_int_equal(o.read_rc, SX_EBUSY);
  assert_int_equal(o.open_rc, SX_EBUSY);
  sx_group_close(o.g);
}

static void test_group_refuses_before_any_byte_moves(void **state) {
  world *w = *state;
  sx_group_params gp;
  sx_group_params_init(&gp);
  sx_group *g = NULL;
  sx_mismatch m;
  /* A rank that is not published: named, after the open deadline. */
  gp.engine = "pf";
  gp.tp_size = 3;
  gp.timeout_ms = 200;
  sxt_rc(sx_group_open(w->d.a, &gp, &g, &m), SX_ENOENT);
  assert_non_null(strstr(sx_errmsg(), "the set lacks pf/tp2"));
  assert_null(g);
  /* One rank alone: heads 2-3 have no holder. */
  const char *one[] = {"pf/tp0"};
  gp.names = one;
  gp.n_names = 1;
  sxt_rc(sx_group_open(w->d.a, &gp, &g, &m), SX_EINCOMPAT);
  assert_int_equal(m.kind, SX_MISMATCH_HEADS_MISSING);
  assert_string_equal(m.local, "2");
  /* The same rank twice. */
  const char *twice[] = {"pf/tp0", "pf/tp0"};
  gp.names = twice;
  gp.n_names = 2;
  sxt_rc(sx_group_open(w->d.a, &gp, &g, &m), SX_EINCOMPAT);
  assert_int_equal(m.kind, SX_MISMATCH_TP);
  gp.names = NULL;
  gp.tp_size = 0;
  sxt_rc(sx_group_open(w->d.a, &gp, &g, &m), SX_EINVAL);
  /* By pattern: no live name matches; only rank 0 matches. */
  gp.engine = NULL;
  gp.pattern = "pf/nothing*";
  sxt_rc(sx_group_open(w->d.a, &gp, &g, &m), SX_ENOENT);
  assert_non_null(strstr(sx_errmsg(), "pf/nothing*"));
  gp.pattern = "pf/tp0*";
  sxt_rc(sx_group_open(w->d.a, &gp, &g, &m), SX_EINCOMPAT);
  assert_int_equal(m.kind, SX_MISMATCH_HEADS_MISSING);
  gp.pattern = NULL;
  /* A block outside a region: nothing is sent. */
  gp.engine = "pf";
  gp.tp_size = 2;
  sxt_ok(sx_group_open(w->d.a, &gp, &g, &m));
  uint64_t far[] = {9, BLOCKS};
  sx_group_result r;
  sx_agent_status before, after;
  sxt_ok(sx_agent_status_get(w->p[0].a, &before));
  sxt_rc(sx_group_read(g, far, 2, LB, 8, 5000, &r), SX_EBOUNDS);
  uint64_t lfar[] = {0, 1, BLOCKS};
  sxt_rc(sx_group_read(g, RB, 4, lfar, 3, 5000, &r), SX_EBOUNDS);
  sxt_rc(sx_group_read(g, NULL, 4, LB, 8, 5000, &r), SX_EINVAL);
  sxt_ok(sx_agent_status_get(w->p[0].a, &after));
  assert_int_equal(before.served_reads, after.served_reads);
  sx_group_close(g);
}

static void test_group_member_gone_fails_the_blocks_it_fed(void **state) {
  world *w = *state;
  sx_group *g = open_pf(w);
  /* Rank 1 restarts between the open and the read (its process, and so
   * its listener and incarnation, are gone). */
  rank_stop(&w->p[1]);
  sx_group_result r;
  sxt_ok(sx_group_read(g, RB, 4, LB, 8, 3000, &r));
  assert_int_equal(r.state, SX_BATCH_FAILED);
  assert_true(r.error != 0);
  assert_non_null(strstr(r.message, "pf/tp1"));
  /* Every local block had heads 2-3 from rank 1: all of them failed, each
   * named by its local id, in the order given. */
  assert_int_equal(r.n_failed, 8);
  for (int i = 0; i < 8; i++)
    assert_int_equal(r.failed[i], LB[i]);
  /* A read of the first local block only: rank 0's half arrived. */
  sxt_ok(sx_group_read(g, RB, 1, LB, 1, 3000, &r));
  assert_int_equal(r.n_failed, 1);
  assert_int_equal(r.failed[0], LB[0]);
  assert_true(r.bytes > 0);
  sx_group_close(g);
}

/*
 * A member whose batch cannot be filled (its regions refuse remote reads:
 * the batch planner says so while the entries are added) after another
 * member's batch was submitted: the read goes on, the other member's
 * heads arrive, and every local block the refusing member fed is reported
 * failed, with its error and name.  With the refusing member first, or
 * in a notifying read (every member is filled before any starts), nothing
 * has moved yet when it fails: the read is refused as a bad request is.
 */
static void test_group_member_that_cannot_start_fails_its_blocks(void **state) {
  world *w = *state;
  sx_group *g = open_pf(w);
  sx_agent_status before, after;
  int ok = 1 - w->denied;
  sxt_ok(sx_agent_status_get(w->p[ok].a, &before));
  sx_group_result r;
  size_t size = rank_bytes(&w->d);
  if (w->denied == 0) {
    sxt_rc(sx_group_read(g, RB, 4, LB, 8, 3000, &r), SX_EDENIED);
    assert_non_null(strstr(sx_errmsg(), "pf/tp0"));
    assert_non_null(strstr(sx_errmsg(), "does not allow remote reads"));
    sxt_ok(sx_agent_status_get(w->p[ok].a, &after));
    assert_int_equal(after.served_reads, before.served_reads);
    float *zero = calloc(1, size);
    assert_non_null(zero);
    for (int s = 0; s < 2; s++)
      assert_memory_equal(w->d.mem[s], zero, size);
    free(zero);
    sx_group_close(g);
    return;
  }
  sxt_ok(sx_group_read(g, RB, 4, LB, 8, 3000, &r));
  assert_int_equal(r.state, SX_BATCH_FAILED);
  assert_int_equal(r.error, SX_EDENIED);
  assert_non_null(strstr(r.message, "pf/tp1"));
  assert_int_equal(r.members, 1);
  /* The other rank's half of every token: its two heads of four. */
  assert_int_equal(r.bytes, 1ull * LAYERS * 32 * HEADS * HEAD_DIM * sizeof(float));
  assert_int_equal(r.n_failed, 8);
  for (int i = 0; i < 8; i++)
    assert_int_equal(r.failed[i], LB[i]);
  sxt_ok(sx_agent_status_get(w->p[ok].a, &after));
  assert_true(after.served_reads > before.served_reads);
  /* Byte for byte: the heads of the rank that served are the reference's,
   * the others were never written. */
  expect_heads(&w->d, LB, TOKENS, 3u << w->p[ok].first);
  /* A notifying read fills every member before any starts (a notice too
   * large is refused before any byte moves): refused the same way. */
  sxt_ok(sx_agent_status_get(w->p[ok].a, &before));
  sxt_rc(sx_group_read_notify(g, RB, 4, LB, 8, 3000, 7, &r), SX_EDENIED);
  assert_non_null(strstr(sx_errmsg(), "pf/tp1"));
  sxt_ok(sx_agent_status_get(w->p[ok].a, &after));
  assert_int_equal(after.served_reads, before.served_reads);
  sx_group_close(g);
}

/*
 * The set keeps its snapshot of the reader's regions from read to read,
 * but never past a change: after the V region is unregistered the read
 * is refused (no local region holds the key) and its old memory is not
 * written; once V is registered again, elsewhere, the next read fills the
 * new memory.
 */
static void test_group_read_follows_the_registrations(void **state) {
  world *w = *state;
  sx_group *g = open_pf(w);
  sx_group_result r;
  sxt_ok(sx_group_read(g, RB, 4, LB, 8, 5000, &r));
  assert_int_equal(r.state, SX_BATCH_COMPLETED);
  expect_reference(w);
  size_t size = rank_bytes(&w->d);
  sxt_ok(sx_agent_unregister(w->d.a, w->d.id[1]));
  memset(w->d.mem[1], 0, size);
  sxt_rc(sx_group_read(g, RB, 4, LB, 8, 5000, &r), SX_ENOREGION);
  assert_non_null(strstr(sx_errmsg(), "no local region"));
  float *zero = calloc(1, size);
  assert_non_null(zero);
  assert_memory_equal(w->d.mem[1], zero, size);
  free(zero);
  /* V again, in new memory (the old stays unregistered and untouched). */
  float *old = w->d.mem[1];
  assert_non_null(w->d.mem[1] = calloc(1, size));
  uint64_t bb = block_elems(&w->d) * sizeof(float);
  sx_region_params rp = {.addr = w->d.mem[1], .length = size, .layer_count = LAYERS,
                         .layer_stride = BLOCKS * bb, .slot = 1, .block_bytes = bb,
                         .num_blocks = BLOCKS, .access = SX_ACCESS_REMOTE_READ};
  sxt_ok(sx_agent_register(w->d.a, &rp, &w->d.id[1]));
  sxt_ok(sx_group_read(g, RB, 4, LB, 8, 5000, &r));
  assert_int_equal(r.state, SX_BATCH_COMPLETED);
  expect_reference(w);
  for (size_t i = 0; i < size / sizeof(float); i++)
    if (old[i] != 0.0f)
      fail_msg("the unregistered memory was written at %zu", i);
  free(old);
  sx_group_close(g);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_group_tp2_into_tp1_by_engine_name,
                                      setup_scattered, teardown),
      cmocka_unit_test_setup_teardown(test_group_member_gone_fails_the_blocks_it_fed,
                                      setup_scattered, teardown),
      cmocka_unit_test_setup_teardown(test_group_tp2_into_tp1_by_engine_name, setup,
                                      teardown),
      cmocka_unit_test_setup_teardown(test_group_read_notify_tells_each_member,
                                      setup_scattered, teardown),
      cmocka_unit_test_setup_teardown(test_group_read_notify_tells_each_member, setup,
                                      teardown),
      cmocka_unit_test_setup_teardown(test_group_refuses_before_any_byte_moves, setup,
                                      teardown),
      cmocka_unit_test_setup_teardown(test_group_refuses_on_the_agent_thread, setup,
                                      teardown),
      cmocka_unit_test_setup_teardown(test_group_member_gone_fails_the_blocks_it_fed, setup,
                                      teardown),
      cmocka_unit_test_setup_teardown(test_group_member_that_cannot_start_fails_its_blocks,
                                      setup_denied1, teardown),
      cmocka_unit_test_setup_teardown(test_group_member_that_cannot_start_fails_its_blocks,
                                      setup_denied1_scattered, teardown),
      cmocka_unit_test_setup_teardown(test_group_member_that_cannot_start_fails_its_blocks,
                                      setup_denied0, teardown),
      cmocka_unit_test_setup_teardown(test_group_read_follows_the_registrations,
                                      setup_scattered, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
