/*
 * The Redis backend's requests: one rreq per store op, its commands written
 * in RESP, its replies, its deadline, and the queue of ops waiting for the
 * session (see redis.h for the picture).  The ops themselves are in
 * backend_redis.c.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "redis.h"

/* ------------------------------------------------------------------ ops */

void sx__redis_q_free(rreq *q) {
  free(q->value);
  free(q->put_ev);
  free(q->del_ev);
  free(q->got_value);
  for (size_t i = 0; i < q->n_names; i++) {
    free(q->names[i]);
    if (q->values)
      free(q->values[i]);
  }
  free(q->names);
  free(q->values);
  free(q->items);
  for (size_t i = 0; i < q->cl_cap; i++)
    if (q->cl_stash[i] != NULL)
      freeReplyObject(q->cl_stash[i]);
  free(q->cl_stash);
  free(q);
}

static void q_release(rreq *q) {
  if (q->done && q->outstanding == 0)
    sx__redis_q_free(q);
}

void sx__redis_q_release(rreq *q) { q_release(q); }

static void q_unlink(rreq *q) {
  redis_backend *rb = q->rb;
  if (!q->linked)
    return;
  if (q->prev)
    q->prev->next = q->next;
  else
    rb->head = q->next;
  if (q->next)
    q->next->prev = q->prev;
  else
    rb->tail = q->prev;
  q->next = q->prev = NULL;
  q->linked = 0;
}

static void op_timer_cb(uv_timer_t *t);

/*
 * The op timer fires at the oldest pending op's deadline, or earlier.  Ops
 * queue in issue order with one timeout, so deadlines only grow along the
 * queue; a timer set for an op that has finished since fires early, and
 * op_timer_cb sets it again for the new head.  So an op arms the timer only
 * when it is idle, and finishing one stops it only when none is left: two
 * timer updates less per request (callgrind: about 450 instructions of a
 * cold resolve's 5.7k).
 */
static void arm_op_timer(redis_backend *rb) {
  if (rb->state == RB_CLOSED)
    return;
  if (rb->head == NULL) {
    uv_timer_stop(&rb->op_timer);
    return;
  }
  uint64_t now = uv_now(rb->base.loop);
  uint64_t d = rb->head->deadline;
  uv_timer_start(&rb->op_timer, op_timer_cb, d > now ? d - now : 0, 0);
}

/* Complete an op: its callback runs here, once.  Does not free it. */
static void q_vfinish(rreq *q, int status, const char *fmt, va_list ap) {
  if (q->done)
    return;
  q->done = 1;
  q_unlink(q);
  /* The op ends before its index write answered (timeout, lost
   * connection or node, closing): the entry may be missing. */
  if (q->ix_sent)
    sx__redis_index_retry(q->rb);
  q->rep.status = status;
  /* fmt NULL keeps a message already written into rep. */
  if (status != 0 && fmt != NULL)
    vsnprintf(q->rep.message, sizeof(q->rep.message), fmt, ap);
  else if (status == 0)
    q->rep.message[0] = '\0';
  /* The callback may close the backend, which drops the connections and
   * so releases the ops whose replies are outstanding, this one too: hold
   * it until the caller releases it.  rb itself lives until the loop has
   * run its close callbacks. */
  redis_backend *rb = q->rb;
  q->outstanding++;
  q->cb(q->arg, &q->rep);
  q->outstanding--;
  if (rb->head == NULL)
    uv_timer_stop(&rb->op_timer);
}

void sx__redis_q_finish(rreq *q, int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  q_vfinish(q, status, fmt, ap);
  va_end(ap);
}

/* Fail every pending op (the list may change under the callbacks). */
void sx__redis_fail_all(redis_backend *rb, int status, const char *msg) {
  rreq *q;
  while ((q = rb->head) != NULL) {
    sx__redis_q_finish(q, status, "%s", msg);
    q_release(q);
  }
}


static void q_cb(redisAsyncContext *ac, void *reply, void *priv);

/* Append a RESP header, "*<n>\r\n" or "$<n>\r\n", at p; returns its end. */
static char *resp_head(char *p, char kind, size_t n) {
  char digits[24];
  int nd = 0;
  do {
    digits[nd++] = (char)('0' + n % 10);
    n /= 10;
  } while (n);
  *p++ = kind;
  while (nd)
    *p++ = digits[--nd];
  *p++ = '\r';
  *p++ = '\n';
  return p;
}

/*
 * Send one command.  The request is written in Redis' wire format (RESP)
 * here and handed to hiredis as is: its own formatter (sdscatfmt, one
 * reallocation per argument) was a third of the client's work per cold
 * resolve (callgrind), more than the rest of the backend's.
 */
int sx__redis_q_send(rreq *q, int argc, const char **argv, const size_t *lens) {
  redis_backend *rb = q->rb;
  if (rb->state != RB_READY || (rb->data == NULL && !rb->cluster))
    return sx__err(SX_EUNREACH, "%s: connection lost", rb->redacted);
  size_t al[16], total = 16;
  if (argc > 16)
    return sx__err(SX_EINVAL, "%s: %s: too many arguments", q->name, q->what);
  for (int i = 0; i < argc; i++) {
    al[i] = lens ? lens[i] : strlen(argv[i]);
    total += al[i] + 32;
  }
  char stack[1024], *buf = total <= sizeof(stack) ? stack : malloc(total);
  if (buf == NULL)
    return sx__err(SX_ENOMEM, "%s: %s", q->name, q->what);
  char *p = resp_head(buf, '*', (size_t)argc);
  for (int i = 0; i < argc; i++) {
    p = resp_head(p, '$', al[i]);
    memcpy(p, argv[i], al[i]);
    p += al[i];
    *p++ = '\r';
    *p++ = '\n';
  }
  int rc;
  if (rb->cluster) {
    /* The key decides the node: a script's first key, else the first
     * argument (every command segxfer sends names one key there). */
    int script = strcmp(argv[0], "EVAL") == 0 || strcmp(argv[0], "EVALSHA") == 0;
    int k = script && argc > 3 ? 3 : 1;
    int write = script || strcmp(argv[0], "SPUBLISH") == 0;
    rc = argc > k ? sx__rcl_send(q, buf, (size_t)(p - buf), argv[k], al[k], write)
                  : sx__err(SX_EINVAL, "%s: %s: a command without a key", q->name, q->what);
    if (buf != stack)
      free(buf);
    return rc;
  }
  rc = redisAsyncFormattedCommand(rb->data, q_cb, q, buf, (size_t)(p - buf));
  if (buf != stack)
    free(buf);
  if (rc != REDIS_OK)
    return sx__err(SX_EUNREACH, "%s: the connection is closing", rb->redacted);
  q->outstanding++;
  return 0;
}

static void q_cb(redisAsyncContext *ac, void *reply, void *priv) {
  rreq *q = priv;
  redis_backend *rb = q->rb;
  redisReply *r = reply;
  /* q stays allocated while outstanding > 0, whatever the code below does. */
  if (!q->done) {
    if (r == NULL) {
      if (ac == rb->data)
        sx__redis_lost(rb, ac);
      else
        sx__redis_q_finish(q, SX_EUNREACH, "%s: %s: connection lost", q->name, q->what);
    } else if (q->fail_rc) {
      sx__redis_q_finish(q, q->fail_rc, "%s: %s: sending failed", q->name, q->what);
    } else if (sx__redis_is_error(r, "READONLY")) {
      /* The master we talk to became a replica: a failover happened.  Ask
       * the sentinels again (redis+sentinel://) or reconnect. */
      sx__redis_q_finish(q, SX_EUNREACH, "%s: %s: %s:%d is read-only now (failover?); reconnecting",
               q->name, q->what, rb->host, rb->port);
      sx__redis_session_fail(rb, SX_EUNREACH, "%s:%d answered READONLY (failover?)",
                             rb->host, rb->port);
    } else {
      q->got++;
      q->on_reply(q, r);
    }
  }
  q->outstanding--;
  q_release(q);
}

void sx__redis_flush_queued(redis_backend *rb) {
  /* Send what waited for the connection, oldest first. */
  for (rreq *q = rb->head; q != NULL && rb->state == RB_READY;) {
    rreq *next = q->next;
    if (!q->started) {
      q->started = 1;
      int rc = q->start(q);
      if (rc != 0 && q->outstanding == 0) {
        sx__redis_q_finish(q, rc, "%s: %s: %s", q->name, q->what, sx_errmsg());
        q_release(q);
      } else if (rc != 0) {
        q->fail_rc = rc;
      }
    }
    q = next;
  }
}

int sx__redis_q_issue(rreq *q) {
  redis_backend *rb = q->rb;
  if (rb->state == RB_CLOSED) {
    sx__redis_q_free(q);
    return sx__err(SX_ECANCELED, "metadata store is closed");
  }
  if (rb->state == RB_DOWN) {
    sx__redis_q_free(q);
    return sx__err(SX_EUNREACH, "%s: not connected (%s); reconnecting in the background",
                   rb->redacted, rb->last_err);
  }
  uv_update_time(rb->base.loop);
  q->deadline = uv_now(rb->base.loop) + rb->base.url.timeout_ms;
  q->prev = rb->tail;
  if (rb->tail)
    rb->tail->next = q;
  else
    rb->head = q;
  rb->tail = q;
  q->linked = 1;
  if (rb->state == RB_READY) {
    q->started = 1;
    int rc = q->start(q);
    if (rc != 0) {
      if (q->outstanding == 0) {
        q_unlink(q);
        sx__redis_q_free(q);
        arm_op_timer(rb);
        return rc;
      }
      q->fail_rc = rc;
    }
  }
  if (!uv_is_active((uv_handle_t *)&rb->op_timer))
    arm_op_timer(rb);
  return 0;
}

static void op_timer_cb(uv_timer_t *t) {
  redis_backend *rb = t->data;
  uint64_t now = uv_now(rb->base.loop);
  rreq *q;
  while ((q = rb->head) != NULL && q->deadline <= now && rb->state != RB_CLOSED) {
    if (!q->started) {
      sx__redis_q_finish(q, SX_ETIMEDOUT, "%s: %s: not connected to %s within %u ms (timeout_ms)",
               q->name, q->what, rb->redacted, rb->base.url.timeout_ms);
      q_release(q);
      continue;
    }
    if (rb->cluster) {
      /* One node of several did not answer, or a slot had no master that
       * long (a failover): fail the op, keep the others, look again. */
      sx__redis_q_finish(q, SX_ETIMEDOUT, "%s: %s: no answer from the cluster %s within "
                         "%u ms (timeout_ms)", q->name, q->what, rb->redacted,
                         rb->base.url.timeout_ms);
      q_release(q);
      sx__rcl_suspect(rb);
      continue;
    }
    sx__redis_q_finish(q, SX_ETIMEDOUT, "%s: %s: no answer from %s:%d within %u ms (timeout_ms)",
             q->name, q->what, rb->host, rb->port, rb->base.url.timeout_ms);
    q_release(q);
    sx__redis_session_fail(rb, SX_ETIMEDOUT,
                           "%s:%d did not answer a command within %u ms; reconnecting",
                           rb->host, rb->port, rb->base.url.timeout_ms);
    return;
  }
  arm_op_timer(rb);
}

void sx__redis_key(char *dst, const char *prefix, const char *name, size_t nlen) {
  size_t plen = strlen(prefix);
  memcpy(dst, prefix, plen);
  memcpy(dst + plen, name, nlen);
  dst[plen + nlen] = '}';
  dst[plen + nlen + 1] = '\0';
}

rreq *sx__redis_q_new(redis_backend *rb, const char *name, sx_backend_cb cb, void *arg,
                   const char *what, sx__redis_start_fn start, sx__redis_reply_fn on_reply) {
  rreq *q = calloc(1, sizeof(*q));
  if (q == NULL)
    return NULL;
  q->rb = rb;
  q->cb = cb;
  q->arg = arg;
  q->what = what;
  q->start = start;
  q->on_reply = on_reply;
  q->rep.ttl_ms = -1;
  q->rep.holder_ttl_ms = -1;
  if (name != NULL) {
    /* Names were validated (at most SX_NAME_MAX bytes): plain copies, no
     * printf, on the path every resolve takes. */
    size_t n = strnlen(name, SX_NAME_MAX);
    memcpy(q->name, name, n);
    q->name[n] = '\0';
  }
  return q;
}

const char *sx__redis_seg_key(const rreq *q, char *dst) {
  sx__redis_key(dst, q->rb->seg_prefix, q->name, strlen(q->name));
  return dst;
}
