/*
 * The security model's checks that need processes and servers:
 *
 *   - no password and no access token appears in anything sx-agent or sxctl
 *     print, at debug log level, in success and in failure (a wrong
 *     password), unless asked for (sxctl show --show-secrets);
 *   - a reader name may hold at most 64 data-plane connections (others are
 *     served meanwhile), and a connection that never says HELLO is closed;
 *   - a client of another protocol (an HTTP probe, binary noise) is closed
 *     as soon as its first bytes arrive, with a log line that says what it
 *     sent, and the target goes on serving.
 *
 * The token check itself (constant time, SX_EACCESS), oversized READs and
 * HELLOs, and the descriptor limits are tested in test_agent, test_frame
 * and test_codec.
 */
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "internal.h"
#include "proc_env.h"
#include "segxfer/store.h"

#define PASSWORD "Sx-S3cret-Pw-4711"
#define ADMIN_PASSWORD "Adm1n-S3cret-0815"

static sxt_proc_env env;

/* Does any file in env.tmpdir contain needle?  Prints where. */
static int found_in_logs(const char *needle) {
  char cmd[PATH_MAX + 256];
  snprintf(cmd, sizeof(cmd), "grep -rlF -- '%s' %s", needle, env.tmpdir);
  return system(cmd) == 0;
}

static int run(const char *log, const char *const argv[]) {
  return sxt_reap(sxt_spawn(log, argv), 30000);
}

static void test_security_no_secret_in_any_output(void **state) {
  (void)state;
  sxt_redis r;
  sxt_redis_opts o = {.requirepass = ADMIN_PASSWORD, .acl_user = "sx-agent",
                      .acl_pass = PASSWORD, .notify = "Kx"};
  if (sxt_redis_start(&r, &o) != 0) {
    print_message("skipped: cannot start redis-server (make deps)\n");
    skip();
  }
  char url[256], bad[256], agent[PATH_MAX + 16], sxctl[PATH_MAX + 16], log[300];
  sxt_redis_url(&r, url, sizeof(url), "namespace=sec");
  snprintf(bad, sizeof(bad), "redis://sx-agent:Wrong-%s@127.0.0.1:%d?namespace=sec",
           PASSWORD, r.port);
  snprintf(agent, sizeof(agent), "%s/sx-agent", env.bindir);
  snprintf(sxctl, sizeof(sxctl), "%s/sxctl", env.bindir);

  /* An agent at debug level, serving a reader at debug level. */
  snprintf(log, sizeof(log), "%s/agent.log", env.tmpdir);
  const char *av[] = {agent, "--name", "secret/0", "--metadata", url, "--listen",
                      "127.0.0.1:0", "--num-blocks", "16", "--fill", "5", "--log-level",
                      "debug", NULL};
  pid_t pid = sxt_spawn(log, av);
  sx_store *s;
  sx_desc d;
  int rc = -1;
  for (int i = 0; i < 1000 && rc != 0; i++) {
    if ((rc = sx_store_open(url, &s)) == 0) {
      rc = sx_store_get(s, "secret/0", &d, NULL);
      sx_store_close(s);
    }
    if (rc != 0)
      sxt_sleep_ms(20);
  }
  sxt_ok(rc);
  char token[2 * SX_TOKEN_LEN + 1];
  sx_hex(d.token, SX_TOKEN_LEN, token);
  sx_desc_free(&d);

  struct {
    const char *file;
    const char *argv[16];
    int expect;
  } runs[] = {
      {"ls", {sxctl, "--metadata", url, "ls"}, 0},
      {"ls-json", {sxctl, "--metadata", url, "ls", "--json"}, 0},
      {"show", {sxctl, "--metadata", url, "show", "secret/0"}, 0},
      {"show-json", {sxctl, "--metadata", url, "show", "secret/0", "--json"}, 0},
      {"read", {sxctl, "--metadata", url, "read", "secret/0", "--blocks", "random:20",
                "--verify", "5", "--debug"}, 0},
      {"read-json", {sxctl, "--metadata", url, "read", "secret/0", "--blocks", "all",
                     "--json", "--debug"}, 0},
      {"ping", {sxctl, "--metadata", url, "ping", "secret/0", "--count", "2"}, 0},
      {"check", {sxctl, "--metadata", url, "check", "secret/0", "--against", "secret/0"},
       0},
      {"bad-ls", {sxctl, "--metadata", bad, "ls"}, 2},
      {"bad-show", {sxctl, "--metadata", bad, "show", "secret/0"}, 2},
      {"bad-read", {sxctl, "--metadata", bad, "read", "secret/0", "--debug"}, 2},
      {"bad-agent", {agent, "--name", "secret/1", "--metadata", bad, "--log-level",
                     "debug", "--num-blocks", "4"}, 2},
  };
  for (size_t i = 0; i < sizeof(runs) / sizeof(runs[0]); i++) {
    char out[300];
    snprintf(out, sizeof(out), "%s/%s.out", env.tmpdir, runs[i].file);
    int st = run(out, runs[i].argv);
    if (st != runs[i].expect)
      fail_msg("%s exited %d, expected %d; see %s", runs[i].file, st, runs[i].expect, out);
  }
  /* A clean stop logs too. */
  kill(pid, SIGTERM);
  assert_int_equal(sxt_reap(pid, 20000), 0);
  /* The outputs say something (they are not empty by accident)... */
  assert_true(sxt_count_in_file(log, "published generation 1") == 1);
  assert_true(sxt_count_in_file(log, "DEBUG") >= 1);
  char f[300];
  snprintf(f, sizeof(f), "%s/bad-ls.out", env.tmpdir);
  assert_true(sxt_count_in_file(f, "sx-agent:***@") >= 1);
  /* ...and none of them holds a secret. */
  if (found_in_logs(PASSWORD))
    fail_msg("the password appears in the output above");
  if (found_in_logs(ADMIN_PASSWORD))
    fail_msg("the admin password appears in the output above");
  if (found_in_logs(token))
    fail_msg("the access token appears in the output above");
  /* Unless asked for. */
  const char *asked[] = {sxctl, "--metadata", url, "show", "secret/0", "--show-secrets",
                         NULL};
  snprintf(f, sizeof(f), "%s/asked.out", env.tmpdir);
  /* The segment was unpublished at SIGTERM: publish it again as a store
   * client would, with the same token, to show the flag works. */
  sx_desc_init(&d);
  sxt_desc_kv(&d, "secret/0", 2, 0, 4096, 4, 0);
  assert_int_equal(sx_unhex(token, d.token, SX_TOKEN_LEN), 0);
  sxt_ok(sx_store_open(url, &s));
  sxt_ok(sx_store_publish(s, &d, 0));
  sx_store_close(s);
  sx_desc_free(&d);
  assert_int_equal(run(f, asked), 0);
  assert_int_equal(sxt_count_in_file(f, token), 1);
  sxt_redis_stop(&r);
}

static void test_security_connections_per_reader_are_limited(void **state) {
  (void)state;
  sxt_agent t;
  sxt_target_start(&t, "mem://security", "limited", NULL, 3);
  sx_desc d;
  sxt_ok(sx_agent_descriptor(t.a, &d));
  uint16_t port = sxt_tcp_port(&d);
  enum { LIMIT = 64 };
  int fds[LIMIT];
  for (int i = 0; i < LIMIT; i++) {
    fds[i] = sxt_wire_connect(port);
    assert_true(fds[i] >= 0);
    sxt_ok(sxt_wire_hello(fds[i], d.incarnation, d.token, "greedy"));
  }
  /* One more from the same reader is refused and closed... */
  int extra = sxt_wire_connect(port);
  assert_int_equal(sxt_wire_hello(extra, d.incarnation, d.token, "greedy"), SX_ELIMIT);
  assert_true(sxt_wire_closed(extra));
  close(extra);
  /* ...while another reader is served, and the greedy one's connections
   * keep working. */
  int other = sxt_wire_connect(port);
  sxt_ok(sxt_wire_hello(other, d.incarnation, d.token, "modest"));
  uint8_t buf[64];
  sxt_ok(sxt_wire_read(other, 1, d.regions[0].id, 0, sizeof(buf), buf));
  sxt_ok(sxt_wire_read(fds[LIMIT - 1], 2, d.regions[0].id, 0, sizeof(buf), buf));
  close(other);
  /* Freed connections make room again. */
  close(fds[0]);
  int again = -1, st = SX_ELIMIT;
  for (int i = 0; i < 200 && st == SX_ELIMIT; i++) {
    again = sxt_wire_connect(port);
    st = sxt_wire_hello(again, d.incarnation, d.token, "greedy");
    if (st == SX_ELIMIT) {
      close(again);
      sxt_sleep_ms(10);
    }
  }
  sxt_ok(st);
  close(again);
  for (int i = 1; i < LIMIT; i++)
    close(fds[i]);
  sx_desc_free(&d);
  sxt_agent_stop(&t);
}

/* Sends what (len may be 0), then waits for the target to hang up: the ms it took, or
 * UINT64_MAX when it did not within 15 s. */
static uint64_t hung_up_after(uint16_t port, const void *what, size_t len) {
  int fd = sxt_wire_connect(port);
  if (len > 0)
    assert_int_equal(send(fd, what, len, 0), (ssize_t)len);
  uint64_t t0 = sx__mono_ms();
  char c;
  ssize_t n;
  do {
    n = recv(fd, &c, 1, 0);
  } while (n < 0 && sx__mono_ms() - t0 < 15000);
  close(fd);
  return n == 0 ? sx__mono_ms() - t0 : UINT64_MAX;
}

static void test_security_silent_connection_is_closed(void **state) {
  (void)state;
  sxt_agent t;
  sxt_target_start(&t, "mem://security", "quiet", NULL, 4);
  sx_desc d;
  sxt_ok(sx_agent_descriptor(t.a, &d));
  /* No HELLO: the target hangs up after its 5 s HELLO deadline. */
  uint64_t took = hung_up_after(sxt_tcp_port(&d), NULL, 0);
  print_message("measured: a connection without HELLO was closed after %lu ms\n",
                (unsigned long)took);
  assert_true(took >= 4500 && took < 10000);
  sx_desc_free(&d);
  sxt_agent_stop(&t);
}

/* The target's warnings, for test_security_foreign_client_is_closed_at_once. */
static pthread_mutex_t warn_mu = PTHREAD_MUTEX_INITIALIZER;
static char warned[4096];

static void warn_log(void *arg, sx_log_level level, const char *msg) {
  (void)arg;
  if (level > SX_LOG_WARN)
    return;
  pthread_mutex_lock(&warn_mu);
  size_t k = strlen(warned);
  snprintf(warned + k, sizeof(warned) - k, "%s\n", msg);
  pthread_mutex_unlock(&warn_mu);
}

static int warned_of(const char *needle) {
  pthread_mutex_lock(&warn_mu);
  int found = strstr(warned, needle) != NULL;
  pthread_mutex_unlock(&warn_mu);
  return found;
}

static void test_security_foreign_client_is_closed_at_once(void **state) {
  (void)state;
  sxt_agent t;
  memset(&t, 0, sizeof(t));
  sx_agent_params p;
  sxt_params(&p, "mem://security", "probed");
  p.listen = "127.0.0.1:0";
  p.log = warn_log;
  p.log_level = SX_LOG_WARN;
  sxt_ok(sx_agent_create(&p, &t.a));
  sxt_register_kv(&t, SXT_TARGET_BLOCKS, SX_ACCESS_REMOTE_READ);
  sxt_ok(sx_agent_publish(t.a, 0));
  sx_desc d;
  sxt_ok(sx_agent_descriptor(t.a, &d));
  uint16_t port = sxt_tcp_port(&d);
  /* Shorter than a frame header (40 bytes): before, held until the HELLO
   * deadline (5 s); now refused from its first byte. */
  static const char probe[] = "GET /healthz HTTP/1.1\r\nHost: x\r\n";
  uint64_t took = hung_up_after(port, probe, sizeof(probe) - 1);
  print_message("measured: an HTTP probe was closed after %lu ms\n", (unsigned long)took);
  assert_true(took < 2000);
  static const uint8_t noise[] = {0x00, 0x01, 0xfe};
  took = hung_up_after(port, noise, sizeof(noise));
  assert_true(took < 2000);
  /* The frame magic, then another version: refused at its fifth byte. */
  static const uint8_t v9[] = {0x53, 0x58, 0x46, 0x31, 9};
  took = hung_up_after(port, v9, sizeof(v9));
  assert_true(took < 2000);
  for (int i = 0; i < 200 && !warned_of("unsupported protocol version"); i++)
    usleep(10000);
  assert_true(warned_of("not a segxfer peer: it began with \"GET /healthz\""));
  assert_true(warned_of("not a segxfer peer: it began with 0001fe"));
  assert_true(warned_of("unsupported protocol version"));
  /* A real peer is still served: HELLO with the right incarnation and
   * token is answered with 0. */
  int fd = sxt_wire_connect(port);
  assert_int_equal(sxt_wire_hello(fd, d.incarnation, d.token, "reader"), 0);
  close(fd);
  sx_desc_free(&d);
  sxt_agent_stop(&t);
}

static int group_setup(void **state) {
  (void)state;
  return sxt_proc_env_setup(&env, &(sxt_proc_env_opts){.test = "test_security",
                                                       .tmp = "security"});
}

static int group_teardown(void **state) {
  (void)state;
  return sxt_proc_env_teardown(&env);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_security_no_secret_in_any_output),
      cmocka_unit_test(test_security_connections_per_reader_are_limited),
      cmocka_unit_test(test_security_silent_connection_is_closed),
      cmocka_unit_test(test_security_foreign_client_is_closed_at_once),
  };
  const char *filter = getenv("SXT_FILTER");
  if (filter != NULL)
    cmocka_set_test_filter(filter);
  return cmocka_run_group_tests_name("security", tests, group_setup, group_teardown);
}
