/*
 * The RDMA transport's internals, shared by its files.  Not installed.
 *
 *   rdma.c       ops table, open/close, peers, the wire structs, error mapping
 *   rdma_dev.c   devices, ports and GIDs, memory registration, pack/usable
 *   rdma_cm.c    the rdma_cm event channel: listener, accept, connect, teardown
 *   rdma_post.c  batched RDMA READs (and WRITEs): slicing, WR chains, completions, abort
 *   rdma_wserve.c  push mode, consumer side: writable memory, producers' QPs, notices
 *   rdma_write.c   push mode, producer side: write peers, notices and their replies
 *   rdma_stage.c, rdma_sserve.c, rdma_swire.c  staged RDMA of GPU memory (rdma_stage.h)
 *   rdma_stagew.c  staged writes (push mode), producer side
 *   rdma_nic.c   NIC choice per region (NUMA node, PCI distance, load), rings on a node
 *   rdma_route.c each range to the QPs of its (local NIC, remote NIC) pair
 *
 * Threading: everything runs on the agent's uv loop thread.  rdma_cm runs in
 * asynchronous mode on one event channel and every device has one completion
 * channel; both fds are polled by the loop (uv_poll), so nothing blocks except
 * peer_close() and close(), which wait (bounded, local) for the flush of the
 * queue pairs they tear down, because they must settle every op before they
 * return.
 *
 * Reentrancy: settling an xfer can run the agent's op->done callback, which
 * may call back into the transport (post, abort, peer_close, close).  So the
 * transport never settles while it walks its own structures: settled xfers
 * are queued on their op and delivered when the outermost entry point leaves
 * (sx__rdma_leave), and objects freed by a nested call are only reclaimed
 * once no entry point is active.
 */
#ifndef SX_AGENT_RDMA_INT_H
#define SX_AGENT_RDMA_INT_H

#include <infiniband/verbs.h>
#include <linux/types.h>
#include <netinet/in.h>
#include <rdma/rdma_cma.h>
#include <stdint.h>
#include <sys/socket.h>

#include "internal.h"
#include "transport/transport.h"
#include "rdma_stage.h"

#define SX__RDMA_MAX_EPS SX_MAX_DEVICES /* published endpoints (device ports) */
#define SX__RDMA_MAX_DEVS SX_MAX_DEVICES
#define SX__RDMA_DEFAULT_SLICE (1u << 20)
#define SX__RDMA_MIN_SLICE 64u
#define SX__RDMA_DEFAULT_CONNS 4u
#define SX__RDMA_MAX_CONNS 64u
/* Send queue slots per QP for READs (one more is kept for the drain WR).
 * Enough for small slices to fill the byte window below; the device may
 * cap it further (max_qp_wr, max_cqe). */
#define SX__RDMA_SQ_DEPTH 256u
/* Signal at least every this many bytes of READs, so that an op's xfers
 * settle (and send-queue slots free up) as data arrives, not only at the end
 * of a long chain of large slices. */
#define SX__RDMA_SIGNAL_BYTES (4u << 20)
/* Bytes of READs in flight per QP.  Far above any link's bandwidth-delay
 * product (100 Gb/s x 10 us is 125 KB), and it bounds how long one
 * ibv_post_send may take: Soft-RoCE runs the protocol inside the poster's
 * system call, over loopback the whole transfer of what was posted. */
#define SX__RDMA_QP_WINDOW (8u << 20)
#define SX__RDMA_RESOLVE_MS 2000
#define SX__RDMA_CONNECT_MS 10000u
#define SX__RDMA_DRAIN_MS 5000u
#define SX__RDMA_TICK_MS 100u
#define SX__RDMA_BACKLOG 128
#define SX__RDMA_DRAIN_WR_ID UINT64_MAX
/* Push mode (docs/push.md).  wr_id tags of the notice SENDs (| slot) and
 * of the receives of their replies; ring slots are small numbers. */
#define SX__RDMA_WR_NSEND (1ull << 62)
#define SX__RDMA_WR_RECV (1ull << 61)
/* One signaled work request over sge (which must live until it is
 * posted): a SEND of the message in sge (no SGE when it is empty), or an
 * RDMA READ of (raddr, rkey) into sge. */
static inline void sx__rdma_wr_send(struct ibv_send_wr *wr, struct ibv_sge *sge, uint64_t wr_id) {
  *wr = (struct ibv_send_wr){.wr_id = wr_id, .sg_list = sge, .num_sge = sge->length > 0,
                             .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED};
}
static inline void sx__rdma_wr_read(struct ibv_send_wr *wr, struct ibv_sge *sge, uint64_t wr_id,
                                    uint64_t raddr, uint32_t rkey) {
  *wr = (struct ibv_send_wr){.wr_id = wr_id, .sg_list = sge, .num_sge = 1,
                             .opcode = IBV_WR_RDMA_READ, .send_flags = IBV_SEND_SIGNALED};
  wr->wr.rdma.remote_addr = raddr;
  wr->wr.rdma.rkey = rkey;
}
/* Notices a producer's QP has sent and not seen answered (the receives it
 * keeps posted for the replies). */
#define SX__RDMA_WCREDITS 16u
/* Notice send buffers of SX_NOTICE_MAX_BYTES per device, producer side. */
#define SX__RDMA_NOTICE_SLOTS 16u
/* Consumer side, per device: notice receive buffers of SX_NOTICE_MAX_BYTES
 * in a shared receive queue, and producers' QPs at once. */
#define SX__RDMA_WSRQ_DEPTH 64u
#define SX__RDMA_WMAX_CONNS 256u
/* GPUs whose reachability from each device is remembered (rdma_reach.c). */
#define SX__RDMA_REACH_GPUS 16
/* rdma_nic.c: a device's resolved sysfs path, and the highest NUMA node. */
#define SX__NIC_PATH 512
#define SX__NIC_MAX_NODE 1023

/* ------------------------------------------------------------------ wire */

#define SX__RDMA_WIRE_VERSION 1
#define SX__RDMA_NAME_BYTES 16

/*
 * Connect private data, reader -> target.  56 bytes: the most rdma_cm carries
 * in a connect request over IB and RoCE (92-byte IB CM REQ private data minus
 * rdma_cm's 36-byte header).  Multi-byte fields are big-endian.  The reader's
 * name is only for the target's logs, so it is cut to 16 bytes.
 */
typedef struct sx__rdma_hello_wire {
  uint8_t magic[2];  /* 'S' 'X' */
  uint8_t version;   /* SX__RDMA_WIRE_VERSION */
  uint8_t flags;     /* 0, or SX__RDMA_HELLO_WRITE */
  __be32 conn_index; /* which of the reader's QPs to this peer */
  uint8_t incarnation[SX_INCARNATION_LEN]; /* the target incarnation expected */
  uint8_t token[SX_TOKEN_LEN];             /* the segment's access token */
  char name[SX__RDMA_NAME_BYTES];          /* reader name, NUL-padded, cut */
} sx__rdma_hello_wire;

/* A producer's hello (push mode): the same 56 bytes, with flags
 * SX__RDMA_HELLO_WRITE; token is the producer's own access token and the
 * 16 name bytes carry the producer's incarnation.  There is no room for
 * its name: the target finds it by incarnation (agent/grant.c).  A target
 * that predates push mode takes it for a reader with a bad token. */
#define SX__RDMA_HELLO_WRITE 0x01u

/* Accept private data, target -> reader: who accepted. */
typedef struct sx__rdma_accept_wire {
  uint8_t magic[2];
  uint8_t version;
  uint8_t flags;
  uint8_t incarnation[SX_INCARNATION_LEN]; /* the target's own */
} sx__rdma_accept_wire;

/* Reject private data, target -> reader: why. */
typedef struct sx__rdma_reject_wire {
  uint8_t magic[2];
  uint8_t version;
  uint8_t reason;  /* SX__RDMA_REJ_* */
  __be32 reserved; /* 0 */
} sx__rdma_reject_wire;

enum {
  SX__RDMA_REJ_ACCESS = 1,  /* bad access token -> SX_EACCESS */
  SX__RDMA_REJ_STALE = 2,   /* other incarnation -> SX_ESTALE */
  SX__RDMA_REJ_VERSION = 3, /* unknown hello version -> SX_EVERSION */
  SX__RDMA_REJ_PROTO = 4,   /* malformed hello -> SX_EPROTO */
  SX__RDMA_REJ_NOMEM = 5,   /* target out of resources -> SX_ENOMEM */
  SX__RDMA_REJ_SHUTDOWN = 6, /* target closing -> SX_ESHUTDOWN */
  SX__RDMA_REJ_NODEV = 7,    /* arrived on a device the target does not use */
  SX__RDMA_REJ_WACCESS = 8,  /* producer not granted or not proven -> SX_EACCESS */
  SX__RDMA_REJ_WSTORE = 9,   /* producer could not be looked up -> SX_ESTORE */
  SX__RDMA_REJ_NOSTAGE = 10  /* stage QP, staging off there -> SX_ENOTSUP */
};

typedef struct sx__rdma_hello {
  uint8_t flags;
  uint8_t producer[SX_INCARNATION_LEN]; /* SX__RDMA_HELLO_WRITE: its incarnation */
  uint32_t conn_index;
  uint8_t incarnation[SX_INCARNATION_LEN];
  uint8_t token[SX_TOKEN_LEN];
  char name[SX__RDMA_NAME_BYTES + 1];
} sx__rdma_hello;

void sx__rdma_hello_pack(sx__rdma_hello_wire *w, const char *name, uint32_t conn_index,
                         const uint8_t *incarnation, const uint8_t *token);
/* Push mode: a producer's hello (see above). */
void sx__rdma_whello_pack(sx__rdma_hello_wire *w, uint32_t conn_index,
                          const uint8_t *target_inc, const uint8_t *producer_inc,
                          const uint8_t *producer_token);
/* 0, SX_EPROTO (not a segxfer hello, too short) or SX_EVERSION. */
int sx__rdma_hello_parse(const void *buf, size_t len, sx__rdma_hello *out);
void sx__rdma_accept_pack(sx__rdma_accept_wire *w, const uint8_t *incarnation);
/* 1 and the incarnation if buf is a segxfer accept, else 0. */
int sx__rdma_accept_parse(const void *buf, size_t len, uint8_t *incarnation);
void sx__rdma_reject_pack(sx__rdma_reject_wire *w, uint8_t reason);
/* 1 and *reason if buf is a segxfer reject, else 0. */
int sx__rdma_reject_parse(const void *buf, size_t len, uint8_t *reason);
/* SX_E* code and text for a reject reason. */
int sx__rdma_reject_code(uint8_t reason);
const char *sx__rdma_reject_text(uint8_t reason);
/* SX_E* code for a work-completion status (SUCCESS -> 0). */
int sx__rdma_wc_code(enum ibv_wc_status st);
/* Text for an IB CM reject status (event->status of RDMA_CM_EVENT_REJECTED). */
const char *sx__rdma_cm_reject_status_text(int status);

/* ------------------------------------------------------------------ objects */

typedef struct sx_rdma sx_rdma;
typedef struct rdma_peer rdma_peer;
typedef struct rdma_conn rdma_conn;
typedef struct rdma_rop rdma_rop;
typedef struct rdma_wnotice rdma_wnotice;
typedef struct rdma_sreader rdma_sreader;
typedef struct rdma_sserve rdma_sserve;
typedef struct rdma_split rdma_split;

/* What an rdma_cm_id's context points to (first member of each). */
enum { RDMA_CM_LISTENER = 1, RDMA_CM_READER = 2, RDMA_CM_TARGET = 3 };
typedef struct rdma_cmctx {
  int kind;
} rdma_cmctx;

/* One device in use: librdmacm's own context for it, so that PDs, CQs and
 * QPs created here match the cm_ids that rdma_cm binds to the device. */
typedef struct rdma_dev {
  sx_rdma *t;
  int index;
  struct ibv_context *verbs;
  char name[SX_TAG_MAX + 1];
  struct ibv_device_attr attr;
  struct ibv_pd *pd;
  struct ibv_comp_channel *chan; /* reader CQs' events */
  uv_poll_t *chan_poll;
  struct ibv_cq *idle_cq; /* target QPs post nothing; they share this CQ */
  /* Push mode, consumer side (rdma_wserve.c).  Writable memory is
   * registered in a PD of its own, which only producers' QPs join: a
   * reader's QP cannot name a write key.  Producers' QPs share a CQ on
   * their own channel and a shared receive queue of notice buffers, made
   * for the first producer and dropped with the last. */
  struct ibv_pd *wpd;
  struct ibv_comp_channel *wchan;
  uv_poll_t *wpoll;
  struct ibv_cq *wcq;
  struct ibv_srq *srq;
  uint8_t *rbufs;              /* SX__RDMA_WSRQ_DEPTH x SX_NOTICE_MAX_BYTES */
  struct ibv_mr *rmr;
  uint32_t n_wconns;           /* producers' QPs on wcq */
  /* Push mode, producer side (rdma_write.c): notice send buffers. */
  uint8_t *nbufs;              /* SX__RDMA_NOTICE_SLOTS x SX_NOTICE_MAX_BYTES */
  struct ibv_mr *nmr;
  rdma_conn *nowner[SX__RDMA_NOTICE_SLOTS]; /* the QP a slot was sent on */
} rdma_dev;

/* One published endpoint: an active port of a device, its GID and address. */
typedef struct rdma_ep {
  rdma_dev *dev;
  uint8_t port_num;
  uint8_t link_layer; /* IBV_LINK_LAYER_* */
  int gid_index;
  int gid_type;       /* IBV_GID_TYPE_* */
  uint8_t gid[SX_GID_LEN];
  uint32_t mtu;       /* active MTU in bytes */
  uint32_t max_msg_sz;
  char addr[SX_ADDR_MAX + 1]; /* numeric IP rdma_cm resolves to this port */
  int has_ipv4;
  struct in_addr ipv4, mask;
} rdma_ep;

/* lreg->tpriv[SX_TRANSPORT_RDMA]: one MR per device. */
typedef struct rdma_mr {
  sx_lregion *lreg;
  struct ibv_mr *mr[SX__RDMA_MAX_DEVS];
  struct ibv_mr *wmr[SX__RDMA_MAX_DEVS]; /* writable regions: in dev->wpd */
  int nic; /* the device chosen for it (rdma_nic.c), published; -1 none */
  struct rdma_mr *prev, *next;
} rdma_mr;

/* Where a device sits (rdma_nic.c): its NUMA node and sysfs path. */
typedef struct sx__nic_topo {
  int numa;  /* -1 unknown */
  int known; /* path resolved */
  char path[SX__NIC_PATH];
} sx__nic_topo;

/* Target side: one accepted connection.  The reader posts; the target's
 * QP only responds, so it posts nothing and needs no completions. */
typedef struct rdma_tconn {
  rdma_cmctx cm; /* RDMA_CM_TARGET */
  sx_rdma *t;
  struct rdma_cm_id *id;
  rdma_dev *dev;
  int established;
  char reader[SX__RDMA_NAME_BYTES + 1];
  uint32_t conn_index;
  struct rdma_tconn *prev, *next;
  /* Push mode: a producer's QP (rdma_wserve.c), in dev->wpd on dev->wcq. */
  int write;
  sx_wauth *auth;            /* being authorized: not accepted yet */
  char producer[SX_NAME_MAX + 1];
  uint8_t pinc[SX_INCARNATION_LEN];
  uint32_t qpn;              /* 0 once its QP is gone */
  uint32_t replies;          /* reply SENDs not completed */
  int unwanted;              /* disconnected before it was established */
  rdma_sserve *ss;           /* a stage QP, a reader's or a producer's (rdma_sserve.c) */
  int stage;                 /* a producer's stage QP, being authorized */
  unsigned depth;            /* its READs at once, once accepted */
} rdma_tconn;

/* A READ in flight: which slice of which xfer a send-queue slot carries. */
typedef struct rdma_slot {
  rdma_rop *rop;
  uint32_t xi;
  uint32_t len;
  uint64_t off;
} rdma_slot;

typedef enum rdma_conn_state {
  RC_IDLE = 0,  /* no cm_id */
  RC_ADDR,      /* rdma_resolve_addr */
  RC_ROUTE,     /* rdma_resolve_route */
  RC_CONNECT,   /* rdma_connect */
  RC_UP,        /* established: READs may be posted */
  RC_DRAIN,     /* QP in error, waiting for the flush of what was posted */
} rdma_conn_state;

/* Reader side: one RC QP to a peer. */
struct rdma_conn {
  rdma_cmctx cm; /* RDMA_CM_READER */
  rdma_peer *p;
  uint32_t index;
  rdma_conn_state state;
  int last_event; /* last rdma_cm event seen, for timeout messages */
  struct rdma_cm_id *id;
  rdma_dev *dev;
  struct ibv_cq *cq;
  struct ibv_qp *qp;
  uint64_t deadline_ms; /* connect or drain deadline */
  /* Send queue: ring of cap slots, used from tail to head. */
  uint32_t cap, sig_every;
  uint32_t head, tail, used;
  uint64_t inflight_bytes;
  rdma_slot *ring;
  struct ibv_send_wr *wrs; /* chain scratch: cap WRs, no mallocs per post */
  struct ibv_sge *sges;
  uint32_t path_mtu, rd_atomic; /* as the CM settled them */
  /* Teardown: why, and whether flushed slices go back to their op's queue
   * (abort of another op) or fail it (a real error). */
  int reason;
  int requeue;
  char msg[200];
  int drain_posted, drained, reap;
  /* Push mode, producer side: receives posted for replies, and the
   * notices sent on this QP waiting for theirs (in order). */
  uint32_t credits;
  rdma_wnotice *await_head, *await_tail;
};

/* Does the conn count for its peer's queued work?  Connecting, up, or
 * draining: a drained conn's finish pumps the peer, which connects it again,
 * so work posted while every QP drains waits for that, it does not fail. */
static inline int sx__rdma_conn_live(const rdma_conn *c) { return c->state != RC_IDLE; }

/* Per xfer of an op. */
typedef struct rdma_xs {
  uint64_t next_off; /* bytes issued so far */
  uint32_t inflight; /* slices posted, not retired */
  uint32_t requeued; /* slices waiting in the op's retry list */
  int status;        /* first error of this xfer */
  int final;         /* status it settled with */
  uint8_t issued;    /* every slice issued (next_off == length) */
  uint8_t settled;
} rdma_xs;

typedef struct rdma_retry {
  uint32_t xi;
  uint32_t len;
  uint64_t off;
} rdma_retry;

/* The transport's state of one posted op. */
struct rdma_rop {
  sx_op *op;
  rdma_peer *p;
  rdma_xs *xs;
  uint32_t *dq; /* settled xfers, in order, waiting to be delivered */
  size_t dq_r, dq_w, delivered;
  size_t next_xi;          /* first xfer not fully issued */
  uint64_t qslices;        /* slices not issued yet (incl. retries) */
  rdma_retry *retry;
  size_t n_retry, cap_retry;
  uint64_t inflight;       /* slices posted, not retired */
  int error;               /* first error (0 while none) */
  char msg[256];
  int aborting, abort_status;
  int queued, in_dlist;
  rdma_rop *prev, *next;   /* peer's list of live rops */
  rdma_rop *qprev, *qnext; /* peer's work queue */
  rdma_rop *dnext;         /* transport's delivery list */
};

struct rdma_peer {
  sx_tpeer base;
  sx_rdma *t;
  char name[SX_NAME_MAX + 1];
  uint8_t incarnation[SX_INCARNATION_LEN];
  uint8_t token[SX_TOKEN_LEN];
  struct sockaddr_storage dst; /* remote rdma_cm address and port */
  char where[SX_ADDR_MAX + 48]; /* "addr:port (device, from local device)", cut if long */
  uint32_t rkey_index;         /* which of a region's rkeys */
  rdma_ep *lep;                /* local endpoint chosen for this peer */
  rdma_conn *conns;
  uint32_t n_conns, rr;
  rdma_rop *rops;              /* live rops */
  rdma_rop *qhead, *qtail;     /* rops with slices to issue */
  uint64_t queued_slices;
  int closing;
  int wants_pump; /* completions freed room: pump at the end of the round */
  int last_fail;   /* last connect failure, to log a burst of them once */
  uint64_t last_fail_ms;
  rdma_peer *prev, *next;
  /* Push mode: a producer's peer (RDMA WRITEs), its notices not sent yet. */
  int write;
  rdma_wnotice *nq_head, *nq_tail;
  /* Staged RDMA (rdma_stage.c): a reader's peer gets a second peer for
   * its stage QP on the first batch that needs one (stage); that peer
   * points back (stage_of) and holds the reader's rings (sr). */
  rdma_peer *stage, *stage_of;
  rdma_sreader *sr;
  /* NIC pairs (rdma_route.c).  A segment's peer carries the ranges of
   * its own pair (lep, rkey_index); ranges whose regions name other NICs
   * go to pair peers opened on their first use, listed in pairs (linked
   * by pnext), each pointing back (pair_of).  rep maps an RDMA endpoint's
   * ordinal to its index in desc->endpoints.  splits: the segment's ops
   * spread over several pairs. */
  const sx_desc *desc;
  uint32_t rep[SX_MAX_DEVICES], n_reps;
  /* A split op's record lives until its last part settled, which the
   * peer's close brings about (the pair peers close first). */
  rdma_peer *pair_of, *pairs, *pnext;
  rdma_split *splits;
};

/* Push mode: a write op's notice, from notify() until op->noticed ran and
 * no QP holds it (rdma_write.c). */
struct rdma_wnotice {
  sx_op *op;           /* NULL once settled */
  rdma_peer *p;
  uint8_t *buf;        /* the encoded notice, copied */
  size_t len;
  rdma_wnotice *next;  /* peer's queue, or its QP's await list */
  rdma_wnotice *snext; /* transport's settle list */
  int in_list, in_settle;
  int status;
  char msg[256];
};

/* Counters for tests and debugging (read with sx__rdma_stats_get). */
typedef struct sx__rdma_stats {
  uint64_t posts;      /* ibv_post_send calls (doorbells) for READs */
  uint64_t wrs;        /* READ work requests posted */
  uint64_t signaled;   /* of them, signalled */
  uint64_t cqes;       /* work completions polled */
  uint64_t cq_events;  /* completion channel events */
  uint64_t connects;   /* QPs established */
  uint64_t teardowns;  /* QPs torn down */
  uint64_t requeued;   /* slices flushed by an abort and issued again */
  uint64_t rejects;    /* connect requests this target rejected */
  uint64_t gpu_unreachable; /* (device, GPU) pairs whose loopback READ failed */
  uint64_t numa_rings;   /* staging rings asked for on their NIC's NUMA node */
  uint64_t numa_refused; /* of them, the kernel refused the memory policy */
  int numa_node;         /* the node the last one asked for */
  /* Per device (index in t->devs): READ and WRITE work requests posted,
   * their bytes, and QPs established from this side. */
  uint64_t dev_wrs[SX__RDMA_MAX_DEVS];
  uint64_t dev_bytes[SX__RDMA_MAX_DEVS];
  uint64_t dev_connects[SX__RDMA_MAX_DEVS];
  uint64_t pairs;        /* pair peers opened (rdma_route.c) */
  uint64_t splits;       /* ops spread over several pairs */
} sx__rdma_stats;

struct sx_rdma {
  sx_transport base;
  sx__rdma_stats stats;
  rdma_cmctx listen_cm; /* RDMA_CM_LISTENER */
  struct ibv_context **dev_list;
  rdma_dev devs[SX__RDMA_MAX_DEVS];
  int n_devs;
  rdma_ep eps[SX__RDMA_MAX_EPS];
  int n_eps;
  struct rdma_event_channel *ch;
  uv_poll_t *ch_poll;
  struct rdma_cm_id *listen_id;
  uint16_t port;
  uv_timer_t *tick;    /* connect and drain deadlines */
  int tick_on;
  uv_timer_t *flusher; /* deferred delivery of settled xfers */
  uint32_t slice, conns_per_peer;
  rdma_mr *mrs;
  rdma_peer *peers;
  rdma_peer *zombies;  /* closed while an entry point was active */
  rdma_tconn *tconns;
  rdma_rop *dhead, *dtail;
  rdma_wnotice *shead, *stail; /* notices settled, to deliver */
  sx__rdma_gpu_tier gpu_tier;  /* SX_RDMA_GPU or rdma_gpu: what carries GPU memory */
  int8_t dmabuf[SX__RDMA_MAX_DEVS]; /* provider takes dma-buf MRs: 1, -1, 0 not probed */
  /* (device, GPU) pairs: the loopback READ passed 1, failed -1, not run 0. */
  int8_t reach[SX__RDMA_MAX_DEVS][SX__RDMA_REACH_GPUS];
  unsigned ring_copies_said; /* rdma_swire.c: copy methods logged, per side */
  /* rdma_nic.c: where each device sits (read on first use), and the bytes
   * of the regions chosen for each. */
  int nic_read;
  sx__nic_topo nic_topo[SX__RDMA_MAX_DEVS];
  uint64_t nic_bytes[SX__RDMA_MAX_DEVS];
  int busy;
  int closed;
};

/* ------------------------------------------------------------------ rdma_swire.c */

/* Queue the GPU copies of a staging ring's slot, rg[0..n), on s with
 * sx__mem_gather (the method by shape, SX_GPU_COPY forces one).  sm_ok:
 * the caller found every pointer on the GPU side of rg to be device
 * memory of s's device; the gather kernel is allowed only then and where
 * the ring is pinned, since the GPU's SMs reach neither pageable host
 * memory nor another GPU's memory without peer access (the copy engines
 * take those).  The first use of each method on each side (target: the
 * serving end) is logged at info.  0, or sx__mem_gather's error. */
int sx__rdma_ring_gather(sx_rdma *t, const sx__rdma_ring *r, sx__mem_stream *s,
                         const sx__mem_range *rg, size_t n, int sm_ok, int target);
/* Ring copies go to or come from local regions l, one after another:
 * *device is their GPU (-1 while none), *sm_ok drops to 0 once one is not
 * device memory of that GPU (host memory, another GPU, or no region). */
static inline void sx__rdma_ring_side(const sx_lregion *l, int *device, int *sm_ok) {
  if (l == NULL || l->mem.kind != SX__MEM_CUDA)
    *sm_ok = 0;
  else if (*device < 0)
    *device = l->mem.device;
  else if (l->mem.device != *device)
    *sm_ok = 0;
}
/* The same copies made here, synchronously: sx__mem_copy (unified
 * addressing) when gpu, memcpy when every pointer is host memory.  0, or
 * the first copy's error. */
int sx__rdma_ring_copy_sync(const sx__mem_range *rg, size_t n, int gpu);

/* ------------------------------------------------------------------ rdma.c */

void sx__rdma_log(sx_rdma *t, sx_log_level level, const char *fmt, ...) SX__PRINTF(3, 4);
/* Entry points bracket their work with these.  leave() delivers settled
 * xfers when the outermost entry point ends: at once if flush_now, else
 * from a zero-delay timer (so that post() and abort() never run op->done
 * before they return), and reclaims closed peers and the transport. */
void sx__rdma_enter(sx_rdma *t);
void sx__rdma_leave(sx_rdma *t, int flush_now);
/* Arm the tick timer (connect and drain deadlines). */
void sx__rdma_tick_arm(sx_rdma *t);
const char *sx__rdma_sockaddr_str(const struct sockaddr *sa, char *buf, size_t len);

/* wrs work requests carrying bytes were posted on device d: its counters,
 * and the agent's per-NIC metrics. */
void sx__rdma_count(sx_rdma *t, const rdma_dev *d, uint64_t wrs, uint64_t bytes);
/* A copy of the transport's counters; zeroes if t is not an RDMA transport. */
void sx__rdma_stats_get(const sx_transport *t, sx__rdma_stats *out);

/* ------------------------------------------------------------------ rdma_dev.c */

/* Find devices, ports, GIDs; allocate PDs and completion channels. */
int sx__rdma_devs_open(sx_rdma *t);
/* A completion channel of d, non-blocking, polled by the loop with cb
 * (handle data: d). */
int sx__rdma_chan_open(sx_rdma *t, rdma_dev *d, struct ibv_comp_channel **chan,
                       uv_poll_t **poll, uv_poll_cb cb);
void sx__rdma_devs_close(sx_rdma *t);
rdma_dev *sx__rdma_dev_by_verbs(sx_rdma *t, struct ibv_context *verbs);
int sx__rdma_reg_mem(sx_transport *tt, sx_lregion *r);
void sx__rdma_dereg_mem(sx_transport *tt, sx_lregion *r);
int sx__rdma_pack(sx_transport *tt, sx_desc *d);
int sx__rdma_usable(sx_transport *tt, const sx_desc *remote);
/* Pick the remote endpoint and local endpoint for a peer: returns the
 * index of the remote endpoint in remote->endpoints (and its ordinal among
 * the RDMA endpoints, i.e. the rkey index), or -1. */
int sx__rdma_pick(sx_rdma *t, const sx_desc *remote, uint32_t *rkey_index, rdma_ep **lep);
/* How well local port l suits remote endpoint r (higher is better; 0:
 * different kinds of GID). */
int sx__rdma_ep_score(const rdma_ep *l, const sx_endpoint *r);

/* ------------------------------------------------------------------ rdma.c, peers */

/* A peer for remote endpoint remote->endpoints[idx] (the ordinal-th RDMA
 * one, whose rkeys it uses) from local port lep; pair_of: the segment's
 * peer it carries a NIC pair for, or NULL.  Linked into t->peers. */
int sx__rdma_peer_new(sx_rdma *t, const sx_desc *remote, uint32_t idx, uint32_t ordinal,
                      rdma_ep *lep, rdma_peer *pair_of, rdma_peer **out);

/* ------------------------------------------------------------------ rdma_route.c */

/* post() of a segment's peer: each range to the pair peer of (its local
 * region's NIC, its remote region's NIC); an op on one pair is posted there
 * as it is, one spanning pairs is split into an op per pair, settled as
 * one (a pair that cannot connect fails only its ranges). */
int sx__rdma_route_post(rdma_peer *p, sx_op *op);
/* The peer that carries xfer x: p itself, or the pair peer of the NICs its
 * regions name (opened now if it is the first range to need it).  0, or an
 * error (out of memory, an endpoint address that is not numeric). */
int sx__rdma_route_pair(rdma_peer *p, const sx_xfer *x, rdma_peer **out);
/* abort() of a segment's peer: the op's parts, wherever they went. */
void sx__rdma_route_abort(rdma_peer *p, sx_op *op, int status);

/* ------------------------------------------------------------------ rdma_cm.c */

int sx__rdma_cm_open(sx_rdma *t);
void sx__rdma_cm_close(sx_rdma *t);
/* Start connecting an idle conn: 0, or an SX_E* code (message set) when
 * rdma_cm refused at once. */
int sx__rdma_conn_start(rdma_conn *c);
/* Tear a conn down: an established one goes to RC_DRAIN (QP to error,
 * drain WR posted) and is reaped once its flush completes; one still
 * connecting is destroyed at once.  The first reason sticks. */
void sx__rdma_conn_teardown(rdma_conn *c, int reason, int requeue, const char *fmt, ...)
    SX__PRINTF(4, 5);
/* Destroy QP, CQ and cm_id of a drained (or never established) conn. */
void sx__rdma_conn_destroy(rdma_conn *c);
/* Connecting failed: destroy, and fail the peer's queued work if no other
 * conn can carry it. */
void sx__rdma_conn_failed(rdma_conn *c, int code, const char *msg);
/* Deadlines: connect timeouts and drains that never complete. */
void sx__rdma_conns_tick(sx_rdma *t, uint64_t now);

/* ------------------------------------------------------------------ rdma_post.c */

int sx__rdma_post(sx_tpeer *tp, sx_op *op);
void sx__rdma_abort(sx_tpeer *tp, sx_op *op, int status);
/* post() and abort() on the QPs of one pair peer (no routing). */
int sx__rdma_post_pair(rdma_peer *p, sx_op *op);
void sx__rdma_abort_pair(rdma_peer *p, sx_op *op, int status);
/* Issue queued slices on the peer's established QPs; (re)connect when none
 * is up or connecting. */
void sx__rdma_pump(rdma_peer *p);
/* Drain a CQ: retire completed slots (the caller pumps the peer after). */
void sx__rdma_conn_poll(rdma_conn *c);
/* Completion channel of a device became readable. */
void sx__rdma_on_cq_event(uv_poll_t *h, int status, int events);
/* One round of completion channel ch: the events pending now, at most a
 * fixed number (so one busy channel cannot starve the loop).  Each CQ is
 * re-armed before it is polled with poll_fn(its cq_context, arg), and its
 * event acked.  Returns the events taken. */
int sx__rdma_cq_round(sx_rdma *t, struct ibv_comp_channel *ch,
                      void (*poll_fn)(void *cq_ctx, void *arg), void *arg);
/* A drained conn: retire what is left, destroy, and go on with the queue. */
void sx__rdma_conn_finish(rdma_conn *c);
/* Fail every rop of the peer that still has slices to issue. */
void sx__rdma_peer_fail_queue(rdma_peer *p, int code, const char *msg);
/* Settle what is left of every rop of a closing peer. */
void sx__rdma_peer_cancel_all(rdma_peer *p, int code, const char *msg);
/* Deliver settled xfers to their ops (may run op->done). */
void sx__rdma_deliver(sx_rdma *t);
void sx__rdma_rop_free(rdma_rop *rop);
/* An op of p with slices (or, staged, none) to issue, linked and queued;
 * NULL when out of memory. */
rdma_rop *sx__rdma_rop_new(rdma_peer *p, sx_op *op, uint64_t slices);
/* The peer's queue of ops with work to issue. */
void sx__rdma_rop_enqueue(rdma_rop *rop);
void sx__rdma_rop_dequeue(rdma_rop *rop);
/* Settle xfer xi once nothing of it is in flight and it is issued or its op
 * stops; fail xfer xi and stop the op (the first error sticks). */
void sx__rdma_xfer_check(rdma_rop *rop, size_t xi);
void sx__rdma_rop_fail(rdma_rop *rop, size_t xi, int status, const char *msg);

/* ------------------------------------------------------------------ rdma_cm.c, push */

/* Reject a connect request (reason in its private data) and drop its id. */
void sx__rdma_reject(sx_rdma *t, struct rdma_cm_id *id, uint8_t reason, const char *who);
/* Add tc to / take it from its transport's list of accepted conns. */
void sx__rdma_tconn_link(rdma_tconn *tc);
void sx__rdma_tconn_unlink(rdma_tconn *tc);
/* Accept a connect request with our incarnation in the private data,
 * serving `reads` RDMA READs at once (0: none) and issuing `depth` at once
 * (0: none; a producer's stage QP); rdma_accept's result (errno set on
 * failure). */
int sx__rdma_accept(sx_rdma *t, struct rdma_cm_id *id, unsigned reads, unsigned depth);

/* ------------------------------------------------------------------ rdma_wserve.c */

/* The device's write PD, allocated on first use: 0 or SX_ENODEV. */
int sx__rdma_wpd_get(rdma_dev *d);
/* Writable regions: their second MR, in the device's write PD. */
int sx__rdma_wreg(sx_rdma *t, rdma_dev *d, sx_lregion *lr, struct ibv_mr **out);
/* A producer's connect request (a write hello, the target incarnation
 * checked): authorize it, then accept or reject.  With SX__RDMA_HELLO_STAGE
 * it is a stage QP for staged writes (rdma_sserve.c), which READs the
 * producer's slots, `depth` at once. */
void sx__rdma_wserve_request(sx_rdma *t, struct rdma_cm_id *id, const sx__rdma_hello *h,
                             unsigned depth);
/* A producer's QP is going: destroy it, after taking what completed on it. */
void sx__rdma_wserve_gone(rdma_tconn *tc);
/* A producer's connection is established (its RTU arrived): disconnect it
 * now if that was asked for before. */
void sx__rdma_wserve_established(rdma_tconn *tc);
int sx__rdma_grants_changed(sx_transport *tt);
/* The device's consumer-side and producer-side push resources. */
void sx__rdma_wdev_free(rdma_dev *d);

/* ------------------------------------------------------------------ rdma_write.c */

int sx__rdma_wpeer_open(sx_transport *tt, const sx_desc *remote, sx_tpeer **out); /* rdma.c */
int sx__rdma_notify(sx_tpeer *tp, sx_op *op, const uint8_t *buf, size_t len);
/* A producer's QP was created: post the receives for replies. */
int sx__rdma_w_qp_ready(rdma_conn *c);
/* A completion of a notice SEND or of a reply's receive. */
void sx__rdma_w_wc(rdma_conn *c, const struct ibv_wc *wc);
/* Send queued notices on established QPs (connecting when none is). */
void sx__rdma_w_pump(rdma_peer *p);
/* A QP is destroyed: its unanswered notices fail, its buffers free. */
void sx__rdma_w_conn_down(rdma_conn *c);
/* Does the QP carry notices waiting for their replies? */
int sx__rdma_w_busy(const rdma_conn *c);
/* abort(): settle the op's notice, if it has one here. */
void sx__rdma_w_abort(rdma_peer *p, sx_op *op, int status);
/* Fail every queued notice of the peer (no QP can carry them). */
void sx__rdma_w_fail_queue(rdma_peer *p, int code, const char *msg);
/* Run op->noticed of settled notices (from sx__rdma_leave). */
void sx__rdma_w_deliver(sx_rdma *t);

/* ------------------------------------------------------------------ rdma_stage.c */

/* The staging side's slots (a reader's, or a producer's for staged writes):
 * slot i rides stage QP i % QPS as its slot i / QPS there. */
#define SX__RDMA_SNSLOTS (SX__RDMA_STAGE_QPS * SX__RDMA_STAGE_SLOTS)
#define SX__RDMA_SSTREAMS 16 /* devices with a stream of their own; others copy synchronously */

/* One piece of an xfer in a slot. */
typedef struct sx__rdma_sent {
  rdma_rop *rop; /* NULL once settled without it (abort) */
  uint32_t xi;
  uint32_t len;
  uint64_t off;      /* in the xfer */
  uint32_t ring_off; /* in the slot */
} sx__rdma_sent;
typedef sx__rdma_sent sent;

/* A slot's states.  Reads: REQ (request sent), READ (READs of the target's
 * slot or of remote host memory out), COPY (ring -> destinations).  Staged
 * writes: FILL (sources -> ring), REQ (write request sent, the consumer
 * READs the slot and answers once its copy ended). */
enum { SL_FREE = 0, SL_REQ, SL_READ, SL_COPY, SL_FILL };

typedef struct sx__rdma_sslot {
  rdma_sreader *r;
  uint32_t index;
  uint32_t conn, tslot; /* its stage QP, and its slot there */
  int state;
  int direct;      /* READs of the remote region itself, no request */
  uint32_t seq;
  uint32_t n, bytes;
  uint32_t wrs;    /* READs of this slot not completed (the request's SEND
                    * is not counted: the reply says it arrived) */
  int status;      /* first error of the slot's work requests */
  char msg[200];
  sent ent[SX__RDMA_STAGE_MAX_RANGES];
  sx__mem_notice note;
} sslot;

struct rdma_sreader {
  rdma_peer *sp;
  int write; /* a producer's: staged writes (rdma_stagew.c) */
  /* NSLOTS slots; NSLOTS receive buffers, then NSLOTS request buffers. */
  sx__rdma_ring ring;
  rdma_dev *mr_dev; /* the device both MRs belong to */
  sslot slots[SX__RDMA_SNSLOTS];
  uint32_t seq;
  sx__mem_stream *streams[SX__RDMA_SSTREAMS];
  sx__mem_notifier *notifier;
};

/* Message buffers: NSLOTS receive buffers (buffer i: QP i / SLOTS, its
 * i % SLOTS-th), then a request buffer per slot. */
static inline uint8_t *sx__rdma_s_req_buf(rdma_sreader *r, uint32_t i) {
  return sx__rdma_ring_msg(&r->ring, SX__RDMA_SNSLOTS + i);
}
/* The stream of a device for ring copies (made on first use), or NULL. */
sx__mem_stream *sx__rdma_s_stream(rdma_sreader *r, int device);
/* Post wrs[0..n) of slot sl on c; on failure the slot's error is set, c
 * torn down, and the slot released when nothing of it is out.  0 or
 * SX_ERDMA. */
int sx__rdma_s_post_wrs(rdma_conn *c, struct ibv_send_wr *wrs, uint32_t n, sslot *sl,
                        const char *what);
/* Send slot sl's request on c: a read's (the target fills its slot), or a
 * staged write's (the consumer READs ours). */
void sx__rdma_s_post_request(rdma_conn *c, sslot *sl);
/* Give a slot back: each piece settles with status. */
void sx__rdma_s_slot_release(sslot *sl, int status, const char *msg);
/* Why a slot failed when its stage QP went away (msg says how), into buf
 * (cap bytes): for a write, that the consumer dropped the QP, whichever
 * noticed it first (the flushed work, the disconnect, the end of a
 * fill).  Returns buf. */
const char *sx__rdma_s_qp_lost(const rdma_sreader *r, const char *msg, char *buf, size_t cap);

/* Can RDMA carry the GPU memory of this segment and of ours?  1 without
 * GPU memory, or unless the tier is off (reads and writes stage GPU
 * memory that has no MR). */
int sx__rdma_gpu_usable(sx_rdma *t, const sx_desc *remote);
/* Does op touch GPU memory that no MR covers (so it must be staged)? */
int sx__rdma_s_wanted(const rdma_peer *p, const sx_op *op);
/* Post a staged op on p (a reader's peer): checked like sx__rdma_post. */
int sx__rdma_s_post(rdma_peer *p, sx_op *op);
/* abort() of rop, an op of the stage peer sp: its pieces in slots whose
 * bytes are not being copied out settle now. */
void sx__rdma_s_abort_slots(rdma_peer *sp, rdma_rop *rop);
/* The stage peer's pump: connect, fill free slots. */
void sx__rdma_s_pump(rdma_peer *sp);
/* A stage QP was created: register the ring on its device, post receives. */
int sx__rdma_s_qp_ready(rdma_conn *c);
/* A completion on a stage QP (wr_id tagged SX__RDMA_WR_STAGE). */
void sx__rdma_s_wc(rdma_conn *c, const struct ibv_wc *wc);
/* The stage QP is destroyed: slots waiting for it fail. */
void sx__rdma_s_conn_down(rdma_conn *c);
/* The stage peer closes (its QP already gone): wait for the copies out of
 * its ring (their pieces settle), free the ring. */
void sx__rdma_s_peer_shutdown(rdma_peer *sp);

/* ------------------------------------------------------------------ rdma_stagew.c */

/* Staged writes, producer side: copy the sources of slot sl's pieces into
 * it (one gather where GPU memory is involved), then send the consumer the
 * write request; the consumer READs the slot, scatters, and answers. */
void sx__rdma_sw_fill(rdma_conn *c, sslot *sl);
/* Is remote region rr GPU memory that the producer's peer p must stage
 * into (no write key for p's endpoint)? */
int sx__rdma_sw_remote_staged(const rdma_peer *p, const sx_region *rr);

/* ------------------------------------------------------------------ rdma_gpu.c */

/* Register GPU region lr on every device where the (device, GPU) pair has
 * a GPUDirect tier (dma-buf, then peermem, or the forced one); *out NULL
 * when none has (the region is staged).  Each pair's outcome is logged. */
int sx__rdma_gpu_reg(sx_rdma *t, sx_lregion *lr, rdma_mr **out);

/* ------------------------------------------------------------------ rdma_reach.c */

/* Read a few bytes of GPU memory at addr through mr (remote-readable) over a
 * loopback QP pair on d.  1 when they arrived; 0 with why filled. */
int sx__rdma_reach(sx_rdma *t, rdma_dev *d, const struct ibv_mr *mr, uint64_t addr, char *why,
                   size_t cap);
/* The pair (d, GPU gpu) failed that READ: count it (the transport's
 * counter and the agent's segxfer_rdma_gpu_unreachable_pairs_total) and
 * say why in a WARN line. */
void sx__rdma_reach_failed(sx_rdma *t, rdma_dev *d, int gpu, const char *why);

/* ------------------------------------------------------------------ rdma_nic.c */

/* The sysfs root: $SX_SYSFS_ROOT (a test hook) or "/sys". */
const char *sx__nic_sysfs_root(void);
/* Where RDMA device dev (root/class/infiniband/dev/device) or PCI device
 * addr ("0000:17:00.0", root/bus/pci/devices/addr) sits: 0, or -1 with why
 * (a name that cannot be a path, a link that is missing or leads outside
 * root/devices); numa is -1 where no numa_node file says one. */
int sx__nic_topo_rdma(const char *root, const char *dev, sx__nic_topo *out, char *why,
                      size_t cap);
int sx__nic_topo_pci(const char *root, const char *addr, sx__nic_topo *out, char *why,
                     size_t cap);
/* Hops from a and b up to their deepest common ancestor; -1 unknown. */
int sx__nic_pci_distance(const sx__nic_topo *a, const sx__nic_topo *b);
/* The best of n devices for memory at mem (NULL: host memory, no place):
 * same NUMA node, then shortest PCI distance, then least load, then
 * lowest index.  -1 when n is 0. */
int sx__nic_choose(const sx__nic_topo *mem, const sx__nic_topo *nics, const uint64_t *load,
                   int n);
/* The device for local region lr (its load counted, the choice logged), or
 * -1 without devices; sx__rdma_nic_put() gives the load back. */
int sx__rdma_nic_pick(sx_rdma *t, const sx_lregion *lr);
void sx__rdma_nic_put(sx_rdma *t, int k, uint64_t bytes);
/* NUMA node of device d, -1 unknown. */
int sx__rdma_nic_node(sx_rdma *t, const rdma_dev *d);
/* sx__rdma_ring_alloc, with the ring's memory on d's NUMA node where it is
 * known (counted in t->stats.numa_*; a refusal is logged, not an error). */
int sx__rdma_ring_alloc_near(sx_rdma *t, rdma_dev *d, sx__rdma_ring *r, size_t bytes,
                             size_t n_msgs);

/* ------------------------------------------------------------------ rdma_sserve.c */

/* A reader's stage hello (incarnation and token checked): accept it with
 * a ring of its own, or reject. */
void sx__rdma_sserve_request(sx_rdma *t, struct rdma_cm_id *id, rdma_dev *dev,
                             const sx__rdma_hello *h, unsigned reads);
/* An authorized producer's stage QP (tc->write, tc->producer known):
 * a ring of its own in the write PD, a QP that READs the producer's slots
 * (depth at once), accepted.  0, or an error (nothing left behind; the
 * caller rejects). */
int sx__rdma_sserve_waccept(rdma_tconn *tc, unsigned depth);
/* Its QP goes (before tconn_destroy destroys the id): wait for copies,
 * free the ring. */
void sx__rdma_sserve_gone(rdma_tconn *tc);

#endif
