/*
 * sx-bench meta, continued: its options, and `ls` of many segments against
 * the raw pipelined reads it is made of.  The fleet run is in
 * meta_probe.c and meta_held.c.
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
      uint64_t *dst = ls ? mo->ls : mo->fleet, most = ls ? 100000 : 1000000;
      int n = bx_parse_list(v, dst, 8, 0), k = 0;
      for (int j = 0; j < n; j++) {
        if (dst[j] > most) {
          fprintf(stderr, "sx-bench meta: %s: at most %" PRIu64 "\n", a, most);
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
    } else if (strcmp(a, "--fleet-threads") == 0 || strcmp(a, "--fleet-search") == 0 ||
               strcmp(a, "--held-late-ms") == 0 || strcmp(a, "--fleet-budget-s") == 0) {
      int th = a[8] == 't', se = a[8] == 's', bu = a[8] == 'b';
      uint64_t most = th ? 64 : se ? 10 : bu ? 86400 : 60000;
      if (bx_parse_list(v, x, 1, 0) != 1 || x[0] == 0 || x[0] > most) {
        fprintf(stderr, "sx-bench meta: %s needs 1..%" PRIu64 "\n", a, most);
        return BX_USAGE;
      }
      if (th)
        mo->fleet_threads = (uint32_t)x[0];
      else if (se)
        mo->search_steps = (uint32_t)x[0];
      else if (bu)
        mo->fleet_budget_s = (uint32_t)x[0];
      else
        mo->held_late_ms = (double)x[0];
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
