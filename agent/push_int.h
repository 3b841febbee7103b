/*
 * Push mode inside the agent: write grants and producer authorization
 * (grant.c), the notice queue (notice.c) and write batches (push_batch.c).
 * Not installed.  docs/push.md is the reference.
 *
 * Threading: grants and authorizations live on the loop thread; the notice
 * queue is shared with API callers under its own mutex.
 */
#ifndef SX_AGENT_PUSH_INT_H
#define SX_AGENT_PUSH_INT_H

#include <pthread.h>
#include <stdint.h>

#include "segxfer/push.h"
#include "transport/transport.h"

typedef struct sx_agent sx_agent;
typedef struct sx__grant sx__grant;
typedef struct sx__nq sx__nq;

/* Incarnation -> name, learnt from the store for RDMA producers (their
 * connect request has no room for a name). */
#define SX__PUSH_NAMES 64

typedef struct sx__push {
  /* Loop thread. */
  sx__grant *grants;
  uint64_t epoch;          /* bumped on every revoke */
  struct {
    uint8_t inc[SX_INCARNATION_LEN];
    char name[SX_NAME_MAX + 1];
  } names[SX__PUSH_NAMES];
  uint32_t next_name;
  /* Revokes waiting until no write of a revoked producer can land (the
   * transports in revoke_pending, by kind, said 1 to grants_changed). */
  struct grant_call *revoke_waits;
  uint32_t revoke_pending;
  int revoke_err;
  char revoke_msg[256];
  /* The notice queue. */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  sx__nq *head, **tail;    /* mu */
  uint32_t count;          /* mu: notices queued, of both kinds */
  uint32_t reads;          /* mu: of those, read notices (SX_NOTICE_READ_QUEUE_MAX) */
  int efd;                 /* mu: -1 until sx_agent_notice_fd() */
  int closed;              /* mu: the agent is shutting down */
  uint32_t waiters;        /* mu: callers inside sx_agent_notice_next() */
  sx_notice_cb cb;         /* mu */
  void *cb_arg;            /* mu */
  int cb_running;          /* mu: the loop is inside cb (with cb_arg) */
} sx__push;

/* agent.c: create with the agent, close at shutdown (wakes waiters with
 * SX_ESHUTDOWN and drops the grants), free with it.  NULL-safe. */
int sx__push_init(sx_agent *a);
void sx__push_close(sx_agent *a);
void sx__push_free(sx_agent *a);

/* The sx_tctx callbacks (grant.c, notice.c). */
int sx__push_write_auth(void *agent, const char *producer, const uint8_t *incarnation,
                        const uint8_t *token, sx_wauth_cb cb, void *arg, sx_wauth **out);
void sx__push_write_auth_cancel(sx_wauth *w);
int sx__push_write_granted(void *agent, const char *producer, const uint8_t *incarnation);
void sx__push_grants_settled(void *agent, sx_transport_kind kind, int status, const char *msg);
int sx__push_notice_in(void *agent, const char *producer, const uint8_t *incarnation,
                       sx_transport_kind kind, const uint8_t *buf, size_t len, char *msg,
                       size_t cap);
void sx__push_written(void *agent, sx_transport_kind kind, uint64_t bytes, int err);
int sx__read_notice_in(void *agent, const char *reader, sx_transport_kind kind,
                       const uint8_t *buf, size_t len, char *msg, size_t cap);

/* grant.c: drop every grant (shutdown). */
void sx__push_grants_free(sx_agent *a);

/* Write batches (push_batch.c, called by batch.c).  A write batch's notice
 * entries, kept as they are added. */
typedef struct sx__pbatch sx__pbatch;
sx__pbatch *sx__pbatch_new(void);
void sx__pbatch_free(sx__pbatch *pb);
/* Loop thread: every write of bytes landed (kind SX_NOTICE_WRITE), or
 * every byte a notifying read batch asked for arrived (SX_NOTICE_READ);
 * send the notice (this agent as producer or reader, tag) on tp.  0:
 * op->noticed will run; < 0: the batch fails with it (sx_errmsg()). */
int sx__pbatch_notify(sx__pbatch *pb, sx_agent *a, sx_notice_kind kind, uint64_t tag,
                      uint64_t bytes, sx_tpeer *tp, sx_op *op);
/* Read entries of a notifying read batch (SX_BATCH_NOTIFY): noted in pb in
 * the target's terms, then planned; all or nothing (push_batch.c). */
int sx__pbatch_add_reads(sx__pbatch *pb, struct sx__plan *plan, int blocks, const void *r,
                         size_t n, const char *what);
/* One scattered range of a notifying read batch: its remote bytes noted in
 * pb, then planned (sx__plan_add_scatter); all or nothing (push_batch.c). */
int sx__pbatch_add_scatter(sx__pbatch *pb, struct sx__plan *plan, const sx_region *R,
                           uint64_t roff, const struct iovec *iov, uint32_t n);
/* A run of one-range entries of a notifying set read (sx__plan_add_run):
 * their remote bytes noted in pb, then planned.  On failure the notes are
 * undone, but ranges before the failing one may stay planned: the set
 * read discards the batch. */
int sx__pbatch_add_run(sx__pbatch *pb, struct sx__plan *plan, const sx_region *R,
                       const sx_lregion *L, const uint64_t *roff, const uint64_t *local,
                       const uint64_t *len, uint32_t n);
/* One strided entry of a notifying set read (sx__plan_add_strided): its
 * pieces' remote bytes noted in pb, then planned; all or nothing. */
int sx__pbatch_add_strided(sx__pbatch *pb, struct sx__plan *plan, const sx_region *R,
                           const sx_lregion *L, uint64_t roff, uint64_t rstride,
                           uint64_t local, uint64_t lstride, uint64_t len, uint32_t count);
/* batch.c: the plan and notice list of batch b (a write batch's, or a
 * notifying read batch's read notice; NULL for other reads) if it takes
 * entries of this direction now (state NEW), else the error. */
struct sx__plan;
int sx__batch_entries(sx_batch *b, int write, const char *what, struct sx__plan **plan,
                      sx__pbatch **pb);
/* batch.c: whether b is a write batch (SX_BATCH_WRITE); fixed at creation. */
int sx__batch_is_write(const sx_batch *b);

#endif
