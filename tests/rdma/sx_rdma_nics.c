/*
 * sx-rdma-test nictest: one segment whose regions sit on two NICs, read and
 * written through both (agent/transport/rdma/rdma_route.c).  Target and
 * reader (then producer) are in one process on one loop, over each
 * device's loopback.
 *
 * Needs two RDMA devices whose addresses lie in different IPv4 subnets:
 * run.sh makes rxe1 on a veth pair next to the VM's rxe0 on eth0.  Host
 * regions are spread over the NICs by load (rdma_nic.c), so with regions
 * of one size registered in order, region i names device i % 2: the test
 * checks that this is what the descriptor says.  SX_NICTEST_NETDEV names
 * the netdev under one of the devices: the last test takes it down and
 * back up (root), and a batch spanning both NICs must then fail only the
 * ranges that need that device, with a message naming it.
 *
 * nictest-gpu: the same with the target's regions in "cuda:0" memory of
 * the host-memory CUDA stand-in (SX_CUDA_LIBRARY=libfakecuda.so): rxe has
 * no GPUDirect, so every range is staged, and each NIC pair stages through
 * a ring of its own, registered on its own device.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sx_rdma_test.h"

#define REGIONS 4
#define LAYERS 2
#define BLOCKS 32
#define BLOCK_BYTES 16384
#define NAME "rdma-test/nics"

static struct {
  uv_loop_t loop;
  node tgt, rdr;
  sx_desc desc;
  sx_tpeer *peer;
  uint64_t seed, epoch;
  int granted;
  /* What the reader's transport reported for the agent's metrics. */
  char nic_name[SX__RDMA_MAX_DEVS][SX_TAG_MAX + 1];
  uint64_t nic_wrs[SX__RDMA_MAX_DEVS], nic_bytes[SX__RDMA_MAX_DEVS];
  uint8_t *host; /* a host copy of a target region (gpu) */
} N;

/* ------------------------------------------------------------------ helpers */

/* The reader's sx_tctx.nic_posted: what the agent's per-NIC metrics get. */
static void nic_posted(void *agent, int dev, const char *name, uint64_t wrs, uint64_t bytes) {
  (void)agent;
  if (dev < 0 || dev >= SX__RDMA_MAX_DEVS)
    return;
  snprintf(N.nic_name[dev], sizeof(N.nic_name[dev]), "%s", name);
  N.nic_wrs[dev] += wrs;
  N.nic_bytes[dev] += bytes;
}

/* The device the owner chose for region r (its NIC), "" when none. */
static const char *region_dev(const sx_region *r) {
  const sx_endpoint *e = sx_desc_region_nic(&N.desc, r);
  return e != NULL ? e->device : "";
}

/* The index of the reader's device of that name, -1 when it has none. */
static int rdr_dev(const char *name) {
  const sx_rdma *t = (const sx_rdma *)N.rdr.t;
  for (int k = 0; k < t->n_devs; k++)
    if (strcmp(t->devs[k].name, name) == 0)
      return k;
  return -1;
}

/* Target region r as host bytes: the region itself, or (GPU memory) a
 * copy made through the memory layer. */
static const uint8_t *tgt_bytes(uint32_t r) {
  uint64_t len = N.tgt.regs[r].r.length;
  if (!N.tgt.gpu)
    return N.tgt.mem[r];
  if (N.host == NULL)
    N.host = malloc(len);
  if (N.host == NULL || sx__mem_copy(N.host, N.tgt.mem[r], len) != 0)
    return NULL;
  return N.host;
}

/* Target region r filled with the pattern of seed again. */
static int tgt_refill(uint32_t r, uint64_t seed) {
  uint64_t len = N.tgt.regs[r].r.length;
  if (!N.tgt.gpu) {
    pattern_fill(N.tgt.mem[r], len, seed, r);
    return 0;
  }
  if (N.host == NULL && (N.host = malloc(len)) == NULL)
    return -1;
  pattern_fill(N.host, len, seed, r);
  return sx__mem_copy(N.tgt.mem[r], N.host, len);
}

/* Ranges from every region: three runs of blocks each, one of them not
 * block-aligned, each into the same place of the reader's region r. */
static uint64_t add_ranges(opx *o) {
  uint64_t bb = BLOCK_BYTES, bytes = 0;
  for (uint32_t r = 0; r < REGIONS; r++) {
    const uint64_t offs[3] = {0, 5 * bb + 96, 20 * bb}, lens[3] = {3 * bb, 2 * bb - 296, 9 * bb};
    for (int k = 0; k < 3; k++) {
      opx_add(o, N.rdr.mem[r] + offs[k], &N.rdr.regs[r], &N.desc.regions[r], offs[k], lens[k]);
      bytes += lens[k];
    }
  }
  return bytes;
}

/* Bytes of o's ranges whose remote region names device dev. */
static uint64_t bytes_on(const opx *o, const char *dev) {
  uint64_t b = 0;
  for (size_t i = 0; i < o->op.n; i++)
    if (strcmp(region_dev(o->x[i].rreg), dev) == 0)
      b += o->x[i].length;
  return b;
}

/* Each device's share of the work requests and bytes posted by the reader
 * since *before: both devices carried some, and each exactly the bytes of
 * the ranges whose remote region names it. */
static int check_both_devices(const sx__rdma_stats *before, const opx *o, uint64_t bytes) {
  sx__rdma_stats after;
  sx__rdma_stats_get(N.rdr.t, &after);
  const sx_rdma *t = (const sx_rdma *)N.rdr.t;
  uint64_t sum = 0;
  for (int k = 0; k < t->n_devs; k++) {
    uint64_t b = after.dev_bytes[k] - before->dev_bytes[k];
    uint64_t w = after.dev_wrs[k] - before->dev_wrs[k];
    printf("      %s: %" PRIu64 " work requests, %" PRIu64 " bytes\n", t->devs[k].name, w, b);
    CHECK(w > 0 && b > 0, "no traffic on %s", t->devs[k].name);
    /* The metrics hook heard the same, under the device's name. */
    CHECK(strcmp(N.nic_name[k], t->devs[k].name) == 0 && N.nic_wrs[k] == after.dev_wrs[k] &&
              N.nic_bytes[k] == after.dev_bytes[k],
          "the metrics hook has %s: %" PRIu64 " WRs, %" PRIu64 " bytes; the transport %"
          PRIu64 ", %" PRIu64, N.nic_name[k], N.nic_wrs[k], N.nic_bytes[k], after.dev_wrs[k],
          after.dev_bytes[k]);
    CHECK(b == bytes_on(o, t->devs[k].name), "%s carried %" PRIu64 " bytes, the ranges on it "
          "are %" PRIu64, t->devs[k].name, b, bytes_on(o, t->devs[k].name));
    sum += b;
  }
  CHECK(sum == bytes, "the devices carried %" PRIu64 " bytes of %" PRIu64, sum, bytes);
  CHECK(after.splits == before->splits + 1, "the op was split %" PRIu64 " times",
        after.splits - before->splits);
  return 0;
}

/* ------------------------------------------------------------------ tests */

static int test_regions_on_two_nics(void) {
  CHECK(sx_desc_rdma_devices(&N.desc) >= 2, "the target publishes %u RDMA endpoints",
        sx_desc_rdma_devices(&N.desc));
  for (uint32_t r = 0; r < REGIONS; r++) {
    const char *dev = region_dev(&N.desc.regions[r]);
    printf("      region %u: %s\n", r, dev);
    CHECK(dev[0] != '\0', "region %u names no NIC", r);
    CHECK(rdr_dev(dev) >= 0, "the reader has no device %s", dev);
    if (r >= 2)
      CHECK(strcmp(dev, region_dev(&N.desc.regions[r - 2])) == 0,
            "region %u is on %s, region %u on %s", r, dev, r - 2,
            region_dev(&N.desc.regions[r - 2]));
  }
  CHECK(strcmp(region_dev(&N.desc.regions[0]), region_dev(&N.desc.regions[1])) != 0,
        "regions 0 and 1 are both on %s", region_dev(&N.desc.regions[0]));
  return 0;
}

static int test_read_spans_both_nics(void) {
  sx__rdma_stats before;
  opx o;
  opx_init(&o, 3 * REGIONS);
  for (uint32_t r = 0; r < REGIONS; r++)
    memset(N.rdr.mem[r], 0, N.rdr.regs[r].r.length);
  uint64_t bytes = add_ranges(&o);
  sx__rdma_stats_get(N.rdr.t, &before);
  int rc = run_op(&N.rdr, N.peer, &o, 20000);
  CHECK(rc == 0, "post: %s: %s", sx_err_name(rc), sx_errmsg());
  CHECK(o.op.first_error == 0, "%s: %s", sx_err_name(o.op.first_error), o.op.message);
  CHECK(o.done_calls == 1, "done ran %d times", o.done_calls);
  CHECK(o.op.bytes == bytes, "bytes %" PRIu64 " of %" PRIu64, o.op.bytes, bytes);
  for (size_t i = 0; i < o.op.n; i++) {
    const sx_xfer *x = &o.x[i];
    uint32_t r = x->rreg->id;
    CHECK(x->status == 0, "range %zu: %s", i, sx_err_name(x->status));
    if (pattern_verify(N.rdr.mem[r], x->roff, x->length, N.seed, r))
      FAIL("range %zu (region %u, on %s) differs", i, r, region_dev(x->rreg));
  }
  if (check_both_devices(&before, &o, bytes))
    return -1;
  opx_free(&o);
  return 0;
}

static int test_write_spans_both_nics(void) {
  const uint64_t seed = N.seed ^ 0x3c3c;
  sx_tpeer *wp = NULL;
  sx__rdma_stats before;
  opx o;
  int rc = N.rdr.t->ops->wpeer_open(N.rdr.t, &N.desc, &wp);
  CHECK(rc == 0, "wpeer_open: %s: %s", sx_err_name(rc), sx_errmsg());
  for (uint32_t r = 0; r < REGIONS; r++)
    pattern_fill(N.rdr.mem[r], N.rdr.regs[r].r.length, seed, r);
  opx_init(&o, 3 * REGIONS);
  uint64_t bytes = add_ranges(&o);
  sx__rdma_stats_get(N.rdr.t, &before);
  rc = run_op(&N.rdr, wp, &o, 20000);
  CHECK(rc == 0, "post: %s: %s", sx_err_name(rc), sx_errmsg());
  CHECK(o.op.first_error == 0, "%s: %s", sx_err_name(o.op.first_error), o.op.message);
  CHECK(o.done_calls == 1 && o.op.bytes == bytes, "done %d, bytes %" PRIu64 " of %" PRIu64,
        o.done_calls, o.op.bytes, bytes);
  for (size_t i = 0; i < o.op.n; i++) {
    const sx_xfer *x = &o.x[i];
    uint32_t r = x->rreg->id;
    const uint8_t *b = tgt_bytes(r);
    CHECK(b != NULL, "copying target region %u out: %s", r, sx_errmsg());
    if (pattern_verify(b, x->roff, x->length, seed, r))
      FAIL("written range %zu (region %u, on %s) differs at the target", i, r,
           region_dev(x->rreg));
    /* Nothing around the ranges changed: the bytes between them still
     * hold the target's own pattern. */
    if (pattern_verify(b, 3 * BLOCK_BYTES, 2 * BLOCK_BYTES, N.seed, r) ||
        pattern_verify(b, 29 * BLOCK_BYTES, 3 * BLOCK_BYTES, N.seed, r))
      FAIL("bytes of region %u outside the written ranges changed", r);
  }
  if (check_both_devices(&before, &o, bytes))
    return -1;
  N.rdr.t->ops->peer_close(wp);
  opx_free(&o);
  /* The target's pattern back, for the next test. */
  for (uint32_t r = 0; r < REGIONS; r++)
    CHECK(tgt_refill(r, N.seed) == 0, "refilling region %u: %s", r, sx_errmsg());
  return 0;
}

/* Staged: the segment's peer and its pair peer each have a stage peer,
 * from their own local port, with its ring registered on that port's
 * device: one on each device. */
static int test_stage_rings_per_nic(void) {
  const rdma_peer *p = (const rdma_peer *)N.peer;
  const sx_rdma *t = (const sx_rdma *)N.rdr.t;
  int seen[SX__RDMA_MAX_DEVS] = {0};
  CHECK(p->pairs != NULL && p->pairs->pnext == NULL, "the segment has %s NIC pair peers",
        p->pairs == NULL ? "no" : "several");
  const rdma_peer *both[2] = {p, p->pairs};
  for (int k = 0; k < 2; k++) {
    const rdma_peer *sp = both[k]->stage;
    CHECK(sp != NULL && sp->sr != NULL && sp->sr->mr_dev != NULL,
          "the peer from %s has no stage ring", both[k]->lep->dev->name);
    CHECK(sp->sr->mr_dev == both[k]->lep->dev, "the stage ring of the pair from %s is "
          "registered on %s", both[k]->lep->dev->name, sp->sr->mr_dev->name);
    printf("      pair from %s: stage ring on %s\n", both[k]->lep->dev->name,
           sp->sr->mr_dev->name);
    seen[sp->sr->mr_dev->index] = 1;
  }
  for (int k = 0; k < t->n_devs; k++)
    CHECK(seen[k], "no stage ring on %s", t->devs[k].name);
  return 0;
}

/* A deadline reaches every part: a fresh peer's batch over both NICs,
 * aborted (as the agent does at its deadline) before any QP is up, ends
 * once, every range SX_ETIMEDOUT on both NICs, nothing written. */
static int test_deadline_spans_both_nics(void) {
  sx_tpeer *p = NULL;
  opx o;
  int rc = N.rdr.t->ops->peer_open(N.rdr.t, &N.desc, &p);
  CHECK(rc == 0, "peer_open: %s", sx_errmsg());
  for (uint32_t r = 0; r < REGIONS; r++)
    memset(N.rdr.mem[r], 0, N.rdr.regs[r].r.length);
  opx_init(&o, 3 * REGIONS);
  add_ranges(&o);
  opx_arm(&o);
  rc = N.rdr.t->ops->post(p, &o.op);
  CHECK(rc == 0, "post: %s: %s", sx_err_name(rc), sx_errmsg());
  CHECK(((rdma_peer *)p)->splits != NULL, "the op was not split over the two NICs");
  N.rdr.t->ops->abort(p, &o.op, SX_ETIMEDOUT);
  CHECK(o.done_calls == 0, "done ran inside abort()");
  CHECK(run_until(&N.loop, &o.done, 5000), "the aborted op did not end");
  run_until(&N.loop, &o.done, 50); /* a second done would come now */
  CHECK(o.done_calls == 1, "done ran %d times", o.done_calls);
  CHECK(o.op.first_error == SX_ETIMEDOUT, "%s: %s", sx_err_name(o.op.first_error),
        o.op.message);
  for (size_t i = 0; i < o.op.n; i++)
    CHECK(o.x[i].status == SX_ETIMEDOUT, "range %zu (on %s): %s", i, region_dev(o.x[i].rreg),
          sx_err_name(o.x[i].status));
  for (uint32_t r = 0; r < REGIONS; r++)
    for (uint64_t k = 0; k < N.rdr.regs[r].r.length; k++)
      if (N.rdr.mem[r][k] != 0)
        FAIL("region %u byte %" PRIu64 " was written by an aborted op", r, k);
  CHECK(((rdma_peer *)p)->splits == NULL, "the split's record outlived its op");
  N.rdr.t->ops->peer_close(p);
  opx_free(&o);
  return 0;
}

static int sh(const char *fmt, const char *arg) {
  char cmd[256];
  snprintf(cmd, sizeof(cmd), fmt, arg);
  int rc = system(cmd);
  if (rc != 0)
    fprintf(stderr, "    '%s' exited %d\n", cmd, rc);
  return rc;
}

/* The port of device dev says ACTIVE, within ms. */
static int port_active(const char *dev, uint64_t ms) {
  char path[256], buf[64];
  snprintf(path, sizeof(path), "/sys/class/infiniband/%s/ports/1/state", dev);
  for (uint64_t end = now_ms() + ms; now_ms() < end; usleep(50000)) {
    FILE *f = fopen(path, "r");
    size_t n = f != NULL ? fread(buf, 1, sizeof(buf) - 1, f) : 0;
    if (f != NULL)
      fclose(f);
    buf[n] = '\0';
    if (strstr(buf, "ACTIVE") != NULL)
      return 1;
  }
  return 0;
}

static int nic_down_body(const char *dev, sx_tpeer *p) {
  opx o;
  opx_init(&o, 3 * REGIONS);
  for (uint32_t r = 0; r < REGIONS; r++)
    memset(N.rdr.mem[r], 0, N.rdr.regs[r].r.length);
  uint64_t bytes = add_ranges(&o), lost = bytes_on(&o, dev);
  CHECK(lost > 0 && lost < bytes, "%" PRIu64 " of %" PRIu64 " bytes on %s", lost, bytes, dev);
  int rc = run_op(&N.rdr, p, &o, 15000);
  CHECK(rc == 0, "post: %s: %s (the other NIC's ranges could go)", sx_err_name(rc),
        sx_errmsg());
  CHECK(o.done_calls == 1, "done ran %d times", o.done_calls);
  CHECK(o.op.first_error != 0, "every range arrived although %s is down", dev);
  printf("      %s: %s\n", sx_err_name(o.op.first_error), o.op.message);
  CHECK(strstr(o.op.message, dev) != NULL, "the message does not name %s", dev);
  CHECK(o.op.bytes == bytes - lost, "bytes %" PRIu64 ", expected %" PRIu64, o.op.bytes,
        bytes - lost);
  for (size_t i = 0; i < o.op.n; i++) {
    const sx_xfer *x = &o.x[i];
    uint32_t r = x->rreg->id;
    int down = strcmp(region_dev(x->rreg), dev) == 0;
    if (down)
      CHECK(x->status != 0, "range %zu needs %s, which is down, yet settled 0", i, dev);
    else if (x->status != 0 || pattern_verify(N.rdr.mem[r], x->roff, x->length, N.seed, r))
      FAIL("range %zu (region %u, on %s): %s, or its bytes differ", i, r, region_dev(x->rreg),
           sx_err_name(x->status));
  }
  opx_free(&o);
  return 0;
}

/* No connection is left at the target: the peers before closed, and
 * their disconnects arrived. */
static int quiet(void) {
  const sx_rdma *t = (const sx_rdma *)N.tgt.t;
  for (uint64_t end = now_ms() + 5000; t->tconns != NULL && now_ms() < end; usleep(1000))
    uv_run(&N.loop, UV_RUN_NOWAIT);
  return t->tconns == NULL;
}

/* One NIC's netdev down: a fresh peer's batch over both NICs fails the
 * ranges that need it, the others arrive; up again, all arrive.  The flap
 * comes once no connection is open or closing (on rxe, a connection torn
 * down across a flap of its netdev left later connects on that device
 * unanswered). */
static int test_nic_down_fails_only_its_ranges(void) {
  const char *netdev = getenv("SX_NICTEST_NETDEV"), *dev = getenv("SX_NICTEST_DEV");
  sx_tpeer *p = NULL;
  CHECK(netdev != NULL && dev != NULL, "SX_NICTEST_NETDEV and SX_NICTEST_DEV name the NIC "
        "to take down (run.sh sets them)");
  CHECK(rdr_dev(dev) >= 0, "no device %s here", dev);
  N.rdr.t->ops->peer_close(N.peer);
  N.peer = NULL;
  CHECK(quiet(), "the target still has connections 5 s after every peer closed");
  int rc = N.rdr.t->ops->peer_open(N.rdr.t, &N.desc, &p);
  CHECK(rc == 0, "peer_open: %s", sx_errmsg());
  if (sh("ip link set dev %s down", netdev) != 0)
    return -1;
  rc = nic_down_body(dev, p);
  int up = sh("ip link set dev %s up", netdev) == 0 && port_active(dev, 10000);
  N.rdr.t->ops->peer_close(p);
  CHECK(up, "%s did not come back (its port is not ACTIVE)", dev);
  if (rc != 0)
    return rc;
  /* Back up: a new peer reads everything through both again. */
  p = NULL;
  rc = N.rdr.t->ops->peer_open(N.rdr.t, &N.desc, &p);
  CHECK(rc == 0, "peer_open: %s", sx_errmsg());
  N.peer = p;
  return test_read_spans_both_nics();
}

/* ------------------------------------------------------------------ the command */

static int fixture_open(int gpu) {
  memset(&N, 0, sizeof(N));
  N.seed = opt.seed ^ 0x9e1c;
  uv_loop_init(&N.loop);
  if (node_open(&N.tgt, &N.loop, NAME "/target", 0, 0, 0))
    return -1;
  CHECK(((sx_rdma *)N.tgt.t)->n_devs >= 2, "%d RDMA device(s) here; nictest needs two, in "
        "different IPv4 subnets (run.sh makes rxe1 on a veth pair)", ((sx_rdma *)N.tgt.t)->n_devs);
  N.tgt.gpu = gpu;
  if (node_regions(&N.tgt, REGIONS, LAYERS, BLOCKS, BLOCK_BYTES,
                   SX_ACCESS_REMOTE_READ | SX_ACCESS_REMOTE_WRITE, N.seed, 0) ||
      node_desc(&N.tgt, &N.desc, N.seed))
    return -1;
  if (node_open(&N.rdr, &N.loop, NAME "/reader", 0, opt.slice, opt.conns) ||
      node_regions(&N.rdr, REGIONS, LAYERS, BLOCKS, BLOCK_BYTES, 0, 0, 0))
    return -1;
  N.rdr.ctx.nic_posted = nic_posted;
  N.granted = 1; /* the reader writes too */
  node_grant(&N.tgt, &N.rdr, &N.granted, &N.epoch);
  int rc = N.rdr.t->ops->peer_open(N.rdr.t, &N.desc, &N.peer);
  CHECK(rc == 0, "peer_open: %s: %s", sx_err_name(rc), sx_errmsg());
  return 0;
}

int cmd_nictest(int gpu) {
  double t0 = now_s();
  if (fixture_open(gpu) != 0) {
    test_report("nictest_fixture", -1, now_s() - t0);
    return 1;
  }
  RUN(test_regions_on_two_nics);
  RUN(test_read_spans_both_nics);
  if (gpu)
    RUN(test_stage_rings_per_nic);
  RUN(test_write_spans_both_nics);
  RUN(test_deadline_spans_both_nics);
  RUN(test_nic_down_fails_only_its_ranges);
  if (N.peer != NULL)
    N.rdr.t->ops->peer_close(N.peer);
  node_close(&N.rdr);
  node_close(&N.tgt);
  sx_desc_free(&N.desc);
  free(N.host);
  uv_run(&N.loop, UV_RUN_DEFAULT);
  uv_loop_close(&N.loop);
  return test_failures != 0;
}
