/*
 * The fault tests' actors (test_faults, test_faults_store, test_faults_net):
 * sx-agent processes holding a filled pool, started without waiting, in a
 * network namespace if asked, each with the store URL as the agent reaches
 * it; and in-process readers with local regions of the same shape, whose
 * batches always end by a bound (never wait forever).
 *
 * Each program's main hands its tests to sxt_fault_main, which sets up the
 * environment (proc_env.h) around them.  Usage:
 *   static sxt_proc_env env;
 *   sxt_fault_agent p;
 *   sxt_fault_spawn(&env, &p, "killed", env.url, NULL, 1000, 11, NULL);
 *   sxt_fault_wait_published(&p, NULL, 20000);
 *   sxt_fault_reader r;
 *   sxt_fault_reader_start(&r, env.url);
 *   ... sx_segment_open(r.a, p.name, ...), sxt_fault_batch(), sxt_fault_verify() ...
 *   sxt_fault_reader_stop(&r);
 *   sxt_fault_stop(&p, SIGTERM);
 */
#ifndef SXT_FAULT_FIXTURE_H
#define SXT_FAULT_FIXTURE_H

#include <stdint.h>
#include <sys/types.h>

#include "proc_env.h"
#include "segxfer.h"
#include "sxtest.h"

/* The pool every sx-agent here holds: 4 layers x K,V x 64 blocks of 16 KiB. */
#define SXT_FAULT_LAYERS 4
#define SXT_FAULT_BLOCK 16384u
#define SXT_FAULT_BLOCKS 64u
#define SXT_FAULT_LOCAL_BLOCKS 64u
#define SXT_FAULT_KV 3u /* slots K and V */

/* The agents' --log-level (tests that check logs for secrets use debug). */
extern const char *sxt_fault_log_level;

typedef struct sxt_fault_agent {
  pid_t pid;
  char name[64];
  char log[256];
  char url[512]; /* the store as the agent reaches it */
  uint8_t inc[SX_INCARNATION_LEN];
  uint64_t seed;
} sxt_fault_agent;

/* A reader agent (no name) with regions K and V of SXT_FAULT_LOCAL_BLOCKS
 * blocks per layer. */
typedef struct sxt_fault_reader {
  sx_agent *a;
  uint8_t *mem[2];
} sxt_fault_reader;

/* Run n tests as one cmocka group named title, SIGPIPE ignored.  The
 * group's setup starts env for the program test ("test_faults_net"):
 * sx-agent needed, a redis-server with keyspace events (Kx), namespace
 * "faults".  Its teardown runs cleanup (NULL: none), then stops env.
 * SXT_FILTER=pattern runs a subset.  Returns cmocka's status. */
int sxt_fault_main(sxt_proc_env *env, const char *test, const char *title,
                   const struct CMUnitTest *tests, size_t n, void (*cleanup)(void));

/* The incarnation and generation the store holds for name: 0 or an error. */
int sxt_fault_stored(const char *url, const char *name, uint8_t inc[SX_INCARNATION_LEN],
                     uint64_t *gen);

/* The path of ip(8), or NULL when iproute2 is not installed. */
const char *sxt_ip_cmd(void);

/* Start env's sx-agent (inside netns when not NULL) publishing name in url
 * with the pattern for seed.  Does not wait. */
void sxt_fault_spawn(const sxt_proc_env *env, sxt_fault_agent *p, const char *name,
                     const char *url, const char *listen, uint32_t lease_ms, uint64_t seed,
                     const char *netns);
/* Wait until the store holds an incarnation for p's name other than
 * `not` (NULL: any), and take it as p's.  Fails the test after ms. */
void sxt_fault_wait_published(sxt_fault_agent *p, const uint8_t *not, int ms);
/* SIGCONT, then sig, then reap (20 s at most): the exit status, 128 +
 * signal, or -1. */
int sxt_fault_stop(sxt_fault_agent *p, int sig);

void sxt_fault_reader_start(sxt_fault_reader *r, const char *url);
void sxt_fault_reader_stop(sxt_fault_reader *r);

/* Blocks [first, first+count) of every layer, K and V, to the same local
 * blocks. */
sx_block_read sxt_fault_blocks(uint64_t first, uint64_t count);
/* One batch of entry e with a deadline of timeout_ms: its result (failed
 * list cleared); fails the test if it has not ended 5 s after the deadline.
 * took_ms (may be NULL): from submit to the end. */
sx_batch_result sxt_fault_batch(sx_segment *s, const sx_block_read *e, uint32_t timeout_ms,
                                uint64_t *took_ms);
/* 0 when every byte of entry e in the reader's memory is the pool's pattern. */
int sxt_fault_verify(const sxt_fault_reader *r, const sx_segment *seg, uint64_t seed,
                     const sx_block_read *e);
/* 1 when every byte of entry e's destinations still holds fill. */
int sxt_fault_untouched(const sxt_fault_reader *r, const sx_block_read *e, uint8_t fill);
/* Fill the reader's regions with v. */
void sxt_fault_fill(sxt_fault_reader *r, uint8_t v);

#endif
