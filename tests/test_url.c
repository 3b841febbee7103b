/* Metadata URL parsing and redaction. */
#include <stdio.h>
#include <string.h>

#include "internal.h"
#include "sxtest.h"
#include "url.h"

static void test_url_redis_defaults(void **state) {
  (void)state;
  sx_url u;
  sxt_ok(sx__url_parse("redis://localhost", &u));
  assert_string_equal(u.scheme, "redis");
  assert_int_equal(u.n_hosts, 1);
  assert_string_equal(u.hosts[0].host, "localhost");
  assert_int_equal(u.hosts[0].port, 6379);
  assert_int_equal(u.db, 0);
  assert_string_equal(u.ns, "default");
  assert_int_equal(u.connect_timeout_ms, 2000);
  assert_int_equal(u.timeout_ms, 2000);
  assert_int_equal(u.has_password, 0);
  assert_string_equal(u.user, "");
}

static void test_url_redis_every_part(void **state) {
  (void)state;
  sx_url u;
  sxt_ok(sx__url_parse("redis://agent-1:p%40ss%2Fw%3Ard@10.0.0.5:6390/3"
                       "?namespace=cluster-a&connect_timeout_ms=250&timeout_ms=750",
                       &u));
  assert_string_equal(u.user, "agent-1");
  assert_string_equal(u.password, "p@ss/w:rd"); /* percent-decoded */
  assert_int_equal(u.has_password, 1);
  assert_string_equal(u.hosts[0].host, "10.0.0.5");
  assert_int_equal(u.hosts[0].port, 6390);
  assert_int_equal(u.db, 3);
  assert_string_equal(u.ns, "cluster-a");
  assert_int_equal(u.connect_timeout_ms, 250);
  assert_int_equal(u.timeout_ms, 750);
  /* Password only (the default user). */
  sxt_ok(sx__url_parse("redis://:only-pass@h:1", &u));
  assert_string_equal(u.user, "");
  assert_string_equal(u.password, "only-pass");
  /* User without password. */
  sxt_ok(sx__url_parse("redis://bob@h", &u));
  assert_string_equal(u.user, "bob");
  assert_int_equal(u.has_password, 0);
}

static void test_url_unencoded_specials_in_password(void **state) {
  (void)state;
  sx_url u;
  /* '/', '?' and '@' unencoded in a password still parse. */
  sxt_ok(sx__url_parse("redis://u:a/b?c@d@127.0.0.1:7000/2?namespace=n", &u));
  assert_string_equal(u.user, "u");
  assert_string_equal(u.password, "a/b?c@d");
  assert_string_equal(u.hosts[0].host, "127.0.0.1");
  assert_int_equal(u.hosts[0].port, 7000);
  assert_int_equal(u.db, 2);
  assert_string_equal(u.ns, "n");
}

static void test_url_ipv6(void **state) {
  (void)state;
  sx_url u;
  sxt_ok(sx__url_parse("redis://[::1]:6380/1", &u));
  assert_string_equal(u.hosts[0].host, "::1");
  assert_int_equal(u.hosts[0].port, 6380);
  assert_int_equal(u.db, 1);
  sxt_ok(sx__url_parse("redis://[fe80::1%25eth0]", &u));
  assert_string_equal(u.hosts[0].host, "fe80::1%25eth0");
  assert_int_equal(u.hosts[0].port, 6379);
  char buf[256];
  sx__url_redact(&u, buf, sizeof(buf));
  assert_non_null(strstr(buf, "[fe80::1%25eth0]:6379"));
}

static void test_url_sentinel_hosts(void **state) {
  (void)state;
  sx_url u;
  sxt_ok(sx__url_parse("redis+sentinel://s1:26380,[::1],10.0.0.3/mymaster/4"
                       "?namespace=x",
                       &u));
  assert_string_equal(u.scheme, "redis+sentinel");
  assert_int_equal(u.n_hosts, 3);
  assert_string_equal(u.hosts[0].host, "s1");
  assert_int_equal(u.hosts[0].port, 26380);
  assert_string_equal(u.hosts[1].host, "::1");
  assert_int_equal(u.hosts[1].port, 26379);
  assert_string_equal(u.hosts[2].host, "10.0.0.3");
  assert_int_equal(u.hosts[2].port, 26379);
  assert_string_equal(u.master, "mymaster");
  assert_int_equal(u.db, 4);
  sxt_ok(sx__url_parse("redis+sentinel://u:pw@s1/m", &u));
  assert_string_equal(u.master, "m");
  assert_int_equal(u.db, 0);
  assert_string_equal(u.password, "pw");
}

static void expect_bad(const char *url, const char *part);

/* redis+cluster://: seed nodes, default port 6379, credentials, no db. */
static void test_url_cluster_seeds(void **state) {
  (void)state;
  sx_url u;
  char buf[512];
  sxt_ok(sx__url_parse("redis+cluster://sx-agent:p%40ss@n1:7000,[::1],10.0.0.3:7002"
                       "?namespace=prod&timeout_ms=500",
                       &u));
  assert_string_equal(u.scheme, "redis+cluster");
  assert_int_equal(u.n_hosts, 3);
  assert_string_equal(u.hosts[0].host, "n1");
  assert_int_equal(u.hosts[0].port, 7000);
  assert_string_equal(u.hosts[1].host, "::1");
  assert_int_equal(u.hosts[1].port, 6379);
  assert_int_equal(u.hosts[2].port, 7002);
  assert_string_equal(u.user, "sx-agent");
  assert_string_equal(u.password, "p@ss");
  assert_string_equal(u.ns, "prod");
  assert_int_equal(u.timeout_ms, 500);
  assert_int_equal(u.db, 0);
  sx__url_redact(&u, buf, sizeof(buf));
  assert_string_equal(buf, "redis+cluster://sx-agent:***@n1:7000,[::1]:6379,"
                           "10.0.0.3:7002?namespace=prod");
  sxt_ok(sx__url_parse("redis+cluster://n1", &u));
  assert_int_equal(u.n_hosts, 1);
  expect_bad("redis+cluster://n1/2", "database 0 only");
  expect_bad("redis+cluster://n1/m", "no path");
  expect_bad("redis+cluster://n1?sentinel_password=x", "only for redis+sentinel://");
  expect_bad("redis+cluster://", "host 1 is empty");
  expect_bad("redis+cluster://n1,", "host 2 is empty");
  expect_bad("redis+clusters://n1", "unknown scheme");
}

static void test_url_other_schemes(void **state) {
  (void)state;
  sx_url u;
  sxt_ok(sx__url_parse("etcd://e1:2379,e2?namespace=q", &u));
  assert_int_equal(u.n_hosts, 2);
  assert_int_equal(u.hosts[1].port, 2379);
  sxt_ok(sx__url_parse("mem://unit-store?namespace=t", &u));
  assert_string_equal(u.master, "unit-store");
  assert_string_equal(u.ns, "t");
}

/* Each malformed URL: SX_EURL and a message naming the wrong part. */
static void expect_bad(const char *url, const char *part) {
  sx_url u;
  int rc = sx__url_parse(url, &u);
  if (rc != SX_EURL)
    fail_msg("%s: %s, expected SX_EURL", url, sx_err_name(rc));
  if (strstr(sx_errmsg(), part) == NULL)
    fail_msg("%s: message '%s' does not name '%s'", url, sx_errmsg(), part);
}

/* A namespace too long for the buffer used to borrow the message of
 * whatever failed before on the thread. */
/* index_refresh_ms: how often renewals rewrite the Redis listing index. */
static void test_url_index_refresh(void **state) {
  (void)state;
  sx_url u;
  sxt_ok(sx__url_parse("redis://h", &u));
  assert_int_equal(u.index_refresh_ms, SX_URL_INDEX_REFRESH_MAX_MS);
  sxt_ok(sx__url_parse("redis://h?index_refresh_ms=0", &u));
  assert_int_equal(u.index_refresh_ms, 0);
  sxt_ok(sx__url_parse("redis+cluster://h1,h2?index_refresh_ms=800", &u));
  assert_int_equal(u.index_refresh_ms, 800);
  sxt_ok(sx__url_parse("redis+sentinel://h/m?index_refresh_ms=7500", &u));
  assert_int_equal(u.index_refresh_ms, 7500);
  expect_bad("redis://h?index_refresh_ms=7501", "index_refresh_ms '7501' is not 0..7500");
  expect_bad("redis://h?index_refresh_ms=-1", "index_refresh_ms '-1'");
  expect_bad("redis://h?index_refresh_ms=", "index_refresh_ms ''");
  expect_bad("etcd://h?index_refresh_ms=100", "only for redis URLs");
  expect_bad("mem://x?index_refresh_ms=100", "only for redis URLs");
}

static void test_url_long_namespace_is_named(void **state) {
  (void)state;
  sx__err(SX_EIO, "an earlier failure");
  char url[128];
  snprintf(url, sizeof(url), "redis://h?namespace=%070d", 7);
  expect_bad(url, "longer than 64 bytes");
  assert_null(strstr(sx_errmsg(), "earlier"));
  expect_bad("redis://h?namespace=a%zzb", "percent-encoded");
}

static void test_url_malformed(void **state) {
  (void)state;
  expect_bad("", "empty");
  expect_bad("localhost:6379", "scheme");
  expect_bad("http://h", "scheme 'http'");
  expect_bad("redis://", "host 1");
  expect_bad("redis://h:0", "port '0'");
  expect_bad("redis://h:65536", "port '65536'");
  expect_bad("redis://h:12ab", "port '12ab'");
  expect_bad("redis://[::1", "'[' without ']'");
  expect_bad("redis://[::1]x", "junk after ']'");
  expect_bad("redis://h!x", "character '!'");
  expect_bad("redis://a,b", "redis+sentinel://");
  expect_bad("redis://h/db1", "db 'db1'");
  expect_bad("redis://h?namespace=bad ns", "namespace");
  expect_bad("redis://h?namespace=", "namespace");
  expect_bad("redis://h?timeout_ms=0", "timeout_ms");
  expect_bad("redis://h?timeout_ms=abc", "timeout_ms");
  expect_bad("redis://h?connect_timeout_ms=99999999", "connect_timeout_ms");
  expect_bad("redis://h?colour=red", "unknown query parameter 'colour'");
  expect_bad("redis://h?namespace", "no '='");
  expect_bad("redis+sentinel://s1,s2", "master");
  expect_bad("redis+sentinel://s1/", "master");
  expect_bad("redis+sentinel://s1/m/x", "db 'x'");
  expect_bad("redis://u%zz:p@h", "user");
  expect_bad("etcd://u:p@h", "only for redis");
  expect_bad("etcd://h/x", "takes no path");
  expect_bad("mem://", "store name");
  expect_bad("redis://h,h,h,h,h,h,h,h,h,h,h,h,h,h,h,h,h", "redis+sentinel://");
  expect_bad("redis+sentinel://h,h,h,h,h,h,h,h,h,h,h,h,h,h,h,h,h/m", "more than 16");
}

/* The sentinels' own credentials: query keys of redis+sentinel:// only. */
static void test_url_sentinel_credentials(void **state) {
  (void)state;
  sx_url u;
  sxt_ok(sx__url_parse("redis+sentinel://s1,s2/mm", &u));
  assert_int_equal(u.has_sentinel_password, 0);
  assert_string_equal(u.sentinel_user, "");
  assert_string_equal(u.sentinel_password, "");
  /* Password alone (the sentinels' requirepass), beside the master's. */
  sxt_ok(sx__url_parse("redis+sentinel://u:master-pw@s1:26380,s2/mm/2"
                       "?namespace=q&sentinel_password=s%40nt%26pw%3D1&timeout_ms=300",
                       &u));
  assert_int_equal(u.has_sentinel_password, 1);
  assert_string_equal(u.sentinel_password, "s@nt&pw=1"); /* percent-decoded */
  assert_string_equal(u.sentinel_user, "");
  assert_string_equal(u.password, "master-pw");
  assert_string_equal(u.user, "u");
  assert_string_equal(u.master, "mm");
  assert_int_equal(u.db, 2);
  assert_string_equal(u.ns, "q");
  assert_int_equal(u.timeout_ms, 300); /* items after it still count */
  /* An ACL user on the sentinels, in either order. */
  sxt_ok(sx__url_parse("redis+sentinel://s1/mm?sentinel_user=sx%2Dwatch&"
                       "sentinel_password=pw",
                       &u));
  assert_string_equal(u.sentinel_user, "sx-watch");
  assert_string_equal(u.sentinel_password, "pw");
  sxt_ok(sx__url_parse("redis+sentinel://s1/mm?sentinel_password=pw&sentinel_user=w", &u));
  assert_string_equal(u.sentinel_user, "w");
  assert_int_equal(u.has_sentinel_password, 1);
  /* Unencoded characters other than '&', '@' and '%' are taken as they are. */
  sxt_ok(sx__url_parse("redis+sentinel://s1/mm?sentinel_password=a/b?c:d=e", &u));
  assert_string_equal(u.sentinel_password, "a/b?c:d=e");
  /* The limits of the user info fields: 127 and 255 bytes. */
  char url[1024], v[300];
  memset(v, 'p', 255);
  v[255] = '\0';
  snprintf(url, sizeof(url), "redis+sentinel://s1/mm?sentinel_password=%s", v);
  sxt_ok(sx__url_parse(url, &u));
  assert_int_equal(strlen(u.sentinel_password), 255);
  snprintf(url, sizeof(url), "redis+sentinel://s1/mm?sentinel_password=%sp", v);
  expect_bad(url, "sentinel_password is too long");
  memset(v, 'u', 127);
  v[127] = '\0';
  snprintf(url, sizeof(url), "redis+sentinel://s1/mm?sentinel_password=x&sentinel_user=%s", v);
  sxt_ok(sx__url_parse(url, &u));
  assert_int_equal(strlen(u.sentinel_user), 127);
  snprintf(url, sizeof(url), "redis+sentinel://s1/mm?sentinel_password=x&sentinel_user=%su",
           v);
  expect_bad(url, "sentinel_user is too long");

  /* Only where there are sentinels. */
  expect_bad("redis://h?sentinel_password=pw", "only for redis+sentinel://");
  expect_bad("redis://h?sentinel_user=w", "only for redis+sentinel://");
  expect_bad("etcd://e1?sentinel_password=pw", "only for redis+sentinel://");
  expect_bad("etcd+https://e1?sentinel_user=w", "only for redis+sentinel://");
  expect_bad("mem://t?sentinel_password=pw", "only for redis+sentinel://");
  /* Malformed. */
  expect_bad("redis+sentinel://s1/mm?sentinel_password=", "sentinel_password is empty");
  expect_bad("redis+sentinel://s1/mm?sentinel_user=&sentinel_password=pw",
             "sentinel_user is empty");
  expect_bad("redis+sentinel://s1/mm?sentinel_user=w", "sentinel_user needs "
             "sentinel_password");
  expect_bad("redis+sentinel://s1/mm?sentinel_password=a%zz", "badly %-encoded");
  expect_bad("redis+sentinel://s1/mm?sentinel_password=a%00b", "badly %-encoded");
  expect_bad("redis+sentinel://s1/mm?sentinel_user=a%2", "sentinel_user");
  /* An unencoded '@' would move the user info into the query: refused. */
  expect_bad("redis+sentinel://s1/mm?sentinel_password=a@b/c", "%40");
  expect_bad("redis+sentinel://u:p@s1/mm?namespace=n&sentinel_user=a@b&"
             "sentinel_password=x",
             "%40");
  /* The unknown-key message lists the new keys. */
  expect_bad("redis://h?sentinel_pass=x", "sentinel_password");
}

/* The sentinel password never shows either: not in parse errors (also when
 * an unencoded '&' splits it), not in the redacted URL. */
static void test_url_sentinel_password_never_shown(void **state) {
  (void)state;
  sx_url u;
  char buf[512];
  const char *bad[] = {
      "redis://h?sentinel_password=Sent-Secret-91",
      "etcd://h?sentinel_password=Sent-Secret-91",
      "redis+sentinel://h/m?sentinel_password=Sent-Secret-91%zz",
      "redis+sentinel://h/m?sentinel_password=Sent-Secret-91@x/m2",
      "redis+sentinel://h/m?sentinel_password=Sent&Secret-91",     /* no '=' */
      "redis+sentinel://h/m?sentinel_password=Sent&Secret-91=x",   /* unknown key */
      "redis+sentinel://h/m?sentinel_password=Sent&namespace=Secret-91!",
      "redis+sentinel://h/m?sentinel_password=Sent&timeout_ms=Secret-91",
      "redis+sentinel://h/m?sentinel_password=Sent-Secret-91&sentinel_user=",
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    int rc = sx__url_parse(bad[i], &u);
    if (rc != SX_EURL)
      fail_msg("%s: %s, expected SX_EURL", bad[i], sx_err_name(rc));
    if (strstr(sx_errmsg(), "Secret") != NULL)
      fail_msg("%s: the message shows the secret: %s", bad[i], sx_errmsg());
  }
  sxt_ok(sx__url_parse("redis+sentinel://mu:Master-Pw-5@a:1,b:2/mm/5?namespace=n1&"
                       "sentinel_user=watcher&sentinel_password=Sent-Secret-91",
                       &u));
  sx__url_redact(&u, buf, sizeof(buf));
  assert_string_equal(buf, "redis+sentinel://mu:***@a:1,b:2/mm/5?namespace=n1");
  assert_null(strstr(buf, "Sent-Secret"));
  assert_null(strstr(buf, "sentinel_"));
}

/* The password never shows: not in parse errors, not in the redacted URL. */
static void test_url_password_never_shown(void **state) {
  (void)state;
  sx_url u;
  char buf[512];
  const char *secret = "Top-Secret-77";
  sxt_rc(sx__url_parse("redis://u:Top-Secret-77%zz@h", &u), SX_EURL);
  assert_null(strstr(sx_errmsg(), secret));
  assert_non_null(strstr(sx_errmsg(), "password"));
  sxt_rc(sx__url_parse("redis://u:Top-Secret-77@h:99999", &u), SX_EURL);
  assert_null(strstr(sx_errmsg(), secret));
  sxt_rc(sx__url_parse("redis://u:Top-Secret-77@h?bogus=1", &u), SX_EURL);
  assert_null(strstr(sx_errmsg(), secret));
  sxt_rc(sx__url_parse("redis://u:Top/Secret-77@h:1/x", &u), SX_EURL);
  assert_null(strstr(sx_errmsg(), "Secret-77"));

  sxt_ok(sx__url_parse("redis://u:Top-Secret-77@h:7/2?namespace=ns1", &u));
  sx__url_redact(&u, buf, sizeof(buf));
  assert_null(strstr(buf, secret));
  assert_string_equal(buf, "redis://u:***@h:7/2?namespace=ns1");
  sxt_ok(sx__url_parse("redis+sentinel://:Top-Secret-77@a:1,b:2/mm/5", &u));
  sx__url_redact(&u, buf, sizeof(buf));
  assert_null(strstr(buf, secret));
  assert_string_equal(buf, "redis+sentinel://:***@a:1,b:2/mm/5?namespace=default");
  /* A short buffer still ends in a terminated string without the secret. */
  sx__url_redact(&u, buf, 12);
  assert_int_equal(strlen(buf), 11);
  assert_null(strstr(buf, "Top"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_url_redis_defaults),
      cmocka_unit_test(test_url_redis_every_part),
      cmocka_unit_test(test_url_unencoded_specials_in_password),
      cmocka_unit_test(test_url_ipv6),
      cmocka_unit_test(test_url_sentinel_hosts),
      cmocka_unit_test(test_url_cluster_seeds),
      cmocka_unit_test(test_url_other_schemes),
      cmocka_unit_test(test_url_malformed),
      cmocka_unit_test(test_url_long_namespace_is_named),
      cmocka_unit_test(test_url_index_refresh),
      cmocka_unit_test(test_url_password_never_shown),
      cmocka_unit_test(test_url_sentinel_credentials),
      cmocka_unit_test(test_url_sentinel_password_never_shown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
