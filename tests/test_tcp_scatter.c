/*
 * Scattered TCP receives (tcp_read.c, sx_xfer.iov), through the call that
 * makes them: sx_group_read of a token-major TP=2 set into one TP=1 reader
 * (each remote block is one request whose reply lands in a piece per
 * token).  Real agents in this process, a mem:// store, TCP on loopback,
 * and between the reader and each prefill rank a proxy thread
 * (support/tcp_proxy.h): each rank advertises 127.0.0.2 and listens on
 * 127.0.0.1 at the same port, where the proxy forwards.  The proxy can
 *   - trickle the replies in chunks of 1..1500 bytes with pauses, so that
 *     payloads arrive in short reads that end anywhere in a piece, and
 *   - cut every connection after a number of reply bytes (and refuse new
 *     ones): the peer dies in the middle of a scattered payload.
 * Pieces of 128 bytes and of 4 KiB are run, and spans of more pieces than
 * one readv() fills.
 * Every test runs twice: with the data on the agents' loop threads, then
 * on data-mover threads for every payload (tcp_rx.c receives the
 * scattered replies, conn.c's threads send them).
 * The reader's memory must equal, byte for byte, a reference written
 * directly in its layout: every requested block, and every byte around
 * them still holding the fill it had; after a cut, every block not
 * reported failed.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent_fixture.h"
#include "segxfer/group.h"
#include "tcp_proxy.h"
#include "transport/conn/xpool.h"

#define LAYERS 2
#define HEADS 4
/* Tokens per block, on every side: 8, or more for spans of more pieces
 * than one readv() takes (256). */
static uint32_t tokens = 8;
#define BLOCKS 8
#define FILL 0xa5
/* 1: the second run, with the data on data-mover threads (tcp_rx.c, conn.c). */
static int threads;

/* ------------------------------------------------------------ ranks */

typedef struct rank {
  sx_agent *a;
  uint32_t first, count, head_dim;
  uint8_t *mem[2];
} rank;

static uint64_t block_bytes(const rank *r) {
  return (uint64_t)tokens * r->count * r->head_dim * sizeof(float);
}

static uint64_t mem_bytes(const rank *r) { return (uint64_t)LAYERS * BLOCKS * block_bytes(r); }

/* Element (t, h, e) of block b: its token-major place. */
static float *elem(const rank *r, uint32_t s, uint32_t l, uint64_t b, uint32_t t, uint32_t h,
                   uint32_t e) {
  uint64_t in = ((uint64_t)t * r->count + (h - r->first)) * r->head_dim + e;
  return (float *)(r->mem[s] + (l * BLOCKS + b) * block_bytes(r)) + in;
}

/* Remote block rb's content, at block b of r. */
static void fill_block(rank *r, uint64_t b, uint64_t rb) {
  for (uint32_t s = 0; s < 2; s++)
    for (uint32_t l = 0; l < LAYERS; l++)
      for (uint32_t t = 0; t < tokens; t++)
        for (uint32_t h = r->first; h < r->first + r->count; h++)
          for (uint32_t e = 0; e < r->head_dim; e++)
            *elem(r, s, l, b, t, h, e) =
                (float)((((rb * 2 + s) * LAYERS + l) * tokens + t) * HEADS + h) * 1000.0f +
                (float)e;
}

static void rank_start(rank *r, const char *url, const char *name, uint16_t port,
                       uint32_t first, uint32_t count, uint32_t head_dim, uint32_t tp_rank,
                       uint32_t tp_size) {
  memset(r, 0, sizeof(*r));
  r->first = first;
  r->count = count;
  r->head_dim = head_dim;
  sx_agent_params p;
  char listen[32];
  sxt_params(&p, url, name);
  strcpy(p.layout.dtype, "fp32");
  p.transports = SX_TRANSPORTS_TCP;
  if (threads) {
    /* Every payload, sent and received, on data-mover threads. */
    p.tcp_threads = 2;
    p.tcp_thread_bytes = 1;
  }
  if (name) {
    snprintf(listen, sizeof(listen), "127.0.0.1:%u", port);
    p.listen = listen;
    p.advertise = "127.0.0.2"; /* the proxy */
  }
  p.layout.tp_rank = tp_rank;
  p.layout.tp_size = tp_size;
  p.layout.n_blocks = 1;
  p.layout.blocks[0] = (sx_block_desc){.order = SX_KV_NHD, .tokens = tokens,
                                       .head_first = first, .head_count = count,
                                       .heads_total = HEADS, .head_dim = head_dim};
  strcpy(p.layout.blocks[0].dtype, "fp32");
  sxt_ok(sx_agent_create(&p, &r->a));
  for (uint32_t s = 0; s < 2; s++) {
    assert_non_null(r->mem[s] = malloc(mem_bytes(r)));
    memset(r->mem[s], FILL, mem_bytes(r));
    sx_region_params rp = {.addr = r->mem[s], .length = mem_bytes(r),
                           .layer_count = LAYERS, .layer_stride = BLOCKS * block_bytes(r),
                           .slot = s, .block_bytes = block_bytes(r), .num_blocks = BLOCKS,
                           .access = SX_ACCESS_REMOTE_READ};
    uint32_t id;
    sxt_ok(sx_agent_register(r->a, &rp, &id));
  }
  if (name)
    sxt_ok(sx_agent_publish(r->a, 0));
}

static void rank_stop(rank *r) {
  sx_agent_destroy(r->a);
  free(r->mem[0]);
  free(r->mem[1]);
}

static const uint64_t RB[] = {6, 1, 3, 4}; /* the request on the prefill ranks */
static const uint64_t LB[] = {2, 7, 0, 5}; /* and here */
#define NREQ 4

typedef struct world {
  char url[128];
  sxt_proxy px[2];
  rank p[2], d;
  sx_group *g;
} world;

static void world_start(world *w, uint32_t head_dim, int trickle, long long cut1) {
  memset(w, 0, sizeof(*w));
  sxt_mem_url(w->url, sizeof(w->url), "scatter");
  for (int i = 0; i < 2; i++) {
    char name[16];
    snprintf(name, sizeof(name), "pf/tp%d", i);
    sxt_proxy_opts po = {.trickle = trickle, .cut_after = i == 1 ? cut1 : -1, .stall_after = -1};
    sxt_proxy_start(&w->px[i], &po);
    rank_start(&w->p[i], w->url, name, w->px[i].port, 2 * (uint32_t)i, 2, head_dim,
               (uint32_t)i, 2);
    for (uint64_t b = 0; b < BLOCKS; b++)
      fill_block(&w->p[i], b, b);
  }
  rank_start(&w->d, w->url, NULL, 0, 0, HEADS, head_dim, 0, 1);
  sx_group_params gp;
  sx_group_params_init(&gp);
  gp.engine = "pf";
  gp.tp_size = 2;
  sxt_ok(sx_group_open(w->d.a, &gp, &w->g, NULL));
}

static void world_stop(world *w) {
  sx_group_close(w->g);
  rank_stop(&w->d);
  for (int i = 0; i < 2; i++) {
    rank_stop(&w->p[i]);
    sxt_proxy_stop(&w->px[i]);
  }
}

/* The reader's memory must equal a reference: the fill everywhere, the
 * request's blocks in place of LB (except those listed in skip). */
static void expect_reference(const world *w, const uint64_t *skip, uint32_t n_skip) {
  rank ref = w->d;
  for (int s = 0; s < 2; s++) {
    assert_non_null(ref.mem[s] = malloc(mem_bytes(&ref)));
    memset(ref.mem[s], FILL, mem_bytes(&ref));
  }
  for (int i = 0; i < NREQ; i++)
    fill_block(&ref, LB[i], RB[i]);
  uint64_t bb = block_bytes(&ref);
  for (int s = 0; s < 2; s++) {
    for (uint32_t l = 0; l < LAYERS; l++)
      for (uint64_t b = 0; b < BLOCKS; b++) {
        int skipped = 0;
        for (uint32_t k = 0; k < n_skip; k++)
          skipped |= skip[k] == b;
        uint64_t at = (l * BLOCKS + b) * bb;
        if (!skipped && memcmp(ref.mem[s] + at, w->d.mem[s] + at, bb) != 0)
          fail_msg("slot %d layer %u block %lu differs from the reference", s, l,
                   (unsigned long)b);
      }
    free(ref.mem[s]);
  }
}

static void read_all(world *w) {
  sx_group_result r;
  sxt_ok(sx_group_read(w->g, RB, NREQ, LB, NREQ, 10000, &r));
  if (r.state != SX_BATCH_COMPLETED)
    fail_msg("%s: %s", sx_batch_state_name(r.state), r.message);
  assert_int_equal(r.n_failed, 0);
  /* One request per run of remote blocks (3: blocks 3 and 4 are one),
   * layer and slot of each rank: scattered, not one per token. */
  assert_int_equal(r.n_ranges, 2 * 3 * LAYERS * 2);
  assert_int_equal(r.bytes, 2ull * NREQ * LAYERS * block_bytes(&w->d));
  expect_reference(w, NULL, 0);
}

/* The request read with replies passed whole, then trickled. */
static void read_both_ways(uint32_t head_dim) {
  world w;
  for (int trickle = 0; trickle < 2; trickle++) {
    world_start(&w, head_dim, trickle, -1);
    read_all(&w);
    world_stop(&w);
  }
}

/* Small pieces (2 heads x 16 x fp32 = 128 bytes a token). */
static void test_scatter_small_pieces_bitwise(void **state) {
  (void)state;
  read_both_ways(16);
}

/* Pieces of 4 KiB (2 heads x 512 x fp32). */
static void test_scatter_large_pieces_bitwise(void **state) {
  (void)state;
  read_both_ways(512);
}

/* Blocks of 160 tokens: remote blocks 3 and 4 make a span of 320 pieces,
 * more than one readv() fills. */
static void test_scatter_more_pieces_than_one_readv(void **state) {
  (void)state;
  tokens = 160;
  read_both_ways(16);
  tokens = 8;
}

/* Rank 1 dies after some of its reply bytes (in the middle of a scattered
 * payload, in chunks): the read fails for the blocks it fed that did not
 * arrive, names it, and every other block (and every byte around the
 * request) is exactly the reference. */
static void test_scatter_peer_dies_mid_payload(void **state) {
  (void)state;
  static const uint32_t dims[] = {16, 512};
  for (int k = 0; k < 2; k++) {
    world w;
    uint64_t bb1 = (uint64_t)tokens * 2 * dims[k] * sizeof(float); /* a rank-1 block */
    /* HELLO replies, then about a third of rank 1's payload. */
    world_start(&w, dims[k], 1, (long long)(NREQ * LAYERS * 2 * bb1 / 3));
    sx_group_result r;
    sxt_ok(sx_group_read(w.g, RB, NREQ, LB, NREQ, 5000, &r));
    assert_int_equal(r.state, SX_BATCH_FAILED);
    assert_true(r.error != 0);
    assert_non_null(strstr(r.message, "pf/tp1"));
    assert_true(r.n_failed >= 1 && r.n_failed <= NREQ);
    assert_true(__atomic_load_n(&w.px[1].dead, __ATOMIC_ACQUIRE));
    expect_reference(&w, r.failed, r.n_failed);
    world_stop(&w);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_scatter_small_pieces_bitwise),
      cmocka_unit_test(test_scatter_large_pieces_bitwise),
      cmocka_unit_test(test_scatter_more_pieces_than_one_readv),
      cmocka_unit_test(test_scatter_peer_dies_mid_payload),
  };
  int failed = cmocka_run_group_tests_name("on the loop thread", tests, NULL, NULL);
  threads = 1;
  uint64_t runs = sx__xpool_runs(SX__XJOB_RECV);
  failed += cmocka_run_group_tests_name("on data-mover threads", tests, NULL, NULL);
  if (sx__xpool_runs(SX__XJOB_RECV) == runs) {
    fprintf(stderr, "no reply was received on a data-mover thread\n");
    failed++;
  }
  return failed;
}
