/*
 * The TCP transport, target side: serving READs straight from registered
 * memory, the READ handler on the control connection (transport/conn/:
 * accepting, HELLO and framing live there; see tcp.c for the whole
 * picture).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "tcp_int.h"
#include "tcp_stage.h"

/* READVs of GPU memory answered through staging, in this process. */
static uint64_t readvs_staged;

uint64_t sx__tcp_stage_readvs(void) { return __atomic_load_n(&readvs_staged, __ATOMIC_RELAXED); }

/* Why a read of length bytes at offset of region l (NULL: none) is
 * refused, or 0. */
static int s_refusal(uint64_t offset, uint64_t length, const sx_lregion *l) {
  uint64_t end;
  if (l == NULL)
    return SX_ENOREGION;
  if (!(l->r.access & SX_ACCESS_REMOTE_READ))
    return SX_EDENIED;
  if (length == 0)
    return SX_EINVAL;
  if (length > MAX_READ)
    return SX_ELIMIT;
  if (!sx__add_ok(offset, length, &end) || end > l->r.length)
    return SX_EBOUNDS;
  return 0;
}

/* Say that a read from region id was refused with st (a debug line, and
 * counted for metrics). */
static void s_refused(sx__conn *c, const sx_tctx *x, uint32_t id, uint64_t offset,
                      uint64_t length, int st) {
  x->log(x->agent, SX_LOG_DEBUG, "tcp: refused read from %s: region %u offset %lu length "
         "%lu: %s", sx__conn_reader(c), id, (unsigned long)offset, (unsigned long)length,
         sx_err_name(st));
  x->served(x->agent, SX_TRANSPORT_TCP, 0, st);
}

/* Is READ f of region l one we serve?  0 or the refusal, counted for
 * metrics either way. */
static int s_check(sx__conn *c, const sx_tctx *x, const sx__frame *f, const sx_lregion *l) {
  int st = s_refusal(f->offset, f->length, l);
  if (st != 0)
    s_refused(c, x, f->region, f->offset, f->length, st);
  else
    x->served(x->agent, SX_TRANSPORT_TCP, f->length, 0);
  return st;
}

/* The ranges of request g (its header at p, avail bytes there) that a
 * staged group for device dev takes, appended to rd at *n (room: bytes left
 * in the group's chunk, then less theirs): a READ, or a READV whole, all of
 * its ranges served and of GPU memory of dev.  The request's bytes (header
 * and body) if it went, counted as served; 0 if not (nothing taken: it is
 * parsed on its own later). */
static size_t s_take(const sx_tctx *x, const sx__frame *g, const uint8_t *p, size_t avail,
                     int dev, sx__tcp_sread *rd, size_t *n, uint64_t *room) {
  sx__range v[SX__READV_MAX];
  sx_lregion *ls[SX__READV_MAX];
  uint32_t k = 1;
  size_t used = SX__FRAME_HDR;
  if (g->type == SX__FRAME_READ) {
    v[0] = (sx__range){g->region, g->offset, g->length};
  } else if (g->type == SX__FRAME_READV && avail >= SX__FRAME_HDR + g->length) {
    k = (uint32_t)(g->length / SX__READV_ENTRY);
    used += g->length;
    for (uint32_t i = 0; i < k; i++)
      if (sx__range_decode(p + SX__FRAME_HDR + (size_t)i * SX__READV_ENTRY, &v[i]) != 0)
        return 0;
  } else {
    return 0;
  }
  if (*n + k > SX__STAGE_GROUP)
    return 0;
  uint64_t total = 0;
  for (uint32_t i = 0; i < k; i++) {
    ls[i] = x->find_region(x->agent, v[i].region);
    if (s_refusal(v[i].offset, v[i].length, ls[i]) != 0 || ls[i]->mem.kind != SX__MEM_CUDA ||
        ls[i]->mem.device != dev || v[i].length > *room - total)
      return 0;
    total += v[i].length;
  }
  if (g->type == SX__FRAME_READV)
    __atomic_add_fetch(&readvs_staged, 1, __ATOMIC_RELAXED);
  for (uint32_t i = 0; i < k; i++) {
    x->served(x->agent, SX_TRANSPORT_TCP, v[i].length, 0);
    rd[(*n)++] = (sx__tcp_sread){g->id, ls[i], v[i].offset, v[i].length, i == 0};
  }
  *room -= total;
  return used;
}

/* GPU memory goes out through staging (tcp_stage_serve.c), in order after
 * the replies gathered so far; the connection parses nothing more while
 * *slot holds the reply being staged.  rd[0..n): the ranges of the request
 * at buf (used bytes of it), served, of GPU memory of one device; the READs
 * and READVs of the same GPU received right behind it, as many as fit one
 * chunk, go with it (anything else, a refusal too, is served on its own,
 * in order).  The bytes parsed, or -1 (the connection is lost). */
static int s_stage(sx__conn *c, void **slot, sx__tcp_sread *rd, size_t n, uint8_t *buf,
                   size_t used, size_t avail) {
  tcp_t *t = sx__tcp_of(sx__conn_server_of(c));
  const sx_tctx *x = sx__tcp_ctx(t);
  if (sx__conn_flush(c) != 0)
    return -1;
  sx__conn_hold(c);
  uint64_t room = sx__tcp_stage_group_bytes(t), total = 0;
  for (size_t i = 0; i < n; i++)
    total += rd[i].len;
  room = total < room ? room - total : 0;
  sx__frame g;
  size_t took;
  while (room > 0 && sx__frame_decode(buf + used, avail - used, &g) == SX__FRAME_HDR &&
         (took = s_take(x, &g, buf + used, avail - used, rd[0].l->mem.device, rd, &n,
                        &room)) > 0)
    used += took;
  sx__tcp_stage_reply(t, c, slot, rd, n);
  return (int)used;
}

static int s_serve(sx__conn *c, void **slot, const sx__frame *f, uint8_t *buf, size_t avail) {
  tcp_t *t = sx__tcp_of(sx__conn_server_of(c));
  const sx_tctx *x = sx__tcp_ctx(t);
  sx_lregion *l = x->find_region(x->agent, f->region);
  int st = s_check(c, x, f, l);
  if (st == 0 && l->mem.kind == SX__MEM_CUDA) {
    sx__tcp_sread rd[SX__STAGE_GROUP] = {{f->id, l, f->offset, f->length, 1}};
    return s_stage(c, slot, rd, 1, buf, SX__FRAME_HDR, avail);
  }
  sx__conn_reply(c, f->id, SX__FRAME_READ_REPLY, st, l,
                 st ? NULL : (uint8_t *)(uintptr_t)(l->r.addr + f->offset), f->length);
  return SX__FRAME_HDR;
}

/* A READV: its ranges answered in one reply, or refused together (naming
 * the first range refused) when any one is refused.  Its ranges are all of
 * host memory (sent from there) or all of GPU memory of one device (sent
 * through staging, as READs of it are); a range of other memory than the
 * first's is refused with SX_EINVAL. */
static int s_serve_ranges(sx__conn *c, void **slot, const sx__frame *f, uint8_t *buf,
                          size_t avail) {
  if (avail < SX__FRAME_HDR + f->length)
    return 0;
  tcp_t *t = sx__tcp_of(sx__conn_server_of(c));
  const sx_tctx *x = sx__tcp_ctx(t);
  uint32_t n = (uint32_t)(f->length / SX__READV_ENTRY);
  sx__conn_piece pc[SX__READV_MAX];
  sx__tcp_sread rd[SX__STAGE_GROUP];
  sx_lregion *l = NULL;
  int where = 0; /* the first range's memory: -1 host, else its device */
  for (uint32_t i = 0; i < n; i++) {
    sx__range r;
    if (sx__range_decode(buf + SX__FRAME_HDR + (size_t)i * SX__READV_ENTRY, &r) != 0) {
      sx__conn_violation(c, "malformed READV range");
      return -1;
    }
    if (l == NULL || l->r.id != r.region)
      l = x->find_region(x->agent, r.region);
    int st = s_refusal(r.offset, r.length, l);
    int w = st == 0 && l->mem.kind == SX__MEM_CUDA ? l->mem.device : -1;
    if (i == 0)
      where = w;
    else if (st == 0 && w != where)
      st = SX_EINVAL; /* host and GPU memory, or two GPUs, in one READV */
    if (st != 0) {
      s_refused(c, x, r.region, r.offset, r.length, st);
      sx__conn_reply_ranges(c, f->id, st, i, NULL, 0);
      return (int)(SX__FRAME_HDR + f->length);
    }
    pc[i] = (sx__conn_piece){l, (uint8_t *)(uintptr_t)(l->r.addr + r.offset), r.length};
    rd[i] = (sx__tcp_sread){f->id, l, r.offset, r.length, i == 0};
  }
  for (uint32_t i = 0; i < n; i++)
    x->served(x->agent, SX_TRANSPORT_TCP, pc[i].len, 0);
  if (where >= 0) {
    __atomic_add_fetch(&readvs_staged, 1, __ATOMIC_RELAXED);
    return s_stage(c, slot, rd, n, buf, SX__FRAME_HDR + f->length, avail);
  }
  sx__conn_reply_ranges(c, f->id, 0, 0, pc, n);
  return (int)(SX__FRAME_HDR + f->length);
}

static int s_staging(const void *slot) { return slot != NULL; }

static void s_detach(void *slot) { sx__tcp_stage_detach(slot); }

const sx__conn_handler sx__tcp_read_frames = {
    .slot = SX__CONN_READ,
    .first = SX__FRAME_READ,
    .last = SX__FRAME_READ,
    .frame = s_serve,
    .holds = s_staging,
    .close = s_detach,
};

/* READV shares READ's slot: the slot's other ops (holding the connection
 * while a staged reply goes out, closing) are READ's handler's above. */
const sx__conn_handler sx__tcp_readv_frames = {
    .slot = SX__CONN_READ,
    .first = SX__FRAME_READV,
    .last = SX__FRAME_READV,
    .frame = s_serve_ranges,
};
