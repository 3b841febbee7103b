/*
 * Segment sets (segxfer/group.h): open the members of a set, plan them
 * against this agent's layout once, and read a request's blocks from all of
 * them as one read.
 *
 * A read checks the request against the plan first (sx__plan_check: every
 * block id and key, so a bad request is refused before any byte moves),
 * then expands the plan (meta/plan.c) member by member into that member's
 * batch, so each member's ranges go through the batch path: checked against
 * both sides again, merged where contiguous, sliced, posted on that
 * member's transport.  A member's batch is submitted as soon as it is
 * filled, and the next member is planned while its copies run.  Every
 * batch ends by the same deadline and the read waits for all of them; a
 * member that fails (its batch could not be made or filled, its process
 * restarted: SX_ESTALE, a reset connection) fails its own entries, which
 * map back to the local blocks they were filling.
 */
#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent_int.h"
#include "plan_int.h"
#include "push_int.h"
#include "segxfer/group.h"
#include "segxfer/store.h"

/*
 * What one member gives, collected from the expansion: pieces (remote
 * region and offset, local address, length; the local block each fills
 * in mlist.blk), and the same pieces grouped into spans that are contiguous on the remote
 * side.  A token-major cache split by heads cuts a piece per token, while
 * the remote rank's blocks are whole: over TCP into host memory each span
 * is one request whose reply the reader receives straight into the pieces
 * (a scattered range, sx_xfer.iov), which costs neither a request per
 * piece nor a copy.  RDMA and device memory read the pieces as ranges.
 */
typedef struct piece {
  const sx_region *R; /* in the member's descriptor, which its index holds */
  uint32_t lregion;
  uint64_t roff, laddr, len;
} piece;

typedef struct span {
  uint32_t region, lregion; /* remote, and local (the pieces' one) */
  uint64_t roff, len;
  uint32_t first, n; /* its pieces */
} span;

typedef struct mlist {
  piece *p; /* collected (not when fed straight into the batch) */
  size_t np, capp;
  /* The local block (its index in the request) of each piece, collected
   * or fed: np of them. */
  uint32_t *blk;
  size_t capb;
  span *s;
  size_t ns, caps;
  struct iovec *iov; /* scattered: the spans' pieces, local runs merged */
  size_t capv;
  int spans;   /* spans are collected: scattered ranges are possible */
  int scatter;
} mlist;

struct sx_group {
  sx_agent *a;
  uint32_t n;
  sx_segment **segs;
  sx_plan *plan;
  uint64_t *failed;
  /* Per member, what a read expands to, kept from read to read: arrays
   * grown afresh would be page-faulted in on every read. */
  mlist *m;
  /* The snapshot of this agent's layout and regions that reads expand
   * against, kept while the registrations it was taken under stand: the
   * same table (held, so its address is never reused by a later one) with
   * as many regions withdrawn.  Any registration, withdrawal or
   * unregistration since makes the next read take a new one. */
  sx__ltable *lt;
  uint32_t lt_withdrawn;
  sx_desc local;
  int host; /* every local region is host memory */
};

static void mlist_free(mlist *l) {
  free(l->blk);
  free(l->p);
  free(l->s);
  free(l->iov);
}

static void group_free(sx_group *g) {
  for (uint32_t i = 0; g->m && i < g->n; i++)
    mlist_free(&g->m[i]);
  if (g->lt != NULL) {
    sx_desc_free(&g->local);
    sx__ltable_put(g->lt);
  }
  free(g->m);
  free(g->segs);
  free(g->failed);
  free(g);
}

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
  group_free(g);
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

/* The live segment names matching pattern, sorted (the store lists them
 * so), into names[] (owned by the caller: free each). */
static int match_names(sx_agent *a, const char *pattern, char **names, uint32_t *n) {
  sx_store *s;
  sx_store_entry *e = NULL;
  size_t ne = 0;
  int rc = sx_store_open(a->url, &s);
  if (rc)
    return sx__errwrap(rc, "sx_group_open: listing segments for '%s'", pattern);
  rc = sx_store_list(s, &e, &ne);
  sx_store_close(s);
  if (rc)
    return sx__errwrap(rc, "sx_group_open: listing segments for '%s'", pattern);
  uint32_t k = 0;
  for (size_t i = 0; i < ne && rc == 0; i++) {
    if (e[i].status != 0 || fnmatch(pattern, e[i].name, 0) != 0)
      continue;
    if (k == SX_PLAN_MAX_MEMBERS)
      rc = sx__err(SX_ELIMIT, "sx_group_open: more than %d segments match '%s'",
                   SX_PLAN_MAX_MEMBERS, pattern);
    else if ((names[k++] = strdup(e[i].name)) == NULL)
      rc = sx__err(SX_ENOMEM, "sx_group_open");
  }
  sx_store_entries_free(e, ne);
  if (rc == 0 && k == 0)
    rc = sx__err(SX_ENOENT, "sx_group_open: no live segment matches '%s'", pattern);
  *n = k;
  return rc;
}

int sx_group_open(sx_agent *a, const sx_group_params *p, sx_group **out,
                  sx_mismatch *mismatch) {
  if (a == NULL || p == NULL || out == NULL)
    return sx__err(SX_EINVAL, "sx_group_open: NULL argument");
  if (sx__on_loop(a))
    return sx__err(SX_EBUSY, "sx_group_open waits: not from the agent thread (a callback)");
  if (p->names == NULL && p->engine == NULL && p->pattern != NULL) {
    char *found[SX_PLAN_MAX_MEMBERS] = {0};
    uint32_t nf = 0;
    int rc = match_names(a, p->pattern, found, &nf);
    if (rc == 0) {
      sx_group_params q = *p;
      q.names = (const char *const *)found;
      q.n_names = nf;
      q.pattern = NULL;
      rc = sx_group_open(a, &q, out, mismatch);
    }
    for (uint32_t i = 0; i < SX_PLAN_MAX_MEMBERS; i++)
      free(found[i]);
    return rc;
  }
  uint32_t n = p->names ? p->n_names : p->tp_size;
  if (n == 0 || n > SX_PLAN_MAX_MEMBERS || (p->names == NULL && p->engine == NULL))
    return sx__err(SX_EINVAL, "sx_group_open: give 1..%d names, an engine and its "
                   "tp_size, or a pattern", SX_PLAN_MAX_MEMBERS);
  if (mismatch != NULL)
    memset(mismatch, 0, sizeof(*mismatch));
  sx_group *g = calloc(1, sizeof(*g));
  if (g == NULL || (g->segs = calloc(n, sizeof(*g->segs))) == NULL ||
      (g->m = calloc(n, sizeof(*g->m))) == NULL) {
    if (g)
      free(g->segs);
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

/* Room for `need` items in *v. */
static int grow(void **v, size_t *cap, size_t need, size_t size) {
  if (need <= *cap)
    return 0;
  size_t c = *cap ? *cap : 256;
  while (c < need)
    c *= 2;
  void *nv = realloc(*v, c * size);
  if (nv == NULL)
    return sx__err(SX_ENOMEM, "expanding a plan");
  *v = nv;
  *cap = c;
  return 0;
}

static int collect_range(mlist *l, const sx_region *R, uint32_t lid, uint32_t block,
                         uint64_t roff, uint64_t laddr, uint64_t len) {
  l->p[l->np] = (piece){R, lid, roff, laddr, len};
  l->blk[l->np] = block;
  if (!l->spans) {
    l->np++;
    return 0;
  }
  span *last = l->ns ? &l->s[l->ns - 1] : NULL;
  /* A span lands in one local region, and is at most a slice long so that
   * a long one still spreads over the connections. */
  if (last && last->region == R->id && last->roff + last->len == roff &&
      last->lregion == lid && last->len + len <= SX__PLAN_SLICE) {
    last->len += len;
    last->n++;
  } else {
    if (grow((void **)&l->s, &l->caps, l->ns + 1, sizeof(span)))
      return SX_ENOMEM;
    l->s[l->ns++] = (span){R->id, lid, roff, len, (uint32_t)l->np, 1};
  }
  l->np++;
  return 0;
}

/* Collected piece by piece (a strided range's pieces each). */
static int collect_run(void *arg, const sx__prun *run) {
  mlist *l = &((mlist *)arg)[run->member];
  size_t need = l->np + (size_t)run->n * run->count;
  if (grow((void **)&l->p, &l->capp, need, sizeof(piece)) ||
      grow((void **)&l->blk, &l->capb, need, sizeof(*l->blk)))
    return SX_ENOMEM;
  for (uint32_t k = 0; k < run->n; k++)
    for (uint32_t i = 0; i < run->count; i++)
      if (collect_range(l, run->R, run->L->id, run->block[k], run->roff[k] + i * run->rstride,
                        run->laddr[k] + i * run->lstride, run->len[k]))
        return SX_ENOMEM;
  return 0;
}

/* Are all of the agent's local regions host memory? */
static int local_on_host(const sx_desc *local) {
  for (uint32_t i = 0; i < local->n_regions; i++)
    if (strcmp(local->regions[i].location, "cpu") != 0)
      return 0;
  return 1;
}

/*
 * Feeding one member's pieces straight into its batch, as the expansion
 * makes them: an entry per piece (or per strided range: a member's token
 * pieces of one unit), numbered in order, with only the local block kept
 * (l->blk[k], to report entry k).  The expansion checked
 * every block id and key, and the remote regions it names are those of
 * the segment's own index; so what the public range path does per range
 * (two region searches on each side, a list built and copied) is left to
 * what cannot have been checked yet: the local region, found by id in the
 * batch's own snapshot of the registrations (a region unregistered since
 * the read began is refused), the bounds, and the remote region's access
 * (sx__plan_add_run, once per run of one remote and one local region).
 * After a failure the expansion runs on, keeping blocks only, so that the
 * member's failure names all of its own.
 */
typedef struct feed {
  mlist *l;
  sx__plan *plan;
  sx__pbatch *note;   /* a notifying read's notice: entries noted as fed */
  const sx_region *L; /* the batch's registration of local region lid */
  uint32_t lid;
  int rc;
} feed;

/* f->L: the batch's local region lid, or the error (said). */
static int feed_local(feed *f, uint32_t lid) {
  if (f->L != NULL && f->lid == lid)
    return 0;
  f->L = sx__rindex_id(f->plan->local, lid);
  f->lid = lid;
  if (f->L == NULL ||
      __atomic_load_n(&((const sx_lregion *)f->L)->withdrawn, __ATOMIC_RELAXED)) {
    f->L = NULL;
    return sx__err(SX_ENOREGION, "local region %u was unregistered", lid);
  }
  return 0;
}

/* Entries of one remote region R into local region lid. */
static int feed_ranges(feed *f, const sx_region *R, uint32_t lid, const uint64_t *roff,
                       const uint64_t *laddr, const uint64_t *len, uint32_t n) {
  int rc = feed_local(f, lid);
  const sx_lregion *L = (const sx_lregion *)f->L;
  if (rc == 0)
    rc = f->note ? sx__pbatch_add_run(f->note, f->plan, R, L, roff, laddr, len, n)
                 : sx__plan_add_run(f->plan, R, L, roff, laddr, len, n);
  return rc;
}

/* A strided run: each range an entry of its own, one strided xfer where
 * the transport takes them (sx__plan_add_strided cuts it into its pieces
 * where not). */
static int feed_strided(feed *f, const sx__prun *run) {
  int rc = feed_local(f, run->L->id);
  const sx_lregion *L = (const sx_lregion *)f->L;
  for (uint32_t k = 0; k < run->n && rc == 0; k++)
    rc = f->note ? sx__pbatch_add_strided(f->note, f->plan, run->R, L, run->roff[k],
                                          run->rstride, run->laddr[k], run->lstride,
                                          run->len[k], run->count)
                 : sx__plan_add_strided(f->plan, run->R, L, run->roff[k], run->rstride,
                                        (uint8_t *)(uintptr_t)run->laddr[k], run->lstride,
                                        run->len[k], run->count);
  return rc;
}

static int feed_run(void *arg, const sx__prun *run) {
  feed *f = arg;
  mlist *l = f->l;
  if (grow((void **)&l->blk, &l->capb, l->np + run->n, sizeof(*l->blk)))
    return SX_ENOMEM;
  memcpy(l->blk + l->np, run->block, run->n * sizeof(*l->blk));
  l->np += run->n;
  if (f->rc == 0)
    f->rc = run->count > 1
                ? feed_strided(f, run)
                : feed_ranges(f, run->R, run->L->id, run->roff, run->laddr, run->len, run->n);
  return 0;
}

/* The batch entries of member l: a scattered range per span, or a range
 * per piece. */
static int add_entries(sx_batch *b, sx_segment *seg, mlist *l) {
  if (l->scatter) {
    if (l->capv < l->np) {
      free(l->iov);
      l->capv = 0;
      if ((l->iov = malloc(l->np * sizeof(*l->iov))) == NULL)
        return sx__err(SX_ENOMEM, "sx_group_read");
      l->capv = l->np;
    }
    size_t k = 0;
    int rc = 0;
    for (size_t i = 0; i < l->ns && rc == 0; i++) {
      const span *sp = &l->s[i];
      size_t first = k;
      for (uint32_t q = 0; q < sp->n; q++) {
        const piece *pc = &l->p[sp->first + q];
        uint8_t *at = (uint8_t *)(uintptr_t)pc->laddr;
        if (k > first && (uint8_t *)l->iov[k - 1].iov_base + l->iov[k - 1].iov_len == at)
          l->iov[k - 1].iov_len += pc->len;
        else
          l->iov[k++] = (struct iovec){at, pc->len};
      }
      const sx_region *R = sx__rindex_id(&seg->ix, sp->region);
      rc = R ? sx__batch_add_scatter(b, R, sp->roff, l->iov + first, (uint32_t)(k - first))
             : sx__err(SX_ENOREGION, "no remote region %u", sp->region);
    }
    return rc;
  }
  /* Collected for a scattered read that did not pay: fed as above. */
  feed f = {.l = l};
  int rc = sx__batch_entries(b, 0, "sx_group_read", &f.plan, &f.note);
  for (size_t i = 0; i < l->np && rc == 0; i++)
    rc = feed_ranges(&f, l->p[i].R, l->p[i].lregion, &l->p[i].roff, &l->p[i].laddr,
                     &l->p[i].len, 1);
  return rc;
}

static void mark(uint8_t *bad, uint32_t block) {
  bad[block / 8] |= (uint8_t)(1u << (block % 8));
}

/* Mark the blocks of entry e of member l. */
static void mark_entry(uint8_t *bad, const mlist *l, uint32_t e) {
  if (!l->scatter) {
    if (e < l->np)
      mark(bad, l->blk[e]);
    return;
  }
  if (e < l->ns)
    for (uint32_t k = 0; k < l->s[e].n; k++)
      mark(bad, l->blk[l->s[e].first + k]);
}

static int state_rank(sx_batch_state s) {
  /* The read's state is its worst member's: a timeout says more than a
   * cancel, a failure more than a timeout. */
  return s == SX_BATCH_FAILED ? 3 : s == SX_BATCH_TIMEOUT ? 2 : s == SX_BATCH_CANCELLED ? 1 : 0;
}

static uint32_t withdrawn_count(const sx__ltable *t) {
  uint32_t n = 0;
  for (uint32_t i = 0; i < t->n; i++)
    n += __atomic_load_n(&t->v[i]->withdrawn, __ATOMIC_RELAXED) != 0;
  return n;
}

/*
 * g->local up to date with the agent's registrations.  The table is taken
 * before the snapshot, so the snapshot is of that table or of a later one:
 * it never holds a region that its key's table lacks, and a table, once
 * replaced, never comes back.  So a region unregistered (or withdrawn)
 * since the last read is never written through an old address.
 */
static int group_local(sx_group *g) {
  sx__ltable *t = sx__ltable_get(g->a);
  uint32_t w = withdrawn_count(t);
  if (t == g->lt && w == g->lt_withdrawn) {
    sx__ltable_put(t);
    return 0;
  }
  sx_desc d;
  int rc = sx__layout_desc(g->a, &d);
  if (rc) {
    sx__ltable_put(t);
    return rc;
  }
  if (g->lt != NULL) {
    sx_desc_free(&g->local);
    sx__ltable_put(g->lt);
  }
  g->local = d;
  g->lt = t;
  g->lt_withdrawn = w;
  g->host = local_on_host(&d);
  return 0;
}

/* The state of one read while its members run. */
typedef struct gread {
  sx_group *g;
  const sx_desc *rd[SX_PLAN_MAX_MEMBERS];
  const uint64_t *rb, *lb;
  size_t nr, nl;
  sx_batch_params bp;
  uint64_t deadline_ms;
  uint8_t *bad;
  sx_batch *b[SX_PLAN_MAX_MEMBERS];
  uint32_t started; /* batches submitted */
  sx_group_result res;
} gread;

/* Member i's pieces and batch.  Returns 0 (its batch, if it has pieces,
 * is in r->b[i], not submitted) or the error (said); *emitted tells
 * whether its pieces were all collected. */
static int member_fill(gread *r, uint32_t i, int *emitted) {
  sx_group *g = r->g;
  mlist *l = &g->m[i];
  l->np = l->ns = 0;
  l->scatter = 0;
  /* Only TCP into host memory reads scattered ranges. */
  l->spans = g->host && sx_segment_transport(g->segs[i]) == SX_TRANSPORT_TCP;
  *emitted = 0;
  /* One deadline for the read: each batch gets what is left of it. */
  uint64_t now = sx__mono_ms();
  sx_batch_params bp = r->bp;
  bp.timeout_ms = now < r->deadline_ms ? (uint32_t)(r->deadline_ms - now) : 1;
  sx_batch *b = NULL;
  /* Fed as expanded, unless the pieces may become scattered ranges. */
  feed f = {.l = l};
  int fed = !l->spans;
  int rc = fed ? sx_batch_create(g->segs[i], &bp, &b) : 0;
  if (rc == 0 && fed)
    rc = sx__batch_entries(b, 0, "sx_group_read", &f.plan, &f.note);
  if (rc == 0) {
    rc = sx__plan_emit(g->plan, &g->local, r->rd, g->n, r->rb, r->nr, r->lb, r->nl,
                       1ull << i, fed ? feed_run : collect_run, fed ? (void *)&f
                                                                    : (void *)g->m);
    if (rc == SX_ENOMEM)
      rc = sx__err(SX_ENOMEM, "expanding the plan");
    *emitted = rc == 0;
    if (rc == 0)
      rc = f.rc;
  }
  if (rc == 0 && l->np > 0 && !fed) {
    /* Scatter where it saves at least half of the requests (else the
     * planner's merging of the ranges does as well). */
    l->scatter = l->spans && l->ns * 2 <= l->np;
    if ((rc = sx_batch_create(g->segs[i], &bp, &b)) == 0)
      rc = add_entries(b, g->segs[i], l);
  }
  if (rc || l->np == 0) {
    sx_batch_destroy(b);
    return rc;
  }
  r->b[i] = b;
  return 0;
}

/* Note member i's failure with err and msg as the read's first error if
 * it is. */
static void member_error(gread *r, uint32_t i, sx_batch_state st, int err, const char *msg) {
  if (state_rank(st) > state_rank(r->res.state))
    r->res.state = st;
  if (r->res.error == 0) {
    r->res.error = err;
    snprintf(r->res.message, sizeof(r->res.message), "%.60s: %.190s", r->rd[i]->name, msg);
  }
}

/* Member i did not start: its blocks fail, or every block where its
 * pieces were not all known. */
static void member_not_started(gread *r, uint32_t i, int rc, int emitted) {
  const mlist *l = &r->g->m[i];
  member_error(r, i, SX_BATCH_FAILED, rc, sx_errmsg());
  if (!emitted) {
    for (size_t j = 0; j < r->nl; j++)
      mark(r->bad, (uint32_t)j);
    return;
  }
  for (size_t k = 0; k < l->np; k++)
    mark(r->bad, l->blk[k]);
}

/* Submit member i's batch; one that does not start fails its blocks. */
static void member_submit(gread *r, uint32_t i) {
  int rc = sx_batch_submit(r->b[i]);
  if (rc == 0) {
    r->started++;
    return;
  }
  sx_batch_destroy(r->b[i]);
  r->b[i] = NULL;
  member_not_started(r, i, rc, 1);
}

/* Wait for member i's batch and take its result. */
static void member_end(gread *r, uint32_t i) {
  const mlist *l = &r->g->m[i];
  sx_batch_result br;
  /* Each batch ends by the read's deadline, so this wait is bounded. */
  sx_batch_wait(r->b[i], -1);
  sx_batch_result_get(r->b[i], &br);
  r->res.members++;
  r->res.bytes += br.bytes;
  r->res.n_ranges += br.n_ranges;
  if (br.state == SX_BATCH_COMPLETED)
    return;
  member_error(r, i, br.state, br.error, br.message);
  /* Entries are numbered from 0 in the order added (one add call). */
  for (uint32_t k = 0; k < br.n_failed; k++)
    mark_entry(r->bad, l, br.failed[k]);
  if (br.n_failed == 0) /* no list (no memory for it): all of its blocks */
    for (size_t k = 0; k < l->np; k++)
      mark(r->bad, l->blk[k]);
}

/* The failed blocks, by local id in the order given, into g->failed. */
static int list_failed(sx_group *g, const uint8_t *bad, const uint64_t *lb, size_t nl,
                       sx_group_result *res) {
  uint32_t nf = 0;
  for (size_t j = 0; j < nl; j++)
    nf += (bad[j / 8] >> (j % 8)) & 1;
  free(g->failed);
  g->failed = NULL;
  if (nf && (g->failed = malloc(nf * sizeof(uint64_t))) == NULL)
    return sx__err(SX_ENOMEM, "sx_group_read: listing %u failed blocks", nf);
  for (size_t j = 0, k = 0; j < nl; j++)
    if ((bad[j / 8] >> (j % 8)) & 1)
      g->failed[k++] = lb[j];
  res->n_failed = nf;
  res->failed = g->failed;
  return 0;
}

/*
 * Everything a request can be refused for is checked first, against the
 * local snapshot and every member: its block ids and keys.  Then member by
 * member: its pieces, its batch, submitted at once, so that the first
 * member's copies run while the next is planned.  A member whose batch
 * cannot be made, filled or submitted fails only its own blocks; those
 * already started run on to the one deadline.
 */
static int group_read(sx_group *g, const uint64_t *rb, size_t nr, const uint64_t *lb,
                      size_t nl, uint32_t timeout_ms, int notify, uint64_t tag,
                      sx_group_result *out) {
  if (g == NULL || out == NULL || (nr && rb == NULL) || (nl && lb == NULL))
    return sx__err(SX_EINVAL, "sx_group_read: NULL argument");
  if (nl > UINT32_MAX)
    return sx__err(SX_ELIMIT, "sx_group_read: %zu local blocks", nl);
  /* It waits for its batches, which the agent thread ends. */
  if (sx__on_loop(g->a))
    return sx__err(SX_EBUSY, "sx_group_read waits: not from the agent thread (a callback)");
  gread r = {.g = g, .rb = rb, .lb = lb, .nr = nr, .nl = nl};
  for (uint32_t i = 0; i < g->n; i++)
    r.rd[i] = sx_segment_desc(g->segs[i]);
  /* The local snapshot has every region the plan's keys name, or the
   * check refuses: a region unregistered since the open is never written
   * through an old address. */
  int rc = group_local(g);
  if (rc == 0)
    rc = sx__plan_check(g->plan, &g->local, r.rd, g->n, rb, nr, lb, nl);
  if (rc)
    return rc;
  if ((r.bad = calloc(nl / 8 + 1, 1)) == NULL)
    return sx__err(SX_ENOMEM, "sx_group_read");
  sx_batch_params_init(&r.bp);
  if (timeout_ms)
    r.bp.timeout_ms = timeout_ms;
  if (notify) {
    r.bp.flags |= SX_BATCH_NOTIFY;
    r.bp.tag = tag;
  }
  r.deadline_ms = sx__mono_ms() + r.bp.timeout_ms;
  r.res.state = SX_BATCH_COMPLETED;
  uint64_t t0 = sx__mono_ns();
  /* A notifying read fills every member before any starts, so that a
   * notice that would list too many ranges (SX_ELIMIT) is still refused
   * before any byte moves. */
  int hold = notify;
  for (uint32_t i = 0; i < g->n; i++) {
    int emitted;
    if ((rc = member_fill(&r, i, &emitted)) != 0) {
      if (r.started == 0) {
        /* Nothing moved yet: the read is refused, as a bad request is. */
        for (uint32_t k = 0; k < g->n; k++)
          sx_batch_destroy(r.b[k]);
        free(r.bad);
        return sx__errwrap(rc, "%s", r.rd[i]->name);
      }
      member_not_started(&r, i, rc, emitted);
    } else if (r.b[i] != NULL && !hold) {
      member_submit(&r, i);
    }
  }
  for (uint32_t i = 0; hold && i < g->n; i++)
    if (r.b[i] != NULL)
      member_submit(&r, i);
  for (uint32_t i = 0; i < g->n; i++)
    if (r.b[i] != NULL)
      member_end(&r, i);
  r.res.transfer_ns = sx__mono_ns() - t0;
  for (uint32_t i = 0; i < g->n; i++)
    sx_batch_destroy(r.b[i]);
  rc = list_failed(g, r.bad, lb, nl, &r.res);
  free(r.bad);
  if (rc == 0)
    *out = r.res;
  return rc;
}

int sx_group_read(sx_group *g, const uint64_t *rb, size_t nr, const uint64_t *lb, size_t nl,
                  uint32_t timeout_ms, sx_group_result *out) {
  return group_read(g, rb, nr, lb, nl, timeout_ms, 0, 0, out);
}

int sx_group_read_notify(sx_group *g, const uint64_t *rb, size_t nr, const uint64_t *lb,
                         size_t nl, uint32_t timeout_ms, uint64_t notify_tag,
                         sx_group_result *out) {
  return group_read(g, rb, nr, lb, nl, timeout_ms, 1, notify_tag, out);
}
