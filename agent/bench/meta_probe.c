/*
 * sx-bench meta: one fleet size on one store (a probe).  fleet.c's
 * simulated agents renew their leases, spread over --fleet-threads
 * threads, while readers resolve with the cache forced to miss; each
 * probe is a row of its store's fleet table, with the servers' and the
 * generator's CPU and whether the size was held (meta_held.c searches
 * and compares with these).
 */
#include <hiredis/hiredis.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "internal.h"
#include "meta.h"

/* The readers: each a store connection and a resolver cache of its own, as
 * a reader agent has, with one resolve in flight (slot i is reader i), sent
 * at a steady rate (open loop: a resolve's latency is the store's, not a
 * queue in this process) or, with rate 0, as soon as the last one ended.
 * Each takes the store's events, as a reader agent's watch does: a fleet's
 * publishes reach every reader, which is why a probe waits for them to be
 * read before its window (settle()). */
struct fleet_readers;
typedef struct reader_hook {
  struct fleet_readers *fr;
  int up; /* 1 connected, < 0 failed */
} reader_hook;

struct fleet_readers {
  sx_backend **b;
  sx_cache **c;
  reader_hook *hooks;
  uv_timer_t *timers; /* one per reader, for the open loop */
  uint64_t *due_ns;   /* each reader's next resolve */
  uint64_t *fire_ns;  /* when its pending timer was meant to fire */
  uint32_t n, rate;
  mb *m;
  uint32_t agents; /* 0: resolve the bench's own segments */
  uint64_t rng;
  uint64_t gone;   /* resolves that found a fleet agent's segment gone */
  uint64_t events; /* fleet events the readers' connections have read */
  bx_lat lag;      /* how late the readers' timers fired: this thread's queue */
  char name[32];
};
typedef struct fleet_readers fleet_readers;

/* How long a probe waits, at most, for the readers to have read the events
 * of a fleet's publishes (and of the last fleet's unpublishes). */
#define SETTLE_MAX_S 30.0
/* No reader event for this long: the backlog has been read. */
#define SETTLE_QUIET_S 0.05

static void reader_cb(void *arg, int status, sx_cdesc *d, const char *msg) {
  bx_slot *s = arg;
  fleet_readers *fr = s->r->user;
  sx__cdesc_unref(d);
  /* Every agent of a running fleet is published: a segment that is not
   * there lost its lease (the store fell behind its renewals).  That is
   * the probe's verdict, not a failure of the run: the answer came back. */
  if (status == SX_ENOENT && fr->agents > 0) {
    fr->gone++;
    status = 0;
  }
  bx_run_done(s, status, msg);
}

/* A forced cache miss of a random agent of the fleet (or, with no fleet, of
 * one of the bench's segments: the same descriptor shape). */
static int fleet_resolve_now(bx_run *r, bx_slot *s) {
  fleet_readers *fr = r->user;
  const char *name = fr->name;
  fr->rng ^= fr->rng << 13;
  fr->rng ^= fr->rng >> 7;
  fr->rng ^= fr->rng << 17;
  if (fr->agents > 0)
    bx_fleet_name((uint32_t)(fr->rng % fr->agents), fr->name, sizeof(fr->name));
  else
    name = fr->m->names[fr->rng % fr->m->n];
  return sx__cache_resolve(fr->c[s->i], name, SX_CACHE_REFRESH, 0, reader_cb, s);
}

static void paced_cb(uv_timer_t *t) {
  bx_slot *s = t->data;
  fleet_readers *fr = s->r->user;
  s->t0 = bx_now_ns(); /* latency from the send, not from the wait */
  uint64_t fire = fr->fire_ns[s->i];
  bx_lat_add(&fr->lag, s->t0 > fire ? s->t0 - fire : 0);
  int rc = fleet_resolve_now(s->r, s);
  if (rc != 0)
    bx_run_done(s, rc, sx_errmsg());
}

/* Open loop: each reader resolves every 1/rate s, from a random phase. */
static int op_fleet_resolve(bx_run *r, bx_slot *s) {
  fleet_readers *fr = r->user;
  if (fr->rate == 0)
    return fleet_resolve_now(r, s);
  uint64_t now = bx_now_ns(), period = 1000000000ull / fr->rate;
  uint64_t *due = &fr->due_ns[s->i];
  if (*due == 0 || *due + period < now) /* first, or fell behind: no burst */
    *due = now + (fr->rng = fr->rng * 6364136223846793005ull + 1) % period;
  uint64_t wait_ms = *due > now ? (*due - now) / 1000000 : 0;
  /* The timer counts from the loop's cached time, which lags the clock by
   * this pass's work so far: start it from now, and measure its lateness
   * against the whole milliseconds asked for. */
  uv_update_time(&fr->m->loop);
  fr->fire_ns[s->i] = now + wait_ms * 1000000;
  *due += period;
  fr->timers[s->i].data = s;
  return uv_timer_start(&fr->timers[s->i], paced_cb, wait_ms, 0) == 0
             ? 0 : sx__err(SX_ENOMEM, "fleet: reader timer");
}

static void readers_close(fleet_readers *fr) {
  for (uint32_t i = 0; i < fr->n; i++) {
    sx__cache_close(fr->c[i]);
    sx__backend_close(fr->b[i]);
    if (fr->timers != NULL)
      uv_close((uv_handle_t *)&fr->timers[i], NULL);
  }
  if (fr->m != NULL)
    uv_run(&fr->m->loop, UV_RUN_NOWAIT); /* the timers' close callbacks */
  free(fr->b);
  free(fr->c);
  free(fr->hooks);
  free(fr->timers);
  free(fr->due_ns);
  free(fr->fire_ns);
  bx_lat_free(&fr->lag);
}

static void reader_conn(void *arg, int up, int err, const char *msg) {
  reader_hook *h = arg;
  (void)msg;
  h->up = up ? 1 : (err ? err : -1);
}

/* The readers' caches are not told (a forced miss asks the store anyway);
 * what counts is that the connection read and decoded a fleet's event. */
static void reader_event(void *arg, const sx_event *ev) {
  reader_hook *h = arg;
  h->fr->events += bx_fleet_event(ev);
}

static int readers_open(fleet_readers *fr, mb *m, uint32_t n) {
  fr->m = m;
  fr->b = calloc(n, sizeof(*fr->b));
  fr->c = calloc(n, sizeof(*fr->c));
  fr->hooks = calloc(n, sizeof(*fr->hooks));
  fr->timers = calloc(n, sizeof(*fr->timers));
  fr->due_ns = calloc(n, sizeof(*fr->due_ns));
  fr->fire_ns = calloc(n, sizeof(*fr->fire_ns));
  if (fr->b == NULL || fr->c == NULL || fr->hooks == NULL || fr->timers == NULL ||
      fr->due_ns == NULL || fr->fire_ns == NULL)
    return -1;
  for (uint32_t i = 0; i < n; i++) {
    fr->hooks[i].fr = fr;
    sx_backend_hooks h = {.on_conn = reader_conn, .on_event = reader_event,
                          .arg = &fr->hooks[i]};
    uv_timer_init(&m->loop, &fr->timers[i]);
    if (sx__backend_open(&m->loop, m->url_text, &h, &fr->b[i]) != 0)
      return -1;
    fr->n = i + 1;
  }
  for (uint32_t i = 0; i < n; i++) {
    while (fr->hooks[i].up == 0)
      uv_run(&m->loop, UV_RUN_ONCE);
    if (fr->hooks[i].up < 0 || sx__cache_create(&m->loop, fr->b[i], NULL, &fr->c[i]) != 0)
      return -1;
  }
  return 0;
}

/* The largest latency (ms) in a LATENCY LATEST answer, or -1. */
static double latency_max_ms(const redisReply *r) {
  if (r == NULL || r->type != REDIS_REPLY_ARRAY)
    return -1;
  double mx = 0;
  for (size_t i = 0; i < r->elements; i++) {
    const redisReply *e = r->element[i];
    /* [event, unix time, latest ms, max ms] */
    if (e->type == REDIS_REPLY_ARRAY && e->elements >= 4 &&
        e->element[3]->type == REDIS_REPLY_INTEGER && e->element[3]->integer > mx)
      mx = (double)e->element[3]->integer;
  }
  return mx;
}

/* The store's servers at a window's start (start = 1) or end: the commands
 * they have processed (INFO stats) into *cmds, -1 unknown; and, on the
 * bench's private servers only, their own stalls: at the start the latency
 * monitor is set to record every event of 1 ms or more (a command, an
 * expiry cycle, ...) and emptied, at the end *stall_ms is the longest it
 * recorded on any server (0: none, -1 unknown).  Time a command spends
 * queued behind other clients' commands is not a stall: that is the
 * server's load (SERVERS CPU %). */
static void servers_window(const mb *m, int start, int64_t *cmds, double *stall_ms) {
  *cmds = -1;
  *stall_ms = -1;
  if (!m->redis && m->n_srv == 0)
    return;
  int64_t sum = 0;
  double stall = m->n_srv ? 0 : -1;
  for (int i = 0; i < (m->n_srv ? m->n_srv : 1); i++) {
    struct timeval tv = {5, 0};
    redisContext *c = m->n_srv ? redisConnectWithTimeout("127.0.0.1", m->srv_ports[i], tv)
                               : bx_mb_sync_connect(m);
    if (c == NULL || c->err) {
      if (c)
        redisFree(c);
      return;
    }
    int64_t v = -1;
    redisReply *r = redisCommand(c, "INFO stats");
    if (r != NULL && r->type == REDIS_REPLY_STRING) {
      const char *p = strstr(r->str, "total_commands_processed:");
      if (p != NULL)
        v = strtoll(p + strlen("total_commands_processed:"), NULL, 10);
    }
    if (r)
      freeReplyObject(r);
    if (m->n_srv && stall >= 0) {
      r = start ? redisCommand(c, "CONFIG SET latency-monitor-threshold 1") : NULL;
      if (r)
        freeReplyObject(r);
      r = redisCommand(c, start ? "LATENCY RESET" : "LATENCY LATEST");
      double x = start ? (r != NULL && r->type == REDIS_REPLY_INTEGER ? 0 : -1)
                       : latency_max_ms(r);
      stall = x < 0 ? -1 : x > stall ? x : stall;
      if (r)
        freeReplyObject(r);
    }
    redisFree(c);
    if (v < 0)
      return;
    sum += v;
  }
  *cmds = sum;
  *stall_ms = stall;
}

/* Each server's used CPU seconds into cpu[] (from /proc, or with
 * --metadata INFO cpu of the URL's server); how many, 0 when unknown. */
static int servers_cpu(const mb *m, double cpu[BX_CLUSTER_MAX]) {
  if (m->n_srv == 0)
    return (cpu[0] = bx_mb_server_cpu(m)) >= 0 ? 1 : 0;
  for (int i = 0; i < m->n_srv; i++)
    if ((cpu[i] = bx_proc_cpu(m->srv_pids[i])) < 0)
      return 0;
  return m->n_srv;
}

/* Run-queue wait of this process and the private servers, seconds, or -1. */
static double runq(const mb *m) {
  double a = bx_runq_wait(getpid());
  for (int i = 0; i < m->n_srv && a >= 0; i++) {
    double b = bx_runq_wait(m->srv_pids[i]);
    a = b >= 0 ? a + b : -1;
  }
  return a;
}

static void wait_done(uv_timer_t *t) { *(int *)t->data = 1; }

/* Wait secs with this thread's loop running: the readers take the fleet's
 * publish events as they come, as reader agents would.  (Sleeping instead
 * left 10,000 x 64 events queued for the window's first 300 ms, where they
 * were the p99 of every resolve.) */
static void run_loop_for(mb *m, double secs) {
  uv_timer_t t;
  int done = 0;
  uv_timer_init(&m->loop, &t);
  t.data = &done;
  /* The loop's clock stood still while this thread waited elsewhere (for
   * a fleet's publishes, its unpublishes, the servers' INFO): a timer
   * started from it would fall due at once, and the wait would not be. */
  uv_update_time(&m->loop);
  uv_timer_start(&t, wait_done, (uint64_t)(secs * 1000), 0);
  while (!done)
    uv_run(&m->loop, UV_RUN_ONCE);
  uv_close((uv_handle_t *)&t, NULL);
  uv_run(&m->loop, UV_RUN_NOWAIT);
}

/* After a fleet has published: run the readers' loop for one renew period
 * (the renewals reach their steady spread), then on until the readers have
 * read every event the publishes sent them (SETTLE_QUIET_S without one),
 * so that the window measures renewals, not the tail of a publish burst:
 * every publish reaches every reader (16 readers and 10,000 agents are
 * 160,000 events; read during the window, they were its p99).  The seconds
 * waited, or -1 when events still came after SETTLE_MAX_S. */
static double settle(mb *m, fleet_readers *fr, double period_s) {
  double t0 = bx_now();
  run_loop_for(m, period_s);
  for (;;) {
    uint64_t ev = fr->events + m->events;
    run_loop_for(m, SETTLE_QUIET_S);
    if (fr->events + m->events == ev)
      return bx_now() - t0;
    if (bx_now() - t0 > SETTLE_MAX_S)
      return -1;
  }
}

static double held_late_ms(const bx_meta_opts *mo) {
  return mo->held_late_ms > 0 ? mo->held_late_ms : mo->lease_ms / 20.0;
}

int bx_fleet_run_open(bx_fleet_run *r, mb *m, const bx_meta_opts *mo, bx_report *rep,
                      char *err, size_t esize) {
  memset(r, 0, sizeof(*r));
  r->m = m;
  r->mo = mo;
  r->rep = rep;
  r->p99_10k = -1;
  char rate_note[96];
  if (mo->reader_rate)
    snprintf(rate_note, sizeof(rate_note), "%u resolves/s each (open loop)", mo->reader_rate);
  else
    snprintf(rate_note, sizeof(rate_note), "the next sent when one ends (closed loop)");
  static const bx_col cols[] = {
      {"agents", "AGENTS", "%.0f"},          {"readers", "READERS", "%.0f"},
      {"resolve_s", "RESOLVES/S", "%.0f"},   {"p50_us", "P50 US", "%.0f"},
      {"p99_us", "P99 US", "%.0f"},          {"renew_s", "RENEWS/S", "%.0f"},
      {"renew_p99_us", "RENEW P99 US", "%.0f"},
      {"late_p99_ms", "LATENESS P99 MS", "%.1f"}, {"late_max_ms", "LATENESS MAX MS", "%.1f"},
      {"late", "SKIPPED", "%.0f"},           {"renew_errors", "RENEW ERR", "%.0f"},
      {"store_cmds_s", "STORE CMDS/S", "%.0f"}, {"srv_cpu", "SERVERS CPU %", "%.0f"},
      {"srv_cpu_max", "BUSIEST SERVER CPU %", "%.0f"},
      {"srv_us_renew", "SERVERS US/RENEW", "%.1f"},
      {"srv_us_renew_max", "BUSIEST SERVER US/RENEW", "%.1f"},
      {"bench_cpu", "GENERATOR CPU %", "%.0f"}, {"gen_thread", "GEN BUSIEST THREAD %", "%.0f"},
      {"runq", "CPU WAIT MS/S", "%.0f"},
      {"lag_p99_ms", "READER LAG P99 MS", "%.1f"}, {"stall_ms", "SERVER STALL MS", "%.0f"},
      {"settle_s", "SETTLE S", "%.2f"},     {"held", "HELD", NULL},
      {"note", "NOTE", NULL},
  };
  const char *label = m->label ? m->label : "";
  char id[32], title[300];
  snprintf(id, sizeof(id), "fleet%s%s", label[0] ? "-" : "", label);
  snprintf(title, sizeof(title), "Fleet%s%s: simulated agents renewing leases (lease/3) "
           "while readers resolve with the cache forced to miss; agents 0 is the same "
           "readers on an idle store", label[0] ? " on the " : "", label);
  r->t = bx_table_add(rep, id, title, cols, (int)(sizeof(cols) / sizeof(cols[0])));
  bx_table_note(r->t, "lease %u ms, renewed every %u ms, spread evenly, by %u thread%s of %u "
                "store connections each; readers: each a store connection and cache of its "
                "own, one resolve in flight, %s", mo->lease_ms, mo->lease_ms / 3,
                mo->fleet_threads, mo->fleet_threads == 1 ? "" : "s", mo->fleet_conns,
                rate_note);
  bx_table_note(r->t, "LATENESS: from a renewal falling due to its answer (a lease is lost "
                "past %u ms; over several fleet threads, the largest thread's); SKIPPED: "
                "renewals not sent, the previous one still in flight",
                mo->lease_ms - mo->lease_ms / 3);
  bx_table_note(r->t, "HELD: every lease kept (and no resolve found an agent gone), p99 "
                "resolve <= %.1f ms, renewal lateness p99 "
                "<= %.0f ms, >= 90%% of the asked resolves answered, and no thread of the "
                "generator (this process) >= %.0f%% busy (else the generator, not the store, "
                "may be the limit)", mo->held_p99_ms, held_late_ms(mo), BX_GEN_BOUND * 100);
  bx_table_note(r->t, "SERVERS CPU %%: the private servers' CPU over the window "
                "(schedstat run time), summed, and the busiest one's; GENERATOR: this process (the "
                "simulated agents and the readers; %ld CPUs here, shared with the servers) "
                "and its busiest thread", sysconf(_SC_NPROCESSORS_ONLN));
  bx_table_note(r->t, "US/RENEW: server CPU per renewal, less the readers' share at the idle "
                "store's cost per resolve (per server); CPU WAIT MS/S: time this process's "
                "and the private servers' threads were runnable but waited for a CPU, per "
                "second (schedstat)");
  bx_table_note(r->t, "where the resolve tail comes from: READER LAG P99 MS: how late the "
                "readers' timers fired (their thread busy: queueing in this process); "
                "SERVER STALL MS: the longest event the private servers' latency monitor "
                "recorded in the window (a command or cycle of >= 1 ms; 0: none); a tail "
                "with neither is time queued in a server behind other clients' commands");
  bx_table_note(r->t, "SETTLE S: from the fleet holding its leases to the window: one renew "
                "period, then until the readers had read every event of its publishes "
                "(%.0f ms without one); a fleet event read in the window fails the size",
                SETTLE_QUIET_S * 1e3);
  r->fr = calloc(1, sizeof(*r->fr));
  if (r->fr == NULL) {
    snprintf(err, esize, "fleet: out of memory");
    return -1;
  }
  r->fr->rng = 0x9E3779B97F4A7C15ull;
  r->fr->rate = mo->reader_rate;
  if (readers_open(r->fr, m, mo->readers) != 0) {
    snprintf(err, esize, "fleet: cannot connect %u readers: %s", mo->readers, sx_errmsg());
    return -1;
  }
  bx_probe idle;
  bx_fleet_probe(r, 0, &idle);
  return 0;
}

/* The simulated agents of one probe, split over the fleet threads. */
typedef struct fleets {
  bx_fleet *f[64];
  uint32_t n;
} fleets;

static void fleets_stop(fleets *fs) {
  for (uint32_t i = 0; i < fs->n; i++)
    bx_fleet_stop(fs->f[i]);
  fs->n = 0;
}

static int fleets_start(fleets *fs, const bx_fleet_run *r, uint32_t agents, char *why,
                        size_t wsize) {
  uint32_t th = r->mo->fleet_threads;
  memset(fs, 0, sizeof(*fs));
  for (uint32_t k = 0; k < th; k++) {
    uint32_t first = (uint32_t)((uint64_t)agents * k / th);
    uint32_t end = (uint32_t)((uint64_t)agents * (k + 1) / th);
    bx_fleet_params fp = {.url = r->m->url_text, .first = first, .agents = end - first,
                          .conns = r->mo->fleet_conns, .lease_ms = r->mo->lease_ms};
    if (fp.agents == 0)
      continue;
    if (bx_fleet_spawn(&fp, &fs->f[fs->n], why, wsize) != 0) {
      fleets_stop(fs);
      return -1;
    }
    fs->n++;
  }
  /* Every thread ends its publishing (or fails) before any is stopped.
   * Meanwhile the readers' loop runs, so that they read the publishes'
   * events as they come, as reader agents do, rather than find them all
   * queued (in their sockets and the servers' output buffers) at once. */
  int rc = 0;
  char later[300]; /* the first failure is the one told */
  for (uint32_t i = 0; i < fs->n; i++) {
    int st;
    while ((st = bx_fleet_state(fs->f[i], rc ? later : why, rc ? sizeof(later) : wsize)) == 0)
      run_loop_for(r->m, 0.01);
    if (st < 0)
      rc = -1;
  }
  if (rc != 0)
    fleets_stop(fs);
  return rc;
}

/* Every thread's counters since the last call, folded: sums, and the
 * largest thread's percentiles. */
static void fleets_sample(fleets *fs, bx_fleet_stats *out) {
  memset(out, 0, sizeof(*out));
  for (uint32_t i = 0; i < fs->n; i++) {
    bx_fleet_stats s;
    bx_fleet_sample(fs->f[i], &s);
    out->renews += s.renews;
    out->renew_errors += s.renew_errors;
    out->publishes += s.publishes;
    out->late += s.late;
    if (out->first_error[0] == '\0')
      memcpy(out->first_error, s.first_error, sizeof(out->first_error));
#define FS_MAX(x) out->x = s.x > out->x ? s.x : out->x
    FS_MAX(renew_p50_us);
    FS_MAX(renew_p99_us);
    FS_MAX(late_p99_ms);
    FS_MAX(late_max_ms);
#undef FS_MAX
  }
}

static void fleets_cpu(fleets *fs, double *cpu) {
  for (uint32_t i = 0; i < fs->n; i++)
    cpu[i] = bx_fleet_cpu(fs->f[i]);
}

static void probe_failed(bx_fleet_run *r, uint32_t agents, bx_probe *out, const char *fmt,
                         const char *a, const char *b) {
  bx_row *row = bx_row_add(r->t);
  bx_set_num(row, "agents", agents);
  snprintf(out->why, sizeof(out->why), fmt, a, b);
  bx_set_str(row, "note", "%s", out->why);
  bx_set_str(row, "held", "no");
  r->failed++;
}

void bx_fleet_probe(bx_fleet_run *r, uint32_t agents, bx_probe *out) {
  mb *m = r->m;
  const bx_meta_opts *mo = r->mo;
  struct fleet_readers *fr = r->fr;
  const char *label = m->label ? m->label : "";
  memset(out, 0, sizeof(*out));
  out->agents = agents;
  fleets fs = {0};
  bx_progress("fleet of %u agents%s%s", agents, label[0] ? ", " : "", label);
  if (agents > 0) {
    char why[300];
    if (fleets_start(&fs, r, agents, why, sizeof(why)) != 0) {
      /* Say why in its row; the other fleet sizes still run. */
      probe_failed(r, agents, out, "did not start: %s%s", why, "");
      char what[128];
      snprintf(what, sizeof(what), "leases kept with %u agents renewing%s%s", agents,
               label[0] ? ", " : "", label);
      bx_target(r->rep, what, 1e9, "ms", "<", mo->lease_ms - mo->lease_ms / 3,
                "the fleet did not start (its row says why)");
      return;
    }
  }
  /* Reach the steady state (with no fleet, read what the last one's
   * unpublishes sent). */
  double settled = settle(m, fr, agents ? mo->lease_ms / 3 / 1000.0 : 0);
  fr->agents = agents;
  fr->gone = 0;
  bx_lat_reset(&fr->lag);
  uint64_t ev0 = fr->events + m->events;
  bx_run run;
  bx_fleet_stats st = {0};
  double srv0[BX_CLUSTER_MAX], srv1[BX_CLUSTER_MAX], th0[64], th1[64], stall;
  int64_t cmd0, cmd1;
  servers_window(m, 1, &cmd0, &stall);
  int nsrv = servers_cpu(m, srv0);
  double cpu0 = bx_cpu_self(), main0 = bx_cpu_thread(), rq0 = runq(m);
  fleets_cpu(&fs, th0);
  fleets_sample(&fs, &st);
  double t0 = bx_now();
  bx_run_init(&run, m, "fleet resolve", op_fleet_resolve, fr->n);
  run.user = fr;
  int mrc = bx_run_round(&run, bx_fleet_window_s(m->o->duration));
  double el = bx_now() - t0;
  uint64_t events = fr->events + m->events - ev0;
  servers_window(m, 0, &cmd1, &stall);
  if (nsrv > 0 && servers_cpu(m, srv1) != nsrv)
    nsrv = 0;
  double cpu = bx_cpu_self() - cpu0, mainc = bx_cpu_thread() - main0, rq1 = runq(m);
  fleets_cpu(&fs, th1);
  fleets_sample(&fs, &st);
  fleets_stop(&fs);
  if (mrc != 0) {
    probe_failed(r, agents, out, "resolve failed: %s: %.150s", sx_err_name(run.err), run.msg);
    bx_run_free(&run);
    return;
  }
  out->ran = 1;
  bx_row *row = bx_row_add(r->t);
  bx_set_num(row, "agents", agents);
  bx_set_num(row, "readers", fr->n);
  double resolves = (double)run.all_ops;
  double asked = mo->reader_rate ? (double)fr->n * mo->reader_rate : 0;
  out->resolve_share = asked > 0 ? bx_run_rate(&run) / asked : 1;
  bx_set_num(row, "resolve_s", bx_run_rate(&run));
  double p99 = bx_lat_pct(&run.lat, 0.99) / 1e3;
  out->p99_ms = p99 / 1e3;
  bx_set_num(row, "p50_us", bx_lat_pct(&run.lat, 0.5) / 1e3);
  bx_set_num(row, "p99_us", p99);
  out->lag_p99_ms = mo->reader_rate ? bx_lat_pct(&fr->lag, 0.99) / 1e6 : -1;
  out->stall_ms = stall;
  out->runq_ms_s = rq0 >= 0 && rq1 >= rq0 ? (rq1 - rq0) / el * 1e3 : -1;
  if (out->lag_p99_ms >= 0)
    bx_set_num(row, "lag_p99_ms", out->lag_p99_ms);
  if (stall >= 0)
    bx_set_num(row, "stall_ms", stall);
  if (settled >= 0)
    bx_set_num(row, "settle_s", settled);
  if (agents) {
    out->renews_s = (double)st.renews / el;
    out->late_p99_ms = st.late_p99_ms;
    bx_set_num(row, "renew_s", out->renews_s);
    bx_set_num(row, "renew_p99_us", st.renew_p99_us);
    bx_set_num(row, "late_p99_ms", st.late_p99_ms);
    bx_set_num(row, "late_max_ms", st.late_max_ms);
    bx_set_num(row, "late", (double)st.late);
    bx_set_num(row, "renew_errors", (double)st.renew_errors);
    r->lost += st.renew_errors;
  }
  if (cmd0 >= 0 && cmd1 >= cmd0)
    bx_set_num(row, "store_cmds_s", (double)(cmd1 - cmd0) / el);
  out->srv_renew_s = out->srv_renew_max_s = -1;
  if (nsrv > 0) {
    double sum = 0, mx = 0, rsum = 0, rmax = -1;
    out->n_srv = nsrv;
    for (int i = 0; i < nsrv; i++) {
      double d = srv1[i] - srv0[i];
      out->srv_each[i] = d / el;
      sum += d;
      mx = d > mx ? d : mx;
      if (agents == 0 && resolves > 0) {
        r->per_resolve[i] = d / resolves;
      } else if (r->have_idle && st.renews > 0) {
        double per = (d - resolves * r->per_resolve[i]) / (double)st.renews;
        rsum += per;
        rmax = per > rmax ? per : rmax;
      }
    }
    if (agents == 0 && resolves > 0)
      r->have_idle = 1;
    out->srv_cpu = sum / el;
    out->srv_cpu_max = mx / el;
    bx_set_num(row, "srv_cpu", out->srv_cpu * 100);
    bx_set_num(row, "srv_cpu_max", out->srv_cpu_max * 100);
    if (rmax >= 0) {
      out->srv_renew_s = rsum;
      out->srv_renew_max_s = rmax;
      bx_set_num(row, "srv_us_renew", rsum * 1e6);
      bx_set_num(row, "srv_us_renew_max", rmax * 1e6);
    }
  }
  out->gen_cpu = cpu / el;
  out->gen_thread_max = mainc / el;
  for (uint32_t i = 0; i < fs.n; i++)
    if (th0[i] >= 0 && th1[i] >= th0[i] && (th1[i] - th0[i]) / el > out->gen_thread_max)
      out->gen_thread_max = (th1[i] - th0[i]) / el;
  out->gen_bound = out->gen_thread_max >= BX_GEN_BOUND;
  bx_set_num(row, "bench_cpu", out->gen_cpu * 100);
  bx_set_num(row, "gen_thread", out->gen_thread_max * 100);
  if (out->runq_ms_s >= 0)
    bx_set_num(row, "runq", out->runq_ms_s);
  if (agents == 10000)
    r->p99_10k = p99;
  bx_run_free(&run);
  if (agents == 0)
    return;
  /* A lease survives while every renewal lands within lease - lease/3
   * of falling due; skipped and failed ones are lost margin too. */
  char what[128], basis[160];
  snprintf(what, sizeof(what), "leases kept with %u agents renewing%s%s", agents,
           label[0] ? ", " : "", label);
  out->kept = !st.late && !st.renew_errors && !fr->gone &&
              st.late_max_ms < mo->lease_ms - mo->lease_ms / 3;
  if (!out->kept)
    snprintf(out->why, sizeof(out->why), "leases lost: %" PRIu64 " skipped, %" PRIu64
             " failed%s%.60s%s, latest renewal %.0f ms after due, %" PRIu64 " resolves found "
             "the segment gone", st.late, st.renew_errors, st.first_error[0] ? " (" : "",
             st.first_error, st.first_error[0] ? ")" : "", st.late_max_ms, fr->gone);
  else if (events > 0)
    snprintf(out->why, sizeof(out->why), "%" PRIu64 " fleet events reached the readers in "
             "the window (the fleet's publishes%s): the window is not the steady state",
             events, settled < 0 ? " were still being read after 30 s" : "");
  else if (out->p99_ms > mo->held_p99_ms)
    snprintf(out->why, sizeof(out->why), "p99 resolve %.1f ms > %.1f", out->p99_ms,
             mo->held_p99_ms);
  else if (out->late_p99_ms > held_late_ms(mo))
    snprintf(out->why, sizeof(out->why), "renewal lateness p99 %.0f ms > %.0f",
             out->late_p99_ms, held_late_ms(mo));
  else if (out->resolve_share < 0.9)
    snprintf(out->why, sizeof(out->why), "%.0f%% of the asked resolves answered",
             out->resolve_share * 100);
  else if (out->gen_bound)
    snprintf(out->why, sizeof(out->why), "the generator's busiest thread at %.0f%%: it, "
             "not the store, may be the limit", out->gen_thread_max * 100);
  else
    out->held = 1;
  bx_set_str(row, "held", "%s", out->held ? "yes" : "no");
  if (!out->held)
    bx_set_str(row, "note", "%s", out->why);
  snprintf(basis, sizeof(basis), "latest renewal from due to answer (ms), limit lease "
           "- lease/3; %" PRIu64 " skipped, %" PRIu64 " failed, %" PRIu64 " found gone",
           st.late, st.renew_errors, fr->gone);
  double worst = st.late || st.renew_errors || fr->gone ? 1e9 : st.late_max_ms;
  bx_target(r->rep, what, worst, "ms", "<", mo->lease_ms - mo->lease_ms / 3, basis);
}

int bx_fleet_run_close(bx_fleet_run *r, char *err, size_t esize) {
  const char *label = r->m && r->m->label ? r->m->label : "";
  if (r->lost > 0)
    bx_table_note(r->t, "%" PRIu64 " renewals failed: those leases were lost", r->lost);
  char what10k[128];
  snprintf(what10k, sizeof(what10k), "p99 cold resolve with 10,000 agents renewing%s%s",
           label[0] ? ", " : "", label);
  if (r->p99_10k >= 0)
    bx_target(r->rep, what10k, r->p99_10k / 1e3, "ms", "<", BX_FLEET_HELD_P99_MS,
              "absolute; agents 0 (idle store) is in the table");
  else if (r->t != NULL)
    bx_target_skip(r->rep, what10k, "10000 not among the fleet sizes run");
  if (r->fr != NULL) {
    readers_close(r->fr);
    free(r->fr);
    r->fr = NULL;
  }
  if (r->failed) {
    snprintf(err, esize, "fleet%s%s: %d of the runs failed (their rows say why)",
             label[0] ? ", " : "", label, r->failed);
    return -1;
  }
  return 0;
}
