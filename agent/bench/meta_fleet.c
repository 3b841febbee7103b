/*
 * sx-bench meta, continued: its options, `ls` of many segments against the
 * raw pipelined reads it is made of, and the fleet run (fleet.c's simulated
 * agents renewing leases while readers resolve).
 */
#include <hiredis/hiredis.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "internal.h"
#include "meta.h"
#include "segxfer/store.h"

int bx_meta_parse(bx_meta_opts *mo, int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    uint64_t x[1];
    if (v == NULL) {
      fprintf(stderr, "sx-bench meta: unknown option or missing value: '%s' "
              "(sx-bench meta --help)\n", a);
      return BX_USAGE;
    }
    i++;
    if (strcmp(a, "--metadata") == 0) {
      mo->url = v;
    } else if (strcmp(a, "--ops") == 0) {
      static const struct {
        const char *name;
        unsigned bit;
      } names[] = {{"resolve", MB_OP_RESOLVE}, {"hmget", MB_OP_HMGET}, {"warm", MB_OP_WARM},
                   {"publish", MB_OP_PUBLISH}, {"renew", MB_OP_RENEW}, {"all", MB_OP_ALL}};
      char buf[128];
      snprintf(buf, sizeof(buf), "%s", v);
      mo->ops = 0;
      for (char *save, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        unsigned bit = 0;
        for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++)
          if (strcmp(tok, names[k].name) == 0)
            bit = names[k].bit;
        if (bit == 0) {
          fprintf(stderr, "sx-bench meta: --ops: '%s' is not resolve, hmget, warm, "
                  "publish, renew or all\n", tok);
          return BX_USAGE;
        }
        mo->ops |= bit;
      }
    } else if (strcmp(a, "--conc") == 0) {
      mo->n_conc = bx_parse_list(v, mo->conc, 16, 0);
      for (int k = 0; k < mo->n_conc; k++)
        if (mo->conc[k] == 0 || mo->conc[k] > 4096)
          mo->n_conc = -1;
      if (mo->n_conc <= 0) {
        fprintf(stderr, "sx-bench meta: --conc needs numbers 1..4096\n");
        return BX_USAGE;
      }
    } else if (strcmp(a, "--ls") == 0 || strcmp(a, "--fleet") == 0) {
      int ls = a[2] == 'l';
      uint64_t *dst = ls ? mo->ls : mo->fleet;
      int n = bx_parse_list(v, dst, 8, 0), k = 0;
      for (int j = 0; j < n; j++) {
        if (dst[j] > 100000) {
          fprintf(stderr, "sx-bench meta: %s: at most 100000\n", a);
          return BX_USAGE;
        }
        if (dst[j] > 0)
          dst[k++] = dst[j];
      }
      if (n < 0) {
        fprintf(stderr, "sx-bench meta: %s needs counts, e.g. 1000,10000 (0: none)\n", a);
        return BX_USAGE;
      }
      *(ls ? &mo->n_ls : &mo->n_fleet) = k;
    } else if (strcmp(a, "--cluster") == 0) {
      if (bx_parse_list(v, x, 1, 0) != 1 || (x[0] != 0 && (x[0] < 3 || x[0] > 8))) {
        fprintf(stderr, "sx-bench meta: --cluster needs 3..8 masters (0: none)\n");
        return BX_USAGE;
      }
      mo->cluster = (uint32_t)x[0];
    } else if (strcmp(a, "--held-p99-ms") == 0) {
      if (bx_parse_list(v, x, 1, 0) != 1 || x[0] == 0 || x[0] > 60000) {
        fprintf(stderr, "sx-bench meta: --held-p99-ms needs 1..60000 ms\n");
        return BX_USAGE;
      }
      mo->held_p99_ms = (double)x[0];
    } else if (strcmp(a, "--reader-rate") == 0) {
      if (bx_parse_list(v, x, 1, 0) != 1 || x[0] > 100000) {
        fprintf(stderr, "sx-bench meta: --reader-rate needs 0..100000 resolves/s\n");
        return BX_USAGE;
      }
      mo->reader_rate = (uint32_t)x[0];
    } else if (strcmp(a, "--regions") == 0 || strcmp(a, "--fleet-conns") == 0 ||
               strcmp(a, "--readers") == 0 || strcmp(a, "--lease-ms") == 0) {
      if (bx_parse_list(v, x, 1, 0) != 1 || x[0] == 0 || x[0] > 600000 ||
          (a[2] == 'r' && a[3] == 'e' && a[4] == 'a' && x[0] > 1024)) {
        fprintf(stderr, "sx-bench meta: %s needs a positive number%s\n", a,
                strcmp(a, "--readers") == 0 ? " (at most 1024)" : "");
        return BX_USAGE;
      }
      if (a[2] == 'r' && a[3] == 'e' && a[4] == 'g') {
        if (x[0] > SX_MAX_REGIONS)
          return BX_USAGE;
        mo->regions = (uint32_t)x[0];
      } else if (a[2] == 'f') {
        mo->fleet_conns = (uint32_t)x[0];
      } else if (a[2] == 'r') {
        mo->readers = (uint32_t)x[0];
      } else {
        mo->lease_ms = (uint32_t)x[0];
      }
    } else {
      fprintf(stderr, "sx-bench meta: unknown option '%s' (sx-bench meta --help)\n", a);
      return BX_USAGE;
    }
  }
  return 0;
}

/* The bench's URL with "-suffix" appended to its namespace. */
static void url_with_ns(const mb *m, const char *suffix, char *buf, size_t size) {
  const char *p = strstr(m->url_text, "namespace=");
  size_t pre = (size_t)(p - m->url_text) + strlen("namespace=");
  size_t vlen = strcspn(p + strlen("namespace="), "&");
  snprintf(buf, size, "%.*s%.*s-%s%s", (int)pre, m->url_text, (int)vlen,
           p + strlen("namespace="), suffix, p + strlen("namespace=") + vlen);
}

/* ------------------------------------------------------------ ls */

typedef struct pubctx {
  int inflight, errors;
  char msg[300];
} pubctx;

static void pub_done(void *arg, const sx_backend_reply *rep) {
  pubctx *p = arg;
  p->inflight--;
  if (rep->status != 0 && p->errors++ == 0)
    snprintf(p->msg, sizeof(p->msg), "%s: %s", sx_err_name(rep->status), rep->message);
}

/* Publish segments [from, to) of the ls namespace through backend b. */
static int ls_publish(uv_loop_t *loop, sx_backend *b, uint32_t from, uint32_t to,
                      uint8_t *inc, char *err, size_t esize) {
  pubctx pc = {0};
  for (uint32_t i = from; i < to && pc.errors == 0; i++) {
    char name[32];
    snprintf(name, sizeof(name), "ls/%06u", i);
    sx_desc d;
    uint8_t *v = NULL;
    size_t len = 0;
    int rc = bx_make_desc(&d, name, 2, 1);
    if (rc == 0) {
      d.lease_ms = MB_LEASE_MS;
      memcpy(d.incarnation, inc, SX_INCARNATION_LEN);
      rc = sx_desc_encode(&d, &v, &len);
      sx_desc_free(&d);
    }
    sx_publish_req req = {.name = name, .incarnation = inc, .generation = 1, .value = v,
                          .len = len, .lease_ms = MB_LEASE_MS};
    if (rc == 0)
      rc = sx__backend_publish(b, &req, pub_done, &pc);
    free(v); /* the backend keeps its own copy */
    if (rc != 0) {
      snprintf(err, esize, "ls: publishing %s: %s", name, sx_errmsg());
      return -1;
    }
    /* A window keeps the client's memory bounded for 100k segments. */
    if (++pc.inflight >= 512)
      while (pc.inflight >= 256)
        uv_run(loop, UV_RUN_ONCE);
  }
  while (pc.inflight > 0)
    uv_run(loop, UV_RUN_ONCE);
  if (pc.errors) {
    snprintf(err, esize, "ls: publishing: %s", pc.msg);
    return -1;
  }
  return 0;
}

/* What ls is made of, done raw: ZRANGE of the index, then HMGET d lease and
 * PTTL of every member in one pipeline; nothing decoded.  Seconds, or -1. */
static double raw_ls(const mb *m, const char *ns, size_t expect) {
  redisContext *c = bx_mb_sync_connect(m);
  if (c == NULL)
    return -1;
  double t0 = bx_now();
  char index[128];
  snprintf(index, sizeof(index), "sx:%s:index", ns);
  redisReply *r = redisCommand(c, "ZRANGE %s 0 -1", index);
  double el = -1;
  if (r != NULL && r->type == REDIS_REPLY_ARRAY && r->elements == expect) {
    for (size_t i = 0; i < r->elements; i++) {
      redisAppendCommand(c, "HMGET sx:%s:seg:{%s} d lease", ns, r->element[i]->str);
      redisAppendCommand(c, "PTTL sx:%s:seg:{%s}", ns, r->element[i]->str);
    }
    int ok = 1;
    for (size_t i = 0; i < 2 * r->elements && ok; i++) {
      void *rep;
      ok = redisGetReply(c, &rep) == REDIS_OK;
      if (ok)
        freeReplyObject(rep);
    }
    if (ok)
      el = bx_now() - t0;
  }
  if (r)
    freeReplyObject(r);
  redisFree(c);
  return el;
}

int bx_meta_ls(mb *m, const bx_meta_opts *mo, bx_report *rep, char *err, size_t esize) {
  if (mo->n_ls == 0) {
    bx_target_skip(rep, "ls of 10,000 segments", "--ls 0");
    return 0;
  }
  char url[700];
  url_with_ns(m, "ls", url, sizeof(url));
  sx_url u;
  sx__url_parse(url, &u);
  static const bx_col cols[] = {
      {"segments", "SEGMENTS", "%.0f"},    {"ls_s", "LS SECONDS", "%.3f"},
      {"us_per_seg", "US/SEGMENT", "%.1f"}, {"raw_s", "RAW PIPELINE S", "%.3f"},
      {"ratio", "LS / RAW", "%.2fx"},
  };
  bx_table *t = bx_table_add(rep, "ls", "ls: sx_store_list() (index, every value, decoded "
                             "and validated) against the raw pipelined reads it needs "
                             "(baseline, not decoded)", cols, 5);
  bx_table_note(t, "median of 3 listings each; segments hold the strided 80-layer descriptor");
  uint8_t inc[SX_INCARNATION_LEN];
  memset(inc, 0x1c, sizeof(inc));
  int up = 0;
  sx_backend *b = NULL;
  sx_store *st = NULL;
  int rc = -1;
  double ls10k = -1;
  uint32_t have = 0;
  sx_backend_hooks h = {.on_conn = bx_flag_conn, .arg = &up};
  if (sx__backend_open(&m->loop, url, &h, &b) != 0) {
    snprintf(err, esize, "ls: %s", sx_errmsg());
    return -1;
  }
  while (up == 0)
    uv_run(&m->loop, UV_RUN_ONCE);
  if (up < 0 || sx_store_open(url, &st) != 0) {
    snprintf(err, esize, "ls: cannot connect: %s", sx_errmsg());
    goto out;
  }
  for (int k = 0; k < mo->n_ls; k++) {
    uint32_t n = (uint32_t)mo->ls[k];
    bx_progress("ls of %u segments", n);
    if (n > have && ls_publish(&m->loop, b, have, n, inc, err, esize) != 0)
      goto out;
    have = n > have ? n : have;
    double ls[3], raw[3];
    for (int r = 0; r < 3; r++) {
      sx_store_entry *e;
      size_t got;
      double t0 = bx_now();
      if (sx_store_list(st, &e, &got) != 0) {
        snprintf(err, esize, "ls: %s", sx_errmsg());
        goto out;
      }
      ls[r] = bx_now() - t0;
      size_t bad = 0;
      for (size_t i = 0; i < got; i++)
        bad += e[i].status != 0;
      sx_store_entries_free(e, got);
      if (got != have || bad) {
        snprintf(err, esize, "ls: listed %zu segments (%zu unreadable), published %u", got,
                 bad, have);
        goto out;
      }
      if (!m->redis)
        raw[r] = 0;
      else if ((raw[r] = raw_ls(m, u.ns, have)) < 0) {
        snprintf(err, esize, "ls: the raw pipeline failed");
        goto out;
      }
    }
    bx_row *row = bx_row_add(t);
    double lm = bx_median(ls, 3), rm = bx_median(raw, 3);
    bx_set_num(row, "segments", have);
    bx_set_num(row, "ls_s", lm);
    bx_set_num(row, "us_per_seg", lm * 1e6 / have);
    if (rm > 0) {
      bx_set_num(row, "raw_s", rm);
      bx_set_num(row, "ratio", lm / rm);
    }
    if (have == 10000)
      ls10k = lm;
  }
  if (ls10k >= 0)
    bx_target(rep, "ls of 10,000 segments", ls10k, "s", "<", 1.0,
              "absolute; the raw pipeline is in the table");
  else
    bx_target_skip(rep, "ls of 10,000 segments", "10000 not among --ls");
  rc = 0;
out:
  /* Leave no segments behind on a store that is not ours. */
  if (m->srv_port == 0 && b != NULL && up == 1) {
    pubctx pc = {0};
    for (uint32_t i = 0; i < have; i++) {
      char name[32];
      snprintf(name, sizeof(name), "ls/%06u", i);
      if (sx__backend_unpublish(b, name, inc, pub_done, &pc) == 0 && ++pc.inflight >= 512)
        while (pc.inflight >= 256)
          uv_run(&m->loop, UV_RUN_ONCE);
    }
    while (pc.inflight > 0)
      uv_run(&m->loop, UV_RUN_ONCE);
  }
  sx_store_close(st);
  sx__backend_close(b);
  return rc;
}

/* ------------------------------------------------------------ fleet */

/* The readers: each a store connection and a resolver cache of its own, as
 * a reader agent has, with one resolve in flight (slot i is reader i), sent
 * at a steady rate (open loop: a resolve's latency is the store's, not a
 * queue in this process) or, with rate 0, as soon as the last one ended. */
typedef struct fleet_readers {
  sx_backend **b;
  sx_cache **c;
  int *up;
  uv_timer_t *timers; /* one per reader, for the open loop */
  uint64_t *due_ns;   /* each reader's next resolve */
  uint32_t n, rate;
  mb *m;
  uint32_t agents; /* 0: resolve the bench's own segments */
  uint64_t rng;
  char name[32];
} fleet_readers;

static void reader_cb(void *arg, int status, sx_cdesc *d, const char *msg) {
  sx__cdesc_unref(d);
  bx_run_done(arg, status, msg);
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
  s->t0 = bx_now_ns(); /* latency from the send, not from the wait */
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
  free(fr->up);
  free(fr->timers);
  free(fr->due_ns);
}

static int readers_open(fleet_readers *fr, mb *m, uint32_t n) {
  fr->m = m;
  fr->b = calloc(n, sizeof(*fr->b));
  fr->c = calloc(n, sizeof(*fr->c));
  fr->up = calloc(n, sizeof(*fr->up));
  fr->timers = calloc(n, sizeof(*fr->timers));
  fr->due_ns = calloc(n, sizeof(*fr->due_ns));
  if (fr->b == NULL || fr->c == NULL || fr->up == NULL || fr->timers == NULL ||
      fr->due_ns == NULL)
    return -1;
  for (uint32_t i = 0; i < n; i++) {
    sx_backend_hooks h = {.on_conn = bx_flag_conn, .arg = &fr->up[i]};
    uv_timer_init(&m->loop, &fr->timers[i]);
    if (sx__backend_open(&m->loop, m->url_text, &h, &fr->b[i]) != 0)
      return -1;
    fr->n = i + 1;
  }
  for (uint32_t i = 0; i < n; i++) {
    while (fr->up[i] == 0)
      uv_run(&m->loop, UV_RUN_ONCE);
    if (fr->up[i] < 0 || sx__cache_create(&m->loop, fr->b[i], NULL, &fr->c[i]) != 0)
      return -1;
  }
  return 0;
}

static int64_t commands_processed(const mb *m) {
  if (!m->redis)
    return -1;
  redisContext *c = bx_mb_sync_connect(m);
  if (c == NULL)
    return -1;
  int64_t v = -1;
  redisReply *r = redisCommand(c, "INFO stats");
  if (r != NULL && r->type == REDIS_REPLY_STRING) {
    const char *p = strstr(r->str, "total_commands_processed:");
    if (p != NULL)
      v = strtoll(p + strlen("total_commands_processed:"), NULL, 10);
  }
  if (r)
    freeReplyObject(r);
  redisFree(c);
  return v;
}

/* Run-queue wait of this process and the private server, seconds, or -1. */
static double runq(const mb *m) {
  double a = bx_runq_wait(getpid()), b = m->srv_pid > 0 ? bx_runq_wait(m->srv_pid) : 0;
  return a >= 0 && b >= 0 ? a + b : -1;
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
  uv_timer_start(&t, wait_done, (uint64_t)(secs * 1000), 0);
  while (!done)
    uv_run(&m->loop, UV_RUN_ONCE);
  uv_close((uv_handle_t *)&t, NULL);
  uv_run(&m->loop, UV_RUN_NOWAIT);
}

int bx_meta_fleet(mb *m, const bx_meta_opts *mo, bx_report *rep, char *err, size_t esize) {
  if (mo->n_fleet == 0) {
    bx_target_skip(rep, "p99 cold resolve with 10,000 agents renewing", "--fleet 0");
    return 0;
  }
  char rate_note[96];
  if (mo->reader_rate)
    snprintf(rate_note, sizeof(rate_note), "%u resolves/s each (open loop)", mo->reader_rate);
  else
    snprintf(rate_note, sizeof(rate_note), "the next sent when one ends (closed loop)");
  static const bx_col cols[] = {
      {"agents", "AGENTS", "%.0f"},          {"conns", "THEIR CONNS", "%.0f"},
      {"readers", "READERS", "%.0f"},        {"resolve_s", "RESOLVES/S", "%.0f"},
      {"p50_us", "P50 US", "%.0f"},          {"p99_us", "P99 US", "%.0f"},
      {"renew_s", "RENEWS/S", "%.0f"},       {"renew_p99_us", "RENEW P99 US", "%.0f"},
      {"late_p99_ms", "LATENESS P99 MS", "%.1f"}, {"late_max_ms", "LATENESS MAX MS", "%.1f"},
      {"late", "SKIPPED", "%.0f"},           {"renew_errors", "RENEW ERR", "%.0f"},
      {"store_cmds_s", "STORE CMDS/S", "%.0f"}, {"srv_cpu", "REDIS CPU %", "%.0f"},
      {"bench_cpu", "BENCH CPU %", "%.0f"},  {"srv_us_renew", "REDIS US/RENEW", "%.1f"},
      {"runq", "CPU WAIT MS/S", "%.0f"},    {"note", "NOTE", NULL},
  };
  const char *label = m->label ? m->label : "";
  char id[32], title[300];
  snprintf(id, sizeof(id), "fleet%s%s", label[0] ? "-" : "", label);
  snprintf(title, sizeof(title), "Fleet%s%s: simulated agents renewing leases (lease/3) "
           "while readers resolve with the cache forced to miss; agents 0 is the same "
           "readers on an idle store", label[0] ? " on the " : "", label);
  bx_table *t = bx_table_add(rep, id, title, cols, (int)(sizeof(cols) / sizeof(cols[0])));
  bx_table_note(t, "lease %u ms, renewed every %u ms, spread evenly; readers: each a store "
                "connection and cache of its own, one resolve in flight, %s", mo->lease_ms,
                mo->lease_ms / 3, rate_note);
  bx_table_note(t, "LATENESS: from a renewal falling due to its answer (a lease is lost "
                "past %u ms); SKIPPED: renewals not sent, the previous one still in flight",
                mo->lease_ms - mo->lease_ms / 3);
  bx_table_note(t, "STORE CMDS/S and REDIS CPU %%: the server's INFO over the window (every "
                "client; a Lua script counts its calls); BENCH CPU %%: this process (readers "
                "and the simulated agents), on the same %ld CPUs", sysconf(_SC_NPROCESSORS_ONLN));
  bx_table_note(t, "REDIS US/RENEW: server CPU per renewal, less the readers' share at the "
                "idle store's cost per resolve; CPU WAIT MS/S: time this process's and the "
                "private redis-server's threads were runnable but waited for a CPU, per "
                "second (schedstat)");
  fleet_readers fr = {.rng = 0x9E3779B97F4A7C15ull, .rate = mo->reader_rate};
  int rc = -1;
  if (readers_open(&fr, m, mo->readers) != 0) {
    snprintf(err, esize, "fleet: cannot connect %u readers: %s", mo->readers, sx_errmsg());
    goto out;
  }
  double p99_10k = -1, srv_per_resolve = -1;
  uint64_t lost = 0;
  int failed = 0;
  for (int k = -1; k < mo->n_fleet; k++) {
    uint32_t agents = k < 0 ? 0 : (uint32_t)mo->fleet[k];
    bx_fleet *f = NULL;
    bx_progress("fleet of %u agents", agents);
    if (agents > 0) {
      bx_fleet_params fp = {.url = m->url_text, .agents = agents, .conns = mo->fleet_conns,
                            .lease_ms = mo->lease_ms};
      char why[300];
      if (bx_fleet_start(&fp, &f, why, sizeof(why)) != 0) {
        /* Say why in its row; the other fleet sizes still run. */
        bx_row *row = bx_row_add(t);
        bx_set_num(row, "agents", agents);
        bx_set_str(row, "note", "did not start: %s", why);
        char what[128];
        snprintf(what, sizeof(what), "leases kept with %u agents renewing%s%s", agents,
                 label[0] ? ", " : "", label);
        bx_target(rep, what, 1e9, "ms", "<", mo->lease_ms - mo->lease_ms / 3,
                  "the fleet did not start (its row says why)");
        failed++;
        continue;
      }
      /* Reach the steady state: one renew period. */
      run_loop_for(m, mo->lease_ms / 3 / 1000.0);
    }
    fr.agents = agents;
    bx_run r;
    bx_fleet_stats fs = {0};
    int64_t cmd0 = commands_processed(m);
    double srv0 = bx_mb_server_cpu(m), cpu0 = bx_cpu_self(), rq0 = runq(m);
    if (f)
      bx_fleet_sample(f, &fs);
    double t0 = bx_now();
    bx_run_init(&r, m, "fleet resolve", op_fleet_resolve, fr.n);
    r.user = &fr;
    int mrc = bx_run_round(&r, m->o->duration < 2 ? 2 : m->o->duration);
    double el = bx_now() - t0;
    int64_t cmd1 = commands_processed(m);
    double srv = bx_mb_server_cpu(m) - srv0, cpu = bx_cpu_self() - cpu0, rq1 = runq(m);
    if (f)
      bx_fleet_sample(f, &fs);
    bx_fleet_stop(f);
    if (mrc != 0) {
      bx_row *row = bx_row_add(t);
      bx_set_num(row, "agents", agents);
      bx_set_str(row, "note", "resolve failed: %s: %.200s", sx_err_name(r.err), r.msg);
      bx_run_free(&r);
      failed++;
      continue;
    }
    bx_row *row = bx_row_add(t);
    bx_set_num(row, "agents", agents);
    if (agents)
      bx_set_num(row, "conns", mo->fleet_conns);
    bx_set_num(row, "readers", fr.n);
    double resolves = (double)r.all_ops;
    bx_set_num(row, "resolve_s", bx_run_rate(&r));
    double p99 = bx_lat_pct(&r.lat, 0.99) / 1e3;
    bx_set_num(row, "p50_us", bx_lat_pct(&r.lat, 0.5) / 1e3);
    bx_set_num(row, "p99_us", p99);
    if (agents) {
      bx_set_num(row, "renew_s", (double)fs.renews / el);
      bx_set_num(row, "renew_p99_us", fs.renew_p99_us);
      bx_set_num(row, "late_p99_ms", fs.late_p99_ms);
      bx_set_num(row, "late_max_ms", fs.late_max_ms);
      bx_set_num(row, "late", (double)fs.late);
      bx_set_num(row, "renew_errors", (double)fs.renew_errors);
      lost += fs.renew_errors;
    }
    if (cmd0 >= 0 && cmd1 >= cmd0)
      bx_set_num(row, "store_cmds_s", (double)(cmd1 - cmd0) / el);
    if (srv0 >= 0 && srv >= 0) {
      bx_set_num(row, "srv_cpu", srv / el * 100);
      if (agents == 0 && resolves > 0)
        srv_per_resolve = srv / resolves;
      else if (srv_per_resolve >= 0 && fs.renews > 0)
        bx_set_num(row, "srv_us_renew",
                   (srv - resolves * srv_per_resolve) / (double)fs.renews * 1e6);
    }
    bx_set_num(row, "bench_cpu", cpu / el * 100);
    if (rq0 >= 0 && rq1 >= rq0)
      bx_set_num(row, "runq", (rq1 - rq0) / el * 1e3);
    if (agents == 10000)
      p99_10k = p99;
    bx_run_free(&r);
    if (agents) {
      /* A lease survives while every renewal lands within lease - lease/3
       * of falling due; skipped and failed ones are lost margin too. */
      char what[128], basis[160];
      snprintf(what, sizeof(what), "leases kept with %u agents renewing%s%s", agents,
               label[0] ? ", " : "", label);
      int kept = !fs.late && !fs.renew_errors &&
                 fs.late_max_ms < mo->lease_ms - mo->lease_ms / 3;
      if (kept && p99 / 1e3 <= mo->held_p99_ms && agents > m->held) {
        m->held = agents;
        m->held_p99_ms = p99 / 1e3;
      }
      snprintf(basis, sizeof(basis), "latest renewal from due to answer (ms), limit lease "
               "- lease/3; %" PRIu64 " skipped, %" PRIu64 " failed", fs.late, fs.renew_errors);
      double worst = fs.late || fs.renew_errors ? 1e9 : fs.late_max_ms;
      bx_target(rep, what, worst, "ms", "<", mo->lease_ms - mo->lease_ms / 3, basis);
    }
  }
  if (lost > 0)
    bx_table_note(t, "%" PRIu64 " renewals failed: those leases were lost", lost);
  char what10k[128];
  snprintf(what10k, sizeof(what10k), "p99 cold resolve with 10,000 agents renewing%s%s",
           label[0] ? ", " : "", label);
  if (p99_10k >= 0)
    bx_target(rep, what10k, p99_10k / 1e3, "ms", "<", BX_FLEET_HELD_P99_MS,
              "absolute; agents 0 (idle store) is in the table");
  else
    bx_target_skip(rep, what10k, "10000 not among --fleet");
  rc = failed ? -1 : 0;
  if (failed)
    snprintf(err, esize, "fleet: %d of the runs failed (their rows say why)", failed);
out:
  readers_close(&fr);
  return rc;
}
