/* Socket address helpers shared by the agent and its transports.  Not
 * installed. */
#ifndef SX_AGENT_ADDR_H
#define SX_AGENT_ADDR_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

/* Split "host:port" or "[v6]:port" into host (hsize bytes) and port.
 * 0, or SX_EINVAL when it is not of that form. */
int sx__hostport_split(const char *s, char *host, size_t hsize, uint16_t *port);

/* The same into a socket address; the host must be an IP literal.
 * 0 or SX_EINVAL. */
int sx__hostport_sockaddr(const char *s, struct sockaddr_storage *ss, char *host,
                          size_t hsize);

#endif
