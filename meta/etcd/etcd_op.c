/*
 * The etcd backend's op chains: create, send the next step, finish (see
 * etcd_op.h), and the fenced read every write starts with.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "etcd_op.h"

/* ---------------------------------------------------------------- helpers */

void sx__etcd_key(const sx__etcd_backend *eb, char *buf, const char *kind,
                   const char *name, const char *suffix) {
  snprintf(buf, SX_ETCD_KEY_MAX, "%s%s/%s%s%s", eb->prefix, kind, name, suffix ? "/" : "",
           suffix ? suffix : "");
}

/* ---------------------------------------------------------------- ops */

void sx__etcd_op_free(sx__etcd_op *o) {
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

void sx__etcd_op_unlink(sx__etcd_op *o) {
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

void sx__etcd_revoke_detached(sx__etcd_backend *eb, int64_t lease) {
  if (lease == 0 || eb->closing)
    return;
  json_t *req = sx__etcd_id_req("ID", lease);
  if (req != NULL)
    sx__etcd_post(eb->http, "/v3/lease/revoke", req, detached_done, eb, NULL);
  json_decref(req);
}

void sx__etcd_op_finish(sx__etcd_op *o, int status, const char *fmt, ...) {
  sx__etcd_backend *eb = o->eb;
  sx__etcd_op_unlink(o);
  if (!o->lease_used)
    sx__etcd_revoke_detached(eb, o->lease);
  if (!o->fence_used)
    sx__etcd_revoke_detached(eb, o->fence_lease);
  o->rep.status = status;
  if (status != 0 && fmt != NULL) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(o->rep.message, sizeof(o->rep.message), fmt, ap);
    va_end(ap);
  }
  if (o->cb)
    o->cb(o->arg, &o->rep);
  sx__etcd_op_free(o);
}

static void sx__etcd_op_done(void *arg, int status, json_t *body, const char *msg) {
  sx__etcd_op *o = arg;
  sx__etcd_backend *eb = o->eb;
  o->call = NULL;
  sx__etcd_conn_note(eb, status, body, msg);
  if (eb->closing)
    return; /* close() has already answered this op with SX_ECANCELED */
  o->step(o, status, body, msg);
}

void sx__etcd_op_send(sx__etcd_op *o, const char *path, json_t *req, sx__etcd_step_fn step) {
  int rc = req ? sx__etcd_post(o->eb->http, path, req, sx__etcd_op_done, o, &o->call) : SX_ENOMEM;
  json_decref(req);
  if (rc == 0) {
    o->step = step;
    return;
  }
  sx__etcd_op_finish(o, rc, "%s %s: %s", o->what, o->name,
            rc == SX_ENOMEM ? "out of memory" : sx_errmsg());
}

sx__etcd_op *sx__etcd_op_new(sx_backend *b, const char *what, const char *name,
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

int sx__etcd_op_begin(sx__etcd_op *o, const char *path, json_t *req, sx__etcd_step_fn step) {
  int rc = req ? sx__etcd_post(o->eb->http, path, req, sx__etcd_op_done, o, &o->call) : SX_ENOMEM;
  json_decref(req);
  if (rc == 0) {
    o->step = step;
    return 0;
  }
  if (rc == SX_ENOMEM)
    sx__err(rc, "etcd: %s: out of memory", o->what);
  sx__etcd_op_unlink(o);
  sx__etcd_op_free(o);
  return rc;
}

void sx__etcd_op_set_inc(sx__etcd_op *o, const uint8_t *inc) {
  memcpy(o->inc, inc, SX_INCARNATION_LEN);
  sx_hex(inc, SX_INCARNATION_LEN, o->inc_hex);
}

json_t *sx__etcd_read_ops(sx__etcd_op *o, int with_seg) {
  char own[SX_ETCD_KEY_MAX], other[SX_ETCD_KEY_MAX];
  sx__etcd_key(o->eb, own, "own", o->name, NULL);
  if (with_seg)
    sx__etcd_key(o->eb, other, "seg", o->name, NULL);
  else
    sx__etcd_key(o->eb, other, "fence", o->name, o->inc_hex);
  json_t *a = sx__etcd_japp(json_array(), sx__etcd_range(own, NULL, 0));
  return sx__etcd_japp(a, sx__etcd_range(other, NULL, with_seg));
}


int sx__etcd_read_seen(sx__etcd_op *o, const json_t *body, sx__etcd_seen *s) {
  char err[200];
  sx__etcd_kv fence;
  memset(s, 0, sizeof(*s));
  int rc = sx__etcd_txn_kv(body, 0, &s->kv, &s->found, err, sizeof(err));
  if (rc == 0)
    rc = sx__etcd_txn_kv(body, 1, &fence, &s->fenced, err, sizeof(err));
  if (rc != 0) {
    if (s->found)
      sx__etcd_kv_free(&s->kv);
    sx__etcd_op_finish(o, rc, "etcd %s: %s %s: %s", sx__etcd_endpoint(o->eb->http), o->what,
              o->name, err);
    return rc;
  }
  if (s->fenced)
    sx__etcd_kv_free(&fence);
  if (s->found)
    s->parsed = sx__etcd_owner_parse(s->kv.value, s->kv.value_len, &s->who) == 0;
  return 0;
}

void sx__etcd_fenced_finish(sx__etcd_op *o, const sx__etcd_seen *s) {
  if (s->found && s->parsed && !s->fenced) {
    char hex[2 * SX_INCARNATION_LEN + 1];
    sx_hex(s->who.inc, SX_INCARNATION_LEN, hex);
    sx__etcd_op_finish(o, SX_EFENCED, "%s: %s: the name is now held by incarnation %s", o->what,
              o->name, hex);
  } else if (s->found && !s->fenced) {
    sx__etcd_op_finish(o, SX_EFENCED, "%s: %s: the owner record is not one this library wrote",
              o->what, o->name);
  } else {
    sx__etcd_op_finish(o, SX_EFENCED,
              "%s: %s: incarnation %s was fenced (taken over, or removed "
              "by an admin)",
              o->what, o->name, o->inc_hex);
  }
}

int sx__etcd_own_or_finish(sx__etcd_op *o, sx__etcd_seen *s) {
  if (s->fenced ||
      (s->found && (!s->parsed || memcmp(s->who.inc, o->inc, SX_INCARNATION_LEN) != 0))) {
    sx__etcd_fenced_finish(o, s);
  } else if (!s->found || s->kv.lease == 0) {
    sx__etcd_op_finish(o, SX_EGONE,
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
