/*
 * End to end over RDMA, where an RDMA device exists (the Soft-RoCE VM, or
 * real hardware): a real redis-server, sx-agent processes holding filled
 * pools, readers in this process (the library) and `sxctl` processes that
 * open the pools by name.  Every read must go over RDMA.
 *
 * sx-agent and sxctl are looked up next to this program (check.sh copies
 * them into the VM's payload directory); redis-server on PATH.
 */
#include <dirent.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "fake_sysfs.h"
#include "internal.h"
#include "pattern.h"
#include "proc_env.h"
#include "segxfer/store.h"

/* The pools: K and V over LAYERS layers, 128 MiB per side in all, so that a
 * whole-pool batch takes seconds on Soft-RoCE (room to kill or time out a
 * batch in the middle). */
#define LAYERS 4
#define BLOCK 65536u
#define BLOCKS 256u
#define N_SLOTS 2
#define POOL_BYTES ((uint64_t)LAYERS * BLOCKS * BLOCK)

static sxt_proc_env env;
static int seq;

/* ------------------------------------------------------------ processes */

/* Wait for pid up to ms: its exit status, or -1 (it is then killed, after
 * saying where it was stuck). */
static int reap(pid_t pid, int ms) { return sxt_reap_log(pid, ms, NULL); }

/* Run a program to its end; its exit status, its output in out. */
static int run(const char *log, const char *const argv[], char *out, size_t size) {
  unlink(log);
  int rc = reap(sxt_spawn_ok(log, argv), 60000);
  FILE *f = fopen(log, "r");
  size_t n = f != NULL ? fread(out, 1, size - 1, f) : 0;
  out[n] = '\0';
  if (f != NULL)
    fclose(f);
  return rc;
}

/* Fail the test after showing the end of the pool's log (inside the VM the
 * log is gone once the test ends). */
#define pool_fail(p, ...)                                                      \
  do {                                                                         \
    sxt_show_log((p)->log);                                                    \
    fail_msg(__VA_ARGS__);                                                     \
  } while (0)

/* Start an sx-agent and wait until the store holds a new incarnation. */
static void pool_start(sxt_pool *p, const char *name, const char *listen, uint64_t seed,
                       int takeover) {
  /* In the VM the device is known: name it, as an operator would. */
  const char *dev[] = {"--rdma-devices", getenv("RXE_DEV"), NULL};
  sxt_pool_opts o = {.listen = listen, .layers = LAYERS, .block_bytes = BLOCK,
                     .num_blocks = BLOCKS, .slots = "K,V", .fingerprint = "rdma-e2e/v1",
                     .lease_ms = 3000, .log_level = "info", .takeover = takeover,
                     .more = dev[1] != NULL ? dev : NULL, .publish_ms = 30000};
  sxt_pool_start(&env, p, name, seed, &o);
}

static int pool_stop(sxt_pool *p, int sig) {
  int rc = sxt_pool_stop(p, sig);
  if (rc == -1)
    fail_msg("sx-agent %s did not exit within 20 s of signal %d; see %s", p->name, sig,
             p->log);
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
  sxt_params(&p, env.url, name);
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
  return sxt_verify(r->mem, BLOCKS, seg, seed, e);
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

static void next_name(char *buf, size_t size, const char *prefix) {
  snprintf(buf, size, "%s-%d", prefix, seq++);
}

static const sx_block_read whole_pool = {.layer_count = LAYERS, .slots = 3, .count = BLOCKS};

/* ------------------------------------------------------------ tests */

static void test_rdma_e2e_random_blocks_are_byte_exact(void **state) {
  (void)state;
  char name[64];
  next_name(name, sizeof(name), "rpool");
  sxt_pool p;
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
    sx_batch_result res = sxt_run_batch(seg, e, 100, 30000);
    if (res.state != SX_BATCH_COMPLETED)
      pool_fail(&p, "round %d: %s: %s", round, sx_batch_state_name(res.state), res.message);
    assert_int_equal(res.transport, SX_TRANSPORT_RDMA);
    for (int i = 0; i < 100; i++)
      if (verify(&r, seg, 4242, &e[i]) != 0)
        pool_fail(&p, "round %d entry %d: bytes differ", round, i);
    bytes += res.bytes;
  }
  /* And the whole pool in one batch. */
  sx_batch_result res = sxt_run_batch(seg, &whole_pool, 1, 60000);
  if (res.state != SX_BATCH_COMPLETED)
    pool_fail(&p, "whole pool: %s: %s", sx_batch_state_name(res.state), res.message);
  if (verify(&r, seg, 4242, &whole_pool) != 0)
    pool_fail(&p, "whole pool: bytes differ");
  print_message("read and verified %lu bytes over RDMA from %s, then the whole pool "
                "(%lu bytes in %u ranges, %.1f MiB/s)\n",
                (unsigned long)bytes, name, (unsigned long)res.bytes, res.n_ranges,
                (double)res.bytes / ((double)res.transfer_ns / 1e9) / 1048576.0);
  /* The reader's per-NIC counters: every byte went through the VM's one
   * device, and the Prometheus text says so. */
  sx_agent_stats st;
  sxt_ok(sx_agent_stats_get(r.a, &st, sizeof(st)));
  const char *dev = getenv("RXE_DEV") != NULL ? getenv("RXE_DEV") : "rxe0";
  uint64_t on_dev = 0, elsewhere = 0;
  for (int k = 0; k < SX_MAX_DEVICES; k++) {
    if (strcmp(st.rdma_devices[k], dev) == 0)
      on_dev += st.rdma_device_bytes[k];
    else
      elsewhere += st.rdma_device_bytes[k];
  }
  if (on_dev < bytes + res.bytes || elsewhere != 0)
    pool_fail(&p, "per-NIC bytes: %lu on %s (read %lu), %lu elsewhere", (unsigned long)on_dev,
              dev, (unsigned long)(bytes + res.bytes), (unsigned long)elsewhere);
  char *text = NULL, want[128];
  sxt_ok(sx_agent_metrics_text(r.a, &text, NULL));
  snprintf(want, sizeof(want), "\nsegxfer_rdma_device_bytes_total{device=\"%s\"} %lu\n", dev,
           (unsigned long)on_dev);
  int found = strstr(text, want) != NULL &&
              strstr(text, "# TYPE segxfer_rdma_device_work_requests_total counter\n") != NULL;
  free(text);
  if (!found)
    pool_fail(&p, "the metrics text lacks '%s'", want + 1);
  sx_segment_close(seg);
  reader_stop(&r);
  assert_int_equal(pool_stop(&p, SIGTERM), 0);
}

/* The planner rejects what is out of range before anything is posted. */
static void test_rdma_e2e_out_of_range_rejected_before_posting(void **state) {
  (void)state;
  char name[64];
  next_name(name, sizeof(name), "rpool");
  sxt_pool p;
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
  res = sxt_run_batch(seg, &good, 1, 20000);
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
  sxt_pool p;
  pool_start(&p, name, NULL, 31337, 0);
  snprintf(exe, sizeof(exe), "%s/sxctl", env.bindir);
  snprintf(log, sizeof(log), "%s/show.log", env.tmpdir);
  const char *show[] = {exe, "--metadata", env.url, "show", name, NULL};
  assert_int_equal(run(log, show, out, sizeof(out)), 0);
  if (strstr(out, "rdma://") == NULL || strstr(out, "device ") == NULL)
    fail_msg("sxctl show lists no RDMA endpoint:\n%s", out);
  /* Every region names the RDMA device the pool chose for it (the NIC
   * column, after LOCATION): the one device of this host. */
  char dev[40] = "", want[64];
  if (sscanf(strstr(out, "device ") + 7, "%39s", dev) != 1)
    fail_msg("no device name in:\n%s", out);
  snprintf(want, sizeof(want), "cpu       %s ", dev);
  const char *regs = strstr(out, "LOCATION  NIC ");
  int rows = 0;
  for (const char *q = regs; q != NULL && (q = strstr(q + 1, want)) != NULL;)
    rows++;
  if (regs == NULL || rows == 0 || strstr(regs, "cpu       -") != NULL)
    fail_msg("sxctl show does not print %s per region:\n%s", dev, out);
  print_message("sxctl show: %d regions on %s\n%s", rows, dev, regs);
  const char *json[] = {exe, "--metadata", env.url, "show", name, "--json", NULL};
  assert_int_equal(run(log, json, out, sizeof(out)), 0);
  snprintf(want, sizeof(want), "\"nic\": \"%s\"", dev);
  if (strstr(out, want) == NULL)
    fail_msg("sxctl show --json has no %s:\n%s", want, out);
  snprintf(log, sizeof(log), "%s/ping.log", env.tmpdir);
  const char *ping[] = {exe, "--metadata", env.url, "ping", name, "--count", "3", NULL};
  assert_int_equal(run(log, ping, out, sizeof(out)), 0);
  if (strstr(out, "via rdma") == NULL && strstr(out, ": rdma ") == NULL)
    fail_msg("sxctl ping did not answer over RDMA:\n%s", out);
  print_message("%s", out);

  pid_t pids[2];
  char logs[2][300];
  for (int i = 0; i < 2; i++) {
    snprintf(logs[i], sizeof(logs[i]), "%s/read-%d.log", env.tmpdir, i);
    unlink(logs[i]);
    const char *rd_argv[] = {exe, "--metadata", env.url, "read", name, "--blocks", "random:200",
                             "--verify", "31337", "--fingerprint", "rdma-e2e/v1",
                             "--transport", "rdma", NULL};
    pids[i] = sxt_spawn_ok(logs[i], rd_argv);
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

/* The NIC choice of a GPU region, on the real device: an sx-agent pool in
 * (stand-in, libfakecuda.so) GPU memory on cuda:0, whose PCI address
 * (FAKE_CUDA_PCI, answered through the driver's attributes) and this host's
 * RDMA device sit in a fake sysfs tree (SX_SYSFS_ROOT) on NUMA node 0
 * behind one switch.  The pool logs the choice with its reasons, and sxctl
 * show prints the device for both GPU regions. */
static void test_rdma_e2e_gpu_region_nic_choice(void **state) {
  (void)state;
  char lib[PATH_MAX + 32], root[256], name[64], exe[PATH_MAX + 16], log[300], out[8192];
  char dev[64] = "", want[200];
  snprintf(lib, sizeof(lib), "%s/libfakecuda.so", env.bindir);
  if (access(lib, R_OK) != 0) {
    print_message("SKIP: %s is not there (the CUDA stand-in)\n", lib);
    skip();
  }
  /* The device the pool will use: the first this host lists. */
  DIR *dir = opendir("/sys/class/infiniband");
  assert_non_null(dir);
  for (struct dirent *e; (e = readdir(dir)) != NULL && dev[0] == '\0';)
    if (e->d_name[0] != '.')
      snprintf(dev, sizeof(dev), "%.63s", e->d_name);
  closedir(dir);
  assert_true(dev[0] != '\0');
  sxt_sysfs_make(root, sizeof(root));
  sxt_sysfs_pci(root, "pci0000:00/0000:00:01.0/0000:17:00.0", "0\n");
  sxt_sysfs_pci(root, "pci0000:00/0000:00:01.0/0000:18:00.0", "0\n");
  sxt_sysfs_ib(root, dev, "pci0000:00/0000:00:01.0/0000:18:00.0");
  /* The pool inherits these; this process does not keep them. */
  setenv("SX_CUDA_LIBRARY", lib, 1);
  setenv("SX_SYSFS_ROOT", root, 1);
  setenv("FAKE_CUDA_PCI", "0000:17:00.0", 1);
  next_name(name, sizeof(name), "gnic");
  const char *more[] = {"--location", "cuda:0", "--rdma-devices", dev, NULL};
  sxt_pool_opts o = {.layers = LAYERS, .block_bytes = BLOCK, .num_blocks = BLOCKS,
                     .slots = "K,V", .fingerprint = "rdma-e2e/v1", .lease_ms = 3000,
                     .log_level = "info", .more = more, .publish_ms = 30000};
  sxt_pool p;
  sxt_pool_start(&env, &p, name, 77, &o);
  unsetenv("SX_CUDA_LIBRARY");
  unsetenv("SX_SYSFS_ROOT");
  unsetenv("FAKE_CUDA_PCI");
  snprintf(want, sizeof(want), "(cuda:0 at 0000:17:00.0, NUMA node 0): %s (NUMA node 0, the "
           "GPU's, PCI distance 2) of 1 devices", dev);
  if (sxt_count_in_file(p.log, want) != 2)
    pool_fail(&p, "the pool did not log the NIC choice of its 2 GPU regions (%s)", want);
  snprintf(exe, sizeof(exe), "%s/sxctl", env.bindir);
  snprintf(log, sizeof(log), "%s/show-gpu.log", env.tmpdir);
  const char *show[] = {exe, "--metadata", env.url, "show", name, NULL};
  assert_int_equal(run(log, show, out, sizeof(out)), 0);
  snprintf(want, sizeof(want), "cuda:0    %s ", dev);
  const char *regs = strstr(out, "LOCATION  NIC ");
  int rows = 0;
  for (const char *q = regs; q != NULL && (q = strstr(q + 1, want)) != NULL;)
    rows++;
  if (rows != 2)
    pool_fail(&p, "sxctl show does not print %s for the 2 GPU regions:\n%s", dev, out);
  print_message("%s", regs);
  assert_int_equal(pool_stop(&p, SIGTERM), 0);
  sxt_sysfs_remove(root);
}

/* A deadline aborts a batch: it ends TIMEOUT, and nothing lands in its
 * destinations afterwards; the next batch reads correctly. */
static void test_rdma_e2e_deadline_aborts_and_nothing_lands_after(void **state) {
  (void)state;
  char name[64];
  next_name(name, sizeof(name), "rpool");
  sxt_pool p;
  pool_start(&p, name, NULL, 5, 0);
  rd r;
  reader_start(&r, "rdma-e2e-reader-2");
  sx_segment *seg = open_rdma(&r, name);
  sx_block_read one = {.layer_count = 1, .slots = 1, .count = 1};
  assert_int_equal(sxt_run_batch(seg, &one, 1, 20000).state, SX_BATCH_COMPLETED);
  for (int s = 0; s < N_SLOTS; s++)
    memset(r.mem[s], 0xab, POOL_BYTES);
  uint64_t t0 = sx__mono_ms();
  sx_batch_result res = sxt_run_batch(seg, &whole_pool, 1, 300);
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
  sxt_sleep_ms(1000);
  for (int s = 0; s < N_SLOTS; s++) {
    if (memcmp(snap[s], r.mem[s], POOL_BYTES) != 0)
      fail_msg("slot %d of a timed-out batch's destination changed after it ended", s);
    free(snap[s]);
  }
  sx_block_read e[50];
  uint32_t rng = 3;
  entries(e, 50, &rng);
  res = sxt_run_batch(seg, e, 50, 30000);
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
  sxt_pool p;
  pool_start(&p, name, NULL, 8, 0);
  rd r;
  reader_start(&r, "rdma-e2e-reader-3");
  sx_segment *seg = open_rdma(&r, name);
  sx_block_read one = {.layer_count = 1, .slots = 1, .count = 1};
  assert_int_equal(sxt_run_batch(seg, &one, 1, 20000).state, SX_BATCH_COMPLETED);
  const uint32_t deadline = 20000;
  sx_batch *b = sxt_batch_submit(seg, &whole_pool, 1, deadline);
  uint64_t t0 = sx__mono_ms();
  sxt_sleep_ms(300);
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
  res = sxt_run_batch(seg, &one, 1, 5000);
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
  sxt_pool p;
  pool_start(&p, name, listen, 100, 0);
  rd r;
  reader_start(&r, "rdma-e2e-reader-4");
  sx_segment *seg = open_rdma(&r, name);
  sx_block_read e = {.layer_count = LAYERS, .slots = 3, .remote_block = 10, .count = 16};
  assert_int_equal(sxt_run_batch(seg, &e, 1, 20000).state, SX_BATCH_COMPLETED);
  assert_int_equal(verify(&r, seg, 100, &e), 0);

  pool_stop(&p, SIGKILL);
  pool_start(&p, name, listen, 200, 1);
  int stale = 0;
  for (int i = 0; i < 10 && !stale; i++) {
    sx_batch_result res = sxt_run_batch(seg, &e, 1, 10000);
    assert_int_not_equal(res.state, SX_BATCH_COMPLETED);
    print_message("old descriptor: %s: %s\n", sx_err_name(res.error), res.message);
    stale = res.error == SX_ESTALE;
  }
  assert_true(stale);
  sx_segment_close(seg);
  seg = open_rdma(&r, name);
  assert_memory_equal(sx_segment_desc(seg)->incarnation, p.inc, SX_INCARNATION_LEN);
  memset(r.mem[0], 0, POOL_BYTES);
  assert_int_equal(sxt_run_batch(seg, &e, 1, 20000).state, SX_BATCH_COMPLETED);
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
  snprintf(exe, sizeof(exe), "%s/sx-agent", env.bindir);
  snprintf(log, sizeof(log), "%s/%s.log", env.tmpdir, name);
  const char *argv[] = {exe, "--name", name, "--metadata", env.url, "--num-blocks", "4",
                        "--transport", "rdma", "--rdma-devices", "nosuch0", NULL};
  assert_int_equal(run(log, argv, out, sizeof(out)), 2);
  if (strstr(out, "nosuch0") == NULL)
    fail_msg("sx-agent does not name the missing device:\n%s", out);
  uint8_t inc[SX_INCARNATION_LEN];
  assert_int_equal(sxt_stored_incarnation(&env, name, inc), SX_ENOENT);
}

/* ------------------------------------------------------------ setup */

static int group_setup(void **state) {
  (void)state;
  /* Unlike the host suites this one never skips: it only runs where RDMA
   * is, and redis-server is part of its setup. */
  return sxt_proc_env_setup(&env, &(sxt_proc_env_opts){.test = "test_rdma_e2e",
                                                       .tmp = "rdma-e2e", .bin_here = 1,
                                                       .need = "sx-agent", .ns = "rdma-e2e",
                                                       .notify = "Kx", .redis_required = 1});
}

static int group_teardown(void **state) {
  (void)state;
  return sxt_proc_env_teardown(&env);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rdma_e2e_random_blocks_are_byte_exact),
      cmocka_unit_test(test_rdma_e2e_out_of_range_rejected_before_posting),
      cmocka_unit_test(test_rdma_e2e_sxctl_show_ping_and_parallel_reads),
      cmocka_unit_test(test_rdma_e2e_gpu_region_nic_choice),
      cmocka_unit_test(test_rdma_e2e_deadline_aborts_and_nothing_lands_after),
      cmocka_unit_test(test_rdma_e2e_target_killed_during_a_batch),
      cmocka_unit_test(test_rdma_e2e_restarted_target_is_stale_then_reopens),
      cmocka_unit_test(test_rdma_e2e_unknown_rdma_device_is_refused),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
