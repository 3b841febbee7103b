/*
 * The synchronous store client (store.c) over the in-process mem:// backend:
 * decoding and validation of what it reads, per-entry errors in listings.
 * The same calls against real Redis are in test_store_redis.c.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "sxtest.h"

static void desc_make(sx_desc *d, const char *name, uint8_t inc) {
  sxt_desc_kv(d, name, 4, 0, 4096, 16, 0);
  memset(d->incarnation, inc, SX_INCARNATION_LEN);
  d->lease_ms = 30000;
}

static void test_store_mem_roundtrip(void **state) {
  (void)state;
  sx_store *s;
  sxt_ok(sx_store_open("mem://unit-rt?namespace=a", &s));
  assert_string_equal(sx_store_url(s), "mem://unit-rt?namespace=a");
  sx_desc d, got;
  desc_make(&d, "p/0", 0x11);
  sxt_ok(sx_store_publish(s, &d, 0));
  sx_store_lease lease;
  sxt_ok(sx_store_get(s, "p/0", &got, &lease));
  assert_string_equal(got.name, "p/0");
  assert_int_equal(got.n_regions, d.n_regions);
  assert_true(lease.ttl_ms > 20000);
  assert_true(lease.renewed_ago_ms >= 0 && lease.renewed_ago_ms < 5000);
  sx_desc_free(&got);
  /* A descriptor that breaks a rule is refused before it is sent. */
  d.regions[0].block_stride = d.regions[0].block_bytes - 1;
  d.generation++;
  sxt_rc(sx_store_publish(s, &d, 0), SX_ESTRIDE);
  assert_non_null(strstr(sx_errmsg(), "p/0: publish"));
  sx_desc_free(&d);
  sx_store_close(s);
  sx_store_close(NULL);
}

static void test_store_mem_corrupt_entries(void **state) {
  (void)state;
  sx_store *s;
  sxt_ok(sx_store_open("mem://unit-bad?namespace=a", &s));
  sx_desc d, got;
  desc_make(&d, "ok/0", 0x11);
  sxt_ok(sx_store_publish(s, &d, 0));
  /* Garbage bytes, and a valid descriptor stored under another name. */
  uint8_t inc[SX_INCARNATION_LEN], junk[] = {0xff, 0xff, 0xff, 0x01, 0x02};
  memset(inc, 0x22, sizeof(inc));
  sxt_ok(sx_store_publish_raw(s, "junk/0", inc, 1, junk, sizeof(junk), 30000, 0));
  uint8_t *buf;
  size_t len;
  sxt_ok(sx_desc_encode(&d, &buf, &len));
  memset(inc, 0x33, sizeof(inc));
  sxt_ok(sx_store_publish_raw(s, "alias/0", inc, 1, buf, len, 30000, 0));
  free(buf);

  sx_desc_init(&got);
  int rc = sx_store_get(s, "junk/0", &got, NULL);
  assert_int_not_equal(rc, 0);
  assert_non_null(strstr(sx_errmsg(), "junk/0: the stored descriptor is corrupt"));
  sxt_rc(sx_store_get(s, "alias/0", &got, NULL), SX_EDECODE);
  assert_non_null(strstr(sx_errmsg(), "names itself 'ok/0'"));
  sxt_rc(sx_store_get(s, "none/0", &got, NULL), SX_ENOENT);

  sx_store_entry *e;
  size_t n;
  sxt_ok(sx_store_list(s, &e, &n));
  assert_int_equal(n, 3);
  assert_string_equal(e[0].name, "alias/0");
  assert_int_equal(e[0].status, SX_EDECODE);
  assert_string_equal(e[1].name, "junk/0");
  assert_int_not_equal(e[1].status, 0);
  assert_non_null(strstr(e[1].message, "corrupt"));
  assert_string_equal(e[2].name, "ok/0");
  assert_int_equal(e[2].status, 0);
  assert_string_equal(e[2].desc.name, "ok/0");
  sx_store_entries_free(e, n);
  sx_store_entries_free(NULL, 0);
  sx_desc_free(&d);
  sx_store_close(s);
}

static void test_store_bad_arguments(void **state) {
  (void)state;
  sx_store *s;
  sxt_rc(sx_store_open("nope://x", &s), SX_EURL);
  /* etcd is built in: nothing listens on port 1, and the message says so. */
  sxt_rc(sx_store_open("etcd://127.0.0.1:1", &s), SX_EUNREACH);
  assert_non_null(strstr(sx_errmsg(), "etcd"));
  assert_non_null(strstr(sx_errmsg(), "127.0.0.1:1"));
  sxt_ok(sx_store_open("mem://unit-args", &s));
  sx_desc d;
  sxt_rc(sx_store_get(s, NULL, &d, NULL), SX_EINVAL);
  sxt_rc(sx_store_get(s, "/bad", &d, NULL), SX_ENAME);
  sxt_rc(sx_store_list(s, NULL, NULL), SX_EINVAL);
  sxt_rc(sx_store_watch(s, NULL, NULL), SX_EINVAL);
  sx_store_close(s);
}

/* Regression: the synchronous client waited with uv_run(UV_RUN_ONCE), which
 * runs due timers first and then blocks in poll.  When the answer came from
 * a timer callback (libcurl's multi interface delivers etcd answers that
 * way, often on a loaded machine), the wait blocked forever: sxctl show
 * hung on etcd.  A mem:// store with a delay answers from a timer. */
typedef struct delayed_run {
  int rc, done;
} delayed_run;

static void *delayed_ops(void *arg) {
  delayed_run *d = arg;
  sx_store *s;
  sx_desc desc, got;
  sx_store_entry *e;
  size_t n;
  desc_make(&desc, "late/0", 0x31);
  d->rc = sx_store_open("mem://unit-delayed?namespace=d", &s);
  if (d->rc == 0)
    d->rc = sx_store_publish(s, &desc, 0);
  if (d->rc == 0 && (d->rc = sx_store_get(s, "late/0", &got, NULL)) == 0)
    sx_desc_free(&got);
  if (d->rc == 0 && (d->rc = sx_store_list(s, &e, &n)) == 0)
    sx_store_entries_free(e, n);
  if (d->rc == 0)
    d->rc = sx_store_unpublish(s, "late/0", desc.incarnation);
  if (d->rc == 0)
    sx_store_close(s);
  sx_desc_free(&desc);
  d->done = 1;
  return NULL;
}

static void test_store_answers_from_a_timer_end_the_wait(void **state) {
  (void)state;
  sx__mem_set_delay("unit-delayed", 1, 0);
  delayed_run d = {0};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, delayed_ops, &d), 0);
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 10;
  if (pthread_timedjoin_np(th, NULL, &until) != 0)
    fail_msg("a synchronous store call did not return within 10 s when its answer came "
             "from a timer");
  sxt_ok(d.rc);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_store_mem_roundtrip),
      cmocka_unit_test(test_store_mem_corrupt_entries),
      cmocka_unit_test(test_store_bad_arguments),
      cmocka_unit_test(test_store_answers_from_a_timer_end_the_wait),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
