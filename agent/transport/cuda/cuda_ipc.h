/*
 * The cuda_ipc transport: GPU to GPU between two processes of one host.
 * Not installed.  The code:
 *
 *   cuda_ipc.c   the ops table: open, endpoint, usable, peers, post, abort
 *   ipc_conn.c   reader side: the control connection that fetches handles
 *                (HELLO + IPC frames on the target's TCP listener)
 *   ipc_serve.c  target side: the IPC frame handler on the control
 *                connection (transport/conn/), the handles lent per
 *                connection, revoking them on unregister
 *
 * Handles are capabilities: they travel only on the control connection
 * after HELLO checked the incarnation and the access token, and
 * the target counts each region lent to a connection in its `inflight`,
 * so sx_agent_unregister() waits until every reader gave it back (or was
 * cut off after SX__IPC_REVOKE_MS).  See docs/gpu.md.
 */
#ifndef SX_CUDA_IPC_H
#define SX_CUDA_IPC_H

#include <stdint.h>

#include "transport/conn/conn.h"
#include "transport/transport.h"

#define SX__IPC_REVOKE_MS 5000 /* a reader must give handles back by then */

/* Target side (ipc_serve.c): sx__ipc_frames, the IPC frame handler on the
 * control connection (transport/conn/conn.h), keeps the regions lent on
 * each connection in its SX__CONN_IPC slot. */

/* ------------------------------------------------ reader (ipc_conn.c) */

typedef struct ipc_peer ipc_peer;

/* One IPC_REPLY record, decoded. */
typedef struct sx__ipc_record {
  uint32_t region;
  int32_t status;
  uint64_t alloc, offset, base;
  uint8_t handle[64];
} sx__ipc_record;

/* Tests: table ops (sx_op.tab) this process's readers have run, direct
 * reads (ipc_lane.c) included; the direct reads alone. */
uint64_t sx__ipc_table_ops(void);
uint64_t sx__ipc_direct_reads(void);

void sx__ipc_record_encode(const sx__ipc_record *r, uint8_t out[SX__IPC_RECORD]);
void sx__ipc_record_decode(const uint8_t in[SX__IPC_RECORD], sx__ipc_record *r);

#endif
