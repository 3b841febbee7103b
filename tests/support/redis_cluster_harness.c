/* A real Redis Cluster for tests; see the header. */
#include "redis_cluster_harness.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "redis/redis.h"

static void nap(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

static long long mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

pid_t sxt_rcluster_cli_spawn(const sxt_rcluster *c, const char *const *args) {
  const char *argv[64];
  int n = 0;
  argv[n++] = "redis-cli";
  if (c->opts.requirepass) {
    argv[n++] = "-a";
    argv[n++] = c->opts.requirepass;
    argv[n++] = "--no-auth-warning";
  }
  for (int i = 0; args[i] != NULL && n < 63; i++)
    argv[n++] = args[i];
  argv[n] = NULL;
  char log[200];
  snprintf(log, sizeof(log), "%s/redis-cli.log", c->node[0].dir);
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0)
    return -1;
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent)
      _exit(1);
    int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    int nul = open("/dev/null", O_RDONLY);
    if (nul >= 0)
      dup2(nul, 0);
    execvp(argv[0], (char *const *)argv);
    _exit(127);
  }
  return pid;
}

int sxt_rcluster_cli_wait(pid_t pid) {
  int st;
  while (waitpid(pid, &st, 0) < 0)
    if (errno != EINTR)
      return -1;
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* The node says the cluster is ok, and, if a master, its replica is in
 * sync (so that it can take over). */
static int node_ok(const sxt_redis *r) {
  redisReply *rep = sxt_redis_command(r, "CLUSTER INFO");
  int ok = rep && rep->type == REDIS_REPLY_STRING && strstr(rep->str, "cluster_state:ok") &&
           strstr(rep->str, "cluster_slots_ok:16384");
  if (rep)
    freeReplyObject(rep);
  rep = ok ? sxt_redis_command(r, "INFO replication") : NULL;
  if (rep && rep->type == REDIS_REPLY_STRING && strstr(rep->str, "role:master"))
    ok = strstr(rep->str, "state=online") != NULL;
  if (rep)
    freeReplyObject(rep);
  return ok;
}

/* The master port of slot as node r sees it, or -1. */
static int slot_master_port(const sxt_redis *r, unsigned slot) {
  redisReply *rep = sxt_redis_command(r, "CLUSTER SLOTS");
  int port = -1;
  if (rep && rep->type == REDIS_REPLY_ARRAY)
    for (size_t i = 0; i < rep->elements; i++) {
      redisReply *e = rep->element[i];
      if (e->elements >= 3 && (unsigned)e->element[0]->integer <= slot &&
          slot <= (unsigned)e->element[1]->integer)
        port = (int)e->element[2]->element[1]->integer;
    }
  if (rep)
    freeReplyObject(rep);
  return port;
}

int sxt_rcluster_wait_ok(const sxt_rcluster *c, int timeout_ms) {
  long long deadline = mono_ms() + timeout_ms;
  while (mono_ms() < deadline) {
    int ok = 1, port0 = -1, port1 = -1;
    for (int i = 0; i < SXT_RCLUSTER_NODES && ok; i++) {
      const sxt_redis *r = &c->node[i];
      if (r->pid <= 0)
        continue;
      ok = node_ok(r);
      /* Every node agrees on two probe slots' masters. */
      int a = slot_master_port(r, 0), b = slot_master_port(r, 16383);
      if (port0 < 0) {
        port0 = a;
        port1 = b;
      }
      ok = ok && a == port0 && b == port1 && a > 0;
    }
    if (ok)
      return 0;
    nap(100);
  }
  fprintf(stderr, "redis cluster harness: not ok within %d ms\n", timeout_ms);
  return -1;
}

int sxt_rcluster_start(sxt_rcluster *c, const sxt_redis_opts *o) {
  memset(c, 0, sizeof(*c));
  if (o)
    c->opts = *o;
  c->opts.cluster = 1;
  if (access("/usr/bin/redis-server", X_OK) != 0 || access("/usr/bin/redis-cli", X_OK) != 0)
    return 1;
  for (int i = 0; i < SXT_RCLUSTER_NODES; i++)
    if (sxt_redis_start(&c->node[i], &c->opts) != 0)
      goto fail;
  char addr[SXT_RCLUSTER_NODES][32];
  const char *args[SXT_RCLUSTER_NODES + 8];
  int n = 0;
  args[n++] = "--cluster";
  args[n++] = "create";
  for (int i = 0; i < SXT_RCLUSTER_NODES; i++) {
    snprintf(addr[i], sizeof(addr[i]), "127.0.0.1:%d", c->node[i].port);
    args[n++] = addr[i];
  }
  args[n++] = "--cluster-replicas";
  args[n++] = "1";
  args[n++] = "--cluster-yes";
  args[n] = NULL;
  pid_t pid = sxt_rcluster_cli_spawn(c, args);
  if (pid < 0 || sxt_rcluster_cli_wait(pid) != 0) {
    fprintf(stderr, "redis cluster harness: redis-cli --cluster create failed (see "
            "%s/redis-cli.log)\n", c->node[0].dir);
    goto fail;
  }
  if (sxt_rcluster_wait_ok(c, 30000) != 0)
    goto fail;
  return 0;
fail:
  sxt_rcluster_stop(c);
  return -1;
}

void sxt_rcluster_stop(sxt_rcluster *c) {
  for (int i = 0; i < SXT_RCLUSTER_NODES; i++)
    sxt_redis_stop(&c->node[i]);
}

void sxt_rcluster_url(const sxt_rcluster *c, char *buf, size_t size, const char *query) {
  const char *user = c->opts.acl_user,
             *pass = c->opts.acl_user ? c->opts.acl_pass : c->opts.requirepass;
  size_t o = 0;
#define PUT(...)                                                               \
  do {                                                                         \
    int n_ = snprintf(buf + o, o < size ? size - o : 0, __VA_ARGS__);          \
    if (n_ > 0)                                                                \
      o += (size_t)n_;                                                         \
  } while (0)
  PUT("redis+cluster://");
  if (user)
    PUT("%s:%s@", user, pass ? pass : "");
  else if (pass)
    PUT(":%s@", pass);
  for (int i = 0; i < SXT_RCLUSTER_NODES; i++)
    PUT("%s127.0.0.1:%d", i ? "," : "", c->node[i].port);
  if (query)
    PUT("?%s", query);
#undef PUT
}

int sxt_rcluster_master_of(const sxt_rcluster *c, unsigned slot) {
  for (int i = 0; i < SXT_RCLUSTER_NODES; i++) {
    if (c->node[i].pid <= 0 || c->node[i].stopped)
      continue;
    int port = slot_master_port(&c->node[i], slot);
    for (int k = 0; k < SXT_RCLUSTER_NODES; k++)
      if (c->node[k].port == port)
        return k;
    return -1;
  }
  return -1;
}

redisReply *sxt_rcluster_command(const sxt_rcluster *c, const char *fmt, ...) {
  for (int i = 0; i < SXT_RCLUSTER_NODES; i++) {
    if (c->node[i].pid <= 0 || c->node[i].stopped)
      continue;
    redisContext *ctx = sxt_redis_connect(&c->node[i]);
    if (ctx == NULL)
      continue;
    va_list ap;
    va_start(ap, fmt);
    redisReply *rep = redisvCommand(ctx, fmt, ap);
    va_end(ap);
    redisFree(ctx);
    if (rep && rep->type == REDIS_REPLY_ERROR && strncmp(rep->str, "MOVED", 5) == 0) {
      freeReplyObject(rep);
      continue;
    }
    return rep;
  }
  return NULL;
}

int sxt_rcluster_node_id(const sxt_rcluster *c, int i, char id[41]) {
  redisReply *rep = sxt_redis_command(&c->node[i], "CLUSTER MYID");
  int ok = rep && rep->type == REDIS_REPLY_STRING && rep->len == 40;
  if (ok)
    memcpy(id, rep->str, 41);
  if (rep)
    freeReplyObject(rep);
  return ok ? 0 : -1;
}

/* ---------------------------------------------------------------- fixture */

static int fx_start(void **server) {
  sxt_rcluster *c = calloc(1, sizeof(*c));
  if (c == NULL)
    return -1;
  sxt_redis_opts o = {.notify = "Kx", .persist = 1};
  int rc = sxt_rcluster_start(c, &o);
  if (rc != 0) {
    free(c);
    return rc;
  }
  *server = c;
  return 0;
}

static void fx_stop(void *server) {
  sxt_rcluster_stop(server);
  free(server);
}

static int fx_kill(void *server, int sig) {
  sxt_rcluster *c = server;
  int any = 0;
  for (int i = 0; i < SXT_RCLUSTER_NODES; i++)
    if (c->node[i].pid > 0) {
      sxt_redis_kill(&c->node[i], sig);
      any = 1;
    }
  return any || sig == SIGCONT ? 0 : -1;
}

static int fx_restart(void *server, int wipe) {
  sxt_rcluster *c = server;
  for (int i = 0; i < SXT_RCLUSTER_NODES; i++) {
    if (c->node[i].pid > 0)
      sxt_redis_kill(&c->node[i], SIGKILL);
  }
  for (int i = 0; i < SXT_RCLUSTER_NODES; i++) {
    int rc = wipe ? sxt_redis_restart(&c->node[i]) : sxt_redis_restart_keep(&c->node[i]);
    if (rc != 0)
      return -1;
  }
  return sxt_rcluster_wait_ok(c, 30000);
}

static void fx_url(void *server, const char *ns, const char *extra, char *buf,
                   size_t size) {
  char q[256];
  snprintf(q, sizeof(q), "namespace=%s%s%s", ns, extra ? "&" : "", extra ? extra : "");
  sxt_rcluster_url(server, buf, size, q);
}

static void fx_dead_url(void *server, const char *ns, char *buf, size_t size) {
  (void)server;
  snprintf(buf, size, "redis+cluster://127.0.0.1:%d?namespace=%s&connect_timeout_ms=1000",
           sxt_free_port(), ns);
}

/* As sxt_redis_fixture's plant, into the name's piece of the index. */
static int fx_plant(void *server, const char *ns, const char *name, const void *value,
                    size_t len) {
  char key[300], index[128];
  snprintf(key, sizeof(key), "sx:%s:seg:{%s}", ns, name);
  snprintf(index, sizeof(index), "sx:%s:index:{%u}", ns,
           sx__rcl_crc16(name, strlen(name)) % SX_RCL_SHARDS);
  redisReply *a = sxt_rcluster_command(server, "HSET %s d %b", key, value, len);
  redisReply *b = sxt_rcluster_command(server, "ZADD %s 99999999999999 %s", index, name);
  int ok = a && a->type == REDIS_REPLY_INTEGER && b && b->type == REDIS_REPLY_INTEGER;
  if (a)
    freeReplyObject(a);
  if (b)
    freeReplyObject(b);
  return ok ? 0 : -1;
}

const sxt_store_fixture sxt_rcluster_fixture = {
    .name = "redis-cluster",
    .start = fx_start,
    .stop = fx_stop,
    .kill = fx_kill,
    .restart = fx_restart,
    .url = fx_url,
    .dead_url = fx_dead_url,
    .plant = fx_plant,
    .short_lease_ms = 1000,
};
