/* Fixtures for set reads: see kv_ranks.h. */
#include "kv_ranks.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mem/mem.h"

uint64_t block_elems(const rank *r) { return (uint64_t)r->tokens * r->count * HEAD_DIM; }

size_t rank_bytes(const rank *r) {
  return (size_t)LAYERS * BLOCKS * block_elems(r) * sizeof(float);
}

float code(uint32_t layer, uint32_t slot, uint32_t pos, uint32_t head, uint32_t e) {
  return (float)(((((layer * 2 + slot) * 256 + pos) * HEADS + head) * HEAD_DIM + e) + 1);
}

float *elem(const rank *r, uint32_t slot, uint32_t layer, uint64_t block, uint32_t t,
            uint32_t h, uint32_t e) {
  uint64_t hh = h - r->first, in = r->order == SX_KV_HND
                                       ? (hh * r->tokens + t) * HEAD_DIM + e
                                       : ((uint64_t)t * r->count + hh) * HEAD_DIM + e;
  return r->mem[slot] + ((uint64_t)layer * BLOCKS + block) * block_elems(r) + in;
}

void fill(rank *r, const uint64_t *table, uint32_t tokens) {
  for (uint32_t s = 0; s < 2; s++)
    for (uint32_t l = 0; l < LAYERS; l++)
      for (uint32_t p = 0; p < tokens; p++)
        for (uint32_t h = r->first; h < r->first + r->count; h++)
          for (uint32_t e = 0; e < HEAD_DIM; e++)
            *elem(r, s, l, table[p / r->tokens], p % r->tokens, h, e) = code(l, s, p, h, e);
}

void rank_start_at(rank *r, const char *url, const char *name, sx_kv_order order,
                   uint32_t tokens, uint32_t first, uint32_t count, uint32_t tp_rank,
                   uint32_t tp_size, uint32_t access, int device) {
  memset(r, 0, sizeof(*r));
  r->order = order;
  r->tokens = tokens;
  r->first = first;
  r->count = count;
  r->device = device;
  sx_agent_params p;
  sxt_params(&p, url, name);
  strcpy(p.layout.dtype, "fp32");
  p.transports = SX_TRANSPORTS_TCP;
  if (name)
    p.listen = "127.0.0.1:0";
  p.layout.tp_rank = tp_rank;
  p.layout.tp_size = tp_size;
  p.layout.n_blocks = 1;
  p.layout.blocks[0] = (sx_block_desc){.order = order, .tokens = tokens, .head_first = first,
                                       .head_count = count, .heads_total = HEADS,
                                       .head_dim = HEAD_DIM};
  strcpy(p.layout.blocks[0].dtype, "fp32");
  sxt_ok(sx_agent_create(&p, &r->a));
  uint64_t bb = block_elems(r) * sizeof(float);
  size_t len = rank_bytes(r);
  char where[16] = "cpu";
  if (device >= 0)
    snprintf(where, sizeof(where), "cuda:%d", device);
  for (uint32_t s = 0; s < 2; s++) {
    r->mem[s] = calloc(1, len);
    assert_non_null(r->mem[s]);
    void *addr = r->mem[s];
    if (device >= 0) {
      sxt_ok(sx__mem_alloc(device, len, &r->dev[s]));
      sxt_ok(sx__mem_copy(r->dev[s], r->mem[s], len));
      addr = r->dev[s];
    }
    sx_region_params rp = {.addr = addr, .length = len, .layer_count = LAYERS,
                           .layer_stride = BLOCKS * bb, .slot = s, .block_bytes = bb,
                           .num_blocks = BLOCKS, .location = where, .access = access};
    sxt_ok(sx_agent_register(r->a, &rp, &r->id[s]));
  }
  if (name)
    sxt_ok(sx_agent_publish(r->a, 0));
}

void rank_start(rank *r, const char *url, const char *name, sx_kv_order order,
                uint32_t tokens, uint32_t first, uint32_t count, uint32_t tp_rank,
                uint32_t tp_size, uint32_t access) {
  rank_start_at(r, url, name, order, tokens, first, count, tp_rank, tp_size, access, -1);
}

void rank_pull(rank *r) {
  for (int s = 0; s < 2 && r->device >= 0; s++)
    sxt_ok(sx__mem_copy(r->mem[s], r->dev[s], rank_bytes(r)));
}

void rank_stop(rank *r) {
  sx_agent_destroy(r->a);
  r->a = NULL;
  for (int s = 0; s < 2; s++) {
    free(r->mem[s]);
    if (r->dev[s] != NULL)
      sx__mem_free(r->dev[s]);
    r->mem[s] = NULL;
    r->dev[s] = NULL;
  }
}

sx_group *ranks_open(sx_agent *a, const char *engine, uint32_t tp_size) {
  sx_group_params gp;
  sx_group_params_init(&gp);
  gp.engine = engine;
  gp.tp_size = tp_size;
  sx_group *g;
  sx_mismatch m;
  sxt_ok(sx_group_open(a, &gp, &g, &m));
  assert_int_equal(m.kind, SX_MISMATCH_NONE);
  return g;
}

void expect_heads(rank *d, const uint64_t *lb, uint32_t tokens, unsigned heads) {
  rank_pull(d);
  rank ref = *d;
  for (int s = 0; s < 2; s++)
    assert_non_null(ref.mem[s] = calloc(1, rank_bytes(d)));
  fill(&ref, lb, tokens);
  for (uint32_t s = 0; s < 2; s++)
    for (uint32_t l = 0; l < LAYERS; l++)
      for (uint64_t b = 0; b < BLOCKS; b++)
        for (uint32_t t = 0; t < d->tokens; t++)
          for (uint32_t h = d->first; h < d->first + d->count; h++)
            for (uint32_t e = 0; e < HEAD_DIM; e++) {
              float want = heads >> h & 1 ? *elem(&ref, s, l, b, t, h, e) : 0.0f;
              if (*elem(d, s, l, b, t, h, e) != want)
                fail_msg("slot %u layer %u block %lu token %u head %u: %g, want %g", s, l,
                         (unsigned long)b, t, h, (double)*elem(d, s, l, b, t, h, e),
                         (double)want);
            }
  for (int s = 0; s < 2; s++)
    free(ref.mem[s]);
}

uint64_t take_read_notice(sx_agent *a, uint64_t tag) {
  sx_notice *n;
  sxt_ok(sx_agent_notice_next(a, 0, &n));
  assert_int_equal(n->kind, SX_NOTICE_READ);
  assert_int_equal(n->tag, tag);
  assert_true(n->n_ranges > 0);
  uint64_t sum = 0;
  for (uint32_t k = 0; k < n->n_ranges; k++)
    sum += n->ranges[k].length;
  assert_int_equal(sum, n->bytes);
  uint64_t bytes = n->bytes;
  sx_notice_free(n);
  sxt_rc(sx_agent_notice_next(a, 0, &n), SX_ETIMEDOUT);
  return bytes;
}
