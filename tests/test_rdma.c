/* RDMA transport pieces that need no device: the connect private data, the
 * mapping of outcomes onto segxfer codes, and open() without a device. */
#include <string.h>

#include "transport/rdma/rdma_int.h"
#include "sxtest.h"

static const uint8_t inc[SX_INCARNATION_LEN] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
static const uint8_t tok[SX_TOKEN_LEN] = {0xa0, 0xa1, 0xa2, 0xa3, 0xa4, 0xa5, 0xa6, 0xa7,
                                          0xa8, 0xa9, 0xaa, 0xab, 0xac, 0xad, 0xae, 0xaf};

static void test_rdma_hello_roundtrip_and_byte_order(void **state) {
  (void)state;
  sx__rdma_hello_wire w;
  sx__rdma_hello h;
  sx__rdma_hello_pack(&w, "decode-7/tp3-with-a-long-name", 0x01020304u, inc, tok);
  const uint8_t *b = (const uint8_t *)&w;
  assert_int_equal(sizeof(w), 56);
  assert_int_equal(b[0], 'S');
  assert_int_equal(b[1], 'X');
  assert_int_equal(b[2], SX__RDMA_WIRE_VERSION);
  /* conn_index is big-endian on the wire. */
  assert_int_equal(b[4], 1);
  assert_int_equal(b[5], 2);
  assert_int_equal(b[6], 3);
  assert_int_equal(b[7], 4);
  sxt_ok(sx__rdma_hello_parse(&w, sizeof(w), &h));
  assert_int_equal(h.conn_index, 0x01020304u);
  assert_memory_equal(h.incarnation, inc, sizeof(inc));
  assert_memory_equal(h.token, tok, sizeof(tok));
  assert_string_equal(h.name, "decode-7/tp3-wit"); /* cut to 16 bytes */
  /* rdma_cm pads private data with zeros: longer buffers parse the same. */
  uint8_t padded[148];
  memset(padded, 0, sizeof(padded));
  memcpy(padded, &w, sizeof(w));
  sxt_ok(sx__rdma_hello_parse(padded, sizeof(padded), &h));
}

/* Push mode: a producer's hello carries its own incarnation in the name
 * bytes and its own token; unknown flags are refused. */
static void test_rdma_write_hello_roundtrip(void **state) {
  (void)state;
  sx__rdma_hello_wire w;
  sx__rdma_hello h;
  uint8_t pinc[SX_INCARNATION_LEN];
  for (int i = 0; i < SX_INCARNATION_LEN; i++)
    pinc[i] = (uint8_t)(0xa0 + i);
  sx__rdma_whello_pack(&w, 3, inc, pinc, tok);
  assert_int_equal(((const uint8_t *)&w)[3], SX__RDMA_HELLO_WRITE);
  sxt_ok(sx__rdma_hello_parse(&w, sizeof(w), &h));
  assert_int_equal(h.flags, SX__RDMA_HELLO_WRITE);
  assert_int_equal(h.conn_index, 3);
  assert_memory_equal(h.incarnation, inc, sizeof(inc));
  assert_memory_equal(h.producer, pinc, sizeof(pinc));
  assert_memory_equal(h.token, tok, sizeof(tok));
  assert_string_equal(h.name, "");
  /* A reader's hello has no flags. */
  sx__rdma_hello_pack(&w, "r", 0, inc, tok);
  sxt_ok(sx__rdma_hello_parse(&w, sizeof(w), &h));
  assert_int_equal(h.flags, 0);
  w.flags = 0x82;
  sxt_rc(sx__rdma_hello_parse(&w, sizeof(w), &h), SX_EPROTO);
  assert_int_equal(sx__rdma_reject_code(SX__RDMA_REJ_WACCESS), SX_EACCESS);
  assert_int_equal(sx__rdma_reject_code(SX__RDMA_REJ_WSTORE), SX_ESTORE);
  assert_non_null(strstr(sx__rdma_reject_text(SX__RDMA_REJ_WACCESS), "write grant"));
}

static void test_rdma_hello_rejects_garbage(void **state) {
  (void)state;
  sx__rdma_hello_wire w;
  sx__rdma_hello h;
  sx__rdma_hello_pack(&w, "r", 0, inc, tok);
  sxt_rc(sx__rdma_hello_parse(&w, sizeof(w) - 1, &h), SX_EPROTO);
  sxt_rc(sx__rdma_hello_parse(NULL, 0, &h), SX_EPROTO);
  w.magic[1] = 'Y';
  sxt_rc(sx__rdma_hello_parse(&w, sizeof(w), &h), SX_EPROTO);
  w.magic[1] = 'X';
  w.version = 2;
  sxt_rc(sx__rdma_hello_parse(&w, sizeof(w), &h), SX_EVERSION);
  /* Unprintable name bytes never reach the logs. */
  w.version = SX__RDMA_WIRE_VERSION;
  memcpy(w.name, "a\nb\x1b", 4);
  sxt_ok(sx__rdma_hello_parse(&w, sizeof(w), &h));
  assert_string_equal(h.name, "a?b?");
}

static void test_rdma_reject_reasons_map_to_codes(void **state) {
  (void)state;
  sx__rdma_reject_wire w;
  uint8_t reason = 0;
  sx__rdma_reject_pack(&w, SX__RDMA_REJ_STALE);
  assert_int_equal(sizeof(w), 8);
  assert_int_equal(sx__rdma_reject_parse(&w, sizeof(w), &reason), 1);
  assert_int_equal(reason, SX__RDMA_REJ_STALE);
  assert_int_equal(sx__rdma_reject_code(SX__RDMA_REJ_STALE), SX_ESTALE);
  assert_int_equal(sx__rdma_reject_code(SX__RDMA_REJ_ACCESS), SX_EACCESS);
  assert_int_equal(sx__rdma_reject_code(SX__RDMA_REJ_VERSION), SX_EVERSION);
  assert_int_equal(sx__rdma_reject_code(SX__RDMA_REJ_NODEV), SX_ENODEV);
  assert_int_equal(sx__rdma_reject_code(99), SX_EPROTO);
  /* A reject without segxfer's private data (no listener, a foreign CM). */
  uint8_t zeros[148] = {0};
  assert_int_equal(sx__rdma_reject_parse(zeros, sizeof(zeros), &reason), 0);
  assert_int_equal(sx__rdma_reject_parse(NULL, 0, &reason), 0);
  assert_non_null(strstr(sx__rdma_cm_reject_status_text(8), "listens"));

  sx__rdma_accept_wire a;
  uint8_t got[SX_INCARNATION_LEN];
  sx__rdma_accept_pack(&a, inc);
  assert_int_equal(sx__rdma_accept_parse(&a, sizeof(a), got), 1);
  assert_memory_equal(got, inc, sizeof(inc));
  assert_int_equal(sx__rdma_accept_parse(zeros, sizeof(zeros), got), 0);
}

static void test_rdma_wc_status_codes(void **state) {
  (void)state;
  assert_int_equal(sx__rdma_wc_code(IBV_WC_SUCCESS), 0);
  assert_int_equal(sx__rdma_wc_code(IBV_WC_WR_FLUSH_ERR), SX_EDISCONN);
  assert_int_equal(sx__rdma_wc_code(IBV_WC_RETRY_EXC_ERR), SX_EDISCONN);
  assert_int_equal(sx__rdma_wc_code(IBV_WC_RNR_RETRY_EXC_ERR), SX_EDISCONN);
  assert_int_equal(sx__rdma_wc_code(IBV_WC_REM_ACCESS_ERR), SX_ERDMA);
  assert_int_equal(sx__rdma_wc_code(IBV_WC_LOC_PROT_ERR), SX_ERDMA);
  assert_int_equal(sx__rdma_wc_code(IBV_WC_GENERAL_ERR), SX_ERDMA);
}

static sx_lregion *no_region(void *agent, uint32_t id) {
  (void)agent;
  (void)id;
  return NULL;
}

/* Without a usable device open() says SX_ENODEV and why, so the agent goes
 * on with TCP only. */
static void test_rdma_open_without_device_is_enodev(void **state) {
  (void)state;
  uv_loop_t loop;
  sx_agent_params params;
  sx_tctx ctx;
  sx_transport *t = NULL;
  int n = 0;
  struct ibv_device **list = ibv_get_device_list(&n);
  if (list != NULL)
    ibv_free_device_list(list);
  uv_loop_init(&loop);
  memset(&params, 0, sizeof(params));
  memset(&ctx, 0, sizeof(ctx));
  params.rdma_gid_index = -1;
  ctx.loop = &loop;
  ctx.name = "t";
  ctx.incarnation = inc;
  ctx.token = tok;
  ctx.params = &params;
  ctx.find_region = no_region;
  if (n == 0) {
    sxt_rc(sx__rdma_ops.open(&ctx, &t), SX_ENODEV);
    assert_non_null(strstr(sx_errmsg(), "no RDMA device"));
  } else {
    /* A device exists here: a device list naming none of them. */
    params.rdma_devices = "no-such-dev0";
    sxt_rc(sx__rdma_ops.open(&ctx, &t), SX_ENODEV);
    assert_non_null(strstr(sx_errmsg(), "no-such-dev0"));
  }
  assert_null(t);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rdma_hello_roundtrip_and_byte_order),
      cmocka_unit_test(test_rdma_write_hello_roundtrip),
      cmocka_unit_test(test_rdma_hello_rejects_garbage),
      cmocka_unit_test(test_rdma_reject_reasons_map_to_codes),
      cmocka_unit_test(test_rdma_wc_status_codes),
      cmocka_unit_test(test_rdma_open_without_device_is_enodev),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
