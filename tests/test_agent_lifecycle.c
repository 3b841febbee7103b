/*
 * Agents over time, inside one process: two agents on the mem:// store
 * talking over real loopback TCP.  A restarted target (new incarnation) is
 * stale to old views and found again by a re-open; a dead target fails
 * batches fast; the lease state machine (renewal, a lost segment
 * republished, takeover and fencing, destroy with a renewal in flight);
 * region retirement; opening a name before it is published.  Reads and
 * batches themselves are in test_agent.c.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "backend.h"
#include "internal.h"
#include "pattern.h"

static void op_done_cb(void *arg, const sx_backend_reply *rep) {
  (void)rep;
  *(int *)arg = 1;
}

static void new_url(char *url, size_t size) { sxt_mem_url(url, size, "agent"); }

static int pattern_ok(const uint8_t *p, uint64_t len, uint64_t seed, uint32_t region,
                      uint64_t off) {
  return sx__pattern_check(p, len, seed, region, off, NULL) == 0;
}

/* ------------------------------------------------------------ staleness */

static void test_agent_restarted_target_is_stale_then_reopens(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sxt_agent t, r;
  sxt_target_start(&t, url, "prefill-5", NULL, 111);
  sxt_reader_start(&r, url, "decode-5");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "prefill-5", 1000, &seg));
  sx_block_read e = {.layer_count = SXT_LAYERS, .slots = SXT_KV, .remote_block = 0,
                     .local_block = 0, .count = 4};
  sx_batch_result res = sxt_run_batch(seg, &e, 1, 10000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  uint16_t port = sxt_tcp_port(sx_segment_desc(seg));
  uint8_t old_inc[SX_INCARNATION_LEN];
  memcpy(old_inc, sx_segment_desc(seg)->incarnation, sizeof(old_inc));

  /* Restart: same name, same port, new incarnation and new contents. */
  sxt_agent_stop(&t);
  char listen[32];
  snprintf(listen, sizeof(listen), "127.0.0.1:%u", port);
  sxt_target_start(&t, url, "prefill-5", listen, 222);

  /* The old segment never yields bytes: the connection broke, or the
   * new target says the incarnation is stale. */
  memset(r.mem[0], 0, SXT_LAYERS * SXT_READER_BLOCKS * SXT_BLOCK);
  int stale = 0;
  for (int i = 0; i < 5 && !stale; i++) {
    res = sxt_run_batch(seg, &e, 1, 10000);
    assert_int_not_equal(res.state, SX_BATCH_COMPLETED);
    assert_true(res.error == SX_ESTALE || res.error == SX_EDISCONN ||
                res.error == SX_EUNREACH);
    stale = res.error == SX_ESTALE;
  }
  assert_true(stale);
  for (size_t i = 0; i < SXT_LAYERS * SXT_READER_BLOCKS * SXT_BLOCK; i++)
    if (r.mem[0][i] != 0)
      fail_msg("byte %zu written by a stale read", i);
  /* And it stays stale, at once. */
  res = sxt_run_batch(seg, &e, 1, 10000);
  assert_int_equal(res.error, SX_ESTALE);
  sx_segment_close(seg);

  /* A re-open finds the new incarnation and reads its bytes. */
  sxt_ok(sx_segment_open(r.a, "prefill-5", 1000, &seg));
  assert_memory_not_equal(sx_segment_desc(seg)->incarnation, old_inc, SX_INCARNATION_LEN);
  res = sxt_run_batch(seg, &e, 1, 10000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(sxt_verify_blocks(&r, seg, 222, &e), 0);
  sx_segment_close(seg);
  sxt_agent_stop(&r);
  sxt_agent_stop(&t);
}

static void test_agent_batches_fail_fast_after_the_target_dies(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sxt_agent t, r;
  sxt_target_start(&t, url, "prefill-13", NULL, 13);
  sxt_reader_start(&r, url, "decode-13");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "prefill-13", 1000, &seg));
  sx_block_read e = {.layer_count = SXT_LAYERS, .slots = SXT_KV, .count = 4};
  assert_int_equal(sxt_run_batch(seg, &e, 1, 10000).state, SX_BATCH_COMPLETED);
  sxt_agent_stop(&t);
  /* Whether the reader has noticed the closed connections yet or not, each
   * batch fails promptly with a connection error: never at its deadline. */
  for (int i = 0; i < 5; i++) {
    uint64_t t0 = sx__mono_ms();
    sx_batch_result res = sxt_run_batch(seg, &e, 1, 30000);
    assert_int_equal(res.state, SX_BATCH_FAILED);
    assert_true(res.error == SX_EDISCONN || res.error == SX_EUNREACH ||
                res.error == SX_ENOENT);
    assert_true(sx__mono_ms() - t0 < 10000);
  }
  sx_segment_close(seg);
  sxt_agent_stop(&r);
}

/* Regression: destroying an agent while one of its renewals was in flight
 * hung for good: the renewal's answer, seeing the agent shut down, did not
 * move the lease queue on, so the unpublish queued behind it never ran and
 * the agent thread never ended (sx-agent ignored SIGTERM under load). */
static void *destroy_agent(void *arg) {
  sx_agent_destroy(arg);
  return NULL;
}

static void test_agent_destroy_while_a_renewal_is_in_flight(void **state) {
  (void)state;
  char url[64], store[64];
  new_url(url, sizeof(url));
  snprintf(store, sizeof(store), "%s", url + strlen("mem://"));
  sx_agent_params p;
  sxt_params(&p, url, "renewing-0");
  p.listen = "127.0.0.1:0";
  p.lease_ms = 600; /* renewed every 200 ms */
  sx_agent *a;
  sxt_ok(sx_agent_create(&p, &a));
  sxt_ok(sx_agent_publish(a, 0));
  /* From now on the store answers 800 ms late: the next renewal (within
   * 200 ms) is still out when the agent is destroyed. */
  sx__mem_set_delay(store, 1, 800);
  usleep(400 * 1000);
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, destroy_agent, a), 0);
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 15;
  if (pthread_timedjoin_np(th, NULL, &until) != 0)
    fail_msg("sx_agent_destroy did not return within 15 s of a renewal in flight");
  sx__mem_set_delay(store, 0, 0);
  /* It unpublished on the way out. */
  sx_store *s;
  sxt_ok(sx_store_open(url, &s));
  sx_desc d;
  sxt_rc(sx_store_get(s, "renewing-0", &d, NULL), SX_ENOENT);
  sx_store_close(s);
}

/* ------------------------------------------------------------ lease */

static void wait_state(sx_agent *a, sx_agent_state want, uint64_t ms) {
  uint64_t end = sx__mono_ms() + ms;
  sx_agent_status st;
  do {
    sxt_ok(sx_agent_status_get(a, &st));
    if (st.state == want)
      return;
    usleep(10000);
  } while (sx__mono_ms() < end);
  fail_msg("state %d, wanted %d", st.state, want);
}

/* The advertised address goes to peers as given: what none could connect
 * to is refused at create, saying why; what they can is taken. */
static void test_agent_create_refuses_an_unusable_advertise_address(void **state) {
  (void)state;
  static const struct {
    const char *adv, *why;
  } bad[] = {{"a b", "only letters"},     {"", "empty"},
             {"10.0.0.1:7000", "no port"}, {"[::1]", "no port"},
             {"0.0.0.0", "wildcard"},   {"::", "wildcard"},
             {"-host", "'-'"},          {"host-.example", "'-'"},
             {"a..b", "empty label"},   {".a", "empty label"},
             {"h\tst", "only letters"},  {"h\xc3\xa9", "only letters"}};
  static const char *good[] = {"10.0.0.1", "::1", "fe80::1%lo", "node-7.example.org",
                               "localhost", "host."};
  char url[64];
  new_url(url, sizeof(url));
  sx_agent_params p;
  sx_agent *a;
  sxt_params(&p, url, "adv-0");
  p.listen = "127.0.0.1:0";
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    p.advertise = bad[i].adv;
    a = (sx_agent *)&p;
    int rc = sx_agent_create(&p, &a);
    if (rc != SX_EINVAL || strstr(sx_errmsg(), "advertise address") == NULL ||
        strstr(sx_errmsg(), bad[i].why) == NULL)
      fail_msg("advertise '%s': %s (%s)", bad[i].adv, sx_err_name(rc), sx_errmsg());
    assert_ptr_equal(a, (sx_agent *)&p);
  }
  char long_name[300];
  memset(long_name, 'a', sizeof(long_name) - 1);
  long_name[sizeof(long_name) - 1] = '\0';
  p.advertise = long_name;
  sxt_rc(sx_agent_create(&p, &a), SX_EINVAL);
  for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
    p.advertise = good[i];
    int rc = sx_agent_create(&p, &a);
    if (rc != 0)
      fail_msg("advertise '%s': %s (%s)", good[i], sx_err_name(rc), sx_errmsg());
    sx_agent_destroy(a);
  }
}

static void test_agent_lease_reclaims_lost_segment(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sx_agent_params p;
  sxt_params(&p, url, "prefill-8");
  p.listen = "127.0.0.1:0";
  p.lease_ms = 600;
  sx_agent *a;
  sxt_ok(sx_agent_create(&p, &a));
  sxt_ok(sx_agent_publish(a, 0));
  /* Renewals keep it alive well past one lease. */
  usleep(1500 * 1000);
  sx_agent_status st;
  sxt_ok(sx_agent_status_get(a, &st));
  assert_int_equal(st.state, SX_AGENT_PUBLISHED);
  assert_true(st.renewals >= 2);
  /* The store loses it (a restarted empty Redis does this): the agent
   * republishes with the next generation by itself. */
  uint8_t inc[SX_INCARNATION_LEN];
  sx_agent_incarnation(a, inc);
  sx_desc d;
  sxt_ok(sx_agent_descriptor(a, &d));
  uv_loop_t loop;
  sx_backend *b;
  uv_loop_init(&loop);
  sxt_ok(sx__backend_open(&loop, url, NULL, &b));
  int done = 0;
  sxt_ok(sx__backend_unpublish(b, "prefill-8", inc, op_done_cb, &done));
  while (!done)
    uv_run(&loop, UV_RUN_ONCE);
  sx__backend_close(b);
  uv_run(&loop, UV_RUN_DEFAULT);
  uv_loop_close(&loop);
  uint64_t end = sx__mono_ms() + 5000;
  do {
    usleep(20000);
    sxt_ok(sx_agent_status_get(a, &st));
  } while (st.republishes == 0 && sx__mono_ms() < end);
  assert_int_equal(st.republishes, 1);
  assert_int_equal(st.state, SX_AGENT_PUBLISHED);
  assert_int_equal(st.generation, 2);
  sx_desc_free(&d);
  sx_agent_destroy(a);
}

static void test_agent_takeover_fences_the_old_holder(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sx_agent_params p;
  sxt_params(&p, url, "prefill-9");
  p.listen = "127.0.0.1:0";
  p.lease_ms = 600;
  sx_agent *a1, *a2;
  sxt_ok(sx_agent_create(&p, &a1));
  sxt_ok(sx_agent_create(&p, &a2));
  sxt_ok(sx_agent_publish(a1, 0));
  /* The name is held: the error names the holder. */
  sxt_rc(sx_agent_publish(a2, 0), SX_EHELD);
  uint8_t inc[SX_INCARNATION_LEN];
  char hex[33];
  sx_agent_incarnation(a1, inc);
  sx_hex(inc, sizeof(inc), hex);
  assert_non_null(strstr(sx_errmsg(), hex));
  sx_agent_status st;
  sxt_ok(sx_agent_status_get(a2, &st));
  assert_int_equal(st.state, SX_AGENT_UNPUBLISHED);
  /* An explicit takeover wins; the old holder is fenced at its next renew. */
  sxt_ok(sx_agent_publish(a2, SX_PUBLISH_TAKEOVER));
  wait_state(a1, SX_AGENT_FENCED, 5000);
  sxt_rc(sx_agent_publish(a1, 0), SX_EFENCED);
  wait_state(a2, SX_AGENT_PUBLISHED, 100);
  sx_agent_destroy(a1);
  /* The fenced agent's shutdown did not remove the new holder's segment. */
  sxt_agent r;
  sxt_reader_start(&r, url, "decode-9");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "prefill-9", 1000, &seg));
  uint8_t inc2[SX_INCARNATION_LEN];
  sx_agent_incarnation(a2, inc2);
  assert_memory_equal(sx_segment_desc(seg)->incarnation, inc2, SX_INCARNATION_LEN);
  sx_segment_close(seg);
  sxt_agent_stop(&r);
  /* Unpublish removes it at once. */
  sxt_ok(sx_agent_unpublish(a2));
  sxt_reader_start(&r, url, "decode-9b");
  sxt_rc(sx_segment_open(r.a, "prefill-9", 0, &seg), SX_ENOENT);
  sxt_agent_stop(&r);
  sx_agent_destroy(a2);
}

/* ------------------------------------------------------------ regions */

static void test_agent_unregister_withdraws_the_region(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sxt_agent t, r;
  sxt_target_start(&t, url, "prefill-10", NULL, 3);
  sxt_reader_start(&r, url, "decode-10");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "prefill-10", 1000, &seg));
  sx_block_read ek = {.layer_count = 1, .slots = 1ull << SX_SLOT_V, .count = 2};
  assert_int_equal(sxt_run_batch(seg, &ek, 1, 10000).state, SX_BATCH_COMPLETED);
  sxt_ok(sx_agent_unregister(t.a, t.id[1]));
  sxt_rc(sx_agent_unregister(t.a, t.id[1]), SX_ENOREGION);
  sx_agent_status st;
  sxt_ok(sx_agent_status_get(t.a, &st));
  assert_int_equal(st.generation, 2);
  /* An old view of the segment asks for it: the target refuses. */
  sx_batch_result res = sxt_run_batch(seg, &ek, 1, 10000);
  assert_int_equal(res.state, SX_BATCH_FAILED);
  assert_int_equal(res.error, SX_ENOREGION);
  sx_segment_close(seg);
  /* A fresh view no longer has it (the put event dropped the cached one). */
  sxt_ok(sx_segment_open(r.a, "prefill-10", 1000, &seg));
  assert_int_equal(sx_segment_desc(seg)->n_regions, 1);
  assert_int_equal(sx_segment_desc(seg)->generation, 2);
  sx_segment_close(seg);
  sxt_agent_stop(&r);
  sxt_agent_stop(&t);
}

/* Open name once the reader's cache has the descriptor with n regions
 * (the store's put event reaches the cache a moment after a publish). */
static sx_segment *open_with_regions(sx_agent *a, const char *name, uint32_t n) {
  for (int i = 0; i < 500; i++) {
    sx_segment *seg;
    sxt_ok(sx_segment_open(a, name, 1000, &seg));
    if (sx_segment_desc(seg)->n_regions == n)
      return seg;
    sx_segment_close(seg);
    usleep(10000);
  }
  fail_msg("%s never showed %u regions", name, n);
  return NULL;
}

/* Planning e on seg fails with SX_ENOREGION; returns sx_errmsg(). */
static const char *refused(sx_segment *seg, const sx_block_read *e) {
  sx_batch *b;
  sxt_ok(sx_batch_create(seg, NULL, &b));
  sxt_rc(sx_batch_add_blocks(b, e, 1), SX_ENOREGION);
  sx_batch_destroy(b);
  return sx_errmsg();
}

/* Region lookups come from an index built with each segment (from its
 * descriptor) and with each set of local registrations (planner.h: a
 * dense table where the layout allows).  When the layout changes, a
 * segment opened before plans against the layout it opened, one opened
 * after against the new one, and local registrations count from the next
 * batch on: no index answers with a layout it was not built from. */
static void test_agent_layout_change_plans_against_a_new_index(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sxt_agent t, r;
  sxt_target_start(&t, url, "prefill-12", NULL, 12);
  sxt_reader_start(&r, url, "decode-12");
  sx_segment *old;
  sxt_ok(sx_segment_open(r.a, "prefill-12", 1000, &old));
  /* Group 1, K, layers 0 and 1, two blocks. */
  sx_block_read g1 = {.group = 1, .layer_count = 2, .slots = 1ull << SX_SLOT_K,
                      .remote_block = 3, .local_block = 1, .count = 2};
  refused(old, &g1);

  /* The target adds group 1 (two layers) and republishes. */
  const uint64_t tl = SXT_TARGET_BLOCKS * SXT_BLOCK, rl = SXT_READER_BLOCKS * SXT_BLOCK;
  uint8_t *tmem = calloc(2, tl), *rmem = calloc(2, rl);
  assert_non_null(tmem);
  assert_non_null(rmem);
  sx_region_params rp = {.addr = tmem, .length = 2 * tl, .group = 1, .layer_count = 2,
                         .layer_stride = tl, .slot = SX_SLOT_K, .block_bytes = SXT_BLOCK,
                         .num_blocks = SXT_TARGET_BLOCKS, .access = SX_ACCESS_REMOTE_READ};
  uint32_t tid, rid;
  sxt_ok(sx_agent_register(t.a, &rp, &tid));
  sx__pattern_fill(tmem, 2 * tl, 12, tid, 0);
  sxt_ok(sx_agent_publish(t.a, 0));

  /* A new view has group 1; the reader has no local group 1 yet. */
  sx_segment *seg = open_with_regions(r.a, "prefill-12", 3);
  assert_non_null(strstr(refused(seg, &g1), "no local region"));
  rp.addr = rmem;
  rp.length = 2 * rl;
  rp.layer_stride = rl;
  rp.num_blocks = SXT_READER_BLOCKS;
  rp.access = 0;
  sxt_ok(sx_agent_register(r.a, &rp, &rid));

  /* The old view still lacks the remote group 1. */
  assert_non_null(strstr(refused(old, &g1), "the remote segment has no region"));
  /* The new one reads it, byte for byte, and nothing past its layers. */
  sx_batch_result res = sxt_run_batch(seg, &g1, 1, 10000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  for (uint32_t l = 0; l < 2; l++)
    assert_true(pattern_ok(rmem + l * rl + 1 * SXT_BLOCK, 2 * SXT_BLOCK, 12, tid,
                           l * tl + 3 * SXT_BLOCK));
  sx_block_read past = g1;
  past.layer_count = 3;
  refused(seg, &past);
  sx_block_read g0 = {.layer_count = SXT_LAYERS, .slots = SXT_KV, .count = 2};
  assert_int_equal(sxt_run_batch(seg, &g0, 1, 10000).state, SX_BATCH_COMPLETED);
  assert_int_equal(sxt_verify_blocks(&r, seg, 12, &g0), 0);
  sx_segment_close(seg);

  /* The target retires group 0's K: a new view refuses it, keeps V. */
  sxt_ok(sx_agent_unregister(t.a, t.id[0]));
  seg = open_with_regions(r.a, "prefill-12", 2);
  refused(seg, &g0);
  g0.slots = 1ull << SX_SLOT_V;
  assert_int_equal(sxt_run_batch(seg, &g0, 1, 10000).state, SX_BATCH_COMPLETED);
  assert_int_equal(sxt_run_batch(seg, &g1, 1, 10000).state, SX_BATCH_COMPLETED);
  sx_segment_close(seg);
  sx_segment_close(old);
  sxt_ok(sx_agent_unregister(r.a, rid));
  sxt_agent_stop(&r);
  sxt_agent_stop(&t);
  free(tmem);
  free(rmem);
}

/* ------------------------------------------------------------ open */

typedef struct late_pub {
  const char *url;
  const char *name;  /* NULL: "late-11" */
  uint32_t delay_ms; /* 0: 200 */
  sxt_agent t;
} late_pub;

static void *publish_late(void *arg) {
  late_pub *lp = arg;
  usleep((lp->delay_ms ? lp->delay_ms : 200) * 1000);
  sxt_target_start(&lp->t, lp->url, lp->name ? lp->name : "late-11", NULL, 11);
  return NULL;
}

typedef struct async_open {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done, status;
  sx_segment *seg;
} async_open;

static void opened(void *arg, int status, sx_segment *seg) {
  async_open *o = arg;
  pthread_mutex_lock(&o->mu);
  o->done++;
  o->status = status;
  o->seg = seg;
  pthread_cond_broadcast(&o->cv);
  pthread_mutex_unlock(&o->mu);
}

static void test_agent_open_waits_for_the_name(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sxt_agent r;
  sxt_reader_start(&r, url, "decode-11");
  sx_segment *seg;
  uint64_t t0 = sx__mono_ms();
  sxt_rc(sx_segment_open(r.a, "never-11", 200, &seg), SX_ENOENT);
  assert_true(sx__mono_ms() - t0 >= 190);
  sxt_rc(sx_segment_open(r.a, "/bad", 200, &seg), SX_ENAME);

  late_pub lp = {.url = url};
  pthread_t th;
  pthread_create(&th, NULL, publish_late, &lp);
  async_open o = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  sxt_ok(sx_segment_open_async(r.a, "late-11", 30000, opened, &o));
  sxt_ok(sx_segment_open(r.a, "late-11", 30000, &seg));
  pthread_join(th, NULL);
  pthread_mutex_lock(&o.mu);
  while (!o.done)
    pthread_cond_wait(&o.cv, &o.mu);
  pthread_mutex_unlock(&o.mu);
  sxt_ok(o.status);
  assert_int_equal(o.done, 1);
  sx_block_read e = {.layer_count = 1, .slots = SXT_KV, .count = 1};
  assert_int_equal(sxt_run_batch(o.seg, &e, 1, 10000).state, SX_BATCH_COMPLETED);
  sx_segment_close(o.seg);
  uint64_t rtt;
  sx_transport_kind via;
  sxt_ok(sx_segment_ping(seg, 5000, &rtt, &via));
  assert_int_equal(via, SX_TRANSPORT_TCP);
  sx_segment_close(seg);
  sxt_agent_stop(&r);
  sxt_agent_stop(&lp.t);
}

/* Regression: the synchronous open waited for the agent thread timeout_ms
 * plus a 30 s slack, added in 32 bits: a timeout near UINT32_MAX (an
 * engine's "as long as it takes") wrapped to a short wait, and the open
 * failed with SX_ETIMEDOUT ("the agent did not answer within 999 ms")
 * while the name was still being waited for. */
static void test_agent_open_with_a_timeout_near_uint32_max_waits(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sxt_agent r;
  sxt_reader_start(&r, url, "decode-12");
  late_pub lp = {.url = url, .name = "late-12", .delay_ms = 1500};
  pthread_t th;
  pthread_create(&th, NULL, publish_late, &lp);
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "late-12", UINT32_MAX - 29000, &seg));
  pthread_join(th, NULL);
  assert_string_equal(sx_segment_desc(seg)->name, "late-12");
  sx_segment_close(seg);
  sxt_agent_stop(&r);
  sxt_agent_stop(&lp.t);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_agent_restarted_target_is_stale_then_reopens),
      cmocka_unit_test(test_agent_batches_fail_fast_after_the_target_dies),
      cmocka_unit_test(test_agent_destroy_while_a_renewal_is_in_flight),
      cmocka_unit_test(test_agent_create_refuses_an_unusable_advertise_address),
      cmocka_unit_test(test_agent_lease_reclaims_lost_segment),
      cmocka_unit_test(test_agent_takeover_fences_the_old_holder),
      cmocka_unit_test(test_agent_unregister_withdraws_the_region),
      cmocka_unit_test(test_agent_layout_change_plans_against_a_new_index),
      cmocka_unit_test(test_agent_open_waits_for_the_name),
      cmocka_unit_test(test_agent_open_with_a_timeout_near_uint32_max_waits),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
