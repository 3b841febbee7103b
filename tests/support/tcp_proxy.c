/*
 * The TCP proxy thread of the TCP transport's tests (tcp_proxy.h).
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "ports.h"
#include "tcp_proxy.h"

static void pair_close(sxt_proxy *p, int i) {
  close(p->fd[i][0]);
  close(p->fd[i][1]);
  p->n--;
  p->fd[i][0] = p->fd[p->n][0];
  p->fd[i][1] = p->fd[p->n][1];
  p->limited[i] = p->limited[p->n];
}

static void proxy_accept(sxt_proxy *p) {
  int c = accept(p->lfd, NULL, NULL);
  if (c < 0)
    return;
  struct sockaddr_in up = {.sin_family = AF_INET, .sin_port = htons(p->port)};
  inet_pton(AF_INET, "127.0.0.1", &up.sin_addr);
  int u = p->dead || p->n == SXT_PROXY_PAIRS ? -1 : socket(AF_INET, SOCK_STREAM, 0);
  if (u >= 0 && p->o.up_rcvbuf > 0)
    setsockopt(u, SOL_SOCKET, SO_RCVBUF, &p->o.up_rcvbuf, sizeof(p->o.up_rcvbuf));
  if (u < 0 || connect(u, (struct sockaddr *)&up, sizeof(up)) != 0) {
    close(c);
    if (u >= 0)
      close(u);
    return;
  }
  int one = 1;
  setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(u, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  p->fd[p->n][0] = c;
  p->fd[p->n][1] = u;
  p->limited[p->n] = !p->o.first_only || p->accepted == 0;
  p->accepted++;
  p->n++;
}

/* Reply bytes that may pass now before a stall; -1: no limit. */
static long long stall_room(sxt_proxy *p) {
  long long at = __atomic_load_n(&p->stall_after, __ATOMIC_ACQUIRE);
  return at < 0 ? -1 : at > p->down ? at - p->down : 0;
}

/* Move what one side of pair i has to the other: 0, or -1 (pair closed). */
static int proxy_move(sxt_proxy *p, int i, int from_up, unsigned *seed) {
  uint8_t *buf = p->buf;
  size_t want = sizeof(p->buf);
  int limited = from_up && p->limited[i];
  if (from_up && p->o.trickle)
    want = 1 + rand_r(seed) % 1500;
  long long room = limited ? stall_room(p) : -1;
  if (room == 0)
    return 0;
  if (room > 0 && (long long)want > room)
    want = (size_t)room;
  ssize_t k = recv(p->fd[i][from_up], buf, want, 0);
  if (k <= 0)
    return -1;
  long long cut = p->o.cut_after;
  if (limited && cut >= 0 && p->down + k >= cut) {
    /* The peer dies here: what fits goes out, then every connection. */
    sxt_wire_send(p->fd[i][0], buf, (size_t)(cut - p->down));
    __atomic_store_n(&p->down, cut, __ATOMIC_RELEASE);
    __atomic_store_n(&p->dead, 1, __ATOMIC_RELEASE);
    return -1;
  }
  if (sxt_wire_send(p->fd[i][!from_up], buf, (size_t)k) != 0)
    return -1;
  if (limited)
    __atomic_store_n(&p->down, p->down + k, __ATOMIC_RELEASE);
  if (from_up && p->o.trickle)
    usleep(30);
  return 0;
}

static void *proxy_run(void *arg) {
  sxt_proxy *p = arg;
  unsigned seed = 7;
  while (!__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) {
    struct pollfd pf[1 + 2 * SXT_PROXY_PAIRS];
    int stalled = stall_room(p) == 0;
    pf[0] = (struct pollfd){.fd = p->lfd, .events = POLLIN};
    for (int i = 0; i < p->n; i++) {
      pf[1 + 2 * i] = (struct pollfd){.fd = p->fd[i][0], .events = POLLIN};
      /* Stalled: replies stay where they are (a negative fd is skipped). */
      pf[2 + 2 * i] = (struct pollfd){.fd = stalled && p->limited[i] ? -1 : p->fd[i][1],
                                      .events = POLLIN};
    }
    int n = p->n;
    if (poll(pf, (nfds_t)(1 + 2 * n), stalled ? 10 : 50) <= 0)
      continue;
    for (int i = n - 1; i >= 0; i--) {
      int bad = 0;
      for (int side = 0; side < 2 && !bad; side++)
        if (pf[1 + 2 * i + side].revents & (POLLIN | POLLHUP | POLLERR))
          bad = proxy_move(p, i, side, &seed) != 0;
      if (bad)
        pair_close(p, i);
    }
    if (p->dead)
      while (p->n > 0)
        pair_close(p, 0);
    if (pf[0].revents & POLLIN)
      proxy_accept(p);
  }
  while (p->n > 0)
    pair_close(p, 0);
  return NULL;
}

void sxt_proxy_start(sxt_proxy *p, const sxt_proxy_opts *o) {
  memset(p, 0, sizeof(*p));
  p->o = *o;
  p->stall_after = o->stall_after;
  for (int tries = 0; tries < 20; tries++) {
    int port = sxt_free_port();
    assert_true(port > 0);
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.2", &a.sin_addr);
    if (bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 && listen(fd, 16) == 0) {
      p->lfd = fd;
      p->port = (uint16_t)port;
      assert_int_equal(pthread_create(&p->th, NULL, proxy_run, p), 0);
      return;
    }
    close(fd);
  }
  fail_msg("no port for the proxy on 127.0.0.2");
}

int sxt_proxy_wait_down(sxt_proxy *p, long long bytes, int ms) {
  for (int i = 0; i < ms; i++) {
    if (__atomic_load_n(&p->down, __ATOMIC_ACQUIRE) >= bytes)
      return 0;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  return -1;
}

void sxt_proxy_release(sxt_proxy *p) { __atomic_store_n(&p->stall_after, -1, __ATOMIC_RELEASE); }

void sxt_proxy_stop(sxt_proxy *p) {
  __atomic_store_n(&p->stop, 1, __ATOMIC_RELEASE);
  pthread_join(p->th, NULL);
  close(p->lfd);
}
