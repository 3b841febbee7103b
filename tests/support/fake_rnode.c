/* Fake Redis Cluster nodes (see fake_rnode.h). */
#include <arpa/inet.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fake_rnode.h"
#include "redis/redis.h"
#include "sxtest.h"

#define MAX_CLIENTS 32

typedef struct client {
  int fd, node;
  redisReader *rd;
} client;

static int is(const redisReply *a, const char *s) {
  return a->type == REDIS_REPLY_STRING && strcasecmp(a->str, s) == 0;
}

static void out(int fd, const char *s, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, s, n, MSG_NOSIGNAL);
    if (w <= 0)
      return;
    s += w;
    n -= (size_t)w;
  }
}

/* The answer to one command r on node k. */
static void answer(sxt_fake_rnodes *f, int k, int fd, const redisReply *r) {
  char buf[1024];
  sxt_fake_rnode *n = &f->node[k];
  if (r->type != REDIS_REPLY_ARRAY || r->elements == 0) {
    out(fd, "-ERR bad request\r\n", 18);
    return;
  }
  const redisReply *c = r->element[0];
  if (is(c, "CLUSTER") && r->elements > 1 && is(r->element[1], "SHARDS")) {
    if (n->shards != NULL) {
      out(fd, n->shards, strlen(n->shards));
      return;
    }
    int len = snprintf(buf, sizeof(buf),
                       "*1\r\n*4\r\n$5\r\nslots\r\n*2\r\n:0\r\n:16383\r\n$5\r\nnodes\r\n"
                       "*1\r\n*8\r\n$4\r\nport\r\n:%d\r\n$2\r\nip\r\n$9\r\n127.0.0.1\r\n"
                       "$4\r\nrole\r\n$6\r\nmaster\r\n$6\r\nhealth\r\n$6\r\nonline\r\n",
                       n->port);
    out(fd, buf, (size_t)len);
  } else if (is(c, "SCRIPT")) {
    out(fd, "$40\r\n0123456789012345678901234567890123456789\r\n", 47);
  } else if (is(c, "AUTH") || is(c, "ASKING") || is(c, "PING")) {
    out(fd, "+OK\r\n", 5);
  } else {
    /* The answer with %s replaced by the slot of the command's key and
     * %p by the other node's port. */
    unsigned slot = r->elements > 1 && r->element[1]->type == REDIS_REPLY_STRING
                        ? sx__rcl_key_slot(r->element[1]->str, r->element[1]->len)
                        : 0;
    size_t len = 0;
    for (const char *a = n->answer; *a && len < sizeof(buf) - 8; a++) {
      if (a[0] == '%' && (a[1] == 's' || a[1] == 'p')) {
        len += (size_t)snprintf(buf + len, sizeof(buf) - len, "%u",
                                a[1] == 's' ? slot : (unsigned)f->node[k ^ 1].port);
        a++;
      } else {
        buf[len++] = *a;
      }
    }
    atomic_fetch_add(&n->others, 1);
    out(fd, buf, len);
  }
}

static void *serve(void *arg) {
  sxt_fake_rnodes *f = arg;
  client cl[MAX_CLIENTS];
  int ncl = 0;
  for (;;) {
    struct pollfd pf[1 + SXT_FAKE_RNODES + MAX_CLIENTS];
    int np = 0;
    pf[np++] = (struct pollfd){.fd = f->stop_fd[0], .events = POLLIN};
    for (int k = 0; k < SXT_FAKE_RNODES; k++)
      pf[np++] = (struct pollfd){.fd = f->node[k].lfd, .events = POLLIN};
    for (int i = 0; i < ncl; i++)
      pf[np++] = (struct pollfd){.fd = cl[i].fd, .events = POLLIN};
    if (poll(pf, (nfds_t)np, 1000) < 0)
      continue;
    if (pf[0].revents)
      break;
    for (int k = 0; k < SXT_FAKE_RNODES; k++) {
      if (!(pf[1 + k].revents & POLLIN))
        continue;
      int fd = accept(f->node[k].lfd, NULL, NULL);
      if (fd < 0)
        continue;
      int one = 1; /* each answer goes out at once, as a real node's */
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      if (ncl == MAX_CLIENTS) {
        close(fd);
        continue;
      }
      cl[ncl++] = (client){.fd = fd, .node = k, .rd = redisReaderCreate()};
    }
    /* Only the clients polled above (accepting appended new ones). */
    for (int i = np - 1 - SXT_FAKE_RNODES; i-- > 0;) {
      if (!pf[1 + SXT_FAKE_RNODES + i].revents)
        continue;
      char buf[16384];
      ssize_t n = recv(cl[i].fd, buf, sizeof(buf), 0);
      void *r = NULL;
      int bad = n <= 0 || redisReaderFeed(cl[i].rd, buf, (size_t)n) != REDIS_OK;
      while (!bad && redisReaderGetReply(cl[i].rd, &r) == REDIS_OK && r != NULL) {
        answer(f, cl[i].node, cl[i].fd, r);
        freeReplyObject(r);
        r = NULL;
      }
      if (bad) {
        close(cl[i].fd);
        redisReaderFree(cl[i].rd);
        cl[i] = cl[--ncl];
      }
    }
  }
  for (int i = 0; i < ncl; i++) {
    close(cl[i].fd);
    redisReaderFree(cl[i].rd);
  }
  return NULL;
}

void sxt_fake_rnodes_start(sxt_fake_rnodes *f, const char *answer_fmt) {
  memset(f, 0, sizeof(*f));
  assert_int_equal(pipe(f->stop_fd), 0);
  for (int k = 0; k < SXT_FAKE_RNODES; k++) {
    sxt_fake_rnode *n = &f->node[k];
    n->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(bind(n->lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(n->lfd, 16), 0);
    socklen_t sl = sizeof(sa);
    getsockname(n->lfd, (struct sockaddr *)&sa, &sl);
    n->port = ntohs(sa.sin_port);
    snprintf(n->answer, sizeof(n->answer), "%s", answer_fmt);
  }
  assert_int_equal(pthread_create(&f->th, NULL, serve, f), 0);
}

void sxt_fake_rnodes_stop(sxt_fake_rnodes *f) {
  ssize_t w = write(f->stop_fd[1], "x", 1);
  (void)w;
  pthread_join(f->th, NULL);
  for (int k = 0; k < SXT_FAKE_RNODES; k++)
    close(f->node[k].lfd);
  close(f->stop_fd[0]);
  close(f->stop_fd[1]);
}
