/*
 * The etcd backend's connection state and watch.
 *
 * Connection: HTTP has no connection to lose, so "up" and "down" are what
 * the answers say.  Every request's outcome goes through
 * sx__etcd_conn_note(): a transport failure means down, any answer from
 * etcd means up, and hooks.on_conn hears of each change.  While down, a
 * probe (/v3/maintenance/status) retries with jittered exponential backoff;
 * while watching, the same probe runs as a health check, because a stopped
 * server keeps its sockets open and a silent stream looks like a quiet one.
 *
 * Watch: one streaming POST /v3/watch over the namespace
 * prefix, turned into segment events for hooks.on_event.
 *
 *   PUT own/NAME       -> SX_EVENT_PUT (incarnation, generation from the record)
 *   PUT del/NAME       -> remembered: a tombstone for this revision
 *   DELETE own/NAME    -> SX_EVENT_DELETE if a tombstone came in the same
 *                         revision (unpublish, admin remove), else
 *                         SX_EVENT_EXPIRED (the lease ran out)
 * Everything else (seg/ values, fences, tombstones going away) says nothing
 * a cache needs: the owner record changes in the same revision.
 *
 * The first stream starts after the newest revision any answer carried
 * before watch() was called, so a change made right after watch() returns
 * is delivered even though the stream takes a moment to set up.  A broken
 * stream resumes from the last revision delivered + 1, so no event is lost
 * across a reconnect.  When that cannot work, on_conn(up) is reported again
 * ("resync": caches drop what they hold, agents renew and republish) and:
 *   - the history to resume from was compacted: the watch starts from now;
 *   - etcd came back with less history than we saw (restarted empty, found
 *     by its revision or raft term going back): the watch replays the new
 *     store's history from revision 1, so that what was published since it
 *     came back is not missed.
 */
#include <stdio.h>
#include <string.h>

#include "etcd.h"
#include "internal.h"

/* ---------------------------------------------------------------- connection */

uint32_t sx__etcd_backoff(uint32_t *state) {
  *state = *state == 0 ? 100 : (*state >= 1000 ? 2000 : *state * 2);
  uint32_t r = 0;
  sx__random(&r, sizeof(r));
  return *state / 2 + r % (*state / 2 + 1);
}

static void arm_probe(sx__etcd_backend *eb, uint64_t delay_ms);
static uint64_t health_interval(const sx__etcd_backend *eb);

void sx__etcd_conn_note(sx__etcd_backend *eb, int status, const json_t *body,
                        const char *msg) {
  int down = status == SX_EUNREACH || status == SX_ETIMEDOUT || status == SX_EIO;
  int64_t rev = 0;
  if (eb->closing)
    return;
  if (body != NULL &&
      sx__etcd_i64(json_object_get(body, "header"), "revision", &rev) == 0 &&
      rev > eb->seen_rev)
    eb->seen_rev = rev;
  if (down) {
    /* A stream on a dead or stopped server hangs; it restarts when the
     * store is back. */
    sx__etcd_watch_stop(eb);
    if (eb->up != 0) {
      eb->up = 0;
      arm_probe(eb, sx__etcd_backoff(&eb->backoff_ms));
      if (eb->base.hooks.on_conn)
        eb->base.hooks.on_conn(eb->base.hooks.arg, 0, status, msg);
    }
  } else if (status != SX_ECANCELED && eb->up != 1) {
    eb->up = 1;
    eb->backoff_ms = 0;
    if (eb->base.hooks.on_conn)
      eb->base.hooks.on_conn(eb->base.hooks.arg, 1, 0, NULL);
    if (!eb->closing && eb->watching) {
      sx__etcd_watch_kick(eb);
      arm_probe(eb, health_interval(eb));
    }
  }
}

/* Health check while watching (a stopped server keeps its sockets open and
 * the stream silent) and reconnection while down. */
static uint64_t health_interval(const sx__etcd_backend *eb) {
  uint32_t t = eb->base.url.timeout_ms;
  return t < 1000 ? 1000 : (t > 5000 ? 5000 : t);
}

static void probe_done(void *arg, int status, json_t *body, const char *msg) {
  sx__etcd_backend *eb = arg;
  char text[300];
  eb->probe = NULL;
  /* Member IDs are uint64 (often above INT64_MAX): only "absent or 0" says
   * that there is no leader. */
  const json_t *leader = json_object_get(body, "leader");
  if (status == 0 &&
      (leader == NULL ||
       (json_is_string(leader) && strcmp(json_string_value(leader), "0") == 0) ||
       (json_is_integer(leader) && json_integer_value(leader) == 0))) {
    sx__etcd_say(text, sizeof(text), "etcd %s has no leader",
                 sx__etcd_endpoint(eb->http));
    status = SX_EUNREACH;
    msg = text;
  }
  int was = eb->up;
  sx__etcd_conn_note(eb, status, body, msg);
  if (eb->closing)
    return;
  if (eb->up == 0 && was == 0)
    arm_probe(eb, sx__etcd_backoff(&eb->backoff_ms));
  else if (eb->up == 1 && eb->watching)
    arm_probe(eb, health_interval(eb));
}

static void probe_fire(uv_timer_t *t) {
  sx__etcd_backend *eb = t->data;
  if (eb->closing || eb->probe)
    return;
  json_t *req = json_object();
  int rc = req ? sx__etcd_post(eb->http, "/v3/maintenance/status", req, probe_done, eb,
                               &eb->probe)
               : SX_ENOMEM;
  json_decref(req);
  if (rc != 0)
    arm_probe(eb, 1000);
}

static void arm_probe(sx__etcd_backend *eb, uint64_t delay_ms) {
  if (!eb->closing && eb->probe == NULL)
    uv_timer_start(&eb->probe_timer, probe_fire, delay_ms, 0);
}

/* The ops table's watch(): health checks run from now on. */
int sx__etcd_watch_op(sx_backend *b) {
  sx__etcd_backend *eb = (sx__etcd_backend *)b;
  if (eb->closing)
    return sx__err(SX_ECANCELED, "etcd: the store is closing");
  if (eb->watching)
    return 0;
  eb->watching = 1;
  /* Every change from now on has a revision above the newest one seen: the
   * stream starts there, so changes made before it is set up still arrive. */
  eb->watch_rev = eb->seen_rev;
  eb->watch_now = eb->seen_rev == 0;
  if (eb->up == 1) {
    sx__etcd_watch_kick(eb);
    arm_probe(eb, health_interval(eb));
  }
  return 0;
}

void sx__etcd_conn_start(sx__etcd_backend *eb) { arm_probe(eb, 0); }

/* ---------------------------------------------------------------- watch */

/* What watch_msg() returns to end the stream for a resync (above); it never
 * leaves this file. */
#define RESYNC SX_ESTALE

static void watch_restart_fire(uv_timer_t *t) { sx__etcd_watch_kick(t->data); }

static int transport_error(int status) {
  return status == SX_EUNREACH || status == SX_ETIMEDOUT || status == SX_EIO;
}

static void watch_done(void *arg, int status, json_t *body, const char *msg) {
  sx__etcd_backend *eb = arg;
  (void)body;
  eb->watch = NULL;
  eb->watch_created = 0;
  uv_timer_stop(&eb->watch_timer);
  if (eb->closing)
    return;
  if (status == RESYNC) {
    /* Whatever was cached may have missed changes.  The first resync
     * restarts at once; a server that keeps asking for them is slowed down
     * by the backoff, which only a stream that delivers events resets. */
    if (eb->base.hooks.on_conn)
      eb->base.hooks.on_conn(eb->base.hooks.arg, 1, 0, NULL);
    if (eb->closing)
      return;
    uint32_t delay = eb->watch_backoff_ms ? sx__etcd_backoff(&eb->watch_backoff_ms) : 0;
    if (delay == 0)
      sx__etcd_backoff(&eb->watch_backoff_ms);
    uv_timer_start(&eb->watch_timer, watch_restart_fire, delay, 0);
  } else if (transport_error(status)) {
    /* Down: the probe brings the watch back with the connection. */
    sx__etcd_conn_note(eb, status, NULL, msg);
  } else {
    /* etcd answered, but not with a usable stream: try again later. */
    uv_timer_start(&eb->watch_timer, watch_restart_fire,
                   sx__etcd_backoff(&eb->watch_backoff_ms), 0);
  }
}

static void watch_deadline(uv_timer_t *t) {
  sx__etcd_backend *eb = t->data;
  char msg[200];
  if (eb->watch == NULL || eb->watch_created)
    return;
  sx__etcd_cancel(eb->watch);
  eb->watch = NULL;
  sx__etcd_say(msg, sizeof(msg), "etcd %s: the watch was not set up within %u ms",
               sx__etcd_endpoint(eb->http),
               eb->base.url.connect_timeout_ms + eb->base.url.timeout_ms);
  sx__etcd_conn_note(eb, SX_ETIMEDOUT, NULL, msg);
}

/* Deliver one event; 0, or non-zero if the backend was closed meanwhile. */
static int deliver(sx__etcd_backend *eb, sx_event_kind kind, const char *name,
                   const sx__etcd_owner *who) {
  sx_event ev;
  memset(&ev, 0, sizeof(ev));
  ev.kind = kind;
  snprintf(ev.name, sizeof(ev.name), "%s", name);
  if (who != NULL) {
    memcpy(ev.incarnation, who->inc, SX_INCARNATION_LEN);
    ev.generation = who->gen;
  }
  if (eb->base.hooks.on_event)
    eb->base.hooks.on_event(eb->base.hooks.arg, &ev);
  return eb->closing;
}

/* One event of a watch answer. */
static int on_one(sx__etcd_backend *eb, const json_t *ev, int64_t *max_rev, char *err,
                  size_t err_size) {
  const json_t *type = json_object_get(ev, "type");
  int is_delete = json_is_string(type) && strcmp(json_string_value(type), "DELETE") == 0;
  if (type != NULL && !is_delete &&
      !(json_is_string(type) && strcmp(json_string_value(type), "PUT") == 0)) {
    sx__etcd_say(err, err_size, "etcd %s: watch: unknown event type",
                 sx__etcd_endpoint(eb->http));
    return SX_EPROTO;
  }
  sx__etcd_kv kv;
  char why[200];
  int rc = sx__etcd_kv_parse(json_object_get(ev, "kv"), &kv, why, sizeof(why));
  if (rc != 0) {
    sx__etcd_say(err, err_size, "etcd %s: watch: %s", sx__etcd_endpoint(eb->http), why);
    return rc;
  }
  if (kv.mod_rev > *max_rev)
    *max_rev = kv.mod_rev;
  size_t plen = strlen(eb->prefix);
  const char *kind = NULL, *name = NULL;
  if (kv.key_len > plen && memcmp(kv.key, eb->prefix, plen) == 0 &&
      strlen((char *)kv.key) == kv.key_len) {
    const char *rest = (const char *)kv.key + plen;
    if (strncmp(rest, "own/", 4) == 0)
      kind = "own", name = rest + 4;
    else if (strncmp(rest, "del/", 4) == 0)
      kind = "del", name = rest + 4;
  }
  int closed = 0;
  if (kind == NULL || *name == '\0' || strlen(name) > SX_NAME_MAX) {
    /* Not ours to announce. */
  } else if (kind[0] == 'd') {
    if (!is_delete) {
      if (kv.mod_rev != eb->tomb_rev) {
        eb->tomb_rev = kv.mod_rev;
        eb->n_tombs = 0;
      }
      sx__etcd_owner who;
      if (eb->n_tombs < (int)SX__ARRAY_SIZE(eb->tombs) &&
          sx__etcd_owner_parse(kv.value, kv.value_len, &who) == 0) {
        snprintf(eb->tombs[eb->n_tombs].name, sizeof(eb->tombs[0].name), "%s", name);
        eb->tombs[eb->n_tombs++].who = who;
      }
    }
  } else if (!is_delete) {
    sx__etcd_owner who;
    int ok = sx__etcd_owner_parse(kv.value, kv.value_len, &who) == 0;
    closed = deliver(eb, SX_EVENT_PUT, name, ok ? &who : NULL);
  } else {
    const sx__etcd_owner *who = NULL;
    for (int i = 0; kv.mod_rev == eb->tomb_rev && i < eb->n_tombs; i++)
      if (strcmp(eb->tombs[i].name, name) == 0)
        who = &eb->tombs[i].who;
    closed = deliver(eb, who ? SX_EVENT_DELETE : SX_EVENT_EXPIRED, name, who);
  }
  sx__etcd_kv_free(&kv);
  return closed ? SX_ECANCELED : 0;
}

static int watch_msg(void *arg, json_t *msg, char *err, size_t err_size) {
  sx__etcd_backend *eb = arg;
  const json_t *header = json_object_get(msg, "header");
  int64_t rev = 0, term = 0, compact = 0;
  if (sx__etcd_i64(header, "revision", &rev) != 0 ||
      sx__etcd_i64(header, "raft_term", &term) != 0 ||
      sx__etcd_i64(msg, "compact_revision", &compact) != 0) {
    sx__etcd_say(err, err_size, "etcd %s: watch: %s", sx__etcd_endpoint(eb->http),
                 sx_errmsg());
    return SX_EPROTO;
  }
  if (json_is_true(json_object_get(msg, "canceled"))) {
    if (compact > 0) {
      /* The revision to resume from is gone: start over from now. */
      eb->watch_now = 1;
      sx__etcd_say(err, err_size, "etcd %s: watch: history compacted at revision %lld",
                   sx__etcd_endpoint(eb->http), (long long)compact);
      return RESYNC;
    }
    const json_t *why = json_object_get(msg, "cancel_reason");
    sx__etcd_say(err, err_size, "etcd %s: watch canceled: %.120s",
                 sx__etcd_endpoint(eb->http),
                 json_is_string(why) ? json_string_value(why) : "no reason given");
    return SX_ESTORE;
  }
  if (json_is_true(json_object_get(msg, "created"))) {
    if ((eb->watch_rev > 0 && rev < eb->watch_rev) || term < eb->watch_term) {
      /* etcd has less history than we have seen: it lost its data. */
      sx__etcd_say(err, err_size,
                   "etcd %s: store revision %lld (term %lld) is behind %lld "
                   "(term %lld): the store was reset",
                   sx__etcd_endpoint(eb->http), (long long)rev, (long long)term,
                   (long long)eb->watch_rev, (long long)eb->watch_term);
      eb->watch_rev = 0;
      eb->watch_term = 0;
      return RESYNC;
    }
    eb->watch_term = term;
    eb->watch_created = 1;
    uv_timer_stop(&eb->watch_timer);
    if (eb->watch_now)
      eb->watch_rev = rev;
    eb->watch_now = 0;
    if (eb->base.hooks.on_watch)
      eb->base.hooks.on_watch(eb->base.hooks.arg);
  }
  const json_t *events = json_object_get(msg, "events");
  if (events != NULL && !json_is_array(events)) {
    sx__etcd_say(err, err_size, "etcd %s: watch: events is not an array",
                 sx__etcd_endpoint(eb->http));
    return SX_EPROTO;
  }
  int64_t max_rev = 0;
  if (json_array_size(events) > 0)
    eb->watch_backoff_ms = 0; /* a working stream */
  for (size_t i = 0; i < json_array_size(events); i++) {
    int rc = on_one(eb, json_array_get(events, i), &max_rev, err, err_size);
    if (rc != 0)
      return rc;
  }
  /* A fragment may stop in the middle of its last revision: resume from
   * that revision again rather than after it. */
  if (max_rev > 0) {
    int64_t done = json_is_true(json_object_get(msg, "fragment")) ? max_rev - 1 : max_rev;
    if (done > eb->watch_rev)
      eb->watch_rev = done;
  }
  return 0;
}

void sx__etcd_watch_kick(sx__etcd_backend *eb) {
  if (!eb->watching || eb->watch != NULL || eb->closing || eb->up != 1)
    return;
  uv_timer_stop(&eb->watch_timer);
  char from[SX_ETCD_KEY_MAX], to[SX_ETCD_KEY_MAX];
  size_t n = strlen(eb->prefix);
  memcpy(from, eb->prefix, n + 1);
  memcpy(to, eb->prefix, n + 1);
  to[n - 1]++; /* "/segxfer/NS0": the end of the "/segxfer/NS/" range */
  json_t *c = json_object();
  int bad = c == NULL;
  bad |= json_object_set_new(c, "key", sx__etcd_b64(from, n)) != 0;
  bad |= json_object_set_new(c, "range_end", sx__etcd_b64(to, n)) != 0;
  bad |= json_object_set_new(c, "fragment", json_true()) != 0;
  if (!eb->watch_now)
    bad |= json_object_set_new(c, "start_revision",
                               sx__etcd_i64_json(eb->watch_rev + 1)) != 0;
  json_t *req = json_object();
  bad |= req == NULL || json_object_set_new(req, "create_request", json_incref(c)) != 0;
  int rc = bad ? SX_ENOMEM
               : sx__etcd_stream(eb->http, "/v3/watch", req, watch_msg, watch_done, eb,
                                 &eb->watch);
  json_decref(c);
  json_decref(req);
  eb->watch_created = 0;
  if (rc != 0) {
    uv_timer_start(&eb->watch_timer, watch_restart_fire,
                   sx__etcd_backoff(&eb->watch_backoff_ms), 0);
    return;
  }
  uv_timer_start(&eb->watch_timer, watch_deadline,
                 (uint64_t)eb->base.url.connect_timeout_ms + eb->base.url.timeout_ms, 0);
}

void sx__etcd_watch_stop(sx__etcd_backend *eb) {
  sx__etcd_cancel(eb->watch);
  eb->watch = NULL;
  eb->watch_created = 0;
  if (!eb->closing)
    uv_timer_stop(&eb->watch_timer);
}
