/*
 * sx-agent's HTTP endpoint, end to end: a real redis-server, an sx-agent
 * process with --metrics-listen, readers as `sxctl read` processes and
 * crafted wire requests; scraped with libcurl.  The counters must move by
 * exactly what was read or refused, and /ready must follow the lease: 503
 * while the store is gone, 200 again once the agent has republished.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <curl/curl.h>

#include "agent_fixture.h"
#include "proc_env.h"
#include "segxfer/store.h"

/* The pool of every sx-agent here: 2 layers x K,V x 64 blocks of 4 KiB. */
#define LAYERS 2
#define SLOTS 2
#define BLOCK 4096u
#define BLOCKS 64u

static sxt_proc_env env;

/* ------------------------------------------------------------ http */

typedef struct reply {
  long status; /* 0: no answer (connection refused, timeout) */
  char type[128];
  char *body;
  size_t len;
} reply;

static size_t on_body(char *p, size_t size, size_t n, void *arg) {
  reply *r = arg;
  size_t add = size * n;
  char *nb = realloc(r->body, r->len + add + 1);
  if (nb == NULL)
    return 0;
  memcpy(nb + r->len, p, add);
  r->body = nb;
  r->len += add;
  r->body[r->len] = '\0';
  return add;
}

static reply http(const char *method, uint16_t port, const char *path) {
  reply r = {0};
  char u[128];
  snprintf(u, sizeof(u), "http://127.0.0.1:%u%s", port, path);
  CURL *c = curl_easy_init();
  assert_non_null(c);
  curl_easy_setopt(c, CURLOPT_URL, u);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 5000L);
  curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &r);
  if (curl_easy_perform(c) == CURLE_OK) {
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r.status);
    char *ct = NULL;
    if (curl_easy_getinfo(c, CURLINFO_CONTENT_TYPE, &ct) == CURLE_OK && ct)
      snprintf(r.type, sizeof(r.type), "%s", ct);
  }
  curl_easy_cleanup(c);
  if (r.body == NULL)
    r.body = calloc(1, 1);
  return r;
}

static void reply_free(reply *r) {
  free(r->body);
  r->body = NULL;
}

/* The value of a sample (name with its labels) in a Prometheus text; -1
 * when it is missing. */
static double sample(const char *text, const char *line) {
  size_t n = strlen(line);
  for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
    if (strncmp(p, line, n) == 0 && p[n] == ' ')
      return strtod(p + n + 1, NULL);
  return -1;
}

/* Scrape /metrics and return one sample. */
static double metric(uint16_t port, const char *line) {
  reply r = http("GET", port, "/metrics");
  assert_int_equal(r.status, 200);
  double v = sample(r.body, line);
  if (v < 0)
    fail_msg("no sample '%s' in /metrics:\n%s", line, r.body);
  reply_free(&r);
  return v;
}

/* Poll path until it answers status (up to ms); 0, or fail. */
static void wait_status(pid_t pid, uint16_t port, const char *path, long status, int ms,
                        const char *log) {
  long last = -1;
  for (int waited = 0; waited <= ms; waited += 50) {
    reply r = http("GET", port, path);
    last = r.status;
    reply_free(&r);
    if (last == status)
      return;
    if (pid > 0 && waitpid(pid, NULL, WNOHANG) == pid)
      fail_msg("sx-agent exited early; see %s", log);
    sxt_sleep_ms(50);
  }
  fail_msg("%s answered %ld, not %ld, for %d ms; see %s", path, last, status, ms, log);
}

/* ------------------------------------------------------------ the agent */

typedef struct agent_proc {
  pid_t pid;
  uint16_t mport;
  char name[64];
  char log[256];
} agent_proc;

static void agent_start(agent_proc *ap, const char *name, uint64_t seed) {
  char exe[PATH_MAX + 16], mlisten[32], fill[32], blocks[16], bb[16], layers[16];
  snprintf(exe, sizeof(exe), "%s/sx-agent", env.bindir);
  ap->mport = (uint16_t)sxt_free_port();
  snprintf(mlisten, sizeof(mlisten), "127.0.0.1:%u", ap->mport);
  snprintf(fill, sizeof(fill), "%lu", (unsigned long)seed);
  snprintf(blocks, sizeof(blocks), "%u", BLOCKS);
  snprintf(bb, sizeof(bb), "%u", BLOCK);
  snprintf(layers, sizeof(layers), "%u", LAYERS);
  snprintf(ap->name, sizeof(ap->name), "%s", name);
  snprintf(ap->log, sizeof(ap->log), "%s/%s.log", env.tmpdir, name);
  const char *argv[] = {exe, "--name", ap->name, "--metadata", env.url, "--listen",
                        "127.0.0.1:0", "--layers", layers, "--block-bytes", bb,
                        "--num-blocks", blocks, "--slots", "K,V", "--fill", fill,
                        "--lease-ms", "3000", "--metrics-listen", mlisten, NULL};
  ap->pid = sxt_spawn_ok(ap->log, argv);
  wait_status(ap->pid, ap->mport, "/ready", 200, 20000, ap->log);
}

static void agent_stop(agent_proc *ap) {
  kill(ap->pid, SIGTERM);
  assert_int_equal(sxt_reap(ap->pid, 20000), 0);
  ap->pid = 0;
}

/* ------------------------------------------------------------ tests */

static void test_metrics_counters_follow_reads_and_refusals(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  agent_proc ap;
  agent_start(&ap, "metrics-pool-0", 11);

  /* The endpoints, their types and their refusals. */
  reply r = http("GET", ap.mport, "/metrics");
  assert_int_equal(r.status, 200);
  assert_non_null(strstr(r.type, "text/plain"));
  assert_non_null(strstr(r.type, "version=0.0.4"));
  assert_true(sample(r.body, "segxfer_served_reads_total{transport=\"tcp\"}") == 0);
  assert_true(sample(r.body, "segxfer_served_bytes_total{transport=\"tcp\"}") == 0);
  assert_true(sample(r.body, "segxfer_regions") == SLOTS);
  assert_true(sample(r.body, "segxfer_region_bytes") ==
              (double)SLOTS * LAYERS * BLOCKS * BLOCK);
  assert_true(sample(r.body, "segxfer_ready") == 1);
  assert_true(sample(r.body, "segxfer_store_up") == 1);
  assert_true(sample(r.body, "segxfer_agent_state{state=\"published\"}") == 1);
  assert_true(sample(r.body, "segxfer_publishes_total") == 1);
  assert_non_null(strstr(r.body, "segxfer_agent_info{segment=\"metrics-pool-0\""));
  reply_free(&r);
  r = http("GET", ap.mport, "/ready");
  assert_int_equal(r.status, 200);
  assert_non_null(strstr(r.body, "ready: published generation 1"));
  reply_free(&r);
  r = http("GET", ap.mport, "/healthz");
  assert_int_equal(r.status, 200);
  reply_free(&r);
  r = http("GET", ap.mport, "/nothing-here");
  assert_int_equal(r.status, 404);
  reply_free(&r);
  r = http("POST", ap.mport, "/metrics");
  assert_int_equal(r.status, 405);
  reply_free(&r);

  /* A reader process reads 10 blocks of every layer and slot: the target
   * served exactly those bytes. */
  char exe[PATH_MAX + 16], log[300];
  snprintf(exe, sizeof(exe), "%s/sxctl", env.bindir);
  snprintf(log, sizeof(log), "%s/reader.log", env.tmpdir);
  const char *argv[] = {exe, "--metadata", env.url, "read", ap.name, "--blocks", "0-9",
                        "--verify", "11", NULL};
  int rc = sxt_reap(sxt_spawn_ok(log, argv), 30000);
  if (rc != 0)
    fail_msg("sxctl read exited %d; see %s", rc, log);
  double bytes = 10.0 * LAYERS * SLOTS * BLOCK;
  assert_true(metric(ap.mport, "segxfer_served_bytes_total{transport=\"tcp\"}") == bytes);
  double reads = metric(ap.mport, "segxfer_served_reads_total{transport=\"tcp\"}");
  assert_true(reads >= LAYERS * SLOTS); /* blocks 0-9 of a layer: one range each */

  /* A second read moves the counters again, by exactly as much. */
  rc = sxt_reap(sxt_spawn_ok(log, argv), 30000);
  assert_int_equal(rc, 0);
  assert_true(metric(ap.mport, "segxfer_served_bytes_total{transport=\"tcp\"}") ==
              2 * bytes);
  assert_true(metric(ap.mport, "segxfer_served_reads_total{transport=\"tcp\"}") ==
              2 * reads);

  /* A crafted HELLO with a wrong token is refused and counted by its error. */
  sx_store *st;
  sxt_ok(sx_store_open(env.url, &st));
  sx_desc d;
  sxt_ok(sx_store_get(st, ap.name, &d, NULL));
  sx_store_close(st);
  uint8_t bad[SX_TOKEN_LEN] = {0};
  int fd = sxt_wire_connect(sxt_tcp_port(&d));
  assert_int_equal(sxt_wire_hello(fd, d.incarnation, bad, "mallory"), SX_EACCESS);
  close(fd);
  r = http("GET", ap.mport, "/metrics");
  assert_true(sample(r.body, "segxfer_served_errors_total{transport=\"tcp\",error="
                             "\"SX_EACCESS\"}") == 1);
  /* The incarnation is there, the token is not. */
  char inc[2 * SX_INCARNATION_LEN + 1], tok[2 * SX_TOKEN_LEN + 1];
  sx_hex(d.incarnation, SX_INCARNATION_LEN, inc);
  sx_hex(d.token, SX_TOKEN_LEN, tok);
  assert_non_null(strstr(r.body, inc));
  assert_null(strstr(r.body, tok));
  reply_free(&r);
  sx_desc_free(&d);

  /* SIGTERM: exit 0, and the endpoint is gone with the process. */
  agent_stop(&ap);
  r = http("GET", ap.mport, "/ready");
  assert_int_equal(r.status, 0);
  reply_free(&r);
}

static void test_metrics_ready_follows_the_store(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  agent_proc ap;
  agent_start(&ap, "metrics-pool-1", 12);
  assert_true(metric(ap.mport, "segxfer_store_reconnects_total") == 0);

  /* The store dies: not ready (the segment cannot be found), and the failed
   * renewals are counted; the process itself stays healthy. */
  sxt_redis_kill(&env.redis, SIGKILL);
  wait_status(ap.pid, ap.mport, "/ready", 503, 10000, ap.log);
  reply r = http("GET", ap.mport, "/ready");
  assert_int_equal(r.status, 503);
  assert_non_null(strstr(r.body, "metadata store down"));
  reply_free(&r);
  assert_true(metric(ap.mport, "segxfer_store_up") == 0);
  assert_true(metric(ap.mport, "segxfer_ready") == 0);
  for (int i = 0; i < 100 && metric(ap.mport, "segxfer_lease_renew_failures_total") < 1;
       i++)
    sxt_sleep_ms(100);
  assert_true(metric(ap.mport, "segxfer_lease_renew_failures_total") >= 1);
  r = http("GET", ap.mport, "/healthz");
  assert_int_equal(r.status, 200);
  reply_free(&r);

  /* It comes back empty: the agent finds its lease gone, republishes with
   * the next generation, and is ready again. */
  assert_int_equal(sxt_redis_restart(&env.redis), 0);
  wait_status(ap.pid, ap.mport, "/ready", 200, 20000, ap.log);
  assert_true(metric(ap.mport, "segxfer_store_up") == 1);
  assert_true(metric(ap.mport, "segxfer_store_reconnects_total") >= 1);
  assert_true(metric(ap.mport, "segxfer_republishes_total") >= 1);
  assert_true(metric(ap.mport, "segxfer_lease_errors_total{error=\"SX_EGONE\"}") >= 1);
  assert_true(metric(ap.mport, "segxfer_segment_generation") >= 2);
  assert_true(metric(ap.mport, "segxfer_agent_state{state=\"published\"}") == 1);
  agent_stop(&ap);
}

static void test_metrics_bad_listen_address_is_a_usage_error(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  char exe[PATH_MAX + 16], log[300];
  snprintf(exe, sizeof(exe), "%s/sx-agent", env.bindir);
  snprintf(log, sizeof(log), "%s/bad-listen.log", env.tmpdir);
  const char *argv[] = {exe, "--name", "metrics-bad", "--metadata", env.url, "--listen",
                        "127.0.0.1:0", "--num-blocks", "4", "--metrics-listen",
                        "not-an-address", NULL};
  assert_int_equal(sxt_reap(sxt_spawn_ok(log, argv), 20000), 2);
  /* It never published. */
  sx_store *st;
  sxt_ok(sx_store_open(env.url, &st));
  sx_desc d;
  sxt_rc(sx_store_get(st, "metrics-bad", &d, NULL), SX_ENOENT);
  sx_store_close(st);
}

/* ------------------------------------------------------------ setup */

static int group_setup(void **state) {
  (void)state;
  if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK)
    return -1;
  return sxt_proc_env_setup(&env, &(sxt_proc_env_opts){.test = "test_metrics",
                                                       .tmp = "metrics", .need = "sx-agent",
                                                       .ns = "metrics", .notify = "Kx"});
}

static int group_teardown(void **state) {
  (void)state;
  int rc = sxt_proc_env_teardown(&env);
  curl_global_cleanup();
  return rc;
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_metrics_counters_follow_reads_and_refusals),
      cmocka_unit_test(test_metrics_ready_follows_the_store),
      cmocka_unit_test(test_metrics_bad_listen_address_is_a_usage_error),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
