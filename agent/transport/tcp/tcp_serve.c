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
static int s_check(sx__conn *c, const sx_tctx *x, const sx__frame *f, const sx_lregion *l) {
  int st = s_refusal(f, l);
  if (st != 0)
    x->log(x->agent, SX_LOG_DEBUG, "tcp: refused read from %s: region %u offset %lu "
           "length %lu: %s", sx__conn_reader(c), f->region, (unsigned long)f->offset,
           (unsigned long)f->length, sx_err_name(st));
  x->served(x->agent, SX_TRANSPORT_TCP, st ? 0 : f->length, st);
  return st;
}

static int s_serve(sx__conn *c, void **slot, const sx__frame *f, uint8_t *buf, size_t avail) {
  tcp_t *t = sx__tcp_of(sx__conn_server_of(c));
  const sx_tctx *x = sx__tcp_ctx(t);
  sx_lregion *l = x->find_region(x->agent, f->region);
  int st = s_check(c, x, f, l);
  if (st == 0 && l->mem.kind == SX__MEM_CUDA) {
    /* GPU memory goes out through staging (tcp_stage_serve.c), in order
     * after the replies gathered so far; the connection parses nothing
     * more while *slot holds the reply being staged.  The READs of the
     * same GPU received right behind this one, as many as fit one chunk,
     * go with it (anything else, a refusal too, is served on its own, in
     * order). */
    if (sx__conn_flush(c) != 0)
      return -1;
    sx__conn_hold(c);
    sx__tcp_sread rd[SX__STAGE_GROUP] = {{f->id, l, f->offset, f->length}};
    size_t n = 1, used = SX__FRAME_HDR;
    uint64_t room = sx__tcp_stage_group_bytes(t), total = f->length;
    sx__frame g;
    while (n < SX__STAGE_GROUP && total < room &&
           sx__frame_decode(buf + used, avail - used, &g) == SX__FRAME_HDR &&
           g.type == SX__FRAME_READ && g.length <= room - total) {
      sx_lregion *gl = x->find_region(x->agent, g.region);
      if (s_refusal(&g, gl) != 0 || gl->mem.kind != SX__MEM_CUDA ||
          gl->mem.device != l->mem.device)
        break;
      s_check(c, x, &g, gl);
      rd[n++] = (sx__tcp_sread){g.id, gl, g.offset, g.length};
      total += g.length;
      used += SX__FRAME_HDR;
    }
    sx__tcp_stage_reply(t, c, slot, rd, n);
    return (int)used;
  }
  sx__conn_reply(c, f->id, SX__FRAME_READ_REPLY, st, l,
                 st ? NULL : (uint8_t *)(uintptr_t)(l->r.addr + f->offset), f->length);
  return SX__FRAME_HDR;
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
