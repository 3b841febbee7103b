/*
 * The synchronous store client (store.c) over the in-process mem:// backend:
 * decoding and validation of what it reads, per-entry errors in listings.
 * The same calls against real Redis are in test_store_redis.c.
 */
#include <stdlib.h>
#include <string.h>

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
  sxt_rc(sx_store_open("etcd://127.0.0.1:1", &s), SX_ENOTSUP);
  assert_non_null(strstr(sx_errmsg(), "etcd"));
  sxt_ok(sx_store_open("mem://unit-args", &s));
  sx_desc d;
  sxt_rc(sx_store_get(s, NULL, &d, NULL), SX_EINVAL);
  sxt_rc(sx_store_get(s, "/bad", &d, NULL), SX_ENAME);
  sxt_rc(sx_store_list(s, NULL, NULL), SX_EINVAL);
  sxt_rc(sx_store_watch(s, NULL, NULL), SX_EINVAL);
  sx_store_close(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_store_mem_roundtrip),
      cmocka_unit_test(test_store_mem_corrupt_entries),
      cmocka_unit_test(test_store_bad_arguments),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
