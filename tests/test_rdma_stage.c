/* Staged RDMA pieces that need no device: the stage hello flag, the
 * request and reply messages of a stage QP (what a target accepts from the
 * network), and the names of the GPU tiers. */
#include <endian.h>
#include <string.h>

#include "transport/rdma/rdma_int.h"
#include "sxtest.h"

static const uint8_t inc[SX_INCARNATION_LEN] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
static const uint8_t tok[SX_TOKEN_LEN] = {7};

static void test_rdma_stage_hello_flag(void **state) {
  (void)state;
  sx__rdma_hello_wire w;
  sx__rdma_hello h;
  sx__rdma_hello_pack(&w, "reader", 0, inc, tok);
  w.flags = SX__RDMA_HELLO_STAGE;
  sxt_ok(sx__rdma_hello_parse(&w, sizeof(w), &h));
  assert_int_equal(h.flags, SX__RDMA_HELLO_STAGE);
  assert_string_equal(h.name, "reader");
  /* A producer's stage QP (staged writes): a write hello with the flag;
   * the producer's incarnation rides where a reader's name would. */
  static const uint8_t pinc[SX_INCARNATION_LEN] = {9, 8, 7};
  sx__rdma_whello_pack(&w, 2, inc, pinc, tok);
  w.flags |= SX__RDMA_HELLO_STAGE;
  sxt_ok(sx__rdma_hello_parse(&w, sizeof(w), &h));
  assert_int_equal(h.flags, SX__RDMA_HELLO_STAGE | SX__RDMA_HELLO_WRITE);
  assert_int_equal(h.conn_index, 2);
  assert_memory_equal(h.producer, pinc, SX_INCARNATION_LEN);
  w.flags = 0x04;
  sxt_rc(sx__rdma_hello_parse(&w, sizeof(w), &h), SX_EPROTO);
  /* A target with staging off says so. */
  assert_int_equal(sx__rdma_reject_code(SX__RDMA_REJ_NOSTAGE), SX_ENOTSUP);
  assert_non_null(strstr(sx__rdma_reject_text(SX__RDMA_REJ_NOSTAGE), "SX_RDMA_GPU=off"));
}

static void test_rdma_stage_request_roundtrip(void **state) {
  (void)state;
  uint8_t buf[SX__RDMA_SMSG_BYTES];
  sx__rdma_sreq q = {.slot = SX__RDMA_STAGE_SLOTS - 1, .seq = 0x01020304u, .n = 3};
  q.r[0] = (sx__rdma_srange){.region = 7, .len = 4096, .off = 1ull << 40};
  q.r[1] = (sx__rdma_srange){.region = 8, .len = 1, .off = 0};
  q.r[2] = (sx__rdma_srange){.region = 0xfffffffeu, .len = SX__RDMA_STAGE_SLOT_BYTES - 4097,
                             .off = 12};
  size_t len = sx__rdma_sreq_pack(buf, &q);
  assert_int_equal(len, sizeof(sx__rdma_smsg_hdr) + 3 * sizeof(sx__rdma_srange));
  /* Big-endian on the wire. */
  assert_int_equal(buf[4], 1);
  assert_int_equal(buf[7], 4);
  sx__rdma_sreq out;
  char msg[160];
  sxt_ok(sx__rdma_sreq_parse(buf, len, 0, &out, msg, sizeof(msg)));
  assert_int_equal(out.slot, SX__RDMA_STAGE_SLOTS - 1);
  assert_int_equal(out.seq, 0x01020304u);
  assert_int_equal(out.n, 3);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(out.r[i].region, q.r[i].region);
    assert_int_equal(out.r[i].len, q.r[i].len);
    assert_int_equal(out.r[i].off, q.r[i].off);
  }
}

static void test_rdma_stage_request_garbage_is_refused(void **state) {
  (void)state;
  uint8_t buf[SX__RDMA_SMSG_BYTES + 16], bad[sizeof(buf)];
  sx__rdma_sreq q = {.slot = 1, .seq = 9, .n = 2}, out;
  q.r[0] = (sx__rdma_srange){.region = 1, .len = 100, .off = 0};
  q.r[1] = (sx__rdma_srange){.region = 2, .len = 100, .off = 0};
  size_t len = sx__rdma_sreq_pack(buf, &q);
  char msg[160];
  /* Short, long, wrong magic, wrong type, slot and count out of range. */
  sxt_rc(sx__rdma_sreq_parse(buf, 3, 0, &out, msg, sizeof(msg)), SX_EPROTO);
  sxt_rc(sx__rdma_sreq_parse(buf, len - 1, 0, &out, msg, sizeof(msg)), SX_EPROTO);
  sxt_rc(sx__rdma_sreq_parse(buf, len + 16, 0, &out, msg, sizeof(msg)), SX_EPROTO);
  memcpy(bad, buf, len);
  bad[0] = 'X';
  sxt_rc(sx__rdma_sreq_parse(bad, len, 0, &out, msg, sizeof(msg)), SX_EPROTO);
  memcpy(bad, buf, len);
  bad[2] = SX__RDMA_SMSG_REPLY;
  sxt_rc(sx__rdma_sreq_parse(bad, len, 0, &out, msg, sizeof(msg)), SX_EPROTO);
  memcpy(bad, buf, len);
  bad[3] = SX__RDMA_STAGE_SLOTS;
  sxt_rc(sx__rdma_sreq_parse(bad, len, 0, &out, msg, sizeof(msg)), SX_EPROTO);
  sx__rdma_sreq z = q;
  z.n = 0;
  size_t zl = sx__rdma_sreq_pack(bad, &z);
  sxt_rc(sx__rdma_sreq_parse(bad, zl, 0, &out, msg, sizeof(msg)), SX_EPROTO);
  /* A zero-length range, and more bytes than a slot holds. */
  z = q;
  z.r[1].len = 0;
  zl = sx__rdma_sreq_pack(bad, &z);
  sxt_rc(sx__rdma_sreq_parse(bad, zl, 0, &out, msg, sizeof(msg)), SX_EPROTO);
  z = q;
  z.r[0].len = SX__RDMA_STAGE_SLOT_BYTES;
  zl = sx__rdma_sreq_pack(bad, &z);
  sxt_rc(sx__rdma_sreq_parse(bad, zl, 0, &out, msg, sizeof(msg)), SX_EPROTO);
  assert_non_null(strstr(msg, "a slot holds"));
  /* Lengths that wrap 32 bits in a sum. */
  z = q;
  z.r[0].len = 0xffffffffu;
  z.r[1].len = 2;
  zl = sx__rdma_sreq_pack(bad, &z);
  sxt_rc(sx__rdma_sreq_parse(bad, zl, 0, &out, msg, sizeof(msg)), SX_EPROTO);
}

/* A staged write's request: where the producer's slot is, then the
 * consumer's ranges; what a consumer must refuse. */
static void test_rdma_stage_write_request(void **state) {
  (void)state;
  uint8_t buf[SX__RDMA_SMSG_BYTES], bad[SX__RDMA_SMSG_BYTES];
  char msg[160];
  sx__rdma_sreq q = {.slot = 2, .write = 1, .seq = 41, .n = 2}, out;
  q.src = (sx__rdma_swsrc){.addr = 0x7f0000100000ull, .rkey = 0x1234, .bytes = 8192 + 100};
  q.r[0] = (sx__rdma_srange){.region = 3, .len = 8192, .off = 1ull << 33};
  q.r[1] = (sx__rdma_srange){.region = 4, .len = 100, .off = 7};
  size_t len = sx__rdma_sreq_pack(buf, &q);
  assert_int_equal(len, sizeof(sx__rdma_smsg_hdr) + sizeof(sx__rdma_swsrc) +
                            2 * sizeof(sx__rdma_srange));
  assert_true(len <= SX__RDMA_SMSG_BYTES);
  sxt_ok(sx__rdma_sreq_parse(buf, len, 1, &out, msg, sizeof(msg)));
  assert_int_equal(out.write, 1);
  assert_int_equal(out.slot, 2);
  assert_int_equal(out.seq, 41);
  assert_int_equal(out.src.addr, 0x7f0000100000ull);
  assert_int_equal(out.src.rkey, 0x1234);
  assert_int_equal(out.src.bytes, 8292);
  assert_int_equal(out.r[0].off, 1ull << 33);
  assert_int_equal(out.r[1].region, 4);
  /* A write request is no read request, and the reverse. */
  sxt_rc(sx__rdma_sreq_parse(buf, len, 0, &out, msg, sizeof(msg)), SX_EPROTO);
  sx__rdma_sreq rq = q;
  rq.write = 0;
  size_t rl = sx__rdma_sreq_pack(bad, &rq);
  sxt_rc(sx__rdma_sreq_parse(bad, rl, 1, &out, msg, sizeof(msg)), SX_EPROTO);
  /* The slot's byte count must be the ranges' sum: a consumer READs
   * exactly what it scatters. */
  sx__rdma_sreq z = q;
  z.src.bytes = 8192;
  size_t zl = sx__rdma_sreq_pack(bad, &z);
  sxt_rc(sx__rdma_sreq_parse(bad, zl, 1, &out, msg, sizeof(msg)), SX_EPROTO);
  assert_non_null(strstr(msg, "its slot holds 8192 bytes, its ranges 8292"));
  /* Short, long. */
  sxt_rc(sx__rdma_sreq_parse(buf, len - 1, 1, &out, msg, sizeof(msg)), SX_EPROTO);
  sxt_rc(sx__rdma_sreq_parse(buf, len + 16, 1, &out, msg, sizeof(msg)), SX_EPROTO);
}

static void test_rdma_stage_reply_roundtrip_and_checks(void **state) {
  (void)state;
  sx__rdma_sreply w;
  uint8_t slot;
  uint32_t seq, rkey, bytes;
  uint64_t addr;
  int st;
  sx__rdma_sreply_pack(&w, 3, 77, 0, 0x7f0012345000ull, 0xabcd, 65536);
  sxt_ok(sx__rdma_sreply_parse((const uint8_t *)&w, sizeof(w), &slot, &seq, &st, &addr, &rkey,
                               &bytes));
  assert_int_equal(slot, 3);
  assert_int_equal(seq, 77);
  assert_int_equal(st, 0);
  assert_int_equal(addr, 0x7f0012345000ull);
  assert_int_equal(rkey, 0xabcd);
  assert_int_equal(bytes, 65536);
  sx__rdma_sreply_pack(&w, 0, 1, SX_EBOUNDS, 0, 0, 0);
  sxt_ok(sx__rdma_sreply_parse((const uint8_t *)&w, sizeof(w), &slot, &seq, &st, &addr, &rkey,
                               &bytes));
  assert_int_equal(st, SX_EBOUNDS);
  /* A status that is no SX_E* code, more bytes than a slot, a wrong size. */
  sx__rdma_sreply_pack(&w, 0, 1, -1000, 0, 0, 0);
  sxt_rc(sx__rdma_sreply_parse((const uint8_t *)&w, sizeof(w), &slot, &seq, &st, &addr, &rkey,
                               &bytes), SX_EPROTO);
  /* Magnitudes with no int negation, or none that is a code (fuzz_rdma
   * found 0x80000000: tests/fuzz/regressions/rdma/). */
  const uint32_t odd[] = {0x80000000u, 0xffffffffu, (uint32_t)-SX_ERRNO_MIN + 1};
  for (size_t i = 0; i < sizeof(odd) / sizeof(odd[0]); i++) {
    sx__rdma_sreply_pack(&w, 0, 1, 0, 0, 0, 0);
    w.h.status = htobe32(odd[i]);
    sxt_rc(sx__rdma_sreply_parse((const uint8_t *)&w, sizeof(w), &slot, &seq, &st, &addr,
                                 &rkey, &bytes), SX_EPROTO);
  }
  sx__rdma_sreply_pack(&w, 0, 1, 0, 0, 0, SX__RDMA_STAGE_SLOT_BYTES + 1);
  sxt_rc(sx__rdma_sreply_parse((const uint8_t *)&w, sizeof(w), &slot, &seq, &st, &addr, &rkey,
                               &bytes), SX_EPROTO);
  sxt_rc(sx__rdma_sreply_parse((const uint8_t *)&w, sizeof(w) - 1, &slot, &seq, &st, &addr,
                               &rkey, &bytes), SX_EPROTO);
}

static void test_rdma_stage_tier_names(void **state) {
  (void)state;
  sx__rdma_gpu_tier t;
  const char *names[] = {"auto", "dmabuf", "peermem", "staged", "off"};
  for (int i = 0; i < 5; i++) {
    sxt_ok(sx__rdma_gpu_tier_parse(names[i], &t));
    assert_int_equal(t, i);
    assert_string_equal(sx__rdma_gpu_tier_name(t), names[i]);
  }
  sxt_ok(sx__rdma_gpu_tier_parse("", &t));
  assert_int_equal(t, SX__RDMA_GPU_AUTO);
  sxt_rc(sx__rdma_gpu_tier_parse("gdr", &t), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "gdr"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rdma_stage_hello_flag),
      cmocka_unit_test(test_rdma_stage_request_roundtrip),
      cmocka_unit_test(test_rdma_stage_request_garbage_is_refused),
      cmocka_unit_test(test_rdma_stage_write_request),
      cmocka_unit_test(test_rdma_stage_reply_roundtrip_and_checks),
      cmocka_unit_test(test_rdma_stage_tier_names),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
