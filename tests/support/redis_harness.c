/* Real redis-server and redis-sentinel processes for tests; see the header. */
#include "redis_harness.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/*
 * What is running, kept here rather than in the callers' structs: a test that
 * fails leaves its sxt_redis (often on its stack) behind, and the cleanup at
 * exit must not read it.
 */
#define MAX_LIVE 64
static struct {
  pid_t pid;
  int stopped;
  char dir[128];
} live[MAX_LIVE];
static int atexit_done;
static pid_t owner; /* the process that started the servers */

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

static long long now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void rm_dir(const char *dir) {
  if (dir[0] == '\0')
    return;
  pid_t pid = fork();
  if (pid == 0) {
    execlp("rm", "rm", "-rf", dir, (char *)NULL);
    _exit(127);
  }
  if (pid > 0)
    waitpid(pid, NULL, 0);
}

static void kill_reap(pid_t pid) {
  if (pid <= 0)
    return;
  kill(pid, SIGKILL);
  kill(pid, SIGCONT);
  waitpid(pid, NULL, 0);
}

/* The registry slot of r, if r is still registered as itself. */
static int slot_of(const sxt_redis *r) {
  int i = r->slot - 1;
  if (i < 0 || i >= MAX_LIVE || strcmp(live[i].dir, r->dir) != 0 || r->dir[0] == '\0')
    return -1;
  return i;
}

static void reap(sxt_redis *r) {
  int i = slot_of(r);
  if (i >= 0 && live[i].pid == r->pid && r->pid > 0)
    kill_reap(r->pid);
  if (i >= 0)
    live[i].pid = 0;
  r->pid = 0;
  r->stopped = 0;
}

void sxt_redis_stop(sxt_redis *r) {
  if (r == NULL)
    return;
  int i = slot_of(r);
  if (i >= 0) {
    reap(r);
    rm_dir(live[i].dir);
    memset(&live[i], 0, sizeof(live[i]));
  }
  r->pid = 0;
  r->slot = 0;
  r->dir[0] = '\0';
}

void sxt_redis_stop_all(void) {
  for (int i = 0; i < MAX_LIVE; i++) {
    if (live[i].dir[0] == '\0')
      continue;
    kill_reap(live[i].pid);
    rm_dir(live[i].dir);
    memset(&live[i], 0, sizeof(live[i]));
  }
}

/* A forked child (a test's publisher) inherits this handler: only the
 * process that started the servers stops them. */
static void at_exit(void) {
  if (getpid() == owner)
    sxt_redis_stop_all();
}

/* Does the server answer (PING gets PONG, or NOAUTH: it is up)? */
static int answers(int port, int sentinel) {
  struct timeval tv = {0, 300000};
  redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
  int ok = 0;
  if (c != NULL && !c->err) {
    redisSetTimeout(c, tv);
    redisReply *rep = redisCommand(c, "PING");
    ok = rep != NULL &&
         ((rep->type == REDIS_REPLY_STATUS && strcmp(rep->str, "PONG") == 0) ||
          (rep->type == REDIS_REPLY_ERROR && strncmp(rep->str, "NOAUTH", 6) == 0));
    (void)sentinel;
    if (rep)
      freeReplyObject(rep);
  }
  if (c)
    redisFree(c);
  return ok;
}

static int register_live(sxt_redis *r);

static int spawn(sxt_redis *r, const char *const argv[]) {
  char log[200];
  snprintf(log, sizeof(log), "%s/stdout.log", r->dir);
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    fprintf(stderr, "redis harness: fork: %s\n", strerror(errno));
    return -1;
  }
  if (pid == 0) {
    /* Die with the test, even when it is killed. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent)
      _exit(1);
    int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    setpgid(0, 0);
    execvp(argv[0], (char *const *)argv);
    _exit(127);
  }
  r->pid = pid;
  register_live(r);
  long long deadline = now_ms() + 10000;
  while (now_ms() < deadline) {
    int st;
    if (waitpid(pid, &st, WNOHANG) == pid) {
      r->pid = 0;
      live[r->slot - 1].pid = 0;
      fprintf(stderr, "redis harness: %s on port %d exited at start (see %s)\n", argv[0],
              r->port, log);
      return -1;
    }
    if (answers(r->port, r->sentinel))
      return 0;
    sleep_ms(20);
  }
  fprintf(stderr, "redis harness: %s on port %d did not answer within 10 s\n", argv[0],
          r->port);
  reap(r);
  return -1;
}

static int make_dir(sxt_redis *r) {
  const char *tmp = getenv("TMPDIR");
  snprintf(r->dir, sizeof(r->dir), "%s/sxt-redis-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (mkdtemp(r->dir) == NULL) {
    fprintf(stderr, "redis harness: mkdtemp: %s\n", strerror(errno));
    r->dir[0] = '\0';
    return -1;
  }
  return 0;
}

/* Record r as running (its directory and pid). */
static int register_live(sxt_redis *r) {
  if (!atexit_done) {
    owner = getpid();
    atexit(at_exit);
    atexit_done = 1;
  }
  int i = slot_of(r);
  for (int k = 0; i < 0 && k < MAX_LIVE; k++)
    if (live[k].dir[0] == '\0')
      i = k;
  if (i < 0)
    return -1;
  live[i].pid = r->pid;
  snprintf(live[i].dir, sizeof(live[i].dir), "%s", r->dir);
  r->slot = i + 1;
  return 0;
}

static int start_server(sxt_redis *r) {
  char port[16], logfile[200], replicaof[16], acl[512], pass[200];
  const char *argv[56];
  int n = 0;
  snprintf(port, sizeof(port), "%d", r->port);
  snprintf(logfile, sizeof(logfile), "%s/redis.log", r->dir);
  argv[n++] = "redis-server";
  argv[n++] = "--port";
  argv[n++] = port;
  /* One argument per address: redis-server quotes each argument when it
   * builds the config line. */
  char binds[128];
  snprintf(binds, sizeof(binds), "%s", r->opts.bind ? r->opts.bind : "127.0.0.1");
  argv[n++] = "--bind";
  for (char *save = NULL, *tok = strtok_r(binds, " ", &save); tok && n < 8;
       tok = strtok_r(NULL, " ", &save))
    argv[n++] = tok;
  if (r->opts.bind) {
    /* Reached from a test's network namespace: not only from loopback. */
    argv[n++] = "--protected-mode";
    argv[n++] = "no";
  }
  argv[n++] = "--save";
  argv[n++] = "";
  argv[n++] = "--appendonly";
  argv[n++] = r->opts.persist ? "yes" : "no";
  if (r->opts.persist) {
    argv[n++] = "--appendfsync";
    argv[n++] = "always";
  }
  argv[n++] = "--dir";
  argv[n++] = r->dir;
  argv[n++] = "--logfile";
  argv[n++] = logfile;
  argv[n++] = "--daemonize";
  argv[n++] = "no";
  if (r->opts.requirepass) {
    argv[n++] = "--requirepass";
    argv[n++] = r->opts.requirepass;
    argv[n++] = "--masterauth";
    argv[n++] = r->opts.requirepass;
  }
  if (r->opts.notify) {
    argv[n++] = "--notify-keyspace-events";
    argv[n++] = r->opts.notify;
  }
  if (r->opts.acl_user) {
    /* redis-server quotes each argument when it builds the config line, so
     * every ACL rule must be an argument of its own. */
    snprintf(pass, sizeof(pass), ">%s", r->opts.acl_pass ? r->opts.acl_pass : "");
    snprintf(acl, sizeof(acl), "%s", r->opts.acl_rules ? r->opts.acl_rules : "~* &* +@all");
    argv[n++] = "--user";
    argv[n++] = r->opts.acl_user;
    argv[n++] = "on";
    argv[n++] = pass;
    for (char *save = NULL, *tok = strtok_r(acl, " ", &save); tok && n < 36;
         tok = strtok_r(NULL, " ", &save))
      argv[n++] = tok;
  }
  /* Replicas sync at once, not after the diskless delay of 5 s: a
   * sentinel that asks before the link is up asks again only 10 s later. */
  argv[n++] = "--repl-diskless-sync-delay";
  argv[n++] = "0";
  if (r->opts.cluster) {
    argv[n++] = "--cluster-enabled";
    argv[n++] = "yes";
    argv[n++] = "--cluster-config-file";
    argv[n++] = "nodes.conf";
    argv[n++] = "--cluster-node-timeout";
    argv[n++] = "1000";
    /* Replicas may take over however long their master was gone. */
    argv[n++] = "--cluster-replica-validity-factor";
    argv[n++] = "0";
  }
  if (r->opts.replica_of) {
    snprintf(replicaof, sizeof(replicaof), "%d", r->opts.replica_of->port);
    argv[n++] = "--replicaof";
    argv[n++] = "127.0.0.1";
    argv[n++] = replicaof;
  }
  argv[n] = NULL;
  return spawn(r, argv);
}

static int write_sentinel_conf(sxt_redis *r, char *path, size_t size) {
  snprintf(path, size, "%s/sentinel.conf", r->dir);
  FILE *f = fopen(path, "w");
  if (f == NULL) {
    fprintf(stderr, "redis harness: %s: %s\n", path, strerror(errno));
    return -1;
  }
  fprintf(f,
          "port %d\nbind 127.0.0.1\ndaemonize no\ndir %s\nlogfile %s/sentinel.log\n"
          "sentinel monitor %s 127.0.0.1 %d 1\n"
          "sentinel down-after-milliseconds %s 1000\n"
          "sentinel failover-timeout %s 5000\n"
          "sentinel parallel-syncs %s 1\n",
          r->port, r->dir, r->dir, r->master_name, r->master_port, r->master_name,
          r->master_name, r->master_name);
  if (r->master_auth)
    fprintf(f, "sentinel auth-pass %s %s\n", r->master_name, r->master_auth);
  /* The sentinel's own credentials (Redis >= 6.2 sentinels know ACL users;
   * requirepass is the default user's password). */
  if (r->opts.requirepass)
    fprintf(f, "requirepass \"%s\"\n", r->opts.requirepass);
  if (r->opts.acl_user)
    fprintf(f, "user %s on >%s %s\n", r->opts.acl_user,
            r->opts.acl_pass ? r->opts.acl_pass : "",
            r->opts.acl_rules ? r->opts.acl_rules : "allchannels +@all");
  fclose(f);
  return 0;
}

static int start_once(sxt_redis *r) {
  if (!r->sentinel)
    return start_server(r);
  char conf[200];
  if (write_sentinel_conf(r, conf, sizeof(conf)))
    return -1;
  const char *argv[] = {"redis-sentinel", conf, NULL};
  return spawn(r, argv);
}

/* Is 127.0.0.1:port free to bind? */
static int port_free(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  int ok = fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
  if (fd >= 0)
    close(fd);
  return ok;
}

/* A cluster node also listens on its port + 10000 (the cluster bus): both
 * must be free, so the port must be at most 55535. */
static int node_port(const sxt_redis *r) {
  for (int i = 0; r->opts.cluster && i < 200; i++) {
    int p = sxt_free_port();
    if (p > 0 && p <= 55535 && port_free(p + 10000))
      return p;
  }
  return sxt_free_port();
}

/* Pick a port and start; retry with another port if the first was taken
 * between our probe and the server's bind (other tests run in parallel). */
static int start_fresh(sxt_redis *r) {
  if (make_dir(r))
    return -1;
  for (int attempt = 0; attempt < 5; attempt++) {
    r->port = node_port(r);
    if (r->port > 0 && start_once(r) == 0)
      return 0;
  }
  if (r->slot)
    sxt_redis_stop(r);
  else
    rm_dir(r->dir);
  r->dir[0] = '\0';
  return -1;
}

int sxt_redis_start(sxt_redis *r, const sxt_redis_opts *o) {
  memset(r, 0, sizeof(*r));
  if (o)
    r->opts = *o;
  return start_fresh(r);
}

int sxt_sentinel_start(sxt_redis *s, const sxt_redis *master, const char *name) {
  return sxt_sentinel_start_opts(s, master, name, NULL);
}

int sxt_sentinel_start_opts(sxt_redis *s, const sxt_redis *master, const char *name,
                            const sxt_redis_opts *o) {
  memset(s, 0, sizeof(*s));
  s->sentinel = 1;
  if (o) {
    s->opts.requirepass = o->requirepass;
    s->opts.acl_user = o->acl_user;
    s->opts.acl_pass = o->acl_pass;
    s->opts.acl_rules = o->acl_rules;
  }
  s->master_auth = master->opts.requirepass;
  snprintf(s->master_name, sizeof(s->master_name), "%s", name);
  s->master_port = master->port;
  return start_fresh(s);
}

void sxt_redis_kill(sxt_redis *r, int sig) {
  if (r->pid <= 0)
    return;
  if (sig == SIGKILL) {
    reap(r);
    return;
  }
  kill(r->pid, sig);
  if (sig == SIGSTOP) {
    /* kill() only queues the signal, and Redis has background threads:
     * wait until the whole server is frozen, so that the test's next
     * request meets a stopped server. */
    int st;
    while (waitpid(r->pid, &st, WUNTRACED) < 0 && errno == EINTR) {
    }
    r->stopped = 1;
  } else if (sig == SIGCONT) {
    r->stopped = 0;
  }
}

static int restart(sxt_redis *r, int wipe) {
  reap(r);
  if (wipe) {
    /* Without persistence there is nothing to remove; with it, the
     * append-only files are the data. */
    char aof[200];
    snprintf(aof, sizeof(aof), "%s/appendonlydir", r->dir);
    rm_dir(aof);
  }
  /* The same port: clients reconnect to the address they know. */
  for (int attempt = 0; attempt < 50; attempt++) {
    if (start_once(r) == 0)
      return 0;
    sleep_ms(100);
  }
  return -1;
}

int sxt_redis_restart(sxt_redis *r) { return restart(r, 1); }

int sxt_redis_restart_keep(sxt_redis *r) { return restart(r, 0); }

void sxt_redis_url(const sxt_redis *r, char *buf, size_t size, const char *query) {
  const char *user = r->opts.acl_user, *pass = r->opts.acl_user ? r->opts.acl_pass
                                                                : r->opts.requirepass;
  char cred[300] = "";
  if (user)
    snprintf(cred, sizeof(cred), "%s:%s@", user, pass ? pass : "");
  else if (pass)
    snprintf(cred, sizeof(cred), ":%s@", pass);
  snprintf(buf, size, "redis://%s127.0.0.1:%d%s%s", cred, r->port, query ? "?" : "",
           query ? query : "");
}

redisContext *sxt_redis_connect(const sxt_redis *r) {
  struct timeval tv = {2, 0};
  redisContext *c = redisConnectWithTimeout("127.0.0.1", r->port, tv);
  if (c == NULL || c->err) {
    fprintf(stderr, "redis harness: connect to %d: %s\n", r->port, c ? c->errstr : "oom");
    if (c)
      redisFree(c);
    return NULL;
  }
  redisSetTimeout(c, tv);
  if (r->opts.requirepass) {
    redisReply *rep = redisCommand(c, "AUTH %s", r->opts.requirepass);
    int ok = rep && rep->type != REDIS_REPLY_ERROR;
    if (rep)
      freeReplyObject(rep);
    if (!ok) {
      redisFree(c);
      return NULL;
    }
  }
  return c;
}

redisReply *sxt_redis_command(const sxt_redis *r, const char *fmt, ...) {
  redisContext *c = sxt_redis_connect(r);
  if (c == NULL)
    return NULL;
  va_list ap;
  va_start(ap, fmt);
  redisReply *rep = redisvCommand(c, fmt, ap);
  va_end(ap);
  redisFree(c);
  return rep;
}

static int sentinel_replicas_ok(const sxt_redis *s, int n) {
  redisReply *rep = sxt_redis_command(s, "SENTINEL REPLICAS %s", s->master_name);
  int healthy = 0;
  if (rep && rep->type == REDIS_REPLY_ARRAY) {
    for (size_t i = 0; i < rep->elements; i++) {
      redisReply *e = rep->element[i];
      int ok = 0;
      for (size_t k = 0; e->type == REDIS_REPLY_ARRAY && k + 1 < e->elements; k += 2) {
        if (strcmp(e->element[k]->str, "flags") == 0)
          ok = strcmp(e->element[k + 1]->str, "slave") == 0;
        if (strcmp(e->element[k]->str, "master-link-status") == 0 &&
            strcmp(e->element[k + 1]->str, "ok") != 0) {
          ok = 0;
          break;
        }
      }
      healthy += ok;
    }
  }
  if (rep)
    freeReplyObject(rep);
  return healthy >= n;
}

int sxt_redis_wait_replicas(const sxt_redis *s, int n, int timeout_ms) {
  long long deadline = now_ms() + timeout_ms;
  while (now_ms() < deadline) {
    if (sentinel_replicas_ok(s, n))
      return 0;
    sleep_ms(100);
  }
  fprintf(stderr, "redis harness: sentinel %d did not see %d healthy replicas in %d ms\n",
          s->port, n, timeout_ms);
  return -1;
}

int sxt_redis_wait_master(const sxt_redis *s, int port, int timeout_ms) {
  long long deadline = now_ms() + timeout_ms;
  while (now_ms() < deadline) {
    redisReply *rep =
        sxt_redis_command(s, "SENTINEL GET-MASTER-ADDR-BY-NAME %s", s->master_name);
    int ok = rep && rep->type == REDIS_REPLY_ARRAY && rep->elements == 2 &&
             atoi(rep->element[1]->str) == port;
    if (rep)
      freeReplyObject(rep);
    if (ok)
      return 0;
    sleep_ms(100);
  }
  fprintf(stderr, "redis harness: sentinel %d did not switch to port %d in %d ms\n",
          s->port, port, timeout_ms);
  return -1;
}

int sxt_redis_wait_role(const sxt_redis *r, const char *role, int timeout_ms) {
  long long deadline = now_ms() + timeout_ms;
  while (now_ms() < deadline) {
    redisReply *rep = sxt_redis_command(r, "ROLE");
    int ok = rep && rep->type == REDIS_REPLY_ARRAY && rep->elements > 0 &&
             rep->element[0]->type == REDIS_REPLY_STRING &&
             strcmp(rep->element[0]->str, role) == 0;
    if (rep)
      freeReplyObject(rep);
    if (ok)
      return 0;
    sleep_ms(100);
  }
  fprintf(stderr, "redis harness: port %d did not become %s in %d ms\n", r->port, role,
          timeout_ms);
  return -1;
}

/* ---------------------------------------------------------------- fixture */

static int fx_start(void **server) {
  sxt_redis *r = calloc(1, sizeof(*r));
  if (r == NULL)
    return -1;
  sxt_redis_opts o = {.notify = "Kx", .persist = 1};
  if (sxt_redis_start(r, &o) != 0) {
    free(r);
    /* The suite skips (saying so) when the program is missing. */
    return access("/usr/bin/redis-server", X_OK) == 0 ? -1 : 1;
  }
  *server = r;
  return 0;
}

static void fx_stop(void *server) {
  sxt_redis_stop(server);
  free(server);
}

static int fx_kill(void *server, int sig) {
  sxt_redis *r = server;
  if (r->pid <= 0)
    return sig == SIGCONT ? 0 : -1;
  sxt_redis_kill(r, sig);
  return 0;
}

static int fx_restart(void *server, int wipe) {
  return wipe ? sxt_redis_restart(server) : sxt_redis_restart_keep(server);
}

static void fx_url(void *server, const char *ns, const char *extra, char *buf,
                   size_t size) {
  char q[256];
  snprintf(q, sizeof(q), "namespace=%s%s%s", ns, extra ? "&" : "", extra ? extra : "");
  sxt_redis_url(server, buf, size, q);
}

static void fx_dead_url(void *server, const char *ns, char *buf, size_t size) {
  (void)server;
  snprintf(buf, size, "redis://127.0.0.1:%d?namespace=%s&connect_timeout_ms=1000",
           sxt_free_port(), ns);
}

/* The value under the segment's key and the name in the listing index, as a
 * buggy writer could leave them (no owner fields, no TTL). */
static int fx_plant(void *server, const char *ns, const char *name, const void *value,
                    size_t len) {
  char key[300], index[128];
  snprintf(key, sizeof(key), "sx:%s:seg:{%s}", ns, name);
  snprintf(index, sizeof(index), "sx:%s:index", ns);
  redisContext *c = sxt_redis_connect(server);
  if (c == NULL)
    return -1;
  redisReply *a = redisCommand(c, "HSET %s d %b", key, value, len);
  redisReply *b = redisCommand(c, "ZADD %s 99999999999999 %s", index, name);
  int ok = a && a->type == REDIS_REPLY_INTEGER && b && b->type == REDIS_REPLY_INTEGER;
  if (a)
    freeReplyObject(a);
  if (b)
    freeReplyObject(b);
  redisFree(c);
  return ok ? 0 : -1;
}

const sxt_store_fixture sxt_redis_fixture = {
    .name = "redis",
    .start = fx_start,
    .stop = fx_stop,
    .kill = fx_kill,
    .restart = fx_restart,
    .url = fx_url,
    .dead_url = fx_dead_url,
    .plant = fx_plant,
    .short_lease_ms = 1000,
};
