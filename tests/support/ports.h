/* Free loopback ports for test servers. */
#ifndef SXT_PORTS_H
#define SXT_PORTS_H

/* A free TCP port on 127.0.0.1, or -1.  The port is bound and released, so
 * another process may take it meanwhile: servers retry on a bind failure. */
int sxt_free_port(void);

#endif
