/*
 * The batch planner (see planner.h).  Each add call runs in two passes: the
 * first checks every entry against both sides without touching the plan,
 * the second emits ranges.  So a bad entry leaves the plan as it was, and
 * the second pass can rely on the first pass's bounds checks for its
 * offset arithmetic.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "planner.h"

#define NONE SIZE_MAX
/* The most ranges sx__plan_add_blocks() makes room for up front (64 KiB). */
#define PRERESERVE_MAX 1024u
/* The most (slot, layer) positions of a shape kept (p->sc). */
#define SHAPE_MAX 4096u

/* Slots in a mask.  Most entries name one, and the build targets the x86-64
 * baseline, which has no popcnt instruction: libgcc's loop runs only for
 * masks of several bits. */
static inline size_t slot_count(uint64_t slots) {
  return slots & (slots - 1) ? (size_t)__builtin_popcountll(slots) : (size_t)(slots != 0);
}

/* ------------------------------------------------------------ index */

static int key_cmp(const void *a, const void *b) {
  const sx_region *x = *(const sx_region *const *)a, *y = *(const sx_region *const *)b;
  if (x->group != y->group)
    return x->group < y->group ? -1 : 1;
  if (x->slot != y->slot)
    return x->slot < y->slot ? -1 : 1;
  return x->layer_first < y->layer_first ? -1 : x->layer_first > y->layer_first;
}

static int id_cmp(const void *a, const void *b) {
  const sx_region *x = *(const sx_region *const *)a, *y = *(const sx_region *const *)b;
  return x->id < y->id ? -1 : x->id > y->id;
}

static int addr_cmp(const void *a, const void *b) {
  const sx_region *x = *(const sx_region *const *)a, *y = *(const sx_region *const *)b;
  return x->addr < y->addr ? -1 : x->addr > y->addr;
}

/* The last region whose (group, slot, layer_first) is <= the key, if it
 * holds the key. */
const sx_region *sx__rindex_key_search(const sx__rindex *ix, uint32_t group, uint32_t layer,
                                       uint32_t slot) {
  size_t lo = 0, hi = ix->n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    const sx_region *r = ix->by_key[mid];
    int le = r->group < group ||
             (r->group == group && (r->slot < slot || (r->slot == slot &&
                                                       r->layer_first <= layer)));
    if (le)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo == 0)
    return NULL;
  const sx_region *r = ix->by_key[lo - 1];
  if (r->group != group || r->slot != slot || layer - r->layer_first >= r->layer_count)
    return NULL;
  return r;
}

/* Fill t->dense when the keys of t's regions span a small box (see
 * planner.h); each cell holds what sx__rindex_key_search() answers for it.  0, or
 * SX_ENOMEM. */
static int dense_build(sx__rindex *t) {
  if (t->n == 0)
    return 0;
  uint32_t g0 = UINT32_MAX, g1 = 0, s0 = UINT32_MAX, s1 = 0, l0 = UINT32_MAX;
  uint64_t l1 = 0;
  for (uint32_t i = 0; i < t->n; i++) {
    const sx_region *r = t->by_key[i];
    uint64_t last = (uint64_t)r->layer_first + (r->layer_count ? r->layer_count - 1 : 0);
    g0 = r->group < g0 ? r->group : g0;
    g1 = r->group > g1 ? r->group : g1;
    s0 = r->slot < s0 ? r->slot : s0;
    s1 = r->slot > s1 ? r->slot : s1;
    l0 = r->layer_first < l0 ? r->layer_first : l0;
    l1 = last > l1 ? last : l1;
  }
  /* Each span is at most 2^32, so the product is checked one factor at a
   * time against a cap far below overflow. */
  uint64_t ng = (uint64_t)g1 - g0 + 1, ns = (uint64_t)s1 - s0 + 1, nl = l1 - l0 + 1;
  uint64_t cap = (uint64_t)t->n * SX__RINDEX_DENSE_PER_REGION;
  if (cap > SX__RINDEX_DENSE_MAX)
    cap = SX__RINDEX_DENSE_MAX;
  if (ng > cap || ns > cap || nl > cap || ng * ns > cap || ng * ns * nl > cap)
    return 0;
  const sx_region **d = malloc(ng * ns * nl * sizeof(*d));
  if (d == NULL)
    return SX_ENOMEM;
  size_t k = 0;
  for (uint64_t g = 0; g < ng; g++)
    for (uint64_t s = 0; s < ns; s++)
      for (uint64_t l = 0; l < nl; l++)
        d[k++] = sx__rindex_key_search(t, (uint32_t)(g0 + g), (uint32_t)(l0 + l),
                                       (uint32_t)(s0 + s));
  t->dense = d;
  t->g0 = g0;
  t->s0 = s0;
  t->l0 = l0;
  t->ng = (uint32_t)ng;
  t->ns = (uint32_t)ns;
  t->nl = (uint32_t)nl;
  return 0;
}

int sx__rindex_build(sx__rindex *ix, const sx_region *const *regions, uint32_t n) {
  size_t bytes = (n ? n : 1) * sizeof(const sx_region *);
  sx__rindex t = {.n = n};
  t.by_key = malloc(bytes);
  t.by_id = malloc(bytes);
  t.by_addr = malloc(bytes);
  if (t.by_key == NULL || t.by_id == NULL || t.by_addr == NULL) {
    sx__rindex_free(&t);
    return sx__err(SX_ENOMEM, "indexing %u regions", n);
  }
  if (n) {
    memcpy(t.by_key, regions, n * sizeof(*regions));
    memcpy(t.by_id, regions, n * sizeof(*regions));
    memcpy(t.by_addr, regions, n * sizeof(*regions));
  }
  qsort(t.by_key, n, sizeof(*t.by_key), key_cmp);
  qsort(t.by_id, n, sizeof(*t.by_id), id_cmp);
  qsort(t.by_addr, n, sizeof(*t.by_addr), addr_cmp);
  if (dense_build(&t) != 0) {
    sx__rindex_free(&t);
    return sx__err(SX_ENOMEM, "indexing %u regions", n);
  }
  *ix = t;
  return 0;
}

int sx__rindex_build_desc(sx__rindex *ix, const sx_desc *d) {
  const sx_region **v = malloc((d->n_regions ? d->n_regions : 1) * sizeof(*v));
  if (v == NULL)
    return sx__err(SX_ENOMEM, "indexing %s", d->name);
  for (uint32_t i = 0; i < d->n_regions; i++)
    v[i] = &d->regions[i];
  int rc = sx__rindex_build(ix, v, d->n_regions);
  free(v);
  return rc;
}

void sx__rindex_free(sx__rindex *ix) {
  free(ix->by_key);
  free(ix->by_id);
  free(ix->by_addr);
  free(ix->dense);
  memset(ix, 0, sizeof(*ix));
}


const sx_region *sx__rindex_id(const sx__rindex *ix, uint32_t id) {
  size_t lo = 0, hi = ix->n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    uint32_t v = ix->by_id[mid]->id;
    if (v == id)
      return ix->by_id[mid];
    if (v < id)
      lo = mid + 1;
    else
      hi = mid;
  }
  return NULL;
}

const sx_region *sx__rindex_addr(const sx__rindex *ix, uint64_t addr, uint64_t len) {
  size_t lo = 0, hi = ix->n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (ix->by_addr[mid]->addr <= addr)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo == 0)
    return NULL;
  const sx_region *r = ix->by_addr[lo - 1];
  uint64_t off = addr - r->addr;
  if (off > r->length || len > r->length - off)
    return NULL;
  return r;
}

/* ------------------------------------------------------------ plan */

void sx__plan_init(sx__plan *p, const sx__rindex *remote, const sx__rindex *local,
                   uint64_t slice, int need_lreg) {
  memset(p, 0, sizeof(*p));
  p->remote = remote;
  p->local = local;
  p->slice = slice ? slice : SX__PLAN_SLICE;
  p->need_lreg = need_lreg;
}

static void tab_release(sx__plan *p) {
  sx__mem_pinned_put(p->tab, p->tab_bytes);
  p->tab = NULL;
  p->n_tab = p->tab_cap = p->tab_bytes = 0;
}

void sx__plan_free(sx__plan *p) {
  tab_release(p);
  free(p->x);
  free(p->pos);
  free(p->sc);
  p->x = NULL;
  p->pos = NULL;
  p->sc = NULL;
  p->n = p->cap = p->pos_cap = p->sc_n = p->sc_cap = 0;
  p->sc_valid = 0;
}

static int reserve(sx__plan *p, size_t extra) {
  if (p->cap - p->n >= extra)
    return 0;
  size_t cap = p->cap ? p->cap : 64;
  while (cap - p->n < extra)
    cap *= 2;
  sx_xfer *x = realloc(p->x, cap * sizeof(*x));
  if (x == NULL)
    return SX_ENOMEM;
  p->x = x;
  p->cap = cap;
  return 0;
}

static const char *slot_str(uint32_t slot, char buf[16]) { return sx_slot_name(slot, buf); }

/* ------------------------------------------------------------ tables */

_Static_assert(SX__OP_RREGS == SX__GATHER_BASES, "a table names its op's regions by index");

void sx__plan_tables(sx__plan *p, uint32_t min) {
  p->tables = 1;
  p->tab_min = min;
  p->tab_device = -1;
  p->sc_tab = -1;
}

/* Room for extra more pieces: 0, or -1 where the table would outgrow
 * SX__PLAN_TABLE_MAX or no pinned memory can be had (the pieces so far
 * stay). */
static int tab_reserve(sx__plan *p, size_t extra) {
  if (p->tab_cap - p->n_tab >= extra)
    return 0;
  size_t cap = p->tab_cap ? p->tab_cap : 64;
  while (cap - p->n_tab < extra)
    cap *= 2;
  if (cap > SX__PLAN_TABLE_MAX / sizeof(sx__mem_bpiece))
    return -1;
  void *t;
  size_t bytes;
  if (sx__mem_pinned_get(p->tab_device, cap * sizeof(sx__mem_bpiece), &t, &bytes) != 0)
    return -1;
  if (p->n_tab > 0)
    memcpy(t, p->tab, p->n_tab * sizeof(*p->tab));
  sx__mem_pinned_put(p->tab, p->tab_bytes);
  p->tab = t;
  p->tab_bytes = bytes;
  p->tab_cap = bytes / sizeof(sx__mem_bpiece);
  return 0;
}

int sx__plan_untable(sx__plan *p) {
  if (!p->tables)
    return 0;
  p->tables = 0;
  int rc = 0;
  if (p->n_tab > 0 && reserve(p, p->n_tab) != 0) {
    p->broken = rc = SX_ENOMEM;
  } else {
    /* Piece k becomes range k: the merge positions (pos) stay right. */
    for (size_t k = 0; k < p->n_tab; k++) {
      const sx__mem_bpiece *q = &p->tab[k];
      const sx_region *Lr = sx__rindex_addr(p->local, q->dst, q->len);
      p->x[p->n++] = (sx_xfer){.local = (uint8_t *)(uintptr_t)q->dst,
                               .lreg = (const sx_lregion *)Lr, .rreg = p->rr[q->region],
                               .roff = q->src, .length = q->len,
                               .entry_first = q->entry_first, .entry_last = q->entry_last,
                               .status = 1};
    }
  }
  tab_release(p);
  return rc;
}

/* Entry points that only plan ranges: the table turns into ranges first. */
static int no_tables(sx__plan *p) {
  if (p->tables && sx__plan_untable(p) != 0)
    return sx__err(SX_ENOMEM, "planning entry %u", p->n_entries);
  return 0;
}

/* The remote region must allow what the plan does to it. */
static int access_check(const sx__plan *p, const sx_region *R, uint32_t e) {
  uint32_t need = p->write ? SX_ACCESS_REMOTE_WRITE : SX_ACCESS_REMOTE_READ;
  if (R->access & need)
    return 0;
  return sx__err(SX_EDENIED, "entry %u: remote region %u does not allow remote %s", e, R->id,
                 p->write ? "writes" : "reads");
}

/* Pass one for a block entry: everything that can be wrong with it. */
static int check_block(const sx__plan *p, const sx_block_read *r, uint32_t e) {
  char s[16];
  if (r->layer_count == 0 || r->slots == 0 || r->count == 0)
    return sx__err(SX_EINVAL, "entry %u: layer_count, slots and count must be non-zero",
                   e);
  if (r->layer_first > UINT32_MAX - (r->layer_count - 1))
    return sx__err(SX_EOVERFLOW, "entry %u: layer_first %u + layer_count %u overflows",
                   e, r->layer_first, r->layer_count);
  uint64_t end = (uint64_t)r->layer_first + r->layer_count;
  for (uint64_t mask = r->slots; mask; mask &= mask - 1) {
    uint32_t slot = (uint32_t)__builtin_ctzll(mask);
    uint64_t layer = r->layer_first;
    while (layer < end) {
      const sx_region *R = sx__rindex_key(p->remote, r->group, (uint32_t)layer, slot);
      if (R == NULL)
        return sx__err(SX_ENOREGION, "entry %u: the remote segment has no region for "
                       "group %u layer %lu slot %s", e, r->group, (unsigned long)layer,
                       slot_str(slot, s));
      const sx_region *L = sx__rindex_key(p->local, r->group, (uint32_t)layer, slot);
      if (L == NULL)
        return sx__err(SX_ENOREGION, "entry %u: no local region is registered for "
                       "group %u layer %lu slot %s", e, r->group, (unsigned long)layer,
                       slot_str(slot, s));
      if (access_check(p, R, e))
        return SX_EDENIED;
      if (R->block_bytes != L->block_bytes)
        return sx__err(SX_EINCOMPAT, "entry %u: block_bytes differs at group %u layer "
                       "%lu slot %s: local %lu, remote %lu", e, r->group,
                       (unsigned long)layer, slot_str(slot, s),
                       (unsigned long)L->block_bytes, (unsigned long)R->block_bytes);
      /* remote_block + count <= num_blocks, written so it cannot overflow. */
      if (r->count > R->num_blocks || r->remote_block > R->num_blocks - r->count)
        return sx__err(SX_EBOUNDS, "entry %u: remote blocks %lu..+%lu outside region %u "
                       "(%lu blocks)", e, (unsigned long)r->remote_block,
                       (unsigned long)r->count, R->id, (unsigned long)R->num_blocks);
      if (r->count > L->num_blocks || r->local_block > L->num_blocks - r->count)
        return sx__err(SX_EBOUNDS, "entry %u: local blocks %lu..+%lu outside local "
                       "region %u (%lu blocks)", e, (unsigned long)r->local_block,
                       (unsigned long)r->count, L->id, (unsigned long)L->num_blocks);
      uint64_t rend = (uint64_t)R->layer_first + R->layer_count;
      uint64_t lend = (uint64_t)L->layer_first + L->layer_count;
      layer = rend < lend ? rend : lend;
    }
  }
  return 0;
}

/* Pass one for a raw range entry. */
static int check_range(const sx__plan *p, const sx_range_read *r, uint32_t e) {
  uint64_t end;
  if (r->local == NULL || r->length == 0)
    return sx__err(SX_EINVAL, "entry %u: local is NULL or length is 0", e);
  const sx_region *R = sx__rindex_id(p->remote, r->remote_region);
  if (R == NULL)
    return sx__err(SX_ENOREGION, "entry %u: the remote segment has no region %u", e,
                   r->remote_region);
  if (access_check(p, R, e))
    return SX_EDENIED;
  if (!sx__add_ok(r->offset, r->length, &end))
    return sx__err(SX_EOVERFLOW, "entry %u: offset + length overflows 64 bits", e);
  if (end > R->length)
    return sx__err(SX_EBOUNDS, "entry %u: bytes %lu..%lu outside remote region %u "
                   "(%lu bytes)", e, (unsigned long)r->offset, (unsigned long)end, R->id,
                   (unsigned long)R->length);
  if (!sx__add_ok((uint64_t)(uintptr_t)r->local, r->length, &end))
    return sx__err(SX_EOVERFLOW, "entry %u: local + length overflows the address space",
                   e);
  if (p->need_lreg &&
      sx__rindex_addr(p->local, (uint64_t)(uintptr_t)r->local, r->length) == NULL)
    return sx__err(SX_EINVAL, "entry %u: the destination is not inside a registered "
                   "region (the transport needs registered memory)", e);
  return 0;
}

/* Remember R among the plan's remote regions (see sx__plan.rr).  Each new
 * range comes through rreg_note(), whose inline test skips the search for
 * the region of the range before (most of a request's). */
static void rreg_add(sx__plan *p, const sx_region *R) {
  p->rr_last = R;
  for (uint32_t i = 0; i < p->n_rr; i++)
    if (p->rr[i] == R)
      return;
  if (p->n_rr == SX__OP_RREGS)
    p->rr_over = 1;
  else
    p->rr[p->n_rr++] = R;
}

static inline void rreg_note(sx__plan *p, const sx_region *R) {
  if (R != p->rr_last)
    rreg_add(p, R);
}

/* R's index in rr (listed now if new), or -1 past SX__OP_RREGS. */
static int rr_index(sx__plan *p, const sx_region *R) {
  if (R != p->rr_last || p->rr_over) {
    rreg_add(p, R);
    if (p->rr_over)
      return -1;
    uint32_t i = 0;
    while (p->rr[i] != R)
      i++;
    p->rr_last_i = i;
  }
  return (int)p->rr_last_i;
}

/* Does range x continue with (R, L, roff, local)? */
static int continues(const sx_xfer *x, const sx_region *R, const sx_lregion *L,
                     uint64_t roff, uint8_t *local) {
  return x->shape == SX__XFER_RANGE && x->rreg == R && x->lreg == L && x->roff + x->length == roff &&
         x->local + x->length == local;
}

/* Emit one contiguous range for entry e; j is its (slot, layer) position in
 * the shape, or NONE (then the last range is the candidate to extend).  The
 * candidate is filled up to the slice size, the rest goes into new ranges
 * of at most the slice size. */
static int emit(sx__plan *p, size_t j, const sx_region *R, const sx_lregion *L,
                uint64_t roff, uint8_t *local, uint64_t len, uint32_t e) {
  size_t k = j == NONE ? (p->n ? p->n - 1 : NONE) : p->pos[j];
  p->bytes += len;
  if (k != NONE && p->x[k].length < p->slice && continues(&p->x[k], R, L, roff, local)) {
    uint64_t take = p->slice - p->x[k].length;
    if (take > len)
      take = len;
    p->x[k].length += take;
    p->x[k].entry_last = e;
    roff += take;
    local += take;
    len -= take;
    if (len == 0)
      return 0;
  }
  rreg_note(p, R);
  while (len > 0) {
    uint64_t piece = len < p->slice ? len : p->slice;
    if (p->n == p->cap && reserve(p, 1))
      return SX_ENOMEM;
    p->x[p->n++] = (sx_xfer){.local = local, .lreg = L, .rreg = R, .roff = roff,
                             .length = piece, .entry_first = e, .entry_last = e,
                             .status = 1};
    roff += piece;
    local += piece;
    len -= piece;
  }
  if (j != NONE)
    p->pos[j] = p->n - 1;
  return 0;
}

/* emit() where the range fits whole: it extends the range position j
 * last extended, or is a new range in room already reserved.  Anything
 * else (a cut at the slice size, no room, a raw range) goes to emit(),
 * which starts from the same plan.  Inline: an engine's request is
 * hundreds of one-block ranges, and the call was a tenth of planning. */
static inline int emit_whole(sx__plan *p, size_t j, const sx_region *R, const sx_lregion *L,
                             uint64_t roff, uint8_t *local, uint64_t len, uint32_t e) {
  size_t k = p->pos[j];
  if (k != NONE && continues(&p->x[k], R, L, roff, local)) {
    if (len > p->slice || p->x[k].length > p->slice - len)
      return emit(p, j, R, L, roff, local, len, e); /* fills it up, goes on in new ones */
    p->x[k].length += len;
    p->x[k].entry_last = e;
    p->bytes += len;
    return 0;
  }
  if (len > p->slice || p->n == p->cap)
    return emit(p, j, R, L, roff, local, len, e);
  rreg_note(p, R);
  p->x[p->n] = (sx_xfer){.local = local, .lreg = L, .rreg = R, .roff = roff, .length = len,
                         .entry_first = e, .entry_last = e, .status = 1};
  p->pos[j] = p->n++;
  p->bytes += len;
  return 0;
}

static inline sx__bshape shape_of(const sx_block_read *r) {
  return (sx__bshape){r->group, r->layer_first, r->layer_count, r->slots};
}

static inline int shape_is(const sx__bshape *k, const sx_block_read *r) {
  return k->group == r->group && k->layer_first == r->layer_first &&
         k->layer_count == r->layer_count && k->slots == r->slots;
}

/* Prepare the per-(slot, layer) merge positions for entry r's shape. */
static int shape_reset(sx__plan *p, const sx_block_read *r) {
  size_t need = (size_t)r->layer_count * slot_count(r->slots);
  if (need > p->pos_cap) {
    size_t *pos = realloc(p->pos, need * sizeof(*pos));
    if (pos == NULL)
      return SX_ENOMEM;
    p->pos = pos;
    p->pos_cap = need;
  }
  for (size_t i = 0; i < need; i++)
    p->pos[i] = NONE;
  p->have_shape = 1;
  p->sh = shape_of(r);
  return 0;
}

static inline int set_shape(sx__plan *p, const sx_block_read *r) {
  if (p->have_shape && shape_is(&p->sh, r))
    return 0;
  return shape_reset(p, r);
}

/* Pass two for a block entry that passed check_block(). */
static int emit_block(sx__plan *p, const sx_block_read *r, uint32_t e) {
  if (set_shape(p, r))
    return SX_ENOMEM;
  uint64_t end = (uint64_t)r->layer_first + r->layer_count;
  size_t si = 0;
  for (uint64_t mask = r->slots; mask; mask &= mask - 1, si++) {
    uint32_t slot = (uint32_t)__builtin_ctzll(mask);
    uint64_t layer = r->layer_first;
    while (layer < end) {
      const sx_region *R = sx__rindex_key(p->remote, r->group, (uint32_t)layer, slot);
      const sx_region *Lr = sx__rindex_key(p->local, r->group, (uint32_t)layer, slot);
      const sx_lregion *L = (const sx_lregion *)Lr;
      uint64_t rend = (uint64_t)R->layer_first + R->layer_count;
      uint64_t lend = (uint64_t)Lr->layer_first + Lr->layer_count;
      uint64_t stop = rend < lend ? rend : lend;
      if (stop > end)
        stop = end;
      uint64_t bb = R->block_bytes;
      int dense = R->block_stride == bb && Lr->block_stride == bb;
      /* The offsets below cannot overflow: blocks were checked against
       * num_blocks, and a valid region's whole span fits in 64 bits. */
      for (; layer < stop; layer++) {
        size_t j = si * r->layer_count + (size_t)(layer - r->layer_first);
        uint64_t roff = (layer - R->layer_first) * R->layer_stride +
                        r->remote_block * R->block_stride;
        uint8_t *local = (uint8_t *)(uintptr_t)(Lr->addr +
                                                (layer - Lr->layer_first) * Lr->layer_stride +
                                                r->local_block * Lr->block_stride);
        if (dense) {
          if (emit(p, j, R, L, roff, local, r->count * bb, e))
            return SX_ENOMEM;
          continue;
        }
        for (uint64_t b = 0; b < r->count; b++)
          if (emit(p, j, R, L, roff + b * R->block_stride, local + b * Lr->block_stride,
                   bb, e))
            return SX_ENOMEM;
      }
    }
  }
  return 0;
}

/*
 * The positions of entry r's shape (its group, layers and slots) into
 * p->sc, unless they are there already.  0; SX_ENOMEM; or -1 where the
 * shape has a position no region pair serves as check_block() requires
 * (missing, access, block_bytes), or too many positions to keep: the
 * caller then goes the long way, whose checks say what is wrong.  The
 * entry's own fields were checked (non-zero counts, no overflow).
 */
static int shape_fill(sx__plan *p, const sx_block_read *r) {
  p->sc_valid = 0;
  size_t need = (size_t)r->layer_count * slot_count(r->slots);
  if (need > SHAPE_MAX)
    return -1;
  if (need > p->sc_cap) {
    sx__ppos *sc = realloc(p->sc, need * sizeof(*sc));
    if (sc == NULL)
      return SX_ENOMEM;
    p->sc = sc;
    p->sc_cap = need;
  }
  uint32_t access = p->write ? SX_ACCESS_REMOTE_WRITE : SX_ACCESS_REMOTE_READ;
  uint64_t rmin = UINT64_MAX, lmin = UINT64_MAX, end = (uint64_t)r->layer_first + r->layer_count;
  size_t j = 0;
  for (uint64_t mask = r->slots; mask; mask &= mask - 1) {
    uint32_t slot = (uint32_t)__builtin_ctzll(mask);
    for (uint64_t layer = r->layer_first; layer < end; layer++, j++) {
      const sx_region *R = sx__rindex_key(p->remote, r->group, (uint32_t)layer, slot);
      const sx_region *L = sx__rindex_key(p->local, r->group, (uint32_t)layer, slot);
      if (R == NULL || L == NULL || !(R->access & access) || R->block_bytes != L->block_bytes)
        return -1;
      uint64_t bb = R->block_bytes;
      p->sc[j] = (sx__ppos){.R = R, .L = (const sx_lregion *)L,
                            .rbase = (layer - R->layer_first) * R->layer_stride,
                            .rstride = R->block_stride,
                            .lbase = L->addr + (layer - L->layer_first) * L->layer_stride,
                            .lstride = L->block_stride, .bb = bb,
                            .dense = R->block_stride == bb && L->block_stride == bb};
      rmin = R->num_blocks < rmin ? R->num_blocks : rmin;
      lmin = L->num_blocks < lmin ? L->num_blocks : lmin;
    }
  }
  p->sc_n = need;
  p->sc_tab = -1;
  p->sc_rblocks = rmin;
  p->sc_lblocks = lmin;
  p->sc_shape = shape_of(r);
  p->sc_valid = 1;
  return 0;
}

static inline int shape_load(sx__plan *p, const sx_block_read *r) {
  if (p->sc_valid && shape_is(&p->sc_shape, r))
    return 0;
  return shape_fill(p, r);
}

/* Does entry r have the shape whose positions are loaded, with its blocks
 * inside every region of it?  Inline, so that the run of like entries an
 * engine sends is checked without a call.  count - 1 wraps for a count of
 * 0, which then fails. */
static inline int entry_fits(const sx__plan *p, const sx_block_read *r) {
  return p->sc_valid && shape_is(&p->sc_shape, r) && r->count - 1 < p->sc_rblocks &&
         r->remote_block <= p->sc_rblocks - r->count && r->count <= p->sc_lblocks &&
         r->local_block <= p->sc_lblocks - r->count;
}

/* check_block() through the shape's positions: only the block ids are
 * compared per entry; anything else (or a failure) goes the long way,
 * which names what is wrong. */
static int check_entry(sx__plan *p, const sx_block_read *r, uint32_t e) {
  if (r->layer_count == 0 || r->slots == 0 || r->count == 0 ||
      r->layer_first > UINT32_MAX - (r->layer_count - 1))
    return check_block(p, r, e);
  int rc = shape_load(p, r);
  if (rc == SX_ENOMEM)
    return sx__err(SX_ENOMEM, "planning entry %u", e);
  if (rc == 0 && entry_fits(p, r))
    return 0;
  return check_block(p, r, e);
}

/* Can a table take the loaded shape?  Every destination in GPU memory of
 * one device, every region among the first SX__OP_RREGS: sets sc_tab, and
 * each position's region index and the pieces a block may need. */
static void tab_shape(sx__plan *p) {
  p->sc_tab = 0;
  uint64_t ppb = 0;
  for (size_t j = 0; j < p->sc_n; j++) {
    sx__ppos *q = &p->sc[j];
    const sx__mem_info *m = &q->L->mem;
    if (m->kind != SX__MEM_CUDA || (p->tab_device >= 0 && m->device != p->tab_device))
      return;
    p->tab_device = m->device;
    int ri = rr_index(p, q->R);
    if (ri < 0)
      return;
    q->ri = (uint32_t)ri;
    ppb += (q->bb + SX__GATHER_PIECE - 1) / SX__GATHER_PIECE;
  }
  p->sc_ppb = ppb;
  p->sc_tab = 1;
}

/* Table form of emit_whole(): len bytes at roff of region rr[ri] into
 * dst at the end of tab (nt pieces so far; the room was reserved),
 * extending the piece *k (the one its position wrote last, or NONE) where
 * both sides continue it and it stays within SX__GATHER_PIECE.  Returns
 * the new count; *k names the position's last piece.  The caller keeps
 * the counters: a store into tab could alias the plan's 64-bit fields, and
 * they would be reloaded for every piece. */
static inline size_t put_piece(sx__mem_bpiece *restrict tab, size_t nt, size_t *restrict k,
                               uint32_t ri, uint64_t roff, uint64_t dst, uint64_t len,
                               uint32_t e) {
  if (*k != NONE) {
    sx__mem_bpiece *q = &tab[*k];
    if (q->region == ri && q->dst + q->len == dst && q->src + q->len == roff &&
        len <= SX__GATHER_PIECE - q->len) {
      q->len += (uint32_t)len;
      q->entry_last = e;
      return nt;
    }
  }
  while (len > 0) {
    uint64_t piece = len < SX__GATHER_PIECE ? len : SX__GATHER_PIECE;
    tab[nt++] = (sx__mem_bpiece){.dst = dst, .src = roff, .len = (uint32_t)piece,
                                 .region = ri, .entry_first = e, .entry_last = e};
    dst += piece;
    roff += piece;
    len -= piece;
  }
  *k = nt - 1;
  return nt;
}

/* The pieces of entry r (of the loaded shape, passed check_entry) into
 * tab from nt, whose room was reserved; the new count.  bytes grows by
 * the entry's. */
static inline __attribute__((always_inline)) size_t put_entry(const sx__plan *p, sx__mem_bpiece *restrict tab, size_t nt,
                               size_t *restrict pos, const sx_block_read *r, uint32_t e,
                               uint64_t *bytes) {
  const sx__ppos *restrict sc = p->sc;
  for (size_t j = 0; j < p->sc_n; j++) {
    const sx__ppos *q = &sc[j];
    uint64_t roff = q->rbase + r->remote_block * q->rstride;
    uint64_t dst = q->lbase + r->local_block * q->lstride;
    *bytes += r->count * q->bb;
    if (q->dense) {
      nt = put_piece(tab, nt, &pos[j], q->ri, roff, dst, r->count * q->bb, e);
      continue;
    }
    for (uint64_t b = 0; b < r->count; b++)
      nt = put_piece(tab, nt, &pos[j], q->ri, roff + b * q->rstride, dst + b * q->lstride,
                     q->bb, e);
  }
  return nt;
}

/* emit_entry() into the table: 0; 1 when the table cannot take the entry
 * (it has turned into ranges: plan the entry as one); SX_ENOMEM. */
static int emit_entry_tab(sx__plan *p, const sx_block_read *r, uint32_t e) {
  if (p->sc_tab < 0)
    tab_shape(p);
  uint64_t need = r->count * p->sc_ppb;
  if (p->sc_tab == 0 || (p->tab_cap - p->n_tab < need && tab_reserve(p, need) != 0))
    return sx__plan_untable(p) ? SX_ENOMEM : 1;
  p->n_tab = put_entry(p, p->tab, p->n_tab, p->pos, r, e, &p->bytes);
  return 0;
}

/* emit_entry_tab() for the run of entries from r on (n at most) that have
 * the loaded shape, already a table one, and fit the reserved room: one
 * loop with the plan's counters held in locals (put_piece).  How many it
 * took: it stops at the first other entry, which goes the usual way. */
static size_t emit_run_tab(sx__plan *p, const sx_block_read *r, size_t n, uint32_t e0) {
  const sx__bshape *a = &p->sh, *b = &p->sc_shape;
  /* The merge positions (pos) are the loaded shape's too. */
  if (!p->tables || !p->sc_valid || p->sc_tab != 1 || !p->have_shape || a->group != b->group ||
      a->layer_first != b->layer_first || a->layer_count != b->layer_count ||
      a->slots != b->slots)
    return 0;
  sx__mem_bpiece *restrict tab = p->tab;
  size_t *restrict pos = p->pos;
  size_t nt = p->n_tab, room = p->tab_cap;
  uint64_t bytes = p->bytes, ppb = p->sc_ppb;
  size_t i = 0;
  uint64_t need;
  if (p->sc_n == 1 && p->sc[0].dense && ppb == 1) {
    /* One (slot, layer) a block, blocks of at most a piece: an engine's
     * entries of one tensor.  The same as put_entry(), with the position
     * and shape in locals (planning 1024 entries took about 30% less
     * time, 4.6 against 6.5 us, on the 2-core stand-in). */
    const sx__ppos q = p->sc[0];
    const sx__bshape sh = p->sc_shape;
    size_t k = pos[0];
    for (; i < n && shape_is(&sh, &r[i]) && r[i].count <= room - nt; i++) {
      uint64_t len = r[i].count * q.bb;
      bytes += len;
      nt = put_piece(tab, nt, &k, q.ri, q.rbase + r[i].remote_block * q.rstride,
                     q.lbase + r[i].local_block * q.lstride, len, e0 + (uint32_t)i);
    }
    pos[0] = k;
    p->n_tab = nt;
    p->bytes = bytes;
    return i;
  }
  for (; i < n && shape_is(&p->sc_shape, &r[i]) &&
         !__builtin_mul_overflow(r[i].count, ppb, &need) && need <= room - nt;
       i++)
    nt = put_entry(p, tab, nt, pos, &r[i], e0 + (uint32_t)i, &bytes);
  p->n_tab = nt;
  p->bytes = bytes;
  return i;
}

/* emit_block() through the shape's positions (entry r passed check_entry,
 * so its shape loads unless it has too many positions). */
static int emit_entry(sx__plan *p, const sx_block_read *r, uint32_t e) {
  if (shape_load(p, r) != 0) {
    if (p->tables && sx__plan_untable(p) != 0)
      return SX_ENOMEM;
    return emit_block(p, r, e);
  }
  if (set_shape(p, r))
    return SX_ENOMEM;
  if (p->tables) {
    int rc = emit_entry_tab(p, r, e);
    if (rc != 1)
      return rc;
  }
  for (size_t j = 0; j < p->sc_n; j++) {
    const sx__ppos *q = &p->sc[j];
    uint64_t roff = q->rbase + r->remote_block * q->rstride;
    uint8_t *local = (uint8_t *)(uintptr_t)(q->lbase + r->local_block * q->lstride);
    if (q->dense) {
      if (emit_whole(p, j, q->R, q->L, roff, local, r->count * q->bb, e))
        return SX_ENOMEM;
      continue;
    }
    for (uint64_t b = 0; b < r->count; b++)
      if (emit_whole(p, j, q->R, q->L, roff + b * q->rstride, local + b * q->lstride, q->bb,
                     e))
        return SX_ENOMEM;
  }
  return 0;
}

static int add_common(sx__plan *p, size_t n, const char *what) {
  if (p->broken)
    return sx__err(p->broken, "the batch ran out of memory while planning");
  if (n > UINT32_MAX - 1 - p->n_entries)
    return sx__err(SX_ELIMIT, "%s: a batch holds at most %u entries", what,
                   UINT32_MAX - 1);
  return 0;
}

int sx__plan_add_blocks(sx__plan *p, const sx_block_read *r, size_t n) {
  int rc = add_common(p, n, "sx_batch_add_blocks");
  if (rc)
    return rc;
  /* Each (slot, layer) of an entry is a range unless it extends the one
   * before: counted in the checking pass (an entry of the loaded shape
   * makes sc_n), for room for that many at once rather than by doubling
   * (a realloc and a copy each time).  Bounded, as merged runs need far
   * fewer and a larger block would come from mmap; a failure here is met
   * again, and reported, by emit().  The count saturates: one entry adds
   * at most 2^38. */
  size_t ranges = 0;
  for (size_t i = 0; i < n; i++) {
    if (entry_fits(p, &r[i]))
      ranges += p->sc_n;
    else if ((rc = check_entry(p, &r[i], p->n_entries + (uint32_t)i)) != 0)
      return rc;
    else
      ranges += (size_t)r[i].layer_count * slot_count(r[i].slots);
    ranges = ranges < SIZE_MAX / 4 ? ranges : SIZE_MAX / 4;
  }
  size_t want = ranges < PRERESERVE_MAX ? ranges : PRERESERVE_MAX;
  if (p->tables && p->n_entries == 0 && ranges < p->tab_min)
    p->tables = 0; /* small: ranges (nothing was written to a table yet) */
  if (p->tables && p->tab_device < 0 && p->sc_valid && p->sc_tab < 0)
    tab_shape(p); /* the loaded shape names the device: room at once, not by doubling */
  if (p->tables && p->tab_device >= 0)
    (void)tab_reserve(p, want);
  else
    (void)reserve(p, want);
  for (size_t i = 0; i < n;) {
    size_t run = emit_run_tab(p, r + i, n - i, p->n_entries + (uint32_t)i);
    if (run > 0) {
      i += run;
      continue;
    }
    if (emit_entry(p, &r[i], p->n_entries + (uint32_t)i)) {
      p->broken = SX_ENOMEM;
      return sx__err(SX_ENOMEM, "planning entry %zu", p->n_entries + i);
    }
    i++;
  }
  p->n_entries += (uint32_t)n;
  return 0;
}

int sx__plan_add_ranges(sx__plan *p, const sx_range_read *r, size_t n) {
  int rc = add_common(p, n, "sx_batch_add_ranges");
  if (rc || (rc = no_tables(p)) != 0)
    return rc;
  for (size_t i = 0; i < n; i++)
    if ((rc = check_range(p, &r[i], p->n_entries + (uint32_t)i)) != 0)
      return rc;
  p->have_shape = 0; /* a range entry ends any run of block entries */
  for (size_t i = 0; i < n; i++) {
    uint32_t e = p->n_entries + (uint32_t)i;
    const sx_region *R = sx__rindex_id(p->remote, r[i].remote_region);
    const sx_region *Lr = sx__rindex_addr(p->local, (uint64_t)(uintptr_t)r[i].local,
                                          r[i].length);
    if (emit(p, NONE, R, (const sx_lregion *)Lr, r[i].offset, r[i].local, r[i].length,
             e)) {
      p->broken = SX_ENOMEM;
      return sx__err(SX_ENOMEM, "planning entry %u", e);
    }
  }
  p->n_entries += (uint32_t)n;
  return 0;
}

/* The checks of a one-range entry e of len bytes at roff of R. */
static int check_xfer(const sx__plan *p, const sx_region *R, uint64_t roff, uint64_t len,
                      uint32_t e) {
  uint64_t end;
  if (access_check(p, R, e))
    return SX_EDENIED;
  if (!sx__add_ok(roff, len, &end) || end > R->length)
    return sx__err(SX_EBOUNDS, "entry %u: bytes outside remote region %u", e, R->id);
  return 0;
}

int sx__plan_add_run(sx__plan *p, const sx_region *R, const sx_lregion *L,
                     const uint64_t *roff, const uint64_t *local, const uint64_t *len,
                     uint32_t n) {
  int rc = add_common(p, n, "sx__plan_add_run");
  if (rc || (rc = access_check(p, R, p->n_entries)) != 0 || (rc = no_tables(p)) != 0)
    return rc;
  if (reserve(p, n)) {
    p->broken = SX_ENOMEM;
    return sx__err(SX_ENOMEM, "planning entry %u", p->n_entries);
  }
  p->have_shape = 0;
  uint64_t rlen = R->length, laddr = L->r.addr, llen = L->r.length;
  for (uint32_t k = 0; k < n; k++) {
    uint32_t e = p->n_entries;
    uint64_t b = len[k];
    /* Inside both regions, written so that nothing can overflow. */
    if (b == 0)
      return sx__err(SX_EINVAL, "entry %u: length is 0", e);
    if (b > rlen || roff[k] > rlen - b)
      return sx__err(SX_EBOUNDS, "entry %u: bytes outside remote region %u", e, R->id);
    if (b > llen || local[k] < laddr || local[k] - laddr > llen - b)
      return sx__err(SX_EBOUNDS, "entry %u: bytes outside local region %u", e, L->r.id);
    if (emit(p, NONE, R, L, roff[k], (uint8_t *)(uintptr_t)local[k], b, e)) {
      p->broken = SX_ENOMEM; /* a range longer than a slice needed more room */
      return sx__err(SX_ENOMEM, "planning entry %u", e);
    }
    p->n_entries++;
  }
  return 0;
}

/* The local region that holds every piece of iov into *out: 0, or the
 * error (said). */
static int scatter_region(const sx__plan *p, const struct iovec *iov, uint32_t n, uint32_t e,
                          const sx_lregion **out) {
  const sx_region *L = NULL;
  for (uint32_t i = 0; i < n; i++) {
    uint64_t a = (uint64_t)(uintptr_t)iov[i].iov_base, end;
    /* No piece is empty, so the reader never waits on a zero-length one. */
    if (a == 0 || iov[i].iov_len == 0 || !sx__add_ok(a, iov[i].iov_len, &end))
      return sx__err(SX_EINVAL, "entry %u: piece %u is NULL, empty or wraps", e, i);
    /* Most pieces lie in the region of the one before. */
    if (L != NULL && a >= L->addr && end <= L->addr + L->length)
      continue;
    const sx_region *Li = sx__rindex_addr(p->local, a, iov[i].iov_len);
    if (Li == NULL || L != NULL)
      return sx__err(SX_EINVAL, "entry %u: piece %u is not inside %s", e, i,
                     L == NULL ? "a registered region" : "the region of the first piece");
    L = Li;
  }
  const sx_lregion *l = (const sx_lregion *)L;
  if (l->mem.kind != SX__MEM_HOST)
    return sx__err(SX_ENOTSUP, "entry %u: scattered reads land in host memory only", e);
  *out = l;
  return 0;
}

int sx__plan_add_scatter(sx__plan *p, const sx_region *R, uint64_t roff,
                         const struct iovec *iov, uint32_t n) {
  int rc = add_common(p, 1, "sx__plan_add_scatter");
  if (rc || (rc = no_tables(p)) != 0)
    return rc;
  uint32_t e = p->n_entries;
  if (n == 0 || iov == NULL)
    return sx__err(SX_EINVAL, "entry %u: no pieces", e);
  uint64_t len = 0;
  for (uint32_t i = 0; i < n; i++)
    if ((len += iov[i].iov_len) > SX__SCATTER_MAX)
      return sx__err(SX_ELIMIT, "entry %u: a scattered range of more than %u bytes", e,
                     SX__SCATTER_MAX);
  const sx_lregion *L = NULL;
  if ((rc = scatter_region(p, iov, n, e, &L)) != 0 || (rc = check_xfer(p, R, roff, len, e)) != 0)
    return rc;
  if (reserve(p, 1)) {
    p->broken = SX_ENOMEM;
    return sx__err(SX_ENOMEM, "planning entry %u", e);
  }
  p->have_shape = 0;
  p->bytes += len;
  rreg_note(p, R);
  p->x[p->n++] = (sx_xfer){.local = iov[0].iov_base, .lreg = L, .rreg = R, .roff = roff,
                           .length = len, .entry_first = e, .entry_last = e, .status = 1,
                           .n_iov = n, .shape = SX__XFER_SCATTER, .iov = iov};
  p->n_entries++;
  return 0;
}

/* ------------------------------------------------------------ strided ranges */

/* Can the strided range of count pieces of len (strides lstride, rstride)
 * at (roff, local) extend x, a strided range of the same shape that ends
 * where it begins, within the slice size and the piece limit? */
static int stride_continues(const sx__plan *p, const sx_xfer *x, const sx_region *R,
                            const sx_lregion *L, uint64_t roff, uint64_t rstride,
                            const uint8_t *local, uint64_t lstride, uint64_t len,
                            uint32_t count) {
  if (x->shape != SX__XFER_STRIDED || x->rreg != R || x->lreg != L ||
      x->st.rstride != rstride || x->st.lstride != lstride || x->length / x->n_iov != len)
    return 0;
  uint64_t n = x->n_iov;
  return n + count < SX__STRIDED_MAX && x->length + (uint64_t)count * len <= p->slice &&
         x->roff + n * rstride == roff && x->local + n * lstride == local;
}

int sx__plan_add_strided(sx__plan *p, const sx_region *R, const sx_lregion *L, uint64_t roff,
                         uint64_t rstride, uint8_t *local, uint64_t lstride, uint64_t len,
                         uint32_t count) {
  int rc = add_common(p, 1, "sx__plan_add_strided");
  if (rc || (rc = no_tables(p)) != 0)
    return rc;
  uint32_t e = p->n_entries;
  if (len == 0 || count == 0 || local == NULL || L == NULL)
    return sx__err(SX_EINVAL, "entry %u: no pieces (local or its region NULL, length or "
                   "count 0)", e);
  if (count > 1 && (lstride < len || rstride < len))
    return sx__err(SX_EINVAL, "entry %u: pieces of %lu bytes overlap at a %s stride of %lu",
                   e, (unsigned long)len, lstride < len ? "local" : "remote",
                   (unsigned long)(lstride < len ? lstride : rstride));
  if (access_check(p, R, e))
    return SX_EDENIED;
  /* The last piece starts at (count - 1) * stride past the first: each
   * end computed without overflow, and checked with the first's. */
  uint64_t total, rlast, rend, lbase = (uint64_t)(uintptr_t)local, llast, lend;
  uint64_t k = count - 1;
  if (__builtin_mul_overflow(len, (uint64_t)count, &total) ||
      __builtin_mul_overflow(k, rstride, &rlast) || !sx__add_ok(roff, rlast, &rlast) ||
      !sx__add_ok(rlast, len, &rend) || __builtin_mul_overflow(k, lstride, &llast) ||
      !sx__add_ok(lbase, llast, &llast) || !sx__add_ok(llast, len, &lend))
    return sx__err(SX_EOVERFLOW, "entry %u: %u pieces of %lu bytes at strides %lu (remote) "
                   "and %lu (local) overflow 64 bits", e, count, (unsigned long)len,
                   (unsigned long)rstride, (unsigned long)lstride);
  if (roff + len > R->length || rend > R->length)
    return sx__err(SX_EBOUNDS, "entry %u: pieces at bytes %lu..%lu outside remote region %u "
                   "(%lu bytes)", e, (unsigned long)roff, (unsigned long)rend, R->id,
                   (unsigned long)R->length);
  if (lbase < L->r.addr || lend > L->r.addr + L->r.length)
    return sx__err(SX_EBOUNDS, "entry %u: pieces at 0x%lx..0x%lx outside local region %u "
                   "(0x%lx, %lu bytes)", e, (unsigned long)lbase, (unsigned long)lend,
                   L->r.id, (unsigned long)L->r.addr, (unsigned long)L->r.length);
  p->have_shape = 0;
  /* One strided xfer where the transport takes it and it is not simply
   * one contiguous run; else the pieces as ranges, merged and sliced as
   * emit() does, so such a transport sees what it saw before. */
  int strided = p->strided && count > 1 && !(lstride == len && rstride == len) &&
                count < SX__STRIDED_MAX && lstride <= UINT32_MAX && rstride <= UINT32_MAX;
  if (!strided) {
    for (uint64_t i = 0; i < count; i++)
      if (emit(p, NONE, R, L, roff + i * rstride, local + i * lstride, len, e)) {
        p->broken = SX_ENOMEM;
        return sx__err(SX_ENOMEM, "planning entry %u", e);
      }
    p->n_entries++;
    return 0;
  }
  p->bytes += total;
  sx_xfer *x = p->n ? &p->x[p->n - 1] : NULL;
  if (x != NULL &&
      stride_continues(p, x, R, L, roff, rstride, local, lstride, len, count)) {
    x->n_iov += count;
    x->length += total;
    x->entry_last = e;
    p->n_entries++;
    return 0;
  }
  if (reserve(p, 1)) {
    p->broken = SX_ENOMEM;
    return sx__err(SX_ENOMEM, "planning entry %u", e);
  }
  rreg_note(p, R);
  p->n_strided++;
  p->x[p->n++] = (sx_xfer){.local = local, .lreg = L, .rreg = R, .roff = roff,
                           .length = total, .entry_first = e, .entry_last = e,
                           .status = 1, .n_iov = count, .shape = SX__XFER_STRIDED,
                           .st = {(uint32_t)lstride, (uint32_t)rstride}};
  p->n_entries++;
  return 0;
}
