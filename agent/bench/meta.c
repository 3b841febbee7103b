/*
 * sx-bench meta: the metadata store under load, with raw hiredis as the
 * baseline in the same run.
 *
 * Everything runs on one libuv loop in this thread, with the library's own
 * asynchronous store backend and resolver cache (what an agent runs) and a
 * raw hiredis connection on the same loop, through the same event glue.
 *
 * Concurrency N means the same on both sides: N requests in flight,
 * pipelined on one connection, closed loop (each completion sends the next
 * request of its slot).  Each slot has a segment of its own, so the cache's
 * single-flight never merges two slots' requests.  Figures of a pair
 * (raw GET and cold resolve) are taken in alternating rounds, so drift of
 * the shared machine hits both alike.
 *
 *   raw GET         GET of a key holding the same bytes as the descriptor
 *   raw HMGET+PTTL  the two commands a resolve sends, without decoding
 *                   (tells store time from client time)
 *   cold resolve    a forced cache miss (SX_CACHE_REFRESH, what an agent
 *                   sends after a transport failure or a lapsed entry): the
 *                   store round trip, the cache's bookkeeping and callback;
 *                   the value read is the one the entry was decoded from,
 *                   so the cache skips decoding it again
 *   cold resolve, new value   the same after the entry is forgotten, as on
 *                   the first resolve of a name or after it changed: the
 *                   round trip plus decode and validation
 *   warm resolve    the cache hit the agent's open takes (sx__cache_peek),
 *                   and through the asynchronous resolve call
 *   publish, renew  the fenced Lua scripts plus the listing-index update
 *   ls              sx_store_list() (index + every value, decoded) of 1k to
 *                   100k segments, against the raw pipelined reads
 *   fleet           fleet.c: K simulated agents renew their leases while
 *                   readers resolve
 */
#include <hiredis/hiredis.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "bench.h"
#include "cache.h"
#include "internal.h"
#include "meta.h"
#include "redis/redis.h"
#include "segxfer/store.h"

const char bx_meta_help[] =
    "usage: sx-bench meta [--metadata URL] [options] [common options]\n"
    "\n"
    "The metadata store under load: publish, renew, cold resolve (store round trip\n"
    "+ decode + validate, the cache forced to miss), warm resolve (a cache hit), ls\n"
    "of many segments, and a fleet of simulated agents renewing leases while readers\n"
    "resolve.  Baseline in the same run: raw hiredis GETs of a value of the same\n"
    "size at the same concurrency.  Concurrency N: N requests in flight, pipelined\n"
    "on one connection, each completion sending the next (both sides alike).\n"
    "\n"
    "  --metadata URL   the store (default: start a private redis-server on a free\n"
    "                   loopback port).  The bench works in a namespace of its own\n"
    "                   (sx-bench unless the URL names one) and removes what it\n"
    "                   wrote.  The raw baselines talk hiredis to one server, so they\n"
    "                   need a redis:// URL; with other stores the library's figures\n"
    "                   run alone and the ratio targets are not judged\n"
    "  --conc LIST      concurrency levels (default 1,4,16,64)\n"
    "  --regions N      regions of the resolved descriptor: 2 is the strided 80-layer\n"
    "                   layout (default), other counts are per-layer regions\n"
    "  --ls LIST        segment counts to list (default 1000,10000,100000; 0: none)\n"
    "  --fleet LIST     simulated agents renewing leases, at most 1000000 (default\n"
    "                   1000,10000,100000; 0: none)\n"
    "  --fleet-search STEPS  instead of running each --fleet size, search for the\n"
    "                   largest fleet held: from the first --fleet size, double while\n"
    "                   held (up to the largest --fleet size), halve while not, then\n"
    "                   halve the bracket STEPS times (1..10)\n"
    "  --fleet-threads N  threads the simulated agents are spread over (default 1;\n"
    "                   more where one thread cannot renew them all: its busiest\n"
    "                   thread is reported, and a thread >= 90% busy stops a size\n"
    "                   from counting as held)\n"
    "  --fleet-conns N  store connections of each fleet thread (default 4)\n"
    "  --readers N      fleet readers, each with a store connection and cache of its\n"
    "                   own, one resolve in flight (default 64)\n"
    "  --reader-rate N  resolves/s per reader, open loop (default 100; 0: closed loop)\n"
    "  --cluster N      also start a private Redis Cluster of N masters (no replicas;\n"
    "                   3..8) and run the fleet sizes against it too, in turn with\n"
    "                   the private redis-server, in the same run.  Targets: the\n"
    "                   cluster holds >= 2.5x the agents (measured here), and >= 2.5x\n"
    "                   CPU-normalised (agents a saturated thread carries, from each\n"
    "                   server's CPU per renewal, the cluster's busiest master against\n"
    "                   the one redis-server: fitted over the sizes run, and at equal\n"
    "                   renewals per server).  Not with --metadata\n"
    "  --held-p99-ms N  a fleet is held when every lease is kept, the p99 resolve is\n"
    "                   within N ms (default 2), renewals are late by at most\n"
    "                   --held-late-ms at p99, >= 90% of the asked resolves are\n"
    "                   answered and no generator thread is >= 90% busy\n"
    "  --held-late-ms N  renewal lateness p99 for held (default lease/20)\n"
    "  --fleet-budget-s N  start no new fleet size after N s of fleet runs (the\n"
    "                   held table says when a search was cut short)\n"
    "  --lease-ms N     the fleet's lease, renewed every lease/3 (default 5000)\n"
    "  --ops LIST       run only these of the per-operation cases: resolve (cold\n"
    "                   resolve and raw GET), hmget (a raw HMGET+PTTL of the\n"
    "                   descriptor, as sx_store_get asks), warm, publish, renew,\n"
    "                   all (default all)\n"
    "\n"
    "targets: cold resolve >= 0.9x raw GET ops/s at each concurrency; warm resolve\n"
    ">= 100x faster than cold (per-op time at concurrency 1); ls of 10,000 segments\n"
    "under 1 s; with 10,000 agents renewing, p99 cold resolve under 2 ms.\n"
    "\n"
    "examples:\n"
    "  sx-bench meta\n"
    "  sx-bench meta --conc 16 --ls 10000 --fleet 10000 --duration 3\n"
    "  sx-bench meta --ops renew --conc 1 --ls 0 --fleet 10000,30000,100000 --cluster 3\n"
    "  sx-bench meta --ops renew --conc 1 --ls 0 --fleet 5000,640000 --fleet-search 3 \\\n"
    "    --fleet-threads 4 --cluster 3 --held-p99-ms 20\n"
    "  sx-bench meta --metadata 'redis://127.0.0.1:6379?namespace=bench' --ls 0\n";

/* ------------------------------------------------------------ setup */

static void on_conn(void *arg, int up, int err, const char *msg) {
  mb *m = arg;
  m->up = up ? 1 : (err ? err : SX_EUNREACH);
  if (!up)
    snprintf(m->conn_msg, sizeof(m->conn_msg), "%s", msg ? msg : "");
}

/* The bench's own cache watches the store too: its events are read on the
 * readers' thread, so a fleet probe waits for them as for the readers'. */
static void on_event(void *arg, const sx_event *ev) {
  mb *m = arg;
  m->events += bx_fleet_event(ev);
}

static void raw_connected(const redisAsyncContext *ac, int status) {
  mb *m = ac->data;
  m->raw_up = status == REDIS_OK ? 1 : -1;
  if (status != REDIS_OK)
    m->raw = NULL; /* hiredis frees it */
}

static void raw_disconnected(const redisAsyncContext *ac, int status) {
  mb *m = ac->data;
  (void)status;
  m->raw = NULL;
  m->raw_up = -1;
}

static void raw_reply_ok(redisAsyncContext *ac, void *reply, void *priv) {
  int *left = priv;
  redisReply *r = reply;
  (void)ac;
  if (r == NULL || r->type == REDIS_REPLY_ERROR)
    left[1] = -1;
  left[0]--;
}

/* Run commands on the raw connection and wait for their replies. */
static int raw_sync(mb *m, int n, const char **argv[], const int argc[],
                    const size_t *lens[]) {
  int state[2] = {0, 0};
  for (int i = 0; i < n; i++) {
    if (m->raw == NULL ||
        redisAsyncCommandArgv(m->raw, raw_reply_ok, state, argc[i], argv[i], lens[i]) !=
            REDIS_OK)
      return -1;
    state[0]++;
  }
  while (state[0] > 0 && m->raw != NULL)
    uv_run(&m->loop, UV_RUN_ONCE);
  return state[0] == 0 && state[1] == 0 ? 0 : -1;
}

int bx_mb_open(mb *m) {
  char err[200];
  sx_backend_hooks hooks = {.on_conn = on_conn, .on_event = on_event, .arg = m};
  if (uv_loop_init(&m->loop) != 0)
    return -1;
  m->loop_init = 1;
  int rc = sx__backend_open(&m->loop, m->url_text, &hooks, &m->b);
  if (rc != 0) {
    fprintf(stderr, "sx-bench meta: %s: %s\n", sx_err_name(rc), sx_errmsg());
    m->b = NULL;
    return -1;
  }
  while (m->up == 0)
    uv_run(&m->loop, UV_RUN_ONCE);
  if (m->up < 0) {
    fprintf(stderr, "sx-bench meta: cannot use the store: %s\n", m->conn_msg);
    return -1;
  }
  sx_cache_params cp;
  sx__cache_params_init(&cp);
  cp.ttl_ms = 600000; /* warm entries must stay warm for the whole run */
  if ((rc = sx__cache_create(&m->loop, m->b, &cp, &m->c)) != 0) {
    fprintf(stderr, "sx-bench meta: cache: %s\n", sx_errmsg());
    return -1;
  }
  /* The raw baselines talk hiredis to the one server of a redis:// URL;
   * other stores (redis+sentinel, etcd) run without them. */
  if (!m->redis)
    return 0;
  const sx_url_host *h = &m->url.hosts[0];
  m->info = bx_mb_sync_connect(m); /* without it, no server CPU figures */
  m->raw = sx__redis_connect(&m->loop, h->host, h->port, m, raw_connected, raw_disconnected,
                             err, sizeof(err));
  if (m->raw == NULL) {
    fprintf(stderr, "sx-bench meta: raw connection to %s:%u: %s\n", h->host, h->port, err);
    return -1;
  }
  /* The raw client authenticates and selects like the backend does. */
  const char *auth[3] = {"AUTH"}, *sel[2] = {"SELECT"};
  int na = 1;
  char db[12];
  if (m->url.has_password) {
    if (m->url.user[0])
      auth[na++] = m->url.user;
    auth[na++] = m->url.password;
  }
  snprintf(db, sizeof(db), "%d", m->url.db);
  sel[1] = db;
  const char **argv[2];
  int argc[2], n = 0;
  const size_t *lens[2] = {NULL, NULL};
  if (m->url.has_password) {
    argv[n] = auth;
    argc[n++] = na;
  }
  if (m->url.db) {
    argv[n] = sel;
    argc[n++] = 2;
  }
  const char *ping[] = {"PING"};
  argv[n] = ping;
  argc[n++] = 1;
  if (raw_sync(m, n, argv, argc, lens) != 0) {
    fprintf(stderr, "sx-bench meta: the raw connection to %s:%u failed\n", h->host, h->port);
    return -1;
  }
  return 0;
}

void bx_mb_close(mb *m) {
  if (!m->loop_init)
    return;
  if (m->c)
    sx__cache_close(m->c);
  if (m->b)
    sx__backend_close(m->b);
  if (m->raw)
    redisAsyncFree(m->raw);
  m->raw = NULL;
  if (m->info)
    redisFree(m->info);
  m->info = NULL;
  uv_run(&m->loop, UV_RUN_DEFAULT);
  uv_loop_close(&m->loop);
  m->loop_init = 0;
}

redisContext *bx_mb_sync_connect(const mb *m) {
  struct timeval tv = {5, 0};
  redisContext *c = redisConnectWithTimeout(m->url.hosts[0].host, m->url.hosts[0].port, tv);
  if (c == NULL || c->err) {
    if (c)
      redisFree(c);
    return NULL;
  }
  redisReply *r = NULL;
  if (m->url.has_password)
    r = m->url.user[0] ? redisCommand(c, "AUTH %s %s", m->url.user, m->url.password)
                       : redisCommand(c, "AUTH %s", m->url.password);
  if (r)
    freeReplyObject(r);
  if (m->url.db) {
    r = redisCommand(c, "SELECT %d", m->url.db);
    if (r)
      freeReplyObject(r);
  }
  return c;
}

double bx_mb_server_cpu(const mb *m) {
  if (m->info == NULL)
    return -1;
  redisReply *r = redisCommand(m->info, "INFO cpu");
  double v = -1;
  if (r != NULL && r->type == REDIS_REPLY_STRING) {
    const char *u = strstr(r->str, "used_cpu_user:"), *sy = strstr(r->str, "used_cpu_sys:");
    if (u != NULL && sy != NULL)
      v = strtod(u + strlen("used_cpu_user:"), NULL) +
          strtod(sy + strlen("used_cpu_sys:"), NULL);
  }
  if (r)
    freeReplyObject(r);
  return v;
}

/* ------------------------------------------------------------ closed loop */

static void slot_start(bx_run *r, bx_slot *s);

/* A slot's request ended: count it if it lies in the window, send the next. */
void bx_run_done(bx_slot *s, int status, const char *msg) {
  bx_run *r = s->r;
  uint64_t now = bx_now_ns();
  r->inflight--;
  if (status != 0) {
    if (r->errors++ == 0) {
      r->err = status;
      snprintf(r->msg, sizeof(r->msg), "%s", msg && *msg ? msg : sx_strerror(status));
    }
    r->stop = 1;
  } else if ((r->all_ops++, s->t0 >= r->t_warm && now <= r->t_end)) {
    r->ops++;
    bx_lat_add(&r->lat, now - s->t0);
  }
  if (!r->stop && now < r->t_end)
    slot_start(r, s);
}

static void slot_start(bx_run *r, bx_slot *s) {
  s->t0 = bx_now_ns();
  int rc = r->issue(r, s);
  if (rc != 0) {
    if (r->errors++ == 0) {
      r->err = rc;
      snprintf(r->msg, sizeof(r->msg), "%s", sx_errmsg());
    }
    r->stop = 1;
    return;
  }
  r->inflight++;
}

int bx_run_init(bx_run *r, mb *m, const char *what, bx_issue_fn issue, uint32_t conc) {
  memset(r, 0, sizeof(*r));
  r->m = m;
  r->what = what;
  r->issue = issue;
  r->conc = conc;
  r->slots = calloc(conc, sizeof(*r->slots));
  if (r->slots == NULL)
    return -1;
  for (uint32_t i = 0; i < conc; i++) {
    r->slots[i].r = r;
    r->slots[i].i = i;
  }
  return 0;
}

void bx_run_free(bx_run *r) {
  free(r->slots);
  bx_lat_free(&r->lat);
}

/* One round: warm up briefly, then count for secs.  0, or -1 on an error
 * (r->err, r->msg say which). */
int bx_run_round(bx_run *r, double secs) {
  double warm = secs * 0.2 < 0.1 ? secs * 0.2 : 0.1;
  double srv0 = bx_mb_server_cpu(r->m), cpu0 = bx_cpu_self();
  uint64_t now = bx_now_ns();
  r->t_warm = now + (uint64_t)(warm * 1e9);
  r->t_end = r->t_warm + (uint64_t)(secs * 1e9);
  for (uint32_t i = 0; i < r->conc && !r->stop; i++)
    slot_start(r, &r->slots[i]);
  while (r->inflight > 0)
    uv_run(&r->m->loop, UV_RUN_ONCE);
  r->secs += secs;
  r->cpu_client += bx_cpu_self() - cpu0;
  double srv1 = bx_mb_server_cpu(r->m);
  if (srv0 >= 0 && srv1 >= srv0 && r->cpu_server >= 0)
    r->cpu_server += srv1 - srv0;
  else
    r->cpu_server = -1;
  return r->errors ? -1 : 0;
}

double bx_run_rate(const bx_run *r) { return r->secs > 0 ? (double)r->ops / r->secs : 0; }

/* ------------------------------------------------------------ the ops */

static void backend_cb(void *arg, const sx_backend_reply *rep) {
  bx_run_done(arg, rep->status, rep->message);
}

static int op_publish(bx_run *r, bx_slot *s) {
  mb *m = r->m;
  sx_publish_req req = {.name = m->names[s->i], .incarnation = m->incs[s->i],
                        .generation = ++m->gens[s->i], .value = m->values[s->i],
                        .len = m->lens[s->i], .lease_ms = MB_LEASE_MS};
  return sx__backend_publish(m->b, &req, backend_cb, s);
}

static int op_renew(bx_run *r, bx_slot *s) {
  mb *m = r->m;
  return sx__backend_renew(m->b, m->names[s->i], m->incs[s->i], MB_LEASE_MS, backend_cb, s);
}

static void resolve_cb(void *arg, int status, sx_cdesc *d, const char *msg) {
  sx__cdesc_unref(d);
  bx_run_done(arg, status, msg);
}

static int op_cold(bx_run *r, bx_slot *s) {
  return sx__cache_resolve(r->m->c, r->m->names[s->i % r->m->n], SX_CACHE_REFRESH, 0,
                           resolve_cb, s);
}

static int op_cold_new(bx_run *r, bx_slot *s) {
  const char *name = r->m->names[s->i % r->m->n];
  sx__cache_invalidate(r->m->c, name, NULL); /* the value must be decoded */
  return sx__cache_resolve(r->m->c, name, SX_CACHE_REFRESH, 0, resolve_cb, s);
}

int bx_meta_cold_issue(bx_run *r, bx_slot *s) { return op_cold(r, s); }

void bx_flag_conn(void *arg, int up, int err, const char *msg) {
  (void)msg;
  *(int *)arg = up ? 1 : (err ? err : -1);
}

static int op_warm(bx_run *r, bx_slot *s) {
  return sx__cache_resolve(r->m->c, r->m->names[s->i], 0, 0, resolve_cb, s);
}

static void raw_cb(redisAsyncContext *ac, void *reply, void *priv) {
  bx_slot *s = priv;
  redisReply *rr = reply;
  (void)ac;
  if (rr == NULL || rr->type == REDIS_REPLY_ERROR || rr->type == REDIS_REPLY_NIL) {
    bx_run_done(s, SX_ESTORE, rr == NULL ? "raw connection lost"
                              : rr->type == REDIS_REPLY_NIL ? "raw key missing"
                                                            : rr->str);
    return;
  }
  if (--s->parts == 0)
    bx_run_done(s, 0, NULL);
}

static int op_raw_get(bx_run *r, bx_slot *s) {
  mb *m = r->m;
  const char *argv[] = {"GET", m->raw_keys[s->i]};
  s->parts = 1;
  if (m->raw == NULL || redisAsyncCommandArgv(m->raw, raw_cb, s, 2, argv, NULL) != REDIS_OK)
    return sx__err(SX_EUNREACH, "raw connection lost");
  return 0;
}

static int op_raw_hmget(bx_run *r, bx_slot *s) {
  mb *m = r->m;
  const char *hm[] = {"HMGET", m->seg_keys[s->i], "d", "lease"};
  const char *pt[] = {"PTTL", m->seg_keys[s->i]};
  s->parts = 2;
  if (m->raw == NULL || redisAsyncCommandArgv(m->raw, raw_cb, s, 4, hm, NULL) != REDIS_OK ||
      redisAsyncCommandArgv(m->raw, raw_cb, s, 2, pt, NULL) != REDIS_OK)
    return sx__err(SX_EUNREACH, "raw connection lost");
  return 0;
}

/* ------------------------------------------------------------ segments */

/* Publish one segment per slot (the largest concurrency) and the raw keys
 * holding the same bytes. */
static int populate(mb *m, uint32_t n, uint32_t regions) {
  m->n = n;
  m->names = calloc(n, sizeof(char *));
  m->seg_keys = calloc(n, sizeof(char *));
  m->raw_keys = calloc(n, sizeof(char *));
  m->values = calloc(n, sizeof(uint8_t *));
  m->lens = calloc(n, sizeof(size_t));
  m->incs = calloc(n, sizeof(*m->incs));
  m->gens = calloc(n, sizeof(uint64_t));
  if (!m->names || !m->seg_keys || !m->raw_keys || !m->values || !m->lens || !m->incs ||
      !m->gens)
    return -1;
  for (uint32_t i = 0; i < n; i++) {
    char name[64], key[256];
    snprintf(name, sizeof(name), "bench/seg-%04u", i);
    sx_desc d;
    int rc = bx_make_desc(&d, name, regions, regions == 2);
    if (rc == 0) {
      d.lease_ms = MB_LEASE_MS;
      d.incarnation[0] = (uint8_t)i;
      d.incarnation[1] = (uint8_t)(i >> 8);
      memcpy(m->incs[i], d.incarnation, SX_INCARNATION_LEN);
      rc = sx_desc_encode(&d, &m->values[i], &m->lens[i]);
      sx_desc_free(&d);
    }
    if (rc != 0) {
      fprintf(stderr, "sx-bench meta: descriptor: %s\n", sx_errmsg());
      return -1;
    }
    m->names[i] = strdup(name);
    snprintf(key, sizeof(key), "sx:%s:seg:{%s}", m->url.ns, name);
    m->seg_keys[i] = strdup(key);
    snprintf(key, sizeof(key), "sx:%s:raw:{%s}", m->url.ns, name);
    m->raw_keys[i] = strdup(key);
    if (!m->names[i] || !m->seg_keys[i] || !m->raw_keys[i])
      return -1;
  }
  bx_run r;
  if (bx_run_init(&r, m, "publish", op_publish, n) != 0)
    return -1;
  /* One publish per segment: a round of zero length sends each slot once. */
  r.t_end = 0;
  for (uint32_t i = 0; i < n; i++) {
    r.slots[i].t0 = bx_now_ns();
    if (op_publish(&r, &r.slots[i]) == 0)
      r.inflight++;
  }
  while (r.inflight > 0)
    uv_run(&m->loop, UV_RUN_ONCE);
  int rc = r.errors ? -1 : 0;
  if (rc)
    fprintf(stderr, "sx-bench meta: publishing: %s: %s\n", sx_err_name(r.err), r.msg);
  bx_run_free(&r);
  for (uint32_t i = 0; i < n && rc == 0 && m->redis; i++) {
    const char *argv[] = {"SET", m->raw_keys[i], (const char *)m->values[i]};
    size_t l[] = {3, strlen(m->raw_keys[i]), m->lens[i]};
    const char **av[] = {argv};
    int ac[] = {3};
    const size_t *ls[] = {l};
    if (raw_sync(m, 1, av, ac, ls) != 0) {
      fprintf(stderr, "sx-bench meta: SET of the raw baseline key failed\n");
      rc = -1;
    }
  }
  return rc;
}

static void count_down(void *arg, const sx_backend_reply *rep) {
  (void)rep;
  (*(int *)arg)--;
}

/* Remove what the run wrote (it matters on a store given by --metadata). */
static void unpopulate(mb *m) {
  int left = 0;
  for (uint32_t i = 0; i < m->n && m->b != NULL && m->up == 1; i++) {
    if (m->redis && m->raw_keys && m->raw_keys[i]) {
      const char *argv[] = {"DEL", m->raw_keys[i]};
      const char **av[] = {argv};
      int ac[] = {2};
      const size_t *ls[] = {NULL};
      raw_sync(m, 1, av, ac, ls);
    }
    if (m->names && m->names[i] &&
        sx__backend_unpublish(m->b, m->names[i], m->incs[i], count_down, &left) == 0)
      left++;
  }
  while (left > 0)
    uv_run(&m->loop, UV_RUN_ONCE);
  for (uint32_t i = 0; i < m->n; i++) {
    free(m->names ? m->names[i] : NULL);
    free(m->seg_keys ? m->seg_keys[i] : NULL);
    free(m->raw_keys ? m->raw_keys[i] : NULL);
    free(m->values ? m->values[i] : NULL);
  }
  free(m->names);
  free(m->seg_keys);
  free(m->raw_keys);
  free(m->values);
  free(m->lens);
  free(m->incs);
  free(m->gens);
  m->n = 0;
}

/* ------------------------------------------------------------ measuring */

typedef struct opres {
  double rate, p50, p99, cpu_us, srv_us; /* per op; srv_us < 0: unknown */
} opres;

static void take(opres *o, bx_run *r) {
  o->rate = bx_run_rate(r);
  o->p50 = bx_lat_pct(&r->lat, 0.5) / 1e3;
  o->p99 = bx_lat_pct(&r->lat, 0.99) / 1e3;
  double n = r->all_ops ? (double)r->all_ops : 1;
  o->cpu_us = r->cpu_client * 1e6 / n;
  o->srv_us = r->cpu_server >= 0 ? r->cpu_server * 1e6 / n : -1;
}

/* Two ops at one concurrency, in alternating rounds. */
static int measure_pair(mb *m, bx_issue_fn a, bx_issue_fn b, uint32_t conc, double secs,
                        opres out[2], char *err, size_t esize) {
  bx_run r[2];
  bx_issue_fn fn[2] = {a, b};
  int rc = 0;
  for (int k = 0; k < 2; k++)
    if (bx_run_init(&r[k], m, "", fn[k], conc) != 0)
      return -1;
  enum { ROUNDS = 3 };
  for (int round = 0; round < ROUNDS && rc == 0; round++)
    for (int k = 0; k < 2 && rc == 0; k++)
      if (bx_run_round(&r[k], secs / ROUNDS) != 0) {
        snprintf(err, esize, "%s: %s", sx_err_name(r[k].err), r[k].msg);
        rc = -1;
      }
  for (int k = 0; k < 2; k++) {
    take(&out[k], &r[k]);
    bx_run_free(&r[k]);
  }
  return rc;
}

static int measure_one(mb *m, bx_issue_fn f, uint32_t conc, double secs, opres *out,
                       char *err, size_t esize) {
  bx_run r;
  if (bx_run_init(&r, m, "", f, conc) != 0)
    return -1;
  int rc = bx_run_round(&r, secs);
  if (rc)
    snprintf(err, esize, "%s: %s", sx_err_name(r.err), r.msg);
  take(out, &r);
  bx_run_free(&r);
  return rc;
}

/* The warm path of an agent's open: a peek at the cache, in a tight loop. */
static double warm_peek_ns(mb *m, double secs) {
  uint64_t iters = 0;
  double t0 = bx_now(), t;
  do {
    for (int k = 0; k < 1000; k++) {
      sx_cdesc *d = sx__cache_peek(m->c, m->names[k % m->n]);
      if (d == NULL)
        return -1;
      sx__cdesc_unref(d);
    }
    iters += 1000;
  } while ((t = bx_now() - t0) < secs);
  return t * 1e9 / (double)iters;
}

static void add_row(bx_table *t, const char *op, uint32_t conc, const opres *o,
                    double base) {
  bx_row *row = bx_row_add(t);
  bx_set_str(row, "op", "%s", op);
  if (conc)
    bx_set_num(row, "conc", conc);
  bx_set_num(row, "ops_s", o->rate);
  if (o->p50 > 0)
    bx_set_num(row, "p50_us", o->p50);
  if (o->p99 > 0)
    bx_set_num(row, "p99_us", o->p99);
  bx_set_num(row, "cpu_us", o->cpu_us);
  if (o->srv_us >= 0)
    bx_set_num(row, "srv_us", o->srv_us);
  if (base > 0) {
    bx_set_num(row, "raw_get_ops_s", base);
    bx_set_num(row, "ratio", o->rate / base);
  }
}

/* ------------------------------------------------------------ cluster */

/*
 * The fleet on the run's private redis-server and on a private Redis
 * Cluster of mo->cluster masters, probe by probe in turn (meta_held.c
 * compares what each held).  Everything shares the machine's CPUs.
 */
static int cluster_fleet(const bx_common *o, const bx_meta_opts *mo, bx_report *rep,
                         mb *base, uint32_t maxc, char *err, size_t esize) {
  bx_rcluster c;
  mb m2;
  memset(&m2, 0, sizeof(m2));
  int rc = -1;
  bx_progress("starting a private Redis Cluster of %u masters", mo->cluster);
  if (bx_rcluster_start(&c, (int)mo->cluster) != 0) {
    snprintf(err, esize, "cannot start the private Redis Cluster");
    return -1;
  }
  snprintf(m2.url_text, sizeof(m2.url_text), "redis+cluster://%s?namespace=sx-bench-%d",
           c.url_hosts, (int)getpid());
  m2.o = o;
  m2.label = "cluster";
  m2.n_srv = c.n;
  for (int i = 0; i < c.n; i++) {
    m2.srv_pids[i] = c.node[i].pid;
    m2.srv_ports[i] = c.node[i].port;
  }
  if (sx__url_parse(m2.url_text, &m2.url) != 0 || bx_mb_open(&m2) != 0 ||
      populate(&m2, maxc, mo->regions) != 0) {
    snprintf(err, esize, "the private Redis Cluster: %s", sx_errmsg());
    goto out;
  }
  rc = bx_meta_fleets(base, &m2, mo, rep, err, esize);
out:
  unpopulate(&m2);
  bx_mb_close(&m2);
  bx_rcluster_stop(&c);
  return rc;
}

/* ------------------------------------------------------------ main */

int bx_meta_main(const bx_common *o, int argc, char **argv) {
  mb m;
  memset(&m, 0, sizeof(m));
  bx_meta_opts mo = {.url = NULL, .n_conc = 4, .conc = {1, 4, 16, 64}, .regions = 2,
                     .n_ls = 3, .ls = {1000, 10000, 100000}, .n_fleet = 3,
                     .fleet = {1000, 10000, 100000}, .fleet_conns = 4, .readers = 64,
                     .reader_rate = 100,
                     .lease_ms = 5000, .ops = MB_OP_ALL, .fleet_threads = 1,
                     .held_p99_ms = BX_FLEET_HELD_P99_MS};
  int rc = bx_meta_parse(&mo, argc, argv);
  if (rc)
    return rc;
  if (mo.search_steps && mo.n_fleet == 0) {
    fprintf(stderr, "sx-bench meta: --fleet-search needs --fleet START[,CAP]\n");
    return BX_USAGE;
  }
  if (mo.cluster && (mo.url != NULL || mo.n_fleet == 0)) {
    fprintf(stderr, "sx-bench meta: --cluster compares private servers' fleets: not with "
            "--metadata, and not with --fleet 0\n");
    return BX_USAGE;
  }
  bx_redis srv = {0};
  char url[600];
  if (mo.url == NULL) {
    if (bx_redis_start(&srv) != 0)
      return BX_FAIL;
    snprintf(url, sizeof(url), "redis://127.0.0.1:%d?namespace=sx-bench-%d", srv.port,
             (int)getpid());
  } else {
    /* Our own namespace unless the URL names one. */
    snprintf(url, sizeof(url), "%s%s", mo.url, strstr(mo.url, "namespace=") ? "" :
             strchr(mo.url, '?') ? "&namespace=sx-bench" : "?namespace=sx-bench");
  }
  snprintf(m.url_text, sizeof(m.url_text), "%s", url);
  if (sx__url_parse(url, &m.url) != 0) {
    fprintf(stderr, "sx-bench meta: --metadata: %s\n", sx_errmsg());
    bx_redis_stop(&srv);
    return BX_USAGE;
  }
  m.redis = strcmp(m.url.scheme, "redis") == 0;
  if (!m.redis)
    fprintf(stderr, "sx-bench meta: %s store: no raw baseline (it talks hiredis to one "
            "redis:// server); the library's figures alone\n", m.url.scheme);
  m.o = o;
  m.srv_port = srv.port;
  m.srv_pid = srv.pid;
  if (srv.pid > 0) {
    m.n_srv = 1;
    m.srv_pids[0] = srv.pid;
    m.srv_ports[0] = srv.port;
  }
  bx_report *rep = bx_report_new("meta", o);
  bx_plot plot = {.logx = 1};
  snprintf(plot.title, sizeof(plot.title),
           "segxfer metadata store: operations/s against concurrency");
  snprintf(plot.xlabel, sizeof(plot.xlabel), "requests in flight on one connection");
  snprintf(plot.ylabel, sizeof(plot.ylabel), "operations per second");
  uint32_t maxc = 1;
  for (int i = 0; i < mo.n_conc; i++)
    maxc = mo.conc[i] > maxc ? (uint32_t)mo.conc[i] : maxc;
  /* A search runs about as many sizes as doublings to its cap, plus its
   * halvings; each size a renew period and a window. */
  int sizes = mo.n_fleet, stores = mo.cluster ? 2 : 1;
  if (mo.search_steps && mo.n_fleet > 0) {
    uint64_t cap = 0;
    for (int i = 0; i < mo.n_fleet; i++)
      cap = mo.fleet[i] > cap ? mo.fleet[i] : cap;
    sizes = 1 + (int)mo.search_steps;
    for (uint64_t v = mo.fleet[0]; v < cap; v *= 2)
      sizes++;
  }
  int steps = mo.n_conc * 3 + 1 + mo.n_ls + (sizes + 1) * stores + (mo.cluster ? 1 : 0);
  double est = o->duration * (mo.n_conc * 4 + 1) + mo.n_ls * 3.0 +
               (sizes + 1) * stores * (bx_fleet_window_s(o->duration) +
                                       mo.lease_ms / 3000.0 + 1);
  bx_progress_start(o, "meta", steps, est);
  rc = BX_FAIL;
  if (bx_mb_open(&m) != 0 || populate(&m, maxc, mo.regions) != 0)
    goto out;
  static const bx_col cols[] = {
      {"op", "OPERATION", NULL},          {"conc", "IN FLIGHT", "%.0f"},
      {"ops_s", "OPS/S", "%.0f"},         {"p50_us", "P50 US", "%.1f"},
      {"p99_us", "P99 US", "%.1f"},       {"cpu_us", "CLIENT CPU US/OP", "%.2f"},
      {"srv_us", "SERVER CPU US/OP", "%.2f"}, {"raw_get_ops_s", "RAW GET OPS/S", "%.0f"},
      {"ratio", "VS RAW GET", "%.2fx"},
  };
  bx_table *t = bx_table_add(rep, "meta", "Metadata store operations against raw hiredis "
                             "GET of a value of the same size (baseline), same run",
                             cols, (int)(sizeof(cols) / sizeof(cols[0])));
  bx_table_note(t, "in flight N: N requests pipelined on one connection, closed loop (each "
                "completion sends the next), for the library and the raw client alike");
  bx_table_note(t, "value: a descriptor of %u regions, %zu bytes; server %s", mo.regions,
                m.lens[0], mo.url ? "given by --metadata" : "a private redis-server");
  bx_table_note(t, "raw GET and cold resolve alternate in 3 rounds; raw HMGET+PTTL is what "
                "sx_store_get sends (two commands), not decoded; a cold resolve sends one HGET");
  bx_table_note(t, "cold resolve: the cache forced to miss; the value read is the one its "
                "entry was decoded from, so it is not decoded again; new value: the entry "
                "forgotten first (a name's first resolve, or a changed value): decoded and "
                "validated");
  char err[400] = "";
  double cold1_p50 = 0;
  for (int ci = 0; ci < mo.n_conc; ci++) {
    uint32_t c = (uint32_t)mo.conc[ci];
    opres pr[2], one;
    memset(pr, 0, sizeof(pr));
    double base = 0;
    if ((mo.ops & MB_OP_RESOLVE) && m.redis) {
      bx_progress("raw GET and cold resolve, %u in flight", c);
      if (measure_pair(&m, op_raw_get, op_cold, c, 2 * o->duration, pr, err, sizeof(err)))
        goto fail;
      base = pr[0].rate;
      add_row(t, "raw GET (baseline)", c, &pr[0], 0);
    } else if (mo.ops & MB_OP_RESOLVE) {
      bx_progress("cold resolve, %u in flight", c);
      if (measure_one(&m, op_cold, c, o->duration, &pr[1], err, sizeof(err)))
        goto fail;
    }
    if ((mo.ops & MB_OP_HMGET) && m.redis) {
      bx_progress("raw HMGET+PTTL, %u in flight", c);
      if (measure_one(&m, op_raw_hmget, c, o->duration, &one, err, sizeof(err)))
        goto fail;
      add_row(t, "raw HMGET+PTTL", c, &one, base);
    }
    if (mo.ops & MB_OP_RESOLVE) {
      add_row(t, "cold resolve", c, &pr[1], base);
      if (measure_one(&m, op_cold_new, c, o->duration, &one, err, sizeof(err)))
        goto fail;
      add_row(t, "cold resolve, new value (decoded)", c, &one, base);
      if (c == 1)
        cold1_p50 = pr[1].p50;
      char what[64];
      snprintf(what, sizeof(what), "cold resolve vs raw GET, %u in flight", c);
      if (base > 0)
        bx_target(rep, what, pr[1].rate / base, "x", ">=", 0.9, "ops/s ratio, same run");
      else
        bx_target_skip(rep, what, "no raw baseline for this store");
      if (base > 0)
        bx_series_add(bx_plot_series(&plot, "raw GET (baseline)", 1), c, base);
      bx_series_add(bx_plot_series(&plot, "cold resolve", 0), c, pr[1].rate);
    }
    if (mo.ops & MB_OP_WARM) {
      sx_cache_stats cs;
      sx__cache_stats(m.c, &cs);
      uint64_t fetches = cs.fetches;
      if (measure_one(&m, op_warm, c, o->duration, &one, err, sizeof(err)))
        goto fail;
      sx__cache_stats(m.c, &cs);
      if (cs.fetches != fetches) {
        snprintf(err, sizeof(err), "warm resolve: %" PRIu64 " store reads: the cache missed",
                 cs.fetches - fetches);
        goto fail;
      }
      add_row(t, "warm resolve (async call)", c, &one, base);
    }
    if (mo.ops & (MB_OP_PUBLISH | MB_OP_RENEW))
      bx_progress("publish and renew, %u in flight", c);
    if (mo.ops & MB_OP_PUBLISH) {
      if (measure_one(&m, op_publish, c, o->duration, &one, err, sizeof(err)))
        goto fail;
      add_row(t, "publish", c, &one, base);
      bx_series_add(bx_plot_series(&plot, "publish", 0), c, one.rate);
    }
    if (mo.ops & MB_OP_RENEW) {
      if (measure_one(&m, op_renew, c, o->duration, &one, err, sizeof(err)))
        goto fail;
      add_row(t, "renew", c, &one, base);
      bx_series_add(bx_plot_series(&plot, "renew", 0), c, one.rate);
    }
  }
  if (!(mo.ops & MB_OP_WARM))
    goto after_warm;
  bx_progress("warm resolve (cache peek)");
  double peek = warm_peek_ns(&m, o->duration);
  if (peek < 0) {
    snprintf(err, sizeof(err), "warm resolve: a cache peek missed");
    goto fail;
  }
  bx_row *row = bx_row_add(t);
  bx_set_str(row, "op", "warm resolve (cache peek, agent open)");
  bx_set_num(row, "ops_s", 1e9 / peek);
  bx_set_num(row, "p50_us", peek / 1e3);
  if (cold1_p50 > 0)
    bx_target(rep, "warm resolve faster than cold (per op, 1 in flight)", cold1_p50 * 1e3 / peek,
              "x", ">=", 100, "cold p50 latency / warm peek time, same run");
  else
    bx_target_skip(rep, "warm resolve faster than cold", "concurrency 1 not measured");
after_warm:
  if (bx_meta_ls(&m, &mo, rep, err, sizeof(err)) != 0)
    goto fail;
  /* A fleet size that failed says why in its row; the others still run. */
  if ((mo.cluster ? cluster_fleet(o, &mo, rep, &m, maxc, err, sizeof(err))
                  : bx_meta_fleets(&m, NULL, &mo, rep, err, sizeof(err))) != 0)
    goto fail;
  rc = BX_OK;
  goto out;
fail:
  fprintf(stderr, "sx-bench meta: %s\n", err);
out:
  bx_progress_end();
  unpopulate(&m);
  bx_mb_close(&m);
  bx_redis_stop(&srv);
  /* What was measured is shown even when a later part failed. */
  if (bx_report_emit(rep, &plot) != 0)
    rc = BX_FAIL;
  bx_report_free(rep);
  return rc;
}
