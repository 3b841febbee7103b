/* Push-mode fixtures (see push_fixture.h). */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "pattern.h"
#include "push_fixture.h"
#include "transport/conn/frame.h"

void sxt_pair_start(sxt_pair *x, uint32_t access) {
  sxt_mem_url(x->url, sizeof(x->url), "push");
  sxt_consumer_start(&x->c, x->url, "decode-0", access);
  sxt_target_start(&x->p, x->url, "prefill-0", NULL, 42);
  sxt_ok(sx_segment_open(x->p.a, "decode-0", 2000, &x->seg));
}

void sxt_pair_stop(sxt_pair *x) {
  sx_segment_close(x->seg);
  sxt_agent_stop(&x->p);
  sxt_agent_stop(&x->c);
}

void sxt_pair_grant(sxt_pair *x) {
  uint8_t inc[SX_INCARNATION_LEN];
  sx_agent_incarnation(x->p.a, inc);
  sxt_ok(sx_agent_grant_write(x->c.a, "prefill-0", inc));
}

sx_block_write sxt_kv_write(uint64_t local, uint64_t remote, uint64_t count) {
  return (sx_block_write){.layer_count = SXT_LAYERS, .slots = SXT_KV, .local_block = local,
                          .remote_block = remote, .count = count};
}

void sxt_expect_no_notice(sx_agent *consumer) {
  sx_notice *n = NULL;
  int rc = sx_agent_notice_next(consumer, 50, &n);
  if (rc == 0)
    fail_msg("unexpected notice from %s tag %lu", n->producer, (unsigned long)n->tag);
  assert_int_equal(rc, SX_ETIMEDOUT);
}

int sxt_fd_readable(int fd) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  return poll(&p, 1, 0) == 1;
}

void sxt_consumer_start(sxt_agent *c, const char *url, const char *name, uint32_t access) {
  memset(c, 0, sizeof(*c));
  sx_agent_params p;
  sxt_params(&p, url, name);
  p.listen = "127.0.0.1:0";
  sxt_ok(sx_agent_create(&p, &c->a));
  sxt_register_kv(c, SXT_CONSUMER_BLOCKS, access);
  sxt_ok(sx_agent_publish(c->a, 0));
}

sx_batch *sxt_write_submit(sx_segment *s, const sx_block_write *w, size_t n, uint64_t tag,
                           uint32_t timeout_ms) {
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = timeout_ms;
  bp.flags = SX_BATCH_WRITE;
  bp.tag = tag;
  sx_batch *b;
  sxt_ok(sx_batch_create(s, &bp, &b));
  sxt_ok(sx_batch_add_block_writes(b, w, n));
  sxt_ok(sx_batch_submit(b));
  return b;
}

sx_batch_result sxt_run_write(sx_segment *s, const sx_block_write *w, size_t n, uint64_t tag,
                              uint32_t timeout_ms) {
  sx_batch *b = sxt_write_submit(s, w, n, tag, timeout_ms);
  sxt_ok(sx_batch_wait(b, -1));
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  res.failed = NULL;
  sx_batch_destroy(b);
  return res;
}

/* Walk the (layer, slot) pairs of w: the consumer's bytes and where they
 * came from in the producer's regions. */
static int walk(const sxt_agent *c, const sxt_agent *p, const sx_block_write *w) {
  for (uint32_t l = w->layer_first; l < w->layer_first + w->layer_count; l++) {
    for (uint64_t m = w->slots; m; m &= m - 1) {
      uint32_t s = (uint32_t)__builtin_ctzll(m);
      const uint8_t *dst = c->mem[s] + ((uint64_t)l * c->blocks + w->remote_block) * SXT_BLOCK;
      uint64_t len = w->count * SXT_BLOCK, bad = 0;
      if (p == NULL) {
        for (uint64_t i = 0; i < len; i++) {
          if (dst[i] != 0) {
            print_error("layer %u slot %u: byte %lu of blocks %lu..+%lu was written\n", l, s,
                        (unsigned long)i, (unsigned long)w->remote_block,
                        (unsigned long)w->count);
            return -1;
          }
        }
        continue;
      }
      uint64_t off = ((uint64_t)l * p->blocks + w->local_block) * SXT_BLOCK;
      if (sx__pattern_check(dst, len, p->seed, p->id[s], off, &bad)) {
        print_error("layer %u slot %u blocks %lu->%lu x%lu: byte %lu differs\n", l, s,
                    (unsigned long)w->local_block, (unsigned long)w->remote_block,
                    (unsigned long)w->count, (unsigned long)bad);
        return -1;
      }
    }
  }
  return 0;
}

int sxt_verify_write(const sxt_agent *consumer, const sxt_agent *producer,
                     const sx_block_write *w) {
  return walk(consumer, producer, w);
}

int sxt_blocks_zero(const sxt_agent *consumer, const sx_block_write *w) {
  return walk(consumer, NULL, w);
}

void sxt_expect_notice(sx_agent *consumer, const sxt_agent *p, const char *pname, uint64_t tag,
                       const sx_block_write *w, size_t n, int timeout_ms) {
  sx_notice *no = NULL;
  sxt_ok(sx_agent_notice_next(consumer, timeout_ms, &no));
  assert_int_equal(no->kind, SX_NOTICE_WRITE);
  sxt_check_notice(no, p, pname, tag, w, n);
  sx_notice_free(no);
}

void sxt_expect_read_notice(sx_agent *target, const sxt_agent *r, const char *rname,
                            uint64_t tag, const sx_block_read *e, size_t n, int timeout_ms) {
  sx_block_write w[16];
  assert_true(n <= 16);
  for (size_t i = 0; i < n; i++)
    w[i] = (sx_block_write){.group = e[i].group, .layer_first = e[i].layer_first,
                            .layer_count = e[i].layer_count, .slots = e[i].slots,
                            .local_block = e[i].local_block, .remote_block = e[i].remote_block,
                            .count = e[i].count};
  sx_notice *no = NULL;
  sxt_ok(sx_agent_notice_next(target, timeout_ms, &no));
  assert_int_equal(no->kind, SX_NOTICE_READ);
  sxt_check_notice(no, r, rname, tag, w, n);
  sx_notice_free(no);
}

void sxt_check_notice(const sx_notice *no, const sxt_agent *p, const char *pname, uint64_t tag,
                      const sx_block_write *w, size_t n) {
  assert_string_equal(no->producer, pname);
  uint8_t inc[SX_INCARNATION_LEN];
  sx_agent_incarnation(p->a, inc);
  assert_memory_equal(no->incarnation, inc, SX_INCARNATION_LEN);
  assert_int_equal(no->tag, tag);
  assert_int_equal(no->n_ranges, 0);
  /* The notice's runs cover exactly the blocks of w, in order. */
  uint64_t bytes = 0;
  size_t k = 0;
  for (uint32_t i = 0; i < no->n_blocks; i++) {
    const sx_notice_blocks *e = &no->blocks[i];
    uint64_t left = e->count, block = e->block;
    while (left > 0) {
      assert_true(k < n);
      assert_int_equal(e->group, w[k].group);
      assert_int_equal(e->layer_first, w[k].layer_first);
      assert_int_equal(e->layer_count, w[k].layer_count);
      assert_int_equal(e->slots, w[k].slots);
      assert_int_equal(block, w[k].remote_block);
      assert_true(w[k].count <= left);
      bytes += w[k].count * SXT_BLOCK * w[k].layer_count *
               (uint64_t)__builtin_popcountll(w[k].slots);
      left -= w[k].count;
      block += w[k].count;
      k++;
    }
  }
  assert_int_equal(k, n);
  assert_int_equal(no->bytes, bytes);
}

/* ------------------------------------------------------------ many producers */

#define PRODUCERS 4
#define BATCHES 8

typedef struct prod {
  sxt_agent a;
  char name[32];
  sx_segment *seg;
  int failed;
  sx_transport_kind want;
} prod;

static void *producer_main(void *arg) {
  prod *p = arg;
  int k = p->name[8] - '0';
  sx_batch *b[BATCHES];
  for (int i = 0; i < BATCHES; i++) {
    uint64_t blk = (uint64_t)k * 12 + (uint64_t)i;
    sx_block_write w = sxt_kv_write(blk, blk, 1);
    b[i] = sxt_write_submit(p->seg, &w, 1, (uint64_t)k * 100 + (uint64_t)i, 10000);
  }
  for (int i = 0; i < BATCHES; i++) {
    sx_batch_result r;
    if (sx_batch_wait(b[i], -1) != 0 || sx_batch_result_get(b[i], &r) != 0 ||
        r.state != SX_BATCH_COMPLETED || r.transport != p->want)
      p->failed++;
    sx_batch_destroy(b[i]);
  }
  return NULL;
}

void sxt_push_many_producers(sx_transport_kind want) {
  sxt_pair x;
  sxt_mem_url(x.url, sizeof(x.url), "push");
  sxt_consumer_start(&x.c, x.url, "decode-0", SXT_RW);
  sxt_ok(sx_agent_grant_write(x.c.a, NULL, NULL)); /* the namespace */
  prod p[PRODUCERS];
  pthread_t th[PRODUCERS];
  for (int k = 0; k < PRODUCERS; k++) {
    memset(&p[k], 0, sizeof(p[k]));
    snprintf(p[k].name, sizeof(p[k].name), "prefill-%d", k);
    sxt_target_start(&p[k].a, x.url, p[k].name, NULL, 1000 + (uint64_t)k);
    sxt_ok(sx_segment_open(p[k].a.a, "decode-0", 2000, &p[k].seg));
    p[k].want = want;
  }
  for (int k = 0; k < PRODUCERS; k++)
    assert_int_equal(pthread_create(&th[k], NULL, producer_main, &p[k]), 0);
  for (int k = 0; k < PRODUCERS; k++) {
    pthread_join(th[k], NULL);
    assert_int_equal(p[k].failed, 0);
  }
  /* Every notice matches its producer, its tag and its bytes. */
  int seen[PRODUCERS][BATCHES] = {{0}};
  for (int i = 0; i < PRODUCERS * BATCHES; i++) {
    sx_notice *n;
    sxt_ok(sx_agent_notice_next(x.c.a, 1000, &n));
    int k = n->producer[8] - '0';
    assert_true(k >= 0 && k < PRODUCERS);
    assert_string_equal(n->producer, p[k].name);
    uint8_t inc[SX_INCARNATION_LEN];
    sx_agent_incarnation(p[k].a.a, inc);
    assert_memory_equal(n->incarnation, inc, SX_INCARNATION_LEN);
    int b = (int)(n->tag - (uint64_t)k * 100);
    assert_true(b >= 0 && b < BATCHES);
    seen[k][b]++;
    assert_int_equal(n->n_blocks, 1);
    assert_int_equal(n->blocks[0].block, (uint64_t)k * 12 + (uint64_t)b);
    sx_block_write w = sxt_kv_write(n->blocks[0].block, n->blocks[0].block, n->blocks[0].count);
    assert_int_equal(sxt_verify_write(&x.c, &p[k].a, &w), 0);
    sx_notice_free(n);
  }
  for (int k = 0; k < PRODUCERS; k++)
    for (int b = 0; b < BATCHES; b++)
      assert_int_equal(seen[k][b], 1);
  sxt_expect_no_notice(x.c.a);
  for (int k = 0; k < PRODUCERS; k++) {
    sx_segment_close(p[k].seg);
    sxt_agent_stop(&p[k].a);
  }
  sxt_agent_stop(&x.c);
}

/* ------------------------------------------------------------ wire */

static int wire_frame(int fd, uint8_t type, uint64_t id, uint32_t region, uint64_t offset,
                      const void *body, uint64_t length, uint8_t want) {
  uint8_t hdr[SX__FRAME_HDR];
  sx__frame f = {.type = type, .id = id, .region = region, .offset = offset, .length = length};
  sx__frame_encode(&f, hdr);
  if (sxt_wire_send(fd, hdr, sizeof(hdr)) || (length && sxt_wire_send(fd, body, length)))
    return 1;
  uint8_t rep[SX__FRAME_HDR];
  if (sxt_wire_recv(fd, rep, sizeof(rep)))
    return 1;
  sx__frame g;
  assert_int_equal(sx__frame_decode(rep, sizeof(rep), &g), SX__FRAME_HDR);
  assert_int_equal(g.type, want);
  assert_int_equal(g.id, id);
  return g.status;
}

int sxt_fake_target(const char *url, const char *name, uint64_t blocks, uint32_t access) {
  int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(bind(lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
  assert_int_equal(listen(lfd, 16), 0);
  socklen_t sl = sizeof(sa);
  getsockname(lfd, (struct sockaddr *)&sa, &sl);
  sx_desc d;
  sxt_desc_kv(&d, name, SXT_LAYERS, 0, SXT_BLOCK, blocks, 0);
  snprintf(d.layout.fingerprint, sizeof(d.layout.fingerprint), "llama-test/v1");
  snprintf(d.endpoints[0].addr, sizeof(d.endpoints[0].addr), "127.0.0.1");
  d.endpoints[0].port = ntohs(sa.sin_port);
  d.lease_ms = 60000;
  for (uint32_t i = 0; i < d.n_regions; i++)
    d.regions[i].access = access;
  sxt_store_publish(url, &d);
  sx_desc_free(&d);
  return lfd;
}

int sxt_wire_wauth(int fd, const uint8_t *incarnation, const uint8_t *token) {
  uint8_t body[SX__WAUTH_BODY];
  memcpy(body, incarnation, SX_INCARNATION_LEN);
  memcpy(body + SX_INCARNATION_LEN, token, SX_TOKEN_LEN);
  return wire_frame(fd, SX__FRAME_WAUTH, 1, 0, 0, body, sizeof(body), SX__FRAME_WAUTH_REPLY);
}

int sxt_wire_write(int fd, uint64_t id, uint32_t region, uint64_t offset, const void *data,
                   uint64_t length) {
  return wire_frame(fd, SX__FRAME_WRITE, id, region, offset, data, length,
                    SX__FRAME_WRITE_REPLY);
}

int sxt_wire_notice(int fd, uint64_t id, const uint8_t *body, size_t len) {
  return wire_frame(fd, SX__FRAME_NOTICE, id, 0, 0, body, len, SX__FRAME_NOTICE_REPLY);
}

int sxt_wire_rnotice(int fd, uint64_t id, const uint8_t *body, size_t len) {
  return wire_frame(fd, SX__FRAME_RNOTICE, id, 0, 0, body, len, SX__FRAME_NOTICE_REPLY);
}
