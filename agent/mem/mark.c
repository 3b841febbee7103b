/*
 * Stream marks (see mem.h): a number a stream writes into a word of pinned
 * memory once the work queued before it has completed, for a thread that
 * watches the word itself (cuda_ipc's direct reads: the reader's own
 * thread, not the agent's loop).  cuStreamWriteValue64 fences the work's
 * writes before the word's, as the notifier's flags do (stream.c).
 *
 * A stream with a launcher writes the mark from the launcher's thread,
 * behind the launches queued before it; the error of such a launch (the
 * stream's s->err) goes to the mark's err word before the word is
 * written.  Where the write cannot be queued, the stream is waited for and
 * the host writes the word itself, so a mark always arrives.
 */
#ifdef SX_HAVE_CUDA
#include "internal.h"
#include "mem_int.h"

/* Queue (or, failing that, make) the mark: the stream's launch error, if
 * any, first into *err (prior), then value into *word. */
static void mark_now(const sx__cuda_drv *d, sx__mem_stream *s, uint64_t *word, uint64_t value,
                     int *err, int prior) {
  if (prior != 0)
    __atomic_store_n(err, prior, __ATOMIC_RELAXED);
  CUresult r = d->StreamWriteValue64 != NULL
                   ? d->StreamWriteValue64(s->s, (CUdeviceptr)(uintptr_t)word, value,
                                           CU_STREAM_WRITE_VALUE_DEFAULT)
                   : CUDA_ERROR_NOT_SUPPORTED;
  if (r == CUDA_SUCCESS)
    return;
  r = d->StreamSynchronize(s->s);
  if (r != CUDA_SUCCESS && prior == 0)
    __atomic_store_n(err, sx__cuda_err(d, r, "waiting for a stream"), __ATOMIC_RELAXED);
  __atomic_store_n(word, value, __ATOMIC_RELEASE);
}

/* The launcher's thread: a mark queued by sx__mem_stream_mark (a: the
 * word, b: the error word, x: the value). */
static void mark_job(sx__mem_job *j) {
  int prior = __atomic_exchange_n(&j->s->err, 0, __ATOMIC_ACQ_REL), rc;
  const sx__cuda_drv *d = sx__cuda_get(j->s->device, &rc);
  if (d != NULL) {
    mark_now(d, j->s, j->a, j->x, j->b, prior);
    return;
  }
  __atomic_store_n((int *)j->b, prior ? prior : rc, __ATOMIC_RELAXED);
  __atomic_store_n((uint64_t *)j->a, j->x, __ATOMIC_RELEASE);
}

int sx__mem_stream_mark(sx__mem_stream *s, uint64_t *word, uint64_t value, int *err) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(s->device, &rc);
  if (d == NULL)
    return rc;
  if (sx__mem_deferred(s)) {
    if (sx__mem_launcher_queue(s, mark_job, word, err, value) == 0)
      return 0;
    sx__mem_launcher_drain(s); /* no memory for the job: in order, here */
  }
  mark_now(d, s, word, value, err, __atomic_exchange_n(&s->err, 0, __ATOMIC_ACQ_REL));
  return 0;
}

int sx__mem_stream_marks(int device) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(device, &rc);
  return d != NULL && d->StreamWriteValue64 != NULL && d->StreamQuery != NULL &&
         d->CtxGetCurrent != NULL;
}

int sx__mem_stream_stopped(sx__mem_stream *s) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(s->device, &rc);
  if (d == NULL)
    return rc;
  if (__atomic_load_n(&s->queued, __ATOMIC_ACQUIRE) > 0)
    return 0; /* calls still to be made by the launcher */
  CUresult r = d->StreamQuery(s->s);
  return r == CUDA_SUCCESS ? 1 : r == CUDA_ERROR_NOT_READY ? 0 : sx__cuda_err(d, r, "a stream");
}

int sx__mem_ctx_keep(void **saved) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(-1, &rc); /* loads; leaves the context */
  if (d == NULL)
    return rc;
  if (d->CtxGetCurrent == NULL)
    return sx__err(SX_ENOTSUP, "the CUDA driver lacks cuCtxGetCurrent");
  CUcontext c = NULL;
  CUresult r = d->CtxGetCurrent(&c);
  if (r != CUDA_SUCCESS)
    return sx__cuda_err(d, r, "reading the current context");
  *saved = c;
  return 0;
}

void sx__mem_ctx_back(void *saved) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(-1, &rc);
  if (d != NULL)
    d->CtxSetCurrent((CUcontext)saved);
}
#else
typedef int sx__mem_mark_unused; /* ISO C wants something in a file */
#endif
