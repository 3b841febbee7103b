/*
 * The store integration suite, the same for every backend: each test takes
 * its server from a sxt_store_fixture (store_fixture.h) and talks to it only
 * through the backend ops table, so it proves the same guarantees for etcd
 * and Redis.
 *
 * A test program runs it for one fixture:
 *
 *   static int group_setup(void **state) {
 *     return sxt_suite_group_setup(state, &sxt_etcd_fixture);
 *   }
 *   const struct CMUnitTest tests[] = { SXT_STORE_SUITE, ... };
 *   cmocka_run_group_tests_name("store/etcd", tests, group_setup,
 *                               sxt_suite_group_teardown);
 *
 * One server serves the whole group; every test gets a namespace of its own
 * and leaves the server running (the per-test teardown restarts it if a test
 * killed it and failed before bringing it back).
 */
#ifndef SXT_STORE_SUITE_H
#define SXT_STORE_SUITE_H

#include "store_fixture.h"
#include "sxtest.h"

typedef struct sxt_suite {
  const sxt_store_fixture *fx;
  void *server;
  int skip; /* the server program is not installed */
  int seq;
  char ns[64]; /* this test's namespace */
} sxt_suite;

int sxt_suite_group_setup(void **state, const sxt_store_fixture *fx);
int sxt_suite_group_teardown(void **state);
int sxt_suite_setup(void **state);
int sxt_suite_teardown(void **state);

/* The suite's context for a test body; skips the test (saying why) when the
 * server is not installed. */
sxt_suite *sxt_suite_get(void **state);
/* The server URL for this test's namespace (extra: more query, or NULL). */
void sxt_suite_url(const sxt_suite *su, const char *extra, char *buf, size_t size);

void test_store_publish_get_list_unpublish(void **state);
void test_store_name_conflict_names_holder(void **state);
void test_store_takeover_fences_old_holder(void **state);
void test_store_generation_must_grow(void **state);
void test_store_remove_fences_holder(void **state);
void test_store_lease_expires_after_owner_sigkill(void **state);
void test_store_watch_reports_put_delete_expiry(void **state);
void test_store_restart_empty_renew_gone_republish(void **state);
void test_store_corrupt_value_returned_raw(void **state);
void test_store_close_cancels_pending_ops(void **state);
void test_store_unreachable_reports_errors(void **state);
void test_store_namespaces_are_isolated(void **state);
void test_store_racing_claims_one_wins(void **state);

#define SXT_SUITE_TEST(f)                                                                \
  cmocka_unit_test_setup_teardown(f, sxt_suite_setup, sxt_suite_teardown)

#define SXT_STORE_SUITE                                                                  \
  SXT_SUITE_TEST(test_store_publish_get_list_unpublish),                                 \
      SXT_SUITE_TEST(test_store_name_conflict_names_holder),                             \
      SXT_SUITE_TEST(test_store_takeover_fences_old_holder),                             \
      SXT_SUITE_TEST(test_store_generation_must_grow),                                   \
      SXT_SUITE_TEST(test_store_remove_fences_holder),                                   \
      SXT_SUITE_TEST(test_store_lease_expires_after_owner_sigkill),                      \
      SXT_SUITE_TEST(test_store_watch_reports_put_delete_expiry),                        \
      SXT_SUITE_TEST(test_store_restart_empty_renew_gone_republish),                     \
      SXT_SUITE_TEST(test_store_corrupt_value_returned_raw),                             \
      SXT_SUITE_TEST(test_store_close_cancels_pending_ops),                              \
      SXT_SUITE_TEST(test_store_unreachable_reports_errors),                             \
      SXT_SUITE_TEST(test_store_namespaces_are_isolated),                                \
      SXT_SUITE_TEST(test_store_racing_claims_one_wins)

/* Helpers the backend-specific tests share with the suite. */

/* A fresh random incarnation. */
void sxt_random_inc(uint8_t inc[SX_INCARNATION_LEN]);
/* An encoded descriptor for name/inc/gen (malloc()ed; free it). */
void sxt_encoded_desc(const char *name, const uint8_t *inc, uint64_t gen, uint8_t **out,
                      size_t *len);
/* A publish request over those values. */
sx_publish_req sxt_req(const char *name, const uint8_t *inc, uint64_t gen,
                       const uint8_t *value, size_t len, uint32_t lease_ms, int takeover);
/* The transport failures a store outage may give. */
int sxt_is_outage(int status);

#endif
