/*
 * End to end over RDMA, where an RDMA device exists (the Soft-RoCE VM, or
 * real hardware): a real redis-server, sx-agent processes holding filled
 * pools, readers in this process (the library) and `sxctl` processes that
 * open the pools by name.  Every read must go over RDMA.
 *
 * sx-agent and sxctl are looked up next to this program (check.sh copies
 * them into the VM's payload directory); redis-server on PATH.
 */
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "internal.h"
#include "pattern.h"
#include "redis_harness.h"
#include "segxfer/store.h"

/* The pools: K and V over LAYERS layers, 128 MiB per side in all, so that a
 * whole-pool batch takes seconds on Soft-RoCE (room to kill or time out a
 * batch in the middle). */
#define LAYERS 4
#define BLOCK 65536u
#define BLOCKS 256u
#define N_SLOTS 2
#define POOL_BYTES ((uint64_t)LAYERS * BLOCKS * BLOCK)

static sxt_redis redis;
static char bindir[PATH_MAX];
static char url[256];
static char tmpdir[128];
static int seq;

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------ processes */

static pid_t spawn(const char *log, const char *const argv[]) {
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (freopen(log, "a", stderr) == NULL)
      _exit(126);
    dup2(2, 1);
    execv(argv[0], (char *const *)argv);
    _exit(127);
  }
  return pid;
}

static void dump_stuck(pid_t pid, const char *log);

/* Wait for pid up to ms: its exit status, or -1 (it is then killed, after
 * saying where it was stuck). */
static int reap_log(pid_t pid, int ms, const char *log) {
  int st;
  for (int waited = 0; waited <= ms; waited += 10) {
    if (waitpid(pid, &st, WNOHANG) == pid)
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    sleep_ms(10);
  }
  fprintf(stderr, "pid %d still runs after %d ms:\n", (int)pid, ms);
  dump_stuck(pid, log);
  kill(pid, SIGKILL);
  waitpid(pid, &st, 0);
  return -1;
}

static int reap(pid_t pid, int ms) { return reap_log(pid, ms, "/dev/null"); }

/* Run a program to its end; its exit status, its output in out. */
static int run(const char *log, const char *const argv[], char *out, size_t size) {
  unlink(log);
  int rc = reap(spawn(log, argv), 60000);
  FILE *f = fopen(log, "r");
  size_t n = f != NULL ? fread(out, 1, size - 1, f) : 0;
  out[n] = '\0';
  if (f != NULL)
    fclose(f);
  return rc;
}

typedef struct pool {
  pid_t pid;
  char name[64];
  char log[256];
  uint64_t seed;
  uint8_t inc[SX_INCARNATION_LEN];
} pool;

/* Fail the test after showing the end of the pool's log (inside the VM the
 * log is gone once the test ends). */
static void show_log(const char *log) {
  char cmd[600];
  snprintf(cmd, sizeof(cmd), "echo '== end of %s'; tail -n 30 '%s'", log, log);
  if (system(cmd) != 0)
    fprintf(stderr, "(no log at %s)\n", log);
}

#define pool_fail(p, ...)                                                      \
  do {                                                                         \
    show_log((p)->log);                                                        \
    fail_msg(__VA_ARGS__);                                                     \
  } while (0)

static int stored_incarnation(const char *name, uint8_t inc[SX_INCARNATION_LEN]) {
  sx_store *s;
  sxt_ok(sx_store_open(url, &s));
  sx_desc d;
  int rc = sx_store_get(s, name, &d, NULL);
  if (rc == 0) {
    memcpy(inc, d.incarnation, SX_INCARNATION_LEN);
    sx_desc_free(&d);
  }
  sx_store_close(s);
  return rc;
}

/* Start an sx-agent and wait until the store holds a new incarnation. */
static void pool_start(pool *p, const char *name, const char *listen, uint64_t seed,
                       int takeover) {
  uint8_t old[SX_INCARNATION_LEN];
  int had = stored_incarnation(name, old) == 0;
  char exe[PATH_MAX + 16], fill[32], blocks[16], bb[16], layers[16];
  snprintf(exe, sizeof(exe), "%s/sx-agent", bindir);
  snprintf(fill, sizeof(fill), "%lu", (unsigned long)seed);
  snprintf(blocks, sizeof(blocks), "%u", BLOCKS);
  snprintf(bb, sizeof(bb), "%u", BLOCK);
  snprintf(layers, sizeof(layers), "%u", LAYERS);
  snprintf(p->name, sizeof(p->name), "%s", name);
  snprintf(p->log, sizeof(p->log), "%s/%s.log", tmpdir, name);
  p->seed = seed;
  const char *argv[32] = {exe, "--name", p->name, "--metadata", url, "--listen",
                          listen ? listen : "127.0.0.1:0", "--layers", layers,
                          "--block-bytes", bb, "--num-blocks", blocks, "--slots", "K,V",
                          "--fingerprint", "rdma-e2e/v1", "--fill", fill, "--lease-ms", "3000",
                          "--log-level", "info"};
  int n = 23;
  if (takeover)
    argv[n++] = "--takeover";
  /* In the VM the device is known: name it, as an operator would. */
  if (getenv("RXE_DEV") != NULL) {
    argv[n++] = "--rdma-devices";
    argv[n++] = getenv("RXE_DEV");
  }
  argv[n] = NULL;
  p->pid = spawn(p->log, argv);
  for (int i = 0; i < 1500; i++) {
    uint8_t inc[SX_INCARNATION_LEN];
    if (stored_incarnation(name, inc) == 0 && (!had || memcmp(inc, old, sizeof(inc)))) {
      memcpy(p->inc, inc, sizeof(inc));
      return;
    }
    if (waitpid(p->pid, NULL, WNOHANG) == p->pid)
      pool_fail(p, "sx-agent %s exited early; see %s", name, p->log);
    sleep_ms(20);
  }
  pool_fail(p, "sx-agent %s did not publish within 30 s; see %s", name, p->log);
}

/* Where each thread of a process that will not exit is stuck, and the end
 * of its log: printed before it is killed. */
static void dump_stuck(pid_t pid, const char *log) {
  char cmd[600];
  snprintf(cmd, sizeof(cmd),
           "for t in /proc/%d/task/*; do echo \"== $t $(cat $t/comm) wchan=$(cat $t/wchan)\"; "
           "cat $t/stack $t/syscall 2>/dev/null; done; echo '== log'; tail -n 30 %s",
           (int)pid, log);
  if (system(cmd) != 0)
    fprintf(stderr, "(could not inspect pid %d)\n", (int)pid);
}

static int pool_stop(pool *p, int sig) {
  kill(p->pid, sig);
  int rc = reap_log(p->pid, 20000, p->log);
  if (rc == -1)
    fail_msg("sx-agent %s did not exit within 20 s of signal %d; see %s", p->name, sig,
             p->log);
  p->pid = 0;
  return rc;
}

/* ------------------------------------------------------------ readers */

typedef struct rd {
  sx_agent *a;
  uint8_t *mem[N_SLOTS];
} rd;

static void reader_start(rd *r, const char *name) {
  memset(r, 0, sizeof(*r));
  sx_agent_params p;
  sxt_params(&p, url, name);
  snprintf(p.layout.fingerprint, sizeof(p.layout.fingerprint), "rdma-e2e/v1");
  sxt_ok(sx_agent_create(&p, &r->a));
  for (uint32_t s = 0; s < N_SLOTS; s++) {
    uint64_t layer = (uint64_t)BLOCKS * BLOCK;
    r->mem[s] = calloc(LAYERS, layer);
    assert_non_null(r->mem[s]);
    sx_region_params rp = {.addr = r->mem[s], .length = LAYERS * layer,
                           .layer_count = LAYERS, .layer_stride = layer, .slot = s,
                           .block_bytes = BLOCK, .num_blocks = BLOCKS};
    uint32_t id;
    sxt_ok(sx_agent_register(r->a, &rp, &id));
  }
}

static void reader_stop(rd *r) {
  sx_agent_destroy(r->a);
  for (int s = 0; s < N_SLOTS; s++)
    free(r->mem[s]);
}

static sx_segment *open_rdma(rd *r, const char *name) {
  sx_segment *seg;
  sxt_ok(sx_segment_open(r->a, name, 5000, &seg));
  if (sx_segment_transport(seg) != SX_TRANSPORT_RDMA)
    fail_msg("%s would be read over %s, not RDMA (is there an RDMA device here?)", name,
             sx_segment_transport(seg) == SX_TRANSPORT_TCP ? "TCP" : "nothing");
  return seg;
}

/* Every block an entry brought equals the pool's pattern. */
static int verify(const rd *r, const sx_segment *seg, uint64_t seed, const sx_block_read *e) {
  const sx_desc *d = sx_segment_desc(seg);
  for (uint32_t l = e->layer_first; l < e->layer_first + e->layer_count; l++) {
    for (uint32_t s = 0; s < N_SLOTS; s++) {
      if (!(e->slots & (1ull << s)))
        continue;
      const sx_region *R = sx_desc_find(d, 0, l, s);
      const uint8_t *local = r->mem[s] + (uint64_t)l * BLOCKS * BLOCK + e->local_block * BLOCK;
      uint64_t off = (l - R->layer_first) * R->layer_stride + e->remote_block * R->block_stride;
      if (sx__pattern_check(local, e->count * BLOCK, seed, R->id, off, NULL) != 0)
        return -1;
    }
  }
  return 0;
}

/* n entries over non-overlapping local blocks, random remote blocks,
 * layers and slots. */
static void entries(sx_block_read *e, size_t n, uint32_t *rng) {
  uint64_t local = 0;
  for (size_t i = 0; i < n; i++) {
    *rng = *rng * 1103515245u + 12345u;
    uint32_t v = *rng >> 4;
    uint64_t count = 1 + v % 2;
    uint32_t lf = (v >> 3) % LAYERS;
    e[i] = (sx_block_read){.layer_first = lf, .layer_count = 1 + (v >> 6) % (LAYERS - lf),
                           .slots = 1 + (v >> 9) % 3, .remote_block = (v >> 12) % (BLOCKS - count),
                           .local_block = local, .count = count};
    local += count;
    assert_true(local <= BLOCKS);
  }
}

static sx_batch *submit(sx_segment *s, const sx_block_read *e, size_t n, uint32_t timeout_ms) {
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = timeout_ms;
  sx_batch *b;
  sxt_ok(sx_batch_create(s, &bp, &b));
  sxt_ok(sx_batch_add_blocks(b, e, n));
  sxt_ok(sx_batch_submit(b));
  return b;
}

static sx_batch_result batch(sx_segment *s, const sx_block_read *e, size_t n,
                             uint32_t timeout_ms) {
  sx_batch *b = submit(s, e, n, timeout_ms);
  sxt_ok(sx_batch_wait(b, -1));
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  res.failed = NULL;
  sx_batch_destroy(b);
  return res;
}

static void next_name(char *buf, size_t size, const char *prefix) {
  snprintf(buf, size, "%s-%d", prefix, seq++);
}

static const sx_block_read whole_pool = {.layer_count = LAYERS, .slots = 3, .count = BLOCKS};

/* ------------------------------------------------------------ tests */

static void test_rdma_e2e_random_blocks_are_byte_exact(void **state) {
  (void)state;
  char name[64];
  next_name(name, sizeof(name), "rpool");
  pool p;
  pool_start(&p, name, NULL, 4242, 0);
  rd r;
  reader_start(&r, "rdma-e2e-reader-0");
  sx_segment *seg = open_rdma(&r, name);
  sx_mismatch m;
  sxt_ok(sx_segment_check(seg, 0, &m));
  uint32_t rng = 99;
  sx_block_read e[100];
  uint64_t bytes = 0;
  for (int round = 0; round < 6; round++) {
    entries(e, 100, &rng);
    sx_batch_result res = batch(seg, e, 100, 30000);
    if (res.state != SX_BATCH_COMPLETED)
      pool_fail(&p, "round %d: %s: %s", round, sx_batch_state_name(res.state), res.message);
    assert_int_equal(res.transport, SX_TRANSPORT_RDMA);
    for (int i = 0; i < 100; i++)
      if (verify(&r, seg, 4242, &e[i]) != 0)
        pool_fail(&p, "round %d entry %d: bytes differ", round, i);
    bytes += res.bytes;
  }
  /* And the whole pool in one batch. */
  sx_batch_result res = batch(seg, &whole_pool, 1, 60000);
  if (res.state != SX_BATCH_COMPLETED)
    pool_fail(&p, "whole pool: %s: %s", sx_batch_state_name(res.state), res.message);
  if (verify(&r, seg, 4242, &whole_pool) != 0)
    pool_fail(&p, "whole pool: bytes differ");
  print_message("read and verified %lu bytes over RDMA from %s, then the whole pool "
                "(%lu bytes in %u ranges, %.1f MiB/s)\n",
                (unsigned long)bytes, name, (unsigned long)res.bytes, res.n_ranges,
                (double)res.bytes / ((double)res.transfer_ns / 1e9) / 1048576.0);
  sx_segment_close(seg);
  reader_stop(&r);
  assert_int_equal(pool_stop(&p, SIGTERM), 0);
}

/* The planner rejects what is out of range before anything is posted. */
static void test_rdma_e2e_out_of_range_rejected_before_posting(void **state) {
  (void)state;
  char name[64];
  next_name(name, sizeof(name), "rpool");
  pool p;
  pool_start(&p, name, NULL, 77, 0);
  rd r;
  reader_start(&r, "rdma-e2e-reader-1");
  sx_segment *seg = open_rdma(&r, name);
  sx_batch *b;
  sxt_ok(sx_batch_create(seg, NULL, &b));
  sx_block_read bad = {.layer_count = 1, .slots = 1, .remote_block = BLOCKS - 2, .count = 4};
  sxt_rc(sx_batch_add_blocks(b, &bad, 1), SX_EBOUNDS);
  bad = (sx_block_read){.layer_first = LAYERS, .layer_count = 1, .slots = 1, .count = 1};
  sxt_rc(sx_batch_add_blocks(b, &bad, 1), SX_ENOREGION);
  const sx_region *R = sx_desc_find(sx_segment_desc(seg), 0, 0, 0);
  sx_range_read rr = {.local = r.mem[0], .remote_region = R->id, .offset = R->length - 10,
                      .length = 20};
  sxt_rc(sx_batch_add_ranges(b, &rr, 1), SX_EBOUNDS);
  /* RDMA needs registered destinations beyond probe size. */
  static uint8_t unregistered[4096];
  rr = (sx_range_read){.local = unregistered, .remote_region = R->id, .length = 4096};
  sxt_rc(sx_batch_add_ranges(b, &rr, 1), SX_EINVAL);
  /* Nothing was added: the batch is empty and completes without a read. */
  sxt_ok(sx_batch_submit(b));
  sxt_ok(sx_batch_wait(b, 10000));
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(res.n_entries, 0);
  assert_int_equal(res.n_ranges, 0);
  assert_int_equal(res.bytes, 0);
  sx_batch_destroy(b);
  /* A good batch on the same segment still works. */
  sx_block_read good = {.layer_count = 1, .slots = 1, .remote_block = BLOCKS - 4, .count = 4};
  res = batch(seg, &good, 1, 20000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(verify(&r, seg, 77, &good), 0);
  sx_segment_close(seg);
  reader_stop(&r);
  assert_int_equal(pool_stop(&p, SIGTERM), 0);
}

/* sxctl show lists the RDMA endpoint, sxctl ping answers over RDMA, and two
 * sxctl read processes read and verify in parallel. */
static void test_rdma_e2e_sxctl_show_ping_and_parallel_reads(void **state) {
  (void)state;
  char name[64], exe[PATH_MAX + 16], log[300], out[8192];
  next_name(name, sizeof(name), "rpool");
  pool p;
  pool_start(&p, name, NULL, 31337, 0);
  snprintf(exe, sizeof(exe), "%s/sxctl", bindir);
  snprintf(log, sizeof(log), "%s/show.log", tmpdir);
  const char *show[] = {exe, "--metadata", url, "show", name, NULL};
  assert_int_equal(run(log, show, out, sizeof(out)), 0);
  if (strstr(out, "rdma://") == NULL || strstr(out, "device ") == NULL)
    fail_msg("sxctl show lists no RDMA endpoint:\n%s", out);
  snprintf(log, sizeof(log), "%s/ping.log", tmpdir);
  const char *ping[] = {exe, "--metadata", url, "ping", name, "--count", "3", NULL};
  assert_int_equal(run(log, ping, out, sizeof(out)), 0);
  if (strstr(out, "via rdma") == NULL && strstr(out, ": rdma ") == NULL)
    fail_msg("sxctl ping did not answer over RDMA:\n%s", out);
  print_message("%s", out);

  pid_t pids[2];
  char logs[2][300];
  for (int i = 0; i < 2; i++) {
    snprintf(logs[i], sizeof(logs[i]), "%s/read-%d.log", tmpdir, i);
    unlink(logs[i]);
    const char *rd_argv[] = {exe, "--metadata", url, "read", name, "--blocks", "random:200",
                             "--verify", "31337", "--fingerprint", "rdma-e2e/v1",
                             "--transport", "rdma", NULL};
    pids[i] = spawn(logs[i], rd_argv);
  }
  for (int i = 0; i < 2; i++) {
    int rc = reap(pids[i], 60000);
    FILE *f = fopen(logs[i], "r");
    size_t n = f ? fread(out, 1, sizeof(out) - 1, f) : 0;
    out[n] = '\0';
    if (f)
      fclose(f);
    if (rc != 0 || strstr(out, "via rdma") == NULL)
      fail_msg("sxctl read %d exited %d:\n%s", i, rc, out);
  }
  print_message("%s", out);
  assert_int_equal(pool_stop(&p, SIGTERM), 0);
}

/* A deadline aborts a batch: it ends TIMEOUT, and nothing lands in its
 * destinations afterwards; the next batch reads correctly. */
static void test_rdma_e2e_deadline_aborts_and_nothing_lands_after(void **state) {
  (void)state;
  char name[64];
  next_name(name, sizeof(name), "rpool");
  pool p;
  pool_start(&p, name, NULL, 5, 0);
  rd r;
  reader_start(&r, "rdma-e2e-reader-2");
  sx_segment *seg = open_rdma(&r, name);
  sx_block_read one = {.layer_count = 1, .slots = 1, .count = 1};
  assert_int_equal(batch(seg, &one, 1, 20000).state, SX_BATCH_COMPLETED);
  for (int s = 0; s < N_SLOTS; s++)
    memset(r.mem[s], 0xab, POOL_BYTES);
  uint64_t t0 = sx__mono_ms();
  sx_batch_result res = batch(seg, &whole_pool, 1, 300);
  uint64_t took = sx__mono_ms() - t0;
  print_message("whole-pool batch with a 300 ms deadline: %s after %lu ms, %lu bytes: %s\n",
                sx_batch_state_name(res.state), (unsigned long)took, (unsigned long)res.bytes,
                res.message);
  assert_int_equal(res.state, SX_BATCH_TIMEOUT);
  assert_int_equal(res.error, SX_ETIMEDOUT);
  assert_true(res.bytes < 2 * POOL_BYTES);
  assert_true(took < 10000);
  uint8_t *snap[N_SLOTS];
  for (int s = 0; s < N_SLOTS; s++) {
    snap[s] = malloc(POOL_BYTES);
    memcpy(snap[s], r.mem[s], POOL_BYTES);
  }
  sleep_ms(1000);
  for (int s = 0; s < N_SLOTS; s++) {
    if (memcmp(snap[s], r.mem[s], POOL_BYTES) != 0)
      fail_msg("slot %d of a timed-out batch's destination changed after it ended", s);
    free(snap[s]);
  }
  sx_block_read e[50];
  uint32_t rng = 3;
  entries(e, 50, &rng);
  res = batch(seg, e, 50, 30000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  for (int i = 0; i < 50; i++)
    assert_int_equal(verify(&r, seg, 5, &e[i]), 0);
  sx_segment_close(seg);
  reader_stop(&r);
  assert_int_equal(pool_stop(&p, SIGTERM), 0);
}

/* The target dies in the middle of a batch: the batch fails (well within
 * its deadline) and later batches never succeed. */
static void test_rdma_e2e_target_killed_during_a_batch(void **state) {
  (void)state;
  char name[64];
  next_name(name, sizeof(name), "rpool");
  pool p;
  pool_start(&p, name, NULL, 8, 0);
  rd r;
  reader_start(&r, "rdma-e2e-reader-3");
  sx_segment *seg = open_rdma(&r, name);
  sx_block_read one = {.layer_count = 1, .slots = 1, .count = 1};
  assert_int_equal(batch(seg, &one, 1, 20000).state, SX_BATCH_COMPLETED);
  const uint32_t deadline = 20000;
  sx_batch *b = submit(seg, &whole_pool, 1, deadline);
  uint64_t t0 = sx__mono_ms();
  sleep_ms(300);
  assert_int_equal(sx_batch_poll(b), SX_EBUSY);
  kill(p.pid, SIGKILL);
  assert_int_equal(reap(p.pid, 10000), 128 + SIGKILL);
  p.pid = 0;
  sxt_ok(sx_batch_wait(b, (int)deadline + 5000));
  uint64_t took = sx__mono_ms() - t0;
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  print_message("batch ended %lu ms after submit: %s %s: %s\n", (unsigned long)took,
                sx_batch_state_name(res.state), sx_err_name(res.error), res.message);
  assert_int_equal(res.state, SX_BATCH_FAILED);
  /* READs in flight at the kill fail with SX_EDISCONN (the CM reports the
   * disconnect); if the kill fell between two rounds, the rest of the batch
   * meets the reconnect's reject instead (SX_EUNREACH): both say the target
   * is gone, and either way the batch must fail well before its deadline. */
  if (res.error != SX_EDISCONN && res.error != SX_EUNREACH)
    fail_msg("the batch failed with %s, not SX_EDISCONN or SX_EUNREACH", sx_err_name(res.error));
  assert_true(res.n_failed >= 1);
  assert_true(took < deadline);
  sx_batch_destroy(b);
  res = batch(seg, &one, 1, 5000);
  assert_int_not_equal(res.state, SX_BATCH_COMPLETED);
  sx_segment_close(seg);
  reader_stop(&r);
}

/* A restarted target (new incarnation, same port): the old descriptor gets
 * SX_ESTALE from the target itself, and a re-open reads the new pool. */
static void test_rdma_e2e_restarted_target_is_stale_then_reopens(void **state) {
  (void)state;
  char name[64], listen[32];
  next_name(name, sizeof(name), "rpool");
  snprintf(listen, sizeof(listen), "127.0.0.1:%d", sxt_free_port());
  pool p;
  pool_start(&p, name, listen, 100, 0);
  rd r;
  reader_start(&r, "rdma-e2e-reader-4");
  sx_segment *seg = open_rdma(&r, name);
  sx_block_read e = {.layer_count = LAYERS, .slots = 3, .remote_block = 10, .count = 16};
  assert_int_equal(batch(seg, &e, 1, 20000).state, SX_BATCH_COMPLETED);
  assert_int_equal(verify(&r, seg, 100, &e), 0);

  pool_stop(&p, SIGKILL);
  pool_start(&p, name, listen, 200, 1);
  int stale = 0;
  for (int i = 0; i < 10 && !stale; i++) {
    sx_batch_result res = batch(seg, &e, 1, 10000);
    assert_int_not_equal(res.state, SX_BATCH_COMPLETED);
    print_message("old descriptor: %s: %s\n", sx_err_name(res.error), res.message);
    stale = res.error == SX_ESTALE;
  }
  assert_true(stale);
  sx_segment_close(seg);
  seg = open_rdma(&r, name);
  assert_memory_equal(sx_segment_desc(seg)->incarnation, p.inc, SX_INCARNATION_LEN);
  memset(r.mem[0], 0, POOL_BYTES);
  assert_int_equal(batch(seg, &e, 1, 20000).state, SX_BATCH_COMPLETED);
  assert_int_equal(verify(&r, seg, 200, &e), 0);
  assert_int_not_equal(verify(&r, seg, 100, &e), 0);
  sx_segment_close(seg);
  reader_stop(&r);
  assert_int_equal(pool_stop(&p, SIGTERM), 0);
}

/* An agent told to use RDMA only, on a device that does not exist, refuses
 * to start and says why. */
static void test_rdma_e2e_unknown_rdma_device_is_refused(void **state) {
  (void)state;
  char name[64], exe[PATH_MAX + 16], log[300], out[8192];
  next_name(name, sizeof(name), "rpool");
  snprintf(exe, sizeof(exe), "%s/sx-agent", bindir);
  snprintf(log, sizeof(log), "%s/%s.log", tmpdir, name);
  const char *argv[] = {exe, "--name", name, "--metadata", url, "--num-blocks", "4",
                        "--transport", "rdma", "--rdma-devices", "nosuch0", NULL};
  assert_int_equal(run(log, argv, out, sizeof(out)), 2);
  if (strstr(out, "nosuch0") == NULL)
    fail_msg("sx-agent does not name the missing device:\n%s", out);
  uint8_t inc[SX_INCARNATION_LEN];
  assert_int_equal(stored_incarnation(name, inc), SX_ENOENT);
}

/* ------------------------------------------------------------ setup */

static int group_setup(void **state) {
  (void)state;
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0)
    return -1;
  self[n] = '\0';
  *strrchr(self, '/') = '\0';
  snprintf(bindir, sizeof(bindir), "%s", self);
  char exe[PATH_MAX + 16];
  snprintf(exe, sizeof(exe), "%s/sx-agent", bindir);
  if (access(exe, X_OK) != 0) {
    fprintf(stderr, "test_rdma_e2e: %s is missing\n", exe);
    return -1;
  }
  snprintf(tmpdir, sizeof(tmpdir), "/tmp/sxt-rdma-e2e-XXXXXX");
  if (mkdtemp(tmpdir) == NULL)
    return -1;
  /* Unlike the host suites this one never skips: it only runs where RDMA
   * is, and redis-server is part of its setup. */
  if (sxt_redis_start(&redis, &(sxt_redis_opts){.notify = "Kx"}) != 0) {
    fprintf(stderr, "test_rdma_e2e: cannot start redis-server\n");
    return -1;
  }
  sxt_redis_url(&redis, url, sizeof(url), "namespace=rdma-e2e");
  return 0;
}

static int group_teardown(void **state) {
  (void)state;
  sxt_redis_stop_all();
  char cmd[200];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", tmpdir);
  return system(cmd) == 0 ? 0 : -1;
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rdma_e2e_random_blocks_are_byte_exact),
      cmocka_unit_test(test_rdma_e2e_out_of_range_rejected_before_posting),
      cmocka_unit_test(test_rdma_e2e_sxctl_show_ping_and_parallel_reads),
      cmocka_unit_test(test_rdma_e2e_deadline_aborts_and_nothing_lands_after),
      cmocka_unit_test(test_rdma_e2e_target_killed_during_a_batch),
      cmocka_unit_test(test_rdma_e2e_restarted_target_is_stale_then_reopens),
      cmocka_unit_test(test_rdma_e2e_unknown_rdma_device_is_refused),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
