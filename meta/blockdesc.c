/*
 * Block descriptions (segxfer/descriptor.h sx_block_desc): what a block of a
 * group is, in tokens, heads and element order.  The rules here run on every
 * descriptor decoded, so a store that hands out a description whose numbers
 * do not multiply to the regions' block_bytes, or whose heads leave the
 * model's, is refused before a plan could cut a block by them.
 */
#include <string.h>

#include "internal.h"
#include "segxfer/descriptor.h"

uint32_t sx_dtype_bytes(const char *dtype) {
  static const struct {
    const char *name;
    uint32_t bytes;
  } t[] = {
      {"fp64", 8},     {"fp32", 4},     {"fp16", 2},  {"bf16", 2},   {"fp8_e4m3", 1},
      {"fp8_e5m2", 1}, {"fp8", 1},      {"int8", 1},  {"uint8", 1},  {"int16", 2},
      {"int32", 4},    {"int64", 8},    {"uint16", 2}, {"uint32", 4}, {"uint64", 8},
  };
  if (dtype == NULL)
    return 0;
  for (size_t i = 0; i < SX__ARRAY_SIZE(t); i++)
    if (strcmp(t[i].name, dtype) == 0)
      return t[i].bytes;
  return 0;
}

const char *sx_kv_order_name(sx_kv_order o) {
  switch (o) {
  case SX_KV_NONE:
    return "none";
  case SX_KV_NHD:
    return "NHD";
  case SX_KV_HND:
    return "HND";
  case SX_KV_MLA:
    return "MLA";
  }
  return "unknown";
}

/* The slots a description covers: 0 means K and V. */
uint64_t sx__block_slots(const sx_block_desc *b) {
  return b->slots ? b->slots : (1ull << SX_SLOT_K | 1ull << SX_SLOT_V);
}

int sx__block_bytes(const sx_block_desc *b, uint64_t *out) {
  uint64_t v = sx_dtype_bytes(b->dtype);
  if (v == 0 || !sx__mul_ok(v, b->tokens, &v) || !sx__mul_ok(v, b->head_count, &v) ||
      !sx__mul_ok(v, b->head_dim, &v))
    return SX_EINVAL;
  *out = v;
  return 0;
}

const sx_block_desc *sx__block_desc(const sx_layout *l, uint32_t group) {
  for (uint32_t i = 0; i < l->n_blocks && i < SX_MAX_BLOCK_DESCS; i++)
    if (l->blocks[i].group == group)
      return &l->blocks[i];
  return NULL;
}

static int one_validate(const sx_block_desc *b, uint32_t i) {
  size_t n = strnlen(b->dtype, sizeof(b->dtype));
  if (n == sizeof(b->dtype))
    return sx__err(SX_ELIMIT, "block description %u: dtype is too long", i);
  if (b->order != SX_KV_NHD && b->order != SX_KV_HND && b->order != SX_KV_MLA)
    return sx__err(SX_EINVAL, "block description %u (group %u): order %d is not NHD, "
                   "HND or MLA", i, b->group, (int)b->order);
  if (b->tokens == 0 || b->tokens > SX_MAX_BLOCK_TOKENS)
    return sx__err(SX_EINVAL, "block description %u (group %u): %u tokens per block is "
                   "not 1..%d", i, b->group, b->tokens, SX_MAX_BLOCK_TOKENS);
  if (b->heads_total == 0 || b->heads_total > SX_MAX_HEADS)
    return sx__err(SX_EINVAL, "block description %u (group %u): heads_total %u is not "
                   "1..%d", i, b->group, b->heads_total, SX_MAX_HEADS);
  if (b->head_count == 0 || b->head_first >= b->heads_total ||
      b->head_count > b->heads_total - b->head_first)
    return sx__err(SX_EINVAL, "block description %u (group %u): heads %u..+%u are not "
                   "inside the model's %u", i, b->group, b->head_first, b->head_count,
                   b->heads_total);
  if (b->order == SX_KV_MLA && (b->head_first != 0 || b->head_count != b->heads_total))
    return sx__err(SX_EINVAL, "block description %u (group %u): an MLA cache has no head "
                   "split (heads %u..+%u of %u)", i, b->group, b->head_first,
                   b->head_count, b->heads_total);
  if (b->head_dim == 0 || b->head_dim > SX_MAX_HEAD_DIM)
    return sx__err(SX_EINVAL, "block description %u (group %u): head_dim %u is not "
                   "1..%d", i, b->group, b->head_dim, SX_MAX_HEAD_DIM);
  if (sx_dtype_bytes(b->dtype) == 0)
    return sx__err(SX_EINVAL, "block description %u (group %u): dtype '%.*s' is not "
                   "one of fp64 fp32 fp16 bf16 fp8 fp8_e4m3 fp8_e5m2 int8..int64 "
                   "uint8..uint64", i, b->group, (int)n, b->dtype);
  return 0; /* every bit of slots names a slot: SX_MAX_SLOTS is 64 */
}

int sx__blocks_validate(const sx_desc *d) {
  const sx_layout *l = &d->layout;
  if (l->n_blocks > SX_MAX_BLOCK_DESCS)
    return sx__err(SX_ELIMIT, "layout: %u block descriptions; the limit is %d",
                   l->n_blocks, SX_MAX_BLOCK_DESCS);
  if (l->layer_count != 0 && l->layer_first > UINT32_MAX - (l->layer_count - 1))
    return sx__err(SX_EOVERFLOW, "layout: layer_first %u + layer_count %u overflows 32 "
                   "bits", l->layer_first, l->layer_count);
  for (uint32_t i = 0; i < l->n_blocks; i++) {
    int rc = one_validate(&l->blocks[i], i);
    if (rc)
      return rc;
    for (uint32_t j = 0; j < i; j++)
      if (l->blocks[j].group == l->blocks[i].group)
        return sx__err(SX_EDUPLICATE, "layout: group %u has two block descriptions",
                       l->blocks[i].group);
  }
  /* Every region agrees with its group's description and the stage's layers. */
  for (uint32_t i = 0; i < d->n_regions; i++) {
    const sx_region *r = &d->regions[i];
    if (l->layer_count != 0 &&
        (r->layer_first < l->layer_first ||
         (uint64_t)r->layer_first + r->layer_count > (uint64_t)l->layer_first + l->layer_count))
      return sx__err(SX_ELAYERS, "region %u: layers %u..+%u outside the stage's %u..+%u",
                     r->id, r->layer_first, r->layer_count, l->layer_first,
                     l->layer_count);
    const sx_block_desc *b = sx__block_desc(l, r->group);
    uint64_t want;
    if (b == NULL || !(sx__block_slots(b) >> r->slot & 1))
      continue;
    if (sx__block_bytes(b, &want))
      return sx__err(SX_EOVERFLOW, "block description of group %u: its block size "
                     "overflows 64 bits", b->group);
    if (r->block_bytes != want) {
      char s[16];
      return sx__err(SX_EINVAL, "region %u (group %u slot %s): block_bytes %lu, but the "
                     "block description says %u tokens x %u heads x %u x %s = %lu",
                     r->id, r->group, sx_slot_name(r->slot, s),
                     (unsigned long)r->block_bytes, b->tokens, b->head_count, b->head_dim,
                     b->dtype, (unsigned long)want);
    }
  }
  return 0;
}
