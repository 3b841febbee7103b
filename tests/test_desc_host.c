/*
 * The descriptor's host identity (host_id, hostname, process) and the
 * cuda_ipc endpoint: round trips, and one test per rejection rule, on
 * encode (validation) and on decode (what a store or peer could send).
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "segxfer.pb-c.h"
#include "sxtest.h"

#define BOOT "4f2c9a1e-0b7d-4c3e-9f10-2a6b8c0d1e2f"

static void host_desc(sx_desc *d) {
  sxt_desc_kv(d, "prefill-0/tp0", 4, 0, 4096, 64, 0);
  strcpy(d->host_id, BOOT);
  strcpy(d->hostname, "gpu-node_17.rack-3");
  d->process = 0x8000000000000001ull;
  strcpy(d->regions[0].location, "cuda:0");
  strcpy(d->regions[1].location, "cuda:0");
  sx_endpoint e;
  memset(&e, 0, sizeof(e));
  e.kind = SX_TRANSPORT_CUDA_IPC;
  strcpy(e.addr, "10.1.2.3");
  e.port = 7400;
  sxt_ok(sx_desc_add_endpoint(d, &e));
}

static void test_desc_host_roundtrip(void **state) {
  (void)state;
  sx_desc d, back;
  host_desc(&d);
  uint8_t *buf;
  size_t len;
  sxt_ok(sx_desc_encode(&d, &buf, &len));
  sxt_ok(sx_desc_decode(buf, len, &back));
  assert_string_equal(back.host_id, BOOT);
  assert_string_equal(back.hostname, "gpu-node_17.rack-3");
  assert_true(back.process == 0x8000000000000001ull);
  assert_int_equal(back.n_endpoints, 2);
  assert_int_equal(back.endpoints[1].kind, SX_TRANSPORT_CUDA_IPC);
  assert_int_equal(back.endpoints[1].port, 7400);
  assert_string_equal(back.regions[0].location, "cuda:0");
  sx_desc copy;
  sxt_ok(sx_desc_copy(&copy, &back));
  assert_string_equal(copy.host_id, BOOT);
  sx_desc_free(&copy);
  sx_desc_free(&back);
  free(buf);
  /* Unknown host: all three empty is valid (and costs nothing). */
  d.host_id[0] = d.hostname[0] = '\0';
  d.process = 0;
  d.n_endpoints = 1; /* no cuda_ipc without a host id */
  sxt_ok(sx_desc_encode(&d, &buf, &len));
  sxt_ok(sx_desc_decode(buf, len, &back));
  assert_string_equal(back.host_id, "");
  assert_string_equal(back.hostname, "");
  sx_desc_free(&back);
  free(buf);
  sx_desc_free(&d);
}

/* d breaks one rule: validation and decode both refuse it with code. */
static void refused(sx_desc *d, int code, const char *words) {
  uint8_t *buf;
  size_t len;
  sx_desc back;
  sxt_rc(sx_desc_validate(d), code);
  assert_non_null(strstr(sx_errmsg(), words));
  sxt_ok(sx__desc_pack(d, &buf, &len)); /* as a hostile store would send it */
  sxt_rc(sx_desc_decode(buf, len, &back), code);
  free(buf);
}

static void test_desc_host_id_rules(void **state) {
  (void)state;
  sx_desc d;
  host_desc(&d);
  const char *bad[] = {
      "4f2c9a1e-0b7d-4c3e-9f10-2a6b8c0d1e2",   /* one short */
      "4F2C9A1E-0B7D-4C3E-9F10-2A6B8C0D1E2F",  /* upper case */
      "4f2c9a1e00b7d-4c3e-9f10-2a6b8c0d1e2f",  /* dash missing */
      "4f2c9a1e-0b7d-4c3e-9f10-2a6b8c0d1e2g",  /* not hex */
      "4f2c9a1e-0b7d-4c3e-9f10-2a6b8c0d1e-f",  /* dash misplaced */
      "x",
  };
  for (size_t i = 0; i < SX__ARRAY_SIZE(bad); i++) {
    strcpy(d.host_id, bad[i]);
    refused(&d, SX_EINVAL, "host_id");
  }
  sx_desc_free(&d);
}

static void test_desc_host_hostname_rules(void **state) {
  (void)state;
  sx_desc d;
  host_desc(&d);
  const char *bad[] = {"node 17", "node/17", "n\x01", "caf\xc3\xa9", "a:b"};
  for (size_t i = 0; i < SX__ARRAY_SIZE(bad); i++) {
    strcpy(d.hostname, bad[i]);
    refused(&d, SX_EINVAL, "hostname");
  }
  memset(d.hostname, 'h', SX_HOSTNAME_MAX);
  d.hostname[SX_HOSTNAME_MAX] = '\0';
  sxt_ok(sx_desc_validate(&d)); /* exactly the limit */
  sx_desc_free(&d);
}

static void test_desc_host_cuda_ipc_needs_host_id(void **state) {
  (void)state;
  sx_desc d;
  host_desc(&d);
  d.host_id[0] = '\0';
  refused(&d, SX_EMISSING, "cuda_ipc");
  sx_desc_free(&d);
}

/* Strings longer than the fields can hold, straight from the wire. */
static void test_desc_host_decode_limits(void **state) {
  (void)state;
  sx_desc d;
  host_desc(&d);
  uint8_t *buf;
  size_t len;
  sxt_ok(sx_desc_encode(&d, &buf, &len));
  Sxpb__SegmentDescriptor *m = sxpb__segment_descriptor__unpack(NULL, len, buf);
  assert_non_null(m);
  free(buf);
  char long_name[300];
  memset(long_name, 'h', sizeof(long_name) - 1);
  long_name[sizeof(long_name) - 1] = '\0';
  char *keep = m->hostname;
  m->hostname = long_name;
  len = sxpb__segment_descriptor__get_packed_size(m);
  buf = malloc(len);
  sxpb__segment_descriptor__pack(m, buf);
  sx_desc back;
  sxt_rc(sx_desc_decode(buf, len, &back), SX_ELIMIT);
  assert_non_null(strstr(sx_errmsg(), "hostname"));
  free(buf);
  m->hostname = keep;
  keep = m->host_id;
  m->host_id = long_name;
  len = sxpb__segment_descriptor__get_packed_size(m);
  buf = malloc(len);
  sxpb__segment_descriptor__pack(m, buf);
  sxt_rc(sx_desc_decode(buf, len, &back), SX_ELIMIT);
  assert_non_null(strstr(sx_errmsg(), "host_id"));
  free(buf);
  m->host_id = keep;
  sxpb__segment_descriptor__free_unpacked(m, NULL);
  sx_desc_free(&d);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_desc_host_roundtrip),
      cmocka_unit_test(test_desc_host_id_rules),
      cmocka_unit_test(test_desc_host_hostname_rules),
      cmocka_unit_test(test_desc_host_cuda_ipc_needs_host_id),
      cmocka_unit_test(test_desc_host_decode_limits),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
