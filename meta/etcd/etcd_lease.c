/*
 * The etcd backend's fenced writes of a segment: publish, renew and
 * unpublish (the request chains are drawn in backend_etcd.c).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "etcd_op.h"

/* ---------------------------------------------------------------- publish */

static void pub_judge(sx__etcd_op *o, const json_t *body);
static void pub_leases(sx__etcd_op *o);
static void pub_read_done(sx__etcd_op *o, int status, json_t *body, const char *msg);

static void pub_revoked(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  (void)status, (void)body, (void)msg; /* the old lease runs out anyway */
  sx__etcd_op_finish(o, 0, NULL);
}

static void pub_written(sx__etcd_op *o) {
  o->lease_used = 1;
  if (o->own_lease != 0 && o->own_lease != o->lease) {
    sx__etcd_op_send(o, "/v3/lease/revoke", sx__etcd_id_req("ID", o->own_lease), pub_revoked);
    return;
  }
  sx__etcd_op_finish(o, 0, NULL);
}

static void pub_txn_done(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  if (status == SX_ENOENT) {
    /* "requested lease not found": a lease we granted ran out before the
     * write (a very slow store); grant fresh ones. */
    o->lease = o->fence_lease = 0;
    if (++o->attempts > SX_ETCD_MAX_ATTEMPTS)
      sx__etcd_op_finish(o, SX_ESTORE, "publish %s: %s", o->name, msg);
    else
      pub_leases(o);
    return;
  }
  if (status != 0) {
    sx__etcd_op_finish(o, status, "publish %s: %s", o->name, msg);
    return;
  }
  if (sx__etcd_txn_ok(body)) {
    o->fence_used = o->has_holder;
    pub_written(o);
    return;
  }
  if (++o->attempts > SX_ETCD_MAX_ATTEMPTS) {
    sx__etcd_op_finish(o, SX_ESTORE, "publish %s: the name kept changing under %d attempts",
              o->name, SX_ETCD_MAX_ATTEMPTS);
    return;
  }
  pub_judge(o, body);
}

static void pub_txn(sx__etcd_op *o) {
  sx__etcd_backend *eb = o->eb;
  char seg[SX_ETCD_KEY_MAX], own[SX_ETCD_KEY_MAX], fence[SX_ETCD_KEY_MAX];
  char rec[256];
  sx__etcd_key(eb, seg, "seg", o->name, NULL);
  sx__etcd_key(eb, own, "own", o->name, NULL);
  sx__etcd_key(eb, fence, "fence", o->name, o->inc_hex);
  int n = sx__etcd_owner_text(rec, sizeof(rec), o->inc, o->gen,
                              sx__etcd_ttl_s(o->lease_ms), NULL);
  json_t *cmp = sx__etcd_japp(json_array(), sx__etcd_cmp("MOD", own, o->own_rev));
  cmp = sx__etcd_japp(cmp, sx__etcd_cmp("CREATE", fence, 0));
  json_t *ok = sx__etcd_japp(json_array(), sx__etcd_put(seg, o->value, o->len, o->lease));
  ok = sx__etcd_japp(ok, sx__etcd_put(own, rec, (size_t)n, o->lease));
  if (o->has_holder) {
    char holder_hex[2 * SX_INCARNATION_LEN + 1], hfence[SX_ETCD_KEY_MAX], frec[160];
    sx_hex(o->holder.inc, SX_INCARNATION_LEN, holder_hex);
    sx__etcd_key(eb, hfence, "fence", o->name, holder_hex);
    int fn = snprintf(frec, sizeof(frec),
                      "{\"v\":1,\"by\":\"%s\",\"at\":%llu,"
                      "\"why\":\"takeover\"}",
                      o->inc_hex, (unsigned long long)sx__wall_ms());
    ok = sx__etcd_japp(ok, sx__etcd_put(hfence, frec, (size_t)fn, o->fence_lease));
  }
  sx__etcd_op_send(o, "/v3/kv/txn", sx__etcd_txn(cmp, ok, sx__etcd_read_ops(o, 0)), pub_txn_done);
}

static void pub_granted(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  int64_t id = 0;
  if (status == 0 && (sx__etcd_i64(body, "ID", &id) != 0 || id == 0)) {
    status = SX_EPROTO;
    msg = "the lease grant answer has no lease ID";
  }
  if (status != 0) {
    sx__etcd_op_finish(o, status, "publish %s: lease grant: %s", o->name, msg);
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
    sx__etcd_op_send(o, "/v3/lease/grant", sx__etcd_id_req("TTL", SX_ETCD_FENCE_TTL_S),
            pub_granted);
  else if (o->lease == 0)
    sx__etcd_op_send(o, "/v3/lease/grant", sx__etcd_id_req("TTL", sx__etcd_ttl_s(o->lease_ms)),
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
  if (status == 0 && ttl < 0 && ++o->attempts <= SX_ETCD_MAX_ATTEMPTS) {
    /* The holder's lease ran out while we looked: read again. */
    sx__etcd_op_send(o, "/v3/kv/txn", sx__etcd_txn(NULL, sx__etcd_read_ops(o, 0), NULL), pub_read_done);
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
  sx__etcd_op_finish(o, SX_EHELD,
            "publish %s: held by incarnation %s (lease left %lld ms, "
            "renewed %llu ms ago); publish with takeover to replace it",
            o->name, hex, (long long)o->rep.holder_ttl_ms, (unsigned long long)age);
}

/* Decide from a read of own + my fence. */
static void pub_judge(sx__etcd_op *o, const json_t *body) {
  sx__etcd_seen s;
  if (sx__etcd_read_seen(o, body, &s) != 0)
    return;
  if (s.fenced) {
    sx__etcd_fenced_finish(o, &s);
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
        sx__etcd_op_send(o, "/v3/lease/timetolive", sx__etcd_id_req("ID", s.kv.lease), pub_held);
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
      sx__etcd_op_finish(o, SX_EGENERATION, "publish %s: generation %llu is not above %llu",
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
    sx__etcd_op_finish(o, status, "publish %s: %s", o->name, msg);
  else
    pub_judge(o, body);
}

int sx__etcd_publish(sx_backend *b, const sx_publish_req *req, sx_backend_cb cb,
                        void *arg) {
  int rc = sx_name_validate(req->name);
  if (rc != 0)
    return rc;
  if (req->value == NULL || req->len == 0 || req->lease_ms == 0)
    return sx__err(SX_EINVAL, "publish %s: empty value or zero lease", req->name);
  if (req->len > SX_MAX_DESC_BYTES)
    return sx__err(SX_ELIMIT, "publish %s: the value is larger than %u bytes", req->name,
                   SX_MAX_DESC_BYTES);
  sx__etcd_op *o = sx__etcd_op_new(b, "publish", req->name, cb, arg, &rc);
  if (o == NULL)
    return rc;
  sx__etcd_op_set_inc(o, req->incarnation);
  o->gen = req->generation;
  o->lease_ms = req->lease_ms;
  o->takeover = req->takeover;
  o->len = req->len;
  o->value = malloc(req->len);
  if (o->value == NULL) {
    sx__etcd_op_unlink(o);
    sx__etcd_op_free(o);
    return sx__err(SX_ENOMEM, "publish: out of memory");
  }
  memcpy(o->value, req->value, req->len);
  return sx__etcd_op_begin(o, "/v3/kv/txn", sx__etcd_txn(NULL, sx__etcd_read_ops(o, 0), NULL),
                  pub_read_done);
}

/* ---------------------------------------------------------------- renew */

static void renew_alive(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  int64_t ttl = 0;
  if (status == SX_ENOENT) {
    sx__etcd_op_finish(o, SX_EGONE, "renew %s: the lease is gone (expired, or the store lost it)",
              o->name);
    return;
  }
  if (status == 0 && sx__etcd_i64(body, "TTL", &ttl) != 0) {
    status = SX_EPROTO;
    msg = "the keepalive answer has a malformed TTL";
  }
  if (status != 0) {
    sx__etcd_op_finish(o, status, "renew %s: keepalive: %s", o->name, msg);
  } else if (ttl <= 0) {
    sx__etcd_op_finish(o, SX_EGONE, "renew %s: the lease expired", o->name);
  } else {
    o->rep.ttl_ms = ttl * 1000;
    sx__etcd_op_finish(o, 0, NULL);
  }
}

static void renew_read(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  sx__etcd_seen s;
  if (status != 0) {
    sx__etcd_op_finish(o, status, "renew %s: %s", o->name, msg);
    return;
  }
  if (sx__etcd_read_seen(o, body, &s) != 0 || sx__etcd_own_or_finish(o, &s))
    return;
  int64_t lease = s.kv.lease;
  sx__etcd_kv_free(&s.kv);
  sx__etcd_op_send(o, "/v3/lease/keepalive", sx__etcd_id_req("ID", lease), renew_alive);
}

int sx__etcd_renew(sx_backend *b, const char *name, const uint8_t *incarnation,
                      uint32_t lease_ms, sx_backend_cb cb, void *arg) {
  int rc;
  (void)lease_ms; /* fixed at publish: etcd leases cannot change their TTL */
  sx__etcd_op *o = sx__etcd_op_new(b, "renew", name, cb, arg, &rc);
  if (o == NULL)
    return rc;
  sx__etcd_op_set_inc(o, incarnation);
  return sx__etcd_op_begin(o, "/v3/kv/txn", sx__etcd_txn(NULL, sx__etcd_read_ops(o, 0), NULL), renew_read);
}

/* ---------------------------------------------------------------- unpublish */

static void unpub_judge(sx__etcd_op *o, const json_t *body);

static void unpub_revoked(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  (void)status, (void)body, (void)msg; /* the lease holds nothing any more */
  sx__etcd_op_finish(o, 0, NULL);
}

static void unpub_txn_done(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  if (status == SX_ENOENT) {
    sx__etcd_op_finish(o, SX_EGONE, "unpublish %s: the lease is gone (expired just now)", o->name);
  } else if (status != 0) {
    sx__etcd_op_finish(o, status, "unpublish %s: %s", o->name, msg);
  } else if (sx__etcd_txn_ok(body)) {
    sx__etcd_op_send(o, "/v3/lease/revoke", sx__etcd_id_req("ID", o->own_lease), unpub_revoked);
  } else if (++o->attempts > SX_ETCD_MAX_ATTEMPTS) {
    sx__etcd_op_finish(o, SX_ESTORE, "unpublish %s: the name kept changing under %d attempts",
              o->name, SX_ETCD_MAX_ATTEMPTS);
  } else {
    unpub_judge(o, body);
  }
}

static void unpub_judge(sx__etcd_op *o, const json_t *body) {
  sx__etcd_backend *eb = o->eb;
  sx__etcd_seen s;
  if (sx__etcd_read_seen(o, body, &s) != 0 || sx__etcd_own_or_finish(o, &s))
    return;
  char seg[SX_ETCD_KEY_MAX], own[SX_ETCD_KEY_MAX], del[SX_ETCD_KEY_MAX], rec[256];
  sx__etcd_key(eb, seg, "seg", o->name, NULL);
  sx__etcd_key(eb, own, "own", o->name, NULL);
  sx__etcd_key(eb, del, "del", o->name, NULL);
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
  sx__etcd_op_send(o, "/v3/kv/txn", sx__etcd_txn(cmp, ok, sx__etcd_read_ops(o, 0)), unpub_txn_done);
}

static void unpub_read(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  if (status != 0)
    sx__etcd_op_finish(o, status, "unpublish %s: %s", o->name, msg);
  else
    unpub_judge(o, body);
}

int sx__etcd_unpublish(sx_backend *b, const char *name, const uint8_t *incarnation,
                          sx_backend_cb cb, void *arg) {
  int rc;
  sx__etcd_op *o = sx__etcd_op_new(b, "unpublish", name, cb, arg, &rc);
  if (o == NULL)
    return rc;
  sx__etcd_op_set_inc(o, incarnation);
  return sx__etcd_op_begin(o, "/v3/kv/txn", sx__etcd_txn(NULL, sx__etcd_read_ops(o, 0), NULL), unpub_read);
}
