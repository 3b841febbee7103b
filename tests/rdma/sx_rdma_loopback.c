/*
 * sx-rdma-test selftest: target and reader transports in one process over
 * the device's loopback, on one loop.  The fixture (one target, one reader
 * with a peer) is opened once; the tests run in order and share it (the
 * last ones take it apart: a deregistered region, close with an op in
 * flight).  First what a reader sees when things work (the endpoint, exact
 * reads, slicing and chaining), then refused and failed connections, then
 * aborts, closes and deregistration.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sx_rdma_test.h"

/* ------------------------------------------------------------------ the loopback fixture */

typedef struct fixture {
  uv_loop_t loop;
  node tgt, rdr;
  sx_desc desc;
  sx_tpeer *peer;
  uint64_t seed;
} fixture;

static fixture F;

static int fixture_open(void) {
  memset(&F, 0, sizeof(F));
  uv_loop_init(&F.loop);
  F.seed = opt.seed;
  if (node_open(&F.tgt, &F.loop, "rdma-test/target", 0, 0, 0) ||
      node_regions(&F.tgt, opt.regions, opt.layers, opt.blocks, opt.block_bytes,
                   SX_ACCESS_REMOTE_READ, F.seed, 0) ||
      node_desc(&F.tgt, &F.desc, F.seed))
    return -1;
  if (node_open(&F.rdr, &F.loop, "rdma-test/reader", 0, opt.slice, opt.conns) ||
      node_regions(&F.rdr, opt.regions, opt.layers, opt.blocks, opt.block_bytes, 0, 0, 0) ||
      /* a scratch region for reads whose bytes are checked after an abort */
      node_regions(&F.rdr, 1, opt.layers, opt.blocks, opt.block_bytes * 2, 0, 0, 0xee))
    return -1;
  int rc = F.rdr.t->ops->peer_open(F.rdr.t, &F.desc, &F.peer);
  CHECK(rc == 0, "peer_open: %s: %s", sx_err_name(rc), sx_errmsg());
  return 0;
}

static uint64_t region_len(void) {
  return (uint64_t)opt.layers * opt.blocks * opt.block_bytes;
}

/* ------------------------------------------------------------------ tests */

static int test_desc_publishes_rdma_endpoint(void) {
  const sx_desc *d = &F.desc;
  CHECK(sx_desc_rdma_devices(d) >= 1, "no RDMA endpoint in the descriptor");
  const sx_endpoint *e = NULL;
  for (uint32_t i = 0; i < d->n_endpoints && e == NULL; i++)
    if (d->endpoints[i].kind == SX_TRANSPORT_RDMA)
      e = &d->endpoints[i];
  CHECK(e->port != 0, "endpoint port 0");
  CHECK(e->device[0] != '\0', "no device name");
  CHECK(e->port_num >= 1, "port_num %u", e->port_num);
  CHECK(e->mtu >= 256 && e->mtu <= 4096, "mtu %u", e->mtu);
  CHECK(e->addr[0] != '\0', "no address");
  for (uint32_t i = 0; i < d->n_regions; i++)
    CHECK(d->regions[i].n_rkeys == sx_desc_rdma_devices(d) && d->regions[i].rkeys[0] != 0,
          "region %u rkeys", i);
  printf("      endpoint %s:%u device %s port %u mtu %u\n", e->addr, e->port, e->device,
         e->port_num, e->mtu);
  return 0;
}

/* Many random blocks and runs across all regions, byte-exact, and nothing
 * written outside them. */
static int test_read_random_blocks_exact(void) {
  const uint64_t bb = opt.block_bytes, nb = (uint64_t)opt.layers * opt.blocks;
  uint8_t *mark = calloc(opt.regions * nb, 1);
  opx o;
  uint64_t bytes = 0;
  srand(7);
  opx_init(&o, 1024);
  for (int i = 0; i < 600; i++) {
    uint32_t r = (uint32_t)rand() % opt.regions;
    uint64_t b = (uint64_t)rand() % nb, run = 1 + (uint64_t)rand() % 8;
    if (b + run > nb)
      run = nb - b;
    int clash = 0;
    for (uint64_t k = 0; k < run; k++)
      clash |= mark[r * nb + b + k];
    if (clash)
      continue;
    for (uint64_t k = 0; k < run; k++)
      mark[r * nb + b + k] = 1;
    opx_add(&o, F.rdr.mem[r] + b * bb, &F.rdr.regs[r], &F.desc.regions[r], b * bb, run * bb);
    bytes += run * bb;
  }
  int rc = run_op(&F.rdr, F.peer, &o, 20000);
  CHECK(rc == 0, "post: %s: %s", sx_err_name(rc), sx_errmsg());
  CHECK(o.op.first_error == 0, "%s: %s", sx_err_name(o.op.first_error), o.op.message);
  CHECK(o.done_calls == 1, "done ran %d times", o.done_calls);
  CHECK(o.op.bytes == bytes, "bytes %" PRIu64 " of %" PRIu64, o.op.bytes, bytes);
  for (uint32_t r = 0; r < opt.regions; r++) {
    for (uint64_t b = 0; b < nb; b++) {
      const uint8_t *p = F.rdr.mem[r] + b * bb;
      if (mark[r * nb + b]) {
        if (pattern_verify(F.rdr.mem[r], b * bb, bb, F.seed, r))
          FAIL("block %" PRIu64 " of region %u differs", b, r);
      } else {
        for (uint64_t k = 0; k < bb; k++)
          if (p[k] != 0)
            FAIL("region %u block %" PRIu64 " was written but not read", r, b);
      }
    }
  }
  printf("      %zu ranges, %" PRIu64 " bytes\n", o.op.n, bytes);
  free(mark);
  opx_free(&o);
  return 0;
}

/* Every region whole, in ranges that are not slice-aligned. */
static int test_read_all_regions_exact(void) {
  opx o;
  opx_init(&o, 256);
  for (uint32_t r = 0; r < opt.regions; r++) {
    memset(F.rdr.mem[r], 0, region_len());
    uint64_t off = 0, step = 3 * 1048576 / 2 + 40; /* 1.5 MiB + 40 */
    while (off < region_len()) {
      uint64_t len = region_len() - off < step ? region_len() - off : step;
      opx_add(&o, F.rdr.mem[r] + off, &F.rdr.regs[r], &F.desc.regions[r], off, len);
      off += len;
    }
  }
  int rc = run_op(&F.rdr, F.peer, &o, 30000);
  CHECK(rc == 0, "post: %s: %s", sx_err_name(rc), sx_errmsg());
  CHECK(o.op.first_error == 0, "%s: %s", sx_err_name(o.op.first_error), o.op.message);
  for (uint32_t r = 0; r < opt.regions; r++)
    if (pattern_verify(F.rdr.mem[r], 0, region_len(), F.seed, r))
      FAIL("region %u differs", r);
  opx_free(&o);
  return 0;
}

/* Small slices on a separate reader: one op needs many times the send
 * queue, so chains, selective signalling and ring wrap-around all run. */
static int test_slicing_chaining_signalling(void) {
  node r2;
  sx_tpeer *p2 = NULL;
  opx o;
  if (node_open(&r2, &F.loop, "rdma-test/slicer", 0, 4096, 2) ||
      node_regions(&r2, opt.regions, opt.layers, opt.blocks, opt.block_bytes, 0, 0, 0))
    return -1;
  int rc = r2.t->ops->peer_open(r2.t, &F.desc, &p2);
  CHECK(rc == 0, "peer_open: %s", sx_errmsg());
  opx_init(&o, 4096);
  /* Region 0 block by block (4 KiB pieces), region 1 in one range. */
  for (uint64_t off = 0; off < region_len(); off += 4096)
    opx_add(&o, r2.mem[0] + off, &r2.regs[0], &F.desc.regions[0], off, 4096);
  opx_add(&o, r2.mem[1], &r2.regs[1], &F.desc.regions[1], 0, region_len());
  uint64_t slices = 2 * region_len() / 4096;
  sx__rdma_stats s0, s1;
  sx__rdma_stats_get(r2.t, &s0);
  rc = run_op(&r2, p2, &o, 60000);
  sx__rdma_stats_get(r2.t, &s1);
  CHECK(rc == 0, "post: %s: %s", sx_err_name(rc), sx_errmsg());
  CHECK(o.op.first_error == 0, "%s: %s", sx_err_name(o.op.first_error), o.op.message);
  CHECK(pattern_verify(r2.mem[0], 0, region_len(), F.seed, 0) == 0, "region 0");
  CHECK(pattern_verify(r2.mem[1], 0, region_len(), F.seed, 1) == 0, "region 1");
  uint64_t wrs = s1.wrs - s0.wrs, posts = s1.posts - s0.posts, sig = s1.signaled - s0.signaled;
  printf("      %" PRIu64 " slices: %" PRIu64 " WRs in %" PRIu64 " ibv_post_send calls, %" PRIu64
         " signalled, %" PRIu64 " CQEs, %" PRIu64 " CQ events\n",
         slices, wrs, posts, sig, s1.cqes - s0.cqes, s1.cq_events - s0.cq_events);
  CHECK(wrs == slices, "%" PRIu64 " WRs for %" PRIu64 " slices", wrs, slices);
  CHECK(slices > 4 * SX__RDMA_SQ_DEPTH, "the batch must exceed the send queues");
  CHECK(posts * 8 <= wrs, "chains too short: %" PRIu64 " posts for %" PRIu64 " WRs", posts, wrs);
  CHECK(sig * 2 <= wrs, "signalling too often: %" PRIu64 " of %" PRIu64, sig, wrs);
  opx_free(&o);
  r2.t->ops->peer_close(p2);
  node_close(&r2);
  return 0;
}

static int expect_connect_error(sx_desc *d, int want, const char *want_text) {
  sx_tpeer *p = NULL;
  opx o;
  int rc = F.rdr.t->ops->peer_open(F.rdr.t, d, &p);
  CHECK(rc == 0, "peer_open: %s", sx_errmsg());
  opx_init(&o, 4);
  opx_add(&o, F.rdr.mem[0], &F.rdr.regs[0], &d->regions[0], 0, opt.block_bytes);
  opx_add(&o, F.rdr.mem[1], &F.rdr.regs[1], &d->regions[1], 0, opt.block_bytes);
  rc = run_op(&F.rdr, p, &o, 15000);
  if (rc == 0) {
    rc = o.op.first_error;
    printf("      %s: %s\n", sx_err_name(rc), o.op.message);
    CHECK(o.x[0].status == want && o.x[1].status == want, "xfer statuses %s %s",
          sx_err_name(o.x[0].status), sx_err_name(o.x[1].status));
  } else {
    printf("      post: %s: %s\n", sx_err_name(rc), sx_errmsg());
  }
  CHECK(rc == want, "got %s, want %s", sx_err_name(rc), sx_err_name(want));
  CHECK(strstr(rc == o.op.first_error ? o.op.message : sx_errmsg(), want_text) != NULL,
        "message lacks '%s'", want_text);
  F.rdr.t->ops->peer_close(p);
  opx_free(&o);
  return 0;
}

static int test_wrong_token_rejected(void) {
  sx_desc d;
  sx_desc_copy(&d, &F.desc);
  d.token[3] ^= 0x40;
  int rc = expect_connect_error(&d, SX_EACCESS, "RDMA_CM_EVENT_REJECTED");
  sx_desc_free(&d);
  return rc;
}

static int test_wrong_incarnation_rejected(void) {
  sx_desc d;
  sx_desc_copy(&d, &F.desc);
  d.incarnation[0] ^= 0x01;
  int rc = expect_connect_error(&d, SX_ESTALE, "RDMA_CM_EVENT_REJECTED");
  sx_desc_free(&d);
  return rc;
}

static int test_nothing_listening(void) {
  sx_desc d;
  sx_desc_copy(&d, &F.desc);
  for (uint32_t i = 0; i < d.n_endpoints; i++)
    if (d.endpoints[i].kind == SX_TRANSPORT_RDMA)
      d.endpoints[i].port = (uint16_t)(d.endpoints[i].port ^ 0x2a5); /* nobody there */
  int rc = expect_connect_error(&d, SX_EUNREACH, "RDMA_CM_EVENT_");
  sx_desc_free(&d);
  return rc;
}

/* An address on the local subnet where nobody answers: address resolution
 * fails (or the connect times out) and the error names the CM event. */
static int test_unreachable_address_names_the_cm_event(void) {
  sx_desc d;
  sx_desc_copy(&d, &F.desc);
  for (uint32_t i = 0; i < d.n_endpoints; i++) {
    sx_endpoint *e = &d.endpoints[i];
    char *dot = strrchr(e->addr, '.');
    if (e->kind == SX_TRANSPORT_RDMA && dot != NULL)
      snprintf(dot + 1, sizeof(e->addr) - (size_t)(dot + 1 - e->addr), "%s",
               strcmp(dot + 1, "99") ? "99" : "98");
  }
  sx_tpeer *p = NULL;
  opx o;
  int rc = F.rdr.t->ops->peer_open(F.rdr.t, &d, &p);
  CHECK(rc == 0, "peer_open: %s", sx_errmsg());
  opx_init(&o, 1);
  opx_add(&o, F.rdr.mem[0], &F.rdr.regs[0], &d.regions[0], 0, opt.block_bytes);
  uint64_t t0 = now_ms();
  rc = run_op(&F.rdr, p, &o, 30000);
  uint64_t took = now_ms() - t0;
  int err = rc != 0 ? rc : o.op.first_error;
  const char *msg = rc != 0 ? sx_errmsg() : o.op.message;
  printf("      after %" PRIu64 " ms: %s: %s\n", took, sx_err_name(err), msg);
  CHECK(err == SX_EUNREACH || err == SX_ETIMEDOUT, "got %s", sx_err_name(err));
  CHECK(strstr(msg, "RDMA_CM_EVENT_") != NULL || strstr(msg, "rdma_resolve_addr") != NULL,
        "the message names no CM event or call");
  CHECK(took < 20000, "took %" PRIu64 " ms", took);
  F.rdr.t->ops->peer_close(p);
  opx_free(&o);
  sx_desc_free(&d);
  return 0;
}

static int test_post_without_local_region(void) {
  opx o;
  static uint8_t buf[4096];
  opx_init(&o, 2);
  opx_add(&o, F.rdr.mem[0], &F.rdr.regs[0], &F.desc.regions[0], 0, 4096);
  opx_add(&o, buf, NULL, &F.desc.regions[0], 4096, 4096);
  opx_arm(&o);
  int rc = F.rdr.t->ops->post(F.peer, &o.op);
  CHECK(rc == SX_EINVAL, "post: %s", sx_err_name(rc));
  CHECK(strstr(sx_errmsg(), "registered memory") != NULL, "message: %s", sx_errmsg());
  /* However small. */
  o.x[1].length = 1;
  rc = F.rdr.t->ops->post(F.peer, &o.op);
  CHECK(rc == SX_EINVAL, "post of 1 byte: %s", sx_err_name(rc));
  /* Outside its local region. */
  o.x[1].length = 4096;
  o.x[1].lreg = &F.rdr.regs[0];
  o.x[1].local = F.rdr.mem[0] + region_len() - 100;
  rc = F.rdr.t->ops->post(F.peer, &o.op);
  CHECK(rc == SX_EBOUNDS, "post: %s", sx_err_name(rc));
  /* Nothing was posted: done never runs. */
  run_until(&F.loop, &o.done, 200);
  CHECK(o.done_calls == 0, "done ran");
  opx_free(&o);
  return 0;
}

/* Abort one op while another shares its QPs: the aborted op settles only
 * after the flush, nothing lands in its buffer afterwards, and the other op
 * still completes (its flushed slices are reissued). */
static int test_abort_flushes_and_spares_others(void) {
  opx a, b;
  const uint32_t scratch = opt.regions; /* the 0xee region */
  uint8_t *dst = F.rdr.mem[scratch];
  uint64_t dlen = F.rdr.regs[scratch].r.length;
  sx__rdma_stats s0, s1;
  opx_init(&a, 64);
  opx_init(&b, 64);
  memset(dst, 0xee, dlen);
  /* A: every region 16 times over, in 1 MiB ranges, into the scratch. */
  for (int rep = 0; rep < 16; rep++)
    for (uint32_t r = 0; r < opt.regions; r++)
      for (uint64_t off = 0; off < region_len(); off += 1048576)
        opx_add(&a, dst + (off + r * region_len()) % (dlen - 1048576), &F.rdr.regs[scratch],
                &F.desc.regions[r], off, 1048576);
  /* B: 64 blocks of region 2. */
  memset(F.rdr.mem[2], 0, region_len());
  for (uint32_t k = 0; k < 64; k++)
    opx_add(&b, F.rdr.mem[2] + (uint64_t)k * 3 * opt.block_bytes, &F.rdr.regs[2],
            &F.desc.regions[2], (uint64_t)k * 3 * opt.block_bytes, opt.block_bytes);
  sx__rdma_stats_get(F.rdr.t, &s0);
  opx_arm(&a);
  opx_arm(&b);
  int rc = F.rdr.t->ops->post(F.peer, &a.op);
  CHECK(rc == 0, "post a: %s", sx_errmsg());
  rc = F.rdr.t->ops->post(F.peer, &b.op);
  CHECK(rc == 0, "post b: %s", sx_errmsg());
  /* Let some of A arrive (or 300 ms pass), then abort it. */
  uint64_t end = now_ms() + 300;
  while (a.op.pending == a.op.n && now_ms() < end)
    uv_run(&F.loop, UV_RUN_ONCE);
  CHECK(!a.done, "A finished before it could be aborted (%zu xfers)", a.op.n);
  size_t pending_at_abort = a.op.pending;
  F.rdr.t->ops->abort(F.peer, &a.op, SX_ETIMEDOUT);
  CHECK(a.done_calls == 0, "abort ran done before returning");
  CHECK(run_until(&F.loop, &a.done, 5000), "abort did not settle A");
  CHECK(a.done_calls == 1, "done ran %d times", a.done_calls);
  CHECK(a.op.first_error == SX_ETIMEDOUT, "A: %s", sx_err_name(a.op.first_error));
  size_t ok = 0, aborted = 0;
  for (size_t i = 0; i < a.op.n; i++) {
    if (a.x[i].status == 0)
      ok++;
    else if (a.x[i].status == SX_ETIMEDOUT)
      aborted++;
    else
      FAIL("xfer %zu of A: %s", i, sx_err_name(a.x[i].status));
  }
  CHECK(aborted > 0 && ok + aborted == a.op.n, "%zu ok, %zu aborted", ok, aborted);
  /* Nothing may land in A's buffer after it ended. */
  uint8_t *snap = malloc(dlen);
  memcpy(snap, dst, dlen);
  CHECK(run_until(&F.loop, &b.done, 15000), "B did not finish");
  int quiet = 0;
  run_until(&F.loop, &quiet, 300);
  CHECK(memcmp(snap, dst, dlen) == 0, "A's buffer changed after A ended");
  free(snap);
  CHECK(b.op.first_error == 0, "B: %s: %s", sx_err_name(b.op.first_error), b.op.message);
  for (uint32_t k = 0; k < 64; k++)
    CHECK(pattern_verify(F.rdr.mem[2], (uint64_t)k * 3 * opt.block_bytes, opt.block_bytes,
                         F.seed, 2) == 0,
          "B block %u", k);
  sx__rdma_stats_get(F.rdr.t, &s1);
  printf("      A: %zu of %zu pending at abort, %zu arrived, %zu aborted; %" PRIu64
         " QPs torn down, %" PRIu64 " slices of B reissued\n",
         pending_at_abort, a.op.n, ok, aborted, s1.teardowns - s0.teardowns,
         s1.requeued - s0.requeued);
  CHECK(s1.teardowns > s0.teardowns, "no QP was moved to error");
  /* The peer still works afterwards (the next post reconnects). */
  opx_arm(&b);
  rc = run_op(&F.rdr, F.peer, &b, 15000);
  CHECK(rc == 0 && b.op.first_error == 0, "B again: %s", b.op.message);
  opx_free(&a);
  opx_free(&b);
  return 0;
}

/* Closing a peer with an op in flight settles it (SX_ECANCELED) before
 * peer_close returns. */
static int test_peer_close_cancels_inflight(void) {
  sx_tpeer *p = NULL;
  opx o;
  int rc = F.rdr.t->ops->peer_open(F.rdr.t, &F.desc, &p);
  CHECK(rc == 0, "peer_open: %s", sx_errmsg());
  opx_init(&o, 64);
  for (int rep = 0; rep < 8; rep++)
    for (uint32_t r = 0; r < opt.regions; r++)
      opx_add(&o, F.rdr.mem[r], &F.rdr.regs[r], &F.desc.regions[r], 0, region_len());
  opx_arm(&o);
  rc = F.rdr.t->ops->post(p, &o.op);
  CHECK(rc == 0, "post: %s", sx_errmsg());
  /* Connect and start reading. */
  uint64_t end = now_ms() + 2000;
  while (o.op.pending == o.op.n && now_ms() < end)
    uv_run(&F.loop, UV_RUN_ONCE);
  size_t pending = o.op.pending;
  F.rdr.t->ops->peer_close(p);
  CHECK(o.done_calls == 1, "done ran %d times by the end of peer_close", o.done_calls);
  size_t ok = 0, cancelled = 0;
  for (size_t i = 0; i < o.op.n; i++) {
    ok += o.x[i].status == 0;
    cancelled += o.x[i].status == SX_ECANCELED;
  }
  printf("      %zu of %zu pending at close; ended with %s: %zu arrived, %zu cancelled: %s\n",
         pending, o.op.n, sx_err_name(o.op.first_error), ok, cancelled, o.op.message);
  CHECK(pending > 0, "the op ended before peer_close");
  CHECK(o.op.first_error == SX_ECANCELED, "%s", sx_err_name(o.op.first_error));
  CHECK(ok + cancelled == o.op.n, "other statuses");
  opx_free(&o);
  return 0;
}

/* A region the target deregistered (after withdrawing it) fails the read
 * cleanly on the reader; other regions stay readable. */
static int test_read_after_dereg_fails_cleanly(void) {
  opx o;
  const uint32_t r = opt.regions - 1;
  F.tgt.regs[r].withdrawn = 1;
  F.tgt.t->ops->dereg_mem(F.tgt.t, &F.tgt.regs[r]);
  opx_init(&o, 2);
  opx_add(&o, F.rdr.mem[r], &F.rdr.regs[r], &F.desc.regions[r], 0, opt.block_bytes);
  int rc = run_op(&F.rdr, F.peer, &o, 15000);
  CHECK(rc == 0, "post: %s", sx_errmsg());
  printf("      %s: %s\n", sx_err_name(o.op.first_error), o.op.message);
  CHECK(o.op.first_error == SX_ERDMA, "got %s", sx_err_name(o.op.first_error));
  CHECK(strstr(o.op.message, "remote") != NULL, "message: %s", o.op.message);
  opx_free(&o);
  opx_init(&o, 2);
  opx_add(&o, F.rdr.mem[0], &F.rdr.regs[0], &F.desc.regions[0], 0, opt.block_bytes);
  rc = run_op(&F.rdr, F.peer, &o, 15000);
  CHECK(rc == 0 && o.op.first_error == 0, "region 0 after: %s %s", sx_err_name(rc),
        o.op.message);
  opx_free(&o);
  return 0;
}

/* close() with a peer and an op still open settles the op and frees all. */
static int test_close_with_op_in_flight(void) {
  opx o;
  opx_init(&o, 64);
  for (uint32_t r = 0; r < opt.regions - 1; r++)
    opx_add(&o, F.rdr.mem[r], &F.rdr.regs[r], &F.desc.regions[r], 0, region_len());
  opx_arm(&o);
  int rc = F.rdr.t->ops->post(F.peer, &o.op);
  CHECK(rc == 0, "post: %s", sx_errmsg());
  int started = 0;
  run_until(&F.loop, &started, 50);
  /* close() itself deregisters what is left (the agent normally does it
   * first, once nothing is in flight). */
  F.rdr.t->ops->close(F.rdr.t);
  F.rdr.t = NULL;
  node_close(&F.rdr);
  F.peer = NULL;
  CHECK(o.done_calls == 1, "done ran %d times", o.done_calls);
  printf("      op ended with %s\n", sx_err_name(o.op.first_error));
  opx_free(&o);
  node_close(&F.tgt);
  sx_desc_free(&F.desc);
  uv_run(&F.loop, UV_RUN_DEFAULT); /* close callbacks */
  CHECK(uv_loop_close(&F.loop) == 0, "handles left open on the loop");
  return 0;
}

int cmd_selftest(void) {
  /* A test picked by name still needs the tests that set up its state. */
  double t0 = now_s();
  int rc = fixture_open();
  test_report("fixture_open", rc, now_s() - t0);
  if (rc)
    return 1;
  RUN(test_desc_publishes_rdma_endpoint);
  RUN(test_read_random_blocks_exact);
  RUN(test_read_all_regions_exact);
  RUN(test_slicing_chaining_signalling);
  RUN(test_wrong_token_rejected);
  RUN(test_wrong_incarnation_rejected);
  RUN(test_nothing_listening);
  RUN(test_unreachable_address_names_the_cm_event);
  RUN(test_post_without_local_region);
  RUN(test_abort_flushes_and_spares_others);
  RUN(test_peer_close_cancels_inflight);
  RUN(test_read_after_dereg_fails_cleanly);
  RUN(test_close_with_op_in_flight);
  return test_failures ? 1 : 0;
}
