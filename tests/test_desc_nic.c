/* The chosen NIC per region in the descriptor (RegionTable.nic, field 40):
 * round trip, descriptors without it, the rules on decode, the endpoint it
 * names, its JSON form. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "segxfer.pb-c.h"
#include "sxtest.h"

static void test_desc_nic_roundtrip(void **state) {
  (void)state;
  sx_desc d, back;
  uint8_t *buf;
  size_t len;
  sxt_desc_kv(&d, "prefill-0/tp1", 4, 1, 4096, 16, 2);
  for (uint32_t i = 0; i < d.n_regions; i++)
    d.regions[i].nic = 1 + i % 2;
  d.regions[0].nic = 0; /* none chosen for this one */
  sxt_ok(sx_desc_encode(&d, &buf, &len));
  sxt_ok(sx_desc_decode(buf, len, &back));
  assert_int_equal(back.n_regions, d.n_regions);
  for (uint32_t i = 0; i < d.n_regions; i++) {
    assert_int_equal(back.regions[i].nic, d.regions[i].nic);
    assert_memory_equal(&back.regions[i], &d.regions[i], sizeof(sx_region));
  }
  /* The endpoint each names: the RDMA endpoints in order (the TCP one of
   * sxt_desc_base comes first and does not count). */
  assert_null(sx_desc_region_nic(&back, &back.regions[0]));
  assert_string_equal(sx_desc_region_nic(&back, &back.regions[1])->device, "mlx5_1");
  assert_string_equal(sx_desc_region_nic(&back, &back.regions[2])->device, "mlx5_0");
  sx_desc_free(&back);
  free(buf);
  sx_desc_free(&d);
}

/* A descriptor written before the field (no column) decodes with no NIC,
 * and one where no region has a NIC writes no column at all. */
static void test_desc_nic_absent_column(void **state) {
  (void)state;
  sx_desc d, back;
  uint8_t *buf;
  size_t len;
  sxt_desc_kv(&d, "old", 2, 0, 4096, 8, 1);
  sxt_ok(sx_desc_encode(&d, &buf, &len));
  Sxpb__SegmentDescriptor *m = sxpb__segment_descriptor__unpack(NULL, len, buf);
  assert_non_null(m);
  assert_int_equal(m->regions->n_nic, 0);
  sxpb__segment_descriptor__free_unpacked(m, NULL);
  sxt_ok(sx_desc_decode(buf, len, &back));
  for (uint32_t i = 0; i < back.n_regions; i++) {
    assert_int_equal(back.regions[i].nic, 0);
    assert_null(sx_desc_region_nic(&back, &back.regions[i]));
  }
  sx_desc_free(&back);
  free(buf);
  sx_desc_free(&d);
}

/* What a hostile store could hold: a NIC past the RDMA endpoints (also
 * with no RDMA endpoint at all), a column of the wrong length. */
static void test_desc_nic_hostile_values_rejected(void **state) {
  (void)state;
  sx_desc d, back;
  uint8_t *buf;
  size_t len;
  sxt_desc_kv(&d, "bad", 2, 0, 4096, 8, 2);
  d.regions[1].nic = 3;
  sxt_rc(sx_desc_validate(&d), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "region 1: nic 3 names RDMA endpoint 3, but the "
                                      "descriptor has 2"));
  sxt_ok(sx__desc_pack(&d, &buf, &len)); /* unvalidated, as a hostile writer would */
  sxt_rc(sx_desc_decode(buf, len, &back), SX_EINVAL);
  free(buf);
  d.regions[1].nic = UINT32_MAX;
  sxt_ok(sx__desc_pack(&d, &buf, &len));
  sxt_rc(sx_desc_decode(buf, len, &back), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "nic 4294967295"));
  free(buf);
  sx_desc_free(&d);

  sxt_desc_kv(&d, "tcp-only", 2, 0, 4096, 8, 0);
  d.regions[0].nic = 1;
  sxt_ok(sx__desc_pack(&d, &buf, &len));
  sxt_rc(sx_desc_decode(buf, len, &back), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "has 0"));
  /* Even unvalidated, the lookup names nothing. */
  assert_null(sx_desc_region_nic(&d, &d.regions[0]));
  free(buf);
  sx_desc_free(&d);

  uint32_t ids[3] = {0, 1, 2}, nics[2] = {1, 1};
  uint8_t inc[16] = {1}, tok[16] = {2};
  char *locs[1] = {(char *)"cpu"};
  Sxpb__RegionTable t = SXPB__REGION_TABLE__INIT;
  t.id = ids;
  t.n_id = 3;
  t.nic = nics;
  t.n_nic = 2;
  t.locations = locs;
  t.n_locations = 1;
  Sxpb__SegmentDescriptor m = SXPB__SEGMENT_DESCRIPTOR__INIT;
  m.schema_version = SX_SCHEMA_VERSION;
  m.name = (char *)"seg";
  m.incarnation = (ProtobufCBinaryData){16, inc};
  m.token = (ProtobufCBinaryData){16, tok};
  m.regions = &t;
  uint8_t raw[256];
  len = sxpb__segment_descriptor__pack(&m, raw);
  sxt_rc(sx_desc_decode(raw, len, &back), SX_EDECODE);
  assert_non_null(strstr(sx_errmsg(), "column nic has 2 entries for 3 regions"));
}

static void test_desc_nic_in_json(void **state) {
  (void)state;
  sx_desc d;
  char *text;
  sxt_desc_kv(&d, "json", 2, 0, 4096, 8, 2);
  d.regions[0].nic = 2;
  sxt_ok(sx_desc_to_json(&d, 0, &text));
  assert_non_null(strstr(text, "\"nic\": \"mlx5_1\""));
  /* Only the region with a NIC has the key. */
  assert_null(strstr(strstr(text, "\"nic\"") + 1, "\"nic\""));
  free(text);
  sx_desc_free(&d);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_desc_nic_roundtrip),
      cmocka_unit_test(test_desc_nic_absent_column),
      cmocka_unit_test(test_desc_nic_hostile_values_rejected),
      cmocka_unit_test(test_desc_nic_in_json),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
