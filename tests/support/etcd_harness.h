/*
 * A real etcd (Debian's etcd-server) for integration tests: started on free
 * 127.0.0.1 client and peer ports with a fresh data dir in a temp dir,
 * waited for until healthy, killed (SIGKILL) or frozen (SIGSTOP/SIGCONT),
 * restarted with its data or empty, and stopped with its files removed.  The
 * server dies with the test process (PR_SET_PDEATHSIG), so a crashed or
 * timed-out test leaves no etcd behind.
 */
#ifndef SXT_ETCD_HARNESS_H
#define SXT_ETCD_HARNESS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "store_fixture.h"

typedef struct sxt_etcd {
  char root[256]; /* temp dir: data/, etcd.log, TLS files */
  char data[300];
  char log[300];
  uint16_t port, peer_port;
  pid_t pid; /* 0 when not running */
  int tls;   /* https with a test CA (root/ca.pem) */
  char ca[300], cert[300], key[300];
} sxt_etcd;

/* 0; 1 if etcd (or, for tls, openssl) is not installed; -1 on failure (the
 * log's tail is printed). */
int sxt_etcd_start(sxt_etcd *e, int tls);
void sxt_etcd_stop(sxt_etcd *e);
/* SIGKILL waits for the process to die; SIGSTOP/SIGCONT freeze and thaw. */
int sxt_etcd_kill(sxt_etcd *e, int sig);
/* Start again on the same ports (killing it first if it runs), with its data
 * or (wipe) empty; wait until healthy.  0 or -1. */
int sxt_etcd_restart(sxt_etcd *e, int wipe);
/* etcd[+https]://127.0.0.1:PORT?namespace=NS[&extra] */
void sxt_etcd_url(const sxt_etcd *e, const char *ns, const char *extra, char *buf,
                  size_t size);
/* A blocking POST of a JSON body to the gateway (for checks behind the
 * backend's back).  The answer (malloc()ed, NUL-terminated) in *answer. */
int sxt_etcd_post(const sxt_etcd *e, const char *path, const char *body, char **answer);
/* Put raw bytes under a key, without a lease. */
int sxt_etcd_put(const sxt_etcd *e, const char *key, const void *value, size_t len);

extern const sxt_store_fixture sxt_etcd_fixture;

#endif
