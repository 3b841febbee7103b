/*
 * JSON form of descriptors (jansson): what `sxctl show --json` prints and
 * what layout files contain.  A layout file is the same shape with only the
 * layout fields required, so `sxctl show --json NAME > f.json` yields a file
 * that `sxctl check --layout f.json` and `sx-agent --layout f.json` accept.
 */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "segxfer/layout.h"

static const char *kind_name(sx_transport_kind k) {
  return k == SX_TRANSPORT_TCP ? "tcp" : k == SX_TRANSPORT_RDMA ? "rdma"
       : k == SX_TRANSPORT_CUDA_IPC ? "cuda_ipc" : "none";
}

/* 64-bit values that may exceed JSON's safe integers go out as hex strings. */
static json_t *u64_json(uint64_t v) {
  if (v <= (1ull << 53))
    return json_integer((json_int_t)v);
  char buf[24];
  snprintf(buf, sizeof(buf), "0x%" PRIx64, v);
  return json_string(buf);
}

static json_t *hex_json(const uint8_t *b, size_t n) {
  char buf[2 * 32 + 1];
  sx_hex(b, n, buf);
  return json_string(buf);
}

int sx_desc_to_json(const sx_desc *d, int with_secrets, char **out) {
  json_t *root = json_object(), *layout = json_object(), *labels = json_object();
  json_t *eps = json_array(), *regs = json_array();
  char s[16];
  json_object_set_new(root, "schema_version", json_integer(d->schema_version));
  json_object_set_new(root, "name", json_string(d->name));
  json_object_set_new(root, "incarnation", hex_json(d->incarnation, SX_INCARNATION_LEN));
  json_object_set_new(root, "generation", u64_json(d->generation));
  json_object_set_new(root, "published_at_ms", u64_json(d->published_at_ms));
  json_object_set_new(root, "lease_ms", json_integer(d->lease_ms));
  json_object_set_new(root, "host_id", json_string(d->host_id));
  json_object_set_new(root, "hostname", json_string(d->hostname));
  json_object_set_new(root, "token", with_secrets ? hex_json(d->token, SX_TOKEN_LEN)
                                                  : json_string("<redacted>"));
  json_object_set_new(layout, "fingerprint", json_string(d->layout.fingerprint));
  json_object_set_new(layout, "tag", json_string(d->layout.tag));
  json_object_set_new(layout, "dtype", json_string(d->layout.dtype));
  json_object_set_new(layout, "tp_rank", json_integer(d->layout.tp_rank));
  json_object_set_new(layout, "tp_size", json_integer(d->layout.tp_size));
  json_object_set_new(layout, "pp_rank", json_integer(d->layout.pp_rank));
  json_object_set_new(layout, "pp_size", json_integer(d->layout.pp_size));
  if (d->layout.layer_count) {
    json_object_set_new(layout, "layer_first", json_integer(d->layout.layer_first));
    json_object_set_new(layout, "layer_count", json_integer(d->layout.layer_count));
  }
  if (d->layout.n_blocks) {
    json_t *bl = json_array();
    for (uint32_t i = 0; i < d->layout.n_blocks && i < SX_MAX_BLOCK_DESCS; i++) {
      const sx_block_desc *b = &d->layout.blocks[i];
      json_t *jb = json_object();
      json_object_set_new(jb, "group", json_integer(b->group));
      json_object_set_new(jb, "order", json_string(sx_kv_order_name(b->order)));
      json_object_set_new(jb, "tokens", json_integer(b->tokens));
      json_object_set_new(jb, "head_first", json_integer(b->head_first));
      json_object_set_new(jb, "head_count", json_integer(b->head_count));
      json_object_set_new(jb, "heads_total", json_integer(b->heads_total));
      json_object_set_new(jb, "head_dim", json_integer(b->head_dim));
      json_object_set_new(jb, "dtype", json_string(b->dtype));
      json_object_set_new(jb, "slots", u64_json(sx__block_slots(b)));
      json_array_append_new(bl, jb);
    }
    json_object_set_new(layout, "blocks", bl);
  }
  json_object_set_new(root, "layout", layout);
  for (uint32_t i = 0; i < d->n_labels; i++)
    json_object_set_new(labels, d->labels[i].key, json_string(d->labels[i].value));
  json_object_set_new(root, "labels", labels);
  for (uint32_t i = 0; i < d->n_endpoints; i++) {
    const sx_endpoint *e = &d->endpoints[i];
    json_t *je = json_object();
    json_object_set_new(je, "kind", json_string(kind_name(e->kind)));
    json_object_set_new(je, "addr", json_string(e->addr));
    json_object_set_new(je, "port", json_integer(e->port));
    if (e->kind == SX_TRANSPORT_RDMA) {
      json_object_set_new(je, "device", json_string(e->device));
      json_object_set_new(je, "gid", hex_json(e->gid, SX_GID_LEN));
      json_object_set_new(je, "port_num", json_integer(e->port_num));
      json_object_set_new(je, "mtu", json_integer(e->mtu));
    }
    json_array_append_new(eps, je);
  }
  json_object_set_new(root, "endpoints", eps);
  for (uint32_t i = 0; i < d->n_regions; i++) {
    const sx_region *r = &d->regions[i];
    json_t *jr = json_object(), *rk = json_array();
    char addr[24];
    snprintf(addr, sizeof(addr), "0x%" PRIx64, r->addr);
    json_object_set_new(jr, "id", json_integer(r->id));
    json_object_set_new(jr, "group", json_integer(r->group));
    json_object_set_new(jr, "layer_first", json_integer(r->layer_first));
    json_object_set_new(jr, "layer_count", json_integer(r->layer_count));
    json_object_set_new(jr, "layer_stride", u64_json(r->layer_stride));
    json_object_set_new(jr, "slot", json_string(sx_slot_name(r->slot, s)));
    json_object_set_new(jr, "addr", json_string(addr));
    json_object_set_new(jr, "length", u64_json(r->length));
    json_object_set_new(jr, "block_bytes", u64_json(r->block_bytes));
    json_object_set_new(jr, "block_stride", u64_json(r->block_stride));
    json_object_set_new(jr, "num_blocks", u64_json(r->num_blocks));
    json_object_set_new(jr, "location", json_string(r->location));
    const sx_endpoint *nic = sx_desc_region_nic(d, r);
    if (nic != NULL)
      json_object_set_new(jr, "nic", json_string(nic->device));
    json_object_set_new(jr, "remote_read",
                        json_boolean(r->access & SX_ACCESS_REMOTE_READ));
    for (uint32_t k = 0; k < r->n_rkeys; k++)
      json_array_append_new(rk, json_integer(r->rkeys[k]));
    json_object_set_new(jr, "rkeys", rk);
    json_array_append_new(regs, jr);
  }
  json_object_set_new(root, "regions", regs);
  char *text = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
  json_decref(root);
  if (text == NULL)
    return sx__err(SX_ENOMEM, "formatting %s as JSON", d->name);
  *out = text;
  return 0;
}

/* ---------------------------------------------------------------- parsing */

/* An unsigned 64-bit field: JSON integer >= 0 or a "0x..."/decimal string. */
static int get_u64(json_t *obj, const char *ctx, const char *key, int required,
                   uint64_t dflt, uint64_t max, uint64_t *out) {
  json_t *v = json_object_get(obj, key);
  if (v == NULL || json_is_null(v)) {
    if (required)
      return sx__err(SX_EINVAL, "%s: \"%s\" is required", ctx, key);
    *out = dflt;
    return 0;
  }
  uint64_t x;
  if (json_is_integer(v)) {
    if (json_integer_value(v) < 0)
      return sx__err(SX_EINVAL, "%s: \"%s\" is negative", ctx, key);
    x = (uint64_t)json_integer_value(v);
  } else if (json_is_string(v)) {
    const char *str = json_string_value(v);
    char *end;
    errno = 0;
    x = strtoull(str, &end, 0);
    if (*str == '\0' || *str == '-' || *end != '\0' || errno == ERANGE)
      return sx__err(SX_EINVAL, "%s: \"%s\" is not an unsigned number: '%.40s'", ctx,
                     key, str);
  } else {
    return sx__err(SX_EINVAL, "%s: \"%s\" must be a number", ctx, key);
  }
  if (x > max)
    return sx__err(SX_EINVAL, "%s: \"%s\" %" PRIu64 " is above %" PRIu64, ctx, key,
                   x, max);
  *out = x;
  return 0;
}

static int get_u32(json_t *obj, const char *ctx, const char *key, int required,
                   uint32_t dflt, uint32_t *out) {
  uint64_t v;
  int rc = get_u64(obj, ctx, key, required, dflt, UINT32_MAX, &v);
  if (rc == 0)
    *out = (uint32_t)v;
  return rc;
}

static int get_str(json_t *obj, const char *ctx, const char *key, char *dst,
                   size_t size, const char *dflt) {
  json_t *v = json_object_get(obj, key);
  if (v == NULL || json_is_null(v)) {
    snprintf(dst, size, "%s", dflt);
    return 0;
  }
  if (!json_is_string(v))
    return sx__err(SX_EINVAL, "%s: \"%s\" must be a string", ctx, key);
  if (sx__strlcpy(dst, json_string_value(v), size))
    return sx__err(SX_ELIMIT, "%s: \"%s\" is longer than %zu bytes", ctx, key, size - 1);
  return 0;
}

static int parse_region(json_t *jr, uint32_t idx, sx_region *r) {
  char ctx[32], slot[32];
  int rc;
  snprintf(ctx, sizeof(ctx), "regions[%u]", idx);
  if (!json_is_object(jr))
    return sx__err(SX_EINVAL, "%s must be an object", ctx);
  memset(r, 0, sizeof(*r));
  if ((rc = get_u32(jr, ctx, "id", 0, idx, &r->id)) ||
      (rc = get_u32(jr, ctx, "group", 0, 0, &r->group)) ||
      (rc = get_u32(jr, ctx, "layer_first", 0, 0, &r->layer_first)) ||
      (rc = get_u32(jr, ctx, "layer_count", 0, 1, &r->layer_count)) ||
      (rc = get_u64(jr, ctx, "layer_stride", 0, 0, UINT64_MAX, &r->layer_stride)) ||
      (rc = get_u64(jr, ctx, "block_bytes", 1, 0, UINT64_MAX, &r->block_bytes)) ||
      (rc = get_u64(jr, ctx, "block_stride", 0, r->block_bytes, UINT64_MAX,
                    &r->block_stride)) ||
      (rc = get_u64(jr, ctx, "num_blocks", 1, 0, UINT64_MAX, &r->num_blocks)) ||
      (rc = get_u64(jr, ctx, "addr", 0, 0, UINT64_MAX, &r->addr)) ||
      (rc = get_str(jr, ctx, "location", r->location, sizeof(r->location), "cpu")) ||
      (rc = get_str(jr, ctx, "slot", slot, sizeof(slot), "K")))
    return rc;
  json_t *js = json_object_get(jr, "slot");
  if (json_is_integer(js)) {
    if (json_integer_value(js) < 0 || json_integer_value(js) >= SX_MAX_SLOTS)
      return sx__err(SX_EINVAL, "%s: slot out of range", ctx);
    r->slot = (uint32_t)json_integer_value(js);
  } else if ((rc = sx_slot_parse(slot, &r->slot)) != 0) {
    return sx__errwrap(rc, "%s", ctx);
  }
  /* Length defaults to the span of the blocks (checked for overflow later). */
  uint64_t span = 0, t;
  if (r->num_blocks && r->layer_count && sx__mul_ok(r->num_blocks, r->block_stride, &t) &&
      sx__mul_ok(r->layer_count - 1, r->layer_stride, &span) &&
      sx__add_ok(span, t, &span))
    ;
  else
    span = 0;
  if ((rc = get_u64(jr, ctx, "length", 0, span, UINT64_MAX, &r->length)))
    return rc;
  json_t *rr = json_object_get(jr, "remote_read");
  if (rr != NULL && !json_is_boolean(rr))
    return sx__err(SX_EINVAL, "%s: \"remote_read\" must be true or false", ctx);
  r->access = (rr == NULL || json_is_true(rr)) ? SX_ACCESS_REMOTE_READ : 0;
  json_t *rk = json_object_get(jr, "rkeys");
  if (rk != NULL) {
    if (!json_is_array(rk) || json_array_size(rk) > SX_MAX_DEVICES)
      return sx__err(SX_ERKEYS, "%s: \"rkeys\" must be an array of at most %d", ctx,
                     SX_MAX_DEVICES);
    for (size_t k = 0; k < json_array_size(rk); k++) {
      json_t *v = json_array_get(rk, k);
      if (!json_is_integer(v) || json_integer_value(v) < 0 ||
          json_integer_value(v) > UINT32_MAX)
        return sx__err(SX_ERKEYS, "%s: rkeys[%zu] is not a 32-bit key", ctx, k);
      r->rkeys[k] = (uint32_t)json_integer_value(v);
    }
    r->n_rkeys = (uint32_t)json_array_size(rk);
  }
  return 0;
}

static int parse_block(json_t *jb, uint32_t idx, sx_block_desc *b) {
  char ctx[32], order[16];
  int rc;
  snprintf(ctx, sizeof(ctx), "layout.blocks[%u]", idx);
  if (!json_is_object(jb))
    return sx__err(SX_EINVAL, "%s must be an object", ctx);
  memset(b, 0, sizeof(*b));
  if ((rc = get_u32(jb, ctx, "group", 0, 0, &b->group)) ||
      (rc = get_str(jb, ctx, "order", order, sizeof(order), "NHD")) ||
      (rc = get_u32(jb, ctx, "tokens", 1, 0, &b->tokens)) ||
      (rc = get_u32(jb, ctx, "head_first", 0, 0, &b->head_first)) ||
      (rc = get_u32(jb, ctx, "head_count", 1, 0, &b->head_count)) ||
      (rc = get_u32(jb, ctx, "heads_total", 0, b->head_count, &b->heads_total)) ||
      (rc = get_u32(jb, ctx, "head_dim", 1, 0, &b->head_dim)) ||
      (rc = get_str(jb, ctx, "dtype", b->dtype, sizeof(b->dtype), "")) ||
      (rc = get_u64(jb, ctx, "slots", 0, 0, UINT64_MAX, &b->slots)))
    return rc;
  for (int o = SX_KV_NHD; o <= SX_KV_MLA; o++)
    if (strcmp(order, sx_kv_order_name((sx_kv_order)o)) == 0)
      b->order = (sx_kv_order)o;
  if (b->order == SX_KV_NONE)
    return sx__err(SX_EINVAL, "%s: order '%s' is not NHD, HND or MLA", ctx, order);
  return 0;
}

static int parse_endpoint(json_t *je, uint32_t idx, sx_endpoint *e) {
  char ctx[32], kind[16], gid[2 * SX_GID_LEN + 1];
  uint64_t port, port_num;
  int rc;
  snprintf(ctx, sizeof(ctx), "endpoints[%u]", idx);
  if (!json_is_object(je))
    return sx__err(SX_EINVAL, "%s must be an object", ctx);
  memset(e, 0, sizeof(*e));
  if ((rc = get_str(je, ctx, "kind", kind, sizeof(kind), "")) ||
      (rc = get_str(je, ctx, "addr", e->addr, sizeof(e->addr), "")) ||
      (rc = get_u64(je, ctx, "port", 1, 0, UINT16_MAX, &port)) ||
      (rc = get_str(je, ctx, "device", e->device, sizeof(e->device), "")) ||
      (rc = get_str(je, ctx, "gid", gid, sizeof(gid), "")) ||
      (rc = get_u64(je, ctx, "port_num", 0, 0, UINT8_MAX, &port_num)) ||
      (rc = get_u32(je, ctx, "mtu", 0, 0, &e->mtu)))
    return rc;
  e->port = (uint16_t)port;
  e->port_num = (uint8_t)port_num;
  if (strcmp(kind, "tcp") == 0)
    e->kind = SX_TRANSPORT_TCP;
  else if (strcmp(kind, "rdma") == 0)
    e->kind = SX_TRANSPORT_RDMA;
  else if (strcmp(kind, "cuda_ipc") == 0)
    e->kind = SX_TRANSPORT_CUDA_IPC;
  else
    return sx__err(SX_EINVAL, "%s: kind '%s' is not tcp, rdma or cuda_ipc", ctx, kind);
  if (gid[0] != '\0' && sx_unhex(gid, e->gid, SX_GID_LEN))
    return sx__err(SX_EINVAL, "%s: gid is not 32 hex digits", ctx);
  return 0;
}

static int parse_root(json_t *root, sx_desc *d) {
  int rc;
  if (!json_is_object(root))
    return sx__err(SX_EINVAL, "layout file: top level must be an object");
  json_t *layout = json_object_get(root, "layout");
  if (layout != NULL) {
    sx_layout *l = &d->layout;
    if (!json_is_object(layout))
      return sx__err(SX_EINVAL, "\"layout\" must be an object");
    if ((rc = get_str(layout, "layout", "fingerprint", l->fingerprint,
                      sizeof(l->fingerprint), "")) ||
        (rc = get_str(layout, "layout", "tag", l->tag, sizeof(l->tag), "")) ||
        (rc = get_str(layout, "layout", "dtype", l->dtype, sizeof(l->dtype), "")) ||
        (rc = get_u32(layout, "layout", "tp_rank", 0, 0, &l->tp_rank)) ||
        (rc = get_u32(layout, "layout", "tp_size", 0, 0, &l->tp_size)) ||
        (rc = get_u32(layout, "layout", "pp_rank", 0, 0, &l->pp_rank)) ||
        (rc = get_u32(layout, "layout", "pp_size", 0, 0, &l->pp_size)) ||
        (rc = get_u32(layout, "layout", "layer_first", 0, 0, &l->layer_first)) ||
        (rc = get_u32(layout, "layout", "layer_count", 0, 0, &l->layer_count)))
      return rc;
    json_t *bl = json_object_get(layout, "blocks");
    if (bl != NULL) {
      if (!json_is_array(bl) || json_array_size(bl) > SX_MAX_BLOCK_DESCS)
        return sx__err(SX_ELIMIT, "\"layout.blocks\" must be an array of at most %d",
                       SX_MAX_BLOCK_DESCS);
      for (size_t i = 0; i < json_array_size(bl); i++) {
        sx_block_desc b;
        if ((rc = parse_block(json_array_get(bl, i), (uint32_t)i, &b)))
          return rc;
        /* A description without dtype takes the layout's. */
        if (b.dtype[0] == '\0')
          snprintf(b.dtype, sizeof(b.dtype), "%s", l->dtype);
        l->blocks[l->n_blocks++] = b;
      }
    }
  }
  json_t *name = json_object_get(root, "name");
  if (name != NULL && (rc = get_str(root, "layout file", "name", d->name,
                                    sizeof(d->name), "")))
    return rc;
  json_t *labels = json_object_get(root, "labels");
  if (labels != NULL) {
    const char *key;
    json_t *v;
    if (!json_is_object(labels))
      return sx__err(SX_EINVAL, "\"labels\" must be an object of strings");
    json_object_foreach(labels, key, v) {
      if (!json_is_string(v))
        return sx__err(SX_EINVAL, "labels.%.64s must be a string", key);
      if ((rc = sx_desc_set_label(d, key, json_string_value(v))))
        return rc;
    }
  }
  json_t *eps = json_object_get(root, "endpoints");
  if (eps != NULL) {
    if (!json_is_array(eps) || json_array_size(eps) > SX_MAX_ENDPOINTS)
      return sx__err(SX_ELIMIT, "\"endpoints\" must be an array of at most %d",
                     SX_MAX_ENDPOINTS);
    for (size_t i = 0; i < json_array_size(eps); i++) {
      sx_endpoint e;
      if ((rc = parse_endpoint(json_array_get(eps, i), (uint32_t)i, &e)) ||
          (rc = sx_desc_add_endpoint(d, &e)))
        return rc;
    }
  }
  json_t *regs = json_object_get(root, "regions");
  if (regs == NULL || !json_is_array(regs))
    return sx__err(SX_EINVAL, "layout file: \"regions\" (an array) is required");
  if (json_array_size(regs) > SX_MAX_REGIONS)
    return sx__err(SX_ELIMIT, "layout file: %zu regions; the limit is %d",
                   json_array_size(regs), SX_MAX_REGIONS);
  for (size_t i = 0; i < json_array_size(regs); i++) {
    sx_region r;
    if ((rc = parse_region(json_array_get(regs, i), (uint32_t)i, &r)) ||
        (rc = sx_desc_add_region(d, &r)))
      return rc;
  }
  return sx__layout_validate(d);
}

#define SX__MAX_LAYOUT_FILE (8u << 20)

int sx_layout_parse(const char *text, size_t len, sx_desc *out) {
  json_error_t jerr;
  if (len > SX__MAX_LAYOUT_FILE)
    return sx__err(SX_ELIMIT, "layout file is %zu bytes; the limit is %u", len,
                   SX__MAX_LAYOUT_FILE);
  json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
  if (root == NULL)
    return sx__err(SX_EDECODE, "layout file: line %d column %d: %s", jerr.line,
                   jerr.column, jerr.text);
  sx_desc d;
  sx_desc_init(&d);
  int rc = parse_root(root, &d);
  json_decref(root);
  if (rc) {
    sx_desc_free(&d);
    return rc;
  }
  *out = d;
  return 0;
}

int sx_layout_load(const char *path, sx_desc *out) {
  FILE *f = fopen(path, "rb");
  if (f == NULL)
    return sx__err(SX_EIO, "%s: %s", path, strerror(errno));
  char *buf = NULL;
  size_t len = 0, cap = 0;
  for (;;) {
    if (len == cap) {
      cap = cap ? cap * 2 : 65536;
      if (cap > SX__MAX_LAYOUT_FILE + 1) {
        free(buf);
        fclose(f);
        return sx__err(SX_ELIMIT, "%s is larger than %u bytes", path, SX__MAX_LAYOUT_FILE);
      }
      char *nb = realloc(buf, cap);
      if (nb == NULL) {
        free(buf);
        fclose(f);
        return sx__err(SX_ENOMEM, "reading %s", path);
      }
      buf = nb;
    }
    size_t n = fread(buf + len, 1, cap - len, f);
    len += n;
    if (n == 0)
      break;
  }
  int err = ferror(f);
  fclose(f);
  if (err) {
    free(buf);
    return sx__err(SX_EIO, "reading %s failed", path);
  }
  int rc = sx_layout_parse(buf, len, out);
  free(buf);
  if (rc)
    return sx__errwrap(rc, "%s", path);
  return 0;
}
