/*
 * Staged RDMA: GPU memory over any RDMA device (rxe included), through
 * pinned, registered rings.  Not installed.  Included by rdma_int.h.
 *
 *   rdma_stage.c    reader side: a stage QP per peer, requests, READs of
 *                   the target's ring slots, scatter into the destinations
 *   rdma_sserve.c   target side: a ring per stage QP, GPU -> ring copies,
 *                   replies; staged writes: READs of a producer's slots,
 *                   ring -> GPU copies
 *   rdma_stagew.c   staged writes (push mode), producer side: sources ->
 *                   ring, write requests (WREQ) naming the filled slot
 *
 * A reader whose batch touches GPU memory that no MR covers (a remote GPU
 * region published with rkey 0, or a local GPU destination) opens one more
 * QP to the target: a stage QP, whose hello carries SX__RDMA_HELLO_STAGE
 * besides the usual incarnation and access token, checked by the target as
 * for any reader.  Each stage QP has SX__RDMA_STAGE_SLOTS slots of
 * SX__RDMA_STAGE_SLOT_BYTES at both ends; the reader's slot k of a QP uses
 * the target's slot k of that QP, so the reader alone decides when a slot
 * is reused (only after its READ of the slot completed) and no "free"
 * message is needed.
 *
 * A slot's life, remote GPU source: the reader SENDs a request (slot, seq,
 * up to SX__RDMA_STAGE_MAX_RANGES ranges of the target's regions, packed
 * one after another); the target checks each range (region exists, is not
 * withdrawn, allows remote reads, bounds), copies them into its slot with
 * one gather (sx__rdma_ring_gather) on a stream of the region's device,
 * and SENDs a reply (status, the slot's address and rkey, bytes) once the
 * copy finished; the reader RDMA-READs the slot into its own slot, then
 * copies the pieces to their destinations (one gather when a destination
 * is GPU memory, memcpy otherwise) and settles them when that copy finished.  Remote host
 * memory into local GPU memory skips the request: the reader READs the
 * region itself into its slot.  With several slots in flight the target's
 * copy, the wire and the reader's copy overlap.
 */
#ifndef SX_AGENT_RDMA_STAGE_H
#define SX_AGENT_RDMA_STAGE_H

#include <infiniband/verbs.h>
#include <stddef.h>
#include <stdint.h>

#include "segxfer/agent.h"

#define SX__RDMA_HELLO_STAGE 0x02u
/* Slots per stage QP (at both ends), and stage QPs per reader and target:
 * several QPs, because a device may serve one QP's READs one at a time
 * (Soft-RoCE does), as host-memory reads use several QPs per peer. */
#define SX__RDMA_STAGE_SLOTS 4u
#define SX__RDMA_STAGE_QPS 4u
#define SX__RDMA_STAGE_SLOT_BYTES (1u << 20)
#define SX__RDMA_STAGE_MAX_RANGES 64u
/* A stage QP's send queue: every slot's READs (direct ones: a READ per
 * range) or requests, and the drain WR. */
#define SX__RDMA_STAGE_SQ (SX__RDMA_STAGE_SLOTS * SX__RDMA_STAGE_MAX_RANGES + 1u)
/* wr_id tags of the stage QPs: | kind << 16 | slot or buffer index. */
#define SX__RDMA_WR_STAGE (1ull << 60)
#define SX__RDMA_SWR_SEND 1u
#define SX__RDMA_SWR_RECV 2u
#define SX__RDMA_SWR_READ 3u
#define SX__RDMA_SWR(kind, i) (SX__RDMA_WR_STAGE | ((uint64_t)(kind) << 16) | (uint64_t)(i))

/* ------------------------------------------------------------------ wire */

enum { SX__RDMA_SMSG_REQ = 1, SX__RDMA_SMSG_REPLY = 2, SX__RDMA_SMSG_WREQ = 3 };

/* Every stage message starts with this.  Multi-byte fields big-endian. */
typedef struct sx__rdma_smsg_hdr {
  uint8_t magic[2]; /* 'S' 'G' */
  uint8_t type;     /* SX__RDMA_SMSG_* */
  uint8_t slot;
  uint32_t seq;     /* the reader's request number, echoed */
  uint16_t n;       /* REQ: ranges that follow */
  uint16_t reserved;
  uint32_t status;  /* REPLY: 0 or -SX_E* */
} sx__rdma_smsg_hdr;

typedef struct sx__rdma_srange {
  uint32_t region;
  uint32_t len;
  uint64_t off;
} sx__rdma_srange;

typedef struct sx__rdma_sreply {
  sx__rdma_smsg_hdr h;
  uint64_t addr;  /* the slot in the target's ring */
  uint32_t rkey;
  uint32_t bytes; /* packed bytes to READ from addr */
} sx__rdma_sreply;

/* A staged write's request (WREQ, producer -> consumer): after the header,
 * where the producer's slot lies (the consumer READs it), then the ranges
 * of the consumer's regions the slot's bytes go to, packed in order. */
typedef struct sx__rdma_swsrc {
  uint64_t addr;  /* the slot in the producer's ring */
  uint32_t rkey;
  uint32_t bytes; /* the sum of the ranges' lengths */
} sx__rdma_swsrc;

#define SX__RDMA_SMSG_BYTES                                                                   \
  (sizeof(sx__rdma_smsg_hdr) + sizeof(sx__rdma_swsrc) +                                       \
   SX__RDMA_STAGE_MAX_RANGES * sizeof(sx__rdma_srange))

/* Host-order view of a request; 0, or SX_EPROTO with msg for one that is
 * malformed (bad magic or type, slot or count out of range, more bytes
 * than a slot holds, a zero-length range). */
typedef struct sx__rdma_sreq {
  uint8_t slot;
  uint8_t write; /* a WREQ: src says where the bytes are */
  uint32_t seq;
  uint16_t n;
  sx__rdma_swsrc src;
  sx__rdma_srange r[SX__RDMA_STAGE_MAX_RANGES];
} sx__rdma_sreq;

/* A REQ, or a WREQ when q->write (with q->src). */
size_t sx__rdma_sreq_pack(uint8_t *buf, const sx__rdma_sreq *q);
/* A REQ, or a WREQ when write (a WREQ whose src.bytes is not the ranges'
 * sum is malformed too). */
int sx__rdma_sreq_parse(const uint8_t *buf, size_t len, int write, sx__rdma_sreq *out,
                        char *msg, size_t cap);
void sx__rdma_sreply_pack(sx__rdma_sreply *w, uint8_t slot, uint32_t seq, int status,
                          uint64_t addr, uint32_t rkey, uint32_t bytes);
/* 0 and the fields, or SX_EPROTO. */
int sx__rdma_sreply_parse(const uint8_t *buf, size_t len, uint8_t *slot, uint32_t *seq,
                          int *status, uint64_t *addr, uint32_t *rkey, uint32_t *bytes);

/* A ring of slots and its message buffers, at either end (rdma_swire.c):
 * pinned host memory where a CUDA driver is loaded (so GPU copies overlap),
 * page-aligned memory otherwise; the MRs are each end's own. */
typedef struct sx__rdma_ring {
  uint8_t *mem;
  size_t bytes;
  int pinned;
  struct ibv_mr *mr;
  uint8_t *msgs; /* n_msgs x SX__RDMA_SMSG_BYTES */
  size_t msg_bytes;
  struct ibv_mr *msg_mr;
} sx__rdma_ring;

/* Slot i of the ring, and message buffer i (receive buffers come first). */
static inline uint8_t *sx__rdma_ring_slot(const sx__rdma_ring *r, uint32_t i) {
  return r->mem + (size_t)i * SX__RDMA_STAGE_SLOT_BYTES;
}
static inline uint8_t *sx__rdma_ring_msg(const sx__rdma_ring *r, uint32_t i) {
  return r->msgs + (size_t)i * SX__RDMA_SMSG_BYTES;
}

/* 0, or SX_ENOMEM with a message (nothing to free then). */
int sx__rdma_ring_alloc(sx__rdma_ring *r, size_t bytes, size_t n_msgs);
/* Deregister and free what is there; r may be half set up. */
void sx__rdma_ring_free(sx__rdma_ring *r);
/* Post message buffer i of r as a receive on qp (wr_id: RECV | i). */
int sx__rdma_ring_post_recv(const sx__rdma_ring *r, struct ibv_qp *qp, uint32_t i);

/* SX_RDMA_GPU / sx_agent_params.rdma_gpu: which tier carries GPU memory. */
typedef enum sx__rdma_gpu_tier {
  SX__RDMA_GPU_AUTO = SX_RDMA_GPU_AUTO,
  SX__RDMA_GPU_DMABUF = SX_RDMA_GPU_DMABUF,
  SX__RDMA_GPU_PEERMEM = SX_RDMA_GPU_PEERMEM,
  SX__RDMA_GPU_STAGED = SX_RDMA_GPU_STAGED,
  SX__RDMA_GPU_OFF = SX_RDMA_GPU_OFF,
} sx__rdma_gpu_tier;

/* "dmabuf", "peermem", "staged", "off", "auto" or "" -> tier; SX_EINVAL. */
int sx__rdma_gpu_tier_parse(const char *s, sx__rdma_gpu_tier *out);
const char *sx__rdma_gpu_tier_name(sx__rdma_gpu_tier t);

#endif
