/*
 * Fault injection, end to end: the network fails.
 * sx-agent processes (BUILD/bin/sx-agent) hold filled pools and publish
 * them in a real redis-server; readers in this process open them by name
 * and read over TCP while the test breaks things.
 *
 *   - a partition between reader and target (target in a network namespace
 *     behind a veth pair): packet loss, a slow link and the link down make
 *     batches end at their deadline (TIMEOUT), and reads work again after
 *     the link heals.
 *
 * Needs root (network namespaces, veth) and tc netem or nftables; says so
 * and skips otherwise. *
 * Each test prints what it measured ("measured: ...").  Bounds are one lease
 * or one renew interval plus documented backoff, with a margin for a loaded
 * machine.  SXT_FILTER=pattern runs a subset; SXT_KEEP_LOGS=1 keeps logs.
 * The actors are in tests/support/fault_fixture.c.
 */
#include <signal.h>
#include <stdarg.h>
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

/* ------------------------------------------------------------ partition */

/* The target lives in a network namespace joined to this one by a veth
 * pair; tc and nft act inside the namespace (deleted with it). */
static char netns[32], veth_host[16];
static int net_up;
static char host_ip[20], ns_ip[20];

static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...) {
  char cmd[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof(cmd), fmt, ap);
  va_end(ap);
  char full[1200];
  snprintf(full, sizeof(full), "%s >>%s/net.log 2>&1", cmd, env.tmpdir);
  int st = system(full);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void net_down(void) {
  if (!net_up)
    return;
  /* Deleting the namespace deletes its end of the veth pair, and with it
   * the pair, its qdiscs and the namespace's nft tables. */
  sh("ip netns del %s", netns);
  sh("ip link del %s", veth_host);
  net_up = 0;
}

/* 0, or why the partition tests cannot run here (printed). */
static int net_setup(void) {
  if (geteuid() != 0) {
    print_message("skipped: partition tests need root (network namespaces, veth)\n");
    return -1;
  }
  if (sxt_ip_cmd() == NULL) {
    print_message("skipped: iproute2 (ip) is not installed (make deps)\n");
    return -1;
  }
  snprintf(netns, sizeof(netns), "sxf-%d", (int)getpid());
  snprintf(veth_host, sizeof(veth_host), "sxfh%d", (int)getpid() % 100000);
  /* A subnet of this process's own: runs in parallel (CI, developers)
   * must not claim the same address in the root namespace. */
  int pid = (int)getpid();
  snprintf(host_ip, sizeof(host_ip), "10.%d.%d.1", 100 + pid % 100, (pid / 100) % 250);
  snprintf(ns_ip, sizeof(ns_ip), "10.%d.%d.2", 100 + pid % 100, (pid / 100) % 250);
  if (sh("ip netns add %s", netns) != 0) {
    print_message("skipped: cannot create a network namespace (ip netns add)\n");
    return -1;
  }
  net_up = 1;
  atexit(net_down);
  if (sh("ip link add %s type veth peer name sxfn0 netns %s", veth_host, netns) != 0 ||
      sh("ip addr add %s/24 dev %s", host_ip, veth_host) != 0 ||
      sh("ip link set %s up", veth_host) != 0 ||
      sh("ip -n %s addr add %s/24 dev sxfn0", netns, ns_ip) != 0 ||
      sh("ip -n %s link set sxfn0 up", netns) != 0 ||
      sh("ip -n %s link set lo up", netns) != 0) {
    net_down();
    print_message("skipped: cannot set up a veth pair into the namespace\n");
    return -1;
  }
  return 0;
}

/* Impairments inside the namespace, on the target's side. */
static int have_nft, have_netem;

static void impair_clear(void) {
  sh("ip netns exec %s nft delete table inet sxf", netns);
  sh("ip netns exec %s tc qdisc del dev sxfn0 root", netns);
  sh("ip link set %s up", veth_host);
}

/* Drop this percentage of the target's data-plane packets, both ways. */
static int impair_loss(int percent, uint16_t port) {
  if (have_netem)
    return sh("ip netns exec %s tc qdisc add dev sxfn0 root netem loss %d%%", netns, percent);
  if (sh("ip netns exec %s nft add table inet sxf", netns) != 0 ||
      sh("ip netns exec %s nft add chain inet sxf in '{ type filter hook input priority 0; }'",
         netns) != 0 ||
      sh("ip netns exec %s nft add chain inet sxf out '{ type filter hook output priority 0; "
         "}'", netns) != 0)
    return -1;
  if (percent >= 100)
    return sh("ip netns exec %s nft add rule inet sxf in tcp dport %u drop", netns, port) ||
           sh("ip netns exec %s nft add rule inet sxf out tcp sport %u drop", netns, port);
  return sh("ip netns exec %s nft add rule inet sxf in tcp dport %u numgen random mod 100 "
            "'<' %d drop", netns, port, percent) ||
         sh("ip netns exec %s nft add rule inet sxf out tcp sport %u numgen random mod 100 "
            "'<' %d drop", netns, port, percent);
}

/* A link slower than the batch needs: netem delay where the kernel has it,
 * else a token bucket at 200 kbit/s (queueing delay grows with the data). */
static int impair_slow(void) {
  if (have_netem)
    return sh("ip netns exec %s tc qdisc add dev sxfn0 root netem delay 400ms", netns);
  return sh("ip netns exec %s tc qdisc add dev sxfn0 root tbf rate 200kbit burst 16kb latency 10s",
            netns);
}

/* One batch that must end at its deadline with a timeout. */
static void expect_timeout(sx_segment *seg, sxt_fault_reader *r, const sx_block_read *e,
                           uint32_t deadline, const char *what) {
  sxt_fault_fill(r, 0xcd);
  uint64_t took;
  sx_batch_result res = sxt_fault_batch(seg, e, deadline, &took);
  if (res.state != SX_BATCH_TIMEOUT || res.error != SX_ETIMEDOUT)
    fail_msg("%s: the batch ended %s (%s: %s) after %lu ms instead of TIMEOUT at its "
             "%u ms deadline", what, sx_batch_state_name(res.state),
             sx_err_name(res.error), res.message, (unsigned long)took, deadline);
  if (took + 50 < deadline || took > deadline + 2000)
    fail_msg("%s: TIMEOUT after %lu ms, not at the %u ms deadline", what,
             (unsigned long)took, deadline);
  /* Bytes that arrived before the deadline are in place (payload goes
   * straight to the destination), but nothing may land after the end:
   * the transport drains what is still on its way into scratch memory. */
  size_t bytes = (size_t)SXT_FAULT_LAYERS * SXT_FAULT_LOCAL_BLOCKS * SXT_FAULT_BLOCK;
  uint8_t *copy[2];
  for (int s = 0; s < 2; s++) {
    copy[s] = malloc(bytes);
    assert_non_null(copy[s]);
    memcpy(copy[s], r->mem[s], bytes);
  }
  sxt_sleep_ms(300);
  for (int s = 0; s < 2; s++) {
    if (memcmp(copy[s], r->mem[s], bytes) != 0)
      fail_msg("%s: a destination of the timed-out batch changed after it ended", what);
    free(copy[s]);
  }
  print_message("measured: %s: TIMEOUT after %lu ms (deadline %u ms)\n", what,
                (unsigned long)took, deadline);
}

/* Batches until one completes (verified): ms from the call, or fail. */
static uint64_t until_reads_work(sx_segment *seg, sxt_fault_reader *r, uint64_t seed,
                                 const sx_block_read *e, const char *what) {
  uint64_t t0 = sx__mono_ms();
  int tries = 0;
  while (sx__mono_ms() - t0 < 60000) {
    tries++;
    sx_batch_result res = sxt_fault_batch(seg, e, 1000, NULL);
    if (res.state == SX_BATCH_COMPLETED) {
      assert_int_equal(sxt_fault_verify(r, seg, seed, e), 0);
      uint64_t ms = sx__mono_ms() - t0;
      print_message("measured: %s: reads work again %lu ms after the link healed (%d "
                    "batches of 1 s)\n", what, (unsigned long)ms, tries);
      return ms;
    }
  }
  fail_msg("%s: no batch completed within 60 s of healing", what);
  return 0;
}

static void test_fault_partition_loss_slow_link_down_then_heal(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  if (net_setup() != 0)
    skip();
  have_netem = sh("ip netns exec %s tc qdisc add dev sxfn0 root netem delay 1ms", netns) == 0;
  if (have_netem)
    sh("ip netns exec %s tc qdisc del dev sxfn0 root", netns);
  have_nft = sh("nft --version") == 0;
  if (!have_netem && !have_nft) {
    net_down();
    print_message("skipped: neither tc netem (kernel module sch_netem) nor nft "
                  "(nftables) is available to drop packets\n");
    skip();
  }
  print_message("impairments: %s for loss, %s for a slow link\n",
                have_netem ? "tc netem" : "nft random drop",
                have_netem ? "netem delay" : "tbf at 200 kbit/s");
  /* A Redis both sides reach: this side on 127.0.0.1, the target over the
   * veth (the store is not what is partitioned: only the data port is,
   * until the link goes down). */
  sxt_redis rs;
  char opts_bind[64];
  snprintf(opts_bind, sizeof(opts_bind), "127.0.0.1 %s", host_ip);
  if (sxt_redis_start(&rs, &(sxt_redis_opts){.notify = "Kx", .bind = opts_bind}) != 0) {
    net_down();
    fail_msg("cannot start a redis-server on %s", opts_bind);
  }
  char here[256], there[256], listen[64];
  sxt_redis_url(&rs, here, sizeof(here), "namespace=part");
  snprintf(there, sizeof(there), "redis://%s:%d?namespace=part", host_ip, rs.port);
  snprintf(listen, sizeof(listen), "%s:0", ns_ip);
  sxt_fault_agent p;
  /* A long lease: the segment must outlive the link being down. */
  sxt_fault_spawn(&env, &p, "behind-veth", there, listen, 60000, 40, netns);
  snprintf(p.url, sizeof(p.url), "%s", here);
  sxt_fault_wait_published(&p, NULL, 20000);
  sxt_fault_reader r;
  sxt_fault_reader_start(&r, here);
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, p.name, 5000, &seg));
  uint16_t port = sxt_tcp_port(sx_segment_desc(seg));
  sx_block_read small = sxt_fault_blocks(0, 8), big = sxt_fault_blocks(0, 64);
  assert_int_equal(sxt_fault_batch(seg, &big, 5000, NULL).state, SX_BATCH_COMPLETED);
  assert_int_equal(sxt_fault_verify(&r, seg, 40, &big), 0);

  /* Every data packet lost: no error comes back, the deadline ends it. */
  assert_int_equal(impair_loss(100, port), 0);
  expect_timeout(seg, &r, &small, 700, "all data packets dropped");
  impair_clear();
  until_reads_work(seg, &r, 40, &small, "after total loss");

  /* Heavy random loss: each batch completes with the right bytes or ends
   * at its deadline; none hangs, none fails with garbage. */
  assert_int_equal(impair_loss(20, port), 0);
  int done = 0, timeouts = 0;
  for (int i = 0; i < 6; i++) {
    sxt_fault_fill(&r, 0xee);
    uint64_t took;
    sx_batch_result res = sxt_fault_batch(seg, &small, 1000, &took);
    if (res.state == SX_BATCH_COMPLETED) {
      assert_int_equal(sxt_fault_verify(&r, seg, 40, &small), 0);
      done++;
    } else if (res.state == SX_BATCH_TIMEOUT) {
      assert_true(took + 50 >= 1000 && took <= 1000 + 2000);
      timeouts++;
    } else {
      fail_msg("20%% loss: a batch ended %s (%s: %s)", sx_batch_state_name(res.state),
               sx_err_name(res.error), res.message);
    }
  }
  print_message("measured: 20%% loss: %d of 6 batches of 1 MiB completed (verified), %d "
                "ended at their 1000 ms deadline\n", done, timeouts);
  impair_clear();
  until_reads_work(seg, &r, 40, &small, "after random loss");

  /* A link far too slow for the batch. */
  assert_int_equal(impair_slow(), 0);
  expect_timeout(seg, &r, &big, 1000, have_netem ? "400 ms delay" : "200 kbit/s link");
  impair_clear();
  until_reads_work(seg, &r, 40, &small, "after the slow link");

  /* The link down (store traffic of the target too). */
  assert_int_equal(sh("ip link set %s down", veth_host), 0);
  expect_timeout(seg, &r, &small, 700, "link down");
  expect_timeout(seg, &r, &small, 700, "link still down");
  assert_int_equal(sh("ip link set %s up", veth_host), 0);
  until_reads_work(seg, &r, 40, &big, "after link down");

  sx_segment_close(seg);
  sxt_fault_reader_stop(&r);
  assert_int_equal(sxt_fault_stop(&p, SIGTERM), 0);
  sxt_redis_stop(&rs);
  net_down();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fault_partition_loss_slow_link_down_then_heal),
  };
  return sxt_fault_main(&env, "test_faults_net", "fault injection: the network", tests,
                        sizeof(tests) / sizeof(tests[0]), net_down);
}
