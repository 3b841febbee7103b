/*
 * Push mode: a producer writes blocks into memory a consumer registered and
 * published writable, and the consumer learns from a notice that a batch of
 * writes has arrived (docs/push.md is the reference).
 *
 * Producer side: a write batch is an ordinary batch (sx_batch_create()) whose
 * params carry SX_BATCH_WRITE and a caller-chosen 64-bit tag.  Its entries
 * are planned at add time like reads (mapped onto region pairs, contiguous
 * runs merged, every range checked against both sides), and it has the same
 * states, deadline, cancel, fd and callback.  It ends COMPLETED only when
 * every byte is in the consumer's memory and the consumer has accepted the
 * batch's notice; it never ends COMPLETED after a failure.
 *
 * Consumer side: regions registered with SX_ACCESS_REMOTE_WRITE may be
 * written by producers this agent granted (sx_agent_grant_write()).  A
 * producer proves who it is on the data plane with its own segment name,
 * incarnation and access token, which the consumer checks against the
 * producer's descriptor in the store; a write from anyone else, into a
 * region that is not writable, for another incarnation of this agent or out
 * of bounds is refused before any byte lands, with a code and a message the
 * producer's batch reports.  After every byte of a batch has landed, the
 * producer sends a notice; the consumer queues it (readable through an
 * eventfd) and runs its notice callback, if any.  A producer that dies or
 * is revoked mid-batch delivers no notice at all: a notice always means
 * "complete".
 *
 * Threading: as in agent.h.  Notice callbacks run on the agent thread and
 * must not block.
 */
#ifndef SEGXFER_PUSH_H
#define SEGXFER_PUSH_H

#include <stddef.h>
#include <stdint.h>

#include "segxfer/agent.h"
#include "segxfer/descriptor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* sx_batch_params.flags */
enum {
  SX_BATCH_WRITE = 1u << 0, /* a write batch (push); entries are writes */
  SX_BATCH_NOTIFY = 1u << 1, /* a read batch that ends with a read notice */
};

/*
 * Read notices (pull mode, docs/push.md "Read notices").  A read batch
 * created with SX_BATCH_NOTIFY in sx_batch_params.flags (not with
 * SX_BATCH_WRITE) carries sx_batch_params.tag to the target: once every
 * range of the batch arrived, the reader sends the target one notice
 * (kind SX_NOTICE_READ) naming itself, the tag and the target's blocks and
 * ranges the batch read, and the batch ends COMPLETED only after the
 * target accepted it.  The target receives it on the same queue, fd and
 * callback as write notices; it means "this reader has every byte it
 * asked for: you may reuse those blocks".  A batch that fails, times out,
 * is cancelled or whose reader dies sends no notice.  The notice lists at
 * most SX_NOTICE_MAX_ENTRIES entries after merging (SX_ELIMIT at add time
 * beyond).  The target checks the notice (size, encoding, every entry
 * inside one of its readable regions, the byte count) and that it came on
 * a connection that presented its incarnation and access token; the
 * reader's name and incarnation are the reader's own statement (a reader
 * need not be published; over TCP and cuda_ipc the name must match its
 * HELLO).  A batch read over RDMA sends its notice on a TCP connection to
 * the same target (RDMA READs are one-sided); when either side has no TCP
 * the batch fails at submit with SX_ENOTSUP, before it reads anything.
 */

/* A notice lists at most this many entries (block runs and ranges after
 * merging), which keeps its encoding under SX_NOTICE_MAX_BYTES.  A write
 * batch that would need more is refused at add time (SX_ELIMIT). */
#define SX_NOTICE_MAX_ENTRIES 1024
#define SX_NOTICE_MAX_BYTES 65536
/* Notices a consumer holds before it refuses new ones (the producer's
 * batch then fails with SX_ELIMIT): read them. */
#define SX_NOTICE_QUEUE_MAX 4096
/* Of those, at most this many read notices at once (beyond, a reader's
 * notifying batch fails with SX_ELIMIT).  Anyone holding a segment's access
 * token may send read notices, so they get a share of their own: write
 * notices always have at least SX_NOTICE_QUEUE_MAX - SX_NOTICE_READ_QUEUE_MAX
 * places, and a reader cannot starve the producers that push into this
 * agent. */
#define SX_NOTICE_READ_QUEUE_MAX (SX_NOTICE_QUEUE_MAX / 2)

/* ------------------------------------------------------------ producer */

/*
 * Write blocks: for each layer in [layer_first, layer_first+layer_count) and
 * each slot in the slots mask, this agent's blocks local_block..+count-1 of
 * the region holding (group, layer, slot) go to blocks remote_block..+count-1
 * of the consumer's region with the same key, which must allow remote
 * writes.  Block sizes must agree.
 */
typedef struct sx_block_write {
  uint32_t group;
  uint32_t layer_first;
  uint32_t layer_count;
  uint64_t slots;        /* bit mask: 1 << SX_SLOT_K | 1 << SX_SLOT_V ... */
  uint64_t local_block;  /* source */
  uint64_t remote_block; /* destination */
  uint64_t count;
} sx_block_write;

/* Write length bytes from local (which must lie in a registered region when
 * the transport is RDMA) to offset of the consumer's region remote_region. */
typedef struct sx_range_write {
  const void *local;
  uint32_t remote_region; /* region id in the consumer's descriptor */
  uint64_t offset;
  uint64_t length;
} sx_range_write;

/*
 * Add write entries to a batch created with SX_BATCH_WRITE (SX_EINVAL on a
 * read batch, and sx_batch_add_blocks()/_ranges() are SX_EINVAL on a write
 * batch).  Planned at once on the calling thread, all or nothing, with the
 * read planner's checks and errors; the consumer's region must carry
 * SX_ACCESS_REMOTE_WRITE (SX_EDENIED otherwise).  SX_ELIMIT when the batch's
 * notice would list more than SX_NOTICE_MAX_ENTRIES entries.
 */
SX_EXTERN int sx_batch_add_block_writes(sx_batch *b, const sx_block_write *w, size_t n);
SX_EXTERN int sx_batch_add_range_writes(sx_batch *b, const sx_range_write *w, size_t n);

/*
 * Blocks as engines keep them: two lists of block ids, local[i] paired with
 * remote[i], for every layer in [layer_first, layer_first+layer_count) and
 * every slot of slots.  On a write batch local ids are the sources and
 * remote ids the destinations; on a read batch the other way round.
 * Consecutive pairs are merged into runs.  n_local != n_remote is a
 * planning error (SX_EINCOMPAT, with both counts in the message), never
 * truncated; so is an empty list.  Otherwise as sx_batch_add_blocks() /
 * sx_batch_add_block_writes(); the run entries count as one entry each.
 */
typedef struct sx_block_ids {
  uint32_t group;
  uint32_t layer_first;
  uint32_t layer_count;
  uint64_t slots;
  const uint64_t *local;
  size_t n_local;
  const uint64_t *remote;
  size_t n_remote;
} sx_block_ids;

SX_EXTERN int sx_batch_add_block_ids(sx_batch *b, const sx_block_ids *ids);

/* ------------------------------------------------------------ consumer */

/*
 * Let a producer write into this agent's writable regions.  producer is a
 * segment name; incarnation (SX_INCARNATION_LEN bytes) names one life of it,
 * or NULL for whichever incarnation holds the name (a restarted producer
 * keeps the grant).  producer NULL (and incarnation NULL) grants every
 * segment of this agent's namespace.  Granting twice is not an error.
 * Waits for the agent thread.  Errors: SX_EINVAL, SX_ENAME, SX_ENOMEM,
 * SX_EBUSY (agent thread).
 */
SX_EXTERN int sx_agent_grant_write(sx_agent *a, const char *producer,
                                   const uint8_t *incarnation);

/*
 * Take back grants: producer and incarnation as above; incarnation NULL
 * removes every grant naming producer, producer NULL only the namespace
 * grant.  From the moment this returns, new writes of a producer no grant
 * covers any more are refused, nothing of what it had under way lands any
 * more (RDMA: its queue pairs are disconnected; TCP: a write being received
 * lands no further byte, and device copies of staged writes have ended;
 * cuda_ipc: it gave back every CUDA IPC handle it held under the grant,
 * after its copies into that memory ended), and a batch of it in flight
 * fails on the producer's side with no notice delivered here.  It may wait
 * for that up to 5 s; a cuda_ipc producer that does not give its handles
 * back by then is disconnected and this returns SX_ETIMEDOUT (that process
 * may still write where it had mapped: docs/security.md).  0 also when no
 * grant matched.  Waits for the agent thread.
 */
SX_EXTERN int sx_agent_revoke_write(sx_agent *a, const char *producer,
                                    const uint8_t *incarnation);

/* Blocks of this agent written by a batch, in this agent's numbering. */
typedef struct sx_notice_blocks {
  uint32_t group;
  uint32_t layer_first;
  uint32_t layer_count;
  uint64_t slots;
  uint64_t block; /* first block */
  uint64_t count;
} sx_notice_blocks;

/* Bytes of one of this agent's regions written by a batch. */
typedef struct sx_notice_range {
  uint32_t region;
  uint64_t offset;
  uint64_t length;
} sx_notice_range;

/* sx_notice.kind */
typedef enum sx_notice_kind {
  SX_NOTICE_WRITE = 0, /* a producer's write batch landed here (push) */
  SX_NOTICE_READ = 1,  /* a reader's SX_BATCH_NOTIFY read batch completed */
} sx_notice_kind;

/*
 * One completed batch.  kind SX_NOTICE_WRITE: a write batch; every byte it
 * lists is in this agent's memory (written before the notice was accepted;
 * for host memory, visible to every thread that reads the notice), and
 * producer and incarnation are those the data plane authenticated, never
 * the producer's own claim.  kind SX_NOTICE_READ: a read batch of a reader
 * (SX_BATCH_NOTIFY) completed; producer and incarnation are the reader's
 * name ("" for an unnamed reader) and incarnation as it stated them on a
 * connection that presented this agent's access token; blocks and ranges
 * are this agent's memory that the batch read, every byte of which the
 * reader had received before it sent the notice; bytes is their size.
 */
typedef struct sx_notice {
  char producer[SX_NAME_MAX + 1];
  uint8_t incarnation[SX_INCARNATION_LEN];
  uint64_t tag;     /* the producer's sx_batch_params.tag */
  uint64_t bytes;   /* bytes the batch wrote */
  sx_transport_kind transport;
  uint32_t n_blocks;
  uint32_t n_ranges;
  uint32_t kind;    /* sx_notice_kind (fills what was padding: the ABI holds) */
  const sx_notice_blocks *blocks; /* n_blocks, owned by the notice */
  const sx_notice_range *ranges;  /* n_ranges, owned by the notice */
} sx_notice;

/*
 * Take the oldest notice, waiting up to timeout_ms for one (0: do not wait;
 * -1: no limit).  0 and *out (free it with sx_notice_free()), or
 * SX_ETIMEDOUT when none came, SX_ESHUTDOWN when the agent is being
 * destroyed, SX_EBUSY when asked to wait on the agent thread.
 */
SX_EXTERN int sx_agent_notice_next(sx_agent *a, int timeout_ms, sx_notice **out);

/* An eventfd that is readable while notices are queued, for an engine's own
 * poll/epoll loop; owned by the agent (do not read or close it).  Returns
 * the fd or SX_EIO. */
SX_EXTERN int sx_agent_notice_fd(sx_agent *a);

/*
 * A function that sees every accepted notice first, on the agent thread.
 * It returns non-zero to take the notice (it is then not queued, and n is
 * valid only during the call) or 0 to leave it in the queue.  NULL removes
 * the callback.  When this returns, the old callback is not running and
 * will not be called again, so its arg may be freed: off the agent thread
 * it waits for a call in progress to return; on it (from the callback
 * itself) it never waits.
 */
typedef int (*sx_notice_cb)(void *arg, const sx_notice *n);
SX_EXTERN int sx_agent_notice_cb(sx_agent *a, sx_notice_cb cb, void *arg);

/* Free a notice from sx_agent_notice_next().  NULL is a no-op. */
SX_EXTERN void sx_notice_free(sx_notice *n);

#ifdef __cplusplus
}
#endif
#endif /* SEGXFER_PUSH_H */
