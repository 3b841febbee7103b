/*
 * Fixtures for set reads (segxfer/group.h): one TP rank's KV pool of fp32
 * (K and V, LAYERS x BLOCKS blocks, a block description of some of HEADS
 * heads, token- or head-major), each element of a request's tokens set to
 * a code of (layer, slot, position, head, element), so a reference written
 * straight in a reader's layout can be compared byte for byte.  The pool
 * is host memory, or device memory (rank_start_at) with a host image that
 * rank_pull() refreshes, on which elem() and the checks work.
 */
#ifndef SXT_KV_RANKS_H
#define SXT_KV_RANKS_H

#include <stdint.h>

#include "agent_fixture.h"
#include "segxfer/group.h"

#define LAYERS 2
#define HEADS 4
#define HEAD_DIM 16
#define BLOCKS 16

typedef struct rank {
  sx_agent *a;
  sx_kv_order order;
  uint32_t tokens, first, count;
  float *mem[2];  /* K, V: the pool, or device memory's host image */
  void *dev[2];   /* device memory (device >= 0) */
  int device;     /* -1: host memory */
  uint32_t id[2]; /* the regions */
} rank;

uint64_t block_elems(const rank *r);
/* Bytes of one slot's pool. */
size_t rank_bytes(const rank *r);
float code(uint32_t layer, uint32_t slot, uint32_t pos, uint32_t head, uint32_t e);
float *elem(const rank *r, uint32_t slot, uint32_t layer, uint64_t block, uint32_t t,
            uint32_t h, uint32_t e);
/* The codes of `tokens` tokens whose blocks are table[0..) into r->mem. */
void fill(rank *r, const uint64_t *table, uint32_t tokens);
/* An agent (TCP; listening and published when name is set) with a block
 * description of heads [first, first+count), its K and V registered with
 * `access`, zeroed; host memory. */
void rank_start(rank *r, const char *url, const char *name, sx_kv_order order,
                uint32_t tokens, uint32_t first, uint32_t count, uint32_t tp_rank,
                uint32_t tp_size, uint32_t access);
/* The same in the memory of cuda:device (-1: host memory). */
void rank_start_at(rank *r, const char *url, const char *name, sx_kv_order order,
                   uint32_t tokens, uint32_t first, uint32_t count, uint32_t tp_rank,
                   uint32_t tp_size, uint32_t access, int device);
/* Device memory copied into r->mem (nothing for host memory). */
void rank_pull(rank *r);
void rank_stop(rank *r);
/* The set <engine>/tp0 .. tp(tp_size-1), opened from a's agent; it must fit
 * (no mismatch). */
sx_group *ranks_open(sx_agent *a, const char *engine, uint32_t tp_size);
/* d's pool (pulled from device memory first) holds the codes of `tokens`
 * tokens whose local blocks are lb[0..) for the heads of `heads` (bit h:
 * head h), and zeros everywhere else: else the test fails, naming the
 * first element that differs. */
void expect_heads(rank *d, const uint64_t *lb, uint32_t tokens, unsigned heads);
/* The one read notice waiting at a's agent: of `tag`, with ranges that add
 * up to its bytes (and no other notice after it).  Returns its bytes. */
uint64_t take_read_notice(sx_agent *a, uint64_t tag);

#endif
