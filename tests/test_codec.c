/* Descriptor and event codec: round trips, one test per rejection rule, size. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "segxfer.pb-c.h"
#include "sxtest.h"

static void assert_desc_equal(const sx_desc *a, const sx_desc *b) {
  assert_int_equal(a->schema_version, b->schema_version);
  assert_string_equal(a->name, b->name);
  assert_memory_equal(a->incarnation, b->incarnation, SX_INCARNATION_LEN);
  assert_memory_equal(a->token, b->token, SX_TOKEN_LEN);
  assert_int_equal(a->generation, b->generation);
  assert_int_equal(a->published_at_ms, b->published_at_ms);
  assert_int_equal(a->lease_ms, b->lease_ms);
  assert_memory_equal(&a->layout, &b->layout, sizeof(a->layout));
  assert_int_equal(a->n_endpoints, b->n_endpoints);
  for (uint32_t i = 0; i < a->n_endpoints; i++)
    assert_memory_equal(&a->endpoints[i], &b->endpoints[i], sizeof(sx_endpoint));
  assert_int_equal(a->n_regions, b->n_regions);
  for (uint32_t i = 0; i < a->n_regions; i++)
    assert_memory_equal(&a->regions[i], &b->regions[i], sizeof(sx_region));
  assert_int_equal(a->n_labels, b->n_labels);
  for (uint32_t i = 0; i < a->n_labels; i++)
    assert_memory_equal(&a->labels[i], &b->labels[i], sizeof(sx_label));
}

static void roundtrip(const sx_desc *d) {
  uint8_t *buf;
  size_t len;
  sx_desc back;
  sxt_ok(sx_desc_encode(d, &buf, &len));
  sxt_ok(sx_desc_decode(buf, len, &back));
  assert_desc_equal(d, &back);
  sx_desc_free(&back);
  free(buf);
}

static void test_codec_roundtrip_small(void **state) {
  (void)state;
  sx_desc d;
  sxt_desc_kv(&d, "prefill-0/tp3", 80, 0, 32768, 1024, 0);
  roundtrip(&d);
  sx_desc_free(&d);
}

static void test_codec_roundtrip_every_field(void **state) {
  (void)state;
  sx_desc d;
  sxt_desc_kv(&d, "decode-7/tp0@rack:3", 8, 1, 16384, 512, 2);
  d.regions[3].group = 5;
  d.regions[3].layer_first = 100;
  d.regions[3].access = 0;
  strcpy(d.regions[4].location, "cuda:1");
  d.regions[5].block_stride = 20000;
  d.regions[5].length = 20000ull * 512;
  d.regions[6].addr = 0xffffff0000000000ull; /* high addresses survive */
  d.regions[6].length = 16384ull * 512;
  d.generation = 0xfffffffffffffffeull;
  d.lease_ms = 0xffffffffu;
  assert_int_equal(sx_desc_set_label(&d, "model", "llama-3-70b"), 0);
  roundtrip(&d);
  sx_desc_free(&d);
}

static void test_codec_roundtrip_large(void **state) {
  (void)state;
  sx_desc d;
  sxt_desc_kv(&d, "big", 2048, 1, 4096, 64, 1); /* 4096 regions: the limit */
  assert_int_equal(d.n_regions, SX_MAX_REGIONS);
  roundtrip(&d);
  sx_region extra = d.regions[0];
  assert_int_equal(sx_desc_add_region(&d, &extra), SX_ELIMIT);
  sx_desc_free(&d);
}

static void test_codec_compact_strided_80_layers(void **state) {
  (void)state;
  sx_desc d;
  uint8_t *buf;
  size_t len;
  sxt_desc_kv(&d, "prefill-0/tp3", 80, 0, 32768, 4096, 1);
  assert_int_equal(d.n_regions, 2);
  sxt_ok(sx_desc_encode(&d, &buf, &len));
  assert_true(len <= 512);
  free(buf);
  sx_desc_free(&d);
}

static void test_codec_compact_160_per_layer_regions(void **state) {
  (void)state;
  sx_desc d;
  uint8_t *buf;
  size_t len;
  sxt_desc_kv(&d, "prefill-0/tp3", 80, 1, 32768, 4096, 1);
  assert_int_equal(d.n_regions, 160);
  sxt_ok(sx_desc_encode(&d, &buf, &len));
  assert_true(len <= 8192);
  free(buf);
  sx_desc_free(&d);
}

/* Pack a descriptor that breaks a rule, decode it, expect the code. */
static void expect_decode(const sx_desc *d, int code, const char *msg_part) {
  uint8_t *buf;
  size_t len;
  sx_desc out;
  assert_int_equal(sx__desc_pack(d, &buf, &len), 0);
  memset(&out, 0x5a, sizeof(out));
  int rc = sx_desc_decode(buf, len, &out);
  if (rc != code)
    fail_msg("decode = %s, expected %s (%s)", sx_err_name(rc), sx_err_name(code),
             sx_errmsg());
  if (msg_part != NULL && strstr(sx_errmsg(), msg_part) == NULL)
    fail_msg("message '%s' lacks '%s'", sx_errmsg(), msg_part);
  /* On failure the output is untouched. */
  assert_int_equal(((uint8_t *)&out)[0], 0x5a);
  free(buf);
}

static void fixture(sx_desc *d) { sxt_desc_kv(d, "seg", 4, 1, 4096, 16, 1); }

static void test_codec_rejects_unknown_schema_version(void **state) {
  (void)state;
  sx_desc d;
  fixture(&d);
  d.schema_version = 2;
  expect_decode(&d, SX_EVERSION, "schema_version 2");
  sx_desc_free(&d);
}

static void test_codec_rejects_empty_name(void **state) {
  (void)state;
  sx_desc d;
  fixture(&d);
  d.name[0] = '\0';
  expect_decode(&d, SX_ENAME, "empty");
  sx_desc_free(&d);
}

static void test_codec_rejects_bad_name_chars(void **state) {
  (void)state;
  sx_desc d;
  fixture(&d);
  strcpy(d.name, "prefill 0");
  expect_decode(&d, SX_ENAME, "0x20");
  strcpy(d.name, "a{b}");
  expect_decode(&d, SX_ENAME, "0x7b");
  strcpy(d.name, "/abs");
  expect_decode(&d, SX_ENAME, "starts with");
  sx_desc_free(&d);
}

static void test_codec_rejects_long_name(void **state) {
  (void)state;
  /* The C struct cannot hold it, so build the protobuf message directly. */
  char name[SX_NAME_MAX + 2];
  uint8_t inc[16] = {1}, tok[16] = {2};
  memset(name, 'a', sizeof(name) - 1);
  name[sizeof(name) - 1] = '\0';
  Sxpb__SegmentDescriptor m = SXPB__SEGMENT_DESCRIPTOR__INIT;
  m.schema_version = SX_SCHEMA_VERSION;
  m.name = name;
  m.incarnation = (ProtobufCBinaryData){16, inc};
  m.token = (ProtobufCBinaryData){16, tok};
  uint8_t buf[512];
  size_t len = sxpb__segment_descriptor__pack(&m, buf);
  sx_desc out;
  sxt_rc(sx_desc_decode(buf, len, &out), SX_ENAME);
  name[SX_NAME_MAX] = '\0'; /* exactly the limit is fine */
  len = sxpb__segment_descriptor__pack(&m, buf);
  sxt_ok(sx_desc_decode(buf, len, &out));
  sx_desc_free(&out);
}

static void test_codec_rejects_too_many_regions(void **state) {
  (void)state;
  /* A region table with SX_MAX_REGIONS + 1 ids. */
  size_t n = SX_MAX_REGIONS + 1;
  uint32_t *ids = calloc(n, sizeof(uint32_t));
  uint8_t inc[16] = {1}, tok[16] = {2};
  for (size_t i = 0; i < n; i++)
    ids[i] = (uint32_t)i;
  Sxpb__RegionTable t = SXPB__REGION_TABLE__INIT;
  t.id = ids;
  t.n_id = n;
  Sxpb__SegmentDescriptor m = SXPB__SEGMENT_DESCRIPTOR__INIT;
  m.schema_version = SX_SCHEMA_VERSION;
  m.name = (char *)"seg";
  m.incarnation = (ProtobufCBinaryData){16, inc};
  m.token = (ProtobufCBinaryData){16, tok};
  m.regions = &t;
  uint8_t *buf = malloc(sxpb__segment_descriptor__get_packed_size(&m));
  size_t len = sxpb__segment_descriptor__pack(&m, buf);
  sx_desc out;
  sxt_rc(sx_desc_decode(buf, len, &out), SX_ELIMIT);
  assert_non_null(strstr(sx_errmsg(), "4097 regions"));
  free(buf);
  free(ids);
}

static void test_codec_rejects_ragged_region_columns(void **state) {
  (void)state;
  uint32_t ids[3] = {0, 1, 2}, groups[2] = {1, 1};
  uint8_t inc[16] = {1}, tok[16] = {2};
  Sxpb__RegionTable t = SXPB__REGION_TABLE__INIT;
  t.id = ids;
  t.n_id = 3;
  t.group = groups;
  t.n_group = 2;
  Sxpb__SegmentDescriptor m = SXPB__SEGMENT_DESCRIPTOR__INIT;
  m.schema_version = SX_SCHEMA_VERSION;
  m.name = (char *)"seg";
  m.incarnation = (ProtobufCBinaryData){16, inc};
  m.token = (ProtobufCBinaryData){16, tok};
  m.regions = &t;
  uint8_t buf[256];
  size_t len = sxpb__segment_descriptor__pack(&m, buf);
  sx_desc out;
  sxt_rc(sx_desc_decode(buf, len, &out), SX_EDECODE);
  assert_non_null(strstr(sx_errmsg(), "column group has 2 entries for 3 regions"));
}

static void test_codec_rejects_too_many_bytes(void **state) {
  (void)state;
  size_t len = SX_MAX_DESC_BYTES + 1;
  uint8_t *buf = calloc(1, len);
  sx_desc out;
  sxt_rc(sx_desc_decode(buf, len, &out), SX_ELIMIT);
  free(buf);
}

static void test_codec_rejects_too_many_labels_and_endpoints(void **state) {
  (void)state;
  uint8_t buf[4 * (SX_MAX_ENDPOINTS + SX_MAX_LABELS + 2)];
  size_t n = 0;
  for (int i = 0; i <= SX_MAX_LABELS; i++) {
    buf[n++] = (11 << 3) | 2;
    buf[n++] = 0;
  }
  sx_desc out;
  sxt_rc(sx_desc_decode(buf, n, &out), SX_ELIMIT);
  assert_non_null(strstr(sx_errmsg(), "labels"));
  n = 0;
  for (int i = 0; i <= SX_MAX_ENDPOINTS; i++) {
    buf[n++] = (7 << 3) | 2;
    buf[n++] = 0;
  }
  sxt_rc(sx_desc_decode(buf, n, &out), SX_ELIMIT);
  assert_non_null(strstr(sx_errmsg(), "endpoints"));
}

static void test_codec_rejects_stride_below_block_bytes(void **state) {
  (void)state;
  sx_desc d;
  fixture(&d);
  d.regions[2].block_stride = d.regions[2].block_bytes - 1;
  expect_decode(&d, SX_ESTRIDE, "region 2");
  sx_desc_free(&d);
}

static void test_codec_rejects_block_span_overflow(void **state) {
  (void)state;
  sx_desc d;
  fixture(&d);
  d.regions[1].num_blocks = 1ull << 40;
  d.regions[1].block_stride = 1ull << 30; /* 2^70 */
  d.regions[1].block_bytes = 4096;
  expect_decode(&d, SX_EOVERFLOW, "num_blocks");
  sx_desc_free(&d);
}

static void test_codec_rejects_layer_span_overflow(void **state) {
  (void)state;
  sx_desc d;
  fixture(&d);
  d.regions[0].layer_count = 3;
  d.regions[0].layer_stride = 1ull << 63; /* (3-1) * 2^63 */
  expect_decode(&d, SX_EOVERFLOW, "layer_stride");
  sx_desc_free(&d);
  fixture(&d);
  d.regions[0].layer_count = 2;
  d.regions[0].layer_stride = UINT64_MAX - 10; /* product fits, sum does not */
  expect_decode(&d, SX_EOVERFLOW, "layer span");
  sx_desc_free(&d);
}

static void test_codec_rejects_span_beyond_length(void **state) {
  (void)state;
  sx_desc d;
  fixture(&d);
  d.regions[3].length -= 1; /* 16 blocks of 4096 no longer fit */
  expect_decode(&d, SX_EBOUNDS, "region 3");
  sx_desc_free(&d);
  fixture(&d);
  d.regions[0].layer_count = 2; /* second layer lies past length */
  d.regions[0].layer_stride = d.regions[0].length;
  d.regions[1].layer_first = 7; /* keep keys disjoint */
  d.regions[0].layer_first = 10;
  expect_decode(&d, SX_EBOUNDS, "region 0");
  sx_desc_free(&d);
}

static void test_codec_rejects_addr_overflow(void **state) {
  (void)state;
  sx_desc d;
  fixture(&d);
  d.regions[0].addr = UINT64_MAX - 100;
  expect_decode(&d, SX_EOVERFLOW, "addr + length");
  sx_desc_free(&d);
}

static void test_codec_rejects_zero_layer_count(void **state) {
  (void)state;
  sx_desc d;
  fixture(&d);
  d.regions[2].layer_count = 0;
  expect_decode(&d, SX_ELAYERS, "region 2");
  sx_desc_free(&d);
}

static void test_codec_rejects_overlapping_keys(void **state) {
  (void)state;
  sx_desc d;
  fixture(&d);
  /* Region 1 (K, layer 1) widened to layers 1..3 collides with K layer 2. */
  d.regions[1].layer_count = 3;
  d.regions[1].layer_stride = 65536;
  d.regions[1].length = 3 * 65536;
  expect_decode(&d, SX_EOVERLAP, "layer 2 slot K");
  sx_desc_free(&d);
}

static void test_codec_rejects_duplicate_region_ids(void **state) {
  (void)state;
  sx_desc d;
  fixture(&d);
  d.regions[5].id = d.regions[2].id;
  expect_decode(&d, SX_EDUPLICATE, "appears twice");
  sx_desc_free(&d);
}

/* Key checks over many regions in a scrambled order (the sort's merge
 * passes, not only its short runs): a valid set passes, and one overlap or
 * one duplicate id anywhere is found. */
static void test_codec_key_checks_scale_and_order(void **state) {
  (void)state;
  sx_desc d;
  sxt_desc_kv(&d, "scrambled/0", 700, 1, 4096, 16, 0);
  /* A fixed scramble: swap each region with one a stride away. */
  for (uint32_t i = 0; i < d.n_regions; i++) {
    uint32_t j = (i * 7919u + 13u) % d.n_regions;
    sx_region t = d.regions[i];
    d.regions[i] = d.regions[j];
    d.regions[j] = t;
  }
  sxt_ok(sx_desc_validate(&d));
  roundtrip(&d);
  /* One region (V, layer 411) widened over layer 412 of V. */
  uint32_t w = 0;
  for (uint32_t i = 0; i < d.n_regions; i++)
    if (d.regions[i].slot == SX_SLOT_V && d.regions[i].layer_first == 411)
      w = i;
  sx_region keep = d.regions[w];
  d.regions[w].layer_count = 2;
  d.regions[w].layer_stride = 65536;
  d.regions[w].length = 2 * 65536;
  expect_decode(&d, SX_EOVERLAP, "layer 412 slot V");
  d.regions[w] = keep;
  sxt_ok(sx_desc_validate(&d));
  d.regions[d.n_regions - 3].id = d.regions[17].id;
  expect_decode(&d, SX_EDUPLICATE, "appears twice");
  sx_desc_free(&d);
}

static void test_codec_rejects_rkey_count_mismatch(void **state) {
  (void)state;
  sx_desc d;
  fixture(&d); /* one RDMA endpoint */
  for (uint32_t i = 0; i < d.n_regions; i++)
    d.regions[i].n_rkeys = 2;
  expect_decode(&d, SX_ERKEYS, "2 rkeys for 1");
  for (uint32_t i = 0; i < d.n_regions; i++)
    d.regions[i].n_rkeys = 0;
  expect_decode(&d, SX_ERKEYS, "0 rkeys for 1");
  sx_desc_free(&d);
  /* Built by hand, a region with a different count fails validation. */
  fixture(&d);
  d.regions[4].n_rkeys = 2;
  sxt_rc(sx_desc_validate(&d), SX_ERKEYS);
  assert_non_null(strstr(sx_errmsg(), "region 4"));
  sx_desc_free(&d);
}

/* Push mode: write keys travel only on writable regions, one per endpoint. */
static void test_codec_write_keys_roundtrip_and_rules(void **state) {
  (void)state;
  sx_desc d;
  fixture(&d); /* one RDMA endpoint */
  d.regions[2].access |= SX_ACCESS_REMOTE_WRITE;
  d.regions[2].n_wkeys = 1;
  d.regions[2].wkeys[0] = 0x5151u;
  d.regions[3].access |= SX_ACCESS_REMOTE_WRITE; /* writable, no key (TCP only) */
  roundtrip(&d);
  d.regions[4].n_wkeys = 1; /* not writable */
  d.regions[4].wkeys[0] = 7;
  expect_decode(&d, SX_ERKEYS, "not writable");
  d.regions[4].n_wkeys = 0;
  d.regions[2].n_wkeys = 2; /* built by hand: validation catches it */
  sxt_rc(sx_desc_validate(&d), SX_ERKEYS);
  assert_non_null(strstr(sx_errmsg(), "2 write keys for 1"));
  sx_desc_free(&d);
}

static void test_codec_rejects_missing_incarnation_or_token(void **state) {
  (void)state;
  sx_desc d;
  fixture(&d);
  memset(d.incarnation, 0, sizeof(d.incarnation));
  expect_decode(&d, SX_EMISSING, "incarnation");
  sx_desc_free(&d);
  fixture(&d);
  memset(d.token, 0, sizeof(d.token));
  expect_decode(&d, SX_EMISSING, "token");
  sx_desc_free(&d);
}

static void test_codec_rejects_garbage_and_truncation(void **state) {
  (void)state;
  sx_desc d, out;
  uint8_t *buf;
  size_t len;
  fixture(&d);
  sxt_ok(sx_desc_encode(&d, &buf, &len));
  for (size_t cut = 1; cut < len; cut += 7) {
    int rc = sx_desc_decode(buf, len - cut, &out);
    assert_int_not_equal(rc, 0);
  }
  static const uint8_t junk[] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01};
  sxt_rc(sx_desc_decode(junk, sizeof(junk), &out), SX_EDECODE);
  sxt_rc(sx_desc_decode((const uint8_t *)"", 0, &out), SX_EVERSION);
  free(buf);
  sx_desc_free(&d);
}

static void test_codec_encode_refuses_invalid(void **state) {
  (void)state;
  sx_desc d;
  uint8_t *buf = NULL;
  size_t len = 0;
  fixture(&d);
  d.regions[0].layer_count = 0;
  sxt_rc(sx_desc_encode(&d, &buf, &len), SX_ELAYERS);
  assert_null(buf);
  sx_desc_free(&d);
}

/* Key counts beyond the arrays are refused even unvalidated (sx__desc_pack
 * writes what tests and hostile-store fixtures hand it), never read past. */
static void test_codec_pack_refuses_key_counts_beyond_the_arrays(void **state) {
  (void)state;
  sx_desc d;
  uint8_t *buf = NULL;
  size_t len = 0;
  fixture(&d);
  d.regions[0].n_rkeys = SX_MAX_DEVICES + 1;
  sxt_rc(sx__desc_pack(&d, &buf, &len), SX_ERKEYS);
  assert_null(buf);
  assert_non_null(strstr(sx_errmsg(), "9 rkeys"));
  sxt_rc(sx_desc_encode(&d, &buf, &len), SX_ERKEYS);
  assert_null(buf);
  d.regions[0].n_rkeys = 0;
  d.regions[d.n_regions - 1].n_wkeys = 1000;
  sxt_rc(sx__desc_pack(&d, &buf, &len), SX_ERKEYS);
  assert_null(buf);
  assert_non_null(strstr(sx_errmsg(), "1000 write keys"));
  /* At the limit it still packs, as given. */
  d.regions[d.n_regions - 1].n_wkeys = 0;
  d.regions[0].n_rkeys = SX_MAX_DEVICES;
  sxt_ok(sx__desc_pack(&d, &buf, &len));
  free(buf);
  sx_desc_free(&d);
}

/* A block description that fits sxt_desc_kv's 16384-byte blocks: 16 tokens
 * x 4 heads (4..7 of 8) x 128 x bf16. */
static void block_fixture(sx_desc *d) {
  sxt_desc_kv(d, "prefill-0/tp1", 8, 0, 16384, 64, 0);
  d->layout.tp_rank = 1;
  d->layout.tp_size = 2;
  d->layout.n_blocks = 1;
  d->layout.blocks[0] = (sx_block_desc){.group = 0, .order = SX_KV_HND, .tokens = 16,
                                        .head_first = 4, .head_count = 4,
                                        .heads_total = 8, .head_dim = 128};
  strcpy(d->layout.blocks[0].dtype, "bf16");
}

static void test_codec_block_description_roundtrip(void **state) {
  (void)state;
  sx_desc d;
  block_fixture(&d);
  d.layout.layer_first = 0;
  d.layout.layer_count = 8;
  roundtrip(&d);
  /* MLA: no head split. */
  d.layout.blocks[0] = (sx_block_desc){.order = SX_KV_MLA, .tokens = 16, .head_count = 1,
                                       .heads_total = 1, .head_dim = 512};
  strcpy(d.layout.blocks[0].dtype, "bf16");
  roundtrip(&d);
  sx_desc_free(&d);
}

/* A descriptor written before block descriptions (no Layout fields 8-10)
 * decodes with none, and one with them differs only there. */
static void test_codec_old_descriptor_decodes_without_blocks(void **state) {
  (void)state;
  sx_desc d, back;
  uint8_t *buf;
  size_t len;
  sxt_desc_kv(&d, "old/tp0", 4, 0, 4096, 16, 0);
  sxt_ok(sx_desc_encode(&d, &buf, &len));
  /* Unpack and check the wire form carries no block field at all. */
  Sxpb__SegmentDescriptor *m = sxpb__segment_descriptor__unpack(NULL, len, buf);
  assert_non_null(m);
  assert_int_equal(m->layout->n_blocks, 0);
  sxpb__segment_descriptor__free_unpacked(m, NULL);
  sxt_ok(sx_desc_decode(buf, len, &back));
  assert_int_equal(back.layout.n_blocks, 0);
  assert_int_equal(back.layout.layer_count, 0);
  sx_desc_free(&back);
  free(buf);
  sx_desc_free(&d);
}

/* Hostile descriptions from a store: each broken rule is refused at
 * decode with its code, never turned into a descriptor. */
static void expect_decode_rc(const sx_desc *d, int want) {
  uint8_t *buf;
  size_t len;
  sx_desc out;
  sxt_ok(sx__desc_pack(d, &buf, &len));
  sxt_rc(sx_desc_decode(buf, len, &out), want);
  free(buf);
}

static void test_codec_rejects_bad_block_descriptions(void **state) {
  (void)state;
  sx_desc d;
  block_fixture(&d);
  sx_block_desc good = d.layout.blocks[0];
#define BAD(stmt, code)                                                        \
  do {                                                                         \
    d.layout.blocks[0] = good;                                                 \
    sx_block_desc *b = &d.layout.blocks[0];                                    \
    (void)b;                                                                   \
    stmt;                                                                      \
    expect_decode_rc(&d, code);                                                \
    sxt_rc(sx_desc_validate(&d), code);                                        \
  } while (0)
  BAD(b->tokens = 0, SX_EINVAL);
  BAD(b->tokens = SX_MAX_BLOCK_TOKENS + 1, SX_EINVAL);
  BAD(b->heads_total = 0, SX_EINVAL);
  BAD(b->heads_total = SX_MAX_HEADS + 1, SX_EINVAL);
  BAD(b->head_count = 0, SX_EINVAL);
  BAD(b->head_first = 8, SX_EINVAL);
  BAD(b->head_first = 5, SX_EINVAL);                     /* 5..8 leaves 8 heads */
  BAD((b->head_first = 0xffffffffu, b->head_count = 2), SX_EINVAL); /* wraps */
  BAD(b->head_dim = 0, SX_EINVAL);
  BAD(b->head_dim = SX_MAX_HEAD_DIM + 1, SX_EINVAL);
  BAD(strcpy(b->dtype, "fp13"), SX_EINVAL);
  BAD(b->order = SX_KV_NONE, SX_EINVAL);
  BAD(b->order = SX_KV_MLA, SX_EINVAL);                 /* MLA with a head split */
  BAD(b->head_dim = 64, SX_EINVAL);                     /* 8192 != block_bytes */
  BAD(strcpy(b->dtype, "fp32"), SX_EINVAL);             /* 32768 != block_bytes */
  /* Every number at its limit: a product far above block_bytes. */
  BAD((b->tokens = SX_MAX_BLOCK_TOKENS, b->heads_total = SX_MAX_HEADS,
       b->head_first = 0, b->head_count = SX_MAX_HEADS, b->head_dim = SX_MAX_HEAD_DIM,
       strcpy(b->dtype, "fp64")), SX_EINVAL);
  /* Two descriptions of one group. */
  d.layout.blocks[0] = good;
  d.layout.blocks[1] = good;
  d.layout.n_blocks = 2;
  expect_decode_rc(&d, SX_EDUPLICATE);
  d.layout.n_blocks = 1;
  /* A stage whose layers do not hold the regions'. */
  d.layout.layer_first = 4;
  d.layout.layer_count = 4;
  expect_decode_rc(&d, SX_ELAYERS);
  d.layout.layer_first = 0xfffffff0u;
  d.layout.layer_count = 0x20;
  expect_decode_rc(&d, SX_EOVERFLOW);
  d.layout.layer_first = d.layout.layer_count = 0;
  /* An order number no build knows, straight on the wire. */
  {
    uint8_t *buf;
    size_t len;
    sx_desc out;
    sxt_ok(sx__desc_pack(&d, &buf, &len));
    Sxpb__SegmentDescriptor *m = sxpb__segment_descriptor__unpack(NULL, len, buf);
    free(buf);
    assert_non_null(m);
    m->layout->blocks[0]->order = 77;
    len = sxpb__segment_descriptor__get_packed_size(m);
    buf = malloc(len);
    sxpb__segment_descriptor__pack(m, buf);
    sxt_rc(sx_desc_decode(buf, len, &out), SX_EINVAL);
    /* More descriptions than the limit. */
    m->layout->blocks[0]->order = SX_KV_HND;
    Sxpb__BlockDesc *many[SX_MAX_BLOCK_DESCS + 1];
    for (int i = 0; i <= SX_MAX_BLOCK_DESCS; i++)
      many[i] = m->layout->blocks[0];
    Sxpb__BlockDesc **keep = m->layout->blocks;
    size_t keep_n = m->layout->n_blocks;
    m->layout->blocks = many;
    m->layout->n_blocks = SX_MAX_BLOCK_DESCS + 1;
    free(buf);
    len = sxpb__segment_descriptor__get_packed_size(m);
    buf = malloc(len);
    sxpb__segment_descriptor__pack(m, buf);
    sxt_rc(sx_desc_decode(buf, len, &out), SX_ELIMIT);
    m->layout->blocks = keep;
    m->layout->n_blocks = keep_n;
    sxpb__segment_descriptor__free_unpacked(m, NULL);
    free(buf);
  }
#undef BAD
  sx_desc_free(&d);
}

static void test_codec_event_roundtrip_and_rejects(void **state) {
  (void)state;
  sx_event ev = {.kind = SX_EVENT_PUT, .generation = 42}, back;
  strcpy(ev.name, "prefill-0/tp3");
  ev.incarnation[0] = 9;
  uint8_t *buf;
  size_t len;
  sxt_ok(sx_event_encode(&ev, &buf, &len));
  sxt_ok(sx_event_decode(buf, len, &back));
  assert_memory_equal(&ev, &back, sizeof(ev));
  free(buf);
  ev.kind = (sx_event_kind)9;
  sxt_rc(sx_event_encode(&ev, &buf, &len), SX_EINVAL);
  static const uint8_t bad_kind[] = {0x08, 0x09, 0x12, 0x01, 'a'};
  sxt_rc(sx_event_decode(bad_kind, sizeof(bad_kind), &back), SX_EDECODE);
  static const uint8_t bad_name[] = {0x08, 0x01, 0x12, 0x02, 'a', ' '};
  sxt_rc(sx_event_decode(bad_name, sizeof(bad_name), &back), SX_ENAME);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_codec_roundtrip_small),
      cmocka_unit_test(test_codec_block_description_roundtrip),
      cmocka_unit_test(test_codec_old_descriptor_decodes_without_blocks),
      cmocka_unit_test(test_codec_rejects_bad_block_descriptions),
      cmocka_unit_test(test_codec_roundtrip_every_field),
      cmocka_unit_test(test_codec_roundtrip_large),
      cmocka_unit_test(test_codec_compact_strided_80_layers),
      cmocka_unit_test(test_codec_compact_160_per_layer_regions),
      cmocka_unit_test(test_codec_rejects_unknown_schema_version),
      cmocka_unit_test(test_codec_rejects_empty_name),
      cmocka_unit_test(test_codec_rejects_bad_name_chars),
      cmocka_unit_test(test_codec_rejects_long_name),
      cmocka_unit_test(test_codec_rejects_too_many_regions),
      cmocka_unit_test(test_codec_rejects_ragged_region_columns),
      cmocka_unit_test(test_codec_rejects_too_many_bytes),
      cmocka_unit_test(test_codec_rejects_too_many_labels_and_endpoints),
      cmocka_unit_test(test_codec_rejects_stride_below_block_bytes),
      cmocka_unit_test(test_codec_rejects_block_span_overflow),
      cmocka_unit_test(test_codec_rejects_layer_span_overflow),
      cmocka_unit_test(test_codec_rejects_span_beyond_length),
      cmocka_unit_test(test_codec_rejects_addr_overflow),
      cmocka_unit_test(test_codec_rejects_zero_layer_count),
      cmocka_unit_test(test_codec_rejects_overlapping_keys),
      cmocka_unit_test(test_codec_rejects_duplicate_region_ids),
      cmocka_unit_test(test_codec_key_checks_scale_and_order),
      cmocka_unit_test(test_codec_rejects_rkey_count_mismatch),
      cmocka_unit_test(test_codec_write_keys_roundtrip_and_rules),
      cmocka_unit_test(test_codec_rejects_missing_incarnation_or_token),
      cmocka_unit_test(test_codec_rejects_garbage_and_truncation),
      cmocka_unit_test(test_codec_encode_refuses_invalid),
      cmocka_unit_test(test_codec_pack_refuses_key_counts_beyond_the_arrays),
      cmocka_unit_test(test_codec_event_roundtrip_and_rejects),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
