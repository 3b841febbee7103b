/*
 * Streams, completion notices and IPC handles (see mem.h).
 *
 * A notice runs on the notifier's loop once the work queued on its stream
 * before it has finished.  Ways, chosen per notifier when it is created
 * (SX_GPU_NOTICE=auto|poll|flag|host|event; auto by default; host where
 * the driver lacks what the others need):
 *
 * - auto: polled (below), by a flag for each notice the launcher thread
 *   queues and by an event for each the loop queues itself.  A flag costs
 *   its queuer 2.5 us and the loop a load; an event costs its queuer
 *   0.2-0.3 us and the loop 1.4-1.6 us to ask (H200,
 *   tests/gpu/drv_cost.c).  The launcher works while the loop would be
 *   busy (sx__mem_deferred), so the loop, the busiest thread at 8 reads
 *   in flight, is spared the driver where it can be.
 * - flag: every notice by a flag.  The stream writes the notice's number
 *   into a word of pinned memory behind the work (cuStreamWriteValue64,
 *   which fences the work's writes before it), and the loop compares
 *   that word with the number.  A stream that broke never writes its
 *   word: once a poll of the timer has found nothing for FLAG_CHECK_US,
 *   the streams still waited for are asked (cuStreamQuery), and one that
 *   is idle or broken delivers its notices.  Without stream memory
 *   operations (the driver refuses the write), events.
 * - poll: every notice by an event (CU_EVENT_DISABLE_TIMING) recorded behind the work,
 *   which the loop itself asks with cuEventQuery: after each loop
 *   iteration (a uv_check handle: whatever woke the loop, the notices that
 *   came due meanwhile go with it) and, only while some are outstanding,
 *   on a timerfd whose interval starts at POLL_MIN_US and doubles on each
 *   poll that finds nothing, up to POLL_MAX_US.  No driver thread and no
 *   wake per notice: with host functions every completion crossed two
 *   threads the driver runs (its event handler and its host-function
 *   thread) and an eventfd before the loop saw it, and those threads were
 *   as busy as the loop itself at 8 requests in flight.  Nothing runs when
 *   nothing is outstanding.
 * - host: a host function queued on the stream (cuLaunchHostFunc): the
 *   driver runs it on its own thread once the work before it finished.  It
 *   makes no CUDA call (the driver forbids that there); it only appends the
 *   notice to the notifier's list and wakes the loop through an eventfd the
 *   loop polls (wake.h: not a uv_async_t, whose libuv 1.44 makes the loop
 *   spin).  A host function holds its stream until it returned, so the
 *   work queued behind it waits for the driver's thread to wake.
 * - event: an event recorded on the stream (blocking sync: the waiting
 *   thread sleeps until the GPU signals it) and a thread of the stream's
 *   own waits for its events in order and posts their notices: the stream
 *   runs on meanwhile.
 *
 * An event passes, and a flag is written, only once everything queued
 * before it on its stream has completed, so a polled notice is as exact as
 * a host function: a range settles only after its bytes landed.
 */
#ifdef SX_HAVE_CUDA
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include "internal.h"
#include "mem_int.h"
#include "wake.h"

/* As sx__mem_notice_counts() counts them. */
enum { NOTICE_POLL, NOTICE_HOST, NOTICE_EVENT, NOTICE_FLAG, NOTICE_WAYS };
/* Which polled notices are flags (the others are events). */
enum { FLAGS_NONE, FLAGS_LAUNCHER, FLAGS_ALL };

/* Poll mode's timer: the first poll this long after a notice was queued
 * with none outstanding (or after one came due), each empty poll doubling
 * it up to the cap.  A 128-range request takes 20-60 us on a GPU.
 * SX_GPU_POLL_US sets the first interval (1 to POLL_MAX_US). */
#define POLL_MIN_US 4
#define POLL_MAX_US 250
#define POLL_STUCK 8 /* streams remembered per poll as not done yet */
/* Flags: an empty timer poll this long after the last delivery asks the
 * driver about the streams still waited for. */
#define FLAG_CHECK_US 64
#define FLAG_WORDS 512 /* streams one notifier tells by flags */

/* SX_GPU_NOTICE=flag|poll: one outstanding notice (n->polled), or a
 * spare (n->spare).  Passed once *flag >= seq (flag), or once ev passed
 * (poll; ev is of device). */
typedef struct poll_item {
  struct poll_item *next;
  const uint64_t *flag;
  uint64_t seq;
  CUevent ev;
  CUstream s;
  int device;
  int passed; /* loop: found passed by this poll */
  sx__mem_notice *note;
} poll_item;

/* The stream that writes a flag word, and the number it wrote last. */
typedef struct flag_slot {
  CUstream s;
  uint64_t seq;
} flag_slot;

struct sx__mem_notifier {
  sx__wake wake; /* readable while notices wait */
  pthread_mutex_t mu;
  sx__mem_notice *head, **tail; /* mu */
  int mode;                     /* NOTICE_POLL (auto, poll, flag), _HOST or _EVENT */
  int flags;                    /* FLAGS_*: which polled notices are flags */
  /* Flags: words[i] is written by the stream of slots[i] (mu). */
  uint64_t *words;              /* pinned, FLAG_WORDS; NULL until the first */
  flag_slot *slots;
  int n_slots, flags_off;
  /* Poll and flag modes (tfd >= 0 once their handles are open). */
  const sx__cuda_drv *d;        /* set by the first polled notice */
  poll_item *polled, **ptail;   /* mu: outstanding, in the order queued */
  poll_item *spare;             /* mu */
  long n_polled;                /* atomic: items on polled */
  uv_check_t check;
  uv_poll_t tpoll;
  int tfd;
  unsigned min_us;              /* the first interval (SX_GPU_POLL_US) */
  unsigned next_us;             /* loop: the timer's next interval */
  unsigned idle_us;             /* loop: timer polls since one found some */
  int timer_polled;             /* loop: the timer polled in this iteration */
  int handles;                  /* loop: uv handles not closed yet */
};

static long ipc_open; /* atomic: mappings open now */
static uint64_t notice_counts[NOTICE_WAYS]; /* atomic: notices queued, by NOTICE_* */

/* SX_GPU_NOTICE=event: a stream's notices by events and a thread. */
typedef struct wait_item {
  struct wait_item *next;
  CUevent ev;
  sx__mem_notifier *n;
  sx__mem_notice *note;
} wait_item;

struct sx__mem_waiter {
  pthread_t th;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  wait_item *head, **tail, *spare; /* mu */
  int stop;                        /* mu */
  int device;
};

/* ------------------------------------------------------------ notices */

/* Each of the notifier's handles (h->data is the notifier) closes here;
 * the last frees it. */
static void notifier_closed(uv_handle_t *h) {
  sx__mem_notifier *n = h->data;
  if (--n->handles > 0)
    return;
  sx__wake_release(&n->wake);
  if (n->tfd >= 0)
    close(n->tfd);
  if (n->words != NULL)
    n->d->MemFreeHost(n->words); /* its streams were destroyed: nothing writes */
  free(n->slots);
  pthread_mutex_destroy(&n->mu);
  free(n);
}

/* Take the whole list and run it (the wake already drained: a notice
 * posted after that either is in the list taken here or woke again). */
static void deliver(sx__wake *w) {
  sx__mem_notifier *n = (sx__mem_notifier *)((char *)w - offsetof(sx__mem_notifier, wake));
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

/* SX_GPU_NOTICE, read for each notifier (tests force each way): the mode,
 * and for polled ones which notices are flags. */
static int notice_mode(int *flags) {
  const char *e = getenv("SX_GPU_NOTICE");
  *flags = FLAGS_NONE;
  if (e != NULL && strcmp(e, "poll") == 0)
    return NOTICE_POLL;
  if (e != NULL && strcmp(e, "flag") == 0) {
    *flags = FLAGS_ALL;
    return NOTICE_POLL;
  }
  if (e != NULL && strcmp(e, "host") == 0)
    return NOTICE_HOST;
  if (e != NULL && strcmp(e, "event") == 0)
    return NOTICE_EVENT;
  static int said;
  if (e != NULL && *e != '\0' && strcmp(e, "auto") != 0 &&
      !__atomic_exchange_n(&said, 1, __ATOMIC_RELAXED))
    fprintf(stderr, "segxfer: SX_GPU_NOTICE=%s is not auto, poll, flag, host or event: "
            "auto\n", e);
  *flags = FLAGS_LAUNCHER;
  return NOTICE_POLL;
}

static void arm(sx__mem_notifier *n, unsigned us) {
  struct itimerspec its = {.it_value = {.tv_sec = 0, .tv_nsec = (long)us * 1000}};
  timerfd_settime(n->tfd, 0, &its, NULL); /* cannot fail with these arguments */
}

/* Has it passed?  A flag: its word says so, or (ask: the timer found
 * nothing for a while) the driver says its stream is idle or broken, and
 * then it never will.  An event: any answer but "not ready" (passed, or
 * the stream is broken and never will: its notice comes, as the event
 * way's waiter posts one; the op's own status says what failed). */
static int passed(const sx__cuda_drv *d, const poll_item *it, int ask) {
  if (it->flag != NULL)
    return __atomic_load_n(it->flag, __ATOMIC_ACQUIRE) >= it->seq ||
           (ask && d->StreamQuery(it->s) != CUDA_ERROR_NOT_READY);
  return d->EventQuery(it->ev) != CUDA_ERROR_NOT_READY;
}

/* Loop thread: deliver the polled notices that passed; 1 if any did.
 * Notices of one stream pass in order, so a stream found not done is not
 * asked again in this pass. */
static int poll_events(sx__mem_notifier *n, int ask) {
  if (__atomic_load_n(&n->n_polled, __ATOMIC_ACQUIRE) == 0)
    return 0;
  /* The items queued so far, first to last.  Only this thread takes items
   * off and others append behind the last, so these stay put while the
   * driver is asked without the lock (a notice queued meanwhile does not
   * wait for the queries). */
  pthread_mutex_lock(&n->mu);
  const sx__cuda_drv *d = n->d;
  poll_item *first = n->polled, *last = first;
  for (poll_item *it = first; it != NULL; it = it->next)
    last = it;
  pthread_mutex_unlock(&n->mu);
  if (first == NULL)
    return 0;
  CUstream stuck[POLL_STUCK];
  int n_stuck = 0;
  long got = 0;
  for (poll_item *it = first;; it = it->next) {
    int k = 0;
    while (k < n_stuck && stuck[k] != it->s)
      k++;
    it->passed = k == n_stuck && passed(d, it, ask);
    if (it->passed)
      got++;
    else if (k == n_stuck && n_stuck < POLL_STUCK)
      stuck[n_stuck++] = it->s;
    if (it == last)
      break;
  }
  if (got == 0)
    return 0;
  sx__mem_notice *done = NULL, **dtail = &done;
  pthread_mutex_lock(&n->mu);
  poll_item **pp = &n->polled;
  while (*pp != NULL) {
    poll_item *it = *pp;
    if (!it->passed) {
      pp = &it->next;
      continue;
    }
    *pp = it->next;
    *dtail = it->note;
    dtail = &it->note->next;
    it->note = NULL;
    it->passed = 0;
    it->next = n->spare;
    n->spare = it;
  }
  n->ptail = pp;
  __atomic_sub_fetch(&n->n_polled, got, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&n->mu);
  *dtail = NULL;
  while (done != NULL) {
    sx__mem_notice *note = done;
    done = note->next;
    note->fn(note); /* may queue more notices: n->mu is not held */
  }
  return 1;
}

/* Loop thread: poll, then time the next poll while any are outstanding
 * (a notice queued with none outstanding arms the timer itself). */
static void poll_and_rearm(sx__mem_notifier *n, int from_timer) {
  int got = poll_events(n, from_timer && n->idle_us >= FLAG_CHECK_US);
  int left = __atomic_load_n(&n->n_polled, __ATOMIC_ACQUIRE) > 0;
  if (got || !left)
    n->idle_us = 0;
  if (!left) {
    n->next_us = n->min_us;
    return;
  }
  if (got) {
    n->next_us = n->min_us;
    arm(n, n->next_us);
  } else if (from_timer) {
    n->idle_us += n->next_us;
    n->next_us = n->next_us * 2 > POLL_MAX_US ? POLL_MAX_US : n->next_us * 2;
    arm(n, n->next_us);
  }
}

static void on_timer(uv_poll_t *h, int status, int events) {
  (void)status, (void)events;
  sx__mem_notifier *n = h->data;
  uint64_t v;
  ssize_t r;
  while ((r = read(n->tfd, &v, sizeof(v))) < 0 && errno == EINTR) {
  }
  (void)r; /* EAGAIN: a re-arm cleared it */
  n->timer_polled = 1;
  poll_and_rearm(n, 1);
}

/* After each loop iteration: the notices that came due while the loop was
 * busy go now, with no timer wake (none when the timer just polled). */
static void on_check(uv_check_t *h) {
  sx__mem_notifier *n = h->data;
  if (n->timer_polled) {
    n->timer_polled = 0;
    return;
  }
  poll_and_rearm(n, 0);
}

/* Loop thread: open poll mode's timer and handles; 0, or -1 (the
 * notifier then uses host functions). */
static int poll_open(uv_loop_t *loop, sx__mem_notifier *n) {
  if ((n->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)) < 0)
    return -1;
  if (uv_poll_init(loop, &n->tpoll, n->tfd) != 0) {
    close(n->tfd);
    n->tfd = -1;
    return -1;
  }
  n->tpoll.data = n;
  n->handles++;
  uv_check_init(loop, &n->check);
  n->check.data = n;
  n->handles++;
  const char *e = getenv("SX_GPU_POLL_US");
  char *end = NULL;
  long us = e != NULL ? strtol(e, &end, 10) : 0;
  int ok = e != NULL && end != e && *end == '\0' && us >= 1 && us <= POLL_MAX_US;
  if (e != NULL && !ok)
    fprintf(stderr, "segxfer: SX_GPU_POLL_US=%s is not a whole number of 1..%u: %u us\n", e,
            POLL_MAX_US, POLL_MIN_US);
  n->min_us = ok ? (unsigned)us : POLL_MIN_US;
  n->next_us = n->min_us;
  n->ptail = &n->polled;
  if (uv_poll_start(&n->tpoll, UV_READABLE, on_timer) != 0 ||
      uv_check_start(&n->check, on_check) != 0)
    return -1; /* handles open: the caller closes them */
  return 0;
}

int sx__mem_notifier_create(uv_loop_t *loop, sx__mem_notifier **out) {
  sx__mem_notifier *n = calloc(1, sizeof(*n));
  if (n == NULL)
    return sx__err(SX_ENOMEM, "notifier");
  pthread_mutex_init(&n->mu, NULL);
  n->tail = &n->head;
  n->tfd = -1;
  n->mode = notice_mode(&n->flags);
  int rc = sx__wake_init(loop, &n->wake, deliver);
  n->wake.poll.data = n;
  if (n->wake.fd >= 0)
    n->handles++;
  if (rc == 0 && n->mode == NOTICE_POLL && poll_open(loop, n) != 0) {
    if (n->tfd >= 0)
      rc = sx__err(SX_EIO, "notifier: cannot poll its timer");
    else
      n->mode = NOTICE_HOST; /* no timerfd: host functions, as before */
  }
  if (rc != 0) {
    if (n->handles > 0) {
      sx__mem_notifier_close(n); /* frees n once its handles closed */
      return rc;
    }
    pthread_mutex_destroy(&n->mu);
    free(n);
    return rc;
  }
  *out = n;
  return 0;
}

void sx__mem_notifier_close(sx__mem_notifier *n) {
  if (n == NULL)
    return;
  sx__wake_drain(&n->wake);
  deliver(&n->wake);
  if (n->tfd >= 0) {
    /* Every stream that queued notices here was destroyed (synchronised)
     * first: every event has passed, so every notice goes now. */
    pthread_mutex_lock(&n->mu);
    poll_item *list = n->polled;
    n->polled = NULL;
    n->ptail = &n->polled;
    __atomic_store_n(&n->n_polled, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&n->mu);
    while (list != NULL) {
      poll_item *it = list;
      list = it->next;
      it->note->fn(it->note);
      it->next = n->spare;
      n->spare = it;
    }
    while (n->spare != NULL) {
      poll_item *it = n->spare;
      n->spare = it->next;
      if (it->ev != NULL)
        n->d->EventDestroy(it->ev);
      free(it);
    }
    uv_close((uv_handle_t *)&n->tpoll, notifier_closed);
    uv_close((uv_handle_t *)&n->check, notifier_closed);
  }
  if (n->wake.fd >= 0)
    sx__wake_close(&n->wake, notifier_closed);
}

void sx__mem_notice_post(sx__mem_notifier *n, sx__mem_notice *note) {
  note->next = NULL;
  pthread_mutex_lock(&n->mu);
  /* One wake per list: deliver() takes the whole list, so a notice queued
   * behind others rides on the wake the first one sent (or is about to
   * send, right after its unlock).  Each wake is a write(2) here and a
   * read(2) on the loop (as in call.c's enqueue). */
  int first = n->head == NULL;
  *n->tail = note;
  n->tail = &note->next;
  pthread_mutex_unlock(&n->mu);
  if (first)
    sx__wake_send(&n->wake);
}

/* The driver's thread: no CUDA calls here.  The notice carries its
 * notifier, so queueing one allocates nothing. */
static void CUDA_CB host_fn(void *arg) {
  sx__mem_notice *note = arg;
  sx__mem_notice_post(note->nf, note);
}

static void *waiter_main(void *arg) {
  struct sx__mem_waiter *w = arg;
  int rc;
  pthread_setname_np(pthread_self(), "sx-cuwait");
  const sx__cuda_drv *d = sx__cuda_get(w->device, &rc);
  pthread_mutex_lock(&w->mu);
  for (;;) {
    while (w->head == NULL && !w->stop)
      pthread_cond_wait(&w->cv, &w->mu);
    wait_item *it = w->head;
    if (it == NULL)
      break;
    pthread_mutex_unlock(&w->mu);
    /* Blocks until the GPU passed the event (an error means the stream is
     * broken: the notice comes anyway, as a host function's would not). */
    if (d != NULL)
      d->EventSynchronize(it->ev);
    sx__mem_notice_post(it->n, it->note);
    pthread_mutex_lock(&w->mu);
    w->head = it->next;
    if (w->head == NULL)
      w->tail = &w->head;
    it->next = w->spare;
    w->spare = it;
  }
  pthread_mutex_unlock(&w->mu);
  return NULL;
}

/* Queue note behind s as an event its waiter thread waits for: 0, or 1
 * when that cannot be done (a host function then). */
static int notify_event(const sx__cuda_drv *d, sx__mem_stream *s, sx__mem_notifier *n,
                        sx__mem_notice *note) {
  if (d->EventCreate == NULL || d->EventRecord == NULL || d->EventSynchronize == NULL ||
      d->EventDestroy == NULL)
    return 1;
  struct sx__mem_waiter *w = s->w;
  if (w == NULL) {
    if ((w = calloc(1, sizeof(*w))) == NULL)
      return 1;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->tail = &w->head;
    w->device = s->device;
    if (pthread_create(&w->th, NULL, waiter_main, w) != 0) {
      pthread_mutex_destroy(&w->mu);
      pthread_cond_destroy(&w->cv);
      free(w);
      return 1;
    }
    s->w = w;
  }
  pthread_mutex_lock(&w->mu);
  wait_item *it = w->spare;
  if (it != NULL)
    w->spare = it->next;
  pthread_mutex_unlock(&w->mu);
  if (it == NULL) {
    if ((it = calloc(1, sizeof(*it))) == NULL)
      return 1;
    if (d->EventCreate(&it->ev, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING) !=
        CUDA_SUCCESS) {
      free(it);
      return 1;
    }
  }
  if (d->EventRecord(it->ev, s->s) != CUDA_SUCCESS) {
    d->EventDestroy(it->ev);
    free(it);
    return 1;
  }
  it->n = n;
  it->note = note;
  it->next = NULL;
  pthread_mutex_lock(&w->mu);
  *w->tail = it;
  w->tail = &it->next;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
  return 0;
}

/* The stream's work has ended: its waiter posts what is left and goes. */
static void waiter_stop(const sx__cuda_drv *d, struct sx__mem_waiter *w) {
  if (w == NULL)
    return;
  pthread_mutex_lock(&w->mu);
  w->stop = 1;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
  pthread_join(w->th, NULL);
  while (w->spare != NULL) {
    wait_item *it = w->spare;
    w->spare = it->next;
    d->EventDestroy(it->ev);
    free(it);
  }
  pthread_mutex_destroy(&w->mu);
  pthread_cond_destroy(&w->cv);
  free(w);
}

/* mu held: queue it as outstanding; 1 if it is the first (the caller
 * then starts the timer, after unlocking). */
static int poll_queue(sx__mem_notifier *n, poll_item *it, sx__mem_notice *note, CUstream s) {
  it->s = s;
  it->note = note;
  it->next = NULL;
  int first = n->polled == NULL;
  *n->ptail = it;
  n->ptail = &it->next;
  __atomic_add_fetch(&n->n_polled, 1, __ATOMIC_RELEASE);
  return first;
}

/* The timer runs while any are outstanding: started by the first (a
 * timerfd may be armed from any thread). */
static void poll_started(sx__mem_notifier *n, int first) {
  if (first)
    arm(n, n->min_us);
}

/* Queue note behind s as an event the loop polls: 0, or 1 when that
 * cannot be done (a host function then). */
static int notify_poll(const sx__cuda_drv *d, sx__mem_stream *s, sx__mem_notifier *n,
                       sx__mem_notice *note) {
  if (d->EventCreate == NULL || d->EventRecord == NULL || d->EventQuery == NULL ||
      d->EventDestroy == NULL)
    return 1;
  /* A spare event of the stream's device (an event records only on
   * streams of its own context). */
  pthread_mutex_lock(&n->mu);
  n->d = d;
  poll_item **pp = &n->spare;
  while (*pp != NULL && (*pp)->device != s->device)
    pp = &(*pp)->next;
  poll_item *it = *pp;
  if (it != NULL)
    *pp = it->next;
  pthread_mutex_unlock(&n->mu);
  if (it == NULL) {
    if ((it = calloc(1, sizeof(*it))) == NULL)
      return 1;
    if (d->EventCreate(&it->ev, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) {
      free(it);
      return 1;
    }
    it->device = s->device;
  }
  if (d->EventRecord(it->ev, s->s) != CUDA_SUCCESS) {
    d->EventDestroy(it->ev);
    free(it);
    return 1;
  }
  it->flag = NULL; /* a spare may have served a flag before */
  pthread_mutex_lock(&n->mu);
  int first = poll_queue(n, it, note, s->s);
  pthread_mutex_unlock(&n->mu);
  poll_started(n, first);
  return 0;
}

/* mu held: the word stream s writes its flags into, or -1 (none left, or
 * no pinned memory: events then). */
static int flag_word(sx__mem_notifier *n, const sx__cuda_drv *d, CUstream s) {
  for (int k = 0; k < n->n_slots; k++)
    if (n->slots[k].s == s)
      return k;
  if (n->words == NULL) {
    void *p;
    if (d->MemHostAlloc(&p, FLAG_WORDS * sizeof(uint64_t), CU_MEMHOSTALLOC_PORTABLE) !=
        CUDA_SUCCESS)
      return -1;
    if ((n->slots = calloc(FLAG_WORDS, sizeof(flag_slot))) == NULL) {
      d->MemFreeHost(p);
      return -1;
    }
    memset(p, 0, FLAG_WORDS * sizeof(uint64_t));
    n->words = p;
  }
  if (n->n_slots == FLAG_WORDS)
    return -1;
  /* A stream destroyed and its handle given to a new one goes on with the
   * numbers where they were: the word never goes back. */
  n->slots[n->n_slots] = (flag_slot){s, 0};
  return n->n_slots++;
}

/* Queue note behind s as a flag the loop polls: 0, or 1 when that cannot
 * be done (events then).  The driver is asked without n->mu (a write
 * costs microseconds, and the loop takes mu to poll): a stream's notices
 * are queued by one thread at a time, in order, so its numbers reach its
 * word in order. */
static int notify_flag(const sx__cuda_drv *d, sx__mem_stream *s, sx__mem_notifier *n,
                       sx__mem_notice *note) {
  if (d->StreamWriteValue64 == NULL || d->StreamQuery == NULL || d->MemHostAlloc == NULL)
    return 1;
  pthread_mutex_lock(&n->mu);
  n->d = d;
  int k = n->flags_off ? -1 : flag_word(n, d, s->s);
  poll_item *it = k < 0 ? NULL : n->spare;
  if (it != NULL)
    n->spare = it->next;
  uint64_t seq = k < 0 ? 0 : n->slots[k].seq + 1;
  uint64_t *word = k < 0 ? NULL : &n->words[k];
  pthread_mutex_unlock(&n->mu);
  if (k >= 0 && it == NULL && (it = calloc(1, sizeof(*it))) != NULL)
    it->device = -1; /* no event: never a spare for notify_poll */
  if (it == NULL)
    return 1;
  CUresult r = d->StreamWriteValue64(s->s, (CUdeviceptr)(uintptr_t)word, seq,
                                     CU_STREAM_WRITE_VALUE_DEFAULT);
  pthread_mutex_lock(&n->mu);
  int first = 0;
  if (r == CUDA_SUCCESS) {
    n->slots[k].seq = seq;
    it->flag = word;
    it->seq = seq;
    first = poll_queue(n, it, note, s->s);
  } else {
    it->next = n->spare;
    n->spare = it;
    /* The driver or device has no stream memory operations. */
    if (r == CUDA_ERROR_NOT_SUPPORTED || r == CUDA_ERROR_INVALID_VALUE)
      n->flags_off = 1;
  }
  pthread_mutex_unlock(&n->mu);
  poll_started(n, first);
  return r == CUDA_SUCCESS ? 0 : 1;
}

/* Queue note behind s now, on this thread (the launcher's when
 * launcher is set). */
static int notify_now(sx__mem_stream *s, sx__mem_notifier *n, sx__mem_notice *note,
                      int launcher) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(s->device, &rc);
  if (d == NULL)
    return rc;
  int how = NOTICE_HOST;
  int flag = n->mode == NOTICE_POLL && (n->flags == FLAGS_ALL ||
                                        (n->flags == FLAGS_LAUNCHER && launcher));
  if (flag && notify_flag(d, s, n, note) == 0)
    how = NOTICE_FLAG;
  else if (n->mode == NOTICE_POLL && notify_poll(d, s, n, note) == 0)
    how = NOTICE_POLL;
  else if (n->mode == NOTICE_EVENT && notify_event(d, s, n, note) == 0)
    how = NOTICE_EVENT;
  __atomic_add_fetch(&notice_counts[how], 1, __ATOMIC_RELAXED);
  if (how != NOTICE_HOST)
    return 0;
  note->nf = n;
  CUresult r = d->LaunchHostFunc(s->s, host_fn, note);
  if (r != CUDA_SUCCESS)
    return sx__cuda_err(d, r, "queueing a completion notice");
  return 0;
}

/* The launcher's thread: a notice queued by sx__mem_notify.  It carries
 * the error of a launch before it that failed; one that cannot be queued
 * at all comes once the stream's work ended, with that error. */
static void notice_job(sx__mem_job *j) {
  sx__mem_stream *s = j->s;
  sx__mem_notice *note = j->b;
  note->status = __atomic_exchange_n(&s->err, 0, __ATOMIC_ACQ_REL);
  int rc = notify_now(s, j->a, note, 1);
  if (rc == 0)
    return;
  int e;
  const sx__cuda_drv *d = sx__cuda_get(s->device, &e);
  if (d != NULL)
    d->StreamSynchronize(s->s);
  if (note->status == 0)
    note->status = rc;
  sx__mem_notice_post(j->a, note);
}

int sx__mem_notify(sx__mem_stream *s, sx__mem_notifier *n, sx__mem_notice *note) {
  note->status = 0;
  note->mark = sx__gather_ring_mark(s->ring);
  if (sx__mem_deferred(s)) {
    if (sx__mem_launcher_queue(s, notice_job, n, note, 0) == 0)
      return 0;
    sx__mem_launcher_drain(s); /* no memory for the job: in order, here */
    note->status = __atomic_exchange_n(&s->err, 0, __ATOMIC_ACQ_REL);
  }
  return notify_now(s, n, note, 0);
}

void sx__mem_notice_counts(uint64_t out[4]) {
  for (int i = 0; i < NOTICE_WAYS; i++)
    out[i] = __atomic_load_n(&notice_counts[i], __ATOMIC_RELAXED);
}

/* ------------------------------------------------------------ streams */

int sx__mem_stream_create(int device, sx__mem_stream **out) {
  return sx__mem_stream_create_on(device, NULL, out);
}

int sx__mem_stream_create_on(int device, sx__mem_launcher *l, sx__mem_stream **out) {
  int rc;
  const sx__cuda_drv *d = sx__cuda_get(device, &rc);
  if (d == NULL)
    return rc;
  sx__mem_stream *s = calloc(1, sizeof(*s));
  if (s == NULL)
    return sx__err(SX_ENOMEM, "stream");
  s->device = device;
  s->l = l;
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
  sx__mem_launcher_drain(s);
  const sx__cuda_drv *d = sx__cuda_get(s->device, &rc);
  if (d != NULL) {
    d->StreamSynchronize(s->s);
    waiter_stop(d, s->w);
    sx__gather_ring_free(d, s->ring);
    d->StreamDestroy(s->s);
  }
  free(s);
}

int sx__mem_stream_device(const sx__mem_stream *s) { return s->device; }

void sx__mem_stream_defer(sx__mem_stream *s, int on) { s->defer = on; }

void sx__mem_stream_passed(sx__mem_stream *s, const sx__mem_notice *note) {
  sx__gather_ring_passed(s->ring, note->mark);
}

long sx__mem_notifier_pending(sx__mem_notifier *n) {
  return __atomic_load_n(&n->n_polled, __ATOMIC_ACQUIRE);
}

int sx__mem_copy_async(sx__mem_stream *s, void *dst, const void *src, size_t len) {
  int rc;
  sx__mem_launcher_drain(s);
  const sx__cuda_drv *d = sx__cuda_get(s->device, &rc);
  if (d == NULL)
    return rc;
  CUresult r = d->MemcpyAsync((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src,
                              len, s->s);
  return r == CUDA_SUCCESS ? 0 : sx__cuda_err(d, r, "queueing a copy");
}

int sx__mem_stream_sync(sx__mem_stream *s) {
  int rc;
  sx__mem_launcher_drain(s);
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
