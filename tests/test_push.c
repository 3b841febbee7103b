/*
 * Push mode inside one process (mem:// store): the notice codec, write
 * planning and its planning-time refusals, grants, the consumer's notice
 * checks and queue.  Write batches over TCP: test_push_tcp.c.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "agent_int.h"
#include "notice.h"
#include "push_fixture.h"
#include "push_int.h"
#include "segxfer.pb-c.h"
#include "transport/conn/frame.h"

/* ------------------------------------------------------------ codec */

static sx_notice *sample_notice(uint32_t nb, uint32_t nr) {
  sx_notice *n = sx__notice_alloc(nb, nr);
  assert_non_null(n);
  snprintf(n->producer, sizeof(n->producer), "prefill-0/tp1");
  for (int i = 0; i < SX_INCARNATION_LEN; i++)
    n->incarnation[i] = (uint8_t)(i + 1);
  n->tag = 0xfeedfacecafebeefull;
  n->bytes = 12345;
  sx_notice_blocks *b = sx__notice_blocks(n);
  for (uint32_t i = 0; i < nb; i++)
    b[i] = (sx_notice_blocks){.group = i % 3, .layer_first = i, .layer_count = 2 + i,
                              .slots = 3, .block = 1000 * i, .count = i + 1};
  sx_notice_range *r = sx__notice_ranges(n);
  for (uint32_t i = 0; i < nr; i++)
    r[i] = (sx_notice_range){.region = i, .offset = (uint64_t)i << 40, .length = 7 + i};
  return n;
}

static void test_notice_codec_round_trip(void **state) {
  (void)state;
  sx_notice *n = sample_notice(5, 3);
  uint8_t *buf;
  size_t len;
  sxt_ok(sx__notice_encode(n, &buf, &len));
  sx_notice *m;
  sxt_ok(sx__notice_decode(buf, len, &m));
  assert_string_equal(m->producer, n->producer);
  assert_memory_equal(m->incarnation, n->incarnation, SX_INCARNATION_LEN);
  assert_int_equal(m->tag, n->tag);
  assert_int_equal(m->bytes, n->bytes);
  assert_int_equal(m->n_blocks, 5);
  assert_int_equal(m->n_ranges, 3);
  assert_memory_equal(m->blocks, n->blocks, 5 * sizeof(sx_notice_blocks));
  assert_memory_equal(m->ranges, n->ranges, 3 * sizeof(sx_notice_range));
  free(buf);
  sx_notice_free(m);
  /* The largest notice fits the limit. */
  sx_notice_free(n);
  n = sample_notice(SX_NOTICE_MAX_ENTRIES / 2, SX_NOTICE_MAX_ENTRIES / 2);
  sx_notice_blocks *b = sx__notice_blocks(n);
  for (uint32_t i = 0; i < n->n_blocks; i++)
    b[i] = (sx_notice_blocks){UINT32_MAX / 2, UINT32_MAX / 2, UINT32_MAX / 2, UINT64_MAX,
                              UINT64_MAX / 2, UINT64_MAX / 2};
  sxt_ok(sx__notice_encode(n, &buf, &len));
  assert_true(len <= SX_NOTICE_MAX_BYTES);
  sxt_ok(sx__notice_decode(buf, len, &m));
  free(buf);
  sx_notice_free(m);
  sx_notice_free(n);
  assert_null(sx__notice_alloc(SX_NOTICE_MAX_ENTRIES, 1));
}

/* Encode a hand-made protobuf message, for inputs the encoder refuses. */
static int decode_pb(const Sxpb__WriteNotice *m) {
  size_t len = sxpb__write_notice__get_packed_size(m);
  uint8_t *buf = malloc(len + 1);
  sxpb__write_notice__pack(m, buf);
  sx_notice *n = NULL;
  int rc = sx__notice_decode(buf, len, &n);
  if (rc == 0)
    sx_notice_free(n);
  free(buf);
  return rc;
}

static void test_notice_decode_is_strict(void **state) {
  (void)state;
  uint8_t inc[SX_INCARNATION_LEN] = {1, 2, 3};
  uint32_t u32[2] = {0, 1};
  uint64_t u64[2] = {1, 2}, zero64[2] = {0, 0}, big[2] = {UINT64_MAX, 1};
  Sxpb__WriteNotice base = SXPB__WRITE_NOTICE__INIT;
  base.version = 1;
  char p_name[] = "p", empty[] = "", bad_name[] = "bad name";
  base.producer = p_name;
  base.incarnation = (ProtobufCBinaryData){SX_INCARNATION_LEN, inc};
  assert_int_equal(decode_pb(&base), 0);

  Sxpb__WriteNotice m = base;
  m.version = 2;
  assert_int_equal(decode_pb(&m), SX_EVERSION);
  m = base;
  m.producer = empty;
  assert_int_equal(decode_pb(&m), SX_ENAME);
  m = base;
  m.producer = bad_name;
  assert_int_equal(decode_pb(&m), SX_ENAME);
  m = base;
  m.incarnation.len = 15;
  assert_int_equal(decode_pb(&m), SX_EDECODE);
  m = base;
  m.incarnation.len = 0;
  assert_int_equal(decode_pb(&m), SX_EDECODE);
  /* Columns of one kind must have one value per entry. */
  m = base;
  m.n_b_group = m.n_b_layer_first = m.n_b_layer_count = 2;
  m.b_group = m.b_layer_first = m.b_layer_count = u32;
  m.n_b_slots = m.n_b_block = 2;
  m.b_slots = m.b_block = u64;
  m.n_b_count = 1;
  m.b_count = u64;
  assert_int_equal(decode_pb(&m), SX_EDECODE);
  m.n_b_count = 2;
  u32[0] = 1; /* layer_count 1 */
  assert_int_equal(decode_pb(&m), 0);
  m.b_count = zero64;
  assert_int_equal(decode_pb(&m), SX_EINVAL);
  m.b_count = u64;
  m.b_block = big; /* block + count overflows */
  assert_int_equal(decode_pb(&m), SX_EOVERFLOW);
  m = base;
  m.n_r_region = m.n_r_offset = m.n_r_length = 1;
  m.r_region = u32;
  m.r_offset = big;
  m.r_length = u64;
  assert_int_equal(decode_pb(&m), SX_EOVERFLOW);
  m.r_length = zero64;
  assert_int_equal(decode_pb(&m), SX_EINVAL);
  /* Not protobuf, too large, an unknown field. */
  sx_notice *n = NULL;
  const uint8_t junk[] = {0xff, 0xff, 0xff, 0xff};
  assert_int_equal(sx__notice_decode(junk, sizeof(junk), &n), SX_EDECODE);
  uint8_t *huge = calloc(1, SX_NOTICE_MAX_BYTES + 1);
  assert_int_equal(sx__notice_decode(huge, SX_NOTICE_MAX_BYTES + 1, &n), SX_ELIMIT);
  free(huge);
  size_t len = sxpb__write_notice__get_packed_size(&base);
  uint8_t buf[256];
  sxpb__write_notice__pack(&base, buf);
  buf[len] = (16 << 3) | 0; /* field 16 (unknown), varint 5 */
  buf[len + 1] = 5;
  assert_int_equal(sx__notice_decode(buf, len + 2, &n), SX_EDECODE);
  assert_null(n);
  /* Field 15 is the kind: write (0) or read (1), nothing else. */
  buf[len] = (15 << 3) | 0;
  assert_int_equal(sx__notice_decode(buf, len + 2, &n), SX_EINVAL);
  assert_null(n);
  buf[len + 1] = 1;
  assert_int_equal(sx__notice_decode(buf, len + 2, &n), 0);
  assert_int_equal(n->kind, SX_NOTICE_READ);
  sx_notice_free(n);
  n = NULL;
}

/* ------------------------------------------------------------ planning */

static sx_batch *write_batch(sx_segment *s) {
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.flags = SX_BATCH_WRITE;
  sx_batch *b;
  sxt_ok(sx_batch_create(s, &bp, &b));
  return b;
}

static void test_push_planning_refusals(void **state) {
  (void)state;
  sxt_pair x;
  sxt_pair_start(&x, SXT_RW);
  sx_batch *b = write_batch(x.seg);
  sx_block_write w = {.layer_count = SXT_LAYERS, .slots = SXT_KV, .count = 4};
  sxt_ok(sx_batch_add_block_writes(b, &w, 1));
  /* Out of bounds on either side, a missing key, a bad entry. */
  sx_block_write bad = w;
  bad.remote_block = SXT_CONSUMER_BLOCKS - 1;
  sxt_rc(sx_batch_add_block_writes(b, &bad, 1), SX_EBOUNDS);
  bad = w;
  bad.local_block = SXT_TARGET_BLOCKS;
  sxt_rc(sx_batch_add_block_writes(b, &bad, 1), SX_EBOUNDS);
  bad = w;
  bad.layer_first = SXT_LAYERS;
  bad.layer_count = 1;
  sxt_rc(sx_batch_add_block_writes(b, &bad, 1), SX_ENOREGION);
  bad = w;
  bad.count = 0;
  sxt_rc(sx_batch_add_block_writes(b, &bad, 1), SX_EINVAL);
  sx_range_write rw = {.local = x.p.mem[0], .remote_region = 1,
                       .offset = SXT_LAYERS * SXT_CONSUMER_BLOCKS * SXT_BLOCK - 8,
                       .length = 16};
  sxt_rc(sx_batch_add_range_writes(b, &rw, 1), SX_EBOUNDS);
  rw.remote_region = 7;
  sxt_rc(sx_batch_add_range_writes(b, &rw, 1), SX_ENOREGION);
  /* Block lists: a count mismatch is a planning error, never truncated. */
  uint64_t loc[3] = {0, 1, 2}, rem[2] = {5, 6};
  sx_block_ids ids = {.layer_count = SXT_LAYERS, .slots = SXT_KV, .local = loc, .n_local = 3,
                      .remote = rem, .n_remote = 2};
  sxt_rc(sx_batch_add_block_ids(b, &ids), SX_EINCOMPAT);
  assert_non_null(strstr(sx_errmsg(), "3 local blocks but 2 remote"));
  ids.n_local = 0;
  ids.n_remote = 0;
  sxt_rc(sx_batch_add_block_ids(b, &ids), SX_EINVAL);
  /* One direction per batch. */
  sx_block_read r = {.layer_count = 1, .slots = 1, .count = 1};
  sxt_rc(sx_batch_add_blocks(b, &r, 1), SX_EINVAL);
  /* Once submitted, block lists are refused for that, not for the direction. */
  sxt_ok(sx_batch_submit(b));
  ids.n_local = ids.n_remote = 2;
  sxt_rc(sx_batch_add_block_ids(b, &ids), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "sx_batch_add_block_ids: the batch was already submitted"));
  sxt_ok(sx_batch_wait(b, 10000));
  sx_batch_destroy(b);
  sx_batch *rb;
  sxt_ok(sx_batch_create(x.seg, NULL, &rb));
  sxt_rc(sx_batch_add_block_writes(rb, &w, 1), SX_EINVAL);
  /* A read batch takes block lists too, as reads. */
  ids.n_local = ids.n_remote = 2;
  sxt_ok(sx_batch_add_block_ids(rb, &ids));
  sxt_ok(sx_batch_submit(rb));
  sxt_rc(sx_batch_add_block_ids(rb, &ids), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "sx_batch_add_block_ids: the batch was already submitted"));
  sxt_ok(sx_batch_wait(rb, 10000));
  sx_batch_destroy(rb);
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.flags = 0x80;
  sxt_rc(sx_batch_create(x.seg, &bp, &rb), SX_EINVAL);
  sxt_pair_stop(&x);
}

static void test_push_read_only_region_is_refused_at_planning(void **state) {
  (void)state;
  sxt_pair x;
  sxt_pair_start(&x, SX_ACCESS_REMOTE_READ);
  sx_batch *b = write_batch(x.seg);
  sx_block_write w = {.layer_count = 1, .slots = SXT_KV, .count = 1};
  sxt_rc(sx_batch_add_block_writes(b, &w, 1), SX_EDENIED);
  assert_non_null(strstr(sx_errmsg(), "does not allow remote writes"));
  sx_batch_destroy(b);
  /* And a write-only region cannot be read. */
  sxt_pair_stop(&x);
  sxt_pair_start(&x, SX_ACCESS_REMOTE_WRITE);
  sx_batch *rb;
  sxt_ok(sx_batch_create(x.seg, NULL, &rb));
  sx_block_read r = {.layer_count = 1, .slots = SXT_KV, .count = 1};
  sxt_rc(sx_batch_add_blocks(rb, &r, 1), SX_EDENIED);
  sx_batch_destroy(rb);
  sxt_pair_stop(&x);
}

static void test_push_notice_entry_limit_is_all_or_nothing(void **state) {
  (void)state;
  sxt_pair x;
  sxt_pair_start(&x, SXT_RW);
  sx_batch *b = write_batch(x.seg);
  /* Alternate the two slots so that no two entries merge. */
  size_t n = SX_NOTICE_MAX_ENTRIES;
  sx_block_write *w = calloc(n + 1, sizeof(*w));
  for (size_t i = 0; i <= n; i++)
    w[i] = (sx_block_write){.layer_count = 1, .slots = 1ull << (i % 2), .count = 1,
                            .local_block = i % SXT_TARGET_BLOCKS,
                            .remote_block = i % SXT_CONSUMER_BLOCKS};
  w[n - 1].local_block = w[n - 1].remote_block = 0;
  sxt_rc(sx_batch_add_block_writes(b, w, n + 1), SX_ELIMIT);
  sxt_ok(sx_batch_add_block_writes(b, w, n));
  sxt_rc(sx_batch_add_block_writes(b, w, 1), SX_ELIMIT);
  /* Entries that merge with the last one cost nothing. */
  sx_block_write more = w[n - 1];
  more.local_block++;
  more.remote_block++;
  sxt_ok(sx_batch_add_block_writes(b, &more, 1));
  sx_batch_destroy(b);
  free(w);
  sxt_pair_stop(&x);
}

static void test_push_write_batch_needs_a_named_agent(void **state) {
  (void)state;
  sxt_pair x;
  sxt_pair_start(&x, SXT_RW);
  sx_agent_params p;
  sxt_params(&p, x.url, NULL);
  sx_agent *anon;
  sxt_ok(sx_agent_create(&p, &anon));
  sx_segment *s;
  sxt_ok(sx_segment_open(anon, "decode-0", 2000, &s));
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.flags = SX_BATCH_WRITE;
  sx_batch *b;
  sxt_rc(sx_batch_create(s, &bp, &b), SX_EINVAL);
  sx_segment_close(s);
  sx_agent_destroy(anon);
  sxt_pair_stop(&x);
}

/* ------------------------------------------------------------ grants */

static void test_push_grants_and_revocation(void **state) {
  (void)state;
  char url[64];
  sxt_mem_url(url, sizeof(url), "push");
  sxt_agent c;
  sxt_consumer_start(&c, url, "decode-0", SXT_RW);
  sx_agent *a = c.a;
  uint8_t i1[SX_INCARNATION_LEN] = {1}, i2[SX_INCARNATION_LEN] = {2};
  assert_int_equal(sx__push_write_granted(a, "p", i1), SX_EACCESS);
  sxt_ok(sx_agent_grant_write(a, "p", i1));
  sxt_ok(sx_agent_grant_write(a, "p", i1)); /* twice is fine */
  assert_int_equal(sx__push_write_granted(a, "p", i1), 0);
  assert_int_equal(sx__push_write_granted(a, "p", i2), SX_EACCESS);
  assert_int_equal(sx__push_write_granted(a, "q", i1), SX_EACCESS);
  sxt_ok(sx_agent_grant_write(a, "q", NULL));
  assert_int_equal(sx__push_write_granted(a, "q", i2), 0);
  uint64_t epoch = a->push->epoch;
  sxt_ok(sx_agent_revoke_write(a, "p", i2)); /* matches nothing */
  assert_int_equal(a->push->epoch, epoch);
  sxt_ok(sx_agent_revoke_write(a, "p", i1));
  assert_true(a->push->epoch > epoch);
  assert_int_equal(sx__push_write_granted(a, "p", i1), SX_EACCESS);
  /* The namespace grant covers anyone until it is revoked by itself. */
  sxt_ok(sx_agent_grant_write(a, NULL, NULL));
  assert_int_equal(sx__push_write_granted(a, "p", i1), 0);
  sxt_ok(sx_agent_revoke_write(a, "q", NULL));
  assert_int_equal(sx__push_write_granted(a, "q", i1), 0);
  sxt_ok(sx_agent_revoke_write(a, NULL, NULL));
  assert_int_equal(sx__push_write_granted(a, "q", i1), SX_EACCESS);
  /* Bad arguments. */
  sxt_rc(sx_agent_grant_write(a, NULL, i1), SX_EINVAL);
  sxt_rc(sx_agent_grant_write(a, "bad name", NULL), SX_ENAME);
  sxt_rc(sx_agent_grant_write(NULL, "p", NULL), SX_EINVAL);
  sxt_agent_stop(&c);
}

/* ------------------------------------------------------------ notices */

/* A notice from "p"/inc for blocks of the consumer's K region. */
static void notice_in(sx_agent *a, const uint8_t *inc, const char *name, uint32_t layer,
                      uint64_t block, uint64_t count, uint64_t bytes, int expect) {
  sx_notice *n = sx__notice_alloc(1, 0);
  snprintf(n->producer, sizeof(n->producer), "%s", name);
  memcpy(n->incarnation, inc, SX_INCARNATION_LEN);
  n->tag = block;
  n->bytes = bytes;
  sx__notice_blocks(n)[0] = (sx_notice_blocks){.layer_first = layer, .layer_count = 1,
                                               .slots = 1, .block = block, .count = count};
  uint8_t *buf;
  size_t len;
  sxt_ok(sx__notice_encode(n, &buf, &len));
  char msg[256] = "";
  int rc = sx__push_notice_in(a, "p", inc, SX_TRANSPORT_TCP, buf, len, msg, sizeof(msg));
  if (rc != expect)
    fail_msg("notice_in = %s, expected %s (%s)", sx_err_name(rc), sx_err_name(expect), msg);
  free(buf);
  sx_notice_free(n);
}

static int taken;
static int take_odd(void *arg, const sx_notice *n) {
  (void)arg;
  if (n->tag % 2 == 0)
    return 0;
  taken++;
  return 1;
}

static void test_push_notice_checks_queue_fd_and_callback(void **state) {
  (void)state;
  char url[64];
  sxt_mem_url(url, sizeof(url), "push");
  sxt_agent c;
  sxt_consumer_start(&c, url, "decode-0", SXT_RW);
  sx_agent *a = c.a;
  uint8_t inc[SX_INCARNATION_LEN] = {7, 7};
  int fd = sx_agent_notice_fd(a);
  assert_true(fd >= 0);
  sx_notice *n;
  sxt_rc(sx_agent_notice_next(a, 0, &n), SX_ETIMEDOUT);
  sxt_rc(sx_agent_notice_next(a, 20, &n), SX_ETIMEDOUT);
  /* No grant yet. */
  notice_in(a, inc, "p", 0, 0, 1, SXT_BLOCK, SX_EACCESS);
  sxt_ok(sx_agent_grant_write(a, "p", inc));
  /* What the notice says must be exactly writable memory of this agent. */
  notice_in(a, inc, "q", 0, 0, 1, SXT_BLOCK, SX_EPROTO);            /* not the connection's */
  notice_in(a, inc, "p", 0, 0, 1, SXT_BLOCK + 1, SX_EPROTO);        /* bytes do not add up */
  notice_in(a, inc, "p", 0, SXT_CONSUMER_BLOCKS, 1, SXT_BLOCK, SX_EBOUNDS);
  notice_in(a, inc, "p", SXT_LAYERS, 0, 1, SXT_BLOCK, SX_EDENIED); /* no such layer */
  assert_false(sxt_fd_readable(fd));
  notice_in(a, inc, "p", 1, 2, 3, 3 * SXT_BLOCK, 0);
  assert_true(sxt_fd_readable(fd));
  notice_in(a, inc, "p", 1, 6, 1, SXT_BLOCK, 0);
  sxt_ok(sx_agent_notice_next(a, 0, &n));
  assert_string_equal(n->producer, "p");
  assert_int_equal(n->tag, 2);
  assert_int_equal(n->bytes, 3 * SXT_BLOCK);
  assert_int_equal(n->transport, SX_TRANSPORT_TCP);
  sx_notice_free(n);
  assert_true(sxt_fd_readable(fd));
  sxt_ok(sx_agent_notice_next(a, -1, &n));
  assert_int_equal(n->tag, 6);
  sx_notice_free(n);
  assert_false(sxt_fd_readable(fd));
  /* A callback takes the odd tags; the rest are queued. */
  sxt_ok(sx_agent_notice_cb(a, take_odd, NULL));
  notice_in(a, inc, "p", 0, 1, 1, SXT_BLOCK, 0);
  notice_in(a, inc, "p", 0, 4, 1, SXT_BLOCK, 0);
  assert_int_equal(taken, 1);
  sxt_ok(sx_agent_notice_next(a, 0, &n));
  assert_int_equal(n->tag, 4);
  sx_notice_free(n);
  sxt_ok(sx_agent_notice_cb(a, NULL, NULL));
  /* A consumer that never reads: the queue is bounded. */
  for (int i = 0; i < SX_NOTICE_QUEUE_MAX; i++)
    notice_in(a, inc, "p", 0, 0, 1, SXT_BLOCK, 0);
  notice_in(a, inc, "p", 0, 0, 1, SXT_BLOCK, SX_ELIMIT);
  sx_agent_stats st;
  sxt_ok(sx_agent_stats_get(a, &st, sizeof(st)));
  assert_int_equal(st.notices, 4 + SX_NOTICE_QUEUE_MAX);
  /* Revoked: refused at once. */
  sxt_ok(sx_agent_revoke_write(a, "p", NULL));
  notice_in(a, inc, "p", 0, 0, 1, SXT_BLOCK, SX_EACCESS);
  sxt_agent_stop(&c); /* frees what is queued */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_notice_codec_round_trip),
      cmocka_unit_test(test_notice_decode_is_strict),
      cmocka_unit_test(test_push_planning_refusals),
      cmocka_unit_test(test_push_read_only_region_is_refused_at_planning),
      cmocka_unit_test(test_push_notice_entry_limit_is_all_or_nothing),
      cmocka_unit_test(test_push_write_batch_needs_a_named_agent),
      cmocka_unit_test(test_push_grants_and_revocation),
      cmocka_unit_test(test_push_notice_checks_queue_fd_and_callback),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
