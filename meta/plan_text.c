/*
 * A read plan in words (sx_plan_text): what `sxctl check` prints, so an
 * operator sees which remote segment each local head comes from and how
 * finely the blocks are cut before any byte moves.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "plan_int.h"

typedef struct text {
  char *buf;
  size_t len, cap;
  int oom;
} text;

static void put(text *t, const char *fmt, ...) SX__PRINTF(2, 3);

static void put(text *t, const char *fmt, ...) {
  va_list ap;
  for (;;) {
    va_start(ap, fmt);
    int n = vsnprintf(t->buf ? t->buf + t->len : NULL, t->buf ? t->cap - t->len : 0, fmt, ap);
    va_end(ap);
    if (n < 0 || t->oom)
      return;
    if (t->buf && (size_t)n < t->cap - t->len) {
      t->len += (size_t)n;
      return;
    }
    size_t cap = t->cap ? t->cap : 256;
    while (cap - t->len <= (size_t)n)
      cap *= 2;
    char *b = realloc(t->buf, cap);
    if (b == NULL) {
      t->oom = 1;
      return;
    }
    t->buf = b;
    t->cap = cap;
  }
}

static void slots_words(text *t, uint64_t slots) {
  char s[16];
  int first = 1, n = 0;
  for (uint64_t m = slots; m; m &= m - 1)
    n++;
  if (n > 8) {
    put(t, "%d slots", n);
    return;
  }
  for (uint64_t m = slots; m; m &= m - 1, first = 0)
    put(t, "%s%s", first ? "" : ",", sx_slot_name((uint32_t)__builtin_ctzll(m), s));
}

static void heads_words(text *t, uint32_t a, uint32_t b) {
  if (b - a == 1)
    put(t, "head %u", a);
  else
    put(t, "heads %u-%u", a, b - 1);
}

/* One group read from one member: the heads, the ratio, the pieces. */
static void member_words(text *t, const sx_plan *p, const sx__pgroup *g, uint32_t gi,
                         uint32_t m) {
  const sx_block_desc *rb = &p->rdesc[(size_t)gi * p->n_members + m];
  const sx_block_desc *lb = &g->ldesc;
  uint32_t lo = UINT32_MAX, hi = 0, pieces = 0;
  uint64_t minp = UINT64_MAX, maxp = 0;
  for (uint32_t q = 0; q < g->n; q++) {
    const sx__piece *pc = &p->pieces[g->first + q];
    if (pc->member != m)
      continue;
    pieces++;
    minp = pc->len < minp ? pc->len : minp;
    maxp = pc->len > maxp ? pc->len : maxp;
  }
  if (pieces == 0)
    return;
  /* The heads this member gives: those of its range inside the local one
   * (replicas give all or nothing of it). */
  lo = rb->head_first > lb->head_first ? rb->head_first : lb->head_first;
  hi = rb->head_first + rb->head_count < lb->head_first + lb->head_count
           ? rb->head_first + rb->head_count : lb->head_first + lb->head_count;
  put(t, "  reads ");
  if (lb->order == SX_KV_MLA)
    put(t, "all of");
  else if (lo == rb->head_first && hi == rb->head_first + rb->head_count)
    heads_words(t, lo, hi), put(t, " (all it holds) of");
  else
    heads_words(t, lo, hi), put(t, " of");
  put(t, " each block of %s", p->names[m]);
  if (g->kr > 1)
    put(t, ", %u local blocks per remote block of %u tokens", g->kr, rb->tokens);
  else if (g->kl > 1)
    put(t, ", %u remote blocks of %u tokens per local block", g->kl, rb->tokens);
  put(t, ": %u piece%s of ", pieces, pieces == 1 ? "" : "s");
  if (minp == maxp)
    put(t, "%lu B", (unsigned long)minp);
  else
    put(t, "%lu-%lu B", (unsigned long)minp, (unsigned long)maxp);
  put(t, " per %u tokens (%s into %s)\n", g->unit, sx_kv_order_name(rb->order),
      sx_kv_order_name(lb->order));
}

int sx_plan_text(const sx_plan *p, char **out) {
  if (p == NULL || out == NULL)
    return sx__err(SX_EINVAL, "sx_plan_text: NULL argument");
  text t = {0};
  for (uint32_t gi = 0; gi < p->n_groups; gi++) {
    const sx__pgroup *g = &p->groups[gi];
    uint32_t lf = UINT32_MAX, le = 0;
    for (uint32_t k = 0; k < p->n_keys; k++)
      if (p->keys[k].pg == gi) {
        lf = p->keys[k].layer_first < lf ? p->keys[k].layer_first : lf;
        le = p->keys[k].layer_first + p->keys[k].layer_count > le
                 ? p->keys[k].layer_first + p->keys[k].layer_count : le;
      }
    put(&t, "group %u (", g->group);
    slots_words(&t, g->slots);
    if (lf < le)
      put(&t, ", layers %u-%u", lf, le - 1);
    else
      put(&t, ", no local region");
    if (g->whole) {
      put(&t, "): whole blocks of %s, block for block\n", p->names[0]);
      continue;
    }
    const sx_block_desc *lb = &g->ldesc;
    put(&t, "): local blocks of %u tokens, ", lb->tokens);
    if (lb->order == SX_KV_MLA)
      put(&t, "MLA");
    else
      heads_words(&t, lb->head_first, lb->head_first + lb->head_count),
          put(&t, " of %u, %s", lb->heads_total, sx_kv_order_name(lb->order));
    put(&t, "\n");
    for (uint32_t m = 0; m < p->n_members; m++)
      member_words(&t, p, g, gi, m);
  }
  if (t.buf == NULL && !t.oom)
    put(&t, "%s", "");
  if (t.oom) {
    free(t.buf);
    return sx__err(SX_ENOMEM, "sx_plan_text");
  }
  *out = t.buf;
  return 0;
}
