/*
 * Deadlines on one libuv loop: a min-heap of items and one uv_timer_t for
 * the earliest, so an item costs a heap insert and a removal, not a timer
 * handle of its own (init, start, stop and a close callback each).  Used
 * for the batches' deadlines (batch.c).  Loop thread only.  Not
 * installed.
 */
#ifndef SX_AGENT_DEADLINE_H
#define SX_AGENT_DEADLINE_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

typedef struct sx__dl_item sx__dl_item;
struct sx__dl_item {
  uint64_t at;                   /* the loop's time (uv_now, ms) it is due */
  size_t idx;                    /* its place in the heap; SIZE_MAX: not in it */
  void (*fire)(sx__dl_item *it); /* due: already out of the heap */
};

typedef struct sx__dl {
  uv_timer_t timer;
  sx__dl_item **heap;
  size_t n, cap;
  uint64_t armed;                /* when the timer fires (0: not armed) */
  int open;
} sx__dl;

void sx__dl_init(uv_loop_t *loop, sx__dl *d);
/* Close the timer (the items left are dropped: none fires). */
void sx__dl_close(sx__dl *d);
/* Make it due `ms` from now (the loop's time, refreshed by the caller):
 * 0, or SX_ENOMEM. */
int sx__dl_add(sx__dl *d, sx__dl_item *it, uint64_t ms);
/* Take it out (nothing if it is not in). */
void sx__dl_remove(sx__dl *d, sx__dl_item *it);

static inline void sx__dl_item_init(sx__dl_item *it, void (*fire)(sx__dl_item *it)) {
  it->idx = SIZE_MAX;
  it->fire = fire;
}

#endif
