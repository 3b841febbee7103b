/*
 * When the data-mover threads (xpool.h) engage: per agent and side (the
 * reader's receive, the target's send), payloads go to the threads only
 * while at least `conns` connections of that side have payload work.
 * Not installed.
 *
 * Why: a hand-over costs a wakeup of a worker and, for each stretch it
 * finishes, one of the loop; with one busy connection the loop has
 * nothing else to do and moves the bytes at the raw stream's rate itself
 * (on 32 CPUs, one connection read 1.01-1.15x of the raw stream without
 * threads and 0.83-0.94x with them; docs/benchmarks.md).  With two and
 * more the threads run them on several cores at once.
 *
 * Hysteresis: once engaged, a side stays so for SX__ENGAGE_HOLD_MS after
 * its busy connections last reached `conns`, so that connections going
 * idle for a moment between batches do not move payloads back and forth.  A worker
 * lent a connection's receive side gives it back at its next reply
 * boundary once the side is off (sx__engage_on()).
 *
 * All but sx__engage_on() and sx__engage_kept() run on the loop thread.
 */
#ifndef SX_ENGAGE_H
#define SX_ENGAGE_H

#include <stdatomic.h>
#include <stdint.h>
#include <uv.h>

/* The default for `conns`, and the hold. */
#define SX__ENGAGE_CONNS 2u
#define SX__ENGAGE_HOLD_MS 10u

typedef struct sx__engage {
  uint32_t conns;  /* busy connections from which payloads go to threads */
  unsigned kind;   /* SX__XJOB_*, for sx__engage_kept() */
  uint64_t until;  /* loop time (ms) the side stays engaged until */
  atomic_int on;   /* engaged now (workers read it) */
} sx__engage;

void sx__engage_init(sx__engage *e, unsigned kind, uint32_t conns);
/* The side has busy connections of payload work now (callers count up to
 * e->conns, then stop): 1 while payloads go to the threads. */
int sx__engage_update(sx__engage *e, uv_loop_t *loop, uint32_t busy);
/* A large payload (or reply write) stays on the loop because the side is
 * not engaged: counted for sx__engage_kept(). */
void sx__engage_keep(const sx__engage *e);
static inline int sx__engage_on(sx__engage *e) {
  return atomic_load_explicit(&e->on, memory_order_relaxed);
}
/* Payloads of a kind (SX__XJOB_RECV: replies received, SX__XJOB_SEND:
 * reply writes) kept on the loop this way, in this process (tests check
 * which mode ran; sx__xpool_runs() counts the other). */
uint64_t sx__engage_kept(unsigned kind);

/* SX_TCP_THREAD_CONNS from the environment (1..1024), else
 * SX__ENGAGE_CONNS; *bad is set to 1 when the value was not 1..1024. */
uint32_t sx__engage_conns(int *bad);

#endif
