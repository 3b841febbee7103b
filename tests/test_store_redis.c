/*
 * The store integration suite (tests/support/store_suite.c, shared with
 * etcd) against a real redis-server, then what only Redis has: the key
 * schema, SELECT db, keyspace-notification expiry, values of the wrong type
 * or size and dangling index entries, requirepass and ACL users, command
 * timeouts, and the async backend's fetch.  Sentinel has its own binary
 * (test_store_sentinel.c).  Servers are started by
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
#include "segxfer/agent.h"
#include "backend_publisher.h"
#include "internal.h"
#include "procs.h"
#include "redis_harness.h"
#include "store_suite.h"

/* The suite's server (persisting, notify-keyspace-events Kx), shared by the
 * Redis-only tests; NULL when redis-server is not installed. */
static sxt_redis *main_redis;

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

static redisReply *cmd(const char *fmt, const char *arg) {
  redisReply *r = sxt_redis_command(main_redis, fmt, arg);
  assert_non_null(r);
  return r;
}

/* ---------------------------------------------------------- key schema */

/* The keys docs/store.md documents for admins, written as it says, and the
 * synchronous client's messages over them. */
static void test_redis_key_schema_is_documented(void **state) {
  (void)state;
  NEED_REDIS();
  sx_store *s = open_ns("keys");
  sx_desc a, b;
  sxt_desc_make(&a, "decode-3", 0x11, 5, 30000);
  sxt_desc_make(&b, "decode-3", 0x44, 1, 30000);
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
  sxt_sleep_ms(300);
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
    sxt_sleep_ms(100);
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
  sxt_desc_make(&d, "d/0", 0x11, 1, 1000);
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
  sxt_desc_make(&good, "good/0", 0x11, 1, 30000);
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
  sxt_desc_make(&d, "a/0", 0x11, 1, 30000);
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

/* The two ACL lines of docs/store.md, for namespace ns-a instead of prod. */
static const char acl_agent[] =
    "ACL SETUSER sx-agent-ns-a on >Acl-Pass-42 resetkeys ~sx:ns-a:* resetchannels "
    "&sx:ns-a:events &__keyspace@0__:sx:ns-a:seg:* -@all +ping +select +role "
    "+script|load +evalsha +eval +time +type +exists +hget +hmget +hset +del +pexpire "
    "+pttl +sismember +sadd +publish +zadd +zrem +zrange +zremrangebyscore +subscribe "
    "+psubscribe";
static const char acl_reader[] =
    "ACL SETUSER sx-reader-ns-a on >Reader-Pw-7 resetkeys %R~sx:ns-a:* resetchannels "
    "&sx:ns-a:events &__keyspace@0__:sx:ns-a:seg:* -@all +ping +select +role +hget +hmget "
    "+pttl +zrange +subscribe +psubscribe";

/* docs/store.md's reader line as it was before resolves read with HGET: an
 * agent of this user is refused, and the message says why. */
static const char acl_old_reader[] =
    "ACL SETUSER sx-old-ns-a on >Old-Pw-9 resetkeys %R~sx:ns-a:* resetchannels "
    "&sx:ns-a:events &__keyspace@0__:sx:ns-a:seg:* -@all +ping +select +role +hmget "
    "+pttl +zrange +subscribe +psubscribe";

static void *interrupt_later(void *arg) {
  sxt_sleep_ms(500);
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
  const char *lines[] = {acl_agent, acl_reader, acl_old_reader};
  for (int i = 0; i < 3; i++) {
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
  sxt_desc_make(&d, "a/0", 0x11, 1, 30000);

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
  /* ... and resolves by name through an agent's cache, as every decode
   * engine does (its reads are not sx_store_get's: HGET of the value). */
  sx_agent_params ap;
  sx_agent_params_init(&ap);
  ap.metadata_url = url;
  ap.transports = SX_TRANSPORTS_TCP;
  sx_agent *ra;
  sxt_ok(sx_agent_create(&ap, &ra));
  sx_segment *seg;
  sxt_ok(sx_segment_open(ra, "a/0", 2000, &seg));
  assert_memory_equal(sx_segment_desc(seg)->incarnation, d.incarnation, SX_INCARNATION_LEN);
  sx_segment_close(seg);
  sx_agent_destroy(ra);
  snprintf(url, sizeof(url), "redis://sx-old-ns-a:Old-Pw-9@127.0.0.1:%d?namespace=ns-a",
           r.port);
  sxt_ok(sx_agent_create(&ap, &ra));
  sxt_rc(sx_segment_open(ra, "a/0", 2000, &seg), SX_EAUTH);
  assert_non_null(strstr(sx_errmsg(), "lacks a permission"));
  assert_non_null(strstr(sx_errmsg(), "hget"));
  sx_agent_destroy(ra);

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
  sxt_desc_make(&d, "t/0", 0x11, 1, 30000);
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
      sxt_sleep_ms(50);
  }
  sxt_ok(rc);
  sx_desc_free(&got);
  sx_desc_free(&d);
  sx_store_close(s);
  sxt_redis_stop(&r);
}

/* ------------------------------------------- the async backend directly */

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
  sxt_bk k;
  sxt_bk_open(&k, url, "f/0");
  assert_true(sxt_bk_run(&k, &k.ups, 5000));
  sxt_ok(sxt_bk_publish(&k));
  assert_true(sxt_bk_run(&k, &k.published, 5000));
  fetched f = {0};
  sxt_ok(sx__backend_fetch(k.b, "f/0", fetched_cb, &f));
  assert_true(sxt_bk_run(&k, &f.calls, 5000));
  assert_int_equal(f.status, 0);
  assert_int_equal(f.ttl_ms, -1);
  assert_int_equal(f.len, k.len);
  assert_memory_equal(f.value, k.val, k.len);

  memset(&f, 0, sizeof(f));
  sxt_ok(sx__backend_fetch(k.b, "nobody/0", fetched_cb, &f));
  assert_true(sxt_bk_run(&k, &f.calls, 5000));
  assert_int_equal(f.status, SX_ENOENT);

  redisReply *r = sxt_redis_command(main_redis, "SET sx:fetch:seg:{str/0} just-a-string");
  freeReplyObject(r);
  memset(&f, 0, sizeof(f));
  sxt_ok(sx__backend_fetch(k.b, "str/0", fetched_cb, &f));
  assert_true(sxt_bk_run(&k, &f.calls, 5000));
  assert_int_equal(f.status, SX_EDECODE);

  size_t big = SX_MAX_DESC_BYTES + 1;
  char *huge = calloc(1, big);
  assert_non_null(huge);
  r = sxt_redis_command(main_redis, "HSET sx:fetch:seg:{huge/0} d %b", huge, big);
  freeReplyObject(r);
  free(huge);
  memset(&f, 0, sizeof(f));
  sxt_ok(sx__backend_fetch(k.b, "huge/0", fetched_cb, &f));
  assert_true(sxt_bk_run(&k, &f.calls, 5000));
  assert_int_equal(f.status, SX_ELIMIT);
  sxt_rc(sx__backend_fetch(k.b, "bad name!", fetched_cb, &f), SX_ENAME);
  sxt_bk_close(&k);
}

/* The server stops answering; the op that times out first closes the
 * backend from its callback while its command and another op's are still
 * outstanding.  Both end once, and the first is not touched after the
 * close released it (a heap-use-after-free under the sanitizers before). */
static void test_store_close_from_a_timed_out_op(void **state) {
  (void)state;
  NEED_REDIS();
  sxt_redis r;
  assert_int_equal(sxt_redis_start(&r, NULL), 0);
  char url[256];
  sxt_redis_url(&r, url, sizeof(url), "namespace=cl&timeout_ms=300");
  sxt_store st;
  sxt_ok(sxt_store_open(&st, url, 1));
  sxt_redis_kill(&r, SIGSTOP);
  sxt_store_close_from_timed_out_op(&st, "stuck/0");
  sxt_redis_kill(&r, SIGCONT);
  sxt_redis_stop(&r);
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
      cmocka_unit_test(test_store_close_from_a_timed_out_op),
      cmocka_unit_test(test_backend_fetch),
  };
  return cmocka_run_group_tests_name("store suite and Redis specifics on redis-server",
                                     tests, group_setup, group_teardown);
}
