/*
 * The TCP transport's shared insides: the transport object, the limits, and
 * the functions its three files call across.  Not installed.
 *
 *   tcp.c        open/close, the endpoint in the descriptor, the ops table
 *   tcp_serve.c  target side: the READ handler on the control connection
 *   tcp_write.c  target side: the push handler (WAUTH, WRITE, NOTICE)
 *   tcp_read.c   reader side: peers, connections, the request pump
 *   tcp_reply.c  reader side: the replies (tcp_read_int.h between the two)
 *   tcp_rx.c     reader side: large replies received on data-mover threads
 *
 * The target side's connections (accepting, HELLO, framing, dispatch by
 * frame type) are transport/conn/, one floor down, shared with cuda_ipc;
 * so are the data-mover threads (conn/xpool.h).
 *
 * Everything runs on the agent's loop thread, except what tcp_rx.c lends
 * to a data-mover thread (a connection's receive side, for a stretch).
 */
#ifndef SX_TCP_INT_H
#define SX_TCP_INT_H

#include <stdint.h>
#include <uv.h>

#include "transport/conn/conn.h"
#include "transport/transport.h"

/* Reader side. */
#define WINDOW_REQS 64              /* requests in flight per connection */
#define WINDOW_BYTES (16u << 20)    /* bytes in flight per connection */
#define CONNECT_TIMEOUT_MS 5000     /* connect + hello */
#define SCRATCH_BYTES 65536         /* drain for aborted payload */
/* Target side. */
#define MAX_READ (64u << 20)        /* longest READ served */
/* Both: payloads from this size on move on data-mover threads (a
 * reader's reply, a target's write of replies), by default. */
#define TCP_THREAD_BYTES (256u << 10)

typedef struct tcp_t tcp_t;
typedef struct tpeer tpeer; /* a target we read from (tcp_read.c) */

struct tcp_t {
  sx_transport base;
  uv_loop_t *loop;
  uv_tcp_t listener;
  int listener_init, listening;
  uint16_t port;
  sx__conn_server srv; /* the connections made to the listener */
  tpeer *peers;
  tpeer *pump_list;
  uv_idle_t pump;
  uint8_t *scratch;
  int closing;
  int live; /* handles and peers not yet freed (connections: srv.n_conns) */
  struct sx__tcp_stage *stage; /* GPU staging (tcp_stage.c), made on first use */
};

static inline const sx_tctx *sx__tcp_ctx(const tcp_t *t) { return t->base.ctx; }
static inline tcp_t *sx__tcp_of(sx__conn_server *s) {
  return (tcp_t *)((char *)s - offsetof(tcp_t, srv));
}

/* tcp.c: free the transport once it is closing and nothing lives on. */
void sx__tcp_maybe_free(tcp_t *t);
/* tcp.c: the TCP endpoint a descriptor publishes, or NULL. */
const sx_endpoint *sx__tcp_endpoint(const sx_desc *d);

/* tcp_read.c: the reader-side ops. */
int sx__tcp_peer_open(sx_transport *base, const sx_desc *remote, sx_tpeer **out);
void sx__tcp_peer_close(sx_tpeer *base);
int sx__tcp_post(sx_tpeer *base, sx_op *op);
void sx__tcp_abort(sx_tpeer *base, sx_op *op, int status);
/* tcp_read.c, push mode: the producer's peer (WAUTH after HELLO, WRITE
 * frames with their payload) and its notices. */
int sx__tcp_wpeer_open(sx_transport *base, const sx_desc *remote, sx_tpeer **out);
/* 1 for a peer made by sx__tcp_wpeer_open() (it carries writes). */
int sx__tcp_peer_writes(const sx_tpeer *base);
int sx__tcp_notify(sx_tpeer *base, sx_op *op, const uint8_t *buf, size_t len);

/* Push mode, target (consumer) side: tcp_write.c, the push handler on the
 * control connection.  A connection's write state (its SX__CONN_PUSH
 * slot), made by its first push frame. */
#define MAX_WRITE (64u << 20) /* longest WRITE taken; longer ones close */
typedef struct sx__tcp_wconn {
  sx__conn *c;
  tcp_t *t;
  sx_wauth *auth;      /* WAUTH being checked; the connection holds */
  uint64_t auth_id;
  int verified;        /* WAUTH passed: the producer is who it says */
  int granted;         /* and a grant covers it (as of epoch) */
  uint64_t epoch;      /* grant epoch of the last check */
  char producer[SX_NAME_MAX + 1];
  uint8_t inc[SX_INCARNATION_LEN];
  /* A WRITE or NOTICE whose body is arriving. */
  uint64_t left;       /* body bytes still to come; 0: none */
  uint8_t *dst;        /* where they go; NULL: drained */
  sx_lregion *l;       /* the region written (inflight held), or NULL */
  uint8_t *notice;     /* a NOTICE body being gathered */
  uint64_t id, len;
  uint8_t type;        /* SX__FRAME_WRITE or SX__FRAME_NOTICE */
  int status;          /* what the reply will say */
  struct sx__tcp_wstage *ws; /* a WRITE into GPU memory (tcp_stage_write.c) */
} sx__tcp_wconn;

/* grants_changed: writes of revoked producers landing now are cut short
 * (the rest of their payload is drained), CUDA IPC handles lent to them
 * are asked back (each handler's revoked() on the control connection); 1
 * while something of them may still land. */
int sx__tcp_grants_changed(sx_transport *t);

#endif
