/*
 * The pinned pool (mem.h): portable pinned host memory for based-gather
 * tables, which a batch's thread writes in place and the kernel reads.
 * Sizes are powers of two from MIN_CLASS; each size keeps a free list of
 * the buffers put back, linked through their first bytes, under one mutex.
 * A miss allocates under the asked device's context and gives the calling
 * thread its own context back (host_alloc_on); a put past KEEP buffers of
 * its size, or past KEEP_BYTES in all, frees.
 */
#ifdef SX_HAVE_CUDA
#include <pthread.h>

#include "internal.h"
#include "mem_int.h"

#define MIN_SHIFT 14 /* 16 KiB */
#define CLASSES 34   /* 16 KiB .. 128 TiB */
#define KEEP SX__PINNED_KEEP

typedef struct free_buf {
  struct free_buf *next;
} free_buf;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static free_buf *pool[CLASSES]; /* mu */
static unsigned kept[CLASSES];  /* mu */
static size_t kept_bytes;       /* mu: in all classes */

/* The size of the buffers of class c. */
static size_t class_size(int c) { return (size_t)1 << (MIN_SHIFT + c); }

/* The class of a buffer of at least bytes, or -1 past the largest. */
static int class_of(size_t bytes) {
  for (int c = 0; c < CLASSES; c++)
    if (bytes <= class_size(c))
      return c;
  return -1;
}

size_t sx__mem_pinned_kept(void) {
  pthread_mutex_lock(&mu);
  size_t n = kept_bytes;
  pthread_mutex_unlock(&mu);
  return n;
}

void sx__mem_pinned_drain(void) {
  for (int c = 0; c < CLASSES; c++) {
    pthread_mutex_lock(&mu);
    free_buf *b = pool[c];
    pool[c] = NULL;
    kept_bytes -= kept[c] * class_size(c);
    kept[c] = 0;
    pthread_mutex_unlock(&mu);
    while (b != NULL) {
      free_buf *next = b->next;
      sx__mem_host_free(b);
      b = next;
    }
  }
}

/* cuMemHostAlloc under device's primary context, the calling thread's own
 * current context (maybe none) made current again after. */
static int host_alloc_on(int device, size_t len, void **out) {
  void *saved;
  int rc = sx__mem_ctx_keep(&saved);
  if (rc)
    return sx__errwrap(rc, "pinned memory for gather tables");
  const sx__cuda_drv *d = sx__cuda_get(device, &rc);
  if (d != NULL) {
    CUresult r = d->MemHostAlloc(out, len, CU_MEMHOSTALLOC_PORTABLE);
    rc = r == CUDA_SUCCESS ? 0 : sx__cuda_err(d, r, "allocating pinned memory");
  }
  sx__mem_ctx_back(saved);
  return rc;
}

int sx__mem_pinned_get(int device, size_t bytes, void **out, size_t *cap) {
  int c = class_of(bytes);
  if (c < 0)
    return sx__err(SX_EINVAL, "pinned memory: %zu bytes is too large", bytes);
  pthread_mutex_lock(&mu);
  free_buf *b = pool[c];
  if (b != NULL) {
    pool[c] = b->next;
    kept[c]--;
    kept_bytes -= class_size(c);
  }
  pthread_mutex_unlock(&mu);
  size_t size = class_size(c);
  if (b == NULL) {
    void *p;
    int rc = host_alloc_on(device, size, &p);
    if (rc)
      return rc;
    b = p;
  }
  *out = b;
  *cap = size;
  return 0;
}

void sx__mem_pinned_put(void *p, size_t cap) {
  if (p == NULL)
    return;
  int c = class_of(cap);
  if (c >= 0 && cap == class_size(c)) {
    pthread_mutex_lock(&mu);
    if (kept[c] < KEEP && cap <= SX__PINNED_KEEP_BYTES - kept_bytes) {
      free_buf *b = p;
      b->next = pool[c];
      pool[c] = b;
      kept[c]++;
      kept_bytes += cap;
      p = NULL;
    }
    pthread_mutex_unlock(&mu);
  }
  sx__mem_host_free(p); /* not kept (NULL: kept) */
}
#else
typedef int sx__mem_pinned_unused; /* ISO C wants something in a file */
#endif
