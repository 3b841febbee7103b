/* Socket address helpers (see addr.h). */
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "addr.h"
#include "segxfer/errors.h"

int sx__hostport_split(const char *s, char *host, size_t hsize, uint16_t *port) {
  const char *hb = s, *colon;
  size_t hlen;
  if (s[0] == '[') {
    colon = strstr(s, "]:");
    if (colon == NULL)
      return SX_EINVAL;
    hb = s + 1;
    hlen = (size_t)(colon - hb);
    colon++;
  } else {
    colon = strrchr(s, ':');
    if (colon == NULL)
      return SX_EINVAL;
    hlen = (size_t)(colon - s);
  }
  if (hlen >= hsize)
    return SX_EINVAL;
  char *end;
  unsigned long v = strtoul(colon + 1, &end, 10);
  if (colon[1] == '\0' || *end != '\0' || v > 65535)
    return SX_EINVAL;
  memcpy(host, hb, hlen);
  host[hlen] = '\0';
  *port = (uint16_t)v;
  return 0;
}

int sx__hostport_sockaddr(const char *s, struct sockaddr_storage *ss, char *host,
                          size_t hsize) {
  uint16_t port;
  if (sx__hostport_split(s, host, hsize, &port) != 0)
    return SX_EINVAL;
  memset(ss, 0, sizeof(*ss));
  if (uv_ip4_addr(host, port, (struct sockaddr_in *)ss) != 0 &&
      uv_ip6_addr(host, port, (struct sockaddr_in6 *)ss) != 0)
    return SX_EINVAL;
  return 0;
}
