/*
 * TCP payloads moved by data-mover threads (transport/conn/xpool.h): the
 * reader's receive of large replies (tcp_rx.c) and the target's send of
 * large reply writes (conn.c), inside one process (mem:// store,
 * loopback), with the agents' own thread counts and a threshold below the
 * 1 MiB ranges read here, so that every reply goes through them.
 *
 *   - Several connections, fewer and more threads than connections (a
 *     worker gives its connection back when others wait): every byte is
 *     compared with the target's memory, and both kinds of job ran.
 *   - Through a proxy thread (support/tcp_proxy.h) that stalls the replies
 *     in the middle of a payload: a cancel and a deadline while the
 *     reader's worker waits in poll() end the batch at once; its
 *     destination is then unregistered and unmapped, and the rest of the
 *     payload is let through: a write after the batch ended would fault
 *     (or be reported by the sanitizer build).  The connection then reads
 *     on, byte-exact.
 *   - The peer dies in the middle of a payload: the batch fails and names
 *     it.
 *   - Both agents are destroyed while their workers are busy (the
 *     reader's waiting for a reply, the target's for room in its socket):
 *     each returns promptly, and the batch in flight ends SX_ESHUTDOWN.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "agent_fixture.h"
#include "internal.h"
#include "pattern.h"
#include "tcp_proxy.h"
#include "transport/conn/xpool.h"

#define MIB (1u << 20)
#define POOL_BLOCKS 24u /* the target's pool, in 1 MiB blocks */
#define BATCH 8u        /* ranges per batch */
#define DEPTH 3u        /* batches queued at once */
#define DST_BYTES ((size_t)DEPTH * BATCH * MIB)

typedef struct pair {
  char url[64];
  sx_agent *t, *r;
  uint8_t *pool, *dst;
  uint32_t region, dst_id;
  sx_segment *seg;
  sxt_proxy px;
  int proxied;
} pair;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* A destination mapped on its own, so that it can be unmapped. */
static void dst_map(pair *x) {
  x->dst = mmap(NULL, DST_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  assert_true(x->dst != MAP_FAILED);
  sx_region_params lp = {.addr = x->dst, .length = DST_BYTES, .layer_count = 1,
                         .slot = SX_SLOT_K, .block_bytes = MIB, .num_blocks = DEPTH * BATCH};
  sxt_ok(sx_agent_register(x->r, &lp, &x->dst_id));
}

static void dst_unmap(pair *x) {
  if (x->dst == NULL)
    return;
  sxt_ok(sx_agent_unregister(x->r, x->dst_id));
  munmap(x->dst, DST_BYTES);
  x->dst = NULL;
}

/* Target and reader with threads each (the threshold 64 KiB), conns
 * connections; stall >= 0: through a proxy that stalls the replies after
 * that many bytes (cut >= 0: that dies there). */
static void pair_start(pair *x, int32_t threads, uint32_t conns, long long stall,
                       long long cut) {
  memset(x, 0, sizeof(*x));
  sxt_mem_url(x->url, sizeof(x->url), "tcpthreads");
  char listen[32];
  sx_agent_params p;
  sxt_params(&p, x->url, "prefill-mt");
  p.transports = SX_TRANSPORTS_TCP;
  p.tcp_threads = threads;
  p.tcp_thread_bytes = 64u << 10;
  p.listen = "127.0.0.1:0";
  if (stall >= 0 || cut >= 0) {
    sxt_proxy_start(&x->px, 0, cut, stall);
    x->proxied = 1;
    snprintf(listen, sizeof(listen), "127.0.0.1:%u", x->px.port);
    p.listen = listen;
    p.advertise = "127.0.0.2"; /* the proxy */
  }
  sxt_ok(sx_agent_create(&p, &x->t));
  x->pool = malloc((size_t)POOL_BLOCKS * MIB);
  assert_non_null(x->pool);
  sx_region_params rp = {.addr = x->pool, .length = (uint64_t)POOL_BLOCKS * MIB,
                         .layer_count = 1, .slot = SX_SLOT_K, .block_bytes = MIB,
                         .num_blocks = POOL_BLOCKS, .access = SX_ACCESS_REMOTE_READ};
  sxt_ok(sx_agent_register(x->t, &rp, &x->region));
  sx__pattern_fill(x->pool, (uint64_t)POOL_BLOCKS * MIB, 17, x->region, 0);
  sxt_ok(sx_agent_publish(x->t, 0));

  sxt_params(&p, x->url, "decode-mt");
  p.transports = SX_TRANSPORTS_TCP;
  p.conns_per_peer = conns;
  p.tcp_threads = threads;
  p.tcp_thread_bytes = 64u << 10;
  sxt_ok(sx_agent_create(&p, &x->r));
  dst_map(x);
  sxt_ok(sx_segment_open(x->r, "prefill-mt", 5000, &x->seg));
  assert_int_equal(sx_segment_transport(x->seg), SX_TRANSPORT_TCP);
}

static void pair_stop(pair *x) {
  if (x->seg != NULL)
    sx_segment_close(x->seg);
  if (x->r != NULL) {
    dst_unmap(x);
    sx_agent_destroy(x->r);
  }
  if (x->t != NULL)
    sx_agent_destroy(x->t);
  if (x->proxied)
    sxt_proxy_stop(&x->px);
  free(x->pool);
}

/* Batch k of round: BATCH ranges of 1 MiB from scattered pool blocks into
 * destination slot k, submitted with a deadline of timeout_ms. */
static sx_batch *submit(pair *x, uint32_t k, uint32_t round, sx_range_read *e,
                        uint32_t timeout_ms, sx_batch_cb cb, void *arg) {
  for (uint32_t i = 0; i < BATCH; i++) {
    uint32_t b = (i * 7 + k * 5 + round * 3) % POOL_BLOCKS;
    e[i] = (sx_range_read){.local = x->dst + ((uint64_t)k * BATCH + i) * MIB,
                           .remote_region = x->region, .offset = (uint64_t)b * MIB,
                           .length = MIB};
  }
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = timeout_ms;
  bp.cb = cb;
  bp.cb_arg = arg;
  sx_batch *b;
  sxt_ok(sx_batch_create(x->seg, &bp, &b));
  sxt_ok(sx_batch_add_ranges(b, e, BATCH));
  sxt_ok(sx_batch_submit(b));
  return b;
}

static void check_landed(const pair *x, const sx_range_read *e) {
  for (uint32_t i = 0; i < BATCH; i++)
    if (memcmp(e[i].local, x->pool + e[i].offset, MIB) != 0)
      fail_msg("range %u (pool offset %lu) differs", i, (unsigned long)e[i].offset);
}

/* DEPTH batches queued, twice, every byte compared. */
static void read_rounds(pair *x) {
  sx_range_read e[DEPTH][BATCH];
  for (uint32_t round = 0; round < 2; round++) {
    memset(x->dst, 0, DST_BYTES);
    sx_batch *b[DEPTH];
    for (uint32_t k = 0; k < DEPTH; k++)
      b[k] = submit(x, k, round, e[k], 10000, NULL, NULL);
    for (uint32_t k = 0; k < DEPTH; k++) {
      sx_batch_result res = sxt_batch_finish(b[k]);
      if (res.state != SX_BATCH_COMPLETED)
        fail_msg("batch %u: %s: %s", k, sx_batch_state_name(res.state), res.message);
      assert_int_equal(res.bytes, (uint64_t)BATCH * MIB);
      check_landed(x, e[k]);
    }
  }
}

/* Four connections on two threads, three on one (workers give way to
 * the connections waiting), two on four: byte-exact, and workers both
 * received and sent. */
static void test_tcp_threads_connections_bytewise(void **state) {
  (void)state;
  static const struct { int32_t threads; uint32_t conns; } cases[] = {{2, 4}, {1, 3}, {4, 2}};
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    uint64_t rx = sx__xpool_runs(SX__XJOB_RECV), tx = sx__xpool_runs(SX__XJOB_SEND);
    pair *x = calloc(1, sizeof(*x));
    assert_non_null(x);
    pair_start(x, cases[i].threads, cases[i].conns, -1, -1);
    read_rounds(x);
    pair_stop(x);
    free(x);
    assert_true(sx__xpool_runs(SX__XJOB_RECV) > rx);
    assert_true(sx__xpool_runs(SX__XJOB_SEND) > tx);
  }
}

/* With no threads (0), nothing goes to a pool. */
static void test_tcp_threads_zero_means_none(void **state) {
  (void)state;
  uint64_t rx = sx__xpool_runs(SX__XJOB_RECV), tx = sx__xpool_runs(SX__XJOB_SEND);
  pair *x = calloc(1, sizeof(*x));
  assert_non_null(x);
  pair_start(x, 0, 2, -1, -1);
  read_rounds(x);
  pair_stop(x);
  free(x);
  assert_true(sx__xpool_runs(SX__XJOB_RECV) == rx);
  assert_true(sx__xpool_runs(SX__XJOB_SEND) == tx);
}

/* The replies stall 2.5 MiB in (the middle of the third range) with the
 * reader's worker waiting for the rest; the batch ends by a cancel
 * (deadline_ms 0) or its deadline.  It ends at once; its destination is
 * unregistered and unmapped before the rest is let through, which the
 * connection drains; then the connection reads on. */
/* Wait (up to 5 s) until a worker has started receiving since runs. */
static void wait_worker(uint64_t runs) {
  for (int i = 0; i < 5000 && sx__xpool_runs(SX__XJOB_RECV) == runs; i++) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  assert_true(sx__xpool_runs(SX__XJOB_RECV) > runs);
}

static void stall_then_end(uint32_t deadline_ms) {
  pair *x = calloc(1, sizeof(*x)); /* on the heap: the proxy thread outlives a failure */
  assert_non_null(x);
  long long stall = 5 * MIB / 2;
  pair_start(x, 2, 1, stall, -1);
  uint64_t rx = sx__xpool_runs(SX__XJOB_RECV);
  sx_range_read e[BATCH];
  double t0 = now_s();
  sx_batch *b = submit(x, 0, 0, e, deadline_ms ? deadline_ms : 30000, NULL, NULL);
  assert_int_equal(sxt_proxy_wait_down(&x->px, stall, 5000), 0);
  wait_worker(rx);
  struct timespec ts = {0, 50 * 1000000};
  nanosleep(&ts, NULL); /* the worker is in poll() by now */
  if (deadline_ms == 0) {
    t0 = now_s();
    sxt_ok(sx_batch_cancel(b));
  }
  sx_batch_result res = sxt_batch_finish(b);
  double took = now_s() - t0;
  assert_int_equal(res.state, deadline_ms ? SX_BATCH_TIMEOUT : SX_BATCH_CANCELLED);
  assert_true(took < 2.0 + deadline_ms / 1000.0);
  /* Whatever arrives from now on must not land in the old destination. */
  dst_unmap(x);
  sxt_proxy_release(&x->px);
  assert_int_equal(sxt_proxy_wait_down(&x->px, (long long)BATCH * MIB, 5000), 0);
  dst_map(x);
  memset(x->dst, 0, DST_BYTES);
  sx_batch *again = submit(x, 1, 1, e, 10000, NULL, NULL);
  res = sxt_batch_finish(again);
  if (res.state != SX_BATCH_COMPLETED)
    fail_msg("after the stall: %s: %s", sx_batch_state_name(res.state), res.message);
  check_landed(x, e);
  pair_stop(x);
  free(x);
}

static void test_tcp_threads_cancel_while_worker_waits(void **state) {
  (void)state;
  stall_then_end(0);
}

static void test_tcp_threads_deadline_while_worker_waits(void **state) {
  (void)state;
  stall_then_end(1500);
}

/* The target dies 2.5 MiB into the replies, in the middle of a payload
 * a worker receives: the batch fails at once and names the peer. */
static void test_tcp_threads_peer_dies_mid_payload(void **state) {
  (void)state;
  pair *x = calloc(1, sizeof(*x));
  assert_non_null(x);
  pair_start(x, 2, 2, -1, 5 * MIB / 2);
  sx_range_read e[BATCH];
  double t0 = now_s();
  sx_batch_result res = sxt_batch_finish(submit(x, 0, 0, e, 10000, NULL, NULL));
  assert_true(now_s() - t0 < 5.0);
  assert_int_equal(res.state, SX_BATCH_FAILED);
  assert_int_equal(res.error, SX_EDISCONN);
  assert_non_null(strstr(res.message, "prefill-mt"));
  assert_true(res.bytes < (uint64_t)BATCH * MIB);
  assert_true(__atomic_load_n(&x->px.dead, __ATOMIC_ACQUIRE));
  pair_stop(x);
  free(x);
}

static void count_shutdown(sx_batch *b, void *arg) {
  int *n = arg;
  sx_batch_result res;
  if (sx_batch_result_get(b, &res) == 0 && res.state == SX_BATCH_FAILED &&
      res.error == SX_ESHUTDOWN)
    __atomic_fetch_add(n, 1, __ATOMIC_ACQ_REL);
  sx_batch_destroy(b);
}

/* Replies stall 1.5 MiB in with the reader's window (16 MiB) asked: the
 * reader's worker waits for a payload, the target's for room to send.
 * Both agents are destroyed in that state: each returns promptly, and
 * the batch ends SX_ESHUTDOWN. */
static void test_tcp_threads_shutdown_with_workers_busy(void **state) {
  (void)state;
  pair *x = calloc(1, sizeof(*x));
  assert_non_null(x);
  long long stall = 3 * MIB / 2;
  pair_start(x, 2, 1, stall, -1);
  uint64_t rx = sx__xpool_runs(SX__XJOB_RECV);
  sx_range_read e[DEPTH][BATCH];
  static int ended;
  ended = 0;
  for (uint32_t k = 0; k < DEPTH; k++)
    submit(x, k, 0, e[k], 30000, count_shutdown, &ended);
  assert_int_equal(sxt_proxy_wait_down(&x->px, stall, 5000), 0);
  wait_worker(rx);
  struct timespec ts = {0, 50 * 1000000};
  nanosleep(&ts, NULL);
  /* The segment stays open: destroy closes it and ends the batches. */
  double t0 = now_s();
  sx_agent_destroy(x->r);
  x->r = NULL;
  x->seg = NULL;
  assert_true(now_s() - t0 < 5.0);
  assert_int_equal(__atomic_load_n(&ended, __ATOMIC_ACQUIRE), DEPTH);
  munmap(x->dst, DST_BYTES);
  x->dst = NULL;
  t0 = now_s();
  sx_agent_destroy(x->t);
  x->t = NULL;
  assert_true(now_s() - t0 < 5.0);
  pair_stop(x);
  free(x);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_tcp_threads_connections_bytewise),
      cmocka_unit_test(test_tcp_threads_zero_means_none),
      cmocka_unit_test(test_tcp_threads_cancel_while_worker_waits),
      cmocka_unit_test(test_tcp_threads_deadline_while_worker_waits),
      cmocka_unit_test(test_tcp_threads_peer_dies_mid_payload),
      cmocka_unit_test(test_tcp_threads_shutdown_with_workers_busy),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
