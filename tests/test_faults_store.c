/*
 * Fault injection, end to end: the store fails.
 * sx-agent processes (BUILD/bin/sx-agent) hold filled pools and publish
 * them in a real redis-server; readers in this process open them by name
 * and read over TCP while the test breaks things.
 *
 *   - Redis killed and restarted empty: every agent republishes by itself;
 *   - Sentinel failover: agents follow the new master and keep renewing, also
 *     through sentinels that require a password (which no log shows). *
 * Each test prints what it measured ("measured: ...").  Bounds are one lease
 * or one renew interval plus documented backoff, with a margin for a loaded
 * machine.  SXT_FILTER=pattern runs a subset; SXT_KEEP_LOGS=1 keeps logs.
 * The actors are in tests/support/fault_fixture.c.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "fault_fixture.h"
#include "internal.h"
#include "redis/redis.h"
#include "segxfer/store.h"

static sxt_proc_env env;

/* ------------------------------------------------------------ the store */

static void test_fault_store_restarted_empty_every_agent_republishes(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  enum { N = 3 };
  const uint32_t lease = 1500, renew = lease / 3;
  sxt_fault_agent p[N];
  for (int i = 0; i < N; i++) {
    char name[32];
    snprintf(name, sizeof(name), "survivor-%d", i);
    sxt_fault_spawn(&env, &p[i], name, env.url, NULL, lease, 20 + (uint64_t)i, NULL);
  }
  for (int i = 0; i < N; i++)
    sxt_fault_wait_published(&p[i], NULL, 20000);
  sxt_redis_kill(&env.redis, SIGKILL);
  assert_int_equal(sxt_redis_restart(&env.redis), 0);
  uint64_t t0 = sx__mono_ms(), back[N] = {0};
  int left = N;
  while (left > 0 && sx__mono_ms() - t0 < 20000) {
    for (int i = 0; i < N; i++) {
      uint8_t inc[SX_INCARNATION_LEN];
      if (back[i] == 0 && sxt_fault_stored(env.url, p[i].name, inc, NULL) == 0) {
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
    assert_int_equal(sxt_fault_stop(&p[i], SIGTERM), 0);
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
  sxt_fault_agent p[N];
  for (int i = 0; i < N; i++) {
    char name[32];
    snprintf(name, sizeof(name), "follower-%d", i);
    sxt_fault_spawn(&env, &p[i], name, surl, NULL, lease, 30 + (uint64_t)i, NULL);
  }
  for (int i = 0; i < N; i++)
    sxt_fault_wait_published(&p[i], NULL, 20000);

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
    assert_int_equal(sxt_fault_stop(&p[i], SIGTERM), 0);

  if (sentinel_pw != NULL) {
    /* An agent with a wrong sentinel password does not start, and says why:
     * the sentinel, AUTH, WRONGPASS; no secret in its debug log. */
    char bad[256];
    snprintf(bad, sizeof(bad),
             "redis+sentinel://127.0.0.1:%d/sxmaster?namespace=fo&connect_timeout_ms=1000"
             "&sentinel_password=Wrong-Sent-Pw-77",
             st.port);
    sxt_fault_agent w;
    sxt_fault_spawn(&env, &w, "refused", bad, NULL, lease, 40, NULL);
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
  sxt_fault_log_level = "debug";
  sentinel_failover_agents_follow("Sent-Fault-Pw-4242");
  sxt_fault_log_level = "info";
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fault_store_restarted_empty_every_agent_republishes),
      cmocka_unit_test(test_fault_sentinel_failover_agents_follow),
      cmocka_unit_test(test_fault_sentinel_with_password_failover_agents_follow),
  };
  return sxt_fault_main(&env, "test_faults_store", "fault injection: the store", tests,
                        sizeof(tests) / sizeof(tests[0]), NULL);
}
