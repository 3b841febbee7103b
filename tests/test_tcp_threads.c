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
 *   - One thread, and a peer that stalls it (a reader's worker waiting
 *     for a reply that does not come, a target's waiting for room that a
 *     reader does not make): another target's or reader's read does not
 *     wait for it (the worker gives way), and the stalled one completes
 *     byte-exact once the stall ends.
 *   - Both agents are destroyed while their workers are busy (the
 *     reader's waiting for a reply, the target's for room in its socket):
 *     each returns promptly, and the batch in flight ends SX_ESHUTDOWN.
 *   - When they engage (transport/conn/engage.h): with one busy
 *     connection per side the loop moves every payload (nothing goes to
 *     a worker, each is counted as kept); with two, workers do; and a
 *     reader streaming from one target switches mid-stream to the workers
 *     while a second target's read runs and back to its loop once that
 *     ended, every byte compared; SX_TCP_THREAD_CONNS takes 1..1024 only.
 *
 * The tests of one connection through a stalling or dying proxy run with
 * SX_TCP_THREAD_CONNS=1 (the threads engage from one busy connection),
 * so that its payloads are on a worker as the fault hits; the cancel and
 * deadline ones run again on two connections with the default.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "agent_fixture.h"
#include "tcp_pair.h"
#include "transport/conn/engage.h"
#include "transport/conn/xpool.h"

#define BATCH 8u /* ranges of 1 MiB per batch */

typedef sxt_tcp_pair pair;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Target and reader with threads each (the threshold 64 KiB), conns
 * connections; stall >= 0: through a proxy that stalls the replies after
 * that many bytes (cut >= 0: that dies there).  On the heap: a proxy
 * thread outlives a failed test. */
static pair *pair_start(int32_t threads, uint32_t conns, long long stall, long long cut) {
  pair *x = calloc(1, sizeof(*x));
  assert_non_null(x);
  sxt_tcp_pair_opts o = {.conns = conns, .batch = BATCH, .threads = threads,
                         .thread_bytes = 64u << 10, .stall = stall, .cut = cut};
  sxt_tcp_pair_start(x, &o);
  return x;
}

/* The threads engage from one busy connection (1) or as by default (0),
 * for the agents started from now on (read when their transport opens). */
static void engage_from_one(int on) {
  if (on)
    setenv("SX_TCP_THREAD_CONNS", "1", 1);
  else
    unsetenv("SX_TCP_THREAD_CONNS");
}

static pair *pair_start_opts(const sxt_tcp_pair_opts *o) {
  pair *x = calloc(1, sizeof(*x));
  assert_non_null(x);
  sxt_tcp_pair_start(x, o);
  return x;
}

static void pair_stop(pair *x) {
  sxt_tcp_pair_stop(x);
  free(x);
}

static sx_batch *submit(pair *x, uint32_t k, uint32_t round, sx_range_read *e,
                        uint32_t timeout_ms, sx_batch_cb cb, void *arg) {
  return sxt_tcp_pair_submit(x, k, round, e, timeout_ms, cb, arg);
}

/* Wait (up to 10 s) until a worker has started a job of kind since runs. */
static void wait_runs(unsigned kind, uint64_t runs) {
  for (int i = 0; i < 10000 && sx__xpool_runs(kind) == runs; i++) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  if (sx__xpool_runs(kind) == runs)
    fail_msg("no worker started %s within 10 s", kind == SX__XJOB_RECV ? "receiving" : "sending");
}

/* A round of SXT_TCP_PAIR_DEPTH batches on conns connections with threads
 * workers a side, during which workers both receive and send, byte for
 * byte.  The connections are held busy at once by the proxy (replies
 * stall 1.5 MiB in, and the target's sends fill up behind a small receive
 * buffer), not left to timing: under valgrind, or on a loaded host, each
 * connection's replies could otherwise finish before another's began, and
 * the threads never engage. */
static void engaged_round(int32_t threads, uint32_t conns) {
  uint64_t rx = sx__xpool_runs(SX__XJOB_RECV), tx = sx__xpool_runs(SX__XJOB_SEND);
  long long stall = 3 * SXT_MIB / 2;
  pair *x = pair_start_opts(&(sxt_tcp_pair_opts){
      .conns = conns, .batch = BATCH, .threads = threads, .thread_bytes = 64u << 10,
      .stall = stall, .cut = -1, .up_rcvbuf = 64 << 10});
  sx_range_read e[SXT_TCP_PAIR_DEPTH][SXT_TCP_PAIR_RANGES];
  sx_batch *b[SXT_TCP_PAIR_DEPTH];
  for (uint32_t k = 0; k < SXT_TCP_PAIR_DEPTH; k++)
    b[k] = submit(x, k, 0, e[k], 30000, NULL, NULL);
  assert_int_equal(sxt_proxy_wait_down(&x->px, stall, 5000), 0);
  print_message("%d threads, %u connections\n", threads, conns);
  wait_runs(SX__XJOB_RECV, rx);
  wait_runs(SX__XJOB_SEND, tx);
  sxt_proxy_release(&x->px);
  sxt_tcp_pair_finish(x, b, e);
  pair_stop(x);
}

/* Four connections on two threads, three on one (workers give way to
 * the connections waiting), two on four: byte-exact, and workers both
 * received and sent. */
static void test_tcp_threads_connections_bytewise(void **state) {
  (void)state;
  static const struct { int32_t threads; uint32_t conns; } cases[] = {{2, 4}, {1, 3}, {4, 2}};
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
    engaged_round(cases[i].threads, cases[i].conns);
}

/* Two rounds with threads and conns, byte-exact, during which no worker
 * started a job. */
static void rounds_without_workers(int32_t threads, uint32_t conns) {
  uint64_t rx = sx__xpool_runs(SX__XJOB_RECV), tx = sx__xpool_runs(SX__XJOB_SEND);
  pair *x = pair_start(threads, conns, -1, -1);
  sxt_tcp_pair_rounds(x, 2);
  pair_stop(x);
  assert_true(sx__xpool_runs(SX__XJOB_RECV) == rx);
  assert_true(sx__xpool_runs(SX__XJOB_SEND) == tx);
}

/* With no threads (0), nothing goes to a pool. */
static void test_tcp_threads_zero_means_none(void **state) {
  (void)state;
  rounds_without_workers(0, 2);
}

/* The replies stall 2.5 MiB in (the middle of the third range) with the
 * reader's worker waiting for the rest; the batch ends by a cancel
 * (deadline_ms 0) or its deadline.  It ends at once; its destination is
 * unregistered and unmapped before the rest is let through, which the
 * connection drains; then the connection reads on.  On one connection
 * (the threads engaged from one), or on two (the default engagement):
 * then a first round passes unstalled, so that both connections are
 * ready and the batch is spread over them. */
static void stall_then_end(uint32_t deadline_ms, uint32_t conns) {
  long long warm = conns > 1 ? (long long)SXT_TCP_PAIR_DEPTH * BATCH * SXT_MIB : 0;
  long long stall = warm + 5 * SXT_MIB / 2;
  engage_from_one(conns == 1);
  pair *x = pair_start(2, conns, stall, -1);
  engage_from_one(0);
  if (warm > 0)
    sxt_tcp_pair_rounds(x, 1);
  uint64_t rx = sx__xpool_runs(SX__XJOB_RECV);
  sx_range_read e[BATCH];
  double t0 = now_s();
  sx_batch *b = submit(x, 0, 0, e, deadline_ms ? deadline_ms : 30000, NULL, NULL);
  assert_int_equal(sxt_proxy_wait_down(&x->px, stall, 5000), 0);
  wait_runs(SX__XJOB_RECV, rx);
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
  sxt_tcp_pair_dst_unmap(x);
  sxt_proxy_release(&x->px);
  assert_int_equal(sxt_proxy_wait_down(&x->px, warm + (long long)BATCH * SXT_MIB, 5000), 0);
  sxt_tcp_pair_dst_map(x);
  memset(x->dst, 0, x->dst_bytes);
  sx_batch *again = submit(x, 1, 1, e, 10000, NULL, NULL);
  res = sxt_batch_finish(again);
  if (res.state != SX_BATCH_COMPLETED)
    fail_msg("after the stall: %s: %s", sx_batch_state_name(res.state), res.message);
  sxt_tcp_pair_check(x, e);
  pair_stop(x);
}

static void test_tcp_threads_cancel_while_worker_waits(void **state) {
  (void)state;
  stall_then_end(0, 1);
  stall_then_end(0, 2);
}

static void test_tcp_threads_deadline_while_worker_waits(void **state) {
  (void)state;
  stall_then_end(1500, 1);
  stall_then_end(1500, 2);
}

/* The target dies 2.5 MiB into the replies, in the middle of a payload
 * a worker receives: the batch fails at once and names the peer. */
static void test_tcp_threads_peer_dies_mid_payload(void **state) {
  (void)state;
  pair *x = pair_start(2, 2, -1, 5 * SXT_MIB / 2);
  sx_range_read e[BATCH];
  double t0 = now_s();
  sx_batch_result res = sxt_batch_finish(submit(x, 0, 0, e, 10000, NULL, NULL));
  assert_true(now_s() - t0 < 5.0);
  assert_int_equal(res.state, SX_BATCH_FAILED);
  assert_int_equal(res.error, SX_EDISCONN);
  assert_non_null(strstr(res.message, "prefill-tcp"));
  assert_true(res.bytes < (uint64_t)BATCH * SXT_MIB);
  assert_true(__atomic_load_n(&x->px.dead, __ATOMIC_ACQUIRE));
  pair_stop(x);
}

static void check_ranges(const sxt_tcp_target *t, const uint8_t *dst, uint32_t n, uint32_t first) {
  for (uint32_t i = 0; i < n; i++)
    if (memcmp(dst + (uint64_t)i * SXT_MIB,
               t->pool + (uint64_t)((first + 3 * i) % SXT_TCP_PAIR_POOL) * SXT_MIB, SXT_MIB))
      fail_msg("range %u differs", i);
}

/* One thread on the reader, two targets: the first one's replies stall in
 * the middle of a payload that the reader's only worker receives.  A read
 * from the second target must not wait for them: its connection, waiting
 * for the thread, wakes the worker, which gives the stalled connection
 * back to the loop.  Once the stall ends the first read completes too. */
static void test_tcp_threads_reader_worker_gives_way(void **state) {
  (void)state;
  long long stall = SXT_MIB / 2;
  engage_from_one(1);
  pair *x = pair_start(1, 1, stall, -1);
  sxt_tcp_target tb;
  sxt_tcp_target_start(x, "prefill-b", &tb);
  engage_from_one(0);
  sx_segment *sb;
  sxt_ok(sx_segment_open(x->r, "prefill-b", 5000, &sb));
  uint64_t rx = sx__xpool_runs(SX__XJOB_RECV);
  sx_range_read e[BATCH];
  sx_batch *a = submit(x, 0, 0, e, 30000, NULL, NULL);
  assert_int_equal(sxt_proxy_wait_down(&x->px, stall, 5000), 0);
  wait_runs(SX__XJOB_RECV, rx);
  struct timespec ts = {0, 50 * 1000000};
  nanosleep(&ts, NULL);
  uint8_t *dst = x->dst + (uint64_t)BATCH * SXT_MIB; /* slot 1 */
  sx_batch_result res = sxt_batch_finish(sxt_tcp_ranges_submit(sb, &tb, dst, BATCH, 1, 5000));
  if (res.state != SX_BATCH_COMPLETED)
    fail_msg("second target: %s: %s", sx_batch_state_name(res.state), res.message);
  check_ranges(&tb, dst, BATCH, 1);
  sxt_proxy_release(&x->px);
  res = sxt_batch_finish(a);
  if (res.state != SX_BATCH_COMPLETED)
    fail_msg("first target: %s: %s", sx_batch_state_name(res.state), res.message);
  sxt_tcp_pair_check(x, e);
  sx_segment_close(sb);
  sxt_tcp_target_stop(&tb);
  pair_stop(x);
}

/* One thread on the target, two readers: the first one's connection stops
 * taking replies 64 KiB in (the proxy stalls it, with a small receive
 * buffer towards the target), so the target's only worker finds its
 * socket full.  The second reader's read must not wait for it: the worker
 * gives way and the loop sends the rest of that write when there is room.
 * Once the stall ends the first read completes, byte-exact. */
static void test_tcp_threads_target_worker_gives_way(void **state) {
  (void)state;
  sxt_tcp_pair_opts o = {.conns = 1, .batch = BATCH, .threads = 1, .thread_bytes = 64u << 10,
                         .stall = 64 << 10, .cut = -1, .first_only = 1,
                         .up_rcvbuf = 64 << 10};
  engage_from_one(1);
  pair *x = pair_start_opts(&o);
  uint64_t tx = sx__xpool_runs(SX__XJOB_SEND);
  sx_range_read e[BATCH];
  sx_batch *a = submit(x, 0, 0, e, 30000, NULL, NULL);
  assert_int_equal(sxt_proxy_wait_down(&x->px, o.stall, 5000), 0);
  for (int i = 0; i < 5000 && sx__xpool_runs(SX__XJOB_SEND) == tx; i++) {
    struct timespec ms = {0, 1000000};
    nanosleep(&ms, NULL);
  }
  assert_true(sx__xpool_runs(SX__XJOB_SEND) > tx);
  struct timespec ts = {0, 100 * 1000000};
  nanosleep(&ts, NULL); /* the worker waits for room by now */
  sx_agent *r2 = sxt_tcp_pair_reader(x, 1);
  engage_from_one(0);
  sx_segment *s2;
  sxt_ok(sx_segment_open(r2, "prefill-tcp", 5000, &s2));
  uint8_t *dst = x->dst + (uint64_t)BATCH * SXT_MIB; /* slot 1 */
  sx_batch_result res = sxt_batch_finish(sxt_tcp_ranges_submit(s2, &x->target, dst, BATCH, 2,
                                                               5000));
  if (res.state != SX_BATCH_COMPLETED)
    fail_msg("second reader: %s: %s", sx_batch_state_name(res.state), res.message);
  check_ranges(&x->target, dst, BATCH, 2);
  sxt_proxy_release(&x->px);
  res = sxt_batch_finish(a);
  if (res.state != SX_BATCH_COMPLETED)
    fail_msg("first reader: %s: %s", sx_batch_state_name(res.state), res.message);
  sxt_tcp_pair_check(x, e);
  sx_segment_close(s2);
  sx_agent_destroy(r2);
  pair_stop(x);
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
  long long stall = 3 * SXT_MIB / 2;
  engage_from_one(1);
  pair *x = pair_start(2, 1, stall, -1);
  engage_from_one(0);
  uint64_t rx = sx__xpool_runs(SX__XJOB_RECV);
  sx_range_read e[SXT_TCP_PAIR_DEPTH][BATCH];
  static int ended;
  ended = 0;
  for (uint32_t k = 0; k < SXT_TCP_PAIR_DEPTH; k++)
    submit(x, k, 0, e[k], 30000, count_shutdown, &ended);
  assert_int_equal(sxt_proxy_wait_down(&x->px, stall, 5000), 0);
  wait_runs(SX__XJOB_RECV, rx);
  struct timespec ts = {0, 50 * 1000000};
  nanosleep(&ts, NULL);
  /* The segment stays open: destroy closes it and ends the batches. */
  double t0 = now_s();
  sx_agent_destroy(x->r);
  x->r = NULL;
  x->seg = NULL;
  assert_true(now_s() - t0 < 5.0);
  assert_int_equal(__atomic_load_n(&ended, __ATOMIC_ACQUIRE), SXT_TCP_PAIR_DEPTH);
  munmap(x->dst, x->dst_bytes);
  x->dst = NULL;
  t0 = now_s();
  sx_agent_destroy(x->t);
  x->t = NULL;
  assert_true(now_s() - t0 < 5.0);
  pair_stop(x);
}

/* One connection per side busy (the reader's one, the target's one):
 * the loops move every payload, as without threads, and count them as
 * kept; two connections busy at once: the workers receive and send. */
static void test_tcp_threads_engage_from_two_busy_connections(void **state) {
  (void)state;
  uint64_t krx = sx__engage_kept(SX__XJOB_RECV), ktx = sx__engage_kept(SX__XJOB_SEND);
  rounds_without_workers(2, 1);
  /* Every reply (2 rounds of 3 batches of 8) stayed on the reader's loop. */
  assert_true(sx__engage_kept(SX__XJOB_RECV) - krx >= 2 * SXT_TCP_PAIR_DEPTH * BATCH);
  assert_true(sx__engage_kept(SX__XJOB_SEND) > ktx);
  engaged_round(2, 2);
}

/* SX_TCP_THREAD_CONNS: 1..1024 taken; anything else ignored (and said:
 * bad), leaving the default of two. */
static void test_tcp_threads_engage_setting(void **state) {
  (void)state;
  static const struct { const char *v; uint32_t want; int bad; } cases[] = {
      {"1", 1, 0}, {"3", 3, 0}, {"1024", 1024, 0}, {"", 2, 0}, {"0", 2, 1},
      {"1025", 2, 1}, {"-1", 2, 1}, {"2x", 2, 1}, {"x", 2, 1}};
  int bad;
  unsetenv("SX_TCP_THREAD_CONNS");
  assert_int_equal(sx__engage_conns(&bad), SX__ENGAGE_CONNS);
  assert_int_equal(bad, 0);
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    setenv("SX_TCP_THREAD_CONNS", cases[i].v, 1);
    assert_int_equal(sx__engage_conns(&bad), cases[i].want);
    assert_int_equal(bad, cases[i].bad);
  }
  unsetenv("SX_TCP_THREAD_CONNS");
}

/* A stream of batches from the pair's target, two in flight at all
 * times (slots 0 and 1, each cleared before it is read into again). */
typedef struct stream {
  pair *x;
  uint32_t k; /* batches submitted */
  sx_batch *b[2];
  sx_range_read e[2][BATCH];
} stream;

static void stream_submit(stream *s) {
  uint32_t slot = s->k % 2;
  memset(s->x->dst + (uint64_t)slot * BATCH * SXT_MIB, 0, (uint64_t)BATCH * SXT_MIB);
  s->b[slot] = submit(s->x, slot, s->k, s->e[slot], 10000, NULL, NULL);
  s->k++;
}

/* The oldest batch completes and is compared. */
static void stream_finish(stream *s) {
  uint32_t slot = s->k % 2;
  sx_batch_result res = sxt_batch_finish(s->b[slot]);
  if (res.state != SX_BATCH_COMPLETED)
    fail_msg("stream: %s: %s", sx_batch_state_name(res.state), res.message);
  sxt_tcp_pair_check(s->x, s->e[slot]);
}

static void stream_step(stream *s) {
  stream_finish(s);
  stream_submit(s);
}

/* A reader with one connection streams from one target, two batches in
 * flight at all times: its loop receives (kept, no worker).  A second
 * target's reads join: two connections are busy, and workers receive.
 * Once they ended, the stream goes on: the worker gives its connection
 * back within the hold, the loop receives again, and no worker starts
 * while the stream runs alone.  Every batch is compared byte for byte. */
static void test_tcp_threads_engage_switches_mid_stream(void **state) {
  (void)state;
  pair *x = pair_start(2, 1, -1, -1);
  sxt_tcp_target tb;
  sxt_tcp_target_start(x, "prefill-b", &tb);
  sx_segment *sb;
  sxt_ok(sx_segment_open(x->r, "prefill-b", 5000, &sb));
  uint8_t *dst_b = x->dst + 2ull * BATCH * SXT_MIB; /* slot 2 */
  stream st = {.x = x};
  stream_submit(&st);
  stream_submit(&st);

  uint64_t rx = sx__xpool_runs(SX__XJOB_RECV), krx = sx__engage_kept(SX__XJOB_RECV);
  for (int i = 0; i < 4; i++)
    stream_step(&st);
  assert_true(sx__xpool_runs(SX__XJOB_RECV) == rx);
  assert_true(sx__engage_kept(SX__XJOB_RECV) > krx);

  /* The second target's reads while the stream runs, until a worker took
   * one (each is 8 MiB against the stream's 16 MiB in flight: they
   * overlap, and at most a few rounds are needed). */
  for (int round = 0; round < 50 && sx__xpool_runs(SX__XJOB_RECV) == rx; round++) {
    memset(dst_b, 0, (uint64_t)BATCH * SXT_MIB);
    sx_batch *b = sxt_tcp_ranges_submit(sb, &tb, dst_b, BATCH, (uint32_t)round, 10000);
    stream_step(&st);
    sx_batch_result res = sxt_batch_finish(b);
    if (res.state != SX_BATCH_COMPLETED)
      fail_msg("second target: %s: %s", sx_batch_state_name(res.state), res.message);
    check_ranges(&tb, dst_b, BATCH, (uint32_t)round);
  }
  assert_true(sx__xpool_runs(SX__XJOB_RECV) > rx);

  /* The stream alone again: within the hold (and a notification of the
   * worker), the loop receives its payloads again. */
  krx = sx__engage_kept(SX__XJOB_RECV);
  double t0 = now_s();
  while (sx__engage_kept(SX__XJOB_RECV) == krx && now_s() - t0 < 10.0)
    stream_step(&st);
  assert_true(sx__engage_kept(SX__XJOB_RECV) > krx);
  /* From then on, no worker starts: one connection is busy. */
  stream_step(&st);
  rx = sx__xpool_runs(SX__XJOB_RECV);
  for (int i = 0; i < 4; i++)
    stream_step(&st);
  assert_true(sx__xpool_runs(SX__XJOB_RECV) == rx);
  stream_finish(&st); /* the two still in flight */
  st.k++;
  stream_finish(&st);
  sx_segment_close(sb);
  sxt_tcp_target_stop(&tb);
  pair_stop(x);
}

int main(void) {
  /* The agents' parameters decide here, not an environment meant for
   * other programs (the variables win over the parameters). */
  unsetenv("SX_TCP_THREADS");
  unsetenv("SX_TCP_THREAD_BYTES");
  unsetenv("SX_TCP_THREAD_CONNS");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_tcp_threads_connections_bytewise),
      cmocka_unit_test(test_tcp_threads_zero_means_none),
      cmocka_unit_test(test_tcp_threads_cancel_while_worker_waits),
      cmocka_unit_test(test_tcp_threads_deadline_while_worker_waits),
      cmocka_unit_test(test_tcp_threads_peer_dies_mid_payload),
      cmocka_unit_test(test_tcp_threads_reader_worker_gives_way),
      cmocka_unit_test(test_tcp_threads_target_worker_gives_way),
      cmocka_unit_test(test_tcp_threads_shutdown_with_workers_busy),
      cmocka_unit_test(test_tcp_threads_engage_setting),
      cmocka_unit_test(test_tcp_threads_engage_from_two_busy_connections),
      cmocka_unit_test(test_tcp_threads_engage_switches_mid_stream),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
