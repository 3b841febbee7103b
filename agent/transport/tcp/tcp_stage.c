/*
 * Staging for GPU memory over TCP: the pinned chunk pools (one per
 * direction, bounded by sx_agent_params.staging_bytes, allocated as they
 * are first needed), the copy streams, and the lifetime of it all (see
 * tcp_stage.h).
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "tcp_int.h"
#include "tcp_stage.h"

#define CHUNK_MAX (1u << 20)
#define STREAMS 4      /* per device and direction */
#define MAX_DEVICES 64

typedef struct pool {
  uint32_t max, n;     /* chunks allowed, chunks allocated */
  void **all;          /* the n allocated, to free them */
  void *free;          /* free chunks, linked through their first bytes */
  uint32_t out;        /* chunks handed out */
  sx__stage_wait *wq, **wq_tail;
} pool;

struct sx__tcp_stage {
  tcp_t *t;
  sx__mem_notifier *nf;
  size_t chunk;
  pool pools[2];
  sx__mem_stream *streams[2][MAX_DEVICES][STREAMS];
  unsigned rr[2][MAX_DEVICES];
  uint32_t holds;      /* staged ops, replies and notices that are not over */
  void *sops;          /* tcp_stage_read.c's staged ops */
  int closing;
};

int sx__tcp_stage_get(tcp_t *t, sx__tcp_stage **out) {
  if (t->stage != NULL) {
    *out = t->stage;
    return 0;
  }
  if (t->closing)
    return sx__err(SX_ESHUTDOWN, "tcp: closing");
  sx__tcp_stage *s = calloc(1, sizeof(*s));
  if (s == NULL)
    return sx__err(SX_ENOMEM, "tcp: staging");
  uint64_t bytes = sx__tcp_ctx(t)->params->staging_bytes;
  if (bytes < (1u << 20))
    bytes = 1u << 20;
  s->chunk = bytes / 4 < CHUNK_MAX ? (size_t)(bytes / 4) : CHUNK_MAX;
  for (int d = 0; d < 2; d++) {
    pool *p = &s->pools[d];
    p->max = (uint32_t)(bytes / s->chunk);
    p->wq_tail = &p->wq;
    if ((p->all = calloc(p->max, sizeof(void *))) == NULL) {
      free(s->pools[0].all);
      free(s);
      return sx__err(SX_ENOMEM, "tcp: staging");
    }
  }
  int rc = sx__mem_notifier_create(t->loop, &s->nf);
  if (rc) {
    free(s->pools[0].all);
    free(s->pools[1].all);
    free(s);
    return rc;
  }
  s->t = t;
  t->stage = s;
  t->live++;
  *out = s;
  return 0;
}

size_t sx__stage_chunk_size(const sx__tcp_stage *s) { return s->chunk; }
void **sx__stage_sops(sx__tcp_stage *s) { return &s->sops; }
sx__mem_notifier *sx__stage_notifier(const sx__tcp_stage *s) { return s->nf; }
int sx__stage_closing(const sx__tcp_stage *s) { return s->closing; }
const sx_tctx *sx__stage_ctx(const sx__tcp_stage *s) { return sx__tcp_ctx(s->t); }

static void maybe_free(sx__tcp_stage *s) {
  if (!s->closing || s->holds > 0 || s->pools[0].out > 0 || s->pools[1].out > 0)
    return;
  for (int d = 0; d < 2; d++) {
    for (uint32_t i = 0; i < s->pools[d].n; i++)
      sx__mem_host_free(s->pools[d].all[i]);
    free(s->pools[d].all);
  }
  tcp_t *t = s->t;
  t->stage = NULL;
  free(s);
  t->live--;
  sx__tcp_maybe_free(t);
}

void sx__stage_hold(sx__tcp_stage *s) { s->holds++; }

void sx__stage_release(sx__tcp_stage *s) {
  s->holds--;
  maybe_free(s);
}

int sx__stage_chunk_get(sx__tcp_stage *s, int dir, sx__stage_wait *w, void **chunk) {
  pool *p = &s->pools[dir];
  if (p->free == NULL && p->n < p->max) {
    void *c;
    int rc = sx__mem_host_alloc(s->chunk, &c);
    if (rc == 0) {
      p->all[p->n++] = c;
      *(void **)c = p->free;
      p->free = c;
    } else if (p->out == 0) {
      return rc; /* none will come back to wait for */
    }
  }
  if (p->free != NULL) {
    void *c = p->free;
    p->free = *(void **)c;
    p->out++;
    *chunk = c;
    return 0;
  }
  w->next = NULL;
  *p->wq_tail = w;
  p->wq_tail = &w->next;
  return 1;
}

void sx__stage_chunk_put(sx__tcp_stage *s, int dir, void *chunk) {
  pool *p = &s->pools[dir];
  sx__stage_wait *w = p->wq;
  if (w != NULL && !s->closing) {
    /* Straight to the oldest waiter. */
    p->wq = w->next;
    if (p->wq == NULL)
      p->wq_tail = &p->wq;
    w->fn(w, chunk);
    return;
  }
  *(void **)chunk = p->free;
  p->free = chunk;
  p->out--;
  maybe_free(s);
}

void sx__stage_unwait(sx__tcp_stage *s, int dir, sx__stage_wait *w) {
  pool *p = &s->pools[dir];
  for (sx__stage_wait **pp = &p->wq; *pp; pp = &(*pp)->next) {
    if (*pp == w) {
      *pp = w->next;
      if (p->wq_tail == &w->next)
        p->wq_tail = pp;
      return;
    }
  }
}

int sx__stage_stream(sx__tcp_stage *s, int dir, int device, sx__mem_stream **out) {
  if (device < 0 || device >= MAX_DEVICES)
    return sx__err(SX_ENODEV, "tcp: no staging for device %d", device);
  unsigned k = s->rr[dir][device]++ % STREAMS;
  sx__mem_stream **sp = &s->streams[dir][device][k];
  if (*sp == NULL) {
    int rc = sx__mem_stream_create(device, sp);
    if (rc)
      return rc;
  }
  *out = *sp;
  return 0;
}

void sx__tcp_stage_close(tcp_t *t) {
  sx__tcp_stage *s = t->stage;
  if (s == NULL)
    return;
  sx__stage_read_abort_all(s, NULL, SX_ECANCELED);
  s->closing = 1;
  /* Waiters get nothing more: their owners were aborted or detached. */
  s->pools[0].wq = s->pools[1].wq = NULL;
  /* Every device copy finishes, then its notice runs (inside the close). */
  for (int d = 0; d < 2; d++)
    for (int dev = 0; dev < MAX_DEVICES; dev++)
      for (int k = 0; k < STREAMS; k++)
        sx__mem_stream_destroy(s->streams[d][dev][k]);
  memset(s->streams, 0, sizeof(s->streams));
  s->holds++;
  sx__mem_notifier_close(s->nf);
  s->nf = NULL;
  sx__stage_release(s); /* frees it unless chunks are still in writes */
}
