/*
 * The TCP transport, push mode, target (consumer) side: a producer's
 * connection authorizes itself (WAUTH, checked by the agent against the
 * store and its grants while the connection holds), then sends WRITEs whose
 * payload is read straight into the registered region, and finally the
 * batch's NOTICE (docs/push.md; wire format in transport/conn/frame.h).
 *
 * Every WRITE is checked before any byte of its payload lands: the
 * connection is authorized and no revoke took the grant back (the grant
 * epoch is rechecked when it moved), the region exists, is writable and
 * published, and the range lies inside it.  A refused WRITE's payload is
 * drained into scratch memory and answered with the reason; the connection
 * goes on.  A WRITE_REPLY of 0 is sent only once the whole payload is in
 * memory, which is what lets the producer send its notice after the last
 * reply.  While a payload lands, its region's inflight count holds, so an
 * unregister waits for it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "tcp_int.h"
#include "tcp_stage.h"

static const sx_tctx *wctx(const sx__tcp_wconn *w) { return sx__tcp_ctx(w->t); }

static void w_free(void *slot) {
  sx__tcp_wconn *w = slot;
  if (w == NULL)
    return;
  if (w->l != NULL)
    w->l->inflight--;
  if (w->ws != NULL)
    sx__tcp_wstage_detach(w->ws);
  free(w->notice);
  if (w->auth != NULL) {
    /* The check goes on without us; its answer is dropped. */
    wctx(w)->write_auth_cancel(w->auth);
    w->auth = NULL;
  }
  free(w);
}

/* Is this connection allowed to write now?  0 or SX_EACCESS.  Grants are
 * looked at again whenever the epoch moved (a grant or a revoke). */
static int w_allowed(sx__tcp_wconn *w) {
  if (w == NULL || !w->verified)
    return SX_EACCESS;
  const sx_tctx *x = wctx(w);
  if (w->epoch != *x->grant_epoch) {
    w->epoch = *x->grant_epoch;
    int was = w->granted;
    w->granted = x->write_granted(x->agent, w->producer, w->inc) == 0;
    if (was != w->granted)
      x->log(x->agent, SX_LOG_INFO, "tcp: producer %s: write grant %s", w->producer,
             w->granted ? "given again" : "revoked");
  }
  return w->granted ? 0 : SX_EACCESS;
}

static int w_write_allowed(const void *slot) { return w_allowed((sx__tcp_wconn *)slot); }

/* 1 while w's connection must parse nothing more (an authorization or a
 * staged WRITE's device copies are pending). */
static int w_holds(const void *slot) {
  const sx__tcp_wconn *w = slot;
  return w->auth != NULL || (w->ws != NULL && sx__tcp_wstage_holds(w->ws));
}

/* ------------------------------------------------------------ revocation */

/* The grants changed: if w's producer lost its grant, a WRITE landing now
 * lands nothing more (its payload is drained, its reply says SX_EACCESS). */
static void w_revoked(sx__conn *c, void *slot) {
  sx__tcp_wconn *w = slot;
  (void)c;
  if (!w->verified || w_allowed(w) == 0)
    return;
  if (w->ws != NULL) {
    sx__tcp_wstage_revoke(w->ws);
  } else if (w->type == SX__FRAME_WRITE && w->left > 0 && w->l != NULL) {
    /* Its payload is landing: the rest is drained, nothing more lands. */
    w->l->inflight--;
    w->l = NULL;
    w->dst = NULL;
    w->status = SX_EACCESS;
  }
}

int sx__tcp_grants_changed(sx_transport *base) {
  tcp_t *t = (tcp_t *)base;
  /* Each WRITE and NOTICE compares the epoch anyway; what is landing now
   * is stopped here, and CUDA IPC handles are asked back. */
  sx__conn_server *s = &t->srv;
  s->revoke_notify = 0; /* nothing is said from inside this call */
  sx__conn_revoked(s);
  if (s->revoking == 0) {
    s->revoke_err = 0;
    return 0;
  }
  s->revoke_notify = 1;
  return 1;
}

static void auth_done(void *arg, int status, const char *producer, const char *msg) {
  sx__tcp_wconn *w = arg;
  sx__conn *c = w->c;
  const sx_tctx *x = wctx(w);
  w->auth = NULL;
  if (status == 0) {
    w->verified = w->granted = 1;
    w->epoch = *x->grant_epoch;
    snprintf(w->producer, sizeof(w->producer), "%s", producer);
    x->log(x->agent, SX_LOG_INFO, "tcp: producer %s may write", w->producer);
  } else {
    x->log(x->agent, SX_LOG_WARN, "tcp: refused writes of %s: %s",
           sx__conn_reader(c), msg && msg[0] ? msg : sx_strerror(status));
    x->written(x->agent, SX_TRANSPORT_TCP, 0, status);
  }
  int st = status == 0 ? 0 : status < 0 && status >= SX_ERRNO_MIN ? status : SX_EACCESS;
  sx__conn_reply(c, w->auth_id, SX__FRAME_WAUTH_REPLY, st, NULL, NULL, 0);
  if (sx__conn_flush(c) == 0)
    sx__conn_wresume(c); /* parse what came behind the WAUTH */
}

static int w_auth(sx__conn *c, sx__tcp_wconn *w, const sx__frame *f, const uint8_t *body) {
  const sx_tctx *x = wctx(w);
  if (w->verified || w->auth != NULL) {
    sx__conn_violation(c, "a second WAUTH");
    return -1;
  }
  memcpy(w->inc, body, SX_INCARNATION_LEN);
  const char *name = sx__conn_reader(c);
  snprintf(w->producer, sizeof(w->producer), "%s", name);
  w->auth_id = f->id;
  int rc = x->write_auth == NULL ? SX_ENOTSUP
                                 : x->write_auth(x->agent, name, w->inc, body + SX_INCARNATION_LEN,
                                                 auth_done, w, &w->auth);
  if (rc != 0) {
    x->log(x->agent, SX_LOG_WARN, "tcp: refused writes of %s: %s", name, sx_errmsg());
    x->written(x->agent, SX_TRANSPORT_TCP, 0, rc);
    sx__conn_reply(c, f->id, SX__FRAME_WAUTH_REPLY, rc, NULL, NULL, 0);
    return 0;
  }
  sx__conn_hold(c);
  return 0;
}

/* The checks of a WRITE header; 0 (and the region) or the refusal. */
static int w_check(sx__tcp_wconn *w, const sx__frame *f, sx_lregion **out) {
  const sx_tctx *x = wctx(w);
  int st = w_allowed(w);
  if (st)
    return st;
  sx_lregion *l = x->find_region(x->agent, f->region);
  uint64_t end;
  if (l == NULL)
    return SX_ENOREGION;
  if (!(l->r.access & SX_ACCESS_REMOTE_WRITE))
    return SX_EDENIED;
  if (f->length == 0)
    return SX_EINVAL;
  if (!sx__add_ok(f->offset, f->length, &end) || end > l->r.length)
    return SX_EBOUNDS;
  *out = l;
  return 0;
}

/* A read notice's body is complete: the agent checks it (a reader needs no
 * WAUTH: HELLO checked the incarnation and token) against what the reader
 * said in HELLO, and it is answered. */
static void r_notice_done(sx__tcp_wconn *w) {
  sx__conn *c = w->c;
  const sx_tctx *x = wctx(w);
  char msg[256] = "";
  /* HELLO's empty name shows as "(unnamed)" in the connection's logs. */
  const char *reader = sx__conn_reader(c);
  if (strcmp(reader, "(unnamed)") == 0)
    reader = "";
  int st = x->read_notice == NULL
               ? SX_ENOTSUP
               : x->read_notice(x->agent, reader,
                                sx__conn_used(c, SX__CONN_IPC) ? SX_TRANSPORT_CUDA_IPC
                                                               : SX_TRANSPORT_TCP,
                                w->notice, (size_t)w->len, msg, sizeof(msg));
  free(w->notice);
  w->notice = NULL;
  sx__conn_reply(c, w->id, SX__FRAME_NOTICE_REPLY, st, NULL, NULL, 0);
}

/* A body is complete: land it and answer. */
static void w_body_done(sx__tcp_wconn *w) {
  sx__conn *c = w->c;
  const sx_tctx *x = wctx(w);
  if (w->type == SX__FRAME_WRITE) {
    if (w->l != NULL) {
      w->l->inflight--;
      w->l = NULL;
    }
    x->written(x->agent, SX_TRANSPORT_TCP, w->status ? 0 : w->len, w->status);
    sx__conn_reply(c, w->id, SX__FRAME_WRITE_REPLY, w->status, NULL, NULL, 0);
  } else if (w->type == SX__FRAME_RNOTICE) {
    r_notice_done(w);
  } else {
    char msg[256] = "";
    int st = w_allowed(w);
    if (st == 0)
      st = x->notice(x->agent, w->producer, w->inc,
                     sx__conn_used(c, SX__CONN_IPC) ? SX_TRANSPORT_CUDA_IPC : SX_TRANSPORT_TCP, w->notice,
                     (size_t)w->len, msg, sizeof(msg));
    free(w->notice);
    w->notice = NULL;
    sx__conn_reply(c, w->id, SX__FRAME_NOTICE_REPLY, st, NULL, NULL, 0);
  }
  w->dst = NULL;
}

/* Start a WRITE or NOTICE body of f->length bytes, avail of which are in
 * buf already.  Returns the bytes of buf used. */
static size_t w_body(sx__tcp_wconn *w, const sx__frame *f, const uint8_t *buf, size_t avail) {
  w->id = f->id;
  w->len = f->length;
  w->type = f->type;
  uint64_t take = f->length < avail ? f->length : avail;
  if (w->dst != NULL && take > 0)
    memcpy(w->dst, buf, (size_t)take);
  w->left = f->length - take;
  if (w->dst != NULL)
    w->dst += take;
  if (w->left == 0)
    w_body_done(w);
  return (size_t)take;
}

/* A push frame (type >= SX__FRAME_WAUTH) at buf, avail bytes read so far:
 * as sx__conn_handler.frame.  The connection parses no more while a body
 * arrives (w->left) or w_holds(). */
static int w_frame(sx__conn *c, void **wp, const sx__frame *f, uint8_t *buf, size_t avail) {
  sx__tcp_wconn *w = *wp;
  if (w == NULL) {
    if ((w = calloc(1, sizeof(*w))) == NULL) {
      sx__conn_violation(c, "out of memory");
      return -1;
    }
    w->c = c;
    w->t = sx__tcp_of(sx__conn_server_of(c));
    *wp = w;
  }
  const sx_tctx *x = wctx(w);
  uint8_t *body = buf + SX__FRAME_HDR;
  avail -= SX__FRAME_HDR;
  switch (f->type) {
  case SX__FRAME_WAUTH:
    if (avail < SX__WAUTH_BODY)
      return 0;
    return w_auth(c, w, f, body) < 0 ? -1 : (int)(SX__FRAME_HDR + SX__WAUTH_BODY);
  case SX__FRAME_WRITE: {
    if (f->length > MAX_WRITE) {
      sx__conn_violation(c, "a WRITE longer than 64 MiB");
      return -1;
    }
    sx_lregion *l = NULL;
    w->status = w_check(w, f, &l);
    if (w->status != 0)
      x->log(x->agent, SX_LOG_DEBUG, "tcp: refused a write from %s: region %u offset %lu "
             "length %lu: %s", sx__conn_reader(c), f->region, (unsigned long)f->offset,
             (unsigned long)f->length, sx_err_name(w->status));
    if (l != NULL && l->mem.kind == SX__MEM_CUDA) {
      /* GPU memory: through pinned staging (tcp_stage_write.c). */
      size_t used;
      int rc = sx__tcp_wstage_begin(w, f, l, body, avail, &used);
      if (rc == 0)
        return (int)(SX__FRAME_HDR + used);
      w->status = rc;
      l = NULL;
    }
    if (l != NULL) {
      l->inflight++;
      w->l = l;
      w->dst = (uint8_t *)(uintptr_t)(l->r.addr + f->offset);
    }
    return (int)(SX__FRAME_HDR + w_body(w, f, body, avail));
  }
  case SX__FRAME_NOTICE:
  case SX__FRAME_RNOTICE:
    if (f->length > 0 && (w->notice = malloc((size_t)f->length)) == NULL) {
      sx__conn_violation(c, "out of memory");
      return -1;
    }
    w->dst = w->notice;
    w->status = 0;
    return (int)(SX__FRAME_HDR + w_body(w, f, body, avail));
  default:
    sx__conn_violation(c, "unexpected frame type");
    return -1;
  }
}

/* While a body arrives: where to read it, and what came. */
static void w_alloc(void *slot, uv_buf_t *buf) {
  sx__tcp_wconn *w = slot;
  if (w->ws != NULL) {
    sx__tcp_wstage_alloc(w->ws, buf);
    return;
  }
  uint64_t left = w->left;
  if (w->dst != NULL) {
    buf->base = (char *)w->dst;
    buf->len = left < (64u << 20) ? (size_t)left : (64u << 20);
  } else {
    buf->base = (char *)w->t->scratch;
    buf->len = left < SCRATCH_BYTES ? (size_t)left : SCRATCH_BYTES;
  }
}

static void w_read(void *slot, size_t n) {
  sx__tcp_wconn *w = slot;
  if (w->ws != NULL) {
    sx__tcp_wstage_read(w->ws, n);
    return;
  }
  w->left -= n;
  if (w->dst != NULL)
    w->dst += n;
  if (w->left > 0)
    return;
  w_body_done(w);
  sx__conn_flush(w->c);
}

static int w_receiving(const void *slot) { return ((const sx__tcp_wconn *)slot)->left > 0; }

static int w_header_alone(const void *slot) { return ((const sx__tcp_wconn *)slot)->verified; }

/* A writable GPU region is being registered: the producer's grant is
 * looked at again first (logged if it changed), before cuda_ipc's handler
 * asks whether the connection may hold handles of that allocation. */
static void w_gated(sx__conn *c, void *slot, const sx_lregion *l) {
  (void)c, (void)l;
  (void)w_allowed(slot);
}

const sx__conn_handler sx__tcp_push_frames = {
    .slot = SX__CONN_PUSH,
    .first = SX__FRAME_WAUTH,
    .last = SX__FRAME_RNOTICE,
    .frame = w_frame,
    .holds = w_holds,
    .receiving = w_receiving,
    .alloc = w_alloc,
    .read = w_read,
    .header_alone = w_header_alone,
    .free = w_free,
    .write_allowed = w_write_allowed,
    .revoked = w_revoked,
    .gated = w_gated,
};
