/*
 * hiredis connections on a libuv loop, and small helpers for replies.
 *
 * Why not hiredis' own adapters/libuv.h: when a socket reports an error
 * (POLLERR: a refused connect, a reset), libuv stops the poll handle and
 * calls the poll callback with a negative status; the Debian 0.14 adapter
 * returns without telling hiredis, so the connection hangs until some timer
 * notices.  The glue below is the same idea (one uv_poll_t per context,
 * started and stopped by hiredis' hooks) but hands such errors to hiredis as
 * readiness, so it reads the error and runs the connect/disconnect callbacks
 * at once.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "redis.h"

typedef struct rc_glue {
  redisAsyncContext *ac; /* NULL once hiredis cleaned up */
  uv_poll_t poll;
  int events, polled; /* wanted, and what the poll handle watches */
  /*
   * Commands are written at the end of the loop phase that queued them (a
   * check handle after I/O callbacks, a prepare handle before the loop
   * blocks), all of a connection's at once, instead of arming writability
   * and writing in the next iteration: two epoll_ctl() calls and a loop
   * iteration less per command (strace: 2.5 epoll_ctl per resolve, 30% of
   * them failing with EEXIST).  Only a socket that cannot take everything
   * falls back to polling for writability.  (A command queued by another
   * prepare callback after this one ran waits for the check phase, after
   * the loop's poll: the agent's calls_prepare, which runs calls that
   * queue commands, makes that poll return at once.)
   */
  uv_check_t flush_check;
  uv_prepare_t flush_prep;
  int want_write, flushing, handles;
} rc_glue;

static void glue_poll_cb(uv_poll_t *h, int status, int events) {
  rc_glue *g = h->data;
  if (status < 0) {
    /* libuv stopped the handle: it watches nothing now. */
    g->polled = 0;
    events = UV_READABLE | UV_WRITABLE;
  }
  /* Either call may free the context; hiredis' cleanup hook clears g->ac. */
  if (g->ac != NULL && (events & UV_WRITABLE))
    redisAsyncHandleWrite(g->ac);
  if (g->ac != NULL && (events & UV_READABLE))
    redisAsyncHandleRead(g->ac);
}

/* Restarting a poll handle costs an epoll_ctl() even with the same events,
 * and hiredis asks for reads after every write: change only what changed. */
static void glue_update(rc_glue *g) {
  if (g->events == g->polled)
    return;
  g->polled = g->events;
  if (g->events)
    uv_poll_start(&g->poll, g->events, glue_poll_cb);
  else
    uv_poll_stop(&g->poll);
}

static void glue_flush(rc_glue *g) {
  uv_check_stop(&g->flush_check);
  uv_prepare_stop(&g->flush_prep);
  if (g->ac == NULL || !g->want_write)
    return;
  g->flushing = 1;
  redisAsyncHandleWrite(g->ac); /* may free the context (a write error) */
  g->flushing = 0;
}

static void glue_check_cb(uv_check_t *h) { glue_flush(h->data); }
static void glue_prep_cb(uv_prepare_t *h) { glue_flush(h->data); }

static void glue_add_read(void *p) {
  rc_glue *g = p;
  g->events |= UV_READABLE;
  glue_update(g);
}
static void glue_del_read(void *p) {
  rc_glue *g = p;
  g->events &= ~UV_READABLE;
  glue_update(g);
}
static void glue_add_write(void *p) {
  rc_glue *g = p;
  g->want_write = 1;
  /* Connecting (writability says the connect ended), or a flush that could
   * not write everything: wait for the socket. */
  if (!(g->ac->c.flags & REDIS_CONNECTED) || g->flushing) {
    g->events |= UV_WRITABLE;
    glue_update(g);
    return;
  }
  if (!(g->events & UV_WRITABLE)) {
    uv_check_start(&g->flush_check, glue_check_cb);
    uv_prepare_start(&g->flush_prep, glue_prep_cb);
  }
}
static void glue_del_write(void *p) {
  rc_glue *g = p;
  g->want_write = 0;
  uv_check_stop(&g->flush_check);
  uv_prepare_stop(&g->flush_prep);
  if (g->events & UV_WRITABLE) {
    g->events &= ~UV_WRITABLE;
    glue_update(g);
  }
}
static void glue_closed(uv_handle_t *h) {
  rc_glue *g = h->data;
  if (--g->handles == 0)
    free(g);
}
static void glue_cleanup(void *p) {
  rc_glue *g = p;
  g->ac = NULL;
  uv_close((uv_handle_t *)&g->poll, glue_closed);
  uv_close((uv_handle_t *)&g->flush_check, glue_closed);
  uv_close((uv_handle_t *)&g->flush_prep, glue_closed);
}

redisAsyncContext *sx__redis_connect(uv_loop_t *loop, const char *host, int port,
                                     void *data, redisConnectCallback *on_connect,
                                     redisDisconnectCallback *on_disconnect, char *err,
                                     size_t errsize) {
  redisAsyncContext *ac = redisAsyncConnect(host, port);
  if (ac == NULL) {
    snprintf(err, errsize, "out of memory");
    return NULL;
  }
  if (ac->err) {
    snprintf(err, errsize, "%s", ac->errstr);
    redisAsyncFree(ac);
    return NULL;
  }
  rc_glue *g = calloc(1, sizeof(*g));
  if (g == NULL || uv_poll_init(loop, &g->poll, ac->c.fd) != 0) {
    free(g);
    snprintf(err, errsize, "cannot poll the socket");
    redisAsyncFree(ac);
    return NULL;
  }
  uv_check_init(loop, &g->flush_check);
  uv_prepare_init(loop, &g->flush_prep);
  g->handles = 3;
  g->ac = ac;
  g->poll.data = g->flush_check.data = g->flush_prep.data = g;
  ac->ev.data = g;
  ac->ev.addRead = glue_add_read;
  ac->ev.delRead = glue_del_read;
  ac->ev.addWrite = glue_add_write;
  ac->ev.delWrite = glue_del_write;
  ac->ev.cleanup = glue_cleanup;
  ac->data = data;
  redisAsyncSetConnectCallback(ac, on_connect);
  redisAsyncSetDisconnectCallback(ac, on_disconnect);
  /* hiredis arms writability for the connect only when the first command is
   * queued; arm it now so a connect failure is seen even before that. */
  glue_add_write(g);
  return ac;
}

uint32_t sx__redis_backoff(uint32_t *step_ms) {
  uint32_t step = *step_ms;
  if (step < SX_REDIS_BACKOFF_MIN_MS)
    step = SX_REDIS_BACKOFF_MIN_MS;
  uint32_t r = 0;
  (void)sx__random(&r, sizeof(r));
  uint32_t wait = step / 2 + r % (step / 2 + 1);
  step *= 2;
  *step_ms = step > SX_REDIS_BACKOFF_MAX_MS ? SX_REDIS_BACKOFF_MAX_MS : step;
  return wait;
}

void sx__redis_scrub(char *dst, size_t size, const char *src, size_t len,
                     const char *secret) {
  size_t slen = secret ? strlen(secret) : 0, o = 0;
  if (size == 0)
    return;
  for (size_t i = 0; i < len && o + 1 < size;) {
    if (slen > 0 && i + slen <= len && memcmp(src + i, secret, slen) == 0) {
      for (const char *s = "***"; *s && o + 1 < size; s++)
        dst[o++] = *s;
      i += slen;
      continue;
    }
    unsigned char c = (unsigned char)src[i++];
    dst[o++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
  }
  dst[o] = '\0';
}

void sx__redis_describe(const redisReply *r, char *buf, size_t size) {
  if (r == NULL) {
    snprintf(buf, size, "no reply (connection lost)");
    return;
  }
  switch (r->type) {
  case REDIS_REPLY_ERROR: {
    char text[160];
    sx__redis_scrub(text, sizeof(text), r->str, r->len, NULL);
    snprintf(buf, size, "error '%s'", text);
    break;
  }
  case REDIS_REPLY_STATUS:
  case REDIS_REPLY_STRING: {
    char text[64];
    sx__redis_scrub(text, sizeof(text), r->str, r->len, NULL);
    snprintf(buf, size, "%s '%s'%s", r->type == REDIS_REPLY_STATUS ? "status" : "string",
             text, r->len >= sizeof(text) ? "..." : "");
    break;
  }
  case REDIS_REPLY_INTEGER:
    snprintf(buf, size, "integer %lld", r->integer);
    break;
  case REDIS_REPLY_NIL:
    snprintf(buf, size, "nil");
    break;
  case REDIS_REPLY_ARRAY:
    snprintf(buf, size, "array of %zu", r->elements);
    break;
  default:
    snprintf(buf, size, "reply of type %d", r->type);
  }
}

int sx__redis_is_error(const redisReply *r, const char *prefix) {
  size_t n = strlen(prefix);
  return r != NULL && r->type == REDIS_REPLY_ERROR && r->len >= n &&
         memcmp(r->str, prefix, n) == 0;
}

int sx__redis_map_error(const redisReply *r) {
  if (sx__redis_is_error(r, "WRONGTYPE"))
    return SX_EDECODE;
  if (sx__redis_is_error(r, "NOAUTH") || sx__redis_is_error(r, "WRONGPASS") ||
      sx__redis_is_error(r, "NOPERM"))
    return SX_EAUTH;
  if (sx__redis_is_error(r, "READONLY") || sx__redis_is_error(r, "MASTERDOWN") ||
      sx__redis_is_error(r, "LOADING") || sx__redis_is_error(r, "TRYAGAIN") ||
      sx__redis_is_error(r, "BUSY"))
    return SX_EUNREACH;
  return SX_ESTORE;
}

int sx__redis_read_error(const redisReply *r, char *msg, size_t size) {
  char desc[160];
  sx__redis_describe(r, desc, sizeof(desc));
  int rc = sx__redis_map_error(r);
  snprintf(msg, size, "%s (%s)",
           rc == SX_EAUTH ? "the store refused the read: this user lacks a permission "
                            "(docs/store.md lists the ACL a reader needs)"
           : rc == SX_EDECODE ? "the stored value is not a segment"
           : rc == SX_EUNREACH ? "the store cannot answer now"
                               : "the store failed the read",
           desc);
  return rc;
}

const char *sx__redis_elem_str(const redisReply *r, size_t i, size_t max) {
  if (i >= r->elements)
    return NULL;
  const redisReply *e = r->element[i];
  if ((e->type != REDIS_REPLY_STRING && e->type != REDIS_REPLY_STATUS) || e->len > max)
    return NULL;
  return e->str;
}
