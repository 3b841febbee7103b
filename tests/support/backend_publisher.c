/* A publisher on one async store backend.  See backend_publisher.h. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_publisher.h"
#include "internal.h"
#include "sxtest.h"

void sxt_desc_make(sx_desc *d, const char *name, uint8_t inc, uint64_t gen,
                   uint32_t lease_ms) {
  sxt_desc_kv(d, name, 4, 0, 4096, 16, 0);
  memset(d->incarnation, inc, SX_INCARNATION_LEN);
  d->generation = gen;
  d->lease_ms = lease_ms;
}

static void renew_now(sxt_bk *k);

static void on_conn(void *arg, int up, int err, const char *msg) {
  sxt_bk *k = arg;
  (void)msg;
  if (up) {
    k->ups++;
    if (k->published)
      renew_now(k);
  } else {
    k->downs++;
    k->last_err = err;
  }
}

static void published(void *arg, const sx_backend_reply *rep) {
  sxt_bk *k = arg;
  k->inflight = 0;
  if (rep->status != 0)
    return;
  if (k->published)
    k->republished++, k->republished_at = sx__mono_ms();
  k->published = 1;
}

int sxt_bk_publish(sxt_bk *k) {
  sx_publish_req req = {.name = k->name, .incarnation = k->inc, .generation = k->gen,
                        .value = k->val, .len = k->len, .lease_ms = k->lease_ms};
  k->inflight = 1;
  int rc = sx__backend_publish(k->b, &req, published, k);
  if (rc)
    k->inflight = 0;
  return rc;
}

static void renewed(void *arg, const sx_backend_reply *rep) {
  sxt_bk *k = arg;
  k->inflight = 0;
  if (rep->status == SX_EGONE) {
    k->gone_seen++;
    k->gen++;
    sxt_bk_publish(k);
  }
}

static void renew_now(sxt_bk *k) {
  if (k->inflight || !k->published)
    return;
  k->inflight = 1;
  if (sx__backend_renew(k->b, k->name, k->inc, k->lease_ms, renewed, k) != 0)
    k->inflight = 0;
}

static void tick(uv_timer_t *t) { (void)t; }

void sxt_bk_open(sxt_bk *k, const char *url, const char *name) {
  memset(k, 0, sizeof(*k));
  assert_int_equal(uv_loop_init(&k->loop), 0);
  uv_timer_init(&k->loop, &k->renew);
  uv_timer_init(&k->loop, &k->tick);
  k->renew.data = k;
  /* A tick keeps uv_run(ONCE) returning so that waits can check a clock. */
  uv_timer_start(&k->tick, tick, 20, 20);
  snprintf(k->name, sizeof(k->name), "%s", name);
  memset(k->inc, 0x5a, sizeof(k->inc));
  k->gen = 1;
  k->lease_ms = 1000;
  k->renew_ms = 1000 / 3;
  sx_desc d;
  sxt_desc_make(&d, name, 0x5a, 1, k->lease_ms);
  sxt_ok(sx_desc_encode(&d, &k->val, &k->len));
  sx_desc_free(&d);
  sx_backend_hooks h = {.on_conn = on_conn, .arg = k};
  sxt_ok(sx__backend_open(&k->loop, url, &h, &k->b));
}

int sxt_bk_run(sxt_bk *k, const int *flag, int ms) {
  uint64_t end = sx__mono_ms() + (uint64_t)ms;
  while (!*flag && sx__mono_ms() < end)
    uv_run(&k->loop, UV_RUN_ONCE);
  return *flag;
}

void sxt_bk_close(sxt_bk *k) {
  sx__backend_close(k->b);
  uv_close((uv_handle_t *)&k->renew, NULL);
  uv_close((uv_handle_t *)&k->tick, NULL);
  uv_run(&k->loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&k->loop), 0); /* every handle closed */
  free(k->val);
}
