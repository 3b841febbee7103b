/*
 * Descriptor and event codec: protobuf (protoc-c generated, private to the
 * library) to and from the plain C structs of segxfer/descriptor.h.
 *
 * Decoding is on the cold-resolve path, so protobuf-c allocates from an arena
 * (one malloc for most descriptors, freed at once), regions come as one
 * columnar table (see proto/segxfer.proto), and a pre-scan of the top-level
 * fields rejects oversized repeated fields before any allocation: a 1 MiB
 * buffer of empty Endpoint messages must not become 500k allocations.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "segxfer.pb-c.h"
#include "segxfer/descriptor.h"

/* ---------------------------------------------------------------- arena */

typedef struct arena_chunk {
  struct arena_chunk *next;
  size_t used, size;
  max_align_t data[];
} arena_chunk;

typedef struct arena {
  ProtobufCAllocator pb;
  arena_chunk *head;
  size_t total;
} arena;

#define ARENA_MAX ((size_t)64 << 20)

static void *arena_alloc(void *data, size_t size) {
  arena *a = data;
  size = (size + sizeof(max_align_t) - 1) & ~(sizeof(max_align_t) - 1);
  arena_chunk *c = a->head;
  if (c == NULL || c->size - c->used < size) {
    size_t want = c == NULL ? 16384 : c->size * 2;
    if (want < size)
      want = size;
    if (a->total + want > ARENA_MAX)
      return NULL;
    c = malloc(sizeof(*c) + want);
    if (c == NULL)
      return NULL;
    c->next = a->head;
    c->used = 0;
    c->size = want;
    a->head = c;
    a->total += want;
  }
  void *p = (char *)c->data + c->used;
  c->used += size;
  return p;
}

static void arena_free_one(void *data, void *ptr) {
  (void)data;
  (void)ptr; /* freed all at once by arena_release() */
}

static void arena_init(arena *a) {
  memset(a, 0, sizeof(*a));
  a->pb.alloc = arena_alloc;
  a->pb.free = arena_free_one;
  a->pb.allocator_data = a;
}

static void arena_release(arena *a) {
  while (a->head != NULL) {
    arena_chunk *c = a->head;
    a->head = c->next;
    free(c);
  }
}

/* ---------------------------------------------------------------- pre-scan */

/* Read a varint; 0 on success. */
static int varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
  uint64_t r = 0;
  for (int shift = 0; shift < 64 && *p < end; shift += 7) {
    uint8_t b = *(*p)++;
    r |= (uint64_t)(b & 0x7f) << shift;
    if ((b & 0x80) == 0) {
      *v = r;
      return 0;
    }
  }
  return -1;
}

/*
 * Count occurrences of each top-level field number below 16 without
 * allocating.  Malformed input returns -1 (protobuf-c then reports it).
 */
static int prescan(const uint8_t *buf, size_t len, uint32_t counts[16]) {
  const uint8_t *p = buf, *end = buf + len;
  memset(counts, 0, 16 * sizeof(counts[0]));
  while (p < end) {
    uint64_t tag, v;
    if (varint(&p, end, &tag))
      return -1;
    uint64_t field = tag >> 3;
    switch (tag & 7) {
    case 0:
      if (varint(&p, end, &v))
        return -1;
      break;
    case 1:
      if (end - p < 8)
        return -1;
      p += 8;
      break;
    case 2:
      if (varint(&p, end, &v) || v > (uint64_t)(end - p))
        return -1;
      p += v;
      break;
    case 5:
      if (end - p < 4)
        return -1;
      p += 4;
      break;
    default:
      return -1;
    }
    if (field < 16)
      counts[field]++;
  }
  return 0;
}

/* ---------------------------------------------------------------- encode */

/*
 * Fill the region table's columns from d.  A column whose entries are all 0
 * is left empty (the decoder reads an empty column as all zeros).
 */
#define COLUMN(tab, field, type, expr)                                         \
  do {                                                                         \
    type *col_ = arena_alloc(a, n * sizeof(type) + 1);                         \
    int any_ = 0;                                                              \
    if (col_ == NULL)                                                          \
      return -1;                                                               \
    for (uint32_t i = 0; i < n; i++) {                                         \
      const sx_region *r = &d->regions[i];                                     \
      (void)r;                                                                 \
      col_[i] = (expr);                                                        \
      any_ |= col_[i] != 0;                                                    \
    }                                                                          \
    (tab)->field = col_;                                                       \
    (tab)->n_##field = any_ ? n : 0;                                           \
  } while (0)

static int find_location(char **locs, size_t n, const char *loc) {
  for (size_t i = 0; i < n; i++)
    if (strcmp(locs[i], loc) == 0)
      return (int)i;
  return -1;
}

static int pack_regions(arena *a, const sx_desc *d, Sxpb__RegionTable *t) {
  uint32_t n = d->n_regions;
  uint32_t *loc_idx = arena_alloc(a, n * sizeof(uint32_t) + 1);
  char **locs = arena_alloc(a, n * sizeof(char *) + 1);
  /* Validated descriptors have one rkey per RDMA endpoint in every region;
   * sx__desc_pack() also writes unvalidated ones, so take region 0's count
   * (at most SX_MAX_DEVICES: sx__desc_pack() checked every region's). */
  uint32_t devices = n ? d->regions[0].n_rkeys : 0;
  uint32_t *rkeys = arena_alloc(a, (size_t)n * devices * sizeof(uint32_t) + 1);
  uint32_t *wkeys = arena_alloc(a, (size_t)n * devices * sizeof(uint32_t) + 1);
  size_t n_locs = 0, n_wkeys = 0;
  if (loc_idx == NULL || locs == NULL || rkeys == NULL || wkeys == NULL)
    return -1;
  for (uint32_t i = 0; i < n; i++) {
    const sx_region *r = &d->regions[i];
    int li = find_location(locs, n_locs, r->location);
    if (li < 0) {
      li = (int)n_locs;
      locs[n_locs++] = (char *)r->location;
    }
    loc_idx[i] = (uint32_t)li;
    memcpy(&rkeys[(size_t)i * devices], r->rkeys, devices * sizeof(uint32_t));
    for (uint32_t k = 0; k < devices; k++)
      wkeys[(size_t)i * devices + k] = k < r->n_wkeys ? r->wkeys[k] : 0;
    if (r->n_wkeys > 0)
      n_wkeys = (size_t)n * devices;
  }
  t->id = arena_alloc(a, n * sizeof(uint32_t) + 1);
  if (t->id == NULL)
    return -1;
  for (uint32_t i = 0; i < n; i++)
    t->id[i] = d->regions[i].id;
  t->n_id = n;
  COLUMN(t, group, uint32_t, r->group);
  COLUMN(t, layer_first, uint32_t, r->layer_first);
  COLUMN(t, layer_count, uint32_t, r->layer_count);
  COLUMN(t, layer_stride, uint64_t, r->layer_stride);
  COLUMN(t, slot, uint32_t, r->slot);
  COLUMN(t, addr, uint64_t, r->addr);
  COLUMN(t, length, uint64_t, r->length);
  COLUMN(t, block_bytes, uint64_t, r->block_bytes);
  COLUMN(t, block_stride, uint64_t, r->block_stride);
  COLUMN(t, num_blocks, uint64_t, r->num_blocks);
  COLUMN(t, access, uint32_t, r->access);
  COLUMN(t, location, uint32_t, loc_idx[i]);
  COLUMN(t, nic, uint32_t, r->nic);
  t->locations = locs;
  t->n_locations = n_locs;
  t->rkeys_per_region = devices;
  t->rkeys = rkeys;
  t->n_rkeys = (size_t)n * devices;
  t->wkeys = wkeys;
  t->n_wkeys = n_wkeys;
  return 0;
}
#undef COLUMN

int sx_desc_encode(const sx_desc *d, uint8_t **out, size_t *out_len) {
  int rc = sx_desc_validate(d);
  return rc ? rc : sx__desc_pack(d, out, out_len);
}

int sx__desc_pack(const sx_desc *d, uint8_t **out, size_t *out_len) {
  /* Unvalidated descriptors come here too (tests, hostile-store fixtures):
   * the key arrays hold SX_MAX_DEVICES entries whatever the counts say, so
   * a larger count is refused rather than read past the arrays. */
  for (uint32_t i = 0; i < d->n_regions; i++)
    if (d->regions[i].n_rkeys > SX_MAX_DEVICES || d->regions[i].n_wkeys > SX_MAX_DEVICES)
      return sx__err(SX_ERKEYS, "encoding %s: region %u has %u rkeys and %u write keys; "
                     "at most %d of each", d->name, d->regions[i].id, d->regions[i].n_rkeys,
                     d->regions[i].n_wkeys, SX_MAX_DEVICES);
  arena a;
  arena_init(&a);
  Sxpb__SegmentDescriptor m = SXPB__SEGMENT_DESCRIPTOR__INIT;
  Sxpb__Layout layout = SXPB__LAYOUT__INIT;
  m.schema_version = d->schema_version;
  m.name = (char *)d->name;
  m.incarnation.data = (uint8_t *)d->incarnation;
  m.incarnation.len = sizeof(d->incarnation);
  m.generation = d->generation;
  m.published_at_ms = d->published_at_ms;
  m.lease_ms = d->lease_ms;
  m.token.data = (uint8_t *)d->token;
  m.token.len = sizeof(d->token);
  m.host_id = (char *)d->host_id;
  m.hostname = (char *)d->hostname;
  m.process = d->process;
  layout.fingerprint = (char *)d->layout.fingerprint;
  layout.tag = (char *)d->layout.tag;
  layout.dtype = (char *)d->layout.dtype;
  layout.tp_rank = d->layout.tp_rank;
  layout.tp_size = d->layout.tp_size;
  layout.pp_rank = d->layout.pp_rank;
  layout.pp_size = d->layout.pp_size;
  layout.layer_first = d->layout.layer_first;
  layout.layer_count = d->layout.layer_count;
  Sxpb__BlockDesc bds[SX_MAX_BLOCK_DESCS], *bdp[SX_MAX_BLOCK_DESCS];
  if (d->layout.n_blocks > SX_MAX_BLOCK_DESCS)
    return sx__err(SX_ELIMIT, "encoding %s: %u block descriptions; at most %d", d->name,
                   d->layout.n_blocks, SX_MAX_BLOCK_DESCS);
  for (uint32_t i = 0; i < d->layout.n_blocks; i++) {
    const sx_block_desc *b = &d->layout.blocks[i];
    sxpb__block_desc__init(&bds[i]);
    bds[i].group = b->group;
    bds[i].order = (uint32_t)b->order;
    bds[i].tokens = b->tokens;
    bds[i].head_first = b->head_first;
    bds[i].head_count = b->head_count;
    bds[i].heads_total = b->heads_total;
    bds[i].head_dim = b->head_dim;
    bds[i].dtype = (char *)b->dtype;
    bds[i].slots = b->slots;
    bdp[i] = &bds[i];
  }
  layout.blocks = bdp;
  layout.n_blocks = d->layout.n_blocks;
  m.layout = &layout;

  Sxpb__Endpoint *eps = arena_alloc(&a, d->n_endpoints * sizeof(*eps) + 1);
  Sxpb__Endpoint **epp = arena_alloc(&a, d->n_endpoints * sizeof(*epp) + 1);
  Sxpb__Label *labs = arena_alloc(&a, d->n_labels * sizeof(*labs) + 1);
  Sxpb__Label **labp = arena_alloc(&a, d->n_labels * sizeof(*labp) + 1);
  Sxpb__RegionTable table = SXPB__REGION_TABLE__INIT;
  if (!eps || !epp || !labs || !labp || pack_regions(&a, d, &table)) {
    arena_release(&a);
    return sx__err(SX_ENOMEM, "encoding %s", d->name);
  }
  m.regions = &table;

  for (uint32_t i = 0; i < d->n_endpoints; i++) {
    const sx_endpoint *e = &d->endpoints[i];
    Sxpb__Endpoint *pe = &eps[i];
    sxpb__endpoint__init(pe);
    pe->kind = (Sxpb__TransportKind)e->kind;
    pe->addr = (char *)e->addr;
    pe->port = e->port;
    if (e->kind == SX_TRANSPORT_RDMA) {
      pe->device = (char *)e->device;
      pe->gid.data = (uint8_t *)e->gid;
      pe->gid.len = sizeof(e->gid);
      pe->port_num = e->port_num;
      pe->mtu = e->mtu;
    }
    epp[i] = pe;
  }
  m.endpoints = epp;
  m.n_endpoints = d->n_endpoints;

  for (uint32_t i = 0; i < d->n_labels; i++) {
    sxpb__label__init(&labs[i]);
    labs[i].key = (char *)d->labels[i].key;
    labs[i].value = (char *)d->labels[i].value;
    labp[i] = &labs[i];
  }
  m.labels = labp;
  m.n_labels = d->n_labels;

  size_t len = sxpb__segment_descriptor__get_packed_size(&m);
  if (len > SX_MAX_DESC_BYTES) {
    arena_release(&a);
    return sx__err(SX_ELIMIT, "%s encodes to %zu bytes; the limit is %u", d->name,
                   len, SX_MAX_DESC_BYTES);
  }
  uint8_t *buf = malloc(len ? len : 1);
  if (buf == NULL) {
    arena_release(&a);
    return sx__err(SX_ENOMEM, "encoding %s", d->name);
  }
  sxpb__segment_descriptor__pack(&m, buf);
  arena_release(&a);
  *out = buf;
  *out_len = len;
  return 0;
}

/* ---------------------------------------------------------------- decode */

/* Copy a decoded string into a fixed field; code names the rule broken. */
static int take_str(char *dst, size_t size, const char *src, const char *what,
                    int code) {
  size_t n = strlen(src);
  if (n >= size)
    return sx__err(code, "%s is %zu bytes; the limit is %zu", what, n, size - 1);
  memcpy(dst, src, n + 1);
  return 0;
}

static int take_bytes(uint8_t *dst, size_t size, ProtobufCBinaryData b,
                      const char *what) {
  if (b.len == 0)
    return sx__err(SX_EMISSING, "%s is missing", what);
  if (b.len != size)
    return sx__err(SX_EDECODE, "%s is %zu bytes, expected %zu", what, b.len, size);
  memcpy(dst, b.data, size);
  return 0;
}

/* A column must have one entry per region, or none (all zeros). */
#define CHECK_COLUMN(t, field)                                                 \
  do {                                                                         \
    if ((t)->n_##field != 0 && (t)->n_##field != n)                            \
      return sx__err(SX_EDECODE, "region column " #field " has %zu entries "   \
                     "for %zu regions", (t)->n_##field, n);                    \
  } while (0)
#define COL(t, field, i) ((t)->n_##field ? (t)->field[i] : 0)

static int unpack_regions(const Sxpb__RegionTable *t, sx_desc *d) {
  size_t n = t->n_id;
  if (n > SX_MAX_REGIONS)
    return sx__err(SX_ELIMIT, "descriptor has %zu regions; the limit is %u", n,
                   SX_MAX_REGIONS);
  CHECK_COLUMN(t, group);
  CHECK_COLUMN(t, layer_first);
  CHECK_COLUMN(t, layer_count);
  CHECK_COLUMN(t, layer_stride);
  CHECK_COLUMN(t, slot);
  CHECK_COLUMN(t, addr);
  CHECK_COLUMN(t, length);
  CHECK_COLUMN(t, block_bytes);
  CHECK_COLUMN(t, block_stride);
  CHECK_COLUMN(t, num_blocks);
  CHECK_COLUMN(t, access);
  CHECK_COLUMN(t, location);
  CHECK_COLUMN(t, nic);
  if (t->rkeys_per_region > SX_MAX_DEVICES)
    return sx__err(SX_ERKEYS, "%u rkeys per region; at most %d devices",
                   t->rkeys_per_region, SX_MAX_DEVICES);
  if (t->n_rkeys != n * t->rkeys_per_region)
    return sx__err(SX_ERKEYS, "%zu rkeys for %zu regions of %u keys each", t->n_rkeys,
                   n, t->rkeys_per_region);
  if (t->n_wkeys != 0 && t->n_wkeys != t->n_rkeys)
    return sx__err(SX_ERKEYS, "%zu write keys for %zu rkeys", t->n_wkeys, t->n_rkeys);
  if (n > 0 && t->n_locations == 0)
    return sx__err(SX_EDECODE, "regions have no location table");
  if (t->n_locations > n)
    return sx__err(SX_EDECODE, "%zu locations for %zu regions", t->n_locations, n);
  for (size_t i = 0; i < t->n_locations; i++)
    if (strlen(t->locations[i]) > SX_TAG_MAX)
      return sx__err(SX_ELIMIT, "location %zu is longer than %d bytes", i, SX_TAG_MAX);
  if (n > 0 && (d->regions = sx__desc_array(n, sizeof(sx_region))) == NULL)
    return sx__err(SX_ENOMEM, "decoding %zu regions", n);
  for (size_t i = 0; i < n; i++) {
    sx_region *r = &d->regions[i];
    uint32_t loc = COL(t, location, i);
    if (loc >= t->n_locations)
      return sx__err(SX_EDECODE, "region %u: location index %u of %zu", t->id[i], loc,
                     t->n_locations);
    r->id = t->id[i];
    r->group = COL(t, group, i);
    r->layer_first = COL(t, layer_first, i);
    r->layer_count = COL(t, layer_count, i);
    r->layer_stride = COL(t, layer_stride, i);
    r->slot = COL(t, slot, i);
    r->addr = COL(t, addr, i);
    r->length = COL(t, length, i);
    r->block_bytes = COL(t, block_bytes, i);
    r->block_stride = COL(t, block_stride, i);
    r->num_blocks = COL(t, num_blocks, i);
    r->access = COL(t, access, i);
    r->nic = COL(t, nic, i);
    strcpy(r->location, t->locations[loc]);
    r->n_rkeys = t->rkeys_per_region;
    if (r->n_rkeys)
      memcpy(r->rkeys, &t->rkeys[i * r->n_rkeys], r->n_rkeys * sizeof(uint32_t));
    /* A region has write keys when any of its entries is not 0 (validate
     * then wants one per endpoint, on a writable region). */
    for (uint32_t k = 0; t->n_wkeys && k < r->n_rkeys; k++)
      r->n_wkeys |= t->wkeys[i * r->n_rkeys + k] != 0;
    if (r->n_wkeys) {
      r->n_wkeys = r->n_rkeys;
      memcpy(r->wkeys, &t->wkeys[i * r->n_rkeys], r->n_rkeys * sizeof(uint32_t));
    }
  }
  d->n_regions = (uint32_t)n;
  return 0;
}
#undef CHECK_COLUMN
#undef COL

static int convert(const Sxpb__SegmentDescriptor *m, sx_desc *d) {
  int rc;
  if (m->schema_version != SX_SCHEMA_VERSION)
    return sx__err(SX_EVERSION, "schema_version %u; this build reads %d",
                   m->schema_version, SX_SCHEMA_VERSION);
  d->schema_version = m->schema_version;
  if ((rc = take_str(d->name, sizeof(d->name), m->name, "name", SX_ENAME)))
    return rc;
  if ((rc = take_bytes(d->incarnation, sizeof(d->incarnation), m->incarnation,
                       "incarnation")) ||
      (rc = take_bytes(d->token, sizeof(d->token), m->token, "access token")))
    return rc;
  d->generation = m->generation;
  d->published_at_ms = m->published_at_ms;
  d->lease_ms = m->lease_ms;
  if ((rc = take_str(d->host_id, sizeof(d->host_id), m->host_id, "host_id", SX_ELIMIT)) ||
      (rc = take_str(d->hostname, sizeof(d->hostname), m->hostname, "hostname",
                     SX_ELIMIT)))
    return rc;
  d->process = m->process;
  if (m->layout != NULL) {
    const Sxpb__Layout *l = m->layout;
    if ((rc = take_str(d->layout.fingerprint, sizeof(d->layout.fingerprint),
                       l->fingerprint, "layout.fingerprint", SX_ELIMIT)) ||
        (rc = take_str(d->layout.tag, sizeof(d->layout.tag), l->tag, "layout.tag",
                       SX_ELIMIT)) ||
        (rc = take_str(d->layout.dtype, sizeof(d->layout.dtype), l->dtype,
                       "layout.dtype", SX_ELIMIT)))
      return rc;
    d->layout.tp_rank = l->tp_rank;
    d->layout.tp_size = l->tp_size;
    d->layout.pp_rank = l->pp_rank;
    d->layout.pp_size = l->pp_size;
    d->layout.layer_first = l->layer_first;
    d->layout.layer_count = l->layer_count;
    if (l->n_blocks > SX_MAX_BLOCK_DESCS)
      return sx__err(SX_ELIMIT, "layout has %zu block descriptions; the limit is %d",
                     l->n_blocks, SX_MAX_BLOCK_DESCS);
    for (size_t i = 0; i < l->n_blocks; i++) {
      const Sxpb__BlockDesc *pb = l->blocks[i];
      sx_block_desc *b = &d->layout.blocks[i];
      if (pb->order > SX_KV_MLA)
        return sx__err(SX_EINVAL, "block description %zu: order %u is unknown", i,
                       pb->order);
      b->group = pb->group;
      b->order = (sx_kv_order)pb->order;
      b->tokens = pb->tokens;
      b->head_first = pb->head_first;
      b->head_count = pb->head_count;
      b->heads_total = pb->heads_total;
      b->head_dim = pb->head_dim;
      b->slots = pb->slots;
      if ((rc = take_str(b->dtype, sizeof(b->dtype), pb->dtype, "block description dtype",
                         SX_ELIMIT)))
        return rc;
    }
    d->layout.n_blocks = (uint32_t)l->n_blocks;
  }

  for (size_t i = 0; i < m->n_endpoints; i++) {
    const Sxpb__Endpoint *pe = m->endpoints[i];
    sx_endpoint *e = &d->endpoints[i];
    if (pe->port > UINT16_MAX)
      return sx__err(SX_EINVAL, "endpoint %zu: port %u is above 65535", i, pe->port);
    if (pe->port_num > UINT8_MAX)
      return sx__err(SX_EINVAL, "endpoint %zu: port_num %u is above 255", i,
                     pe->port_num);
    e->kind = (sx_transport_kind)pe->kind;
    e->port = (uint16_t)pe->port;
    e->port_num = (uint8_t)pe->port_num;
    e->mtu = pe->mtu;
    if ((rc = take_str(e->addr, sizeof(e->addr), pe->addr, "endpoint addr", SX_ELIMIT)) ||
        (rc = take_str(e->device, sizeof(e->device), pe->device, "endpoint device",
                       SX_ELIMIT)))
      return rc;
    if (pe->gid.len != 0 && pe->gid.len != SX_GID_LEN)
      return sx__err(SX_EDECODE, "endpoint %zu: gid is %zu bytes, expected 16", i,
                     pe->gid.len);
    if (pe->gid.len)
      memcpy(e->gid, pe->gid.data, SX_GID_LEN);
  }
  d->n_endpoints = (uint32_t)m->n_endpoints;

  if (m->regions != NULL && (rc = unpack_regions(m->regions, d)) != 0)
    return rc;

  for (size_t i = 0; i < m->n_labels; i++) {
    sx_label *l = &d->labels[i];
    if ((rc = take_str(l->key, sizeof(l->key), m->labels[i]->key, "label key",
                       SX_ELIMIT)) ||
        (rc = take_str(l->value, sizeof(l->value), m->labels[i]->value, "label value",
                       SX_ELIMIT)))
      return rc;
  }
  d->n_labels = (uint32_t)m->n_labels;
  return sx_desc_validate(d);
}

int sx_desc_decode(const uint8_t *buf, size_t len, sx_desc *out) {
  uint32_t counts[16];
  if (buf == NULL && len != 0)
    return sx__err(SX_EINVAL, "descriptor buffer is NULL");
  if (len > SX_MAX_DESC_BYTES)
    return sx__err(SX_ELIMIT, "descriptor is %zu bytes; the limit is %u", len,
                   SX_MAX_DESC_BYTES);
  if (prescan(buf, len, counts))
    return sx__err(SX_EDECODE, "descriptor is not a valid protobuf message");
  if (counts[7] > SX_MAX_ENDPOINTS)
    return sx__err(SX_ELIMIT, "descriptor has %u endpoints; the limit is %u",
                   counts[7], SX_MAX_ENDPOINTS);
  if (counts[11] > SX_MAX_LABELS)
    return sx__err(SX_ELIMIT, "descriptor has %u labels; the limit is %u", counts[11],
                   SX_MAX_LABELS);

  arena a;
  arena_init(&a);
  Sxpb__SegmentDescriptor *m = sxpb__segment_descriptor__unpack(&a.pb, len, buf);
  if (m == NULL) {
    arena_release(&a);
    return sx__err(SX_EDECODE, "descriptor is not a valid SegmentDescriptor");
  }
  sx_desc d;
  sx_desc_init(&d);
  d.endpoints = sx__desc_array(m->n_endpoints, sizeof(sx_endpoint));
  d.labels = sx__desc_array(m->n_labels, sizeof(sx_label));
  int rc;
  if ((m->n_endpoints && !d.endpoints) || (m->n_labels && !d.labels))
    rc = sx__err(SX_ENOMEM, "decoding a descriptor");
  else
    rc = convert(m, &d);
  arena_release(&a);
  if (rc) {
    sx_desc_free(&d);
    return rc;
  }
  *out = d;
  return 0;
}

/* ---------------------------------------------------------------- events */

int sx_event_encode(const sx_event *ev, uint8_t **out, size_t *out_len) {
  if (ev->kind < SX_EVENT_PUT || ev->kind > SX_EVENT_EXPIRED)
    return sx__err(SX_EINVAL, "unknown event kind %d", (int)ev->kind);
  int rc = sx_name_validate(ev->name);
  if (rc)
    return rc;
  Sxpb__SegmentEvent m = SXPB__SEGMENT_EVENT__INIT;
  m.kind = (Sxpb__EventKind)ev->kind;
  m.name = (char *)ev->name;
  m.incarnation.data = (uint8_t *)ev->incarnation;
  m.incarnation.len = sizeof(ev->incarnation);
  m.generation = ev->generation;
  size_t len = sxpb__segment_event__get_packed_size(&m);
  uint8_t *buf = malloc(len);
  if (buf == NULL)
    return sx__err(SX_ENOMEM, "encoding an event");
  sxpb__segment_event__pack(&m, buf);
  *out = buf;
  *out_len = len;
  return 0;
}

#define SX__MAX_EVENT_BYTES 1024

int sx_event_decode(const uint8_t *buf, size_t len, sx_event *out) {
  if (len > SX__MAX_EVENT_BYTES)
    return sx__err(SX_ELIMIT, "event is %zu bytes; the limit is %d", len,
                   SX__MAX_EVENT_BYTES);
  arena a;
  arena_init(&a);
  Sxpb__SegmentEvent *m = sxpb__segment_event__unpack(&a.pb, len, buf);
  if (m == NULL) {
    arena_release(&a);
    return sx__err(SX_EDECODE, "event is not a valid SegmentEvent");
  }
  sx_event ev;
  memset(&ev, 0, sizeof(ev));
  int rc = 0;
  if (m->kind < SXPB__EVENT_KIND__EVENT_PUT || m->kind > SXPB__EVENT_KIND__EVENT_EXPIRED)
    rc = sx__err(SX_EDECODE, "event kind %d is unknown", (int)m->kind);
  else if (m->incarnation.len != 0 && m->incarnation.len != SX_INCARNATION_LEN)
    rc = sx__err(SX_EDECODE, "event incarnation is %zu bytes", m->incarnation.len);
  else if ((rc = take_str(ev.name, sizeof(ev.name), m->name, "event name", SX_ENAME)) == 0)
    rc = sx_name_validate(ev.name);
  if (rc == 0) {
    ev.kind = (sx_event_kind)m->kind;
    ev.generation = m->generation;
    if (m->incarnation.len)
      memcpy(ev.incarnation, m->incarnation.data, SX_INCARNATION_LEN);
    *out = ev;
  }
  arena_release(&a);
  return rc;
}
