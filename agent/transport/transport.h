/*
 * Transports: one ops table (UCX uct_iface_ops_t style), picked per peer.
 * TCP (tcp.c) and RDMA (rdma.c) implement it.  Not installed.
 *
 * Threading: everything here runs on the agent's loop thread.  A transport
 * hooks its file descriptors (sockets, rdma_cm event channel, CQ completion
 * channel) into that uv loop; nothing blocks.
 *
 * Reader side: the agent plans a batch into sx_xfer ranges (both sides'
 * bounds already checked), groups them per peer into an sx_op and posts it.
 * The transport completes each xfer exactly once through sx__op_xfer_done();
 * the op's done callback runs when the last one settles.  Completion is a
 * counter (UCX uct_completion_t): the first error sticks.
 *
 * Target side: the transport serves reads of the agent's registered regions,
 * checking what the peer cannot be trusted with (token, incarnation, region
 * id, remote-read flag, bounds) through the sx_tctx it was opened with.
 */
#ifndef SX_AGENT_TRANSPORT_H
#define SX_AGENT_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>
#include <uv.h>

#include "mem/mem.h"
#include "segxfer/agent.h"
#include "segxfer/descriptor.h"

#define SX__TRANSPORT_SLOTS 4 /* indexed by sx_transport_kind */

typedef struct sx_transport sx_transport;
typedef struct sx_tpeer sx_tpeer;
typedef struct sx__lane sx__lane; /* direct reads (below) */

/* A region this agent registered. */
typedef struct sx_lregion {
  sx_region r;         /* as published (transports fill r.rkeys in pack) */
  uint32_t inflight;   /* target side: reads of it being served right now */
  int withdrawn;       /* no longer published: refuse new reads */
  void *tpriv[SX__TRANSPORT_SLOTS]; /* per transport (RDMA: its MRs) */
  sx__mem_info mem;    /* host or CUDA memory (checked at registration) */
} sx_lregion;

/* Push mode: a producer's pending write authorization (agent/grant.c). */
typedef struct sx_wauth sx_wauth;
/* status 0: producer (its name as the store has it) may write; else why
 * not (SX_EACCESS no grant or a bad token, SX_ESTALE another incarnation
 * holds the name, SX_ENOENT not published, store errors) and msg says so. */
typedef void (*sx_wauth_cb)(void *arg, int status, const char *producer, const char *msg);

/* What a transport may ask of the agent that opened it. */
typedef struct sx_tctx {
  uv_loop_t *loop;
  const char *name;              /* this agent's segment name, or "" */
  const uint8_t *incarnation;    /* SX_INCARNATION_LEN */
  const uint8_t *token;          /* SX_TOKEN_LEN: what readers must present */
  const sx_agent_params *params; /* listen, advertise, conns_per_peer, rdma_* */
  /* Look up a registered region by id (NULL if none or withdrawn). */
  sx_lregion *(*find_region)(void *agent, uint32_t id);
  /* Log one line at a level (formatted by the agent). */
  void (*log)(void *agent, sx_log_level level, const char *fmt, ...)
      __attribute__((format(printf, 3, 4)));
  /* Count a served read for metrics: bytes, or an error code. */
  void (*served)(void *agent, sx_transport_kind kind, uint64_t bytes, int err);
  void *agent;
  /* Push mode, target (consumer) side.  write_auth checks a producer that
   * asks to write: its name (NULL: find it by incarnation), incarnation and
   * token against its descriptor in the store, and this agent's grants.
   * 0: cb runs once, later, unless write_auth_cancel() comes first; < 0: the
   * refusal (cb never runs; sx_errmsg() says why). */
  int (*write_auth)(void *agent, const char *producer, const uint8_t *incarnation,
                    const uint8_t *token, sx_wauth_cb cb, void *arg, sx_wauth **out);
  void (*write_auth_cancel)(sx_wauth *w);
  /* 0 while a grant covers (producer, incarnation), else SX_EACCESS.  Cheap;
   * transports call it again whenever *grant_epoch moved (every revoke). */
  int (*write_granted)(void *agent, const char *producer, const uint8_t *incarnation);
  const uint64_t *grant_epoch;
  /* A notice (len encoded bytes) arrived from an authorized producer after
   * its writes: 0 when accepted, else the refusal with msg filled. */
  int (*notice)(void *agent, const char *producer, const uint8_t *incarnation,
                sx_transport_kind kind, const uint8_t *buf, size_t len, char *msg,
                size_t cap);
  /* A read notice (len encoded bytes) arrived on a reader's connection,
   * which presented this agent's incarnation and token; reader is the name
   * the connection stated (NULL: the transport knows none).  0 when
   * accepted, else the refusal with msg filled. */
  int (*read_notice)(void *agent, const char *reader, sx_transport_kind kind,
                     const uint8_t *buf, size_t len, char *msg, size_t cap);
  /* Count a served write for metrics: bytes, or an error code. */
  void (*written)(void *agent, sx_transport_kind kind, uint64_t bytes, int err);
  /* Count an RDMA (device, GPU) pair whose loopback READ failed (it is
   * staged from then on), for metrics. */
  void (*gpu_unreachable)(void *agent);
  /* RDMA: wrs work requests carrying bytes were posted through local
   * device dev (its index, < SX_MAX_DEVICES; named name), for per-NIC
   * metrics. */
  void (*nic_posted)(void *agent, int dev, const char *name, uint64_t wrs, uint64_t bytes);
  /* The i-th registered region (withdrawn ones included), NULL past the
   * last: cuda_ipc looks at every region sharing a CUDA allocation. */
  sx_lregion *(*region_at)(void *agent, uint32_t i);
  /* A transport whose grants_changed() returned 1 calls this once nothing
   * of the producers it took the grant from can land any more: status 0,
   * or an error (msg says which producer may still write). */
  void (*grants_settled)(void *agent, sx_transport_kind kind, int status, const char *msg);
  /* The frame handlers the transports register on the control connection
   * the TCP listener serves (transport/conn/conn.h; the list is in
   * transports.c). */
  const struct sx__conn_handler *const *conn_handlers;
  unsigned n_conn_handlers;
  /* Loop thread, lane's lock held: the direct reads in flight on lane
   * before this withdraw (on stream si, numbers above done[si]) have
   * ended but fail with err and msg (the connection was lost, or the
   * peer closed, while they ran). */
  void (*lane_failed)(void *agent, const sx__lane *lane, const uint64_t *done, unsigned n,
                      int err, const char *msg);
} sx_tctx;

/* What an sx_xfer stands for: which member of its union is live. */
enum {
  SX__XFER_RANGE = 0,   /* one contiguous range */
  SX__XFER_SCATTER = 1, /* iov: one remote range into a list of pieces */
  SX__XFER_STRIDED = 2, /* st: n_iov pieces at a fixed stride on both sides */
};

/* One range to read: length bytes at roff of remote region rreg into local.
 *
 * A scattered range (shape SX__XFER_SCATTER, iov != NULL; a read into host
 * memory over TCP only) lands in n_iov destinations instead, in order,
 * whose lengths add up to length; local is then the first of them.  It is
 * one request on the wire whose reply the reader receives straight into
 * the pieces (readv), so a remote block that a read plan cuts into
 * per-token pieces costs neither a request per piece nor a copy.  The list
 * belongs to whoever added the range and lives until the op ends.
 *
 * A strided range (shape SX__XFER_STRIDED) stands for n_iov pieces (at
 * least 2) of length / n_iov bytes each: piece k at roff + k * st.rstride
 * of rreg into local + k * st.lstride.  Neither stride is below the piece
 * length (no piece overlaps another), and every piece lies inside both
 * regions (the planner checked the first and the last).  Only transports
 * whose ops have SX__TR_STRIDED get them (cuda_ipc: one gather table entry
 * copies them all); for the others the planner emits the pieces as plain
 * ranges, so a transport without the bit may go on testing iov != NULL for
 * a scattered range.  Like any xfer it settles once, for all its pieces.
 *
 * n_iov fits in 30 bits: a scattered range holds at most SX__SCATTER_MAX
 * bytes in non-empty pieces, a strided one is cut below 2^30 pieces. */
typedef struct sx_xfer {
  uint8_t *local;
  const sx_lregion *lreg; /* local region holding the destination, or NULL */
  const sx_region *rreg;  /* in the batch's segment's descriptor: the peer's
                           * incarnation, maybe a later generation than the
                           * one the peer was opened with (remote addr, rkeys) */
  uint64_t roff;
  uint64_t length;        /* every byte it moves (all pieces) */
  uint32_t entry_first;   /* batch entries this range serves */
  uint32_t entry_last;
  int status;             /* 1 while pending, then 0 or SX_E* */
  uint32_t n_iov : 30;    /* pieces: of iov (scattered) or strided */
  uint32_t shape : 2;     /* SX__XFER_* */
  union {
    const struct iovec *iov;   /* SX__XFER_SCATTER */
    struct {
      uint32_t lstride, rstride;
    } st;                      /* SX__XFER_STRIDED */
  };
} sx_xfer;

_Static_assert(sizeof(sx_xfer) == 64, "sx_xfer stays one cache line");

/* The most remote regions an op lists (sx_op.rregs). */
#define SX__OP_RREGS 16u

typedef struct sx_op sx_op;
struct sx_op {
  sx_xfer *xfers;
  size_t n;
  /* From the planner, where it kept them: every remote region the xfers
   * read, each once (n_rregs of them; 0 when it did not keep the list:
   * more than SX__OP_RREGS), and how many xfers are strided.  A transport
   * that sets up per region may look at these instead of every xfer. */
  const sx_region *const *rregs;
  uint32_t n_rregs;
  uint32_t n_strided;
  size_t pending;   /* xfers not settled yet */
  uint64_t total;   /* bytes of all xfers (or of the table) */
  uint64_t bytes;   /* bytes that arrived */
  /* A table op (a transport with SX__TR_TABLES): no xfers (n 0); the
   * planner's gather table instead, n_tab pieces in pinned memory, their
   * sources relative to rregs[piece.region], every destination in GPU
   * memory of tab_device.  It settles whole (pending 1), by
   * sx__op_xfers_done. */
  const sx__mem_bpiece *tab;
  size_t n_tab;
  int tab_device;
  int first_error;
  char message[256];
  void (*done)(sx_op *op); /* once, when pending reaches 0 */
  void *owner;
  /* Push: the op's notice (sx_transport_ops.notify) settled with status
   * 0 (the consumer accepted it) or an error and msg. */
  void (*noticed)(sx_op *op, int status, const char *msg);
};

/* Settle xfer idx of op with status (0 or SX_E*); msg (may be NULL) becomes
 * the op's message if this is its first error.  Calls op->done at zero. */
void sx__op_xfer_done(sx_op *op, size_t idx, int status, const char *msg);
/* Keep status (SX_E*; 0 is ignored) and msg (NULL: its name) as the op's
 * error if it has none yet, without settling anything. */
void sx__op_error(sx_op *op, int status, const char *msg);
/* Settle every xfer of op still pending with status, as one
 * sx__op_xfer_done() each would (bytes counted, the first error kept), but
 * in one pass and calling op->done once: for a transport whose whole op
 * ended together (one stream's copies, one notice), or that fails or
 * cancels all that is left of it.  A table op settles whole. */
void sx__op_xfers_done(sx_op *op, int status, const char *msg);

/* sx_transport_ops.caps */
#define SX__TR_STRIDED 1u /* post() takes strided xfers (SX__XFER_STRIDED) */
#define SX__TR_TABLES 2u  /* post() takes table ops (sx_op.tab) */

/*
 * Direct reads (cuda_ipc).  A read peer's lane runs table ops on the
 * thread that submits them, without the agent's loop: the lane holds what
 * a table op needs from the loop (each mapped region's address, per
 * region of the peer's descriptor, and streams of its own), published by
 * the loop whenever it ran a table op of that peer, and withdrawn by the
 * loop (under the lane's lock) before anything it needs goes: a region
 * given back, a lost connection, the peer closing.  Withdrawing waits for
 * the direct reads in flight first (their copies are microseconds).  A
 * direct read is a ticket: the stream writes its number into a word of
 * pinned memory behind its copies, and whoever holds the ticket watches
 * the word.
 */
typedef struct sx__lane_ticket {
  sx__lane *lane; /* a reference, dropped by lane_ref(lane, -1) */
  unsigned si;    /* the lane's stream */
  uint64_t no;    /* the number the stream writes once the copies ended */
  int err;        /* atomic: a launch refused on the launcher's thread */
} sx__lane_ticket;

typedef struct sx_transport_ops {
  const char *name;
  sx_transport_kind kind;
  unsigned caps;          /* SX__TR_*: what post() takes beyond plain ranges */
  /* Start serving (listeners).  SX_ENODEV when the transport cannot run
   * here (no RDMA device): the agent then goes on without it. */
  int (*open)(const sx_tctx *ctx, sx_transport **out);
  /* Stop serving, close every peer (failing ops in flight), free. */
  void (*close)(sx_transport *t);
  /* Make a region readable through this transport (RDMA: ibv_reg_mr on
   * every device) and drop it again.  dereg_mem is only called once the
   * region is withdrawn and no reads of it are in flight. */
  int (*reg_mem)(sx_transport *t, sx_lregion *r);
  void (*dereg_mem)(sx_transport *t, sx_lregion *r);
  /* Add this transport's endpoints to the descriptor being published and
   * fill its regions' rkeys (regions appear in d in registration order). */
  int (*pack)(sx_transport *t, sx_desc *d);
  /* Can this transport reach the segment described by remote? 1 or 0. */
  int (*usable)(sx_transport *t, const sx_desc *remote);
  /* Per remote segment incarnation; connects lazily, reconnects after a
   * failure on the next post.  remote stays valid until peer_close. */
  int (*peer_open)(sx_transport *t, const sx_desc *remote, sx_tpeer **out);
  /* Fail ops in flight (SX_ECANCELED), close connections, free. */
  void (*peer_close)(sx_tpeer *p);
  /* Start reading the op's xfers.  0: every xfer will be settled; < 0:
   * none was posted and done will not run. */
  int (*post)(sx_tpeer *p, sx_op *op);
  /* Stop an op early (deadline, cancel): settle its unfinished xfers with
   * status once nothing can write their destinations any more (RDMA: after
   * the flush of a QP moved to error).  Done then runs as usual. */
  void (*abort)(sx_tpeer *p, sx_op *op, int status);

  /* Push mode; optional (sx__tr_call() answers SX_ENOTSUP without them).
   * wpeer_open: a peer whose connections present this agent as a producer
   * (name, incarnation, token) and carry writes: post() then writes each
   * xfer's local bytes to the remote range and settles it once the target
   * acknowledged that they landed; abort() settles only once nothing reads
   * the sources any more.  notify: send the op's notice (len bytes, copied)
   * after every xfer settled with 0; op->noticed runs once (abort() settles
   * it too); < 0: not sent, noticed will not run.  On a read peer
   * (peer_open) notify sends a read notice (SX_BATCH_NOTIFY), which the
   * target hands to ctx->read_notice; SX_ENOTSUP where the transport
   * cannot (RDMA: the agent sends it over TCP instead).  grants_changed: grants
   * were revoked: stop the writes of producers no grant covers.  0: nothing
   * of them lands from now on; 1: something still may (a device copy
   * running, a CUDA IPC mapping not given back yet), and ctx->grants_settled
   * runs once it cannot any more (sx_agent_revoke_write waits for it). */
  int (*wpeer_open)(sx_transport *t, const sx_desc *remote, sx_tpeer **out);
  int (*notify)(sx_tpeer *p, sx_op *op, const uint8_t *buf, size_t len);
  int (*grants_changed)(sx_transport *t);
  /* Optional: r was just withdrawn (it is being unregistered).  Transports
   * that lent it out beyond single reads (TCP: CUDA IPC handles) ask for it
   * back here and hold r->inflight until it is returned. */
  void (*withdraw)(sx_transport *t, sx_lregion *r);

  /* Direct reads; optional.  lane (loop thread): the read peer's lane, or
   * NULL (none: a write peer, no stream writes); the pointer is the
   * peer's, lane_ref(+1) makes it the caller's.  lane_ref (any thread):
   * take or drop a reference; the last frees it.  lane_read (any thread
   * but the loop's): queue table op op (tab, n_tab, tab_device, rregs,
   * n_rregs: nothing else is read) and fill *tk (a reference taken): 0;
   * SX_EBUSY when the lane cannot take it now (not published yet, a
   * region it has no mapping of, withdrawn): the loop must run it.
   * lane_done (any thread): 1 once tk's copies ended (tk->err, or the
   * stream's failure when ask found it stopped without writing the word,
   * says how), else 0; ask also asks the driver (microseconds: not on
   * every look). */
  sx__lane *(*lane)(sx_tpeer *p);
  void (*lane_ref)(sx__lane *l, int delta);
  int (*lane_read)(sx__lane *l, const sx_op *op, sx__lane_ticket *tk);
  int (*lane_done)(sx__lane *l, sx__lane_ticket *tk, int ask);
  /* Loop thread: run note (on the loop) once tk's copies ended: 0; 1 when
   * they have (nothing queued: look now); < 0 when it cannot be queued. */
  int (*lane_watch)(sx__lane *l, const sx__lane_ticket *tk, sx__mem_notice *note);
} sx_transport_ops;

/* The one dispatcher for optional slots: a missing slot is SX_ENOTSUP. */
#define sx__tr_call(ops, slot, ...) ((ops)->slot ? (ops)->slot(__VA_ARGS__) : SX_ENOTSUP)

/* Each transport's structs start with these. */
struct sx_transport {
  const sx_transport_ops *ops;
  const sx_tctx *ctx;
};

struct sx_tpeer {
  sx_transport *t;
};

/* This host's boot id and hostname and this process's random number into d
 * (agent/host.c): what cuda_ipc compares to find a target on this host. */
void sx__host_identity(sx_desc *d);

extern const sx_transport_ops sx__tcp_ops;
extern const sx_transport_ops sx__rdma_ops;
extern const sx_transport_ops sx__cuda_ipc_ops;
/* Their handlers on the control connection (transport/conn/conn.h). */
extern const struct sx__conn_handler sx__tcp_read_frames, sx__tcp_readv_frames,
    sx__tcp_push_frames, sx__ipc_frames;

#endif
