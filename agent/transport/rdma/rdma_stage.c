/*
 * Staged RDMA, reader side (rdma_stage.h says how a slot lives).
 *
 * A reader's peer gets a stage peer on the first batch that needs it: one
 * more rdma_peer with SX__RDMA_STAGE_QPS QPs, connected, torn down and
 * reconnected by rdma_cm.c like any other, but whose hello says "stage"
 * and whose send queues carry this file's SENDs and READs (wr_ids tagged
 * SX__RDMA_WR_STAGE) instead of rdma_post.c's slices.  Its ops are ordinary
 * rdma_rops (rdma_post.c settles and delivers them); this file issues their
 * queue in slots.  The peer also holds
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

#define NSLOTS SX__RDMA_SNSLOTS
#define MAX_STREAMS SX__RDMA_SSTREAMS

static uint8_t *req_buf(rdma_sreader *r, uint32_t i) { return sx__rdma_s_req_buf(r, i); }

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
  int gpu = 0;
  for (uint32_t i = 0; i < remote->n_regions; i++)
    gpu |= strncmp(remote->regions[i].location, "cuda:", 5) == 0;
  for (uint32_t i = 0; ctx->region_at != NULL; i++) {
    const sx_lregion *l = ctx->region_at(ctx->agent, i);
    if (l == NULL)
      break;
    gpu |= l->mem.kind == SX__MEM_CUDA && !l->withdrawn;
  }
  /* Reads and writes (push mode) of GPU memory without an MR are staged
   * through rings (writes: rdma_stagew.c); only the tier off keeps GPU
   * memory off RDMA. */
  return !gpu || t->gpu_tier != SX__RDMA_GPU_OFF;
}

int sx__rdma_s_wanted(const rdma_peer *p, const sx_op *op) {
  if (p->t->gpu_tier == SX__RDMA_GPU_OFF)
    return 0;
  for (size_t i = 0; i < op->n; i++) {
    const sx_xfer *x = &op->xfers[i];
    if ((x->rreg != NULL && (p->write ? sx__rdma_sw_remote_staged(p, x->rreg)
                                      : remote_staged(p, x->rreg))) ||
        (x->lreg != NULL && local_staged(p, x->lreg)))
      return 1;
  }
  return 0;
}

/* ------------------------------------------------------------------ slots */

/* A piece is done (status 0: its bytes are in the destination).  A piece
 * holds one count of its xfer's inflight, so its op outlives it. */
static void piece_done(sent *e, int status, const char *msg) {
  rdma_rop *rop = e->rop;
  if (rop == NULL)
    return;
  e->rop = NULL;
  rop->xs[e->xi].inflight--;
  rop->inflight--;
  if (status != 0 && !rop->aborting)
    sx__rdma_rop_fail(rop, e->xi, status, msg);
  sx__rdma_xfer_check(rop, e->xi);
}

void sx__rdma_s_slot_release(sslot *sl, int status, const char *msg) {
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
  sx__rdma_s_slot_release(sl, 0, NULL);
  sx__rdma_s_pump(sl->r->sp);
  sx__rdma_leave(t, 1);
}

sx__mem_stream *sx__rdma_s_stream(rdma_sreader *r, int device) {
  if (device < 0 || device >= MAX_STREAMS)
    return NULL;
  if (r->streams[device] == NULL && sx__mem_stream_create(device, &r->streams[device]) != 0)
    r->streams[device] = NULL;
  return r->streams[device];
}

/* The slot's bytes are here: copy each live piece to its destination. */
static void slot_scatter(sslot *sl) {
  rdma_sreader *r = sl->r;
  sx__mem_range rg[SX__RDMA_STAGE_MAX_RANGES];
  size_t n = 0;
  int device = -1, sm_ok = 1; /* every destination on device's GPU */
  for (uint32_t i = 0; i < sl->n; i++) {
    sent *e = &sl->ent[i];
    rdma_rop *rop = e->rop;
    if (rop == NULL || rop->aborting || rop->error != 0)
      continue; /* it stops: its destination is not to be touched any more */
    const sx_xfer *x = &rop->op->xfers[e->xi];
    rg[n].dst = (uint64_t)(uintptr_t)(x->local + e->off);
    rg[n].src = (uint64_t)(uintptr_t)(sx__rdma_ring_slot(&r->ring, sl->index) + e->ring_off);
    rg[n].len = e->len;
    sx__rdma_ring_side(x->lreg, &device, &sm_ok);
    n++;
  }
  if (device >= 0) {
    sx__mem_stream *st = sx__rdma_s_stream(r, device);
    if (st != NULL && r->notifier != NULL &&
        sx__rdma_ring_gather(r->sp->t, &r->ring, st, rg, n, sm_ok, 0) == 0) {
      sl->note.fn = on_copied;
      if (sx__mem_notify(st, r->notifier, &sl->note) == 0) {
        sl->state = SL_COPY;
        return;
      }
      /* The copies were queued but no notice will say when they end. */
      sx__mem_stream_sync(st);
      sx__rdma_s_slot_release(sl, 0, NULL);
      return;
    }
  }
  /* Host memory, or no stream: copy synchronously (unified addressing). */
  int rc = sx__rdma_ring_copy_sync(rg, n, device >= 0);
  sx__rdma_s_slot_release(sl, rc, rc ? sx_errmsg() : NULL);
}

int sx__rdma_s_post_wrs(rdma_conn *c, struct ibv_send_wr *wrs, uint32_t n, sslot *sl,
                    const char *what) {
  struct ibv_send_wr *bad = NULL;
  int rc = ibv_post_send(c->qp, wrs, &bad);
  if (rc == 0) {
    /* Per-device counters: the slot's READs (a request SEND is a work
     * request without payload bytes). */
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < n; i++)
      if (wrs[i].opcode == IBV_WR_RDMA_READ || wrs[i].opcode == IBV_WR_RDMA_WRITE)
        bytes += wrs[i].sg_list->length;
    sx__rdma_count(c->p->t, c->dev, n, bytes);
    return 0;
  }
  uint32_t posted = (bad != NULL && bad >= wrs && bad < wrs + n) ? (uint32_t)(bad - wrs) : 0;
  snprintf(sl->msg, sizeof(sl->msg), "ibv_post_send of a stage %s to '%.64s': %s", what,
           c->p->name, strerror(rc > 0 ? rc : errno));
  sl->status = SX_ERDMA;
  sl->wrs += posted;
  sx__rdma_conn_teardown(c, SX_ERDMA, 0, "%s", sl->msg);
  if (sl->wrs == 0)
    sx__rdma_s_slot_release(sl, SX_ERDMA, sl->msg);
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
    const sx_xfer *x = &e->rop->op->xfers[e->xi];
    sges[i].addr = (uintptr_t)(sx__rdma_ring_slot(&r->ring, sl->index) + e->ring_off);
    sges[i].length = e->len;
    sges[i].lkey = r->ring.mr->lkey;
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
  if (sx__rdma_s_post_wrs(c, wrs, sl->n, sl, "READ") == 0) {
    sl->wrs = sl->n;
    p->t->stats.posts++;
    p->t->stats.wrs += sl->n;
  }
}

void sx__rdma_s_post_request(rdma_conn *c, sslot *sl) {
  rdma_sreader *r = sl->r;
  sx__rdma_sreq q;
  q.slot = (uint8_t)sl->tslot;
  q.write = (uint8_t)r->write;
  if (r->write) /* the consumer READs the filled slot */
    q.src = (sx__rdma_swsrc){.addr = (uintptr_t)sx__rdma_ring_slot(&r->ring, sl->index),
                             .rkey = r->ring.mr->rkey, .bytes = sl->bytes};
  q.seq = sl->seq = ++r->seq;
  q.n = (uint16_t)sl->n;
  for (uint32_t i = 0; i < sl->n; i++) {
    const sent *e = &sl->ent[i];
    const sx_xfer *x = &e->rop->op->xfers[e->xi];
    q.r[i].region = x->rreg->id;
    q.r[i].off = x->roff + e->off;
    q.r[i].len = e->len;
  }
  size_t len = sx__rdma_sreq_pack(req_buf(r, sl->index), &q);
  struct ibv_sge sge = {.addr = (uintptr_t)req_buf(r, sl->index), .length = (uint32_t)len,
                        .lkey = r->ring.msg_mr->lkey};
  struct ibv_send_wr wr;
  sx__rdma_wr_send(&wr, &sge, SX__RDMA_SWR(SX__RDMA_SWR_SEND, sl->index));
  sl->state = SL_REQ;
  /* A staged write's bytes cross this device when the consumer READs the
   * slot: they count here, where the request goes out. */
  if (sx__rdma_s_post_wrs(c, &wr, 1, sl, "request") == 0 && r->write)
    sx__rdma_count(c->p->t, c->dev, 0, sl->bytes);
}

/* Fill a free slot from the queue: pieces of one kind (direct or staged,
 * and staged ones from one remote location), at most a slot's bytes. */
/* Empty ranges have nothing to stage: they are done once reached. */
static void skip_empty(rdma_rop *rop) {
  const sx_op *op = rop->op;
  while (rop->next_xi < op->n && op->xfers[rop->next_xi].length == 0) {
    rop->xs[rop->next_xi].issued = 1;
    sx__rdma_xfer_check(rop, rop->next_xi);
    rop->next_xi++;
  }
  if (rop->next_xi == op->n)
    sx__rdma_rop_dequeue(rop);
}

static void slot_fill(rdma_conn *c, sslot *sl) {
  rdma_peer *p = c->p;
  const char *loc = NULL;
  sl->n = 0;
  sl->bytes = 0;
  sl->status = 0;
  sl->msg[0] = '\0';
  sl->direct = -1;
  while (p->qhead != NULL && sl->n < SX__RDMA_STAGE_MAX_RANGES &&
         sl->bytes < SX__RDMA_STAGE_SLOT_BYTES) {
    rdma_rop *rop = p->qhead;
    const sx_xfer *x = &rop->op->xfers[rop->next_xi];
    rdma_xs *xs = &rop->xs[rop->next_xi];
    /* Staged writes all go through the consumer's ring, whatever lies
     * behind each range: one kind per slot. */
    int direct = !sl->r->write && !remote_staged(p, x->rreg);
    if (sl->direct < 0)
      sl->direct = direct;
    else if (sl->direct != direct ||
             (!direct && !sl->r->write && strcmp(loc, x->rreg->location) != 0))
      break;
    loc = x->rreg->location;
    uint64_t rem = x->length - xs->next_off;
    uint32_t room = SX__RDMA_STAGE_SLOT_BYTES - sl->bytes;
    uint32_t len = rem < room ? (uint32_t)rem : room;
    sent *e = &sl->ent[sl->n++];
    e->rop = rop;
    e->xi = (uint32_t)rop->next_xi;
    e->off = xs->next_off;
    e->len = len;
    e->ring_off = sl->bytes;
    xs->inflight++;
    rop->inflight++;
    sl->bytes += len;
    xs->next_off += len;
    if (xs->next_off == x->length) {
      xs->issued = 1;
      rop->next_xi++;
      skip_empty(rop);
    }
  }
  if (sl->n == 0)
    return;
  if (sl->r->write)
    sx__rdma_sw_fill(c, sl);
  else if (sl->direct)
    post_direct(c, sl);
  else
    sx__rdma_s_post_request(c, sl);
}

void sx__rdma_s_pump(rdma_peer *sp) {
  rdma_sreader *r = sp->sr;
  if (sp->closing || r == NULL || sp->qhead == NULL)
    return;
  int live = 0, rc = 0;
  for (uint32_t k = 0; k < sp->n_conns; k++) {
    rdma_conn *c = &sp->conns[k];
    if (c->state == RC_IDLE && (rc = sx__rdma_conn_start(c)) != 0)
      continue;
    live |= sx__rdma_conn_live(c);
  }
  if (!live) {
    if (rc)
      sx__rdma_peer_fail_queue(sp, rc, sx_errmsg());
    return;
  }
  for (uint32_t i = 0; i < NSLOTS && sp->qhead != NULL; i++) {
    sslot *sl = &r->slots[i];
    if (sl->state == SL_FREE && sp->conns[sl->conn].state == RC_UP)
      slot_fill(&sp->conns[sl->conn], sl);
  }
}

/* ------------------------------------------------------------------ the QP */

static int post_recv(rdma_conn *c, uint32_t i) { /* i: a receive buffer */
  return sx__rdma_ring_post_recv(&c->p->sr->ring, c->qp, i);
}

int sx__rdma_s_qp_ready(rdma_conn *c) {
  rdma_sreader *r = c->p->sr;
  rdma_dev *d = c->dev;
  if (r == NULL)
    return sx__err(SX_EINVAL, "rdma: a stage QP without its rings");
  if (r->mr_dev != d) {
    if (r->ring.mr != NULL)
      ibv_dereg_mr(r->ring.mr);
    if (r->ring.msg_mr != NULL)
      ibv_dereg_mr(r->ring.msg_mr);
    r->ring.mr = r->ring.msg_mr = NULL;
    r->mr_dev = NULL;
    /* A producer's slots are READ by the consumer (staged writes). */
    r->ring.mr = ibv_reg_mr(d->pd, r->ring.mem, r->ring.bytes,
                            IBV_ACCESS_LOCAL_WRITE | (r->write ? IBV_ACCESS_REMOTE_READ : 0));
    r->ring.msg_mr = ibv_reg_mr(d->pd, r->ring.msgs, r->ring.msg_bytes, IBV_ACCESS_LOCAL_WRITE);
    if (r->ring.mr == NULL || r->ring.msg_mr == NULL)
      return sx__err(SX_ENOMEM, "ibv_reg_mr(%s) of the staging ring: %s", d->name,
                     strerror(errno));
    r->mr_dev = d;
  }
  for (uint32_t i = 0; i < SX__RDMA_STAGE_SLOTS; i++)
    if (post_recv(c, c->index * SX__RDMA_STAGE_SLOTS + i) != 0)
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
    sx__rdma_s_slot_release(sl, sl->status, sl->msg);
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
  int rc = sx__rdma_sreply_parse(sx__rdma_ring_msg(&r->ring, buf), len, &slot, &seq, &st, &addr, &rkey, &bytes);
  sslot *sl = rc == 0 ? &r->slots[slot * SX__RDMA_STAGE_QPS + c->index] : NULL;
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
    snprintf(msg, sizeof(msg), "'%.64s' refused to stage %u bytes%s: %s", p->name, sl->bytes,
             r->write ? " of a write" : "", sx_strerror(st));
    sx__rdma_s_slot_release(sl, st, msg);
    return;
  }
  if (r->write) { /* every byte of the slot is in the consumer's memory */
    sx__rdma_s_slot_release(sl, 0, NULL);
    return;
  }
  struct ibv_sge sge = {.addr = (uintptr_t)sx__rdma_ring_slot(&r->ring, sl->index), .length = bytes,
                        .lkey = r->ring.mr->lkey};
  struct ibv_send_wr wr;
  sx__rdma_wr_read(&wr, &sge, SX__RDMA_SWR(SX__RDMA_SWR_READ, sl->index), addr, rkey);
  sl->state = SL_READ;
  if (sx__rdma_s_post_wrs(c, &wr, 1, sl, "READ") == 0) {
    sl->wrs = 1;
    p->t->stats.posts++;
    p->t->stats.wrs++;
  }
}

const char *sx__rdma_s_qp_lost(const rdma_sreader *r, const char *msg, char *buf, size_t cap) {
  snprintf(buf, cap, "%s%s", msg,
           r->write ? "; the consumer dropped a staged write's QP (its write grant was "
                      "revoked, or it stopped or failed)"
                    : "");
  return buf;
}

void sx__rdma_s_wc(rdma_conn *c, const struct ibv_wc *wc) {
  rdma_peer *p = c->p;
  rdma_sreader *r = p->sr;
  uint32_t kind = (uint32_t)(wc->wr_id >> 16) & 0xffu;
  uint32_t idx = (uint32_t)wc->wr_id & 0xffffu;
  if (r == NULL || idx >= NSLOTS)
    return;
  char msg[sizeof(c->msg) + 128] = "";
  int st = 0;
  if (wc->status == IBV_WC_WR_FLUSH_ERR) {
    st = c->reason != 0 ? c->reason : SX_EDISCONN;
    sx__rdma_s_qp_lost(r, c->msg[0] ? c->msg : "the stage QP went to error", msg, sizeof(msg));
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
  char wmsg[sizeof(c->msg) + 128];
  const char *msg =
      sx__rdma_s_qp_lost(r, c->msg[0] ? c->msg : "the stage QP is gone", wmsg, sizeof(wmsg));
  for (uint32_t i = 0; i < NSLOTS; i++) {
    sslot *sl = &r->slots[i];
    /* Copies out of the ring go on without the QP. */
    if (sl->conn == c->index && (sl->state == SL_REQ || sl->state == SL_READ))
      sx__rdma_s_slot_release(sl, sl->status != 0 ? sl->status : st, sl->msg[0] ? sl->msg : msg);
  }
}

/* ------------------------------------------------------------------ ops */

static void sreader_free(rdma_sreader *r) {
  for (int i = 0; i < MAX_STREAMS; i++)
    sx__mem_stream_destroy(r->streams[i]); /* waits for copies still running */
  if (r->notifier != NULL)
    sx__mem_notifier_close(r->notifier); /* their notices run now */
  sx__rdma_ring_free(&r->ring);
  free(r);
}

static int sreader_new(rdma_peer *p, rdma_sreader **out) {
  rdma_sreader *r = calloc(1, sizeof(*r));
  if (r == NULL)
    return sx__err(SX_ENOMEM, "rdma: out of memory");
  int rc = sx__rdma_ring_alloc_near(p->t, p->lep->dev, &r->ring,
                                    (size_t)NSLOTS * SX__RDMA_STAGE_SLOT_BYTES, 2 * NSLOTS);
  if (rc) {
    free(r);
    return rc;
  }
  /* Without a notifier, copies into GPU memory are synchronous. */
  if (sx__mem_notifier_create(p->t->base.ctx->loop, &r->notifier) != 0)
    r->notifier = NULL;
  for (uint32_t i = 0; i < NSLOTS; i++) {
    r->slots[i].r = r;
    r->slots[i].index = i;
    r->slots[i].conn = i % SX__RDMA_STAGE_QPS;
    r->slots[i].tslot = i / SX__RDMA_STAGE_QPS;
  }
  *out = r;
  return 0;
}

/* The stage peer of p, made on first use: a copy of p's address and
 * credentials with stage QPs of its own. */
static int stage_peer(rdma_peer *p, rdma_peer **out) {
  sx_rdma *t = p->t;
  if (p->stage != NULL) {
    *out = p->stage;
    return 0;
  }
  rdma_peer *sp = calloc(1, sizeof(*sp));
  if (sp == NULL || (sp->conns = calloc(SX__RDMA_STAGE_QPS, sizeof(*sp->conns))) == NULL) {
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
  sp->n_conns = SX__RDMA_STAGE_QPS;
  for (uint32_t i = 0; i < sp->n_conns; i++) {
    sp->conns[i].cm.kind = RDMA_CM_READER;
    sp->conns[i].p = sp;
    sp->conns[i].index = i;
  }
  int rc = sreader_new(sp, &sp->sr);
  if (rc) {
    free(sp->conns);
    free(sp);
    return rc;
  }
  sp->sr->sp = sp;
  sp->sr->write = p->write;
  sp->stage_of = p;
  p->stage = sp;
  sp->next = t->peers;
  if (t->peers != NULL)
    t->peers->prev = sp;
  t->peers = sp;
  sx__rdma_log(t, SX_LOG_INFO, "staging GPU memory %s '%.64s' at %s through %u slots of %u "
               "bytes on %u QPs", p->write ? "writes to" : "reads from", p->name, p->where,
               NSLOTS, SX__RDMA_STAGE_SLOT_BYTES, SX__RDMA_STAGE_QPS);
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
  if (p->write) /* staged writes need no key: the consumer READs our slots */
    return (x->rreg->access & SX_ACCESS_REMOTE_WRITE)
               ? 0
               : sx__err(SX_EDENIED, "remote region %u does not allow remote writes",
                         x->rreg->id);
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
  for (uint32_t k = 0; k < sp->n_conns; k++) {
    rdma_conn *c = &sp->conns[k];
    int r = c->state == RC_IDLE ? sx__rdma_conn_start(c) : 0;
    if (r != 0 && k == 0) { /* the first cannot even start: say so now */
      rc = r;
      goto out_leave;
    }
  }
  /* An ordinary op of the stage peer (settled and delivered as any), whose
   * queue this file issues in slots instead of slices. */
  rdma_rop *rop = sx__rdma_rop_new(sp, op, 0);
  if (rop == NULL) {
    rc = sx__err(SX_ENOMEM, "rdma: out of memory for an op of %zu ranges", op->n);
    goto out_leave;
  }
  skip_empty(rop);
  sx__rdma_s_pump(sp);
  sx__rdma_leave(t, 0);
  return 0;

out_leave:
  sx__rdma_leave(t, 0);
  return rc;
}

void sx__rdma_s_abort_slots(rdma_peer *sp, rdma_rop *rop) {
  rdma_sreader *r = sp->sr;
  for (uint32_t i = 0; r != NULL && i < NSLOTS; i++) {
    sslot *sl = &r->slots[i];
    if (sl->state != SL_REQ && sl->state != SL_READ)
      continue; /* a copy out of the ring that runs is waited for */
    for (uint32_t k = 0; k < sl->n; k++) {
      sent *e = &sl->ent[k];
      if (e->rop != rop)
        continue;
      e->rop = NULL;
      rop->xs[e->xi].inflight--;
      rop->inflight--;
      sx__rdma_xfer_check(rop, e->xi);
    }
  }
}

void sx__rdma_s_peer_shutdown(rdma_peer *sp) {
  rdma_sreader *r = sp->sr;
  if (r == NULL)
    return;
  /* Slots waiting for the QP went with conn_down; copies out of the ring
   * finish inside sreader_free, and their notices settle their pieces. */
  sreader_free(r);
  sp->sr = NULL;
}
