/*
 * GPU memory over RDMA, staged through pinned rings (docs/gpu.md), where an
 * RDMA device exists (the Soft-RoCE VM), on the host-memory stand-in for the
 * CUDA driver that run.sh names in SX_CUDA_LIBRARY (tests/gpu/fake_cuda.c).
 * It proves the staging protocol, its checks and its failure handling over
 * real verbs; it says nothing about real GPU copies.
 *
 * Pools are sx-agent processes with their pool in "device memory"
 * (--location cuda:0); readers are agents in this process whose
 * destinations are device memory too, or host memory.
 */
#include <dlfcn.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "internal.h"
#include "mem/mem.h"
#include "transport/rdma/rdma_stage.h"
#include "pattern.h"
#include "proc_env.h"
#include "segxfer/store.h"

#define LAYERS 4
#define N_SLOTS 2
#define REGION_SKEW (4096 + 512)

static sxt_proc_env env;
static int seq;

static int reap(pid_t pid, int ms) { return sxt_reap_log(pid, ms, NULL); }

#define pool_fail(p, ...)                                                      \
  do {                                                                         \
    sxt_show_log((p)->log);                                                    \
    fail_msg(__VA_ARGS__);                                                     \
  } while (0)

typedef struct shape {
  uint32_t block, blocks;
  const char *location; /* the pool's */
} shape;

static void pool_start(sxt_pool *p, const char *name, uint64_t seed, const shape *s) {
  const char *more[] = {"--location", s->location, "--rdma-devices", getenv("RXE_DEV"), NULL};
  if (more[3] == NULL)
    more[2] = NULL;
  sxt_pool_opts o = {.layers = LAYERS, .block_bytes = s->block, .num_blocks = s->blocks,
                     .slots = "K,V", .fingerprint = "rdma-gpu/v1", .lease_ms = 3000,
                     .log_level = "info", .more = more, .publish_ms = 30000};
  sxt_pool_start(&env, p, name, seed, &o);
}

/* A reader: its destinations on the GPU (device memory of the stand-in)
 * or in host memory. */
typedef struct rd {
  sx_agent *a;
  int gpu;
  uint64_t bytes; /* per slot */
  uint32_t blocks;
  uint8_t *mem[N_SLOTS]; /* device or host memory: the regions */
  uint8_t *alloc[N_SLOTS]; /* the allocations holding them */
  uint8_t *host[N_SLOTS]; /* host copies for checks */
} rd;

static void reader_start(rd *r, const char *name, const shape *s, int gpu) {
  memset(r, 0, sizeof(*r));
  sx_agent_params p;
  sxt_params(&p, env.url, name);
  snprintf(p.layout.fingerprint, sizeof(p.layout.fingerprint), "rdma-gpu/v1");
  /* Pool and reader share a host here: keep cuda_ipc out of the choice, as
   * if they were two hosts. */
  p.transports = SX_TRANSPORTS_RDMA | SX_TRANSPORTS_TCP;
  sxt_ok(sx_agent_create(&p, &r->a));
  r->gpu = gpu;
  r->blocks = s->blocks;
  uint64_t layer = (uint64_t)s->blocks * s->block;
  r->bytes = LAYERS * layer;
  for (uint32_t k = 0; k < N_SLOTS; k++) {
    void *m = NULL;
    /* The regions start 4 KiB + 512 bytes into their allocations, so a
     * dma-buf export must round to pages and pass the offset. */
    if (gpu)
      sxt_ok(sx__mem_alloc(0, r->bytes + REGION_SKEW + 4096, &m));
    else
      m = calloc(1, r->bytes + REGION_SKEW + 4096);
    assert_non_null(m);
    r->alloc[k] = m;
    r->mem[k] = (uint8_t *)m + REGION_SKEW;
    m = r->mem[k];
    r->host[k] = calloc(1, r->bytes);
    assert_non_null(r->host[k]);
    sx_region_params rp = {.addr = m, .length = r->bytes, .layer_count = LAYERS,
                           .layer_stride = layer, .slot = k, .block_bytes = s->block,
                           .num_blocks = s->blocks, .location = gpu ? "cuda:0" : "cpu"};
    uint32_t id;
    sxt_ok(sx_agent_register(r->a, &rp, &id));
  }
}

static void reader_stop(rd *r) {
  sx_agent_destroy(r->a);
  for (int k = 0; k < N_SLOTS; k++) {
    if (r->gpu)
      sx__mem_free(r->alloc[k]);
    else
      free(r->alloc[k]);
    free(r->host[k]);
  }
}

static void fill(rd *r, int byte) {
  for (int k = 0; k < N_SLOTS; k++) {
    memset(r->host[k], byte, r->bytes);
    sxt_ok(sx__mem_copy(r->mem[k], r->host[k], r->bytes));
  }
}

/* Every block e brought equals the pool's pattern (checked on host copies
 * of the destinations). */
static int verify(rd *r, const sx_segment *seg, uint64_t seed, const sx_block_read *e) {
  for (int k = 0; k < N_SLOTS; k++)
    sxt_ok(sx__mem_copy(r->host[k], r->mem[k], r->bytes));
  return sxt_verify(r->host, r->blocks, seg, seed, e);
}

static sx_segment *open_rdma(rd *r, const char *name) {
  sx_segment *seg;
  sxt_ok(sx_segment_open(r->a, name, 5000, &seg));
  if (sx_segment_transport(seg) != SX_TRANSPORT_RDMA)
    fail_msg("%s would be read over transport %d, not RDMA", name,
             (int)sx_segment_transport(seg));
  return seg;
}

static void entries(sx_block_read *e, size_t n, uint32_t blocks, uint32_t *rng) {
  uint64_t local = 0;
  for (size_t i = 0; i < n; i++) {
    *rng = *rng * 1103515245u + 12345u;
    uint32_t v = *rng >> 4;
    uint64_t count = 1 + v % 2;
    uint32_t lf = (v >> 3) % LAYERS;
    e[i] = (sx_block_read){.layer_first = lf, .layer_count = 1 + (v >> 6) % (LAYERS - lf),
                           .slots = 1 + (v >> 9) % 3,
                           .remote_block = (v >> 12) % (blocks - count),
                           .local_block = local, .count = count};
    local += count;
    assert_true(local <= blocks);
  }
}

static void next_name(char *buf, size_t size, const char *prefix) {
  snprintf(buf, size, "%s-%d", prefix, seq++);
}

static uint64_t kernels(void) {
  uint64_t c[4];
  sx__mem_copy_counts(c);
  return c[SX__COPY_KERNEL];
}

/* Random scattered blocks and then the whole pool, byte for byte.  The
 * ring copies go by the gather kernel wherever a slot carries several
 * pieces and every pointer is device memory of one GPU or the pinned ring:
 * on the reader (this process: counted) for GPU destinations, on the
 * target (its log says so) for a GPU pool; host destinations never get
 * the kernel (pageable memory: copy engines or memcpy). */
static void read_and_verify(const shape *s, int reader_gpu, uint64_t seed) {
  char name[64];
  next_name(name, sizeof(name), "gpool");
  sxt_pool p;
  pool_start(&p, name, seed, s);
  rd r;
  reader_start(&r, "rdma-gpu-reader", s, reader_gpu);
  sx_segment *seg = open_rdma(&r, name);
  sx_mismatch m;
  sxt_ok(sx_segment_check(seg, 0, &m));
  uint64_t k0 = kernels();
  uint32_t rng = (uint32_t)seed;
  sx_block_read e[40];
  size_t n = s->blocks >= 80 ? 40 : s->blocks / 2;
  for (int round = 0; round < 3; round++) {
    fill(&r, 0xee);
    entries(e, n, s->blocks, &rng);
    sx_batch_result res = sxt_run_batch(seg, e, n, 60000);
    if (res.state != SX_BATCH_COMPLETED)
      pool_fail(&p, "round %d: %s: %s", round, sx_batch_state_name(res.state), res.message);
    assert_int_equal(res.transport, SX_TRANSPORT_RDMA);
    for (size_t i = 0; i < n; i++)
      if (verify(&r, seg, seed, &e[i]) != 0)
        pool_fail(&p, "round %d entry %zu: bytes differ", round, i);
  }
  fill(&r, 0x11);
  sx_block_read all = {.layer_count = LAYERS, .slots = 3, .count = s->blocks};
  sx_batch_result res = sxt_run_batch(seg, &all, 1, 120000);
  if (res.state != SX_BATCH_COMPLETED)
    pool_fail(&p, "whole pool: %s: %s", sx_batch_state_name(res.state), res.message);
  if (verify(&r, seg, seed, &all) != 0)
    pool_fail(&p, "whole pool: bytes differ");
  print_message("%s pool (%u blocks of %u bytes) into %s memory over staged RDMA: %.1f MiB/s, "
                "%lu gather kernel launches here\n", s->location, s->blocks, s->block,
                reader_gpu ? "GPU" : "host",
                (double)res.bytes / ((double)res.transfer_ns / 1e9) / 1048576.0,
                (unsigned long)(kernels() - k0));
  int several = s->block <= SX__RDMA_STAGE_SLOT_BYTES / 2;
  if (reader_gpu && several && kernels() == k0)
    pool_fail(&p, "GPU destinations, several pieces per slot: no gather kernel ran");
  if (!reader_gpu && kernels() != k0)
    pool_fail(&p, "host destinations: the gather kernel ran");
  if (strcmp(s->location, "cpu") != 0 && several &&
      !sxt_log_has(p.log, "rdma staged (target): ring copies by kernel"))
    pool_fail(&p, "GPU pool, several pieces per slot: the target's ring copies were not "
              "by the gather kernel");
  sx_segment_close(seg);
  reader_stop(&r);
  assert_int_equal(sxt_pool_stop(&p, SIGTERM), 0);
}

static const shape small_gpu = {.block = 4096, .blocks = 256, .location = "cuda:0"};
static const shape large_gpu = {.block = 3u << 20, .blocks = 4, .location = "cuda:0"};
static const shape host_pool = {.block = 65536, .blocks = 64, .location = "cpu"};

static void test_rdma_gpu_small_blocks_gpu_to_gpu(void **state) {
  (void)state;
  read_and_verify(&small_gpu, 1, 4242);
}

/* Blocks of 3 MiB: each spans several 1 MiB slots. */
static void test_rdma_gpu_large_blocks_gpu_to_gpu(void **state) {
  (void)state;
  read_and_verify(&large_gpu, 1, 77);
}

static void test_rdma_gpu_gpu_pool_into_host_memory(void **state) {
  (void)state;
  read_and_verify(&small_gpu, 0, 9);
}

/* Host pool, GPU reader: READs of the region itself into the reader's
 * ring (no request), then copies into device memory. */
static void test_rdma_gpu_host_pool_into_gpu_memory(void **state) {
  (void)state;
  read_and_verify(&host_pool, 1, 31);
}

/* sxctl read --location cuda:0 --transport rdma: a program's reads into GPU
 * memory over staged RDMA, verified against the pool's pattern. */
static void test_rdma_gpu_sxctl_read_into_gpu(void **state) {
  (void)state;
  char name[64], exe[PATH_MAX + 16], log[300], out[8192];
  next_name(name, sizeof(name), "gpool");
  sxt_pool p;
  pool_start(&p, name, 271828, &small_gpu);
  snprintf(exe, sizeof(exe), "%s/sxctl", env.bindir);
  snprintf(log, sizeof(log), "%s/sxctl-read.log", env.tmpdir);
  unlink(log);
  const char *argv[] = {exe, "--metadata", env.url, "read", name, "--blocks", "random:100",
                        "--verify", "271828", "--fingerprint", "rdma-gpu/v1", "--transport",
                        "rdma", "--location", "cuda:0", NULL};
  int rc = reap(sxt_spawn_ok(log, argv), 60000);
  FILE *f = fopen(log, "r");
  size_t n = f != NULL ? fread(out, 1, sizeof(out) - 1, f) : 0;
  out[n] = '\0';
  if (f != NULL)
    fclose(f);
  if (rc != 0 || strstr(out, "via rdma") == NULL)
    pool_fail(&p, "sxctl read --location cuda:0 over rdma exited %d:\n%s", rc, out);
  print_message("%s", out);
  assert_int_equal(sxt_pool_stop(&p, SIGTERM), 0);
}

/* SX_RDMA_GPU=off keeps GPU memory off RDMA: the segment goes over TCP. */
static void test_rdma_gpu_tier_off_chooses_tcp(void **state) {
  (void)state;
  char name[64];
  next_name(name, sizeof(name), "gpool");
  sxt_pool p;
  pool_start(&p, name, 5, &small_gpu);
  setenv("SX_RDMA_GPU", "off", 1);
  rd r;
  reader_start(&r, "rdma-gpu-off", &small_gpu, 1);
  unsetenv("SX_RDMA_GPU");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, name, 5000, &seg));
  assert_int_equal(sx_segment_transport(seg), SX_TRANSPORT_TCP);
  sx_block_read e = {.layer_count = LAYERS, .slots = 3, .remote_block = 3, .count = 5};
  sx_batch_result res = sxt_run_batch(seg, &e, 1, 30000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(verify(&r, seg, 5, &e), 0);
  sx_segment_close(seg);
  reader_stop(&r);
  assert_int_equal(sxt_pool_stop(&p, SIGTERM), 0);
}

/* A target that keeps GPU memory off RDMA refuses stage QPs: a reader that
 * tries fails with SX_ENOTSUP and the reason, and nothing is read. */
static void test_rdma_gpu_target_with_staging_off_refuses(void **state) {
  (void)state;
  char name[64];
  next_name(name, sizeof(name), "gpool");
  setenv("SX_RDMA_GPU", "off", 1);
  sxt_pool p;
  pool_start(&p, name, 14, &small_gpu);
  unsetenv("SX_RDMA_GPU");
  rd r;
  reader_start(&r, "rdma-gpu-refused", &small_gpu, 1);
  sx_segment *seg = open_rdma(&r, name);
  sx_block_read e = {.layer_count = 1, .slots = 1, .count = 4};
  sx_batch_result res = sxt_run_batch(seg, &e, 1, 20000);
  print_message("staging refused: %s %s: %s\n", sx_batch_state_name(res.state),
                sx_err_name(res.error), res.message);
  assert_int_equal(res.state, SX_BATCH_FAILED);
  assert_int_equal(res.error, SX_ENOTSUP);
  assert_non_null(strstr(res.message, "SX_RDMA_GPU=off"));
  sx_segment_close(seg);
  reader_stop(&r);
  assert_int_equal(sxt_pool_stop(&p, SIGTERM), 0);
}

/* A deadline ends a staged batch: TIMEOUT, and nothing lands afterwards. */
static void test_rdma_gpu_deadline_and_nothing_lands_after(void **state) {
  (void)state;
  const shape s = {.block = 1u << 20, .blocks = 16, .location = "cuda:0"};
  char name[64];
  next_name(name, sizeof(name), "gpool");
  sxt_pool p;
  pool_start(&p, name, 6, &s);
  rd r;
  reader_start(&r, "rdma-gpu-deadline", &s, 1);
  sx_segment *seg = open_rdma(&r, name);
  fill(&r, 0xab);
  sx_block_read all = {.layer_count = LAYERS, .slots = 3, .count = s.blocks};
  sx_batch_result res = sxt_run_batch(seg, &all, 1, 200);
  print_message("staged whole-pool batch with a 200 ms deadline: %s, %lu bytes: %s\n",
                sx_batch_state_name(res.state), (unsigned long)res.bytes, res.message);
  assert_int_equal(res.state, SX_BATCH_TIMEOUT);
  for (int k = 0; k < N_SLOTS; k++)
    sxt_ok(sx__mem_copy(r.host[k], r.mem[k], r.bytes));
  uint8_t *snap = malloc(r.bytes);
  assert_non_null(snap);
  sxt_sleep_ms(1000);
  for (int k = 0; k < N_SLOTS; k++) {
    sxt_ok(sx__mem_copy(snap, r.mem[k], r.bytes));
    if (memcmp(snap, r.host[k], r.bytes) != 0)
      fail_msg("slot %d of a timed-out staged batch changed after it ended", k);
  }
  free(snap);
  sx_block_read e = {.layer_count = LAYERS, .slots = 3, .remote_block = 2, .count = 3};
  res = sxt_run_batch(seg, &e, 1, 30000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(verify(&r, seg, 6, &e), 0);
  sx_segment_close(seg);
  reader_stop(&r);
  assert_int_equal(sxt_pool_stop(&p, SIGTERM), 0);
}

/* The target dies in the middle of a staged batch: the batch fails within
 * its deadline, later batches do not succeed, this process is fine. */
static void test_rdma_gpu_target_killed_during_a_batch(void **state) {
  (void)state;
  const shape s = {.block = 1u << 20, .blocks = 32, .location = "cuda:0"};
  char name[64];
  next_name(name, sizeof(name), "gpool");
  sxt_pool p;
  pool_start(&p, name, 8, &s);
  rd r;
  reader_start(&r, "rdma-gpu-kill", &s, 1);
  sx_segment *seg = open_rdma(&r, name);
  sx_block_read one = {.layer_count = 1, .slots = 1, .count = 1};
  assert_int_equal(sxt_run_batch(seg, &one, 1, 20000).state, SX_BATCH_COMPLETED);
  const uint32_t deadline = 30000;
  sx_block_read all = {.layer_count = LAYERS, .slots = 3, .count = s.blocks};
  sx_batch *b = sxt_batch_submit(seg, &all, 1, deadline);
  uint64_t t0 = sx__mono_ms();
  sxt_sleep_ms(300);
  assert_int_equal(sx_batch_poll(b), SX_EBUSY);
  kill(p.pid, SIGKILL);
  assert_int_equal(reap(p.pid, 10000), 128 + SIGKILL);
  p.pid = 0;
  sxt_ok(sx_batch_wait(b, (int)deadline + 5000));
  uint64_t took = sx__mono_ms() - t0;
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  print_message("staged batch ended %lu ms after submit: %s %s: %s\n", (unsigned long)took,
                sx_batch_state_name(res.state), sx_err_name(res.error), res.message);
  assert_int_equal(res.state, SX_BATCH_FAILED);
  if (res.error != SX_EDISCONN && res.error != SX_EUNREACH && res.error != SX_ETIMEDOUT)
    fail_msg("the batch failed with %s", sx_err_name(res.error));
  assert_true(took < deadline);
  sx_batch_destroy(b);
  res = sxt_run_batch(seg, &one, 1, 5000);
  assert_int_not_equal(res.state, SX_BATCH_COMPLETED);
  sx_segment_close(seg);
  reader_stop(&r);
}

/* ------------------------------------------------------------ GPUDirect tiers
 * `test_rdma_gpu gpudirect` runs under LD_PRELOAD=libsxibvshim.so
 * (tests/rdma/sx_ibv_shim.c), which plays a provider that takes dma-buf MRs
 * of the stand-in's memory.  This proves detection, export offsets, fd
 * lifetime, rkeys and the fallbacks between tiers; not GPU peer to peer. */

static char shim_log[300], sysfs[300];
static int group_setup(void **state);
static int group_teardown(void **state);

/* Start a GPU pool with the shim (and the sysfs stand-in) in mode dmabuf and
 * peermem, read it into GPU memory byte for byte, and check what the pool
 * registered: rkeys on its GPU regions (GPUDirect) or none (staged), and
 * that its log names the tier (and why it fell back). */
static void tier_case(const char *dmabuf, const char *peermem, int modules, int expect_rkeys,
                      const char *expect_log) {
  const shape s = {.block = 65536, .blocks = 32, .location = "cuda:0"};
  char name[64];
  next_name(name, sizeof(name), "tpool");
  setenv("SXSHIM_DMABUF", dmabuf, 1);
  setenv("SXSHIM_PEERMEM", peermem, 1);
  if (modules)
    setenv("SX_RDMA_SYSFS", sysfs, 1);
  sxt_pool p;
  pool_start(&p, name, 12, &s);
  unsetenv("SX_RDMA_SYSFS");
  setenv("SXSHIM_DMABUF", "ok", 1);
  unsetenv("SXSHIM_PEERMEM");
  rd r;
  reader_start(&r, "rdma-gpu-tiers", &s, 1);
  sx_segment *seg = open_rdma(&r, name);
  const sx_desc *d = sx_segment_desc(seg);
  for (uint32_t i = 0; i < d->n_regions; i++) {
    assert_true(d->regions[i].n_rkeys >= 1);
    if ((d->regions[i].rkeys[0] != 0) != expect_rkeys)
      pool_fail(&p, "region %u published rkey 0x%x; expected %s", d->regions[i].id,
                d->regions[i].rkeys[0], expect_rkeys ? "an MR" : "none (staged)");
  }
  if (!sxt_log_has(p.log, expect_log))
    pool_fail(&p, "the pool's log does not say '%s'", expect_log);
  sx_block_read all = {.layer_count = LAYERS, .slots = 3, .count = s.blocks};
  fill(&r, 0x5a);
  sx_batch_result res = sxt_run_batch(seg, &all, 1, 60000);
  if (res.state != SX_BATCH_COMPLETED)
    pool_fail(&p, "%s: %s", sx_batch_state_name(res.state), res.message);
  if (verify(&r, seg, 12, &all) != 0)
    pool_fail(&p, "bytes differ");
  print_message("dma-buf %s, peermem %s%s: %s, %.1f MiB/s\n", dmabuf, peermem,
                modules ? " (module loaded)" : "", expect_rkeys ? "GPUDirect" : "staged",
                (double)res.bytes / ((double)res.transfer_ns / 1e9) / 1048576.0);
  sx_segment_close(seg);
  reader_stop(&r);
  assert_int_equal(sxt_pool_stop(&p, SIGTERM), 0);
}

/* The probe answers EBADF, exports succeed: both sides register through
 * dma-buf (the reader's regions at an offset inside their allocations), the
 * pool publishes rkeys, the read is direct, and the fds are closed. */
static void test_rdma_gpu_dmabuf_tier(void **state) {
  (void)state;
  tier_case("ok", "ok", 0, 1, "dma-buf GPUDirect");
  assert_true(sxt_log_has(shim_log, "probe -> EBADF"));
  /* The reader's own exports: offset 512 into the fd (4 KiB + 512 into
   * the allocation, rounded down to its page), iova = the region. */
  char want[64];
  snprintf(want, sizeof(want), " off 512 len ");
  assert_true(sxt_log_has(shim_log, want));
  long (*memops)(void) = NULL;
  void *h = dlopen(getenv("SX_CUDA_LIBRARY"), RTLD_NOW | RTLD_NOLOAD);
  if (h != NULL)
    *(void **)&memops = dlsym(h, "fake_cuda_sync_memops");
  assert_non_null(memops);
  assert_true(memops() >= N_SLOTS); /* SYNC_MEMOPS on every exported region */
  /* The reader's READs landed in its GPU memory directly: flushed. */
  long (*flushes)(void) = NULL;
  *(void **)&flushes = dlsym(h, "fake_cuda_flushes");
  assert_non_null(flushes);
  assert_true(flushes() >= 1);
}

/* dma-buf registration fails, no peer-memory module: staged, and the log
 * says why at each step. */
static void test_rdma_gpu_dmabuf_fails_to_staged(void **state) {
  (void)state;
  tier_case("fail", "ok", 0, 0, "staged (dma-buf: ibv_reg_dmabuf_mr");
}

/* The provider refuses dma-buf (as rxe does), nvidia_peermem is loaded:
 * ibv_reg_mr on the device pointer. */
static void test_rdma_gpu_peermem_tier(void **state) {
  (void)state;
  tier_case("off", "ok", 1, 1, "peermem GPUDirect");
}

/* dma-buf registers, but the NIC cannot read the memory: the loopback READ
 * at registration fails (remote access error), the pair is staged. */
static void test_rdma_gpu_unreachable_pair_is_staged(void **state) {
  (void)state;
  tier_case("unreachable", "ok", 0, 0, "loopback READ of GPU memory on");
}

/* 1 when the agent's Prometheus text has the unreachable-pair counter
 * with value v, and its HELP and TYPE lines. */
static int metric_is(sx_agent *a, uint64_t v) {
  char *text = NULL, want[96];
  sxt_ok(sx_agent_metrics_text(a, &text, NULL));
  snprintf(want, sizeof(want), "\nsegxfer_rdma_gpu_unreachable_pairs_total %llu\n",
           (unsigned long long)v);
  int ok = strstr(text, want) != NULL &&
           strstr(text, "# HELP segxfer_rdma_gpu_unreachable_pairs_total ") != NULL &&
           strstr(text, "# TYPE segxfer_rdma_gpu_unreachable_pairs_total counter\n") != NULL;
  if (!ok)
    print_error("no '%s' in:\n%s\n", want + 1, text);
  free(text);
  return ok;
}

/* Register a remote-readable GPU region of 1 MiB for slot on an agent of
 * this process; its allocation in *mem. */
static void gpu_region(sx_agent *a, uint32_t slot, void **mem) {
  sxt_ok(sx__mem_alloc(0, 1 << 20, mem));
  sx_region_params rp = {.addr = *mem, .length = 1 << 20, .layer_count = 1,
                         .layer_stride = 1 << 20, .slot = slot, .block_bytes = 4096,
                         .num_blocks = 256, .location = "cuda:0",
                         .access = SX_ACCESS_REMOTE_READ};
  uint32_t id;
  sxt_ok(sx_agent_register(a, &rp, &id));
}

/* The unreachable pair is counted in the Prometheus output.  With
 * SXSHIM_DMABUF=unreachable the shim registers dma-buf MRs without remote
 * access, so the loopback READ of the first remote-readable GPU region
 * fails: 0 before, 1 after, still 1 for a second region of the same pair
 * (a pair is tested once); an agent whose pair is reachable says 0. */
static void test_rdma_gpu_unreachable_pair_metric(void **state) {
  (void)state;
  char url[64];
  sxt_mem_url(url, sizeof(url), "rgpumetric");
  sx_agent_params p;
  sxt_params(&p, url, "metric-gpu");
  p.transports = SX_TRANSPORTS_RDMA | SX_TRANSPORTS_TCP;
  sx_agent *a;
  void *m1 = NULL, *m2 = NULL, *m3 = NULL;
  setenv("SXSHIM_DMABUF", "unreachable", 1);
  sxt_ok(sx_agent_create(&p, &a));
  assert_true(metric_is(a, 0));
  gpu_region(a, 0, &m1);
  assert_true(metric_is(a, 1));
  gpu_region(a, 1, &m2);
  assert_true(metric_is(a, 1));
  sx_agent_stats st;
  sxt_ok(sx_agent_stats_get(a, &st, sizeof(st)));
  assert_int_equal(st.rdma_gpu_unreachable, 1);
  sx_agent_destroy(a);
  setenv("SXSHIM_DMABUF", "ok", 1);
  sxt_ok(sx_agent_create(&p, &a));
  gpu_region(a, 0, &m3);
  assert_true(metric_is(a, 0));
  sx_agent_destroy(a);
  sx__mem_free(m1);
  sx__mem_free(m2);
  sx__mem_free(m3);
}

/* peermem loaded but the provider cannot pin the pages (EFAULT): staged. */
static void test_rdma_gpu_peermem_efault_to_staged(void **state) {
  (void)state;
  tier_case("off", "efault", 1, 0, "peermem: ibv_reg_mr(");
}

/* The stand-in enforces the real export rules; the memory layer rounds the
 * region's own range to pages and reports where it lies in the fd. */
static void test_rdma_gpu_dmabuf_export_rules(void **state) {
  (void)state;
  void *m = NULL;
  sxt_ok(sx__mem_alloc(0, 1 << 20, &m));
  int fd = -1;
  uint64_t off = 0;
  sxt_ok(sx__mem_dmabuf_export((uint8_t *)m + 8192 + 100, 5000, 0, &fd, &off));
  assert_true(fd >= 0);
  assert_int_equal(off, 100);
  close(fd);
  /* A range that leaves its allocation is refused by the driver. */
  sxt_rc(sx__mem_dmabuf_export((uint8_t *)m + (1 << 20) - 4096, 8192, 0, &fd, &off), SX_EIO);
  sxt_rc(sx__mem_dmabuf_export(m, 0, 0, &fd, &off), SX_EINVAL);
  assert_int_equal(sx__mem_dmabuf_supported(0), 1);
  sx__mem_free(m);
}

static int gd_setup(void **state) {
  if (getenv("LD_PRELOAD") == NULL || strstr(getenv("LD_PRELOAD"), "libsxibvshim") == NULL) {
    fprintf(stderr, "test_rdma_gpu gpudirect: run it with LD_PRELOAD=libsxibvshim.so\n");
    return -1;
  }
  int rc = group_setup(state);
  if (rc)
    return rc;
  snprintf(shim_log, sizeof(shim_log), "%s/shim.log", env.tmpdir);
  setenv("SXSHIM_LOG", shim_log, 1);
  snprintf(sysfs, sizeof(sysfs), "%s/sys", env.tmpdir);
  char mod[400];
  snprintf(mod, sizeof(mod), "%s/module/nvidia_peermem", sysfs);
  char cmd[500];
  snprintf(cmd, sizeof(cmd), "mkdir -p '%s'", mod);
  return system(cmd) == 0 ? 0 : -1;
}

static int group_setup(void **state) {
  (void)state;
  static int done;
  if (done++)
    return 0;
  int n = 0;
  if (sx__mem_cuda_devices(&n) != 0 || n == 0) {
    fprintf(stderr, "test_rdma_gpu: no CUDA device, not even the stand-in (SX_CUDA_LIBRARY=%s):"
            " %s\n", getenv("SX_CUDA_LIBRARY") ? getenv("SX_CUDA_LIBRARY") : "unset",
            sx_errmsg());
    return -1;
  }
  return sxt_proc_env_setup(&env, &(sxt_proc_env_opts){.test = "test_rdma_gpu",
                                                       .tmp = "rdma-gpu", .bin_here = 1,
                                                       .need = "sx-agent", .ns = "rdma-gpu",
                                                       .notify = "Kx", .redis_required = 1});
}

static int group_teardown(void **state) {
  (void)state;
  return sxt_proc_env_teardown(&env);
}

static int gd_teardown(void **state) {
  unsetenv("SXSHIM_LOG");
  return group_teardown(state);
}

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  if (argc > 1 && strcmp(argv[1], "gpudirect") == 0) {
    const struct CMUnitTest gd[] = {
        cmocka_unit_test(test_rdma_gpu_dmabuf_export_rules),
        cmocka_unit_test(test_rdma_gpu_dmabuf_tier),
        cmocka_unit_test(test_rdma_gpu_dmabuf_fails_to_staged),
        cmocka_unit_test(test_rdma_gpu_peermem_tier),
        cmocka_unit_test(test_rdma_gpu_peermem_efault_to_staged),
        cmocka_unit_test(test_rdma_gpu_unreachable_pair_is_staged),
        cmocka_unit_test(test_rdma_gpu_unreachable_pair_metric),
    };
    return cmocka_run_group_tests(gd, gd_setup, gd_teardown);
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rdma_gpu_small_blocks_gpu_to_gpu),
      cmocka_unit_test(test_rdma_gpu_large_blocks_gpu_to_gpu),
      cmocka_unit_test(test_rdma_gpu_gpu_pool_into_host_memory),
      cmocka_unit_test(test_rdma_gpu_host_pool_into_gpu_memory),
      cmocka_unit_test(test_rdma_gpu_tier_off_chooses_tcp),
      cmocka_unit_test(test_rdma_gpu_sxctl_read_into_gpu),
      cmocka_unit_test(test_rdma_gpu_target_with_staging_off_refuses),
      cmocka_unit_test(test_rdma_gpu_deadline_and_nothing_lands_after),
      cmocka_unit_test(test_rdma_gpu_target_killed_during_a_batch),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
