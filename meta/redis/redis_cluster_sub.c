/*
 * redis+cluster:// events (see redis_cluster.c for the whole client): every
 * master's second connection subscribes to its keyspace notifications and,
 * with SSUBSCRIBE, to the shard channels whose slot it owns; a channel whose
 * slot moves is subscribed again at its new master after the next map
 * refresh, and on_watch is reported again.  Also the names of the shard
 * keys and channels.
 *
 * hiredis 0.14 knows SUBSCRIBE and PSUBSCRIBE but not SSUBSCRIBE: it hands
 * pushes to the callback it registered for the channel's name under
 * SUBSCRIBE, and aborts on a push in a connection it does not think is
 * subscribed.  So each shard channel is subscribed with SUBSCRIBE too (no
 * one publishes on it with PUBLISH), which registers the callback that
 * its smessage and ssubscribe pushes then find.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "redis_cluster.h"

/* ------------------------------------------------------------- shards */

unsigned sx__rcl_shard_of(const char *name) {
  return sx__rcl_crc16(name, strlen(name)) % SX_RCL_SHARDS;
}

void sx__rcl_index_key(const redis_backend *rb, unsigned shard, char *dst, size_t size) {
  snprintf(dst, size, "%s:{%u}", rb->index_key, shard);
}

void sx__rcl_channel(const redis_backend *rb, unsigned shard, char *dst, size_t size) {
  snprintf(dst, size, "%s:{%u}", rb->channel, shard);
}

unsigned sx__rcl_channel_slot(const redis_backend *rb, unsigned k) {
  char ch[SX_NS_MAX + 32];
  sx__rcl_channel(rb, k, ch, sizeof(ch));
  return sx__rcl_key_slot(ch, strlen(ch));
}

/* ------------------------------------------------------------- events */

void sx__rcl_watch_check(redis_backend *rb) {
  sx_rcl *cl = rb->cl;
  if (!rb->watching || rb->state != RB_READY || cl->watch_told)
    return;
  for (int k = 0; k < SX_RCL_SHARDS; k++)
    if (cl->chan_node[k] < 0)
      return;
  for (int i = 0; i < RCL_MAX_NODES; i++) {
    const rcl_node *n = &cl->nodes[i];
    if (n->master && (n->sub == NULL || n->sub_left > 0))
      return;
  }
  cl->watch_told = 1;
  if (rb->base.hooks.on_watch)
    rb->base.hooks.on_watch(rb->base.hooks.arg);
}

static int channel_shard(const redis_backend *rb, const redisReply *ch) {
  char name[SX_NS_MAX + 32];
  if (ch->type != REDIS_REPLY_STRING)
    return -1;
  for (unsigned k = 0; k < SX_RCL_SHARDS; k++) {
    sx__rcl_channel(rb, k, name, sizeof(name));
    if (ch->len == strlen(name) && memcmp(ch->str, name, ch->len) == 0)
      return (int)k;
  }
  return -1;
}

static void sub_lost(rcl_node *n, const char *why) {
  redis_backend *rb = n->rb;
  sx_rcl *cl = rb->cl;
  int idx = sx__rcl_node_index(cl, n);
  n->sub = NULL;
  n->sub_left = 0;
  cl->watch_told = 0;
  for (int k = 0; k < SX_RCL_SHARDS; k++)
    if (cl->chan_node[k] == idx)
      cl->chan_node[k] = -1;
  if (rb->state == RB_CONNECTING) {
    sx__redis_session_fail(rb, SX_EUNREACH, "cluster node %s:%d (events): %s", n->host,
                           n->port, why[0] ? why : "connection closed");
    return;
  }
  sx__rcl_refresh(rb, sx__redis_backoff(&cl->backoff_ms));
}

static void sub_cb(redisAsyncContext *ac, void *reply, void *priv) {
  rcl_node *n = ac->data;
  redis_backend *rb = n->rb;
  redisReply *r = reply;
  (void)priv;
  if (ac != n->sub)
    return;
  if (r == NULL) {
    sub_lost(n, ac->errstr);
    return;
  }
  if (r->type == REDIS_REPLY_ERROR) {
    char text[200], host[256];
    int ask, port;
    unsigned slot;
    sx__redis_scrub(text, sizeof(text), r->str, r->len, rb->base.url.password);
    if (sx__rcl_parse_redirect(r, &ask, &slot, host, sizeof(host), &port) == 0) {
      /* A shard channel subscribed at a node that no longer owns it.  Its
       * confirmation will not come; a node that answers more than it was
       * asked must not drive the count below zero (the watch would then
       * never be told ready). */
      if (n->sub_left > 0)
        n->sub_left--;
      for (unsigned k = 0; k < SX_RCL_SHARDS; k++)
        if (sx__rcl_channel_slot(rb, k) == slot && rb->cl->chan_node[k] == sx__rcl_node_index(rb->cl, n))
          rb->cl->chan_node[k] = -1;
      sx__rcl_refresh(rb, 0);
      return;
    }
    if (sx__redis_map_error(r) == SX_EAUTH && !sx__redis_is_error(r, "NOPERM")) {
      sx__redis_auth_fail(rb, r);
      return;
    }
    sx__redis_session_fail(rb, sx__redis_map_error(r), "subscribing to events on %s:%d "
                           "failed: %s (a watching user needs +psubscribe, +ssubscribe "
                           "and the channels sx:NS:events:* and __keyspace@0__:*)",
                           n->host, n->port, text);
    return;
  }
  if (r->type != REDIS_REPLY_ARRAY || r->elements < 3 ||
      r->element[0]->type != REDIS_REPLY_STRING)
    return;
  const char *kind = r->element[0]->str;
  if (strcmp(kind, "subscribe") == 0 || strcmp(kind, "psubscribe") == 0 ||
      strcmp(kind, "ssubscribe") == 0) {
    if (n->sub_left > 0 && --n->sub_left == 0) {
      sx__rcl_check_ready(rb);
      sx__rcl_watch_check(rb);
    }
  } else if ((strcmp(kind, "smessage") == 0 || strcmp(kind, "message") == 0) &&
             r->elements == 3) {
    sx__redis_deliver_event(rb, r->element[2]);
  } else if (strcmp(kind, "pmessage") == 0 && r->elements == 4) {
    sx__redis_deliver_expiry(rb, r->element[2], r->element[3]);
  } else if (strcmp(kind, "sunsubscribe") == 0) {
    /* The channel's slot left this node (resharding, failover). */
    int k = channel_shard(rb, r->element[1]);
    if (k >= 0 && rb->cl->chan_node[k] == sx__rcl_node_index(rb->cl, n)) {
      rb->cl->chan_node[k] = -1;
      rb->cl->watch_told = 0;
      sx__rcl_refresh(rb, 0);
    }
  }
}

static void sub_on_connect(const redisAsyncContext *cac, int status) {
  redisAsyncContext *ac = (redisAsyncContext *)cac;
  rcl_node *n = ac->data;
  if (ac != n->sub || status == REDIS_OK)
    return;
  sub_lost(n, ac->errstr);
}

static void sub_on_disconnect(const redisAsyncContext *cac, int status) {
  redisAsyncContext *ac = (redisAsyncContext *)cac;
  rcl_node *n = ac->data;
  (void)status;
  if (ac == n->sub)
    sub_lost(n, ac->errstr);
}

static void subscribe_channel(rcl_node *n, unsigned k) {
  redis_backend *rb = n->rb;
  char ch[SX_NS_MAX + 32];
  sx__rcl_channel(rb, k, ch, sizeof(ch));
  const char *s[] = {"SUBSCRIBE", ch};
  const char *ss[] = {"SSUBSCRIBE", ch};
  /* SUBSCRIBE first: see the top of the file. */
  redisAsyncCommandArgv(n->sub, sub_cb, NULL, 2, s, NULL);
  redisAsyncCommandArgv(n->sub, sub_cb, NULL, 2, ss, NULL);
  n->sub_left += 2;
  rb->cl->chan_node[k] = (int16_t)sx__rcl_node_index(rb->cl, n);
}

void sx__rcl_sub_connect(rcl_node *n) {
  redis_backend *rb = n->rb;
  char err[160];
  n->sub = sx__redis_connect(rb->base.loop, n->host, n->port, n, sub_on_connect,
                             sub_on_disconnect, err, sizeof(err));
  if (n->sub == NULL) {
    sub_lost(n, err);
    return;
  }
  rb->cl->watch_told = 0;
  n->sub_left = 0;
  if (rb->base.url.has_password) {
    const char *argv[3];
    int argc = sx__redis_auth_argv(rb, argv);
    redisAsyncCommandArgv(n->sub, sub_cb, NULL, argc, argv, NULL);
  }
  /* Expiry is announced by the node that held the key: every master. */
  const char *p[] = {"PSUBSCRIBE", rb->ks_pattern};
  redisAsyncCommandArgv(n->sub, sub_cb, NULL, 2, p, NULL);
  n->sub_left++;
}

/* Subscribe every shard channel at its slot's master, where it is not. */
void sx__rcl_resubscribe(redis_backend *rb) {
  sx_rcl *cl = rb->cl;
  for (unsigned k = 0; k < SX_RCL_SHARDS; k++) {
    int owner = cl->slot_node[sx__rcl_channel_slot(rb, k)];
    if (owner < 0 || cl->chan_node[k] == owner)
      continue;
    rcl_node *n = &cl->nodes[owner];
    if (n->sub == NULL)
      sx__rcl_sub_connect(n);
    if (n->sub == NULL)
      continue;
    cl->watch_told = 0;
    subscribe_channel(n, k);
  }
  sx__rcl_watch_check(rb);
}

void sx__rcl_watch(redis_backend *rb) {
  sx_rcl *cl = rb->cl;
  if (cl == NULL || !cl->have_map || (rb->state != RB_READY && rb->state != RB_CONNECTING))
    return; /* the next connect subscribes */
  for (int i = 0; i < RCL_MAX_NODES && rb->state != RB_DOWN; i++)
    if (cl->nodes[i].master && cl->nodes[i].sub == NULL)
      sx__rcl_sub_connect(&cl->nodes[i]);
  if (rb->state != RB_DOWN)
    sx__rcl_resubscribe(rb);
}

