/*
 * cuda_ipc, the side that copies: the control connection to the target's
 * TCP listener that fetches CUDA IPC handles.  It says HELLO like any TCP
 * reader (incarnation and access token checked by the target), and WAUTH
 * like a TCP producer when this agent is named and the target has
 * writable regions (handles of writable allocations go only to producers
 * the target granted writes), then asks for the handles of the regions
 * batches need (IPC frames, transport/conn/frame.h), hears when the target wants them
 * back, and carries write batches' notices.  When it breaks, every mapping
 * of that target goes (cuda_ipc.c, sx__ipc_lost).
 */
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "ipc_int.h"

#define RB_MIN 65536

static void c_closed(uv_handle_t *h) {
  ipc_peer *p = h->data;
  p->handles--;
  if ((uv_handle_t *)&p->h == h) {
    p->state = C_IDLE;
    if (!p->closing && p->waiting != NULL)
      sx__ipc_conn_kick(p); /* work came while it closed */
  }
  sx__ipc_peer_maybe_free(p);
}

/* Close the connection; waiting ops fail with err, mappings go. */
static void c_fail(ipc_peer *p, int err, const char *msg) {
  if (p->state == C_IDLE || p->state == C_CLOSING)
    return;
  const sx_tctx *x = p->t->base.ctx;
  x->log(x->agent, SX_LOG_INFO, "cuda_ipc: %s", msg);
  p->state = C_CLOSING;
  p->rlen = 0;
  uv_timer_stop(&p->timer);
  uv_close((uv_handle_t *)&p->h, c_closed);
  sx__ipc_lost(p, err, msg);
}

static void c_timeout(uv_timer_t *t) {
  ipc_peer *p = t->data;
  char msg[256];
  snprintf(msg, sizeof(msg), "%s: connecting timed out after %d ms", p->label,
           IPC_CONNECT_MS);
  c_fail(p, SX_EUNREACH, msg);
}

typedef struct cwrite {
  uv_write_t req;
  ipc_peer *p;
  uint8_t buf[];
} cwrite;

static void c_written(uv_write_t *req, int status) {
  cwrite *w = (cwrite *)req;
  ipc_peer *p = w->p;
  free(w);
  if (status < 0 && status != UV_ECANCELED) {
    char msg[256];
    snprintf(msg, sizeof(msg), "%s: sending: %s", p->label, uv_strerror(status));
    c_fail(p, SX_EDISCONN, msg);
  }
}

static int c_write(ipc_peer *p, const sx__frame *f, const uint8_t *body, size_t len) {
  cwrite *w = malloc(sizeof(*w) + SX__FRAME_HDR + len);
  if (w == NULL)
    return sx__err(SX_ENOMEM, "cuda_ipc: write");
  w->p = p;
  sx__frame_encode(f, w->buf);
  if (len)
    memcpy(w->buf + SX__FRAME_HDR, body, len);
  uv_buf_t b = uv_buf_init((char *)w->buf, (unsigned)(SX__FRAME_HDR + len));
  if (uv_write(&w->req, (uv_stream_t *)&p->h, &b, 1, c_written) != 0) {
    free(w);
    return sx__err(SX_EDISCONN, "%s: cannot send", p->label);
  }
  return 0;
}

int sx__ipc_conn_send(ipc_peer *p, uint64_t id, const uint32_t *ids, uint32_t n) {
  while (n > 0) {
    uint32_t k = n < SX__IPC_MAX_IDS ? n : SX__IPC_MAX_IDS;
    uint8_t body[4 * SX__IPC_MAX_IDS];
    for (uint32_t i = 0; i < k; i++) {
      body[4 * i] = (uint8_t)(ids[i] >> 24);
      body[4 * i + 1] = (uint8_t)(ids[i] >> 16);
      body[4 * i + 2] = (uint8_t)(ids[i] >> 8);
      body[4 * i + 3] = (uint8_t)ids[i];
    }
    sx__frame f = {.type = SX__FRAME_IPC, .id = id, .length = 4u * k};
    int rc = c_write(p, &f, body, 4u * k);
    if (rc)
      return rc;
    ids += k;
    n -= k;
  }
  return 0;
}

/* Ask for every region that a waiting op needs and nobody asked for. */
static void ask(ipc_peer *p) {
  uint32_t *ids = malloc((p->n_regs + 1) * sizeof(uint32_t)), n = 0;
  if (ids == NULL)
    return;
  for (iop *o = p->waiting; o != NULL; o = o->next) {
    for (size_t i = 0; i < iop_n_regs(o); i++) {
      ipc_reg *r = &p->regs[iop_reg(o, i)];
      if (r->state == R_NONE) {
        r->state = R_ASKED;
        ids[n++] = r->id;
      }
    }
  }
  if (n > 0 && sx__ipc_conn_send(p, ++p->next_id, ids, n) != 0)
    c_fail(p, SX_EDISCONN, sx_errmsg());
  free(ids);
}

int sx__ipc_conn_wauth(ipc_peer *p) {
  const sx_tctx *x = p->t->base.ctx;
  uint8_t body[SX__WAUTH_BODY];
  memcpy(body, x->incarnation, SX_INCARNATION_LEN);
  memcpy(body + SX_INCARNATION_LEN, x->token, SX_TOKEN_LEN);
  sx__frame f = {.type = SX__FRAME_WAUTH, .length = SX__WAUTH_BODY};
  int rc = c_write(p, &f, body, sizeof(body));
  if (rc == 0)
    p->wauth = WA_PENDING;
  return rc;
}

int sx__ipc_conn_notice(ipc_peer *p, uint64_t id, const uint8_t *buf, size_t len) {
  /* A read peer's notice is a read notice (SX_BATCH_NOTIFY): no WAUTH. */
  sx__frame f = {.type = p->write ? SX__FRAME_NOTICE : SX__FRAME_RNOTICE, .id = id,
                 .length = len};
  return c_write(p, &f, buf, len);
}

static void on_hello_reply(ipc_peer *p, const sx__frame *f) {
  char msg[256];
  if (f->status == 0) {
    if (p->wauth == WA_PENDING) {
      p->state = C_WAUTH; /* its reply follows */
      return;
    }
    p->state = C_READY;
    uv_timer_stop(&p->timer);
    ask(p);
    return;
  }
  int err = sx__hello_refused(f->status, p->label, p->remote->incarnation, msg, sizeof(msg));
  c_fail(p, err, msg);
}

/* One whole frame (header and body) from the target. */
static void on_frame(ipc_peer *p, const sx__frame *f, const uint8_t *body) {
  char msg[256];
  if (p->state == C_HELLO) {
    if (f->type == SX__FRAME_HELLO_REPLY) {
      on_hello_reply(p, f);
      return;
    }
  } else if (f->type == SX__FRAME_WAUTH_REPLY && p->wauth == WA_PENDING) {
    /* A refusal leaves the connection open: handles of allocations that
     * need no grant still come, the others are refused one by one. */
    p->wauth = f->status == 0 ? WA_OK : f->status >= SX_ERRNO_MIN ? f->status : SX_EPROTO;
    if (p->state == C_WAUTH) {
      p->state = C_READY;
      uv_timer_stop(&p->timer);
      ask(p);
    }
    return;
  } else if (p->state == C_WAUTH) {
    /* nothing else before the WAUTH reply */
  } else if (f->type == SX__FRAME_NOTICE_REPLY) {
    sx__ipc_noticed(p, f->id, f->status);
    return;
  } else if (f->type == SX__FRAME_IPC_REPLY) {
    if (f->id == 0) {
      if (sx__ipc_revoked(p, body, (size_t)f->length) != 0) {
        snprintf(msg, sizeof(msg), "%s: out of memory noting regions to give back",
                 p->label);
        c_fail(p, SX_ENOMEM, msg);
      }
    } else if (f->status != 0) {
      /* The target refused the whole request (it does not serve cuda_ipc). */
      for (uint32_t i = 0; i < p->n_regs; i++) {
        if (p->regs[i].state == R_ASKED) {
          p->regs[i].state = R_FAILED;
          p->regs[i].err = f->status >= SX_ERRNO_MIN ? f->status : SX_EPROTO;
        }
      }
      sx__ipc_records(p, NULL, 0);
    } else {
      sx__ipc_records(p, body, (size_t)f->length);
    }
    return;
  }
  snprintf(msg, sizeof(msg), "%s sent an unexpected frame (type %u)", p->label, f->type);
  c_fail(p, SX_EPROTO, msg);
}

static void c_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  ipc_peer *p = h->data;
  (void)suggested;
  if (p->rcap - p->rlen < 4096) {
    size_t cap = p->rcap ? 2 * p->rcap : RB_MIN;
    uint8_t *rb = realloc(p->rb, cap);
    if (rb != NULL) {
      p->rb = rb;
      p->rcap = cap;
    }
  }
  buf->base = (char *)p->rb + p->rlen;
  buf->len = p->rcap - p->rlen;
}

static void c_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  ipc_peer *p = s->data;
  char msg[256];
  (void)buf;
  if (nread < 0) {
    sx__conn_lost_msg(p->label, nread == UV_EOF ? NULL : uv_strerror((int)nread), msg,
                      sizeof(msg));
    c_fail(p, SX_EDISCONN, msg);
    return;
  }
  p->rlen += (size_t)nread;
  size_t off = 0;
  while (p->state == C_HELLO || p->state == C_WAUTH || p->state == C_READY) {
    sx__frame f;
    int rc = sx__frame_decode(p->rb + off, p->rlen - off, &f);
    if (rc == 0 || (rc > 0 && p->rlen - off < SX__FRAME_HDR + f.length))
      break;
    if (rc < 0) {
      snprintf(msg, sizeof(msg), "%s sent a malformed frame", p->label);
      c_fail(p, SX_EPROTO, msg);
      return;
    }
    on_frame(p, &f, p->rb + off + SX__FRAME_HDR);
    off += SX__FRAME_HDR + (size_t)f.length;
  }
  if (p->state == C_HELLO || p->state == C_WAUTH || p->state == C_READY) {
    memmove(p->rb, p->rb + off, p->rlen - off);
    p->rlen -= off;
  }
}

static void c_connected(uv_connect_t *req, int status) {
  ipc_peer *p = req->data;
  char msg[256];
  if (p->state != C_CONNECTING)
    return;
  if (status < 0) {
    snprintf(msg, sizeof(msg), "connecting to %s: %s", p->label, uv_strerror(status));
    c_fail(p, SX_EUNREACH, msg);
    return;
  }
  const sx_tctx *x = p->t->base.ctx;
  uv_tcp_nodelay(&p->h, 1);
  uint8_t body[SX__HELLO_MAX];
  int len = sx__hello_build(p->remote->incarnation, p->remote->token, x->name, body,
                            sizeof(body));
  sx__frame f = {.type = SX__FRAME_HELLO, .length = (uint64_t)len};
  p->state = C_HELLO;
  p->wauth = WA_NONE;
  if (uv_read_start((uv_stream_t *)&p->h, c_alloc, c_read) != 0 ||
      c_write(p, &f, body, (size_t)len) != 0 ||
      (p->wauth_want && sx__ipc_conn_wauth(p) != 0)) {
    snprintf(msg, sizeof(msg), "%s: cannot start the connection", p->label);
    c_fail(p, SX_EDISCONN, msg);
  }
}

static const sx_endpoint *endpoint(const sx_desc *d) {
  for (uint32_t i = 0; i < d->n_endpoints; i++)
    if (d->endpoints[i].kind == SX_TRANSPORT_CUDA_IPC)
      return &d->endpoints[i];
  return NULL;
}

void sx__ipc_conn_kick(ipc_peer *p) {
  if (p->closing)
    return;
  if (p->state == C_READY) {
    ask(p);
    return;
  }
  if (p->state != C_IDLE)
    return;
  const sx_endpoint *e = endpoint(p->remote);
  struct sockaddr_storage sa;
  char port[8], msg[256];
  snprintf(port, sizeof(port), "%u", e->port);
  memset(&sa, 0, sizeof(sa));
  if (uv_ip4_addr(e->addr, e->port, (struct sockaddr_in *)&sa) != 0 &&
      uv_ip6_addr(e->addr, e->port, (struct sockaddr_in6 *)&sa) != 0) {
    /* A host name: the target runs on this host, so this resolves fast. */
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *res = NULL;
    if (getaddrinfo(e->addr, port, &hints, &res) != 0 || res == NULL) {
      snprintf(msg, sizeof(msg), "%s: cannot resolve the address", p->label);
      p->state = C_CONNECTING; /* so that c_fail runs its course */
      uv_tcp_init(p->t->loop, &p->h);
      p->h.data = p;
      p->handles++;
      c_fail(p, SX_EUNREACH, msg);
      return;
    }
    memcpy(&sa, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
  }
  uv_tcp_init(p->t->loop, &p->h);
  p->h.data = p;
  p->handles++;
  p->state = C_CONNECTING;
  p->creq.data = p;
  uv_timer_start(&p->timer, c_timeout, IPC_CONNECT_MS, 0);
  int rc = uv_tcp_connect(&p->creq, &p->h, (struct sockaddr *)&sa, c_connected);
  if (rc != 0) {
    snprintf(msg, sizeof(msg), "connecting to %s: %s", p->label, uv_strerror(rc));
    c_fail(p, SX_EUNREACH, msg);
  }
}

int sx__ipc_conn_init(ipc_peer *p) {
  const sx_endpoint *e = endpoint(p->remote);
  if (e == NULL)
    return sx__err(SX_EUNREACH, "%s publishes no cuda_ipc endpoint", p->remote->name);
  snprintf(p->label, sizeof(p->label), strchr(e->addr, ':') ? "%.64s at [%.63s]:%u"
                                                            : "%.64s at %.63s:%u",
           p->remote->name, e->addr, e->port);
  uv_timer_init(p->t->loop, &p->timer);
  p->timer.data = p;
  p->handles = 1;
  p->state = C_IDLE;
  return 0;
}

void sx__ipc_conn_close(ipc_peer *p) {
  if (p->state != C_IDLE && p->state != C_CLOSING) {
    p->state = C_CLOSING;
    uv_close((uv_handle_t *)&p->h, c_closed);
  }
  uv_close((uv_handle_t *)&p->timer, c_closed);
}
