/*
 * sx-rdma-test: the RDMA transport against a real device (Soft-RoCE in the
 * test VM, or real hardware).  It plays the agent's part itself: a fake
 * sx_tctx with registered regions on the target side, ops of xfers on the
 * reader side, driven through sx__rdma_ops on one uv loop per process
 * (sx_rdma_test.h lists the parts).
 *
 *   selftest                 every in-process test, target and reader in one
 *                            process over the device's loopback
 *   wselftest                push mode in process: consumer and producer, each
 *                            on a loop of its own, stepped from one thread
 *   nictest                  one segment on two NICs (two devices, two subnets):
 *                            reads and writes through both, one NIC taken down
 *   nictest-gpu              the same, the target's regions in cuda:0 memory
 *                            (staged; SX_CUDA_LIBRARY=libfakecuda.so)
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

#include "sx_rdma_test.h"

/* ------------------------------------------------------------------ options */

rdma_test_opts opt = {
    .regions = 4, .layers = 2, .blocks = 256, .block_bytes = 16384,
    .seed = 0x5eed, .wait_s = 60, .size = 65536, .depth = 4, .batch = 64,
    .seconds = 3.0,
};

int test_failures;
static volatile sig_atomic_t stop_signal;

void test_report(const char *name, int rc, double secs) {
  printf("%s  %-44s %6.2fs\n", rc == 0 ? "PASS" : "FAIL", name, secs);
  fflush(stdout);
  if (rc != 0)
    test_failures++;
}

static char **only; /* selftest: run only these tests */

int test_selected(const char *name) {
  if (only == NULL || *only == NULL)
    return 1;
  for (char **o = only; *o != NULL; o++)
    if (strstr(name, *o) != NULL)
      return 1;
  return 0;
}

/* ------------------------------------------------------------------ serve */

static void on_stop_check(uv_timer_t *h) {
  struct stat st;
  if (stop_signal || (opt.stop != NULL && stat(opt.stop, &st) == 0))
    uv_stop(h->loop);
}

static void on_signal(int sig) {
  (void)sig;
  stop_signal = 1;
}

int cmd_serve(void) {
  uv_loop_t loop;
  node n;
  sx_desc d;
  uv_timer_t tick;
  signal(SIGTERM, on_signal);
  signal(SIGINT, on_signal);
  uv_loop_init(&loop);
  uint64_t seed = opt.seed ^ (uint64_t)getpid();
  if (node_open(&n, &loop, "rdma-test/target", opt.port, 0, 0) ||
      node_regions(&n, opt.regions, opt.layers, opt.blocks, opt.block_bytes,
                   SX_ACCESS_REMOTE_READ, seed, 0) ||
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

/* ------------------------------------------------------------------ bench */

/* Batched READs of size-byte blocks from a serve process, ops of `batch`
 * xfers, `depth` ops in flight, for opt.seconds. */
int cmd_bench(void) {
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
          "usage: sx-rdma-test selftest|wselftest|nictest[-gpu]|serve|read|killtest|bench [options]\n"
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
  if (strcmp(cmd, "wselftest") == 0)
    return cmd_wselftest();
  if (strcmp(cmd, "nictest") == 0 || strcmp(cmd, "nictest-gpu") == 0)
    return cmd_nictest(strcmp(cmd, "nictest-gpu") == 0);
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
