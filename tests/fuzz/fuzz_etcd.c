/*
 * Fuzz target: what the etcd backend parses from the server (JSON answers,
 * key-values, transaction answers, watch messages, owner records).  Nothing
 * may crash, and whatever parses must hold up: NUL-terminated buffers of the
 * stated length.
 */
#include <stdlib.h>
#include <string.h>

#include "etcd/etcd.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_kv(const sx__etcd_kv *kv) {
  if (kv->key == NULL || kv->value == NULL || kv->key[kv->key_len] != 0 ||
      kv->value[kv->value_len] != 0)
    abort();
}

static void try_kv(const json_t *j) {
  sx__etcd_kv kv;
  char err[256];
  if (sx__etcd_kv_parse(j, &kv, err, sizeof(err)) == 0) {
    check_kv(&kv);
    sx__etcd_kv_free(&kv);
  } else if (memchr(err, '\0', sizeof(err)) == NULL) {
    abort();
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  sx__etcd_owner who;
  sx__etcd_owner_parse(data, size, &who);
  uint8_t *bytes;
  size_t n;
  if (sx__etcd_unb64((const char *)data, size, &bytes, &n) == 0) {
    if (bytes[n] != 0 || n > size)
      abort();
    free(bytes);
  }
  json_t *j = json_loadb((const char *)data, size, 0, NULL);
  if (j == NULL)
    return 0;
  /* A key-value, a range answer, a txn answer, a watch message. */
  try_kv(j);
  const json_t *kvs = json_object_get(j, "kvs");
  for (size_t i = 0; i < json_array_size(kvs); i++)
    try_kv(json_array_get(kvs, i));
  for (size_t i = 0; i < 3; i++) {
    sx__etcd_kv kv;
    int found;
    char err[256];
    if (sx__etcd_txn_kv(j, i, &kv, &found, err, sizeof(err)) == 0 && found) {
      check_kv(&kv);
      sx__etcd_kv_free(&kv);
    }
  }
  sx__etcd_txn_ok(j);
  const json_t *res = json_object_get(j, "result");
  const json_t *events = json_object_get(res ? res : j, "events");
  for (size_t i = 0; i < json_array_size(events); i++)
    try_kv(json_object_get(json_array_get(events, i), "kv"));
  int64_t v;
  sx__etcd_i64(json_object_get(j, "header"), "revision", &v);
  sx__etcd_i64(j, "TTL", &v);
  sx__etcd_i64(j, "compact_revision", &v);
  json_decref(j);
  return 0;
}
