/*
 * Launchers (see mem.h): a thread that makes the driver calls queued for
 * the streams bound to it (gather launches, completion notices), in the
 * order each stream queued them.
 *
 * Why: cuda_ipc runs every read on the agent's loop thread, and at 8
 * requests in flight that thread is the limit, a third of its time in the
 * driver (cuLaunchKernel and the events behind it: about 5 us of each
 * 128-range request on an H200, tests/gpu/results/
 * 2026-11-27-h200x2-driver-costs-and-flag-notices.txt).  The loop still
 * plans each op and writes its table of ranges; the launcher makes the
 * calls, so the two run side by side.
 *
 * The thread spins for SPIN_NS after its queue ran empty before it sleeps
 * (a request comes every 10-20 us while reads stream), so a busy launcher
 * is never woken; a queue that finds it asleep signals it.  A job that
 * fails leaves its error on the stream (s->err), and the next notice
 * queued on it carries that error to the notice's owner (notice->status).
 */
#ifdef SX_HAVE_CUDA
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>

#include "internal.h"
#include "mem_int.h"

#define SPIN_NS 50000 /* empty-queue spinning before the thread sleeps */

struct sx__mem_launcher {
  pthread_t th;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  sx__mem_job *head, **tail, *spare; /* mu; head also read atomically while spinning */
  int sleeping, stop;                /* mu (stop also atomically) */
};

static void *launcher_main(void *arg) {
  sx__mem_launcher *l = arg;
  pthread_setname_np(pthread_self(), "sx-launch");
  pthread_mutex_lock(&l->mu);
  for (;;) {
    if (l->head == NULL && !l->stop) {
      pthread_mutex_unlock(&l->mu);
      /* The clock read once per 64 looks at the queue. */
      uint64_t t0 = sx__mono_ns();
      for (unsigned i = 1; __atomic_load_n(&l->head, __ATOMIC_RELAXED) == NULL &&
                           !__atomic_load_n(&l->stop, __ATOMIC_RELAXED);
           i++) {
        sx__cpu_relax();
        if (i % 64 == 0 && sx__mono_ns() - t0 >= SPIN_NS)
          break;
      }
      pthread_mutex_lock(&l->mu);
      while (l->head == NULL && !l->stop) {
        l->sleeping = 1;
        pthread_cond_wait(&l->cv, &l->mu);
        l->sleeping = 0;
      }
    }
    sx__mem_job *list = l->head;
    if (list == NULL)
      break; /* stopped, and nothing is left */
    __atomic_store_n(&l->head, NULL, __ATOMIC_RELAXED);
    l->tail = &l->head;
    pthread_mutex_unlock(&l->mu);
    sx__mem_job *last = NULL;
    for (sx__mem_job *j = list; j != NULL; j = j->next) {
      j->run(j);
      __atomic_sub_fetch(&j->s->queued, 1, __ATOMIC_RELEASE);
      last = j;
    }
    pthread_mutex_lock(&l->mu);
    last->next = l->spare;
    l->spare = list;
  }
  pthread_mutex_unlock(&l->mu);
  return NULL;
}

int sx__mem_launcher_create(sx__mem_launcher **out) {
  sx__mem_launcher *l = calloc(1, sizeof(*l));
  if (l == NULL)
    return sx__err(SX_ENOMEM, "launcher");
  pthread_mutex_init(&l->mu, NULL);
  pthread_cond_init(&l->cv, NULL);
  l->tail = &l->head;
  if (pthread_create(&l->th, NULL, launcher_main, l) != 0) {
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->cv);
    free(l);
    return sx__err(SX_EIO, "launcher: cannot start its thread");
  }
  *out = l;
  return 0;
}

void sx__mem_launcher_destroy(sx__mem_launcher *l) {
  if (l == NULL)
    return;
  pthread_mutex_lock(&l->mu);
  __atomic_store_n(&l->stop, 1, __ATOMIC_RELAXED);
  pthread_cond_signal(&l->cv);
  pthread_mutex_unlock(&l->mu);
  pthread_join(l->th, NULL);
  while (l->spare != NULL) {
    sx__mem_job *j = l->spare;
    l->spare = j->next;
    free(j);
  }
  pthread_mutex_destroy(&l->mu);
  pthread_cond_destroy(&l->cv);
  free(l);
}

int sx__mem_launcher_queue(sx__mem_stream *s, void (*run)(sx__mem_job *j), void *a, void *b,
                           uint64_t x) {
  sx__mem_launcher *l = s->l;
  pthread_mutex_lock(&l->mu);
  sx__mem_job *j = l->spare;
  if (j != NULL)
    l->spare = j->next;
  else if ((j = malloc(sizeof(*j))) == NULL) {
    pthread_mutex_unlock(&l->mu);
    return -1;
  }
  *j = (sx__mem_job){.run = run, .s = s, .a = a, .b = b, .x = x};
  __atomic_add_fetch(&s->queued, 1, __ATOMIC_RELAXED);
  if (l->head == NULL)
    __atomic_store_n(&l->head, j, __ATOMIC_RELAXED);
  else
    *l->tail = j;
  l->tail = &j->next;
  if (l->sleeping)
    pthread_cond_signal(&l->cv);
  pthread_mutex_unlock(&l->mu);
  return 0;
}

void sx__mem_launcher_drain(sx__mem_stream *s) {
  if (s->l == NULL)
    return;
  while (__atomic_load_n(&s->queued, __ATOMIC_ACQUIRE) > 0)
    sched_yield();
}

void sx__mem_stream_fail(sx__mem_stream *s, int err) {
  int zero = 0;
  __atomic_compare_exchange_n(&s->err, &zero, err, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
}
#else
typedef int sx__mem_launch_unused; /* ISO C wants something in a file */
#endif
