/*
 * sx-bench meta's insides, shared by meta.c (setup, closed-loop runner,
 * per-op figures), meta_fleet.c (options, ls), meta_probe.c (one fleet size),
 * meta_held.c (the search and the held figures) and fleet.c
 * (the simulated agents' thread).
 */
#ifndef SX_BENCH_META_H
#define SX_BENCH_META_H

#include <hiredis/async.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <uv.h>

#include "backend.h"
#include "bench.h"
#include "cache.h"
#include "url.h"

/* The resolve segments never expire during a run: nothing renews them. */
#define MB_LEASE_MS 600000u

typedef struct bx_meta_opts {
  const char *url;
  uint64_t conc[16];
  int n_conc;
  uint32_t regions;
  uint64_t ls[8];
  int n_ls;
  uint64_t fleet[8];
  int n_fleet;
  uint32_t fleet_conns, readers, lease_ms;
  uint32_t reader_rate; /* resolves/s per fleet reader; 0: closed loop */
  unsigned ops; /* MB_OP_* to run */
  uint32_t cluster; /* masters of a private Redis Cluster for the fleet, 0: none */
  double held_p99_ms; /* --held-p99-ms: a fleet is held within this p99 resolve */
  double held_late_ms; /* --held-late-ms: and renewals this late at p99 (0: lease/20) */
  uint32_t fleet_threads; /* --fleet-threads: threads the simulated agents use */
  uint32_t search_steps;  /* --fleet-search: halvings of the bracket (0: the list) */
  uint32_t fleet_budget_s; /* --fleet-budget-s: no new fleet size after this (0: none) */
} bx_meta_opts;

enum {
  MB_OP_RESOLVE = 1u << 0, /* raw GET + cold resolve (the pair) */
  MB_OP_HMGET = 1u << 1,
  MB_OP_WARM = 1u << 2,
  MB_OP_PUBLISH = 1u << 3,
  MB_OP_RENEW = 1u << 4,
  MB_OP_ALL = 0x1f,
};

/* The bench's store client: backend + cache (as an agent has them) and a
 * raw hiredis connection, all on one loop. */
typedef struct mb {
  const bx_common *o;
  uv_loop_t loop;
  int loop_init;
  char url_text[600];
  sx_url url;
  int srv_port;           /* our private redis-server, 0 if --metadata */
  pid_t srv_pid;
  /* The private servers this store is made of (one redis-server, or the
   * cluster's masters), for their CPU (/proc) and INFO; none with
   * --metadata (then INFO cpu of the URL's server, if any). */
  int n_srv;
  pid_t srv_pids[BX_CLUSTER_MAX];
  int srv_ports[BX_CLUSTER_MAX];
  int redis;              /* a plain redis:// store: the raw baselines run */
  sx_backend *b;
  sx_cache *c;
  int up;                 /* 1 connected, < 0 failed */
  uint64_t events;        /* events of fleet agents b has read */
  char conn_msg[512];
  redisAsyncContext *raw;
  int raw_up;
  struct redisContext *info; /* blocking, for INFO (server CPU time) */
  /* One segment per slot of the largest concurrency. */
  uint32_t n;
  char **names, **seg_keys, **raw_keys;
  uint8_t **values;
  size_t *lens;
  uint8_t (*incs)[SX_INCARNATION_LEN];
  uint64_t *gens;
  /* The fleet: "" for the store of the run, else what the second store is
   * ("cluster"): its table and targets are named after it. */
  const char *label;
} mb;

/* The resolve p99 a fleet must keep to count as held by default (the same
 * bound as the target of 10,000 agents; --held-p99-ms changes it). */
#define BX_FLEET_HELD_P99_MS 2.0

typedef struct bx_run bx_run;

/* A request slot of a closed loop. */
typedef struct bx_slot {
  bx_run *r;
  uint32_t i;     /* slot index: which segment it works on */
  uint64_t t0;    /* when its request was sent */
  int parts;      /* replies still expected (raw pipelines) */
  void *user;
} bx_slot;

/* Send slot s's next request; 0, or an SX_E* code (then nothing was sent). */
typedef int (*bx_issue_fn)(bx_run *r, bx_slot *s);

struct bx_run {
  mb *m;
  const char *what;
  bx_issue_fn issue;
  uint32_t conc;
  bx_slot *slots;
  uint64_t t_warm, t_end;
  uint32_t inflight;
  int stop;
  /* Accumulated over rounds: requests sent after the warm-up and answered
   * before the end, their latencies, the seconds counted. */
  uint64_t ops, errors;
  double secs;
  /* Every request answered (warm-up included) and the CPU seconds spent
   * meanwhile by this process and by the server (INFO cpu; < 0 unknown). */
  uint64_t all_ops;
  double cpu_client, cpu_server;
  bx_lat lat;
  int err;
  char msg[256];
  void *user;
};

int bx_mb_open(mb *m);
/* A blocking connection to the bench's server, authenticated and on its db;
 * NULL on failure. */
struct redisContext *bx_mb_sync_connect(const mb *m);
/* The server's used CPU seconds (user + sys), or -1. */
double bx_mb_server_cpu(const mb *m);
void bx_mb_close(mb *m);

int bx_run_init(bx_run *r, mb *m, const char *what, bx_issue_fn issue, uint32_t conc);
void bx_run_free(bx_run *r);
int bx_run_round(bx_run *r, double secs);
double bx_run_rate(const bx_run *r);
/* A slot's request ended with status: count it, send the next. */
void bx_run_done(bx_slot *s, int status, const char *msg);

/* A connection hook that stores 1 (up) or the error in *(int *)arg. */
void bx_flag_conn(void *arg, int up, int err, const char *msg);
/* A cold resolve of the bench segment of slot s (modulo their number). */
int bx_meta_cold_issue(bx_run *r, bx_slot *s);

/* meta_fleet.c: options, ls */
int bx_meta_parse(bx_meta_opts *mo, int argc, char **argv);
int bx_meta_ls(mb *m, const bx_meta_opts *mo, bx_report *rep, char *err, size_t esize);

/* What one fleet size gave on one store (a probe).  CPU figures are
 * fractions of one CPU over the window; per-renewal ones are CPU seconds
 * per renewal, the readers' share (at the idle store's cost per resolve)
 * taken out, < 0 when unknown. */
typedef struct bx_probe {
  uint32_t agents;
  int ran;           /* it ran to the end (else the row says why not) */
  int kept;          /* every lease kept: none skipped, failed or past the margin */
  int held;          /* kept, and within --held-p99-ms and --held-late-ms, every
                      * resolve asked for answered, the generator not saturated */
  int gen_bound;     /* a thread of this process was busy >= BX_GEN_BOUND */
  char why[300];     /* the first criterion missed */
  double p99_ms, late_p99_ms, renews_s, resolve_share;
  double gen_cpu, gen_thread_max;
  double runq_ms_s, lag_p99_ms, stall_ms; /* < 0 unknown */
  double srv_cpu, srv_cpu_max;
  double srv_renew_s, srv_renew_max_s; /* all servers; the busiest one */
  int n_srv;
  double srv_each[BX_CLUSTER_MAX]; /* each server's CPU share */
} bx_probe;

/* A fleet probe's window: at least 2 s, so that its p99 rests on
 * thousands of resolves; a smoke run (--duration under 0.5 s) gets 0.5 s,
 * enough to check the method, not to judge a store. */
static inline double bx_fleet_window_s(double duration) {
  return duration < 0.5 ? 0.5 : duration < 2 ? 2 : duration;
}

/* Whether a store event names an agent of a fleet (bx_fleet_name): the
 * events a fleet probe waits for, and must not see in its window. */
static inline int bx_fleet_event(const sx_event *ev) {
  return strncmp(ev->name, "fleet/", 6) == 0;
}

/* A generator thread at least this busy may be what limits the run. */
#define BX_GEN_BOUND 0.9

/* One store's fleet runs (meta_probe.c): open (the readers, its table and
 * the idle store's row), probe fleet sizes one at a time, close. */
typedef struct bx_fleet_run {
  mb *m;
  const bx_meta_opts *mo;
  bx_report *rep;
  bx_table *t;
  struct fleet_readers *fr;
  double per_resolve[BX_CLUSTER_MAX]; /* each server's CPU per resolve, idle store */
  int have_idle;
  uint64_t lost;
  int failed;
  double p99_10k;
} bx_fleet_run;

int bx_fleet_run_open(bx_fleet_run *r, mb *m, const bx_meta_opts *mo, bx_report *rep,
                      char *err, size_t esize);
void bx_fleet_probe(bx_fleet_run *r, uint32_t agents, bx_probe *out);
/* 0, or -1 when some probe failed (err says so). */
int bx_fleet_run_close(bx_fleet_run *r, char *err, size_t esize);

/* meta_held.c: the --fleet sizes (or, with --fleet-search, a search for
 * the largest fleet held) on the run's store and, given a cluster's, on it
 * too, probe by probe in turn; then what each held and the targets. */
int bx_meta_fleets(mb *base, mb *cluster, const bx_meta_opts *mo, bx_report *rep, char *err,
                   size_t esize);

#endif
