/*
 * The compatibility check: may a reader with layout `local` read blocks from
 * a segment described by `remote`?  Both sides' regions are turned into runs
 * of (group, slot, layers) keys, sorted, and swept together, so the cost is
 * O(R log R) in regions whatever the number of layers they span, and the
 * first difference reported is the lowest key that differs.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "segxfer/layout.h"

const char *sx_mismatch_kind_name(sx_mismatch_kind k) {
  switch (k) {
  case SX_MISMATCH_NONE:
    return "none";
  case SX_MISMATCH_FINGERPRINT:
    return "fingerprint";
  case SX_MISMATCH_LAYOUT_TAG:
    return "layout_tag";
  case SX_MISMATCH_DTYPE:
    return "dtype";
  case SX_MISMATCH_MISSING_KEY:
    return "missing_key";
  case SX_MISMATCH_EXTRA_KEY:
    return "extra_key";
  case SX_MISMATCH_BLOCK_BYTES:
    return "block_bytes";
  case SX_MISMATCH_BLOCK_DESC:
    return "block_desc";
  case SX_MISMATCH_HEADS_TOTAL:
    return "heads_total";
  case SX_MISMATCH_HEAD_DIM:
    return "head_dim";
  case SX_MISMATCH_BLOCK_TOKENS:
    return "block_tokens";
  case SX_MISMATCH_ORDER:
    return "order";
  case SX_MISMATCH_HEADS_MISSING:
    return "heads_missing";
  case SX_MISMATCH_HEADS_OVERLAP:
    return "heads_overlap";
  case SX_MISMATCH_TP:
    return "tp";
  }
  return "unknown";
}

typedef struct run {
  uint32_t group, slot;
  uint64_t first, end; /* layers [first, end) */
  uint64_t block_bytes;
} run;

static int run_cmp(const void *a, const void *b) {
  const run *x = a, *y = b;
  if (x->group != y->group)
    return x->group < y->group ? -1 : 1;
  if (x->slot != y->slot)
    return x->slot < y->slot ? -1 : 1;
  return x->first < y->first ? -1 : x->first > y->first;
}

static run *make_runs(const sx_desc *d) {
  run *r = malloc((d->n_regions ? d->n_regions : 1) * sizeof(*r));
  if (r == NULL)
    return NULL;
  for (uint32_t i = 0; i < d->n_regions; i++) {
    const sx_region *g = &d->regions[i];
    r[i] = (run){g->group, g->slot, g->layer_first,
                 (uint64_t)g->layer_first + g->layer_count, g->block_bytes};
  }
  qsort(r, d->n_regions, sizeof(*r), run_cmp);
  return r;
}

/* Order of the (group, slot) of two runs. */
static int gs_cmp(const run *a, const run *b) {
  if (a->group != b->group)
    return a->group < b->group ? -1 : 1;
  return a->slot < b->slot ? -1 : a->slot > b->slot;
}

static int fail(sx_mismatch *m, sx_mismatch_kind kind, const char *field,
                const char *local, const char *remote) {
  if (m != NULL) {
    m->kind = kind;
    m->field = field;
    snprintf(m->local, sizeof(m->local), "%s", local);
    snprintf(m->remote, sizeof(m->remote), "%s", remote);
    snprintf(m->message, sizeof(m->message), "%s differs: local '%s', remote '%s'",
             field, local, remote);
    return sx__err(SX_EINCOMPAT, "%s", m->message);
  }
  return sx__err(SX_EINCOMPAT, "%s differs: local '%s', remote '%s'", field, local,
                 remote);
}

static int fail_key(sx_mismatch *m, sx_mismatch_kind kind, uint32_t group,
                    uint64_t layer, uint32_t slot, uint64_t lv, uint64_t rv) {
  sx_mismatch tmp;
  char s[16], msg[sizeof(tmp.message)];
  if (m == NULL)
    m = &tmp;
  memset(m, 0, sizeof(*m));
  m->kind = kind;
  m->group = group;
  m->layer = (uint32_t)layer;
  m->slot = slot;
  sx_slot_name(slot, s);
  if (kind == SX_MISMATCH_BLOCK_BYTES) {
    m->field = "block_bytes";
    snprintf(m->local, sizeof(m->local), "%lu", (unsigned long)lv);
    snprintf(m->remote, sizeof(m->remote), "%lu", (unsigned long)rv);
    snprintf(msg, sizeof(msg),
             "block_bytes differs at group %u layer %u slot %s: local %lu, remote %lu",
             group, m->layer, s, (unsigned long)lv, (unsigned long)rv);
  } else {
    int missing = kind == SX_MISMATCH_MISSING_KEY;
    m->field = "key";
    snprintf(m->local, sizeof(m->local), "%s", missing ? "present" : "absent");
    snprintf(m->remote, sizeof(m->remote), "%s", missing ? "absent" : "present");
    snprintf(msg, sizeof(msg), "key group %u layer %u slot %s: %s has it, %s does not",
             group, m->layer, s, missing ? "local" : "remote",
             missing ? "remote" : "local");
  }
  memcpy(m->message, msg, sizeof(msg));
  return sx__err(SX_EINCOMPAT, "%s", msg);
}

static int sweep(const run *a, uint32_t na, const run *b, uint32_t nb,
                 sx_mismatch *m) {
  uint32_t i = 0, j = 0;
  run x = na ? a[0] : (run){0}, y = nb ? b[0] : (run){0};
  while (i < na || j < nb) {
    int c = i == na ? 1 : j == nb ? -1 : gs_cmp(&x, &y);
    if (c == 0)
      c = x.first < y.first ? -1 : x.first > y.first;
    if (c < 0)
      return fail_key(m, SX_MISMATCH_MISSING_KEY, x.group, x.first, x.slot, 0, 0);
    if (c > 0)
      return fail_key(m, SX_MISMATCH_EXTRA_KEY, y.group, y.first, y.slot, 0, 0);
    if (x.block_bytes != y.block_bytes)
      return fail_key(m, SX_MISMATCH_BLOCK_BYTES, x.group, x.first, x.slot,
                      x.block_bytes, y.block_bytes);
    /* Same key, same block size: consume the common layers of both runs. */
    uint64_t end = x.end < y.end ? x.end : y.end;
    x.first = y.first = end;
    if (x.first == x.end && ++i < na)
      x = a[i];
    if (y.first == y.end && ++j < nb)
      y = b[j];
  }
  return 0;
}

int sx_layout_check(const sx_desc *local, const sx_desc *remote, unsigned flags,
                    sx_mismatch *mismatch) {
  if (local == NULL || remote == NULL)
    return sx__err(SX_EINVAL, "sx_layout_check: NULL descriptor");
  if (mismatch != NULL)
    memset(mismatch, 0, sizeof(*mismatch));
  const sx_layout *l = &local->layout, *r = &remote->layout;
  if (!(flags & SX_CHECK_IGNORE_FINGERPRINT) && strcmp(l->fingerprint, r->fingerprint))
    return fail(mismatch, SX_MISMATCH_FINGERPRINT, "fingerprint", l->fingerprint,
                r->fingerprint);
  if (strcmp(l->tag, r->tag))
    return fail(mismatch, SX_MISMATCH_LAYOUT_TAG, "layout_tag", l->tag, r->tag);
  if (strcmp(l->dtype, r->dtype))
    return fail(mismatch, SX_MISMATCH_DTYPE, "dtype", l->dtype, r->dtype);

  /* Both sides describe a group's blocks and the descriptions differ (other
   * heads, order or block size at equal block_bytes): not equal layouts,
   * whatever the byte counts say.  A plan may still fit them. */
  for (uint32_t i = 0; i < l->n_blocks && i < SX_MAX_BLOCK_DESCS; i++) {
    const sx_block_desc *x = &l->blocks[i], *y = sx__block_desc(r, x->group);
    if (y == NULL || (x->order == y->order && x->tokens == y->tokens &&
                      x->head_first == y->head_first && x->head_count == y->head_count &&
                      x->heads_total == y->heads_total && x->head_dim == y->head_dim &&
                      strcmp(x->dtype, y->dtype) == 0 &&
                      sx__block_slots(x) == sx__block_slots(y)))
      continue;
    char lw[64], rw[64];
    snprintf(lw, sizeof(lw), "%s %ut h%u-%u/%u d%u %s", sx_kv_order_name(x->order), x->tokens,
             x->head_first, x->head_first + x->head_count - 1, x->heads_total, x->head_dim,
             x->dtype);
    snprintf(rw, sizeof(rw), "%s %ut h%u-%u/%u d%u %s", sx_kv_order_name(y->order), y->tokens,
             y->head_first, y->head_first + y->head_count - 1, y->heads_total, y->head_dim,
             y->dtype);
    int rc = fail(mismatch, SX_MISMATCH_BLOCK_DESC, "block_desc", lw, rw);
    if (mismatch != NULL) {
      mismatch->group = x->group;
      snprintf(mismatch->message, sizeof(mismatch->message),
               "group %u blocks differ: local %s, remote %s (tokens, heads of the model, "
               "head_dim, dtype): not equal layouts; a read plan may fit them", x->group, lw,
               rw);
    }
    return rc;
  }
  run *a = make_runs(local), *b = make_runs(remote);
  int rc = (a && b) ? sweep(a, local->n_regions, b, remote->n_regions, mismatch)
                    : sx__err(SX_ENOMEM, "sx_layout_check");
  free(a);
  free(b);
  return rc;
}
