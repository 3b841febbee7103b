/*
 * The synchronous store client (include/segxfer/store.h): the asynchronous
 * backend driven on a private libuv loop until each op's callback has run.
 * There is no second store implementation here, only waiting and decoding.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "internal.h"
#include "segxfer/store.h"

struct sx_store {
  uv_loop_t loop;
  uv_async_t wake;
  uv_timer_t tick; /* bounds waits for a reconnect */
  sx_backend *b;
  char url[600];
  int conn;          /* 0 connecting, 1 up, < 0 down with this code */
  char conn_msg[1024];
  /* Set by sx_store_interrupt() from a signal handler or another thread;
   * lock-free atomics are safe in both. */
  atomic_int interrupted;
  sx_store_watch_cb wcb;
  void *warg;
  int wstop;
  int wready;   /* cb(arg, NULL) was called */
  int watching; /* the backend's watch() was called (it stays on) */
};

/* One op's outcome, copied out of the callback. */
typedef struct wait_op {
  sx_store *s;
  int done;
  int status;
  char message[256];
  const char *name;
  /* get */
  sx_desc desc;
  int have_desc;
  sx_store_lease lease;
  /* list */
  sx_store_entry *entries;
  size_t n;
} wait_op;

/*
 * Every wait here is "run the loop once until a flag is set" (UV_RUN_ONCE).
 * That mode runs due timers first and then blocks in poll: when the flag is
 * set by a timer callback (libcurl's multi interface answers etcd requests
 * from timers; Redis command timeouts fire from one), poll would then block
 * until something else happens, forever if nothing does.  So whatever ends
 * a wait also stops the loop (uv_stop makes that poll return at once).
 */
static void wake(sx_store *s) { uv_stop(&s->loop); }

static void on_conn(void *arg, int up, int err, const char *msg) {
  sx_store *s = arg;
  wake(s);
  if (up) {
    s->conn = 1;
    return;
  }
  s->conn = err ? err : SX_EUNREACH;
  snprintf(s->conn_msg, sizeof(s->conn_msg), "%s", msg ? msg : sx_strerror(s->conn));
}

static void on_event(void *arg, const sx_event *ev) {
  sx_store *s = arg;
  if (s->wcb != NULL && !s->wstop && s->wcb(s->warg, ev) != 0) {
    s->wstop = 1;
    wake(s);
  }
}

/* The watch is in place: tell the caller once per sx_store_watch(). */
static void on_watch(void *arg) {
  sx_store *s = arg;
  if (s->wcb != NULL && !s->wstop && !s->wready) {
    s->wready = 1;
    if (s->wcb(s->warg, NULL) != 0) {
      s->wstop = 1;
      wake(s);
    }
  }
}

static void on_wake(uv_async_t *h) { (void)h; }

static void on_tick(uv_timer_t *t) {
  *(int *)t->data = 1;
  uv_stop(t->loop);
}

static const char *hint(const sx_store *s, int code) {
  switch (code) {
  case SX_EUNREACH:
    return "is the server running, and are host and port right?";
  case SX_EAUTH:
    if (s->b != NULL && strcmp(s->b->url.scheme, "redis+sentinel") == 0)
      return "check the user and password in the URL (user:password@ for the master, "
             "sentinel_user and sentinel_password for the sentinels)";
    return "check the user and password in the URL";
  case SX_ETIMEDOUT:
    return "the server did not answer in time: is it overloaded or stopped, or does a "
           "firewall drop the packets? (connect_timeout_ms, timeout_ms)";
  default:
    return "";
  }
}

static void drain_close(sx_store *s) {
  if (s->b != NULL)
    sx__backend_close(s->b);
  s->b = NULL;
  uv_close((uv_handle_t *)&s->wake, NULL);
  uv_close((uv_handle_t *)&s->tick, NULL);
  /* Callbacks of cancelled ops stop the loop (wake()): run until every
   * handle is closed. */
  while (uv_run(&s->loop, UV_RUN_DEFAULT) != 0) {
  }
  uv_loop_close(&s->loop);
}

int sx_store_open(const char *url, sx_store **out) {
  sx_store *s = calloc(1, sizeof(*s));
  int rc;
  if (s == NULL)
    return sx__err(SX_ENOMEM, "store: open");
  if (uv_loop_init(&s->loop) != 0) {
    free(s);
    return sx__err(SX_ENOMEM, "store: cannot create an event loop");
  }
  uv_async_init(&s->loop, &s->wake, on_wake);
  uv_timer_init(&s->loop, &s->tick);
  sx_backend_hooks hooks = {
      .on_event = on_event, .on_conn = on_conn, .on_watch = on_watch, .arg = s};
  rc = sx__backend_open(&s->loop, url, &hooks, &s->b);
  if (rc != 0) {
    s->b = NULL;
    goto out_close;
  }
  sx__url_redact(&s->b->url, s->url, sizeof(s->url));
  while (s->conn == 0)
    uv_run(&s->loop, UV_RUN_ONCE);
  if (s->conn < 0) {
    rc = sx__err(s->conn, "cannot use the metadata store: %s; %s", s->conn_msg,
                 hint(s, s->conn));
    goto out_close;
  }
  *out = s;
  return 0;

out_close:
  drain_close(s);
  free(s);
  return rc;
}

void sx_store_close(sx_store *s) {
  if (s == NULL)
    return;
  drain_close(s);
  free(s);
}

const char *sx_store_url(const sx_store *s) { return s->url; }

/*
 * The backend reconnects by itself, with backoff, but only while its loop
 * runs, which for a synchronous client is only inside calls.  So a call
 * made after the connection was lost first waits for the reconnect, as long
 * as one backoff step and one connect may take, and fails if it does not
 * come.
 */
static int ensure_conn(sx_store *s) {
  int expired = 0;
  /* Handle what arrived since the last call first (a lost connection, a
   * sentinel's +switch-master), so this call goes where it should. */
  uv_run(&s->loop, UV_RUN_NOWAIT);
  if (s->conn > 0)
    return 0;
  s->tick.data = &expired;
  uv_timer_start(&s->tick, on_tick, (uint64_t)s->b->url.connect_timeout_ms + 1000, 0);
  while (s->conn < 0 && !expired)
    uv_run(&s->loop, UV_RUN_ONCE);
  uv_timer_stop(&s->tick);
  if (s->conn > 0)
    return 0;
  return sx__err(s->conn, "%s; %s", s->conn_msg, hint(s, s->conn));
}

/* Run the loop until the op's callback ran.  The backend's own deadlines
 * bound the wait. */
static int wait_for(wait_op *w, int rc) {
  if (rc != 0)
    return rc;
  while (!w->done)
    uv_run(&w->s->loop, UV_RUN_ONCE);
  if (w->status != 0)
    return sx__err(w->status, "%s", w->message);
  return 0;
}

static void done_cb(void *arg, const sx_backend_reply *rep) {
  wait_op *w = arg;
  w->done = 1;
  wake(w->s);
  w->status = rep->status;
  snprintf(w->message, sizeof(w->message), "%s", rep->message);
}

/* Decode a stored value; on failure fill code and message. */
static int decode(const char *name, const uint8_t *value, size_t len, sx_desc *d,
                  char *msg, size_t msize) {
  int rc = sx_desc_decode(value, len, d);
  if (rc != 0) {
    snprintf(msg, msize, "%s: the stored descriptor is corrupt: %s", name, sx_errmsg());
    return rc;
  }
  if (strcmp(d->name, name) != 0) {
    snprintf(msg, msize, "%s: the stored descriptor names itself '%s'", name, d->name);
    sx_desc_free(d);
    return SX_EDECODE;
  }
  return 0;
}

static void get_cb(void *arg, const sx_backend_reply *rep) {
  wait_op *w = arg;
  done_cb(arg, rep);
  if (rep->status != 0)
    return;
  w->lease.ttl_ms = rep->ttl_ms;
  w->lease.renewed_ago_ms = rep->ttl_ms >= 0 ? (int64_t)rep->holder_age_ms : -1;
  w->status = decode(w->name, rep->value, rep->len, &w->desc, w->message,
                     sizeof(w->message));
  w->have_desc = w->status == 0;
}

int sx_store_get(sx_store *s, const char *name, sx_desc *desc, sx_store_lease *lease) {
  wait_op w = {.s = s, .name = name};
  if (s == NULL || name == NULL || desc == NULL)
    return sx__err(SX_EINVAL, "sx_store_get: NULL argument");
  /* Every backend gets the same name rules, whatever it checks itself. */
  if (sx_name_validate(name) != 0)
    return SX_ENAME;
  int rc = ensure_conn(s);
  if (rc != 0)
    return rc;
  rc = wait_for(&w, sx__backend_get(s->b, name, get_cb, &w));
  if (rc != 0)
    return rc;
  *desc = w.desc;
  if (lease)
    *lease = w.lease;
  return 0;
}

static int entry_cmp(const void *a, const void *b) {
  return strcmp(((const sx_store_entry *)a)->name, ((const sx_store_entry *)b)->name);
}

static void list_cb(void *arg, const sx_backend_reply *rep) {
  wait_op *w = arg;
  done_cb(arg, rep);
  if (rep->status != 0 || rep->n_items == 0)
    return;
  w->entries = calloc(rep->n_items, sizeof(*w->entries));
  if (w->entries == NULL) {
    w->status = SX_ENOMEM;
    snprintf(w->message, sizeof(w->message), "list: out of memory");
    return;
  }
  for (size_t i = 0; i < rep->n_items; i++) {
    const sx_backend_item *it = &rep->items[i];
    if (it->status == 0 && it->value == NULL)
      continue; /* vanished while listing */
    sx_store_entry *e = &w->entries[w->n++];
    snprintf(e->name, sizeof(e->name), "%s", it->name);
    e->lease.ttl_ms = it->ttl_ms;
    e->lease.renewed_ago_ms = -1;
    if (it->status != 0) {
      e->status = it->status;
      snprintf(e->message, sizeof(e->message), "%s: the stored value is not a segment "
               "descriptor (%s)", it->name, sx_strerror(it->status));
      continue;
    }
    e->status = decode(it->name, it->value, it->len, &e->desc, e->message,
                       sizeof(e->message));
  }
  qsort(w->entries, w->n, sizeof(*w->entries), entry_cmp);
}

int sx_store_list(sx_store *s, sx_store_entry **entries, size_t *n) {
  wait_op w = {.s = s};
  if (s == NULL || entries == NULL || n == NULL)
    return sx__err(SX_EINVAL, "sx_store_list: NULL argument");
  int rc = ensure_conn(s);
  if (rc != 0)
    return rc;
  rc = wait_for(&w, sx__backend_list(s->b, list_cb, &w));
  if (rc != 0) {
    sx_store_entries_free(w.entries, w.n);
    return rc;
  }
  if (w.n == 0) {
    free(w.entries);
    w.entries = NULL;
  }
  *entries = w.entries;
  *n = w.n;
  return 0;
}

void sx_store_entries_free(sx_store_entry *entries, size_t n) {
  if (entries == NULL)
    return;
  for (size_t i = 0; i < n; i++)
    if (entries[i].status == 0)
      sx_desc_free(&entries[i].desc);
  free(entries);
}

int sx_store_remove(sx_store *s, const char *name) {
  wait_op w = {.s = s};
  if (s == NULL || name == NULL)
    return sx__err(SX_EINVAL, "sx_store_remove: NULL argument");
  if (sx_name_validate(name) != 0)
    return SX_ENAME;
  int rc = ensure_conn(s);
  if (rc != 0)
    return rc;
  return wait_for(&w, sx__backend_remove(s->b, name, done_cb, &w));
}

int sx_store_publish_raw(sx_store *s, const char *name,
                         const uint8_t incarnation[SX_INCARNATION_LEN], uint64_t generation,
                         const uint8_t *value, size_t len, uint32_t lease_ms,
                         unsigned flags) {
  wait_op w = {.s = s};
  if (s == NULL || name == NULL || incarnation == NULL || value == NULL)
    return sx__err(SX_EINVAL, "sx_store_publish: NULL argument");
  sx_publish_req req = {
      .name = name,
      .incarnation = incarnation,
      .generation = generation,
      .value = value,
      .len = len,
      .lease_ms = lease_ms ? lease_ms : 5000,
      .takeover = (flags & SX_STORE_TAKEOVER) != 0,
  };
  if (sx_name_validate(name) != 0)
    return SX_ENAME;
  int rc = ensure_conn(s);
  if (rc != 0)
    return rc;
  return wait_for(&w, sx__backend_publish(s->b, &req, done_cb, &w));
}

int sx_store_publish(sx_store *s, const sx_desc *d, unsigned flags) {
  uint8_t *buf;
  size_t len;
  if (s == NULL || d == NULL)
    return sx__err(SX_EINVAL, "sx_store_publish: NULL argument");
  int rc = sx_desc_encode(d, &buf, &len);
  if (rc != 0)
    return sx__errwrap(rc, "%s: publish", d->name);
  rc = sx_store_publish_raw(s, d->name, d->incarnation, d->generation, buf, len,
                            d->lease_ms, flags);
  free(buf);
  return rc;
}

int sx_store_renew(sx_store *s, const char *name,
                   const uint8_t incarnation[SX_INCARNATION_LEN], uint32_t lease_ms) {
  wait_op w = {.s = s};
  if (s == NULL || name == NULL || incarnation == NULL)
    return sx__err(SX_EINVAL, "sx_store_renew: NULL argument");
  if (sx_name_validate(name) != 0)
    return SX_ENAME;
  int rc = ensure_conn(s);
  if (rc != 0)
    return rc;
  return wait_for(&w, sx__backend_renew(s->b, name, incarnation,
                                        lease_ms ? lease_ms : 5000, done_cb, &w));
}

int sx_store_unpublish(sx_store *s, const char *name,
                       const uint8_t incarnation[SX_INCARNATION_LEN]) {
  wait_op w = {.s = s};
  if (s == NULL || name == NULL || incarnation == NULL)
    return sx__err(SX_EINVAL, "sx_store_unpublish: NULL argument");
  if (sx_name_validate(name) != 0)
    return SX_ENAME;
  int rc = ensure_conn(s);
  if (rc != 0)
    return rc;
  return wait_for(&w, sx__backend_unpublish(s->b, name, incarnation, done_cb, &w));
}

int sx_store_watch(sx_store *s, sx_store_watch_cb cb, void *arg) {
  if (s == NULL || cb == NULL)
    return sx__err(SX_EINVAL, "sx_store_watch: NULL argument");
  int rc = ensure_conn(s);
  if (rc != 0)
    return rc;
  s->wcb = cb;
  s->warg = arg;
  s->wstop = 0;
  /* A second watch on this store: the backend's watch is in place already
   * (it stays on between calls). */
  s->wready = 0;
  if (s->watching) {
    on_watch(s);
  } else {
    rc = sx__backend_watch(s->b);
    if (rc != 0) {
      s->wcb = NULL;
      return rc;
    }
    s->watching = 1;
  }
  while (!s->wstop && !atomic_load(&s->interrupted) && s->conn >= 0)
    uv_run(&s->loop, UV_RUN_ONCE);
  s->wcb = NULL;
  if (s->wstop)
    return 0;
  if (atomic_exchange(&s->interrupted, 0))
    return sx__err(SX_ECANCELED, "watch interrupted");
  return sx__err(s->conn, "watch ended: %s", s->conn_msg);
}

void sx_store_interrupt(sx_store *s) {
  atomic_store(&s->interrupted, 1);
  uv_async_send(&s->wake);
}
