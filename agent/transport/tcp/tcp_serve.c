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

static int s_serve(sx__conn *c, void **slot, const sx__frame *f, uint8_t *buf, size_t avail) {
  (void)buf, (void)avail;
  tcp_t *t = sx__tcp_of(sx__conn_server_of(c));
  const sx_tctx *x = sx__tcp_ctx(t);
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
           "length %lu: %s", sx__conn_reader(c), f->region, (unsigned long)f->offset,
           (unsigned long)f->length, sx_err_name(st));
  x->served(x->agent, SX_TRANSPORT_TCP, st ? 0 : f->length, st);
  if (st == 0 && l->mem.kind == SX__MEM_CUDA) {
    /* GPU memory goes out through staging (tcp_stage_serve.c), in order
     * after the replies gathered so far; the connection parses nothing
     * more while *slot holds the reply being staged. */
    if (sx__conn_flush(c) != 0)
      return -1;
    sx__conn_hold(c);
    sx__tcp_stage_reply(t, c, sx__conn_stream(c), slot, f->id, l, f->offset, f->length);
    return SX__FRAME_HDR;
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
