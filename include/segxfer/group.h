/*
 * Segment sets: fan-in and fan-out reads (docs/architecture.md, "Block
 * descriptions and read plans").
 *
 * A decode rank whose KV heads live on several prefill ranks (or on a part
 * of one) opens them as a set and reads one request's blocks from all of
 * them as one read: one deadline, one result, failed blocks named by their
 * local block ids.  The set is planned once, at open, from the published
 * block descriptions (segxfer/plan.h); a set that cannot fill the local
 * blocks (an impossible ratio, heads missing or overlapping, a rank not
 * published) is refused there, before any byte moves.
 *
 * Threading: open, read and close wait for the agent thread: not from a
 * callback (SX_EBUSY).  One read at a time per set; a set belongs to its
 * agent and must be closed before it.
 */
#ifndef SEGXFER_GROUP_H
#define SEGXFER_GROUP_H

#include <stddef.h>
#include <stdint.h>

#include "segxfer/agent.h"
#include "segxfer/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sx_group sx_group;

typedef struct sx_group_params {
  /* The set, by names (n_names of them)... */
  const char *const *names;
  uint32_t n_names;
  /* ...or by engine name and tp size: "<engine>/tp0" .. "<engine>/tp<N-1>"
   * (used when names is NULL). */
  const char *engine;
  uint32_t tp_size;
  /* How long to wait for every member to be published (default 5000). */
  uint32_t timeout_ms;
  unsigned flags; /* SX_CHECK_IGNORE_FINGERPRINT */
  /* ...or by a glob pattern over the namespace's live segment names
   * ("prefill-0/tp*"; '*' also matches '/'), used when names and engine
   * are NULL: the names listed now (one store round trip on a connection
   * of its own), sorted, at most SX_PLAN_MAX_MEMBERS.  A rank that is not
   * published is then missing from the set, which the plan refuses
   * (heads_missing) unless the others hold its heads. */
  const char *pattern;
} sx_group_params;

SX_EXTERN void sx_group_params_init(sx_group_params *p);

/*
 * Open every member (sx_segment_open, one deadline for all), plan the set
 * against this agent's layout and registered regions, and keep both.
 * Errors: SX_EINCOMPAT with the first misfit in *mismatch (may be NULL),
 * SX_ENOENT naming the member not published in time (a missing rank) or
 * the pattern no live segment matches, SX_EINVAL (no names, more than
 * SX_PLAN_MAX_MEMBERS, a name too long), store errors (pattern),
 * the open errors, SX_EBUSY on the agent thread.
 */
SX_EXTERN int sx_group_open(sx_agent *a, const sx_group_params *p, sx_group **out,
                            sx_mismatch *mismatch);

/* Close the members and free the set.  NULL is a no-op. */
SX_EXTERN void sx_group_close(sx_group *g);

SX_EXTERN uint32_t sx_group_size(const sx_group *g);
/* Member i (valid until sx_group_close()), or NULL past the end. */
SX_EXTERN sx_segment *sx_group_segment(const sx_group *g, uint32_t i);
/* The plan made at open (valid until sx_group_close()). */
SX_EXTERN const sx_plan *sx_group_plan(const sx_group *g);

typedef struct sx_group_result {
  sx_batch_state state;   /* COMPLETED, FAILED, TIMEOUT or CANCELLED */
  int error;              /* first error (0 when COMPLETED) */
  char message[256];      /* what failed, with the member's name */
  uint64_t bytes;         /* bytes that arrived, over every member */
  uint32_t n_ranges;      /* ranges posted, over every member */
  uint32_t members;       /* members read from */
  uint32_t n_failed;
  const uint64_t *failed; /* local block ids with a piece that did not
                           * arrive, in the order of local_blocks; valid
                           * until the next read or close */
  uint64_t transfer_ns;   /* first submit -> last end */
} sx_group_result;

/*
 * Read one request: remote_blocks[0..n_remote) are its blocks on every
 * member (a tensor-parallel engine's ranks share one block table),
 * local_blocks[0..n_local) where it goes here, both in token order.
 * Every block id and key is checked first (SX_EBOUNDS, SX_ENOREGION,
 * nothing sent); then member by member the plan is expanded into one batch
 * per member read from, submitted as soon as it is filled (the first
 * member's copies run while the next is planned), all under one deadline
 * of timeout_ms (0: 30000), and waited for.  A member whose batch cannot
 * be made or filled (its regions refuse remote reads: SX_EDENIED) refuses
 * the read if no member has started yet, else fails only its own blocks.
 * Returns 0 when the read ran (whatever its outcome: see out->state and
 * out->failed), or the error that kept it from starting.
 */
SX_EXTERN int sx_group_read(sx_group *g, const uint64_t *remote_blocks, size_t n_remote,
                            const uint64_t *local_blocks, size_t n_local,
                            uint32_t timeout_ms, sx_group_result *out);

/*
 * sx_group_read with read notices (segxfer/push.h, SX_BATCH_NOTIFY): every
 * member read from gets its own notice carrying notify_tag and the ranges
 * of its memory this read took, once every byte from it arrived, so each
 * prefill rank of a set frees its blocks on its own notice.  A member whose
 * batch fails, times out or is cancelled gets none.  The notice lists the
 * member's ranges merged where contiguous: a head slice of token-major (NHD)
 * blocks is one range per token, and more than SX_NOTICE_MAX_ENTRIES of them
 * for one member is refused before anything is sent (SX_ELIMIT): every
 * member's batch is filled before any is submitted.
 */
SX_EXTERN int sx_group_read_notify(sx_group *g, const uint64_t *remote_blocks,
                                   size_t n_remote, const uint64_t *local_blocks,
                                   size_t n_local, uint32_t timeout_ms, uint64_t notify_tag,
                                   sx_group_result *out);

/* One segment's plan against this agent's layout: sx_layout_plan(local,
 * {remote}, 1, ...).  The caller frees it with sx_plan_free(). */
SX_EXTERN int sx_segment_plan(sx_segment *s, unsigned flags, sx_plan **out,
                              sx_mismatch *mismatch);

#ifdef __cplusplus
}
#endif
#endif /* SEGXFER_GROUP_H */
