/*
 * Streams, completion notices and IPC handles (see mem.h).
 *
 * A notice is a host function queued on the stream (cuLaunchHostFunc): the
 * driver runs it on its own thread once the work before it finished.  It
 * makes no CUDA call (the driver forbids that there); it only appends the
 * notice to the notifier's list and wakes the loop through uv_async_send,
 * so completion costs no polling and no spinning core.
 */
#ifdef SX_HAVE_CUDA
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "mem_int.h"

struct sx__mem_notifier {
  uv_async_t async;
  pthread_mutex_t mu;
  sx__mem_notice *head, **tail; /* mu */
};

typedef struct notice_arg {
  sx__mem_notifier *n;
  sx__mem_notice *note;
} notice_arg;

static long ipc_open; /* atomic: mappings open now */

/* ------------------------------------------------------------ notices */

static void deliver(uv_async_t *h) {
  sx__mem_notifier *n = h->data;
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
  if (uv_async_init(loop, &n->async, deliver) != 0) {
    free(n);
    return sx__err(SX_EIO, "notifier: uv_async_init failed");
  }
  n->async.data = n;
  pthread_mutex_init(&n->mu, NULL);
  n->tail = &n->head;
  *out = n;
  return 0;
}

static void notifier_closed(uv_handle_t *h) {
  sx__mem_notifier *n = h->data;
  pthread_mutex_destroy(&n->mu);
  free(n);
}

void sx__mem_notifier_close(sx__mem_notifier *n) {
  if (n == NULL)
    return;
  deliver(&n->async);
  uv_close((uv_handle_t *)&n->async, notifier_closed);
}

void sx__mem_notice_post(sx__mem_notifier *n, sx__mem_notice *note) {
  note->next = NULL;
  pthread_mutex_lock(&n->mu);
  *n->tail = note;
  n->tail = &note->next;
  pthread_mutex_unlock(&n->mu);
  uv_async_send(&n->async);
}

/* The driver's thread: no CUDA calls here. */
static void CUDA_CB host_fn(void *arg) {
  notice_arg *a = arg;
  sx__mem_notifier *n = a->n;
  sx__mem_notice *note = a->note;
  free(a);
  sx__mem_notice_post(n, note);
}

int sx__mem_notify(sx__mem_stream *s, sx__mem_notifier *n, sx__mem_notice *note) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(s->device, &rc);
  if (d == NULL)
    return rc;
  notice_arg *a = malloc(sizeof(*a));
  if (a == NULL)
    return sx__err(SX_ENOMEM, "notice");
  a->n = n;
  a->note = note;
  CUresult r = d->LaunchHostFunc(s->s, host_fn, a);
  if (r != CUDA_SUCCESS) {
    free(a);
    return sx__cuda_err(d, r, "queueing a completion notice");
  }
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
