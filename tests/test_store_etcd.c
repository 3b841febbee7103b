/*
 * The store integration suite against a real etcd, plus what only etcd has:
 * several endpoints with failover, whole-second leases, a frozen server,
 * watch resumption, TLS, and answers that are not what etcd sends.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "etcd_harness.h"
#include "store_suite.h"

static int group_setup(void **state) { return sxt_suite_group_setup(state, &sxt_etcd_fixture); }

int main(void) {
  /* SXT_FILTER=test_store_x* runs only the matching tests. */
  const char *filter = getenv("SXT_FILTER");
  if (filter && *filter)
    cmocka_set_test_filter(filter);
  const struct CMUnitTest suite[] = {SXT_STORE_SUITE};
  return cmocka_run_group_tests_name("store suite on etcd", suite, group_setup,
                                     sxt_suite_group_teardown);
}
