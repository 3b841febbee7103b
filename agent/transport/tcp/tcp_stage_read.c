/*
 * Staging, the side that posts batches: a read batch whose destinations
 * include GPU memory is read in pieces of at most a chunk into pinned
 * staging memory over the ordinary TCP path, each piece copied to the
 * device when it arrived; a write batch (push mode) whose sources include
 * GPU memory is copied to pinned chunks piece by piece, and each piece is
 * sent as its copy finished, so the copy of piece n+1 overlaps sending
 * piece n (see tcp_stage.h).  A piece is an sx_op posted to tcp_read.c,
 * so the wire, the connections and their failure handling stay one code
 * path.  A read's small ranges share a piece: as many as fit one chunk
 * (up to SX__STAGE_GROUP), one after the other in it, and once all of
 * them arrived one gather (the memory layer's kernel) scatters them to
 * their destinations, one launch and one notice for the lot.  A range settles when its last piece did (writes:
 * when the consumer acknowledged it), so a write batch sends its notice
 * only after every byte was acknowledged.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "tcp_int.h"
#include "tcp_stage.h"

typedef struct sop sop;

/* Per range of the staged op. */
typedef struct srange {
  int device;           /* of the destination; -1 host */
  uint32_t outstanding; /* pieces posted or copying */
  int err;
  int settled;
} srange;

/* Where one range of a piece goes: part idx of o, from off in it. */
typedef struct ppart {
  size_t idx;
  uint64_t off;
} ppart;

typedef struct piece {
  sx_op op;             /* its ranges (x), posted to tcp_read.c */
  sx_xfer *x;           /* k of them, into the chunk one after the other */
  ppart *part;          /* k */
  size_t k;
  sop *o;
  void *chunk;          /* staging; NULL: received in place (host) */
  sx__mem_notice note;
  struct piece *next, *prev; /* o->posted while tcp_read.c has it */
} piece;

struct sop {
  sx__tcp_stage *st;
  sx_tpeer *tp;
  sx_op *op;
  size_t n;             /* op->n: op may be gone once its last range settled */
  srange *r;
  size_t cur;           /* next range to cut pieces from */
  uint64_t cur_off;
  size_t unsettled;
  uint32_t live;        /* pieces alive, plus a guard during aborts */
  int aborted;          /* status the remaining ranges settle with */
  int write;            /* push: local memory is the source */
  char msg[256];        /* the first error */
  void *ready;          /* a chunk a waiter handed over */
  sx__stage_wait wait;
  int waiting;
  piece *posted;
  sop *next, *prev;     /* all staged ops */
};

static void pump(sop *o);

static void sop_maybe_free(sop *o) {
  if (o->unsettled > 0 || o->live > 0)
    return;
  if (o->waiting)
    sx__stage_unwait(o->st, SX__STAGE_READ, &o->wait);
  if (o->ready != NULL)
    sx__stage_chunk_put(o->st, SX__STAGE_READ, o->ready);
  if (o->prev)
    o->prev->next = o->next;
  else
    *sx__stage_sops(o->st) = o->next;
  if (o->next)
    o->next->prev = o->prev;
  sx__tcp_stage *st = o->st;
  free(o->r);
  free(o);
  sx__stage_release(st);
}

static void record(sop *o, size_t idx, int err, const char *msg) {
  if (o->r[idx].err == 0)
    o->r[idx].err = err;
  if (o->msg[0] == '\0')
    snprintf(o->msg, sizeof(o->msg), "%s", msg ? msg : sx_strerror(err));
}

/* Settle range idx once it is cut completely and nothing of it is out.
 * The op's done may run here: the caller touches o->op no more after. */
static void try_settle(sop *o, size_t idx) {
  srange *r = &o->r[idx];
  if (r->settled || r->outstanding > 0 || idx >= o->cur)
    return;
  r->settled = 1;
  o->unsettled--;
  int st = o->aborted ? o->aborted : r->err;
  sx__op_xfer_done(o->op, idx, st, st && !o->aborted ? o->msg : NULL);
}

/* Stop cutting: the ranges not cut yet settle with status now. */
static void stop(sop *o, int status, const char *msg) {
  if (o->aborted == 0) {
    o->aborted = status;
    if (msg != NULL && o->msg[0] == '\0')
      snprintf(o->msg, sizeof(o->msg), "%s", msg);
  }
  size_t from = o->cur;
  o->cur = o->n;
  o->cur_off = 0;
  for (size_t i = from; i < o->n; i++)
    try_settle(o, i);
}

static void piece_free(sx__mem_notice *n) {
  free((char *)n - offsetof(piece, note));
}

static void piece_end(piece *pc) {
  sop *o = pc->o;
  if (pc->chunk != NULL)
    sx__stage_chunk_put(o->st, SX__STAGE_READ, pc->chunk);
  o->live++; /* o outlives the settles and the pump */
  for (size_t j = 0; j < pc->k; j++)
    o->r[pc->part[j].idx].outstanding--;
  for (size_t j = 0; j < pc->k; j++)
    try_settle(o, pc->part[j].idx);
  /* tcp_read.c may still look at the piece's op after its done returned:
   * it is freed in a later loop iteration. */
  sx__mem_notifier *nf = sx__stage_notifier(o->st);
  pc->note.fn = piece_free;
  if (nf != NULL)
    sx__mem_notice_post(nf, &pc->note);
  else
    free(pc);
  pump(o);
  o->live--;
  o->live--; /* the piece's */
  sop_maybe_free(o);
}

static void copied(sx__mem_notice *n) {
  piece *pc = (piece *)((char *)n - offsetof(piece, note));
  piece_end(pc);
}

/* tcp_read.c settled the piece: its bytes are in the chunk (or in place);
 * for a write, the consumer acknowledged them. */
static void piece_done(sx_op *pop) {
  piece *pc = pop->owner;
  sop *o = pc->o;
  if (pc->prev)
    pc->prev->next = pc->next;
  else
    o->posted = pc->next;
  if (pc->next)
    pc->next->prev = pc->prev;
  size_t ok = 0;
  for (size_t j = 0; j < pc->k; j++) {
    if (pc->x[j].status != 0)
      record(o, pc->part[j].idx, pc->x[j].status, pop->message);
    else
      ok++;
  }
  if (ok == 0 || pc->chunk == NULL || o->aborted || o->write) {
    piece_end(pc);
    return;
  }
  /* The ranges that arrived go from the chunk to their destinations in
   * one call (a gather launch for several, one copy for one). */
  sx__mem_range one, *rg = ok == 1 ? &one : malloc(ok * sizeof(*rg));
  int dev = o->r[pc->part[0].idx].device, rc = rg == NULL ? SX_ENOMEM : 0;
  size_t m = 0;
  for (size_t j = 0; j < pc->k && rc == 0; j++)
    if (pc->x[j].status == 0)
      rg[m++] = (sx__mem_range){
          (uint64_t)(uintptr_t)(o->op->xfers[pc->part[j].idx].local + pc->part[j].off),
          (uint64_t)(uintptr_t)pc->x[j].local, pc->x[j].length};
  sx__mem_stream *s;
  if (rc == 0)
    rc = sx__stage_stream(o->st, SX__STAGE_READ, dev, &s);
  if (rc == 0)
    rc = sx__mem_gather(s, rg, m, SX__GATHER_SM_OK, SX__COPY_AUTO, NULL);
  if (rg != &one)
    free(rg);
  if (rc == 0) {
    pc->note.fn = copied;
    rc = sx__mem_notify(s, sx__stage_notifier(o->st), &pc->note);
    if (rc != 0)
      sx__mem_stream_sync(s); /* the copy must be over before the chunk is reused */
  }
  if (rc != 0) {
    for (size_t j = 0; j < pc->k; j++)
      record(o, pc->part[j].idx, rc, rc == SX_ENOMEM ? NULL : sx_errmsg());
    piece_end(pc);
  }
}

/* Hand the piece to tcp_read.c.  0, or the piece ended with the error. */
static int piece_post(piece *pc) {
  sop *o = pc->o;
  pc->next = o->posted;
  if (pc->next)
    pc->next->prev = pc;
  o->posted = pc;
  int rc = sx__tcp_post(o->tp, &pc->op);
  if (rc != 0) {
    o->posted = pc->next;
    if (pc->next)
      pc->next->prev = NULL;
    for (size_t j = 0; j < pc->k; j++)
      record(o, pc->part[j].idx, rc, sx_errmsg());
    stop(o, rc, NULL);
    piece_end(pc);
  }
  return rc;
}

/* A write's piece is in its chunk: send it (unless the op stopped). */
static void staged(sx__mem_notice *n) {
  piece *pc = (piece *)((char *)n - offsetof(piece, note));
  if (pc->o->aborted)
    piece_end(pc);
  else
    piece_post(pc);
}

/* Copy a write's piece from the device into its chunk; it is sent once
 * the copy finished.  0, or the piece ended with the error. */
static int piece_stage(piece *pc, const uint8_t *src) {
  sop *o = pc->o;
  sx__mem_stream *s;
  int rc = sx__stage_stream(o->st, SX__STAGE_READ, o->r[pc->part[0].idx].device, &s);
  if (rc == 0)
    rc = sx__mem_copy_async(s, pc->chunk, src, (size_t)pc->x[0].length);
  if (rc == 0) {
    pc->note.fn = staged;
    if ((rc = sx__mem_notify(s, sx__stage_notifier(o->st), &pc->note)) != 0)
      sx__mem_stream_sync(s); /* the copy must be over before the chunk is reused */
  }
  if (rc != 0) {
    record(o, pc->part[0].idx, rc, sx_errmsg());
    stop(o, rc, NULL);
    piece_end(pc);
  }
  return rc;
}

static void chunk_ready(sx__stage_wait *w, void *chunk) {
  sop *o = (sop *)((char *)w - offsetof(sop, wait));
  o->waiting = 0;
  o->ready = chunk;
  o->live++;
  pump(o);
  o->live--;
  sop_maybe_free(o);
}

/* Cut and post pieces while there is staging for them. */
static void pump(sop *o) {
  size_t chunk_size = sx__stage_chunk_size(o->st);
  while (o->cur < o->n && !o->aborted && !o->waiting) {
    sx_xfer *x = &o->op->xfers[o->cur];
    int dev = o->r[o->cur].device;
    uint64_t len = x->length - o->cur_off;
    void *chunk = NULL;
    if (dev >= 0) {
      if (len > chunk_size)
        len = chunk_size;
      if (o->ready != NULL) {
        chunk = o->ready;
        o->ready = NULL;
      } else {
        o->wait.fn = chunk_ready;
        int rc = sx__stage_chunk_get(o->st, SX__STAGE_READ, &o->wait, &chunk);
        if (rc == 1) {
          o->waiting = 1;
          return;
        }
        if (rc < 0) {
          stop(o, rc, sx_errmsg());
          return;
        }
      }
    }
    /* A read's whole ranges that fit the chunk behind this one, into the
     * same device, share it (not a write's: each of those is sent as its
     * copy ended). */
    size_t k = 1;
    uint64_t fill = len;
    if (chunk != NULL && !o->write && o->cur_off == 0 && len == x->length)
      while (k < SX__STAGE_GROUP && o->cur + k < o->n && o->r[o->cur + k].device == dev &&
             o->op->xfers[o->cur + k].length <= chunk_size - fill) {
        fill += o->op->xfers[o->cur + k].length;
        k++;
      }
    piece *pc = calloc(1, sizeof(*pc) + k * (sizeof(sx_xfer) + sizeof(ppart)));
    if (pc == NULL) {
      if (chunk != NULL)
        sx__stage_chunk_put(o->st, SX__STAGE_READ, chunk);
      stop(o, SX_ENOMEM, "tcp: staging: out of memory");
      return;
    }
    pc->x = (sx_xfer *)(pc + 1);
    pc->part = (ppart *)(pc->x + k);
    pc->k = k;
    pc->o = o;
    pc->chunk = chunk;
    const uint8_t *src = x->local + o->cur_off;
    uint64_t at = 0;
    for (size_t j = 0; j < k; j++) {
      const sx_xfer *xj = &o->op->xfers[o->cur];
      uint64_t lj = j == 0 ? len : xj->length;
      pc->part[j] = (ppart){.idx = o->cur, .off = o->cur_off};
      pc->x[j] = *xj;
      pc->x[j].local = chunk != NULL ? (uint8_t *)chunk + at : xj->local + o->cur_off;
      pc->x[j].lreg = NULL;
      pc->x[j].roff = xj->roff + o->cur_off;
      pc->x[j].length = lj;
      pc->x[j].status = 1;
      at += lj;
      o->r[o->cur].outstanding++;
      if ((o->cur_off += lj) == xj->length) {
        o->cur++;
        o->cur_off = 0;
      }
    }
    pc->op = (sx_op){.xfers = pc->x, .n = k, .pending = k, .done = piece_done, .owner = pc};
    o->live++;
    if ((o->write && chunk != NULL ? piece_stage(pc, src) : piece_post(pc)) != 0)
      return;
  }
}

/* Where each range's destination lives; 1 when any is GPU memory. */
static int classify(const sx_op *op, srange *r) {
  int gpu = 0;
  for (size_t i = 0; i < op->n; i++) {
    const sx_xfer *x = &op->xfers[i];
    sx__mem_info m;
    if (x->lreg != NULL)
      m = x->lreg->mem;
    else
      sx__mem_query(x->local, &m);
    if (r != NULL)
      r[i].device = m.kind == SX__MEM_CUDA ? m.device : -1;
    gpu |= m.kind == SX__MEM_CUDA;
  }
  return gpu;
}

int sx__tcp_stage_post(sx_tpeer *tp, sx_op *op) {
  if (!classify(op, NULL))
    return sx__tcp_post(tp, op);
  tcp_t *t = (tcp_t *)tp->t;
  sx__tcp_stage *st;
  int rc = sx__tcp_stage_get(t, &st);
  if (rc)
    return rc;
  sop *o = calloc(1, sizeof(*o));
  srange *r = calloc(op->n, sizeof(*r));
  if (o == NULL || r == NULL) {
    free(o);
    free(r);
    return sx__err(SX_ENOMEM, "tcp: staging");
  }
  classify(op, r);
  *o = (sop){.st = st, .tp = tp, .op = op, .n = op->n, .r = r, .unsettled = op->n,
             .write = sx__tcp_peer_writes(tp)};
  void **head = sx__stage_sops(st);
  o->next = *head;
  if (o->next)
    o->next->prev = o;
  *head = o;
  sx__stage_hold(st);
  o->live++; /* nothing settles the op inside this call */
  pump(o);
  o->live--;
  sop_maybe_free(o);
  return 0;
}

static void abort_sop(sop *o, int status) {
  o->live++;
  stop(o, status, NULL);
  if (o->waiting) {
    sx__stage_unwait(o->st, SX__STAGE_READ, &o->wait);
    o->waiting = 0;
  }
  /* tcp_read.c settles each piece inside its abort (drained from then on);
   * pieces whose device copy is running settle when it finished. */
  for (piece *pc = o->posted, *next; pc != NULL; pc = next) {
    next = pc->next;
    sx__tcp_abort(o->tp, &pc->op, status);
  }
  o->live--;
  sop_maybe_free(o);
}

void sx__tcp_stage_abort(sx_tpeer *tp, sx_op *op, int status) {
  tcp_t *t = (tcp_t *)tp->t;
  for (sop *o = t->stage ? *sx__stage_sops(t->stage) : NULL; o; o = o->next) {
    if (o->op == op && o->tp == tp) {
      abort_sop(o, status);
      return;
    }
  }
  sx__tcp_abort(tp, op, status);
}

void sx__stage_read_abort_all(sx__tcp_stage *st, sx_tpeer *peer, int status) {
  for (;;) {
    sop *o = *sx__stage_sops(st);
    while (o != NULL && (o->st != st || (peer != NULL && o->tp != peer) || o->aborted))
      o = o->next;
    if (o == NULL)
      return;
    abort_sop(o, status);
  }
}

void sx__tcp_stage_peer_close(sx_tpeer *tp) {
  tcp_t *t = (tcp_t *)tp->t;
  if (t->stage != NULL)
    sx__stage_read_abort_all(t->stage, tp, SX_ECANCELED);
  sx__tcp_peer_close(tp);
}
