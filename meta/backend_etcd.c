/*
 * etcd://host[:port][,host[:port]...][?namespace=NS&timeout_ms=N&connect_timeout_ms=N]
 * (and etcd+https://): the store ops table over etcd v3's JSON gateway.
 *
 * Key layout: see etcd.h.  Every op is a short chain of HTTP requests, each
 * step a callback of the previous one:
 *
 *   publish    txn(read own + my fence) -> [timetolive of the holder: HELD]
 *              -> [grant a 24 h fence lease, on takeover] -> grant lease L
 *              -> txn(if own unchanged and I am not fenced: put seg, own
 *                 [, fence the holder]; else read again) -> revoke the old L
 *   renew      txn(read own + my fence) -> lease keepalive of own's lease
 *   unpublish  txn(read) -> txn(if unchanged: tombstone, delete seg, own)
 *              -> revoke L
 *   get        range seg/NAME -> timetolive (lease left)
 *   list       range over seg/ -> timetolive of each lease (8 at a time)
 *   remove     txn(read own + seg) -> [grant fence lease] -> txn(if
 *              unchanged: tombstone, delete, fence the holder) -> revoke L
 *
 * The fenced writes are optimistic transactions: the first step reads the
 * owner record, the write compares its mod_revision, so a write that raced
 * with another one fails as a whole and is judged again on the fresh read
 * that the transaction's failure branch returns.  etcd's transactions are
 * linearizable, so two claimants can never both win.
 *
 * The lease ID lives in the owner record, read in the same snapshot as the
 * fence check, so renew and unpublish need no client-side state and work
 * the same from any backend instance (an agent that reopened its store).
 * The lease length is fixed at publish: etcd cannot change a lease's TTL, so
 * renew keeps the length the segment was published with.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "etcd.h"
#include "internal.h"

#define MAX_ATTEMPTS 8    /* optimistic transactions that lost a race */
#define LIST_TTL_MAX 1024 /* leases looked up per list; the rest read -1 */
#define LIST_TTL_WINDOW 8

typedef void (*step_fn)(sx__etcd_op *o, int status, json_t *body, const char *msg);

struct sx__etcd_op {
  sx__etcd_op *prev, *next;
  sx__etcd_backend *eb;
  const char *what;
  sx_backend_cb cb;
  void *arg;
  sx__etcd_call *call;
  step_fn step;
  sx_backend_reply rep;
  char name[SX_NAME_MAX + 1];
  uint8_t inc[SX_INCARNATION_LEN];
  char inc_hex[2 * SX_INCARNATION_LEN + 1];
  uint64_t gen;
  uint8_t *value;
  size_t len;
  uint32_t lease_ms;
  int takeover;
  int attempts;
  /* Read in the first step. */
  int64_t own_rev, seg_rev, own_lease;
  int has_holder; /* own names another incarnation (publish) or anyone (remove) */
  sx__etcd_owner holder;
  /* Leases this op granted, and whether a successful write now uses them. */
  int64_t lease, fence_lease;
  int lease_used, fence_used;
  /* get and list results. */
  uint8_t *out;
  size_t out_len;
  sx__etcd_kv *kvs;
  sx_backend_item *items;
  char (*names)[SX_NAME_MAX + 1];
  size_t n_items;
  sx__etcd_call **ttl_calls;
  struct ttl_req {
    sx__etcd_op *o;
    size_t i;
  } * ttl_reqs;
  size_t ttl_next, ttl_busy, ttl_max;
};

/* ---------------------------------------------------------------- helpers */

static void key_of(const sx__etcd_backend *eb, char *buf, const char *kind,
                   const char *name, const char *suffix) {
  snprintf(buf, SX_ETCD_KEY_MAX, "%s%s/%s%s%s", eb->prefix, kind, name, suffix ? "/" : "",
           suffix ? suffix : "");
}

/* ---------------------------------------------------------------- ops */

static void op_free(sx__etcd_op *o) {
  sx__etcd_cancel(o->call);
  if (o->ttl_calls)
    for (size_t i = 0; i < o->n_items; i++)
      sx__etcd_cancel(o->ttl_calls[i]);
  if (o->kvs)
    for (size_t i = 0; i < o->n_items; i++)
      sx__etcd_kv_free(&o->kvs[i]);
  free(o->kvs);
  free(o->items);
  free(o->names);
  free(o->ttl_calls);
  free(o->ttl_reqs);
  free(o->value);
  free(o->out);
  free(o);
}

static void op_unlink(sx__etcd_op *o) {
  sx__etcd_backend *eb = o->eb;
  if (o->prev)
    o->prev->next = o->next;
  else if (eb->ops == o)
    eb->ops = o->next;
  if (o->next)
    o->next->prev = o->prev;
  o->prev = o->next = NULL;
}

/* A request nobody waits for (revoking a lease no longer needed).  Close
 * cancels it; the lease then runs out by itself. */
static void detached_done(void *arg, int status, json_t *body, const char *msg) {
  sx__etcd_conn_note(arg, status, body, msg);
}

static void revoke_detached(sx__etcd_backend *eb, int64_t lease) {
  if (lease == 0 || eb->closing)
    return;
  json_t *req = sx__etcd_id_req("ID", lease);
  if (req != NULL)
    sx__etcd_post(eb->http, "/v3/lease/revoke", req, detached_done, eb, NULL);
  json_decref(req);
}

/* Deliver the op's result and free it.  Leases it granted but did not put
 * to use are revoked. */
static void op_finish(sx__etcd_op *o, int status, const char *fmt, ...) SX__PRINTF(3, 4);
static void op_finish(sx__etcd_op *o, int status, const char *fmt, ...) {
  sx__etcd_backend *eb = o->eb;
  op_unlink(o);
  if (!o->lease_used)
    revoke_detached(eb, o->lease);
  if (!o->fence_used)
    revoke_detached(eb, o->fence_lease);
  o->rep.status = status;
  if (status != 0 && fmt != NULL) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(o->rep.message, sizeof(o->rep.message), fmt, ap);
    va_end(ap);
  }
  if (o->cb)
    o->cb(o->arg, &o->rep);
  op_free(o);
}

static void op_done(void *arg, int status, json_t *body, const char *msg) {
  sx__etcd_op *o = arg;
  sx__etcd_backend *eb = o->eb;
  o->call = NULL;
  sx__etcd_conn_note(eb, status, body, msg);
  if (eb->closing)
    return; /* close() has already answered this op with SX_ECANCELED */
  o->step(o, status, body, msg);
}

/* Send the next request of an op; the JSON is consumed.  On failure the op
 * is finished with the error. */
static void op_send(sx__etcd_op *o, const char *path, json_t *req, step_fn step) {
  int rc = req ? sx__etcd_post(o->eb->http, path, req, op_done, o, &o->call) : SX_ENOMEM;
  json_decref(req);
  if (rc == 0) {
    o->step = step;
    return;
  }
  op_finish(o, rc, "%s %s: %s", o->what, o->name,
            rc == SX_ENOMEM ? "out of memory" : sx_errmsg());
}

static sx__etcd_op *op_new(sx_backend *b, const char *what, const char *name,
                           sx_backend_cb cb, void *arg, int *rc) {
  sx__etcd_backend *eb = (sx__etcd_backend *)b;
  if (eb->closing) {
    *rc = sx__err(SX_ECANCELED, "etcd: the store is closing");
    return NULL;
  }
  if (name != NULL && (*rc = sx_name_validate(name)) != 0)
    return NULL;
  sx__etcd_op *o = calloc(1, sizeof(*o));
  if (o == NULL) {
    *rc = sx__err(SX_ENOMEM, "etcd: %s: out of memory", what);
    return NULL;
  }
  o->eb = eb;
  o->what = what;
  o->cb = cb;
  o->arg = arg;
  o->rep.ttl_ms = -1;
  o->rep.holder_ttl_ms = -1;
  if (name)
    snprintf(o->name, sizeof(o->name), "%s", name);
  o->next = eb->ops;
  if (eb->ops)
    eb->ops->prev = o;
  eb->ops = o;
  *rc = 0;
  return o;
}

/* Start an op's first request; on failure unlink and free it silently (the
 * caller returns the error, so the callback must never run). */
static int op_begin(sx__etcd_op *o, const char *path, json_t *req, step_fn step) {
  int rc = req ? sx__etcd_post(o->eb->http, path, req, op_done, o, &o->call) : SX_ENOMEM;
  json_decref(req);
  if (rc == 0) {
    o->step = step;
    return 0;
  }
  if (rc == SX_ENOMEM)
    sx__err(rc, "etcd: %s: out of memory", o->what);
  op_unlink(o);
  op_free(o);
  return rc;
}

static void set_inc(sx__etcd_op *o, const uint8_t *inc) {
  memcpy(o->inc, inc, SX_INCARNATION_LEN);
  sx_hex(inc, SX_INCARNATION_LEN, o->inc_hex);
}

/* The read every fenced op starts with: own/NAME and fence/NAME/<mine>
 * (or seg/NAME for remove), in one snapshot. */
static json_t *read_ops(sx__etcd_op *o, int with_seg) {
  char own[SX_ETCD_KEY_MAX], other[SX_ETCD_KEY_MAX];
  key_of(o->eb, own, "own", o->name, NULL);
  if (with_seg)
    key_of(o->eb, other, "seg", o->name, NULL);
  else
    key_of(o->eb, other, "fence", o->name, o->inc_hex);
  json_t *a = sx__etcd_japp(json_array(), sx__etcd_range(own, NULL, 0));
  return sx__etcd_japp(a, sx__etcd_range(other, NULL, with_seg));
}

/* A read of own/NAME and fence/NAME/<mine> (the first step, or a failed
 * transaction's failure branch), decoded. */
typedef struct seen {
  int found, fenced, parsed;
  sx__etcd_kv kv;
  sx__etcd_owner who;
} seen;

/* 0, or the answer is malformed and the op is finished with the error. */
static int read_seen(sx__etcd_op *o, const json_t *body, seen *s) {
  char err[200];
  sx__etcd_kv fence;
  memset(s, 0, sizeof(*s));
  int rc = sx__etcd_txn_kv(body, 0, &s->kv, &s->found, err, sizeof(err));
  if (rc == 0)
    rc = sx__etcd_txn_kv(body, 1, &fence, &s->fenced, err, sizeof(err));
  if (rc != 0) {
    if (s->found)
      sx__etcd_kv_free(&s->kv);
    op_finish(o, rc, "etcd %s: %s %s: %s", sx__etcd_endpoint(o->eb->http), o->what,
              o->name, err);
    return rc;
  }
  if (s->fenced)
    sx__etcd_kv_free(&fence);
  if (s->found)
    s->parsed = sx__etcd_owner_parse(s->kv.value, s->kv.value_len, &s->who) == 0;
  return 0;
}

static void fenced_finish(sx__etcd_op *o, const seen *s) {
  if (s->found && s->parsed && !s->fenced) {
    char hex[2 * SX_INCARNATION_LEN + 1];
    sx_hex(s->who.inc, SX_INCARNATION_LEN, hex);
    op_finish(o, SX_EFENCED, "%s: %s: the name is now held by incarnation %s", o->what,
              o->name, hex);
  } else if (s->found && !s->fenced) {
    op_finish(o, SX_EFENCED, "%s: %s: the owner record is not one this library wrote",
              o->what, o->name);
  } else {
    op_finish(o, SX_EFENCED,
              "%s: %s: incarnation %s was fenced (taken over, or removed "
              "by an admin)",
              o->what, o->name, o->inc_hex);
  }
}

/* For renew and unpublish: 0 if the segment is ours, else finish. */
static int own_or_finish(sx__etcd_op *o, seen *s) {
  if (s->fenced ||
      (s->found && (!s->parsed || memcmp(s->who.inc, o->inc, SX_INCARNATION_LEN) != 0))) {
    fenced_finish(o, s);
  } else if (!s->found || s->kv.lease == 0) {
    op_finish(o, SX_EGONE,
              "%s: %s: no such segment (its lease expired, or the store "
              "lost it)",
              o->what, o->name);
  } else {
    return 0;
  }
  if (s->found)
    sx__etcd_kv_free(&s->kv);
  return 1;
}

/* ---------------------------------------------------------------- publish */

static void pub_judge(sx__etcd_op *o, const json_t *body);
static void pub_leases(sx__etcd_op *o);
static void pub_read_done(sx__etcd_op *o, int status, json_t *body, const char *msg);

static void pub_revoked(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  (void)status, (void)body, (void)msg; /* the old lease runs out anyway */
  op_finish(o, 0, NULL);
}

static void pub_written(sx__etcd_op *o) {
  o->lease_used = 1;
  if (o->own_lease != 0 && o->own_lease != o->lease) {
    op_send(o, "/v3/lease/revoke", sx__etcd_id_req("ID", o->own_lease), pub_revoked);
    return;
  }
  op_finish(o, 0, NULL);
}

static void pub_txn_done(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  if (status == SX_ENOENT) {
    /* "requested lease not found": a lease we granted ran out before the
     * write (a very slow store); grant fresh ones. */
    o->lease = o->fence_lease = 0;
    if (++o->attempts > MAX_ATTEMPTS)
      op_finish(o, SX_ESTORE, "publish %s: %s", o->name, msg);
    else
      pub_leases(o);
    return;
  }
  if (status != 0) {
    op_finish(o, status, "publish %s: %s", o->name, msg);
    return;
  }
  if (sx__etcd_txn_ok(body)) {
    o->fence_used = o->has_holder;
    pub_written(o);
    return;
  }
  if (++o->attempts > MAX_ATTEMPTS) {
    op_finish(o, SX_ESTORE, "publish %s: the name kept changing under %d attempts",
              o->name, MAX_ATTEMPTS);
    return;
  }
  pub_judge(o, body);
}

static void pub_txn(sx__etcd_op *o) {
  sx__etcd_backend *eb = o->eb;
  char seg[SX_ETCD_KEY_MAX], own[SX_ETCD_KEY_MAX], fence[SX_ETCD_KEY_MAX];
  char rec[256];
  key_of(eb, seg, "seg", o->name, NULL);
  key_of(eb, own, "own", o->name, NULL);
  key_of(eb, fence, "fence", o->name, o->inc_hex);
  int n = sx__etcd_owner_text(rec, sizeof(rec), o->inc, o->gen,
                              sx__etcd_ttl_s(o->lease_ms), NULL);
  json_t *cmp = sx__etcd_japp(json_array(), sx__etcd_cmp("MOD", own, o->own_rev));
  cmp = sx__etcd_japp(cmp, sx__etcd_cmp("CREATE", fence, 0));
  json_t *ok = sx__etcd_japp(json_array(), sx__etcd_put(seg, o->value, o->len, o->lease));
  ok = sx__etcd_japp(ok, sx__etcd_put(own, rec, (size_t)n, o->lease));
  if (o->has_holder) {
    char holder_hex[2 * SX_INCARNATION_LEN + 1], hfence[SX_ETCD_KEY_MAX], frec[160];
    sx_hex(o->holder.inc, SX_INCARNATION_LEN, holder_hex);
    key_of(eb, hfence, "fence", o->name, holder_hex);
    int fn = snprintf(frec, sizeof(frec),
                      "{\"v\":1,\"by\":\"%s\",\"at\":%llu,"
                      "\"why\":\"takeover\"}",
                      o->inc_hex, (unsigned long long)sx__wall_ms());
    ok = sx__etcd_japp(ok, sx__etcd_put(hfence, frec, (size_t)fn, o->fence_lease));
  }
  op_send(o, "/v3/kv/txn", sx__etcd_txn(cmp, ok, read_ops(o, 0)), pub_txn_done);
}

static void pub_granted(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  int64_t id = 0;
  if (status == 0 && (sx__etcd_i64(body, "ID", &id) != 0 || id == 0)) {
    status = SX_EPROTO;
    msg = "the lease grant answer has no lease ID";
  }
  if (status != 0) {
    op_finish(o, status, "publish %s: lease grant: %s", o->name, msg);
    return;
  }
  if (o->has_holder && o->fence_lease == 0)
    o->fence_lease = id;
  else
    o->lease = id;
  pub_leases(o);
}

/* Grant what the write needs (a fence lease on takeover, the segment's
 * lease), then write. */
static void pub_leases(sx__etcd_op *o) {
  if (o->has_holder && o->fence_lease == 0)
    op_send(o, "/v3/lease/grant", sx__etcd_id_req("TTL", SX_ETCD_FENCE_TTL_S),
            pub_granted);
  else if (o->lease == 0)
    op_send(o, "/v3/lease/grant", sx__etcd_id_req("TTL", sx__etcd_ttl_s(o->lease_ms)),
            pub_granted);
  else
    pub_txn(o);
}

static void pub_held(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  int64_t ttl = -1, granted = 0;
  (void)msg;
  if (status == 0 && (sx__etcd_i64(body, "TTL", &ttl) != 0 ||
                      sx__etcd_i64(body, "grantedTTL", &granted) != 0))
    ttl = -1;
  if (status == 0 && ttl < 0 && ++o->attempts <= MAX_ATTEMPTS) {
    /* The holder's lease ran out while we looked: read again. */
    op_send(o, "/v3/kv/txn", sx__etcd_txn(NULL, read_ops(o, 0), NULL), pub_read_done);
    return;
  }
  uint64_t now = sx__wall_ms();
  uint64_t age =
      o->holder.pub_ms && o->holder.pub_ms <= now ? now - o->holder.pub_ms : UINT64_MAX;
  if (ttl >= 0 && granted >= ttl && (uint64_t)(granted - ttl) * 1000 < age)
    age = (uint64_t)(granted - ttl) * 1000; /* since the last keepalive, to 1 s */
  if (age == UINT64_MAX)
    age = 0;
  memcpy(o->rep.holder, o->holder.inc, SX_INCARNATION_LEN);
  o->rep.holder_age_ms = age;
  o->rep.holder_ttl_ms = ttl >= 0 ? ttl * 1000 : -1;
  char hex[2 * SX_INCARNATION_LEN + 1];
  sx_hex(o->holder.inc, SX_INCARNATION_LEN, hex);
  op_finish(o, SX_EHELD,
            "publish %s: held by incarnation %s (lease left %lld ms, "
            "renewed %llu ms ago); publish with takeover to replace it",
            o->name, hex, (long long)o->rep.holder_ttl_ms, (unsigned long long)age);
}

/* Decide from a read of own + my fence. */
static void pub_judge(sx__etcd_op *o, const json_t *body) {
  seen s;
  if (read_seen(o, body, &s) != 0)
    return;
  if (s.fenced) {
    fenced_finish(o, &s);
    goto out;
  }
  o->own_rev = s.found ? s.kv.mod_rev : 0;
  o->own_lease = s.found ? s.kv.lease : 0;
  o->has_holder = 0;
  if (s.found && s.parsed && memcmp(s.who.inc, o->inc, SX_INCARNATION_LEN) != 0) {
    o->holder = s.who;
    if (!o->takeover) {
      if (s.kv.lease == 0) {
        o->rep.holder_ttl_ms = -1;
        pub_held(o, SX_ENOENT, NULL, NULL);
      } else {
        op_send(o, "/v3/lease/timetolive", sx__etcd_id_req("ID", s.kv.lease), pub_held);
      }
      goto out;
    }
    o->has_holder = 1;
  } else if (s.found && s.parsed) {
    if (o->lease != 0 && s.kv.lease == o->lease && s.who.gen == o->gen) {
      /* Our own write landed, but its answer was lost on the way. */
      pub_written(o);
      goto out;
    }
    if (s.who.gen >= o->gen) {
      op_finish(o, SX_EGENERATION, "publish %s: generation %llu is not above %llu",
                o->name, (unsigned long long)o->gen, (unsigned long long)s.who.gen);
      goto out;
    }
  }
  /* Absent, ours with a lower generation, unreadable (overwritten like an
   * absent one), or another holder being taken over. */
  pub_leases(o);
out:
  if (s.found)
    sx__etcd_kv_free(&s.kv);
}

static void pub_read_done(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  if (status != 0)
    op_finish(o, status, "publish %s: %s", o->name, msg);
  else
    pub_judge(o, body);
}

static int etcd_publish(sx_backend *b, const sx_publish_req *req, sx_backend_cb cb,
                        void *arg) {
  int rc = sx_name_validate(req->name);
  if (rc != 0)
    return rc;
  if (req->value == NULL || req->len == 0 || req->lease_ms == 0)
    return sx__err(SX_EINVAL, "publish %s: empty value or zero lease", req->name);
  if (req->len > SX_MAX_DESC_BYTES)
    return sx__err(SX_ELIMIT, "publish %s: the value is larger than %u bytes", req->name,
                   SX_MAX_DESC_BYTES);
  sx__etcd_op *o = op_new(b, "publish", req->name, cb, arg, &rc);
  if (o == NULL)
    return rc;
  set_inc(o, req->incarnation);
  o->gen = req->generation;
  o->lease_ms = req->lease_ms;
  o->takeover = req->takeover;
  o->len = req->len;
  o->value = malloc(req->len);
  if (o->value == NULL) {
    op_unlink(o);
    op_free(o);
    return sx__err(SX_ENOMEM, "publish: out of memory");
  }
  memcpy(o->value, req->value, req->len);
  return op_begin(o, "/v3/kv/txn", sx__etcd_txn(NULL, read_ops(o, 0), NULL),
                  pub_read_done);
}

/* ---------------------------------------------------------------- renew */

static void renew_alive(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  int64_t ttl = 0;
  if (status == SX_ENOENT) {
    op_finish(o, SX_EGONE, "renew %s: the lease is gone (expired, or the store lost it)",
              o->name);
    return;
  }
  if (status == 0 && sx__etcd_i64(body, "TTL", &ttl) != 0) {
    status = SX_EPROTO;
    msg = "the keepalive answer has a malformed TTL";
  }
  if (status != 0) {
    op_finish(o, status, "renew %s: keepalive: %s", o->name, msg);
  } else if (ttl <= 0) {
    op_finish(o, SX_EGONE, "renew %s: the lease expired", o->name);
  } else {
    o->rep.ttl_ms = ttl * 1000;
    op_finish(o, 0, NULL);
  }
}

static void renew_read(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  seen s;
  if (status != 0) {
    op_finish(o, status, "renew %s: %s", o->name, msg);
    return;
  }
  if (read_seen(o, body, &s) != 0 || own_or_finish(o, &s))
    return;
  int64_t lease = s.kv.lease;
  sx__etcd_kv_free(&s.kv);
  op_send(o, "/v3/lease/keepalive", sx__etcd_id_req("ID", lease), renew_alive);
}

static int etcd_renew(sx_backend *b, const char *name, const uint8_t *incarnation,
                      uint32_t lease_ms, sx_backend_cb cb, void *arg) {
  int rc;
  (void)lease_ms; /* fixed at publish: etcd leases cannot change their TTL */
  sx__etcd_op *o = op_new(b, "renew", name, cb, arg, &rc);
  if (o == NULL)
    return rc;
  set_inc(o, incarnation);
  return op_begin(o, "/v3/kv/txn", sx__etcd_txn(NULL, read_ops(o, 0), NULL), renew_read);
}

/* ---------------------------------------------------------------- unpublish */

static void unpub_judge(sx__etcd_op *o, const json_t *body);

static void unpub_revoked(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  (void)status, (void)body, (void)msg; /* the lease holds nothing any more */
  op_finish(o, 0, NULL);
}

static void unpub_txn_done(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  if (status == SX_ENOENT) {
    op_finish(o, SX_EGONE, "unpublish %s: the lease is gone (expired just now)", o->name);
  } else if (status != 0) {
    op_finish(o, status, "unpublish %s: %s", o->name, msg);
  } else if (sx__etcd_txn_ok(body)) {
    op_send(o, "/v3/lease/revoke", sx__etcd_id_req("ID", o->own_lease), unpub_revoked);
  } else if (++o->attempts > MAX_ATTEMPTS) {
    op_finish(o, SX_ESTORE, "unpublish %s: the name kept changing under %d attempts",
              o->name, MAX_ATTEMPTS);
  } else {
    unpub_judge(o, body);
  }
}

static void unpub_judge(sx__etcd_op *o, const json_t *body) {
  sx__etcd_backend *eb = o->eb;
  seen s;
  if (read_seen(o, body, &s) != 0 || own_or_finish(o, &s))
    return;
  char seg[SX_ETCD_KEY_MAX], own[SX_ETCD_KEY_MAX], del[SX_ETCD_KEY_MAX], rec[256];
  key_of(eb, seg, "seg", o->name, NULL);
  key_of(eb, own, "own", o->name, NULL);
  key_of(eb, del, "del", o->name, NULL);
  o->own_rev = s.kv.mod_rev;
  o->own_lease = s.kv.lease;
  int n =
      sx__etcd_owner_text(rec, sizeof(rec), o->inc, s.who.gen, s.who.ttl_s, "unpublish");
  sx__etcd_kv_free(&s.kv);
  /* The tombstone rides on the segment's own lease, which is revoked next:
   * watchers see it in the revision of the delete, and it is gone after. */
  json_t *cmp = sx__etcd_japp(json_array(), sx__etcd_cmp("MOD", own, o->own_rev));
  json_t *ok =
      sx__etcd_japp(json_array(), sx__etcd_put(del, rec, (size_t)n, o->own_lease));
  ok = sx__etcd_japp(ok, sx__etcd_delete(seg));
  ok = sx__etcd_japp(ok, sx__etcd_delete(own));
  op_send(o, "/v3/kv/txn", sx__etcd_txn(cmp, ok, read_ops(o, 0)), unpub_txn_done);
}

static void unpub_read(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  if (status != 0)
    op_finish(o, status, "unpublish %s: %s", o->name, msg);
  else
    unpub_judge(o, body);
}

static int etcd_unpublish(sx_backend *b, const char *name, const uint8_t *incarnation,
                          sx_backend_cb cb, void *arg) {
  int rc;
  sx__etcd_op *o = op_new(b, "unpublish", name, cb, arg, &rc);
  if (o == NULL)
    return rc;
  set_inc(o, incarnation);
  return op_begin(o, "/v3/kv/txn", sx__etcd_txn(NULL, read_ops(o, 0), NULL), unpub_read);
}

/* ---------------------------------------------------------------- get */

static void get_ttl(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  int64_t ttl = -1, granted = 0;
  (void)msg;
  /* The value is what was asked for; a lease left we cannot read is -1. */
  if (status == 0 && sx__etcd_i64(body, "TTL", &ttl) == 0)
    o->rep.ttl_ms = ttl >= 0 ? ttl * 1000 : 0;
  /* A keepalive sets the lease left back to the granted length, so the
   * difference is the time since the holder last renewed (to 1 s).  sxctl
   * rm tells a live agent from one that stopped renewing by it. */
  if (status == 0 && ttl >= 0 && sx__etcd_i64(body, "grantedTTL", &granted) == 0 &&
      granted >= ttl)
    o->rep.holder_age_ms = (uint64_t)(granted - ttl) * 1000;
  o->rep.value = o->out;
  o->rep.len = o->out_len;
  op_finish(o, 0, NULL);
}

static void get_read(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  char err[200];
  if (status != 0) {
    op_finish(o, status, "get %s: %s", o->name, msg);
    return;
  }
  const json_t *kvs = json_object_get(body, "kvs");
  if (kvs != NULL && !json_is_array(kvs)) {
    op_finish(o, SX_EPROTO, "etcd %s: get %s: kvs is not an array",
              sx__etcd_endpoint(o->eb->http), o->name);
    return;
  }
  if (json_array_size(kvs) == 0) {
    op_finish(o, SX_ENOENT, "%s: no such segment", o->name);
    return;
  }
  sx__etcd_kv kv;
  int rc = sx__etcd_kv_parse(json_array_get(kvs, 0), &kv, err, sizeof(err));
  if (rc != 0) {
    op_finish(o, rc, "etcd %s: get %s: %s", sx__etcd_endpoint(o->eb->http), o->name, err);
    return;
  }
  o->out = kv.value;
  o->out_len = kv.value_len;
  kv.value = NULL;
  int64_t lease = kv.lease;
  sx__etcd_kv_free(&kv);
  if (lease == 0)
    get_ttl(o, SX_ENOENT, NULL, NULL);
  else
    op_send(o, "/v3/lease/timetolive", sx__etcd_id_req("ID", lease), get_ttl);
}

static int etcd_get(sx_backend *b, const char *name, sx_backend_cb cb, void *arg) {
  int rc;
  sx__etcd_op *o = op_new(b, "get", name, cb, arg, &rc);
  if (o == NULL)
    return rc;
  char seg[SX_ETCD_KEY_MAX];
  key_of(o->eb, seg, "seg", name, NULL);
  return op_begin(o, "/v3/kv/range",
                  sx__etcd_jkv(json_object(), "key", sx__etcd_jkey(seg)), get_read);
}

/* ---------------------------------------------------------------- list */

static void list_more(sx__etcd_op *o);

static void list_ttl_done(void *arg, int status, json_t *body, const char *msg) {
  struct ttl_req *t = arg;
  sx__etcd_op *o = t->o;
  size_t i = t->i;
  o->ttl_calls[i] = NULL;
  o->ttl_busy--;
  sx__etcd_conn_note(o->eb, status, body, msg);
  if (o->eb->closing)
    return;
  int64_t ttl;
  if (status == 0 && sx__etcd_i64(body, "TTL", &ttl) == 0)
    o->items[i].ttl_ms = ttl >= 0 ? ttl * 1000 : 0;
  list_more(o);
}

/* Look up the lease left of each item, a window at a time; finish when all
 * have answered. */
static void list_more(sx__etcd_op *o) {
  while (o->ttl_busy < LIST_TTL_WINDOW && o->ttl_next < o->ttl_max) {
    size_t i = o->ttl_next++;
    if (o->kvs[i].lease == 0)
      continue;
    struct ttl_req *t = &o->ttl_reqs[i];
    t->o = o;
    t->i = i;
    json_t *req = sx__etcd_id_req("ID", o->kvs[i].lease);
    int rc = req ? sx__etcd_post(o->eb->http, "/v3/lease/timetolive", req, list_ttl_done,
                                 t, &o->ttl_calls[i])
                 : SX_ENOMEM;
    json_decref(req);
    if (rc == 0)
      o->ttl_busy++; /* else this one reads -1 */
  }
  if (o->ttl_busy == 0) {
    o->rep.items = o->items;
    o->rep.n_items = o->n_items;
    op_finish(o, 0, NULL);
  }
}

static void list_read(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  sx__etcd_backend *eb = o->eb;
  char err[200], segp[SX_ETCD_KEY_MAX];
  if (status != 0) {
    op_finish(o, status, "list: %s", msg);
    return;
  }
  const json_t *kvs = json_object_get(body, "kvs");
  if (kvs != NULL && !json_is_array(kvs)) {
    op_finish(o, SX_EPROTO, "etcd %s: list: kvs is not an array",
              sx__etcd_endpoint(eb->http));
    return;
  }
  size_t n = json_array_size(kvs);
  o->kvs = calloc(n + 1, sizeof(*o->kvs));
  o->items = calloc(n + 1, sizeof(*o->items));
  o->names = calloc(n + 1, sizeof(*o->names));
  o->ttl_calls = calloc(n + 1, sizeof(*o->ttl_calls));
  o->ttl_reqs = calloc(n + 1, sizeof(*o->ttl_reqs));
  if (!o->kvs || !o->items || !o->names || !o->ttl_calls || !o->ttl_reqs) {
    op_finish(o, SX_ENOMEM, "list: out of memory");
    return;
  }
  int plen = snprintf(segp, sizeof(segp), "%sseg/", eb->prefix);
  for (size_t i = 0; i < n; i++) {
    sx__etcd_kv kv;
    int rc = sx__etcd_kv_parse(json_array_get(kvs, i), &kv, err, sizeof(err));
    if (rc != 0) {
      op_finish(o, rc, "etcd %s: list: %s", sx__etcd_endpoint(eb->http), err);
      return;
    }
    /* Keys that cannot be a segment name are not listed. */
    size_t nlen = kv.key_len - (size_t)plen;
    if (kv.key_len <= (size_t)plen || memcmp(kv.key, segp, (size_t)plen) != 0 ||
        nlen > SX_NAME_MAX || memchr(kv.key + plen, '\0', nlen) != NULL) {
      sx__etcd_kv_free(&kv);
      continue;
    }
    size_t k = o->n_items++;
    memcpy(o->names[k], kv.key + plen, nlen);
    o->names[k][nlen] = '\0';
    o->kvs[k] = kv;
    o->items[k] = (sx_backend_item){.name = o->names[k], .value = kv.value, .len = kv.value_len, .ttl_ms = -1};
  }
  o->ttl_max = o->n_items < LIST_TTL_MAX ? o->n_items : LIST_TTL_MAX;
  list_more(o);
}

static int etcd_list(sx_backend *b, sx_backend_cb cb, void *arg) {
  int rc;
  sx__etcd_op *o = op_new(b, "list", NULL, cb, arg, &rc);
  if (o == NULL)
    return rc;
  char from[SX_ETCD_KEY_MAX], to[SX_ETCD_KEY_MAX];
  snprintf(from, sizeof(from), "%sseg/", o->eb->prefix);
  snprintf(to, sizeof(to), "%sseg0", o->eb->prefix); /* '0' follows '/' */
  json_t *req = sx__etcd_jkv(json_object(), "key", sx__etcd_jkey(from));
  return op_begin(o, "/v3/kv/range", sx__etcd_jkv(req, "range_end", sx__etcd_jkey(to)),
                  list_read);
}

/* ---------------------------------------------------------------- remove */

static void rm_judge(sx__etcd_op *o, const json_t *body);
static void rm_read(sx__etcd_op *o, int status, json_t *body, const char *msg);

static void rm_revoked(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  (void)status, (void)body, (void)msg;
  op_finish(o, 0, NULL);
}

static void rm_txn_done(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  if (status == SX_ENOENT && ++o->attempts <= MAX_ATTEMPTS) {
    /* The holder's lease ran out under the tombstone: read again. */
    op_send(o, "/v3/kv/txn", sx__etcd_txn(NULL, read_ops(o, 1), NULL), rm_read);
    return;
  }
  if (status != 0) {
    op_finish(o, status, "remove %s: %s", o->name, msg);
  } else if (sx__etcd_txn_ok(body)) {
    o->fence_used = o->has_holder;
    if (o->has_holder)
      memcpy(o->rep.holder, o->holder.inc, SX_INCARNATION_LEN);
    if (o->own_lease != 0)
      op_send(o, "/v3/lease/revoke", sx__etcd_id_req("ID", o->own_lease), rm_revoked);
    else
      op_finish(o, 0, NULL);
  } else if (++o->attempts > MAX_ATTEMPTS) {
    op_finish(o, SX_ESTORE, "remove %s: the name kept changing under %d attempts",
              o->name, MAX_ATTEMPTS);
  } else {
    rm_judge(o, body);
  }
}

static void rm_txn(sx__etcd_op *o) {
  sx__etcd_backend *eb = o->eb;
  char seg[SX_ETCD_KEY_MAX], own[SX_ETCD_KEY_MAX], del[SX_ETCD_KEY_MAX];
  key_of(eb, seg, "seg", o->name, NULL);
  key_of(eb, own, "own", o->name, NULL);
  key_of(eb, del, "del", o->name, NULL);
  json_t *cmp = sx__etcd_japp(json_array(), sx__etcd_cmp("MOD", own, o->own_rev));
  cmp = sx__etcd_japp(cmp, sx__etcd_cmp("MOD", seg, o->seg_rev));
  json_t *ok = json_array();
  if (o->has_holder && o->own_lease != 0) {
    char rec[256];
    int n = sx__etcd_owner_text(rec, sizeof(rec), o->holder.inc, o->holder.gen,
                                o->holder.ttl_s, "remove");
    ok = sx__etcd_japp(ok, sx__etcd_put(del, rec, (size_t)n, o->own_lease));
  }
  if (o->seg_rev)
    ok = sx__etcd_japp(ok, sx__etcd_delete(seg));
  if (o->own_rev)
    ok = sx__etcd_japp(ok, sx__etcd_delete(own));
  if (o->has_holder) {
    char hex[2 * SX_INCARNATION_LEN + 1], fence[SX_ETCD_KEY_MAX], frec[96];
    sx_hex(o->holder.inc, SX_INCARNATION_LEN, hex);
    key_of(eb, fence, "fence", o->name, hex);
    int fn = snprintf(frec, sizeof(frec), "{\"v\":1,\"at\":%llu,\"why\":\"remove\"}",
                      (unsigned long long)sx__wall_ms());
    ok = sx__etcd_japp(ok, sx__etcd_put(fence, frec, (size_t)fn, o->fence_lease));
  }
  op_send(o, "/v3/kv/txn", sx__etcd_txn(cmp, ok, read_ops(o, 1)), rm_txn_done);
}

static void rm_granted(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  if (status == 0 &&
      (sx__etcd_i64(body, "ID", &o->fence_lease) != 0 || o->fence_lease == 0)) {
    status = SX_EPROTO;
    msg = "the lease grant answer has no lease ID";
  }
  if (status != 0)
    op_finish(o, status, "remove %s: lease grant: %s", o->name, msg);
  else
    rm_txn(o);
}

static void rm_judge(sx__etcd_op *o, const json_t *body) {
  char err[200];
  sx__etcd_kv own, seg;
  int has_own, has_seg;
  int rc = sx__etcd_txn_kv(body, 0, &own, &has_own, err, sizeof(err));
  if (rc == 0)
    rc = sx__etcd_txn_kv(body, 1, &seg, &has_seg, err, sizeof(err));
  if (rc != 0) {
    if (has_own)
      sx__etcd_kv_free(&own);
    op_finish(o, rc, "etcd %s: remove %s: %s", sx__etcd_endpoint(o->eb->http), o->name,
              err);
    return;
  }
  o->own_rev = has_own ? own.mod_rev : 0;
  o->own_lease = has_own ? own.lease : 0;
  o->seg_rev = has_seg ? seg.mod_rev : 0;
  o->has_holder =
      has_own && sx__etcd_owner_parse(own.value, own.value_len, &o->holder) == 0;
  if (has_own)
    sx__etcd_kv_free(&own);
  if (has_seg)
    sx__etcd_kv_free(&seg);
  if (!has_own && !has_seg)
    op_finish(o, SX_ENOENT, "remove %s: no such segment", o->name);
  else if (o->has_holder && o->fence_lease == 0)
    op_send(o, "/v3/lease/grant", sx__etcd_id_req("TTL", SX_ETCD_FENCE_TTL_S),
            rm_granted);
  else
    rm_txn(o);
}

static void rm_read(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  if (status != 0)
    op_finish(o, status, "remove %s: %s", o->name, msg);
  else
    rm_judge(o, body);
}

static int etcd_remove(sx_backend *b, const char *name, sx_backend_cb cb, void *arg) {
  int rc;
  sx__etcd_op *o = op_new(b, "remove", name, cb, arg, &rc);
  if (o == NULL)
    return rc;
  return op_begin(o, "/v3/kv/txn", sx__etcd_txn(NULL, read_ops(o, 1), NULL), rm_read);
}

/* ---------------------------------------------------------------- open/close */

static void timer_closed(uv_handle_t *h) {
  sx__etcd_backend *eb = h->data;
  if (--eb->handles == 0)
    free(eb);
}

static void etcd_close(sx_backend *b) {
  sx__etcd_backend *eb = (sx__etcd_backend *)b;
  if (eb->closing)
    return;
  eb->closing = 1;
  while (eb->ops) {
    sx__etcd_op *o = eb->ops;
    op_unlink(o);
    sx__etcd_cancel(o->call);
    o->call = NULL;
    o->rep.status = SX_ECANCELED;
    sx__etcd_say(o->rep.message, sizeof(o->rep.message), "%s %s: the store was closed",
                 o->what, o->name);
    o->rep.items = NULL;
    o->rep.n_items = 0;
    o->rep.value = NULL;
    o->rep.len = 0;
    if (o->cb)
      o->cb(o->arg, &o->rep);
    op_free(o);
  }
  sx__etcd_cancel(eb->probe);
  eb->probe = NULL;
  sx__etcd_cancel(eb->watch);
  eb->watch = NULL;
  sx__etcd_http_close(eb->http);
  uv_close((uv_handle_t *)&eb->probe_timer, timer_closed);
  uv_close((uv_handle_t *)&eb->watch_timer, timer_closed);
}

static int etcd_open(uv_loop_t *loop, const sx_url *url, const sx_backend_hooks *hooks,
                     sx_backend **out) {
  sx__etcd_backend *eb = calloc(1, sizeof(*eb));
  if (eb == NULL)
    return sx__err(SX_ENOMEM, "etcd: out of memory");
  eb->base.ops = &sx__backend_etcd_ops;
  eb->base.loop = loop;
  eb->base.url = *url;
  if (hooks)
    eb->base.hooks = *hooks;
  eb->up = -1;
  snprintf(eb->prefix, sizeof(eb->prefix), "%s%s/", SX_ETCD_ROOT, url->ns);
  int rc = sx__etcd_http_open(loop, url, &eb->http);
  if (rc)
    goto out_free;
  uv_timer_init(loop, &eb->probe_timer);
  uv_timer_init(loop, &eb->watch_timer);
  eb->probe_timer.data = eb->watch_timer.data = eb;
  eb->handles = 2;
  sx__etcd_conn_start(eb);
  *out = &eb->base;
  return 0;

out_free:
  free(eb);
  return rc;
}

const sx_backend_ops sx__backend_etcd_ops = {
    .scheme = "etcd",
    .open = etcd_open,
    .close = etcd_close,
    .publish = etcd_publish,
    .renew = etcd_renew,
    .unpublish = etcd_unpublish,
    .get = etcd_get,
    .list = etcd_list,
    .remove = etcd_remove,
    .watch = sx__etcd_watch_op,
};
