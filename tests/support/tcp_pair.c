/*
 * A target and a reader agent for the TCP transport's tests at large
 * blocks (tcp_pair.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "agent_fixture.h"
#include "pattern.h"
#include "tcp_pair.h"

void sxt_tcp_pair_dst_map(sxt_tcp_pair *x) {
  x->dst = mmap(NULL, x->dst_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  assert_true(x->dst != MAP_FAILED);
  sx_region_params lp = {.addr = x->dst, .length = x->dst_bytes, .layer_count = 1,
                         .slot = SX_SLOT_K, .block_bytes = SXT_MIB,
                         .num_blocks = x->dst_bytes / SXT_MIB};
  sxt_ok(sx_agent_register(x->r, &lp, &x->dst_id));
}

void sxt_tcp_pair_dst_unmap(sxt_tcp_pair *x) {
  if (x->dst == NULL)
    return;
  if (x->r != NULL)
    sxt_ok(sx_agent_unregister(x->r, x->dst_id));
  munmap(x->dst, x->dst_bytes);
  x->dst = NULL;
}

static void agent_params(const sxt_tcp_pair *x, sx_agent_params *p, const char *name) {
  sxt_params(p, x->url, name);
  p->transports = SX_TRANSPORTS_TCP;
  p->tcp_threads = x->o.threads;
  p->tcp_thread_bytes = x->o.thread_bytes;
}

/* A target named name serving on listen and advertising advertise (NULL:
 * the listen host). */
static void target_start(const sxt_tcp_pair *x, const char *name, const char *listen,
                         const char *advertise, sxt_tcp_target *t) {
  sx_agent_params p;
  agent_params(x, &p, name);
  p.listen = listen;
  p.advertise = advertise;
  sxt_ok(sx_agent_create(&p, &t->a));
  uint64_t pool_bytes = (uint64_t)SXT_TCP_PAIR_POOL * SXT_MIB;
  assert_non_null(t->pool = malloc(pool_bytes));
  sx_region_params rp = {.addr = t->pool, .length = pool_bytes, .layer_count = 1,
                         .slot = SX_SLOT_K, .block_bytes = SXT_MIB,
                         .num_blocks = SXT_TCP_PAIR_POOL, .access = SX_ACCESS_REMOTE_READ};
  sxt_ok(sx_agent_register(t->a, &rp, &t->region));
  sx__pattern_fill(t->pool, pool_bytes, 11, t->region, 0);
  sxt_ok(sx_agent_publish(t->a, 0));
}

void sxt_tcp_target_start(const sxt_tcp_pair *x, const char *name, sxt_tcp_target *t) {
  target_start(x, name, "127.0.0.1:0", NULL, t);
}

void sxt_tcp_target_stop(sxt_tcp_target *t) {
  sx_agent_destroy(t->a);
  free(t->pool);
  memset(t, 0, sizeof(*t));
}

sx_agent *sxt_tcp_pair_reader(const sxt_tcp_pair *x, uint32_t conns) {
  sx_agent_params p;
  agent_params(x, &p, NULL);
  p.conns_per_peer = conns;
  sx_agent *a;
  sxt_ok(sx_agent_create(&p, &a));
  return a;
}

void sxt_tcp_pair_start(sxt_tcp_pair *x, const sxt_tcp_pair_opts *o) {
  memset(x, 0, sizeof(*x));
  x->o = *o;
  assert_true(o->batch >= 1 && o->batch <= SXT_TCP_PAIR_RANGES);
  x->dst_bytes = (size_t)SXT_TCP_PAIR_DEPTH * o->batch * SXT_MIB;
  sxt_mem_url(x->url, sizeof(x->url), "tcppair");
  char listen[32] = "127.0.0.1:0";
  const char *advertise = NULL;
  if (o->stall >= 0 || o->cut >= 0) {
    sxt_proxy_opts po = {.cut_after = o->cut, .stall_after = o->stall,
                         .first_only = o->first_only, .up_rcvbuf = o->up_rcvbuf};
    sxt_proxy_start(&x->px, &po);
    x->proxied = 1;
    snprintf(listen, sizeof(listen), "127.0.0.1:%u", x->px.port);
    advertise = "127.0.0.2"; /* the proxy */
  }
  target_start(x, "prefill-tcp", listen, advertise, &x->target);
  x->t = x->target.a;
  x->pool = x->target.pool;
  x->region = x->target.region;
  x->r = sxt_tcp_pair_reader(x, o->conns);
  sxt_tcp_pair_dst_map(x);
  sxt_ok(sx_segment_open(x->r, "prefill-tcp", 5000, &x->seg));
  assert_int_equal(sx_segment_transport(x->seg), SX_TRANSPORT_TCP);
}

void sxt_tcp_pair_stop(sxt_tcp_pair *x) {
  if (x->seg != NULL)
    sx_segment_close(x->seg);
  x->seg = NULL;
  sxt_tcp_pair_dst_unmap(x);
  sx_agent_destroy(x->r);
  sx_agent_destroy(x->t);
  x->r = x->t = NULL;
  if (x->proxied)
    sxt_proxy_stop(&x->px);
  x->proxied = 0;
  free(x->pool);
  x->pool = NULL;
}

static sx_batch *ranges_submit(sx_segment *seg, const sx_range_read *e, uint32_t n,
                               uint32_t timeout_ms, sx_batch_cb cb, void *arg) {
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = timeout_ms;
  bp.cb = cb;
  bp.cb_arg = arg;
  sx_batch *b;
  sxt_ok(sx_batch_create(seg, &bp, &b));
  sxt_ok(sx_batch_add_ranges(b, e, n));
  sxt_ok(sx_batch_submit(b));
  return b;
}

sx_batch *sxt_tcp_pair_submit(sxt_tcp_pair *x, uint32_t k, uint32_t round, sx_range_read *e,
                              uint32_t timeout_ms, sx_batch_cb cb, void *arg) {
  for (uint32_t i = 0; i < x->o.batch; i++) {
    uint32_t b = (i * 7 + k * 5 + round * 3) % SXT_TCP_PAIR_POOL;
    e[i] = (sx_range_read){.local = x->dst + ((uint64_t)k * x->o.batch + i) * SXT_MIB,
                           .remote_region = x->region, .offset = (uint64_t)b * SXT_MIB,
                           .length = SXT_MIB};
  }
  return ranges_submit(x->seg, e, x->o.batch, timeout_ms, cb, arg);
}

sx_batch *sxt_tcp_ranges_submit(sx_segment *seg, const sxt_tcp_target *t, uint8_t *dst,
                                uint32_t n, uint32_t first, uint32_t timeout_ms) {
  sx_range_read e[SXT_TCP_PAIR_RANGES];
  assert_true(n <= SXT_TCP_PAIR_RANGES);
  for (uint32_t i = 0; i < n; i++)
    e[i] = (sx_range_read){.local = dst + (uint64_t)i * SXT_MIB, .remote_region = t->region,
                           .offset = (uint64_t)((first + 3 * i) % SXT_TCP_PAIR_POOL) * SXT_MIB,
                           .length = SXT_MIB};
  return ranges_submit(seg, e, n, timeout_ms, NULL, NULL);
}

void sxt_tcp_pair_check(const sxt_tcp_pair *x, const sx_range_read *e) {
  for (uint32_t i = 0; i < x->o.batch; i++)
    if (memcmp(e[i].local, x->pool + e[i].offset, SXT_MIB) != 0)
      fail_msg("range %u (pool offset %lu) differs", i, (unsigned long)e[i].offset);
}

void sxt_tcp_pair_finish(const sxt_tcp_pair *x, sx_batch *b[SXT_TCP_PAIR_DEPTH],
                         sx_range_read e[SXT_TCP_PAIR_DEPTH][SXT_TCP_PAIR_RANGES]) {
  for (uint32_t k = 0; k < SXT_TCP_PAIR_DEPTH; k++) {
    sx_batch_result res = sxt_batch_finish(b[k]);
    if (res.state != SX_BATCH_COMPLETED)
      fail_msg("batch %u: %s: %s", k, sx_batch_state_name(res.state), res.message);
    assert_int_equal(res.bytes, (uint64_t)x->o.batch * SXT_MIB);
    sxt_tcp_pair_check(x, e[k]);
  }
}

void sxt_tcp_pair_rounds(sxt_tcp_pair *x, uint32_t rounds) {
  sx_range_read e[SXT_TCP_PAIR_DEPTH][SXT_TCP_PAIR_RANGES];
  for (uint32_t round = 0; round < rounds; round++) {
    memset(x->dst, 0, x->dst_bytes);
    sx_batch *b[SXT_TCP_PAIR_DEPTH];
    for (uint32_t k = 0; k < SXT_TCP_PAIR_DEPTH; k++)
      b[k] = sxt_tcp_pair_submit(x, k, round, e[k], 10000, NULL, NULL);
    sxt_tcp_pair_finish(x, b, e);
  }
}
