/*
 * Metadata store backends: one asynchronous ops table, so Redis, etcd and the
 * in-process test store are interchangeable.  Not installed.
 *
 * Threading: a backend lives on one libuv loop; every call below and every
 * callback happens on that loop's thread.  An op that returns 0 calls its
 * callback exactly once (with SX_ECANCELED if the backend is closed first);
 * an op that returns < 0 never calls it (libuv's rule).
 *
 * Values are opaque bytes (encoded descriptors); decoding and validation are
 * the caller's (cache.c, store.c), so every backend gets the same checks.
 */
#ifndef SX_META_BACKEND_H
#define SX_META_BACKEND_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "segxfer/descriptor.h"
#include "url.h"

typedef struct sx_backend sx_backend;

typedef struct sx_backend_hooks {
  /* A segment changed: from the event channel, an expiry notification or a
   * watch.  May be called for changes this backend made itself. */
  void (*on_event)(void *arg, const sx_event *ev);
  /* The connection came up (up=1: first connect, or back after an outage; an
   * agent then renews at once, which republishes if the store lost its
   * data) or went down (up=0, err says why).  A down is reported once per
   * outage (the first failed attempt after open counts), not for every
   * failed reconnect.  While watching, "up" includes the event
   * subscription, so events may have been missed before an up=1. */
  void (*on_conn)(void *arg, int up, int err, const char *msg);
  /* After watch(): the watch is in place, and every change made from now
   * on is delivered (until the next on_conn(down)).  Reported once the
   * subscription is established, and again after each reconnect.  Redis
   * subscribes asynchronously and cannot replay, so a change made between
   * watch() and this hook may go unseen; etcd resumes from the newest
   * revision seen before watch() and misses nothing.  Tests and tools that
   * must see a change wait for this before making it.  May be NULL. */
  void (*on_watch)(void *arg);
  void *arg;
} sx_backend_hooks;

typedef struct sx_publish_req {
  const char *name;
  const uint8_t *incarnation; /* SX_INCARNATION_LEN bytes */
  uint64_t generation;        /* must grow for the same incarnation */
  const uint8_t *value;       /* encoded descriptor */
  size_t len;
  uint32_t lease_ms;
  int takeover;               /* replace a live holder of another incarnation */
} sx_publish_req;

typedef struct sx_backend_item {
  const char *name;
  const uint8_t *value; /* NULL if the segment vanished while listing, or
                         * when status != 0 */
  size_t len;
  int64_t ttl_ms;       /* lease left, -1 if unknown */
  /* 0, or why this one entry is unusable while the listing goes on: e.g.
   * SX_EDECODE when the key holds something that is not a segment,
   * SX_ELIMIT when the value is oversized. */
  int status;
} sx_backend_item;

typedef struct sx_backend_reply {
  int status;         /* 0 or SX_E* */
  char message[256];  /* context for a failure; never holds a password */
  /* get: the value and its lease left (-1 unknown). */
  const uint8_t *value;
  size_t len;
  int64_t ttl_ms;
  /* publish failing with SX_EHELD: who holds the name. */
  uint8_t holder[SX_INCARNATION_LEN];
  /* Since the holder last published or renewed.  Also filled by a
   * successful get (0 when the backend cannot tell). */
  uint64_t holder_age_ms;
  int64_t holder_ttl_ms;  /* its lease left */
  /* list: */
  const sx_backend_item *items;
  size_t n_items;
} sx_backend_reply;

/* The reply and everything it points to are valid only during the callback. */
typedef void (*sx_backend_cb)(void *arg, const sx_backend_reply *rep);

typedef struct sx_backend_ops {
  const char *scheme;
  int (*open)(uv_loop_t *loop, const sx_url *url, const sx_backend_hooks *hooks,
              sx_backend **out);
  /* Fail pending ops with SX_ECANCELED, close handles; memory is freed once
   * the loop has run the close callbacks. */
  void (*close)(sx_backend *b);
  /*
   * Claim or update a name atomically: 0; SX_EHELD (another live incarnation
   * holds it, reply names it); SX_EFENCED (this incarnation was taken over or
   * removed by an admin); SX_EGENERATION (generation did not grow).
   */
  int (*publish)(sx_backend *b, const sx_publish_req *req, sx_backend_cb cb, void *arg);
  /* Extend the lease: 0; SX_EGONE (expired or store lost it: republish);
   * SX_EFENCED (someone else holds it, or this incarnation was fenced). */
  int (*renew)(sx_backend *b, const char *name, const uint8_t *incarnation,
               uint32_t lease_ms, sx_backend_cb cb, void *arg);
  /* Delete one's own segment: 0, SX_EGONE, SX_EFENCED. */
  int (*unpublish)(sx_backend *b, const char *name, const uint8_t *incarnation,
                   sx_backend_cb cb, void *arg);
  /* Read one value: 0 or SX_ENOENT. */
  int (*get)(sx_backend *b, const char *name, sx_backend_cb cb, void *arg);
  /* The same without the lease facts (the reply's ttl_ms is -1 and
   * holder_age_ms 0): what a resolver cache needs, and cheaper where the
   * store keeps those facts apart (Redis: one HMGET instead of HMGET and
   * PTTL).  Optional: sx__backend_fetch() falls back to get. */
  int (*fetch)(sx_backend *b, const char *name, sx_backend_cb cb, void *arg);
  /* All live segments of the namespace, without scanning the keyspace. */
  int (*list)(sx_backend *b, sx_backend_cb cb, void *arg);
  /* Admin removal: delete whoever holds it and fence that incarnation, so
   * a zombie cannot renew it back: 0 or SX_ENOENT. */
  int (*remove)(sx_backend *b, const char *name, sx_backend_cb cb, void *arg);
  /* Start delivering events to hooks.on_event (idempotent); hooks.on_watch
   * says when the watch is in place. */
  int (*watch)(sx_backend *b);
} sx_backend_ops;

/* Every backend's struct starts with this. */
struct sx_backend {
  const sx_backend_ops *ops;
  uv_loop_t *loop;
  sx_url url;
  sx_backend_hooks hooks;
};

/* Parse the URL and open the backend its scheme names.  SX_EURL, SX_ENOTSUP
 * (scheme known but not built), or the backend's error. */
int sx__backend_open(uv_loop_t *loop, const char *url, const sx_backend_hooks *hooks,
                     sx_backend **out);

extern const sx_backend_ops sx__backend_mem_ops;
/* Tests: with on, every mem:// backend on store `name` answers its ops from
 * a timer callback ms after the op was called (0: at the next loop turn). */
void sx__mem_set_delay(const char *name, int on, uint32_t ms);
/* Tests: every watching mem:// backend on store `name` reports on_watch
 * again, as a Redis Cluster backend does after a slot move or failover
 * (events may have been missed). */
void sx__mem_rewatch(const char *name);
extern const sx_backend_ops sx__backend_redis_ops; /* redis://, redis+sentinel://,
                                                    * redis+cluster:// */
extern const sx_backend_ops sx__backend_etcd_ops; /* etcd://, etcd+https:// */

/* Dispatchers: a missing slot returns SX_ENOTSUP. */
#define SX__BACKEND_CALL(b, op, ...)                                           \
  ((b)->ops->op ? (b)->ops->op((b), __VA_ARGS__) : SX_ENOTSUP)

static inline void sx__backend_close(sx_backend *b) {
  if (b != NULL)
    b->ops->close(b);
}
static inline int sx__backend_watch(sx_backend *b) {
  return b->ops->watch ? b->ops->watch(b) : SX_ENOTSUP;
}
#define sx__backend_publish(b, req, cb, arg) SX__BACKEND_CALL(b, publish, req, cb, arg)
#define sx__backend_renew(b, name, inc, lease, cb, arg)                        \
  SX__BACKEND_CALL(b, renew, name, inc, lease, cb, arg)
#define sx__backend_unpublish(b, name, inc, cb, arg)                           \
  SX__BACKEND_CALL(b, unpublish, name, inc, cb, arg)
#define sx__backend_get(b, name, cb, arg) SX__BACKEND_CALL(b, get, name, cb, arg)
/* fetch is an optimisation of get, so a backend without it serves get. */
static inline int sx__backend_fetch(sx_backend *b, const char *name, sx_backend_cb cb,
                                    void *arg) {
  return b->ops->fetch ? b->ops->fetch(b, name, cb, arg)
                       : SX__BACKEND_CALL(b, get, name, cb, arg);
}
#define sx__backend_list(b, cb, arg) SX__BACKEND_CALL(b, list, cb, arg)
#define sx__backend_remove(b, name, cb, arg) SX__BACKEND_CALL(b, remove, name, cb, arg)

/* Fill a reply's status and message (printf-style). */
void sx__reply_fail(sx_backend_reply *rep, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
