/*
 * Real redis-server / redis-sentinel processes for integration tests.
 *
 * Each server runs on a free 127.0.0.1 port, in a fresh temporary directory,
 * without persistence (--save '' --appendonly no), so a restart comes back
 * empty.  Servers die with the test process (PR_SET_PDEATHSIG), and an
 * atexit() handler stops whatever a failing test left running and removes the
 * directories; tests should still stop their servers in a group teardown.
 *
 * Usage:
 *   sxt_redis r;
 *   sxt_redis_opts o = {.notify = "Kx"};
 *   if (sxt_redis_start(&r, &o) != 0) skip();   // no redis-server installed
 *   char url[256];
 *   sxt_redis_url(&r, url, sizeof(url), "namespace=t1");
 *   ... sxt_redis_kill(&r, SIGKILL); sxt_redis_restart(&r); ...
 *   sxt_redis_stop(&r);
 *
 * Sentinel setups: start a master, a replica with .replica_of = &master, and
 * a sentinel with sxt_sentinel_start(&s, &master, "mymaster");
 * sxt_redis_wait_replicas() waits until the sentinel knows the replica, so
 * that SENTINEL FAILOVER can succeed.  sxt_sentinel_start_opts() gives the
 * sentinel a password of its own (requirepass in its config) and an ACL
 * user; the harness' own commands to it then authenticate.
 *
 * Functions return 0 or -1 and print why to stderr.  Not thread-safe.
 */
#ifndef SXT_REDIS_HARNESS_H
#define SXT_REDIS_HARNESS_H

#include "ports.h"
#include "store_fixture.h"

#include <sys/types.h>

#include <hiredis/hiredis.h>

typedef struct sxt_redis sxt_redis;

typedef struct sxt_redis_opts {
  /* Password of the default user.  Sentinels (sxt_sentinel_start_opts): the
   * sentinel's own requirepass, which clients must AUTH with. */
  const char *requirepass;
  /* An ACL user created at start: `user NAME on >PASS RULES`.  rules
   * defaults to "~* &* +@all". */
  const char *acl_user;
  const char *acl_pass;
  const char *acl_rules;
  const char *notify;        /* notify-keyspace-events, e.g. "Kx" */
  const sxt_redis *replica_of; /* start as a replica of this server */
  /* Keep data across a SIGKILL (appendonly, fsync always), so that a
   * restart may keep it (sxt_redis_restart_keep). */
  int persist;
  /* Addresses to listen on (space-separated; default "127.0.0.1"), e.g.
   * also a veth address that agents in a network namespace reach. */
  const char *bind;
  /* A Redis Cluster node (cluster-enabled, node timeout 1000 ms, its
   * nodes.conf in its directory); redis_cluster_harness.h joins nodes. */
  int cluster;
} sxt_redis_opts;

struct sxt_redis {
  pid_t pid;      /* 0 when not running */
  int port;
  int sentinel;   /* a redis-sentinel */
  int stopped;    /* SIGSTOPped */
  char dir[128];  /* its temporary directory */
  sxt_redis_opts opts;
  char master_name[64]; /* sentinel: the monitored master */
  int master_port;
  const char *master_auth; /* sentinel: the master's requirepass (auth-pass) */
  int slot;       /* in the harness' registry of running servers */
};

/* Start redis-server; waits until it answers PING (10 s at most). */
int sxt_redis_start(sxt_redis *r, const sxt_redis_opts *o);

/* Start redis-sentinel monitoring master under name (quorum 1,
 * down-after 1000 ms, failover-timeout 5000 ms); it authenticates to the
 * master with the master's requirepass. */
int sxt_sentinel_start(sxt_redis *s, const sxt_redis *master, const char *name);

/* The same with options for the sentinel itself: o->requirepass (its
 * `requirepass`: clients must AUTH), o->acl_user/acl_pass/acl_rules (an ACL
 * user on it, `user NAME on >PASS RULES`, rules default
 * "allchannels +@all").  The other fields are ignored.  o may be NULL. */
int sxt_sentinel_start_opts(sxt_redis *s, const sxt_redis *master, const char *name,
                            const sxt_redis_opts *o);

/* Send a signal (SIGKILL: and reap it; SIGSTOP/SIGCONT: pause/resume). */
void sxt_redis_kill(sxt_redis *r, int sig);

/* Start it again on the same port with the same options, empty. */
int sxt_redis_restart(sxt_redis *r);
/* Start it again on the same port with the data it had (opts.persist). */
int sxt_redis_restart_keep(sxt_redis *r);

/* Stop (SIGKILL), reap and remove the directory.  Safe to call twice. */
void sxt_redis_stop(sxt_redis *r);

/* Stop every server still running (also runs at exit). */
void sxt_redis_stop_all(void);

/* "redis://[user:pass@]127.0.0.1:PORT[?query]" with the server's own
 * credentials (the ACL user if any, else requirepass).  query may be NULL. */
void sxt_redis_url(const sxt_redis *r, char *buf, size_t size, const char *query);

/* A blocking hiredis connection, authenticated as the server's admin
 * (requirepass) when it has one (a sentinel: its own requirepass).  NULL on
 * failure.  redisFree() it. */
redisContext *sxt_redis_connect(const sxt_redis *r);

/* Run one command (printf-style, as redisCommand) on a fresh connection and
 * return the reply (freeReplyObject() it), or NULL. */
redisReply *sxt_redis_command(const sxt_redis *r, const char *fmt, ...);

/* Wait (up to timeout_ms) until the sentinel reports n healthy replicas of
 * its master and the master sees them online. */
int sxt_redis_wait_replicas(const sxt_redis *sentinel, int n, int timeout_ms);

/* Wait until the sentinel names port as its master's port. */
int sxt_redis_wait_master(const sxt_redis *sentinel, int port, int timeout_ms);

/* Wait until the server's ROLE is role ("master", "slave"). */
int sxt_redis_wait_role(const sxt_redis *r, const char *role, int timeout_ms);

/* The store suite's fixture: a persisting redis-server with keyspace
 * notifications (Kx), 1000 ms short leases. */
extern const sxt_store_fixture sxt_redis_fixture;

#endif
