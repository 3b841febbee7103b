/*
 * The TCP transport (libuv).  Wire format in transport/conn/frame.h.
 *
 * Target side: one listener; each reader connection first sends HELLO
 * (its name, the incarnation it expects, the access token), which is
 * checked (incarnation -> SX_ESTALE, token in constant time -> SX_EACCESS)
 * before anything else.  Then every READ is checked (region id, its
 * remote-read flag and that it is not withdrawn, bounds with overflow-safe
 * arithmetic) and answered in order with a status.  Replies to the READs of
 * one socket read go out in one uv_write whose buffers alternate between a
 * header and the payload straight from registered memory; each region's
 * `inflight` counts the replies until the write completes, so unregister
 * can wait for them.  Bad requests get an error reply and the connection
 * keeps serving; only protocol violations (bad magic/version/type/flags,
 * oversized HELLO, no HELLO first, a failed HELLO) close it.
 *
 * Reader side: per peer (remote incarnation) conns_per_peer persistent
 * connections, made by the first post and remade by the next post after a
 * failure.  Ranges queue per peer and are spread round-robin over the ready
 * connections, at most WINDOW_REQS / WINDOW_BYTES in flight on each; the
 * request headers gathered in one loop iteration go out in one write per
 * connection, and a connection whose window is half free asks for more
 * from its read callback (large blocks: libuv's read burst would
 * otherwise drain the window before the pump runs).  Replies come back in
 * order, so the oldest request in flight is the one being answered: the
 * alloc callback hands libuv the header buffer for header bytes and the
 * destination itself for payload bytes (no copy).  A request aborted while
 * in flight has its payload drained into a scratch buffer, so a batch's
 * destinations are never written after it ended.
 *
 * Large payloads move on data-mover threads (transport/conn/xpool.h), so
 * that several connections are not capped at the loop thread's one core:
 * a reader's receive of large replies (tcp_rx.c), a target's write of
 * large replies (conn.c).  The loop keeps owning the connections and
 * takes a job back before it aborts, fails or closes anything.
 *
 * The code: tcp.c (this file: open, close, endpoint, ops table), tcp_serve.c
 * (target side: the READ handler), tcp_write.c (target side: the push
 * handler), tcp_read.c, tcp_reply.c and tcp_rx.c (reader side).  The connections the listener
 * accepts (HELLO, framing, the reply queue, dispatch by frame type) are
 * transport/conn/, one floor down, which cuda_ipc's handler shares.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "addr.h"
#include "internal.h"
#include "tcp_int.h"
#include "tcp_stage.h"

void sx__tcp_maybe_free(tcp_t *t) {
  if (t->closing && t->live == 0 && t->srv.n_conns == 0) {
    free(t->scratch);
    free(t);
  }
}

static void tcp_close(sx_transport *base);

/* The control connection (transport/conn/) accepts and serves; the
 * transport counts the connections to know when it may be freed. */
static void t_accept(uv_stream_t *server, int status) {
  tcp_t *t = server->data;
  sx__conn_accept(&t->srv, server, status);
}

static void t_conn_freed(sx__conn_server *s) { sx__tcp_maybe_free(sx__tcp_of(s)); }

/* The data-mover threads (transport/conn/xpool.h): how many, from which
 * payload size on, and from how many busy connections on
 * (transport/conn/engage.h).  The environment (SX_TCP_THREADS,
 * SX_TCP_THREAD_BYTES, SX_TCP_THREAD_CONNS) wins over the agent's
 * parameters, so that one program can be measured with and without them
 * (docs/data-plane.md). */
static void tcp_threads(tcp_t *t) {
  const sx_tctx *x = sx__tcp_ctx(t);
  int bad;
  t->srv.pool_threads = sx__xpool_size(x->params->tcp_threads, &bad);
  if (bad)
    x->log(x->agent, SX_LOG_WARN, "tcp: SX_TCP_THREADS is not 0..64: ignored");
  uint64_t min = x->params->tcp_thread_bytes ? x->params->tcp_thread_bytes : TCP_THREAD_BYTES;
  const char *env = getenv("SX_TCP_THREAD_BYTES");
  if (env != NULL && *env != '\0') {
    char *end;
    unsigned long long v = strtoull(env, &end, 10);
    if (*end == '\0' && v >= 1 && v <= MAX_READ)
      min = v;
    else
      x->log(x->agent, SX_LOG_WARN, "tcp: SX_TCP_THREAD_BYTES is not 1..%u: ignored",
             MAX_READ);
  }
  t->srv.pool_min = min;
  uint32_t conns = sx__engage_conns(&bad);
  if (bad)
    x->log(x->agent, SX_LOG_WARN, "tcp: SX_TCP_THREAD_CONNS is not 1..1024: ignored");
  sx__engage_init(&t->srv.rx_eng, SX__XJOB_RECV, conns);
  sx__engage_init(&t->srv.tx_eng, SX__XJOB_SEND, conns);
}

static int tcp_open(const sx_tctx *ctx, sx_transport **out) {
  tcp_t *t = calloc(1, sizeof(*t));
  if (t == NULL || (t->scratch = malloc(SCRATCH_BYTES)) == NULL) {
    free(t);
    return sx__err(SX_ENOMEM, "tcp: open");
  }
  t->base.ops = &sx__tcp_ops;
  t->base.ctx = ctx;
  sx__conn_server_init(&t->srv, ctx, t_conn_freed);
  tcp_threads(t);
  t->loop = ctx->loop;
  uv_idle_init(t->loop, &t->pump);
  t->pump.data = t;
  t->live = 1;
  const char *listen = ctx->params->listen;
  if (listen == NULL) {
    /* A reader-only agent: it reads, nobody reads from it. */
    *out = &t->base;
    return 0;
  }
  char host[256];
  struct sockaddr_storage ss;
  int rc;
  if (sx__hostport_sockaddr(listen, &ss, host, sizeof(host)) != 0) {
    rc = sx__err(SX_EINVAL, "tcp: listen address '%.64s' is not IP:port", listen);
    tcp_close(&t->base); /* freed once the loop has closed its handles */
    return rc;
  }
  uv_tcp_init(t->loop, &t->listener);
  t->listener.data = t;
  t->listener_init = 1;
  t->live++;
  int uvrc = uv_tcp_bind(&t->listener, (struct sockaddr *)&ss, 0);
  if (uvrc == 0)
    uvrc = uv_listen((uv_stream_t *)&t->listener, 128, t_accept);
  if (uvrc != 0) {
    rc = sx__err(SX_EIO, "tcp: cannot listen on %s: %s", listen, uv_strerror(uvrc));
    tcp_close(&t->base);
    return rc;
  }
  int len = sizeof(ss);
  uv_tcp_getsockname(&t->listener, (struct sockaddr *)&ss, &len);
  t->port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
  t->listening = 1;
  ctx->log(ctx->agent, SX_LOG_INFO, "tcp: serving on %s port %u (advertised as %s)",
           host, t->port, ctx->params->advertise ? ctx->params->advertise : host);
  *out = &t->base;
  return 0;
}

static void t_handle_closed(uv_handle_t *h) {
  tcp_t *t = h->data;
  t->live--;
  sx__tcp_maybe_free(t);
}

static void tcp_close(sx_transport *base) {
  tcp_t *t = (tcp_t *)base;
  t->closing = 1;
  while (t->peers != NULL)
    sx__tcp_stage_peer_close((sx_tpeer *)t->peers);
  sx__conn_close_all(&t->srv);
  /* Every connection took its data-mover job back above. */
  sx__xpool_destroy(t->srv.pool);
  t->srv.pool = NULL;
  sx__tcp_stage_close(t);
  if (t->listener_init)
    uv_close((uv_handle_t *)&t->listener, t_handle_closed);
  uv_close((uv_handle_t *)&t->pump, t_handle_closed);
}

static int tcp_pack(sx_transport *base, sx_desc *d) {
  tcp_t *t = (tcp_t *)base;
  if (!t->listening)
    return 0;
  sx_endpoint e;
  memset(&e, 0, sizeof(e));
  e.kind = SX_TRANSPORT_TCP;
  const char *adv = sx__tcp_ctx(t)->params->advertise;
  if (sx__strlcpy(e.addr, adv ? adv : "127.0.0.1", sizeof(e.addr)))
    return sx__err(SX_ELIMIT, "tcp: advertised address is longer than %d bytes",
                   SX_ADDR_MAX);
  e.port = t->port;
  return sx_desc_add_endpoint(d, &e);
}

const sx_endpoint *sx__tcp_endpoint(const sx_desc *d) {
  for (uint32_t i = 0; i < d->n_endpoints; i++)
    if (d->endpoints[i].kind == SX_TRANSPORT_TCP)
      return &d->endpoints[i];
  return NULL;
}

static int tcp_usable(sx_transport *base, const sx_desc *remote) {
  (void)base;
  return sx__tcp_endpoint(remote) != NULL;
}

static void tcp_withdraw(sx_transport *base, sx_lregion *l) {
  if (l->mem.kind == SX__MEM_CUDA)
    sx__conn_withdraw(&((tcp_t *)base)->srv, l);
}

/* A writable GPU region makes its whole allocation writable through a
 * CUDA IPC handle: readers holding a handle of it without a write grant
 * are asked to give it back (transport/cuda/ipc_serve.c). */
static int tcp_reg_mem(sx_transport *base, sx_lregion *l) {
  if (l->mem.kind == SX__MEM_CUDA && (l->r.access & SX_ACCESS_REMOTE_WRITE))
    sx__conn_gated(&((tcp_t *)base)->srv, l);
  return 0;
}

const sx_transport_ops sx__tcp_ops = {
    .name = "tcp",
    .kind = SX_TRANSPORT_TCP,
    .open = tcp_open,
    .close = tcp_close,
    .pack = tcp_pack,
    .usable = tcp_usable,
    .peer_open = sx__tcp_peer_open,
    .peer_close = sx__tcp_stage_peer_close,
    .post = sx__tcp_stage_post,
    .abort = sx__tcp_stage_abort,
    .withdraw = tcp_withdraw,
    .reg_mem = tcp_reg_mem,
    .wpeer_open = sx__tcp_wpeer_open,
    .notify = sx__tcp_notify,
    .grants_changed = sx__tcp_grants_changed,
};
