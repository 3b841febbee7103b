/*
 * Redis Sentinel against real redis-server and redis-sentinel processes:
 * SENTINEL FAILOVER followed by a store and by an idle async backend (its
 * +switch-master watch), the watch's subscription staying up, sentinels
 * with credentials of their own (requirepass, an ACL user) and a
 * sentinel_password given before the sentinels have one.  The plain Redis
 * tests are in test_store_redis.c.  Servers are started by
 * tests/support/redis_harness.c on free loopback ports.
 *
 * SXT_FILTER=test_store_sentinel_* runs only the matching tests.  Timing
 * checks have wide margins: the machine is shared with other builds.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend_publisher.h"
#include "internal.h"
#include "procs.h"
#include "redis/redis.h"
#include "redis_harness.h"
#include "sxtest.h"

/* Whether redis-server is installed; without it every test skips. */
static int have_redis;

static int group_setup(void **state) {
  (void)state;
  have_redis = access("/usr/bin/redis-server", X_OK) == 0;
  if (!have_redis)
    fprintf(stderr, "test_store_sentinel: redis-server is not installed (make deps): every "
            "test here is skipped\n");
  return 0;
}

static int group_teardown(void **state) {
  (void)state;
  sxt_redis_stop_all();
  return 0;
}

#define NEED_REDIS()                                                           \
  do {                                                                         \
    if (!have_redis)                                                           \
      skip();                                                                  \
  } while (0)

/* SENTINEL FAILOVER from m to its replica rp, then check that the idle
 * backend k (opened through the sentinels) came back up on rp by itself and
 * that s, which published d (in namespace ns) on m, publishes it on rp. */
static void sentinel_failover_follow(sx_store *s, sxt_bk *k, sx_desc *d, const char *ns,
                                     sxt_redis *m, sxt_redis *rp, sxt_redis *st) {
  redisReply *rep = sxt_redis_command(st, "SENTINEL FAILOVER %s", st->master_name);
  assert_non_null(rep);
  assert_int_not_equal(rep->type, REDIS_REPLY_ERROR);
  freeReplyObject(rep);
  assert_int_equal(sxt_redis_wait_master(st, rp->port, 30000), 0);
  /* Replication is asynchronous: until the sentinel demotes the old master,
   * a write to it may be acknowledged and then lost at its resync (Redis
   * Sentinel's known window).  Check where writes land once it is demoted. */
  assert_int_equal(sxt_redis_wait_role(m, "slave", 30000), 0);
  /* The idle backend went down and came back up on the new master without
   * issuing a command (+switch-master, or the old master dropping it). */
  uint64_t t1 = sx__mono_ms();
  while (sx__mono_ms() - t1 < 20000 &&
         !(k->ups >= 2 && ((redis_backend *)k->b)->state == RB_READY &&
           ((redis_backend *)k->b)->port == rp->port))
    uv_run(&k->loop, UV_RUN_ONCE);
  assert_int_equal(((redis_backend *)k->b)->port, rp->port);
  assert_true(k->downs >= 1 && k->ups >= 2);
  uint64_t t0 = sx__mono_ms();
  int rc = -1;
  while (sx__mono_ms() - t0 < 30000) {
    d->generation++;
    if ((rc = sx_store_publish(s, d, 0)) == 0)
      break;
    sxt_sleep_ms(200);
  }
  sxt_ok(rc);
  fprintf(stderr, "publishing again %llu ms after the sentinel switched\n",
          (unsigned long long)(sx__mono_ms() - t0));
  /* The write went to the new master. */
  rep = sxt_redis_command(rp, "HGET sx:%s:seg:{%s} gen", ns, d->name);
  assert_non_null(rep);
  assert_int_equal(rep->type, REDIS_REPLY_STRING);
  assert_int_equal(strtoull(rep->str, NULL, 10), d->generation);
  freeReplyObject(rep);
  sx_desc got;
  sxt_ok(sx_store_get(s, d->name, &got, NULL));
  assert_int_equal(got.generation, d->generation);
  sx_desc_free(&got);
}

static void test_store_sentinel_failover(void **state) {
  (void)state;
  NEED_REDIS();
  sxt_redis m, rp, st;
  assert_int_equal(sxt_redis_start(&m, NULL), 0);
  sxt_redis_opts ro = {.replica_of = &m};
  assert_int_equal(sxt_redis_start(&rp, &ro), 0);
  if (sxt_sentinel_start(&st, &m, "mymaster") != 0) {
    sxt_redis_stop(&rp);
    sxt_redis_stop(&m);
    skip(); /* redis-sentinel not installed */
  }
  assert_int_equal(sxt_redis_wait_replicas(&st, 1, 30000), 0);
  char url[256];
  /* A plain URL that points at the replica: writes fail clearly. */
  sxt_redis_url(&rp, url, sizeof(url), "namespace=sent");
  sx_store *rs;
  sxt_ok(sx_store_open(url, &rs));
  sx_desc rd;
  sxt_desc_make(&rd, "ro/0", 0x11, 1, 60000);
  sxt_rc(sx_store_publish(rs, &rd, 0), SX_EUNREACH);
  assert_non_null(strstr(sx_errmsg(), "read-only"));
  sx_desc_free(&rd);
  sx_store_close(rs);
  snprintf(url, sizeof(url), "redis+sentinel://127.0.0.1:%d,127.0.0.1:%d/mymaster"
           "?namespace=sent&timeout_ms=1000&connect_timeout_ms=1000",
           sxt_free_port(), st.port); /* the first sentinel is dead: skipped */
  sx_store *s;
  sxt_ok(sx_store_open(url, &s));
  /* An idle async backend on the same URL: it must follow by itself. */
  sxt_bk k;
  redisReply *rep;
  sxt_bk_open(&k, url, "idle/0");
  assert_true(sxt_bk_run(&k, &k.ups, 10000));
  assert_int_equal(((redis_backend *)k.b)->port, m.port);
  sx_desc d;
  sxt_desc_make(&d, "s/0", 0x11, 1, 60000);
  sxt_ok(sx_store_publish(s, &d, 0));
  rep = sxt_redis_command(&m, "HGET sx:sent:seg:{s/0} gen");
  assert_non_null(rep);
  assert_string_equal(rep->str, "1"); /* written to the master */
  freeReplyObject(rep);

  sentinel_failover_follow(s, &k, &d, "sent", &m, &rp, &st);
  sxt_bk_close(&k);
  sx_desc_free(&d);
  sx_store_close(s);
  sxt_redis_stop(&st);
  sxt_redis_stop(&rp);
  sxt_redis_stop(&m);
}

/* The +switch-master subscription must stay up.  It used to be dropped
 * and re-made every connect_timeout_ms (the subscribe confirmation was not
 * recognised, so its deadline fired), leaving gaps in which a failover went
 * unnoticed until the old master was demoted, up to 10 s later: found by
 * deploy/local-cluster.sh, where agents kept renewing on the old master
 * and their segments expired on the new one. */
static void test_store_sentinel_watch_stays_subscribed(void **state) {
  (void)state;
  NEED_REDIS();
  sxt_redis m, st;
  assert_int_equal(sxt_redis_start(&m, NULL), 0);
  if (sxt_sentinel_start(&st, &m, "mymaster") != 0) {
    sxt_redis_stop(&m);
    skip(); /* redis-sentinel not installed */
  }
  char url[256];
  snprintf(url, sizeof(url), "redis+sentinel://127.0.0.1:%d/mymaster"
           "?namespace=swatch&connect_timeout_ms=300", st.port);
  sxt_bk k;
  sxt_bk_open(&k, url, "swatch/0");
  assert_true(sxt_bk_run(&k, &k.ups, 10000));
  /* Several subscribe deadlines (300 ms) later ... */
  uint64_t t0 = sx__mono_ms();
  while (sx__mono_ms() - t0 < 2500)
    uv_run(&k.loop, UV_RUN_ONCE);
  /* ... the sentinel still has the same subscriber: one connection with a
   * subscription, open for at least 2 s. */
  redisReply *rep = sxt_redis_command(&st, "CLIENT LIST");
  assert_non_null(rep);
  assert_int_equal(rep->type, REDIS_REPLY_STRING);
  int found = 0;
  for (char *line = rep->str; line && *line; line = strchr(line, '\n'), line = line ? line + 1 : NULL) {
    char *sub = strstr(line, " sub=1 "), *age = strstr(line, " age="), *nl = strchr(line, '\n');
    if (sub && age && (nl == NULL || sub < nl) && strtol(age + 5, NULL, 10) >= 2)
      found = 1;
  }
  if (!found)
    fail_msg("no subscriber connection older than 2 s on the sentinel:\n%s", rep->str);
  freeReplyObject(rep);
  sxt_bk_close(&k);
  sxt_redis_stop(&st);
  sxt_redis_stop(&m);
}

/* Sentinels with credentials of their own (requirepass and an ACL user),
 * besides the master's: with sentinel_password the resolver and the
 * +switch-master watch authenticate, and a failover is followed; with a
 * wrong or missing one, opening fails with SX_EAUTH naming the sentinel and
 * AUTH, and no secret shows. */
#define SENT_PW "Sentinel-Pw-3141"
#define SENT_USER_PW "Watcher-Pw-2718"
#define SENT_MASTER_PW "Master-Pw-1618"

/* Opening url fails with SX_EAUTH and a message holding each of want[]
 * (NULL-terminated) and none of the secrets. */
static void expect_sentinel_auth_error(const char *url, const char *const *want) {
  sx_store *s = NULL;
  int rc = sx_store_open(url, &s);
  if (rc != SX_EAUTH)
    fail_msg("%s: %s (%s), expected SX_EAUTH", url, sx_err_name(rc), sx_errmsg());
  fprintf(stderr, "as expected: %s\n", sx_errmsg());
  for (int i = 0; want[i]; i++)
    if (strstr(sx_errmsg(), want[i]) == NULL)
      fail_msg("the message does not say '%s': %s", want[i], sx_errmsg());
  const char *secrets[] = {SENT_PW, SENT_USER_PW, SENT_MASTER_PW, "Wrong-Sent-Pw-99"};
  for (size_t i = 0; i < sizeof(secrets) / sizeof(secrets[0]); i++)
    if (strstr(sx_errmsg(), secrets[i]) != NULL)
      fail_msg("the message shows a secret: %s", sx_errmsg());
}

/* Does the sentinel have a subscribed connection authenticated as user? */
static int sentinel_has_subscriber(const sxt_redis *st, const char *user) {
  redisReply *rep = sxt_redis_command(st, "CLIENT LIST");
  int found = 0;
  char want[80];
  snprintf(want, sizeof(want), " user=%s ", user);
  if (rep && rep->type == REDIS_REPLY_STRING)
    for (char *line = rep->str; line && *line; line = strchr(line, '\n'), line = line ? line + 1 : NULL) {
      char *nl = strchr(line, '\n');
      char *sub = strstr(line, " sub=1 "), *u = strstr(line, want);
      if (sub && u && (nl == NULL || (sub < nl && u < nl)))
        found = 1;
    }
  if (rep)
    freeReplyObject(rep);
  return found;
}

static void test_store_sentinel_auth(void **state) {
  (void)state;
  NEED_REDIS();
  sxt_redis m, rp, st;
  sxt_redis_opts mo = {.requirepass = SENT_MASTER_PW};
  assert_int_equal(sxt_redis_start(&m, &mo), 0);
  sxt_redis_opts ro = {.requirepass = SENT_MASTER_PW, .replica_of = &m};
  assert_int_equal(sxt_redis_start(&rp, &ro), 0);
  /* The sx-watch user may do what segxfer needs of a sentinel, no more
   * (the rules in docs/store.md): ask for the master, hear +switch-master. */
  sxt_redis_opts so = {.requirepass = SENT_PW, .acl_user = "sx-watch",
                       .acl_pass = SENT_USER_PW,
                       .acl_rules = "resetchannels &+switch-master -@all "
                                    "+sentinel|get-master-addr-by-name +subscribe"};
  if (sxt_sentinel_start_opts(&st, &m, "authmaster", &so) != 0) {
    sxt_redis_stop(&rp);
    sxt_redis_stop(&m);
    skip(); /* redis-sentinel not installed */
  }
  assert_int_equal(sxt_redis_wait_replicas(&st, 1, 30000), 0);
  char url[512], who[64], dead[64];
  const char *base = "redis+sentinel://:" SENT_MASTER_PW "@127.0.0.1:%d/authmaster"
                     "?namespace=sauth&timeout_ms=1000&connect_timeout_ms=1000";
  snprintf(who, sizeof(who), "sentinel 127.0.0.1:%d: ", st.port);

  /* (b) No sentinel password: the sentinel answers NOAUTH. */
  snprintf(url, sizeof(url), base, st.port);
  expect_sentinel_auth_error(url, (const char *[]){who, "requires AUTH", "NOAUTH",
                                                   "sentinel_password", NULL});
  /* A wrong one: AUTH refused, WRONGPASS. */
  snprintf(url, sizeof(url), base, st.port);
  strcat(url, "&sentinel_password=Wrong-Sent-Pw-99");
  expect_sentinel_auth_error(url, (const char *[]){who, "AUTH refused: WRONGPASS",
                                                   "sentinel_password", NULL});
  /* The right password for the wrong user. */
  snprintf(url, sizeof(url), base, st.port);
  strcat(url, "&sentinel_user=sx-watch&sentinel_password=" SENT_PW);
  expect_sentinel_auth_error(url, (const char *[]){who, "AUTH as 'sx-watch' refused: "
                                                   "WRONGPASS", NULL});
  /* A refusal is named even when a later sentinel failed otherwise. */
  int dport = sxt_free_port();
  snprintf(dead, sizeof(dead), "last: sentinel 127.0.0.1:%d: cannot connect", dport);
  snprintf(url, sizeof(url), "redis+sentinel://127.0.0.1:%d,127.0.0.1:%d/authmaster"
           "?namespace=sauth&connect_timeout_ms=1000&sentinel_password=Wrong-Sent-Pw-99",
           st.port, dport);
  expect_sentinel_auth_error(url, (const char *[]){who, "AUTH refused", dead, NULL});

  /* (a) The right password (a dead sentinel first: skipped). */
  snprintf(url, sizeof(url), "redis+sentinel://:" SENT_MASTER_PW "@127.0.0.1:%d,"
           "127.0.0.1:%d/authmaster?namespace=sauth&timeout_ms=1000&connect_timeout_ms=1000"
           "&sentinel_password=" SENT_PW, sxt_free_port(), st.port);
  sx_store *s;
  sxt_ok(sx_store_open(url, &s));
  sx_desc d;
  sxt_desc_make(&d, "sa/0", 0x21, 1, 60000);
  sxt_ok(sx_store_publish(s, &d, 0));
  redisReply *rep = sxt_redis_command(&m, "HGET sx:sauth:seg:{sa/0} gen");
  assert_non_null(rep);
  assert_string_equal(rep->str, "1"); /* written to the master */
  freeReplyObject(rep);
  /* An idle backend as the sentinels' ACL user: its +switch-master watch
   * is subscribed under that user. */
  snprintf(url, sizeof(url), base, st.port);
  strcat(url, "&sentinel_user=sx-watch&sentinel_password=" SENT_USER_PW);
  sxt_bk k;
  sxt_bk_open(&k, url, "sidle/0");
  assert_true(sxt_bk_run(&k, &k.ups, 10000));
  assert_int_equal(((redis_backend *)k.b)->port, m.port);
  uint64_t t0 = sx__mono_ms();
  while (!sentinel_has_subscriber(&st, "sx-watch") && sx__mono_ms() - t0 < 5000)
    for (uint64_t t1 = sx__mono_ms(); sx__mono_ms() - t1 < 100;)
      uv_run(&k.loop, UV_RUN_ONCE);
  if (!sentinel_has_subscriber(&st, "sx-watch")) {
    rep = sxt_redis_command(&st, "CLIENT LIST");
    fail_msg("no +switch-master subscription as sx-watch on the sentinel:\n%s",
             rep && rep->type == REDIS_REPLY_STRING ? rep->str : "(no answer)");
  }

  sentinel_failover_follow(s, &k, &d, "sauth", &m, &rp, &st);
  sxt_bk_close(&k);
  sx_desc_free(&d);
  sx_store_close(s);
  sxt_redis_stop(&st);
  sxt_redis_stop(&rp);
  sxt_redis_stop(&m);
}

/* A sentinel_password for sentinels without one: AUTH with a password
 * alone is an error there (refused like a wrong password), while AUTH as
 * "default" succeeds on a user without password, so
 * sentinel_user=default&sentinel_password=... works before and after the
 * sentinels get requirepass (docs/store.md's way to introduce one). */
static void test_store_sentinel_password_before_requirepass(void **state) {
  (void)state;
  NEED_REDIS();
  sxt_redis m, st;
  assert_int_equal(sxt_redis_start(&m, NULL), 0);
  if (sxt_sentinel_start(&st, &m, "openmaster") != 0) {
    sxt_redis_stop(&m);
    skip(); /* redis-sentinel not installed */
  }
  char url[256], who[64];
  snprintf(who, sizeof(who), "sentinel 127.0.0.1:%d: ", st.port);
  snprintf(url, sizeof(url), "redis+sentinel://127.0.0.1:%d/openmaster?namespace=open"
           "&connect_timeout_ms=1000&sentinel_password=" SENT_PW, st.port);
  expect_sentinel_auth_error(url, (const char *[]){who, "AUTH refused: ERR AUTH",
                                                   "without any password configured",
                                                   NULL});
  snprintf(url, sizeof(url), "redis+sentinel://127.0.0.1:%d/openmaster?namespace=open"
           "&connect_timeout_ms=1000&sentinel_user=default&sentinel_password=" SENT_PW,
           st.port);
  sx_store *s;
  sxt_ok(sx_store_open(url, &s));
  sx_desc d;
  sxt_desc_make(&d, "open/0", 0x31, 1, 60000);
  sxt_ok(sx_store_publish(s, &d, 0));
  sx_desc_free(&d);
  sx_store_close(s);
  sxt_redis_stop(&st);
  sxt_redis_stop(&m);
}

int main(void) {
  const char *filter = getenv("SXT_FILTER");
  if (filter && *filter)
    cmocka_set_test_filter(filter);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_store_sentinel_failover),
      cmocka_unit_test(test_store_sentinel_watch_stays_subscribed),
      cmocka_unit_test(test_store_sentinel_auth),
      cmocka_unit_test(test_store_sentinel_password_before_requirepass),
  };
  return cmocka_run_group_tests_name("Redis Sentinel on redis-server and redis-sentinel",
                                     tests, group_setup, group_teardown);
}
