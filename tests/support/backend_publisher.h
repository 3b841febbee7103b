/*
 * A publisher as the agent runs it, on one async store backend (any URL
 * sx__backend_open takes) and a loop of its own: on_conn counts ups and
 * downs; once published, it renews at once whenever the connection comes
 * back, and on SX_EGONE republishes with the next generation.  The Redis
 * tests (test_store_redis, test_store_sentinel) drive it to watch a backend
 * follow restarts and failovers by itself.
 *
 * Usage:
 *   sxt_bk k;
 *   sxt_bk_open(&k, url, "idle/0");
 *   assert_true(sxt_bk_run(&k, &k.ups, 10000));   // connected
 *   sxt_ok(sxt_bk_publish(&k));
 *   assert_true(sxt_bk_run(&k, &k.published, 5000));
 *   ...
 *   sxt_bk_close(&k);                              // every handle closed
 */
#ifndef SXT_BACKEND_PUBLISHER_H
#define SXT_BACKEND_PUBLISHER_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "backend.h"
#include "segxfer/descriptor.h"

typedef struct sxt_bk {
  uv_loop_t loop;
  sx_backend *b;
  uv_timer_t renew, tick;
  int ups, downs, last_err;
  char name[64];
  uint8_t inc[SX_INCARNATION_LEN];
  uint64_t gen;
  uint8_t *val; /* the encoded descriptor it publishes */
  size_t len;
  uint32_t lease_ms, renew_ms;
  int inflight, published, gone_seen, republished;
  uint64_t republished_at;
} sxt_bk;

/* A KV descriptor for name whose incarnation is inc repeated. */
void sxt_desc_make(sx_desc *d, const char *name, uint8_t inc, uint64_t gen,
                   uint32_t lease_ms);

/* Open the backend on url for segment name (incarnation 0x5a.., lease 1 s);
 * fails the test when the backend does not open. */
void sxt_bk_open(sxt_bk *k, const char *url, const char *name);
/* Start publishing generation k->gen: 0 or the synchronous error. */
int sxt_bk_publish(sxt_bk *k);
/* Run the loop until *flag becomes non-zero or ms pass; returns *flag. */
int sxt_bk_run(sxt_bk *k, const int *flag, int ms);
/* Close the backend and assert that the loop has no handle left. */
void sxt_bk_close(sxt_bk *k);

#endif
