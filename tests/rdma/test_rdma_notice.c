/*
 * Read notices (SX_BATCH_NOTIFY) for batches read over RDMA, where an RDMA
 * device exists (the Soft-RoCE VM, or real hardware).  RDMA READs are
 * one-sided and a reader's QPs carry no messages, so the notice travels on
 * a TCP connection to the same target once every READ completed: it names
 * the reader, the tag and the target's blocks, and a read without the flag
 * leaves none.  A target that serves no TCP refuses such a batch before a
 * byte is read.  With a real redis-server: an `sxctl read --notify-tag`
 * reader over RDMA killed mid-stream leaves one notice per batch it
 * completed and none for the batch it was in.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "procs.h"
#include "proc_env.h"
#include "push_fixture.h"

static sxt_proc_env env;

static sx_block_read kv_read(uint64_t remote, uint64_t local, uint64_t count) {
  return (sx_block_read){.layer_count = SXT_LAYERS, .slots = SXT_KV, .remote_block = remote,
                         .local_block = local, .count = count};
}

static sx_batch_result run(sx_segment *s, const sx_block_read *e, size_t n, int notify,
                           uint64_t tag) {
  return sxt_batch_finish(notify ? sxt_notify_submit(s, e, n, tag, 20000)
                                 : sxt_batch_submit(s, e, n, 20000));
}

static void test_rdma_notice_after_every_read(void **state) {
  (void)state;
  char url[64];
  sxt_mem_url(url, sizeof(url), "rdma-notice");
  sxt_agent t, r;
  sxt_target_start(&t, url, "rprefill-n", NULL, 42);
  sxt_reader_start(&r, url, "rdecode-n");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "rprefill-n", 5000, &seg));
  if (sx_segment_transport(seg) != SX_TRANSPORT_RDMA)
    fail_msg("rprefill-n would be read over %s, not RDMA (is there an RDMA device here?)",
             sx_segment_transport(seg) == SX_TRANSPORT_TCP ? "TCP" : "nothing");
  sx_block_read plain = kv_read(1, 0, 2);
  sx_batch_result res = run(seg, &plain, 1, 0, 0);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  sxt_expect_no_notice(t.a);
  sx_block_read e[2] = {kv_read(7, 0, 5), kv_read(50, 5, 9)};
  res = run(seg, e, 2, 1, 0x1122334455667788ull);
  if (res.state != SX_BATCH_COMPLETED)
    fail_msg("read batch %s: %s (%s)", sx_batch_state_name(res.state), res.message,
             sx_err_name(res.error));
  assert_int_equal(res.transport, SX_TRANSPORT_RDMA);
  assert_int_equal(res.bytes, 14 * SXT_LAYERS * 2 * SXT_BLOCK);
  for (int i = 0; i < 2; i++)
    assert_int_equal(sxt_verify_blocks(&r, seg, 42, &e[i]), 0);
  /* COMPLETED: the target holds it already; it came over TCP. */
  sx_notice *n = NULL;
  sxt_ok(sx_agent_notice_next(t.a, 0, &n));
  assert_int_equal(n->kind, SX_NOTICE_READ);
  assert_int_equal(n->transport, SX_TRANSPORT_TCP);
  sx_block_write w[2] = {{.layer_count = SXT_LAYERS, .slots = SXT_KV, .remote_block = 7,
                          .count = 5},
                         {.layer_count = SXT_LAYERS, .slots = SXT_KV, .remote_block = 50,
                          .count = 9}};
  sxt_check_notice(n, &r, "rdecode-n", 0x1122334455667788ull, w, 2);
  sx_notice_free(n);
  /* Many at once: one notice each, every tag once. */
  sx_batch *bs[8];
  for (int i = 0; i < 8; i++) {
    sx_block_read one = kv_read((uint64_t)i * 8, (uint64_t)i * 4, 4);
    bs[i] = sxt_notify_submit(seg, &one, 1, 100 + (uint64_t)i, 20000);
  }
  unsigned seen = 0;
  for (int i = 0; i < 8; i++) {
    sx_batch_result br = sxt_batch_finish(bs[i]);
    assert_int_equal(br.state, SX_BATCH_COMPLETED);
    sxt_ok(sx_agent_notice_next(t.a, 1000, &n));
    assert_true(n->tag >= 100 && n->tag < 108 && !(seen & (1u << (n->tag - 100))));
    seen |= 1u << (n->tag - 100);
    assert_int_equal(n->blocks[0].block, (n->tag - 100) * 8);
    sx_notice_free(n);
  }
  sxt_expect_no_notice(t.a);
  sx_segment_close(seg);
  sxt_agent_stop(&r);
  sxt_agent_stop(&t);
}

static void test_rdma_notice_needs_tcp_at_the_target(void **state) {
  (void)state;
  char url[64];
  sxt_mem_url(url, sizeof(url), "rdma-notice");
  sxt_agent t, r;
  memset(&t, 0, sizeof(t));
  sx_agent_params p;
  sxt_params(&p, url, "rprefill-only");
  p.transports = SX_TRANSPORTS_RDMA;
  sxt_ok(sx_agent_create(&p, &t.a));
  sxt_register_kv(&t, SXT_TARGET_BLOCKS, SX_ACCESS_REMOTE_READ);
  sxt_ok(sx_agent_publish(t.a, 0));
  sxt_reader_start(&r, url, "rdecode-only");
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "rprefill-only", 5000, &seg));
  assert_int_equal(sx_segment_transport(seg), SX_TRANSPORT_RDMA);
  sx_block_read e = kv_read(0, 0, 4);
  sx_batch_result res = run(seg, &e, 1, 1, 5);
  assert_int_equal(res.state, SX_BATCH_FAILED);
  assert_int_equal(res.error, SX_ENOTSUP);
  assert_int_equal(res.bytes, 0);
  assert_non_null(strstr(res.message, "TCP"));
  /* Without the flag the same read works. */
  res = run(seg, &e, 1, 0, 0);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  sxt_expect_no_notice(t.a);
  sx_segment_close(seg);
  sxt_agent_stop(&r);
  sxt_agent_stop(&t);
}

static void test_rdma_notice_reader_killed_mid_stream(void **state) {
  (void)state;
  SXT_NEED_REDIS(&env);
  const uint64_t blocks = 4096, batch = 64; /* 64 batches of 2 MiB */
  sxt_agent t;
  memset(&t, 0, sizeof(t));
  sx_agent_params p;
  sxt_params(&p, env.url, "rprefill-k");
  p.listen = "127.0.0.1:0";
  sxt_ok(sx_agent_create(&p, &t.a));
  sxt_register_kv(&t, blocks, SX_ACCESS_REMOTE_READ);
  sxt_ok(sx_agent_publish(t.a, 0));
  char exe[PATH_MAX + 16], log[300];
  snprintf(exe, sizeof(exe), "%s/sxctl", env.bindir);
  snprintf(log, sizeof(log), "%s/rnotice-victim.log", env.tmpdir);
  const char *argv[] = {exe, "--metadata", env.url, "read", "rprefill-k", "--blocks", "all",
                        "--batch", "64", "--depth", "1", "--notify-tag", "1000",
                        "--transport", "rdma", "--timeout-ms", "60000", NULL};
  pid_t victim = sxt_spawn_ok(log, argv);
  /* Its first batch done, stop it in the middle of the stream. */
  sx_notice *n = NULL;
  if (sx_agent_notice_next(t.a, 30000, &n) != 0) {
    sxt_show_log(log);
    fail_msg("no read notice of the reader within 30 s");
  }
  assert_int_equal(sxt_freeze(victim), 0);
  uint64_t next = 1000;
  do { /* each one a whole batch, in order */
    assert_int_equal(n->kind, SX_NOTICE_READ);
    assert_int_equal(n->tag, next);
    assert_int_equal(n->n_blocks, 1);
    assert_int_equal(n->blocks[0].block, (next - 1000) * batch);
    assert_int_equal(n->blocks[0].count, batch);
    assert_int_equal(n->bytes, batch * SXT_LAYERS * 2 * SXT_BLOCK);
    sx_notice_free(n);
    next++;
  } while (sx_agent_notice_next(t.a, 500, &n) == 0);
  kill(victim, SIGKILL);
  assert_int_equal(sxt_reap(victim, 10000), 128 + SIGKILL);
  print_message("measured: %lu of %lu batches notified before the reader was killed\n",
                (unsigned long)(next - 1000), (unsigned long)(blocks / batch));
  if (next - 1000 >= blocks / batch)
    fail_msg("every batch completed before the reader was stopped: the test proves "
             "nothing (raise its size)");
  /* The batch it was in leaves nothing, now or later. */
  sxt_rc(sx_agent_notice_next(t.a, 2000, &n), SX_ETIMEDOUT);
  sxt_agent_stop(&t);
}

static int group_setup(void **state) {
  (void)state;
  return sxt_proc_env_setup(&env, &(sxt_proc_env_opts){.test = "test_rdma_notice",
                                                       .tmp = "rdma-notice", .bin_here = 1,
                                                       .need = "sxctl", .ns = "rdma-notice",
                                                       .redis_required = 1});
}

static int group_teardown(void **state) {
  (void)state;
  return sxt_proc_env_teardown(&env);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rdma_notice_after_every_read),
      cmocka_unit_test(test_rdma_notice_needs_tcp_at_the_target),
      cmocka_unit_test(test_rdma_notice_reader_killed_mid_stream),
  };
  const char *filter = getenv("SXT_FILTER");
  if (filter != NULL)
    cmocka_set_test_filter(filter);
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
