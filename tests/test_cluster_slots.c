/*
 * Redis Cluster arithmetic and answers (meta/redis/redis_slots.c), without
 * a server: key slots (CRC16 and hash tags, against values from the Redis
 * Cluster specification and CLUSTER KEYSLOT), MOVED/ASK errors, CLUSTER
 * SLOTS replies and coverage, including malformed answers a broken node
 * could send.  test_store_cluster.c checks the slots against a real node.
 */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "redis/redis.h"
#include "sxtest.h"

static void test_rcl_crc16_reference(void **state) {
  (void)state;
  /* The specification's check value for CRC16-CCITT (XMODEM). */
  assert_int_equal(sx__rcl_crc16("123456789", 9), 0x31C3);
  assert_int_equal(sx__rcl_crc16("", 0), 0);
}

static unsigned slot(const char *k) { return sx__rcl_key_slot(k, strlen(k)); }

static void test_rcl_key_slot_hash_tags(void **state) {
  (void)state;
  /* CLUSTER KEYSLOT answers on Redis 7.0. */
  assert_int_equal(slot("foo"), 12182);
  assert_int_equal(slot("bar"), 5061);
  assert_int_equal(slot("hello"), 866);
  /* The tag alone is hashed. */
  assert_int_equal(slot("{user1000}.following"), slot("{user1000}.followers"));
  assert_int_equal(slot("{user1000}.following"), slot("user1000"));
  assert_int_equal(slot("sx:ns:seg:{a/b}"), slot("sx:ns:fence:{a/b}"));
  /* The specification's edge cases: an empty tag hashes the whole key;
   * only the first '{' and the first '}' after it count. */
  assert_int_equal(slot("foo{}{bar}"), sx__rcl_crc16("foo{}{bar}", 10) % 16384);
  assert_int_equal(slot("foo{{bar}}zap"), slot("{bar"));
  assert_int_equal(slot("foo{bar}{zap}"), slot("bar"));
  assert_int_equal(slot("{"), sx__rcl_crc16("{", 1) % 16384);
}

static redisReply *err_reply(const char *text) {
  redisReply *r = calloc(1, sizeof(*r));
  r->type = REDIS_REPLY_ERROR;
  r->str = strdup(text);
  r->len = strlen(text);
  return r;
}

static int redirect(const char *text, int *ask, unsigned *sl, char *host, int *port) {
  redisReply *r = err_reply(text);
  int rc = sx__rcl_parse_redirect(r, ask, sl, host, 64, port);
  freeReplyObject(r);
  return rc;
}

static void test_rcl_parse_redirect(void **state) {
  (void)state;
  int ask, port;
  unsigned sl;
  char host[64];
  assert_int_equal(redirect("MOVED 3999 127.0.0.1:6381", &ask, &sl, host, &port), 0);
  assert_int_equal(ask, 0);
  assert_int_equal(sl, 3999);
  assert_string_equal(host, "127.0.0.1");
  assert_int_equal(port, 6381);
  assert_int_equal(redirect("ASK 1 ::1:7000", &ask, &sl, host, &port), 0);
  assert_int_equal(ask, 1);
  assert_string_equal(host, "::1");
  assert_int_equal(port, 7000);
  /* Redis 7 with an unknown endpoint: the host is empty. */
  assert_int_equal(redirect("MOVED 5 :7001", &ask, &sl, host, &port), 0);
  assert_string_equal(host, "");
  /* Not redirections, or broken ones. */
  const char *bad[] = {"ERR MOVED 1 a:1", "MOVED", "MOVED 16384 a:1", "MOVED x a:1",
                       "MOVED 1 a", "MOVED 1 a:", "MOVED 1 a:0", "MOVED 1 a:65536",
                       "MOVED 1 a:12x", "MOVED 1 a b:1", "MOVED 1\x01a:1",
                       "ASK 1 host-name-that-is-far-too-long-for-the-buffer-we-gave-it-"
                       "and-more:1", "TRYAGAIN x", "CLUSTERDOWN The cluster is down"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
    if (redirect(bad[i], &ask, &sl, host, &port) == 0)
      fail_msg("'%s' was taken as a redirection", bad[i]);
}

/* Builders for CLUSTER SLOTS replies. */
static redisReply *rep_new(int type) {
  redisReply *r = calloc(1, sizeof(*r));
  r->type = type;
  return r;
}
static redisReply *rep_int(long long v) {
  redisReply *r = rep_new(REDIS_REPLY_INTEGER);
  r->integer = v;
  return r;
}
static redisReply *rep_str(const char *s) {
  redisReply *r = rep_new(REDIS_REPLY_STRING);
  r->str = strdup(s);
  r->len = strlen(s);
  return r;
}
static redisReply *rep_arr(size_t n, ...) {
  redisReply *r = rep_new(REDIS_REPLY_ARRAY);
  va_list ap;
  va_start(ap, n);
  r->elements = n;
  r->element = calloc(n ? n : 1, sizeof(*r->element));
  for (size_t i = 0; i < n; i++)
    r->element[i] = va_arg(ap, redisReply *);
  va_end(ap);
  return r;
}
static redisReply *range(long long a, long long b, const char *host, long long port) {
  return rep_arr(4, rep_int(a), rep_int(b), rep_arr(3, rep_str(host), rep_int(port),
                                                    rep_str("id")),
                 rep_arr(3, rep_str("127.0.0.1"), rep_int(9999), rep_str("rid")));
}

static void test_rcl_parse_slots_and_coverage(void **state) {
  (void)state;
  sx_rcl_range out[8];
  size_t n;
  char msg[200];
  redisReply *r = rep_arr(3, range(0, 5460, "127.0.0.1", 7000),
                          range(5461, 10922, "?", 7001), range(10923, 16383, "", 7002));
  assert_int_equal(sx__rcl_parse_slots(r, out, 8, &n, msg, sizeof(msg)), 0);
  assert_int_equal(n, 3);
  assert_int_equal(out[0].last, 5460);
  assert_string_equal(out[0].host, "127.0.0.1");
  assert_int_equal(out[1].port, 7001);
  assert_string_equal(out[1].host, ""); /* "?": the node that answered */
  assert_string_equal(out[2].host, "");
  assert_int_equal(sx__rcl_uncovered(out, n, msg, sizeof(msg)), 0);
  freeReplyObject(r);

  /* A gap is found and named. */
  r = rep_arr(2, range(0, 99, "a", 1), range(200, 16383, "b", 2));
  assert_int_equal(sx__rcl_parse_slots(r, out, 8, &n, msg, sizeof(msg)), 0);
  assert_int_equal(sx__rcl_uncovered(out, n, msg, sizeof(msg)), 100);
  assert_non_null(strstr(msg, "100-199"));
  freeReplyObject(r);
  assert_int_equal(sx__rcl_uncovered(out, 0, msg, sizeof(msg)), 16384);

  /* Malformed answers are refused with a message. */
  redisReply *bad[] = {
      rep_str("ERR"),
      rep_arr(1, rep_int(3)),
      rep_arr(1, range(10, 5, "a", 1)),
      rep_arr(1, range(0, 16384, "a", 1)),
      rep_arr(1, range(-1, 3, "a", 1)),
      rep_arr(1, range(0, 3, "a", 0)),
      rep_arr(1, range(0, 3, "a", 70000)),
      rep_arr(1, range(0, 3, "a b", 1)),
      rep_arr(1, rep_arr(3, rep_int(0), rep_int(1), rep_str("x"))),
      rep_arr(9, range(0, 1, "a", 1), range(0, 1, "a", 1), range(0, 1, "a", 1),
              range(0, 1, "a", 1), range(0, 1, "a", 1), range(0, 1, "a", 1),
              range(0, 1, "a", 1), range(0, 1, "a", 1), range(0, 1, "a", 1)),
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    msg[0] = '\0';
    if (sx__rcl_parse_slots(bad[i], out, 8, &n, msg, sizeof(msg)) == 0)
      fail_msg("malformed CLUSTER SLOTS answer %zu was accepted", i);
    assert_true(msg[0] != '\0');
    freeReplyObject(bad[i]);
  }
}

/* One CLUSTER SHARDS entry: slots (pairs) and nodes (field lists). */
static redisReply *node_entry(const char *ip, const char *endpoint, long long port,
                              const char *role, const char *health) {
  return rep_arr(10, rep_str("ip"), rep_str(ip), rep_str("endpoint"), rep_str(endpoint),
                 rep_str("port"), rep_int(port), rep_str("role"), rep_str(role),
                 rep_str("health"), rep_str(health));
}

static void test_rcl_parse_shards(void **state) {
  (void)state;
  sx_rcl_range out[8];
  size_t n;
  char msg[200];
  redisReply *r = rep_arr(
      3,
      rep_arr(4, rep_str("slots"), rep_arr(4, rep_int(0), rep_int(99), rep_int(200), rep_int(5460)),
              rep_str("nodes"),
              rep_arr(2, node_entry("10.0.0.1", "10.0.0.1", 7002, "replica", "online"),
                      node_entry("10.0.0.2", "node2.example", 7001, "master", "online"))),
      rep_arr(4, rep_str("slots"), rep_arr(2, rep_int(5461), rep_int(16383)), rep_str("nodes"),
              rep_arr(2, node_entry("10.0.0.3", "?", 7003, "master", "fail"),
                      node_entry("10.0.0.4", "10.0.0.4", 7004, "master", "online"))),
      /* A master without slots yet. */
      rep_arr(4, rep_str("slots"), rep_arr(0), rep_str("nodes"),
              rep_arr(1, node_entry("10.0.0.5", "10.0.0.5", 7005, "master", "online"))));
  assert_int_equal(sx__rcl_parse_shards(r, out, 8, &n, msg, sizeof(msg)), 0);
  assert_int_equal(n, 3);
  assert_int_equal(out[0].first, 0);
  assert_int_equal(out[0].last, 99);
  assert_string_equal(out[0].host, "node2.example"); /* the endpoint */
  assert_int_equal(out[0].port, 7001);
  assert_int_equal(out[1].first, 200);
  assert_int_equal(out[1].port, 7001);
  assert_string_equal(out[2].host, "10.0.0.4"); /* the failed master is skipped */
  assert_int_equal(sx__rcl_uncovered(out, n, msg, sizeof(msg)), 100);
  freeReplyObject(r);

  /* A shard whose only master failed leaves its slots uncovered. */
  r = rep_arr(1, rep_arr(4, rep_str("slots"), rep_arr(2, rep_int(0), rep_int(16383)),
                         rep_str("nodes"),
                         rep_arr(1, node_entry("a", "a", 1, "master", "fail"))));
  assert_int_equal(sx__rcl_parse_shards(r, out, 8, &n, msg, sizeof(msg)), 0);
  assert_int_equal(n, 0);
  freeReplyObject(r);

  redisReply *bad[] = {
      rep_str("x"),
      rep_arr(1, rep_arr(2, rep_str("slots"), rep_int(3))),
      rep_arr(1, rep_arr(4, rep_str("slots"), rep_arr(1, rep_int(0)), rep_str("nodes"),
                         rep_arr(1, node_entry("a", "a", 1, "master", "online")))),
      rep_arr(1, rep_arr(4, rep_str("slots"), rep_arr(2, rep_int(9), rep_int(3)),
                         rep_str("nodes"),
                         rep_arr(1, node_entry("a", "a", 1, "master", "online")))),
      rep_arr(1, rep_arr(4, rep_str("slots"), rep_arr(2, rep_int(0), rep_int(16384)),
                         rep_str("nodes"),
                         rep_arr(1, node_entry("a", "a", 1, "master", "online")))),
      rep_arr(1, rep_arr(4, rep_str("slots"), rep_arr(2, rep_int(0), rep_int(1)),
                         rep_str("nodes"),
                         rep_arr(1, node_entry("a b", "a b", 1, "master", "online")))),
      rep_arr(1, rep_arr(4, rep_str("slots"), rep_arr(2, rep_int(0), rep_int(1)),
                         rep_str("nodes"),
                         rep_arr(1, node_entry("a", "a", 0, "master", "online")))),
      /* Bad ranges are bad whether or not the shard has a healthy master. */
      rep_arr(1, rep_arr(4, rep_str("slots"), rep_arr(2, rep_int(0), rep_int(99999)),
                         rep_str("nodes"),
                         rep_arr(1, node_entry("a", "a", 1, "master", "fail")))),
      rep_arr(1, rep_arr(4, rep_str("slots"), rep_arr(2, rep_int(-1), rep_str("5")),
                         rep_str("nodes"), rep_arr(0))),
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    msg[0] = '\0';
    if (sx__rcl_parse_shards(bad[i], out, 8, &n, msg, sizeof(msg)) == 0)
      fail_msg("malformed CLUSTER SHARDS answer %zu was accepted", i);
    assert_true(msg[0] != '\0');
    freeReplyObject(bad[i]);
  }
}

static void test_rcl_shards_spread(void **state) {
  (void)state;
  /* The index pieces and event channels spread over the three masters
   * redis-cli --cluster create makes (0-5460, 5461-10922, 10923-16383). */
  int per[3] = {0, 0, 0};
  for (unsigned k = 0; k < SX_RCL_SHARDS; k++) {
    char key[64];
    snprintf(key, sizeof(key), "sx:ns:index:{%u}", k);
    unsigned s = slot(key);
    per[s <= 5460 ? 0 : s <= 10922 ? 1 : 2]++;
  }
  for (int i = 0; i < 3; i++)
    assert_true(per[i] >= 3);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rcl_crc16_reference),
      cmocka_unit_test(test_rcl_key_slot_hash_tags),
      cmocka_unit_test(test_rcl_parse_redirect),
      cmocka_unit_test(test_rcl_parse_slots_and_coverage),
      cmocka_unit_test(test_rcl_parse_shards),
      cmocka_unit_test(test_rcl_shards_spread),
  };
  return cmocka_run_group_tests_name("cluster_slots", tests, NULL, NULL);
}
