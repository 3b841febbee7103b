/*
 * Opening segments by name: resolve through the cache (waiting for the name
 * if asked), pick a transport, share one transport peer per remote
 * incarnation between the segments opened on it, and learn from failures
 * (a stale target is remembered so later batches fail at once; a broken
 * connection triggers one cache refresh to see whether the target
 * restarted).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent_int.h"

/* ------------------------------------------------------------ peers */

static void rpeer_put(sx__rpeer *p, sx_agent *a) {
  if (--p->refs > 0)
    return;
  for (sx__rpeer **pp = &a->peers; *pp; pp = &(*pp)->next) {
    if (*pp == p) {
      *pp = p->next;
      break;
    }
  }
  if (p->tp != NULL)
    p->tp->t->ops->peer_close(p->tp);
  if (p->wtp != NULL)
    p->wtp->t->ops->peer_close(p->wtp);
  if (p->ntp != NULL)
    p->ntp->t->ops->peer_close(p->ntp);
  sx__cdesc_unref(p->cd);
  free(p);
}

static sx__rpeer *rpeer_get(sx_agent *a, sx_cdesc *cd, sx_transport_kind kind) {
  for (sx__rpeer *p = a->peers; p; p = p->next) {
    if (p->kind == kind && strcmp(p->cd->desc.name, cd->desc.name) == 0 &&
        memcmp(p->cd->desc.incarnation, cd->desc.incarnation, SX_INCARNATION_LEN) == 0) {
      /* cd was just resolved: this incarnation is published (again, after
       * its lease lapsed while it was stopped), whatever a refresh found
       * before. */
      if (p->fatal == SX_ENOENT) {
        p->fatal = 0;
        p->fatal_msg[0] = '\0';
      }
      p->refs++;
      return p;
    }
  }
  sx__rpeer *p = calloc(1, sizeof(*p));
  if (p == NULL)
    return NULL;
  p->cd = sx__cdesc_ref(cd);
  p->kind = kind;
  p->refs = 1;
  p->next = a->peers;
  a->peers = p;
  return p;
}

static const char *kind_name(sx_transport_kind k) {
  return k == SX_TRANSPORT_RDMA ? "rdma" : k == SX_TRANSPORT_TCP ? "tcp"
       : k == SX_TRANSPORT_CUDA_IPC ? "cuda_ipc" : "none";
}

typedef struct refresh {
  sx_agent *a;
  sx__rpeer *p;
} refresh;

static void refreshed(void *arg, int status, sx_cdesc *d, const char *msg) {
  refresh *r = arg;
  sx_agent *a = r->a;
  sx__rpeer *p = r->p;
  (void)msg;
  free(r);
  p->refreshing = 0;
  char old[2 * SX_INCARNATION_LEN + 1], now[2 * SX_INCARNATION_LEN + 1];
  sx_hex(p->cd->desc.incarnation, SX_INCARNATION_LEN, old);
  if (status == 0 &&
      memcmp(d->desc.incarnation, p->cd->desc.incarnation, SX_INCARNATION_LEN) != 0) {
    sx_hex(d->desc.incarnation, SX_INCARNATION_LEN, now);
    p->fatal = SX_ESTALE;
    snprintf(p->fatal_msg, sizeof(p->fatal_msg), "%.64s restarted: incarnation %.8s "
             "replaced %.8s; reopen the segment", p->cd->desc.name, now, old);
    sx__log(a, SX_LOG_WARN, "%s", p->fatal_msg);
  } else if (status == 0 && p->fatal == SX_ENOENT) {
    p->fatal = 0; /* published again by the same incarnation */
    p->fatal_msg[0] = '\0';
  } else if (status == SX_ENOENT) {
    p->fatal = SX_ENOENT;
    snprintf(p->fatal_msg, sizeof(p->fatal_msg), "%.64s (incarnation %.8s) is no longer "
             "published", p->cd->desc.name, old);
    sx__log(a, SX_LOG_WARN, "%s", p->fatal_msg);
  }
  sx__cdesc_unref(d);
  rpeer_put(p, a);
}

void sx__peer_failed(sx_agent *a, sx__rpeer *p, int err, const char *msg) {
  if (err == SX_ESTALE || err == SX_EACCESS) {
    /* The target said so itself: nothing read through this peer can work. */
    if (p->fatal == 0) {
      p->fatal = err;
      snprintf(p->fatal_msg, sizeof(p->fatal_msg), "%s", msg ? msg : sx_strerror(err));
      sx__log(a, SX_LOG_WARN, "%s: %s", p->cd->desc.name, p->fatal_msg);
    }
    if (err == SX_ESTALE)
      sx__cache_invalidate(a->cache, p->cd->desc.name, p->cd->desc.incarnation);
    return;
  }
  if ((err == SX_EDISCONN || err == SX_EUNREACH || err == SX_ETIMEDOUT) &&
      !p->refreshing && p->fatal == 0 && a->cache != NULL) {
    /* One refresh (shared with any other caller) tells a dead or restarted
     * target from a slow one. */
    refresh *r = malloc(sizeof(*r));
    if (r == NULL)
      return;
    r->a = a;
    r->p = p;
    if (sx__cache_resolve(a->cache, p->cd->desc.name, SX_CACHE_REFRESH, 0, refreshed,
                          r) != 0) {
      free(r);
      return;
    }
    p->refreshing = 1;
    p->refs++;
  }
}

/* ------------------------------------------------------------ segments */

void sx__segment_put(sx_segment *s) {
  if (__atomic_sub_fetch(&s->refs, 1, __ATOMIC_ACQ_REL) != 0)
    return;
  sx__cdesc_unref(s->cd);
  sx__rindex_free(&s->ix);
  pthread_mutex_destroy(&s->lane_mu);
  free(s);
}

/* Loop thread: point s's direct reads at lane (NULL: none), a lane of
 * transport ops. */
void sx__segment_lane(sx_segment *s, const sx_transport_ops *ops, sx__lane *lane) {
  if (s->lane == lane)
    return;
  if (lane != NULL)
    ops->lane_ref(lane, +1);
  pthread_mutex_lock(&s->lane_mu);
  sx__lane *old = s->lane;
  const sx_transport_ops *old_ops = s->lane_ops;
  s->lane = lane;
  s->lane_ops = ops;
  pthread_mutex_unlock(&s->lane_mu);
  if (old != NULL)
    old_ops->lane_ref(old, -1);
}

/* Loop thread: close s.  What only the loop may touch (the agent's list, the
 * transport peer) goes now; the rest when the last batch on s is freed. */
static void segment_free(sx_segment *s) {
  sx_agent *a = s->a;
  if (s->prev)
    s->prev->next = s->next;
  else
    a->segments = s->next;
  if (s->next)
    s->next->prev = s->prev;
  sx__rpeer *p = s->peer;
  s->peer = NULL; /* batches started from now on fail; see submit_run() */
  sx__segment_lane(s, NULL, NULL);
  rpeer_put(p, a);
  sx__stats_segment(a, -1);
  sx__segment_put(s);
}

/* Loop thread: a segment over cd (takes a new reference). */
static int make_segment(sx_agent *a, sx_cdesc *cd, sx_segment **out) {
  const sx_desc *d = &cd->desc;
  sx_transport_kind kind = SX_TRANSPORT_NONE;
  static const sx_transport_kind prefer[] = {SX_TRANSPORT_CUDA_IPC, SX_TRANSPORT_RDMA,
                                              SX_TRANSPORT_TCP};
  /* Whether RDMA carries this segment's GPU memory is its usable()'s call
   * (docs/gpu.md, "Which transport carries GPU memory"). */
  for (unsigned i = 0; i < sizeof(prefer) / sizeof(prefer[0]); i++) {
    sx_transport *t = a->tr[prefer[i]];
    if (t != NULL && (a->p.transports & (1u << prefer[i])) && t->ops->usable(t, d)) {
      kind = prefer[i];
      break;
    }
  }
  if (kind == SX_TRANSPORT_NONE) {
    char theirs[64] = "";
    for (uint32_t i = 0; i < d->n_endpoints; i++)
      snprintf(theirs + strlen(theirs), sizeof(theirs) - strlen(theirs), "%s%s",
               i ? "," : "", kind_name(d->endpoints[i].kind));
    return sx__err(SX_EUNREACH, "%s: no common transport (it publishes endpoints "
                   "'%s'; this agent may use%s%s%s)", d->name, theirs,
                   a->tr[SX_TRANSPORT_TCP] ? " tcp" : "",
                   a->tr[SX_TRANSPORT_RDMA] ? " rdma" : "",
                   a->tr[SX_TRANSPORT_CUDA_IPC] ? " cuda_ipc" : "");
  }
  sx_segment *s = calloc(1, sizeof(*s));
  if (s == NULL)
    return sx__err(SX_ENOMEM, "opening %s", d->name);
  int rc = sx__rindex_build_desc(&s->ix, d);
  if (rc == 0 && (s->peer = rpeer_get(a, cd, kind)) == NULL)
    rc = sx__err(SX_ENOMEM, "opening %s", d->name);
  if (rc) {
    sx__rindex_free(&s->ix);
    free(s);
    return rc;
  }
  s->a = a;
  s->cd = sx__cdesc_ref(cd);
  s->kind = kind;
  s->refs = 1;
  pthread_mutex_init(&s->lane_mu, NULL);
  s->next = a->segments;
  if (s->next)
    s->next->prev = s;
  a->segments = s;
  sx__stats_segment(a, +1);
  char inc[2 * SX_INCARNATION_LEN + 1];
  sx_hex(d->incarnation, SX_INCARNATION_LEN, inc);
  sx__log(a, SX_LOG_DEBUG, "opened %s: incarnation %.8s generation %lu, %u regions, "
          "via %s", d->name, inc, (unsigned long)d->generation, d->n_regions,
          kind_name(kind));
  *out = s;
  return 0;
}

void sx__segments_close(sx_agent *a) {
  while (a->segments != NULL) {
    sx__log(a, SX_LOG_WARN, "closing segment %s left open at shutdown",
            a->segments->cd->desc.name);
    segment_free(a->segments);
  }
}

/* ------------------------------------------------------------ open */

typedef struct open_req {
  sx__call c;
  char name[SX_NAME_MAX + 1];
  uint32_t timeout_ms;
  int async;
  sx_open_cb cb;
  void *arg;
  sx_segment *seg; /* the result of a synchronous open */
} open_req;

static void open_done(open_req *o, int rc, sx_segment *s, const char *msg) {
  if (o->async) {
    if (rc)
      sx__err(rc, "%s", msg ? msg : sx_strerror(rc));
    o->cb(o->arg, rc, s);
    free(o);
    return;
  }
  o->seg = s;
  sx__call_finish(&o->c, rc, msg);
}

/* The waiter of a synchronous open gave up: close what it will not take. */
static void open_discard(sx__call *c) {
  open_req *o = (open_req *)c;
  if (o->seg != NULL)
    segment_free(o->seg);
}

static void resolved(void *arg, int status, sx_cdesc *d, const char *msg) {
  open_req *o = arg;
  sx_agent *a = o->c.a;
  sx_segment *s = NULL;
  if (status == 0 && a->shutting_down)
    status = sx__err(SX_ESHUTDOWN, "the agent is shutting down");
  if (status == 0)
    status = make_segment(a, d, &s);
  else if (msg != NULL)
    sx__err(status, "%s", msg);
  sx__cdesc_unref(d);
  open_done(o, status, s, status ? sx_errmsg() : NULL);
}

static void open_run(sx__call *c) {
  open_req *o = (open_req *)c;
  sx_agent *a = c->a;
  if (a->shutting_down) {
    open_done(o, SX_ESHUTDOWN, NULL, "the agent is shutting down");
    return;
  }
  sx_cdesc *d = sx__cache_peek(a->cache, o->name);
  if (d != NULL) {
    resolved(o, 0, d, NULL);
    return;
  }
  int rc = sx__cache_resolve(a->cache, o->name, 0, o->timeout_ms, resolved, o);
  if (rc)
    open_done(o, rc, NULL, sx_errmsg());
}

static int new_open(sx_agent *a, const char *name, uint32_t timeout_ms,
                    open_req **out) {
  if (a == NULL || name == NULL)
    return sx__err(SX_EINVAL, "sx_segment_open: NULL argument");
  int rc = sx_name_validate(name);
  if (rc)
    return rc;
  open_req *o = calloc(1, sizeof(*o));
  if (o == NULL)
    return sx__err(SX_ENOMEM, "sx_segment_open");
  snprintf(o->name, sizeof(o->name), "%s", name);
  o->timeout_ms = timeout_ms;
  o->c.run = open_run;
  *out = o;
  return 0;
}

int sx_segment_open(sx_agent *a, const char *name, uint32_t timeout_ms,
                    sx_segment **out) {
  open_req *o;
  if (out == NULL)
    return sx__err(SX_EINVAL, "sx_segment_open: NULL out");
  int rc = new_open(a, name, timeout_ms, &o);
  if (rc)
    return rc;
  o->c.discard = open_discard;
  /* The loop bounds the open by timeout_ms itself; the slack on top must
   * not wrap a long timeout around to a short one. */
  uint32_t wait_ms = timeout_ms > UINT32_MAX - SX__CALL_SLACK_MS ? UINT32_MAX
                                                                : timeout_ms + SX__CALL_SLACK_MS;
  int err = sx__call_wait(a, &o->c, wait_ms, &rc);
  if (err)
    return err; /* the call is the agent's now */
  rc = sx__call_result(&o->c, rc);
  if (rc == 0)
    *out = o->seg;
  sx__call_free(&o->c);
  return rc;
}

int sx_segment_open_async(sx_agent *a, const char *name, uint32_t timeout_ms,
                          sx_open_cb cb, void *arg) {
  open_req *o;
  if (cb == NULL)
    return sx__err(SX_EINVAL, "sx_segment_open_async: NULL callback");
  int rc = new_open(a, name, timeout_ms, &o);
  if (rc)
    return rc;
  o->async = 1;
  o->cb = cb;
  o->arg = arg;
  if ((rc = sx__call_post(a, &o->c)) != 0)
    free(o);
  return rc;
}

/* ------------------------------------------------------------ close */

typedef struct close_call {
  sx__call c;
  sx_segment *s;
} close_call;

static void close_run(sx__call *c) {
  close_call *cc = (close_call *)c;
  segment_free(cc->s);
  free(cc);
}

void sx_segment_close(sx_segment *s) {
  if (s == NULL)
    return;
  sx_agent *a = s->a;
  int live = __atomic_load_n(&s->refs, __ATOMIC_ACQUIRE) - 1;
  if (live > 0)
    sx__log(a, SX_LOG_ERROR, "closing segment %s with %d batches not destroyed: "
            "destroy them first", s->cd->desc.name, live);
  close_call *cc = calloc(1, sizeof(*cc));
  if (cc == NULL)
    return; /* freed at agent shutdown */
  cc->c.run = close_run;
  cc->c.embedded = 1; /* close_run frees it */
  cc->s = s;
  if (sx__call_post(a, &cc->c) != 0)
    free(cc); /* shutting down: sx__segments_close() frees it */
}

/* ------------------------------------------------------------ queries */

const sx_desc *sx_segment_desc(const sx_segment *s) { return &s->cd->desc; }

sx_transport_kind sx_segment_transport(const sx_segment *s) { return s->kind; }

int sx_segment_check(sx_segment *s, unsigned flags, sx_mismatch *mismatch) {
  if (s == NULL)
    return sx__err(SX_EINVAL, "sx_segment_check: NULL segment");
  sx_desc local;
  int rc = sx__layout_desc(s->a, &local);
  if (rc)
    return rc;
  sx_mismatch m;
  rc = sx_layout_check(&local, &s->cd->desc, flags, &m);
  sx_desc_free(&local);
  if (mismatch != NULL)
    *mismatch = m;
  return rc;
}

int sx_segment_ping(sx_segment *s, uint32_t timeout_ms, uint64_t *rtt_us,
                    sx_transport_kind *via) {
  if (s == NULL || rtt_us == NULL)
    return sx__err(SX_EINVAL, "sx_segment_ping: NULL argument");
  const sx_desc *d = &s->cd->desc;
  const sx_region *target = NULL;
  for (uint32_t i = 0; i < d->n_regions && target == NULL; i++)
    if (d->regions[i].access & SX_ACCESS_REMOTE_READ)
      target = &d->regions[i];
  if (target == NULL)
    return sx__err(SX_EDENIED, "%s has no region that allows remote reads", d->name);
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = timeout_ms ? timeout_ms : 5000;
  sx_batch *b;
  int rc = sx_batch_create(s, &bp, &b);
  if (rc)
    return rc;
  /* One byte into the agent's registered scratch memory. */
  if ((rc = sx__batch_add_scratch(b, target, 0, 1)) == 0 && (rc = sx_batch_submit(b)) == 0 &&
      (rc = sx_batch_wait(b, -1)) == 0) {
    sx_batch_result res;
    sx_batch_result_get(b, &res);
    if (res.state == SX_BATCH_COMPLETED) {
      *rtt_us = res.transfer_ns / 1000;
      if (via)
        *via = res.transport;
    } else {
      rc = sx__err(res.error ? res.error : SX_EIO, "%s", res.message);
    }
  }
  sx_batch_destroy(b);
  return rc;
}
