/*
 * The Redis metadata store against real redis-server processes (started by
 * tests/support/redis_harness.c on free loopback ports): the sync client
 * (store.c) and, where timing matters, the async backend directly.
 *
 * Timing checks have wide margins: the machine is shared with other builds.
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "internal.h"
#include "redis_harness.h"
#include "sxtest.h"

static sxt_redis main_redis; /* notify-keyspace-events Kx */
static int have_redis;

static SX__UNUSED void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static int group_setup(void **state) {
  (void)state;
  sxt_redis_opts o = {.notify = "Kx"};
  have_redis = sxt_redis_start(&main_redis, &o) == 0;
  if (!have_redis)
    fprintf(stderr, "test_store_redis: cannot start redis-server (is the redis-server "
            "package installed?): every test here is skipped\n");
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

/* A URL for the shared server in a namespace of the test's own. */
static void url_ns(const sxt_redis *r, char *buf, size_t size, const char *ns) {
  char q[128];
  snprintf(q, sizeof(q), "namespace=%s", ns);
  sxt_redis_url(r, buf, size, q);
}

static sx_store *open_ns(const char *ns) {
  char url[256];
  sx_store *s = NULL;
  url_ns(&main_redis, url, sizeof(url), ns);
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

static void test_store_publish_get_list_unpublish(void **state) {
  (void)state;
  NEED_REDIS();
  sx_store *s = open_ns("basic");
  sx_desc a, b, got;
  desc_make(&a, "prefill-0/tp0", 0x11, 1, 30000);
  desc_make(&b, "decode-1/tp0", 0x22, 5, 30000);
  sxt_ok(sx_store_publish(s, &a, 0));
  sxt_ok(sx_store_publish(s, &b, 0));

  sx_store_lease lease;
  sxt_ok(sx_store_get(s, "prefill-0/tp0", &got, &lease));
  assert_string_equal(got.name, "prefill-0/tp0");
  assert_memory_equal(got.incarnation, a.incarnation, SX_INCARNATION_LEN);
  assert_int_equal(got.generation, 1);
  assert_int_equal(got.n_regions, a.n_regions);
  assert_true(lease.ttl_ms > 20000 && lease.ttl_ms <= 30000);
  assert_true(lease.renewed_ago_ms >= 0 && lease.renewed_ago_ms < 10000);
  sx_desc_free(&got);

  sx_store_entry *e;
  size_t n;
  sxt_ok(sx_store_list(s, &e, &n));
  assert_int_equal(n, 2);
  assert_string_equal(e[0].name, "decode-1/tp0"); /* sorted */
  assert_string_equal(e[1].name, "prefill-0/tp0");
  assert_int_equal(e[0].status, 0);
  assert_int_equal(e[0].desc.generation, 5);
  assert_true(e[1].lease.ttl_ms > 20000);
  sx_store_entries_free(e, n);

  /* Another namespace on the same server sees nothing of this one. */
  sx_store *other = open_ns("basic-other");
  sxt_ok(sx_store_list(other, &e, &n));
  assert_int_equal(n, 0);
  assert_null(e);
  sxt_rc(sx_store_get(other, "prefill-0/tp0", &got, NULL), SX_ENOENT);
  sx_store_close(other);

  /* Unpublish: only by the owner. */
  uint8_t wrong[SX_INCARNATION_LEN];
  memset(wrong, 0x99, sizeof(wrong));
  sxt_rc(sx_store_unpublish(s, "prefill-0/tp0", wrong), SX_EFENCED);
  sxt_ok(sx_store_unpublish(s, "prefill-0/tp0", a.incarnation));
  sxt_rc(sx_store_get(s, "prefill-0/tp0", &got, NULL), SX_ENOENT);
  assert_non_null(strstr(sx_errmsg(), "prefill-0/tp0"));
  sxt_rc(sx_store_unpublish(s, "prefill-0/tp0", a.incarnation), SX_EGONE);
  sxt_ok(sx_store_list(s, &e, &n));
  assert_int_equal(n, 1);
  assert_string_equal(e[0].name, "decode-1/tp0");
  sx_store_entries_free(e, n);

  /* The listing index is the only way list finds segments: no KEYS. */
  redisReply *r = sxt_redis_command(&main_redis, "ZRANGE sx:basic:index 0 -1");
  assert_non_null(r);
  assert_int_equal(r->type, REDIS_REPLY_ARRAY);
  assert_int_equal(r->elements, 1);
  assert_string_equal(r->element[0]->str, "decode-1/tp0");
  freeReplyObject(r);
  r = sxt_redis_command(&main_redis, "HGET sx:basic:seg:{decode-1/tp0} gen");
  assert_non_null(r);
  assert_string_equal(r->str, "5");
  freeReplyObject(r);

  /* Renew extends; a renew by another incarnation is fenced. */
  sxt_ok(sx_store_renew(s, "decode-1/tp0", b.incarnation, 60000));
  sxt_ok(sx_store_get(s, "decode-1/tp0", &got, &lease));
  assert_true(lease.ttl_ms > 50000);
  sx_desc_free(&got);
  sxt_rc(sx_store_renew(s, "decode-1/tp0", wrong, 60000), SX_EFENCED);
  sxt_rc(sx_store_renew(s, "nobody", wrong, 60000), SX_EGONE);

  /* Admin removal. */
  sxt_ok(sx_store_remove(s, "decode-1/tp0"));
  sxt_rc(sx_store_remove(s, "decode-1/tp0"), SX_ENOENT);
  sxt_rc(sx_store_get(s, "bad name with spaces", &got, NULL), SX_ENAME);

  sx_desc_free(&a);
  sx_desc_free(&b);
  sx_store_close(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_store_publish_get_list_unpublish),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
