/* Compatibility check (one test per mismatch kind) and layout files. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sxtest.h"

static void pair(sx_desc *local, sx_desc *remote) {
  sxt_desc_kv(local, "decode-0", 80, 0, 32768, 1024, 0);
  sxt_desc_kv(remote, "prefill-0", 80, 0, 32768, 4096, 1);
}

static void test_layout_check_compatible_with_asymmetric_num_blocks(void **state) {
  (void)state;
  sx_desc l, r;
  sx_mismatch m;
  pair(&l, &r);
  sxt_ok(sx_layout_check(&l, &r, 0, &m));
  assert_int_equal(m.kind, SX_MISMATCH_NONE);
  sx_desc_free(&l);
  sx_desc_free(&r);
}

static void test_layout_check_strided_equals_per_layer(void **state) {
  (void)state;
  sx_desc l, r;
  sxt_desc_kv(&l, "a", 80, 1, 32768, 100, 0); /* 160 regions */
  sxt_desc_kv(&r, "b", 80, 0, 32768, 200, 0); /* 2 regions */
  sxt_ok(sx_layout_check(&l, &r, 0, NULL));
  sxt_ok(sx_layout_check(&r, &l, 0, NULL));
  sx_desc_free(&l);
  sx_desc_free(&r);
}

static void test_layout_check_fingerprint(void **state) {
  (void)state;
  sx_desc l, r;
  sx_mismatch m;
  pair(&l, &r);
  strcpy(r.layout.fingerprint, "llama-3-8b/bf16/v1");
  sxt_rc(sx_layout_check(&l, &r, 0, &m), SX_EINCOMPAT);
  assert_int_equal(m.kind, SX_MISMATCH_FINGERPRINT);
  assert_string_equal(m.field, "fingerprint");
  assert_string_equal(m.local, "llama-3-70b/bf16/v1");
  assert_string_equal(m.remote, "llama-3-8b/bf16/v1");
  assert_non_null(strstr(m.message, "fingerprint differs"));
  /* The caller may opt out of the fingerprint. */
  sxt_ok(sx_layout_check(&l, &r, SX_CHECK_IGNORE_FINGERPRINT, &m));
  sx_desc_free(&l);
  sx_desc_free(&r);
}

static void test_layout_check_layout_tag(void **state) {
  (void)state;
  sx_desc l, r;
  sx_mismatch m;
  pair(&l, &r);
  strcpy(r.layout.tag, "HND");
  sxt_rc(sx_layout_check(&l, &r, 0, &m), SX_EINCOMPAT);
  assert_int_equal(m.kind, SX_MISMATCH_LAYOUT_TAG);
  assert_string_equal(m.remote, "HND");
  sx_desc_free(&l);
  sx_desc_free(&r);
}

static void test_layout_check_dtype(void **state) {
  (void)state;
  sx_desc l, r;
  sx_mismatch m;
  pair(&l, &r);
  strcpy(l.layout.dtype, "fp8_e4m3");
  sxt_rc(sx_layout_check(&l, &r, 0, &m), SX_EINCOMPAT);
  assert_int_equal(m.kind, SX_MISMATCH_DTYPE);
  assert_string_equal(m.local, "fp8_e4m3");
  assert_string_equal(m.remote, "bf16");
  sx_desc_free(&l);
  sx_desc_free(&r);
}

static void test_layout_check_block_bytes(void **state) {
  (void)state;
  sx_desc l, r;
  sx_mismatch m;
  sxt_desc_kv(&l, "a", 80, 1, 32768, 100, 0);
  sxt_desc_kv(&r, "b", 80, 1, 32768, 100, 0);
  /* Remote layer 17, slot V (region 80 + 17) has half-size blocks. */
  sx_region *v17 = &r.regions[80 + 17];
  assert_int_equal(v17->slot, SX_SLOT_V);
  assert_int_equal(v17->layer_first, 17);
  v17->block_bytes = v17->block_stride = 16384;
  sxt_rc(sx_layout_check(&l, &r, 0, &m), SX_EINCOMPAT);
  assert_int_equal(m.kind, SX_MISMATCH_BLOCK_BYTES);
  assert_int_equal(m.group, 0);
  assert_int_equal(m.layer, 17);
  assert_int_equal(m.slot, SX_SLOT_V);
  assert_string_equal(m.local, "32768");
  assert_string_equal(m.remote, "16384");
  assert_string_equal(m.message, "block_bytes differs at group 0 layer 17 slot V: "
                                 "local 32768, remote 16384");
  assert_string_equal(sx_errmsg(), m.message);
  sx_desc_free(&l);
  sx_desc_free(&r);
}

static void test_layout_check_missing_key(void **state) {
  (void)state;
  sx_desc l, r;
  sx_mismatch m;
  pair(&l, &r);
  r.regions[0].layer_count = 79; /* remote K lacks layer 79 */
  sxt_rc(sx_layout_check(&l, &r, 0, &m), SX_EINCOMPAT);
  assert_int_equal(m.kind, SX_MISMATCH_MISSING_KEY);
  assert_int_equal(m.layer, 79);
  assert_int_equal(m.slot, SX_SLOT_K);
  assert_non_null(strstr(m.message, "local has it, remote does not"));
  sx_desc_free(&l);
  sx_desc_free(&r);
}

static void test_layout_check_extra_key(void **state) {
  (void)state;
  sx_desc l, r;
  sx_mismatch m;
  pair(&l, &r);
  sx_region idx = r.regions[1];
  idx.id = 99;
  idx.slot = SX_SLOT_INDEX;
  idx.group = 1;
  assert_int_equal(sx_desc_add_region(&r, &idx), 0);
  sxt_rc(sx_layout_check(&l, &r, 0, &m), SX_EINCOMPAT);
  assert_int_equal(m.kind, SX_MISMATCH_EXTRA_KEY);
  assert_int_equal(m.group, 1);
  assert_int_equal(m.layer, 0);
  assert_int_equal(m.slot, SX_SLOT_INDEX);
  assert_non_null(strstr(m.message, "remote has it, local does not"));
  /* And the other way round it is a missing key. */
  sxt_rc(sx_layout_check(&r, &l, 0, &m), SX_EINCOMPAT);
  assert_int_equal(m.kind, SX_MISMATCH_MISSING_KEY);
  sx_desc_free(&l);
  sx_desc_free(&r);
}

static void test_layout_check_reports_lowest_key_first(void **state) {
  (void)state;
  sx_desc l, r;
  sx_mismatch m;
  sxt_desc_kv(&l, "a", 10, 1, 4096, 8, 0);
  sxt_desc_kv(&r, "b", 10, 1, 4096, 8, 0);
  r.regions[15].block_bytes = r.regions[15].block_stride = 2048; /* V layer 5 */
  r.regions[7].block_bytes = r.regions[7].block_stride = 2048;   /* K layer 7 */
  sxt_rc(sx_layout_check(&l, &r, 0, &m), SX_EINCOMPAT);
  assert_int_equal(m.slot, SX_SLOT_K);
  assert_int_equal(m.layer, 7);
  sx_desc_free(&l);
  sx_desc_free(&r);
}

static void test_layout_check_rejects_null(void **state) {
  (void)state;
  sx_desc l;
  sxt_desc_kv(&l, "a", 1, 0, 4096, 8, 0);
  sxt_rc(sx_layout_check(&l, NULL, 0, NULL), SX_EINVAL);
  sx_desc_free(&l);
}

/* Block descriptions: the same on both sides (or on one side only, an
 * older peer) check as before; other heads at equal block_bytes do not. */
static void test_layout_check_block_descriptions(void **state) {
  (void)state;
  sx_desc l, r;
  sx_mismatch m;
  pair(&l, &r);
  sx_block_desc b = {.order = SX_KV_HND, .tokens = 16, .head_first = 0, .head_count = 8,
                     .heads_total = 16, .head_dim = 128};
  strcpy(b.dtype, "bf16");
  l.layout.n_blocks = 1;
  l.layout.blocks[0] = b;
  sxt_ok(sx_desc_validate(&l));
  sxt_ok(sx_layout_check(&l, &r, 0, &m)); /* the remote describes nothing */
  r.layout.n_blocks = 1;
  r.layout.blocks[0] = b;
  sxt_ok(sx_layout_check(&l, &r, 0, &m));
  r.layout.blocks[0].head_first = 8; /* the other TP rank: same bytes, other heads */
  sxt_ok(sx_desc_validate(&r));
  sxt_rc(sx_layout_check(&l, &r, 0, &m), SX_EINCOMPAT);
  assert_int_equal(m.kind, SX_MISMATCH_BLOCK_DESC);
  assert_string_equal(m.field, "block_desc");
  assert_string_equal(m.local, "HND 16t h0-7/16 d128 bf16");
  assert_string_equal(m.remote, "HND 16t h8-15/16 d128 bf16");
  assert_non_null(strstr(m.message, "read plan"));
  r.layout.blocks[0] = b;
  r.layout.blocks[0].order = SX_KV_NHD;
  sxt_rc(sx_layout_check(&l, &r, 0, &m), SX_EINCOMPAT);
  assert_int_equal(m.kind, SX_MISMATCH_BLOCK_DESC);
  sx_desc_free(&l);
  sx_desc_free(&r);
}

static void test_layout_json_roundtrip_through_layout_file(void **state) {
  (void)state;
  sx_desc d, back;
  char *json;
  sxt_desc_kv(&d, "prefill-0/tp3", 80, 0, 32768, 1024, 2);
  sxt_ok(sx_desc_to_json(&d, 0, &json));
  assert_non_null(strstr(json, "\"<redacted>\""));
  assert_null(strstr(json, "101112131415")); /* the token's hex never appears */
  sxt_ok(sx_layout_parse(json, strlen(json), &back));
  sxt_ok(sx_layout_check(&d, &back, 0, NULL));
  assert_int_equal(back.n_regions, d.n_regions);
  assert_int_equal(back.n_endpoints, d.n_endpoints);
  for (uint32_t i = 0; i < d.n_regions; i++)
    assert_memory_equal(&back.regions[i], &d.regions[i], sizeof(sx_region));
  assert_string_equal(sx_desc_label(&back, "role"), "prefill");
  free(json);
  sxt_ok(sx_desc_to_json(&d, 1, &json));
  assert_non_null(strstr(json, "101112131415"));
  free(json);
  sx_desc_free(&back);
  sx_desc_free(&d);
}

/* Block descriptions in layout files: written by show --json, read back
 * the same; a description defaults its dtype to the layout's; bad ones
 * are refused with what is wrong. */
static void test_layout_file_block_descriptions(void **state) {
  (void)state;
  static const char text[] =
      "{\"layout\": {\"fingerprint\": \"m1\", \"dtype\": \"bf16\", \"tp_rank\": 1,\n"
      "  \"tp_size\": 2, \"layer_first\": 0, \"layer_count\": 2, \"blocks\": [\n"
      "  {\"order\": \"HND\", \"tokens\": 16, \"head_first\": 4, \"head_count\": 4,\n"
      "   \"heads_total\": 8, \"head_dim\": 128}]},\n"
      " \"regions\": [{\"slot\": \"K\", \"layer_count\": 2, \"layer_stride\": 65536,\n"
      "   \"block_bytes\": 16384, \"num_blocks\": 4}]}";
  sx_desc d, back;
  char *json;
  sxt_ok(sx_layout_parse(text, strlen(text), &d));
  assert_int_equal(d.layout.n_blocks, 1);
  const sx_block_desc *b = &d.layout.blocks[0];
  assert_int_equal(b->order, SX_KV_HND);
  assert_int_equal(b->head_first, 4);
  assert_string_equal(b->dtype, "bf16");
  assert_int_equal(d.layout.layer_count, 2);
  snprintf(d.name, sizeof(d.name), "x");
  sxt_ok(sx_desc_to_json(&d, 0, &json));
  sxt_ok(sx_layout_parse(json, strlen(json), &back));
  assert_int_equal(back.layout.n_blocks, 1);
  assert_int_equal(back.layout.blocks[0].head_count, 4);
  assert_int_equal(back.layout.blocks[0].slots, 3); /* written resolved: K and V */
  free(json);
  sx_desc_free(&back);
  sx_desc_free(&d);
  static const struct {
    const char *from, *to;
    int rc;
    const char *says;
  } bad[] = {
      {"\"HND\"", "\"HDN\"", SX_EINVAL, "order 'HDN'"},
      {"\"head_dim\": 128", "\"head_dim\": 64", SX_EINVAL, "block_bytes 16384"},
      {"\"head_first\": 4", "\"head_first\": 5", SX_EINVAL, "inside the model"},
      {"\"tokens\": 16,", "", SX_EINVAL, "\"tokens\" is required"},
      {"\"layer_first\": 0", "\"layer_first\": 1", SX_ELAYERS, "outside the stage"},
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    char buf[1024];
    const char *at = strstr(text, bad[i].from);
    assert_non_null(at);
    snprintf(buf, sizeof(buf), "%.*s%s%s", (int)(at - text), text, bad[i].to,
             at + strlen(bad[i].from));
    sxt_rc(sx_layout_parse(buf, strlen(buf), &d), bad[i].rc);
    if (strstr(sx_errmsg(), bad[i].says) == NULL)
      fail_msg("case %zu: '%s' lacks '%s'", i, sx_errmsg(), bad[i].says);
  }
}

static void test_layout_parse_minimal_file_with_defaults(void **state) {
  (void)state;
  static const char text[] =
      "{\"layout\": {\"fingerprint\": \"m1\", \"tag\": \"NHD\", \"dtype\": \"bf16\"},\n"
      " \"regions\": [\n"
      "  {\"slot\": \"K\", \"layer_count\": 4, \"layer_stride\": 65536,\n"
      "   \"block_bytes\": 4096, \"num_blocks\": 16},\n"
      "  {\"slot\": \"V\", \"layer_count\": 4, \"layer_stride\": 65536,\n"
      "   \"block_bytes\": 4096, \"num_blocks\": 16}]}";
  sx_desc d;
  sxt_ok(sx_layout_parse(text, strlen(text), &d));
  assert_int_equal(d.n_regions, 2);
  assert_int_equal(d.regions[1].id, 1);
  assert_int_equal(d.regions[1].slot, SX_SLOT_V);
  assert_int_equal(d.regions[0].block_stride, 4096);
  assert_int_equal(d.regions[0].length, 3 * 65536 + 16 * 4096);
  assert_string_equal(d.regions[0].location, "cpu");
  assert_int_equal(d.regions[0].access, SX_ACCESS_REMOTE_READ);
  sx_desc_free(&d);
}

static void expect_parse(const char *text, int code, const char *part) {
  sx_desc d;
  int rc = sx_layout_parse(text, strlen(text), &d);
  if (rc != code)
    fail_msg("parse = %s, expected %s (%s)", sx_err_name(rc), sx_err_name(code),
             sx_errmsg());
  if (strstr(sx_errmsg(), part) == NULL)
    fail_msg("message '%s' lacks '%s'", sx_errmsg(), part);
}

static void test_layout_parse_rejects_bad_files(void **state) {
  (void)state;
  expect_parse("{\"regions\": [", SX_EDECODE, "line 1");
  expect_parse("[]", SX_EINVAL, "top level");
  expect_parse("{}", SX_EINVAL, "\"regions\"");
  expect_parse("{\"regions\": [{\"num_blocks\": 1}]}", SX_EINVAL,
               "regions[0]: \"block_bytes\" is required");
  expect_parse("{\"regions\": [{\"block_bytes\": -1, \"num_blocks\": 1}]}", SX_EINVAL,
               "negative");
  expect_parse("{\"regions\": [{\"block_bytes\": 8, \"num_blocks\": 1, \"slot\": \"Q\"}]}",
               SX_EINVAL, "regions[0]: bad slot 'Q'");
  expect_parse("{\"regions\": [{\"block_bytes\": 8, \"block_stride\": 4, \"num_blocks\": 1}]}",
               SX_ESTRIDE, "block_stride 4 < block_bytes 8");
  expect_parse("{\"regions\": [{\"block_bytes\": 8, \"num_blocks\": 1},"
               " {\"id\": 5, \"block_bytes\": 8, \"num_blocks\": 1}]}",
               SX_EOVERLAP, "regions 0 and 5");
  expect_parse("{\"layout\": {\"tp_rank\": 4, \"tp_size\": 4}, \"regions\": []}",
               SX_EINVAL, "tp 4/4");
  expect_parse("{\"regions\": [], \"a\": 1, \"a\": 2}", SX_EDECODE, "duplicate");
  expect_parse("{\"regions\": [{\"block_bytes\": \"0x1zz\", \"num_blocks\": 1}]}",
               SX_EINVAL, "not an unsigned number");
}

/* Slot names and numbers (sx-agent --slots, layout files): a blank or a
 * sign first was taken by strtoul ("+1" and " 1" were slot 1). */
static void test_layout_slot_parse(void **state) {
  (void)state;
  static const struct {
    const char *s;
    uint32_t slot;
  } good[] = {{"K", 0}, {"v", 1}, {"0", 0}, {"3", 3}, {"slot2", 2}};
  for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
    uint32_t slot = 99;
    sxt_ok(sx_slot_parse(good[i].s, &slot));
    assert_int_equal(slot, good[i].slot);
  }
  static const char *const bad[] = {"", " 1", "+1", "-0", "1 ", "slot", "slot+1",
                                    "slot 1", "1x", "99999999999999999999"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    uint32_t slot = 99;
    if (sx_slot_parse(bad[i], &slot) != SX_EINVAL)
      fail_msg("slot '%s' was taken as %u", bad[i], slot);
    assert_non_null(strstr(sx_errmsg(), "bad slot"));
  }
}

static void test_layout_load_reports_missing_file(void **state) {
  (void)state;
  sx_desc d;
  sxt_rc(sx_layout_load("/nonexistent/layout.json", &d), SX_EIO);
  assert_non_null(strstr(sx_errmsg(), "/nonexistent/layout.json"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_layout_check_compatible_with_asymmetric_num_blocks),
      cmocka_unit_test(test_layout_check_strided_equals_per_layer),
      cmocka_unit_test(test_layout_check_fingerprint),
      cmocka_unit_test(test_layout_check_layout_tag),
      cmocka_unit_test(test_layout_check_dtype),
      cmocka_unit_test(test_layout_check_block_bytes),
      cmocka_unit_test(test_layout_check_missing_key),
      cmocka_unit_test(test_layout_check_extra_key),
      cmocka_unit_test(test_layout_check_reports_lowest_key_first),
      cmocka_unit_test(test_layout_check_rejects_null),
      cmocka_unit_test(test_layout_check_block_descriptions),
      cmocka_unit_test(test_layout_file_block_descriptions),
      cmocka_unit_test(test_layout_json_roundtrip_through_layout_file),
      cmocka_unit_test(test_layout_parse_minimal_file_with_defaults),
      cmocka_unit_test(test_layout_parse_rejects_bad_files),
      cmocka_unit_test(test_layout_load_reports_missing_file),
      cmocka_unit_test(test_layout_slot_parse),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
