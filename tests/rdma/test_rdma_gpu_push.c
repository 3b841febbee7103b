/*
 * Staged RDMA writes (push mode) of GPU memory (docs/gpu.md, docs/push.md),
 * where an RDMA device exists (the Soft-RoCE VM), on the host-memory
 * stand-in for the CUDA driver that run.sh names in SX_CUDA_LIBRARY
 * (tests/gpu/fake_cuda.c).  The stand-in's "device memory" is host memory
 * that RDMA does not register (no GPUDirect tier without the shim), so
 * every write that touches it goes through the rings of
 * agent/transport/rdma/rdma_stagew.c and rdma_sserve.c: the producer copies
 * its sources into a slot, the consumer RDMA-READs the slot and scatters it.
 * It proves the protocol, its checks and its failure handling over real
 * verbs; it says nothing about real GPU copies.
 *
 * Producer and consumer are agents of this process on a mem:// store,
 * except where the consumer is killed: then it is an sx-agent pool
 * (--location cuda:0 --writable) on env's redis-server.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "internal.h"
#include "mem/mem.h"
#include "pattern.h"
#include "proc_env.h"
#include "push_fixture.h"
#include "segxfer/push.h"

#define LAYERS 2
#define GUARD 8192 /* bytes before and after each consumer region, checked */
#define GUARD_BYTE 0xee

static sxt_proc_env env;
static int seq;
/* The rdma_gpu parameter of the next side_start (SX_RDMA_GPU_*). */
static uint32_t next_tier = SX_RDMA_GPU_AUTO;

/* One side: regions K and V of LAYERS layers of blocks blocks, each in GPU
 * (stand-in) memory or host memory, GUARD bytes into its allocation. */
typedef struct side {
  sx_agent *a;
  char name[32];
  int gpu;
  uint32_t block, blocks;
  uint64_t bytes; /* per region */
  uint8_t *alloc[2], *mem[2];
  uint32_t id[2];
  uint64_t seed; /* producer: its regions hold the pattern; 0: zeroed */
} side;

static void copy_in(side *x, int s, uint64_t off, const void *src, uint64_t len) {
  sxt_ok(x->gpu ? sx__mem_copy(x->alloc[s] + off, src, len)
                : (memcpy(x->alloc[s] + off, src, len), 0));
}

static void copy_out(const side *x, int s, void *dst) {
  uint64_t len = x->bytes + 2 * GUARD;
  sxt_ok(x->gpu ? sx__mem_copy(dst, x->alloc[s], len) : (memcpy(dst, x->alloc[s], len), 0));
}

static void side_start(side *x, const char *url, const char *name, int gpu, uint32_t block,
                       uint32_t blocks, uint32_t access, uint64_t seed) {
  memset(x, 0, sizeof(*x));
  snprintf(x->name, sizeof(x->name), "%s", name);
  sx_agent_params p;
  sxt_params(&p, url, x->name);
  p.listen = "127.0.0.1:0";
  /* One host here: keep cuda_ipc out of the choice, as if two hosts. */
  p.transports = SX_TRANSPORTS_RDMA | SX_TRANSPORTS_TCP;
  p.rdma_gpu = next_tier;
  sxt_ok(sx_agent_create(&p, &x->a));
  x->gpu = gpu;
  x->block = block;
  x->blocks = blocks;
  x->bytes = (uint64_t)LAYERS * blocks * block;
  x->seed = seed;
  uint64_t total = x->bytes + 2 * GUARD;
  uint8_t *host = malloc(total);
  assert_non_null(host);
  for (int s = 0; s < 2; s++) {
    void *m = NULL;
    if (gpu)
      sxt_ok(sx__mem_alloc(0, total, &m));
    else
      m = malloc(total);
    assert_non_null(m);
    x->alloc[s] = m;
    x->mem[s] = x->alloc[s] + GUARD;
    sx_region_params rp = {.addr = x->mem[s], .length = x->bytes, .layer_count = LAYERS,
                           .layer_stride = (uint64_t)blocks * block, .slot = (uint32_t)s,
                           .block_bytes = block, .num_blocks = blocks,
                           .location = gpu ? "cuda:0" : "cpu", .access = access};
    sxt_ok(sx_agent_register(x->a, &rp, &x->id[s]));
    memset(host, GUARD_BYTE, total);
    if (seed != 0)
      sx__pattern_fill(host + GUARD, x->bytes, seed, x->id[s], 0);
    else
      memset(host + GUARD, 0, x->bytes);
    copy_in(x, s, 0, host, total);
  }
  free(host);
  sxt_ok(sx_agent_publish(x->a, 0));
}

static void side_stop(side *x) {
  sx_agent_destroy(x->a);
  for (int s = 0; s < 2; s++) {
    if (x->gpu)
      sx__mem_free(x->alloc[s]);
    else
      free(x->alloc[s]);
  }
}

static void next_name(char *out, size_t size, const char *base) {
  snprintf(out, size, "%s-%d", base, ++seq);
}

/* Consumer memory, both regions with their guards, copied out. */
typedef struct snap {
  uint8_t *m[2];
} snap;

static void snap_take(const side *c, snap *s) {
  for (int k = 0; k < 2; k++) {
    s->m[k] = malloc(c->bytes + 2 * GUARD);
    assert_non_null(s->m[k]);
    copy_out(c, k, s->m[k]);
  }
}

static void snap_free(snap *s) {
  free(s->m[0]);
  free(s->m[1]);
}

/* Is consumer block (s, l, b) one that an entry of w writes?  Then *src is
 * the producer's block. */
static int written(const sx_block_write *w, size_t n, int s, uint32_t l, uint32_t b,
                   uint32_t *src) {
  for (size_t i = 0; i < n; i++) {
    if (!(w[i].slots & (1u << s)) || l < w[i].layer_first ||
        l >= w[i].layer_first + w[i].layer_count)
      continue;
    if (b >= w[i].remote_block && b < w[i].remote_block + w[i].count) {
      *src = (uint32_t)(w[i].local_block + (b - w[i].remote_block));
      return 1;
    }
  }
  return 0;
}

/* Check a snapshot of the consumer: the guards intact, every written block
 * equal to the producer's block (its pattern), every other block as
 * untouched (zero) or, with partial, either zero or the producer's (a
 * batch stopped midway).  0, or -1 with a message printed. */
static int check(const side *c, const side *p, const snap *sn, const sx_block_write *w,
                 size_t n, int partial) {
  uint8_t *want = malloc(c->block);
  assert_non_null(want);
  int bad = 0;
  for (int s = 0; s < 2 && !bad; s++) {
    const uint8_t *m = sn->m[s];
    for (uint64_t i = 0; i < GUARD && !bad; i++)
      if (m[i] != GUARD_BYTE || m[GUARD + c->bytes + i] != GUARD_BYTE) {
        print_error("%s region %d: guard byte %s the region changed\n", c->name, s,
                    m[i] != GUARD_BYTE ? "before" : "after");
        bad = 1;
      }
    for (uint32_t l = 0; l < LAYERS && !bad; l++) {
      for (uint32_t b = 0; b < c->blocks && !bad; b++) {
        const uint8_t *got = m + GUARD + ((uint64_t)l * c->blocks + b) * c->block;
        uint32_t src;
        int is_w = written(w, n, s, l, b, &src);
        int zero = 1;
        for (uint32_t k = 0; k < c->block && zero; k++)
          zero = got[k] == 0;
        if (is_w) {
          sx__pattern_fill(want, c->block, p->seed, p->id[s],
                           ((uint64_t)l * p->blocks + src) * p->block);
          if (memcmp(got, want, c->block) != 0 && !(partial && zero)) {
            print_error("%s slot %d layer %u block %u: not producer block %u\n", c->name, s,
                        l, b, src);
            bad = 1;
          }
        } else if (!zero) {
          print_error("%s slot %d layer %u block %u: written, but no entry writes it\n",
                      c->name, s, l, b);
          bad = 1;
        }
      }
    }
  }
  free(want);
  return bad ? -1 : 0;
}

static int check_now(const side *c, const side *p, const sx_block_write *w, size_t n) {
  snap sn;
  snap_take(c, &sn);
  int rc = check(c, p, &sn, w, n, 0);
  snap_free(&sn);
  return rc;
}

static sx_segment *open_rdma(side *p, const char *name) {
  sx_segment *seg;
  sxt_ok(sx_segment_open(p->a, name, 5000, &seg));
  if (sx_segment_transport(seg) != SX_TRANSPORT_RDMA)
    fail_msg("%s would be written over transport %d, not RDMA", name,
             (int)sx_segment_transport(seg));
  return seg;
}

/* The notice of tag from producer p arrives, with bytes as written. */
static void expect_notice(side *c, const side *p, uint64_t tag, uint64_t bytes) {
  sx_notice *nt = NULL;
  sxt_ok(sx_agent_notice_next(c->a, 2000, &nt));
  assert_string_equal(nt->producer, p->name);
  assert_int_equal(nt->tag, tag);
  assert_int_equal(nt->bytes, bytes);
  assert_int_equal(nt->transport, SX_TRANSPORT_RDMA);
  sx_notice_free(nt);
}

static uint64_t bytes_of(const side *c, const sx_block_write *w, size_t n) {
  uint64_t t = 0;
  for (size_t i = 0; i < n; i++)
    t += (uint64_t)__builtin_popcount(w[i].slots) * w[i].layer_count * w[i].count * c->block;
  return t;
}

/* One write case: producer (gpu or host) -> consumer (gpu or host), both
 * with blocks of `block` bytes, entries w; bytes checked, notice checked. */
static void write_case(int pgpu, int cgpu, uint32_t block, uint32_t blocks,
                       const sx_block_write *w, size_t n) {
  char url[64], cname[32], pname[32];
  sxt_mem_url(url, sizeof(url), "rgpush");
  next_name(cname, sizeof(cname), "gdecode");
  next_name(pname, sizeof(pname), "gprefill");
  side c, p;
  side_start(&c, url, cname, cgpu, block, blocks, SXT_RW, 0);
  sxt_ok(sx_agent_grant_write(c.a, pname, NULL));
  side_start(&p, url, pname, pgpu, block, blocks, SX_ACCESS_REMOTE_READ, 0x5eed + blocks);
  sx_segment *seg = open_rdma(&p, cname);
  /* The consumer's GPU regions have no write key (the stand-in's memory
   * is not registered): writes into them can only be staged. */
  const sx_desc *d = sx_segment_desc(seg);
  for (uint32_t i = 0; i < d->n_regions; i++)
    assert_int_equal(d->regions[i].n_wkeys == 0, cgpu);
  sx_batch_result r = sxt_batch_finish(sxt_write_submit(seg, w, n, 7, 60000));
  if (r.state != SX_BATCH_COMPLETED)
    fail_msg("write batch %s: %s (%s)", sx_batch_state_name(r.state), r.message,
             sx_err_name(r.error));
  assert_int_equal(r.transport, SX_TRANSPORT_RDMA);
  assert_int_equal(r.bytes, bytes_of(&c, w, n));
  expect_notice(&c, &p, 7, r.bytes);
  /* The consumer copied every byte itself: counted as served writes. */
  sx_agent_stats st;
  sxt_ok(sx_agent_stats_get(c.a, &st, sizeof(st)));
  assert_int_equal(st.served_write_bytes[SX_TRANSPORT_RDMA], r.bytes);
  assert_true(st.served_writes[SX_TRANSPORT_RDMA] >= 1);
  if (check_now(&c, &p, w, n) != 0)
    fail_msg("the consumer's memory is not what was written");
  print_message("%s -> %s, %u-byte blocks: %llu bytes, %.1f MiB/s\n", pgpu ? "GPU" : "host",
                cgpu ? "GPU" : "host", block, (unsigned long long)r.bytes,
                (double)r.bytes / ((double)r.transfer_ns / 1e9) / 1048576.0);
  sx_segment_close(seg);
  side_stop(&p);
  side_stop(&c);
}

/* 4 KiB blocks: many pieces per slot (one gather per slot on each side). */
static void test_rdma_gpu_push_small_blocks_host_to_gpu(void **state) {
  (void)state;
  const sx_block_write w[] = {
      {.layer_count = LAYERS, .slots = 3, .local_block = 3, .remote_block = 40, .count = 5},
      {.layer_count = 1, .slots = 2, .local_block = 60, .remote_block = 2, .count = 1},
      {.layer_first = 1, .layer_count = 1, .slots = 1, .local_block = 0, .remote_block = 63,
       .count = 1},
  };
  write_case(0, 1, 4096, 64, w, 3);
}

static void test_rdma_gpu_push_small_blocks_gpu_to_gpu(void **state) {
  (void)state;
  const sx_block_write w[] = {
      {.layer_count = LAYERS, .slots = 3, .local_block = 0, .remote_block = 10, .count = 50},
  };
  write_case(1, 1, 4096, 64, w, 1);
}

/* GPU sources into host memory that has write keys: staged on the
 * producer's side only because its sources have no MR. */
static void test_rdma_gpu_push_small_blocks_gpu_to_host(void **state) {
  (void)state;
  const sx_block_write w[] = {
      {.layer_count = LAYERS, .slots = 3, .local_block = 7, .remote_block = 0, .count = 9},
  };
  write_case(1, 0, 4096, 64, w, 1);
}

/* Blocks of 1.5 MiB (more than a slot: each spans two) and 36 MiB in all
 * (more than the 16 MiB of slots on each side). */
static void test_rdma_gpu_push_large_blocks_gpu_to_gpu(void **state) {
  (void)state;
  const sx_block_write w[] = {
      {.layer_count = LAYERS, .slots = 3, .local_block = 0, .remote_block = 0, .count = 6},
  };
  write_case(1, 1, 3u << 19, 6, w, 1);
}

static void test_rdma_gpu_push_large_blocks_host_to_gpu(void **state) {
  (void)state;
  const sx_block_write w[] = {
      {.layer_count = LAYERS, .slots = 3, .local_block = 1, .remote_block = 3, .count = 3},
  };
  write_case(0, 1, 3u << 19, 6, w, 1);
}

/* A grant revoked before the batch: refused with a clear error, nothing
 * lands, no notice; the consumer serves the next (granted) producer. */
static void test_rdma_gpu_push_revoked_before_the_batch(void **state) {
  (void)state;
  char url[64];
  sxt_mem_url(url, sizeof(url), "rgrevoke");
  side c, p;
  side_start(&c, url, "gdecode-r", 1, 4096, 64, SXT_RW, 0);
  sxt_ok(sx_agent_grant_write(c.a, "gprefill-r", NULL));
  side_start(&p, url, "gprefill-r", 1, 4096, 64, SX_ACCESS_REMOTE_READ, 99);
  sx_segment *seg = open_rdma(&p, "gdecode-r");
  const sx_block_write w = {.layer_count = LAYERS, .slots = 3, .count = 8};
  sx_batch_result r = sxt_batch_finish(sxt_write_submit(seg, &w, 1, 1, 20000));
  if (r.state != SX_BATCH_COMPLETED)
    fail_msg("granted: %s: %s", sx_batch_state_name(r.state), r.message);
  expect_notice(&c, &p, 1, r.bytes);
  sxt_ok(sx_agent_revoke_write(c.a, "gprefill-r", NULL));
  /* Zero the consumer again, then write other blocks: refused. */
  uint8_t *zero = calloc(1, c.bytes);
  assert_non_null(zero);
  for (int s = 0; s < 2; s++)
    sxt_ok(sx__mem_copy(c.mem[s], zero, c.bytes));
  free(zero);
  const sx_block_write w2 = {.layer_count = LAYERS, .slots = 3, .remote_block = 20, .count = 8};
  /* The consumer destroyed the producer's stage QPs before the revoke
   * returned: the next batch finds them gone (or is refused), the one
   * after is refused when it connects, saying why. */
  r = sxt_batch_finish(sxt_write_submit(seg, &w2, 1, 2, 20000));
  if (r.state != SX_BATCH_FAILED ||
      (r.error != SX_EDISCONN && r.error != SX_EACCESS && r.error != SX_ERDMA))
    fail_msg("after the revoke: %s %s: %s", sx_batch_state_name(r.state), sx_err_name(r.error),
             r.message);
  r = sxt_batch_finish(sxt_write_submit(seg, &w2, 1, 2, 20000));
  print_message("after the revoke: %s: %s\n", sx_err_name(r.error), r.message);
  assert_int_equal(r.state, SX_BATCH_FAILED);
  assert_int_equal(r.error, SX_EACCESS);
  assert_non_null(strstr(r.message, "no write grant covers this producer"));
  if (check_now(&c, &p, NULL, 0) != 0)
    fail_msg("bytes landed after the revoke");
  sxt_expect_no_notice(c.a);
  /* The consumer is fine: granted again, the producer's next batch lands. */
  sxt_ok(sx_agent_grant_write(c.a, "gprefill-r", NULL));
  r = sxt_batch_finish(sxt_write_submit(seg, &w2, 1, 3, 20000));
  if (r.state != SX_BATCH_COMPLETED)
    fail_msg("granted again: %s: %s", sx_batch_state_name(r.state), r.message);
  expect_notice(&c, &p, 3, r.bytes);
  assert_int_equal(check_now(&c, &p, &w2, 1), 0);
  sx_segment_close(seg);
  side_stop(&p);
  side_stop(&c);
}

/* A grant revoked while a staged write batch runs: the batch fails with a
 * clear error, nothing lands after sx_agent_revoke_write returned, nothing
 * outside the destination blocks, no notice; the consumer lives on. */
static void test_rdma_gpu_push_revoked_mid_batch(void **state) {
  (void)state;
  char url[64];
  sxt_mem_url(url, sizeof(url), "rgrevoke2");
  const uint32_t block = 1u << 20, blocks = 16; /* 64 MiB to write */
  side c, p;
  side_start(&c, url, "gdecode-m", 1, block, blocks, SXT_RW, 0);
  sxt_ok(sx_agent_grant_write(c.a, "gprefill-m", NULL));
  side_start(&p, url, "gprefill-m", 1, block, blocks, SX_ACCESS_REMOTE_READ, 1234);
  sx_segment *seg = open_rdma(&p, "gdecode-m");
  const sx_block_write w = {.layer_count = LAYERS, .slots = 3, .count = blocks};
  sx_batch *b = sxt_write_submit(seg, &w, 1, 9, 120000);
  /* Revoke once the first bytes landed (block 0 of layer 0, K, goes in
   * the first slot). */
  uint8_t probe[64];
  int landed = 0;
  for (int i = 0; i < 30000 && !landed; i++) {
    sxt_ok(sx__mem_copy(probe, c.mem[0], sizeof(probe)));
    for (size_t k = 0; k < sizeof(probe) && !landed; k++)
      landed = probe[k] != 0;
    if (!landed)
      usleep(1000);
  }
  if (!landed)
    fail_msg("no byte of the batch landed within 30 s");
  sxt_ok(sx_agent_revoke_write(c.a, "gprefill-m", NULL));
  snap at;
  snap_take(&c, &at);
  sx_batch_result r = sxt_batch_finish(b);
  if (r.state == SX_BATCH_COMPLETED)
    fail_msg("the whole batch landed before the revoke: the test proves nothing");
  print_message("revoked mid-batch: %s %s after %llu of %llu bytes: %s\n",
                sx_batch_state_name(r.state), sx_err_name(r.error),
                (unsigned long long)r.bytes, (unsigned long long)bytes_of(&c, &w, 1), r.message);
  assert_int_equal(r.state, SX_BATCH_FAILED);
  assert_true(r.error == SX_EACCESS || r.error == SX_EDISCONN);
  assert_non_null(strstr(r.message, "grant"));
  /* What stood when the revoke returned is what stands now. */
  usleep(300 * 1000);
  snap now;
  snap_take(&c, &now);
  for (int s = 0; s < 2; s++)
    if (memcmp(at.m[s], now.m[s], c.bytes + 2 * GUARD) != 0)
      fail_msg("bytes landed in region %d after sx_agent_revoke_write returned", s);
  /* Every byte that landed is a byte of its destination block. */
  assert_int_equal(check(&c, &p, &now, &w, 1, 1), 0);
  snap_free(&at);
  snap_free(&now);
  sxt_expect_no_notice(c.a);
  sx_segment_close(seg);
  side_stop(&p);
  side_stop(&c);
}

/* A consumer with SX_RDMA_GPU=off (its agent parameter) refuses the
 * producer's stage QPs: the batch fails with SX_ENOTSUP saying so, nothing
 * lands, no notice. */
static void test_rdma_gpu_push_consumer_with_staging_off_refuses(void **state) {
  (void)state;
  char url[64];
  sxt_mem_url(url, sizeof(url), "rgoff");
  side c, p;
  next_tier = SX_RDMA_GPU_OFF;
  side_start(&c, url, "gdecode-o", 1, 4096, 64, SXT_RW, 0);
  next_tier = SX_RDMA_GPU_AUTO;
  sxt_ok(sx_agent_grant_write(c.a, "gprefill-o", NULL));
  side_start(&p, url, "gprefill-o", 0, 4096, 64, SX_ACCESS_REMOTE_READ, 5);
  sx_segment *seg = open_rdma(&p, "gdecode-o");
  const sx_block_write w = {.layer_count = LAYERS, .slots = 3, .count = 4};
  sx_batch_result r = sxt_batch_finish(sxt_write_submit(seg, &w, 1, 1, 20000));
  print_message("staging off at the consumer: %s %s: %s\n", sx_batch_state_name(r.state),
                sx_err_name(r.error), r.message);
  assert_int_equal(r.state, SX_BATCH_FAILED);
  assert_int_equal(r.error, SX_ENOTSUP);
  assert_non_null(strstr(r.message, "SX_RDMA_GPU=off there"));
  assert_int_equal(check_now(&c, &p, NULL, 0), 0);
  sxt_expect_no_notice(c.a);
  sx_segment_close(seg);
  side_stop(&p);
  side_stop(&c);
}

/* A 300 ms deadline on a 64 MiB staged write batch: TIMEOUT soon after,
 * no notice (the consumer may hold part of the bytes, as over TCP); the
 * producer's slots come back, and its next batch lands with its notice. */
static void test_rdma_gpu_push_deadline_mid_batch(void **state) {
  (void)state;
  char url[64];
  sxt_mem_url(url, sizeof(url), "rgdeadline");
  const uint32_t block = 1u << 20, blocks = 16;
  side c, p;
  side_start(&c, url, "gdecode-d", 1, block, blocks, SXT_RW, 0);
  sxt_ok(sx_agent_grant_write(c.a, "gprefill-d", NULL));
  side_start(&p, url, "gprefill-d", 1, block, blocks, SX_ACCESS_REMOTE_READ, 777);
  sx_segment *seg = open_rdma(&p, "gdecode-d");
  /* Blocks 2.. only: a late slot of this batch never meets the next one. */
  const sx_block_write w = {.layer_count = LAYERS, .slots = 3, .remote_block = 2,
                            .count = blocks - 2};
  uint64_t t0 = sx__mono_ms();
  sx_batch_result r = sxt_batch_finish(sxt_write_submit(seg, &w, 1, 11, 300));
  uint64_t took = sx__mono_ms() - t0;
  print_message("deadline: %s %s after %.2f s: %s\n", sx_batch_state_name(r.state),
                sx_err_name(r.error), (double)took / 1e3, r.message);
  assert_int_equal(r.state, SX_BATCH_TIMEOUT);
  assert_true(took < 10000);
  sxt_expect_no_notice(c.a);
  const sx_block_write w2 = {.layer_count = 1, .slots = 1, .local_block = 2, .count = 2};
  r = sxt_batch_finish(sxt_write_submit(seg, &w2, 1, 12, 30000));
  if (r.state != SX_BATCH_COMPLETED)
    fail_msg("after the deadline: %s: %s", sx_batch_state_name(r.state), r.message);
  expect_notice(&c, &p, 12, r.bytes);
  snap sn;
  snap_take(&c, &sn);
  /* Blocks 0 and 1 of layer 0, K, hold producer blocks 2 and 3 now (the
   * rest: zero, or what the timed-out batch landed in blocks 2..). */
  uint8_t *want = malloc(block);
  assert_non_null(want);
  for (uint32_t b = 0; b < 2; b++) {
    sx__pattern_fill(want, block, p.seed, p.id[0], (uint64_t)(2 + b) * block);
    assert_memory_equal(sn.m[0] + GUARD + (uint64_t)b * block, want, block);
  }
  free(want);
  snap_free(&sn);
  sx_segment_close(seg);
  side_stop(&p);
  side_stop(&c);
}

/* The consumer (an sx-agent pool in GPU memory) is SIGKILLed during a
 * staged write batch: the batch fails with per-op errors well before its
 * deadline, nothing hangs, and the next batch fails too. */
static void test_rdma_gpu_push_consumer_killed_mid_batch(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  char pool_name[64], prod[32];
  next_name(pool_name, sizeof(pool_name), "gwpool");
  next_name(prod, sizeof(prod), "gwprefill");
  const uint32_t block = 1u << 20, blocks = 24; /* 96 MiB per batch (K, V, 2 layers) */
  const char *more[] = {"--location", "cuda:0", "--writable", "--grant", prod,
                        "--rdma-devices", getenv("RXE_DEV"), NULL};
  if (more[6] == NULL)
    more[5] = NULL;
  sxt_pool_opts o = {.layers = LAYERS, .block_bytes = block, .num_blocks = blocks,
                     .slots = "K,V", .fingerprint = "llama-test/v1", .lease_ms = 3000,
                     .log_level = "info", .more = more, .publish_ms = 30000};
  sxt_pool pool;
  sxt_pool_start(&env, &pool, pool_name, 0, &o);
  side p;
  side_start(&p, env.url, prod, 1, block, blocks, SX_ACCESS_REMOTE_READ, 4321);
  sx_segment *seg = open_rdma(&p, pool_name);
  const sx_block_write w = {.layer_count = LAYERS, .slots = 3, .count = blocks};
  uint64_t t0 = sx__mono_ms();
  sx_batch *b = sxt_write_submit(seg, &w, 1, 5, 60000);
  /* Kill it once it accepted the producer's stage QPs (slots then flow at
   * once), so that the kill comes in the middle of the batch. */
  int up = 0;
  for (int i = 0; i < 3000 && !up; i++) {
    up = sxt_log_has(pool.log, "opened a stage QP");
    if (!up)
      usleep(10 * 1000);
  }
  if (!up) {
    sxt_show_log(pool.log);
    fail_msg("the pool did not accept a stage QP within 30 s");
  }
  usleep(200 * 1000);
  assert_int_equal(sxt_pool_stop(&pool, SIGKILL), 128 + SIGKILL);
  sx_batch_result r;
  sxt_ok(sx_batch_wait(b, -1));
  sxt_ok(sx_batch_result_get(b, &r));
  uint64_t took = sx__mono_ms() - t0;
  if (r.state == SX_BATCH_COMPLETED) {
    sx_batch_destroy(b);
    fail_msg("the batch completed before the kill: the test proves nothing");
  }
  print_message("consumer killed: %s %s in %.1f s, %u failed entries: %s\n",
                sx_batch_state_name(r.state), sx_err_name(r.error), (double)took / 1e3,
                (unsigned)r.n_failed, r.message);
  assert_int_equal(r.state, SX_BATCH_FAILED);
  assert_true(r.n_failed > 0);
  assert_true(took < 30000);
  sx_batch_destroy(b);
  r = sxt_batch_finish(sxt_write_submit(seg, &w, 1, 6, 20000));
  assert_int_not_equal(r.state, SX_BATCH_COMPLETED);
  sx_segment_close(seg);
  side_stop(&p);
}

static int group_setup(void **state) {
  (void)state;
  int n = 0;
  if (sx__mem_cuda_devices(&n) != 0 || n == 0) {
    fprintf(stderr, "test_rdma_gpu_push: no CUDA device, not even the stand-in "
            "(SX_CUDA_LIBRARY=%s): %s\n",
            getenv("SX_CUDA_LIBRARY") ? getenv("SX_CUDA_LIBRARY") : "unset", sx_errmsg());
    return -1;
  }
  return sxt_proc_env_setup(&env, &(sxt_proc_env_opts){.test = "test_rdma_gpu_push",
                                                       .tmp = "rdma-gpu-push", .bin_here = 1,
                                                       .need = "sx-agent", .ns = "rdma-gpu-push",
                                                       .notify = "Kx", .redis_required = 1});
}

static int group_teardown(void **state) {
  (void)state;
  return sxt_proc_env_teardown(&env);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rdma_gpu_push_small_blocks_host_to_gpu),
      cmocka_unit_test(test_rdma_gpu_push_small_blocks_gpu_to_gpu),
      cmocka_unit_test(test_rdma_gpu_push_small_blocks_gpu_to_host),
      cmocka_unit_test(test_rdma_gpu_push_large_blocks_gpu_to_gpu),
      cmocka_unit_test(test_rdma_gpu_push_large_blocks_host_to_gpu),
      cmocka_unit_test(test_rdma_gpu_push_revoked_before_the_batch),
      cmocka_unit_test(test_rdma_gpu_push_revoked_mid_batch),
      cmocka_unit_test(test_rdma_gpu_push_deadline_mid_batch),
      cmocka_unit_test(test_rdma_gpu_push_consumer_with_staging_off_refuses),
      cmocka_unit_test(test_rdma_gpu_push_consumer_killed_mid_batch),
  };
  const char *filter = getenv("SXT_FILTER"); /* one test, e.g. to repeat it */
  if (filter != NULL)
    cmocka_set_test_filter(filter);
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
