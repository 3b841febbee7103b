/*
 * Batched RDMA READ, and RDMA WRITE for a producer's peer (push mode: the
 * same slicing, chains, signalling and abort; rdma_write.c sends the
 * notice once every WRITE completed).
 *
 * An op's xfers are cut into slices of at most t->slice bytes, each one RDMA
 * READ work request.  A peer keeps a queue of ops with slices left to issue;
 * the pump hands them out to the peer's established QPs in chains (one
 * ibv_post_send, one doorbell, per chain), sharing the queue evenly between
 * the QPs, each QP keeping at most SX__RDMA_QP_WINDOW bytes in flight.  Only
 * the last WR of a chain and every sig_every-th WR or 4 MiB within it are
 * signalled: RC completes a send queue in order, so a signalled completion
 * retires every unsignalled WR before it, and an error completes the failing
 * WR (and flushes the rest) even if it was unsignalled.  Completions are
 * handled in rounds: the channel events pending, then one pump per peer.
 * The READ depth (max_rd_atomic) is left to the device: READs beyond it
 * wait in the send queue.
 *
 * Each QP's send queue is a ring of slots (op, xfer, offset, length) indexed
 * by wr_id, so a completion finds its slices without a lookup or an
 * allocation.  An xfer settles when all its slices have retired: 0 when they
 * all arrived, else its first error.
 *
 * Abort moves the QPs carrying the op to error and waits for their flush:
 * only then are its xfers settled, so no READ lands in a destination after
 * the batch ended.  Slices of other ops flushed that way are not failures;
 * they go back to their op's queue and are reissued on the remaining or
 * reconnected QPs.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rdma_int.h"

#define POLL_BATCH 32
#define CQ_EVENTS_PER_ROUND 64

static uint64_t slices_of(uint64_t len, uint32_t slice) {
  return len == 0 ? 1 : len / slice + (len % slice != 0);
}

/* ------------------------------------------------------------------ queue */

void sx__rdma_rop_enqueue(rdma_rop *rop) {
  rdma_peer *p = rop->p;
  if (rop->queued)
    return;
  rop->queued = 1;
  rop->qnext = NULL;
  rop->qprev = p->qtail;
  if (p->qtail != NULL)
    p->qtail->qnext = rop;
  else
    p->qhead = rop;
  p->qtail = rop;
}

void sx__rdma_rop_dequeue(rdma_rop *rop) {
  rdma_peer *p = rop->p;
  if (!rop->queued)
    return;
  rop->queued = 0;
  if (rop->qprev != NULL)
    rop->qprev->qnext = rop->qnext;
  else
    p->qhead = rop->qnext;
  if (rop->qnext != NULL)
    rop->qnext->qprev = rop->qprev;
  else
    p->qtail = rop->qprev;
  rop->qprev = rop->qnext = NULL;
}

void sx__rdma_rop_free(rdma_rop *rop) {
  rdma_peer *p = rop->p;
  sx__rdma_rop_dequeue(rop);
  if (rop->prev != NULL)
    rop->prev->next = rop->next;
  else
    p->rops = rop->next;
  if (rop->next != NULL)
    rop->next->prev = rop->prev;
  free(rop->retry);
  free(rop);
}

/* ------------------------------------------------------------------ settling */

static void settle(rdma_rop *rop, size_t xi, int status) {
  sx_rdma *t = rop->p->t;
  rdma_xs *xs = &rop->xs[xi];
  xs->settled = 1;
  xs->final = status;
  rop->dq[rop->dq_w++] = (uint32_t)xi;
  if (!rop->in_dlist) {
    rop->in_dlist = 1;
    rop->dnext = NULL;
    if (t->dtail != NULL)
      t->dtail->dnext = rop;
    else
      t->dhead = rop;
    t->dtail = rop;
  }
}

/* Settle xfer xi if nothing of it is in flight or queued and either all of
 * it arrived or its op stopped issuing. */
void sx__rdma_xfer_check(rdma_rop *rop, size_t xi) {
  rdma_xs *xs = &rop->xs[xi];
  if (xs->settled || xs->inflight != 0 || xs->requeued != 0)
    return;
  int stopping = rop->error != 0 || rop->aborting || rop->p->closing;
  if (!xs->issued && !stopping)
    return;
  int st;
  if (xs->status != 0)
    st = xs->status;
  else if (xs->issued)
    st = 0; /* every slice retired without error */
  else if (rop->aborting)
    st = rop->abort_status;
  else
    st = rop->error != 0 ? rop->error : SX_ECANCELED;
  settle(rop, xi, st);
}

/* Stop issuing the op's slices: what is not in flight settles now, what is
 * in flight settles as it retires. */
static void give_up(rdma_rop *rop) {
  rdma_peer *p = rop->p;
  sx__rdma_rop_dequeue(rop);
  p->queued_slices -= rop->qslices;
  rop->qslices = 0;
  for (size_t i = 0; i < rop->n_retry; i++)
    rop->xs[rop->retry[i].xi].requeued--;
  rop->n_retry = 0;
  for (size_t i = 0; i < rop->op->n; i++)
    sx__rdma_xfer_check(rop, i);
}

static void rop_fail_all(rdma_rop *rop, int status, const char *msg) {
  if (rop->error != 0 || rop->aborting)
    return;
  rop->error = status;
  snprintf(rop->msg, sizeof(rop->msg), "%s", msg != NULL && msg[0] ? msg : sx_strerror(status));
  /* The batch has failed: its remaining slices would only add load on a
   * peer that is likely gone. */
  give_up(rop);
}

void sx__rdma_rop_fail(rdma_rop *rop, size_t xi, int status, const char *msg) {
  if (rop->xs[xi].status == 0)
    rop->xs[xi].status = status;
  rop_fail_all(rop, status, msg);
}

static void requeue(rdma_rop *rop, uint32_t xi, uint64_t off, uint32_t len) {
  rdma_peer *p = rop->p;
  if (rop->n_retry == rop->cap_retry) {
    size_t cap = rop->cap_retry ? rop->cap_retry * 2 : 16;
    rdma_retry *r = realloc(rop->retry, cap * sizeof(*r));
    if (r == NULL) {
      sx__rdma_rop_fail(rop, xi, SX_ENOMEM, "rdma: out of memory requeueing a flushed READ");
      return;
    }
    rop->retry = r;
    rop->cap_retry = cap;
  }
  rop->retry[rop->n_retry].xi = xi;
  rop->retry[rop->n_retry].off = off;
  rop->retry[rop->n_retry].len = len;
  rop->n_retry++;
  rop->xs[xi].requeued++;
  p->t->stats.requeued++;
  rop->qslices++;
  p->queued_slices++;
  sx__rdma_rop_enqueue(rop);
}

/* One slot of a send queue is done: status 0, a completion error, or a
 * flush (is_flush) caused by the conn's teardown. */
static void retire(rdma_conn *c, rdma_slot *s, int status, int is_flush, const char *msg) {
  rdma_rop *rop = s->rop;
  c->inflight_bytes -= s->len;
  rdma_xs *xs = &rop->xs[s->xi];
  xs->inflight--;
  rop->inflight--;
  if (status != 0 && !rop->aborting) {
    if (is_flush && c->requeue && rop->error == 0 && !rop->p->closing)
      requeue(rop, s->xi, s->off, s->len);
    else
      sx__rdma_rop_fail(rop, s->xi, status, msg);
  }
  sx__rdma_xfer_check(rop, s->xi);
}

/* READs that landed in GPU memory through GPUDirect (an MR on device
 * memory) are flushed before the op ends, so that a kernel on another GPU,
 * or one not ordered with the NIC, sees them (cuFlushGPUDirectRDMAWrites).
 * Staged reads end with CUDA copies, which need none. */
static void flush_gpu(const rdma_rop *rop) {
  const sx_op *op = rop->op;
  if (rop->p->write || rop->p->stage_of != NULL)
    return;
  int done = -1;
  for (size_t i = 0; i < op->n; i++) {
    const sx_lregion *l = op->xfers[i].lreg;
    if (l != NULL && l->mem.kind == SX__MEM_CUDA && l->mem.device != done &&
        rop->xs[i].final == 0) {
      if (sx__mem_flush_rdma_writes(l->mem.device) != 0)
        sx__rdma_log(rop->p->t, SX_LOG_WARN, "%s", sx_errmsg());
      done = l->mem.device;
    }
  }
}

void sx__rdma_deliver(sx_rdma *t) {
  rdma_rop *rop;
  while ((rop = t->dhead) != NULL) {
    if (rop->dq_r == rop->dq_w) {
      t->dhead = rop->dnext;
      if (t->dhead == NULL)
        t->dtail = NULL;
      rop->in_dlist = 0;
      rop->dnext = NULL;
      continue;
    }
    size_t xi = rop->dq[rop->dq_r++];
    int st = rop->xs[xi].final;
    sx_op *op = rop->op;
    const char *msg = (st != 0 && st == rop->error) ? rop->msg : NULL;
    if (rop->delivered + 1 == op->n) {
      /* The last one: op->done runs inside, and may free op; the rop goes
       * first. */
      char buf[sizeof(rop->msg)];
      snprintf(buf, sizeof(buf), "%s", msg != NULL ? msg : "");
      flush_gpu(rop);
      t->dhead = rop->dnext;
      if (t->dhead == NULL)
        t->dtail = NULL;
      sx__rdma_rop_free(rop);
      sx__op_xfer_done(op, xi, st, msg != NULL ? buf : NULL);
    } else {
      rop->delivered++;
      sx__op_xfer_done(op, xi, st, msg);
    }
  }
}

/* ------------------------------------------------------------------ issue */

/* Build and post one chain of at most want READs from the peer's queue.
 * Returns how many were posted. */
static uint32_t post_chain(rdma_conn *c, uint32_t want) {
  rdma_peer *p = c->p;
  sx_rdma *t = p->t;
  uint32_t n = 0;
  int dev = c->dev->index;
  uint64_t window = c->inflight_bytes;
  while (n < want && p->qhead != NULL) {
    rdma_rop *rop = p->qhead;
    sx_op *op = rop->op;
    uint32_t xi, len;
    uint64_t off;
    /* The window is full (a QP with nothing in flight takes one slice of
     * any size). */
    if (window > 0 && window + t->slice > SX__RDMA_QP_WINDOW)
      break;
    if (rop->n_retry > 0) {
      rdma_retry *r = &rop->retry[--rop->n_retry];
      xi = r->xi;
      off = r->off;
      len = r->len;
      rop->xs[xi].requeued--;
    } else {
      rdma_xs *xs = &rop->xs[rop->next_xi];
      const sx_xfer *x = &op->xfers[rop->next_xi];
      uint64_t rem = x->length - xs->next_off;
      xi = (uint32_t)rop->next_xi;
      off = xs->next_off;
      len = rem < t->slice ? (uint32_t)rem : t->slice;
      xs->next_off += len;
      if (xs->next_off == x->length) {
        xs->issued = 1;
        rop->next_xi++;
      }
    }
    rop->qslices--;
    p->queued_slices--;
    if (rop->n_retry == 0 && rop->next_xi == op->n)
      sx__rdma_rop_dequeue(rop);

    const sx_xfer *x = &op->xfers[xi];
    uint32_t pos = (c->head + n) % c->cap;
    const rdma_mr *rm = x->lreg->tpriv[SX_TRANSPORT_RDMA];
    const struct ibv_mr *mr = rm != NULL ? rm->mr[dev] : NULL;
    if (mr == NULL) {
      char msg[160];
      snprintf(msg, sizeof(msg), "local region %u is not registered on %s", x->lreg->r.id,
               c->dev->name);
      sx__rdma_rop_fail(rop, xi, SX_EINVAL, msg);
      sx__rdma_xfer_check(rop, xi);
      continue;
    }
    struct ibv_sge *sge = &c->sges[n];
    struct ibv_send_wr *wr = &c->wrs[n];
    sge->addr = (uintptr_t)(x->local + off);
    sge->length = len;
    sge->lkey = mr->lkey;
    memset(wr, 0, sizeof(*wr));
    wr->wr_id = pos;
    wr->next = &c->wrs[n + 1];
    wr->sg_list = sge;
    wr->num_sge = len > 0 ? 1 : 0;
    wr->opcode = p->write ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
    wr->wr.rdma.remote_addr = x->rreg->addr + x->roff + off;
    wr->wr.rdma.rkey = p->write ? x->rreg->wkeys[p->rkey_index] : x->rreg->rkeys[p->rkey_index];
    rdma_slot *s = &c->ring[pos];
    s->rop = rop;
    s->xi = xi;
    s->off = off;
    s->len = len;
    rop->xs[xi].inflight++;
    rop->inflight++;
    window += len;
    n++;
  }
  if (n == 0)
    return 0;
  uint32_t sig = 0, since = 0;
  uint64_t bytes = 0, chain = 0;
  for (uint32_t i = 0; i < n; i++) {
    since++;
    bytes += c->sges[i].length;
    chain += c->sges[i].length;
    if (since == c->sig_every || bytes >= SX__RDMA_SIGNAL_BYTES || i + 1 == n) {
      c->wrs[i].send_flags = IBV_SEND_SIGNALED;
      sig++;
      since = 0;
      bytes = 0;
    }
  }
  c->wrs[n - 1].next = NULL;
  c->head = (c->head + n) % c->cap;
  c->used += n;
  c->inflight_bytes = window;

  struct ibv_send_wr *bad = NULL;
  int rc = ibv_post_send(c->qp, c->wrs, &bad);
  if (rc == 0) {
    t->stats.posts++;
    t->stats.wrs += n;
    t->stats.signaled += sig;
    sx__rdma_count(t, c->dev, n, chain);
    return n;
  }

  /* WRs from bad on were not posted: take them back off the head of the
   * ring and fail them; the QP is torn down (its posted WRs flush). */
  uint32_t posted = 0;
  if (bad != NULL && bad >= c->wrs && bad < c->wrs + n)
    posted = (uint32_t)(bad - c->wrs);
  char msg[200];
  snprintf(msg, sizeof(msg), "ibv_post_send of %u %s on QP %u to '%.64s': %s", n - posted,
           p->write ? "WRITEs" : "READs", c->index, p->name, strerror(rc > 0 ? rc : errno));
  for (uint32_t i = n; i > posted; i--) {
    c->head = (c->head + c->cap - 1) % c->cap;
    c->used--;
    retire(c, &c->ring[c->head], SX_ERDMA, 0, msg);
  }
  sx__rdma_conn_teardown(c, SX_ERDMA, 0, "%s", msg);
  return posted;
}

static int start_conns(rdma_peer *p) {
  int rc = 0, live = 0;
  for (uint32_t i = 0; i < p->n_conns; i++) {
    rdma_conn *c = &p->conns[i];
    if (c->state == RC_IDLE) {
      int r = sx__rdma_conn_start(c);
      if (r)
        rc = r;
    }
    if (sx__rdma_conn_live(c))
      live = 1;
  }
  if (live)
    return 0;
  return rc ? rc : sx__err(SX_EUNREACH, "rdma: no QP to '%.64s' can connect", p->name);
}

void sx__rdma_pump(rdma_peer *p) {
  if (p->stage_of != NULL) {
    sx__rdma_s_pump(p);
    return;
  }
  if (p->write)
    sx__rdma_w_pump(p); /* notices of ops whose WRITEs all completed */
  if (p->closing || p->qhead == NULL)
    return;
  uint32_t n_up = 0;
  int connecting = 0;
  for (uint32_t i = 0; i < p->n_conns; i++) {
    if (p->conns[i].state == RC_UP)
      n_up++;
    else if (p->conns[i].state >= RC_ADDR && p->conns[i].state <= RC_CONNECT)
      connecting = 1;
  }
  if (n_up == 0) {
    /* Work is waiting (e.g. slices flushed by an abort) and nothing can
     * carry it: reconnect; if that cannot even start, fail it. */
    if (!connecting) {
      int rc = start_conns(p);
      if (rc)
        sx__rdma_peer_fail_queue(p, rc, sx_errmsg());
    }
    return;
  }
  while (p->qhead != NULL) {
    /* Share this pass's queue evenly, so one QP does not take a whole
     * batch while the others idle. */
    uint64_t share = (p->queued_slices + n_up - 1) / n_up;
    uint32_t posted = 0;
    if (share == 0)
      share = 1;
    for (uint32_t k = 0; k < p->n_conns && p->qhead != NULL; k++) {
      rdma_conn *c = &p->conns[(p->rr + k) % p->n_conns];
      if (c->state != RC_UP || c->used >= c->cap ||
          (c->inflight_bytes > 0 && c->inflight_bytes + p->t->slice > SX__RDMA_QP_WINDOW))
        continue;
      uint32_t room = c->cap - c->used;
      posted += post_chain(c, share < room ? (uint32_t)share : room);
    }
    p->rr = (p->rr + 1) % p->n_conns;
    if (posted == 0)
      break; /* every window is full; completions will call again */
  }
}

/* ------------------------------------------------------------------ completions */

static void handle_wc(rdma_conn *c, const struct ibv_wc *wc) {
  rdma_peer *p = c->p;
  if (wc->wr_id == SX__RDMA_DRAIN_WR_ID) {
    c->drained = 1;
    c->reap = 1;
    return;
  }
  if (wc->wr_id & SX__RDMA_WR_STAGE) {
    sx__rdma_s_wc(c, wc); /* staged RDMA: a request, a reply or a READ of a slot */
    return;
  }
  if (wc->wr_id & (SX__RDMA_WR_NSEND | SX__RDMA_WR_RECV)) {
    sx__rdma_w_wc(c, wc); /* push: a notice or its reply */
    return;
  }
  if (wc->wr_id >= c->cap || c->used == 0) {
    sx__rdma_log(p->t, SX_LOG_ERROR, "QP %u to '%s': completion for unknown wr_id %llu",
                 c->index, p->name, (unsigned long long)wc->wr_id);
    return;
  }
  uint32_t idx = (uint32_t)wc->wr_id;
  int st = 0, is_flush = 0;
  char msg[256] = "";
  if (wc->status == IBV_WC_WR_FLUSH_ERR) {
    is_flush = 1;
    if (c->state == RC_UP)
      sx__rdma_conn_teardown(c, SX_EDISCONN, 0,
                             "QP %u to '%.64s' at %s went to error: work requests flushed",
                             c->index, p->name, p->where);
    st = c->reason != 0 ? c->reason : SX_EDISCONN;
  } else if (wc->status != IBV_WC_SUCCESS) {
    st = sx__rdma_wc_code(wc->status);
    snprintf(msg, sizeof(msg),
             "RDMA %s '%.64s' at %s (QP %u) failed: %s (status %d, vendor error 0x%x)",
             p->write ? "WRITE to" : "READ from", p->name, p->where, c->index,
             ibv_wc_status_str(wc->status), (int)wc->status, wc->vendor_err);
    if (c->state == RC_UP)
      sx__rdma_conn_teardown(c, st, 0, "%s", msg);
  }
  /* In-order completion: every slot before idx finished without error. */
  while (c->used > 0) {
    uint32_t pos = c->tail;
    c->tail = (c->tail + 1) % c->cap;
    c->used--;
    if (pos == idx) {
      retire(c, &c->ring[pos], st, is_flush, is_flush ? c->msg : msg);
      break;
    }
    retire(c, &c->ring[pos], 0, 0, NULL);
  }
  if (c->state == RC_DRAIN && !c->drain_posted && c->used == 0) {
    c->drained = 1;
    c->reap = 1;
  }
}

void sx__rdma_conn_poll(rdma_conn *c) {
  struct ibv_wc wc[POLL_BATCH];
  int n;
  do {
    if (c->cq == NULL)
      return;
    n = ibv_poll_cq(c->cq, POLL_BATCH, wc);
    if (n < 0) {
      sx__rdma_log(c->p->t, SX_LOG_ERROR, "ibv_poll_cq on QP %u to '%s' failed", c->index,
                   c->p->name);
      if (c->state == RC_UP)
        sx__rdma_conn_teardown(c, SX_ERDMA, 0, "ibv_poll_cq failed");
      if (c->state == RC_DRAIN) {
        c->drained = 1; /* nothing more can be learned from this CQ */
        c->reap = 1;
      }
      return;
    }
    c->p->t->stats.cqes += (uint64_t)n;
    for (int i = 0; i < n; i++)
      handle_wc(c, &wc[i]);
  } while (n == POLL_BATCH);
  if (c->state == RC_UP)
    c->p->wants_pump = 1;
}

void sx__rdma_conn_finish(rdma_conn *c) {
  rdma_peer *p = c->p;
  int st = c->reason != 0 ? c->reason : SX_EDISCONN;
  /* Whatever no completion retired is flushed by now (or the drain timed
   * out and the QP is about to be destroyed). */
  while (c->used > 0) {
    uint32_t pos = c->tail;
    c->tail = (c->tail + 1) % c->cap;
    c->used--;
    retire(c, &c->ring[pos], st, 1, c->msg);
  }
  sx__rdma_conn_destroy(c);
  sx__rdma_pump(p);
}

int sx__rdma_cq_round(sx_rdma *t, struct ibv_comp_channel *ch,
                      void (*poll_fn)(void *cq_ctx, void *arg), void *arg) {
  int k;
  for (k = 0; k < CQ_EVENTS_PER_ROUND; k++) {
    struct ibv_cq *cq;
    void *cq_ctx;
    if (ibv_get_cq_event(ch, &cq, &cq_ctx) != 0)
      break; /* EAGAIN: the channel is drained */
    /* Re-arm before polling, so a completion that lands after the last
     * poll still raises an event. */
    if (ibv_req_notify_cq(cq, 0) != 0)
      sx__rdma_log(t, SX_LOG_ERROR, "ibv_req_notify_cq: %s", strerror(errno));
    poll_fn(cq_ctx, arg);
    ibv_ack_cq_events(cq, 1);
  }
  return k;
}

/* sx__rdma_cq_round's poll for the reader's CQs: one per conn. */
static void poll_conn(void *cq_ctx, void *arg) {
  (void)arg;
  sx__rdma_conn_poll(cq_ctx);
}

void sx__rdma_on_cq_event(uv_poll_t *h, int status, int events) {
  rdma_dev *d = h->data;
  sx_rdma *t = d->t;
  (void)status;
  (void)events;
  sx__rdma_enter(t);
  /* One round: the events pending now (bounded), then one pump per peer.
   * Posting from inside the round would let a device that completes READs
   * within ibv_post_send (Soft-RoCE over loopback) keep this callback
   * busy until the whole batch is done, starving the rest of the loop. */
  t->stats.cq_events += (uint64_t)sx__rdma_cq_round(t, d->chan, poll_conn, NULL);
  /* Conns whose flush completed are destroyed only now, after their CQ
   * events were acked. */
  for (rdma_peer *p = t->peers; p != NULL; p = p->next)
    for (uint32_t i = 0; i < p->n_conns; i++)
      if (p->conns[i].reap)
        sx__rdma_conn_finish(&p->conns[i]);
  for (rdma_peer *p = t->peers; p != NULL; p = p->next) {
    if (p->wants_pump) {
      p->wants_pump = 0;
      sx__rdma_pump(p);
    }
  }
  sx__rdma_leave(t, 1);
}

/* ------------------------------------------------------------------ ops */

static rdma_rop *rop_find(rdma_peer *p, const sx_op *op) {
  for (rdma_rop *r = p->rops; r != NULL; r = r->next)
    if (r->op == op)
      return r;
  return NULL;
}

/* The destination lies in its local region, registered with RDMA. */
static int check_local(const rdma_peer *p, const sx_xfer *x, size_t i) {
  const rdma_mr *rm = x->lreg->tpriv[SX_TRANSPORT_RDMA];
  if (x->lreg->mem.kind == SX__MEM_CUDA && (rm == NULL || rm->mr[p->lep->dev->index] == NULL))
    return sx__err(SX_ENOTSUP, "local region %u is GPU memory (%s) that RDMA did not "
                   "register, and staging is off here (SX_RDMA_GPU=off)",
                   x->lreg->r.id, x->lreg->r.location);
  if (rm == NULL || rm->mr[p->lep->dev->index] == NULL)
    return sx__err(SX_EINVAL, "local region %u is not registered with RDMA on %s",
                   x->lreg->r.id, p->lep->dev->name);
  uint64_t a = (uint64_t)(uintptr_t)x->local;
  if (a < x->lreg->r.addr || a - x->lreg->r.addr > x->lreg->r.length ||
      x->length > x->lreg->r.length - (a - x->lreg->r.addr))
    return sx__err(SX_EBOUNDS, "range %zu: %llu bytes at %p lie outside local region %u", i,
                   (unsigned long long)x->length, (void *)x->local, x->lreg->r.id);
  return 0;
}

int sx__rdma_post(sx_tpeer *tp, sx_op *op) {
  rdma_peer *p = (rdma_peer *)tp;
  if (p->closing || p->t->closed)
    return sx__err(SX_ESHUTDOWN, "rdma: the peer '%s' is closed", p->name);
  if (op->n == 0 || op->xfers == NULL)
    return sx__err(SX_EINVAL, "rdma: an op with no ranges");
  if (op->n > UINT32_MAX)
    return sx__err(SX_ELIMIT, "rdma: %zu ranges in one op", op->n);
  return sx__rdma_route_post(p, op);
}

int sx__rdma_post_pair(rdma_peer *p, sx_op *op) {
  sx_rdma *t = p->t;
  uint64_t slices = 0;
  int rc;
  if (p->closing || t->closed)
    return sx__err(SX_ESHUTDOWN, "rdma: the peer '%s' is closed", p->name);
  if (op->n == 0 || op->xfers == NULL)
    return sx__err(SX_EINVAL, "rdma: an op with no ranges");
  if (op->n > UINT32_MAX)
    return sx__err(SX_ELIMIT, "rdma: %zu ranges in one op", op->n);
  if (sx__rdma_s_wanted(p, op))
    return sx__rdma_s_post(p, op); /* GPU memory without an MR: through rings */
  /* Check everything before posting anything. */
  for (size_t i = 0; i < op->n; i++) {
    const sx_xfer *x = &op->xfers[i];
    if (x->lreg == NULL)
      return sx__err(SX_EINVAL,
                     "RDMA READ needs its destination in registered memory: range %zu "
                     "(entries %u-%u, %llu bytes) has no local region",
                     i, x->entry_first, x->entry_last, (unsigned long long)x->length);
    if ((rc = check_local(p, x, i)) != 0)
      return rc;
    if (x->rreg == NULL)
      return sx__err(SX_EINVAL, "range %zu has no remote region", i);
    if (strncmp(x->rreg->location, "cuda:", 5) == 0 &&
        (x->rreg->n_rkeys <= p->rkey_index || x->rreg->rkeys[p->rkey_index] == 0))
      return sx__err(SX_ENOTSUP, "remote region %u is GPU memory (%s) without an rkey, and "
                     "staging is off here (SX_RDMA_GPU=off)", x->rreg->id,
                     x->rreg->location);
    if (x->rreg->n_rkeys <= p->rkey_index)
      return sx__err(SX_ERKEYS, "remote region %u has %u rkeys, the endpoint used is #%u",
                     x->rreg->id, x->rreg->n_rkeys, p->rkey_index);
    if (p->write && x->rreg->n_wkeys <= p->rkey_index)
      return sx__err(SX_EDENIED, "'%s' publishes no RDMA write key for region %u (not "
                     "writable over RDMA)", p->name, x->rreg->id);
    if (x->roff > x->rreg->length || x->length > x->rreg->length - x->roff)
      return sx__err(SX_EBOUNDS, "range %zu: %llu bytes at offset %llu lie outside remote "
                     "region %u", i, (unsigned long long)x->length,
                     (unsigned long long)x->roff, x->rreg->id);
    slices += slices_of(x->length, t->slice);
  }

  sx__rdma_enter(t);
  /* The next post reconnects: bring up every idle QP of the peer.  If not
   * one can even start, nothing is posted and the caller hears why. */
  rc = start_conns(p);
  if (rc) {
    sx__rdma_leave(t, 0);
    return rc;
  }
  if (sx__rdma_rop_new(p, op, slices) == NULL) {
    sx__rdma_leave(t, 0);
    return sx__err(SX_ENOMEM, "rdma: out of memory for an op of %zu ranges", op->n);
  }
  sx__rdma_pump(p);
  sx__rdma_leave(t, 0);
  return 0;
}

rdma_rop *sx__rdma_rop_new(rdma_peer *p, sx_op *op, uint64_t slices) {
  size_t bytes = sizeof(rdma_rop) + op->n * (sizeof(rdma_xs) + sizeof(uint32_t));
  rdma_rop *rop = calloc(1, bytes);
  if (rop == NULL)
    return NULL;
  rop->op = op;
  rop->p = p;
  rop->xs = (rdma_xs *)(rop + 1);
  rop->dq = (uint32_t *)(rop->xs + op->n);
  rop->qslices = slices;
  p->queued_slices += slices;
  rop->next = p->rops;
  if (p->rops != NULL)
    p->rops->prev = rop;
  p->rops = rop;
  sx__rdma_rop_enqueue(rop);
  return rop;
}

/* Does the conn carry a READ of this op right now? */
static int conn_carries(const rdma_conn *c, const rdma_rop *rop) {
  for (uint32_t i = 0, pos = c->tail; i < c->used; i++, pos = (pos + 1) % c->cap)
    if (c->ring[pos].rop == rop)
      return 1;
  return 0;
}

void sx__rdma_abort(sx_tpeer *tp, sx_op *op, int status) {
  rdma_peer *p = (rdma_peer *)tp;
  sx__rdma_route_abort(p, op, status);
}

void sx__rdma_abort_pair(rdma_peer *p, sx_op *op, int status) {
  sx_rdma *t = p->t;
  sx__rdma_enter(t);
  rdma_rop *rop = rop_find(p, op);
  if (p->write)
    sx__rdma_w_abort(p, op, status); /* its notice, if it got that far */
  if (rop == NULL && p->stage != NULL) { /* a staged op: its stage peer has it */
    p = p->stage;
    rop = rop_find(p, op);
  }
  if (rop != NULL && !rop->aborting) {
    rop->aborting = 1;
    rop->abort_status = status != 0 ? status : SX_ECANCELED;
    give_up(rop);
    if (p->stage_of != NULL)
      sx__rdma_s_abort_slots(p, rop); /* its pieces not being copied out settle now */
    if (rop->inflight > 0) {
      for (uint32_t i = 0; i < p->n_conns; i++) {
        rdma_conn *c = &p->conns[i];
        /* A QP with notices awaiting replies is not torn down (they could
         * not be sent again): the op's WRITEs on it settle as they complete. */
        if (c->state == RC_UP && conn_carries(c, rop) && !sx__rdma_w_busy(c))
          sx__rdma_conn_teardown(c, rop->abort_status, 1, "an op was aborted (%s)",
                                 sx_err_name(rop->abort_status));
      }
    }
  }
  sx__rdma_leave(t, 0);
}

void sx__rdma_peer_fail_queue(rdma_peer *p, int code, const char *msg) {
  sx__rdma_w_fail_queue(p, code, msg);
  while (p->qhead != NULL) {
    rdma_rop *rop = p->qhead;
    rop_fail_all(rop, code, msg);
    if (rop->queued)
      give_up(rop); /* already failing or aborting: still stop issuing */
  }
}

void sx__rdma_peer_cancel_all(rdma_peer *p, int code, const char *msg) {
  for (rdma_rop *rop = p->rops; rop != NULL; rop = rop->next) {
    if (rop->error == 0 && !rop->aborting) {
      rop->error = code;
      snprintf(rop->msg, sizeof(rop->msg), "%s", msg);
    }
    give_up(rop);
    /* Only left in flight if a drain timed out: the QP is destroyed. */
    for (size_t i = 0; i < rop->op->n; i++) {
      if (!rop->xs[i].settled && rop->xs[i].inflight != 0) {
        rop->inflight -= rop->xs[i].inflight;
        rop->xs[i].inflight = 0;
        sx__rdma_xfer_check(rop, i);
      }
    }
  }
}
