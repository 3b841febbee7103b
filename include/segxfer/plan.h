/*
 * Read plans: how a reader with one layout reads blocks from segments with
 * another (docs/architecture.md, "Block descriptions and read plans").
 *
 * sx_layout_check() answers "equal or not".  When both sides describe their
 * blocks (sx_block_desc: tokens per block, the KV heads held, head_dim,
 * dtype, NHD/HND/MLA order), layouts that differ can still fit: another
 * tensor-parallel split (the reader's heads live on several remote ranks,
 * or on a part of one), GQA replication (several remote ranks hold the same
 * heads), block sizes in an integer ratio, token-major against head-major.
 * sx_layout_plan() decides that once, from the descriptors alone, and
 * returns the plan: for every local block, which remote segment, which byte
 * pieces of which remote block go where in it; or SX_EINCOMPAT with the
 * first thing that does not fit in *mismatch.  Nothing is read to decide.
 *
 * The plan works in units of min(local, remote) tokens per block: a local
 * block is kl units, a remote block kr units (one of them is 1), and the
 * pieces of one unit are the same for every unit, shifted.  Pieces are
 * merged where both sides are contiguous: a head slice of an HND block is
 * one piece, NHD splits are one piece per token, equal layouts one piece
 * per block.
 *
 * Groups without a description are read whole, block for block, from the
 * first segment, which must then hold them with equal block_bytes, tag and
 * dtype (the sx_layout_check() rules); a set of more than one segment needs
 * descriptions.  A set split by pipeline stage is planned in bands of
 * layers: each band is read from the members holding its layers (a TP rank
 * may then repeat across stages, not within one).
 *
 * Threading: a plan is immutable once made; any thread may read it.
 */
#ifndef SEGXFER_PLAN_H
#define SEGXFER_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "segxfer/descriptor.h"
#include "segxfer/layout.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sx_plan sx_plan;

/*
 * Plan reads into `local` from the set remotes[0..n) (n >= 1, at most
 * SX_PLAN_MAX_MEMBERS; for a tensor-parallel set, in any order).  flags:
 * SX_CHECK_IGNORE_FINGERPRINT.  Returns 0 with *out (free with
 * sx_plan_free()), SX_EINCOMPAT with the first misfit in *mismatch (may be
 * NULL; its message names the group, head or segment), SX_ELIMIT when a
 * group would need more than SX_PLAN_MAX_PIECES pieces per unit, SX_EINVAL
 * on NULL input, SX_ENOMEM.  The descriptors are not kept: the plan holds
 * the segment names, the pieces and the local keys it covers.
 */
#define SX_PLAN_MAX_MEMBERS 64
#define SX_PLAN_MAX_PIECES 65536
SX_EXTERN int sx_layout_plan(const sx_desc *local, const sx_desc *const *remotes,
                             uint32_t n, unsigned flags, sx_plan **out,
                             sx_mismatch *mismatch);

/* NULL is a no-op. */
SX_EXTERN void sx_plan_free(sx_plan *p);

typedef struct sx_plan_info {
  uint32_t members;        /* remote segments in the set */
  uint32_t used;           /* of them, those the plan reads from */
  uint32_t groups;         /* local groups planned */
  uint32_t pieces;         /* pieces per unit, over every group */
  uint32_t whole;          /* 1 when every group reads whole, equal blocks */
} sx_plan_info;

SX_EXTERN int sx_plan_info_get(const sx_plan *p, sx_plan_info *out);

/*
 * The plan in words, one line per group and remote segment, e.g.
 *   group 0 (K,V, layers 0-3): reads heads 4-7 of each block of prefill-0/tp1
 *     into heads 4-7 of a local block: 1 piece of 2048 B per 16 tokens (HND)
 * On success *text is a malloc()ed string the caller frees.
 */
SX_EXTERN int sx_plan_text(const sx_plan *p, char **text);

#ifdef __cplusplus
}
#endif
#endif /* SEGXFER_PLAN_H */
