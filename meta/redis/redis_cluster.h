/*
 * The Redis Cluster client's state, shared by redis_cluster.c (nodes,
 * commands, the slot map, the session) and redis_cluster_sub.c (events).
 * Not installed.
 */
#ifndef SX_META_REDIS_CLUSTER_H
#define SX_META_REDIS_CLUSTER_H

#include "redis.h"

#define RCL_MAX_NODES 64
/* Redirections and retries of one command before its op fails. */
#define RCL_MAX_TRIES 32
/* The pause before a retry after TRYAGAIN or CLUSTERDOWN. */
#define RCL_RETRY_MS 50u
/* At most one map refresh per this many ms while redirections come in. */
#define RCL_REFRESH_GAP_MS 100u

typedef struct rcl_node {
  redis_backend *rb;
  int used;
  char host[256];
  int port;
  redisAsyncContext *ac;  /* commands */
  redisAsyncContext *sub; /* events, while watching */
  int hs_left;            /* handshake replies still expected on ac */
  int sub_left;           /* subscription confirmations still expected */
  int master;             /* a master in the current map */
} rcl_node;

typedef struct rcl_cmd rcl_cmd;
struct rcl_cmd {
  struct rcl_cmd *next;
  rreq *q;
  uint32_t seq;
  unsigned slot;
  int tries;
  rcl_node *ask; /* resend there once, after ASKING */
  int write;     /* changes data or announces: not resent after a loss */
  size_t len;
  char buf[];
};

struct sx_rcl {
  rcl_node nodes[RCL_MAX_NODES];
  int16_t slot_node[SX_RCL_SLOTS]; /* index into nodes, -1 unknown */
  int have_map;
  rcl_cmd *parked, *parked_tail;
  redisAsyncContext *disc; /* asking a node for the map */
  int disc_next, disc_tried, refreshing, again;
  char disc_host[256];
  int disc_port;
  char disc_err[400];
  uint32_t backoff_ms;
  int16_t chan_node[SX_RCL_SHARDS]; /* whose sub carries channel k, -1 none */
  int watch_told;
};

static inline int sx__rcl_node_index(const sx_rcl *cl, const rcl_node *n) {
  return (int)(n - cl->nodes);
}

/* redis_cluster.c: read the map again after delay_ms (coalesced); report
 * the session ready once every master (and, watching, every subscription)
 * answered. */
void sx__rcl_refresh(redis_backend *rb, uint32_t delay_ms);
void sx__rcl_check_ready(redis_backend *rb);

/* redis_cluster_sub.c: the events connection of a master; the shard
 * channels subscribed at their masters; on_watch once all are in place. */
void sx__rcl_sub_connect(rcl_node *n);
void sx__rcl_resubscribe(redis_backend *rb);
void sx__rcl_watch_check(redis_backend *rb);
unsigned sx__rcl_channel_slot(const redis_backend *rb, unsigned k);

#endif
