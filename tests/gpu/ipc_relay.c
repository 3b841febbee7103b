/*
 * The lying target's relay (ipc_relay.h): one thread, polling the
 * listener and each pair of connections, relaying whole frames of the
 * target's so that a record is rewritten before any byte of it goes on.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "internal.h"
#include "ipc_relay.h"
#include "transport/cuda/cuda_ipc.h"


static void put64be(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (56 - 8 * i));
}

/* Each whole frame of buf (n bytes) to fn(r, frame, header, arg), which
 * says -1 to stop; returns the bytes of whole frames, or -1. */
static ssize_t relay_walk(relay *r, uint8_t *buf, size_t n,
                          int (*fn)(relay *r, uint8_t *frame, const sx__frame *f, void *arg),
                          void *arg) {
  size_t off = 0;
  for (;;) {
    sx__frame f;
    int rc = sx__frame_decode(buf + off, n - off, &f);
    if (rc < 0)
      return -1;
    if (rc == 0 || n - off < SX__FRAME_HDR + f.length)
      return (ssize_t)off;
    if (fn(r, buf + off, &f, arg) != 0)
      return -1;
    off += SX__FRAME_HDR + (size_t)f.length;
  }
}

/* A frame of the target's to the reader (fd in *arg), records rewritten. */
static int relay_frame(relay *r, uint8_t *frame, const sx__frame *f, void *arg) {
  uint8_t *body = frame + SX__FRAME_HDR;
  if (f->type == SX__FRAME_IPC_REPLY && f->id != 0 && f->status == 0) {
    for (uint64_t k = 0; k < f->length / SX__IPC_RECORD; k++) {
      uint8_t *b = body + k * SX__IPC_RECORD;
      sx__ipc_record rec;
      sx__ipc_record_decode(b, &rec);
      if (rec.status != 0)
        continue;
      put64be(b + 8, rec.alloc + r->shift);
      put64be(b + 16, rec.offset + r->shift);
      put64be(b + 24, rec.base - r->shift);
      r->rewritten++;
    }
  }
  return sxt_wire_send(*(int *)arg, frame, SX__FRAME_HDR + (size_t)f->length) != 0 ? -1 : 0;
}

static ssize_t relay_frames(relay *r, int fd, uint8_t *buf, size_t n) {
  return relay_walk(r, buf, n, relay_frame, &fd);
}

/* A frame the reader sent, noted: *arg (int) when it asks for handles,
 * the ids it gives back in r->given. */
static int relay_note(relay *r, uint8_t *frame, const sx__frame *f, void *arg) {
  const uint8_t *body = frame + SX__FRAME_HDR;
  if (f->type == SX__FRAME_IPC && f->id != 0)
    *(int *)arg = 1;
  if (f->type == SX__FRAME_IPC && f->id == 0) {
    unsigned g = __atomic_load_n(&r->n_given, __ATOMIC_RELAXED);
    for (uint64_t k = 0; k < f->length / 4 && g < 64; k++)
      r->given[g++] = (uint32_t)body[4 * k] << 24 | (uint32_t)body[4 * k + 1] << 16 |
                      (uint32_t)body[4 * k + 2] << 8 | body[4 * k + 3];
    __atomic_store_n(&r->n_given, g, __ATOMIC_RELEASE);
    __atomic_add_fetch(&r->give_frames, 1, __ATOMIC_RELEASE);
  }
  return 0;
}

static void relay_inject(relay *r, int fd) {
  uint8_t b[SX__FRAME_HDR + 4 * 8];
  sx__frame f = {.type = SX__FRAME_IPC_REPLY, .id = 0, .length = 4 * (uint64_t)r->n_inject};
  sx__frame_encode(&f, b);
  for (unsigned k = 0; k < r->n_inject; k++)
    for (int j = 0; j < 4; j++)
      b[SX__FRAME_HDR + 4 * k + (unsigned)j] = (uint8_t)(r->inject[k] >> (24 - 8 * j));
  (void)sxt_wire_send(fd, b, SX__FRAME_HDR + 4 * (size_t)r->n_inject);
}

static void *relay_main(void *arg) {
  relay *r = arg;
  enum { PAIRS = 8, CAP = 1 << 18 };
  int rd[PAIRS], tg[PAIRS], ipc[PAIRS], injected[PAIRS];
  size_t tlen[PAIRS];
  ssize_t rlen[PAIRS]; /* -1: not followed */
  uint8_t *tbuf = malloc((size_t)PAIRS * CAP), *rbuf = malloc((size_t)PAIRS * CAP);
  for (int i = 0; i < PAIRS; i++)
    rd[i] = tg[i] = -1;
  while (!__atomic_load_n(&r->stop, __ATOMIC_RELAXED)) {
    struct pollfd pf[1 + 2 * PAIRS];
    int np = 0;
    pf[np++] = (struct pollfd){.fd = r->lfd, .events = POLLIN};
    for (int i = 0; i < PAIRS; i++) {
      pf[np++] = (struct pollfd){.fd = rd[i], .events = POLLIN};
      pf[np++] = (struct pollfd){.fd = tg[i], .events = POLLIN};
    }
    if (poll(pf, (nfds_t)np, 50) < 0)
      continue; /* on a timeout, an injection may still be due */
    if (pf[0].revents & POLLIN) {
      int c = accept(r->lfd, NULL, NULL);
      int i = 0;
      while (i < PAIRS && rd[i] >= 0)
        i++;
      struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(r->port)};
      inet_pton(AF_INET, "127.0.0.2", &sa.sin_addr);
      int t = socket(AF_INET, SOCK_STREAM, 0);
      if (c < 0 || i == PAIRS || connect(t, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        close(c);
        close(t);
      } else {
        rd[i] = c, tg[i] = t, tlen[i] = 0, rlen[i] = 0, ipc[i] = injected[i] = 0;
      }
    }
    for (int i = 0; i < PAIRS; i++) {
      int broken = 0;
      if (rd[i] >= 0 && (pf[1 + 2 * i].revents & (POLLIN | POLLHUP | POLLERR))) {
        uint8_t b[65536];
        ssize_t n = recv(rd[i], b, sizeof(b), 0);
        broken = n <= 0 || sxt_wire_send(tg[i], b, (size_t)n) != 0;
        if (!broken && rlen[i] >= 0 && (size_t)(rlen[i] + n) <= CAP) {
          uint8_t *q = rbuf + (size_t)i * CAP;
          memcpy(q + rlen[i], b, (size_t)n);
          ssize_t used = relay_walk(r, q, (size_t)(rlen[i] + n), relay_note, &ipc[i]);
          if (used >= 0) {
            rlen[i] += n - used;
            memmove(q, q + used, (size_t)rlen[i]);
          } else {
            rlen[i] = -1;
          }
        } else {
          rlen[i] = -1;
        }
      }
      /* Between whole frames of the target's (relay_frames sends only those). */
      if (!broken && rd[i] >= 0 && ipc[i] && !injected[i] &&
          __atomic_load_n(&r->inject_go, __ATOMIC_ACQUIRE)) {
        relay_inject(r, rd[i]);
        injected[i] = 1;
      }
      if (!broken && rd[i] >= 0 && (pf[2 + 2 * i].revents & (POLLIN | POLLHUP | POLLERR))) {
        uint8_t *b = tbuf + (size_t)i * CAP;
        ssize_t n = recv(tg[i], b + tlen[i], CAP - tlen[i], 0);
        ssize_t used = n <= 0 ? -1 : relay_frames(r, rd[i], b, tlen[i] + (size_t)n);
        if (used < 0) {
          broken = 1;
        } else {
          tlen[i] += (size_t)n - (size_t)used;
          memmove(b, b + used, tlen[i]);
        }
      }
      if (broken) {
        close(rd[i]);
        close(tg[i]);
        rd[i] = tg[i] = -1;
      }
    }
  }
  for (int i = 0; i < PAIRS; i++)
    if (rd[i] >= 0)
      close(rd[i]), close(tg[i]);
  free(tbuf);
  free(rbuf);
  return NULL;
}

void relay_stop(relay *r) {
  __atomic_store_n(&r->stop, 1, __ATOMIC_RELAXED);
  pthread_join(r->th, NULL);
  close(r->lfd);
}

int relay_start(relay *r, uint16_t port, uint64_t shift) {
  memset(r, 0, sizeof(*r));
  r->port = port;
  r->shift = shift;
  r->lfd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(r->lfd >= 0);
  int one = 1;
  setsockopt(r->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port),
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  if (bind(r->lfd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
    close(r->lfd);
    return -1; /* the port is taken on 127.0.0.1 */
  }
  assert_int_equal(listen(r->lfd, 8), 0);
  assert_int_equal(pthread_create(&r->th, NULL, relay_main, r), 0);
  return 0;
}
