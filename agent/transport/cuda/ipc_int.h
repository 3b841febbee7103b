/*
 * cuda_ipc, reader side: the transport, its peers, their mappings and
 * control connections, shared by cuda_ipc.c and ipc_conn.c.  Not
 * installed.  Everything runs on the agent's loop thread.
 */
#ifndef SX_IPC_INT_H
#define SX_IPC_INT_H

#include <stdint.h>
#include <uv.h>

#include "cuda_ipc.h"
#include "mem/mem.h"

#define IPC_STREAMS 4       /* per local device */
#define IPC_MAX_DEVICES 64
#define IPC_SLOTS 8         /* distinct streams one op may use */
#define IPC_CONNECT_MS 5000
#define IPC_SPARE_OPS 32    /* ops kept for reuse per transport */
#define IPC_SPARE_RANGES 1024 /* the largest op whose arrays are kept */

typedef struct cipc_t cipc_t;
typedef struct iop iop;

struct cipc_t {
  sx_transport base;
  uv_loop_t *loop;
  sx__mem_notifier *nf;
  sx__mem_launcher *launcher; /* makes the streams' launches and notices, or NULL */
  int launch_mode;         /* SX_GPU_LAUNCHER: 0 never, 1 always, 2 auto */
  sx__mem_stream *streams[IPC_MAX_DEVICES][IPC_STREAMS];
  unsigned rr[IPC_MAX_DEVICES];
  unsigned rr_op;          /* the stream of the next op on each device */
  sx__mem_copy_method method; /* SX_GPU_COPY, read at open */
  int spread;              /* SX_GPU_COPY=batch|range: ranges over the streams */
  unsigned said;           /* copy methods logged so far (bit per method) */
  iop *spare;              /* ops to reuse (their arrays kept), n_spare of them */
  unsigned n_spare;
  ipc_peer *peers;
  sx_desc self;            /* host_id and process only */
};

/* A mapping of one target allocation into one local device's context. */
typedef struct ipc_map {
  struct ipc_map *next;
  uint64_t base;           /* the allocation's address in the target */
  int device;              /* local device it is mapped into */
  uint8_t *ptr;
  uint64_t size;
} ipc_map;

enum { R_NONE, R_ASKED, R_READY, R_FAILED };

/* What the reader knows of one region of the target: its id, place and
 * size (copied: a region may come from a later descriptor of the same
 * incarnation than the one the peer was opened with), and its handle. */
typedef struct ipc_reg {
  uint32_t id;
  uint64_t addr, length;
  int state;
  int err;
  int gated;               /* refused for want of a write grant */
  sx__ipc_record rec;
  ipc_map *map;            /* the last mapping used (cache) */
} ipc_reg;

enum { C_IDLE, C_CONNECTING, C_HELLO, C_WAUTH, C_READY, C_CLOSING };

/* Push: a notice sent, waiting for its NOTICE_REPLY. */
typedef struct ipc_note {
  struct ipc_note *next;
  sx_op *op;
  uint64_t id;
} ipc_note;

/* p->wauth: where the producer's write authorization stands. */
enum { WA_NONE = 0, WA_PENDING = 1, WA_OK = 2 }; /* < 0: refused with that code */

/* One completion notice: the copies of op on one stream. */
typedef struct iop_slot {
  sx__mem_notice note;
  iop *o;
  sx__mem_stream *s;
  uint32_t left;           /* ranges of the op on this stream not settled */
  int host;                /* one of them has a host destination or source */
} iop_slot;

struct iop {
  iop *next, *prev;        /* p->waiting or p->running (t->spare when free) */
  cipc_t *t;
  ipc_peer *p;             /* NULL once the peer closed under it */
  sx_op *op;
  int status;              /* abort status: ranges settle with it */
  int one;                 /* every range copied, on one stream: settle at once */
  uint8_t *slot;           /* per range: its slot, or 0xff (not copied) */
  uint32_t *ri;            /* per range: its region's index in p->regs
                            * (UINT32_MAX: none, the range fails) */
  int ri_late;             /* ri is written by run(), from rix */
  uint32_t rix[SX__OP_RREGS]; /* the index of each of op->rregs */
  sx__mem_range *rg;       /* per range: its copy; then room for one stream's
                            * ranges when the op uses several */
  size_t cap;              /* ranges slot and rg have room for (rg: twice) */
  /* The strided ranges (SX__XFER_STRIDED), in op order: their copies
   * (srg[j] for the j-th), then room for one stream's; NULL until an op
   * has one. */
  sx__mem_strided *srg;
  size_t n_strided, scap;  /* of the op; room in srg (twice) */
  iop_slot slots[IPC_SLOTS];
  uint32_t n_slots, slots_left;
};

/* The regions a waiting op needs, as indexes into p->regs: a table op's
 * listed ones (rix), else each range's (ri). */
static inline size_t iop_n_regs(const iop *o) {
  return o->op->tab != NULL ? o->op->n_rregs : o->op->n;
}
static inline uint32_t iop_reg(const iop *o, size_t i) {
  return o->op->tab != NULL ? o->rix[i] : o->ri[i];
}

struct ipc_peer {
  sx_tpeer base;
  cipc_t *t;
  ipc_peer *next, *prev;   /* t->peers */
  const sx_desc *remote;
  char label[160];
  /* The target's regions: remote's in its order, then those that segments
   * opened later on a newer descriptor of the same incarnation name
   * (they share this peer; region ids are never reused in one
   * incarnation).  Looked up by id (sx__ipc_reg_find). */
  ipc_reg *regs;
  uint32_t n_regs, cap_regs;
  uint32_t cap_give;
  ipc_map *maps;
  iop *waiting, *running;
  int closing;
  int write;               /* push: batches copy from local memory into the target */
  int wauth_want;          /* say WAUTH (a named agent, a target with writable regions) */
  int wauth;               /* WA_* or the refusal */
  ipc_note *notes;         /* push: notices waiting for their reply, oldest first */
  int unmap_all;           /* the connection was lost: drop every mapping */
  uint32_t *give, n_give;  /* regions to give back once no copy runs */
  /* The control connection (ipc_conn.c). */
  int state;
  uv_tcp_t h;
  uv_timer_t timer;
  uv_connect_t creq;
  int handles;             /* uv handles not closed yet */
  uint8_t *rb;
  size_t rlen, rcap;
  uint64_t next_id;
  sx__lane *lane;          /* direct reads (ipc_lane.c), or NULL */
};

/* ipc_conn.c */
int sx__ipc_conn_init(ipc_peer *p);
/* Connect if idle; ask for the regions in R_NONE that waiting ops need. */
void sx__ipc_conn_kick(ipc_peer *p);
/* Send an IPC frame of id with these region ids. */
int sx__ipc_conn_send(ipc_peer *p, uint64_t id, const uint32_t *ids, uint32_t n);
/* Push: say WAUTH again (a grant may have come since a refusal); send a
 * NOTICE frame of id (len bytes of encoded notice). */
int sx__ipc_conn_wauth(ipc_peer *p);
int sx__ipc_conn_notice(ipc_peer *p, uint64_t id, const uint8_t *buf, size_t len);
void sx__ipc_conn_close(ipc_peer *p);

/* cuda_ipc.c, called by ipc_conn.c */
/* Regions of one incarnation a peer keeps track of, at most (each
 * descriptor's are bounded by decode; these span its generations). */
#define SX__IPC_MAX_REGS 65536u
/* The index of region id in p->regs, or p->n_regs when it has none. */
uint32_t sx__ipc_reg_find(const ipc_peer *p, uint32_t id);
void sx__ipc_records(ipc_peer *p, const uint8_t *body, size_t len);
/* The target asks back regions (ids, len bytes): 0, or SX_ENOMEM when
 * they cannot be noted (the caller closes the connection: the target then
 * counts nothing lent). */
int sx__ipc_revoked(ipc_peer *p, const uint8_t *ids, size_t len);
/* The target answered NOTICE id with status. */
void sx__ipc_noticed(ipc_peer *p, uint64_t id, int status);
/* The connection failed or closed: err for waiting ops, mappings go. */
void sx__ipc_lost(ipc_peer *p, int err, const char *msg);
void sx__ipc_peer_maybe_free(ipc_peer *p);

/* ipc_lane.c: direct reads (transport.h).  The ops' slots: */
sx__lane *sx__ipc_lane(sx_tpeer *tp);
void sx__ipc_lane_ref(sx__lane *l, int delta);
int sx__ipc_lane_read(sx__lane *l, const sx_op *op, sx__lane_ticket *tk);
int sx__ipc_lane_done(sx__lane *l, sx__lane_ticket *tk, int ask);
int sx__ipc_lane_watch(sx__lane *l, const sx__lane_ticket *tk, sx__mem_notice *note);
/* Loop thread.  publish: the table op o ran with these bases (one per
 * o->op->rregs): direct reads may use them.  withdraw: no more direct
 * reads until the next publish, and those in flight ended (they fail with
 * err and msg unless err is 0).  close: the same with SX_ECANCELED, then
 * the lane's streams go (the peer is closing). */
void sx__ipc_lane_publish(ipc_peer *p, const iop *o, const uint64_t *bases);
void sx__ipc_lane_withdraw(ipc_peer *p, int err, const char *msg);
void sx__ipc_lane_close(ipc_peer *p, const char *msg);

#endif
