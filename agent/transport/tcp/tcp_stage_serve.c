/*
 * Staging, target side: a READ of a GPU region is answered from pinned
 * chunks, each filled by a device-to-host copy and written to the socket
 * once its copy finished, so copying chunk n+1 overlaps sending chunk n
 * (see tcp_stage.h).
 *
 * A connection has a pipe of up to SX__STAGE_CONN_REPLIES staged replies,
 * so small replies do not each wait for the copy and the notice of the one
 * before.  Copies are issued in request order (a reply's chunks after
 * those of the replies before it) and may run on different streams; the
 * chunks are written strictly in the order they were issued, a chunk whose
 * copy finished early waiting for those before it.  So each reply frame
 * goes out whole, in request order, and nothing else is written to the
 * socket in between (tcp_serve.c parses nothing but staged READs while
 * replies are pending).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "tcp_int.h"
#include "tcp_stage.h"

typedef struct sreply sreply;

struct sreply {
  sreply *next;         /* in p->rq while chunks are still to issue */
  sx__tcp_spipe *p;
  sx_lregion *l;        /* inflight held while a copy may read it */
  const uint8_t *src;   /* the region's bytes being read (device memory) */
  uint64_t len, issued, written;
  uint32_t refs;        /* chunks alive (copying, waiting, being written) */
  int cut;              /* the pipe stopped: nothing more is issued */
  sx__mem_stream *stream;
  uint8_t hdr[SX__FRAME_HDR];
};

typedef struct schunk {
  sx__mem_notice note;
  uv_write_t wr;
  struct schunk *next;  /* in p->wq until written */
  sreply *r;
  void *chunk;
  size_t len;
  int first, copied;
} schunk;

struct sx__tcp_spipe {
  sx__tcp_stage *st;
  sconn *c;             /* NULL once stopped */
  uv_stream_t *h;       /* NULL once stopped: nothing more is written */
  int detached;         /* the connection let go of it */
  sreply *rq, **rq_tail; /* replies with chunks still to issue, in order */
  schunk *wq, **wq_tail; /* chunks issued and not written yet, in order */
  uint32_t pending;     /* replies not yet queued whole */
  uint32_t live;        /* replies and chunks alive, plus guards */
  sx__stage_wait wait;
  int waiting;
};

static void issue(sx__tcp_spipe *p, void *ready);

static void p_maybe_free(sx__tcp_spipe *p) {
  if (!p->detached || p->live > 0)
    return;
  sx__tcp_stage *st = p->st;
  free(p);
  sx__stage_release(st);
}

static void r_maybe_free(sreply *r) {
  if (r->refs > 0 || (r->issued < r->len && !r->cut))
    return;
  sx__tcp_spipe *p = r->p;
  r->l->inflight--; /* no copy reads the region any more */
  free(r);
  p->live--;
  p_maybe_free(p);
}

/* The chunk is done with (written, or dropped): back to the pool. */
static void chunk_end(schunk *sc) {
  sreply *r = sc->r;
  sx__tcp_spipe *p = r->p;
  /* The put may hand the chunk to a waiter at once; r and p stay counted
   * until after it. */
  sx__stage_chunk_put(p->st, SX__STAGE_SERVE, sc->chunk);
  free(sc);
  p->live--;
  r->refs--;
  r_maybe_free(r);
}

/* Stopped: chunks whose copies finished are written no more. */
static void drop_copied(sx__tcp_spipe *p) {
  schunk **pp = &p->wq;
  while (*pp != NULL) {
    schunk *sc = *pp;
    if (sc->copied) {
      *pp = sc->next;
      chunk_end(sc);
    } else {
      pp = &sc->next;
    }
  }
  p->wq_tail = pp;
}

/* Nothing more is issued or written: the connection is gone or closing.
 * Copies running end in copied(), writes queued in written(). */
static void stop(sx__tcp_spipe *p) {
  p->c = NULL;
  p->h = NULL;
  if (p->waiting) {
    sx__stage_unwait(p->st, SX__STAGE_SERVE, &p->wait);
    p->waiting = 0;
  }
  drop_copied(p);
  sreply *r = p->rq;
  p->rq = NULL;
  p->rq_tail = &p->rq;
  while (r != NULL) {
    sreply *next = r->next;
    r->cut = 1;
    r_maybe_free(r);
    r = next;
  }
}

/* Something broke: nothing more is written, and the connection closes.
 * The caller holds a guard on p. */
static void fail(sx__tcp_spipe *p, int err) {
  sconn *c = p->c;
  stop(p);
  if (c != NULL)
    sx__tcp_sconn_resume(c, err);
}

static void written(uv_write_t *req, int status) {
  schunk *sc = req->data;
  sx__tcp_spipe *p = sc->r->p;
  (void)status; /* a failed write is the connection's end: tcp_serve.c sees it */
  p->live++;
  chunk_end(sc);
  p->live--;
  p_maybe_free(p);
}

/* Write the chunks whose copies finished, in the order they were issued;
 * the connection hears of every reply queued whole.  The caller holds a
 * guard on p. */
static void write_ready(sx__tcp_spipe *p) {
  int whole = 0;
  if (p->h == NULL) {
    drop_copied(p);
    return;
  }
  while (p->wq != NULL && p->wq->copied) {
    schunk *sc = p->wq;
    sreply *r = sc->r;
    if ((p->wq = sc->next) == NULL)
      p->wq_tail = &p->wq;
    uv_buf_t b[2];
    unsigned nb = 0;
    if (sc->first)
      b[nb++] = uv_buf_init((char *)r->hdr, SX__FRAME_HDR);
    b[nb++] = uv_buf_init(sc->chunk, (unsigned)sc->len);
    sc->wr.data = sc;
    if (uv_write(&sc->wr, p->h, b, nb, written) != 0) {
      chunk_end(sc);
      fail(p, SX_EDISCONN);
      return;
    }
    if ((r->written += sc->len) == r->len) {
      p->pending--;
      whole = 1;
    }
  }
  /* A reply is queued whole: the connection may parse on (it may stage
   * more replies on p here). */
  if (whole && p->c != NULL)
    sx__tcp_sconn_resume(p->c, 0);
}

/* The copy of sc finished. */
static void copied(sx__mem_notice *n) {
  schunk *sc = (schunk *)((char *)n - offsetof(schunk, note));
  sx__tcp_spipe *p = sc->r->p;
  sc->copied = 1;
  p->live++;
  write_ready(p);
  p->live--;
  p_maybe_free(p);
}

static void chunk_ready(sx__stage_wait *w, void *chunk) {
  sx__tcp_spipe *p = (sx__tcp_spipe *)((char *)w - offsetof(sx__tcp_spipe, wait));
  p->waiting = 0;
  p->live++;
  issue(p, chunk);
  p->live--;
  p_maybe_free(p);
}

/* Queue copies into as many chunks as there are, reply after reply in
 * request order (ready: a chunk a waiter was handed, or NULL).  The caller
 * holds a guard on p. */
static void issue(sx__tcp_spipe *p, void *ready) {
  size_t csize = sx__stage_chunk_size(p->st);
  while (p->rq != NULL && p->h != NULL) {
    sreply *r = p->rq;
    void *chunk = ready;
    int rc = 0;
    ready = NULL;
    if (chunk == NULL) {
      p->wait.fn = chunk_ready;
      rc = sx__stage_chunk_get(p->st, SX__STAGE_SERVE, &p->wait, &chunk);
      if (rc == 1) {
        p->waiting = 1;
        return;
      }
    }
    schunk *sc = rc == 0 ? calloc(1, sizeof(*sc)) : NULL;
    if (sc == NULL) {
      if (rc == 0)
        sx__stage_chunk_put(p->st, SX__STAGE_SERVE, chunk);
      fail(p, rc ? rc : SX_ENOMEM);
      return;
    }
    uint64_t left = r->len - r->issued;
    *sc = (schunk){.r = r, .chunk = chunk, .len = left < csize ? (size_t)left : csize,
                   .first = r->issued == 0, .note.fn = copied};
    rc = sx__mem_copy_async(r->stream, chunk, r->src + r->issued, sc->len);
    if (rc == 0 && (rc = sx__mem_notify(r->stream, sx__stage_notifier(p->st),
                                        &sc->note)) != 0)
      sx__mem_stream_sync(r->stream); /* the chunk is free only after the copy */
    if (rc != 0) {
      const sx_tctx *x = sx__stage_ctx(p->st);
      x->log(x->agent, SX_LOG_ERROR, "tcp: staging region %u: %s", r->l->r.id,
             sx_errmsg());
      sx__stage_chunk_put(p->st, SX__STAGE_SERVE, chunk);
      free(sc);
      fail(p, rc);
      return;
    }
    r->issued += sc->len;
    r->refs++;
    p->live++;
    *p->wq_tail = sc;
    p->wq_tail = &sc->next;
    if (r->issued == r->len && (p->rq = r->next) == NULL)
      p->rq_tail = &p->rq;
  }
  if (ready != NULL)
    sx__stage_chunk_put(p->st, SX__STAGE_SERVE, ready);
}

void sx__tcp_stage_reply(tcp_t *t, sconn *c, uv_stream_t *h, sx__tcp_spipe **slot,
                         uint64_t id, sx_lregion *l, uint64_t off, uint64_t len) {
  sx__tcp_spipe *p = *slot;
  int rc = 0;
  if (p == NULL) {
    sx__tcp_stage *st;
    if ((rc = sx__tcp_stage_get(t, &st)) == 0 && (p = calloc(1, sizeof(*p))) == NULL)
      rc = sx__err(SX_ENOMEM, "tcp: staging");
    if (rc == 0) {
      *p = (sx__tcp_spipe){.st = st, .c = c, .h = h};
      p->rq_tail = &p->rq;
      p->wq_tail = &p->wq;
      sx__stage_hold(st);
      *slot = p;
    }
  }
  sreply *r = rc == 0 ? calloc(1, sizeof(*r)) : NULL;
  if (rc == 0 && r == NULL)
    rc = sx__err(SX_ENOMEM, "tcp: staging");
  if (rc == 0 && (rc = sx__stage_stream(p->st, SX__STAGE_SERVE, l->mem.device,
                                        &r->stream)) != 0)
    free(r);
  if (rc != 0) {
    const sx_tctx *x = sx__tcp_ctx(t);
    x->log(x->agent, SX_LOG_ERROR, "tcp: cannot stage region %u: %s", l->r.id,
           sx_errmsg());
    sx__tcp_sconn_resume(c, rc);
    return;
  }
  r->p = p;
  r->l = l;
  r->src = (const uint8_t *)(uintptr_t)(l->r.addr + off);
  r->len = len;
  sx__frame f = {.type = SX__FRAME_READ_REPLY, .id = id, .length = len};
  sx__frame_encode(&f, r->hdr);
  l->inflight++;
  p->live++;
  p->pending++;
  *p->rq_tail = r;
  p->rq_tail = &r->next;
  p->live++;
  if (!p->waiting)
    issue(p, NULL);
  /* A failure inside issue() already resumed (closed) the connection. */
  p->live--;
  p_maybe_free(p);
}

uint32_t sx__tcp_stage_pending(const sx__tcp_spipe *p) { return p != NULL ? p->pending : 0; }

void sx__tcp_stage_detach(sx__tcp_spipe *p) {
  if (p == NULL)
    return;
  p->detached = 1;
  p->live++;
  stop(p);
  p->live--;
  p_maybe_free(p);
}
