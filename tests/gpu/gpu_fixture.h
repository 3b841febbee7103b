/*
 * Fixtures for the GPU suite (make test-gpu): a KV pool of K and V regions
 * in host or CUDA memory, filled with the verification pattern through a
 * host buffer and a copy, and checks that copy GPU memory back first.
 */
#ifndef SXT_GPU_FIXTURE_H
#define SXT_GPU_FIXTURE_H

#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include "agent_fixture.h"
#include "redis_harness.h"
#include "mem/mem.h"

typedef struct gpu_pool {
  sx_agent *a;
  const char *location;  /* "cpu" or "cuda:N" */
  uint8_t *mem[2];       /* K, V: host or device pointers */
  uint32_t id[2];
  uint32_t layers;
  uint64_t blocks, block_bytes;
} gpu_pool;

/* Number of CUDA devices (0 when none: the caller skips). */
int gpu_devices(void);
/* A test binary's group setup: a CUDA device, a redis-server r (keyspace
 * notifications on) and its URL with namespace ns into url.  0, or -1
 * with the reason on stderr (who: the binary's name). */
int gpu_store_setup(sxt_redis *r, char *url, size_t size, const char *who,
                    const char *ns);
/* Does the suite run on the host-memory stand-in driver
 * (tests/gpu/fake_cuda.c, named by SX_CUDA_LIBRARY)? */
int gpu_on_stand_in(void);
/* The memory layer's gathers by method m in this process so far. */
uint64_t gpu_copy_count(sx__mem_copy_method m);
/* Run path (this test binary) with argv (NULL-terminated) as a helper
 * process whose stdin and stdout are pipes: *in writes to it, *out reads
 * from it.  Its pid; asserts. */
pid_t gpu_spawn(const char *path, const char *const argv[], FILE **in, FILE **out);

/* An agent (listening on 127.0.0.1 when name is not NULL); staging_bytes 0
 * keeps the default. */
sx_agent *gpu_agent(const char *url, const char *name, uint64_t staging_bytes,
                    unsigned transports);
/* A target process's agent (params p) with a pool of layers x blocks x
 * block_bytes at location filled with the pattern of seed, published.
 * NULL, said on stderr, when it cannot be. */
sx_agent *gpu_target_publish(const sx_agent_params *p, gpu_pool *pool, const char *location,
                             uint32_t layers, uint64_t blocks, uint64_t block_bytes,
                             uint64_t seed);
/* Register K and V of layers x blocks x block_bytes at location; fill them
 * with the pattern of seed when seed != 0 (else zeros). */
void gpu_pool_make(gpu_pool *p, sx_agent *a, const char *location, uint32_t layers,
                   uint64_t blocks, uint64_t block_bytes, uint64_t seed);
/* The same with the regions' access flags (push mode: writable ones). */
void gpu_pool_make_access(gpu_pool *p, sx_agent *a, const char *location, uint32_t layers,
                          uint64_t blocks, uint64_t block_bytes, uint64_t seed,
                          uint32_t access);
/* Push mode: do blocks [dst, dst+count) of every layer and both slots of
 * p hold what a producer's blocks [src, src+count) held: the pattern of
 * seed of its regions pid[2] (K, V) of pblocks blocks per layer?  0, or -1
 * with a message.  Device memory is copied back first. */
int gpu_pool_check_written(const gpu_pool *p, const uint32_t pid[2], uint64_t pblocks,
                           uint64_t seed, uint64_t src, uint64_t dst, uint64_t count);
/* Are blocks [dst, dst+count) of every layer and both slots all zero? */
int gpu_pool_zero(const gpu_pool *p, uint64_t dst, uint64_t count);
/* A copy of the whole pool (both slots) in host memory, to compare two
 * moments: free() it. */
uint8_t *gpu_pool_snapshot(const gpu_pool *p);
void gpu_pool_free(gpu_pool *p);
/* Check that every entry's local blocks hold the target's (pattern of
 * seed).  0 or -1. */
int gpu_pool_verify(const gpu_pool *p, const sx_segment *seg, uint64_t seed,
                    const sx_block_read *e, size_t n);
/* n scattered block reads of count blocks each over both slots of all
 * layers: remote and local ids from a simple generator, never repeated
 * locally, so a misplaced block shows. */
void gpu_entries(sx_block_read *e, size_t n, uint32_t layers, uint64_t remote_blocks,
                 uint64_t local_blocks, uint64_t count, uint32_t seed);

#endif
