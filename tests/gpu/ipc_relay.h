/*
 * The GPU suite, cuda_ipc: a lying target for test_gpu_ipc, as a relay
 * thread between the reader and a real target that rewrites what the
 * target says (its IPC records) and adds what it never would (REVOKE
 * frames of chosen ids), noting what the reader answers.
 */
#ifndef SXT_IPC_RELAY_H
#define SXT_IPC_RELAY_H

#include <pthread.h>
#include <stdint.h>

/* A relay on 127.0.0.1:PORT to a target listening on 127.0.0.2:PORT (and
 * advertising 127.0.0.1): bytes go through as they are, except that every
 * IPC_REPLY record the target sends claims its allocation starts `shift`
 * bytes lower and is that much larger.  The record still adds up (base +
 * offset is the region's address, the region ends inside alloc), but the
 * handle maps only the real allocation. */
typedef struct relay {
  int lfd, stop;
  uint16_t port;
  uint64_t shift;
  unsigned rewritten;
  pthread_t th;
  /* A revoking target: once inject_go is set, one REVOKE frame (IPC_REPLY
   * id 0) of inject[] goes to each reader connection that asked for IPC
   * handles; the ids readers give back (IPC id 0) land in given[]. */
  uint32_t inject[8];
  unsigned n_inject, n_given, give_frames;
  int inject_go;
  uint32_t given[64];
} relay;

/* Listen on 127.0.0.1:port and relay each connection to 127.0.0.2:port:
 * 0, or -1 when port is taken on 127.0.0.1 (the target's port was chosen
 * on 127.0.0.2, where it was free). */
int relay_start(relay *r, uint16_t port, uint64_t shift);
/* Stop the thread; every connection it relayed closes. */
void relay_stop(relay *r);

#endif
