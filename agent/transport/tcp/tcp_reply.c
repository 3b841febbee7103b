/*
 * The TCP transport, reader side: the replies, read straight into their
 * destinations (frame headers, payloads, and scattered payloads received
 * into their pieces with readv(); see tcp.c for the whole picture).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "internal.h"
#include "tcp_read_int.h"

void sx__tcp_c_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  cconn *c = h->data;
  (void)suggested;
  if (!c->in_payload) {
    buf->base = (char *)c->hdr + c->hgot;
    buf->len = SX__FRAME_HDR - c->hgot;
    return;
  }
  treq *r = &c->ring[c->head];
  if (r->aborted) {
    uint64_t left = r->len - c->pgot;
    buf->base = (char *)c->p->t->scratch;
    buf->len = left < SCRATCH_BYTES ? (size_t)left : SCRATCH_BYTES;
    return;
  }
  struct iovec v = sx__tcp_r_piece(r, c->vi);
  buf->base = (char *)v.iov_base + c->voff;
  buf->len = v.iov_len - c->voff;
}

/* n more bytes of r's payload arrived where sx__tcp_c_alloc(), c_readv()
 * or a data-mover thread put them: move to the piece they end in. */
void sx__tcp_c_advance(cconn *c, const treq *r, uint64_t n) {
  uint32_t pieces = sx__tcp_r_pieces(r);
  while (n > 0 && c->vi < pieces) {
    uint64_t room = sx__tcp_r_piece(r, c->vi).iov_len - c->voff;
    if (n < room) {
      c->voff += n;
      return;
    }
    n -= room;
    c->vi++;
    c->voff = 0;
  }
}

/* The most pieces one readv() fills (IOV_MAX is 1024 on Linux; this many
 * cover a 1 MiB range of 4 KiB pieces). */
#define READV_PIECES 256
/*
 * Receive what the socket holds of r's payload straight into its
 * destination (a scattered one into its pieces, up to READV_PIECES of them
 * at a time) with readv(): libuv reads into one buffer per system call.
 * (Scattered pieces through a buffer and copied out, with cached or
 * streaming stores, measured no cheaper: small pieces cost about twice per
 * byte what one buffer does either way.)  When another reply is due on c,
 * the same call asks for its header too (into c->hdr, c->hgot saying how
 * much came), which saves a system call per request: a reply then costs
 * one readv() where libuv needs two (header, payload).  Nothing past that
 * header is asked for.  Reading the descriptor here, on the loop thread
 * inside the read callback, is safe: libuv's next read of it just finds it
 * empty (EAGAIN).  0, or -1 when the connection failed (sx__tcp_c_fail()
 * has run: r is settled).
 */
static int c_readv(cconn *c, treq *r) {
  uint32_t pieces = sx__tcp_r_pieces(r);
  uint64_t ahead = c->count > 1 ? SX__FRAME_HDR : 0; /* the next header */
  uv_os_fd_t fd;
  char msg[512];
  if (uv_fileno((const uv_handle_t *)&c->h, &fd) != 0)
    return 0; /* libuv's reads carry on, one piece at a time */
  while (c->pgot < r->len && c->vi < pieces) {
    uint64_t left = r->len - c->pgot, more = 0;
    struct iovec v[READV_PIECES + 1];
    int n = 0;
    uint32_t i = c->vi;
    for (; i < pieces && n < READV_PIECES; i++)
      v[n++] = sx__tcp_r_piece(r, i);
    v[0].iov_base = (char *)v[0].iov_base + c->voff;
    v[0].iov_len -= c->voff;
    if (i == pieces && ahead)
      v[n++] = (struct iovec){c->hdr, SX__FRAME_HDR};
    ssize_t got = readv(fd, v, n);
    if (got > 0) {
      more = (uint64_t)got > left ? (uint64_t)got - left : 0;
      sx__tcp_c_advance(c, r, (uint64_t)got - more);
      c->pgot += (uint64_t)got - more;
      c->hgot = (size_t)more;
      continue;
    }
    if (got < 0 && errno == EINTR)
      continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
      return 0;
    sx__conn_lost_msg(c->p->label, got == 0 ? NULL : strerror(errno), msg, sizeof(msg));
    sx__tcp_c_fail(c, SX_EDISCONN, msg);
    return -1;
  }
  return 0;
}

static void c_header(cconn *c);

/* Take in payloads while the socket has them: the head's, then, where its
 * read brought the next header whole, that reply's, and so on.  Anything
 * else (an aborted request's payload, half a header) is left to libuv's
 * reads. */
static void c_payloads(cconn *c) {
  while (c->state != C_CLOSING && !c->rx_away && c->in_payload && c->count > 0) {
    treq *r = &c->ring[c->head];
    if (r->aborted || c_readv(c, r) != 0 || c->pgot < r->len)
      return;
    c->in_payload = 0;
    sx__tcp_c_complete_head(c, 0, NULL);
    sx__tcp_c_refill(c);
    if (c->state == C_CLOSING || c->hgot < SX__FRAME_HDR)
      return;
    c_header(c);
  }
}

/* A whole frame header is in c->hdr: act on it. */
static void c_header(cconn *c) {
  tpeer *p = c->p;
  char msg[512];
  c->hgot = 0;
  sx__frame f;
  if (sx__frame_decode(c->hdr, SX__FRAME_HDR, &f) <= 0) {
    snprintf(msg, sizeof(msg), "%s sent a malformed frame", p->label);
    sx__tcp_c_fail(c, SX_EPROTO, msg);
    return;
  }
  if (c->state == C_HELLO || c->state == C_WAUTH) {
    uint8_t want = c->state == C_HELLO ? SX__FRAME_HELLO_REPLY : SX__FRAME_WAUTH_REPLY;
    if (f.type != want) {
      snprintf(msg, sizeof(msg), "%s did not answer %s", p->label,
               c->state == C_HELLO ? "HELLO" : "WAUTH");
      sx__tcp_c_fail(c, SX_EPROTO, msg);
      return;
    }
    if (p->write && c->state == C_HELLO && f.status == 0) {
      c->state = C_WAUTH; /* the WAUTH reply follows */
      return;
    }
    sx__tcp_c_hello_reply(c, &f);
    return;
  }
  treq *r = &c->ring[c->head];
  int bare = p->write || r->idx == NOTICE_IDX; /* replies without payload */
  uint8_t want = r->idx == NOTICE_IDX ? SX__FRAME_NOTICE_REPLY
               : p->write ? SX__FRAME_WRITE_REPLY : SX__FRAME_READ_REPLY;
  if (f.type != want || c->count == 0 || f.id != r->id ||
      (f.status == 0 && f.length != (bare ? 0 : r->len))) {
    snprintf(msg, sizeof(msg), "%s sent a reply that matches no request", p->label);
    sx__tcp_c_fail(c, SX_EPROTO, msg);
    return;
  }
  if (f.status != 0) {
    int err = f.status >= SX_ERRNO_MIN ? f.status : SX_EPROTO;
    /* A READV's refusal names the range refused; its other ranges fail
     * with it (they are of one region, or serve the same entries: see
     * c_ranges() in tcp_read.c). */
    uint32_t k = f.region < r->n ? f.region : 0;
    const sx_xfer *x = r->aborted || r->idx == NOTICE_IDX ? NULL : &r->op->xfers[r->idx + k];
    if (x != NULL)
      snprintf(msg, sizeof(msg), "%s refused a %s of region %u bytes %lu..+%lu: %s", p->label,
               p->write ? "write" : "read", x->rreg->id, (unsigned long)x->roff,
               (unsigned long)x->length, sx_strerror(err));
    else
      snprintf(msg, sizeof(msg), "%s refused the batch's notice: %s", p->label,
               sx_strerror(err));
    sx__tcp_c_complete_head(c, err, r->aborted ? NULL : msg);
    return;
  }
  if (bare) {
    sx__tcp_c_complete_head(c, 0, NULL); /* landed (or the notice was taken) */
    return;
  }
  c->in_payload = 1;
  c->pgot = 0;
  c->vi = 0;
  c->voff = 0;
  sx__tcp_rx_lend(c); /* a large payload: on a data-mover thread */
}

void sx__tcp_c_resume(cconn *c) {
  if (c->hgot == SX__FRAME_HDR && !c->in_payload)
    c_header(c);
  if (c->state != C_READY || c->rx_away)
    return;
  if (uv_read_start((uv_stream_t *)&c->h, sx__tcp_c_alloc, sx__tcp_c_read) != 0) {
    char msg[512];
    snprintf(msg, sizeof(msg), "%s: cannot read the connection", c->p->label);
    sx__tcp_c_fail(c, SX_EDISCONN, msg);
  }
}

void sx__tcp_c_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  cconn *c = s->data;
  tpeer *p = c->p;
  char msg[512];
  (void)buf;
  if (nread < 0) {
    sx__conn_lost_msg(p->label, nread == UV_EOF ? NULL : uv_strerror((int)nread), msg,
                      sizeof(msg));
    sx__tcp_c_fail(c, SX_EDISCONN, msg);
    return;
  }
  if (nread == 0 || c->state == C_CLOSING)
    return;
  if (c->in_payload) {
    treq *r = &c->ring[c->head];
    c->pgot += (uint64_t)nread;
    if (!r->aborted)
      sx__tcp_c_advance(c, r, (uint64_t)nread);
    if (c->pgot == r->len) {
      c->in_payload = 0;
      sx__tcp_c_complete_head(c, 0, NULL);
      sx__tcp_c_refill(c);
      return;
    }
    c_payloads(c);
    return;
  }
  c->hgot += (size_t)nread;
  if (c->hgot < SX__FRAME_HDR)
    return;
  c_header(c);
  /* The payload may be waiting already: take it in now, with the next
   * header, rather than through libuv first. */
  c_payloads(c);
}

