/*
 * GPU suite: pointer checks with the real driver, and TCP with GPU memory
 * on either side through pinned staging, byte for byte in all three
 * directions (GPU->host, host->GPU, GPU->GPU), with staging small enough
 * that work waits for chunks, blocks larger than a chunk, range reads into
 * unregistered device memory, a deadline in the middle, and unregister
 * while staged reads run.  Needs a CUDA device (make test-gpu).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu_fixture.h"
#include "internal.h"
#include "pattern.h"
#include "procs.h"

#define SEED 0x5eed6a11u

static void new_url(char *url, size_t size) {
  static int seq;
  snprintf(url, size, "mem://gpu-tcp-%d-%d", (int)getpid(), seq++);
}

static void test_gpu_pointer_checks(void **state) {
  (void)state;
  int n = gpu_devices();
  void *dev, *pinned;
  sxt_ok(sx__mem_alloc(0, 4u << 20, &dev));
  sxt_ok(sx__mem_host_alloc(65536, &pinned));
  sx__mem_info m;
  sxt_ok(sx__mem_check((uint8_t *)dev + 4096, 1u << 20, "cuda:0", &m));
  assert_int_equal(m.kind, SX__MEM_CUDA);
  assert_int_equal(m.device, 0);
  assert_true(m.base == (uint64_t)(uintptr_t)dev);
  assert_true(m.size >= (4u << 20));
  sxt_rc(sx__mem_check((uint8_t *)dev + (4u << 20) - 4096, 8192 + m.size - (4u << 20),
                       "cuda:0", &m), SX_EBOUNDS);
  char host[64];
  sxt_rc(sx__mem_check(host, sizeof(host), "cuda:0", &m), SX_EINVAL);
  sxt_rc(sx__mem_check(pinned, 65536, "cuda:0", &m), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "pinned host memory"));
  sxt_rc(sx__mem_check(dev, 4096, "cpu", &m), SX_EINVAL);
  char name[16];
  snprintf(name, sizeof(name), "cuda:%d", n);
  sxt_rc(sx__mem_check(dev, 4096, name, &m), SX_ENODEV);
  if (n >= 2) {
    sxt_rc(sx__mem_check(dev, 4096, "cuda:1", &m), SX_EINVAL);
    assert_non_null(strstr(sx_errmsg(), "memory of cuda:0"));
  }
  /* Through an agent: the same rules, and the message reaches the caller. */
  char url[64];
  new_url(url, sizeof(url));
  sx_agent *a = gpu_agent(url, "ptr-0", 0, 0);
  sx_region_params rp = {.addr = (uint8_t *)dev + (4u << 20) - 4096, .length = 1u << 20,
                         .block_bytes = 4096, .num_blocks = 256, .location = "cuda:0"};
  uint32_t id;
  if (m.size == (4u << 20)) { /* the driver may round the allocation up */
    sxt_rc(sx_agent_register(a, &rp, &id), SX_EBOUNDS);
    assert_non_null(strstr(sx_errmsg(), "not inside one allocation"));
  }
  rp.addr = dev;
  sxt_ok(sx_agent_register(a, &rp, &id));
  sx_agent_destroy(a);
  sx__mem_host_free(pinned);
  sx__mem_free(dev);
}

/* One direction: target pool at tloc, reader pool at rloc, several batches
 * of scattered block reads (and one of raw ranges), each verified. */
static void staged(const char *tloc, const char *rloc, uint64_t block_bytes,
                   uint64_t staging, size_t per_batch, uint64_t count) {
  char url[64];
  new_url(url, sizeof(url));
  const uint32_t layers = 2;
  const uint64_t tblocks = 96, rblocks = per_batch * count;
  sx_agent *ta = gpu_agent(url, "stage-t", staging, SX_TRANSPORTS_TCP);
  sx_agent *ra = gpu_agent(url, "stage-r", staging, SX_TRANSPORTS_TCP);
  gpu_pool t, r;
  gpu_pool_make(&t, ta, tloc, layers, tblocks, block_bytes, SEED);
  gpu_pool_make(&r, ra, rloc, layers, rblocks, block_bytes, 0);
  sxt_ok(sx_agent_publish(ta, 0));
  sx_segment *seg;
  sxt_ok(sx_segment_open(ra, "stage-t", 2000, &seg));
  assert_int_equal(sx_segment_transport(seg), SX_TRANSPORT_TCP);
  sxt_ok(sx_segment_check(seg, 0, NULL));
  sx_block_read *e = calloc(per_batch, sizeof(*e));
  for (uint32_t round = 0; round < 3; round++) {
    gpu_entries(e, per_batch, layers, tblocks, rblocks, count, round + 1);
    sx_batch_result res = sxt_run_batch(seg, e, per_batch, 20000);
    if (res.state != SX_BATCH_COMPLETED)
      fail_msg("%s -> %s round %u: %s (%s)", tloc, rloc, round,
               sx_batch_state_name(res.state), res.message);
    assert_true(res.bytes == per_batch * count * block_bytes * 2 * layers);
    assert_int_equal(gpu_pool_verify(&r, seg, SEED, e, per_batch), 0);
  }
  /* Raw ranges: one into the registered pool, one into device or host
   * memory that no region covers (its kind is asked of the driver). */
  sx__mem_info m;
  sxt_ok(sx__mem_parse_location(rloc, &m));
  uint64_t len = 3 * block_bytes + 123;
  uint8_t *loose, *back = malloc(len);
  if (m.kind == SX__MEM_CUDA)
    sxt_ok(sx__mem_alloc(m.device, len, (void **)&loose));
  else
    loose = malloc(len);
  sx_range_read rr[2] = {
      {.local = r.mem[1], .remote_region = t.id[1], .offset = 7, .length = block_bytes},
      {.local = loose, .remote_region = t.id[0], .offset = 4099, .length = len}};
  sx_batch *b;
  sxt_ok(sx_batch_create(seg, NULL, &b));
  sxt_ok(sx_batch_add_ranges(b, rr, 2));
  sxt_ok(sx_batch_submit(b));
  sxt_ok(sx_batch_wait(b, -1));
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  if (res.state != SX_BATCH_COMPLETED)
    fail_msg("ranges: %s", res.message);
  sx_batch_destroy(b);
  if (m.kind == SX__MEM_CUDA)
    sxt_ok(sx__mem_copy(back, loose, len));
  else
    memcpy(back, loose, len);
  assert_int_equal(sx__pattern_check(back, len, SEED, t.id[0], 4099, NULL), 0);
  if (m.kind == SX__MEM_CUDA)
    sxt_ok(sx__mem_copy(back, r.mem[1], block_bytes));
  else
    memcpy(back, r.mem[1], block_bytes);
  assert_int_equal(sx__pattern_check(back, block_bytes, SEED, t.id[1], 7, NULL), 0);
  m.kind == SX__MEM_CUDA ? sx__mem_free(loose) : free(loose);
  free(back);
  free(e);
  sx_segment_close(seg);
  sx_agent_destroy(ra);
  sx_agent_destroy(ta);
  gpu_pool_free(&r);
  gpu_pool_free(&t);
}

/* Small blocks, many ranges, default staging. */
static void test_gpu_tcp_gpu_to_host(void **state) {
  (void)state;
  staged("cuda:0", "cpu", 16384, 0, 64, 2);
}

static void test_gpu_tcp_host_to_gpu(void **state) {
  (void)state;
  staged("cpu", "cuda:0", 16384, 0, 64, 2);
}

static void test_gpu_tcp_gpu_to_gpu(void **state) {
  (void)state;
  staged("cuda:0", "cuda:0", 16384, 0, 64, 2);
}

/* Blocks of 1.5 MiB + 4 KiB through 1 MiB of staging (four 256 KiB chunks
 * per direction): every range is cut, chunks run out and work waits. */
static void test_gpu_tcp_small_staging_large_blocks(void **state) {
  (void)state;
  const uint64_t bb = (3u << 19) + 4096;
  staged("cuda:0", "cuda:0", bb, 1u << 20, 8, 2);
  staged("cuda:0", "cpu", bb, 1u << 20, 8, 1);
  staged("cpu", "cuda:0", bb, 1u << 20, 8, 1);
}

/* Two GPUs, when there are: target on one, reader on the other. */
static void test_gpu_tcp_two_gpus(void **state) {
  (void)state;
  if (gpu_devices() < 2)
    skip();
  staged("cuda:0", "cuda:1", 65536, 0, 32, 2);
  staged("cuda:1", "cuda:0", 65536, 0, 32, 2);
}

typedef struct unreg_arg {
  sx_agent *a;
  uint32_t id;
  int rc;
} unreg_arg;

static void *unreg_thread(void *arg) {
  unreg_arg *u = arg;
  sxt_sleep_ms(5);
  u->rc = sx_agent_unregister(u->a, u->id);
  return NULL;
}

/* A deadline in the middle of staged reads, then unregister while reads of
 * the GPU region are in flight: nothing hangs, unregister waits for the
 * chunks on the wire, later reads of it are refused. */
static void test_gpu_tcp_deadline_and_unregister(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  const uint64_t bb = 1u << 20, blocks = 64;
  sx_agent *ta = gpu_agent(url, "stage-u", 2u << 20, SX_TRANSPORTS_TCP);
  sx_agent *ra = gpu_agent(url, "stage-v", 2u << 20, SX_TRANSPORTS_TCP);
  gpu_pool t, r;
  gpu_pool_make(&t, ta, "cuda:0", 1, blocks, bb, SEED);
  gpu_pool_make(&r, ra, "cuda:0", 1, blocks, bb, 0);
  sxt_ok(sx_agent_publish(ta, 0));
  sx_segment *seg;
  sxt_ok(sx_segment_open(ra, "stage-u", 2000, &seg));
  sx_block_read all = {.layer_count = 1, .slots = SXT_KV, .count = blocks};
  /* 128 MiB through 2 MiB of staging in 1 ms: the deadline comes first. */
  sx_batch_result res = sxt_run_batch(seg, &all, 1, 1);
  assert_int_equal(res.state, SX_BATCH_TIMEOUT);
  /* The connections and staging still work afterwards. */
  res = sxt_run_batch(seg, &all, 1, 30000);
  if (res.state != SX_BATCH_COMPLETED)
    fail_msg("after the timeout: %s", res.message);
  assert_int_equal(gpu_pool_verify(&r, seg, SEED, &all, 1), 0);
  /* Unregister K while a batch reads it. */
  unreg_arg u = {.a = ta, .id = t.id[0]};
  pthread_t th;
  sx_batch *b = sxt_batch_submit(seg, &all, 1, 30000);
  assert_int_equal(pthread_create(&th, NULL, unreg_thread, &u), 0);
  sxt_ok(sx_batch_wait(b, -1));
  pthread_join(th, NULL);
  sxt_ok(u.rc);
  sx_batch_destroy(b);
  /* The region is gone for new reads. */
  res = sxt_run_batch(seg, &all, 1, 5000);
  assert_int_equal(res.state, SX_BATCH_FAILED);
  assert_int_equal(res.error, SX_ENOREGION);
  sx_segment_close(seg);
  sx_agent_destroy(ra);
  sx_agent_destroy(ta);
  gpu_pool_free(&r);
  gpu_pool_free(&t);
}

static int need_gpu(void **state) {
  (void)state;
  if (gpu_devices() == 0) {
    fprintf(stderr, "test_gpu_tcp: no CUDA device: %s\n", sx_errmsg());
    return -1;
  }
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gpu_pointer_checks),
      cmocka_unit_test(test_gpu_tcp_gpu_to_host),
      cmocka_unit_test(test_gpu_tcp_host_to_gpu),
      cmocka_unit_test(test_gpu_tcp_gpu_to_gpu),
      cmocka_unit_test(test_gpu_tcp_small_staging_large_blocks),
      cmocka_unit_test(test_gpu_tcp_two_gpus),
      cmocka_unit_test(test_gpu_tcp_deadline_and_unregister),
  };
  return cmocka_run_group_tests(tests, need_gpu, NULL);
}
