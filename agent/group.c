/*
 * Segment sets (segxfer/group.h): open the members of a set, plan them
 * against this agent's layout once, and read a request's blocks from all of
 * them as one read.
 *
 * A read expands the plan (meta/plan.c) into raw range entries, one batch
 * per member read from, so each member's ranges go through the ordinary
 * batch path: checked against both sides again, merged where contiguous,
 * sliced, posted on that member's transport.  Every batch gets the same
 * deadline and the read waits for all of them; a member that fails (its
 * process restarted: SX_ESTALE, a reset connection) fails its own entries,
 * which map back to the local blocks they were filling.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent_int.h"
#include "plan_int.h"
#include "segxfer/group.h"

struct sx_group {
  sx_agent *a;
  uint32_t n;
  sx_segment **segs;
  sx_plan *plan;
  uint64_t *failed;
};

void sx_group_params_init(sx_group_params *p) {
  memset(p, 0, sizeof(*p));
  p->timeout_ms = 5000;
}

uint32_t sx_group_size(const sx_group *g) { return g ? g->n : 0; }

sx_segment *sx_group_segment(const sx_group *g, uint32_t i) {
  return g && i < g->n ? g->segs[i] : NULL;
}

const sx_plan *sx_group_plan(const sx_group *g) { return g ? g->plan : NULL; }

void sx_group_close(sx_group *g) {
  if (g == NULL)
    return;
  for (uint32_t i = 0; i < g->n; i++)
    sx_segment_close(g->segs[i]);
  sx_plan_free(g->plan);
  free(g->segs);
  free(g->failed);
  free(g);
}

/* Plan segs[0..n) against the agent's layout and regions now. */
static int plan_members(sx_agent *a, sx_segment *const *segs, uint32_t n, unsigned flags,
                        sx_plan **out, sx_mismatch *m) {
  const sx_desc *rd[SX_PLAN_MAX_MEMBERS];
  sx_desc local;
  int rc = sx__layout_desc(a, &local);
  if (rc)
    return rc;
  for (uint32_t i = 0; i < n; i++)
    rd[i] = sx_segment_desc(segs[i]);
  rc = sx_layout_plan(&local, rd, n, flags, out, m);
  sx_desc_free(&local);
  return rc;
}

int sx_segment_plan(sx_segment *s, unsigned flags, sx_plan **out, sx_mismatch *mismatch) {
  if (s == NULL || out == NULL)
    return sx__err(SX_EINVAL, "sx_segment_plan: NULL argument");
  return plan_members(s->a, &s, 1, flags, out, mismatch);
}

int sx_group_open(sx_agent *a, const sx_group_params *p, sx_group **out,
                  sx_mismatch *mismatch) {
  if (a == NULL || p == NULL || out == NULL)
    return sx__err(SX_EINVAL, "sx_group_open: NULL argument");
  uint32_t n = p->names ? p->n_names : p->tp_size;
  if (n == 0 || n > SX_PLAN_MAX_MEMBERS || (p->names == NULL && p->engine == NULL))
    return sx__err(SX_EINVAL, "sx_group_open: give 1..%d names, or an engine and its "
                   "tp_size", SX_PLAN_MAX_MEMBERS);
  if (mismatch != NULL)
    memset(mismatch, 0, sizeof(*mismatch));
  sx_group *g = calloc(1, sizeof(*g));
  if (g == NULL || (g->segs = calloc(n, sizeof(*g->segs))) == NULL) {
    free(g);
    return sx__err(SX_ENOMEM, "sx_group_open");
  }
  g->a = a;
  uint32_t timeout = p->timeout_ms ? p->timeout_ms : 5000;
  uint64_t deadline = sx__mono_ms() + timeout;
  int rc = 0;
  for (uint32_t i = 0; i < n && rc == 0; i++) {
    char name[SX_NAME_MAX + 2];
    const char *nm = name;
    if (p->names != NULL) {
      if (p->names[i] == NULL)
        rc = sx__err(SX_EINVAL, "sx_group_open: name %u is NULL", i);
      nm = p->names[i];
    } else if (snprintf(name, sizeof(name), "%s/tp%u", p->engine, i) > SX_NAME_MAX) {
      rc = sx__err(SX_ENAME, "sx_group_open: '%s/tp%u' is longer than %d bytes", p->engine,
                   i, SX_NAME_MAX);
    }
    if (rc)
      break;
    uint64_t now = sx__mono_ms();
    uint32_t left = now < deadline ? (uint32_t)(deadline - now) : 1;
    rc = sx_segment_open(a, nm, left, &g->segs[i]);
    if (rc == SX_ENOENT)
      rc = sx__errwrap(rc, "the set lacks %s (member %u of %u)", nm, i, n);
    else if (rc == 0)
      g->n++;
  }
  if (rc == 0)
    rc = plan_members(a, g->segs, n, p->flags, &g->plan, mismatch);
  if (rc) {
    sx_group_close(g);
    return rc;
  }
  *out = g;
  return 0;
}

/* ------------------------------------------------------------ reading */

/* One member's entries: ranges and the local block index of each. */
typedef struct mlist {
  sx_range_read *r;
  uint32_t *block;
  size_t n, cap;
} mlist;

typedef struct collect {
  mlist *m;
} collect;

static int collect_range(void *arg, const sx__prange *pr) {
  collect *c = arg;
  mlist *l = &c->m[pr->member];
  if (l->n == l->cap) {
    size_t cap = l->cap ? l->cap * 2 : 256;
    sx_range_read *r = realloc(l->r, cap * sizeof(*r));
    if (r == NULL)
      return sx__err(SX_ENOMEM, "expanding a plan");
    l->r = r;
    uint32_t *b = realloc(l->block, cap * sizeof(*b));
    if (b == NULL)
      return sx__err(SX_ENOMEM, "expanding a plan");
    l->block = b;
    l->cap = cap;
  }
  l->r[l->n] = (sx_range_read){.local = (void *)(uintptr_t)pr->laddr,
                               .remote_region = pr->R->id, .offset = pr->roff,
                               .length = pr->len};
  l->block[l->n++] = pr->block;
  return 0;
}

static int state_rank(sx_batch_state s) {
  /* The read's state is its worst member's: a timeout says more than a
   * cancel, a failure more than a timeout. */
  return s == SX_BATCH_FAILED ? 3 : s == SX_BATCH_TIMEOUT ? 2 : s == SX_BATCH_CANCELLED ? 1 : 0;
}

int sx_group_read(sx_group *g, const uint64_t *rb, size_t nr, const uint64_t *lb, size_t nl,
                  uint32_t timeout_ms, sx_group_result *out) {
  if (g == NULL || out == NULL || (nr && rb == NULL) || (nl && lb == NULL))
    return sx__err(SX_EINVAL, "sx_group_read: NULL argument");
  if (nl > UINT32_MAX)
    return sx__err(SX_ELIMIT, "sx_group_read: %zu local blocks", nl);
  const sx_desc *rd[SX_PLAN_MAX_MEMBERS];
  mlist m[SX_PLAN_MAX_MEMBERS];
  sx_batch *b[SX_PLAN_MAX_MEMBERS] = {0};
  uint8_t *bad = calloc(nl / 8 + 1, 1);
  sx_desc local;
  int rc = bad ? sx__layout_desc(g->a, &local) : sx__err(SX_ENOMEM, "sx_group_read");
  if (rc) {
    free(bad);
    return rc;
  }
  memset(m, 0, sizeof(m));
  for (uint32_t i = 0; i < g->n; i++)
    rd[i] = sx_segment_desc(g->segs[i]);
  /* The local snapshot has every region the plan's keys name, or the
   * expansion refuses: a region unregistered since the open is never
   * written through an old address. */
  collect c = {m};
  rc = sx__plan_expand(g->plan, &local, rd, g->n, rb, nr, lb, nl, collect_range, &c);
  sx_desc_free(&local);
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  if (timeout_ms)
    bp.timeout_ms = timeout_ms;
  for (uint32_t i = 0; i < g->n && rc == 0; i++) {
    if (m[i].n == 0)
      continue;
    if ((rc = sx_batch_create(g->segs[i], &bp, &b[i])) == 0 &&
        (rc = sx_batch_add_ranges(b[i], m[i].r, m[i].n)) != 0)
      rc = sx__errwrap(rc, "%s", rd[i]->name);
  }
  sx_group_result res;
  memset(&res, 0, sizeof(res));
  res.state = SX_BATCH_COMPLETED;
  uint64_t t0 = sx__mono_ns();
  /* Nothing is sent before every member's entries passed their checks. */
  for (uint32_t i = 0; i < g->n && rc == 0; i++) {
    if (b[i] == NULL)
      continue;
    int src = sx_batch_submit(b[i]);
    if (src != 0) {
      /* Not started: its blocks fail; the members already started run on. */
      sx_batch_destroy(b[i]);
      b[i] = NULL;
      for (size_t k = 0; k < m[i].n; k++)
        bad[m[i].block[k] / 8] |= (uint8_t)(1u << (m[i].block[k] % 8));
      if (res.error == 0) {
        res.error = src;
        snprintf(res.message, sizeof(res.message), "%.60s: %.190s", rd[i]->name, sx_errmsg());
      }
      res.state = SX_BATCH_FAILED;
    }
  }
  for (uint32_t i = 0; i < g->n && rc == 0; i++) {
    if (b[i] == NULL)
      continue;
    sx_batch_result r;
    /* Each batch ends by its own deadline (the same for all), so this
     * wait is bounded. */
    sx_batch_wait(b[i], -1);
    sx_batch_result_get(b[i], &r);
    res.members++;
    res.bytes += r.bytes;
    res.n_ranges += r.n_ranges;
    if (r.state != SX_BATCH_COMPLETED) {
      if (state_rank(r.state) > state_rank(res.state))
        res.state = r.state;
      if (res.error == 0) {
        res.error = r.error;
        snprintf(res.message, sizeof(res.message), "%.60s: %.190s", rd[i]->name, r.message);
      }
      /* Entries are numbered from 0 in the order added (one add call). */
      for (uint32_t k = 0; k < r.n_failed; k++)
        if (r.failed[k] < m[i].n)
          bad[m[i].block[r.failed[k]] / 8] |= (uint8_t)(1u << (m[i].block[r.failed[k]] % 8));
      if (r.n_failed == 0) /* no list (no memory for it): all of its blocks */
        for (size_t k = 0; k < m[i].n; k++)
          bad[m[i].block[k] / 8] |= (uint8_t)(1u << (m[i].block[k] % 8));
    }
  }
  res.transfer_ns = sx__mono_ns() - t0;
  for (uint32_t i = 0; i < g->n; i++) {
    sx_batch_destroy(b[i]);
    free(m[i].r);
    free(m[i].block);
  }
  if (rc == 0) {
    uint32_t nf = 0;
    for (size_t j = 0; j < nl; j++)
      nf += (bad[j / 8] >> (j % 8)) & 1;
    free(g->failed);
    g->failed = NULL;
    if (nf && (g->failed = malloc(nf * sizeof(uint64_t))) == NULL)
      rc = sx__err(SX_ENOMEM, "sx_group_read: listing %u failed blocks", nf);
    for (size_t j = 0, k = 0; j < nl && rc == 0; j++)
      if ((bad[j / 8] >> (j % 8)) & 1)
        g->failed[k++] = lb[j];
    res.n_failed = rc == 0 ? nf : 0;
    res.failed = g->failed;
  }
  free(bad);
  if (rc == 0)
    *out = res;
  return rc;
}
