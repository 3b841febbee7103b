/*
 * Multi-process end to end with a real redis-server: sx-agent processes
 * (BUILD/bin/sx-agent) hold filled pools; readers in this process (the
 * library) and as `sxctl read` processes open them by name and read over
 * TCP.  Byte-exact reads, crafted wire requests, a target killed or
 * stopped during a batch, restarts (stale, then a re-open), lease expiry
 * and clean shutdown, the store lost around the first publish.
 *
 * SXT_FILTER=pattern runs a subset; SXT_KEEP_LOGS=1 keeps the sx-agent logs
 * and SXT_LOG_LEVEL=debug makes them verbose.
 */
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "internal.h"
#include "pattern.h"
#include "proc_env.h"
#include "segxfer/store.h"

/* The pool every sx-agent here holds. */
#define LAYERS 4
#define BLOCK 16384u
#define BLOCKS 512u
#define LOCAL_BLOCKS 256u
#define N_SLOTS 3 /* K, V, index */

static sxt_proc_env env;
static int seq;

#define sleep_ms sxt_sleep_ms
#define spawn sxt_spawn
#define reap sxt_reap
#define count_in_file sxt_count_in_file

/* Start an sx-agent and wait until the store holds a new incarnation of
 * its name (not the one it held before). */
static void pool_start(sxt_pool *p, const char *name, const char *listen, uint64_t seed,
                       int takeover, uint32_t lease_ms) {
  const char *level = getenv("SXT_LOG_LEVEL");
  sxt_pool_opts o = {.listen = listen, .layers = LAYERS, .block_bytes = BLOCK,
                     .num_blocks = BLOCKS, .slots = "K,V,index", .fingerprint = "e2e/v1",
                     .lease_ms = lease_ms, .log_level = level ? level : "info",
                     .takeover = takeover, .publish_ms = 20000};
  sxt_pool_start(&env, p, name, seed, &o);
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
  snprintf(p.layout.fingerprint, sizeof(p.layout.fingerprint), "e2e/v1");
  sxt_ok(sx_agent_create(&p, &r->a));
  for (uint32_t s = 0; s < N_SLOTS; s++) {
    uint64_t layer = (uint64_t)LOCAL_BLOCKS * BLOCK;
    r->mem[s] = calloc(LAYERS, layer);
    sx_region_params rp = {.addr = r->mem[s], .length = LAYERS * layer,
                           .layer_count = LAYERS, .layer_stride = layer, .slot = s,
                           .block_bytes = BLOCK, .num_blocks = LOCAL_BLOCKS};
    uint32_t id;
    sxt_ok(sx_agent_register(r->a, &rp, &id));
  }
}

static void reader_stop(rd *r) {
  sx_agent_destroy(r->a);
  for (int s = 0; s < N_SLOTS; s++)
    free(r->mem[s]);
}

/* Every block an entry brought equals the pool's pattern. */
static int verify(const rd *r, const sx_segment *seg, uint64_t seed, const sx_block_read *e) {
  return sxt_verify(r->mem, LOCAL_BLOCKS, seg, seed, e);
}

/* n entries over non-overlapping local blocks, random remote blocks,
 * layers and slots. */
static void entries(sx_block_read *e, size_t n, uint32_t *rng) {
  uint64_t local = 0;
  for (size_t i = 0; i < n; i++) {
    *rng = *rng * 1103515245u + 12345u;
    uint32_t v = *rng >> 4;
    uint64_t count = 1 + v % 4;
    uint32_t lf = (v >> 3) % LAYERS;
    e[i] = (sx_block_read){.layer_first = lf,
                           .layer_count = 1 + (v >> 6) % (LAYERS - lf),
                           .slots = 1 + (v >> 9) % 7,
                           .remote_block = (v >> 12) % (BLOCKS - count),
                           .local_block = local, .count = count};
    local += count;
    assert_true(local <= LOCAL_BLOCKS);
  }
}

static void next_name(char *buf, size_t size, const char *prefix) {
  snprintf(buf, size, "%s-%d", prefix, seq++);
}

/* ------------------------------------------------------------ tests */

static void test_e2e_random_blocks_are_byte_exact(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  char name[64];
  next_name(name, sizeof(name), "pool");
  sxt_pool p;
  pool_start(&p, name, NULL, 4242, 0, 3000);
  rd r;
  reader_start(&r, "e2e-reader-0");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, name, 5000, &seg));
  sx_mismatch m;
  sxt_ok(sx_segment_check(seg, 0, &m));
  uint32_t rng = 99;
  sx_block_read e[100];
  uint64_t bytes = 0;
  for (int round = 0; round < 10; round++) {
    entries(e, 100, &rng);
    sx_batch_result res = sxt_run_batch(seg, e, 100, 20000);
    if (res.state != SX_BATCH_COMPLETED)
      fail_msg("%s: %s", sx_batch_state_name(res.state), res.message);
    for (int i = 0; i < 100; i++)
      if (verify(&r, seg, 4242, &e[i]) != 0)
        fail_msg("round %d entry %d: bytes differ", round, i);
    bytes += res.bytes;
  }
  print_message("read and verified %lu bytes from %s\n", (unsigned long)bytes, name);
  sx_segment_close(seg);
  reader_stop(&r);
  assert_int_equal(sxt_pool_stop(&p, SIGTERM), 0);
}

/* Holds the reader's loop in a batch callback until the test says. */
typedef struct holder {
  int in, release; /* atomic */
} holder;

static void hold_loop(sx_batch *b, void *arg) {
  (void)b;
  holder *h = arg;
  __atomic_store_n(&h->in, 1, __ATOMIC_RELEASE);
  while (!__atomic_load_n(&h->release, __ATOMIC_ACQUIRE))
    usleep(1000);
}

typedef struct opener {
  sx_agent *a;
  const char *name;
  int rc;
  double ms;
} opener;

static void *open_named(void *arg) {
  opener *o = arg;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  sx_segment *s = NULL;
  o->rc = sx_segment_open(o->a, o->name, 5000, &s);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  o->ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
  sx_segment_close(s);
  return NULL;
}

/* A call queued while the agent's loop is busy runs just before the loop
 * polls (agent/call.c), and a store command it queues must go out then,
 * not when the poll's next timer fires (the store's 2 s timeout: "get: no
 * answer").  The reader's loop is held in a batch callback while another
 * thread opens a segment it has not opened yet (a store read); once
 * released, the open ends at once. */
static void test_e2e_open_queued_while_the_loop_is_busy(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  char name[64];
  next_name(name, sizeof(name), "pool");
  sxt_pool p;
  pool_start(&p, name, NULL, 77, 0, 3000);
  sxt_pool q[5];
  char qname[5][64];
  for (int k = 0; k < 5; k++) {
    next_name(qname[k], sizeof(qname[k]), "pool");
    pool_start(&q[k], qname[k], NULL, 78, 0, 3000);
  }
  rd r;
  reader_start(&r, "e2e-reader-busy");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, name, 5000, &seg));
  for (int round = 0; round < 5; round++) {
    holder h = {0};
    sx_batch_params bp;
    sx_batch_params_init(&bp);
    bp.cb = hold_loop;
    bp.cb_arg = &h;
    sx_batch *b;
    sx_block_read e = {.layer_count = 1, .slots = 1, .count = 1};
    sxt_ok(sx_batch_create(seg, &bp, &b));
    sxt_ok(sx_batch_add_blocks(b, &e, 1));
    sxt_ok(sx_batch_submit(b));
    while (!__atomic_load_n(&h.in, __ATOMIC_ACQUIRE))
      usleep(1000);
    opener o = {.a = r.a, .name = qname[round]};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, open_named, &o), 0);
    usleep(50000); /* the open is queued behind the busy loop */
    __atomic_store_n(&h.release, 1, __ATOMIC_RELEASE);
    pthread_join(th, NULL);
    sxt_ok(sx_batch_wait(b, 10000));
    sx_batch_destroy(b);
    print_message("round %d: open of %s: %s in %.0f ms (the loop held 50 ms of them)\n",
                  round, qname[round], o.rc ? sx_err_name(o.rc) : "ok", o.ms);
    assert_int_equal(o.rc, 0);
    assert_true(o.ms < 1000);
  }
  sx_segment_close(seg);
  reader_stop(&r);
  assert_int_equal(sxt_pool_stop(&p, SIGTERM), 0);
  for (int k = 0; k < 5; k++)
    assert_int_equal(sxt_pool_stop(&q[k], SIGTERM), 0);
}

static void test_e2e_two_reader_processes_in_parallel(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  char name[64];
  next_name(name, sizeof(name), "pool");
  sxt_pool p;
  pool_start(&p, name, NULL, 777, 0, 3000);
  char exe[PATH_MAX + 16], log[2][256];
  snprintf(exe, sizeof(exe), "%s/sxctl", env.bindir);
  pid_t pid[2];
  for (int i = 0; i < 2; i++) {
    snprintf(log[i], sizeof(log[i]), "%s/%s-reader%d.log", env.tmpdir, name, i);
    const char *argv[] = {exe, "--metadata", env.url, "read", name, "--blocks", "random:300",
                    "--verify", "777", "--seed", i ? "5" : "6", "--batch", "32",
                    "--fingerprint", "e2e/v1", NULL};
    pid[i] = spawn(log[i], argv);
  }
  for (int i = 0; i < 2; i++) {
    int rc = reap(pid[i], 60000);
    if (rc != 0)
      fail_msg("sxctl read %d exited %d; see %s", i, rc, log[i]);
  }
  assert_int_equal(sxt_pool_stop(&p, SIGTERM), 0);
}

static void test_e2e_crafted_requests_are_rejected_and_serving_goes_on(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  char name[64];
  next_name(name, sizeof(name), "pool");
  sxt_pool p;
  pool_start(&p, name, NULL, 31, 0, 3000);
  sx_store *s;
  sxt_ok(sx_store_open(env.url, &s));
  sx_desc d;
  sxt_ok(sx_store_get(s, name, &d, NULL));
  sx_store_close(s);
  uint16_t port = sxt_tcp_port(&d);
  uint8_t bad[SX_TOKEN_LEN], other[SX_INCARNATION_LEN], buf[4096];
  memcpy(bad, d.token, sizeof(bad));
  bad[15] ^= 1;
  memcpy(other, d.incarnation, sizeof(other));
  other[7] ^= 0x80;
  int fd = sxt_wire_connect(port);
  assert_int_equal(sxt_wire_hello(fd, d.incarnation, bad, "intruder"), SX_EACCESS);
  assert_true(sxt_wire_closed(fd));
  close(fd);
  fd = sxt_wire_connect(port);
  assert_int_equal(sxt_wire_hello(fd, other, d.token, "stale-reader"), SX_ESTALE);
  assert_true(sxt_wire_closed(fd));
  close(fd);
  /* Requests outside a region on an accepted connection, then a good one. */
  fd = sxt_wire_connect(port);
  sxt_ok(sxt_wire_hello(fd, d.incarnation, d.token, "prober"));
  const sx_region *R = &d.regions[0];
  assert_int_equal(sxt_wire_read(fd, 1, R->id, R->length, 1, buf), SX_EBOUNDS);
  assert_int_equal(sxt_wire_read(fd, 2, R->id, UINT64_MAX - 3, 8, buf), SX_EBOUNDS);
  assert_int_equal(sxt_wire_read(fd, 6, R->id, 0, 1ull << 63, buf), SX_ELIMIT);
  assert_int_equal(sxt_wire_read(fd, 3, 4000, 0, 1, buf), SX_ENOREGION);
  sxt_ok(sxt_wire_read(fd, 4, R->id, R->length - sizeof(buf), sizeof(buf), buf));
  assert_int_equal(sx__pattern_check(buf, sizeof(buf), 31, R->id, R->length - sizeof(buf),
                                     NULL), 0);
  /* Others are served all along. */
  rd r;
  reader_start(&r, "e2e-reader-2");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, name, 5000, &seg));
  sx_block_read e[10];
  uint32_t rng = 3;
  entries(e, 10, &rng);
  sx_batch_result res = sxt_run_batch(seg, e, 10, 20000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  for (int i = 0; i < 10; i++)
    assert_int_equal(verify(&r, seg, 31, &e[i]), 0);
  sxt_ok(sxt_wire_read(fd, 5, R->id, 0, 16, buf));
  close(fd);
  sx_segment_close(seg);
  reader_stop(&r);
  sx_desc_free(&d);
  assert_int_equal(sxt_pool_stop(&p, SIGTERM), 0);
}

static void test_e2e_target_killed_during_a_batch(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  char name[64];
  next_name(name, sizeof(name), "pool");
  sxt_pool p;
  pool_start(&p, name, NULL, 8, 0, 1000);
  rd r;
  reader_start(&r, "e2e-reader-3");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, name, 5000, &seg));
  sx_block_read e = {.layer_count = LAYERS, .slots = 7, .count = 64};
  assert_int_equal(sxt_run_batch(seg, &e, 1, 20000).state, SX_BATCH_COMPLETED);

  /* Stopped: its connections stay up, nothing is answered; the batch is in
   * flight when the target dies.  (Frozen for real: kill(SIGSTOP) alone
   * let the target's loop thread serve this batch on a loaded machine.) */
  assert_int_equal(sxt_freeze(p.pid), 0);
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = 15000;
  sx_batch *b;
  sxt_ok(sx_batch_create(seg, &bp, &b));
  sx_block_read big[4];
  uint32_t rng = 5;
  entries(big, 4, &rng);
  sxt_ok(sx_batch_add_blocks(b, big, 4));
  uint64_t t0 = sx__mono_ms();
  sxt_ok(sx_batch_submit(b));
  sleep_ms(200);
  if (sx_batch_poll(b) != SX_EBUSY) {
    sx_batch_result early;
    sxt_ok(sx_batch_result_get(b, &early));
    fail_msg("the batch ended %lu ms after submit while its target was stopped: %s %s: "
             "%s", (unsigned long)(sx__mono_ms() - t0), sx_batch_state_name(early.state),
             sx_err_name(early.error), early.message);
  }
  kill(p.pid, SIGKILL);
  assert_int_equal(reap(p.pid, 10000), 128 + SIGKILL);
  p.pid = 0;
  sxt_ok(sx_batch_wait(b, 20000));
  uint64_t took = sx__mono_ms() - t0;
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  assert_int_equal(res.state, SX_BATCH_FAILED);
  assert_int_equal(res.error, SX_EDISCONN);
  assert_int_equal(res.n_failed, 4);
  assert_true(took < bp.timeout_ms);
  print_message("batch failed %lu ms after submit: %s\n", (unsigned long)took, res.message);
  sx_batch_destroy(b);

  /* Later batches fail, never succeed; once the lease runs out the name is
   * gone from the store. */
  res = sxt_run_batch(seg, &e, 1, 5000);
  assert_int_not_equal(res.state, SX_BATCH_COMPLETED);
  uint8_t inc[SX_INCARNATION_LEN];
  uint64_t t1 = sx__mono_ms();
  while (sxt_stored_incarnation(&env, name, inc) == 0 && sx__mono_ms() - t1 < 10000)
    sleep_ms(50);
  assert_int_equal(sxt_stored_incarnation(&env, name, inc), SX_ENOENT);
  sx_segment_close(seg);
  sxt_rc(sx_segment_open(r.a, name, 0, &seg), SX_ENOENT);
  reader_stop(&r);
}

static void test_e2e_stopped_target_times_out_then_recovers(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  char name[64];
  next_name(name, sizeof(name), "pool");
  sxt_pool p;
  pool_start(&p, name, NULL, 9, 0, 60000);
  rd r;
  reader_start(&r, "e2e-reader-4");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, name, 5000, &seg));
  sx_block_read e[20];
  uint32_t rng = 11;
  entries(e, 20, &rng);
  assert_int_equal(sxt_run_batch(seg, e, 20, 20000).state, SX_BATCH_COMPLETED);
  assert_int_equal(sxt_freeze(p.pid), 0);
  memset(r.mem[0], 0xab, (uint64_t)LAYERS * LOCAL_BLOCKS * BLOCK);
  uint64_t t0 = sx__mono_ms();
  sx_batch_result res = sxt_run_batch(seg, e, 20, 500);
  uint64_t took = sx__mono_ms() - t0;
  assert_int_equal(res.state, SX_BATCH_TIMEOUT);
  assert_int_equal(res.n_failed, 20);
  assert_true(took >= 450 && took < 10000);
  /* Resumed, it answers the aborted requests: their payload is drained, the
   * destinations stay as they were, and the next batch reads correctly. */
  assert_int_equal(sxt_thaw(p.pid), 0);
  sleep_ms(300);
  for (uint64_t i = 0; i < (uint64_t)LAYERS * LOCAL_BLOCKS * BLOCK; i++)
    if (r.mem[0][i] != 0xab)
      fail_msg("byte %lu of a timed-out batch's destination was written after it ended",
               (unsigned long)i);
  entries(e, 20, &rng);
  res = sxt_run_batch(seg, e, 20, 20000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  for (int i = 0; i < 20; i++)
    assert_int_equal(verify(&r, seg, 9, &e[i]), 0);
  sx_segment_close(seg);
  reader_stop(&r);
  assert_int_equal(sxt_pool_stop(&p, SIGTERM), 0);
}

static void test_e2e_restarted_target_is_stale_then_reopens(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  char name[64], listen[32];
  next_name(name, sizeof(name), "pool");
  snprintf(listen, sizeof(listen), "127.0.0.1:%d", sxt_free_port());
  sxt_pool p;
  pool_start(&p, name, listen, 100, 0, 3000);
  rd r;
  reader_start(&r, "e2e-reader-5");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, name, 5000, &seg));
  sx_block_read e = {.layer_count = LAYERS, .slots = 7, .remote_block = 10, .count = 16};
  assert_int_equal(sxt_run_batch(seg, &e, 1, 20000).state, SX_BATCH_COMPLETED);
  assert_int_equal(verify(&r, seg, 100, &e), 0);

  /* Crash, then a new incarnation takes the name over on the same port. */
  sxt_pool_stop(&p, SIGKILL);
  pool_start(&p, name, listen, 200, 1, 3000);
  int stale = 0;
  for (int i = 0; i < 10 && !stale; i++) {
    sx_batch_result res = sxt_run_batch(seg, &e, 1, 10000);
    assert_int_not_equal(res.state, SX_BATCH_COMPLETED);
    stale = res.error == SX_ESTALE;
  }
  assert_true(stale);
  sx_segment_close(seg);
  sxt_ok(sx_segment_open(r.a, name, 5000, &seg));
  assert_memory_equal(sx_segment_desc(seg)->incarnation, p.inc, SX_INCARNATION_LEN);
  memset(r.mem[0], 0, (uint64_t)LAYERS * LOCAL_BLOCKS * BLOCK);
  assert_int_equal(sxt_run_batch(seg, &e, 1, 20000).state, SX_BATCH_COMPLETED);
  assert_int_equal(verify(&r, seg, 200, &e), 0);
  assert_int_not_equal(verify(&r, seg, 100, &e), 0);
  sx_segment_close(seg);
  reader_stop(&r);
  assert_int_equal(sxt_pool_stop(&p, SIGTERM), 0);
}

static void test_e2e_reader_killed_during_a_batch(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  char name[64];
  next_name(name, sizeof(name), "pool");
  sxt_pool p;
  pool_start(&p, name, NULL, 12, 0, 3000);
  char exe[PATH_MAX + 16], log[256];
  snprintf(exe, sizeof(exe), "%s/sxctl", env.bindir);
  snprintf(log, sizeof(log), "%s/%s-victim.log", env.tmpdir, name);
  const char *argv[] = {exe, "--metadata", env.url, "read", name, "--blocks", "random:20000",
                        "--batch", "256", "--depth", "4", "--seed", "9", NULL};
  pid_t victim = spawn(log, argv);
  /* Kill it once its connections are up and reads are flowing. */
  for (int i = 0; i < 500 && count_in_file(p.log, "connected from") == 0; i++)
    sleep_ms(10);
  sleep_ms(200);
  kill(victim, SIGKILL);
  assert_int_equal(reap(victim, 10000), 128 + SIGKILL);
  /* The target notices every connection go and frees it, and keeps serving. */
  for (int i = 0; i < 500 && count_in_file(p.log, "disconnected") <
                                 count_in_file(p.log, "connected from");
       i++)
    sleep_ms(10);
  assert_true(count_in_file(p.log, "connected from") >= 1);
  assert_int_equal(count_in_file(p.log, "disconnected"),
                   count_in_file(p.log, "connected from"));
  rd r;
  reader_start(&r, "e2e-reader-6");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, name, 5000, &seg));
  sx_block_read e[20];
  uint32_t rng = 21;
  entries(e, 20, &rng);
  assert_int_equal(sxt_run_batch(seg, e, 20, 20000).state, SX_BATCH_COMPLETED);
  for (int i = 0; i < 20; i++)
    assert_int_equal(verify(&r, seg, 12, &e[i]), 0);
  sx_segment_close(seg);
  reader_stop(&r);
  /* A clean exit (and, in sanitizer builds, no leak report). */
  assert_int_equal(sxt_pool_stop(&p, SIGTERM), 0);
}

static void test_e2e_sigterm_unpublishes_at_once(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  char name[64];
  next_name(name, sizeof(name), "pool");
  sxt_pool p;
  pool_start(&p, name, NULL, 1, 0, 60000);
  /* A second agent cannot take the name without --takeover. */
  char exe[PATH_MAX + 16], log[256];
  snprintf(exe, sizeof(exe), "%s/sx-agent", env.bindir);
  snprintf(log, sizeof(log), "%s/%s-second.log", env.tmpdir, name);
  const char *argv[] = {exe, "--name", name, "--metadata", env.url, "--listen", "127.0.0.1:0",
                  "--num-blocks", "4", NULL};
  assert_int_equal(reap(spawn(log, argv), 20000), 1);
  uint8_t inc[SX_INCARNATION_LEN];
  sxt_ok(sxt_stored_incarnation(&env, name, inc));
  assert_memory_equal(inc, p.inc, SX_INCARNATION_LEN);
  /* SIGTERM: exit 0 and the segment is gone now, not at lease expiry. */
  assert_int_equal(sxt_pool_stop(&p, SIGTERM), 0);
  assert_int_equal(sxt_stored_incarnation(&env, name, inc), SX_ENOENT);
}

static void test_e2e_store_restarted_empty_gets_the_segment_back(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  char name[64];
  next_name(name, sizeof(name), "pool");
  sxt_pool p;
  pool_start(&p, name, NULL, 5, 0, 1500); /* renews every 500 ms */
  /* The descriptor is in Redis before its answer reaches the agent: a kill
   * in between loses the answer, and the agent rightly publishes
   * generation 1 again (test_e2e_store_lost_during_first_publish_...).
   * This test is about a publish the agent knows landed, so wait for its
   * word (seen under AddressSanitizer, where that window is wider). */
  for (int i = 0; i < 1000 && count_in_file(p.log, "published generation 1") == 0; i++)
    sleep_ms(10);
  assert_int_equal(count_in_file(p.log, "published generation 1"), 1);
  sxt_redis_kill(&env.redis, SIGKILL);
  assert_int_equal(sxt_redis_restart(&env.redis), 0);
  /* The restarted Redis is empty; the agent notices (reconnect, renew ->
   * gone) and republishes the same incarnation with the next generation. */
  uint64_t t0 = sx__mono_ms();
  uint8_t inc[SX_INCARNATION_LEN];
  while (sxt_stored_incarnation(&env, name, inc) != 0 && sx__mono_ms() - t0 < 20000)
    sleep_ms(50);
  sxt_ok(sxt_stored_incarnation(&env, name, inc));
  assert_memory_equal(inc, p.inc, SX_INCARNATION_LEN);
  print_message("republished %lu ms after the restart\n",
                (unsigned long)(sx__mono_ms() - t0));
  sx_store *s;
  sxt_ok(sx_store_open(env.url, &s));
  sx_desc d;
  sxt_ok(sx_store_get(s, name, &d, NULL));
  assert_true(d.generation >= 2);
  sx_desc_free(&d);
  sx_store_close(s);
  /* And it serves as before. */
  rd r;
  reader_start(&r, "e2e-reader-7");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, name, 5000, &seg));
  sx_block_read e = {.layer_count = LAYERS, .slots = 7, .count = 8};
  assert_int_equal(sxt_run_batch(seg, &e, 1, 20000).state, SX_BATCH_COMPLETED);
  assert_int_equal(verify(&r, seg, 5, &e), 0);
  sx_segment_close(seg);
  reader_stop(&r);
  assert_int_equal(sxt_pool_stop(&p, SIGTERM), 0);
  assert_true(count_in_file(p.log, "republishing") >= 1);
}

/* Regression: the store went away while an sx-agent's first publish was in
 * flight (under load a test could kill Redis after the publish landed but
 * before its answer arrived).  sx-agent exited with status 2 instead of
 * serving on and publishing when the store came back.  CLIENT PAUSE WRITE
 * holds the publish (EVALSHA) inside Redis until Redis is killed, so the
 * answer is lost every time. */
static void test_e2e_store_lost_during_first_publish_agent_publishes_later(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  char name[64];
  next_name(name, sizeof(name), "pool");
  redisReply *rep = sxt_redis_command(&env.redis, "CLIENT PAUSE 60000 WRITE");
  assert_non_null(rep);
  freeReplyObject(rep);
  sxt_pool p;
  char exe[PATH_MAX + 16];
  snprintf(exe, sizeof(exe), "%s/sx-agent", env.bindir);
  snprintf(p.name, sizeof(p.name), "%s", name);
  snprintf(p.log, sizeof(p.log), "%s/%s.log", env.tmpdir, name);
  const char *argv[] = {exe, "--name", name, "--metadata", env.url, "--listen", "127.0.0.1:0",
                        "--num-blocks", "8", "--lease-ms", "1500", "--log-level", "debug",
                        NULL};
  p.pid = spawn(p.log, argv);
  for (int i = 0; i < 2000 && count_in_file(p.log, "publishing generation 1") == 0; i++)
    sleep_ms(10);
  assert_int_equal(count_in_file(p.log, "publishing generation 1"), 1);
  sxt_redis_kill(&env.redis, SIGKILL);
  assert_int_equal(sxt_redis_restart(&env.redis), 0);
  uint64_t t0 = sx__mono_ms();
  uint8_t inc[SX_INCARNATION_LEN];
  while (sxt_stored_incarnation(&env, name, inc) != 0 && sx__mono_ms() - t0 < 10000 &&
         waitpid(p.pid, NULL, WNOHANG) == 0)
    sleep_ms(20);
  if (waitpid(p.pid, NULL, WNOHANG) == p.pid)
    fail_msg("sx-agent exited after its first publish lost the store; see %s", p.log);
  sxt_ok(sxt_stored_incarnation(&env, name, inc));
  print_message("published %lu ms after the store came back\n",
                (unsigned long)(sx__mono_ms() - t0));
  assert_int_equal(sxt_pool_stop(&p, SIGTERM), 0);
}

/* Regression: a publish refused at once because the store connection was
 * down (no request sent) left the agent UNPUBLISHED with nothing to retry
 * it, although publish promises to keep retrying (RECLAIMING). */
static void test_e2e_publish_while_store_down_is_retried(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  char name[64];
  next_name(name, sizeof(name), "lib");
  sxt_agent t;
  memset(&t, 0, sizeof(t));
  sx_agent_params prm;
  sxt_params(&prm, env.url, name);
  prm.listen = "127.0.0.1:0";
  prm.lease_ms = 1500;
  sxt_ok(sx_agent_create(&prm, &t.a));
  sxt_redis_kill(&env.redis, SIGKILL);
  sx_agent_status st;
  for (int i = 0; i < 500; i++) {
    sxt_ok(sx_agent_status_get(t.a, &st));
    if (!st.store_up)
      break;
    sleep_ms(10);
  }
  assert_false(st.store_up);
  assert_int_not_equal(sx_agent_publish(t.a, 0), 0);
  sxt_ok(sx_agent_status_get(t.a, &st));
  assert_int_equal(st.state, SX_AGENT_RECLAIMING);
  assert_int_equal(sxt_redis_restart(&env.redis), 0);
  uint64_t t0 = sx__mono_ms();
  while (sx__mono_ms() - t0 < 10000) {
    sxt_ok(sx_agent_status_get(t.a, &st));
    if (st.state == SX_AGENT_PUBLISHED)
      break;
    sleep_ms(20);
  }
  assert_int_equal(st.state, SX_AGENT_PUBLISHED);
  uint8_t inc[SX_INCARNATION_LEN], mine[SX_INCARNATION_LEN];
  sxt_ok(sxt_stored_incarnation(&env, name, inc));
  sx_agent_incarnation(t.a, mine);
  assert_memory_equal(inc, mine, SX_INCARNATION_LEN);
  print_message("published %lu ms after the store came back\n",
                (unsigned long)(sx__mono_ms() - t0));
  sxt_agent_stop(&t);
}

/* ------------------------------------------------------------ options */

/* sx-agent ARGS (a shell fragment, after --metadata) exits 2 within 10 s
 * with want on stderr: refused before anything is published. */
static void sx_agent_usage_fails(const char *want, const char *args) {
  char cmd[PATH_MAX + 1024], errpath[200];
  snprintf(errpath, sizeof(errpath), "%s/usage.err", env.tmpdir);
  snprintf(cmd, sizeof(cmd), "timeout 10 %s/sx-agent --metadata '%s' %s 2>%s >/dev/null",
           env.bindir, env.url, args, errpath);
  int st = system(cmd);
  char err[4096] = "";
  FILE *f = fopen(errpath, "r");
  if (f != NULL) {
    err[fread(err, 1, sizeof(err) - 1, f)] = '\0';
    fclose(f);
  }
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 2 || strstr(err, want) == NULL)
    fail_msg("sx-agent %s: exit %d, stderr '%s' (wanted 2 and '%s')", args,
             WIFEXITED(st) ? WEXITSTATUS(st) : -1, err, want);
}

static void test_e2e_sx_agent_refuses_layout_text_too_long(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  /* They were cut to the field's size and published: readers then checked
   * against another fingerprint (or dtype, or tag) than the one given. */
  char fp[200], args[400];
  memset(fp, 'f', 128);
  fp[128] = '\0';
  snprintf(args, sizeof(args), "--name opt-0 --num-blocks 4 --fingerprint %s", fp);
  sx_agent_usage_fails("--fingerprint", args);
  sx_agent_usage_fails("--dtype", "--name opt-0 --num-blocks 4 "
                       "--dtype bf16-with-a-name-of-32-bytes-xyz");
  sx_agent_usage_fails("--tag", "--name opt-0 --num-blocks 4 "
                       "--tag NHD-with-a-name-of-32-bytes-wxyz");
  assert_int_equal(sxt_stored_incarnation(&env, "opt-0", NULL), SX_ENOENT);
}

static void test_e2e_sx_agent_refuses_a_pool_of_more_than_64_bits(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  /* 2^44 + 1 blocks of 1 MiB: the layer's size wrapped to 1 MiB, which was
   * mapped, and regions claiming 2^44 + 1 blocks in it were registered. */
  sx_agent_usage_fails("more than 2^64 bytes", "--name opt-1 --num-blocks 17592186044417 "
                       "--block-bytes 1M --slots K");
  sx_agent_usage_fails("more than 2^64 bytes", "--name opt-1 --num-blocks 1T --block-bytes 1T");
  sx_agent_usage_fails("more than 2^64 bytes", "--name opt-1 --layers 4294967295 "
                       "--block-bytes 1T --pool-size 1G --slots K,V,index");
  assert_int_equal(sxt_stored_incarnation(&env, "opt-1", NULL), SX_ENOENT);
}

static void test_e2e_sx_agent_names_an_option_missing_its_value(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  /* getopt's '?' for both cases said "unknown option '--layers'". */
  sx_agent_usage_fails("--layers needs a value", "--name opt-2 --num-blocks 4 --layers");
  sx_agent_usage_fails("--name needs a value", "--num-blocks 4 --name");
  sx_agent_usage_fails("unknown option '--bogus'", "--name opt-2 --num-blocks 4 --bogus");
}

static void test_e2e_sx_agent_refuses_malformed_sizes_slots_and_option_values(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  /* strtoull took blanks and octal (010 was 8), and the unit parser took a
   * second B and an i without a unit. */
  sx_agent_usage_fails("--pool-size '5BB' is not a size", "--name opt-3 --pool-size 5BB");
  sx_agent_usage_fails("--pool-size '1iB' is not a size", "--name opt-3 --pool-size 1iB");
  sx_agent_usage_fails("--block-bytes '010' is not a size",
                       "--name opt-3 --num-blocks 4 --block-bytes 010");
  sx_agent_usage_fails("--block-bytes ' 4K' is not a size",
                       "--name opt-3 --num-blocks 4 --block-bytes ' 4K'");
  sx_agent_usage_fails("--num-blocks '+4' is not a count", "--name opt-3 --num-blocks +4");
  /* A slot twice was refused only at register, after the pool was made. */
  sx_agent_usage_fails("slot 0 is given twice", "--name opt-3 --num-blocks 4 --slots K,0");
  sx_agent_usage_fails("slot V is given twice", "--name opt-3 --num-blocks 4 --slots V,V");
  sx_agent_usage_fails("an empty slot name", "--name opt-3 --num-blocks 4 --slots K,,V");
  sx_agent_usage_fails("an empty slot name", "--name opt-3 --num-blocks 4 --slots K,");
  /* A value given to an option that takes none read as an unknown option. */
  sx_agent_usage_fails("--takeover takes no value ('--takeover=1')",
                       "--name opt-3 --num-blocks 4 --takeover=1");
  sx_agent_usage_fails("--writable takes no value", "--name opt-3 --num-blocks 4 --writable=yes");
  sx_agent_usage_fails("unknown option '--bogus'", "--name opt-3 --num-blocks 4 --bogus=1");
  assert_int_equal(sxt_stored_incarnation(&env, "opt-3", NULL), SX_ENOENT);
}

/* ------------------------------------------------------------ setup */

static int group_setup(void **state) {
  (void)state;
  return sxt_proc_env_setup(&env, &(sxt_proc_env_opts){.test = "test_e2e_agent",
                                                       .tmp = "e2e", .need = "sx-agent",
                                                       .ns = "e2e", .notify = "Kx"});
}

static int group_teardown(void **state) {
  (void)state;
  return sxt_proc_env_teardown(&env);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_e2e_random_blocks_are_byte_exact),
      cmocka_unit_test(test_e2e_two_reader_processes_in_parallel),
      cmocka_unit_test(test_e2e_open_queued_while_the_loop_is_busy),
      cmocka_unit_test(test_e2e_crafted_requests_are_rejected_and_serving_goes_on),
      cmocka_unit_test(test_e2e_target_killed_during_a_batch),
      cmocka_unit_test(test_e2e_stopped_target_times_out_then_recovers),
      cmocka_unit_test(test_e2e_restarted_target_is_stale_then_reopens),
      cmocka_unit_test(test_e2e_reader_killed_during_a_batch),
      cmocka_unit_test(test_e2e_sigterm_unpublishes_at_once),
      cmocka_unit_test(test_e2e_store_restarted_empty_gets_the_segment_back),
      cmocka_unit_test(test_e2e_store_lost_during_first_publish_agent_publishes_later),
      cmocka_unit_test(test_e2e_publish_while_store_down_is_retried),
      cmocka_unit_test(test_e2e_sx_agent_refuses_layout_text_too_long),
      cmocka_unit_test(test_e2e_sx_agent_refuses_a_pool_of_more_than_64_bits),
      cmocka_unit_test(test_e2e_sx_agent_names_an_option_missing_its_value),
      cmocka_unit_test(test_e2e_sx_agent_refuses_malformed_sizes_slots_and_option_values),
  };
  const char *filter = getenv("SXT_FILTER");
  if (filter != NULL)
    cmocka_set_test_filter(filter);
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
