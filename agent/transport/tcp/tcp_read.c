/*
 * The TCP transport, reader side: per-peer connections, the request pump
 * and aborts; the replies are read in tcp_reply.c (see tcp.c for the whole
 * picture).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "addr.h"
#include "internal.h"
#include "tcp_read_int.h"

static void p_fail_pending(tpeer *p, int err, const char *msg);
static void p_pump(tpeer *p);

static int c_live(const cconn *c) {
  return c->state == C_CONNECTING || c->state == C_HELLO || c->state == C_READY ||
         c->state == C_WAUTH;
}

/* Settle what a ring entry carries: its xfers, or (push) the op's
 * notice. */
static void settle(const treq *r, int status, const char *msg) {
  if (r->idx == NOTICE_IDX) {
    r->op->noticed(r->op, status, msg);
    return;
  }
  for (uint32_t i = 0; i < r->n; i++)
    sx__op_xfer_done(r->op, r->idx + i, status, msg);
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
void sx__tcp_c_complete_head(cconn *c, int status, const char *msg) {
  treq r = c->ring[c->head];
  c->head = (c->head + 1) % WINDOW_REQS;
  c->count--;
  c->inflight_bytes -= r.len;
  if (!r.aborted)
    settle(&r, status, msg);
  if (c->p->q != NULL)
    schedule_pump(c->p);
}

void sx__tcp_c_fail(cconn *c, int err, const char *msg) {
  tpeer *p = c->p;
  if (!c_live(c))
    return;
  /* A data-mover thread stops receiving before the descriptor closes and
   * the destinations' batches end; what it finished fails with the rest. */
  sx__tcp_rx_take(c);
  c->rx_ready = 0;
  c->state = C_CLOSING;
  uv_timer_stop(&c->timer);
  uv_read_stop((uv_stream_t *)&c->h);
  uv_close((uv_handle_t *)&c->h, c_closed);
  free(c->w);
  c->w = NULL;
  /* Everything in flight on this connection fails with it. */
  while (c->count > 0)
    sx__tcp_c_complete_head(c, err, msg);
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
  sx__tcp_c_fail(c, SX_EUNREACH, msg);
}

/* A reply landed on c: when half of c's window is free again in both
 * requests and bytes, ask for more now, from inside the read callback,
 * rather than in the loop's idle phase.  libuv reads a ready socket up to
 * 32 times before it returns to the loop: 16 replies of header and
 * payload, which at 1 MiB blocks is the whole 16 MiB window.  Refilled
 * only after that, the pipe ran dry once per window and the target waited
 * a round trip with nothing to send (nothing in flight for 10% of a read
 * of 1 MiB x 128 batches on one connection, strace; docs/benchmarks.md).
 * Small blocks get here only while few are in flight anyway (16 replies
 * are a fraction of WINDOW_REQS): in a steady stream they keep one request
 * write per loop iteration. */
void sx__tcp_c_refill(cconn *c) {
  tpeer *p = c->p;
  if (c->state == C_READY && p->q != NULL && !p->closing && c->count <= WINDOW_REQS / 2 &&
      c->inflight_bytes <= WINDOW_BYTES / 2)
    p_pump(p);
}

/* The target answered HELLO: go, or the whole peer is unusable. */
void sx__tcp_c_hello_reply(cconn *c, const sx__frame *f) {
  tpeer *p = c->p;
  if (f->status == 0) {
    c->state = C_READY;
    c->readv = !p->write && (f->offset & SX__FEAT_READV) != 0;
    c->readv_gpu = c->readv && (f->offset & SX__FEAT_READV_GPU) != 0;
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
    sx__tcp_c_fail(&p->conns[i], err, msg);
  p_fail_pending(p, err, msg);
}

static void c_hello_written(uv_write_t *req, int status) {
  cconn *c = req->data;
  if (status < 0 && status != UV_ECANCELED) {
    char msg[512];
    snprintf(msg, sizeof(msg), "sending HELLO to %s: %s", c->p->label,
             uv_strerror(status));
    sx__tcp_c_fail(c, SX_EDISCONN, msg);
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
    sx__tcp_c_fail(c, SX_EUNREACH, msg);
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
  if (uv_read_start((uv_stream_t *)&c->h, sx__tcp_c_alloc, sx__tcp_c_read) != 0 ||
      uv_write(&c->hello_wr, (uv_stream_t *)&c->h, &b, 1, c_hello_written) != 0) {
    snprintf(msg, sizeof(msg), "%s: cannot start the connection", p->label);
    sx__tcp_c_fail(c, SX_EDISCONN, msg);
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
  c->rx_away = 0;
  c->rx_ready = 0;
  c->readv = 0;
  c->readv_gpu = 0;
  uv_timer_start(&c->timer, c_timeout, CONNECT_TIMEOUT_MS, 0);
  int rc = uv_tcp_connect(&c->creq, &c->h, (struct sockaddr *)&p->sa, c_connected);
  if (rc != 0) {
    char msg[512];
    snprintf(msg, sizeof(msg), "connecting to %s: %s", p->label, uv_strerror(rc));
    sx__tcp_c_fail(c, SX_EUNREACH, msg);
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
    sx__tcp_c_fail(c, SX_EDISCONN, msg);
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
  uv_buf_t b = uv_buf_init((char *)w->data, w->used);
  int rc = w->nb > 0 ? uv_write(&w->req, (uv_stream_t *)&c->h, w->bufs, w->nb, c_written)
                     : uv_write(&w->req, (uv_stream_t *)&c->h, &b, 1, c_written);
  if (rc != 0) {
    free(w->owned);
    free(w);
    char msg[512];
    snprintf(msg, sizeof(msg), "sending requests to %s failed", c->p->label);
    sx__tcp_c_fail(c, SX_EDISCONN, msg);
  }
}

static cwrite *c_gather(cconn *c) {
  if (c->w == NULL && (c->w = malloc(sizeof(cwrite))) != NULL) {
    c->w->used = c->w->nb = 0;
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
  *r = (treq){.op = q->op, .idx = NOTICE_IDX, .n = 1, .id = c->next_id++,
              .wseq = c->wseq + 1};
  c->count++;
  sx__tcp_rx_added(c);
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

/* Host memory (GPU memory goes through the target's staging: a READV of it
 * takes ranges of one device). */
static int r_host(const sx_region *r) { return strcmp(r->location, "cpu") == 0; }

/* How many of q's ranges from x on one READV takes: those that follow x
 * in the op, plain, at most READV_RANGE bytes each, up to SX__READV_MAX
 * of them and READV_BYTES in all, either all of x's region or all serving
 * x's batch entries, and all of host memory or (where the target serves
 * that: gpu) all of the GPU of x's region.  A target refuses a READV
 * whole, so that no entry fails for another's sake: what a target refuses
 * (a withdrawn region, one it stopped serving) is the region's, and an
 * entry fails with any of its ranges anyway.  1: a READ. */
static uint32_t c_ranges(const pend *q, const sx_xfer *x, int gpu) {
  int host = r_host(x->rreg);
  if (x->iov != NULL || x->length > READV_RANGE || !(host || gpu))
    return 1;
  size_t left = q->op->n - q->next_idx;
  uint64_t bytes = x->length;
  uint32_t n = 1;
  int region = 1, entries = 1; /* what the ranges so far share */
  while (n < SX__READV_MAX && n < left) {
    const sx_xfer *y = &x[n];
    region &= y->rreg == x->rreg;
    entries &= y->entry_first == x->entry_first && y->entry_last == x->entry_last;
    if (!(region || entries) || y->iov != NULL || y->length > READV_RANGE ||
        bytes + y->length > READV_BYTES ||
        (y->rreg != x->rreg && strcmp(y->rreg->location, x->rreg->location) != 0))
      break;
    bytes += y->length;
    n++;
  }
  return n;
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
      uint32_t n = c->readv ? c_ranges(q, x, c->readv_gpu) : 1;
      uint64_t len = x->length;
      for (uint32_t k = 1; k < n; k++)
        len += x[k].length;
      treq *r = &c->ring[(c->head + c->count) % WINDOW_REQS];
      *r = (treq){.op = q->op, .idx = q->next_idx, .n = n, .id = c->next_id++,
                  .len = len, .wseq = c->wseq + 1};
      c->count++;
      sx__tcp_rx_added(c);
      c->inflight_bytes += len;
      uint8_t *hdr = c->w->data + c->w->used;
      if (n > 1) {
        sx__frame f = {.type = SX__FRAME_READV, .id = r->id,
                       .length = (uint64_t)n * SX__READV_ENTRY};
        sx__frame_encode(&f, hdr);
        for (uint32_t k = 0; k < n; k++) {
          sx__range e = {x[k].rreg->id, x[k].roff, x[k].length};
          sx__range_encode(&e, hdr + SX__FRAME_HDR + k * SX__READV_ENTRY);
        }
        c->w->used += SX__FRAME_HDR + n * SX__READV_ENTRY;
      } else {
        sx__frame f = {.type = p->write ? SX__FRAME_WRITE : SX__FRAME_READ, .id = r->id,
                       .region = x->rreg->id, .offset = x->roff, .length = x->length};
        sx__frame_encode(&f, hdr);
        c->w->used += SX__FRAME_HDR;
      }
      if (p->write) {
        /* The payload goes straight from the source. */
        c->w->bufs[c->w->nb++] = uv_buf_init((char *)hdr, SX__FRAME_HDR);
        c->w->bufs[c->w->nb++] = uv_buf_init((char *)x->local, (unsigned)x->length);
      }
      progress = 1;
      q->next_idx += n;
      if (q->next_idx == q->op->n)
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
    sx__tcp_c_fail(&p->conns[i], SX_ECANCELED, msg);
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
    /* A data-mover thread receiving on c stops first (it may be writing
     * into this op's destinations); c's receive side resumes below. */
    int away = 0;
    for (uint32_t k = 0; k < c->count && !away; k++)
      away = c->ring[(c->head + k) % WINDOW_REQS].op == op && c->rx_away;
    if (away)
      sx__tcp_rx_take(c);
    for (uint32_t k = 0; k < c->count; k++) {
      treq *r = &c->ring[(c->head + k) % WINDOW_REQS];
      if (r->op == op && !r->aborted) {
        unsent |= p->write && r->wseq > c->wseq_done;
        r->aborted = 1;
        settle(r, status, NULL);
      }
    }
    if (unsent) {
      snprintf(msg, sizeof(msg), "%s: connection closed to stop an aborted write batch",
               p->label);
      sx__tcp_c_fail(c, SX_EDISCONN, msg);
    }
    if (away)
      sx__tcp_rx_back(c);
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
