/*
 * The notice queue (push mode and read notices, docs/push.md).
 *
 * A transport hands over a write notice only after the producer saw every
 * write of its batch acknowledged, and a read notice only after the reader
 * received every byte of its batch.  Here it is decoded strictly, its
 * identity checked against what the data plane knows, and each entry
 * against this agent's regions (registered, writable for a write notice,
 * readable for a read notice, in bounds), with the byte count recomputed:
 * a notice that does not describe such memory of this agent exactly is
 * refused and the sender's batch fails with the reason.  An accepted
 * notice goes to the callback first, then (unless the callback took it)
 * into a bounded queue that API callers drain, woken by a condition
 * variable or an eventfd that is readable while the queue is not empty.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "agent_int.h"
#include "notice.h"
#include "push_int.h"

struct sx__nq {
  sx__nq *next;
  sx_notice *n;
};

int sx__push_init(sx_agent *a) {
  sx__push *ps = calloc(1, sizeof(*ps));
  if (ps == NULL)
    return sx__err(SX_ENOMEM, "sx_agent_create");
  pthread_mutex_init(&ps->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&ps->cv, &ca);
  pthread_condattr_destroy(&ca);
  ps->tail = &ps->head;
  ps->efd = -1;
  a->push = ps;
  return 0;
}

void sx__push_close(sx_agent *a) {
  sx__push *ps = a->push;
  if (ps == NULL)
    return;
  sx__push_grants_free(a);
  pthread_mutex_lock(&ps->mu);
  ps->closed = 1;
  pthread_cond_broadcast(&ps->cv);
  pthread_mutex_unlock(&ps->mu);
}

void sx__push_free(sx_agent *a) {
  sx__push *ps = a->push;
  if (ps == NULL)
    return;
  /* Callers that sx__push_close() woke may not have left yet (a waiter
   * needs the mutex back after its wait): they hold the queue until then. */
  pthread_mutex_lock(&ps->mu);
  ps->closed = 1;
  pthread_cond_broadcast(&ps->cv);
  while (ps->waiters > 0)
    pthread_cond_wait(&ps->cv, &ps->mu);
  pthread_mutex_unlock(&ps->mu);
  sx__push_grants_free(a);
  while (ps->head != NULL) {
    sx__nq *q = ps->head;
    ps->head = q->next;
    sx_notice_free(q->n);
    free(q);
  }
  ps->count = ps->reads = 0;
  if (ps->efd >= 0)
    close(ps->efd);
  pthread_mutex_destroy(&ps->mu);
  pthread_cond_destroy(&ps->cv);
  free(ps);
  a->push = NULL;
}

void sx__push_written(void *agent, sx_transport_kind kind, uint64_t bytes, int err) {
  sx__stats_written(agent, kind, bytes, err);
}

/* ------------------------------------------------------------ checks */

/* A region of this agent that is still published and allows access (a
 * write notice lists writable memory, a read notice readable memory). */
static int allowed(const sx_region *R, uint32_t access) {
  return R != NULL && (R->access & access) && !((const sx_lregion *)R)->withdrawn;
}

/* Every entry lies in memory of this agent with access; the bytes add up. */
static int check_entries(sx_agent *a, const sx_notice *n, uint32_t access, char *msg,
                         size_t cap) {
  const sx__rindex *ix = &a->lt->ix;
  const char *what = access == SX_ACCESS_REMOTE_WRITE ? "writable" : "readable";
  uint64_t total = 0, bytes;
  for (uint32_t i = 0; i < n->n_blocks; i++) {
    const sx_notice_blocks *e = &n->blocks[i];
    uint64_t end = (uint64_t)e->layer_first + e->layer_count;
    for (uint64_t m = e->slots; m; m &= m - 1) {
      uint32_t slot = (uint32_t)__builtin_ctzll(m);
      for (uint64_t l = e->layer_first; l < end; l++) {
        const sx_region *R = sx__rindex_key(ix, e->group, (uint32_t)l, slot);
        if (!allowed(R, access)) {
          snprintf(msg, cap, "block run %u: no %s region for group %u layer %lu slot %u",
                   i, what, e->group, (unsigned long)l, slot);
          return SX_EDENIED;
        }
        if (e->count > R->num_blocks || e->block > R->num_blocks - e->count) {
          snprintf(msg, cap, "block run %u: blocks %lu..+%lu outside region %u (%lu blocks)", i,
                   (unsigned long)e->block, (unsigned long)e->count, R->id,
                   (unsigned long)R->num_blocks);
          return SX_EBOUNDS;
        }
        if (!sx__mul_ok(e->count, R->block_bytes, &bytes) || !sx__add_ok(total, bytes, &total)) {
          snprintf(msg, cap, "block run %u: the byte count overflows", i);
          return SX_EOVERFLOW;
        }
      }
    }
  }
  for (uint32_t i = 0; i < n->n_ranges; i++) {
    const sx_notice_range *e = &n->ranges[i];
    const sx_region *R = sx__rindex_id(ix, e->region);
    if (!allowed(R, access)) {
      snprintf(msg, cap, "range %u: region %u is not a %s region", i, e->region, what);
      return SX_EDENIED;
    }
    if (e->offset > R->length || e->length > R->length - e->offset) {
      snprintf(msg, cap, "range %u: bytes %lu..+%lu outside region %u (%lu bytes)", i,
               (unsigned long)e->offset, (unsigned long)e->length, R->id,
               (unsigned long)R->length);
      return SX_EBOUNDS;
    }
    if (!sx__add_ok(total, e->length, &total)) {
      snprintf(msg, cap, "range %u: the byte count overflows", i);
      return SX_EOVERFLOW;
    }
  }
  if (total != n->bytes) {
    snprintf(msg, cap, "the notice claims %lu bytes, its entries cover %lu",
             (unsigned long)n->bytes, (unsigned long)total);
    return SX_EPROTO;
  }
  return 0;
}

/* ------------------------------------------------------------ intake */

/* Hand an accepted notice n (taken) to the callback, else to the queue.
 * 0, or SX_ELIMIT / SX_ENOMEM with msg (n freed either way). */
static int deliver(sx_agent *a, sx_notice *n, char *msg, size_t cap) {
  sx__push *ps = a->push;
  pthread_mutex_lock(&ps->mu);
  sx_notice_cb cb = ps->cb;
  void *cb_arg = ps->cb_arg;
  int is_read = n->kind == SX_NOTICE_READ;
  /* Read notices have a share of the queue of their own, so that readers
   * (who need no write grant) cannot fill it against producers. */
  int full = ps->count >= SX_NOTICE_QUEUE_MAX;
  int reads_full = is_read && ps->reads >= SX_NOTICE_READ_QUEUE_MAX;
  ps->cb_running = cb != NULL; /* sx_agent_notice_cb() waits for it */
  pthread_mutex_unlock(&ps->mu);
  int took = cb != NULL && cb(cb_arg, n) != 0;
  if (cb != NULL) {
    pthread_mutex_lock(&ps->mu);
    ps->cb_running = 0;
    pthread_cond_broadcast(&ps->cv);
    pthread_mutex_unlock(&ps->mu);
  }
  if (took) {
    sx_notice_free(n);
    sx__stats_notice(a);
    return 0;
  }
  sx__nq *q = full || reads_full ? NULL : malloc(sizeof(*q));
  if (q == NULL) {
    if (full)
      snprintf(msg, cap, "the notice queue is full (%u notices unread)", SX_NOTICE_QUEUE_MAX);
    else if (reads_full)
      snprintf(msg, cap, "the notice queue's share for read notices is full (%u unread)",
               SX_NOTICE_READ_QUEUE_MAX);
    else
      snprintf(msg, cap, "out of memory");
    sx_notice_free(n);
    return full || reads_full ? SX_ELIMIT : SX_ENOMEM;
  }
  q->n = n;
  q->next = NULL;
  pthread_mutex_lock(&ps->mu);
  *ps->tail = q;
  ps->tail = &q->next;
  ps->count++;
  ps->reads += is_read;
  if (ps->efd >= 0 && ps->count == 1) {
    uint64_t one = 1;
    ssize_t w = write(ps->efd, &one, sizeof(one));
    (void)w; /* an eventfd write of 1 cannot fail short of overflow */
  }
  pthread_cond_broadcast(&ps->cv);
  pthread_mutex_unlock(&ps->mu);
  sx__stats_notice(a);
  return 0;
}

/* Decode len bytes into *out and check that it is of kind; 0 or the
 * refusal with msg. */
static int decode_kind(const uint8_t *buf, size_t len, uint32_t kind, sx_notice **out,
                       char *msg, size_t cap) {
  int rc = sx__notice_decode(buf, len, out);
  if (rc) {
    snprintf(msg, cap, "malformed notice: %s", sx_errmsg());
    return rc;
  }
  if ((*out)->kind != kind) {
    snprintf(msg, cap, "a %s notice where a %s notice belongs",
             (*out)->kind == SX_NOTICE_READ ? "read" : "write",
             kind == SX_NOTICE_READ ? "read" : "write");
    return SX_EPROTO;
  }
  return 0;
}

int sx__push_notice_in(void *agent, const char *producer, const uint8_t *inc,
                       sx_transport_kind kind, const uint8_t *buf, size_t len, char *msg,
                       size_t cap) {
  sx_agent *a = agent;
  sx_notice *n = NULL;
  int rc = decode_kind(buf, len, SX_NOTICE_WRITE, &n, msg, cap);
  if (rc)
    goto out_refuse;
  if (strcmp(n->producer, producer) != 0 ||
      memcmp(n->incarnation, inc, SX_INCARNATION_LEN) != 0) {
    rc = SX_EPROTO;
    snprintf(msg, cap, "the notice names producer %.64s, the connection is %.64s", n->producer,
             producer);
    goto out_refuse;
  }
  if ((rc = sx__push_write_granted(a, producer, inc)) != 0) {
    snprintf(msg, cap, "no write grant covers %.64s (revoked)", producer);
    goto out_refuse;
  }
  if ((rc = check_entries(a, n, SX_ACCESS_REMOTE_WRITE, msg, cap)) != 0)
    goto out_refuse;
  n->transport = kind;
  rc = deliver(a, n, msg, cap);
  n = NULL; /* taken */
  if (rc)
    goto out_refuse;
  return 0;

out_refuse:
  sx__log(a, SX_LOG_WARN, "refused a notice from %.64s: %s", producer, msg);
  sx_notice_free(n);
  return rc;
}

int sx__read_notice_in(void *agent, const char *reader, sx_transport_kind kind,
                       const uint8_t *buf, size_t len, char *msg, size_t cap) {
  sx_agent *a = agent;
  sx_notice *n = NULL;
  int rc = decode_kind(buf, len, SX_NOTICE_READ, &n, msg, cap);
  if (rc)
    goto out_refuse;
  /* The connection presented this agent's incarnation and token (checked
   * before any read); the reader's name is its own statement, which must
   * at least agree with what it said when it connected. */
  if (reader != NULL && strcmp(n->producer, reader) != 0) {
    rc = SX_EPROTO;
    snprintf(msg, cap, "the notice names reader '%.64s', the connection said '%.64s'",
             n->producer, reader);
    goto out_refuse;
  }
  if ((rc = check_entries(a, n, SX_ACCESS_REMOTE_READ, msg, cap)) != 0)
    goto out_refuse;
  n->transport = kind;
  rc = deliver(a, n, msg, cap);
  n = NULL;
  if (rc)
    goto out_refuse;
  return 0;

out_refuse:
  sx__log(a, SX_LOG_WARN, "refused a read notice from %.64s: %s",
          reader != NULL && reader[0] ? reader : "(unnamed reader)", msg);
  sx_notice_free(n);
  return rc;
}

/* ------------------------------------------------------------ API */

int sx_agent_notice_next(sx_agent *a, int timeout_ms, sx_notice **out) {
  if (a == NULL || out == NULL)
    return sx__err(SX_EINVAL, "sx_agent_notice_next: NULL argument");
  if (timeout_ms != 0 && sx__on_loop(a))
    return sx__err(SX_EBUSY, "sx_agent_notice_next cannot wait on the agent's thread");
  sx__push *ps = a->push;
  struct timespec ts;
  if (timeout_ms > 0)
    sx__deadline(&ts, (uint32_t)timeout_ms);
  pthread_mutex_lock(&ps->mu);
  ps->waiters++; /* the agent's destroy frees the queue only after we left */
  while (ps->head == NULL && !ps->closed && timeout_ms != 0) {
    if (timeout_ms < 0)
      pthread_cond_wait(&ps->cv, &ps->mu);
    else if (pthread_cond_timedwait(&ps->cv, &ps->mu, &ts) != 0)
      break;
  }
  if (--ps->waiters == 0 && ps->closed)
    pthread_cond_broadcast(&ps->cv);
  sx__nq *q = ps->head;
  if (q != NULL) {
    ps->head = q->next;
    if (ps->head == NULL)
      ps->tail = &ps->head;
    ps->reads -= q->n->kind == SX_NOTICE_READ;
    if (--ps->count == 0 && ps->efd >= 0) {
      uint64_t v;
      ssize_t r = read(ps->efd, &v, sizeof(v));
      (void)r; /* resets the counter; EAGAIN if it was already 0 */
    }
  }
  int closed = ps->closed;
  pthread_mutex_unlock(&ps->mu);
  if (q == NULL)
    return closed ? sx__err(SX_ESHUTDOWN, "the agent is shutting down")
                  : sx__err(SX_ETIMEDOUT, "no notice within %d ms", timeout_ms);
  *out = q->n;
  free(q);
  return 0;
}

int sx_agent_notice_fd(sx_agent *a) {
  if (a == NULL)
    return sx__err(SX_EINVAL, "sx_agent_notice_fd: NULL agent");
  sx__push *ps = a->push;
  pthread_mutex_lock(&ps->mu);
  if (ps->efd < 0) {
    ps->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (ps->efd >= 0 && ps->count > 0) {
      uint64_t one = 1;
      ssize_t w = write(ps->efd, &one, sizeof(one));
      (void)w;
    }
  }
  int fd = ps->efd;
  pthread_mutex_unlock(&ps->mu);
  return fd >= 0 ? fd : sx__err(SX_EIO, "sx_agent_notice_fd: eventfd failed");
}

int sx_agent_notice_cb(sx_agent *a, sx_notice_cb cb, void *arg) {
  if (a == NULL)
    return sx__err(SX_EINVAL, "sx_agent_notice_cb: NULL agent");
  sx__push *ps = a->push;
  int on_loop = sx__on_loop(a);
  pthread_mutex_lock(&ps->mu);
  ps->cb = cb;
  ps->cb_arg = arg;
  /* The old callback may be running on the agent thread with the old arg:
   * once this returns, the caller may free that arg.  On the agent thread
   * itself (from the callback) nothing runs meanwhile. */
  while (ps->cb_running && !on_loop)
    pthread_cond_wait(&ps->cv, &ps->mu);
  pthread_mutex_unlock(&ps->mu);
  return 0;
}
