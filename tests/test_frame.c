/* The TCP frame parser: round trips, byte order, and everything it rejects. */
#include <string.h>

#include "sxtest.h"
#include "segxfer/push.h"
#include "transport/conn/frame.h"

static void test_frame_round_trip_and_byte_order(void **state) {
  (void)state;
  sx__frame f = {.type = SX__FRAME_READ, .id = 0x0102030405060708ull, .region = 0x0a0b0c0d,
                 .status = 0, .offset = 0x1112131415161718ull, .length = 0x2122232425262728ull};
  uint8_t b[SX__FRAME_HDR];
  sx__frame_encode(&f, b);
  static const uint8_t want[SX__FRAME_HDR] = {
      0x53, 0x58, 0x46, 0x31, 1, SX__FRAME_READ, 0, 0,
      1, 2, 3, 4, 5, 6, 7, 8,
      0x0a, 0x0b, 0x0c, 0x0d, 0, 0, 0, 0,
      0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18,
      0x21, 0x22, 0x23, 0x24, 0x25, 0x26, 0x27, 0x28};
  assert_memory_equal(b, want, sizeof(want));
  sx__frame g;
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX__FRAME_HDR);
  assert_int_equal(g.type, f.type);
  assert_true(g.id == f.id && g.region == f.region && g.offset == f.offset &&
              g.length == f.length && g.status == 0);
  /* A negative status survives the trip. */
  sx__frame r = {.type = SX__FRAME_READ_REPLY, .id = 9, .status = SX_EBOUNDS};
  sx__frame_encode(&r, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX__FRAME_HDR);
  assert_int_equal(g.status, SX_EBOUNDS);
}

static void test_frame_needs_a_whole_header(void **state) {
  (void)state;
  sx__frame f = {.type = SX__FRAME_READ, .length = 10}, g;
  uint8_t b[SX__FRAME_HDR];
  sx__frame_encode(&f, b);
  for (size_t n = 0; n < SX__FRAME_HDR; n++)
    assert_int_equal(sx__frame_decode(b, n, &g), 0);
}

/* A wrong magic or version is refused from its first byte on: a peer of
 * another protocol is not held until 40 bytes arrive. */
static void test_frame_refuses_a_foreign_start_early(void **state) {
  (void)state;
  sx__frame g;
  static const uint8_t http[] = "GET / HTTP/1.1";
  for (size_t n = 1; n < sizeof(http); n++)
    assert_int_equal(sx__frame_decode(http, n, &g), SX_EPROTO);
  assert_true(sx__frame_foreign(http, 1));
  static const uint8_t almost[] = {0x53, 0x58, 0x46, 0x32}; /* "SXF2" */
  assert_int_equal(sx__frame_decode(almost, 3, &g), 0);
  assert_int_equal(sx__frame_decode(almost, 4, &g), SX_EPROTO);
  assert_false(sx__frame_foreign(almost, 3));
  assert_true(sx__frame_foreign(almost, 4));
  assert_false(sx__frame_foreign(almost, 0));
  static const uint8_t v2[] = {0x53, 0x58, 0x46, 0x31, 2};
  assert_int_equal(sx__frame_decode(v2, 4, &g), 0);
  assert_int_equal(sx__frame_decode(v2, 5, &g), SX_EVERSION);
  assert_false(sx__frame_foreign(v2, 5)); /* ours, another version */
}

static void test_frame_rejects_bad_headers(void **state) {
  (void)state;
  uint8_t b[SX__FRAME_HDR];
  sx__frame g, f = {.type = SX__FRAME_READ, .length = 4096};
  sx__frame_encode(&f, b);
  b[0] ^= 1; /* magic */
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  sx__frame_encode(&f, b);
  b[4] = 2; /* version */
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EVERSION);
  sx__frame_encode(&f, b);
  b[5] = 99; /* type (5 and up are taken: GPU staging, push) */
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  sx__frame_encode(&f, b);
  b[7] = 1; /* flags */
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  /* A request that carries a status, a positive status, a failed reply
   * that announces payload, a hello reply with payload. */
  f.status = SX_EBOUNDS;
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  f = (sx__frame){.type = SX__FRAME_READ_REPLY, .status = 5};
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  f = (sx__frame){.type = SX__FRAME_READ_REPLY, .status = SX_EBOUNDS, .length = 1};
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  f = (sx__frame){.type = SX__FRAME_HELLO_REPLY, .length = 1};
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  /* HELLO bodies outside their bounds are oversized frames. */
  f = (sx__frame){.type = SX__FRAME_HELLO, .length = SX__HELLO_MAX + 1};
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  f.length = SX__HELLO_FIXED - 1;
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  f.length = UINT64_MAX;
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  /* Notices (write and read): a body up to SX_NOTICE_MAX_BYTES, no status;
   * their reply carries no body. */
  static const uint8_t notices[] = {SX__FRAME_NOTICE, SX__FRAME_RNOTICE};
  for (size_t i = 0; i < sizeof(notices); i++) {
    f = (sx__frame){.type = notices[i], .id = 7, .length = SX_NOTICE_MAX_BYTES};
    sx__frame_encode(&f, b);
    assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX__FRAME_HDR);
    assert_int_equal(g.type, notices[i]);
    assert_int_equal(g.length, SX_NOTICE_MAX_BYTES);
    f.length = SX_NOTICE_MAX_BYTES + 1;
    sx__frame_encode(&f, b);
    assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
    f.length = UINT64_MAX;
    sx__frame_encode(&f, b);
    assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
    f = (sx__frame){.type = notices[i], .status = SX_EPROTO, .length = 8};
    sx__frame_encode(&f, b);
    assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  }
  f = (sx__frame){.type = SX__FRAME_NOTICE_REPLY, .status = SX_ELIMIT, .length = 1};
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  /* One past the highest type in use. */
  f = (sx__frame){.type = SX__FRAME_TYPE_MAX + 1};
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
}

static void test_readv_frames_and_ranges(void **state) {
  (void)state;
  uint8_t b[SX__FRAME_HDR];
  sx__frame g, f = {.type = SX__FRAME_READV, .id = 3, .length = SX__READV_ENTRY};
  for (uint64_t n = 1; n <= SX__READV_MAX; n++) {
    f.length = n * SX__READV_ENTRY;
    sx__frame_encode(&f, b);
    assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX__FRAME_HDR);
    assert_int_equal(g.type, SX__FRAME_READV);
    assert_true(g.length == n * SX__READV_ENTRY);
  }
  /* No ranges, too many, part of one; a region, an offset or a status in
   * the header. */
  static const sx__frame bad[] = {
      {.type = SX__FRAME_READV, .length = 0},
      {.type = SX__FRAME_READV, .length = SX__READV_ENTRY * (SX__READV_MAX + 1)},
      {.type = SX__FRAME_READV, .length = SX__READV_ENTRY + 8},
      {.type = SX__FRAME_READV, .length = UINT64_MAX},
      {.type = SX__FRAME_READV, .length = SX__READV_ENTRY, .region = 1},
      {.type = SX__FRAME_READV, .length = SX__READV_ENTRY, .offset = 1},
      {.type = SX__FRAME_READV, .length = SX__READV_ENTRY, .status = SX_EIO},
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    sx__frame_encode(&bad[i], b);
    assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  }
  /* A refusal names the range in `region`; HELLO_REPLY's features. */
  f = (sx__frame){.type = SX__FRAME_READ_REPLY, .id = 3, .status = SX_EBOUNDS, .region = 5};
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX__FRAME_HDR);
  assert_int_equal(g.region, 5);
  f = (sx__frame){.type = SX__FRAME_HELLO_REPLY, .offset = SX__FEAT_READV};
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX__FRAME_HDR);
  assert_true(g.offset == SX__FEAT_READV);

  /* A range: big-endian, a zero field that must stay 0, no empty range. */
  uint8_t e[SX__READV_ENTRY];
  sx__range r = {0x01020304u, 0x1112131415161718ull, 0x2122232425262728ull}, q;
  sx__range_encode(&r, e);
  static const uint8_t want[SX__READV_ENTRY] = {
      1,    2,    3,    4,    0,    0,    0,    0,    0x11, 0x12, 0x13, 0x14,
      0x15, 0x16, 0x17, 0x18, 0x21, 0x22, 0x23, 0x24, 0x25, 0x26, 0x27, 0x28};
  assert_memory_equal(e, want, sizeof(want));
  assert_int_equal(sx__range_decode(e, &q), 0);
  assert_int_equal(q.region, r.region);
  assert_true(q.offset == r.offset && q.length == r.length);
  e[6] = 1;
  assert_int_equal(sx__range_decode(e, &q), SX_EPROTO);
  r.length = 0;
  sx__range_encode(&r, e);
  assert_int_equal(sx__range_decode(e, &q), SX_EPROTO);
}

static void test_hello_round_trip(void **state) {
  (void)state;
  sx__hello h, g;
  memset(&h, 0, sizeof(h));
  for (int i = 0; i < 16; i++) {
    h.incarnation[i] = (uint8_t)i;
    h.token[i] = (uint8_t)(0xf0 | i);
  }
  strcpy(h.name, "decode-3/tp1");
  uint8_t b[SX__HELLO_MAX];
  int n = sx__hello_encode(&h, b, sizeof(b));
  assert_int_equal(n, SX__HELLO_FIXED + 12);
  sxt_ok(sx__hello_decode(b, (size_t)n, &g));
  assert_memory_equal(g.incarnation, h.incarnation, 16);
  assert_memory_equal(g.token, h.token, 16);
  assert_string_equal(g.name, "decode-3/tp1");
  /* An empty name is allowed (reader-only agents). */
  h.name[0] = '\0';
  n = sx__hello_encode(&h, b, sizeof(b));
  sxt_ok(sx__hello_decode(b, (size_t)n, &g));
  assert_string_equal(g.name, "");
  /* sx__hello_build, what the tcp and cuda_ipc readers send: the same
   * bytes as the struct's encoding; a NULL name is the empty one. */
  uint8_t c[SX__HELLO_MAX];
  strcpy(h.name, "decode-3/tp1");
  n = sx__hello_encode(&h, b, sizeof(b));
  assert_int_equal(sx__hello_build(h.incarnation, h.token, "decode-3/tp1", c, sizeof(c)), n);
  assert_memory_equal(c, b, (size_t)n);
  n = sx__hello_build(h.incarnation, h.token, NULL, c, sizeof(c));
  sxt_ok(sx__hello_decode(c, (size_t)n, &g));
  assert_memory_equal(g.incarnation, h.incarnation, 16);
  assert_memory_equal(g.token, h.token, 16);
  assert_string_equal(g.name, "");
}

static void test_hello_rejects_inconsistent_bodies(void **state) {
  (void)state;
  sx__hello h, g;
  memset(&h, 0, sizeof(h));
  strcpy(h.name, "abc");
  uint8_t b[SX__HELLO_MAX];
  int n = sx__hello_encode(&h, b, sizeof(b));
  /* The length must match the name length exactly. */
  assert_int_equal(sx__hello_decode(b, (size_t)n - 1, &g), SX_EPROTO);
  assert_int_equal(sx__hello_decode(b, (size_t)n + 1, &g), SX_EPROTO);
  b[33] = 250; /* name length beyond the body */
  assert_int_equal(sx__hello_decode(b, (size_t)n, &g), SX_EPROTO);
  n = sx__hello_encode(&h, b, sizeof(b));
  b[SX__HELLO_FIXED + 1] = '\n'; /* not printable */
  assert_int_equal(sx__hello_decode(b, (size_t)n, &g), SX_EPROTO);
  assert_int_equal(sx__hello_decode(b, 3, &g), SX_EPROTO);
  /* The encoder refuses a buffer that is too small. */
  assert_int_equal(sx__hello_encode(&h, b, SX__HELLO_FIXED + 2), SX_ENAME);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_frame_round_trip_and_byte_order),
      cmocka_unit_test(test_frame_needs_a_whole_header),
      cmocka_unit_test(test_frame_refuses_a_foreign_start_early),
      cmocka_unit_test(test_frame_rejects_bad_headers),
      cmocka_unit_test(test_readv_frames_and_ranges),
      cmocka_unit_test(test_hello_round_trip),
      cmocka_unit_test(test_hello_rejects_inconsistent_bodies),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
