/*
 * The RDMA transport, push mode, producer side (docs/push.md): a write
 * peer's QPs carry RDMA WRITEs (rdma_post.c, as READs are carried) and the
 * batches' notices.
 *
 * A write op's notice is sent only once every xfer of it settled with 0,
 * that is once the completion of every one of its WRITEs arrived, on every
 * QP: RC completes a WRITE only after the target acknowledged it.  The
 * notice is a SEND of the encoded WriteNotice, from a registered slot of
 * the device's notice buffers, on any established QP that has credit.  The
 * consumer answers each with a SEND carrying the status as immediate data,
 * in order on that QP; each QP keeps SX__RDMA_WCREDITS receives posted for
 * them, and that many notices unanswered at most.
 *
 * A notice whose QP goes down before its answer fails (SX_EDISCONN): the
 * consumer may or may not have taken it, and it is never sent twice.  So
 * an abort does not tear down a QP that holds notices waiting for answers
 * (rdma_post.c); the aborted op's WRITEs on it settle as they complete.
 * Settled notices run op->noticed from sx__rdma_leave(), never from inside
 * a walk of the transport's structures.
 */
#include <endian.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rdma_int.h"
#include "segxfer/push.h"

/* ------------------------------------------------------------------ settling */

static void settle(rdma_wnotice *n, int status, const char *msg) {
  sx_rdma *t = n->p->t;
  if (n->in_settle || n->op == NULL)
    return;
  n->status = status;
  snprintf(n->msg, sizeof(n->msg), "%.255s", msg != NULL ? msg : "");
  n->in_settle = 1;
  n->snext = NULL;
  if (t->stail != NULL)
    t->stail->snext = n;
  else
    t->shead = n;
  t->stail = n;
}

void sx__rdma_w_deliver(sx_rdma *t) {
  rdma_wnotice *n;
  while ((n = t->shead) != NULL) {
    t->shead = n->snext;
    if (t->shead == NULL)
      t->stail = NULL;
    n->in_settle = 0;
    sx_op *op = n->op;
    int st = n->status;
    char msg[sizeof(n->msg)];
    snprintf(msg, sizeof(msg), "%s", n->msg);
    n->op = NULL;
    if (!n->in_list)
      free(n);
    op->noticed(op, st, msg[0] ? msg : NULL);
  }
}

/* ------------------------------------------------------------------ buffers */

static int nbufs_open(rdma_dev *d) {
  if (d->nmr != NULL)
    return 0;
  size_t size = (size_t)SX__RDMA_NOTICE_SLOTS * SX_NOTICE_MAX_BYTES;
  d->nbufs = aligned_alloc(4096, size);
  if (d->nbufs == NULL)
    return sx__err(SX_ENOMEM, "rdma: out of memory for notice buffers");
  d->nmr = ibv_reg_mr(d->pd, d->nbufs, size, 0);
  if (d->nmr == NULL) {
    free(d->nbufs);
    d->nbufs = NULL;
    return sx__err(SX_ENOMEM, "ibv_reg_mr(%s) of %zu bytes of notice buffers: %s", d->name,
                   size, strerror(errno));
  }
  return 0;
}

static int slot_get(rdma_dev *d, rdma_conn *c) {
  for (int i = 0; i < (int)SX__RDMA_NOTICE_SLOTS; i++) {
    if (d->nowner[i] == NULL) {
      d->nowner[i] = c;
      return i;
    }
  }
  return -1;
}

static int recv_post(rdma_conn *c) {
  struct ibv_recv_wr wr = {.wr_id = SX__RDMA_WR_RECV}, *bad = NULL;
  return ibv_post_recv(c->qp, &wr, &bad);
}

int sx__rdma_w_qp_ready(rdma_conn *c) {
  for (uint32_t i = 0; i < SX__RDMA_WCREDITS; i++)
    if (recv_post(c) != 0)
      return sx__err(SX_ERDMA, "ibv_post_recv on QP %u to '%.64s': %s", c->index, c->p->name,
                     strerror(errno));
  c->credits = SX__RDMA_WCREDITS;
  return 0;
}

/* ------------------------------------------------------------------ sending */

int sx__rdma_notify(sx_tpeer *tp, sx_op *op, const uint8_t *buf, size_t len) {
  rdma_peer *p = (rdma_peer *)tp;
  sx_rdma *t = p->t;
  if (p->closing || t->closed)
    return sx__err(SX_ECANCELED, "rdma: the peer '%s' is closed", p->name);
  /* A reader's QPs carry only its READs (the target's side posts no
   * receives): a read notice goes another way (agent/batch.c). */
  if (!p->write)
    return SX_ENOTSUP;
  if (len > SX_NOTICE_MAX_BYTES)
    return sx__err(SX_ELIMIT, "a notice of %zu bytes; at most %u", len, SX_NOTICE_MAX_BYTES);
  rdma_wnotice *n = calloc(1, sizeof(*n) + len);
  if (n == NULL)
    return sx__err(SX_ENOMEM, "rdma: notify");
  n->op = op;
  n->p = p;
  n->buf = (uint8_t *)(n + 1);
  n->len = len;
  memcpy(n->buf, buf, len);
  n->in_list = 1;
  if (p->nq_tail != NULL)
    p->nq_tail->next = n;
  else
    p->nq_head = n;
  p->nq_tail = n;
  sx__rdma_enter(t);
  sx__rdma_w_pump(p);
  sx__rdma_leave(t, 0);
  return 0;
}

/* The established QP with the most credit, or NULL; *live whether any QP
 * is up, connecting or draining (sx__rdma_conn_live). */
static rdma_conn *pick(rdma_peer *p, int *live) {
  rdma_conn *best = NULL;
  *live = 0;
  for (uint32_t i = 0; i < p->n_conns; i++) {
    rdma_conn *c = &p->conns[(p->rr + i) % p->n_conns];
    if (sx__rdma_conn_live(c))
      *live = 1;
    if (c->state == RC_UP && c->credits > 0 && (best == NULL || c->credits > best->credits))
      best = c;
  }
  return best;
}

/* Send the head of the peer's queue on c.  0, 1 when no buffer is free, or
 * an error (the notice failed, c is torn down). */
static int send_one(rdma_peer *p, rdma_conn *c) {
  rdma_dev *d = c->dev;
  rdma_wnotice *n = p->nq_head;
  int rc = nbufs_open(d);
  if (rc != 0) {
    p->nq_head = n->next;
    if (p->nq_head == NULL)
      p->nq_tail = NULL;
    n->in_list = 0;
    settle(n, rc, sx_errmsg());
    return rc;
  }
  int slot = slot_get(d, c);
  if (slot < 0)
    return 1; /* a SEND completion frees one */
  p->nq_head = n->next;
  if (p->nq_head == NULL)
    p->nq_tail = NULL;
  n->next = NULL;
  uint8_t *dst = d->nbufs + (size_t)slot * SX_NOTICE_MAX_BYTES;
  memcpy(dst, n->buf, n->len);
  struct ibv_sge sge = {.addr = (uintptr_t)dst, .length = (uint32_t)n->len,
                        .lkey = d->nmr->lkey};
  struct ibv_send_wr wr, *bad = NULL;
  sx__rdma_wr_send(&wr, &sge, SX__RDMA_WR_NSEND | (uint64_t)slot);
  if ((rc = ibv_post_send(c->qp, &wr, &bad)) != 0) {
    char msg[200];
    snprintf(msg, sizeof(msg), "ibv_post_send of a notice on QP %u to '%.64s': %s", c->index,
             p->name, strerror(rc > 0 ? rc : errno));
    d->nowner[slot] = NULL;
    n->in_list = 0;
    settle(n, SX_ERDMA, msg);
    sx__rdma_conn_teardown(c, SX_ERDMA, 0, "%s", msg);
    return SX_ERDMA;
  }
  c->credits--;
  if (c->await_tail != NULL)
    c->await_tail->next = n;
  else
    c->await_head = n;
  c->await_tail = n;
  p->rr = (p->rr + 1) % p->n_conns;
  return 0;
}

void sx__rdma_w_pump(rdma_peer *p) {
  while (p->nq_head != NULL && !p->closing) {
    int live;
    rdma_conn *c = pick(p, &live);
    if (c != NULL) {
      if (send_one(p, c) == 1)
        return;
      continue;
    }
    if (live)
      return; /* credit comes back with replies, a QP comes up, or a drained
               * one is connected again (its finish pumps) */
    /* Nothing up or connecting (an op without WRITEs, or after a
     * failure): connect; if not one QP can even start, fail. */
    int rc = 0, started = 0;
    for (uint32_t i = 0; i < p->n_conns; i++) {
      if (p->conns[i].state != RC_IDLE)
        continue;
      int r = sx__rdma_conn_start(&p->conns[i]);
      if (r == 0)
        started = 1;
      else
        rc = r;
    }
    if (!started)
      sx__rdma_w_fail_queue(p, rc ? rc : SX_EUNREACH, rc ? sx_errmsg() : "no QP can start");
    return;
  }
}

/* ------------------------------------------------------------------ completions */

static void await_pop(rdma_conn *c) {
  rdma_wnotice *n = c->await_head;
  c->await_head = n->next;
  if (c->await_head == NULL)
    c->await_tail = NULL;
  n->next = NULL;
  n->in_list = 0;
}

void sx__rdma_w_wc(rdma_conn *c, const struct ibv_wc *wc) {
  rdma_peer *p = c->p;
  sx_rdma *t = p->t;
  char msg[256];
  if (wc->wr_id & SX__RDMA_WR_NSEND) {
    uint64_t slot = wc->wr_id & ~SX__RDMA_WR_NSEND;
    if (c->dev != NULL && slot < SX__RDMA_NOTICE_SLOTS && c->dev->nowner[slot] == c)
      c->dev->nowner[slot] = NULL;
    for (rdma_peer *q = t->peers; q != NULL; q = q->next)
      if (q->write && q->nq_head != NULL)
        q->wants_pump = 1; /* a buffer is free again */
    if (wc->status != IBV_WC_SUCCESS && wc->status != IBV_WC_WR_FLUSH_ERR &&
        c->state == RC_UP)
      sx__rdma_conn_teardown(c, sx__rdma_wc_code(wc->status), 0,
                             "sending a notice to '%.64s' at %s (QP %u) failed: %s", p->name,
                             p->where, c->index, ibv_wc_status_str(wc->status));
    return;
  }
  if (wc->status != IBV_WC_SUCCESS)
    return; /* flushed: the QP is going down, and its notices with it */
  if (!(wc->wc_flags & IBV_WC_WITH_IMM) || c->await_head == NULL) {
    if (c->state == RC_UP)
      sx__rdma_conn_teardown(c, SX_EPROTO, 0, "'%.64s' at %s (QP %u) sent a reply to no notice",
                             p->name, p->where, c->index);
    return;
  }
  int st = -(int)be32toh(wc->imm_data);
  if (st > 0 || st < SX_ERRNO_MIN)
    st = SX_EPROTO;
  rdma_wnotice *n = c->await_head;
  await_pop(c);
  if (recv_post(c) == 0)
    c->credits++;
  else if (c->state == RC_UP)
    sx__rdma_conn_teardown(c, SX_ERDMA, 0, "ibv_post_recv on QP %u to '%.64s': %s", c->index,
                           p->name, strerror(errno));
  if (st != 0)
    snprintf(msg, sizeof(msg), "%s refused the batch's notice: %s", p->where, sx_strerror(st));
  settle(n, st, st != 0 ? msg : NULL);
  if (!n->in_settle)
    free(n); /* settled before (aborted): nobody else holds it */
  p->wants_pump = 1;
}

/* ------------------------------------------------------------------ teardown */

void sx__rdma_w_conn_down(rdma_conn *c) {
  rdma_peer *p = c->p;
  char msg[512];
  snprintf(msg, sizeof(msg), "the QP to '%.64s' at %s went down before the consumer answered "
           "the batch's notice (%s)", p->name, p->where, c->msg[0] ? c->msg : "disconnected");
  /* Closing the segment or the agent says so; anything else lost the QP. */
  int code = c->reason == SX_ECANCELED || c->reason == SX_ESHUTDOWN ? c->reason : SX_EDISCONN;
  while (c->await_head != NULL) {
    rdma_wnotice *n = c->await_head;
    await_pop(c);
    settle(n, code, msg);
    if (!n->in_settle)
      free(n);
  }
  c->credits = 0;
  for (uint32_t i = 0; c->dev != NULL && i < SX__RDMA_NOTICE_SLOTS; i++)
    if (c->dev->nowner[i] == c)
      c->dev->nowner[i] = NULL;
}

int sx__rdma_w_busy(const rdma_conn *c) { return c->await_head != NULL; }

void sx__rdma_w_abort(rdma_peer *p, sx_op *op, int status) {
  status = status != 0 ? status : SX_ECANCELED;
  for (rdma_wnotice **pp = &p->nq_head, *prev = NULL; *pp != NULL; prev = *pp, pp = &(*pp)->next) {
    rdma_wnotice *n = *pp;
    if (n->op != op)
      continue;
    *pp = n->next;
    if (p->nq_tail == n)
      p->nq_tail = prev;
    n->in_list = 0;
    settle(n, status, NULL);
    return;
  }
  /* Sent: settled now; its answer, when it comes, is dropped. */
  for (uint32_t i = 0; i < p->n_conns; i++)
    for (rdma_wnotice *n = p->conns[i].await_head; n != NULL; n = n->next)
      if (n->op == op)
        settle(n, status, NULL);
}

void sx__rdma_w_fail_queue(rdma_peer *p, int code, const char *msg) {
  while (p->nq_head != NULL) {
    rdma_wnotice *n = p->nq_head;
    p->nq_head = n->next;
    n->in_list = 0;
    settle(n, code, msg);
  }
  p->nq_tail = NULL;
}
