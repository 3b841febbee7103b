/*
 * Parsing what Redis answers: pure functions over hiredis replies, so that
 * the fuzz target (tests/fuzz/fuzz_redis.c) reaches every one of them with
 * replies a hostile or broken server could send.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "redis.h"

int sx__redis_parse_u64(const char *s, uint64_t *out) {
  char *end;
  if (s == NULL || *s < '0' || *s > '9')
    return -1;
  unsigned long long v = strtoull(s, &end, 10);
  if (*end != '\0')
    return -1;
  *out = v;
  return 0;
}

int sx__redis_parse_i64(const char *s, int64_t *out) {
  char *end;
  if (s == NULL || *s == '\0')
    return -1;
  long long v = strtoll(s, &end, 10);
  if (*end != '\0')
    return -1;
  *out = v;
  return 0;
}

int sx__redis_read_value(const redisReply *h, const redisReply *ttl, uint8_t **value,
                         size_t *len, int64_t *ttl_ms, int64_t *lease, char *msg,
                         size_t msize) {
  char desc[160];
  *value = NULL;
  *len = 0;
  *ttl_ms = -1;
  *lease = -1;
  if (h->type == REDIS_REPLY_ERROR)
    return sx__redis_read_error(h, msg, msize);
  if (h->type != REDIS_REPLY_ARRAY || h->elements != 2) {
    sx__redis_describe(h, desc, sizeof(desc));
    snprintf(msg, msize, "unexpected reply to HMGET: %s", desc);
    return SX_ESTORE;
  }
  const redisReply *d = h->element[0];
  if (d->type == REDIS_REPLY_NIL)
    return 0;
  if (d->type != REDIS_REPLY_STRING) {
    snprintf(msg, msize, "field d is not a string");
    return SX_EDECODE;
  }
  if (d->len > SX_MAX_DESC_BYTES) {
    snprintf(msg, msize, "stored value of %zu bytes is over the %u-byte limit", d->len,
             SX_MAX_DESC_BYTES);
    return SX_ELIMIT;
  }
  if (ttl->type == REDIS_REPLY_INTEGER && ttl->integer >= 0)
    *ttl_ms = ttl->integer;
  const char *l = sx__redis_elem_str(h, 1, 20);
  int64_t lv;
  if (l != NULL && sx__redis_parse_i64(l, &lv) == 0 && lv > 0)
    *lease = lv;
  *value = malloc(d->len ? d->len : 1);
  if (*value == NULL) {
    snprintf(msg, msize, "out of memory");
    return SX_ENOMEM;
  }
  memcpy(*value, d->str, d->len);
  *len = d->len;
  return 0;
}

int sx__redis_parse_held(const redisReply *r, uint8_t holder[SX_INCARNATION_LEN],
                         uint64_t *age_ms, int64_t *ttl_ms) {
  const char *inc = sx__redis_elem_str(r, 1, 64);
  int64_t ttl = -1, age = 0;
  *age_ms = 0;
  (void)sx__redis_parse_i64(sx__redis_elem_str(r, 3, 24), &ttl);
  *ttl_ms = ttl;
  if (sx__redis_parse_i64(sx__redis_elem_str(r, 2, 24), &age) == 0 && age > 0)
    *age_ms = (uint64_t)age;
  if (inc == NULL || strlen(inc) != 2 * SX_INCARNATION_LEN ||
      sx_unhex(inc, holder, SX_INCARNATION_LEN) != 0)
    return -1;
  return 0;
}

int sx__redis_expiry_name(const char *prefix, size_t pre, const redisReply *chan,
                          const redisReply *what, char name[SX_NAME_MAX + 1]) {
  if (chan->type != REDIS_REPLY_STRING || what->type != REDIS_REPLY_STRING)
    return -1;
  if (!(what->len == 7 && memcmp(what->str, "expired", 7) == 0) &&
      !(what->len == 7 && memcmp(what->str, "evicted", 7) == 0))
    return -1;
  if (chan->len < pre + 3 || memcmp(chan->str, prefix, pre) != 0 ||
      chan->str[pre] != '{' || chan->str[chan->len - 1] != '}')
    return -1;
  size_t nlen = chan->len - pre - 2;
  if (nlen == 0 || nlen > SX_NAME_MAX)
    return -1;
  memcpy(name, chan->str + pre + 1, nlen);
  name[nlen] = '\0';
  return sx_name_validate(name) == 0 ? 0 : -1;
}
