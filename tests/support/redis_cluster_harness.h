/*
 * A real Redis Cluster for integration tests: 3 masters and 3 replicas
 * (redis-server --cluster-enabled yes on free loopback ports, joined with
 * redis-cli --cluster create --cluster-replicas 1), stopped with the test
 * (the servers are redis_harness.c's, so its atexit cleanup covers them).
 *
 *   sxt_rcluster c;
 *   sxt_redis_opts o = {.notify = "Kx"};
 *   if (sxt_rcluster_start(&c, &o) != 0) ...;
 *   sxt_rcluster_url(&c, url, sizeof(url), "namespace=t");
 *   ... sxt_rcluster_stop(&c);
 *
 * Functions return 0 or -1 and print why to stderr.  Not thread-safe.
 */
#ifndef SXT_REDIS_CLUSTER_HARNESS_H
#define SXT_REDIS_CLUSTER_HARNESS_H

#include "redis_harness.h"

#define SXT_RCLUSTER_NODES 6

typedef struct sxt_rcluster {
  sxt_redis node[SXT_RCLUSTER_NODES];
  sxt_redis_opts opts;
} sxt_rcluster;

/* Start six nodes with o (o->cluster is set here) and join them: 0, 1 when
 * redis-server or redis-cli is not installed, -1 on failure. */
int sxt_rcluster_start(sxt_rcluster *c, const sxt_redis_opts *o);
void sxt_rcluster_stop(sxt_rcluster *c);

/* "redis+cluster://[cred@]127.0.0.1:P1,...[?query]": every node a seed. */
void sxt_rcluster_url(const sxt_rcluster *c, char *buf, size_t size, const char *query);

/* Wait until every running node says cluster_state:ok and agrees on the
 * masters of all slots. */
int sxt_rcluster_wait_ok(const sxt_rcluster *c, int timeout_ms);

/* The node (index) serving slot as master, or -1. */
int sxt_rcluster_master_of(const sxt_rcluster *c, unsigned slot);

/* Run a command for key on the node that serves it (following MOVED):
 * the reply (freeReplyObject() it) or NULL. */
redisReply *sxt_rcluster_command(const sxt_rcluster *c, const char *fmt, ...);

/* Node i's cluster node id into id[41]: 0 or -1. */
int sxt_rcluster_node_id(const sxt_rcluster *c, int i, char id[41]);

/* Start a redis-cli run in the background (argv without the program and
 * the auth options; they are added): its pid, or -1. */
pid_t sxt_rcluster_cli_spawn(const sxt_rcluster *c, const char *const *args);
/* Wait for it: its exit status, or -1. */
int sxt_rcluster_cli_wait(pid_t pid);

/* The store suite's fixture: a persisting cluster with keyspace
 * notifications (Kx) on every node, 1000 ms short leases. */
extern const sxt_store_fixture sxt_rcluster_fixture;

#endif
