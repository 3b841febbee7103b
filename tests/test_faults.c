/*
 * Fault injection, end to end: sx-agent processes (BUILD/bin/sx-agent) hold
 * filled pools and publish them in a real redis-server; readers in this
 * process open them by name and read over TCP while the test breaks things:
 *
 *   - an agent killed with SIGKILL: its segment is gone within one lease, and
 *     readers get errors (never COMPLETED, never a written destination);
 *   - an agent stopped past its lease and resumed: it republishes (new
 *     generation) when the name is still free, and stops as fenced when
 *     another agent took it meanwhile; the store never shows two owners;
 *   - Redis killed and restarted empty: every agent republishes by itself;
 *   - Sentinel failover: agents follow the new master and keep renewing, also
 *     through sentinels that require a password (which no log shows);
 *   - a partition between reader and target (target in a network namespace
 *     behind a veth pair): packet loss, a slow link and the link down make
 *     batches end at their deadline (TIMEOUT), and reads work again after
 *     the link heals;
 *   - a reader killed during a batch: the target closes every connection it
 *     had and keeps serving.
 *
 * Each test prints what it measured ("measured: ...").  Bounds are one lease
 * or one renew interval plus documented backoff, with a margin for a loaded
 * machine.  SXT_FILTER=pattern runs a subset; SXT_KEEP_LOGS=1 keeps logs.
 */
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "internal.h"
#include "proc_env.h"
#include "redis/redis.h"
#include "segxfer/store.h"

/* The pool every sx-agent here holds: 4 layers x K,V x 64 blocks of 16 KiB. */
#define LAYERS 4
#define BLOCK 16384u
#define BLOCKS 64u
#define LOCAL_BLOCKS 64u
#define KV 3u /* slots K and V */

static sxt_proc_env env;
static int seq;
/* The agents' --log-level (tests that check logs for secrets use debug). */
static const char *agent_log_level = "info";

/* ------------------------------------------------------------ helpers */

typedef struct agent_proc {
  pid_t pid;
  char name[64];
  char log[256];
  char url[512]; /* the store as the agent reaches it */
  uint8_t inc[SX_INCARNATION_LEN];
  uint64_t seed;
} agent_proc;

/* The incarnation and generation the store holds for name: 0 or an error. */
static int stored(const char *url, const char *name, uint8_t inc[SX_INCARNATION_LEN],
                  uint64_t *gen) {
  sx_store *s;
  int rc = sx_store_open(url, &s);
  if (rc != 0)
    return rc;
  sx_desc d;
  rc = sx_store_get(s, name, &d, NULL);
  if (rc == 0) {
    if (inc)
      memcpy(inc, d.incarnation, SX_INCARNATION_LEN);
    if (gen)
      *gen = d.generation;
    sx_desc_free(&d);
  }
  sx_store_close(s);
  return rc;
}

static const char *ip_cmd(void) {
  static const char *const paths[] = {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"};
  for (size_t i = 0; i < sizeof(paths) / sizeof(paths[0]); i++)
    if (access(paths[i], X_OK) == 0)
      return paths[i];
  return NULL;
}

/* Start an sx-agent (inside netns when not NULL) publishing name in url.
 * Does not wait. */
static void agent_spawn(agent_proc *p, const char *name, const char *url,
                        const char *listen, uint32_t lease_ms, uint64_t seed,
                        const char *netns) {
  char exe[PATH_MAX + 16], lease[16], fill[32], blocks[16], bb[16], layers[16];
  snprintf(exe, sizeof(exe), "%s/sx-agent", env.bindir);
  snprintf(lease, sizeof(lease), "%u", lease_ms);
  snprintf(fill, sizeof(fill), "%lu", (unsigned long)seed);
  snprintf(blocks, sizeof(blocks), "%u", BLOCKS);
  snprintf(bb, sizeof(bb), "%u", BLOCK);
  snprintf(layers, sizeof(layers), "%u", LAYERS);
  memset(p, 0, sizeof(*p));
  snprintf(p->name, sizeof(p->name), "%s", name);
  snprintf(p->log, sizeof(p->log), "%s/%s-%d.log", env.tmpdir, name, seq++);
  snprintf(p->url, sizeof(p->url), "%s", url);
  p->seed = seed;
  const char *argv[40];
  int n = 0;
  if (netns) {
    argv[n++] = ip_cmd();
    argv[n++] = "netns";
    argv[n++] = "exec";
    argv[n++] = netns;
  }
  const char *rest[] = {exe, "--name", p->name, "--metadata", url, "--listen",
                        listen ? listen : "127.0.0.1:0", "--layers", layers,
                        "--block-bytes", bb, "--num-blocks", blocks, "--slots", "K,V",
                        "--fingerprint", "faults/v1", "--fill", fill, "--lease-ms", lease,
                        "--log-level", agent_log_level, NULL};
  for (size_t i = 0; i < sizeof(rest) / sizeof(rest[0]); i++)
    argv[n++] = rest[i];
  p->pid = sxt_spawn(p->log, argv);
  assert_true(p->pid > 0);
}

/* Wait until the store holds an incarnation for p's name other than
 * `not` (NULL: any), and take it as p's.  Fails the test after ms. */
static void agent_wait_published(agent_proc *p, const uint8_t *not, int ms) {
  uint64_t t0 = sx__mono_ms();
  while ((int)(sx__mono_ms() - t0) < ms) {
    uint8_t inc[SX_INCARNATION_LEN];
    if (stored(p->url, p->name, inc, NULL) == 0 &&
        (not == NULL || memcmp(inc, not, SX_INCARNATION_LEN) != 0)) {
      memcpy(p->inc, inc, SX_INCARNATION_LEN);
      return;
    }
    if (waitpid(p->pid, NULL, WNOHANG) == p->pid)
      fail_msg("sx-agent %s exited early; see %s", p->name, p->log);
    sxt_sleep_ms(20);
  }
  fail_msg("sx-agent %s did not publish within %d ms; see %s", p->name, ms, p->log);
}

static int agent_stop(agent_proc *p, int sig) {
  if (p->pid <= 0)
    return -1;
  kill(p->pid, SIGCONT);
  kill(p->pid, sig);
  int rc = sxt_reap(p->pid, 20000);
  p->pid = 0;
  return rc;
}

typedef struct reader {
  sx_agent *a;
  uint8_t *mem[2];
} reader;

static void reader_start(reader *r, const char *url) {
  memset(r, 0, sizeof(*r));
  sx_agent_params p;
  char name[32];
  snprintf(name, sizeof(name), "fault-reader-%d", seq++);
  sxt_params(&p, url, name);
  p.name = NULL; /* reader only */
  snprintf(p.layout.fingerprint, sizeof(p.layout.fingerprint), "faults/v1");
  sxt_ok(sx_agent_create(&p, &r->a));
  for (uint32_t s = 0; s < 2; s++) {
    uint64_t layer = (uint64_t)LOCAL_BLOCKS * BLOCK;
    r->mem[s] = calloc(LAYERS, layer);
    assert_non_null(r->mem[s]);
    sx_region_params rp = {.addr = r->mem[s], .length = LAYERS * layer,
                           .layer_count = LAYERS, .layer_stride = layer, .slot = s,
                           .block_bytes = BLOCK, .num_blocks = LOCAL_BLOCKS};
    uint32_t id;
    sxt_ok(sx_agent_register(r->a, &rp, &id));
  }
}

static void reader_stop(reader *r) {
  sx_agent_destroy(r->a);
  for (int s = 0; s < 2; s++)
    free(r->mem[s]);
}

/* Blocks [first, first+count) of every layer, K and V, to the same local
 * blocks. */
static sx_block_read blocks_of(uint64_t first, uint64_t count) {
  return (sx_block_read){.layer_count = LAYERS, .slots = KV, .remote_block = first,
                         .local_block = first, .count = count};
}

static sx_batch_result run_batch(sx_segment *s, const sx_block_read *e, uint32_t timeout_ms,
                                 uint64_t *took_ms) {
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = timeout_ms;
  sx_batch *b;
  sxt_ok(sx_batch_create(s, &bp, &b));
  sxt_ok(sx_batch_add_blocks(b, e, 1));
  uint64_t t0 = sx__mono_ms();
  sxt_ok(sx_batch_submit(b));
  /* A batch must end by its deadline: wait a bounded time, never forever. */
  if (sx_batch_wait(b, (int)timeout_ms + 5000) != 0)
    fail_msg("a batch with a %u ms deadline was still running %u ms after submit",
             timeout_ms, timeout_ms + 5000);
  if (took_ms)
    *took_ms = sx__mono_ms() - t0;
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  res.failed = NULL;
  sx_batch_destroy(b);
  return res;
}

/* Every byte of entry e in the reader's memory is the pool's pattern. */
static int verify(const reader *r, const sx_segment *seg, uint64_t seed,
                  const sx_block_read *e) {
  return sxt_verify(r->mem, LOCAL_BLOCKS, seg, seed, e);
}

/* Every byte of entry e's destinations still holds fill. */
static int untouched(const reader *r, const sx_block_read *e, uint8_t fill) {
  uint64_t layer = (uint64_t)LOCAL_BLOCKS * BLOCK;
  for (int s = 0; s < 2; s++)
    for (uint32_t l = 0; l < LAYERS; l++)
      for (uint64_t i = e->local_block * BLOCK; i < (e->local_block + e->count) * BLOCK; i++)
        if (r->mem[s][l * layer + i] != fill)
          return 0;
  return 1;
}

static void fill_dest(reader *r, uint8_t v) {
  for (int s = 0; s < 2; s++)
    memset(r->mem[s], v, (uint64_t)LAYERS * LOCAL_BLOCKS * BLOCK);
}

/* ------------------------------------------------------------ agents */

static void test_fault_agent_sigkill_segment_gone_within_a_lease(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  const uint32_t lease = 1000;
  agent_proc p;
  agent_spawn(&p, "killed", env.url, NULL, lease, 11, NULL);
  agent_wait_published(&p, NULL, 20000);
  reader r;
  reader_start(&r, env.url);
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, p.name, 5000, &seg));
  sx_block_read e = blocks_of(0, 16);
  assert_int_equal(run_batch(seg, &e, 5000, NULL).state, SX_BATCH_COMPLETED);
  assert_int_equal(verify(&r, seg, 11, &e), 0);

  assert_int_equal(agent_stop(&p, SIGKILL), 128 + SIGKILL);
  uint64_t t0 = sx__mono_ms();
  /* Until the store drops it, and after: every read fails, and no
   * destination is written. */
  int batches = 0, gone = 0;
  uint64_t gone_ms = 0;
  while (sx__mono_ms() - t0 < lease + 3000 && !(gone && batches >= 3)) {
    fill_dest(&r, 0xab);
    sx_batch_result res = run_batch(seg, &e, 1000, NULL);
    batches++;
    if (res.state == SX_BATCH_COMPLETED)
      fail_msg("a batch COMPLETED %lu ms after its target was killed",
               (unsigned long)(sx__mono_ms() - t0));
    assert_true(untouched(&r, &e, 0xab));
    if (!gone && stored(env.url, p.name, NULL, NULL) == SX_ENOENT) {
      gone = 1;
      gone_ms = sx__mono_ms() - t0;
    }
    sxt_sleep_ms(20);
  }
  assert_true(gone);
  print_message("measured: segment gone %lu ms after SIGKILL (lease %u ms); %d batches "
                "meanwhile, all failed, no destination written\n",
                (unsigned long)gone_ms, lease, batches);
  /* Within one lease of the last renewal; margin for a loaded machine. */
  assert_true(gone_ms <= lease + 1000);
  sx_segment_close(seg);
  sxt_rc(sx_segment_open(r.a, p.name, 0, &seg), SX_ENOENT);
  reader_stop(&r);
}

static void test_fault_agent_stopped_past_lease_republishes(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  const uint32_t lease = 1000, deadline = 2500;
  agent_proc p;
  agent_spawn(&p, "sleeper", env.url, NULL, lease, 12, NULL);
  agent_wait_published(&p, NULL, 20000);
  reader r;
  reader_start(&r, env.url);
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, p.name, 5000, &seg));
  sx_block_read e = blocks_of(8, 8);
  assert_int_equal(run_batch(seg, &e, 5000, NULL).state, SX_BATCH_COMPLETED);
  assert_int_equal(sxt_freeze(p.pid), 0);
  /* A batch in flight while the segment expires: the store's event is no
   * reason to end it (the data path may just be slow); it ends at its
   * deadline, or on a transport error, never early and never COMPLETED. */
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = deadline;
  sx_batch *b;
  sxt_ok(sx_batch_create(seg, &bp, &b));
  sxt_ok(sx_batch_add_blocks(b, &e, 1));
  uint64_t t0 = sx__mono_ms();
  sxt_ok(sx_batch_submit(b));
  while (stored(env.url, p.name, NULL, NULL) == 0 && sx__mono_ms() - t0 < lease + 3000)
    sxt_sleep_ms(20);
  uint64_t expired = sx__mono_ms() - t0;
  assert_int_equal(stored(env.url, p.name, NULL, NULL), SX_ENOENT);
  sxt_sleep_ms(200); /* the expiry event reaches the reader's cache */
  if (expired + 200 < deadline - 100)
    assert_int_equal(sx_batch_poll(b), SX_EBUSY);
  sxt_ok(sx_batch_wait(b, (int)deadline + 5000));
  uint64_t ended = sx__mono_ms() - t0;
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  assert_int_equal(res.state, SX_BATCH_TIMEOUT);
  assert_true(ended + 50 >= deadline);
  sx_batch_destroy(b);

  assert_int_equal(sxt_thaw(p.pid), 0);
  uint64_t t1 = sx__mono_ms();
  uint8_t inc[SX_INCARNATION_LEN];
  uint64_t gen = 0;
  while ((stored(env.url, p.name, inc, &gen) != 0 || gen < 2) && sx__mono_ms() - t1 < 10000)
    sxt_sleep_ms(10);
  uint64_t back = sx__mono_ms() - t1;
  sxt_ok(stored(env.url, p.name, inc, &gen));
  assert_memory_equal(inc, p.inc, SX_INCARNATION_LEN); /* the same process */
  assert_true(gen >= 2);                               /* a new generation */
  print_message("measured: stopped agent's segment expired %lu ms after SIGSTOP (lease "
                "%u ms); a batch in flight ended TIMEOUT at %lu ms (deadline %u ms); "
                "republished as generation %lu %lu ms after SIGCONT\n",
                (unsigned long)expired, lease, (unsigned long)ended, deadline,
                (unsigned long)gen, (unsigned long)back);
  assert_true(back <= lease / 3 + 2000);
  /* It reads as before: a re-open finds the new generation, also while the
   * old segment is still open.  (Both share one peer per incarnation; the
   * timeout's refresh had marked it "no longer published", which must not
   * outlive the republish.) */
  sx_segment *again;
  sxt_ok(sx_segment_open(r.a, p.name, 5000, &again));
  assert_true(sx_segment_desc(again)->generation >= 2);
  e = blocks_of(20, 8);
  sx_batch_result ok = run_batch(again, &e, 5000, NULL);
  if (ok.state != SX_BATCH_COMPLETED)
    fail_msg("reading the republished segment: %s %s: %s", sx_batch_state_name(ok.state),
             sx_err_name(ok.error), ok.message);
  assert_int_equal(verify(&r, again, 12, &e), 0);
  sx_segment_close(seg);
  sx_segment_close(again);
  reader_stop(&r);
  assert_true(sxt_count_in_file(p.log, "republishing") >= 1);
  assert_int_equal(agent_stop(&p, SIGTERM), 0);
}

static void test_fault_agent_stopped_while_another_took_the_name_is_fenced(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  const uint32_t lease = 1000;
  agent_proc a, b;
  agent_spawn(&a, "contested", env.url, NULL, lease, 13, NULL);
  agent_wait_published(&a, NULL, 20000);
  assert_int_equal(sxt_freeze(a.pid), 0);
  /* Its lease runs out; a second agent claims the free name (no takeover). */
  uint64_t t0 = sx__mono_ms();
  while (stored(env.url, a.name, NULL, NULL) == 0 && sx__mono_ms() - t0 < lease + 3000)
    sxt_sleep_ms(20);
  assert_int_equal(stored(env.url, a.name, NULL, NULL), SX_ENOENT);
  agent_spawn(&b, "contested", env.url, NULL, lease, 14, NULL);
  agent_wait_published(&b, a.inc, 20000);
  /* The first wakes up: it must find it lost the name and stop, while the
   * store shows the second as the only owner all along. */
  assert_int_equal(sxt_thaw(a.pid), 0);
  uint64_t t1 = sx__mono_ms();
  int status = -1, samples = 0;
  while (sx__mono_ms() - t1 < 10000) {
    uint8_t inc[SX_INCARNATION_LEN];
    int rc = stored(env.url, a.name, inc, NULL);
    if (rc == 0) {
      samples++;
      if (memcmp(inc, b.inc, SX_INCARNATION_LEN) != 0)
        fail_msg("the store names another owner than the agent that took the name");
    }
    int st;
    if (waitpid(a.pid, &st, WNOHANG) == a.pid) {
      status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      a.pid = 0;
      break;
    }
    sxt_sleep_ms(10);
  }
  uint64_t fenced_ms = sx__mono_ms() - t1;
  if (status != 3)
    fail_msg("the stopped agent should exit 3 (fenced), got %d; see %s", status, a.log);
  assert_true(sxt_count_in_file(a.log, "fenced") >= 1);
  /* The second keeps the name, renewing, past a few leases. */
  sxt_sleep_ms(2 * lease);
  uint8_t inc[SX_INCARNATION_LEN];
  sxt_ok(stored(env.url, b.name, inc, NULL));
  assert_memory_equal(inc, b.inc, SX_INCARNATION_LEN);
  assert_int_equal(waitpid(b.pid, NULL, WNOHANG), 0);
  assert_int_equal(sxt_count_in_file(b.log, "fenced"), 0);
  print_message("measured: the resumed agent stopped as fenced %lu ms after SIGCONT; "
                "%d store samples meanwhile, all naming the new owner\n",
                (unsigned long)fenced_ms, samples);
  assert_int_equal(agent_stop(&b, SIGTERM), 0);
}

/* ------------------------------------------------------------ the store */

static void test_fault_store_restarted_empty_every_agent_republishes(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  enum { N = 3 };
  const uint32_t lease = 1500, renew = lease / 3;
  agent_proc p[N];
  for (int i = 0; i < N; i++) {
    char name[32];
    snprintf(name, sizeof(name), "survivor-%d", i);
    agent_spawn(&p[i], name, env.url, NULL, lease, 20 + (uint64_t)i, NULL);
  }
  for (int i = 0; i < N; i++)
    agent_wait_published(&p[i], NULL, 20000);
  sxt_redis_kill(&env.redis, SIGKILL);
  assert_int_equal(sxt_redis_restart(&env.redis), 0);
  uint64_t t0 = sx__mono_ms(), back[N] = {0};
  int left = N;
  while (left > 0 && sx__mono_ms() - t0 < 20000) {
    for (int i = 0; i < N; i++) {
      uint8_t inc[SX_INCARNATION_LEN];
      if (back[i] == 0 && stored(env.url, p[i].name, inc, NULL) == 0) {
        assert_memory_equal(inc, p[i].inc, SX_INCARNATION_LEN);
        back[i] = sx__mono_ms() - t0;
        left--;
      }
    }
    sxt_sleep_ms(5);
  }
  if (left > 0)
    fail_msg("%d agents did not republish within 20 s of the store restart", left);
  uint64_t worst = 0;
  for (int i = 0; i < N; i++)
    worst = back[i] > worst ? back[i] : worst;
  print_message("measured: %d agents republished %lu, %lu, %lu ms after Redis came back "
                "empty (renew interval %u ms, reconnect backoff at most %u ms)\n",
                N, (unsigned long)back[0], (unsigned long)back[1], (unsigned long)back[2],
                renew, SX_REDIS_BACKOFF_MAX_MS);
  /* One renew interval plus one backoff step, with a margin. */
  assert_true(worst <= renew + SX_REDIS_BACKOFF_MAX_MS + 1000);
  for (int i = 0; i < N; i++)
    assert_int_equal(agent_stop(&p[i], SIGTERM), 0);
}

/* Server time in ms (TIME) of a redis-server. */
static int64_t server_ms(const sxt_redis *r) {
  redisReply *t = sxt_redis_command(r, "TIME");
  assert_non_null(t);
  assert_int_equal(t->type, REDIS_REPLY_ARRAY);
  int64_t ms = strtoll(t->element[0]->str, NULL, 10) * 1000 +
               strtoll(t->element[1]->str, NULL, 10) / 1000;
  freeReplyObject(t);
  return ms;
}

/* The segment's last renewal (server ms) on r, or -1. */
static int64_t renewed_at(const sxt_redis *r, const char *ns, const char *name) {
  redisReply *x = sxt_redis_command(r, "HGET sx:%s:seg:{%s} ren", ns, name);
  int64_t v = x && x->type == REDIS_REPLY_STRING ? strtoll(x->str, NULL, 10) : -1;
  if (x)
    freeReplyObject(x);
  return v;
}

/* Two agents publish through a sentinel (with its own password when
 * sentinel_pw is not NULL: the agents' URL carries sentinel_password), then
 * SENTINEL FAILOVER: every agent renews on the new master by itself. */
static void sentinel_failover_agents_follow(const char *sentinel_pw) {
  enum { N = 2 };
  sxt_redis m, rp, st;
  assert_int_equal(sxt_redis_start(&m, NULL), 0);
  sxt_redis_opts ro = {.replica_of = &m};
  assert_int_equal(sxt_redis_start(&rp, &ro), 0);
  sxt_redis_opts so = {.requirepass = sentinel_pw};
  if (sxt_sentinel_start_opts(&st, &m, "sxmaster", &so) != 0) {
    sxt_redis_stop(&rp);
    sxt_redis_stop(&m);
    print_message("skipped: redis-sentinel is not installed (make deps)\n");
    skip();
  }
  assert_int_equal(sxt_redis_wait_replicas(&st, 1, 30000), 0);
  char surl[256];
  snprintf(surl, sizeof(surl),
           "redis+sentinel://127.0.0.1:%d/sxmaster?namespace=fo&timeout_ms=1000"
           "&connect_timeout_ms=1000%s%s",
           st.port, sentinel_pw ? "&sentinel_password=" : "", sentinel_pw ? sentinel_pw : "");
  const uint32_t lease = 2000;
  agent_proc p[N];
  for (int i = 0; i < N; i++) {
    char name[32];
    snprintf(name, sizeof(name), "follower-%d", i);
    agent_spawn(&p[i], name, surl, NULL, lease, 30 + (uint64_t)i, NULL);
  }
  for (int i = 0; i < N; i++)
    agent_wait_published(&p[i], NULL, 20000);

  redisReply *rep = sxt_redis_command(&st, "SENTINEL FAILOVER sxmaster");
  assert_non_null(rep);
  assert_int_not_equal(rep->type, REDIS_REPLY_ERROR);
  freeReplyObject(rep);
  uint64_t t0 = sx__mono_ms();
  assert_int_equal(sxt_redis_wait_master(&st, rp.port, 30000), 0);
  uint64_t switched = sx__mono_ms() - t0;
  int64_t since = server_ms(&rp);
  /* Every agent renews on the new master (a renewal written there after
   * the switch), by itself. */
  uint64_t renewed[N] = {0};
  int left = N;
  while (left > 0 && sx__mono_ms() - t0 < 30000) {
    for (int i = 0; i < N; i++)
      if (renewed[i] == 0 && renewed_at(&rp, "fo", p[i].name) > since) {
        renewed[i] = sx__mono_ms() - t0;
        left--;
      }
    sxt_sleep_ms(20);
  }
  if (left > 0)
    fail_msg("%d agents did not renew on the new master within 30 s", left);
  /* And they stay published there, through more than a lease. */
  sxt_sleep_ms(lease + 500);
  for (int i = 0; i < N; i++) {
    int64_t last = renewed_at(&rp, "fo", p[i].name);
    assert_true(last > since);
    redisReply *inc = sxt_redis_command(&rp, "HGET sx:fo:seg:{%s} inc", p[i].name);
    assert_non_null(inc);
    assert_int_equal(inc->type, REDIS_REPLY_STRING);
    char hex[2 * SX_INCARNATION_LEN + 1];
    sx_hex(p[i].inc, SX_INCARNATION_LEN, hex);
    assert_string_equal(inc->str, hex);
    freeReplyObject(inc);
    assert_int_equal(waitpid(p[i].pid, NULL, WNOHANG), 0);
  }
  print_message("measured: Sentinel%s switched in %lu ms; agents renewed on the new master "
                "%lu and %lu ms after SENTINEL FAILOVER (lease %u ms)\n",
                sentinel_pw ? " (with a password)" : "", (unsigned long)switched,
                (unsigned long)renewed[0], (unsigned long)renewed[1], lease);
  for (int i = 0; i < N; i++)
    assert_int_equal(agent_stop(&p[i], SIGTERM), 0);

  if (sentinel_pw != NULL) {
    /* An agent with a wrong sentinel password does not start, and says why:
     * the sentinel, AUTH, WRONGPASS; no secret in its debug log. */
    char bad[256];
    snprintf(bad, sizeof(bad),
             "redis+sentinel://127.0.0.1:%d/sxmaster?namespace=fo&connect_timeout_ms=1000"
             "&sentinel_password=Wrong-Sent-Pw-77",
             st.port);
    agent_proc w;
    agent_spawn(&w, "refused", bad, NULL, lease, 40, NULL);
    int rc = sxt_reap_log(w.pid, 20000, w.log);
    assert_true(rc > 0 && rc < 128); /* exited with an error */
    char want[96];
    snprintf(want, sizeof(want), "sentinel 127.0.0.1:%d: AUTH refused: WRONGPASS", st.port);
    if (sxt_count_in_file(w.log, want) == 0) {
      sxt_show_log(w.log);
      fail_msg("the refused agent's log does not say '%s'", want);
    }
    assert_int_equal(sxt_count_in_file(w.log, "Wrong-Sent-Pw-77"), 0);
    for (int i = 0; i < N; i++)
      assert_int_equal(sxt_count_in_file(p[i].log, sentinel_pw), 0);
  }
  sxt_redis_stop(&st);
  sxt_redis_stop(&rp);
  sxt_redis_stop(&m);
}

static void test_fault_sentinel_failover_agents_follow(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  sentinel_failover_agents_follow(NULL);
}

/* The same with sentinels that require a password (requirepass): the agents
 * authenticate to them (resolution and the +switch-master watch), at debug
 * log level, and never log the password. */
static void test_fault_sentinel_with_password_failover_agents_follow(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  agent_log_level = "debug";
  sentinel_failover_agents_follow("Sent-Fault-Pw-4242");
  agent_log_level = "info";
}

/* ------------------------------------------------------------ partition */

/* The target lives in a network namespace joined to this one by a veth
 * pair; tc and nft act inside the namespace (deleted with it). */
static char netns[32], veth_host[16];
static int net_up;
static char host_ip[20], ns_ip[20];

static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...) {
  char cmd[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof(cmd), fmt, ap);
  va_end(ap);
  char full[1200];
  snprintf(full, sizeof(full), "%s >>%s/net.log 2>&1", cmd, env.tmpdir);
  int st = system(full);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void net_down(void) {
  if (!net_up)
    return;
  /* Deleting the namespace deletes its end of the veth pair, and with it
   * the pair, its qdiscs and the namespace's nft tables. */
  sh("ip netns del %s", netns);
  sh("ip link del %s", veth_host);
  net_up = 0;
}

/* 0, or why the partition tests cannot run here (printed). */
static int net_setup(void) {
  if (geteuid() != 0) {
    print_message("skipped: partition tests need root (network namespaces, veth)\n");
    return -1;
  }
  if (ip_cmd() == NULL) {
    print_message("skipped: iproute2 (ip) is not installed (make deps)\n");
    return -1;
  }
  snprintf(netns, sizeof(netns), "sxf-%d", (int)getpid());
  snprintf(veth_host, sizeof(veth_host), "sxfh%d", (int)getpid() % 100000);
  /* A subnet of this process's own: runs in parallel (CI, developers)
   * must not claim the same address in the root namespace. */
  int pid = (int)getpid();
  snprintf(host_ip, sizeof(host_ip), "10.%d.%d.1", 100 + pid % 100, (pid / 100) % 250);
  snprintf(ns_ip, sizeof(ns_ip), "10.%d.%d.2", 100 + pid % 100, (pid / 100) % 250);
  if (sh("ip netns add %s", netns) != 0) {
    print_message("skipped: cannot create a network namespace (ip netns add)\n");
    return -1;
  }
  net_up = 1;
  atexit(net_down);
  if (sh("ip link add %s type veth peer name sxfn0 netns %s", veth_host, netns) != 0 ||
      sh("ip addr add %s/24 dev %s", host_ip, veth_host) != 0 ||
      sh("ip link set %s up", veth_host) != 0 ||
      sh("ip -n %s addr add %s/24 dev sxfn0", netns, ns_ip) != 0 ||
      sh("ip -n %s link set sxfn0 up", netns) != 0 ||
      sh("ip -n %s link set lo up", netns) != 0) {
    net_down();
    print_message("skipped: cannot set up a veth pair into the namespace\n");
    return -1;
  }
  return 0;
}

/* Impairments inside the namespace, on the target's side. */
static int have_nft, have_netem;

static void impair_clear(void) {
  sh("ip netns exec %s nft delete table inet sxf", netns);
  sh("ip netns exec %s tc qdisc del dev sxfn0 root", netns);
  sh("ip link set %s up", veth_host);
}

/* Drop this percentage of the target's data-plane packets, both ways. */
static int impair_loss(int percent, uint16_t port) {
  if (have_netem)
    return sh("ip netns exec %s tc qdisc add dev sxfn0 root netem loss %d%%", netns, percent);
  if (sh("ip netns exec %s nft add table inet sxf", netns) != 0 ||
      sh("ip netns exec %s nft add chain inet sxf in '{ type filter hook input priority 0; }'",
         netns) != 0 ||
      sh("ip netns exec %s nft add chain inet sxf out '{ type filter hook output priority 0; "
         "}'", netns) != 0)
    return -1;
  if (percent >= 100)
    return sh("ip netns exec %s nft add rule inet sxf in tcp dport %u drop", netns, port) ||
           sh("ip netns exec %s nft add rule inet sxf out tcp sport %u drop", netns, port);
  return sh("ip netns exec %s nft add rule inet sxf in tcp dport %u numgen random mod 100 "
            "'<' %d drop", netns, port, percent) ||
         sh("ip netns exec %s nft add rule inet sxf out tcp sport %u numgen random mod 100 "
            "'<' %d drop", netns, port, percent);
}

/* A link slower than the batch needs: netem delay where the kernel has it,
 * else a token bucket at 200 kbit/s (queueing delay grows with the data). */
static int impair_slow(void) {
  if (have_netem)
    return sh("ip netns exec %s tc qdisc add dev sxfn0 root netem delay 400ms", netns);
  return sh("ip netns exec %s tc qdisc add dev sxfn0 root tbf rate 200kbit burst 16kb latency 10s",
            netns);
}

/* One batch that must end at its deadline with a timeout. */
static void expect_timeout(sx_segment *seg, reader *r, const sx_block_read *e,
                           uint32_t deadline, const char *what) {
  fill_dest(r, 0xcd);
  uint64_t took;
  sx_batch_result res = run_batch(seg, e, deadline, &took);
  if (res.state != SX_BATCH_TIMEOUT || res.error != SX_ETIMEDOUT)
    fail_msg("%s: the batch ended %s (%s: %s) after %lu ms instead of TIMEOUT at its "
             "%u ms deadline", what, sx_batch_state_name(res.state),
             sx_err_name(res.error), res.message, (unsigned long)took, deadline);
  if (took + 50 < deadline || took > deadline + 2000)
    fail_msg("%s: TIMEOUT after %lu ms, not at the %u ms deadline", what,
             (unsigned long)took, deadline);
  /* Bytes that arrived before the deadline are in place (payload goes
   * straight to the destination), but nothing may land after the end:
   * the transport drains what is still on its way into scratch memory. */
  size_t bytes = (size_t)LAYERS * LOCAL_BLOCKS * BLOCK;
  uint8_t *copy[2];
  for (int s = 0; s < 2; s++) {
    copy[s] = malloc(bytes);
    assert_non_null(copy[s]);
    memcpy(copy[s], r->mem[s], bytes);
  }
  sxt_sleep_ms(300);
  for (int s = 0; s < 2; s++) {
    if (memcmp(copy[s], r->mem[s], bytes) != 0)
      fail_msg("%s: a destination of the timed-out batch changed after it ended", what);
    free(copy[s]);
  }
  print_message("measured: %s: TIMEOUT after %lu ms (deadline %u ms)\n", what,
                (unsigned long)took, deadline);
}

/* Batches until one completes (verified): ms from the call, or fail. */
static uint64_t until_reads_work(sx_segment *seg, reader *r, uint64_t seed,
                                 const sx_block_read *e, const char *what) {
  uint64_t t0 = sx__mono_ms();
  int tries = 0;
  while (sx__mono_ms() - t0 < 60000) {
    tries++;
    sx_batch_result res = run_batch(seg, e, 1000, NULL);
    if (res.state == SX_BATCH_COMPLETED) {
      assert_int_equal(verify(r, seg, seed, e), 0);
      uint64_t ms = sx__mono_ms() - t0;
      print_message("measured: %s: reads work again %lu ms after the link healed (%d "
                    "batches of 1 s)\n", what, (unsigned long)ms, tries);
      return ms;
    }
  }
  fail_msg("%s: no batch completed within 60 s of healing", what);
  return 0;
}

static void test_fault_partition_loss_slow_link_down_then_heal(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  if (net_setup() != 0)
    skip();
  have_netem = sh("ip netns exec %s tc qdisc add dev sxfn0 root netem delay 1ms", netns) == 0;
  if (have_netem)
    sh("ip netns exec %s tc qdisc del dev sxfn0 root", netns);
  have_nft = sh("nft --version") == 0;
  if (!have_netem && !have_nft) {
    net_down();
    print_message("skipped: neither tc netem (kernel module sch_netem) nor nft "
                  "(nftables) is available to drop packets\n");
    skip();
  }
  print_message("impairments: %s for loss, %s for a slow link\n",
                have_netem ? "tc netem" : "nft random drop",
                have_netem ? "netem delay" : "tbf at 200 kbit/s");
  /* A Redis both sides reach: this side on 127.0.0.1, the target over the
   * veth (the store is not what is partitioned: only the data port is,
   * until the link goes down). */
  sxt_redis rs;
  char opts_bind[64];
  snprintf(opts_bind, sizeof(opts_bind), "127.0.0.1 %s", host_ip);
  if (sxt_redis_start(&rs, &(sxt_redis_opts){.notify = "Kx", .bind = opts_bind}) != 0) {
    net_down();
    fail_msg("cannot start a redis-server on %s", opts_bind);
  }
  char here[256], there[256], listen[64];
  sxt_redis_url(&rs, here, sizeof(here), "namespace=part");
  snprintf(there, sizeof(there), "redis://%s:%d?namespace=part", host_ip, rs.port);
  snprintf(listen, sizeof(listen), "%s:0", ns_ip);
  agent_proc p;
  /* A long lease: the segment must outlive the link being down. */
  agent_spawn(&p, "behind-veth", there, listen, 60000, 40, netns);
  snprintf(p.url, sizeof(p.url), "%s", here);
  agent_wait_published(&p, NULL, 20000);
  reader r;
  reader_start(&r, here);
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, p.name, 5000, &seg));
  uint16_t port = sxt_tcp_port(sx_segment_desc(seg));
  sx_block_read small = blocks_of(0, 8), big = blocks_of(0, 64);
  assert_int_equal(run_batch(seg, &big, 5000, NULL).state, SX_BATCH_COMPLETED);
  assert_int_equal(verify(&r, seg, 40, &big), 0);

  /* Every data packet lost: no error comes back, the deadline ends it. */
  assert_int_equal(impair_loss(100, port), 0);
  expect_timeout(seg, &r, &small, 700, "all data packets dropped");
  impair_clear();
  until_reads_work(seg, &r, 40, &small, "after total loss");

  /* Heavy random loss: each batch completes with the right bytes or ends
   * at its deadline; none hangs, none fails with garbage. */
  assert_int_equal(impair_loss(20, port), 0);
  int done = 0, timeouts = 0;
  for (int i = 0; i < 6; i++) {
    fill_dest(&r, 0xee);
    uint64_t took;
    sx_batch_result res = run_batch(seg, &small, 1000, &took);
    if (res.state == SX_BATCH_COMPLETED) {
      assert_int_equal(verify(&r, seg, 40, &small), 0);
      done++;
    } else if (res.state == SX_BATCH_TIMEOUT) {
      assert_true(took + 50 >= 1000 && took <= 1000 + 2000);
      timeouts++;
    } else {
      fail_msg("20%% loss: a batch ended %s (%s: %s)", sx_batch_state_name(res.state),
               sx_err_name(res.error), res.message);
    }
  }
  print_message("measured: 20%% loss: %d of 6 batches of 1 MiB completed (verified), %d "
                "ended at their 1000 ms deadline\n", done, timeouts);
  impair_clear();
  until_reads_work(seg, &r, 40, &small, "after random loss");

  /* A link far too slow for the batch. */
  assert_int_equal(impair_slow(), 0);
  expect_timeout(seg, &r, &big, 1000, have_netem ? "400 ms delay" : "200 kbit/s link");
  impair_clear();
  until_reads_work(seg, &r, 40, &small, "after the slow link");

  /* The link down (store traffic of the target too). */
  assert_int_equal(sh("ip link set %s down", veth_host), 0);
  expect_timeout(seg, &r, &small, 700, "link down");
  expect_timeout(seg, &r, &small, 700, "link still down");
  assert_int_equal(sh("ip link set %s up", veth_host), 0);
  until_reads_work(seg, &r, 40, &big, "after link down");

  sx_segment_close(seg);
  reader_stop(&r);
  assert_int_equal(agent_stop(&p, SIGTERM), 0);
  sxt_redis_stop(&rs);
  net_down();
}

/* ------------------------------------------------------------ readers */

/* Established TCP connections whose local port is port (/proc/net/tcp). */
static int established_on(uint16_t port) {
  FILE *f = fopen("/proc/net/tcp", "r");
  char line[512];
  int n = 0;
  if (f == NULL)
    return -1;
  while (fgets(line, sizeof(line), f)) {
    unsigned lport, st;
    if (sscanf(line, " %*d: %*x:%x %*x:%*x %x", &lport, &st) == 2 && lport == port &&
        st == 1)
      n++;
  }
  fclose(f);
  return n;
}

/* Open file descriptors of a process. */
static int fd_count(pid_t pid) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
  DIR *d = opendir(path);
  if (d == NULL)
    return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

static void test_fault_reader_killed_during_batches_target_frees_all(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  agent_proc p;
  agent_spawn(&p, "victim-target", env.url, NULL, 5000, 50, NULL);
  agent_wait_published(&p, NULL, 20000);
  sx_store *s;
  sxt_ok(sx_store_open(env.url, &s));
  sx_desc d;
  sxt_ok(sx_store_get(s, p.name, &d, NULL));
  sx_store_close(s);
  uint16_t port = sxt_tcp_port(&d);
  sx_desc_free(&d);
  int fds0 = fd_count(p.pid);
  long rss0 = sxt_rss_kib(p.pid);
  assert_int_equal(established_on(port), 0);
  for (int round = 0; round < 3; round++) {
    char exe[PATH_MAX + 16], log[300];
    snprintf(exe, sizeof(exe), "%s/sxctl", env.bindir);
    snprintf(log, sizeof(log), "%s/reader-%d.log", env.tmpdir, round);
    const char *argv[] = {exe, "--metadata", env.url, "read", p.name, "--blocks",
                          "random:100000", "--batch", "64", "--depth", "4", "--fingerprint",
                          "faults/v1", NULL};
    pid_t victim = sxt_spawn(log, argv);
    /* Killed while its connections are up and reads flow. */
    for (int i = 0; i < 1000 && established_on(port) < 1; i++)
      sxt_sleep_ms(10);
    assert_true(established_on(port) >= 1);
    sxt_sleep_ms(200);
    assert_int_equal(waitpid(victim, NULL, WNOHANG), 0); /* still reading */
    kill(victim, SIGKILL);
    assert_int_equal(sxt_reap(victim, 10000), 128 + SIGKILL);
    uint64_t t0 = sx__mono_ms();
    while ((established_on(port) > 0 || fd_count(p.pid) > fds0) && sx__mono_ms() - t0 < 10000)
      sxt_sleep_ms(10);
    print_message("measured: reader %d killed mid-batch: the target closed its "
                  "connections and freed their fds within %lu ms\n", round,
                  (unsigned long)(sx__mono_ms() - t0));
    assert_int_equal(established_on(port), 0);
    assert_int_equal(fd_count(p.pid), fds0);
  }
  long rss1 = sxt_rss_kib(p.pid);
  print_message("measured: target RSS %ld KiB before, %ld KiB after 3 killed readers\n",
                rss0, rss1);
  assert_true(rss1 < rss0 + 16 * 1024);
  /* And it serves the next reader. */
  reader r;
  reader_start(&r, env.url);
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, p.name, 5000, &seg));
  sx_block_read e = blocks_of(4, 12);
  assert_int_equal(run_batch(seg, &e, 5000, NULL).state, SX_BATCH_COMPLETED);
  assert_int_equal(verify(&r, seg, 50, &e), 0);
  sx_segment_close(seg);
  reader_stop(&r);
  /* Every connection it logged, it logged closed (the last ones a moment
   * after the reader went). */
  for (int i = 0; i < 500 && sxt_count_in_file(p.log, "connected from") !=
                                 sxt_count_in_file(p.log, "disconnected");
       i++)
    sxt_sleep_ms(10);
  assert_int_equal(sxt_count_in_file(p.log, "connected from"),
                   sxt_count_in_file(p.log, "disconnected"));
  assert_int_equal(agent_stop(&p, SIGTERM), 0);
}

/* ------------------------------------------------------------ setup */

static int group_setup(void **state) {
  (void)state;
  return sxt_proc_env_setup(&env, &(sxt_proc_env_opts){.test = "test_faults",
                                                       .tmp = "faults", .need = "sx-agent",
                                                       .ns = "faults", .notify = "Kx"});
}

static int group_teardown(void **state) {
  (void)state;
  net_down();
  return sxt_proc_env_teardown(&env);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fault_agent_sigkill_segment_gone_within_a_lease),
      cmocka_unit_test(test_fault_agent_stopped_past_lease_republishes),
      cmocka_unit_test(test_fault_agent_stopped_while_another_took_the_name_is_fenced),
      cmocka_unit_test(test_fault_store_restarted_empty_every_agent_republishes),
      cmocka_unit_test(test_fault_sentinel_failover_agents_follow),
      cmocka_unit_test(test_fault_sentinel_with_password_failover_agents_follow),
      cmocka_unit_test(test_fault_partition_loss_slow_link_down_then_heal),
      cmocka_unit_test(test_fault_reader_killed_during_batches_target_frees_all),
  };
  const char *filter = getenv("SXT_FILTER");
  if (filter != NULL)
    cmocka_set_test_filter(filter);
  return cmocka_run_group_tests_name("fault injection", tests, group_setup,
                                     group_teardown);
}
