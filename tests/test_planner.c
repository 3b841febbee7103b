/* The batch planner: mapping, merging, slicing, bounds, overflow, scale. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "planner.h"
#include "sxtest.h"
#ifdef SX_HAVE_CUDA
#include "fake_drv.h"
#include "mem/mem_int.h"
#endif

/* A remote descriptor (from the fixture) and a local side of registered
 * regions with the same keys, backed by real memory. */
typedef struct sides {
  sx_desc remote;
  sx_lregion *lregs;
  uint32_t n_local;
  uint8_t *mem;
  sx__rindex rix, lix;
} sides;

static void make_local(sides *s, uint32_t layers, int per_layer, uint64_t block_bytes,
                       uint64_t num_blocks, uint64_t stride_pad) {
  uint32_t n = per_layer ? 2 * layers : 2;
  uint64_t stride = block_bytes + stride_pad;
  uint64_t layer_bytes = stride * num_blocks;
  uint64_t per_region = per_layer ? layer_bytes : layer_bytes * layers;
  s->mem = calloc(n, per_region);
  assert_non_null(s->mem);
  s->lregs = calloc(n, sizeof(*s->lregs));
  s->n_local = n;
  const sx_region **v = malloc(n * sizeof(*v));
  for (uint32_t i = 0; i < n; i++) {
    sx_region *r = &s->lregs[i].r;
    r->id = 100 + i;
    r->slot = per_layer ? (i < layers ? SX_SLOT_K : SX_SLOT_V) : i;
    r->layer_first = per_layer ? i % layers : 0;
    r->layer_count = per_layer ? 1 : layers;
    r->layer_stride = per_layer ? 0 : layer_bytes;
    r->block_bytes = block_bytes;
    r->block_stride = stride;
    r->num_blocks = num_blocks;
    r->length = per_region;
    r->addr = (uint64_t)(uintptr_t)(s->mem + (uint64_t)i * per_region);
    r->access = SX_ACCESS_REMOTE_READ;
    v[i] = r;
  }
  sxt_ok(sx__rindex_build(&s->lix, v, n));
  free(v);
}

static void sides_init(sides *s, uint32_t layers, int remote_per_layer, int local_per_layer,
                       uint64_t block_bytes, uint64_t rblocks, uint64_t lblocks) {
  memset(s, 0, sizeof(*s));
  sxt_desc_kv(&s->remote, "prefill-0", layers, remote_per_layer, block_bytes, rblocks, 0);
  sxt_ok(sx__rindex_build_desc(&s->rix, &s->remote));
  make_local(s, layers, local_per_layer, block_bytes, lblocks, 0);
}

static void sides_free(sides *s) {
  sx__rindex_free(&s->rix);
  sx__rindex_free(&s->lix);
  sx_desc_free(&s->remote);
  free(s->lregs);
  free(s->mem);
}

static sx_block_read blk(uint32_t layer_first, uint32_t layer_count, uint64_t slots,
                         uint64_t rb, uint64_t lb, uint64_t count) {
  return (sx_block_read){.group = 0, .layer_first = layer_first,
                         .layer_count = layer_count, .slots = slots,
                         .remote_block = rb, .local_block = lb, .count = count};
}

#define KV ((1ull << SX_SLOT_K) | (1ull << SX_SLOT_V))

static void test_rindex_finds_by_key_id_and_addr(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 80, 1, 0, 4096, 16, 16);
  const sx_region *r = sx__rindex_key(&s.rix, 0, 17, SX_SLOT_V);
  assert_non_null(r);
  assert_int_equal(r->layer_first, 17);
  assert_int_equal(r->slot, SX_SLOT_V);
  assert_null(sx__rindex_key(&s.rix, 0, 80, SX_SLOT_K));
  assert_null(sx__rindex_key(&s.rix, 1, 0, SX_SLOT_K));
  assert_null(sx__rindex_key(&s.rix, 0, 0, 7));
  assert_ptr_equal(sx__rindex_id(&s.rix, 5), &s.remote.regions[5]);
  assert_null(sx__rindex_id(&s.rix, 1000));
  /* Local strided regions: layer 79 of V is in the second region. */
  r = sx__rindex_key(&s.lix, 0, 79, SX_SLOT_V);
  assert_non_null(r);
  assert_int_equal(r->id, 101);
  const sx_region *a = sx__rindex_addr(&s.lix, s.lregs[1].r.addr + 10, 100);
  assert_ptr_equal(a, &s.lregs[1].r);
  assert_null(sx__rindex_addr(&s.lix, s.lregs[1].r.addr + s.lregs[1].r.length - 10,
                              100));
  assert_null(sx__rindex_addr(&s.lix, 1, 1));
  sides_free(&s);
}

static void test_planner_merges_contiguous_blocks(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 4, 0, 0, 4096, 64, 64);
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 1 << 20, 0);
  /* One layer, one slot, 10 contiguous blocks: one range. */
  sx_block_read r = blk(2, 1, 1ull << SX_SLOT_K, 5, 7, 10);
  sxt_ok(sx__plan_add_blocks(&p, &r, 1));
  assert_int_equal(p.n, 1);
  const sx_region *R = &s.remote.regions[0];
  assert_ptr_equal(p.x[0].rreg, R);
  assert_int_equal(p.x[0].roff, 2 * R->layer_stride + 5 * 4096);
  assert_int_equal(p.x[0].length, 10 * 4096);
  assert_ptr_equal(p.x[0].local, (uint8_t *)(uintptr_t)(s.lregs[0].r.addr +
                                                         2 * s.lregs[0].r.layer_stride +
                                                         7 * 4096));
  assert_ptr_equal(p.x[0].lreg, &s.lregs[0]);
  assert_int_equal(p.x[0].status, 1);
  assert_int_equal(p.bytes, 10 * 4096);
  sx__plan_free(&p);
  sides_free(&s);
}

static void test_planner_merges_across_entries_of_one_shape(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 80, 0, 0, 4096, 256, 256);
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 1 << 20, 0);
  /* vLLM style: one entry per block, all layers, K and V; block ids
   * consecutive on both sides: each (layer, slot) becomes one range. */
  sx_block_read r[32];
  for (int i = 0; i < 32; i++)
    r[i] = blk(0, 80, KV, 100 + i, 10 + i, 1);
  sxt_ok(sx__plan_add_blocks(&p, r, 16));
  sxt_ok(sx__plan_add_blocks(&p, r + 16, 16)); /* also across add calls */
  assert_int_equal(p.n, 160);
  assert_int_equal(p.n_entries, 32);
  for (size_t i = 0; i < p.n; i++) {
    assert_int_equal(p.x[i].length, 32 * 4096);
    assert_int_equal(p.x[i].entry_first, 0);
    assert_int_equal(p.x[i].entry_last, 31);
  }
  /* A gap in the block ids starts new ranges. */
  sx_block_read gap = blk(0, 80, KV, 200, 50, 1);
  sxt_ok(sx__plan_add_blocks(&p, &gap, 1));
  assert_int_equal(p.n, 320);
  assert_int_equal(p.x[319].entry_first, 32);
  sx__plan_free(&p);
  sides_free(&s);
}

static void test_planner_no_merge_when_one_side_is_not_contiguous(void **state) {
  (void)state;
  sides s;
  memset(&s, 0, sizeof(s));
  sxt_desc_kv(&s.remote, "prefill-0", 2, 0, 4096, 64, 0);
  sxt_ok(sx__rindex_build_desc(&s.rix, &s.remote));
  make_local(&s, 2, 0, 4096, 64, 512); /* padded local blocks */
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 1 << 20, 0);
  sx_block_read r = blk(0, 1, 1ull << SX_SLOT_K, 0, 0, 8);
  sxt_ok(sx__plan_add_blocks(&p, &r, 1));
  assert_int_equal(p.n, 8);
  for (size_t i = 0; i < 8; i++) {
    assert_int_equal(p.x[i].length, 4096);
    assert_int_equal(p.x[i].roff, i * 4096);
    assert_ptr_equal(p.x[i].local,
                     (uint8_t *)(uintptr_t)(s.lregs[0].r.addr + i * (4096 + 512)));
  }
  sx__plan_free(&p);
  sides_free(&s);
}

static void test_planner_slices_large_ranges(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 1, 0, 0, 1 << 20, 16, 16);
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 256 << 10, 0);
  sx_block_read r = blk(0, 1, 1ull << SX_SLOT_K, 0, 0, 3); /* 3 MiB contiguous */
  sxt_ok(sx__plan_add_blocks(&p, &r, 1));
  assert_int_equal(p.n, 12);
  uint64_t off = 0;
  for (size_t i = 0; i < p.n; i++) {
    assert_int_equal(p.x[i].length, 256 << 10);
    assert_int_equal(p.x[i].roff, off);
    off += p.x[i].length;
  }
  /* Raw ranges are sliced as well, and merged with a contiguous previous one. */
  sx_range_read rr[2] = {
      {.local = s.mem + (3 << 20), .remote_region = 0, .offset = 3 << 20, .length = 100},
      {.local = s.mem + (3 << 20) + 100, .remote_region = 0, .offset = (3 << 20) + 100,
       .length = 600 << 10},
  };
  sxt_ok(sx__plan_add_ranges(&p, rr, 2));
  assert_int_equal(p.n, 15);
  assert_int_equal(p.x[12].length, 256 << 10);
  assert_int_equal(p.x[12].entry_first, 1);
  assert_int_equal(p.x[12].entry_last, 2);
  assert_int_equal(p.x[14].length, 100 + (600 << 10) - 2 * (256 << 10));
  sx__plan_free(&p);
  sides_free(&s);
}

/* Entries of one shape, each continuing the one before, fill a range up
 * to the slice size and go on in the next. */
static void test_planner_slices_ranges_merged_across_entries(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 1, 0, 0, 4096, 16, 16);
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 3 * 4096, 0);
  sx_block_read r[5];
  for (uint32_t i = 0; i < 5; i++)
    r[i] = blk(0, 1, 1ull << SX_SLOT_K, 2 * i, 2 * i, 2);
  sxt_ok(sx__plan_add_blocks(&p, r, 5));
  static const uint64_t blocks[] = {3, 3, 3, 1}, first[] = {0, 1, 3, 4}, last[] = {1, 2, 4, 4};
  assert_int_equal(p.n, 4);
  uint64_t off = 0;
  for (size_t i = 0; i < p.n; i++) {
    assert_int_equal(p.x[i].roff, off);
    assert_int_equal(p.x[i].length, blocks[i] * 4096);
    assert_int_equal(p.x[i].entry_first, first[i]);
    assert_int_equal(p.x[i].entry_last, last[i]);
    off += p.x[i].length;
  }
  assert_int_equal(p.bytes, 10 * 4096);
  sx__plan_free(&p);
  sides_free(&s);
}

/* Is every range's remote region in the plan's list (sx_op.rregs), each
 * listed once? */
static void assert_rregs_listed(const sx__plan *p) {
  for (uint32_t i = 0; i < p->n_rr; i++)
    for (uint32_t j = i + 1; j < p->n_rr; j++)
      assert_ptr_not_equal(p->rr[i], p->rr[j]);
  for (size_t i = 0; i < p->n; i++) {
    uint32_t j = 0;
    while (j < p->n_rr && p->rr[j] != p->x[i].rreg)
      j++;
    assert_true(j < p->n_rr);
  }
}

/* The plan lists the remote regions its ranges read (for transports that
 * set up per region), up to SX__OP_RREGS; past that it says it has no
 * list. */
static void test_planner_lists_remote_regions(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 8, 1, 0, 4096, 64, 64); /* remote: a region per layer and slot */
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 0, 0);
  sx_block_read r[40];
  for (uint32_t i = 0; i < 40; i++) /* layers 0-3, then 2-5: 12 regions */
    r[i] = blk(i < 20 ? 0 : 2, 4, KV, (i * 7) % 64, i, 1);
  sxt_ok(sx__plan_add_blocks(&p, r, 40));
  assert_int_equal(p.n_rr, 12);
  assert_false(p.rr_over);
  assert_rregs_listed(&p);
  /* Raw ranges of regions listed and not listed yet. */
  sx_range_read rr[2] = {{.local = s.mem, .remote_region = 0, .offset = 0, .length = 64},
                         {.local = s.mem, .remote_region = 15, .offset = 0, .length = 64}};
  sxt_ok(sx__plan_add_ranges(&p, rr, 2));
  assert_int_equal(p.n_rr, 13);
  assert_rregs_listed(&p);
  /* All 8 layers, K and V: 16 regions, the most listed. */
  sx_block_read all = blk(0, 8, KV, 0, 0, 1);
  sxt_ok(sx__plan_add_blocks(&p, &all, 1));
  assert_int_equal(p.n_rr, SX__OP_RREGS);
  assert_false(p.rr_over);
  assert_rregs_listed(&p);
  assert_int_equal(p.n_strided, 0);
  sx__plan_free(&p);
  sides_free(&s);
  /* 80 layers: more regions than listed. */
  sides_init(&s, 80, 1, 0, 4096, 64, 64);
  sx__plan_init(&p, &s.rix, &s.lix, 0, 0);
  sx_block_read many = blk(0, 80, KV, 3, 3, 1);
  sxt_ok(sx__plan_add_blocks(&p, &many, 1));
  assert_int_equal(p.n, 160);
  assert_true(p.rr_over);
  sx__plan_free(&p);
  sides_free(&s);
}

static void test_planner_rejects_out_of_range_blocks(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 4, 0, 0, 4096, 64, 32); /* local holds fewer blocks */
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 0, 0);
  sx_block_read r = blk(0, 4, KV, 60, 0, 4);
  sxt_ok(sx__plan_add_blocks(&p, &r, 1)); /* 60..63 is the remote's last block */
  size_t n = p.n;
  r.remote_block = 61;
  sxt_rc(sx__plan_add_blocks(&p, &r, 1), SX_EBOUNDS);
  assert_non_null(strstr(sx_errmsg(), "remote blocks"));
  r = blk(0, 4, KV, 0, 29, 4);
  sxt_rc(sx__plan_add_blocks(&p, &r, 1), SX_EBOUNDS);
  assert_non_null(strstr(sx_errmsg(), "local blocks"));
  /* Huge values that would wrap a naive remote_block + count. */
  r = blk(0, 1, KV, UINT64_MAX - 1, 0, 4);
  sxt_rc(sx__plan_add_blocks(&p, &r, 1), SX_EBOUNDS);
  r = blk(0, 1, KV, 0, 0, UINT64_MAX);
  sxt_rc(sx__plan_add_blocks(&p, &r, 1), SX_EBOUNDS);
  /* Nothing of the failed calls was added, and entries keep their numbers. */
  assert_int_equal(p.n, n);
  assert_int_equal(p.n_entries, 1);
  sx__plan_free(&p);
  sides_free(&s);
}

static void test_planner_call_is_all_or_nothing(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 4, 0, 0, 4096, 64, 64);
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 0, 0);
  sx_block_read r[3] = {blk(0, 4, KV, 0, 0, 1), blk(0, 4, KV, 1, 1, 1),
                        blk(0, 5, KV, 2, 2, 1)}; /* layer 4 does not exist */
  sxt_rc(sx__plan_add_blocks(&p, r, 3), SX_ENOREGION);
  assert_non_null(strstr(sx_errmsg(), "entry 2"));
  assert_int_equal(p.n, 0);
  assert_int_equal(p.n_entries, 0);
  assert_int_equal(p.bytes, 0);
  /* The good entries still plan, and merge with what follows. */
  sxt_ok(sx__plan_add_blocks(&p, r, 2));
  assert_int_equal(p.n, 8);
  sx__plan_free(&p);
  sides_free(&s);
}

/*
 * Entries of one shape are looked up once (the planner keeps the shape's
 * regions): each entry's block ids are still checked, so one bad entry
 * among many of its shape refuses the call by its number; and entries
 * whose shapes alternate each get their own regions and offsets.
 */
static void test_planner_shape_kept_but_every_entry_checked(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 4, 1, 0, 4096, 64, 32); /* remote: a region per layer */
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 0, 0);
  sx_block_read r[100];
  for (uint32_t i = 0; i < 100; i++)
    r[i] = blk(0, 4, KV, (i * 7) % 64, (i * 5) % 32, 1);
  r[57].local_block = 32;
  sxt_rc(sx__plan_add_blocks(&p, r, 100), SX_EBOUNDS);
  assert_non_null(strstr(sx_errmsg(), "entry 57"));
  assert_int_equal(p.n, 0);
  r[57].local_block = 31;
  r[58].remote_block = 64;
  sxt_rc(sx__plan_add_blocks(&p, r, 100), SX_EBOUNDS);
  assert_non_null(strstr(sx_errmsg(), "entry 58"));
  assert_int_equal(p.n_entries, 0);
  /* A count of 0, and blocks whose end wraps, amid entries of the shape. */
  r[58].remote_block = 63;
  r[59].count = 0;
  sxt_rc(sx__plan_add_blocks(&p, r, 100), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "entry 59"));
  r[59].count = 1;
  r[60].remote_block = UINT64_MAX;
  r[60].count = 2;
  sxt_rc(sx__plan_add_blocks(&p, r, 100), SX_EBOUNDS);
  assert_non_null(strstr(sx_errmsg(), "entry 60"));
  assert_int_equal(p.n, 0);
  /* Alternating shapes: (layers 0-3, K and V) and (layer 2, V). */
  for (uint32_t i = 0; i < 100; i++)
    r[i] = i % 2 ? blk(2, 1, 1ull << SX_SLOT_V, (i * 7) % 64, (i * 5) % 32, 1)
                 : blk(0, 4, KV, (i * 7) % 64, (i * 5) % 32, 1);
  sxt_ok(sx__plan_add_blocks(&p, r, 100));
  assert_int_equal(p.n, 50 * 8 + 50);
  size_t k = 0;
  for (uint32_t i = 0; i < 100; i++) {
    const sx_block_read *e = &r[i];
    for (uint64_t m = e->slots; m; m &= m - 1) {
      uint32_t slot = (uint32_t)__builtin_ctzll(m);
      for (uint32_t l = e->layer_first; l < e->layer_first + e->layer_count; l++, k++) {
        const sx_region *R = sx__rindex_key(&s.rix, 0, l, slot);
        const sx_region *L = sx__rindex_key(&s.lix, 0, l, slot);
        const sx_xfer *x = &p.x[k];
        assert_ptr_equal(x->rreg, R);
        assert_ptr_equal(x->lreg, (const sx_lregion *)L);
        assert_int_equal(x->roff, (l - R->layer_first) * R->layer_stride +
                                      e->remote_block * R->block_stride);
        assert_ptr_equal(x->local, (uint8_t *)(uintptr_t)(L->addr + (l - L->layer_first) *
                                   L->layer_stride + e->local_block * L->block_stride));
        assert_int_equal(x->length, 4096);
        assert_int_equal(x->entry_first, i);
      }
    }
  }
  sx__plan_free(&p);
  sides_free(&s);
}

/* A shape of more (slot, layer) positions than the planner keeps (2 x 2100
 * here) goes the long way, with the same checks and the same ranges. */
static void test_planner_shape_too_large_to_keep(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 2100, 0, 0, 64, 4, 4);
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 0, 0);
  sx_block_read r = blk(0, 2100, KV, 3, 4, 1);
  sxt_rc(sx__plan_add_blocks(&p, &r, 1), SX_EBOUNDS); /* local block 4 of 4 */
  assert_non_null(strstr(sx_errmsg(), "local blocks"));
  r.local_block = 2;
  sxt_ok(sx__plan_add_blocks(&p, &r, 1));
  assert_int_equal(p.n, 2 * 2100);
  size_t k = 0;
  for (uint64_t m = KV; m; m &= m - 1)
    for (uint32_t l = 0; l < 2100; l++, k++) {
      uint32_t slot = (uint32_t)__builtin_ctzll(m);
      const sx_region *R = sx__rindex_key(&s.rix, 0, l, slot);
      const sx_region *L = sx__rindex_key(&s.lix, 0, l, slot);
      assert_ptr_equal(p.x[k].rreg, R);
      assert_int_equal(p.x[k].roff, (l - R->layer_first) * R->layer_stride + 3 * R->block_stride);
      assert_ptr_equal(p.x[k].local, (uint8_t *)(uintptr_t)(L->addr + (l - L->layer_first) *
                                     L->layer_stride + 2 * L->block_stride));
      assert_int_equal(p.x[k].length, 64);
    }
  sx__plan_free(&p);
  sides_free(&s);
}

static void test_planner_rejects_missing_keys_denied_and_bad_entries(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 4, 0, 0, 4096, 64, 64);
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 0, 0);
  sx_block_read r = blk(0, 1, 1ull << SX_SLOT_INDEX, 0, 0, 1);
  sxt_rc(sx__plan_add_blocks(&p, &r, 1), SX_ENOREGION);
  r = blk(0, 0, KV, 0, 0, 1);
  sxt_rc(sx__plan_add_blocks(&p, &r, 1), SX_EINVAL);
  r = blk(0, 1, 0, 0, 0, 1);
  sxt_rc(sx__plan_add_blocks(&p, &r, 1), SX_EINVAL);
  r = blk(0, 1, KV, 0, 0, 0);
  sxt_rc(sx__plan_add_blocks(&p, &r, 1), SX_EINVAL);
  r = blk(UINT32_MAX, 2, KV, 0, 0, 1);
  sxt_rc(sx__plan_add_blocks(&p, &r, 1), SX_EOVERFLOW);
  /* A remote region without remote-read access. */
  s.remote.regions[1].access = 0;
  r = blk(0, 1, 1ull << SX_SLOT_V, 0, 0, 1);
  sxt_rc(sx__plan_add_blocks(&p, &r, 1), SX_EDENIED);
  sx_range_read rr = {.local = s.mem, .remote_region = 1, .offset = 0, .length = 8};
  sxt_rc(sx__plan_add_ranges(&p, &rr, 1), SX_EDENIED);
  /* Different block sizes on the two sides. */
  s.remote.regions[0].block_bytes = 2048;
  r = blk(0, 1, 1ull << SX_SLOT_K, 0, 0, 1);
  sxt_rc(sx__plan_add_blocks(&p, &r, 1), SX_EINCOMPAT);
  assert_int_equal(p.n, 0);
  sx__plan_free(&p);
  sides_free(&s);
}

static void test_planner_range_bounds_and_overflow(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 2, 0, 0, 4096, 16, 16);
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 0, 1 /* destinations must be registered */);
  uint64_t len = s.remote.regions[0].length;
  uint8_t *dst = (uint8_t *)(uintptr_t)s.lregs[0].r.addr;
  sx_range_read rr = {.local = dst, .remote_region = 0, .offset = 0, .length = len};
  sxt_ok(sx__plan_add_ranges(&p, &rr, 1));
  rr.offset = 1;
  sxt_rc(sx__plan_add_ranges(&p, &rr, 1), SX_EBOUNDS);
  rr = (sx_range_read){.local = dst, .remote_region = 0, .offset = UINT64_MAX - 10,
                       .length = 100};
  sxt_rc(sx__plan_add_ranges(&p, &rr, 1), SX_EOVERFLOW);
  rr = (sx_range_read){.local = dst, .remote_region = 99, .offset = 0, .length = 1};
  sxt_rc(sx__plan_add_ranges(&p, &rr, 1), SX_ENOREGION);
  rr = (sx_range_read){.local = (void *)(uintptr_t)(UINTPTR_MAX - 4), .remote_region = 0,
                       .offset = 0, .length = 100};
  sxt_rc(sx__plan_add_ranges(&p, &rr, 1), SX_EOVERFLOW);
  uint8_t unregistered[16];
  rr = (sx_range_read){.local = unregistered, .remote_region = 0, .offset = 0,
                       .length = sizeof(unregistered)};
  sxt_rc(sx__plan_add_ranges(&p, &rr, 1), SX_EINVAL);
  rr.length = 0;
  sxt_rc(sx__plan_add_ranges(&p, &rr, 1), SX_EINVAL);
  assert_int_equal(p.n_entries, 1);
  sx__plan_free(&p);
  sides_free(&s);
}

/* A run of one-range entries (a set read's): each range inside the remote
 * and the local region, hostile values included, the remote access
 * checked; entries before a bad one stay, numbered in order. */
static void test_planner_run_checks_each_range(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 2, 0, 0, 4096, 16, 16);
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 0, 0);
  const sx_region *R = &s.remote.regions[0];
  const sx_lregion *L = &s.lregs[0];
  uint64_t la = L->r.addr, rl = R->length, ll = L->r.length;
  uint64_t roff[3] = {0, 8192, rl - 4096}, loc[3] = {la, la + 4096, la + ll - 4096};
  uint64_t len[3] = {4096, 4096, 4096};
  sxt_ok(sx__plan_add_run(&p, R, L, roff, loc, len, 3));
  assert_int_equal(p.n_entries, 3);
  assert_int_equal(p.bytes, 3 * 4096);
  struct {
    uint64_t roff, local, len;
    int rc;
    const char *msg;
  } bad[] = {{rl - 4095, la, 4096, SX_EBOUNDS, "remote region"},
             {UINT64_MAX - 10, la, 4096, SX_EBOUNDS, "remote region"},
             {0, la, rl + 1, SX_EBOUNDS, "remote region"},
             {0, la, 0, SX_EINVAL, "length is 0"},
             {0, la + ll - 4095, 4096, SX_EBOUNDS, "local region"},
             {0, la - 1, 4096, SX_EBOUNDS, "local region"},
             {0, UINT64_MAX - 10, 4096, SX_EBOUNDS, "local region"}};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    uint64_t ro[2] = {0, bad[i].roff}, lo[2] = {la, bad[i].local}, ln[2] = {8, bad[i].len};
    uint32_t before = p.n_entries;
    sxt_rc(sx__plan_add_run(&p, R, L, ro, lo, ln, 2), bad[i].rc);
    assert_non_null(strstr(sx_errmsg(), bad[i].msg));
    assert_int_equal(p.n_entries, before + 1); /* the good one before it stays */
    char want[32];
    snprintf(want, sizeof(want), "entry %u", before + 1);
    assert_non_null(strstr(sx_errmsg(), want));
  }
  s.remote.regions[0].access = 0;
  sxt_rc(sx__plan_add_run(&p, R, L, roff, loc, len, 1), SX_EDENIED);
  sx__plan_free(&p);
  sides_free(&s);
}

static void test_planner_empty_batch(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 2, 0, 0, 4096, 16, 16);
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 0, 0);
  sxt_ok(sx__plan_add_blocks(&p, NULL, 0));
  sxt_ok(sx__plan_add_ranges(&p, NULL, 0));
  assert_int_equal(p.n, 0);
  assert_int_equal(p.n_entries, 0);
  sx__plan_free(&p);
  sides_free(&s);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* 1024 entries x 80 layers x 2 slots, per-layer remote regions (160) and
 * strided local ones: contiguous ids merge to 160 ranges (sliced), and
 * scattered ids give 163,840 ranges; both must plan fast. */
static void test_planner_huge_batch_is_fast(void **state) {
  (void)state;
  sides s;
  memset(&s, 0, sizeof(s));
  sxt_desc_kv(&s.remote, "prefill-0", 80, 1, 4096, 4096, 0);
  sxt_ok(sx__rindex_build_desc(&s.rix, &s.remote));
  make_local(&s, 80, 0, 4096, 2048, 0);
  sx_block_read *r = malloc(1024 * sizeof(*r));
  for (int i = 0; i < 1024; i++)
    r[i] = blk(0, 80, KV, (uint64_t)i, (uint64_t)i, 1);
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 1 << 20, 0);
  double t0 = now_s();
  sxt_ok(sx__plan_add_blocks(&p, r, 1024));
  double contiguous = now_s() - t0;
  /* 1024 blocks x 4 KiB = 4 MiB per (layer, slot), cut at 1 MiB. */
  assert_int_equal(p.n, 160 * 4);
  assert_int_equal(p.bytes, 1024ull * 160 * 4096);
  sx__plan_free(&p);

  for (int i = 0; i < 1024; i++)
    r[i] = blk(0, 80, KV, (uint64_t)(i * 3 % 4096), (uint64_t)(2047 - i), 1);
  sx__plan_init(&p, &s.rix, &s.lix, 1 << 20, 0);
  t0 = now_s();
  sxt_ok(sx__plan_add_blocks(&p, r, 1024));
  double scattered = now_s() - t0;
  assert_int_equal(p.n, 1024 * 160);
  print_message("planned 163840 block reads: contiguous %.2f ms, scattered %.2f ms\n",
                contiguous * 1e3, scattered * 1e3);
  /* Generous bounds (a shared 2-core machine, sanitizers): tens of ms
   * expected. */
  assert_true(contiguous < 2.0);
  assert_true(scattered < 4.0);
  sx__plan_free(&p);
  free(r);
  sides_free(&s);
}

/* The dense key table (planner.h) answers every key as the search does:
 * random layouts with gaps, several groups and slots, multi-layer regions
 * and overlaps, probed over their whole box and past its edges; a sparse
 * layout keeps to the search.  Each index is built from its regions alone,
 * so rebuilding for another layout leaves nothing of the old one. */
static void test_rindex_dense_table_matches_the_search(void **state) {
  (void)state;
  enum { MAXR = 48 };
  sx_region regs[MAXR];
  const sx_region *v[MAXR];
  uint32_t rng = 12345;
  int dense = 0, sparse = 0;
  for (int trial = 0; trial < 300; trial++) {
    rng = rng * 1103515245u + 12345u;
    int far = trial % 5 == 4; /* keys far apart: too sparse for a table */
    uint32_t n = (far ? 2 : 1) + (rng >> 8) % (MAXR - 1);
    for (uint32_t i = 0; i < n; i++) {
      rng = rng * 1103515245u + 12345u;
      uint32_t x = rng >> 4;
      memset(&regs[i], 0, sizeof(regs[i]));
      regs[i].id = i + 1;
      regs[i].group = far && i == 0 ? 1000000u : x % 3;
      regs[i].slot = (x >> 3) % 4 == 3 ? SX_MAX_SLOTS - 1 : (x >> 3) % 4;
      regs[i].layer_first = 2 + (x >> 6) % 30;
      regs[i].layer_count = 1 + (x >> 11) % 4;
      v[i] = &regs[i];
    }
    sx__rindex ix;
    sxt_ok(sx__rindex_build(&ix, v, n));
    if (ix.dense != NULL)
      dense++;
    else
      sparse++;
    if (far)
      assert_null(ix.dense);
    static const uint32_t groups[] = {0, 1, 2, 3, 999999u, 1000000u, UINT32_MAX};
    static const uint32_t slots[] = {0, 1, 2, 3, 4, SX_MAX_SLOTS - 1, SX_MAX_SLOTS};
    for (size_t g = 0; g < sizeof(groups) / sizeof(groups[0]); g++)
      for (size_t k = 0; k < sizeof(slots) / sizeof(slots[0]); k++)
        for (uint32_t l = 0; l < 40; l++) {
          uint32_t layer = l == 39 ? UINT32_MAX : l;
          const sx_region *want = sx__rindex_key_search(&ix, groups[g], layer, slots[k]);
          assert_ptr_equal(sx__rindex_key(&ix, groups[g], layer, slots[k]), want);
          /* The search itself: the region holds the key. */
          if (want != NULL) {
            assert_int_equal(want->group, groups[g]);
            assert_int_equal(want->slot, slots[k]);
            assert_true(layer >= want->layer_first &&
                        layer - want->layer_first < want->layer_count);
          }
        }
    sx__rindex_free(&ix);
    assert_null(ix.dense);
  }
  print_message("%d layouts with a dense table, %d without\n", dense, sparse);
  assert_true(dense >= 100 && sparse >= 60);
}

/* A scattered range: one entry, one range (never merged with the next),
 * its pieces all in one registered host region; anything else refused
 * with nothing added. */
static void test_planner_scatter_checks_its_pieces(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 2, 0, 0, 4096, 16, 16);
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 0, 0);
  const sx_region *R = sx__rindex_id(&s.rix, 0);
  uint8_t *l0 = (uint8_t *)(uintptr_t)s.lregs[0].r.addr;
  uint8_t *l1 = (uint8_t *)(uintptr_t)s.lregs[1].r.addr;
  /* Pieces in any order, of any length. */
  struct iovec ok[] = {{l0 + 8192, 1000}, {l0, 24}, {l0 + 100, 3}};
  sxt_ok(sx__plan_add_scatter(&p, R, 4096, ok, 3));
  assert_int_equal(p.n, 1);
  assert_int_equal(p.x[0].length, 1027);
  assert_int_equal(p.x[0].n_iov, 3);
  assert_ptr_equal(p.x[0].iov, ok);
  assert_ptr_equal(p.x[0].local, l0 + 8192);
  assert_ptr_equal(p.x[0].lreg, &s.lregs[0]);
  /* A range that continues it on both sides is a range of its own. */
  sx_range_read rr = {.local = l0 + 8192 + 1027, .remote_region = 0, .offset = 4096 + 1027,
                      .length = 5};
  sxt_ok(sx__plan_add_ranges(&p, &rr, 1));
  assert_int_equal(p.n, 2);
  assert_int_equal(p.bytes, 1032);
  struct iovec two[] = {{l0, 16}, {l1, 16}};
  sxt_rc(sx__plan_add_scatter(&p, R, 0, two, 2), SX_EINVAL);
  uint8_t unregistered[16];
  struct iovec stray[] = {{l0, 16}, {unregistered, 16}};
  sxt_rc(sx__plan_add_scatter(&p, R, 0, stray, 2), SX_EINVAL);
  struct iovec empty[] = {{l0, 16}, {l0 + 16, 0}};
  sxt_rc(sx__plan_add_scatter(&p, R, 0, empty, 2), SX_EINVAL);
  sxt_rc(sx__plan_add_scatter(&p, R, 0, ok, 0), SX_EINVAL);
  struct iovec huge[] = {{l0, (size_t)SX__SCATTER_MAX + 1}};
  sxt_rc(sx__plan_add_scatter(&p, R, 0, huge, 1), SX_ELIMIT);
  /* Past the end of the remote region. */
  sxt_rc(sx__plan_add_scatter(&p, R, R->length - 1000, ok, 3), SX_EBOUNDS);
  /* Device memory is not received into by the TCP reader. */
  s.lregs[0].mem.kind = SX__MEM_CUDA;
  sxt_rc(sx__plan_add_scatter(&p, R, 0, ok, 3), SX_ENOTSUP);
  assert_int_equal(p.n, 2);
  assert_int_equal(p.n_entries, 2);
  sx__plan_free(&p);
  sides_free(&s);
}

/* Strided pieces (read plans of token-major caches): one xfer where the
 * transport takes them, extended by a call that continues it at the same
 * strides up to the slice size; a contiguous run or a single piece is a
 * plain range. */
static void test_planner_strided_is_one_xfer_where_taken(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 2, 0, 0, 32768, 64, 64);
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 64 << 10, 0);
  p.strided = 1;
  const sx_region *R = sx__rindex_id(&s.rix, 0);
  const sx_lregion *L = &s.lregs[0];
  uint8_t *l0 = (uint8_t *)(uintptr_t)L->r.addr;
  /* Block 0's 16 pieces of 1 KiB: remote contiguous, local every 2 KiB. */
  sxt_ok(sx__plan_add_strided(&p, R, L, 0, 1024, l0 + 1024, 2048, 1024, 16));
  assert_int_equal(p.n, 1);
  assert_int_equal(p.x[0].shape, SX__XFER_STRIDED);
  assert_int_equal(p.x[0].n_iov, 16);
  assert_int_equal(p.x[0].length, 16384);
  assert_int_equal(p.x[0].st.lstride, 2048);
  assert_int_equal(p.x[0].st.rstride, 1024);
  assert_ptr_equal(p.x[0].local, l0 + 1024);
  assert_ptr_equal(p.x[0].lreg, L);
  /* Block 1 continues it on both sides: the same xfer, two entries. */
  sxt_ok(sx__plan_add_strided(&p, R, L, 16384, 1024, l0 + 1024 + 32768, 2048, 1024, 16));
  assert_int_equal(p.n, 1);
  assert_int_equal(p.x[0].n_iov, 32);
  assert_int_equal(p.x[0].entry_first, 0);
  assert_int_equal(p.x[0].entry_last, 1);
  /* Up to the slice (64 KiB): two more blocks fill it, a fifth starts anew. */
  for (uint64_t b = 2; b < 5; b++)
    sxt_ok(sx__plan_add_strided(&p, R, L, b * 16384, 1024, l0 + 1024 + b * 32768, 2048,
                                1024, 16));
  assert_int_equal(p.n, 2);
  assert_int_equal(p.x[0].n_iov, 64);
  assert_int_equal(p.x[1].n_iov, 16);
  assert_int_equal(p.x[1].entry_first, 4);
  /* Another stride does not continue it. */
  sxt_ok(sx__plan_add_strided(&p, R, L, 5 * 16384, 2048, l0 + 1024 + 5 * 32768, 2048, 1024,
                              8));
  assert_int_equal(p.n, 3);
  /* Contiguous on both sides, or a single piece: plain ranges. */
  sxt_ok(sx__plan_add_strided(&p, R, L, 1 << 20, 512, l0 + (1 << 20), 512, 512, 8));
  assert_int_equal(p.n, 4);
  assert_int_equal(p.x[3].shape, SX__XFER_RANGE);
  assert_int_equal(p.x[3].length, 4096);
  sxt_ok(sx__plan_add_strided(&p, R, L, 1 << 21, 9999, l0 + (1 << 21), 9999, 100, 1));
  assert_int_equal(p.n, 5);
  assert_int_equal(p.x[4].shape, SX__XFER_RANGE);
  assert_int_equal(p.x[4].length, 100);
  assert_int_equal(p.n_entries, 8);
  assert_int_equal(p.bytes, 5 * 16384 + 8 * 1024 + 4096 + 100);
  assert_int_equal(p.n_strided, 3); /* what a transport is told (sx_op.n_strided) */
  assert_int_equal(p.n_rr, 1);
  assert_ptr_equal(p.rr[0], R);
  sx__plan_free(&p);
  sides_free(&s);
}

/* Where the transport does not take them (TCP, RDMA) the same calls give
 * the plain ranges emit() makes: merged where contiguous, sliced. */
static void test_planner_strided_is_ranges_elsewhere(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 2, 0, 0, 32768, 64, 64);
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 4096, 0);
  const sx_region *R = sx__rindex_id(&s.rix, 0);
  const sx_lregion *L = &s.lregs[0];
  uint8_t *l0 = (uint8_t *)(uintptr_t)L->r.addr;
  sxt_ok(sx__plan_add_strided(&p, R, L, 0, 1024, l0 + 1024, 2048, 1024, 16));
  assert_int_equal(p.n, 16);
  for (size_t i = 0; i < 16; i++) {
    assert_int_equal(p.x[i].shape, SX__XFER_RANGE);
    assert_null(p.x[i].iov);
    assert_int_equal(p.x[i].roff, i * 1024);
    assert_ptr_equal(p.x[i].local, l0 + 1024 + i * 2048);
    assert_int_equal(p.x[i].length, 1024);
    assert_int_equal(p.x[i].entry_first, 0);
  }
  /* Contiguous pieces merge (into slices of 4 KiB), as block pieces do. */
  sxt_ok(sx__plan_add_strided(&p, R, L, 1 << 20, 1024, l0 + (1 << 20), 1024, 1024, 10));
  assert_int_equal(p.n, 19);
  assert_int_equal(p.x[16].length, 4096);
  assert_int_equal(p.x[18].length, 2048);
  assert_int_equal(p.x[18].entry_last, 1);
  assert_int_equal(p.n_entries, 2);
  assert_int_equal(p.bytes, 26 * 1024);
  sx__plan_free(&p);
  sides_free(&s);
}

/* Every piece is checked, first and last, without overflow; a refused
 * call adds nothing. */
static void test_planner_strided_checks_its_pieces(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 2, 0, 0, 4096, 16, 16);
  sx__plan p;
  sx__plan_init(&p, &s.rix, &s.lix, 0, 0);
  p.strided = 1;
  const sx_region *R = sx__rindex_id(&s.rix, 0);
  const sx_lregion *L = &s.lregs[0];
  uint8_t *l0 = (uint8_t *)(uintptr_t)L->r.addr;
  uint64_t rlen = R->length, llen = L->r.length;
  sxt_rc(sx__plan_add_strided(&p, R, L, 0, 1024, l0, 2048, 1024, 0), SX_EINVAL);
  sxt_rc(sx__plan_add_strided(&p, R, L, 0, 1024, l0, 2048, 0, 4), SX_EINVAL);
  sxt_rc(sx__plan_add_strided(&p, R, L, 0, 1024, NULL, 2048, 1024, 4), SX_EINVAL);
  sxt_rc(sx__plan_add_strided(&p, R, NULL, 0, 1024, l0, 2048, 1024, 4), SX_EINVAL);
  /* Overlapping pieces on either side. */
  sxt_rc(sx__plan_add_strided(&p, R, L, 0, 1024, l0, 1000, 1024, 4), SX_EINVAL);
  sxt_rc(sx__plan_add_strided(&p, R, L, 0, 0, l0, 2048, 1024, 4), SX_EINVAL);
  /* The last piece past the remote region, then past the local one; the
   * first in place each time. */
  sxt_rc(sx__plan_add_strided(&p, R, L, rlen - 4096, 2048, l0, 1024, 1024, 3), SX_EBOUNDS);
  sxt_rc(sx__plan_add_strided(&p, R, L, 0, 1024, l0 + llen - 4096, 2048, 1024, 3),
         SX_EBOUNDS);
  sxt_rc(sx__plan_add_strided(&p, R, L, 0, 1024, l0 - 1024, 2048, 1024, 2), SX_EBOUNDS);
  sxt_rc(sx__plan_add_strided(&p, R, L, rlen, 1024, l0, 2048, 1, 1), SX_EBOUNDS);
  /* Strides whose products wrap 64 bits. */
  sxt_rc(sx__plan_add_strided(&p, R, L, 0, UINT64_MAX / 2, l0, 2048, 1024, 3), SX_EOVERFLOW);
  sxt_rc(sx__plan_add_strided(&p, R, L, 0, 1024, l0, UINT64_MAX / 2, 1024, 3),
         SX_EOVERFLOW);
  sxt_rc(sx__plan_add_strided(&p, R, L, 0, 1ull << 33, l0, 1ull << 33, 1ull << 33,
                              UINT32_MAX), SX_EOVERFLOW);
  /* A region that allows no remote reads. */
  s.remote.regions[0].access = 0;
  sxt_rc(sx__plan_add_strided(&p, R, L, 0, 1024, l0, 2048, 1024, 2), SX_EDENIED);
  assert_int_equal(p.n, 0);
  assert_int_equal(p.n_entries, 0);
  assert_int_equal(p.bytes, 0);
  sx__plan_free(&p);
  sides_free(&s);
}

#ifdef SX_HAVE_CUDA
/* ------------------------------------------------------------ tables */

/* A driver table whose pinned memory is plain heap (or refused). */
static sx__cuda_drv fake;
static int host_alloc_fails;

static CUcontext alloc_ctx; /* current when the last pinned buffer was made */

static CUresult f_host_alloc(void **p, size_t len, unsigned flags) {
  (void)flags;
  if (host_alloc_fails)
    return CUDA_ERROR_OUT_OF_MEMORY;
  fake.CtxGetCurrent(&alloc_ctx);
  *p = aligned_alloc(64, len);
  return *p != NULL ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult f_free_host(void *p) {
  free(p);
  return CUDA_SUCCESS;
}

static int use_fake(void **state) {
  (void)state;
  sxt_fake_drv_base(&fake, 2);
  fake.MemHostAlloc = f_host_alloc;
  fake.MemFreeHost = f_free_host;
  sx__mem_cuda_use(&fake);
  host_alloc_fails = 0;
  return 0;
}

static int use_real(void **state) {
  (void)state;
  sx__mem_cuda_use(NULL);
  return 0;
}

/* Local regions in GPU memory of device (as the agent's registration
 * would say; the planner only reads it). */
static void on_device(sides *s, int device) {
  for (uint32_t i = 0; i < s->n_local; i++)
    s->lregs[i].mem = (sx__mem_info){.kind = SX__MEM_CUDA, .device = device};
}

/* 64 entries over both slots of 2 layers: runs of 1-3 blocks at random
 * remote places, with pairs that continue each other (merged). */
static void table_entries(sx_block_read *r, size_t n, uint64_t rblocks) {
  uint32_t rng = 7;
  for (size_t i = 0; i < n; i++) {
    rng = rng * 1103515245u + 12345u;
    uint64_t count = 1 + i % 3;
    uint64_t rb = (rng >> 8) % (rblocks - 8);
    if (i % 5 == 1) /* continues the entry before on both sides */
      rb = r[i - 1].remote_block + r[i - 1].count;
    r[i] = blk(0, 2, KV, rb, i * 3, count);
  }
}

/* A plan over s that plans tables from min ranges on. */
static void plan_tables(sx__plan *p, sides *s, uint32_t min) {
  sx__plan_init(p, &s->rix, &s->lix, 0, 0);
  sx__plan_tables(p, min);
}

/* The sides most table tests use (2 layers, K and V per layer, 4 KiB
 * blocks, destinations on device) and their 64 entries. */
static void table_setup(sides *s, int device, sx_block_read r[64]) {
  sides_init(s, 2, 1, 1, 4096, 256, 256);
  on_device(s, device);
  table_entries(r, 64, 256);
}

/* Plan a has the same ranges as plan b, in order (after untable). */
static void same_ranges(const sx__plan *a, const sx__plan *b) {
  assert_int_equal(a->n, b->n);
  assert_true(a->bytes == b->bytes);
  for (size_t k = 0; k < a->n; k++) {
    const sx_xfer *x = &a->x[k], *y = &b->x[k];
    assert_ptr_equal(x->local, y->local);
    assert_ptr_equal(x->lreg, y->lreg);
    assert_ptr_equal(x->rreg, y->rreg);
    assert_true(x->roff == y->roff && x->length == y->length);
    assert_int_equal(x->entry_first, y->entry_first);
    assert_int_equal(x->entry_last, y->entry_last);
    assert_int_equal(x->status, 1);
  }
}

/* Table a's pieces are plan b's ranges, in order (sources as offsets in
 * a.rr[region]). */
static void same_pieces(const sx__plan *a, const sx__plan *b) {
  assert_int_equal(a->n_tab, b->n);
  assert_true(a->bytes == b->bytes);
  for (size_t k = 0; k < a->n_tab; k++) {
    const sx__mem_bpiece *q = &a->tab[k];
    const sx_xfer *y = &b->x[k];
    assert_true(q->dst == (uint64_t)(uintptr_t)y->local && q->src == y->roff &&
                q->len == y->length);
    assert_true(q->region < a->n_rr);
    assert_ptr_equal(a->rr[q->region], y->rreg);
    assert_int_equal(q->entry_first, y->entry_first);
    assert_int_equal(q->entry_last, y->entry_last);
  }
}

/* Block entries into GPU memory of one device plan into a table whose
 * pieces are the ranges a plan without tables makes (sources as offsets
 * in rr[region]); untable turns them into exactly those ranges, and
 * planning goes on as ranges. */
static void test_planner_table_is_the_ranges(void **state) {
  (void)state;
  sides s;
  sx_block_read r[64];
  table_setup(&s, 0, r);
  sx__plan a, b;
  plan_tables(&a, &s, 1);
  sx__plan_init(&b, &s.rix, &s.lix, 0, 0);
  sxt_ok(sx__plan_add_blocks(&a, r, 32));
  sxt_ok(sx__plan_add_blocks(&a, r + 32, 32)); /* merges across calls too */
  sxt_ok(sx__plan_add_blocks(&b, r, 32));
  sxt_ok(sx__plan_add_blocks(&b, r + 32, 32));
  assert_int_equal(a.tables, 1);
  assert_int_equal(a.n, 0);
  assert_int_equal(a.tab_device, 0);
  assert_int_equal(a.n_tab, b.n);
  assert_true(b.n < 64 * 4); /* some merged */
  assert_true(a.bytes == b.bytes);
  assert_int_equal(a.n_rr, 4);
  same_pieces(&a, &b);
  sxt_ok(sx__plan_untable(&a));
  assert_int_equal(a.tables, 0);
  assert_null(a.tab);
  same_ranges(&a, &b);
  /* Ranges from now on, and still the same. */
  sx_block_read more[8];
  table_entries(more, 8, 256);
  for (int i = 0; i < 8; i++)
    more[i].local_block = 200 + (uint64_t)i * 3;
  sxt_ok(sx__plan_add_blocks(&a, more, 8));
  sxt_ok(sx__plan_add_blocks(&b, more, 8));
  same_ranges(&a, &b);
  sx__plan_free(&a);
  sx__plan_free(&b);
  sides_free(&s);
}

/* Entries of one (slot, layer) each, an engine's per-tensor entries
 * (the planner's one-position loop): runs of 1-3 blocks, some continuing
 * the entry before (merged), runs of one tensor then the next, past the
 * table's first room.  The table is what a plan of ranges makes; also
 * where a gap follows each local block (the general loop, nothing
 * merges).  Blocks longer than a piece (the general loop) are cut at the
 * piece size and cover the same bytes. */
static void test_planner_table_one_position_is_the_ranges(void **state) {
  (void)state;
  for (int c = 0; c < 3; c++) {
    const uint64_t bb = c == 2 ? SX__GATHER_PIECE + 4096 : 4096;
    sides s;
    memset(&s, 0, sizeof(s));
    sxt_desc_kv(&s.remote, "prefill-0", 2, 1, bb, 256, 0);
    sxt_ok(sx__rindex_build_desc(&s.rix, &s.remote));
    make_local(&s, 2, 1, bb, 1024, c == 1 ? 64 : 0);
    on_device(&s, 0);
    sx_block_read r[300];
    uint32_t rng = 11;
    uint64_t blocks = 0;
    for (size_t i = 0; i < 300; i++) {
      rng = rng * 1103515245u + 12345u;
      uint64_t count = 1 + i % 3;
      uint64_t rb = (rng >> 8) % (256 - 8);
      uint32_t layer = (uint32_t)(i / 100) % 2; /* runs of 100 of one tensor */
      uint64_t slot = i / 200 ? 1ull << SX_SLOT_V : 1ull << SX_SLOT_K;
      if (i % 5 == 1 && i % 100 != 0)
        rb = r[i - 1].remote_block + r[i - 1].count;
      r[i] = blk(layer, 1, slot, rb, i * 3, count);
      blocks += count;
    }
    sx__plan a, b;
    plan_tables(&a, &s, 1);
    sx__plan_init(&b, &s.rix, &s.lix, 0, 0);
    sxt_ok(sx__plan_add_blocks(&a, r, 150));
    sxt_ok(sx__plan_add_blocks(&a, r + 150, 150));
    sxt_ok(sx__plan_add_blocks(&b, r, 150));
    sxt_ok(sx__plan_add_blocks(&b, r + 150, 150));
    assert_int_equal(a.tables, 1);
    assert_int_equal(a.n, 0);
    assert_true(a.bytes == blocks * bb && b.bytes == a.bytes);
    if (c < 2) {
      assert_true(c == 0 ? b.n < 300 : b.n == blocks); /* merged; or each block alone */
      same_pieces(&a, &b);
    } else {
      uint64_t sum = 0;
      for (size_t k = 0; k < a.n_tab; k++) {
        assert_true(a.tab[k].len <= SX__GATHER_PIECE);
        sum += a.tab[k].len;
      }
      assert_true(sum == a.bytes && a.n_tab > blocks);
    }
    sx__plan_free(&a);
    sx__plan_free(&b);
    sides_free(&s);
  }
}

/* A batch whose first block entries make fewer ranges than the minimum
 * goes as ranges; at the minimum, a table. */
static void test_planner_table_only_from_min_ranges(void **state) {
  (void)state;
  sides s;
  sx_block_read r[64];
  table_setup(&s, 0, r);
  sx__plan a;
  plan_tables(&a, &s, 256);
  sxt_ok(sx__plan_add_blocks(&a, r, 63)); /* 252 ranges */
  assert_int_equal(a.tables, 0);
  assert_null(a.tab);
  assert_true(a.n > 0);
  sx__plan_free(&a);
  plan_tables(&a, &s, 256);
  sxt_ok(sx__plan_add_blocks(&a, r, 64)); /* 256 */
  assert_int_equal(a.tables, 1);
  assert_true(a.n_tab > 0);
  assert_int_equal(a.n, 0);
  sx__plan_free(&a);
  sides_free(&s);
}

/* A batch that would need a table of more than SX__PLAN_TABLE_MAX goes as
 * ranges (which grow in ordinary memory), the same ones. */
static void test_planner_table_has_a_size_limit(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 1, 0, 0, 64, 1u << 20, 256);
  on_device(&s, 0);
  size_t n = SX__PLAN_TABLE_MAX / sizeof(sx__mem_bpiece) + 1;
  sx_block_read *r = malloc(n * sizeof(*r));
  assert_non_null(r);
  uint32_t rng = 3;
  for (size_t i = 0; i < n; i++) {
    rng = rng * 1103515245u + 12345u;
    r[i] = blk(0, 1, 1, (rng >> 4) % (1u << 20), i % 256, 1);
  }
  sx__plan a, b;
  plan_tables(&a, &s, 1);
  sx__plan_init(&b, &s.rix, &s.lix, 0, 0);
  sxt_ok(sx__plan_add_blocks(&a, r, n));
  sxt_ok(sx__plan_add_blocks(&b, r, n));
  assert_int_equal(a.tables, 0);
  same_ranges(&a, &b);
  sx__plan_free(&a);
  sx__plan_free(&b);
  free(r);
  sides_free(&s);
}

/* The pool keeps what is put back up to SX__PINNED_KEEP_BYTES in all,
 * and frees the rest. */
static void test_planner_pinned_pool_is_bounded(void **state) {
  (void)state;
  enum { N = 6 };
  void *p[N];
  size_t cap[N];
  for (int i = 0; i < N; i++)
    sxt_ok(sx__mem_pinned_get(0, 16u << 20, &p[i], &cap[i]));
  for (int i = 0; i < N; i++)
    sx__mem_pinned_put(p[i], cap[i]);
  size_t kept = sx__mem_pinned_kept();
  print_message("the pool keeps %zu bytes after 6 x 16 MiB came back\n", kept);
  assert_true(kept <= SX__PINNED_KEEP_BYTES);
  assert_true(kept + (16u << 20) > SX__PINNED_KEEP_BYTES);
  /* What it kept is handed out again. */
  for (int i = 0; i < N; i++)
    sxt_ok(sx__mem_pinned_get(0, 16u << 20, &p[i], &cap[i]));
  for (int i = 0; i < N; i++)
    sx__mem_pinned_put(p[i], cap[i]);
  sx__mem_pinned_drain();
  assert_int_equal(sx__mem_pinned_kept(), 0);
}

/* A table planned on an engine's thread (its CUDA runtime on device 1)
 * gets its pinned memory under device 1's context, the table's, and the
 * thread's own context is current again after; no other device's context
 * is made current. */
static void test_planner_table_keeps_the_threads_context(void **state) {
  (void)state;
  sides s;
  sx_block_read r[64];
  table_setup(&s, 1, r);
  sx__mem_pinned_drain(); /* the table's buffer is a new one */
  CUcontext mine = (CUcontext)(uintptr_t)0x4242, now = NULL, dev1 = NULL;
  fake.DevicePrimaryCtxRetain(&dev1, 1);
  fake.CtxSetCurrent(mine);
  alloc_ctx = NULL;
  sx__plan a;
  plan_tables(&a, &s, 1);
  sxt_ok(sx__plan_add_blocks(&a, r, 64));
  assert_int_equal(a.tables, 1);
  assert_ptr_equal(alloc_ctx, dev1);
  fake.CtxGetCurrent(&now);
  assert_ptr_equal(now, mine);
  /* No context at all before: none after. */
  sx__plan_free(&a);
  sx__mem_pinned_drain();
  fake.CtxSetCurrent(NULL);
  plan_tables(&a, &s, 1);
  sxt_ok(sx__plan_add_blocks(&a, r, 64));
  fake.CtxGetCurrent(&now);
  assert_null(now);
  sx__plan_free(&a);
  sides_free(&s);
}

/* A table takes runs of at most 64 KiB: a longer one is cut. */
static void test_planner_table_cuts_long_runs(void **state) {
  (void)state;
  sides s;
  sides_init(&s, 1, 0, 0, 16384, 64, 64);
  on_device(&s, 1);
  sx__plan a;
  plan_tables(&a, &s, 1);
  sx_block_read r = blk(0, 1, 1, 3, 0, 9); /* 144 KiB of slot 0 */
  sxt_ok(sx__plan_add_blocks(&a, &r, 1));
  assert_int_equal(a.tables, 1);
  assert_int_equal(a.tab_device, 1);
  assert_int_equal(a.n_tab, 3);
  assert_int_equal(a.tab[0].len, 65536);
  assert_int_equal(a.tab[1].len, 65536);
  assert_int_equal(a.tab[2].len, 16384);
  assert_true(a.tab[1].src == a.tab[0].src + 65536 && a.tab[1].dst == a.tab[0].dst + 65536);
  sx__plan_free(&a);
  sides_free(&s);
}

/* What a table cannot take: the batch becomes the ranges a plan without
 * tables makes, whichever entry brought it. */
static void table_refused(sides *s, const sx_block_read *r, size_t n, int ranges_after) {
  sx__plan a, b;
  plan_tables(&a, s, 1);
  sx__plan_init(&b, &s->rix, &s->lix, 0, 0);
  sxt_ok(sx__plan_add_blocks(&a, r, n));
  sxt_ok(sx__plan_add_blocks(&b, r, n));
  if (ranges_after) {
    sx_range_read rr = {.local = (uint8_t *)(uintptr_t)s->lregs[0].r.addr + 255 * 4096,
                        .remote_region = s->remote.regions[0].id, .offset = 8, .length = 100};
    sxt_ok(sx__plan_add_ranges(&a, &rr, 1));
    sxt_ok(sx__plan_add_ranges(&b, &rr, 1));
  }
  assert_int_equal(a.tables, 0);
  assert_null(a.tab);
  same_ranges(&a, &b);
  sx__plan_free(&a);
  sx__plan_free(&b);
}

static void test_planner_table_refuses_what_it_cannot_take(void **state) {
  (void)state;
  sx_block_read r[64];
  table_entries(r, 64, 256);
  sides s;
  sides_init(&s, 2, 1, 1, 4096, 256, 256);
  /* Host memory, then a second device for V, then a range entry. */
  table_refused(&s, r, 64, 0);
  on_device(&s, 0);
  s.lregs[2].mem.device = 1;
  s.lregs[3].mem.device = 1;
  table_refused(&s, r, 64, 0);
  on_device(&s, 0);
  table_refused(&s, r, 64, 1);
  sides_free(&s);
  /* No pinned memory to be had (and none kept by the pool from the tests
   * before, which it would hand out again without an allocation). */
  sx__mem_pinned_drain();
  assert_int_equal(sx__mem_pinned_kept(), 0);
  sides_init(&s, 2, 1, 1, 4096, 256, 2048);
  on_device(&s, 0);
  sx_block_read *big = malloc(600 * sizeof(*big));
  assert_non_null(big);
  table_entries(big, 600, 256);
  host_alloc_fails = 1;
  table_refused(&s, big, 600, 0);
  host_alloc_fails = 0;
  free(big);
  sides_free(&s);
  /* 18 remote regions (9 layers, K and V each their own): more than a
   * table's 16 bases. */
  sides_init(&s, 9, 1, 0, 4096, 256, 256);
  on_device(&s, 0);
  sx_block_read all = blk(0, 9, KV, 5, 0, 2);
  table_refused(&s, &all, 1, 0);
  sides_free(&s);
}
#endif

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rindex_finds_by_key_id_and_addr),
      cmocka_unit_test(test_rindex_dense_table_matches_the_search),
      cmocka_unit_test(test_planner_merges_contiguous_blocks),
      cmocka_unit_test(test_planner_merges_across_entries_of_one_shape),
      cmocka_unit_test(test_planner_no_merge_when_one_side_is_not_contiguous),
      cmocka_unit_test(test_planner_slices_large_ranges),
      cmocka_unit_test(test_planner_slices_ranges_merged_across_entries),
      cmocka_unit_test(test_planner_lists_remote_regions),
      cmocka_unit_test(test_planner_rejects_out_of_range_blocks),
      cmocka_unit_test(test_planner_call_is_all_or_nothing),
      cmocka_unit_test(test_planner_shape_kept_but_every_entry_checked),
      cmocka_unit_test(test_planner_shape_too_large_to_keep),
      cmocka_unit_test(test_planner_run_checks_each_range),
      cmocka_unit_test(test_planner_rejects_missing_keys_denied_and_bad_entries),
      cmocka_unit_test(test_planner_range_bounds_and_overflow),
      cmocka_unit_test(test_planner_empty_batch),
      cmocka_unit_test(test_planner_scatter_checks_its_pieces),
      cmocka_unit_test(test_planner_strided_is_one_xfer_where_taken),
      cmocka_unit_test(test_planner_strided_is_ranges_elsewhere),
      cmocka_unit_test(test_planner_strided_checks_its_pieces),
      cmocka_unit_test(test_planner_huge_batch_is_fast),
#ifdef SX_HAVE_CUDA
      cmocka_unit_test_setup_teardown(test_planner_table_is_the_ranges, use_fake, use_real),
      cmocka_unit_test_setup_teardown(test_planner_table_cuts_long_runs, use_fake, use_real),
      cmocka_unit_test_setup_teardown(test_planner_table_one_position_is_the_ranges, use_fake,
                                      use_real),
      cmocka_unit_test_setup_teardown(test_planner_table_only_from_min_ranges, use_fake,
                                      use_real),
      cmocka_unit_test_setup_teardown(test_planner_table_has_a_size_limit, use_fake, use_real),
      cmocka_unit_test_setup_teardown(test_planner_table_keeps_the_threads_context, use_fake,
                                      use_real),
      cmocka_unit_test_setup_teardown(test_planner_pinned_pool_is_bounded, use_fake, use_real),
      cmocka_unit_test_setup_teardown(test_planner_table_refuses_what_it_cannot_take, use_fake,
                                      use_real),
#endif
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
