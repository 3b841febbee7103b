/*
 * Fake Redis Cluster nodes for tests of what a hostile or broken node says
 * (tests/test_store_cluster.c): a thread serves a few listening sockets on
 * loopback, parses each command with hiredis' reader (a command is a RESP
 * array of bulk strings, as replies are) and answers it:
 *   - CLUSTER SHARDS: the map, every slot on this node (or `shards` as is);
 *   - SCRIPT LOAD: a made-up SHA1, AUTH and ASKING: +OK;
 *   - anything else: `answer` (RESP bytes), where "%s" stands for the slot
 *     of the command's key and "%p" for the port of the other node (node k
 *     answers about node k ^ 1).
 * Each node counts the commands of the last kind it got.
 */
#ifndef SXT_FAKE_RNODE_H
#define SXT_FAKE_RNODE_H

#include <pthread.h>
#include <stdatomic.h>

#define SXT_FAKE_RNODES 2

typedef struct sxt_fake_rnode {
  int lfd;
  int port;
  char answer[256];  /* RESP, with %s (the key's slot) and %p (the other port) */
  const char *shards; /* NULL: the whole map on this node */
  atomic_int others;  /* commands answered with `answer` */
} sxt_fake_rnode;

typedef struct sxt_fake_rnodes {
  sxt_fake_rnode node[SXT_FAKE_RNODES];
  pthread_t th;
  int stop_fd[2];
} sxt_fake_rnodes;

/* Start both nodes; each answers other commands with answer. */
void sxt_fake_rnodes_start(sxt_fake_rnodes *f, const char *answer);
void sxt_fake_rnodes_stop(sxt_fake_rnodes *f);

#endif
