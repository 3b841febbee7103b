/*
 * Registered regions: registration (checked with the descriptor rules,
 * registered with every transport), retirement in the safe order
 * (refuse reads -> withdraw from the descriptor -> drain reads in flight ->
 * deregister), and the immutable snapshots planners read without locks.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent_int.h"

#define DRAIN_POLL_MS 2 /* how often a retiring region checks its reads */

/* ------------------------------------------------------------ snapshots */

static void lreg_put(sx_lregion *l) {
  sx__lreg *r = (sx__lreg *)l;
  if (__atomic_sub_fetch(&r->refs, 1, __ATOMIC_ACQ_REL) == 0)
    free(r);
}

sx__ltable *sx__ltable_get(sx_agent *a) {
  pthread_mutex_lock(&a->lock);
  sx__ltable *t = a->lt;
  __atomic_add_fetch(&t->refs, 1, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&a->lock);
  return t;
}

void sx__ltable_put(sx__ltable *t) {
  if (t == NULL || __atomic_sub_fetch(&t->refs, 1, __ATOMIC_ACQ_REL) != 0)
    return;
  for (uint32_t i = 0; i < t->n; i++)
    lreg_put(t->v[i]);
  free(t->v);
  sx__rindex_free(&t->ix);
  free(t);
}

/* A snapshot of the current regions with `add` appended and/or `drop`
 * left out; NULL when out of memory. */
static sx__ltable *ltable_derive(const sx__ltable *old, sx_lregion *add,
                                 const sx_lregion *drop) {
  sx__ltable *t = calloc(1, sizeof(*t));
  uint32_t cap = old->n + 1;
  const sx_region **keys = malloc(cap * sizeof(*keys));
  if (t == NULL || keys == NULL || (t->v = malloc(cap * sizeof(*t->v))) == NULL)
    goto out_free;
  for (uint32_t i = 0; i < old->n; i++)
    if (old->v[i] != drop)
      t->v[t->n++] = old->v[i];
  if (add != NULL)
    t->v[t->n++] = add;
  for (uint32_t i = 0; i < t->n; i++)
    keys[i] = &t->v[i]->r;
  if (sx__rindex_build(&t->ix, keys, t->n))
    goto out_free;
  free(keys);
  for (uint32_t i = 0; i < t->n; i++)
    __atomic_add_fetch(&((sx__lreg *)t->v[i])->refs, 1, __ATOMIC_RELAXED);
  t->refs = 1;
  return t;
out_free:
  if (t != NULL)
    free(t->v);
  free(t);
  free(keys);
  return NULL;
}

static void ltable_swap(sx_agent *a, sx__ltable *t) {
  pthread_mutex_lock(&a->lock);
  sx__ltable *old = a->lt;
  a->lt = t;
  pthread_mutex_unlock(&a->lock);
  sx__ltable_put(old);
}

sx_lregion *sx__find_region(void *agent, uint32_t id) {
  sx_agent *a = agent;
  sx_lregion *l = (sx_lregion *)sx__rindex_id(&a->lt->ix, id);
  return l != NULL && !l->withdrawn ? l : NULL;
}

sx_lregion *sx__region_at(void *agent, uint32_t i) {
  sx_agent *a = agent;
  return i < a->lt->n ? a->lt->v[i] : NULL;
}

/* ------------------------------------------------------------ descriptors */

/* Layout, labels and the given regions (withdrawn ones left out). */
static int snapshot_desc(sx_agent *a, const sx__ltable *t, sx_desc *out) {
  sx_desc d;
  sx_desc_init(&d);
  d.layout = a->p.layout;
  int rc = 0;
  for (uint32_t i = 0; i < a->p.n_labels && rc == 0; i++)
    rc = sx_desc_set_label(&d, a->p.labels[i].key, a->p.labels[i].value);
  /* Any thread (sx__layout_desc): the loop may be withdrawing one now. */
  for (uint32_t i = 0; i < t->n && rc == 0; i++)
    if (!__atomic_load_n(&t->v[i]->withdrawn, __ATOMIC_RELAXED))
      rc = sx_desc_add_region(&d, &t->v[i]->r);
  if (rc) {
    sx_desc_free(&d);
    return rc;
  }
  *out = d;
  return 0;
}

int sx__local_desc(sx_agent *a, sx_desc *out) {
  sx_desc d;
  int rc = snapshot_desc(a, a->lt, &d);
  if (rc)
    return rc;
  snprintf(d.name, sizeof(d.name), "%s", a->name);
  memcpy(d.incarnation, a->incarnation, SX_INCARNATION_LEN);
  memcpy(d.token, a->token, SX_TOKEN_LEN);
  d.generation = a->lease.generation;
  d.published_at_ms = sx__wall_ms();
  d.lease_ms = a->p.lease_ms;
  sx__host_identity(&d);
  for (int k = 0; k < SX__TRANSPORT_SLOTS && rc == 0; k++) {
    sx_transport *t = a->tr[k];
    if (t != NULL && t->ops->pack != NULL)
      rc = t->ops->pack(t, &d);
  }
  if (rc) {
    sx_desc_free(&d);
    return rc;
  }
  *out = d;
  return 0;
}

int sx__layout_desc(sx_agent *a, sx_desc *out) {
  sx__ltable *t = sx__ltable_get(a);
  int rc = snapshot_desc(a, t, out);
  sx__ltable_put(t);
  return rc;
}

/* ------------------------------------------------------------ register */

typedef struct reg_call {
  sx__call c;
  sx_region_params rp;
  uint32_t id;
} reg_call;

static int make_region(sx_agent *a, const sx_region_params *rp, sx_region *r) {
  memset(r, 0, sizeof(*r));
  if (rp->addr == NULL || rp->length == 0)
    return sx__err(SX_EINVAL, "region: addr is NULL or length is 0");
  r->id = a->next_region_id;
  r->group = rp->group;
  r->layer_first = rp->layer_first;
  r->layer_count = rp->layer_count ? rp->layer_count : 1;
  r->layer_stride = rp->layer_stride;
  r->slot = rp->slot;
  r->access = rp->access;
  r->addr = (uint64_t)(uintptr_t)rp->addr;
  r->length = rp->length;
  r->block_bytes = rp->block_bytes;
  r->block_stride = rp->block_stride ? rp->block_stride : rp->block_bytes;
  r->num_blocks = rp->num_blocks;
  if (sx__strlcpy(r->location, rp->location ? rp->location : "cpu", sizeof(r->location)))
    return sx__err(SX_ELIMIT, "region: location is longer than %d bytes", SX_TAG_MAX);
  /* The descriptor rules, with every region registered so far: strides,
   * bounds, overflow and key overlap. */
  sx_desc d;
  sx_desc_init(&d);
  d.layout = a->p.layout;
  int rc = 0;
  for (uint32_t i = 0; i < a->lt->n && rc == 0; i++)
    rc = sx_desc_add_region(&d, &a->lt->v[i]->r);
  if (rc == 0)
    rc = sx_desc_add_region(&d, r);
  if (rc == 0)
    rc = sx__layout_validate(&d);
  sx_desc_free(&d);
  return rc;
}

static void reg_run(sx__call *c) {
  reg_call *rc_ = (reg_call *)c;
  sx_agent *a = c->a;
  int rc, k;
  if (a->shutting_down) {
    sx__call_finish(c, SX_ESHUTDOWN, "the agent is shutting down");
    return;
  }
  sx__lreg *r = calloc(1, sizeof(*r));
  if (r == NULL) {
    sx__call_finish(c, SX_ENOMEM, "registering a region: out of memory");
    return;
  }
  if ((rc = make_region(a, &rc_->rp, &r->l.r)) != 0)
    goto out_free;
  /* What the memory is (host, or CUDA on the device named): transports
   * pick their path by it. */
  if ((rc = sx__mem_check(rc_->rp.addr, rc_->rp.length, r->l.r.location, &r->l.mem)) != 0) {
    sx__errwrap(rc, "region %u", r->l.r.id);
    goto out_free;
  }
  for (k = 0; k < SX__TRANSPORT_SLOTS; k++) {
    sx_transport *t = a->tr[k];
    if (t != NULL && t->ops->reg_mem && (rc = t->ops->reg_mem(t, &r->l)) != 0) {
      sx__errwrap(rc, "registering region %u with %s", r->l.r.id, t->ops->name);
      goto out_dereg;
    }
  }
  sx__ltable *nt = ltable_derive(a->lt, &r->l, NULL);
  if (nt == NULL) {
    rc = sx__err(SX_ENOMEM, "registering a region: out of memory");
    goto out_dereg;
  }
  ltable_swap(a, nt);
  rc_->id = a->next_region_id++;
  char s[16];
  sx__log(a, SX_LOG_DEBUG, "registered region %u: group %u layers %u..%u slot %s, %lu "
          "blocks of %lu bytes, %lu bytes", r->l.r.id, r->l.r.group, r->l.r.layer_first,
          r->l.r.layer_first + r->l.r.layer_count - 1, sx_slot_name(r->l.r.slot, s),
          (unsigned long)r->l.r.num_blocks, (unsigned long)r->l.r.block_bytes,
          (unsigned long)r->l.r.length);
  sx__call_finish(c, 0, NULL);
  return;

out_dereg:
  while (--k >= 0)
    if (a->tr[k] != NULL && a->tr[k]->ops->dereg_mem)
      a->tr[k]->ops->dereg_mem(a->tr[k], &r->l);
out_free:
  free(r);
  sx__call_finish(c, rc, sx_errmsg());
}

int sx_agent_register(sx_agent *a, const sx_region_params *r, uint32_t *id) {
  if (a == NULL || r == NULL || id == NULL)
    return sx__err(SX_EINVAL, "sx_agent_register: NULL argument");
  reg_call *c = calloc(1, sizeof(*c));
  if (c == NULL)
    return sx__err(SX_ENOMEM, "sx_agent_register");
  c->c.run = reg_run;
  c->rp = *r;
  int rc, err = sx__call_wait(a, &c->c, SX__CALL_SLACK_MS, &rc);
  if (err)
    return err; /* the call is the agent's now */
  rc = sx__call_result(&c->c, rc);
  if (rc == 0)
    *id = c->id;
  sx__call_free(&c->c);
  return rc;
}

/* ------------------------------------------------------------ unregister */

typedef struct sx__unreg {
  sx__call c;
  uint32_t id;
  sx_lregion *l;
  struct sx__unreg *next;
} unreg;

static void drain_tick(uv_timer_t *t);

/* Retire every region whose reads have drained; poll for the others. */
static void check_drains(sx_agent *a) {
  for (unreg **pp = &a->unregs; *pp;) {
    unreg *u = *pp;
    if (u->l->inflight > 0) {
      pp = &u->next;
      continue;
    }
    *pp = u->next;
    for (int k = 0; k < SX__TRANSPORT_SLOTS; k++)
      if (a->tr[k] != NULL && a->tr[k]->ops->dereg_mem)
        a->tr[k]->ops->dereg_mem(a->tr[k], u->l);
    sx__ltable *nt = ltable_derive(a->lt, NULL, u->l);
    if (nt != NULL) {
      ltable_swap(a, nt);
    } else {
      /* Keep it in the table, withdrawn and deregistered: harmless. */
      sx__log(a, SX_LOG_WARN, "region %u retired but kept in the table (out of "
              "memory)", u->id);
    }
    sx__log(a, SX_LOG_DEBUG, "unregistered region %u", u->id);
    sx__call_finish(&u->c, 0, NULL);
  }
  if (a->unregs != NULL)
    uv_timer_start(&a->drain_timer, drain_tick, DRAIN_POLL_MS, DRAIN_POLL_MS);
  else
    uv_timer_stop(&a->drain_timer);
}

static void drain_tick(uv_timer_t *t) { check_drains(t->data); }

static void withdrawn(sx_agent *a, void *arg, int rc) {
  unreg *u = arg;
  if (rc && rc != SX_ESHUTDOWN)
    sx__log(a, SX_LOG_WARN, "withdrawing region %u: republish failed (%s); retiring "
            "it anyway", u->id, sx_strerror(rc));
  if (a->shutting_down) {
    sx__call_finish(&u->c, SX_ESHUTDOWN, "the agent is shutting down");
    return;
  }
  u->next = a->unregs;
  a->unregs = u;
  check_drains(a);
}

static void unreg_run(sx__call *c) {
  unreg *u = (unreg *)c;
  sx_agent *a = c->a;
  if (a->shutting_down) {
    sx__call_finish(c, SX_ESHUTDOWN, "the agent is shutting down");
    return;
  }
  sx_lregion *l = sx__find_region(a, u->id);
  if (l == NULL) {
    char msg[64];
    snprintf(msg, sizeof(msg), "no registered region %u", u->id);
    sx__call_finish(c, SX_ENOREGION, msg);
    return;
  }
  /* From here the transports refuse new reads of it.  Atomic: threads
   * that snapshot the registrations read it (sx__layout_desc). */
  __atomic_store_n(&l->withdrawn, 1, __ATOMIC_RELAXED);
  u->l = l;
  for (int k = 0; k < SX__TRANSPORT_SLOTS; k++)
    if (a->tr[k] != NULL && a->tr[k]->ops->withdraw)
      a->tr[k]->ops->withdraw(a->tr[k], l);
  sx_agent_status st;
  sx_agent_status_get(a, &st);
  if (a->lease.want && st.state != SX_AGENT_FENCED)
    sx__lease_publish(a, 0, withdrawn, u);
  else
    withdrawn(a, u, 0);
}

int sx_agent_unregister(sx_agent *a, uint32_t id) {
  if (a == NULL)
    return sx__err(SX_EINVAL, "sx_agent_unregister: NULL agent");
  unreg *u = calloc(1, sizeof(*u));
  if (u == NULL)
    return sx__err(SX_ENOMEM, "sx_agent_unregister");
  u->c.run = unreg_run;
  u->id = id;
  int rc, err = sx__call_wait(a, &u->c, SX__CALL_SLACK_MS, &rc);
  if (err)
    return err; /* the call is the agent's now */
  rc = sx__call_result(&u->c, rc);
  sx__call_free(&u->c);
  return rc;
}

void sx__regions_close(sx_agent *a) {
  uv_timer_stop(&a->drain_timer);
  while (a->unregs != NULL) {
    unreg *u = a->unregs;
    a->unregs = u->next;
    sx__call_finish(&u->c, SX_ESHUTDOWN, "the agent is shutting down");
  }
}
