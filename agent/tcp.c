/*
 * The TCP transport (libuv).  Wire format in tcp_frame.h.
 *
 * Target side: one listener; each reader connection first sends HELLO
 * (its name, the incarnation it expects, the access token), which is
 * checked (incarnation -> SX_ESTALE, token in constant time -> SX_EACCESS)
 * before anything else.  Then every READ is checked (region id, its
 * remote-read flag and that it is not withdrawn, bounds with overflow-safe
 * arithmetic) and answered in order with a status.  Replies to the READs of
 * one socket read go out in one uv_write whose buffers alternate between a
 * header and the payload straight from registered memory; each region's
 * `inflight` counts the replies until the write completes, so unregister
 * can wait for them.  Bad requests get an error reply and the connection
 * keeps serving; only protocol violations (bad magic/version/type/flags,
 * oversized HELLO, no HELLO first, a failed HELLO) close it.
 *
 * Reader side: per peer (remote incarnation) conns_per_peer persistent
 * connections, made by the first post and remade by the next post after a
 * failure.  Ranges queue per peer and are spread round-robin over the ready
 * connections, at most WINDOW_REQS / WINDOW_BYTES in flight on each; the
 * request headers gathered in one loop iteration go out in one write per
 * connection.  Replies come back in order, so the oldest request in flight
 * is the one being answered: the alloc callback hands libuv the header
 * buffer for header bytes and the destination itself for payload bytes (no
 * copy).  A request aborted while in flight has its payload drained into a
 * scratch buffer, so a batch's destinations are never written after it
 * ended.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "addr.h"
#include "internal.h"
#include "tcp_frame.h"
#include "transport.h"

/* Reader side. */
#define WINDOW_REQS 64              /* requests in flight per connection */
#define WINDOW_BYTES (16u << 20)    /* bytes in flight per connection */
#define CONNECT_TIMEOUT_MS 5000     /* connect + hello */
#define SCRATCH_BYTES 65536         /* drain for aborted payload */
/* Target side. */
#define MAX_READ (64u << 20)        /* longest READ served */
#define MAX_CONNS 1024              /* reader connections at once */
#define MAX_CONNS_PER_READER 64     /* per reader name (unnamed: per address) */
#define HELLO_TIMEOUT_MS 5000       /* a connection must say HELLO by then */
#define SERVER_RBUF 16384           /* >= header + largest HELLO */
#define REPLIES_PER_WRITE 256
#define SERVER_QUEUE_MAX 1024       /* replies queued before it stops reading */

typedef struct tcp_t tcp_t;
typedef struct sconn sconn;
typedef struct cconn cconn;
typedef struct tpeer tpeer;

struct tcp_t {
  sx_transport base;
  uv_loop_t *loop;
  uv_tcp_t listener;
  int listener_init, listening;
  uint16_t port;
  sconn *sconns;
  uint32_t n_sconns;
  tpeer *peers;
  tpeer *pump_list;
  uv_idle_t pump;
  uint8_t *scratch;
  int closing;
  int live; /* handles, server connections and peers not yet freed */
};

/* ================================================================ target */

typedef struct reply {
  sx_lregion *l; /* NULL for an error reply */
  uint8_t *payload;
  uint64_t len;
} reply;

struct sconn {
  uv_tcp_t h;
  uv_timer_t hello_timer;
  tcp_t *t;
  sconn *next, *prev;
  char peer[64];                 /* "ip:port" */
  char host[48];                 /* "ip" */
  char reader[SX_NAME_MAX + 1];
  int hello_ok, closing, reading, handles;
  uint32_t queued;
  size_t rlen;
  uint8_t rbuf[SERVER_RBUF];
  uint32_t nrep;
  reply rep[REPLIES_PER_WRITE];
  uint8_t hdr[REPLIES_PER_WRITE][SX__FRAME_HDR];
};

typedef struct swrite {
  uv_write_t req;
  sconn *c;
  uint32_t n;
  int close_after;
  sx_lregion **lregs; /* n, inside this allocation */
  uint8_t *hdrs;      /* n * SX__FRAME_HDR, inside this allocation */
} swrite;

static const sx_tctx *ctx_of(tcp_t *t) { return t->base.ctx; }

static void maybe_free_transport(tcp_t *t) {
  if (t->closing && t->live == 0) {
    free(t->scratch);
    free(t);
  }
}

static void s_closed(uv_handle_t *h) {
  sconn *c = h->data;
  if (--c->handles > 0)
    return;
  tcp_t *t = c->t;
  if (c->prev)
    c->prev->next = c->next;
  else
    t->sconns = c->next;
  if (c->next)
    c->next->prev = c->prev;
  t->n_sconns--;
  free(c);
  t->live--;
  maybe_free_transport(t);
}

/* Close a reader connection; its queued replies are cancelled first (their
 * write callbacks release the regions), then it is freed. */
static void s_close(sconn *c) {
  if (c->handles == 0 || uv_is_closing((uv_handle_t *)&c->h))
    return;
  c->closing = 1;
  uv_close((uv_handle_t *)&c->h, s_closed);
  uv_close((uv_handle_t *)&c->hello_timer, s_closed);
}

static void s_violation(sconn *c, const char *what) {
  const sx_tctx *x = ctx_of(c->t);
  x->log(x->agent, SX_LOG_WARN, "tcp: closing connection from %s (%s): %s", c->peer,
         c->reader[0] ? c->reader : "no hello yet", what);
  x->served(x->agent, SX_TRANSPORT_TCP, 0, SX_EPROTO);
  s_close(c);
}

/* The reader went away (end of stream, or an error reading or writing):
 * one line for it, then close.  err is 0 or a libuv error. */
static void s_lost(sconn *c, int err) {
  if (!c->closing) {
    const sx_tctx *x = ctx_of(c->t);
    x->log(x->agent, SX_LOG_INFO, "tcp: reader %s from %s disconnected%s%s",
           c->reader[0] ? c->reader : "(no hello)", c->peer, err ? ": " : "",
           err ? uv_strerror(err) : "");
  }
  s_close(c);
}

static void s_read_start(sconn *c);

static void s_written(uv_write_t *req, int status) {
  swrite *w = (swrite *)req;
  sconn *c = w->c;
  for (uint32_t i = 0; i < w->n; i++)
    if (w->lregs[i] != NULL)
      w->lregs[i]->inflight--;
  c->queued -= w->n;
  int close_after = w->close_after;
  free(w);
  if (c->closing && !close_after)
    return;
  if (status < 0) {
    s_lost(c, status);
    return;
  }
  if (close_after) {
    s_close(c);
    return;
  }
  if (!c->reading && c->queued < SERVER_QUEUE_MAX / 2)
    s_read_start(c);
}

/* Send the replies gathered so far in one write. */
static int s_flush(sconn *c, int close_after) {
  uint32_t n = c->nrep;
  if (n == 0)
    return 0;
  c->nrep = 0;
  swrite *w = malloc(sizeof(*w) + n * (sizeof(sx_lregion *) + SX__FRAME_HDR));
  uv_buf_t bufs[2 * REPLIES_PER_WRITE];
  if (w == NULL) {
    s_violation(c, "out of memory");
    return -1;
  }
  w->c = c;
  w->n = n;
  w->close_after = close_after;
  w->lregs = (sx_lregion **)(w + 1);
  w->hdrs = (uint8_t *)(w->lregs + n);
  unsigned nb = 0;
  for (uint32_t i = 0; i < n; i++) {
    memcpy(w->hdrs + i * SX__FRAME_HDR, c->hdr[i], SX__FRAME_HDR);
    bufs[nb++] = uv_buf_init((char *)w->hdrs + i * SX__FRAME_HDR, SX__FRAME_HDR);
    w->lregs[i] = c->rep[i].l;
    if (c->rep[i].l != NULL) {
      bufs[nb].base = (char *)c->rep[i].payload;
      bufs[nb].len = (size_t)c->rep[i].len;
      nb++;
      c->rep[i].l->inflight++;
    }
  }
  c->queued += n;
  int rc = uv_write(&w->req, (uv_stream_t *)&c->h, bufs, nb, s_written);
  if (rc != 0) {
    for (uint32_t i = 0; i < n; i++)
      if (w->lregs[i] != NULL)
        w->lregs[i]->inflight--;
    c->queued -= n;
    free(w);
    s_lost(c, rc);
    return -1;
  }
  return 0;
}

static void s_reply(sconn *c, uint64_t id, uint8_t type, int status, sx_lregion *l,
                    uint8_t *payload, uint64_t len) {
  sx__frame f = {.type = type, .id = id, .status = status, .length = status ? 0 : len};
  sx__frame_encode(&f, c->hdr[c->nrep]);
  c->rep[c->nrep] = (reply){status ? NULL : l, payload, len};
  c->nrep++;
}

static void s_hello(sconn *c, const sx__frame *f, const uint8_t *body) {
  tcp_t *t = c->t;
  const sx_tctx *x = ctx_of(t);
  sx__hello h;
  if (sx__hello_decode(body, (size_t)f->length, &h) != 0) {
    s_violation(c, "malformed HELLO");
    return;
  }
  snprintf(c->reader, sizeof(c->reader), "%s", h.name[0] ? h.name : "(unnamed)");
  /* Both comparisons always run; the token one in constant time. */
  int inc_bad = sx__ct_memcmp(h.incarnation, x->incarnation, SX_INCARNATION_LEN) != 0;
  int tok_bad = sx__ct_memcmp(h.token, x->token, SX_TOKEN_LEN) != 0;
  int status = inc_bad ? SX_ESTALE : tok_bad ? SX_EACCESS : 0;
  if (status == 0) {
    /* Fairness between readers: named ones by name, unnamed (reader-only
     * agents) by address. */
    uint32_t same = 0;
    for (sconn *o = t->sconns; o; o = o->next)
      same += o != c && o->hello_ok && strcmp(o->reader, c->reader) == 0 &&
              (h.name[0] != '\0' || strcmp(o->host, c->host) == 0);
    if (same >= MAX_CONNS_PER_READER)
      status = SX_ELIMIT;
  }
  s_reply(c, f->id, SX__FRAME_HELLO_REPLY, status, NULL, NULL, 0);
  if (status != 0) {
    x->log(x->agent, SX_LOG_WARN, "tcp: refused reader %s from %s: %s", c->reader,
           c->peer, status == SX_ESTALE ? "it expects another incarnation (ours "
           "restarted)" : status == SX_EACCESS ? "bad access token" :
           "too many connections from this reader");
    x->served(x->agent, SX_TRANSPORT_TCP, 0, status);
    uv_read_stop((uv_stream_t *)&c->h);
    c->reading = 0;
    c->closing = 1; /* stop parsing; the reply goes out, then we close */
    s_flush(c, 1);
    return;
  }
  c->hello_ok = 1;
  uv_timer_stop(&c->hello_timer);
  x->log(x->agent, SX_LOG_INFO, "tcp: reader %s connected from %s", c->reader, c->peer);
}

static void s_serve(sconn *c, const sx__frame *f) {
  const sx_tctx *x = ctx_of(c->t);
  sx_lregion *l = x->find_region(x->agent, f->region);
  uint64_t end;
  int st = 0;
  if (l == NULL)
    st = SX_ENOREGION;
  else if (!(l->r.access & SX_ACCESS_REMOTE_READ))
    st = SX_EDENIED;
  else if (f->length == 0)
    st = SX_EINVAL;
  else if (f->length > MAX_READ)
    st = SX_ELIMIT;
  else if (!sx__add_ok(f->offset, f->length, &end) || end > l->r.length)
    st = SX_EBOUNDS;
  if (st != 0)
    x->log(x->agent, SX_LOG_DEBUG, "tcp: refused read from %s: region %u offset %lu "
           "length %lu: %s", c->reader, f->region, (unsigned long)f->offset,
           (unsigned long)f->length, sx_err_name(st));
  x->served(x->agent, SX_TRANSPORT_TCP, st ? 0 : f->length, st);
  s_reply(c, f->id, SX__FRAME_READ_REPLY, st, l,
          st ? NULL : (uint8_t *)(uintptr_t)(l->r.addr + f->offset), f->length);
}

static void s_process(sconn *c) {
  size_t off = 0;
  while (!c->closing) {
    sx__frame f;
    int rc = sx__frame_decode(c->rbuf + off, c->rlen - off, &f);
    if (rc == 0)
      break;
    if (rc < 0) {
      s_violation(c, rc == SX_EVERSION ? "unsupported protocol version"
                                        : "malformed frame header");
      return;
    }
    if (!c->hello_ok) {
      if (f.type != SX__FRAME_HELLO) {
        s_violation(c, "the first frame is not HELLO");
        return;
      }
      if (c->rlen - off < SX__FRAME_HDR + f.length)
        break;
      s_hello(c, &f, c->rbuf + off + SX__FRAME_HDR);
      off += SX__FRAME_HDR + (size_t)f.length;
      continue;
    }
    if (f.type != SX__FRAME_READ) {
      s_violation(c, "unexpected frame type");
      return;
    }
    off += SX__FRAME_HDR;
    s_serve(c, &f);
    if (c->nrep == REPLIES_PER_WRITE && s_flush(c, 0) != 0)
      return;
  }
  if (c->closing)
    return;
  if (s_flush(c, 0) != 0)
    return;
  memmove(c->rbuf, c->rbuf + off, c->rlen - off);
  c->rlen -= off;
  if (c->queued >= SERVER_QUEUE_MAX && c->reading) {
    /* The reader sends faster than it reads: push back. */
    uv_read_stop((uv_stream_t *)&c->h);
    c->reading = 0;
  }
}

static void s_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  sconn *c = h->data;
  (void)suggested;
  buf->base = (char *)c->rbuf + c->rlen;
  buf->len = SERVER_RBUF - c->rlen;
}

static void s_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  sconn *c = s->data;
  (void)buf;
  if (nread < 0) {
    s_lost(c, nread == UV_EOF ? 0 : (int)nread);
    return;
  }
  c->rlen += (size_t)nread;
  s_process(c);
}

static void s_read_start(sconn *c) {
  if (uv_read_start((uv_stream_t *)&c->h, s_alloc, s_read) == 0)
    c->reading = 1;
}

static void s_hello_timeout(uv_timer_t *tm) {
  sconn *c = tm->data;
  s_violation(c, "no HELLO in time");
}

static void on_connection(uv_stream_t *server, int status) {
  tcp_t *t = server->data;
  const sx_tctx *x = ctx_of(t);
  if (status < 0) {
    x->log(x->agent, SX_LOG_WARN, "tcp: accept failed: %s", uv_strerror(status));
    return;
  }
  sconn *c = calloc(1, sizeof(*c));
  if (c == NULL) {
    x->log(x->agent, SX_LOG_ERROR, "tcp: out of memory accepting a connection");
    return;
  }
  c->t = t;
  uv_tcp_init(t->loop, &c->h);
  uv_timer_init(t->loop, &c->hello_timer);
  c->h.data = c->hello_timer.data = c;
  c->handles = 2;
  c->next = t->sconns;
  if (c->next)
    c->next->prev = c;
  t->sconns = c;
  t->n_sconns++;
  t->live++;
  if (uv_accept(server, (uv_stream_t *)&c->h) != 0) {
    s_close(c);
    return;
  }
  struct sockaddr_storage ss;
  int len = sizeof(ss);
  if (uv_tcp_getpeername(&c->h, (struct sockaddr *)&ss, &len) == 0) {
    uv_ip_name((struct sockaddr *)&ss, c->host, sizeof(c->host));
    snprintf(c->peer, sizeof(c->peer), "%s:%u", c->host,
             ntohs(((struct sockaddr_in *)&ss)->sin_port));
  }
  if (t->n_sconns > MAX_CONNS) {
    x->log(x->agent, SX_LOG_WARN, "tcp: refusing %s: %u connections already", c->peer,
           MAX_CONNS);
    s_close(c);
    return;
  }
  uv_tcp_nodelay(&c->h, 1);
  uv_timer_start(&c->hello_timer, s_hello_timeout, HELLO_TIMEOUT_MS, 0);
  s_read_start(c);
}

/* ================================================================ reader */

enum { C_IDLE, C_CONNECTING, C_HELLO, C_READY, C_CLOSING };

typedef struct treq {
  sx_op *op;
  size_t idx;
  uint64_t id;
  uint64_t len;
  int aborted; /* the op gave up on it: drain its payload */
} treq;

typedef struct cwrite {
  uv_write_t req;
  uint32_t n;
  uint8_t data[WINDOW_REQS * SX__FRAME_HDR];
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
  uint8_t hello[SX__FRAME_HDR + SX__HELLO_MAX];
  cwrite *w; /* requests gathered by the current pump */
};

typedef struct pend {
  struct pend *next;
  sx_op *op;
  size_t next_idx;
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
};

static void p_fail_pending(tpeer *p, int err, const char *msg);
static void c_fail(cconn *c, int err, const char *msg);

static int c_live(const cconn *c) {
  return c->state == C_CONNECTING || c->state == C_HELLO || c->state == C_READY;
}

static void p_maybe_free(tpeer *p) {
  if (!p->closing || p->handles > 0)
    return;
  tcp_t *t = p->t;
  free(p->conns);
  free(p);
  t->live--;
  maybe_free_transport(t);
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
    sx__op_xfer_done(r.op, r.idx, status, msg);
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
  if (r->aborted) {
    buf->base = (char *)c->p->t->scratch;
    buf->len = left < SCRATCH_BYTES ? (size_t)left : SCRATCH_BYTES;
  } else {
    buf->base = (char *)r->op->xfers[r->idx].local + c->pgot;
    buf->len = (size_t)left;
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
  char msg[512], inc[2 * SX_INCARNATION_LEN + 1];
  sx_hex(p->remote->incarnation, SX_INCARNATION_LEN, inc);
  if (f->status == SX_ESTALE)
    snprintf(msg, sizeof(msg), "%s is no longer incarnation %.8s (the target "
             "restarted); reopen the segment", p->label, inc);
  else if (f->status == SX_EACCESS)
    snprintf(msg, sizeof(msg), "%s refused our access token", p->label);
  else
    snprintf(msg, sizeof(msg), "%s refused the connection: %s", p->label,
             sx_strerror(f->status));
  int err = f->status < 0 && f->status >= SX_ERRNO_MIN ? f->status : SX_EPROTO;
  /* Every connection would hear the same: fail everything queued. */
  for (uint32_t i = 0; i < p->n_conns; i++)
    c_fail(&p->conns[i], err, msg);
  p_fail_pending(p, err, msg);
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
    c->pgot += (uint64_t)nread;
    if (c->pgot == c->ring[c->head].len) {
      c->in_payload = 0;
      c_complete_head(c, 0, NULL);
    }
    return;
  }
  c->hgot += (size_t)nread;
  if (c->hgot < SX__FRAME_HDR)
    return;
  c->hgot = 0;
  sx__frame f;
  if (sx__frame_decode(c->hdr, SX__FRAME_HDR, &f) <= 0) {
    snprintf(msg, sizeof(msg), "%s sent a malformed frame", p->label);
    c_fail(c, SX_EPROTO, msg);
    return;
  }
  if (c->state == C_HELLO) {
    if (f.type != SX__FRAME_HELLO_REPLY) {
      snprintf(msg, sizeof(msg), "%s did not answer HELLO", p->label);
      c_fail(c, SX_EPROTO, msg);
      return;
    }
    c_hello_reply(c, &f);
    return;
  }
  treq *r = &c->ring[c->head];
  if (f.type != SX__FRAME_READ_REPLY || c->count == 0 || f.id != r->id ||
      (f.status == 0 && f.length != r->len)) {
    snprintf(msg, sizeof(msg), "%s sent a reply that matches no request", p->label);
    c_fail(c, SX_EPROTO, msg);
    return;
  }
  if (f.status != 0) {
    int err = f.status >= SX_ERRNO_MIN ? f.status : SX_EPROTO;
    const sx_xfer *x = r->aborted ? NULL : &r->op->xfers[r->idx];
    if (x != NULL)
      snprintf(msg, sizeof(msg), "%s refused a read of region %u bytes %lu..+%lu: %s",
               p->label, x->rreg->id, (unsigned long)x->roff, (unsigned long)x->length,
               sx_strerror(err));
    c_complete_head(c, err, x ? msg : NULL);
    return;
  }
  c->in_payload = 1;
  c->pgot = 0;
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
  const sx_tctx *x = ctx_of(p->t);
  uv_tcp_nodelay(&c->h, 1);
  uv_tcp_keepalive(&c->h, 1, 30);
  sx__hello h;
  memcpy(h.incarnation, p->remote->incarnation, SX_INCARNATION_LEN);
  memcpy(h.token, p->remote->token, SX_TOKEN_LEN);
  snprintf(h.name, sizeof(h.name), "%s", x->name ? x->name : "");
  int len = sx__hello_encode(&h, c->hello + SX__FRAME_HDR, SX__HELLO_MAX);
  sx__frame f = {.type = SX__FRAME_HELLO, .length = (uint64_t)len};
  sx__frame_encode(&f, c->hello);
  uv_buf_t b = uv_buf_init((char *)c->hello, (unsigned)(SX__FRAME_HDR + len));
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
    free(q);
    for (size_t i = first; i < n; i++)
      if (op->xfers[i].status == 1)
        sx__op_xfer_done(op, i, err, msg);
  }
}

static void c_written(uv_write_t *req, int status) {
  cwrite *w = (cwrite *)req;
  cconn *c = req->data;
  free(w);
  if (status < 0 && status != UV_ECANCELED) {
    char msg[512];
    snprintf(msg, sizeof(msg), "sending requests to %s: %s", c->p->label,
             uv_strerror(status));
    c_fail(c, SX_EDISCONN, msg);
  }
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
      sx_xfer *x = &q->op->xfers[q->next_idx];
      if (c->w == NULL) {
        if ((c->w = malloc(sizeof(cwrite))) == NULL)
          continue; /* try the others; the rest waits for a later pump */
        c->w->n = 0;
      }
      treq *r = &c->ring[(c->head + c->count) % WINDOW_REQS];
      *r = (treq){.op = q->op, .idx = q->next_idx, .id = c->next_id++,
                  .len = x->length};
      c->count++;
      c->inflight_bytes += x->length;
      sx__frame f = {.type = SX__FRAME_READ, .id = r->id, .region = x->rreg->id,
                     .offset = x->roff, .length = x->length};
      sx__frame_encode(&f, c->w->data + (size_t)c->w->n * SX__FRAME_HDR);
      c->w->n++;
      progress = 1;
      if (++q->next_idx == q->op->n) {
        p->q = q->next;
        if (p->q == NULL)
          p->q_tail = &p->q;
        free(q);
      }
    }
    if (!progress || p->q == NULL)
      break;
  }
  for (uint32_t i = 0; i < p->n_conns; i++) {
    cconn *c = &p->conns[i];
    cwrite *w = c->w;
    if (w == NULL)
      continue;
    c->w = NULL;
    w->req.data = c;
    uv_buf_t b = uv_buf_init((char *)w->data, w->n * SX__FRAME_HDR);
    if (uv_write(&w->req, (uv_stream_t *)&c->h, &b, 1, c_written) != 0) {
      free(w);
      char msg[512];
      snprintf(msg, sizeof(msg), "sending requests to %s failed", p->label);
      c_fail(c, SX_EDISCONN, msg);
    }
  }
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

/* ================================================================ ops */

static void tcp_close(sx_transport *base);

static int tcp_open(const sx_tctx *ctx, sx_transport **out) {
  tcp_t *t = calloc(1, sizeof(*t));
  if (t == NULL || (t->scratch = malloc(SCRATCH_BYTES)) == NULL) {
    free(t);
    return sx__err(SX_ENOMEM, "tcp: open");
  }
  t->base.ops = &sx__tcp_ops;
  t->base.ctx = ctx;
  t->loop = ctx->loop;
  uv_idle_init(t->loop, &t->pump);
  t->pump.data = t;
  t->live = 1;
  const char *listen = ctx->params->listen;
  if (listen == NULL) {
    /* A reader-only agent: it reads, nobody reads from it. */
    *out = &t->base;
    return 0;
  }
  char host[256];
  struct sockaddr_storage ss;
  int rc;
  if (sx__hostport_sockaddr(listen, &ss, host, sizeof(host)) != 0) {
    rc = sx__err(SX_EINVAL, "tcp: listen address '%.64s' is not IP:port", listen);
    tcp_close(&t->base); /* freed once the loop has closed its handles */
    return rc;
  }
  uv_tcp_init(t->loop, &t->listener);
  t->listener.data = t;
  t->listener_init = 1;
  t->live++;
  int uvrc = uv_tcp_bind(&t->listener, (struct sockaddr *)&ss, 0);
  if (uvrc == 0)
    uvrc = uv_listen((uv_stream_t *)&t->listener, 128, on_connection);
  if (uvrc != 0) {
    rc = sx__err(SX_EIO, "tcp: cannot listen on %s: %s", listen, uv_strerror(uvrc));
    tcp_close(&t->base);
    return rc;
  }
  int len = sizeof(ss);
  uv_tcp_getsockname(&t->listener, (struct sockaddr *)&ss, &len);
  t->port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
  t->listening = 1;
  ctx->log(ctx->agent, SX_LOG_INFO, "tcp: serving on %s port %u (advertised as %s)",
           host, t->port, ctx->params->advertise ? ctx->params->advertise : host);
  *out = &t->base;
  return 0;
}

static void t_handle_closed(uv_handle_t *h) {
  tcp_t *t = h->data;
  t->live--;
  maybe_free_transport(t);
}

static void tcp_peer_close(sx_tpeer *base);

static void tcp_close(sx_transport *base) {
  tcp_t *t = (tcp_t *)base;
  t->closing = 1;
  while (t->peers != NULL)
    tcp_peer_close(&t->peers->base);
  for (sconn *c = t->sconns; c; c = c->next)
    s_close(c);
  if (t->listener_init)
    uv_close((uv_handle_t *)&t->listener, t_handle_closed);
  uv_close((uv_handle_t *)&t->pump, t_handle_closed);
}

static int tcp_pack(sx_transport *base, sx_desc *d) {
  tcp_t *t = (tcp_t *)base;
  if (!t->listening)
    return 0;
  sx_endpoint e;
  memset(&e, 0, sizeof(e));
  e.kind = SX_TRANSPORT_TCP;
  const char *adv = ctx_of(t)->params->advertise;
  if (sx__strlcpy(e.addr, adv ? adv : "127.0.0.1", sizeof(e.addr)))
    return sx__err(SX_ELIMIT, "tcp: advertised address is longer than %d bytes",
                   SX_ADDR_MAX);
  e.port = t->port;
  return sx_desc_add_endpoint(d, &e);
}

static const sx_endpoint *tcp_endpoint(const sx_desc *d) {
  for (uint32_t i = 0; i < d->n_endpoints; i++)
    if (d->endpoints[i].kind == SX_TRANSPORT_TCP)
      return &d->endpoints[i];
  return NULL;
}

static int tcp_usable(sx_transport *base, const sx_desc *remote) {
  (void)base;
  return tcp_endpoint(remote) != NULL;
}

static int tcp_peer_open(sx_transport *base, const sx_desc *remote, sx_tpeer **out) {
  tcp_t *t = (tcp_t *)base;
  const sx_endpoint *e = tcp_endpoint(remote);
  if (e == NULL)
    return sx__err(SX_EUNREACH, "%s publishes no TCP endpoint", remote->name);
  uint32_t n = ctx_of(t)->params->conns_per_peer;
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

static void tcp_peer_close(sx_tpeer *base) {
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

static int tcp_post(sx_tpeer *base, sx_op *op) {
  tpeer *p = (tpeer *)base;
  if (p->closing)
    return sx__err(SX_ECANCELED, "%s: segment closed", p->label);
  pend *q = malloc(sizeof(*q));
  if (q == NULL)
    return sx__err(SX_ENOMEM, "tcp: post");
  q->next = NULL;
  q->op = op;
  q->next_idx = 0;
  *p->q_tail = q;
  p->q_tail = &q->next;
  p_ensure(p);
  /* A connection that failed at once may have failed the queue already. */
  schedule_pump(p);
  return 0;
}

static void tcp_abort(sx_tpeer *base, sx_op *op, int status) {
  tpeer *p = (tpeer *)base;
  /* In flight: drain their payload from now on, settle them now. */
  for (uint32_t i = 0; i < p->n_conns; i++) {
    cconn *c = &p->conns[i];
    for (uint32_t k = 0; k < c->count; k++) {
      treq *r = &c->ring[(c->head + k) % WINDOW_REQS];
      if (r->op == op && !r->aborted) {
        r->aborted = 1;
        sx__op_xfer_done(op, r->idx, status, NULL);
      }
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
    free(q);
    for (size_t i = first; i < op->n; i++)
      if (op->xfers[i].status == 1)
        sx__op_xfer_done(op, i, status, NULL);
    break;
  }
}

const sx_transport_ops sx__tcp_ops = {
    .name = "tcp",
    .kind = SX_TRANSPORT_TCP,
    .open = tcp_open,
    .close = tcp_close,
    .pack = tcp_pack,
    .usable = tcp_usable,
    .peer_open = tcp_peer_open,
    .peer_close = tcp_peer_close,
    .post = tcp_post,
    .abort = tcp_abort,
};
