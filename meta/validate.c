/*
 * Descriptor validation: every rule a descriptor must satisfy before anything
 * (a cache, a planner, a transport) may use it.  Decode calls this on every
 * descriptor read from a store, so it is on the cold-resolve path: it must
 * stay linear in the number of regions apart from one sort.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "segxfer/descriptor.h"

/* Every resolve checks its name (twice: cache and store), so this is
 * branch-light: a letter in either case, a digit, or one of ._:/@+=- */
static int name_char_ok(unsigned char c) {
  if ((unsigned)((c | 0x20) - 'a') < 26u || (unsigned)(c - '0') < 10u)
    return 1;
  switch (c) {
  case '.': case '_': case ':': case '/': case '@': case '+': case '=': case '-':
    return 1;
  default:
    return 0;
  }
}

int sx_name_validate(const char *name) {
  if (name == NULL || name[0] == '\0')
    return sx__err(SX_ENAME, "segment name is empty");
  size_t len = strnlen(name, SX_NAME_MAX + 1);
  if (len > SX_NAME_MAX)
    return sx__err(SX_ENAME, "segment name is longer than %d bytes", SX_NAME_MAX);
  if (name[0] == '/' || name[0] == '.')
    return sx__err(SX_ENAME, "segment name '%s' starts with '%c'", name, name[0]);
  for (size_t i = 0; i < len; i++) {
    if (!name_char_ok((unsigned char)name[i]))
      return sx__err(SX_ENAME,
                     "segment name has byte 0x%02x at offset %zu; allowed are "
                     "letters, digits and ._:/@+=-",
                     (unsigned char)name[i], i);
  }
  return 0;
}

int sx_ns_validate(const char *ns) {
  if (ns == NULL || ns[0] == '\0')
    return sx__err(SX_ENAME, "namespace is empty");
  size_t len = strnlen(ns, SX_NS_MAX + 1);
  if (len > SX_NS_MAX)
    return sx__err(SX_ENAME, "namespace is longer than %d bytes", SX_NS_MAX);
  for (size_t i = 0; i < len; i++) {
    unsigned char c = (unsigned char)ns[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
          (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-'))
      return sx__err(SX_ENAME,
                     "namespace has byte 0x%02x at offset %zu; allowed are "
                     "letters, digits and ._-",
                     c, i);
  }
  return 0;
}

/* A short string field: NUL-terminated inside its array, printable ASCII. */
static int text_ok(const char *s, size_t size) {
  size_t n = strnlen(s, size);
  if (n == size)
    return 0;
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)s[i] < 0x20 || (unsigned char)s[i] > 0x7e)
      return 0;
  return 1;
}

static int all_zero(const uint8_t *p, size_t n) {
  uint8_t acc = 0;
  for (size_t i = 0; i < n; i++)
    acc |= p[i];
  return acc == 0;
}

/*
 * Bytes a region's block structure spans from addr:
 *   (layer_count-1)*layer_stride + (num_blocks-1)*block_stride + block_bytes
 * with num_blocks*block_stride also required to fit in 64 bits.
 */
static int region_span(const sx_region *r, uint64_t *span) {
  uint64_t blocks, layers, s;
  if (!sx__mul_ok(r->num_blocks, r->block_stride, &blocks))
    return sx__err(SX_EOVERFLOW, "region %u: num_blocks %lu * block_stride %lu "
                   "overflows 64 bits", r->id, (unsigned long)r->num_blocks,
                   (unsigned long)r->block_stride);
  if (!sx__mul_ok(r->layer_count - 1, r->layer_stride, &layers))
    return sx__err(SX_EOVERFLOW, "region %u: (layer_count-1) * layer_stride "
                   "overflows 64 bits", r->id);
  s = blocks - r->block_stride + r->block_bytes; /* num_blocks >= 1 */
  if (!sx__add_ok(s, layers, &s))
    return sx__err(SX_EOVERFLOW, "region %u: layer span overflows 64 bits", r->id);
  *span = s;
  return 0;
}

static int region_validate(const sx_region *r, uint32_t rdma_devices) {
  uint64_t end, span = 0;
  if (r->layer_count == 0)
    return sx__err(SX_ELAYERS, "region %u: layer_count is 0", r->id);
  if (r->layer_first > UINT32_MAX - (r->layer_count - 1))
    return sx__err(SX_EOVERFLOW, "region %u: layer_first %u + layer_count %u "
                   "overflows 32 bits", r->id, r->layer_first, r->layer_count);
  if (r->slot >= SX_MAX_SLOTS)
    return sx__err(SX_EINVAL, "region %u: slot %u is not below %d", r->id,
                   r->slot, SX_MAX_SLOTS);
  if (r->block_bytes == 0)
    return sx__err(SX_EINVAL, "region %u: block_bytes is 0", r->id);
  if (r->num_blocks == 0)
    return sx__err(SX_EINVAL, "region %u: num_blocks is 0", r->id);
  if (r->block_stride < r->block_bytes)
    return sx__err(SX_ESTRIDE, "region %u: block_stride %lu < block_bytes %lu",
                   r->id, (unsigned long)r->block_stride,
                   (unsigned long)r->block_bytes);
  if (r->layer_count > 1 && r->layer_stride == 0)
    return sx__err(SX_ESTRIDE, "region %u: layer_stride is 0 with layer_count %u",
                   r->id, r->layer_count);
  int rc = region_span(r, &span);
  if (rc)
    return rc;
  if (span > r->length)
    return sx__err(SX_EBOUNDS, "region %u: blocks span %lu bytes but length is %lu",
                   r->id, (unsigned long)span, (unsigned long)r->length);
  if (!sx__add_ok(r->addr, r->length, &end))
    return sx__err(SX_EOVERFLOW, "region %u: addr + length overflows 64 bits", r->id);
  if (r->n_rkeys != rdma_devices)
    return sx__err(SX_ERKEYS, "region %u: %u rkeys for %u RDMA endpoints", r->id,
                   r->n_rkeys, rdma_devices);
  if (r->n_wkeys != 0 && (r->n_wkeys != rdma_devices || !(r->access & SX_ACCESS_REMOTE_WRITE)))
    return sx__err(SX_ERKEYS, "region %u: %u write keys for %u RDMA endpoints%s", r->id,
                   r->n_wkeys, rdma_devices,
                   r->access & SX_ACCESS_REMOTE_WRITE ? "" : " on a region that is not writable");
  /* The chosen NIC names one of the RDMA endpoints: a reader looks that
   * endpoint up, so a number past them would name nothing. */
  if (r->nic > rdma_devices)
    return sx__err(SX_EINVAL, "region %u: nic %u names RDMA endpoint %u, but the descriptor "
                   "has %u", r->id, r->nic, r->nic, rdma_devices);
  if (r->location[0] == '\0' || !text_ok(r->location, sizeof(r->location)))
    return sx__err(SX_EINVAL, "region %u: location is empty or not printable", r->id);
  return 0;
}

/* Regions sorted by a 64-bit key, for the duplicate and overlap checks. */
typedef struct key_ent {
  uint64_t key;
  uint32_t idx;
} key_ent;

/*
 * Sort by key: a bottom-up merge sort with the comparison inline.  It runs
 * on every descriptor decoded (the cold-resolve path), where qsort()'s
 * indirect comparisons and generic element moves took as long as the rest
 * of the validation together.  tmp holds n entries.
 */
static void sort_ents(key_ent *a, key_ent *tmp, uint32_t n) {
  enum { RUN = 8 };
  /* Insertion-sort short runs, then merge runs of doubling width. */
  for (uint32_t lo = 0; lo < n; lo += RUN) {
    uint32_t hi = lo + RUN < n ? lo + RUN : n;
    for (uint32_t i = lo + 1; i < hi; i++) {
      key_ent e = a[i];
      uint32_t j = i;
      for (; j > lo && a[j - 1].key > e.key; j--)
        a[j] = a[j - 1];
      a[j] = e;
    }
  }
  key_ent *src = a, *dst = tmp;
  for (uint32_t w = RUN; w < n; w *= 2) {
    for (uint32_t lo = 0; lo < n; lo += 2 * w) {
      uint32_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
      uint32_t i = lo, j = mid, k = lo;
      while (i < mid && j < hi)
        dst[k++] = src[j].key < src[i].key ? src[j++] : src[i++];
      while (i < mid)
        dst[k++] = src[i++];
      while (j < hi)
        dst[k++] = src[j++];
    }
    key_ent *t = src;
    src = dst;
    dst = t;
  }
  if (src != a)
    memcpy(a, src, n * sizeof(*a));
}

/* Groups are limited to 26 bits so that (group, slot, layer) packs into 64. */
#define SX__MAX_GROUP ((1u << 26) - 1)

static uint64_t layer_key(const sx_region *r) {
  return (uint64_t)r->group << 38 | (uint64_t)r->slot << 32 | r->layer_first;
}

static uint64_t id_key(const sx_region *r) { return r->id; }

/* Fill ents (n entries) with key(region) and sort them unless already sorted. */
static void sort_keys(const sx_desc *d, uint64_t (*key)(const sx_region *),
                      key_ent *ents, key_ent *tmp) {
  int sorted = 1;
  for (uint32_t i = 0; i < d->n_regions; i++) {
    ents[i].key = key(&d->regions[i]);
    ents[i].idx = i;
    sorted &= i == 0 || ents[i - 1].key <= ents[i].key;
  }
  if (!sorted)
    sort_ents(ents, tmp, d->n_regions);
}

static int keys_validate(const sx_desc *d) {
  key_ent stack[2 * 256], *ents = stack;
  uint32_t n = d->n_regions;
  int rc = 0;
  if (n < 2)
    return 0;
  if (2 * n > SX__ARRAY_SIZE(stack) && (ents = malloc(2 * n * sizeof(*ents))) == NULL)
    return sx__err(SX_ENOMEM, "checking region keys");
  key_ent *tmp = ents + n;
  sort_keys(d, id_key, ents, tmp);
  for (uint32_t i = 1; i < n && rc == 0; i++)
    if (ents[i - 1].key == ents[i].key)
      rc = sx__err(SX_EDUPLICATE, "region id %u appears twice",
                   (unsigned)ents[i].key);
  if (rc == 0)
    sort_keys(d, layer_key, ents, tmp);
  for (uint32_t i = 1; i < n && rc == 0; i++) {
    const sx_region *a = &d->regions[ents[i - 1].idx], *b = &d->regions[ents[i].idx];
    if (a->group == b->group && a->slot == b->slot &&
        (uint64_t)a->layer_first + a->layer_count > b->layer_first) {
      char s[16];
      rc = sx__err(SX_EOVERLAP, "regions %u and %u both hold group %u layer %u slot %s",
                   a->id, b->id, b->group, b->layer_first, sx_slot_name(b->slot, s));
    }
  }
  if (ents != stack)
    free(ents);
  return rc;
}

static int endpoint_validate(const sx_endpoint *e, uint32_t i) {
  if (e->kind != SX_TRANSPORT_TCP && e->kind != SX_TRANSPORT_RDMA &&
      e->kind != SX_TRANSPORT_CUDA_IPC)
    return sx__err(SX_EINVAL, "endpoint %u: unknown transport kind %d", i, (int)e->kind);
  if (e->addr[0] == '\0' || !text_ok(e->addr, sizeof(e->addr)))
    return sx__err(SX_EINVAL, "endpoint %u: addr is empty or not printable", i);
  if (e->port == 0)
    return sx__err(SX_EINVAL, "endpoint %u: port is 0", i);
  if (e->kind == SX_TRANSPORT_RDMA) {
    if (e->device[0] == '\0' || !text_ok(e->device, sizeof(e->device)))
      return sx__err(SX_EINVAL, "endpoint %u: RDMA device name is empty", i);
    if (e->port_num == 0)
      return sx__err(SX_EINVAL, "endpoint %u: RDMA port_num is 0", i);
    if (e->mtu != 256 && e->mtu != 512 && e->mtu != 1024 && e->mtu != 2048 &&
        e->mtu != 4096)
      return sx__err(SX_EINVAL, "endpoint %u: RDMA mtu %u is not 256..4096", i, e->mtu);
  }
  return 0;
}

/* Host identity: a boot id is a lower-case 8-4-4-4-12 hex UUID; a hostname
 * is letters, digits, '.', '_' and '-'.  Both may be empty (unknown), but
 * a cuda_ipc endpoint is only meaningful with a boot id. */
static int host_validate(const sx_desc *d) {
  size_t n = strnlen(d->host_id, sizeof(d->host_id));
  if (n == sizeof(d->host_id) || (n != 0 && n != SX_HOST_ID_LEN))
    return sx__err(SX_EINVAL, "%s: host_id is not a %d-character boot id", d->name,
                   SX_HOST_ID_LEN);
  for (size_t i = 0; i < n; i++) {
    char c = d->host_id[i];
    int dash = i == 8 || i == 13 || i == 18 || i == 23;
    if (dash ? c != '-' : !((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')))
      return sx__err(SX_EINVAL, "%s: host_id is not a boot id (character %zu)", d->name,
                     i);
  }
  size_t h = strnlen(d->hostname, sizeof(d->hostname));
  if (h == sizeof(d->hostname))
    return sx__err(SX_ELIMIT, "%s: hostname is longer than %d bytes", d->name,
                   SX_HOSTNAME_MAX);
  for (size_t i = 0; i < h; i++) {
    char c = d->hostname[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
          c == '.' || c == '_' || c == '-'))
      return sx__err(SX_EINVAL, "%s: hostname has a character outside [A-Za-z0-9._-]",
                     d->name);
  }
  for (uint32_t i = 0; i < d->n_endpoints; i++)
    if (d->endpoints[i].kind == SX_TRANSPORT_CUDA_IPC && n == 0)
      return sx__err(SX_EMISSING, "%s: endpoint %u is cuda_ipc but host_id is empty",
                     d->name, i);
  return 0;
}

/* The rules on layout and regions alone (also used for layout files). */
int sx__layout_validate(const sx_desc *d) {
  const sx_layout *l = &d->layout;
  if (d->n_regions > SX_MAX_REGIONS)
    return sx__err(SX_ELIMIT, "%u regions; the limit is %u", d->n_regions,
                   SX_MAX_REGIONS);
  if (d->n_labels > SX_MAX_LABELS)
    return sx__err(SX_ELIMIT, "%u labels; the limit is %u", d->n_labels, SX_MAX_LABELS);
  if (!text_ok(l->fingerprint, sizeof(l->fingerprint)) || !text_ok(l->tag, sizeof(l->tag)) ||
      !text_ok(l->dtype, sizeof(l->dtype)))
    return sx__err(SX_EINVAL, "layout: fingerprint, tag or dtype not printable text");
  if ((l->tp_size && l->tp_rank >= l->tp_size) || (l->pp_size && l->pp_rank >= l->pp_size))
    return sx__err(SX_EINVAL, "layout: rank not below size (tp %u/%u, pp %u/%u)",
                   l->tp_rank, l->tp_size, l->pp_rank, l->pp_size);
  for (uint32_t i = 0; i < d->n_labels; i++) {
    if (d->labels[i].key[0] == '\0' ||
        !text_ok(d->labels[i].key, sizeof(d->labels[i].key)))
      return sx__err(SX_EINVAL, "label %u: key is empty or not printable", i);
    if (strnlen(d->labels[i].value, sizeof(d->labels[i].value)) ==
        sizeof(d->labels[i].value))
      return sx__err(SX_ELIMIT, "label %u: value too long", i);
  }
  uint32_t devices = sx_desc_rdma_devices(d);
  for (uint32_t i = 0; i < d->n_regions; i++) {
    int rc = region_validate(&d->regions[i], devices);
    if (rc)
      return rc;
    if (d->regions[i].group > SX__MAX_GROUP)
      return sx__err(SX_EINVAL, "region %u: group %u is above %u", d->regions[i].id,
                     d->regions[i].group, SX__MAX_GROUP);
  }
  int rc = keys_validate(d);
  return rc ? rc : sx__blocks_validate(d);
}

int sx_desc_validate(const sx_desc *d) {
  if (d == NULL)
    return sx__err(SX_EINVAL, "descriptor is NULL");
  if (d->schema_version != SX_SCHEMA_VERSION)
    return sx__err(SX_EVERSION, "schema_version %u; this build reads %d",
                   d->schema_version, SX_SCHEMA_VERSION);
  int rc = sx_name_validate(d->name);
  if (rc)
    return rc;
  if (all_zero(d->incarnation, sizeof(d->incarnation)))
    return sx__err(SX_EMISSING, "%s: incarnation is missing", d->name);
  if (all_zero(d->token, sizeof(d->token)))
    return sx__err(SX_EMISSING, "%s: access token is missing", d->name);
  if (d->n_endpoints > SX_MAX_ENDPOINTS)
    return sx__err(SX_ELIMIT, "%s: %u endpoints; the limit is %u", d->name,
                   d->n_endpoints, SX_MAX_ENDPOINTS);
  if (sx_desc_rdma_devices(d) > SX_MAX_DEVICES)
    return sx__err(SX_ELIMIT, "%s: more than %u RDMA endpoints", d->name,
                   SX_MAX_DEVICES);
  for (uint32_t i = 0; i < d->n_endpoints; i++)
    if ((rc = endpoint_validate(&d->endpoints[i], i)) != 0)
      return rc;
  if ((rc = host_validate(d)) != 0)
    return rc;
  return sx__layout_validate(d);
}
