/*
 * sx-rdma-test wselftest: push mode (RDMA WRITE) through sx__rdma_ops, a
 * consumer and a producer in one process, each on a loop of its own.  Both
 * loops are run from this thread, so a test can let one side run while the
 * other stands still: that places a revoke exactly where the agents only
 * meet by chance (test_rdma_push runs them on threads of their own).  The
 * consumer's agent part (grants, authorization, notices) is faked here; the
 * agent's own is tested by test_rdma_push.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sx_rdma_test.h"

#define BLOCKS 64
#define BLOCK_BYTES 4096
#define PNAME "rdma-test/producer"

static struct {
  uv_loop_t cloop, ploop;
  node c, p;       /* consumer, producer */
  sx_desc desc;    /* the consumer's */
  sx_tpeer *peer;  /* the producer's write peer */
  int granted;     /* does a grant cover the producer? */
  uint64_t epoch;  /* grant changes */
  int notices;     /* notices the consumer took */
  uint64_t seed;
} W;

/* ------------------------------------------------------------------ the consumer's agent part */

static int notice(void *agent, const char *producer, const uint8_t *inc, sx_transport_kind kind,
                  const uint8_t *buf, size_t len, char *msg, size_t cap) {
  (void)agent;
  (void)producer;
  (void)inc;
  (void)kind;
  (void)buf;
  (void)len;
  (void)msg;
  (void)cap;
  W.notices++;
  return 0;
}

static void written(void *agent, sx_transport_kind kind, uint64_t bytes, int err) {
  (void)agent;
  (void)kind;
  (void)bytes;
  (void)err;
}

/* Grant or revoke, as sx_agent_grant_write/revoke_write do on the loop. */
static void set_granted(int on) {
  W.granted = on;
  W.epoch++;
  if (!on)
    W.c.t->ops->grants_changed(W.c.t);
}

/* ------------------------------------------------------------------ driving the loops */

typedef int (*cond_fn)(void);

/* Run the consumer's loop (c), the producer's (p), or both, until cond()
 * holds or ms pass.  Returns 1 if it holds. */
static int run_while(int c, int p, cond_fn cond, uint64_t ms) {
  uint64_t end = now_ms() + ms;
  while (!cond()) {
    if (now_ms() > end)
      return 0;
    if (c)
      uv_run(&W.cloop, UV_RUN_NOWAIT);
    if (p)
      uv_run(&W.ploop, UV_RUN_NOWAIT);
    usleep(200);
  }
  return 1;
}

static rdma_peer *wpeer(void) { return (rdma_peer *)W.peer; }

static int all_connecting(void) {
  for (uint32_t i = 0; i < wpeer()->n_conns; i++)
    if (wpeer()->conns[i].state != RC_CONNECT)
      return 0;
  return 1;
}

/* Producers' QPs the consumer accepted (its tconns with a QP). */
static uint32_t accepted(void) {
  uint32_t n = 0;
  for (rdma_tconn *tc = ((sx_rdma *)W.c.t)->tconns; tc != NULL; tc = tc->next)
    n += tc->write && tc->qpn != 0;
  return n;
}

static int all_accepted(void) { return accepted() == wpeer()->n_conns; }

static int all_up(void) {
  for (uint32_t i = 0; i < wpeer()->n_conns; i++)
    if (wpeer()->conns[i].state != RC_UP)
      return 0;
  return 1;
}

/* What RDMA_CM_EVENT_DISCONNECTED does to every QP of the producer: each
 * goes to error and waits for its flush (RC_DRAIN). */
static void teardown_all(void) {
  sx_rdma *t = (sx_rdma *)W.p.t;
  sx__rdma_enter(t);
  for (uint32_t i = 0; i < wpeer()->n_conns; i++)
    sx__rdma_conn_teardown(&wpeer()->conns[i], SX_EDISCONN, 0,
                           "the consumer disconnected (the test says so)");
  sx__rdma_leave(t, 0);
}

static int all_draining(void) {
  for (uint32_t i = 0; i < wpeer()->n_conns; i++)
    if (wpeer()->conns[i].state != RC_DRAIN)
      return 0;
  return 1;
}

/* Neither side holds a connection any more. */
static int no_conns(void) {
  for (uint32_t i = 0; W.peer != NULL && i < wpeer()->n_conns; i++)
    if (wpeer()->conns[i].state != RC_IDLE)
      return 0;
  return ((sx_rdma *)W.c.t)->tconns == NULL;
}

static opx *cur_op;
static int op_done(void) { return cur_op->done; }

static int noticed_status = 1;
static void op_noticed(sx_op *op, int status, const char *msg) {
  (void)op;
  (void)msg;
  noticed_status = status;
}
static int noticed(void) { return noticed_status != 1; }

/* Close the producer's peer and open a new one: no QP yet. */
static int fresh_peer(void) {
  W.p.t->ops->peer_close(W.peer);
  W.peer = NULL;
  CHECK(run_while(1, 1, no_conns, 10000), "the consumer kept QPs of a closed peer");
  int rc = W.p.t->ops->wpeer_open(W.p.t, &W.desc, &W.peer);
  CHECK(rc == 0, "wpeer_open: %s", sx_errmsg());
  return 0;
}

/* A write op of blocks first..first+count of region 0 to the same blocks
 * of the consumer's region 0. */
static void wop_init(opx *o, uint32_t first, uint32_t count) {
  opx_init(o, 1);
  opx_add(o, W.p.mem[0] + (uint64_t)first * BLOCK_BYTES, &W.p.regs[0], &W.desc.regions[0],
          (uint64_t)first * BLOCK_BYTES, (uint64_t)count * BLOCK_BYTES);
  o->op.noticed = op_noticed;
  opx_arm(o);
}

static int blocks_zero(uint32_t first, uint32_t count) {
  const uint8_t *m = W.c.mem[0] + (uint64_t)first * BLOCK_BYTES;
  for (uint64_t i = 0; i < (uint64_t)count * BLOCK_BYTES; i++)
    if (m[i] != 0)
      return 0;
  return 1;
}

/* Post o, run both loops until it settles (at most ms): its first error,
 * or SX_EBUSY if it did not settle. */
static int wop_run(opx *o, uint64_t ms, double *secs) {
  double t0 = now_s();
  int rc = W.p.t->ops->post(W.peer, &o->op);
  *secs = 0;
  if (rc != 0)
    return rc;
  cur_op = o;
  int done = run_while(1, 1, op_done, ms);
  *secs = now_s() - t0;
  return done ? o->op.first_error : SX_EBUSY;
}

/* ------------------------------------------------------------------ fixture */

static int wfixture_open(void) {
  memset(&W, 0, sizeof(W));
  W.seed = opt.seed ^ 0x77;
  uv_loop_init(&W.cloop);
  uv_loop_init(&W.ploop);
  if (node_open(&W.c, &W.cloop, "rdma-test/consumer", 0, 0, 0) ||
      node_regions(&W.c, 2, 1, BLOCKS, BLOCK_BYTES,
                   SX_ACCESS_REMOTE_READ | SX_ACCESS_REMOTE_WRITE, 0, 0) ||
      node_desc(&W.c, &W.desc, 0))
    return -1;
  W.c.ctx.notice = notice;
  W.c.ctx.written = written;
  CHECK(W.desc.regions[0].n_wkeys > 0, "the consumer publishes no write key");
  if (node_open(&W.p, &W.ploop, PNAME, 0, 0, opt.conns) ||
      node_regions(&W.p, 2, 1, BLOCKS, BLOCK_BYTES, 0, W.seed, 0))
    return -1;
  node_grant(&W.c, &W.p, &W.granted, &W.epoch);
  int rc = W.p.t->ops->wpeer_open(W.p.t, &W.desc, &W.peer);
  CHECK(rc == 0, "wpeer_open: %s: %s", sx_err_name(rc), sx_errmsg());
  return 0;
}

static void wfixture_close(void) {
  if (W.peer != NULL)
    W.p.t->ops->peer_close(W.peer);
  node_close(&W.p);
  node_close(&W.c);
  sx_desc_free(&W.desc);
  for (int k = 0; k < 20; k++) { /* close callbacks, pending auth timers */
    uv_run(&W.cloop, UV_RUN_NOWAIT);
    uv_run(&W.ploop, UV_RUN_NOWAIT);
  }
  uv_loop_close(&W.cloop);
  uv_loop_close(&W.ploop);
}

/* ------------------------------------------------------------------ tests */

/* Granted: the bytes land, then the notice; the consumer took it. */
static int test_write_lands_then_notice(void) {
  static opx o; /* a failed check leaves it to the fixture's close */
  double secs;
  set_granted(1);
  wop_init(&o, 0, 4);
  int rc = wop_run(&o, 20000, &secs);
  CHECK(rc == 0, "write: %s: %s", sx_err_name(rc), o.op.message);
  CHECK(pattern_verify(W.c.mem[0], 0, 4 * BLOCK_BYTES, W.seed, 0) == 0, "the bytes that landed");
  CHECK(blocks_zero(4, 4), "blocks past the write were touched");
  noticed_status = 1;
  uint8_t body[8] = "notice";
  rc = W.p.t->ops->notify(W.peer, &o.op, body, sizeof(body));
  CHECK(rc == 0, "notify: %s", sx_errmsg());
  CHECK(run_while(1, 1, noticed, 10000), "the notice was not answered within 10 s");
  CHECK(noticed_status == 0 && W.notices == 1, "noticed %s, %d notices",
        sx_err_name(noticed_status), W.notices);
  opx_free(&o);
  return 0;
}

/*
 * The revoke comes after the consumer accepted the producer's QPs and before
 * the producer's side of them came up: the consumer's cm_ids wait for the
 * producer's RTU, so rdma_disconnect() has nothing to send yet, and the
 * consumer destroys its QPs.  The producer's QPs then come up facing no QP.
 * Its op must fail promptly (the consumer disconnects them once they are
 * established), not wait on WRITEs that nothing will ever acknowledge; the
 * next op is refused; nothing lands; granted again, writes land again.
 */
static int test_revoke_between_accept_and_established(void) {
  static opx o; /* a failed check leaves it to the fixture's close */
  double secs;
  if (fresh_peer()) /* the first test left its QPs up */
    return -1;
  memset(W.c.mem[0], 0, BLOCKS * BLOCK_BYTES);

  wop_init(&o, 8, 4);
  int rc = W.p.t->ops->post(W.peer, &o.op);
  CHECK(rc == 0, "post: %s", sx_errmsg());
  /* The producer resolves and sends its connect requests; the consumer
   * stands still. */
  CHECK(run_while(0, 1, all_connecting, 10000), "the producer's QPs did not reach rdma_connect");
  /* The consumer authorizes and accepts them; the producer stands still. */
  CHECK(run_while(1, 0, all_accepted, 10000), "the consumer accepted %u of %u QPs", accepted(),
        wpeer()->n_conns);
  set_granted(0);
  CHECK(accepted() == 0, "%u QPs left after the revoke", accepted());
  /* Now both run: the producer's QPs come up, its WRITEs go out. */
  cur_op = &o;
  double t0 = now_s();
  int done = run_while(1, 1, op_done, 20000);
  secs = now_s() - t0;
  printf("      op after the revoke: %s in %.2fs: %s\n",
         done ? sx_err_name(o.op.first_error) : "still pending", secs, o.op.message);
  CHECK(done, "the op did not settle within 20 s of the revoke");
  CHECK(o.op.first_error == SX_EDISCONN || o.op.first_error == SX_EACCESS ||
            o.op.first_error == SX_ERDMA,
        "%s", sx_err_name(o.op.first_error));
  CHECK(secs < 10.0, "the op settled only after %.2fs", secs);
  CHECK(run_while(1, 1, no_conns, 10000), "connections left after the revoke: the consumer's "
        "%s, the producer's QP 0 in state %d", ((sx_rdma *)W.c.t)->tconns ? "some" : "none",
        wpeer()->conns[0].state);
  CHECK(blocks_zero(8, 4), "bytes landed after the revoke");
  opx_free(&o);

  /* The next op is refused at connect. */
  wop_init(&o, 8, 4);
  rc = wop_run(&o, 20000, &secs);
  printf("      next op: %s in %.2fs: %s\n", sx_err_name(rc), secs, o.op.message);
  CHECK(rc == SX_EACCESS, "got %s", sx_err_name(rc));
  CHECK(blocks_zero(8, 4), "bytes landed while refused");
  opx_free(&o);

  /* Granted again: it lands. */
  set_granted(1);
  wop_init(&o, 8, 4);
  rc = wop_run(&o, 20000, &secs);
  CHECK(rc == 0, "granted again: %s: %s", sx_err_name(rc), o.op.message);
  CHECK(pattern_verify(W.c.mem[0], 8 * BLOCK_BYTES, 4 * BLOCK_BYTES, W.seed, 0) == 0,
        "the bytes that landed");
  opx_free(&o);
  return 0;
}

/*
 * Every QP of the producer is being torn down (the consumer disconnected
 * them; their flush is not in yet) when the next op is posted, and again
 * when a finished op's notice is sent.  Neither may fail at once for want of
 * a QP, nor hang: both wait for the flushes, connect again, and (still
 * granted) the bytes land and the notice is taken.
 */
static int test_post_and_notice_while_every_qp_drains(void) {
  static opx o, o2; /* a failed check leaves them to the fixture's close */
  double secs;
  uint8_t body[8] = "notice";
  set_granted(1);
  memset(W.c.mem[0], 0, BLOCKS * BLOCK_BYTES);
  /* A fresh peer's first op brings up every QP. */
  if (fresh_peer())
    return -1;
  wop_init(&o, 16, 4);
  int rc = wop_run(&o, 20000, &secs);
  CHECK(rc == 0, "write: %s: %s", sx_err_name(rc), o.op.message);
  CHECK(run_while(1, 1, all_up, 10000), "the producer's QPs did not all come up");
  teardown_all();
  CHECK(all_draining(), "the QPs are not draining");
  wop_init(&o2, 20, 4);
  rc = wop_run(&o2, 20000, &secs);
  printf("      posted while every QP drained: %s in %.2fs %s\n", sx_err_name(rc), secs,
         rc != 0 && o2.op.message[0] == '\0' ? sx_errmsg() : o2.op.message);
  CHECK(rc == 0, "got %s", sx_err_name(rc));
  CHECK(pattern_verify(W.c.mem[0], 20 * BLOCK_BYTES, 4 * BLOCK_BYTES, W.seed, 0) == 0,
        "the bytes that landed");

  /* Again, and now a notice goes out while they drain. */
  if (fresh_peer())
    return -1;
  opx_free(&o);
  wop_init(&o, 16, 4);
  rc = wop_run(&o, 20000, &secs);
  CHECK(rc == 0, "write: %s: %s", sx_err_name(rc), o.op.message);
  CHECK(run_while(1, 1, all_up, 10000), "the producer's QPs did not all come up");
  teardown_all();
  CHECK(all_draining(), "the QPs are not draining");
  noticed_status = 1;
  int notices = W.notices;
  rc = W.p.t->ops->notify(W.peer, &o.op, body, sizeof(body));
  CHECK(rc == 0, "notify: %s", sx_errmsg());
  CHECK(run_while(1, 1, noticed, 20000), "the notice was not settled within 20 s");
  printf("      notice sent while every QP drained: %s\n", sx_err_name(noticed_status));
  CHECK(noticed_status == 0 && W.notices == notices + 1, "noticed %s, %d notices",
        sx_err_name(noticed_status), W.notices - notices);
  opx_free(&o);
  opx_free(&o2);
  return 0;
}

int cmd_wselftest(void) {
  double t0 = now_s();
  int rc = wfixture_open();
  test_report("wfixture_open", rc, now_s() - t0);
  if (rc)
    return 1;
  RUN(test_write_lands_then_notice);
  RUN(test_revoke_between_accept_and_established);
  RUN(test_post_and_notice_while_every_qp_drains);
  wfixture_close();
  return test_failures ? 1 : 0;
}
