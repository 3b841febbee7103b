/*
 * The Redis backend's session: connecting (with the handshake: AUTH, SELECT,
 * ROLE for sentinel masters, SCRIPT LOAD), the pub/sub connection and its
 * events, failures and reconnects with backoff, open and close.  The ops
 * themselves are in backend_redis.c.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "redis.h"

/* The connection a callback came from died under it: hiredis is freeing the
 * context (never free it again), so forget it and fail the session. */
void sx__redis_lost(redis_backend *rb, redisAsyncContext *ac) {
  char why[160];
  sx__redis_scrub(why, sizeof(why), ac->errstr, strlen(ac->errstr),
                  rb->base.url.password);
  int err = strstr(why, "NOAUTH") || strstr(why, "NOPERM") || strstr(why, "WRONGPASS")
                ? SX_EAUTH
                : SX_EUNREACH;
  if (ac == rb->data)
    rb->data = NULL;
  if (ac == rb->sub)
    rb->sub = NULL;
  sx__redis_session_fail(rb, err, "connection to %s:%d lost: %s", rb->host, rb->port,
                         why[0] ? why : "closed by the server");
}

/* ------------------------------------------------------------ events */

void sx__redis_deliver_event(redis_backend *rb, const redisReply *payload) {
  sx_event ev;
  if (payload->type != REDIS_REPLY_STRING || payload->len > 4096)
    return;
  /* Undecodable events are dropped: caches also expire entries by TTL. */
  if (sx_event_decode((const uint8_t *)payload->str, payload->len, &ev) != 0)
    return;
  if (rb->base.hooks.on_event)
    rb->base.hooks.on_event(rb->base.hooks.arg, &ev);
}

/* "__keyspace@DB__:sx:NS:seg:{NAME}" with message "expired". */
void sx__redis_deliver_expiry(redis_backend *rb, const redisReply *chan,
                              const redisReply *what) {
  sx_event ev;
  memset(&ev, 0, sizeof(ev));
  ev.kind = SX_EVENT_EXPIRED;
  if (sx__redis_expiry_name(rb->ks_pattern, rb->ks_prefix_len, chan, what, ev.name) != 0)
    return;
  if (rb->base.hooks.on_event)
    rb->base.hooks.on_event(rb->base.hooks.arg, &ev);
}

static void maybe_ready(redis_backend *rb);

/* The subscription is confirmed: Redis delivers every message published
 * after it. */
static void watch_ready(redis_backend *rb) {
  if (rb->state == RB_READY && rb->watching && rb->sub != NULL && rb->sub_left == 0 &&
      rb->base.hooks.on_watch)
    rb->base.hooks.on_watch(rb->base.hooks.arg);
}

static void sub_cb(redisAsyncContext *ac, void *reply, void *priv) {
  redis_backend *rb = ac->data;
  redisReply *r = reply;
  (void)priv;
  if (ac != rb->sub)
    return;
  if (r == NULL) {
    sx__redis_lost(rb, ac);
    return;
  }
  if (r->type == REDIS_REPLY_ERROR) {
    char desc[200];
    sx__redis_describe(r, desc, sizeof(desc));
    sx__redis_session_fail(rb, sx__redis_map_error(r), "subscribing to events failed: %s", desc);
    return;
  }
  if (r->type != REDIS_REPLY_ARRAY || r->elements < 3 ||
      r->element[0]->type != REDIS_REPLY_STRING)
    return;
  const char *kind = r->element[0]->str;
  if (strcmp(kind, "subscribe") == 0 || strcmp(kind, "psubscribe") == 0) {
    if (rb->sub_left > 0 && --rb->sub_left == 0) {
      /* Connecting: ready() reports it with the connection.  Already up
       * (watch() came later): report it now. */
      if (rb->state == RB_READY)
        watch_ready(rb);
      else
        maybe_ready(rb);
    }
  } else if (strcmp(kind, "message") == 0 && r->elements == 3) {
    sx__redis_deliver_event(rb, r->element[2]);
  } else if (strcmp(kind, "pmessage") == 0 && r->elements == 4) {
    sx__redis_deliver_expiry(rb, r->element[2], r->element[3]);
  }
}

void sx__redis_auth_fail(redis_backend *rb, const redisReply *r) {
  char text[160];
  sx__redis_scrub(text, sizeof(text), r->str, r->len, rb->base.url.password);
  if (rb->base.url.has_password)
    sx__redis_session_fail(rb, SX_EAUTH, "authentication%s%s%s failed (%s); check the "
                           "user and password in the URL", rb->base.url.user[0] ? " as '" : "",
                           rb->base.url.user, rb->base.url.user[0] ? "'" : "", text);
  else
    sx__redis_session_fail(rb, SX_EAUTH, "the server requires a password (%s); put "
                           "user:password@ in the URL", text);
}

static void sub_auth_cb(redisAsyncContext *ac, void *reply, void *priv) {
  redis_backend *rb = ac->data;
  redisReply *r = reply;
  (void)priv;
  if (ac != rb->sub)
    return;
  if (r == NULL)
    sx__redis_lost(rb, ac);
  else if (r->type == REDIS_REPLY_ERROR)
    sx__redis_auth_fail(rb, r);
}

static void sub_on_connect(const redisAsyncContext *cac, int status) {
  redisAsyncContext *ac = (redisAsyncContext *)cac;
  redis_backend *rb = ac->data;
  if (ac != rb->sub || status == REDIS_OK)
    return;
  rb->sub = NULL;
  sx__redis_session_fail(rb, SX_EUNREACH, "cannot connect to %s:%d for events: %s",
                         rb->host, rb->port, ac->errstr);
}

static void sub_on_disconnect(const redisAsyncContext *cac, int status) {
  redisAsyncContext *ac = (redisAsyncContext *)cac;
  redis_backend *rb = ac->data;
  (void)status;
  if (ac == rb->sub)
    sx__redis_lost(rb, ac);
}

int sx__redis_auth_argv(const redis_backend *rb, const char **argv) {
  int n = 0;
  argv[n++] = "AUTH";
  if (rb->base.url.user[0])
    argv[n++] = rb->base.url.user;
  argv[n++] = rb->base.url.password;
  return n;
}

static void sub_connect(redis_backend *rb) {
  char err[160];
  rb->sub = sx__redis_connect(rb->base.loop, rb->host, rb->port, rb, sub_on_connect,
                              sub_on_disconnect, err, sizeof(err));
  if (rb->sub == NULL) {
    sx__redis_session_fail(rb, SX_EUNREACH, "cannot connect to %s:%d for events: %s",
                           rb->host, rb->port, err);
    return;
  }
  if (rb->base.url.has_password) {
    const char *argv[3];
    int n = sx__redis_auth_argv(rb, argv);
    redisAsyncCommandArgv(rb->sub, sub_auth_cb, NULL, n, argv, NULL);
  }
  const char *s[] = {"SUBSCRIBE", rb->channel};
  const char *p[] = {"PSUBSCRIBE", rb->ks_pattern};
  rb->sub_left = 2;
  redisAsyncCommandArgv(rb->sub, sub_cb, NULL, 2, s, NULL);
  redisAsyncCommandArgv(rb->sub, sub_cb, NULL, 2, p, NULL);
}

/* ------------------------------------------------------------ session */

enum { HS_AUTH = 100, HS_SELECT, HS_ROLE, HS_SCRIPT };

void sx__redis_ready(redis_backend *rb) {
  rb->state = RB_READY;
  uv_timer_stop(&rb->conn_timer);
  rb->backoff_ms = 0;
  rb->last_err[0] = '\0';
  sx__redis_flush_queued(rb);
  if (rb->state != RB_READY)
    return;
  rb->reported_down = 0;
  /* A reconnect (maybe to a promoted replica that missed recent writes):
   * index entries may have been lost with the old connection. */
  if (rb->up_once)
    sx__redis_index_retry(rb);
  rb->up_once = 1;
  if (rb->base.hooks.on_conn)
    rb->base.hooks.on_conn(rb->base.hooks.arg, 1, 0, NULL);
  watch_ready(rb);
}

static void maybe_ready(redis_backend *rb) {
  if (rb->state == RB_CONNECTING && rb->hs_left == 0 &&
      (!rb->watching || (rb->sub != NULL && rb->sub_left == 0)))
    sx__redis_ready(rb);
}

static void hs_cb(redisAsyncContext *ac, void *reply, void *priv) {
  redis_backend *rb = ac->data;
  redisReply *r = reply;
  int step = (int)(intptr_t)priv;
  char desc[200];
  if (ac != rb->data)
    return;
  if (r == NULL) {
    sx__redis_lost(rb, ac);
    return;
  }
  if (r->type == REDIS_REPLY_ERROR && step >= HS_SCRIPT && !sx__redis_is_error(r, "NOAUTH")) {
    /* Script loading is an optimisation: a read-only ACL user may not load
     * scripts, and a server may restrict them.  Ops then send the script body
     * (EVAL), which fails by itself where scripts are not allowed. */
    rb->script_sha[step - HS_SCRIPT][0] = '\0';
    if (--rb->hs_left == 0)
      maybe_ready(rb);
    return;
  }
  if (r->type == REDIS_REPLY_ERROR) {
    if (step == HS_AUTH || sx__redis_map_error(r) == SX_EAUTH) {
      sx__redis_auth_fail(rb, r);
      return;
    }
    sx__redis_describe(r, desc, sizeof(desc));
    sx__redis_session_fail(rb, sx__redis_map_error(r), "%s:%d: %s failed: %s", rb->host, rb->port,
                           step == HS_SELECT ? "SELECT"
                           : step == HS_ROLE ? "ROLE"
                                             : "SCRIPT LOAD",
                           desc);
    return;
  }
  if (step == HS_ROLE) {
    const char *role = r->type == REDIS_REPLY_ARRAY ? sx__redis_elem_str(r, 0, 32) : NULL;
    if (role == NULL || strcmp(role, "master") != 0) {
      sx__redis_session_fail(rb, SX_EUNREACH, "%s:%d, given by the sentinels as master "
                             "'%s', is a %s; asking again", rb->host, rb->port,
                             rb->base.url.master, role ? role : "server of unknown role");
      return;
    }
  } else if (step >= HS_SCRIPT && step < HS_SCRIPT + SX_SCRIPT_COUNT) {
    if (r->type != REDIS_REPLY_STRING || r->len != 40) {
      sx__redis_describe(r, desc, sizeof(desc));
      sx__redis_session_fail(rb, SX_ESTORE, "SCRIPT LOAD answered %s", desc);
      return;
    }
    memcpy(rb->script_sha[step - HS_SCRIPT], r->str, 40);
    rb->script_sha[step - HS_SCRIPT][40] = '\0';
  }
  if (--rb->hs_left == 0)
    maybe_ready(rb);
}

static void data_on_connect(const redisAsyncContext *cac, int status) {
  redisAsyncContext *ac = (redisAsyncContext *)cac;
  redis_backend *rb = ac->data;
  if (ac != rb->data || status == REDIS_OK)
    return;
  rb->data = NULL;
  sx__redis_session_fail(rb, SX_EUNREACH, "cannot connect to %s:%d: %s", rb->host,
                         rb->port, ac->errstr);
}

static void data_on_disconnect(const redisAsyncContext *cac, int status) {
  redisAsyncContext *ac = (redisAsyncContext *)cac;
  redis_backend *rb = ac->data;
  (void)status;
  if (ac == rb->data)
    sx__redis_lost(rb, ac);
}

static void hs_send(redis_backend *rb, int step, int argc, const char **argv) {
  if (redisAsyncCommandArgv(rb->data, hs_cb, (void *)(intptr_t)step, argc, argv, NULL) ==
      REDIS_OK)
    rb->hs_left++;
}

void sx__redis_master_resolved(redis_backend *rb) {
  char err[160];
  rb->state = RB_CONNECTING;
  rb->hs_left = 0;
  sx__redis_arm_conn_timer(rb, rb->base.url.connect_timeout_ms);
  rb->data = sx__redis_connect(rb->base.loop, rb->host, rb->port, rb, data_on_connect,
                               data_on_disconnect, err, sizeof(err));
  if (rb->data == NULL) {
    sx__redis_session_fail(rb, SX_EUNREACH, "cannot connect to %s:%d: %s", rb->host,
                           rb->port, err);
    return;
  }
  /* The handshake is queued at once; hiredis sends it when connected.  The
   * connect deadline covers it all. */
  if (rb->base.url.has_password) {
    const char *argv[3];
    int n = sx__redis_auth_argv(rb, argv);
    hs_send(rb, HS_AUTH, n, argv);
  }
  if (rb->base.url.db != 0) {
    char db[12];
    snprintf(db, sizeof(db), "%d", rb->base.url.db);
    const char *argv[] = {"SELECT", db};
    hs_send(rb, HS_SELECT, 2, argv);
  }
  if (rb->sentinel) {
    const char *argv[] = {"ROLE"};
    hs_send(rb, HS_ROLE, 1, argv);
  }
  for (int i = 0; i < SX_SCRIPT_COUNT; i++) {
    const char *argv[] = {"SCRIPT", "LOAD", sx__redis_scripts[i]};
    hs_send(rb, HS_SCRIPT + i, 3, argv);
  }
  if (rb->watching)
    sub_connect(rb);
}

static void session_start(redis_backend *rb) {
  if (rb->cluster) {
    rb->state = RB_CONNECTING;
    sx__rcl_start(rb);
    return;
  }
  if (rb->sentinel) {
    rb->state = RB_RESOLVING;
    sx__redis_resolve(rb);
    return;
  }
  snprintf(rb->host, sizeof(rb->host), "%s", rb->base.url.hosts[0].host);
  rb->port = rb->base.url.hosts[0].port;
  sx__redis_master_resolved(rb);
}

void sx__redis_drop(redisAsyncContext **acp) {
  redisAsyncContext *ac = *acp;
  *acp = NULL;
  if (ac != NULL)
    redisAsyncFree(ac);
}

void sx__redis_session_fail(redis_backend *rb, int err, const char *fmt, ...) {
  char detail[720], msg[sizeof(rb->redacted) + sizeof(detail) + 4];
  va_list ap;
  if (rb->state == RB_CLOSED || rb->state == RB_DOWN)
    return;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof(detail), fmt, ap);
  va_end(ap);
  snprintf(msg, sizeof(msg), "%s: %s", rb->redacted, detail);
  /* Detach first: callbacks run below may issue ops, which must now fail
   * fast instead of landing on a dying connection. */
  redisAsyncContext *data = rb->data, *sub = rb->sub, *sres = rb->sres;
  rb->data = rb->sub = rb->sres = NULL;
  rb->state = RB_DOWN;
  uv_timer_stop(&rb->conn_timer);
  snprintf(rb->last_err, sizeof(rb->last_err), "%s", detail);
  sx__redis_fail_all(rb, err, msg);
  if (rb->cluster)
    sx__rcl_drop(rb);
  sx__redis_drop(&data);
  sx__redis_drop(&sub);
  sx__redis_drop(&sres);
  if (rb->state == RB_CLOSED)
    return;
  if (!rb->reported_down) {
    rb->reported_down = 1;
    if (rb->base.hooks.on_conn)
      rb->base.hooks.on_conn(rb->base.hooks.arg, 0, err, msg);
    if (rb->state == RB_CLOSED)
      return;
  }
  sx__redis_arm_conn_timer(rb, sx__redis_backoff(&rb->backoff_ms));
}

static void conn_timer_cb(uv_timer_t *t);

void sx__redis_arm_conn_timer(redis_backend *rb, uint64_t ms) {
  uv_timer_start(&rb->conn_timer, conn_timer_cb, ms, 0);
}

static void conn_timer_cb(uv_timer_t *t) {
  redis_backend *rb = t->data;
  switch (rb->state) {
  case RB_STARTING:
  case RB_DOWN:
    session_start(rb);
    break;
  case RB_RESOLVING:
    sx__redis_sres_timeout(rb);
    break;
  case RB_CONNECTING:
    sx__redis_session_fail(rb, SX_ETIMEDOUT,
                           "connecting to %s:%d: no answer within %u ms (connect_timeout_ms)",
                           rb->host, rb->port, rb->base.url.connect_timeout_ms);
    break;
  default:
    break;
  }
}

int sx__redis_watch(sx_backend *b) {
  redis_backend *rb = (redis_backend *)b;
  if (rb->state == RB_CLOSED)
    return sx__err(SX_ECANCELED, "metadata store is closed");
  if (rb->watching)
    return 0;
  rb->watching = 1;
  if (rb->cluster) {
    sx__rcl_watch(rb);
    return 0;
  }
  /* Connected (or connecting) without events: add the subscription now.
   * Otherwise the next connect includes it. */
  if ((rb->state == RB_READY || rb->state == RB_CONNECTING) && rb->sub == NULL)
    sub_connect(rb);
  return 0;
}

/* ------------------------------------------------------------ open/close */

static void closed_cb(uv_handle_t *h) {
  redis_backend *rb = h->data;
  if (--rb->handles == 0) {
    sx__rcl_free(rb);
    free(rb);
  }
}

void sx__redis_close(sx_backend *b) {
  redis_backend *rb = (redis_backend *)b;
  if (rb->state == RB_CLOSED)
    return;
  redisAsyncContext *data = rb->data, *sub = rb->sub, *sres = rb->sres;
  rb->data = rb->sub = rb->sres = NULL;
  rb->state = RB_CLOSED;
  sx__redis_fail_all(rb, SX_ECANCELED, "metadata store closed");
  sx__redis_drop(&data);
  sx__redis_drop(&sub);
  sx__redis_drop(&sres);
  sx__redis_sentinel_close(rb);
  sx__rcl_drop(rb); /* the state itself goes with rb (closed_cb) */
  uv_close((uv_handle_t *)&rb->cl_timer, closed_cb);
  uv_close((uv_handle_t *)&rb->conn_timer, closed_cb);
  uv_close((uv_handle_t *)&rb->op_timer, closed_cb);
  uv_close((uv_handle_t *)&rb->swatch_timer, closed_cb);
}

int sx__redis_open(uv_loop_t *loop, const sx_url *url, const sx_backend_hooks *hooks,
                      sx_backend **out) {
  if (strcmp(url->scheme, "redis") != 0 && strcmp(url->scheme, "redis+sentinel") != 0 &&
      strcmp(url->scheme, "redis+cluster") != 0)
    return sx__err(SX_EURL, "metadata URL: scheme %s is not redis", url->scheme);
  if (url->n_hosts < 1)
    return sx__err(SX_EURL, "metadata URL: no host");
  redis_backend *rb = calloc(1, sizeof(*rb));
  if (rb == NULL)
    return sx__err(SX_ENOMEM, "redis store: open");
  rb->base.ops = &sx__backend_redis_ops;
  rb->base.loop = loop;
  rb->base.url = *url;
  if (hooks)
    rb->base.hooks = *hooks;
  rb->sentinel = strcmp(url->scheme, "redis+sentinel") == 0;
  rb->cluster = strcmp(url->scheme, "redis+cluster") == 0;
  sx__url_redact(url, rb->redacted, sizeof(rb->redacted));
  snprintf(rb->seg_prefix, sizeof(rb->seg_prefix), "sx:%s:seg:{", url->ns);
  snprintf(rb->fence_prefix, sizeof(rb->fence_prefix), "sx:%s:fence:{", url->ns);
  snprintf(rb->index_key, sizeof(rb->index_key), "sx:%s:index", url->ns);
  snprintf(rb->channel, sizeof(rb->channel), "sx:%s:events", url->ns);
  snprintf(rb->ks_pattern, sizeof(rb->ks_pattern), "__keyspace@%d__:sx:%s:seg:",
           url->db, url->ns);
  rb->ks_prefix_len = strlen(rb->ks_pattern);
  strcat(rb->ks_pattern, "*");
  snprintf(rb->last_err, sizeof(rb->last_err), "not connected yet");
  uv_timer_init(loop, &rb->conn_timer);
  uv_timer_init(loop, &rb->op_timer);
  uv_timer_init(loop, &rb->swatch_timer);
  uv_timer_init(loop, &rb->cl_timer);
  rb->conn_timer.data = rb->op_timer.data = rb->swatch_timer.data = rb->cl_timer.data = rb;
  rb->handles = 4;
  /* Connect from the loop, so hooks never run before open returns; ops
   * issued meanwhile wait for the connection. */
  rb->state = RB_STARTING;
  sx__redis_arm_conn_timer(rb, 0);
  if (rb->sentinel)
    sx__redis_swatch_start(rb);
  *out = &rb->base;
  return 0;
}

