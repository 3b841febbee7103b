/*
 * The Redis backend's shared internals (backend_redis.c, redis_conn.c,
 * redis_sentinel.c, redis_scripts.c).  Not installed.
 *
 * One backend keeps a *session* with the master: a data connection (commands
 * and Lua scripts) and, once watch() was called, a pub/sub connection (the
 * namespace's event channel and keyspace notifications).  Both go up and down
 * together: when either fails, both are dropped, pending commands fail, and
 * the session reconnects after a backoff.  In Sentinel mode the master's
 * address is resolved before each connect, and a separate connection to one
 * sentinel listens for +switch-master.
 */
#ifndef SX_META_REDIS_H
#define SX_META_REDIS_H

#include <hiredis/async.h>
#include <hiredis/hiredis.h>
#include <uv.h>

#include "backend.h"

/* Reconnect backoff: 50 ms doubling to 1 s; each wait is drawn uniformly
 * from [half, all] of the current step ("equal jitter"), so many agents
 * that lost the same server do not reconnect in lock step. */
#define SX_REDIS_BACKOFF_MIN_MS 50u
#define SX_REDIS_BACKOFF_MAX_MS 1000u
/* Fence sets outlive any plausible zombie; refreshed on every addition. */
#define SX_REDIS_FENCE_TTL_MS (24u * 3600u * 1000u)
/* list prunes index entries that expired longer ago than this.  A live
 * segment's score lags its real expiry by less than the index refresh
 * interval (below), so a client clock ahead of the server's by less than
 * this minus that interval never hides live segments.  Entries in the
 * window whose key is gone are skipped. */
#define SX_REDIS_INDEX_GRACE_MS 30000u
/* A renewal rewrites a segment's index entry only every index_refresh_ms
 * (the URL's; at most SX_URL_INDEX_REFRESH_MAX_MS, a quarter of the grace):
 * docs/store.md, "Redis key schema", has the bound on an entry's age. */
_Static_assert(4u * SX_URL_INDEX_REFRESH_MAX_MS <= SX_REDIS_INDEX_GRACE_MS,
               "the index refresh interval must stay well inside the prune grace");
/* Sanity bounds on what the server may send us. */
#define SX_REDIS_MAX_LIST 100000u

enum {
  SX_SCRIPT_PUBLISH,
  SX_SCRIPT_RENEW,
  SX_SCRIPT_UNPUBLISH,
  SX_SCRIPT_REMOVE,
  SX_SCRIPT_COUNT
};
extern const char *const sx__redis_scripts[SX_SCRIPT_COUNT];
extern const char *const sx__redis_script_names[SX_SCRIPT_COUNT];

typedef enum rb_state {
  RB_STARTING,   /* opened; the first connect runs from the loop */
  RB_DOWN,       /* waiting out a backoff (ops fail fast with SX_EUNREACH) */
  RB_RESOLVING,  /* asking the sentinels for the master */
  RB_CONNECTING, /* connecting to the master and running the handshake */
  RB_READY,
  RB_CLOSED,
} rb_state;

typedef struct rreq rreq;
typedef struct sx_rcl sx_rcl;

/* Redis Cluster: its hash slots, and the number of pieces the listing index
 * and the event channel are split into (redis+cluster:// only), each piece
 * a hash tag of its own, "{0}".."{15}", so that they spread over the
 * masters: renewals on every master do not all write one hot key. */
#define SX_RCL_SLOTS 16384
#define SX_RCL_SHARDS 16

typedef struct redis_backend {
  sx_backend base;
  char redacted[600]; /* the URL without its password, for messages */
  char seg_prefix[SX_NS_MAX + 16]; /* "sx:NS:seg:{" */
  char fence_prefix[SX_NS_MAX + 16];
  char index_key[SX_NS_MAX + 16];
  char channel[SX_NS_MAX + 16];
  char ks_pattern[SX_NS_MAX + 48]; /* "__keyspace@DB__:sx:NS:seg:*" */
  size_t ks_prefix_len;            /* length of the pattern without '*' */
  int sentinel;
  int cluster;   /* redis+cluster:// */
  sx_rcl *cl;    /* its client state (redis_cluster.c); NULL otherwise */
  uv_timer_t cl_timer; /* cluster: map refresh delay and deadline */
  /* Until this uv_now() ms every renewal writes its index entry: an index
   * write failed or may have been lost (sx__redis_index_retry). */
  uint64_t ix_force_until;
  /* Cluster: redirections and retries so far (tests and logs read them). */
  uint64_t cl_moved, cl_asked, cl_retried, cl_refreshes;

  rb_state state;
  redisAsyncContext *data; /* commands; NULL when down */
  redisAsyncContext *sub;  /* pub/sub; NULL unless watching and up */
  int hs_left;             /* handshake replies still expected on data */
  int sub_left;            /* subscription confirmations still expected */
  char script_sha[SX_SCRIPT_COUNT][41];
  char host[256]; /* the master in use */
  int port;
  uv_timer_t conn_timer; /* connect deadline, or the backoff wait */
  uv_timer_t op_timer;   /* the oldest pending op's deadline */
  uint32_t backoff_ms;
  int watching;
  char last_err[720];    /* why the session last failed, for fail-fast ops */
  int reported_down;     /* on_conn(0) told since the last on_conn(1) */
  int up_once;

  /* Ops in issue order: queued while connecting, or sent. */
  rreq *head, *tail;

  /* Sentinel: resolution and the +switch-master listener. */
  redisAsyncContext *sres;   /* the sentinel being asked */
  int sres_next;             /* next sentinel to ask */
  int sres_tried;
  char sres_err[320];        /* last resolution failure, for the message */
  char sres_auth_err[320];   /* this round's last AUTH/permission refusal */
  redisAsyncContext *swatch; /* SUBSCRIBE +switch-master */
  uv_timer_t swatch_timer;   /* its connect deadline or retry wait */
  int swatch_next;

  int handles; /* uv handles not yet closed */
} redis_backend;

/* redis_conn.c ------------------------------------------------------------ */

/*
 * Start a non-blocking connect to host:port on loop and attach it to the
 * loop with segxfer's own libuv glue (see redis_conn.c for why not the stock
 * adapter).  data goes to ac->data.  Returns the context, or NULL with a
 * message in err (the connect failed at once, e.g. ECONNREFUSED on loopback).
 */
redisAsyncContext *sx__redis_connect(uv_loop_t *loop, const char *host, int port,
                                     void *data, redisConnectCallback *on_connect,
                                     redisDisconnectCallback *on_disconnect, char *err,
                                     size_t errsize);

/* The next backoff wait for a step (with jitter), and the step after it. */
uint32_t sx__redis_backoff(uint32_t *step_ms);

/* A short printable rendering of a reply for messages ("error 'ERR ...'",
 * "integer 3", "nil", "array of 2"). */
void sx__redis_describe(const redisReply *r, char *buf, size_t size);

/* Copy src into dst, replacing every occurrence of secret (if non-empty)
 * with "***" and non-printable bytes with '?'. */
void sx__redis_scrub(char *dst, size_t size, const char *src, size_t len,
                     const char *secret);

/* True when r is an error reply starting with prefix (e.g. "NOSCRIPT"). */
int sx__redis_is_error(const redisReply *r, const char *prefix);

/* Element i of an array reply if it is a string of at most max bytes,
 * else NULL. */
const char *sx__redis_elem_str(const redisReply *r, size_t i, size_t max);

/* The SX_E* code for an error reply: WRONGTYPE -> SX_EDECODE (not our
 * value), NOAUTH/WRONGPASS/NOPERM -> SX_EAUTH, READONLY/MASTERDOWN/LOADING/
 * TRYAGAIN/BUSY -> SX_EUNREACH, anything else SX_ESTORE. */
int sx__redis_map_error(const redisReply *r);
/* An error reply to a read of a segment: its SX_E* code (as above) and a
 * message saying what it means for the reader ("the store refused the read:
 * ..." for a missing permission, "the stored value is not a segment" for a
 * key of another type), with the server's own text. */
int sx__redis_read_error(const redisReply *r, char *msg, size_t size);

/* redis_reply.c ------------------------------------------------------------ */

/* Decimal integers as the scripts answer them (the whole string): 0 or -1. */
int sx__redis_parse_u64(const char *s, uint64_t *out);
int sx__redis_parse_i64(const char *s, int64_t *out);

/*
 * One segment's value from an HMGET d lease reply (h) and a PTTL reply
 * (ttl; a nil reply when unknown).  Returns 0 with *value (malloc'ed, or
 * NULL when the key is gone), *ttl_ms and *lease (-1 when unknown), or an
 * error code with msg filled (wrong type, oversized).
 */
int sx__redis_read_value(const redisReply *h, const redisReply *ttl, uint8_t **value,
                         size_t *len, int64_t *ttl_ms, int64_t *lease, char *msg,
                         size_t msize);

/* The publish script's HELD answer {"HELD", inc_hex, age_ms, ttl_ms}: the
 * holder (0) or -1 when its incarnation is unreadable; age and ttl are
 * filled either way (0 and -1 when unreadable). */
int sx__redis_parse_held(const redisReply *r, uint8_t holder[SX_INCARNATION_LEN],
                         uint64_t *age_ms, int64_t *ttl_ms);

/* A keyspace notification on "<prefix>{NAME}" (pre bytes of prefix) saying
 * "expired" or "evicted": 0 with the validated name, else -1. */
int sx__redis_expiry_name(const char *prefix, size_t pre, const redisReply *chan,
                          const redisReply *what, char name[SX_NAME_MAX + 1]);

/* redis_sentinel.c -------------------------------------------------------- */

/* Ask the sentinels for the master; on success sets rb->host/port and calls
 * sx__redis_master_resolved(rb), on failure sx__redis_session_fail(). */
void sx__redis_resolve(redis_backend *rb);
/* Keep a subscription to +switch-master on one sentinel (sentinel mode). */
void sx__redis_swatch_start(redis_backend *rb);
void sx__redis_sentinel_close(redis_backend *rb);
/* The sentinel being asked did not answer within connect_timeout_ms. */
void sx__redis_sres_timeout(redis_backend *rb);

/* redis_slots.c ----------------------------------------------------------- */

uint16_t sx__rcl_crc16(const char *buf, size_t len);
/* The hash slot of a key (its hash tag's, if it has one). */
unsigned sx__rcl_key_slot(const char *key, size_t len);
/* A MOVED or ASK error: 0 with *ask, the slot and the node's address, or -1
 * for any other reply (and for a malformed one). */
int sx__rcl_parse_redirect(const redisReply *r, int *ask, unsigned *slot, char *host,
                           size_t hsize, int *port);
/* One slot range of the map and its master (host "" when the node that
 * answered did not know its own address: it is that node). */
typedef struct sx_rcl_range {
  unsigned first, last;
  char host[256];
  int port;
} sx_rcl_range;
/* A CLUSTER SLOTS reply into at most max ranges: 0, or -1 with msg. */
int sx__rcl_parse_slots(const redisReply *r, sx_rcl_range *out, size_t max, size_t *n,
                        char *msg, size_t msize);
/* The same from a CLUSTER SHARDS reply (Redis >= 7.0): each shard's slot
 * ranges with its master (role master, health not fail; its endpoint, else
 * its ip).  A shard without such a master leaves its slots uncovered. */
int sx__rcl_parse_shards(const redisReply *r, sx_rcl_range *out, size_t max, size_t *n,
                         char *msg, size_t msize);
/* How many slots no range covers (0: all), with the first gap in msg. */
int sx__rcl_uncovered(const sx_rcl_range *ranges, size_t n, char *msg, size_t msize);

/* redis_cluster.c ---------------------------------------------------------- */

/* Discover the map from the seeds and connect to every master; the session
 * is ready (sx__redis_ready) once all answered their handshake. */
void sx__rcl_start(redis_backend *rb);
/* Drop every node connection (session failure or close). */
void sx__rcl_drop(redis_backend *rb);
/* Free the client state, once dropped and once no hiredis context can call
 * back into it: a context freed from inside its own callback is freed by
 * hiredis after that callback returns, and its disconnect callback then
 * reads the node it belongs to (so close frees this with rb, later). */
void sx__rcl_free(redis_backend *rb);
/* Send one RESP command of q to the master of key's slot (retrying on
 * MOVED, ASK, TRYAGAIN, CLUSTERDOWN and lost nodes until q's deadline);
 * replies reach q->on_reply in the order the commands were sent.  write: the
 * command changes data or announces, so it is not resent once it may have
 * reached a node that was then lost. */
int sx__rcl_send(rreq *q, const char *buf, size_t len, const char *key, size_t klen,
                 int write);
/* Subscribe to the shard channels and every master's keyspace events. */
void sx__rcl_watch(redis_backend *rb);
/* The map may be stale (an op timed out): look again soon. */
void sx__rcl_suspect(redis_backend *rb);
/* The index piece and the event channel of a segment name's shard. */
unsigned sx__rcl_shard_of(const char *name);
void sx__rcl_index_key(const redis_backend *rb, unsigned shard, char *dst, size_t size);
void sx__rcl_channel(const redis_backend *rb, unsigned shard, char *dst, size_t size);

/* redis_req.c (requests) --------------------------------------------------- */

typedef int (*sx__redis_start_fn)(rreq *q);
typedef void (*sx__redis_reply_fn)(rreq *q, redisReply *r);

/* One store op: its commands, the replies it waits for, its result. */
typedef int (*sx__redis_start_fn)(rreq *q);
typedef void (*sx__redis_reply_fn)(rreq *q, redisReply *r);

struct rreq {
  rreq *next, *prev;
  redis_backend *rb;
  sx_backend_cb cb;
  void *arg;
  const char *what;
  uint64_t deadline; /* uv_now() ms */
  int linked, done, started;
  int outstanding; /* hiredis callbacks still to come */
  int fail_rc;     /* a send failed half-way: fail at the next reply */
  sx__redis_start_fn start;
  sx__redis_reply_fn on_reply;
  int step, got;

  int script, eval;
  char name[SX_NAME_MAX + 1];
  char inc_hex[2 * SX_INCARNATION_LEN + 1];
  char gen[24];
  char lease[16];
  int takeover;
  uint8_t *value;
  size_t len;
  uint8_t *put_ev, *del_ev;
  size_t put_ev_len, del_ev_len;
  uint64_t server_now;
  int ix_sent; /* an index ZADD was sent and has not answered success yet */

  /* Results. */
  sx_backend_reply rep;
  uint8_t *got_value;
  int64_t got_lease;
  char **names;
  uint8_t **values;
  sx_backend_item *items;
  size_t n_names;

  /* Cluster: commands sent and replies handed on so far, and replies that
   * came back ahead of an earlier command's (from another node), by the
   * number of their command. */
  uint32_t cl_sent, cl_next;
  redisReply **cl_stash;
  size_t cl_cap;
};

/* A new op on name (may be NULL); start sends its commands, on_reply takes
 * each reply.  NULL when out of memory. */
rreq *sx__redis_q_new(redis_backend *rb, const char *name, sx_backend_cb cb, void *arg,
                      const char *what, sx__redis_start_fn start, sx__redis_reply_fn on_reply);
/* Send it now, or queue it for the session being set up; fails it at once
 * when the store is down.  0, or an error and the op was not taken. */
int sx__redis_q_issue(rreq *q);
/* One command in RESP (argc words); 0 or an error. */
int sx__redis_q_send(rreq *q, int argc, const char **argv, const size_t *lens);
/* Deliver the op's result (status, message) and release it. */
void sx__redis_q_finish(rreq *q, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void sx__redis_q_free(rreq *q);
/* Free a finished op once no reply is outstanding. */
void sx__redis_q_release(rreq *q);
/* prefix + name + "}" into dst (sized for the longest prefix and name). */
#define SX_REDIS_KEY_MAX (SX_NAME_MAX + SX_NS_MAX + 24)
void sx__redis_key(char *dst, const char *prefix, const char *name, size_t nlen);
/* The op's segment key (its name's hash), into dst[SX_REDIS_KEY_MAX]; built
 * when a command is sent rather than kept in every op, which keeps an op
 * small enough for malloc's fast per-thread cache (a cold resolve's op
 * allocation was a tenth of its instructions). */
const char *sx__redis_seg_key(const rreq *q, char *dst);


/* backend_redis.c: an index write failed or may have been lost (an error
 * reply, an op that ended before its answer, a reconnect): for the next
 * refresh interval every renewal writes its entry, so each segment's next
 * renewal repairs it instead of the one an interval later. */
void sx__redis_index_retry(redis_backend *rb);

/* Send the ops that waited for the session, oldest first. */
void sx__redis_flush_queued(redis_backend *rb);
/* Fail every pending op with status and msg (their callbacks run here). */
void sx__redis_fail_all(redis_backend *rb, int status, const char *msg);

/* redis_session.c ---------------------------------------------------------- */

int sx__redis_open(uv_loop_t *loop, const sx_url *url, const sx_backend_hooks *hooks,
                   sx_backend **out);
void sx__redis_close(sx_backend *b);
int sx__redis_watch(sx_backend *b);
/* The data or pub/sub context ac died under a callback (hiredis is freeing
 * it): forget it and fail the session. */
void sx__redis_lost(redis_backend *rb, redisAsyncContext *ac);
void sx__redis_master_resolved(redis_backend *rb);
/* (Re)start the timer behind connect deadlines and backoff waits. */
void sx__redis_arm_conn_timer(redis_backend *rb, uint64_t ms);
/* Drop the session: fail pending ops with err (SX_EUNREACH when the
 * connection died, SX_ETIMEDOUT...), tell on_conn, schedule a reconnect. */
void sx__redis_session_fail(redis_backend *rb, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Close a context we own; safe inside its own callbacks. */
void sx__redis_drop(redisAsyncContext **acp);
/* The session is up: send what waited, tell on_conn. */
void sx__redis_ready(redis_backend *rb);
/* AUTH [user] password for the URL's credentials; its argument count. */
int sx__redis_auth_argv(const redis_backend *rb, const char **argv);
/* A refused AUTH: fail the session with SX_EAUTH, saying what to check. */
void sx__redis_auth_fail(redis_backend *rb, const redisReply *r);
/* An event message's payload, or a keyspace notification, to on_event. */
void sx__redis_deliver_event(redis_backend *rb, const redisReply *payload);
void sx__redis_deliver_expiry(redis_backend *rb, const redisReply *chan,
                              const redisReply *what);


#endif
