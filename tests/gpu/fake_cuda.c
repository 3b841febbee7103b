/*
 * A stand-in for libcuda.so.1 built on host memory, so the GPU code paths
 * (staging, cuda_ipc, the programs) also run, under the sanitizers and
 * valgrind, on machines without a GPU:
 *   SX_CUDA_LIBRARY=build/tests/gpu/libfakecuda.so build/tests/gpu/test_gpu_tcp
 * It is no GPU: results on it say nothing about real CUDA behaviour or
 * speed, and the suite's results under tests/gpu/results/ come from real
 * GPUs only.
 *
 * "Device memory" is shared memory (memfd), so IPC handles work between
 * processes (the importer maps the exporter's memfd through /proc/PID/fd).
 * Each stream is a worker thread running its queue in order: copies are
 * memcpy, host functions are called there (as the driver's own thread
 * would).  FAKE_CUDA_DEVICES (default 2) sets the device count,
 * FAKE_CUDA_DELAY_US slows every asynchronous copy down, FAKE_CUDA_PCI
 * gives the devices' PCI addresses (the RDMA transport's NIC choice).
 *
 * The memory layer's gather kernels "run" too: cuModuleLoadData accepts
 * only a PTX image with the entries sx_gather, sx_gather_strided and
 * sx_gather_based, and a launch is done on the stream's thread by copying
 * each piece of the table the kernel would read (sx_gather: dst, src, len;
 * sx_gather_strided: dst, src, len, count, dstride, sstride;
 * sx_gather_based: dst, src, len, region, from base[region] + src, the 16
 * bases a parameter; agent/mem/gather.cu), read when the launch runs, as
 * the GPU reads it.  A based table is also checked at launch (its writer
 * is done by then): a len outside 1..64 KiB, or a region past 16 or naming
 * a null base, fails the launch with CUDA_ERROR_INVALID_VALUE.  Events are markers in a stream's queue.
 * FAKE_CUDA_NO_BATCH=1 makes the batch copy refuse (as a driver whose
 * rules differ), FAKE_CUDA_NO_KERNEL=1 makes the module refuse to load,
 * FAKE_CUDA_NO_EVENTS=1 makes cuEventCreate refuse (a driver without
 * events: notices fall back to host functions, gathers to the copies).
 * FAKE_CUDA_FAIL_LAUNCH=1 makes every kernel launch fail (as a driver
 * whose launch is refused: the batch must fail, not complete).
 * FAKE_CUDA_NO_MEMOPS=1 refuses cuStreamWriteValue64 (notices are polled
 * by events then), FAKE_CUDA_LOSE_WRITES=1 accepts it and never writes
 * (a stream that broke first: the notice must come all the same).
 * FAKE_CUDA_NO_COPY=1 moves no bytes at all (asynchronous copies and
 * launches only keep their order): for profiling segxfer's own CPU cost
 * per batch, never for tests.
 *
 * GPUDirect through dma-buf is played as far as host memory can (see the
 * dma-buf section below): exports are dups of an allocation's memfd, for
 * the RDMA suite's provider shim (tests/rdma/sx_ibv_shim.c).
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef struct alloc {
  uintptr_t base;
  size_t size;
  int device;    /* -1: pinned host memory */
  int fd;        /* memfd of device memory, -1 for host or imported */
  int imported;
  struct alloc *next;
} alloc;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static alloc *allocs;
static __thread int cur_dev;

typedef struct op {
  struct op *next;
  void *dst;
  const void *src;
  size_t len;
  CUhostFn fn;
  void *arg;
  const uint64_t *table; /* a gather launch: n pieces of (dst, src, len) */
  uint64_t n;
  int strided;           /* ... or of (dst, src, len, count, dstride, sstride) */
  int based;             /* ... or of sx_bpiece, from bases[region] + src */
  uint64_t bases[16];
  struct event *ev;      /* an event record */
  uint64_t *word;        /* a cuStreamWriteValue64: value stored at word */
  uint64_t value;
} op;

typedef struct event {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  unsigned recorded, reached; /* records queued, records the stream passed */
} event;

typedef struct stream {
  pthread_t th;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  op *head, **tail;
  int busy, stop;
} stream;

static int devices(void) {
  const char *e = getenv("FAKE_CUDA_DEVICES");
  return e ? atoi(e) : 2;
}

static alloc *find(uintptr_t p) {
  for (alloc *a = allocs; a; a = a->next)
    if (p >= a->base && p < a->base + a->size)
      return a;
  return NULL;
}

static void add(uintptr_t base, size_t size, int device, int fd, int imported) {
  alloc *a = calloc(1, sizeof(*a));
  *a = (alloc){base, size, device, fd, imported, NULL};
  pthread_mutex_lock(&mu);
  a->next = allocs;
  allocs = a;
  pthread_mutex_unlock(&mu);
}

static alloc *take(uintptr_t base) {
  pthread_mutex_lock(&mu);
  for (alloc **pp = &allocs; *pp; pp = &(*pp)->next) {
    if ((*pp)->base == base) {
      alloc *a = *pp;
      *pp = a->next;
      pthread_mutex_unlock(&mu);
      return a;
    }
  }
  pthread_mutex_unlock(&mu);
  return NULL;
}

EXPORT CUresult cuInit(unsigned f) {
  (void)f;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuGetErrorString(CUresult e, const char **s) {
  *s = e == CUDA_ERROR_INVALID_VALUE ? "invalid argument" : "fake CUDA error";
  return CUDA_SUCCESS;
}
EXPORT CUresult cuGetErrorName(CUresult e, const char **s) {
  *s = e == CUDA_ERROR_INVALID_VALUE ? "CUDA_ERROR_INVALID_VALUE" : "CUDA_ERROR_FAKE";
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetCount(int *n) {
  *n = devices();
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGet(CUdevice *d, int o) {
  if (o < 0 || o >= devices())
    return CUDA_ERROR_INVALID_DEVICE;
  *d = o;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
  *c = (CUcontext)(uintptr_t)(d + 1);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxSetCurrent(CUcontext c) {
  cur_dev = (int)(uintptr_t)c - 1;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetCurrent(CUcontext *c) {
  *c = (CUcontext)(uintptr_t)(cur_dev + 1);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuPointerGetAttributes(unsigned n, CUpointer_attribute *at, void **data,
                                       CUdeviceptr p) {
  pthread_mutex_lock(&mu);
  alloc *a = find((uintptr_t)p);
  alloc copy = a ? *a : (alloc){0};
  pthread_mutex_unlock(&mu);
  for (unsigned i = 0; i < n; i++) {
    switch (at[i]) {
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
      *(unsigned *)data[i] = !a ? 0 : copy.device < 0 ? CU_MEMORYTYPE_HOST
                                                       : CU_MEMORYTYPE_DEVICE;
      break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
      *(int *)data[i] = a ? (copy.device < 0 ? 0 : copy.device) : -2;
      break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
      *(CUdeviceptr *)data[i] = copy.base;
      break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
      *(size_t *)data[i] = copy.size;
      break;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
      *(unsigned char *)data[i] = 0;
      break;
    default:
      return CUDA_ERROR_INVALID_VALUE;
    }
  }
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t len) {
  int fd = memfd_create("fake-cuda", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)len) != 0)
    return CUDA_ERROR_OUT_OF_MEMORY;
  void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  add((uintptr_t)m, len, cur_dev, fd, 0);
  *p = (CUdeviceptr)(uintptr_t)m;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
  alloc *a = take((uintptr_t)p);
  if (a == NULL || a->device < 0 || a->imported) {
    free(a);
    return CUDA_ERROR_INVALID_VALUE;
  }
  munmap((void *)a->base, a->size);
  close(a->fd);
  free(a);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemHostAlloc(void **p, size_t len, unsigned flags) {
  (void)flags;
  void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED)
    return CUDA_ERROR_OUT_OF_MEMORY;
  add((uintptr_t)m, len, -1, -1, 0);
  *p = m;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemFreeHost(void *p) {
  alloc *a = take((uintptr_t)p);
  if (a == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  munmap(p, a->size);
  free(a);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t len) {
  memmove((void *)(uintptr_t)d, (const void *)(uintptr_t)s, len);
  return CUDA_SUCCESS;
}

/* ------------------------------------------------------------ streams */

/* One entry of sx_gather_based (gather.cu's sx_bpiece). */
typedef struct bpiece {
  uint64_t dst, src;
  uint32_t len, region, e0, e1;
} bpiece;

/* One entry of sx_gather_strided: what the kernel would copy.  The
 * kernel indexes an entry's elements with 32 bits, so the host keeps an
 * entry within 64 KiB (agent/mem/gather.c): a larger one is the host's bug,
 * which a GPU would copy wrongly, so it stops the process here. */
static void strided_piece(const uint64_t *e) {
  uint64_t dst = e[0], src = e[1], len = e[2], count = e[3], ds = e[4], ss = e[5];
  if (count == 0 || len == 0 || (count > 1 && len * count > (64u << 10))) {
    fprintf(stderr, "fake_cuda: a strided gather entry of %lu pieces of %lu bytes\n",
            (unsigned long)count, (unsigned long)len);
    abort();
  }
  for (uint64_t k = 0; k < count; k++)
    memmove((void *)(uintptr_t)(dst + k * ds), (const void *)(uintptr_t)(src + k * ss), len);
}

static void *worker(void *arg) {
  stream *s = arg;
  const char *e = getenv("FAKE_CUDA_DELAY_US");
  int delay = e ? atoi(e) : 0;
  e = getenv("FAKE_CUDA_NO_COPY");
  int no_copy = e != NULL && strcmp(e, "1") == 0;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (s->head == NULL && !s->stop)
      pthread_cond_wait(&s->cv, &s->mu);
    if (s->head == NULL)
      break;
    op *o = s->head;
    s->head = o->next;
    if (s->head == NULL)
      s->tail = &s->head;
    s->busy = 1;
    pthread_mutex_unlock(&s->mu);
    if (o->word != NULL) {
      __atomic_store_n(o->word, o->value, __ATOMIC_RELEASE);
    } else if (o->ev != NULL) {
      pthread_mutex_lock(&o->ev->mu);
      o->ev->reached++;
      pthread_cond_broadcast(&o->ev->cv);
      pthread_mutex_unlock(&o->ev->mu);
    } else if (o->table != NULL && o->based) {
      if (delay)
        usleep((useconds_t)delay);
      const bpiece *t = (const bpiece *)o->table;
      for (uint64_t i = 0; i < o->n && !no_copy; i++)
        memmove((void *)(uintptr_t)t[i].dst,
                (const void *)(uintptr_t)(o->bases[t[i].region] + t[i].src), t[i].len);
    } else if (o->table != NULL && o->strided) {
      if (delay)
        usleep((useconds_t)delay);
      for (uint64_t i = 0; i < o->n && !no_copy; i++)
        strided_piece(o->table + 6 * i);
    } else if (o->table != NULL) {
      if (delay)
        usleep((useconds_t)delay);
      for (uint64_t i = 0; i < o->n && !no_copy; i++)
        memmove((void *)(uintptr_t)o->table[3 * i], (const void *)(uintptr_t)o->table[3 * i + 1],
                (size_t)o->table[3 * i + 2]);
    } else if (o->fn != NULL) {
      o->fn(o->arg);
    } else {
      if (delay)
        usleep((useconds_t)delay);
      if (!no_copy)
        memmove(o->dst, o->src, o->len);
    }
    free(o);
    pthread_mutex_lock(&s->mu);
    s->busy = 0;
    pthread_cond_broadcast(&s->cv);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

static CUresult enqueue(CUstream h, op *o) {
  stream *s = (stream *)h;
  if (s == NULL)
    return CUDA_ERROR_INVALID_HANDLE;
  pthread_mutex_lock(&s->mu);
  o->next = NULL;
  *s->tail = o;
  s->tail = &o->next;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamCreate(CUstream *out, unsigned flags) {
  (void)flags;
  stream *s = calloc(1, sizeof(*s));
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  s->tail = &s->head;
  pthread_create(&s->th, NULL, worker, s);
  *out = (CUstream)s;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamSynchronize(CUstream h) {
  stream *s = (stream *)h;
  pthread_mutex_lock(&s->mu);
  while (s->head != NULL || s->busy)
    pthread_cond_wait(&s->cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
  return CUDA_SUCCESS;
}

/* Not ready while anything is queued or running. */
EXPORT CUresult cuStreamQuery(CUstream h) {
  stream *s = (stream *)h;
  pthread_mutex_lock(&s->mu);
  int idle = s->head == NULL && !s->busy;
  pthread_mutex_unlock(&s->mu);
  return idle ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

/* FAKE_CUDA_NO_MEMOPS=1: refused, as by a driver or device without stream
 * memory operations; FAKE_CUDA_LOSE_WRITES=1: accepted but never written,
 * as by a stream that broke before it got there. */
EXPORT CUresult cuStreamWriteValue64_v2(CUstream h, CUdeviceptr addr, cuuint64_t v,
                                        unsigned flags) {
  const char *no = getenv("FAKE_CUDA_NO_MEMOPS"), *lose = getenv("FAKE_CUDA_LOSE_WRITES");
  if (no != NULL && strcmp(no, "1") == 0)
    return CUDA_ERROR_NOT_SUPPORTED;
  if (flags != 0 || addr == 0 || addr % 8 != 0)
    return CUDA_ERROR_INVALID_VALUE;
  if (lose != NULL && strcmp(lose, "1") == 0)
    return CUDA_SUCCESS;
  op *o = calloc(1, sizeof(*o));
  o->word = (uint64_t *)(uintptr_t)addr;
  o->value = v;
  return enqueue(h, o);
}

EXPORT CUresult cuStreamDestroy_v2(CUstream h) {
  stream *s = (stream *)h;
  cuStreamSynchronize(h);
  pthread_mutex_lock(&s->mu);
  s->stop = 1;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  pthread_join(s->th, NULL);
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->cv);
  free(s);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr src, size_t len, CUstream h) {
  op *o = calloc(1, sizeof(*o));
  o->dst = (void *)(uintptr_t)d;
  o->src = (const void *)(uintptr_t)src;
  o->len = len;
  return enqueue(h, o);
}

EXPORT CUresult cuLaunchHostFunc(CUstream h, CUhostFn fn, void *arg) {
  op *o = calloc(1, sizeof(*o));
  o->fn = fn;
  o->arg = arg;
  return enqueue(h, o);
}

/* ------------------------------------------------------------ IPC */

typedef struct fake_handle {
  uint32_t magic, pid;
  int32_t fd, device;
  uint64_t size;
} fake_handle;

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
  pthread_mutex_lock(&mu);
  alloc *a = find((uintptr_t)p);
  fake_handle f = {0x46414b45, (uint32_t)getpid(), a ? a->fd : -1, a ? a->device : 0,
                   a ? a->size : 0};
  pthread_mutex_unlock(&mu);
  if (a == NULL || a->fd < 0 || a->base != (uintptr_t)p)
    return CUDA_ERROR_INVALID_VALUE;
  memset(h, 0, sizeof(*h));
  memcpy(h->reserved, &f, sizeof(f));
  return CUDA_SUCCESS;
}

EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags) {
  (void)flags;
  fake_handle f;
  memcpy(&f, h.reserved, sizeof(f));
  if (f.magic != 0x46414b45)
    return CUDA_ERROR_INVALID_HANDLE;
  if (f.pid == (uint32_t)getpid())
    return CUDA_ERROR_INVALID_CONTEXT; /* as CUDA: not in the exporting process */
  char path[64];
  snprintf(path, sizeof(path), "/proc/%u/fd/%d", f.pid, f.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0)
    return CUDA_ERROR_MAP_FAILED;
  void *m = mmap(NULL, f.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED)
    return CUDA_ERROR_MAP_FAILED;
  add((uintptr_t)m, f.size, f.device, -1, 1);
  *p = (CUdeviceptr)(uintptr_t)m;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
  alloc *a = take((uintptr_t)p);
  if (a == NULL || !a->imported) {
    free(a);
    return CUDA_ERROR_INVALID_VALUE;
  }
  munmap((void *)a->base, a->size);
  free(a);
  return CUDA_SUCCESS;
}

/* The CUDA 13 batch copy: the same copies, queued in order. */
EXPORT CUresult cuMemcpyBatchAsync_v2(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                                      size_t count, CUmemcpyAttributes *attrs,
                                      size_t *attrs_idx, size_t n_attrs, CUstream h) {
  const char *no = getenv("FAKE_CUDA_NO_BATCH");
  if (no != NULL && strcmp(no, "1") == 0)
    return CUDA_ERROR_NOT_SUPPORTED;
  if (n_attrs != 1 || attrs == NULL || attrs_idx == NULL || attrs_idx[0] != 0 ||
      attrs->srcAccessOrder == 0)
    return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < count; i++) {
    CUresult r = cuMemcpyAsync(dsts[i], srcs[i], sizes[i], h);
    if (r != CUDA_SUCCESS)
      return r;
  }
  return CUDA_SUCCESS;
}

/* ------------------------------------------------------------ the gather kernel */

static int module_token, function_token, strided_token, based_token;

EXPORT CUresult cuModuleLoadData(CUmodule *m, const void *image) {
  const char *no = getenv("FAKE_CUDA_NO_KERNEL");
  if (no != NULL && strcmp(no, "1") == 0)
    return CUDA_ERROR_INVALID_PTX;
  const char *ptx = image;
  while (*ptx == '\n' || *ptx == ' ')
    ptx++;
  if (strncmp(ptx, ".version ", 9) != 0)
    return CUDA_ERROR_INVALID_IMAGE;
  if (strstr(ptx, ".entry sx_gather(") == NULL ||
      strstr(ptx, ".entry sx_gather_strided(") == NULL ||
      strstr(ptx, ".entry sx_gather_based(") == NULL)
    return CUDA_ERROR_INVALID_PTX;
  *m = (CUmodule)&module_token;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
  if (m != (CUmodule)&module_token)
    return CUDA_ERROR_NOT_FOUND;
  if (strcmp(name, "sx_gather") == 0)
    *f = (CUfunction)&function_token;
  else if (strcmp(name, "sx_gather_strided") == 0)
    *f = (CUfunction)&strided_token;
  else if (strcmp(name, "sx_gather_based") == 0)
    *f = (CUfunction)&based_token;
  else
    return CUDA_ERROR_NOT_FOUND;
  return CUDA_SUCCESS;
}

/* sx_gather(const sx_piece *table, unsigned long long n), and
 * sx_gather_strided the same with its table, sx_gather_based with a third,
 * its 16 bases by value: the parameters are read now (as the driver copies
 * them at launch), the table when the launch runs.  The table must be
 * memory the kernel may read: pinned host or device memory. */
EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                               unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                               CUstream h, void **params, void **extra) {
  int strided = f == (CUfunction)&strided_token, based = f == (CUfunction)&based_token;
  const char *fail = getenv("FAKE_CUDA_FAIL_LAUNCH");
  if (fail != NULL && strcmp(fail, "1") == 0)
    return CUDA_ERROR_LAUNCH_FAILED;
  if ((f != (CUfunction)&function_token && !strided && !based) || params == NULL ||
      extra != NULL || gx == 0 || gy != 1 || gz != 1 || bx == 0 || bx > 1024 || by != 1 ||
      bz != 1 || shmem != 0)
    return CUDA_ERROR_INVALID_VALUE;
  uint64_t table, n;
  memcpy(&table, params[0], sizeof(table));
  memcpy(&n, params[1], sizeof(n));
  pthread_mutex_lock(&mu);
  alloc *a = find((uintptr_t)table);
  int ok = a != NULL && table + n * (strided ? 48 : based ? 32 : 24) <= a->base + a->size;
  pthread_mutex_unlock(&mu);
  if (!ok)
    return CUDA_ERROR_ILLEGAL_ADDRESS;
  op *o = calloc(1, sizeof(*o));
  if (based) {
    memcpy(o->bases, params[2], sizeof(o->bases));
    const bpiece *t = (const bpiece *)(uintptr_t)table;
    for (uint64_t i = 0; i < n; i++) {
      if (t[i].len == 0 || t[i].len > (64u << 10) || t[i].region >= 16 ||
          o->bases[t[i].region] == 0) {
        free(o);
        return CUDA_ERROR_INVALID_VALUE;
      }
    }
  }
  o->table = (const uint64_t *)(uintptr_t)table;
  o->n = n;
  o->strided = strided;
  o->based = based;
  return enqueue(h, o);
}

EXPORT CUresult cuEventCreate(CUevent *e, unsigned flags) {
  (void)flags;
  const char *no = getenv("FAKE_CUDA_NO_EVENTS");
  if (no != NULL && strcmp(no, "1") == 0)
    return CUDA_ERROR_NOT_SUPPORTED;
  event *ev = calloc(1, sizeof(*ev));
  pthread_mutex_init(&ev->mu, NULL);
  pthread_cond_init(&ev->cv, NULL);
  *e = (CUevent)ev;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuEventRecord(CUevent e, CUstream h) {
  event *ev = (event *)e;
  op *o = calloc(1, sizeof(*o));
  o->ev = ev;
  pthread_mutex_lock(&ev->mu);
  ev->recorded++;
  pthread_mutex_unlock(&ev->mu);
  return enqueue(h, o);
}

static void event_wait(event *ev) {
  pthread_mutex_lock(&ev->mu);
  while (ev->reached < ev->recorded)
    pthread_cond_wait(&ev->cv, &ev->mu);
  pthread_mutex_unlock(&ev->mu);
}

static unsigned long event_syncs; /* atomic: cuEventSynchronize calls */

/* Tests (dlsym): how often this process called cuEventSynchronize. */
EXPORT unsigned long fake_cuda_event_syncs(void) {
  return __atomic_load_n(&event_syncs, __ATOMIC_RELAXED);
}

EXPORT CUresult cuEventSynchronize(CUevent e) {
  __atomic_add_fetch(&event_syncs, 1, __ATOMIC_RELAXED);
  event_wait((event *)e);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuEventQuery(CUevent e) {
  event *ev = (event *)e;
  pthread_mutex_lock(&ev->mu);
  int done = ev->reached >= ev->recorded;
  pthread_mutex_unlock(&ev->mu);
  return done ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

EXPORT CUresult cuEventDestroy_v2(CUevent e) {
  event *ev = (event *)e;
  event_wait(ev);
  pthread_mutex_destroy(&ev->mu);
  pthread_cond_destroy(&ev->cv);
  free(ev);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned flags) {
  if (flags != 0 || peer == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

/* ------------------------------------------------------------ dma-buf
 * GPUDirect through dma-buf, as far as host memory can play it: the
 * handle is a memfd (a dup of the allocation's), and the real driver's
 * rules are enforced: page-aligned address and size, the range inside one
 * device allocation.  fake_cuda_dmabuf_info() tells the RDMA test shim
 * (tests/rdma/sx_ibv_shim.c) where in the memfd the exported range starts,
 * so that it can register the same pages.  FAKE_CUDA_DMABUF=0 makes the
 * devices report no dma-buf support. */

typedef struct dmabuf {
  int fd;
  uint64_t off, size;
  struct dmabuf *next;
} dmabuf;
static dmabuf *dmabufs;
static long sync_memops; /* SYNC_MEMOPS set on device memory, for tests */

/* The PCI address of device d: the d-th entry of FAKE_CUDA_PCI
 * ("0000:17:00.0,0000:65:00.0", for the RDMA transport's NIC choice
 * against a fake sysfs tree), else 0000:(0x10 * (d + 1)):00.0.  0, or -1
 * for an entry that does not parse (the caller answers as a driver would
 * to a bad query). */
static int pci_address(CUdevice d, unsigned *dom, unsigned *bus, unsigned *dev) {
  const char *s = getenv("FAKE_CUDA_PCI");
  *dom = 0, *bus = 0x10u * (unsigned)(d + 1), *dev = 0;
  for (int i = 0; s != NULL && *s != '\0'; i++) {
    if (i == d) {
      unsigned fn;
      return sscanf(s, "%x:%x:%x.%x", dom, bus, dev, &fn) == 4 ? 0 : -1;
    }
    s = strchr(s, ',');
    s = s != NULL ? s + 1 : NULL;
  }
  return 0;
}

EXPORT CUresult cuDeviceGetAttribute(int *v, CUdevice_attribute at, CUdevice d) {
  if (d < 0 || d >= devices())
    return CUDA_ERROR_INVALID_DEVICE;
  if (at == CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID || at == CU_DEVICE_ATTRIBUTE_PCI_BUS_ID ||
      at == CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID) {
    unsigned dom, bus, dev;
    if (pci_address(d, &dom, &bus, &dev) != 0)
      return CUDA_ERROR_INVALID_VALUE;
    *v = (int)(at == CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID ? dom
               : at == CU_DEVICE_ATTRIBUTE_PCI_BUS_ID  ? bus
                                                       : dev);
    return CUDA_SUCCESS;
  }
  if (at != CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
    return CUDA_ERROR_INVALID_VALUE;
  const char *e = getenv("FAKE_CUDA_DMABUF");
  *v = e == NULL || strcmp(e, "0") != 0;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr p, size_t len,
                                              CUmemRangeHandleType type,
                                              unsigned long long flags) {
  long ps = sysconf(_SC_PAGESIZE);
  if (type != CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD || flags != 0 || len == 0 ||
      (p % (uintptr_t)ps) != 0 || (len % (size_t)ps) != 0)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  alloc *a = find((uintptr_t)p);
  int ok = a != NULL && a->device >= 0 && !a->imported && len <= a->size - (p - a->base);
  int fd = ok ? dup(a->fd) : -1;
  uint64_t off = ok ? p - a->base : 0;
  if (fd >= 0) {
    dmabuf *b = calloc(1, sizeof(*b));
    *b = (dmabuf){fd, off, len, dmabufs};
    dmabufs = b;
  }
  pthread_mutex_unlock(&mu);
  if (fd < 0)
    return CUDA_ERROR_INVALID_VALUE;
  *(int *)handle = fd;
  return CUDA_SUCCESS;
}

/* FAKE_CUDA_SYNC_MEMOPS=unsupported answers as a real driver does for VMM
 * memory (CUDA_ERROR_NOT_SUPPORTED), =fail as for a bad pointer. */
EXPORT CUresult cuPointerSetAttribute(const void *v, CUpointer_attribute at, CUdeviceptr p) {
  const char *how = getenv("FAKE_CUDA_SYNC_MEMOPS");
  if (how != NULL && strcmp(how, "unsupported") == 0)
    return CUDA_ERROR_NOT_SUPPORTED;
  if (how != NULL && strcmp(how, "fail") == 0)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  alloc *a = find((uintptr_t)p);
  int ok = a != NULL && a->device >= 0 && at == CU_POINTER_ATTRIBUTE_SYNC_MEMOPS &&
           *(const unsigned *)v == 1;
  sync_memops += ok;
  pthread_mutex_unlock(&mu);
  return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static long flushes; /* cuFlushGPUDirectRDMAWrites calls, for tests */

EXPORT CUresult cuFlushGPUDirectRDMAWrites(CUflushGPUDirectRDMAWritesTarget target,
                                           CUflushGPUDirectRDMAWritesScope scope) {
  if (target != CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX)
    return CUDA_ERROR_INVALID_VALUE;
  (void)scope;
  __atomic_add_fetch(&flushes, 1, __ATOMIC_RELAXED);
  return CUDA_SUCCESS;
}

EXPORT long fake_cuda_flushes(void) { return __atomic_load_n(&flushes, __ATOMIC_RELAXED); }

/* Not CUDA: where the exported range of fd starts in its memfd and how
 * long it is; 0, or -1 for an fd this library did not hand out (closed fds
 * stay listed: the shim looks them up before the caller closes them). */
EXPORT int fake_cuda_dmabuf_info(int fd, uint64_t *off, uint64_t *size) {
  int rc = -1;
  pthread_mutex_lock(&mu);
  for (dmabuf *b = dmabufs; b != NULL; b = b->next) {
    if (b->fd == fd) {
      *off = b->off;
      *size = b->size;
      rc = 0;
      break; /* the newest: fd numbers are reused */
    }
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

/* Not CUDA: is p device memory of this stand-in? */
EXPORT int fake_cuda_is_device(const void *p) {
  pthread_mutex_lock(&mu);
  alloc *a = find((uintptr_t)p);
  int r = a != NULL && a->device >= 0;
  pthread_mutex_unlock(&mu);
  return r;
}

EXPORT long fake_cuda_sync_memops(void) { return sync_memops; }
