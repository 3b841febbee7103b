/*
 * RDMA transport: the ops table, open/close, peers, the connect private data
 * and the mapping of verbs and rdma_cm outcomes onto segxfer codes.
 * See rdma_int.h for how the files split the work and for the threading and
 * reentrancy rules.
 */
#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "addr.h"
#include "rdma_int.h"

_Static_assert(sizeof(sx__rdma_hello_wire) == 56, "hello must fit a RoCE/IB connect request");
_Static_assert(sizeof(sx__rdma_accept_wire) == 20, "accept wire size");
_Static_assert(sizeof(sx__rdma_reject_wire) == 8, "reject wire size");

/* ------------------------------------------------------------------ wire */

static int magic_ok(const uint8_t *m) { return m[0] == 'S' && m[1] == 'X'; }

void sx__rdma_hello_pack(sx__rdma_hello_wire *w, const char *name, uint32_t conn_index,
                         const uint8_t *incarnation, const uint8_t *token) {
  memset(w, 0, sizeof(*w));
  w->magic[0] = 'S';
  w->magic[1] = 'X';
  w->version = SX__RDMA_WIRE_VERSION;
  w->conn_index = htobe32(conn_index);
  memcpy(w->incarnation, incarnation, SX_INCARNATION_LEN);
  memcpy(w->token, token, SX_TOKEN_LEN);
  if (name != NULL) /* NUL-padded; a 16-byte name fills it without a NUL */
    memcpy(w->name, name, strnlen(name, sizeof(w->name)));
}

void sx__rdma_whello_pack(sx__rdma_hello_wire *w, uint32_t conn_index,
                          const uint8_t *target_inc, const uint8_t *producer_inc,
                          const uint8_t *producer_token) {
  sx__rdma_hello_pack(w, NULL, conn_index, target_inc, producer_token);
  w->flags = SX__RDMA_HELLO_WRITE;
  _Static_assert(sizeof(w->name) == SX_INCARNATION_LEN, "the name bytes carry an incarnation");
  memcpy(w->name, producer_inc, SX_INCARNATION_LEN);
}

int sx__rdma_hello_parse(const void *buf, size_t len, sx__rdma_hello *out) {
  sx__rdma_hello_wire w;
  if (buf == NULL || len < sizeof(w))
    return sx__err(SX_EPROTO, "connect private data is %zu bytes, a hello needs %zu",
                   len, sizeof(w));
  memcpy(&w, buf, sizeof(w));
  if (!magic_ok(w.magic))
    return sx__err(SX_EPROTO, "connect private data is not a segxfer hello");
  if (w.version != SX__RDMA_WIRE_VERSION)
    return sx__err(SX_EVERSION, "hello version %u, this target speaks %u", w.version,
                   SX__RDMA_WIRE_VERSION);
  if (w.flags & ~(SX__RDMA_HELLO_WRITE | SX__RDMA_HELLO_STAGE))
    return sx__err(SX_EPROTO, "hello flags 0x%x", w.flags);
  out->flags = w.flags;
  out->conn_index = be32toh(w.conn_index);
  memcpy(out->incarnation, w.incarnation, SX_INCARNATION_LEN);
  memcpy(out->token, w.token, SX_TOKEN_LEN);
  memset(out->producer, 0, SX_INCARNATION_LEN);
  if (w.flags & SX__RDMA_HELLO_WRITE) {
    memcpy(out->producer, w.name, SX_INCARNATION_LEN);
    out->name[0] = '\0';
    return 0;
  }
  /* The name is for logs only: keep printable bytes. */
  size_t i;
  for (i = 0; i < SX__RDMA_NAME_BYTES && w.name[i] != '\0'; i++) {
    unsigned char c = (unsigned char)w.name[i];
    out->name[i] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
  }
  out->name[i] = '\0';
  return 0;
}

void sx__rdma_accept_pack(sx__rdma_accept_wire *w, const uint8_t *incarnation) {
  memset(w, 0, sizeof(*w));
  w->magic[0] = 'S';
  w->magic[1] = 'X';
  w->version = SX__RDMA_WIRE_VERSION;
  memcpy(w->incarnation, incarnation, SX_INCARNATION_LEN);
}

int sx__rdma_accept_parse(const void *buf, size_t len, uint8_t *incarnation) {
  sx__rdma_accept_wire w;
  if (buf == NULL || len < sizeof(w))
    return 0;
  memcpy(&w, buf, sizeof(w));
  if (!magic_ok(w.magic) || w.version != SX__RDMA_WIRE_VERSION)
    return 0;
  memcpy(incarnation, w.incarnation, SX_INCARNATION_LEN);
  return 1;
}

void sx__rdma_reject_pack(sx__rdma_reject_wire *w, uint8_t reason) {
  memset(w, 0, sizeof(*w));
  w->magic[0] = 'S';
  w->magic[1] = 'X';
  w->version = SX__RDMA_WIRE_VERSION;
  w->reason = reason;
}

int sx__rdma_reject_parse(const void *buf, size_t len, uint8_t *reason) {
  sx__rdma_reject_wire w;
  if (buf == NULL || len < sizeof(w))
    return 0;
  memcpy(&w, buf, sizeof(w));
  if (!magic_ok(w.magic) || w.reason == 0)
    return 0;
  *reason = w.reason;
  return 1;
}

int sx__rdma_reject_code(uint8_t reason) {
  switch (reason) {
  case SX__RDMA_REJ_ACCESS: return SX_EACCESS;
  case SX__RDMA_REJ_STALE: return SX_ESTALE;
  case SX__RDMA_REJ_VERSION: return SX_EVERSION;
  case SX__RDMA_REJ_NOMEM: return SX_ENOMEM;
  case SX__RDMA_REJ_SHUTDOWN: return SX_ESHUTDOWN;
  case SX__RDMA_REJ_NODEV: return SX_ENODEV;
  case SX__RDMA_REJ_WACCESS: return SX_EACCESS;
  case SX__RDMA_REJ_WSTORE: return SX_ESTORE;
  case SX__RDMA_REJ_NOSTAGE: return SX_ENOTSUP;
  default: return SX_EPROTO;
  }
}

const char *sx__rdma_reject_text(uint8_t reason) {
  switch (reason) {
  case SX__RDMA_REJ_ACCESS: return "bad access token";
  case SX__RDMA_REJ_STALE: return "the target is another incarnation (it restarted)";
  case SX__RDMA_REJ_VERSION: return "the target does not speak this hello version";
  case SX__RDMA_REJ_PROTO: return "the target could not parse the hello";
  case SX__RDMA_REJ_NOMEM: return "the target is out of resources";
  case SX__RDMA_REJ_SHUTDOWN: return "the target is shutting down";
  case SX__RDMA_REJ_NODEV: return "the target does not serve the RDMA device this reached";
  case SX__RDMA_REJ_WACCESS:
    return "the target refused our writes: no write grant covers this producer, or it is not "
           "published as this incarnation";
  case SX__RDMA_REJ_WSTORE: return "the target could not look this producer up in the store";
  case SX__RDMA_REJ_NOSTAGE:
    return "the target does not stage GPU memory over RDMA (SX_RDMA_GPU=off there)";
  default: return "unknown reason";
  }
}

int sx__rdma_wc_code(enum ibv_wc_status st) {
  switch (st) {
  case IBV_WC_SUCCESS: return 0;
  /* The peer stopped answering: it died, or the path is gone. */
  case IBV_WC_WR_FLUSH_ERR:
  case IBV_WC_RETRY_EXC_ERR:
  case IBV_WC_RNR_RETRY_EXC_ERR:
  case IBV_WC_RESP_TIMEOUT_ERR:
    return SX_EDISCONN;
  default:
    return SX_ERDMA;
  }
}

const char *sx__rdma_cm_reject_status_text(int status) {
  /* IB CM REJ reasons (IBTA 12.11.3); rdma_cm passes them in event->status. */
  switch (status) {
  case 1: return "no QP resources at the target";
  case 2: return "no EEC resources";
  case 3: return "no resources";
  case 4: return "timeout";
  case 5: return "unsupported request";
  case 6: return "invalid communication id";
  case 8: return "nothing listens on that port";
  case 13: return "stale connection";
  case 28: return "rejected by the target";
  default: return "IB CM reject";
  }
}

/* ------------------------------------------------------------------ helpers */

void sx__rdma_log(sx_rdma *t, sx_log_level level, const char *fmt, ...) {
  const sx_tctx *ctx = t->base.ctx;
  if (ctx == NULL || ctx->log == NULL)
    return;
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  ctx->log(ctx->agent, level, "rdma: %s", buf);
}

const char *sx__rdma_sockaddr_str(const struct sockaddr *sa, char *buf, size_t len) {
  char host[INET6_ADDRSTRLEN] = "?";
  unsigned port = 0;
  if (sa->sa_family == AF_INET) {
    const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
    snprintf(buf, len, "%s:%u", host, port);
  } else if (sa->sa_family == AF_INET6) {
    const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)sa;
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    port = ntohs(in6->sin6_port);
    snprintf(buf, len, "[%s]:%u", host, port);
  } else {
    snprintf(buf, len, "(family %d)", sa->sa_family);
  }
  return buf;
}

static void free_handle(uv_handle_t *h) { free(h); }

static void conn_free_mem(rdma_conn *c) {
  free(c->ring);
  free(c->wrs);
  free(c->sges);
  c->ring = NULL;
  c->wrs = NULL;
  c->sges = NULL;
}

static void peer_free(rdma_peer *p) {
  for (uint32_t i = 0; i < p->n_conns; i++)
    conn_free_mem(&p->conns[i]);
  free(p->conns);
  free(p);
}

static void on_flusher(uv_timer_t *h) {
  sx_rdma *t = h->data;
  sx__rdma_enter(t);
  sx__rdma_leave(t, 1);
}

void sx__rdma_enter(sx_rdma *t) { t->busy++; }

void sx__rdma_leave(sx_rdma *t, int flush_now) {
  if (t->busy == 1) {
    /* Closed peers are reclaimed below, so what they settled goes now. */
    if (flush_now || t->closed || t->flusher == NULL || t->zombies != NULL) {
      do { /* a settled notice may end a batch whose callback posts more */
        sx__rdma_deliver(t);
        sx__rdma_w_deliver(t);
      } while (t->dhead != NULL || t->shead != NULL);
    } else if (t->dhead != NULL || t->shead != NULL) {
      uv_timer_start(t->flusher, on_flusher, 0, 0);
    }
  }
  if (--t->busy > 0)
    return;
  while (t->zombies != NULL) {
    rdma_peer *p = t->zombies;
    t->zombies = p->next;
    peer_free(p);
  }
  if (t->closed)
    free(t);
}

static void on_tick(uv_timer_t *h) {
  sx_rdma *t = h->data;
  sx__rdma_enter(t);
  sx__rdma_conns_tick(t, sx__mono_ms());
  sx__rdma_leave(t, 1);
}

void sx__rdma_tick_arm(sx_rdma *t) {
  if (t->tick_on || t->tick == NULL)
    return;
  t->tick_on = 1;
  uv_timer_start(t->tick, on_tick, SX__RDMA_TICK_MS, SX__RDMA_TICK_MS);
}

/* ------------------------------------------------------------------ open/close */

/* The port of the listen address (rdma_cm has its own port space, so the
 * TCP transport may use the same number); 0 when absent. */
static int listen_port(const char *listen, uint16_t *port) {
  char host[SX_ADDR_MAX + 1];
  *port = 0;
  if (listen == NULL || listen[0] == '\0')
    return 0;
  if (sx__hostport_split(listen, host, sizeof(host), port) != 0)
    return sx__err(SX_EINVAL, "listen address '%s' is not host:port", listen);
  return 0;
}

static int rdma_open(const sx_tctx *ctx, sx_transport **out) {
  const sx_agent_params *params = ctx->params;
  sx_rdma *t = calloc(1, sizeof(*t));
  int rc;
  if (t == NULL)
    return sx__err(SX_ENOMEM, "rdma: out of memory");
  t->base.ops = &sx__rdma_ops;
  t->base.ctx = ctx;
  t->listen_cm.kind = RDMA_CM_LISTENER;
  t->slice = SX__RDMA_DEFAULT_SLICE;
  t->conns_per_peer = SX__RDMA_DEFAULT_CONNS;
  if (params != NULL) {
    if (params->rdma_slice_bytes != 0)
      t->slice = params->rdma_slice_bytes < SX__RDMA_MIN_SLICE ? SX__RDMA_MIN_SLICE
                                                                : params->rdma_slice_bytes;
    if (params->conns_per_peer != 0)
      t->conns_per_peer = params->conns_per_peer > SX__RDMA_MAX_CONNS
                              ? SX__RDMA_MAX_CONNS
                              : params->conns_per_peer;
    rc = listen_port(params->listen, &t->port);
    if (rc)
      goto out_free;
  }
  /* The environment overrides the agent's parameter, so an operator can
   * force a tier without touching the engine's code. */
  const char *tier = getenv("SX_RDMA_GPU");
  if (tier != NULL && (rc = sx__rdma_gpu_tier_parse(tier, &t->gpu_tier)) != 0)
    goto out_free;
  if (tier == NULL && params != NULL) {
    if (params->rdma_gpu > SX_RDMA_GPU_OFF) {
      rc = sx__err(SX_EINVAL, "rdma_gpu %u is not an sx_rdma_gpu value", params->rdma_gpu);
      goto out_free;
    }
    t->gpu_tier = (sx__rdma_gpu_tier)params->rdma_gpu;
  }

  rc = sx__rdma_devs_open(t);
  if (rc)
    goto out_free;
  /* A slice must fit one RDMA message on every port used. */
  for (int i = 0; i < t->n_eps; i++)
    if (t->eps[i].max_msg_sz != 0 && t->slice > t->eps[i].max_msg_sz)
      t->slice = t->eps[i].max_msg_sz;

  t->tick = malloc(sizeof(*t->tick));
  t->flusher = malloc(sizeof(*t->flusher));
  if (t->tick == NULL || t->flusher == NULL) {
    free(t->tick);
    free(t->flusher);
    t->tick = t->flusher = NULL;
    rc = sx__err(SX_ENOMEM, "rdma: out of memory");
    goto out_devs;
  }
  uv_timer_init(ctx->loop, t->tick);
  uv_timer_init(ctx->loop, t->flusher);
  t->tick->data = t;
  t->flusher->data = t;

  rc = sx__rdma_cm_open(t);
  if (rc)
    goto out_timers;

  for (int i = 0; i < t->n_eps; i++) {
    char gid[INET6_ADDRSTRLEN];
    inet_ntop(AF_INET6, t->eps[i].gid, gid, sizeof(gid));
    sx__rdma_log(t, SX_LOG_INFO,
                 "serving on %s:%u via %s port %u (GID[%d] %s, MTU %u), slices of %u bytes, "
                 "%u QPs per peer",
                 t->eps[i].addr, t->port, t->eps[i].dev->name, t->eps[i].port_num,
                 t->eps[i].gid_index, gid, t->eps[i].mtu, t->slice, t->conns_per_peer);
  }
  *out = &t->base;
  return 0;

out_timers:
  uv_close((uv_handle_t *)t->tick, free_handle);
  uv_close((uv_handle_t *)t->flusher, free_handle);
out_devs:
  sx__rdma_devs_close(t);
out_free:
  free(t);
  return rc;
}

static void peer_shutdown(rdma_peer *p, int code, const char *msg);

static void rdma_close(sx_transport *tt) {
  sx_rdma *t = (sx_rdma *)tt;
  if (t == NULL || t->closed)
    return;
  sx__rdma_enter(t);
  while (t->peers != NULL) {
    rdma_peer *p = t->peers;
    peer_shutdown(p, SX_ESHUTDOWN, "the agent is shutting down");
  }
  sx__rdma_cm_close(t);
  if (t->tick != NULL) {
    uv_close((uv_handle_t *)t->tick, free_handle);
    t->tick = NULL;
  }
  if (t->flusher != NULL) {
    uv_close((uv_handle_t *)t->flusher, free_handle);
    t->flusher = NULL;
  }
  while (t->mrs != NULL) {
    sx__rdma_log(t, SX_LOG_WARN, "region %u still registered at close; deregistering it",
                 t->mrs->lreg->r.id);
    sx__rdma_dereg_mem(tt, t->mrs->lreg);
  }
  sx__rdma_devs_close(t);
  t->closed = 1;
  sx__rdma_leave(t, 1); /* delivers cancelled ops, then frees t */
}

/* ------------------------------------------------------------------ peers */

int sx__rdma_peer_new(sx_rdma *t, const sx_desc *remote, uint32_t idx, uint32_t ordinal,
                      rdma_ep *lep, rdma_peer *pair_of, rdma_peer **out) {
  const sx_endpoint *e = &remote->endpoints[idx];
  struct addrinfo hints, *ai = NULL;
  char port[8];
  memset(&hints, 0, sizeof(hints));
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  hints.ai_family = AF_UNSPEC;
  snprintf(port, sizeof(port), "%u", e->port);
  /* Numeric only: a name lookup would block the loop. */
  int g = getaddrinfo(e->addr, port, &hints, &ai);
  if (g != 0 || ai == NULL || ai->ai_addrlen > sizeof(struct sockaddr_storage)) {
    if (ai != NULL)
      freeaddrinfo(ai);
    return sx__err(SX_EUNREACH, "segment '%s': RDMA endpoint address '%s' (%s) is not a "
                   "numeric IP", remote->name, e->addr, e->device);
  }

  rdma_peer *p = calloc(1, sizeof(*p));
  if (p == NULL)
    goto out_free_ai;
  p->conns = calloc(t->conns_per_peer, sizeof(*p->conns));
  if (p->conns == NULL)
    goto out_free_peer;
  memcpy(&p->dst, ai->ai_addr, ai->ai_addrlen);
  freeaddrinfo(ai);
  p->base.t = &t->base;
  p->t = t;
  snprintf(p->name, sizeof(p->name), "%s", remote->name);
  memcpy(p->incarnation, remote->incarnation, SX_INCARNATION_LEN);
  memcpy(p->token, remote->token, SX_TOKEN_LEN);
  p->rkey_index = ordinal;
  p->lep = lep;
  p->desc = remote;
  for (uint32_t i = 0; i < remote->n_endpoints && p->n_reps < SX_MAX_DEVICES; i++)
    if (remote->endpoints[i].kind == SX_TRANSPORT_RDMA)
      p->rep[p->n_reps++] = i;
  char sa[96];
  /* Both NICs, so that a failure names the pair it hit. */
  snprintf(p->where, sizeof(p->where), "%s (%s, from %s)",
           sx__rdma_sockaddr_str((struct sockaddr *)&p->dst, sa, sizeof(sa)), e->device,
           lep->dev->name);
  p->n_conns = t->conns_per_peer;
  for (uint32_t i = 0; i < p->n_conns; i++) {
    p->conns[i].cm.kind = RDMA_CM_READER;
    p->conns[i].p = p;
    p->conns[i].index = i;
  }
  p->next = t->peers;
  if (t->peers != NULL)
    t->peers->prev = p;
  t->peers = p;
  if (pair_of != NULL) {
    p->pair_of = pair_of;
    p->write = pair_of->write;
    p->pnext = pair_of->pairs;
    pair_of->pairs = p;
    t->stats.pairs++;
  }
  sx__rdma_log(t, SX_LOG_DEBUG, "%s '%.64s' at %s from %s port %u, %u QPs",
               pair_of != NULL ? "NIC pair of" : "peer", p->name, p->where, lep->dev->name,
               lep->port_num, p->n_conns);
  *out = p;
  return 0;

out_free_peer:
  free(p);
out_free_ai:
  freeaddrinfo(ai);
  return sx__err(SX_ENOMEM, "rdma: out of memory");
}

static int rdma_peer_open(sx_transport *tt, const sx_desc *remote, sx_tpeer **out) {
  sx_rdma *t = (sx_rdma *)tt;
  uint32_t rkey_index = 0;
  rdma_ep *lep = NULL;
  rdma_peer *p;
  if (t->closed)
    return sx__err(SX_ESHUTDOWN, "rdma transport is closed");
  int idx = sx__rdma_pick(t, remote, &rkey_index, &lep);
  if (idx < 0)
    return sx__err(SX_EUNREACH, "segment '%s' publishes no RDMA endpoint", remote->name);
  int rc = sx__rdma_peer_new(t, remote, (uint32_t)idx, rkey_index, lep, NULL, &p);
  if (rc == 0)
    *out = &p->base;
  return rc;
}

/* Push mode: a peer whose QPs present this agent as a producer and carry
 * RDMA WRITEs (rdma_write.c). */
int sx__rdma_wpeer_open(sx_transport *tt, const sx_desc *remote, sx_tpeer **out) {
  const sx_tctx *ctx = tt->ctx;
  if (ctx->name == NULL || ctx->name[0] == '\0')
    return sx__err(SX_EINVAL, "rdma: a producer must be a named agent");
  int rc = rdma_peer_open(tt, remote, out);
  if (rc == 0)
    ((rdma_peer *)*out)->write = 1;
  return rc;
}

/* Wait (bounded) for the flush of a conn that is being torn down, then
 * destroy it.  Flushes are local to this host, so this is quick. */
static void conn_close_sync(rdma_conn *c, int code, const char *msg) {
  switch (c->state) {
  case RC_IDLE:
    return;
  case RC_ADDR:
  case RC_ROUTE:
  case RC_CONNECT:
    sx__rdma_conn_destroy(c);
    return;
  case RC_UP:
    sx__rdma_conn_teardown(c, code, 0, "%s", msg);
    break;
  case RC_DRAIN:
    break;
  }
  uint64_t deadline = sx__mono_ms() + SX__RDMA_DRAIN_MS;
  while (!c->drained && sx__mono_ms() < deadline) {
    sx__rdma_conn_poll(c);
    if (!c->drained)
      usleep(100);
  }
  if (!c->drained)
    sx__rdma_log(c->p->t, SX_LOG_WARN,
                 "QP %u to '%s' did not flush within %u ms; destroying it anyway", c->index,
                 c->p->name, SX__RDMA_DRAIN_MS);
  sx__rdma_conn_finish(c);
}

static void peer_shutdown(rdma_peer *p, int code, const char *msg) {
  sx_rdma *t = p->t;
  p->closing = 1;
  if (p->stage != NULL) /* its stage peer goes with it */
    peer_shutdown(p->stage, code, msg);
  if (p->stage_of != NULL)
    p->stage_of->stage = NULL;
  while (p->pairs != NULL) /* and its NIC pairs (they unlink themselves) */
    peer_shutdown(p->pairs, code, msg);
  if (p->pair_of != NULL) {
    rdma_peer **pp = &p->pair_of->pairs;
    while (*pp != NULL && *pp != p)
      pp = &(*pp)->pnext;
    if (*pp == p)
      *pp = p->pnext;
    p->pair_of = NULL;
  }
  for (uint32_t i = 0; i < p->n_conns; i++)
    conn_close_sync(&p->conns[i], code, msg);
  sx__rdma_s_peer_shutdown(p);
  sx__rdma_peer_cancel_all(p, code, msg);
  sx__rdma_w_fail_queue(p, code, msg);
  if (p->prev != NULL)
    p->prev->next = p->next;
  else
    t->peers = p->next;
  if (p->next != NULL)
    p->next->prev = p->prev;
  p->prev = NULL;
  p->next = t->zombies;
  t->zombies = p;
}

static void rdma_peer_close(sx_tpeer *tp) {
  if (tp == NULL)
    return;
  rdma_peer *p = (rdma_peer *)tp;
  sx_rdma *t = p->t;
  sx__rdma_enter(t);
  if (!p->closing)
    peer_shutdown(p, SX_ECANCELED, "the segment was closed");
  sx__rdma_leave(t, 1);
}

void sx__rdma_count(sx_rdma *t, const rdma_dev *d, uint64_t wrs, uint64_t bytes) {
  const sx_tctx *ctx = t->base.ctx;
  t->stats.dev_wrs[d->index] += wrs;
  t->stats.dev_bytes[d->index] += bytes;
  if (ctx != NULL && ctx->nic_posted != NULL)
    ctx->nic_posted(ctx->agent, d->index, d->name, wrs, bytes);
}

void sx__rdma_stats_get(const sx_transport *tt, sx__rdma_stats *out) {
  memset(out, 0, sizeof(*out));
  if (tt != NULL && tt->ops == &sx__rdma_ops)
    *out = ((const sx_rdma *)tt)->stats;
}

const sx_transport_ops sx__rdma_ops = {
    .name = "rdma",
    .kind = SX_TRANSPORT_RDMA,
    .open = rdma_open,
    .close = rdma_close,
    .reg_mem = sx__rdma_reg_mem,
    .dereg_mem = sx__rdma_dereg_mem,
    .pack = sx__rdma_pack,
    .usable = sx__rdma_usable,
    .peer_open = rdma_peer_open,
    .peer_close = rdma_peer_close,
    .post = sx__rdma_post,
    .abort = sx__rdma_abort,
    .wpeer_open = sx__rdma_wpeer_open,
    .notify = sx__rdma_notify,
    .grants_changed = sx__rdma_grants_changed,
};
