/*
 * Redis Cluster's arithmetic and what its nodes answer about the slot map:
 * pure functions over strings and hiredis replies, so that the unit test
 * (tests/test_cluster_slots.c) and the fuzz target reach each of them with
 * answers a broken or hostile node could send.  The client that uses them
 * is redis_cluster.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "redis.h"

/* CRC16-CCITT (XMODEM: polynomial 0x1021, initial value 0), the checksum
 * the Redis Cluster specification hashes keys with.  Bitwise: keys are
 * short, and a table would be 512 bytes of cache for a few dozen bytes of
 * input per command. */
uint16_t sx__rcl_crc16(const char *buf, size_t len) {
  uint16_t crc = 0;
  for (size_t i = 0; i < len; i++) {
    crc ^= (uint16_t)((uint16_t)(unsigned char)buf[i] << 8);
    for (int b = 0; b < 8; b++)
      crc = (crc & 0x8000) ? (uint16_t)((crc << 1) ^ 0x1021) : (uint16_t)(crc << 1);
  }
  return crc;
}

/* The slot of a key: only the part between the first '{' and the first '}'
 * after it is hashed, when that part is not empty (a hash tag), so that
 * keys sharing a tag share a slot. */
unsigned sx__rcl_key_slot(const char *key, size_t len) {
  const char *open = memchr(key, '{', len);
  if (open != NULL) {
    size_t rest = len - (size_t)(open + 1 - key);
    const char *close = memchr(open + 1, '}', rest);
    if (close != NULL && close > open + 1)
      return sx__rcl_crc16(open + 1, (size_t)(close - open - 1)) & (SX_RCL_SLOTS - 1);
  }
  return sx__rcl_crc16(key, len) & (SX_RCL_SLOTS - 1);
}

int sx__rcl_parse_redirect(const redisReply *r, int *ask, unsigned *slot, char *host,
                           size_t hsize, int *port) {
  if (r == NULL || r->type != REDIS_REPLY_ERROR)
    return -1;
  const char *p;
  if (r->len > 6 && memcmp(r->str, "MOVED ", 6) == 0) {
    *ask = 0;
    p = r->str + 6;
  } else if (r->len > 4 && memcmp(r->str, "ASK ", 4) == 0) {
    *ask = 1;
    p = r->str + 4;
  } else {
    return -1;
  }
  /* "<slot> <host>:<port>"; the host may be an IPv6 literal (colons), so
   * the port follows the last colon.  An empty host means "the node you
   * asked" (Redis 7 with an unknown endpoint answers so). */
  char *end;
  unsigned long s = strtoul(p, &end, 10);
  if (end == p || *end != ' ' || s >= SX_RCL_SLOTS)
    return -1;
  const char *addr = end + 1, *stop = r->str + r->len;
  const char *colon = NULL;
  for (const char *c = addr; c < stop; c++)
    if (*c == ':')
      colon = c;
  if (colon == NULL || (size_t)(colon - addr) >= hsize)
    return -1;
  char digits[8];
  size_t dl = (size_t)(stop - colon - 1);
  if (dl == 0 || dl >= sizeof(digits))
    return -1;
  memcpy(digits, colon + 1, dl);
  digits[dl] = '\0';
  if (strspn(digits, "0123456789") != dl)
    return -1;
  long pt = strtol(digits, NULL, 10);
  if (pt < 1 || pt > 65535)
    return -1;
  for (const char *c = addr; c < colon; c++)
    if ((unsigned char)*c <= 0x20 || (unsigned char)*c >= 0x7f)
      return -1;
  memcpy(host, addr, (size_t)(colon - addr));
  host[colon - addr] = '\0';
  *slot = (unsigned)s;
  *port = (int)pt;
  return 0;
}

/* A node entry of CLUSTER SLOTS: [ip, port, id, ...]. */
static int slots_node(const redisReply *n, sx_rcl_range *out) {
  if (n->type != REDIS_REPLY_ARRAY || n->elements < 2 ||
      n->element[0]->type != REDIS_REPLY_STRING ||
      n->element[1]->type != REDIS_REPLY_INTEGER)
    return -1;
  const redisReply *ip = n->element[0];
  if (ip->len >= sizeof(out->host) || n->element[1]->integer < 1 ||
      n->element[1]->integer > 65535)
    return -1;
  for (size_t i = 0; i < ip->len; i++)
    if ((unsigned char)ip->str[i] <= 0x20 || (unsigned char)ip->str[i] >= 0x7f)
      return -1;
  /* "?" is Redis 7's unknown endpoint: like "", the node that answered. */
  if (ip->len == 1 && ip->str[0] == '?')
    out->host[0] = '\0';
  else
    memcpy(out->host, ip->str, ip->len), out->host[ip->len] = '\0';
  out->port = (int)n->element[1]->integer;
  return 0;
}

int sx__rcl_parse_slots(const redisReply *r, sx_rcl_range *out, size_t max, size_t *n,
                        char *msg, size_t msize) {
  char desc[160];
  *n = 0;
  if (r->type != REDIS_REPLY_ARRAY) {
    sx__redis_describe(r, desc, sizeof(desc));
    snprintf(msg, msize, "CLUSTER SLOTS answered %s", desc);
    return -1;
  }
  if (r->elements > max) {
    snprintf(msg, msize, "CLUSTER SLOTS answered %zu ranges (at most %zu taken)",
             r->elements, max);
    return -1;
  }
  for (size_t i = 0; i < r->elements; i++) {
    const redisReply *e = r->element[i];
    if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
        e->element[0]->type != REDIS_REPLY_INTEGER ||
        e->element[1]->type != REDIS_REPLY_INTEGER) {
      snprintf(msg, msize, "CLUSTER SLOTS: range %zu is malformed", i);
      return -1;
    }
    long long a = e->element[0]->integer, b = e->element[1]->integer;
    if (a < 0 || b < a || b >= SX_RCL_SLOTS) {
      snprintf(msg, msize, "CLUSTER SLOTS: range %zu (%lld-%lld) is outside 0-%d", i, a, b,
               SX_RCL_SLOTS - 1);
      return -1;
    }
    out[*n].first = (unsigned)a;
    out[*n].last = (unsigned)b;
    if (slots_node(e->element[2], &out[*n]) != 0) {
      snprintf(msg, msize, "CLUSTER SLOTS: the master of range %lld-%lld is malformed", a,
               b);
      return -1;
    }
    (*n)++;
  }
  return 0;
}

int sx__rcl_uncovered(const sx_rcl_range *ranges, size_t n, char *msg, size_t msize) {
  /* A bitmap on the stack: agents on other threads may refresh at once. */
  unsigned char seen[SX_RCL_SLOTS / 8];
  memset(seen, 0, sizeof(seen));
  for (size_t i = 0; i < n; i++)
    for (unsigned s = ranges[i].first; s <= ranges[i].last; s++)
      seen[s / 8] |= (unsigned char)(1u << (s % 8));
  unsigned missing = 0, first = 0, last = 0;
  for (unsigned s = 0; s < SX_RCL_SLOTS; s++) {
    if (seen[s / 8] & (1u << (s % 8)))
      continue;
    if (missing == 0)
      first = s;
    if (missing == 0 || last + 1 == s)
      last = s;
    missing++;
  }
  if (missing == 0)
    return 0;
  snprintf(msg, msize, "%u of %u hash slots have no master (the first gap: %u-%u)",
           missing, SX_RCL_SLOTS, first, last);
  return (int)missing;
}

/* The value after key in a flat [key, value, ...] array, or NULL. */
static const redisReply *field(const redisReply *map, const char *key) {
  if (map->type != REDIS_REPLY_ARRAY)
    return NULL;
  for (size_t i = 0; i + 1 < map->elements; i += 2) {
    const redisReply *k = map->element[i];
    if (k->type == REDIS_REPLY_STRING && k->len == strlen(key) &&
        memcmp(k->str, key, k->len) == 0)
      return map->element[i + 1];
  }
  return NULL;
}

static int field_is(const redisReply *map, const char *key, const char *want) {
  const redisReply *v = field(map, key);
  return v != NULL && v->type == REDIS_REPLY_STRING && v->len == strlen(want) &&
         memcmp(v->str, want, v->len) == 0;
}

/* The master of a shard's node list: its endpoint (else ip) and port.
 * 0; -1 when it has no healthy master; -2 when the list or the master's
 * entry is malformed. */
static int shard_master(const redisReply *nodes, sx_rcl_range *out) {
  if (nodes == NULL || nodes->type != REDIS_REPLY_ARRAY)
    return -2;
  for (size_t i = 0; i < nodes->elements; i++) {
    const redisReply *nd = nodes->element[i];
    if (!field_is(nd, "role", "master") || field_is(nd, "health", "fail"))
      continue;
    const redisReply *port = field(nd, "port"), *host = field(nd, "endpoint");
    if (host == NULL || host->type != REDIS_REPLY_STRING)
      host = field(nd, "ip");
    if (port == NULL || port->type != REDIS_REPLY_INTEGER || host == NULL ||
        host->type != REDIS_REPLY_STRING)
      return -2;
    /* As a CLUSTER SLOTS node entry, [host, port], for one set of checks. */
    redisReply *elems[2] = {(redisReply *)host, (redisReply *)port};
    redisReply entry = {.type = REDIS_REPLY_ARRAY, .elements = 2, .element = elems};
    return slots_node(&entry, out) == 0 ? 0 : -2;
  }
  return -1;
}

int sx__rcl_parse_shards(const redisReply *r, sx_rcl_range *out, size_t max, size_t *n,
                         char *msg, size_t msize) {
  char desc[160];
  *n = 0;
  if (r->type != REDIS_REPLY_ARRAY) {
    sx__redis_describe(r, desc, sizeof(desc));
    snprintf(msg, msize, "CLUSTER SHARDS answered %s", desc);
    return -1;
  }
  for (size_t i = 0; i < r->elements; i++) {
    const redisReply *sh = r->element[i], *slots = field(sh, "slots");
    if (slots == NULL || slots->type != REDIS_REPLY_ARRAY || slots->elements % 2 != 0) {
      snprintf(msg, msize, "CLUSTER SHARDS: shard %zu is malformed", i);
      return -1;
    }
    if (slots->elements == 0)
      continue; /* a shard without slots (a new master) */
    /* Every range is checked, also those of a shard without a healthy
     * master (a malformed answer is refused, not half taken). */
    for (size_t k = 0; k < slots->elements; k += 2) {
      const redisReply *a = slots->element[k], *b = slots->element[k + 1];
      if (a->type != REDIS_REPLY_INTEGER || b->type != REDIS_REPLY_INTEGER || a->integer < 0 ||
          b->integer < a->integer || b->integer >= SX_RCL_SLOTS) {
        snprintf(msg, msize, "CLUSTER SHARDS: shard %zu has a bad slot range", i);
        return -1;
      }
    }
    sx_rcl_range master;
    int mrc = shard_master(field(sh, "nodes"), &master);
    if (mrc == -2) {
      snprintf(msg, msize, "CLUSTER SHARDS: the nodes of shard %zu are malformed", i);
      return -1;
    }
    if (mrc != 0)
      continue; /* no healthy master: its slots stay uncovered (and are said so) */
    for (size_t k = 0; k < slots->elements; k += 2) {
      const redisReply *a = slots->element[k], *b = slots->element[k + 1];
      if (*n >= max) {
        snprintf(msg, msize, "CLUSTER SHARDS answered more than %zu ranges", max);
        return -1;
      }
      out[*n] = master;
      out[*n].first = (unsigned)a->integer;
      out[*n].last = (unsigned)b->integer;
      (*n)++;
    }
  }
  return 0;
}
