/*
 * The RDMA transport, push mode, consumer side (docs/push.md).
 *
 * Writable regions get a second MR, with IBV_ACCESS_REMOTE_WRITE, in a
 * protection domain of their own (dev->wpd); the MRs readers' QPs use never
 * allow writes.  An rkey works only for QPs of its MR's PD, and only
 * producers this agent authorized get a QP in the write PD, so the write
 * keys published in the descriptor grant nothing by themselves.
 *
 * A producer connects with a write hello (rdma.c): the target incarnation,
 * its own incarnation and token.  The incarnation is checked at once; the
 * rest by the agent (agent/grant.c: the producer found by incarnation, its
 * descriptor in the store, the grants), asynchronously, with the connect
 * request held meanwhile.  Then the request is accepted with a QP in the
 * write PD, or rejected with the reason in the reject data.  Nothing of a
 * refused producer can land: it never has a QP that could name a key.
 *
 * Notices arrive as SENDs into a shared receive queue of 64 KiB buffers
 * per device; the sender is known from the completion's QP.  Each is handed
 * to the agent's notice check (the same code as TCP's) and answered with a
 * SEND carrying the status as immediate data.  RC completes a producer's
 * WRITE only once the target acknowledged it, and the producer sends the
 * notice only after the completions of every WRITE of the batch, on every
 * QP, so no notice precedes its bytes.
 *
 * Revocation (grants_changed) disconnects the QPs of producers no grant
 * covers any more and destroys them before it returns: once a QP is
 * destroyed the device takes nothing more for it.  A connection accepted
 * but not established yet (the producer's RTU not in) cannot be
 * disconnected then; it is once it is established (wdisconnect), so that
 * the producer never keeps a QP that faces none.
 */
#include <endian.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rdma_int.h"
#include "segxfer/push.h"

#define POLL_BATCH 32

static void free_handle(uv_handle_t *h) { free(h); }

int sx__rdma_wpd_get(rdma_dev *d) {
  if (d->wpd == NULL && (d->wpd = ibv_alloc_pd(d->verbs)) == NULL)
    return sx__err(SX_ENODEV, "ibv_alloc_pd(%s) for writable memory: %s", d->name,
                   strerror(errno));
  return 0;
}

int sx__rdma_wreg(sx_rdma *t, rdma_dev *d, sx_lregion *lr, struct ibv_mr **out) {
  (void)t;
  int rc = sx__rdma_wpd_get(d);
  if (rc)
    return rc;
  *out = ibv_reg_mr(d->wpd, (void *)(uintptr_t)lr->r.addr, (size_t)lr->r.length,
                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (*out == NULL)
    return sx__err(errno == ENOMEM || errno == EAGAIN ? SX_ENOMEM : SX_EIO,
                   "ibv_reg_mr(%s) of writable region %u (%llu bytes) for producers: %s",
                   d->name, lr->r.id, (unsigned long long)lr->r.length, strerror(errno));
  return 0;
}

/* ------------------------------------------------------------------ notices */

static uint8_t *rbuf(const rdma_dev *d, uint32_t i) {
  return d->rbufs + (size_t)i * SX_NOTICE_MAX_BYTES;
}

static int srq_post(rdma_dev *d, uint32_t i) {
  struct ibv_sge sge = {.addr = (uintptr_t)rbuf(d, i), .length = SX_NOTICE_MAX_BYTES,
                        .lkey = d->rmr->lkey};
  struct ibv_recv_wr wr = {.wr_id = i, .sg_list = &sge, .num_sge = 1}, *bad = NULL;
  return ibv_post_srq_recv(d->srq, &wr, &bad);
}

static rdma_tconn *by_qpn(sx_rdma *t, const rdma_dev *d, uint32_t qpn) {
  for (rdma_tconn *tc = t->tconns; tc != NULL; tc = tc->next)
    if (tc->write && tc->dev == d && tc->qpn != 0 && tc->qpn == qpn)
      return tc;
  return NULL;
}

/* Disconnect a producer's connection: the CM tells the producer (a DREQ),
 * and DISCONNECTED destroys it here.  Between our accept and the producer's
 * RTU the CM has nothing to send that on (rdma_disconnect fails, the
 * producer never hears of it); the producer's QP comes up anyway, and its
 * WRITEs would wait for acknowledgements that never come.  So a connection
 * not established yet is disconnected again once it is. */
static void wdisconnect(rdma_tconn *tc) {
  if (!tc->established)
    tc->unwanted = 1;
  rdma_disconnect(tc->id);
}

void sx__rdma_wserve_established(rdma_tconn *tc) {
  if (!tc->unwanted)
    return;
  sx__rdma_log(tc->t, SX_LOG_DEBUG, "producer %s (QP %u): established after we dropped it; "
               "disconnecting", tc->producer, tc->conn_index);
  rdma_disconnect(tc->id);
}

/* Drop a producer's QP that broke the protocol or failed. */
static void wdrop(rdma_tconn *tc, const char *why) {
  sx__rdma_log(tc->t, SX_LOG_WARN, "producer %s (QP %u): %s; disconnecting", tc->producer,
               tc->conn_index, why);
  wdisconnect(tc);
}

/* Answer a notice: its status as immediate data, no payload. */
static void reply(rdma_tconn *tc, int status) {
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = SX__RDMA_WR_NSEND;
  wr.opcode = IBV_WR_SEND_WITH_IMM;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.imm_data = htobe32((uint32_t)-status);
  if (tc->replies >= SX__RDMA_WCREDITS) {
    wdrop(tc, "more notices in flight than its credit");
    return;
  }
  if (ibv_post_send(tc->id->qp, &wr, &bad) != 0) {
    wdrop(tc, "cannot post the reply to a notice");
    return;
  }
  tc->replies++;
}

static void on_wc(sx_rdma *t, rdma_dev *d, const struct ibv_wc *wc) {
  const sx_tctx *ctx = t->base.ctx;
  rdma_tconn *tc = by_qpn(t, d, wc->qp_num);
  if (wc->wr_id == SX__RDMA_WR_NSEND) { /* a reply went out, or failed */
    if (tc != NULL) {
      tc->replies--;
      if (wc->status != IBV_WC_SUCCESS && wc->status != IBV_WC_WR_FLUSH_ERR)
        wdrop(tc, ibv_wc_status_str(wc->status));
    }
    return;
  }
  if (wc->wr_id >= SX__RDMA_WSRQ_DEPTH) {
    sx__rdma_log(t, SX_LOG_ERROR, "%s: producer completion for unknown wr_id %llu", d->name,
                 (unsigned long long)wc->wr_id);
    return;
  }
  uint32_t i = (uint32_t)wc->wr_id;
  if (wc->status == IBV_WC_SUCCESS && tc != NULL) {
    char msg[256] = "";
    int st = SX_EPROTO;
    if (wc->opcode == IBV_WC_RECV && !(wc->wc_flags & IBV_WC_WITH_IMM))
      st = ctx->notice(ctx->agent, tc->producer, tc->pinc, SX_TRANSPORT_RDMA, rbuf(d, i),
                       wc->byte_len, msg, sizeof(msg));
    reply(tc, st);
  } else if (wc->status != IBV_WC_SUCCESS && wc->status != IBV_WC_WR_FLUSH_ERR) {
    /* A notice longer than a buffer, for one: the producer's QP is in
     * error now, and so is ours. */
    if (tc != NULL)
      wdrop(tc, ibv_wc_status_str(wc->status));
  }
  /* Taken (notice() copies what it keeps) or dropped: the buffer goes
   * back.  Completions of a QP that is gone (tc NULL) are dropped. */
  if (srq_post(d, i) != 0)
    sx__rdma_log(t, SX_LOG_ERROR, "%s: cannot repost notice buffer %u: %s", d->name, i,
                 strerror(errno));
}

static void wcq_poll(sx_rdma *t, rdma_dev *d) {
  struct ibv_wc wc[POLL_BATCH];
  int n;
  while (d->wcq != NULL && (n = ibv_poll_cq(d->wcq, POLL_BATCH, wc)) > 0)
    for (int k = 0; k < n; k++)
      on_wc(t, d, &wc[k]);
}

/* sx__rdma_cq_round's poll for the device's one write CQ. */
static void poll_wcq(void *cq_ctx, void *arg) {
  rdma_dev *d = arg;
  (void)cq_ctx;
  wcq_poll(d->t, d);
}

static void on_wcq_event(uv_poll_t *h, int status, int events) {
  rdma_dev *d = h->data;
  sx_rdma *t = d->t;
  (void)status;
  (void)events;
  sx__rdma_enter(t);
  sx__rdma_cq_round(t, d->wchan, poll_wcq, d);
  sx__rdma_leave(t, 1);
}

/* ------------------------------------------------------------------ resources */

/* Most producers' QPs a device's CQ can serve: each may hold a full credit
 * of replies, and the shared receive queue completes into the same CQ. */
static uint32_t wmax_conns(const rdma_dev *d) {
  uint32_t cqe = (uint32_t)d->attr.max_cqe;
  uint32_t want = SX__RDMA_WSRQ_DEPTH + SX__RDMA_WMAX_CONNS * (SX__RDMA_WCREDITS + 1);
  if (cqe == 0 || cqe >= want)
    return SX__RDMA_WMAX_CONNS;
  return cqe > SX__RDMA_WSRQ_DEPTH ? (cqe - SX__RDMA_WSRQ_DEPTH) / (SX__RDMA_WCREDITS + 1) : 0;
}

static void wres_close(rdma_dev *d) {
  if (d->srq != NULL && ibv_destroy_srq(d->srq) != 0)
    sx__rdma_log(d->t, SX_LOG_WARN, "ibv_destroy_srq(%s): %s", d->name, strerror(errno));
  d->srq = NULL;
  if (d->wcq != NULL && ibv_destroy_cq(d->wcq) != 0)
    sx__rdma_log(d->t, SX_LOG_WARN, "ibv_destroy_cq(%s): %s", d->name, strerror(errno));
  d->wcq = NULL;
  if (d->rmr != NULL)
    ibv_dereg_mr(d->rmr);
  d->rmr = NULL;
  free(d->rbufs);
  d->rbufs = NULL;
}

/* The completion channel (kept), CQ, shared receive queue and notice
 * buffers of a device, for its first producer. */
static int wres_open(sx_rdma *t, rdma_dev *d) {
  int rc;
  if (d->wcq != NULL)
    return 0;
  if ((rc = sx__rdma_wpd_get(d)) != 0)
    return rc;
  if (d->wchan == NULL && (rc = sx__rdma_chan_open(t, d, &d->wchan, &d->wpoll, on_wcq_event)))
    return rc;
  int cqe = (int)(SX__RDMA_WSRQ_DEPTH + wmax_conns(d) * (SX__RDMA_WCREDITS + 1));
  d->wcq = ibv_create_cq(d->verbs, cqe, d, d->wchan, 0);
  if (d->wcq == NULL)
    return sx__err(SX_ERDMA, "ibv_create_cq(%s, %d) for producers: %s", d->name, cqe,
                   strerror(errno));
  if (ibv_req_notify_cq(d->wcq, 0) != 0) {
    rc = sx__err(SX_ERDMA, "ibv_req_notify_cq(%s): %s", d->name, strerror(errno));
    goto out_close;
  }
  struct ibv_srq_init_attr sa;
  memset(&sa, 0, sizeof(sa));
  sa.attr.max_wr = SX__RDMA_WSRQ_DEPTH;
  sa.attr.max_sge = 1;
  d->srq = ibv_create_srq(d->wpd, &sa);
  if (d->srq == NULL) {
    rc = sx__err(SX_ERDMA, "ibv_create_srq(%s, %u WRs): %s (the device must support shared "
                 "receive queues to take RDMA writes)", d->name, SX__RDMA_WSRQ_DEPTH,
                 strerror(errno));
    goto out_close;
  }
  size_t size = (size_t)SX__RDMA_WSRQ_DEPTH * SX_NOTICE_MAX_BYTES;
  d->rbufs = aligned_alloc(4096, size);
  if (d->rbufs == NULL) {
    rc = sx__err(SX_ENOMEM, "rdma: out of memory for notice buffers");
    goto out_close;
  }
  d->rmr = ibv_reg_mr(d->wpd, d->rbufs, size, IBV_ACCESS_LOCAL_WRITE);
  if (d->rmr == NULL) {
    rc = sx__err(SX_ENOMEM, "ibv_reg_mr(%s) of %zu bytes of notice buffers: %s", d->name, size,
                 strerror(errno));
    goto out_close;
  }
  for (uint32_t i = 0; i < SX__RDMA_WSRQ_DEPTH; i++) {
    if (srq_post(d, i) != 0) {
      rc = sx__err(SX_ERDMA, "ibv_post_srq_recv(%s): %s", d->name, strerror(errno));
      goto out_close;
    }
  }
  return 0;

out_close:
  wres_close(d);
  return rc;
}

void sx__rdma_wdev_free(rdma_dev *d) {
  wres_close(d);
  if (d->wpoll != NULL) {
    uv_close((uv_handle_t *)d->wpoll, free_handle);
    d->wpoll = NULL;
  }
  if (d->wchan != NULL) {
    ibv_destroy_comp_channel(d->wchan);
    d->wchan = NULL;
  }
  if (d->wpd != NULL && ibv_dealloc_pd(d->wpd) != 0)
    sx__rdma_log(d->t, SX_LOG_WARN, "ibv_dealloc_pd(%s) for writes: %s", d->name,
                 strerror(errno));
  d->wpd = NULL;
  if (d->nmr != NULL)
    ibv_dereg_mr(d->nmr);
  d->nmr = NULL;
  free(d->nbufs);
  d->nbufs = NULL;
}

/* ------------------------------------------------------------------ producers */

static uint8_t reject_reason(int rc) {
  switch (rc) {
  case SX_EACCESS: return SX__RDMA_REJ_WACCESS;
  case SX_ENOTSUP: return SX__RDMA_REJ_NOSTAGE;
  case SX_ESHUTDOWN: return SX__RDMA_REJ_SHUTDOWN;
  case SX_ENOMEM: case SX_ELIMIT: case SX_ERDMA: case SX_EIO: return SX__RDMA_REJ_NOMEM;
  default: return SX__RDMA_REJ_WSTORE;
  }
}

/* Say no to a producer whose request is still pending, and forget it. */
static void refuse(rdma_tconn *tc, int rc, const char *msg) {
  sx_rdma *t = tc->t;
  const sx_tctx *ctx = t->base.ctx;
  sx__rdma_log(t, SX_LOG_WARN, "refused the writes of %s: %s", tc->reader,
               msg != NULL && msg[0] ? msg : sx_strerror(rc));
  if (ctx->written != NULL)
    ctx->written(ctx->agent, SX_TRANSPORT_RDMA, 0, rc);
  sx__rdma_tconn_unlink(tc);
  tc->id->context = &t->listen_cm;
  sx__rdma_reject(t, tc->id, reject_reason(rc), tc->reader);
  free(tc);
}

/* An authorized producer: its QP in the write PD, then accept. */
static int accept_producer(rdma_tconn *tc) {
  sx_rdma *t = tc->t;
  rdma_dev *d = tc->dev;
  int rc;
  if (d->n_wconns >= wmax_conns(d))
    return sx__err(SX_ELIMIT, "%s serves %u producers' QPs already", d->name, d->n_wconns);
  if ((rc = wres_open(t, d)) != 0)
    return rc;
  struct ibv_qp_init_attr qa;
  memset(&qa, 0, sizeof(qa));
  qa.qp_context = tc;
  qa.send_cq = d->wcq;
  qa.recv_cq = d->wcq;
  qa.srq = d->srq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = SX__RDMA_WCREDITS + 1;
  qa.cap.max_send_sge = 1;
  if (rdma_create_qp(tc->id, d->wpd, &qa) != 0) {
    rc = sx__err(SX_ERDMA, "rdma_create_qp(%s) for producer %s: %s", d->name, tc->producer,
                 strerror(errno));
    if (d->n_wconns == 0)
      wres_close(d);
    return rc;
  }
  tc->qpn = tc->id->qp->qp_num;
  d->n_wconns++;
  if (sx__rdma_accept(t, tc->id, 0, 0) != 0) { /* a producer's QP cannot READ here */
    rc = sx__err(SX_ERDMA, "rdma_accept for producer %s: %s", tc->producer, strerror(errno));
    sx__rdma_wserve_gone(tc);
    return rc;
  }
  sx__rdma_log(t, SX_LOG_INFO, "producer %s may write (its QP %u, our QP %u on %s)",
               tc->producer, tc->conn_index, tc->qpn, d->name);
  return 0;
}

static void authed(void *arg, int status, const char *producer, const char *msg) {
  rdma_tconn *tc = arg;
  sx_rdma *t = tc->t;
  sx__rdma_enter(t);
  tc->auth = NULL;
  if (status == 0) {
    snprintf(tc->producer, sizeof(tc->producer), "%s", producer);
    /* A stage QP (staged writes of GPU memory) gets a ring, no write PD
     * QP on the shared CQ. */
    status = tc->stage ? sx__rdma_sserve_waccept(tc, tc->depth) : accept_producer(tc);
    msg = status ? sx_errmsg() : NULL;
  }
  if (status != 0)
    refuse(tc, status, msg);
  sx__rdma_leave(t, 1);
}

void sx__rdma_wserve_request(sx_rdma *t, struct rdma_cm_id *id, const sx__rdma_hello *h,
                             unsigned depth) {
  const sx_tctx *ctx = t->base.ctx;
  char hex[2 * SX_INCARNATION_LEN + 1], who[SX__RDMA_NAME_BYTES + 1];
  sx_hex(h->producer, SX_INCARNATION_LEN, hex);
  snprintf(who, sizeof(who), "producer %.7s", hex);
  rdma_dev *dev = sx__rdma_dev_by_verbs(t, id->verbs);
  if (dev == NULL) {
    sx__rdma_reject(t, id, SX__RDMA_REJ_NODEV, who);
    return;
  }
  rdma_tconn *tc = calloc(1, sizeof(*tc));
  if (tc == NULL) {
    sx__rdma_reject(t, id, SX__RDMA_REJ_NOMEM, who);
    return;
  }
  tc->cm.kind = RDMA_CM_TARGET;
  tc->t = t;
  tc->id = id;
  tc->dev = dev;
  tc->write = 1;
  tc->stage = (h->flags & SX__RDMA_HELLO_STAGE) != 0;
  tc->depth = depth;
  tc->conn_index = h->conn_index;
  memcpy(tc->pinc, h->producer, SX_INCARNATION_LEN);
  snprintf(tc->reader, sizeof(tc->reader), "%s", who);
  snprintf(tc->producer, sizeof(tc->producer), "%s", who);
  id->context = tc;
  sx__rdma_tconn_link(tc);
  /* Found by incarnation: its descriptor in the store holds its token. */
  int rc = ctx->write_auth == NULL ? sx__err(SX_EACCESS, "this agent takes no writes")
                                   : ctx->write_auth(ctx->agent, NULL, tc->pinc, h->token,
                                                     authed, tc, &tc->auth);
  if (rc != 0)
    refuse(tc, rc, sx_errmsg());
}

void sx__rdma_wserve_gone(rdma_tconn *tc) {
  sx_rdma *t = tc->t;
  rdma_dev *d = tc->dev;
  if (tc->auth != NULL) {
    t->base.ctx->write_auth_cancel(tc->auth);
    tc->auth = NULL;
  }
  if (tc->ss != NULL) { /* a stage QP: its own CQ; copies into the GPU end first */
    sx__rdma_sserve_gone(tc);
    return;
  }
  if (tc->id->qp == NULL)
    return;
  /* Completions still queued for this QP are dropped once it is unnamed
   * (its QP number may come back for another producer). */
  tc->qpn = 0;
  rdma_destroy_qp(tc->id);
  wcq_poll(t, d);
  if (--d->n_wconns == 0)
    wres_close(d);
}

int sx__rdma_grants_changed(sx_transport *tt) {
  sx_rdma *t = (sx_rdma *)tt;
  const sx_tctx *ctx = t->base.ctx;
  sx__rdma_enter(t);
  for (rdma_tconn *tc = t->tconns; tc != NULL; tc = tc->next) {
    if (!tc->write || tc->qpn == 0 ||
        ctx->write_granted(ctx->agent, tc->producer, tc->pinc) == 0)
      continue;
    sx__rdma_log(t, SX_LOG_INFO, "producer %s: write grant revoked; its QP %u goes",
                 tc->producer, tc->conn_index);
    /* The QP is destroyed before this returns: nothing of it lands after
     * the revoke.  The cm_id goes with the DISCONNECTED event. */
    wdisconnect(tc);
    sx__rdma_wserve_gone(tc);
  }
  sx__rdma_leave(t, 1);
  return 0;
}
