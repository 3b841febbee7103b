/* Deadlines on one loop: a min-heap and one timer (see deadline.h). */
#include <stdlib.h>

#include "deadline.h"
#include "internal.h"

static void put(sx__dl *d, size_t i, sx__dl_item *it) {
  d->heap[i] = it;
  it->idx = i;
}

static void sift_up(sx__dl *d, size_t i) {
  sx__dl_item *it = d->heap[i];
  while (i > 0) {
    size_t p = (i - 1) / 2;
    if (d->heap[p]->at <= it->at)
      break;
    put(d, i, d->heap[p]);
    i = p;
  }
  put(d, i, it);
}

static void sift_down(sx__dl *d, size_t i) {
  sx__dl_item *it = d->heap[i];
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= d->n)
      break;
    if (c + 1 < d->n && d->heap[c + 1]->at < d->heap[c]->at)
      c++;
    if (it->at <= d->heap[c]->at)
      break;
    put(d, i, d->heap[c]);
    i = c;
  }
  put(d, i, it);
}

static void on_timer(uv_timer_t *t);

/* Arm the timer for the earliest item, unless it fires by then anyway (an
 * early fire finds nothing due and arms again). */
static void arm(sx__dl *d) {
  if (d->n == 0 || (d->armed != 0 && d->armed <= d->heap[0]->at))
    return;
  uint64_t now = uv_now(d->timer.loop), at = d->heap[0]->at;
  uv_timer_start(&d->timer, on_timer, at > now ? at - now : 0, 0);
  d->armed = at;
}

static void on_timer(uv_timer_t *t) {
  sx__dl *d = t->data;
  d->armed = 0;
  uint64_t now = uv_now(t->loop);
  /* A fire may end other items (they leave the heap): look again each
   * time. */
  while (d->open && d->n > 0 && d->heap[0]->at <= now) {
    sx__dl_item *it = d->heap[0];
    sx__dl_remove(d, it);
    it->fire(it);
  }
  if (d->open)
    arm(d);
}

void sx__dl_init(uv_loop_t *loop, sx__dl *d) {
  *d = (sx__dl){.open = 1};
  uv_timer_init(loop, &d->timer);
  d->timer.data = d;
}

void sx__dl_close(sx__dl *d) {
  if (!d->open)
    return;
  d->open = 0;
  for (size_t i = 0; i < d->n; i++)
    d->heap[i]->idx = SIZE_MAX;
  free(d->heap);
  d->heap = NULL;
  d->n = d->cap = 0;
  uv_close((uv_handle_t *)&d->timer, NULL);
}

int sx__dl_add(sx__dl *d, sx__dl_item *it, uint64_t ms) {
  if (!d->open)
    return sx__err(SX_ESHUTDOWN, "deadlines closed");
  if (d->n == d->cap) {
    size_t cap = d->cap ? 2 * d->cap : 64;
    sx__dl_item **h = realloc(d->heap, cap * sizeof(*h));
    if (h == NULL)
      return sx__err(SX_ENOMEM, "deadlines");
    d->heap = h;
    d->cap = cap;
  }
  it->at = uv_now(d->timer.loop) + ms;
  put(d, d->n++, it);
  sift_up(d, d->n - 1);
  arm(d);
  return 0;
}

void sx__dl_remove(sx__dl *d, sx__dl_item *it) {
  size_t i = it->idx;
  if (i == SIZE_MAX || i >= d->n || d->heap[i] != it)
    return;
  it->idx = SIZE_MAX;
  sx__dl_item *last = d->heap[--d->n];
  if (i == d->n)
    return;
  put(d, i, last);
  if (i > 0 && d->heap[(i - 1) / 2]->at > last->at)
    sift_up(d, i);
  else
    sift_down(d, i);
}
