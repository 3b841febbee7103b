/*
 * A wake of a libuv loop from any thread: an eventfd that the loop polls.
 * Not installed.
 *
 * Instead of uv_async_t because libuv before 1.45 (Debian 12 ships 1.44)
 * has the loop spin in uv__async_io, with sched_yield, while any async
 * handle's sender is between its two steps in uv_async_send(); on a busy
 * host the sender is often preempted right after its write(2) woke the
 * loop, and the agent's loop spent up to 40% of its time there on the
 * cuda_ipc read path (callers' submits and the driver's completion notices
 * both send).  Here a send is one write(2) and a wake one read(2), with no
 * state shared between them.  Senders send only when their own queue was
 * empty (the callback takes the whole queue), as uv_async_send's callers
 * do.
 */
#ifndef SX_MEM_WAKE_H
#define SX_MEM_WAKE_H

#include <uv.h>

typedef struct sx__wake sx__wake;
struct sx__wake {
  uv_poll_t poll;
  int fd;                   /* -1 before init and after sx__wake_release */
  void (*cb)(sx__wake *w);  /* on the loop, the eventfd already drained */
};

/* Loop thread (or before it runs).  0, or SX_EIO: then if w->fd is still
 * >= 0 the handle lives and goes through sx__wake_close and _release. */
int sx__wake_init(uv_loop_t *loop, sx__wake *w, void (*cb)(sx__wake *w));
/* Any thread, until sx__wake_release. */
void sx__wake_send(sx__wake *w);
/* Loop thread: read the pending wake (if any) before taking the queue
 * outside the callback. */
void sx__wake_drain(sx__wake *w);
/* Loop thread: stop polling (uv_close; cb as for uv_close).  The eventfd
 * stays open, so a late sender writes harmlessly, until release. */
void sx__wake_close(sx__wake *w, uv_close_cb cb);
/* Close the eventfd once no thread can send any more. */
void sx__wake_release(sx__wake *w);

#endif
