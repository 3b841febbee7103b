/* Metadata store URL parsing.  See url.h for the grammar. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "url.h"

/* Percent-decode src[0..len) into dst (size bytes); 0 or -1. */
static int pct_decode(const char *src, size_t len, char *dst, size_t size) {
  size_t o = 0;
  for (size_t i = 0; i < len; i++) {
    char c = src[i];
    if (c == '%') {
      unsigned v;
      char hex[3] = {0};
      if (i + 2 >= len)
        return -1;
      hex[0] = src[i + 1];
      hex[1] = src[i + 2];
      if (sscanf(hex, "%2x", &v) != 1 || strspn(hex, "0123456789abcdefABCDEF") != 2)
        return -1;
      c = (char)v;
      i += 2;
    }
    if (c == '\0' || o + 1 >= size)
      return -1;
    dst[o++] = c;
  }
  dst[o] = '\0';
  return 0;
}

/* Characters of sentinel master and mem store names. */
static int name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         c == '.' || c == '_' || c == '-';
}

static int parse_u32(const char *s, size_t len, uint32_t max, uint32_t *out) {
  char buf[16];
  if (len == 0 || len >= sizeof(buf))
    return -1;
  memcpy(buf, s, len);
  buf[len] = '\0';
  if (strspn(buf, "0123456789") != len)
    return -1;
  errno = 0;
  unsigned long v = strtoul(buf, NULL, 10);
  if (errno || v > max)
    return -1;
  *out = (uint32_t)v;
  return 0;
}

/* One "host[:port]" or "[v6]:port" item of length len. */
static int parse_host(const char *s, size_t len, int idx, uint16_t dport,
                      sx_url_host *h) {
  const char *host = s, *port = NULL;
  size_t hlen = len;
  if (len == 0)
    return sx__err(SX_EURL, "metadata URL: host %d is empty", idx + 1);
  if (s[0] == '[') {
    const char *close = memchr(s, ']', len);
    if (close == NULL)
      return sx__err(SX_EURL, "metadata URL: host %d: '[' without ']'", idx + 1);
    host = s + 1;
    hlen = (size_t)(close - host);
    if (close + 1 < s + len) {
      if (close[1] != ':')
        return sx__err(SX_EURL, "metadata URL: host %d: junk after ']'", idx + 1);
      port = close + 2;
    }
  } else {
    const char *colon = memchr(s, ':', len);
    if (colon != NULL) {
      hlen = (size_t)(colon - s);
      port = colon + 1;
    }
  }
  if (hlen == 0 || hlen >= sizeof(h->host))
    return sx__err(SX_EURL, "metadata URL: host %d: name is empty or too long", idx + 1);
  for (size_t i = 0; i < hlen; i++) {
    char c = host[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
          c == '.' || c == '-' || c == '_' || c == ':' || c == '%'))
      return sx__err(SX_EURL, "metadata URL: host %d has character '%c'", idx + 1, c);
  }
  memcpy(h->host, host, hlen);
  h->host[hlen] = '\0';
  h->port = dport;
  if (port != NULL) {
    uint32_t p;
    size_t plen = (size_t)(s + len - port);
    if (parse_u32(port, plen, 65535, &p) || p == 0)
      return sx__err(SX_EURL, "metadata URL: port '%.*s' of host %d is not 1..65535",
                     (int)(plen > 16 ? 16 : plen), port, idx + 1);
    h->port = (uint16_t)p;
  }
  return 0;
}

/* Is q[0..klen) the key k? */
static int key_is(const char *q, size_t klen, const char *k) {
  return klen == strlen(k) && memcmp(q, k, klen) == 0;
}

static int parse_query(const char *q, sx_url *u) {
  int sentinel = strcmp(u->scheme, "redis+sentinel") == 0;
  /* Once sentinel_password was read, errors quote nothing of the query: an
   * unencoded '&' in the password makes its tail look like further items. */
  int quiet = 0;
  while (*q) {
    size_t len = strcspn(q, "&");
    const char *eq = memchr(q, '=', len);
    if (eq == NULL) {
      if (quiet)
        return sx__err(SX_EURL, "metadata URL: a query item after sentinel_password has "
                       "no '=' (not shown; percent-encode '&' in a password as %%26)");
      return sx__err(SX_EURL, "metadata URL: query item '%.*s' has no '='",
                     (int)(len > 40 ? 40 : len), q);
    }
    size_t klen = (size_t)(eq - q), vlen = len - klen - 1;
    const char *v = eq + 1;
    /* How much of a bad value or key an error may quote. */
    int vshow = quiet ? 0 : (int)(vlen > 64 ? 64 : vlen);
    if (key_is(q, klen, "namespace")) {
      /* pct_decode() leaves no message of its own: say what it refused. */
      if (pct_decode(v, vlen, u->ns, sizeof(u->ns)))
        return sx__err(SX_EURL, "metadata URL: namespace '%.*s' is longer than %d bytes "
                       "or badly percent-encoded", vshow, v, SX_NS_MAX);
      if (sx_ns_validate(u->ns))
        return sx__err(SX_EURL, "metadata URL: namespace '%.*s': %s", vshow, v,
                       sx_errmsg());
    } else if (key_is(q, klen, "timeout_ms")) {
      if (parse_u32(v, vlen, 3600000, &u->timeout_ms) || u->timeout_ms == 0)
        return sx__err(SX_EURL, "metadata URL: timeout_ms '%.*s' is not 1..3600000",
                       vshow > 16 ? 16 : vshow, v);
    } else if (key_is(q, klen, "connect_timeout_ms")) {
      if (parse_u32(v, vlen, 3600000, &u->connect_timeout_ms) ||
          u->connect_timeout_ms == 0)
        return sx__err(SX_EURL,
                       "metadata URL: connect_timeout_ms '%.*s' is not 1..3600000",
                       vshow > 16 ? 16 : vshow, v);
    } else if (key_is(q, klen, "index_refresh_ms")) {
      if (u->scheme[0] != 'r')
        return sx__err(SX_EURL, "metadata URL: index_refresh_ms is only for redis URLs "
                       "(%s:// has no listing index to refresh)", u->scheme);
      if (parse_u32(v, vlen, SX_URL_INDEX_REFRESH_MAX_MS, &u->index_refresh_ms))
        return sx__err(SX_EURL, "metadata URL: index_refresh_ms '%.*s' is not 0..%u",
                       vshow > 16 ? 16 : vshow, v, SX_URL_INDEX_REFRESH_MAX_MS);
    } else if (key_is(q, klen, "sentinel_user")) {
      if (!sentinel)
        return sx__err(SX_EURL, "metadata URL: sentinel_user is only for "
                       "redis+sentinel:// URLs (%s:// has no sentinels)", u->scheme);
      if (vlen == 0)
        return sx__err(SX_EURL, "metadata URL: sentinel_user is empty (leave it out to "
                       "AUTH with sentinel_password alone)");
      if (pct_decode(v, vlen, u->sentinel_user, sizeof(u->sentinel_user)))
        return sx__err(SX_EURL, "metadata URL: sentinel_user is too long or badly "
                       "%%-encoded");
    } else if (key_is(q, klen, "sentinel_password")) {
      if (!sentinel)
        return sx__err(SX_EURL, "metadata URL: sentinel_password is only for "
                       "redis+sentinel:// URLs (%s:// has no sentinels)",
                       u->scheme);
      if (vlen == 0)
        return sx__err(SX_EURL, "metadata URL: sentinel_password is empty");
      if (pct_decode(v, vlen, u->sentinel_password, sizeof(u->sentinel_password)))
        return sx__err(SX_EURL, "metadata URL: sentinel_password is too long or badly "
                       "%%-encoded (not shown)");
      u->has_sentinel_password = 1;
      quiet = 1;
    } else if (quiet) {
      return sx__err(SX_EURL, "metadata URL: unknown query parameter after "
                     "sentinel_password (not shown; percent-encode '&' in a password "
                     "as %%26)");
    } else {
      return sx__err(SX_EURL,
                     "metadata URL: unknown query parameter '%.*s' (known: namespace, "
                     "connect_timeout_ms, timeout_ms, index_refresh_ms, sentinel_user, "
                     "sentinel_password)",
                     (int)(klen > 40 ? 40 : klen), q);
    }
    q += len;
    if (*q == '&')
      q++;
  }
  if (u->sentinel_user[0] && !u->has_sentinel_password)
    return sx__err(SX_EURL, "metadata URL: sentinel_user needs sentinel_password");
  return 0;
}

/* Does [p, end) hold a sentinel credential query item ("?sentinel_..." or
 * "&sentinel_...")?  Then the '@' taken for the end of the user info is in
 * its value. */
static int query_key_before(const char *p, const char *end) {
  static const char *const keys[] = {"sentinel_password=", "sentinel_user="};
  for (const char *c = p; c < end; c++) {
    if (*c != '?' && *c != '&')
      continue;
    for (size_t k = 0; k < sizeof(keys) / sizeof(keys[0]); k++) {
      size_t n = strlen(keys[k]);
      if ((size_t)(end - c - 1) >= n && memcmp(c + 1, keys[k], n) == 0)
        return 1;
    }
  }
  return 0;
}

int sx__url_parse(const char *text, sx_url *out) {
  sx_url u;
  memset(&u, 0, sizeof(u));
  strcpy(u.ns, SX_URL_DEFAULT_NS);
  u.connect_timeout_ms = 2000;
  u.timeout_ms = 2000;
  u.index_refresh_ms = SX_URL_INDEX_REFRESH_MAX_MS;
  if (text == NULL || *text == '\0')
    return sx__err(SX_EURL, "metadata URL is empty (set --metadata or SX_METADATA_URL)");
  if (strlen(text) > 2048)
    return sx__err(SX_EURL, "metadata URL is longer than 2048 bytes");

  const char *sep = strstr(text, "://");
  if (sep == NULL)
    return sx__err(SX_EURL, "metadata URL has no scheme (expected redis://, "
                   "redis+sentinel://, redis+cluster://, etcd://)");
  size_t slen = (size_t)(sep - text);
  uint16_t dport;
  if (slen == 5 && memcmp(text, "redis", 5) == 0)
    dport = 6379;
  else if (slen == 14 && memcmp(text, "redis+sentinel", 14) == 0)
    dport = 26379;
  else if (slen == 13 && memcmp(text, "redis+cluster", 13) == 0)
    dport = 6379;
  else if ((slen == 4 && memcmp(text, "etcd", 4) == 0) ||
           (slen == 10 && memcmp(text, "etcd+https", 10) == 0))
    dport = 2379;
  else if (slen == 3 && memcmp(text, "mem", 3) == 0)
    dport = 0;
  else
    return sx__err(SX_EURL, "metadata URL: unknown scheme '%.*s' (expected redis, "
                   "redis+sentinel, redis+cluster, etcd)", (int)(slen > 24 ? 24 : slen), text);
  memcpy(u.scheme, text, slen);
  int is_redis = u.scheme[0] == 'r', is_sentinel = slen == 14, is_mem = dport == 0;
  int is_cluster = slen == 13;

  const char *p = sep + 3;
  /* The user info ends at the last '@' of the whole URL: '@' is valid in no
   * host and no query value, and a password with an unencoded '/', '?' or
   * '@' then still parses instead of being taken for a host or a query
   * (whose error messages would echo it). */
  const char *at = strrchr(p, '@');
  /* ... except in a sentinel credential, where it would misplace the user
   * info silently: there '@' must be percent-encoded. */
  if (at != NULL && query_key_before(p, at))
    return sx__err(SX_EURL, "metadata URL: '@' in sentinel_user or sentinel_password "
                   "must be percent-encoded as %%40 (not shown)");
  const char *hosts = at ? at + 1 : p;
  const char *query = strchr(hosts, '?');
  const char *end = query ? query : hosts + strlen(hosts);
  const char *path = memchr(hosts, '/', (size_t)(end - hosts));
  const char *auth_end = path ? path : end;
  if (at != NULL) {
    if (!is_redis)
      return sx__err(SX_EURL, "metadata URL: user/password are only for redis URLs");
    const char *colon = memchr(p, ':', (size_t)(at - p));
    const char *uend = colon ? colon : at;
    if (pct_decode(p, (size_t)(uend - p), u.user, sizeof(u.user)))
      return sx__err(SX_EURL, "metadata URL: user is too long or badly %%-encoded");
    if (colon != NULL) {
      if (pct_decode(colon + 1, (size_t)(at - colon - 1), u.password, sizeof(u.password)))
        return sx__err(SX_EURL, "metadata URL: password is too long or badly "
                       "%%-encoded (not shown)");
      u.has_password = 1;
    }
    p = at + 1;
  }

  if (is_mem) {
    size_t nlen = (size_t)(auth_end - p);
    if (nlen == 0 || nlen >= sizeof(u.master))
      return sx__err(SX_EURL, "metadata URL: mem:// needs a store name");
    for (size_t i = 0; i < nlen; i++)
      if (!name_char(p[i]))
        return sx__err(SX_EURL, "metadata URL: mem store name has character '%c'", p[i]);
    memcpy(u.master, p, nlen);
  } else {
    /* Comma-separated hosts. */
    const char *h = p;
    while (h <= auth_end) {
      const char *comma = memchr(h, ',', (size_t)(auth_end - h));
      const char *hend = comma ? comma : auth_end;
      if (u.n_hosts == SX_URL_MAX_HOSTS)
        return sx__err(SX_EURL, "metadata URL: more than %d hosts", SX_URL_MAX_HOSTS);
      if (u.n_hosts > 0 && is_redis && !is_sentinel && !is_cluster)
        return sx__err(SX_EURL, "metadata URL: redis:// takes one host; use "
                       "redis+sentinel:// or redis+cluster:// for several");
      int rc = parse_host(h, (size_t)(hend - h), u.n_hosts, dport, &u.hosts[u.n_hosts]);
      if (rc)
        return rc;
      u.n_hosts++;
      if (comma == NULL)
        break;
      h = comma + 1;
    }
  }

  /* Path: redis "/db"; sentinel "/master[/db]"; etcd and mem: none. */
  if (path != NULL && path + 1 < end) {
    const char *seg = path + 1;
    size_t len = (size_t)(end - seg);
    if (is_sentinel) {
      const char *slash = memchr(seg, '/', len);
      size_t mlen = slash ? (size_t)(slash - seg) : len;
      if (mlen == 0 || mlen >= sizeof(u.master))
        return sx__err(SX_EURL, "metadata URL: sentinel master name is empty or too long");
      for (size_t i = 0; i < mlen; i++)
        if (!name_char(seg[i]))
          return sx__err(SX_EURL, "metadata URL: sentinel master name has character "
                         "'%c' (allowed: letters, digits, ._-)", seg[i]);
      memcpy(u.master, seg, mlen);
      seg = slash ? slash + 1 : end;
      len = (size_t)(end - seg);
    }
    if (len > 0) {
      uint32_t db;
      if (is_cluster)
        return sx__err(SX_EURL, "metadata URL: redis+cluster:// takes no path: a cluster "
                       "has database 0 only ('/%.*s')", (int)(len > 40 ? 40 : len), seg);
      if (!is_redis)
        return sx__err(SX_EURL, "metadata URL: %s:// takes no path ('/%.*s')", u.scheme,
                       (int)(len > 40 ? 40 : len), seg);
      if (parse_u32(seg, len, 65535, &db))
        return sx__err(SX_EURL, "metadata URL: db '%.*s' is not a number",
                       (int)(len > 16 ? 16 : len), seg);
      u.db = (int)db;
    }
  }
  if (is_sentinel && u.master[0] == '\0')
    return sx__err(SX_EURL, "metadata URL: redis+sentinel:// needs /master-name after "
                   "the sentinel hosts");
  if (query != NULL) {
    int rc = parse_query(query + 1, &u);
    if (rc)
      return rc;
  }
  *out = u;
  return 0;
}

void sx__url_redact(const sx_url *u, char *buf, size_t size) {
  size_t o = 0;
#define PUT(...)                                                               \
  do {                                                                         \
    int n_ = snprintf(buf + o, o < size ? size - o : 0, __VA_ARGS__);          \
    if (n_ > 0)                                                                \
      o += (size_t)n_;                                                         \
  } while (0)
  PUT("%s://", u->scheme);
  if (u->user[0] || u->has_password)
    PUT("%s%s@", u->user, u->has_password ? ":***" : "");
  if (u->scheme[0] == 'm')
    PUT("%s", u->master);
  for (int i = 0; i < u->n_hosts; i++)
    PUT(strchr(u->hosts[i].host, ':') ? "%s[%s]:%u" : "%s%s:%u", i ? "," : "",
        u->hosts[i].host, u->hosts[i].port);
  if (strcmp(u->scheme, "redis+sentinel") == 0)
    PUT("/%s", u->master);
  if (u->db)
    PUT("/%d", u->db);
  PUT("?namespace=%s", u->ns);
#undef PUT
  if (size > 0 && o >= size)
    buf[size - 1] = '\0';
}
