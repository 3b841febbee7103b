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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "etcd_op.h"

#define LIST_TTL_MAX 1024 /* leases looked up per list; the rest read -1 */
#define LIST_TTL_WINDOW 8

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
  sx__etcd_op_finish(o, 0, NULL);
}

static void get_read(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  char err[200];
  if (status != 0) {
    sx__etcd_op_finish(o, status, "get %s: %s", o->name, msg);
    return;
  }
  const json_t *kvs = json_object_get(body, "kvs");
  if (kvs != NULL && !json_is_array(kvs)) {
    sx__etcd_op_finish(o, SX_EPROTO, "etcd %s: get %s: kvs is not an array",
              sx__etcd_endpoint(o->eb->http), o->name);
    return;
  }
  if (json_array_size(kvs) == 0) {
    sx__etcd_op_finish(o, SX_ENOENT, "%s: no such segment", o->name);
    return;
  }
  sx__etcd_kv kv;
  int rc = sx__etcd_kv_parse(json_array_get(kvs, 0), &kv, err, sizeof(err));
  if (rc != 0) {
    sx__etcd_op_finish(o, rc, "etcd %s: get %s: %s", sx__etcd_endpoint(o->eb->http), o->name, err);
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
    sx__etcd_op_send(o, "/v3/lease/timetolive", sx__etcd_id_req("ID", lease), get_ttl);
}

static int etcd_get(sx_backend *b, const char *name, sx_backend_cb cb, void *arg) {
  int rc;
  sx__etcd_op *o = sx__etcd_op_new(b, "get", name, cb, arg, &rc);
  if (o == NULL)
    return rc;
  char seg[SX_ETCD_KEY_MAX];
  sx__etcd_key(o->eb, seg, "seg", name, NULL);
  return sx__etcd_op_begin(o, "/v3/kv/range",
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
    sx__etcd_op_finish(o, 0, NULL);
  }
}

static void list_read(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  sx__etcd_backend *eb = o->eb;
  char err[200], segp[SX_ETCD_KEY_MAX];
  if (status != 0) {
    sx__etcd_op_finish(o, status, "list: %s", msg);
    return;
  }
  const json_t *kvs = json_object_get(body, "kvs");
  if (kvs != NULL && !json_is_array(kvs)) {
    sx__etcd_op_finish(o, SX_EPROTO, "etcd %s: list: kvs is not an array",
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
    sx__etcd_op_finish(o, SX_ENOMEM, "list: out of memory");
    return;
  }
  int plen = snprintf(segp, sizeof(segp), "%sseg/", eb->prefix);
  for (size_t i = 0; i < n; i++) {
    sx__etcd_kv kv;
    int rc = sx__etcd_kv_parse(json_array_get(kvs, i), &kv, err, sizeof(err));
    if (rc != 0) {
      sx__etcd_op_finish(o, rc, "etcd %s: list: %s", sx__etcd_endpoint(eb->http), err);
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
  sx__etcd_op *o = sx__etcd_op_new(b, "list", NULL, cb, arg, &rc);
  if (o == NULL)
    return rc;
  char from[SX_ETCD_KEY_MAX], to[SX_ETCD_KEY_MAX];
  snprintf(from, sizeof(from), "%sseg/", o->eb->prefix);
  snprintf(to, sizeof(to), "%sseg0", o->eb->prefix); /* '0' follows '/' */
  json_t *req = sx__etcd_jkv(json_object(), "key", sx__etcd_jkey(from));
  return sx__etcd_op_begin(o, "/v3/kv/range", sx__etcd_jkv(req, "range_end", sx__etcd_jkey(to)),
                  list_read);
}

/* ---------------------------------------------------------------- remove */

static void rm_judge(sx__etcd_op *o, const json_t *body);
static void rm_read(sx__etcd_op *o, int status, json_t *body, const char *msg);

static void rm_revoked(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  (void)status, (void)body, (void)msg;
  sx__etcd_op_finish(o, 0, NULL);
}

static void rm_txn_done(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  if (status == SX_ENOENT && ++o->attempts <= SX_ETCD_MAX_ATTEMPTS) {
    /* The holder's lease ran out under the tombstone: read again. */
    sx__etcd_op_send(o, "/v3/kv/txn", sx__etcd_txn(NULL, sx__etcd_read_ops(o, 1), NULL), rm_read);
    return;
  }
  if (status != 0) {
    sx__etcd_op_finish(o, status, "remove %s: %s", o->name, msg);
  } else if (sx__etcd_txn_ok(body)) {
    o->fence_used = o->has_holder;
    if (o->has_holder)
      memcpy(o->rep.holder, o->holder.inc, SX_INCARNATION_LEN);
    if (o->own_lease != 0)
      sx__etcd_op_send(o, "/v3/lease/revoke", sx__etcd_id_req("ID", o->own_lease), rm_revoked);
    else
      sx__etcd_op_finish(o, 0, NULL);
  } else if (++o->attempts > SX_ETCD_MAX_ATTEMPTS) {
    sx__etcd_op_finish(o, SX_ESTORE, "remove %s: the name kept changing under %d attempts",
              o->name, SX_ETCD_MAX_ATTEMPTS);
  } else {
    rm_judge(o, body);
  }
}

static void rm_txn(sx__etcd_op *o) {
  sx__etcd_backend *eb = o->eb;
  char seg[SX_ETCD_KEY_MAX], own[SX_ETCD_KEY_MAX], del[SX_ETCD_KEY_MAX];
  sx__etcd_key(eb, seg, "seg", o->name, NULL);
  sx__etcd_key(eb, own, "own", o->name, NULL);
  sx__etcd_key(eb, del, "del", o->name, NULL);
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
    sx__etcd_key(eb, fence, "fence", o->name, hex);
    int fn = snprintf(frec, sizeof(frec), "{\"v\":1,\"at\":%llu,\"why\":\"remove\"}",
                      (unsigned long long)sx__wall_ms());
    ok = sx__etcd_japp(ok, sx__etcd_put(fence, frec, (size_t)fn, o->fence_lease));
  }
  sx__etcd_op_send(o, "/v3/kv/txn", sx__etcd_txn(cmp, ok, sx__etcd_read_ops(o, 1)), rm_txn_done);
}

static void rm_granted(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  if (status == 0 &&
      (sx__etcd_i64(body, "ID", &o->fence_lease) != 0 || o->fence_lease == 0)) {
    status = SX_EPROTO;
    msg = "the lease grant answer has no lease ID";
  }
  if (status != 0)
    sx__etcd_op_finish(o, status, "remove %s: lease grant: %s", o->name, msg);
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
    sx__etcd_op_finish(o, rc, "etcd %s: remove %s: %s", sx__etcd_endpoint(o->eb->http), o->name,
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
    sx__etcd_op_finish(o, SX_ENOENT, "remove %s: no such segment", o->name);
  else if (o->has_holder && o->fence_lease == 0)
    sx__etcd_op_send(o, "/v3/lease/grant", sx__etcd_id_req("TTL", SX_ETCD_FENCE_TTL_S),
            rm_granted);
  else
    rm_txn(o);
}

static void rm_read(sx__etcd_op *o, int status, json_t *body, const char *msg) {
  if (status != 0)
    sx__etcd_op_finish(o, status, "remove %s: %s", o->name, msg);
  else
    rm_judge(o, body);
}

static int etcd_remove(sx_backend *b, const char *name, sx_backend_cb cb, void *arg) {
  int rc;
  sx__etcd_op *o = sx__etcd_op_new(b, "remove", name, cb, arg, &rc);
  if (o == NULL)
    return rc;
  return sx__etcd_op_begin(o, "/v3/kv/txn", sx__etcd_txn(NULL, sx__etcd_read_ops(o, 1), NULL), rm_read);
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
    sx__etcd_op_unlink(o);
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
    sx__etcd_op_free(o);
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
    .publish = sx__etcd_publish,
    .renew = sx__etcd_renew,
    .unpublish = sx__etcd_unpublish,
    .get = etcd_get,
    .list = etcd_list,
    .remove = etcd_remove,
    .watch = sx__etcd_watch_op,
};
