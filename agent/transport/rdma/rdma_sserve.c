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
 *
 * Staged writes (push mode) run the other way on a producer's stage QP,
 * authorized as any producer (rdma_wserve.c) and living in the write PD:
 * a write request (WREQ) names the producer's filled slot and the ranges
 * of our regions its bytes go to; each range is checked as a TCP WRITE is
 * (the grant still covers the producer, region known and not withdrawn,
 * remote writes allowed, bounds), then this side RDMA-READs the producer's
 * slot into its own and scatters it with one gather (GPU destinations) or
 * memcpy, and replies once that copy finished.  Nothing lands before every
 * range of the request passed, and the ring itself is never remotely
 * accessible.  Revocation destroys the QP and waits for the copies already
 * queued (sx__rdma_sserve_gone), so nothing of the producer lands after
 * sx_agent_revoke_write returns.
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
  int reading; /* staged writes: the READ of the producer's slot is out */
  /* Staged writes: where the slot's bytes go, once the READ of the
   * producer's slot completed. */
  sx__mem_range rg[SX__RDMA_STAGE_MAX_RANGES];
  int device, sm_ok;
} tslot;

struct rdma_sserve {
  rdma_tconn *tc; /* NULL once gone */
  sx_rdma *t;
  int write; /* a producer's stage QP: WREQs, READs of its slots */
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
  sx__rdma_wr_send(&wr, &sge, SX__RDMA_SWR(SX__RDMA_SWR_SEND, sl->index));
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
  if (ss->write && ctx->written != NULL && status != SX_EDISCONN)
    ctx->written(ctx->agent, SX_TRANSPORT_RDMA, status == 0 ? sl->bytes : 0, status);
  else if (!ss->write && ctx->served != NULL)
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

/* Check the ranges of q against our regions as a TCP read (write) is
 * checked: known and not withdrawn, remote reads (a producer's stage QP:
 * writes) allowed, in bounds.  Each range that passes is taken: rg[i]
 * between it and the slot (into the slot for reads, out of it for
 * writes), its region's inflight held (slot_end gives it back), *device
 * the regions' GPU (-1: host memory only) and *sm_ok whether every range
 * is device memory of it.  0, or the first refusal (nothing copied). */
static int take_ranges(rdma_sserve *ss, tslot *sl, const sx__rdma_sreq *q, sx__mem_range *rg,
                       int *device, int *sm_ok) {
  const sx_tctx *ctx = ss->t->base.ctx;
  uint32_t access = ss->write ? SX_ACCESS_REMOTE_WRITE : SX_ACCESS_REMOTE_READ;
  *device = -1;
  *sm_ok = 1;
  for (uint16_t i = 0; i < q->n; i++) {
    const sx__rdma_srange *r = &q->r[i];
    sx_lregion *l = ctx->find_region(ctx->agent, r->region);
    uint64_t end;
    int st = 0;
    if (l == NULL)
      st = SX_ENOREGION;
    else if (!(l->r.access & access))
      st = SX_EDENIED;
    else if (!sx__add_ok(r->off, r->len, &end) || end > l->r.length)
      st = SX_EBOUNDS;
    if (st != 0) {
      sx__rdma_log(ss->t, SX_LOG_DEBUG, "refused to stage %s region %u offset %llu length %u "
                   "for '%s': %s", ss->write ? "a write into" : "a read of", r->region,
                   (unsigned long long)r->off, r->len,
                   ss->write ? ss->tc->producer : ss->tc->reader, sx_err_name(st));
      return st;
    }
    uint64_t reg = l->r.addr + r->off;
    uint64_t ring = (uint64_t)(uintptr_t)(sx__rdma_ring_slot(&ss->ring, sl->index) + sl->bytes);
    rg[i].dst = ss->write ? reg : ring;
    rg[i].src = ss->write ? ring : reg;
    rg[i].len = r->len;
    sl->bytes += r->len;
    sx__rdma_ring_side(l, device, sm_ok);
    sl->regs[sl->n++] = l;
    l->inflight++;
  }
  return 0;
}

/* Copy rg[0..n) between the ring and the regions (one gather on a stream
 * of device where a GPU is involved, device < 0: host memory only), then
 * end the slot: from the stream's notice, or here when copied here. */
static void slot_copy(rdma_sserve *ss, tslot *sl, const sx__mem_range *rg, size_t n,
                      int device, int sm_ok) {
  int st = 0;
  if (device >= 0 && device < MAX_STREAMS && ss->notifier != NULL) {
    if (ss->streams[device] == NULL &&
        sx__mem_stream_create(device, &ss->streams[device]) != 0)
      ss->streams[device] = NULL;
    sx__mem_stream *s = ss->streams[device];
    if (s != NULL && sx__rdma_ring_gather(ss->t, &ss->ring, s, rg, n, sm_ok, 1) == 0) {
      sl->note.fn = on_copied;
      if (sx__mem_notify(s, ss->notifier, &sl->note) == 0)
        return;
      st = sx__mem_stream_sync(s);
      slot_end(sl, st);
      return;
    }
  }
  /* Host memory, or no stream: copy here (unified addressing). */
  slot_end(sl, sx__rdma_ring_copy_sync(rg, n, device >= 0));
}

/* The slot q names, taken for q; NULL (the connection dropped for why)
 * while an earlier request still holds it. */
static tslot *claim(rdma_sserve *ss, const sx__rdma_sreq *q, const char *why) {
  tslot *sl = &ss->slots[q->slot];
  if (sl->busy) {
    drop(ss, why);
    return NULL;
  }
  sl->busy = 1;
  sl->seq = q->seq;
  sl->bytes = 0;
  sl->n = 0;
  return sl;
}

/* A producer's write request: check every range (nothing lands unless all
 * pass), then READ the producer's slot into ours; the scatter follows its
 * completion (on_read). */
static void serve_write(rdma_sserve *ss, const sx__rdma_sreq *q) {
  const sx_tctx *ctx = ss->t->base.ctx;
  rdma_tconn *tc = ss->tc;
  tslot *sl = claim(ss, q, "a write request for a slot that is still being copied");
  int st = 0;
  if (sl == NULL)
    return;
  /* The grant now, not only at connect time: a revoke destroys this QP,
   * but a request that arrived before must not land either. */
  if (ctx->write_granted == NULL || ctx->write_granted(ctx->agent, tc->producer, tc->pinc) != 0)
    st = SX_EACCESS;
  else
    st = take_ranges(ss, sl, q, sl->rg, &sl->device, &sl->sm_ok);
  if (st == 0 && sl->bytes != q->src.bytes)
    st = SX_EPROTO; /* the parser checked it; cheap to keep honest */
  if (st == SX_EACCESS)
    sx__rdma_log(ss->t, SX_LOG_INFO, "refused a staged write from %s: no write grant covers "
                 "it any more", tc->producer);
  if (st != 0) {
    slot_end(sl, st);
    return;
  }
  struct ibv_sge sge = {.addr = (uintptr_t)sx__rdma_ring_slot(&ss->ring, sl->index),
                        .length = sl->bytes, .lkey = ss->ring.mr->lkey};
  struct ibv_send_wr wr, *bad = NULL;
  sx__rdma_wr_read(&wr, &sge, SX__RDMA_SWR(SX__RDMA_SWR_READ, sl->index), q->src.addr,
                   q->src.rkey);
  sl->reading = 1;
  if (ibv_post_send(tc->id->qp, &wr, &bad) != 0) {
    char why[96];
    sl->reading = 0;
    snprintf(why, sizeof(why), "ibv_post_send of a READ of its slot: %s", strerror(errno));
    slot_end(sl, SX_ERDMA);
    drop(ss, why);
  }
}

/* The READ of a producer's slot completed (status 0) or failed. */
static void on_read(rdma_sserve *ss, tslot *sl, enum ibv_wc_status status) {
  if (!sl->busy || !sl->reading)
    return;
  sl->reading = 0;
  if (status == IBV_WC_SUCCESS) {
    slot_copy(ss, sl, sl->rg, sl->n, sl->device, sl->sm_ok);
    return;
  }
  slot_end(sl, status == IBV_WC_WR_FLUSH_ERR ? SX_EDISCONN : sx__rdma_wc_code(status));
  if (status != IBV_WC_WR_FLUSH_ERR) {
    char why[128];
    snprintf(why, sizeof(why), "a READ of its slot failed: %s", ibv_wc_status_str(status));
    drop(ss, why);
  }
}

/* Check the ranges of q and copy them into their slot. */
static void serve(rdma_sserve *ss, const sx__rdma_sreq *q) {
  tslot *sl = claim(ss, q, "a request for a slot that is still being filled");
  sx__mem_range rg[SX__RDMA_STAGE_MAX_RANGES];
  int device, sm_ok;
  if (sl == NULL)
    return;
  int st = take_ranges(ss, sl, q, rg, &device, &sm_ok);
  if (st != 0) {
    slot_end(sl, st);
    return;
  }
  slot_copy(ss, sl, rg, q->n, device, sm_ok);
}

static void on_wc(rdma_sserve *ss, const struct ibv_wc *wc) {
  uint32_t kind = (uint32_t)(wc->wr_id >> 16) & 0xffu;
  uint32_t idx = (uint32_t)wc->wr_id & 0xffffu;
  if (kind == SX__RDMA_SWR_READ) {
    if (ss->write && idx < SX__RDMA_STAGE_SLOTS)
      on_read(ss, &ss->slots[idx], wc->status);
    return;
  }
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
  int rc = sx__rdma_sreq_parse(sx__rdma_ring_msg(&ss->ring, idx), wc->byte_len, ss->write, &q,
                               msg, sizeof(msg));
  if (rc == 0 && post_recv(ss, ss->tc->id->qp, idx) != 0) {
    snprintf(msg, sizeof(msg), "ibv_post_recv: %s", strerror(errno));
    rc = SX_ERDMA;
  }
  if (rc != 0) {
    drop(ss, msg);
    return;
  }
  if (ss->write)
    serve_write(ss, &q);
  else
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
  /* Staged writes whose READ never completed (the QP went first): nothing
   * of them landed; give their regions back. */
  for (uint32_t i = 0; i < SX__RDMA_STAGE_SLOTS; i++) {
    if (ss->slots[i].busy && ss->slots[i].reading) {
      ss->slots[i].reading = 0;
      slot_end(&ss->slots[i], SX_EDISCONN);
    }
  }
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

/* A ring and a CQ for a stage QP on d: a reader's (the ring remotely
 * readable, in the device's PD) or a producer's (write: the ring local
 * only, in the write PD, where the producer's QP lives). */
static int sserve_new(sx_rdma *t, rdma_dev *d, int write, rdma_sserve **out) {
  rdma_sserve *ss = calloc(1, sizeof(*ss));
  size_t ring = (size_t)SX__RDMA_STAGE_SLOTS * SX__RDMA_STAGE_SLOT_BYTES;
  int rc;
  if (ss == NULL)
    return sx__err(SX_ENOMEM, "rdma: out of memory");
  ss->t = t;
  ss->dev = d;
  ss->write = write;
  struct ibv_pd *pd = d->pd;
  if (write) {
    if ((rc = sx__rdma_wpd_get(d)) != 0) {
      free(ss);
      return rc;
    }
    pd = d->wpd;
  }
  for (uint32_t i = 0; i < SX__RDMA_STAGE_SLOTS; i++) {
    ss->slots[i].ss = ss;
    ss->slots[i].index = i;
  }
  if ((rc = sx__rdma_ring_alloc_near(t, d, &ss->ring, ring, 2 * SX__RDMA_STAGE_SLOTS)) != 0) {
    free(ss);
    return rc;
  }
  ss->ring.mr = ibv_reg_mr(pd, ss->ring.mem, ring,
                           IBV_ACCESS_LOCAL_WRITE | (write ? 0 : IBV_ACCESS_REMOTE_READ));
  ss->ring.msg_mr = ibv_reg_mr(pd, ss->ring.msgs, ss->ring.msg_bytes, IBV_ACCESS_LOCAL_WRITE);
  if (ss->ring.mr == NULL || ss->ring.msg_mr == NULL) {
    rc = sx__err(SX_ENOMEM, "ibv_reg_mr(%s) of a staging ring: %s", d->name, strerror(errno));
    goto out_free;
  }
  if ((rc = sx__rdma_chan_open(t, d, &ss->chan, &ss->poll, on_cq_event)) != 0)
    goto out_free;
  ss->poll->data = ss;
  uint32_t cqe = 3 * SX__RDMA_STAGE_SLOTS + 2; /* receives, replies, READs (writes) */
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

/* The QP of tc's stage ring ss, its receives, and the accept.  0, or an
 * error with the QP gone again (ss stays for the caller to free). */
static int sserve_accept(rdma_tconn *tc, rdma_sserve *ss, unsigned reads, unsigned depth) {
  sx_rdma *t = tc->t;
  rdma_dev *dev = tc->dev;
  struct rdma_cm_id *id = tc->id;
  const char *who = ss->write ? tc->producer : tc->reader;
  struct ibv_qp_init_attr qa;
  memset(&qa, 0, sizeof(qa));
  qa.send_cq = ss->cq;
  qa.recv_cq = ss->cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = (ss->write ? 2 : 1) * SX__RDMA_STAGE_SLOTS + 1;
  qa.cap.max_recv_wr = SX__RDMA_STAGE_SLOTS;
  qa.cap.max_send_sge = 1;
  qa.cap.max_recv_sge = 1;
  if (rdma_create_qp(id, ss->write ? dev->wpd : dev->pd, &qa) != 0)
    return sx__err(SX_ERDMA, "rdma_create_qp(%s) for the stage QP of '%s': %s", dev->name, who,
                   strerror(errno));
  for (uint32_t i = 0; i < SX__RDMA_STAGE_SLOTS; i++) {
    if (post_recv(ss, id->qp, i) != 0) {
      int rc = sx__err(SX_ERDMA, "ibv_post_recv for the stage QP of '%s': %s", who,
                       strerror(errno));
      rdma_destroy_qp(id);
      return rc;
    }
  }
  if (sx__rdma_accept(t, id, reads, depth) != 0) {
    int rc = sx__err(SX_ERDMA, "rdma_accept for the stage QP of '%s': %s", who,
                     strerror(errno));
    rdma_destroy_qp(id);
    return rc;
  }
  tc->ss = ss;
  ss->tc = tc;
  /* A producer's QPs are logged at info, as producer_accept does. */
  sx__rdma_log(t, ss->write ? SX_LOG_INFO : SX_LOG_DEBUG,
               "%s '%s' opened a stage QP on %s (%u slots of %u bytes)",
               ss->write ? "producer" : "reader", who, dev->name, SX__RDMA_STAGE_SLOTS,
               SX__RDMA_STAGE_SLOT_BYTES);
  return 0;
}

void sx__rdma_sserve_request(sx_rdma *t, struct rdma_cm_id *id, rdma_dev *dev,
                             const sx__rdma_hello *h, unsigned reads) {
  if (t->gpu_tier == SX__RDMA_GPU_OFF) {
    sx__rdma_reject(t, id, SX__RDMA_REJ_NOSTAGE, h->name);
    return;
  }
  rdma_tconn *tc = calloc(1, sizeof(*tc));
  rdma_sserve *ss = NULL;
  if (tc == NULL || sserve_new(t, dev, 0, &ss) != 0) {
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
  snprintf(tc->reader, sizeof(tc->reader), "%s", h->name);
  id->context = tc;
  if (sserve_accept(tc, ss, reads, 0) != 0) {
    sx__rdma_log(t, SX_LOG_ERROR, "%s", sx_errmsg());
    id->context = &t->listen_cm;
    sserve_free(ss);
    free(tc);
    sx__rdma_reject(t, id, SX__RDMA_REJ_NOMEM, h->name);
    return;
  }
  sx__rdma_tconn_link(tc);
}

int sx__rdma_sserve_waccept(rdma_tconn *tc, unsigned depth) {
  sx_rdma *t = tc->t;
  rdma_sserve *ss = NULL;
  int rc;
  if (t->gpu_tier == SX__RDMA_GPU_OFF)
    return sx__err(SX_ENOTSUP, "staged writes of GPU memory over RDMA are off here "
                   "(SX_RDMA_GPU=off)");
  if (depth == 0)
    return sx__err(SX_EPROTO, "producer %s offers its stage QP without RDMA READs",
                   tc->producer);
  if (depth > (unsigned)tc->dev->attr.max_qp_init_rd_atom)
    depth = (unsigned)tc->dev->attr.max_qp_init_rd_atom;
  if ((rc = sserve_new(t, tc->dev, 1, &ss)) != 0)
    return rc;
  if ((rc = sserve_accept(tc, ss, 0, depth)) != 0) {
    sserve_free(ss);
    return rc;
  }
  tc->qpn = tc->id->qp->qp_num; /* revocation looks for it */
  return 0;
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
