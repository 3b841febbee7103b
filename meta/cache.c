/*
 * The resolver cache (see cache.h for the rules it keeps).
 *
 * Each name the cache has been asked about has a slot in a chained hash
 * table.  A slot holds the current descriptor (or a remembered "not found"),
 * at most one store request in flight, the resolves waiting for that request
 * and the resolves parked until the name appears.  Completions are queued and
 * delivered from an idle handle, so no callback ever runs inside the call
 * that asked for it.  One timer serves every deadline, recheck and sweep.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache.h"
#include "internal.h"

#define SWEEP_MS 10000u /* how often dead slots are freed */

/* Statistics are written on the loop thread and read from any thread (an
 * agent's stats snapshot), hence relaxed atomics: counters, not fences. */
#define STAT_INC(c, field) __atomic_add_fetch(&(c)->stats.field, 1, __ATOMIC_RELAXED)
#define STAT_ENTRIES(c)                                                        \
  __atomic_store_n(&(c)->stats.entries, (uint32_t)(c)->n_slots, __ATOMIC_RELAXED)

typedef struct creq creq;
typedef struct slot slot;

struct creq {
  creq *next;
  sx_cache_cb cb;
  void *arg;
  int status;
  sx_cdesc *d;
  uint64_t deadline_ms; /* parked resolves: when to give up; 0 = no wait */
  char msg[512];
};

struct slot {
  sx_cache *c; /* the store read in flight names its slot (the backend's arg) */
  slot *next;  /* hash chain */
  slot *wnext; /* list of slots with parked resolves */
  int in_wlist;
  char name[SX_NAME_MAX + 1];
  sx_cdesc *d;
  uint64_t expires_ms;   /* d is served until then */
  uint64_t neg_until_ms; /* "not found" is served until then */
  int fetching;          /* one store request in flight */
  int refetch;           /* an event arrived during it: its answer may be old */
  creq *fetch_waiters;   /* want the answer of the request in flight */
  creq *parked;          /* want the name to appear */
  uint64_t recheck_ms;   /* parked: next slow re-read */
};

struct sx_cache {
  uv_loop_t *loop;
  sx_backend *b;
  sx_cache_params p;
  slot **buckets;
  size_t n_buckets, n_slots;
  slot *wlist;
  creq *ready, **ready_tail;
  uv_idle_t idle;
  uv_timer_t timer;
  uint64_t timer_due;   /* when the timer is set to fire, 0 if stopped */
  uint64_t next_sweep;
  int closing, handles, gets_in_flight;
  sx_cache_stats stats;
};

/* ------------------------------------------------------------ descriptors */

sx_cdesc *sx__cdesc_ref(sx_cdesc *d) {
  __atomic_add_fetch(&d->refs, 1, __ATOMIC_RELAXED);
  return d;
}

void sx__cdesc_unref(sx_cdesc *d) {
  if (d != NULL && __atomic_sub_fetch(&d->refs, 1, __ATOMIC_ACQ_REL) == 0) {
    sx_desc_free(&d->desc);
    free(d);
  }
}

/* ------------------------------------------------------------ slots */

static uint64_t hash_name(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++)
    h = (h ^ (uint8_t)*s) * 1099511628211ull;
  return h;
}

static slot **bucket(sx_cache *c, const char *name) {
  return &c->buckets[hash_name(name) & (c->n_buckets - 1)];
}

static slot *find_slot(sx_cache *c, const char *name) {
  for (slot *s = *bucket(c, name); s; s = s->next)
    if (strcmp(s->name, name) == 0)
      return s;
  return NULL;
}

static void grow(sx_cache *c) {
  size_t n = c->n_buckets * 2;
  slot **nb = calloc(n, sizeof(*nb));
  if (nb == NULL)
    return; /* keep the longer chains; still correct */
  for (size_t i = 0; i < c->n_buckets; i++) {
    slot *s = c->buckets[i];
    while (s) {
      slot *next = s->next;
      slot **head = &nb[hash_name(s->name) & (n - 1)];
      s->next = *head;
      *head = s;
      s = next;
    }
  }
  free(c->buckets);
  c->buckets = nb;
  c->n_buckets = n;
}

static slot *get_slot(sx_cache *c, const char *name) {
  slot *s = find_slot(c, name);
  if (s != NULL)
    return s;
  if (c->n_slots >= c->n_buckets)
    grow(c);
  if ((s = calloc(1, sizeof(*s))) == NULL)
    return NULL;
  s->c = c;
  snprintf(s->name, sizeof(s->name), "%s", name);
  slot **head = bucket(c, name);
  s->next = *head;
  *head = s;
  c->n_slots++;
  STAT_ENTRIES(c);
  return s;
}

static void drop_desc(slot *s) {
  sx__cdesc_unref(s->d);
  s->d = NULL;
  s->expires_ms = 0;
}

/* A slot holding nothing and waited on by nobody. */
static int slot_dead(const slot *s, uint64_t now) {
  return s->d == NULL && s->neg_until_ms <= now && !s->fetching &&
         s->fetch_waiters == NULL && s->parked == NULL;
}

static void free_slot(sx_cache *c, slot *s) {
  for (slot **pp = bucket(c, s->name); *pp; pp = &(*pp)->next) {
    if (*pp == s) {
      *pp = s->next;
      break;
    }
  }
  drop_desc(s);
  free(s);
  c->n_slots--;
  STAT_ENTRIES(c);
}

static void sweep(sx_cache *c, uint64_t now) {
  for (size_t i = 0; i < c->n_buckets; i++) {
    slot *s = c->buckets[i];
    while (s) {
      slot *next = s->next;
      if (slot_dead(s, now))
        free_slot(c, s);
      s = next;
    }
  }
}

/* ------------------------------------------------------------ completions */

static void deliver(uv_idle_t *h) {
  sx_cache *c = h->data;
  creq *r;
  /* Take one at a time: a callback may resolve again and queue more. */
  while ((r = c->ready) != NULL) {
    c->ready = r->next;
    if (c->ready == NULL)
      c->ready_tail = &c->ready;
    r->cb(r->arg, r->status, r->d, r->status ? r->msg : NULL);
    free(r);
  }
  uv_idle_stop(&c->idle);
}

/* Queue r's callback with status and, on success, a new reference to d. */
static void complete(sx_cache *c, creq *r, int status, sx_cdesc *d, const char *msg) {
  r->status = status;
  r->d = status == 0 ? sx__cdesc_ref(d) : NULL;
  if (status)
    sx__strlcpy(r->msg, msg && *msg ? msg : sx_strerror(status), sizeof(r->msg));
  r->next = NULL;
  *c->ready_tail = r;
  c->ready_tail = &r->next;
  if (!c->closing)
    uv_idle_start(&c->idle, deliver);
}

static void complete_list(sx_cache *c, creq **list, int status, sx_cdesc *d,
                          const char *msg) {
  creq *r = *list;
  *list = NULL;
  while (r) {
    creq *next = r->next;
    complete(c, r, status, d, msg);
    r = next;
  }
}

/* ------------------------------------------------------------ timer */

static void timer_cb(uv_timer_t *t);

/* Set the one timer to the earliest of: a parked resolve's deadline or
 * recheck, and the next sweep while slots exist. */
static void rearm(sx_cache *c) {
  if (c->closing)
    return;
  uint64_t due = 0;
  for (slot *s = c->wlist; s; s = s->wnext) {
    if (due == 0 || s->recheck_ms < due)
      due = s->recheck_ms;
    for (creq *r = s->parked; r; r = r->next)
      if (r->deadline_ms < due)
        due = r->deadline_ms;
  }
  if (c->n_slots > 0 && (due == 0 || c->next_sweep < due))
    due = c->next_sweep;
  if (due == c->timer_due)
    return;
  c->timer_due = due;
  if (due == 0) {
    uv_timer_stop(&c->timer);
    return;
  }
  uint64_t now = uv_now(c->loop);
  uv_timer_start(&c->timer, timer_cb, due > now ? due - now : 0, 0);
}

static void park(sx_cache *c, slot *s, creq *r) {
  r->next = s->parked;
  s->parked = r;
  if (!s->in_wlist) {
    s->in_wlist = 1;
    s->wnext = c->wlist;
    c->wlist = s;
    s->recheck_ms = uv_now(c->loop) + c->p.recheck_ms;
  }
}

static void unlist(sx_cache *c, slot *s) {
  if (!s->in_wlist || s->parked != NULL)
    return;
  for (slot **pp = &c->wlist; *pp; pp = &(*pp)->wnext) {
    if (*pp == s) {
      *pp = s->wnext;
      break;
    }
  }
  s->in_wlist = 0;
}

/* ------------------------------------------------------------ store reads */

static void fetch_cb(void *arg, const sx_backend_reply *rep);

/* A store read names its slot: a slot with a read in flight is never swept
 * or freed; when the cache closes, it is left for fetch_cb to free. */
static int start_fetch(sx_cache *c, slot *s) {
  if (s->fetching)
    return 0;
  int rc = sx__backend_fetch(c->b, s->name, fetch_cb, s);
  if (rc)
    return rc;
  s->fetching = 1;
  s->refetch = 0;
  c->gets_in_flight++;
  STAT_INC(c, fetches);
  return 0;
}

static void maybe_free_cache(sx_cache *c) {
  if (c->closing && c->handles == 0 && c->gets_in_flight == 0) {
    free(c->buckets);
    free(c);
  }
}

/* Decode and check a store value for name into a new cdesc (refs 1), or,
 * when the value is byte for byte the one cur was decoded from, a new
 * reference to cur: decoding and checking the same bytes again could only
 * give the same descriptor. */
static int decode(const char *name, const sx_backend_reply *rep, sx_cdesc *cur,
                  sx_cdesc **out, char *msg, size_t msize) {
  if (cur != NULL && cur->raw_len == rep->len && memcmp(cur->raw, rep->value, rep->len) == 0) {
    *out = sx__cdesc_ref(cur);
    return 0;
  }
  sx_cdesc *d = calloc(1, sizeof(*d) + rep->len);
  if (d == NULL) {
    snprintf(msg, msize, "cache: out of memory decoding %s", name);
    return SX_ENOMEM;
  }
  int rc = sx_desc_decode(rep->value, rep->len, &d->desc);
  if (rc) {
    snprintf(msg, msize, "%s: stored descriptor is invalid: %s", name, sx_errmsg());
    free(d);
    return rc;
  }
  if (strcmp(d->desc.name, name) != 0) {
    snprintf(msg, msize, "%s: the store holds a descriptor named '%s' under this name",
             name, d->desc.name);
    sx_desc_free(&d->desc);
    free(d);
    return SX_EDECODE;
  }
  d->refs = 1;
  d->fetched_ms = sx__mono_ms();
  memcpy(d + 1, rep->value, rep->len);
  d->raw = (const uint8_t *)(d + 1);
  d->raw_len = rep->len;
  *out = d;
  return 0;
}

static void fetch_cb(void *arg, const sx_backend_reply *rep) {
  slot *s = arg;
  sx_cache *c = s->c;
  c->gets_in_flight--;
  if (c->closing) {
    free(s); /* sx__cache_close left it to us */
    maybe_free_cache(c);
    return;
  }
  s->fetching = 0;
  uint64_t now = uv_now(c->loop);
  if (s->refetch) {
    /* An event said the name changed after this read was sent: its answer
     * may predate the change.  Read again; the waiters keep waiting. */
    if (start_fetch(c, s) == 0)
      return;
  }
  int status = rep->status;
  char msg[512];
  if (status != 0)
    sx__strlcpy(msg, rep->message, sizeof(msg));
  sx_cdesc *d = NULL;
  if (status == 0)
    status = decode(s->name, rep, s->d, &d, msg, sizeof(msg));
  if (status == 0) {
    drop_desc(s);
    s->d = d;
    uint64_t ttl = c->p.ttl_ms;
    if (d->desc.lease_ms && d->desc.lease_ms < ttl)
      ttl = d->desc.lease_ms;
    s->expires_ms = now + ttl;
    s->neg_until_ms = 0;
    complete_list(c, &s->fetch_waiters, 0, d, NULL);
    complete_list(c, &s->parked, 0, d, NULL);
    unlist(c, s);
  } else if (status == SX_ENOENT) {
    drop_desc(s);
    s->neg_until_ms = now + c->p.negative_ms;
    /* Resolves that may wait are parked; the others learn "not found". */
    creq *r = s->fetch_waiters;
    s->fetch_waiters = NULL;
    while (r) {
      creq *next = r->next;
      if (r->deadline_ms > now)
        park(c, s, r);
      else
        complete(c, r, SX_ENOENT, NULL, msg);
      r = next;
    }
  } else {
    /* A corrupt value or a store failure: everyone waiting hears it. */
    complete_list(c, &s->fetch_waiters, status, NULL, msg);
    complete_list(c, &s->parked, status, NULL, msg);
    unlist(c, s);
  }
  if (s->in_wlist)
    s->recheck_ms = now + c->p.recheck_ms;
  rearm(c);
}

static void timer_cb(uv_timer_t *t) {
  sx_cache *c = t->data;
  uint64_t now = uv_now(c->loop);
  c->timer_due = 0;
  slot *s = c->wlist;
  while (s) {
    slot *next = s->wnext;
    for (creq **pp = &s->parked; *pp;) {
      creq *r = *pp;
      if (r->deadline_ms <= now) {
        *pp = r->next;
        char msg[300];
        snprintf(msg, sizeof(msg), "%s: not published (waited for it)", s->name);
        complete(c, r, SX_ENOENT, NULL, msg);
      } else {
        pp = &r->next;
      }
    }
    unlist(c, s);
    if (s->in_wlist && s->recheck_ms <= now) {
      /* The slow fallback in case the put event was lost. */
      s->recheck_ms = now + c->p.recheck_ms;
      start_fetch(c, s);
    }
    s = next;
  }
  if (c->next_sweep <= now) {
    sweep(c, now);
    c->next_sweep = now + SWEEP_MS;
  }
  rearm(c);
}

/* ------------------------------------------------------------ API */

void sx__cache_params_init(sx_cache_params *p) {
  p->ttl_ms = 5000;
  p->negative_ms = 250;
  p->recheck_ms = 1000;
}

int sx__cache_create(uv_loop_t *loop, sx_backend *b, const sx_cache_params *p,
                     sx_cache **out) {
  sx_cache *c = calloc(1, sizeof(*c));
  if (c == NULL || (c->buckets = calloc(16, sizeof(slot *))) == NULL) {
    free(c);
    return sx__err(SX_ENOMEM, "cache: create");
  }
  c->n_buckets = 16;
  c->loop = loop;
  c->b = b;
  if (p != NULL)
    c->p = *p;
  else
    sx__cache_params_init(&c->p);
  if (c->p.ttl_ms == 0)
    c->p.ttl_ms = 1;
  if (c->p.recheck_ms == 0)
    c->p.recheck_ms = 1000;
  c->ready_tail = &c->ready;
  uv_idle_init(loop, &c->idle);
  uv_timer_init(loop, &c->timer);
  c->idle.data = c->timer.data = c;
  c->handles = 2;
  c->next_sweep = uv_now(loop) + SWEEP_MS;
  int rc = sx__backend_watch(b);
  if (rc && rc != SX_ENOTSUP) {
    sx__cache_close(c);
    return sx__errwrap(rc, "cache: watching store events");
  }
  *out = c;
  return 0;
}

static void handle_closed(uv_handle_t *h) {
  sx_cache *c = h->data;
  c->handles--;
  maybe_free_cache(c);
}

void sx__cache_close(sx_cache *c) {
  if (c == NULL)
    return;
  c->closing = 1;
  for (size_t i = 0; i < c->n_buckets; i++) {
    slot *s = c->buckets[i];
    while (s) {
      slot *next = s->next;
      complete_list(c, &s->fetch_waiters, SX_ECANCELED, NULL, "cache closed");
      complete_list(c, &s->parked, SX_ECANCELED, NULL, "cache closed");
      drop_desc(s);
      if (!s->fetching)
        free(s); /* else its store read's callback frees it */
      s = next;
    }
    c->buckets[i] = NULL;
  }
  c->n_slots = 0;
  STAT_ENTRIES(c);
  c->wlist = NULL;
  /* Run what is queued now: the rule is that every callback runs once. */
  creq *r;
  while ((r = c->ready) != NULL) {
    c->ready = r->next;
    r->cb(r->arg, r->status, r->d, r->status ? r->msg : NULL);
    free(r);
  }
  c->ready_tail = &c->ready;
  uv_close((uv_handle_t *)&c->idle, handle_closed);
  uv_close((uv_handle_t *)&c->timer, handle_closed);
}

void sx__cache_event(sx_cache *c, const sx_event *ev) {
  slot *s = find_slot(c, ev->name);
  if (s == NULL)
    return; /* nobody asked about this name */
  static const uint8_t zero[SX_INCARNATION_LEN];
  int known_inc = memcmp(ev->incarnation, zero, SX_INCARNATION_LEN) != 0;
  int same_inc = s->d && memcmp(s->d->desc.incarnation, ev->incarnation,
                                SX_INCARNATION_LEN) == 0;
  if (ev->kind == SX_EVENT_PUT) {
    if (same_inc && s->d->desc.generation >= ev->generation)
      return; /* we already hold this one or a newer one */
    STAT_INC(c, events);
    drop_desc(s);
    s->neg_until_ms = 0;
    if (s->fetching)
      s->refetch = 1;
    else if (s->parked != NULL || s->fetch_waiters != NULL)
      start_fetch(c, s);
    return;
  }
  /* A delete names its incarnation; an expiry may not.  A delete of an
   * older incarnation than the one cached says nothing about ours. */
  if (known_inc && s->d && !same_inc)
    return;
  STAT_INC(c, events);
  drop_desc(s);
  s->neg_until_ms = uv_now(c->loop) + c->p.negative_ms;
  if (s->fetching)
    s->refetch = 1;
}

void sx__cache_flush(sx_cache *c) {
  for (size_t i = 0; i < c->n_buckets; i++) {
    for (slot *s = c->buckets[i]; s; s = s->next) {
      drop_desc(s);
      s->neg_until_ms = 0;
      if (s->fetching)
        s->refetch = 1;
    }
  }
}

sx_cdesc *sx__cache_peek(sx_cache *c, const char *name) {
  slot *s = find_slot(c, name);
  if (s == NULL || s->d == NULL || s->expires_ms <= uv_now(c->loop))
    return NULL;
  STAT_INC(c, hits);
  return sx__cdesc_ref(s->d);
}

int sx__cache_resolve(sx_cache *c, const char *name, unsigned flags, uint32_t wait_ms,
                      sx_cache_cb cb, void *arg) {
  if (c->closing)
    return sx__err(SX_ESHUTDOWN, "cache: closing");
  int rc = sx_name_validate(name);
  if (rc)
    return rc;
  slot *s = get_slot(c, name);
  /* Not calloc: its message (most of it) is written only on a failure. */
  creq *r = malloc(sizeof(*r));
  if (s == NULL || r == NULL) {
    free(r);
    return sx__err(SX_ENOMEM, "cache: resolving %s", name);
  }
  r->next = NULL;
  r->status = 0;
  r->d = NULL;
  r->cb = cb;
  r->arg = arg;
  uint64_t now = uv_now(c->loop);
  r->deadline_ms = wait_ms ? now + wait_ms : 0;
  if (flags & SX_CACHE_REFRESH)
    STAT_INC(c, refreshes);
  if (!(flags & SX_CACHE_REFRESH)) {
    if (s->d != NULL && s->expires_ms > now) {
      STAT_INC(c, hits);
      complete(c, r, 0, s->d, NULL);
      return 0;
    }
    if (s->neg_until_ms > now && !s->fetching) {
      STAT_INC(c, hits);
      if (wait_ms) {
        park(c, s, r);
        rearm(c);
      } else {
        char msg[300];
        snprintf(msg, sizeof(msg), "%s: not published", name);
        complete(c, r, SX_ENOENT, NULL, msg);
      }
      return 0;
    }
  }
  if (!(flags & SX_CACHE_REFRESH))
    STAT_INC(c, misses);
  /* Join the request in flight, or send one. */
  if ((rc = start_fetch(c, s)) != 0) {
    free(r);
    if (slot_dead(s, now))
      free_slot(c, s);
    return rc;
  }
  r->next = s->fetch_waiters;
  s->fetch_waiters = r;
  rearm(c);
  return 0;
}

void sx__cache_invalidate(sx_cache *c, const char *name, const uint8_t *inc) {
  slot *s = find_slot(c, name);
  if (s == NULL || s->d == NULL)
    return;
  if (inc == NULL || memcmp(s->d->desc.incarnation, inc, SX_INCARNATION_LEN) == 0)
    drop_desc(s);
}

void sx__cache_stats(const sx_cache *c, sx_cache_stats *out) {
  out->hits = __atomic_load_n(&c->stats.hits, __ATOMIC_RELAXED);
  out->misses = __atomic_load_n(&c->stats.misses, __ATOMIC_RELAXED);
  out->refreshes = __atomic_load_n(&c->stats.refreshes, __ATOMIC_RELAXED);
  out->fetches = __atomic_load_n(&c->stats.fetches, __ATOMIC_RELAXED);
  out->events = __atomic_load_n(&c->stats.events, __ATOMIC_RELAXED);
  out->entries = __atomic_load_n(&c->stats.entries, __ATOMIC_RELAXED);
}
