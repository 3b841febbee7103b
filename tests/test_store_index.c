/*
 * The Redis listing index under renewals (issue 24): a renewal writes its
 * index entry only when the renew script says it is due (the segment's
 * field ix older than the URL's index_refresh_ms), so that a renewal is one
 * command, not two on two masters of a cluster.  Against a real
 * redis-server and a real 3-master cluster: index writes counted with INFO
 * commandstats stay at one per interval per segment (and at one per renewal
 * with index_refresh_ms=0 or a lease not shorter than the interval); an
 * entry deleted by hand, or from a value without ix, is back within one
 * interval; a failed index write, and a reconnect, make the next renewal
 * write its entry, not the one an interval later; listing across the
 * cluster's index pieces stays complete.
 *
 * SXT_FILTER=test_index_* runs only the matching tests.  Timing checks have
 * wide margins: the machine is shared with other builds.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend_publisher.h"
#include "internal.h"
#include "redis/redis.h"
#include "redis_cluster_harness.h"
#include "store_fixture.h"
#include "sxtest.h"

/* The refresh interval the tests run with, and a lease shorter than it
 * (else every renewal writes), long enough for a loaded machine's stalls. */
#define IVL 1000
#define IVL_Q "index_refresh_ms=1000"
#define LEASE 900

static sxt_redis srv;
static int have_redis;
static sxt_rcluster cl;
static int have_cluster;

static uint64_t mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void sleep_ms(unsigned ms) { usleep(ms * 1000u); }

/* Calls of cmd so far on one server (INFO commandstats), 0 when none. */
static long long calls_of(redisReply *info, const char *cmd) {
  assert_non_null(info);
  assert_int_equal(info->type, REDIS_REPLY_STRING);
  char pat[64];
  snprintf(pat, sizeof(pat), "cmdstat_%s:calls=", cmd);
  const char *p = strstr(info->str, pat);
  return p ? atoll(p + strlen(pat)) : 0;
}

static long long zadds_single(void) {
  redisReply *r = sxt_redis_command(&srv, "INFO commandstats");
  long long n = calls_of(r, "zadd");
  freeReplyObject(r);
  return n;
}

/* The cluster's masters' ZADD and EVALSHA calls, summed (replicas apply
 * the scripts' effects, not the scripts, and are left out). */
static void cluster_calls(long long *zadd, long long *evalsha) {
  *zadd = *evalsha = 0;
  for (int i = 0; i < SXT_RCLUSTER_NODES; i++) {
    redisReply *role = sxt_redis_command(&cl.node[i], "ROLE");
    assert_non_null(role);
    int master = role->type == REDIS_REPLY_ARRAY && role->elements > 0 &&
                 strcmp(role->element[0]->str, "master") == 0;
    freeReplyObject(role);
    if (!master)
      continue;
    redisReply *r = sxt_redis_command(&cl.node[i], "INFO commandstats");
    *zadd += calls_of(r, "zadd");
    *evalsha += calls_of(r, "evalsha");
    freeReplyObject(r);
  }
}

static sx_store *open_single(const char *ns, const char *extra) {
  char q[160], url[320];
  snprintf(q, sizeof(q), "namespace=%s%s%s", ns, extra ? "&" : "", extra ? extra : "");
  sxt_redis_url(&srv, url, sizeof(url), q);
  sx_store *s = NULL;
  sxt_ok(sx_store_open(url, &s));
  return s;
}

static sx_store *open_cluster(const char *ns, const char *extra) {
  char q[160], url[512];
  snprintf(q, sizeof(q), "namespace=%s%s%s", ns, extra ? "&" : "", extra ? extra : "");
  sxt_rcluster_url(&cl, url, sizeof(url), q);
  sx_store *s = NULL;
  sxt_ok(sx_store_open(url, &s));
  return s;
}

/* Is name in the listing? */
static int listed(sx_store *s, const char *name) {
  sx_store_entry *e = NULL;
  size_t n = 0;
  sxt_ok(sx_store_list(s, &e, &n));
  int found = 0;
  for (size_t i = 0; i < n; i++)
    found |= strcmp(e[i].name, name) == 0 && e[i].status == 0;
  sx_store_entries_free(e, n);
  return found;
}

/* Run a command with one string argument on the single server: its
 * integer reply, or -1 for any other reply. */
static long long srv_do(const char *fmt, const char *arg) {
  redisReply *r = sxt_redis_command(&srv, fmt, arg);
  assert_non_null(r);
  long long v = r->type == REDIS_REPLY_INTEGER ? r->integer : -1;
  freeReplyObject(r);
  return v;
}

static int in_index(const char *key, const char *name) {
  redisReply *r = sxt_redis_command(&srv, "ZSCORE %s %s", key, name);
  assert_non_null(r);
  int in = r->type == REDIS_REPLY_STRING;
  freeReplyObject(r);
  return in;
}

/* Renew d every 50 ms for ms milliseconds; the number of renewals. */
static int renew_for(sx_store *s, const sx_desc *d, uint32_t lease, unsigned ms) {
  int n = 0;
  for (uint64_t end = mono_ms() + ms; mono_ms() < end; n++) {
    sxt_ok(sx_store_renew(s, d->name, d->incarnation, lease));
    sleep_ms(50);
  }
  return n;
}

/* ------------------------------------------------------------ one server */

static void test_index_written_once_per_interval(void **state) {
  (void)state;
  if (!have_redis)
    skip();
  /* A lease shorter than the interval: renewals every 50 ms write the
   * entry about once an interval. */
  sx_store *s = open_single("ix1", IVL_Q);
  sx_desc d;
  sxt_desc_make(&d, "ix1/a", 0x21, 1, LEASE);
  long long z0 = zadds_single();
  sxt_ok(sx_store_publish(s, &d, 0));
  assert_int_equal(zadds_single() - z0, 1); /* publish always writes it */
  z0 = zadds_single();
  uint64_t t0 = mono_ms();
  int n = renew_for(s, &d, LEASE, 2 * IVL + 200);
  uint64_t took = mono_ms() - t0;
  long long w = zadds_single() - z0;
  print_message("%d renewals in %llu ms wrote the index %lld times\n", n,
                (unsigned long long)took, w);
  assert_true(n >= 10);
  /* At least one write (over two intervals), at most one per interval begun. */
  assert_true(w >= 1);
  assert_true(w <= (long long)(took / IVL) + 1);
  /* The field the script keeps is a server time, and the entry's score is
   * an expiry after it. */
  redisReply *ix = sxt_redis_command(&srv, "HGET sx:ix1:seg:{%s} ix", d.name);
  assert_int_equal(ix->type, REDIS_REPLY_STRING);
  redisReply *sc = sxt_redis_command(&srv, "ZSCORE sx:ix1:index %s", d.name);
  assert_int_equal(sc->type, REDIS_REPLY_STRING);
  assert_true(strtod(sc->str, NULL) >= strtod(ix->str, NULL) + LEASE);
  freeReplyObject(ix);
  freeReplyObject(sc);
  assert_true(listed(s, d.name));
  sx_store_close(s);

  /* index_refresh_ms=0: every renewal writes the entry, as before. */
  s = open_single("ix1", "index_refresh_ms=0");
  z0 = zadds_single();
  n = renew_for(s, &d, LEASE, 300);
  assert_int_equal(zadds_single() - z0, n);
  sx_store_close(s);

  /* A lease not shorter than the interval: renewals are that far apart
   * anyway, each writes. */
  s = open_single("ix1", IVL_Q);
  z0 = zadds_single();
  n = renew_for(s, &d, IVL, 300);
  assert_int_equal(zadds_single() - z0, n);
  sxt_ok(sx_store_unpublish(s, d.name, d.incarnation));
  assert_false(in_index("sx:ix1:index", d.name));
  sx_desc_free(&d);
  sx_store_close(s);
}

static void test_index_entry_deleted_by_hand_comes_back(void **state) {
  (void)state;
  if (!have_redis)
    skip();
  sx_store *s = open_single("ix2", IVL_Q);
  sx_desc d;
  sxt_desc_make(&d, "ix2/a", 0x22, 1, LEASE);
  sxt_ok(sx_store_publish(s, &d, 0));
  assert_int_equal(srv_do("ZREM sx:ix2:index %s", d.name), 1);
  assert_false(listed(s, d.name));
  /* Back within one interval and a renewal (50 ms), plus margin. */
  uint64_t t0 = mono_ms(), took = 0;
  while (!in_index("sx:ix2:index", d.name)) {
    took = mono_ms() - t0;
    assert_true(took < IVL + 50 + 1500);
    sxt_ok(sx_store_renew(s, d.name, d.incarnation, LEASE));
    sleep_ms(50);
  }
  print_message("the entry was back after %llu ms\n", (unsigned long long)took);
  assert_true(listed(s, d.name));

  /* A value without ix (written by an older client) is due at once. */
  srv_do("ZREM sx:ix2:index %s", d.name);
  assert_int_equal(srv_do("HDEL sx:ix2:seg:{%s} ix", d.name), 1);
  sxt_ok(sx_store_renew(s, d.name, d.incarnation, LEASE));
  assert_true(in_index("sx:ix2:index", d.name));
  assert_true(listed(s, d.name));
  sxt_ok(sx_store_unpublish(s, d.name, d.incarnation));
  sx_desc_free(&d);
  sx_store_close(s);
}

/* A ZADD that fails (here: the index key is of the wrong type) makes the
 * next renewals write their entries, although ix was just set. */
static void test_index_failed_write_is_retried_next_renewal(void **state) {
  (void)state;
  if (!have_redis)
    skip();
  sx_store *s = open_single("ix3", "index_refresh_ms=7500");
  sx_desc d;
  sxt_desc_make(&d, "ix3/a", 0x23, 1, 1000);
  sxt_ok(sx_store_publish(s, &d, 0));
  srv_do("DEL sx:ix3:index", NULL);
  srv_do("SET sx:ix3:index %s", "not-a-zset");
  srv_do("HDEL sx:ix3:seg:{%s} ix", d.name);
  /* Due (no ix): the script sets ix, the ZADD fails; the renewal itself
   * succeeded. */
  long long z0 = zadds_single();
  sxt_ok(sx_store_renew(s, d.name, d.incarnation, 1000));
  assert_int_equal(zadds_single() - z0, 1);
  assert_int_equal(srv_do("HEXISTS sx:ix3:seg:{%s} ix", d.name), 1);
  srv_do("DEL sx:ix3:index", NULL);
  /* Not due by ix (set just now, interval 7.5 s), written all the same. */
  sxt_ok(sx_store_renew(s, d.name, d.incarnation, 1000));
  assert_true(in_index("sx:ix3:index", d.name));
  assert_true(listed(s, d.name));
  sxt_ok(sx_store_unpublish(s, d.name, d.incarnation));
  sx_desc_free(&d);
  sx_store_close(s);
}

/* After a reconnect (the old connection may have taken index writes with
 * it, or the master may be a promoted replica that missed them) the next
 * renewals write their entries, although ix is fresh. */
static void test_index_rewritten_after_a_reconnect(void **state) {
  (void)state;
  if (!have_redis)
    skip();
  sx_store *pub = open_single("ix4", NULL);
  sx_desc d;
  sxt_desc_make(&d, "ix4/a", 0x24, 1, 60000);
  sxt_ok(sx_store_publish(pub, &d, 0));
  sx_store_close(pub);
  char url[320];
  sxt_redis_url(&srv, url, sizeof(url), "namespace=ix4&index_refresh_ms=7500");
  sxt_store st;
  sxt_ok(sxt_store_open(&st, url, 1));
  sxt_reply r;
  /* ix is fresh: a renewal does not bring back an entry deleted by hand. */
  assert_int_equal(srv_do("ZREM sx:ix4:index %s", d.name), 1);
  sxt_ok(sxt_renew(&st, d.name, d.incarnation, 800, &r));
  sxt_reply_free(&r);
  assert_false(in_index("sx:ix4:index", d.name));
  /* Drop the backend's connection; it reconnects. */
  assert_true(srv_do("CLIENT KILL TYPE %s", "normal") >= 1);
  assert_int_equal(sxt_store_wait_conn(&st, 0, 1, 10000), 0);
  assert_int_equal(sxt_store_wait_conn(&st, 1, 2, SXT_OP_DEADLINE_MS), 0);
  sxt_ok(sxt_renew(&st, d.name, d.incarnation, 800, &r));
  sxt_reply_free(&r);
  assert_true(in_index("sx:ix4:index", d.name));
  sxt_ok(sxt_unpublish(&st, d.name, d.incarnation, &r));
  sxt_reply_free(&r);
  sxt_store_close(&st);
  sx_desc_free(&d);
}

/* ---------------------------------------------------------------- cluster */

static void test_index_cluster_renewals(void **state) {
  (void)state;
  if (!have_cluster)
    skip();
  enum { N = 24 };
  sx_store *s = open_cluster("ixc", IVL_Q);
  sx_desc d[N];
  for (int i = 0; i < N; i++) {
    char name[32];
    snprintf(name, sizeof(name), "ixc/%d", i);
    sxt_desc_make(&d[i], name, (uint8_t)(0x30 + i), 1, LEASE);
    sxt_ok(sx_store_publish(s, &d[i], 0));
  }
  long long z0, e0, z1, e1;
  cluster_calls(&z0, &e0);
  uint64_t t0 = mono_ms();
  int rounds = 0;
  while (mono_ms() < t0 + 2 * IVL + 200) {
    for (int i = 0; i < N; i++)
      sxt_ok(sx_store_renew(s, d[i].name, d[i].incarnation, LEASE));
    rounds++;
    sleep_ms(50);
  }
  uint64_t took = mono_ms() - t0;
  cluster_calls(&z1, &e1);
  long long renewals = e1 - e0, writes = z1 - z0;
  print_message("%d rounds of %d renewals in %llu ms: %lld EVALSHA, %lld ZADD on the masters\n",
                rounds, N, (unsigned long long)took, renewals, writes);
  assert_true(renewals >= (long long)rounds * N);
  assert_true(writes >= N);
  assert_true(writes <= (long long)N * ((long long)(took / IVL) + 1));
  assert_true(writes < renewals);

  /* An entry deleted by hand from its piece is back within an interval,
   * and the listing across the pieces has every name. */
  char key[64];
  snprintf(key, sizeof(key), "sx:ixc:index:{%u}", sx__rcl_shard_of(d[5].name));
  redisReply *r = sxt_rcluster_command(&cl, "ZREM %s %s", key, d[5].name);
  assert_non_null(r);
  assert_int_equal(r->integer, 1);
  freeReplyObject(r);
  uint64_t t1 = mono_ms();
  for (;;) {
    r = sxt_rcluster_command(&cl, "ZSCORE %s %s", key, d[5].name);
    assert_non_null(r);
    int back = r->type == REDIS_REPLY_STRING;
    freeReplyObject(r);
    if (back)
      break;
    assert_true(mono_ms() - t1 < IVL + 50 + 2000);
    for (int i = 0; i < N; i++)
      sxt_ok(sx_store_renew(s, d[i].name, d[i].incarnation, LEASE));
    sleep_ms(50);
  }
  sx_store_entry *e = NULL;
  size_t n = 0;
  sxt_ok(sx_store_list(s, &e, &n));
  assert_int_equal(n, N);
  for (size_t i = 0; i < n; i++)
    assert_int_equal(e[i].status, 0);
  sx_store_entries_free(e, n);
  for (int i = 0; i < N; i++) {
    sxt_ok(sx_store_unpublish(s, d[i].name, d[i].incarnation));
    sx_desc_free(&d[i]);
  }
  sx_store_close(s);
}

static int group_setup(void **state) {
  (void)state;
  sxt_redis_opts o = {0};
  have_redis = sxt_redis_start(&srv, &o) == 0;
  if (!have_redis) {
    fprintf(stderr, "test_store_index: redis-server is not installed (make deps): the "
            "Redis tests are skipped\n");
    return 0;
  }
  int rc = sxt_rcluster_start(&cl, &o);
  have_cluster = rc == 0;
  return rc < 0 ? -1 : 0;
}

static int group_teardown(void **state) {
  (void)state;
  if (have_cluster)
    sxt_rcluster_stop(&cl);
  if (have_redis)
    sxt_redis_stop(&srv);
  sxt_redis_stop_all();
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_index_written_once_per_interval),
      cmocka_unit_test(test_index_entry_deleted_by_hand_comes_back),
      cmocka_unit_test(test_index_failed_write_is_retried_next_renewal),
      cmocka_unit_test(test_index_rewritten_after_a_reconnect),
      cmocka_unit_test(test_index_cluster_renewals),
  };
  const char *filter = getenv("SXT_FILTER");
  if (filter && *filter)
    cmocka_set_test_filter(filter);
  return cmocka_run_group_tests_name("store/index", tests, group_setup, group_teardown);
}
