/*
 * The batch planner: block reads and raw range reads -> sx_xfer ranges.
 * Not installed.
 *
 * Every entry is checked against both sides before anything is sent: the
 * (group, layer, slot) keys exist, the remote region allows remote reads,
 * block sizes agree and every block and byte range lies inside its region
 * (overflow-safe).  Contiguous runs are merged (both sides contiguous, also
 * across consecutive entries of the same shape) and ranges are cut at the
 * slice size so large transfers spread over connections.
 *
 * Cost: regions are indexed by key, id and address (sorted arrays, binary
 * search; key lookups from a dense table where the layout allows, see
 * sx__rindex), each entry looks a region up once per region it crosses,
 * and the output grows by doubling: no allocation per block.
 *
 * Threading: an index is immutable once built and may be read by many
 * threads; a plan belongs to one batch and is used by one thread at a time.
 */
#ifndef SX_AGENT_PLANNER_H
#define SX_AGENT_PLANNER_H

#include <stddef.h>
#include <stdint.h>

#include "segxfer/agent.h"
#include "transport/transport.h"

/* Regions of one side, sorted three ways.  Entries point into the caller's
 * storage (a descriptor's region array, or sx_lregion.r of registered
 * regions), which must outlive the index.
 *
 * Key lookups run once per (slot, layer) of every block entry, twice (the
 * check and the emit pass) on each side, so they lead the planner's cost.
 * Where the keys fill a small box (an engine's layout: a few groups and
 * slots, every layer), the index also holds the answer for every key of
 * the box in one table, filled from the search at build time: a lookup is
 * then O(1) and gives what the search gives by construction.  The table is
 * part of the immutable index, so it is never stale: a new descriptor or a
 * new registration builds a new index. */
typedef struct sx__rindex {
  uint32_t n;
  const sx_region **by_key;  /* (group, slot, layer_first) */
  const sx_region **by_id;
  const sx_region **by_addr;
  const sx_region **dense;   /* [(g - g0) * ns + (s - s0)] * nl + (l - l0), or NULL */
  uint32_t g0, ng, s0, ns, l0, nl;
} sx__rindex;

/* The most cells of a dense table (8 bytes each), and of cells per region:
 * a sparse layout (layers far apart) keeps to the search. */
#define SX__RINDEX_DENSE_MAX (1u << 16)
#define SX__RINDEX_DENSE_PER_REGION 256u

/* Build from n region pointers.  0 or SX_ENOMEM. */
int sx__rindex_build(sx__rindex *ix, const sx_region *const *regions, uint32_t n);
/* Build over a descriptor's regions. */
int sx__rindex_build_desc(sx__rindex *ix, const sx_desc *d);
void sx__rindex_free(sx__rindex *ix);

/* The region holding (group, layer, slot) (sx__rindex_key: from the dense
 * table when there is one, else by sx__rindex_key_search), by id, or
 * containing the byte range [addr, addr+len); NULL if none.  Inline, as
 * the planner calls it four times per (slot, layer) of each entry. */
const sx_region *sx__rindex_key_search(const sx__rindex *ix, uint32_t group, uint32_t layer,
                                       uint32_t slot);
static inline const sx_region *sx__rindex_key(const sx__rindex *ix, uint32_t group,
                                              uint32_t layer, uint32_t slot) {
  if (ix->dense == NULL)
    return sx__rindex_key_search(ix, group, layer, slot);
  /* Unsigned differences: a key below the box wraps to a large value. */
  uint32_t g = group - ix->g0, s = slot - ix->s0, l = layer - ix->l0;
  if (g >= ix->ng || s >= ix->ns || l >= ix->nl)
    return NULL; /* no region has a key outside the box */
  return ix->dense[((size_t)g * ix->ns + s) * ix->nl + l];
}
const sx_region *sx__rindex_id(const sx__rindex *ix, uint32_t id);
const sx_region *sx__rindex_addr(const sx__rindex *ix, uint64_t addr, uint64_t len);

/* The default cut for long ranges. */
#define SX__PLAN_SLICE (1u << 20)
/* The longest scattered range (the TCP target serves reads of up to 64 MiB). */
#define SX__SCATTER_MAX (64u << 20)

/* A block entry's shape: what the (slot, layer) positions of its ranges
 * depend on. */
typedef struct sx__bshape {
  uint32_t group, layer_first, layer_count;
  uint64_t slots;
} sx__bshape;

/* Where one (slot, layer) of a block entry's shape reads and lands. */
typedef struct sx__ppos {
  const sx_region *R;
  const sx_lregion *L;
  uint64_t rbase, rstride; /* the layer's offset in R; a block's */
  uint64_t lbase, lstride; /* the layer's address in L; a block's */
  uint64_t bb;             /* block_bytes, the same on both sides */
  int dense;               /* blocks back to back on both sides */
  uint32_t ri;             /* tables: R's index in the plan's rr */
} sx__ppos;

typedef struct sx__plan {
  const sx__rindex *remote;
  const sx__rindex *local; /* its regions are sx_lregion.r */
  uint64_t slice;
  int need_lreg;           /* raw range destinations must be registered */
  int write;               /* push: local is the source, the remote region
                            * must allow remote writes (set after init) */
  int strided;             /* the transport takes strided xfers (its ops have
                            * SX__TR_STRIDED; set after init) */
  sx_xfer *x;              /* the ranges so far */
  size_t n, cap;
  uint64_t bytes;          /* sum of the ranges' lengths */
  uint32_t n_entries;
  int broken;              /* an allocation failed half-way: unusable */
  /* Merging across entries: the shape of the last block entry and, per
   * (slot, layer) of it, the index of the range it last extended. */
  int have_shape;
  sx__bshape sh;
  size_t *pos;
  size_t pos_cap;
  /* The regions of every (slot, layer) of the last shape checked, and the
   * fewest blocks any of them holds on each side: entries of one shape
   * (an engine's are all alike) look nothing up again. */
  int sc_valid;
  sx__bshape sc_shape;
  sx__ppos *sc;
  size_t sc_n, sc_cap;
  uint64_t sc_rblocks, sc_lblocks;
  /* The remote regions of the ranges so far, each once (for sx_op.rregs),
   * unless there were more than SX__OP_RREGS (rr_over); the region of
   * the last range added; how many ranges are strided. */
  const sx_region *rr[SX__OP_RREGS];
  uint32_t n_rr;
  int rr_over;
  const sx_region *rr_last;
  uint32_t n_strided;
  /* Tables (set after init: a cuda_ipc read batch, see sx__plan_tables):
   * block entries become gather-table pieces, written here on the
   * caller's thread straight into pinned memory that the GPU reads, each
   * piece's source relative to its region (index in rr); x stays empty.
   * The first entry that a table cannot take (other memory, another
   * device, more than SX__GATHER_BASES regions, any entry but blocks)
   * turns the pieces into ranges (tables 0) and planning goes on so. */
  int tables;
  sx__mem_bpiece *tab;     /* pinned, from sx__mem_pinned_get */
  size_t n_tab, tab_cap;   /* pieces; room for */
  size_t tab_bytes;        /* the pinned buffer's size */
  int tab_device;          /* every piece's destination device, -1 before the first */
  uint32_t rr_last_i;      /* rr index of rr_last */
  uint32_t tab_min;        /* ranges the first block entries must make */
  int sc_tab;              /* the loaded shape in a table: 1 yes, 0 no, -1 not asked */
  uint64_t sc_ppb;         /* its pieces per block, at most */
} sx__plan;

void sx__plan_init(sx__plan *p, const sx__rindex *remote, const sx__rindex *local,
                   uint64_t slice, int need_lreg);
void sx__plan_free(sx__plan *p);
/* Plan block entries into a gather table from now on (before the first
 * entry), unless the first sx__plan_add_blocks call makes fewer than min
 * ranges (before merging): a small request goes as ranges, which measured
 * as fast or faster there (docs/gpu.md).  Where no pinned memory can be
 * had (no CUDA driver), planning goes on with ranges. */
void sx__plan_tables(sx__plan *p, uint32_t min);
#define SX__PLAN_TABLE_MIN 256
/* A table's largest pinned buffer (256k pieces): a batch that needs more
 * goes as ranges, which grow in ordinary memory. */
#define SX__PLAN_TABLE_MAX (8u << 20)
/* Turn the table's pieces into ranges (the table goes back to the pool):
 * for a transport that does not take tables.  0, or SX_ENOMEM (the plan
 * is then broken). */
int sx__plan_untable(sx__plan *p);

/*
 * Plan n entries, numbered from p->n_entries on.  All or nothing: if any
 * entry fails its checks, nothing of this call is added and sx_errmsg()
 * names the entry (SX_EINVAL, SX_ENOREGION, SX_EDENIED, SX_EBOUNDS,
 * SX_EOVERFLOW, SX_EINCOMPAT, SX_ELIMIT).  SX_ENOMEM may leave the plan
 * broken; every later call then fails with it.
 */
int sx__plan_add_blocks(sx__plan *p, const sx_block_read *r, size_t n);
int sx__plan_add_ranges(sx__plan *p, const sx_range_read *r, size_t n);
/* n one-range entries from remote region R into local region L (a run of
 * a set read's expansion, or one range into the agent's ping scratch, which
 * is registered outside the published table): entry k is len[k] bytes at
 * roff[k] of R into local[k].  Each range is checked to lie inside R and
 * inside L; the access of R once.  Returns 0, or the error (said) of the
 * first entry that fails, the entries before it added. */
int sx__plan_add_run(sx__plan *p, const sx_region *R, const sx_lregion *L,
                     const uint64_t *roff, const uint64_t *local, const uint64_t *len,
                     uint32_t n);
/* One entry and one range, never merged with another nor sliced: the
 * bytes at roff of remote region R (as long as the n pieces of iov
 * together, at most SX__SCATTER_MAX) scattered into the pieces, which must
 * all lie in one registered local region of host memory.  For transports
 * that take scattered ranges (sx_xfer.iov: TCP); iov must live until the
 * batch ends. */
int sx__plan_add_scatter(sx__plan *p, const sx_region *R, uint64_t roff,
                         const struct iovec *iov, uint32_t n);
/* The most pieces of one strided xfer (sx_xfer.n_iov is 30 bits). */
#define SX__STRIDED_MAX (1u << 30)
/* One entry of count pieces of len bytes: piece k from roff + k * rstride
 * of remote region R into local + k * lstride, inside local region L (the
 * caller found L; every piece is checked against it and against R, first
 * and last, overflow-safe; pieces may not overlap: each stride is at least
 * len unless count is 1).  Where the plan's transport takes strided xfers
 * (p->strided) it is one xfer (extending the last one where it continues
 * it at the same strides, up to the slice size), else count ranges,
 * merged and sliced as block pieces are.  Read plans of token-major
 * caches (per-token pieces at a fixed local stride) come this way. */
int sx__plan_add_strided(sx__plan *p, const sx_region *R, const sx_lregion *L, uint64_t roff,
                         uint64_t rstride, uint8_t *local, uint64_t lstride, uint64_t len,
                         uint32_t count);

#endif
