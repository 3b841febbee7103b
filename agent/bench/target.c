/*
 * sx-bench target: the far end of `sx-bench read`, which spawns it.
 *
 * One process hosts both sides of the comparison, reading the same memory:
 *   - an agent publishing a pool with one group per block size (group g:
 *     one layer, slot K, blocks of sizes[g]), filled with the verification
 *     pattern, served over TCP (and RDMA when asked);
 *   - a raw TCP stream server (blocking sockets, one thread per connection):
 *     the baseline, sending the same pool bytes chunk by chunk;
 * and answers the reader's control requests (its CPU time, quit).
 *
 * Lifetime: it exits when its stdin reaches end of file (the reader went
 * away, whatever the reason), on a QUIT request, or on SIGTERM; it
 * unpublishes first.  It prints "ready PORT" on stdout once the segment is
 * published and the stream server listens on PORT.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "bench.h"
#include "pattern.h"
#include "rawproto.h"
#include "segxfer/agent.h"
#include "segxfer/push.h"

const char bx_target_help[] =
    "usage: sx-bench target --metadata URL --name NAME [options]\n"
    "\n"
    "The far end of `sx-bench read`, which starts it; not meant to be run by hand.\n"
    "Hosts an agent with one group of blocks per size, filled with the verification\n"
    "pattern, and a raw TCP stream server over the same memory; prints \"ready PORT\"\n"
    "(the stream server's port) and runs until its stdin closes.\n"
    "\n"
    "  --metadata URL, --name NAME   where to publish\n"
    "  --sizes LIST                  block sizes, one group each (default 64K)\n"
    "  --group-bytes N               memory per group (default 64M)\n"
    "  --seed N                      fill pattern seed (default 42)\n"
    "  --transport tcp|rdma|auto     what the agent serves (default tcp)\n"
    "  --writable 1                  the pool takes writes from every producer of\n"
    "                                the namespace (sx-bench read --op write)\n"
    "  --listen HOST                 address of the agent and the stream server\n"
    "                                (default 127.0.0.1)\n";

typedef struct tgt {
  uint8_t *mem[BX_MAX_SIZES];
  uint64_t len[BX_MAX_SIZES];
  int n;
  volatile sig_atomic_t quit;
} tgt;

static tgt T;

static void on_term(int sig) {
  (void)sig;
  T.quit = 1;
}

/* Stream group g in chunks until the reader hangs up. */
static void stream(int fd, uint64_t chunk, uint64_t g) {
  if (g >= (uint64_t)T.n || chunk == 0 || chunk > T.len[g])
    return;
  uint64_t span = T.len[g] / chunk * chunk, off = 0;
  while (!T.quit) {
    if (bx_send_all(fd, T.mem[g] + off, (size_t)chunk) != 0)
      return;
    off += chunk;
    if (off == span)
      off = 0;
  }
}

/* Take chunks into group g until the writer hangs up. */
static void sink(int fd, uint64_t chunk, uint64_t g) {
  if (g >= (uint64_t)T.n || chunk == 0 || chunk > T.len[g])
    return;
  uint64_t span = T.len[g] / chunk * chunk, off = 0;
  while (!T.quit && bx_recv_all(fd, T.mem[g] + off, (size_t)chunk) == 0)
    off = off + chunk == span ? 0 : off + chunk;
}

static void *conn_main(void *arg) {
  int fd = (int)(intptr_t)arg;
  bx_rawreq q;
  while (!T.quit && bx_recv_all(fd, &q, sizeof(q)) == 0) {
    if (memcmp(q.magic, BX_RAW_MAGIC, 4) != 0)
      break;
    uint32_t op = ntohl(q.op);
    if (op == BX_RAW_STREAM || op == BX_RAW_SINK) {
      (op == BX_RAW_STREAM ? stream : sink)(fd, be64toh(q.a), be64toh(q.b));
      break;
    } else if (op == BX_RAW_RUSAGE) {
      struct rusage ru;
      getrusage(RUSAGE_SELF, &ru);
      uint64_t r[2] = {htobe64((uint64_t)ru.ru_utime.tv_sec * 1000000000u +
                               (uint64_t)ru.ru_utime.tv_usec * 1000u),
                       htobe64((uint64_t)ru.ru_stime.tv_sec * 1000000000u +
                               (uint64_t)ru.ru_stime.tv_usec * 1000u)};
      if (bx_send_all(fd, r, sizeof(r)) != 0)
        break;
    } else if (op == BX_RAW_QUIT) {
      T.quit = 1;
      break;
    } else {
      break;
    }
  }
  close(fd);
  return NULL;
}

static void *accept_main(void *arg) {
  int lfd = (int)(intptr_t)arg;
  while (!T.quit) {
    int fd = accept(lfd, NULL, NULL);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED)
        continue;
      break;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    pthread_t th;
    if (pthread_create(&th, NULL, conn_main, (void *)(intptr_t)fd) == 0)
      pthread_detach(th);
    else
      close(fd);
  }
  return NULL;
}

/* Quit when the reader closes our stdin (it exited or crashed). */
static void *lifeline_main(void *arg) {
  (void)arg;
  char buf[64];
  while (read(STDIN_FILENO, buf, sizeof(buf)) > 0)
    ;
  T.quit = 1;
  return NULL;
}

static int listen_raw(const char *host, uint16_t *port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET};
  socklen_t len = sizeof(a);
  int one = 1;
  if (fd < 0 || inet_pton(AF_INET, host, &a.sin_addr) != 1) {
    if (fd >= 0)
      close(fd);
    return -1;
  }
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(fd, 64) != 0 ||
      getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
    close(fd);
    return -1;
  }
  *port = ntohs(a.sin_port);
  return fd;
}

/* --writable: take each notice as an engine would (and drop it), so that the
 * queue never fills up. */
static int take_notice(void *arg, const sx_notice *n) {
  (void)arg;
  (void)n;
  return 1;
}

static void quiet_log(void *arg, sx_log_level level, const char *msg) {
  (void)arg;
  if (level <= SX_LOG_WARN)
    fprintf(stderr, "sx-bench target: %s\n", msg);
}

int bx_target_main(const bx_common *o, int argc, char **argv) {
  const char *url = NULL, *name = NULL, *listen_host = "127.0.0.1";
  uint64_t sizes[BX_MAX_SIZES] = {65536}, group = 64ull << 20, seed = 42;
  unsigned transports = SX_TRANSPORTS_TCP;
  uint32_t access = SX_ACCESS_REMOTE_READ;
  int n = 1;
  (void)o;
  /* Every option takes a value: a missing one reads as "" here, and is
   * said once the option is known to be one. */
  for (int i = 1; i < argc; i += 2) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
    if (strcmp(a, "--metadata") == 0)
      url = v;
    else if (strcmp(a, "--name") == 0)
      name = v;
    else if (strcmp(a, "--listen") == 0)
      listen_host = v;
    else if (strcmp(a, "--sizes") == 0)
      n = bx_parse_list(v, sizes, BX_MAX_SIZES, 1);
    else if (strcmp(a, "--group-bytes") == 0)
      n = bx_parse_size(v, &group) == 0 ? n : -1;
    else if (strcmp(a, "--seed") == 0)
      n = bx_parse_list(v, &seed, 1, 0) == 1 ? n : -1;
    else if (strcmp(a, "--writable") == 0)
      access |= strcmp(v, "1") == 0 ? SX_ACCESS_REMOTE_WRITE : 0;
    else if (strcmp(a, "--transport") == 0)
      transports = strcmp(v, "rdma") == 0   ? SX_TRANSPORTS_RDMA
                   : strcmp(v, "auto") == 0 ? SX_TRANSPORTS_ALL
                                            : SX_TRANSPORTS_TCP;
    else {
      fprintf(stderr, "sx-bench target: unknown option '%s'\n", a);
      return BX_USAGE;
    }
    if (i + 1 == argc) {
      fprintf(stderr, "sx-bench target: '%s' needs a value\n", a);
      return BX_USAGE;
    }
    if (n <= 0) {
      fprintf(stderr, "sx-bench target: bad option '%s %s'\n", a, v);
      return BX_USAGE;
    }
  }
  if (url == NULL || name == NULL) {
    fprintf(stderr, "sx-bench target: --metadata and --name are required\n");
    return BX_USAGE;
  }
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  signal(SIGTERM, on_term);
  signal(SIGINT, on_term);

  char listen[96];
  snprintf(listen, sizeof(listen), "%s:0", listen_host);
  sx_agent_params p;
  sx_agent_params_init(&p);
  p.name = name;
  p.metadata_url = url;
  p.listen = listen;
  p.transports = transports;
  p.log = quiet_log;
  p.log_level = SX_LOG_WARN;
  bx_bench_layout(&p.layout);
  sx_agent *a;
  int rc = sx_agent_create(&p, &a);
  if (rc) {
    fprintf(stderr, "sx-bench target: agent: %s: %s\n", sx_err_name(rc), sx_errmsg());
    return BX_FAIL;
  }
  T.n = n;
  for (int g = 0; g < n && rc == 0; g++) {
    uint64_t blocks = group / sizes[g];
    if (blocks == 0) {
      fprintf(stderr, "sx-bench target: --group-bytes is below block size %llu\n",
              (unsigned long long)sizes[g]);
      rc = SX_EINVAL;
      break;
    }
    T.len[g] = blocks * sizes[g];
    T.mem[g] = mmap(NULL, T.len[g], PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                    -1, 0);
    if (T.mem[g] == MAP_FAILED) {
      fprintf(stderr, "sx-bench target: cannot map %llu bytes\n",
              (unsigned long long)T.len[g]);
      rc = SX_ENOMEM;
      break;
    }
    sx_region_params r = {.addr = T.mem[g], .length = T.len[g], .group = (uint32_t)g,
                          .layer_count = 1, .slot = SX_SLOT_K, .block_bytes = sizes[g],
                          .num_blocks = blocks, .access = access};
    uint32_t id;
    /* Fill before registering: the pattern is keyed by the region id, which
     * registration gives out in order from 0 in a new agent. */
    sx__pattern_fill(T.mem[g], T.len[g], seed, (uint32_t)g, 0);
    if ((rc = sx_agent_register(a, &r, &id)) == 0 && id != (uint32_t)g) {
      fprintf(stderr, "sx-bench target: region ids are not 0.. in order (got %u)\n", id);
      rc = SX_EINVAL;
    }
  }
  if (rc == 0 && (access & SX_ACCESS_REMOTE_WRITE) &&
      (rc = sx_agent_grant_write(a, NULL, NULL)) == 0) /* every writer of the namespace */
    rc = sx_agent_notice_cb(a, take_notice, NULL);
  if (rc == 0)
    rc = sx_agent_publish(a, 0);
  uint16_t port = 0;
  int lfd = rc == 0 ? listen_raw(listen_host, &port) : -1;
  if (rc != 0 || lfd < 0) {
    if (rc)
      fprintf(stderr, "sx-bench target: %s: %s\n", sx_err_name(rc), sx_errmsg());
    else
      fprintf(stderr, "sx-bench target: cannot listen on %s\n", listen_host);
    sx_agent_destroy(a);
    return BX_FAIL;
  }
  pthread_t acc, life;
  pthread_create(&acc, NULL, accept_main, (void *)(intptr_t)lfd);
  pthread_detach(acc);
  pthread_create(&life, NULL, lifeline_main, NULL);
  pthread_detach(life);
  printf("ready %u\n", port);
  fflush(stdout);
  while (!T.quit)
    usleep(20000);
  sx_agent_destroy(a);
  /* Stream threads may still be sending from the pool: leave it mapped. */
  return BX_OK;
}
