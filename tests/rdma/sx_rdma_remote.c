/*
 * sx-rdma-test read and killtest: a reader in this process against a serve
 * process (on this host or another) found through its descriptor file:
 * byte-exact reads of everything, an abort that must not lose another op's
 * flushed READs, and a target killed during a batch, restarted on the same
 * port and re-opened.
 */
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sx_rdma_test.h"

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
  CHECK(pattern_verify(r.mem[1], 0, 256 * 16384, seed, d.regions[1].id) == 0, "B's bytes");
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

int cmd_read(void) {
  RUN(test_remote_read_exact);
  RUN(test_remote_abort_reissues_others);
  if (opt.stop != NULL) {
    FILE *f = fopen(opt.stop, "w");
    if (f != NULL)
      fclose(f);
  }
  return test_failures ? 1 : 0;
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

int cmd_killtest(void) {
  RUN(test_target_killed_then_restarted);
  return test_failures ? 1 : 0;
}
