/*
 * The store integration suite (tests/support/store_suite.c, shared with
 * etcd) against a real redis-server, then what only Redis has: the key
 * schema, SELECT db, keyspace-notification expiry, values of the wrong type
 * or size and dangling index entries, requirepass and ACL users, command
 * timeouts, and Sentinel failover.  Servers are started by
 * tests/support/redis_harness.c on free loopback ports.
 *
 * SXT_FILTER=test_redis_* runs only the matching tests.  Timing checks have
 * wide margins: the machine is shared with other builds.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "internal.h"
#include "redis/redis.h"
#include "redis_harness.h"
#include "store_suite.h"

/* The suite's server (persisting, notify-keyspace-events Kx), shared by the
 * Redis-only tests; NULL when redis-server is not installed. */
static sxt_redis *main_redis;

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static int group_setup(void **state) {
  int rc = sxt_suite_group_setup(state, &sxt_redis_fixture);
  if (rc == 0)
    main_redis = ((sxt_suite *)*state)->server;
  if (rc == 0 && main_redis == NULL)
    fprintf(stderr, "test_store_redis: redis-server is not installed (make deps): every "
            "test here is skipped\n");
  return rc;
}

static int group_teardown(void **state) {
  int rc = sxt_suite_group_teardown(state);
  main_redis = NULL;
  sxt_redis_stop_all();
  return rc;
}

#define NEED_REDIS()                                                           \
  do {                                                                         \
    if (main_redis == NULL)                                                    \
      skip();                                                                  \
  } while (0)

/* A URL for the shared server in a namespace of the test's own. */
static void url_ns(const sxt_redis *r, char *buf, size_t size, const char *ns) {
  char q[128];
  snprintf(q, sizeof(q), "namespace=%s", ns);
  sxt_redis_url(r, buf, size, q);
}

static sx_store *open_ns(const char *ns) {
  char url[256];
  sx_store *s = NULL;
  url_ns(main_redis, url, sizeof(url), ns);
  sxt_ok(sx_store_open(url, &s));
  return s;
}

/* A descriptor with its own incarnation byte. */
static void desc_make(sx_desc *d, const char *name, uint8_t inc, uint64_t gen,
                      uint32_t lease_ms) {
  sxt_desc_kv(d, name, 4, 0, 4096, 16, 0);
  memset(d->incarnation, inc, SX_INCARNATION_LEN);
  d->generation = gen;
  d->lease_ms = lease_ms;
}

static redisReply *cmd(const char *fmt, const char *arg) {
  redisReply *r = sxt_redis_command(main_redis, fmt, arg);
  assert_non_null(r);
  return r;
}

/* ---------------------------------------------------------- key schema */

/* The keys the README documents for admins, written as it says, and the
 * synchronous client's messages over them. */
static void test_redis_key_schema_is_documented(void **state) {
  (void)state;
  NEED_REDIS();
  sx_store *s = open_ns("keys");
  sx_desc a, b;
  desc_make(&a, "decode-3", 0x11, 5, 30000);
  desc_make(&b, "decode-3", 0x44, 1, 30000);
  sxt_ok(sx_store_publish(s, &a, 0));

  redisReply *r = cmd("HGET sx:keys:seg:{%s} gen", "decode-3");
  assert_string_equal(r->str, "5");
  freeReplyObject(r);
  r = cmd("HGET sx:keys:seg:{%s} inc", "decode-3");
  assert_string_equal(r->str, "11111111111111111111111111111111");
  freeReplyObject(r);
  r = cmd("HGET sx:keys:seg:{%s} lease", "decode-3");
  assert_string_equal(r->str, "30000");
  freeReplyObject(r);
  r = cmd("PTTL sx:keys:seg:{%s}", "decode-3");
  assert_true(r->integer > 20000 && r->integer <= 30000);
  freeReplyObject(r);
  /* The listing index is how list finds segments (never KEYS or SCAN); its
   * score is the lease expiry in server ms. */
  r = cmd("ZSCORE sx:keys:index %s", "decode-3");
  assert_int_equal(r->type, REDIS_REPLY_STRING);
  freeReplyObject(r);

  /* A conflict names the holder, its lease age and lease left. */
  sxt_rc(sx_store_publish(s, &b, 0), SX_EHELD);
  const char *msg = sx_errmsg();
  assert_non_null(strstr(msg, "decode-3"));
  assert_non_null(strstr(msg, "11111111111111111111111111111111"));
  assert_non_null(strstr(msg, "ms ago"));
  assert_non_null(strstr(msg, "lease left"));
  assert_non_null(strstr(msg, "takeover"));

  /* Takeover adds the old holder to the fence set. */
  sxt_ok(sx_store_publish(s, &b, SX_STORE_TAKEOVER));
  r = cmd("SISMEMBER sx:keys:fence:{decode-3} %s", "11111111111111111111111111111111");
  assert_int_equal(r->integer, 1);
  freeReplyObject(r);
  r = cmd("TTL sx:keys:fence:{%s}", "decode-3");
  assert_true(r->integer > 23 * 3600 && r->integer <= 24 * 3600);
  freeReplyObject(r);
  sxt_rc(sx_store_renew(s, "decode-3", a.incarnation, 30000), SX_EFENCED);
  assert_non_null(strstr(sx_errmsg(), "fenced"));

  /* Unpublish removes the key and the index entry. */
  sxt_ok(sx_store_unpublish(s, "decode-3", b.incarnation));
  r = cmd("EXISTS sx:keys:seg:{%s}", "decode-3");
  assert_int_equal(r->integer, 0);
  freeReplyObject(r);
  r = cmd("ZSCORE sx:keys:index %s", "decode-3");
  assert_int_equal(r->type, REDIS_REPLY_NIL);
  freeReplyObject(r);
  sx_desc_free(&a);
  sx_desc_free(&b);
  sx_store_close(s);
}

/* While the connection is down, ops fail at once instead of queueing; after
 * a restart with the data kept, the segment is still there. */
static void test_redis_ops_fail_fast_while_down(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  char url[512];
  sxt_suite_url(su, "timeout_ms=1000&connect_timeout_ms=1000", url, sizeof(url));
  sxt_store st;
  sxt_ok(sxt_store_open(&st, url, 1));
  uint8_t inc[SX_INCARNATION_LEN], *val;
  size_t len;
  sxt_random_inc(inc);
  sxt_encoded_desc("kept/0", inc, 1, &val, &len);
  sx_publish_req req = sxt_req("kept/0", inc, 1, val, len, 60000, 0);
  sxt_reply r;
  sxt_ok(sxt_publish(&st, &req, &r));
  sxt_reply_free(&r);
  sxt_redis_kill(main_redis, SIGKILL);
  assert_int_equal(sxt_store_wait_conn(&st, 0, 1, 10000), 0);
  uint64_t t0 = sx__mono_ms();
  int rc = sxt_get(&st, "kept/0", &r);
  sxt_reply_free(&r);
  assert_int_equal(rc, SX_EUNREACH);
  assert_true(sx__mono_ms() - t0 < 1000);
  assert_int_equal(sxt_redis_restart_keep(main_redis), 0);
  assert_int_equal(sxt_store_wait_conn(&st, 1, 2, SXT_OP_DEADLINE_MS), 0);
  sxt_ok(sxt_get(&st, "kept/0", &r));
  assert_int_equal(r.len, len);
  sxt_reply_free(&r);
  sxt_ok(sxt_renew(&st, "kept/0", inc, 60000, &r));
  sxt_reply_free(&r);
  sxt_store_close(&st);
  free(val);
}

/* ---------------------------------------------------------------- events */

static int never(void *arg, const sx_event *ev) {
  (void)arg;
  (void)ev;
  return 0;
}

static void *interrupter(void *arg) {
  sleep_ms(300);
  sx_store_interrupt(arg);
  return NULL;
}

static void test_store_watch_interrupt(void **state) {
  (void)state;
  NEED_REDIS();
  sx_store *s = open_ns("events-int");
  pthread_t th;
  uint64_t t0 = sx__mono_ms();
  assert_int_equal(pthread_create(&th, NULL, interrupter, s), 0);
  sxt_rc(sx_store_watch(s, never, NULL), SX_ECANCELED);
  pthread_join(th, NULL);
  assert_true(sx__mono_ms() - t0 < 5000);
  sx_store_close(s);
}


static int until_expired(void *arg, const sx_event *ev) {
  return ev != NULL && ev->kind == SX_EVENT_EXPIRED && strcmp(ev->name, (const char *)arg) == 0;
}

/* Interrupt a watch that has not ended by itself within 10 s. */
typedef struct watchdog {
  sx_store *s;
  atomic_int done;
} watchdog;

static void *watchdog_main(void *arg) {
  watchdog *w = arg;
  for (int i = 0; i < 100 && !atomic_load(&w->done); i++)
    sleep_ms(100);
  if (!atomic_load(&w->done))
    sx_store_interrupt(w->s);
  return NULL;
}

static void test_store_select_db(void **state) {
  (void)state;
  NEED_REDIS();
  char url[256];
  sx_store *s;
  snprintf(url, sizeof(url), "redis://127.0.0.1:%d/3?namespace=dbt", main_redis->port);
  sxt_ok(sx_store_open(url, &s));
  sx_desc d;
  desc_make(&d, "d/0", 0x11, 1, 1000);
  sxt_ok(sx_store_publish(s, &d, 0));
  redisContext *c = sxt_redis_connect(main_redis);
  assert_non_null(c);
  redisReply *r = redisCommand(c, "EXISTS sx:dbt:seg:{d/0}");
  assert_int_equal(r->integer, 0); /* not in db 0 */
  freeReplyObject(r);
  r = redisCommand(c, "SELECT 3");
  freeReplyObject(r);
  r = redisCommand(c, "EXISTS sx:dbt:seg:{d/0}");
  assert_int_equal(r->integer, 1);
  freeReplyObject(r);
  redisFree(c);
  /* Expiry events come from db 3's keyspace channel. */
  watchdog w = {.s = s};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, watchdog_main, &w), 0);
  int rc = sx_store_watch(s, until_expired, (void *)"d/0");
  atomic_store(&w.done, 1);
  pthread_join(th, NULL);
  sxt_ok(rc);
  sx_desc_free(&d);
  sx_store_close(s);
}

/* ---------------------------------------------------- corrupt values */

/* What the suite's planted value cannot show: a key of the wrong type, a
 * value over the descriptor limit, and index entries without a key or with
 * a name that is not one.  (Undecodable bytes are in the suite.) */
static void test_redis_wrong_type_oversized_and_dangling_entries(void **state) {
  (void)state;
  NEED_REDIS();
  sx_store *s = open_ns("corrupt");
  sx_desc good, got;
  desc_make(&good, "good/0", 0x11, 1, 30000);
  sxt_ok(sx_store_publish(s, &good, 0));
  redisContext *c = sxt_redis_connect(main_redis);
  assert_non_null(c);
  redisReply *r = redisCommand(c, "SET sx:corrupt:seg:{str/0} just-a-string");
  freeReplyObject(r);
  /* A value over the 1 MiB descriptor limit is refused, not decoded. */
  size_t big = SX_MAX_DESC_BYTES + 4096;
  char *huge = calloc(1, big);
  assert_non_null(huge);
  r = redisCommand(c, "HSET sx:corrupt:seg:{huge/0} d %b", huge, big);
  assert_non_null(r);
  freeReplyObject(r);
  free(huge);
  r = redisCommand(c, "ZADD sx:corrupt:index 99999999999999 huge/0 99999999999999 str/0 "
                      "99999999999999 gone/0 99999999999999 %s", "bad name!");
  freeReplyObject(r);
  redisFree(c);

  sx_desc_init(&got);
  sxt_rc(sx_store_get(s, "str/0", &got, NULL), SX_EDECODE);
  assert_non_null(strstr(sx_errmsg(), "not a segment"));
  sxt_rc(sx_store_get(s, "huge/0", &got, NULL), SX_ELIMIT);
  assert_non_null(strstr(sx_errmsg(), "limit"));

  sx_store_entry *e;
  size_t n;
  sxt_ok(sx_store_list(s, &e, &n));
  /* gone/0 has no key and "bad name!" is no name: both left out. */
  assert_int_equal(n, 3);
  assert_string_equal(e[0].name, "good/0");
  assert_int_equal(e[0].status, 0);
  assert_int_equal(e[0].desc.n_regions, good.n_regions);
  assert_string_equal(e[1].name, "huge/0");
  assert_int_equal(e[1].status, SX_ELIMIT);
  assert_string_equal(e[2].name, "str/0");
  assert_int_equal(e[2].status, SX_EDECODE);
  sx_store_entries_free(e, n);
  /* An admin can remove them. */
  sxt_ok(sx_store_remove(s, "str/0"));
  sxt_ok(sx_store_remove(s, "huge/0"));
  sxt_ok(sx_store_list(s, &e, &n));
  assert_int_equal(n, 1);
  sx_store_entries_free(e, n);
  sx_desc_free(&good);
  sx_store_close(s);
}

/* ------------------------------------------------ auth, reachability */

static void test_store_auth_requirepass(void **state) {
  (void)state;
  NEED_REDIS();
  sxt_redis r;
  sxt_redis_opts o = {.requirepass = "s3cret-Pw"};
  assert_int_equal(sxt_redis_start(&r, &o), 0);
  char url[256];
  sx_store *s;
  sxt_redis_url(&r, url, sizeof(url), "namespace=auth");
  sxt_ok(sx_store_open(url, &s));
  sx_desc d;
  desc_make(&d, "a/0", 0x11, 1, 30000);
  sxt_ok(sx_store_publish(s, &d, 0));
  sx_store_close(s);
  /* A wrong password: SX_EAUTH, a clear message, never the password. */
  snprintf(url, sizeof(url), "redis://:WrongPass-XYZ@127.0.0.1:%d?namespace=auth", r.port);
  sxt_rc(sx_store_open(url, &s), SX_EAUTH);
  assert_null(strstr(sx_errmsg(), "WrongPass-XYZ"));
  assert_non_null(strstr(sx_errmsg(), "authentication"));
  assert_non_null(strstr(sx_errmsg(), ":***@127.0.0.1"));
  /* No password at all. */
  snprintf(url, sizeof(url), "redis://127.0.0.1:%d?namespace=auth", r.port);
  sxt_rc(sx_store_open(url, &s), SX_EAUTH);
  assert_non_null(strstr(sx_errmsg(), "requires a password"));
  sx_desc_free(&d);
  sxt_redis_stop(&r);
}

/* The two ACL lines of the README, for namespace ns-a instead of prod. */
static const char acl_agent[] =
    "ACL SETUSER sx-agent-ns-a on >Acl-Pass-42 resetkeys ~sx:ns-a:* resetchannels "
    "&sx:ns-a:events &__keyspace@0__:sx:ns-a:seg:* -@all +ping +select +role "
    "+script|load +evalsha +eval +time +type +exists +hget +hmget +hset +del +pexpire "
    "+pttl +sismember +sadd +publish +zadd +zrem +zrange +zremrangebyscore +subscribe "
    "+psubscribe";
static const char acl_reader[] =
    "ACL SETUSER sx-reader-ns-a on >Reader-Pw-7 resetkeys %R~sx:ns-a:* resetchannels "
    "&sx:ns-a:events &__keyspace@0__:sx:ns-a:seg:* -@all +ping +select +role +hmget "
    "+pttl +zrange +subscribe +psubscribe";

static void *interrupt_later(void *arg) {
  sleep_ms(500);
  sx_store_interrupt(arg);
  return NULL;
}

static void test_store_auth_acl_users(void **state) {
  (void)state;
  NEED_REDIS();
  sxt_redis r;
  /* Also an ACL user given to the harness (its own option). */
  sxt_redis_opts o = {.acl_user = "admin", .acl_pass = "Admin-Pw-1"};
  assert_int_equal(sxt_redis_start(&r, &o), 0);
  redisContext *c = sxt_redis_connect(&r);
  assert_non_null(c);
  const char *lines[] = {acl_agent, acl_reader};
  for (int i = 0; i < 2; i++) {
    /* Word by word: the rules contain '%', which redisCommand would format. */
    char buf[1024], *argv[64], *save = NULL;
    int argc = 0;
    snprintf(buf, sizeof(buf), "%s", lines[i]);
    for (char *w = strtok_r(buf, " ", &save); w && argc < 64; w = strtok_r(NULL, " ", &save))
      argv[argc++] = w;
    redisReply *rep = redisCommandArgv(c, argc, (const char **)argv, NULL);
    assert_non_null(rep);
    if (rep->type == REDIS_REPLY_ERROR)
      fail_msg("%s: %s", lines[i], rep->str);
    freeReplyObject(rep);
  }
  redisFree(c);
  char url[256];
  sx_store *s;
  sx_desc d, got;
  desc_make(&d, "a/0", 0x11, 1, 30000);

  /* The agent user: everything in its namespace. */
  snprintf(url, sizeof(url), "redis://sx-agent-ns-a:Acl-Pass-42@127.0.0.1:%d?namespace=ns-a",
           r.port);
  sxt_ok(sx_store_open(url, &s));
  sxt_ok(sx_store_publish(s, &d, 0));
  sxt_ok(sx_store_renew(s, "a/0", d.incarnation, 30000));
  sxt_ok(sx_store_get(s, "a/0", &got, NULL));
  sx_desc_free(&got);
  sx_store_entry *e;
  size_t n;
  sxt_ok(sx_store_list(s, &e, &n));
  assert_int_equal(n, 1);
  sx_store_entries_free(e, n);
  sx_store_close(s);

  /* ... and nothing in another namespace, with a clear error. */
  snprintf(url, sizeof(url), "redis://sx-agent-ns-a:Acl-Pass-42@127.0.0.1:%d?namespace=ns-b",
           r.port);
  sxt_ok(sx_store_open(url, &s));
  sxt_rc(sx_store_publish(s, &d, 0), SX_EAUTH);
  assert_non_null(strstr(sx_errmsg(), "NOPERM"));
  sx_store_close(s);

  /* The reader: lists, gets and watches, but cannot write. */
  snprintf(url, sizeof(url), "redis://sx-reader-ns-a:Reader-Pw-7@127.0.0.1:%d?namespace=ns-a",
           r.port);
  sxt_ok(sx_store_open(url, &s));
  sxt_ok(sx_store_get(s, "a/0", &got, NULL));
  sx_desc_free(&got);
  sxt_ok(sx_store_list(s, &e, &n));
  assert_int_equal(n, 1);
  sx_store_entries_free(e, n);
  d.generation = 2;
  sxt_rc(sx_store_publish(s, &d, 0), SX_EAUTH);
  sxt_rc(sx_store_remove(s, "a/0"), SX_EAUTH);
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, interrupt_later, s), 0);
  /* Subscribing is allowed: the watch runs until interrupted. */
  sxt_rc(sx_store_watch(s, never, NULL), SX_ECANCELED);
  pthread_join(th, NULL);
  sx_store_close(s);

  /* The right user with a wrong password. */
  snprintf(url, sizeof(url), "redis://sx-agent-ns-a:nope-nope@127.0.0.1:%d?namespace=ns-a",
           r.port);
  sxt_rc(sx_store_open(url, &s), SX_EAUTH);
  assert_null(strstr(sx_errmsg(), "nope-nope"));
  assert_non_null(strstr(sx_errmsg(), "'sx-agent-ns-a'"));
  assert_non_null(strstr(sx_errmsg(), "sx-agent-ns-a:***@"));
  sx_desc_free(&d);
  sxt_redis_stop(&r);
}

static void test_store_unreachable(void **state) {
  (void)state;
  int port = sxt_free_port();
  char url[256];
  sx_store *s;
  snprintf(url, sizeof(url), "redis://u:Hidden-Pw@127.0.0.1:%d/2?namespace=x", port);
  uint64_t t0 = sx__mono_ms();
  sxt_rc(sx_store_open(url, &s), SX_EUNREACH);
  /* A refused connect is reported at once, not after connect_timeout_ms. */
  assert_true(sx__mono_ms() - t0 < 1500);
  char expect[64];
  snprintf(expect, sizeof(expect), "127.0.0.1:%d", port);
  assert_non_null(strstr(sx_errmsg(), expect));
  assert_non_null(strstr(sx_errmsg(), "u:***@"));
  assert_null(strstr(sx_errmsg(), "Hidden-Pw"));
  assert_non_null(strstr(sx_errmsg(), "running"));
  sxt_rc(sx_store_open("redis://127.0.0.1:99999", &s), SX_EURL);
  assert_non_null(strstr(sx_errmsg(), "port"));
}

/* --------------------------------------------------------- timeouts */

static void test_store_command_timeout(void **state) {
  (void)state;
  NEED_REDIS();
  sxt_redis r;
  assert_int_equal(sxt_redis_start(&r, NULL), 0);
  char url[256];
  sx_store *s;
  sxt_redis_url(&r, url, sizeof(url), "namespace=to&timeout_ms=500&connect_timeout_ms=500");
  sxt_ok(sx_store_open(url, &s));
  sx_desc d, got;
  desc_make(&d, "t/0", 0x11, 1, 30000);
  sxt_ok(sx_store_publish(s, &d, 0));
  sxt_redis_kill(&r, SIGSTOP);
  uint64_t t0 = sx__mono_ms();
  sxt_rc(sx_store_get(s, "t/0", &got, NULL), SX_ETIMEDOUT);
  uint64_t took = sx__mono_ms() - t0;
  fprintf(stderr, "command timed out after %llu ms (timeout_ms=500)\n",
          (unsigned long long)took);
  assert_true(took >= 450 && took < 500 * 3 + 500);
  assert_non_null(strstr(sx_errmsg(), "500 ms"));
  /* A new connection to a stopped server times out in its handshake. */
  sx_store *s2;
  t0 = sx__mono_ms();
  sxt_rc(sx_store_open(url, &s2), SX_ETIMEDOUT);
  took = sx__mono_ms() - t0;
  assert_true(took >= 450 && took < 500 * 3 + 500);
  /* Once the server is back, the first store reconnects by itself. */
  sxt_redis_kill(&r, SIGCONT);
  int rc = -1;
  for (int i = 0; i < 100 && rc != 0; i++) {
    rc = sx_store_get(s, "t/0", &got, NULL);
    if (rc != 0)
      sleep_ms(50);
  }
  sxt_ok(rc);
  sx_desc_free(&got);
  sx_desc_free(&d);
  sx_store_close(s);
  sxt_redis_stop(&r);
}

/* ------------------------------------------- the async backend directly */

/* A publisher as the agent runs it: renew every renew_ms; on SX_EGONE
 * republish with the next generation; renew at once when the connection
 * comes back. */
typedef struct bk {
  uv_loop_t loop;
  sx_backend *b;
  uv_timer_t renew, tick;
  int ups, downs, last_err;
  char name[64];
  uint8_t inc[SX_INCARNATION_LEN];
  uint64_t gen;
  uint8_t *val;
  size_t len;
  uint32_t lease_ms, renew_ms;
  int inflight, published, gone_seen, republished;
  uint64_t republished_at;
} bk;

static void bk_renew_now(bk *k);

static void bk_on_conn(void *arg, int up, int err, const char *msg) {
  bk *k = arg;
  (void)msg;
  if (up) {
    k->ups++;
    if (k->published)
      bk_renew_now(k);
  } else {
    k->downs++;
    k->last_err = err;
  }
}

static void bk_published(void *arg, const sx_backend_reply *rep) {
  bk *k = arg;
  k->inflight = 0;
  if (rep->status != 0)
    return;
  if (k->published)
    k->republished++, k->republished_at = sx__mono_ms();
  k->published = 1;
}

static int bk_publish(bk *k) {
  sx_publish_req req = {.name = k->name, .incarnation = k->inc, .generation = k->gen,
                        .value = k->val, .len = k->len, .lease_ms = k->lease_ms};
  k->inflight = 1;
  int rc = sx__backend_publish(k->b, &req, bk_published, k);
  if (rc)
    k->inflight = 0;
  return rc;
}

static void bk_renewed(void *arg, const sx_backend_reply *rep) {
  bk *k = arg;
  k->inflight = 0;
  if (rep->status == SX_EGONE) {
    k->gone_seen++;
    k->gen++;
    bk_publish(k);
  }
}

static void bk_renew_now(bk *k) {
  if (k->inflight || !k->published)
    return;
  k->inflight = 1;
  if (sx__backend_renew(k->b, k->name, k->inc, k->lease_ms, bk_renewed, k) != 0)
    k->inflight = 0;
}

static void bk_tick(uv_timer_t *t) { (void)t; }

static void bk_open(bk *k, const char *url, const char *name) {
  memset(k, 0, sizeof(*k));
  assert_int_equal(uv_loop_init(&k->loop), 0);
  uv_timer_init(&k->loop, &k->renew);
  uv_timer_init(&k->loop, &k->tick);
  k->renew.data = k;
  /* A tick keeps uv_run(ONCE) returning so that waits can check a clock. */
  uv_timer_start(&k->tick, bk_tick, 20, 20);
  snprintf(k->name, sizeof(k->name), "%s", name);
  memset(k->inc, 0x5a, sizeof(k->inc));
  k->gen = 1;
  k->lease_ms = 1000;
  k->renew_ms = 1000 / 3;
  sx_desc d;
  desc_make(&d, name, 0x5a, 1, k->lease_ms);
  sxt_ok(sx_desc_encode(&d, &k->val, &k->len));
  sx_desc_free(&d);
  sx_backend_hooks h = {.on_conn = bk_on_conn, .arg = k};
  sxt_ok(sx__backend_open(&k->loop, url, &h, &k->b));
}

/* Run the loop until *flag becomes non-zero or ms pass; returns *flag. */
static int bk_run(bk *k, const int *flag, int ms) {
  uint64_t end = sx__mono_ms() + (uint64_t)ms;
  while (!*flag && sx__mono_ms() < end)
    uv_run(&k->loop, UV_RUN_ONCE);
  return *flag;
}

static void bk_close(bk *k) {
  sx__backend_close(k->b);
  uv_close((uv_handle_t *)&k->renew, NULL);
  uv_close((uv_handle_t *)&k->tick, NULL);
  uv_run(&k->loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&k->loop), 0); /* every handle closed */
  free(k->val);
}

/* A fetch copies the reply's value out in its callback. */
typedef struct fetched {
  int calls, status;
  int64_t ttl_ms;
  uint8_t value[4096];
  size_t len;
} fetched;

static void fetched_cb(void *arg, const sx_backend_reply *rep) {
  fetched *f = arg;
  f->calls++;
  f->status = rep->status;
  f->ttl_ms = rep->ttl_ms;
  f->len = rep->status == 0 && rep->len <= sizeof(f->value) ? rep->len : 0;
  if (f->len)
    memcpy(f->value, rep->value, f->len);
}

/* fetch (what the resolver cache uses): the stored bytes in one command,
 * no lease facts; missing, wrong-typed and oversized values as get has them. */
static void test_backend_fetch(void **state) {
  (void)state;
  NEED_REDIS();
  char url[256];
  url_ns(main_redis, url, sizeof(url), "fetch");
  bk k;
  bk_open(&k, url, "f/0");
  assert_true(bk_run(&k, &k.ups, 5000));
  sxt_ok(bk_publish(&k));
  assert_true(bk_run(&k, &k.published, 5000));
  fetched f = {0};
  sxt_ok(sx__backend_fetch(k.b, "f/0", fetched_cb, &f));
  assert_true(bk_run(&k, &f.calls, 5000));
  assert_int_equal(f.status, 0);
  assert_int_equal(f.ttl_ms, -1);
  assert_int_equal(f.len, k.len);
  assert_memory_equal(f.value, k.val, k.len);

  memset(&f, 0, sizeof(f));
  sxt_ok(sx__backend_fetch(k.b, "nobody/0", fetched_cb, &f));
  assert_true(bk_run(&k, &f.calls, 5000));
  assert_int_equal(f.status, SX_ENOENT);

  redisReply *r = sxt_redis_command(main_redis, "SET sx:fetch:seg:{str/0} just-a-string");
  freeReplyObject(r);
  memset(&f, 0, sizeof(f));
  sxt_ok(sx__backend_fetch(k.b, "str/0", fetched_cb, &f));
  assert_true(bk_run(&k, &f.calls, 5000));
  assert_int_equal(f.status, SX_EDECODE);

  size_t big = SX_MAX_DESC_BYTES + 1;
  char *huge = calloc(1, big);
  assert_non_null(huge);
  r = sxt_redis_command(main_redis, "HSET sx:fetch:seg:{huge/0} d %b", huge, big);
  freeReplyObject(r);
  free(huge);
  memset(&f, 0, sizeof(f));
  sxt_ok(sx__backend_fetch(k.b, "huge/0", fetched_cb, &f));
  assert_true(bk_run(&k, &f.calls, 5000));
  assert_int_equal(f.status, SX_ELIMIT);
  sxt_rc(sx__backend_fetch(k.b, "bad name!", fetched_cb, &f), SX_ENAME);
  bk_close(&k);
}

/* ------------------------------------------------------------- sentinel */

/* SENTINEL FAILOVER from m to its replica rp, then check that the idle
 * backend k (opened through the sentinels) came back up on rp by itself and
 * that s, which published d (in namespace ns) on m, publishes it on rp. */
static void sentinel_failover_follow(sx_store *s, bk *k, sx_desc *d, const char *ns,
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
    sleep_ms(200);
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
  desc_make(&rd, "ro/0", 0x11, 1, 60000);
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
  bk k;
  redisReply *rep;
  bk_open(&k, url, "idle/0");
  assert_true(bk_run(&k, &k.ups, 10000));
  assert_int_equal(((redis_backend *)k.b)->port, m.port);
  sx_desc d;
  desc_make(&d, "s/0", 0x11, 1, 60000);
  sxt_ok(sx_store_publish(s, &d, 0));
  rep = sxt_redis_command(&m, "HGET sx:sent:seg:{s/0} gen");
  assert_non_null(rep);
  assert_string_equal(rep->str, "1"); /* written to the master */
  freeReplyObject(rep);

  sentinel_failover_follow(s, &k, &d, "sent", &m, &rp, &st);
  bk_close(&k);
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
  bk k;
  bk_open(&k, url, "swatch/0");
  assert_true(bk_run(&k, &k.ups, 10000));
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
  bk_close(&k);
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
   * (the README's rules): ask for the master, hear +switch-master. */
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
  desc_make(&d, "sa/0", 0x21, 1, 60000);
  sxt_ok(sx_store_publish(s, &d, 0));
  redisReply *rep = sxt_redis_command(&m, "HGET sx:sauth:seg:{sa/0} gen");
  assert_non_null(rep);
  assert_string_equal(rep->str, "1"); /* written to the master */
  freeReplyObject(rep);
  /* An idle backend as the sentinels' ACL user: its +switch-master watch
   * is subscribed under that user. */
  snprintf(url, sizeof(url), base, st.port);
  strcat(url, "&sentinel_user=sx-watch&sentinel_password=" SENT_USER_PW);
  bk k;
  bk_open(&k, url, "sidle/0");
  assert_true(bk_run(&k, &k.ups, 10000));
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
  bk_close(&k);
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
 * sentinels get requirepass (the README's way to introduce one). */
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
  desc_make(&d, "open/0", 0x31, 1, 60000);
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
      SXT_STORE_SUITE,
      cmocka_unit_test(test_redis_key_schema_is_documented),
      SXT_SUITE_TEST(test_redis_ops_fail_fast_while_down),
      cmocka_unit_test(test_redis_wrong_type_oversized_and_dangling_entries),
      cmocka_unit_test(test_store_watch_interrupt),
      cmocka_unit_test(test_store_select_db),
      cmocka_unit_test(test_store_auth_requirepass),
      cmocka_unit_test(test_store_auth_acl_users),
      cmocka_unit_test(test_store_unreachable),
      cmocka_unit_test(test_store_command_timeout),
      cmocka_unit_test(test_backend_fetch),
      cmocka_unit_test(test_store_sentinel_failover),
      cmocka_unit_test(test_store_sentinel_watch_stays_subscribed),
      cmocka_unit_test(test_store_sentinel_auth),
      cmocka_unit_test(test_store_sentinel_password_before_requirepass),
  };
  return cmocka_run_group_tests_name("store suite and Redis specifics on redis-server",
                                     tests, group_setup, group_teardown);
}
