/* Synchronous driving of a store backend for tests.  See store_fixture.h. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "internal.h"
#include "store_fixture.h"
#include "sxtest.h"

static void on_event(void *arg, const sx_event *ev) {
  sxt_store *s = arg;
  if (s->n_events < SXT_MAX_EVENTS)
    s->events[s->n_events++] = *ev;
}

static void on_watch(void *arg) { ((sxt_store *)arg)->n_watch++; }

static void on_conn(void *arg, int up, int err, const char *msg) {
  sxt_store *s = arg;
  if (up) {
    s->n_up++;
  } else {
    s->n_down++;
    s->last_err = err;
    snprintf(s->last_msg, sizeof(s->last_msg), "%s", msg ? msg : "");
  }
}

/* The wait ends from a prepare handle: it runs before the loop polls, and
 * uv_stop() makes that poll return at once.  (UV_RUN_ONCE would not do:
 * after running due timers it still blocks in poll until the next timer,
 * even when a timer callback already did what we wait for.) */
typedef struct waiter {
  sxt_store *s;
  int (*pred)(sxt_store *, void *);
  void *arg;
  int expired;
} waiter;

static void deadline_cb(uv_timer_t *t) {
  waiter *w = t->data;
  w->expired = 1;
  uv_stop(t->loop);
}

static void check_cb(uv_prepare_t *p) {
  waiter *w = p->data;
  if (w->pred(w->s, w->arg))
    uv_stop(p->loop);
}

int sxt_store_run_until(sxt_store *s, int (*pred)(sxt_store *, void *), void *arg,
                        uint32_t timeout_ms) {
  waiter w = {s, pred, arg, 0};
  uv_timer_t t;
  uv_prepare_t p;
  uv_timer_init(&s->loop, &t);
  uv_prepare_init(&s->loop, &p);
  t.data = p.data = &w;
  uv_timer_start(&t, deadline_cb, timeout_ms, 0);
  uv_prepare_start(&p, check_cb);
  while (!pred(s, arg) && !w.expired)
    uv_run(&s->loop, UV_RUN_DEFAULT);
  uv_close((uv_handle_t *)&t, NULL);
  uv_close((uv_handle_t *)&p, NULL);
  uv_run(&s->loop, UV_RUN_NOWAIT);
  return pred(s, arg) ? 0 : -1;
}

static int never(sxt_store *s, void *arg) {
  (void)s, (void)arg;
  return 0;
}

void sxt_store_run_for(sxt_store *s, uint32_t ms) {
  sxt_store_run_until(s, never, NULL, ms);
}

static int conn_count(sxt_store *s, void *arg) {
  const int *want = arg; /* {up, count} */
  return (want[0] ? s->n_up : s->n_down) >= want[1];
}

int sxt_store_wait_conn(sxt_store *s, int up, int count, uint32_t timeout_ms) {
  int want[2] = {up, count};
  return sxt_store_run_until(s, conn_count, want, timeout_ms);
}

static int watch_count(sxt_store *s, void *arg) { return s->n_watch >= *(int *)arg; }

int sxt_store_wait_watch(sxt_store *s, int count, uint32_t timeout_ms) {
  return sxt_store_run_until(s, watch_count, &count, timeout_ms);
}

int sxt_store_watch(sxt_store *s) {
  int before = s->n_watch;
  int rc = sx__backend_watch(s->b);
  if (rc == 0 && sxt_store_wait_watch(s, before + 1, SXT_OP_DEADLINE_MS) != 0)
    fail_msg("the watch was not in place within %d ms", SXT_OP_DEADLINE_MS);
  return rc;
}

int sxt_store_open(sxt_store *s, const char *url, int wait_up) {
  memset(s, 0, sizeof(*s));
  assert_int_equal(uv_loop_init(&s->loop), 0);
  sx_backend_hooks hooks = {
      .on_event = on_event, .on_conn = on_conn, .on_watch = on_watch, .arg = s};
  int rc = sx__backend_open(&s->loop, url, &hooks, &s->b);
  if (rc != 0) {
    s->b = NULL;
    return rc;
  }
  if (wait_up && sxt_store_wait_conn(s, 1, 1, SXT_OP_DEADLINE_MS) != 0)
    fail_msg("store %s never came up (last error %s: %s)", url, sx_err_name(s->last_err),
             s->last_msg);
  return 0;
}

void sxt_store_close(sxt_store *s) {
  sx__backend_close(s->b);
  s->b = NULL;
  uv_run(&s->loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&s->loop), 0);
}

/* ---------------------------------------------------------------- ops */

void sxt_reply_free(sxt_reply *r) {
  free(r->value);
  for (size_t i = 0; i < r->n_items; i++)
    free(r->items[i].value);
  free(r->items);
  memset(r, 0, sizeof(*r));
}

static uint8_t *dup_bytes(const uint8_t *p, size_t n) {
  uint8_t *d = malloc(n ? n : 1);
  assert_non_null(d);
  if (n)
    memcpy(d, p, n);
  return d;
}

void sxt_reply_cb(void *arg, const sx_backend_reply *rep) {
  sxt_reply *r = arg;
  if (r->calls++ > 0)
    return; /* counted: the test fails on a second call */
  r->status = rep->status;
  snprintf(r->message, sizeof(r->message), "%s", rep->message);
  r->ttl_ms = rep->ttl_ms;
  if (rep->value != NULL) {
    r->value = dup_bytes(rep->value, rep->len);
    r->len = rep->len;
  }
  memcpy(r->holder, rep->holder, SX_INCARNATION_LEN);
  r->holder_age_ms = rep->holder_age_ms;
  r->holder_ttl_ms = rep->holder_ttl_ms;
  if (rep->n_items > 0) {
    r->items = calloc(rep->n_items, sizeof(*r->items));
    assert_non_null(r->items);
    for (size_t i = 0; i < rep->n_items; i++) {
      const sx_backend_item *it = &rep->items[i];
      snprintf(r->items[i].name, sizeof(r->items[i].name), "%s", it->name);
      r->items[i].value = it->value ? dup_bytes(it->value, it->len) : NULL;
      r->items[i].len = it->len;
      r->items[i].ttl_ms = it->ttl_ms;
    }
    r->n_items = rep->n_items;
  }
}

static int replied(sxt_store *s, void *arg) {
  (void)s;
  return ((sxt_reply *)arg)->calls > 0;
}

/* Wait for the callback of an op that started with rc. */
static int await(sxt_store *s, int rc, sxt_reply *r, const char *what) {
  if (rc != 0) {
    /* Refused before it started: the message is the calling thread's. */
    snprintf(r->message, sizeof(r->message), "%s", sx_errmsg());
    return rc;
  }
  if (sxt_store_run_until(s, replied, r, SXT_OP_DEADLINE_MS) != 0)
    fail_msg("%s: no answer within %d ms", what, SXT_OP_DEADLINE_MS);
  /* Let anything else that is due run, so a second callback would show. */
  uv_run(&s->loop, UV_RUN_NOWAIT);
  assert_int_equal(r->calls, 1);
  return r->status;
}

int sxt_publish(sxt_store *s, const sx_publish_req *req, sxt_reply *r) {
  memset(r, 0, sizeof(*r));
  return await(s, sx__backend_publish(s->b, req, sxt_reply_cb, r), r, "publish");
}

int sxt_renew(sxt_store *s, const char *name, const uint8_t *inc, uint32_t lease_ms,
              sxt_reply *r) {
  memset(r, 0, sizeof(*r));
  return await(s, sx__backend_renew(s->b, name, inc, lease_ms, sxt_reply_cb, r), r,
               "renew");
}

int sxt_unpublish(sxt_store *s, const char *name, const uint8_t *inc, sxt_reply *r) {
  memset(r, 0, sizeof(*r));
  return await(s, sx__backend_unpublish(s->b, name, inc, sxt_reply_cb, r), r,
               "unpublish");
}

int sxt_get(sxt_store *s, const char *name, sxt_reply *r) {
  memset(r, 0, sizeof(*r));
  return await(s, sx__backend_get(s->b, name, sxt_reply_cb, r), r, "get");
}

int sxt_list(sxt_store *s, sxt_reply *r) {
  memset(r, 0, sizeof(*r));
  return await(s, sx__backend_list(s->b, sxt_reply_cb, r), r, "list");
}

int sxt_remove(sxt_store *s, const char *name, sxt_reply *r) {
  memset(r, 0, sizeof(*r));
  return await(s, sx__backend_remove(s->b, name, sxt_reply_cb, r), r, "remove");
}

int sxt_stores_await(sxt_store *const *stores, size_t n, sxt_reply *const *replies,
                     size_t n_replies, uint32_t timeout_ms) {
  uint64_t start = sx__mono_ms();
  for (;;) {
    size_t done = 0;
    for (size_t i = 0; i < n_replies; i++)
      done += replies[i]->calls > 0;
    if (done == n_replies)
      return 0;
    if (sx__mono_ms() - start > timeout_ms)
      return -1;
    for (size_t i = 0; i < n; i++)
      uv_run(&stores[i]->loop, UV_RUN_NOWAIT);
    usleep(500);
  }
}

const sxt_item *sxt_reply_item(const sxt_reply *r, const char *name) {
  for (size_t i = 0; i < r->n_items; i++)
    if (strcmp(r->items[i].name, name) == 0)
      return &r->items[i];
  return NULL;
}

/* ---------------------------------------------------------------- events */

typedef struct ev_want {
  sx_event_kind kind;
  const char *name;
  long found;
} ev_want;

static int find_event(sxt_store *s, void *arg) {
  ev_want *w = arg;
  for (size_t i = 0; i < s->n_events; i++) {
    if (!s->taken[i] && s->events[i].kind == w->kind &&
        strcmp(s->events[i].name, w->name) == 0) {
      w->found = (long)i;
      return 1;
    }
  }
  return 0;
}

int sxt_store_take_event(sxt_store *s, sx_event_kind kind, const char *name,
                         uint32_t timeout_ms, sx_event *out) {
  ev_want w = {kind, name, -1};
  if (sxt_store_run_until(s, find_event, &w, timeout_ms) != 0)
    return -1;
  s->taken[w.found] = 1;
  if (out)
    *out = s->events[w.found];
  return 0;
}

int sxt_store_count_events(const sxt_store *s, sx_event_kind kind, const char *name) {
  int n = 0;
  for (size_t i = 0; i < s->n_events; i++)
    n += s->events[i].kind == kind && strcmp(s->events[i].name, name) == 0;
  return n;
}


typedef struct closer {
  sxt_store *s;
  int calls, status;
} closer;

static void close_in_cb(void *arg, const sx_backend_reply *rep) {
  closer *c = arg;
  c->calls++;
  c->status = rep->status;
  sx__backend_close(c->s->b);
  c->s->b = NULL;
}

/* Two reads of name, the first closing the backend from its callback: it
 * ends once with status, the other once, cancelled or with status too. */
static void close_from_first_read(sxt_store *s, const char *name, int status) {
  closer c = {.s = s};
  sxt_reply other;
  memset(&other, 0, sizeof(other));
  assert_int_equal(sx__backend_get(s->b, name, close_in_cb, &c), 0);
  assert_int_equal(sx__backend_get(s->b, name, sxt_reply_cb, &other), 0);
  uint64_t t0 = sx__mono_ms();
  while ((c.calls == 0 || other.calls == 0) && sx__mono_ms() - t0 < 10000)
    uv_run(&s->loop, UV_RUN_ONCE);
  assert_int_equal(c.calls, 1);
  assert_int_equal(c.status, status);
  assert_int_equal(other.calls, 1);
  assert_true(other.status == SX_ECANCELED || other.status == status);
  sxt_store_close(s);
  assert_int_equal(c.calls, 1);
  assert_int_equal(other.calls, 1);
  sxt_reply_free(&other);
}

void sxt_store_close_from_timed_out_op(sxt_store *s, const char *name) {
  close_from_first_read(s, name, SX_ETIMEDOUT);
}

void sxt_store_close_from_reply(sxt_store *s, const char *name) {
  close_from_first_read(s, name, SX_ENOENT);
}
