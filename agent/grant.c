/*
 * Write grants and producer authorization (push mode, docs/push.md).
 *
 * A grant names a producer segment and one incarnation of it, or any
 * incarnation of that name, or the whole namespace.  A producer that asks
 * to write presents its name, incarnation and access token on the data
 * plane; it is authorized when a grant covers it and its descriptor in the
 * store (the same resolver cache that opens segments) carries that
 * incarnation and token (constant-time compare).  The token is what the
 * store publishes for readers: whoever can read the store can read every
 * segment, so the store is trusted here as it is for reads; what the grant
 * adds is that the consumer decides who may write, and that a producer
 * cannot write as somebody else without that somebody's token.
 *
 * RDMA connect requests have no room for a name (56 bytes of private data),
 * so an RDMA producer is found by incarnation: in an exact grant, in the
 * names learnt before, or else in one listing of the namespace.
 *
 * Every change bumps an epoch that transports watch: TCP refuses the next
 * write of a producer no grant covers any more (and takes writes again on
 * the same connection once a grant covers it again), RDMA disconnects its
 * queue pairs (grants_changed).  Everything here runs on the loop thread.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent_int.h"
#include "push_int.h"

struct sx__grant {
  sx__grant *next;
  int any_name; /* the whole namespace */
  int any_inc;  /* any incarnation of name */
  char name[SX_NAME_MAX + 1];
  uint8_t inc[SX_INCARNATION_LEN];
};

static int grant_covers(const sx__grant *g, const char *name, const uint8_t *inc) {
  if (g->any_name)
    return 1;
  if (strcmp(g->name, name) != 0)
    return 0;
  return g->any_inc || memcmp(g->inc, inc, SX_INCARNATION_LEN) == 0;
}

int sx__push_write_granted(void *agent, const char *producer, const uint8_t *inc) {
  sx_agent *a = agent;
  for (const sx__grant *g = a->push->grants; g != NULL; g = g->next)
    if (grant_covers(g, producer, inc))
      return 0;
  return SX_EACCESS;
}

/* ------------------------------------------------------------ grant/revoke */

typedef struct grant_call {
  sx__call c;
  struct grant_call *next_wait; /* ps->revoke_waits */
  int revoke;
  int any_name, any_inc;
  char name[SX_NAME_MAX + 1];
  uint8_t inc[SX_INCARNATION_LEN];
} grant_call;

/* Does grant g match what a revoke names? */
static int revoke_matches(const sx__grant *g, const grant_call *r) {
  if (r->any_name)
    return g->any_name;
  if (g->any_name || strcmp(g->name, r->name) != 0)
    return 0;
  return r->any_inc || (!g->any_inc && memcmp(g->inc, r->inc, SX_INCARNATION_LEN) == 0);
}

static void revoke_waits_finish(sx__push *ps, int status, const char *msg);

static void grant_run(sx__call *c) {
  grant_call *gc = (grant_call *)c;
  sx_agent *a = c->a;
  sx__push *ps = a->push;
  if (a->shutting_down) {
    sx__call_finish(c, SX_ESHUTDOWN, "the agent is shutting down");
    return;
  }
  char inc[2 * SX_INCARNATION_LEN + 1];
  sx_hex(gc->inc, SX_INCARNATION_LEN, inc);
  const char *who = gc->any_name ? "every segment of the namespace" : gc->name;
  if (!gc->revoke) {
    for (sx__grant *g = ps->grants; g != NULL; g = g->next) {
      if (g->any_name == gc->any_name && g->any_inc == gc->any_inc &&
          strcmp(g->name, gc->name) == 0 && memcmp(g->inc, gc->inc, SX_INCARNATION_LEN) == 0) {
        sx__call_finish(c, 0, NULL);
        return;
      }
    }
    sx__grant *g = calloc(1, sizeof(*g));
    if (g == NULL) {
      sx__call_finish(c, SX_ENOMEM, "granting a write: out of memory");
      return;
    }
    g->any_name = gc->any_name;
    g->any_inc = gc->any_inc;
    memcpy(g->name, gc->name, sizeof(g->name));
    memcpy(g->inc, gc->inc, SX_INCARNATION_LEN);
    g->next = ps->grants;
    ps->grants = g;
    ps->epoch++; /* connections refused since a revoke look again */
    sx__log(a, SX_LOG_INFO, "granted writes to %s%s%.8s", who,
            gc->any_name || gc->any_inc ? "" : " incarnation ",
            gc->any_name || gc->any_inc ? "" : inc);
    sx__call_finish(c, 0, NULL);
    return;
  }
  int removed = 0;
  for (sx__grant **pp = &ps->grants; *pp != NULL;) {
    sx__grant *g = *pp;
    if (revoke_matches(g, gc)) {
      *pp = g->next;
      free(g);
      removed++;
    } else {
      pp = &g->next;
    }
  }
  if (removed > 0) {
    ps->epoch++;
    for (int k = 0; k < SX__TRANSPORT_SLOTS; k++) {
      if (a->tr[k] == NULL)
        continue;
      if (sx__tr_call(a->tr[k]->ops, grants_changed, a->tr[k]) > 0)
        ps->revoke_pending |= 1u << k;
      else
        ps->revoke_pending &= ~(1u << k); /* what an earlier revoke waited for is over */
    }
    sx__log(a, SX_LOG_INFO, "revoked %d write grant%s of %s", removed, removed > 1 ? "s" : "",
            who);
    if (ps->revoke_pending == 0 && ps->revoke_waits != NULL)
      revoke_waits_finish(ps, ps->revoke_err, ps->revoke_msg);
  }
  if (ps->revoke_pending != 0) {
    /* A device copy or a CUDA IPC mapping of a revoked producer may still
     * write: return once the transports said nothing can any more. */
    gc->next_wait = ps->revoke_waits;
    ps->revoke_waits = gc;
    return;
  }
  sx__call_finish(c, 0, NULL);
}

static void revoke_waits_finish(sx__push *ps, int status, const char *msg) {
  while (ps->revoke_waits != NULL) {
    grant_call *gc = ps->revoke_waits;
    ps->revoke_waits = gc->next_wait;
    sx__call_finish(&gc->c, status, msg);
  }
  ps->revoke_err = 0;
  ps->revoke_msg[0] = '\0';
}

void sx__push_grants_settled(void *agent, sx_transport_kind kind, int status, const char *msg) {
  sx_agent *a = agent;
  sx__push *ps = a->push;
  if (ps == NULL)
    return;
  ps->revoke_pending &= ~(1u << kind);
  if (status != 0 && ps->revoke_err == 0) {
    ps->revoke_err = status;
    snprintf(ps->revoke_msg, sizeof(ps->revoke_msg), "%s", msg ? msg : sx_strerror(status));
  }
  if (ps->revoke_pending == 0)
    revoke_waits_finish(ps, ps->revoke_err, ps->revoke_msg);
}

static int grant_call_run(sx_agent *a, int revoke, const char *producer, const uint8_t *inc) {
  const char *what = revoke ? "sx_agent_revoke_write" : "sx_agent_grant_write";
  if (a == NULL)
    return sx__err(SX_EINVAL, "%s: NULL agent", what);
  if (producer == NULL && inc != NULL)
    return sx__err(SX_EINVAL, "%s: an incarnation without a producer name", what);
  int rc;
  if (producer != NULL && (rc = sx_name_validate(producer)) != 0)
    return sx__errwrap(rc, "%s", what);
  grant_call *gc = calloc(1, sizeof(*gc));
  if (gc == NULL)
    return sx__err(SX_ENOMEM, "%s", what);
  gc->c.run = grant_run;
  gc->revoke = revoke;
  gc->any_name = producer == NULL;
  gc->any_inc = inc == NULL;
  if (producer != NULL)
    snprintf(gc->name, sizeof(gc->name), "%s", producer);
  if (inc != NULL)
    memcpy(gc->inc, inc, SX_INCARNATION_LEN);
  int err = sx__call_wait(a, &gc->c, SX__CALL_SLACK_MS, &rc);
  if (err)
    return err; /* the call is the agent's now */
  rc = sx__call_result(&gc->c, rc);
  sx__call_free(&gc->c);
  return rc;
}

int sx_agent_grant_write(sx_agent *a, const char *producer, const uint8_t *incarnation) {
  return grant_call_run(a, 0, producer, incarnation);
}

int sx_agent_revoke_write(sx_agent *a, const char *producer, const uint8_t *incarnation) {
  return grant_call_run(a, 1, producer, incarnation);
}

/* ------------------------------------------------------------ authorization */

struct sx_wauth {
  sx_agent *a;
  sx_wauth_cb cb; /* NULL once cancelled */
  void *arg;
  char name[SX_NAME_MAX + 1]; /* "" while looked up by incarnation */
  uint8_t inc[SX_INCARNATION_LEN];
  uint8_t token[SX_TOKEN_LEN];
  int refreshed;
};

void sx__push_write_auth_cancel(sx_wauth *w) {
  if (w != NULL)
    w->cb = NULL;
}

static void auth_end(sx_wauth *w, int status, const char *fmt, ...) SX__PRINTF(3, 4);
static void auth_end(sx_wauth *w, int status, const char *fmt, ...) {
  char msg[512] = "";
  if (fmt != NULL) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
  }
  if (w->cb != NULL)
    w->cb(w->arg, status, w->name, msg);
  free(w);
}

static const char *short_inc(const uint8_t *inc, char buf[2 * SX_INCARNATION_LEN + 1]) {
  sx_hex(inc, SX_INCARNATION_LEN, buf);
  buf[8] = '\0';
  return buf;
}

static void remember_name(sx__push *ps, const uint8_t *inc, const char *name) {
  for (uint32_t i = 0; i < SX__PUSH_NAMES; i++)
    if (memcmp(ps->names[i].inc, inc, SX_INCARNATION_LEN) == 0)
      return;
  uint32_t k = ps->next_name++ % SX__PUSH_NAMES;
  memcpy(ps->names[k].inc, inc, SX_INCARNATION_LEN);
  snprintf(ps->names[k].name, sizeof(ps->names[k].name), "%s", name);
}

static void resolved(void *arg, int status, sx_cdesc *d, const char *msg);

static void auth_resolve(sx_wauth *w, unsigned flags) {
  sx_agent *a = w->a;
  int rc = a->cache != NULL ? sx__cache_resolve(a->cache, w->name, flags, 0, resolved, w)
                            : SX_ESHUTDOWN;
  if (rc != 0)
    auth_end(w, rc, "cannot look up producer %.64s: %s", w->name, sx_strerror(rc));
}

/* The producer's descriptor, from the cache or the store. */
static void resolved(void *arg, int status, sx_cdesc *d, const char *msg) {
  sx_wauth *w = arg;
  sx_agent *a = w->a;
  char want[2 * SX_INCARNATION_LEN + 1], have[2 * SX_INCARNATION_LEN + 1];
  if (w->cb == NULL || a->shutting_down) {
    sx__cdesc_unref(d);
    auth_end(w, SX_ESHUTDOWN, NULL);
    return;
  }
  if (status != 0) {
    auth_end(w, status == SX_ENOENT ? SX_EACCESS : status,
             "producer %.64s is not published%s%s", w->name, msg ? ": " : "", msg ? msg : "");
    return;
  }
  int inc_bad = memcmp(d->desc.incarnation, w->inc, SX_INCARNATION_LEN) != 0;
  int tok_bad = sx__ct_memcmp(d->desc.token, w->token, SX_TOKEN_LEN) != 0;
  short_inc(d->desc.incarnation, have);
  sx__cdesc_unref(d);
  if (inc_bad && !w->refreshed) {
    /* The cache may hold the life before a restart: ask the store once. */
    w->refreshed = 1;
    auth_resolve(w, SX_CACHE_REFRESH);
    return;
  }
  if (inc_bad) {
    auth_end(w, SX_EACCESS, "producer %.64s presents incarnation %s, but the store holds %s",
             w->name, short_inc(w->inc, want), have);
    return;
  }
  if (tok_bad) {
    auth_end(w, SX_EACCESS, "producer %.64s presents a token that is not its descriptor's",
             w->name);
    return;
  }
  if (sx__push_write_granted(a, w->name, w->inc) != 0) {
    auth_end(w, SX_EACCESS, "no write grant covers %.64s (revoked meanwhile)", w->name);
    return;
  }
  remember_name(a->push, w->inc, w->name);
  auth_end(w, 0, NULL);
}

/* The namespace listing, searched for the producer's incarnation. */
static void listed(void *arg, const sx_backend_reply *rep) {
  sx_wauth *w = arg;
  char inc[2 * SX_INCARNATION_LEN + 1];
  if (w->cb == NULL || w->a->shutting_down) {
    auth_end(w, SX_ESHUTDOWN, NULL);
    return;
  }
  if (rep->status != 0) {
    auth_end(w, rep->status, "listing the namespace to find producer %s: %s",
             short_inc(w->inc, inc), rep->message[0] ? rep->message : sx_strerror(rep->status));
    return;
  }
  for (size_t i = 0; i < rep->n_items && w->name[0] == '\0'; i++) {
    const sx_backend_item *it = &rep->items[i];
    sx_desc d;
    if (it->status != 0 || it->value == NULL || sx_desc_decode(it->value, it->len, &d) != 0)
      continue;
    if (memcmp(d.incarnation, w->inc, SX_INCARNATION_LEN) == 0)
      snprintf(w->name, sizeof(w->name), "%s", d.name);
    sx_desc_free(&d);
  }
  if (w->name[0] == '\0') {
    auth_end(w, SX_EACCESS, "no published segment has incarnation %s", short_inc(w->inc, inc));
    return;
  }
  if (sx__push_write_granted(w->a, w->name, w->inc) != 0) {
    auth_end(w, SX_EACCESS, "no write grant covers %.64s", w->name);
    return;
  }
  auth_resolve(w, 0);
}

int sx__push_write_auth(void *agent, const char *producer, const uint8_t *inc,
                        const uint8_t *token, sx_wauth_cb cb, void *arg, sx_wauth **out) {
  sx_agent *a = agent;
  sx__push *ps = a->push;
  char hex[2 * SX_INCARNATION_LEN + 1];
  if (a->shutting_down || a->cache == NULL)
    return sx__err(SX_ESHUTDOWN, "the agent is shutting down");
  const char *name = producer != NULL && producer[0] != '\0' ? producer : NULL;
  if (name == NULL) {
    for (const sx__grant *g = ps->grants; g != NULL && name == NULL; g = g->next)
      if (!g->any_name && !g->any_inc && memcmp(g->inc, inc, SX_INCARNATION_LEN) == 0)
        name = g->name;
    for (uint32_t i = 0; i < SX__PUSH_NAMES && name == NULL; i++)
      if (ps->names[i].name[0] && memcmp(ps->names[i].inc, inc, SX_INCARNATION_LEN) == 0)
        name = ps->names[i].name;
  }
  if (name != NULL && sx__push_write_granted(a, name, inc) != 0)
    return sx__err(SX_EACCESS, "no write grant covers %.64s incarnation %s", name,
                   short_inc(inc, hex));
  if (name == NULL && ps->grants == NULL)
    return sx__err(SX_EACCESS, "no write grant covers producer %s (this agent granted none)",
                   short_inc(inc, hex));
  sx_wauth *w = calloc(1, sizeof(*w));
  if (w == NULL)
    return sx__err(SX_ENOMEM, "authorizing a producer");
  w->a = a;
  w->cb = cb;
  w->arg = arg;
  memcpy(w->inc, inc, SX_INCARNATION_LEN);
  memcpy(w->token, token, SX_TOKEN_LEN);
  int rc;
  if (name != NULL) {
    snprintf(w->name, sizeof(w->name), "%s", name);
    rc = sx__cache_resolve(a->cache, w->name, 0, 0, resolved, w);
  } else {
    rc = SX__BACKEND_CALL(a->backend, list, listed, w);
  }
  if (rc != 0) {
    free(w);
    return sx__err(rc, "cannot look up the producer in the store: %s", sx_strerror(rc));
  }
  *out = w;
  return 0;
}

/* ------------------------------------------------------------ lifetime */

void sx__push_grants_free(sx_agent *a) {
  a->push->revoke_pending = 0;
  revoke_waits_finish(a->push, SX_ESHUTDOWN, "the agent is shutting down");
  while (a->push->grants != NULL) {
    sx__grant *g = a->push->grants;
    a->push->grants = g->next;
    free(g);
  }
}
