/*
 * cuda_ipc, target side: the IPC frame handler on the control connection
 * (transport/conn/conn.h; after HELLO), the regions lent to each
 * connection, and asking them back when one is unregistered (see
 * cuda_ipc.h and transport/conn/frame.h for the wire).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_ipc.h"
#include "internal.h"
#include "mem/mem.h"

/* One region lent on a connection (counted once in its inflight). */
typedef struct lent {
  sx_lregion *l;
  uint8_t gated;       /* lent under a write grant (its allocation is writable) */
  uint8_t asked;       /* asked back, not returned yet */
  uint8_t revoked;     /* asked back because the grant went: a revoke waits */
} lent;

/* A connection's SX__CONN_IPC slot. */
typedef struct sx__ipc_holds {
  const sx_tctx *x;
  sx__conn_server *s;
  sx__conn *c;         /* NULL once the connection closed */
  lent *lent;
  uint32_t n, cap;
  uint32_t asked;      /* of them, asked back and not returned yet */
  uv_timer_t timer;    /* the deadline for returning them */
  int timer_init;
  int timed_out;       /* closed for not returning them in time */
} sx__ipc_holds;

static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (24 - 8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
  put32(p, (uint32_t)(v >> 32));
  put32(p + 4, (uint32_t)v);
}
static uint32_t get32(const uint8_t *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) << 32 | get32(p + 4); }

void sx__ipc_record_encode(const sx__ipc_record *r, uint8_t out[SX__IPC_RECORD]) {
  put32(out, r->region);
  put32(out + 4, (uint32_t)r->status);
  put64(out + 8, r->alloc);
  put64(out + 16, r->offset);
  put64(out + 24, r->base);
  memcpy(out + 32, r->handle, 64);
}

void sx__ipc_record_decode(const uint8_t in[SX__IPC_RECORD], sx__ipc_record *r) {
  r->region = get32(in);
  r->status = (int32_t)get32(in + 4);
  r->alloc = get64(in + 8);
  r->offset = get64(in + 16);
  r->base = get64(in + 24);
  memcpy(r->handle, in + 32, 64);
}

static int lent_index(const sx__ipc_holds *h, uint32_t id) {
  for (uint32_t i = 0; i < h->n; i++)
    if (h->lent[i].l->r.id == id)
      return (int)i;
  return -1;
}

/* err: why a revoke waiting for it cannot vouch for it (the connection
 * was cut while the peer may still hold the mapping). */
static void give_back(sx__ipc_holds *h, uint32_t i, int err) {
  lent *e = &h->lent[i];
  e->l->inflight--;
  if (e->asked)
    h->asked--;
  if (e->revoked) {
    char msg[256];
    snprintf(msg, sizeof(msg), "producer %s did not give back its CUDA IPC mapping of "
             "region %u within %d ms: its connection was closed, but that process may "
             "still write there until the memory is freed", h->c ? sx__conn_reader(h->c)
             : "(gone)", e->l->r.id, SX__IPC_REVOKE_MS);
    sx__conn_revoke_release(h->s, err, err ? msg : NULL);
  }
  h->lent[i] = h->lent[--h->n];
}

/* A handle is a capability for the whole allocation, read AND write (CUDA
 * has no read-only IPC mapping).  So where any region of the allocation
 * is writable, it is lent only to a connection of a producer the agent
 * granted writes (WAUTH passed, a grant covers it now); otherwise to any
 * reader that passed HELLO (docs/security.md). */
static int alloc_writable(const sx_tctx *x, uint64_t base) {
  sx_lregion *o;
  for (uint32_t i = 0; (o = x->region_at(x->agent, i)) != NULL; i++)
    if (o->mem.kind == SX__MEM_CUDA && o->mem.base == base &&
        (o->r.access & SX_ACCESS_REMOTE_WRITE))
      return 1;
  return 0;
}

/* One region asked for: its record, and lend it if it can be. */
static void lend(sx__ipc_holds *h, uint32_t id, sx__ipc_record *rec) {
  const sx_tctx *x = h->x;
  memset(rec, 0, sizeof(*rec));
  rec->region = id;
  sx_lregion *l = x->find_region(x->agent, id);
  int st = 0, gated = 0;
  if (l == NULL)
    st = SX_ENOREGION;
  else if (!(l->r.access & (SX_ACCESS_REMOTE_READ | SX_ACCESS_REMOTE_WRITE)))
    st = SX_EDENIED;
  else if (l->mem.kind != SX__MEM_CUDA)
    st = SX_EINVAL; /* host memory: read it over TCP */
  else if ((gated = alloc_writable(x, l->mem.base)) &&
           sx__conn_write_allowed(h->c) != 0)
    st = SX_EACCESS; /* no write grant covers this connection */
  else if (sx__mem_ipc_export((void *)(uintptr_t)l->mem.base, rec->handle) != 0) {
    x->log(x->agent, SX_LOG_WARN, "cuda_ipc: region %u: %s", id, sx_errmsg());
    st = SX_ENOTSUP;
  }
  int k = st == 0 ? lent_index(h, id) : -1;
  if (k >= 0)
    h->lent[k].gated |= (uint8_t)gated;
  if (st == 0 && k < 0) {
    if (h->n == h->cap) {
      uint32_t cap = h->cap ? 2 * h->cap : 8;
      lent *v = realloc(h->lent, cap * sizeof(*v));
      if (v == NULL)
        st = SX_ENOMEM;
      else {
        h->lent = v;
        h->cap = cap;
      }
    }
    if (st == 0) {
      h->lent[h->n++] = (lent){.l = l, .gated = (uint8_t)gated};
      l->inflight++; /* until the reader gives it back or goes away */
    }
  }
  rec->status = st;
  if (st == 0) {
    rec->alloc = l->mem.size;
    rec->offset = l->r.addr - l->mem.base;
    rec->base = l->mem.base;
  } else {
    memset(rec->handle, 0, sizeof(rec->handle));
  }
}

static void reply(sx__ipc_holds *h, uint64_t id, int status, uint32_t n,
                  const uint32_t *ids) {
  size_t len = status ? 0 : (size_t)n * SX__IPC_RECORD;
  uint8_t *buf = malloc(SX__FRAME_HDR + len);
  if (buf == NULL) {
    sx__conn_violation(h->c, "out of memory");
    return;
  }
  sx__frame f = {.type = SX__FRAME_IPC_REPLY, .id = id, .status = status,
                 .length = len};
  sx__frame_encode(&f, buf);
  for (uint32_t i = 0; i < n && status == 0; i++) {
    sx__ipc_record rec;
    lend(h, ids[i], &rec);
    sx__ipc_record_encode(&rec, buf + SX__FRAME_HDR + (size_t)i * SX__IPC_RECORD);
  }
  sx__conn_send(h->c, buf, SX__FRAME_HDR + len);
}

/* An IPC frame f at buf (avail bytes read so far) on connection c, whose
 * lent regions are *holds (made on first use); as sx__conn_handler.frame. */
static int serve(sx__conn *c, void **holds, const sx__frame *f, uint8_t *buf, size_t avail) {
  if (avail < SX__FRAME_HDR + f->length)
    return 0;
  /* Its reply goes out after those gathered so far. */
  if (sx__conn_flush(c) != 0)
    return -1;
  const sx_tctx *x = sx__conn_ctx(c);
  const uint8_t *body = buf + SX__FRAME_HDR;
  int used = (int)(SX__FRAME_HDR + f->length);
  sx__ipc_holds *h = *holds;
  if (h == NULL) {
    if ((h = calloc(1, sizeof(*h))) == NULL) {
      sx__conn_violation(c, "out of memory");
      return used;
    }
    h->x = x;
    h->s = sx__conn_server_of(c);
    h->c = c;
    *holds = h;
  }
  uint32_t n = (uint32_t)(f->length / 4), ids[SX__IPC_MAX_IDS];
  for (uint32_t i = 0; i < n; i++)
    ids[i] = get32(body + 4 * i);
  if (f->id == 0) {
    /* Given back. */
    for (uint32_t i = 0; i < n; i++) {
      int k = lent_index(h, ids[i]);
      if (k >= 0)
        give_back(h, (uint32_t)k, 0);
    }
    if (h->asked == 0 && h->timer_init)
      uv_timer_stop(&h->timer);
    return used;
  }
  int st = 0;
  if (!(x->params->transports & SX_TRANSPORTS_CUDA_IPC))
    st = SX_ENOTSUP; /* this agent does not serve cuda_ipc */
  reply(h, f->id, st, n, ids);
  return used;
}

static void revoke_timeout(uv_timer_t *t) {
  sx__ipc_holds *h = t->data;
  if (h->c == NULL || h->asked == 0)
    return;
  const sx_tctx *x = h->x;
  x->log(x->agent, SX_LOG_WARN, "cuda_ipc: reader %s did not give back %u region(s) "
         "within %d ms: closing its connection", sx__conn_reader(h->c), h->asked,
         SX__IPC_REVOKE_MS);
  h->timed_out = 1;
  sx__conn_violation(h->c, "CUDA IPC handles not given back in time");
}

/* Ask back the lent regions for which pick() says so, in one frame;
 * revoked: a revoke waits for them. */
static void ask_back(sx__ipc_holds *h, int (*pick)(const lent *e, const void *arg),
                     const void *arg, int revoked) {
  if (h == NULL || h->c == NULL)
    return;
  uint32_t n = 0;
  for (uint32_t i = 0; i < h->n; i++)
    n += !h->lent[i].asked && pick(&h->lent[i], arg);
  if (n == 0)
    return;
  uint8_t *buf = malloc(SX__FRAME_HDR + 4 * (size_t)n);
  if (buf == NULL) {
    sx__conn_violation(h->c, "out of memory");
    return;
  }
  sx__frame f = {.type = SX__FRAME_IPC_REPLY, .id = 0, .length = 4 * (uint64_t)n};
  sx__frame_encode(&f, buf);
  uint32_t k = 0;
  for (uint32_t i = 0; i < h->n; i++) {
    lent *e = &h->lent[i];
    if (e->asked || !pick(e, arg))
      continue;
    put32(buf + SX__FRAME_HDR + 4 * k++, e->l->r.id);
    e->asked = 1;
    h->asked++;
    if (revoked) {
      e->revoked = 1;
      sx__conn_revoke_hold(h->s);
    }
  }
  if (!h->timer_init) {
    uv_timer_init(h->x->loop, &h->timer);
    h->timer.data = h;
    h->timer_init = 1;
  }
  if (!uv_is_active((uv_handle_t *)&h->timer))
    uv_timer_start(&h->timer, revoke_timeout, SX__IPC_REVOKE_MS, 0);
  sx__conn_send(h->c, buf, SX__FRAME_HDR + 4 * (size_t)n);
}

static int pick_region(const lent *e, const void *arg) { return e->l == arg; }
static int pick_gated(const lent *e, const void *arg) { return (void)arg, e->gated; }
static int pick_alloc_ungated(const lent *e, const void *arg) {
  const sx_lregion *l = arg;
  return !e->gated && e->l->mem.base == l->mem.base;
}

/* l is being unregistered: ask it back if it was lent on this connection. */
static void withdraw(sx__conn *c, void *h, sx_lregion *l) {
  (void)c;
  ask_back(h, pick_region, l, 0);
}

/* The write grants changed: where the connection's producer lost its
 * grant, ask back every region lent under it (a revoke waits for them
 * until returned or cut off). */
static void revoked(sx__conn *c, void *h) {
  if (sx__conn_write_allowed(c) != 0)
    ask_back(h, pick_gated, NULL, 1);
}

/* Writable GPU region l is being registered: regions of its allocation
 * lent without a grant are asked back, or, where the connection's
 * producer has one, now count as lent under it. */
static void gated(sx__conn *c, void *slot, const sx_lregion *l) {
  sx__ipc_holds *h = slot;
  if (l->mem.kind != SX__MEM_CUDA || !(l->r.access & SX_ACCESS_REMOTE_WRITE))
    return;
  if (sx__conn_write_allowed(c) != 0) {
    ask_back(h, pick_alloc_ungated, l, 0);
    return;
  }
  /* A producer: what it holds of that allocation is now under its grant. */
  for (uint32_t i = 0; i < h->n; i++)
    if (h->lent[i].l->mem.base == l->mem.base)
      h->lent[i].gated = 1;
}

static void holds_closed(uv_handle_t *t) { free(t->data); }

/* The connection closes: everything lent is released. */
static void drop(void *slot) {
  sx__ipc_holds *h = slot;
  while (h->n > 0)
    give_back(h, h->n - 1, h->timed_out ? SX_ETIMEDOUT : 0);
  free(h->lent);
  h->c = NULL;
  if (h->timer_init)
    uv_close((uv_handle_t *)&h->timer, holds_closed);
  else
    free(h);
}

const sx__conn_handler sx__ipc_frames = {
    .slot = SX__CONN_IPC,
    .first = SX__FRAME_IPC,
    .last = SX__FRAME_IPC,
    .frame = serve,
    .close = drop,
    .withdraw = withdraw,
    .revoked = revoked,
    .gated = gated,
};
