/*
 * Staged RDMA, target side (rdma_stage.h says how a slot lives).
 *
 * A reader's stage QP, once its incarnation and token passed (rdma_cm.c),
 * gets a ring of its own: SX__RDMA_STAGE_SLOTS slots of pinned host memory
 * registered for remote reads in the device's PD, so only this reader learns
 * the rkey in replies and only the bytes it asked for are ever in it.  Its
 * QP has a CQ on a completion channel of its own, so tearing it down never
 * waits for another QP's events.
 *
 * Each request is checked range by range as a TCP read is (region known and
 * not withdrawn, remote reads allowed, bounds), copied into the slot with one
 * gather on a stream of the region's GPU (sx__rdma_ring_gather; host
 * regions: memcpy), and answered once the copy finished.  The regions'
 * inflight counts hold until then, so unregister waits for the copies.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rdma_int.h"

#define MAX_STREAMS 16

typedef struct tslot {
  rdma_sserve *ss;
  uint32_t index;
  int busy;
  uint32_t seq, bytes, n;
  sx_lregion *regs[SX__RDMA_STAGE_MAX_RANGES]; /* inflight held while copying */
  sx__mem_notice note;
} tslot;

struct rdma_sserve {
  rdma_tconn *tc; /* NULL once gone */
  sx_rdma *t;
  rdma_dev *dev;
  struct ibv_comp_channel *chan;
  uv_poll_t *poll;
  struct ibv_cq *cq;
  sx__rdma_ring ring; /* SLOTS slots; SLOTS receive buffers, then SLOTS replies */
  tslot slots[SX__RDMA_STAGE_SLOTS];
  sx__mem_stream *streams[MAX_STREAMS];
  sx__mem_notifier *notifier;
};

static void free_handle(uv_handle_t *h) { free(h); }

/* Message buffers: SLOTS receive buffers, then SLOTS replies. */
static uint8_t *send_buf(rdma_sserve *ss, uint32_t i) {
  return sx__rdma_ring_msg(&ss->ring, SX__RDMA_STAGE_SLOTS + i);
}

static int post_recv(rdma_sserve *ss, struct ibv_qp *qp, uint32_t i) {
  return sx__rdma_ring_post_recv(&ss->ring, qp, i);
}

static void drop(rdma_sserve *ss, const char *why) {
  rdma_tconn *tc = ss->tc;
  if (tc == NULL)
    return;
  sx__rdma_log(ss->t, SX_LOG_WARN, "stage QP of reader '%s': %s; disconnecting it", tc->reader,
               why);
  rdma_disconnect(tc->id);
}

static void reply(rdma_sserve *ss, tslot *sl, int status) {
  rdma_tconn *tc = ss->tc;
  if (tc == NULL || tc->id->qp == NULL)
    return;
  sx__rdma_sreply *w = (sx__rdma_sreply *)send_buf(ss, sl->index);
  sx__rdma_sreply_pack(w, (uint8_t)sl->index, sl->seq, status,
                       (uint64_t)(uintptr_t)sx__rdma_ring_slot(&ss->ring, sl->index), ss->ring.mr->rkey,
                       status == 0 ? sl->bytes : 0);
  struct ibv_sge sge = {.addr = (uintptr_t)w, .length = sizeof(*w), .lkey = ss->ring.msg_mr->lkey};
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = SX__RDMA_SWR(SX__RDMA_SWR_SEND, sl->index);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  if (ibv_post_send(tc->id->qp, &wr, &bad) != 0) {
    char why[96];
    snprintf(why, sizeof(why), "ibv_post_send of a reply: %s", strerror(errno));
    drop(ss, why);
  }
}

static void slot_end(tslot *sl, int status) {
  rdma_sserve *ss = sl->ss;
  const sx_tctx *ctx = ss->t->base.ctx;
  for (uint32_t i = 0; i < sl->n; i++)
    sl->regs[i]->inflight--;
  if (ctx->served != NULL)
    ctx->served(ctx->agent, SX_TRANSPORT_RDMA, status == 0 ? sl->bytes : 0, status);
  sl->n = 0;
  sl->busy = 0;
  reply(ss, sl, status);
}

static void on_copied(sx__mem_notice *n) {
  tslot *sl = (tslot *)((char *)n - offsetof(tslot, note));
  sx_rdma *t = sl->ss->t;
  sx__rdma_enter(t);
  slot_end(sl, 0);
  sx__rdma_leave(t, 1);
}

/* Check the ranges of q and copy them into their slot. */
static void serve(rdma_sserve *ss, const sx__rdma_sreq *q) {
  const sx_tctx *ctx = ss->t->base.ctx;
  tslot *sl = &ss->slots[q->slot];
  sx__mem_range rg[SX__RDMA_STAGE_MAX_RANGES];
  int device = -1, st = 0, sm_ok = 1; /* every source on device's GPU */
  if (sl->busy) {
    drop(ss, "a request for a slot that is still being filled");
    return;
  }
  sl->busy = 1;
  sl->seq = q->seq;
  sl->bytes = 0;
  sl->n = 0;
  for (uint16_t i = 0; i < q->n && st == 0; i++) {
    const sx__rdma_srange *r = &q->r[i];
    sx_lregion *l = ctx->find_region(ctx->agent, r->region);
    uint64_t end;
    if (l == NULL)
      st = SX_ENOREGION;
    else if (!(l->r.access & SX_ACCESS_REMOTE_READ))
      st = SX_EDENIED;
    else if (!sx__add_ok(r->off, r->len, &end) || end > l->r.length)
      st = SX_EBOUNDS;
    if (st != 0) {
      sx__rdma_log(ss->t, SX_LOG_DEBUG, "refused to stage region %u offset %llu length %u for "
                   "'%s': %s", r->region, (unsigned long long)r->off, r->len,
                   ss->tc->reader, sx_err_name(st));
      break;
    }
    rg[i].dst = (uint64_t)(uintptr_t)(sx__rdma_ring_slot(&ss->ring, sl->index) + sl->bytes);
    rg[i].src = l->r.addr + r->off;
    rg[i].len = r->len;
    sl->bytes += r->len;
    if (l->mem.kind != SX__MEM_CUDA)
      sm_ok = 0;
    else if (device < 0)
      device = l->mem.device;
    else if (l->mem.device != device)
      sm_ok = 0;
    sl->regs[sl->n++] = l;
    l->inflight++;
  }
  if (st != 0) {
    slot_end(sl, st);
    return;
  }
  if (device >= 0 && device < MAX_STREAMS && ss->notifier != NULL) {
    if (ss->streams[device] == NULL &&
        sx__mem_stream_create(device, &ss->streams[device]) != 0)
      ss->streams[device] = NULL;
    sx__mem_stream *s = ss->streams[device];
    if (s != NULL && sx__rdma_ring_gather(ss->t, &ss->ring, s, rg, q->n, sm_ok, 1) == 0) {
      sl->note.fn = on_copied;
      if (sx__mem_notify(s, ss->notifier, &sl->note) == 0)
        return;
      st = sx__mem_stream_sync(s);
      slot_end(sl, st);
      return;
    }
  }
  /* Host memory, or no stream: copy here (unified addressing). */
  for (uint16_t i = 0; i < q->n && st == 0; i++)
    st = device >= 0 ? sx__mem_copy((void *)(uintptr_t)rg[i].dst,
                                    (const void *)(uintptr_t)rg[i].src, rg[i].len)
                     : (memcpy((void *)(uintptr_t)rg[i].dst, (const void *)(uintptr_t)rg[i].src,
                               rg[i].len), 0);
  slot_end(sl, st);
}

static void on_wc(rdma_sserve *ss, const struct ibv_wc *wc) {
  uint32_t kind = (uint32_t)(wc->wr_id >> 16) & 0xffu;
  uint32_t idx = (uint32_t)wc->wr_id & 0xffffu;
  if (wc->status != IBV_WC_SUCCESS) {
    if (wc->status != IBV_WC_WR_FLUSH_ERR) {
      char why[128];
      snprintf(why, sizeof(why), "%s completion failed: %s",
               kind == SX__RDMA_SWR_RECV ? "a receive" : "a reply",
               ibv_wc_status_str(wc->status));
      drop(ss, why);
    }
    return;
  }
  if (kind != SX__RDMA_SWR_RECV || idx >= SX__RDMA_STAGE_SLOTS || ss->tc == NULL)
    return; /* a reply went out */
  sx__rdma_sreq q;
  char msg[160];
  int rc = sx__rdma_sreq_parse(sx__rdma_ring_msg(&ss->ring, idx), wc->byte_len, &q, msg, sizeof(msg));
  if (rc == 0 && post_recv(ss, ss->tc->id->qp, idx) != 0) {
    snprintf(msg, sizeof(msg), "ibv_post_recv: %s", strerror(errno));
    rc = SX_ERDMA;
  }
  if (rc != 0) {
    drop(ss, msg);
    return;
  }
  serve(ss, &q);
}

static void poll_cq(void *cq_ctx, void *arg) {
  rdma_sserve *ss = cq_ctx;
  struct ibv_wc wc[16];
  int n;
  (void)arg;
  do {
    n = ibv_poll_cq(ss->cq, 16, wc);
    for (int i = 0; i < n; i++)
      on_wc(ss, &wc[i]);
  } while (n == 16 && ss->tc != NULL);
}

static void on_cq_event(uv_poll_t *h, int status, int events) {
  rdma_sserve *ss = h->data;
  sx_rdma *t = ss->t;
  (void)status;
  (void)events;
  sx__rdma_enter(t);
  sx__rdma_cq_round(t, ss->chan, poll_cq, NULL);
  sx__rdma_leave(t, 1);
}

static void sserve_free(rdma_sserve *ss) {
  for (int i = 0; i < MAX_STREAMS; i++)
    sx__mem_stream_destroy(ss->streams[i]); /* copies still running end first */
  if (ss->notifier != NULL)
    sx__mem_notifier_close(ss->notifier); /* their notices run: inflight drops */
  if (ss->cq != NULL) {
    /* Ack what the channel still holds, or destroying the CQ would wait
     * for those events forever. */
    struct ibv_cq *cq;
    void *ctx;
    while (ibv_get_cq_event(ss->chan, &cq, &ctx) == 0)
      ibv_ack_cq_events(cq, 1);
    ibv_destroy_cq(ss->cq);
  }
  if (ss->poll != NULL)
    uv_close((uv_handle_t *)ss->poll, free_handle);
  if (ss->chan != NULL)
    ibv_destroy_comp_channel(ss->chan);
  sx__rdma_ring_free(&ss->ring);
  free(ss);
}

static int sserve_new(sx_rdma *t, rdma_dev *d, rdma_sserve **out) {
  rdma_sserve *ss = calloc(1, sizeof(*ss));
  size_t ring = (size_t)SX__RDMA_STAGE_SLOTS * SX__RDMA_STAGE_SLOT_BYTES;
  int rc;
  if (ss == NULL)
    return sx__err(SX_ENOMEM, "rdma: out of memory");
  ss->t = t;
  ss->dev = d;
  for (uint32_t i = 0; i < SX__RDMA_STAGE_SLOTS; i++) {
    ss->slots[i].ss = ss;
    ss->slots[i].index = i;
  }
  if ((rc = sx__rdma_ring_alloc(&ss->ring, ring, 2 * SX__RDMA_STAGE_SLOTS)) != 0) {
    free(ss);
    return rc;
  }
  ss->ring.mr = ibv_reg_mr(d->pd, ss->ring.mem, ring,
                           IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
  ss->ring.msg_mr = ibv_reg_mr(d->pd, ss->ring.msgs, ss->ring.msg_bytes, IBV_ACCESS_LOCAL_WRITE);
  if (ss->ring.mr == NULL || ss->ring.msg_mr == NULL) {
    rc = sx__err(SX_ENOMEM, "ibv_reg_mr(%s) of a staging ring: %s", d->name, strerror(errno));
    goto out_free;
  }
  if ((rc = sx__rdma_chan_open(t, d, &ss->chan, &ss->poll, on_cq_event)) != 0)
    goto out_free;
  ss->poll->data = ss;
  uint32_t cqe = 2 * SX__RDMA_STAGE_SLOTS + 2;
  ss->cq = ibv_create_cq(d->verbs, (int)cqe, ss, ss->chan, 0);
  if (ss->cq == NULL || ibv_req_notify_cq(ss->cq, 0) != 0) {
    rc = sx__err(SX_ERDMA, "ibv_create_cq(%s) for a stage QP: %s", d->name, strerror(errno));
    goto out_free;
  }
  /* Without a notifier, GPU copies are synchronous. */
  if (sx__mem_notifier_create(t->base.ctx->loop, &ss->notifier) != 0)
    ss->notifier = NULL;
  *out = ss;
  return 0;

out_free:
  sserve_free(ss);
  return rc;
}

void sx__rdma_sserve_request(sx_rdma *t, struct rdma_cm_id *id, rdma_dev *dev,
                             const sx__rdma_hello *h, unsigned reads) {
  if (t->gpu_tier == SX__RDMA_GPU_OFF) {
    sx__rdma_reject(t, id, SX__RDMA_REJ_NOSTAGE, h->name);
    return;
  }
  rdma_tconn *tc = calloc(1, sizeof(*tc));
  rdma_sserve *ss = NULL;
  if (tc == NULL || sserve_new(t, dev, &ss) != 0) {
    if (tc != NULL)
      sx__rdma_log(t, SX_LOG_ERROR, "stage QP for reader '%s': %s", h->name, sx_errmsg());
    free(tc);
    sx__rdma_reject(t, id, SX__RDMA_REJ_NOMEM, h->name);
    return;
  }
  tc->cm.kind = RDMA_CM_TARGET;
  tc->t = t;
  tc->id = id;
  tc->dev = dev;
  tc->conn_index = h->conn_index;
  tc->ss = ss;
  ss->tc = tc;
  snprintf(tc->reader, sizeof(tc->reader), "%s", h->name);
  id->context = tc;
  struct ibv_qp_init_attr qa;
  memset(&qa, 0, sizeof(qa));
  qa.send_cq = ss->cq;
  qa.recv_cq = ss->cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = SX__RDMA_STAGE_SLOTS + 1;
  qa.cap.max_recv_wr = SX__RDMA_STAGE_SLOTS;
  qa.cap.max_send_sge = 1;
  qa.cap.max_recv_sge = 1;
  if (rdma_create_qp(id, dev->pd, &qa) != 0) {
    sx__rdma_log(t, SX_LOG_ERROR, "rdma_create_qp(%s) for stage reader '%s': %s", dev->name,
                 h->name, strerror(errno));
    goto out_reject;
  }
  for (uint32_t i = 0; i < SX__RDMA_STAGE_SLOTS; i++) {
    if (post_recv(ss, id->qp, i) != 0) {
      sx__rdma_log(t, SX_LOG_ERROR, "ibv_post_recv for stage reader '%s': %s", h->name,
                   strerror(errno));
      rdma_destroy_qp(id);
      goto out_reject;
    }
  }
  if (sx__rdma_accept(t, id, reads) != 0) {
    sx__rdma_log(t, SX_LOG_ERROR, "rdma_accept for stage reader '%s': %s", h->name,
                 strerror(errno));
    rdma_destroy_qp(id);
    goto out_reject;
  }
  sx__rdma_tconn_link(tc);
  sx__rdma_log(t, SX_LOG_DEBUG, "reader '%s' opened a stage QP on %s (%u slots of %u bytes)",
               h->name, dev->name, SX__RDMA_STAGE_SLOTS, SX__RDMA_STAGE_SLOT_BYTES);
  return;

out_reject:
  id->context = &t->listen_cm;
  ss->tc = NULL;
  sserve_free(ss);
  free(tc);
  sx__rdma_reject(t, id, SX__RDMA_REJ_NOMEM, h->name);
}

void sx__rdma_sserve_gone(rdma_tconn *tc) {
  rdma_sserve *ss = tc->ss;
  if (ss == NULL)
    return;
  tc->ss = NULL;
  ss->tc = NULL; /* no more replies */
  if (tc->id->qp != NULL)
    rdma_destroy_qp(tc->id); /* no completion can come any more */
  sserve_free(ss);
}
