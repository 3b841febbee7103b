/*
 * Data-mover threads: a small per-agent pool that moves TCP payload bytes
 * (the reader's receive, the target's send) off the agent's loop thread,
 * so that several connections go past one core's copy rate.  Not
 * installed.
 *
 * The loop keeps owning every connection's state.  For one stretch of
 * work it hands a job to the pool: from then on a worker thread alone
 * touches that direction of that socket (receive or send) and the job's
 * state, until the job returns, and the loop touches neither.  The worker
 * polls the (non-blocking) socket itself.  It tells the loop of progress
 * and of its return through one uv_async; the loop then runs the job's
 * notify().  The loop takes a job back at any time with
 * sx__xpool_reclaim(), which returns only once no worker runs it any more
 * (abort, deadline, closing): so after it, nothing writes a batch's
 * destination or reads a region on the job's behalf.
 *
 * A worker gives its job back (returns from run) where the job's owner
 * says: at the latest when the loop asks (stop), and when the job would
 * wait for its socket while other jobs wait for a thread, so that a peer
 * that stops reading, or a reply that does not come, never holds a thread
 * that other connections need (a target serving many readers, a reader of
 * many targets).
 */
#ifndef SX_XPOOL_H
#define SX_XPOOL_H

#include <stdatomic.h>
#include <stdint.h>
#include <uv.h>

typedef struct sx__xpool sx__xpool;
typedef struct sx__xjob sx__xjob;
struct sx__xworker;

struct sx__xjob {
  /* Set by the owner before submitting.  run: on a worker; returns when
   * its stretch is done or it should give way (sx__xpool_wait() said 0,
   * sx__xpool_yield() said 1).  notify: on the loop thread, after
   * progress (finished 0) or once run returned (finished 1: the loop owns
   * the job again). */
  void (*run)(sx__xjob *j);
  void (*notify)(sx__xjob *j, int finished);
  unsigned kind;            /* SX__XJOB_*, for sx__xpool_runs() */
  /* The pool's. */
  sx__xpool *pool;
  sx__xjob *next;           /* in the queue or the news list */
  int state;                /* XJ_* in xpool.c */
  int listed;               /* on the news list */
  atomic_int stop;          /* the loop wants it back */
  struct sx__xworker *w;    /* the worker running it */
};

/* Start threads workers on loop (threads >= 1).  0 or SX_ENOMEM/SX_EIO
 * (sx_errmsg() says why). */
int sx__xpool_create(uv_loop_t *loop, unsigned threads, sx__xpool **out);
/* Stop the workers and join them.  Every job must have been taken back
 * (sx__xpool_reclaim) or have finished and been notified.  The pool is
 * freed once the loop closed its async handle.  NULL: no-op. */
void sx__xpool_destroy(sx__xpool *p);
/* Queue j (idle) for a worker; from now on the loop leaves what j covers
 * alone until notify(j, 1) or sx__xpool_reclaim(j). */
void sx__xpool_submit(sx__xpool *p, sx__xjob *j);
/* Take j back, on the loop thread: returns once no worker runs it.  1 if
 * j was queued, running, or finished without notify(j, 1) yet (which will
 * not come: the caller does what it would have done); 0 if j was idle. */
int sx__xpool_reclaim(sx__xjob *j);

/* Worker side, inside run(j).  wait: until fd is ready for events (1), or
 * j should return now (0: the loop asked for it, or, while j has to wait,
 * other jobs wait for a thread).  yield: 1 when j should return at its next
 * convenient point (the same reasons, without waiting).  progress: the loop
 * runs notify(j, 0) soon. */
int sx__xpool_wait(sx__xjob *j, int fd, short events);
/* After a system call on non-blocking fd failed with errno: 1 to try it
 * again (EINTR, or fd is ready after sx__xpool_wait), 0 when j should
 * return (sx__xpool_wait said so), -1 for a real error (errno kept). */
int sx__xpool_again(sx__xjob *j, int fd, short events);
int sx__xpool_yield(const sx__xjob *j);
void sx__xpool_progress(sx__xjob *j);

/* Jobs of a kind that a worker started, in this process (tests check
 * that the threads carried the data). */
enum { SX__XJOB_RECV, SX__XJOB_SEND, SX__XJOB_KINDS };
uint64_t sx__xpool_runs(unsigned kind);

/* The pool size an agent uses: SX_TCP_THREADS from the environment when
 * set (0..64), else param when >= 0, else min(4, online CPUs / 4).  0: no
 * pool (everything on the loop thread).  *bad is set to 1 when the
 * environment value was not 0..64 (then ignored). */
unsigned sx__xpool_size(int32_t param, int *bad);

#endif
