/* Agent fixtures for tests (see agent_fixture.h). */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "backend.h"
#include "internal.h"
#include "pattern.h"
#include "transport/conn/frame.h"

static void quiet_log(void *arg, sx_log_level level, const char *msg) {
  (void)arg;
  if (level <= SX_LOG_WARN || getenv("SXT_VERBOSE"))
    fprintf(stderr, "  [agent %s] %s\n", level == SX_LOG_ERROR ? "ERROR" :
            level == SX_LOG_WARN ? "WARN" : level == SX_LOG_INFO ? "INFO" : "DEBUG", msg);
}

void sxt_params(sx_agent_params *p, const char *url, const char *name) {
  sx_agent_params_init(p);
  p->name = name;
  p->metadata_url = url;
  p->lease_ms = 2000;
  snprintf(p->layout.fingerprint, sizeof(p->layout.fingerprint), "llama-test/v1");
  snprintf(p->layout.tag, sizeof(p->layout.tag), "NHD");
  snprintf(p->layout.dtype, sizeof(p->layout.dtype), "bf16");
  p->log = quiet_log;
  p->log_level = getenv("SXT_VERBOSE") ? SX_LOG_DEBUG : SX_LOG_WARN;
}

static void register_kv(sxt_agent *t, uint64_t blocks) {
  sxt_register_kv(t, blocks, SX_ACCESS_REMOTE_READ);
}

void sxt_register_kv(sxt_agent *t, uint64_t blocks, uint32_t access) {
  uint64_t layer_bytes = blocks * SXT_BLOCK;
  t->blocks = blocks;
  for (int s = 0; s < 2; s++) {
    t->mem[s] = calloc(SXT_LAYERS, layer_bytes);
    assert_non_null(t->mem[s]);
    sx_region_params rp = {.addr = t->mem[s], .length = SXT_LAYERS * layer_bytes,
                           .layer_count = SXT_LAYERS, .layer_stride = layer_bytes,
                           .slot = (uint32_t)s, .block_bytes = SXT_BLOCK,
                           .num_blocks = blocks, .access = access};
    sxt_ok(sx_agent_register(t->a, &rp, &t->id[s]));
  }
}

void sxt_target_start(sxt_agent *t, const char *url, const char *name,
                      const char *listen, uint64_t seed) {
  memset(t, 0, sizeof(*t));
  sx_agent_params p;
  sxt_params(&p, url, name);
  p.listen = listen ? listen : "127.0.0.1:0";
  sxt_ok(sx_agent_create(&p, &t->a));
  register_kv(t, SXT_TARGET_BLOCKS);
  t->seed = seed;
  for (int s = 0; s < 2; s++)
    sx__pattern_fill(t->mem[s], SXT_LAYERS * SXT_TARGET_BLOCKS * SXT_BLOCK, seed, t->id[s],
                     0);
  sxt_ok(sx_agent_publish(t->a, 0));
}

void sxt_reader_start(sxt_agent *r, const char *url, const char *name) {
  memset(r, 0, sizeof(*r));
  sx_agent_params p;
  sxt_params(&p, url, name);
  sxt_ok(sx_agent_create(&p, &r->a));
  register_kv(r, SXT_READER_BLOCKS);
}

void sxt_agent_stop(sxt_agent *t) {
  sx_agent_destroy(t->a);
  t->a = NULL;
  free(t->mem[0]);
  free(t->mem[1]);
  t->mem[0] = t->mem[1] = NULL;
}

int sxt_verify(uint8_t *const *mem, uint64_t local_blocks, const sx_segment *seg,
               uint64_t seed, const sx_block_read *e) {
  const sx_desc *d = sx_segment_desc(seg);
  for (uint32_t l = e->layer_first; l < e->layer_first + e->layer_count; l++) {
    for (uint64_t m = e->slots; m; m &= m - 1) {
      uint32_t s = (uint32_t)__builtin_ctzll(m);
      const sx_region *R = sx_desc_find(d, e->group, l, s);
      if (R == NULL) {
        print_error("no remote region for layer %u slot %u\n", l, s);
        return -1;
      }
      const uint8_t *local = mem[s] + ((uint64_t)l * local_blocks + e->local_block) *
                                          R->block_bytes;
      uint64_t off = (l - R->layer_first) * R->layer_stride +
                     e->remote_block * R->block_stride;
      uint64_t bad;
      if (sx__pattern_check(local, e->count * R->block_bytes, seed, R->id, off, &bad)) {
        print_error("layer %u slot %u blocks %lu->%lu x%lu: byte %lu differs\n", l, s,
                    (unsigned long)e->remote_block, (unsigned long)e->local_block,
                    (unsigned long)e->count, (unsigned long)bad);
        return -1;
      }
    }
  }
  return 0;
}

int sxt_verify_blocks(const sxt_agent *reader, const sx_segment *seg, uint64_t seed,
                      const sx_block_read *r) {
  return sxt_verify(reader->mem, reader->blocks, seg, seed, r);
}

/* ------------------------------------------------------------ batches */

static sx_batch *submit(sx_segment *s, const sx_block_read *e, size_t n, unsigned flags,
                        uint64_t tag, uint32_t timeout_ms) {
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = timeout_ms;
  bp.flags = flags;
  bp.tag = tag;
  sx_batch *b;
  sxt_ok(sx_batch_create(s, &bp, &b));
  sxt_ok(sx_batch_add_blocks(b, e, n));
  sxt_ok(sx_batch_submit(b));
  return b;
}

sx_batch *sxt_batch_submit(sx_segment *s, const sx_block_read *e, size_t n,
                           uint32_t timeout_ms) {
  return submit(s, e, n, 0, 0, timeout_ms);
}

sx_batch *sxt_notify_submit(sx_segment *s, const sx_block_read *e, size_t n, uint64_t tag,
                            uint32_t timeout_ms) {
  return submit(s, e, n, SX_BATCH_NOTIFY, tag, timeout_ms);
}

sx_batch_result sxt_batch_finish(sx_batch *b) {
  sxt_ok(sx_batch_wait(b, -1));
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  res.failed = NULL; /* not valid after destroy; n_failed still counts them */
  sx_batch_destroy(b);
  return res;
}

sx_batch_result sxt_run_batch(sx_segment *s, const sx_block_read *e, size_t n,
                              uint32_t timeout_ms) {
  return sxt_batch_finish(sxt_batch_submit(s, e, n, timeout_ms));
}

/* ------------------------------------------------------------ store */

typedef struct pub_state {
  int done, status;
} pub_state;

static void pub_cb(void *arg, const sx_backend_reply *rep) {
  pub_state *s = arg;
  s->status = rep->status;
  s->done = 1;
}

void sxt_mem_url(char *url, size_t size, const char *prefix) {
  static int seq;
  snprintf(url, size, "mem://%s-%d-%d", prefix, (int)getpid(), seq++);
}

void sxt_store_publish(const char *url, const sx_desc *d) {
  uv_loop_t loop;
  sx_backend *b;
  assert_int_equal(uv_loop_init(&loop), 0);
  sxt_ok(sx__backend_open(&loop, url, NULL, &b));
  uint8_t *buf;
  size_t len;
  sxt_ok(sx_desc_encode(d, &buf, &len));
  sx_publish_req req = {.name = d->name, .incarnation = d->incarnation,
                        .generation = d->generation, .value = buf, .len = len,
                        .lease_ms = d->lease_ms, .takeover = 1};
  pub_state st = {0};
  sxt_ok(sx__backend_publish(b, &req, pub_cb, &st));
  while (!st.done)
    uv_run(&loop, UV_RUN_ONCE);
  sxt_ok(st.status);
  free(buf);
  sx__backend_close(b);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* ------------------------------------------------------------ wire */

int sxt_wire_connect(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  assert_true(fd >= 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
  struct timeval tv = {.tv_sec = 5};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

static int send_all(int fd, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n > 0) {
    ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
    if (w <= 0)
      return -1;
    b += w;
    n -= (size_t)w;
  }
  return 0;
}

static int recv_all(int fd, void *p, size_t n) {
  uint8_t *b = p;
  while (n > 0) {
    ssize_t r = recv(fd, b, n, 0);
    if (r <= 0)
      return -1;
    b += r;
    n -= (size_t)r;
  }
  return 0;
}

int sxt_wire_hello_features(int fd, const uint8_t *incarnation, const uint8_t *token,
                            const char *name, uint64_t *features) {
  uint8_t buf[SX__FRAME_HDR + SX__HELLO_MAX];
  sx__hello h;
  memcpy(h.incarnation, incarnation, SX_INCARNATION_LEN);
  memcpy(h.token, token, SX_TOKEN_LEN);
  snprintf(h.name, sizeof(h.name), "%s", name);
  int n = sx__hello_encode(&h, buf + SX__FRAME_HDR, SX__HELLO_MAX);
  sx__frame f = {.type = SX__FRAME_HELLO, .length = (uint64_t)n};
  sx__frame_encode(&f, buf);
  if (send_all(fd, buf, SX__FRAME_HDR + (size_t)n))
    return 1;
  uint8_t rep[SX__FRAME_HDR];
  if (recv_all(fd, rep, sizeof(rep)))
    return 1;
  sx__frame g;
  assert_int_equal(sx__frame_decode(rep, sizeof(rep), &g), SX__FRAME_HDR);
  assert_int_equal(g.type, SX__FRAME_HELLO_REPLY);
  if (features != NULL)
    *features = g.offset;
  return g.status;
}

int sxt_wire_hello(int fd, const uint8_t *incarnation, const uint8_t *token,
                   const char *name) {
  return sxt_wire_hello_features(fd, incarnation, token, name, NULL);
}

int sxt_wire_read(int fd, uint64_t id, uint32_t region, uint64_t offset, uint64_t length,
                  uint8_t *buf) {
  uint8_t b[SX__FRAME_HDR];
  sx__range r = {region, offset, length};
  if (sxt_wire_send_read(fd, id, &r) || recv_all(fd, b, sizeof(b)))
    return 1;
  sx__frame g;
  assert_int_equal(sx__frame_decode(b, sizeof(b), &g), SX__FRAME_HDR);
  assert_int_equal(g.type, SX__FRAME_READ_REPLY);
  assert_true(g.id == id);
  if (g.status != 0)
    return g.status;
  assert_true(g.length == length);
  return recv_all(fd, buf, (size_t)length) ? 1 : 0;
}

int sxt_wire_send_read(int fd, uint64_t id, const sx__range *r) {
  uint8_t b[SX__FRAME_HDR];
  sx__frame f = {.type = SX__FRAME_READ, .id = id, .region = r->region, .offset = r->offset,
                 .length = r->length};
  sx__frame_encode(&f, b);
  return send_all(fd, b, sizeof(b));
}

size_t sxt_wire_readv_encode(uint8_t *b, uint64_t id, const sx__range *r, uint32_t n) {
  assert_true(n >= 1 && n <= SX__READV_MAX);
  sx__frame f = {.type = SX__FRAME_READV, .id = id, .length = (uint64_t)n * SX__READV_ENTRY};
  sx__frame_encode(&f, b);
  for (uint32_t i = 0; i < n; i++)
    sx__range_encode(&r[i], b + SX__FRAME_HDR + i * SX__READV_ENTRY);
  return SX__FRAME_HDR + (size_t)n * SX__READV_ENTRY;
}

int sxt_wire_send_readv(int fd, uint64_t id, const sx__range *r, uint32_t n) {
  uint8_t b[SX__FRAME_HDR + SX__READV_MAX * SX__READV_ENTRY];
  return send_all(fd, b, sxt_wire_readv_encode(b, id, r, n));
}

int sxt_wire_readv(int fd, uint64_t id, const sx__range *r, uint32_t n, uint8_t *buf,
                   uint32_t *index) {
  uint8_t b[SX__FRAME_HDR];
  uint64_t total = 0;
  for (uint32_t i = 0; i < n; i++)
    total += r[i].length;
  if (sxt_wire_send_readv(fd, id, r, n) || recv_all(fd, b, SX__FRAME_HDR))
    return 1;
  sx__frame g;
  assert_int_equal(sx__frame_decode(b, SX__FRAME_HDR, &g), SX__FRAME_HDR);
  assert_int_equal(g.type, SX__FRAME_READ_REPLY);
  assert_true(g.id == id);
  *index = g.region;
  if (g.status != 0)
    return g.status;
  assert_true(g.length == total);
  return recv_all(fd, buf, (size_t)total) ? 1 : 0;
}

int sxt_wire_closed(int fd) {
  uint8_t b[64];
  for (;;) {
    ssize_t r = recv(fd, b, sizeof(b), 0);
    if (r == 0)
      return 1;
    if (r < 0)
      return errno == ECONNRESET;
  }
}

uint16_t sxt_tcp_port(const sx_desc *d) {
  for (uint32_t i = 0; i < d->n_endpoints; i++)
    if (d->endpoints[i].kind == SX_TRANSPORT_TCP)
      return d->endpoints[i].port;
  fail_msg("no TCP endpoint in %s", d->name);
  return 0;
}

int sxt_wire_send(int fd, const void *p, size_t n) { return send_all(fd, p, n); }

int sxt_wire_recv(int fd, void *p, size_t n) { return recv_all(fd, p, n); }
