/*
 * GPU suite: pointer checks with the real driver, and TCP with GPU memory
 * on either side through pinned staging, byte for byte in all three
 * directions (GPU->host, host->GPU, GPU->GPU), with staging small enough
 * that work waits for chunks, blocks larger than a chunk, range reads into
 * unregistered device memory, a deadline in the middle, and unregister
 * while staged reads run; many staged requests queued on one connection
 * (in order, byte for byte, mixed with host and refused reads), READVs of
 * GPU memory (one reply through several chunks) and of host memory, several
 * readers on a small staging budget, a reader closing and a target
 * unregistering while replies are staged; the target's staged replies
 * sent by its data-mover threads.  Needs a CUDA device (make test-gpu).
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
#include "transport/conn/frame.h"
#include "transport/conn/xpool.h"
#include "transport/tcp/tcp_stage.h"

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
static uint64_t next_rand(uint64_t *x);

/* The gather kernel straight through the memory layer: 100 launches on one
 * stream (more than its tables, so they are reused behind events), each
 * of ranges at odd offsets and lengths (byte, 4-byte and 16-byte paths,
 * ranges longer than a piece), device to device, and with two GPUs from
 * the other GPU's memory (peer access); every byte compared with the same
 * copies done on the host. */
static void gather_direct(int sdev, int ddev) {
  const size_t size = 4u << 20, rounds = 100, n = 37;
  uint8_t *src, *dst, *host = malloc(size), *want = calloc(1, size), *got = malloc(size);
  for (size_t i = 0; i < size; i++)
    host[i] = (uint8_t)(i * 131 + (i >> 9));
  sxt_ok(sx__mem_alloc(sdev, size, (void **)&src));
  sxt_ok(sx__mem_alloc(ddev, size, (void **)&dst));
  sxt_ok(sx__mem_copy(src, host, size));
  sxt_ok(sx__mem_copy(dst, want, size));
  if (sdev != ddev)
    sxt_ok(sx__mem_peer_enable(ddev, sdev));
  sx__mem_stream *s;
  sxt_ok(sx__mem_stream_create(ddev, &s));
  uint64_t x = 0x1234567;
  uint64_t k0 = 0, c[4];
  sx__mem_copy_counts(c);
  k0 = c[SX__COPY_KERNEL];
  for (size_t r = 0; r < rounds; r++) {
    sx__mem_range rg[37];
    for (size_t i = 0; i < n; i++) {
      /* Destinations: disjoint slots of 100000 bytes, so rounds overwrite
       * in order (one stream) and the host replay gives the same bytes. */
      uint64_t len = 1 + next_rand(&x) % (i % 5 == 0 ? 99000 : 5000);
      uint64_t so = next_rand(&x) % (size - len), doff = i * 100000 + next_rand(&x) % 997;
      if (i % 3 == 0) { /* 16-byte aligned both sides */
        so &= ~15ull;
        doff &= ~15ull;
      }
      rg[i] = (sx__mem_range){(uint64_t)(uintptr_t)(dst + doff),
                              (uint64_t)(uintptr_t)(src + so), len};
      memmove(want + doff, host + so, len);
    }
    sx__mem_copy_method used;
    sxt_ok(sx__mem_gather(s, rg, n, SX__GATHER_SM_OK, SX__COPY_KERNEL, &used));
    assert_int_equal(used, SX__COPY_KERNEL);
  }
  sxt_ok(sx__mem_stream_sync(s));
  sx__mem_copy_counts(c);
  assert_int_equal(c[SX__COPY_KERNEL] - k0, rounds);
  sxt_ok(sx__mem_copy(got, dst, size));
  for (size_t i = 0; i < size; i++)
    if (got[i] != want[i])
      fail_msg("cuda:%d -> cuda:%d: byte %zu is %u, not %u", sdev, ddev, i, got[i], want[i]);
  sx__mem_stream_destroy(s);
  sx__mem_free(src);
  sx__mem_free(dst);
  free(host);
  free(want);
  free(got);
}

static void test_gpu_gather_kernel(void **state) {
  (void)state;
  gather_direct(0, 0);
  if (gpu_devices() >= 2) {
    gather_direct(1, 0);
    gather_direct(0, 1);
  }
}

static uint64_t kernels(void) {
  uint64_t c[4];
  sx__mem_copy_counts(c);
  return c[SX__COPY_KERNEL];
}

/* Small blocks go in groups: the target answers READs that arrive
 * together with one gather kernel launch filling one chunk
 * (tcp_stage_serve.c), the reader packs ranges into one chunk and
 * scatters them with one launch (tcp_stage_read.c).  Blocks of 4100 bytes
 * put every part after the first at an unaligned place in the chunk;
 * every byte is checked.  Both ends are this process: GPU -> host
 * memory launches on the target only, host -> GPU on the reader only. */
static void test_gpu_tcp_small_blocks_in_groups(void **state) {
  (void)state;
  uint64_t k0 = kernels();
  staged("cuda:0", "cpu", 4100, 0, 64, 1);
  uint64_t k1 = kernels();
  staged("cpu", "cuda:0", 4100, 0, 64, 1);
  uint64_t k2 = kernels();
  staged("cuda:0", "cuda:0", 4096, 0, 64, 1);
  uint64_t k3 = kernels();
  print_message("gather launches: target %lu, reader %lu, both %lu\n",
                (unsigned long)(k1 - k0), (unsigned long)(k2 - k1), (unsigned long)(k3 - k2));
  assert_true(k1 > k0);
  assert_true(k2 > k1);
  assert_true(k3 > k2);
}

static void test_gpu_tcp_small_staging_large_blocks(void **state) {
  (void)state;
  const uint64_t bb = (3u << 19) + 4096;
  staged("cuda:0", "cuda:0", bb, 1u << 20, 8, 2);
  staged("cuda:0", "cpu", bb, 1u << 20, 8, 1);
  staged("cpu", "cuda:0", bb, 1u << 20, 8, 1);
}

/* The target's staged replies go to its data-mover threads, as large
 * reply writes from host memory do: threads forced on (2 per agent, from
 * 32 KiB, engaged from one busy connection), 1 MiB blocks GPU->GPU and
 * blocks larger than a chunk GPU->host, byte for byte, and the threads
 * sent (every read is of the target's GPU pool, so every reply is a
 * staged one).  16 KiB blocks: the reader asks for them in READVs (an
 * entry's four ranges, 64 KiB, in one reply), so the threads receive the
 * replies; a reply per block (16 KiB) would stay on the loop. */
static void test_gpu_tcp_staged_replies_on_threads(void **state) {
  (void)state;
  setenv("SX_TCP_THREADS", "2", 1);
  setenv("SX_TCP_THREAD_BYTES", "32768", 1);
  setenv("SX_TCP_THREAD_CONNS", "1", 1);
  uint64_t tx = sx__xpool_runs(SX__XJOB_SEND);
  staged("cuda:0", "cuda:0", 1u << 20, 0, 16, 2);
  uint64_t tx1 = sx__xpool_runs(SX__XJOB_SEND);
  staged("cuda:0", "cpu", (3u << 19) + 4096, 1u << 20, 8, 1);
  uint64_t tx2 = sx__xpool_runs(SX__XJOB_SEND);
  uint64_t rx = sx__xpool_runs(SX__XJOB_RECV), rv = sx__tcp_stage_readvs();
  staged("cuda:0", "cuda:0", 16384, 0, 64, 2);
  uint64_t rx1 = sx__xpool_runs(SX__XJOB_RECV), rv1 = sx__tcp_stage_readvs();
  unsetenv("SX_TCP_THREADS");
  unsetenv("SX_TCP_THREAD_BYTES");
  unsetenv("SX_TCP_THREAD_CONNS");
  print_message("staged reply writes sent by threads: %lu, %lu; 16 KiB blocks: %lu READVs, "
                "the threads received %lu times\n", (unsigned long)(tx1 - tx),
                (unsigned long)(tx2 - tx1), (unsigned long)(rv1 - rv), (unsigned long)(rx1 - rx));
  assert_true(tx1 > tx);
  assert_true(tx2 > tx1);
  /* 64 entries of four ranges each, three rounds: about a READV per
   * entry (ranges of neighbouring blocks merge); none where readers send
   * a READ per range. */
  assert_true(rv1 - rv >= 64);
  assert_true(rx1 > rx);
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

/* ------------------------------------------------ many staged requests at once */

/* Copies slowed down (the stand-in driver reads this when a stream starts;
 * a real driver ignores it), so that requests pile up behind staged
 * replies and chunks of one reply overlap copying and sending. */
static void slow_copies(int us) {
  char v[16];
  snprintf(v, sizeof(v), "%d", us);
  setenv("FAKE_CUDA_DELAY_US", v, 1);
}

static void fast_copies(void) { unsetenv("FAKE_CUDA_DELAY_US"); }

/* A small deterministic generator for request shapes. */
static uint64_t next_rand(uint64_t *x) {
  *x ^= *x << 13;
  *x ^= *x >> 7;
  *x ^= *x << 17;
  return *x;
}

typedef struct wreq {
  uint32_t region;
  uint64_t off, len;
  int want; /* the status expected */
} wreq;

/* Send all n requests on fd, then read the n replies: each in request
 * order, whole, with the expected status and exactly the bytes of the
 * pattern of seed.  stop_after < n: close after that many replies and a
 * part of the next one's payload. */
static void wire_burst(int fd, const wreq *q, size_t n, uint64_t seed, size_t stop_after) {
  uint8_t *hdrs = malloc(n * SX__FRAME_HDR);
  assert_non_null(hdrs);
  for (size_t i = 0; i < n; i++) {
    sx__frame f = {.type = SX__FRAME_READ, .id = 1000 + i, .region = q[i].region,
                   .offset = q[i].off, .length = q[i].len};
    sx__frame_encode(&f, hdrs + i * SX__FRAME_HDR);
  }
  sxt_ok(sxt_wire_send(fd, hdrs, n * SX__FRAME_HDR));
  free(hdrs);
  for (size_t i = 0; i < n && i <= stop_after; i++) {
    uint8_t b[SX__FRAME_HDR];
    sx__frame g;
    sxt_ok(sxt_wire_recv(fd, b, sizeof(b)));
    assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX__FRAME_HDR);
    assert_int_equal(g.type, SX__FRAME_READ_REPLY);
    if (g.id != 1000 + i)
      fail_msg("reply %zu: id %lu, expected %lu", i, (unsigned long)g.id,
               (unsigned long)(1000 + i));
    assert_int_equal(g.status, q[i].want);
    if (q[i].want != 0)
      continue;
    assert_true(g.length == q[i].len);
    uint8_t *buf = malloc((size_t)g.length);
    assert_non_null(buf);
    if (i == stop_after) {
      sxt_ok(sxt_wire_recv(fd, buf, (size_t)g.length / 2));
      free(buf);
      return;
    }
    sxt_ok(sxt_wire_recv(fd, buf, (size_t)g.length));
    if (sx__pattern_check(buf, (size_t)g.length, seed, q[i].region, q[i].off, NULL) != 0)
      fail_msg("reply %zu: region %u offset %lu length %lu: wrong bytes", i, q[i].region,
               (unsigned long)q[i].off, (unsigned long)q[i].len);
    free(buf);
  }
}

/* A target with a GPU pool (t) and a host region (*host_id), HELLO said
 * on a raw connection: fd. */
typedef struct wire_target {
  sx_agent *a;
  gpu_pool t;
  uint8_t *host;
  uint32_t host_id;
  uint64_t host_len;
  sx_desc d;
  uint16_t port;
} wire_target;

static void wire_target_start(wire_target *w, uint64_t staging, uint64_t blocks,
                              uint64_t block_bytes) {
  char url[64];
  new_url(url, sizeof(url));
  w->a = gpu_agent(url, "pipe-t", staging, SX_TRANSPORTS_TCP);
  gpu_pool_make(&w->t, w->a, "cuda:0", 1, blocks, block_bytes, SEED);
  w->host_len = blocks * block_bytes;
  assert_non_null(w->host = malloc(w->host_len));
  sx_region_params rp = {.addr = w->host, .length = w->host_len, .group = 1,
                         .block_bytes = block_bytes,
                         .num_blocks = blocks, .location = "cpu",
                         .access = SX_ACCESS_REMOTE_READ};
  sxt_ok(sx_agent_register(w->a, &rp, &w->host_id));
  sx__pattern_fill(w->host, w->host_len, SEED, w->host_id, 0);
  sxt_ok(sx_agent_descriptor(w->a, &w->d));
  w->port = sxt_tcp_port(&w->d);
}

static int wire_open(const wire_target *w) {
  int fd = sxt_wire_connect(w->port);
  sxt_ok(sxt_wire_hello(fd, w->d.incarnation, w->d.token, "pipe-r"));
  return fd;
}

static void wire_target_stop(wire_target *w) {
  sx_desc_free(&w->d);
  sx_agent_destroy(w->a);
  gpu_pool_free(&w->t);
  free(w->host);
}

/* Requests of GPU regions, most of them small, some longer than a chunk,
 * mixed with reads of host memory and refused ones. */
static size_t wire_mix(const wire_target *w, wreq *q, size_t n, uint64_t x) {
  uint64_t len = w->host_len;
  for (size_t i = 0; i < n; i++) {
    uint64_t r = next_rand(&x), kind = r % 16;
    uint64_t l = 1 + (next_rand(&x) % 20000);
    if (kind == 0)
      l = 300000 + next_rand(&x) % 300000; /* several chunks */
    uint64_t off = next_rand(&x) % (len - l);
    q[i] = (wreq){.region = w->t.id[r % 2], .off = off, .len = l};
    if (kind == 1 || kind == 2)
      q[i].region = w->host_id;
    if (kind == 3)
      q[i] = (wreq){.region = w->t.id[0], .off = len - 10, .len = 11, .want = SX_EBOUNDS};
    if (kind == 4)
      q[i] = (wreq){.region = 9999, .off = 0, .len = 8, .want = SX_ENOREGION};
  }
  return n;
}

/* Many staged requests sent at once on one connection: every reply whole,
 * in request order, byte for byte, also among host and refused replies;
 * 1 MiB of staging (four chunks of 256 KiB), so replies also wait for
 * chunks. */
static void test_gpu_tcp_many_requests_one_connection(void **state) {
  (void)state;
  slow_copies(300);
  wire_target w;
  wire_target_start(&w, 1u << 20, 256, 4096);
  int fd = wire_open(&w);
  enum { N = 400 };
  wreq *q = calloc(N, sizeof(*q));
  for (uint64_t round = 0; round < 3; round++) {
    wire_mix(&w, q, N, 0x9e3779b97f4a7c15ull + round);
    wire_burst(fd, q, N, SEED, N);
  }
  /* Only GPU reads, all small. */
  for (size_t i = 0; i < N; i++)
    q[i] = (wreq){.region = w.t.id[i % 2], .off = (i * 7919) % (w.host_len - 4096),
                  .len = 1 + (i * 31) % 4096};
  wire_burst(fd, q, N, SEED, N);
  close(fd);
  free(q);
  wire_target_stop(&w);
  fast_copies();
}

/* One reply of a frame sent on fd: its header (type READ_REPLY, id) and,
 * with status 0, len bytes that match the pattern for ranges r[0..n). */
static int wire_reply(int fd, uint64_t id, const sx__range *r, uint32_t n, uint32_t *index) {
  uint8_t b[SX__FRAME_HDR];
  sx__frame g;
  sxt_ok(sxt_wire_recv(fd, b, sizeof(b)));
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX__FRAME_HDR);
  assert_int_equal(g.type, SX__FRAME_READ_REPLY);
  assert_true(g.id == id);
  *index = g.region;
  if (g.status != 0)
    return g.status;
  uint64_t sum = 0;
  for (uint32_t i = 0; i < n; i++)
    sum += r[i].length;
  assert_true(g.length == sum);
  for (uint32_t i = 0; i < n; i++) {
    uint8_t *buf = malloc((size_t)r[i].length);
    assert_non_null(buf);
    sxt_ok(sxt_wire_recv(fd, buf, (size_t)r[i].length));
    assert_int_equal(sx__pattern_check(buf, r[i].length, SEED, r[i].region, r[i].offset, NULL),
                     0);
    free(buf);
  }
  return 0;
}

/* READVs of host memory and READVs of GPU memory (staged, one reply: one
 * longer than a chunk, its chunks cut inside ranges; small ones grouped
 * with small READs into one chunk) between staged READs of GPU memory are
 * answered in order, byte for byte; a READV that mixes
 * host and GPU memory is refused (SX_EINVAL, naming the first range of
 * other memory than the first's), and the connection serves on. */
static void test_gpu_tcp_readv_host_and_gpu_in_order(void **state) {
  (void)state;
  slow_copies(300);
  wire_target w;
  wire_target_start(&w, 1u << 20, 256, 4096);
  int fd = wire_open(&w);
  sx__range hv[3] = {{w.host_id, 4096, 5000}, {w.host_id, 100, 77}, {w.host_id, 65536, 16384}};
  sx__range bad[2] = {{w.host_id, 0, 64}, {w.t.id[0], 0, 64}};
  sx__range bad2[3] = {{w.t.id[0], 0, 64}, {w.t.id[1], 64, 64}, {w.host_id, 0, 64}};
  /* 1 MiB of staging: chunks of 256 KiB, so gv (263 KiB) takes two, the
   * second starting inside its third range. */
  sx__range gv[4] = {{w.t.id[0], 12345, 200000}, {w.t.id[1], 8, 4096},
                     {w.t.id[0], 777, 65536}, {w.t.id[1], 300001, 3}};
  sx__range gs[2] = {{w.t.id[1], 4096, 100}, {w.t.id[0], 1, 5000}};
  /* Small READs and READVs of GPU memory that go in one group, then one
   * READV that does not fit the rest of its chunk. */
  sx__range s8 = {w.t.id[0], 999, 3000}, s10 = {w.t.id[1], 70000, 1};
  sx__range s9[3] = {{w.t.id[1], 5, 7000}, {w.t.id[0], 123456, 20000}, {w.t.id[1], 0, 1}};
  sx__range s11[2] = {{w.t.id[0], 65536, 4096}, {w.t.id[0], 4096, 65536}};
  sx__range s12[2] = {{w.t.id[0], 0, 255000}, {w.t.id[1], 5, 10}};
  uint32_t index = 9;
  /* READ (GPU, staged), READV (host), READ (GPU), READV (host and GPU),
   * READV (GPU), READV (GPU then host), READV (GPU), then READ, READV,
   * READ, READV, READV (GPU): all sent before any reply is read. */
  sx__range g0 = {w.t.id[0], 12345, 300000}, g1 = {w.t.id[1], 8, 4096};
  sxt_ok(sxt_wire_send_read(fd, 1, &g0));
  sxt_ok(sxt_wire_send_readv(fd, 2, hv, 3));
  sxt_ok(sxt_wire_send_read(fd, 3, &g1));
  sxt_ok(sxt_wire_send_readv(fd, 4, bad, 2));
  sxt_ok(sxt_wire_send_readv(fd, 5, gv, 4));
  sxt_ok(sxt_wire_send_readv(fd, 6, bad2, 3));
  sxt_ok(sxt_wire_send_readv(fd, 7, gs, 2));
  sxt_ok(sxt_wire_send_read(fd, 8, &s8));
  sxt_ok(sxt_wire_send_readv(fd, 9, s9, 3));
  sxt_ok(sxt_wire_send_read(fd, 10, &s10));
  sxt_ok(sxt_wire_send_readv(fd, 11, s11, 2));
  sxt_ok(sxt_wire_send_readv(fd, 12, s12, 2));
  sxt_ok(wire_reply(fd, 1, &g0, 1, &index));
  sxt_ok(wire_reply(fd, 2, hv, 3, &index));
  sxt_ok(wire_reply(fd, 3, &g1, 1, &index));
  assert_int_equal(wire_reply(fd, 4, bad, 2, &index), SX_EINVAL);
  assert_int_equal(index, 1);
  sxt_ok(wire_reply(fd, 5, gv, 4, &index));
  assert_int_equal(wire_reply(fd, 6, bad2, 3, &index), SX_EINVAL);
  assert_int_equal(index, 2);
  sxt_ok(wire_reply(fd, 7, gs, 2, &index));
  sxt_ok(wire_reply(fd, 8, &s8, 1, &index));
  sxt_ok(wire_reply(fd, 9, s9, 3, &index));
  sxt_ok(wire_reply(fd, 10, &s10, 1, &index));
  sxt_ok(wire_reply(fd, 11, s11, 2, &index));
  sxt_ok(wire_reply(fd, 12, s12, 2, &index));
  /* The connection serves on. */
  uint8_t *got = malloc(5000 + 77 + 16384);
  assert_non_null(got);
  sxt_ok(sxt_wire_readv(fd, 5, hv, 3, got, &index));
  assert_int_equal(sx__pattern_check(got, 5000, SEED, w.host_id, 4096, NULL), 0);
  assert_int_equal(sx__pattern_check(got + 5077, 16384, SEED, w.host_id, 65536, NULL), 0);
  free(got);
  close(fd);
  wire_target_stop(&w);
  fast_copies();
}

/* A reader that closes while replies are staged (one part-way out): every
 * chunk comes back (the next connection gets all of the small pool), the
 * region's reads are over (unregister returns), nothing leaks. */
static void test_gpu_tcp_reader_closes_with_replies_staged(void **state) {
  (void)state;
  slow_copies(2000);
  wire_target w;
  wire_target_start(&w, 1u << 20, 256, 4096);
  enum { N = 64 };
  wreq q[N];
  for (int k = 0; k < 3; k++) {
    int fd = wire_open(&w);
    for (size_t i = 0; i < N; i++)
      q[i] = (wreq){.region = w.t.id[0], .off = (i * 8192) % 400000,
                    .len = i % 4 ? 4096 : 600000};
    wire_burst(fd, q, N, SEED, (size_t)k * 3); /* gone after a few replies */
    close(fd);
  }
  /* Whole replies of the whole pool still come. */
  int fd = wire_open(&w);
  for (size_t i = 0; i < 8; i++)
    q[i] = (wreq){.region = w.t.id[1], .off = i * 4096, .len = (1u << 20) - 32768};
  wire_burst(fd, q, 8, SEED, 8);
  close(fd);
  sxt_ok(sx_agent_unregister(w.a, w.t.id[0]));
  wire_target_stop(&w);
  fast_copies();
}

typedef struct reader_run {
  sx_agent *a;
  sx_segment *seg;
  gpu_pool r;
  sx_block_read e[96];
  sx_batch *b[2];
} reader_run;

/* Several readers at once on a small staging budget at both ends (1 MiB:
 * four chunks per direction), small blocks, two batches each in flight:
 * everything completes and every byte is where it belongs. */
static void test_gpu_tcp_several_readers_small_staging(void **state) {
  (void)state;
  slow_copies(200);
  char url[64];
  new_url(url, sizeof(url));
  enum { READERS = 3, PER = 96 };
  const uint64_t bb = 8192, tblocks = 128, rblocks = 2 * PER;
  sx_agent *ta = gpu_agent(url, "multi-t", 1u << 20, SX_TRANSPORTS_TCP);
  gpu_pool t;
  gpu_pool_make(&t, ta, "cuda:0", 1, tblocks, bb, SEED);
  sxt_ok(sx_agent_publish(ta, 0));
  reader_run *rr = calloc(READERS, sizeof(*rr));
  for (int k = 0; k < READERS; k++) {
    char name[32];
    snprintf(name, sizeof(name), "multi-r%d", k);
    rr[k].a = gpu_agent(url, name, 1u << 20, SX_TRANSPORTS_TCP);
    gpu_pool_make(&rr[k].r, rr[k].a, k == 1 ? "cpu" : "cuda:0", 1, rblocks, bb, 0);
    sxt_ok(sx_segment_open(rr[k].a, "multi-t", 2000, &rr[k].seg));
  }
  for (uint32_t round = 0; round < 2; round++) {
    for (int k = 0; k < READERS; k++) {
      gpu_entries(rr[k].e, PER, 1, tblocks, rblocks, 1, round * 7 + (uint32_t)k + 1);
      for (int h = 0; h < 2; h++)
        rr[k].b[h] = sxt_batch_submit(rr[k].seg, rr[k].e + h * PER / 2, PER / 2, 30000);
    }
    for (int k = 0; k < READERS; k++) {
      for (int h = 0; h < 2; h++) {
        sx_batch_result res;
        sxt_ok(sx_batch_wait(rr[k].b[h], -1));
        sxt_ok(sx_batch_result_get(rr[k].b[h], &res));
        if (res.state != SX_BATCH_COMPLETED)
          fail_msg("reader %d batch %d: %s (%s)", k, h, sx_batch_state_name(res.state),
                   res.message);
        sx_batch_destroy(rr[k].b[h]);
      }
      assert_int_equal(gpu_pool_verify(&rr[k].r, rr[k].seg, SEED, rr[k].e, PER), 0);
    }
  }
  for (int k = 0; k < READERS; k++) {
    sx_segment_close(rr[k].seg);
    sx_agent_destroy(rr[k].a);
    gpu_pool_free(&rr[k].r);
  }
  free(rr);
  sx_agent_destroy(ta);
  gpu_pool_free(&t);
  fast_copies();
}

/* The target unregisters a region while many small staged replies of it
 * are in flight on one connection: unregister returns only once no copy
 * reads it (its memory is unmapped at once after, and a copy still
 * reading it would fault), the batch ends, later reads are refused. */
static void test_gpu_tcp_unregister_with_replies_staged(void **state) {
  (void)state;
  slow_copies(1000);
  char url[64];
  new_url(url, sizeof(url));
  const uint64_t bb = 16384, blocks = 256;
  sx_agent *ta = gpu_agent(url, "unreg-t", 1u << 20, SX_TRANSPORTS_TCP);
  sx_agent_params p;
  sxt_params(&p, url, "unreg-r");
  p.conns_per_peer = 1;
  p.transports = SX_TRANSPORTS_TCP;
  sx_agent *ra;
  sxt_ok(sx_agent_create(&p, &ra));
  gpu_pool t, r;
  gpu_pool_make(&t, ta, "cuda:0", 1, blocks, bb, SEED);
  gpu_pool_make(&r, ra, "cuda:0", 1, blocks, bb, 0);
  sxt_ok(sx_agent_publish(ta, 0));
  sx_segment *seg;
  sxt_ok(sx_segment_open(ra, "unreg-t", 2000, &seg));
  sx_block_read all = {.layer_count = 1, .slots = SXT_KV, .count = blocks};
  unreg_arg u = {.a = ta, .id = t.id[0]};
  pthread_t th;
  sx_batch *b = sxt_batch_submit(seg, &all, 1, 30000);
  assert_int_equal(pthread_create(&th, NULL, unreg_thread, &u), 0);
  pthread_join(th, NULL);
  sxt_ok(u.rc);
  sx__mem_free(t.mem[0]); /* nothing may read it any more */
  t.mem[0] = NULL;
  sxt_ok(sx_batch_wait(b, -1));
  sx_batch_destroy(b);
  sx_batch_result res = sxt_run_batch(seg, &all, 1, 5000);
  assert_int_equal(res.state, SX_BATCH_FAILED);
  assert_int_equal(res.error, SX_ENOREGION);
  /* V is still served, whole. */
  sx_block_read v = {.layer_count = 1, .slots = 1ull << SX_SLOT_V, .count = blocks};
  res = sxt_run_batch(seg, &v, 1, 30000);
  if (res.state != SX_BATCH_COMPLETED)
    fail_msg("V after the unregister: %s", res.message);
  sx_segment_close(seg);
  sx_agent_destroy(ra);
  sx_agent_destroy(ta);
  gpu_pool_free(&r);
  gpu_pool_free(&t);
  fast_copies();
}

static int need_gpu(void **state) {
  (void)state;
  if (gpu_devices() == 0) {
    fprintf(stderr, "test_gpu_tcp: no CUDA device: %s\n", sx_errmsg());
    return -1;
  }
  return 0;
}

/* One burst of small READs that alternate between GPU regions of two
 * devices and host memory, with hostile ones among them: a range past a
 * region's end, an offset that overflows, zero bytes, more than a READ may
 * ask, a region that does not exist.  A group never spans two devices
 * (each device's regions are copied on a stream of that device); every
 * reply is whole, in order, byte for byte, every refusal the right one,
 * and the connection goes on. */
static void test_gpu_tcp_group_across_devices_and_refusals(void **state) {
  (void)state;
  if (gpu_devices() < 2)
    skip();
  wire_target w;
  wire_target_start(&w, 1u << 20, 256, 4096);
  uint64_t len = w.host_len;
  uint8_t *dev1 = NULL, *host = malloc(len);
  assert_non_null(host);
  sxt_ok(sx__mem_alloc(1, len, (void **)&dev1));
  sx_region_params rp = {.addr = dev1, .length = len, .group = 2, .block_bytes = 4096,
                         .num_blocks = 256, .location = "cuda:1",
                         .access = SX_ACCESS_REMOTE_READ};
  uint32_t id1;
  sxt_ok(sx_agent_register(w.a, &rp, &id1));
  sx__pattern_fill(host, len, SEED, id1, 0);
  sxt_ok(sx__mem_copy(dev1, host, len));
  free(host);
  int fd = wire_open(&w);
  enum { N = 240 };
  wreq q[N];
  const uint32_t where[4] = {w.t.id[0], id1, w.host_id, w.t.id[1]};
  for (size_t i = 0; i < N; i++) {
    q[i] = (wreq){.region = where[i % 4], .off = (i * 7919) % (len - 4096),
                  .len = 1 + (i * 131) % 4096};
    switch (i % 23) {
    case 5:
      q[i] = (wreq){.region = id1, .off = len - 100, .len = 101, .want = SX_EBOUNDS};
      break;
    case 9:
      q[i] = (wreq){.region = w.t.id[0], .off = UINT64_MAX - 8, .len = 16,
                    .want = SX_EBOUNDS};
      break;
    case 13:
      q[i] = (wreq){.region = id1, .off = 0, .len = 0, .want = SX_EINVAL};
      break;
    case 17:
      q[i] = (wreq){.region = w.t.id[1], .off = 0, .len = (64u << 20) + 1,
                    .want = SX_ELIMIT};
      break;
    case 21:
      q[i] = (wreq){.region = 4242, .off = 0, .len = 8, .want = SX_ENOREGION};
      break;
    }
  }
  wire_burst(fd, q, N, SEED, N);
  /* Only the two devices, alternating, each read one block. */
  for (size_t i = 0; i < N; i++)
    q[i] = (wreq){.region = i % 2 ? id1 : w.t.id[0], .off = (i % 256) * 4096, .len = 4096};
  wire_burst(fd, q, N, SEED, N);
  close(fd);
  sxt_ok(sx_agent_unregister(w.a, id1));
  sx__mem_free(dev1);
  wire_target_stop(&w);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gpu_pointer_checks),
      cmocka_unit_test(test_gpu_tcp_gpu_to_host),
      cmocka_unit_test(test_gpu_tcp_host_to_gpu),
      cmocka_unit_test(test_gpu_tcp_gpu_to_gpu),
      cmocka_unit_test(test_gpu_gather_kernel),
      cmocka_unit_test(test_gpu_tcp_small_blocks_in_groups),
      cmocka_unit_test(test_gpu_tcp_small_staging_large_blocks),
      cmocka_unit_test(test_gpu_tcp_two_gpus),
      cmocka_unit_test(test_gpu_tcp_staged_replies_on_threads),
      cmocka_unit_test(test_gpu_tcp_deadline_and_unregister),
      cmocka_unit_test(test_gpu_tcp_many_requests_one_connection),
      cmocka_unit_test(test_gpu_tcp_group_across_devices_and_refusals),
      cmocka_unit_test(test_gpu_tcp_readv_host_and_gpu_in_order),
      cmocka_unit_test(test_gpu_tcp_reader_closes_with_replies_staged),
      cmocka_unit_test(test_gpu_tcp_several_readers_small_staging),
      cmocka_unit_test(test_gpu_tcp_unregister_with_replies_staged),
  };
  return cmocka_run_group_tests(tests, need_gpu, NULL);
}
