/*
 * The control connection, target side: the connections readers and
 * producers make to the agent's TCP listener, one floor below the
 * transports that use them.  Not installed.
 *
 *   frame.c  the wire format (pure functions, fuzzed; frame.h)
 *   conn.c   this: accepting, the HELLO handshake (incarnation and access
 *            token), framing, the reply queue, flow control, closing, and
 *            dispatch of every later frame by type to a handler
 *   xpool.c  the data-mover threads (xpool.h), which send large reply
 *            writes here and receive large replies on the TCP reader
 *   engage.c when they do: while two connections or more of a side are
 *            busy (engage.h)
 *
 * The handlers come from the transports (sx__conn_handler below): TCP
 * registers READ (tcp_serve.c) and the push frames WAUTH..NOTICE
 * (tcp_write.c), cuda_ipc its IPC frames (ipc_serve.c).  The list lives in
 * transports.c, one floor above them, and reaches the server through the
 * transport context, so TCP and cuda_ipc include this header and their
 * own, never each other's.  Each handler keeps its own state per
 * connection in a slot (NULL until its first frame there).
 *
 * Everything runs on the agent's loop thread, except the sending of a
 * large write lent to a data-mover thread (conn.c, tx_lend).
 */
#ifndef SX_CONN_H
#define SX_CONN_H

#include <stdint.h>
#include <uv.h>

#include "engage.h"
#include "frame.h"
#include "transport/transport.h"
#include "xpool.h"

#define SX__CONN_MAX 1024            /* connections at once */
#define SX__CONN_PER_READER 64       /* per reader name (unnamed: per address) */
#define SX__CONN_HELLO_MS 5000       /* a connection must say HELLO by then */
#define SX__CONN_RBUF 16384          /* >= header + largest HELLO */
#define SX__CONN_REPLIES 256         /* replies gathered into one write */
#define SX__CONN_QUEUE_MAX 1024      /* replies queued before it stops reading */
#define SX__CONN_SEND_MAX (1u << 20) /* bytes of sx__conn_send() frames queued, the same */

typedef struct sx__conn sx__conn;
typedef struct sx__conn_server sx__conn_server;

/* Per-connection state slots, one per handler (the order is the order in
 * which closing and the server-wide events below visit them). */
enum { SX__CONN_READ, SX__CONN_PUSH, SX__CONN_IPC, SX__CONN_SLOTS };

/* Frames of types [first, last] after HELLO go to frame(); the other ops
 * may be NULL.  slot is the handler's state on that connection.  Handlers
 * may share a slot (TCP's READ and READV): the first one listed owns the
 * slot's other ops. */
typedef struct sx__conn_handler {
  unsigned slot;
  uint8_t first, last;
  /* A frame f at buf, avail bytes of it read so far (header included).
   * Returns the bytes used (> 0), 0 when more must be read first, < 0 when
   * the connection is closing. */
  int (*frame)(sx__conn *c, void **slot, const sx__frame *f, uint8_t *buf, size_t avail);
  /* 1 while the connection must read and parse nothing more (a reply
   * being staged, an authorization waiting for the store). */
  int (*holds)(const void *slot);
  /* A body is arriving that goes to the handler, not the read buffer:
   * receiving says so, alloc where to read it, read what came. */
  int (*receiving)(const void *slot);
  void (*alloc)(void *slot, uv_buf_t *buf);
  void (*read)(void *slot, size_t n);
  /* 1: read the next header alone (the payload behind it then goes
   * straight where alloc says, not through the read buffer). */
  int (*header_alone)(const void *slot);
  /* The connection closes (close: its slot is cleared after) / is freed. */
  void (*close)(void *slot);
  void (*free)(void *slot);
  /* 0 while the connection may write (a producer's WAUTH passed, a grant
   * covers it), else SX_EACCESS. */
  int (*write_allowed)(const void *slot);
  /* Server-wide events, for connections with the slot set: region l is
   * withdrawn; the write grants changed; writable GPU region l is
   * registered. */
  void (*withdraw)(sx__conn *c, void *slot, sx_lregion *l);
  void (*revoked)(sx__conn *c, void *slot);
  void (*gated)(sx__conn *c, void *slot, const sx_lregion *l);
} sx__conn_handler;

struct sx__conn_server {
  const sx_tctx *x;
  sx__conn *conns;
  uint32_t n_conns;
  const sx__conn_handler *by_type[SX__FRAME_TYPE_MAX + 1];
  const sx__conn_handler *by_slot[SX__CONN_SLOTS]; /* the slot's owner */
  /* A connection was freed (the owner counts them to know when it may
   * free itself). */
  void (*freed)(sx__conn_server *s);
  /* Push: things of revoked producers that may still land (device copies
   * of staged WRITEs, CUDA IPC mappings not given back); grants_settled
   * is called when this drops to 0 after revoke_notify was set. */
  uint32_t revoking;
  int revoke_notify, revoke_err;
  char revoke_msg[256];
  /* Data-mover threads (xpool.h), shared with the TCP reader side: made
   * on first use with pool_threads workers (0: none); a reply write (and a
   * reader's payload) of at least pool_min bytes goes to them. */
  unsigned pool_threads;
  uint64_t pool_min;
  sx__xpool *pool;
  int pool_failed;
  /* When they engage (engage.h): the reader side's receive (tcp_rx.c),
   * the target side's reply writes (conn.c). */
  sx__engage rx_eng, tx_eng;
};

/* Set up s for ctx's handlers (ctx->conn_handlers); freed as above. */
void sx__conn_server_init(sx__conn_server *s, const sx_tctx *x,
                          void (*freed)(sx__conn_server *s));
/* The listener's connection callback, for s. */
void sx__conn_accept(sx__conn_server *s, uv_stream_t *server, int status);
void sx__conn_close_all(sx__conn_server *s);
/* The server-wide events of sx__conn_handler, to every open connection. */
void sx__conn_withdraw(sx__conn_server *s, sx_lregion *l);
void sx__conn_revoked(sx__conn_server *s);
void sx__conn_gated(sx__conn_server *s, const sx_lregion *l);
/* Something of a revoked producer may still land / cannot any more (err:
 * why the revoke cannot vouch for it, with msg). */
void sx__conn_revoke_hold(sx__conn_server *s);
void sx__conn_revoke_release(sx__conn_server *s, int err, const char *msg);

/* The data-mover pool, made on first use; NULL when there is none (no
 * threads configured, or they could not start: logged once). */
sx__xpool *sx__conn_pool(sx__conn_server *s);

/* For the handlers. */
sx__conn_server *sx__conn_server_of(const sx__conn *c);
const sx_tctx *sx__conn_ctx(const sx__conn *c);
/* The HELLO name, or the peer's address before it. */
const char *sx__conn_reader(const sx__conn *c);
/* Whether the slot's handler has state on c (cuda_ipc: a peer asked for
 * handles here, so notices on it come from a cuda_ipc producer). */
int sx__conn_used(const sx__conn *c, unsigned slot);
int sx__conn_write_allowed(const sx__conn *c);
/* Queue a reply of type with status; with status 0 and l, len payload
 * bytes from registered memory follow (l->inflight counts it until
 * written).  Replies go out in order, SX__CONN_REPLIES per write. */
void sx__conn_reply(sx__conn *c, uint64_t id, uint8_t type, int status, sx_lregion *l,
                    uint8_t *payload, uint64_t len);
/* One range of a READV's reply: len bytes at payload, in l. */
typedef struct sx__conn_piece {
  sx_lregion *l;
  uint8_t *payload;
  uint64_t len;
} sx__conn_piece;
/* Queue the READ_REPLY to a READV: with status 0, one header and the n
 * (>= 1) pieces' bytes (each counted in its region's inflight until
 * written); else the refusal, naming the index of the range refused. */
void sx__conn_reply_ranges(sx__conn *c, uint64_t id, int status, uint32_t index,
                           const sx__conn_piece *pc, uint32_t n);
/* Send what is queued now: 0, or < 0 when the connection is lost. */
int sx__conn_flush(sx__conn *c);
/* Send buf (malloc()ed, len bytes; freed here) after the replies
 * gathered so far. */
int sx__conn_send(sx__conn *c, uint8_t *buf, size_t len);
/* Close for a protocol violation (logged, counted). */
void sx__conn_violation(sx__conn *c, const char *what);
/* Stop reading (a handler's holds() now says 1).  Parse on once nothing
 * holds: resume clears slot first (a staged READ reply went out; err != 0
 * closes instead), wresume is for the push handler. */
void sx__conn_hold(sx__conn *c);
void sx__conn_resume(sx__conn *c, unsigned slot, int err);
void sx__conn_wresume(sx__conn *c);
/* Write bufs on c after everything written so far (uv_write's contract:
 * cb runs once, with UV_ECANCELED when the connection closes first):
 * staging's replies go out through here, so that they queue behind a
 * reply a data-mover thread is sending, and a large one (pool_min bytes
 * and more) goes to a data-mover thread itself when reply writes do.  The
 * bytes stay the caller's until cb. */
typedef struct sx__conn_wreq sx__conn_wreq;
typedef void (*sx__conn_wcb)(sx__conn_wreq *w, int status);
struct sx__conn_wreq {
  void *data;      /* the caller's */
  /* conn.c's */
  uv_write_t req;
  sx__conn *c;
  uint64_t bytes;  /* counted in the connection's queued payload */
  sx__conn_wcb cb;
};
int sx__conn_write(sx__conn *c, sx__conn_wreq *w, const uv_buf_t *bufs, unsigned n,
                   sx__conn_wcb cb);

#endif
