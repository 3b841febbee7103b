/* sx-bench helpers: clocks, latency percentiles, sizes, progress, a private
 * redis-server, machine facts. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "rawproto.h"

/* ------------------------------------------------------------ clocks */

double bx_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

uint64_t bx_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

double bx_cpu_self(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
         (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
}

double bx_cpu_thread(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* One field of pid's threads' schedstat (alive now), summed, in seconds:
 * 0 the time run on a CPU, 1 the time runnable but waiting; -1 when the
 * kernel does not say.  Nanoseconds, where /proc/PID/stat counts clock
 * ticks (10 ms: too coarse for the CPU difference of two fleet sizes). */
static double schedstat_sum(pid_t pid, int field) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/task", (int)pid);
  DIR *d = opendir(path);
  if (d == NULL)
    return -1;
  double sum = 0;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.')
      continue;
    char p[300];
    snprintf(p, sizeof(p), "/proc/%d/task/%.200s/schedstat", (int)pid, e->d_name);
    FILE *f = fopen(p, "r");
    unsigned long long v[2];
    if (f != NULL && fscanf(f, "%llu %llu", &v[0], &v[1]) == 2) {
      sum += (double)v[field] / 1e9;
      n++;
    }
    if (f != NULL)
      fclose(f);
  }
  closedir(d);
  return n > 0 ? sum : -1;
}

double bx_runq_wait(pid_t pid) { return schedstat_sum(pid, 1); }

double bx_proc_cpu(pid_t pid) {
  double run = schedstat_sum(pid, 0);
  if (run >= 0)
    return run;
  char path[64], buf[1024];
  snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return -1;
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = '\0';
  /* The name (field 2) may hold spaces and parentheses: count fields from
   * the last ')'.  utime and stime are fields 14 and 15, in clock ticks. */
  const char *p = strrchr(buf, ')');
  unsigned long long ut, st;
  if (p == NULL || sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu",
                          &ut, &st) != 2)
    return -1;
  return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* ------------------------------------------------------------ statistics */

void bx_lat_add(bx_lat *l, uint64_t ns) {
  if (l->n == l->cap) {
    size_t cap = l->cap ? l->cap * 2 : 4096;
    uint64_t *v = realloc(l->v, cap * sizeof(*v));
    if (v == NULL)
      return; /* keep what we have: percentiles of fewer samples */
    l->v = v;
    l->cap = cap;
  }
  l->v[l->n++] = ns;
  l->sorted = 0;
}

static int u64_cmp(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

double bx_lat_pct(bx_lat *l, double q) {
  if (l->n == 0)
    return 0;
  if (!l->sorted) {
    qsort(l->v, l->n, sizeof(*l->v), u64_cmp);
    l->sorted = 1;
  }
  /* Nearest rank: the smallest sample with at least q of them at or below. */
  size_t k = (size_t)(q * (double)l->n + 0.999999);
  if (k == 0)
    k = 1;
  if (k > l->n)
    k = l->n;
  return (double)l->v[k - 1];
}

void bx_lat_reset(bx_lat *l) {
  l->n = 0;
  l->sorted = 0;
}

void bx_lat_free(bx_lat *l) {
  free(l->v);
  memset(l, 0, sizeof(*l));
}

static int dbl_cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

double bx_median(double *v, int n) {
  if (n <= 0)
    return 0;
  qsort(v, (size_t)n, sizeof(*v), dbl_cmp);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* ------------------------------------------------------------ sizes */

int bx_parse_size(const char *s, uint64_t *out) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (s[0] < '0' || s[0] > '9' || errno)
    return -1;
  uint64_t mul = 1;
  switch (*end) {
  case 'k': case 'K': mul = 1ull << 10; end++; break;
  case 'm': case 'M': mul = 1ull << 20; end++; break;
  case 'g': case 'G': mul = 1ull << 30; end++; break;
  default: break;
  }
  if (mul > 1 && *end == 'i')
    end++;
  if (mul > 1 && *end == 'B')
    end++;
  if (*end != '\0' || v > UINT64_MAX / mul)
    return -1;
  *out = v * mul;
  return 0;
}

int bx_parse_list(const char *s, uint64_t *out, int max, int sizes) {
  char buf[512];
  int n = 0;
  if (strlen(s) >= sizeof(buf))
    return -1;
  strcpy(buf, s);
  /* Every item given: strtok would skip the empty ones of "64K," and ",4". */
  for (char *tok = buf, *next; tok != NULL; tok = next) {
    uint64_t v;
    if ((next = strchr(tok, ',')) != NULL)
      *next++ = '\0';
    if (tok[0] == '\0')
      return -1;
    if (n == max)
      return -1;
    if (sizes) {
      if (bx_parse_size(tok, &v))
        return -1;
    } else {
      char *end;
      errno = 0;
      unsigned long long x = strtoull(tok, &end, 10);
      if (tok[0] < '0' || tok[0] > '9' || *end != '\0' || errno)
        return -1;
      v = x;
    }
    out[n++] = v;
  }
  return n;
}

const char *bx_size_name(uint64_t b, char *buf, size_t size) {
  if (b >= (1ull << 30) && b % (1ull << 30) == 0)
    snprintf(buf, size, "%lluG", (unsigned long long)(b >> 30));
  else if (b >= (1ull << 20) && b % (1ull << 20) == 0)
    snprintf(buf, size, "%lluM", (unsigned long long)(b >> 20));
  else if (b >= 1024 && b % 1024 == 0)
    snprintf(buf, size, "%lluK", (unsigned long long)(b >> 10));
  else
    snprintf(buf, size, "%llu", (unsigned long long)b);
  return buf;
}

/* ------------------------------------------------------------ progress */

static struct {
  int on, tty, steps, step, width;
  double t0, est;
  char mode[16];
} prog;

void bx_progress_start(const bx_common *o, const char *mode, int steps, double est_s) {
  memset(&prog, 0, sizeof(prog));
  /* Runs of a few seconds need no progress; longer ones do. */
  prog.on = !o->quiet && est_s > 3.0;
  prog.tty = isatty(STDERR_FILENO);
  prog.steps = steps;
  prog.t0 = bx_now();
  prog.est = est_s;
  snprintf(prog.mode, sizeof(prog.mode), "%s", mode);
  if (prog.on && !prog.tty)
    fprintf(stderr, "sx-bench %s: %d steps, about %.0f s\n", mode, steps, est_s);
}

void bx_progress(const char *fmt, ...) {
  char what[200];
  va_list ap;
  prog.step++;
  if (!prog.on)
    return;
  va_start(ap, fmt);
  vsnprintf(what, sizeof(what), fmt, ap);
  va_end(ap);
  double el = bx_now() - prog.t0;
  double left = prog.est - el;
  if (prog.step > 1 && prog.steps > 0)
    left = el / (prog.step - 1) * (prog.steps - prog.step + 1);
  if (left < 0)
    left = 0;
  char line[300];
  int n = snprintf(line, sizeof(line), "[%s %d/%d, %.0f s, ~%.0f s left] %s", prog.mode,
                   prog.step, prog.steps, el, left, what);
  if (prog.tty) {
    int pad = prog.width > n ? prog.width - n : 0;
    fprintf(stderr, "\r%s%*s", line, pad, "");
    prog.width = n;
  } else {
    fprintf(stderr, "%s\n", line);
  }
}

void bx_progress_end(void) {
  if (prog.on && prog.tty && prog.width > 0)
    fprintf(stderr, "\r%*s\r", prog.width, "");
  if (prog.on)
    fprintf(stderr, "sx-bench %s: finished in %.1f s\n", prog.mode, bx_now() - prog.t0);
  prog.on = 0;
}

/* ------------------------------------------------------------ children */

int bx_spawn(const char *const *args, pid_t *pid, int *lifeline, char *line, size_t size) {
  int in[2], out[2];
  *pid = -1;
  if (pipe(in) != 0)
    return -1;
  if (pipe(out) != 0) {
    close(in[0]);
    close(in[1]);
    return -1;
  }
  fflush(NULL);
  if ((*pid = fork()) == 0) {
    dup2(in[0], STDIN_FILENO);
    dup2(out[1], STDOUT_FILENO);
    close(in[1]);
    close(out[0]);
    execv("/proc/self/exe", (char *const *)args);
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  *lifeline = in[1];
  ssize_t n = *pid > 0 ? read(out[0], line, size - 1) : -1;
  close(out[0]);
  line[n > 0 ? n : 0] = '\0';
  return n > 0 ? 0 : -1;
}

/* ------------------------------------------------------------ sockets */

int bx_send_all(int fd, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n > 0) {
    ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      return -1;
    b += w;
    n -= (size_t)w;
  }
  return 0;
}

int bx_recv_all(int fd, void *p, size_t n) {
  uint8_t *b = p;
  while (n > 0) {
    ssize_t r = recv(fd, b, n, 0);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      return -1;
    b += r;
    n -= (size_t)r;
  }
  return 0;
}

/* ------------------------------------------------------------ redis-server */

static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof(a);
  if (fd < 0)
    return -1;
  if (bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0 ||
      getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
    close(fd);
    return -1;
  }
  close(fd);
  return ntohs(a.sin_port);
}

static int redis_ping(int port) {
  struct timeval tv = {0, 200000};
  redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
  int ok = 0;
  if (c != NULL && !c->err) {
    redisReply *r = redisCommand(c, "PING");
    ok = r != NULL && r->type == REDIS_REPLY_STATUS;
    if (r)
      freeReplyObject(r);
  }
  if (c)
    redisFree(c);
  return ok;
}

static void rm_rf(const char *dir) {
  pid_t pid = fork();
  if (pid == 0) {
    execlp("rm", "rm", "-rf", dir, (char *)NULL);
    _exit(127);
  }
  if (pid > 0)
    waitpid(pid, NULL, 0);
}

int bx_redis_start(bx_redis *r) { return bx_redis_start_node(r, 0); }

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

int bx_redis_start_node(bx_redis *r, int cluster) {
  memset(r, 0, sizeof(*r));
  snprintf(r->dir, sizeof(r->dir), "/tmp/sx-bench-redis.XXXXXX");
  if (mkdtemp(r->dir) == NULL) {
    fprintf(stderr, "sx-bench: cannot make a directory for redis-server: %s\n",
            strerror(errno));
    return -1;
  }
  /* A port found free may be taken before redis binds it: try a few. */
  for (int attempt = 0; attempt < 5; attempt++) {
    int port = free_port();
    /* A cluster node also listens on port + 10000 (the cluster bus). */
    for (int k = 0; cluster && k < 200 && (port > 55535 || !port_free(port + 10000)); k++)
      port = free_port();
    if (port < 0)
      continue;
    char ports[16];
    snprintf(ports, sizeof(ports), "%d", port);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0)
      break;
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent)
        _exit(1);
      int devnull = open("/dev/null", O_RDWR);
      if (devnull >= 0) {
        dup2(devnull, STDIN_FILENO);
        dup2(devnull, STDOUT_FILENO);
      }
      /* No persistence, expiry notifications as agents expect them. */
      if (cluster)
        execlp("redis-server", "redis-server", "--port", ports, "--bind", "127.0.0.1",
               "--save", "", "--appendonly", "no", "--dir", r->dir, "--daemonize", "no",
               "--notify-keyspace-events", "Kx", "--loglevel", "warning",
               "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
               "--cluster-node-timeout", "5000", (char *)NULL);
      else
        execlp("redis-server", "redis-server", "--port", ports, "--bind", "127.0.0.1",
               "--save", "", "--appendonly", "no", "--dir", r->dir, "--daemonize", "no",
               "--notify-keyspace-events", "Kx", "--loglevel", "warning", (char *)NULL);
      fprintf(stderr, "sx-bench: cannot run redis-server: %s (install redis-server, or "
              "give --metadata URL)\n", strerror(errno));
      _exit(127);
    }
    for (int i = 0; i < 100; i++) {
      int st;
      if (waitpid(pid, &st, WNOHANG) == pid) {
        pid = 0;
        break;
      }
      if (redis_ping(port)) {
        r->pid = pid;
        r->port = port;
        return 0;
      }
      struct timespec ts = {0, 50000000};
      nanosleep(&ts, NULL);
    }
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, NULL, 0);
    }
  }
  fprintf(stderr, "sx-bench: redis-server did not start\n");
  rm_rf(r->dir);
  return -1;
}

void bx_redis_stop(bx_redis *r) {
  if (r->pid > 0) {
    kill(r->pid, SIGKILL);
    waitpid(r->pid, NULL, 0);
  }
  if (r->dir[0])
    rm_rf(r->dir);
  memset(r, 0, sizeof(*r));
}

/* ------------------------------------------------------------ machine */

void bx_machine_get(bx_machine *m) {
  memset(m, 0, sizeof(*m));
  m->nproc = (int)sysconf(_SC_NPROCESSORS_ONLN);
  snprintf(m->cpu, sizeof(m->cpu), "unknown");
  FILE *f = fopen("/proc/cpuinfo", "r");
  char line[512];
  while (f != NULL && fgets(line, sizeof(line), f)) {
    if (strncmp(line, "model name", 10) == 0) {
      char *v = strchr(line, ':');
      if (v != NULL) {
        v++;
        while (*v == ' ' || *v == '\t')
          v++;
        v[strcspn(v, "\n")] = '\0';
        snprintf(m->cpu, sizeof(m->cpu), "%s", v);
      }
      break;
    }
  }
  if (f)
    fclose(f);
  struct utsname u;
  if (uname(&u) == 0)
    snprintf(m->kernel, sizeof(m->kernel), "%s %s", u.sysname, u.release);
  double la[1];
  if (getloadavg(la, 1) == 1)
    m->load1 = la[0];
}

/* ------------------------------------------------------------ cluster */

/* Does every node say cluster_state:ok? */
static int cluster_ok(const bx_rcluster *c) {
  for (int i = 0; i < c->n; i++) {
    struct timeval tv = {0, 300000};
    redisContext *ctx = redisConnectWithTimeout("127.0.0.1", c->node[i].port, tv);
    int ok = 0;
    if (ctx != NULL && !ctx->err) {
      redisReply *r = redisCommand(ctx, "CLUSTER INFO");
      ok = r != NULL && r->type == REDIS_REPLY_STRING && strstr(r->str, "cluster_state:ok");
      if (r)
        freeReplyObject(r);
    }
    if (ctx)
      redisFree(ctx);
    if (!ok)
      return 0;
  }
  return 1;
}

int bx_rcluster_start(bx_rcluster *c, int masters) {
  memset(c, 0, sizeof(*c));
  if (masters < 3 || masters > BX_CLUSTER_MAX) {
    fprintf(stderr, "sx-bench: a cluster has 3..%d masters\n", BX_CLUSTER_MAX);
    return -1;
  }
  char addr[BX_CLUSTER_MAX][24];
  const char *argv[BX_CLUSTER_MAX + 8];
  int n = 0;
  argv[n++] = "redis-cli";
  argv[n++] = "--cluster";
  argv[n++] = "create";
  for (c->n = 0; c->n < masters; c->n++) {
    if (bx_redis_start_node(&c->node[c->n], 1) != 0)
      goto fail;
    snprintf(addr[c->n], sizeof(addr[c->n]), "127.0.0.1:%d", c->node[c->n].port);
    argv[n++] = addr[c->n];
    size_t o = strlen(c->url_hosts);
    snprintf(c->url_hosts + o, sizeof(c->url_hosts) - o, "%s%s", o ? "," : "", addr[c->n]);
  }
  argv[n++] = "--cluster-replicas";
  argv[n++] = "0";
  argv[n++] = "--cluster-yes";
  argv[n] = NULL;
  pid_t pid = fork();
  if (pid < 0)
    goto fail;
  if (pid == 0) {
    int devnull = open("/dev/null", O_RDWR);
    if (devnull >= 0) {
      dup2(devnull, STDIN_FILENO);
      dup2(devnull, STDOUT_FILENO);
    }
    execvp("redis-cli", (char *const *)argv);
    _exit(127);
  }
  int st;
  if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    fprintf(stderr, "sx-bench: redis-cli --cluster create failed (is redis-tools "
            "installed?)\n");
    goto fail;
  }
  for (int i = 0; i < 300; i++) {
    if (cluster_ok(c))
      return 0;
    struct timespec ts = {0, 100000000};
    nanosleep(&ts, NULL);
  }
  fprintf(stderr, "sx-bench: the private cluster did not become ok within 30 s\n");
fail:
  bx_rcluster_stop(c);
  return -1;
}

void bx_rcluster_stop(bx_rcluster *c) {
  for (int i = 0; i < BX_CLUSTER_MAX; i++)
    bx_redis_stop(&c->node[i]);
  c->n = 0;
}
