/*
 * Read plans (meta/plan.c): every case the planner accepts is checked by
 * moving real bytes.  Each side is a paged K/V cache in memory whose every
 * element holds a code for (layer, slot, token position, head, element);
 * the plan is expanded for a request's block lists and the ranges copied
 * with memcpy, and the local cache must then equal, byte for byte, the
 * cache a reference fill of the same request gives.  Refusals are checked
 * for their kind, field and values.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "plan_int.h"
#include "sxtest.h"

#define LAYERS 3
#define HEAD_DIM 4

/* One side: its shape, its memory and its descriptor. */
typedef struct side {
  sx_kv_order order;
  uint32_t tokens, first, count, total, blocks, rank, tp;
  uint32_t *mem;  /* [slot][layer][block][block elements] */
  sx_desc d;
} side;

static uint64_t block_elems(const side *s) {
  return (uint64_t)s->tokens * s->count * HEAD_DIM;
}

static uint32_t code(uint32_t layer, uint32_t slot, uint32_t pos, uint32_t head, uint32_t e) {
  return ((((layer * 2 + slot) * 1024 + pos) * 64 + head) * HEAD_DIM + e) + 1;
}

/* Element (t, h, e) of a block, by the side's order. */
static uint64_t elem_at(const side *s, uint32_t t, uint32_t h, uint32_t e) {
  uint32_t hh = h - s->first;
  if (s->order == SX_KV_HND)
    return ((uint64_t)hh * s->tokens + t) * HEAD_DIM + e;
  return ((uint64_t)t * s->count + hh) * HEAD_DIM + e;
}

static uint32_t *slot_layer_block(const side *s, uint32_t slot, uint32_t layer, uint64_t b) {
  return s->mem + (((uint64_t)slot * LAYERS + layer) * s->blocks + b) * block_elems(s);
}

static void side_make(side *s, const char *name, sx_kv_order order, uint32_t tokens,
                      uint32_t first, uint32_t count, uint32_t total, uint32_t blocks) {
  memset(s, 0, sizeof(*s));
  s->order = order;
  s->tokens = tokens;
  s->first = first;
  s->count = count;
  s->total = total;
  s->blocks = blocks;
  uint64_t bb = block_elems(s) * 4;
  s->mem = calloc(2ull * LAYERS * blocks, bb);
  assert_non_null(s->mem);
  sxt_desc_base(&s->d, name);
  strcpy(s->d.layout.dtype, "fp32");
  strcpy(s->d.layout.tag, sx_kv_order_name(order));
  s->d.layout.tp_rank = 0;
  s->d.layout.tp_size = 0;
  s->d.layout.n_blocks = 1;
  sx_block_desc *b = &s->d.layout.blocks[0];
  *b = (sx_block_desc){.group = 0, .order = order, .tokens = tokens, .head_first = first,
                       .head_count = count, .heads_total = total, .head_dim = HEAD_DIM};
  strcpy(b->dtype, "fp32");
  for (uint32_t slot = 0; slot < 2; slot++) {
    sx_region r;
    memset(&r, 0, sizeof(r));
    r.id = slot;
    r.slot = slot;
    r.layer_count = LAYERS;
    r.layer_stride = blocks * bb;
    r.block_bytes = r.block_stride = bb;
    r.num_blocks = blocks;
    r.length = LAYERS * blocks * bb;
    r.addr = (uint64_t)(uintptr_t)slot_layer_block(s, slot, 0, 0);
    r.access = SX_ACCESS_REMOTE_READ;
    strcpy(r.location, "cpu");
    assert_int_equal(sx_desc_add_region(&s->d, &r), 0);
  }
  sxt_ok(sx_desc_validate(&s->d));
}

static void side_tp(side *s, uint32_t rank, uint32_t size) {
  s->d.layout.tp_rank = s->rank = rank;
  s->d.layout.tp_size = s->tp = size;
}

static void side_free(side *s) {
  free(s->mem);
  sx_desc_free(&s->d);
}

/* A TP=2 prefill: prefix/tp0 and prefix/tp1 holding count heads each of
 * total, rank 1's right after rank 0's. */
static void tp2_make(side r[2], const char *prefix, sx_kv_order order, uint32_t tokens,
                     uint32_t count, uint32_t total) {
  for (uint32_t i = 0; i < 2; i++) {
    char name[64];
    snprintf(name, sizeof(name), "%s/tp%u", prefix, i);
    side_make(&r[i], name, order, tokens, order == SX_KV_MLA ? 0 : i * count, count, total, 8);
    side_tp(&r[i], i, 2);
  }
}

/* A pipeline stage: only layers [first, first + count) of the side. */
static void side_stage(side *s, uint32_t first, uint32_t count, uint32_t pp_rank,
                       uint32_t pp_size) {
  for (uint32_t i = 0; i < s->d.n_regions; i++) {
    sx_region *r = &s->d.regions[i];
    r->addr = (uint64_t)(uintptr_t)slot_layer_block(s, r->slot, first, 0);
    r->layer_first = first;
    r->layer_count = count;
    r->length = count * r->layer_stride;
  }
  s->d.layout.layer_first = first;
  s->d.layout.layer_count = count;
  s->d.layout.pp_rank = pp_rank;
  s->d.layout.pp_size = pp_size;
  sxt_ok(sx_desc_validate(&s->d));
}

static void sides_free(side *l, side *r, uint32_t n) {
  side_free(l);
  for (uint32_t i = 0; i < n; i++)
    side_free(&r[i]);
}

/* Write the request's tokens [0, n) into the blocks table[] of s. */
static void fill(side *s, const uint64_t *table, uint32_t n) {
  for (uint32_t slot = 0; slot < 2; slot++)
    for (uint32_t l = 0; l < LAYERS; l++)
      for (uint32_t p = 0; p < n; p++) {
        uint32_t *blk = slot_layer_block(s, slot, l, table[p / s->tokens]);
        for (uint32_t h = s->first; h < s->first + s->count; h++)
          for (uint32_t e = 0; e < HEAD_DIM; e++)
            blk[elem_at(s, p % s->tokens, h, e)] = code(l, slot, p, h, e);
      }
}

static int copy_run(void *arg, const sx__prun *r) {
  uint64_t *bytes = arg;
  assert_true(r->n > 0 && r->n <= SX__PRUN_MAX);
  assert_true(r->count >= 1);
  for (uint32_t k = 0; k < r->n; k++)
    for (uint32_t i = 0; i < r->count; i++) {
      memcpy((void *)(uintptr_t)(r->laddr[k] + i * r->lstride),
             (const uint8_t *)(uintptr_t)r->R->addr + r->roff[k] + i * r->rstride, r->len[k]);
      *bytes += r->len[k];
    }
  return 0;
}

/*
 * Plan local from remotes[0..n), read a request of `tokens` tokens whose
 * remote blocks are rb and local blocks lb, and compare with a reference
 * local side filled directly.  Returns the plan's info.
 */
static sx_plan_info run_case(side *local, side *remotes, uint32_t n, const uint64_t *rb,
                             size_t nr, const uint64_t *lb, size_t nl, uint32_t tokens) {
  const sx_desc *rd[SX_PLAN_MAX_MEMBERS];
  for (uint32_t i = 0; i < n; i++) {
    rd[i] = &remotes[i].d;
    fill(&remotes[i], rb, tokens);
  }
  sx_plan *p;
  sx_mismatch m;
  sxt_ok(sx_layout_plan(&local->d, rd, n, 0, &p, &m));
  assert_int_equal(m.kind, SX_MISMATCH_NONE);
  uint64_t bytes = 0;
  sxt_ok(sx__plan_expand(p, &local->d, rd, n, rb, nr, lb, nl, copy_run, &bytes));
  /* The reference: the same request written straight into a side shaped
   * like the local one. */
  side ref = *local;
  size_t size = 2ull * LAYERS * local->blocks * block_elems(local) * 4;
  ref.mem = calloc(1, size);
  assert_non_null(ref.mem);
  fill(&ref, lb, tokens);
  assert_memory_equal(ref.mem, local->mem, size);
  /* Whole units are read: up to the shorter block list's end. */
  uint64_t lt = (uint64_t)nl * local->tokens, rt = (uint64_t)nr * remotes[0].tokens;
  uint64_t want = 2ull * LAYERS * (lt < rt ? lt : rt) * local->count * HEAD_DIM * 4;
  assert_int_equal(bytes, want);
  free(ref.mem);
  sx_plan_info info;
  sxt_ok(sx_plan_info_get(p, &info));
  sx_plan_free(p);
  return info;
}

static const uint64_t RB[] = {5, 2, 7, 0};
static const uint64_t LB[] = {3, 1, 6, 4, 0, 2, 7, 5};

/* ------------------------------------------------------------ accepted */

static void test_plan_equal_layouts_are_one_piece_per_block(void **state) {
  (void)state;
  side l, r;
  side_make(&l, "decode-0", SX_KV_NHD, 16, 0, 8, 8, 8);
  side_make(&r, "prefill-0", SX_KV_NHD, 16, 0, 8, 8, 8);
  sx_plan_info info = run_case(&l, &r, 1, RB, 3, LB, 3, 40);
  assert_int_equal(info.pieces, 1);
  assert_int_equal(info.used, 1);
  side_free(&l);
  side_free(&r);
}

static void test_plan_tp2_to_tp1_hnd_reads_head_slices(void **state) {
  (void)state;
  side l, r[2];
  side_make(&l, "decode-0", SX_KV_HND, 16, 0, 8, 8, 8);
  tp2_make(r, "prefill-0", SX_KV_HND, 16, 4, 8);
  sx_plan_info info = run_case(&l, r, 2, RB, 4, LB, 4, 61);
  assert_int_equal(info.pieces, 2); /* one head slice per member */
  assert_int_equal(info.used, 2);
  sides_free(&l, r, 2);
}

static void test_plan_tp2_to_tp1_nhd_reads_token_pieces(void **state) {
  (void)state;
  side l, r[2];
  side_make(&l, "decode-0", SX_KV_NHD, 4, 0, 4, 4, 8);
  tp2_make(r, "prefill-0", SX_KV_NHD, 4, 2, 4);
  /* Members in any order: tp1 first. */
  side rev[2] = {r[1], r[0]};
  sx_plan_info info = run_case(&l, rev, 2, RB, 4, LB, 4, 13);
  assert_int_equal(info.pieces, 2 * 4); /* per member, one piece per token */
  sides_free(&l, r, 2);
}

static void test_plan_tp1_to_tp2_reads_a_part_of_each_block(void **state) {
  (void)state;
  for (int order = SX_KV_NHD; order <= SX_KV_HND; order++) {
    for (uint32_t rank = 0; rank < 2; rank++) {
      side l, r;
      side_make(&l, "decode-0/tp", (sx_kv_order)order, 8, rank * 2, 2, 4, 8);
      side_tp(&l, rank, 2);
      side_make(&r, "prefill-0", (sx_kv_order)order, 8, 0, 4, 4, 8);
      sx_plan_info info = run_case(&l, &r, 1, RB, 3, LB, 3, 20);
      /* HND: one head slice; NHD: one piece per token. */
      assert_int_equal(info.pieces, order == SX_KV_HND ? 1 : 8);
      side_free(&l);
      side_free(&r);
    }
  }
}

static void test_plan_gqa_replicas_spread_over_local_ranks(void **state) {
  (void)state;
  /* Prefill TP=4 with 2 KV heads: ranks 0,1 hold head 0, ranks 2,3 head 1. */
  side r[4];
  for (uint32_t i = 0; i < 4; i++) {
    char name[32];
    snprintf(name, sizeof(name), "prefill-0/tp%u", i);
    side_make(&r[i], name, SX_KV_NHD, 4, i / 2, 1, 2, 8);
    side_tp(&r[i], i, 4);
  }
  for (uint32_t rank = 0; rank < 2; rank++) {
    side l;
    side_make(&l, "decode-0", SX_KV_NHD, 4, 0, 2, 2, 8);
    side_tp(&l, rank, 2);
    const sx_desc *rd[4] = {&r[0].d, &r[1].d, &r[2].d, &r[3].d};
    sx_plan *p;
    sxt_ok(sx_layout_plan(&l.d, rd, 4, 0, &p, NULL));
    /* Local rank 0 reads replicas 0 and 2, rank 1 replicas 1 and 3. */
    for (uint32_t q = 0; q < p->n_pieces; q++)
      assert_int_equal(p->pieces[q].member % 2, rank);
    sx_plan_free(p);
    sx_plan_info info = run_case(&l, r, 4, RB, 4, LB, 4, 15);
    assert_int_equal(info.used, 2);
    side_free(&l);
  }
  /* Decode TP=4 over the same heads: each reads its one head whole. */
  side l;
  side_make(&l, "decode-1/tp3", SX_KV_NHD, 4, 1, 1, 2, 8);
  side_tp(&l, 3, 4);
  sx_plan_info info = run_case(&l, r, 4, RB, 4, LB, 4, 15);
  assert_int_equal(info.pieces, 1);
  assert_int_equal(info.used, 1);
  side_free(&l);
  for (int i = 0; i < 4; i++)
    side_free(&r[i]);
}

static void test_plan_block_size_ratios_both_ways(void **state) {
  (void)state;
  for (int order = SX_KV_NHD; order <= SX_KV_HND; order++) {
    /* Remote 32 tokens per block, local 16. */
    side l, r;
    side_make(&l, "decode-0", (sx_kv_order)order, 16, 0, 2, 2, 8);
    side_make(&r, "prefill-0", (sx_kv_order)order, 32, 0, 2, 2, 8);
    run_case(&l, &r, 1, RB, 2, LB, 4, 53);
    side_free(&l);
    side_free(&r);
    /* Remote 8 tokens per block, local 32, a partial last block. */
    side_make(&l, "decode-0", (sx_kv_order)order, 32, 0, 2, 2, 8);
    side_make(&r, "prefill-0", (sx_kv_order)order, 8, 0, 2, 2, 8);
    uint64_t rb8[] = {3, 4, 5, 0, 1, 7, 6};
    run_case(&l, &r, 1, rb8, 7, LB, 2, 50);
    side_free(&l);
    side_free(&r);
  }
}

static void test_plan_nhd_into_hnd_and_back(void **state) {
  (void)state;
  side l, r;
  side_make(&l, "decode-0", SX_KV_HND, 4, 0, 2, 2, 8);
  side_make(&r, "prefill-0", SX_KV_NHD, 4, 0, 2, 2, 8);
  sx_plan_info info = run_case(&l, &r, 1, RB, 4, LB, 4, 13);
  assert_int_equal(info.pieces, 4 * 2); /* every (token, head) alone */
  side_free(&l);
  side_free(&r);
  side_make(&l, "decode-0", SX_KV_NHD, 8, 0, 2, 2, 8);
  side_make(&r, "prefill-0", SX_KV_HND, 4, 0, 2, 2, 8);
  run_case(&l, &r, 1, RB, 4, LB, 2, 15);
  side_free(&l);
  side_free(&r);
}

static void test_plan_everything_at_once(void **state) {
  (void)state;
  /* TP=2 HND blocks of 4 tokens into one NHD rank with blocks of 8 that
   * holds heads 1..2 of 4: both members, a ratio and an order change. */
  side l, r[2];
  side_make(&l, "decode-0", SX_KV_NHD, 8, 1, 2, 4, 8);
  side_tp(&l, 0, 1);
  tp2_make(r, "p", SX_KV_HND, 4, 2, 4);
  sx_plan_info info = run_case(&l, r, 2, RB, 4, LB, 2, 14);
  assert_int_equal(info.used, 2);
  sides_free(&l, r, 2);
}

static void test_plan_mla_reads_whole_latents(void **state) {
  (void)state;
  side l, r[2];
  side_make(&l, "decode-0", SX_KV_MLA, 16, 0, 1, 1, 8);
  side_tp(&l, 1, 2);
  tp2_make(r, "p", SX_KV_MLA, 32, 1, 1);
  sx_plan_info info = run_case(&l, r, 2, RB, 2, LB, 4, 60);
  assert_int_equal(info.pieces, 1);
  assert_int_equal(info.used, 1);
  sides_free(&l, r, 2);
}

/* A set split by pipeline stage (and by TP within each stage): each band
 * of layers is read from the stage holding it. */
static void test_plan_pipeline_stages(void **state) {
  (void)state;
  side l, r[4];
  side_make(&l, "decode-0", SX_KV_NHD, 4, 0, 4, 4, 8);
  side_make(&r[0], "p/pp0", SX_KV_NHD, 8, 0, 4, 4, 8);
  side_make(&r[1], "p/pp1", SX_KV_NHD, 8, 0, 4, 4, 8);
  side_stage(&r[0], 0, 2, 0, 2);
  side_stage(&r[1], 2, 1, 1, 2);
  sx_plan_info info = run_case(&l, r, 2, RB, 2, LB, 4, 15);
  assert_int_equal(info.used, 2);
  assert_int_equal(info.groups, 2);
  const sx_desc *rd[4] = {&r[0].d, &r[1].d};
  sx_plan *p;
  char *text;
  sxt_ok(sx_layout_plan(&l.d, rd, 2, 0, &p, NULL));
  sxt_ok(sx_plan_text(p, &text));
  if (!strstr(text, "group 0 (K,V, layers 0-1)") || !strstr(text, "group 0 (K,V, layers 2-2)"))
    fail_msg("plan text:\n%s", text);
  free(text);
  sx_plan_free(p);
  side_free(&r[0]);
  side_free(&r[1]);
  /* TP=2 x PP=2: four members, ranks repeating across the stages. */
  for (uint32_t i = 0; i < 4; i++) {
    char name[32];
    snprintf(name, sizeof(name), "p/pp%u/tp%u", i / 2, i % 2);
    side_make(&r[i], name, SX_KV_HND, 4, i % 2 * 2, 2, 4, 8);
    side_tp(&r[i], i % 2, 2);
    side_stage(&r[i], i < 2 ? 0 : 1, i < 2 ? 1 : 2, i / 2, 2);
  }
  info = run_case(&l, r, 4, RB, 4, LB, 4, 16);
  assert_int_equal(info.used, 4);
  /* The same rank twice in one stage is still refused. */
  r[3].d.layout.tp_rank = 0;
  const sx_desc *rd4[4] = {&r[0].d, &r[1].d, &r[2].d, &r[3].d};
  sx_mismatch m;
  sxt_rc(sx_layout_plan(&l.d, rd4, 4, 0, &p, &m), SX_EINCOMPAT);
  assert_int_equal(m.kind, SX_MISMATCH_TP);
  sides_free(&l, r, 4);
}

/* Layouts without descriptions plan as whole blocks, with the equal-layout
 * rules, and move the same bytes. */
static void test_plan_undescribed_layouts_read_whole_blocks(void **state) {
  (void)state;
  side l, r;
  side_make(&l, "decode-0", SX_KV_NHD, 4, 0, 2, 2, 8);
  side_make(&r, "prefill-0", SX_KV_NHD, 4, 0, 2, 2, 8);
  l.d.layout.n_blocks = r.d.layout.n_blocks = 0;
  sx_plan_info info = run_case(&l, &r, 1, RB, 4, LB, 4, 16);
  assert_int_equal(info.whole, 1);
  /* A tag or block size that differs is refused as the check refuses it. */
  const sx_desc *rd[1] = {&r.d};
  sx_plan *p;
  sx_mismatch m;
  strcpy(r.d.layout.tag, "HND");
  sxt_rc(sx_layout_plan(&l.d, rd, 1, 0, &p, &m), SX_EINCOMPAT);
  assert_int_equal(m.kind, SX_MISMATCH_LAYOUT_TAG);
  strcpy(r.d.layout.tag, "NHD");
  r.d.regions[1].block_bytes /= 2;
  r.d.regions[1].block_stride /= 2;
  sxt_rc(sx_layout_plan(&l.d, rd, 1, 0, &p, &m), SX_EINCOMPAT);
  assert_int_equal(m.kind, SX_MISMATCH_BLOCK_BYTES);
  assert_int_equal(m.slot, SX_SLOT_V);
  side_free(&l);
  side_free(&r);
}

/* ------------------------------------------------------------ refused */

static void expect_refusal(side *l, side *r, uint32_t n, sx_mismatch_kind kind,
                           const char *local, const char *remote, const char *words) {
  const sx_desc *rd[SX_PLAN_MAX_MEMBERS];
  for (uint32_t i = 0; i < n; i++)
    rd[i] = &r[i].d;
  sx_plan *p = (sx_plan *)0x1;
  sx_mismatch m;
  sxt_rc(sx_layout_plan(&l->d, rd, n, 0, &p, &m), SX_EINCOMPAT);
  assert_ptr_equal(p, (sx_plan *)0x1); /* untouched */
  if (m.kind != kind)
    fail_msg("kind %s, expected %s: %s", sx_mismatch_kind_name(m.kind),
             sx_mismatch_kind_name(kind), m.message);
  if (local)
    assert_string_equal(m.local, local);
  if (remote)
    assert_string_equal(m.remote, remote);
  if (strstr(m.message, words) == NULL)
    fail_msg("message '%s' lacks '%s'", m.message, words);
  assert_non_null(strstr(sx_errmsg(), words));
}

static void test_plan_refusals_name_the_first_misfit(void **state) {
  (void)state;
  side l, r[2];
  side_make(&l, "decode-0", SX_KV_NHD, 16, 0, 8, 8, 8);
  tp2_make(r, "prefill-0", SX_KV_HND, 16, 4, 8);
  sx_block_desc keep = r[1].d.layout.blocks[0];
  sx_block_desc *b = &r[1].d.layout.blocks[0];

  /* A rank that is not in the set: heads 4..7 have no holder. */
  expect_refusal(&l, r, 1, SX_MISMATCH_HEADS_MISSING, "4", "absent", "KV head 4");
  /* Overlapping, unequal ranges. */
  b->head_first = 2;
  expect_refusal(&l, r, 2, SX_MISMATCH_HEADS_OVERLAP, "0-3", "2-5", "overlap");
  *b = keep;
  b->heads_total = 16;
  expect_refusal(&l, r, 2, SX_MISMATCH_HEADS_TOTAL, "8", "16", "prefill-0/tp1");
  *b = keep;
  b->head_dim = 8;
  b->head_count = 2; /* keep block_bytes; the head_dim is what differs */
  expect_refusal(&l, r, 2, SX_MISMATCH_HEAD_DIM, "4", "8", "head_dim");
  *b = keep;
  strcpy(b->dtype, "int32"); /* same size, another type */
  expect_refusal(&l, r, 2, SX_MISMATCH_DTYPE, "fp32", "int32", "dtype");
  *b = keep;
  b->order = SX_KV_MLA;
  b->head_first = 0;
  b->head_count = b->heads_total = 4;
  expect_refusal(&l, r, 2, SX_MISMATCH_HEADS_TOTAL, NULL, NULL, "KV heads");
  b->heads_total = 8;
  b->head_count = 8;
  b->tokens = 8;
  expect_refusal(&l, r, 2, SX_MISMATCH_ORDER, "NHD", "MLA", "MLA");
  *b = keep;
  b->tokens = 24;
  expect_refusal(&l, r, 2, SX_MISMATCH_BLOCK_TOKENS, "16", "24", "integer ratio");
  b->tokens = 32;
  expect_refusal(&l, r, 2, SX_MISMATCH_BLOCK_TOKENS, "16", "32", "mixes");
  *b = keep;
  /* The set: a repeated rank, mixed sizes. */
  r[1].d.layout.tp_rank = 0;
  expect_refusal(&l, r, 2, SX_MISMATCH_TP, "0", "0", "appears twice");
  r[1].d.layout.tp_rank = 1;
  r[1].d.layout.tp_size = 4;
  expect_refusal(&l, r, 2, SX_MISMATCH_TP, "2", "4", "mixes tp sizes");
  r[1].d.layout.tp_size = 2;
  /* A member without a description, or one that leaves out a slot. */
  r[1].d.layout.n_blocks = 0;
  expect_refusal(&l, r, 2, SX_MISMATCH_BLOCK_DESC, "described", "not described",
                 "prefill-0/tp1 does not");
  r[1].d.layout.n_blocks = 1;
  b->slots = 1u << SX_SLOT_K;
  expect_refusal(&l, r, 2, SX_MISMATCH_BLOCK_DESC, NULL, NULL, "every slot");
  *b = keep;
  /* The reader without descriptions, against a set. */
  l.d.layout.n_blocks = 0;
  expect_refusal(&l, r, 2, SX_MISMATCH_BLOCK_DESC, "not described", "2", "a set of 2");
  l.d.layout.n_blocks = 1;
  /* A member lacking one of the reader's layers: its heads are missing
   * there; a layer no member holds is a missing key. */
  r[1].d.regions[1].layer_count = 2;
  r[1].d.regions[1].length -= r[1].d.regions[1].layer_stride;
  expect_refusal(&l, r, 2, SX_MISMATCH_HEADS_MISSING, "4", "absent",
                 "group 0 layers 2-2: no segment of the set holds KV head 4");
  r[0].d.regions[1].layer_count = 2;
  r[0].d.regions[1].length -= r[0].d.regions[1].layer_stride;
  expect_refusal(&l, r, 2, SX_MISMATCH_MISSING_KEY, "present", "absent",
                 "layer 2 slot V: local has it, no segment of the set does");
  r[0].d.regions[1].layer_count = LAYERS;
  r[0].d.regions[1].length += r[0].d.regions[1].layer_stride;
  r[1].d.regions[1].layer_count = LAYERS;
  /* Fingerprint. */
  strcpy(r[0].d.layout.fingerprint, "other-model");
  expect_refusal(&l, r, 2, SX_MISMATCH_FINGERPRINT, NULL, "other-model", "fingerprint");
  const sx_desc *rd[2] = {&r[0].d, &r[1].d};
  sx_plan *p;
  sxt_ok(sx_layout_plan(&l.d, rd, 2, SX_CHECK_IGNORE_FINGERPRINT, &p, NULL));
  sx_plan_free(p);
  sides_free(&l, r, 2);
}

static void test_plan_bad_arguments_and_limits(void **state) {
  (void)state;
  side l, r;
  side_make(&l, "decode-0", SX_KV_NHD, 16, 0, 8, 8, 8);
  side_make(&r, "prefill-0", SX_KV_NHD, 16, 0, 8, 8, 8);
  const sx_desc *rd[SX_PLAN_MAX_MEMBERS + 1];
  for (int i = 0; i <= SX_PLAN_MAX_MEMBERS; i++)
    rd[i] = &r.d;
  sx_plan *p;
  sxt_rc(sx_layout_plan(NULL, rd, 1, 0, &p, NULL), SX_EINVAL);
  sxt_rc(sx_layout_plan(&l.d, NULL, 1, 0, &p, NULL), SX_EINVAL);
  sxt_rc(sx_layout_plan(&l.d, rd, 0, 0, &p, NULL), SX_EINVAL);
  sxt_rc(sx_layout_plan(&l.d, rd, 1, 0, NULL, NULL), SX_EINVAL);
  sxt_rc(sx_layout_plan(&l.d, rd, SX_PLAN_MAX_MEMBERS + 1, 0, &p, NULL), SX_ELIMIT);
  const sx_desc *holes[2] = {&r.d, NULL};
  sxt_rc(sx_layout_plan(&l.d, holes, 2, 0, &p, NULL), SX_EINVAL);
  sxt_rc(sx_plan_info_get(NULL, NULL), SX_EINVAL);
  sxt_rc(sx_plan_text(NULL, NULL), SX_EINVAL);
  sx_plan_free(NULL);
  side_free(&l);
  side_free(&r);
  /* NHD into HND with nothing contiguous: 1024 tokens x 128 heads would be
   * 131072 pieces; refused, not allocated. */
  sx_desc a, c;
  sxt_desc_kv(&a, "decode-0", 1, 0, 1024ull * 128 * 2, 1, 0);
  sxt_desc_kv(&c, "prefill-0", 1, 0, 1024ull * 128 * 2, 1, 0);
  a.layout.n_blocks = c.layout.n_blocks = 1;
  a.layout.blocks[0] = (sx_block_desc){.order = SX_KV_HND, .tokens = 1024, .head_count = 128,
                                       .heads_total = 128, .head_dim = 1};
  strcpy(a.layout.blocks[0].dtype, "bf16");
  c.layout.blocks[0] = a.layout.blocks[0];
  c.layout.blocks[0].order = SX_KV_NHD;
  sxt_ok(sx_desc_validate(&a));
  sxt_ok(sx_desc_validate(&c));
  const sx_desc *cd[1] = {&c};
  sxt_rc(sx_layout_plan(&a, cd, 1, 0, &p, NULL), SX_ELIMIT);
  sx_desc_free(&a);
  sx_desc_free(&c);
}

/* A valid region may span nearly 2^32 layers (a stride of one byte): the
 * plan steps by regions, so this takes no time, and expansion of a short
 * request is bounded by the request. */
static void test_plan_huge_layer_counts_are_stepped_by_regions(void **state) {
  (void)state;
  sx_desc a;
  sxt_desc_base(&a, "odd/0");
  a.layout.n_blocks = 1;
  a.layout.blocks[0] = (sx_block_desc){.order = SX_KV_NHD, .tokens = 1, .head_count = 1,
                                       .heads_total = 1, .head_dim = 1};
  strcpy(a.layout.blocks[0].dtype, "int8");
  sx_region r;
  memset(&r, 0, sizeof(r));
  r.layer_count = 0xf0000000u;
  r.layer_stride = 1;
  r.block_bytes = r.block_stride = 1;
  r.num_blocks = 1;
  r.length = 0xf0000000u;
  r.addr = 0x100000;
  r.access = SX_ACCESS_REMOTE_READ;
  strcpy(r.location, "cpu");
  assert_int_equal(sx_desc_add_region(&a, &r), 0);
  sxt_ok(sx_desc_validate(&a));
  const sx_desc *rd[1] = {&a};
  sx_plan *p;
  sxt_ok(sx_layout_plan(&a, rd, 1, 0, &p, NULL));
  sx_plan_free(p);
  sx_desc_free(&a);
}

/* Many undescribed groups plan as many whole groups (one per group). */
static void test_plan_many_undescribed_groups(void **state) {
  (void)state;
  sx_desc a;
  sxt_desc_kv(&a, "decode-0", 2, 1, 4096, 8, 0);
  for (uint32_t i = 0; i < a.n_regions; i++)
    a.regions[i].group = i / 2 * 1000; /* 2 layers x K,V: groups 0 and 1000 */
  for (uint32_t i = 0; i < a.n_regions; i++)
    a.regions[i].layer_first = i % 2;
  sxt_ok(sx_desc_validate(&a));
  const sx_desc *rd[1] = {&a};
  sx_plan *p;
  sxt_ok(sx_layout_plan(&a, rd, 1, 0, &p, NULL));
  sx_plan_info info;
  sxt_ok(sx_plan_info_get(p, &info));
  assert_int_equal(info.whole, 1);
  assert_true(info.groups >= 2);
  sx_plan_free(p);
  sx_desc_free(&a);
}

static int count_range(void *arg, const sx__prun *r) {
  *(int *)arg += (int)r->n;
  return 0;
}

/* Stops the expansion at its first run. */
static int stop_range(void *arg, const sx__prun *r) {
  (void)r;
  ++*(int *)arg;
  return SX_ECANCELED;
}

static void test_plan_expand_checks_every_block_first(void **state) {
  (void)state;
  side l, r;
  side_make(&l, "decode-0", SX_KV_HND, 4, 0, 2, 2, 8);
  side_make(&r, "prefill-0", SX_KV_HND, 8, 0, 2, 2, 8);
  const sx_desc *rd[1] = {&r.d};
  sx_plan *p;
  sxt_ok(sx_layout_plan(&l.d, rd, 1, 0, &p, NULL));
  int n = 0;
  uint64_t bad_r[] = {1, 8}, bad_l[] = {0, 1, 2, 8}, ok_l[] = {0, 1, 2, 3};
  uint64_t huge[] = {UINT64_MAX};
  sxt_rc(sx__plan_expand(p, &l.d, rd, 1, bad_r, 2, ok_l, 4, count_range, &n), SX_EBOUNDS);
  sxt_rc(sx__plan_expand(p, &l.d, rd, 1, bad_r, 1, bad_l, 4, count_range, &n), 0);
  /* (one remote block covers two local ones: bad_l[3] is past the request) */
  n = 0;
  sxt_rc(sx__plan_expand(p, &l.d, rd, 1, bad_r, 2, bad_l, 4, count_range, &n), SX_EBOUNDS);
  sxt_rc(sx__plan_expand(p, &l.d, rd, 1, huge, 1, ok_l, 2, count_range, &n), SX_EBOUNDS);
  sxt_rc(sx__plan_expand(p, &l.d, rd, 1, bad_r, 1, huge, 1, count_range, &n), SX_EBOUNDS);
  assert_int_equal(n, 0); /* nothing emitted by a refused expansion */
  sxt_rc(sx__plan_expand(p, &l.d, rd, 2, bad_r, 1, ok_l, 2, count_range, &n), SX_EINVAL);
  sxt_rc(sx__plan_expand(p, &l.d, rd, 1, bad_r, 1, ok_l, 2, stop_range, &n), SX_ECANCELED);
  assert_int_equal(n, 1); /* fn's error stopped the expansion: not called again */
  /* A local region gone since planning. */
  sx_desc_remove_region(&l.d, 1);
  sxt_rc(sx__plan_expand(p, &l.d, rd, 1, bad_r, 1, ok_l, 2, count_range, &n), SX_ENOREGION);
  sx_plan_free(p);
  side_free(&l);
  side_free(&r);
}

static void test_plan_text_says_which_heads_come_from_where(void **state) {
  (void)state;
  side l, r[2];
  side_make(&l, "decode-0", SX_KV_HND, 16, 0, 8, 8, 8);
  tp2_make(r, "prefill-0", SX_KV_HND, 32, 4, 8);
  const sx_desc *rd[2] = {&r[0].d, &r[1].d};
  sx_plan *p;
  char *text;
  sxt_ok(sx_layout_plan(&l.d, rd, 2, 0, &p, NULL));
  sxt_ok(sx_plan_text(p, &text));
  if (strstr(text, "reads heads 4-7 (all it holds) of each block of prefill-0/tp1, 2 local "
                   "blocks per remote block of 32 tokens") == NULL ||
      strstr(text, "group 0 (K,V, layers 0-2): local blocks of 16 tokens, heads 0-7 of 8, "
                   "HND") == NULL)
    fail_msg("plan text:\n%s", text);
  free(text);
  sx_plan_free(p);
  sides_free(&l, r, 2);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_plan_equal_layouts_are_one_piece_per_block),
      cmocka_unit_test(test_plan_tp2_to_tp1_hnd_reads_head_slices),
      cmocka_unit_test(test_plan_tp2_to_tp1_nhd_reads_token_pieces),
      cmocka_unit_test(test_plan_tp1_to_tp2_reads_a_part_of_each_block),
      cmocka_unit_test(test_plan_gqa_replicas_spread_over_local_ranks),
      cmocka_unit_test(test_plan_block_size_ratios_both_ways),
      cmocka_unit_test(test_plan_nhd_into_hnd_and_back),
      cmocka_unit_test(test_plan_everything_at_once),
      cmocka_unit_test(test_plan_mla_reads_whole_latents),
      cmocka_unit_test(test_plan_pipeline_stages),
      cmocka_unit_test(test_plan_undescribed_layouts_read_whole_blocks),
      cmocka_unit_test(test_plan_refusals_name_the_first_misfit),
      cmocka_unit_test(test_plan_bad_arguments_and_limits),
      cmocka_unit_test(test_plan_many_undescribed_groups),
      cmocka_unit_test(test_plan_huge_layer_counts_are_stepped_by_regions),
      cmocka_unit_test(test_plan_expand_checks_every_block_first),
      cmocka_unit_test(test_plan_text_says_which_heads_come_from_where),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
