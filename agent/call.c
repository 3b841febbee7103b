/*
 * Cross-thread calls: any thread queues a call under the agent's lock and
 * wakes the loop (mem/wake.h) if it may be asleep; the loop runs it and
 * finishes it, possibly much later (when the store answers).  A busy loop
 * is not woken: it takes the calls queued meanwhile just before it polls
 * (a uv_prepare handle), after saying that from then on callers must wake
 * it, so each busy turn spares the caller a write(2) and the loop an
 * epoll event and a read(2).  Waiters sleep on the
 * agent's condition variable with a timeout; one that gives up leaves the
 * call to the loop, which releases whatever result nobody will collect.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "agent_int.h"

int sx__on_loop(const sx_agent *a) {
  uv_thread_t self = uv_thread_self();
  return uv_thread_equal(&self, &a->loop_tid);
}

static void release(sx__call *c) {
  if (c->discard)
    c->discard(c);
  if (!c->embedded)
    free(c);
}

static int enqueue(sx_agent *a, sx__call *c, int refs) {
  c->a = a;
  c->next = NULL;
  c->done = 0;
  c->refs = refs;
  pthread_mutex_lock(&a->lock);
  if (a->stopping) {
    pthread_mutex_unlock(&a->lock);
    return sx__err(SX_ESHUTDOWN, "the agent is shutting down");
  }
  /* One wake per batch of queued calls: the loop takes the whole queue
   * at once (take_all), so a call queued behind others rides on the wake
   * the first one sent (or is about to send, right after its unlock).
   * Each wake is a write(2) here and a read(2) on the loop; with many
   * batches in flight this skips most of them. */
  int first = a->calls == NULL;
  *a->calls_tail = c;
  a->calls_tail = &c->next;
  /* Sequentially consistent, as calls_prepare's store of loop_sleepy and
   * load of calls_pending: either the loop sees this call there, or this
   * sees that it may sleep. */
  __atomic_store_n(&a->calls_pending, 1, __ATOMIC_SEQ_CST);
  pthread_mutex_unlock(&a->lock);
  if (first && __atomic_load_n(&a->loop_sleepy, __ATOMIC_SEQ_CST))
    sx__wake_send(&a->wake);
  return 0;
}

int sx__call_post(sx_agent *a, sx__call *c) { return enqueue(a, c, 1); }

void sx__deadline(struct timespec *ts, uint32_t ms) {
  clock_gettime(CLOCK_MONOTONIC, ts);
  ts->tv_sec += ms / 1000;
  ts->tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts->tv_nsec >= 1000000000L) {
    ts->tv_sec++;
    ts->tv_nsec -= 1000000000L;
  }
}

/* Drop one reference (lock held); returns 1 if the caller must free c. */
static int unref_locked(sx__call *c) { return --c->refs == 0; }

int sx__call_wait(sx_agent *a, sx__call *c, uint32_t timeout_ms, int *rc) {
  int err;
  if (sx__on_loop(a))
    err = sx__err(SX_EBUSY, "this call waits, so it cannot run on the agent's own "
                  "thread (from a callback)");
  else
    err = enqueue(a, c, 2);
  if (err) {
    release(c); /* never queued */
    return err;
  }
  struct timespec ts;
  sx__deadline(&ts, timeout_ms);
  pthread_mutex_lock(&a->lock);
  while (!c->done) {
    if (pthread_cond_timedwait(&a->cond, &a->lock, &ts) == ETIMEDOUT && !c->done)
      break;
  }
  if (c->done) {
    c->refs--;
    pthread_mutex_unlock(&a->lock);
    *rc = c->rc;
    return 0;
  }
  c->refs--; /* the loop holds the last reference and frees it */
  pthread_mutex_unlock(&a->lock);
  return sx__err(SX_ETIMEDOUT, "the agent did not answer within %u ms", timeout_ms);
}

void sx__call_finish(sx__call *c, int rc, const char *msg) {
  sx_agent *a = c->a;
  c->rc = rc;
  snprintf(c->msg, sizeof(c->msg), "%s", rc && msg ? msg : "");
  pthread_mutex_lock(&a->lock);
  c->done = 1;
  int last = unref_locked(c);
  pthread_cond_broadcast(&a->cond);
  pthread_mutex_unlock(&a->lock);
  if (last)
    release(c); /* posted, or its waiter gave up */
}

void sx__call_free(sx__call *c) {
  if (!c->embedded)
    free(c);
}

int sx__call_result(const sx__call *c, int rc) {
  if (rc && c->msg[0])
    return sx__err(rc, "%s", c->msg);
  if (rc)
    return sx__err(rc, "%s", sx_strerror(rc));
  return 0;
}

static sx__call *take_all(sx_agent *a) {
  pthread_mutex_lock(&a->lock);
  sx__call *c = a->calls;
  a->calls = NULL;
  a->calls_tail = &a->calls;
  __atomic_store_n(&a->calls_pending, 0, __ATOMIC_SEQ_CST);
  pthread_mutex_unlock(&a->lock);
  return c;
}

void sx__calls_run(sx__wake *w) {
  sx_agent *a = (sx_agent *)((char *)w - offsetof(sx_agent, wake));
  sx__call *c = take_all(a);
  while (c) {
    sx__call *next = c->next;
    c->run(c); /* each run fails fast once a->shutting_down is set */
    c = next;
  }
}

static void calls_idle(uv_idle_t *h) { (void)h; }

/* Before the loop polls (and may block): from now on callers wake it; the
 * calls they queued without (the loop was busy) run now.  What they start
 * may be finished by other phase handles that already ran in this turn (a
 * store command is written by the store's check or prepare handle), so
 * the poll after them must not block: the idle handle makes it return at
 * once, and the check phase follows. */
static void calls_prepare(uv_prepare_t *h) {
  sx_agent *a = h->data;
  __atomic_store_n(&a->loop_sleepy, 1, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&a->calls_pending, __ATOMIC_SEQ_CST)) {
    sx__calls_run(&a->wake);
    uv_idle_start(&a->calls_idle, calls_idle);
  }
}

/* The poll returned: the loop is busy until its next calls_prepare. */
static void calls_checked(uv_check_t *h) {
  sx_agent *a = h->data;
  __atomic_store_n(&a->loop_sleepy, 0, __ATOMIC_RELAXED);
  uv_idle_stop(&a->calls_idle);
}

void sx__calls_open(sx_agent *a) {
  __atomic_store_n(&a->loop_sleepy, 1, __ATOMIC_RELAXED); /* until the first turn */
  uv_prepare_init(&a->loop, &a->calls_prep);
  a->calls_prep.data = a;
  uv_prepare_start(&a->calls_prep, calls_prepare);
  uv_check_init(&a->loop, &a->calls_check);
  a->calls_check.data = a;
  uv_check_start(&a->calls_check, calls_checked);
  uv_idle_init(&a->loop, &a->calls_idle);
}

void sx__calls_close(sx_agent *a) {
  /* Callers wake the loop again until the agent stops taking calls. */
  __atomic_store_n(&a->loop_sleepy, 1, __ATOMIC_SEQ_CST);
  if (!uv_is_closing((uv_handle_t *)&a->calls_prep))
    uv_close((uv_handle_t *)&a->calls_prep, NULL);
  if (!uv_is_closing((uv_handle_t *)&a->calls_check))
    uv_close((uv_handle_t *)&a->calls_check, NULL);
  if (!uv_is_closing((uv_handle_t *)&a->calls_idle))
    uv_close((uv_handle_t *)&a->calls_idle, NULL);
}

void sx__calls_drain(sx_agent *a) {
  pthread_mutex_lock(&a->lock);
  a->stopping = 1;
  pthread_mutex_unlock(&a->lock);
  sx__call *c = take_all(a);
  while (c) {
    sx__call *next = c->next;
    c->run(c);
    c = next;
  }
}
