/*
 * The cuda_ipc transport: GPU to GPU between two processes of one host.
 * Not installed.  The code:
 *
 *   cuda_ipc.c   the ops table: open, endpoint, usable, peers, post, abort
 *   ipc_conn.c   reader side: the control connection that fetches handles
 *                (HELLO + IPC frames on the target's TCP listener)
 *   ipc_serve.c  target side: IPC frames on TCP reader connections, the
 *                handles lent per connection, revoking them on unregister
 *
 * Handles are capabilities: they travel only on the TCP data-plane
 * connection after HELLO checked the incarnation and the access token, and
 * the target counts each region lent to a connection in its `inflight`,
 * so sx_agent_unregister() waits until every reader gave it back (or was
 * cut off after SX__IPC_REVOKE_MS).  See docs/gpu.md.
 */
#ifndef SX_CUDA_IPC_H
#define SX_CUDA_IPC_H

#include <stdint.h>

#include "transport/tcp/tcp_frame.h"
#include "transport/transport.h"

#define SX__IPC_REVOKE_MS 5000 /* a reader must give handles back by then */

typedef struct sconn sconn;
typedef struct sx__ipc_holds sx__ipc_holds;

/* ------------------------------------------------ target (ipc_serve.c) */

/* An IPC frame f (body: f->length bytes) arrived on reader connection c,
 * whose lent regions are *holds (created on first use). */
void sx__ipc_serve(const sx_tctx *x, sconn *c, sx__ipc_holds **holds, const sx__frame *f,
                   const uint8_t *body);
/* l is being unregistered: ask it back if it was lent on this connection. */
void sx__ipc_revoke(sx__ipc_holds *h, sx_lregion *l);
/* The connection's producer lost its write grant: ask back every region
 * lent under it (sx__tcp_revoke_hold() until returned or cut off). */
void sx__ipc_revoke_granted(sx__ipc_holds *h);
/* Writable GPU region l is being registered: regions of its allocation
 * lent without a grant are asked back (allowed == 0), or now count as
 * lent under the connection's grant (allowed).  NULL is a no-op. */
void sx__ipc_gated(sx__ipc_holds *h, const sx_lregion *l, int allowed);
/* The connection closes: everything lent is released.  NULL is a no-op. */
void sx__ipc_drop(sx__ipc_holds *h);

/* tcp_serve.c, for the above: send buf (malloc()ed, len bytes; freed
 * here) after the replies gathered so far; close the connection. */
int sx__tcp_sconn_send(sconn *c, uint8_t *buf, size_t len);
void sx__tcp_sconn_close(sconn *c, const char *why);
const char *sx__tcp_sconn_reader(const sconn *c);

/* ------------------------------------------------ reader (ipc_conn.c) */

typedef struct ipc_peer ipc_peer;

/* One IPC_REPLY record, decoded. */
typedef struct sx__ipc_record {
  uint32_t region;
  int32_t status;
  uint64_t alloc, offset, base;
  uint8_t handle[64];
} sx__ipc_record;

void sx__ipc_record_encode(const sx__ipc_record *r, uint8_t out[SX__IPC_RECORD]);
void sx__ipc_record_decode(const uint8_t in[SX__IPC_RECORD], sx__ipc_record *r);

#endif
