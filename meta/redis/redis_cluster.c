/*
 * redis+cluster://: the Redis backend on a Redis Cluster.
 *
 * The ops (backend_redis.c) are the same as on one server; what changes is
 * where each command goes.  The URL's hosts are seeds: the slot map comes
 * from CLUSTER SHARDS (CLUSTER SLOTS where that is unknown or denied) on
 * the first seed (or known node) that answers, and
 * every master gets one hiredis connection on the agent's loop, set up with
 * the same handshake as a single server (AUTH, SCRIPT LOAD).  Each command
 * goes to the master of its key's slot (redis_slots.c).  Then:
 *   - MOVED: the slot has a new master: note it, resend there, and read the
 *     whole map again (one move usually means more);
 *   - ASK: the slot is migrating and this key is already on the target:
 *     resend once there, preceded by ASKING;
 *   - TRYAGAIN, CLUSTERDOWN, or a lost connection: park the command and
 *     read the map again after a backoff (a failover promotes a replica
 *     within cluster-node-timeout and a bit); parked commands are resent
 *     after each refresh, until their op's deadline (timeout_ms) passes.
 * Replies reach an op in the order its commands were sent, whatever node
 * answered first (a listing reads keys on every master).
 *
 * Events: every master's second connection subscribes to its keyspace
 * notifications (expiry is local to the node holding the key) and, with
 * SSUBSCRIBE, to the shard channels sx:NS:events:{k} whose slot it owns
 * (Redis 7 sharded pub/sub: an event goes to one shard, not the whole
 * cluster bus); that part is in redis_cluster_sub.c.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "redis_cluster.h"

static void dispatch(redis_backend *rb, rcl_cmd *c);

/* ------------------------------------------------------------- nodes */

/* The node at host:port, added to the table when new (NULL when the table
 * is full of nodes still in use). */
static rcl_node *node_get(redis_backend *rb, const char *host, int port) {
  sx_rcl *cl = rb->cl;
  rcl_node *free_slot = NULL, *stale = NULL;
  for (int i = 0; i < RCL_MAX_NODES; i++) {
    rcl_node *n = &cl->nodes[i];
    if (n->used && n->port == port && strcmp(n->host, host) == 0)
      return n;
    if (free_slot == NULL && !n->used)
      free_slot = n;
    /* Past its use: not a master, not connected, not an ASK target. */
    if (stale == NULL && n->used && !n->master && n->ac == NULL && n->sub == NULL)
      stale = n;
  }
  if (free_slot == NULL)
    free_slot = stale;
  if (free_slot == NULL)
    return NULL;
  /* A reused entry must not be named by a stale slot. */
  int idx = sx__rcl_node_index(cl, free_slot);
  for (unsigned s = 0; s < SX_RCL_SLOTS; s++)
    if (cl->slot_node[s] == idx)
      cl->slot_node[s] = -1;
  memset(free_slot, 0, sizeof(*free_slot));
  free_slot->rb = rb;
  free_slot->used = 1;
  snprintf(free_slot->host, sizeof(free_slot->host), "%s", host);
  free_slot->port = port;
  return free_slot;
}

/* The master at host:port in the current map, or NULL.  A MOVED is only
 * believed about masters the map already names: an address that a node
 * names and the map does not is checked by reading the map, never
 * connected to (and sent the password) on one node's word. */
static rcl_node *node_master(redis_backend *rb, const char *host, int port) {
  sx_rcl *cl = rb->cl;
  for (int i = 0; i < RCL_MAX_NODES; i++) {
    rcl_node *n = &cl->nodes[i];
    if (n->used && n->master && n->port == port && strcmp(n->host, host) == 0)
      return n;
  }
  return NULL;
}

static void node_drop(rcl_node *n) {
  sx_rcl *cl = n->rb->cl;
  int idx = sx__rcl_node_index(cl, n);
  for (int k = 0; k < SX_RCL_SHARDS; k++)
    if (cl->chan_node[k] == idx)
      cl->chan_node[k] = -1;
  if (n->sub != NULL)
    cl->watch_told = 0;
  sx__redis_drop(&n->ac);
  sx__redis_drop(&n->sub);
  n->hs_left = n->sub_left = 0;
}

/* A node's connection failed or closed.  While connecting, that fails the
 * session (every master must answer); once up, its commands wait for a
 * refreshed map (a failover, usually). */
static void node_lost(rcl_node *n, const char *why) {
  redis_backend *rb = n->rb;
  char text[200];
  sx__redis_scrub(text, sizeof(text), why, strlen(why), rb->base.url.password);
  node_drop(n);
  if (rb->state == RB_CONNECTING) {
    sx__redis_session_fail(rb, SX_EUNREACH, "cluster node %s:%d: %s", n->host, n->port,
                           text[0] ? text : "connection closed");
    return;
  }
  sx__rcl_refresh(rb, sx__redis_backoff(&rb->cl->backoff_ms));
}


enum { HS_AUTH = 1, HS_SCRIPT = 100 };

static void node_hs_cb(redisAsyncContext *ac, void *reply, void *priv) {
  rcl_node *n = ac->data;
  redisReply *r = reply;
  int step = (int)(intptr_t)priv;
  if (ac != n->ac)
    return;
  if (r == NULL) {
    n->ac = NULL; /* hiredis is freeing it */
    node_lost(n, ac->errstr);
    return;
  }
  if (step == HS_AUTH && r->type == REDIS_REPLY_ERROR) {
    sx__redis_auth_fail(n->rb, r);
    return;
  }
  /* A script that did not load is sent whole (EVAL) when needed: a
   * read-only user may not load scripts. */
  if (step >= HS_SCRIPT && step < HS_SCRIPT + SX_SCRIPT_COUNT &&
      r->type == REDIS_REPLY_STRING && r->len == 40) {
    memcpy(n->rb->script_sha[step - HS_SCRIPT], r->str, 40);
    n->rb->script_sha[step - HS_SCRIPT][40] = '\0';
  }
  if (--n->hs_left == 0)
    sx__rcl_check_ready(n->rb);
}

static void node_on_connect(const redisAsyncContext *cac, int status) {
  redisAsyncContext *ac = (redisAsyncContext *)cac;
  rcl_node *n = ac->data;
  if (ac != n->ac || status == REDIS_OK)
    return;
  n->ac = NULL; /* hiredis frees it */
  node_lost(n, ac->errstr);
}

static void node_on_disconnect(const redisAsyncContext *cac, int status) {
  redisAsyncContext *ac = (redisAsyncContext *)cac;
  rcl_node *n = ac->data;
  (void)status;
  if (ac != n->ac)
    return;
  n->ac = NULL;
  node_lost(n, ac->errstr);
}

static void hs_send(rcl_node *n, int step, int argc, const char **argv) {
  if (redisAsyncCommandArgv(n->ac, node_hs_cb, (void *)(intptr_t)step, argc, argv, NULL) ==
      REDIS_OK)
    n->hs_left++;
}

/* Open the command connection with its handshake queued first: commands
 * sent before it is up follow the handshake on the same socket. */
static int node_connect(rcl_node *n) {
  redis_backend *rb = n->rb;
  char err[160];
  if (n->ac != NULL)
    return 0;
  n->ac = sx__redis_connect(rb->base.loop, n->host, n->port, n, node_on_connect,
                            node_on_disconnect, err, sizeof(err));
  if (n->ac == NULL) {
    node_lost(n, err);
    return -1;
  }
  n->hs_left = 0;
  if (rb->base.url.has_password) {
    const char *argv[3];
    int argc = sx__redis_auth_argv(rb, argv);
    hs_send(n, HS_AUTH, argc, argv);
  }
  for (int i = 0; i < SX_SCRIPT_COUNT; i++) {
    const char *argv[] = {"SCRIPT", "LOAD", sx__redis_scripts[i]};
    hs_send(n, HS_SCRIPT + i, 3, argv);
  }
  return 0;
}

/* ------------------------------------------------------------- commands */

static void cmd_free(rcl_cmd *c) {
  rreq *q = c->q;
  free(c);
  q->outstanding--;
  sx__redis_q_release(q);
}

static void park(redis_backend *rb, rcl_cmd *c) {
  sx_rcl *cl = rb->cl;
  c->next = NULL;
  if (cl->parked_tail)
    cl->parked_tail->next = c;
  else
    cl->parked = c;
  cl->parked_tail = c;
}

static void flush_parked(redis_backend *rb) {
  sx_rcl *cl = rb->cl;
  rcl_cmd *c = cl->parked;
  cl->parked = cl->parked_tail = NULL;
  while (c != NULL) {
    rcl_cmd *next = c->next;
    if (c->q->done || rb->state != RB_READY)
      cmd_free(c);
    else
      dispatch(rb, c);
    c = next;
  }
}

static redisReply *reply_dup(const redisReply *r) {
  redisReply *d = calloc(1, sizeof(*d));
  if (d == NULL)
    return NULL;
  d->type = r->type;
  d->integer = r->integer;
  if (r->str != NULL) {
    if ((d->str = malloc(r->len + 1)) == NULL)
      goto fail;
    memcpy(d->str, r->str, r->len);
    d->str[r->len] = '\0';
    d->len = r->len;
  }
  if (r->type == REDIS_REPLY_ARRAY && r->elements > 0) {
    if ((d->element = calloc(r->elements, sizeof(*d->element))) == NULL)
      goto fail;
    d->elements = r->elements;
    for (size_t i = 0; i < r->elements; i++)
      if ((d->element[i] = reply_dup(r->element[i])) == NULL)
        goto fail;
  }
  return d;
fail:
  freeReplyObject(d);
  return NULL;
}

static void deliver(rreq *q, redisReply *r) {
  if (q->done)
    return;
  if (q->fail_rc) {
    sx__redis_q_finish(q, q->fail_rc, "%s: %s: sending failed", q->name, q->what);
    return;
  }
  q->got++;
  q->on_reply(q, r);
}

/* Hand r (the reply to command seq) and every stashed reply after it on,
 * in order; a reply that came early waits in the stash. */
static void deliver_in_order(rreq *q, uint32_t seq, redisReply *r) {
  if (seq != q->cl_next) {
    /* The stash is made on the first reply that comes early: most ops
     * (one key, one node) never need it. */
    if (seq >= q->cl_cap) {
      size_t cap = q->cl_sent > seq ? q->cl_sent : seq + 1;
      redisReply **st = realloc(q->cl_stash, cap * sizeof(*st));
      if (st != NULL) {
        memset(st + q->cl_cap, 0, (cap - q->cl_cap) * sizeof(*st));
        q->cl_stash = st;
        q->cl_cap = cap;
      }
    }
    if (seq < q->cl_cap && q->cl_stash[seq] == NULL &&
        (q->cl_stash[seq] = reply_dup(r)) != NULL)
      return;
    sx__redis_q_finish(q, SX_ENOMEM, "%s: %s: out of memory for a reply", q->name, q->what);
    return;
  }
  deliver(q, r);
  q->cl_next++;
  while (q->cl_next < q->cl_cap && q->cl_stash[q->cl_next] != NULL) {
    redisReply *s = q->cl_stash[q->cl_next];
    q->cl_stash[q->cl_next++] = NULL;
    deliver(q, s);
    freeReplyObject(s);
  }
}

static void cmd_cb(redisAsyncContext *ac, void *reply, void *priv) {
  rcl_cmd *c = priv;
  rcl_node *n = ac->data;
  rreq *q = c->q;
  redis_backend *rb = q->rb;
  redisReply *r = reply;
  if (q->done || rb->state != RB_READY) {
    cmd_free(c);
    return;
  }
  if (r == NULL) {
    /* The node went: node_lost (from the disconnect callback, right after
     * this) reads the map again, and a command that never left waits for
     * it.  A write that may have been applied is not sent twice (a publish
     * would then fail on its own generation, an event be announced twice):
     * its op fails, and the caller decides. */
    if (c->write && (ac->c.flags & REDIS_CONNECTED)) {
      sx__redis_q_finish(q, SX_EUNREACH, "%s: %s: the connection to %s:%d was lost with the "
                         "write in flight (it may have been applied)", q->name, q->what,
                         n->host, n->port);
      cmd_free(c);
      return;
    }
    park(rb, c);
    return;
  }
  int ask, port;
  unsigned slot;
  char host[256];
  if (sx__rcl_parse_redirect(r, &ask, &slot, host, sizeof(host), &port) == 0) {
    const char *to_host = host[0] ? host : n->host;
    if (slot != c->slot) {
      /* A node names the key's own slot; any other is not a redirection
       * of this command, and must not move another slot's commands. */
      sx__redis_q_finish(q, SX_ESTORE, "%s: %s: %s:%d answered %s for slot %u, but the "
                         "key is in slot %u (not a cluster node's answer)", q->name, q->what,
                         n->host, n->port, ask ? "ASK" : "MOVED", slot, c->slot);
      cmd_free(c);
      return;
    }
    if (++c->tries > RCL_MAX_TRIES) {
      sx__redis_q_finish(q, SX_ESTORE, "%s: %s: still redirected after %d tries (last: "
                         "slot %u to %s:%d)", q->name, q->what, RCL_MAX_TRIES, slot,
                         to_host, port);
      cmd_free(c);
      return;
    }
    if (!ask) {
      rb->cl_moved++;
      rcl_node *to = node_master(rb, to_host, port);
      if (to == NULL) {
        /* A master the map does not know (a promoted replica, a node
         * added, or a made-up address): the map read now says where the
         * slot went, and the command waits for it.  Should the node read
         * not know yet (gossip still spreading the change), the reads after
         * half the tries come paced, so that the rest span some time. */
        park(rb, c);
        sx__rcl_refresh(rb, c->tries > RCL_MAX_TRIES / 2 ? RCL_RETRY_MS : 0);
        return;
      }
      rb->cl->slot_node[slot] = (int16_t)sx__rcl_node_index(rb->cl, to);
      sx__rcl_refresh(rb, RCL_REFRESH_GAP_MS);
      dispatch(rb, c);
      return;
    }
    /* ASK is for this one command and leaves the map alone; its target
     * may be a master that owns no slot yet (the map does not list it). */
    rcl_node *to = node_get(rb, to_host, port);
    if (to == NULL) {
      sx__redis_q_finish(q, SX_ELIMIT, "%s: %s: the cluster has more than %d nodes", q->name,
                         q->what, RCL_MAX_NODES);
      cmd_free(c);
      return;
    }
    rb->cl_asked++;
    c->ask = to;
    dispatch(rb, c);
    return;
  }
  if (sx__redis_is_error(r, "TRYAGAIN") || sx__redis_is_error(r, "CLUSTERDOWN")) {
    /* A multi-key command during a migration, or a cluster without a
     * master for some slot (a failover in progress): later. */
    c->tries++;
    rb->cl_retried++;
    park(rb, c);
    sx__rcl_refresh(rb, RCL_RETRY_MS);
    return;
  }
  deliver_in_order(q, c->seq, r);
  cmd_free(c);
}

static void dispatch(redis_backend *rb, rcl_cmd *c) {
  sx_rcl *cl = rb->cl;
  rcl_node *n = c->ask;
  if (n == NULL) {
    int idx = cl->slot_node[c->slot];
    n = idx >= 0 ? &cl->nodes[idx] : NULL;
  }
  if (n == NULL || (n->ac == NULL && node_connect(n) != 0)) {
    /* An ASK is for this attempt only: a retry asks the slot's owner,
     * which redirects again if the slot is still moving. */
    c->ask = NULL;
    park(rb, c);
    sx__rcl_refresh(rb, n == NULL ? 0 : sx__redis_backoff(&cl->backoff_ms));
    return;
  }
  if (c->ask != NULL) {
    static const char asking[] = "*1\r\n$6\r\nASKING\r\n";
    c->ask = NULL; /* once */
    if (redisAsyncFormattedCommand(n->ac, NULL, NULL, asking, sizeof(asking) - 1) !=
        REDIS_OK) {
      park(rb, c);
      return;
    }
  }
  if (redisAsyncFormattedCommand(n->ac, cmd_cb, c, c->buf, c->len) != REDIS_OK)
    park(rb, c);
}

int sx__rcl_send(rreq *q, const char *buf, size_t len, const char *key, size_t klen,
                 int write) {
  redis_backend *rb = q->rb;
  rcl_cmd *c = malloc(sizeof(*c) + len);
  if (c == NULL)
    return sx__err(SX_ENOMEM, "%s: %s", q->name, q->what);
  memset(c, 0, sizeof(*c));
  c->q = q;
  c->seq = q->cl_sent++;
  c->slot = sx__rcl_key_slot(key, klen);
  c->write = write;
  c->len = len;
  memcpy(c->buf, buf, len);
  q->outstanding++;
  dispatch(rb, c);
  return 0;
}

/* ------------------------------------------------------------- the map */

static int candidates(const redis_backend *rb) {
  return rb->base.url.n_hosts + RCL_MAX_NODES;
}

/* Candidate i for discovery: the seeds first, then every node seen. */
static int candidate(redis_backend *rb, int i, const char **host, int *port) {
  if (i < rb->base.url.n_hosts) {
    *host = rb->base.url.hosts[i].host;
    *port = rb->base.url.hosts[i].port;
    return 0;
  }
  rcl_node *n = &rb->cl->nodes[i - rb->base.url.n_hosts];
  if (!n->used)
    return -1;
  *host = n->host;
  *port = n->port;
  return 0;
}

static void disc_attempt(redis_backend *rb);
static void cl_timer_cb(uv_timer_t *t);

static void disc_failed(redis_backend *rb, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The node asked for the map failed us: a permanent refusal (not a
 * cluster node, a missing permission, a wrong password) fails a connecting
 * session at once; anything else moves on to the next candidate. */
static void disc_failed(redis_backend *rb, int err, const char *fmt, ...) {
  sx_rcl *cl = rb->cl;
  va_list ap;
  int o = snprintf(cl->disc_err, sizeof(cl->disc_err), "%s:%d: ", cl->disc_host,
                   cl->disc_port);
  va_start(ap, fmt);
  if (o > 0 && (size_t)o < sizeof(cl->disc_err))
    vsnprintf(cl->disc_err + o, sizeof(cl->disc_err) - (size_t)o, fmt, ap);
  va_end(ap);
  sx__redis_drop(&cl->disc);
  if (err != 0 && rb->state == RB_CONNECTING) {
    cl->refreshing = 0;
    sx__redis_session_fail(rb, err, "%s", cl->disc_err);
    return;
  }
  cl->disc_next = (cl->disc_next + 1) % candidates(rb);
  disc_attempt(rb);
}

static void apply_map(redis_backend *rb, const sx_rcl_range *ranges, size_t n) {
  sx_rcl *cl = rb->cl;
  for (int i = 0; i < RCL_MAX_NODES; i++)
    cl->nodes[i].master = 0;
  for (size_t i = 0; i < n; i++) {
    rcl_node *nd = node_get(rb, ranges[i].host[0] ? ranges[i].host : cl->disc_host,
                            ranges[i].port);
    if (nd == NULL)
      continue; /* more than RCL_MAX_NODES masters: those slots redirect */
    nd->master = 1;
    for (unsigned s = ranges[i].first; s <= ranges[i].last; s++)
      cl->slot_node[s] = (int16_t)sx__rcl_node_index(cl, nd);
  }
  cl->have_map = 1;
  for (int i = 0; i < RCL_MAX_NODES && rb->state != RB_DOWN; i++) {
    rcl_node *nd = &cl->nodes[i];
    if (!nd->master)
      continue;
    if (nd->ac == NULL && node_connect(nd) != 0)
      continue; /* node_lost() asked for another look (or failed the session) */
    if (rb->watching && nd->sub == NULL)
      sx__rcl_sub_connect(nd);
  }
  if (rb->state == RB_DOWN)
    return;
  if (rb->watching)
    sx__rcl_resubscribe(rb);
  if (rb->state == RB_READY)
    flush_parked(rb);
  sx__rcl_check_ready(rb);
}

/* The map: CLUSTER SHARDS (priv 0) first; where a node does not know it
 * (Redis < 7) or the user may not run it, CLUSTER SLOTS (priv 1). */
static void disc_map_cb(redisAsyncContext *ac, void *reply, void *priv) {
  redis_backend *rb = ac->data;
  sx_rcl *cl = rb->cl;
  redisReply *r = reply;
  int slots = priv != NULL;
  const char *cmd = slots ? "CLUSTER SLOTS" : "CLUSTER SHARDS";
  char msg[300];
  if (cl == NULL || ac != cl->disc)
    return;
  if (r == NULL) {
    cl->disc = NULL;
    disc_failed(rb, 0, "connection lost: %s", ac->errstr);
    return;
  }
  if (r->type == REDIS_REPLY_ERROR) {
    char text[160];
    sx__redis_scrub(text, sizeof(text), r->str, r->len, rb->base.url.password);
    if (strstr(text, "cluster support disabled")) {
      disc_failed(rb, SX_ESTORE, "not a cluster node (it answered '%s'): use redis:// for "
                  "a single server", text);
    } else if (!slots && (sx__redis_map_error(r) == SX_EAUTH || strstr(text, "nknown"))) {
      const char *argv[] = {"CLUSTER", "SLOTS"};
      redisAsyncCommandArgv(ac, disc_map_cb, (void *)1, 2, argv, NULL);
    } else if (sx__redis_map_error(r) == SX_EAUTH) {
      disc_failed(rb, SX_EAUTH, "CLUSTER SHARDS and CLUSTER SLOTS refused ('%s'): the ACL "
                  "user%s%s needs +cluster|shards or +cluster|slots (docs/store.md lists a "
                  "cluster user's rules)", text, rb->base.url.user[0] ? " " : "",
                  rb->base.url.user);
    } else {
      disc_failed(rb, 0, "%s failed: %s", cmd, text);
    }
    return;
  }
  /* CLUSTER SLOTS has a range per element; a shard may list several. */
  size_t n, max = r->type == REDIS_REPLY_ARRAY && r->elements > 0 ? r->elements : 1;
  if (!slots)
    max = SX_RCL_SLOTS / 4;
  sx_rcl_range *ranges = max <= SX_RCL_SLOTS ? malloc(max * sizeof(*ranges)) : NULL;
  int prc = ranges == NULL ? -1
            : slots        ? sx__rcl_parse_slots(r, ranges, max, &n, msg, sizeof(msg))
                           : sx__rcl_parse_shards(r, ranges, max, &n, msg, sizeof(msg));
  if (prc != 0) {
    free(ranges);
    disc_failed(rb, 0, "%s", ranges ? msg : "CLUSTER SLOTS: too many ranges");
    return;
  }
  if (sx__rcl_uncovered(ranges, n, msg, sizeof(msg)) != 0) {
    if (rb->state == RB_CONNECTING) {
      free(ranges);
      disc_failed(rb, SX_ESTORE, "the cluster does not serve every slot: %s (cluster_state "
                  "is not ok; fix it with redis-cli --cluster fix, or wait for a failover)",
                  msg);
      return;
    }
    /* Up already: keep the old masters of the missing slots (they answer
     * CLUSTERDOWN or MOVED) and look again later. */
    cl->again = 1;
  }
  sx__redis_drop(&cl->disc);
  cl->refreshing = 0;
  cl->backoff_ms = 0;
  uv_timer_stop(&rb->cl_timer);
  apply_map(rb, ranges, n);
  free(ranges);
  if (cl->again && rb->state == RB_READY) {
    cl->again = 0;
    sx__rcl_refresh(rb, RCL_REFRESH_GAP_MS);
  }
}

static void disc_auth_cb(redisAsyncContext *ac, void *reply, void *priv) {
  redis_backend *rb = ac->data;
  redisReply *r = reply;
  (void)priv;
  if (rb->cl == NULL || ac != rb->cl->disc || r == NULL || r->type != REDIS_REPLY_ERROR)
    return; /* +OK, or a lost connection (CLUSTER SLOTS' callback says) */
  char text[160];
  sx__redis_scrub(text, sizeof(text), r->str, r->len, rb->base.url.password);
  disc_failed(rb, SX_EAUTH, "authentication%s%s%s failed (%s); check the user and "
              "password in the URL", rb->base.url.user[0] ? " as '" : "", rb->base.url.user,
              rb->base.url.user[0] ? "'" : "", text);
}

static void disc_on_connect(const redisAsyncContext *cac, int status) {
  redisAsyncContext *ac = (redisAsyncContext *)cac;
  redis_backend *rb = ac->data;
  if (rb->cl == NULL || ac != rb->cl->disc || status == REDIS_OK)
    return;
  rb->cl->disc = NULL;
  disc_failed(rb, 0, "cannot connect: %s", ac->errstr);
}

static void disc_on_disconnect(const redisAsyncContext *cac, int status) {
  redisAsyncContext *ac = (redisAsyncContext *)cac;
  redis_backend *rb = ac->data;
  (void)status;
  if (rb->cl == NULL || ac != rb->cl->disc)
    return;
  rb->cl->disc = NULL;
  disc_failed(rb, 0, "connection lost: %s", ac->errstr);
}

static void disc_attempt(redis_backend *rb) {
  sx_rcl *cl = rb->cl;
  char err[160];
  const char *host;
  int port;
  while (cl->disc_tried < candidates(rb) &&
         candidate(rb, cl->disc_next, &host, &port) != 0) {
    cl->disc_tried++;
    cl->disc_next = (cl->disc_next + 1) % candidates(rb);
  }
  if (cl->disc_tried >= candidates(rb)) {
    /* No seed and no node seen answers: the cluster is out of reach, as a
     * single server that went away (the session reconnects with backoff). */
    cl->refreshing = 0;
    sx__redis_session_fail(rb, SX_EUNREACH, "no cluster node gave the slot map (last: %s)",
                           cl->disc_err);
    return;
  }
  cl->disc_tried++;
  snprintf(cl->disc_host, sizeof(cl->disc_host), "%s", host);
  cl->disc_port = port;
  snprintf(rb->host, sizeof(rb->host), "%s", host);
  rb->port = port;
  cl->disc = sx__redis_connect(rb->base.loop, host, port, rb, disc_on_connect,
                               disc_on_disconnect, err, sizeof(err));
  if (cl->disc == NULL) {
    disc_failed(rb, 0, "cannot connect: %s", err);
    return;
  }
  if (rb->base.url.has_password) {
    const char *argv[3];
    int argc = sx__redis_auth_argv(rb, argv);
    redisAsyncCommandArgv(cl->disc, disc_auth_cb, NULL, argc, argv, NULL);
  }
  const char *argv[] = {"CLUSTER", "SHARDS"};
  redisAsyncCommandArgv(cl->disc, disc_map_cb, NULL, 2, argv, NULL);
  /* While a refresh runs, the timer is its deadline. */
  uv_timer_start(&rb->cl_timer, cl_timer_cb, rb->base.url.connect_timeout_ms, 0);
}

static void cl_timer_cb(uv_timer_t *t) {
  redis_backend *rb = t->data;
  sx_rcl *cl = rb->cl;
  if (cl == NULL || rb->state == RB_CLOSED || rb->state == RB_DOWN)
    return;
  if (cl->refreshing) {
    sx__redis_drop(&cl->disc);
    disc_failed(rb, 0, "no answer to CLUSTER SHARDS/SLOTS within %u ms (connect_timeout_ms)",
                rb->base.url.connect_timeout_ms);
    return;
  }
  cl->refreshing = 1;
  cl->disc_tried = 0;
  rb->cl_refreshes++;
  disc_attempt(rb);
}

/* Read the map again after delay_ms (sooner requests win; one at a time,
 * and while one runs, another is asked for after it).  While a refresh
 * runs, the timer is its deadline. */
void sx__rcl_refresh(redis_backend *rb, uint32_t delay_ms) {
  sx_rcl *cl = rb->cl;
  if (rb->state == RB_CLOSED || rb->state == RB_DOWN)
    return;
  if (cl->refreshing) {
    cl->again = 1;
    return;
  }
  if (uv_is_active((uv_handle_t *)&rb->cl_timer) &&
      uv_timer_get_due_in(&rb->cl_timer) <= delay_ms)
    return;
  uv_timer_start(&rb->cl_timer, cl_timer_cb, delay_ms, 0);
}

void sx__rcl_suspect(redis_backend *rb) {
  if (rb->cl != NULL)
    sx__rcl_refresh(rb, RCL_REFRESH_GAP_MS);
}

/* ------------------------------------------------------------- session */

void sx__rcl_check_ready(redis_backend *rb) {
  sx_rcl *cl = rb->cl;
  if (rb->state != RB_CONNECTING || !cl->have_map)
    return;
  for (int i = 0; i < RCL_MAX_NODES; i++) {
    const rcl_node *n = &cl->nodes[i];
    if (!n->master)
      continue;
    if (n->ac == NULL || n->hs_left > 0)
      return;
    if (rb->watching && (n->sub == NULL || n->sub_left > 0))
      return;
  }
  if (rb->watching)
    for (int k = 0; k < SX_RCL_SHARDS; k++)
      if (cl->chan_node[k] < 0)
        return;
  sx__redis_ready(rb);
  if (rb->state == RB_READY) {
    flush_parked(rb);
    sx__rcl_watch_check(rb);
  }
}

void sx__rcl_start(redis_backend *rb) {
  if (rb->cl == NULL) {
    rb->cl = calloc(1, sizeof(*rb->cl));
    if (rb->cl == NULL) {
      sx__redis_session_fail(rb, SX_ENOMEM, "out of memory for the cluster map");
      return;
    }
  }
  sx_rcl *cl = rb->cl;
  memset(cl->slot_node, 0xff, sizeof(cl->slot_node));
  for (int k = 0; k < SX_RCL_SHARDS; k++)
    cl->chan_node[k] = -1;
  cl->have_map = 0;
  cl->watch_told = 0;
  cl->again = 0;
  cl->disc_next = 0;
  snprintf(cl->disc_err, sizeof(cl->disc_err), "no seed tried");
  /* The whole connect (map, every master's handshake) within
   * connect_timeout_ms per node asked; the session's own timer bounds the
   * handshakes once the map is known. */
  sx__redis_arm_conn_timer(rb, (uint64_t)rb->base.url.connect_timeout_ms * 2);
  uv_timer_stop(&rb->cl_timer);
  cl->refreshing = 1;
  cl->disc_tried = 0;
  disc_attempt(rb);
}

void sx__rcl_drop(redis_backend *rb) {
  sx_rcl *cl = rb->cl;
  if (cl == NULL)
    return;
  uv_timer_stop(&rb->cl_timer);
  cl->refreshing = 0;
  sx__redis_drop(&cl->disc);
  for (int i = 0; i < RCL_MAX_NODES; i++)
    if (cl->nodes[i].used)
      node_drop(&cl->nodes[i]);
  rcl_cmd *c = cl->parked;
  cl->parked = cl->parked_tail = NULL;
  while (c != NULL) {
    rcl_cmd *next = c->next;
    cmd_free(c);
    c = next;
  }
  cl->have_map = 0;
}

void sx__rcl_free(redis_backend *rb) {
  free(rb->cl);
  rb->cl = NULL;
}
