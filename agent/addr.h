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

/* What an advertised host may be, the address peers are told to connect
 * to: an IPv4 or IPv6 literal other than the wildcard, or a DNS host name
 * (labels of letters, digits and '-', 1..63 bytes each, 253 in all).  NULL
 * when it is one, else why not (for a message). */
const char *sx__host_unusable(const char *host);

#endif
