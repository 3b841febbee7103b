/* The write-notice codec (see notice.h). */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "notice.h"
#include "segxfer.pb-c.h"

/* ------------------------------------------------------------ memory */

/* One allocation: the notice, then its block runs, then its ranges (both
 * arrays of 8-byte-aligned structs, so no padding is needed between). */
typedef struct notice_mem {
  sx_notice n;
  uint64_t body[];
} notice_mem;

sx_notice *sx__notice_alloc(uint32_t nb, uint32_t nr) {
  if (nb > SX_NOTICE_MAX_ENTRIES || nr > SX_NOTICE_MAX_ENTRIES - nb)
    return NULL;
  size_t size = sizeof(notice_mem) + nb * sizeof(sx_notice_blocks) +
                nr * sizeof(sx_notice_range);
  notice_mem *m = calloc(1, size);
  if (m == NULL)
    return NULL;
  m->n.n_blocks = nb;
  m->n.n_ranges = nr;
  m->n.blocks = (const sx_notice_blocks *)m->body;
  m->n.ranges = (const sx_notice_range *)(m->n.blocks + nb);
  return &m->n;
}

sx_notice_blocks *sx__notice_blocks(sx_notice *n) { return (sx_notice_blocks *)n->blocks; }
sx_notice_range *sx__notice_ranges(sx_notice *n) { return (sx_notice_range *)n->ranges; }

void sx_notice_free(sx_notice *n) { free(n); }

/* ------------------------------------------------------------ rules */

static int all_zero(const uint8_t *p, size_t n) {
  uint8_t acc = 0;
  for (size_t i = 0; i < n; i++)
    acc |= p[i];
  return acc == 0;
}

int sx__notice_check(const sx_notice *n) {
  uint64_t end;
  if (n->kind != SX_NOTICE_WRITE && n->kind != SX_NOTICE_READ)
    return sx__err(SX_EINVAL, "notice: unknown kind %u", n->kind);
  /* A reader need not be named (reader-only agents); a producer must. */
  int rc = n->kind == SX_NOTICE_READ && n->producer[0] == '\0' ? 0
                                                                : sx_name_validate(n->producer);
  if (rc)
    return sx__errwrap(rc, "notice: %s", n->kind == SX_NOTICE_READ ? "reader" : "producer");
  if (all_zero(n->incarnation, SX_INCARNATION_LEN))
    return sx__err(SX_EMISSING, "notice from %s: incarnation is missing", n->producer);
  if (n->n_blocks > SX_NOTICE_MAX_ENTRIES || n->n_ranges > SX_NOTICE_MAX_ENTRIES - n->n_blocks)
    return sx__err(SX_ELIMIT, "notice from %s: %u block runs and %u ranges; the limit is %u "
                   "entries", n->producer, n->n_blocks, n->n_ranges, SX_NOTICE_MAX_ENTRIES);
  for (uint32_t i = 0; i < n->n_blocks; i++) {
    const sx_notice_blocks *b = &n->blocks[i];
    if (b->layer_count == 0 || b->slots == 0 || b->count == 0)
      return sx__err(SX_EINVAL, "notice from %s: block run %u: layer_count, slots and count "
                     "must be non-zero", n->producer, i);
    if (b->layer_first > UINT32_MAX - (b->layer_count - 1) || !sx__add_ok(b->block, b->count, &end))
      return sx__err(SX_EOVERFLOW, "notice from %s: block run %u overflows", n->producer, i);
  }
  for (uint32_t i = 0; i < n->n_ranges; i++) {
    const sx_notice_range *r = &n->ranges[i];
    if (r->length == 0)
      return sx__err(SX_EINVAL, "notice from %s: range %u is empty", n->producer, i);
    if (!sx__add_ok(r->offset, r->length, &end))
      return sx__err(SX_EOVERFLOW, "notice from %s: range %u overflows", n->producer, i);
  }
  return 0;
}

/* ------------------------------------------------------------ encode */

int sx__notice_encode(const sx_notice *n, uint8_t **out, size_t *len) {
  int rc = sx__notice_check(n);
  if (rc)
    return rc;
  uint32_t nb = n->n_blocks, nr = n->n_ranges;
  /* Columns as plain arrays, one allocation: 3 x u32 + 3 x u64 per run,
   * 1 x u32 + 2 x u64 per range. */
  uint64_t *c64 = malloc((3 * (size_t)nb + 2 * (size_t)nr + 1) * sizeof(uint64_t));
  uint32_t *c32 = malloc((3 * (size_t)nb + (size_t)nr + 1) * sizeof(uint32_t));
  if (c64 == NULL || c32 == NULL) {
    free(c64);
    free(c32);
    return sx__err(SX_ENOMEM, "encoding a notice");
  }
  Sxpb__WriteNotice m = SXPB__WRITE_NOTICE__INIT;
  m.version = SX__NOTICE_VERSION;
  m.producer = (char *)n->producer;
  m.incarnation.data = (uint8_t *)n->incarnation;
  m.incarnation.len = SX_INCARNATION_LEN;
  m.tag = n->tag;
  m.bytes = n->bytes;
  m.kind = n->kind;
  m.n_b_group = m.n_b_layer_first = m.n_b_layer_count = nb;
  m.n_b_slots = m.n_b_block = m.n_b_count = nb;
  m.b_group = c32;
  m.b_layer_first = c32 + nb;
  m.b_layer_count = c32 + 2 * (size_t)nb;
  m.b_slots = c64;
  m.b_block = c64 + nb;
  m.b_count = c64 + 2 * (size_t)nb;
  for (uint32_t i = 0; i < nb; i++) {
    const sx_notice_blocks *b = &n->blocks[i];
    m.b_group[i] = b->group;
    m.b_layer_first[i] = b->layer_first;
    m.b_layer_count[i] = b->layer_count;
    m.b_slots[i] = b->slots;
    m.b_block[i] = b->block;
    m.b_count[i] = b->count;
  }
  m.n_r_region = m.n_r_offset = m.n_r_length = nr;
  m.r_region = c32 + 3 * (size_t)nb;
  m.r_offset = c64 + 3 * (size_t)nb;
  m.r_length = c64 + 3 * (size_t)nb + nr;
  for (uint32_t i = 0; i < nr; i++) {
    m.r_region[i] = n->ranges[i].region;
    m.r_offset[i] = n->ranges[i].offset;
    m.r_length[i] = n->ranges[i].length;
  }
  size_t size = sxpb__write_notice__get_packed_size(&m);
  uint8_t *buf = size <= SX_NOTICE_MAX_BYTES ? malloc(size ? size : 1) : NULL;
  if (buf != NULL)
    sxpb__write_notice__pack(&m, buf);
  free(c64);
  free(c32);
  if (buf == NULL)
    return size > SX_NOTICE_MAX_BYTES
               ? sx__err(SX_ELIMIT, "notice from %s: %zu bytes encoded; the limit is %u",
                         n->producer, size, SX_NOTICE_MAX_BYTES)
               : sx__err(SX_ENOMEM, "encoding a notice");
  *out = buf;
  *len = size;
  return 0;
}

/* ------------------------------------------------------------ decode */

static int decode_fields(const Sxpb__WriteNotice *m, sx_notice **out) {
  if (m->version != SX__NOTICE_VERSION)
    return sx__err(SX_EVERSION, "notice version %u; this build reads %d", m->version,
                   SX__NOTICE_VERSION);
  if (m->base.n_unknown_fields != 0)
    return sx__err(SX_EDECODE, "notice: %u unknown fields", m->base.n_unknown_fields);
  size_t nb = m->n_b_group, nr = m->n_r_region;
  if (m->n_b_layer_first != nb || m->n_b_layer_count != nb || m->n_b_slots != nb ||
      m->n_b_block != nb || m->n_b_count != nb || m->n_r_offset != nr || m->n_r_length != nr)
    return sx__err(SX_EDECODE, "notice: columns of different lengths");
  if (nb > SX_NOTICE_MAX_ENTRIES || nr > SX_NOTICE_MAX_ENTRIES - nb)
    return sx__err(SX_ELIMIT, "notice: %zu block runs and %zu ranges; the limit is %u entries",
                   nb, nr, SX_NOTICE_MAX_ENTRIES);
  if (m->incarnation.len != SX_INCARNATION_LEN)
    return sx__err(SX_EDECODE, "notice: incarnation is %zu bytes, not %d", m->incarnation.len,
                   SX_INCARNATION_LEN);
  if (m->producer == NULL || strlen(m->producer) > SX_NAME_MAX)
    return sx__err(SX_ENAME, "notice: producer name missing or longer than %d bytes",
                   SX_NAME_MAX);
  sx_notice *n = sx__notice_alloc((uint32_t)nb, (uint32_t)nr);
  if (n == NULL)
    return sx__err(SX_ENOMEM, "decoding a notice");
  memcpy(n->producer, m->producer, strlen(m->producer) + 1);
  memcpy(n->incarnation, m->incarnation.data, SX_INCARNATION_LEN);
  n->tag = m->tag;
  n->bytes = m->bytes;
  n->kind = m->kind;
  sx_notice_blocks *b = sx__notice_blocks(n);
  for (size_t i = 0; i < nb; i++)
    b[i] = (sx_notice_blocks){.group = m->b_group[i], .layer_first = m->b_layer_first[i],
                              .layer_count = m->b_layer_count[i], .slots = m->b_slots[i],
                              .block = m->b_block[i], .count = m->b_count[i]};
  sx_notice_range *r = sx__notice_ranges(n);
  for (size_t i = 0; i < nr; i++)
    r[i] = (sx_notice_range){.region = m->r_region[i], .offset = m->r_offset[i],
                             .length = m->r_length[i]};
  int rc = sx__notice_check(n);
  if (rc) {
    sx_notice_free(n);
    return rc;
  }
  *out = n;
  return 0;
}

int sx__notice_decode(const uint8_t *buf, size_t len, sx_notice **out) {
  if (buf == NULL && len > 0)
    return sx__err(SX_EINVAL, "notice: NULL buffer");
  if (len > SX_NOTICE_MAX_BYTES)
    return sx__err(SX_ELIMIT, "notice: %zu bytes; the limit is %u", len, SX_NOTICE_MAX_BYTES);
  Sxpb__WriteNotice *m = sxpb__write_notice__unpack(NULL, len, buf);
  if (m == NULL)
    return sx__err(SX_EDECODE, "notice: not a WriteNotice protobuf");
  int rc = decode_fields(m, out);
  sxpb__write_notice__free_unpacked(m, NULL);
  return rc;
}
