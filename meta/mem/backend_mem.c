/*
 * mem://NAME: an in-process store with the semantics of the real backends
 * (leases, fencing, generations, events), shared by every backend opened on
 * the same NAME in this process.  Unit tests drive the cache and the agent
 * through it; it is never a substitute for Redis or etcd between processes.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "internal.h"

typedef struct mem_entry {
  struct mem_entry *next;
  char ns[SX_NS_MAX + 1];
  char name[SX_NAME_MAX + 1];
  uint8_t inc[SX_INCARNATION_LEN];
  uint64_t gen;
  uint8_t *value;
  size_t len;
  uint64_t expires_ms; /* monotonic */
  uint64_t touched_ms; /* monotonic: last publish or renew */
  int fence;           /* a fenced-incarnation record, not a segment */
} mem_entry;

typedef struct mem_backend mem_backend;

typedef struct mem_store {
  struct mem_store *next;
  char name[128];
  mem_entry *entries;
  mem_backend *instances;
  int delayed;       /* answers come from a timer (sx__mem_set_delay) */
  uint32_t delay_ms;
} mem_store;

static pthread_mutex_t mem_lock = PTHREAD_MUTEX_INITIALIZER;
static mem_store *mem_stores;

/* A finished op or an event waiting to be delivered on the instance's loop. */
typedef struct mem_msg {
  struct mem_msg *next;
  sx_backend_cb cb; /* NULL for an event */
  void *arg;
  sx_backend_reply rep;
  uint8_t *value;   /* owned copy of rep.value */
  sx_backend_item *items;
  char **names;
  uint8_t **values;
  sx_event ev;
} mem_msg;

struct mem_backend {
  sx_backend base;
  mem_backend *next_instance;
  mem_store *store;
  uv_async_t async;
  uv_timer_t sweep;
  uv_timer_t delay; /* sx__mem_set_delay() */
  pthread_mutex_t qlock;
  mem_msg *head, **tail;
  int watching, closing, handles, announce_up, announce_watch;
};

static mem_store *store_get(const char *name) {
  for (mem_store *s = mem_stores; s; s = s->next)
    if (strcmp(s->name, name) == 0)
      return s;
  mem_store *s = calloc(1, sizeof(*s));
  if (s == NULL)
    return NULL;
  snprintf(s->name, sizeof(s->name), "%s", name);
  s->next = mem_stores;
  mem_stores = s;
  return s;
}

static void delay_cb(uv_timer_t *t);

static void enqueue(mem_backend *m, mem_msg *msg) {
  pthread_mutex_lock(&m->qlock);
  msg->next = NULL;
  *m->tail = msg;
  m->tail = &msg->next;
  pthread_mutex_unlock(&m->qlock);
  /* Events come from other instances, possibly other threads, and with
   * mem_lock held (broadcast): always through the async. */
  if (msg->cb == NULL) {
    uv_async_send(&m->async);
    return;
  }
  /* An answer to one of this instance's ops (queued on its own loop thread,
   * without mem_lock) may come from a timer instead. */
  pthread_mutex_lock(&mem_lock);
  int delayed = m->store != NULL && m->store->delayed;
  uint32_t ms = m->store != NULL ? m->store->delay_ms : 0;
  pthread_mutex_unlock(&mem_lock);
  if (delayed && !uv_is_active((uv_handle_t *)&m->delay))
    uv_timer_start(&m->delay, delay_cb, ms, 0);
  else if (!delayed)
    uv_async_send(&m->async);
}

static void free_msg(mem_msg *msg) {
  free(msg->value);
  if (msg->names)
    for (size_t i = 0; i < msg->rep.n_items; i++) {
      free(msg->names[i]);
      free(msg->values[i]);
    }
  free(msg->names);
  free(msg->values);
  free(msg->items);
  free(msg);
}

/* Broadcast an event to every watching instance of the store (lock held). */
static void broadcast(mem_store *s, sx_event_kind kind, const mem_entry *e) {
  for (mem_backend *m = s->instances; m; m = m->next_instance) {
    if (!m->watching || strcmp(m->base.url.ns, e->ns) != 0)
      continue;
    mem_msg *msg = calloc(1, sizeof(*msg));
    if (msg == NULL)
      continue;
    msg->ev.kind = kind;
    strcpy(msg->ev.name, e->name);
    if (kind != SX_EVENT_EXPIRED)
      memcpy(msg->ev.incarnation, e->inc, SX_INCARNATION_LEN);
    msg->ev.generation = e->gen;
    enqueue(m, msg);
  }
}

static void unlink_entry(mem_store *s, mem_entry *e) {
  for (mem_entry **pp = &s->entries; *pp; pp = &(*pp)->next) {
    if (*pp == e) {
      *pp = e->next;
      free(e->value);
      free(e);
      return;
    }
  }
}

/* Drop expired segments, announcing each (lock held). */
static void expire(mem_store *s) {
  uint64_t now = sx__mono_ms();
  mem_entry *e = s->entries;
  while (e) {
    mem_entry *next = e->next;
    if (!e->fence && e->expires_ms <= now) {
      broadcast(s, SX_EVENT_EXPIRED, e);
      unlink_entry(s, e);
    }
    e = next;
  }
}

static mem_entry *find(mem_store *s, const char *ns, const char *name, int fence,
                       const uint8_t *inc) {
  for (mem_entry *e = s->entries; e; e = e->next)
    if (e->fence == fence && strcmp(e->ns, ns) == 0 && strcmp(e->name, name) == 0 &&
        (inc == NULL || memcmp(e->inc, inc, SX_INCARNATION_LEN) == 0))
      return e;
  return NULL;
}

static int add_fence(mem_store *s, const char *ns, const char *name, const uint8_t *inc) {
  if (find(s, ns, name, 1, inc))
    return 0;
  mem_entry *f = calloc(1, sizeof(*f));
  if (f == NULL)
    return SX_ENOMEM;
  strcpy(f->ns, ns);
  strcpy(f->name, name);
  memcpy(f->inc, inc, SX_INCARNATION_LEN);
  f->fence = 1;
  f->next = s->entries;
  s->entries = f;
  return 0;
}

static mem_msg *new_reply(sx_backend_cb cb, void *arg) {
  mem_msg *msg = calloc(1, sizeof(*msg));
  if (msg != NULL) {
    msg->cb = cb;
    msg->arg = arg;
    msg->rep.ttl_ms = -1;
  }
  return msg;
}

static int64_t ttl_of(const mem_entry *e) {
  uint64_t now = sx__mono_ms();
  return e->expires_ms > now ? (int64_t)(e->expires_ms - now) : 0;
}

static int mem_publish(sx_backend *b, const sx_publish_req *req, sx_backend_cb cb,
                       void *arg) {
  mem_backend *m = (mem_backend *)b;
  const char *ns = b->url.ns;
  mem_msg *msg = new_reply(cb, arg);
  uint8_t *copy = malloc(req->len ? req->len : 1);
  if (msg == NULL || copy == NULL) {
    free(msg);
    free(copy);
    return sx__err(SX_ENOMEM, "mem store: publish");
  }
  memcpy(copy, req->value, req->len);
  pthread_mutex_lock(&mem_lock);
  expire(m->store);
  mem_entry *e = find(m->store, ns, req->name, 0, NULL);
  if (find(m->store, ns, req->name, 1, req->incarnation)) {
    sx__reply_fail(&msg->rep, SX_EFENCED, "%s: this incarnation was fenced", req->name);
  } else if (e && memcmp(e->inc, req->incarnation, SX_INCARNATION_LEN) != 0 &&
             !req->takeover) {
    sx__reply_fail(&msg->rep, SX_EHELD, "%s is held by another incarnation", req->name);
    memcpy(msg->rep.holder, e->inc, SX_INCARNATION_LEN);
    msg->rep.holder_age_ms = sx__mono_ms() - e->touched_ms;
    msg->rep.holder_ttl_ms = ttl_of(e);
  } else if (e && memcmp(e->inc, req->incarnation, SX_INCARNATION_LEN) == 0 &&
             req->generation <= e->gen) {
    sx__reply_fail(&msg->rep, SX_EGENERATION, "%s: generation %lu is not above %lu",
                   req->name, (unsigned long)req->generation, (unsigned long)e->gen);
  } else {
    if (e && memcmp(e->inc, req->incarnation, SX_INCARNATION_LEN) != 0)
      add_fence(m->store, ns, req->name, e->inc);
    if (e == NULL && (e = calloc(1, sizeof(*e))) != NULL) {
      strcpy(e->ns, ns);
      strcpy(e->name, req->name);
      e->next = m->store->entries;
      m->store->entries = e;
    }
    if (e == NULL) {
      sx__reply_fail(&msg->rep, SX_ENOMEM, "mem store: publish");
    } else {
      free(e->value);
      e->value = copy;
      copy = NULL;
      e->len = req->len;
      memcpy(e->inc, req->incarnation, SX_INCARNATION_LEN);
      e->gen = req->generation;
      e->touched_ms = sx__mono_ms();
      e->expires_ms = e->touched_ms + req->lease_ms;
      broadcast(m->store, SX_EVENT_PUT, e);
    }
  }
  pthread_mutex_unlock(&mem_lock);
  free(copy);
  enqueue(m, msg);
  return 0;
}

/* Shared by renew and unpublish: find the caller's own live entry. */
static mem_entry *own_entry(mem_backend *m, const char *name, const uint8_t *inc,
                            sx_backend_reply *rep) {
  mem_entry *e = find(m->store, m->base.url.ns, name, 0, NULL);
  if (find(m->store, m->base.url.ns, name, 1, inc))
    sx__reply_fail(rep, SX_EFENCED, "%s: this incarnation was fenced", name);
  else if (e == NULL)
    sx__reply_fail(rep, SX_EGONE, "%s: no such segment (lease expired?)", name);
  else if (memcmp(e->inc, inc, SX_INCARNATION_LEN) != 0)
    sx__reply_fail(rep, SX_EFENCED, "%s is held by another incarnation", name);
  else
    return e;
  return NULL;
}

static int mem_renew(sx_backend *b, const char *name, const uint8_t *inc,
                     uint32_t lease_ms, sx_backend_cb cb, void *arg) {
  mem_backend *m = (mem_backend *)b;
  mem_msg *msg = new_reply(cb, arg);
  if (msg == NULL)
    return sx__err(SX_ENOMEM, "mem store: renew");
  pthread_mutex_lock(&mem_lock);
  expire(m->store);
  mem_entry *e = own_entry(m, name, inc, &msg->rep);
  if (e != NULL) {
    e->touched_ms = sx__mono_ms();
    e->expires_ms = e->touched_ms + lease_ms;
  }
  pthread_mutex_unlock(&mem_lock);
  enqueue(m, msg);
  return 0;
}

static int mem_unpublish(sx_backend *b, const char *name, const uint8_t *inc,
                         sx_backend_cb cb, void *arg) {
  mem_backend *m = (mem_backend *)b;
  mem_msg *msg = new_reply(cb, arg);
  if (msg == NULL)
    return sx__err(SX_ENOMEM, "mem store: unpublish");
  pthread_mutex_lock(&mem_lock);
  expire(m->store);
  mem_entry *e = own_entry(m, name, inc, &msg->rep);
  if (e != NULL) {
    broadcast(m->store, SX_EVENT_DELETE, e);
    unlink_entry(m->store, e);
  }
  pthread_mutex_unlock(&mem_lock);
  enqueue(m, msg);
  return 0;
}

static int mem_get(sx_backend *b, const char *name, sx_backend_cb cb, void *arg) {
  mem_backend *m = (mem_backend *)b;
  mem_msg *msg = new_reply(cb, arg);
  if (msg == NULL)
    return sx__err(SX_ENOMEM, "mem store: get");
  pthread_mutex_lock(&mem_lock);
  expire(m->store);
  mem_entry *e = find(m->store, b->url.ns, name, 0, NULL);
  if (e == NULL) {
    sx__reply_fail(&msg->rep, SX_ENOENT, "%s: no such segment", name);
  } else if ((msg->value = malloc(e->len ? e->len : 1)) == NULL) {
    sx__reply_fail(&msg->rep, SX_ENOMEM, "mem store: get");
  } else {
    memcpy(msg->value, e->value, e->len);
    msg->rep.value = msg->value;
    msg->rep.len = e->len;
    msg->rep.ttl_ms = ttl_of(e);
    msg->rep.holder_age_ms = sx__mono_ms() - e->touched_ms;
  }
  pthread_mutex_unlock(&mem_lock);
  enqueue(m, msg);
  return 0;
}

static int mem_list(sx_backend *b, sx_backend_cb cb, void *arg) {
  mem_backend *m = (mem_backend *)b;
  mem_msg *msg = new_reply(cb, arg);
  if (msg == NULL)
    return sx__err(SX_ENOMEM, "mem store: list");
  pthread_mutex_lock(&mem_lock);
  expire(m->store);
  size_t n = 0;
  for (mem_entry *e = m->store->entries; e; e = e->next)
    n += !e->fence && strcmp(e->ns, b->url.ns) == 0;
  msg->items = calloc(n + 1, sizeof(*msg->items));
  msg->names = calloc(n + 1, sizeof(char *));
  msg->values = calloc(n + 1, sizeof(uint8_t *));
  size_t i = 0;
  for (mem_entry *e = m->store->entries; e && msg->values; e = e->next) {
    if (e->fence || strcmp(e->ns, b->url.ns) != 0)
      continue;
    msg->names[i] = strdup(e->name);
    msg->values[i] = malloc(e->len ? e->len : 1);
    if (msg->names[i] == NULL || msg->values[i] == NULL)
      break;
    memcpy(msg->values[i], e->value, e->len);
    msg->items[i] = (sx_backend_item){.name = msg->names[i], .value = msg->values[i],
                                      .len = e->len, .ttl_ms = ttl_of(e)};
    i++;
  }
  msg->rep.items = msg->items;
  msg->rep.n_items = i;
  if (i != n)
    sx__reply_fail(&msg->rep, SX_ENOMEM, "mem store: list");
  pthread_mutex_unlock(&mem_lock);
  enqueue(m, msg);
  return 0;
}

static int mem_remove(sx_backend *b, const char *name, sx_backend_cb cb, void *arg) {
  mem_backend *m = (mem_backend *)b;
  mem_msg *msg = new_reply(cb, arg);
  if (msg == NULL)
    return sx__err(SX_ENOMEM, "mem store: remove");
  pthread_mutex_lock(&mem_lock);
  expire(m->store);
  mem_entry *e = find(m->store, b->url.ns, name, 0, NULL);
  if (e == NULL) {
    sx__reply_fail(&msg->rep, SX_ENOENT, "%s: no such segment", name);
  } else {
    add_fence(m->store, b->url.ns, name, e->inc);
    broadcast(m->store, SX_EVENT_DELETE, e);
    unlink_entry(m->store, e);
  }
  pthread_mutex_unlock(&mem_lock);
  enqueue(m, msg);
  return 0;
}

static void deliver_now(mem_backend *m) {
  pthread_mutex_lock(&m->qlock);
  mem_msg *msg = m->head;
  m->head = NULL;
  m->tail = &m->head;
  pthread_mutex_unlock(&m->qlock);
  if (m->announce_up && !m->closing) {
    m->announce_up = 0;
    if (m->base.hooks.on_conn)
      m->base.hooks.on_conn(m->base.hooks.arg, 1, 0, NULL);
  }
  if (m->announce_watch && !m->closing) {
    m->announce_watch = 0;
    if (m->base.hooks.on_watch)
      m->base.hooks.on_watch(m->base.hooks.arg);
  }
  while (msg) {
    mem_msg *next = msg->next;
    if (msg->cb != NULL) {
      if (m->closing)
        sx__reply_fail(&msg->rep, SX_ECANCELED, "store closed");
      msg->cb(msg->arg, &msg->rep);
    } else if (!m->closing && m->base.hooks.on_event) {
      m->base.hooks.on_event(m->base.hooks.arg, &msg->ev);
    }
    free_msg(msg);
    msg = next;
  }
}

/* A delayed store answers from a timer callback, as real backends do for
 * timeouts and as libcurl's multi interface does for ordinary answers
 * (etcd): waits must end in that case too.  A timer started while the loop
 * is not running is due at the next uv_run's first step. */
static void delay_cb(uv_timer_t *t) { deliver_now(t->data); }

static void deliver(uv_async_t *h) { deliver_now(h->data); }

void sx__mem_set_delay(const char *name, int on, uint32_t ms) {
  pthread_mutex_lock(&mem_lock);
  mem_store *s = store_get(name);
  if (s != NULL) {
    s->delayed = on;
    s->delay_ms = ms;
  }
  pthread_mutex_unlock(&mem_lock);
}

static void sweep_cb(uv_timer_t *t) {
  mem_backend *m = t->data;
  pthread_mutex_lock(&mem_lock);
  expire(m->store);
  pthread_mutex_unlock(&mem_lock);
}

static int mem_watch(sx_backend *b) {
  mem_backend *m = (mem_backend *)b;
  pthread_mutex_lock(&mem_lock);
  int first = !m->watching;
  m->watching = 1;
  pthread_mutex_unlock(&mem_lock);
  if (first) {
    /* Broadcasts reach this instance from now on; say so from the loop. */
    m->announce_watch = 1;
    uv_async_send(&m->async);
  }
  return uv_timer_start(&m->sweep, sweep_cb, 20, 20) ? SX_EIO : 0;
}

void sx__mem_rewatch(const char *name) {
  pthread_mutex_lock(&mem_lock);
  mem_store *s = store_get(name);
  for (mem_backend *m = s ? s->instances : NULL; m; m = m->next_instance) {
    if (!m->watching || m->closing)
      continue;
    m->announce_watch = 1;
    uv_async_send(&m->async);
  }
  pthread_mutex_unlock(&mem_lock);
}

static void closed_cb(uv_handle_t *h) {
  mem_backend *m = h->data;
  if (--m->handles > 0)
    return;
  deliver_now(m); /* cancel what is left */
  pthread_mutex_destroy(&m->qlock);
  free(m);
}

static void mem_close(sx_backend *b) {
  mem_backend *m = (mem_backend *)b;
  pthread_mutex_lock(&mem_lock);
  for (mem_backend **pp = &m->store->instances; *pp; pp = &(*pp)->next_instance) {
    if (*pp == m) {
      *pp = m->next_instance;
      break;
    }
  }
  pthread_mutex_unlock(&mem_lock);
  m->closing = 1;
  uv_close((uv_handle_t *)&m->async, closed_cb);
  uv_close((uv_handle_t *)&m->sweep, closed_cb);
  uv_close((uv_handle_t *)&m->delay, closed_cb);
}

static int mem_open(uv_loop_t *loop, const sx_url *url, const sx_backend_hooks *hooks,
                    sx_backend **out) {
  mem_backend *m = calloc(1, sizeof(*m));
  if (m == NULL)
    return sx__err(SX_ENOMEM, "mem store: open");
  m->base.ops = &sx__backend_mem_ops;
  m->base.loop = loop;
  m->base.url = *url;
  if (hooks)
    m->base.hooks = *hooks;
  m->tail = &m->head;
  pthread_mutex_init(&m->qlock, NULL);
  uv_async_init(loop, &m->async, deliver);
  uv_timer_init(loop, &m->sweep);
  uv_timer_init(loop, &m->delay);
  m->async.data = m->sweep.data = m->delay.data = m;
  m->handles = 3;
  pthread_mutex_lock(&mem_lock);
  m->store = store_get(url->master);
  if (m->store) {
    m->next_instance = m->store->instances;
    m->store->instances = m;
  }
  pthread_mutex_unlock(&mem_lock);
  if (m->store == NULL) {
    mem_close(&m->base);
    return sx__err(SX_ENOMEM, "mem store: open");
  }
  /* Report "connected" from the loop, as a real backend does. */
  m->announce_up = 1;
  uv_async_send(&m->async);
  *out = &m->base;
  return 0;
}

const sx_backend_ops sx__backend_mem_ops = {
    .scheme = "mem",
    .open = mem_open,
    .close = mem_close,
    .publish = mem_publish,
    .renew = mem_renew,
    .unpublish = mem_unpublish,
    .get = mem_get,
    .list = mem_list,
    .remove = mem_remove,
    .watch = mem_watch,
};
