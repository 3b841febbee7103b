/*
 * Write batches (push mode, docs/push.md): write entries are planned by the
 * read planner in write mode (same region pairs, merging and checks, the
 * remote side needing SX_ACCESS_REMOTE_WRITE), and each batch keeps the
 * list its notice will carry, in the consumer's terms, merged as entries
 * are added.  Engines' block-id lists become runs here, with a count
 * mismatch between the two sides refused at planning time.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent_int.h"
#include "notice.h"
#include "push_int.h"

struct sx__pbatch {
  sx_notice_blocks *b;
  uint32_t nb, capb;
  sx_notice_range *r;
  uint32_t nr, capr;
};

sx__pbatch *sx__pbatch_new(void) { return calloc(1, sizeof(sx__pbatch)); }

void sx__pbatch_free(sx__pbatch *pb) {
  if (pb == NULL)
    return;
  free(pb->b);
  free(pb->r);
  free(pb);
}

static int entries_full(const sx__pbatch *pb) {
  return (uint64_t)pb->nb + pb->nr + 1 > SX_NOTICE_MAX_ENTRIES;
}

/* Room for one more entry in a notice list v of either kind (n entries of
 * size bytes, *cap allotted): v, or v grown (and *cap with it); NULL if
 * memory runs out (v stays). */
static void *grow(void *v, uint32_t n, uint32_t *cap, size_t size) {
  if (n < *cap)
    return v;
  uint32_t grown = *cap ? *cap * 2 : 16;
  if ((v = realloc(v, grown * size)) != NULL)
    *cap = grown;
  return v;
}

/* Where both notice lists stood, to undo the additions of a failed add. */
typedef struct pmark {
  uint32_t nb, nr;
  sx_notice_blocks last_b;
  sx_notice_range last_r;
} pmark;

static pmark mark(const sx__pbatch *pb) {
  return (pmark){pb->nb, pb->nr, pb->nb ? pb->b[pb->nb - 1] : (sx_notice_blocks){0},
                 pb->nr ? pb->r[pb->nr - 1] : (sx_notice_range){0}};
}

static void undo(sx__pbatch *pb, const pmark *m) {
  pb->nb = m->nb;
  if (m->nb)
    pb->b[m->nb - 1] = m->last_b;
  pb->nr = m->nr;
  if (m->nr)
    pb->r[m->nr - 1] = m->last_r;
}

/* Append block runs for w (merged with the last run where they continue
 * it).  Undo with a mark taken before. */
static int note_blocks(sx__pbatch *pb, const sx_block_write *w, size_t n) {
  for (size_t i = 0; i < n; i++) {
    sx_notice_blocks *last = pb->nb ? &pb->b[pb->nb - 1] : NULL;
    if (last != NULL && last->group == w[i].group && last->layer_first == w[i].layer_first &&
        last->layer_count == w[i].layer_count && last->slots == w[i].slots &&
        last->block + last->count == w[i].remote_block) {
      last->count += w[i].count;
      continue;
    }
    if (entries_full(pb))
      return SX_ELIMIT;
    sx_notice_blocks *v = grow(pb->b, pb->nb, &pb->capb, sizeof(*v));
    if (v == NULL)
      return SX_ENOMEM;
    pb->b = v;
    pb->b[pb->nb++] = (sx_notice_blocks){.group = w[i].group, .layer_first = w[i].layer_first,
                                         .layer_count = w[i].layer_count, .slots = w[i].slots,
                                         .block = w[i].remote_block, .count = w[i].count};
  }
  return 0;
}

/* One remote range, merged with the last one where it continues it. */
static int note_range(sx__pbatch *pb, uint32_t region, uint64_t offset, uint64_t length) {
  sx_notice_range *last = pb->nr ? &pb->r[pb->nr - 1] : NULL;
  if (last != NULL && last->region == region && last->offset + last->length == offset) {
    last->length += length;
    return 0;
  }
  if (entries_full(pb))
    return SX_ELIMIT;
  sx_notice_range *v = grow(pb->r, pb->nr, &pb->capr, sizeof(*v));
  if (v == NULL)
    return SX_ENOMEM;
  pb->r = v;
  pb->r[pb->nr++] = (sx_notice_range){.region = region, .offset = offset, .length = length};
  return 0;
}

static int note_ranges(sx__pbatch *pb, const sx_range_write *w, size_t n) {
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++)
    rc = note_range(pb, w[i].remote_region, w[i].offset, w[i].length);
  return rc;
}

/* A set read's note failed with rc: said. */
static int group_note_err(int rc) {
  if (rc == SX_ELIMIT)
    return sx__err(SX_ELIMIT, "sx_group_read: the batch's notice would list more than %u "
                   "entries (after merging); split the batch", SX_NOTICE_MAX_ENTRIES);
  return sx__err(rc, "sx_group_read");
}

/* ------------------------------------------------------------ add */

/* w as the planner takes it (read entries; the caller frees them), or NULL
 * if memory runs out. */
static sx_block_read *block_reads(const sx_block_write *w, size_t n) {
  sx_block_read *r = malloc((n ? n : 1) * sizeof(*r));
  for (size_t i = 0; r != NULL && i < n; i++)
    r[i] = (sx_block_read){.group = w[i].group, .layer_first = w[i].layer_first,
                           .layer_count = w[i].layer_count, .slots = w[i].slots,
                           .remote_block = w[i].remote_block,
                           .local_block = w[i].local_block, .count = w[i].count};
  return r;
}

static sx_range_read *range_reads(const sx_range_write *w, size_t n) {
  sx_range_read *r = malloc((n ? n : 1) * sizeof(*r));
  for (size_t i = 0; r != NULL && i < n; i++)
    r[i] = (sx_range_read){.local = (void *)(uintptr_t)w[i].local,
                           .remote_region = w[i].remote_region, .offset = w[i].offset,
                           .length = w[i].length};
  return r;
}

/* Note n entries w (sx_block_write when blocks, else sx_range_write: in
 * the notice's terms) in pb first (that can be undone), then plan r, the
 * same entries as the planner takes them (all or nothing by itself); a
 * failed plan undoes the note. */
static int note_and_plan(sx__pbatch *pb, sx__plan *plan, int blocks, const void *w,
                         const void *r, size_t n, const char *what) {
  pmark m = mark(pb);
  int rc = blocks ? note_blocks(pb, w, n) : note_ranges(pb, w, n);
  if (rc == SX_ELIMIT)
    rc = sx__err(SX_ELIMIT, "%s: the batch's notice would list more than %u entries "
                 "(after merging); split the batch", what, SX_NOTICE_MAX_ENTRIES);
  else if (rc)
    rc = sx__err(rc, "%s", what);
  else
    rc = blocks ? sx__plan_add_blocks(plan, r, n) : sx__plan_add_ranges(plan, r, n);
  if (rc)
    undo(pb, &m);
  return rc;
}

/* Add n write entries w, sx_block_write (blocks) or sx_range_write,
 * planned as reads in write mode. */
static int add_writes(sx_batch *b, int blocks, const void *w, size_t n, const char *what) {
  sx__plan *plan;
  sx__pbatch *pb;
  if (b == NULL || (w == NULL && n > 0))
    return sx__err(SX_EINVAL, "%s: NULL argument", what);
  int rc = sx__batch_entries(b, 1, what, &plan, &pb);
  if (rc)
    return rc;
  void *r = blocks ? (void *)block_reads(w, n) : (void *)range_reads(w, n);
  if (r == NULL)
    return sx__err(SX_ENOMEM, "%s", what);
  rc = note_and_plan(pb, plan, blocks, w, r, n, what);
  free(r);
  return rc;
}

/* ------------------------------------------------------------ read notices */

/* Read entries as the notice lists them (the target's blocks and ranges:
 * the sources of a read are where a write would go).  NULL if memory runs
 * out. */
static sx_block_write *as_block_writes(const sx_block_read *r, size_t n) {
  sx_block_write *w = malloc((n ? n : 1) * sizeof(*w));
  for (size_t i = 0; w != NULL && i < n; i++)
    w[i] = (sx_block_write){.group = r[i].group, .layer_first = r[i].layer_first,
                            .layer_count = r[i].layer_count, .slots = r[i].slots,
                            .local_block = r[i].local_block,
                            .remote_block = r[i].remote_block, .count = r[i].count};
  return w;
}

static sx_range_write *as_range_writes(const sx_range_read *r, size_t n) {
  sx_range_write *w = malloc((n ? n : 1) * sizeof(*w));
  for (size_t i = 0; w != NULL && i < n; i++)
    w[i] = (sx_range_write){.local = r[i].local, .remote_region = r[i].remote_region,
                            .offset = r[i].offset, .length = r[i].length};
  return w;
}

int sx__pbatch_add_reads(sx__pbatch *pb, sx__plan *plan, int blocks, const void *r, size_t n,
                         const char *what) {
  void *w = blocks ? (void *)as_block_writes(r, n) : (void *)as_range_writes(r, n);
  if (w == NULL)
    return sx__err(SX_ENOMEM, "%s", what);
  int rc = note_and_plan(pb, plan, blocks, w, r, n, what);
  free(w);
  return rc;
}

int sx__pbatch_add_scatter(sx__pbatch *pb, sx__plan *plan, const sx_region *R, uint64_t roff,
                           const struct iovec *iov, uint32_t n) {
  /* As a range read of the same remote bytes: the notice names the
   * target's memory, never where the pieces land here. */
  sx_range_write w = {.local = n ? iov[0].iov_base : NULL, .remote_region = R->id,
                      .offset = roff};
  for (uint32_t i = 0; i < n; i++)
    w.length += iov[i].iov_len;
  pmark m = mark(pb);
  int rc = note_ranges(pb, &w, 1);
  rc = rc ? group_note_err(rc) : sx__plan_add_scatter(plan, R, roff, iov, n);
  if (rc)
    undo(pb, &m);
  return rc;
}

int sx__pbatch_add_strided(sx__pbatch *pb, struct sx__plan *plan, const sx_region *R,
                           const sx_lregion *L, uint64_t roff, uint64_t rstride,
                           uint64_t local, uint64_t lstride, uint64_t len, uint32_t count) {
  pmark m = mark(pb);
  int rc = 0;
  for (uint32_t k = 0; k < count && rc == 0; k++)
    rc = note_range(pb, R->id, roff + k * rstride, len);
  rc = rc ? group_note_err(rc)
          : sx__plan_add_strided(plan, R, L, roff, rstride, (uint8_t *)(uintptr_t)local, lstride,
                                 len, count);
  if (rc)
    undo(pb, &m);
  return rc;
}

int sx__pbatch_add_run(sx__pbatch *pb, struct sx__plan *plan, const sx_region *R,
                       const sx_lregion *L, const uint64_t *roff, const uint64_t *local,
                       const uint64_t *len, uint32_t n) {
  pmark m = mark(pb);
  int rc = 0;
  for (uint32_t k = 0; k < n && rc == 0; k++)
    rc = note_range(pb, R->id, roff[k], len[k]);
  rc = rc ? group_note_err(rc) : sx__plan_add_run(plan, R, L, roff, local, len, n);
  if (rc)
    undo(pb, &m);
  return rc;
}

int sx_batch_add_block_writes(sx_batch *b, const sx_block_write *w, size_t n) {
  return add_writes(b, 1, w, n, "sx_batch_add_block_writes");
}

int sx_batch_add_range_writes(sx_batch *b, const sx_range_write *w, size_t n) {
  return add_writes(b, 0, w, n, "sx_batch_add_range_writes");
}

int sx_batch_add_block_ids(sx_batch *b, const sx_block_ids *ids) {
  static const char what[] = "sx_batch_add_block_ids";
  if (b == NULL || ids == NULL)
    return sx__err(SX_EINVAL, "%s: NULL argument", what);
  if (ids->n_local != ids->n_remote)
    return sx__err(SX_EINCOMPAT, "%s: %zu local blocks but %zu remote blocks; the two sides "
                   "must list the same number", what, ids->n_local, ids->n_remote);
  if (ids->n_local == 0 || ids->local == NULL || ids->remote == NULL)
    return sx__err(SX_EINVAL, "%s: empty block lists", what);
  /* The batch's own direction, and refused in our name once submitted
   * (trying the write path and falling back to reads would report a
   * submitted write batch as "this is a write batch"). */
  int write = sx__batch_is_write(b);
  sx__plan *plan;
  sx__pbatch *pb;
  int rc = sx__batch_entries(b, write, what, &plan, &pb);
  if (rc)
    return rc;
  /* Runs of consecutive pairs: (local, remote) -> (local+1, remote+1). */
  size_t runs = 1;
  for (size_t i = 1; i < ids->n_local; i++)
    runs += ids->local[i] != ids->local[i - 1] + 1 || ids->remote[i] != ids->remote[i - 1] + 1;
  sx_block_write *w = malloc(runs * sizeof(*w));
  if (w == NULL)
    return sx__err(SX_ENOMEM, "%s", what);
  size_t k = 0;
  for (size_t i = 0; i < ids->n_local; i++) {
    if (i > 0 && ids->local[i] == ids->local[i - 1] + 1 &&
        ids->remote[i] == ids->remote[i - 1] + 1) {
      w[k - 1].count++;
      continue;
    }
    w[k++] = (sx_block_write){.group = ids->group, .layer_first = ids->layer_first,
                              .layer_count = ids->layer_count, .slots = ids->slots,
                              .local_block = ids->local[i], .remote_block = ids->remote[i],
                              .count = 1};
  }
  if (write) {
    rc = sx_batch_add_block_writes(b, w, runs);
    free(w);
    return rc;
  }
  sx_block_read *r = block_reads(w, runs);
  free(w);
  if (r == NULL)
    return sx__err(SX_ENOMEM, "%s", what);
  rc = sx_batch_add_blocks(b, r, runs);
  free(r);
  return rc;
}

/* ------------------------------------------------------------ notice */

int sx__pbatch_notify(sx__pbatch *pb, sx_agent *a, sx_notice_kind kind, uint64_t tag,
                      uint64_t bytes, sx_tpeer *tp, sx_op *op) {
  sx_notice *n = sx__notice_alloc(pb->nb, pb->nr);
  if (n == NULL)
    return sx__err(SX_ENOMEM, "building the notice");
  snprintf(n->producer, sizeof(n->producer), "%s", a->name);
  memcpy(n->incarnation, a->incarnation, SX_INCARNATION_LEN);
  n->kind = kind;
  n->tag = tag;
  n->bytes = bytes;
  if (pb->nb)
    memcpy(sx__notice_blocks(n), pb->b, pb->nb * sizeof(*pb->b));
  if (pb->nr)
    memcpy(sx__notice_ranges(n), pb->r, pb->nr * sizeof(*pb->r));
  uint8_t *buf;
  size_t len;
  int rc = sx__notice_encode(n, &buf, &len);
  sx_notice_free(n);
  if (rc)
    return rc;
  rc = sx__tr_call(tp->t->ops, notify, tp, op, buf, len);
  free(buf);
  if (rc == SX_ENOTSUP)
    sx__err(rc, "the transport cannot send %s notices", kind == SX_NOTICE_READ ? "read" : "write");
  return rc;
}
