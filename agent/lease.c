/*
 * The lease state machine.  One store operation is in flight at a time;
 * publish, unpublish and renew requests queue behind it in order.
 *
 *   UNPUBLISHED --publish ok--> PUBLISHED --renew every renew_ms--> ...
 *   PUBLISHED --renew: SX_EGONE (expired while we were stopped, or a
 *               restarted empty store)--> RECLAIMING --republish with the
 *               next generation--> PUBLISHED
 *   PUBLISHED/RECLAIMING --SX_EFENCED, or the name held by another live
 *               incarnation when reclaiming--> FENCED (renewing stops)
 *   store errors: counted and retried at the next tick; a publish that
 *               cannot reach the store leaves RECLAIMING and retries.
 *   the store connection comes back: renew (or republish) at once.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent_int.h"

typedef enum { REQ_PUBLISH, REQ_UNPUBLISH, REQ_RENEW } req_kind;

/* How often a publish that hit SX_EGENERATION moves on to a higher one. */
#define EGEN_RETRIES 3

struct sx__lease_req {
  sx__lease_req *next;
  sx_agent *a;
  req_kind kind;
  unsigned flags;
  int internal; /* a reclaim or renew the agent made itself */
  uint64_t generation;
  uint8_t *value;
  void (*then)(sx_agent *, void *, int);
  void *arg;
};

static sx_agent_state state_of(sx_agent *a) {
  pthread_mutex_lock(&a->lock);
  sx_agent_state s = a->status.state;
  pthread_mutex_unlock(&a->lock);
  return s;
}

static void pump(sx_agent *a);

static void push(sx_agent *a, sx__lease_req *r, int front) {
  sx__lease *l = &a->lease;
  if (front) {
    r->next = l->q;
    l->q = r;
    if (l->q_tail == &l->q)
      l->q_tail = &r->next;
  } else {
    r->next = NULL;
    *l->q_tail = r;
    l->q_tail = &r->next;
  }
}

static sx__lease_req *new_req(sx_agent *a, req_kind kind, int internal,
                              void (*then)(sx_agent *, void *, int), void *arg) {
  sx__lease_req *r = calloc(1, sizeof(*r));
  if (r == NULL) {
    sx__log(a, SX_LOG_ERROR, "lease: out of memory");
    if (then)
      then(a, arg, sx__err(SX_ENOMEM, "lease: out of memory"));
    return NULL;
  }
  r->a = a;
  r->kind = kind;
  r->internal = internal;
  r->then = then;
  r->arg = arg;
  return r;
}

/* Finish a request: its continuation sees rc (and sx_errmsg() on this
 * thread says why). */
static void done(sx__lease_req *r, int rc) {
  if (r->then)
    r->then(r->a, r->arg, rc);
  free(r->value);
  free(r);
}

static void tick(uv_timer_t *t);

static void arm(sx_agent *a) {
  if (!a->shutting_down && !uv_is_active((uv_handle_t *)&a->lease.timer))
    uv_timer_start(&a->lease.timer, tick, a->p.renew_ms, a->p.renew_ms);
}

static void disarm(sx_agent *a) {
  if (a->lease.timer_init)
    uv_timer_stop(&a->lease.timer);
}

static void fenced(sx_agent *a, int rc, const char *why) {
  a->lease.want = 0;
  disarm(a);
  if (state_of(a) != SX_AGENT_FENCED)
    sx__log(a, SX_LOG_ERROR, "fenced: %s; stopped renewing (restart or publish with "
            "takeover to claim the name again)", why);
  sx__set_state(a, SX_AGENT_FENCED, rc);
}

static void count_failure(sx_agent *a, int rc) {
  sx__stats_lease_error(a, rc);
  pthread_mutex_lock(&a->lock);
  a->status.renew_failures++;
  a->status.last_error = rc;
  pthread_mutex_unlock(&a->lock);
}

/* The store did not take a publish (it was down, timed out or answered an
 * error; sx_errmsg() says which).  While the user still wants the segment
 * published, keep retrying from the renew timer and on reconnect: a store
 * outage at the first publish must not leave the agent unpublished for
 * good. */
static void publish_retry_later(sx_agent *a, int rc) {
  count_failure(a, rc);
  if (a->lease.want && !a->shutting_down) {
    sx__set_state(a, SX_AGENT_RECLAIMING, rc);
    sx__log(a, SX_LOG_WARN, "%s; retrying every %u ms", sx_errmsg(), a->p.renew_ms);
    arm(a);
  }
}

/* Queue the operation the current state calls for: a renew when published,
 * a republish when reclaiming. */
static void maintain(sx_agent *a, int front) {
  if (!a->lease.want || a->shutting_down)
    return;
  sx_agent_state s = state_of(a);
  req_kind k;
  if (s == SX_AGENT_PUBLISHED)
    k = REQ_RENEW;
  else if (s == SX_AGENT_RECLAIMING)
    k = REQ_PUBLISH;
  else
    return;
  sx__lease_req *r = new_req(a, k, 1, NULL, NULL);
  if (r != NULL)
    push(a, r, front);
}

/* ------------------------------------------------------------ replies */

static void publish_cb(void *arg, const sx_backend_reply *rep) {
  sx__lease_req *r = arg;
  sx_agent *a = r->a;
  int rc = rep->status;
  a->lease.busy = 0;
  if (a->shutting_down && r->internal) {
    done(r, rc);
    pump(a); /* the shutdown's unpublish may wait behind this one */
    return;
  }
  sx_agent_state before = state_of(a);
  if (rc == 0) {
    sx__stats_lease_ok(a, 1);
    a->lease.egen_retries = 0;
    a->lease.generation = r->generation;
    pthread_mutex_lock(&a->lock);
    a->status.generation = r->generation;
    if (before == SX_AGENT_RECLAIMING && r->internal)
      a->status.republishes++;
    pthread_mutex_unlock(&a->lock);
    sx__set_state(a, SX_AGENT_PUBLISHED, 0);
    sx__log(a, SX_LOG_INFO, "published generation %lu (lease %u ms%s)",
            (unsigned long)r->generation, a->p.lease_ms,
            before == SX_AGENT_RECLAIMING ? ", reclaimed" : "");
    arm(a);
  } else if (rc == SX_EGENERATION && a->lease.egen_retries < EGEN_RETRIES) {
    /* An earlier attempt may have landed without its answer reaching us:
     * move past it and try again. */
    a->lease.egen_retries++;
    a->lease.generation = r->generation;
    free(r->value);
    r->value = NULL;
    push(a, r, 1);
    pump(a);
    return;
  } else if (rc == SX_EHELD) {
    sx__stats_lease_error(a, rc);
    char inc[2 * SX_INCARNATION_LEN + 1];
    sx_hex(rep->holder, SX_INCARNATION_LEN, inc);
    sx__err(rc, "%s is held by incarnation %s (last renewed %lu ms ago, lease left "
            "%ld ms)", a->name, inc, (unsigned long)rep->holder_age_ms,
            (long)rep->holder_ttl_ms);
    if (r->internal) {
      char why[300];
      snprintf(why, sizeof(why), "the name was taken by incarnation %s while our lease "
               "was lost", inc);
      fenced(a, rc, why);
    } else if (before == SX_AGENT_UNPUBLISHED) {
      a->lease.want = 0;
    }
  } else if (rc == SX_EFENCED) {
    sx__stats_lease_error(a, rc);
    sx__err(rc, "%s: %s", a->name, rep->message[0] ? rep->message :
            "another incarnation took over this segment");
    fenced(a, rc, "another incarnation took over this segment");
  } else if (rc == SX_ECANCELED) {
    sx__err(rc, "%s: publish canceled (store closed)", a->name);
  } else {
    sx__err(rc, "%s: publish failed: %s", a->name, rep->message[0] ? rep->message :
            sx_strerror(rc));
    publish_retry_later(a, rc);
  }
  done(r, rc);
  pump(a);
}

static void renew_cb(void *arg, const sx_backend_reply *rep) {
  sx__lease_req *r = arg;
  sx_agent *a = r->a;
  int rc = rep->status;
  a->lease.busy = 0;
  if (a->shutting_down || rc == SX_ECANCELED) {
    done(r, rc);
    pump(a); /* the shutdown's unpublish may wait behind this one */
    return;
  }
  if (rc == 0) {
    sx__stats_lease_ok(a, 0);
    pthread_mutex_lock(&a->lock);
    a->status.renewals++;
    a->status.last_error = 0;
    pthread_mutex_unlock(&a->lock);
  } else if (rc == SX_EGONE) {
    sx__stats_lease_error(a, rc);
    sx__log(a, SX_LOG_WARN, "lease lost (the segment expired or the store lost it): "
            "republishing");
    sx__set_state(a, SX_AGENT_RECLAIMING, rc);
    maintain(a, 1);
  } else if (rc == SX_EFENCED) {
    sx__stats_lease_error(a, rc);
    fenced(a, rc, rep->message[0] ? rep->message : "another incarnation holds the name");
  } else {
    count_failure(a, rc);
    sx__log(a, SX_LOG_WARN, "renewing the lease failed: %s", rep->message[0] ?
            rep->message : sx_strerror(rc));
  }
  done(r, rc);
  pump(a);
}

static void unpublish_cb(void *arg, const sx_backend_reply *rep) {
  sx__lease_req *r = arg;
  sx_agent *a = r->a;
  int rc = rep->status;
  a->lease.busy = 0;
  if (rc == SX_EGONE)
    rc = 0; /* gone already: what we wanted */
  sx__set_state(a, SX_AGENT_UNPUBLISHED, rc);
  if (rc && rc != SX_ECANCELED)
    sx__stats_lease_error(a, rc);
  if (rc == 0)
    sx__log(a, SX_LOG_INFO, "unpublished");
  else
    sx__log(a, SX_LOG_WARN, "unpublish failed: %s (the lease runs out by itself)",
            rep->message[0] ? rep->message : sx_strerror(rc));
  if (rc)
    sx__err(rc, "%s: unpublish failed: %s", a->name, rep->message[0] ? rep->message :
            sx_strerror(rc));
  done(r, rc);
  pump(a);
}

/* ------------------------------------------------------------ requests */

static int start_publish(sx_agent *a, sx__lease_req *r) {
  if (a->name[0] == '\0')
    return sx__err(SX_EINVAL, "publishing needs an agent name (params.name)");
  sx_desc d;
  size_t len;
  int rc = sx__local_desc(a, &d);
  if (rc)
    return rc;
  /* A segment nobody can reach is no segment: say why instead of
   * publishing it (cuda_ipc alone packs nothing, since it lends its
   * handles over the TCP connection). */
  if (d.n_endpoints == 0) {
    sx_desc_free(&d);
    return sx__err(SX_EINVAL, "%s: nothing to publish peers could reach: no transport of "
                   "this agent listens (cuda_ipc needs tcp as well; a reader-only "
                   "agent has no listen address)", a->name);
  }
  r->generation = a->lease.generation + 1;
  d.generation = r->generation;
  rc = sx_desc_encode(&d, &r->value, &len);
  uint32_t n_regions = d.n_regions;
  sx_desc_free(&d);
  if (rc)
    return sx__errwrap(rc, "encoding the descriptor");
  sx_publish_req req = {
      .name = a->name,
      .incarnation = a->incarnation,
      .generation = r->generation,
      .value = r->value,
      .len = len,
      .lease_ms = a->p.lease_ms,
      .takeover = (r->flags & SX_PUBLISH_TAKEOVER) != 0,
  };
  sx__log(a, SX_LOG_DEBUG, "publishing generation %lu: %u regions, %zu bytes%s",
          (unsigned long)r->generation, n_regions, len, req.takeover ? ", takeover" : "");
  rc = sx__backend_publish(a->backend, &req, publish_cb, r);
  if (rc) {
    /* Refused before it was sent (the store is down): the same as a
     * failure the store answered. */
    sx__errwrap(rc, "publish failed");
    publish_retry_later(a, rc);
  }
  return rc;
}

static void pump(sx_agent *a) {
  sx__lease *l = &a->lease;
  while (!l->busy && l->q != NULL) {
    sx__lease_req *r = l->q;
    l->q = r->next;
    if (l->q == NULL)
      l->q_tail = &l->q;
    int rc;
    sx_agent_state s = state_of(a);
    if (r->kind == REQ_PUBLISH) {
      if (r->internal && (!l->want || s == SX_AGENT_FENCED)) {
        done(r, 0);
        continue;
      }
      rc = start_publish(a, r);
    } else if (r->kind == REQ_RENEW) {
      if (!l->want || s != SX_AGENT_PUBLISHED) {
        done(r, 0);
        continue;
      }
      rc = sx__backend_renew(a->backend, a->name, a->incarnation, a->p.lease_ms,
                             renew_cb, r);
    } else {
      disarm(a);
      l->want = 0;
      if (s == SX_AGENT_UNPUBLISHED || s == SX_AGENT_FENCED) {
        sx__set_state(a, SX_AGENT_UNPUBLISHED, 0);
        done(r, 0);
        continue;
      }
      rc = sx__backend_unpublish(a->backend, a->name, a->incarnation, unpublish_cb, r);
    }
    if (rc) {
      /* Not sent at all (the store is down: SX_EUNREACH at once): a failed
       * renewal all the same, for the counters.  A publish counts itself
       * (start_publish() keeps retrying it). */
      if (r->kind == REQ_RENEW && rc != SX_ESHUTDOWN)
        count_failure(a, rc);
      done(r, rc);
      continue;
    }
    l->busy = 1;
  }
  if (!l->busy && l->kick) {
    l->kick = 0;
    maintain(a, 0);
    if (l->q != NULL)
      pump(a);
  }
}

static void tick(uv_timer_t *t) {
  sx_agent *a = t->data;
  if (a->lease.busy || a->lease.q != NULL)
    return; /* the operation in flight will do */
  maintain(a, 0);
  pump(a);
}

void sx__lease_publish(sx_agent *a, unsigned flags, void (*then)(sx_agent *, void *, int),
                       void *arg) {
  sx__lease_req *r = new_req(a, REQ_PUBLISH, 0, then, arg);
  if (r == NULL)
    return;
  r->flags = flags;
  a->lease.want = 1;
  a->lease.egen_retries = 0;
  push(a, r, 0);
  pump(a);
}

void sx__lease_unpublish(sx_agent *a, void (*then)(sx_agent *, void *, int), void *arg) {
  sx__lease_req *r = new_req(a, REQ_UNPUBLISH, 0, then, arg);
  if (r == NULL)
    return;
  push(a, r, 0);
  pump(a);
}

void sx__lease_on_conn(sx_agent *a, int up, int err, const char *msg) {
  (void)err;
  (void)msg;
  if (!up || !a->lease.want)
    return;
  /* Back after an outage, or a restarted store: renew now (which
   * republishes if the store lost the segment). */
  if (a->lease.busy) {
    a->lease.kick = 1;
    return;
  }
  maintain(a, 0);
  pump(a);
}

void sx__lease_close(sx_agent *a) {
  sx__lease *l = &a->lease;
  while (l->q != NULL) {
    sx__lease_req *r = l->q;
    l->q = r->next;
    done(r, sx__err(SX_ESHUTDOWN, "the agent is shutting down"));
  }
  l->q_tail = &l->q;
  if (l->timer_init && !uv_is_closing((uv_handle_t *)&l->timer))
    uv_close((uv_handle_t *)&l->timer, NULL);
}

/* ------------------------------------------------------------ API */

typedef struct lease_call {
  sx__call c;
  unsigned flags;
  int publish;
} lease_call;

static void lease_then(sx_agent *a, void *arg, int rc) {
  (void)a;
  sx__call_finish(arg, rc, rc ? sx_errmsg() : NULL);
}

static void lease_run(sx__call *c) {
  lease_call *lc = (lease_call *)c;
  sx_agent *a = c->a;
  if (a->shutting_down) {
    sx__call_finish(c, SX_ESHUTDOWN, "the agent is shutting down");
    return;
  }
  if (lc->publish)
    sx__lease_publish(a, lc->flags, lease_then, c);
  else
    sx__lease_unpublish(a, lease_then, c);
}

static int lease_call_wait(sx_agent *a, int publish, unsigned flags) {
  if (a == NULL)
    return sx__err(SX_EINVAL, "NULL agent");
  lease_call *lc = calloc(1, sizeof(*lc));
  if (lc == NULL)
    return sx__err(SX_ENOMEM, "out of memory");
  lc->c.run = lease_run;
  lc->publish = publish;
  lc->flags = flags;
  int rc, err = sx__call_wait(a, &lc->c, SX__CALL_SLACK_MS, &rc);
  if (err)
    return err; /* the call is the agent's now */
  rc = sx__call_result(&lc->c, rc);
  sx__call_free(&lc->c);
  return rc;
}

int sx_agent_publish(sx_agent *a, unsigned flags) {
  if (a != NULL && a->name[0] == '\0')
    return sx__err(SX_EINVAL, "publishing needs an agent name (params.name)");
  return lease_call_wait(a, 1, flags);
}

int sx_agent_unpublish(sx_agent *a) { return lease_call_wait(a, 0, 0); }
