/*
 * A target and a reader agent in this process for the TCP transport's
 * tests at large blocks (test_tcp_window, test_tcp_threads): a mem://
 * store, TCP on loopback (or through a proxy thread, tcp_proxy.h), the
 * target's pool of 1 MiB blocks filled with the verification pattern, the
 * reader's destination of its own mapping, and batches of 1 MiB ranges.
 */
#ifndef SXT_TCP_PAIR_H
#define SXT_TCP_PAIR_H

#include <stdint.h>

#include "segxfer/agent.h"
#include "sxtest.h"
#include "tcp_proxy.h"

#define SXT_MIB (1u << 20)
#define SXT_TCP_PAIR_POOL 24u  /* the target's pool, in 1 MiB blocks */
#define SXT_TCP_PAIR_DEPTH 3u  /* batches queued at once */
#define SXT_TCP_PAIR_RANGES 20 /* ranges per batch, at most */

typedef struct sxt_tcp_pair_opts {
  uint32_t conns;        /* the reader's connections */
  uint32_t batch;        /* ranges per batch, <= SXT_TCP_PAIR_RANGES */
  int32_t threads;       /* both agents' tcp_threads (-1: the default) */
  uint32_t thread_bytes; /* both agents' tcp_thread_bytes (0: the default) */
  long long stall, cut;  /* >= 0: through a proxy that stalls / dies there */
  int first_only;        /* the proxy stalls the first connection only */
  int up_rcvbuf;         /* > 0: the proxy's receive buffer towards the target */
} sxt_tcp_pair_opts;

/* A target: a published pool of SXT_TCP_PAIR_POOL blocks of 1 MiB. */
typedef struct sxt_tcp_target {
  sx_agent *a;
  uint8_t *pool;
  uint32_t region;
} sxt_tcp_target;

typedef struct sxt_tcp_pair {
  sxt_tcp_pair_opts o;
  char url[64];
  sx_agent *t, *r;
  uint8_t *pool, *dst; /* dst: SXT_TCP_PAIR_DEPTH batches of o.batch ranges */
  size_t dst_bytes;
  uint32_t region, dst_id;
  sxt_tcp_target target; /* t, pool and region above are its */
  sx_segment *seg;
  sxt_proxy px;
  int proxied;
} sxt_tcp_pair;

/* Start both agents and open the target's segment on the reader. */
void sxt_tcp_pair_start(sxt_tcp_pair *x, const sxt_tcp_pair_opts *o);
/* Close the segment (if open), destroy both agents (those left), stop
 * the proxy; x itself is the caller's. */
void sxt_tcp_pair_stop(sxt_tcp_pair *x);
/* Map and register the reader's destination / unregister and unmap it (a
 * write into it afterwards faults). */
void sxt_tcp_pair_dst_map(sxt_tcp_pair *x);
void sxt_tcp_pair_dst_unmap(sxt_tcp_pair *x);
/* Another target named name in x's store, served directly (no proxy),
 * with x's thread settings; stopped by sxt_tcp_target_stop(). */
void sxt_tcp_target_start(const sxt_tcp_pair *x, const char *name, sxt_tcp_target *t);
void sxt_tcp_target_stop(sxt_tcp_target *t);
/* Another reader in x's store with x's thread settings and conns
 * connections, no regions; sx_agent_destroy() it. */
sx_agent *sxt_tcp_pair_reader(const sxt_tcp_pair *x, uint32_t conns);
/* n ranges of 1 MiB of t's pool blocks first, first + 3, ... (mod the
 * pool) into dst, on seg, submitted with a deadline of timeout_ms. */
sx_batch *sxt_tcp_ranges_submit(sx_segment *seg, const sxt_tcp_target *t, uint8_t *dst,
                                uint32_t n, uint32_t first, uint32_t timeout_ms);
/* Batch k of round: o.batch ranges of 1 MiB from scattered pool blocks
 * into destination slot k (e filled), submitted with a deadline of
 * timeout_ms and the callback cb (NULL: none). */
sx_batch *sxt_tcp_pair_submit(sxt_tcp_pair *x, uint32_t k, uint32_t round, sx_range_read *e,
                              uint32_t timeout_ms, sx_batch_cb cb, void *arg);
/* Every range of e holds its pool bytes. */
void sxt_tcp_pair_check(const sxt_tcp_pair *x, const sx_range_read *e);
/* End the SXT_TCP_PAIR_DEPTH batches b submitted into slots 0.. with
 * ranges e: each must complete with every byte checked. */
void sxt_tcp_pair_finish(const sxt_tcp_pair *x, sx_batch *b[SXT_TCP_PAIR_DEPTH],
                         sx_range_read e[SXT_TCP_PAIR_DEPTH][SXT_TCP_PAIR_RANGES]);
/* SXT_TCP_PAIR_DEPTH batches queued, rounds times, each one completed and
 * compared byte for byte. */
void sxt_tcp_pair_rounds(sxt_tcp_pair *x, uint32_t rounds);

#endif
