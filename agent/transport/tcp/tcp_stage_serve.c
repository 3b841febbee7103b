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
 * longer pays a device copy, a notice and a write of its own.  READVs of
 * GPU memory go in groups the same way (a reply each, with the bytes of
 * its ranges one after the other); one that a chunk does not hold alone
 * goes through as many chunks as it takes, a gather each.
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
  uint64_t len, issued, written; /* bytes of all the parts */
  uint32_t refs;       /* copies and writes in flight */
  int failed;
  sx__mem_stream *stream;
  sx__stage_wait wait;
  int waiting;
  void *ready;         /* a chunk a waiter was handed */
  size_t n;            /* parts, */
  size_t replies;      /* of so many replies (> 1: all in one chunk) */
  struct gpart *parts;
};

/* One range to send: where its bytes are, and the header of its reply
 * when one starts with it. */
typedef struct gpart {
  sx_lregion *l;
  const uint8_t *src;  /* device memory */
  uint64_t len;
  int head;
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
  for (size_t i = 0; i < r->n; i++)
    r->parts[i].l->inflight--;
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
  if (r->replies > 1) {
    /* Replies in one chunk: each reply's header, then its bytes. */
    size_t at = 0;
    b = malloc((r->n + r->replies) * sizeof(*b));
    for (size_t i = 0; b != NULL && i < r->n; i++) {
      if (r->parts[i].head)
        b[nb++] = uv_buf_init((char *)r->parts[i].hdr, SX__FRAME_HDR);
      b[nb++] = uv_buf_init((char *)sc->chunk + at, (unsigned)r->parts[i].len);
      at += r->parts[i].len;
    }
  } else {
    if (sc->first)
      b[nb++] = uv_buf_init((char *)r->parts[0].hdr, SX__FRAME_HDR);
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

/* Bytes [from, from + len) of the parts, one after the other, into chunk:
 * one gather (several replies fit one chunk; one may take several). */
static int group_copy(sx__tcp_sreply *r, void *chunk, uint64_t from, uint64_t len) {
  sx__mem_range *rg = malloc(r->n * sizeof(*rg));
  if (rg == NULL)
    return sx__err(SX_ENOMEM, "tcp: staging");
  uint64_t at = 0, end = from + len, dst = (uint64_t)(uintptr_t)chunk;
  size_t k = 0;
  for (size_t i = 0; i < r->n && at < end; i++) {
    uint64_t a = at, b = at + r->parts[i].len;
    at = b;
    if (b <= from)
      continue;
    uint64_t s0 = a < from ? from : a, e0 = b < end ? b : end;
    rg[k++] = (sx__mem_range){dst + (s0 - from),
                              (uint64_t)(uintptr_t)(r->parts[i].src + (s0 - a)), e0 - s0};
  }
  /* Device memory to pinned memory: the kernel may touch both. */
  int rc = sx__mem_gather(r->stream, rg, k, SX__GATHER_SM_OK, SX__COPY_AUTO, NULL);
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
      rc = group_copy(r, chunk, r->issued, sc->len);
    else
      rc = sx__mem_copy_async(r->stream, chunk, r->parts[0].src + r->issued, sc->len);
    if (rc == 0 && (rc = sx__mem_notify(r->stream, sx__stage_notifier(r->st),
                                        &sc->note)) != 0)
      sx__mem_stream_sync(r->stream); /* the chunk is free only after the copy */
    if (rc != 0) {
      const sx_tctx *x = sx__stage_ctx(r->st);
      x->log(x->agent, SX_LOG_ERROR, "tcp: staging region %u: %s", r->parts[0].l->r.id,
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
  if (rc == 0 && (r == NULL || (r->parts = calloc(n, sizeof(gpart))) == NULL))
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
  r->n = n;
  for (size_t i = 0; i < n; i++) {
    const uint8_t *src = (const uint8_t *)(uintptr_t)(rd[i].l->r.addr + rd[i].off);
    r->parts[i] = (gpart){.l = rd[i].l, .src = src, .len = rd[i].len, .head = i == 0 || rd[i].head};
    if (r->parts[i].head) {
      /* The reply's header: its ranges' bytes in all. */
      uint64_t len = rd[i].len;
      for (size_t k = i + 1; k < n && !rd[k].head; k++)
        len += rd[k].len;
      sx__frame f = {.type = SX__FRAME_READ_REPLY, .id = rd[i].id, .length = len};
      sx__frame_encode(&f, r->parts[i].hdr);
      r->replies++;
    }
    r->len += rd[i].len;
    rd[i].l->inflight++;
  }
  if (r->replies > 1 && r->len > sx__stage_chunk_size(st)) {
    /* The caller groups only what one chunk holds. */
    r->failed = 1;
    rc = sx__err(SX_EPROTO, "tcp: a staged group of %zu replies is larger than a chunk (a bug)",
                 r->replies);
  }
  sx__stage_hold(st);
  *slot = r;
  if (rc != 0) {
    const sx_tctx *x = sx__tcp_ctx(t);
    x->log(x->agent, SX_LOG_ERROR, "%s", sx_errmsg());
    r->c = NULL;
    r->h = NULL;
    sx__conn_resume(c, SX__CONN_READ, rc);
    r_maybe_free(r);
    return;
  }
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
