/*
 * NIC pairs: each range of a batch travels through the NICs its two regions
 * name (docs/gpu.md "NIC choice").
 *
 * Every region is published with the NIC its owner chose for it (rdma_nic.c:
 * a GPU's nearest NIC, host memory spread over the NICs), and the
 * descriptor carries an endpoint (address, device, GID) and an rkey per
 * NIC.  A segment's peer is opened for one pair of ports (sx__rdma_pick);
 * a range whose remote region names another NIC, or whose local region
 * sits on another local NIC, goes to the pair peer of (local port, remote
 * endpoint): a peer of its own with its own QPs, opened on the first range
 * that needs it and connected through rdma_cm to the address that NIC
 * publishes.  The local port is the one best suited to the remote endpoint
 * (sx__rdma_ep_score: on RoCE the one in its subnet, which on a multi-rail
 * host is the rail's own NIC); among equals, the local region's NIC, then
 * the segment's own port.
 *
 * An op whose ranges all use one pair is posted there as it is.  One that
 * spans pairs is split: a part (an op of its own, its ranges copied) per
 * pair, each posted on its pair peer and settled there as any op is, then
 * mapped back onto the caller's op, range by range, so that the caller's
 * op ends once, with one deadline (its abort reaches every part) and the
 * per-range errors of its parts.  A pair that cannot connect (refused, its
 * port down, no route) fails only its own part's ranges; its message
 * names both NICs (the pair peer's `where`).  Staged GPU ranges go the
 * same way: each pair peer stages through a ring of its own, on its own
 * NIC (rdma_stage.c).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rdma_int.h"

/* One pair's share of a split op.  op comes first: its done callback finds
 * the part from it. */
typedef struct rdma_part {
  sx_op op;     /* op.owner: its split */
  rdma_peer *q; /* the pair peer carrying it */
  size_t *map;  /* op.xfers[i] is xfer map[i] of the split op */
  int live;     /* posted, its done not run yet */
} rdma_part;

struct rdma_split {
  sx_op *op;
  rdma_peer *p;
  size_t n_parts, left; /* parts, and those whose done has not run */
  rdma_split *prev, *next;
  rdma_part part[];     /* then the parts' xfers, then their maps */
};

/* The RDMA endpoint (ordinal) the remote region's owner chose for it, or
 * the peer's own when it names none. */
static uint32_t remote_ordinal(const rdma_peer *p, const sx_region *rr) {
  if (rr->nic >= 1 && rr->nic <= p->n_reps)
    return rr->nic - 1;
  return p->rkey_index;
}

/* The local port for remote endpoint re: the best suited; among equals,
 * one on device ldev (the local region's NIC), then the peer's own.  NULL
 * when none suits it as well as the segment's own pair suits its
 * endpoints: a reader with fewer rails than the target (one NIC in one
 * subnet, say) keeps reading through the pair it was opened for, which
 * reaches every region (each is registered on every NIC), rather than
 * trying a NIC of the target's that it may have no route to. */
static rdma_ep *local_port(const rdma_peer *p, const sx_endpoint *re, int ldev) {
  sx_rdma *t = p->t;
  rdma_ep *best = NULL;
  int need = sx__rdma_ep_score(p->lep, &p->desc->endpoints[p->rep[p->rkey_index]]);
  int best_score = 0, best_pref = -1;
  for (int k = 0; k < t->n_eps; k++) {
    rdma_ep *ep = &t->eps[k];
    int s = sx__rdma_ep_score(ep, re);
    int pref = 2 * (ep->dev->index == ldev) + (ep == p->lep);
    if (s == 0 || s < need)
      continue;
    if (s > best_score || (s == best_score && pref > best_pref)) {
      best = ep;
      best_score = s;
      best_pref = pref;
    }
  }
  return best;
}

int sx__rdma_route_pair(rdma_peer *p, const sx_xfer *x, rdma_peer **out) {
  *out = p;
  if (x->lreg == NULL || x->rreg == NULL)
    return 0; /* sx__rdma_post_pair says what is wrong with it */
  const rdma_mr *rm = x->lreg->tpriv[SX_TRANSPORT_RDMA];
  int ldev = rm != NULL ? rm->nic : -1;
  uint32_t o = remote_ordinal(p, x->rreg);
  if (o == p->rkey_index && (ldev < 0 || ldev == p->lep->dev->index))
    return 0;
  rdma_ep *lep = local_port(p, &p->desc->endpoints[p->rep[o]], ldev);
  if (lep == NULL || (o == p->rkey_index && lep == p->lep))
    return 0;
  for (rdma_peer *q = p->pairs; q != NULL; q = q->pnext) {
    if (q->rkey_index == o && q->lep == lep) {
      *out = q;
      return 0;
    }
  }
  return sx__rdma_peer_new(p->t, p->desc, p->rep[o], o, lep, p, out);
}

static void split_free(rdma_split *s) {
  rdma_peer *p = s->p;
  if (s->prev != NULL)
    s->prev->next = s->next;
  else
    p->splits = s->next;
  if (s->next != NULL)
    s->next->prev = s->prev;
  free(s);
}

/* A part settled every range: they settle on the split op.  The last part
 * frees the split before the op's last range settles, since the op's done
 * may free the op or close the peer. */
static void part_done(sx_op *pop) {
  rdma_part *part = (rdma_part *)pop;
  rdma_split *s = pop->owner;
  sx_op *op = s->op;
  const char *msg = pop->first_error != 0 ? pop->message : NULL;
  size_t n = pop->n;
  part->live = 0;
  if (--s->left > 0) {
    for (size_t i = 0; i < n; i++)
      sx__op_xfer_done(op, part->map[i], pop->xfers[i].status, msg);
    return;
  }
  for (size_t i = 0; i + 1 < n; i++)
    sx__op_xfer_done(op, part->map[i], pop->xfers[i].status, msg);
  size_t last = part->map[n - 1];
  int st = pop->xfers[n - 1].status;
  char buf[sizeof(pop->message)];
  snprintf(buf, sizeof(buf), "%s", msg != NULL ? msg : "");
  split_free(s);
  sx__op_xfer_done(op, last, st, st != 0 ? buf : NULL);
}

/* Split op over the n_parts distinct peers of set (to[i]: xfer i's), post
 * each part.  A part whose post fails at once settles its ranges now with
 * that error (the op's done cannot run: another part is in flight); when
 * every part fails, nothing is posted and the first error is returned. */
static int split_post(rdma_peer *p, sx_op *op, rdma_peer **to, rdma_peer **set,
                      size_t n_parts) {
  size_t bytes = sizeof(rdma_split) + n_parts * sizeof(rdma_part) +
                 op->n * (sizeof(sx_xfer) + sizeof(size_t));
  rdma_split *s = calloc(1, bytes);
  if (s == NULL)
    return sx__err(SX_ENOMEM, "rdma: out of memory splitting an op of %zu ranges over %zu "
                   "NIC pairs", op->n, n_parts);
  sx_xfer *xf = (sx_xfer *)(s->part + n_parts);
  size_t *map = (size_t *)(xf + op->n), k = 0;
  s->op = op;
  s->p = p;
  s->n_parts = n_parts;
  for (size_t j = 0; j < n_parts; j++) {
    rdma_part *part = &s->part[j];
    part->q = set[j];
    part->op.xfers = xf + k;
    part->map = map + k;
    for (size_t i = 0; i < op->n; i++) {
      if (to[i] != set[j])
        continue;
      xf[k] = op->xfers[i];
      xf[k].status = 1;
      map[k] = i;
      k++;
    }
    part->op.n = part->op.pending = (size_t)(xf + k - part->op.xfers);
    part->op.done = part_done;
    part->op.owner = s;
  }
  s->next = p->splits;
  if (p->splits != NULL)
    p->splits->prev = s;
  p->splits = s;
  s->left = n_parts;

  int first_rc = 0, rcs[SX__RDMA_MAX_EPS * SX_MAX_DEVICES];
  char first_msg[256] = "", msgs[SX__RDMA_MAX_EPS * SX_MAX_DEVICES][256];
  size_t ok = 0;
  for (size_t j = 0; j < n_parts; j++) {
    rcs[j] = sx__rdma_post_pair(s->part[j].q, &s->part[j].op);
    if (rcs[j] == 0) {
      s->part[j].live = 1;
      ok++;
      continue;
    }
    snprintf(msgs[j], sizeof(msgs[j]), "%s", sx_errmsg());
    if (first_rc == 0) {
      first_rc = rcs[j];
      snprintf(first_msg, sizeof(first_msg), "%s", msgs[j]);
    }
  }
  if (ok == 0) {
    split_free(s);
    return sx__err(first_rc, "%s", first_msg);
  }
  p->t->stats.splits++;
  for (size_t j = 0; j < n_parts; j++) {
    if (rcs[j] == 0)
      continue;
    rdma_part *part = &s->part[j];
    sx__rdma_log(p->t, SX_LOG_WARN, "%zu of %zu ranges to '%.64s' fail: %s", part->op.n,
                 op->n, p->name, msgs[j]);
    s->left--;
    for (size_t i = 0; i < part->op.n; i++)
      sx__op_xfer_done(op, part->map[i], rcs[j], msgs[j]);
  }
  return 0;
}

int sx__rdma_route_post(rdma_peer *p, sx_op *op) {
  sx_rdma *t = p->t;
  /* One port here and one NIC there: nothing to choose. */
  if (p->pair_of != NULL || p->stage_of != NULL || (t->n_eps <= 1 && p->n_reps <= 1))
    return sx__rdma_post_pair(p, op);
  rdma_peer **to = malloc(op->n * sizeof(*to));
  rdma_peer *set[SX__RDMA_MAX_EPS * SX_MAX_DEVICES];
  size_t n_set = 0;
  int rc = 0;
  if (to == NULL)
    return sx__err(SX_ENOMEM, "rdma: out of memory for an op of %zu ranges", op->n);
  sx__rdma_enter(t);
  for (size_t i = 0; i < op->n && rc == 0; i++) {
    rc = sx__rdma_route_pair(p, &op->xfers[i], &to[i]);
    size_t j = 0;
    while (rc == 0 && j < n_set && set[j] != to[i])
      j++;
    if (rc == 0 && j == n_set)
      set[n_set++] = to[i];
  }
  if (rc == 0)
    rc = n_set == 1 ? sx__rdma_post_pair(set[0], op) : split_post(p, op, to, set, n_set);
  free(to);
  sx__rdma_leave(t, 0);
  return rc;
}

void sx__rdma_route_abort(rdma_peer *p, sx_op *op, int status) {
  sx_rdma *t = p->t;
  sx__rdma_enter(t);
  rdma_split *s = p->splits;
  while (s != NULL && s->op != op)
    s = s->next;
  if (s != NULL) {
    if (p->write)
      sx__rdma_w_abort(p, op, status); /* its notice, if it got that far */
    for (size_t j = 0; j < s->n_parts; j++)
      if (s->part[j].live)
        sx__rdma_abort_pair(s->part[j].q, &s->part[j].op, status);
  } else {
    /* Posted whole, on p or on the one pair peer all its ranges use. */
    sx__rdma_abort_pair(p, op, status);
    for (rdma_peer *q = p->pairs; q != NULL; q = q->pnext)
      sx__rdma_abort_pair(q, op, status);
  }
  sx__rdma_leave(t, 0);
}
