/*
 * etcd's JSON wire: base64 bytes and int64 strings, key-values, the request
 * pieces the backend builds (ranges, puts, deletes, compares, transactions)
 * and the owner records it stores.  See etcd.h.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "etcd.h"
#include "internal.h"

static const char b64_chars[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

json_t *sx__etcd_b64(const void *bytes, size_t len) {
  const uint8_t *p = bytes;
  size_t olen = (len + 2) / 3 * 4;
  char *s = malloc(olen + 1);
  if (s == NULL)
    return NULL;
  size_t o = 0, i = 0;
  for (; i + 2 < len; i += 3) {
    uint32_t v = (uint32_t)p[i] << 16 | (uint32_t)p[i + 1] << 8 | p[i + 2];
    s[o++] = b64_chars[v >> 18];
    s[o++] = b64_chars[(v >> 12) & 63];
    s[o++] = b64_chars[(v >> 6) & 63];
    s[o++] = b64_chars[v & 63];
  }
  if (i < len) {
    uint32_t v = (uint32_t)p[i] << 16 | (i + 1 < len ? (uint32_t)p[i + 1] << 8 : 0);
    s[o++] = b64_chars[v >> 18];
    s[o++] = b64_chars[(v >> 12) & 63];
    s[o++] = i + 1 < len ? b64_chars[(v >> 6) & 63] : '=';
    s[o++] = '=';
  }
  json_t *j = json_stringn_nocheck(s, o);
  free(s);
  return j;
}

static int b64_val(char c) {
  if (c >= 'A' && c <= 'Z')
    return c - 'A';
  if (c >= 'a' && c <= 'z')
    return c - 'a' + 26;
  if (c >= '0' && c <= '9')
    return c - '0' + 52;
  if (c == '+' || c == '-')
    return 62;
  if (c == '/' || c == '_')
    return 63;
  return -1;
}

int sx__etcd_unb64(const char *text, size_t len, uint8_t **out, size_t *out_len) {
  while (len > 0 && text[len - 1] == '=')
    len--;
  if (len % 4 == 1)
    return sx__err(SX_EPROTO, "etcd: base64 text has a bad length");
  uint8_t *b = malloc(len / 4 * 3 + 3);
  if (b == NULL)
    return sx__err(SX_ENOMEM, "etcd: out of memory");
  size_t o = 0;
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < len; i++) {
    int v = b64_val(text[i]);
    if (v < 0) {
      free(b);
      return sx__err(SX_EPROTO, "etcd: not base64 (byte %zu)", i);
    }
    acc = acc << 6 | (uint32_t)v;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      b[o++] = (uint8_t)(acc >> bits);
    }
  }
  b[o] = 0;
  *out = b;
  *out_len = o;
  return 0;
}

int sx__etcd_i64(const json_t *obj, const char *field, int64_t *out) {
  const json_t *v = json_object_get(obj, field);
  if (v == NULL || json_is_null(v)) {
    *out = 0;
    return 0;
  }
  if (json_is_integer(v)) {
    *out = json_integer_value(v);
    return 0;
  }
  if (!json_is_string(v))
    return sx__err(SX_EPROTO, "etcd: field '%s' is not an integer", field);
  const char *s = json_string_value(v);
  size_t n = json_string_length(v);
  int neg = n > 0 && s[0] == '-';
  if (n == (size_t)neg || n > 20)
    return sx__err(SX_EPROTO, "etcd: field '%s' is not an integer", field);
  uint64_t acc = 0;
  for (size_t i = (size_t)neg; i < n; i++) {
    if (s[i] < '0' || s[i] > '9' || acc > (UINT64_MAX - 9) / 10)
      return sx__err(SX_EPROTO, "etcd: field '%s' is not an int64", field);
    acc = acc * 10 + (uint64_t)(s[i] - '0');
  }
  if (acc > (uint64_t)INT64_MAX + (uint64_t)neg)
    return sx__err(SX_EPROTO, "etcd: field '%s' is out of int64 range", field);
  *out = neg ? (int64_t)(0 - acc) : (int64_t)acc;
  return 0;
}

json_t *sx__etcd_i64_json(int64_t v) {
  char buf[24];
  snprintf(buf, sizeof(buf), "%lld", (long long)v);
  return json_string(buf);
}

int sx__etcd_kv_parse(const json_t *kv, sx__etcd_kv *out, char *err, size_t err_size) {
  sx__etcd_kv r;
  memset(&r, 0, sizeof(r));
  if (!json_is_object(kv)) {
    sx__etcd_say(err, err_size, "a key-value is not a JSON object");
    return SX_EPROTO;
  }
  const json_t *k = json_object_get(kv, "key"), *v = json_object_get(kv, "value");
  if (!json_is_string(k) || (v != NULL && !json_is_string(v))) {
    sx__etcd_say(err, err_size,
                 "a key-value has no key, or a key or value that is not text");
    return SX_EPROTO;
  }
  int rc =
      sx__etcd_unb64(json_string_value(k), json_string_length(k), &r.key, &r.key_len);
  if (rc == 0)
    rc = v ? sx__etcd_unb64(json_string_value(v), json_string_length(v), &r.value,
                            &r.value_len)
           : sx__etcd_unb64("", 0, &r.value, &r.value_len);
  if (rc == 0)
    rc = sx__etcd_i64(kv, "create_revision", &r.create_rev);
  if (rc == 0)
    rc = sx__etcd_i64(kv, "mod_revision", &r.mod_rev);
  if (rc == 0)
    rc = sx__etcd_i64(kv, "version", &r.version);
  if (rc == 0)
    rc = sx__etcd_i64(kv, "lease", &r.lease);
  if (rc != 0) {
    sx__etcd_say(err, err_size, "a key-value is malformed: %s", sx_errmsg());
    sx__etcd_kv_free(&r);
    return rc;
  }
  *out = r;
  return 0;
}

void sx__etcd_kv_free(sx__etcd_kv *kv) {
  free(kv->key);
  free(kv->value);
  kv->key = kv->value = NULL;
}

/* ---------------------------------------------------------------- requests */

/* Chainable JSON builders: any NULL (out of memory) makes the result NULL
 * and frees everything built so far. */
json_t *sx__etcd_jkv(json_t *o, const char *k, json_t *v) {
  if (o == NULL) {
    json_decref(v);
    return NULL;
  }
  if (v == NULL || json_object_set_new(o, k, v) != 0) {
    json_decref(o);
    return NULL;
  }
  return o;
}

json_t *sx__etcd_japp(json_t *a, json_t *v) {
  if (a == NULL) {
    json_decref(v);
    return NULL;
  }
  if (v == NULL || json_array_append_new(a, v) != 0) {
    json_decref(a);
    return NULL;
  }
  return a;
}

json_t *sx__etcd_jkey(const char *key) { return sx__etcd_b64(key, strlen(key)); }

json_t *sx__etcd_range(const char *key, const char *end, int keys_only) {
  json_t *r = sx__etcd_jkv(json_object(), "key", sx__etcd_jkey(key));
  if (end)
    r = sx__etcd_jkv(r, "range_end", sx__etcd_jkey(end));
  if (keys_only)
    r = sx__etcd_jkv(r, "keys_only", json_true());
  return sx__etcd_jkv(json_object(), "request_range", r);
}

json_t *sx__etcd_put(const char *key, const void *val, size_t len, int64_t lease) {
  json_t *p = sx__etcd_jkv(json_object(), "key", sx__etcd_jkey(key));
  p = sx__etcd_jkv(p, "value", sx__etcd_b64(val, len));
  if (lease != 0)
    p = sx__etcd_jkv(p, "lease", sx__etcd_i64_json(lease));
  return sx__etcd_jkv(json_object(), "request_put", p);
}

json_t *sx__etcd_delete(const char *key) {
  return sx__etcd_jkv(json_object(), "request_delete_range",
                      sx__etcd_jkv(json_object(), "key", sx__etcd_jkey(key)));
}

/* Compare a key's mod_revision ("MOD") or create_revision ("CREATE"); 0
 * stands for "the key does not exist". */
json_t *sx__etcd_cmp(const char *target, const char *key, int64_t rev) {
  json_t *c = sx__etcd_jkv(json_object(), "target", json_string(target));
  c = sx__etcd_jkv(c, "key", sx__etcd_jkey(key));
  c = sx__etcd_jkv(c, "result", json_string("EQUAL"));
  return sx__etcd_jkv(c, strcmp(target, "MOD") == 0 ? "mod_revision" : "create_revision",
                      sx__etcd_i64_json(rev));
}

json_t *sx__etcd_txn(json_t *compare, json_t *success, json_t *failure) {
  json_t *t = json_object();
  if (compare)
    t = sx__etcd_jkv(t, "compare", compare);
  t = sx__etcd_jkv(t, "success", success);
  if (failure)
    t = sx__etcd_jkv(t, "failure", failure);
  return t;
}

json_t *sx__etcd_id_req(const char *field, int64_t v) {
  return sx__etcd_jkv(json_object(), field, sx__etcd_i64_json(v));
}

/* The i-th response of a txn answer, a response_range: its first kv (if
 * any) into *kv and *found.  0 or SX_EPROTO with a message in err. */
int sx__etcd_txn_kv(const json_t *body, size_t i, sx__etcd_kv *kv, int *found, char *err,
                    size_t err_size) {
  const json_t *rs = json_object_get(body, "responses");
  const json_t *r = json_object_get(json_array_get(rs, i), "response_range");
  *found = 0;
  if (!json_is_object(r)) {
    sx__etcd_say(err, err_size, "transaction answer %zu is not a range answer", i);
    return SX_EPROTO;
  }
  const json_t *kvs = json_object_get(r, "kvs");
  if (kvs == NULL || json_array_size(kvs) == 0) {
    if (kvs != NULL && !json_is_array(kvs)) {
      sx__etcd_say(err, err_size, "range answer: kvs is not an array");
      return SX_EPROTO;
    }
    return 0;
  }
  int rc = sx__etcd_kv_parse(json_array_get(kvs, 0), kv, err, err_size);
  *found = rc == 0;
  return rc;
}

int sx__etcd_txn_ok(const json_t *body) {
  return json_is_true(json_object_get(body, "succeeded"));
}

int sx__etcd_owner_parse(const uint8_t *v, size_t len, sx__etcd_owner *o) {
  sx__etcd_owner r;
  memset(&r, 0, sizeof(r));
  json_t *j = json_loadb((const char *)v, len, 0, NULL);
  const json_t *inc = json_object_get(j, "inc");
  int64_t pub = 0, ttl = 0;
  int ok = json_is_object(j) && json_is_string(inc) &&
           json_string_length(inc) == 2 * SX_INCARNATION_LEN &&
           sx_unhex(json_string_value(inc), r.inc, SX_INCARNATION_LEN) == 0 &&
           json_is_string(json_object_get(j, "gen")) &&
           sx__etcd_i64(j, "pub", &pub) == 0 && sx__etcd_i64(j, "ttl", &ttl) == 0;
  if (ok) {
    /* Generations are uint64: parse the string ourselves. */
    const char *g = json_string_value(json_object_get(j, "gen"));
    char *end;
    errno = 0;
    unsigned long long u = strtoull(g, &end, 10);
    ok = *g >= '0' && *g <= '9' && *end == '\0' && errno == 0;
    r.gen = u;
  }
  json_decref(j);
  if (!ok)
    return SX_EDECODE;
  r.pub_ms = pub > 0 ? (uint64_t)pub : 0;
  r.ttl_s = ttl;
  *o = r;
  return 0;
}

int sx__etcd_owner_text(char *buf, size_t size, const uint8_t *inc, uint64_t gen,
                        int64_t ttl_s, const char *why) {
  char hex[2 * SX_INCARNATION_LEN + 1];
  sx_hex(inc, SX_INCARNATION_LEN, hex);
  return snprintf(
      buf, size,
      "{\"v\":1,\"inc\":\"%s\",\"gen\":\"%llu\",\"pub\":%llu,\"ttl\":%lld%s%s%s}", hex,
      (unsigned long long)gen, (unsigned long long)sx__wall_ms(), (long long)ttl_s,
      why ? ",\"why\":\"" : "", why ? why : "", why ? "\"" : "");
}
