/*
 * The control connection, target side (see conn.h): accepting, HELLO,
 * framing, the reply queue, flow control and dispatch to the transports'
 * handlers.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "conn.h"
#include "internal.h"

typedef struct swrite swrite;

/* A write held back while a data-mover thread sends on the connection
 * (bufs copied: callers' lists live on their stacks). */
typedef struct held {
  struct held *next;
  uv_write_t *req;
  uv_write_cb cb;
  int big;          /* a write that a data-mover thread may send */
  unsigned n;
  uv_buf_t bufs[];
} held;

typedef struct reply {
  sx_lregion *l; /* NULL for a reply without payload */
  uint8_t *payload;
  uint64_t len;
  int more; /* a further piece of the payload of the reply before (no header) */
} reply;

struct sx__conn {
  uv_tcp_t h;
  uv_timer_t hello_timer;
  sx__conn_server *s;
  sx__conn *next, *prev;
  char peer[64];                 /* "ip:port" */
  char host[48];                 /* "ip" */
  char reader[SX_NAME_MAX + 1];
  int hello_ok, closing, reading, handles;
  uint32_t queued;
  uint64_t wbytes;               /* payload bytes of those replies (tx_engaged) */
  size_t sbytes;                 /* of sx__conn_send() frames not sent yet */
  size_t rlen;
  uint8_t rbuf[SX__CONN_RBUF];
  uint32_t nrep;
  reply rep[SX__CONN_REPLIES];
  uint8_t hdr[SX__CONN_REPLIES][SX__FRAME_HDR];
  void *slot[SX__CONN_SLOTS];    /* each handler's state, NULL until used */
  /* A large write lent to a data-mover thread (tx_*: see tx_lend), and
   * the writes held behind it meanwhile, in order. */
  sx__xjob tx;
  uv_write_t *tx_req;            /* the lent write; NULL: none */
  uv_write_cb tx_cb;
  struct iovec *tx_iov;          /* a copy of its buffers, sent from */
  int tx_fd, tx_errno;
  unsigned tx_i, tx_n;           /* tx_iov: the next one to send, all */
  held *held, **held_tail;
};

struct swrite {
  uv_write_t req;
  sx__conn *c;
  uint32_t n;
  int close_after;
  uint64_t bytes;     /* payload bytes */
  sx_lregion **lregs; /* n, inside this allocation */
  uint8_t *hdrs;      /* n * SX__FRAME_HDR, inside this allocation */
};

static const sx__conn_handler *slot_handler(const sx__conn_server *s, unsigned k) {
  return s->by_slot[k];
}

void sx__conn_server_init(sx__conn_server *s, const sx_tctx *x,
                          void (*freed)(sx__conn_server *s)) {
  memset(s, 0, sizeof(*s));
  s->x = x;
  s->freed = freed;
  for (unsigned i = 0; i < x->n_conn_handlers; i++) {
    const sx__conn_handler *h = x->conn_handlers[i];
    for (unsigned t = h->first; t <= h->last && t <= SX__FRAME_TYPE_MAX; t++)
      s->by_type[t] = h;
    if (h->slot < SX__CONN_SLOTS && s->by_slot[h->slot] == NULL)
      s->by_slot[h->slot] = h;
  }
}

static void s_closed(uv_handle_t *h) {
  sx__conn *c = h->data;
  if (--c->handles > 0)
    return;
  sx__conn_server *s = c->s;
  if (c->prev)
    c->prev->next = c->next;
  else
    s->conns = c->next;
  if (c->next)
    c->next->prev = c->prev;
  s->n_conns--;
  for (unsigned k = 0; k < SX__CONN_SLOTS; k++) {
    const sx__conn_handler *hd = slot_handler(s, k);
    if (hd != NULL && hd->free != NULL)
      hd->free(c->slot[k]);
  }
  free(c);
  s->freed(s);
}

static void tx_cancel(sx__conn *c);

/* Close a connection; its queued replies are cancelled first (their write
 * callbacks release the regions), then it is freed. */
static void s_close(sx__conn *c) {
  if (c->handles == 0 || uv_is_closing((uv_handle_t *)&c->h))
    return;
  c->closing = 1;
  tx_cancel(c); /* before the descriptor closes */
  for (unsigned k = 0; k < SX__CONN_SLOTS; k++) {
    const sx__conn_handler *hd = slot_handler(c->s, k);
    if (hd != NULL && hd->close != NULL) {
      if (c->slot[k] != NULL)
        hd->close(c->slot[k]);
      c->slot[k] = NULL;
    }
  }
  uv_close((uv_handle_t *)&c->h, s_closed);
  uv_close((uv_handle_t *)&c->hello_timer, s_closed);
}

static void s_violation(sx__conn *c, const char *what) {
  const sx_tctx *x = c->s->x;
  x->log(x->agent, SX_LOG_WARN, "tcp: closing connection from %s (%s): %s", c->peer,
         c->reader[0] ? c->reader : "no hello yet", what);
  x->served(x->agent, SX_TRANSPORT_TCP, 0, SX_EPROTO);
  s_close(c);
}

/* The reader went away (end of stream, or an error reading or writing):
 * one line for it, then close.  err is 0 or a libuv error. */
static void s_lost(sx__conn *c, int err) {
  if (!c->closing) {
    const sx_tctx *x = c->s->x;
    x->log(x->agent, SX_LOG_INFO, "tcp: reader %s from %s disconnected%s%s",
           c->reader[0] ? c->reader : "(no hello)", c->peer, err ? ": " : "",
           err ? uv_strerror(err) : "");
  }
  s_close(c);
}

static void s_read_start(sx__conn *c);

/* 1 while a handler says the connection must read and parse nothing
 * more (holds), or also while a body arrives for it (busy: parse no
 * more, but read on). */
static int s_holds(const sx__conn *c, int busy) {
  for (unsigned k = 0; k < SX__CONN_SLOTS; k++) {
    const sx__conn_handler *hd;
    if (c->slot[k] == NULL || (hd = slot_handler(c->s, k)) == NULL)
      continue;
    if ((hd->holds != NULL && hd->holds(c->slot[k])) ||
        (busy && hd->receiving != NULL && hd->receiving(c->slot[k])))
      return 1;
  }
  return 0;
}

/* The handler whose body is arriving, or NULL. */
static const sx__conn_handler *s_receiver(const sx__conn *c, void **slot) {
  for (unsigned k = 0; k < SX__CONN_SLOTS; k++) {
    const sx__conn_handler *hd;
    if (c->slot[k] != NULL && (hd = slot_handler(c->s, k)) != NULL &&
        hd->receiving != NULL && hd->receiving(c->slot[k])) {
      *slot = c->slot[k];
      return hd;
    }
  }
  return NULL;
}

/* Not reading now, and nothing holds parsing back.  The callers add their
 * queue limits. */
static int s_may_read(const sx__conn *c) {
  return !c->closing && !c->reading && c->sbytes < SX__CONN_SEND_MAX / 2 && !s_holds(c, 0);
}

static void s_written(uv_write_t *req, int status) {
  swrite *w = (swrite *)req;
  sx__conn *c = w->c;
  for (uint32_t i = 0; i < w->n; i++)
    if (w->lregs[i] != NULL)
      w->lregs[i]->inflight--;
  c->queued -= w->n;
  c->wbytes -= w->bytes;
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
  if (s_may_read(c) && c->queued < SX__CONN_QUEUE_MAX / 2)
    s_read_start(c);
}

/* ----------------------------------------- writes by data-mover threads */

/* The most bytes one system call sends: taking a write back waits for one
 * such copy at most. */
#define TX_CHUNK (2u << 20)
#define TX_PIECES 64

static sx__conn *tx_conn(sx__xjob *j) { return (sx__conn *)((char *)j - offsetof(sx__conn, tx)); }

/* Worker: send the lent write (its owner keeps the bytes), until it
 * is out, the socket fails, or the pool wants the thread back while the
 * socket is full (a reader that does not read holds no thread others
 * need; the loop sends the rest). */
static void tx_run(sx__xjob *j) {
  sx__conn *c = tx_conn(j);
  struct iovec *iov = c->tx_iov;
  c->tx_errno = 0;
  while (c->tx_i < c->tx_n && !atomic_load(&j->stop)) {
    struct iovec v[TX_PIECES];
    size_t k = 0, bytes = 0;
    for (unsigned i = c->tx_i; i < c->tx_n && k < TX_PIECES && bytes < TX_CHUNK; i++) {
      v[k] = iov[i];
      if (v[k].iov_len > TX_CHUNK - bytes)
        v[k].iov_len = TX_CHUNK - bytes;
      bytes += v[k++].iov_len;
    }
    struct msghdr m = {.msg_iov = v, .msg_iovlen = k};
    ssize_t sent = sendmsg(c->tx_fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent >= 0) {
      size_t left = (size_t)sent;
      while (c->tx_i < c->tx_n && left >= iov[c->tx_i].iov_len)
        left -= iov[c->tx_i++].iov_len;
      if (left > 0) {
        iov[c->tx_i].iov_base = (char *)iov[c->tx_i].iov_base + left;
        iov[c->tx_i].iov_len -= left;
      }
      continue;
    }
    int again = sx__xpool_again(j, c->tx_fd, POLLOUT);
    if (again <= 0) {
      c->tx_errno = again < 0 ? errno : 0;
      return;
    }
  }
}

static int tx_lend(sx__conn *c, uv_write_t *req, uv_write_cb cb, const uv_buf_t *bufs,
                   unsigned nb);

/* Issue held writes in order, until one is lent to a thread again. */
static void tx_drain(sx__conn *c) {
  while (c->held != NULL && c->tx_req == NULL && !c->closing) {
    held *h = c->held;
    c->held = h->next;
    if (c->held == NULL)
      c->held_tail = &c->held;
    if (!(h->big && tx_lend(c, h->req, h->cb, h->bufs, h->n))) {
      int rc = uv_write(h->req, (uv_stream_t *)&c->h, h->bufs, h->n, h->cb);
      if (rc != 0)
        h->cb(h->req, rc); /* its callback sees the broken connection */
    }
    free(h);
  }
}

/* Loop: the worker returned: what it did not send (it gave way), libuv
 * sends; then the writes held behind it go. */
static void tx_notify(sx__xjob *j, int finished) {
  sx__conn *c = tx_conn(j);
  uv_write_t *req = c->tx_req;
  struct iovec *iov = c->tx_iov;
  (void)finished; /* a write reports only its end */
  c->tx_req = NULL;
  c->tx_iov = NULL;
  int st = c->tx_errno ? uv_translate_sys_error(c->tx_errno) : 0;
  if (st == 0 && c->tx_i < c->tx_n) {
    /* uv_write() copies the list. */
    unsigned n = c->tx_n - c->tx_i;
    uv_buf_t some[2 * SX__CONN_REPLIES], *rest = some;
    if (n > sizeof(some) / sizeof(some[0]) && (rest = malloc(n * sizeof(*rest))) == NULL)
      st = UV_ENOMEM;
    for (unsigned i = 0; rest != NULL && i < n; i++)
      rest[i] = uv_buf_init(iov[c->tx_i + i].iov_base, (unsigned)iov[c->tx_i + i].iov_len);
    if (rest != NULL)
      st = uv_write(req, (uv_stream_t *)&c->h, rest, n, c->tx_cb);
    if (rest != some)
      free(rest);
    if (st == 0)
      req = NULL;
  }
  free(iov);
  if (req != NULL)
    c->tx_cb(req, st);
  tx_drain(c);
}

/* Whether the threads send reply writes now (engage.h): while at least
 * tx_eng.conns connections, c among them, have a large reply write queued
 * or being sent. */
static int tx_engaged(sx__conn *c) {
  sx__conn_server *s = c->s;
  uint32_t busy = 0;
  for (const sx__conn *o = s->conns; o != NULL && busy < s->tx_eng.conns; o = o->next)
    busy += !o->closing && o->wbytes >= s->pool_min;
  if (sx__engage_update(&s->tx_eng, s->x->loop, busy))
    return 1;
  sx__engage_keep(&s->tx_eng);
  return 0;
}

/* Lend the write req (buffers bufs, cb when done) to a data-mover thread
 * when the threads are engaged and one may send it now: nothing written
 * before it is still queued in libuv.  1 if lent. */
static int tx_lend(sx__conn *c, uv_write_t *req, uv_write_cb cb, const uv_buf_t *bufs,
                   unsigned nb) {
  sx__xpool *pool;
  uv_os_fd_t fd;
  if (c->closing || !tx_engaged(c) || (pool = sx__conn_pool(c->s)) == NULL ||
      c->tx_req != NULL || uv_stream_get_write_queue_size((uv_stream_t *)&c->h) != 0 ||
      uv_fileno((const uv_handle_t *)&c->h, &fd) != 0 ||
      (c->tx_iov = malloc(nb * sizeof(*c->tx_iov))) == NULL)
    return 0;
  for (unsigned i = 0; i < nb; i++)
    c->tx_iov[i] = (struct iovec){bufs[i].base, bufs[i].len};
  c->tx_req = req;
  c->tx_cb = cb;
  c->tx_fd = fd;
  c->tx_i = 0;
  c->tx_n = nb;
  c->tx.run = tx_run;
  c->tx.notify = tx_notify;
  c->tx.kind = SX__XJOB_SEND;
  sx__xpool_submit(pool, &c->tx);
  return 1;
}

/* Closing: the thread stops before the descriptor closes; the lent write
 * and the held ones end cancelled, as libuv ends its queued ones. */
static void tx_cancel(sx__conn *c) {
  if (c->tx_req != NULL) {
    sx__xpool_reclaim(&c->tx);
    uv_write_t *req = c->tx_req;
    free(c->tx_iov);
    c->tx_req = NULL;
    c->tx_iov = NULL;
    c->tx_cb(req, UV_ECANCELED);
  }
  while (c->held != NULL) {
    held *h = c->held;
    c->held = h->next;
    h->cb(h->req, UV_ECANCELED);
    free(h);
  }
  c->held_tail = &c->held;
}

/* Is a write of bytes payload bytes one for the data-mover threads? */
static int s_big(const sx__conn *c, uint64_t bytes) {
  return c->s->pool_threads > 0 && bytes >= c->s->pool_min;
}

/* Write on c in order.  big (s_big): lent to a data-mover thread when
 * nothing waits before it and the threads are engaged (tx_lend), else
 * held behind a lent write, for a thread when its turn comes. */
static int s_write(sx__conn *c, uv_write_t *req, const uv_buf_t *bufs, unsigned n,
                   uv_write_cb cb, int big) {
  if (big && c->held == NULL && tx_lend(c, req, cb, bufs, n))
    return 0;
  if (c->tx_req == NULL && c->held == NULL)
    return uv_write(req, (uv_stream_t *)&c->h, bufs, n, cb);
  if (c->closing)
    return UV_ECANCELED;
  held *h = malloc(sizeof(*h) + n * sizeof(uv_buf_t));
  if (h == NULL)
    return UV_ENOMEM;
  *h = (held){.req = req, .cb = cb, .big = big, .n = n};
  memcpy(h->bufs, bufs, n * sizeof(uv_buf_t));
  if (c->held_tail == NULL)
    c->held_tail = &c->held;
  *c->held_tail = h;
  c->held_tail = &h->next;
  return 0;
}

static void w_written(uv_write_t *req, int status) {
  sx__conn_wreq *w = (sx__conn_wreq *)((char *)req - offsetof(sx__conn_wreq, req));
  w->c->wbytes -= w->bytes;
  w->cb(w, status);
}

int sx__conn_write(sx__conn *c, sx__conn_wreq *w, const uv_buf_t *bufs, unsigned n,
                   sx__conn_wcb cb) {
  uint64_t bytes = 0;
  for (unsigned i = 0; i < n; i++)
    bytes += bufs[i].len;
  int big = s_big(c, bytes);
  w->c = c;
  w->cb = cb;
  w->bytes = big ? bytes : 0; /* counted while queued, as reply writes are */
  c->wbytes += w->bytes;
  int rc = s_write(c, &w->req, bufs, n, w_written, big);
  if (rc != 0)
    c->wbytes -= w->bytes;
  return rc;
}

/* Send the replies gathered so far in one write: on a data-mover thread
 * when their payload is large. */
static int s_flush(sx__conn *c, int close_after) {
  uint32_t n = c->nrep;
  if (n == 0)
    return 0;
  c->nrep = 0;
  swrite *w = malloc(sizeof(*w) + n * (sizeof(sx_lregion *) + SX__FRAME_HDR));
  uv_buf_t bufs[2 * SX__CONN_REPLIES];
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
  uint64_t bytes = 0;
  for (uint32_t i = 0; i < n; i++) {
    if (!c->rep[i].more) {
      memcpy(w->hdrs + i * SX__FRAME_HDR, c->hdr[i], SX__FRAME_HDR);
      bufs[nb++] = uv_buf_init((char *)w->hdrs + i * SX__FRAME_HDR, SX__FRAME_HDR);
    }
    w->lregs[i] = c->rep[i].l;
    if (c->rep[i].l != NULL) {
      bufs[nb].base = (char *)c->rep[i].payload;
      bufs[nb].len = (size_t)c->rep[i].len;
      bytes += c->rep[i].len;
      nb++;
      c->rep[i].l->inflight++;
    }
  }
  c->queued += n;
  w->bytes = bytes;
  c->wbytes += bytes;
  int big = !close_after && s_big(c, bytes);
  int rc = s_write(c, &w->req, bufs, nb, s_written, big);
  if (rc != 0) {
    for (uint32_t i = 0; i < n; i++)
      if (w->lregs[i] != NULL)
        w->lregs[i]->inflight--;
    c->queued -= n;
    c->wbytes -= bytes;
    free(w);
    s_lost(c, rc);
    return -1;
  }
  return 0;
}

/* Queue header f and, with status 0 and l, len payload bytes at payload
 * (all of f->length, or a READV's first piece of it). */
static void s_reply_frame(sx__conn *c, const sx__frame *f, sx_lregion *l, uint8_t *payload,
                          uint64_t len) {
  sx__frame_encode(f, c->hdr[c->nrep]);
  c->rep[c->nrep] = (reply){f->status ? NULL : l, payload, len, 0};
  c->nrep++;
}

static void s_reply(sx__conn *c, uint64_t id, uint8_t type, int status, sx_lregion *l,
                    uint8_t *payload, uint64_t len) {
  sx__frame f = {.type = type, .id = id, .status = status, .length = status ? 0 : len};
  s_reply_frame(c, &f, l, payload, len);
}

/* The handshake: the incarnation the reader expects and the access token
 * it presents, both compared before anything else is parsed. */
static void s_hello(sx__conn *c, const sx__frame *f, const uint8_t *body) {
  sx__conn_server *s = c->s;
  const sx_tctx *x = s->x;
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
    for (sx__conn *o = s->conns; o; o = o->next)
      same += o != c && o->hello_ok && strcmp(o->reader, c->reader) == 0 &&
              (h.name[0] != '\0' || strcmp(o->host, c->host) == 0);
    if (same >= SX__CONN_PER_READER)
      status = SX_ELIMIT;
  }
  /* What we serve beyond every version's frames. */
  sx__frame r = {.type = SX__FRAME_HELLO_REPLY, .id = f->id, .status = status,
                 .offset = status == 0 && s->by_type[SX__FRAME_READV]
                               ? SX__FEAT_READV | SX__FEAT_READV_GPU
                               : 0};
  s_reply_frame(c, &r, NULL, NULL, 0);
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

/* What a connection that began with no frame magic sent, for the log:
 * its first bytes, as text where they are printable (an HTTP probe reads
 * "GET / HTTP"), else in hex. */
static void s_foreign(const uint8_t *b, size_t len, char *out, size_t cap) {
  size_t n = len < 12 ? len : 12, k = 0, printable = 1;
  for (size_t i = 0; i < n; i++)
    printable &= b[i] >= 0x20 && b[i] < 0x7f;
  k = (size_t)snprintf(out, cap, "not a segxfer peer: it began with %s", printable ? "\"" : "");
  for (size_t i = 0; i < n && k + 4 < cap; i++)
    k += (size_t)snprintf(out + k, cap - k, printable ? "%c" : "%02x", b[i]);
  if (printable && k + 2 < cap)
    snprintf(out + k, cap - k, "\"");
}

static void s_process(sx__conn *c) {
  size_t off = 0;
  while (!c->closing && !s_holds(c, 1)) {
    sx__frame f;
    int rc = sx__frame_decode(c->rbuf + off, c->rlen - off, &f);
    if (rc == 0)
      break;
    if (rc < 0) {
      char what[96];
      if (!c->hello_ok && off == 0 && rc == SX_EPROTO && sx__frame_foreign(c->rbuf, c->rlen))
        s_foreign(c->rbuf, c->rlen, what, sizeof(what));
      else
        snprintf(what, sizeof(what), "%s", rc == SX_EVERSION ? "unsupported protocol version"
                                                             : "malformed frame header");
      s_violation(c, what);
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
    const sx__conn_handler *hd = f.type <= SX__FRAME_TYPE_MAX ? c->s->by_type[f.type] : NULL;
    if (hd == NULL) {
      s_violation(c, "unexpected frame type");
      return;
    }
    int used = hd->frame(c, &c->slot[hd->slot], &f, c->rbuf + off, c->rlen - off);
    if (used < 0)
      return;
    if (used == 0)
      break;
    off += (size_t)used;
  }
  if (c->closing)
    return;
  if (s_flush(c, 0) != 0)
    return;
  memmove(c->rbuf, c->rbuf + off, c->rlen - off);
  c->rlen -= off;
  if ((c->queued >= SX__CONN_QUEUE_MAX || c->sbytes >= SX__CONN_SEND_MAX) && c->reading) {
    /* The reader sends faster than it reads: push back.  IPC requests
     * count by the bytes they are answered with (up to 24 times theirs). */
    uv_read_stop((uv_stream_t *)&c->h);
    c->reading = 0;
  }
}

static void s_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  sx__conn *c = h->data;
  (void)suggested;
  void *slot;
  const sx__conn_handler *hd = s_receiver(c, &slot);
  if (hd != NULL) {
    hd->alloc(slot, buf);
    return;
  }
  buf->base = (char *)c->rbuf + c->rlen;
  buf->len = SX__CONN_RBUF - c->rlen;
  /* A producer's connection: read the next header alone, so that the
   * payload behind it goes straight into the region (the push handler's
   * alloc) rather than into rbuf and then copied (a quarter more copying
   * at 64 KiB writes, for one more small read per WRITE). */
  if (c->rlen < SX__FRAME_HDR)
    for (unsigned k = 0; k < SX__CONN_SLOTS; k++) {
      const sx__conn_handler *o = slot_handler(c->s, k);
      if (c->slot[k] != NULL && o != NULL && o->header_alone != NULL &&
          o->header_alone(c->slot[k]))
        buf->len = SX__FRAME_HDR - c->rlen;
    }
}

static void s_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf) {
  sx__conn *c = st->data;
  (void)buf;
  if (nread < 0) {
    s_lost(c, nread == UV_EOF ? 0 : (int)nread);
    return;
  }
  void *slot;
  const sx__conn_handler *hd = s_receiver(c, &slot);
  if (hd != NULL) {
    hd->read(slot, (size_t)nread);
    return;
  }
  c->rlen += (size_t)nread;
  s_process(c);
}

static void s_read_start(sx__conn *c) {
  if (uv_read_start((uv_stream_t *)&c->h, s_alloc, s_read) == 0)
    c->reading = 1;
}

static void s_hello_timeout(uv_timer_t *tm) {
  sx__conn *c = tm->data;
  s_violation(c, "no HELLO in time");
}

void sx__conn_accept(sx__conn_server *s, uv_stream_t *server, int status) {
  const sx_tctx *x = s->x;
  if (status < 0) {
    x->log(x->agent, SX_LOG_WARN, "tcp: accept failed: %s", uv_strerror(status));
    return;
  }
  sx__conn *c = calloc(1, sizeof(*c));
  if (c == NULL) {
    x->log(x->agent, SX_LOG_ERROR, "tcp: out of memory accepting a connection");
    return;
  }
  c->s = s;
  uv_tcp_init(x->loop, &c->h);
  uv_timer_init(x->loop, &c->hello_timer);
  c->h.data = c->hello_timer.data = c;
  c->handles = 2;
  c->next = s->conns;
  if (c->next)
    c->next->prev = c;
  s->conns = c;
  s->n_conns++;
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
  if (s->n_conns > SX__CONN_MAX) {
    x->log(x->agent, SX_LOG_WARN, "tcp: refusing %s: %u connections already", c->peer,
           SX__CONN_MAX);
    s_close(c);
    return;
  }
  uv_tcp_nodelay(&c->h, 1);
  uv_timer_start(&c->hello_timer, s_hello_timeout, SX__CONN_HELLO_MS, 0);
  s_read_start(c);
}

void sx__conn_resume(sx__conn *c, unsigned slot, int err) {
  c->slot[slot] = NULL;
  if (c->closing)
    return;
  if (err) {
    s_violation(c, sx_strerror(err));
    return;
  }
  s_process(c);
  if (s_may_read(c) && c->queued < SX__CONN_QUEUE_MAX / 2)
    s_read_start(c);
}

typedef struct sbuf_write {
  uv_write_t req;
  sx__conn *c;
  uint8_t *buf;
  size_t len;
} sbuf_write;

/* Runs before the connection is freed (libuv cancels writes before the
 * close callback). */
static void sbuf_written(uv_write_t *req, int status) {
  sbuf_write *w = (sbuf_write *)req;
  sx__conn *c = w->c;
  (void)status; /* a broken connection shows on its read side */
  c->sbytes -= w->len;
  free(w->buf);
  free(w);
  if (s_may_read(c) && c->queued < SX__CONN_QUEUE_MAX / 2)
    s_read_start(c);
}

int sx__conn_send(sx__conn *c, uint8_t *buf, size_t len) {
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
  if (s_write(c, &w->req, &b, 1, sbuf_written, 0) != 0) {
    free(w);
    free(buf);
    s_lost(c, 0);
    return SX_EDISCONN;
  }
  c->sbytes += len;
  return 0;
}

const char *sx__conn_reader(const sx__conn *c) { return c->reader[0] ? c->reader : c->peer; }

void sx__conn_close_all(sx__conn_server *s) {
  for (sx__conn *c = s->conns; c; c = c->next)
    s_close(c);
}

void sx__conn_reply(sx__conn *c, uint64_t id, uint8_t type, int status, sx_lregion *l,
                    uint8_t *payload, uint64_t len) {
  if (c->nrep == SX__CONN_REPLIES && s_flush(c, 0) != 0)
    return;
  s_reply(c, id, type, status, l, payload, len);
}

void sx__conn_reply_ranges(sx__conn *c, uint64_t id, int status, uint32_t index,
                           const sx__conn_piece *pc, uint32_t n) {
  if (c->nrep == SX__CONN_REPLIES && s_flush(c, 0) != 0)
    return;
  sx__frame f = {.type = SX__FRAME_READ_REPLY, .id = id, .status = status};
  if (status != 0) {
    f.region = index;
    s_reply_frame(c, &f, NULL, NULL, 0);
    return;
  }
  for (uint32_t i = 0; i < n; i++)
    f.length += pc[i].len;
  s_reply_frame(c, &f, pc[0].l, pc[0].payload, pc[0].len);
  for (uint32_t i = 1; i < n; i++) {
    if (c->nrep == SX__CONN_REPLIES && s_flush(c, 0) != 0)
      return;
    c->rep[c->nrep++] = (reply){pc[i].l, pc[i].payload, pc[i].len, 1};
  }
}

int sx__conn_flush(sx__conn *c) { return s_flush(c, 0); }

void sx__conn_violation(sx__conn *c, const char *what) { s_violation(c, what); }

void sx__conn_hold(sx__conn *c) {
  uv_read_stop((uv_stream_t *)&c->h);
  c->reading = 0;
}

void sx__conn_wresume(sx__conn *c) {
  if (c->closing)
    return;
  s_process(c);
  if (s_may_read(c) && c->queued < SX__CONN_QUEUE_MAX)
    s_read_start(c);
}

sx__xpool *sx__conn_pool(sx__conn_server *s) {
  if (s->pool == NULL && s->pool_threads > 0 && !s->pool_failed) {
    const sx_tctx *x = s->x;
    if (sx__xpool_create(x->loop, s->pool_threads, &s->pool) != 0) {
      s->pool_failed = 1;
      x->log(x->agent, SX_LOG_WARN, "%s; TCP data moves on the agent's thread", sx_errmsg());
      return NULL;
    }
    x->log(x->agent, SX_LOG_DEBUG, "tcp: %u data-mover threads for payloads of %lu bytes "
           "and more", s->pool_threads, (unsigned long)s->pool_min);
  }
  return s->pool;
}

sx__conn_server *sx__conn_server_of(const sx__conn *c) { return c->s; }

const sx_tctx *sx__conn_ctx(const sx__conn *c) { return c->s->x; }

int sx__conn_used(const sx__conn *c, unsigned slot) { return c->slot[slot] != NULL; }

int sx__conn_write_allowed(const sx__conn *c) {
  for (unsigned k = 0; k < SX__CONN_SLOTS; k++) {
    const sx__conn_handler *hd = slot_handler(c->s, k);
    if (hd != NULL && hd->write_allowed != NULL)
      return hd->write_allowed(c->slot[k]);
  }
  return SX_EACCESS;
}

/* ------------------------------------------------ server-wide events */

void sx__conn_withdraw(sx__conn_server *s, sx_lregion *l) {
  for (sx__conn *c = s->conns; c; c = c->next)
    for (unsigned k = 0; k < SX__CONN_SLOTS && !c->closing; k++) {
      const sx__conn_handler *hd = slot_handler(s, k);
      if (c->slot[k] != NULL && hd != NULL && hd->withdraw != NULL)
        hd->withdraw(c, c->slot[k], l);
    }
}

void sx__conn_revoked(sx__conn_server *s) {
  for (sx__conn *c = s->conns; c; c = c->next)
    for (unsigned k = 0; k < SX__CONN_SLOTS && !c->closing; k++) {
      const sx__conn_handler *hd = slot_handler(s, k);
      if (c->slot[k] != NULL && hd != NULL && hd->revoked != NULL)
        hd->revoked(c, c->slot[k]);
    }
}

void sx__conn_gated(sx__conn_server *s, const sx_lregion *l) {
  for (sx__conn *c = s->conns; c; c = c->next)
    for (unsigned k = 0; k < SX__CONN_SLOTS && !c->closing; k++) {
      const sx__conn_handler *hd = slot_handler(s, k);
      if (c->slot[k] != NULL && hd != NULL && hd->gated != NULL)
        hd->gated(c, c->slot[k], l);
    }
}

void sx__conn_revoke_hold(sx__conn_server *s) { s->revoking++; }

void sx__conn_revoke_release(sx__conn_server *s, int err, const char *msg) {
  if (err != 0 && s->revoke_err == 0) {
    s->revoke_err = err;
    snprintf(s->revoke_msg, sizeof(s->revoke_msg), "%s", msg ? msg : sx_strerror(err));
  }
  if (--s->revoking > 0 || !s->revoke_notify)
    return;
  const sx_tctx *x = s->x;
  err = s->revoke_err;
  s->revoke_notify = s->revoke_err = 0;
  x->grants_settled(x->agent, SX_TRANSPORT_TCP, err, s->revoke_msg);
}
