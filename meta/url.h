/* Metadata store URLs.  Not installed. */
#ifndef SX_META_URL_H
#define SX_META_URL_H

#include <stddef.h>
#include <stdint.h>

#include "segxfer/descriptor.h"

#define SX_URL_MAX_HOSTS 16
#define SX_URL_DEFAULT_NS "default"

typedef struct sx_url_host {
  char host[256]; /* name or IP literal, without IPv6 brackets */
  uint16_t port;
} sx_url_host;

typedef struct sx_url {
  char scheme[24];  /* "redis", "redis+sentinel", "redis+cluster", "etcd",
                     * "etcd+https", "mem" */
  sx_url_host hosts[SX_URL_MAX_HOSTS];
  int n_hosts;
  char user[128];
  char password[256]; /* never printed: use sx__url_redact() */
  int has_password;
  char master[128];   /* redis+sentinel: the master name; mem: the store name */
  int db;             /* redis: SELECT db (0 when absent) */
  /* redis+sentinel: AUTH [sentinel_user] sentinel_password to the sentinels
   * (query keys; the sentinels' own credentials, not the master's). */
  char sentinel_user[128];
  char sentinel_password[256]; /* never printed */
  int has_sentinel_password;
  char ns[SX_NS_MAX + 1];
  uint32_t connect_timeout_ms; /* default 2000 */
  uint32_t timeout_ms;         /* per command, default 2000 */
  /* redis schemes: a renewal writes the listing index only when the last
   * index write of that segment is older than this (ms); 0 = every renewal.
   * At most SX_URL_INDEX_REFRESH_MAX_MS, the default. */
  uint32_t index_refresh_ms;
} sx_url;

/* A quarter of the Redis listing index's prune grace (30 s, meta/redis/
 * redis.h): an entry is rewritten well before list could prune it. */
#define SX_URL_INDEX_REFRESH_MAX_MS 7500u

/*
 * Parse
 *   redis://[user[:password]@]host[:port][/db][?query]
 *   redis+sentinel://[user[:password]@]host[:port][,host[:port]...]/master[/db][?query]
 *   redis+cluster://[user[:password]@]host[:port][,host[:port]...][?query]
 *                   (seed nodes of a Redis Cluster; database 0 only)
 *   etcd://host[:port][,host[:port]...][?query]     (also etcd+https://)
 *   mem://name[?query]                              (in-process, for tests)
 * with query keys namespace, connect_timeout_ms, timeout_ms, for the redis
 * schemes index_refresh_ms (0..7500), and for redis+sentinel:// also sentinel_user and sentinel_password (the sentinels'
 * AUTH).  User, password and the sentinel credentials may be percent-encoded
 * ('@' and '&' in the sentinel ones must be: %40, %26); IPv6 hosts go in
 * brackets.  Default ports: redis and redis+cluster 6379, sentinel 26379, etcd 2379.  Returns 0
 * or SX_EURL with a message naming the part that is wrong (passwords are
 * never echoed).
 */
int sx__url_parse(const char *text, sx_url *out);

/* The URL as text with the password replaced by "***"; of the query only
 * the namespace is shown (so never the sentinel credentials). */
void sx__url_redact(const sx_url *u, char *buf, size_t size);

#endif
