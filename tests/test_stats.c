/*
 * The agent's counters (sx_agent_stats_get) and their Prometheus text
 * (sx_agent_metrics_text), inside one process: two agents on the mem://
 * store over loopback TCP.  Every check is on values: what was read, served,
 * refused, opened, and how the lease went; the text must carry the same
 * numbers and never the access token.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "pattern.h"

static int url_seq;

static void new_url(char *url, size_t size) {
  snprintf(url, size, "mem://stats-%d-%d", (int)getpid(), url_seq++);
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static sx_agent_stats stats(sx_agent *a) {
  sx_agent_stats s;
  sxt_ok(sx_agent_stats_get(a, &s, sizeof(s)));
  return s;
}

static uint64_t sum(const uint64_t *v, size_t n) {
  uint64_t t = 0;
  for (size_t i = 0; i < n; i++)
    t += v[i];
  return t;
}

/* The value of the sample `line` (a metric name with its labels) in a
 * Prometheus text, or -1 when it is missing. */
static double sample(const char *text, const char *line) {
  size_t n = strlen(line);
  for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
    if (strncmp(p, line, n) == 0 && p[n] == ' ')
      return strtod(p + n + 1, NULL);
  return -1;
}

/* ------------------------------------------------------------ reader side */

static void test_stats_count_batches_bytes_and_latency(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sxt_agent t, r;
  sxt_target_start(&t, url, "prefill-s1", NULL, 5);
  sxt_reader_start(&r, url, "decode-s1");

  sx_agent_stats s = stats(r.a);
  assert_int_equal(sum(s.batches, SX_STATS_BATCH_STATES), 0);
  assert_int_equal(s.open_segments, 0);
  assert_int_equal(s.regions, 2);
  assert_int_equal(s.region_bytes, 2ull * SXT_LAYERS * SXT_READER_BLOCKS * SXT_BLOCK);

  /* The first open asks the store, the second is served by the cache. */
  sx_segment *seg, *seg2;
  sxt_ok(sx_segment_open(r.a, "prefill-s1", 1000, &seg));
  s = stats(r.a);
  assert_int_equal(s.cache_misses, 1);
  assert_int_equal(s.cache_fetches, 1);
  assert_int_equal(s.cache_hits, 0);
  assert_int_equal(s.open_segments, 1);
  sxt_ok(sx_segment_open(r.a, "prefill-s1", 1000, &seg2));
  s = stats(r.a);
  assert_int_equal(s.cache_hits, 1);
  assert_int_equal(s.cache_fetches, 1);
  assert_int_equal(s.open_segments, 2);
  sx_segment_close(seg2);

  /* Three batches of 5 blocks x all layers x K,V. */
  sx_block_read e = {.layer_first = 0, .layer_count = SXT_LAYERS, .slots = SXT_KV,
                     .remote_block = 3, .local_block = 0, .count = 5};
  uint64_t want_bytes = 0, want_us = 0;
  for (int i = 0; i < 3; i++) {
    sx_batch_result res = sxt_run_batch(seg, &e, 1, 10000);
    assert_int_equal(res.state, SX_BATCH_COMPLETED);
    assert_int_equal(res.bytes, 5ull * SXT_LAYERS * 2 * SXT_BLOCK);
    want_bytes += res.bytes;
    want_us += res.transfer_ns / 1000;
    sxt_ok(sxt_verify_blocks(&r, seg, 5, &e));
  }
  s = stats(r.a);
  assert_int_equal(s.batches[SX_BATCH_COMPLETED], 3);
  assert_int_equal(sum(s.batches, SX_STATS_BATCH_STATES), 3);
  assert_int_equal(sum(s.batch_errors, SX_STATS_ERRORS), 0);
  assert_int_equal(s.read_bytes[SX_TRANSPORT_TCP], want_bytes);
  assert_int_equal(s.read_bytes[SX_TRANSPORT_RDMA], 0);
  assert_int_equal(sum(s.batch_latency, SX_STATS_LATENCY_BUCKETS), 3);
  assert_int_equal(s.batch_latency_sum_us, want_us);
  /* The target served exactly those bytes, in some number of reads. */
  sx_agent_stats ts = stats(t.a);
  assert_int_equal(ts.served_bytes[SX_TRANSPORT_TCP], want_bytes);
  assert_true(ts.served_reads[SX_TRANSPORT_TCP] >= 3);
  sx_agent_status st;
  sxt_ok(sx_agent_status_get(t.a, &st));
  assert_int_equal(st.served_bytes, want_bytes);
  assert_int_equal(st.served_reads, ts.served_reads[SX_TRANSPORT_TCP]);
  /* The reader's own thread ran those batches: its CPU clock moved, and
   * it is a part of the process's, read after it. */
  uint64_t loop_ns = stats(r.a).loop_cpu_ns;
  struct timespec pt;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &pt);
  assert_true(s.loop_cpu_ns > 0 && s.loop_cpu_ns <= loop_ns);
  assert_true(loop_ns <= (uint64_t)pt.tv_sec * 1000000000u + (uint64_t)pt.tv_nsec);

  /* The same numbers in the Prometheus text. */
  char *text;
  size_t len;
  sxt_ok(sx_agent_metrics_text(r.a, &text, &len));
  assert_int_equal(strlen(text), len);
  assert_true(sample(text, "segxfer_batches_total{result=\"completed\"}") == 3);
  assert_true(sample(text, "segxfer_batches_total{result=\"failed\"}") == 0);
  assert_true(sample(text, "segxfer_batch_duration_seconds_count") == 3);
  assert_true(sample(text, "segxfer_batch_duration_seconds_bucket{le=\"+Inf\"}") == 3);
  assert_true(sample(text, "segxfer_read_bytes_total{transport=\"tcp\"}") ==
              (double)want_bytes);
  assert_true(sample(text, "segxfer_cache_misses_total") == 1);
  assert_true(sample(text, "segxfer_cache_hits_total") == 1);
  assert_true(sample(text, "segxfer_open_segments") >= 1);
  assert_true(sample(text, "segxfer_loop_cpu_seconds_total") > 0);
  assert_true(strstr(text, "# TYPE segxfer_loop_cpu_seconds_total counter\n") != NULL);
  assert_true(text[len - 1] == '\n');
  /* Buckets are cumulative: never decreasing. */
  double prev = 0;
  for (const char *p = strstr(text, "_bucket{"); p; p = strstr(p + 1, "_bucket{")) {
    double v = strtod(strchr(p, ' ') + 1, NULL);
    assert_true(v >= prev);
    prev = v;
  }
  free(text);

  /* The target dies: the next batch fails, is counted by its error, and the
   * transport failure forces one cache refresh. */
  sxt_agent_stop(&t);
  sx_batch_result res = sxt_run_batch(seg, &e, 1, 10000);
  assert_int_not_equal(res.state, SX_BATCH_COMPLETED);
  s = stats(r.a);
  assert_int_equal(s.batches[SX_BATCH_FAILED] + s.batches[SX_BATCH_TIMEOUT], 1);
  assert_int_equal(sum(s.batch_errors, SX_STATS_ERRORS), 1);
  assert_int_equal(s.batch_errors[-res.error], 1);
  assert_int_equal(sum(s.batch_latency, SX_STATS_LATENCY_BUCKETS), 4);
  for (int i = 0; i < 200 && stats(r.a).cache_refreshes == 0; i++)
    sleep_ms(10);
  assert_int_equal(stats(r.a).cache_refreshes, 1);
  sxt_ok(sx_agent_metrics_text(r.a, &text, NULL));
  char line[128];
  snprintf(line, sizeof(line), "segxfer_batch_errors_total{error=\"%s\"}",
           sx_err_name(res.error));
  assert_true(sample(text, line) == 1);
  free(text);

  /* Closing is asynchronous: the gauge follows. */
  sx_segment_close(seg);
  for (int i = 0; i < 200 && stats(r.a).open_segments != 0; i++)
    sleep_ms(10);
  assert_int_equal(stats(r.a).open_segments, 0);
  sxt_agent_stop(&r);
}

/* ------------------------------------------------------------ target side */

static void test_stats_count_refused_requests_by_error(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sxt_agent t;
  sxt_target_start(&t, url, "prefill-s2", NULL, 9);
  sx_desc d;
  sxt_ok(sx_agent_descriptor(t.a, &d));
  uint16_t port = sxt_tcp_port(&d);
  uint8_t bad[SX_TOKEN_LEN] = {0}, buf[64];

  int fd = sxt_wire_connect(port);
  assert_int_equal(sxt_wire_hello(fd, d.incarnation, bad, "mallory"), SX_EACCESS);
  close(fd);
  fd = sxt_wire_connect(port);
  sxt_ok(sxt_wire_hello(fd, d.incarnation, d.token, "tester"));
  assert_int_equal(sxt_wire_read(fd, 1, 777, 0, 8, buf), SX_ENOREGION);
  assert_int_equal(sxt_wire_read(fd, 2, t.id[0], UINT64_MAX - 3, 8, buf), SX_EBOUNDS);
  assert_int_equal(sxt_wire_read(fd, 3, t.id[0], 7, 8, buf), 0);
  close(fd);

  sx_agent_stats s = stats(t.a);
  assert_int_equal(s.served_errors[SX_TRANSPORT_TCP][-SX_EACCESS], 1);
  assert_int_equal(s.served_errors[SX_TRANSPORT_TCP][-SX_ENOREGION], 1);
  assert_int_equal(s.served_errors[SX_TRANSPORT_TCP][-SX_EBOUNDS], 1);
  assert_int_equal(sum(s.served_errors[SX_TRANSPORT_TCP], SX_STATS_ERRORS), 3);
  assert_int_equal(s.served_reads[SX_TRANSPORT_TCP], 1);
  assert_int_equal(s.served_bytes[SX_TRANSPORT_TCP], 8);

  char *text;
  sxt_ok(sx_agent_metrics_text(t.a, &text, NULL));
  assert_true(sample(text, "segxfer_served_errors_total{transport=\"tcp\",error="
                           "\"SX_EACCESS\"}") == 1);
  assert_true(sample(text, "segxfer_served_errors_total{transport=\"tcp\",error="
                           "\"SX_EBOUNDS\"}") == 1);
  assert_true(sample(text, "segxfer_served_bytes_total{transport=\"tcp\"}") == 8);
  /* Identity, but never the access token. */
  char inc[2 * SX_INCARNATION_LEN + 1], tok[2 * SX_TOKEN_LEN + 1];
  sx_hex(d.incarnation, SX_INCARNATION_LEN, inc);
  sx_hex(d.token, SX_TOKEN_LEN, tok);
  assert_non_null(strstr(text, "segment=\"prefill-s2\""));
  assert_non_null(strstr(text, inc));
  assert_null(strstr(text, tok));
  free(text);
  sx_desc_free(&d);
  sxt_agent_stop(&t);
}

/* ------------------------------------------------------------ lease */

static void test_stats_ready_follows_publish_and_unpublish(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sx_agent_params p;
  sxt_params(&p, url, "prefill-s3");
  p.listen = "127.0.0.1:0";
  p.lease_ms = 600; /* renewed every 200 ms */
  sx_agent *a;
  sxt_ok(sx_agent_create(&p, &a));
  sx_agent_stats s = stats(a);
  assert_false(s.ready);
  assert_int_equal(s.state, SX_AGENT_UNPUBLISHED);
  assert_true(s.store_up);
  assert_true(s.lease_age_ms == UINT64_MAX);
  assert_int_equal(s.lease_ms, 600);

  sxt_ok(sx_agent_publish(a, 0));
  s = stats(a);
  assert_true(s.ready);
  assert_int_equal(s.publishes, 1);
  assert_int_equal(s.generation, 1);
  assert_true(s.lease_age_ms < 600);
  /* Renewals keep the lease young. */
  for (int i = 0; i < 300 && stats(a).renewals < 3; i++)
    sleep_ms(10);
  s = stats(a);
  assert_true(s.renewals >= 3);
  assert_true(s.ready);
  assert_true(s.lease_age_ms < 600);

  sxt_ok(sx_agent_unpublish(a));
  s = stats(a);
  assert_false(s.ready);
  assert_int_equal(s.state, SX_AGENT_UNPUBLISHED);
  sxt_ok(sx_agent_publish(a, 0));
  s = stats(a);
  assert_true(s.ready);
  assert_int_equal(s.publishes, 2);
  assert_int_equal(s.generation, 2);
  assert_int_equal(sum(s.lease_errors, SX_STATS_ERRORS), 0);

  char *text;
  sxt_ok(sx_agent_metrics_text(a, &text, NULL));
  assert_true(sample(text, "segxfer_ready") == 1);
  assert_true(sample(text, "segxfer_agent_state{state=\"published\"}") == 1);
  assert_true(sample(text, "segxfer_agent_state{state=\"unpublished\"}") == 0);
  assert_true(sample(text, "segxfer_segment_generation") == 2);
  assert_true(sample(text, "segxfer_publishes_total") == 2);
  free(text);
  sx_agent_destroy(a);
}

/* A caller compiled against a smaller struct gets only what it knows. */
static void test_stats_respects_the_callers_size(void **state) {
  (void)state;
  char url[64];
  new_url(url, sizeof(url));
  sx_agent_params p;
  sxt_params(&p, url, NULL);
  sx_agent *a;
  sxt_ok(sx_agent_create(&p, &a));
  sx_agent_stats s;
  memset(&s, 0xAB, sizeof(s));
  size_t part = offsetof(sx_agent_stats, lease_ms);
  sxt_ok(sx_agent_stats_get(a, &s, part));
  assert_int_equal(s.state, SX_AGENT_UNPUBLISHED);
  const uint8_t *rest = (const uint8_t *)&s + part;
  for (size_t i = 0; i < sizeof(s) - part; i++)
    assert_int_equal(rest[i], 0xAB);
  sxt_rc(sx_agent_stats_get(a, &s, 0), SX_EINVAL);
  sxt_rc(sx_agent_stats_get(NULL, &s, sizeof(s)), SX_EINVAL);
  sxt_rc(sx_agent_metrics_text(a, NULL, NULL), SX_EINVAL);
  sx_agent_destroy(a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_stats_count_batches_bytes_and_latency),
      cmocka_unit_test(test_stats_count_refused_requests_by_error),
      cmocka_unit_test(test_stats_ready_follows_publish_and_unpublish),
      cmocka_unit_test(test_stats_respects_the_callers_size),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
