/*
 * sx-bench meta: how many agents a store holds, and a Redis Cluster
 * against one Redis (issue 24), with meta_fleet.c's probes.
 *
 * A fleet size is held when every lease is kept, the readers' p99 cold
 * resolve stays within --held-p99-ms, renewals are late by at most
 * --held-late-ms at p99, the readers get >= 90% of the resolves they ask
 * for, and no thread of this process (the load generator) is saturated:
 * a saturated generator means the store was not what gave out.
 *
 * The sizes come from --fleet, or with --fleet-search STEPS from a search:
 * from the first --fleet size, double while held (up to the largest
 * --fleet size), halve while not held, then halve the bracket between the
 * largest size held and the smallest not held STEPS times.  With a cluster
 * both stores are searched in the same run, one probe each in turn, so
 * that a change in the machine's load hits both alike.
 *
 * Two figures, because they answer different questions:
 *   - measured: the largest size each store held here.  On a machine
 *     with fewer cores than servers plus generator, the cluster's masters
 *     and the generator share the cores and this understates a cluster;
 *   - CPU-normalised: each server's CPU seconds per renewal (the readers'
 *     share taken out), at the largest size whose leases were all kept.
 *     One saturated Redis thread carries lease/3 / (CPU per renewal)
 *     agents; a cluster with each master on a core of its own saturates
 *     when its busiest master does.  This is what scales with masters
 *     where the machine has cores for them.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "meta.h"

typedef struct search {
  uint32_t next;       /* the next size to run, 0: done */
  int list;            /* the next --fleet size (without --fleet-search) */
  uint32_t cap, steps; /* the largest size tried; halvings of the bracket left */
  bx_probe lo, hi;     /* the largest size held, the smallest not held (agents 0: none) */
  bx_probe kept[32];   /* the sizes with every lease kept and the servers' CPU known */
  int n_kept;
  int cut;             /* stopped by --fleet-budget-s */
} search;

/* Sizes are round: hundreds below 10,000 agents, thousands above. */
static uint32_t round_size(uint64_t v) {
  uint64_t g = v < 10000 ? 100 : 1000;
  return (uint32_t)((v + g / 2) / g * g);
}

static void search_next(search *s, const bx_meta_opts *mo) {
  if (!mo->search_steps) {
    s->next = s->list < mo->n_fleet ? (uint32_t)mo->fleet[s->list++] : 0;
    return;
  }
  uint32_t lo = s->lo.agents, hi = s->hi.agents;
  if (hi == 0) {
    s->next = lo >= s->cap ? 0 : (uint64_t)lo * 2 > s->cap ? s->cap : lo * 2;
  } else if (lo == 0) {
    s->next = hi / 2 < 100 ? 0 : round_size(hi / 2);
  } else {
    uint32_t mid = round_size(((uint64_t)lo + hi) / 2);
    s->next = s->steps > 0 && mid > lo && mid < hi ? mid : 0;
    if (s->next)
      s->steps--;
  }
}

static void search_record(search *s, const bx_probe *p) {
  if (p->held && p->agents > s->lo.agents) {
    s->lo = *p;
    /* A --fleet list may hold a size above one it did not (the machine's
     * load moved): the smallest size not held is then looked for above. */
    if (s->hi.agents != 0 && s->hi.agents <= p->agents)
      memset(&s->hi, 0, sizeof(s->hi));
  }
  if (!p->held && (s->hi.agents == 0 || p->agents < s->hi.agents) &&
      p->agents > s->lo.agents)
    s->hi = *p;
  if (p->kept && p->n_srv > 0 && p->renews_s > 0 &&
      s->n_kept < (int)(sizeof(s->kept) / sizeof(s->kept[0])))
    s->kept[s->n_kept++] = *p;
}

/* The kept size with the most (most = 1) or fewest agents. */
static const bx_probe *kept_end(const search *s, int most) {
  const bx_probe *b = NULL;
  for (int i = 0; i < s->n_kept; i++)
    if (b == NULL || (most ? s->kept[i].agents > b->agents : s->kept[i].agents < b->agents))
      b = &s->kept[i];
  return b;
}

/* CPU seconds per renewal, all servers and the busiest: for each server
 * the slope of a least-squares line through its CPU share against
 * renewals/s over the sizes whose leases were kept, so that what does not
 * grow with renewals (the readers' resolves, timers, the cluster bus)
 * drops out.  Where those sizes span less than 1.5x in renewals, the
 * average at the largest (less the readers' share at the idle store's
 * cost).  *from says which; -1 when neither is known. */
static int renew_cost(const search *s, double *all, double *busiest, char *from,
                      size_t fsize) {
  const bx_probe *lo = kept_end(s, 0), *hi = kept_end(s, 1);
  if (hi == NULL)
    return -1;
  if (hi->renews_s >= 1.5 * lo->renews_s) {
    double mx = 0, my[BX_CLUSTER_MAX] = {0}, sxx = 0, sxy[BX_CLUSTER_MAX] = {0};
    int n = s->n_kept, ns = hi->n_srv;
    for (int k = 0; k < n; k++) {
      mx += s->kept[k].renews_s / n;
      for (int i = 0; i < ns; i++)
        my[i] += s->kept[k].srv_each[i] / n;
    }
    for (int k = 0; k < n; k++) {
      double dx = s->kept[k].renews_s - mx;
      sxx += dx * dx;
      for (int i = 0; i < ns; i++)
        sxy[i] += dx * (s->kept[k].srv_each[i] - my[i]);
    }
    double sum = 0, top = 0;
    for (int i = 0; i < ns; i++) {
      double b = sxy[i] / sxx;
      sum += b;
      top = b > top ? b : top;
    }
    if (sum > 0 && top > 0) {
      *all = sum;
      *busiest = top;
      snprintf(from, fsize, "fit, %d sizes %u..%u", n, lo->agents, hi->agents);
      return 0;
    }
  }
  if (hi->srv_renew_s <= 0 || hi->srv_renew_max_s <= 0)
    return -1;
  *all = hi->srv_renew_s;
  *busiest = hi->srv_renew_max_s;
  snprintf(from, fsize, "average at %u", hi->agents);
  return 0;
}

/* One Redis's average CPU per renewal (less the readers' share) at r
 * renewals/s, interpolated between its kept sizes (an end only within 25%
 * of it); -1 when r lies outside what was measured. */
static double cost_at(const search *s, double r) {
  const bx_probe *below = NULL, *above = NULL;
  for (int i = 0; i < s->n_kept; i++) {
    const bx_probe *p = &s->kept[i];
    if (p->srv_renew_s <= 0)
      continue;
    if (p->renews_s <= r && (below == NULL || p->renews_s > below->renews_s))
      below = p;
    if (p->renews_s >= r && (above == NULL || p->renews_s < above->renews_s))
      above = p;
  }
  if (below != NULL && above != NULL) {
    if (above->renews_s == below->renews_s)
      return below->srv_renew_s;
    double f = (r - below->renews_s) / (above->renews_s - below->renews_s);
    return below->srv_renew_s + f * (above->srv_renew_s - below->srv_renew_s);
  }
  const bx_probe *end = below != NULL ? below : above;
  if (end != NULL && r > end->renews_s * 0.8 && r < end->renews_s * 1.25)
    return end->srv_renew_s;
  return -1;
}

/* The cluster against one Redis with each server doing the same work: the
 * busiest master's CPU per renewal at the cluster's largest kept size
 * whose renewals per master one Redis was also measured at (a server's
 * cost per renewal depends on its load: more commands per wakeup when
 * busier).  The ratio, or -1; what was compared in text. */
static double equal_load_ratio(const search *one, const search *cl, char *text,
                               size_t size) {
  const bx_probe *best = NULL;
  double best_one = -1;
  for (int i = 0; i < cl->n_kept; i++) {
    const bx_probe *c = &cl->kept[i];
    if (c->srv_renew_max_s <= 0 || c->n_srv == 0)
      continue;
    double y = cost_at(one, c->renews_s / c->n_srv);
    if (y > 0 && (best == NULL || c->renews_s > best->renews_s)) {
      best = c;
      best_one = y;
    }
  }
  if (best == NULL)
    return -1;
  snprintf(text, size, "one Redis %.1f us/renewal at %.0f renewals/s; cluster busiest "
           "master %.1f at %.0f (%u agents)", best_one * 1e6, best->renews_s / best->n_srv,
           best->srv_renew_max_s * 1e6, best->renews_s, best->agents);
  return best_one / best->srv_renew_max_s;
}

/* Agents one saturated thread carries at cpu seconds per renewal. */
static double agents_per_thread(const bx_meta_opts *mo, double cpu) {
  return cpu > 0 ? mo->lease_ms / 3000.0 / cpu : -1;
}

static void held_row(bx_table *t, const char *store, int servers, const search *s,
                     const bx_meta_opts *mo) {
  bx_row *row = bx_row_add(t);
  bx_set_str(row, "store", "%s", store);
  bx_set_num(row, "servers", servers);
  bx_set_num(row, "held", s->lo.agents);
  if (s->lo.agents) {
    bx_set_num(row, "p99_ms", s->lo.p99_ms);
    if (s->lo.n_srv > 0)
      bx_set_num(row, "srv_max", s->lo.srv_cpu_max * 100);
    bx_set_num(row, "gen_thread", s->lo.gen_thread_max * 100);
  }
  if (s->hi.agents) {
    bx_set_num(row, "not_held", s->hi.agents);
    bx_set_str(row, "why", "%s", s->hi.why);
  }
  if (s->hi.agents && s->hi.ran) {
    /* What each resource did where the store gave out: a saturated server
     * is the store's limit; the rest are this machine's or this process's. */
    const bx_probe *p = &s->hi;
    char srv[8 * BX_CLUSTER_MAX] = "-", rq[48] = "-", lag[48] = "-", stall[48] = "-";
    for (int i = 0, off = 0; i < p->n_srv && off < (int)sizeof(srv); i++)
      off += snprintf(srv + off, sizeof(srv) - (size_t)off, "%s%.0f%%", i ? "/" : "",
                      p->srv_each[i] * 100);
    if (p->runq_ms_s >= 0)
      snprintf(rq, sizeof(rq), "%.0f ms/s", p->runq_ms_s);
    if (p->lag_p99_ms >= 0)
      snprintf(lag, sizeof(lag), "%.1f ms", p->lag_p99_ms);
    if (p->stall_ms >= 0)
      snprintf(stall, sizeof(stall), "%.0f ms", p->stall_ms);
    bx_set_str(row, "bound", "server%s %s, generator thread %.0f%%, CPU wait %s, "
               "reader lag p99 %s, server stall %s", p->n_srv > 1 ? "s" : "", srv,
               p->gen_thread_max * 100, rq, lag, stall);
  }
  double all, busiest;
  char from[64];
  if (renew_cost(s, &all, &busiest, from, sizeof(from)) == 0) {
    bx_set_str(row, "cpu_at", "%s", from);
    bx_set_num(row, "us_renew", all * 1e6);
    bx_set_num(row, "us_renew_max", busiest * 1e6);
    bx_set_num(row, "per_thread", agents_per_thread(mo, all));
    bx_set_num(row, "own_cores", agents_per_thread(mo, busiest));
  }
  if (s->cut)
    bx_set_str(row, "why", "%s%s", s->hi.agents ? s->hi.why : "",
               s->hi.agents ? "; search cut short by --fleet-budget-s"
                            : "search cut short by --fleet-budget-s");
}

/* "N (not M: why)" or "N (the largest size tried)". */
static void held_text(const search *s, char *buf, size_t size) {
  if (s->hi.agents)
    snprintf(buf, size, "%u (not %u: %.60s)", s->lo.agents, s->hi.agents, s->hi.why);
  else
    snprintf(buf, size, "%u (the largest size tried)", s->lo.agents);
}

/* What each store held, and the two cluster targets. */
static void held_report(bx_report *rep, const bx_meta_opts *mo, const search se[2],
                        const mb *cl) {
  static const bx_col cols[] = {
      {"store", "STORE", NULL},
      {"servers", "SERVERS", "%.0f"},
      {"held", "AGENTS HELD", "%.0f"},
      {"p99_ms", "ITS P99 RESOLVE MS", "%.2f"},
      {"srv_max", "ITS BUSIEST SERVER CPU %", "%.0f"},
      {"gen_thread", "ITS GEN BUSIEST THREAD %", "%.0f"},
      {"not_held", "NOT HELD AT", "%.0f"},
      {"why", "WHY NOT", NULL},
      {"bound", "THERE", NULL},
      {"cpu_at", "CPU PER RENEWAL FROM", NULL},
      {"us_renew", "SERVERS US/RENEW", "%.1f"},
      {"us_renew_max", "BUSIEST SERVER US/RENEW", "%.1f"},
      {"per_thread", "AGENTS PER SATURATED THREAD", "%.0f"},
      {"own_cores", "AGENTS, EACH SERVER ON ITS OWN CORE", "%.0f"},
  };
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  bx_table *t = bx_table_add(rep, "held", "Agents held: the largest fleet with every lease "
                             "kept, p99 resolve and renewals on time (measured here), and "
                             "the same from CPU per renewal (normalised)",
                             cols, (int)(sizeof(cols) / sizeof(cols[0])));
  bx_table_note(t, "%s; held: see the fleet tables' HELD note (p99 resolve <= %.1f ms, "
                "lease %u ms)", mo->search_steps ? "sizes from a search (doubling, then "
                "halving the bracket)" : "sizes from --fleet", mo->held_p99_ms, mo->lease_ms);
  bx_table_note(t, "measured: servers and generator share these %ld CPUs; normalised: "
                "server CPU per renewal, the slope of a line fitted to each server's CPU "
                "against renewals/s over the fleets whose leases were all kept (else the "
                "average at the largest)", ncpu);
  bx_table_note(t, "THERE: at the size not held, each server's CPU (a server near 100%% is "
                "the store's own limit), the generator's busiest thread, the CPU "
                "wait of this process and the servers, the readers' timer lag and the "
                "longest server stall (the fleet tables' notes say what each is)");
  bx_table_note(t, "one saturated thread carries lease/3 / (US/RENEW) agents; servers with "
                "a core each saturate when the busiest does");
  bx_table_note(t, "a server's cost per renewal falls as it gets busier (more commands per "
                "wakeup): lightly loaded servers (a cluster's masters) look costlier here "
                "than at saturation");
  held_row(t, "one redis-server", 1, &se[0], mo);
  if (cl == NULL)
    return;
  char name[64];
  snprintf(name, sizeof(name), "Redis Cluster of %d masters", cl->n_srv);
  held_row(t, name, cl->n_srv, &se[1], mo);

  char what[160], basis[240];
  snprintf(what, sizeof(what), "agents held, %d-master cluster vs one Redis, measured on "
           "%ld shared CPUs", cl->n_srv, ncpu);
  if (se[0].lo.agents == 0) {
    snprintf(basis, sizeof(basis), "one redis-server held none of the sizes tried (%.100s); "
             "the cluster held %u", se[0].hi.why, se[1].lo.agents);
    bx_target_skip(rep, what, basis);
  } else {
    char a[100], b[100];
    held_text(&se[1], a, sizeof(a));
    held_text(&se[0], b, sizeof(b));
    snprintf(basis, sizeof(basis), "cluster %.100s; one Redis %.100s", a, b);
    bx_target(rep, what, (double)se[1].lo.agents / se[0].lo.agents, "x", ">=", 2.5, basis);
  }
  snprintf(what, sizeof(what), "agents per saturated Redis thread, %d-master cluster (each "
           "master a core) vs one Redis, CPU-normalised", cl->n_srv);
  double all0, one0, all1, max1;
  char from0[64], from1[64];
  if (renew_cost(&se[0], &all0, &one0, from0, sizeof(from0)) != 0 ||
      renew_cost(&se[1], &all1, &max1, from1, sizeof(from1)) != 0) {
    bx_target_skip(rep, what, "no fleet size with every lease kept and the servers' CPU "
                   "known on both stores");
  } else {
    snprintf(basis, sizeof(basis), "server CPU us/renewal: one Redis %.1f (%s); cluster "
             "busiest master %.1f, all masters %.1f (%s)", one0 * 1e6, from0, max1 * 1e6,
             all1 * 1e6, from1);
    bx_target(rep, what, one0 / max1, "x", ">=", 2.5, basis);
  }
  snprintf(what, sizeof(what), "agents per saturated Redis thread, %d-master cluster vs one "
           "Redis, CPU at equal load per server", cl->n_srv);
  char text[200];
  double eq = equal_load_ratio(&se[0], &se[1], text, sizeof(text));
  if (eq < 0)
    bx_target_skip(rep, what, "the cluster kept no size whose renewals per master one "
                   "Redis was measured at");
  else
    bx_target(rep, what, eq, "x", ">=", 2.5, text);
}

int bx_meta_fleets(mb *base, mb *cluster, const bx_meta_opts *mo, bx_report *rep, char *err,
                   size_t esize) {
  if (mo->n_fleet == 0) {
    bx_target_skip(rep, "p99 cold resolve with 10,000 agents renewing", "--fleet 0");
    return 0;
  }
  mb *ms[2] = {base, cluster};
  int n = cluster ? 2 : 1, rc = 0, opened = 0;
  bx_fleet_run run[2];
  search se[2];
  memset(se, 0, sizeof(se));
  memset(run, 0, sizeof(run));
  for (; opened < n; opened++)
    if (bx_fleet_run_open(&run[opened], ms[opened], mo, rep, err, esize) != 0) {
      rc = -1;
      opened++;
      goto out;
    }
  uint32_t cap = 0;
  for (int i = 0; i < mo->n_fleet; i++)
    cap = mo->fleet[i] > cap ? (uint32_t)mo->fleet[i] : cap;
  for (int k = 0; k < n; k++) {
    se[k].cap = cap;
    se[k].steps = mo->search_steps;
    if (mo->search_steps)
      se[k].next = (uint32_t)mo->fleet[0];
    else
      search_next(&se[k], mo);
  }
  double t0 = bx_now();
  for (int more = 1; more;) {
    more = 0;
    for (int k = 0; k < n; k++) {
      if (se[k].next == 0)
        continue;
      if (mo->fleet_budget_s && bx_now() - t0 > mo->fleet_budget_s) {
        se[k].cut = 1;
        se[k].next = 0;
        continue;
      }
      bx_probe p;
      bx_fleet_probe(&run[k], se[k].next, &p);
      search_record(&se[k], &p);
      search_next(&se[k], mo);
      more |= se[k].next != 0;
    }
  }
  held_report(rep, mo, se, cluster);
out:
  for (int k = 0; k < opened; k++) {
    char e2[400];
    if (bx_fleet_run_close(&run[k], e2, sizeof(e2)) != 0 && rc == 0) {
      snprintf(err, esize, "%s", e2);
      rc = -1;
    }
  }
  return rc;
}
