/*
 * What the calls on cuda_ipc's path cost the calling thread, on this GPU
 * and driver: each one in a loop of N, CPU time and wall time per call
 * (CLOCK_THREAD_CPUTIME_ID, CLOCK_MONOTONIC), through the same memory
 * layer the library uses.  A measuring tool, not a test: it checks nothing
 * but that the calls succeed.  Usage: drv_cost [device] [iterations]
 *
 * Rows: the context made current (every launch and notice asks), an
 * event recorded, an event that passed queried, one gather launch of 1
 * and of 128 ranges of 32 KiB (table written, launch, the table's event),
 * and, for scale, the system calls of one loop wake: an eventfd write and
 * read, a timerfd armed and read, a condition variable signalled to a
 * thread that sleeps on it and answers (one round trip, both sides).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include "mem/mem_int.h"
#include "segxfer.h"

static double now(clockid_t c) {
  struct timespec ts;
  clock_gettime(c, &ts);
  return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

typedef struct span {
  double cpu, wall;
} span;

static span begin(void) { return (span){now(CLOCK_THREAD_CPUTIME_ID), now(CLOCK_MONOTONIC)}; }

static void end(const char *what, span s, long n) {
  double cpu = now(CLOCK_THREAD_CPUTIME_ID) - s.cpu, wall = now(CLOCK_MONOTONIC) - s.wall;
  printf("%-58s %8.2f us CPU  %8.2f us wall  per call (%ld calls)\n", what, cpu / 1e3 / n,
         wall / 1e3 / n, n);
}

static int fail(const char *what) {
  fprintf(stderr, "drv_cost: %s: %s\n", what, sx_errmsg());
  return 1;
}

#ifdef SX_HAVE_CUDA
typedef struct pong {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  long ping, pong;
  int stop;
} pong;

static void *ponger(void *arg) {
  pong *p = arg;
  pthread_mutex_lock(&p->mu);
  while (!p->stop) {
    while (p->ping == p->pong && !p->stop)
      pthread_cond_wait(&p->cv, &p->mu);
    p->pong = p->ping;
    pthread_cond_broadcast(&p->cv);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

static int syscalls(long n) {
  int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  int tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  if (efd < 0 || tfd < 0)
    return 1;
  uint64_t v = 1;
  span s = begin();
  for (long i = 0; i < n; i++) {
    if (write(efd, &v, sizeof(v)) != sizeof(v) || read(efd, &v, sizeof(v)) != sizeof(v))
      return 1;
  }
  end("eventfd write + read (a loop wake, both sides)", s, n);
  struct itimerspec its = {.it_value = {.tv_sec = 0, .tv_nsec = 1000}};
  s = begin();
  for (long i = 0; i < n; i++) {
    timerfd_settime(tfd, 0, &its, NULL);
    while (read(tfd, &v, sizeof(v)) < 0) {
    }
  }
  end("timerfd armed (1 us) + read (spinning until it fired)", s, n);
  close(efd);
  close(tfd);
  pong p = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  pthread_t th;
  if (pthread_create(&th, NULL, ponger, &p) != 0)
    return 1;
  s = begin();
  pthread_mutex_lock(&p.mu);
  for (long i = 0; i < n / 10; i++) {
    p.ping++;
    pthread_cond_broadcast(&p.cv);
    while (p.pong != p.ping)
      pthread_cond_wait(&p.cv, &p.mu);
  }
  p.stop = 1;
  pthread_cond_broadcast(&p.cv);
  pthread_mutex_unlock(&p.mu);
  end("cond signal to a sleeping thread + its answer (round trip)", s, n / 10);
  pthread_join(th, NULL);
  return 0;
}

int main(int argc, char **argv) {
  int dev = argc > 1 ? atoi(argv[1]) : 0;
  long n = argc > 2 ? atol(argv[2]) : 20000;
  int rc, ndev;
  if (n < 100 || sx__mem_cuda_devices(&ndev) != 0 || dev < 0 || dev >= ndev)
    return fail("usage: drv_cost [device] [iterations >= 100], on a host with that GPU");
  const sx__cuda_drv *d = sx__cuda_get(dev, &rc);
  sx__mem_stream *st;
  uint8_t *src, *dst;
  enum { R = 128, LEN = 32 << 10 };
  if (d == NULL || sx__mem_stream_create(dev, &st) != 0 ||
      sx__mem_alloc(dev, (size_t)R * LEN * 4, (void **)&src) != 0 ||
      sx__mem_alloc(dev, (size_t)R * LEN, (void **)&dst) != 0)
    return fail("setting up");
  printf("cuda:%d, %ld iterations\n", dev, n);

  span s = begin();
  for (long i = 0; i < n; i++)
    if (sx__cuda_get(dev, &rc) == NULL)
      return fail("sx__cuda_get");
  end("sx__cuda_get (cuCtxSetCurrent of the primary context)", s, n);

  CUevent ev;
  if (d->EventCreate(&ev, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS)
    return fail("cuEventCreate");
  s = begin();
  for (long i = 0; i < n; i++)
    if (d->EventRecord(ev, st->s) != CUDA_SUCCESS)
      return fail("cuEventRecord");
  end("cuEventRecord on an idle stream", s, n);
  d->StreamSynchronize(st->s);
  s = begin();
  for (long i = 0; i < n; i++)
    if (d->EventQuery(ev) != CUDA_SUCCESS)
      return fail("cuEventQuery");
  end("cuEventQuery of an event that passed", s, n);

  sx__mem_range rg[R];
  for (int i = 0; i < R; i++)
    rg[i] = (sx__mem_range){(uint64_t)(uintptr_t)(dst + (size_t)i * LEN),
                            (uint64_t)(uintptr_t)(src + (size_t)((i * 7) % (R * 4)) * LEN),
                            LEN};
  for (int k = 0; k < 2; k++) {
    size_t nr = k == 0 ? 1 : R;
    sx__mem_copy_method used;
    s = begin();
    for (long i = 0; i < n; i++) {
      if (sx__mem_gather(st, rg, nr, SX__GATHER_SM_OK, SX__COPY_KERNEL, &used) != 0)
        return fail("sx__mem_gather");
      if (used != SX__COPY_KERNEL)
        return fail("the gather kernel did not run");
      if (i % 8 == 7)
        sx__mem_stream_sync(st);
    }
    sx__mem_stream_sync(st);
    char what[96];
    snprintf(what, sizeof(what), "gather of %zu x 32K (table, launch, its event; sync per 8)",
             nr);
    end(what, s, n);
  }
  s = begin();
  for (long i = 0; i < n; i++) {
    sx__mem_copy_method used;
    if (sx__mem_gather(st, rg, R, SX__GATHER_SM_OK, SX__COPY_KERNEL, &used) != 0 ||
        d->EventRecord(ev, st->s) != CUDA_SUCCESS)
      return fail("gather + event");
    while (d->EventQuery(ev) == CUDA_ERROR_NOT_READY) {
    }
  }
  end("gather of 128 x 32K + cuEventRecord, queried until it passed", s, n);
  /* An event not passed yet: behind a gather of 128 x 1 MiB (long enough
   * for the queries to all find it running). */
  sx__mem_range big[R];
  for (int i = 0; i < R; i++)
    big[i] = (sx__mem_range){(uint64_t)(uintptr_t)(dst + (size_t)(i % 4) * LEN * (R / 4)),
                             (uint64_t)(uintptr_t)(src + (size_t)(i % 4) * LEN * R), LEN * 32};
  sx__mem_copy_method used;
  long q = 0;
  double qcpu = 0;
  for (int k = 0; k < 20 && q < n; k++) {
    if (sx__mem_gather(st, big, R, SX__GATHER_SM_OK, SX__COPY_KERNEL, &used) != 0 ||
        d->EventRecord(ev, st->s) != CUDA_SUCCESS)
      return fail("gather + event");
    double c0 = now(CLOCK_THREAD_CPUTIME_ID);
    for (int j = 0; j < 100 && d->EventQuery(ev) == CUDA_ERROR_NOT_READY; j++)
      q++;
    qcpu += now(CLOCK_THREAD_CPUTIME_ID) - c0;
    sx__mem_stream_sync(st);
  }
  printf("%-58s %8.2f us CPU  per call (%ld calls)\n", "cuEventQuery of an event not passed yet",
         q ? qcpu / 1e3 / (double)q : 0.0, q);
  if (d->StreamWriteValue64 != NULL) {
    uint64_t *word;
    if (d->MemHostAlloc((void **)&word, 64, CU_MEMHOSTALLOC_PORTABLE) != CUDA_SUCCESS)
      return fail("cuMemHostAlloc");
    *word = 0;
    s = begin();
    for (long i = 0; i < n; i++)
      if (d->StreamWriteValue64(st->s, (CUdeviceptr)(uintptr_t)word, (uint64_t)i + 1, 0) !=
          CUDA_SUCCESS)
        return fail("cuStreamWriteValue64");
    end("cuStreamWriteValue64 into pinned memory", s, n);
    sx__mem_stream_sync(st);
    printf("  the word after the stream synchronized: %lu (want %ld)\n",
           (unsigned long)__atomic_load_n(word, __ATOMIC_ACQUIRE), n);
    s = begin();
    for (long i = 0; i < n; i++)
      if (d->StreamQuery(st->s) != CUDA_SUCCESS)
        return fail("cuStreamQuery");
    end("cuStreamQuery of an idle stream", s, n);
    d->MemFreeHost(word);
  } else {
    printf("this driver has no cuStreamWriteValue64\n");
  }
  d->EventDestroy(ev);
  sx__mem_stream_destroy(st);
  sx__mem_free(src);
  sx__mem_free(dst);
  return syscalls(n);
}
#else
int main(void) { return fail("built without CUDA headers"); }
#endif
