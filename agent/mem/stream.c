/*
 * Streams, completion notices and IPC handles (see mem.h).
 *
 * A notice is a host function queued on the stream (cuLaunchHostFunc): the
 * driver runs it on its own thread once the work before it finished.  It
 * makes no CUDA call (the driver forbids that there); it only appends the
 * notice to the notifier's list and wakes the loop through an eventfd the
 * loop polls (wake.h: not a uv_async_t, whose libuv 1.44 makes the loop
 * spin), so completion costs no polling and no spinning core.
 *
 * A host function holds its stream until it returned, so the work queued
 * behind it waits for the driver's thread to wake.  With SX_GPU_NOTICE=event
 * a notice is an event recorded on the stream instead (blocking sync: the
 * waiting thread sleeps until the GPU signals it) and a thread of the
 * stream's own waits for its events in order and posts their notices: the
 * stream runs on meanwhile.
 */
#ifdef SX_HAVE_CUDA
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "mem_int.h"
#include "wake.h"

struct sx__mem_notifier {
  sx__wake wake; /* readable while notices wait */
  pthread_mutex_t mu;
  sx__mem_notice *head, **tail; /* mu */
};

static long ipc_open; /* atomic: mappings open now */

/* SX_GPU_NOTICE=event: a stream's notices by events and a thread. */
typedef struct wait_item {
  struct wait_item *next;
  CUevent ev;
  sx__mem_notifier *n;
  sx__mem_notice *note;
} wait_item;

struct sx__mem_waiter {
  pthread_t th;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  wait_item *head, **tail, *spare; /* mu */
  int stop;                        /* mu */
  int device;
};

/* ------------------------------------------------------------ notices */

static void notifier_closed(uv_handle_t *h) {
  sx__mem_notifier *n = (sx__mem_notifier *)((char *)h - offsetof(sx__mem_notifier, wake.poll));
  sx__wake_release(&n->wake);
  pthread_mutex_destroy(&n->mu);
  free(n);
}

/* Take the whole list and run it (the wake already drained: a notice
 * posted after that either is in the list taken here or woke again). */
static void deliver(sx__wake *w) {
  sx__mem_notifier *n = (sx__mem_notifier *)((char *)w - offsetof(sx__mem_notifier, wake));
  pthread_mutex_lock(&n->mu);
  sx__mem_notice *list = n->head;
  n->head = NULL;
  n->tail = &n->head;
  pthread_mutex_unlock(&n->mu);
  while (list != NULL) {
    sx__mem_notice *note = list;
    list = note->next;
    note->fn(note);
  }
}

int sx__mem_notifier_create(uv_loop_t *loop, sx__mem_notifier **out) {
  sx__mem_notifier *n = calloc(1, sizeof(*n));
  if (n == NULL)
    return sx__err(SX_ENOMEM, "notifier");
  pthread_mutex_init(&n->mu, NULL);
  n->tail = &n->head;
  int rc = sx__wake_init(loop, &n->wake, deliver);
  if (rc != 0) {
    if (n->wake.fd >= 0) {
      sx__wake_close(&n->wake, notifier_closed); /* frees n */
      return rc;
    }
    pthread_mutex_destroy(&n->mu);
    free(n);
    return rc;
  }
  *out = n;
  return 0;
}

void sx__mem_notifier_close(sx__mem_notifier *n) {
  if (n == NULL)
    return;
  sx__wake_drain(&n->wake);
  deliver(&n->wake);
  sx__wake_close(&n->wake, notifier_closed);
}

void sx__mem_notice_post(sx__mem_notifier *n, sx__mem_notice *note) {
  note->next = NULL;
  pthread_mutex_lock(&n->mu);
  /* One wake per list: deliver() takes the whole list, so a notice queued
   * behind others rides on the wake the first one sent (or is about to
   * send, right after its unlock).  Each wake is a write(2) here and a
   * read(2) on the loop (as in call.c's enqueue). */
  int first = n->head == NULL;
  *n->tail = note;
  n->tail = &note->next;
  pthread_mutex_unlock(&n->mu);
  if (first)
    sx__wake_send(&n->wake);
}

/* The driver's thread: no CUDA calls here.  The notice carries its
 * notifier, so queueing one allocates nothing. */
static void CUDA_CB host_fn(void *arg) {
  sx__mem_notice *note = arg;
  sx__mem_notice_post(note->nf, note);
}

static void *waiter_main(void *arg) {
  struct sx__mem_waiter *w = arg;
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(w->device, &rc);
  pthread_mutex_lock(&w->mu);
  for (;;) {
    while (w->head == NULL && !w->stop)
      pthread_cond_wait(&w->cv, &w->mu);
    wait_item *it = w->head;
    if (it == NULL)
      break;
    pthread_mutex_unlock(&w->mu);
    /* Blocks until the GPU passed the event (an error means the stream is
     * broken: the notice comes anyway, as a host function's would not). */
    if (d != NULL)
      d->EventSynchronize(it->ev);
    sx__mem_notice_post(it->n, it->note);
    pthread_mutex_lock(&w->mu);
    w->head = it->next;
    if (w->head == NULL)
      w->tail = &w->head;
    it->next = w->spare;
    w->spare = it;
  }
  pthread_mutex_unlock(&w->mu);
  return NULL;
}

static int notice_events(void) {
  static int mode = -1; /* 0 host functions, 1 events */
  if (mode < 0) {
    const char *e = getenv("SX_GPU_NOTICE");
    mode = e != NULL && strcmp(e, "event") == 0;
  }
  return mode;
}

/* Queue note behind s as an event its waiter thread waits for: 0, or 1
 * when that cannot be done (a host function then). */
static int notify_event(const sx__cuda_drv *d, sx__mem_stream *s, sx__mem_notifier *n,
                        sx__mem_notice *note) {
  if (d->EventCreate == NULL || d->EventRecord == NULL || d->EventSynchronize == NULL ||
      d->EventDestroy == NULL)
    return 1;
  struct sx__mem_waiter *w = s->w;
  if (w == NULL) {
    if ((w = calloc(1, sizeof(*w))) == NULL)
      return 1;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->tail = &w->head;
    w->device = s->device;
    if (pthread_create(&w->th, NULL, waiter_main, w) != 0) {
      pthread_mutex_destroy(&w->mu);
      pthread_cond_destroy(&w->cv);
      free(w);
      return 1;
    }
    s->w = w;
  }
  pthread_mutex_lock(&w->mu);
  wait_item *it = w->spare;
  if (it != NULL)
    w->spare = it->next;
  pthread_mutex_unlock(&w->mu);
  if (it == NULL) {
    if ((it = calloc(1, sizeof(*it))) == NULL)
      return 1;
    if (d->EventCreate(&it->ev, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING) !=
        CUDA_SUCCESS) {
      free(it);
      return 1;
    }
  }
  if (d->EventRecord(it->ev, s->s) != CUDA_SUCCESS) {
    d->EventDestroy(it->ev);
    free(it);
    return 1;
  }
  it->n = n;
  it->note = note;
  it->next = NULL;
  pthread_mutex_lock(&w->mu);
  *w->tail = it;
  w->tail = &it->next;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
  return 0;
}

/* The stream's work has ended: its waiter posts what is left and goes. */
static void waiter_stop(const sx__cuda_drv *d, struct sx__mem_waiter *w) {
  if (w == NULL)
    return;
  pthread_mutex_lock(&w->mu);
  w->stop = 1;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
  pthread_join(w->th, NULL);
  while (w->spare != NULL) {
    wait_item *it = w->spare;
    w->spare = it->next;
    d->EventDestroy(it->ev);
    free(it);
  }
  pthread_mutex_destroy(&w->mu);
  pthread_cond_destroy(&w->cv);
  free(w);
}

int sx__mem_notify(sx__mem_stream *s, sx__mem_notifier *n, sx__mem_notice *note) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(s->device, &rc);
  if (d == NULL)
    return rc;
  if (notice_events() && notify_event(d, s, n, note) == 0)
    return 0;
  note->nf = n;
  CUresult r = d->LaunchHostFunc(s->s, host_fn, note);
  if (r != CUDA_SUCCESS)
    return sx__cuda_err(d, r, "queueing a completion notice");
  return 0;
}

/* ------------------------------------------------------------ streams */

int sx__mem_stream_create(int device, sx__mem_stream **out) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(device, &rc);
  if (d == NULL)
    return rc;
  sx__mem_stream *s = calloc(1, sizeof(*s));
  if (s == NULL)
    return sx__err(SX_ENOMEM, "stream");
  s->device = device;
  CUresult r = d->StreamCreate(&s->s, CU_STREAM_NON_BLOCKING);
  if (r != CUDA_SUCCESS) {
    free(s);
    return sx__cuda_err(d, r, "creating a stream");
  }
  *out = s;
  return 0;
}

void sx__mem_stream_destroy(sx__mem_stream *s) {
  int rc;
  if (s == NULL)
    return;
  const sx__cuda_drv *d = sx__cuda_get(s->device, &rc);
  if (d != NULL) {
    d->StreamSynchronize(s->s);
    waiter_stop(d, s->w);
    sx__gather_ring_free(d, s->ring);
    d->StreamDestroy(s->s);
  }
  free(s);
}

int sx__mem_stream_device(const sx__mem_stream *s) { return s->device; }

int sx__mem_copy_async(sx__mem_stream *s, void *dst, const void *src, size_t len) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(s->device, &rc);
  if (d == NULL)
    return rc;
  CUresult r = d->MemcpyAsync((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src,
                              len, s->s);
  return r == CUDA_SUCCESS ? 0 : sx__cuda_err(d, r, "queueing a copy");
}

int sx__mem_stream_sync(sx__mem_stream *s) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(s->device, &rc);
  if (d == NULL)
    return rc;
  CUresult r = d->StreamSynchronize(s->s);
  return r == CUDA_SUCCESS ? 0 : sx__cuda_err(d, r, "waiting for a stream");
}

/* ------------------------------------------------------------ IPC */

int sx__mem_ipc_export(const void *addr, uint8_t handle[SX__MEM_IPC_HANDLE]) {
  int rc;
  sx__mem_info m;
  sx__mem_query(addr, &m);
  if (m.kind != SX__MEM_CUDA)
    return sx__err(SX_EINVAL, "IPC: %p is not device memory", addr);
  const sx__cuda_drv *d = sx__cuda_get(m.device, &rc);
  if (d == NULL)
    return rc;
  CUipcMemHandle h;
  CUresult r = d->IpcGetMemHandle(&h, (CUdeviceptr)m.base);
  if (r != CUDA_SUCCESS)
    return sx__cuda_err(d, r, "exporting an IPC handle (memory from cudaMalloc/cuMemAlloc "
                        "can be exported; pooled or VMM allocations may not)");
  _Static_assert(sizeof(h) == SX__MEM_IPC_HANDLE, "CUipcMemHandle is 64 bytes");
  memcpy(handle, &h, sizeof(h));
  return 0;
}

int sx__mem_ipc_open(int device, const uint8_t handle[SX__MEM_IPC_HANDLE], void **out,
                     uint64_t *size) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(device, &rc);
  if (d == NULL)
    return rc;
  CUipcMemHandle h;
  memcpy(&h, handle, sizeof(h));
  CUdeviceptr p;
  CUresult r = d->IpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  if (r != CUDA_SUCCESS)
    return sx__cuda_err(d, r, "opening an IPC handle");
  /* How much was mapped is the driver's to say: the exporter's record may
   * claim more, and a copy past the mapping would reach this process's
   * own device memory. */
  sx__mem_info m;
  sx__mem_query((void *)(uintptr_t)p, &m);
  if (m.kind != SX__MEM_CUDA || m.base != (uint64_t)p || m.size == 0) {
    d->IpcCloseMemHandle(p);
    return sx__err(SX_EIO, "opening an IPC handle: the driver does not say how large "
                   "the mapping is");
  }
  *size = m.size;
  __atomic_add_fetch(&ipc_open, 1, __ATOMIC_RELAXED);
  *out = (void *)(uintptr_t)p;
  return 0;
}

void sx__mem_ipc_close(int device, void *p) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(device, &rc);
  if (d == NULL || p == NULL)
    return;
  d->IpcCloseMemHandle((CUdeviceptr)(uintptr_t)p);
  __atomic_sub_fetch(&ipc_open, 1, __ATOMIC_RELAXED);
}

long sx__mem_ipc_open_count(void) { return __atomic_load_n(&ipc_open, __ATOMIC_RELAXED); }
#else
typedef int sx__mem_stream_unused; /* ISO C wants something in a file */
#endif
