/*
 * The transports built into this library, in the order the agent prefers
 * them for a peer.  RDMA is compiled in only when agent/transport/rdma/rdma.c exists (the
 * Makefile then defines SX_HAVE_RDMA), so the agent links and runs without
 * it; a weak symbol would not do, since a static link would then silently
 * leave rdma.o out of the program.
 */
#include "transport.h"

const sx_transport_ops *const sx__transports[] = {
    &sx__cuda_ipc_ops, /* opens only where a CUDA driver is (else SX_ENODEV) */
#ifdef SX_HAVE_RDMA
    &sx__rdma_ops,
#endif
    &sx__tcp_ops,
};

const unsigned sx__n_transports = sizeof(sx__transports) / sizeof(sx__transports[0]);

/* The control connection's frame handlers (transport/conn/conn.h), one
 * floor below TCP and cuda_ipc: listed here, above both, and handed to the
 * connection through the transport context, so neither transport names
 * the other. */
const struct sx__conn_handler *const sx__conn_handlers[] = {
    &sx__tcp_read_frames,  /* READ (owns the slot READV shares: first) */
    &sx__tcp_readv_frames, /* READV */
    &sx__tcp_push_frames, /* WAUTH .. NOTICE_REPLY */
    &sx__ipc_frames,      /* IPC */
};

const unsigned sx__n_conn_handlers = sizeof(sx__conn_handlers) / sizeof(sx__conn_handlers[0]);
