/*
 * Staged RDMA, reader side (rdma_stage.h says how a slot lives).
 *
 * A reader's peer gets a stage peer on the first batch that needs it: one
 * more rdma_peer with a single QP (conns[0]), connected, torn down and
 * reconnected by rdma_cm.c like any other, but whose hello says "stage"
 * and whose send queue carries this file's SENDs and READs (wr_ids tagged
 * SX__RDMA_WR_STAGE) instead of rdma_post.c's slices.  The peer also holds
 * the reader's ring of slots (pinned host memory, registered on the QP's
 * device), the receive buffers for replies, and streams for the copies
 * into GPU destinations.
 *
 * Nothing RDMA does lands in a destination: READs land in the reader's
 * ring, and only the copy out of it (after the READ completed) writes the
 * destination.  So abort settles a piece at once unless that copy runs;
 * then it settles when the copy finished.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rdma_int.h"

#define MAX_STREAMS 16 /* devices with a stream of their own; others copy synchronously */

/* One piece of an xfer in a slot. */
typedef struct sent {
  rdma_srop *srop; /* NULL once settled without it (abort) */
  uint32_t xi;
  uint32_t len;
  uint64_t off;      /* in the xfer */
  uint32_t ring_off; /* in the slot */
} sent;

enum { SL_FREE = 0, SL_REQ, SL_READ, SL_COPY };

typedef struct sslot {
  rdma_sreader *r;
  uint32_t index;
  int state;
  int direct;      /* READs of the remote region itself, no request */
  uint32_t seq;
  uint32_t n, bytes;
  uint32_t wrs;    /* READs of this slot not completed (the request's SEND
                    * is not counted: the reply says it arrived) */
  int status;      /* first error of the slot's work requests */
  char msg[200];
  sent ent[SX__RDMA_STAGE_MAX_RANGES];
  sx__mem_notice note;
} sslot;

struct rdma_sreader {
  rdma_peer *sp;
  uint8_t *ring; /* SX__RDMA_STAGE_SLOTS x SX__RDMA_STAGE_SLOT_BYTES */
  int ring_pinned;
  struct ibv_mr *ring_mr;
  uint8_t *msgs; /* SLOTS request buffers, then SLOTS reply buffers */
  struct ibv_mr *msg_mr;
  rdma_dev *mr_dev; /* the device both MRs belong to */
  sslot slots[SX__RDMA_STAGE_SLOTS];
  uint32_t seq;
  sx__mem_stream *streams[MAX_STREAMS];
  sx__mem_notifier *notifier;
  rdma_srop *qhead, *qtail; /* ops with pieces to issue */
  rdma_srop *live;          /* every op not fully settled */
};

typedef struct sxs {
  uint32_t inflight; /* pieces in slots */
  int status;
  int final;
  uint8_t issued, settled;
} sxs;

struct rdma_srop {
  sx_op *op;
  rdma_sreader *r; /* NULL once the stage peer is gone */
  sx_rdma *t;
  sxs *xs;
  uint32_t *dq;
  size_t dq_r, dq_w, delivered;
  size_t next_xi;
  uint64_t next_off;
  uint32_t refs; /* pieces in slots that name it */
  int error, aborting, abort_status, queued, in_dlist, done;
  char msg[256];
  rdma_srop *qnext, *lprev, *lnext, *dnext;
};

static uint8_t *slot_mem(rdma_sreader *r, uint32_t i) {
  return r->ring + (size_t)i * SX__RDMA_STAGE_SLOT_BYTES;
}

static uint8_t *req_buf(rdma_sreader *r, uint32_t i) {
  return r->msgs + (size_t)i * SX__RDMA_SMSG_BYTES;
}

static uint8_t *reply_buf(rdma_sreader *r, uint32_t i) {
  return r->msgs + (size_t)(SX__RDMA_STAGE_SLOTS + i) * SX__RDMA_SMSG_BYTES;
}

/* Remote range that only the target's ring can serve: GPU memory without
 * an rkey for the endpoint this peer uses. */
static int remote_staged(const rdma_peer *p, const sx_region *rr) {
  return strncmp(rr->location, "cuda:", 5) == 0 &&
         (rr->n_rkeys <= p->rkey_index || rr->rkeys[p->rkey_index] == 0);
}

static int local_staged(const rdma_peer *p, const sx_lregion *l) {
  const rdma_mr *rm = l->tpriv[SX_TRANSPORT_RDMA];
  return l->mem.kind == SX__MEM_CUDA && (rm == NULL || rm->mr[p->lep->dev->index] == NULL);
}

int sx__rdma_gpu_usable(sx_rdma *t, const sx_desc *remote) {
  const sx_tctx *ctx = t->base.ctx;
  int rgpu = 0, rgpu_w = 0, rw = 0, lgpu = 0;
  for (uint32_t i = 0; i < remote->n_regions; i++) {
    const sx_region *r = &remote->regions[i];
    int gpu = strncmp(r->location, "cuda:", 5) == 0;
    int w = (r->access & SX_ACCESS_REMOTE_WRITE) != 0;
    rgpu |= gpu;
    rw |= w;
    rgpu_w |= gpu && w && r->n_wkeys == 0;
  }
  for (uint32_t i = 0; ctx->region_at != NULL; i++) {
    const sx_lregion *l = ctx->region_at(ctx->agent, i);
    if (l == NULL)
      break;
    lgpu |= l->mem.kind == SX__MEM_CUDA && !l->withdrawn;
  }
  if (!rgpu && !lgpu)
    return 1;
  if (t->gpu_tier == SX__RDMA_GPU_OFF)
    return 0;
  /* Writes into GPU memory without a write key, or out of ours, are not
   * staged over RDMA: such segments go over TCP or cuda_ipc. */
  return !rgpu_w && !(lgpu && rw);
}

int sx__rdma_s_wanted(const rdma_peer *p, const sx_op *op) {
  if (p->write || p->t->gpu_tier == SX__RDMA_GPU_OFF)
    return 0;
  for (size_t i = 0; i < op->n; i++) {
    const sx_xfer *x = &op->xfers[i];
    if ((x->rreg != NULL && remote_staged(p, x->rreg)) ||
        (x->lreg != NULL && local_staged(p, x->lreg)))
      return 1;
  }
  return 0;
}

/* ------------------------------------------------------------------ settling */

static void srop_unlink(rdma_srop *s) {
  rdma_sreader *r = s->r;
  if (r == NULL)
    return;
  if (s->lprev != NULL)
    s->lprev->lnext = s->lnext;
  else
    r->live = s->lnext;
  if (s->lnext != NULL)
    s->lnext->lprev = s->lprev;
  s->lprev = s->lnext = NULL;
}

static void srop_put(rdma_srop *s) {
  if (s->done && s->refs == 0 && !s->in_dlist)
    free(s);
}

static void settle(rdma_srop *s, size_t xi, int status) {
  sx_rdma *t = s->t;
  s->xs[xi].settled = 1;
  s->xs[xi].final = status;
  s->dq[s->dq_w++] = (uint32_t)xi;
  if (!s->in_dlist) {
    s->in_dlist = 1;
    s->dnext = NULL;
    if (t->sdtail != NULL)
      t->sdtail->dnext = s;
    else
      t->sdhead = s;
    t->sdtail = s;
  }
}

static void xfer_check(rdma_srop *s, size_t xi) {
  sxs *xs = &s->xs[xi];
  if (xs->settled || xs->inflight != 0)
    return;
  int stopping = s->error != 0 || s->aborting || s->r == NULL;
  if (!xs->issued && !stopping)
    return;
  int st;
  if (xs->status != 0)
    st = xs->status;
  else if (xs->issued)
    st = 0;
  else if (s->aborting)
    st = s->abort_status;
  else
    st = s->error != 0 ? s->error : SX_ECANCELED;
  settle(s, xi, st);
}

static void dequeue(rdma_srop *s) {
  rdma_sreader *r = s->r;
  if (!s->queued || r == NULL)
    return;
  s->queued = 0;
  rdma_srop **pp = &r->qhead;
  rdma_srop *prev = NULL;
  while (*pp != NULL && *pp != s) {
    prev = *pp;
    pp = &(*pp)->qnext;
  }
  if (*pp == s) {
    *pp = s->qnext;
    if (r->qtail == s)
      r->qtail = prev;
  }
  s->qnext = NULL;
}

/* Stop issuing: what is in no slot settles now. */
static void give_up(rdma_srop *s) {
  dequeue(s);
  for (size_t i = 0; i < s->op->n; i++)
    xfer_check(s, i);
}

static void srop_fail(rdma_srop *s, size_t xi, int status, const char *msg) {
  if (s->xs[xi].status == 0)
    s->xs[xi].status = status;
  if (s->error != 0 || s->aborting)
    return;
  s->error = status;
  snprintf(s->msg, sizeof(s->msg), "%s", msg != NULL && msg[0] ? msg : sx_strerror(status));
  give_up(s);
}

void sx__rdma_s_deliver(sx_rdma *t) {
  rdma_srop *s;
  while ((s = t->sdhead) != NULL) {
    if (s->dq_r == s->dq_w) {
      t->sdhead = s->dnext;
      if (t->sdhead == NULL)
        t->sdtail = NULL;
      s->in_dlist = 0;
      s->dnext = NULL;
      srop_put(s);
      continue;
    }
    size_t xi = s->dq[s->dq_r++];
    int st = s->xs[xi].final;
    sx_op *op = s->op;
    const char *msg = (st != 0 && st == s->error) ? s->msg : NULL;
    if (s->delivered + 1 == op->n) {
      /* The last one: op->done may free op, so s lets go of it first. */
      char buf[sizeof(s->msg)];
      snprintf(buf, sizeof(buf), "%s", msg != NULL ? msg : "");
      t->sdhead = s->dnext;
      if (t->sdhead == NULL)
        t->sdtail = NULL;
      s->in_dlist = 0;
      s->done = 1;
      srop_unlink(s);
      s->op = NULL;
      srop_put(s);
      sx__op_xfer_done(op, xi, st, msg != NULL ? buf : NULL);
    } else {
      s->delivered++;
      sx__op_xfer_done(op, xi, st, msg);
    }
  }
}

/* ------------------------------------------------------------------ slots */

/* A piece is done (status 0: its bytes are in the destination). */
static void piece_done(sent *e, int status, const char *msg) {
  rdma_srop *s = e->srop;
  if (s == NULL)
    return;
  e->srop = NULL;
  s->xs[e->xi].inflight--;
  s->refs--;
  if (status != 0 && !s->aborting)
    srop_fail(s, e->xi, status, msg);
  if (s->op != NULL)
    xfer_check(s, e->xi);
  srop_put(s);
}

static void slot_release(sslot *sl, int status, const char *msg) {
  for (uint32_t i = 0; i < sl->n; i++)
    piece_done(&sl->ent[i], status, msg);
  sl->n = 0;
  sl->bytes = 0;
  sl->wrs = 0;
  sl->status = 0;
  sl->state = SL_FREE;
  if (sl->r->sp != NULL)
    sl->r->sp->wants_pump = 1;
}

static void on_copied(sx__mem_notice *n) {
  sslot *sl = (sslot *)((char *)n - offsetof(sslot, note));
  sx_rdma *t = sl->r->sp->t;
  sx__rdma_enter(t);
  slot_release(sl, 0, NULL);
  sx__rdma_s_pump(sl->r->sp);
  sx__rdma_leave(t, 1);
}

static sx__mem_stream *stream_of(rdma_sreader *r, int device) {
  if (device < 0 || device >= MAX_STREAMS)
    return NULL;
  if (r->streams[device] == NULL && sx__mem_stream_create(device, &r->streams[device]) != 0)
    r->streams[device] = NULL;
  return r->streams[device];
}

/* The slot's bytes are here: copy each live piece to its destination. */
static void slot_scatter(sslot *sl) {
  rdma_sreader *r = sl->r;
  uint64_t dst[SX__RDMA_STAGE_MAX_RANGES], src[SX__RDMA_STAGE_MAX_RANGES];
  size_t len[SX__RDMA_STAGE_MAX_RANGES];
  size_t n = 0;
  int device = -1;
  for (uint32_t i = 0; i < sl->n; i++) {
    sent *e = &sl->ent[i];
    rdma_srop *s = e->srop;
    if (s == NULL || s->aborting || s->error != 0 || s->op == NULL)
      continue; /* settled already: its destination is not ours any more */
    const sx_xfer *x = &s->op->xfers[e->xi];
    dst[n] = (uint64_t)(uintptr_t)(x->local + e->off);
    src[n] = (uint64_t)(uintptr_t)(slot_mem(r, sl->index) + e->ring_off);
    len[n] = e->len;
    if (device < 0 && x->lreg != NULL && x->lreg->mem.kind == SX__MEM_CUDA)
      device = x->lreg->mem.device;
    n++;
  }
  if (device >= 0) {
    sx__mem_stream *st = stream_of(r, device);
    if (st != NULL && r->notifier != NULL &&
        sx__mem_copy_batch_async(st, dst, src, len, n) == 0) {
      sl->note.fn = on_copied;
      if (sx__mem_notify(st, r->notifier, &sl->note) == 0) {
        sl->state = SL_COPY;
        return;
      }
      /* The copies were queued but no notice will say when they end. */
      sx__mem_stream_sync(st);
      slot_release(sl, 0, NULL);
      return;
    }
    /* No stream: copy synchronously (unified addressing). */
    for (size_t i = 0; i < n; i++) {
      int rc = sx__mem_copy((void *)(uintptr_t)dst[i], (const void *)(uintptr_t)src[i], len[i]);
      if (rc) {
        slot_release(sl, rc, sx_errmsg());
        return;
      }
    }
  } else {
    for (size_t i = 0; i < n; i++)
      memcpy((void *)(uintptr_t)dst[i], (const void *)(uintptr_t)src[i], len[i]);
  }
  slot_release(sl, 0, NULL);
}

static int post_wrs(rdma_conn *c, struct ibv_send_wr *wrs, uint32_t n, sslot *sl,
                    const char *what) {
  struct ibv_send_wr *bad = NULL;
  int rc = ibv_post_send(c->qp, wrs, &bad);
  if (rc == 0)
    return 0;
  uint32_t posted = (bad != NULL && bad >= wrs && bad < wrs + n) ? (uint32_t)(bad - wrs) : 0;
  snprintf(sl->msg, sizeof(sl->msg), "ibv_post_send of a stage %s to '%.64s': %s", what,
           c->p->name, strerror(rc > 0 ? rc : errno));
  sl->status = SX_ERDMA;
  sl->wrs += posted;
  sx__rdma_conn_teardown(c, SX_ERDMA, 0, "%s", sl->msg);
  if (sl->wrs == 0)
    slot_release(sl, SX_ERDMA, sl->msg);
  return SX_ERDMA;
}

/* READs of the remote regions themselves into the slot. */
static void post_direct(rdma_conn *c, sslot *sl) {
  rdma_sreader *r = sl->r;
  rdma_peer *p = c->p;
  struct ibv_send_wr wrs[SX__RDMA_STAGE_MAX_RANGES];
  struct ibv_sge sges[SX__RDMA_STAGE_MAX_RANGES];
  for (uint32_t i = 0; i < sl->n; i++) {
    const sent *e = &sl->ent[i];
    const sx_xfer *x = &e->srop->op->xfers[e->xi];
    sges[i].addr = (uintptr_t)(slot_mem(r, sl->index) + e->ring_off);
    sges[i].length = e->len;
    sges[i].lkey = r->ring_mr->lkey;
    memset(&wrs[i], 0, sizeof(wrs[i]));
    wrs[i].wr_id = SX__RDMA_SWR(SX__RDMA_SWR_READ, sl->index);
    wrs[i].next = i + 1 < sl->n ? &wrs[i + 1] : NULL;
    wrs[i].sg_list = &sges[i];
    wrs[i].num_sge = 1;
    wrs[i].opcode = IBV_WR_RDMA_READ;
    wrs[i].send_flags = IBV_SEND_SIGNALED;
    wrs[i].wr.rdma.remote_addr = x->rreg->addr + x->roff + e->off;
    wrs[i].wr.rdma.rkey = x->rreg->rkeys[p->rkey_index];
  }
  sl->state = SL_READ;
  if (post_wrs(c, wrs, sl->n, sl, "READ") == 0) {
    sl->wrs = sl->n;
    p->t->stats.posts++;
    p->t->stats.wrs += sl->n;
  }
}

static void post_request(rdma_conn *c, sslot *sl) {
  rdma_sreader *r = sl->r;
  sx__rdma_sreq q;
  q.slot = (uint8_t)sl->index;
  q.seq = sl->seq = ++r->seq;
  q.n = (uint16_t)sl->n;
  for (uint32_t i = 0; i < sl->n; i++) {
    const sent *e = &sl->ent[i];
    const sx_xfer *x = &e->srop->op->xfers[e->xi];
    q.r[i].region = x->rreg->id;
    q.r[i].off = x->roff + e->off;
    q.r[i].len = e->len;
  }
  size_t len = sx__rdma_sreq_pack(req_buf(r, sl->index), &q);
  struct ibv_sge sge = {.addr = (uintptr_t)req_buf(r, sl->index), .length = (uint32_t)len,
                        .lkey = r->msg_mr->lkey};
  struct ibv_send_wr wr;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = SX__RDMA_SWR(SX__RDMA_SWR_SEND, sl->index);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  sl->state = SL_REQ;
  post_wrs(c, &wr, 1, sl, "request");
}

/* Fill a free slot from the queue: pieces of one kind (direct or staged,
 * and staged ones from one remote location), at most a slot's bytes. */
static void slot_fill(rdma_conn *c, sslot *sl) {
  rdma_sreader *r = sl->r;
  const rdma_peer *p = c->p;
  const char *loc = NULL;
  sl->n = 0;
  sl->bytes = 0;
  sl->status = 0;
  sl->msg[0] = '\0';
  sl->direct = -1;
  while (r->qhead != NULL && sl->n < SX__RDMA_STAGE_MAX_RANGES &&
         sl->bytes < SX__RDMA_STAGE_SLOT_BYTES) {
    rdma_srop *s = r->qhead;
    const sx_xfer *x = &s->op->xfers[s->next_xi];
    int direct = !remote_staged(p, x->rreg);
    if (sl->direct < 0)
      sl->direct = direct;
    else if (sl->direct != direct || (!direct && strcmp(loc, x->rreg->location) != 0))
      break;
    loc = x->rreg->location;
    uint64_t rem = x->length - s->next_off;
    uint32_t room = SX__RDMA_STAGE_SLOT_BYTES - sl->bytes;
    uint32_t len = rem < room ? (uint32_t)rem : room;
    sent *e = &sl->ent[sl->n++];
    e->srop = s;
    e->xi = (uint32_t)s->next_xi;
    e->off = s->next_off;
    e->len = len;
    e->ring_off = sl->bytes;
    s->xs[s->next_xi].inflight++;
    s->refs++;
    sl->bytes += len;
    s->next_off += len;
    if (s->next_off == x->length) {
      s->xs[s->next_xi].issued = 1;
      s->next_xi++;
      s->next_off = 0;
      /* Empty ranges have nothing to stage: they are done when issued. */
      while (s->next_xi < s->op->n && s->op->xfers[s->next_xi].length == 0) {
        s->xs[s->next_xi].issued = 1;
        xfer_check(s, s->next_xi);
        s->next_xi++;
      }
      if (s->next_xi == s->op->n)
        dequeue(s);
    }
  }
  if (sl->n == 0)
    return;
  if (sl->direct)
    post_direct(c, sl);
  else
    post_request(c, sl);
}

void sx__rdma_s_pump(rdma_peer *sp) {
  rdma_sreader *r = sp->sr;
  if (sp->closing || r == NULL || r->qhead == NULL)
    return;
  rdma_conn *c = &sp->conns[0];
  if (c->state != RC_UP) {
    if (c->state == RC_IDLE) {
      int rc = sx__rdma_conn_start(c);
      if (rc)
        sx__rdma_s_fail_queue(sp, rc, sx_errmsg());
    }
    return;
  }
  for (uint32_t i = 0; i < SX__RDMA_STAGE_SLOTS && r->qhead != NULL && c->state == RC_UP; i++)
    if (r->slots[i].state == SL_FREE)
      slot_fill(c, &r->slots[i]);
}

/* ------------------------------------------------------------------ the QP */

static int post_recv(rdma_conn *c, uint32_t i) {
  rdma_sreader *r = c->p->sr;
  struct ibv_sge sge = {.addr = (uintptr_t)reply_buf(r, i), .length = SX__RDMA_SMSG_BYTES,
                        .lkey = r->msg_mr->lkey};
  struct ibv_recv_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = SX__RDMA_SWR(SX__RDMA_SWR_RECV, i);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  return ibv_post_recv(c->qp, &wr, &bad);
}

int sx__rdma_s_qp_ready(rdma_conn *c) {
  rdma_sreader *r = c->p->sr;
  rdma_dev *d = c->dev;
  if (r == NULL)
    return sx__err(SX_EINVAL, "rdma: a stage QP without its rings");
  if (r->mr_dev != d) {
    if (r->ring_mr != NULL)
      ibv_dereg_mr(r->ring_mr);
    if (r->msg_mr != NULL)
      ibv_dereg_mr(r->msg_mr);
    r->ring_mr = r->msg_mr = NULL;
    r->mr_dev = NULL;
    r->ring_mr = ibv_reg_mr(d->pd, r->ring,
                            (size_t)SX__RDMA_STAGE_SLOTS * SX__RDMA_STAGE_SLOT_BYTES,
                            IBV_ACCESS_LOCAL_WRITE);
    r->msg_mr = ibv_reg_mr(d->pd, r->msgs, 2 * SX__RDMA_STAGE_SLOTS * SX__RDMA_SMSG_BYTES,
                           IBV_ACCESS_LOCAL_WRITE);
    if (r->ring_mr == NULL || r->msg_mr == NULL)
      return sx__err(SX_ENOMEM, "ibv_reg_mr(%s) of the staging ring: %s", d->name,
                     strerror(errno));
    r->mr_dev = d;
  }
  for (uint32_t i = 0; i < SX__RDMA_STAGE_SLOTS; i++)
    if (post_recv(c, i) != 0)
      return sx__err(SX_ERDMA, "ibv_post_recv on a stage QP: %s", strerror(errno));
  return 0;
}

static void slot_wr_done(sslot *sl, int st, const char *msg) {
  if (st != 0 && sl->status == 0) {
    sl->status = st;
    snprintf(sl->msg, sizeof(sl->msg), "%s", msg);
  }
  if (sl->wrs == 0 || --sl->wrs != 0)
    return;
  if (sl->status != 0) {
    slot_release(sl, sl->status, sl->msg);
    return;
  }
  if (sl->state == SL_READ)
    slot_scatter(sl);
}

static void on_reply(rdma_conn *c, uint32_t buf, uint32_t len) {
  rdma_peer *p = c->p;
  rdma_sreader *r = p->sr;
  uint8_t slot;
  uint32_t seq, rkey, bytes;
  uint64_t addr;
  int st;
  int rc = sx__rdma_sreply_parse(reply_buf(r, buf), len, &slot, &seq, &st, &addr, &rkey, &bytes);
  sslot *sl = rc == 0 ? &r->slots[slot] : NULL;
  if (rc == 0 && (sl->state != SL_REQ || sl->seq != seq || (st == 0 && bytes != sl->bytes)))
    rc = SX_EPROTO;
  if (rc != 0) {
    sx__rdma_conn_teardown(c, SX_EPROTO, 0, "'%.64s' at %s sent a malformed stage reply",
                           p->name, p->where);
    return;
  }
  if (post_recv(c, buf) != 0) {
    sx__rdma_conn_teardown(c, SX_ERDMA, 0, "ibv_post_recv on the stage QP to '%.64s': %s",
                           p->name, strerror(errno));
  }
  if (st != 0) {
    char msg[200];
    snprintf(msg, sizeof(msg), "'%.64s' refused to stage %u bytes: %s", p->name, sl->bytes,
             sx_strerror(st));
    slot_release(sl, st, msg);
    return;
  }
  struct ibv_sge sge = {.addr = (uintptr_t)slot_mem(r, sl->index), .length = bytes,
                        .lkey = r->ring_mr->lkey};
  struct ibv_send_wr wr;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = SX__RDMA_SWR(SX__RDMA_SWR_READ, sl->index);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_READ;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = addr;
  wr.wr.rdma.rkey = rkey;
  sl->state = SL_READ;
  if (post_wrs(c, &wr, 1, sl, "READ") == 0) {
    sl->wrs = 1;
    p->t->stats.posts++;
    p->t->stats.wrs++;
  }
}

void sx__rdma_s_wc(rdma_conn *c, const struct ibv_wc *wc) {
  rdma_peer *p = c->p;
  rdma_sreader *r = p->sr;
  uint32_t kind = (uint32_t)(wc->wr_id >> 16) & 0xffu;
  uint32_t idx = (uint32_t)wc->wr_id & 0xffffu;
  if (r == NULL || idx >= SX__RDMA_STAGE_SLOTS)
    return;
  char msg[256] = "";
  int st = 0;
  if (wc->status == IBV_WC_WR_FLUSH_ERR) {
    st = c->reason != 0 ? c->reason : SX_EDISCONN;
    snprintf(msg, sizeof(msg), "%s", c->msg[0] ? c->msg : "the stage QP went to error");
    if (c->state == RC_UP)
      sx__rdma_conn_teardown(c, SX_EDISCONN, 0, "stage QP to '%.64s' at %s went to error",
                             p->name, p->where);
  } else if (wc->status != IBV_WC_SUCCESS) {
    st = sx__rdma_wc_code(wc->status);
    snprintf(msg, sizeof(msg), "staged RDMA from '%.64s' at %s failed: %s (status %d, vendor "
             "error 0x%x)", p->name, p->where, ibv_wc_status_str(wc->status), (int)wc->status,
             wc->vendor_err);
    if (c->state == RC_UP)
      sx__rdma_conn_teardown(c, st, 0, "%s", msg);
  }
  if (kind == SX__RDMA_SWR_RECV) {
    if (st == 0)
      on_reply(c, idx, wc->byte_len);
    return; /* a flushed receive: the slots fail in conn_down */
  }
  if (kind == SX__RDMA_SWR_SEND)
    return; /* a failed request tore the QP down: its slot fails in conn_down */
  slot_wr_done(&r->slots[idx], st, msg);
  c->p->wants_pump = 1;
}

void sx__rdma_s_conn_down(rdma_conn *c) {
  rdma_sreader *r = c->p->sr;
  if (r == NULL)
    return;
  int st = c->reason != 0 ? c->reason : SX_EDISCONN;
  const char *msg = c->msg[0] ? c->msg : "the stage QP is gone";
  for (uint32_t i = 0; i < SX__RDMA_STAGE_SLOTS; i++) {
    sslot *sl = &r->slots[i];
    /* Copies out of the ring go on without the QP. */
    if (sl->state == SL_REQ || sl->state == SL_READ)
      slot_release(sl, sl->status != 0 ? sl->status : st, sl->msg[0] ? sl->msg : msg);
  }
}

void sx__rdma_s_fail_queue(rdma_peer *sp, int code, const char *msg) {
  rdma_sreader *r = sp->sr;
  while (r != NULL && r->qhead != NULL) {
    rdma_srop *s = r->qhead;
    if (s->error == 0 && !s->aborting) {
      s->error = code;
      snprintf(s->msg, sizeof(s->msg), "%s", msg != NULL && msg[0] ? msg : sx_strerror(code));
    }
    give_up(s);
  }
}

/* ------------------------------------------------------------------ ops */

static void sreader_free(rdma_sreader *r) {
  for (int i = 0; i < MAX_STREAMS; i++)
    sx__mem_stream_destroy(r->streams[i]); /* waits for copies still running */
  if (r->notifier != NULL)
    sx__mem_notifier_close(r->notifier); /* their notices run now */
  if (r->ring_mr != NULL)
    ibv_dereg_mr(r->ring_mr);
  if (r->msg_mr != NULL)
    ibv_dereg_mr(r->msg_mr);
  if (r->ring_pinned)
    sx__mem_host_free(r->ring);
  else
    free(r->ring);
  free(r->msgs);
  free(r);
}

static int sreader_new(rdma_peer *p, rdma_sreader **out) {
  rdma_sreader *r = calloc(1, sizeof(*r));
  size_t ring = (size_t)SX__RDMA_STAGE_SLOTS * SX__RDMA_STAGE_SLOT_BYTES;
  void *mem = NULL;
  if (r == NULL)
    return sx__err(SX_ENOMEM, "rdma: out of memory");
  /* Pinned where a driver is loaded, so copies to the GPU overlap. */
  if (sx__mem_host_alloc(ring, &mem) == 0) {
    r->ring_pinned = 1;
  } else if (posix_memalign(&mem, 4096, ring) != 0) {
    mem = NULL;
  }
  r->ring = mem;
  r->msgs = calloc(2 * SX__RDMA_STAGE_SLOTS, SX__RDMA_SMSG_BYTES);
  if (r->ring == NULL || r->msgs == NULL) {
    sreader_free(r);
    return sx__err(SX_ENOMEM, "rdma: out of memory for a staging ring of %zu bytes", ring);
  }
  /* Without a notifier, copies into GPU memory are synchronous. */
  if (sx__mem_notifier_create(p->t->base.ctx->loop, &r->notifier) != 0)
    r->notifier = NULL;
  for (uint32_t i = 0; i < SX__RDMA_STAGE_SLOTS; i++) {
    r->slots[i].r = r;
    r->slots[i].index = i;
  }
  *out = r;
  return 0;
}

/* The stage peer of p, made on first use: a copy of p's address and
 * credentials with one QP of its own. */
static int stage_peer(rdma_peer *p, rdma_peer **out) {
  sx_rdma *t = p->t;
  if (p->stage != NULL) {
    *out = p->stage;
    return 0;
  }
  rdma_peer *sp = calloc(1, sizeof(*sp));
  if (sp == NULL || (sp->conns = calloc(1, sizeof(*sp->conns))) == NULL) {
    free(sp);
    return sx__err(SX_ENOMEM, "rdma: out of memory");
  }
  sp->base = p->base;
  sp->t = t;
  memcpy(sp->name, p->name, sizeof(sp->name));
  memcpy(sp->incarnation, p->incarnation, SX_INCARNATION_LEN);
  memcpy(sp->token, p->token, SX_TOKEN_LEN);
  sp->dst = p->dst;
  memcpy(sp->where, p->where, sizeof(sp->where));
  sp->rkey_index = p->rkey_index;
  sp->lep = p->lep;
  sp->n_conns = 1;
  sp->conns[0].cm.kind = RDMA_CM_READER;
  sp->conns[0].p = sp;
  int rc = sreader_new(sp, &sp->sr);
  if (rc) {
    free(sp->conns);
    free(sp);
    return rc;
  }
  sp->sr->sp = sp;
  sp->stage_of = p;
  p->stage = sp;
  sp->next = t->peers;
  if (t->peers != NULL)
    t->peers->prev = sp;
  t->peers = sp;
  sx__rdma_log(t, SX_LOG_INFO, "staging GPU memory for '%.64s' at %s through %u slots of %u "
               "bytes", p->name, p->where, SX__RDMA_STAGE_SLOTS, SX__RDMA_STAGE_SLOT_BYTES);
  *out = sp;
  return 0;
}

/* What sx__rdma_post checks, less the MR of GPU destinations. */
static int check_xfer(const rdma_peer *p, const sx_xfer *x, size_t i) {
  if (x->lreg == NULL)
    return sx__err(SX_EINVAL, "staged RDMA needs its destination in a registered region: "
                   "range %zu (entries %u-%u) has none", i, x->entry_first, x->entry_last);
  uint64_t a = (uint64_t)(uintptr_t)x->local;
  if (a < x->lreg->r.addr || a - x->lreg->r.addr > x->lreg->r.length ||
      x->length > x->lreg->r.length - (a - x->lreg->r.addr))
    return sx__err(SX_EBOUNDS, "range %zu: %llu bytes at %p lie outside local region %u", i,
                   (unsigned long long)x->length, (void *)x->local, x->lreg->r.id);
  if (x->rreg == NULL)
    return sx__err(SX_EINVAL, "range %zu has no remote region", i);
  if (x->roff > x->rreg->length || x->length > x->rreg->length - x->roff)
    return sx__err(SX_EBOUNDS, "range %zu: %llu bytes at offset %llu lie outside remote "
                   "region %u", i, (unsigned long long)x->length,
                   (unsigned long long)x->roff, x->rreg->id);
  if (!remote_staged(p, x->rreg) && x->rreg->n_rkeys <= p->rkey_index)
    return sx__err(SX_ERKEYS, "remote region %u has %u rkeys, the endpoint used is #%u",
                   x->rreg->id, x->rreg->n_rkeys, p->rkey_index);
  return 0;
}

int sx__rdma_s_post(rdma_peer *p, sx_op *op) {
  sx_rdma *t = p->t;
  rdma_peer *sp = NULL;
  int rc;
  for (size_t i = 0; i < op->n; i++)
    if ((rc = check_xfer(p, &op->xfers[i], i)) != 0)
      return rc;
  sx__rdma_enter(t);
  if ((rc = stage_peer(p, &sp)) != 0)
    goto out_leave;
  rdma_conn *c = &sp->conns[0];
  if (c->state == RC_IDLE && (rc = sx__rdma_conn_start(c)) != 0)
    goto out_leave;
  size_t bytes = sizeof(rdma_srop) + op->n * (sizeof(sxs) + sizeof(uint32_t));
  rdma_srop *s = calloc(1, bytes);
  if (s == NULL) {
    rc = sx__err(SX_ENOMEM, "rdma: out of memory for an op of %zu ranges", op->n);
    goto out_leave;
  }
  rdma_sreader *r = sp->sr;
  s->op = op;
  s->r = r;
  s->t = t;
  s->xs = (sxs *)(s + 1);
  s->dq = (uint32_t *)(s->xs + op->n);
  s->lnext = r->live;
  if (r->live != NULL)
    r->live->lprev = s;
  r->live = s;
  /* Leading empty ranges settle at once; the rest queue. */
  while (s->next_xi < op->n && op->xfers[s->next_xi].length == 0) {
    s->xs[s->next_xi].issued = 1;
    xfer_check(s, s->next_xi);
    s->next_xi++;
  }
  if (s->next_xi < op->n) {
    s->queued = 1;
    if (r->qtail != NULL)
      r->qtail->qnext = s;
    else
      r->qhead = s;
    r->qtail = s;
  }
  sx__rdma_s_pump(sp);
  sx__rdma_leave(t, 0);
  return 0;

out_leave:
  sx__rdma_leave(t, 0);
  return rc;
}

int sx__rdma_s_abort(rdma_peer *sp, sx_op *op, int status) {
  rdma_sreader *r = sp->sr;
  rdma_srop *s = NULL;
  for (rdma_srop *k = r != NULL ? r->live : NULL; k != NULL; k = k->lnext)
    if (k->op == op)
      s = k;
  if (s == NULL)
    return 0;
  if (s->aborting)
    return 1;
  s->aborting = 1;
  s->abort_status = status != 0 ? status : SX_ECANCELED;
  give_up(s);
  /* Pieces whose bytes are not on their way into the destination settle
   * now; a copy out of the ring that runs is waited for. */
  for (uint32_t i = 0; i < SX__RDMA_STAGE_SLOTS; i++) {
    sslot *sl = &r->slots[i];
    if (sl->state != SL_REQ && sl->state != SL_READ)
      continue;
    for (uint32_t k = 0; k < sl->n; k++) {
      sent *e = &sl->ent[k];
      if (e->srop != s)
        continue;
      e->srop = NULL;
      s->xs[e->xi].inflight--;
      s->refs--;
      xfer_check(s, e->xi);
    }
  }
  return 1;
}

void sx__rdma_s_peer_shutdown(rdma_peer *sp, int code, const char *msg) {
  rdma_sreader *r = sp->sr;
  if (r == NULL)
    return;
  sx__rdma_s_fail_queue(sp, code, msg);
  for (rdma_srop *s = r->live; s != NULL; s = s->lnext) {
    if (s->error == 0 && !s->aborting) {
      s->error = code;
      snprintf(s->msg, sizeof(s->msg), "%s", msg);
    }
  }
  /* Slots still waiting for the QP went with conn_down; copies out of the
   * ring finish inside sreader_free (their notices settle the pieces). */
  rdma_srop *live = r->live;
  sp->sr = NULL;
  sreader_free(r);
  for (rdma_srop *s = live; s != NULL;) {
    rdma_srop *next = s->lnext;
    s->r = NULL;
    s->lprev = s->lnext = NULL;
    for (size_t i = 0; s->op != NULL && i < s->op->n; i++)
      xfer_check(s, i);
    s = next;
  }
}
