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

#endif
