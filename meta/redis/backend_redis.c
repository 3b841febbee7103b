/*
 * redis:// and redis+sentinel:// metadata store (hiredis async on libuv):
 * the ops and their replies.  Requests (RESP, replies, deadlines) are in
 * redis_req.c; the session (connect, handshake, events,
 * reconnects) is in redis_session.c, Sentinel in redis_sentinel.c, the Lua
 * scripts in redis_scripts.c.
 *
 * Keys for namespace NS and segment N (docs/store.md, "Redis key schema"):
 *   sx:NS:seg:{N}    HASH d (descriptor), inc (hex), gen, pub, ren (server
 *                    ms), lease, xd (the holder's encoded delete event),
 *                    ix (server ms of the last index write); PEXPIRE = lease
 *   sx:NS:fence:{N}  SET of fenced incarnations (hex), TTL 24 h
 *   sx:NS:index      ZSET member N, score = lease expiry (server ms) as of
 *                    the last index write: every publish, and a renewal
 *                    only when the renew script says it is due
 *   sx:NS:events     pub/sub channel of encoded SegmentEvents
 * On a Redis Cluster (redis+cluster://, redis_cluster.c) the index and the
 * channel are split into SX_RCL_SHARDS pieces, sx:NS:index:{k} and the
 * sharded pub/sub channel sx:NS:events:{k}, k = CRC16(N) mod 16, so that
 * they spread over the masters; the client SPUBLISHes the events there.
 *
 * Connection handling (redis.h has the picture): ops issued while the
 * session is being set up wait for it (bounded by their own timeout); ops
 * issued while it is down fail at once with SX_EUNREACH.  Every op has a
 * deadline of timeout_ms; when it passes, the op fails with SX_ETIMEDOUT and
 * the connection is treated as dead, because a server that does not answer
 * one command will not answer the ones queued behind it either.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "redis.h"

/* ------------------------------------------------------------- scripts */

/* The renew script's refresh_ms: 0 (write the entry) while a failed index
 * write is being repaired, else the URL's interval. */
static const char *refresh_arg(redis_backend *rb, char buf[16]) {
  if (uv_now(rb->base.loop) < rb->ix_force_until)
    return "0";
  snprintf(buf, 16, "%u", rb->base.url.index_refresh_ms);
  return buf;
}

void sx__redis_index_retry(redis_backend *rb) {
  rb->ix_force_until = uv_now(rb->base.loop) + rb->base.url.index_refresh_ms;
}

static int q_script(rreq *q) {
  redis_backend *rb = q->rb;
  /* Only the scripts touch the fence set. */
  char seg_key[SX_REDIS_KEY_MAX], fence_key[SX_REDIS_KEY_MAX];
  sx__redis_seg_key(q, seg_key);
  sx__redis_key(fence_key, rb->fence_prefix, q->name, strlen(q->name));
  const char *argv[16];
  size_t lens[16];
  int n = 0;
  char fence_ttl[16];
  snprintf(fence_ttl, sizeof(fence_ttl), "%u", SX_REDIS_FENCE_TTL_MS);
  /* A cluster's channel is in another slot than the script's keys: the
   * client publishes there (after_write). */
  const char *channel = rb->cluster ? "" : rb->channel;
  char refresh[16];
#define ARG(p, l) (argv[n] = (const char *)(p), lens[n] = (l), n++)
#define SARG(s) ARG(s, strlen(s))
  if (q->eval || rb->script_sha[q->script][0] == '\0') {
    SARG("EVAL");
    SARG(sx__redis_scripts[q->script]);
  } else {
    SARG("EVALSHA");
    SARG(rb->script_sha[q->script]);
  }
  SARG("2");
  SARG(seg_key);
  SARG(fence_key);
  switch (q->script) {
  case SX_SCRIPT_PUBLISH:
    SARG(q->inc_hex);
    SARG(q->gen);
    ARG(q->value, q->len);
    SARG(q->lease);
    SARG(q->takeover ? "1" : "0");
    ARG(q->put_ev, q->put_ev_len);
    ARG(q->del_ev, q->del_ev_len);
    SARG(channel);
    SARG(fence_ttl);
    break;
  case SX_SCRIPT_RENEW:
    SARG(q->inc_hex);
    SARG(q->lease);
    SARG(refresh_arg(rb, refresh));
    break;
  case SX_SCRIPT_UNPUBLISH:
    SARG(q->inc_hex);
    SARG(channel);
    break;
  case SX_SCRIPT_REMOVE:
    SARG(channel);
    SARG(fence_ttl);
    break;
  }
#undef SARG
#undef ARG
  return sx__redis_q_send(q, n, argv, lens);
}

/*
 * Common checks of a script reply.  Returns 1 when the op was dealt with
 * (retried after NOSCRIPT, or failed), 0 with the status word in *word and
 * the elements in r->element otherwise.
 */
static int script_reply(rreq *q, redisReply *r, const char **word) {
  char desc[200];
  if (sx__redis_is_error(r, "NOSCRIPT") && !q->eval) {
    /* The server lost its script cache (SCRIPT FLUSH, a restart, a new
     * master): send the body; EVAL caches it again. */
    q->eval = 1;
    int rc = q_script(q);
    if (rc)
      sx__redis_q_finish(q, rc, "%s: %s: %s", q->name, q->what, sx_errmsg());
    return 1;
  }
  if (r->type == REDIS_REPLY_ERROR) {
    sx__redis_describe(r, desc, sizeof(desc));
    sx__redis_q_finish(q, sx__redis_map_error(r), "%s: %s failed: %s", q->name, q->what, desc);
    return 1;
  }
  if (r->type != REDIS_REPLY_ARRAY || r->elements < 1 ||
      (r->element[0]->type != REDIS_REPLY_STRING &&
       r->element[0]->type != REDIS_REPLY_STATUS)) {
    sx__redis_describe(r, desc, sizeof(desc));
    sx__redis_q_finish(q, SX_ESTORE, "%s: %s: unexpected reply from the store: %s", q->name, q->what,
             desc);
    return 1;
  }
  *word = r->element[0]->str;
  return 0;
}


static void fenced(rreq *q, const redisReply *r) {
  const char *holder = sx__redis_elem_str(r, 1, 64);
  if (holder != NULL && holder[0] != '\0')
    sx__redis_q_finish(q, SX_EFENCED, "%s: %s: the name is now held by incarnation %s; this "
             "incarnation (%s) lost it and must not write it again", q->name, q->what,
             holder, q->inc_hex);
  else
    sx__redis_q_finish(q, SX_EFENCED, "%s: %s: incarnation %s was fenced (taken over, or removed "
             "by an admin); start a new incarnation to publish again", q->name, q->what,
             q->inc_hex);
}

/* The listing index key of q's name: one key on a single server, the
 * name's piece on a cluster. */
static const char *index_key(const rreq *q, char *buf, size_t size) {
  if (!q->rb->cluster)
    return q->rb->index_key;
  sx__rcl_index_key(q->rb, sx__rcl_shard_of(q->name), buf, size);
  return buf;
}

/* Put the name in the listing index with its expiry. */
static int index_add(rreq *q) {
  char score[32], key[SX_NS_MAX + 32];
  uint64_t lease = strtoull(q->lease, NULL, 10);
  snprintf(score, sizeof(score), "%" PRIu64, q->server_now + lease);
  const char *argv[] = {"ZADD", index_key(q, key, sizeof(key)), score, q->name};
  int rc = sx__redis_q_send(q, 4, argv, NULL);
  q->ix_sent = rc == 0;
  return rc;
}

static int index_rem(rreq *q) {
  char key[SX_NS_MAX + 32];
  const char *argv[] = {"ZREM", index_key(q, key, sizeof(key)), q->name};
  return sx__redis_q_send(q, 3, argv, NULL);
}

/* The op ends once what after_write() sent has answered (q->step). */
static void index_done(rreq *q, redisReply *r) {
  if (r->type == REDIS_REPLY_ERROR && q->ix_sent)
    sx__redis_index_retry(q->rb);
  if (q->got >= q->step) {
    q->ix_sent = 0;
    sx__redis_q_finish(q, 0, NULL);
  }
}

/*
 * After a successful write: the index entry (add or remove) and, on a
 * cluster, the event on the name's shard channel.  A failure of either is
 * not the op's failure (the segment is written): a failed add (an error
 * reply, a send that fails here, an op that ends before the answer) makes
 * the next renewals write their entries (sx__redis_index_retry), and caches
 * also expire entries by TTL.  Returns 1 when the op waits for their
 * replies, 0 when nothing could be sent.
 */
static int after_write(rreq *q, int add, const char *ev, size_t ev_len) {
  q->on_reply = index_done;
  q->step = q->got;
  if ((add ? index_add(q) : index_rem(q)) == 0)
    q->step++;
  else if (add)
    sx__redis_index_retry(q->rb);
  if (q->rb->cluster && ev != NULL && ev_len > 0) {
    char ch[SX_NS_MAX + 32];
    sx__rcl_channel(q->rb, sx__rcl_shard_of(q->name), ch, sizeof(ch));
    const char *argv[] = {"SPUBLISH", ch, ev};
    size_t lens[] = {8, strlen(ch), ev_len};
    if (sx__redis_q_send(q, 3, argv, lens) == 0)
      q->step++;
  }
  return q->step > q->got;
}

/* Element i of a script reply as bytes (an event), or NULL. */
static const char *reply_bytes(const redisReply *r, size_t i, size_t *len) {
  if (i >= r->elements || r->element[i]->type != REDIS_REPLY_STRING)
    return NULL;
  *len = r->element[i]->len;
  return r->element[i]->str;
}

static void publish_reply(rreq *q, redisReply *r) {
  const char *word;
  if (script_reply(q, r, &word))
    return;
  if (strcmp(word, "OK") == 0) {
    if (sx__redis_parse_u64(sx__redis_elem_str(r, 1, 24), &q->server_now)) {
      sx__redis_q_finish(q, SX_ESTORE, "%s: %s: the script answered OK without a time", q->name,
               q->what);
      return;
    }
    if (!after_write(q, 1, (const char *)q->put_ev, q->put_ev_len))
      sx__redis_q_finish(q, 0, NULL);
  } else if (strcmp(word, "FENCED") == 0) {
    fenced(q, r);
  } else if (strcmp(word, "HELD") == 0) {
    const char *inc = sx__redis_elem_str(r, 1, 64);
    uint64_t age;
    int64_t ttl;
    if (sx__redis_parse_held(r, q->rep.holder, &age, &ttl) != 0)
      inc = "(unreadable)";
    q->rep.holder_age_ms = age;
    q->rep.holder_ttl_ms = ttl;
    sx__redis_q_finish(q, SX_EHELD, "%s is held by incarnation %s (last renewed %" PRIu64
             " ms ago, lease left %" PRId64 " ms); publish with takeover to replace it",
             q->name, inc, age, ttl);
  } else if (strcmp(word, "GENERATION") == 0) {
    const char *cur = sx__redis_elem_str(r, 1, 24);
    sx__redis_q_finish(q, SX_EGENERATION, "%s: generation %s is not above the stored %s", q->name,
             q->gen, cur ? cur : "?");
  } else {
    sx__redis_q_finish(q, SX_ESTORE, "%s: publish: unexpected script status", q->name);
  }
}

static int start_script(rreq *q) { return q_script(q); }

static int check_name(const char *name) {
  if (name == NULL)
    return sx__err(SX_EINVAL, "segment name is NULL");
  return sx_name_validate(name);
}

static int redis_publish(sx_backend *b, const sx_publish_req *req, sx_backend_cb cb,
                         void *arg) {
  redis_backend *rb = (redis_backend *)b;
  int rc = check_name(req->name);
  if (rc)
    return rc;
  if (req->incarnation == NULL || req->lease_ms == 0 || req->value == NULL)
    return sx__err(SX_EINVAL, "%s: publish needs an incarnation, a value and a lease",
                   req->name);
  if (req->len > SX_MAX_DESC_BYTES)
    return sx__err(SX_ELIMIT, "%s: value of %zu bytes is over the %u-byte limit",
                   req->name, req->len, SX_MAX_DESC_BYTES);
  rreq *q = sx__redis_q_new(rb, req->name, cb, arg, "publish", start_script, publish_reply);
  if (q == NULL)
    return sx__err(SX_ENOMEM, "%s: publish", req->name);
  q->script = SX_SCRIPT_PUBLISH;
  sx_hex(req->incarnation, SX_INCARNATION_LEN, q->inc_hex);
  snprintf(q->gen, sizeof(q->gen), "%" PRIu64, req->generation);
  snprintf(q->lease, sizeof(q->lease), "%u", req->lease_ms);
  q->takeover = req->takeover;
  q->value = malloc(req->len ? req->len : 1);
  sx_event ev = {.kind = SX_EVENT_PUT, .generation = req->generation};
  snprintf(ev.name, sizeof(ev.name), "%s", req->name);
  memcpy(ev.incarnation, req->incarnation, SX_INCARNATION_LEN);
  rc = q->value ? sx_event_encode(&ev, &q->put_ev, &q->put_ev_len) : SX_ENOMEM;
  ev.kind = SX_EVENT_DELETE;
  if (rc == 0)
    rc = sx_event_encode(&ev, &q->del_ev, &q->del_ev_len);
  if (rc) {
    sx__redis_q_free(q);
    return sx__err(rc, "%s: publish: cannot encode the event", req->name);
  }
  memcpy(q->value, req->value, req->len);
  q->len = req->len;
  return sx__redis_q_issue(q);
}

static void renew_reply(rreq *q, redisReply *r) {
  const char *word;
  if (script_reply(q, r, &word))
    return;
  if (strcmp(word, "OK") == 0) {
    if (sx__redis_parse_u64(sx__redis_elem_str(r, 1, 24), &q->server_now)) {
      sx__redis_q_finish(q, SX_ESTORE, "%s: renew: the script answered OK without a time", q->name);
      return;
    }
    /* The entry is not due: it was written less than the refresh interval
     * ago.  A reply without the word (not ours) counts as due. */
    const char *due = sx__redis_elem_str(r, 2, 1);
    if (due != NULL && due[0] == '0') {
      sx__redis_q_finish(q, 0, NULL);
      return;
    }
    if (!after_write(q, 1, NULL, 0))
      sx__redis_q_finish(q, 0, NULL);
  } else if (strcmp(word, "GONE") == 0) {
    sx__redis_q_finish(q, SX_EGONE, "%s: %s: the segment is gone from the store (lease expired, or "
             "the store lost its data); republish it", q->name, q->what);
  } else if (strcmp(word, "FENCED") == 0) {
    fenced(q, r);
  } else {
    sx__redis_q_finish(q, SX_ESTORE, "%s: %s: unexpected script status", q->name, q->what);
  }
}

static int redis_renew(sx_backend *b, const char *name, const uint8_t *inc,
                       uint32_t lease_ms, sx_backend_cb cb, void *arg) {
  int rc = check_name(name);
  if (rc)
    return rc;
  if (inc == NULL || lease_ms == 0)
    return sx__err(SX_EINVAL, "%s: renew needs an incarnation and a lease", name);
  rreq *q = sx__redis_q_new((redis_backend *)b, name, cb, arg, "renew", start_script, renew_reply);
  if (q == NULL)
    return sx__err(SX_ENOMEM, "%s: renew", name);
  q->script = SX_SCRIPT_RENEW;
  sx_hex(inc, SX_INCARNATION_LEN, q->inc_hex);
  snprintf(q->lease, sizeof(q->lease), "%u", lease_ms);
  return sx__redis_q_issue(q);
}

static void unpublish_reply(rreq *q, redisReply *r) {
  const char *word;
  if (script_reply(q, r, &word))
    return;
  if (strcmp(word, "OK") == 0) {
    size_t evl = 0;
    const char *ev = reply_bytes(r, 1, &evl);
    if (!after_write(q, 0, ev, evl))
      sx__redis_q_finish(q, 0, NULL);
  } else if (strcmp(word, "GONE") == 0) {
    sx__redis_q_finish(q, SX_EGONE, "%s: unpublish: the segment is already gone", q->name);
  } else if (strcmp(word, "FENCED") == 0) {
    fenced(q, r);
  } else {
    sx__redis_q_finish(q, SX_ESTORE, "%s: unpublish: unexpected script status", q->name);
  }
}

static int redis_unpublish(sx_backend *b, const char *name, const uint8_t *inc,
                           sx_backend_cb cb, void *arg) {
  int rc = check_name(name);
  if (rc)
    return rc;
  if (inc == NULL)
    return sx__err(SX_EINVAL, "%s: unpublish needs an incarnation", name);
  rreq *q = sx__redis_q_new((redis_backend *)b, name, cb, arg, "unpublish", start_script,
                  unpublish_reply);
  if (q == NULL)
    return sx__err(SX_ENOMEM, "%s: unpublish", name);
  q->script = SX_SCRIPT_UNPUBLISH;
  sx_hex(inc, SX_INCARNATION_LEN, q->inc_hex);
  return sx__redis_q_issue(q);
}

static void remove_reply(rreq *q, redisReply *r) {
  const char *word;
  if (script_reply(q, r, &word))
    return;
  if (strcmp(word, "OK") == 0 || strcmp(word, "NOENT") == 0) {
    /* Drop the index entry in both cases: a NOENT name may still be listed
     * until its score is pruned. */
    size_t evl = 0;
    const char *ev = reply_bytes(r, 2, &evl);
    if (strcmp(word, "NOENT") == 0)
      q->rep.status = SX_ENOENT;
    if (!after_write(q, 0, ev, evl) || q->rep.status)
      sx__redis_q_finish(q, q->rep.status, "%s: no such segment", q->name);
  } else {
    sx__redis_q_finish(q, SX_ESTORE, "%s: remove: unexpected script status", q->name);
  }
}

static int redis_remove(sx_backend *b, const char *name, sx_backend_cb cb, void *arg) {
  int rc = check_name(name);
  if (rc)
    return rc;
  rreq *q = sx__redis_q_new((redis_backend *)b, name, cb, arg, "remove", start_script, remove_reply);
  if (q == NULL)
    return sx__err(SX_ENOMEM, "%s: remove", name);
  q->script = SX_SCRIPT_REMOVE;
  return sx__redis_q_issue(q);
}

/* ------------------------------------------------------------ reads */

static void get_reply(rreq *q, redisReply *r) {
  if (q->got == 1) {
    /* Keep the HMGET reply's content until the PTTL reply arrives. */
    if (r->type == REDIS_REPLY_ERROR) {
      char msg[320];
      int rc = sx__redis_read_error(r, msg, sizeof(msg));
      sx__reply_fail(&q->rep, rc, "%s: %s", q->name, msg);
      return;
    }
    redisReply ttl = {.type = REDIS_REPLY_NIL};
    char msg[200] = "";
    int rc = sx__redis_read_value(r, &ttl, &q->got_value, &q->len, &q->rep.ttl_ms,
                                  &q->got_lease, msg, sizeof(msg));
    if (rc)
      sx__reply_fail(&q->rep, rc, "%s: %s", q->name, msg);
    return;
  }
  if (q->rep.status) {
    sx__redis_q_finish(q, q->rep.status, NULL);
    return;
  }
  if (q->got_value == NULL) {
    sx__redis_q_finish(q, SX_ENOENT, "%s: no such segment", q->name);
    return;
  }
  if (r->type == REDIS_REPLY_INTEGER && r->integer >= 0) {
    q->rep.ttl_ms = r->integer;
    if (q->got_lease > 0)
      q->rep.holder_age_ms =
          q->got_lease > r->integer ? (uint64_t)(q->got_lease - r->integer) : 0;
  }
  q->rep.value = q->got_value;
  q->rep.len = q->len;
  sx__redis_q_finish(q, 0, NULL);
}

static int get_start(rreq *q) {
  char key[SX_REDIS_KEY_MAX];
  const char *hm[] = {"HMGET", sx__redis_seg_key(q, key), "d", "lease"};
  const char *pt[] = {"PTTL", key};
  int rc = sx__redis_q_send(q, 4, hm, NULL);
  return rc ? rc : sx__redis_q_send(q, 2, pt, NULL);
}

static int redis_get(sx_backend *b, const char *name, sx_backend_cb cb, void *arg) {
  int rc = check_name(name);
  if (rc)
    return rc;
  rreq *q = sx__redis_q_new((redis_backend *)b, name, cb, arg, "get", get_start, get_reply);
  if (q == NULL)
    return sx__err(SX_ENOMEM, "%s: get", name);
  return sx__redis_q_issue(q);
}

/* fetch: the value alone, in one HGET (no PTTL), handed to the caller
 * straight from hiredis' reply, which lives until the callback returns.
 * HGET rather than HMGET of one field: a bulk string, not an array of one,
 * is one reply object less to build on both ends. */
static void fetch_reply(rreq *q, redisReply *r) {
  if (r->type == REDIS_REPLY_ERROR) {
    char msg[320];
    int rc = sx__redis_read_error(r, msg, sizeof(msg));
    sx__redis_q_finish(q, rc, "%s: %s", q->name, msg);
    return;
  }
  const redisReply *d = r;
  if (d->type == REDIS_REPLY_NIL) {
    sx__redis_q_finish(q, SX_ENOENT, "%s: no such segment", q->name);
  } else if (d->type != REDIS_REPLY_STRING) {
    sx__redis_q_finish(q, SX_EDECODE, "%s: field d is not a string", q->name);
  } else if (d->len > SX_MAX_DESC_BYTES) {
    sx__redis_q_finish(q, SX_ELIMIT, "%s: stored value of %zu bytes is over the %u-byte limit", q->name,
             d->len, SX_MAX_DESC_BYTES);
  } else {
    q->rep.value = (const uint8_t *)d->str;
    q->rep.len = d->len;
    sx__redis_q_finish(q, 0, NULL);
  }
}

static int fetch_start(rreq *q) {
  char key[SX_REDIS_KEY_MAX];
  const char *hg[] = {"HGET", sx__redis_seg_key(q, key), "d"};
  return sx__redis_q_send(q, 3, hg, NULL);
}

static int redis_fetch(sx_backend *b, const char *name, sx_backend_cb cb, void *arg) {
  int rc = check_name(name);
  if (rc)
    return rc;
  rreq *q = sx__redis_q_new((redis_backend *)b, name, cb, arg, "get", fetch_start, fetch_reply);
  if (q == NULL)
    return sx__err(SX_ENOMEM, "%s: get", name);
  return sx__redis_q_issue(q);
}

/*
 * list: prune the index (a failure is fine: read-only users may not write),
 * read its members, then each member's value and TTL in one pipeline.  On a
 * cluster the same for each piece of the index, all pipelined; the names
 * come together before the values are read.  q->step counts the replies
 * before the values'.
 */
static void list_values_reply(rreq *q, redisReply *r) {
  size_t k = (size_t)(q->got - q->step - 1); /* replies of this step so far, minus one */
  size_t i = k / 2;
  if (i >= q->n_names)
    return;
  sx_backend_item *it = &q->items[i];
  if (k % 2 == 0) {
    redisReply ttl = {.type = REDIS_REPLY_NIL};
    char msg[200] = "";
    int64_t lease;
    int rc = sx__redis_read_value(r, &ttl, &q->values[i], &it->len, &it->ttl_ms, &lease,
                                  msg, sizeof(msg));
    if (rc != 0) {
      /* One bad entry does not spoil the listing: report it in place. */
      it->status = rc;
      free(q->values[i]);
      q->values[i] = NULL;
      it->len = 0;
    }
    it->value = q->values[i];
  } else {
    if (r->type == REDIS_REPLY_INTEGER && r->integer >= 0)
      it->ttl_ms = r->integer;
    if (i + 1 == q->n_names) {
      q->rep.items = q->items;
      q->rep.n_items = q->n_names;
      sx__redis_q_finish(q, 0, NULL);
    }
  }
}

/* Add the names of one index reply; 0, or -1 when the op was failed. */
static int list_collect(rreq *q, const redisReply *r, const char *key) {
  char desc[200];
  if (r->type == REDIS_REPLY_ERROR) {
    sx__redis_describe(r, desc, sizeof(desc));
    sx__redis_q_finish(q, sx__redis_map_error(r), "list: reading the index %s failed: %s",
                       key, desc);
    return -1;
  }
  if (r->type != REDIS_REPLY_ARRAY || r->elements > SX_REDIS_MAX_LIST - q->n_names) {
    sx__redis_describe(r, desc, sizeof(desc));
    sx__redis_q_finish(q, SX_ESTORE, "list: unexpected index reply: %s", desc);
    return -1;
  }
  size_t n = q->n_names + r->elements;
  char **names = realloc(q->names, (n + 1) * sizeof(char *));
  if (names != NULL)
    q->names = names;
  uint8_t **values = names ? realloc(q->values, (n + 1) * sizeof(uint8_t *)) : NULL;
  if (values != NULL)
    q->values = values;
  sx_backend_item *items = values ? realloc(q->items, (n + 1) * sizeof(*items)) : NULL;
  if (items == NULL) {
    sx__redis_q_finish(q, SX_ENOMEM, "list: out of memory for %zu entries", n);
    return -1;
  }
  q->items = items;
  for (size_t i = 0; i < r->elements; i++) {
    const char *name = sx__redis_elem_str(r, i, SX_NAME_MAX);
    /* Skip members that are no segment name: keys built from them could
     * reach outside the namespace's hash tags. */
    if (name == NULL || sx_name_validate(name) != 0)
      continue;
    if ((q->names[q->n_names] = strdup(name)) == NULL) {
      sx__redis_q_finish(q, SX_ENOMEM, "list: out of memory");
      return -1;
    }
    q->values[q->n_names] = NULL;
    memset(&q->items[q->n_names], 0, sizeof(q->items[0]));
    q->items[q->n_names].name = q->names[q->n_names];
    q->items[q->n_names].ttl_ms = -1;
    q->n_names++;
  }
  return 0;
}

/* Read every collected name's value and TTL. */
static void list_fetch(rreq *q) {
  if (q->n_names == 0) {
    sx__redis_q_finish(q, 0, NULL);
    return;
  }
  q->step = q->got;
  q->on_reply = list_values_reply;
  for (size_t i = 0; i < q->n_names; i++) {
    char key[SX_REDIS_KEY_MAX];
    sx__redis_key(key, q->rb->seg_prefix, q->names[i], strlen(q->names[i]));
    const char *hm[] = {"HMGET", key, "d", "lease"};
    const char *pt[] = {"PTTL", key};
    int rc = sx__redis_q_send(q, 4, hm, NULL);
    if (rc == 0)
      rc = sx__redis_q_send(q, 2, pt, NULL);
    if (rc) {
      sx__redis_q_finish(q, rc, "list: %s", sx_errmsg());
      return;
    }
  }
}

/* Replies: (prune, range) per index key, in order; prunes are ignored
 * (only a dead connection matters, which the request layer handles). */
static void list_index_reply(rreq *q, redisReply *r) {
  if (q->got % 2 == 1)
    return;
  char key[SX_NS_MAX + 32];
  const char *k = q->rb->index_key;
  if (q->rb->cluster) {
    sx__rcl_index_key(q->rb, (unsigned)(q->got / 2 - 1), key, sizeof(key));
    k = key;
  }
  if (list_collect(q, r, k) != 0)
    return;
  if (q->got == 2 * (q->rb->cluster ? SX_RCL_SHARDS : 1))
    list_fetch(q);
}

static int list_start(rreq *q) {
  char cutoff[32], key[SX_NS_MAX + 32];
  uint64_t now = sx__wall_ms();
  snprintf(cutoff, sizeof(cutoff), "%" PRIu64,
           now > SX_REDIS_INDEX_GRACE_MS ? now - SX_REDIS_INDEX_GRACE_MS : 0);
  unsigned pieces = q->rb->cluster ? SX_RCL_SHARDS : 1;
  for (unsigned i = 0; i < pieces; i++) {
    const char *k = q->rb->index_key;
    if (q->rb->cluster) {
      sx__rcl_index_key(q->rb, i, key, sizeof(key));
      k = key;
    }
    const char *prune[] = {"ZREMRANGEBYSCORE", k, "-inf", cutoff};
    const char *range[] = {"ZRANGE", k, "0", "-1"};
    int rc = sx__redis_q_send(q, 4, prune, NULL);
    if (rc == 0)
      rc = sx__redis_q_send(q, 4, range, NULL);
    if (rc)
      return rc;
  }
  return 0;
}

static int redis_list(sx_backend *b, sx_backend_cb cb, void *arg) {
  rreq *q = sx__redis_q_new((redis_backend *)b, NULL, cb, arg, "list", list_start, list_index_reply);
  if (q == NULL)
    return sx__err(SX_ENOMEM, "list");
  snprintf(q->name, sizeof(q->name), "%s", b->url.ns);
  return sx__redis_q_issue(q);
}

const sx_backend_ops sx__backend_redis_ops = {
    .scheme = "redis",
    .open = sx__redis_open,
    .close = sx__redis_close,
    .publish = redis_publish,
    .renew = redis_renew,
    .unpublish = redis_unpublish,
    .get = redis_get,
    .fetch = redis_fetch,
    .list = redis_list,
    .remove = redis_remove,
    .watch = sx__redis_watch,
};
