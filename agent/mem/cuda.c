/*
 * The CUDA driver, loaded at run time: the table of driver calls, the
 * devices' primary contexts, pointer checks and the synchronous helpers.
 * See mem.h.
 */
#ifdef SX_HAVE_CUDA
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "mem_int.h"

#define MAX_DEVICES 64

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
/* mu: 0 not tried, 1 loaded, < 0 the load error.  Stored with release
 * and read with acquire outside mu by sx__cuda_get's fast path. */
static int state;
static char load_msg[256];   /* mu: why it failed */
static sx__cuda_drv real;
static const sx__cuda_drv *fake;
static const char *libname = "libcuda.so.1";
static void *lib;
static int n_devices;
/* Retained primary contexts: written under mu (release), read without it
 * by sx__cuda_get's fast path (acquire). */
static CUcontext ctx[MAX_DEVICES];
/* mu: the process's count of objects ever loaded when the driver was last
 * found not loaded (0: not known); see sx__mem_query. */
static unsigned long long absent_at;

void sx__mem_cuda_use(const sx__cuda_drv *f) {
  pthread_mutex_lock(&mu);
  fake = f;
  __atomic_store_n(&state, 0, __ATOMIC_RELEASE);
  absent_at = 0;
  memset(ctx, 0, sizeof(ctx));
  pthread_mutex_unlock(&mu);
}

void sx__mem_cuda_library(const char *name) {
  pthread_mutex_lock(&mu);
  libname = name;
  __atomic_store_n(&state, 0, __ATOMIC_RELEASE);
  absent_at = 0;
  memset(ctx, 0, sizeof(ctx));
  pthread_mutex_unlock(&mu);
}

int sx__cuda_err(const sx__cuda_drv *d, CUresult r, const char *what) {
  const char *s = NULL, *n = NULL;
  if (d->GetErrorString == NULL || d->GetErrorString(r, &s) != CUDA_SUCCESS)
    s = NULL;
  if (d->GetErrorName == NULL || d->GetErrorName(r, &n) != CUDA_SUCCESS)
    n = NULL;
  return sx__err(SX_EIO, "%s: %s (%s)", what, s ? s : "CUDA error", n ? n : "?");
}

/* mu held: dlopen the driver and fill `real`. */
static int load(void) {
  /* SX_CUDA_LIBRARY names another driver library (a driver outside the
   * loader's path, or the suite's host-memory stand-in). */
  const char *env = getenv("SX_CUDA_LIBRARY");
  if (env != NULL && *env != '\0' && strcmp(libname, "libcuda.so.1") == 0)
    libname = env;
  if (lib == NULL && (lib = dlopen(libname, RTLD_NOW | RTLD_LOCAL)) == NULL) {
    snprintf(load_msg, sizeof(load_msg), "no CUDA driver on this host (%s: %s)", libname,
             dlerror());
    return SX_ENODEV;
  }
  /* optional: NULL where the driver lacks it (the CUDA 13 batch copy: one
   * call for a batch's ranges; the gather kernel's module, launch, events
   * and peer access: without any of them, no kernel; GPUDirect RDMA through
   * dma-buf, dmabuf.c: without them, no dma-buf tier). */
  static const struct {
    const char *sym;
    size_t off;
    int optional;
  } syms[] = {
#define SYM(field, name) {name, offsetof(sx__cuda_drv, field), 0}
#define OPT(field, name) {name, offsetof(sx__cuda_drv, field), 1}
      SYM(Init, "cuInit"),
      SYM(GetErrorString, "cuGetErrorString"),
      SYM(GetErrorName, "cuGetErrorName"),
      SYM(DeviceGetCount, "cuDeviceGetCount"),
      SYM(DeviceGet, "cuDeviceGet"),
      SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
      SYM(CtxSetCurrent, "cuCtxSetCurrent"),
      OPT(CtxGetCurrent, "cuCtxGetCurrent"),
      SYM(PointerGetAttributes, "cuPointerGetAttributes"),
      SYM(MemAlloc, "cuMemAlloc_v2"),
      SYM(MemFree, "cuMemFree_v2"),
      SYM(MemHostAlloc, "cuMemHostAlloc"),
      SYM(MemFreeHost, "cuMemFreeHost"),
      SYM(Memcpy, "cuMemcpy"),
      SYM(MemcpyAsync, "cuMemcpyAsync"),
      SYM(StreamCreate, "cuStreamCreate"),
      SYM(StreamDestroy, "cuStreamDestroy_v2"),
      SYM(StreamSynchronize, "cuStreamSynchronize"),
      SYM(LaunchHostFunc, "cuLaunchHostFunc"),
      SYM(IpcGetMemHandle, "cuIpcGetMemHandle"),
      SYM(IpcOpenMemHandle, "cuIpcOpenMemHandle_v2"),
      SYM(IpcCloseMemHandle, "cuIpcCloseMemHandle"),
      OPT(MemcpyBatchAsync, "cuMemcpyBatchAsync_v2"),
      OPT(ModuleLoadData, "cuModuleLoadData"),
      OPT(ModuleGetFunction, "cuModuleGetFunction"),
      OPT(LaunchKernel, "cuLaunchKernel"),
      OPT(EventCreate, "cuEventCreate"),
      OPT(EventRecord, "cuEventRecord"),
      OPT(EventSynchronize, "cuEventSynchronize"),
      OPT(EventDestroy, "cuEventDestroy_v2"),
      OPT(EventQuery, "cuEventQuery"),
      OPT(StreamWriteValue64, "cuStreamWriteValue64_v2"),
      OPT(StreamQuery, "cuStreamQuery"),
      OPT(CtxEnablePeerAccess, "cuCtxEnablePeerAccess"),
      OPT(DeviceGetAttribute, "cuDeviceGetAttribute"),
      OPT(MemGetHandleForAddressRange, "cuMemGetHandleForAddressRange"),
      OPT(PointerSetAttribute, "cuPointerSetAttribute"),
      OPT(FlushGPUDirectRDMAWrites, "cuFlushGPUDirectRDMAWrites"),
#undef SYM
#undef OPT
  };
  for (size_t i = 0; i < SX__ARRAY_SIZE(syms); i++) {
    void *f = dlsym(lib, syms[i].sym);
    if (f == NULL && !syms[i].optional) {
      snprintf(load_msg, sizeof(load_msg), "the CUDA driver %s lacks %s (too old?)",
               libname, syms[i].sym);
      return SX_ENODEV;
    }
    memcpy((char *)&real + syms[i].off, &f, sizeof(f));
  }
  return 0;
}

/* mu held: the driver initialised, with at least one device. */
static int start(const sx__cuda_drv *d) {
  CUresult r = d->Init(0);
  if (r == CUDA_SUCCESS)
    r = d->DeviceGetCount(&n_devices);
  if (r != CUDA_SUCCESS) {
    const char *s = NULL;
    if (d->GetErrorString(r, &s) != CUDA_SUCCESS)
      s = "unknown error";
    snprintf(load_msg, sizeof(load_msg), "the CUDA driver does not start: %s", s);
    return SX_ENODEV;
  }
  if (n_devices <= 0) {
    snprintf(load_msg, sizeof(load_msg), "the CUDA driver sees no device");
    return SX_ENODEV;
  }
  if (n_devices > MAX_DEVICES)
    n_devices = MAX_DEVICES;
  return 0;
}

/* The driver loaded and device's context retained: the table, with the
 * context made current, and no lock (every launch and notice asks; the
 * load and the retain happen once, under mu, and publish with release).
 * NULL when the slow path must run. */
static const sx__cuda_drv *get_fast(int device, int *err) {
  if (__atomic_load_n(&state, __ATOMIC_ACQUIRE) != 1 || device >= n_devices)
    return NULL;
  CUcontext c = NULL;
  if (device >= 0 && (c = __atomic_load_n(&ctx[device], __ATOMIC_ACQUIRE)) == NULL)
    return NULL;
  const sx__cuda_drv *d = fake ? fake : &real;
  if (c != NULL) {
    CUresult r = d->CtxSetCurrent(c);
    if (r != CUDA_SUCCESS) {
      *err = sx__cuda_err(d, r, "making the primary context current");
      return NULL;
    }
  }
  *err = 0;
  return d;
}

const sx__cuda_drv *sx__cuda_get(int device, int *err) {
  const sx__cuda_drv *d = get_fast(device, err);
  if (d != NULL)
    return d;
  pthread_mutex_lock(&mu);
  d = fake ? fake : &real;
  if (state == 0) {
    int rc = fake ? 0 : load();
    if (rc == 0)
      rc = start(d);
    __atomic_store_n(&state, rc ? rc : 1, __ATOMIC_RELEASE);
  }
  int rc = state < 0 ? state : 0;
  const char *why = load_msg;
  char msg[64];
  if (rc == 0 && device >= 0 && device >= n_devices) {
    snprintf(msg, sizeof(msg), "no CUDA device %d (this host has %d)", device, n_devices);
    why = msg;
    rc = SX_ENODEV;
  }
  CUcontext c = NULL;
  if (rc == 0 && device >= 0 && (c = ctx[device]) == NULL) {
    CUdevice dev;
    CUresult r = d->DeviceGet(&dev, device);
    if (r == CUDA_SUCCESS)
      r = d->DevicePrimaryCtxRetain(&c, dev);
    if (r != CUDA_SUCCESS) {
      pthread_mutex_unlock(&mu);
      *err = sx__cuda_err(d, r, "retaining the primary context");
      return NULL;
    }
    __atomic_store_n(&ctx[device], c, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&mu);
  if (rc) {
    *err = sx__err(rc, "%s", why);
    return NULL;
  }
  if (c != NULL) {
    CUresult r = d->CtxSetCurrent(c);
    if (r != CUDA_SUCCESS) {
      *err = sx__cuda_err(d, r, "making the primary context current");
      return NULL;
    }
  }
  return d;
}

CUcontext sx__cuda_ctx(int device) {
  pthread_mutex_lock(&mu);
  CUcontext c = device >= 0 && device < MAX_DEVICES ? ctx[device] : NULL;
  pthread_mutex_unlock(&mu);
  return c;
}

int sx__mem_cuda_devices(int *n) {
  int rc;
  if (sx__cuda_get(-1, &rc) == NULL)
    return rc;
  *n = n_devices;
  return 0;
}

/* ------------------------------------------------------------ pointers */

typedef struct ptr_attrs {
  unsigned type;
  int ordinal;
  CUdeviceptr start;
  size_t size;
  unsigned long long managed; /* a boolean; wide so any width reads right */
} ptr_attrs;

static CUresult query(const sx__cuda_drv *d, const void *addr, ptr_attrs *a) {
  CUpointer_attribute at[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                              CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                              CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                              CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                              CU_POINTER_ATTRIBUTE_IS_MANAGED};
  memset(a, 0, sizeof(*a));
  void *data[] = {&a->type, &a->ordinal, &a->start, &a->size, &a->managed};
  CUresult r = d->PointerGetAttributes(5, at, data, (CUdeviceptr)(uintptr_t)addr);
  if (r == CUDA_ERROR_INVALID_CONTEXT) {
    /* Some drivers want a current context even for this: take device 0's. */
    int err;
    if ((d = sx__cuda_get(0, &err)) == NULL)
      return r;
    memset(a, 0, sizeof(*a));
    r = d->PointerGetAttributes(5, at, data, (CUdeviceptr)(uintptr_t)addr);
  }
  return r;
}

/* dl_iterate_phdr: the count of objects loaded so far (the first entry
 * carries it). */
static int adds_of(struct dl_phdr_info *info, size_t size, void *arg) {
  (void)size;
  *(unsigned long long *)arg = info->dlpi_adds;
  return 1;
}

void sx__mem_query(const void *addr, sx__mem_info *out) {
  *out = (sx__mem_info){.kind = SX__MEM_HOST, .device = -1};
  pthread_mutex_lock(&mu);
  int loaded = state == 1;
  if (state == 0 && fake == NULL) {
    /* Not used here yet: if nothing in this process loaded the driver
     * either (an engine's CUDA runtime would have), no pointer can be
     * device memory, and starting the driver just to learn that is slow.
     * Asking the dynamic loader costs a dlopen per query (a host read
     * queries every unregistered range), so the answer "not loaded" is
     * kept until the process loads another object. */
    unsigned long long adds = 0;
    dl_iterate_phdr(adds_of, &adds);
    if (absent_at == 0 || adds != absent_at) {
      void *h = dlopen(libname, RTLD_NOW | RTLD_NOLOAD);
      if (h != NULL)
        dlclose(h);
      loaded = h != NULL;
      absent_at = loaded ? 0 : adds;
    }
  }
  pthread_mutex_unlock(&mu);
  if (!loaded && fake == NULL)
    return;
  int err;
  const sx__cuda_drv *d = sx__cuda_get(-1, &err);
  ptr_attrs a;
  if (d == NULL || query(d, addr, &a) != CUDA_SUCCESS || a.type != CU_MEMORYTYPE_DEVICE)
    return;
  *out = (sx__mem_info){.kind = SX__MEM_CUDA, .device = a.ordinal,
                        .base = (uint64_t)a.start, .size = (uint64_t)a.size};
}

int sx__mem_check(const void *addr, uint64_t len, const char *location,
                  sx__mem_info *out) {
  sx__mem_info m;
  int rc = sx__mem_parse_location(location, &m);
  if (rc)
    return rc;
  if (m.kind == SX__MEM_HOST) {
    sx__mem_info q;
    sx__mem_query(addr, &q);
    if (q.kind == SX__MEM_CUDA)
      return sx__err(SX_EINVAL, "location is 'cpu' but %p is device memory of cuda:%d",
                     addr, q.device);
    *out = m;
    return 0;
  }
  const sx__cuda_drv *d = sx__cuda_get(-1, &rc);
  if (d == NULL)
    return sx__errwrap(rc, "location %s", location);
  if (m.device >= n_devices)
    return sx__err(SX_ENODEV, "location %s: no CUDA device %d (this host has %d)",
                   location, m.device, n_devices);
  ptr_attrs a;
  CUresult r = query(d, addr, &a);
  if (r != CUDA_SUCCESS)
    return sx__cuda_err(d, r, "checking the pointer");
  if (a.type != CU_MEMORYTYPE_DEVICE)
    return sx__err(SX_EINVAL, "location is %s but %p is not device memory (%s)", location,
                   addr, a.type == CU_MEMORYTYPE_HOST ? "pinned host memory"
                                                      : "unknown to the CUDA driver");
  if (a.managed)
    return sx__err(SX_EINVAL, "%p is CUDA managed memory, which segxfer does not "
                   "serve: use device memory (cudaMalloc)", addr);
  if (a.ordinal != m.device)
    return sx__err(SX_EINVAL, "location is %s but %p is memory of cuda:%d", location,
                   addr, a.ordinal);
  uint64_t p = (uint64_t)(uintptr_t)addr, end, aend;
  if (!sx__add_ok(p, len, &end) || !sx__add_ok(a.start, a.size, &aend) || p < a.start ||
      end > aend)
    return sx__err(SX_EBOUNDS, "%s range %p..+%lu is not inside one allocation (the "
                   "allocation at 0x%llx is %lu bytes)", location, addr,
                   (unsigned long)len, (unsigned long long)a.start,
                   (unsigned long)a.size);
  m.base = (uint64_t)a.start;
  m.size = (uint64_t)a.size;
  *out = m;
  return 0;
}

/* ------------------------------------------------------------ helpers */

int sx__mem_alloc(int device, size_t len, void **out) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(device, &rc);
  if (d == NULL)
    return rc;
  CUdeviceptr p;
  CUresult r = d->MemAlloc(&p, len);
  if (r != CUDA_SUCCESS)
    return sx__cuda_err(d, r, "allocating device memory");
  *out = (void *)(uintptr_t)p;
  return 0;
}

void sx__mem_free(void *p) {
  int rc;
  sx__mem_info m;
  sx__mem_query(p, &m);
  const sx__cuda_drv *d = p ? sx__cuda_get(m.device, &rc) : NULL;
  if (d != NULL)
    d->MemFree((CUdeviceptr)(uintptr_t)p);
}

int sx__mem_copy(void *dst, const void *src, size_t len) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(-1, &rc);
  if (d == NULL)
    return rc;
  sx__mem_info m;
  sx__mem_query(dst, &m);
  if (m.kind != SX__MEM_CUDA)
    sx__mem_query(src, &m);
  if (m.kind == SX__MEM_CUDA && sx__cuda_get(m.device, &rc) == NULL)
    return rc;
  CUresult r = d->Memcpy((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, len);
  return r == CUDA_SUCCESS ? 0 : sx__cuda_err(d, r, "copying");
}

int sx__mem_host_alloc(size_t len, void **out) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(0, &rc);
  if (d == NULL)
    return rc;
  /* Portable: pinned for every context, so any device's copies overlap. */
  CUresult r = d->MemHostAlloc(out, len, CU_MEMHOSTALLOC_PORTABLE);
  return r == CUDA_SUCCESS ? 0 : sx__cuda_err(d, r, "allocating pinned memory");
}

void sx__mem_host_free(void *p) {
  int rc;
  const sx__cuda_drv *d = p ? sx__cuda_get(-1, &rc) : NULL;
  if (d != NULL)
    d->MemFreeHost(p);
}
#else
typedef int sx__mem_cuda_unused; /* ISO C wants something in a file */
#endif
