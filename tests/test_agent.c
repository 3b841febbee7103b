/*
 * The agent end to end inside one process: two agents on the mem:// store
 * talking over real loopback TCP.  Publish, open by name, layout check,
 * batched reads verified byte for byte, the wire checks (token,
 * incarnation, bounds), deadlines, cancel and batches from many threads.
 * What happens to agents over time (restarts, leases, takeover, region
 * retirement, opening a name not yet there) is in test_agent_lifecycle.c.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "backend.h"
#include "internal.h"
#include "pattern.h"

static int pattern_ok(const uint8_t *p, uint64_t len, uint64_t seed, uint32_t region,
                      uint64_t off) {
  return sx__pattern_check(p, len, seed, region, off, NULL);
}

static void new_url(char *url, size_t size) { sxt_mem_url(url, size, "agent"); }

/* Random-looking block reads that stay inside both pools. */
static void random_entries(sx_block_read *e, size_t n, uint32_t *rng) {
  for (size_t i = 0; i < n; i++) {
    *rng = *rng * 1103515245u + 12345u;
    uint32_t v = *rng >> 8;
    uint64_t count = 1 + v % 3;
    e[i] = (sx_block_read){.group = 0, .layer_first = v % SXT_LAYERS,
                           .layer_count = 1 + (v >> 4) % (SXT_LAYERS - v % SXT_LAYERS),
                           .slots = 1 + (v >> 9) % 3,
                           .remote_block = (v >> 12) % (SXT_TARGET_BLOCKS - count),
                           .local_block = (uint64_t)(i * 3) % (SXT_READER_BLOCKS - count),
                           .count = count};
  }
}

/* ------------------------------------------------------------ reads */

/* Pattern seeds (--fill, --verify): decimal or 0x hex, nothing else;
 * strtoull's blanks, signs and octal (010 would be 8) are refused. */
static void test_agent_pattern_seed_parse(void **state) {
  (void)state;
  static const struct {
    const char *s;
    uint64_t v;
  } good[] = {{"0", 0},          {"8", 8},   {"42", 42}, {"0x10", 16}, {"0XfF", 255},
              {"18446744073709551615", UINT64_MAX}, {"0xffffffffffffffff", UINT64_MAX}};
  static const char *bad[] = {"",   " 8",  "8 ",  "+8",   "-8",  "010",  "00", "0x",
                              "0x-1", "1e3", "8k", "0b1", "\t8", "0x1g",
                              "18446744073709551616", "0x10000000000000000"};
  for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
    uint64_t v = 7;
    if (sx__pattern_parse(good[i].s, &v) != 0 || v != good[i].v)
      fail_msg("'%s': %s, %lu", good[i].s, sx_errmsg(), (unsigned long)v);
  }
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    uint64_t v = 7;
    if (sx__pattern_parse(bad[i], &v) != SX_EINVAL || v != 7)
      fail_msg("'%s' was taken as %lu", bad[i], (unsigned long)v);
  }
  sxt_rc(sx__pattern_parse("18446744073709551616", &(uint64_t){0}), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "out of range"));
  sxt_rc(sx__pattern_parse("010", &(uint64_t){0}), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "leading zeros"));
}

static void test_agent_publish_open_check_and_read(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sxt_agent t, r;
  sxt_target_start(&t, url, "prefill-0", NULL, 42);
  sxt_reader_start(&r, url, "decode-0");

  sx_agent_status st;
  sxt_ok(sx_agent_status_get(t.a, &st));
  assert_int_equal(st.state, SX_AGENT_PUBLISHED);
  assert_int_equal(st.generation, 1);

  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "prefill-0", 1000, &seg));
  const sx_desc *d = sx_segment_desc(seg);
  assert_string_equal(d->name, "prefill-0");
  assert_int_equal(d->n_regions, 2);
  uint8_t inc[SX_INCARNATION_LEN];
  sx_agent_incarnation(t.a, inc);
  assert_memory_equal(d->incarnation, inc, SX_INCARNATION_LEN);
  assert_int_equal(sx_segment_transport(seg), SX_TRANSPORT_TCP);
  sx_mismatch m;
  sxt_ok(sx_segment_check(seg, 0, &m));
  assert_int_equal(m.kind, SX_MISMATCH_NONE);

  /* Many random batches across all regions, every byte checked. */
  uint32_t rng = 7;
  sx_block_read e[64];
  uint64_t total = 0;
  for (int round = 0; round < 20; round++) {
    random_entries(e, 64, &rng);
    memset(r.mem[0], 0, SXT_LAYERS * SXT_READER_BLOCKS * SXT_BLOCK);
    memset(r.mem[1], 0, SXT_LAYERS * SXT_READER_BLOCKS * SXT_BLOCK);
    for (int k = 0; k < 64; k += 16) {
      sx_batch_result res = sxt_run_batch(seg, e + k, 16, 10000);
      if (res.state != SX_BATCH_COMPLETED)
        fail_msg("batch %s: %s", sx_batch_state_name(res.state), res.message);
      assert_int_equal(res.error, 0);
      assert_int_equal(res.n_entries, 16);
      assert_int_equal(res.n_failed, 0);
      assert_true(res.n_ranges >= 1);
      assert_true(res.post_ns <= res.transfer_ns);
      assert_int_equal(res.transport, SX_TRANSPORT_TCP);
      uint64_t want = 0;
      for (int i = k; i < k + 16; i++)
        want += e[i].count * SXT_BLOCK * e[i].layer_count *
                (uint64_t)__builtin_popcountll(e[i].slots);
      assert_int_equal(res.bytes, want);
      total += res.bytes;
      /* Entries of one batch that write the same local block land in no
       * defined order (ranges run in parallel): check the others. */
      for (int i = k; i < k + 16; i++) {
        int shadowed = 0;
        for (int j = k; j < k + 16 && !shadowed; j++)
          shadowed = j != i && e[j].local_block < e[i].local_block + e[i].count &&
                     e[i].local_block < e[j].local_block + e[j].count &&
                     (e[i].slots & e[j].slots) &&
                     e[j].layer_first < e[i].layer_first + e[i].layer_count &&
                     e[i].layer_first < e[j].layer_first + e[j].layer_count;
        if (!shadowed)
          assert_int_equal(sxt_verify_blocks(&r, seg, 42, &e[i]), 0);
      }
    }
  }
  assert_true(total > 0);
  sxt_ok(sx_agent_status_get(t.a, &st));
  assert_true(st.served_reads > 0);
  assert_int_equal(st.served_errors, 0);

  /* A whole-layer read, K and V, the full local pool. */
  sx_block_read all = {.layer_first = 0, .layer_count = SXT_LAYERS, .slots = SXT_KV,
                       .remote_block = 5, .local_block = 0, .count = SXT_READER_BLOCKS};
  sx_batch_result res = sxt_run_batch(seg, &all, 1, 10000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(res.n_ranges, 2 * SXT_LAYERS);
  assert_int_equal(sxt_verify_blocks(&r, seg, 42, &all), 0);

  sx_segment_close(seg);
  sxt_agent_stop(&r);
  sxt_agent_stop(&t);
}

typedef struct cb_state {
  pthread_mutex_t mu;
  int calls;
  sx_batch_state state;
  int wait_rc, publish_rc;
} cb_state;

static void batch_cb(sx_batch *b, void *arg) {
  cb_state *s = arg;
  sx_batch_result res;
  /* Calls that wait fail on the agent thread; the result is already there. */
  int wait_rc = sx_batch_wait(b, 0);
  sxt_ok(sx_batch_result_get(b, &res));
  pthread_mutex_lock(&s->mu);
  s->calls++;
  s->state = res.state;
  s->wait_rc = wait_rc;
  pthread_mutex_unlock(&s->mu);
}

/* The store's watch was set up again (on a Redis Cluster: a slot moved or
 * a master failed over, and events may have been missed): the reader's
 * cache forgets what it holds, and the next open asks the store. */
static void test_agent_cache_flushed_when_the_watch_is_set_up_again(void **state) {
  (void)state;
  char url[64], name[64];
  new_url(url, sizeof(url));
  snprintf(name, sizeof(name), "%s", url + strlen("mem://"));
  name[strcspn(name, "?")] = '\0';
  sxt_agent t, r;
  sxt_target_start(&t, url, "prefill-0", NULL, 42);
  sxt_reader_start(&r, url, "decode-0");
  sx_segment *seg;
  sx_agent_stats st;
  sxt_ok(sx_segment_open(r.a, "prefill-0", 1000, &seg));
  sx_segment_close(seg);
  sxt_ok(sx_segment_open(r.a, "prefill-0", 1000, &seg));
  sx_segment_close(seg);
  sxt_ok(sx_agent_stats_get(r.a, &st, sizeof(st)));
  assert_int_equal(st.cache_entries, 1);
  assert_true(st.cache_hits >= 1);
  uint64_t misses = st.cache_misses;
  sx__mem_rewatch(name);
  /* on_watch arrives on the reader's loop: until then opens are hits;
   * the first open after it asks the store.  The entry's TTL (the 2 s
   * lease) outlasts the wait: only the flush makes an open miss here. */
  uint64_t t0 = sx__mono_ms();
  do {
    uv_sleep(10);
    sxt_ok(sx_segment_open(r.a, "prefill-0", 1000, &seg));
    sx_segment_close(seg);
    sxt_ok(sx_agent_stats_get(r.a, &st, sizeof(st)));
  } while (st.cache_misses == misses && sx__mono_ms() - t0 < 1000);
  assert_int_equal(st.cache_misses, misses + 1);
  /* And it is cached again. */
  sxt_ok(sx_segment_open(r.a, "prefill-0", 1000, &seg));
  sx_segment_close(seg);
  sxt_ok(sx_agent_stats_get(r.a, &st, sizeof(st)));
  assert_int_equal(st.cache_misses, misses + 1);
  sxt_agent_stop(&r);
  sxt_agent_stop(&t);
}

static void test_agent_range_reads_callback_and_eventfd(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sxt_agent t, r;
  sxt_target_start(&t, url, "prefill-1", NULL, 1234);
  sxt_reader_start(&r, url, NULL); /* reader-only: no name, no listener */
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "prefill-1", 1000, &seg));
  /* Raw ranges into plain (unregistered) memory: fine over TCP. */
  size_t len = 3 * 1024 * 1024 + 17;
  uint8_t *dst = malloc(len);
  sx_range_read rr[3] = {
      {.local = dst, .remote_region = t.id[1], .offset = 1, .length = 100},
      {.local = dst + 100, .remote_region = t.id[1], .offset = 101, .length = 1000},
      {.local = dst + 4096, .remote_region = t.id[0], .offset = 4096,
       .length = SXT_LAYERS * SXT_TARGET_BLOCKS * SXT_BLOCK - 4096},
  };
  cb_state cs = {.mu = PTHREAD_MUTEX_INITIALIZER};
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.cb = batch_cb;
  bp.cb_arg = &cs;
  sx_batch *b;
  sxt_ok(sx_batch_create(seg, &bp, &b));
  sxt_ok(sx_batch_add_ranges(b, rr, 3));
  int fd = sx_batch_fd(b);
  assert_true(fd >= 0);
  assert_int_equal(sx_batch_poll(b), SX_EBUSY);
  sx_batch_result res;
  assert_int_equal(sx_batch_result_get(b, &res), SX_EBUSY);
  sxt_ok(sx_batch_submit(b));
  sxt_rc(sx_batch_submit(b), SX_EINVAL);
  sxt_rc(sx_batch_add_ranges(b, rr, 1), SX_EINVAL);
  struct pollfd pfd = {.fd = fd, .events = POLLIN};
  assert_int_equal(poll(&pfd, 1, 10000), 1);
  sxt_ok(sx_batch_poll(b));
  sxt_ok(sx_batch_wait(b, 0));
  sxt_ok(sx_batch_result_get(b, &res));
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(res.n_entries, 3);
  /* The first two entries are contiguous on both sides: one range. */
  assert_int_equal(res.bytes, 100 + 1000 + rr[2].length);
  assert_int_equal(cs.calls, 1);
  assert_int_equal(cs.state, SX_BATCH_COMPLETED);
  assert_int_equal(cs.wait_rc, SX_EBUSY);
  assert_int_equal(pattern_ok(dst, 1100, 1234, t.id[1], 1), 0);
  assert_int_equal(pattern_ok(dst + 4096, rr[2].length, 1234, t.id[0], 4096),
                   0);
  sx_batch_destroy(b);

  /* An empty batch completes at once, and so does its callback. */
  cs.calls = 0;
  sxt_ok(sx_batch_create(seg, &bp, &b));
  sxt_ok(sx_batch_submit(b));
  sxt_ok(sx_batch_wait(b, 10000));
  sxt_ok(sx_batch_result_get(b, &res));
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(res.bytes, 0);
  assert_int_equal(cs.calls, 1);
  sx_batch_destroy(b);
  /* A batch never submitted is just freed. */
  sxt_ok(sx_batch_create(seg, NULL, &b));
  sxt_rc(sx_batch_wait(b, 0), SX_EINVAL);
  sxt_rc(sx_batch_cancel(b), SX_EINVAL);
  sx_batch_destroy(b);
  free(dst);
  sx_segment_close(seg);
  sxt_agent_stop(&r);
  sxt_agent_stop(&t);
}

/* ------------------------------------------------------------ checks */

static void test_agent_check_reports_mismatch(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sxt_agent t;
  sxt_target_start(&t, url, "prefill-2", NULL, 1);
  sx_agent_params p;
  sxt_params(&p, url, "decode-2");
  sx_agent *a;
  sxt_ok(sx_agent_create(&p, &a));
  uint8_t *mem = calloc(1, 1 << 20);
  sx_region_params rp = {.addr = mem, .length = 1 << 20, .layer_count = SXT_LAYERS,
                         .layer_stride = 1 << 18, .slot = SX_SLOT_K, .block_bytes = 2048,
                         .num_blocks = 128};
  uint32_t id;
  sxt_ok(sx_agent_register(a, &rp, &id));
  rp.slot = SX_SLOT_V;
  rp.addr = mem; /* the same memory twice is fine, the same key is not */
  sxt_ok(sx_agent_register(a, &rp, &id));
  sxt_rc(sx_agent_register(a, &rp, &id), SX_EOVERLAP);
  rp.block_stride = 1024; /* below block_bytes */
  rp.slot = SX_SLOT_INDEX;
  sxt_rc(sx_agent_register(a, &rp, &id), SX_ESTRIDE);
  rp.block_stride = 0;
  rp.num_blocks = 1000; /* beyond the memory */
  sxt_rc(sx_agent_register(a, &rp, &id), SX_EBOUNDS);
  sx_segment *seg;
  sxt_ok(sx_segment_open(a, "prefill-2", 1000, &seg));
  sx_mismatch m;
  sxt_rc(sx_segment_check(seg, 0, &m), SX_EINCOMPAT);
  assert_int_equal(m.kind, SX_MISMATCH_BLOCK_BYTES);
  assert_non_null(strstr(m.message, "local 2048, remote 4096"));
  /* Reads that would need equal block sizes are refused before sending. */
  sx_batch *b;
  sxt_ok(sx_batch_create(seg, NULL, &b));
  sx_block_read e = {.layer_count = 1, .slots = SXT_KV, .count = 1};
  sxt_rc(sx_batch_add_blocks(b, &e, 1), SX_EINCOMPAT);
  sx_batch_destroy(b);
  sx_segment_close(seg);
  sx_agent_destroy(a);
  free(mem);
  sxt_agent_stop(&t);
}

/* ------------------------------------------------------------ wire */

static void test_agent_wire_rejects_bad_requests_and_keeps_serving(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sxt_agent t, r;
  sxt_target_start(&t, url, "prefill-3", NULL, 99);
  sxt_reader_start(&r, url, "decode-3");
  sx_desc d;
  sxt_ok(sx_agent_descriptor(t.a, &d));
  uint16_t port = sxt_tcp_port(&d);
  uint8_t bad[SX_TOKEN_LEN];
  memcpy(bad, d.token, sizeof(bad));
  bad[3] ^= 0x40;

  /* A wrong token: refused with SX_EACCESS, then closed. */
  int fd = sxt_wire_connect(port);
  assert_int_equal(sxt_wire_hello(fd, d.incarnation, bad, "mallory"), SX_EACCESS);
  assert_true(sxt_wire_closed(fd));
  close(fd);
  /* The incarnation of someone else: SX_ESTALE. */
  uint8_t other[SX_INCARNATION_LEN];
  memcpy(other, d.incarnation, sizeof(other));
  other[0] ^= 1;
  fd = sxt_wire_connect(port);
  assert_int_equal(sxt_wire_hello(fd, other, d.token, "old-reader"), SX_ESTALE);
  assert_true(sxt_wire_closed(fd));
  close(fd);
  /* A READ before HELLO, or garbage: closed without an answer. */
  fd = sxt_wire_connect(port);
  uint8_t buf[8192];
  assert_int_equal(sxt_wire_read(fd, 1, t.id[0], 0, 16, buf), 1);
  close(fd);
  fd = sxt_wire_connect(port);
  memset(buf, 0x5a, 64);
  assert_int_equal(send(fd, buf, 64, MSG_NOSIGNAL), 64);
  assert_true(sxt_wire_closed(fd));
  close(fd);

  /* A good connection: bad requests are answered and it keeps serving. */
  fd = sxt_wire_connect(port);
  sxt_ok(sxt_wire_hello(fd, d.incarnation, d.token, "tester"));
  uint64_t len = d.regions[0].length;
  assert_int_equal(sxt_wire_read(fd, 1, t.id[0], len - 10, 11, buf), SX_EBOUNDS);
  assert_int_equal(sxt_wire_read(fd, 2, t.id[0], UINT64_MAX - 3, 8, buf), SX_EBOUNDS);
  assert_int_equal(sxt_wire_read(fd, 3, 777, 0, 8, buf), SX_ENOREGION);
  assert_int_equal(sxt_wire_read(fd, 4, t.id[0], 0, 0, buf), SX_EINVAL);
  assert_int_equal(sxt_wire_read(fd, 5, t.id[0], 0, 1ull << 40, buf), SX_ELIMIT);
  sxt_ok(sxt_wire_read(fd, 6, t.id[1], len - 4096, 4096, buf));
  assert_int_equal(pattern_ok(buf, 4096, 99, t.id[1], len - 4096), 0);
  /* Pipelined: several requests before reading any reply. */
  for (uint64_t i = 0; i < 8; i++)
    sxt_ok(sxt_wire_read(fd, 10 + i, t.id[0], i * 512, 512, buf));
  close(fd);

  /* Meanwhile the agent API reader is served as usual. */
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "prefill-3", 1000, &seg));
  sx_block_read e = {.layer_count = SXT_LAYERS, .slots = SXT_KV, .remote_block = 3,
                     .local_block = 1, .count = 8};
  sx_batch_result res = sxt_run_batch(seg, &e, 1, 10000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(sxt_verify_blocks(&r, seg, 99, &e), 0);
  sx_agent_status st;
  sxt_ok(sx_agent_status_get(t.a, &st));
  assert_true(st.served_errors >= 7);
  sx_segment_close(seg);
  sx_desc_free(&d);
  sxt_agent_stop(&r);
  sxt_agent_stop(&t);
}

static void test_agent_read_with_bad_token_fails_with_eaccess(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sxt_agent t, r;
  sxt_target_start(&t, url, "prefill-4", NULL, 5);
  sxt_reader_start(&r, url, "decode-4");
  /* A forged descriptor: the target's endpoint and incarnation, but not its
   * token (what a reader without the store's copy would present). */
  sx_desc d;
  sxt_ok(sx_agent_descriptor(t.a, &d));
  snprintf(d.name, sizeof(d.name), "forged-4");
  d.token[0] ^= 0xff;
  d.generation = 1;
  sxt_store_publish(url, &d);
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "forged-4", 1000, &seg));
  sx_block_read e = {.layer_count = 1, .slots = SXT_KV, .count = 1};
  memset(r.mem[0], 0xee, SXT_BLOCK);
  sx_batch_result res = sxt_run_batch(seg, &e, 1, 10000);
  assert_int_equal(res.state, SX_BATCH_FAILED);
  assert_int_equal(res.error, SX_EACCESS);
  assert_int_equal(res.n_failed, 1);
  assert_non_null(strstr(res.message, "access token"));
  /* Nothing was written. */
  for (size_t i = 0; i < SXT_BLOCK; i++)
    assert_int_equal(r.mem[0][i], 0xee);
  /* Later batches on this segment fail at once with the same error. */
  res = sxt_run_batch(seg, &e, 1, 10000);
  assert_int_equal(res.error, SX_EACCESS);
  sx_segment_close(seg);
  sx_desc_free(&d);
  sxt_agent_stop(&r);
  sxt_agent_stop(&t);
}

/* Regression: the agent's thread writes to sockets with write(2) (libuv),
 * which raises SIGPIPE on a connection the peer has reset, and nothing
 * guarded against it: a process that had not set SIGPIPE to SIG_IGN itself
 * (most engines; this test binary) died when a peer went away mid-write
 * (test_push_tcp did, now and then, under ASan).  Here a write to a broken
 * socket from the agent's thread (a batch callback) must fail with EPIPE
 * and leave the process alive. */
static void write_broken_socket(sx_batch *b, void *arg) {
  (void)b;
  int *err = arg, sv[2];
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  close(sv[1]);
  ssize_t w = write(sv[0], "x", 1);
  *err = w < 0 ? errno : 0;
  close(sv[0]);
}

static void test_agent_thread_survives_writes_to_broken_sockets(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sxt_agent t, r;
  sxt_target_start(&t, url, "prefill-5", NULL, 3);
  sxt_reader_start(&r, url, "decode-5");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "prefill-5", 1000, &seg));
  sx_block_read e = {.layer_count = 1, .slots = SXT_KV, .count = 1};
  int err = -1;
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.cb = write_broken_socket;
  bp.cb_arg = &err;
  sx_batch *b;
  sxt_ok(sx_batch_create(seg, &bp, &b));
  sxt_ok(sx_batch_add_blocks(b, &e, 1));
  sxt_ok(sx_batch_submit(b));
  sxt_ok(sx_batch_wait(b, 10000));
  assert_int_equal(err, EPIPE);
  sx_batch_destroy(b);
  sx_segment_close(seg);
  sxt_agent_stop(&r);
  sxt_agent_stop(&t);
}

/* ------------------------------------------------------------ calls */

typedef struct submitter {
  sx_segment *seg;
  int n, ok;
} submitter;

/* n batches of one block, each submitted alone and waited for 2 s at
 * most: a submit that waits for a wake that never comes sits until the
 * lease timer's next turn (seconds) and fails the wait. */
static void *submit_one_at_a_time(void *arg) {
  submitter *s = arg;
  sx_block_read e = {.layer_count = 1, .slots = SXT_KV, .count = 1};
  for (int i = 0; i < s->n; i++) {
    sx_batch *b;
    if (sx_batch_create(s->seg, NULL, &b) != 0)
      return NULL;
    e.remote_block = e.local_block = (uint64_t)i % 8;
    sx_batch_result res = {.state = SX_BATCH_FAILED};
    int waited = sx_batch_add_blocks(b, &e, 1) == 0 && sx_batch_submit(b) == 0 &&
                 sx_batch_wait(b, 2000) == 0;
    if (waited)
      sx_batch_result_get(b, &res);
    sx_batch_destroy(b);
    if (res.state != SX_BATCH_COMPLETED)
      return NULL;
    s->ok++;
  }
  return NULL;
}

/* A caller wakes the loop only while it may sleep (call.c): a busy loop
 * takes the calls queued meanwhile just before it polls.  Every batch
 * reaches the loop, from one thread (the loop mostly asleep between
 * batches) and from four at once (mostly busy). */
static void test_agent_calls_reach_a_busy_or_sleeping_loop(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sxt_agent t, r;
  sxt_target_start(&t, url, "prefill-c", NULL, 8);
  sxt_reader_start(&r, url, "decode-c");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "prefill-c", 1000, &seg));
  submitter one = {.seg = seg, .n = 3000};
  submit_one_at_a_time(&one);
  assert_int_equal(one.ok, one.n);
  submitter many[4];
  pthread_t th[4];
  for (int k = 0; k < 4; k++) {
    many[k] = (submitter){.seg = seg, .n = 750};
    assert_int_equal(pthread_create(&th[k], NULL, submit_one_at_a_time, &many[k]), 0);
  }
  for (int k = 0; k < 4; k++) {
    pthread_join(th[k], NULL);
    assert_int_equal(many[k].ok, many[k].n);
  }
  sx_segment_close(seg);
  sxt_agent_stop(&r);
  sxt_agent_stop(&t);
}

/* ------------------------------------------------------------ deadlines */

/* A "target" that accepts connections (the kernel does) and never answers. */
static int silent_listener(uint16_t *port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
  assert_int_equal(listen(fd, 16), 0);
  socklen_t len = sizeof(sa);
  getsockname(fd, (struct sockaddr *)&sa, &len);
  *port = ntohs(sa.sin_port);
  return fd;
}

static void publish_silent(const char *url, const char *name, uint16_t port) {
  sx_desc d;
  sxt_desc_kv(&d, name, SXT_LAYERS, 0, SXT_BLOCK, SXT_TARGET_BLOCKS, 0);
  snprintf(d.layout.fingerprint, sizeof(d.layout.fingerprint), "llama-test/v1");
  snprintf(d.endpoints[0].addr, sizeof(d.endpoints[0].addr), "127.0.0.1");
  d.endpoints[0].port = port;
  d.lease_ms = 60000;
  sxt_store_publish(url, &d);
  sx_desc_free(&d);
}

static void test_agent_deadline_ends_batch_with_timeout(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  uint16_t port;
  int lfd = silent_listener(&port);
  publish_silent(url, "silent-0", port);
  sxt_agent r;
  sxt_reader_start(&r, url, "decode-6");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "silent-0", 1000, &seg));
  sx_block_read e[2] = {{.layer_count = 2, .slots = SXT_KV, .count = 2},
                        {.layer_count = 1, .slots = SXT_KV, .remote_block = 9,
                         .local_block = 9, .count = 1}};
  uint64_t t0 = sx__mono_ms();
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = 300;
  sx_batch *b;
  sxt_ok(sx_batch_create(seg, &bp, &b));
  sxt_ok(sx_batch_add_blocks(b, e, 2));
  sxt_ok(sx_batch_submit(b));
  sxt_rc(sx_batch_wait(b, 50), SX_ETIMEDOUT); /* still running */
  sxt_ok(sx_batch_wait(b, 20000));
  uint64_t took = sx__mono_ms() - t0;
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  assert_int_equal(res.state, SX_BATCH_TIMEOUT);
  assert_int_equal(res.error, SX_ETIMEDOUT);
  assert_int_equal(res.bytes, 0);
  assert_int_equal(res.n_failed, 2);
  assert_int_equal(res.failed[0], 0);
  assert_int_equal(res.failed[1], 1);
  assert_non_null(strstr(res.message, "deadline"));
  assert_true(took >= 290);
  assert_true(took < 10000);
  sx_batch_destroy(b);
  sx_segment_close(seg);
  sxt_agent_stop(&r);
  close(lfd);
}

/* Regression: a batch's deadline timer counted from the loop's cached time,
 * which is as old as the loop iteration.  When an earlier call of the same
 * iteration was slow (here a log sink that blocks), the batch ended TIMEOUT
 * that much before its deadline. */
static atomic_int slow_log_armed;

static void slow_log(void *arg, sx_log_level level, const char *msg) {
  (void)arg;
  (void)level;
  if (atomic_load(&slow_log_armed) && strstr(msg, "opened slow-1") != NULL) {
    atomic_store(&slow_log_armed, 0);
    usleep(400 * 1000);
  }
}

typedef struct blocker {
  atomic_int in_cb;
  atomic_int release;
} blocker;

/* A batch callback that holds the loop until released. */
static void block_loop(sx_batch *b, void *arg) {
  (void)b;
  blocker *k = arg;
  atomic_store(&k->in_cb, 1);
  while (!atomic_load(&k->release))
    usleep(1000);
}

static void open_ignored(void *arg, int status, sx_segment *seg) {
  (void)arg;
  (void)status;
  sx_segment_close(seg);
}

static void test_agent_deadline_holds_after_a_slow_loop_iteration(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  uint16_t port;
  int lfd = silent_listener(&port);
  publish_silent(url, "slow-0", port);
  publish_silent(url, "slow-1", port);
  sxt_agent r;
  memset(&r, 0, sizeof(r));
  sx_agent_params p;
  sxt_params(&p, url, "decode-slow");
  p.log = slow_log;
  p.log_level = SX_LOG_DEBUG;
  sxt_ok(sx_agent_create(&p, &r.a));
  sx_segment *seg, *other;
  sxt_ok(sx_segment_open(r.a, "slow-0", 1000, &seg));
  sxt_ok(sx_segment_open(r.a, "slow-1", 1000, &other)); /* cached from now on */
  sx_segment_close(other);
  uint8_t one;
  sx_range_read rr = {.local = &one, .remote_region = 0, .offset = 0, .length = 1};
  /* Batch A's callback holds the loop while the next calls queue up. */
  blocker k = {0};
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = 50;
  bp.cb = block_loop;
  bp.cb_arg = &k;
  sx_batch *a, *b;
  sxt_ok(sx_batch_create(seg, &bp, &a));
  sxt_ok(sx_batch_add_ranges(a, &rr, 1));
  sxt_ok(sx_batch_submit(a));
  while (!atomic_load(&k.in_cb))
    usleep(1000);
  /* Two calls the loop takes together: an open whose log line blocks 400 ms,
   * then a batch with a 600 ms deadline. */
  atomic_store(&slow_log_armed, 1);
  sxt_ok(sx_segment_open_async(r.a, "slow-1", 1000, open_ignored, NULL));
  sx_batch_params_init(&bp);
  bp.timeout_ms = 600;
  sxt_ok(sx_batch_create(seg, &bp, &b));
  sxt_ok(sx_batch_add_ranges(b, &rr, 1));
  uint64_t t0 = sx__mono_ms();
  sxt_ok(sx_batch_submit(b));
  atomic_store(&k.release, 1);
  sxt_ok(sx_batch_wait(b, 20000));
  uint64_t took = sx__mono_ms() - t0;
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  assert_int_equal(res.state, SX_BATCH_TIMEOUT);
  if (took < 590)
    fail_msg("a batch with a 600 ms deadline ended TIMEOUT after %lu ms",
             (unsigned long)took);
  sx_batch_destroy(b);
  sx_batch_destroy(a);
  sx_segment_close(seg);
  sx_agent_destroy(r.a);
  close(lfd);
}

static void test_agent_cancel_ends_batch_cancelled(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  uint16_t port;
  int lfd = silent_listener(&port);
  publish_silent(url, "silent-1", port);
  sxt_agent r;
  sxt_reader_start(&r, url, "decode-7");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "silent-1", 1000, &seg));
  sx_block_read e = {.layer_count = 1, .slots = SXT_KV, .count = 1};
  cb_state cs = {.mu = PTHREAD_MUTEX_INITIALIZER};
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.cb = batch_cb;
  bp.cb_arg = &cs;
  sx_batch *b;
  sxt_ok(sx_batch_create(seg, &bp, &b));
  sxt_ok(sx_batch_add_blocks(b, &e, 1));
  sxt_ok(sx_batch_submit(b));
  sxt_ok(sx_batch_cancel(b));
  sxt_ok(sx_batch_cancel(b)); /* twice is fine */
  sxt_ok(sx_batch_wait(b, 20000));
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  assert_int_equal(res.state, SX_BATCH_CANCELLED);
  assert_int_equal(res.error, SX_ECANCELED);
  assert_int_equal(cs.calls, 1);
  assert_int_equal(cs.state, SX_BATCH_CANCELLED);
  sx_batch_destroy(b);
  /* Destroying a running batch cancels and waits for it. */
  sxt_ok(sx_batch_create(seg, &bp, &b));
  sxt_ok(sx_batch_add_blocks(b, &e, 1));
  sxt_ok(sx_batch_submit(b));
  sx_batch_destroy(b);
  assert_int_equal(cs.calls, 2);
  sx_segment_close(seg);
  sxt_agent_stop(&r);
  close(lfd);
}

/* Regression: fire-and-forget batches (a callback that destroys its own
 * batch) still in flight when the agent is destroyed with their segment
 * left open.  Shutdown closed the segment first, and the callbacks that
 * ran afterwards freed their batches through it: a use after free. */
static void destroy_in_cb(sx_batch *b, void *arg) {
  atomic_int *calls = arg;
  sx_batch_result res;
  if (sx_batch_result_get(b, &res) == 0 && res.state == SX_BATCH_FAILED &&
      res.error == SX_ESHUTDOWN)
    atomic_fetch_add(calls, 1);
  sx_batch_destroy(b);
}

static void test_agent_destroy_ends_self_destroying_batches_of_open_segments(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  uint16_t port;
  int lfd = silent_listener(&port);
  publish_silent(url, "silent-2", port);
  sxt_agent r;
  sxt_reader_start(&r, url, "decode-8");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "silent-2", 1000, &seg));
  sx_block_read e = {.layer_count = 1, .slots = SXT_KV, .count = 1};
  atomic_int calls = 0;
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.cb = destroy_in_cb;
  bp.cb_arg = &calls;
  for (int i = 0; i < 3; i++) {
    sx_batch *b;
    sxt_ok(sx_batch_create(seg, &bp, &b));
    sxt_ok(sx_batch_add_blocks(b, &e, 1));
    sxt_ok(sx_batch_submit(b));
  }
  usleep(50 * 1000); /* posted to the silent target */
  sxt_agent_stop(&r); /* the segment is left open: destroy closes it */
  assert_int_equal(atomic_load(&calls), 3);
  close(lfd);
}

/* Regression: a segment closed under its batches (a misuse the agent logs)
 * freed what they still read: the batch in flight ended through freed
 * memory, and one submitted afterwards started on a freed peer.  Both now
 * end with an error and are destroyed as usual. */
static void test_agent_segment_closed_under_its_batches(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  uint16_t port;
  int lfd = silent_listener(&port);
  publish_silent(url, "silent-3", port);
  sxt_agent r;
  sxt_reader_start(&r, url, "decode-9");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "silent-3", 1000, &seg));
  sx_block_read e = {.layer_count = 1, .slots = SXT_KV, .count = 1};
  sx_batch *running = sxt_batch_submit(seg, &e, 1, 20000), *later;
  sxt_ok(sx_batch_create(seg, NULL, &later));
  sxt_ok(sx_batch_add_blocks(later, &e, 1));
  usleep(50 * 1000); /* posted to the silent target */
  sx_segment_close(seg);
  sxt_ok(sx_batch_wait(running, 10000));
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(running, &res));
  assert_int_equal(res.state, SX_BATCH_FAILED);
  assert_int_equal(res.error, SX_ECANCELED);
  sxt_ok(sx_batch_submit(later));
  sxt_ok(sx_batch_wait(later, 10000));
  sxt_ok(sx_batch_result_get(later, &res));
  assert_int_equal(res.state, SX_BATCH_FAILED);
  assert_int_equal(res.error, SX_EINVAL);
  assert_non_null(strstr(res.message, "segment was closed"));
  sx_batch_destroy(running);
  sx_batch_destroy(later);
  sxt_agent_stop(&r);
  close(lfd);
}

/* ------------------------------------------------------------ threads */

typedef struct worker {
  sx_segment *seg;
  sxt_agent *r;
  int slot;
  int ok;
} worker;

static void *worker_main(void *arg) {
  worker *w = arg;
  w->ok = 1;
  for (int i = 0; i < 30 && w->ok; i++) {
    /* Each worker owns one slot of the local pool, so checks do not race. */
    sx_block_read e = {.layer_first = (uint32_t)(i % SXT_LAYERS), .layer_count = 1,
                       .slots = 1ull << w->slot, .remote_block = (uint64_t)(i * 7 % 60),
                       .local_block = (uint64_t)(i % 28), .count = 4};
    sx_batch *b;
    if (sx_batch_create(w->seg, NULL, &b) || sx_batch_add_blocks(b, &e, 1) ||
        sx_batch_submit(b) || sx_batch_wait(b, -1)) {
      w->ok = 0;
      break;
    }
    sx_batch_result res;
    sx_batch_result_get(b, &res);
    w->ok = res.state == SX_BATCH_COMPLETED && sxt_verify_blocks(w->r, w->seg, 77, &e) == 0;
    sx_batch_destroy(b);
  }
  return NULL;
}

static void test_agent_batches_from_many_threads(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sxt_agent t, r;
  sxt_target_start(&t, url, "prefill-12", NULL, 77);
  sxt_reader_start(&r, url, "decode-12");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "prefill-12", 1000, &seg));
  pthread_t th[2];
  worker w[2];
  for (int i = 0; i < 2; i++) {
    w[i] = (worker){.seg = seg, .r = &r, .slot = i};
    pthread_create(&th[i], NULL, worker_main, &w[i]);
  }
  for (int i = 0; i < 2; i++) {
    pthread_join(th[i], NULL);
    assert_true(w[i].ok);
  }
  sx_segment_close(seg);
  sxt_agent_stop(&r);
  sxt_agent_stop(&t);
}

int main(void) {
  /* sx_batch_wait spins before it sleeps here (its default only on hosts of
   * 8 or more CPUs): the waits below, the 50 ms timeout among them, run
   * through the spin.  The other suites take the host's default. */
  setenv("SX_WAIT_SPIN_US", "2000", 0);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_agent_pattern_seed_parse),
      cmocka_unit_test(test_agent_calls_reach_a_busy_or_sleeping_loop),
      cmocka_unit_test(test_agent_publish_open_check_and_read),
      cmocka_unit_test(test_agent_cache_flushed_when_the_watch_is_set_up_again),
      cmocka_unit_test(test_agent_range_reads_callback_and_eventfd),
      cmocka_unit_test(test_agent_check_reports_mismatch),
      cmocka_unit_test(test_agent_wire_rejects_bad_requests_and_keeps_serving),
      cmocka_unit_test(test_agent_read_with_bad_token_fails_with_eaccess),
      cmocka_unit_test(test_agent_thread_survives_writes_to_broken_sockets),
      cmocka_unit_test(test_agent_deadline_ends_batch_with_timeout),
      cmocka_unit_test(test_agent_deadline_holds_after_a_slow_loop_iteration),
      cmocka_unit_test(test_agent_cancel_ends_batch_cancelled),
      cmocka_unit_test(test_agent_destroy_ends_self_destroying_batches_of_open_segments),
      cmocka_unit_test(test_agent_segment_closed_under_its_batches),
      cmocka_unit_test(test_agent_batches_from_many_threads),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
