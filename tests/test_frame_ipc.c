/*
 * The CUDA IPC frames (types 5 and 6, transport/conn/frame.h) without a GPU: header
 * rules, the record codec, and what a target does with IPC requests from
 * the network: refused before HELLO, host and unknown regions answered
 * with a per-region error, malformed bodies closing the connection, an
 * agent that does not serve cuda_ipc refusing the whole request.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "internal.h"
#include "transport/cuda/cuda_ipc.h"

static void test_frame_ipc_header_rules(void **state) {
  (void)state;
  uint8_t b[SX__FRAME_HDR];
  sx__frame g, f = {.type = SX__FRAME_IPC, .id = 3, .length = 8};
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX__FRAME_HDR);
  assert_int_equal(g.type, SX__FRAME_IPC);
  const uint64_t bad_ipc[] = {0, 3, 4u * SX__IPC_MAX_IDS + 4, UINT64_MAX};
  for (size_t i = 0; i < SX__ARRAY_SIZE(bad_ipc); i++) {
    f.length = bad_ipc[i];
    sx__frame_encode(&f, b);
    assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  }
  f = (sx__frame){.type = SX__FRAME_IPC, .length = 4, .status = SX_EINVAL};
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  /* Replies: records (id != 0), region ids (id 0), or an error alone. */
  f = (sx__frame){.type = SX__FRAME_IPC_REPLY, .id = 1, .length = 2 * SX__IPC_RECORD};
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX__FRAME_HDR);
  f.length = SX__IPC_RECORD + 4;
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  f.length = (uint64_t)SX__IPC_RECORD * (SX__IPC_MAX_IDS + 1);
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  f = (sx__frame){.type = SX__FRAME_IPC_REPLY, .id = 0, .length = 8};
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX__FRAME_HDR);
  f.length = 0;
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  f = (sx__frame){.type = SX__FRAME_IPC_REPLY, .id = 1, .status = SX_ENOTSUP, .length = 4};
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX_EPROTO);
  f.length = 0;
  sx__frame_encode(&f, b);
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX__FRAME_HDR);
}

static void test_frame_ipc_record_codec(void **state) {
  (void)state;
  sx__ipc_record r = {.region = 0x01020304, .status = SX_ENOREGION,
                      .alloc = 0x1122334455667788ull, .offset = 4096,
                      .base = 0x7f0000000000ull}, back;
  for (int i = 0; i < 64; i++)
    r.handle[i] = (uint8_t)(i * 7);
  uint8_t b[SX__IPC_RECORD];
  sx__ipc_record_encode(&r, b);
  assert_int_equal(b[0], 1); /* big-endian */
  assert_int_equal(b[3], 4);
  sx__ipc_record_decode(b, &back);
  assert_memory_equal(&r, &back, sizeof(r));
}

/* ------------------------------------------------------------ wire */

static void send_ipc(int fd, uint64_t id, const uint32_t *ids, uint32_t n,
                     uint64_t length) {
  uint8_t buf[SX__FRAME_HDR + 64];
  sx__frame f = {.type = SX__FRAME_IPC, .id = id, .length = length};
  sx__frame_encode(&f, buf);
  for (uint32_t i = 0; i < n; i++) {
    uint8_t *p = buf + SX__FRAME_HDR + 4 * i;
    p[0] = (uint8_t)(ids[i] >> 24), p[1] = (uint8_t)(ids[i] >> 16);
    p[2] = (uint8_t)(ids[i] >> 8), p[3] = (uint8_t)ids[i];
  }
  assert_true(send(fd, buf, SX__FRAME_HDR + 4 * n, MSG_NOSIGNAL) ==
              (ssize_t)(SX__FRAME_HDR + 4 * n));
}

static void recv_n(int fd, void *p, size_t n) {
  uint8_t *b = p;
  while (n > 0) {
    ssize_t r = recv(fd, b, n, 0);
    assert_true(r > 0);
    b += r;
    n -= (size_t)r;
  }
}

static void wire_target(sxt_agent *t, unsigned transports, char *url, size_t size,
                        uint16_t *port, sx_desc *d) {
  static int seq;
  snprintf(url, size, "mem://ipc-wire-%d-%d", (int)getpid(), seq++);
  memset(t, 0, sizeof(*t));
  sx_agent_params p;
  sxt_params(&p, url, "ipc-wire");
  p.listen = "127.0.0.1:0";
  p.transports = transports;
  sxt_ok(sx_agent_create(&p, &t->a));
  t->mem[0] = calloc(1, 65536);
  sx_region_params rp = {.addr = t->mem[0], .length = 65536, .block_bytes = 4096,
                         .num_blocks = 16, .access = SX_ACCESS_REMOTE_READ};
  sxt_ok(sx_agent_register(t->a, &rp, &t->id[0]));
  sxt_ok(sx_agent_publish(t->a, 0));
  sxt_ok(sx_agent_descriptor(t->a, d));
  *port = sxt_tcp_port(d);
}

static void test_frame_ipc_served_without_gpu(void **state) {
  (void)state;
  char url[64];
  sxt_agent t;
  uint16_t port;
  sx_desc d;
  wire_target(&t, SX_TRANSPORTS_ALL, url, sizeof(url), &port, &d);
  /* Before HELLO: a protocol violation, the connection closes. */
  int fd = sxt_wire_connect(port);
  uint32_t ids[2] = {t.id[0], 999};
  send_ipc(fd, 1, ids, 2, 8);
  assert_true(sxt_wire_closed(fd));
  close(fd);
  /* After HELLO: host memory and an unknown region, one record each. */
  fd = sxt_wire_connect(port);
  assert_int_equal(sxt_wire_hello(fd, d.incarnation, d.token, "probe"), 0);
  send_ipc(fd, 7, ids, 2, 8);
  uint8_t hdr[SX__FRAME_HDR], body[2 * SX__IPC_RECORD];
  recv_n(fd, hdr, sizeof(hdr));
  sx__frame g;
  assert_int_equal(sx__frame_decode(hdr, sizeof(hdr), &g), SX__FRAME_HDR);
  assert_int_equal(g.type, SX__FRAME_IPC_REPLY);
  assert_true(g.id == 7 && g.status == 0 && g.length == sizeof(body));
  recv_n(fd, body, sizeof(body));
  sx__ipc_record r;
  sx__ipc_record_decode(body, &r);
  assert_int_equal(r.region, t.id[0]);
  assert_int_equal(r.status, SX_EINVAL); /* host memory: no handle */
  uint8_t zero[64] = {0};
  assert_memory_equal(r.handle, zero, 64);
  sx__ipc_record_decode(body + SX__IPC_RECORD, &r);
  assert_int_equal(r.region, 999);
  assert_int_equal(r.status, SX_ENOREGION);
  /* Giving back what was never lent is harmless; reads still work. */
  send_ipc(fd, 0, ids, 1, 4);
  uint8_t buf[64];
  assert_int_equal(sxt_wire_read(fd, 8, t.id[0], 0, 64, buf), 0);
  /* A body that is no whole number of ids: the connection closes. */
  send_ipc(fd, 9, ids, 1, 6);
  assert_true(sxt_wire_closed(fd));
  close(fd);
  sx_desc_free(&d);
  sxt_agent_stop(&t);
  /* An agent that does not serve cuda_ipc refuses the whole request. */
  wire_target(&t, SX_TRANSPORTS_TCP, url, sizeof(url), &port, &d);
  fd = sxt_wire_connect(port);
  assert_int_equal(sxt_wire_hello(fd, d.incarnation, d.token, "probe"), 0);
  send_ipc(fd, 5, ids, 1, 4);
  recv_n(fd, hdr, sizeof(hdr));
  assert_int_equal(sx__frame_decode(hdr, sizeof(hdr), &g), SX__FRAME_HDR);
  assert_true(g.id == 5 && g.status == SX_ENOTSUP && g.length == 0);
  close(fd);
  sx_desc_free(&d);
  sxt_agent_stop(&t);
}

static long rss_kib(void) {
  long pages = 0, rss = 0;
  FILE *f = fopen("/proc/self/statm", "r");
  if (f != NULL) {
    if (fscanf(f, "%ld %ld", &pages, &rss) != 2)
      rss = 0;
    fclose(f);
  }
  return rss * (sysconf(_SC_PAGESIZE) / 1024);
}

/* A reader that asks for handles and never reads the answers: each IPC
 * request of 1024 ids is answered with 24 times its size, so the target
 * must stop reading it (as it does for READs) instead of queueing answers
 * without bound. */
static void test_frame_ipc_requests_pushed_back(void **state) {
  (void)state;
  char url[64];
  sxt_agent t;
  uint16_t port;
  sx_desc d;
  wire_target(&t, SX_TRANSPORTS_ALL, url, sizeof(url), &port, &d);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  int small = 4096;
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port),
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
  assert_int_equal(sxt_wire_hello(fd, d.incarnation, d.token, "greedy"), 0);
  static uint8_t req[SX__FRAME_HDR + 4 * SX__IPC_MAX_IDS];
  sx__frame f = {.type = SX__FRAME_IPC, .id = 1, .length = 4 * SX__IPC_MAX_IDS};
  sx__frame_encode(&f, req);
  memset(req + SX__FRAME_HDR, 0xee, 4 * SX__IPC_MAX_IDS); /* no such regions */
  long before = rss_kib();
  size_t sent = 0, off = 0;
  while (sent < (8u << 20)) {
    ssize_t n = send(fd, req + off, sizeof(req) - off, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) {
      struct pollfd pf = {.fd = fd, .events = POLLOUT};
      if (poll(&pf, 1, 1000) <= 0)
        break; /* pushed back: the target stopped reading */
      continue;
    }
    sent += (size_t)n;
    off = (off + (size_t)n) % sizeof(req);
  }
  long grown = rss_kib() - before;
  print_message("sent %zu bytes of IPC requests; the process grew by %ld KiB\n", sent, grown);
  assert_true(sent < (8u << 20));
  assert_true(grown < 32 * 1024);
  close(fd);
  sx_desc_free(&d);
  sxt_agent_stop(&t);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN); /* the target writes to readers that went away */
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_frame_ipc_header_rules),
      cmocka_unit_test(test_frame_ipc_record_codec),
      cmocka_unit_test(test_frame_ipc_served_without_gpu),
      cmocka_unit_test(test_frame_ipc_requests_pushed_back),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
