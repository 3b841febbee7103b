/*
 * Push-mode fixtures: a consumer agent with writable regions, write batches
 * run to their end, and checks that a consumer's blocks hold what a
 * producer wrote (the producer is a fixture target: its regions hold the
 * verification pattern).
 */
#ifndef SX_PUSH_FIXTURE_H
#define SX_PUSH_FIXTURE_H

#include "agent_fixture.h"

#define SXT_CONSUMER_BLOCKS 48u
#define SXT_RW (SX_ACCESS_REMOTE_READ | SX_ACCESS_REMOTE_WRITE)

/* A consumer "decode-0" (access as given) and a producer "prefill-0" (a
 * fixture target of seed 42) on a fresh mem:// store, the consumer opened
 * by the producer as seg. */
typedef struct sxt_pair {
  char url[64];
  sxt_agent c, p;
  sx_segment *seg;
} sxt_pair;
void sxt_pair_start(sxt_pair *x, uint32_t access);
void sxt_pair_stop(sxt_pair *x);

/* Let the pair's producer (this incarnation of "prefill-0") write. */
void sxt_pair_grant(sxt_pair *x);

/* Blocks local..+count -> remote..+count of every layer, K and V. */
sx_block_write sxt_kv_write(uint64_t local, uint64_t remote, uint64_t count);

/* No notice comes within 50 ms. */
void sxt_expect_no_notice(sx_agent *consumer);

/* 1 when fd is readable now. */
int sxt_fd_readable(int fd);

/* A published consumer: zeroed K and V regions of SXT_CONSUMER_BLOCKS
 * blocks per layer with this access, serving on 127.0.0.1:0. */
void sxt_consumer_start(sxt_agent *c, const char *url, const char *name, uint32_t access);

/* A write batch of n block writes with tag, submitted / run to its end
 * (the result's failed list cleared). */
sx_batch *sxt_write_submit(sx_segment *s, const sx_block_write *w, size_t n, uint64_t tag,
                           uint32_t timeout_ms);
sx_batch_result sxt_run_write(sx_segment *s, const sx_block_write *w, size_t n, uint64_t tag,
                              uint32_t timeout_ms);

/* Do the consumer's blocks of w hold the producer's blocks of w (every
 * layer and slot)?  0, or -1 with a message. */
int sxt_verify_write(const sxt_agent *consumer, const sxt_agent *producer,
                     const sx_block_write *w);
/* Are the consumer's blocks of w still all zero (nothing landed)? */
int sxt_blocks_zero(const sxt_agent *consumer, const sx_block_write *w);

/* Take the next notice within timeout_ms and check that it is the one of a
 * batch of w[0..n) with tag from producer p (its name and incarnation). */
void sxt_expect_notice(sx_agent *consumer, const sxt_agent *p, const char *pname, uint64_t tag,
                       const sx_block_write *w, size_t n, int timeout_ms);

/* The same for a read notice (SX_BATCH_NOTIFY) of reader r (named rname)
 * that read e[0..n) (at most 16 entries) with tag. */
void sxt_expect_read_notice(sx_agent *target, const sxt_agent *r, const char *rname,
                            uint64_t tag, const sx_block_read *e, size_t n, int timeout_ms);
/* The checks of both on a notice at hand: sender, tag, runs, bytes. */
void sxt_check_notice(const sx_notice *no, const sxt_agent *p, const char *pname, uint64_t tag,
                      const sx_block_write *w, size_t n);

/* PRODUCERS agents in threads write 8 batches each into one consumer at
 * once over transport want; every notice must match its producer, tag and
 * bytes.  Fails the test otherwise. */
void sxt_push_many_producers(sx_transport_kind want);

/* A target of the test's own on the wire: a loopback listener (the fd is
 * returned; accept and answer on it) published in url's store as segment
 * name, a KV pool of blocks blocks per layer with this access. */
int sxt_fake_target(const char *url, const char *name, uint64_t blocks, uint32_t access);

/* Raw push frames on a connection that said HELLO (sxt_wire_hello): each
 * returns the status of its reply, or 1 when the connection closed. */
int sxt_wire_wauth(int fd, const uint8_t *incarnation, const uint8_t *token);
int sxt_wire_write(int fd, uint64_t id, uint32_t region, uint64_t offset, const void *data,
                   uint64_t length);
int sxt_wire_notice(int fd, uint64_t id, const uint8_t *body, size_t len);
/* A read notice (RNOTICE) on a reader's connection: needs no WAUTH. */
int sxt_wire_rnotice(int fd, uint64_t id, const uint8_t *body, size_t len);

#endif
