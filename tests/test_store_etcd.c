/*
 * The store integration suite against a real etcd, plus what only etcd has:
 * several endpoints with failover, whole-second leases, the documented key
 * layout, a frozen server, watch resumption across a restart, TLS, and
 * answers that are not what etcd sends (from a scripted fake server).
 *
 * SXT_FILTER=test_etcd_* runs only the matching tests.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <signal.h>

#include "etcd/etcd.h"
#include "etcd_harness.h"
#include "fake_http.h"
#include "internal.h"
#include "store_suite.h"

/* ---------------------------------------------------------------- helpers */

typedef struct seg {
  char name[64];
  uint8_t inc[SX_INCARNATION_LEN];
  uint8_t *val;
  size_t len;
} seg;

static void seg_init(seg *s, const char *name) {
  snprintf(s->name, sizeof(s->name), "%s", name);
  sxt_random_inc(s->inc);
  sxt_encoded_desc(name, s->inc, 1, &s->val, &s->len);
}

static int seg_publish(sxt_store *st, const seg *s, uint32_t lease_ms, int takeover) {
  sxt_reply r;
  sx_publish_req req = sxt_req(s->name, s->inc, 1, s->val, s->len, lease_ms, takeover);
  int rc = sxt_publish(st, &req, &r);
  if (rc != 0)
    print_message("publish %s: %s: %s\n", s->name, sx_err_name(rc), r.message);
  sxt_reply_free(&r);
  return rc;
}

static int op_status(int rc, sxt_reply *r) {
  sxt_reply_free(r);
  return rc;
}

/* A blocking call to the gateway behind the backend's back, parsed. */
static json_t *raw(const sxt_etcd *e, const char *path, json_t *req) {
  char *body = json_dumps(req, JSON_COMPACT), *ans = NULL;
  json_decref(req);
  assert_non_null(body);
  assert_int_equal(sxt_etcd_post(e, path, body, &ans), 0);
  free(body);
  json_t *j = json_loads(ans, 0, NULL);
  free(ans);
  assert_non_null(j);
  return j;
}

static json_t *raw_range(const sxt_etcd *e, const char *key, const char *end) {
  json_t *req = sx__etcd_jkv(json_object(), "key", sx__etcd_jkey(key));
  if (end)
    req = sx__etcd_jkv(req, "range_end", sx__etcd_jkey(end));
  return raw(e, "/v3/kv/range", req);
}

static int64_t granted_ttl(const sxt_etcd *e, int64_t lease) {
  json_t *j = raw(e, "/v3/lease/timetolive", sx__etcd_id_req("ID", lease));
  int64_t g = -1;
  assert_int_equal(sx__etcd_i64(j, "grantedTTL", &g), 0);
  json_decref(j);
  return g;
}

/* The decoded key-values of a range answer. */
static size_t kvs_of(const json_t *ans, sx__etcd_kv *out, size_t max) {
  const json_t *kvs = json_object_get(ans, "kvs");
  size_t n = json_array_size(kvs);
  char err[200];
  assert_true(n <= max);
  for (size_t i = 0; i < n; i++)
    assert_int_equal(sx__etcd_kv_parse(json_array_get(kvs, i), &out[i], err, sizeof(err)),
                     0);
  return n;
}

static const sx__etcd_kv *kv_named(const sx__etcd_kv *kvs, size_t n, const char *key) {
  for (size_t i = 0; i < n; i++)
    if (strcmp((const char *)kvs[i].key, key) == 0)
      return &kvs[i];
  return NULL;
}

/* ---------------------------------------------------------------- real etcd */

static void test_etcd_failover_first_endpoint_dead(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  const sxt_etcd *e = su->server;
  sxt_store s, w;
  sxt_reply r;
  seg a;
  char url[512];
  seg_init(&a, "failover");
  uint16_t dead = sxt_free_port(), dead2 = sxt_free_port();
  snprintf(url, sizeof(url), "etcd://127.0.0.1:%u,127.0.0.1:%u?namespace=%s", dead,
           e->port, su->ns);
  sxt_ok(sxt_store_open(&s, url, 1));
  sxt_ok(sxt_store_open(&w, url, 1));
  sxt_ok(sx__backend_watch(w.b));

  assert_int_equal(seg_publish(&s, &a, 30000, 0), 0);
  assert_int_equal(sxt_store_take_event(&w, SX_EVENT_PUT, a.name, 10000, NULL), 0);
  assert_int_equal(op_status(sxt_get(&s, a.name, &r), &r), 0);
  assert_int_equal(op_status(sxt_list(&s, &r), &r), 0);
  assert_int_equal(op_status(sxt_renew(&s, a.name, a.inc, 30000, &r), &r), 0);
  assert_int_equal(op_status(sxt_unpublish(&s, a.name, a.inc, &r), &r), 0);
  assert_int_equal(sxt_store_take_event(&w, SX_EVENT_DELETE, a.name, 10000, NULL), 0);
  sxt_store_close(&w);
  sxt_store_close(&s);

  /* Every endpoint dead: one error that names them all. */
  snprintf(url, sizeof(url), "etcd://127.0.0.1:%u,127.0.0.1:%u?namespace=%s", dead, dead2,
           su->ns);
  sxt_ok(sxt_store_open(&s, url, 0));
  assert_int_equal(sxt_get(&s, a.name, &r), SX_EUNREACH);
  char p1[16], p2[16];
  snprintf(p1, sizeof(p1), ":%u", dead);
  snprintf(p2, sizeof(p2), ":%u", dead2);
  if (strstr(r.message, p1) == NULL || strstr(r.message, p2) == NULL)
    fail_msg("the message does not name both endpoints: %s", r.message);
  sxt_reply_free(&r);
  sxt_store_close(&s);
  free(a.val);
}

static void test_etcd_lease_rounds_up_to_whole_seconds(void **state) {
  assert_int_equal(sx__etcd_ttl_s(0), 1);
  assert_int_equal(sx__etcd_ttl_s(1), 1);
  assert_int_equal(sx__etcd_ttl_s(1000), 1);
  assert_int_equal(sx__etcd_ttl_s(1001), 2);
  assert_int_equal(sx__etcd_ttl_s(2500), 3);
  assert_int_equal(sx__etcd_ttl_s(UINT32_MAX), 4294968);

  sxt_suite *su = sxt_suite_get(state);
  const sxt_etcd *e = su->server;
  sxt_store s;
  seg a;
  char url[512], key[256];
  seg_init(&a, "rounded");
  sxt_suite_url(su, NULL, url, sizeof(url));
  sxt_ok(sxt_store_open(&s, url, 1));
  assert_int_equal(seg_publish(&s, &a, 2500, 0), 0);

  snprintf(key, sizeof(key), "%s%s/own/%s", SX_ETCD_ROOT, su->ns, a.name);
  json_t *ans = raw_range(e, key, NULL);
  sx__etcd_kv kv;
  assert_int_equal(kvs_of(ans, &kv, 1), 1);
  json_decref(ans);
  assert_int_equal(granted_ttl(e, kv.lease), 3);
  sx__etcd_kv_free(&kv);
  sxt_store_close(&s);
  free(a.val);
}

static void test_etcd_key_layout_is_documented(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  const sxt_etcd *e = su->server;
  sxt_store s;
  sxt_reply r;
  seg a, b;
  char url[512], from[128], to[128], k[256];
  seg_init(&a, "layout/x");
  seg_init(&b, "layout/x");
  sxt_suite_url(su, NULL, url, sizeof(url));
  sxt_ok(sxt_store_open(&s, url, 1));
  assert_int_equal(seg_publish(&s, &a, 30000, 0), 0);
  assert_int_equal(seg_publish(&s, &b, 30000, 1), 0);

  snprintf(from, sizeof(from), "%s%s/", SX_ETCD_ROOT, su->ns);
  snprintf(to, sizeof(to), "%s%s0", SX_ETCD_ROOT, su->ns);
  sx__etcd_kv kvs[8];
  json_t *ans = raw_range(e, from, to);
  size_t n = kvs_of(ans, kvs, 8);
  json_decref(ans);
  assert_int_equal(n, 3);
  char ahex[33], bhex[33];
  sx_hex(a.inc, SX_INCARNATION_LEN, ahex);
  sx_hex(b.inc, SX_INCARNATION_LEN, bhex);

  /* seg/NAME: the descriptor; own/NAME: the owner record; one lease. */
  snprintf(k, sizeof(k), "%sseg/%s", from, a.name);
  const sx__etcd_kv *sg = kv_named(kvs, n, k);
  snprintf(k, sizeof(k), "%sown/%s", from, a.name);
  const sx__etcd_kv *ow = kv_named(kvs, n, k);
  snprintf(k, sizeof(k), "%sfence/%s/%s", from, a.name, ahex);
  const sx__etcd_kv *fe = kv_named(kvs, n, k);
  assert_non_null(sg);
  assert_non_null(ow);
  assert_non_null(fe);
  assert_int_equal(sg->value_len, b.len);
  assert_memory_equal(sg->value, b.val, b.len);
  assert_true(sg->lease != 0 && sg->lease == ow->lease);
  assert_int_equal(granted_ttl(e, sg->lease), 30);
  sx__etcd_owner who;
  assert_int_equal(sx__etcd_owner_parse(ow->value, ow->value_len, &who), 0);
  assert_memory_equal(who.inc, b.inc, SX_INCARNATION_LEN);
  assert_int_equal(who.gen, 1);
  assert_int_equal(who.ttl_s, 30);
  assert_non_null(strstr((const char *)ow->value, bhex));
  /* fence/NAME/INC: the taken-over incarnation, for 24 h. */
  assert_int_equal(granted_ttl(e, fe->lease), SX_ETCD_FENCE_TTL_S);
  for (size_t i = 0; i < n; i++)
    sx__etcd_kv_free(&kvs[i]);

  /* After an unpublish only the fence is left (the tombstone went with the
   * revoked lease). */
  assert_int_equal(op_status(sxt_unpublish(&s, b.name, b.inc, &r), &r), 0);
  ans = raw_range(e, from, to);
  n = kvs_of(ans, kvs, 8);
  json_decref(ans);
  assert_int_equal(n, 1);
  assert_non_null(strstr((const char *)kvs[0].key, "/fence/"));
  sx__etcd_kv_free(&kvs[0]);
  sxt_store_close(&s);
  free(a.val);
  free(b.val);
}

static void test_etcd_list_looks_up_every_lease(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  sxt_store s;
  sxt_reply r;
  char url[512];
  enum { N = 20 };
  seg segs[N];
  sxt_suite_url(su, NULL, url, sizeof(url));
  sxt_ok(sxt_store_open(&s, url, 1));
  for (int i = 0; i < N; i++) {
    char name[32];
    snprintf(name, sizeof(name), "many-%02d", i);
    seg_init(&segs[i], name);
    assert_int_equal(seg_publish(&s, &segs[i], 30000, 0), 0);
  }
  assert_int_equal(sxt_list(&s, &r), 0);
  assert_int_equal(r.n_items, N);
  for (int i = 0; i < N; i++) {
    const sxt_item *it = sxt_reply_item(&r, segs[i].name);
    assert_non_null(it);
    assert_int_equal(it->len, segs[i].len);
    assert_memory_equal(it->value, segs[i].val, segs[i].len);
    assert_true(it->ttl_ms > 0 && it->ttl_ms <= 30000);
    free(segs[i].val);
  }
  sxt_reply_free(&r);
  sxt_store_close(&s);
}

static void test_etcd_frozen_server_times_out_then_recovers(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  sxt_store s, w;
  sxt_reply r;
  seg a, b;
  char url[512];
  seg_init(&a, "frozen-a");
  seg_init(&b, "frozen-b");
  sxt_suite_url(su, "timeout_ms=1000&connect_timeout_ms=1000", url, sizeof(url));
  sxt_ok(sxt_store_open(&s, url, 1));
  sxt_ok(sxt_store_open(&w, url, 1));
  sxt_ok(sx__backend_watch(w.b));
  assert_int_equal(seg_publish(&s, &a, 30000, 0), 0);
  assert_int_equal(sxt_store_take_event(&w, SX_EVENT_PUT, a.name, 10000, NULL), 0);

  /* A stopped server accepts connections and never answers. */
  assert_int_equal(su->fx->kill(su->server, SIGSTOP), 0);
  uint64_t t0 = sx__mono_ms();
  int st = sxt_get(&s, a.name, &r);
  uint64_t took = sx__mono_ms() - t0;
  if (st != SX_ETIMEDOUT)
    fail_msg("get from a frozen etcd = %s: %s", sx_err_name(st), r.message);
  sxt_reply_free(&r);
  print_message("timed out after %llu ms (timeout_ms=1000)\n", (unsigned long long)took);
  assert_true(took >= 900 && took < 5000);
  /* The watcher's health probe notices too: its stream is silent. */
  assert_int_equal(sxt_store_wait_conn(&w, 0, 1, 15000), 0);

  assert_int_equal(su->fx->kill(su->server, SIGCONT), 0);
  assert_int_equal(sxt_store_wait_conn(&w, 1, 2, SXT_OP_DEADLINE_MS), 0);
  assert_int_equal(op_status(sxt_get(&s, a.name, &r), &r), 0);
  assert_int_equal(op_status(sxt_renew(&s, a.name, a.inc, 30000, &r), &r), 0);
  /* The watch is back. */
  assert_int_equal(seg_publish(&s, &b, 30000, 0), 0);
  assert_int_equal(sxt_store_take_event(&w, SX_EVENT_PUT, b.name, 10000, NULL), 0);

  sxt_store_close(&w);
  sxt_store_close(&s);
  free(a.val);
  free(b.val);
}

static void test_etcd_watch_loses_nothing_across_restart(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  sxt_store p, w;
  sxt_reply r;
  seg x, y;
  char url[512];
  seg_init(&x, "before");
  seg_init(&y, "during");
  sxt_suite_url(su, NULL, url, sizeof(url));
  sxt_ok(sxt_store_open(&p, url, 1));
  sxt_ok(sxt_store_open(&w, url, 1));
  sxt_ok(sx__backend_watch(w.b));
  assert_int_equal(seg_publish(&p, &x, 30000, 0), 0);
  assert_int_equal(sxt_store_take_event(&w, SX_EVENT_PUT, x.name, 10000, NULL), 0);

  assert_int_equal(su->fx->kill(su->server, SIGKILL), 0);
  assert_int_equal(sxt_store_wait_conn(&w, 0, 1, 10000), 0);
  assert_int_equal(su->fx->restart(su->server, 0), 0);
  /* Written while the watcher may still be reconnecting: it resumes from
   * the revision after the last one it delivered. */
  assert_int_equal(op_status(sxt_renew(&p, x.name, x.inc, 30000, &r), &r), 0);
  assert_int_equal(seg_publish(&p, &y, 30000, 0), 0);
  if (sxt_store_take_event(&w, SX_EVENT_PUT, y.name, SXT_OP_DEADLINE_MS, NULL) != 0)
    fail_msg("the watcher missed a PUT across the restart");
  assert_int_equal(sxt_store_count_events(&w, SX_EVENT_PUT, x.name), 1);
  assert_int_equal(sxt_store_count_events(&w, SX_EVENT_DELETE, x.name), 0);
  assert_int_equal(sxt_store_count_events(&w, SX_EVENT_EXPIRED, x.name), 0);
  assert_true(w.n_up >= 2);

  sxt_store_close(&w);
  sxt_store_close(&p);
  free(x.val);
  free(y.val);
}

static void test_etcd_tls_with_a_test_ca(void **state) {
  (void)state;
  sxt_etcd e;
  int rc = sxt_etcd_start(&e, 1);
  if (rc == 1) {
    sxt_etcd_stop(&e);
    print_message("skipped: etcd or openssl is not installed\n");
    skip();
  }
  if (rc != 0) {
    sxt_etcd_stop(&e);
    fail_msg("etcd with TLS did not start");
  }
  sxt_store s;
  sxt_reply r;
  seg a;
  char url[512];
  seg_init(&a, "secure");
  sxt_etcd_url(&e, "tls", NULL, url, sizeof(url));
  assert_non_null(strstr(url, "etcd+https://"));

  setenv("SX_ETCD_CACERT", e.ca, 1);
  rc = sxt_store_open(&s, url, 1);
  unsetenv("SX_ETCD_CACERT");
  sxt_ok(rc);
  assert_int_equal(seg_publish(&s, &a, 30000, 0), 0);
  assert_int_equal(sxt_get(&s, a.name, &r), 0);
  assert_memory_equal(r.value, a.val, a.len);
  sxt_reply_free(&r);
  sxt_store_close(&s);

  /* Without the CA, the server's certificate is refused. */
  sxt_ok(sxt_store_open(&s, url, 0));
  assert_int_equal(sxt_store_wait_conn(&s, 0, 1, SXT_OP_DEADLINE_MS), 0);
  assert_int_equal(sxt_get(&s, a.name, &r), SX_EUNREACH);
  if (strstr(r.message, "certificate") == NULL && strstr(r.message, "SSL") == NULL)
    fail_msg("the message does not say what is wrong: %s", r.message);
  sxt_reply_free(&r);
  sxt_store_close(&s);
  sxt_etcd_stop(&e);
  free(a.val);
}

/* ---------------------------------------------------------------- wire */

static void test_etcd_wire_base64_and_int64(void **state) {
  (void)state;
  uint8_t buf[64], *out;
  size_t n;
  for (size_t len = 0; len < sizeof(buf); len++) {
    for (size_t i = 0; i < len; i++)
      buf[i] = (uint8_t)(i * 37 + len);
    json_t *j = sx__etcd_b64(buf, len);
    assert_non_null(j);
    assert_int_equal(json_string_length(j) % 4, 0);
    assert_int_equal(
        sx__etcd_unb64(json_string_value(j), json_string_length(j), &out, &n), 0);
    assert_int_equal(n, len);
    assert_memory_equal(out, buf, len);
    assert_int_equal(out[n], 0);
    free(out);
    json_decref(j);
  }
  assert_int_equal(sx__etcd_unb64("a", 1, &out, &n), SX_EPROTO);
  assert_int_equal(sx__etcd_unb64("ab!c", 4, &out, &n), SX_EPROTO);
  assert_int_equal(sx__etcd_unb64("a b=", 4, &out, &n), SX_EPROTO);

  json_t *o =
      json_pack("{s:s, s:s, s:s, s:s, s:s, s:I, s:f, s:s, s:b}", "a", "12", "b", "-5",
                "max", "9223372036854775807", "over", "9223372036854775808", "text",
                "12x", "num", (json_int_t)7, "dbl", 1.5, "empty", "", "bool", 1);
  int64_t v;
  assert_int_equal(sx__etcd_i64(o, "a", &v), 0);
  assert_int_equal(v, 12);
  assert_int_equal(sx__etcd_i64(o, "b", &v), 0);
  assert_int_equal(v, -5);
  assert_int_equal(sx__etcd_i64(o, "max", &v), 0);
  assert_int_equal(v, INT64_MAX);
  assert_int_equal(sx__etcd_i64(o, "num", &v), 0);
  assert_int_equal(v, 7);
  assert_int_equal(sx__etcd_i64(o, "absent", &v), 0);
  assert_int_equal(v, 0);
  assert_int_equal(sx__etcd_i64(o, "over", &v), SX_EPROTO);
  assert_int_equal(sx__etcd_i64(o, "text", &v), SX_EPROTO);
  assert_int_equal(sx__etcd_i64(o, "dbl", &v), SX_EPROTO);
  assert_int_equal(sx__etcd_i64(o, "empty", &v), SX_EPROTO);
  assert_int_equal(sx__etcd_i64(o, "bool", &v), SX_EPROTO);
  json_decref(o);

  sx__etcd_owner who;
  static const char good[] = "{\"v\":1,\"inc\":\"00112233445566778899aabbccddeeff\","
                             "\"gen\":\"18446744073709551615\",\"pub\":5,\"ttl\":3}";
  assert_int_equal(sx__etcd_owner_parse((const uint8_t *)good, strlen(good), &who), 0);
  assert_int_equal(who.gen, UINT64_MAX);
  assert_int_equal(who.inc[15], 0xff);
  assert_int_equal(who.ttl_s, 3);
  static const char *const bad[] = {
      "",
      "[]",
      "{\"inc\":\"0011\",\"gen\":\"1\"}",
      "{\"inc\":\"00112233445566778899aabbccddeeff\",\"gen\":1}",
      "{\"inc\":\"00112233445566778899aabbccddeeff\",\"gen\":\"-1\"}",
      "{\"inc\":\"00112233445566778899aabbccddeeff\",\"gen\":\"18446744073709551616\"}",
      "{\"inc\":\"zz112233445566778899aabbccddeeff\",\"gen\":\"1\"}"};
  for (size_t i = 0; i < SX__ARRAY_SIZE(bad); i++)
    assert_int_equal(sx__etcd_owner_parse((const uint8_t *)bad[i], strlen(bad[i]), &who),
                     SX_EDECODE);
}

/* ---------------------------------------------------------------- fake etcd */

static const char status_ok[] =
    "{\"header\":{\"revision\":\"100\",\"raft_term\":\"2\"},\"version\":\"3.4.23\","
    "\"leader\":\"18446744073709551615\"}";

typedef struct fake {
  sxt_fake_http *f;
  uint16_t port;
  char url[256];
} fake;

static void fake_start(fake *k, const char *extra) {
  assert_int_equal(sxt_fake_http_start(&k->f, &k->port), 0);
  snprintf(k->url, sizeof(k->url), "etcd://127.0.0.1:%u?namespace=fk%s%s", k->port,
           extra ? "&" : "", extra ? extra : "");
}

static void fake_routes(fake *k, const char *path, int status, const char *body,
                        int stream) {
  sxt_fake_route r[2] = {{"/v3/maintenance/status", 200, status_ok, 0},
                         {path, status, body, stream}};
  sxt_fake_http_routes(k->f, r, 2);
}

/* Get against an answer; the status and message are checked by the caller. */
static int fake_get(sxt_store *s, fake *k, int status, const char *body, char *msg,
                    size_t size) {
  sxt_reply r;
  fake_routes(k, "/v3/kv/range", status, body, 0);
  int rc = sxt_get(s, "x", &r);
  snprintf(msg, size, "%s", r.message);
  sxt_reply_free(&r);
  return rc;
}

static void test_etcd_bad_answers_are_errors(void **state) {
  (void)state;
  fake k;
  sxt_store s;
  sxt_reply r;
  char msg[256];
  fake_start(&k, NULL);
  fake_routes(&k, "/v3/kv/range", 200, "{}", 0);
  sxt_ok(sxt_store_open(&s, k.url, 1));

  assert_int_equal(fake_get(&s, &k, 200, "this is not json", msg, sizeof(msg)),
                   SX_EPROTO);
  assert_non_null(strstr(msg, "not JSON"));
  assert_int_equal(fake_get(&s, &k, 200, "[1,2]", msg, sizeof(msg)), SX_EPROTO);
  assert_int_equal(fake_get(&s, &k, 200, "{\"kvs\":5}", msg, sizeof(msg)), SX_EPROTO);
  assert_int_equal(
      fake_get(&s, &k, 200, "{\"kvs\":[{\"key\":\"%%%\"}]}", msg, sizeof(msg)),
      SX_EPROTO);
  assert_int_equal(fake_get(&s, &k, 200, "{\"kvs\":[7]}", msg, sizeof(msg)), SX_EPROTO);
  assert_int_equal(
      fake_get(&s, &k, 200,
               "{\"kvs\":[{\"key\":\"eA==\",\"value\":\"dg==\",\"lease\":\"1x\"}]}", msg,
               sizeof(msg)),
      SX_EPROTO);
  assert_int_equal(fake_get(&s, &k, 500, "<html>oops\x01</html>", msg, sizeof(msg)),
                   SX_ESTORE);
  assert_non_null(strstr(msg, "HTTP 500"));
  assert_null(strchr(msg, '\x01')); /* server text is cleaned */
  assert_int_equal(fake_get(&s, &k, 401,
                            "{\"error\":\"etcdserver: invalid auth token\",\"code\":16}",
                            msg, sizeof(msg)),
                   SX_EAUTH);
  assert_non_null(strstr(msg, "invalid auth token"));
  assert_int_equal(fake_get(&s, &k, 200,
                            "{\"error\":{\"grpc_code\":3,\"message\":\"bad\"}}", msg,
                            sizeof(msg)),
                   SX_ESTORE);
  /* A value without a lease, or with an unknown one, has no lease left. */
  assert_int_equal(fake_get(&s, &k, 200,
                            "{\"kvs\":[{\"key\":\"eA==\",\"value\":\"dg==\"}]}", msg,
                            sizeof(msg)),
                   0);

  /* Answers are capped. */
  char *big = malloc(5000);
  assert_non_null(big);
  memset(big, ' ', 4999);
  big[0] = '{';
  big[4998] = '}';
  big[4999] = '\0';
  sx__etcd_answer_max = 1024;
  int rc = fake_get(&s, &k, 200, big, msg, sizeof(msg));
  sx__etcd_answer_max = SX_ETCD_ANSWER_MAX;
  free(big);
  assert_int_equal(rc, SX_ELIMIT);
  assert_non_null(strstr(msg, "1024"));

  /* A transaction answer of the wrong shape fails the publish. */
  seg a;
  seg_init(&a, "x");
  fake_routes(&k, "/v3/kv/txn", 200, "{\"responses\":\"no\"}", 0);
  sx_publish_req req = sxt_req(a.name, a.inc, 1, a.val, a.len, 5000, 0);
  assert_int_equal(sxt_publish(&s, &req, &r), SX_EPROTO);
  sxt_reply_free(&r);
  fake_routes(&k, "/v3/kv/txn", 200,
              "{\"succeeded\":true,\"responses\":[{\"response_range\":{\"kvs\":[]}},"
              "{\"response_range\":{\"kvs\":[]}}]}",
              0);
  /* ... and so does a lease grant without an ID. */
  sxt_fake_route routes[3] = {{"/v3/maintenance/status", 200, status_ok, 0},
                              {"/v3/kv/txn", 200,
                               "{\"responses\":[{\"response_range\":{}},"
                               "{\"response_range\":{}}]}",
                               0},
                              {"/v3/lease/grant", 200, "{\"TTL\":\"5\"}", 0}};
  sxt_fake_http_routes(k.f, routes, 3);
  assert_int_equal(sxt_publish(&s, &req, &r), SX_EPROTO);
  assert_non_null(strstr(r.message, "lease ID"));
  sxt_reply_free(&r);

  sxt_store_close(&s);
  sxt_fake_http_stop(k.f);
  free(a.val);
}

static void test_etcd_no_leader_is_down(void **state) {
  (void)state;
  fake k;
  sxt_store s;
  fake_start(&k, NULL);
  sxt_fake_route r[1] = {{"/v3/maintenance/status", 200,
                          "{\"header\":{\"revision\":\"3\"},\"version\":\"3.4.23\"}", 0}};
  sxt_fake_http_routes(k.f, r, 1);
  sxt_ok(sxt_store_open(&s, k.url, 0));
  assert_int_equal(sxt_store_wait_conn(&s, 0, 1, 10000), 0);
  assert_int_equal(s.last_err, SX_EUNREACH);
  assert_non_null(strstr(s.last_msg, "no leader"));
  /* A leader appears: up, by the reconnection probe alone. */
  fake_routes(&k, "/v3/kv/range", 200, "{}", 0);
  assert_int_equal(sxt_store_wait_conn(&s, 1, 1, 10000), 0);
  sxt_store_close(&s);
  sxt_fake_http_stop(k.f);
}

/* One watch answer line with events: (type, key, value) triples. */
static char *watch_line(int64_t rev, const char *const *ev, size_t n) {
  json_t *events = json_array();
  for (size_t i = 0; i < n; i += 3) {
    json_t *kv = sx__etcd_jkv(json_object(), "key", sx__etcd_jkey(ev[i + 1]));
    kv = sx__etcd_jkv(kv, "mod_revision", sx__etcd_i64_json(rev));
    if (ev[i + 2])
      kv = sx__etcd_jkv(kv, "value", sx__etcd_jkey(ev[i + 2]));
    json_t *e = sx__etcd_jkv(json_object(), "kv", kv);
    if (strcmp(ev[i], "DELETE") == 0)
      e = sx__etcd_jkv(e, "type", json_string("DELETE"));
    events = sx__etcd_japp(events, e);
  }
  json_t *hdr = sx__etcd_jkv(json_object(), "revision", sx__etcd_i64_json(rev));
  json_t *res = sx__etcd_jkv(json_object(), "header", hdr);
  res = sx__etcd_jkv(res, "events", events);
  json_t *msg = sx__etcd_jkv(json_object(), "result", res);
  assert_non_null(msg);
  char *s = json_dumps(msg, JSON_COMPACT);
  json_decref(msg);
  return s;
}

static void test_etcd_watch_classifies_events(void **state) {
  (void)state;
  fake k;
  sxt_store w;
  fake_start(&k, NULL);
  const char *own_n =
      "{\"v\":1,\"inc\":\"0102030405060708090a0b0c0d0e0f10\",\"gen\":\"4\","
      "\"pub\":1,\"ttl\":5}";
  const char *tomb =
      "{\"v\":1,\"inc\":\"0102030405060708090a0b0c0d0e0f10\",\"gen\":\"4\","
      "\"pub\":2,\"ttl\":5,\"why\":\"unpublish\"}";
  const char *put[] = {"PUT", "/segxfer/fk/seg/n", "descriptor",
                       "PUT", "/segxfer/fk/own/n", own_n};
  const char *del[] = {"PUT",    "/segxfer/fk/del/n", tomb,
                       "DELETE", "/segxfer/fk/seg/n", NULL,
                       "DELETE", "/segxfer/fk/own/n", NULL};
  const char *exp[] = {"DELETE", "/segxfer/fk/seg/m", NULL,
                       "DELETE", "/segxfer/fk/own/m", NULL};
  const char *junk[] = {"PUT", "/segxfer/fk/fence/n/00", "x",
                        "PUT", "/other/own/z",           own_n,
                        "PUT", "/segxfer/fk/own/bad",    "not a record"};
  char *l1 = watch_line(101, put, 6), *l2 = watch_line(102, del, 9),
       *l3 = watch_line(103, exp, 6), *l4 = watch_line(104, junk, 9);
  char stream[4096];
  snprintf(stream, sizeof(stream),
           "{\"result\":{\"header\":{\"revision\":\"100\"},\"created\":true}}\n%s\n%s\n%"
           "s\n%s\n",
           l1, l2, l3, l4);
  free(l1), free(l2), free(l3), free(l4);
  fake_routes(&k, "/v3/watch", 200, stream, 1);
  sxt_ok(sxt_store_open(&w, k.url, 1));
  sxt_ok(sx__backend_watch(w.b));

  sx_event ev;
  assert_int_equal(sxt_store_take_event(&w, SX_EVENT_PUT, "n", 10000, &ev), 0);
  assert_int_equal(ev.generation, 4);
  assert_int_equal(ev.incarnation[0], 1);
  assert_int_equal(ev.incarnation[15], 0x10);
  assert_int_equal(sxt_store_take_event(&w, SX_EVENT_DELETE, "n", 10000, &ev), 0);
  assert_int_equal(ev.incarnation[15], 0x10);
  assert_int_equal(ev.generation, 4);
  assert_int_equal(sxt_store_take_event(&w, SX_EVENT_EXPIRED, "m", 10000, &ev), 0);
  /* An owner record we cannot read still says "changed". */
  assert_int_equal(sxt_store_take_event(&w, SX_EVENT_PUT, "bad", 10000, &ev), 0);
  assert_int_equal(ev.generation, 0);
  /* Nothing else: no event from seg/, fence/, del/ or another prefix. */
  sxt_store_run_for(&w, 200);
  assert_int_equal(w.n_events, 4);

  /* The stream started after the revision the probe reported. */
  char body[1024];
  sxt_fake_http_last_body(k.f, "/v3/watch", body, sizeof(body));
  assert_non_null(strstr(body, "\"start_revision\":\"101\""));
  assert_non_null(strstr(body, "\"fragment\":true"));
  sxt_store_close(&w);
  sxt_fake_http_stop(k.f);
}

static int watch_hits(sxt_store *s, void *arg) {
  (void)s;
  const fake *k = arg;
  return sxt_fake_http_hits(k->f, "/v3/watch") >= 2;
}

static void test_etcd_watch_recovers_from_garbage_compaction_and_reset(void **state) {
  (void)state;
  fake k;
  sxt_store w;
  char body[1024];

  /* Garbage on the stream: the watch ends and is set up again. */
  fake_start(&k, NULL);
  fake_routes(&k, "/v3/watch", 200, "garbage\n", 1);
  sxt_ok(sxt_store_open(&w, k.url, 1));
  sxt_ok(sx__backend_watch(w.b));
  assert_int_equal(sxt_store_run_until(&w, watch_hits, &k, 10000), 0);
  assert_int_equal(w.n_events, 0);
  sxt_store_close(&w);
  sxt_fake_http_stop(k.f);

  /* Compacted history: resync (on_conn up again), then watch from now. */
  fake_start(&k, NULL);
  fake_routes(
      &k, "/v3/watch", 200,
      "{\"result\":{\"header\":{\"revision\":\"100\"},\"created\":true}}\n"
      "{\"result\":{\"header\":{},\"canceled\":true,\"compact_revision\":\"90\"}}\n",
      1);
  sxt_ok(sxt_store_open(&w, k.url, 1));
  sxt_ok(sx__backend_watch(w.b));
  assert_int_equal(sxt_store_wait_conn(&w, 1, 2, 10000), 0);
  assert_int_equal(sxt_store_run_until(&w, watch_hits, &k, 10000), 0);
  sxt_fake_http_last_body(k.f, "/v3/watch", body, sizeof(body));
  assert_null(strstr(body, "start_revision"));
  sxt_store_close(&w);
  sxt_fake_http_stop(k.f);

  /* A store with less history than seen (restarted empty): resync, and
   * replay the new store from revision 1. */
  fake_start(&k, NULL);
  fake_routes(&k, "/v3/watch", 200,
              "{\"result\":{\"header\":{\"revision\":\"5\",\"raft_term\":\"2\"},"
              "\"created\":true}}\n",
              1);
  sxt_ok(sxt_store_open(&w, k.url, 1));
  sxt_ok(sx__backend_watch(w.b));
  assert_int_equal(sxt_store_wait_conn(&w, 1, 2, 10000), 0);
  assert_int_equal(sxt_store_run_until(&w, watch_hits, &k, 10000), 0);
  sxt_fake_http_last_body(k.f, "/v3/watch", body, sizeof(body));
  assert_non_null(strstr(body, "\"start_revision\":\"1\""));
  sxt_store_close(&w);
  sxt_fake_http_stop(k.f);
}

/* ---------------------------------------------------------------- main */

static int group_setup(void **state) {
  return sxt_suite_group_setup(state, &sxt_etcd_fixture);
}

#define ETCD_TEST(f) SXT_SUITE_TEST(f)

int main(void) {
  const char *filter = getenv("SXT_FILTER");
  if (filter && *filter)
    cmocka_set_test_filter(filter);
  const struct CMUnitTest tests[] = {
      SXT_STORE_SUITE,
      ETCD_TEST(test_etcd_failover_first_endpoint_dead),
      ETCD_TEST(test_etcd_lease_rounds_up_to_whole_seconds),
      ETCD_TEST(test_etcd_key_layout_is_documented),
      ETCD_TEST(test_etcd_list_looks_up_every_lease),
      ETCD_TEST(test_etcd_frozen_server_times_out_then_recovers),
      ETCD_TEST(test_etcd_watch_loses_nothing_across_restart),
      cmocka_unit_test(test_etcd_tls_with_a_test_ca),
      cmocka_unit_test(test_etcd_wire_base64_and_int64),
      cmocka_unit_test(test_etcd_bad_answers_are_errors),
      cmocka_unit_test(test_etcd_no_leader_is_down),
      cmocka_unit_test(test_etcd_watch_classifies_events),
      cmocka_unit_test(test_etcd_watch_recovers_from_garbage_compaction_and_reset),
  };
  return cmocka_run_group_tests_name("store suite and etcd specifics on etcd", tests,
                                     group_setup, sxt_suite_group_teardown);
}
