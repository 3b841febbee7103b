/*
 * READV (agent/transport/conn/frame.h): several ranges in one request and
 * one reply.
 *
 * The target's side, on the wire against a real agent: HELLO_REPLY says
 * it serves READV; the ranges come back in one payload, in order; a
 * refusal names the range refused and the connection goes on; malformed
 * READVs close it.
 *
 * The reader's side, against a target of the test's own: small ranges go
 * out as READVs within the limits (SX__READV_MAX ranges, READV_BYTES, none
 * above READV_RANGE), large ones as READs, and every byte lands where it
 * belongs; a refused READV fails exactly the entries whose ranges it held;
 * a target that does not say READV gets READs only.
 *
 * Both, with data-mover threads forced on: READV replies above the
 * threshold are received by the reader's threads, byte for byte.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "internal.h"
#include "pattern.h"
#include "push_fixture.h"
#include "transport/conn/frame.h"
#include "transport/conn/xpool.h"
#include "transport/tcp/tcp_read_int.h"

/* ------------------------------------------------------------ the target */

static void test_readv_target_serves_ranges_in_one_reply(void **state) {
  (void)state;
  char url[64];
  sxt_mem_url(url, sizeof(url), "readv");
  sxt_agent t;
  sxt_target_start(&t, url, "prefill-0", NULL, 7);
  sx_desc d;
  sxt_ok(sx_agent_descriptor(t.a, &d));
  uint64_t len = d.regions[0].length;
  int fd = sxt_wire_connect(sxt_tcp_port(&d));
  uint64_t feat = 0;
  sxt_ok(sxt_wire_hello_features(fd, d.incarnation, d.token, "tester", &feat));
  assert_true(feat & SX__FEAT_READV);

  /* Ranges of both regions, in the order asked, in one payload. */
  static uint8_t buf[1 << 16];
  sx__range r[SX__READV_MAX];
  for (uint32_t i = 0; i < SX__READV_MAX; i++)
    r[i] = (sx__range){t.id[i % 2], (uint64_t)(SX__READV_MAX - i) * 1000 + 3, 100 + 17 * i};
  uint32_t index = 99;
  sxt_ok(sxt_wire_readv(fd, 1, r, SX__READV_MAX, buf, &index));
  uint64_t at = 0;
  for (uint32_t i = 0; i < SX__READV_MAX; i++) {
    assert_int_equal(sx__pattern_check(buf + at, r[i].length, 7, r[i].region, r[i].offset, NULL), 0);
    at += r[i].length;
  }

  /* Pipelined: 40 READVs of 16 ranges sent before any reply is read,
   * so that the target's reply writes (SX__CONN_REPLIES entries each)
   * end in the middle of READVs. */
  enum { NV = 40 };
  size_t one = SX__FRAME_HDR + SX__READV_MAX * SX__READV_ENTRY;
  uint8_t *reqs = malloc(NV * one);
  assert_non_null(reqs);
  sx__range pv[NV][SX__READV_MAX];
  for (uint32_t v = 0; v < NV; v++) {
    for (uint32_t i = 0; i < SX__READV_MAX; i++)
      pv[v][i] = (sx__range){t.id[(v + i) % 2], (uint64_t)v * 4096 + i * 97,
                             1 + (v * 7 + i) % 50};
    assert_int_equal(sxt_wire_readv_encode(reqs + v * one, 100 + v, pv[v], SX__READV_MAX), one);
  }
  sxt_ok(sxt_wire_send(fd, reqs, NV * one)); /* in one write: parsed together */
  free(reqs);
  for (uint32_t v = 0; v < NV; v++) {
    uint8_t h[SX__FRAME_HDR];
    sx__frame g;
    sxt_ok(sxt_wire_recv(fd, h, sizeof(h)));
    assert_int_equal(sx__frame_decode(h, sizeof(h), &g), SX__FRAME_HDR);
    assert_true(g.type == SX__FRAME_READ_REPLY && g.id == 100 + v && g.status == 0);
    uint64_t sum = 0;
    for (uint32_t i = 0; i < SX__READV_MAX; i++) {
      const sx__range *e = &pv[v][i];
      sxt_ok(sxt_wire_recv(fd, buf, (size_t)e->length));
      assert_int_equal(sx__pattern_check(buf, e->length, 7, e->region, e->offset, NULL), 0);
      sum += e->length;
    }
    assert_true(g.length == sum);
  }

  /* A refusal names the first range refused; nothing else is sent. */
  r[0] = (sx__range){t.id[0], 0, 64};
  r[1] = (sx__range){t.id[1], len - 10, 11};
  r[2] = (sx__range){777, 0, 8};
  assert_int_equal(sxt_wire_readv(fd, 2, r, 3, buf, &index), SX_EBOUNDS);
  assert_int_equal(index, 1);
  r[1].offset = 0;
  assert_int_equal(sxt_wire_readv(fd, 3, r, 3, buf, &index), SX_ENOREGION);
  assert_int_equal(index, 2);
  r[2] = (sx__range){t.id[0], 0, 1ull << 40};
  assert_int_equal(sxt_wire_readv(fd, 4, r, 3, buf, &index), SX_ELIMIT);
  assert_int_equal(index, 2);
  /* ... and the connection serves on. */
  sxt_ok(sxt_wire_readv(fd, 5, r, 2, buf, &index));
  assert_int_equal(sx__pattern_check(buf + 64, 11, 7, t.id[1], 0, NULL), 0);
  sxt_ok(sxt_wire_read(fd, 6, t.id[1], len - 4096, 4096, buf));
  assert_int_equal(sx__pattern_check(buf, 4096, 7, t.id[1], len - 4096, NULL), 0);
  close(fd);

  /* Malformed READVs close the connection. */
  struct {
    uint64_t length; /* header length */
    uint32_t zero;   /* the entry's reserved field */
    uint64_t rlen;   /* the entry's length */
  } bad[] = {{SX__READV_ENTRY + 1, 0, 8},
             {SX__READV_ENTRY * (SX__READV_MAX + 1), 0, 8},
             {SX__READV_ENTRY, 1, 8},
             {SX__READV_ENTRY, 0, 0}};
  for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
    fd = sxt_wire_connect(sxt_tcp_port(&d));
    sxt_ok(sxt_wire_hello(fd, d.incarnation, d.token, "mallory"));
    uint8_t b[SX__FRAME_HDR + SX__READV_ENTRY * (SX__READV_MAX + 1) + 1];
    memset(b, 0, sizeof(b));
    sx__frame f = {.type = SX__FRAME_READV, .id = 9, .length = bad[k].length};
    sx__frame_encode(&f, b);
    sx__range e = {t.id[0], 0, bad[k].rlen};
    sx__range_encode(&e, b + SX__FRAME_HDR);
    b[SX__FRAME_HDR + 7] = (uint8_t)bad[k].zero;
    assert_int_equal(sxt_wire_send(fd, b, SX__FRAME_HDR + (size_t)bad[k].length), 0);
    assert_true(sxt_wire_closed(fd));
    close(fd);
  }
  sx_agent_status st;
  sxt_ok(sx_agent_status_get(t.a, &st));
  assert_true(st.served_errors >= 3);
  sx_desc_free(&d);
  sxt_agent_stop(&t);
}

/* ------------------------------------------------------------ the reader */

/* The fake target's byte at offset o of region r. */
static uint8_t byte_at(uint32_t r, uint64_t o) {
  return (uint8_t)(o * 131 + (o >> 9) * 7 + r * 29 + 1);
}

#define FAKE_MAX_RANGES 4096

/* A target of the test's own: says READV in HELLO_REPLY when readv is
 * set, answers READ and READV with byte_at()'s bytes, and refuses (SX_EIO)
 * a request holding the range of remote block refuse_block, layer
 * REFUSE_LAYER of the K region (at the index of that range).  It keeps
 * what it saw. */
#define REFUSE_LAYER 2
typedef struct fake {
  int lfd, fd;
  int readv;
  int64_t refuse_block;
  uint64_t layer_stride;
  atomic_int reads, readvs, broken; /* broken: a READV outside the reader's limits */
  atomic_int mixed;                 /* READVs over both regions (of one block) */
  atomic_int ranges;
  /* The blocks of K ranges in refused requests. */
  atomic_int n_refused;
  uint64_t refused_blocks[FAKE_MAX_RANGES];
} fake;

static uint64_t block_of(const fake *fk, uint64_t off) {
  return (off % fk->layer_stride) / SXT_BLOCK;
}

static void *fake_main(void *arg) {
  fake *fk = arg;
  fk->fd = accept(fk->lfd, NULL, NULL);
  static uint8_t buf[SX__FRAME_HDR + SX__HELLO_MAX + SX__READV_MAX * SX__READV_ENTRY];
  static uint8_t payload[1 << 20];
  for (;;) {
    sx__frame f, r;
    if (sxt_wire_recv(fk->fd, buf, SX__FRAME_HDR) ||
        sx__frame_decode(buf, SX__FRAME_HDR, &f) != SX__FRAME_HDR)
      return NULL;
    sx__range rg[SX__READV_MAX];
    uint32_t n = 0;
    r = (sx__frame){.id = f.id, .type = SX__FRAME_READ_REPLY};
    if (f.type == SX__FRAME_HELLO) {
      if (sxt_wire_recv(fk->fd, buf, (size_t)f.length))
        return NULL;
      r.type = SX__FRAME_HELLO_REPLY;
      r.offset = fk->readv ? SX__FEAT_READV : 0;
    } else if (f.type == SX__FRAME_READ) {
      atomic_fetch_add(&fk->reads, 1);
      rg[n++] = (sx__range){f.region, f.offset, f.length};
    } else if (f.type == SX__FRAME_READV) {
      atomic_fetch_add(&fk->readvs, 1);
      if (sxt_wire_recv(fk->fd, buf, (size_t)f.length))
        return NULL;
      uint64_t total = 0;
      for (; n < f.length / SX__READV_ENTRY; n++) {
        if (sx__range_decode(buf + n * SX__READV_ENTRY, &rg[n]) != 0)
          return NULL;
        total += rg[n].length;
        if (rg[n].length > READV_RANGE)
          atomic_fetch_add(&fk->broken, 1);
      }
      if (!fk->readv || n < 2 || total > READV_BYTES)
        atomic_fetch_add(&fk->broken, 1);
      /* Ranges of more than one region serve one entry: here, one
       * block (or one run of blocks, the first at the same offset). */
      int one_region = 1, one_block = 1;
      for (uint32_t i = 1; i < n; i++) {
        one_region &= rg[i].region == rg[0].region;
        one_block &= block_of(fk, rg[i].offset) == block_of(fk, rg[0].offset);
      }
      if (!one_region)
        atomic_fetch_add(one_block ? &fk->mixed : &fk->broken, 1);
    } else {
      return NULL;
    }
    atomic_fetch_add(&fk->ranges, (int)n);
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++) {
      if (rg[i].region == 0 && (int64_t)block_of(fk, rg[i].offset) == fk->refuse_block &&
          rg[i].offset / fk->layer_stride == REFUSE_LAYER && r.status == 0) {
        r.status = SX_EIO;
        r.region = i;
      }
      total += rg[i].length;
    }
    if (r.status != 0) {
      for (uint32_t i = 0; i < n; i++) {
        int k = atomic_fetch_add(&fk->n_refused, 1);
        if (rg[i].region == 0 && k < FAKE_MAX_RANGES)
          fk->refused_blocks[k] = block_of(fk, rg[i].offset);
        else
          atomic_fetch_sub(&fk->n_refused, 1);
      }
    } else if (n > 0) {
      if (total > sizeof(payload))
        return NULL;
      uint64_t at = 0;
      for (uint32_t i = 0; i < n; i++)
        for (uint64_t k = 0; k < rg[i].length; k++)
          payload[at++] = byte_at(rg[i].region, rg[i].offset + k);
      r.length = total;
    }
    sx__frame_encode(&r, buf);
    if (sxt_wire_send(fk->fd, buf, SX__FRAME_HDR) ||
        (r.length && sxt_wire_send(fk->fd, payload, (size_t)r.length)))
      return NULL;
  }
}

typedef struct rig {
  char url[64];
  fake fk;
  sxt_agent r;
  sx_segment *seg;
  pthread_t th;
} rig;

static void rig_start(rig *g, int readv) {
  sxt_mem_url(g->url, sizeof(g->url), "readv");
  memset(&g->fk, 0, sizeof(g->fk));
  g->fk.fd = -1;
  g->fk.readv = readv;
  g->fk.refuse_block = -1;
  g->fk.lfd = sxt_fake_target(g->url, "fake-0", SXT_TARGET_BLOCKS, SX_ACCESS_REMOTE_READ);
  memset(&g->r, 0, sizeof(g->r));
  sx_agent_params ap;
  sxt_params(&ap, g->url, "decode-0");
  ap.conns_per_peer = 1; /* the fake serves one connection */
  sxt_ok(sx_agent_create(&ap, &g->r.a));
  sxt_register_kv(&g->r, SXT_READER_BLOCKS, SX_ACCESS_REMOTE_READ);
  sxt_ok(sx_segment_open(g->r.a, "fake-0", 2000, &g->seg));
  const sx_desc *d = sx_segment_desc(g->seg);
  assert_int_equal(d->regions[0].id, 0);
  assert_int_equal(d->regions[0].slot, SX_SLOT_K);
  g->fk.layer_stride = d->regions[0].layer_stride;
  assert_int_equal(pthread_create(&g->th, NULL, fake_main, &g->fk), 0);
}

static void rig_stop(rig *g) {
  sx_segment_close(g->seg);
  sxt_agent_stop(&g->r);
  pthread_join(g->th, NULL);
  if (g->fk.fd >= 0)
    close(g->fk.fd);
  close(g->fk.lfd);
}

/* Do the reader's blocks of entry e hold the fake's bytes?  0 or -1. */
static int landed(const rig *g, const sx_block_read *e) {
  const sx_desc *d = sx_segment_desc(g->seg);
  int rc = 0;
  for (uint32_t s = 0; s < 2 && rc == 0; s++)
    for (uint32_t l = 0; l < e->layer_count; l++)
      for (uint64_t b = 0; b < e->count; b++) {
        const sx_region *rr = &d->regions[s];
        uint64_t off = l * rr->layer_stride + (e->remote_block + b) * rr->block_stride;
        const uint8_t *m = g->r.mem[s] + (l * SXT_READER_BLOCKS + e->local_block + b) * SXT_BLOCK;
        for (uint64_t k = 0; k < SXT_BLOCK; k++)
          if (m[k] != byte_at(rr->id, off + k)) {
            fprintf(stderr, "slot %u layer %u block %lu byte %lu differs\n", s, l,
                    (unsigned long)(e->remote_block + b), (unsigned long)k);
            rc = -1;
            break;
          }
      }
  return rc;
}

static void test_readv_reader_gathers_small_ranges(void **state) {
  (void)state;
  rig g;
  rig_start(&g, 1);
  /* Scattered single blocks (4 KiB ranges: one region's layers of one
   * block go together), four contiguous blocks (16 KiB ranges), and 32
   * contiguous blocks (128 KiB ranges: above READV_RANGE, READs). */
  sx_block_read e[18];
  for (uint32_t i = 0; i < 16; i++)
    e[i] = (sx_block_read){.layer_count = SXT_LAYERS, .slots = SXT_KV,
                           .remote_block = (i * 37) % 60, .local_block = i, .count = 1};
  sx_batch_result res = sxt_run_batch(g.seg, e, 16, 5000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  for (uint32_t i = 0; i < 16; i++)
    assert_int_equal(landed(&g, &e[i]), 0);
  assert_int_equal(atomic_load(&g.fk.reads), 0);
  assert_true(atomic_load(&g.fk.readvs) > 0);
  assert_true(atomic_load(&g.fk.readvs) < (int)res.n_ranges);
  assert_int_equal(atomic_load(&g.fk.ranges), (int)res.n_ranges);
  /* One block's K and V of every layer (8 ranges of 4 KiB) go together. */
  assert_true(atomic_load(&g.fk.mixed) > 0);
  assert_int_equal(atomic_load(&g.fk.broken), 0);

  memset(g.r.mem[0], 0, SXT_LAYERS * SXT_READER_BLOCKS * SXT_BLOCK);
  memset(g.r.mem[1], 0, SXT_LAYERS * SXT_READER_BLOCKS * SXT_BLOCK);
  int before = atomic_load(&g.fk.readvs);
  e[16] = (sx_block_read){.layer_count = SXT_LAYERS, .slots = SXT_KV, .remote_block = 40,
                          .local_block = 0, .count = 4};
  e[17] = (sx_block_read){.layer_count = SXT_LAYERS, .slots = SXT_KV, .remote_block = 3,
                          .local_block = 4, .count = 28};
  res = sxt_run_batch(g.seg, &e[16], 2, 5000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(landed(&g, &e[16]), 0);
  assert_int_equal(landed(&g, &e[17]), 0);
  /* 28 blocks of 4 KiB are 112 KiB a range: a READ each (2 slots x 4
   * layers); the 16 KiB ranges went in READVs. */
  assert_int_equal(atomic_load(&g.fk.reads), 2 * SXT_LAYERS);
  assert_true(atomic_load(&g.fk.readvs) > before);
  assert_int_equal(atomic_load(&g.fk.broken), 0);
  rig_stop(&g);
}

static void test_readv_refusal_fails_the_entries_it_held(void **state) {
  (void)state;
  rig g;
  rig_start(&g, 1);
  g.fk.refuse_block = 21;
  sx_block_read e[16];
  for (uint32_t i = 0; i < 16; i++)
    e[i] = (sx_block_read){.layer_count = SXT_LAYERS, .slots = SXT_KV,
                           .remote_block = 10 + 2 * (uint64_t)i + (i > 5), .local_block = i,
                           .count = 1};
  e[5].remote_block = 21; /* the only entry reading block 21 */
  sx_batch *b = sxt_batch_submit(g.seg, e, 16, 5000);
  sxt_ok(sx_batch_wait(b, -1));
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  assert_int_equal(res.state, SX_BATCH_FAILED);
  assert_int_equal(res.error, SX_EIO);
  /* The message names the range refused. */
  char what[96];
  snprintf(what, sizeof(what), "refused a read of region 0 bytes %lu..+%u",
           (unsigned long)(REFUSE_LAYER * g.fk.layer_stride + 21 * SXT_BLOCK), SXT_BLOCK);
  assert_non_null(strstr(res.message, what));
  /* Exactly the entries of the blocks the refused requests held. */
  int n = atomic_load(&g.fk.n_refused);
  assert_true(n > 0);
  int want[16] = {0};
  for (int k = 0; k < n; k++)
    for (uint32_t i = 0; i < 16; i++)
      if (e[i].remote_block == g.fk.refused_blocks[k])
        want[i] = 1;
  assert_int_equal(want[5], 1);
  uint32_t n_want = 0;
  for (uint32_t i = 0; i < 16; i++)
    n_want += (uint32_t)want[i];
  assert_int_equal(res.n_failed, n_want);
  for (uint32_t k = 0; k < res.n_failed; k++)
    assert_int_equal(want[res.failed[k]], 1);
  /* Everything else arrived. */
  for (uint32_t i = 0; i < 16; i++)
    if (!want[i])
      assert_int_equal(landed(&g, &e[i]), 0);
  sx_batch_destroy(b);
  assert_int_equal(atomic_load(&g.fk.broken), 0);
  rig_stop(&g);
}

static void test_readv_not_sent_to_a_target_that_does_not_say_it(void **state) {
  (void)state;
  rig g;
  rig_start(&g, 0);
  sx_block_read e[8];
  for (uint32_t i = 0; i < 8; i++)
    e[i] = (sx_block_read){.layer_count = SXT_LAYERS, .slots = SXT_KV,
                           .remote_block = 50 - 3 * (uint64_t)i, .local_block = 2 * i,
                           .count = 2};
  sx_batch_result res = sxt_run_batch(g.seg, e, 8, 5000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  for (uint32_t i = 0; i < 8; i++)
    assert_int_equal(landed(&g, &e[i]), 0);
  assert_int_equal(atomic_load(&g.fk.readvs), 0);
  assert_int_equal(atomic_load(&g.fk.reads), (int)res.n_ranges);
  rig_stop(&g);
}

/* ------------------------------------------------- with the threads on */

/* Scattered single blocks: each entry's eight 4 KiB ranges (K and V of
 * every layer) in one READV of 32 KiB, above the threshold (16 KiB), so
 * the reader's threads receive the replies (a READ's 4 KiB reply never
 * goes to them); four connections, engaged from one busy one; every byte
 * checked, three rounds. */
static void test_readv_replies_received_by_threads(void **state) {
  (void)state;
  setenv("SX_TCP_THREADS", "2", 1);
  setenv("SX_TCP_THREAD_BYTES", "16384", 1);
  setenv("SX_TCP_THREAD_CONNS", "1", 1);
  char url[64];
  sxt_mem_url(url, sizeof(url), "readv-threads");
  sxt_agent t, r;
  sxt_target_start(&t, url, "prefill-0", NULL, 7);
  sxt_reader_start(&r, url, "decode-0");
  unsetenv("SX_TCP_THREADS");
  unsetenv("SX_TCP_THREAD_BYTES");
  unsetenv("SX_TCP_THREAD_CONNS");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "prefill-0", 2000, &seg));
  uint64_t rx = sx__xpool_runs(SX__XJOB_RECV);
  sx_block_read e[SXT_READER_BLOCKS];
  for (uint32_t round = 0; round < 3; round++) {
    for (uint32_t i = 0; i < SXT_READER_BLOCKS; i++)
      e[i] = (sx_block_read){.layer_count = SXT_LAYERS, .slots = SXT_KV,
                             .remote_block = (i * 37 + round * 11) % SXT_TARGET_BLOCKS,
                             .local_block = i, .count = 1};
    sx_batch_result res = sxt_run_batch(seg, e, SXT_READER_BLOCKS, 5000);
    assert_int_equal(res.state, SX_BATCH_COMPLETED);
    for (uint32_t i = 0; i < SXT_READER_BLOCKS; i++)
      assert_int_equal(sxt_verify_blocks(&r, seg, 7, &e[i]), 0);
  }
  assert_true(sx__xpool_runs(SX__XJOB_RECV) > rx);
  sx_segment_close(seg);
  sxt_agent_stop(&r);
  sxt_agent_stop(&t);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_readv_target_serves_ranges_in_one_reply),
      cmocka_unit_test(test_readv_reader_gathers_small_ranges),
      cmocka_unit_test(test_readv_refusal_fails_the_entries_it_held),
      cmocka_unit_test(test_readv_not_sent_to_a_target_that_does_not_say_it),
      cmocka_unit_test(test_readv_replies_received_by_threads),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
