/*
 * The TCP transport, reader side: per-peer connections, the request pump
 * and the replies read straight into the destinations (see tcp.c for the
 * whole picture).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "addr.h"
#include "internal.h"
#include "tcp_int.h"

typedef struct cconn cconn;

enum { C_IDLE, C_CONNECTING, C_HELLO, C_READY, C_CLOSING, C_WAUTH };

/* Push: a ring entry that carries an op's notice instead of an xfer. */
#define NOTICE_IDX SIZE_MAX

typedef struct treq {
  sx_op *op;
  size_t idx;
  uint64_t id;
  uint64_t len;
  int aborted; /* the op gave up on it: drain its payload */
  uint64_t wseq; /* push: the cwrite carrying it (its payload is read
                  * from the source until that write completes) */
} treq;

typedef struct cwrite {
  uv_write_t req;
  uint32_t n;
  uint8_t data[WINDOW_REQS * SX__FRAME_HDR];
  /* Push: WRITE headers alternate with their payload; a NOTICE owns its
   * header and body in `owned`. */
  uint32_t nb;
  uv_buf_t bufs[2 * WINDOW_REQS];
  uint8_t *owned;
} cwrite;

struct cconn {
  uv_tcp_t h;
  uv_timer_t timer; /* connect + hello deadline */
  uv_connect_t creq;
  uv_write_t hello_wr;
  tpeer *p;
  int state;
  treq ring[WINDOW_REQS];
  uint32_t head, count;
  uint64_t inflight_bytes;
  uint64_t next_id;
  uint8_t hdr[SX__FRAME_HDR];
  size_t hgot;
  int in_payload;
  uint64_t pgot;
  uint32_t vi;   /* a scattered payload: the piece being filled */
  uint64_t voff; /* and the bytes of it that arrived */
  uint8_t hello[SX__FRAME_HDR + SX__HELLO_MAX + SX__FRAME_HDR + SX__WAUTH_BODY];
  cwrite *w; /* requests gathered by the current pump */
  uint64_t wseq, wseq_done; /* push: cwrites issued and completed */
};

typedef struct pend {
  struct pend *next;
  sx_op *op;
  size_t next_idx;
  uint8_t *notice; /* push: the op's notice (header room + body), or NULL */
  size_t nlen;
} pend;

struct tpeer {
  sx_tpeer base;
  tcp_t *t;
  const sx_desc *remote;
  tpeer *next, *prev;
  tpeer *pnext;
  int in_pump;
  char label[160]; /* "name at host:port", for messages */
  char host[SX_ADDR_MAX + 1];
  uint16_t port;
  struct sockaddr_storage sa;
  int have_sa, resolving;
  uv_getaddrinfo_t gai;
  cconn *conns;
  uint32_t n_conns;
  pend *q, **q_tail;
  int closing;
  int handles;
  int write; /* push: connections authorize as producer and carry writes */
};

static void p_fail_pending(tpeer *p, int err, const char *msg);
static void c_fail(cconn *c, int err, const char *msg);

static int c_live(const cconn *c) {
  return c->state == C_CONNECTING || c->state == C_HELLO || c->state == C_READY ||
         c->state == C_WAUTH;
}

/* Settle what a ring entry or a queued entry carries: an xfer, or (push)
 * the op's notice. */
static void settle(sx_op *op, size_t idx, int status, const char *msg) {
  if (idx == NOTICE_IDX)
    op->noticed(op, status, msg);
  else
    sx__op_xfer_done(op, idx, status, msg);
}

static void p_maybe_free(tpeer *p) {
  if (!p->closing || p->handles > 0)
    return;
  tcp_t *t = p->t;
  free(p->conns);
  free(p);
  t->live--;
  sx__tcp_maybe_free(t);
}

static void c_start(cconn *c);

static void c_closed(uv_handle_t *h) {
  cconn *c = h->data;
  tpeer *p = c->p;
  p->handles--;
  if ((uv_handle_t *)&c->h == h) {
    c->state = C_IDLE;
    /* Work posted while every connection was closing has nobody to send
     * it: connect again (which fails it at once if the target is gone). */
    if (!p->closing && p->q != NULL) {
      int live = 0;
      for (uint32_t i = 0; i < p->n_conns; i++)
        live |= c_live(&p->conns[i]);
      if (!live && p->have_sa)
        c_start(c);
    }
  }
  p_maybe_free(p);
}

static void pump_cb(uv_idle_t *h);

static void schedule_pump(tpeer *p) {
  tcp_t *t = p->t;
  if (p->in_pump || p->closing)
    return;
  p->in_pump = 1;
  p->pnext = t->pump_list;
  t->pump_list = p;
  if (!uv_is_active((uv_handle_t *)&t->pump))
    uv_idle_start(&t->pump, pump_cb);
}


/* Settle the oldest request in flight on c with status. */
static void c_complete_head(cconn *c, int status, const char *msg) {
  treq r = c->ring[c->head];
  c->head = (c->head + 1) % WINDOW_REQS;
  c->count--;
  c->inflight_bytes -= r.len;
  if (!r.aborted)
    settle(r.op, r.idx, status, msg);
  if (c->p->q != NULL)
    schedule_pump(c->p);
}

static void c_fail(cconn *c, int err, const char *msg) {
  tpeer *p = c->p;
  if (!c_live(c))
    return;
  c->state = C_CLOSING;
  uv_timer_stop(&c->timer);
  uv_read_stop((uv_stream_t *)&c->h);
  uv_close((uv_handle_t *)&c->h, c_closed);
  free(c->w);
  c->w = NULL;
  /* Everything in flight on this connection fails with it. */
  while (c->count > 0)
    c_complete_head(c, err, msg);
  c->in_payload = 0;
  c->hgot = 0;
  c->inflight_bytes = 0;
  for (uint32_t i = 0; i < p->n_conns; i++)
    if (c_live(&p->conns[i]))
      return; /* the others carry on with what is queued */
  p_fail_pending(p, err, msg);
}

static void c_timeout(uv_timer_t *tm) {
  cconn *c = tm->data;
  char msg[512];
  snprintf(msg, sizeof(msg), "%s: connecting timed out after %d ms", c->p->label,
           CONNECT_TIMEOUT_MS);
  c_fail(c, SX_EUNREACH, msg);
}

static void c_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  cconn *c = h->data;
  (void)suggested;
  if (!c->in_payload) {
    buf->base = (char *)c->hdr + c->hgot;
    buf->len = SX__FRAME_HDR - c->hgot;
    return;
  }
  treq *r = &c->ring[c->head];
  uint64_t left = r->len - c->pgot;
  const sx_xfer *x = r->aborted ? NULL : &r->op->xfers[r->idx];
  if (r->aborted) {
    buf->base = (char *)c->p->t->scratch;
    buf->len = left < SCRATCH_BYTES ? (size_t)left : SCRATCH_BYTES;
  } else if (x->iov != NULL) {
    buf->base = (char *)x->iov[c->vi].iov_base + c->voff;
    buf->len = (size_t)(x->iov[c->vi].iov_len - c->voff);
  } else {
    buf->base = (char *)r->op->xfers[r->idx].local + c->pgot;
    buf->len = (size_t)left;
  }
}

/* n more bytes of a scattered payload arrived where c_alloc() or c_readv()
 * put them: move to the piece they end in. */
static void c_advance(cconn *c, const sx_xfer *x, uint64_t n) {
  while (n > 0 && c->vi < x->n_iov) {
    uint64_t room = x->iov[c->vi].iov_len - c->voff;
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
 * Receive what the socket holds of r's scattered payload straight into its
 * pieces, with readv() into up to READV_PIECES of them at a time (libuv
 * reads into one buffer per system call).  (Through a buffer and copied
 * out, with cached or streaming stores, measured no cheaper: small pieces
 * cost about twice per byte what one buffer does either way.)  When another
 * reply is due on c, the same call asks for its header too (into c->hdr,
 * c->hgot saying how much came), which saves a system call per request;
 * nothing past that header is asked for.  Reading the descriptor here, on
 * the loop thread inside the read callback, is safe: libuv's next read of
 * it just finds it empty (EAGAIN).  0, or -1 when the connection failed
 * (c_fail() has run: r is settled).
 */
static int c_readv(cconn *c, treq *r) {
  const sx_xfer *x = &r->op->xfers[r->idx];
  uint64_t ahead = c->count > 1 ? SX__FRAME_HDR : 0; /* the next header */
  uv_os_fd_t fd;
  char msg[512];
  if (uv_fileno((const uv_handle_t *)&c->h, &fd) != 0)
    return 0; /* libuv's reads carry on, one piece at a time */
  while (c->pgot < r->len && c->vi < x->n_iov) {
    uint64_t left = r->len - c->pgot, more = 0;
    struct iovec v[READV_PIECES + 1];
    int n = 0;
    uint32_t i = c->vi;
    for (; i < x->n_iov && n < READV_PIECES; i++)
      v[n++] = x->iov[i];
    v[0].iov_base = (char *)v[0].iov_base + c->voff;
    v[0].iov_len -= c->voff;
    if (i == x->n_iov && ahead)
      v[n++] = (struct iovec){c->hdr, SX__FRAME_HDR};
    ssize_t got = readv(fd, v, n);
    if (got > 0) {
      more = (uint64_t)got > left ? (uint64_t)got - left : 0;
      c_advance(c, x, (uint64_t)got - more);
      c->pgot += (uint64_t)got - more;
      c->hgot = (size_t)more;
      continue;
    }
    if (got < 0 && errno == EINTR)
      continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
      return 0;
    if (got == 0)
      snprintf(msg, sizeof(msg), "%s closed the connection", c->p->label);
    else
      snprintf(msg, sizeof(msg), "connection to %s lost: %s", c->p->label, strerror(errno));
    c_fail(c, SX_EDISCONN, msg);
    return -1;
  }
  return 0;
}

static void c_header(cconn *c);

/* Take in scattered payloads while the socket has them: the head's, then,
 * where its read brought the next header whole, that reply's, and so on.
 * Anything else (a plain payload, half a header) is left to libuv's
 * reads. */
static void c_scattered(cconn *c) {
  while (c->state != C_CLOSING && c->in_payload && c->count > 0) {
    treq *r = &c->ring[c->head];
    if (r->aborted || r->op->xfers[r->idx].iov == NULL || c_readv(c, r) != 0 ||
        c->pgot < r->len)
      return;
    c->in_payload = 0;
    c_complete_head(c, 0, NULL);
    if (c->state == C_CLOSING || c->hgot < SX__FRAME_HDR)
      return;
    c_header(c);
  }
}

/* The target answered HELLO: go, or the whole peer is unusable. */
static void c_hello_reply(cconn *c, const sx__frame *f) {
  tpeer *p = c->p;
  if (f->status == 0) {
    c->state = C_READY;
    uv_timer_stop(&c->timer);
    if (p->q != NULL)
      schedule_pump(p);
    return;
  }
  char msg[512];
  int err = sx__hello_refused(f->status, p->label, p->remote->incarnation, msg, sizeof(msg));
  if (f->status == SX_EACCESS && c->state == C_WAUTH)
    snprintf(msg, sizeof(msg), "%s refused our writes: no write grant covers this producer, "
             "or it is not published as this incarnation", p->label);
  /* Every connection would hear the same: fail everything queued. */
  for (uint32_t i = 0; i < p->n_conns; i++)
    c_fail(&p->conns[i], err, msg);
  p_fail_pending(p, err, msg);
}

/* A whole frame header is in c->hdr: act on it. */
static void c_header(cconn *c) {
  tpeer *p = c->p;
  char msg[512];
  c->hgot = 0;
  sx__frame f;
  if (sx__frame_decode(c->hdr, SX__FRAME_HDR, &f) <= 0) {
    snprintf(msg, sizeof(msg), "%s sent a malformed frame", p->label);
    c_fail(c, SX_EPROTO, msg);
    return;
  }
  if (c->state == C_HELLO || c->state == C_WAUTH) {
    uint8_t want = c->state == C_HELLO ? SX__FRAME_HELLO_REPLY : SX__FRAME_WAUTH_REPLY;
    if (f.type != want) {
      snprintf(msg, sizeof(msg), "%s did not answer %s", p->label,
               c->state == C_HELLO ? "HELLO" : "WAUTH");
      c_fail(c, SX_EPROTO, msg);
      return;
    }
    if (p->write && c->state == C_HELLO && f.status == 0) {
      c->state = C_WAUTH; /* the WAUTH reply follows */
      return;
    }
    c_hello_reply(c, &f);
    return;
  }
  treq *r = &c->ring[c->head];
  int bare = p->write || r->idx == NOTICE_IDX; /* replies without payload */
  uint8_t want = r->idx == NOTICE_IDX ? SX__FRAME_NOTICE_REPLY
               : p->write ? SX__FRAME_WRITE_REPLY : SX__FRAME_READ_REPLY;
  if (f.type != want || c->count == 0 || f.id != r->id ||
      (f.status == 0 && f.length != (bare ? 0 : r->len))) {
    snprintf(msg, sizeof(msg), "%s sent a reply that matches no request", p->label);
    c_fail(c, SX_EPROTO, msg);
    return;
  }
  if (f.status != 0) {
    int err = f.status >= SX_ERRNO_MIN ? f.status : SX_EPROTO;
    const sx_xfer *x = r->aborted || r->idx == NOTICE_IDX ? NULL : &r->op->xfers[r->idx];
    if (x != NULL)
      snprintf(msg, sizeof(msg), "%s refused a %s of region %u bytes %lu..+%lu: %s", p->label,
               p->write ? "write" : "read", x->rreg->id, (unsigned long)x->roff,
               (unsigned long)x->length, sx_strerror(err));
    else
      snprintf(msg, sizeof(msg), "%s refused the batch's notice: %s", p->label,
               sx_strerror(err));
    c_complete_head(c, err, r->aborted ? NULL : msg);
    return;
  }
  if (bare) {
    c_complete_head(c, 0, NULL); /* landed (or the notice was taken) */
    return;
  }
  c->in_payload = 1;
  c->pgot = 0;
  c->vi = 0;
  c->voff = 0;
}

static void c_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  cconn *c = s->data;
  tpeer *p = c->p;
  char msg[512];
  (void)buf;
  if (nread < 0) {
    if (nread == UV_EOF)
      snprintf(msg, sizeof(msg), "%s closed the connection", p->label);
    else
      snprintf(msg, sizeof(msg), "connection to %s lost: %s", p->label,
               uv_strerror((int)nread));
    c_fail(c, SX_EDISCONN, msg);
    return;
  }
  if (nread == 0 || c->state == C_CLOSING)
    return;
  if (c->in_payload) {
    treq *r = &c->ring[c->head];
    c->pgot += (uint64_t)nread;
    const sx_xfer *x = r->aborted ? NULL : &r->op->xfers[r->idx];
    if (x != NULL && x->iov != NULL)
      c_advance(c, x, (uint64_t)nread);
    if (c->pgot == r->len) {
      c->in_payload = 0;
      c_complete_head(c, 0, NULL);
      return;
    }
    c_scattered(c);
    return;
  }
  c->hgot += (size_t)nread;
  if (c->hgot < SX__FRAME_HDR)
    return;
  c_header(c);
  /* A scattered payload may be waiting already: take it in now rather
   * than one piece through libuv first. */
  c_scattered(c);
}

static void c_hello_written(uv_write_t *req, int status) {
  cconn *c = req->data;
  if (status < 0 && status != UV_ECANCELED) {
    char msg[512];
    snprintf(msg, sizeof(msg), "sending HELLO to %s: %s", c->p->label,
             uv_strerror(status));
    c_fail(c, SX_EDISCONN, msg);
  }
}

static void c_connected(uv_connect_t *req, int status) {
  cconn *c = req->data;
  tpeer *p = c->p;
  char msg[512];
  if (c->state != C_CONNECTING)
    return;
  if (status < 0) {
    snprintf(msg, sizeof(msg), "connecting to %s: %s", p->label, uv_strerror(status));
    c_fail(c, SX_EUNREACH, msg);
    return;
  }
  const sx_tctx *x = sx__tcp_ctx(p->t);
  uv_tcp_nodelay(&c->h, 1);
  uv_tcp_keepalive(&c->h, 1, 30);
  int len = sx__hello_build(p->remote->incarnation, p->remote->token, x->name,
                            c->hello + SX__FRAME_HDR, SX__HELLO_MAX);
  sx__frame f = {.type = SX__FRAME_HELLO, .length = (uint64_t)len};
  sx__frame_encode(&f, c->hello);
  size_t total = SX__FRAME_HDR + (size_t)len;
  if (p->write) {
    /* Push: who we are, to be checked against the store and the grants. */
    sx__frame wf = {.type = SX__FRAME_WAUTH, .length = SX__WAUTH_BODY};
    sx__frame_encode(&wf, c->hello + total);
    memcpy(c->hello + total + SX__FRAME_HDR, x->incarnation, SX_INCARNATION_LEN);
    memcpy(c->hello + total + SX__FRAME_HDR + SX_INCARNATION_LEN, x->token, SX_TOKEN_LEN);
    total += SX__FRAME_HDR + SX__WAUTH_BODY;
  }
  uv_buf_t b = uv_buf_init((char *)c->hello, (unsigned)total);
  c->hello_wr.data = c;
  c->state = C_HELLO;
  if (uv_read_start((uv_stream_t *)&c->h, c_alloc, c_read) != 0 ||
      uv_write(&c->hello_wr, (uv_stream_t *)&c->h, &b, 1, c_hello_written) != 0) {
    snprintf(msg, sizeof(msg), "%s: cannot start the connection", p->label);
    c_fail(c, SX_EDISCONN, msg);
  }
}

static void c_start(cconn *c) {
  tpeer *p = c->p;
  uv_tcp_init(p->t->loop, &c->h);
  c->h.data = c;
  p->handles++;
  c->state = C_CONNECTING;
  c->creq.data = c;
  c->head = c->count = 0;
  c->in_payload = 0;
  c->hgot = 0;
  c->inflight_bytes = 0;
  c->wseq = c->wseq_done = 0;
  uv_timer_start(&c->timer, c_timeout, CONNECT_TIMEOUT_MS, 0);
  int rc = uv_tcp_connect(&c->creq, &c->h, (struct sockaddr *)&p->sa, c_connected);
  if (rc != 0) {
    char msg[512];
    snprintf(msg, sizeof(msg), "connecting to %s: %s", p->label, uv_strerror(rc));
    c_fail(c, SX_EUNREACH, msg);
  }
}

static void p_connect_all(tpeer *p) {
  for (uint32_t i = 0; i < p->n_conns; i++)
    if (p->conns[i].state == C_IDLE)
      c_start(&p->conns[i]);
}

static void p_resolved(uv_getaddrinfo_t *req, int status, struct addrinfo *res) {
  tpeer *p = req->data;
  p->resolving = 0;
  p->handles--;
  if (status == 0 && res != NULL) {
    memcpy(&p->sa, res->ai_addr, res->ai_addrlen);
    p->have_sa = 1;
  }
  uv_freeaddrinfo(res);
  if (p->closing) {
    p_maybe_free(p);
    return;
  }
  if (!p->have_sa) {
    char msg[512];
    snprintf(msg, sizeof(msg), "%s: cannot resolve the address: %s", p->label,
             uv_strerror(status));
    p_fail_pending(p, SX_EUNREACH, msg);
    return;
  }
  p_connect_all(p);
}

/* Connect what is not connected (resolving the address first if needed). */
static void p_ensure(tpeer *p) {
  if (p->have_sa) {
    p_connect_all(p);
    return;
  }
  if (p->resolving)
    return;
  char port[8];
  snprintf(port, sizeof(port), "%u", p->port);
  struct addrinfo hints;
  memset(&hints, 0, sizeof(hints));
  hints.ai_socktype = SOCK_STREAM;
  p->gai.data = p;
  if (uv_getaddrinfo(p->t->loop, &p->gai, p_resolved, p->host, port, &hints) == 0) {
    p->resolving = 1;
    p->handles++;
  } else {
    char msg[512];
    snprintf(msg, sizeof(msg), "%s: cannot resolve the address", p->label);
    p_fail_pending(p, SX_EUNREACH, msg);
  }
}

static void p_fail_pending(tpeer *p, int err, const char *msg) {
  while (p->q != NULL) {
    pend *q = p->q;
    p->q = q->next;
    if (p->q == NULL)
      p->q_tail = &p->q;
    size_t n = q->op->n;
    sx_op *op = q->op;
    size_t first = q->next_idx;
    uint8_t *notice = q->notice;
    free(q);
    if (notice != NULL) {
      free(notice);
      op->noticed(op, err, msg);
      continue;
    }
    for (size_t i = first; i < n; i++)
      if (op->xfers[i].status == 1)
        sx__op_xfer_done(op, i, err, msg);
  }
}

static void c_written(uv_write_t *req, int status) {
  cwrite *w = (cwrite *)req;
  cconn *c = req->data;
  c->wseq_done++;
  free(w->owned);
  free(w);
  if (status < 0 && status != UV_ECANCELED) {
    char msg[512];
    snprintf(msg, sizeof(msg), "sending requests to %s: %s", c->p->label,
             uv_strerror(status));
    c_fail(c, SX_EDISCONN, msg);
  }
}

/* Send what the current pump gathered for c in one write. */
static void c_flush(cconn *c) {
  cwrite *w = c->w;
  if (w == NULL)
    return;
  c->w = NULL;
  w->req.data = c;
  c->wseq++;
  uv_buf_t b = uv_buf_init((char *)w->data, w->n * SX__FRAME_HDR);
  int rc = w->nb > 0 ? uv_write(&w->req, (uv_stream_t *)&c->h, w->bufs, w->nb, c_written)
                     : uv_write(&w->req, (uv_stream_t *)&c->h, &b, 1, c_written);
  if (rc != 0) {
    free(w->owned);
    free(w);
    char msg[512];
    snprintf(msg, sizeof(msg), "sending requests to %s failed", c->p->label);
    c_fail(c, SX_EDISCONN, msg);
  }
}

static cwrite *c_gather(cconn *c) {
  if (c->w == NULL && (c->w = malloc(sizeof(cwrite))) != NULL) {
    c->w->n = c->w->nb = 0;
    c->w->owned = NULL;
  }
  return c->w;
}

/* A write peer sends its batches' write notices, a read peer the read
 * notices of SX_BATCH_NOTIFY batches. */
static uint8_t p_notice_type(const tpeer *p) {
  return p->write ? SX__FRAME_NOTICE : SX__FRAME_RNOTICE;
}

/* Push: send q's notice on c, after what c gathered so far (replies come
 * in the order of the frames).  0, or -1 when out of memory (q stays). */
static int c_send_notice(cconn *c, pend *q) {
  c_flush(c);
  if (c->state != C_READY || c_gather(c) == NULL)
    return -1;
  treq *r = &c->ring[(c->head + c->count) % WINDOW_REQS];
  *r = (treq){.op = q->op, .idx = NOTICE_IDX, .id = c->next_id++, .wseq = c->wseq + 1};
  c->count++;
  sx__frame f = {.type = p_notice_type(c->p), .id = r->id, .length = q->nlen - SX__FRAME_HDR};
  sx__frame_encode(&f, q->notice);
  c->w->owned = q->notice;
  c->w->bufs[c->w->nb++] = uv_buf_init((char *)q->notice, (unsigned)q->nlen);
  q->notice = NULL;
  c_flush(c);
  return 0;
}

static void p_pop(tpeer *p) {
  pend *q = p->q;
  p->q = q->next;
  if (p->q == NULL)
    p->q_tail = &p->q;
  free(q);
}

/* Hand queued ranges to ready connections, round-robin, within windows. */
static void p_pump(tpeer *p) {
  for (;;) {
    int progress = 0;
    for (uint32_t i = 0; i < p->n_conns && p->q != NULL; i++) {
      cconn *c = &p->conns[i];
      if (c->state != C_READY || c->count >= WINDOW_REQS ||
          c->inflight_bytes >= WINDOW_BYTES)
        continue;
      pend *q = p->q;
      if (q->notice != NULL) {
        if (c_send_notice(c, q) == 0) {
          p_pop(p);
          progress = 1;
        }
        continue;
      }
      sx_xfer *x = &q->op->xfers[q->next_idx];
      if (c_gather(c) == NULL)
        continue; /* try the others; the rest waits for a later pump */
      treq *r = &c->ring[(c->head + c->count) % WINDOW_REQS];
      *r = (treq){.op = q->op, .idx = q->next_idx, .id = c->next_id++,
                  .len = x->length, .wseq = c->wseq + 1};
      c->count++;
      c->inflight_bytes += x->length;
      sx__frame f = {.type = p->write ? SX__FRAME_WRITE : SX__FRAME_READ, .id = r->id,
                     .region = x->rreg->id, .offset = x->roff, .length = x->length};
      uint8_t *hdr = c->w->data + (size_t)c->w->n * SX__FRAME_HDR;
      sx__frame_encode(&f, hdr);
      c->w->n++;
      if (p->write) {
        /* The payload goes straight from the source. */
        c->w->bufs[c->w->nb++] = uv_buf_init((char *)hdr, SX__FRAME_HDR);
        c->w->bufs[c->w->nb++] = uv_buf_init((char *)x->local, (unsigned)x->length);
      }
      progress = 1;
      if (++q->next_idx == q->op->n)
        p_pop(p);
    }
    if (!progress || p->q == NULL)
      break;
  }
  for (uint32_t i = 0; i < p->n_conns; i++)
    c_flush(&p->conns[i]);
}

static void pump_cb(uv_idle_t *h) {
  tcp_t *t = h->data;
  tpeer *list = t->pump_list;
  t->pump_list = NULL;
  uv_idle_stop(&t->pump);
  while (list != NULL) {
    tpeer *p = list;
    list = p->pnext;
    p->in_pump = 0;
    p_pump(p);
  }
}

int sx__tcp_peer_open(sx_transport *base, const sx_desc *remote, sx_tpeer **out) {
  tcp_t *t = (tcp_t *)base;
  const sx_endpoint *e = sx__tcp_endpoint(remote);
  if (e == NULL)
    return sx__err(SX_EUNREACH, "%s publishes no TCP endpoint", remote->name);
  uint32_t n = sx__tcp_ctx(t)->params->conns_per_peer;
  if (n == 0)
    n = 4;
  tpeer *p = calloc(1, sizeof(*p));
  cconn *conns = calloc(n, sizeof(*conns));
  if (p == NULL || conns == NULL) {
    free(p);
    free(conns);
    return sx__err(SX_ENOMEM, "tcp: peer");
  }
  p->base.t = base;
  p->t = t;
  p->remote = remote;
  p->conns = conns;
  p->n_conns = n;
  p->q_tail = &p->q;
  snprintf(p->host, sizeof(p->host), "%s", e->addr);
  p->port = e->port;
  snprintf(p->label, sizeof(p->label), strchr(e->addr, ':') ? "%.64s at [%.63s]:%u"
                                                            : "%.64s at %.63s:%u",
           remote->name, e->addr, e->port);
  memset(&p->sa, 0, sizeof(p->sa));
  if (uv_ip4_addr(e->addr, e->port, (struct sockaddr_in *)&p->sa) == 0 ||
      uv_ip6_addr(e->addr, e->port, (struct sockaddr_in6 *)&p->sa) == 0)
    p->have_sa = 1;
  for (uint32_t i = 0; i < n; i++) {
    conns[i].p = p;
    conns[i].state = C_IDLE;
    uv_timer_init(t->loop, &conns[i].timer);
    conns[i].timer.data = &conns[i];
    p->handles++;
  }
  p->next = t->peers;
  if (p->next)
    p->next->prev = p;
  t->peers = p;
  t->live++;
  *out = &p->base;
  return 0;
}

void sx__tcp_peer_close(sx_tpeer *base) {
  tpeer *p = (tpeer *)base;
  tcp_t *t = p->t;
  if (p->closing)
    return;
  if (p->prev)
    p->prev->next = p->next;
  else
    t->peers = p->next;
  if (p->next)
    p->next->prev = p->prev;
  if (p->in_pump) {
    for (tpeer **pp = &t->pump_list; *pp; pp = &(*pp)->pnext) {
      if (*pp == p) {
        *pp = p->pnext;
        break;
      }
    }
    p->in_pump = 0;
  }
  /* Closing first, so nothing failed below queues more work. */
  p->closing = 1;
  char msg[512];
  snprintf(msg, sizeof(msg), "%s: segment closed", p->label);
  for (uint32_t i = 0; i < p->n_conns; i++)
    c_fail(&p->conns[i], SX_ECANCELED, msg);
  p_fail_pending(p, SX_ECANCELED, msg);
  if (p->resolving)
    uv_cancel((uv_req_t *)&p->gai);
  for (uint32_t i = 0; i < p->n_conns; i++)
    uv_close((uv_handle_t *)&p->conns[i].timer, c_closed);
}

int sx__tcp_wpeer_open(sx_transport *base, const sx_desc *remote, sx_tpeer **out) {
  int rc = sx__tcp_peer_open(base, remote, out);
  if (rc == 0)
    ((tpeer *)*out)->write = 1;
  return rc;
}

int sx__tcp_peer_writes(const sx_tpeer *base) { return ((const tpeer *)base)->write; }

int sx__tcp_notify(sx_tpeer *base, sx_op *op, const uint8_t *buf, size_t len) {
  tpeer *p = (tpeer *)base;
  if (p->closing)
    return sx__err(SX_ECANCELED, "%s: segment closed", p->label);
  pend *q = calloc(1, sizeof(*q));
  uint8_t *n = malloc(SX__FRAME_HDR + len);
  if (q == NULL || n == NULL) {
    free(q);
    free(n);
    return sx__err(SX_ENOMEM, "tcp: notify");
  }
  memcpy(n + SX__FRAME_HDR, buf, len);
  q->op = op;
  q->notice = n;
  q->nlen = SX__FRAME_HDR + len;
  *p->q_tail = q;
  p->q_tail = &q->next;
  p_ensure(p);
  schedule_pump(p);
  return 0;
}

int sx__tcp_post(sx_tpeer *base, sx_op *op) {
  tpeer *p = (tpeer *)base;
  if (p->closing)
    return sx__err(SX_ECANCELED, "%s: segment closed", p->label);
  pend *q = calloc(1, sizeof(*q));
  if (q == NULL)
    return sx__err(SX_ENOMEM, "tcp: post");
  q->op = op;
  *p->q_tail = q;
  p->q_tail = &q->next;
  p_ensure(p);
  /* A connection that failed at once may have failed the queue already. */
  schedule_pump(p);
  return 0;
}

void sx__tcp_abort(sx_tpeer *base, sx_op *op, int status) {
  tpeer *p = (tpeer *)base;
  char msg[512];
  /* In flight: drain their payload from now on, settle them now.  A write
   * whose payload is still being sent reads its source until the socket
   * is closed: then that connection goes (its other work fails with
   * SX_EDISCONN), so that nothing reads the sources after the op ends. */
  for (uint32_t i = 0; i < p->n_conns; i++) {
    cconn *c = &p->conns[i];
    int unsent = 0;
    for (uint32_t k = 0; k < c->count; k++) {
      treq *r = &c->ring[(c->head + k) % WINDOW_REQS];
      if (r->op == op && !r->aborted) {
        unsent |= p->write && r->wseq > c->wseq_done;
        r->aborted = 1;
        settle(op, r->idx, status, NULL);
      }
    }
    if (unsent) {
      snprintf(msg, sizeof(msg), "%s: connection closed to stop an aborted write batch",
               p->label);
      c_fail(c, SX_EDISCONN, msg);
    }
  }
  /* Not sent yet: settle and forget. */
  for (pend **pp = &p->q; *pp; pp = &(*pp)->next) {
    pend *q = *pp;
    if (q->op != op)
      continue;
    *pp = q->next;
    if (p->q_tail == &q->next)
      p->q_tail = pp;
    size_t first = q->next_idx;
    uint8_t *notice = q->notice;
    free(q);
    if (notice != NULL) {
      free(notice);
      op->noticed(op, status, NULL);
      break;
    }
    for (size_t i = first; i < op->n; i++)
      if (op->xfers[i].status == 1)
        sx__op_xfer_done(op, i, status, NULL);
    break;
  }
}
