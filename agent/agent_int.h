/*
 * The agent's insides, shared by agent.c (lifecycle, thread), log.c
 * (logging, published state; the bottom file), call.c (cross-thread
 * calls), region.c (registration), lease.c (publish/renew), segment.c
 * (open by name) and batch.c.  Not installed.
 *
 * Threading: the loop thread owns everything below except the fields
 * marked "lock": those are also read or written by API callers under
 * a->lock.  Descriptors, region snapshots and segment indexes are
 * immutable once published, so planners on caller threads read them
 * without locks.
 */
#ifndef SX_AGENT_INT_H
#define SX_AGENT_INT_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>
#include <uv.h>

#include "backend.h"
#include "cache.h"
#include "internal.h"
#include "log.h"
#include "planner.h"
#include "deadline.h"
#include "mem/wake.h"
#include "segxfer/agent.h"
#include "transport/transport.h"

/* ------------------------------------------------------------ calls */

typedef struct sx__call sx__call;

/*
 * A request from an API caller to the loop thread.  The caller allocates
 * it (usually as the first member of a larger struct), the loop runs it
 * and finishes it with sx__call_finish().  Either side may be the last to
 * let go: a waiter that times out abandons the call, and the loop then
 * calls discard (to release results nobody will collect) and frees it.
 */
struct sx__call {
  sx__call *next;
  sx_agent *a;
  void (*run)(sx__call *c);     /* loop thread */
  void (*discard)(sx__call *c); /* loop thread; may be NULL */
  int refs;                     /* lock: waiter + loop */
  int done;                     /* lock */
  int embedded;                 /* lives inside another object: never freed */
  int rc;
  char msg[256];
};

/* Queue c and wait up to timeout_ms for it.  Returns 0 when the call
 * finished (*rc is its result, and the caller must sx__call_free(c) after
 * reading what it needs), or SX_ETIMEDOUT/SX_ESHUTDOWN/SX_EBUSY when it
 * gave up: c is then no longer the caller's (freed now, or by the loop
 * after it finishes, which runs discard).  On the agent thread itself it
 * fails with SX_EBUSY without queueing. */
int sx__call_wait(sx_agent *a, sx__call *c, uint32_t timeout_ms, int *rc);
/* Queue c without waiting; the loop frees it (unless embedded).  Returns
 * SX_ESHUTDOWN when the agent no longer takes calls (c is then the
 * caller's).  Any thread, including the agent thread. */
int sx__call_post(sx_agent *a, sx__call *c);
/* Loop thread: c is done with rc (and msg, may be NULL). */
void sx__call_finish(sx__call *c, int rc, const char *msg);
/* Release a call sx__call_wait() finished. */
void sx__call_free(sx__call *c);
/* Loop thread: run what is queued (the async handle's callback). */
void sx__calls_run(sx__wake *w);
/* Loop thread (or before it runs), after the wake: the handles that let
 * a caller skip the wake while the loop is busy; sx__calls_close closes
 * them (beside sx__wake_close). */
void sx__calls_open(sx_agent *a);
void sx__calls_close(sx_agent *a);
/* Loop thread, at shutdown: refuse new calls and run what is queued (every
 * run fails fast once a->shutting_down is set). */
void sx__calls_drain(sx_agent *a);
/* CLOCK_MONOTONIC now + ms, for condition waits (the agent's and batches'
 * condition variables use that clock). */
void sx__deadline(struct timespec *ts, uint32_t ms);
/* Record a loop-side failure as the caller's sx_errmsg(). */
int sx__call_result(const sx__call *c, int rc);

/* ------------------------------------------------------------ regions */

/* A registered region and its reference count (snapshots hold it). */
typedef struct sx__lreg {
  sx_lregion l; /* first: planners cast sx_region* -> sx_lregion* -> sx__lreg* */
  int refs;     /* atomic */
} sx__lreg;

/* An immutable snapshot of the registered regions; swapped on every
 * (un)registration, so a batch planned against one keeps its regions
 * alive without locks. */
typedef struct sx__ltable {
  int refs; /* atomic */
  uint32_t n;
  sx_lregion **v; /* registration order */
  sx__rindex ix;
} sx__ltable;

sx__ltable *sx__ltable_get(sx_agent *a); /* any thread: a new reference */
void sx__ltable_put(sx__ltable *t);      /* any thread */
/* Loop thread: the region with this id that is published (not withdrawn). */
sx_lregion *sx__find_region(void *agent, uint32_t id);
/* Loop thread: the i-th registered region (withdrawn ones too), or NULL. */
sx_lregion *sx__region_at(void *agent, uint32_t i);
/* Loop thread: the whole descriptor this agent publishes (endpoints packed
 * by the transports, generation of the last publish). */
int sx__local_desc(sx_agent *a, sx_desc *d);
/* Any thread: layout, labels and registered regions only (for checks). */
int sx__layout_desc(sx_agent *a, sx_desc *d);
/* Loop thread: unregistrations waiting for reads to drain. */
void sx__regions_close(sx_agent *a);


/* ------------------------------------------------------------ lease */

typedef struct sx__lease_req sx__lease_req;

typedef struct sx__lease {
  uv_timer_t timer;
  int timer_init;
  int busy;                /* a store op is in flight */
  int kick;                /* the store came back during it: renew after */
  int want;                /* the user asked to be published */
  uint64_t generation;     /* the last one sent */
  uint32_t egen_retries;
  sx__lease_req *q, **q_tail;
} sx__lease;

/* Loop thread.  then(a, arg, rc) runs once when the store answered. */
void sx__lease_publish(sx_agent *a, unsigned flags, void (*then)(sx_agent *, void *, int),
                       void *arg);
void sx__lease_unpublish(sx_agent *a, void (*then)(sx_agent *, void *, int), void *arg);
void sx__lease_on_conn(sx_agent *a, int up, int err, const char *msg);
void sx__lease_close(sx_agent *a);

/* ------------------------------------------------------------ segments */

/* One remote incarnation and its transport peer, shared by the segments
 * opened on it.  Loop thread. */
typedef struct sx__rpeer {
  struct sx__rpeer *next;
  sx_cdesc *cd;
  sx_transport_kind kind;
  sx_tpeer *tp;
  int refs;
  sx_tpeer *wtp;     /* push: the producer's write connections, or NULL */
  sx_tpeer *ntp;     /* read notices over TCP where kind cannot carry them */
  int fatal;         /* SX_ESTALE, SX_EACCESS: later batches fail at once */
  char fatal_msg[256];
  int refreshing;    /* a cache refresh after a transport failure is out */
} sx__rpeer;

struct sx_segment {
  sx_agent *a;
  sx__rpeer *peer;
  sx_cdesc *cd;      /* the descriptor as opened */
  sx__rindex ix;
  sx_transport_kind kind;
  /* atomic: 1 while open, plus 1 per batch not destroyed yet.  Whoever
   * drops the last frees the segment: a batch can outlive the close (the
   * agent's shutdown closes segments left open while callbacks of their
   * batches have yet to run), and it still reads cd, ix and kind. */
  int refs;
  sx_segment *next, *prev; /* the agent's open segments (loop thread) */
  /* Direct reads (transport.h): the lane of the peer the segment's table
   * reads last went to, set by the loop (submit_run) and read by threads
   * that submit, both under lane_mu; lane_ops is its transport's. */
  pthread_mutex_t lane_mu;
  sx__lane *lane;
  const sx_transport_ops *lane_ops;
};

void sx__segments_close(sx_agent *a);
/* Loop thread: point s's direct reads at lane of transport ops (NULL,
 * NULL: none); takes a reference of lane and drops the old one's. */
void sx__segment_lane(sx_segment *s, const sx_transport_ops *ops, sx__lane *lane);
/* Any thread: drop one reference of s (see refs). */
void sx__segment_put(sx_segment *s);
/* A batch on peer ended with err: learn from it (stale, disconnected). */
void sx__peer_failed(sx_agent *a, sx__rpeer *p, int err, const char *msg);

/* ------------------------------------------------------------ batches */

void sx__batches_abort(sx_agent *a, int status);
/* Loop thread: open the batches' deadline timer and end queue; close them
 * (ends still queued are published now, later ones at once). */
void sx__batches_init(sx_agent *a);
void sx__batches_close(sx_agent *a);
/* Add one range into the agent's scratch memory (see sx__plan_add_run). */
int sx__batch_add_scratch(sx_batch *b, const sx_region *R, uint64_t roff, uint64_t len);
/* Add one scattered range (see sx__plan_add_scatter), noted in a notifying
 * batch's notice as the remote range it reads; TCP batches only. */
int sx__batch_add_scatter(sx_batch *b, const sx_region *R, uint64_t roff,
                          const struct iovec *iov, uint32_t n);

/* ------------------------------------------------------------ stats */

/*
 * The counters behind sx_agent_stats_get().  Written with relaxed atomic
 * adds where they happen (the TCP serving path, batch ends, lease replies,
 * segment open/close), read the same way by the snapshot: cheap on the hot
 * path and never a lock.  Gauges that already live under a->lock (state,
 * generation, store_up) stay in a->status.
 */
typedef struct sx__stats {
  uint64_t publishes;
  uint64_t lease_ok_ms;  /* monotonic ms of the last publish/renew that
                          * worked; 0: never */
  uint64_t lease_errors[SX_STATS_ERRORS];
  uint64_t served_reads[SX_STATS_TRANSPORTS];
  uint64_t served_bytes[SX_STATS_TRANSPORTS];
  uint64_t served_errors[SX_STATS_TRANSPORTS][SX_STATS_ERRORS];
  uint64_t batches[SX_STATS_BATCH_STATES];
  uint64_t batch_errors[SX_STATS_ERRORS];
  uint64_t read_bytes[SX_STATS_TRANSPORTS];
  uint64_t batch_latency[SX_STATS_LATENCY_BUCKETS];
  uint64_t batch_latency_sum_us;
  uint64_t open_segments;
  sx_cache_stats cache_final; /* lock: the cache's counters when it closed */
  uint64_t served_writes[SX_STATS_TRANSPORTS]; /* push, consumer side */
  uint64_t served_write_bytes[SX_STATS_TRANSPORTS];
  uint64_t refused_writes[SX_STATS_TRANSPORTS];
  uint64_t notices;
  uint64_t write_batches[SX_STATS_BATCH_STATES]; /* push, producer side */
  uint64_t written_bytes[SX_STATS_TRANSPORTS];
  uint64_t rdma_gpu_unreachable; /* (device, GPU) pairs staged after their loopback */
  /* Per local RDMA device: its name (written once, by the loop thread,
   * before named is released), work requests and bytes posted. */
  char nic_name[SX_MAX_DEVICES][SX_TAG_MAX + 1];
  uint64_t nic_named[SX_MAX_DEVICES];
  uint64_t nic_wrs[SX_MAX_DEVICES];
  uint64_t nic_bytes[SX_MAX_DEVICES];
} sx__stats;

/* Any thread: one read served (bytes) or refused (err), by transport. */
void sx__stats_served(sx_agent *a, sx_transport_kind kind, uint64_t bytes, int err);
/* Any thread: one write served (bytes; err 0) or refused; a notice taken. */
void sx__stats_written(sx_agent *a, sx_transport_kind kind, uint64_t bytes, int err);
void sx__stats_notice(sx_agent *a);
/* Any thread: an RDMA (device, GPU) pair failed its loopback READ. */
void sx__stats_gpu_unreachable(sx_agent *a);
/* Any thread: RDMA work requests and their bytes posted through local
 * device dev (name). */
void sx__stats_nic(sx_agent *a, int dev, const char *name, uint64_t wrs, uint64_t bytes);
/* Loop thread: a batch (a write batch when write) ended with this result. */
void sx__stats_batch(sx_agent *a, const sx_batch_result *r, int write);
/* Loop thread: the store confirmed the lease (publish or renew). */
void sx__stats_lease_ok(sx_agent *a, int publish);
/* Loop thread: a lease operation failed with err. */
void sx__stats_lease_error(sx_agent *a, int err);
/* Loop thread: a segment was opened (+1) or closed (-1). */
void sx__stats_segment(sx_agent *a, int delta);
/* Loop thread, before the cache closes: keep its final counters. */
void sx__stats_cache_closing(sx_agent *a);

/* ------------------------------------------------------------ the agent */

struct sx_agent {
  sx_agent_params p;      /* strings point into the copies below */
  char name[SX_NAME_MAX + 1];
  char *url, *ns, *listen, *advertise, *rdma_devices;
  sx_label *labels;
  uint8_t incarnation[SX_INCARNATION_LEN];
  uint8_t token[SX_TOKEN_LEN];

  uv_loop_t loop;
  uv_thread_t thread;      /* as created, for the join */
  uv_thread_t loop_tid;    /* as the loop thread sees itself */
  int joining;             /* lock: sx_agent_destroy is joining the loop thread */
  sx__call shutdown;
  sx__wake wake;         /* calls queued (call.c) */
  uv_prepare_t calls_prep; /* call.c: the loop is about to poll... */
  uv_check_t calls_check;  /* ...and polled */
  uv_idle_t calls_idle;    /* keeps that poll from blocking after calls ran */
  int loop_sleepy;         /* atomic: the loop may block in its poll: a
                            * caller queueing a call must wake it */
  int calls_pending;       /* atomic (written under lock): calls is not empty */
  pthread_mutex_t lock;
  pthread_cond_t cond;    /* calls finished, store connected */
  sx__call *calls, **calls_tail; /* lock */
  int stopping;           /* lock: no new calls */

  sx_backend *backend;
  sx_cache *cache;
  int conn_seen;          /* lock: the first on_conn arrived */
  int conn_err;           /* lock: its error */
  char conn_msg[1024];    /* lock */
  int store_down;
  int watch_seen; /* hooks.on_watch calls so far (loop thread) */

  sx_tctx tctx;
  sx_transport *tr[SX__TRANSPORT_SLOTS];

  sx__ltable *lt;         /* lock for readers off the loop thread */
  uint32_t next_region_id;
  struct sx__unreg *unregs; /* waiting for reads to drain */
  uv_timer_t drain_timer;
  uv_timer_t stop_timer;  /* runs the last step of shutdown */

  /* A few registered bytes outside the published table: the destination
   * of pings, which RDMA needs in registered memory. */
  sx__lreg scratch;
  uint8_t scratch_buf[64];
  int scratch_reg[SX__TRANSPORT_SLOTS];

  sx__lease lease;
  sx_agent_status status; /* lock */
  sx__stats stats;        /* atomics, see sx__stats */

  sx__rpeer *peers;
  sx_segment *segments;
  struct sx_batch *running;
  /* batch.c: the running batches' deadlines, and the ended batches whose
   * end is published at the loop's next turn (pub_idle runs then). */
  sx__dl deadlines;
  uv_idle_t pub_idle;
  struct sx_batch *pub_head, **pub_tail;
  int pub_open;           /* pub_idle open: ends wait for it */
  int shutting_down;      /* loop thread: destroy has begun */
  /* batch.c: the batches reading directly (on a lane), any thread. */
  pthread_mutex_t direct_mu;
  struct sx_batch *direct;
  struct sx__push *push;  /* grants and notices (push_int.h) */
};

int sx__on_loop(const sx_agent *a);

/* batch.c: direct reads.  The transports' ctx->lane_failed; end the
 * direct batches left at shutdown (after the transports closed: their
 * lanes' copies have all ended). */
void sx__batches_lane_failed(void *agent, const sx__lane *lane, const uint64_t *done,
                             unsigned n, int err, const char *msg);
void sx__batches_direct_close(sx_agent *a);

/* Defaults for waits that the loop bounds by itself; the cross-thread
 * wait is only a safety net against a wedged loop. */
#define SX__CALL_SLACK_MS 30000u

#endif
