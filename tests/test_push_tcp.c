/*
 * Push mode over TCP inside one process (mem:// store, loopback): writes
 * that land byte-exact before their notice, refusals that land nothing
 * (through the API and as raw frames), many producers into one consumer,
 * and a deadline while payload is stuck in the socket.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "internal.h"
#include "notice.h"
#include "push_fixture.h"
#include "transport/conn/frame.h"

static sx_agent *self_remover_agent; /* for remove_self() */

static void test_push_tcp_writes_land_then_the_notice_arrives(void **state) {
  (void)state;
  sxt_pair x;
  sxt_pair_start(&x, SXT_RW);
  sxt_pair_grant(&x);
  int fd = sx_agent_notice_fd(x.c.a);
  sx_block_write w[3] = {sxt_kv_write(0, 10, 4), sxt_kv_write(20, 14, 2),
                         sxt_kv_write(63, 0, 1)};
  sx_batch_result r = sxt_run_write(x.seg, w, 3, 77, 5000);
  if (r.state != SX_BATCH_COMPLETED)
    fail_msg("write batch %s: %s", sx_batch_state_name(r.state), r.message);
  assert_int_equal(r.bytes, 7 * SXT_LAYERS * 2 * SXT_BLOCK);
  assert_int_equal(r.transport, SX_TRANSPORT_TCP);
  /* COMPLETED means the consumer holds the notice already. */
  assert_true(sxt_fd_readable(fd));
  for (int i = 0; i < 3; i++)
    assert_int_equal(sxt_verify_write(&x.c, &x.p, &w[i]), 0);
  sxt_expect_notice(x.c.a, &x.p, "prefill-0", 77, w, 3, 0);
  sx_block_write untouched = sxt_kv_write(0, 30, 10);
  assert_int_equal(sxt_blocks_zero(&x.c, &untouched), 0);
  sx_agent_stats st;
  sxt_ok(sx_agent_stats_get(x.c.a, &st, sizeof(st)));
  assert_int_equal(st.served_write_bytes[SX_TRANSPORT_TCP], r.bytes);
  assert_int_equal(st.notices, 1);
  /* The producer counts what it wrote as written, not as read. */
  sxt_ok(sx_agent_stats_get(x.p.a, &st, sizeof(st)));
  assert_int_equal(st.written_bytes[SX_TRANSPORT_TCP], r.bytes);
  assert_int_equal(st.read_bytes[SX_TRANSPORT_TCP], 0);
  assert_int_equal(st.write_batches[SX_BATCH_COMPLETED], 1);
  assert_int_equal(st.batches[SX_BATCH_COMPLETED], 1);
  char *text, line[128];
  sxt_ok(sx_agent_metrics_text(x.p.a, &text, NULL));
  snprintf(line, sizeof(line), "\nsegxfer_written_bytes_total{transport=\"tcp\"} %lu\n",
           (unsigned long)r.bytes);
  assert_non_null(strstr(text, line));
  assert_non_null(strstr(text, "\nsegxfer_write_batches_total{result=\"completed\"} 1\n"));
  assert_non_null(strstr(text, "\nsegxfer_read_bytes_total{transport=\"tcp\"} 0\n"));
  free(text);
  sxt_ok(sx_agent_metrics_text(x.c.a, &text, NULL));
  snprintf(line, sizeof(line), "\nsegxfer_served_write_bytes_total{transport=\"tcp\"} %lu\n",
           (unsigned long)r.bytes);
  assert_non_null(strstr(text, line));
  assert_non_null(strstr(text, "\nsegxfer_notices_total 1\n"));
  free(text);
  /* An empty write batch is only its notice ("nothing to send"). */
  r = sxt_run_write(x.seg, NULL, 0, 78, 5000);
  assert_int_equal(r.state, SX_BATCH_COMPLETED);
  sxt_expect_notice(x.c.a, &x.p, "prefill-0", 78, NULL, 0, 1000);
  sxt_pair_stop(&x);
}

static void test_push_tcp_refused_writes_land_nothing(void **state) {
  (void)state;
  sxt_pair x;
  sxt_pair_start(&x, SXT_RW);
  sx_block_write w = sxt_kv_write(0, 5, 3);
  /* No grant. */
  sx_batch_result r = sxt_run_write(x.seg, &w, 1, 1, 5000);
  assert_int_equal(r.state, SX_BATCH_FAILED);
  assert_int_equal(r.error, SX_EACCESS);
  assert_non_null(strstr(r.message, "no write grant"));
  assert_int_equal(sxt_blocks_zero(&x.c, &w), 0);
  sxt_expect_no_notice(x.c.a);
  /* A grant for another incarnation of the name. */
  uint8_t other[SX_INCARNATION_LEN] = {9, 9, 9};
  sxt_ok(sx_agent_grant_write(x.c.a, "prefill-0", other));
  r = sxt_run_write(x.seg, &w, 1, 2, 5000);
  assert_int_equal(r.error, SX_EACCESS);
  assert_int_equal(sxt_blocks_zero(&x.c, &w), 0);
  /* Granted: the next batch reconnects and lands. */
  sxt_pair_grant(&x);
  r = sxt_run_write(x.seg, &w, 1, 3, 5000);
  assert_int_equal(r.state, SX_BATCH_COMPLETED);
  assert_int_equal(sxt_verify_write(&x.c, &x.p, &w), 0);
  sxt_expect_notice(x.c.a, &x.p, "prefill-0", 3, &w, 1, 0);
  /* Revoked: refused on the same connections, with the reason; reading
   * that consumer still works. */
  sxt_ok(sx_agent_revoke_write(x.c.a, "prefill-0", NULL));
  sx_block_write w2 = sxt_kv_write(10, 20, 2);
  r = sxt_run_write(x.seg, &w2, 1, 4, 5000);
  assert_int_equal(r.state, SX_BATCH_FAILED);
  assert_int_equal(r.error, SX_EACCESS);
  assert_non_null(strstr(r.message, "refused a write of region"));
  assert_int_equal(sxt_blocks_zero(&x.c, &w2), 0);
  sxt_expect_no_notice(x.c.a);
  sx_block_read rd = {.layer_count = 1, .slots = SXT_KV, .remote_block = 5, .local_block = 0,
                      .count = 1};
  sx_batch_result rr = sxt_run_batch(x.seg, &rd, 1, 5000);
  assert_int_equal(rr.state, SX_BATCH_COMPLETED);
  /* Granted again: the same connections take writes again. */
  sxt_pair_grant(&x);
  r = sxt_run_write(x.seg, &w2, 1, 5, 5000);
  assert_int_equal(r.state, SX_BATCH_COMPLETED);
  assert_int_equal(sxt_verify_write(&x.c, &x.p, &w2), 0);
  sxt_expect_notice(x.c.a, &x.p, "prefill-0", 5, &w2, 1, 0);
  sxt_pair_stop(&x);
}

static void test_push_tcp_stale_consumer_gets_nothing(void **state) {
  (void)state;
  sxt_pair x;
  sxt_pair_start(&x, SXT_RW);
  /* The consumer restarts under its name and address: a new incarnation. */
  sx_desc d;
  sxt_ok(sx_agent_descriptor(x.c.a, &d));
  char listen[32];
  snprintf(listen, sizeof(listen), "127.0.0.1:%u", sxt_tcp_port(&d));
  sx_desc_free(&d);
  sxt_agent_stop(&x.c);
  memset(&x.c, 0, sizeof(x.c));
  sx_agent_params p;
  sxt_params(&p, x.url, "decode-0");
  p.listen = listen;
  sxt_ok(sx_agent_create(&p, &x.c.a));
  sxt_register_kv(&x.c, SXT_CONSUMER_BLOCKS, SXT_RW);
  sxt_ok(sx_agent_publish(x.c.a, 0));
  sxt_ok(sx_agent_grant_write(x.c.a, NULL, NULL));
  sx_block_write w = sxt_kv_write(0, 0, 8);
  sx_batch_result r = sxt_run_write(x.seg, &w, 1, 1, 5000);
  assert_int_equal(r.state, SX_BATCH_FAILED);
  assert_int_equal(r.error, SX_ESTALE);
  assert_int_equal(sxt_blocks_zero(&x.c, &w), 0);
  sxt_expect_no_notice(x.c.a);
  sxt_pair_stop(&x);
}

/* A producer that skips the planner: raw frames, each refused before any
 * byte lands, the connection serving on. */
static void test_push_tcp_wire_refusals(void **state) {
  (void)state;
  sxt_pair x;
  sxt_pair_start(&x, SXT_RW);
  /* One more region, readable only. */
  uint8_t *ro = calloc(1, 8192);
  sx_region_params rp = {.addr = ro, .length = 8192, .layer_count = 1, .slot = 7,
                         .block_bytes = 4096, .num_blocks = 2,
                         .access = SX_ACCESS_REMOTE_READ};
  uint32_t ro_id;
  sxt_ok(sx_agent_register(x.c.a, &rp, &ro_id));
  sxt_ok(sx_agent_publish(x.c.a, 0));
  sx_desc cd, pd;
  sxt_ok(sx_agent_descriptor(x.c.a, &cd));
  sxt_ok(sx_agent_descriptor(x.p.a, &pd));
  uint16_t port = sxt_tcp_port(&cd);
  uint8_t data[4096];
  memset(data, 0xab, sizeof(data));
  uint32_t k = x.c.id[0];
  uint64_t region_len = SXT_LAYERS * SXT_CONSUMER_BLOCKS * SXT_BLOCK;

  int fd = sxt_wire_connect(port);
  assert_int_equal(sxt_wire_hello(fd, cd.incarnation, cd.token, "prefill-0"), 0);
  /* Writes before WAUTH. */
  assert_int_equal(sxt_wire_write(fd, 2, k, 0, data, sizeof(data)), SX_EACCESS);
  /* WAUTH with a token that is not the producer's. */
  uint8_t bad[SX_TOKEN_LEN];
  memcpy(bad, pd.token, sizeof(bad));
  bad[0] ^= 1;
  assert_int_equal(sxt_wire_wauth(fd, pd.incarnation, bad), SX_EACCESS);
  /* The right token, but no grant. */
  assert_int_equal(sxt_wire_wauth(fd, pd.incarnation, pd.token), SX_EACCESS);
  close(fd);
  sxt_ok(sx_agent_grant_write(x.c.a, "prefill-0", NULL));
  fd = sxt_wire_connect(port);
  assert_int_equal(sxt_wire_hello(fd, cd.incarnation, cd.token, "prefill-0"), 0);
  /* Someone else's incarnation under the producer's name. */
  uint8_t inc2[SX_INCARNATION_LEN];
  memcpy(inc2, pd.incarnation, sizeof(inc2));
  inc2[3] ^= 0x40;
  assert_int_equal(sxt_wire_wauth(fd, inc2, pd.token), SX_EACCESS);
  close(fd);
  fd = sxt_wire_connect(port);
  assert_int_equal(sxt_wire_hello(fd, cd.incarnation, cd.token, "prefill-0"), 0);
  assert_int_equal(sxt_wire_wauth(fd, pd.incarnation, pd.token), 0);
  assert_int_equal(sxt_wire_write(fd, 3, ro_id, 0, data, sizeof(data)), SX_EDENIED);
  assert_int_equal(sxt_wire_write(fd, 4, k, region_len - 100, data, sizeof(data)), SX_EBOUNDS);
  assert_int_equal(sxt_wire_write(fd, 5, k, UINT64_MAX - 10, data, sizeof(data)), SX_EBOUNDS);
  assert_int_equal(sxt_wire_write(fd, 6, 999, 0, data, sizeof(data)), SX_ENOREGION);
  assert_int_equal(sxt_wire_write(fd, 7, k, 0, data, 0), SX_EINVAL);
  for (size_t i = 0; i < 8192; i++)
    assert_int_equal(ro[i], 0);
  for (uint64_t i = 0; i < region_len; i++)
    if (x.c.mem[0][i] != 0)
      fail_msg("byte %lu of K was written", (unsigned long)i);
  /* Notices must describe writable memory and name the connection. */
  const uint8_t junk[3] = {1, 2, 3};
  assert_int_equal(sxt_wire_notice(fd, 8, junk, sizeof(junk)), SX_EDECODE);
  sx_notice *n = sx__notice_alloc(0, 1);
  snprintf(n->producer, sizeof(n->producer), "prefill-9");
  memcpy(n->incarnation, pd.incarnation, SX_INCARNATION_LEN);
  n->bytes = 16;
  sx__notice_ranges(n)[0] = (sx_notice_range){.region = k, .offset = 0, .length = 16};
  uint8_t *buf;
  size_t len;
  sxt_ok(sx__notice_encode(n, &buf, &len));
  assert_int_equal(sxt_wire_notice(fd, 9, buf, len), SX_EPROTO);
  free(buf);
  snprintf(n->producer, sizeof(n->producer), "prefill-0");
  sx__notice_ranges(n)[0].region = ro_id;
  sxt_ok(sx__notice_encode(n, &buf, &len));
  assert_int_equal(sxt_wire_notice(fd, 10, buf, len), SX_EDENIED);
  free(buf);
  sxt_expect_no_notice(x.c.a);
  /* And a good write and notice still go through on this connection. */
  assert_int_equal(sxt_wire_write(fd, 11, k, 4096, data, 16), 0);
  assert_int_equal(x.c.mem[0][4096 + 15], 0xab);
  assert_int_equal(x.c.mem[0][4096 + 16], 0);
  sx__notice_ranges(n)[0] = (sx_notice_range){.region = k, .offset = 4096, .length = 16};
  sxt_ok(sx__notice_encode(n, &buf, &len));
  assert_int_equal(sxt_wire_notice(fd, 12, buf, len), 0);
  free(buf);
  sx_notice_free(n);
  sxt_ok(sx_agent_notice_next(x.c.a, 0, &n));
  assert_int_equal(n->n_ranges, 1);
  assert_int_equal(n->ranges[0].offset, 4096);
  sx_notice_free(n);
  /* A WRITE longer than the limit closes the connection. */
  uint8_t hdr[SX__FRAME_HDR];
  sx__frame f = {.type = SX__FRAME_WRITE, .id = 13, .region = k, .length = 1ull << 40};
  sx__frame_encode(&f, hdr);
  assert_int_equal(sxt_wire_send(fd, hdr, sizeof(hdr)), 0);
  assert_int_equal(sxt_wire_closed(fd), 1);
  close(fd);
  sx_desc_free(&cd);
  sx_desc_free(&pd);
  sxt_pair_stop(&x);
  free(ro);
}

static void test_push_many_producers_into_one_consumer(void **state) {
  (void)state;
  sxt_push_many_producers(SX_TRANSPORT_TCP);
}

/* ------------------------------------------------------------ deadline */

/* A consumer that accepts the producer, then never reads again. */
typedef struct stall {
  int lfd, fd;
} stall;

static void *stall_main(void *arg) {
  stall *st = arg;
  st->fd = accept(st->lfd, NULL, NULL);
  uint8_t buf[SX__FRAME_HDR + SX__HELLO_MAX];
  for (int i = 0; i < 2; i++) { /* HELLO, then WAUTH */
    sx__frame f;
    if (sxt_wire_recv(st->fd, buf, SX__FRAME_HDR) ||
        sx__frame_decode(buf, SX__FRAME_HDR, &f) != SX__FRAME_HDR ||
        sxt_wire_recv(st->fd, buf, (size_t)f.length))
      return NULL;
    sx__frame r = {.type = i == 0 ? SX__FRAME_HELLO_REPLY : SX__FRAME_WAUTH_REPLY, .id = f.id};
    sx__frame_encode(&r, buf);
    sxt_wire_send(st->fd, buf, SX__FRAME_HDR);
  }
  return NULL;
}

static void test_push_tcp_deadline_with_payload_stuck_in_the_socket(void **state) {
  (void)state;
  char url[64];
  sxt_mem_url(url, sizeof(url), "push");
  stall st = {.fd = -1};
  st.lfd = sxt_fake_target(url, "stuck-0", SXT_CONSUMER_BLOCKS, SXT_RW);
  sxt_agent p;
  sxt_target_start(&p, url, "prefill-0", NULL, 3);
  sx_segment *seg;
  sxt_ok(sx_segment_open(p.a, "stuck-0", 2000, &seg));
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, stall_main, &st), 0);
  /* 4 layers x 2 slots x 48 blocks x 4 KiB = 1.5 MiB: more than loopback
   * socket buffers take without a reader. */
  sx_block_write w = sxt_kv_write(0, 0, SXT_CONSUMER_BLOCKS);
  uint64_t t0 = sx__mono_ms();
  sx_batch *b = sxt_write_submit(seg, &w, 1, 9, 400);
  sxt_ok(sx_batch_wait(b, 20000));
  sx_batch_result r;
  sxt_ok(sx_batch_result_get(b, &r));
  assert_int_equal(r.state, SX_BATCH_TIMEOUT);
  assert_true(sx__mono_ms() - t0 < 5000);
  sx_batch_destroy(b);
  pthread_join(th, NULL);
  sx_segment_close(seg);
  sxt_agent_stop(&p);
  if (st.fd >= 0)
    close(st.fd);
  close(st.lfd);
}

/* ------------------------------------------------------------ racing the queue */

/* A notice callback that holds the consumer's loop until released. */
typedef struct held_cb {
  atomic_int in_cb, release, calls;
} held_cb;

static int hold_notice(void *arg, const sx_notice *n) {
  (void)n;
  held_cb *h = arg;
  atomic_fetch_add(&h->calls, 1);
  atomic_store(&h->in_cb, 1);
  while (!atomic_load(&h->release))
    usleep(1000);
  return 1;
}

typedef struct cb_remover {
  sx_agent *a;
  atomic_int returned;
} cb_remover;

static void *remove_cb(void *arg) {
  cb_remover *r = arg;
  sxt_ok(sx_agent_notice_cb(r->a, NULL, NULL));
  atomic_store(&r->returned, 1);
  return NULL;
}

/* A callback that removes itself from the agent thread (must not wait). */
static int remove_self(void *arg, const sx_notice *n) {
  (void)n;
  atomic_int *calls = arg;
  atomic_fetch_add(calls, 1);
  sxt_ok(sx_agent_notice_cb(self_remover_agent, NULL, NULL));
  return 1;
}

/* Regression: removing the notice callback returned while the loop was
 * still inside it, so an engine that freed the callback's state after
 * sx_agent_notice_cb(a, NULL, NULL) had it used after free. */
static void test_push_notice_cb_removal_waits_for_a_running_callback(void **state) {
  (void)state;
  sxt_pair x;
  sxt_pair_start(&x, SXT_RW);
  sxt_pair_grant(&x);
  held_cb h = {0};
  sxt_ok(sx_agent_notice_cb(x.c.a, hold_notice, &h));
  sx_block_write w = sxt_kv_write(0, 1, 1);
  sx_batch *b = sxt_write_submit(x.seg, &w, 1, 5, 10000);
  while (!atomic_load(&h.in_cb))
    usleep(1000);
  cb_remover r = {.a = x.c.a};
  pthread_t th;
  pthread_create(&th, NULL, remove_cb, &r);
  usleep(200 * 1000);
  assert_int_equal(atomic_load(&r.returned), 0); /* the callback still runs */
  atomic_store(&h.release, 1);
  pthread_join(th, NULL);
  assert_int_equal(atomic_load(&r.returned), 1);
  sxt_ok(sx_batch_wait(b, 10000));
  sx_batch_destroy(b);
  /* Removed: the next notice is queued, the old callback not called. */
  sx_batch_result res = sxt_run_write(x.seg, &w, 1, 6, 10000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(atomic_load(&h.calls), 1);
  sxt_expect_notice(x.c.a, &x.p, "prefill-0", 6, &w, 1, 1000);
  /* From the callback itself it does not wait (no deadlock). */
  atomic_int calls = 0;
  self_remover_agent = x.c.a;
  sxt_ok(sx_agent_notice_cb(x.c.a, remove_self, &calls));
  res = sxt_run_write(x.seg, &w, 1, 7, 10000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  res = sxt_run_write(x.seg, &w, 1, 8, 10000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(atomic_load(&calls), 1);
  sxt_expect_notice(x.c.a, &x.p, "prefill-0", 8, &w, 1, 1000);
  sxt_pair_stop(&x);
}

/* CPU 0 kept busy by a spinner until the agent's destroy returned, and
 * the waiters confined to it at the lowest priority (SCHED_IDLE): they
 * hardly run again before the destroy, on the other CPUs, is over. */
static atomic_int destroyed;

static void on_cpu0(void) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(0, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

static void *spin(void *arg) {
  (void)arg;
  on_cpu0();
  while (!atomic_load(&destroyed))
    ;
  return NULL;
}

typedef struct waiter {
  sx_agent *a;
  int rc;
} waiter;

static void *wait_notice(void *arg) {
  waiter *w = arg;
  struct sched_param sp = {0};
  on_cpu0();
  pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp);
  sx_notice *n;
  w->rc = sx_agent_notice_next(w->a, -1, &n);
  return NULL;
}

/* Regression: sx_agent_destroy() woke threads waiting in
 * sx_agent_notice_next() and freed the queue without waiting for them to
 * leave; one that got the CPU late took a freed mutex and read freed
 * memory (ASan: heap-use-after-free in sx_agent_notice_next). */
static void test_push_destroy_waits_for_notice_waiters_to_leave(void **state) {
  (void)state;
  char url[64];
  sxt_mem_url(url, sizeof(url), "push");
  sxt_agent c;
  sxt_consumer_start(&c, url, "decode-0", SXT_RW);
  enum { WAITERS = 4 };
  waiter w[WAITERS];
  pthread_t th[WAITERS], spinner;
  for (int i = 0; i < WAITERS; i++) {
    w[i] = (waiter){.a = c.a, .rc = 1};
    pthread_create(&th[i], NULL, wait_notice, &w[i]);
  }
  usleep(100 * 1000); /* waiting now */
  int busy = sysconf(_SC_NPROCESSORS_ONLN) > 1;
  if (busy)
    pthread_create(&spinner, NULL, spin, NULL);
  sxt_agent_stop(&c);
  atomic_store(&destroyed, 1);
  if (busy)
    pthread_join(spinner, NULL);
  for (int i = 0; i < WAITERS; i++) {
    pthread_join(th[i], NULL);
    assert_int_equal(w[i].rc, SX_ESHUTDOWN);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_push_tcp_writes_land_then_the_notice_arrives),
      cmocka_unit_test(test_push_tcp_refused_writes_land_nothing),
      cmocka_unit_test(test_push_tcp_stale_consumer_gets_nothing),
      cmocka_unit_test(test_push_tcp_wire_refusals),
      cmocka_unit_test(test_push_many_producers_into_one_consumer),
      cmocka_unit_test(test_push_tcp_deadline_with_payload_stuck_in_the_socket),
      cmocka_unit_test(test_push_notice_cb_removal_waits_for_a_running_callback),
      cmocka_unit_test(test_push_destroy_waits_for_notice_waiters_to_leave),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
