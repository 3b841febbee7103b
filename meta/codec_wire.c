/*
 * A reader of the SegmentDescriptor wire format, written for the decode
 * path (every cold resolve and every listed segment).  It fills the same
 * structs as protobuf-c's generic unpacker, from the same arena, so that
 * codec.c keeps one set of checks after it; it only replaces the generic
 * field-table walk, which took about three quarters of a descriptor's
 * decode (sx-bench codec and meta, callgrind: ~15k instructions for a
 * 317-byte, 2-region descriptor).
 *
 * It accepts and rejects what protobuf-c 1.4 does, field by field:
 *   - tags of up to 5 bytes; field number 0 in a one-byte key, groups and
 *     wire types 6/7 are errors; unknown fields (field 0 in a longer key
 *     among them) are skipped;
 *   - a known field with the wrong wire type is an error; repeated scalar
 *     fields are read packed or not, and several occurrences concatenate;
 *   - a scalar, string or bytes field seen twice keeps the last value;
 *   - a singular message field seen twice is merged as protobuf-c merges:
 *     repeated fields concatenate (earlier first), strings and bytes are the
 *     later occurrence's if it has them, scalars are always the later one's;
 *   - uint32 fields take the low 32 bits of their varint; varints have at
 *     most 10 bytes, length prefixes at most 5 and at most INT_MAX.
 * tests/test_codec.c checks both readers against each other on crafted and
 * on mutated encodings.
 */
#include <limits.h>
#include <string.h>

#include "codec_wire.h"

typedef struct cur {
  const uint8_t *p, *end;
} cur;

enum { WT_VARINT = 0, WT_64 = 1, WT_LEN = 2, WT_32 = 5 };

static inline int get_varint(cur *c, uint64_t *v) {
  if (c->p < c->end && c->p[0] < 0x80) {
    *v = *c->p++;
    return 0;
  }
  uint64_t x = 0;
  for (int i = 0; i < 10; i++) {
    if (c->p == c->end)
      return -1;
    uint8_t b = *c->p++;
    x |= (uint64_t)(b & 0x7f) << (7 * i);
    if (!(b & 0x80)) {
      *v = x;
      return 0;
    }
  }
  return -1;
}

/* A field key: protobuf-c reads at most 5 bytes and refuses a one-byte key
 * of field 0.  Keys of fields 1..15 are one byte: that case comes first. */
static inline int get_tag(cur *c, uint32_t *field, int *wt) {
  if (c->p < c->end && c->p[0] < 0x80 && c->p[0] >= 8) {
    *field = c->p[0] >> 3;
    *wt = c->p[0] & 7;
    c->p++;
    return 0;
  }
  size_t left = (size_t)(c->end - c->p), max = left > 5 ? 5 : left;
  if (left == 0)
    return -1;
  uint8_t b0 = c->p[0];
  uint32_t tag = (uint32_t)(b0 & 0x7f) >> 3;
  *wt = b0 & 7;
  if (!(b0 & 0x80)) {
    c->p++;
    *field = tag;
    return tag == 0 ? -1 : 0;
  }
  unsigned shift = 4;
  for (size_t i = 1; i < max; i++) {
    uint8_t b = c->p[i];
    if (b & 0x80) {
      tag |= (uint32_t)(b & 0x7f) << shift;
      shift += 7;
    } else {
      /* protobuf-c refuses field 0 only in a one-byte key; a longer key
       * for field 0 is an unknown field to it, so here too. */
      tag |= (uint32_t)b << shift;
      c->p += i + 1;
      *field = tag;
      return 0;
    }
  }
  return -1;
}

/* A length prefix (at most 5 bytes, at most INT_MAX) and the bytes it covers;
 * lengths below 128 (one byte) come first. */
static inline int get_bytes(cur *c, cur *out) {
  size_t left = (size_t)(c->end - c->p);
  if (left > 0 && c->p[0] < 0x80) {
    if (c->p[0] > left - 1)
      return -1;
    out->p = c->p + 1;
    out->end = out->p + c->p[0];
    c->p = out->end;
    return 0;
  }
  size_t max = left < 5 ? left : 5;
  uint64_t len = 0;
  size_t i;
  for (i = 0; i < max; i++) {
    len |= (uint64_t)(c->p[i] & 0x7f) << (7 * i);
    if (!(c->p[i] & 0x80))
      break;
  }
  /* protobuf-c refuses lengths above INT_MAX as well as past the end. */
  if (i == max || len > INT_MAX || len > left - i - 1)
    return -1;
  out->p = c->p + i + 1;
  out->end = out->p + len;
  c->p = out->end;
  return 0;
}

static int skip(cur *c, int wt) {
  uint64_t v;
  cur sub;
  switch (wt) {
  case WT_VARINT:
    return get_varint(c, &v);
  case WT_64:
    if (c->end - c->p < 8)
      return -1;
    c->p += 8;
    return 0;
  case WT_LEN:
    return get_bytes(c, &sub);
  case WT_32:
    if (c->end - c->p < 4)
      return -1;
    c->p += 4;
    return 0;
  default: /* groups (3, 4) and 6, 7 */
    return -1;
  }
}

static void *alloc(ProtobufCAllocator *a, size_t n) {
  return a->alloc(a->allocator_data, n ? n : 1);
}

static int take_string(ProtobufCAllocator *a, const cur *s, char **out) {
  size_t n = (size_t)(s->end - s->p);
  char *str = alloc(a, n + 1);
  if (str == NULL)
    return -1;
  memcpy(str, s->p, n);
  str[n] = '\0';
  *out = str;
  return 0;
}

static int take_binary(ProtobufCAllocator *a, const cur *s, ProtobufCBinaryData *out) {
  size_t n = (size_t)(s->end - s->p);
  uint8_t *b = NULL;
  if (n > 0) {
    if ((b = alloc(a, n)) == NULL)
      return -1;
    memcpy(b, s->p, n);
  }
  out->data = b;
  out->len = n;
  return 0;
}

/* A field of the three small messages: one step of their parse loops. */
#define EXPECT(w)                                                              \
  do {                                                                         \
    if (wt != (w))                                                             \
      return -1;                                                               \
  } while (0)

static int parse_endpoint(ProtobufCAllocator *a, cur c, Sxpb__Endpoint *e) {
  sxpb__endpoint__init(e);
  while (c.p < c.end) {
    uint32_t f;
    int wt;
    uint64_t v;
    cur s;
    if (get_tag(&c, &f, &wt))
      return -1;
    switch (f) {
    case 1:
      EXPECT(WT_VARINT);
      if (get_varint(&c, &v))
        return -1;
      e->kind = (Sxpb__TransportKind)(int32_t)(uint32_t)v;
      break;
    case 2:
    case 4:
      EXPECT(WT_LEN);
      if (get_bytes(&c, &s) || take_string(a, &s, f == 2 ? &e->addr : &e->device))
        return -1;
      break;
    case 5:
      EXPECT(WT_LEN);
      if (get_bytes(&c, &s) || take_binary(a, &s, &e->gid))
        return -1;
      break;
    case 3:
    case 6:
    case 7:
      EXPECT(WT_VARINT);
      if (get_varint(&c, &v))
        return -1;
      *(f == 3 ? &e->port : f == 6 ? &e->port_num : &e->mtu) = (uint32_t)v;
      break;
    default:
      if (skip(&c, wt))
        return -1;
    }
  }
  return 0;
}

/* present: which string fields (bits 1..3) this occurrence carried. */
static int parse_layout(ProtobufCAllocator *a, cur c, Sxpb__Layout *l, unsigned *present) {
  sxpb__layout__init(l);
  *present = 0;
  while (c.p < c.end) {
    uint32_t f;
    int wt;
    uint64_t v;
    cur s;
    if (get_tag(&c, &f, &wt))
      return -1;
    if (f >= 1 && f <= 3) {
      EXPECT(WT_LEN);
      char **dst = f == 1 ? &l->fingerprint : f == 2 ? &l->tag : &l->dtype;
      if (get_bytes(&c, &s) || take_string(a, &s, dst))
        return -1;
      *present |= 1u << f;
    } else if (f >= 4 && f <= 7) {
      EXPECT(WT_VARINT);
      if (get_varint(&c, &v))
        return -1;
      *(f == 4 ? &l->tp_rank : f == 5 ? &l->tp_size : f == 6 ? &l->pp_rank : &l->pp_size) =
          (uint32_t)v;
    } else if (skip(&c, wt)) {
      return -1;
    }
  }
  return 0;
}

static int parse_label(ProtobufCAllocator *a, cur c, Sxpb__Label *l) {
  sxpb__label__init(l);
  while (c.p < c.end) {
    uint32_t f;
    int wt;
    cur s;
    if (get_tag(&c, &f, &wt))
      return -1;
    if (f == 1 || f == 2) {
      EXPECT(WT_LEN);
      if (get_bytes(&c, &s) || take_string(a, &s, f == 1 ? &l->key : &l->value))
        return -1;
    } else if (skip(&c, wt)) {
      return -1;
    }
  }
  return 0;
}

/* ---------------------------------------------------------------- regions */

/* RegionTable fields 1..16: the packed columns' element width (4 or 8),
 * 0 for locations (14) and rkeys_per_region (15). */
static const uint8_t col_width[17] = {0, 4, 4, 4, 4, 8, 4, 8, 8, 8, 8, 8, 4, 4, 0, 0, 4};

/* The next varint of a packed payload: at most 10 bytes, all inside it. */
static inline const uint8_t *packed_varint(const uint8_t *p, const uint8_t *end,
                                           uint64_t *v) {
  uint64_t b = *p++;
  if (b < 0x80) {
    *v = b;
    return p;
  }
  uint64_t x = b & 0x7f;
  for (unsigned shift = 7; shift < 70; shift += 7) {
    if (p == end)
      return NULL;
    b = *p++;
    x |= (b & 0x7f) << shift;
    if (b < 0x80) {
      *v = x;
      return p;
    }
  }
  return NULL;
}

typedef struct coldst {
  size_t *n;
  void *v; /* uint32_t[] or uint64_t[] */
} coldst;

static coldst column(Sxpb__RegionTable *t, uint32_t f) {
  switch (f) {
  case 1: return (coldst){&t->n_id, t->id};
  case 2: return (coldst){&t->n_group, t->group};
  case 3: return (coldst){&t->n_layer_first, t->layer_first};
  case 4: return (coldst){&t->n_layer_count, t->layer_count};
  case 5: return (coldst){&t->n_layer_stride, t->layer_stride};
  case 6: return (coldst){&t->n_slot, t->slot};
  case 7: return (coldst){&t->n_addr, t->addr};
  case 8: return (coldst){&t->n_length, t->length};
  case 9: return (coldst){&t->n_block_bytes, t->block_bytes};
  case 10: return (coldst){&t->n_block_stride, t->block_stride};
  case 11: return (coldst){&t->n_num_blocks, t->num_blocks};
  case 12: return (coldst){&t->n_access, t->access};
  case 13: return (coldst){&t->n_location, t->location};
  default: return (coldst){&t->n_rkeys, t->rkeys};
  }
}

static void set_column(Sxpb__RegionTable *t, uint32_t f, void *arr) {
  switch (f) {
  case 1: t->id = arr; break;
  case 2: t->group = arr; break;
  case 3: t->layer_first = arr; break;
  case 4: t->layer_count = arr; break;
  case 5: t->layer_stride = arr; break;
  case 6: t->slot = arr; break;
  case 7: t->addr = arr; break;
  case 8: t->length = arr; break;
  case 9: t->block_bytes = arr; break;
  case 10: t->block_stride = arr; break;
  case 11: t->num_blocks = arr; break;
  case 12: t->access = arr; break;
  case 13: t->location = arr; break;
  default: t->rkeys = arr; break;
  }
}

/* Append a packed payload's varints to a column of 4- or 8-byte values;
 * -1 if one is malformed. */
static int put_packed(coldst d, int wide, cur s) {
  const uint8_t *p = s.p;
  uint64_t v;
  size_t n = *d.n;
  if (wide) {
    uint64_t *a = d.v;
    while (p < s.end) {
      if ((p = packed_varint(p, s.end, &v)) == NULL)
        return -1;
      a[n++] = v;
    }
  } else {
    uint32_t *a = d.v;
    while (p < s.end) {
      if ((p = packed_varint(p, s.end, &v)) == NULL)
        return -1;
      a[n++] = (uint32_t)v;
    }
  }
  *d.n = n;
  return 0;
}

static void put(coldst d, int wide, uint64_t v) {
  if (wide)
    ((uint64_t *)d.v)[(*d.n)++] = v;
  else
    ((uint32_t *)d.v)[(*d.n)++] = (uint32_t)v;
}

/*
 * The region table from every occurrence of field 10, in order.  A first
 * pass checks the fields' keys and lengths and bounds each column's
 * element count (a packed payload of n bytes holds at most n varints)
 * without reading the payloads; the second decodes into arrays of that
 * size, so occurrences concatenate as merging does.  rkeys_per_region is
 * the last occurrence's (0 if it lacks it).
 */
static int parse_regions(ProtobufCAllocator *a, const cur *occ, size_t n_occ,
                         Sxpb__RegionTable *t) {
  size_t bound[17] = {0};
  sxpb__region_table__init(t);
  for (size_t k = 0; k < n_occ; k++) {
    cur c = occ[k];
    uint32_t rkpr = 0;
    while (c.p < c.end) {
      uint32_t f;
      int wt;
      uint64_t v;
      cur s;
      if (get_tag(&c, &f, &wt))
        return -1;
      if (f == 15) {
        EXPECT(WT_VARINT);
        if (get_varint(&c, &v))
          return -1;
        rkpr = (uint32_t)v;
      } else if (f == 14) {
        EXPECT(WT_LEN);
        if (get_bytes(&c, &s))
          return -1;
        bound[14]++;
      } else if (f >= 1 && f <= 16) {
        if (wt == WT_LEN) {
          if (get_bytes(&c, &s))
            return -1;
          bound[f] += (size_t)(s.end - s.p);
        } else if (wt == WT_VARINT) {
          if (get_varint(&c, &v))
            return -1;
          bound[f]++;
        } else {
          return -1;
        }
      } else if (skip(&c, wt)) {
        return -1;
      }
    }
    t->rkeys_per_region = rkpr;
  }
  for (uint32_t f = 1; f <= 16; f++) {
    if (f == 14 || f == 15 || bound[f] == 0)
      continue;
    void *arr = alloc(a, bound[f] * col_width[f]);
    if (arr == NULL)
      return -1;
    set_column(t, f, arr);
  }
  if (bound[14] && (t->locations = alloc(a, bound[14] * sizeof(char *))) == NULL)
    return -1;
  /* Second pass: keys and lengths are known to be well formed now. */
  for (size_t k = 0; k < n_occ; k++) {
    cur c = occ[k];
    while (c.p < c.end) {
      uint32_t f = 0;
      int wt = 0;
      uint64_t v = 0;
      cur s;
      get_tag(&c, &f, &wt);
      if (f == 14) {
        get_bytes(&c, &s);
        if (take_string(a, &s, &t->locations[t->n_locations++]))
          return -1;
      } else if (f >= 1 && f <= 16 && f != 15) {
        coldst d = column(t, f);
        if (wt == WT_LEN) {
          get_bytes(&c, &s);
          if (put_packed(d, col_width[f] == 8, s))
            return -1;
        } else {
          get_varint(&c, &v);
          put(d, col_width[f] == 8, v);
        }
      } else {
        skip(&c, wt);
      }
    }
  }
  return 0;
}

/* ---------------------------------------------------------------- top */

/* Merge a later Layout occurrence into the one before, as protobuf-c does. */
static void merge_layout(Sxpb__Layout *into, const Sxpb__Layout *later, unsigned present) {
  if (present & (1u << 1))
    into->fingerprint = later->fingerprint;
  if (present & (1u << 2))
    into->tag = later->tag;
  if (present & (1u << 3))
    into->dtype = later->dtype;
  into->tp_rank = later->tp_rank;
  into->tp_size = later->tp_size;
  into->pp_rank = later->pp_rank;
  into->pp_size = later->pp_size;
}

Sxpb__SegmentDescriptor *sx__desc_wire_unpack(ProtobufCAllocator *a, const uint8_t *buf,
                                              size_t len) {
  Sxpb__SegmentDescriptor *m = alloc(a, sizeof(*m));
  if (m == NULL)
    return NULL;
  sxpb__segment_descriptor__init(m);
  /* Pass 1: check the top level's wire format and count what repeats. */
  size_t n_ep = 0, n_lab = 0, n_reg = 0;
  cur c = {buf, buf + len};
  while (c.p < c.end) {
    uint32_t f;
    int wt;
    if (get_tag(&c, &f, &wt))
      return NULL;
    int want = f == 2 || f == 3 || (f >= 7 && f <= 11) ? WT_LEN : WT_VARINT;
    if (f >= 1 && f <= 11 && wt != want)
      return NULL;
    if (skip(&c, wt))
      return NULL;
    n_ep += f == 7;
    n_lab += f == 11;
    n_reg += f == 10;
  }
  cur *regs = NULL;
  if (n_ep && (m->endpoints = alloc(a, n_ep * sizeof(*m->endpoints))) == NULL)
    return NULL;
  if (n_lab && (m->labels = alloc(a, n_lab * sizeof(*m->labels))) == NULL)
    return NULL;
  if (n_reg && (regs = alloc(a, n_reg * sizeof(*regs))) == NULL)
    return NULL;
  size_t i_reg = 0;
  /* Pass 2: the fields, in order. */
  c = (cur){buf, buf + len};
  while (c.p < c.end) {
    uint32_t f = 0;
    int wt = 0;
    uint64_t v = 0;
    cur s = {NULL, NULL};
    get_tag(&c, &f, &wt);
    if (f == 0 || f > 11) {
      skip(&c, wt);
      continue;
    }
    if (wt == WT_LEN)
      get_bytes(&c, &s);
    else
      get_varint(&c, &v);
    switch (f) {
    case 1: m->schema_version = (uint32_t)v; break;
    case 4: m->generation = v; break;
    case 5: m->published_at_ms = v; break;
    case 6: m->lease_ms = (uint32_t)v; break;
    case 2:
      if (take_string(a, &s, &m->name))
        return NULL;
      break;
    case 3:
    case 8:
      if (take_binary(a, &s, f == 3 ? &m->incarnation : &m->token))
        return NULL;
      break;
    case 7: {
      Sxpb__Endpoint *e = alloc(a, sizeof(*e));
      if (e == NULL || parse_endpoint(a, s, e))
        return NULL;
      m->endpoints[m->n_endpoints++] = e;
      break;
    }
    case 11: {
      Sxpb__Label *l = alloc(a, sizeof(*l));
      if (l == NULL || parse_label(a, s, l))
        return NULL;
      m->labels[m->n_labels++] = l;
      break;
    }
    case 9: {
      Sxpb__Layout *l = alloc(a, sizeof(*l));
      unsigned present;
      if (l == NULL || parse_layout(a, s, l, &present))
        return NULL;
      if (m->layout == NULL)
        m->layout = l;
      else
        merge_layout(m->layout, l, present);
      break;
    }
    case 10:
      regs[i_reg++] = s;
      break;
    }
  }
  if (n_reg) {
    Sxpb__RegionTable *t = alloc(a, sizeof(*t));
    if (t == NULL || parse_regions(a, regs, n_reg, t))
      return NULL;
    m->regions = t;
  }
  return m;
}
