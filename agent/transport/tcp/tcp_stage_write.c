/*
 * Staging, consumer side of push mode: a WRITE into a GPU region is
 * received into pinned chunks, each copied to the device as soon as it is
 * full, so the copy of chunk n overlaps the arrival of chunk n+1 (see
 * tcp_stage.h).  The WRITE_REPLY goes only once the last device copy of
 * the WRITE finished, and the connection parses nothing after the WRITE
 * until then: replies stay in order, and the producer, which sends its
 * notice only after every reply, never announces bytes that are not on the
 * device yet.  The region's inflight holds until the last copy ended, so
 * an unregister waits for it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "tcp_int.h"
#include "tcp_stage.h"

struct sx__tcp_wstage {
  sx__tcp_stage *st;
  tcp_t *t;
  sx__tcp_wconn *w;     /* NULL once the connection closed */
  sx_lregion *l;
  uint8_t *dst;         /* device address of the payload's first byte */
  uint64_t id, len;
  uint64_t got;         /* payload bytes put into chunks (or drained) */
  sx__mem_stream *stream;
  void *chunk;          /* being filled, or NULL */
  size_t fill;
  uint64_t chunk_at;    /* payload offset of the chunk's first byte */
  uint8_t *pend;        /* payload that came with the header, no chunk yet */
  size_t npend;
  uint32_t copies;      /* device copies running */
  int status;           /* 0, or why nothing more lands (the rest is drained) */
  int waiting;          /* for a chunk (the connection does not read) */
  int done;             /* the whole payload arrived; copies may run */
  int revoking;         /* a revoke waits for the copies running */
  sx__stage_wait wait;
};

typedef struct wcopy {
  sx__mem_notice note;
  sx__tcp_wstage *ws;
  void *chunk;
} wcopy;

static void ws_maybe_free(sx__tcp_wstage *ws) {
  if (ws->w != NULL || ws->copies > 0)
    return;
  sx__tcp_stage *st = ws->st;
  if (ws->waiting)
    sx__stage_unwait(st, SX__STAGE_SERVE, &ws->wait);
  if (ws->chunk != NULL)
    sx__stage_chunk_put(st, SX__STAGE_SERVE, ws->chunk);
  free(ws->pend);
  ws->l->inflight--;
  free(ws);
  sx__stage_release(st);
}

static void ws_fail(sx__tcp_wstage *ws, int err) {
  if (ws->status == 0) {
    const sx_tctx *x = sx__tcp_ctx(ws->t);
    x->log(x->agent, SX_LOG_ERROR, "tcp: staging a write into region %u: %s", ws->l->r.id,
           sx_errmsg());
    ws->status = err;
  }
}

/* The WRITE is over (every copy ended): answer it; the connection parses
 * on (resume: it was held and must be started again). */
static void ws_finish(sx__tcp_wstage *ws, int resume) {
  sx__tcp_wconn *w = ws->w;
  const sx_tctx *x = sx__tcp_ctx(ws->t);
  x->written(x->agent, SX_TRANSPORT_TCP, ws->status ? 0 : ws->len, ws->status);
  sx__conn_reply(w->c, ws->id, SX__FRAME_WRITE_REPLY, ws->status, NULL, NULL, 0);
  w->ws = NULL;
  ws->w = NULL;
  sx__conn *c = w->c;
  ws_maybe_free(ws);
  if (sx__conn_flush(c) == 0 && resume)
    sx__conn_wresume(c);
}

static void copied(sx__mem_notice *n) {
  wcopy *wc = (wcopy *)((char *)n - offsetof(wcopy, note));
  sx__tcp_wstage *ws = wc->ws;
  sx__tcp_stage *st = ws->st; /* lives on: the chunk is still out */
  void *chunk = wc->chunk;
  free(wc);
  ws->copies--;
  if (ws->copies == 0 && ws->revoking) {
    ws->revoking = 0;
    sx__conn_revoke_release(&ws->t->srv, 0, NULL);
  }
  /* The chunk may go straight to another waiter: ws is settled first. */
  int finish = ws->w != NULL && ws->done && ws->copies == 0;
  if (ws->w == NULL)
    ws_maybe_free(ws);
  else if (finish)
    ws_finish(ws, 1);
  sx__stage_chunk_put(st, SX__STAGE_SERVE, chunk);
}

/* Copy the chunk's bytes to the device (or drop them once refused). */
static void ws_flush(sx__tcp_wstage *ws) {
  void *chunk = ws->chunk;
  if (chunk == NULL)
    return;
  ws->chunk = NULL;
  wcopy *wc = ws->status == 0 && ws->fill > 0 ? malloc(sizeof(*wc)) : NULL;
  if (wc == NULL) {
    if (ws->status == 0 && ws->fill > 0)
      ws_fail(ws, sx__err(SX_ENOMEM, "out of memory"));
    sx__stage_chunk_put(ws->st, SX__STAGE_SERVE, chunk);
    return;
  }
  *wc = (wcopy){.note.fn = copied, .ws = ws, .chunk = chunk};
  int rc = sx__mem_copy_async(ws->stream, ws->dst + ws->chunk_at, chunk, ws->fill);
  if (rc == 0 && (rc = sx__mem_notify(ws->stream, sx__stage_notifier(ws->st), &wc->note)) != 0)
    sx__mem_stream_sync(ws->stream); /* the chunk is free only after the copy */
  if (rc != 0) {
    ws_fail(ws, rc);
    free(wc);
    sx__stage_chunk_put(ws->st, SX__STAGE_SERVE, chunk);
    return;
  }
  ws->copies++;
}

/* The payload is all here: the reply waits for the copies. */
static void ws_body_done(sx__tcp_wstage *ws, int resume) {
  ws_flush(ws);
  ws->done = 1;
  if (ws->copies == 0) {
    ws_finish(ws, resume);
    return;
  }
  if (!resume)
    sx__conn_hold(ws->w->c); /* parse nothing until the reply went */
}

static void chunk_ready(sx__stage_wait *wt, void *chunk);

/* A chunk for the bytes from ws->got on: 0, or 1 (waiting: the connection
 * stops reading until chunk_ready). */
static int ws_next(sx__tcp_wstage *ws) {
  void *chunk;
  ws->wait.fn = chunk_ready;
  int rc = sx__stage_chunk_get(ws->st, SX__STAGE_SERVE, &ws->wait, &chunk);
  if (rc == 1) {
    ws->waiting = 1;
    return 1;
  }
  if (rc < 0) {
    ws_fail(ws, rc);
    return 0;
  }
  ws->chunk = chunk;
  ws->fill = 0;
  ws->chunk_at = ws->got;
  return 0;
}

/* n bytes of payload are in the chunk (or drained). */
static void ws_took(sx__tcp_wstage *ws, size_t n) {
  ws->got += n;
  if (ws->chunk != NULL) {
    ws->fill += n;
    if (ws->fill == sx__stage_chunk_size(ws->st) || ws->got == ws->len)
      ws_flush(ws);
  }
}

static void chunk_ready(sx__stage_wait *wt, void *chunk) {
  sx__tcp_wstage *ws = (sx__tcp_wstage *)((char *)wt - offsetof(sx__tcp_wstage, wait));
  ws->waiting = 0;
  ws->chunk = chunk;
  ws->fill = 0;
  ws->chunk_at = ws->got;
  if (ws->npend > 0) {
    memcpy(chunk, ws->pend, ws->npend);
    size_t n = ws->npend;
    free(ws->pend);
    ws->pend = NULL;
    ws->npend = 0;
    ws_took(ws, n);
  }
  if (ws->got == ws->len)
    ws_body_done(ws, 1);
  else
    sx__conn_wresume(ws->w->c);
}

int sx__tcp_wstage_begin(sx__tcp_wconn *w, const sx__frame *f, sx_lregion *l,
                         const uint8_t *buf, size_t avail, size_t *used) {
  tcp_t *t = w->t;
  sx__tcp_wstage *ws = calloc(1, sizeof(*ws));
  size_t take = f->length < avail ? (size_t)f->length : avail;
  sx__tcp_stage *st = NULL;
  int rc = ws == NULL ? sx__err(SX_ENOMEM, "tcp: staging a write") : sx__tcp_stage_get(t, &st);
  if (rc != 0) {
    free(ws);
    return rc;
  }
  *used = take;
  *ws = (sx__tcp_wstage){.st = st, .t = t, .w = w, .l = l, .id = f->id, .len = f->length,
                         .dst = (uint8_t *)(uintptr_t)(l->r.addr + f->offset)};
  l->inflight++;
  sx__stage_hold(st);
  w->ws = ws;
  w->id = f->id;
  w->len = f->length;
  w->type = SX__FRAME_WRITE;
  w->dst = NULL;
  w->left = f->length - take;
  if ((rc = sx__stage_stream(st, SX__STAGE_SERVE, l->mem.device, &ws->stream)) != 0)
    ws_fail(ws, rc);
  if (ws->status == 0 && ws_next(ws) == 1) {
    if (take > 0) {
      if ((ws->pend = malloc(take)) == NULL) {
        sx__stage_unwait(st, SX__STAGE_SERVE, &ws->wait);
        ws->waiting = 0;
        ws_fail(ws, sx__err(SX_ENOMEM, "out of memory"));
      } else {
        memcpy(ws->pend, buf, take);
        ws->npend = take;
      }
    }
    if (ws->waiting) {
      sx__conn_hold(w->c);
      return 0;
    }
  }
  if (ws->chunk != NULL)
    memcpy(ws->chunk, buf, take);
  ws_took(ws, take);
  if (ws->got == ws->len)
    ws_body_done(ws, 0);
  return 0;
}

void sx__tcp_wstage_alloc(sx__tcp_wstage *ws, uv_buf_t *buf) {
  uint64_t left = ws->len - ws->got;
  if (ws->chunk == NULL) {
    buf->base = (char *)ws->t->scratch; /* refused: drained */
    buf->len = left < SCRATCH_BYTES ? (size_t)left : SCRATCH_BYTES;
    return;
  }
  size_t room = sx__stage_chunk_size(ws->st) - ws->fill;
  buf->base = (char *)ws->chunk + ws->fill;
  buf->len = left < room ? (size_t)left : room;
}

void sx__tcp_wstage_read(sx__tcp_wstage *ws, size_t n) {
  ws->w->left -= n;
  ws_took(ws, n);
  if (ws->got == ws->len) {
    ws_body_done(ws, 0);
    return;
  }
  if (ws->chunk == NULL && ws->status == 0 && ws_next(ws) == 1)
    sx__conn_hold(ws->w->c);
}

int sx__tcp_wstage_holds(const sx__tcp_wstage *ws) {
  return ws->waiting || (ws->done && ws->copies > 0);
}

void sx__tcp_wstage_revoke(sx__tcp_wstage *ws) {
  if (ws->status != 0)
    return;
  ws->status = SX_EACCESS;
  if (ws->chunk != NULL) {
    sx__stage_chunk_put(ws->st, SX__STAGE_SERVE, ws->chunk); /* its bytes never land */
    ws->chunk = NULL;
  }
  if (ws->copies > 0 && !ws->revoking) {
    ws->revoking = 1;
    sx__conn_revoke_hold(&ws->t->srv);
  }
  if (ws->waiting) {
    /* Drain from now on instead of waiting for staging. */
    sx__stage_unwait(ws->st, SX__STAGE_SERVE, &ws->wait);
    ws->waiting = 0;
    ws->got += ws->npend;
    free(ws->pend);
    ws->pend = NULL;
    ws->npend = 0;
    if (ws->got == ws->len)
      ws_body_done(ws, 1);
    else
      sx__conn_wresume(ws->w->c);
  }
}

void sx__tcp_wstage_detach(sx__tcp_wstage *ws) {
  ws->w = NULL;
  if (ws->waiting) {
    sx__stage_unwait(ws->st, SX__STAGE_SERVE, &ws->wait);
    ws->waiting = 0;
  }
  ws_maybe_free(ws);
}
