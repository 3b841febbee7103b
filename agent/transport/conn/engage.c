/*
 * When the data-mover threads engage (see engage.h): a count of busy
 * connections against a threshold, with a hold so that it does not flap.
 */
#include "engage.h"
#include "internal.h"
#include "xpool.h"

static atomic_ulong kept[SX__XJOB_KINDS];

void sx__engage_init(sx__engage *e, unsigned kind, uint32_t conns) {
  e->conns = conns > 0 ? conns : 1;
  e->kind = kind;
  e->until = 0;
  atomic_store(&e->on, 0);
}

int sx__engage_update(sx__engage *e, uv_loop_t *loop, uint32_t busy) {
  uint64_t now = uv_now(loop);
  if (busy >= e->conns) {
    e->until = now + SX__ENGAGE_HOLD_MS;
    atomic_store_explicit(&e->on, 1, memory_order_relaxed);
    return 1;
  }
  int on = now < e->until;
  atomic_store_explicit(&e->on, on, memory_order_relaxed);
  return on;
}

void sx__engage_keep(const sx__engage *e) {
  if (e->kind < SX__XJOB_KINDS)
    atomic_fetch_add_explicit(&kept[e->kind], 1, memory_order_relaxed);
}

uint64_t sx__engage_kept(unsigned kind) {
  return kind < SX__XJOB_KINDS ? atomic_load(&kept[kind]) : 0;
}

uint32_t sx__engage_conns(int *bad) {
  long v;
  return sx__env_long("SX_TCP_THREAD_CONNS", 1, 1024, &v, bad) ? (uint32_t)v
                                                                 : SX__ENGAGE_CONNS;
}
