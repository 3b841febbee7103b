/*
 * Agent fixtures for tests: a target agent holding a KV pool filled with
 * the verification pattern, a reader agent with matching local regions,
 * checks of what a block read brought, forged descriptors in a mem://
 * store, and raw wire clients for the TCP data plane.
 */
#ifndef SX_AGENT_FIXTURE_H
#define SX_AGENT_FIXTURE_H

#include <stdint.h>

#include "segxfer/agent.h"
#include "sxtest.h"
#include "transport/conn/frame.h"

/* The pool shape every fixture agent uses. */
#define SXT_LAYERS 4
#define SXT_BLOCK 4096u
#define SXT_TARGET_BLOCKS 64u
#define SXT_READER_BLOCKS 32u
#define SXT_KV ((1ull << SX_SLOT_K) | (1ull << SX_SLOT_V))

typedef struct sxt_agent {
  sx_agent *a;
  uint8_t *mem[2];      /* K, V */
  uint32_t id[2];
  uint64_t blocks;
  uint64_t seed;
} sxt_agent;

/* Parameters every fixture agent shares (layout, quiet log). */
void sxt_params(sx_agent_params *p, const char *url, const char *name);

/* A published target: regions K and V over SXT_LAYERS layers of
 * SXT_TARGET_BLOCKS blocks, filled with the pattern for seed, serving on
 * listen (NULL: "127.0.0.1:0"). */
void sxt_target_start(sxt_agent *t, const char *url, const char *name,
                      const char *listen, uint64_t seed);
/* A reader with SXT_READER_BLOCKS blocks per layer and the same keys. */
void sxt_reader_start(sxt_agent *r, const char *url, const char *name);
void sxt_agent_stop(sxt_agent *t);
/* Register zeroed regions K and V over SXT_LAYERS layers of blocks blocks
 * with this access (what the target and reader above do with
 * SX_ACCESS_REMOTE_READ). */
void sxt_register_kv(sxt_agent *t, uint64_t blocks, uint32_t access);

/* Check that local blocks [local_block, +count) of every layer and slot of
 * entry e hold the target's blocks [remote_block, +count) under the pattern
 * of seed.  mem[slot] is the local region of each slot: layers of
 * local_blocks dense blocks.  0 or -1 (and a message). */
int sxt_verify(uint8_t *const *mem, uint64_t local_blocks, const sx_segment *seg,
               uint64_t seed, const sx_block_read *e);
/* sxt_verify() for a fixture reader. */
int sxt_verify_blocks(const sxt_agent *reader, const sx_segment *seg, uint64_t seed,
                      const sx_block_read *r);

/* A batch of n block reads with a deadline of timeout_ms, submitted. */
sx_batch *sxt_batch_submit(sx_segment *s, const sx_block_read *e, size_t n,
                           uint32_t timeout_ms);
/* The same batch with SX_BATCH_NOTIFY: it ends with a read notice of tag
 * at the target (segxfer/push.h). */
sx_batch *sxt_notify_submit(sx_segment *s, const sx_block_read *e, size_t n, uint64_t tag,
                            uint32_t timeout_ms);
/* Wait for b's end, destroy it: its result (the failed list cleared, since
 * it does not outlive the batch; n_failed kept). */
sx_batch_result sxt_batch_finish(sx_batch *b);
/* Submit, wait for the end, destroy: the result (its failed list cleared,
 * since it does not outlive the batch). */
sx_batch_result sxt_run_batch(sx_segment *s, const sx_block_read *e, size_t n,
                              uint32_t timeout_ms);

/* A mem:// store URL of its own for each call: "mem://PREFIX-PID-SEQ". */
void sxt_mem_url(char *url, size_t size, const char *prefix);

/* Publish a descriptor as-is into the mem:// store behind url. */
void sxt_store_publish(const char *url, const sx_desc *d);

/* Raw TCP client of the data plane (blocking, with a 5 s receive timeout). */
int sxt_wire_connect(uint16_t port);
/* Send HELLO; returns the status of HELLO_REPLY, or 1 when the connection
 * closed without a reply. */
int sxt_wire_hello(int fd, const uint8_t *incarnation, const uint8_t *token,
                   const char *name);
/* The same, also giving HELLO_REPLY's feature bits (SX__FEAT_*). */
int sxt_wire_hello_features(int fd, const uint8_t *incarnation, const uint8_t *token,
                            const char *name, uint64_t *features);
/* Send one READ and receive its reply: the status (payload into buf, which
 * must hold length bytes), or 1 on a closed connection. */
int sxt_wire_read(int fd, uint64_t id, uint32_t region, uint64_t offset, uint64_t length,
                  uint8_t *buf);
/* One READV of ranges r[0..n) (1 <= n <= SX__READV_MAX) into b: its
 * size. */
size_t sxt_wire_readv_encode(uint8_t *b, uint64_t id, const sx__range *r, uint32_t n);
/* Send one READ of range r / one READV of ranges r[0..n): 0 or -1. */
int sxt_wire_send_read(int fd, uint64_t id, const sx__range *r);
int sxt_wire_send_readv(int fd, uint64_t id, const sx__range *r, uint32_t n);
/* Send one READV of ranges r[0..n) and receive its reply: the status
 * (payload into buf, which must hold their sum; *index: the reply's
 * `region`, the range refused), or 1 on a closed connection. */
int sxt_wire_readv(int fd, uint64_t id, const sx__range *r, uint32_t n, uint8_t *buf,
                   uint32_t *index);
/* Send or receive exactly n bytes: 0, or -1 when the connection failed. */
int sxt_wire_send(int fd, const void *p, size_t n);
int sxt_wire_recv(int fd, void *p, size_t n);
/* 1 when the peer closed the connection (reads EOF within 5 s). */
int sxt_wire_closed(int fd);

/* The TCP port a descriptor publishes. */
uint16_t sxt_tcp_port(const sx_desc *d);

#endif
