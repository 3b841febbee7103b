/* The error table: every code has a distinct name and a message. */
#include <string.h>

#include <stdio.h>

#include "internal.h"
#include "sxtest.h"

static const int all_codes[] = {
#define X(name, val, msg) SX_E##name,
    SX_ERRNO_MAP(X)
#undef X
};

static void test_errors_every_code_has_name_and_message(void **state) {
  (void)state;
  size_t n = sizeof(all_codes) / sizeof(all_codes[0]);
  assert_true(n >= 30);
  for (size_t i = 0; i < n; i++) {
    int c = all_codes[i];
    assert_true(c < 0);
    assert_true(c >= SX_ERRNO_MIN);
    assert_string_not_equal(sx_err_name(c), "SX_UNKNOWN");
    assert_int_equal(strncmp(sx_err_name(c), "SX_E", 4), 0);
    assert_string_not_equal(sx_strerror(c), "unknown error");
    assert_true(strlen(sx_strerror(c)) > 3);
    for (size_t j = 0; j < i; j++) {
      assert_int_not_equal(all_codes[j], c);
      assert_string_not_equal(sx_err_name(all_codes[j]), sx_err_name(c));
    }
  }
  /* The codes are dense from -1 to SX_ERRNO_MIN. */
  assert_int_equal((int)n, -SX_ERRNO_MIN);
}

static void test_errors_unknown_and_ok(void **state) {
  (void)state;
  assert_string_equal(sx_err_name(0), "SX_OK");
  assert_string_equal(sx_strerror(0), "success");
  assert_string_equal(sx_err_name(SX_ERRNO_MIN - 1), "SX_UNKNOWN");
  assert_string_equal(sx_strerror(12345), "unknown error");
  assert_string_equal(sx_err_name(SX_EFENCED), "SX_EFENCED");
}

static void test_errors_message_is_per_thread_and_set_on_failure(void **state) {
  (void)state;
  sx_desc d;
  sx_desc_init(&d);
  assert_int_equal(sx_name_validate(""), SX_ENAME);
  assert_non_null(strstr(sx_errmsg(), "empty"));
  assert_int_equal(sx_name_validate("bad name"), SX_ENAME);
  assert_non_null(strstr(sx_errmsg(), "0x20"));
}

/* Regression: a message that quotes the previous one (sx_errmsg() as an
 * argument) came out garbled, because it was formatted over itself.
 * Callers do this when they add context to a failure from below. */
static void test_errors_message_may_quote_the_previous_one(void **state) {
  (void)state;
  char long_inner[300];
  memset(long_inner, 'x', sizeof(long_inner) - 1);
  long_inner[sizeof(long_inner) - 1] = '\0';
  sx__err(SX_EUNREACH, "redis://127.0.0.1:6379?namespace=a: not connected (%s)", long_inner);
  char expect[1024];
  snprintf(expect, sizeof(expect), "publish failed: %s", sx_errmsg());
  assert_int_equal(sx__err(SX_EUNREACH, "publish failed: %s", sx_errmsg()), SX_EUNREACH);
  assert_string_equal(sx_errmsg(), expect);
  assert_int_equal(sx__err(SX_EURL, "%s and %s", sx_errmsg(), sx_errmsg()), SX_EURL);
  assert_non_null(strstr(sx_errmsg(), "publish failed: redis://127.0.0.1:6379?namespace=a"));
}

static void test_errors_version_string(void **state) {
  (void)state;
  assert_string_equal(sx_version(), "0.1.0");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_errors_every_code_has_name_and_message),
      cmocka_unit_test(test_errors_unknown_and_ok),
      cmocka_unit_test(test_errors_message_is_per_thread_and_set_on_failure),
      cmocka_unit_test(test_errors_message_may_quote_the_previous_one),
      cmocka_unit_test(test_errors_version_string),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
