/*
 * The etcd backend's operations: each op is a chain of HTTP requests, each
 * step a callback of the previous one (the chains are drawn in
 * backend_etcd.c).  etcd_op.c has the chain machinery and the fenced read
 * every write starts with; etcd_lease.c publish, renew and unpublish;
 * backend_etcd.c get, list, remove, open and close.  Loop thread only.
 * Not installed.
 */
#ifndef SX_ETCD_OP_H
#define SX_ETCD_OP_H

#include "etcd.h"
#include "internal.h"

#define SX_ETCD_MAX_ATTEMPTS 8 /* optimistic transactions that lost a race */

typedef void (*sx__etcd_step_fn)(sx__etcd_op *o, int status, json_t *body, const char *msg);

struct sx__etcd_op {
  sx__etcd_op *prev, *next;
  sx__etcd_backend *eb;
  const char *what;
  sx_backend_cb cb;
  void *arg;
  sx__etcd_call *call;
  sx__etcd_step_fn step;
  sx_backend_reply rep;
  char name[SX_NAME_MAX + 1];
  uint8_t inc[SX_INCARNATION_LEN];
  char inc_hex[2 * SX_INCARNATION_LEN + 1];
  uint64_t gen;
  uint8_t *value;
  size_t len;
  uint32_t lease_ms;
  int takeover;
  int attempts;
  /* Read in the first step. */
  int64_t own_rev, seg_rev, own_lease;
  int has_holder; /* own names another incarnation (publish) or anyone (remove) */
  sx__etcd_owner holder;
  /* Leases this op granted, and whether a successful write now uses them. */
  int64_t lease, fence_lease;
  int lease_used, fence_used;
  /* get and list results. */
  uint8_t *out;
  size_t out_len;
  sx__etcd_kv *kvs;
  sx_backend_item *items;
  char (*names)[SX_NAME_MAX + 1];
  size_t n_items;
  sx__etcd_call **ttl_calls;
  struct ttl_req {
    sx__etcd_op *o;
    size_t i;
  } * ttl_reqs;
  size_t ttl_next, ttl_busy, ttl_max;
};

/* The key P KIND/NAME[/SUFFIX] into buf (SX_ETCD_KEY_MAX bytes). */
void sx__etcd_key(const sx__etcd_backend *eb, char *buf, const char *kind, const char *name,
                  const char *suffix);

/* A new op, linked into the backend (NULL with *rc set on failure). */
sx__etcd_op *sx__etcd_op_new(sx_backend *b, const char *what, const char *name,
                             sx_backend_cb cb, void *arg, int *rc);
/* Start an op's first request; on failure unlink and free it silently (the
 * caller returns the error, so the callback must never run). */
int sx__etcd_op_begin(sx__etcd_op *o, const char *path, json_t *req, sx__etcd_step_fn step);
/* Send the next request of an op; the JSON is consumed.  On failure the op
 * is finished with the error. */
void sx__etcd_op_send(sx__etcd_op *o, const char *path, json_t *req, sx__etcd_step_fn step);
/* Deliver the op's result and free it.  Leases it granted but did not put
 * to use are revoked. */
void sx__etcd_op_finish(sx__etcd_op *o, int status, const char *fmt, ...) SX__PRINTF(3, 4);
void sx__etcd_op_unlink(sx__etcd_op *o);
void sx__etcd_op_free(sx__etcd_op *o);
void sx__etcd_op_set_inc(sx__etcd_op *o, const uint8_t *inc);
/* Revoke a lease without waiting for the answer (0: nothing to do). */
void sx__etcd_revoke_detached(sx__etcd_backend *eb, int64_t lease);

/* A read of own/NAME and fence/NAME/<mine> (the first step, or a failed
 * transaction's failure branch), decoded. */
typedef struct sx__etcd_seen {
  int found, fenced, parsed;
  sx__etcd_kv kv;
  sx__etcd_owner who;
} sx__etcd_seen;

/* The read every fenced op starts with: own/NAME and fence/NAME/<mine>
 * (or seg/NAME for remove), in one snapshot. */
json_t *sx__etcd_read_ops(sx__etcd_op *o, int with_seg);
/* 0, or the answer is malformed and the op is finished with the error. */
int sx__etcd_read_seen(sx__etcd_op *o, const json_t *body, sx__etcd_seen *s);
/* Finish with SX_EFENCED, saying who holds the name now. */
void sx__etcd_fenced_finish(sx__etcd_op *o, const sx__etcd_seen *s);
/* For renew and unpublish: 0 if the segment is ours, else finish. */
int sx__etcd_own_or_finish(sx__etcd_op *o, sx__etcd_seen *s);

/* etcd_lease.c: the ops table's publish, renew and unpublish. */
int sx__etcd_publish(sx_backend *b, const sx_publish_req *req, sx_backend_cb cb, void *arg);
int sx__etcd_renew(sx_backend *b, const char *name, const uint8_t *incarnation,
                   uint32_t lease_ms, sx_backend_cb cb, void *arg);
int sx__etcd_unpublish(sx_backend *b, const char *name, const uint8_t *incarnation,
                       sx_backend_cb cb, void *arg);

#endif
