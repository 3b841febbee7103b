/*
 * Read plans inside the library (segxfer/plan.h is the public face): the
 * plan's parts, and its expansion into byte ranges for one request's
 * blocks, which agent/group.c turns into batch entries.  Not installed.
 */
#ifndef SX_META_PLAN_INT_H
#define SX_META_PLAN_INT_H

#include <stdint.h>

#include "segxfer/plan.h"

/* One contiguous piece of a unit: len bytes at roff of a remote block of
 * `member` go to loff of a local block.  Unit q of a block (q counted in
 * that side's block) adds q * rshift remotely and q * lshift locally. */
typedef struct sx__piece {
  uint32_t member;
  uint64_t roff, loff, len, rshift;
} sx__piece;

/* How one local group (and the slots of it that one description covers)
 * is read.  Whole groups (no description) copy block for block from
 * member 0: one piece of block_bytes, kl = kr = 1. */
typedef struct sx__pgroup {
  uint32_t group;
  uint64_t slots;        /* the slots it covers */
  uint64_t mask;         /* described: the members it may read from (those
                          * holding its layers: a pipeline stage's) */
  int whole;
  uint32_t unit;         /* tokens per unit (described groups) */
  uint32_t kl, kr;       /* units per local, per remote block */
  uint64_t lshift;
  uint32_t first, n;     /* pieces */
  sx_block_desc ldesc;   /* for the words */
} sx__pgroup;

/* A local key run the plan covers. */
typedef struct sx__pkey {
  uint32_t group, slot, layer_first, layer_count, pg;
} sx__pkey;

struct sx_plan {
  uint32_t n_members;
  char (*names)[SX_NAME_MAX + 1];
  sx_block_desc *rdesc;  /* [group * n_members + member]: each member's
                          * description of each planned group (zero when
                          * whole) */
  sx__pgroup *groups;
  uint32_t n_groups, cap_groups;
  sx__piece *pieces;
  uint32_t n_pieces, cap_pieces;
  sx__pkey *keys;
  uint32_t n_keys, cap_keys;
};

/* A run of ranges of an expanded plan: n ranges (at most SX__PRUN_MAX) of
 * one member, all from remote region R (in remotes[member]) into local
 * region L; range k is len[k] bytes at roff[k] of R to laddr[k], filling
 * local block block[k] (an index into the local block list).  Runs, not
 * single ranges, so that a consumer pays its call, its region lookups and
 * its checks once per run: a plan read's ranges are many and small.
 *
 * With count > 1 each range stands for count pieces of len[k] bytes, piece
 * i at roff[k] + i * rstride into laddr[k] + i * lstride (a token-major
 * split: a member's piece of every token of a unit, at fixed strides on
 * both sides, neither below the piece length). */
#define SX__PRUN_MAX 64
typedef struct sx__prun {
  uint32_t member;
  const sx_region *R, *L;
  uint32_t n;
  uint32_t count;
  uint64_t rstride, lstride;
  uint64_t roff[SX__PRUN_MAX], laddr[SX__PRUN_MAX], len[SX__PRUN_MAX];
  uint32_t block[SX__PRUN_MAX];
} sx__prun;

typedef int (*sx__prun_fn)(void *arg, const sx__prun *run);

/*
 * Expand plan p for one request: local blocks lb[0..nl) hold the request's
 * tokens in order, as remote blocks rb[0..nr) of every member do.  Units
 * past the shorter list are not read.  Every block id is checked against
 * its region's num_blocks, every key looked up in `local` and the members
 * (the descriptors the plan was made from, or later ones with the same
 * keys): SX_EBOUNDS, SX_ENOREGION, SX_EINVAL, with nothing emitted.  Then
 * fn runs for every run of ranges in order: key by key, layer by layer,
 * and within a layer member by member, each member's ranges in unit order;
 * its non-zero return stops the expansion and is returned.
 */
int sx__plan_expand(const sx_plan *p, const sx_desc *local, const sx_desc *const *remotes,
                    uint32_t n_remotes, const uint64_t *rb, size_t nr, const uint64_t *lb,
                    size_t nl, sx__prun_fn fn, void *arg);
/* The expansion's two halves, for a read that starts each member's batch
 * as soon as it is planned (agent/group.c): sx__plan_check() is the first
 * pass alone (every check above, nothing emitted), sx__plan_emit() the
 * second for the members in the bit mask `members` only (bit i: member i),
 * in the same order, after a check of the same arguments.  Its lookups can
 * still fail (SX_ENOREGION) if the descriptors changed in between. */
int sx__plan_check(const sx_plan *p, const sx_desc *local, const sx_desc *const *remotes,
                   uint32_t n_remotes, const uint64_t *rb, size_t nr, const uint64_t *lb,
                   size_t nl);
int sx__plan_emit(const sx_plan *p, const sx_desc *local, const sx_desc *const *remotes,
                  uint32_t n_remotes, const uint64_t *rb, size_t nr, const uint64_t *lb,
                  size_t nl, uint64_t members, sx__prun_fn fn, void *arg);

#endif
