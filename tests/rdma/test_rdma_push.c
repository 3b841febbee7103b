/*
 * Push mode over RDMA, where an RDMA device exists (the Soft-RoCE VM, or
 * real hardware): RDMA WRITE batches and their notices between agents in
 * this process (mem:// store); refusals that land nothing, including keys
 * the device itself must refuse (forged descriptors); many producers into
 * one consumer; a deadline in the middle of a batch.  With a real
 * redis-server: `sxctl write` into `sx-agent --writable`, and a producer
 * process killed in the middle of a batch.  Every write must go over RDMA.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "mem/mem.h"
#include "pattern.h"
#include "ports.h"
#include "proc_env.h"
#include "push_fixture.h"

static sxt_proc_env env;

/* The pair of push_fixture.h, its segment over RDMA. */
static void pair_start(sxt_pair *x, uint32_t access) {
  sxt_pair_start(x, access);
  if (sx_segment_transport(x->seg) != SX_TRANSPORT_RDMA)
    fail_msg("decode-0 would be written over %s, not RDMA (is there an RDMA device here?)",
             sx_segment_transport(x->seg) == SX_TRANSPORT_TCP ? "TCP" : "nothing");
}

static void expect_completed(const sx_batch_result *r) {
  if (r->state != SX_BATCH_COMPLETED)
    fail_msg("write batch %s: %s (%s)", sx_batch_state_name(r->state), r->message,
             sx_err_name(r->error));
  assert_int_equal(r->transport, SX_TRANSPORT_RDMA);
}

/* A fixture agent on 127.0.0.1 with no regions yet, its RDMA slices cut to
 * slice bytes and conns QPs per peer (0: the defaults). */
static void agent_new(sxt_agent *x, const char *url, const char *name, uint32_t slice,
                      uint32_t conns) {
  memset(x, 0, sizeof(*x));
  sx_agent_params p;
  sxt_params(&p, url, name);
  p.listen = "127.0.0.1:0";
  p.rdma_slice_bytes = slice;
  p.conns_per_peer = conns;
  sxt_ok(sx_agent_create(&p, &x->a));
}

/* A producer with the pool of a fixture target (seed). */
static void producer_start(sxt_agent *p, const char *url, const char *name, uint64_t seed,
                           uint32_t slice, uint32_t conns) {
  agent_new(p, url, name, slice, conns);
  sxt_register_kv(p, SXT_TARGET_BLOCKS, SX_ACCESS_REMOTE_READ);
  p->seed = seed;
  for (int s = 0; s < 2; s++)
    sx__pattern_fill(p->mem[s], SXT_LAYERS * SXT_TARGET_BLOCKS * SXT_BLOCK, seed, p->id[s], 0);
  sxt_ok(sx_agent_publish(p->a, 0));
}

static sx_batch *write_batch(sx_segment *s, uint64_t tag) {
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.flags = SX_BATCH_WRITE;
  bp.tag = tag;
  bp.timeout_ms = 20000;
  sx_batch *b;
  sxt_ok(sx_batch_create(s, &bp, &b));
  return b;
}

static sx_batch_result run(sx_batch *b) {
  sx_batch_result r;
  sxt_ok(sx_batch_submit(b));
  sxt_ok(sx_batch_wait(b, -1));
  sxt_ok(sx_batch_result_get(b, &r));
  r.failed = NULL;
  sx_batch_destroy(b);
  return r;
}

/* ------------------------------------------------------------ writes */

static void test_rdma_push_writes_land_then_the_notice_arrives(void **state) {
  (void)state;
  sxt_pair x;
  pair_start(&x, SXT_RW);
  sxt_pair_grant(&x);
  int fd = sx_agent_notice_fd(x.c.a);
  /* Blocks. */
  sx_block_write w[3] = {sxt_kv_write(0, 10, 4), sxt_kv_write(20, 14, 2),
                         sxt_kv_write(63, 0, 1)};
  sx_batch_result r = sxt_run_write(x.seg, w, 3, 77, 20000);
  expect_completed(&r);
  assert_int_equal(r.bytes, 7 * SXT_LAYERS * 2 * SXT_BLOCK);
  assert_true(sxt_fd_readable(fd)); /* COMPLETED: the consumer holds the notice */
  for (int i = 0; i < 3; i++)
    assert_int_equal(sxt_verify_write(&x.c, &x.p, &w[i]), 0);
  sxt_expect_notice(x.c.a, &x.p, "prefill-0", 77, w, 3, 0);
  sx_block_write untouched = sxt_kv_write(0, 30, 10);
  assert_int_equal(sxt_blocks_zero(&x.c, &untouched), 0);
  /* Bytes: an odd range from registered memory to an odd offset. */
  sx_batch *b = write_batch(x.seg, 78);
  const uint64_t off = 20 * SXT_BLOCK + 17; /* in blocks 20-22, not written so far */
  sx_range_write rw = {.local = x.p.mem[1] + 5, .remote_region = x.c.id[0], .offset = off,
                       .length = 10007};
  sxt_ok(sx_batch_add_range_writes(b, &rw, 1));
  expect_completed((r = run(b), &r));
  assert_memory_equal(x.c.mem[0] + off, x.p.mem[1] + 5, 10007);
  assert_int_equal(x.c.mem[0][off - 1], 0);
  assert_int_equal(x.c.mem[0][off + 10007], 0);
  sx_notice *n;
  sxt_ok(sx_agent_notice_next(x.c.a, 0, &n));
  assert_int_equal(n->tag, 78);
  assert_int_equal(n->transport, SX_TRANSPORT_RDMA);
  assert_int_equal(n->n_ranges, 1);
  assert_int_equal(n->ranges[0].region, x.c.id[0]);
  assert_int_equal(n->ranges[0].offset, off);
  assert_int_equal(n->ranges[0].length, 10007);
  sx_notice_free(n);
  /* Block ids as an engine keeps them: merged into runs. */
  uint64_t local[] = {30, 31, 32, 40}, remote[] = {40, 41, 42, 47};
  sx_block_ids ids = {.layer_count = SXT_LAYERS, .slots = SXT_KV, .local = local,
                      .n_local = 4, .remote = remote, .n_remote = 4};
  b = write_batch(x.seg, 79);
  sxt_ok(sx_batch_add_block_ids(b, &ids));
  expect_completed((r = run(b), &r));
  sx_block_write runs[2] = {sxt_kv_write(30, 40, 3), sxt_kv_write(40, 47, 1)};
  for (int i = 0; i < 2; i++)
    assert_int_equal(sxt_verify_write(&x.c, &x.p, &runs[i]), 0);
  sxt_expect_notice(x.c.a, &x.p, "prefill-0", 79, runs, 2, 0);
  /* The producer counts RDMA WRITEs as written bytes (the consumer sees
   * none: they are one-sided), the consumer its notices. */
  sx_agent_stats st;
  sxt_ok(sx_agent_stats_get(x.p.a, &st, sizeof(st)));
  assert_int_equal(st.written_bytes[SX_TRANSPORT_RDMA],
                   (7 + 3 + 1) * SXT_LAYERS * 2 * SXT_BLOCK + 10007);
  assert_int_equal(st.read_bytes[SX_TRANSPORT_RDMA], 0);
  assert_int_equal(st.write_batches[SX_BATCH_COMPLETED], 3);
  sxt_ok(sx_agent_stats_get(x.c.a, &st, sizeof(st)));
  assert_int_equal(st.notices, 3);
  assert_int_equal(st.served_write_bytes[SX_TRANSPORT_RDMA], 0);
  /* An empty write batch is its notice alone. */
  r = sxt_run_write(x.seg, NULL, 0, 80, 20000);
  assert_int_equal(r.state, SX_BATCH_COMPLETED);
  sxt_expect_notice(x.c.a, &x.p, "prefill-0", 80, NULL, 0, 1000);
  sxt_expect_no_notice(x.c.a);
  sxt_pair_stop(&x);
}

/* Large ranges cut into many slices over several QPs: every byte lands
 * before the notice. */
static void test_rdma_push_sliced_over_several_qps(void **state) {
  (void)state;
  sxt_pair x;
  pair_start(&x, SXT_RW);
  sxt_ok(sx_agent_grant_write(x.c.a, NULL, NULL));
  sxt_agent p;
  producer_start(&p, x.url, "prefill-slices", 4711, 1000, 4);
  sx_segment *seg;
  sxt_ok(sx_segment_open(p.a, "decode-0", 5000, &seg));
  sx_block_write w = sxt_kv_write(16, 0, SXT_CONSUMER_BLOCKS);
  for (int round = 0; round < 3; round++) {
    memset(x.c.mem[0], 0, SXT_LAYERS * SXT_CONSUMER_BLOCKS * SXT_BLOCK);
    memset(x.c.mem[1], 0, SXT_LAYERS * SXT_CONSUMER_BLOCKS * SXT_BLOCK);
    sx_batch_result r = sxt_run_write(seg, &w, 1, 900 + (uint64_t)round, 30000);
    expect_completed(&r);
    assert_true(r.n_ranges >= 8);
    sxt_expect_notice(x.c.a, &p, "prefill-slices", 900 + (uint64_t)round, &w, 1, 0);
    assert_int_equal(sxt_verify_write(&x.c, &p, &w), 0);
  }
  sx_segment_close(seg);
  sxt_agent_stop(&p);
  sxt_pair_stop(&x);
}

/* ------------------------------------------------------------ refusals */

static void expect_refused(sx_batch_result r, int code, const char *text) {
  if (r.state != SX_BATCH_FAILED || r.error != code)
    fail_msg("expected FAILED with %s, got %s with %s: %s", sx_err_name(code),
             sx_batch_state_name(r.state), sx_err_name(r.error), r.message);
  if (text != NULL && strstr(r.message, text) == NULL)
    fail_msg("the message '%s' lacks '%s'", r.message, text);
}

static void test_rdma_push_refused_writes_land_nothing(void **state) {
  (void)state;
  sxt_pair x;
  pair_start(&x, SXT_RW);
  sx_block_write w = sxt_kv_write(0, 5, 3);
  /* No grant: the connect request is rejected, no QP can name a key. */
  expect_refused(sxt_run_write(x.seg, &w, 1, 1, 20000), SX_EACCESS, "refused our writes");
  assert_int_equal(sxt_blocks_zero(&x.c, &w), 0);
  sxt_expect_no_notice(x.c.a);
  /* A grant for another incarnation of the name. */
  uint8_t other[SX_INCARNATION_LEN] = {9, 9, 9};
  sxt_ok(sx_agent_grant_write(x.c.a, "prefill-0", other));
  expect_refused(sxt_run_write(x.seg, &w, 1, 2, 20000), SX_EACCESS, NULL);
  assert_int_equal(sxt_blocks_zero(&x.c, &w), 0);
  /* Granted: the next batch connects and lands. */
  sxt_pair_grant(&x);
  expect_completed((sx_batch_result[]){sxt_run_write(x.seg, &w, 1, 3, 20000)});
  assert_int_equal(sxt_verify_write(&x.c, &x.p, &w), 0);
  sxt_expect_notice(x.c.a, &x.p, "prefill-0", 3, &w, 1, 0);
  /* Revoked: the consumer destroyed the producer's QPs before the revoke
   * returned; the next batch finds them gone, the one after is refused. */
  sxt_ok(sx_agent_revoke_write(x.c.a, "prefill-0", NULL));
  sx_block_write w2 = sxt_kv_write(10, 20, 2);
  sx_batch_result r = sxt_run_write(x.seg, &w2, 1, 4, 20000);
  assert_int_equal(r.state, SX_BATCH_FAILED);
  if (r.error != SX_EDISCONN && r.error != SX_EACCESS && r.error != SX_ERDMA)
    fail_msg("after a revoke: %s: %s", sx_err_name(r.error), r.message);
  expect_refused(sxt_run_write(x.seg, &w2, 1, 5, 20000), SX_EACCESS, "refused our writes");
  assert_int_equal(sxt_blocks_zero(&x.c, &w2), 0);
  sxt_expect_no_notice(x.c.a);
  /* Reading that consumer over RDMA is not affected. */
  sx_block_read rd = {.layer_count = 1, .slots = SXT_KV, .remote_block = 5, .count = 1};
  sx_batch_result rr = sxt_run_batch(x.seg, &rd, 1, 20000);
  assert_int_equal(rr.state, SX_BATCH_COMPLETED);
  assert_int_equal(rr.transport, SX_TRANSPORT_RDMA);
  /* Granted again: writes land again. */
  sxt_pair_grant(&x);
  expect_completed((sx_batch_result[]){sxt_run_write(x.seg, &w2, 1, 6, 20000)});
  assert_int_equal(sxt_verify_write(&x.c, &x.p, &w2), 0);
  sxt_expect_notice(x.c.a, &x.p, "prefill-0", 6, &w2, 1, 0);
  /* Planning refusals: block counts that differ. */
  uint64_t l3[] = {1, 2, 3}, r2[] = {1, 2};
  sx_block_ids ids = {.layer_count = 1, .slots = SXT_KV, .local = l3, .n_local = 3,
                      .remote = r2, .n_remote = 2};
  sx_batch *b = write_batch(x.seg, 7);
  sxt_rc(sx_batch_add_block_ids(b, &ids), SX_EINCOMPAT);
  sx_batch_destroy(b);
  sxt_pair_stop(&x);
}

static void test_rdma_push_read_only_and_stale_are_refused(void **state) {
  (void)state;
  /* A read-only consumer: no write key, the planner refuses. */
  sxt_pair x;
  pair_start(&x, SX_ACCESS_REMOTE_READ);
  sxt_ok(sx_agent_grant_write(x.c.a, NULL, NULL));
  assert_int_equal(sx_segment_desc(x.seg)->regions[0].n_wkeys, 0);
  sx_batch *b = write_batch(x.seg, 1);
  sx_block_write w = sxt_kv_write(0, 0, 2);
  sxt_rc(sx_batch_add_block_writes(b, &w, 1), SX_EDENIED);
  sx_batch_destroy(b);
  sxt_pair_stop(&x);

  /* A producer presenting an incarnation the store no longer holds for its
   * name (it was taken over): refused. */
  pair_start(&x, SXT_RW);
  sxt_ok(sx_agent_grant_write(x.c.a, "prefill-0", NULL));
  sx_desc d;
  sxt_ok(sx_agent_descriptor(x.p.a, &d));
  d.incarnation[0] ^= 0x5a;
  d.generation++;
  sxt_store_publish(x.url, &d);
  sx_desc_free(&d);
  w = sxt_kv_write(0, 0, 2);
  expect_refused(sxt_run_write(x.seg, &w, 1, 2, 20000), SX_EACCESS, "refused our writes");
  assert_int_equal(sxt_blocks_zero(&x.c, &w), 0);
  sxt_expect_no_notice(x.c.a);
  sxt_pair_stop(&x);

  /* The consumer restarts under its name and address: writes meant for
   * its old incarnation are refused as stale. */
  char listen[32];
  snprintf(listen, sizeof(listen), "127.0.0.1:%d", sxt_free_port());
  sxt_mem_url(x.url, sizeof(x.url), "rpush");
  sx_agent_params p;
  for (int life = 0; life < 2; life++) {
    memset(&x.c, 0, sizeof(x.c));
    sxt_params(&p, x.url, "decode-0");
    p.listen = listen;
    sxt_ok(sx_agent_create(&p, &x.c.a));
    sxt_register_kv(&x.c, SXT_CONSUMER_BLOCKS, SXT_RW);
    sxt_ok(sx_agent_publish(x.c.a, 0));
    sxt_ok(sx_agent_grant_write(x.c.a, NULL, NULL));
    if (life == 0) {
      sxt_target_start(&x.p, x.url, "prefill-0", NULL, 42);
      sxt_ok(sx_segment_open(x.p.a, "decode-0", 5000, &x.seg));
      assert_int_equal(sx_segment_transport(x.seg), SX_TRANSPORT_RDMA);
      sxt_agent_stop(&x.c);
    }
  }
  w = sxt_kv_write(0, 0, 8);
  expect_refused(sxt_run_write(x.seg, &w, 1, 3, 20000), SX_ESTALE, NULL);
  assert_int_equal(sxt_blocks_zero(&x.c, &w), 0);
  sxt_expect_no_notice(x.c.a);
  sxt_pair_stop(&x);
}

/* Keys a producer could forge: the device refuses them, nothing lands. */
static void publish_forged(const char *url, const sx_desc *real, const char *name,
                           void (*edit)(sx_desc *d)) {
  sx_desc d;
  sxt_ok(sx_desc_copy(&d, real));
  snprintf(d.name, sizeof(d.name), "%s", name);
  edit(&d);
  sxt_store_publish(url, &d);
  sx_desc_free(&d);
}

/* K (region 0) is writable; V (region 1) only readable. */
static void v_with_k_write_key(sx_desc *d) {
  d->regions[1].access |= SX_ACCESS_REMOTE_WRITE;
  d->regions[1].n_wkeys = d->regions[0].n_wkeys;
  memcpy(d->regions[1].wkeys, d->regions[0].wkeys, sizeof(d->regions[0].wkeys));
}
static void k_with_read_key(sx_desc *d) {
  memcpy(d->regions[0].wkeys, d->regions[0].rkeys, sizeof(d->regions[0].rkeys));
}
static void k_twice_as_long(sx_desc *d) {
  d->regions[0].length *= 2;
}
static void k_read_with_write_key(sx_desc *d) {
  memcpy(d->regions[0].rkeys, d->regions[0].wkeys, sizeof(d->regions[0].wkeys));
}

static void test_rdma_push_forged_keys_are_refused_by_the_device(void **state) {
  (void)state;
  char url[64];
  sxt_mem_url(url, sizeof(url), "rforge");
  /* The consumer: K writable, registered over the first half of a buffer
   * twice its size; V readable only. */
  const uint64_t len = (uint64_t)SXT_LAYERS * SXT_CONSUMER_BLOCKS * SXT_BLOCK;
  sxt_agent c;
  agent_new(&c, url, "decode-f", 0, 0);
  c.blocks = SXT_CONSUMER_BLOCKS;
  for (int s = 0; s < 2; s++) {
    c.mem[s] = calloc(2, len);
    assert_non_null(c.mem[s]);
    sx_region_params rp = {.addr = c.mem[s], .length = len, .layer_count = SXT_LAYERS,
                           .layer_stride = SXT_CONSUMER_BLOCKS * SXT_BLOCK, .slot = (uint32_t)s,
                           .block_bytes = SXT_BLOCK, .num_blocks = SXT_CONSUMER_BLOCKS,
                           .access = s == 0 ? SXT_RW : SX_ACCESS_REMOTE_READ};
    sxt_ok(sx_agent_register(c.a, &rp, &c.id[s]));
  }
  sxt_ok(sx_agent_publish(c.a, 0));
  sxt_ok(sx_agent_grant_write(c.a, NULL, NULL));
  sx_desc real;
  sxt_ok(sx_agent_descriptor(c.a, &real));
  assert_int_equal(real.regions[0].n_wkeys, real.regions[0].n_rkeys);
  assert_true(real.regions[0].wkeys[0] != real.regions[0].rkeys[0]);
  assert_int_equal(real.regions[1].n_wkeys, 0);
  publish_forged(url, &real, "forged-v", v_with_k_write_key);
  publish_forged(url, &real, "forged-pd", k_with_read_key);
  publish_forged(url, &real, "forged-oob", k_twice_as_long);
  publish_forged(url, &real, "forged-rd", k_read_with_write_key);
  sx_desc_free(&real);
  sxt_agent p;
  producer_start(&p, url, "prefill-f", 99, 0, 1);
  sx_segment *seg;

  /* V with K's write key: outside K's MR. */
  sxt_ok(sx_segment_open(p.a, "forged-v", 5000, &seg));
  sx_block_write wv = {.layer_count = SXT_LAYERS, .slots = 1u << SX_SLOT_V, .count = 4};
  sx_batch_result r = sxt_run_write(seg, &wv, 1, 1, 20000);
  expect_refused(r, SX_ERDMA, "WRITE");
  assert_int_equal(sxt_blocks_zero(&c, &wv), 0);
  sx_segment_close(seg);
  /* K with its read key: that MR is in the readers' PD. */
  sxt_ok(sx_segment_open(p.a, "forged-pd", 5000, &seg));
  sx_block_write wk = {.layer_count = SXT_LAYERS, .slots = 1u << SX_SLOT_K, .count = 4};
  expect_refused(sxt_run_write(seg, &wk, 1, 2, 20000), SX_ERDMA, "WRITE");
  assert_int_equal(sxt_blocks_zero(&c, &wk), 0);
  sx_segment_close(seg);
  /* Past the end of K's MR. */
  sxt_ok(sx_segment_open(p.a, "forged-oob", 5000, &seg));
  sx_batch *b = write_batch(seg, 3);
  sx_range_write rw = {.local = p.mem[0], .remote_region = c.id[0], .offset = len,
                       .length = 8192};
  sxt_ok(sx_batch_add_range_writes(b, &rw, 1));
  r = run(b);
  expect_refused(r, SX_ERDMA, "WRITE");
  for (uint64_t i = 0; i < len; i++)
    if (c.mem[0][len + i] != 0)
      fail_msg("byte %lu past K's end was written", (unsigned long)i);
  sx_segment_close(seg);
  /* And a reader cannot READ with a write key. */
  sxt_ok(sx_segment_open(p.a, "forged-rd", 5000, &seg));
  sx_block_read rk = {.layer_count = 1, .slots = 1u << SX_SLOT_K, .count = 1};
  r = sxt_run_batch(seg, &rk, 1, 20000);
  assert_int_equal(r.state, SX_BATCH_FAILED);
  assert_int_equal(r.error, SX_ERDMA);
  sx_segment_close(seg);
  sxt_expect_no_notice(c.a);
  /* The real descriptor still takes writes. */
  sxt_ok(sx_segment_open(p.a, "decode-f", 5000, &seg));
  expect_completed((sx_batch_result[]){sxt_run_write(seg, &wk, 1, 4, 20000)});
  assert_int_equal(sxt_verify_write(&c, &p, &wk), 0);
  sx_segment_close(seg);
  sxt_agent_stop(&p);
  sxt_agent_stop(&c);
}

/* GPU memory (`test_rdma_push gpu`, on the host-memory stand-in for libcuda
 * that run.sh names in SX_CUDA_LIBRARY): RDMA does not register it, so a
 * writable GPU region is published without a write key beside a host
 * region that has one.  Peers still write the segment over RDMA: writes
 * into the GPU region are staged (the consumer READs the producer's ring
 * slots and copies them to the device, rdma_stagew.c), writes into the
 * host region are RDMA WRITEs with its key.  tests/rdma/test_rdma_gpu_push.c
 * covers staged writes in depth. */
static void test_rdma_push_gpu_region_has_no_write_key(void **state) {
  (void)state;
  int ndev = 0;
  if (sx__mem_cuda_devices(&ndev) != 0 || ndev == 0)
    fail_msg("no CUDA device, not even the stand-in (SX_CUDA_LIBRARY=%s): %s",
             getenv("SX_CUDA_LIBRARY") ? getenv("SX_CUDA_LIBRARY") : "unset", sx_errmsg());
  char url[64];
  sxt_mem_url(url, sizeof(url), "rgpu");
  const uint64_t len = (uint64_t)SXT_LAYERS * SXT_CONSUMER_BLOCKS * SXT_BLOCK;
  sxt_agent c;
  agent_new(&c, url, "decode-g", 0, 0);
  c.blocks = SXT_CONSUMER_BLOCKS;
  void *dev = NULL;
  sxt_ok(sx__mem_alloc(0, len, &dev));
  c.mem[1] = calloc(1, len);
  assert_non_null(c.mem[1]);
  for (int s = 0; s < 2; s++) {
    sx_region_params rp = {.addr = s == 0 ? dev : c.mem[1], .length = len,
                           .layer_count = SXT_LAYERS,
                           .layer_stride = SXT_CONSUMER_BLOCKS * SXT_BLOCK, .slot = (uint32_t)s,
                           .block_bytes = SXT_BLOCK, .num_blocks = SXT_CONSUMER_BLOCKS,
                           .location = s == 0 ? "cuda:0" : "cpu", .access = SXT_RW};
    sxt_ok(sx_agent_register(c.a, &rp, &c.id[s]));
  }
  sxt_ok(sx_agent_publish(c.a, 0));
  sxt_ok(sx_agent_grant_write(c.a, NULL, NULL));
  sxt_agent p;
  producer_start(&p, url, "prefill-g", 5, 0, 1);
  sx_segment *seg;
  sxt_ok(sx_segment_open(p.a, "decode-g", 5000, &seg));
  const sx_desc *d = sx_segment_desc(seg);
  assert_true(sx_desc_rdma_devices(d) >= 1);
  assert_int_equal(sx_desc_find(d, 0, 0, SX_SLOT_K)->n_wkeys, 0);
  assert_int_equal(sx_desc_find(d, 0, 0, SX_SLOT_V)->n_wkeys, sx_desc_rdma_devices(d));
  assert_int_equal(sx_segment_transport(seg), SX_TRANSPORT_RDMA);
  /* The GPU region has no write key, so its writes are staged RDMA
   * (docs/gpu.md); the bytes are checked on a copy. */
  sx_block_write wk = {.layer_count = SXT_LAYERS, .slots = 1u << SX_SLOT_K, .count = 2};
  sx_batch_result r = sxt_run_write(seg, &wk, 1, 1, 20000);
  assert_int_equal(r.state, SX_BATCH_COMPLETED);
  assert_int_equal(r.transport, SX_TRANSPORT_RDMA);
  sxt_expect_notice(c.a, &p, "prefill-g", 1, &wk, 1, 1000);
  c.mem[0] = malloc(len);
  assert_non_null(c.mem[0]);
  sxt_ok(sx__mem_copy(c.mem[0], dev, len));
  assert_int_equal(sxt_verify_write(&c, &p, &wk), 0);
  sx_block_write wv = {.layer_count = SXT_LAYERS, .slots = 1u << SX_SLOT_V, .count = 2};
  r = sxt_run_write(seg, &wv, 1, 2, 20000);
  assert_int_equal(r.state, SX_BATCH_COMPLETED);
  assert_int_equal(r.transport, SX_TRANSPORT_RDMA);
  sxt_expect_notice(c.a, &p, "prefill-g", 2, &wv, 1, 1000);
  sx_segment_close(seg);
  sxt_agent_stop(&p);
  sxt_agent_stop(&c);
  sx__mem_free(dev);
}

/* ------------------------------------------------------------ load and stops */

static void test_rdma_push_many_producers_into_one_consumer(void **state) {
  (void)state;
  sxt_push_many_producers(SX_TRANSPORT_RDMA);
}

/* A deadline in the middle of a large write batch: TIMEOUT, no notice; the
 * next batch goes through. */
static void test_rdma_push_deadline_mid_batch(void **state) {
  (void)state;
  char url[64];
  sxt_mem_url(url, sizeof(url), "rdeadline");
  const uint64_t blocks = 2048; /* 64 MiB per side */
  sxt_agent c;
  agent_new(&c, url, "decode-d", 0, 0);
  sxt_register_kv(&c, blocks, SXT_RW);
  sxt_ok(sx_agent_publish(c.a, 0));
  sxt_ok(sx_agent_grant_write(c.a, NULL, NULL));
  sxt_agent p;
  agent_new(&p, url, "prefill-d", 0, 0);
  sxt_register_kv(&p, blocks, SX_ACCESS_REMOTE_READ);
  for (int s = 0; s < 2; s++)
    memset(p.mem[s], 0x6b, SXT_LAYERS * blocks * SXT_BLOCK);
  sxt_ok(sx_agent_publish(p.a, 0));
  sx_segment *seg;
  sxt_ok(sx_segment_open(p.a, "decode-d", 5000, &seg));
  sx_block_write all = sxt_kv_write(0, 0, blocks);
  sx_batch_result r = sxt_run_write(seg, &all, 1, 1, 300);
  if (r.state != SX_BATCH_TIMEOUT)
    fail_msg("a 128 MiB write batch with a 300 ms deadline ended %s (%s)",
             sx_batch_state_name(r.state), r.message);
  sx_notice *n = NULL;
  sxt_rc(sx_agent_notice_next(c.a, 1000, &n), SX_ETIMEDOUT);
  /* New bytes for the next batch, so that what the aborted one left in
   * its destinations cannot pass for them. */
  for (int s = 0; s < 2; s++)
    memset(p.mem[s] + 5 * SXT_BLOCK, 0x3c, 2 * SXT_BLOCK);
  sx_block_write one = {.layer_count = 1, .slots = SXT_KV, .local_block = 5,
                        .remote_block = 7, .count = 2};
  r = sxt_run_write(seg, &one, 1, 2, 20000);
  expect_completed(&r);
  sxt_ok(sx_agent_notice_next(c.a, 1000, &n));
  assert_int_equal(n->tag, 2);
  sx_notice_free(n);
  for (int s = 0; s < 2; s++)
    for (uint64_t i = 0; i < 2 * SXT_BLOCK; i++)
      assert_int_equal(c.mem[s][7 * SXT_BLOCK + i], 0x3c);
  sx_segment_close(seg);
  sxt_agent_stop(&p);
  sxt_agent_stop(&c);
}

/* The consumer goes away in the middle of a large write batch (its agent
 * destroyed: producers' QPs, the shared receive queue and the write MRs
 * torn down while WRITEs arrive): the batch fails, nothing crashes, and
 * the producer's next batch fails cleanly too. */
static void test_rdma_push_consumer_stops_mid_batch(void **state) {
  (void)state;
  char url[64];
  sxt_mem_url(url, sizeof(url), "rstop");
  const uint64_t blocks = 2048; /* 64 MiB per side */
  sxt_agent c, p;
  agent_new(&c, url, "decode-s", 0, 0);
  sxt_register_kv(&c, blocks, SXT_RW);
  sxt_ok(sx_agent_publish(c.a, 0));
  sxt_ok(sx_agent_grant_write(c.a, NULL, NULL));
  agent_new(&p, url, "prefill-s", 0, 0);
  sxt_register_kv(&p, blocks, SX_ACCESS_REMOTE_READ);
  for (int s = 0; s < 2; s++)
    memset(p.mem[s], 0x21, SXT_LAYERS * blocks * SXT_BLOCK);
  sxt_ok(sx_agent_publish(p.a, 0));
  sx_segment *seg;
  sxt_ok(sx_segment_open(p.a, "decode-s", 5000, &seg));
  sx_block_write one = sxt_kv_write(0, 0, 1);
  expect_completed((sx_batch_result[]){sxt_run_write(seg, &one, 1, 1, 20000)});
  sx_block_write all = sxt_kv_write(0, 0, blocks);
  sx_batch *b = sxt_write_submit(seg, &all, 1, 2, 30000);
  /* Once the second block of K's first layer landed, the batch is moving. */
  for (int i = 0; i < 20000 && c.mem[0][SXT_BLOCK] != 0x21; i++)
    usleep(500);
  assert_int_equal(c.mem[0][SXT_BLOCK], 0x21);
  sxt_agent_stop(&c);
  sx_batch_result r;
  sxt_ok(sx_batch_wait(b, -1));
  sxt_ok(sx_batch_result_get(b, &r));
  sx_batch_destroy(b);
  if (r.state == SX_BATCH_COMPLETED)
    fail_msg("the whole 128 MiB batch completed before the consumer stopped");
  r = sxt_run_write(seg, &one, 1, 3, 5000);
  assert_true(r.state == SX_BATCH_FAILED || r.state == SX_BATCH_TIMEOUT);
  sx_segment_close(seg);
  sxt_agent_stop(&p);
}

/* ------------------------------------------------------------ processes */

static int sxctl(const char *log, const char *const *args, char *out, size_t size) {
  return sxt_sxctl(&env, log, args, out, size);
}

static void test_rdma_push_sxctl_write_into_sx_agent(void **state) {
  (void)state;
  const char *more[] = {"--writable", "--grant", "*", "--rdma-devices", getenv("RXE_DEV"), NULL};
  if (more[4] == NULL)
    more[3] = NULL;
  sxt_pool_opts o = {.layers = 4, .block_bytes = 65536, .num_blocks = 128, .slots = "K,V",
                     .fingerprint = "rpush/v1", .lease_ms = 3000, .log_level = "info",
                     .more = more, .publish_ms = 30000};
  sxt_pool p;
  sxt_pool_start(&env, &p, "rdecode-1", 1, &o);
  char log[300], out[8192];
  snprintf(log, sizeof(log), "%s/write-1.log", env.tmpdir);
  const char *w[] = {"write", "rdecode-1", "--as", "rprefill-1", "--fill", "7",
                     "--blocks", "0-63", "--batch", "16", "--depth", "2", "--tag", "500",
                     "--verify", NULL};
  assert_int_equal(sxctl(log, w, out, sizeof(out)), 0);
  if (strstr(out, "via rdma") == NULL || strstr(out, "read back and verified every byte") == NULL)
    fail_msg("sxctl write did not write over RDMA and verify:\n%s", out);
  snprintf(log, sizeof(log), "%s/read-1.log", env.tmpdir);
  const char *r1[] = {"read", "rdecode-1", "--blocks", "64-127", "--verify", "1", NULL};
  assert_int_equal(sxctl(log, r1, out, sizeof(out)), 0);
  assert_int_equal(sxt_count_in_file(p.log, "notice: rprefill-1"), 4);
  assert_int_equal(sxt_pool_stop(&p, SIGTERM), 0);
}

/* Is block b of layer l of slot s of c's K/V still all zero? */
static int block_zero(const sxt_agent *c, int s, uint32_t l, uint64_t b) {
  const uint8_t *m = c->mem[s] + ((uint64_t)l * c->blocks + b) * SXT_BLOCK;
  for (uint32_t i = 0; i < SXT_BLOCK; i++)
    if (m[i] != 0)
      return 0;
  return 1;
}

static void test_rdma_push_producer_killed_mid_batch(void **state) {
  (void)state;
  const uint64_t blocks = 4096; /* one batch of 128 MiB */
  sxt_agent c;
  agent_new(&c, env.url, "rdecode-3", 0, 0);
  sxt_register_kv(&c, blocks, SXT_RW);
  sxt_ok(sx_agent_publish(c.a, 0));
  sxt_ok(sx_agent_grant_write(c.a, NULL, NULL));
  char exe[PATH_MAX + 16], log[300];
  snprintf(exe, sizeof(exe), "%s/sxctl", env.bindir);
  snprintf(log, sizeof(log), "%s/victim.log", env.tmpdir);
  const char *argv[] = {exe, "--metadata", env.url, "write", "rdecode-3", "--as",
                        "rprefill-victim", "--fill", "5", "--blocks", "all", "--batch", "4096",
                        "--depth", "1", "--tag", "666", "--timeout-ms", "120000", NULL};
  pid_t victim = sxt_spawn_ok(log, argv);
  /* Stop it once its WRITEs land (the first block is written first). */
  int landed = 0;
  for (int i = 0; i < 60000 && !landed; i++) {
    landed = !block_zero(&c, 0, 0, 0);
    if (!landed)
      usleep(500);
  }
  if (!landed) {
    sxt_show_log(log);
    fail_msg("no write of the producer landed within 30 s");
  }
  assert_int_equal(sxt_freeze(victim), 0);
  int whole = !block_zero(&c, 1, SXT_LAYERS - 1, blocks - 1); /* the last byte posted */
  kill(victim, SIGKILL);
  assert_int_equal(sxt_reap(victim, 10000), 128 + SIGKILL);
  if (whole)
    fail_msg("the whole batch landed before the producer was stopped: the test proves "
             "nothing (raise its size)");
  sx_notice *n = NULL;
  sxt_rc(sx_agent_notice_next(c.a, 2000, &n), SX_ETIMEDOUT);
  /* Another producer's request goes through, with its notice. */
  sxt_agent p;
  producer_start(&p, env.url, "rprefill-3", 77, 0, 0);
  sx_segment *seg;
  sxt_ok(sx_segment_open(p.a, "rdecode-3", 5000, &seg));
  assert_int_equal(sx_segment_transport(seg), SX_TRANSPORT_RDMA);
  sx_block_write w = sxt_kv_write(0, 100, 8);
  sx_batch_result r = sxt_run_write(seg, &w, 1, 42, 20000);
  expect_completed(&r);
  sxt_expect_notice(c.a, &p, "rprefill-3", 42, &w, 1, 1000);
  assert_int_equal(sxt_verify_write(&c, &p, &w), 0);
  sxt_expect_no_notice(c.a);
  sx_segment_close(seg);
  sxt_agent_stop(&p);
  sxt_agent_stop(&c);
}

static int group_setup(void **state) {
  (void)state;
  return sxt_proc_env_setup(&env, &(sxt_proc_env_opts){.test = "test_rdma_push",
                                                       .tmp = "rdma-push", .bin_here = 1,
                                                       .need = "sx-agent", .ns = "rdma-push",
                                                       .notify = "Kx", .redis_required = 1});
}

static int group_teardown(void **state) {
  (void)state;
  return sxt_proc_env_teardown(&env);
}

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  /* The GPU case runs alone: the CUDA driver (or its stand-in) is looked
   * for once per process, and the other cases run without one. */
  if (argc > 1 && strcmp(argv[1], "gpu") == 0) {
    const struct CMUnitTest gpu[] = {
        cmocka_unit_test(test_rdma_push_gpu_region_has_no_write_key),
    };
    return cmocka_run_group_tests(gpu, NULL, NULL);
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rdma_push_writes_land_then_the_notice_arrives),
      cmocka_unit_test(test_rdma_push_sliced_over_several_qps),
      cmocka_unit_test(test_rdma_push_refused_writes_land_nothing),
      cmocka_unit_test(test_rdma_push_read_only_and_stale_are_refused),
      cmocka_unit_test(test_rdma_push_forged_keys_are_refused_by_the_device),
      cmocka_unit_test(test_rdma_push_many_producers_into_one_consumer),
      cmocka_unit_test(test_rdma_push_deadline_mid_batch),
      cmocka_unit_test(test_rdma_push_consumer_stops_mid_batch),
      cmocka_unit_test(test_rdma_push_sxctl_write_into_sx_agent),
      cmocka_unit_test(test_rdma_push_producer_killed_mid_batch),
  };
  const char *filter = getenv("SXT_FILTER"); /* one test, e.g. to repeat it */
  if (filter != NULL)
    cmocka_set_test_filter(filter);
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
