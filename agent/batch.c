/*
 * Batches.  Entries are planned on the caller's thread at add time; submit
 * queues the batch to the loop, which adds its deadline to the agent's
 * (deadline.h: one heap and one timer for all batches) and posts its
 * ranges to the segment's transport peer.  The transport settles every
 * range once (sx__op_xfer_done); at zero the batch ends: its result is
 * computed, its deadline dropped, then at the loop's next turn (pub_idle,
 * outside the transport's call stack: the callback may free the batch)
 * the user callback runs, waiters wake and the eventfd turns readable.  A
 * deadline or a cancel asks the transport to abort the rest, which it
 * settles only once nothing can write the destinations any more.
 *
 * Memory: a batch is freed by whoever is last of the user (destroy) and the
 * loop (the end, and cancel/submit calls still queued): `queued` counts
 * calls in the loop's queue, `settled` says the end is complete.
 */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include "agent_int.h"
#include "push_int.h"

#define DEFAULT_TIMEOUT_MS 30000u

/* A batch's place in one of the agent's lists of batches (the running
 * ones, the direct ones): blist_add / blist_del with the member. */
typedef struct blink {
  struct sx_batch *next, *prev;
  int in;
} blink;

struct sx_batch {
  sx_segment *s;
  sx_agent *a;
  sx_batch_params p;
  sx__ltable *lt;  /* destinations stay registered-or-at-least-allocated */
  sx__plan plan;
  sx__pbatch *push; /* write batches: the notice's entries (push_batch.c) */
  sx__pbatch *rnote; /* SX_BATCH_NOTIFY read batches: the read notice's entries */
  sx_tpeer *tp;     /* loop thread: where the batch was posted */
  sx_tpeer *ntp;    /* loop thread: where its read notice went, if not tp */

  pthread_mutex_t mu;
  pthread_cond_t cv;
  sx_batch_state state; /* mu */
  int ended;            /* mu: the result is readable */
  int settled;          /* mu (written atomically, read so by a spinning wait): the
                         * callback returned */
  int queued;           /* mu: submit/cancel calls in the loop's queue */
  int cancel_req;       /* mu */
  int free_when_done;   /* mu: destroyed on the agent thread while running */
  int efd;              /* mu: -1 until sx_batch_fd() */

  /* Loop thread only. */
  int running;          /* posted to the transport, not ended */
  sx_batch_state reason; /* TIMEOUT or CANCELLED when that ended it early */
  sx_op op;
  sx__dl_item deadline;  /* in a->deadlines while running */
  struct sx_batch *pub_next; /* a->pub_head: the end waits to be published */
  uint64_t submit_ns, post_ns;
  blink rl;              /* in a->running */
  sx_batch_result res;
  uint32_t *failed;

  sx__call submit_call, cancel_call, watch_call;

  /* A direct read (transport.h, "Direct reads"): a table read launched
   * on the submitting thread, whose end that thread (or any that waits,
   * polls or destroys) sees in its ticket, with no hop through the loop.
   * op then only describes it (op.first_error and op.message: why it
   * fails, written under a->direct_mu by lane_failed or the abort). */
  int direct;            /* atomic: DIRECT_* */
  sx__lane_ticket dt;    /* written under the lane's lock */
  const sx_transport_ops *dops;
  blink dl;              /* in a->direct (a->direct_mu) */
  sx__mem_notice dnote;  /* the loop's watch (an eventfd, a destroy on the loop) */
  int watching;          /* mu: that watch is queued or running (one at most) */
};

enum { DIRECT_NO, DIRECT_RUNNING, DIRECT_ENDED };

const char *sx_batch_state_name(sx_batch_state s) {
  switch (s) {
  case SX_BATCH_NEW:
    return "NEW";
  case SX_BATCH_RUNNING:
    return "RUNNING";
  case SX_BATCH_COMPLETED:
    return "COMPLETED";
  case SX_BATCH_FAILED:
    return "FAILED";
  case SX_BATCH_TIMEOUT:
    return "TIMEOUT";
  case SX_BATCH_CANCELLED:
    return "CANCELLED";
  }
  return "UNKNOWN";
}

void sx_batch_params_init(sx_batch_params *p) {
  memset(p, 0, sizeof(*p));
  p->timeout_ms = DEFAULT_TIMEOUT_MS;
}

/* ------------------------------------------------------------ create/add */

/* Is b of a kind that may be read directly: a read (not a push) with no
 * callback and no notice, which are the loop's to deliver? */
static int direct_kind(const sx_batch *b) {
  return b->push == NULL && b->rnote == NULL && b->p.cb == NULL;
}

/* The fewest ranges a batch's first block entries make for a gather table
 * (sx__plan_tables): SX_IPC_TABLES=N, 0 never (ranges, as before tables).
 * By default every batch that may go direct (direct: no callback and no
 * notice; submitted later from another thread than the loop's, with no
 * eventfd before) on a segment that has a lane (the caller's thread
 * launches the table; tests/gpu/results/2026-11-28-h200x2-direct-ab.txt),
 * else SX__PLAN_TABLE_MIN (through the loop, tables pay off from there). */
#define TABLES_UNSET UINT32_MAX
static uint32_t tables_min(sx_segment *s, int direct) {
  static int64_t cached = -1;
  uint32_t n = (uint32_t)sx__env_once(&cached, "SX_IPC_TABLES", 0, TABLES_UNSET - 1,
                                      TABLES_UNSET);
  if (n != TABLES_UNSET)
    return n;
  if (!direct)
    return SX__PLAN_TABLE_MIN;
  pthread_mutex_lock(&s->lane_mu);
  int lane = s->lane != NULL;
  pthread_mutex_unlock(&s->lane_mu);
  return lane ? 1 : SX__PLAN_TABLE_MIN;
}

int sx_batch_create(sx_segment *s, const sx_batch_params *p, sx_batch **out) {
  if (s == NULL || out == NULL)
    return sx__err(SX_EINVAL, "sx_batch_create: NULL argument");
  sx_batch *b = calloc(1, sizeof(*b));
  if (b == NULL)
    return sx__err(SX_ENOMEM, "sx_batch_create");
  b->s = s;
  b->a = s->a;
  if (p != NULL)
    b->p = *p;
  else
    sx_batch_params_init(&b->p);
  if (b->p.timeout_ms == 0)
    b->p.timeout_ms = DEFAULT_TIMEOUT_MS;
  if (b->p.flags & ~(unsigned)(SX_BATCH_WRITE | SX_BATCH_NOTIFY)) {
    unsigned flags = b->p.flags;
    free(b);
    return sx__err(SX_EINVAL, "sx_batch_create: unknown flags 0x%x", flags);
  }
  if ((b->p.flags & SX_BATCH_WRITE) && (b->p.flags & SX_BATCH_NOTIFY)) {
    free(b);
    return sx__err(SX_EINVAL, "sx_batch_create: SX_BATCH_NOTIFY is for read batches (a write "
                   "batch always ends with its notice)");
  }
  if ((b->p.flags & SX_BATCH_NOTIFY) && (b->rnote = sx__pbatch_new()) == NULL) {
    free(b);
    return sx__err(SX_ENOMEM, "sx_batch_create");
  }
  if ((b->p.flags & SX_BATCH_WRITE) && b->a->name[0] == '\0') {
    free(b);
    return sx__err(SX_EINVAL, "sx_batch_create: a write batch needs a named agent (consumers "
                   "authorize producers by their published segment)");
  }
  if ((b->p.flags & SX_BATCH_WRITE) && (b->push = sx__pbatch_new()) == NULL) {
    free(b);
    return sx__err(SX_ENOMEM, "sx_batch_create");
  }
  b->lt = sx__ltable_get(b->a);
  sx__plan_init(&b->plan, &s->ix, &b->lt->ix, b->a->p.slice_bytes,
                s->kind == SX_TRANSPORT_RDMA);
  b->plan.write = b->push != NULL;
  /* Strided pieces stay one xfer only for a transport that copies them so. */
  const sx_transport *tr = b->a->tr[s->kind];
  b->plan.strided = tr != NULL && (tr->ops->caps & SX__TR_STRIDED) != 0;
  /* A read over a transport that takes tables (cuda_ipc) plans its block
   * entries into the gather table itself, on this thread. */
  if (b->push == NULL && tr != NULL && (tr->ops->caps & SX__TR_TABLES)) {
    uint32_t tmin = tables_min(s, direct_kind(b));
    if (tmin > 0)
      sx__plan_tables(&b->plan, tmin);
  }
  pthread_mutex_init(&b->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&b->cv, &ca);
  pthread_condattr_destroy(&ca);
  b->efd = -1;
  b->submit_call.embedded = b->cancel_call.embedded = b->watch_call.embedded = 1;
  __atomic_add_fetch(&s->refs, 1, __ATOMIC_RELAXED);
  *out = b;
  return 0;
}

static int check_new(sx_batch *b, const char *what) {
  pthread_mutex_lock(&b->mu);
  sx_batch_state st = b->state;
  pthread_mutex_unlock(&b->mu);
  if (st != SX_BATCH_NEW)
    return sx__err(SX_EINVAL, "%s: the batch was already submitted", what);
  return 0;
}

/* Entries of one direction only: reads into a read batch, writes into a
 * write batch (SX_BATCH_WRITE). */
static int check_add(sx_batch *b, int write, const char *what) {
  if ((b->push != NULL) != write)
    return sx__err(SX_EINVAL, "%s: this is a %s batch", what, b->push ? "write" : "read");
  return check_new(b, what);
}

int sx__batch_is_write(const sx_batch *b) { return b->push != NULL; }

int sx__batch_entries(sx_batch *b, int write, const char *what, struct sx__plan **plan,
                      sx__pbatch **pb) {
  int rc = check_add(b, write, what);
  if (rc == 0) {
    *plan = &b->plan;
    *pb = write ? b->push : b->rnote;
  }
  return rc;
}

int sx_batch_add_blocks(sx_batch *b, const sx_block_read *r, size_t n) {
  if (b == NULL || (r == NULL && n > 0))
    return sx__err(SX_EINVAL, "sx_batch_add_blocks: NULL argument");
  int rc = check_add(b, 0, "sx_batch_add_blocks");
  if (rc == 0 && b->rnote != NULL)
    return sx__pbatch_add_reads(b->rnote, &b->plan, 1, r, n, "sx_batch_add_blocks");
  return rc ? rc : sx__plan_add_blocks(&b->plan, r, n);
}

int sx_batch_add_ranges(sx_batch *b, const sx_range_read *r, size_t n) {
  if (b == NULL || (r == NULL && n > 0))
    return sx__err(SX_EINVAL, "sx_batch_add_ranges: NULL argument");
  int rc = check_add(b, 0, "sx_batch_add_ranges");
  if (rc == 0 && b->rnote != NULL)
    return sx__pbatch_add_reads(b->rnote, &b->plan, 0, r, n, "sx_batch_add_ranges");
  return rc ? rc : sx__plan_add_ranges(&b->plan, r, n);
}

int sx__batch_add_scratch(sx_batch *b, const sx_region *R, uint64_t roff, uint64_t len) {
  sx_agent *a = b->a;
  if (len > sizeof(a->scratch_buf))
    return sx__err(SX_ELIMIT, "at most %zu bytes into the scratch buffer",
                   sizeof(a->scratch_buf));
  int rc = b->rnote != NULL ? sx__err(SX_EINVAL, "a notifying batch reads no scratch")
                            : check_add(b, 0, "sx__batch_add_scratch");
  uint64_t local = (uint64_t)(uintptr_t)a->scratch_buf;
  return rc ? rc : sx__plan_add_run(&b->plan, R, &a->scratch.l, &roff, &local, &len, 1);
}

int sx__batch_add_scatter(sx_batch *b, const sx_region *R, uint64_t roff,
                          const struct iovec *iov, uint32_t n) {
  static const char what[] = "a scattered range";
  /* Only the TCP reader receives into a list of pieces (tcp_read.c). */
  int rc = b->s->kind != SX_TRANSPORT_TCP
               ? sx__err(SX_ENOTSUP, "%s is read over TCP only", what)
               : check_add(b, 0, what);
  if (rc == 0 && b->rnote != NULL)
    return sx__pbatch_add_scatter(b->rnote, &b->plan, R, roff, iov, n);
  return rc ? rc : sx__plan_add_scatter(&b->plan, R, roff, iov, n);
}

/* ------------------------------------------------------------ the end */

static void batch_free(sx_batch *b) {
  sx__plan_free(&b->plan);
  sx__pbatch_free(b->push);
  sx__pbatch_free(b->rnote);
  sx__ltable_put(b->lt);
  free(b->failed);
  if (b->efd >= 0)
    close(b->efd);
  pthread_mutex_destroy(&b->mu);
  pthread_cond_destroy(&b->cv);
  sx__segment_put(b->s);
  free(b);
}

/* Loop thread, mu held: may the loop free b for a destroy that could not
 * wait?  Then the caller frees it after unlocking. */
static int loop_may_free(sx_batch *b) {
  return b->free_when_done && b->settled && b->queued == 0;
}

#define BLINK(b, off) ((blink *)((char *)(b) + (off)))

/* b at the head of *head through its blink at off. */
static void blist_add(sx_batch **head, sx_batch *b, size_t off) {
  blink *l = BLINK(b, off);
  l->prev = NULL;
  l->next = *head;
  if (*head != NULL)
    BLINK(*head, off)->prev = b;
  *head = b;
  l->in = 1;
}

/* b off *head, if it is there. */
static void blist_del(sx_batch **head, sx_batch *b, size_t off) {
  blink *l = BLINK(b, off);
  if (!l->in)
    return;
  if (l->prev)
    BLINK(l->prev, off)->next = l->next;
  else
    *head = l->next;
  if (l->next)
    BLINK(l->next, off)->prev = l->prev;
  l->in = 0;
}

static void unlink_running(sx_batch *b) {
  blist_del(&b->a->running, b, offsetof(sx_batch, rl));
}

/* The end is visible to everyone from here. */
static void publish_end(sx_batch *b) {
  pthread_mutex_lock(&b->mu);
  b->ended = 1;
  b->state = b->res.state;
  pthread_mutex_unlock(&b->mu);
  if (b->p.cb != NULL)
    b->p.cb(b, b->p.cb_arg);
  pthread_mutex_lock(&b->mu);
  __atomic_store_n(&b->settled, 1, __ATOMIC_RELEASE);
  if (b->efd >= 0) {
    uint64_t one = 1;
    ssize_t w = write(b->efd, &one, sizeof(one));
    (void)w; /* an eventfd write of 1 cannot fail short of overflow */
  }
  pthread_cond_broadcast(&b->cv);
  int free_now = loop_may_free(b);
  pthread_mutex_unlock(&b->mu);
  if (free_now)
    batch_free(b);
}

/* The loop's next turn: publish the ends queued since (a callback may
 * queue more: they restart the idle handle). */
static void publish_queued(uv_idle_t *h) {
  sx_agent *a = h->data;
  sx_batch *b = a->pub_head;
  a->pub_head = NULL;
  a->pub_tail = &a->pub_head;
  uv_idle_stop(h);
  while (b != NULL) {
    sx_batch *next = b->pub_next;
    publish_end(b); /* may free b */
    b = next;
  }
}

/* Publish b's end at the loop's next turn (at once once the agent closed
 * its queue: shutdown, on a fresh stack). */
static void publish_later(sx_batch *b) {
  sx_agent *a = b->a;
  if (!a->pub_open) {
    publish_end(b);
    return;
  }
  b->pub_next = NULL;
  if (a->pub_head == NULL)
    uv_idle_start(&a->pub_idle, publish_queued);
  *a->pub_tail = b;
  a->pub_tail = &b->pub_next;
}

void sx__batches_init(sx_agent *a) {
  sx__dl_init(&a->loop, &a->deadlines);
  uv_idle_init(&a->loop, &a->pub_idle);
  a->pub_idle.data = a;
  a->pub_head = NULL;
  a->pub_tail = &a->pub_head;
  a->pub_open = 1;
}

void sx__batches_close(sx_agent *a) {
  if (!a->pub_open)
    return;
  publish_queued(&a->pub_idle);
  a->pub_open = 0;
  uv_close((uv_handle_t *)&a->pub_idle, NULL);
  sx__dl_close(&a->deadlines);
}

/* Mark the entries of failed ranges (they may cover several entries each). */
static int collect_failed(sx_batch *b) {
  uint32_t n = b->plan.n_entries;
  uint8_t *bits = calloc(n / 8 + 1, 1);
  if (bits == NULL)
    return SX_ENOMEM;
  uint32_t count = 0;
  /* A table op failed whole: every entry of its pieces. */
  const sx__mem_bpiece *tab = b->op.tab;
  size_t nr = tab != NULL ? b->op.n_tab : b->op.n;
  for (size_t i = 0; i < nr; i++) {
    const sx_xfer *x = tab != NULL ? NULL : &b->op.xfers[i];
    if (x != NULL && x->status == 0)
      continue;
    uint32_t first = x != NULL ? x->entry_first : tab[i].entry_first;
    uint32_t last = x != NULL ? x->entry_last : tab[i].entry_last;
    for (uint32_t e = first; e <= last && e < n; e++) {
      if (!(bits[e / 8] & (1u << (e % 8)))) {
        bits[e / 8] |= (uint8_t)(1u << (e % 8));
        count++;
      }
    }
  }
  if (count > 0 && (b->failed = malloc(count * sizeof(uint32_t))) != NULL) {
    uint32_t k = 0;
    for (uint32_t e = 0; e < n; e++)
      if (bits[e / 8] & (1u << (e % 8)))
        b->failed[k++] = e;
  }
  free(bits);
  b->res.n_failed = b->failed ? count : 0;
  b->res.failed = b->failed;
  return 0;
}

/* The result of a batch that ended (op settled, reason set); counted. */
static void fill_result(sx_batch *b) {
  sx_agent *a = b->a;
  sx_batch_result *r = &b->res;
  uint64_t now = sx__mono_ns();
  r->transfer_ns = now - b->submit_ns;
  r->post_ns = b->post_ns ? b->post_ns : r->transfer_ns;
  r->n_entries = b->plan.n_entries;
  r->n_ranges = (uint32_t)(b->plan.n + b->plan.n_tab);
  r->bytes = b->op.bytes;
  r->transport = b->s->kind;
  r->error = b->op.first_error;
  if (r->error == 0)
    r->state = SX_BATCH_COMPLETED;
  else if (b->reason != SX_BATCH_NEW)
    r->state = b->reason;
  else
    r->state = SX_BATCH_FAILED;
  if (r->state == SX_BATCH_TIMEOUT && r->error == SX_ETIMEDOUT)
    snprintf(r->message, sizeof(r->message), "%.64s: the batch deadline of %u ms passed "
             "with %lu of %lu bytes arrived", b->s->cd->desc.name, b->p.timeout_ms,
             (unsigned long)b->op.bytes, (unsigned long)b->plan.bytes);
  else if (r->error)
    snprintf(r->message, sizeof(r->message), "%s", b->op.message);
  sx__stats_batch(a, r, b->push != NULL);
  if (r->error && collect_failed(b) != 0)
    sx__log(a, SX_LOG_WARN, "batch on %s: no memory to list failed entries",
            b->s->cd->desc.name);
}

/* Loop thread: every range has settled (or none was posted). */
static void finish(sx_batch *b) {
  sx_agent *a = b->a;
  sx_batch_result *r = &b->res;
  unlink_running(b);
  b->running = 0;
  fill_result(b);
  /* A refused write (no grant) says nothing about reading that peer. */
  if (r->error && r->error != SX_ECANCELED && r->error != SX_ESHUTDOWN &&
      !a->shutting_down && b->s->peer != NULL && !(b->push != NULL && r->error == SX_EACCESS))
    sx__peer_failed(a, b->s->peer, r->error, r->message);
  sx__dl_remove(&a->deadlines, &b->deadline);
  publish_later(b);
}

/* A write batch's (or a notifying read batch's) notice settled: that is
 * its end. */
static void op_noticed(sx_op *op, int status, const char *msg) {
  sx__op_error(op, status, msg);
  finish(op->owner);
}

/* Loop thread, at submit: where a notifying read batch over RDMA will send
 * its notice.  RDMA READs are one-sided and a reader's QPs carry no
 * messages (the target's side posts no receives), so the notice goes on a
 * TCP connection to the same target, opened once per peer; a batch that
 * could not send one fails here, before it reads anything. */
static int rdma_notice_peer(sx_batch *b) {
  sx__rpeer *peer = b->s->peer;
  sx_transport *t = b->a->tr[SX_TRANSPORT_TCP];
  if (t == NULL || !t->ops->usable(t, &peer->cd->desc))
    return sx__err(SX_ENOTSUP, "%.64s: read notices over RDMA travel on TCP, and %s",
                   b->s->cd->desc.name, t == NULL ? "this agent runs no TCP transport"
                                                  : "the target publishes no TCP endpoint");
  int rc = peer->ntp == NULL ? t->ops->peer_open(t, &peer->cd->desc, &peer->ntp) : 0;
  if (rc == 0)
    b->ntp = peer->ntp;
  return rc;
}

/* A notifying read batch's bytes all arrived: its notice, on its own peer
 * or on the one rdma_notice_peer() chose. */
static int read_notify(sx_batch *b, sx_op *op) {
  return sx__pbatch_notify(b->rnote, b->a, SX_NOTICE_READ, b->p.tag, b->plan.bytes,
                           b->ntp != NULL ? b->ntp : b->tp, op);
}

/* Every range settled.  A write batch whose writes all landed, or a
 * notifying read batch whose bytes all arrived, then sends its notice and
 * ends when the other side answered it. */
static void op_done(sx_op *op) {
  sx_batch *b = op->owner;
  int notice = b->push != NULL || b->rnote != NULL;
  if (notice && op->first_error == 0 && b->reason != SX_BATCH_NEW) {
    /* Stopped just as the last byte came: no notice, so not complete. */
    op->first_error = b->reason == SX_BATCH_TIMEOUT ? SX_ETIMEDOUT : SX_ECANCELED;
    snprintf(op->message, sizeof(op->message), "stopped before the notice was sent");
  }
  if (notice && op->first_error == 0) {
    int rc = b->push != NULL ? sx__pbatch_notify(b->push, b->a, SX_NOTICE_WRITE, b->p.tag,
                                                 b->plan.bytes, b->tp, op)
                             : read_notify(b, op);
    if (rc == 0)
      return;
    op->first_error = rc;
    snprintf(op->message, sizeof(op->message), "%s", sx_errmsg());
  }
  finish(b);
}

/* End before (or instead of) posting: every range fails with rc. */
static void end_now(sx_batch *b, int rc, const char *msg) {
  b->op.first_error = rc;
  if (rc) {
    snprintf(b->op.message, sizeof(b->op.message), "%s", msg ? msg : sx_strerror(rc));
    for (size_t i = 0; i < b->op.n; i++)
      b->op.xfers[i].status = rc;
  }
  finish(b);
}

/* Stop the batch where it is: its ranges on its peer, and its read notice
 * on the peer that carries it, if that is another (each settles only what
 * it holds; the batch has ended before the second call if the first ended
 * it, and then that call finds nothing). */
static void abort_op(sx_batch *b, int status) {
  sx_tpeer *ntp = b->ntp;
  b->tp->t->ops->abort(b->tp, &b->op, status);
  if (ntp != NULL && ntp != b->tp)
    ntp->t->ops->abort(ntp, &b->op, status);
}

static void expired(sx__dl_item *it) {
  sx_batch *b = (sx_batch *)((char *)it - offsetof(sx_batch, deadline));
  if (!b->running)
    return;
  b->reason = SX_BATCH_TIMEOUT;
  abort_op(b, SX_ETIMEDOUT);
}

/* ------------------------------------------------------------ submit */

static int dequeued(sx_batch *b) {
  pthread_mutex_lock(&b->mu);
  b->queued--;
  int cancel = b->cancel_req, free_now = loop_may_free(b);
  pthread_cond_broadcast(&b->cv);
  pthread_mutex_unlock(&b->mu);
  if (free_now) {
    batch_free(b);
    return -1;
  }
  return cancel;
}

/* The op of b's plan (its table when it has one). */
static void op_init(sx_batch *b) {
  int tab = b->plan.tables && b->plan.n_tab > 0;
  b->op = (sx_op){.xfers = b->plan.x, .n = b->plan.n, .pending = tab ? 1 : b->plan.n,
                  .total = b->plan.bytes, .tab = tab ? b->plan.tab : NULL,
                  .n_tab = tab ? b->plan.n_tab : 0, .tab_device = b->plan.tab_device,
                  .rregs = b->plan.rr, .n_rregs = b->plan.rr_over ? 0 : b->plan.n_rr,
                  .n_strided = b->plan.n_strided, .done = op_done, .owner = b,
                  .noticed = op_noticed};
}

static void submit_run(sx__call *c) {
  sx_batch *b = (sx_batch *)((char *)c - offsetof(sx_batch, submit_call));
  sx_agent *a = b->a;
  int cancel = dequeued(b); /* never frees here: the batch has not ended */
  sx__dl_item_init(&b->deadline, expired);
  /* A table goes to a transport that takes it; any other gets ranges. */
  const sx_transport *tr = a->tr[b->s->kind];
  if (b->plan.tables && (tr == NULL || !(tr->ops->caps & SX__TR_TABLES)))
    (void)sx__plan_untable(&b->plan); /* no memory: the plan is broken, said below */
  op_init(b);
  sx__rpeer *peer = b->s->peer;
  if (a->shutting_down) {
    end_now(b, SX_ESHUTDOWN, "the agent is shutting down");
    return;
  }
  if (peer == NULL) {
    end_now(b, SX_EINVAL, "the segment was closed before the batch started");
    return;
  }
  if (b->plan.broken) {
    end_now(b, SX_ENOMEM, "the batch ran out of memory while planning");
    return;
  }
  if (cancel) {
    b->reason = SX_BATCH_CANCELLED;
    end_now(b, SX_ECANCELED, "cancelled before it started");
    return;
  }
  if (peer->fatal) {
    end_now(b, peer->fatal, peer->fatal_msg);
    return;
  }
  if (b->op.n == 0 && b->op.tab == NULL && b->push == NULL && b->rnote == NULL) {
    end_now(b, 0, NULL);
    return;
  }
  int rc = 0;
  if (b->rnote != NULL && b->s->kind == SX_TRANSPORT_RDMA && (rc = rdma_notice_peer(b)) != 0) {
    end_now(b, rc, sx_errmsg());
    return;
  }
  uint64_t elapsed_ms = (sx__mono_ns() - b->submit_ns) / 1000000u;
  uint64_t left = elapsed_ms < b->p.timeout_ms ? b->p.timeout_ms - elapsed_ms : 0;
  /* Deadlines count from the loop's cached time, which is as old as this
   * loop iteration: refresh it, or a busy iteration ends the batch early. */
  uv_update_time(&a->loop);
  if ((rc = sx__dl_add(&a->deadlines, &b->deadline, left)) != 0) {
    end_now(b, rc, sx_errmsg());
    return;
  }
  sx_transport *t = a->tr[b->s->kind];
  sx_tpeer **tpp = b->push != NULL ? &peer->wtp : &peer->tp;
  if (*tpp == NULL &&
      (rc = b->push != NULL
                ? sx__tr_call(t->ops, wpeer_open, t, &peer->cd->desc, tpp)
                : t->ops->peer_open(t, &peer->cd->desc, tpp)) != 0) {
    end_now(b, rc, rc == SX_ENOTSUP ? "the transport cannot write" : sx_errmsg());
    return;
  }
  b->tp = *tpp;
  /* The segment's next table reads may go direct, on the peer's lane
   * (which opens once the loop ran a table read of the peer). */
  if (b->push == NULL && t->ops->lane != NULL)
    sx__segment_lane(b->s, t->ops, t->ops->lane(b->tp));
  b->running = 1;
  blist_add(&a->running, b, offsetof(sx_batch, rl));
  if (b->op.n == 0 && b->op.tab == NULL) {
    op_done(&b->op); /* a batch of no bytes: only its notice */
    return;
  }
  if ((rc = b->tp->t->ops->post(b->tp, &b->op)) != 0) {
    end_now(b, rc, sx_errmsg());
    return;
  }
  b->post_ns = sx__mono_ns() - b->submit_ns;
}

/* ------------------------------------------------------------ direct reads */

/* mu held: may b be read directly?  A read of one gather table and
 * nothing else, with no callback, notice or eventfd (those are the
 * loop's), submitted from another thread than the loop's. */
static int direct_ok(const sx_batch *b) {
  return b->plan.tables && b->plan.n_tab > 0 && b->plan.n == 0 && !b->plan.broken &&
         !b->plan.rr_over && b->plan.n_rr > 0 && direct_kind(b) && b->efd < 0 &&
         !sx__on_loop(b->a);
}

static void direct_link(sx_batch *b) {
  sx_agent *a = b->a;
  pthread_mutex_lock(&a->direct_mu);
  blist_add(&a->direct, b, offsetof(sx_batch, dl));
  pthread_mutex_unlock(&a->direct_mu);
}

/* a->direct_mu held. */
static void direct_unlink_locked(sx_batch *b) {
  blist_del(&b->a->direct, b, offsetof(sx_batch, dl));
}

/* Submit b on its segment's lane: 0, or SX_EBUSY (the loop runs it).
 * Listed first, so that a withdraw that comes before the ticket is
 * complete finds it (sx__batches_lane_failed skips tickets not issued). */
static int direct_start(sx_batch *b) {
  sx_segment *s = b->s;
  op_init(b);
  b->dt = (sx__lane_ticket){0};
  direct_link(b);
  pthread_mutex_lock(&s->lane_mu);
  b->dops = s->lane_ops;
  int rc = s->lane != NULL ? b->dops->lane_read(s->lane, &b->op, &b->dt) : SX_EBUSY;
  pthread_mutex_unlock(&s->lane_mu);
  if (rc != 0) {
    pthread_mutex_lock(&b->a->direct_mu);
    direct_unlink_locked(b);
    pthread_mutex_unlock(&b->a->direct_mu);
    return rc;
  }
  b->post_ns = sx__mono_ns() - b->submit_ns;
  __atomic_store_n(&b->direct, DIRECT_RUNNING, __ATOMIC_RELEASE);
  return 0;
}

/* Take the end of b's direct read for this thread: 1, or 0 when another
 * thread took it. */
static int direct_claim(sx_batch *b) {
  int running = DIRECT_RUNNING;
  return __atomic_compare_exchange_n(&b->direct, &running, DIRECT_ENDED, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE);
}

/* End b, claimed and off the list: its result, then the end published. */
static void direct_settle(sx_batch *b) {
  int err = __atomic_load_n(&b->dt.err, __ATOMIC_RELAXED);
  if (b->op.first_error == 0 && err != 0) {
    b->op.first_error = err;
    snprintf(b->op.message, sizeof(b->op.message), "%.64s: launching the gather kernel "
             "(launcher thread, for a direct read): %s", b->s->cd->desc.name, sx_strerror(err));
  }
  pthread_mutex_lock(&b->mu);
  int cancelled = b->cancel_req;
  pthread_mutex_unlock(&b->mu);
  if (b->op.first_error == 0 && cancelled) {
    b->reason = SX_BATCH_CANCELLED;
    b->op.first_error = SX_ECANCELED;
    snprintf(b->op.message, sizeof(b->op.message), "cancelled");
  } else if (b->op.first_error == 0 &&
             sx__mono_ns() - b->submit_ns > (uint64_t)b->p.timeout_ms * 1000000u) {
    b->reason = SX_BATCH_TIMEOUT;
    b->op.first_error = SX_ETIMEDOUT;
  }
  b->op.bytes = b->op.first_error == 0 ? b->plan.bytes : 0;
  b->op.pending = 0;
  b->dops->lane_ref(b->dt.lane, -1);
  b->dt.lane = NULL;
  fill_result(b);
  publish_end(b);
}

/* b's direct read has ended (its ticket says so): end b, once.  0 when
 * this call ended it; 1 when another thread does. */
static int direct_end(sx_batch *b) {
  if (!direct_claim(b))
    return 1;
  pthread_mutex_lock(&b->a->direct_mu);
  direct_unlink_locked(b);
  pthread_mutex_unlock(&b->a->direct_mu);
  direct_settle(b);
  return 0;
}

/* Has b's direct read ended?  Then end b (here, or another thread is
 * about to).  ask: also ask the driver (a stream that broke never
 * writes its ticket's word). */
static int direct_check(sx_batch *b, int ask) {
  if (__atomic_load_n(&b->direct, __ATOMIC_ACQUIRE) != DIRECT_RUNNING)
    return 1;
  if (!b->dops->lane_done(b->dt.lane, &b->dt, ask))
    return 0;
  direct_end(b);
  return 1;
}

/* mu held (released on return): wait until b's end is published, or
 * until ts (timeout_ms >= 0; < 0: for ever).  1 when it was. */
static int settled_wait(sx_batch *b, int timeout_ms, const struct timespec *ts) {
  while (!b->settled) {
    if (timeout_ms < 0)
      pthread_cond_wait(&b->cv, &b->mu);
    else if (pthread_cond_timedwait(&b->cv, &b->mu, ts) != 0)
      break;
  }
  int settled = b->settled;
  pthread_mutex_unlock(&b->mu);
  return settled;
}

/* Wait up to timeout_ms (< 0: for ever) for b's direct read, spinning
 * spin_ns first, then sleeping (the GPU writes the word; nobody wakes
 * us) in naps of an eighth of the time waited so far, within
 * DIRECT_NAP_MIN_NS..DIRECT_NAP_MAX_NS, so that a read is seen at most
 * about an eighth of its time late; then for its end to be published, by
 * this thread or whichever ended it.  0, or SX_ETIMEDOUT.
 *
 * While it naps, the thread's timer slack is DIRECT_NAP_SLACK_NS and
 * then what it was: at Linux's default of 50 us a 2 us nap lasts 50 us
 * or more, and a read that ended just after the spin was seen twice as
 * late as one that ended within it (p99 above 2x p50 on an H200).  From
 * its first nap it also asks the driver, every DIRECT_ASK_NS (a stream
 * that broke never writes the word). */
#define DIRECT_NAP_MIN_NS 2000u
#define DIRECT_NAP_MAX_NS 200000u
#define DIRECT_NAP_SLACK_NS 1000
#define DIRECT_ASK_NS 1000000u /* how often a napping wait asks the driver */
static int direct_wait(sx_batch *b, int timeout_ms, uint64_t spin_ns) {
  uint64_t t0 = sx__mono_ns(), now = t0;
  uint64_t limit = timeout_ms < 0 ? UINT64_MAX : (uint64_t)timeout_ms * 1000000u;
  uint64_t ask_at = 0; /* after t0: ask the driver, from the first nap on */
  int slack = 0, napped = 0, rc = 0; /* slack: the thread's, once cut */
  for (unsigned i = 1;; i++) {
    int ask = napped && now - t0 >= ask_at;
    if (ask)
      ask_at = now - t0 + DIRECT_ASK_NS;
    if (direct_check(b, ask))
      break;
    if (i % 64 == 0 || now - t0 >= spin_ns)
      now = sx__mono_ns();
    if (now - t0 >= limit) {
      rc = SX_ETIMEDOUT;
      break;
    }
    if (now - t0 < spin_ns) {
      sx__cpu_relax();
      continue;
    }
    if (slack == 0) {
      slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
      if (slack > DIRECT_NAP_SLACK_NS)
        prctl(PR_SET_TIMERSLACK, DIRECT_NAP_SLACK_NS, 0, 0, 0);
    }
    uint64_t nap = (now - t0) / 8;
    nap = nap < DIRECT_NAP_MIN_NS ? DIRECT_NAP_MIN_NS : nap;
    nap = nap > DIRECT_NAP_MAX_NS ? DIRECT_NAP_MAX_NS : nap;
    nap = nap > limit - (now - t0) ? limit - (now - t0) : nap;
    struct timespec ts = {0, (long)nap};
    nanosleep(&ts, NULL);
    napped = 1;
  }
  if (slack > DIRECT_NAP_SLACK_NS)
    prctl(PR_SET_TIMERSLACK, slack, 0, 0, 0);
  if (rc != 0)
    return rc;
  struct timespec ts;
  if (timeout_ms >= 0)
    sx__deadline(&ts, (uint32_t)timeout_ms);
  pthread_mutex_lock(&b->mu);
  return settled_wait(b, timeout_ms, &ts) ? 0 : SX_ETIMEDOUT;
}

/* The loop's watch of a direct read (sx_batch_fd asked for its eventfd,
 * which only an end writes): its copies ended. */
static void direct_noticed(sx__mem_notice *n) {
  sx_batch *b = (sx_batch *)((char *)n - offsetof(sx_batch, dnote));
  if (!direct_check(b, 1))
    direct_wait(b, -1, 0); /* the stream passed the mark: at once */
  dequeued(b);
}

/* mu held: the loop's watch of b's direct read is this caller's to start
 * (1; counted in b->queued, which the watch's end drops), or already
 * queued or running (0). */
static int watch_take(sx_batch *b) {
  if (b->watching)
    return 0;
  b->watching = 1;
  b->queued++;
  return 1;
}

/* Loop thread: watch b's direct read (an eventfd, sx_batch_fd; a destroy
 * from a callback).  The call's queued count is dropped when the watch
 * ends, which may free b (free_when_done). */
static void watch_run(sx__call *c) {
  sx_batch *b = (sx_batch *)((char *)c - offsetof(sx_batch, watch_call));
  b->dnote.fn = direct_noticed;
  if (__atomic_load_n(&b->direct, __ATOMIC_ACQUIRE) == DIRECT_RUNNING &&
      b->dops->lane_watch(b->dt.lane, &b->dt, &b->dnote) == 0)
    return; /* the notice drops the call's count */
  /* Ended already (or no memory to watch: the copies are microseconds). */
  direct_noticed(&b->dnote);
}

void sx__batches_lane_failed(void *agent, const sx__lane *lane, const uint64_t *done,
                             unsigned n, int err, const char *msg) {
  sx_agent *a = agent;
  pthread_mutex_lock(&a->direct_mu);
  for (sx_batch *b = a->direct; b != NULL; b = b->dl.next) {
    if (b->dt.lane != lane || b->dt.no == 0 || b->dt.si >= n || b->dt.no <= done[b->dt.si] ||
        b->op.first_error != 0)
      continue;
    b->op.first_error = err;
    snprintf(b->op.message, sizeof(b->op.message), "%s", msg ? msg : sx_strerror(err));
  }
  pthread_mutex_unlock(&a->direct_mu);
}

/* Shutdown: the direct reads still listed fail with status unless their
 * copies already ended. */
static void direct_abort(sx_agent *a, int status) {
  pthread_mutex_lock(&a->direct_mu);
  for (sx_batch *b = a->direct; b != NULL; b = b->dl.next) {
    if (b->op.first_error != 0 ||
        __atomic_load_n(&b->direct, __ATOMIC_ACQUIRE) != DIRECT_RUNNING ||
        b->dops->lane_done(b->dt.lane, &b->dt, 0))
      continue;
    b->op.first_error = status;
    snprintf(b->op.message, sizeof(b->op.message), "the agent is shutting down");
  }
  pthread_mutex_unlock(&a->direct_mu);
}

void sx__batches_direct_close(sx_agent *a) {
  for (;;) {
    /* Claimed under the list's lock: b cannot end and go meanwhile.  Its
     * lane closed with the transports, so its copies have ended. */
    pthread_mutex_lock(&a->direct_mu);
    sx_batch *b = a->direct;
    int mine = b != NULL && __atomic_load_n(&b->direct, __ATOMIC_ACQUIRE) == DIRECT_RUNNING &&
               direct_claim(b);
    if (mine)
      direct_unlink_locked(b);
    pthread_mutex_unlock(&a->direct_mu);
    if (b == NULL)
      return;
    if (mine)
      direct_settle(b);
    else
      sched_yield(); /* listed but not started yet, or ending on another thread */
  }
}

int sx_batch_submit(sx_batch *b) {
  if (b == NULL)
    return sx__err(SX_EINVAL, "sx_batch_submit: NULL batch");
  pthread_mutex_lock(&b->mu);
  if (b->state != SX_BATCH_NEW) {
    pthread_mutex_unlock(&b->mu);
    return sx__err(SX_EINVAL, "sx_batch_submit: the batch was already submitted");
  }
  b->state = SX_BATCH_RUNNING;
  b->submit_ns = sx__mono_ns();
  int direct = direct_ok(b);
  if (!direct)
    b->queued++;
  pthread_mutex_unlock(&b->mu);
  if (direct) {
    if (direct_start(b) == 0)
      return 0;
    pthread_mutex_lock(&b->mu);
    b->queued++;
    pthread_mutex_unlock(&b->mu);
  }
  b->submit_call.run = submit_run;
  int rc = sx__call_post(b->a, &b->submit_call);
  if (rc) {
    pthread_mutex_lock(&b->mu);
    b->state = SX_BATCH_NEW;
    b->queued--;
    pthread_mutex_unlock(&b->mu);
  }
  return rc;
}

/* ------------------------------------------------------------ cancel */

/* Loop thread: abort b if it is in flight. */
static void cancel_now(sx_batch *b) {
  if (!b->running)
    return; /* ended, or submit_run will see cancel_req */
  b->reason = SX_BATCH_CANCELLED;
  abort_op(b, SX_ECANCELED);
}

static void cancel_run(sx__call *c) {
  sx_batch *b = (sx_batch *)((char *)c - offsetof(sx_batch, cancel_call));
  pthread_mutex_lock(&b->mu);
  int ended = b->ended;
  pthread_mutex_unlock(&b->mu);
  if (!ended)
    cancel_now(b);
  dequeued(b);
}

/* mu held: ask for a cancel once; returns 1 if the caller must queue it. */
static int want_cancel(sx_batch *b) {
  if (b->ended || b->cancel_req)
    return 0;
  b->cancel_req = 1;
  b->queued++;
  return 1;
}

/* Queue call c (counted in b->queued already) to run on the loop.  When
 * the agent is shutting down it ends the batch itself: the count goes. */
static void queue_call(sx_batch *b, sx__call *c, void (*run)(sx__call *c)) {
  c->run = run;
  if (sx__call_post(b->a, c) != 0) {
    pthread_mutex_lock(&b->mu);
    b->queued--;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
  }
}

static void queue_cancel(sx_batch *b) { queue_call(b, &b->cancel_call, cancel_run); }

int sx_batch_cancel(sx_batch *b) {
  if (b == NULL)
    return sx__err(SX_EINVAL, "sx_batch_cancel: NULL batch");
  pthread_mutex_lock(&b->mu);
  if (b->state == SX_BATCH_NEW) {
    pthread_mutex_unlock(&b->mu);
    return sx__err(SX_EINVAL, "sx_batch_cancel: the batch was never submitted");
  }
  int post = want_cancel(b);
  pthread_mutex_unlock(&b->mu);
  if (post)
    queue_cancel(b);
  return 0;
}

/* ------------------------------------------------------------ waiting */

/* How long sx_batch_wait spins before it sleeps, ns: SX_WAIT_SPIN_US, by
 * default WAIT_SPIN_US on hosts of 8 or more CPUs and none on smaller ones
 * (a spinning caller there takes the core the agent's loop needs).  A
 * batch that ends within it is seen without the sleep and its wake-up
 * (tens of microseconds on a virtual machine), and the loop's broadcast
 * finds nobody to wake. */
#define WAIT_SPIN_US 50
#define WAIT_SPIN_MAX_US 10000

static uint64_t wait_spin_ns(void) {
  static int64_t cached = -1; /* us */
  int64_t us = __atomic_load_n(&cached, __ATOMIC_RELAXED);
  if (us < 0) /* the default asks sysconf: only on the first call */
    us = sx__env_once(&cached, "SX_WAIT_SPIN_US", 0, WAIT_SPIN_MAX_US,
                      sx__spin_host() ? WAIT_SPIN_US : 0);
  return (uint64_t)us * 1000;
}

int sx_batch_wait(sx_batch *b, int timeout_ms) {
  if (b == NULL)
    return sx__err(SX_EINVAL, "sx_batch_wait: NULL batch");
  if (sx__on_loop(b->a))
    return sx__err(SX_EBUSY, "sx_batch_wait cannot wait on the agent's thread");
  struct timespec ts;
  if (timeout_ms >= 0)
    sx__deadline(&ts, (uint32_t)timeout_ms);
  pthread_mutex_lock(&b->mu);
  if (b->state == SX_BATCH_NEW) {
    pthread_mutex_unlock(&b->mu);
    return sx__err(SX_EINVAL, "sx_batch_wait: the batch was never submitted");
  }
  if (__atomic_load_n(&b->direct, __ATOMIC_ACQUIRE) == DIRECT_RUNNING) {
    pthread_mutex_unlock(&b->mu);
    return direct_wait(b, timeout_ms, timeout_ms == 0 ? 0 : wait_spin_ns()) == 0
               ? 0
               : sx__err(SX_ETIMEDOUT, "the batch is still running");
  }
  uint64_t spin = b->settled || timeout_ms == 0 ? 0 : wait_spin_ns();
  if (timeout_ms > 0 && spin > (uint64_t)timeout_ms * 1000000u)
    spin = (uint64_t)timeout_ms * 1000000u;
  if (spin > 0) {
    pthread_mutex_unlock(&b->mu);
    /* The clock read once per 64 looks. */
    uint64_t t0 = sx__mono_ns();
    for (unsigned i = 1; !__atomic_load_n(&b->settled, __ATOMIC_ACQUIRE); i++) {
      sx__cpu_relax();
      if (i % 64 == 0 && sx__mono_ns() - t0 >= spin)
        break;
    }
    pthread_mutex_lock(&b->mu);
  }
  return settled_wait(b, timeout_ms, &ts) ? 0
                                          : sx__err(SX_ETIMEDOUT, "the batch is still running");
}

/* A direct read's end, looked for by poll and result_get: the driver is
 * asked only once the read has run for a while. */
#define DIRECT_ASK_NS 1000000u
static void direct_look(sx_batch *b) {
  if (__atomic_load_n(&b->direct, __ATOMIC_ACQUIRE) == DIRECT_RUNNING)
    direct_check(b, sx__mono_ns() - b->submit_ns > DIRECT_ASK_NS);
}

int sx_batch_poll(sx_batch *b) {
  if (b == NULL)
    return sx__err(SX_EINVAL, "sx_batch_poll: NULL batch");
  direct_look(b);
  pthread_mutex_lock(&b->mu);
  int ended = b->ended;
  pthread_mutex_unlock(&b->mu);
  return ended ? 0 : SX_EBUSY;
}

int sx_batch_fd(sx_batch *b) {
  if (b == NULL)
    return sx__err(SX_EINVAL, "sx_batch_fd: NULL batch");
  pthread_mutex_lock(&b->mu);
  int watch = 0;
  if (b->efd < 0) {
    b->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (b->efd >= 0 && b->settled) {
      uint64_t one = 1;
      ssize_t w = write(b->efd, &one, sizeof(one));
      (void)w;
    }
    /* A direct read's end is seen by whoever looks at it: from now on the
     * loop looks too (a notice behind its copies), so the fd turns
     * readable with no call from the user. */
    watch = b->efd >= 0 && __atomic_load_n(&b->direct, __ATOMIC_ACQUIRE) == DIRECT_RUNNING &&
            watch_take(b);
  }
  int fd = b->efd;
  pthread_mutex_unlock(&b->mu);
  if (watch)
    queue_call(b, &b->watch_call, watch_run);
  return fd >= 0 ? fd : sx__err(SX_EIO, "sx_batch_fd: eventfd failed");
}

int sx_batch_result_get(sx_batch *b, sx_batch_result *out) {
  if (b == NULL || out == NULL)
    return sx__err(SX_EINVAL, "sx_batch_result_get: NULL argument");
  direct_look(b);
  pthread_mutex_lock(&b->mu);
  int ended = b->ended;
  pthread_mutex_unlock(&b->mu);
  if (!ended)
    return SX_EBUSY;
  *out = b->res;
  return 0;
}

/* ------------------------------------------------------------ destroy */

void sx_batch_destroy(sx_batch *b) {
  if (b == NULL)
    return;
  /* A direct read ends first (its copies write the destinations and read
   * the table).  On the loop's thread (a callback), which cannot wait,
   * the loop watches it and frees it at its end, cancelled, as any
   * running batch destroyed there. */
  if (__atomic_load_n(&b->direct, __ATOMIC_ACQUIRE) == DIRECT_RUNNING) {
    if (!sx__on_loop(b->a)) {
      direct_wait(b, -1, wait_spin_ns());
    } else {
      pthread_mutex_lock(&b->mu);
      b->free_when_done = 1;
      b->cancel_req = 1;
      int watch = watch_take(b);
      pthread_mutex_unlock(&b->mu);
      if (watch)
        watch_run(&b->watch_call); /* may free b */
      return;
    }
  }
  pthread_mutex_lock(&b->mu);
  if (b->state == SX_BATCH_NEW) {
    pthread_mutex_unlock(&b->mu);
    batch_free(b);
    return;
  }
  if (sx__on_loop(b->a)) {
    /* A callback cannot wait for the loop it runs on: free at the end. */
    int done = b->settled && b->queued == 0;
    if (!done)
      b->free_when_done = 1;
    int running = !b->ended && !b->cancel_req;
    if (running)
      b->cancel_req = 1;
    pthread_mutex_unlock(&b->mu);
    if (done)
      batch_free(b);
    else if (running)
      cancel_now(b);
    return;
  }
  int post = want_cancel(b);
  pthread_mutex_unlock(&b->mu);
  if (post)
    queue_cancel(b);
  pthread_mutex_lock(&b->mu);
  while (!b->settled || b->queued > 0)
    pthread_cond_wait(&b->cv, &b->mu);
  pthread_mutex_unlock(&b->mu);
  batch_free(b);
}

/* ------------------------------------------------------------ shutdown */

void sx__batches_abort(sx_agent *a, int status) {
  direct_abort(a, status);
  while (a->running != NULL) {
    sx_batch *b = a->running;
    /* Abort settles its ranges (now or after a flush); take it off the
     * list first so a slow abort cannot make this loop spin. */
    unlink_running(b);
    abort_op(b, status);
  }
}
