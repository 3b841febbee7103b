/*
 * Read plans (segxfer/plan.h): from the local descriptor and a set of
 * remote ones, decide whether and how the local blocks can be filled.
 *
 * The plan is made in three steps, each refusing with the first misfit:
 * the set itself (fingerprints, tensor-parallel ranks), each local group
 * (descriptions on every side, equal head counts, head_dim and dtype, an
 * integer block-size ratio, every local head held by exactly one kind of
 * remote range), then every local key (each segment read from holds it).
 * Pieces are made for one unit of min(local, remote) tokens by walking the
 * local block in its own memory order and merging what is contiguous on
 * both sides, so the cost is bounded by the pieces, not by the bytes.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "plan_int.h"

/* ------------------------------------------------------------ refusals */

static int refuse(sx_mismatch *m, sx_mismatch_kind kind, const char *field, uint32_t group,
                  const char *local, const char *remote, const char *fmt, ...)
    SX__PRINTF(7, 8);

static int refuse(sx_mismatch *m, sx_mismatch_kind kind, const char *field, uint32_t group,
                  const char *local, const char *remote, const char *fmt, ...) {
  sx_mismatch tmp;
  va_list ap;
  if (m == NULL)
    m = &tmp;
  memset(m, 0, sizeof(*m));
  m->kind = kind;
  m->field = field;
  m->group = group;
  snprintf(m->local, sizeof(m->local), "%s", local);
  snprintf(m->remote, sizeof(m->remote), "%s", remote);
  va_start(ap, fmt);
  vsnprintf(m->message, sizeof(m->message), fmt, ap);
  va_end(ap);
  return sx__err(SX_EINCOMPAT, "%s", m->message);
}

static const char *u32s(uint32_t v, char buf[16]) {
  snprintf(buf, 16, "%u", v);
  return buf;
}

/* ------------------------------------------------------------ building */

static void plan_free(sx_plan *p) {
  if (p == NULL)
    return;
  free(p->names);
  free(p->rdesc);
  free(p->groups);
  free(p->pieces);
  free(p->keys);
  free(p);
}

void sx_plan_free(sx_plan *p) { plan_free(p); }

/* Append a piece, or extend the last one of this group when both sides
 * continue it. */
static int add_piece(sx_plan *p, const sx__pgroup *g, uint32_t member, uint64_t roff,
                     uint64_t loff, uint64_t len, uint64_t rshift) {
  if (p->n_pieces > g->first) {
    sx__piece *l = &p->pieces[p->n_pieces - 1];
    if (l->member == member && l->rshift == rshift && l->roff + l->len == roff &&
        l->loff + l->len == loff) {
      l->len += len;
      return 0;
    }
  }
  if (p->n_pieces - g->first >= SX_PLAN_MAX_PIECES)
    return sx__err(SX_ELIMIT, "group %u: the plan needs more than %d pieces per %u tokens "
                   "(orders or head splits that leave nothing contiguous)", g->group,
                   SX_PLAN_MAX_PIECES, g->unit);
  if (p->n_pieces == p->cap_pieces) {
    uint32_t cap = p->cap_pieces ? p->cap_pieces * 2 : 64;
    sx__piece *v = realloc(p->pieces, cap * sizeof(*v));
    if (v == NULL)
      return sx__err(SX_ENOMEM, "planning");
    p->pieces = v;
    p->cap_pieces = cap;
  }
  p->pieces[p->n_pieces++] = (sx__piece){member, roff, loff, len, rshift};
  return 0;
}

/* A run of local heads [a, b) read from one member. */
typedef struct hrun {
  uint32_t member, a, b;
} hrun;

static int token_major(sx_kv_order o) { return o != SX_KV_HND; }

/* The pieces of one unit of a described group, in the local block's memory
 * order (so the merge in add_piece sees what is contiguous locally). */
static int make_pieces(sx_plan *p, sx__pgroup *g, const sx_block_desc *lb,
                       const sx_block_desc *const *rbs, const hrun *runs, uint32_t n_runs) {
  uint64_t hb = (uint64_t)lb->head_dim * sx_dtype_bytes(lb->dtype);
  uint64_t lc = lb->head_count, Tl = lb->tokens, unit = g->unit;
  int rc;
  g->lshift = token_major(lb->order) ? unit * lc * hb : unit * hb;
  if (token_major(lb->order)) {
    for (uint64_t t = 0; t < unit; t++)
      for (uint32_t k = 0; k < n_runs; k++) {
        const hrun *r = &runs[k];
        const sx_block_desc *rb = rbs[r->member];
        uint64_t rc_ = rb->head_count, Tr = rb->tokens, rf = rb->head_first;
        uint64_t rshift = token_major(rb->order) ? unit * rc_ * hb : unit * hb;
        if (token_major(rb->order)) {
          rc = add_piece(p, g, r->member, (t * rc_ + (r->a - rf)) * hb,
                         (t * lc + (r->a - lb->head_first)) * hb, (uint64_t)(r->b - r->a) * hb,
                         rshift);
          if (rc)
            return rc;
          continue;
        }
        for (uint64_t h = r->a; h < r->b; h++)
          if ((rc = add_piece(p, g, r->member, ((h - rf) * Tr + t) * hb,
                              (t * lc + (h - lb->head_first)) * hb, hb, rshift)))
            return rc;
      }
    return 0;
  }
  for (uint32_t k = 0; k < n_runs; k++) {
    const hrun *r = &runs[k];
    const sx_block_desc *rb = rbs[r->member];
    uint64_t rc_ = rb->head_count, Tr = rb->tokens, rf = rb->head_first;
    uint64_t rshift = token_major(rb->order) ? unit * rc_ * hb : unit * hb;
    for (uint64_t h = r->a; h < r->b; h++) {
      uint64_t lbase = (h - lb->head_first) * Tl * hb;
      if (!token_major(rb->order)) {
        if ((rc = add_piece(p, g, r->member, (h - rf) * Tr * hb, lbase, unit * hb, rshift)))
          return rc;
        continue;
      }
      for (uint64_t t = 0; t < unit; t++)
        if ((rc = add_piece(p, g, r->member, (t * rc_ + (h - rf)) * hb, lbase + t * hb, hb,
                            rshift)))
          return rc;
    }
  }
  return 0;
}

/* The set: fingerprints, and ranks that do not repeat under one tp size. */
static int set_check(const sx_desc *local, const sx_desc *const *remotes, uint32_t n,
                     unsigned flags, sx_mismatch *m) {
  char a[16], b[16];
  for (uint32_t i = 0; i < n; i++) {
    const sx_layout *r = &remotes[i]->layout;
    if (!(flags & SX_CHECK_IGNORE_FINGERPRINT) &&
        strcmp(local->layout.fingerprint, r->fingerprint))
      return refuse(m, SX_MISMATCH_FINGERPRINT, "fingerprint", 0, local->layout.fingerprint,
                    r->fingerprint, "fingerprint differs: local '%s', %s has '%s'",
                    local->layout.fingerprint, remotes[i]->name, r->fingerprint);
    if (n < 2)
      continue;
    const sx_layout *r0 = &remotes[0]->layout;
    if (r->tp_size != r0->tp_size)
      return refuse(m, SX_MISMATCH_TP, "tp_size", 0, u32s(r0->tp_size, a),
                    u32s(r->tp_size, b), "the set mixes tp sizes: %s has %u, %s has %u",
                    remotes[0]->name, r0->tp_size, remotes[i]->name, r->tp_size);
    /* A rank repeats within one pipeline stage (stages repeat ranks). */
    for (uint32_t j = 0; j < i && r->tp_size; j++)
      if (remotes[j]->layout.tp_rank == r->tp_rank && remotes[j]->layout.pp_rank == r->pp_rank)
        return refuse(m, SX_MISMATCH_TP, "tp_rank", 0, u32s(r->tp_rank, a),
                      u32s(r->tp_rank, b), "tp rank %u of %u (pp rank %u) appears twice in "
                      "the set: %s and %s", r->tp_rank, r->tp_size, r->pp_rank,
                      remotes[j]->name, remotes[i]->name);
  }
  return 0;
}

/* The remote descriptions of a described local group, checked against it. */
static int group_descs(const sx_block_desc *lb, uint64_t slots, const sx_desc *const *remotes,
                       uint32_t n, const sx_block_desc **rbs, sx_mismatch *m) {
  char a[16], b[16];
  uint32_t g = lb->group;
  for (uint32_t i = 0; i < n; i++) {
    const sx_block_desc *rb = sx__block_desc(&remotes[i]->layout, g);
    const char *rn = remotes[i]->name;
    if (rb == NULL || (sx__block_slots(rb) & slots) != slots)
      return refuse(m, SX_MISMATCH_BLOCK_DESC, "block_desc", g, "described", "not described",
                    "group %u: the local layout describes its blocks, %s does not%s", g, rn,
                    rb ? " for every slot" : "");
    if (rb->heads_total != lb->heads_total)
      return refuse(m, SX_MISMATCH_HEADS_TOTAL, "heads_total", g, u32s(lb->heads_total, a),
                    u32s(rb->heads_total, b), "group %u: the model has %u KV heads here, "
                    "%u in %s", g, lb->heads_total, rb->heads_total, rn);
    if (rb->head_dim != lb->head_dim)
      return refuse(m, SX_MISMATCH_HEAD_DIM, "head_dim", g, u32s(lb->head_dim, a),
                    u32s(rb->head_dim, b), "group %u: head_dim %u here, %u in %s", g,
                    lb->head_dim, rb->head_dim, rn);
    if (strcmp(rb->dtype, lb->dtype))
      return refuse(m, SX_MISMATCH_DTYPE, "dtype", g, lb->dtype, rb->dtype,
                    "group %u: dtype %s here, %s in %s", g, lb->dtype, rb->dtype, rn);
    if ((rb->order == SX_KV_MLA) != (lb->order == SX_KV_MLA))
      return refuse(m, SX_MISMATCH_ORDER, "order", g, sx_kv_order_name(lb->order),
                    sx_kv_order_name(rb->order), "group %u: an MLA cache (no head split) "
                    "against a %s one in %s", g,
                    sx_kv_order_name(lb->order == SX_KV_MLA ? rb->order : lb->order), rn);
    uint32_t lo = lb->tokens < rb->tokens ? lb->tokens : rb->tokens;
    uint32_t hi = lb->tokens < rb->tokens ? rb->tokens : lb->tokens;
    if (hi % lo != 0)
      return refuse(m, SX_MISMATCH_BLOCK_TOKENS, "tokens", g, u32s(lb->tokens, a),
                    u32s(rb->tokens, b), "group %u: %u tokens per block here, %u in %s: "
                    "not an integer ratio", g, lb->tokens, rb->tokens, rn);
    if (i > 0 && rb->tokens != rbs[0]->tokens)
      return refuse(m, SX_MISMATCH_BLOCK_TOKENS, "tokens", g, u32s(rbs[0]->tokens, a),
                    u32s(rb->tokens, b), "group %u: the set mixes blocks of %u tokens (%s) "
                    "and %u (%s)", g, rbs[0]->tokens, remotes[0]->name, rb->tokens, rn);
    rbs[i] = rb;
  }
  return 0;
}

/* Which member each local head comes from.  Two members' ranges are equal
 * (replicas) or disjoint; among replicas, the local tp rank picks one, so
 * the readers of a replicated set spread over it. */
static int head_runs(const sx_block_desc *lb, uint32_t local_rank,
                     const sx_desc *const *remotes, const sx_block_desc *const *rbs,
                     uint32_t n, uint64_t mask, const char *band, hrun *runs,
                     uint32_t *n_runs, sx_mismatch *m) {
  char a[48], b[48];
  uint32_t g = lb->group;
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = 0; j < i; j++) {
      const sx_block_desc *x = rbs[i], *y = rbs[j];
      int equal = x->head_first == y->head_first && x->head_count == y->head_count;
      int disjoint = x->head_first >= y->head_first + y->head_count ||
                     y->head_first >= x->head_first + x->head_count;
      if (!equal && !disjoint) {
        snprintf(a, sizeof(a), "%u-%u", y->head_first, y->head_first + y->head_count - 1);
        snprintf(b, sizeof(b), "%u-%u", x->head_first, x->head_first + x->head_count - 1);
        return refuse(m, SX_MISMATCH_HEADS_OVERLAP, "heads", g, a, b,
                      "group %u: %s holds heads %s and %s heads %s: they overlap without "
                      "being equal", g, remotes[j]->name, a, remotes[i]->name, b);
      }
    }
  uint32_t h = lb->head_first, end = lb->head_first + lb->head_count, k = 0;
  while (h < end) {
    uint32_t holders[SX_PLAN_MAX_MEMBERS], nh = 0;
    for (uint32_t i = 0; i < n; i++)
      if ((mask >> i & 1) && h >= rbs[i]->head_first &&
          h - rbs[i]->head_first < rbs[i]->head_count)
        holders[nh++] = i;
    if (nh == 0) {
      snprintf(a, sizeof(a), "%u", h);
      return refuse(m, SX_MISMATCH_HEADS_MISSING, "heads", g, a, "absent",
                    "group %u%s: no segment of the set holds KV head %u (of %u): a rank is "
                    "missing", g, band, h, lb->heads_total);
    }
    uint32_t mb = holders[local_rank % nh];
    uint32_t stop = rbs[mb]->head_first + rbs[mb]->head_count;
    if (stop > end)
      stop = end;
    runs[k++] = (hrun){mb, h, stop};
    h = stop;
  }
  *n_runs = k;
  return 0;
}

/* Room for one more planned group (and its members' descriptions). */
static int more_groups(sx_plan *p) {
  if (p->n_groups < p->cap_groups)
    return 0;
  uint32_t cap = p->cap_groups ? p->cap_groups * 2 : 8;
  sx__pgroup *g = realloc(p->groups, cap * sizeof(*g));
  if (g == NULL)
    return sx__err(SX_ENOMEM, "planning");
  p->groups = g;
  sx_block_desc *r = realloc(p->rdesc, (size_t)cap * p->n_members * sizeof(*r));
  if (r == NULL)
    return sx__err(SX_ENOMEM, "planning");
  p->rdesc = r;
  p->cap_groups = cap;
  return 0;
}

/* A described group read from the members in mask (all of them, or those
 * holding a pipeline stage's layers: band says which, for messages). */
static int plan_group(sx_plan *p, const sx_desc *local, const sx_block_desc *lb,
                      const sx_desc *const *remotes, uint32_t n, uint64_t mask,
                      const char *band, sx_mismatch *m) {
  const sx_block_desc *rbs[SX_PLAN_MAX_MEMBERS];
  hrun runs[SX_MAX_HEADS];
  uint32_t n_runs = 0;
  uint64_t slots = sx__block_slots(lb);
  int rc = group_descs(lb, slots, remotes, n, rbs, m);
  if (rc == 0)
    rc = head_runs(lb, local->layout.tp_rank, remotes, rbs, n, mask, band, runs, &n_runs, m);
  if (rc == 0)
    rc = more_groups(p);
  if (rc)
    return rc;
  sx__pgroup *g = &p->groups[p->n_groups];
  memset(g, 0, sizeof(*g));
  g->group = lb->group;
  g->slots = slots;
  g->mask = mask;
  g->ldesc = *lb;
  g->unit = lb->tokens < rbs[0]->tokens ? lb->tokens : rbs[0]->tokens;
  g->kl = lb->tokens / g->unit;
  g->kr = rbs[0]->tokens / g->unit;
  g->first = p->n_pieces;
  for (uint32_t i = 0; i < n; i++)
    p->rdesc[(size_t)p->n_groups * n + i] = *rbs[i];
  if ((rc = make_pieces(p, g, lb, rbs, runs, n_runs)))
    return rc;
  g->n = p->n_pieces - g->first;
  p->n_groups++;
  return 0;
}

/* A group (or the slots of it no description covers) read whole from
 * member 0: the sx_layout_check() rules for what it compares. */
static int plan_whole(sx_plan *p, const sx_desc *local, uint32_t group, uint64_t slots,
                      const sx_desc *const *remotes, uint32_t n, sx_mismatch *m) {
  const sx_layout *l = &local->layout, *r = &remotes[0]->layout;
  char a[16], b[16];
  if (n > 1)
    return refuse(m, SX_MISMATCH_BLOCK_DESC, "block_desc", group, "not described",
                  u32s(n, b), "group %u has no block description here: a set of %u "
                  "segments can only be planned from descriptions", group, n);
  if (strcmp(l->tag, r->tag))
    return refuse(m, SX_MISMATCH_LAYOUT_TAG, "layout_tag", group, l->tag, r->tag,
                  "layout_tag differs: local '%s', remote '%s'", l->tag, r->tag);
  if (strcmp(l->dtype, r->dtype))
    return refuse(m, SX_MISMATCH_DTYPE, "dtype", group, l->dtype, r->dtype,
                  "dtype differs: local '%s', remote '%s'", l->dtype, r->dtype);
  (void)a;
  int rc = more_groups(p);
  if (rc)
    return rc;
  memset(&p->rdesc[(size_t)p->n_groups * n], 0, n * sizeof(*p->rdesc));
  sx__pgroup *g = &p->groups[p->n_groups++];
  memset(g, 0, sizeof(*g));
  g->group = group;
  g->slots = slots;
  g->whole = 1;
  g->kl = g->kr = 1;
  g->first = p->n_pieces;
  return 0; /* the one piece depends on the key's block_bytes: see expand */
}

/* The planned group covering (group, slot) from the members in mask
 * (described) or whole, or -1. */
static int find_pg(const sx_plan *p, uint32_t group, uint32_t slot, int whole, uint64_t mask) {
  for (uint32_t i = 0; i < p->n_groups; i++) {
    const sx__pgroup *g = &p->groups[i];
    if (g->group == group && (g->slots >> slot & 1) && g->whole == whole &&
        (whole || g->mask == mask))
      return (int)i;
  }
  return -1;
}

/* The members holding (group, layer, slot), and in *stop the first layer
 * after it where that may change (a region of some member begins or ends
 * there; at most end), so bands are found in steps of regions, never of
 * layers: a region may span 2^32 layers. */
static uint64_t layer_mask(const sx_desc *const *remotes, uint32_t n, uint32_t group,
                           uint64_t layer, uint32_t slot, uint64_t end, uint64_t *stop) {
  uint64_t mask = 0;
  *stop = end;
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t j = 0; j < remotes[i]->n_regions; j++) {
      const sx_region *r = &remotes[i]->regions[j];
      uint64_t rf = r->layer_first, re = rf + r->layer_count;
      if (r->group != group || r->slot != slot)
        continue;
      if (layer >= rf && layer < re) {
        mask |= 1ull << i;
        *stop = re < *stop ? re : *stop;
      } else if (rf > layer && rf < *stop) {
        *stop = rf;
      }
    }
  return mask;
}

static int add_key(sx_plan *p, sx__pkey k) {
  if (p->n_keys == p->cap_keys) {
    uint32_t cap = p->cap_keys ? p->cap_keys * 2 : 16;
    sx__pkey *v = realloc(p->keys, cap * sizeof(*v));
    if (v == NULL)
      return sx__err(SX_ENOMEM, "planning");
    p->keys = v;
    p->cap_keys = cap;
  }
  p->keys[p->n_keys++] = k;
  return 0;
}

/*
 * A described local region: its layers in bands over which the same
 * members hold the layer (all of them, unless the set is split by pipeline
 * stage), each band planned from those members.
 */
static int plan_region(sx_plan *p, const sx_desc *local, const sx_block_desc *lb,
                       const sx_region *L, const sx_desc *const *remotes, uint32_t n,
                       sx_mismatch *m) {
  uint64_t layer = L->layer_first, end = (uint64_t)L->layer_first + L->layer_count;
  uint64_t all = n == 64 ? ~0ull : (1ull << n) - 1;
  char s[16];
  while (layer < end) {
    uint64_t stop, next;
    uint64_t mask = layer_mask(remotes, n, L->group, layer, L->slot, end, &stop);
    while (stop < end && layer_mask(remotes, n, L->group, stop, L->slot, end, &next) == mask)
      stop = next;
    if (mask == 0) {
      sx_mismatch tmp;
      if (m == NULL)
        m = &tmp;
      refuse(m, SX_MISMATCH_MISSING_KEY, "key", L->group, "present", "absent",
             "key group %u layer %lu slot %s: local has it, no segment of the set does",
             L->group, (unsigned long)layer, sx_slot_name(L->slot, s));
      m->layer = (uint32_t)layer;
      m->slot = L->slot;
      return SX_EINCOMPAT;
    }
    int pg = find_pg(p, L->group, L->slot, 0, mask);
    if (pg < 0) {
      char band[48] = "";
      if (mask != all)
        snprintf(band, sizeof(band), " layers %lu-%lu", (unsigned long)layer,
                 (unsigned long)stop - 1);
      int rc = plan_group(p, local, lb, remotes, n, mask, band, m);
      if (rc)
        return rc;
      pg = (int)p->n_groups - 1;
    }
    int rc = add_key(p, (sx__pkey){L->group, L->slot, (uint32_t)layer,
                                   (uint32_t)(stop - layer), (uint32_t)pg});
    if (rc)
      return rc;
    layer = stop;
  }
  return 0;
}

/* Members a group reads from. */
static uint64_t pg_members(const sx_plan *p, const sx__pgroup *g) {
  uint64_t mask = g->whole ? 1 : 0;
  for (uint32_t k = 0; k < g->n; k++)
    mask |= 1ull << p->pieces[g->first + k].member;
  return mask;
}

/* Every member a key's pieces read from holds the key's layers. */
static int key_check(const sx_plan *p, const sx__pkey *k, const sx_region *L,
                     const sx_desc *const *remotes, sx_mismatch *m) {
  const sx__pgroup *g = &p->groups[k->pg];
  uint64_t mask = pg_members(p, g);
  char s[16], a[16], b[16];
  for (uint32_t i = 0; mask >> i; i++) {
    if (!(mask >> i & 1))
      continue;
    uint64_t layer = k->layer_first, end = (uint64_t)k->layer_first + k->layer_count;
    while (layer < end) {
      const sx_region *R = sx_desc_find(remotes[i], k->group, (uint32_t)layer, k->slot);
      if (R == NULL) {
        sx_mismatch tmp;
        if (m == NULL)
          m = &tmp;
        refuse(m, SX_MISMATCH_MISSING_KEY, "key", k->group, "present", "absent",
               "key group %u layer %lu slot %s: local has it, %s does not", k->group,
               (unsigned long)layer, sx_slot_name(k->slot, s), remotes[i]->name);
        m->layer = (uint32_t)layer;
        m->slot = k->slot;
        return SX_EINCOMPAT;
      }
      if (g->whole && R->block_bytes != L->block_bytes) {
        sx_mismatch tmp;
        if (m == NULL)
          m = &tmp;
        snprintf(a, sizeof(a), "%lu", (unsigned long)L->block_bytes);
        snprintf(b, sizeof(b), "%lu", (unsigned long)R->block_bytes);
        refuse(m, SX_MISMATCH_BLOCK_BYTES, "block_bytes", k->group, a, b,
               "block_bytes differs at group %u layer %lu slot %s: local %s, remote %s",
               k->group, (unsigned long)layer, sx_slot_name(k->slot, s), a, b);
        m->layer = (uint32_t)layer;
        m->slot = k->slot;
        return SX_EINCOMPAT;
      }
      layer = (uint64_t)R->layer_first + R->layer_count;
    }
  }
  return 0;
}

int sx_layout_plan(const sx_desc *local, const sx_desc *const *remotes, uint32_t n,
                   unsigned flags, sx_plan **out, sx_mismatch *mismatch) {
  if (local == NULL || remotes == NULL || out == NULL || n == 0)
    return sx__err(SX_EINVAL, "sx_layout_plan: NULL argument or no remote segment");
  if (n > SX_PLAN_MAX_MEMBERS)
    return sx__err(SX_ELIMIT, "sx_layout_plan: %u segments; at most %d", n,
                   SX_PLAN_MAX_MEMBERS);
  for (uint32_t i = 0; i < n; i++)
    if (remotes[i] == NULL)
      return sx__err(SX_EINVAL, "sx_layout_plan: remote %u is NULL", i);
  if (mismatch != NULL)
    memset(mismatch, 0, sizeof(*mismatch));
  int rc = set_check(local, remotes, n, flags, mismatch);
  if (rc)
    return rc;
  sx_plan *p = calloc(1, sizeof(*p));
  if (p == NULL || (p->names = calloc(n, sizeof(*p->names))) == NULL) {
    plan_free(p);
    return sx__err(SX_ENOMEM, "sx_layout_plan");
  }
  p->n_members = n;
  for (uint32_t i = 0; i < n; i++)
    memcpy(p->names[i], remotes[i]->name, sizeof(p->names[i]));
  const sx_layout *l = &local->layout;
  /* Every description is checked against the set even where no region of
   * its group is registered yet: a misfit shows at the open. */
  for (uint32_t i = 0; i < l->n_blocks && i < SX_MAX_BLOCK_DESCS && rc == 0; i++) {
    const sx_block_desc *rbs[SX_PLAN_MAX_MEMBERS];
    rc = group_descs(&l->blocks[i], sx__block_slots(&l->blocks[i]), remotes, n, rbs,
                     mismatch);
  }
  /* The keys: described regions in bands of the members holding them, and
   * whole groups for what no description covers. */
  for (uint32_t i = 0; i < local->n_regions && rc == 0; i++) {
    const sx_region *L = &local->regions[i];
    const sx_block_desc *b = sx__block_desc(l, L->group);
    if (b != NULL && (sx__block_slots(b) >> L->slot & 1)) {
      rc = plan_region(p, local, b, L, remotes, n, mismatch);
      continue;
    }
    int pg = find_pg(p, L->group, L->slot, 1, 0);
    if (pg < 0) {
      uint64_t slots = b ? ~sx__block_slots(b) : ~0ull;
      if ((rc = plan_whole(p, local, L->group, slots, remotes, n, mismatch)))
        break;
      pg = (int)p->n_groups - 1;
    }
    sx__pkey k = {L->group, L->slot, L->layer_first, L->layer_count, (uint32_t)pg};
    if ((rc = add_key(p, k)) == 0)
      rc = key_check(p, &p->keys[p->n_keys - 1], L, remotes, mismatch);
  }
  if (rc) {
    plan_free(p);
    return rc;
  }
  *out = p;
  return 0;
}

/* ------------------------------------------------------------ reading */

int sx_plan_info_get(const sx_plan *p, sx_plan_info *out) {
  if (p == NULL || out == NULL)
    return sx__err(SX_EINVAL, "sx_plan_info_get: NULL argument");
  sx_plan_info v = {.members = p->n_members, .groups = p->n_groups, .whole = 1};
  uint64_t used = 0;
  for (uint32_t i = 0; i < p->n_groups; i++) {
    used |= pg_members(p, &p->groups[i]);
    v.pieces += p->groups[i].whole ? 1 : p->groups[i].n;
    v.whole &= p->groups[i].whole;
  }
  v.used = (uint32_t)__builtin_popcountll(used);
  *out = v;
  return 0;
}

/* ------------------------------------------------------------ expansion */

/* Do member m's pieces (at least two, in order) follow each other at one
 * remote and one local stride, each at least the pieces' one length, and
 * with one unit shift?  The strides into *rstride, *lstride. */
static int strided(const sx__piece *pcs, uint32_t npc, uint32_t m, uint64_t *rstride,
                   uint64_t *lstride) {
  const sx__piece *prev = NULL;
  uint64_t rs = 0, ls = 0;
  uint32_t k = 0;
  for (uint32_t q = 0; q < npc; q++) {
    const sx__piece *pc = &pcs[q];
    if (pc->member != m)
      continue;
    if (prev != NULL) {
      if (pc->len != prev->len || pc->rshift != prev->rshift || pc->roff < prev->roff ||
          pc->loff < prev->loff)
        return 0;
      uint64_t dr = pc->roff - prev->roff, dl = pc->loff - prev->loff;
      if (k == 1) {
        rs = dr;
        ls = dl;
      }
      if (dr != rs || dl != ls || dr < pc->len || dl < pc->len || dr > UINT32_MAX ||
          dl > UINT32_MAX)
        return 0;
    }
    prev = pc;
    k++;
  }
  *rstride = rs;
  *lstride = ls;
  return k >= 2;
}

/*
 * The ranges of member m in one (key, layer): for each of the request's
 * units, m's pieces of it, handed to fn in runs.  lbase is the layer's
 * start in L, rbase its offset in R.  What each range needs is kept in
 * locals: fn may write memory, so fields read through pointers would be
 * loaded again for every range.
 */
static int emit_member(const sx_plan *p, const sx__pgroup *g, const sx_region *L,
                       const sx_region *R, uint32_t m, uint64_t lbase, uint64_t rbase,
                       const uint64_t *rb, const uint64_t *lb, uint64_t units,
                       sx__prun_fn fn, void *arg) {
  uint64_t lstride = L->block_stride, rstride = R->block_stride, lshift = g->lshift;
  uint64_t kl = g->kl, kr = g->kr;
  /* A whole group is one piece of block_bytes from member 0. */
  sx__piece whole = {0, 0, 0, L->block_bytes, 0};
  const sx__piece *pcs = g->whole ? &whole : &p->pieces[g->first];
  uint32_t npc = g->whole ? 1 : g->n;
  sx__prun run;
  run.member = m;
  run.R = R;
  run.L = L;
  uint32_t n = 0;
  /* The usual case (whole blocks, head slices of equal block sizes): unit
   * u is block u on both sides and m has one piece of it. */
  const sx__piece *one = NULL;
  uint32_t mine = 0;
  for (uint32_t q = 0; q < npc; q++)
    if (pcs[q].member == m && mine++ == 0)
      one = &pcs[q];
  run.count = 1;
  run.rstride = run.lstride = 0;
  if (kl == 1 && kr == 1 && mine == 1) {
    uint64_t lb0 = lbase + one->loff, rb0 = rbase + one->roff, len = one->len;
    for (uint64_t u = 0; u < units; u += n) {
      n = units - u < SX__PRUN_MAX ? (uint32_t)(units - u) : SX__PRUN_MAX;
      for (uint32_t k = 0; k < n; k++) {
        run.roff[k] = rb0 + rb[u + k] * rstride;
        run.laddr[k] = lb0 + lb[u + k] * lstride;
        run.len[k] = len;
        run.block[k] = (uint32_t)(u + k);
      }
      run.n = n;
      int rc = fn(arg, &run);
      if (rc)
        return rc;
    }
    return 0;
  }
  /* m's pieces of a unit at fixed strides on both sides (a token-major
   * split: one per token) are one strided range per unit. */
  if (mine >= 2 && strided(pcs, npc, m, &run.rstride, &run.lstride))
    run.count = mine;
  /* Unit u is unit ql of local block j and unit qr of remote block i
   * (u / kl, u % kl, u / kr, u % kr), counted rather than divided. */
  uint64_t j = 0, ql = 0, i = 0, qr = 0;
  for (uint64_t u = 0; u < units; u++) {
    if (u > 0) {
      if (++ql == kl)
        ql = 0, j++;
      if (++qr == kr)
        qr = 0, i++;
    }
    uint64_t laddr = lbase + lb[j] * lstride + ql * lshift;
    uint64_t roff = rbase + rb[i] * rstride;
    for (uint32_t q = 0; q < npc; q++) {
      const sx__piece *pc = &pcs[q];
      if (pc->member != m)
        continue;
      if (n == SX__PRUN_MAX) {
        run.n = n;
        int rc = fn(arg, &run);
        if (rc)
          return rc;
        n = 0;
      }
      run.roff[n] = roff + pc->roff + qr * pc->rshift;
      run.laddr[n] = laddr + pc->loff;
      run.len[n] = pc->len;
      run.block[n] = (uint32_t)j;
      n++;
      if (run.count > 1)
        break; /* the unit's pieces are this strided range */
    }
  }
  run.n = n;
  return n ? fn(arg, &run) : 0;
}

/* One pass of the expansion over every key: pass 0 checks every key and
 * block id, pass 1 emits the ranges of the members in `members`. */
static int expand_pass(const sx_plan *p, const sx_desc *local, const sx_desc *const *remotes,
                       const uint64_t *rb, size_t nr, const uint64_t *lb, size_t nl,
                       int pass, uint64_t members, sx__prun_fn fn, void *arg) {
  char s[16];
  for (uint32_t ki = 0; ki < p->n_keys; ki++) {
    const sx__pkey *k = &p->keys[ki];
    const sx__pgroup *g = &p->groups[k->pg];
    uint64_t mask = pg_members(p, g);
    /* A member emitting nothing here needs no lookups (pass 1 of one
     * member of a pipelined read). */
    if (pass == 1 && (mask & members) == 0)
      continue;
    uint64_t units = (uint64_t)nl * g->kl, runits = (uint64_t)nr * g->kr;
    if (runits < units)
      units = runits;
    /* The blocks the units touch on each side, and the largest id of each:
     * a layer's check is then one compare (the ids are searched for the
     * message only when it fails). */
    size_t nrj = (size_t)((units + g->kr - 1) / g->kr), nlj = (size_t)((units + g->kl - 1) / g->kl);
    uint64_t rmax = 0, lmax = 0;
    for (size_t j = 0; pass == 0 && j < nrj; j++)
      rmax = rb[j] > rmax ? rb[j] : rmax;
    for (size_t j = 0; pass == 0 && j < nlj; j++)
      lmax = lb[j] > lmax ? lb[j] : lmax;
    for (uint64_t layer = k->layer_first; layer < (uint64_t)k->layer_first + k->layer_count;
         layer++) {
      const sx_region *L = sx_desc_find(local, k->group, (uint32_t)layer, k->slot);
      const sx_region *R[SX_PLAN_MAX_MEMBERS] = {0};
      if (L == NULL)
        return sx__err(SX_ENOREGION, "no local region holds group %u layer %lu slot %s "
                       "any more", k->group, (unsigned long)layer, sx_slot_name(k->slot, s));
      for (uint32_t i = 0; mask >> i; i++) {
        if (!(mask >> i & 1))
          continue;
        R[i] = sx_desc_find(remotes[i], k->group, (uint32_t)layer, k->slot);
        if (R[i] == NULL)
          return sx__err(SX_ENOREGION, "%s has no region for group %u layer %lu slot %s",
                         remotes[i]->name, k->group, (unsigned long)layer,
                         sx_slot_name(k->slot, s));
        if (pass == 0 && g->whole && R[i]->block_bytes != L->block_bytes)
          return sx__err(SX_EINCOMPAT, "block_bytes differs at group %u layer %lu slot %s: "
                         "local %lu, %s %lu", k->group, (unsigned long)layer,
                         sx_slot_name(k->slot, s), (unsigned long)L->block_bytes,
                         remotes[i]->name, (unsigned long)R[i]->block_bytes);
        if (pass == 0 && nrj > 0 && rmax >= R[i]->num_blocks) {
          size_t j = 0;
          while (rb[j] < R[i]->num_blocks)
            j++;
          return sx__err(SX_EBOUNDS, "remote block %lu is outside %s's region %u "
                         "(%lu blocks)", (unsigned long)rb[j], remotes[i]->name,
                         R[i]->id, (unsigned long)R[i]->num_blocks);
        }
      }
      if (pass == 0) {
        if (nlj > 0 && lmax >= L->num_blocks) {
          size_t j = 0;
          while (lb[j] < L->num_blocks)
            j++;
          return sx__err(SX_EBOUNDS, "local block %lu is outside local region %u "
                         "(%lu blocks)", (unsigned long)lb[j], L->id,
                         (unsigned long)L->num_blocks);
        }
        continue;
      }
      uint64_t lbase = L->addr + (layer - L->layer_first) * L->layer_stride;
      for (uint32_t m = 0; mask >> m; m++) {
        if (!(mask >> m & 1) || !(members >> m & 1))
          continue;
        int rc = emit_member(p, g, L, R[m], m, lbase,
                             (layer - R[m]->layer_first) * R[m]->layer_stride, rb, lb, units,
                             fn, arg);
        if (rc)
          return rc;
      }
    }
  }
  return 0;
}

static int expand_args(const sx_plan *p, const sx_desc *local, const sx_desc *const *remotes,
                       uint32_t n_remotes, const uint64_t *rb, size_t nr, const uint64_t *lb,
                       size_t nl) {
  if (p == NULL || local == NULL || remotes == NULL || (nr && rb == NULL) ||
      (nl && lb == NULL))
    return sx__err(SX_EINVAL, "expanding a plan: NULL argument");
  if (n_remotes != p->n_members)
    return sx__err(SX_EINVAL, "expanding a plan of %u segments with %u", p->n_members,
                   n_remotes);
  return 0;
}

int sx__plan_check(const sx_plan *p, const sx_desc *local, const sx_desc *const *remotes,
                   uint32_t n_remotes, const uint64_t *rb, size_t nr, const uint64_t *lb,
                   size_t nl) {
  int rc = expand_args(p, local, remotes, n_remotes, rb, nr, lb, nl);
  return rc ? rc : expand_pass(p, local, remotes, rb, nr, lb, nl, 0, 0, NULL, NULL);
}

int sx__plan_emit(const sx_plan *p, const sx_desc *local, const sx_desc *const *remotes,
                  uint32_t n_remotes, const uint64_t *rb, size_t nr, const uint64_t *lb,
                  size_t nl, uint64_t members, sx__prun_fn fn, void *arg) {
  int rc = expand_args(p, local, remotes, n_remotes, rb, nr, lb, nl);
  return rc ? rc : expand_pass(p, local, remotes, rb, nr, lb, nl, 1, members, fn, arg);
}

int sx__plan_expand(const sx_plan *p, const sx_desc *local, const sx_desc *const *remotes,
                    uint32_t n_remotes, const uint64_t *rb, size_t nr, const uint64_t *lb,
                    size_t nl, sx__prun_fn fn, void *arg) {
  int rc = sx__plan_check(p, local, remotes, n_remotes, rb, nr, lb, nl);
  return rc ? rc : sx__plan_emit(p, local, remotes, n_remotes, rb, nr, lb, nl, ~0ull, fn, arg);
}
