/*
 * GPU suite, cuda_ipc: a reader and a target in two processes of one host
 * (this binary runs itself as the target, driven over a pipe), sharing a
 * real redis-server as the store.  Byte-exact batches on one GPU (and
 * between two GPUs when there are two), the choice of transport, a target
 * killed during batches (every batch ends by its deadline, mappings are
 * gone), a restarted target (SX_ESTALE, no mapping left), unregister
 * while the reader holds a mapping (the handle is given back at once), and
 * read notices (SX_BATCH_NOTIFY) after the device copies.  A test that
 * fails midway leaves nothing behind: its teardown ends what it held.
 */
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu_fixture.h"
#include "internal.h"
#include "ipc_relay.h"
#include "pattern.h"
#include "procs.h"
#include "redis_harness.h"
#include "transport/cuda/cuda_ipc.h"

#define SEED 0xc0da1234u
#define LAYERS 2
#define TBLOCKS 256
#define BB 65536

static sxt_redis redis;
static char url[256];
static char self[4096]; /* this binary (not /proc/self/exe: under valgrind that is valgrind) */

/* ------------------------------------------------------------ the target */

/* argv: target URL NAME LOCATION LISTEN [ADVERTISE].  Says "ready PORT" when published,
 * then obeys lines on stdin: "unregister SLOT" (answers "done RC MS"),
 * "grow [SLOT]" (registers one more region, of slot 2 unless given:
 * "grown RC ID"),
 * "notice MS" (the next notice within MS ms: "notice KIND TAG TRANSPORT
 * BYTES BLOCK COUNT RUNS READER", or "none RC"), "exit". */
static int target_main(char **argv) {
  sx_agent_params p;
  sxt_params(&p, argv[2], argv[3]);
  p.listen = argv[5];
  p.advertise = argv[6]; /* NULL when not given */
  gpu_pool pool;
  sx_agent *a = gpu_target_publish(&p, &pool, argv[4], LAYERS, TBLOCKS, BB, SEED);
  if (a == NULL)
    return 1;
  sx_desc d;
  sx_agent_descriptor(a, &d);
  printf("ready %u\n", sxt_tcp_port(&d));
  fflush(stdout);
  sx_desc_free(&d);
  char line[64];
  void *extra[32] = {0};
  int n_extra = 0;
  while (fgets(line, sizeof(line), stdin) != NULL) {
    int slot;
    if (sscanf(line, "unregister %d", &slot) == 1) {
      uint64_t t0 = sx__mono_ms();
      int rc = sx_agent_unregister(a, pool.id[slot]);
      printf("done %d %lu\n", rc, (unsigned long)(sx__mono_ms() - t0));
      fflush(stdout);
    } else if (sscanf(line, "notice %d", &slot) == 1) {
      sx_notice *n = NULL;
      int rc = sx_agent_notice_next(a, slot, &n);
      if (rc == 0)
        printf("notice %u %lu %d %lu %lu %lu %u %s\n", n->kind, (unsigned long)n->tag,
               (int)n->transport, (unsigned long)n->bytes,
               (unsigned long)(n->n_blocks ? n->blocks[0].block : 0),
               (unsigned long)(n->n_blocks ? n->blocks[0].count : 0), n->n_blocks,
               n->producer[0] ? n->producer : "-");
      else
        printf("none %d\n", rc);
      fflush(stdout);
      sx_notice_free(n);
    } else if (strncmp(line, "grow", 4) == 0) {
      /* One more region (4 blocks of slot 2 or the one given), filled
       * with the pattern of its id: a newer descriptor of this
       * incarnation. */
      sx__mem_info m;
      uint32_t id = 0, gslot = 2;
      sscanf(line, "grow %u", &gslot);
      int rc = n_extra == 32 ? SX_ELIMIT : sx__mem_parse_location(argv[4], &m);
      uint8_t *host = malloc(4 * BB);
      void **mem = &extra[n_extra];
      if (rc == 0 && host != NULL && (rc = sx__mem_alloc(m.device, 4 * BB, mem)) == 0) {
        n_extra++;
        sx_region_params rp = {.addr = *mem, .length = 4 * BB, .layer_count = 1,
                               .layer_stride = 4 * BB, .slot = gslot, .block_bytes = BB,
                               .num_blocks = 4, .location = argv[4],
                               .access = SX_ACCESS_REMOTE_READ};
        if ((rc = sx_agent_register(a, &rp, &id)) == 0) {
          sx__pattern_fill(host, 4 * BB, SEED, id, 0);
          if ((rc = sx__mem_copy(*mem, host, 4 * BB)) == 0)
            rc = sx_agent_publish(a, 0);
        }
      }
      free(host);
      if (rc != 0)
        fprintf(stderr, "target: grow: %s\n", sx_errmsg());
      printf("grown %d %u\n", rc, id);
      fflush(stdout);
    } else if (strncmp(line, "exit", 4) == 0) {
      break;
    }
  }
  sx_agent_destroy(a);
  gpu_pool_free(&pool);
  for (int i = 0; i < n_extra; i++)
    sx__mem_free(extra[i]);
  return 0;
}

typedef struct target {
  pid_t pid;
  FILE *in, *out;
  uint16_t port;
} target;

/* ------------------------------------------------------------ held */

/* What the running test holds: a failed assertion longjmps out of the
 * test, past its own clean-up, and what it held would stay for the tests
 * after it (a reader agent's mappings, a stopped target, a relay thread on
 * a dead stack).  The teardown of every test ends what is still here.
 * Copies, not pointers: the tests keep these on their stacks (a relay is
 * the exception: its thread uses it, so relayed tests keep it static). */
#define HELD 8
static struct {
  sx_agent *agents[HELD];
  gpu_pool pools[HELD];
  target targets[HELD];
  relay *relay;
} held;

/* An agent of this binary's store (its name as in gpu_agent), held. */
static sx_agent *agent_new(const char *name, unsigned transports) {
  sx_agent *a = gpu_agent(url, name, 0, transports);
  for (int i = 0; i < HELD; i++) {
    if (held.agents[i] == NULL) {
      held.agents[i] = a;
      return a;
    }
  }
  sx_agent_destroy(a);
  fail_msg("a test holds more than %d agents", HELD);
  return NULL;
}

static void agent_end(sx_agent *a) {
  for (int i = 0; i < HELD; i++)
    if (held.agents[i] == a)
      held.agents[i] = NULL;
  sx_agent_destroy(a);
}

/* A pool of LAYERS x blocks x BB in a's regions, held. */
static void pool_make(gpu_pool *p, sx_agent *a, const char *location, uint64_t blocks,
                      uint64_t seed) {
  gpu_pool_make(p, a, location, LAYERS, blocks, BB, seed);
  for (int i = 0; i < HELD; i++) {
    if (held.pools[i].mem[0] == NULL) {
      held.pools[i] = *p;
      return;
    }
  }
  gpu_pool_free(p);
  fail_msg("a test holds more than %d pools", HELD);
}

/* After the agent that registered it is gone. */
static void pool_end(gpu_pool *p) {
  for (int i = 0; i < HELD; i++)
    if (held.pools[i].mem[0] == p->mem[0])
      memset(&held.pools[i], 0, sizeof(held.pools[i]));
  gpu_pool_free(p);
}

static void hold_target(const target *t) {
  for (int i = 0; i < HELD; i++) {
    if (held.targets[i].pid == 0) {
      held.targets[i] = *t;
      return;
    }
  }
  fail_msg("a test holds more than %d targets", HELD);
}

static void drop_target(const target *t) {
  for (int i = 0; i < HELD; i++)
    if (held.targets[i].pid == t->pid)
      memset(&held.targets[i], 0, sizeof(held.targets[i]));
}

static void target_start_adv(target *t, const char *name, const char *location,
                             const char *listen, const char *advertise) {
  const char *argv[] = {"test_gpu_ipc", "target", url, name, location,
                  listen ? listen : "127.0.0.1:0", advertise, NULL};
  t->pid = gpu_spawn(self, argv, &t->in, &t->out);
  hold_target(t); /* before it may fail to start */
  char line[64];
  unsigned port = 0;
  if (fgets(line, sizeof(line), t->out) == NULL || sscanf(line, "ready %u", &port) != 1)
    fail_msg("the target (%s on %s) did not start", name, location);
  t->port = (uint16_t)port;
}

static void target_start(target *t, const char *name, const char *location,
                         const char *listen) {
  target_start_adv(t, name, location, listen, NULL);
}

static void target_say(target *t, const char *line) {
  fprintf(t->in, "%s\n", line);
  fflush(t->in);
}

/* The target unregisters its pool's region of slot; it must succeed.
 * Returns how long it took (ms). */
static unsigned long target_unregister(target *t, int slot) {
  char line[64];
  int rc = -1;
  unsigned long ms = 0;
  snprintf(line, sizeof(line), "unregister %d", slot);
  target_say(t, line);
  assert_non_null(fgets(line, sizeof(line), t->out));
  assert_int_equal(sscanf(line, "done %d %lu", &rc, &ms), 2);
  assert_int_equal(rc, 0);
  return ms;
}

static int target_end(target *t, int sig) {
  drop_target(t);
  if (sig)
    kill(t->pid, sig);
  else
    target_say(t, "exit");
  fclose(t->in);
  fclose(t->out);
  int st;
  waitpid(t->pid, &st, 0);
  return st;
}

/* Bytes that arrived on the target's connections to its port (a cuda_ipc
 * reader's control connection) and that it has not read: the rx_queue of
 * the established sockets of that local port in /proc/net/tcp. */
static unsigned long unread_at(uint16_t port) {
  FILE *f = fopen("/proc/net/tcp", "r");
  assert_non_null(f);
  char line[512];
  unsigned long sum = 0;
  while (fgets(line, sizeof(line), f) != NULL) {
    unsigned lport, st;
    unsigned long tx, rx;
    if (sscanf(line, " %*d: %*x:%x %*x:%*x %x %lx:%lx", &lport, &st, &tx, &rx) == 4 &&
        lport == port && st == 1 /* TCP_ESTABLISHED */)
      sum += rx;
  }
  fclose(f);
  return sum;
}

/* ------------------------------------------------------------ helpers */

static sx_segment *open_seg(sx_agent *a, const char *name) {
  sx_segment *s;
  sxt_ok(sx_segment_open(a, name, 5000, &s));
  return s;
}

/* One batch of n range reads, run to its end (its failed list dropped). */
static sx_batch_result run_ranges(sx_segment *seg, const sx_range_read *rr, size_t n) {
  sx_batch *b;
  sx_batch_result res;
  sxt_ok(sx_batch_create(seg, NULL, &b));
  sxt_ok(sx_batch_add_ranges(b, rr, n));
  sxt_ok(sx_batch_submit(b));
  sxt_ok(sx_batch_wait(b, -1));
  sxt_ok(sx_batch_result_get(b, &res));
  res.failed = NULL; /* not valid after destroy */
  sx_batch_destroy(b);
  return res;
}

static void read_verify(sx_segment *seg, const gpu_pool *r, uint32_t seed_round,
                        sx_transport_kind want) {
  sx_block_read e[64];
  gpu_entries(e, 64, LAYERS, TBLOCKS, r->blocks, 1, seed_round);
  sx_batch_result res = sxt_run_batch(seg, e, 64, 10000);
  if (res.state != SX_BATCH_COMPLETED)
    fail_msg("batch: %s (%s)", sx_batch_state_name(res.state), res.message);
  assert_int_equal(res.transport, want);
  assert_true(res.bytes == 64ull * BB * 2 * LAYERS);
  assert_int_equal(gpu_pool_verify(r, seg, SEED, e, 64), 0);
}

/* A reader on cuda:0 with its pool, the target's segment open and read
 * once over cuda_ipc (verified). */
static sx_segment *reader_of(const char *tname, const char *rname, gpu_pool *r,
                             sx_agent **ra) {
  *ra = agent_new(rname, 0);
  pool_make(r, *ra, "cuda:0", 64, 0);
  sx_segment *seg = open_seg(*ra, tname);
  read_verify(seg, r, 1, SX_TRANSPORT_CUDA_IPC);
  return seg;
}

/* Close what reader_of opened. */
static void reader_end(sx_segment *seg, sx_agent *ra, gpu_pool *r) {
  sx_segment_close(seg);
  agent_end(ra);
  pool_end(r);
}

/* ------------------------------------------------------------ tests */

static void between(const char *tloc, const char *rloc) {
  target t;
  target_start(&t, "ipc-t", tloc, NULL);
  sx_agent *ra = agent_new("ipc-r", 0);
  gpu_pool r;
  pool_make(&r, ra, rloc, 64, 0);
  sx_segment *seg = open_seg(ra, "ipc-t");
  assert_int_equal(sx_segment_transport(seg), SX_TRANSPORT_CUDA_IPC);
  for (uint32_t round = 1; round <= 3; round++)
    read_verify(seg, &r, round, SX_TRANSPORT_CUDA_IPC);
  /* K and V are two allocations, mapped once each. */
  assert_int_equal(sx__mem_ipc_open_count(), 2);
  /* A range into host memory, and a ping (into host memory) too. */
  uint8_t *host = malloc(3 * BB);
  sx_range_read rr = {.local = host, .remote_region = 1, .offset = 5, .length = 3 * BB};
  assert_int_equal(run_ranges(seg, &rr, 1).state, SX_BATCH_COMPLETED);
  assert_int_equal(sx__pattern_check(host, 3 * BB, SEED, 1, 5, NULL), 0);
  free(host);
  uint64_t rtt;
  sx_transport_kind via;
  sxt_ok(sx_segment_ping(seg, 5000, &rtt, &via));
  assert_int_equal(via, SX_TRANSPORT_CUDA_IPC);
  sx_segment_close(seg);
  /* Closing the segment closed the mappings. */
  for (int i = 0; i < 100 && sx__mem_ipc_open_count() != 0; i++)
    sxt_sleep_ms(10);
  assert_int_equal(sx__mem_ipc_open_count(), 0);
  agent_end(ra);
  pool_end(&r);
  assert_int_equal(target_end(&t, 0), 0);
}

static void test_gpu_ipc_one_gpu(void **state) {
  (void)state;
  between("cuda:0", "cuda:0");
}

static void test_gpu_ipc_two_gpus(void **state) {
  (void)state;
  if (gpu_devices() < 2)
    skip();
  between("cuda:1", "cuda:0");
  between("cuda:0", "cuda:1");
}

/* The choice: forced TCP works (staged); a host target is not for
 * cuda_ipc; a target in this same process is read over TCP. */
static void test_gpu_ipc_transport_choice(void **state) {
  (void)state;
  target t;
  target_start(&t, "ipc-c", "cuda:0", NULL);
  sx_agent *tcp_only = agent_new("ipc-c-tcp", SX_TRANSPORTS_TCP);
  gpu_pool r;
  pool_make(&r, tcp_only, "cuda:0", 64, 0);
  sx_segment *seg = open_seg(tcp_only, "ipc-c");
  assert_int_equal(sx_segment_transport(seg), SX_TRANSPORT_TCP);
  read_verify(seg, &r, 7, SX_TRANSPORT_TCP);
  sx_segment_close(seg);
  agent_end(tcp_only);
  pool_end(&r);
  /* Same process: IPC cannot open its own handles. */
  sx_agent *self_t = agent_new("ipc-self", 0);
  gpu_pool st;
  pool_make(&st, self_t, "cuda:0", TBLOCKS, SEED);
  sxt_ok(sx_agent_publish(self_t, 0));
  sx_agent *ra = agent_new("ipc-c-r", 0);
  pool_make(&r, ra, "cuda:0", 64, 0);
  seg = open_seg(ra, "ipc-self");
  assert_int_equal(sx_segment_transport(seg), SX_TRANSPORT_TCP);
  read_verify(seg, &r, 8, SX_TRANSPORT_TCP);
  sx_segment_close(seg);
  /* Forced cuda_ipc with no way to use it: a clear refusal. */
  sx_agent *ipc_only = agent_new("ipc-c-only", SX_TRANSPORTS_CUDA_IPC);
  sxt_rc(sx_segment_open(ipc_only, "ipc-self", 2000, &seg), SX_EUNREACH);
  assert_non_null(strstr(sx_errmsg(), "no common transport"));
  /* It reads, but it has nothing peers could reach: publishing is refused
   * with the reason, not left as an unreachable segment. */
  sxt_rc(sx_agent_publish(ipc_only, 0), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "cuda_ipc needs tcp as well"));
  agent_end(ipc_only);
  agent_end(ra);
  agent_end(self_t);
  pool_end(&r);
  pool_end(&st);
  assert_int_equal(target_end(&t, 0), 0);
}

/* SIGKILL the target while batches run back to back: each ends by its
 * deadline, the ones after the kill fail, and no mapping is left. */
static void test_gpu_ipc_target_killed(void **state) {
  (void)state;
  target t;
  target_start(&t, "ipc-k", "cuda:0", NULL);
  sx_agent *ra;
  gpu_pool r;
  sx_segment *seg = reader_of("ipc-k", "ipc-k-r", &r, &ra);
  sx_block_read e[64];
  gpu_entries(e, 64, LAYERS, TBLOCKS, 64, 1, 3);
  int killed = 0, failed_after = 0, completed = 0;
  uint64_t start = sx__mono_ms();
  while (sx__mono_ms() - start < 3000 && failed_after < 3) {
    if (!killed && sx__mono_ms() - start > 300) {
      kill(t.pid, SIGKILL);
      killed = 1;
    }
    uint64_t t0 = sx__mono_ms();
    sx_batch_result res = sxt_run_batch(seg, e, 64, 1000);
    assert_true(sx__mono_ms() - t0 < 1000 + 500); /* by its deadline */
    if (res.state == SX_BATCH_COMPLETED)
      completed++;
    else if (killed)
      failed_after++;
    else
      fail_msg("before the kill: %s", res.message);
  }
  assert_true(completed > 0);
  assert_true(failed_after >= 1);
  /* The mappings went with the connection, before the segment closed. */
  for (int i = 0; i < 200 && sx__mem_ipc_open_count() != 0; i++)
    sxt_sleep_ms(10);
  assert_int_equal(sx__mem_ipc_open_count(), 0);
  sx_segment_close(seg);
  agent_end(ra);
  pool_end(&r);
  target_end(&t, SIGKILL); /* killed already: closes the pipes and reaps it */
}

/* The target restarts under the same name and port: the old segment's
 * reads fail with SX_ESTALE and hold no mapping. */
static void test_gpu_ipc_stale_incarnation(void **state) {
  (void)state;
  target t;
  target_start(&t, "ipc-s", "cuda:0", NULL);
  sx_agent *ra;
  gpu_pool r;
  sx_segment *seg = reader_of("ipc-s", "ipc-s-r", &r, &ra);
  assert_int_equal(sx__mem_ipc_open_count(), 2);
  char listen[32];
  snprintf(listen, sizeof(listen), "127.0.0.1:%u", t.port);
  assert_int_equal(target_end(&t, 0), 0);
  target_start(&t, "ipc-s", "cuda:0", listen);
  sx_block_read e = {.layer_count = LAYERS, .slots = SXT_KV, .count = 4};
  sx_batch_result res = {0};
  for (int i = 0; i < 5; i++) {
    res = sxt_run_batch(seg, &e, 1, 5000);
    if (res.error == SX_ESTALE)
      break;
  }
  assert_int_equal(res.state, SX_BATCH_FAILED);
  assert_int_equal(res.error, SX_ESTALE);
  assert_int_equal(sx__mem_ipc_open_count(), 0);
  sx_segment_close(seg);
  /* Opened again, the new incarnation reads fine. */
  seg = open_seg(ra, "ipc-s");
  read_verify(seg, &r, 2, SX_TRANSPORT_CUDA_IPC);
  sx_segment_close(seg);
  agent_end(ra);
  pool_end(&r);
  assert_int_equal(target_end(&t, 0), 0);
}

/* Unregister K while the reader holds its mapping: the reader gives it
 * back at once (not after the 5 s cut-off), K's mapping closes, K is
 * refused afterwards and V still reads. */
static void test_gpu_ipc_unregister_while_mapped(void **state) {
  (void)state;
  target t;
  target_start(&t, "ipc-u", "cuda:0", NULL);
  sx_agent *ra;
  gpu_pool r;
  sx_segment *seg = reader_of("ipc-u", "ipc-u-r", &r, &ra);
  assert_int_equal(sx__mem_ipc_open_count(), 2);
  unsigned long ms = target_unregister(&t, 0);
  assert_true(ms < SX__IPC_REVOKE_MS);
  assert_int_equal(sx__mem_ipc_open_count(), 1);
  sx_block_read k = {.layer_count = LAYERS, .slots = 1u << SX_SLOT_K, .count = 2};
  sx_batch_result res = sxt_run_batch(seg, &k, 1, 5000);
  assert_int_equal(res.state, SX_BATCH_FAILED);
  assert_int_equal(res.error, SX_ENOREGION);
  sx_block_read v = {.layer_count = LAYERS, .slots = 1u << SX_SLOT_V, .remote_block = 9,
                     .count = 2};
  res = sxt_run_batch(seg, &v, 1, 5000);
  if (res.state != SX_BATCH_COMPLETED)
    fail_msg("V after K went: %s", res.message);
  assert_int_equal(gpu_pool_verify(&r, seg, SEED, &v, 1), 0);
  sx_segment_close(seg);
  agent_end(ra);
  pool_end(&r);
  assert_int_equal(target_end(&t, 0), 0);
}

/* The segment name opened again once a's cache has a descriptor newer
 * than generation gen (it learns it from the store's event). */
static sx_segment *open_newer(sx_agent *a, const char *name, uint64_t gen) {
  for (int i = 0; i < 200; i++) {
    sx_segment *s = open_seg(a, name);
    if (sx_segment_desc(s)->generation != gen)
      return s;
    sx_segment_close(s);
    sxt_sleep_ms(25);
  }
  fail_msg("%s: no generation after %lu within 5 s", name, (unsigned long)gen);
  return NULL;
}

/* Segments of one target incarnation opened on different descriptors:
 * the first before K was unregistered (K, V), the second after (V alone, a
 * republished generation), the third after a new region was registered.
 * They share the transport's peer, which knew the first descriptor; the
 * later ones' batches name regions of their own descriptors, so the peer
 * must find them by id, not by their place in the first one's table, and
 * learn the new one.  V reads through all, K is refused, the new region
 * reads byte-exact. */
static void test_gpu_ipc_second_generation(void **state) {
  (void)state;
  target t;
  target_start(&t, "ipc-g", "cuda:0", NULL);
  sx_agent *ra;
  gpu_pool r;
  sx_segment *s1 = reader_of("ipc-g", "ipc-g-r", &r, &ra);
  uint64_t gen1 = sx_segment_desc(s1)->generation;
  target_unregister(&t, 0);
  char line[64];
  int rc = -1;
  sx_segment *s2 = open_newer(ra, "ipc-g", gen1);
  assert_int_equal(sx_segment_desc(s2)->n_regions, 1);
  assert_int_equal(sx_segment_transport(s2), SX_TRANSPORT_CUDA_IPC);
  sx_block_read v = {.layer_count = LAYERS, .slots = 1u << SX_SLOT_V, .remote_block = 7,
                     .local_block = 3, .count = 2};
  for (int k = 0; k < 2; k++) {
    sx_segment *seg = k ? s1 : s2;
    sx_batch_result res = sxt_run_batch(seg, &v, 1, 5000);
    if (res.state != SX_BATCH_COMPLETED)
      fail_msg("V through segment %d: %s", k + 1, res.message);
    assert_int_equal(res.transport, SX_TRANSPORT_CUDA_IPC);
    assert_int_equal(gpu_pool_verify(&r, seg, SEED, &v, 1), 0);
  }
  sx_block_read kk = {.layer_count = LAYERS, .slots = 1u << SX_SLOT_K, .count = 1};
  sx_batch_result res = sxt_run_batch(s1, &kk, 1, 5000);
  assert_int_equal(res.state, SX_BATCH_FAILED);
  /* A region registered later: only a third descriptor has it, and the
   * shared peer never knew it. */
  uint64_t gen2 = sx_segment_desc(s2)->generation;
  target_say(&t, "grow");
  unsigned id = 0;
  assert_non_null(fgets(line, sizeof(line), t.out));
  assert_int_equal(sscanf(line, "grown %d %u", &rc, &id), 2);
  assert_int_equal(rc, 0);
  sx_segment *s3 = open_newer(ra, "ipc-g", gen2);
  assert_int_equal(sx_segment_desc(s3)->n_regions, 2);
  uint8_t *host = malloc(3 * BB);
  assert_non_null(host);
  for (int k = 0; k < 2; k++) { /* the second time it is known */
    memset(host, 0, 3 * BB);
    sx_range_read rr = {.local = host, .remote_region = id, .offset = 7, .length = 3 * BB};
    res = run_ranges(s3, &rr, 1);
    if (res.state != SX_BATCH_COMPLETED)
      fail_msg("the new region through segment 3: %s", res.message);
    assert_int_equal(res.transport, SX_TRANSPORT_CUDA_IPC);
    assert_int_equal(sx__pattern_check(host, 3 * BB, SEED, id, 7, NULL), 0);
  }
  free(host);
  res = sxt_run_batch(s3, &v, 1, 5000);
  if (res.state != SX_BATCH_COMPLETED)
    fail_msg("V through segment 3: %s", res.message);
  sx_segment_close(s3);
  sx_segment_close(s2);
  sx_segment_close(s1);
  agent_end(ra);
  pool_end(&r);
  assert_int_equal(target_end(&t, 0), 0);
}

/* One batch reads a range of each of n regions (ids[k], 3 blocks at
 * offset 11 + k) into host memory; every byte is checked. */
static void read_regions(sx_segment *seg, const uint32_t *ids, size_t n) {
  uint64_t len = 3 * BB;
  uint8_t *host = calloc(n, len);
  sx_range_read rr[32];
  assert_non_null(host);
  assert_true(n <= 32);
  for (size_t k = 0; k < n; k++)
    rr[k] = (sx_range_read){.local = host + k * len, .remote_region = ids[k],
                            .offset = 11 + k, .length = len};
  sx_batch_result res = run_ranges(seg, rr, n);
  if (res.state != SX_BATCH_COMPLETED)
    fail_msg("%zu regions: %s", n, res.message);
  assert_int_equal(res.transport, SX_TRANSPORT_CUDA_IPC);
  for (size_t k = 0; k < n; k++)
    if (sx__pattern_check(host + k * len, len, SEED, ids[k], 11 + k, NULL) != 0)
      fail_msg("%zu regions: the range of region %u is wrong", n, ids[k]);
  free(host);
}

/* A batch over more regions than its plan lists for the transport (16:
 * cuda_ipc then looks at every range, as for an op that waits) and one
 * over fewer (it looks at each listed region once and finds each range's
 * in the pass that writes its copy): each read twice, so that the second
 * finds every region mapped, and byte-exact. */
static void test_gpu_ipc_batch_over_many_regions(void **state) {
  (void)state;
  target t;
  target_start(&t, "ipc-m", "cuda:0", NULL);
  sx_agent *ra;
  gpu_pool r;
  sx_segment *s1 = reader_of("ipc-m", "ipc-m-r", &r, &ra);
  uint32_t ids[20];
  char line[64];
  for (int k = 0; k < 18; k++) {
    char cmd[32];
    snprintf(cmd, sizeof(cmd), "grow %d", 2 + k);
    target_say(&t, cmd);
    int rc = -1;
    assert_non_null(fgets(line, sizeof(line), t.out));
    assert_int_equal(sscanf(line, "grown %d", &rc), 1);
    assert_int_equal(rc, 0);
  }
  sx_segment *s = NULL;
  for (int i = 0; i < 200 && s == NULL; i++) {
    s = open_seg(ra, "ipc-m");
    if (sx_segment_desc(s)->n_regions != 20) {
      sx_segment_close(s);
      s = NULL;
      sxt_sleep_ms(25);
    }
  }
  if (s == NULL)
    fail_msg("no descriptor of 20 regions within 5 s");
  for (int k = 0; k < 20; k++) /* K, V and the 18 new ones */
    ids[k] = sx_segment_desc(s)->regions[k].id;
  for (int round = 0; round < 2; round++) {
    read_regions(s, ids, 20);
    read_regions(s, ids + 4, 12);
  }
  sx_segment_close(s);
  sx_segment_close(s1);
  agent_end(ra);
  pool_end(&r);
  assert_int_equal(target_end(&t, 0), 0);
}

/* ------------------------------------------------------------ a lying target */

/* A target on 127.0.0.2 behind a relay (shift as in relay_start), and a
 * reader on cuda:0 with the target's segment open over cuda_ipc. */
typedef struct relayed {
  target t;
  relay rl;
  sx_agent *ra;
  gpu_pool r;
  sx_segment *seg;
} relayed;

static void relayed_start(relayed *x, const char *name, uint64_t shift) {
  char rname[64];
  snprintf(rname, sizeof(rname), "%s-r", name);
  /* The target's port is free on 127.0.0.2; the relay needs it on
   * 127.0.0.1 too, where a connection may hold it: another target then. */
  int tries = 0;
  for (;;) {
    target_start_adv(&x->t, name, "cuda:0", "127.0.0.2:0", "127.0.0.1");
    if (relay_start(&x->rl, x->t.port, shift) == 0)
      break;
    assert_int_equal(target_end(&x->t, 0), 0);
    if (++tries == 5)
      fail_msg("no port free on both 127.0.0.1 and 127.0.0.2 in 5 tries");
  }
  held.relay = &x->rl;
  x->ra = agent_new(rname, 0);
  pool_make(&x->r, x->ra, "cuda:0", 64, 0);
  x->seg = open_seg(x->ra, name);
  assert_int_equal(sx_segment_transport(x->seg), SX_TRANSPORT_CUDA_IPC);
}

/* Close it all; no mapping stays open. */
static void relayed_end(relayed *x) {
  sx_segment_close(x->seg);
  for (int i = 0; i < 100 && sx__mem_ipc_open_count() != 0; i++)
    sxt_sleep_ms(10);
  assert_int_equal(sx__mem_ipc_open_count(), 0);
  agent_end(x->ra);
  pool_end(&x->r);
  held.relay = NULL;
  relay_stop(&x->rl);
  assert_int_equal(target_end(&x->t, 0), 0);
}

/* A target whose IPC records claim more memory than their handles map:
 * the reader checks what the driver mapped and refuses the regions
 * (SX_EBOUNDS), rather than copying from past its mapping (into memory of
 * its own).  Nothing lands in the destinations, no mapping stays open. */
static void test_gpu_ipc_record_beyond_mapping(void **state) {
  (void)state;
  static relayed x; /* its relay thread outlives a failed assertion */
  relayed_start(&x, "ipc-lie", 1ull << 30);
  sx_block_read e[8];
  gpu_entries(e, 8, LAYERS, TBLOCKS, 64, 1, 5);
  sx_batch_result res = sxt_run_batch(x.seg, e, 8, 5000);
  assert_true(x.rl.rewritten > 0);
  if (res.state != SX_BATCH_FAILED || res.error != SX_EBOUNDS)
    fail_msg("a record beyond its mapping: %s (%s)", sx_batch_state_name(res.state),
             res.message);
  assert_non_null(strstr(res.message, "its CUDA IPC handle maps"));
  assert_int_equal(gpu_pool_zero(&x.r, 0, 64), 0);
  relayed_end(&x);
}

/* A target asking back regions in one frame that names an unknown id and
 * a region three times: the reader gives that region back once and
 * nothing else (what it keeps to give back stays within the descriptor's
 * regions however the target repeats itself), and reads again after. */
static void test_gpu_ipc_revoke_of_unknown_and_repeated_ids(void **state) {
  (void)state;
  static relayed x; /* its relay thread outlives a failed assertion */
  relayed_start(&x, "ipc-rev", 0);
  relay *rl = &x.rl;
  read_verify(x.seg, &x.r, 1, SX_TRANSPORT_CUDA_IPC);
  const sx_desc *d = sx_segment_desc(x.seg);
  uint32_t id = d->regions[0].id, unknown = 0;
  for (uint32_t i = 0; i < d->n_regions; i++)
    if (d->regions[i].id >= unknown)
      unknown = d->regions[i].id + 1000;
  uint32_t ids[] = {unknown, id, id, unknown, id};
  memcpy(rl->inject, ids, sizeof(ids));
  rl->n_inject = 5;
  __atomic_store_n(&rl->inject_go, 1, __ATOMIC_RELEASE);
  for (int i = 0; i < 200 && __atomic_load_n(&rl->give_frames, __ATOMIC_ACQUIRE) == 0; i++)
    sxt_sleep_ms(10);
  sxt_sleep_ms(100); /* anything more it would give back */
  unsigned n = __atomic_load_n(&rl->n_given, __ATOMIC_ACQUIRE);
  if (__atomic_load_n(&rl->give_frames, __ATOMIC_ACQUIRE) != 1 || n != 1 ||
      rl->given[0] != id)
    fail_msg("gave back %u ids in %u frames (first %u), expected region %u once", n,
             rl->give_frames, n ? rl->given[0] : 0, id);
  read_verify(x.seg, &x.r, 2, SX_TRANSPORT_CUDA_IPC);
  relayed_end(&x);
}

/* Read notices over cuda_ipc: the reader's copies end on the device, then
 * the notice goes on the control connection; the target (another process)
 * gets it with the reader's name, the tag and its own blocks, and none for
 * a batch without SX_BATCH_NOTIFY. */
static void test_gpu_ipc_read_notice(void **state) {
  (void)state;
  target t;
  target_start(&t, "ipc-n", "cuda:0", NULL);
  sx_agent *ra;
  gpu_pool r;
  sx_segment *seg = reader_of("ipc-n", "ipc-nr", &r, &ra);
  char line[256];
  target_say(&t, "notice 0"); /* the first read above asked for none */
  assert_non_null(fgets(line, sizeof(line), t.out));
  assert_int_equal(strncmp(line, "none", 4), 0);
  sx_block_read e = {.layer_count = LAYERS, .slots = (1u << SX_SLOT_K) | (1u << SX_SLOT_V),
                     .remote_block = 100, .local_block = 3, .count = 8};
  sx_batch_result res = sxt_batch_finish(sxt_notify_submit(seg, &e, 1, 0x77, 10000));
  if (res.state != SX_BATCH_COMPLETED)
    fail_msg("batch: %s (%s)", sx_batch_state_name(res.state), res.message);
  assert_int_equal(res.transport, SX_TRANSPORT_CUDA_IPC);
  assert_int_equal(gpu_pool_verify(&r, seg, SEED, &e, 1), 0);
  /* COMPLETED: the target holds the notice already. */
  target_say(&t, "notice 0");
  assert_non_null(fgets(line, sizeof(line), t.out));
  char want[256];
  snprintf(want, sizeof(want), "notice %u %u %d %lu 100 8 1 ipc-nr\n", SX_NOTICE_READ, 0x77,
           (int)SX_TRANSPORT_CUDA_IPC, (unsigned long)(8ull * BB * 2 * LAYERS));
  assert_string_equal(line, want);
  target_say(&t, "notice 200");
  assert_non_null(fgets(line, sizeof(line), t.out));
  assert_int_equal(strncmp(line, "none", 4), 0);
  sx_segment_close(seg);
  agent_end(ra);
  pool_end(&r);
  assert_int_equal(target_end(&t, 0), 0);
}

/* The reader destroyed while a notifying batch waits for the answer to
 * its notice on the cuda_ipc control connection (the target is stopped
 * once the handles are mapped: the copies end, the notice gets no answer):
 * the batch ends once, SX_ESHUTDOWN, destroy returns, and the target,
 * continued, goes on.  Static: a batch left running by a failed assertion
 * ends in the teardown, and its callback must not write to a dead stack. */
static atomic_int notify_ends;
static char notify_how[320];

static void notify_end(sx_batch *b, void *arg) {
  sx_batch_result res;
  int got = sx_batch_result_get(b, &res);
  if (got == 0 && res.state == SX_BATCH_FAILED && res.error == SX_ESHUTDOWN) {
    atomic_fetch_add((atomic_int *)arg, 1);
  } else {
    snprintf(notify_how, sizeof(notify_how), "%s, error %d (%.200s)",
             got ? "no result" : sx_batch_state_name(res.state), got ? got : res.error,
             got ? "" : res.message);
    atomic_fetch_add((atomic_int *)arg, 100);
  }
  sx_batch_destroy(b);
}

static void test_gpu_ipc_reader_destroyed_while_notice_waits(void **state) {
  (void)state;
  target t;
  target_start(&t, "ipc-w", "cuda:0", NULL);
  sx_agent *ra;
  gpu_pool r;
  sx_segment *seg = reader_of("ipc-w", "ipc-wr", &r, &ra);
  /* Frozen for real (procs.h): right after kill(SIGSTOP) the target's loop
   * thread may still run, and on a loaded machine it answered the notice
   * (the batch COMPLETED, about 1 run in 8). */
  assert_int_equal(sxt_freeze(t.pid), 0);
  /* Every frame before was answered, so the target has read them all. */
  assert_int_equal(unread_at(t.port), 0);
  atomic_store(&notify_ends, 0);
  notify_how[0] = '\0';
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.flags = SX_BATCH_NOTIFY;
  bp.tag = 5;
  bp.timeout_ms = 20000;
  bp.cb = notify_end;
  bp.cb_arg = &notify_ends;
  sx_block_read e = {.layer_count = LAYERS, .slots = (1u << SX_SLOT_K) | (1u << SX_SLOT_V),
                     .remote_block = 10, .local_block = 2, .count = 4};
  sx_batch *b;
  sxt_ok(sx_batch_create(seg, &bp, &b));
  sxt_ok(sx_batch_add_blocks(b, &e, 1));
  sxt_ok(sx_batch_submit(b));
  /* The notice goes once the copies ended: wait until it lies unread in
   * the stopped target's socket.  Nothing can answer it now. */
  for (int i = 0; i < 1000 && unread_at(t.port) == 0 && atomic_load(&notify_ends) == 0; i++)
    sxt_sleep_ms(10);
  if (atomic_load(&notify_ends) == 0 && unread_at(t.port) == 0)
    fail_msg("the batch's notice did not reach the stopped target in 10 s");
  /* Not needed to pass: time for a batch wrongly ended by its notice's
   * send (rather than its answer) to show. */
  sxt_sleep_ms(100);
  if (atomic_load(&notify_ends) != 0)
    fail_msg("the batch ended before the reader was destroyed: %s", notify_how);
  agent_end(ra); /* the segment left open: closed by destroy */
  if (atomic_load(&notify_ends) != 1)
    fail_msg("the batch ended %d times (100 a time not SX_ESHUTDOWN: %s)",
             atomic_load(&notify_ends), notify_how);
  (void)seg;
  assert_int_equal(sxt_thaw(t.pid), 0);
  pool_end(&r);
  assert_int_equal(target_end(&t, 0), 0);
}

/* ------------------------------------------------------------ copy methods */

/* Raw ranges at odd offsets and lengths into device memory at an odd
 * address, and into host memory: byte for byte.  Returns the gathers of
 * kernel that ran for the host one (the kernel must not touch pageable
 * memory). */
static uint64_t odd_ranges(sx_segment *seg, gpu_pool *r) {
  const sx_desc *d = sx_segment_desc(seg);
  assert_int_equal(d->n_regions, 2);
  uint32_t k = d->regions[0].id, v = d->regions[1].id;
  uint8_t *host = malloc(3 * BB + 3), *back = malloc(3 * BB + 3);
  assert_non_null(host);
  assert_non_null(back);
  sx_range_read rr[2] = {
      {.local = r->mem[0] + 7, .remote_region = k, .offset = 5, .length = 2 * BB + 3},
      {.local = r->mem[1] + 4096, .remote_region = v, .offset = 16 * 3, .length = BB - 1}};
  sx_batch_result res = run_ranges(seg, rr, 2);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  sxt_ok(sx__mem_copy(back, r->mem[0] + 7, 2 * BB + 3));
  assert_int_equal(sx__pattern_check(back, 2 * BB + 3, SEED, k, 5, NULL), 0);
  sxt_ok(sx__mem_copy(back, r->mem[1] + 4096, BB - 1));
  assert_int_equal(sx__pattern_check(back, BB - 1, SEED, v, 16 * 3, NULL), 0);
  uint64_t k0 = gpu_copy_count(SX__COPY_KERNEL);
  sx_range_read hr[2] = {
      {.local = host, .remote_region = k, .offset = 3, .length = BB},
      {.local = host + BB, .remote_region = v, .offset = 0, .length = 2 * BB + 3}};
  res = run_ranges(seg, hr, 2);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(sx__pattern_check(host, BB, SEED, k, 3, NULL), 0);
  assert_int_equal(sx__pattern_check(host + BB, 2 * BB + 3, SEED, v, 0, NULL), 0);
  free(host);
  free(back);
  return gpu_copy_count(SX__COPY_KERNEL) - k0;
}

/* Each method forced with SX_GPU_COPY (and auto) reads byte for byte, and
 * is the one that ran: the gather kernel (which must load wherever there
 * is a GPU: the library ships it), the batch call, single copies. */
static void test_gpu_ipc_copy_methods(void **state) {
  (void)state;
  const char *why = sx__mem_kernel_error(0);
  if (why != NULL)
    fail_msg("%s", why);
  target t;
  target_start(&t, "ipc-m", "cuda:0", NULL);
  static const char *const methods[] = {"kernel", "batch", "range", "auto"};
  for (int k = 0; k < 4; k++) {
    setenv("SX_GPU_COPY", methods[k], 1);
    uint64_t before[4], after[4];
    sx__mem_copy_counts(before);
    gpu_pool r;
    sx_agent *ra;
    sx_segment *seg = reader_of("ipc-m", "ipc-mr", &r, &ra);
    for (uint32_t round = 2; round <= 4; round++)
      read_verify(seg, &r, round, SX_TRANSPORT_CUDA_IPC);
    uint64_t host_kernels = odd_ranges(seg, &r);
    sx__mem_copy_counts(after);
    sx_segment_close(seg);
    agent_end(ra);
    pool_end(&r);
    uint64_t d[4];
    for (int m = 0; m < 4; m++)
      d[m] = after[m] - before[m];
    print_message("SX_GPU_COPY=%s: kernel %lu, batch %lu, range %lu gathers\n", methods[k],
                  (unsigned long)d[1], (unsigned long)d[2], (unsigned long)d[3]);
    assert_int_equal(host_kernels, 0);
    assert_int_equal(d[SX__COPY_AUTO], 0); /* never reported as such */
    if (k == 0 || k == 3) {
      /* Every batch of several device ranges is one launch. */
      assert_true(d[SX__COPY_KERNEL] >= 4);
      assert_int_equal(d[SX__COPY_BATCH] + d[SX__COPY_RANGE], 1); /* the host batch */
    } else if (k == 1) {
      assert_int_equal(d[SX__COPY_KERNEL], 0);
      assert_true(d[SX__COPY_BATCH] >= 4);
    } else {
      assert_int_equal(d[SX__COPY_KERNEL] + d[SX__COPY_BATCH], 0);
      assert_true(d[SX__COPY_RANGE] >= 4);
    }
  }
  unsetenv("SX_GPU_COPY");
  assert_int_equal(target_end(&t, 0), 0);
}

/* A launch the driver refuses (only the stand-in can be made to) fails
 * its batch with a message that says so, whether the launcher's thread
 * made it (SX_GPU_LAUNCHER=1: the error reaches the batch through the
 * notice behind it) or the loop did (0), and the next batch reads every
 * byte again. */
static void test_gpu_ipc_launch_refused(void **state) {
  (void)state;
  if (!gpu_on_stand_in())
    skip();
  static const char *const ways[] = {"1", "0"};
  /* The suite's own setting (run.sh runs it again with 1) goes back after. */
  const char *was = getenv("SX_GPU_LAUNCHER");
  char *saved = was != NULL ? strdup(was) : NULL;
  for (int w = 0; w < 2; w++) {
    setenv("SX_GPU_LAUNCHER", ways[w], 1);
    target t;
    target_start(&t, "ipc-l", "cuda:0", NULL);
    gpu_pool r;
    sx_agent *ra;
    sx_segment *seg = reader_of("ipc-l", "ipc-lr", &r, &ra);
    setenv("FAKE_CUDA_FAIL_LAUNCH", "1", 1);
    sx_block_read e[64];
    gpu_entries(e, 64, LAYERS, TBLOCKS, r.blocks, 1, 5);
    sx_batch_result res = sxt_run_batch(seg, e, 64, 10000);
    unsetenv("FAKE_CUDA_FAIL_LAUNCH");
    print_message("SX_GPU_LAUNCHER=%s, launches refused: %s (%s)\n", ways[w],
                  sx_batch_state_name(res.state), res.message);
    assert_int_equal(res.state, SX_BATCH_FAILED);
    assert_true(res.error != 0);
    assert_int_equal(res.n_failed, 64);
    assert_non_null(strstr(res.message, "gather kernel"));
    for (uint32_t round = 6; round <= 7; round++)
      read_verify(seg, &r, round, SX_TRANSPORT_CUDA_IPC);
    reader_end(seg, ra, &r);
    assert_int_equal(target_end(&t, 0), 0);
  }
  if (saved != NULL)
    setenv("SX_GPU_LAUNCHER", saved, 1);
  else
    unsetenv("SX_GPU_LAUNCHER");
  free(saved);
}

/* ------------------------------------------------------------ tables */

/* Block reads over cuda_ipc are planned into a gather table on the
 * caller's thread, run as one based gather, where the batch's first block
 * entries make at least SX_IPC_TABLES ranges (0 never: run.sh runs this
 * file with 0 and with 1 too; by default 1 once the segment's reads may go
 * direct, after its first table read, and 256 before or with
 * SX_IPC_DIRECT=0); what a table cannot take turns the batch into ranges:
 * a range added after blocks, destinations in host memory.  Byte for byte
 * each way, and the table counter says which way ran. */
static uint64_t tables_for(uint64_t ranges) {
  const char *env = getenv("SX_IPC_TABLES"), *direct = getenv("SX_IPC_DIRECT");
  uint64_t min = env != NULL                                  ? strtoull(env, NULL, 10)
                 : direct != NULL && strcmp(direct, "0") == 0 ? 256
                                                              : 1;
  return min > 0 && ranges >= min;
}

static void test_gpu_ipc_tables(void **state) {
  (void)state;
  target t;
  target_start(&t, "ipc-tab", "cuda:0", NULL);
  sx_agent *ra = agent_new("ipc-tabr", 0);
  gpu_pool r;
  pool_make(&r, ra, "cuda:0", 256, 0);
  sx_segment *seg = open_seg(ra, "ipc-tab");
  const sx_desc *d = sx_segment_desc(seg);
  /* 64 runs of 3 blocks of 64 KiB over 2 layers and K, V (256 ranges):
   * three pieces for each. */
  uint64_t t0 = sx__ipc_table_ops();
  sx_block_read e[64];
  gpu_entries(e, 64, LAYERS, TBLOCKS, 192, 3, 11);
  sx_batch_result res = sxt_run_batch(seg, e, 64, 10000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_true(res.bytes == 64ull * 3 * BB * 2 * LAYERS);
  assert_int_equal(gpu_pool_verify(&r, seg, SEED, e, 64), 0);
  assert_int_equal(sx__ipc_table_ops() - t0, tables_for(256));
  /* A small request (8 entries: 32 ranges). */
  t0 = sx__ipc_table_ops();
  gpu_entries(e, 8, LAYERS, TBLOCKS, 24, 1, 15);
  res = sxt_run_batch(seg, e, 8, 10000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(gpu_pool_verify(&r, seg, SEED, e, 8), 0);
  assert_int_equal(sx__ipc_table_ops() - t0, tables_for(32));
  /* Blocks, then a range: the batch goes as ranges. */
  t0 = sx__ipc_table_ops();
  gpu_entries(e, 64, LAYERS, TBLOCKS, 192, 3, 12);
  sx_range_read rr = {.local = r.mem[0] + 250ull * BB, .remote_region = d->regions[0].id,
                      .offset = 5, .length = BB + 7};
  sx_batch *b;
  sxt_ok(sx_batch_create(seg, NULL, &b));
  sxt_ok(sx_batch_add_blocks(b, e, 64));
  sxt_ok(sx_batch_add_ranges(b, &rr, 1));
  sxt_ok(sx_batch_submit(b));
  sxt_ok(sx_batch_wait(b, -1));
  sxt_ok(sx_batch_result_get(b, &res));
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  sx_batch_destroy(b);
  assert_int_equal(gpu_pool_verify(&r, seg, SEED, e, 64), 0);
  uint8_t *back = malloc(BB + 7);
  assert_non_null(back);
  sxt_ok(sx__mem_copy(back, rr.local, BB + 7));
  assert_int_equal(sx__pattern_check(back, BB + 7, SEED, d->regions[0].id, 5, NULL), 0);
  free(back);
  assert_int_equal(sx__ipc_table_ops() - t0, 0);
  /* Into host memory: ranges from the first entry on. */
  sx_agent *ha = agent_new("ipc-tabh", 0);
  gpu_pool h;
  pool_make(&h, ha, "cpu", 64, 0);
  sx_segment *hseg = open_seg(ha, "ipc-tab");
  t0 = sx__ipc_table_ops();
  read_verify(hseg, &h, 13, SX_TRANSPORT_CUDA_IPC);
  assert_int_equal(sx__ipc_table_ops() - t0, 0);
  reader_end(hseg, ha, &h);
  /* And tables again on the first reader (64 entries: 256 ranges). */
  t0 = sx__ipc_table_ops();
  read_verify(seg, &r, 14, SX_TRANSPORT_CUDA_IPC);
  assert_int_equal(sx__ipc_table_ops() - t0, tables_for(256));
  reader_end(seg, ra, &r);
  assert_int_equal(target_end(&t, 0), 0);
}

/* ------------------------------------------------------------ notices */

/* 8 batches of 8 blocks submitted together (several notices outstanding
 * on several streams), each checked byte for byte as soon as its wait
 * returned: a notice delivered before its copies ended shows as wrong
 * bytes (on the stand-in every launch is slowed down for that). */
static void read_overlapped(sx_segment *seg, const gpu_pool *r, uint32_t seed_round) {
  sx_block_read e[64];
  gpu_entries(e, 64, LAYERS, TBLOCKS, r->blocks, 1, seed_round);
  sx_batch *b[8];
  for (int k = 0; k < 8; k++)
    b[k] = sxt_batch_submit(seg, e + 8 * k, 8, 10000);
  for (int k = 0; k < 8; k++) {
    sx_batch_result res = sxt_batch_finish(b[k]);
    if (res.state != SX_BATCH_COMPLETED)
      fail_msg("batch %d: %s (%s)", k, sx_batch_state_name(res.state), res.message);
    assert_int_equal(res.transport, SX_TRANSPORT_CUDA_IPC);
    assert_int_equal(gpu_pool_verify(r, seg, SEED, e + 8 * k, 8), 0);
  }
}

/* A gather table is written again once the notice behind the launch that
 * read it passed, without asking the driver about the launch's own event:
 * 40 x 8 batches in flight (each stream's ring of 32 tables goes round
 * more than twice), every one checked byte for byte while later ones may
 * still be launching; on the stand-in every launch is slowed to 2 ms, so
 * a table written too early would copy the wrong blocks.  The stand-in
 * counts the reader's cuEventSynchronize calls: none. */
static void test_gpu_ipc_tables_reused_by_notices(void **state) {
  (void)state;
  if (!gpu_on_stand_in())
    skip();
  void *h = dlopen(getenv("SX_CUDA_LIBRARY"), RTLD_NOW | RTLD_NOLOAD);
  unsigned long (*syncs)(void) = NULL;
  if (h != NULL)
    *(void **)&syncs = dlsym(h, "fake_cuda_event_syncs");
  assert_non_null(syncs);
  setenv("FAKE_CUDA_DELAY_US", "2000", 1); /* read when a stream starts */
  target t;
  target_start(&t, "ipc-tb", "cuda:0", NULL);
  gpu_pool r;
  sx_agent *ra;
  sx_segment *seg = reader_of("ipc-tb", "ipc-tbr", &r, &ra);
  read_verify(seg, &r, 2, SX_TRANSPORT_CUDA_IPC); /* the first maps */
  uint64_t k0 = gpu_copy_count(SX__COPY_KERNEL);
  unsigned long s0 = syncs();
  for (uint32_t round = 0; round < 40; round++)
    read_overlapped(seg, &r, 100 + round);
  unsigned long waited = syncs() - s0;
  uint64_t gathers = gpu_copy_count(SX__COPY_KERNEL) - k0;
  print_message("%lu gathers, %lu cuEventSynchronize calls\n", (unsigned long)gathers, waited);
  reader_end(seg, ra, &r);
  unsetenv("FAKE_CUDA_DELAY_US");
  assert_int_equal(target_end(&t, 0), 0);
  assert_int_equal(gathers, 320);
  assert_int_equal(waited, 0);
  if (h != NULL)
    dlclose(h);
}

/* sx__mem_notice_counts()'s ways, as bits of notices_by's want. */
enum { BY_EVENT_POLL = 1, BY_HOST = 2, BY_EVENT_WAIT = 4, BY_FLAG = 8 };

/* Reads with SX_GPU_NOTICE=how (NULL: unset, the default; read when the
 * reader's agent opens cuda_ipc): byte for byte, and every notice went one
 * of the ways in want, none another. */
static void notices_by(const char *how, int want) {
  /* The loop's notices: direct reads (none here unless tables are forced)
   * have none. */
  setenv("SX_IPC_DIRECT", "0", 1);
  if (how != NULL)
    setenv("SX_GPU_NOTICE", how, 1);
  else
    unsetenv("SX_GPU_NOTICE");
  if (gpu_on_stand_in())
    setenv("FAKE_CUDA_DELAY_US", "2000", 1); /* read when a stream starts */
  target t;
  target_start(&t, "ipc-q", "cuda:0", NULL);
  uint64_t before[4], after[4];
  sx__mem_notice_counts(before);
  {
    gpu_pool r;
    sx_agent *ra;
    sx_segment *seg = reader_of("ipc-q", "ipc-qr", &r, &ra);
    for (uint32_t round = 2; round <= 3; round++) {
      read_verify(seg, &r, round, SX_TRANSPORT_CUDA_IPC);
      read_overlapped(seg, &r, round + 10);
    }
    reader_end(seg, ra, &r);
  }
  sx__mem_notice_counts(after);
  unsetenv("FAKE_CUDA_DELAY_US");
  unsetenv("SX_GPU_NOTICE");
  unsetenv("SX_IPC_DIRECT");
  print_message("SX_GPU_NOTICE=%s: polled flags %lu, polled events %lu, host functions %lu, "
                "waited events %lu\n", how ? how : "(unset)",
                (unsigned long)(after[3] - before[3]), (unsigned long)(after[0] - before[0]),
                (unsigned long)(after[1] - before[1]), (unsigned long)(after[2] - before[2]));
  uint64_t wanted = 0;
  for (int m = 0; m < 4; m++) {
    if (want & 1 << m)
      wanted += after[m] - before[m];
    else
      assert_int_equal(after[m] - before[m], 0);
  }
  assert_true(wanted >= 19); /* 1 + 2 x (1 + 8) batches, one notice each */
  assert_int_equal(target_end(&t, 0), 0);
}

static void test_gpu_ipc_notice_flag(void **state) {
  (void)state;
  /* The default (auto): flags for the notices the launcher queues, events
   * for those the loop queues (SX_GPU_LAUNCHER: 1 every read's, 0 none,
   * auto some where the host may spin: sx__spin_host). */
  const char *l = getenv("SX_GPU_LAUNCHER");
  int launcher = l != NULL && strcmp(l, "1") == 0   ? 1
                 : l != NULL && strcmp(l, "0") == 0 ? 0
                 : sx__spin_host()                  ? 2
                                                    : 0;
  int want = launcher == 1 ? BY_FLAG : launcher == 0 ? BY_EVENT_POLL : BY_FLAG | BY_EVENT_POLL;
  notices_by(NULL, want);
  notices_by("auto", want);
  notices_by("flag", BY_FLAG);
}

static void test_gpu_ipc_notice_poll(void **state) {
  (void)state;
  notices_by("poll", BY_EVENT_POLL);
}

/* notices_by with the stand-in's switch fake set (skipped on a GPU). */
static void notices_on_stand_in(const char *fake, const char *how, int want) {
  if (!gpu_on_stand_in())
    skip();
  setenv(fake, "1", 1);
  notices_by(how, want);
  unsetenv(fake);
}

/* A driver that refuses stream memory operations (only the stand-in can
 * be made to): flags fall back to polled events, byte for byte. */
static void test_gpu_ipc_notice_flag_fallback(void **state) {
  (void)state;
  notices_on_stand_in("FAKE_CUDA_NO_MEMOPS", "flag", BY_EVENT_POLL);
}

/* A stream that never writes its flags (one that broke before it got
 * there; the stand-in accepts the writes and drops them): every notice
 * still comes, once the stream is idle (cuStreamQuery), and the bytes
 * are there. */
static void test_gpu_ipc_notice_flag_lost(void **state) {
  (void)state;
  notices_on_stand_in("FAKE_CUDA_LOSE_WRITES", "flag", BY_FLAG);
}

static void test_gpu_ipc_notice_host(void **state) {
  (void)state;
  notices_by("host", BY_HOST);
}

static void test_gpu_ipc_notice_event(void **state) {
  (void)state;
  notices_by("event", BY_EVENT_WAIT);
}

/* A driver without events (only the stand-in can refuse them): polling
 * falls back to host functions, byte for byte, and so do flags where the
 * driver refuses them too.  The gather kernel needs events too, so the
 * copies go by the batch call. */
static void test_gpu_ipc_notice_poll_fallback(void **state) {
  (void)state;
  if (!gpu_on_stand_in())
    skip();
  setenv("SX_GPU_COPY", "batch", 1);
  setenv("FAKE_CUDA_NO_EVENTS", "1", 1);
  notices_by("poll", BY_HOST);
  setenv("FAKE_CUDA_NO_MEMOPS", "1", 1);
  notices_by("flag", BY_HOST);
  unsetenv("FAKE_CUDA_NO_MEMOPS");
  unsetenv("FAKE_CUDA_NO_EVENTS");
  unsetenv("SX_GPU_COPY");
}

/* A driver that refuses the batch call (as one without it): batches go
 * as single copies from then on, byte for byte.  Only the stand-in can
 * refuse it; last, since the refusal is remembered by the process. */
static void test_gpu_ipc_batch_refused(void **state) {
  (void)state;
  if (!gpu_on_stand_in())
    skip();
  setenv("SX_GPU_COPY", "batch", 1);
  setenv("FAKE_CUDA_NO_BATCH", "1", 1);
  target t;
  target_start(&t, "ipc-nb", "cuda:0", NULL);
  uint64_t before[4], after[4];
  sx__mem_copy_counts(before);
  gpu_pool r;
  sx_agent *ra;
  sx_segment *seg = reader_of("ipc-nb", "ipc-nbr", &r, &ra);
  read_verify(seg, &r, 2, SX_TRANSPORT_CUDA_IPC);
  odd_ranges(seg, &r);
  sx__mem_copy_counts(after);
  assert_int_equal(after[SX__COPY_BATCH], before[SX__COPY_BATCH]);
  assert_true(after[SX__COPY_RANGE] - before[SX__COPY_RANGE] >= 3);
  reader_end(seg, ra, &r);
  unsetenv("SX_GPU_COPY");
  unsetenv("FAKE_CUDA_NO_BATCH");
  assert_int_equal(target_end(&t, 0), 0);
}

static int setup(void **state) {
  (void)state;
  return gpu_store_setup(&redis, url, sizeof(url), "test_gpu_ipc", "gpu");
}

/* ------------------------------------------------------------ direct reads */

/* Do table reads go direct here (transport.h, "Direct reads")?  Not with
 * SX_IPC_DIRECT=0, without tables, or with copies forced onto the copy
 * engines (no kernel: no lane). */
static int direct_on(void) {
  const char *d = getenv("SX_IPC_DIRECT"), *t = getenv("SX_IPC_TABLES"),
             *c = getenv("SX_GPU_COPY");
  return !(d != NULL && strcmp(d, "0") == 0) && !(t != NULL && strcmp(t, "0") == 0) &&
         !(c != NULL && (strcmp(c, "batch") == 0 || strcmp(c, "range") == 0));
}

/* Blocks [first, first + n) of the reader's pool for one thread: entries of
 * one block each over both slots of every layer, remote blocks spread. */
static void direct_entries(sx_block_read *e, size_t n, uint64_t first, uint32_t seed) {
  for (size_t i = 0; i < n; i++)
    e[i] = (sx_block_read){.layer_count = LAYERS, .slots = SXT_KV,
                           .remote_block = (seed * 37u + i * 11u) % TBLOCKS,
                           .local_block = first + i, .count = 1};
}

typedef struct direct_thread {
  pthread_t th;
  sx_segment *seg;
  const gpu_pool *r;
  uint64_t first;
  int reads, bad;
  char why[300];
} direct_thread;

/* reads batches of 4 entries into its own blocks, each checked. */
static void *direct_reader(void *arg) {
  direct_thread *d = arg;
  sx_block_read e[4];
  for (int i = 0; i < d->reads && d->bad == 0; i++) {
    direct_entries(e, 4, d->first, (uint32_t)(d->first + (uint64_t)i));
    sx_batch_result res = sxt_run_batch(d->seg, e, 4, 10000);
    if (res.state != SX_BATCH_COMPLETED) {
      d->bad = 1;
      snprintf(d->why, sizeof(d->why), "%s (%.200s)", sx_batch_state_name(res.state),
               res.message);
    } else if (gpu_pool_verify(d->r, d->seg, SEED, e, 4) != 0) {
      d->bad = 2;
      snprintf(d->why, sizeof(d->why), "bytes differ in read %d", i);
    }
  }
  return NULL;
}

/* A batch callback (the loop's thread) that destroys the batch *arg
 * points to, and clears it. */
static void destroy_other(sx_batch *b, void *arg) {
  (void)b;
  sx_batch **other = arg;
  sx_batch_destroy(*other);
  *other = NULL;
}

/* Once the loop has run one table read of a peer, table reads from other
 * threads are launched on the submitting thread, and that thread (or any
 * that waits, polls or destroys) sees their end in the stream's word: no
 * hop through the agent's loop.  Checked byte for byte: reads in flight
 * together, from four threads at once, ended by polling alone, by an
 * eventfd, by a cancel, by a destroy without a wait; a wait of 0 ms on
 * one still running times out; and each counts in the agent's stats.
 * On the stand-in every copy is slowed to 2 ms, so the ends come
 * well after the submits. */
static void test_gpu_ipc_direct(void **state) {
  (void)state;
  if (!direct_on())
    skip();
  int slow = gpu_on_stand_in();
  if (slow)
    setenv("FAKE_CUDA_DELAY_US", "2000", 1);
  target t;
  target_start(&t, "ipc-d", "cuda:0", NULL);
  gpu_pool r;
  sx_agent *ra;
  sx_segment *seg = reader_of("ipc-d", "ipc-dr", &r, &ra); /* the loop ran a table */
  uint64_t d0 = sx__ipc_direct_reads();
  read_verify(seg, &r, 2, SX_TRANSPORT_CUDA_IPC);
  read_overlapped(seg, &r, 3); /* 8 in flight, 8 x 4 ranges each */
  assert_int_equal(sx__ipc_direct_reads() - d0, 9);
  sx_agent_stats st0, st1;
  sxt_ok(sx_agent_stats_get(ra, &st0, sizeof(st0)));

  /* Polling alone, and the result not there before the end. */
  sx_block_read e[8];
  direct_entries(e, 8, 0, 5);
  sx_batch *b = sxt_batch_submit(seg, e, 8, 10000);
  sx_batch_result res;
  if (slow) {
    assert_int_equal(sx_batch_result_get(b, &res), SX_EBUSY);
    sxt_rc(sx_batch_wait(b, 0), SX_ETIMEDOUT);
  }
  uint64_t t0 = sx__mono_ms();
  while (sx_batch_poll(b) == SX_EBUSY && sx__mono_ms() - t0 < 5000)
    ;
  sxt_ok(sx_batch_result_get(b, &res));
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_true(res.bytes == 8ull * BB * 2 * LAYERS);
  sx_batch_destroy(b);
  assert_int_equal(gpu_pool_verify(&r, seg, SEED, e, 8), 0);

  /* An eventfd asked for after the submit turns readable with the end,
   * nobody waiting (the loop watches the read from then on); one asked
   * for, then the batch destroyed at once. */
  direct_entries(e, 8, 8, 6);
  b = sxt_batch_submit(seg, e, 8, 10000);
  int fd = sx_batch_fd(b);
  assert_true(fd >= 0);
  struct pollfd pfd = {.fd = fd, .events = POLLIN};
  if (slow)
    assert_int_equal(poll(&pfd, 1, 0), 0);
  assert_int_equal(poll(&pfd, 1, 5000), 1);
  res = sxt_batch_finish(b);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(gpu_pool_verify(&r, seg, SEED, e, 8), 0);
  b = sxt_batch_submit(seg, e, 8, 10000);
  assert_true(sx_batch_fd(b) >= 0);
  sx_batch_destroy(b);

  /* A cancel: it ends CANCELLED (the copies were under way) or COMPLETED,
   * and the next read is whole. */
  direct_entries(e, 8, 16, 7);
  b = sxt_batch_submit(seg, e, 8, 10000);
  sxt_ok(sx_batch_cancel(b));
  res = sxt_batch_finish(b);
  assert_true(res.state == SX_BATCH_CANCELLED || res.state == SX_BATCH_COMPLETED);
  /* A destroy with no wait waits for the copies (ASan and the stand-in's
   * 2 ms say whether anything is used after it). */
  direct_entries(e, 8, 24, 8);
  sx_batch_destroy(sxt_batch_submit(seg, e, 8, 10000));
  direct_entries(e, 8, 16, 9);
  res = sxt_run_batch(seg, e, 8, 10000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(gpu_pool_verify(&r, seg, SEED, e, 8), 0);
  sxt_ok(sx_agent_stats_get(ra, &st1, sizeof(st1)));
  assert_true(st1.batches[SX_BATCH_COMPLETED] + st1.batches[SX_BATCH_CANCELLED] -
                  st0.batches[SX_BATCH_COMPLETED] - st0.batches[SX_BATCH_CANCELLED] ==
              6);

  /* A destroy from a callback (on the loop's thread, which cannot wait):
   * the loop watches the direct read and frees it at its end, cancelled
   * (a wait there would have ended it COMPLETED). */
  sxt_ok(sx_agent_stats_get(ra, &st0, sizeof(st0)));
  direct_entries(e, 8, 0, 12);
  sx_batch *victim = sxt_batch_submit(seg, e, 8, 10000);
  sx_block_read e2[1];
  direct_entries(e2, 1, 30, 13);
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.cb = destroy_other;
  bp.cb_arg = &victim;
  sxt_ok(sx_batch_create(seg, &bp, &b));
  sxt_ok(sx_batch_add_blocks(b, e2, 1));
  sxt_ok(sx_batch_submit(b));
  res = sxt_batch_finish(b);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_null(victim);
  for (int i = 0; i < 500; i++) {
    sxt_ok(sx_agent_stats_get(ra, &st1, sizeof(st1)));
    if (st1.batches[SX_BATCH_CANCELLED] > st0.batches[SX_BATCH_CANCELLED])
      break;
    sxt_sleep_ms(10);
  }
  assert_true(st1.batches[SX_BATCH_CANCELLED] == st0.batches[SX_BATCH_CANCELLED] + 1);

  /* A notifying read (its notice is the loop's to send) goes through the
   * loop, and a small one as ranges unless SX_IPC_TABLES says otherwise:
   * not direct. */
  uint64_t t1 = sx__ipc_table_ops(), n1 = sx__ipc_direct_reads();
  direct_entries(e, 8, 0, 11);
  res = sxt_batch_finish(sxt_notify_submit(seg, e, 8, 77, 10000));
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(gpu_pool_verify(&r, seg, SEED, e, 8), 0);
  assert_int_equal(sx__ipc_table_ops() - t1, getenv("SX_IPC_TABLES") ? tables_for(32) : 0);
  assert_int_equal(sx__ipc_direct_reads() - n1, 0);

  /* The submitting thread's own current context (an engine's runtime
   * works in it) is current again after a direct read: here none. */
  const char *lib = getenv("SX_CUDA_LIBRARY");
  void *h = dlopen(lib != NULL ? lib : "libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  assert_non_null(h);
  int (*set_current)(void *) = NULL, (*get_current)(void **) = NULL;
  *(void **)&set_current = dlsym(h, "cuCtxSetCurrent");
  *(void **)&get_current = dlsym(h, "cuCtxGetCurrent");
  assert_true(set_current != NULL && get_current != NULL);
  assert_int_equal(set_current(NULL), 0);
  uint64_t d1 = sx__ipc_direct_reads();
  direct_entries(e, 8, 24, 10);
  res = sxt_run_batch(seg, e, 8, 10000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(sx__ipc_direct_reads() - d1, 1);
  void *cur = &cur;
  assert_int_equal(get_current(&cur), 0);
  assert_null(cur);
  dlclose(h);
  /* So is its timer slack, which a direct wait cuts while it naps (on
   * the stand-in the read takes 2 ms: it naps). */
  assert_int_equal(prctl(PR_SET_TIMERSLACK, 123456, 0, 0, 0), 0);
  d1 = sx__ipc_direct_reads();
  direct_entries(e, 8, 24, 14);
  res = sxt_run_batch(seg, e, 8, 10000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(sx__ipc_direct_reads() - d1, 1);
  assert_int_equal(prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0), 123456);
  prctl(PR_SET_TIMERSLACK, 0, 0, 0, 0); /* back to the default */

  /* Four threads at once, each into its own blocks. */
  direct_thread th[4];
  for (int i = 0; i < 4; i++) {
    th[i] = (direct_thread){.seg = seg, .r = &r, .first = 32 + 8 * (uint64_t)i,
                            .reads = slow ? 40 : 400};
    assert_int_equal(pthread_create(&th[i].th, NULL, direct_reader, &th[i]), 0);
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(th[i].th, NULL);
    if (th[i].bad)
      fail_msg("thread %d: %s", i, th[i].why);
  }
  print_message("direct reads: %lu of this test's\n",
                (unsigned long)(sx__ipc_direct_reads() - d0));
  assert_true(sx__ipc_direct_reads() - d0 >= 9 + 8 + 4 * (uint64_t)th[0].reads);
  reader_end(seg, ra, &r);
  unsetenv("FAKE_CUDA_DELAY_US");
  assert_int_equal(target_end(&t, 0), 0);
}

/* What the loop takes away from direct reads in flight: a region given
 * back (the unregister completes at once, not after the reader's 5 s),
 * the target killed (every read ends, COMPLETED or failed, and the
 * mappings go), the reader's agent destroyed (every read ends, COMPLETED
 * or SX_ESHUTDOWN; the batches are destroyed after the agent, as the
 * notice test does). */
static void test_gpu_ipc_direct_withdrawn(void **state) {
  (void)state;
  if (!direct_on())
    skip();
  if (gpu_on_stand_in())
    setenv("FAKE_CUDA_DELAY_US", "2000", 1);
  target t;
  target_start(&t, "ipc-dw", "cuda:0", NULL);
  gpu_pool r;
  sx_agent *ra;
  sx_segment *seg = reader_of("ipc-dw", "ipc-dwr", &r, &ra);
  sx_block_read e[8];
  sx_batch *b[8];
  /* Slot V given back while reads of both slots are in flight. */
  uint64_t d0 = sx__ipc_direct_reads();
  for (int k = 0; k < 8; k++) {
    direct_entries(e, 1, (uint64_t)k, (uint32_t)k);
    b[k] = sxt_batch_submit(seg, e, 1, 10000);
  }
  assert_int_equal(sx__ipc_direct_reads() - d0, 8);
  unsigned long ms = target_unregister(&t, 1);
  assert_true(ms < 2000);
  for (int k = 0; k < 8; k++) {
    sx_batch_result res = sxt_batch_finish(b[k]);
    assert_true(res.state == SX_BATCH_COMPLETED || res.state == SX_BATCH_FAILED);
  }
  /* K alone still reads; V is refused. */
  sx_block_read k1 = {.layer_count = LAYERS, .slots = 1u << SX_SLOT_K, .remote_block = 3,
                      .local_block = 40, .count = 2};
  sx_batch_result res = sxt_run_batch(seg, &k1, 1, 10000);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(gpu_pool_verify(&r, seg, SEED, &k1, 1), 0);
  k1.slots = 1u << SX_SLOT_V;
  res = sxt_run_batch(seg, &k1, 1, 10000);
  assert_int_equal(res.state, SX_BATCH_FAILED);

  /* The target killed under direct reads of K. */
  k1.slots = 1u << SX_SLOT_K;
  for (int k = 0; k < 8; k++) {
    k1.local_block = (uint64_t)k * 2;
    b[k] = sxt_batch_submit(seg, &k1, 1, 10000);
  }
  kill(t.pid, SIGKILL);
  int lost = 0;
  for (int k = 0; k < 8; k++) {
    res = sxt_batch_finish(b[k]);
    assert_true(res.state == SX_BATCH_COMPLETED ||
                (res.state == SX_BATCH_FAILED && res.error == SX_EDISCONN));
    lost += res.state == SX_BATCH_FAILED;
  }
  print_message("target killed: %d of 8 direct reads failed\n", lost);
  for (int i = 0; i < 200 && sx__mem_ipc_open_count() != 0; i++)
    sxt_sleep_ms(10);
  assert_int_equal(sx__mem_ipc_open_count(), 0);
  sx_segment_close(seg);
  agent_end(ra);
  pool_end(&r);
  target_end(&t, SIGKILL);

  /* The reader destroyed under direct reads (another name: the killed
   * target's lease holds its own a while). */
  target_start(&t, "ipc-dx", "cuda:0", NULL);
  seg = reader_of("ipc-dx", "ipc-dxr", &r, &ra);
  d0 = sx__ipc_direct_reads();
  for (int k = 0; k < 8; k++) {
    direct_entries(e, 1, (uint64_t)k, (uint32_t)k);
    b[k] = sxt_batch_submit(seg, e, 1, 10000);
  }
  assert_int_equal(sx__ipc_direct_reads() - d0, 8);
  agent_end(ra); /* the segment left open: closed by destroy */
  int shut = 0;
  for (int k = 0; k < 8; k++) {
    assert_int_equal(sx_batch_poll(b[k]), 0);
    sxt_ok(sx_batch_result_get(b[k], &res));
    assert_true(res.state == SX_BATCH_COMPLETED ||
                (res.state == SX_BATCH_FAILED && res.error == SX_ESHUTDOWN));
    shut += res.state == SX_BATCH_FAILED;
    sx_batch_destroy(b[k]);
  }
  print_message("reader destroyed: %d of 8 direct reads failed\n", shut);
  pool_end(&r);
  unsetenv("FAKE_CUDA_DELAY_US");
  assert_int_equal(target_end(&t, 0), 0);
}

/* After each test: end what a failed one left (see held), and check that
 * no mapping outlives it. */
static int test_teardown(void **state) {
  (void)state;
  int agents = 0, targets = 0, relays = held.relay != NULL;
  for (int i = 0; i < HELD; i++) {
    if (held.agents[i] != NULL) {
      sx_agent_destroy(held.agents[i]); /* ends its batches, closes its mappings */
      held.agents[i] = NULL;
      agents++;
    }
  }
  for (int i = 0; i < HELD; i++) {
    if (held.pools[i].mem[0] != NULL)
      gpu_pool_free(&held.pools[i]);
    memset(&held.pools[i], 0, sizeof(held.pools[i]));
  }
  if (held.relay != NULL)
    relay_stop(held.relay);
  held.relay = NULL;
  for (int i = 0; i < HELD; i++) {
    if (held.targets[i].pid != 0) {
      target *t = &held.targets[i];
      kill(t->pid, SIGKILL); /* stopped or not */
      fclose(t->in);
      fclose(t->out);
      waitpid(t->pid, NULL, 0);
      memset(t, 0, sizeof(*t));
      targets++;
    }
  }
  unsetenv("SX_GPU_COPY"); /* what the copy-method tests set */
  unsetenv("FAKE_CUDA_NO_BATCH");
  unsetenv("SX_GPU_NOTICE"); /* what the notice tests set */
  unsetenv("FAKE_CUDA_DELAY_US");
  unsetenv("FAKE_CUDA_NO_EVENTS");
  if (agents + targets + relays > 0)
    print_message("teardown: ended %d agents, %d targets and %d relays the test left\n",
                  agents, targets, relays);
  for (int i = 0; i < 100 && sx__mem_ipc_open_count() != 0; i++)
    sxt_sleep_ms(10);
  if (sx__mem_ipc_open_count() != 0) {
    print_error("teardown: %lu IPC mappings outlive every agent\n",
                (unsigned long)sx__mem_ipc_open_count());
    return -1;
  }
  return 0;
}

static int teardown(void **state) {
  (void)state;
  sxt_redis_stop(&redis);
  return 0;
}

int main(int argc, char **argv) {
  if ((argc == 6 || argc == 7) && strcmp(argv[1], "target") == 0)
    return target_main(argv);
  if (realpath(argv[0], self) == NULL)
    snprintf(self, sizeof(self), "/proc/self/exe");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_gpu_ipc_one_gpu, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_two_gpus, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_transport_choice, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_target_killed, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_stale_incarnation, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_unregister_while_mapped, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_second_generation, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_batch_over_many_regions, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_record_beyond_mapping, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_revoke_of_unknown_and_repeated_ids, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_read_notice, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_reader_destroyed_while_notice_waits, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_copy_methods, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_launch_refused, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_tables_reused_by_notices, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_tables, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_direct, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_direct_withdrawn, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_notice_flag, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_notice_flag_fallback, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_notice_flag_lost, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_notice_poll, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_notice_host, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_notice_event, test_teardown),
      cmocka_unit_test_teardown(test_gpu_ipc_notice_poll_fallback, test_teardown),
      /* Last: the refusal stays. */
      cmocka_unit_test_teardown(test_gpu_ipc_batch_refused, test_teardown),
  };
  const char *filter = getenv("SXT_FILTER");
  if (filter != NULL)
    cmocka_set_test_filter(filter);
  return cmocka_run_group_tests(tests, setup, teardown);
}
