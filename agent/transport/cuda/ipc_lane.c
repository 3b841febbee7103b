/*
 * cuda_ipc's lanes (transport.h, "Direct reads"): a read peer's table ops
 * launched on the thread that submits them.
 *
 * Why: a request of 16-128 blocks is a few microseconds of GPU work, and
 * through the agent's loop it crosses threads four times (the caller
 * queues it to the loop, the loop to the launcher, the GPU's notice back
 * to the loop, the loop's end back to the caller); each crossing moves
 * tens of cache lines between cores (about 0.4 us each on the H200
 * hosts, tests/gpu/results/2026-11-28-h200-placement-739f3cf.txt), and
 * the loop was the busiest thread.  A direct read makes none of those
 * crossings: the caller plans its table (as before), takes the mapping
 * addresses from the lane, queues the launch and a mark on a stream of
 * the lane's (through the launcher where there is one: then it only
 * queues), and watches the mark's word itself.
 *
 * The loop stays the only thread that maps, asks for handles and gives
 * regions back.  It publishes each mapped region's address here after
 * every table op it ran, and before a mapping may go (a region given
 * back, the connection lost, the peer closing) it withdraws them under
 * the lane's lock and waits for the lane's streams: the direct reads in
 * flight end before any mapping they read closes.  Reads in flight when
 * the connection was lost or the peer closed fail, as the loop's own do
 * (ctx->lane_failed tells the agent which).
 *
 * Lock order: the segment's lane lock, then this lock, then the agent's
 * list of direct batches (taken by lane_failed).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "ipc_int.h"

#define LANE_STREAMS 4
#define WORD_GAP 8 /* uint64_t: one word per cache line */

struct sx__lane {
  pthread_mutex_t mu;
  int refs;                /* atomic: the peer's and each ticket's and segment's */
  cipc_t *t;               /* mu: NULL once the peer closed */
  const sx_region *lo;     /* the peer's descriptor's regions: compared, never read */
  uint32_t n;
  int open;                /* mu: direct reads go */
  int off;                 /* mu: never (no kernel, no stream writes) */
  int closed;              /* atomic: the peer closed, its streams waited for */
  int device;              /* mu: of bases and streams; -1 until the first publish */
  uint64_t *bases;         /* mu: per region of lo: its address on device, 0 none */
  sx__mem_stream *s[LANE_STREAMS]; /* mu */
  uint64_t issued[LANE_STREAMS];   /* mu: numbers handed out per stream */
  uint64_t *words;         /* pinned: stream k writes words[WORD_GAP * k] */
  size_t words_cap;
  unsigned rr;             /* mu */
};

static uint64_t direct_reads; /* atomic: tickets issued in this process */

uint64_t sx__ipc_direct_reads(void) {
  return __atomic_load_n(&direct_reads, __ATOMIC_RELAXED);
}

/* SX_IPC_DIRECT=0 keeps every read on the loop; unset or 1 (the
 * default) lets a read peer take direct reads.  Read per peer (when its
 * first table read runs), not per read. */
static int direct_env(void) {
  const char *e = getenv("SX_IPC_DIRECT");
  return e == NULL || strcmp(e, "0") != 0;
}

static uint64_t word(const sx__lane *l, unsigned k) {
  return __atomic_load_n(&l->words[WORD_GAP * k], __ATOMIC_ACQUIRE);
}

sx__lane *sx__ipc_lane(sx_tpeer *tp) {
  ipc_peer *p = (ipc_peer *)tp;
  if (p->lane != NULL) {
    pthread_mutex_lock(&p->lane->mu);
    int off = p->lane->off;
    pthread_mutex_unlock(&p->lane->mu);
    return off ? NULL : p->lane; /* off: no kernel or no stream writes here */
  }
  if (p->write || p->closing || p->t->spread || !direct_env())
    return NULL;
  sx__lane *l = calloc(1, sizeof(*l));
  if (l == NULL || (l->bases = calloc(p->remote->n_regions + 1, sizeof(uint64_t))) == NULL) {
    free(l);
    return NULL; /* no memory: reads go through the loop */
  }
  pthread_mutex_init(&l->mu, NULL);
  l->refs = 1;
  l->t = p->t;
  l->lo = p->remote->regions;
  l->n = p->remote->n_regions;
  l->device = -1;
  p->lane = l;
  return l;
}

void sx__ipc_lane_ref(sx__lane *l, int delta) {
  if (__atomic_add_fetch(&l->refs, delta, __ATOMIC_ACQ_REL) != 0)
    return;
  /* The last: the peer closed (its streams went then). */
  sx__mem_pinned_put(l->words, l->words_cap);
  free(l->bases);
  pthread_mutex_destroy(&l->mu);
  free(l);
}

/* mu held, loop thread: the streams and words on device; 0 or -1 (the
 * lane stays off). */
static int lane_start(sx__lane *l, int device) {
  void *w;
  size_t cap;
  if (!sx__mem_stream_marks(device) ||
      sx__mem_pinned_get(device, LANE_STREAMS * WORD_GAP * sizeof(uint64_t), &w, &cap) != 0)
    return -1;
  memset(w, 0, cap);
  l->words = w;
  l->words_cap = cap;
  for (unsigned k = 0; k < LANE_STREAMS; k++) {
    if (sx__mem_stream_create_on(device, l->t->launcher, &l->s[k]) != 0)
      return -1;
    /* With a launcher the caller only queues, and that thread launches. */
    sx__mem_stream_defer(l->s[k], l->t->launcher != NULL);
  }
  l->device = device;
  return 0;
}

void sx__ipc_lane_publish(ipc_peer *p, const iop *o, const uint64_t *bases) {
  sx__lane *l = p->lane;
  const sx_op *op = o->op;
  if (l == NULL)
    return;
  pthread_mutex_lock(&l->mu);
  if (!l->off && l->device < 0 && lane_start(l, op->tab_device) != 0)
    l->off = 1;
  if (!l->off && l->t != NULL && l->device == op->tab_device && p->state == C_READY) {
    for (uint32_t j = 0; j < op->n_rregs; j++)
      if (o->rix[j] < l->n)
        l->bases[o->rix[j]] = bases[j];
    l->open = 1;
  }
  pthread_mutex_unlock(&l->mu);
}

/* mu held, loop thread: stop direct reads and wait for those in flight;
 * done[k] receives stream k's word from before the wait.  1 when some
 * were in flight. */
static int lane_stop(sx__lane *l, uint64_t *done) {
  int some = 0;
  l->open = 0;
  memset(l->bases, 0, l->n * sizeof(uint64_t));
  for (unsigned k = 0; k < LANE_STREAMS; k++) {
    done[k] = l->s[k] != NULL ? word(l, k) : l->issued[k];
    if (done[k] < l->issued[k]) {
      some = 1;
      sx__mem_stream_sync(l->s[k]); /* briefly blocking the loop */
    }
  }
  return some;
}

void sx__ipc_lane_withdraw(ipc_peer *p, int err, const char *msg) {
  sx__lane *l = p->lane;
  if (l == NULL)
    return;
  uint64_t done[LANE_STREAMS];
  pthread_mutex_lock(&l->mu);
  if (lane_stop(l, done) && err != 0) {
    const sx_tctx *c = p->t->base.ctx;
    c->lane_failed(c->agent, l, done, LANE_STREAMS, err, msg);
  }
  pthread_mutex_unlock(&l->mu);
}

void sx__ipc_lane_close(ipc_peer *p, const char *msg) {
  sx__lane *l = p->lane;
  if (l == NULL)
    return;
  sx__ipc_lane_withdraw(p, SX_ECANCELED, msg);
  pthread_mutex_lock(&l->mu);
  for (unsigned k = 0; k < LANE_STREAMS; k++) {
    sx__mem_stream_destroy(l->s[k]);
    l->s[k] = NULL;
  }
  l->t = NULL;
  __atomic_store_n(&l->closed, 1, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&l->mu);
  p->lane = NULL;
  sx__ipc_lane_ref(l, -1);
}

int sx__ipc_lane_read(sx__lane *l, const sx_op *op, sx__lane_ticket *tk) {
  uint64_t bases[SX__GATHER_BASES];
  if (op->tab == NULL || op->n_rregs == 0 || op->n_rregs > SX__GATHER_BASES)
    return SX_EBUSY;
  pthread_mutex_lock(&l->mu);
  int rc = l->open && l->device == op->tab_device ? 0 : SX_EBUSY;
  for (uint32_t j = 0; j < op->n_rregs && rc == 0; j++) {
    const sx_region *R = op->rregs[j];
    uintptr_t a = (uintptr_t)R, lo = (uintptr_t)l->lo;
    /* Only regions of the peer's own descriptor (a segment opened on a
     * newer one of the same incarnation goes through the loop). */
    if (a < lo || a >= lo + (uintptr_t)l->n * sizeof(sx_region) ||
        (bases[j] = l->bases[(a - lo) / sizeof(sx_region)]) == 0)
      rc = SX_EBUSY;
  }
  void *ctx = NULL;
  if (rc == 0 && sx__mem_ctx_keep(&ctx) != 0)
    rc = SX_EBUSY;
  if (rc != 0) {
    pthread_mutex_unlock(&l->mu);
    return rc;
  }
  unsigned k = l->rr++ % LANE_STREAMS;
  sx__mem_stream *s = l->s[k];
  rc = sx__mem_gather_based(s, op->tab, op->n_tab, bases, op->n_rregs);
  if (rc == 0) {
    *tk = (sx__lane_ticket){.lane = l, .si = k, .no = ++l->issued[k]};
    if (sx__mem_stream_mark(s, &l->words[WORD_GAP * k], tk->no, &tk->err) != 0) {
      /* Cannot happen once the gather went (the driver is loaded): the
       * host writes the word once the stream is idle. */
      sx__mem_stream_sync(s);
      __atomic_store_n(&l->words[WORD_GAP * k], tk->no, __ATOMIC_RELEASE);
    }
    __atomic_add_fetch(&l->refs, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&direct_reads, 1, __ATOMIC_RELAXED);
  } else {
    if (rc == SX_ENOTSUP)
      l->off = 1; /* the kernel does not load here: the loop reads ranges */
    l->open = !l->off;
    rc = SX_EBUSY;
  }
  sx__mem_ctx_back(ctx);
  pthread_mutex_unlock(&l->mu);
  return rc;
}

int sx__ipc_lane_done(sx__lane *l, sx__lane_ticket *tk, int ask) {
  if (word(l, tk->si) >= tk->no || __atomic_load_n(&l->closed, __ATOMIC_ACQUIRE))
    return 1; /* closed: its stream was waited for (lane_failed said why) */
  if (!ask)
    return 0;
  pthread_mutex_lock(&l->mu);
  int st = 0; /* not known: still running */
  void *ctx = NULL;
  if (l->s[tk->si] != NULL && sx__mem_ctx_keep(&ctx) == 0) {
    st = sx__mem_stream_stopped(l->s[tk->si]);
    sx__mem_ctx_back(ctx);
  }
  pthread_mutex_unlock(&l->mu);
  if (st == 0)
    return word(l, tk->si) >= tk->no;
  /* Nothing left to run, and the word (maybe) not written: the copies
   * ended all the same, with the stream's error if it broke. */
  if (st < 0 && word(l, tk->si) < tk->no && __atomic_load_n(&tk->err, __ATOMIC_RELAXED) == 0)
    __atomic_store_n(&tk->err, st, __ATOMIC_RELAXED);
  return 1;
}

int sx__ipc_lane_watch(sx__lane *l, const sx__lane_ticket *tk, sx__mem_notice *note) {
  pthread_mutex_lock(&l->mu);
  int rc = 1;
  if (!__atomic_load_n(&l->closed, __ATOMIC_ACQUIRE) && l->s[tk->si] != NULL &&
      word(l, tk->si) < tk->no)
    rc = sx__mem_notify(l->s[tk->si], l->t->nf, note) == 0 ? 0 : -1;
  pthread_mutex_unlock(&l->mu);
  return rc;
}
