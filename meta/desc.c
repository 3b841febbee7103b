/* Building, copying and querying descriptors in their plain C form. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "segxfer/descriptor.h"

void sx_desc_init(sx_desc *d) {
  memset(d, 0, sizeof(*d));
  d->schema_version = SX_SCHEMA_VERSION;
}

void sx_desc_free(sx_desc *d) {
  if (d == NULL)
    return;
  free(d->endpoints);
  free(d->regions);
  free(d->labels);
  sx_desc_init(d);
}

/*
 * The three arrays grow in powers of two from 4 and their capacity is implied
 * by their count, so every allocation of them goes through array_cap().
 */
static size_t array_cap(size_t n) {
  size_t cap = 4;
  while (cap < n)
    cap *= 2;
  return n == 0 ? 0 : cap;
}

/* Only the n elements are zeroed: decoding fills every one of them, and
 * zeroing the unused capacity too (up to twice as much) was a measurable
 * part of decoding a large descriptor. */
void *sx__desc_array(size_t n, size_t size) {
  if (n == 0)
    return NULL;
  void *p = malloc(array_cap(n) * size);
  if (p != NULL)
    memset(p, 0, n * size);
  return p;
}

static void *dup_array(const void *src, size_t n, size_t size) {
  void *p = sx__desc_array(n, size);
  if (p != NULL)
    memcpy(p, src, n * size);
  return p;
}

int sx_desc_copy(sx_desc *dst, const sx_desc *src) {
  sx_desc tmp = *src;
  tmp.endpoints = dup_array(src->endpoints, src->n_endpoints, sizeof(sx_endpoint));
  tmp.regions = dup_array(src->regions, src->n_regions, sizeof(sx_region));
  tmp.labels = dup_array(src->labels, src->n_labels, sizeof(sx_label));
  if ((src->n_endpoints && !tmp.endpoints) || (src->n_regions && !tmp.regions) ||
      (src->n_labels && !tmp.labels)) {
    free(tmp.endpoints);
    free(tmp.regions);
    free(tmp.labels);
    return sx__err(SX_ENOMEM, "copying descriptor %s", src->name);
  }
  *dst = tmp;
  return 0;
}

/* Make room for element n (0-based) of an array holding n elements. */
static int make_room(void **arr, uint32_t n, size_t size) {
  if (array_cap(n + 1) == array_cap(n))
    return 0;
  void *p = realloc(*arr, array_cap(n + 1) * size);
  if (p == NULL)
    return sx__err(SX_ENOMEM, "growing a descriptor array");
  *arr = p;
  return 0;
}

int sx_desc_add_region(sx_desc *d, const sx_region *r) {
  if (d->n_regions >= SX_MAX_REGIONS)
    return sx__err(SX_ELIMIT, "more than %u regions", SX_MAX_REGIONS);
  if (make_room((void **)&d->regions, d->n_regions, sizeof(*r)))
    return SX_ENOMEM;
  d->regions[d->n_regions++] = *r;
  return 0;
}

int sx_desc_add_endpoint(sx_desc *d, const sx_endpoint *e) {
  if (d->n_endpoints >= SX_MAX_ENDPOINTS)
    return sx__err(SX_ELIMIT, "more than %u endpoints", SX_MAX_ENDPOINTS);
  if (make_room((void **)&d->endpoints, d->n_endpoints, sizeof(*e)))
    return SX_ENOMEM;
  d->endpoints[d->n_endpoints++] = *e;
  return 0;
}

int sx_desc_set_label(sx_desc *d, const char *key, const char *value) {
  if (key == NULL || value == NULL || key[0] == '\0')
    return sx__err(SX_EINVAL, "label key must not be empty");
  if (strlen(key) > SX_LABEL_KEY_MAX || strlen(value) > SX_LABEL_VALUE_MAX)
    return sx__err(SX_ELIMIT, "label %.64s: key over %d or value over %d bytes",
                   key, SX_LABEL_KEY_MAX, SX_LABEL_VALUE_MAX);
  for (uint32_t i = 0; i < d->n_labels; i++) {
    if (strcmp(d->labels[i].key, key) == 0) {
      memset(d->labels[i].value, 0, sizeof(d->labels[i].value));
      strcpy(d->labels[i].value, value);
      return 0;
    }
  }
  if (d->n_labels >= SX_MAX_LABELS)
    return sx__err(SX_ELIMIT, "more than %u labels", SX_MAX_LABELS);
  if (make_room((void **)&d->labels, d->n_labels, sizeof(sx_label)))
    return SX_ENOMEM;
  sx_label *l = &d->labels[d->n_labels++];
  memset(l, 0, sizeof(*l));
  strcpy(l->key, key);
  strcpy(l->value, value);
  return 0;
}

const char *sx_desc_label(const sx_desc *d, const char *key) {
  for (uint32_t i = 0; i < d->n_labels; i++)
    if (strcmp(d->labels[i].key, key) == 0)
      return d->labels[i].value;
  return NULL;
}

int sx_desc_remove_region(sx_desc *d, uint32_t id) {
  for (uint32_t i = 0; i < d->n_regions; i++) {
    if (d->regions[i].id == id) {
      memmove(&d->regions[i], &d->regions[i + 1],
              (d->n_regions - i - 1) * sizeof(sx_region));
      d->n_regions--;
      return 0;
    }
  }
  return sx__err(SX_ENOREGION, "no region %u in %s", id, d->name);
}

const sx_region *sx_desc_find(const sx_desc *d, uint32_t group, uint32_t layer,
                              uint32_t slot) {
  for (uint32_t i = 0; i < d->n_regions; i++) {
    const sx_region *r = &d->regions[i];
    if (r->group == group && r->slot == slot && layer >= r->layer_first &&
        layer - r->layer_first < r->layer_count)
      return r;
  }
  return NULL;
}

uint32_t sx_desc_rdma_devices(const sx_desc *d) {
  uint32_t n = 0;
  for (uint32_t i = 0; i < d->n_endpoints; i++)
    n += d->endpoints[i].kind == SX_TRANSPORT_RDMA;
  return n;
}

const sx_endpoint *sx_desc_region_nic(const sx_desc *d, const sx_region *r) {
  uint32_t ordinal = 0;
  if (r->nic == 0)
    return NULL;
  for (uint32_t i = 0; i < d->n_endpoints; i++) {
    if (d->endpoints[i].kind != SX_TRANSPORT_RDMA)
      continue;
    if (++ordinal == r->nic)
      return &d->endpoints[i];
  }
  return NULL;
}

uint64_t sx_desc_total_bytes(const sx_desc *d) {
  uint64_t sum = 0;
  for (uint32_t i = 0; i < d->n_regions; i++)
    sum += d->regions[i].length;
  return sum;
}

const char *sx_event_kind_name(sx_event_kind k) {
  switch (k) {
  case SX_EVENT_PUT:
    return "put";
  case SX_EVENT_DELETE:
    return "delete";
  case SX_EVENT_EXPIRED:
    return "expired";
  }
  return "unknown";
}

static const char *const slot_names[] = {"K", "V", "index", "state"};

const char *sx_slot_name(uint32_t slot, char buf[16]) {
  if (slot < SX__ARRAY_SIZE(slot_names))
    snprintf(buf, 16, "%s", slot_names[slot]);
  else
    snprintf(buf, 16, "slot%u", slot);
  return buf;
}

int sx_slot_parse(const char *s, uint32_t *slot) {
  for (uint32_t i = 0; i < SX__ARRAY_SIZE(slot_names); i++) {
    if (strcasecmp(s, slot_names[i]) == 0) {
      *slot = i;
      return 0;
    }
  }
  const char *num = strncmp(s, "slot", 4) == 0 ? s + 4 : s;
  char *end;
  unsigned long v = strtoul(num, &end, 10);
  /* Digits only: strtoul also takes blanks and a sign ("+1", " 1", "-0"). */
  if (*num < '0' || *num > '9' || *end != '\0' || v >= SX_MAX_SLOTS)
    return sx__err(SX_EINVAL, "bad slot '%.32s': use K, V, index, state or 0..%d",
                   s, SX_MAX_SLOTS - 1);
  *slot = (uint32_t)v;
  return 0;
}

void sx_hex(const uint8_t *bytes, size_t len, char *out) {
  static const char digits[] = "0123456789abcdef";
  for (size_t i = 0; i < len; i++) {
    out[2 * i] = digits[bytes[i] >> 4];
    out[2 * i + 1] = digits[bytes[i] & 15];
  }
  out[2 * len] = '\0';
}

static int hexval(char c) {
  if (c >= '0' && c <= '9')
    return c - '0';
  if (c >= 'a' && c <= 'f')
    return c - 'a' + 10;
  if (c >= 'A' && c <= 'F')
    return c - 'A' + 10;
  return -1;
}

int sx_unhex(const char *hex, uint8_t *bytes, size_t len) {
  if (strlen(hex) != 2 * len)
    return sx__err(SX_EINVAL, "expected %zu hex digits", 2 * len);
  for (size_t i = 0; i < len; i++) {
    int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
    if (hi < 0 || lo < 0)
      return sx__err(SX_EINVAL, "not a hex digit in '%.40s'", hex);
    bytes[i] = (uint8_t)(hi << 4 | lo);
  }
  return 0;
}
