/*
 * RDMA connections through librdmacm, in asynchronous mode: one event
 * channel per transport, polled by the agent's loop.
 *
 * Target side: a listener accepts readers that present the incarnation this
 * agent has and its access token (constant-time compare), and rejects others
 * with a reason code in the reject private data.  Accepted QPs only respond
 * to RDMA READs.
 *
 * Reader side: each peer has conns_per_peer RC QPs, connected lazily:
 * address resolution, route resolution, connect; the path MTU and the READ
 * depth are whatever the CM settles.  A conn that fails is torn down (QP to
 * error, flush drained) and reconnected by the next post.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rdma_int.h"

static void free_handle(uv_handle_t *h) { free(h); }

static const char *event_name(int ev) {
  return ev < 0 ? "none" : rdma_event_str((enum rdma_cm_event_type)ev);
}

/* What a handler needs of an event; the event itself is acked at once, so
 * that destroying its cm_id in the handler cannot deadlock. */
typedef struct cm_ev {
  enum rdma_cm_event_type type;
  int status;
  struct rdma_cm_id *id;
  struct rdma_cm_id *listen_id;
  uint8_t initiator_depth, responder_resources;
  uint8_t pdata[256];
  size_t plen;
} cm_ev;

/* ------------------------------------------------------------------ target side */

void sx__rdma_tconn_link(rdma_tconn *tc) {
  sx_rdma *t = tc->t;
  tc->prev = NULL;
  tc->next = t->tconns;
  if (t->tconns != NULL)
    t->tconns->prev = tc;
  t->tconns = tc;
}

void sx__rdma_tconn_unlink(rdma_tconn *tc) {
  sx_rdma *t = tc->t;
  if (tc->prev != NULL)
    tc->prev->next = tc->next;
  else
    t->tconns = tc->next;
  if (tc->next != NULL)
    tc->next->prev = tc->prev;
}

static void tconn_destroy(rdma_tconn *tc) {
  if (tc->ss != NULL)
    sx__rdma_sserve_gone(tc); /* copies into its ring end first */
  if (tc->write)
    sx__rdma_wserve_gone(tc); /* its QP goes first, after what completed on it */
  if (tc->established)
    rdma_disconnect(tc->id); /* may already be disconnected: nothing to do then */
  if (tc->id->qp != NULL)
    rdma_destroy_qp(tc->id);
  rdma_destroy_id(tc->id);
  sx__rdma_tconn_unlink(tc);
  free(tc);
}

void sx__rdma_reject(sx_rdma *t, struct rdma_cm_id *id, uint8_t reason, const char *reader) {
  sx__rdma_reject_wire w;
  char from[96];
  sx__rdma_reject_pack(&w, reason);
  t->stats.rejects++;
  if (rdma_reject(id, &w, sizeof(w)) != 0)
    sx__rdma_log(t, SX_LOG_WARN, "rdma_reject: %s", strerror(errno));
  sx__rdma_log(t, SX_LOG_INFO, "rejected '%s' from %s: %s", reader,
               sx__rdma_sockaddr_str(rdma_get_peer_addr(id), from, sizeof(from)),
               sx__rdma_reject_text(reason));
  rdma_destroy_id(id);
}

int sx__rdma_accept(sx_rdma *t, struct rdma_cm_id *id, unsigned reads, unsigned depth) {
  const sx_tctx *ctx = t->base.ctx;
  sx__rdma_accept_wire aw;
  sx__rdma_accept_pack(&aw, ctx->incarnation);
  struct rdma_conn_param cp;
  memset(&cp, 0, sizeof(cp));
  cp.responder_resources = (uint8_t)(reads > 255 ? 255 : reads);
  cp.initiator_depth = (uint8_t)(depth > 255 ? 255 : depth);
  cp.rnr_retry_count = 7;
  cp.private_data = &aw;
  cp.private_data_len = sizeof(aw);
  return rdma_accept(id, &cp);
}

static void on_connect_request(sx_rdma *t, const cm_ev *e) {
  const sx_tctx *ctx = t->base.ctx;
  struct rdma_cm_id *id = e->id;
  sx__rdma_hello h;
  int rc;
  memset(&h, 0, sizeof(h));
  rc = sx__rdma_hello_parse(e->pdata, e->plen, &h);
  if (rc) {
    sx__rdma_reject(t, id, rc == SX_EVERSION ? SX__RDMA_REJ_VERSION : SX__RDMA_REJ_PROTO, "?");
    return;
  }
  /* Incarnation first: a reader holding an old descriptor also holds the
   * old token, and "stale" tells it to re-open, which is what it needs. */
  if (ctx->incarnation == NULL ||
      memcmp(h.incarnation, ctx->incarnation, SX_INCARNATION_LEN) != 0) {
    sx__rdma_reject(t, id, SX__RDMA_REJ_STALE, h.name);
    return;
  }
  if (h.flags & SX__RDMA_HELLO_WRITE) {
    /* A producer: its own checks, its own PD.  A producer's stage QP READs
     * the producer's ring slots from here: as many at once as the producer
     * serves (its responder resources arrive as initiator_depth). */
    sx__rdma_wserve_request(t, id, &h, e->initiator_depth);
    return;
  }
  if (ctx->token == NULL || sx__ct_memcmp(h.token, ctx->token, SX_TOKEN_LEN) != 0) {
    sx__rdma_reject(t, id, SX__RDMA_REJ_ACCESS, h.name);
    return;
  }
  rdma_dev *dev = sx__rdma_dev_by_verbs(t, id->verbs);
  if (dev == NULL) {
    sx__rdma_reject(t, id, SX__RDMA_REJ_NODEV, h.name);
    return;
  }
  /* Serve as many READs at once as the reader may issue and this device
   * allows; the CM hands the smaller figure back to the reader.  The IB CM
   * reports a request from the listener's side: the reader's initiator
   * depth arrives as responder_resources. */
  unsigned rd = e->responder_resources;
  if (rd > (unsigned)dev->attr.max_qp_rd_atom)
    rd = (unsigned)dev->attr.max_qp_rd_atom;
  if (rd == 0)
    rd = 1;
  if (h.flags & SX__RDMA_HELLO_STAGE) {
    sx__rdma_sserve_request(t, id, dev, &h, rd); /* a ring of its own */
    return;
  }
  rdma_tconn *tc = calloc(1, sizeof(*tc));
  if (tc == NULL) {
    sx__rdma_reject(t, id, SX__RDMA_REJ_NOMEM, h.name);
    return;
  }
  tc->cm.kind = RDMA_CM_TARGET;
  tc->t = t;
  tc->id = id;
  tc->dev = dev;
  tc->conn_index = h.conn_index;
  snprintf(tc->reader, sizeof(tc->reader), "%s", h.name);
  id->context = tc;

  if (dev->idle_cq == NULL) {
    dev->idle_cq = ibv_create_cq(dev->verbs, 4, NULL, NULL, 0);
    if (dev->idle_cq == NULL) {
      sx__rdma_log(t, SX_LOG_ERROR, "ibv_create_cq(%s): %s", dev->name, strerror(errno));
      goto out_reject;
    }
  }
  struct ibv_qp_init_attr qa;
  memset(&qa, 0, sizeof(qa));
  qa.send_cq = dev->idle_cq;
  qa.recv_cq = dev->idle_cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = 1;
  qa.cap.max_recv_wr = 1;
  qa.cap.max_send_sge = 1;
  qa.cap.max_recv_sge = 1;
  if (rdma_create_qp(id, dev->pd, &qa) != 0) {
    sx__rdma_log(t, SX_LOG_ERROR, "rdma_create_qp(%s) for reader '%s': %s", dev->name, h.name,
                 strerror(errno));
    goto out_reject;
  }

  if (sx__rdma_accept(t, id, rd, 0) != 0) {
    sx__rdma_log(t, SX_LOG_ERROR, "rdma_accept for reader '%s': %s", h.name, strerror(errno));
    rdma_destroy_qp(id);
    goto out_reject;
  }
  sx__rdma_tconn_link(tc);
  return;

out_reject:
  id->context = &t->listen_cm;
  free(tc);
  sx__rdma_reject(t, id, SX__RDMA_REJ_NOMEM, h.name);
}

static void target_event(rdma_tconn *tc, const cm_ev *e) {
  sx_rdma *t = tc->t;
  switch (e->type) {
  case RDMA_CM_EVENT_ESTABLISHED:
    tc->established = 1;
    sx__rdma_log(t, SX_LOG_DEBUG, "reader '%s' connected (its QP %u, our QP %u on %s)",
                 tc->reader, tc->conn_index, tc->id->qp ? tc->id->qp->qp_num : 0,
                 tc->dev->name);
    if (tc->write)
      sx__rdma_wserve_established(tc);
    break;
  case RDMA_CM_EVENT_DISCONNECTED:
  case RDMA_CM_EVENT_CONNECT_ERROR:
  case RDMA_CM_EVENT_UNREACHABLE:
  case RDMA_CM_EVENT_REJECTED:
  case RDMA_CM_EVENT_DEVICE_REMOVAL:
    sx__rdma_log(t, SX_LOG_DEBUG, "reader '%s' (its QP %u): %s", tc->reader, tc->conn_index,
                 rdma_event_str(e->type));
    tconn_destroy(tc);
    break;
  default:
    break;
  }
}

/* ------------------------------------------------------------------ reader side */

static int conn_any_live(const rdma_peer *p) {
  for (uint32_t i = 0; i < p->n_conns; i++)
    if (sx__rdma_conn_live(&p->conns[i]))
      return 1;
  return 0;
}

void sx__rdma_conn_destroy(rdma_conn *c) {
  sx__rdma_w_conn_down(c);
  if (c->p->stage_of != NULL)
    sx__rdma_s_conn_down(c);
  if (c->id != NULL && c->id->qp != NULL)
    rdma_destroy_qp(c->id);
  c->qp = NULL;
  if (c->cq != NULL) {
    if (ibv_destroy_cq(c->cq) != 0)
      sx__rdma_log(c->p->t, SX_LOG_WARN, "ibv_destroy_cq: %s", strerror(errno));
    c->cq = NULL;
  }
  if (c->id != NULL) {
    rdma_destroy_id(c->id);
    c->id = NULL;
  }
  c->state = RC_IDLE;
  c->deadline_ms = 0;
  c->head = c->tail = c->used = 0;
  c->inflight_bytes = 0;
  c->drain_posted = c->drained = c->reap = 0;
}

void sx__rdma_conn_failed(rdma_conn *c, int code, const char *msg) {
  rdma_peer *p = c->p;
  /* The QPs of a peer usually fail together, for the same reason: say it
   * once. */
  uint64_t now = sx__mono_ms();
  int again = code == p->last_fail && now - p->last_fail_ms < 1000;
  p->last_fail = code;
  p->last_fail_ms = now;
  sx__rdma_log(p->t, again ? SX_LOG_DEBUG : SX_LOG_WARN, "%s", msg);
  sx__rdma_conn_destroy(c);
  /* Other QPs may still carry the work; if none can, the queued ops fail
   * with this error rather than wait for a connection that will not come. */
  if (!conn_any_live(p))
    sx__rdma_peer_fail_queue(p, code, msg);
}

int sx__rdma_conn_start(rdma_conn *c) {
  rdma_peer *p = c->p;
  sx_rdma *t = p->t;
  struct sockaddr_in src4;
  struct sockaddr *src = NULL;
  if (c->state != RC_IDLE)
    return 0;
  if (rdma_create_id(t->ch, &c->id, c, RDMA_PS_TCP) != 0) {
    c->id = NULL;
    return sx__err(SX_ERDMA, "rdma_create_id: %s", strerror(errno));
  }
  /* Bind to the chosen local port's address so rdma_cm uses that device. */
  if (p->lep->has_ipv4 && p->dst.ss_family == AF_INET) {
    memset(&src4, 0, sizeof(src4));
    src4.sin_family = AF_INET;
    src4.sin_addr = p->lep->ipv4;
    src = (struct sockaddr *)&src4;
  }
  if (rdma_resolve_addr(c->id, src, (struct sockaddr *)&p->dst, SX__RDMA_RESOLVE_MS) != 0) {
    int e = errno;
    rdma_destroy_id(c->id);
    c->id = NULL;
    return sx__err(SX_EUNREACH, "rdma_resolve_addr(%s) for '%s': %s", p->where, p->name,
                   strerror(e));
  }
  c->state = RC_ADDR;
  c->last_event = -1;
  c->deadline_ms = sx__mono_ms() + SX__RDMA_CONNECT_MS;
  sx__rdma_tick_arm(t);
  return 0;
}

/* CQ, QP and send-queue scratch for an established route. */
static int conn_create_qp(rdma_conn *c) {
  rdma_dev *d = c->dev;
  uint32_t cap = SX__RDMA_SQ_DEPTH;
  int rc;
  if (d->attr.max_qp_wr > 1 && (uint32_t)d->attr.max_qp_wr - 1 < cap)
    cap = (uint32_t)d->attr.max_qp_wr - 1;
  if (d->attr.max_cqe > 2 && (uint32_t)d->attr.max_cqe - 2 < cap)
    cap = (uint32_t)d->attr.max_cqe - 2;
  if (c->cap != cap) {
    free(c->ring);
    free(c->wrs);
    free(c->sges);
    c->ring = calloc(cap, sizeof(*c->ring));
    c->wrs = calloc(cap, sizeof(*c->wrs));
    c->sges = calloc(cap, sizeof(*c->sges));
    c->cap = cap;
    if (c->ring == NULL || c->wrs == NULL || c->sges == NULL) {
      c->cap = 0;
      return sx__err(SX_ENOMEM, "rdma: out of memory");
    }
  }
  c->sig_every = cap / 4 > 0 ? cap / 4 : 1;
  c->head = c->tail = c->used = 0;
  c->inflight_bytes = 0;
  c->drain_posted = c->drained = c->reap = 0;
  c->reason = 0;
  c->requeue = 0;
  c->msg[0] = '\0';

  /* Every posted WR may complete with an error (a CQE even if unsignalled),
   * plus the drain WR: cap + 2 entries never overflow. */
  uint32_t cqe = cap + 2 + (c->p->write ? 2 * SX__RDMA_WCREDITS : 0);
  if (c->p->stage_of != NULL)
    cqe = SX__RDMA_STAGE_SQ + SX__RDMA_STAGE_SLOTS + 2;
  c->cq = ibv_create_cq(d->verbs, (int)cqe, c, d->chan, 0);
  if (c->cq == NULL)
    return sx__err(SX_ERDMA, "ibv_create_cq(%s, %u): %s", d->name, cqe, strerror(errno));
  if (ibv_req_notify_cq(c->cq, 0) != 0) {
    rc = sx__err(SX_ERDMA, "ibv_req_notify_cq(%s): %s", d->name, strerror(errno));
    goto out_destroy_cq;
  }
  struct ibv_qp_init_attr qa;
  memset(&qa, 0, sizeof(qa));
  qa.qp_context = c;
  qa.send_cq = c->cq;
  qa.recv_cq = c->cq;
  qa.qp_type = IBV_QPT_RC;
  qa.sq_sig_all = 0; /* selective signalling */
  qa.cap.max_send_wr = cap + 1;
  qa.cap.max_recv_wr = 1;
  qa.cap.max_send_sge = 1;
  qa.cap.max_recv_sge = 1;
  if (c->p->write) { /* push: notice SENDs and the receives of their replies */
    qa.cap.max_send_wr += SX__RDMA_WCREDITS;
    qa.cap.max_recv_wr = SX__RDMA_WCREDITS;
  }
  if (c->p->stage_of != NULL) { /* staging: requests, READs of slots, replies */
    qa.cap.max_send_wr = SX__RDMA_STAGE_SQ;
    qa.cap.max_recv_wr = SX__RDMA_STAGE_SLOTS;
  }
  if (rdma_create_qp(c->id, d->pd, &qa) != 0) {
    rc = sx__err(SX_ERDMA, "rdma_create_qp(%s, %u WRs): %s", d->name, cap + 1, strerror(errno));
    goto out_destroy_cq;
  }
  c->qp = c->id->qp;
  if ((c->p->write && (rc = sx__rdma_w_qp_ready(c)) != 0) ||
      (c->p->stage_of != NULL && (rc = sx__rdma_s_qp_ready(c)) != 0)) {
    rdma_destroy_qp(c->id);
    c->qp = NULL;
    goto out_destroy_cq;
  }
  return 0;

out_destroy_cq:
  ibv_destroy_cq(c->cq);
  c->cq = NULL;
  return rc;
}

static void conn_fail_msg(rdma_conn *c, int code, const char *fmt, ...) SX__PRINTF(3, 4);
static void conn_fail_msg(rdma_conn *c, int code, const char *fmt, ...) {
  char msg[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  sx__rdma_conn_failed(c, code, msg);
}

static void on_route_resolved(rdma_conn *c) {
  rdma_peer *p = c->p;
  sx_rdma *t = p->t;
  const sx_tctx *ctx = t->base.ctx;
  int rc = conn_create_qp(c);
  if (rc) {
    sx__rdma_conn_failed(c, rc, sx_errmsg());
    return;
  }
  sx__rdma_hello_wire hw;
  /* A producer's stage QP (staged writes) is a producer's QP too. */
  int producer = p->write || (p->stage_of != NULL && p->stage_of->write);
  if (producer) /* who we are, for the target to check in the store */
    sx__rdma_whello_pack(&hw, c->index, p->incarnation, ctx->incarnation, ctx->token);
  else
    sx__rdma_hello_pack(&hw, ctx->name, c->index, p->incarnation, p->token);
  if (p->stage_of != NULL)
    hw.flags |= SX__RDMA_HELLO_STAGE; /* a stage QP: the target gives it a ring */
  struct rdma_conn_param cp;
  memset(&cp, 0, sizeof(cp));
  unsigned depth = (unsigned)c->dev->attr.max_qp_init_rd_atom;
  cp.initiator_depth = (uint8_t)(depth > 255 ? 255 : depth);
  /* Nobody reads from a reader's QP; the consumer READs the slots of a
   * producer's stage QP, one READ per slot at most. */
  unsigned serve = producer && p->stage_of != NULL ? SX__RDMA_STAGE_SLOTS : 0;
  if (serve > (unsigned)c->dev->attr.max_qp_rd_atom)
    serve = (unsigned)c->dev->attr.max_qp_rd_atom;
  cp.responder_resources = (uint8_t)serve;
  cp.retry_count = 7;
  cp.rnr_retry_count = 7;
  cp.private_data = &hw;
  cp.private_data_len = sizeof(hw);
  if (rdma_connect(c->id, &cp) != 0) {
    conn_fail_msg(c, SX_EUNREACH, "rdma_connect to '%.64s' at %s (QP %u): %s", p->name, p->where,
                  c->index, strerror(errno));
    return;
  }
  c->state = RC_CONNECT;
}

static void on_established(rdma_conn *c, const cm_ev *e) {
  rdma_peer *p = c->p;
  uint8_t inc[SX_INCARNATION_LEN];
  if (sx__rdma_accept_parse(e->pdata, e->plen, inc) &&
      memcmp(inc, p->incarnation, SX_INCARNATION_LEN) != 0) {
    conn_fail_msg(c, SX_ESTALE,
                  "'%.64s' at %s accepted as another incarnation: the segment's owner restarted",
                  p->name, p->where);
    return;
  }
  struct ibv_qp_attr qa;
  struct ibv_qp_init_attr qia;
  memset(&qa, 0, sizeof(qa));
  if (ibv_query_qp(c->qp, &qa, IBV_QP_PATH_MTU | IBV_QP_MAX_QP_RD_ATOMIC, &qia) == 0) {
    c->path_mtu = (qa.path_mtu >= IBV_MTU_256 && qa.path_mtu <= IBV_MTU_4096)
                      ? 128u << qa.path_mtu
                      : 0;
    c->rd_atomic = qa.max_rd_atomic;
  }
  c->state = RC_UP;
  c->deadline_ms = 0;
  p->t->stats.connects++;
  p->t->stats.dev_connects[c->dev->index]++;
  sx__rdma_log(p->t, SX_LOG_DEBUG,
               "QP %u to '%.64s' at %s is up: qp_num %u on %s, path MTU %u, %u READs in flight, "
               "%u WRs per send queue",
               c->index, p->name, p->where, c->qp->qp_num, c->dev->name, c->path_mtu,
               c->rd_atomic, c->cap);
  sx__rdma_pump(p);
}

static void on_rejected(rdma_conn *c, const cm_ev *e) {
  rdma_peer *p = c->p;
  uint8_t reason;
  if (sx__rdma_reject_parse(e->pdata, e->plen, &reason)) {
    conn_fail_msg(c, sx__rdma_reject_code(reason),
                  "connect to '%.64s' at %s: RDMA_CM_EVENT_REJECTED: %s", p->name, p->where,
                  sx__rdma_reject_text(reason));
    return;
  }
  conn_fail_msg(c, SX_EUNREACH, "connect to '%.64s' at %s: RDMA_CM_EVENT_REJECTED (status %d: %s)",
                p->name, p->where, e->status, sx__rdma_cm_reject_status_text(e->status));
}

static void reader_event(rdma_conn *c, const cm_ev *e) {
  rdma_peer *p = c->p;
  sx_rdma *t = p->t;
  int connecting = c->state >= RC_ADDR && c->state <= RC_CONNECT;
  c->last_event = (int)e->type;
  switch (e->type) {
  case RDMA_CM_EVENT_ADDR_RESOLVED:
    if (c->state != RC_ADDR)
      break;
    c->dev = sx__rdma_dev_by_verbs(t, c->id->verbs);
    if (c->dev == NULL) {
      conn_fail_msg(c, SX_ENODEV, "'%.64s' at %s is reached through device %s, which this agent "
                    "does not use (rdma_devices)", p->name, p->where,
                    c->id->verbs ? ibv_get_device_name(c->id->verbs->device) : "?");
      break;
    }
    if (rdma_resolve_route(c->id, SX__RDMA_RESOLVE_MS) != 0) {
      conn_fail_msg(c, SX_EUNREACH, "rdma_resolve_route(%s): %s", p->where, strerror(errno));
      break;
    }
    c->state = RC_ROUTE;
    break;
  case RDMA_CM_EVENT_ROUTE_RESOLVED:
    if (c->state == RC_ROUTE)
      on_route_resolved(c);
    break;
  case RDMA_CM_EVENT_ESTABLISHED:
    if (c->state == RC_CONNECT)
      on_established(c, e);
    break;
  case RDMA_CM_EVENT_REJECTED:
    if (connecting)
      on_rejected(c, e);
    break;
  case RDMA_CM_EVENT_ADDR_ERROR:
  case RDMA_CM_EVENT_ROUTE_ERROR:
  case RDMA_CM_EVENT_UNREACHABLE:
  case RDMA_CM_EVENT_CONNECT_ERROR:
    if (connecting) {
      int code = e->status == -ETIMEDOUT ? SX_ETIMEDOUT : SX_EUNREACH;
      conn_fail_msg(c, code, "connect to '%.64s' at %s (QP %u): %s (status %d%s%s)", p->name,
                    p->where, c->index, rdma_event_str(e->type), e->status,
                    e->status < 0 ? ": " : "", e->status < 0 ? strerror(-e->status) : "");
    } else if (c->state == RC_UP) {
      sx__rdma_conn_teardown(c, SX_EDISCONN, 0, "'%.64s' at %s: %s", p->name, p->where,
                             rdma_event_str(e->type));
    }
    break;
  case RDMA_CM_EVENT_DISCONNECTED:
    if (connecting)
      conn_fail_msg(c, SX_EDISCONN, "'%.64s' at %s: RDMA_CM_EVENT_DISCONNECTED while connecting",
                    p->name, p->where);
    else if (c->state == RC_UP)
      sx__rdma_conn_teardown(c, SX_EDISCONN, 0,
                             "'%.64s' at %s disconnected (RDMA_CM_EVENT_DISCONNECTED)", p->name,
                             p->where);
    break;
  case RDMA_CM_EVENT_DEVICE_REMOVAL:
    if (connecting)
      conn_fail_msg(c, SX_ENODEV, "RDMA device removed (RDMA_CM_EVENT_DEVICE_REMOVAL)");
    else if (c->state == RC_UP)
      sx__rdma_conn_teardown(c, SX_ENODEV, 0,
                             "RDMA device removed (RDMA_CM_EVENT_DEVICE_REMOVAL)");
    break;
  default:
    break;
  }
}

void sx__rdma_conn_teardown(rdma_conn *c, int reason, int requeue, const char *fmt, ...) {
  rdma_peer *p = c->p;
  if (c->state == RC_IDLE || c->state == RC_DRAIN)
    return;
  if (c->state != RC_UP) {
    sx__rdma_conn_destroy(c); /* nothing was posted on it */
    return;
  }
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->msg, sizeof(c->msg), fmt, ap);
  va_end(ap);
  c->reason = reason;
  c->requeue = requeue;
  c->state = RC_DRAIN;
  c->drained = 0;
  p->t->stats.teardowns++;
  /* Closing a segment or the agent, and aborts, are routine. */
  int routine = requeue || reason == SX_ECANCELED || reason == SX_ESHUTDOWN;
  sx__rdma_log(p->t, routine ? SX_LOG_DEBUG : SX_LOG_WARN, "QP %u to '%.64s': tearing down: %s",
               c->index, p->name, c->msg);
  /* rdma_disconnect moves the QP to error and tells the target; the
   * explicit modify covers a QP the CM no longer considers connected. */
  rdma_disconnect(c->id);
  struct ibv_qp_attr qa;
  memset(&qa, 0, sizeof(qa));
  qa.qp_state = IBV_QPS_ERR;
  ibv_modify_qp(c->qp, &qa, IBV_QP_STATE);
  /* The drain WR is flushed after everything posted before it (the
   * kernel's ib_drain_sq does the same): its completion says that no READ
   * of this QP can touch memory any more. */
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = SX__RDMA_DRAIN_WR_ID;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  c->drain_posted = ibv_post_send(c->qp, &wr, &bad) == 0;
  if (!c->drain_posted && c->used == 0) {
    c->drained = 1;
    c->reap = 1;
  }
  c->deadline_ms = sx__mono_ms() + SX__RDMA_DRAIN_MS;
  sx__rdma_tick_arm(p->t);
}

void sx__rdma_conns_tick(sx_rdma *t, uint64_t now) {
  int pending = 0;
  for (rdma_peer *p = t->peers; p != NULL; p = p->next) {
    for (uint32_t i = 0; i < p->n_conns; i++) {
      rdma_conn *c = &p->conns[i];
      if (c->deadline_ms == 0)
        continue;
      if (now < c->deadline_ms) {
        pending = 1;
        continue;
      }
      if (c->state >= RC_ADDR && c->state <= RC_CONNECT) {
        conn_fail_msg(c, SX_ETIMEDOUT,
                      "connect to '%.64s' at %s (QP %u): no RDMA_CM_EVENT_ESTABLISHED within %u "
                      "ms (last event: %s)",
                      p->name, p->where, c->index, SX__RDMA_CONNECT_MS,
                      event_name(c->last_event));
      } else if (c->state == RC_DRAIN) {
        sx__rdma_log(t, SX_LOG_WARN,
                     "QP %u to '%s' did not flush within %u ms; destroying it anyway", c->index,
                     p->name, SX__RDMA_DRAIN_MS);
        sx__rdma_conn_finish(c);
      } else {
        c->deadline_ms = 0;
      }
    }
  }
  if (!pending && t->tick_on) {
    uv_timer_stop(t->tick);
    t->tick_on = 0;
  }
}

/* ------------------------------------------------------------------ event channel */

static void dispatch(sx_rdma *t, const cm_ev *e) {
  rdma_cmctx *cx = e->id != NULL ? e->id->context : NULL;
  if (e->type == RDMA_CM_EVENT_CONNECT_REQUEST) {
    on_connect_request(t, e);
    return;
  }
  if (cx == NULL || cx->kind == RDMA_CM_LISTENER) {
    sx__rdma_log(t, SX_LOG_WARN, "listener: %s (status %d)", rdma_event_str(e->type), e->status);
    return;
  }
  if (cx->kind == RDMA_CM_READER)
    reader_event((rdma_conn *)cx, e);
  else if (cx->kind == RDMA_CM_TARGET)
    target_event((rdma_tconn *)cx, e);
}

static void on_cm_event(uv_poll_t *h, int status, int events) {
  sx_rdma *t = h->data;
  (void)status;
  (void)events;
  sx__rdma_enter(t);
  for (;;) {
    struct rdma_cm_event *ev;
    if (rdma_get_cm_event(t->ch, &ev) != 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
        sx__rdma_log(t, SX_LOG_ERROR, "rdma_get_cm_event: %s", strerror(errno));
      break;
    }
    cm_ev e;
    memset(&e, 0, sizeof(e));
    e.type = ev->event;
    e.status = ev->status;
    e.id = ev->id;
    e.listen_id = ev->listen_id;
    if (ev->id != NULL && ev->id->ps == RDMA_PS_TCP) {
      e.initiator_depth = ev->param.conn.initiator_depth;
      e.responder_resources = ev->param.conn.responder_resources;
      if (ev->param.conn.private_data != NULL) {
        e.plen = ev->param.conn.private_data_len;
        if (e.plen > sizeof(e.pdata))
          e.plen = sizeof(e.pdata);
        memcpy(e.pdata, ev->param.conn.private_data, e.plen);
      }
    }
    rdma_ack_cm_event(ev);
    dispatch(t, &e);
  }
  sx__rdma_leave(t, 1);
}

int sx__rdma_cm_open(sx_rdma *t) {
  const sx_tctx *ctx = t->base.ctx;
  int rc, flags;
  t->ch = rdma_create_event_channel();
  if (t->ch == NULL)
    return sx__err(SX_ENODEV, "rdma_create_event_channel: %s (is rdma_ucm loaded?)",
                   strerror(errno));
  flags = fcntl(t->ch->fd, F_GETFL);
  if (flags < 0 || fcntl(t->ch->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    rc = sx__err(SX_EIO, "rdma_cm event channel: fcntl: %s", strerror(errno));
    goto out_destroy_channel;
  }
  t->ch_poll = malloc(sizeof(*t->ch_poll));
  if (t->ch_poll == NULL) {
    rc = sx__err(SX_ENOMEM, "rdma: out of memory");
    goto out_destroy_channel;
  }
  if (uv_poll_init(ctx->loop, t->ch_poll, t->ch->fd) != 0) {
    free(t->ch_poll);
    t->ch_poll = NULL;
    rc = sx__err(SX_EIO, "uv_poll_init on the rdma_cm event channel failed");
    goto out_destroy_channel;
  }
  t->ch_poll->data = t;

  if (rdma_create_id(t->ch, &t->listen_id, &t->listen_cm, RDMA_PS_TCP) != 0) {
    rc = sx__err(SX_ENODEV, "rdma_create_id: %s", strerror(errno));
    goto out_close_poll;
  }
  /* One listener for both families: endpoints publish IPv4 addresses, or
   * IPv6 ones for ports that have no IPv4 address.  Where IPv6 is off, the
   * IPv6 bind fails and IPv4 alone serves. */
  struct sockaddr_in6 sin6;
  struct sockaddr_in sin;
  int afonly = 0;
  memset(&sin6, 0, sizeof(sin6));
  sin6.sin6_family = AF_INET6;
  sin6.sin6_addr = in6addr_any;
  sin6.sin6_port = htons(t->port);
  if (rdma_set_option(t->listen_id, RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY, &afonly,
                      sizeof(afonly)) != 0 ||
      rdma_bind_addr(t->listen_id, (struct sockaddr *)&sin6) != 0) {
    memset(&sin, 0, sizeof(sin));
    sin.sin_family = AF_INET;
    sin.sin_addr.s_addr = htonl(INADDR_ANY);
    sin.sin_port = htons(t->port);
    if (rdma_bind_addr(t->listen_id, (struct sockaddr *)&sin) != 0) {
      rc = sx__err(SX_EIO, "rdma_bind_addr(port %u): %s", t->port, strerror(errno));
      goto out_destroy_id;
    }
  }
  if (rdma_listen(t->listen_id, SX__RDMA_BACKLOG) != 0) {
    rc = sx__err(SX_EIO, "rdma_listen(port %u): %s", t->port, strerror(errno));
    goto out_destroy_id;
  }
  t->port = ntohs(rdma_get_src_port(t->listen_id));
  sx__rdma_log(t, SX_LOG_DEBUG, "rdma_cm listens on %s port %u",
               rdma_get_local_addr(t->listen_id)->sa_family == AF_INET6 ? "[::] (IPv4 and IPv6)"
                                                                         : "0.0.0.0",
               t->port);
  uv_poll_start(t->ch_poll, UV_READABLE, on_cm_event);
  return 0;

out_destroy_id:
  rdma_destroy_id(t->listen_id);
  t->listen_id = NULL;
out_close_poll:
  uv_close((uv_handle_t *)t->ch_poll, free_handle);
  t->ch_poll = NULL;
out_destroy_channel:
  rdma_destroy_event_channel(t->ch);
  t->ch = NULL;
  return rc;
}

void sx__rdma_cm_close(sx_rdma *t) {
  while (t->tconns != NULL)
    tconn_destroy(t->tconns);
  if (t->listen_id != NULL) {
    rdma_destroy_id(t->listen_id);
    t->listen_id = NULL;
  }
  if (t->ch_poll != NULL) {
    uv_close((uv_handle_t *)t->ch_poll, free_handle);
    t->ch_poll = NULL;
  }
  if (t->ch != NULL) {
    rdma_destroy_event_channel(t->ch);
    t->ch = NULL;
  }
}
