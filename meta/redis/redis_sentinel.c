/*
 * redis+sentinel://: find the master through the sentinels and follow
 * failovers.
 *
 * Resolution asks one sentinel at a time (SENTINEL get-master-addr-by-name),
 * starting with the one that answered last, each within connect_timeout_ms;
 * the first usable answer wins.  The backend then connects to that address
 * and checks with ROLE that it really is a master (a sentinel may answer
 * with stale data during a failover).  The session re-resolves whenever it
 * reconnects: after a disconnect, a -READONLY reply, or a +switch-master
 * message, which a separate connection to one sentinel listens for.
 *
 * Sentinels have credentials of their own (their requirepass or ACL users,
 * separate from the master's): with sentinel_password (and sentinel_user) in
 * the URL, both connections to a sentinel send AUTH [user] password first,
 * pipelined before their command.  A refused AUTH (WRONGPASS), or a sentinel
 * that wants one when none is set (NOAUTH) or denies the command (NOPERM),
 * fails that sentinel like any other failure, and the next one is asked; when
 * none answered, the session fails with SX_EAUTH if any of them refused us so
 * (a wrong password is not fixed by retrying).  Error texts are scrubbed of
 * the sentinel password.  Without sentinel_password nothing is sent first.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "redis.h"

static void sres_attempt(redis_backend *rb);

static const sx_url_host *sres_host(redis_backend *rb) {
  return &rb->base.url.hosts[rb->sres_next % rb->base.url.n_hosts];
}

/* The sentinel being asked failed: remember why (auth: also as the round's
 * authentication failure), try the next one. */
static void sres_vfailed(redis_backend *rb, int auth, const char *fmt, va_list ap) {
  const sx_url_host *h = sres_host(rb);
  int o = snprintf(rb->sres_err, sizeof(rb->sres_err), "sentinel %s:%u: ", h->host, h->port);
  if (o > 0 && (size_t)o < sizeof(rb->sres_err))
    vsnprintf(rb->sres_err + o, sizeof(rb->sres_err) - (size_t)o, fmt, ap);
  if (auth)
    memcpy(rb->sres_auth_err, rb->sres_err, sizeof(rb->sres_auth_err));
  sx__redis_drop(&rb->sres);
  rb->sres_next = (rb->sres_next + 1) % rb->base.url.n_hosts;
  sres_attempt(rb);
}

static void sres_failed(redis_backend *rb, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void sres_failed(redis_backend *rb, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  sres_vfailed(rb, 0, fmt, ap);
  va_end(ap);
}

static void sres_auth_failed(redis_backend *rb, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void sres_auth_failed(redis_backend *rb, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  sres_vfailed(rb, 1, fmt, ap);
  va_end(ap);
}

/* An error reply's text, printable and without the sentinel password. */
static void sentinel_error_text(const redis_backend *rb, const redisReply *r, char *buf,
                                size_t size) {
  sx__redis_scrub(buf, size, r->str, r->len,
                  rb->base.url.has_sentinel_password ? rb->base.url.sentinel_password
                                                     : NULL);
}

/* AUTH [sentinel_user] sentinel_password; its argument count. */
static int sentinel_auth_argv(const redis_backend *rb, const char **argv) {
  int n = 0;
  argv[n++] = "AUTH";
  if (rb->base.url.sentinel_user[0])
    argv[n++] = rb->base.url.sentinel_user;
  argv[n++] = rb->base.url.sentinel_password;
  return n;
}

/* The backend a resolver reply is for, or NULL when the reply is for an old
 * resolver connection, or when there is no reply (the connection went: the
 * next sentinel is asked). */
static redis_backend *sres_reply_of(redisAsyncContext *ac, const redisReply *r) {
  redis_backend *rb = ac->data;
  if (ac != rb->sres)
    return NULL;
  if (r == NULL) {
    rb->sres = NULL;
    sres_failed(rb, "connection lost: %s", ac->errstr);
    return NULL;
  }
  return rb;
}

static void sres_auth_reply(redisAsyncContext *ac, void *reply, void *priv) {
  redisReply *r = reply;
  redis_backend *rb = sres_reply_of(ac, r);
  char text[160];
  (void)priv;
  if (rb == NULL)
    return;
  if (r->type == REDIS_REPLY_ERROR) {
    sentinel_error_text(rb, r, text, sizeof(text));
    sres_auth_failed(rb, "AUTH%s%s%s refused: %s; check sentinel_user and "
                     "sentinel_password in the URL", rb->base.url.sentinel_user[0] ? " as '" : "",
                     rb->base.url.sentinel_user, rb->base.url.sentinel_user[0] ? "'" : "",
                     text);
  }
  /* +OK: the SENTINEL command queued behind it answers next. */
}

static void sres_reply(redisAsyncContext *ac, void *reply, void *priv) {
  redisReply *r = reply;
  redis_backend *rb = sres_reply_of(ac, r);
  (void)priv;
  if (rb == NULL)
    return;
  if (r->type == REDIS_REPLY_NIL) {
    sres_failed(rb, "does not know master '%s'", rb->base.url.master);
    return;
  }
  if (r->type == REDIS_REPLY_ERROR && sx__redis_map_error(r) == SX_EAUTH) {
    char text[160];
    sentinel_error_text(rb, r, text, sizeof(text));
    if (sx__redis_is_error(r, "NOAUTH"))
      sres_auth_failed(rb, "requires AUTH (%s); set sentinel_password (and "
                       "sentinel_user) in the URL", text);
    else
      sres_auth_failed(rb, "refused SENTINEL get-master-addr-by-name (%s); check "
                       "sentinel_user's permissions", text);
    return;
  }
  if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 ||
      r->element[0]->type != REDIS_REPLY_STRING ||
      r->element[1]->type != REDIS_REPLY_STRING || r->element[0]->len == 0 ||
      r->element[0]->len >= sizeof(rb->host) || r->element[1]->len > 5) {
    char desc[160];
    sx__redis_describe(r, desc, sizeof(desc));
    sres_failed(rb, "unexpected answer %s", desc);
    return;
  }
  char *end;
  long port = strtol(r->element[1]->str, &end, 10);
  if (*end != '\0' || port < 1 || port > 65535) {
    sres_failed(rb, "answered a bad port");
    return;
  }
  memcpy(rb->host, r->element[0]->str, r->element[0]->len);
  rb->host[r->element[0]->len] = '\0';
  rb->port = (int)port;
  /* Done with this sentinel; hiredis frees the context after this callback. */
  sx__redis_drop(&rb->sres);
  sx__redis_master_resolved(rb);
}

static void sres_on_connect(const redisAsyncContext *cac, int status) {
  redisAsyncContext *ac = (redisAsyncContext *)cac;
  redis_backend *rb = ac->data;
  if (ac != rb->sres || status == REDIS_OK)
    return;
  rb->sres = NULL; /* hiredis frees it */
  sres_failed(rb, "cannot connect: %s", ac->errstr);
}

static void sres_on_disconnect(const redisAsyncContext *cac, int status) {
  redisAsyncContext *ac = (redisAsyncContext *)cac;
  redis_backend *rb = ac->data;
  (void)status;
  if (ac != rb->sres)
    return;
  rb->sres = NULL;
  sres_failed(rb, "connection lost: %s", ac->errstr);
}

static void sres_attempt(redis_backend *rb) {
  char err[160];
  if (rb->state != RB_RESOLVING)
    return;
  if (rb->sres_tried >= rb->base.url.n_hosts) {
    /* A sentinel that refused us is the thing to fix: say so first. */
    if (rb->sres_auth_err[0] && strcmp(rb->sres_auth_err, rb->sres_err) != 0)
      sx__redis_session_fail(rb, SX_EAUTH, "no sentinel gave the address of master "
                             "'%s' (%s; last: %s)", rb->base.url.master,
                             rb->sres_auth_err, rb->sres_err);
    else
      sx__redis_session_fail(rb, rb->sres_auth_err[0] ? SX_EAUTH : SX_EUNREACH,
                             "no sentinel gave the address of master '%s' (%s%s)",
                             rb->base.url.master, rb->sres_auth_err[0] ? "" : "last: ",
                             rb->sres_err);
    return;
  }
  rb->sres_tried++;
  const sx_url_host *h = sres_host(rb);
  sx__redis_arm_conn_timer(rb, rb->base.url.connect_timeout_ms);
  rb->sres = sx__redis_connect(rb->base.loop, h->host, h->port, rb, sres_on_connect,
                               sres_on_disconnect, err, sizeof(err));
  if (rb->sres == NULL) {
    sres_failed(rb, "cannot connect: %s", err);
    return;
  }
  if (rb->base.url.has_sentinel_password) {
    const char *auth[3];
    int n = sentinel_auth_argv(rb, auth);
    redisAsyncCommandArgv(rb->sres, sres_auth_reply, NULL, n, auth, NULL);
  }
  const char *argv[] = {"SENTINEL", "get-master-addr-by-name", rb->base.url.master};
  redisAsyncCommandArgv(rb->sres, sres_reply, NULL, 3, argv, NULL);
}

void sx__redis_resolve(redis_backend *rb) {
  rb->sres_tried = 0;
  rb->sres_auth_err[0] = '\0';
  sres_attempt(rb);
}

void sx__redis_sres_timeout(redis_backend *rb) {
  sres_failed(rb, "no answer within %u ms (connect_timeout_ms)",
              rb->base.url.connect_timeout_ms);
}

/* ---------------------------------------------------- +switch-master */

static void swatch_timer_cb(uv_timer_t *t);

static void swatch_retry(redis_backend *rb) {
  sx__redis_drop(&rb->swatch);
  rb->swatch_next = (rb->swatch_next + 1) % rb->base.url.n_hosts;
  if (rb->state != RB_CLOSED)
    uv_timer_start(&rb->swatch_timer, swatch_timer_cb, SX_REDIS_BACKOFF_MAX_MS, 0);
}

/* The backend a watch reply is for, or NULL when the reply is for an old
 * watch connection, or when there is no reply (the connection went: the
 * watch moves on to the next sentinel). */
static redis_backend *swatch_reply_of(redisAsyncContext *ac, const redisReply *r) {
  redis_backend *rb = ac->data;
  if (ac != rb->swatch)
    return NULL;
  if (r == NULL) {
    rb->swatch = NULL;
    swatch_retry(rb);
    return NULL;
  }
  return rb;
}

static void swatch_msg(redisAsyncContext *ac, void *reply, void *priv) {
  redisReply *r = reply;
  redis_backend *rb = swatch_reply_of(ac, r);
  (void)priv;
  if (rb == NULL)
    return;
  if (r->type != REDIS_REPLY_ARRAY || r->elements != 3 ||
      r->element[0]->type != REDIS_REPLY_STRING)
    return;
  /* The confirmation is ["subscribe", channel, count]: its third element is
   * an integer, so it is recognised before messages' string check. */
  if (strcmp(r->element[0]->str, "subscribe") == 0) {
    uv_timer_stop(&rb->swatch_timer); /* subscribed: no deadline any more */
    return;
  }
  if (strcmp(r->element[0]->str, "message") != 0 ||
      r->element[2]->type != REDIS_REPLY_STRING || r->element[2]->len > 600)
    return;
  /* "<master-name> <old-ip> <old-port> <new-ip> <new-port>" */
  char name[128], oldip[256], newip[256];
  int oldport, newport;
  if (sscanf(r->element[2]->str, "%127s %255s %d %255s %d", name, oldip, &oldport, newip,
             &newport) != 5 ||
      strcmp(name, rb->base.url.master) != 0)
    return;
  if ((rb->state == RB_READY || rb->state == RB_CONNECTING) &&
      (strcmp(newip, rb->host) != 0 || newport != rb->port))
    sx__redis_session_fail(rb, SX_EUNREACH, "sentinel: master '%s' moved from %s:%d to "
                           "%s:%d; reconnecting", name, rb->host, rb->port, newip, newport);
}

/* AUTH on the watch connection: refused, try the next sentinel (the
 * resolver, asking the same sentinels, reports why). */
static void swatch_auth_reply(redisAsyncContext *ac, void *reply, void *priv) {
  redisReply *r = reply;
  redis_backend *rb = swatch_reply_of(ac, r);
  (void)priv;
  if (rb != NULL && r->type == REDIS_REPLY_ERROR)
    swatch_retry(rb);
}

static void swatch_on_connect(const redisAsyncContext *cac, int status) {
  redisAsyncContext *ac = (redisAsyncContext *)cac;
  redis_backend *rb = ac->data;
  if (ac != rb->swatch || status == REDIS_OK)
    return;
  rb->swatch = NULL;
  swatch_retry(rb);
}

static void swatch_on_disconnect(const redisAsyncContext *cac, int status) {
  redisAsyncContext *ac = (redisAsyncContext *)cac;
  redis_backend *rb = ac->data;
  (void)status;
  if (ac != rb->swatch)
    return;
  rb->swatch = NULL;
  swatch_retry(rb);
}

static void swatch_timer_cb(uv_timer_t *t) {
  redis_backend *rb = t->data;
  char err[160];
  if (rb->state == RB_CLOSED)
    return;
  if (rb->swatch != NULL) {
    /* Connected but not subscribed in time: try another sentinel. */
    swatch_retry(rb);
    return;
  }
  const sx_url_host *h = &rb->base.url.hosts[rb->swatch_next % rb->base.url.n_hosts];
  rb->swatch = sx__redis_connect(rb->base.loop, h->host, h->port, rb, swatch_on_connect,
                                 swatch_on_disconnect, err, sizeof(err));
  if (rb->swatch == NULL) {
    swatch_retry(rb);
    return;
  }
  if (rb->base.url.has_sentinel_password) {
    const char *auth[3];
    int n = sentinel_auth_argv(rb, auth);
    redisAsyncCommandArgv(rb->swatch, swatch_auth_reply, NULL, n, auth, NULL);
  }
  const char *argv[] = {"SUBSCRIBE", "+switch-master"};
  redisAsyncCommandArgv(rb->swatch, swatch_msg, NULL, 2, argv, NULL);
  uv_timer_start(&rb->swatch_timer, swatch_timer_cb, rb->base.url.connect_timeout_ms, 0);
}

void sx__redis_swatch_start(redis_backend *rb) {
  uv_timer_start(&rb->swatch_timer, swatch_timer_cb, 0, 0);
}

void sx__redis_sentinel_close(redis_backend *rb) {
  sx__redis_drop(&rb->sres);
  sx__redis_drop(&rb->swatch);
}
