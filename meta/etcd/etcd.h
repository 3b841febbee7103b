/*
 * etcd v3 through its JSON gateway (grpc-gateway), for backend_etcd.c.  Not
 * installed.
 *
 * etcd_http.c drives libcurl's multi interface from a libuv loop: every
 * socket curl opens gets a uv_poll_t, curl's timer a uv_timer_t, so nothing
 * here ever blocks the loop.  A request goes to the preferred endpoint of the
 * URL; one that cannot connect moves on to the next (failover), one that
 * connects but does not answer in time fails with SX_ETIMEDOUT and makes the
 * next request start elsewhere.
 *
 * Threading: one loop thread, like the backends.  Every callback below runs
 * from the loop, after libcurl has returned (never from inside a libcurl
 * callback), so it may start, cancel or close anything.
 */
#ifndef SX_META_ETCD_H
#define SX_META_ETCD_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "backend.h"
#include "url.h"

/* The largest answer to one request and the largest message of a stream.
 * Anything bigger fails with SX_ELIMIT instead of growing without bound.
 * A variable so that tests can lower it. */
#define SX_ETCD_ANSWER_MAX (64u << 20)
extern size_t sx__etcd_answer_max;

/* etcd lease TTLs are whole seconds: a lease of lease_ms lasts
 * ceil(lease_ms / 1000) s (never 0).  etcd raises TTLs below its own minimum
 * (1.5 election timeouts, 2 s by default) to that minimum. */
static inline int64_t sx__etcd_ttl_s(uint32_t lease_ms) {
  int64_t s = ((int64_t)lease_ms + 999) / 1000;
  return s > 0 ? s : 1;
}

typedef struct sx__etcd_http sx__etcd_http;
typedef struct sx__etcd_call sx__etcd_call;

/*
 * A finished request: status 0 with the JSON object etcd answered (a
 * stream's "result" wrapper already removed; borrowed for the callback), or
 * an SX_E* code, body NULL and a message that names the endpoint and path.
 * Codes: SX_EUNREACH (no endpoint accepted a connection), SX_ETIMEDOUT (no
 * answer in timeout_ms), SX_EIO (the connection broke), SX_EPROTO (the answer
 * is not what etcd sends), SX_ELIMIT (too large), SX_ENOENT (gRPC NotFound,
 * e.g. "requested lease not found"), SX_EAUTH, SX_ESTORE (any other error
 * etcd reported), SX_ECANCELED is never passed: a canceled call is silent.
 * The call's handle is invalid once this runs.
 */
typedef void (*sx__etcd_done_fn)(void *arg, int status, json_t *body, const char *msg);

/*
 * One message of a stream (one line of the answer, parsed; borrowed).
 * Return 0 to go on, or an SX_E* code (and a message in err) to end the
 * stream: done then runs with that code.
 */
typedef int (*sx__etcd_msg_fn)(void *arg, json_t *msg, char *err, size_t err_size);

/* 0, SX_ENOMEM or SX_EIO (libcurl would not start).  TLS (etcd+https) uses
 * the system's CA store, or the files named by the environment variables
 * SX_ETCD_CACERT, SX_ETCD_CERT and SX_ETCD_KEY. */
int sx__etcd_http_open(uv_loop_t *loop, const sx_url *url, sx__etcd_http **out);

/* Cancel every call without calling back; memory is freed once the loop has
 * run the close callbacks. */
void sx__etcd_http_close(sx__etcd_http *h);

/* POST the JSON request (borrowed) to path ("/v3/kv/range").  0 and done runs
 * exactly once later, or < 0 and it never runs.  *out (may be NULL) receives
 * a handle for sx__etcd_cancel(). */
int sx__etcd_post(sx__etcd_http *h, const char *path, const json_t *req,
                  sx__etcd_done_fn done, void *arg, sx__etcd_call **out);

/* The same for a streaming endpoint (/v3/watch): on_msg runs for every
 * message, done once when the stream ends (it has no overall timeout). */
int sx__etcd_stream(sx__etcd_http *h, const char *path, const json_t *req,
                    sx__etcd_msg_fn on_msg, sx__etcd_done_fn done, void *arg,
                    sx__etcd_call **out);

/* Abandon a call; its callbacks never run. */
void sx__etcd_cancel(sx__etcd_call *c);

/* "host:port" of the endpoint requests go to first. */
const char *sx__etcd_endpoint(const sx__etcd_http *h);

/* snprintf for messages, where cutting a long host name or server text
 * short is intended. */
void sx__etcd_say(char *buf, size_t size, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- the wire (etcd_wire.c): base64 bytes and int64 strings in JSON ---- */

typedef struct sx__etcd_kv sx__etcd_kv;

/* A JSON string holding base64 of the bytes, or NULL (out of memory). */
json_t *sx__etcd_b64(const void *bytes, size_t len);

/* Decode base64 text; *out is malloc()ed with one extra NUL byte after
 * *out_len bytes.  0, SX_EPROTO (not base64) or SX_ENOMEM. */
int sx__etcd_unb64(const char *text, size_t len, uint8_t **out, size_t *out_len);

/* An int64 field: etcd writes them as strings ("12"), proto3 leaves out
 * zeroes.  0 (absent reads as 0) or SX_EPROTO. */
int sx__etcd_i64(const json_t *obj, const char *field, int64_t *out);

/* A JSON string of the decimal value (int64s travel as strings). */
json_t *sx__etcd_i64_json(int64_t v);

/* Request pieces.  Each returns a new JSON value, or NULL when out of memory;
 * the builders that take JSON values consume them, also on failure, so a
 * chain of calls needs one NULL check at the end. */
json_t *sx__etcd_jkv(json_t *obj, const char *key, json_t *value); /* obj[key]=value */
json_t *sx__etcd_japp(json_t *array, json_t *value);
json_t *sx__etcd_jkey(const char *key); /* base64 of a C string */
/* {"request_range":{key[, range_end][, keys_only]}} */
json_t *sx__etcd_range(const char *key, const char *end, int keys_only);
/* {"request_put":{key, value[, lease]}} */
json_t *sx__etcd_put(const char *key, const void *value, size_t len, int64_t lease);
/* {"request_delete_range":{key}} */
json_t *sx__etcd_delete(const char *key);
/* A compare of a key's mod_revision (target "MOD") or create_revision
 * ("CREATE") with rev; 0 stands for "the key does not exist". */
json_t *sx__etcd_cmp(const char *target, const char *key, int64_t rev);
json_t *sx__etcd_txn(json_t *compare, json_t *success, json_t *failure);
/* {field: "v"}: lease requests ({"ID": ...}, {"TTL": ...}). */
json_t *sx__etcd_id_req(const char *field, int64_t v);
/* The i-th response of a txn answer, a response_range: its first kv (if any)
 * into *kv and *found.  0, or SX_EPROTO with a message in err. */
int sx__etcd_txn_kv(const json_t *body, size_t i, sx__etcd_kv *kv, int *found, char *err,
                    size_t err_size);
/* Whether a txn's compares held. */
int sx__etcd_txn_ok(const json_t *body);

/* One mvccpb.KeyValue, decoded. */
struct sx__etcd_kv {
  uint8_t *key; /* NUL-terminated for convenience */
  size_t key_len;
  uint8_t *value; /* NUL-terminated; NULL only when freed */
  size_t value_len;
  int64_t create_rev, mod_rev, version, lease;
};

/* 0, SX_EPROTO (with a message in err) or SX_ENOMEM. */
int sx__etcd_kv_parse(const json_t *kv, sx__etcd_kv *out, char *err, size_t err_size);
void sx__etcd_kv_free(sx__etcd_kv *kv);

/* ---- the backend (backend_etcd.c, etcd_conn.c) ---- */

/*
 * Key layout under the namespace prefix P = "/segxfer/NS/":
 *   P seg/NAME             the encoded descriptor            lease L
 *   P own/NAME             owner record (JSON, below)        lease L
 *   P del/NAME             tombstone of an unpublish/remove  lease L (revoked next)
 *   P fence/NAME/INC_HEX   a fenced incarnation              24 h lease
 * L is the segment's lease: when it expires etcd deletes seg and own in one
 * revision; an explicit delete writes the tombstone in the same transaction,
 * which is how a watcher tells SX_EVENT_DELETE from SX_EVENT_EXPIRED.
 */
#define SX_ETCD_ROOT "/segxfer/"
#define SX_ETCD_FENCE_TTL_S (24 * 3600)
#define SX_ETCD_KEY_MAX (sizeof(SX_ETCD_ROOT) + SX_NS_MAX + SX_NAME_MAX + 48)

/* Owner records and tombstones:
 * {"v":1,"inc":"<32 hex>","gen":"<decimal>","pub":<wall ms>,"ttl":<s>}. */
typedef struct sx__etcd_owner {
  uint8_t inc[SX_INCARNATION_LEN];
  uint64_t gen;
  uint64_t pub_ms; /* 0 if absent */
  int64_t ttl_s;   /* 0 if absent */
} sx__etcd_owner;

/* 0 or SX_EDECODE. */
int sx__etcd_owner_parse(const uint8_t *v, size_t len, sx__etcd_owner *o);
/* Write a record for inc/gen/ttl (now as "pub"), with "why" when not NULL
 * (tombstones); returns its length. */
int sx__etcd_owner_text(char *buf, size_t size, const uint8_t *inc, uint64_t gen,
                        int64_t ttl_s, const char *why);

typedef struct sx__etcd_op sx__etcd_op;

typedef struct sx__etcd_backend {
  sx_backend base;
  sx__etcd_http *http;
  /* "/segxfer/NS/" */
  char prefix[sizeof(SX_ETCD_ROOT) + SX_NS_MAX + 1];
  sx__etcd_op *ops; /* ops in flight */
  int closing;
  int handles; /* open uv timers */
  /* Connection state as last reported through on_conn: -1 not yet, 0, 1. */
  int up;
  uint32_t backoff_ms;
  uv_timer_t probe_timer;
  sx__etcd_call *probe;
  /* The watch (etcd_watch.c). */
  int watching;
  sx__etcd_call *watch;
  int watch_created;
  uint32_t watch_backoff_ms;
  int64_t watch_rev;  /* every event up to this revision was delivered */
  int watch_now;      /* no revision to resume from: start at the current one */
  int64_t watch_term; /* raft term when the watch was set up: never goes back */
  int64_t seen_rev;   /* the newest store revision any answer carried */
  uv_timer_t watch_timer;
  /* Tombstones seen in the revision being delivered. */
  struct sx__etcd_tomb {
    char name[SX_NAME_MAX + 1];
    sx__etcd_owner who;
  } tombs[8];
  int n_tombs;
  int64_t tomb_rev;
} sx__etcd_backend;

/* Record what a request to etcd taught about the connection: transport
 * failures (SX_EUNREACH, SX_ETIMEDOUT, SX_EIO) mean down, any answer means
 * up.  Also remembers the store revision of the answer (body, may be NULL).
 * Runs hooks.on_conn on a change, which may close the backend: callers check
 * eb->closing afterwards. */
void sx__etcd_conn_note(sx__etcd_backend *eb, int status, const json_t *body,
                        const char *msg);

/* Learn at once whether etcd is there (a probe); on_conn reports it. */
void sx__etcd_conn_start(sx__etcd_backend *eb);
/* The ops table's watch(). */
int sx__etcd_watch_op(sx_backend *b);

/* A jittered delay that doubles from 100 ms to 2 s with each failure. */
uint32_t sx__etcd_backoff(uint32_t *state);

/* Watch (etcd_conn.c): start the stream if it should run and does not;
 * stop it (the connection went down or the backend closes). */
void sx__etcd_watch_kick(sx__etcd_backend *eb);
void sx__etcd_watch_stop(sx__etcd_backend *eb);

#endif
