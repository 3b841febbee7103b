/*
 * Data-mover threads (see xpool.h): a queue of jobs under one mutex, a
 * condition variable for idle workers, one eventfd per worker to wake it
 * out of poll() (the loop wants its job back, or another job waits), and
 * one uv_async through which workers hand news back to the loop.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "internal.h"
#include "xpool.h"

enum { XJ_IDLE, XJ_QUEUED, XJ_RUNNING, XJ_FINISHED };

typedef struct sx__xworker {
  sx__xpool *p;
  pthread_t tid;
  int wake;         /* eventfd: poked out of poll() */
  sx__xjob *job;    /* running now, or NULL */
} xworker;

struct sx__xpool {
  pthread_mutex_t mu;
  pthread_cond_t work;   /* idle workers wait here */
  pthread_cond_t back;   /* sx__xpool_reclaim() waits here */
  sx__xjob *q, **q_tail; /* submitted, not picked yet */
  atomic_uint queued;    /* its length, read without the lock */
  sx__xjob *news;        /* jobs with something for the loop */
  unsigned idle;
  int quit;
  unsigned n;
  xworker *w;
  uv_async_t async;
};

static atomic_ulong runs[SX__XJOB_KINDS];

uint64_t sx__xpool_runs(unsigned kind) { return kind < SX__XJOB_KINDS ? atomic_load(&runs[kind]) : 0; }

static void poke(xworker *w) {
  uint64_t one = 1;
  ssize_t rc = write(w->wake, &one, sizeof(one));
  (void)rc; /* a counter already at its limit wakes as well */
}

static void drain(int fd) {
  uint64_t v;
  ssize_t rc = read(fd, &v, sizeof(v));
  (void)rc; /* EAGAIN: nothing was pending */
}

/* Under the lock: j goes on the news list (once). */
static void listed(sx__xpool *p, sx__xjob *j) {
  if (j->listed)
    return;
  j->listed = 1;
  j->next = p->news;
  p->news = j;
}

static void *worker_main(void *arg) {
  xworker *w = arg;
  sx__xpool *p = w->p;
  pthread_setname_np(pthread_self(), "sx-mover");
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (!p->quit && p->q == NULL) {
      p->idle++;
      pthread_cond_wait(&p->work, &p->mu);
      p->idle--;
    }
    if (p->quit)
      break;
    sx__xjob *j = p->q;
    p->q = j->next;
    if (p->q == NULL)
      p->q_tail = &p->q;
    atomic_fetch_sub(&p->queued, 1);
    j->state = XJ_RUNNING;
    j->w = w;
    w->job = j;
    pthread_mutex_unlock(&p->mu);
    drain(w->wake); /* pokes meant for the job before */
    if (j->kind < SX__XJOB_KINDS)
      atomic_fetch_add(&runs[j->kind], 1);
    j->run(j);
    pthread_mutex_lock(&p->mu);
    w->job = NULL;
    j->w = NULL;
    j->state = XJ_FINISHED;
    listed(p, j);
    pthread_cond_broadcast(&p->back);
    uv_async_send(&p->async);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

/* On the loop: hand each job's news to its owner. */
static void on_news(uv_async_t *h) {
  sx__xpool *p = h->data;
  for (;;) {
    pthread_mutex_lock(&p->mu);
    sx__xjob *j = p->news;
    if (j == NULL) {
      pthread_mutex_unlock(&p->mu);
      return;
    }
    p->news = j->next;
    j->listed = 0;
    int finished = j->state == XJ_FINISHED;
    if (finished) {
      j->state = XJ_IDLE;
      atomic_store(&j->stop, 0);
    }
    pthread_mutex_unlock(&p->mu);
    j->notify(j, finished);
  }
}

int sx__xpool_create(uv_loop_t *loop, unsigned threads, sx__xpool **out) {
  sx__xpool *p = calloc(1, sizeof(*p));
  if (p == NULL || (p->w = calloc(threads, sizeof(xworker))) == NULL) {
    free(p);
    return sx__err(SX_ENOMEM, "tcp: data-mover threads");
  }
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->work, NULL);
  pthread_cond_init(&p->back, NULL);
  p->q_tail = &p->q;
  uv_async_init(loop, &p->async, on_news);
  p->async.data = p;
  /* Workers take no signals: they belong to whichever thread of the
   * engine expects them (and SIGPIPE cannot happen: MSG_NOSIGNAL). */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int rc = 0;
  for (unsigned i = 0; i < threads; i++) {
    xworker *w = &p->w[i];
    w->p = p;
    w->wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (w->wake < 0) {
      rc = sx__err(SX_EIO, "tcp: data-mover threads: eventfd: %s", strerror(errno));
      break;
    }
    if (pthread_create(&w->tid, NULL, worker_main, w) != 0) {
      close(w->wake);
      rc = sx__err(SX_EIO, "tcp: cannot start data-mover thread %u of %u", i + 1, threads);
      break;
    }
    p->n++;
  }
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc != 0) {
    sx__xpool_destroy(p);
    return rc;
  }
  *out = p;
  return 0;
}

static void pool_closed(uv_handle_t *h) {
  sx__xpool *p = h->data;
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->work);
  pthread_cond_destroy(&p->back);
  free(p->w);
  free(p);
}

void sx__xpool_destroy(sx__xpool *p) {
  if (p == NULL)
    return;
  pthread_mutex_lock(&p->mu);
  p->quit = 1;
  pthread_cond_broadcast(&p->work);
  pthread_mutex_unlock(&p->mu);
  for (unsigned i = 0; i < p->n; i++) {
    pthread_join(p->w[i].tid, NULL);
    close(p->w[i].wake);
  }
  uv_close((uv_handle_t *)&p->async, pool_closed);
}

void sx__xpool_submit(sx__xpool *p, sx__xjob *j) {
  j->pool = p;
  atomic_store(&j->stop, 0);
  pthread_mutex_lock(&p->mu);
  j->state = XJ_QUEUED;
  j->next = NULL;
  *p->q_tail = j;
  p->q_tail = &j->next;
  atomic_fetch_add(&p->queued, 1);
  if (p->idle > 0) {
    pthread_cond_signal(&p->work);
  } else {
    /* Every worker is busy: those waiting on their sockets give way. */
    for (unsigned i = 0; i < p->n; i++)
      if (p->w[i].job != NULL)
        poke(&p->w[i]);
  }
  pthread_mutex_unlock(&p->mu);
}

int sx__xpool_reclaim(sx__xjob *j) {
  sx__xpool *p = j->pool;
  if (p == NULL)
    return 0;
  int had = 0;
  pthread_mutex_lock(&p->mu);
  if (j->state == XJ_QUEUED) {
    sx__xjob **pp = &p->q;
    while (*pp != j)
      pp = &(*pp)->next;
    *pp = j->next;
    if (p->q_tail == &j->next)
      p->q_tail = pp;
    atomic_fetch_sub(&p->queued, 1);
    had = 1;
  } else if (j->state == XJ_RUNNING) {
    atomic_store(&j->stop, 1);
    poke(j->w);
    while (j->state == XJ_RUNNING)
      pthread_cond_wait(&p->back, &p->mu);
    had = 1;
  } else if (j->state == XJ_FINISHED) {
    had = 1;
  }
  if (j->listed) {
    sx__xjob **pp = &p->news;
    while (*pp != j)
      pp = &(*pp)->next;
    *pp = j->next;
    j->listed = 0;
  }
  j->state = XJ_IDLE;
  atomic_store(&j->stop, 0);
  pthread_mutex_unlock(&p->mu);
  return had;
}

int sx__xpool_yield(const sx__xjob *j) {
  return atomic_load(&j->stop) || atomic_load(&j->pool->queued) > 0;
}

int sx__xpool_wait(sx__xjob *j, int fd, short events) {
  int wake = j->w->wake;
  for (;;) {
    if (sx__xpool_yield(j))
      return 0;
    struct pollfd pf[2] = {{.fd = fd, .events = events}, {.fd = wake, .events = POLLIN}};
    int n = poll(pf, 2, -1);
    if (n < 0 && errno != EINTR)
      return 1; /* the caller's next system call on fd says what is wrong */
    if (n > 0 && pf[1].revents)
      drain(wake);
    if (n > 0 && pf[0].revents)
      return 1;
  }
}

int sx__xpool_again(sx__xjob *j, int fd, short events) {
  if (errno == EINTR)
    return 1;
  if (errno != EAGAIN && errno != EWOULDBLOCK)
    return -1;
  return sx__xpool_wait(j, fd, events);
}

void sx__xpool_progress(sx__xjob *j) {
  sx__xpool *p = j->pool;
  pthread_mutex_lock(&p->mu);
  listed(p, j);
  pthread_mutex_unlock(&p->mu);
  uv_async_send(&p->async);
}

unsigned sx__xpool_size(int32_t param, int *bad) {
  long v;
  if (sx__env_long("SX_TCP_THREADS", 0, 64, &v, bad))
    return (unsigned)v;
  if (param >= 0)
    return param > 64 ? 64 : (unsigned)param;
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  long n = cpus / 4;
  return n < 0 ? 0 : n > 4 ? 4 : (unsigned)n;
}
