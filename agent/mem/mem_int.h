/*
 * The memory layer's insides: the CUDA driver table (filled by dlsym from
 * libcuda.so.1, or by a test's fake) and the per-device primary contexts.
 * Not installed.
 */
#ifndef SX_AGENT_MEM_INT_H
#define SX_AGENT_MEM_INT_H

#include "mem.h"

#ifdef SX_HAVE_CUDA
#include <cuda.h>

/* The driver calls the memory layer makes.  Names are the driver's minus
 * the "cu" prefix; the loader takes the versioned symbols cuda.h maps the
 * plain names to (cuMemAlloc_v2, ...), so the ABI is the one these types
 * describe. */
typedef struct sx__cuda_drv {
  CUresult (*Init)(unsigned flags);
  CUresult (*GetErrorString)(CUresult e, const char **s);
  CUresult (*GetErrorName)(CUresult e, const char **s);
  CUresult (*DeviceGetCount)(int *n);
  CUresult (*DeviceGet)(CUdevice *d, int ordinal);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext *c, CUdevice d);
  CUresult (*CtxSetCurrent)(CUcontext c);
  CUresult (*CtxGetCurrent)(CUcontext *c);
  CUresult (*PointerGetAttributes)(unsigned n, CUpointer_attribute *attrs, void **data,
                                   CUdeviceptr p);
  CUresult (*MemAlloc)(CUdeviceptr *p, size_t len);
  CUresult (*MemFree)(CUdeviceptr p);
  CUresult (*MemHostAlloc)(void **p, size_t len, unsigned flags);
  CUresult (*MemFreeHost)(void *p);
  CUresult (*Memcpy)(CUdeviceptr dst, CUdeviceptr src, size_t len);
  CUresult (*MemcpyAsync)(CUdeviceptr dst, CUdeviceptr src, size_t len, CUstream s);
  CUresult (*StreamCreate)(CUstream *s, unsigned flags);
  CUresult (*StreamDestroy)(CUstream s);
  CUresult (*StreamSynchronize)(CUstream s);
  CUresult (*LaunchHostFunc)(CUstream s, CUhostFn fn, void *arg);
  CUresult (*IpcGetMemHandle)(CUipcMemHandle *h, CUdeviceptr p);
  CUresult (*IpcOpenMemHandle)(CUdeviceptr *p, CUipcMemHandle h, unsigned flags);
  CUresult (*IpcCloseMemHandle)(CUdeviceptr p);
  /* Optional (CUDA 13 drivers; NULL where missing): many copies, one call. */
  CUresult (*MemcpyBatchAsync)(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                               size_t count, CUmemcpyAttributes *attrs, size_t *attrs_idx,
                               size_t n_attrs, CUstream s);
  /* Optional (NULL where missing: no gather kernel, copies as above):
   * the gather kernel's module, launches, events and peer access. */
  CUresult (*ModuleLoadData)(CUmodule *m, const void *image);
  CUresult (*ModuleGetFunction)(CUfunction *f, CUmodule m, const char *name);
  CUresult (*LaunchKernel)(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                           unsigned by, unsigned bz, unsigned shmem, CUstream s,
                           void **params, void **extra);
  CUresult (*EventCreate)(CUevent *e, unsigned flags);
  CUresult (*EventRecord)(CUevent e, CUstream s);
  CUresult (*EventSynchronize)(CUevent e);
  CUresult (*EventDestroy)(CUevent e);
  CUresult (*EventQuery)(CUevent e); /* polled notices (stream.c) */
  /* Optional (NULL where missing: notices polled by events): flagged
   * notices (stream.c), a word the stream writes behind its work. */
  CUresult (*StreamWriteValue64)(CUstream s, CUdeviceptr addr, cuuint64_t v, unsigned flags);
  CUresult (*StreamQuery)(CUstream s);
  CUresult (*CtxEnablePeerAccess)(CUcontext peer, unsigned flags);
  /* Optional (NULL where missing): GPUDirect RDMA through dma-buf
   * (dmabuf.c). */
  CUresult (*DeviceGetAttribute)(int *v, CUdevice_attribute a, CUdevice d);
  CUresult (*MemGetHandleForAddressRange)(void *handle, CUdeviceptr p, size_t len,
                                          CUmemRangeHandleType type, unsigned long long flags);
  CUresult (*PointerSetAttribute)(const void *v, CUpointer_attribute a, CUdeviceptr p);
  CUresult (*FlushGPUDirectRDMAWrites)(CUflushGPUDirectRDMAWritesTarget target,
                                       CUflushGPUDirectRDMAWritesScope scope);
} sx__cuda_drv;

/* A stream (stream.c); ring: the gather kernel's piece tables on it
 * (gather.c), NULL until its first launch.  With a launcher (l), its
 * launches and notices are queued to the launcher's thread (queued: jobs
 * not made yet), and err keeps the first job that failed for the next
 * notice. */
struct sx__mem_stream {
  CUstream s;
  int device;
  struct sx__gather_ring *ring;
  struct sx__mem_waiter *w; /* stream.c: event notices' thread, or NULL */
  sx__mem_launcher *l;
  long queued; /* atomic */
  int err;     /* atomic */
  int defer;   /* the owner's: queue to l now (sx__mem_stream_defer) */
};

/* launch.c: one job, made on the launcher's thread by run(j). */
typedef struct sx__mem_job {
  struct sx__mem_job *next;
  void (*run)(struct sx__mem_job *j);
  sx__mem_stream *s;
  void *a, *b;
  uint64_t x;
} sx__mem_job;
/* Does a call on s go to its launcher?  When the owner asked for it, or
 * while jobs of s are queued there (a call made now would pass them). */
static inline int sx__mem_deferred(const sx__mem_stream *s) {
  return s->l != NULL && (s->defer || __atomic_load_n(&s->queued, __ATOMIC_ACQUIRE) > 0);
}
/* Queue run(a, b, x) for s's launcher: 0, or -1 (no memory: the caller
 * drains s and makes the call itself). */
int sx__mem_launcher_queue(sx__mem_stream *s, void (*run)(sx__mem_job *j), void *a, void *b,
                           uint64_t x);
/* Wait until every job queued for s was made (any thread but the
 * launcher's): before a call made on s directly.  No-op without one. */
void sx__mem_launcher_drain(sx__mem_stream *s);
/* Launcher thread: a job of s failed with err (the first one counts). */
void sx__mem_stream_fail(sx__mem_stream *s, int err);
/* gather.c: free a stream's tables (its work has ended). */
void sx__gather_ring_free(const sx__cuda_drv *d, struct sx__gather_ring *r);
/* The ring's count of tables taken (0 without a ring), and: those taken
 * before mark have been read (their launches finished). */
uint64_t sx__gather_ring_mark(const struct sx__gather_ring *r);
void sx__gather_ring_passed(struct sx__gather_ring *r, uint64_t mark);
/* The retained primary context of device (NULL if not retained yet). */
CUcontext sx__cuda_ctx(int device);

/* The loaded driver (with its primary context of device made current on
 * this thread when device >= 0), or NULL with the error recorded. */
const sx__cuda_drv *sx__cuda_get(int device, int *err);
/* Record a driver error as SX_EIO "what: <driver message> (NAME)". */
int sx__cuda_err(const sx__cuda_drv *d, CUresult r, const char *what);

/* Tests: use this table instead of the driver (NULL: the driver again);
 * load this library name instead of libcuda.so.1 on the next use. */
void sx__mem_cuda_use(const sx__cuda_drv *fake);
void sx__mem_cuda_library(const char *name);
#endif

#endif
