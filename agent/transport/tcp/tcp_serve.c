/*
 * The TCP transport, target side: reader connections, HELLO, and serving
 * READs straight from registered memory (see tcp.c for the whole picture).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "tcp_int.h"
#include "tcp_stage.h"
#include "transport/cuda/cuda_ipc.h"

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
  size_t sbytes;                 /* of sx__tcp_sconn_send() frames not sent yet */
  size_t rlen;
  uint8_t rbuf[SERVER_RBUF];
  uint32_t nrep;
  reply rep[REPLIES_PER_WRITE];
  uint8_t hdr[REPLIES_PER_WRITE][SX__FRAME_HDR];
  sx__tcp_wconn *w;       /* push mode (tcp_write.c), NULL until a push frame */
  sx__tcp_sreply *stage; /* a reply from GPU memory being staged: parse no more */
  sx__ipc_holds *ipc;    /* CUDA IPC handles lent on this connection */
};

typedef struct swrite {
  uv_write_t req;
  sconn *c;
  uint32_t n;
  int close_after;
  sx_lregion **lregs; /* n, inside this allocation */
  uint8_t *hdrs;      /* n * SX__FRAME_HDR, inside this allocation */
} swrite;

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
  sx__tcp_w_free(c->w);
  free(c);
  t->live--;
  sx__tcp_maybe_free(t);
}

/* Close a reader connection; its queued replies are cancelled first (their
 * write callbacks release the regions), then it is freed. */
static void s_close(sconn *c) {
  if (c->handles == 0 || uv_is_closing((uv_handle_t *)&c->h))
    return;
  c->closing = 1;
  if (c->stage != NULL)
    sx__tcp_stage_detach(c->stage);
  c->stage = NULL;
  sx__ipc_drop(c->ipc);
  c->ipc = NULL;
  uv_close((uv_handle_t *)&c->h, s_closed);
  uv_close((uv_handle_t *)&c->hello_timer, s_closed);
}

static void s_violation(sconn *c, const char *what) {
  const sx_tctx *x = sx__tcp_ctx(c->t);
  x->log(x->agent, SX_LOG_WARN, "tcp: closing connection from %s (%s): %s", c->peer,
         c->reader[0] ? c->reader : "no hello yet", what);
  x->served(x->agent, SX_TRANSPORT_TCP, 0, SX_EPROTO);
  s_close(c);
}

/* The reader went away (end of stream, or an error reading or writing):
 * one line for it, then close.  err is 0 or a libuv error. */
static void s_lost(sconn *c, int err) {
  if (!c->closing) {
    const sx_tctx *x = sx__tcp_ctx(c->t);
    x->log(x->agent, SX_LOG_INFO, "tcp: reader %s from %s disconnected%s%s",
           c->reader[0] ? c->reader : "(no hello)", c->peer, err ? ": " : "",
           err ? uv_strerror(err) : "");
  }
  s_close(c);
}

static void s_read_start(sconn *c);

/* Not reading now, and nothing holds parsing back: a reply being staged
 * from GPU memory (tcp_stage_serve.c) or a write authorization waiting for
 * the store (tcp_write.c).  The callers add their queue limits. */
static int s_may_read(const sconn *c) {
  return !c->closing && !c->reading && c->stage == NULL && c->sbytes < SERVER_SEND_MAX / 2 &&
         (c->w == NULL || !sx__tcp_w_holds(c->w));
}

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
  if (s_may_read(c) && c->queued < SERVER_QUEUE_MAX / 2)
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
  const sx_tctx *x = sx__tcp_ctx(t);
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

/* Why READ f of region l (NULL: none) is refused, or 0. */
static int s_refusal(const sx__frame *f, const sx_lregion *l) {
  uint64_t end;
  if (l == NULL)
    return SX_ENOREGION;
  if (!(l->r.access & SX_ACCESS_REMOTE_READ))
    return SX_EDENIED;
  if (f->length == 0)
    return SX_EINVAL;
  if (f->length > MAX_READ)
    return SX_ELIMIT;
  if (!sx__add_ok(f->offset, f->length, &end) || end > l->r.length)
    return SX_EBOUNDS;
  return 0;
}

/* Is READ f of region l one we serve?  0 or the refusal, counted for
 * metrics either way. */
static int s_check(sconn *c, const sx__frame *f, const sx_lregion *l) {
  const sx_tctx *x = sx__tcp_ctx(c->t);
  int st = s_refusal(f, l);
  if (st != 0)
    x->log(x->agent, SX_LOG_DEBUG, "tcp: refused read from %s: region %u offset %lu "
           "length %lu: %s", c->reader, f->region, (unsigned long)f->offset,
           (unsigned long)f->length, sx_err_name(st));
  x->served(x->agent, SX_TRANSPORT_TCP, st ? 0 : f->length, st);
  return st;
}

/* Serve READ f; more: the avail bytes received behind its header.  Returns
 * how many of them it took (READs of GPU memory answered with it). */
static size_t s_serve(sconn *c, const sx__frame *f, const uint8_t *more, size_t avail) {
  const sx_tctx *x = sx__tcp_ctx(c->t);
  sx_lregion *l = x->find_region(x->agent, f->region);
  int st = s_check(c, f, l);
  if (st == 0 && l->mem.kind == SX__MEM_CUDA) {
    /* GPU memory goes out through staging (tcp_stage_serve.c), in order
     * after the replies gathered so far; the READs of the same GPU that
     * wait right behind this one, as many as fit one chunk, go with it. */
    if (s_flush(c, 0) != 0)
      return 0;
    uv_read_stop((uv_stream_t *)&c->h);
    c->reading = 0;
    sx__tcp_sread rd[SX__STAGE_GROUP] = {{f->id, l, f->offset, f->length}};
    size_t n = 1, used = 0;
    uint64_t room = sx__tcp_stage_group_bytes(c->t), total = f->length;
    sx__frame g;
    while (n < SX__STAGE_GROUP && total < room &&
           sx__frame_decode(more + used, avail - used, &g) == SX__FRAME_HDR &&
           g.type == SX__FRAME_READ && g.length <= room - total) {
      sx_lregion *gl = x->find_region(x->agent, g.region);
      /* Anything else (a refusal too) is served on its own, in order. */
      if (s_refusal(&g, gl) != 0 || gl->mem.kind != SX__MEM_CUDA ||
          gl->mem.device != l->mem.device)
        break;
      s_check(c, &g, gl);
      rd[n++] = (sx__tcp_sread){g.id, gl, g.offset, g.length};
      total += g.length;
      used += SX__FRAME_HDR;
    }
    sx__tcp_stage_reply(c->t, c, (uv_stream_t *)&c->h, &c->stage, rd, n);
    return used;
  }
  s_reply(c, f->id, SX__FRAME_READ_REPLY, st, l,
          st ? NULL : (uint8_t *)(uintptr_t)(l->r.addr + f->offset), f->length);
  return 0;
}

static void s_process(sconn *c) {
  size_t off = 0;
  while (!c->closing && c->stage == NULL &&
         (c->w == NULL || (c->w->left == 0 && !sx__tcp_w_holds(c->w)))) {
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
    if (f.type == SX__FRAME_IPC) {
      /* CUDA IPC handles (cuda_ipc.h): only after HELLO, as here. */
      if (c->rlen - off < SX__FRAME_HDR + f.length)
        break;
      if (s_flush(c, 0) != 0)
        return;
      sx__ipc_serve(sx__tcp_ctx(c->t), c, &c->ipc, &f, c->rbuf + off + SX__FRAME_HDR);
      off += SX__FRAME_HDR + (size_t)f.length;
      continue;
    }
    if (f.type >= SX__FRAME_WAUTH) {
      int used = sx__tcp_w_frame(c, &c->w, &f, c->rbuf + off, c->rlen - off);
      if (used < 0)
        return;
      if (used == 0)
        break;
      off += (size_t)used;
      continue;
    }
    if (f.type != SX__FRAME_READ) {
      s_violation(c, "unexpected frame type");
      return;
    }
    off += SX__FRAME_HDR;
    off += s_serve(c, &f, c->rbuf + off, c->rlen - off);
    if (c->nrep == REPLIES_PER_WRITE && s_flush(c, 0) != 0)
      return;
  }
  if (c->closing)
    return;
  if (s_flush(c, 0) != 0)
    return;
  memmove(c->rbuf, c->rbuf + off, c->rlen - off);
  c->rlen -= off;
  if ((c->queued >= SERVER_QUEUE_MAX || c->sbytes >= SERVER_SEND_MAX) && c->reading) {
    /* The reader sends faster than it reads: push back.  IPC requests
     * count by the bytes they are answered with (up to 24 times theirs). */
    uv_read_stop((uv_stream_t *)&c->h);
    c->reading = 0;
  }
}

static void s_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  sconn *c = h->data;
  (void)suggested;
  if (c->w != NULL && c->w->left > 0) {
    sx__tcp_w_alloc(c->w, buf);
    return;
  }
  buf->base = (char *)c->rbuf + c->rlen;
  buf->len = SERVER_RBUF - c->rlen;
  /* A producer's connection: read the next header alone, so that the
   * payload behind it goes straight into the region (sx__tcp_w_alloc)
   * rather than into rbuf and then copied (a quarter more copying at 64 KiB
   * writes, for one more small read per WRITE). */
  if (c->w != NULL && c->w->verified && c->rlen < SX__FRAME_HDR)
    buf->len = SX__FRAME_HDR - c->rlen;
}

static void s_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  sconn *c = s->data;
  (void)buf;
  if (nread < 0) {
    s_lost(c, nread == UV_EOF ? 0 : (int)nread);
    return;
  }
  if (c->w != NULL && c->w->left > 0) {
    sx__tcp_w_read(c->w, (size_t)nread);
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

void sx__tcp_on_connection(uv_stream_t *server, int status) {
  tcp_t *t = server->data;
  const sx_tctx *x = sx__tcp_ctx(t);
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

void sx__tcp_sconn_resume(sconn *c, int err) {
  c->stage = NULL;
  if (c->closing)
    return;
  if (err) {
    s_violation(c, sx_strerror(err));
    return;
  }
  s_process(c);
  if (s_may_read(c) && c->queued < SERVER_QUEUE_MAX / 2)
    s_read_start(c);
}

typedef struct sbuf_write {
  uv_write_t req;
  sconn *c;
  uint8_t *buf;
  size_t len;
} sbuf_write;

/* Runs before the connection is freed (libuv cancels writes before the
 * close callback). */
static void sbuf_written(uv_write_t *req, int status) {
  sbuf_write *w = (sbuf_write *)req;
  sconn *c = w->c;
  (void)status; /* a broken connection shows on its read side */
  c->sbytes -= w->len;
  free(w->buf);
  free(w);
  if (s_may_read(c) && c->queued < SERVER_QUEUE_MAX / 2)
    s_read_start(c);
}

int sx__tcp_sconn_send(sconn *c, uint8_t *buf, size_t len) {
  sbuf_write *w = malloc(sizeof(*w));
  if (w == NULL || c->closing || s_flush(c, 0) != 0) {
    free(w);
    free(buf);
    return SX_EDISCONN;
  }
  w->c = c;
  w->buf = buf;
  w->len = len;
  uv_buf_t b = uv_buf_init((char *)buf, (unsigned)len);
  if (uv_write(&w->req, (uv_stream_t *)&c->h, &b, 1, sbuf_written) != 0) {
    free(w);
    free(buf);
    s_lost(c, 0);
    return SX_EDISCONN;
  }
  c->sbytes += len;
  return 0;
}

void sx__tcp_sconn_close(sconn *c, const char *why) { s_violation(c, why); }

const char *sx__tcp_sconn_reader(const sconn *c) {
  return c->reader[0] ? c->reader : c->peer;
}

void sx__tcp_serve_withdraw(tcp_t *t, sx_lregion *l) {
  for (sconn *c = t->sconns; c; c = c->next)
    if (!c->closing)
      sx__ipc_revoke(c->ipc, l);
}

void sx__tcp_serve_close_all(tcp_t *t) {
  for (sconn *c = t->sconns; c; c = c->next)
    s_close(c);
}

/* ------------------------------------------------------------ push mode */

void sx__tcp_sconn_reply(sconn *c, uint64_t id, uint8_t type, int status) {
  if (c->nrep == REPLIES_PER_WRITE && s_flush(c, 0) != 0)
    return;
  s_reply(c, id, type, status, NULL, NULL, 0);
}

int sx__tcp_sconn_flush(sconn *c) { return s_flush(c, 0); }

void sx__tcp_sconn_violation(sconn *c, const char *what) { s_violation(c, what); }

void sx__tcp_sconn_hold(sconn *c) {
  uv_read_stop((uv_stream_t *)&c->h);
  c->reading = 0;
}

void sx__tcp_sconn_wresume(sconn *c) {
  if (c->closing)
    return;
  s_process(c);
  if (s_may_read(c) && c->queued < SERVER_QUEUE_MAX)
    s_read_start(c);
}

tcp_t *sx__tcp_sconn_transport(const sconn *c) { return c->t; }

sx__tcp_wconn *sx__tcp_sconn_wconn(const sconn *c) { return c->w; }

int sx__tcp_sconn_ipc(const sconn *c) { return c->ipc != NULL; }

void sx__tcp_serve_revoked(tcp_t *t) {
  for (sconn *c = t->sconns; c; c = c->next) {
    if (c->closing || c->w == NULL)
      continue;
    sx__tcp_w_revoked(c->w);
    if (c->ipc != NULL && sx__tcp_w_allowed(c->w) != 0)
      sx__ipc_revoke_granted(c->ipc);
  }
}

void sx__tcp_serve_gated(tcp_t *t, const sx_lregion *l) {
  for (sconn *c = t->sconns; c; c = c->next)
    if (!c->closing)
      sx__ipc_gated(c->ipc, l, sx__tcp_w_allowed(c->w) == 0);
}
