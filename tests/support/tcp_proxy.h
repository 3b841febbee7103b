/*
 * A TCP proxy thread between a reader and a target agent, for the TCP
 * transport's tests (test_tcp_scatter, test_tcp_threads).  The target
 * listens on 127.0.0.1 at a port and advertises 127.0.0.2; the proxy
 * listens on 127.0.0.2 at the same port and forwards to it.  It can
 *   - trickle the replies in chunks of 1..1500 bytes with pauses, so that
 *     payloads arrive in short reads that end anywhere,
 *   - cut every connection after a number of reply bytes (and refuse new
 *     ones): the peer dies in the middle of a payload,
 *   - stall: forward no reply bytes past a number of them (connections
 *     stay open, requests still pass) until released: a reply that stops
 *     in the middle of its payload, and a target whose sends fill up
 *     (with a small receive buffer towards the target, they fill up at
 *     once); on every connection, or on the first one accepted only.
 */
#ifndef SXT_TCP_PROXY_H
#define SXT_TCP_PROXY_H

#include <pthread.h>
#include <stdint.h>

#define SXT_PROXY_PAIRS 16

typedef struct sxt_proxy_opts {
  int trickle;
  long long cut_after;   /* reply bytes passed before every connection is cut; <0: never */
  long long stall_after; /* reply bytes passed before replies stop; <0: never */
  int first_only;        /* stall and count the first connection only */
  int up_rcvbuf;         /* > 0: SO_RCVBUF of the connections to the target */
} sxt_proxy_opts;

typedef struct sxt_proxy {
  sxt_proxy_opts o;
  int lfd;
  uint16_t port;
  long long stall_after; /* o.stall_after until released (-1) */
  long long down;        /* reply bytes passed (read it with __atomic_load_n) */
  int dead;
  int stop;
  int accepted;
  int fd[SXT_PROXY_PAIRS][2]; /* client, upstream */
  int limited[SXT_PROXY_PAIRS]; /* stalled, cut and counted */
  int n;
  pthread_t th;
  uint8_t buf[65536];
} sxt_proxy;

/* Listen on 127.0.0.2 at a free port (p->port; the target listens on
 * 127.0.0.1 at the same one) and start forwarding as o says. */
void sxt_proxy_start(sxt_proxy *p, const sxt_proxy_opts *o);
/* Wait (up to ms) until the proxy has passed at least bytes reply bytes:
 * 0, or -1 on timeout. */
int sxt_proxy_wait_down(sxt_proxy *p, long long bytes, int ms);
/* Forward replies again, with no more stall. */
void sxt_proxy_release(sxt_proxy *p);
void sxt_proxy_stop(sxt_proxy *p);

#endif
