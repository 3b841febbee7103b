/*
 * sx-rdma-test: the RDMA transport against a real device (Soft-RoCE in the
 * test VM, or real hardware).  It plays the agent's part itself: a fake
 * sx_tctx with registered regions on the target side, ops of xfers on the
 * reader side, driven through sx__rdma_ops on one uv loop per process.
 *
 *   selftest                 every in-process test, target and reader in one
 *                            process over the device's loopback
 *   serve --desc F [...]     a target: register, publish F, serve until the
 *                            stop file appears or SIGTERM
 *   read --desc F [...]      a reader of that target: byte-exact reads
 *   killtest --dir D         target killed during a batch, restart, re-open
 *   bench --desc F --size S  batched READ bandwidth against a serve process
 *
 * Prints one PASS/FAIL line per test and exits non-zero if any failed.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "transport/rdma/rdma_int.h"
#include "segxfer.h"

/* ------------------------------------------------------------------ options */

static struct {
  const char *desc, *stop, *dir;
  int port;
  uint32_t regions, layers, blocks, block_bytes;
  uint32_t slice, conns;
  uint64_t seed;
  int wait_s;
  uint64_t size, total;
  uint32_t depth, batch;
  double seconds;
  int verbose;
  int expect_reissue;
} opt = {
    .regions = 4, .layers = 2, .blocks = 256, .block_bytes = 16384,
    .seed = 0x5eed, .wait_s = 60, .size = 65536, .depth = 4, .batch = 64,
    .seconds = 3.0,
};

static int failures;
static volatile sig_atomic_t stop_signal;

#define FAIL(...)                                                              \
  do {                                                                         \
    fprintf(stderr, "    %s:%d: ", __FILE__, __LINE__);                        \
    fprintf(stderr, __VA_ARGS__);                                              \
    fputc('\n', stderr);                                                       \
    return -1;                                                                 \
  } while (0)
#define CHECK(cond, ...)                                                       \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "    %s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                            \
      fputc('\n', stderr);                                                     \
      return -1;                                                               \
    }                                                                          \
  } while (0)

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void report(const char *name, int rc, double secs) {
  printf("%s  %-44s %6.2fs\n", rc == 0 ? "PASS" : "FAIL", name, secs);
  fflush(stdout);
  if (rc != 0)
    failures++;
}

static char **only; /* selftest: run only these tests */

static int selected(const char *name) {
  if (only == NULL || *only == NULL)
    return 1;
  for (char **o = only; *o != NULL; o++)
    if (strstr(name, *o) != NULL)
      return 1;
  return 0;
}

#define RUN(fn, ...)                                                           \
  if (selected(#fn)) {                                                         \
    double t0_ = now_s();                                                      \
    int rc_ = fn(__VA_ARGS__);                                                 \
    report(#fn, rc_, now_s() - t0_);                                           \
  }

/* ------------------------------------------------------------------ pattern */

static uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* The 8-byte word at offset o (a multiple of 8) of region id. */
static uint64_t pattern(uint64_t seed, uint32_t id, uint64_t o) {
  return mix(seed ^ ((uint64_t)id << 48) ^ (o >> 3));
}

static void fill(uint8_t *p, uint64_t len, uint64_t seed, uint32_t id) {
  for (uint64_t o = 0; o + 8 <= len; o += 8) {
    uint64_t v = pattern(seed, id, o);
    memcpy(p + o, &v, 8);
  }
}

/* 0 when [off, off+len) of a copy of region id holds the pattern. */
static int verify(const uint8_t *p, uint64_t off, uint64_t len, uint64_t seed, uint32_t id) {
  for (uint64_t o = off; o + 8 <= off + len; o += 8) {
    uint64_t v;
    memcpy(&v, p + o, 8);
    if (v != pattern(seed, id, o)) {
      fprintf(stderr, "    region %u: wrong bytes at offset %" PRIu64 "\n", id, o);
      return -1;
    }
  }
  return 0;
}

/* ------------------------------------------------------------------ a fake agent */

typedef struct node {
  uv_loop_t *loop;
  sx_agent_params params;
  sx_tctx ctx;
  uint8_t inc[SX_INCARNATION_LEN], token[SX_TOKEN_LEN];
  char name[64];
  char listen[32];
  sx_transport *t;
  sx_lregion regs[16];
  uint8_t *mem[16];
  uint32_t n_regs;
} node;

static sx_lregion *find_region(void *agent, uint32_t id) {
  node *n = agent;
  for (uint32_t i = 0; i < n->n_regs; i++)
    if (n->regs[i].r.id == id && !n->regs[i].withdrawn)
      return &n->regs[i];
  return NULL;
}

static void node_log(void *agent, sx_log_level level, const char *fmt, ...) {
  node *n = agent;
  if ((int)level > (opt.verbose ? SX_LOG_DEBUG : SX_LOG_WARN))
    return;
  static const char *names[] = {"error", "warn", "info", "debug"};
  char buf[600];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  fprintf(stderr, "    [%s %s] %s\n", n->name, names[level], buf);
}

static void node_served(void *agent, sx_transport_kind kind, uint64_t bytes, int err) {
  (void)agent;
  (void)kind;
  (void)bytes;
  (void)err;
}

static int node_open(node *n, uv_loop_t *loop, const char *name, int port, uint32_t slice,
                     uint32_t conns) {
  memset(n, 0, sizeof(*n));
  n->loop = loop;
  snprintf(n->name, sizeof(n->name), "%s", name);
  snprintf(n->listen, sizeof(n->listen), "0.0.0.0:%d", port);
  if (sx__random(n->inc, sizeof(n->inc)) || sx__random(n->token, sizeof(n->token)))
    FAIL("getrandom");
  n->params.name = n->name;
  n->params.listen = n->listen;
  n->params.rdma_gid_index = -1;
  n->params.rdma_slice_bytes = slice;
  n->params.conns_per_peer = conns;
  n->params.transports = SX_TRANSPORTS_ALL;
  n->ctx.loop = loop;
  n->ctx.name = n->name;
  n->ctx.incarnation = n->inc;
  n->ctx.token = n->token;
  n->ctx.params = &n->params;
  n->ctx.find_region = find_region;
  n->ctx.log = node_log;
  n->ctx.served = node_served;
  n->ctx.agent = n;
  int rc = sx__rdma_ops.open(&n->ctx, &n->t);
  CHECK(rc == 0, "open: %s: %s", sx_err_name(rc), sx_errmsg());
  return 0;
}

/* Regions: id i is group i/2, slot i%2, layers x blocks of block_bytes. */
static int node_regions(node *n, uint32_t count, uint32_t layers, uint32_t blocks,
                        uint32_t block_bytes, int remote, uint64_t seed, int fill_byte) {
  for (uint32_t i = 0; i < count; i++) {
    sx_lregion *lr = &n->regs[n->n_regs];
    uint64_t len = (uint64_t)layers * blocks * block_bytes;
    void *m = NULL;
    if (posix_memalign(&m, 4096, len) != 0)
      FAIL("out of memory");
    n->mem[n->n_regs] = m;
    if (seed != 0)
      fill(m, len, seed, n->n_regs);
    else
      memset(m, fill_byte, len);
    memset(lr, 0, sizeof(*lr));
    lr->r.id = n->n_regs;
    lr->r.group = n->n_regs / 2;
    lr->r.slot = n->n_regs % 2;
    lr->r.layer_first = 0;
    lr->r.layer_count = layers;
    lr->r.layer_stride = (uint64_t)blocks * block_bytes;
    lr->r.block_bytes = block_bytes;
    lr->r.block_stride = block_bytes;
    lr->r.num_blocks = blocks;
    lr->r.addr = (uint64_t)(uintptr_t)m;
    lr->r.length = len;
    lr->r.access = remote ? SX_ACCESS_REMOTE_READ : 0;
    snprintf(lr->r.location, sizeof(lr->r.location), "cpu");
    int rc = n->t->ops->reg_mem(n->t, lr);
    CHECK(rc == 0, "reg_mem: %s: %s", sx_err_name(rc), sx_errmsg());
    n->n_regs++;
  }
  return 0;
}

/* The descriptor this node would publish, through encode and decode so
 * that it passes validation exactly as a store's copy would. */
static int node_desc(node *n, sx_desc *out, uint64_t seed) {
  sx_desc d;
  uint8_t *buf;
  size_t len;
  char s[32];
  sx_desc_init(&d);
  snprintf(d.name, sizeof(d.name), "%s", n->name);
  memcpy(d.incarnation, n->inc, SX_INCARNATION_LEN);
  memcpy(d.token, n->token, SX_TOKEN_LEN);
  d.generation = 1;
  d.published_at_ms = sx__wall_ms();
  d.lease_ms = 5000;
  snprintf(d.layout.fingerprint, sizeof(d.layout.fingerprint), "rdma-test");
  snprintf(d.layout.tag, sizeof(d.layout.tag), "NHD");
  snprintf(d.layout.dtype, sizeof(d.layout.dtype), "u8");
  d.layout.tp_size = d.layout.pp_size = 1;
  snprintf(s, sizeof(s), "%" PRIu64, seed);
  sx_desc_set_label(&d, "pattern-seed", s);
  for (uint32_t i = 0; i < n->n_regs; i++)
    if (!n->regs[i].withdrawn)
      sx_desc_add_region(&d, &n->regs[i].r);
  int rc = n->t->ops->pack(n->t, &d);
  if (rc == 0)
    rc = sx_desc_encode(&d, &buf, &len);
  sx_desc_free(&d);
  CHECK(rc == 0, "pack/encode: %s: %s", sx_err_name(rc), sx_errmsg());
  rc = sx_desc_decode(buf, len, out);
  free(buf);
  CHECK(rc == 0, "decode: %s: %s", sx_err_name(rc), sx_errmsg());
  return 0;
}

static void node_close(node *n) {
  if (n->t != NULL) {
    for (uint32_t i = 0; i < n->n_regs; i++)
      n->t->ops->dereg_mem(n->t, &n->regs[i]);
    n->t->ops->close(n->t);
    n->t = NULL;
  }
  for (uint32_t i = 0; i < n->n_regs; i++)
    free(n->mem[i]);
  n->n_regs = 0;
}

static uint64_t desc_seed(const sx_desc *d) {
  const char *s = sx_desc_label(d, "pattern-seed");
  return s != NULL ? strtoull(s, NULL, 10) : 0;
}

/* ------------------------------------------------------------------ ops */

typedef struct opx {
  sx_op op;
  sx_xfer *x;
  size_t cap;
  int done;
  int done_calls;
  uint64_t done_ms;
} opx;

static void opx_done(sx_op *op) {
  opx *o = op->owner;
  o->done = 1;
  o->done_calls++;
  o->done_ms = now_ms();
}

static void opx_init(opx *o, size_t cap) {
  memset(o, 0, sizeof(*o));
  o->x = calloc(cap, sizeof(*o->x));
  o->cap = cap;
  o->op.xfers = o->x;
  o->op.done = opx_done;
  o->op.owner = o;
}

static void opx_add(opx *o, uint8_t *local, const sx_lregion *lreg, const sx_region *rreg,
                    uint64_t roff, uint64_t len) {
  if (o->op.n == o->cap) {
    o->cap *= 2;
    o->x = realloc(o->x, o->cap * sizeof(*o->x));
    o->op.xfers = o->x;
  }
  sx_xfer *x = &o->x[o->op.n];
  memset(x, 0, sizeof(*x));
  x->local = local;
  x->lreg = lreg;
  x->rreg = rreg;
  x->roff = roff;
  x->length = len;
  x->entry_first = x->entry_last = (uint32_t)o->op.n;
  x->status = 1;
  o->op.n++;
}

/* Ready an op for (re)posting. */
static void opx_arm(opx *o) {
  o->op.pending = o->op.n;
  o->op.bytes = 0;
  o->op.first_error = 0;
  o->op.message[0] = '\0';
  o->done = 0;
  o->done_calls = 0;
  for (size_t i = 0; i < o->op.n; i++)
    o->x[i].status = 1;
}

static void opx_free(opx *o) { free(o->x); }

static void on_wake(uv_timer_t *h) { (void)h; }

/* Run the loop until *flag or ms pass.  Returns 1 if the flag was set. */
static int run_until(uv_loop_t *loop, const int *flag, uint64_t ms) {
  uv_timer_t wake;
  uint64_t end = now_ms() + ms;
  uv_timer_init(loop, &wake);
  uv_timer_start(&wake, on_wake, 10, 10);
  while (!*flag && now_ms() < end)
    uv_run(loop, UV_RUN_ONCE);
  uv_close((uv_handle_t *)&wake, NULL);
  uv_run(loop, UV_RUN_NOWAIT);
  return *flag;
}

/* Post an op and wait for it; at the deadline abort it (as the agent does)
 * and wait for the abort to settle it. */
static int run_op(node *r, sx_tpeer *p, opx *o, uint64_t deadline_ms) {
  opx_arm(o);
  int rc = r->t->ops->post(p, &o->op);
  if (rc != 0)
    return rc;
  if (!run_until(r->loop, &o->done, deadline_ms)) {
    r->t->ops->abort(p, &o->op, SX_ETIMEDOUT);
    if (!run_until(r->loop, &o->done, 10000)) {
      fprintf(stderr, "    abort did not settle the op within 10 s (%zu of %zu pending)\n",
              o->op.pending, o->op.n);
      return SX_EBUSY;
    }
  }
  return 0;
}

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
      node_regions(&F.tgt, opt.regions, opt.layers, opt.blocks, opt.block_bytes, 1, F.seed, 0) ||
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
        if (verify(F.rdr.mem[r], b * bb, bb, F.seed, r))
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
    if (verify(F.rdr.mem[r], 0, region_len(), F.seed, r))
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
  CHECK(verify(r2.mem[0], 0, region_len(), F.seed, 0) == 0, "region 0");
  CHECK(verify(r2.mem[1], 0, region_len(), F.seed, 1) == 0, "region 1");
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
    CHECK(verify(F.rdr.mem[2], (uint64_t)k * 3 * opt.block_bytes, opt.block_bytes, F.seed, 2) == 0,
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

static int cmd_selftest(void) {
  /* A test picked by name still needs the tests that set up its state. */
  double t0 = now_s();
  int rc = fixture_open();
  report("fixture_open", rc, now_s() - t0);
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
  return failures ? 1 : 0;
}

/* ------------------------------------------------------------------ multi-process */

static int write_desc(const sx_desc *d, const char *path) {
  uint8_t *buf;
  size_t len;
  char tmp[512];
  int rc = sx_desc_encode(d, &buf, &len);
  CHECK(rc == 0, "encode: %s", sx_errmsg());
  snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid());
  FILE *f = fopen(tmp, "wb");
  CHECK(f != NULL, "%s: %s", tmp, strerror(errno));
  size_t w = fwrite(buf, 1, len, f);
  free(buf);
  CHECK(w == len && fclose(f) == 0, "write %s", tmp);
  CHECK(rename(tmp, path) == 0, "rename %s: %s", path, strerror(errno));
  return 0;
}

/* Wait up to wait_s for path, then decode it. */
static int read_desc(const char *path, int wait_s, const uint8_t *not_inc, sx_desc *out) {
  uint64_t end = now_ms() + (uint64_t)wait_s * 1000;
  for (;;) {
    FILE *f = fopen(path, "rb");
    if (f != NULL) {
      uint8_t buf[1 << 16];
      size_t len = fread(buf, 1, sizeof(buf), f);
      fclose(f);
      if (sx_desc_decode(buf, len, out) == 0) {
        if (not_inc == NULL || memcmp(out->incarnation, not_inc, SX_INCARNATION_LEN) != 0)
          return 0;
        sx_desc_free(out);
      }
    }
    if (now_ms() > end)
      FAIL("no descriptor in %s after %d s", path, wait_s);
    usleep(50000);
  }
}

static void on_stop_check(uv_timer_t *h) {
  struct stat st;
  if (stop_signal || (opt.stop != NULL && stat(opt.stop, &st) == 0))
    uv_stop(h->loop);
}

static void on_signal(int sig) {
  (void)sig;
  stop_signal = 1;
}

static int cmd_serve(void) {
  uv_loop_t loop;
  node n;
  sx_desc d;
  uv_timer_t tick;
  signal(SIGTERM, on_signal);
  signal(SIGINT, on_signal);
  uv_loop_init(&loop);
  uint64_t seed = opt.seed ^ (uint64_t)getpid();
  if (node_open(&n, &loop, "rdma-test/target", opt.port, 0, 0) ||
      node_regions(&n, opt.regions, opt.layers, opt.blocks, opt.block_bytes, 1, seed, 0) ||
      node_desc(&n, &d, seed) || write_desc(&d, opt.desc))
    return 1;
  fprintf(stderr, "serve: %u regions of %" PRIu64 " bytes published in %s (pid %d)\n",
          n.n_regs, n.regs[0].r.length, opt.desc, (int)getpid());
  uv_timer_init(&loop, &tick);
  uv_timer_start(&tick, on_stop_check, 100, 100);
  uv_run(&loop, UV_RUN_DEFAULT);
  uv_close((uv_handle_t *)&tick, NULL);
  sx_desc_free(&d);
  node_close(&n);
  uv_run(&loop, UV_RUN_DEFAULT);
  uv_loop_close(&loop);
  fprintf(stderr, "serve: stopped\n");
  return 0;
}

/* Reader node mirroring the remote regions (same lengths). */
static int mirror_open(node *r, uv_loop_t *loop, const char *name, const sx_desc *d) {
  if (node_open(r, loop, name, 0, opt.slice, opt.conns))
    return -1;
  for (uint32_t i = 0; i < d->n_regions && i < 15; i++) {
    const sx_region *rr = &d->regions[i];
    if (node_regions(r, 1, rr->layer_count, (uint32_t)rr->num_blocks, (uint32_t)rr->block_bytes,
                     0, 0, 0))
      return -1;
  }
  return 0;
}

static int read_everything(node *r, sx_tpeer *p, const sx_desc *d, uint64_t deadline_ms) {
  opx o;
  uint64_t seed = desc_seed(d), total = 0;
  opx_init(&o, 256);
  for (uint32_t i = 0; i < d->n_regions && i < r->n_regs; i++) {
    memset(r->mem[i], 0, d->regions[i].length);
    for (uint64_t off = 0; off < d->regions[i].length;) {
      uint64_t len = d->regions[i].length - off;
      if (len > 700000)
        len = 700000; /* not slice-aligned, several slices per range */
      opx_add(&o, r->mem[i] + off, &r->regs[i], &d->regions[i], off, len);
      off += len;
      total += len;
    }
  }
  double t0 = now_s();
  int rc = run_op(r, p, &o, deadline_ms);
  double secs = now_s() - t0;
  CHECK(rc == 0, "post: %s: %s", sx_err_name(rc), sx_errmsg());
  CHECK(o.op.first_error == 0, "%s: %s", sx_err_name(o.op.first_error), o.op.message);
  for (uint32_t i = 0; i < d->n_regions && i < r->n_regs; i++)
    CHECK(verify(r->mem[i], 0, d->regions[i].length, seed, d->regions[i].id) == 0, "region %u",
          i);
  printf("      %" PRIu64 " bytes in %zu ranges, %.1f MiB/s\n", total, o.op.n,
         (double)total / secs / 1048576.0);
  opx_free(&o);
  return 0;
}

static int test_remote_read_exact(void) {
  uv_loop_t loop;
  node r;
  sx_desc d;
  sx_tpeer *p;
  uv_loop_init(&loop);
  if (read_desc(opt.desc, opt.wait_s, NULL, &d) || mirror_open(&r, &loop, "rdma-test/reader", &d))
    return -1;
  int rc = r.t->ops->peer_open(r.t, &d, &p);
  CHECK(rc == 0, "peer_open: %s", sx_errmsg());
  const sx_endpoint *e = NULL;
  for (uint32_t i = 0; i < d.n_endpoints && e == NULL; i++)
    if (d.endpoints[i].kind == SX_TRANSPORT_RDMA)
      e = &d.endpoints[i];
  printf("      target at %s:%u (%s)\n", e->addr, e->port, e->device);
  rc = read_everything(&r, p, &d, 60000);
  if (rc == 0) {
    /* Again with slices of 4 KiB on a second reader: chains across hosts. */
    node r2;
    sx_tpeer *p2;
    uint32_t saved = opt.slice;
    opt.slice = 4096;
    if (mirror_open(&r2, &loop, "rdma-test/reader2", &d))
      return -1;
    opt.slice = saved;
    rc = r2.t->ops->peer_open(r2.t, &d, &p2);
    CHECK(rc == 0, "peer_open: %s", sx_errmsg());
    rc = read_everything(&r2, p2, &d, 120000);
    r2.t->ops->peer_close(p2);
    node_close(&r2);
  }
  r.t->ops->peer_close(p);
  node_close(&r);
  sx_desc_free(&d);
  uv_run(&loop, UV_RUN_DEFAULT);
  uv_loop_close(&loop);
  return rc;
}

/* Across hosts a post returns before its READs are done, so aborting one op
 * flushes slices of another op sharing its QPs: those must be reissued and
 * that op must still complete, while nothing lands in the aborted op's
 * buffer after it ended. */
static int test_remote_abort_reissues_others(void) {
  uv_loop_t loop;
  node r;
  sx_desc d;
  sx_tpeer *p;
  opx a, b;
  uv_loop_init(&loop);
  if (read_desc(opt.desc, opt.wait_s, NULL, &d) || mirror_open(&r, &loop, "rdma-test/aborter", &d))
    return -1;
  uint32_t scratch = r.n_regs;
  if (node_regions(&r, 1, 1, 64, 1048576, 0, 0, 0xee))
    return -1;
  uint8_t *dst = r.mem[scratch];
  uint64_t dlen = r.regs[scratch].r.length, seed = desc_seed(&d);
  int rc = r.t->ops->peer_open(r.t, &d, &p);
  CHECK(rc == 0, "peer_open: %s", sx_errmsg());
  /* Connect every QP first, so both ops are posted at once. */
  opx_init(&b, 512);
  opx_add(&b, r.mem[0], &r.regs[0], &d.regions[0], 0, 4096);
  rc = run_op(&r, p, &b, 30000);
  CHECK(rc == 0 && b.op.first_error == 0, "warm-up: %s", b.op.message);
  b.op.n = 0;
  /* B: 256 blocks of 16 KiB of region 1; A: 1 MiB ranges into the scratch. */
  memset(r.mem[1], 0, d.regions[1].length);
  for (uint64_t k = 0; k < 256; k++)
    opx_add(&b, r.mem[1] + k * 16384, &r.regs[1], &d.regions[1], k * 16384, 16384);
  opx_init(&a, 64);
  for (uint64_t k = 0; k < 64; k++)
    opx_add(&a, dst + k * 1048576, &r.regs[scratch], &d.regions[k % d.n_regions],
            0, 1048576);
  sx__rdma_stats s0, s1;
  sx__rdma_stats_get(r.t, &s0);
  opx_arm(&b);
  opx_arm(&a);
  CHECK(r.t->ops->post(p, &b.op) == 0, "post b: %s", sx_errmsg());
  CHECK(r.t->ops->post(p, &a.op) == 0, "post a: %s", sx_errmsg());
  r.t->ops->abort(p, &a.op, SX_ECANCELED);
  CHECK(run_until(&loop, &a.done, 10000), "abort did not settle A");
  CHECK(a.op.first_error == SX_ECANCELED, "A: %s", sx_err_name(a.op.first_error));
  uint8_t *snap = malloc(dlen);
  memcpy(snap, dst, dlen);
  CHECK(run_until(&loop, &b.done, 30000), "B did not finish");
  int quiet = 0;
  run_until(&loop, &quiet, 500);
  CHECK(memcmp(snap, dst, dlen) == 0, "A's buffer changed after A ended");
  free(snap);
  CHECK(b.op.first_error == 0, "B: %s: %s", sx_err_name(b.op.first_error), b.op.message);
  CHECK(verify(r.mem[1], 0, 256 * 16384, seed, d.regions[1].id) == 0, "B's bytes");
  sx__rdma_stats_get(r.t, &s1);
  size_t ok = 0;
  for (size_t i = 0; i < a.op.n; i++)
    ok += a.x[i].status == 0;
  printf("      A aborted: %zu of %zu arrived; %" PRIu64 " QPs torn down, %" PRIu64
         " slices of B flushed and reissued\n",
         ok, a.op.n, s1.teardowns - s0.teardowns, s1.requeued - s0.requeued);
  if (opt.expect_reissue)
    CHECK(s1.requeued > s0.requeued, "no slice of B was in flight on an aborted QP");
  opx_free(&a);
  opx_free(&b);
  r.t->ops->peer_close(p);
  node_close(&r);
  sx_desc_free(&d);
  uv_run(&loop, UV_RUN_DEFAULT);
  uv_loop_close(&loop);
  return 0;
}

static int cmd_read(void) {
  RUN(test_remote_read_exact);
  RUN(test_remote_abort_reissues_others);
  if (opt.stop != NULL) {
    FILE *f = fopen(opt.stop, "w");
    if (f != NULL)
      fclose(f);
  }
  return failures ? 1 : 0;
}

static pid_t spawn_serve(const char *desc, int port) {
  char self[512], portbuf[16], regions[16];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0)
    return -1;
  self[n] = '\0';
  snprintf(portbuf, sizeof(portbuf), "%d", port);
  snprintf(regions, sizeof(regions), "%u", opt.regions);
  pid_t pid = fork();
  if (pid == 0) {
    execl(self, self, "serve", "--desc", desc, "--port", portbuf, "--regions", regions,
          (char *)NULL);
    _exit(127);
  }
  return pid;
}

/* The target dies during a batch: the batch fails (within its deadline),
 * the next post fails fast, and after a restart on the same port the old
 * descriptor gets SX_ESTALE while the new one reads fine. */
static int test_target_killed_then_restarted(void) {
  char desc[512];
  uv_loop_t loop;
  node r;
  sx_desc d1, d2;
  sx_tpeer *p1, *p2;
  const int port = 7471;
  const uint64_t deadline = 10000;
  snprintf(desc, sizeof(desc), "%s/kill.desc", opt.dir);
  unlink(desc);
  uv_loop_init(&loop);
  pid_t pid = spawn_serve(desc, port);
  CHECK(pid > 0, "fork");
  if (read_desc(desc, 30, NULL, &d1) || mirror_open(&r, &loop, "rdma-test/killer", &d1))
    return -1;
  int rc = r.t->ops->peer_open(r.t, &d1, &p1);
  CHECK(rc == 0, "peer_open: %s", sx_errmsg());

  /* A batch long enough to be cut in the middle: every region 16 times. */
  opx o;
  opx_init(&o, 512);
  for (int rep = 0; rep < 16; rep++)
    for (uint32_t i = 0; i < d1.n_regions; i++)
      for (uint64_t off = 0; off < d1.regions[i].length; off += 1048576)
        opx_add(&o, r.mem[i] + off, &r.regs[i], &d1.regions[i], off,
                d1.regions[i].length - off < 1048576 ? d1.regions[i].length - off : 1048576);
  opx_arm(&o);
  rc = r.t->ops->post(p1, &o.op);
  CHECK(rc == 0, "post: %s", sx_errmsg());
  uint64_t t_post = now_ms();
  while (o.op.pending == o.op.n && now_ms() < t_post + 10000)
    uv_run(&loop, UV_RUN_ONCE);
  CHECK(!o.done, "the batch ended before the kill");
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  uint64_t t_kill = now_ms();
  if (!run_until(&loop, &o.done, deadline)) {
    r.t->ops->abort(p1, &o.op, SX_ETIMEDOUT);
    CHECK(run_until(&loop, &o.done, 5000), "abort after the deadline did not settle the batch");
  }
  uint64_t took = o.done_ms - t_kill;
  printf("      batch ended %" PRIu64 " ms after the kill: %s: %s\n", took,
         sx_err_name(o.op.first_error), o.op.message);
  CHECK(o.op.first_error != 0, "the batch succeeded although its target died");
  CHECK(took <= deadline + 1000, "took %" PRIu64 " ms", took);
  CHECK(o.done_calls == 1, "done ran %d times", o.done_calls);

  /* The next post reconnects, and finds nobody. */
  opx q;
  opx_init(&q, 2);
  opx_add(&q, r.mem[0], &r.regs[0], &d1.regions[0], 0, 4096);
  rc = run_op(&r, p1, &q, 15000);
  int err = rc != 0 ? rc : q.op.first_error;
  printf("      next post: %s: %s\n", sx_err_name(err), rc != 0 ? sx_errmsg() : q.op.message);
  CHECK(err == SX_EUNREACH || err == SX_ETIMEDOUT, "got %s", sx_err_name(err));

  /* Restart on the same port: a new incarnation. */
  pid = spawn_serve(desc, port);
  CHECK(pid > 0, "fork");
  if (read_desc(desc, 30, d1.incarnation, &d2))
    return -1;
  rc = run_op(&r, p1, &q, 15000);
  err = rc != 0 ? rc : q.op.first_error;
  printf("      old descriptor after restart: %s: %s\n", sx_err_name(err),
         rc != 0 ? sx_errmsg() : q.op.message);
  CHECK(err == SX_ESTALE, "got %s", sx_err_name(err));
  r.t->ops->peer_close(p1);
  /* Re-open with the new descriptor. */
  rc = r.t->ops->peer_open(r.t, &d2, &p2);
  CHECK(rc == 0, "peer_open: %s", sx_errmsg());
  rc = read_everything(&r, p2, &d2, 60000);
  r.t->ops->peer_close(p2);
  kill(pid, SIGTERM);
  waitpid(pid, NULL, 0);
  opx_free(&o);
  opx_free(&q);
  node_close(&r);
  sx_desc_free(&d1);
  sx_desc_free(&d2);
  uv_run(&loop, UV_RUN_DEFAULT);
  uv_loop_close(&loop);
  return rc;
}

static int cmd_killtest(void) {
  RUN(test_target_killed_then_restarted);
  return failures ? 1 : 0;
}

/* ------------------------------------------------------------------ bench */

/* Batched READs of size-byte blocks from a serve process, ops of `batch`
 * xfers, `depth` ops in flight, for opt.seconds. */
static int cmd_bench(void) {
  uv_loop_t loop;
  node r;
  sx_desc d;
  sx_tpeer *p;
  uv_loop_init(&loop);
  if (read_desc(opt.desc, opt.wait_s, NULL, &d) || mirror_open(&r, &loop, "rdma-test/bench", &d))
    return 1;
  int rc = r.t->ops->peer_open(r.t, &d, &p);
  if (rc) {
    fprintf(stderr, "peer_open: %s\n", sx_errmsg());
    return 1;
  }
  uint64_t rlen = d.regions[0].length, size = opt.size;
  if (size > rlen)
    size = rlen;
  uint64_t per_region = rlen / size;
  opx *ops = calloc(opt.depth, sizeof(*ops));
  uint64_t next = 0, bytes = 0, batches = 0;
  for (uint32_t k = 0; k < opt.depth; k++) {
    opx_init(&ops[k], opt.batch);
    for (uint32_t j = 0; j < opt.batch; j++, next++) {
      uint32_t reg = (uint32_t)(next / per_region % d.n_regions);
      uint64_t off = next % per_region * size;
      opx_add(&ops[k], r.mem[reg] + off, &r.regs[reg], &d.regions[reg], off, size);
    }
  }
  /* Warm up: connect every QP. */
  rc = run_op(&r, p, &ops[0], 20000);
  if (rc || ops[0].op.first_error) {
    fprintf(stderr, "warm-up: %s %s\n", sx_errmsg(), ops[0].op.message);
    return 1;
  }
  double t0 = now_s(), end = t0 + opt.seconds;
  for (uint32_t k = 0; k < opt.depth; k++) {
    opx_arm(&ops[k]);
    if (r.t->ops->post(p, &ops[k].op) != 0)
      return 1;
  }
  int running = (int)opt.depth;
  while (running > 0) {
    uv_run(&loop, UV_RUN_ONCE);
    for (uint32_t k = 0; k < opt.depth; k++) {
      if (!ops[k].done || ops[k].op.n == 0)
        continue;
      if (ops[k].op.first_error) {
        fprintf(stderr, "batch failed: %s\n", ops[k].op.message);
        return 1;
      }
      bytes += ops[k].op.bytes;
      batches++;
      ops[k].done = 0;
      if (now_s() < end) {
        opx_arm(&ops[k]);
        if (r.t->ops->post(p, &ops[k].op) != 0)
          return 1;
      } else {
        ops[k].op.n = 0;
        running--;
      }
    }
  }
  double secs = now_s() - t0;
  sx__rdma_stats st;
  sx__rdma_stats_get(r.t, &st);
  printf("segxfer-read size=%" PRIu64 " batch=%u depth=%u conns=%u slice=%u: %" PRIu64
         " batches, %.2f MiB/s (%" PRIu64 " WRs, %" PRIu64 " posts, %" PRIu64 " signalled)\n",
         size, opt.batch, opt.depth, opt.conns ? opt.conns : SX__RDMA_DEFAULT_CONNS,
         opt.slice ? opt.slice : SX__RDMA_DEFAULT_SLICE, batches,
         (double)bytes / secs / 1048576.0, st.wrs, st.posts, st.signaled);
  for (uint32_t k = 0; k < opt.depth; k++)
    opx_free(&ops[k]);
  free(ops);
  r.t->ops->peer_close(p);
  node_close(&r);
  sx_desc_free(&d);
  uv_run(&loop, UV_RUN_DEFAULT);
  uv_loop_close(&loop);
  if (opt.stop != NULL) {
    FILE *f = fopen(opt.stop, "w");
    if (f != NULL)
      fclose(f);
  }
  return 0;
}

/* ------------------------------------------------------------------ main */

static void usage(void) {
  fprintf(stderr,
          "usage: sx-rdma-test selftest|serve|read|killtest|bench [options]\n"
          "  --desc FILE      descriptor file (serve writes it, read/bench read it)\n"
          "  --stop FILE      serve: stop when it exists; read/bench: create it at the end\n"
          "  --dir DIR        killtest: where to put its descriptor\n"
          "  --port N         serve: rdma_cm port (default any)\n"
          "  --regions N --layers N --blocks N --block-bytes N   target geometry\n"
          "  --slice N --conns N   reader: READ slice size, QPs per peer\n"
          "  --size N --batch N --depth N --seconds S   bench\n"
          "  --wait S         seconds to wait for the descriptor (default 60)\n"
          "  --expect-reissue read: an abort must flush and reissue another op's READs\n"
          "  -v               transport logs at debug level\n");
}

int main(int argc, char **argv) {
  static const struct option longs[] = {
      {"desc", 1, NULL, 'd'},    {"stop", 1, NULL, 's'},        {"dir", 1, NULL, 'D'},
      {"port", 1, NULL, 'p'},    {"regions", 1, NULL, 'r'},     {"layers", 1, NULL, 'l'},
      {"blocks", 1, NULL, 'b'},  {"block-bytes", 1, NULL, 'B'}, {"slice", 1, NULL, 'S'},
      {"conns", 1, NULL, 'c'},   {"size", 1, NULL, 'z'},        {"batch", 1, NULL, 'n'},
      {"depth", 1, NULL, 'q'},   {"seconds", 1, NULL, 't'},     {"wait", 1, NULL, 'w'},
      {"seed", 1, NULL, 'e'},    {"expect-reissue", 0, NULL, 'x'},
      {NULL, 0, NULL, 0}};
  if (argc < 2) {
    usage();
    return 2;
  }
  const char *cmd = argv[1];
  optind = 2;
  int ch;
  while ((ch = getopt_long(argc, argv, "v", longs, NULL)) != -1) {
    switch (ch) {
    case 'd': opt.desc = optarg; break;
    case 's': opt.stop = optarg; break;
    case 'D': opt.dir = optarg; break;
    case 'p': opt.port = atoi(optarg); break;
    case 'r': opt.regions = (uint32_t)atoi(optarg); break;
    case 'l': opt.layers = (uint32_t)atoi(optarg); break;
    case 'b': opt.blocks = (uint32_t)atoi(optarg); break;
    case 'B': opt.block_bytes = (uint32_t)atoi(optarg); break;
    case 'S': opt.slice = (uint32_t)atoi(optarg); break;
    case 'c': opt.conns = (uint32_t)atoi(optarg); break;
    case 'z': opt.size = strtoull(optarg, NULL, 0); break;
    case 'n': opt.batch = (uint32_t)atoi(optarg); break;
    case 'q': opt.depth = (uint32_t)atoi(optarg); break;
    case 't': opt.seconds = atof(optarg); break;
    case 'w': opt.wait_s = atoi(optarg); break;
    case 'e': opt.seed = strtoull(optarg, NULL, 0); break;
    case 'v': opt.verbose = 1; break;
    case 'x': opt.expect_reissue = 1; break;
    default: usage(); return 2;
    }
  }
  if (opt.regions < 2 || opt.regions > 15 || opt.block_bytes % 8 != 0) {
    fprintf(stderr, "sx-rdma-test: 2..15 regions, block bytes a multiple of 8\n");
    return 2;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  only = argv + optind;
  if (strcmp(cmd, "selftest") == 0)
    return cmd_selftest();
  if (strcmp(cmd, "serve") == 0 && opt.desc != NULL)
    return cmd_serve();
  if (strcmp(cmd, "read") == 0 && opt.desc != NULL)
    return cmd_read();
  if (strcmp(cmd, "killtest") == 0 && opt.dir != NULL)
    return cmd_killtest();
  if (strcmp(cmd, "bench") == 0 && opt.desc != NULL)
    return cmd_bench();
  usage();
  return 2;
}
