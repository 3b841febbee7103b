/*
 * Gathers: many copies in one call, by the gather kernel, the driver's
 * batch copy or single copies (see mem.h for which runs when).
 *
 * The kernel (gather.cu; its PTX in gather_ptx.h) is loaded once per device
 * into the primary context with cuModuleLoadData, the driver compiling it
 * for the GPU it runs on.  A launch takes a table of pieces: the ranges cut
 * into at most PIECE bytes each, so one thread block copies one piece and a
 * few large ranges still spread over the SMs.  The table lies in pinned host
 * memory that the kernel reads in place (unified addressing maps it for
 * every device), one of RING_SLOTS per stream used in turn; an event
 * recorded behind each launch says when its table may be written again, so
 * the host only waits when RING_SLOTS launches are still queued on that one
 * stream.  The stream orders everything else: copies and notices queued
 * after a launch start after it ended.  On a stream with a launcher
 * (launch.c) the caller writes the table and the launcher's thread makes
 * the launch and records the event; every other call on the stream waits
 * until its queued launches were made.
 *
 * The based entry point (sx__mem_gather_based) takes a table its caller
 * wrote in pinned memory (sx__mem_pinned_get, pinned.c) and owns: no ring
 * slot and no event, only the launch, whose up to 16 bases travel with it
 * as a kernel parameter.
 */
#ifdef SX_HAVE_CUDA
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gather_ptx.h"
#include "internal.h"
#include "mem_int.h"

#define MAX_DEVICES 64
#define PIECE SX__GATHER_PIECE /* bytes one thread block copies at a time */
#define THREADS 256       /* as gather.cu's __launch_bounds__ */
#define MAX_GRID 65535u   /* blocks stride over longer tables */
#define RING_SLOTS 32 /* launches in flight per stream before the host waits */
#define TABLE_MIN (16u << 10)

typedef struct piece {
  uint64_t dst, src, len; /* as gather.cu's sx_piece */
} piece;

/* As gather.cu's sx_spiece: count pieces of len, count * len <= PIECE. */
typedef sx__mem_strided spiece;

_Static_assert(sizeof(sx__mem_bpiece) == 32, "as gather.cu's sx_bpiece");

/* The module's entry points. */
enum { K_PLAIN, K_STRIDED, K_BASED, K_N };
static const char *const knames[K_N] = {"sx_gather", "sx_gather_strided", "sx_gather_based"};

/* A table's state (atomic): free to write; queued for the launcher;
 * launched with done recorded behind it (free once done passed). */
enum { SLOT_FREE, SLOT_QUEUED, SLOT_RECORDED };

typedef struct slot {
  void *table;  /* pinned: pieces or strided pieces */
  size_t cap;   /* bytes */
  CUevent done; /* recorded behind the launch that reads table */
  int state;    /* atomic: SLOT_* */
  uint64_t no;  /* the ring's count when it was taken last */
} slot;

/* The owner's (the thread that queues on the stream). */
struct sx__gather_ring {
  slot slots[RING_SLOTS];
  uint64_t next;      /* tables taken so far */
  uint64_t done_upto; /* those taken before this count have been read */
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int kstate[MAX_DEVICES];        /* mu: 0 untried, 1 loaded, -1 failed */
static CUfunction kfn[MAX_DEVICES][K_N]; /* mu: the module's entries (K_*) */
static char kerr[MAX_DEVICES][200];    /* mu: why it failed */
static uint64_t counts[4];             /* atomic */
static int batch_broken;               /* atomic: the batch call failed once */

static const char *const names[] = {"auto", "kernel", "batch", "range"};

const char *sx__mem_copy_name(sx__mem_copy_method m) {
  return (unsigned)m < 4 ? names[m] : "?";
}

sx__mem_copy_method sx__mem_copy_env(void) {
  static int said;
  const char *e = getenv("SX_GPU_COPY");
  if (e == NULL || *e == '\0')
    return SX__COPY_AUTO;
  for (int m = 0; m < 4; m++)
    if (strcmp(e, names[m]) == 0)
      return (sx__mem_copy_method)m;
  if (!__atomic_exchange_n(&said, 1, __ATOMIC_RELAXED))
    fprintf(stderr, "segxfer: SX_GPU_COPY=%s is not kernel, batch, range or auto: "
            "choosing per shape\n", e);
  return SX__COPY_AUTO;
}

void sx__mem_copy_counts(uint64_t out[4]) {
  for (int i = 0; i < 4; i++)
    out[i] = __atomic_load_n(&counts[i], __ATOMIC_RELAXED);
}

/* Entry point which (K_*) of device's kernel (its context current), or
 * NULL. */
static CUfunction kernel(const sx__cuda_drv *d, int device, int which) {
  if (device < 0 || device >= MAX_DEVICES)
    return NULL;
  pthread_mutex_lock(&mu);
  if (kstate[device] == 0) {
    CUmodule m;
    CUresult r = CUDA_ERROR_NOT_SUPPORTED;
    const char *what = "the driver lacks cuModuleLoadData, cuLaunchKernel or events";
    char finding[48];
    if (d->ModuleLoadData && d->ModuleGetFunction && d->LaunchKernel && d->EventCreate &&
        d->EventRecord && d->EventSynchronize && d->EventDestroy) {
      what = "loading its PTX";
      r = d->ModuleLoadData(&m, sx__gather_ptx);
      for (int k = 0; k < K_N && r == CUDA_SUCCESS; k++) {
        snprintf(finding, sizeof(finding), "finding %s in it", knames[k]);
        what = finding;
        r = d->ModuleGetFunction(&kfn[device][k], m, knames[k]);
      }
    }
    const char *s = NULL;
    if (r != CUDA_SUCCESS && (d->GetErrorString == NULL ||
                              d->GetErrorString(r, &s) != CUDA_SUCCESS))
      s = NULL;
    if (r != CUDA_SUCCESS)
      snprintf(kerr[device], sizeof(kerr[device]), "no gather kernel on cuda:%d: %s%s%s",
               device, what, s ? ": " : "", s ? s : "");
    /* The module stays loaded while the process runs (the primary context
     * keeps it; it is a few kilobytes). */
    kstate[device] = r == CUDA_SUCCESS ? 1 : -1;
  }
  CUfunction f = kstate[device] == 1 ? kfn[device][which] : NULL;
  pthread_mutex_unlock(&mu);
  return f;
}

const char *sx__mem_kernel_error(int device) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(device, &rc);
  if (d == NULL)
    return sx_errmsg();
  if (kernel(d, device, K_PLAIN) != NULL)
    return NULL;
  pthread_mutex_lock(&mu);
  const char *e = device >= 0 && device < MAX_DEVICES ? kerr[device] : "no such device";
  pthread_mutex_unlock(&mu);
  return e;
}

void sx__gather_ring_free(const sx__cuda_drv *d, struct sx__gather_ring *r) {
  if (r == NULL)
    return;
  for (int i = 0; i < RING_SLOTS; i++) {
    if (r->slots[i].done != NULL)
      d->EventDestroy(r->slots[i].done);
    if (r->slots[i].table != NULL)
      d->MemFreeHost(r->slots[i].table);
  }
  free(r);
}

/* The next table of s with room for bytes, free to write. */
static int table_get(const sx__cuda_drv *d, sx__mem_stream *s, size_t bytes, slot **out) {
  if (s->ring == NULL && (s->ring = calloc(1, sizeof(*s->ring))) == NULL)
    return sx__err(SX_ENOMEM, "gather tables");
  uint64_t no = s->ring->next++;
  slot *t = &s->ring->slots[no % RING_SLOTS];
  CUresult r;
  int st;
  /* Queued RING_SLOTS launches ago and not made yet: only a launcher far
   * behind leaves one so. */
  while ((st = __atomic_load_n(&t->state, __ATOMIC_ACQUIRE)) == SLOT_QUEUED)
    sched_yield();
  /* A notice behind its launch passed (sx__mem_stream_passed): read. */
  if (st == SLOT_RECORDED && t->no >= s->ring->done_upto &&
      (r = d->EventSynchronize(t->done)) != CUDA_SUCCESS)
    return sx__cuda_err(d, r, "waiting for a gather launch");
  __atomic_store_n(&t->state, SLOT_FREE, __ATOMIC_RELAXED);
  t->no = no;
  if (t->done == NULL && (r = d->EventCreate(&t->done, CU_EVENT_DISABLE_TIMING)) != CUDA_SUCCESS)
    return sx__cuda_err(d, r, "creating an event");
  if (t->cap < bytes) {
    size_t cap = TABLE_MIN;
    while (cap < bytes)
      cap *= 2;
    if (t->table != NULL)
      d->MemFreeHost(t->table);
    t->table = NULL;
    t->cap = 0;
    void *p;
    if ((r = d->MemHostAlloc(&p, cap, CU_MEMHOSTALLOC_PORTABLE)) != CUDA_SUCCESS)
      return sx__cuda_err(d, r, "allocating a gather table");
    t->table = p;
    t->cap = cap;
  }
  *out = t;
  return 0;
}

uint64_t sx__gather_ring_mark(const struct sx__gather_ring *r) { return r ? r->next : 0; }

void sx__gather_ring_passed(struct sx__gather_ring *r, uint64_t mark) {
  if (r != NULL && mark > r->done_upto)
    r->done_upto = mark;
}

/* Launch f over the np entries written into t, now. */
static int launch_now(const sx__cuda_drv *d, CUfunction f, sx__mem_stream *s, slot *t,
                      size_t np) {
  uint64_t table = (uint64_t)(uintptr_t)t->table, count = np;
  void *params[] = {&table, &count};
  unsigned grid = np < MAX_GRID ? (unsigned)np : MAX_GRID;
  CUresult r = d->LaunchKernel(f, grid, 1, 1, THREADS, 1, 1, 0, s->s, params, NULL);
  if (r != CUDA_SUCCESS) {
    __atomic_store_n(&t->state, SLOT_FREE, __ATOMIC_RELEASE);
    return sx__cuda_err(d, r, "launching the gather kernel");
  }
  if ((r = d->EventRecord(t->done, s->s)) != CUDA_SUCCESS) {
    /* Not known when the table is free: wait for it now. */
    d->StreamSynchronize(s->s);
    __atomic_store_n(&t->state, SLOT_FREE, __ATOMIC_RELEASE);
    return 0;
  }
  __atomic_store_n(&t->state, SLOT_RECORDED, __ATOMIC_RELEASE);
  return 0;
}

/* The launcher's thread: a launch queued by launch_table. */
static void launch_job(sx__mem_job *j) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(j->s->device, &rc);
  if (d != NULL)
    rc = launch_now(d, (CUfunction)j->b, j->s, j->a, (size_t)j->x);
  else
    __atomic_store_n(&((slot *)j->a)->state, SLOT_FREE, __ATOMIC_RELEASE);
  if (rc != 0)
    sx__mem_stream_fail(j->s, rc);
}

/* Launch f over the np entries written into t: by s's launcher when it has
 * one (its failure then reaches the next notice), else now. */
static int launch_table(const sx__cuda_drv *d, CUfunction f, sx__mem_stream *s, slot *t,
                        size_t np) {
  if (sx__mem_deferred(s)) {
    __atomic_store_n(&t->state, SLOT_QUEUED, __ATOMIC_RELEASE);
    if (sx__mem_launcher_queue(s, launch_job, t, (void *)f, np) == 0)
      return 0;
    sx__mem_launcher_drain(s); /* no memory for the job: in order, here */
  }
  return launch_now(d, f, s, t, np);
}

static int launch(const sx__cuda_drv *d, CUfunction f, sx__mem_stream *s,
                  const sx__mem_range *rg, size_t n) {
  size_t np = 0;
  for (size_t i = 0; i < n; i++)
    np += rg[i].len == 0 ? 0 : (rg[i].len + PIECE - 1) / PIECE;
  if (np == 0)
    return 0;
  slot *t = NULL;
  int rc = table_get(d, s, np * sizeof(piece), &t);
  if (rc)
    return rc;
  piece *tb = t->table;
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    for (uint64_t off = 0; off < rg[i].len; off += PIECE)
      tb[k++] = (piece){rg[i].dst + off, rg[i].src + off,
                        rg[i].len - off < PIECE ? rg[i].len - off : PIECE};
  return launch_table(d, f, s, t, np);
}

/* Pieces of len bytes per table entry: as many as PIECE holds, or one
 * (cut further at PIECE) when a piece alone is that long.  A request's
 * runs mostly share one piece length: the division is made once for it. */
typedef struct per_cache {
  uint64_t len, per;
} per_cache;

static uint64_t per_entry(per_cache *c, uint64_t len) {
  if (len != c->len) {
    c->len = len;
    c->per = len >= PIECE ? 1 : PIECE / len;
  }
  return c->per;
}

/* The table entries of strided copy r (per: its pieces per entry). */
static uint64_t entries_of(const sx__mem_strided *r, uint64_t per) {
  if (r->len == 0 || r->count == 0)
    return 0;
  if (r->len >= PIECE)
    return r->count * ((r->len + PIECE - 1) / PIECE);
  return r->count <= per ? 1 : (r->count + per - 1) / per;
}

static int launch_strided(const sx__cuda_drv *d, CUfunction f, sx__mem_stream *s,
                          const sx__mem_strided *rg, size_t n) {
  size_t np = 0;
  per_cache pc = {0, 0};
  for (size_t i = 0; i < n; i++)
    np += rg[i].len == 0 ? 0 : entries_of(&rg[i], per_entry(&pc, rg[i].len));
  if (np == 0)
    return 0;
  slot *t = NULL;
  int rc = table_get(d, s, np * sizeof(spiece), &t);
  if (rc)
    return rc;
  spiece *tb = t->table;
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    const sx__mem_strided *r = &rg[i];
    if (r->len == 0)
      continue;
    uint64_t per = per_entry(&pc, r->len);
    if (r->len < PIECE && r->count <= per) {
      tb[k++] = *r; /* the whole run in one entry: the usual case */
      continue;
    }
    for (uint64_t q = 0; q < r->count; q += per) {
      uint64_t dst = r->dst + q * r->dstride, src = r->src + q * r->sstride;
      if (r->len < PIECE) {
        uint64_t c = r->count - q < per ? r->count - q : per;
        tb[k++] = (spiece){dst, src, r->len, c, r->dstride, r->sstride};
        continue;
      }
      for (uint64_t off = 0; off < r->len; off += PIECE)
        tb[k++] = (spiece){dst + off, src + off, r->len - off < PIECE ? r->len - off : PIECE,
                           1, 0, 0};
    }
  }
  return launch_table(d, f, s, t, np);
}

/* A based launch's parameters, as the kernel takes them (its bases by
 * value: 128 bytes). */
typedef struct based_launch {
  uint64_t table, n;
  uint64_t bases[SX__GATHER_BASES];
} based_launch;

static int based_now(const sx__cuda_drv *d, CUfunction f, sx__mem_stream *s,
                     const based_launch *b) {
  void *params[] = {(void *)&b->table, (void *)&b->n, (void *)b->bases};
  unsigned grid = b->n < MAX_GRID ? (unsigned)b->n : MAX_GRID;
  CUresult r = d->LaunchKernel(f, grid, 1, 1, THREADS, 1, 1, 0, s->s, params, NULL);
  return r == CUDA_SUCCESS ? 0 : sx__cuda_err(d, r, "launching the gather kernel");
}

/* The launcher's thread: a launch queued by sx__mem_gather_based (a: its
 * parameters, the job's to free; b: the kernel). */
static void based_job(sx__mem_job *j) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(j->s->device, &rc);
  if (d != NULL)
    rc = based_now(d, (CUfunction)j->b, j->s, j->a);
  free(j->a);
  if (rc != 0)
    sx__mem_stream_fail(j->s, rc);
}

/* Launch b: by s's launcher when deferred (its failure then reaches the
 * next notice), else now. */
static int based_launch_on(const sx__cuda_drv *d, CUfunction f, sx__mem_stream *s,
                           const based_launch *b) {
  if (sx__mem_deferred(s)) {
    based_launch *q = malloc(sizeof(*q));
    if (q != NULL) {
      *q = *b;
      if (sx__mem_launcher_queue(s, based_job, q, (void *)f, 0) == 0)
        return 0;
      free(q);
    }
    sx__mem_launcher_drain(s); /* no memory for the job: in order, here */
  }
  return based_now(d, f, s, b);
}

int sx__mem_gather_based(sx__mem_stream *s, const sx__mem_bpiece *table, size_t n,
                         const uint64_t *bases, unsigned nb) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(s->device, &rc);
  if (d == NULL)
    return rc;
  if (nb > SX__GATHER_BASES)
    return sx__err(SX_EINVAL, "a based gather names %u bases (at most %d)", nb,
                   SX__GATHER_BASES);
  CUfunction f = kernel(d, s->device, K_BASED);
  if (f == NULL) {
    char why[sizeof(kerr[0])] = "no such device";
    pthread_mutex_lock(&mu);
    if (s->device >= 0 && s->device < MAX_DEVICES)
      memcpy(why, kerr[s->device], sizeof(why));
    pthread_mutex_unlock(&mu);
    return sx__err(SX_ENOTSUP, "%s", why);
  }
  if (n > 0) {
    based_launch b = {(uint64_t)(uintptr_t)table, n, {0}};
    if (nb > 0)
      memcpy(b.bases, bases, nb * sizeof(*bases));
    if ((rc = based_launch_on(d, f, s, &b)) != 0)
      return rc;
  }
  __atomic_add_fetch(&counts[SX__COPY_KERNEL], 1, __ATOMIC_RELAXED);
  return 0;
}

static int batch(const sx__cuda_drv *d, sx__mem_stream *s, const sx__mem_range *rg, size_t n) {
  if (n == 0)
    return 0;
  uint64_t *a = malloc(n * 2 * sizeof(uint64_t));
  size_t *len = malloc(n * sizeof(size_t));
  int rc = -1;
  if (a != NULL && len != NULL) {
    for (size_t i = 0; i < n; i++) {
      a[i] = rg[i].dst;
      a[n + i] = rg[i].src;
      len[i] = (size_t)rg[i].len;
    }
    /* Stream order: sources are read in the order the stream gives, as
     * with single copies. */
    CUmemcpyAttributes attr;
    memset(&attr, 0, sizeof(attr));
    attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    size_t idx = 0;
    _Static_assert(sizeof(CUdeviceptr) == sizeof(uint64_t), "CUdeviceptr is 64 bits");
    CUresult r = d->MemcpyBatchAsync((CUdeviceptr *)a, (CUdeviceptr *)(a + n), len, n, &attr,
                                     &idx, 1, s->s);
    rc = r == CUDA_SUCCESS ? 0 : 1;
  }
  free(a);
  free(len);
  return rc; /* 1: refused by the driver; -1: no memory (single copies, this once) */
}

/* The method that runs n copies (ranges or pieces) of bytes in all, and
 * the kernel (strided: its strided entry) when it is the kernel. */
static sx__mem_copy_method choose(const sx__cuda_drv *d, int device, uint64_t n,
                                  uint64_t bytes, unsigned flags, sx__mem_copy_method method,
                                  int strided, CUfunction *f) {
  if (method == SX__COPY_AUTO && !(flags & SX__GATHER_ENV_READ))
    method = sx__mem_copy_env();
  if (method == SX__COPY_AUTO)
    method = n <= 1 ? SX__COPY_RANGE
             : bytes / n <= SX__GATHER_KERNEL_MAX ? SX__COPY_KERNEL : SX__COPY_BATCH;
  *f = NULL;
  if (method == SX__COPY_KERNEL &&
      (!(flags & SX__GATHER_SM_OK) ||
       (*f = kernel(d, device, strided ? K_STRIDED : K_PLAIN)) == NULL))
    method = SX__COPY_BATCH;
  if (method == SX__COPY_BATCH &&
      (n <= 1 || d->MemcpyBatchAsync == NULL || __atomic_load_n(&batch_broken, __ATOMIC_RELAXED)))
    method = SX__COPY_RANGE;
  return method;
}

int sx__mem_gather(sx__mem_stream *s, const sx__mem_range *rg, size_t n, unsigned flags,
                   sx__mem_copy_method method, sx__mem_copy_method *used) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(s->device, &rc);
  if (d == NULL)
    return rc;
  rc = 0;
  uint64_t bytes = 0;
  for (size_t i = 0; i < n; i++)
    bytes += rg[i].len;
  CUfunction f;
  method = choose(d, s->device, n, bytes, flags, method, 0, &f);
  if (method == SX__COPY_KERNEL) {
    rc = launch(d, f, s, rg, n);
  } else if (method == SX__COPY_BATCH) {
    sx__mem_launcher_drain(s);
    int b = batch(d, s, rg, n);
    /* Refused (an older driver's rules): single copies from now on. */
    if (b == 1)
      __atomic_store_n(&batch_broken, 1, __ATOMIC_RELAXED);
    if (b != 0)
      method = SX__COPY_RANGE;
  }
  if (method == SX__COPY_RANGE) {
    rc = 0;
    sx__mem_launcher_drain(s);
    for (size_t i = 0; i < n && rc == 0; i++) {
      CUresult r = d->MemcpyAsync((CUdeviceptr)rg[i].dst, (CUdeviceptr)rg[i].src,
                                  (size_t)rg[i].len, s->s);
      if (r != CUDA_SUCCESS)
        rc = sx__cuda_err(d, r, "queueing a copy");
    }
  }
  if (method != SX__COPY_BATCH || rc == 0)
    __atomic_add_fetch(&counts[method], 1, __ATOMIC_RELAXED);
  if (used != NULL)
    *used = method;
  return rc;
}

/* Queue every piece of rg[0..n) as a copy of its own. */
static int pieces_one_by_one(const sx__cuda_drv *d, sx__mem_stream *s,
                             const sx__mem_strided *rg, size_t n) {
  for (size_t i = 0; i < n; i++) {
    for (uint64_t k = 0; k < rg[i].count; k++) {
      CUresult r = d->MemcpyAsync((CUdeviceptr)(rg[i].dst + k * rg[i].dstride),
                                  (CUdeviceptr)(rg[i].src + k * rg[i].sstride),
                                  (size_t)rg[i].len, s->s);
      if (r != CUDA_SUCCESS)
        return sx__cuda_err(d, r, "queueing a copy");
    }
  }
  return 0;
}

/* Every piece of rg[0..n) (np in all) as one batch call: 0, 1 refused by
 * the driver, -1 no memory. */
static int pieces_batch(const sx__cuda_drv *d, sx__mem_stream *s, const sx__mem_strided *rg,
                        size_t n, uint64_t np) {
  if (np > SIZE_MAX / sizeof(sx__mem_range))
    return -1;
  sx__mem_range *v = malloc((size_t)np * sizeof(*v));
  if (v == NULL)
    return -1;
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    for (uint64_t q = 0; q < rg[i].count; q++)
      v[k++] = (sx__mem_range){rg[i].dst + q * rg[i].dstride, rg[i].src + q * rg[i].sstride,
                               rg[i].len};
  int rc = batch(d, s, v, k);
  free(v);
  return rc;
}

int sx__mem_gather_strided(sx__mem_stream *s, const sx__mem_strided *rg, size_t n,
                           unsigned flags, sx__mem_copy_method method,
                           sx__mem_copy_method *used) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(s->device, &rc);
  if (d == NULL)
    return rc;
  uint64_t pieces = 0, bytes = 0;
  for (size_t i = 0; i < n; i++) {
    pieces += rg[i].count;
    bytes += rg[i].count * rg[i].len;
  }
  CUfunction f;
  method = choose(d, s->device, pieces, bytes, flags, method, 1, &f);
  rc = 0;
  if (method == SX__COPY_KERNEL) {
    rc = launch_strided(d, f, s, rg, n);
  } else if (method == SX__COPY_BATCH) {
    sx__mem_launcher_drain(s);
    int b = pieces_batch(d, s, rg, n, pieces);
    if (b == 1)
      __atomic_store_n(&batch_broken, 1, __ATOMIC_RELAXED);
    if (b != 0)
      method = SX__COPY_RANGE;
  }
  if (method == SX__COPY_RANGE) {
    sx__mem_launcher_drain(s);
    rc = pieces_one_by_one(d, s, rg, n);
  }
  if (method != SX__COPY_BATCH || rc == 0)
    __atomic_add_fetch(&counts[method], 1, __ATOMIC_RELAXED);
  if (used != NULL)
    *used = method;
  return rc;
}

int sx__mem_peer_enable(int device, int peer) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(peer, &rc);
  if (d == NULL || (d = sx__cuda_get(device, &rc)) == NULL)
    return rc;
  if (device == peer)
    return 0;
  if (d->CtxEnablePeerAccess == NULL)
    return sx__err(SX_ENOTSUP, "the CUDA driver lacks cuCtxEnablePeerAccess");
  CUresult r = d->CtxEnablePeerAccess(sx__cuda_ctx(peer), 0);
  if (r != CUDA_SUCCESS && r != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
    return sx__cuda_err(d, r, "enabling peer access");
  return 0;
}
#else
typedef int sx__mem_gather_unused; /* ISO C wants something in a file */
#endif
