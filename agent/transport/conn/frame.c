/* The TCP data-plane wire format (see frame.h for the layout). */
#include <stdio.h>
#include <string.h>

#include "segxfer/push.h"
#include "frame.h"

static void put16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)(v >> 8);
  p[1] = (uint8_t)v;
}

static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (24 - 8 * i));
}

static void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (56 - 8 * i));
}

static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }

static uint32_t get32(const uint8_t *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static uint64_t get64(const uint8_t *p) {
  return (uint64_t)get32(p) << 32 | get32(p + 4);
}

void sx__frame_encode(const sx__frame *f, uint8_t out[SX__FRAME_HDR]) {
  put32(out, SX__FRAME_MAGIC);
  out[4] = SX__FRAME_VERSION;
  out[5] = f->type;
  put16(out + 6, 0);
  put64(out + 8, f->id);
  put32(out + 16, f->region);
  put32(out + 20, (uint32_t)f->status);
  put64(out + 24, f->offset);
  put64(out + 32, f->length);
}

static const uint8_t magic[4] = {SX__FRAME_MAGIC >> 24, SX__FRAME_MAGIC >> 16 & 0xff,
                                 SX__FRAME_MAGIC >> 8 & 0xff, SX__FRAME_MAGIC & 0xff};

int sx__frame_foreign(const uint8_t *buf, size_t len) {
  return len > 0 && memcmp(buf, magic, len < 4 ? len : 4) != 0;
}

int sx__frame_decode(const uint8_t *buf, size_t len, sx__frame *out) {
  /* The magic and the version are judged as soon as their bytes are in:
   * something that is no segxfer peer (an HTTP probe, a port scan) is
   * refused at once rather than held until a whole header arrives. */
  if (sx__frame_foreign(buf, len))
    return SX_EPROTO;
  if (len > 4 && buf[4] != SX__FRAME_VERSION)
    return SX_EVERSION;
  if (len < SX__FRAME_HDR)
    return 0;
  if (get16(buf + 6) != 0)
    return SX_EPROTO;
  sx__frame f;
  f.type = buf[5];
  f.id = get64(buf + 8);
  f.region = get32(buf + 16);
  f.status = (int32_t)get32(buf + 20);
  f.offset = get64(buf + 24);
  f.length = get64(buf + 32);
  if (f.status > 0)
    return SX_EPROTO;
  switch (f.type) {
  case SX__FRAME_HELLO:
    if (f.status != 0 || f.length < SX__HELLO_FIXED || f.length > SX__HELLO_MAX)
      return SX_EPROTO;
    break;
  case SX__FRAME_READ:
    if (f.status != 0)
      return SX_EPROTO;
    break;
  case SX__FRAME_HELLO_REPLY:
    if (f.length != 0)
      return SX_EPROTO;
    break;
  case SX__FRAME_READV:
    if (f.status != 0 || f.region != 0 || f.offset != 0 || f.length == 0 ||
        f.length % SX__READV_ENTRY != 0 || f.length > SX__READV_ENTRY * SX__READV_MAX)
      return SX_EPROTO;
    break;
  case SX__FRAME_READ_REPLY:
    if (f.status != 0 && f.length != 0)
      return SX_EPROTO;
    break;
  case SX__FRAME_WAUTH:
    if (f.status != 0 || f.length != SX__WAUTH_BODY)
      return SX_EPROTO;
    break;
  case SX__FRAME_WRITE:
    if (f.status != 0)
      return SX_EPROTO;
    break;
  case SX__FRAME_NOTICE:
  case SX__FRAME_RNOTICE:
    if (f.status != 0 || f.length > SX_NOTICE_MAX_BYTES)
      return SX_EPROTO;
    break;
  case SX__FRAME_WAUTH_REPLY:
  case SX__FRAME_WRITE_REPLY:
  case SX__FRAME_NOTICE_REPLY:
    if (f.length != 0)
      return SX_EPROTO;
    break;
  case SX__FRAME_IPC:
    if (f.status != 0 || f.length == 0 || f.length % 4 != 0 ||
        f.length > 4u * SX__IPC_MAX_IDS)
      return SX_EPROTO;
    break;
  case SX__FRAME_IPC_REPLY:
    if (f.status != 0 ? f.length != 0
        : f.id == 0 ? f.length == 0 || f.length % 4 != 0 || f.length > 4u * SX__IPC_MAX_IDS
                    : f.length % SX__IPC_RECORD != 0 ||
                          f.length > (uint64_t)SX__IPC_RECORD * SX__IPC_MAX_IDS)
      return SX_EPROTO;
    break;
  default:
    return SX_EPROTO;
  }
  *out = f;
  return SX__FRAME_HDR;
}

void sx__range_encode(const sx__range *r, uint8_t out[SX__READV_ENTRY]) {
  put32(out, r->region);
  put32(out + 4, 0);
  put64(out + 8, r->offset);
  put64(out + 16, r->length);
}

int sx__range_decode(const uint8_t in[SX__READV_ENTRY], sx__range *out) {
  if (get32(in + 4) != 0 || get64(in + 16) == 0)
    return SX_EPROTO;
  *out = (sx__range){get32(in), get64(in + 8), get64(in + 16)};
  return 0;
}

int sx__hello_encode(const sx__hello *h, uint8_t *out, size_t cap) {
  size_t n = strnlen(h->name, sizeof(h->name));
  if (n > SX_NAME_MAX || cap < SX__HELLO_FIXED + n)
    return SX_ENAME;
  memcpy(out, h->incarnation, SX_INCARNATION_LEN);
  memcpy(out + 16, h->token, SX_TOKEN_LEN);
  put16(out + 32, (uint16_t)n);
  memcpy(out + SX__HELLO_FIXED, h->name, n);
  return (int)(SX__HELLO_FIXED + n);
}

int sx__hello_build(const uint8_t *incarnation, const uint8_t *token, const char *name,
                    uint8_t *out, size_t cap) {
  sx__hello h;
  memcpy(h.incarnation, incarnation, SX_INCARNATION_LEN);
  memcpy(h.token, token, SX_TOKEN_LEN);
  snprintf(h.name, sizeof(h.name), "%s", name ? name : "");
  return sx__hello_encode(&h, out, cap);
}

int sx__hello_decode(const uint8_t *buf, size_t len, sx__hello *out) {
  if (len < SX__HELLO_FIXED || len > SX__HELLO_MAX)
    return SX_EPROTO;
  size_t n = get16(buf + 32);
  if (n > SX_NAME_MAX || len != SX__HELLO_FIXED + n)
    return SX_EPROTO;
  for (size_t i = 0; i < n; i++) {
    uint8_t c = buf[SX__HELLO_FIXED + i];
    if (c < 0x20 || c > 0x7e)
      return SX_EPROTO;
  }
  memcpy(out->incarnation, buf, SX_INCARNATION_LEN);
  memcpy(out->token, buf + 16, SX_TOKEN_LEN);
  memcpy(out->name, buf + SX__HELLO_FIXED, n);
  out->name[n] = '\0';
  return 0;
}

void sx__conn_lost_msg(const char *label, const char *why, char *msg, size_t size) {
  if (why == NULL)
    snprintf(msg, size, "%s closed the connection", label);
  else
    snprintf(msg, size, "connection to %s lost: %s", label, why);
}

int sx__hello_refused(int32_t status, const char *label, const uint8_t *incarnation,
                      char *msg, size_t size) {
  char inc[2 * SX_INCARNATION_LEN + 1];
  sx_hex(incarnation, SX_INCARNATION_LEN, inc);
  if (status == SX_ESTALE)
    snprintf(msg, size, "%s is no longer incarnation %.8s (the target restarted); "
             "reopen the segment", label, inc);
  else if (status == SX_EACCESS)
    snprintf(msg, size, "%s refused our access token", label);
  else
    snprintf(msg, size, "%s refused the connection: %s", label, sx_strerror(status));
  return status < 0 && status >= SX_ERRNO_MIN ? status : SX_EPROTO;
}
