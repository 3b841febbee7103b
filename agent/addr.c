/* Socket address helpers (see addr.h). */
#include <arpa/inet.h>
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

static int label_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         c == '-';
}

const char *sx__host_unusable(const char *host) {
  unsigned char a[sizeof(struct in6_addr)], zero[sizeof(struct in6_addr)] = {0};
  if (host[0] == '\0')
    return "it is empty";
  if (inet_pton(AF_INET, host, a) == 1)
    return memcmp(a, zero, 4) ? NULL : "it is the wildcard address";
  if (inet_pton(AF_INET6, host, a) == 1)
    return memcmp(a, zero, 16) ? NULL : "it is the wildcard address";
  const char *zone = strchr(host, '%'); /* fe80::1%eth0 */
  if (zone != NULL && zone > host && (size_t)(zone - host) < INET6_ADDRSTRLEN && zone[1]) {
    char ip[INET6_ADDRSTRLEN];
    memcpy(ip, host, (size_t)(zone - host));
    ip[zone - host] = '\0';
    int named = 1;
    for (const char *z = zone + 1; *z; z++)
      named &= label_char(*z) || *z == '.' || *z == '_';
    if (named && inet_pton(AF_INET6, ip, a) == 1)
      return NULL;
  }
  if (strchr(host, ':') != NULL || strchr(host, '[') != NULL)
    return "it is no IP address or host name (give the host alone, no port or brackets)";
  size_t len = strlen(host), label = 0;
  if (len > 253 + (host[len - 1] == '.'))
    return "a host name is at most 253 bytes";
  for (size_t i = 0; i <= len; i++) {
    char c = host[i];
    if (c == '.' || c == '\0') {
      if (label == 0 && c == '.') /* ".a", "a..b"; a final dot ("a.") is fine */
        return "it is no IP address or host name (an empty label)";
      if (label > 63)
        return "a host name label is at most 63 bytes";
      if (label > 0 && (host[i - 1] == '-' || host[i - label] == '-'))
        return "it is no IP address or host name (a label begins or ends with '-')";
      label = 0;
      continue;
    }
    if (!label_char(c))
      return "it is no IP address or host name (only letters, digits, '-' and '.')";
    label++;
  }
  return NULL;
}
