/* A wake of a libuv loop from any thread (see wake.h). */
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "internal.h"
#include "wake.h"

static void on_readable(uv_poll_t *h, int status, int events) {
  (void)status, (void)events; /* an error reads as readable: drained */
  sx__wake *w = (sx__wake *)((char *)h - offsetof(sx__wake, poll));
  sx__wake_drain(w);
  w->cb(w);
}

int sx__wake_init(uv_loop_t *loop, sx__wake *w, void (*cb)(sx__wake *w)) {
  w->cb = cb;
  if ((w->fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0)
    return sx__err(SX_EIO, "wake: eventfd: %s", strerror(errno));
  if (uv_poll_init(loop, &w->poll, w->fd) != 0) {
    close(w->fd);
    w->fd = -1;
    return sx__err(SX_EIO, "wake: uv_poll_init failed");
  }
  if (uv_poll_start(&w->poll, UV_READABLE, on_readable) != 0)
    return sx__err(SX_EIO, "wake: uv_poll_start failed"); /* w->fd >= 0: close it */
  return 0;
}

void sx__wake_send(sx__wake *w) {
  uint64_t one = 1;
  ssize_t n;
  while ((n = write(w->fd, &one, sizeof(one))) < 0 && errno == EINTR) {
  }
  (void)n; /* EAGAIN only with the counter near 2^64: readable anyway */
}

void sx__wake_drain(sx__wake *w) {
  uint64_t v;
  ssize_t n;
  while ((n = read(w->fd, &v, sizeof(v))) < 0 && errno == EINTR) {
  }
  (void)n; /* EAGAIN: nothing was pending */
}

void sx__wake_close(sx__wake *w, uv_close_cb cb) {
  if (!uv_is_closing((uv_handle_t *)&w->poll))
    uv_close((uv_handle_t *)&w->poll, cb);
}

void sx__wake_release(sx__wake *w) {
  if (w->fd >= 0)
    close(w->fd);
  w->fd = -1;
}
