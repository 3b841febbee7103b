/*
 * sx-bench read's far end and baselines: spawning `sx-bench target`, its
 * control requests (CPU time), the raw TCP stream between the same two
 * processes, and perftest's ib_read_bw and ib_write_bw on the same RDMA
 * device (child processes, their CPU time from wait4).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "pattern.h"
#include "rawproto.h"
#include "read.h"
#include "segxfer/descriptor.h"

/* ------------------------------------------------------------ the target */

static void stop_proc(bx_tproc *t);

/* The target's stderr, read by a thread: held while it starts (so that a
 * failed start can say what it said), then passed on to ours as it comes. */
typedef struct bx_errfwd {
  int fd;
  pthread_t th;
  pthread_mutex_t mu;
  int pass;
  size_t n;
  char held[2048];
} bx_errfwd;

static void err_write(const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(STDERR_FILENO, p, n);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      return;
    p += w;
    n -= (size_t)w;
  }
}

static void *errfwd_main(void *arg) {
  bx_errfwd *e = arg;
  char b[4096];
  for (;;) {
    ssize_t r = read(e->fd, b, sizeof(b));
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      return NULL;
    pthread_mutex_lock(&e->mu);
    if (e->pass) {
      err_write(b, (size_t)r);
    } else {
      size_t k = (size_t)r < sizeof(e->held) - 1 - e->n ? (size_t)r : sizeof(e->held) - 1 - e->n;
      memcpy(e->held + e->n, b, k);
      e->n += k;
      e->held[e->n] = '\0';
    }
    pthread_mutex_unlock(&e->mu);
  }
}

/* The target started: what it said so far goes out, and the rest as it comes. */
static void errfwd_pass(bx_errfwd *e) {
  if (e == NULL)
    return;
  pthread_mutex_lock(&e->mu);
  e->pass = 1;
  err_write(e->held, e->n);
  e->n = 0;
  pthread_mutex_unlock(&e->mu);
}

/* After the target ended (its end of the pipe closed): the thread's end;
 * what it said and nobody saw into said (size bytes, "" if nothing). */
static void errfwd_end(bx_tproc *t, char *said, size_t size) {
  bx_errfwd *e = t->err;
  if (said != NULL && size > 0)
    said[0] = '\0';
  if (e == NULL)
    return;
  pthread_join(e->th, NULL);
  close(e->fd);
  if (said != NULL && size > 0) {
    size_t n = e->n;
    while (n > 0 && (e->held[n - 1] == '\n' || e->held[n - 1] == '\r'))
      n--;
    snprintf(said, size, "%.*s", (int)n, e->held);
  }
  pthread_mutex_destroy(&e->mu);
  free(e);
  t->err = NULL;
}

int bx_target_spawn(bx_tproc *t, const char *url, const char *name, const uint64_t *sizes,
                    int n, uint64_t group_bytes, uint64_t seed, const char *transport,
                    int writable) {
  int in[2], out[2], err[2];
  memset(t, 0, sizeof(*t));
  t->in_fd = t->out_fd = -1;
  if (pipe(in) != 0 || pipe(out) != 0 || pipe2(err, O_CLOEXEC) != 0) {
    fprintf(stderr, "sx-bench read: pipe: %s\n", strerror(errno));
    return -1;
  }
  char list[512] = "", gb[32], sd[32], b[16];
  for (int i = 0; i < n; i++)
    snprintf(list + strlen(list), sizeof(list) - strlen(list), "%s%s", i ? "," : "",
             bx_size_name(sizes[i], b, sizeof(b)));
  snprintf(gb, sizeof(gb), "%llu", (unsigned long long)group_bytes);
  snprintf(sd, sizeof(sd), "%llu", (unsigned long long)seed);
  bx_errfwd *e = calloc(1, sizeof(*e));
  if (e == NULL) {
    fprintf(stderr, "sx-bench read: out of memory\n");
    return -1;
  }
  e->fd = err[0];
  pthread_mutex_init(&e->mu, NULL);
  pid_t pid = fork();
  if (pid < 0) {
    fprintf(stderr, "sx-bench read: fork: %s\n", strerror(errno));
    close(err[0]);
    close(err[1]);
    pthread_mutex_destroy(&e->mu);
    free(e);
    return -1;
  }
  if (pid == 0) {
    dup2(in[0], STDIN_FILENO);
    dup2(out[1], STDOUT_FILENO);
    dup2(err[1], STDERR_FILENO);
    close(in[0]);
    close(in[1]);
    close(out[0]);
    close(out[1]);
    execl("/proc/self/exe", "sx-bench", "target", "--metadata", url, "--name", name,
          "--sizes", list, "--group-bytes", gb, "--seed", sd, "--transport", transport,
          writable ? "--writable" : (char *)NULL, writable ? "1" : NULL, (char *)NULL);
    fprintf(stderr, "sx-bench read: cannot start sx-bench target: %s\n", strerror(errno));
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  close(err[1]);
  t->pid = pid;
  t->in_fd = in[1];
  t->out_fd = out[0];
  t->err = e;
  if (pthread_create(&e->th, NULL, errfwd_main, e) != 0) {
    fprintf(stderr, "sx-bench read: cannot start a thread for the target's messages\n");
    t->err = NULL;
    bx_target_stop(t);
    close(e->fd);
    pthread_mutex_destroy(&e->mu);
    free(e);
    return -1;
  }
  /* Filling the pool takes a while: wait up to a minute for "ready". */
  char line[64];
  size_t got = 0;
  while (got < sizeof(line) - 1) {
    struct pollfd pfd = {.fd = t->out_fd, .events = POLLIN};
    if (poll(&pfd, 1, 60000) <= 0)
      break;
    ssize_t r = read(t->out_fd, line + got, 1);
    if (r <= 0)
      break;
    if (line[got] == '\n')
      break;
    got++;
  }
  line[got] = '\0';
  unsigned port;
  if (sscanf(line, "ready %u", &port) != 1 || port == 0 || port > 65535) {
    char said[1024];
    stop_proc(t);
    errfwd_end(t, said, sizeof(said));
    if (said[0] == '\0')
      snprintf(said, sizeof(said), "%s", line);
    fprintf(stderr, "sx-bench read: the target did not start (%s%s%s)\n",
            said[0] ? "it said '" : "it said nothing", said, said[0] ? "'" : "");
    return -1;
  }
  errfwd_pass(t->err);
  t->raw_port = (uint16_t)port;
  return 0;
}

void bx_target_stop(bx_tproc *t) {
  stop_proc(t);
  errfwd_end(t, NULL, 0);
}

static void stop_proc(bx_tproc *t) {
  if (t->in_fd >= 0)
    close(t->in_fd); /* its lifeline: it unpublishes and exits */
  if (t->out_fd >= 0)
    close(t->out_fd);
  t->in_fd = t->out_fd = -1;
  if (t->pid > 0) {
    int st;
    for (int i = 0; i < 100; i++) {
      if (waitpid(t->pid, &st, WNOHANG) == t->pid) {
        t->pid = 0;
        return;
      }
      struct timespec ts = {0, 50000000};
      nanosleep(&ts, NULL);
    }
    kill(t->pid, SIGKILL);
    waitpid(t->pid, &st, 0);
    t->pid = 0;
  }
}

int bx_target_exited(bx_tproc *t, char *why, size_t size) {
  int st;
  if (t->pid <= 0 || waitpid(t->pid, &st, WNOHANG) != t->pid)
    return 0;
  t->pid = 0;
  if (WIFSIGNALED(st))
    snprintf(why, size, "the target process was killed by signal %d", WTERMSIG(st));
  else
    snprintf(why, size, "the target process exited with status %d", WEXITSTATUS(st));
  return 1;
}

static int raw_connect(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  if (fd < 0)
    return -1;
  if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

static int send_req(int fd, uint32_t op, uint64_t a, uint64_t b) {
  bx_rawreq q;
  memcpy(q.magic, BX_RAW_MAGIC, 4);
  q.op = htonl(op);
  q.a = htobe64(a);
  q.b = htobe64(b);
  q.c = 0;
  return bx_send_all(fd, &q, sizeof(q));
}

double bx_target_cpu(bx_tproc *t) {
  if (t->ctl_fd <= 0 && (t->ctl_fd = raw_connect(t->raw_port)) < 0) {
    t->ctl_fd = 0;
    return -1;
  }
  uint64_t r[2];
  if (send_req(t->ctl_fd, BX_RAW_RUSAGE, 0, 0) != 0 || bx_recv_all(t->ctl_fd, r, sizeof(r))) {
    close(t->ctl_fd);
    t->ctl_fd = 0;
    return -1;
  }
  return (double)(be64toh(r[0]) + be64toh(r[1])) / 1e9;
}

/* ------------------------------------------------------------ raw stream */

typedef struct sreader {
  pthread_t th;
  int fd;
  uint8_t *buf;
  uint64_t chunk, slots;
  atomic_uint_fast64_t bytes;
  atomic_int stop;
  int failed;
  /* --verify: where the stream is in the group's memory. */
  int verify, bad;
  uint64_t seed, span, off;
  uint32_t region;
  int reverse; /* sx-bench read --op write: this side sends */
} sreader;

static void *sreader_main(void *arg) {
  sreader *s = arg;
  uint64_t slot = 0;
  while (!atomic_load_explicit(&s->stop, memory_order_relaxed)) {
    uint8_t *dst = s->buf + slot * s->chunk;
    int rc = s->reverse ? bx_send_all(s->fd, dst, (size_t)s->chunk)
                        : bx_recv_all(s->fd, dst, (size_t)s->chunk);
    if (rc != 0) {
      s->failed = 1;
      break;
    }
    if (s->verify) {
      if (sx__pattern_check(dst, s->chunk, s->seed, s->region, s->off, NULL) != 0)
        s->bad = 1;
      s->off += s->chunk;
      if (s->off == s->span)
        s->off = 0;
    }
    atomic_fetch_add_explicit(&s->bytes, s->chunk, memory_order_relaxed);
    slot = (slot + 1) % s->slots;
  }
  return NULL;
}

static uint64_t stream_bytes(sreader *s, int n) {
  uint64_t b = 0;
  for (int i = 0; i < n; i++)
    b += atomic_load_explicit(&s[i].bytes, memory_order_relaxed);
  return b;
}

int bx_raw_stream(bx_tproc *t, const bx_stream_req *q, bx_caseres *out, char *err,
                  size_t esize) {
  sreader *s = calloc((size_t)q->conns, sizeof(*s));
  int rc = -1, started = 0;
  memset(out, 0, sizeof(*out));
  if (s == NULL)
    return -1;
  /* Connections not yet made must not close stdin on the way out. */
  for (uint32_t i = 0; i < q->conns; i++)
    s[i].fd = -1;
  for (uint32_t i = 0; i < q->conns; i++) {
    s[i].chunk = q->size;
    s[i].slots = q->dst_bytes / q->size ? q->dst_bytes / q->size : 1;
    s[i].buf = malloc((size_t)(s[i].slots * q->size));
    /* Touch it now: first-touch page faults inside the window would make
     * the baseline weaker than it is (segxfer's buffers are warm too).  A
     * sender's bytes are real ones, not the one zero page. */
    if (s[i].buf != NULL && q->reverse)
      sx__pattern_fill(s[i].buf, s[i].slots * q->size, q->seed, i, 0);
    else if (s[i].buf != NULL)
      memset(s[i].buf, 0, (size_t)(s[i].slots * q->size));
    s[i].reverse = q->reverse;
    s[i].fd = raw_connect(t->raw_port);
    s[i].verify = q->verify;
    s[i].seed = q->seed;
    s[i].region = q->region;
    s[i].span = q->group_bytes / q->size * q->size;
    if (s[i].buf == NULL || s[i].fd < 0 ||
        send_req(s[i].fd, q->reverse ? BX_RAW_SINK : BX_RAW_STREAM, q->size, q->group)) {
      snprintf(err, esize, "raw stream: cannot connect to the target");
      goto out;
    }
    if (pthread_create(&s[i].th, NULL, sreader_main, &s[i]) != 0) {
      snprintf(err, esize, "raw stream: cannot start a thread");
      goto out;
    }
    started = (int)i + 1;
  }
  /* Warm up, then count bytes over the window, with both processes' CPU. */
  struct timespec w = {0, 150000000};
  nanosleep(&w, NULL);
  double t0 = bx_now(), c0 = bx_cpu_self(), tc0 = bx_target_cpu(t);
  uint64_t b0 = stream_bytes(s, started);
  struct timespec d = {(time_t)q->secs, (long)((q->secs - (double)(time_t)q->secs) * 1e9)};
  nanosleep(&d, NULL);
  uint64_t b1 = stream_bytes(s, started);
  double t1 = bx_now(), c1 = bx_cpu_self(), tc1 = bx_target_cpu(t);
  out->secs = t1 - t0;
  out->bytes = b1 - b0;
  out->blocks = out->bytes / q->size;
  out->cpu_reader = c1 - c0;
  out->cpu_target = tc0 >= 0 && tc1 >= tc0 ? tc1 - tc0 : -1;
  rc = 0;
out:
  for (int i = 0; i < started; i++)
    atomic_store(&s[i].stop, 1);
  /* Closing wakes the readers (and stops the target's senders). */
  for (uint32_t i = 0; i < q->conns; i++)
    if (s[i].fd >= 0)
      shutdown(s[i].fd, SHUT_RDWR);
  for (int i = 0; i < started; i++) {
    pthread_join(s[i].th, NULL);
    if (s[i].bad) {
      snprintf(err, esize, "raw stream: --verify: received bytes differ from the pattern");
      rc = -1;
    } else if (s[i].failed && rc == 0 && !atomic_load(&s[i].stop)) {
      snprintf(err, esize, "raw stream: the connection broke");
      rc = -1;
    }
  }
  for (uint32_t i = 0; i < q->conns; i++) {
    if (s[i].fd >= 0)
      close(s[i].fd);
    free(s[i].buf);
  }
  free(s);
  return rc;
}

/* ------------------------------------------------------------ perftest */

static double ru_secs(const struct rusage *ru) {
  return (double)ru->ru_utime.tv_sec + (double)ru->ru_utime.tv_usec / 1e6 +
         (double)ru->ru_stime.tv_sec + (double)ru->ru_stime.tv_usec / 1e6;
}

/* Run a program, its stdout into buf; returns its exit status or -1, and
 * its CPU seconds (user + system) in *cpu. */
static int run_capture(const char *const argv[], char *buf, size_t size, int timeout_s,
                       double *cpu) {
  int p[2];
  *cpu = 0;
  if (pipe(p) != 0)
    return -1;
  pid_t pid = fork();
  if (pid == 0) {
    dup2(p[1], STDOUT_FILENO);
    dup2(p[1], STDERR_FILENO);
    close(p[0]);
    close(p[1]);
    execvp(argv[0], (char *const *)argv);
    _exit(127);
  }
  close(p[1]);
  size_t got = 0;
  double end = bx_now() + timeout_s;
  while (bx_now() < end) {
    struct pollfd pfd = {.fd = p[0], .events = POLLIN};
    if (poll(&pfd, 1, 200) < 0)
      break;
    if (pfd.revents) {
      ssize_t r = read(p[0], buf + got, size - 1 - got);
      if (r <= 0)
        break;
      got += (size_t)r;
      if (got == size - 1)
        break;
    }
  }
  buf[got] = '\0';
  close(p[0]);
  /* Its output ended; give it until the deadline to exit (it may close its
   * stdout a moment before it is gone). */
  int st = 0;
  struct rusage ru;
  while (wait4(pid, &st, WNOHANG, &ru) == 0) {
    if (bx_now() >= end) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      return -1;
    }
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
  }
  *cpu = ru_secs(&ru);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* One perftest run (prog: ib_read_bw or ib_write_bw), a server and a client
 * of iters iterations per QP: MiB/s (BW average), or -1 with err filled;
 * *took its wall time, cpu[0] the client's and cpu[1] the server's CPU
 * seconds, both processes' whole lives. */
static double ib_bw_once(const char *prog, const char *dev, const char *ip, uint64_t size,
                         uint32_t qps, uint64_t iters, double *took, double cpu[2],
                         char *err, size_t esize) {
  char s_size[24], s_iters[24], s_qps[16], s_port[16];
  static int port_seq;
  snprintf(s_size, sizeof(s_size), "%llu", (unsigned long long)size);
  snprintf(s_iters, sizeof(s_iters), "%llu", (unsigned long long)iters);
  snprintf(s_qps, sizeof(s_qps), "%u", qps ? qps : 1);
  snprintf(s_port, sizeof(s_port), "%d", 18515 + (getpid() + port_seq++) % 2000);
  /* -N: no peak bandwidth, which perftest finds by a search over every
   * pair of completions (quadratic in iterations), after the test but
   * inside the CPU time counted here. */
  const char *srv[] = {prog, "-d", dev, "-s", s_size, "-n", s_iters, "-q", s_qps,
                       "-p", s_port, "-F", "-N", NULL};
  const char *cli[] = {prog, "-d", dev, "-s", s_size, "-n", s_iters, "-q", s_qps,
                       "-p", s_port, "-F", "-N", ip, NULL};
  /* The server's words go to a file, for the message if it fails. */
  char slog[64];
  snprintf(slog, sizeof(slog), "/tmp/sx-bench-ib-%d.log", (int)getpid());
  pid_t spid = fork();
  if (spid == 0) {
    int fd = open(slog, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
    }
    execvp(srv[0], (char *const *)srv);
    _exit(127);
  }
  char out[8192] = "";
  int rc = -1, st;
  double t0 = bx_now();
  struct rusage sru;
  cpu[0] = cpu[1] = 0;
  /* The server needs a moment to listen (seconds under emulation); retry
   * the client while it is alive. */
  for (int attempt = 0; attempt < 20 && rc != 0 && spid > 0; attempt++) {
    struct timespec ts = {0, 500000000};
    nanosleep(&ts, NULL);
    if (wait4(spid, &st, WNOHANG, &sru) == spid) {
      spid = -1;
      int n = snprintf(out, sizeof(out), "the %s server exited (status %d): ", prog, st);
      FILE *f = fopen(slog, "r");
      if (f != NULL && n > 0) {
        size_t r = fread(out + n, 1, sizeof(out) - (size_t)n - 1, f);
        out[(size_t)n + r] = '\0';
      }
      if (f)
        fclose(f);
      break;
    }
    t0 = bx_now();
    double c;
    rc = run_capture(cli, out, sizeof(out), 600, &c);
    cpu[0] += c;
  }
  *took = bx_now() - t0;
  unlink(slog);
  if (spid > 0) {
    /* After a good run the server ends by itself within moments. */
    double end = bx_now() + (rc == 0 ? 10 : 0);
    pid_t w;
    while ((w = wait4(spid, &st, WNOHANG, &sru)) == 0 && bx_now() < end) {
      struct timespec ts = {0, 10000000};
      nanosleep(&ts, NULL);
    }
    if (w == spid) {
      cpu[1] = ru_secs(&sru);
    } else {
      kill(spid, SIGKILL);
      waitpid(spid, &st, 0);
      cpu[1] = -1;
    }
  }
  if (rc != 0) {
    snprintf(err, esize, "%s -d %s -s %s -n %s failed (exit %d): %.200s", prog, dev, s_size,
             s_iters, rc, out);
    return -1;
  }
  /* The result line: #bytes #iterations BW peak[MiB/sec] BW average[MiB/sec] MsgRate */
  const char *h = strstr(out, "BW average");
  const char *line = h ? strchr(h, '\n') : NULL;
  double bytes = 0, n = 0, peak = 0, avg = -1;
  if (line == NULL || sscanf(line + 1, "%lf %lf %lf %lf", &bytes, &n, &peak, &avg) != 4 ||
      avg <= 0) {
    fprintf(stderr, "sx-bench read: %s said:\n%s\n", prog, out);
    snprintf(err, esize, "%s: no result in its output (above)", prog);
    return -1;
  }
  return avg;
}

/*
 * perftest's ib_read_bw or ib_write_bw between a server and a client on the
 * same device (the RDMA baselines), in iteration mode: its duration mode
 * reports nothing for large messages on slow devices (every READ of the
 * first window still in flight), so a short run sizes a second one to last
 * about secs.  The rate is perftest's own (BW average of the sized run).
 * CPU per byte is the difference of the two runs' CPU over the difference
 * of their bytes (size x iterations x QPs), which cancels what both spend
 * starting (device open, memory registration, connection); with one run
 * it is that run's, setup included.
 */
int bx_ib_bw(const char *prog, const char *dev, const char *ip, uint64_t size, uint32_t qps,
             double secs, bx_caseres *out, char *err, size_t esize) {
  uint64_t n = (8ull << 20) / size, m = 0;
  if (n < 20)
    n = 20;
  double took, cpu1[2], cpu2[2];
  /* perftest times itself with the CPU's cycle counter, calibrated at
   * start; under emulation the calibration sometimes fails ("Correlation
   * coefficient r^2 < 0.9") and a run reports 0 MB/s: try again. */
  double mib = -1;
  for (int attempt = 0; attempt < 3 && mib < 0; attempt++)
    mib = ib_bw_once(prog, dev, ip, size, qps, n, &took, cpu1, err, esize);
  if (mib < 0)
    return -1;
  if (took < secs) {
    double scale = took > 0.01 ? secs / took : 100;
    m = (uint64_t)((double)n * scale);
    if (m > 10000000)
      m = 10000000;
    if (m > n) {
      mib = -1;
      for (int attempt = 0; attempt < 3 && mib < 0; attempt++)
        mib = ib_bw_once(prog, dev, ip, size, qps, m, &took, cpu2, err, esize);
      if (mib < 0)
        return -1;
    }
  }
  double q = qps ? qps : 1, gbs = mib * 1048576.0 / 1e9;
  memset(out, 0, sizeof(*out));
  if (m > n) {
    /* A side that does next to nothing per byte (ib_read_bw's server only
     * waits) can come out below zero by the noise of its setup: zero, then. */
    out->bytes = (uint64_t)((double)(m - n) * (double)size * q);
    out->cpu_reader = cpu2[0] > cpu1[0] ? cpu2[0] - cpu1[0] : 0;
    out->cpu_target = cpu2[1] < 0 || cpu1[1] < 0 ? -1 : cpu2[1] > cpu1[1] ? cpu2[1] - cpu1[1] : 0;
  } else {
    out->bytes = (uint64_t)((double)n * (double)size * q);
    out->cpu_reader = cpu1[0];
    out->cpu_target = cpu1[1];
  }
  /* The window at perftest's rate, so that bytes / secs is that rate. */
  out->secs = (double)out->bytes / (gbs * 1e9);
  out->blocks = out->bytes / size;
  return 0;
}
