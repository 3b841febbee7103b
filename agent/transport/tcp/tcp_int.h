/*
 * The TCP transport's shared insides: the transport object, the limits, and
 * the functions its three files call across.  Not installed.
 *
 *   tcp.c        open/close, the endpoint in the descriptor, the ops table
 *   tcp_serve.c  target side: reader connections, HELLO, serving READs
 *   tcp_read.c   reader side: peers, connections, the request pump
 *   tcp_frame.c  the wire format (pure functions, fuzzed)
 *
 * Everything runs on the agent's loop thread.
 */
#ifndef SX_TCP_INT_H
#define SX_TCP_INT_H

#include <stdint.h>
#include <uv.h>

#include "tcp_frame.h"
#include "transport/transport.h"

/* Reader side. */
#define WINDOW_REQS 64              /* requests in flight per connection */
#define WINDOW_BYTES (16u << 20)    /* bytes in flight per connection */
#define CONNECT_TIMEOUT_MS 5000     /* connect + hello */
#define SCRATCH_BYTES 65536         /* drain for aborted payload */
/* Target side. */
#define MAX_READ (64u << 20)        /* longest READ served */
#define MAX_CONNS 1024              /* reader connections at once */
#define MAX_CONNS_PER_READER 64     /* per reader name (unnamed: per address) */
#define HELLO_TIMEOUT_MS 5000       /* a connection must say HELLO by then */
#define SERVER_RBUF 16384           /* >= header + largest HELLO */
#define REPLIES_PER_WRITE 256
#define SERVER_QUEUE_MAX 1024       /* replies queued before it stops reading */
#define SERVER_SEND_MAX (1u << 20)  /* bytes of CUDA IPC frames queued, the same */

typedef struct tcp_t tcp_t;
typedef struct sconn sconn; /* a reader's connection to us (tcp_serve.c) */
typedef struct tpeer tpeer; /* a target we read from (tcp_read.c) */

struct tcp_t {
  sx_transport base;
  uv_loop_t *loop;
  uv_tcp_t listener;
  int listener_init, listening;
  uint16_t port;
  sconn *sconns;
  uint32_t n_sconns;
  tpeer *peers;
  tpeer *pump_list;
  uv_idle_t pump;
  uint8_t *scratch;
  int closing;
  int live; /* handles, server connections and peers not yet freed */
  struct sx__tcp_stage *stage; /* GPU staging (tcp_stage.c), made on first use */
  /* Push: things of revoked producers that may still land (device copies
   * of staged WRITEs, CUDA IPC mappings not given back); grants_settled
   * is called when this drops to 0 after grants_changed returned 1. */
  uint32_t revoking;
  int revoke_notify, revoke_err;
  char revoke_msg[256];
};

static inline const sx_tctx *sx__tcp_ctx(const tcp_t *t) { return t->base.ctx; }

/* tcp.c: free the transport once it is closing and nothing lives on. */
void sx__tcp_maybe_free(tcp_t *t);
/* tcp.c: the TCP endpoint a descriptor publishes, or NULL. */
const sx_endpoint *sx__tcp_endpoint(const sx_desc *d);

/* tcp_serve.c: the listener's connection callback; close every reader. */
void sx__tcp_on_connection(uv_stream_t *server, int status);
void sx__tcp_serve_close_all(tcp_t *t);
/* tcp_serve.c: l is being unregistered: readers holding its CUDA IPC handle
 * are asked to give it back (transport/cuda/ipc_serve.c). */
void sx__tcp_serve_withdraw(tcp_t *t, sx_lregion *l);

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

/* Push mode, target (consumer) side: tcp_write.c.  A connection's write
 * state, made by its first push frame. */
#define MAX_WRITE (64u << 20) /* longest WRITE taken; longer ones close */
typedef struct sx__tcp_wconn {
  sconn *c;            /* NULL once the connection closed */
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

/* s_process: a push frame (type >= SX__FRAME_WAUTH) at buf, avail bytes
 * read so far.  Returns the bytes used (> 0), 0 when more must be read
 * first, < 0 when the connection is closing.  After it, the caller stops
 * parsing while (*w)->left or (*w)->auth is set. */
int sx__tcp_w_frame(sconn *c, sx__tcp_wconn **w, const sx__frame *f, uint8_t *buf,
                    size_t avail);
/* s_alloc/s_read: while a body arrives, where to read it and what came. */
void sx__tcp_w_alloc(sx__tcp_wconn *w, uv_buf_t *buf);
void sx__tcp_w_read(sx__tcp_wconn *w, size_t n);
/* s_closed: the connection is gone. */
void sx__tcp_w_free(sx__tcp_wconn *w);
/* grants_changed: writes of revoked producers landing now are cut short
 * (the rest of their payload is drained), CUDA IPC handles lent to them
 * are asked back; 1 while something of them may still land. */
int sx__tcp_grants_changed(sx_transport *t);
/* 0 while w (NULL: none) passed WAUTH and a grant covers it now, else
 * SX_EACCESS. */
int sx__tcp_w_allowed(sx__tcp_wconn *w);
/* The grants changed: if w's producer lost its grant, a WRITE landing now
 * lands nothing more (its payload is drained, its reply says SX_EACCESS). */
void sx__tcp_w_revoked(sx__tcp_wconn *w);
/* 1 while w's connection must parse nothing more (an authorization or a
 * staged WRITE's device copies are pending). */
int sx__tcp_w_holds(const sx__tcp_wconn *w);
/* Something of a revoked producer may still land / cannot any more (err:
 * why the revoke cannot vouch for it, with msg). */
void sx__tcp_revoke_hold(tcp_t *t);
void sx__tcp_revoke_release(tcp_t *t, int err, const char *msg);

/* tcp_serve.c, for tcp_write.c: queue a reply without payload, send what
 * is queued, close for a protocol violation, stop or resume reading (a
 * resume parses what was held back), and the HELLO name. */
void sx__tcp_sconn_reply(sconn *c, uint64_t id, uint8_t type, int status);
int sx__tcp_sconn_flush(sconn *c);
void sx__tcp_sconn_violation(sconn *c, const char *what);
void sx__tcp_sconn_hold(sconn *c);
void sx__tcp_sconn_wresume(sconn *c);
const char *sx__tcp_sconn_reader(const sconn *c);
tcp_t *sx__tcp_sconn_transport(const sconn *c);
/* The connection's push state (NULL before its first push frame), and
 * whether it asked for CUDA IPC handles (a cuda_ipc peer's connection). */
sx__tcp_wconn *sx__tcp_sconn_wconn(const sconn *c);
int sx__tcp_sconn_ipc(const sconn *c);
/* tcp_serve.c, for grants_changed and reg_mem: every connection's push
 * state and lent CUDA IPC handles looked at again. */
void sx__tcp_serve_revoked(tcp_t *t);
void sx__tcp_serve_gated(tcp_t *t, const sx_lregion *l);

#endif
