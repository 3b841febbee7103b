/*
 * A fleet of simulated agents for sx-bench meta: K segments published and
 * their leases renewed every lease/3, as K agents would, but from one
 * thread over a few store connections (the library's asynchronous backend,
 * many leases per connection).  Renewals are spread evenly over the renew
 * period, so the store sees a steady K*3/lease renewals per second rather
 * than bursts.  The renewals start with the first publish (an agent not
 * published yet lets its turn pass): an agent's first renewal then comes
 * within one renew period of its publish, however long the whole fleet
 * takes to publish (tens of thousands of agents take longer than a short
 * lease).  A renewal still in flight when its agent's next one falls
 * due is counted as skipped, as a real agent's lease timer would.  Each
 * renewal's lateness is the time from when it fell due to its answer: what
 * the store's load eats of the lease's margin (lease - lease/3).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <uv.h>

#include "backend.h"
#include "bench.h"
#include "segxfer/descriptor.h"

#define PUBLISH_WINDOW 256u /* publishes in flight per connection at start */
#define TICK_MS 2u

typedef struct agent {
  struct bx_fleet *f;
  uint32_t i;
  uint64_t t0, due; /* sent, fell due (bx_now_ns) */
  int busy;
  int published; /* holds its lease: renewed from now on */
} agent;

struct bx_fleet {
  bx_fleet_params p;
  uv_loop_t loop;
  uv_thread_t th;
  uv_async_t stop;
  uv_timer_t tick;
  sx_backend **b;
  int *up;
  agent *ag;
  uint8_t (*incs)[SX_INCARNATION_LEN];
  uint8_t **values;
  size_t *lens;
  uint32_t next_pub, pub_inflight, published, unpub_left;
  uint64_t t0, scheduled; /* renewals due so far, over all periods */
  double period_ns;
  /* Shared with the caller's thread. */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int state; /* 0 starting, 1 renewing, -1 failed */
  char err[300];
  bx_fleet_stats st;
  uint64_t late;
  bx_lat lat, lateness;
};

void bx_fleet_name(uint32_t i, char *buf, size_t size) {
  snprintf(buf, size, "fleet/%07u", i);
}

static void set_state(bx_fleet *f, int state, const char *err) {
  pthread_mutex_lock(&f->mu);
  f->state = state;
  if (err != NULL)
    snprintf(f->err, sizeof(f->err), "%s", err);
  pthread_cond_broadcast(&f->cv);
  pthread_mutex_unlock(&f->mu);
}

static void on_conn(void *arg, int up, int err, const char *msg) {
  int *flag = arg;
  (void)msg;
  *flag = up ? 1 : (err ? err : -1);
}

/* ------------------------------------------------------------ renewing */

static void renewed(void *arg, const sx_backend_reply *rep) {
  agent *a = arg;
  bx_fleet *f = a->f;
  a->busy = 0;
  uint64_t ns = bx_now_ns() - a->t0;
  pthread_mutex_lock(&f->mu);
  if (rep->status == 0) {
    f->st.renews++;
    bx_lat_add(&f->lat, ns);
    bx_lat_add(&f->lateness, bx_now_ns() - a->due);
  } else {
    if (f->st.renew_errors++ == 0)
      snprintf(f->st.first_error, sizeof(f->st.first_error), "%s: %.120s",
               sx_err_name(rep->status), rep->message);
  }
  pthread_mutex_unlock(&f->mu);
}

static void tick(uv_timer_t *t) {
  bx_fleet *f = t->data;
  uint32_t n = f->p.agents;
  double el = (double)(bx_now_ns() - f->t0);
  uint64_t due = (uint64_t)(el / f->period_ns * n);
  for (; f->scheduled < due; f->scheduled++) {
    agent *a = &f->ag[f->scheduled % n];
    char name[32];
    if (!a->published)
      continue;
    if (a->busy) {
      f->late++;
      continue;
    }
    bx_fleet_name(f->p.first + a->i, name, sizeof(name));
    a->t0 = bx_now_ns();
    a->due = f->t0 + (uint64_t)((double)f->scheduled * f->period_ns / n);
    sx_backend *b = f->b[a->i % f->p.conns];
    if (sx__backend_renew(b, name, f->incs[a->i], f->p.lease_ms, renewed, a) == 0) {
      a->busy = 1;
    } else {
      pthread_mutex_lock(&f->mu);
      if (f->st.renew_errors++ == 0)
        snprintf(f->st.first_error, sizeof(f->st.first_error), "%s", sx_errmsg());
      pthread_mutex_unlock(&f->mu);
    }
  }
}

/* ------------------------------------------------------------ publishing */

static void publish_more(bx_fleet *f);

static void published(void *arg, const sx_backend_reply *rep) {
  agent *a = arg;
  bx_fleet *f = a->f;
  f->pub_inflight--;
  if (rep->status != 0) {
    if (f->state == 0) {
      char err[300];
      snprintf(err, sizeof(err), "fleet: publishing agent %u: %s: %s", a->i,
               sx_err_name(rep->status), rep->message);
      set_state(f, -1, err);
    }
    return;
  }
  f->published++;
  a->published = 1;
  publish_more(f);
}

static void publish_more(bx_fleet *f) {
  uint32_t n = f->p.agents;
  while (f->state == 0 && f->next_pub < n &&
         f->pub_inflight < PUBLISH_WINDOW * f->p.conns) {
    agent *a = &f->ag[f->next_pub++];
    char name[32];
    bx_fleet_name(f->p.first + a->i, name, sizeof(name));
    sx_publish_req req = {.name = name, .incarnation = f->incs[a->i], .generation = 1,
                          .value = f->values[a->i], .len = f->lens[a->i],
                          .lease_ms = f->p.lease_ms, .takeover = 1};
    if (sx__backend_publish(f->b[a->i % f->p.conns], &req, published, a) != 0) {
      char err[300];
      snprintf(err, sizeof(err), "fleet: publishing agent %u: %s", a->i, sx_errmsg());
      set_state(f, -1, err);
      return;
    }
    f->pub_inflight++;
  }
  if (f->state == 0 && f->published == n) {
    /* Everyone holds a lease (and is renewed already). */
    pthread_mutex_lock(&f->mu);
    f->st.publishes = n;
    pthread_mutex_unlock(&f->mu);
    set_state(f, 1, NULL);
  }
}

/* ------------------------------------------------------------ thread */

static void close_all(bx_fleet *f) {
  for (uint32_t i = 0; i < f->p.conns; i++)
    if (f->b[i] != NULL)
      sx__backend_close(f->b[i]);
  uv_close((uv_handle_t *)&f->tick, NULL);
  uv_close((uv_handle_t *)&f->stop, NULL);
}

static void unpublished(void *arg, const sx_backend_reply *rep) {
  bx_fleet *f = arg;
  (void)rep;
  if (--f->unpub_left == 0)
    close_all(f);
}

/* Stop renewing and unpublish every agent, as agents shutting down do,
 * so the next fleet starts from an empty namespace. */
static void on_stop(uv_async_t *h) {
  bx_fleet *f = h->data;
  uv_timer_stop(&f->tick);
  for (uint32_t i = 0; i < f->p.agents; i++) {
    char name[32];
    if (!f->ag[i].published)
      continue;
    bx_fleet_name(f->p.first + i, name, sizeof(name));
    if (sx__backend_unpublish(f->b[i % f->p.conns], name, f->incs[i], unpublished, f) == 0)
      f->unpub_left++;
  }
  if (f->unpub_left == 0)
    close_all(f);
}

static void thread_main(void *arg) {
  bx_fleet *f = arg;
  int ok = 1;
  char url[700];
  for (uint32_t i = 0; i < f->p.conns && ok; i++) {
    snprintf(url, sizeof(url), "%s", f->p.url);
    sx_backend_hooks h = {.on_conn = on_conn, .arg = &f->up[i]};
    if (sx__backend_open(&f->loop, url, &h, &f->b[i]) != 0) {
      char err[300];
      snprintf(err, sizeof(err), "fleet: store connection: %s", sx_errmsg());
      f->b[i] = NULL;
      set_state(f, -1, err);
      ok = 0;
    }
  }
  for (uint32_t i = 0; i < f->p.conns && ok; i++) {
    while (f->up[i] == 0)
      uv_run(&f->loop, UV_RUN_ONCE);
    if (f->up[i] < 0) {
      set_state(f, -1, "fleet: a store connection failed");
      ok = 0;
    }
  }
  if (ok) {
    /* Renew from the first publish on, spread over the period. */
    f->t0 = bx_now_ns();
    f->scheduled = 0;
    uv_timer_start(&f->tick, tick, TICK_MS, TICK_MS);
    publish_more(f);
  }
  /* Runs until on_stop closed everything. */
  uv_run(&f->loop, UV_RUN_DEFAULT);
}

/* What bx_fleet_start allocated (the loop and thread are gone). */
static void fleet_free(bx_fleet *f) {
  for (uint32_t i = 0; f->values != NULL && i < f->p.agents; i++)
    free(f->values[i]);
  free(f->values);
  free(f->lens);
  free(f->incs);
  free(f->ag);
  free(f->b);
  free(f->up);
  bx_lat_free(&f->lat);
  bx_lat_free(&f->lateness);
  pthread_mutex_destroy(&f->mu);
  pthread_cond_destroy(&f->cv);
  free(f);
}

int bx_fleet_spawn(const bx_fleet_params *p, bx_fleet **out, char *err, size_t esize) {
  static uint32_t fleet_serial;
  fleet_serial++;
  bx_fleet *f = calloc(1, sizeof(*f));
  if (f == NULL) {
    snprintf(err, esize, "out of memory");
    return -1;
  }
  f->p = *p;
  if (f->p.conns == 0)
    f->p.conns = 1;
  uint32_t n = p->agents;
  f->period_ns = (double)p->lease_ms / 3 * 1e6;
  f->b = calloc(f->p.conns, sizeof(*f->b));
  f->up = calloc(f->p.conns, sizeof(*f->up));
  f->ag = calloc(n, sizeof(*f->ag));
  f->incs = calloc(n, sizeof(*f->incs));
  f->values = calloc(n, sizeof(*f->values));
  f->lens = calloc(n, sizeof(*f->lens));
  pthread_mutex_init(&f->mu, NULL);
  pthread_cond_init(&f->cv, NULL);
  if (!f->b || !f->up || !f->ag || !f->incs || !f->values || !f->lens) {
    snprintf(err, esize, "out of memory");
    fleet_free(f);
    return -1;
  }
  for (uint32_t i = 0; i < n; i++) {
    char name[32];
    sx_desc d;
    uint32_t g = p->first + i;
    bx_fleet_name(g, name, sizeof(name));
    f->ag[i] = (agent){.f = f, .i = i};
    int rc = bx_make_desc(&d, name, 2, 1);
    if (rc == 0) {
      d.lease_ms = p->lease_ms;
      /* A new incarnation per fleet: a fleet's leftovers (should its
       * unpublish have failed) cannot block the next one's publish. */
      memcpy(d.incarnation, &g, sizeof(g));
      memcpy(d.incarnation + 8, &fleet_serial, sizeof(fleet_serial));
      d.incarnation[15] = 0xf1;
      memcpy(f->incs[i], d.incarnation, SX_INCARNATION_LEN);
      rc = sx_desc_encode(&d, &f->values[i], &f->lens[i]);
      sx_desc_free(&d);
    }
    if (rc != 0) {
      snprintf(err, esize, "descriptor: %s", sx_errmsg());
      fleet_free(f);
      return -1;
    }
  }
  if (uv_loop_init(&f->loop) != 0) {
    snprintf(err, esize, "cannot start an event loop");
    fleet_free(f);
    return -1;
  }
  uv_async_init(&f->loop, &f->stop, on_stop);
  uv_timer_init(&f->loop, &f->tick);
  f->stop.data = f->tick.data = f;
  if (uv_thread_create(&f->th, thread_main, f) != 0) {
    snprintf(err, esize, "cannot start a thread");
    uv_close((uv_handle_t *)&f->stop, NULL);
    uv_close((uv_handle_t *)&f->tick, NULL);
    uv_run(&f->loop, UV_RUN_DEFAULT);
    uv_loop_close(&f->loop);
    fleet_free(f);
    return -1;
  }
  *out = f;
  return 0;
}

int bx_fleet_ready(bx_fleet *f, char *err, size_t esize) {
  pthread_mutex_lock(&f->mu);
  while (f->state == 0)
    pthread_cond_wait(&f->cv, &f->mu);
  int state = f->state;
  pthread_mutex_unlock(&f->mu);
  if (state < 0) {
    snprintf(err, esize, "%s", f->err);
    return -1;
  }
  return 0;
}

int bx_fleet_state(bx_fleet *f, char *err, size_t esize) {
  pthread_mutex_lock(&f->mu);
  int state = f->state;
  if (state < 0)
    snprintf(err, esize, "%s", f->err);
  pthread_mutex_unlock(&f->mu);
  return state;
}

int bx_fleet_start(const bx_fleet_params *p, bx_fleet **out, char *err, size_t esize) {
  bx_fleet *f;
  if (bx_fleet_spawn(p, &f, err, esize) != 0)
    return -1;
  if (bx_fleet_ready(f, err, esize) != 0) {
    bx_fleet_stop(f);
    return -1;
  }
  *out = f;
  return 0;
}

void bx_fleet_sample(bx_fleet *f, bx_fleet_stats *out) {
  pthread_mutex_lock(&f->mu);
  *out = f->st;
  out->late = f->late;
  f->late = 0;
  out->renew_p50_us = bx_lat_pct(&f->lat, 0.5) / 1e3;
  out->renew_p99_us = bx_lat_pct(&f->lat, 0.99) / 1e3;
  out->late_p99_ms = bx_lat_pct(&f->lateness, 0.99) / 1e6;
  out->late_max_ms = bx_lat_pct(&f->lateness, 1.0) / 1e6;
  memset(&f->st, 0, sizeof(f->st));
  bx_lat_reset(&f->lat);
  bx_lat_reset(&f->lateness);
  pthread_mutex_unlock(&f->mu);
}

double bx_fleet_cpu(bx_fleet *f) {
  clockid_t id;
  struct timespec ts;
  if (pthread_getcpuclockid(f->th, &id) != 0 || clock_gettime(id, &ts) != 0)
    return -1;
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

void bx_fleet_stop(bx_fleet *f) {
  if (f == NULL)
    return;
  uv_async_send(&f->stop);
  uv_thread_join(&f->th);
  uv_loop_close(&f->loop);
  fleet_free(f);
}
