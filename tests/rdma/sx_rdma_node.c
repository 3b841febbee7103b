/*
 * sx-rdma-test's fake agent (see sx_rdma_test.h): the verification
 * pattern, a node that opens sx__rdma_ops and registers regions as an agent
 * would, ops of xfers posted and waited for on the node's loop, and
 * descriptors handed between processes in files.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sx_rdma_test.h"

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

void pattern_fill(uint8_t *p, uint64_t len, uint64_t seed, uint32_t id) {
  for (uint64_t o = 0; o + 8 <= len; o += 8) {
    uint64_t v = pattern(seed, id, o);
    memcpy(p + o, &v, 8);
  }
}

int pattern_verify(const uint8_t *p, uint64_t off, uint64_t len, uint64_t seed, uint32_t id) {
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

int node_open(node *n, uv_loop_t *loop, const char *name, int port, uint32_t slice,
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

/* ------------------------------------------------------------------ push: grants */

/* Authorization answers from the consumer's loop, later, as the agent's
 * store lookup does, and looks at the grant again then. */
struct sx_wauth {
  uv_timer_t timer;
  node *c;
  sx_wauth_cb cb; /* NULL once cancelled */
  void *arg;
};

static void auth_free(uv_handle_t *h) { free(h->data); }

static void auth_answer(uv_timer_t *h) {
  sx_wauth *w = h->data;
  node *c = w->c;
  char why[128];
  snprintf(why, sizeof(why), "no write grant covers %s (revoked meanwhile)", c->grantee);
  if (w->cb != NULL)
    w->cb(w->arg, *c->granted ? 0 : SX_EACCESS, c->grantee, *c->granted ? NULL : why);
  uv_close((uv_handle_t *)&w->timer, auth_free);
}

static int write_auth(void *agent, const char *producer, const uint8_t *inc, const uint8_t *token,
                      sx_wauth_cb cb, void *arg, sx_wauth **out) {
  node *c = agent;
  (void)producer;
  (void)token;
  if (memcmp(inc, c->grantee_inc, SX_INCARNATION_LEN) != 0)
    return sx__err(SX_EACCESS, "no published segment has that incarnation");
  if (!*c->granted)
    return sx__err(SX_EACCESS, "no write grant covers %s", c->grantee);
  sx_wauth *w = calloc(1, sizeof(*w));
  if (w == NULL)
    return sx__err(SX_ENOMEM, "write_auth");
  w->c = c;
  w->cb = cb;
  w->arg = arg;
  uv_timer_init(c->loop, &w->timer);
  w->timer.data = w;
  uv_timer_start(&w->timer, auth_answer, 0, 0);
  *out = w;
  return 0;
}

static void write_auth_cancel(sx_wauth *w) { w->cb = NULL; }

static int write_granted(void *agent, const char *producer, const uint8_t *inc) {
  const node *c = agent;
  return strcmp(producer, c->grantee) == 0 &&
                 memcmp(inc, c->grantee_inc, SX_INCARNATION_LEN) == 0 && *c->granted
             ? 0
             : SX_EACCESS;
}

void node_grant(node *c, const node *producer, const int *granted, const uint64_t *epoch) {
  c->grantee = producer->name;
  c->grantee_inc = producer->inc;
  c->granted = granted;
  c->ctx.write_auth = write_auth;
  c->ctx.write_auth_cancel = write_auth_cancel;
  c->ctx.write_granted = write_granted;
  c->ctx.grant_epoch = epoch;
}

int node_regions(node *n, uint32_t count, uint32_t layers, uint32_t blocks,
                        uint32_t block_bytes, uint32_t access, uint64_t seed, int fill_byte) {
  for (uint32_t i = 0; i < count; i++) {
    sx_lregion *lr = &n->regs[n->n_regs];
    uint64_t len = (uint64_t)layers * blocks * block_bytes;
    void *m = NULL, *h = NULL;
    if (posix_memalign(&h, 4096, len) != 0)
      FAIL("out of memory");
    if (seed != 0)
      pattern_fill(h, len, seed, n->n_regs);
    else
      memset(h, fill_byte, len);
    if (n->gpu) {
      int rc = sx__mem_alloc(0, len, &m);
      if (rc == 0)
        rc = sx__mem_copy(m, h, len);
      free(h);
      CHECK(rc == 0, "cuda:0 memory: %s", sx_errmsg());
    } else {
      m = h;
    }
    n->mem[n->n_regs] = m;
    memset(lr, 0, sizeof(*lr));
    if (n->gpu)
      lr->mem = (sx__mem_info){.kind = SX__MEM_CUDA, .device = 0,
                               .base = (uint64_t)(uintptr_t)m, .size = len};
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
    lr->r.access = access;
    snprintf(lr->r.location, sizeof(lr->r.location), n->gpu ? "cuda:0" : "cpu");
    int rc = n->t->ops->reg_mem(n->t, lr);
    CHECK(rc == 0, "reg_mem: %s: %s", sx_err_name(rc), sx_errmsg());
    n->n_regs++;
  }
  return 0;
}

int node_desc(node *n, sx_desc *out, uint64_t seed) {
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

void node_close(node *n) {
  if (n->t != NULL) {
    for (uint32_t i = 0; i < n->n_regs; i++)
      n->t->ops->dereg_mem(n->t, &n->regs[i]);
    n->t->ops->close(n->t);
    n->t = NULL;
  }
  for (uint32_t i = 0; i < n->n_regs; i++) {
    if (n->gpu)
      sx__mem_free(n->mem[i]);
    else
      free(n->mem[i]);
  }
  n->n_regs = 0;
}

uint64_t desc_seed(const sx_desc *d) {
  const char *s = sx_desc_label(d, "pattern-seed");
  return s != NULL ? strtoull(s, NULL, 10) : 0;
}

/* ------------------------------------------------------------------ ops */

static void opx_done(sx_op *op) {
  opx *o = op->owner;
  o->done = 1;
  o->done_calls++;
  o->done_ms = now_ms();
}

void opx_init(opx *o, size_t cap) {
  memset(o, 0, sizeof(*o));
  o->x = calloc(cap, sizeof(*o->x));
  o->cap = cap;
  o->op.xfers = o->x;
  o->op.done = opx_done;
  o->op.owner = o;
}

void opx_add(opx *o, uint8_t *local, const sx_lregion *lreg, const sx_region *rreg,
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

void opx_arm(opx *o) {
  o->op.pending = o->op.n;
  o->op.bytes = 0;
  o->op.first_error = 0;
  o->op.message[0] = '\0';
  o->done = 0;
  o->done_calls = 0;
  for (size_t i = 0; i < o->op.n; i++)
    o->x[i].status = 1;
}

void opx_free(opx *o) { free(o->x); }

static void on_wake(uv_timer_t *h) { (void)h; }

int run_until(uv_loop_t *loop, const int *flag, uint64_t ms) {
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

int run_op(node *r, sx_tpeer *p, opx *o, uint64_t deadline_ms) {
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

/* ------------------------------------------------------------------ descriptor files */

int write_desc(const sx_desc *d, const char *path) {
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

int read_desc(const char *path, int wait_s, const uint8_t *not_inc, sx_desc *out) {
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

int mirror_open(node *r, uv_loop_t *loop, const char *name, const sx_desc *d) {
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

int read_everything(node *r, sx_tpeer *p, const sx_desc *d, uint64_t deadline_ms) {
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
    CHECK(pattern_verify(r->mem[i], 0, d->regions[i].length, seed, d->regions[i].id) == 0,
          "region %u", i);
  printf("      %" PRIu64 " bytes in %zu ranges, %.1f MiB/s\n", total, o.op.n,
         (double)total / secs / 1048576.0);
  opx_free(&o);
  return 0;
}
