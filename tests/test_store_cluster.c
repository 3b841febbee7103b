/*
 * Redis Cluster (redis+cluster://) against a real cluster on loopback: 3
 * masters and 3 replicas started here (tests/support/redis_cluster_harness.c:
 * redis-server --cluster-enabled yes, redis-cli --cluster create
 * --cluster-replicas 1).  The store suite shared by every backend runs
 * against one cluster; the tests below against another: a listing across
 * the index pieces on every master, events from every shard channel and
 * every master's expiries, a master killed and its replica promoted while
 * owners renew and watchers watch, slots resharded under load, and bad
 * input at connect (a node not in cluster mode, uncovered slots, an ACL
 * user without CLUSTER SHARDS and CLUSTER SLOTS).
 *
 * SXT_FILTER=test_cluster_* runs only the matching tests.  Timing checks
 * have wide margins: the machine is shared with other builds.
 */
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend_publisher.h"
#include "fake_rnode.h"
#include "internal.h"
#include "redis/redis.h"
#include "redis_cluster_harness.h"
#include "store_suite.h"
#include "sxtest.h"

static sxt_rcluster cl;
static int have_cluster;

static int suite_setup(void **state) {
  return sxt_suite_group_setup(state, &sxt_rcluster_fixture);
}

static int group_setup(void **state) {
  (void)state;
  sxt_redis_opts o = {.notify = "Kx"};
  int rc = sxt_rcluster_start(&cl, &o);
  if (rc == 1)
    fprintf(stderr, "test_store_cluster: redis-server or redis-cli is not installed "
            "(make deps): the cluster tests are skipped\n");
  have_cluster = rc == 0;
  return rc < 0 ? -1 : 0;
}

static int group_teardown(void **state) {
  (void)state;
  sxt_rcluster_stop(&cl);
  sxt_redis_stop_all();
  return 0;
}

#define NEED_CLUSTER()                                                         \
  do {                                                                         \
    if (!have_cluster)                                                         \
      skip();                                                                  \
  } while (0)

static void cl_url(const char *ns, const char *extra, char *buf, size_t size) {
  char q[256];
  snprintf(q, sizeof(q), "namespace=%s%s%s", ns, extra ? "&" : "", extra ? extra : "");
  sxt_rcluster_url(&cl, buf, size, q);
}

/* A segment owner: its name, incarnation, value and generation. */
typedef struct seg {
  char name[64];
  uint8_t inc[SX_INCARNATION_LEN];
  uint64_t gen;
  uint8_t *val;
  size_t len;
} seg;

static void seg_init(seg *s, const char *fmt, int i) {
  memset(s, 0, sizeof(*s));
  snprintf(s->name, sizeof(s->name), fmt, i);
  sxt_random_inc(s->inc);
  s->gen = 1;
  sxt_encoded_desc(s->name, s->inc, s->gen, &s->val, &s->len);
}

static int seg_publish(sxt_store *st, seg *s, uint32_t lease, sxt_reply *r) {
  sx_publish_req req = sxt_req(s->name, s->inc, s->gen, s->val, s->len, lease, 0);
  return sxt_publish(st, &req, r);
}

static unsigned seg_slot(const char *ns, const char *name) {
  char key[2048];
  snprintf(key, sizeof(key), "sx:%s:seg:{%s}", ns, name);
  return sx__rcl_key_slot(key, strlen(key));
}

/* Where keys really are: the slot a real node computes is ours. */
static void test_cluster_slots_match_the_server(void **state) {
  (void)state;
  NEED_CLUSTER();
  const char *keys[] = {"foo", "sx:t:seg:{a/b}", "sx:t:index:{7}", "x{}y", "{{a}}"};
  for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
    redisReply *r = sxt_redis_command(&cl.node[0], "CLUSTER KEYSLOT %s", keys[i]);
    assert_non_null(r);
    assert_int_equal(r->type, REDIS_REPLY_INTEGER);
    assert_int_equal(r->integer, sx__rcl_key_slot(keys[i], strlen(keys[i])));
    freeReplyObject(r);
  }
}

/* 48 segments over every master; the index is in pieces on several
 * masters; one listing returns them all with their values. */
static void test_cluster_listing_across_shards(void **state) {
  (void)state;
  NEED_CLUSTER();
  char url[512];
  cl_url("lst", NULL, url, sizeof(url));
  sxt_store st;
  sxt_ok(sxt_store_open(&st, url, 1));
  enum { N = 48 };
  seg s[N];
  sxt_reply r;
  int per_master[SXT_RCLUSTER_NODES] = {0};
  for (int i = 0; i < N; i++) {
    seg_init(&s[i], "lst/%d", i);
    assert_int_equal(seg_publish(&st, &s[i], 60000, &r), 0);
    sxt_reply_free(&r);
    int m = sxt_rcluster_master_of(&cl, seg_slot("lst", s[i].name));
    assert_true(m >= 0);
    per_master[m]++;
  }
  int masters = 0;
  for (int i = 0; i < SXT_RCLUSTER_NODES; i++)
    masters += per_master[i] > 0;
  assert_int_equal(masters, 3);
  /* The index pieces that hold names sit on more than one master. */
  int piece_master[SXT_RCLUSTER_NODES] = {0};
  for (unsigned k = 0; k < SX_RCL_SHARDS; k++) {
    redisReply *z = sxt_rcluster_command(&cl, "ZCARD sx:lst:index:{%u}", k);
    assert_non_null(z);
    assert_int_equal(z->type, REDIS_REPLY_INTEGER);
    if (z->integer > 0) {
      char key[64];
      snprintf(key, sizeof(key), "sx:lst:index:{%u}", k);
      piece_master[sxt_rcluster_master_of(&cl, sx__rcl_key_slot(key, strlen(key)))]++;
    }
    freeReplyObject(z);
  }
  masters = 0;
  for (int i = 0; i < SXT_RCLUSTER_NODES; i++)
    masters += piece_master[i] > 0;
  assert_true(masters >= 2);
  /* No single index key on a cluster. */
  redisReply *e = sxt_rcluster_command(&cl, "EXISTS sx:lst:index");
  assert_int_equal(e->integer, 0);
  freeReplyObject(e);

  assert_int_equal(sxt_list(&st, &r), 0);
  assert_int_equal(r.n_items, N);
  for (int i = 0; i < N; i++) {
    const sxt_item *it = sxt_reply_item(&r, s[i].name);
    assert_non_null(it);
    assert_int_equal(it->len, s[i].len);
    assert_memory_equal(it->value, s[i].val, s[i].len);
    assert_true(it->ttl_ms > 0);
  }
  sxt_reply_free(&r);
  /* Unpublished names leave the listing. */
  for (int i = 0; i < N; i += 2) {
    assert_int_equal(sxt_unpublish(&st, s[i].name, s[i].inc, &r), 0);
    sxt_reply_free(&r);
  }
  assert_int_equal(sxt_list(&st, &r), 0);
  assert_int_equal(r.n_items, N / 2);
  assert_null(sxt_reply_item(&r, s[0].name));
  assert_non_null(sxt_reply_item(&r, s[1].name));
  sxt_reply_free(&r);
  for (int i = 0; i < N; i++)
    free(s[i].val);
  sxt_store_close(&st);
}

/* Names whose shards cover all 16 channels: a watcher hears every put and
 * delete, and the expiry of a lease on every master. */
static void test_cluster_events_from_every_shard(void **state) {
  (void)state;
  NEED_CLUSTER();
  char url[512];
  cl_url("ev", NULL, url, sizeof(url));
  sxt_store p, w;
  sxt_ok(sxt_store_open(&p, url, 1));
  sxt_ok(sxt_store_open(&w, url, 1));
  assert_int_equal(sxt_store_watch(&w), 0);
  seg s[SX_RCL_SHARDS];
  int have[SX_RCL_SHARDS] = {0};
  int n = 0;
  for (int i = 0; n < SX_RCL_SHARDS && i < 10000; i++) {
    char name[64];
    snprintf(name, sizeof(name), "ev/%d", i);
    unsigned k = sx__rcl_shard_of(name);
    if (have[k])
      continue;
    have[k] = 1;
    seg_init(&s[n++], "ev/%d", i);
  }
  assert_int_equal(n, SX_RCL_SHARDS);
  sxt_reply r;
  for (int i = 0; i < n; i++) {
    assert_int_equal(seg_publish(&p, &s[i], 60000, &r), 0);
    sxt_reply_free(&r);
  }
  for (int i = 0; i < n; i++)
    if (sxt_store_take_event(&w, SX_EVENT_PUT, s[i].name, 10000, NULL) != 0)
      fail_msg("no put event for %s (shard %u)", s[i].name, sx__rcl_shard_of(s[i].name));
  for (int i = 0; i < n; i++) {
    assert_int_equal(sxt_unpublish(&p, s[i].name, s[i].inc, &r), 0);
    sxt_reply_free(&r);
  }
  for (int i = 0; i < n; i++)
    if (sxt_store_take_event(&w, SX_EVENT_DELETE, s[i].name, 10000, NULL) != 0)
      fail_msg("no delete event for %s", s[i].name);
  /* Each event once: sharded pub/sub delivers from one node. */
  for (int i = 0; i < n; i++) {
    assert_int_equal(sxt_store_count_events(&w, SX_EVENT_PUT, s[i].name), 1);
    assert_int_equal(sxt_store_count_events(&w, SX_EVENT_DELETE, s[i].name), 1);
  }
  /* Expiry on every master: short leases on names held by each. */
  int masters_seen[SXT_RCLUSTER_NODES] = {0};
  seg x[3];
  int nx = 0;
  for (int i = 0; nx < 3 && i < 10000; i++) {
    char name[64];
    snprintf(name, sizeof(name), "exp/%d", i);
    int m = sxt_rcluster_master_of(&cl, seg_slot("ev", name));
    if (m < 0 || masters_seen[m])
      continue;
    masters_seen[m] = 1;
    seg_init(&x[nx++], "exp/%d", i);
  }
  assert_int_equal(nx, 3);
  for (int i = 0; i < nx; i++) {
    assert_int_equal(seg_publish(&p, &x[i], 300, &r), 0);
    sxt_reply_free(&r);
  }
  for (int i = 0; i < nx; i++)
    if (sxt_store_take_event(&w, SX_EVENT_EXPIRED, x[i].name, 15000, NULL) != 0)
      fail_msg("no expiry event for %s", x[i].name);
  for (int i = 0; i < n; i++)
    free(s[i].val);
  for (int i = 0; i < nx; i++)
    free(x[i].val);
  sxt_store_close(&p);
  sxt_store_close(&w);
}


/* ------------------------------------------------- failover, resharding */

/* Renew (renew != 0, with lease) or get every segment at once and wait for
 * all the answers; the statuses go to st[] (a get that returns another
 * value than the segment's: SX_EDECODE). */
static void all_at_once(sxt_store *p, seg *s, int n, int renew, uint32_t lease, int *st) {
  sxt_reply r[64];
  sxt_reply *rp[64];
  memset(r, 0, sizeof(r));
  for (int i = 0; i < n; i++) {
    rp[i] = &r[i];
    int rc = renew ? sx__backend_renew(p->b, s[i].name, s[i].inc, lease, sxt_reply_cb, &r[i])
                   : sx__backend_get(p->b, s[i].name, sxt_reply_cb, &r[i]);
    if (rc != 0) {
      r[i].calls = 1;
      r[i].status = rc;
    }
  }
  assert_int_equal(sxt_stores_await(&p, 1, rp, (size_t)n, SXT_OP_DEADLINE_MS), 0);
  for (int i = 0; i < n; i++) {
    st[i] = r[i].status;
    if (!renew && st[i] == 0 &&
        (r[i].len != s[i].len || memcmp(r[i].value, s[i].val, s[i].len) != 0))
      st[i] = SX_EDECODE;
    sxt_reply_free(&r[i]);
  }
}

static void renew_all(sxt_store *p, seg *s, int n, uint32_t lease, int *st) {
  all_at_once(p, s, n, 1, lease, st);
}

static void get_all(sxt_store *p, seg *s, int n, int *st) { all_at_once(p, s, n, 0, 0, st); }

/* Pick names, one per shard channel (n == SX_RCL_SHARDS) or any. */
static void seg_pick_shards(seg *s, const char *fmt) {
  int have[SX_RCL_SHARDS] = {0}, n = 0;
  for (int i = 0; n < SX_RCL_SHARDS && i < 100000; i++) {
    char name[64];
    snprintf(name, sizeof(name), fmt, i);
    unsigned k = sx__rcl_shard_of(name);
    if (have[k])
      continue;
    have[k] = 1;
    seg_init(&s[n++], fmt, i);
  }
  assert_int_equal(n, SX_RCL_SHARDS);
}

/* Publish the next generation of every segment and take each put event. */
static void events_flow(sxt_store *p, sxt_store *w, seg *s, int n) {
  sxt_reply r;
  for (int i = 0; i < n; i++) {
    s[i].gen++;
    free(s[i].val);
    sxt_encoded_desc(s[i].name, s[i].inc, s[i].gen, &s[i].val, &s[i].len);
    assert_int_equal(seg_publish(p, &s[i], 5000, &r), 0);
    sxt_reply_free(&r);
  }
  for (int i = 0; i < n; i++)
    if (sxt_store_take_event(w, SX_EVENT_PUT, s[i].name, 10000, NULL) != 0)
      fail_msg("no put event for %s (shard %u) after the change", s[i].name,
               sx__rcl_shard_of(s[i].name));
}

/* The master of the most segments is SIGKILLed; its replica takes over.
 * Owners renewing every 500 ms never lose a lease (5 s), every segment is
 * readable again, and the watcher gets events from every shard again. */
static void test_cluster_master_failover(void **state) {
  (void)state;
  NEED_CLUSTER();
  char url[512];
  cl_url("fo", "timeout_ms=1000&connect_timeout_ms=1000", url, sizeof(url));
  sxt_store p, w;
  sxt_ok(sxt_store_open(&p, url, 1));
  sxt_ok(sxt_store_open(&w, url, 1));
  assert_int_equal(sxt_store_watch(&w), 0);
  seg s[SX_RCL_SHARDS];
  seg_pick_shards(s, "fo/%d");
  const int n = SX_RCL_SHARDS;
  const uint32_t lease = 5000;
  sxt_reply r;
  for (int i = 0; i < n; i++) {
    assert_int_equal(seg_publish(&p, &s[i], lease, &r), 0);
    sxt_reply_free(&r);
  }
  int on[SXT_RCLUSTER_NODES] = {0}, victim = 0;
  for (int i = 0; i < n; i++)
    on[sxt_rcluster_master_of(&cl, seg_slot("fo", s[i].name))]++;
  for (int i = 1; i < SXT_RCLUSTER_NODES; i++)
    if (on[i] > on[victim])
      victim = i;
  assert_true(on[victim] > 0);
  int watches = w.n_watch;
  uint64_t last_ok[SX_RCL_SHARDS], t0 = sx__mono_ms(), worst = 0;
  for (int i = 0; i < n; i++)
    last_ok[i] = t0;
  sxt_redis_kill(&cl.node[victim], SIGKILL);
  fprintf(stderr, "killed master on port %d (serving %d of %d segments)\n",
          cl.node[victim].port, on[victim], n);
  int st[SX_RCL_SHARDS], all_ok_since = 0, failures = 0;
  while (sx__mono_ms() - t0 < 30000) {
    renew_all(&p, s, n, lease, st);
    uint64_t now = sx__mono_ms();
    int ok = 1;
    for (int i = 0; i < n; i++) {
      if (st[i] == SX_EGONE || st[i] == SX_EFENCED)
        fail_msg("%s: lease lost during the failover (%s)", s[i].name, sx_err_name(st[i]));
      if (st[i] == 0) {
        if (now - last_ok[i] > worst)
          worst = now - last_ok[i];
        last_ok[i] = now;
      } else {
        ok = 0;
        failures++;
      }
    }
    all_ok_since = ok ? all_ok_since + 1 : 0;
    if (all_ok_since >= 3)
      break;
    sxt_store_run_for(&w, 500);
  }
  fprintf(stderr, "renewals back for all after %llu ms; longest gap %llu ms, %d failed "
          "renewals\n", (unsigned long long)(sx__mono_ms() - t0),
          (unsigned long long)worst, failures);
  assert_true(all_ok_since >= 3);
  assert_true(worst < lease);
  get_all(&p, s, n, st);
  for (int i = 0; i < n; i++)
    if (st[i] != 0)
      fail_msg("%s unreadable after the failover: %s", s[i].name, sx_err_name(st[i]));
  /* The watcher subscribed again where the channels now live. */
  assert_int_equal(sxt_store_wait_watch(&w, watches + 1, 20000), 0);
  events_flow(&p, &w, s, n);
  for (int i = 0; i < n; i++)
    free(s[i].val);
  sxt_store_close(&p);
  sxt_store_close(&w);
  /* The old master comes back as a replica, for the tests after this. */
  assert_int_equal(sxt_redis_restart_keep(&cl.node[victim]), 0);
  assert_int_equal(sxt_rcluster_wait_ok(&cl, 30000), 0);
}

/* redis-cli --cluster reshard moves 4000 slots, keys and all, from one
 * master to another while owners publish, renew and readers resolve: every
 * op succeeds (through ASK and MOVED), nothing is lost, no event twice. */
static void test_cluster_reshard_under_load(void **state) {
  (void)state;
  NEED_CLUSTER();
  assert_int_equal(sxt_rcluster_wait_ok(&cl, 30000), 0);
  char url[512];
  cl_url("rs", "timeout_ms=3000", url, sizeof(url));
  sxt_store p, w;
  sxt_ok(sxt_store_open(&p, url, 1));
  sxt_ok(sxt_store_open(&w, url, 1));
  assert_int_equal(sxt_store_watch(&w), 0);
  enum { N = 32, NEW = 48 };
  seg s[N], fresh[NEW];
  sxt_reply r;
  for (int i = 0; i < N; i++) {
    seg_init(&s[i], "rs/%d", i);
    assert_int_equal(seg_publish(&p, &s[i], 10000, &r), 0);
    sxt_reply_free(&r);
  }
  /* From the master of slot 0 to the master of slot 16383. */
  int from = sxt_rcluster_master_of(&cl, 0), to = sxt_rcluster_master_of(&cl, 16383);
  assert_true(from >= 0 && to >= 0 && from != to);
  char from_id[41], to_id[41], seed[32];
  assert_int_equal(sxt_rcluster_node_id(&cl, from, from_id), 0);
  assert_int_equal(sxt_rcluster_node_id(&cl, to, to_id), 0);
  snprintf(seed, sizeof(seed), "127.0.0.1:%d", cl.node[from].port);
  const char *args[] = {"--cluster", "reshard", seed, "--cluster-from", from_id,
                        "--cluster-to", to_id, "--cluster-slots", "4000",
                        "--cluster-yes", "--cluster-pipeline", "4", NULL};
  pid_t cli = sxt_rcluster_cli_spawn(&cl, args);
  assert_true(cli > 0);
  int st[N], rounds = 0, done = 0, n_new = 0, exit_code = -1;
  uint64_t t0 = sx__mono_ms();
  while (!done || rounds < 3) {
    renew_all(&p, s, N, 10000, st);
    for (int i = 0; i < N; i++)
      if (st[i] != 0)
        fail_msg("renew %s during resharding: %s", s[i].name, sx_err_name(st[i]));
    get_all(&p, s, N, st);
    for (int i = 0; i < N; i++)
      if (st[i] != 0)
        fail_msg("get %s during resharding: %s", s[i].name, sx_err_name(st[i]));
    if (n_new < NEW) {
      seg_init(&fresh[n_new], "rs-new/%d", n_new);
      int rc = seg_publish(&p, &fresh[n_new], 10000, &r);
      if (rc != 0)
        fail_msg("publish %s during resharding: %s (%s)", fresh[n_new].name,
                 sx_err_name(rc), r.message);
      sxt_reply_free(&r);
      n_new++;
    }
    rounds += done;
    /* The watcher runs as an agent's loop would, beside the others. */
    sxt_store_run_for(&w, 5);
    int wst;
    if (!done && waitpid(cli, &wst, WNOHANG) == cli) {
      done = 1;
      exit_code = WIFEXITED(wst) ? WEXITSTATUS(wst) : -1;
    }
    if (sx__mono_ms() - t0 > 90000)
      fail_msg("resharding did not end within 90 s");
  }
  fprintf(stderr, "resharding took %llu ms; %d publishes, %d renew+get rounds of %d\n",
          (unsigned long long)(sx__mono_ms() - t0), n_new, rounds, N);
  assert_int_equal(exit_code, 0);
  /* The slots did move, and the ops followed them. */
  assert_int_equal(sxt_rcluster_master_of(&cl, 0), to);
  const redis_backend *rb = (const redis_backend *)p.b;
  fprintf(stderr, "client: %llu MOVED, %llu ASK, %llu TRYAGAIN/CLUSTERDOWN, %llu map reads\n",
          (unsigned long long)rb->cl_moved, (unsigned long long)rb->cl_asked,
          (unsigned long long)rb->cl_retried, (unsigned long long)rb->cl_refreshes);
  assert_true(rb->cl_moved > 0);
  /* Nothing lost, each listed once, each new one announced once. */
  assert_int_equal(sxt_list(&p, &r), 0);
  assert_int_equal(r.n_items, N + n_new);
  for (size_t i = 0; i < r.n_items; i++)
    for (size_t j = i + 1; j < r.n_items; j++)
      assert_string_not_equal(r.items[i].name, r.items[j].name);
  sxt_reply_free(&r);
  /* A shard channel whose slot moved was dropped by its old master
   * (sunsubscribe) and subscribed again at the new one: an event published
   * in between is not delivered (Redis keeps no backlog), and on_watch is
   * reported again so that caches drop what they hold.  Every other event
   * arrives, and none twice. */
  int moved[SX_RCL_SHARDS] = {0}, any_moved = 0, missed = 0;
  for (unsigned k = 0; k < SX_RCL_SHARDS; k++) {
    char ch[64];
    snprintf(ch, sizeof(ch), "sx:rs:events:{%u}", k);
    unsigned sl = sx__rcl_key_slot(ch, strlen(ch));
    moved[k] = sxt_rcluster_master_of(&cl, sl) == to && sl < 4000;
    any_moved |= moved[k];
  }
  for (int i = 0; i < n_new; i++) {
    if (sxt_store_take_event(&w, SX_EVENT_PUT, fresh[i].name, moved[sx__rcl_shard_of(
                                 fresh[i].name)] ? 500 : 10000, NULL) != 0) {
      if (!moved[sx__rcl_shard_of(fresh[i].name)])
        fail_msg("no put event for %s (its channel did not move)", fresh[i].name);
      missed++;
    }
    assert_true(sxt_store_count_events(&w, SX_EVENT_PUT, fresh[i].name) <= 1);
  }
  fprintf(stderr, "%d of %d put events missed, all on channels whose slot moved\n",
          missed, n_new);
  if (any_moved)
    assert_true(w.n_watch >= 2);
  for (int i = 0; i < N; i++)
    free(s[i].val);
  for (int i = 0; i < n_new; i++)
    free(fresh[i].val);
  sxt_store_close(&p);
  sxt_store_close(&w);
}


/* Run one command on node i and check it did not fail. */
static void node_ok_cmd(int i, const char *fmt, ...) {
  redisContext *c = sxt_redis_connect(&cl.node[i]);
  assert_non_null(c);
  va_list ap;
  va_start(ap, fmt);
  redisReply *r = redisvCommand(c, fmt, ap);
  va_end(ap);
  redisFree(c);
  if (r == NULL || r->type == REDIS_REPLY_ERROR)
    fail_msg("node %d: '%s' failed: %s", i, fmt, r ? r->str : "no reply");
  freeReplyObject(r);
}

/* One slot migrated by hand, as redis-cli does it.  While it is MIGRATING,
 * a read of a key already moved is answered with ASK, which the client
 * follows (ASKING, once); a script (two keys, one of them absent: the fence
 * set) is answered with TRYAGAIN until the slot is assigned, and the client
 * retries it within its timeout; once the slot is assigned, MOVED. */
static void test_cluster_ask_during_slot_migration(void **state) {
  (void)state;
  NEED_CLUSTER();
  assert_int_equal(sxt_rcluster_wait_ok(&cl, 30000), 0);
  char url[512];
  cl_url("ask", "timeout_ms=15000", url, sizeof(url));
  sxt_store p;
  sxt_ok(sxt_store_open(&p, url, 1));
  seg a, b;
  seg_init(&a, "ask/%d", 0);
  unsigned slot = seg_slot("ask", a.name);
  int i;
  for (i = 1; i < 1000000; i++) {
    char name[64];
    snprintf(name, sizeof(name), "ask/%d", i);
    if (seg_slot("ask", name) == slot)
      break;
  }
  seg_init(&b, "ask/%d", i);
  assert_int_equal(seg_slot("ask", b.name), slot);
  sxt_reply r;
  assert_int_equal(seg_publish(&p, &a, 60000, &r), 0);
  sxt_reply_free(&r);
  int src = sxt_rcluster_master_of(&cl, slot), dst = -1;
  for (int k = 0; k < 3 && dst < 0; k++) {
    int m = sxt_rcluster_master_of(&cl, k == 0 ? 0 : k == 1 ? 8000 : 16383);
    if (m >= 0 && m != src)
      dst = m;
  }
  assert_true(src >= 0 && dst >= 0);
  char src_id[41], dst_id[41];
  assert_int_equal(sxt_rcluster_node_id(&cl, src, src_id), 0);
  assert_int_equal(sxt_rcluster_node_id(&cl, dst, dst_id), 0);
  node_ok_cmd(dst, "CLUSTER SETSLOT %u IMPORTING %s", slot, src_id);
  node_ok_cmd(src, "CLUSTER SETSLOT %u MIGRATING %s", slot, dst_id);
  node_ok_cmd(src, "MIGRATE 127.0.0.1 %d %s 0 5000 KEYS sx:ask:seg:{%s}",
              cl.node[dst].port, "", a.name);
  const redis_backend *rb = (const redis_backend *)p.b;
  uint64_t asked = rb->cl_asked, retried = rb->cl_retried;
  /* Moved already: read on the target. */
  assert_int_equal(sxt_get(&p, a.name, &r), 0);
  assert_memory_equal(r.value, a.val, a.len);
  sxt_reply_free(&r);
  assert_true(rb->cl_asked >= asked + 2); /* HMGET and PTTL */
  /* Scripts wait while the slot is half moved. */
  sxt_reply rr, rp;
  memset(&rr, 0, sizeof(rr));
  memset(&rp, 0, sizeof(rp));
  sx_publish_req req = sxt_req(b.name, b.inc, b.gen, b.val, b.len, 60000, 0);
  sxt_ok(sx__backend_renew(p.b, a.name, a.inc, 60000, sxt_reply_cb, &rr));
  sxt_ok(sx__backend_publish(p.b, &req, sxt_reply_cb, &rp));
  sxt_store_run_for(&p, 500);
  assert_int_equal(rr.calls + rp.calls, 0);
  assert_true(rb->cl_retried > retried);
  /* The slot now belongs to the target everywhere: they go through. */
  uint64_t moved = rb->cl_moved, refreshes = rb->cl_refreshes;
  node_ok_cmd(dst, "CLUSTER SETSLOT %u NODE %s", slot, dst_id);
  node_ok_cmd(src, "CLUSTER SETSLOT %u NODE %s", slot, dst_id);
  sxt_reply *both[] = {&rr, &rp};
  sxt_store *ps = &p;
  assert_int_equal(sxt_stores_await(&ps, 1, both, 2, SXT_OP_DEADLINE_MS), 0);
  if (rr.status || rp.status)
    fail_msg("renew: %s (%s); publish: %s (%s)", sx_err_name(rr.status), rr.message,
             sx_err_name(rp.status), rp.message);
  sxt_reply_free(&rr);
  sxt_reply_free(&rp);
  /* Through MOVED, or a map read after TRYAGAIN that saw the change. */
  assert_true(rb->cl_moved > moved || rb->cl_refreshes > refreshes);
  redisReply *ex = sxt_redis_command(&cl.node[dst], "EXISTS sx:ask:seg:{%s}", b.name);
  assert_non_null(ex);
  assert_int_equal(ex->integer, 1);
  freeReplyObject(ex);
  assert_int_equal(sxt_get(&p, b.name, &r), 0);
  assert_memory_equal(r.value, b.val, b.len);
  sxt_reply_free(&r);
  assert_int_equal(sxt_list(&p, &r), 0);
  assert_int_equal(r.n_items, 2);
  sxt_reply_free(&r);
  free(a.val);
  free(b.val);
  sxt_store_close(&p);
  assert_int_equal(sxt_rcluster_wait_ok(&cl, 30000), 0);
}



/* A master stops answering; the op that times out first closes the
 * backend from its callback while its own command and another op's are
 * still outstanding on that master.  Both ops end once (the other one
 * cancelled), and nothing is touched after it was freed (this crashed
 * sx-bench, and fails under the sanitizers without the fix). */
static void test_cluster_close_from_a_timed_out_op(void **state) {
  (void)state;
  NEED_CLUSTER();
  assert_int_equal(sxt_rcluster_wait_ok(&cl, 30000), 0);
  char url[512];
  cl_url("cl", "timeout_ms=300", url, sizeof(url));
  sxt_store s;
  sxt_ok(sxt_store_open(&s, url, 1));
  int m = sxt_rcluster_master_of(&cl, seg_slot("cl", "stuck/0"));
  assert_true(m >= 0);
  sxt_redis_kill(&cl.node[m], SIGSTOP);
  sxt_store_close_from_timed_out_op(&s, "stuck/0");
  sxt_redis_kill(&cl.node[m], SIGCONT);
  assert_int_equal(sxt_rcluster_wait_ok(&cl, 30000), 0);
}

/* An op's callback closes the backend while the master's connection is
 * inside its own reply callback, another op outstanding on it: hiredis
 * frees the connection after the callback returns and then calls its
 * disconnect callback, which read the node from the client state that the
 * close had freed (found by sx-bench's fleet under the sanitizers; fails
 * under them without the fix). */
static void test_cluster_close_from_a_reply(void **state) {
  (void)state;
  NEED_CLUSTER();
  assert_int_equal(sxt_rcluster_wait_ok(&cl, 30000), 0);
  char url[512];
  cl_url("clr", NULL, url, sizeof(url));
  sxt_store s;
  sxt_ok(sxt_store_open(&s, url, 1));
  sxt_store_close_from_reply(&s, "absent/0");
}

/* Opening must fail with this status and a message containing want. */
static void open_fails(const char *url, int status, const char *want) {
  sx_store *s = NULL;
  int rc = sx_store_open(url, &s);
  if (rc == 0) {
    sx_store_close(s);
    fail_msg("%s opened", url);
  }
  if (rc != status || strstr(sx_errmsg(), want) == NULL)
    fail_msg("open %s: %s (%s), wanted %s with '%s'", url, sx_err_name(rc), sx_errmsg(),
             sx_err_name(status), want);
}

static void test_cluster_bad_input_at_connect(void **state) {
  (void)state;
  NEED_CLUSTER();
  char url[512];
  /* A plain server, not in cluster mode. */
  sxt_redis plain;
  assert_int_equal(sxt_redis_start(&plain, NULL), 0);
  snprintf(url, sizeof(url), "redis+cluster://127.0.0.1:%d?connect_timeout_ms=2000",
           plain.port);
  open_fails(url, SX_ESTORE, "not a cluster node");
  sxt_redis_stop(&plain);

  /* A cluster node that serves no slot: the cluster is not whole. */
  sxt_redis lone;
  sxt_redis_opts lo = {.cluster = 1};
  assert_int_equal(sxt_redis_start(&lone, &lo), 0);
  snprintf(url, sizeof(url), "redis+cluster://127.0.0.1:%d?connect_timeout_ms=2000",
           lone.port);
  open_fails(url, SX_ESTORE, "16384 of 16384 hash slots have no master");
  /* Slots 0-99 only. */
  redisReply *r = sxt_redis_command(&lone, "CLUSTER ADDSLOTSRANGE 0 99");
  assert_non_null(r);
  assert_int_not_equal(r->type, REDIS_REPLY_ERROR);
  freeReplyObject(r);
  open_fails(url, SX_ESTORE, "first gap: 100-16383");

  /* An ACL user without CLUSTER SHARDS and CLUSTER SLOTS. */
  r = sxt_redis_command(&lone, "ACL SETUSER noslots on >pw ~* &* +@all -cluster|slots "
                        "-cluster|shards");
  assert_non_null(r);
  assert_int_not_equal(r->type, REDIS_REPLY_ERROR);
  freeReplyObject(r);
  snprintf(url, sizeof(url), "redis+cluster://noslots:pw@127.0.0.1:%d?connect_timeout_ms="
           "2000", lone.port);
  open_fails(url, SX_EAUTH, "needs +cluster|shards or +cluster|slots");
  /* A wrong password. */
  snprintf(url, sizeof(url), "redis+cluster://noslots:nope@127.0.0.1:%d?connect_timeout_ms="
           "2000", lone.port);
  open_fails(url, SX_EAUTH, "authentication as 'noslots' failed");
  sxt_redis_stop(&lone);

  /* A user who may not run CLUSTER SHARDS: the map comes from CLUSTER
   * SLOTS, and the store works. */
  for (int i = 0; i < SXT_RCLUSTER_NODES; i++) {
    r = sxt_redis_command(&cl.node[i], "ACL SETUSER noshards on >pw ~* &* +@all "
                          "-cluster|shards");
    assert_non_null(r);
    assert_int_not_equal(r->type, REDIS_REPLY_ERROR);
    freeReplyObject(r);
  }
  char seeds[256];
  snprintf(seeds, sizeof(seeds), "redis+cluster://noshards:pw@127.0.0.1:%d,127.0.0.1:%d"
           "?namespace=nosh", cl.node[0].port, cl.node[1].port);
  sx_store *ok;
  sxt_ok(sx_store_open(seeds, &ok));
  sx_desc d;
  sxt_desc_make(&d, "nosh/0", 0x21, 1, 60000);
  sxt_ok(sx_store_publish(ok, &d, 0));
  sx_desc got;
  sxt_ok(sx_store_get(ok, "nosh/0", &got, NULL));
  assert_int_equal(got.generation, 1);
  sx_desc_free(&got);
  sx_desc_free(&d);
  sx_store_close(ok);

  /* No seed answers. */
  snprintf(url, sizeof(url), "redis+cluster://127.0.0.1:%d,127.0.0.1:%d?connect_timeout_ms="
           "1000", sxt_free_port(), sxt_free_port());
  open_fails(url, SX_EUNREACH, "no cluster node gave the slot map");
}

/* What a hostile or broken node answers for the slot map at connect (fake
 * nodes): not a map, a slot out of range, no slots, a master nothing
 * listens at, an error for CLUSTER SHARDS and garbage for CLUSTER SLOTS.
 * Each open fails within its connect timeout with the status and a
 * message that says what was wrong. */
static void test_cluster_hostile_maps(void **state) {
  (void)state;
  static const struct {
    const char *shards, *answer;
    int status;
    const char *want;
  } cases[] = {
      {":5\r\n", "+OK\r\n", SX_EUNREACH, "CLUSTER SHARDS answered"},
      {"*1\r\n*4\r\n$5\r\nslots\r\n*2\r\n:0\r\n:99999\r\n$5\r\nnodes\r\n*1\r\n*8\r\n"
       "$4\r\nport\r\n:1\r\n$2\r\nip\r\n$9\r\n127.0.0.1\r\n$4\r\nrole\r\n$6\r\nmaster\r\n"
       "$6\r\nhealth\r\n$6\r\nonline\r\n",
       "+OK\r\n", SX_EUNREACH, "bad slot range"},
      {"*1\r\n*2\r\n$5\r\nslots\r\n*3\r\n:0\r\n:1\r\n:2\r\n", "+OK\r\n", SX_EUNREACH,
       "shard 0 is malformed"},
      {"*0\r\n", "+OK\r\n", SX_ESTORE, "16384 of 16384 hash slots have no master"},
      {"*1\r\n*4\r\n$5\r\nslots\r\n*2\r\n:0\r\n:16383\r\n$5\r\nnodes\r\n*1\r\n*8\r\n"
       "$4\r\nport\r\n:1\r\n$2\r\nip\r\n$9\r\n127.0.0.1\r\n$4\r\nrole\r\n$6\r\nmaster\r\n"
       "$6\r\nhealth\r\n$6\r\nonline\r\n",
       "+OK\r\n", SX_EUNREACH, "cluster node 127.0.0.1:1"},
      {"-ERR unknown subcommand 'SHARDS'\r\n", "*1\r\n:7\r\n", SX_EUNREACH,
       "CLUSTER SLOTS: range 0 is malformed"},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    sxt_fake_rnodes f;
    sxt_fake_rnodes_start(&f, cases[i].answer);
    f.node[0].shards = f.node[1].shards = cases[i].shards;
    char url[256];
    snprintf(url, sizeof(url), "redis+cluster://127.0.0.1:%d?connect_timeout_ms=1000",
             f.node[0].port);
    uint64_t t0 = sx__mono_ms();
    open_fails(url, cases[i].status, cases[i].want);
    uint64_t took = sx__mono_ms() - t0;
    if (took > 4000)
      fail_msg("map %zu: the open took %lu ms", i, (unsigned long)took);
    sxt_fake_rnodes_stop(&f);
  }
}

/* What a hostile or broken node answers a command (fake nodes, no
 * redis-server): MOVED to a node the map does not name, MOVED for a slot
 * that is not the key's, MOVED to an address that does not parse, ASK
 * back and forth between two nodes, a plain error.  Each get ends within
 * its timeout with the status and a message that says what happened; the
 * second node (in no map) is sent nothing on a MOVED's word: the client
 * reads the map again instead (which names the first node only). */
static void test_cluster_hostile_redirects(void **state) {
  (void)state;
  static const struct {
    const char *answer;
    int status;
    const char *want;
    int other_asked; /* may the second node get commands? */
  } cases[] = {
      {"-MOVED %s 127.0.0.1:%p\r\n", SX_ESTORE, "still redirected after", 0},
      {"-MOVED 0 127.0.0.1:%p\r\n", SX_ESTORE, "answered MOVED for slot 0, but the key is "
       "in slot", 0},
      {"-MOVED 16384 127.0.0.1:%p\r\n", SX_ESTORE, "MOVED 16384", 0},
      {"-MOVED 0 nohostnoport\r\n", SX_ESTORE, "MOVED 0 nohostnoport", 0},
      {"-MOVED 0 127.0.0.1:0\r\n", SX_ESTORE, "MOVED 0 127.0.0.1:0", 0},
      {"-ASK 0 127.0.0.1:%p\r\n", SX_ESTORE, "answered ASK for slot 0, but the key is in "
       "slot", 0},
      {"-ASK %s 127.0.0.1:%p\r\n", SX_ESTORE, "still redirected after", 1},
      {"-ERR something else went wrong\r\n", SX_ESTORE, "something else went wrong", 0},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    sxt_fake_rnodes f;
    sxt_fake_rnodes_start(&f, cases[i].answer);
    char url[256];
    snprintf(url, sizeof(url), "redis+cluster://127.0.0.1:%d?connect_timeout_ms=2000&"
             "timeout_ms=3000", f.node[0].port);
    sx_store *s = NULL;
    sxt_ok(sx_store_open(url, &s));
    sx_desc d;
    uint64_t t0 = sx__mono_ms();
    int rc = sx_store_get(s, "seg/0", &d, NULL);
    uint64_t took = sx__mono_ms() - t0;
    if (rc != cases[i].status || strstr(sx_errmsg(), cases[i].want) == NULL)
      fail_msg("answer %s: %s (%s), wanted %s with '%s'", cases[i].answer, sx_err_name(rc),
               sx_errmsg(), sx_err_name(cases[i].status), cases[i].want);
    if (took > 2500)
      fail_msg("answer %s: the get took %lu ms", cases[i].answer, (unsigned long)took);
    int other = atomic_load(&f.node[1].others);
    if (!cases[i].other_asked && other != 0)
      fail_msg("answer %s: the node no map names was sent %d commands", cases[i].answer,
               other);
    if (cases[i].other_asked && other == 0)
      fail_msg("answer %s: ASK did not reach the node it names", cases[i].answer);
    sx_store_close(s);
    sxt_fake_rnodes_stop(&f);
  }
}

int main(void) {
  const struct CMUnitTest suite[] = {SXT_STORE_SUITE};
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cluster_slots_match_the_server),
      cmocka_unit_test(test_cluster_listing_across_shards),
      cmocka_unit_test(test_cluster_events_from_every_shard),
      cmocka_unit_test(test_cluster_bad_input_at_connect),
      cmocka_unit_test(test_cluster_hostile_redirects),
      cmocka_unit_test(test_cluster_hostile_maps),
      cmocka_unit_test(test_cluster_ask_during_slot_migration),
      cmocka_unit_test(test_cluster_close_from_a_timed_out_op),
      cmocka_unit_test(test_cluster_close_from_a_reply),
      cmocka_unit_test(test_cluster_master_failover),
      cmocka_unit_test(test_cluster_reshard_under_load),
  };
  const char *filter = getenv("SXT_FILTER");
  if (filter && *filter)
    cmocka_set_test_filter(filter);
  int rc = cmocka_run_group_tests_name("store/redis-cluster", suite, suite_setup,
                                       sxt_suite_group_teardown);
  rc |= cmocka_run_group_tests_name("cluster", tests, group_setup, group_teardown);
  return rc;
}
