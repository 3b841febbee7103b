/*
 * Fault injection, end to end: processes that die or stop.
 * sx-agent processes (BUILD/bin/sx-agent) hold filled pools and publish
 * them in a real redis-server; readers in this process open them by name
 * and read over TCP while the test breaks things.
 *
 *   - an agent killed with SIGKILL: its segment is gone within one lease, and
 *     readers get errors (never COMPLETED, never a written destination);
 *   - an agent stopped past its lease and resumed: it republishes (new
 *     generation) when the name is still free, and stops as fenced when
 *     another agent took it meanwhile; the store never shows two owners;
 *   - a reader killed during a batch: the target closes every connection it
 *     had and keeps serving.
 *
 * The store's faults are in test_faults_store.c, the network's in
 * test_faults_net.c. *
 * Each test prints what it measured ("measured: ...").  Bounds are one lease
 * or one renew interval plus documented backoff, with a margin for a loaded
 * machine.  SXT_FILTER=pattern runs a subset; SXT_KEEP_LOGS=1 keeps logs.
 * The actors are in tests/support/fault_fixture.c.
 */
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "fault_fixture.h"
#include "internal.h"
#include "segxfer/store.h"

static sxt_proc_env env;

/* ------------------------------------------------------------ agents */

static void test_fault_agent_sigkill_segment_gone_within_a_lease(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  const uint32_t lease = 1000;
  sxt_fault_agent p;
  sxt_fault_spawn(&env, &p, "killed", env.url, NULL, lease, 11, NULL);
  sxt_fault_wait_published(&p, NULL, 20000);
  sxt_fault_reader r;
  sxt_fault_reader_start(&r, env.url);
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, p.name, 5000, &seg));
  sx_block_read e = sxt_fault_blocks(0, 16);
  assert_int_equal(sxt_fault_batch(seg, &e, 5000, NULL).state, SX_BATCH_COMPLETED);
  assert_int_equal(sxt_fault_verify(&r, seg, 11, &e), 0);

  assert_int_equal(sxt_fault_stop(&p, SIGKILL), 128 + SIGKILL);
  uint64_t t0 = sx__mono_ms();
  /* Until the store drops it, and after: every read fails, and no
   * destination is written. */
  int batches = 0, gone = 0;
  uint64_t gone_ms = 0;
  while (sx__mono_ms() - t0 < lease + 3000 && !(gone && batches >= 3)) {
    sxt_fault_fill(&r, 0xab);
    sx_batch_result res = sxt_fault_batch(seg, &e, 1000, NULL);
    batches++;
    if (res.state == SX_BATCH_COMPLETED)
      fail_msg("a batch COMPLETED %lu ms after its target was killed",
               (unsigned long)(sx__mono_ms() - t0));
    assert_true(sxt_fault_untouched(&r, &e, 0xab));
    if (!gone && sxt_fault_stored(env.url, p.name, NULL, NULL) == SX_ENOENT) {
      gone = 1;
      gone_ms = sx__mono_ms() - t0;
    }
    sxt_sleep_ms(20);
  }
  assert_true(gone);
  print_message("measured: segment gone %lu ms after SIGKILL (lease %u ms); %d batches "
                "meanwhile, all failed, no destination written\n",
                (unsigned long)gone_ms, lease, batches);
  /* Within one lease of the last renewal; margin for a loaded machine. */
  assert_true(gone_ms <= lease + 1000);
  sx_segment_close(seg);
  sxt_rc(sx_segment_open(r.a, p.name, 0, &seg), SX_ENOENT);
  sxt_fault_reader_stop(&r);
}

static void test_fault_agent_stopped_past_lease_republishes(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  const uint32_t lease = 1000, deadline = 2500;
  sxt_fault_agent p;
  sxt_fault_spawn(&env, &p, "sleeper", env.url, NULL, lease, 12, NULL);
  sxt_fault_wait_published(&p, NULL, 20000);
  sxt_fault_reader r;
  sxt_fault_reader_start(&r, env.url);
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, p.name, 5000, &seg));
  sx_block_read e = sxt_fault_blocks(8, 8);
  assert_int_equal(sxt_fault_batch(seg, &e, 5000, NULL).state, SX_BATCH_COMPLETED);
  assert_int_equal(sxt_freeze(p.pid), 0);
  /* A batch in flight while the segment expires: the store's event is no
   * reason to end it (the data path may just be slow); it ends at its
   * deadline, or on a transport error, never early and never COMPLETED. */
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = deadline;
  sx_batch *b;
  sxt_ok(sx_batch_create(seg, &bp, &b));
  sxt_ok(sx_batch_add_blocks(b, &e, 1));
  uint64_t t0 = sx__mono_ms();
  sxt_ok(sx_batch_submit(b));
  while (sxt_fault_stored(env.url, p.name, NULL, NULL) == 0 &&
         sx__mono_ms() - t0 < lease + 3000)
    sxt_sleep_ms(20);
  uint64_t expired = sx__mono_ms() - t0;
  assert_int_equal(sxt_fault_stored(env.url, p.name, NULL, NULL), SX_ENOENT);
  sxt_sleep_ms(200); /* the expiry event reaches the reader's cache */
  if (expired + 200 < deadline - 100)
    assert_int_equal(sx_batch_poll(b), SX_EBUSY);
  sxt_ok(sx_batch_wait(b, (int)deadline + 5000));
  uint64_t ended = sx__mono_ms() - t0;
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  assert_int_equal(res.state, SX_BATCH_TIMEOUT);
  assert_true(ended + 50 >= deadline);
  sx_batch_destroy(b);

  assert_int_equal(sxt_thaw(p.pid), 0);
  uint64_t t1 = sx__mono_ms();
  uint8_t inc[SX_INCARNATION_LEN];
  uint64_t gen = 0;
  while ((sxt_fault_stored(env.url, p.name, inc, &gen) != 0 || gen < 2) &&
         sx__mono_ms() - t1 < 10000)
    sxt_sleep_ms(10);
  uint64_t back = sx__mono_ms() - t1;
  sxt_ok(sxt_fault_stored(env.url, p.name, inc, &gen));
  assert_memory_equal(inc, p.inc, SX_INCARNATION_LEN); /* the same process */
  assert_true(gen >= 2);                               /* a new generation */
  print_message("measured: stopped agent's segment expired %lu ms after SIGSTOP (lease "
                "%u ms); a batch in flight ended TIMEOUT at %lu ms (deadline %u ms); "
                "republished as generation %lu %lu ms after SIGCONT\n",
                (unsigned long)expired, lease, (unsigned long)ended, deadline,
                (unsigned long)gen, (unsigned long)back);
  assert_true(back <= lease / 3 + 2000);
  /* It reads as before: a re-open finds the new generation, also while the
   * old segment is still open.  (Both share one peer per incarnation; the
   * timeout's refresh had marked it "no longer published", which must not
   * outlive the republish.) */
  sx_segment *again;
  sxt_ok(sx_segment_open(r.a, p.name, 5000, &again));
  assert_true(sx_segment_desc(again)->generation >= 2);
  e = sxt_fault_blocks(20, 8);
  sx_batch_result ok = sxt_fault_batch(again, &e, 5000, NULL);
  if (ok.state != SX_BATCH_COMPLETED)
    fail_msg("reading the republished segment: %s %s: %s", sx_batch_state_name(ok.state),
             sx_err_name(ok.error), ok.message);
  assert_int_equal(sxt_fault_verify(&r, again, 12, &e), 0);
  sx_segment_close(seg);
  sx_segment_close(again);
  sxt_fault_reader_stop(&r);
  assert_true(sxt_count_in_file(p.log, "republishing") >= 1);
  assert_int_equal(sxt_fault_stop(&p, SIGTERM), 0);
}

static void test_fault_agent_stopped_while_another_took_the_name_is_fenced(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  const uint32_t lease = 1000;
  sxt_fault_agent a, b;
  sxt_fault_spawn(&env, &a, "contested", env.url, NULL, lease, 13, NULL);
  sxt_fault_wait_published(&a, NULL, 20000);
  assert_int_equal(sxt_freeze(a.pid), 0);
  /* Its lease runs out; a second agent claims the free name (no takeover). */
  uint64_t t0 = sx__mono_ms();
  while (sxt_fault_stored(env.url, a.name, NULL, NULL) == 0 &&
         sx__mono_ms() - t0 < lease + 3000)
    sxt_sleep_ms(20);
  assert_int_equal(sxt_fault_stored(env.url, a.name, NULL, NULL), SX_ENOENT);
  sxt_fault_spawn(&env, &b, "contested", env.url, NULL, lease, 14, NULL);
  sxt_fault_wait_published(&b, a.inc, 20000);
  /* The first wakes up: it must find it lost the name and stop, while the
   * store shows the second as the only owner all along. */
  assert_int_equal(sxt_thaw(a.pid), 0);
  uint64_t t1 = sx__mono_ms();
  int status = -1, samples = 0;
  while (sx__mono_ms() - t1 < 10000) {
    uint8_t inc[SX_INCARNATION_LEN];
    int rc = sxt_fault_stored(env.url, a.name, inc, NULL);
    if (rc == 0) {
      samples++;
      if (memcmp(inc, b.inc, SX_INCARNATION_LEN) != 0)
        fail_msg("the store names another owner than the agent that took the name");
    }
    int st;
    if (waitpid(a.pid, &st, WNOHANG) == a.pid) {
      status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      a.pid = 0;
      break;
    }
    sxt_sleep_ms(10);
  }
  uint64_t fenced_ms = sx__mono_ms() - t1;
  if (status != 3)
    fail_msg("the stopped agent should exit 3 (fenced), got %d; see %s", status, a.log);
  assert_true(sxt_count_in_file(a.log, "fenced") >= 1);
  /* The second keeps the name, renewing, past a few leases. */
  sxt_sleep_ms(2 * lease);
  uint8_t inc[SX_INCARNATION_LEN];
  sxt_ok(sxt_fault_stored(env.url, b.name, inc, NULL));
  assert_memory_equal(inc, b.inc, SX_INCARNATION_LEN);
  assert_int_equal(waitpid(b.pid, NULL, WNOHANG), 0);
  assert_int_equal(sxt_count_in_file(b.log, "fenced"), 0);
  print_message("measured: the resumed agent stopped as fenced %lu ms after SIGCONT; "
                "%d store samples meanwhile, all naming the new owner\n",
                (unsigned long)fenced_ms, samples);
  assert_int_equal(sxt_fault_stop(&b, SIGTERM), 0);
}

/* ------------------------------------------------------------ readers */

/* Established TCP connections whose local port is port (/proc/net/tcp). */
static int established_on(uint16_t port) {
  FILE *f = fopen("/proc/net/tcp", "r");
  char line[512];
  int n = 0;
  if (f == NULL)
    return -1;
  while (fgets(line, sizeof(line), f)) {
    unsigned lport, st;
    if (sscanf(line, " %*d: %*x:%x %*x:%*x %x", &lport, &st) == 2 && lport == port &&
        st == 1)
      n++;
  }
  fclose(f);
  return n;
}

/* Open file descriptors of a process. */
static int fd_count(pid_t pid) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
  DIR *d = opendir(path);
  if (d == NULL)
    return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

#if defined(__SANITIZE_ADDRESS__)
#define SXT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SXT_ASAN 1
#endif
#endif

static void test_fault_reader_killed_during_batches_target_frees_all(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  sxt_fault_agent p;
#ifdef SXT_ASAN
  /* Under ASan freed memory waits in a quarantine (256 MiB by default), so
   * the target's RSS would grow with what it frees, not with what it keeps
   * (15-19 MiB here over the three readers, against 0.1 MiB without ASan):
   * the target this test bounds runs with a quarantine of 1 MiB. */
  const char *was = getenv("ASAN_OPTIONS");
  char *saved = was ? strdup(was) : NULL, opts[1024];
  snprintf(opts, sizeof(opts), "%s%squarantine_size_mb=1", was ? was : "", was && *was ? ":" : "");
  setenv("ASAN_OPTIONS", opts, 1);
#endif
  sxt_fault_spawn(&env, &p, "victim-target", env.url, NULL, 5000, 50, NULL);
#ifdef SXT_ASAN
  if (saved != NULL)
    setenv("ASAN_OPTIONS", saved, 1);
  else
    unsetenv("ASAN_OPTIONS");
  free(saved);
#endif
  sxt_fault_wait_published(&p, NULL, 20000);
  sx_store *s;
  sxt_ok(sx_store_open(env.url, &s));
  sx_desc d;
  sxt_ok(sx_store_get(s, p.name, &d, NULL));
  sx_store_close(s);
  uint16_t port = sxt_tcp_port(&d);
  sx_desc_free(&d);
  int fds0 = fd_count(p.pid);
  long rss0 = sxt_rss_kib(p.pid);
  assert_int_equal(established_on(port), 0);
  for (int round = 0; round < 3; round++) {
    char exe[PATH_MAX + 16], log[300];
    snprintf(exe, sizeof(exe), "%s/sxctl", env.bindir);
    snprintf(log, sizeof(log), "%s/reader-%d.log", env.tmpdir, round);
    const char *argv[] = {exe, "--metadata", env.url, "read", p.name, "--blocks",
                          "random:100000", "--batch", "64", "--depth", "4", "--fingerprint",
                          "faults/v1", NULL};
    pid_t victim = sxt_spawn(log, argv);
    /* Killed while its connections are up and reads flow. */
    for (int i = 0; i < 1000 && established_on(port) < 1; i++)
      sxt_sleep_ms(10);
    assert_true(established_on(port) >= 1);
    sxt_sleep_ms(200);
    assert_int_equal(waitpid(victim, NULL, WNOHANG), 0); /* still reading */
    kill(victim, SIGKILL);
    assert_int_equal(sxt_reap(victim, 10000), 128 + SIGKILL);
    uint64_t t0 = sx__mono_ms();
    while ((established_on(port) > 0 || fd_count(p.pid) > fds0) && sx__mono_ms() - t0 < 10000)
      sxt_sleep_ms(10);
    print_message("measured: reader %d killed mid-batch: the target closed its "
                  "connections and freed their fds within %lu ms\n", round,
                  (unsigned long)(sx__mono_ms() - t0));
    assert_int_equal(established_on(port), 0);
    assert_int_equal(fd_count(p.pid), fds0);
  }
  long rss1 = sxt_rss_kib(p.pid);
  print_message("measured: target RSS %ld KiB before, %ld KiB after 3 killed readers\n",
                rss0, rss1);
  assert_true(rss1 < rss0 + 16 * 1024);
  /* And it serves the next reader. */
  sxt_fault_reader r;
  sxt_fault_reader_start(&r, env.url);
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, p.name, 5000, &seg));
  sx_block_read e = sxt_fault_blocks(4, 12);
  assert_int_equal(sxt_fault_batch(seg, &e, 5000, NULL).state, SX_BATCH_COMPLETED);
  assert_int_equal(sxt_fault_verify(&r, seg, 50, &e), 0);
  sx_segment_close(seg);
  sxt_fault_reader_stop(&r);
  /* Every connection it logged, it logged closed (the last ones a moment
   * after the reader went). */
  for (int i = 0; i < 500 && sxt_count_in_file(p.log, "connected from") !=
                                 sxt_count_in_file(p.log, "disconnected");
       i++)
    sxt_sleep_ms(10);
  assert_int_equal(sxt_count_in_file(p.log, "connected from"),
                   sxt_count_in_file(p.log, "disconnected"));
  assert_int_equal(sxt_fault_stop(&p, SIGTERM), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fault_agent_sigkill_segment_gone_within_a_lease),
      cmocka_unit_test(test_fault_agent_stopped_past_lease_republishes),
      cmocka_unit_test(test_fault_agent_stopped_while_another_took_the_name_is_fenced),
      cmocka_unit_test(test_fault_reader_killed_during_batches_target_frees_all),
  };
  return sxt_fault_main(&env, "test_faults", "fault injection: processes", tests,
                        sizeof(tests) / sizeof(tests[0]), NULL);
}
