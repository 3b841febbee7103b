/*
 * Staged RDMA writes (push mode), producer side (rdma_stage.h says how a
 * read's slot lives; this is the other direction).
 *
 * A write batch that touches GPU memory no MR covers (a GPU source here, or
 * a consumer's GPU region published without a write key) runs on the write
 * peer's stage peer (rdma_stage.c): its stage QPs connect with a write
 * hello plus SX__RDMA_HELLO_STAGE, so the consumer authorizes them as any
 * producer (incarnation, token, grant) and puts them in its write PD.  A
 * slot's life:
 *
 *   FILL  the sources of the slot's pieces are copied into it: one gather
 *         on a stream of the sources' GPU (sx__rdma_ring_gather), memcpy
 *         for host sources;
 *   REQ   once that copy ended, a write request (WREQ) names the slot's
 *         address, rkey and bytes and the consumer's ranges; the consumer
 *         checks every range, RDMA-READs the slot into its own ring,
 *         scatters it into its regions (one gather into GPU memory) and
 *         answers once that copy ended.  The answer settles the pieces.
 *
 * Why the consumer READs our slot rather than we WRITE into its ring: it
 * is the staged read's wire turned around (requests, replies, one slot per
 * request, the side that consumes the bytes moves them), the consumer's
 * ring is never remotely writable (nothing a producer's QP could scribble
 * on while the consumer scatters it), and a request names exactly what the
 * consumer will fetch, so it checks every range before a byte moves.  Our
 * ring is remotely readable only in our own PD, and holds only bytes on
 * their way to this consumer.
 *
 * The batch's notice goes on the write peer's QPs after every piece
 * settled, that is after the consumer answered every request: its bytes
 * are in its memory (its GPU copies ended) before it sees the notice.
 * Nothing of a slot is reused before its answer, or before its QP is gone
 * (the consumer's READ of it then fails with the QP).
 */
#include <stdio.h>
#include <string.h>

#include "rdma_int.h"

int sx__rdma_sw_remote_staged(const rdma_peer *p, const sx_region *rr) {
  return strncmp(rr->location, "cuda:", 5) == 0 &&
         (rr->n_wkeys <= p->rkey_index || rr->wkeys[p->rkey_index] == 0);
}

/* The fill ended: ask the consumer to take the slot, unless its QP went. */
static void filled(sslot *sl, int status, const char *msg) {
  rdma_peer *sp = sl->r->sp;
  rdma_conn *c = sp != NULL ? &sp->conns[sl->conn] : NULL;
  if (status != 0) {
    sx__rdma_s_slot_release(sl, status, msg);
    return;
  }
  if (c == NULL || sp->closing || c->state != RC_UP) {
    /* The QP went while the slot was being filled: say what that means
     * for a write, as when its work is flushed or the disconnect comes
     * first (unless our own side is closing). */
    char wmsg[sizeof(c->msg) + 128];
    const char *why = c != NULL && c->msg[0] ? c->msg
                                             : "the stage QP went down while a staged write "
                                               "was being copied into its slot";
    if (sp != NULL && !sp->closing)
      why = sx__rdma_s_qp_lost(sl->r, why, wmsg, sizeof(wmsg));
    sx__rdma_s_slot_release(sl, c != NULL && c->reason != 0 ? c->reason : SX_EDISCONN, why);
    return;
  }
  sx__rdma_s_post_request(c, sl);
}

static void on_filled(sx__mem_notice *n) {
  sslot *sl = (sslot *)((char *)n - offsetof(sslot, note));
  rdma_peer *sp = sl->r->sp;
  sx_rdma *t = sp->t;
  sx__rdma_enter(t);
  filled(sl, 0, NULL);
  if (sp->sr != NULL)
    sx__rdma_s_pump(sp);
  sx__rdma_leave(t, 1);
}

void sx__rdma_sw_fill(rdma_conn *c, sslot *sl) {
  rdma_sreader *r = sl->r;
  sx__mem_range rg[SX__RDMA_STAGE_MAX_RANGES];
  int device = -1, sm_ok = 1; /* every source on device's GPU */
  (void)c;
  for (uint32_t i = 0; i < sl->n; i++) {
    const sent *e = &sl->ent[i];
    const sx_xfer *x = &e->rop->op->xfers[e->xi];
    rg[i].dst = (uint64_t)(uintptr_t)(sx__rdma_ring_slot(&r->ring, sl->index) + e->ring_off);
    rg[i].src = (uint64_t)(uintptr_t)(x->local + e->off);
    rg[i].len = e->len;
    sx__rdma_ring_side(x->lreg, &device, &sm_ok);
  }
  sl->state = SL_FILL;
  if (device >= 0) {
    sx__mem_stream *st = sx__rdma_s_stream(r, device);
    if (st != NULL && r->notifier != NULL &&
        sx__rdma_ring_gather(r->sp->t, &r->ring, st, rg, sl->n, sm_ok, 0) == 0) {
      sl->note.fn = on_filled;
      if (sx__mem_notify(st, r->notifier, &sl->note) == 0)
        return;
      /* Queued, but no notice will say when they end. */
      int rc = sx__mem_stream_sync(st);
      filled(sl, rc, rc ? sx_errmsg() : NULL);
      return;
    }
  }
  /* Host memory, or no stream: copy synchronously (unified addressing). */
  int rc = sx__rdma_ring_copy_sync(rg, sl->n, device >= 0);
  filled(sl, rc, rc ? sx_errmsg() : NULL);
}
