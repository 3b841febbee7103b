/*
 * Staging, target side: a READ of a GPU region is answered from pinned
 * chunks, each filled by a device-to-host copy and written to the socket
 * as soon as the copy finished, so copying chunk n+1 overlaps sending
 * chunk n (see tcp_stage.h).  The chunks of one reply go through one
 * stream, so their copies, and so their writes, come in order.
 *
 * Small READs that arrived together (a reader's batch of small blocks) are
 * answered as a group: one gather launch copies all of them into one
 * chunk, one notice, one write of every reply; so a 32 KiB block no
 * longer pays a device copy, a notice and a write of its own.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "tcp_int.h"
#include "tcp_stage.h"

struct sx__tcp_sreply {
  sx__tcp_stage *st;
  sx__conn *c;         /* NULL once detached or resumed */
  sx__conn *h;         /* written to; NULL once detached */
  sx_lregion *l;
  const uint8_t *src;  /* the region's bytes being read (device memory) */
  uint64_t len, issued, written;
  uint32_t refs;       /* copies and writes in flight */
  int failed;
  sx__mem_stream *stream;
  sx__stage_wait wait;
  int waiting;
  void *ready;         /* a chunk a waiter was handed */
  uint8_t hdr[SX__FRAME_HDR];
  size_t n;            /* > 1: a group (below), answered from one chunk */
  struct gpart *parts;
};

/* One READ of a group: its header and where its bytes are. */
typedef struct gpart {
  sx_lregion *l;
  const uint8_t *src;
  uint64_t len;
  uint8_t hdr[SX__FRAME_HDR];
} gpart;

typedef struct schunk {
  sx__mem_notice note;
  sx__conn_wreq wr;
  sx__tcp_sreply *r;
  void *chunk;
  size_t len;
  int first;
} schunk;

static void issue(sx__tcp_sreply *r);

static void r_maybe_free(sx__tcp_sreply *r) {
  if (r->refs > 0 || r->waiting || (r->h != NULL && !r->failed && r->written < r->len))
    return;
  sx__tcp_stage *st = r->st;
  if (r->ready != NULL)
    sx__stage_chunk_put(st, SX__STAGE_SERVE, r->ready);
  /* No copy reads the regions any more. */
  if (r->n > 1)
    for (size_t i = 0; i < r->n; i++)
      r->parts[i].l->inflight--;
  else
    r->l->inflight--;
  free(r->parts);
  free(r);
  sx__stage_release(st);
}

/* Something broke: nothing more is written, and the connection closes. */
static void r_fail(sx__tcp_sreply *r, int err) {
  r->failed = 1;
  sx__conn *c = r->c;
  r->c = NULL;
  r->h = NULL;
  if (r->waiting) {
    sx__stage_unwait(r->st, SX__STAGE_SERVE, &r->wait);
    r->waiting = 0;
  }
  if (c != NULL)
    sx__conn_resume(c, SX__CONN_READ, err);
}

static void written(sx__conn_wreq *req, int status) {
  schunk *sc = req->data;
  sx__tcp_sreply *r = sc->r;
  (void)status; /* a failed write is the connection's end: conn.c sees it */
  sx__stage_chunk_put(r->st, SX__STAGE_SERVE, sc->chunk);
  free(sc);
  r->refs--;
  r_maybe_free(r);
}

/* The copy of sc finished: its bytes go to the socket. */
static void copied(sx__mem_notice *n) {
  schunk *sc = (schunk *)((char *)n - offsetof(schunk, note));
  sx__tcp_sreply *r = sc->r;
  if (r->h == NULL || r->failed) {
    sx__stage_chunk_put(r->st, SX__STAGE_SERVE, sc->chunk);
    free(sc);
    r->refs--;
    r_maybe_free(r);
    return;
  }
  uv_buf_t two[2], *b = two;
  unsigned nb = 0;
  if (r->n > 1 && (b = malloc(2 * r->n * sizeof(*b))) != NULL) {
    /* A group: every reply's header, then its bytes from the chunk. */
    size_t at = 0;
    for (size_t i = 0; i < r->n; i++) {
      b[nb++] = uv_buf_init((char *)r->parts[i].hdr, SX__FRAME_HDR);
      b[nb++] = uv_buf_init((char *)sc->chunk + at, (unsigned)r->parts[i].len);
      at += r->parts[i].len;
    }
  } else if (r->n <= 1) {
    if (sc->first)
      b[nb++] = uv_buf_init((char *)r->hdr, SX__FRAME_HDR);
    b[nb++] = uv_buf_init(sc->chunk, (unsigned)sc->len);
  }
  sc->wr.data = sc;
  int wrc = b == NULL ? UV_ENOMEM : sx__conn_write(r->h, &sc->wr, b, nb, written);
  if (b != two)
    free(b); /* the write keeps a copy of the buffer list */
  if (wrc != 0) {
    sx__stage_chunk_put(r->st, SX__STAGE_SERVE, sc->chunk);
    free(sc);
    r->refs--;
    r_fail(r, SX_EDISCONN);
    r_maybe_free(r);
    return;
  }
  r->written += sc->len;
  if (r->written == r->len && r->c != NULL) {
    /* The whole reply is queued: the connection may go on parsing. */
    sx__conn *c = r->c;
    r->c = NULL;
    sx__conn_resume(c, SX__CONN_READ, 0);
  }
}

static void chunk_ready(sx__stage_wait *w, void *chunk) {
  sx__tcp_sreply *r = (sx__tcp_sreply *)((char *)w - offsetof(sx__tcp_sreply, wait));
  r->waiting = 0;
  r->ready = chunk;
  issue(r);
  r_maybe_free(r);
}

/* A group's READs into one chunk, one after the other: one gather. */
static int group_copy(sx__tcp_sreply *r, void *chunk) {
  sx__mem_range *rg = malloc(r->n * sizeof(*rg));
  if (rg == NULL)
    return sx__err(SX_ENOMEM, "tcp: staging");
  uint64_t at = (uint64_t)(uintptr_t)chunk;
  for (size_t i = 0; i < r->n; i++) {
    rg[i] = (sx__mem_range){at, (uint64_t)(uintptr_t)r->parts[i].src, r->parts[i].len};
    at += r->parts[i].len;
  }
  /* Device memory to pinned memory: the kernel may touch both. */
  int rc = sx__mem_gather(r->stream, rg, r->n, SX__GATHER_SM_OK, SX__COPY_AUTO, NULL);
  free(rg);
  return rc;
}

/* Queue copies into as many chunks as there are, up to the whole reply. */
static void issue(sx__tcp_sreply *r) {
  size_t csize = sx__stage_chunk_size(r->st);
  while (r->issued < r->len && !r->failed && r->h != NULL) {
    void *chunk = r->ready;
    int rc = 0;
    r->ready = NULL;
    r->wait.fn = chunk_ready;
    if (chunk == NULL)
      rc = sx__stage_chunk_get(r->st, SX__STAGE_SERVE, &r->wait, &chunk);
    if (rc == 1) {
      r->waiting = 1;
      return;
    }
    schunk *sc = rc == 0 ? calloc(1, sizeof(*sc)) : NULL;
    if (sc == NULL) {
      if (rc == 0)
        sx__stage_chunk_put(r->st, SX__STAGE_SERVE, chunk);
      r_fail(r, rc ? rc : SX_ENOMEM);
      return;
    }
    uint64_t left = r->len - r->issued;
    *sc = (schunk){.r = r, .chunk = chunk, .len = left < csize ? (size_t)left : csize,
                   .first = r->issued == 0, .note.fn = copied};
    if (r->n > 1)
      rc = group_copy(r, chunk);
    else
      rc = sx__mem_copy_async(r->stream, chunk, r->src + r->issued, sc->len);
    if (rc == 0 && (rc = sx__mem_notify(r->stream, sx__stage_notifier(r->st),
                                        &sc->note)) != 0)
      sx__mem_stream_sync(r->stream); /* the chunk is free only after the copy */
    if (rc != 0) {
      const sx_tctx *x = sx__stage_ctx(r->st);
      x->log(x->agent, SX_LOG_ERROR, "tcp: staging region %u: %s", r->l->r.id,
             sx_errmsg());
      sx__stage_chunk_put(r->st, SX__STAGE_SERVE, chunk);
      free(sc);
      r_fail(r, rc);
      return;
    }
    r->issued += sc->len;
    r->refs++;
  }
}

uint64_t sx__tcp_stage_group_bytes(tcp_t *t) {
  sx__tcp_stage *st;
  return sx__tcp_stage_get(t, &st) == 0 ? sx__stage_chunk_size(st) : 0;
}

void sx__tcp_stage_reply(tcp_t *t, sx__conn *c, void **slot, const sx__tcp_sread *rd,
                         size_t n) {
  sx__tcp_stage *st;
  sx_lregion *l = rd[0].l;
  int rc = sx__tcp_stage_get(t, &st);
  sx__tcp_sreply *r = rc == 0 ? calloc(1, sizeof(*r)) : NULL;
  if (rc == 0 && (r == NULL || (n > 1 && (r->parts = calloc(n, sizeof(gpart))) == NULL)))
    rc = sx__err(SX_ENOMEM, "tcp: staging");
  if (rc == 0)
    rc = sx__stage_stream(st, SX__STAGE_SERVE, l->mem.device, &r->stream);
  if (rc != 0) {
    if (r != NULL)
      free(r->parts);
    free(r);
    const sx_tctx *x = sx__tcp_ctx(t);
    x->log(x->agent, SX_LOG_ERROR, "tcp: cannot stage region %u: %s", l->r.id,
           sx_errmsg());
    sx__conn_resume(c, SX__CONN_READ, rc);
    return;
  }
  r->st = st;
  r->c = c;
  r->h = c;
  r->l = l;
  r->n = n;
  for (size_t i = 0; i < n; i++) {
    const uint8_t *src = (const uint8_t *)(uintptr_t)(rd[i].l->r.addr + rd[i].off);
    sx__frame f = {.type = SX__FRAME_READ_REPLY, .id = rd[i].id, .length = rd[i].len};
    if (n > 1) {
      r->parts[i] = (gpart){.l = rd[i].l, .src = src, .len = rd[i].len};
      sx__frame_encode(&f, r->parts[i].hdr);
    } else {
      r->src = src;
      sx__frame_encode(&f, r->hdr);
    }
    r->len += rd[i].len;
    rd[i].l->inflight++;
  }
  sx__stage_hold(st);
  *slot = r;
  issue(r);
  /* A failure inside issue() already resumed (closed) the connection. */
  if (r->failed)
    r_maybe_free(r);
}

void sx__tcp_stage_detach(sx__tcp_sreply *r) {
  r->c = NULL;
  r->h = NULL;
  if (r->waiting) {
    sx__stage_unwait(r->st, SX__STAGE_SERVE, &r->wait);
    r->waiting = 0;
  }
  r_maybe_free(r);
}
