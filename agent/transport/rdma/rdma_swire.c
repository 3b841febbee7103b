/*
 * Staged RDMA's wire (rdma_stage.h): the request and reply messages of a
 * stage QP, and the names of the GPU tiers.  Everything that arrives is
 * checked here before either side acts on it.
 */
#include <endian.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rdma_int.h"

static void hdr_pack(sx__rdma_smsg_hdr *h, uint8_t type, uint8_t slot, uint32_t seq, uint16_t n,
                     uint32_t status) {
  memset(h, 0, sizeof(*h));
  h->magic[0] = 'S';
  h->magic[1] = 'G';
  h->type = type;
  h->slot = slot;
  h->seq = htobe32(seq);
  h->n = htobe16(n);
  h->status = htobe32(status);
}

size_t sx__rdma_sreq_pack(uint8_t *buf, const sx__rdma_sreq *q) {
  sx__rdma_smsg_hdr h;
  hdr_pack(&h, q->write ? SX__RDMA_SMSG_WREQ : SX__RDMA_SMSG_REQ, q->slot, q->seq, q->n, 0);
  memcpy(buf, &h, sizeof(h));
  size_t off = sizeof(h);
  if (q->write) {
    sx__rdma_swsrc w = {.addr = htobe64(q->src.addr), .rkey = htobe32(q->src.rkey),
                        .bytes = htobe32(q->src.bytes)};
    memcpy(buf + off, &w, sizeof(w));
    off += sizeof(w);
  }
  for (uint16_t i = 0; i < q->n; i++) {
    sx__rdma_srange r = {.region = htobe32(q->r[i].region),
                         .len = htobe32(q->r[i].len),
                         .off = htobe64(q->r[i].off)};
    memcpy(buf + off, &r, sizeof(r));
    off += sizeof(r);
  }
  return off;
}

static int hdr_parse(const uint8_t *buf, size_t len, uint8_t type, sx__rdma_smsg_hdr *h) {
  if (len < sizeof(*h))
    return SX_EPROTO;
  memcpy(h, buf, sizeof(*h));
  if (h->magic[0] != 'S' || h->magic[1] != 'G' || h->type != type ||
      h->slot >= SX__RDMA_STAGE_SLOTS)
    return SX_EPROTO;
  h->seq = be32toh(h->seq);
  h->n = be16toh(h->n);
  h->status = be32toh(h->status);
  return 0;
}

int sx__rdma_sreq_parse(const uint8_t *buf, size_t len, int write, sx__rdma_sreq *out,
                        char *msg, size_t cap) {
  sx__rdma_smsg_hdr h;
  size_t head = sizeof(h) + (write ? sizeof(sx__rdma_swsrc) : 0);
  if (hdr_parse(buf, len, write ? SX__RDMA_SMSG_WREQ : SX__RDMA_SMSG_REQ, &h) != 0) {
    snprintf(msg, cap, "not a stage %srequest (%zu bytes)", write ? "write " : "", len);
    return SX_EPROTO;
  }
  if (h.n == 0 || h.n > SX__RDMA_STAGE_MAX_RANGES ||
      len != head + (size_t)h.n * sizeof(sx__rdma_srange)) {
    snprintf(msg, cap, "stage request of %zu bytes with %u ranges", len, h.n);
    return SX_EPROTO;
  }
  memset(&out->src, 0, sizeof(out->src));
  if (write) {
    sx__rdma_swsrc w;
    memcpy(&w, buf + sizeof(h), sizeof(w));
    out->src.addr = be64toh(w.addr);
    out->src.rkey = be32toh(w.rkey);
    out->src.bytes = be32toh(w.bytes);
  }
  uint64_t total = 0;
  for (uint16_t i = 0; i < h.n; i++) {
    sx__rdma_srange r;
    memcpy(&r, buf + head + i * sizeof(r), sizeof(r));
    out->r[i].region = be32toh(r.region);
    out->r[i].len = be32toh(r.len);
    out->r[i].off = be64toh(r.off);
    total += out->r[i].len;
    if (out->r[i].len == 0 || total > SX__RDMA_STAGE_SLOT_BYTES) {
      snprintf(msg, cap, "stage request: range %u has %u bytes (%llu in all, a slot holds %u)",
               i, out->r[i].len, (unsigned long long)total, SX__RDMA_STAGE_SLOT_BYTES);
      return SX_EPROTO;
    }
  }
  if (write && total != out->src.bytes) {
    snprintf(msg, cap, "stage write request: its slot holds %u bytes, its ranges %llu",
             out->src.bytes, (unsigned long long)total);
    return SX_EPROTO;
  }
  out->slot = h.slot;
  out->write = (uint8_t)(write != 0);
  out->seq = h.seq;
  out->n = h.n;
  return 0;
}

void sx__rdma_sreply_pack(sx__rdma_sreply *w, uint8_t slot, uint32_t seq, int status,
                          uint64_t addr, uint32_t rkey, uint32_t bytes) {
  hdr_pack(&w->h, SX__RDMA_SMSG_REPLY, slot, seq, 0, (uint32_t)-status);
  w->addr = htobe64(addr);
  w->rkey = htobe32(rkey);
  w->bytes = htobe32(bytes);
}

int sx__rdma_sreply_parse(const uint8_t *buf, size_t len, uint8_t *slot, uint32_t *seq,
                          int *status, uint64_t *addr, uint32_t *rkey, uint32_t *bytes) {
  sx__rdma_smsg_hdr h;
  sx__rdma_sreply w;
  if (len != sizeof(w) || hdr_parse(buf, len, SX__RDMA_SMSG_REPLY, &h) != 0)
    return SX_EPROTO;
  memcpy(&w, buf, sizeof(w));
  /* The status travels as the code's magnitude: bound it before negating
   * (a hostile 0x80000000 has no int negation). */
  if (h.status > (uint32_t)-(int64_t)SX_ERRNO_MIN)
    return SX_EPROTO;
  int st = -(int)h.status;
  *slot = h.slot;
  *seq = h.seq;
  *status = st;
  *addr = be64toh(w.addr);
  *rkey = be32toh(w.rkey);
  *bytes = be32toh(w.bytes);
  if (*bytes > SX__RDMA_STAGE_SLOT_BYTES)
    return SX_EPROTO;
  return 0;
}

int sx__rdma_ring_alloc(sx__rdma_ring *r, size_t bytes, size_t n_msgs) {
  void *mem = NULL;
  memset(r, 0, sizeof(*r));
  if (sx__mem_host_alloc(bytes, &mem) == 0)
    r->pinned = 1;
  else if (posix_memalign(&mem, 4096, bytes) != 0)
    mem = NULL;
  r->mem = mem;
  r->bytes = bytes;
  r->msg_bytes = n_msgs * SX__RDMA_SMSG_BYTES;
  r->msgs = calloc(n_msgs, SX__RDMA_SMSG_BYTES);
  if (r->mem == NULL || r->msgs == NULL) {
    sx__rdma_ring_free(r);
    return sx__err(SX_ENOMEM, "rdma: out of memory for a staging ring of %zu bytes", bytes);
  }
  return 0;
}

void sx__rdma_ring_free(sx__rdma_ring *r) {
  if (r->mr != NULL)
    ibv_dereg_mr(r->mr);
  if (r->msg_mr != NULL)
    ibv_dereg_mr(r->msg_mr);
  if (r->pinned)
    sx__mem_host_free(r->mem);
  else
    free(r->mem);
  free(r->msgs);
  memset(r, 0, sizeof(*r));
}

int sx__rdma_ring_post_recv(const sx__rdma_ring *r, struct ibv_qp *qp, uint32_t i) {
  struct ibv_sge sge = {.addr = (uintptr_t)(r->msgs + (size_t)i * SX__RDMA_SMSG_BYTES),
                        .length = SX__RDMA_SMSG_BYTES, .lkey = r->msg_mr->lkey};
  struct ibv_recv_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = SX__RDMA_SWR(SX__RDMA_SWR_RECV, i);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  return ibv_post_recv(qp, &wr, &bad);
}

static const char *const tier_names[] = {
    [SX__RDMA_GPU_AUTO] = "auto",       [SX__RDMA_GPU_DMABUF] = "dmabuf",
    [SX__RDMA_GPU_PEERMEM] = "peermem", [SX__RDMA_GPU_STAGED] = "staged",
    [SX__RDMA_GPU_OFF] = "off",
};

int sx__rdma_gpu_tier_parse(const char *s, sx__rdma_gpu_tier *out) {
  if (s == NULL || s[0] == '\0') {
    *out = SX__RDMA_GPU_AUTO;
    return 0;
  }
  for (size_t i = 0; i < sizeof(tier_names) / sizeof(tier_names[0]); i++) {
    if (strcmp(s, tier_names[i]) == 0) {
      *out = (sx__rdma_gpu_tier)i;
      return 0;
    }
  }
  return sx__err(SX_EINVAL, "RDMA GPU tier '%.32s' is none of dmabuf, peermem, staged, off, "
                 "auto", s);
}

const char *sx__rdma_gpu_tier_name(sx__rdma_gpu_tier t) {
  return (unsigned)t < sizeof(tier_names) / sizeof(tier_names[0]) ? tier_names[t] : "?";
}

int sx__rdma_ring_gather(sx_rdma *t, const sx__rdma_ring *r, sx__mem_stream *s,
                         const sx__mem_range *rg, size_t n, int sm_ok, int target) {
  int kernel_ok = sm_ok && r->pinned;
  sx__mem_copy_method used = SX__COPY_AUTO;
  int rc = sx__mem_gather(s, rg, n, kernel_ok ? SX__GATHER_SM_OK : 0, SX__COPY_AUTO, &used);
  unsigned bit = 1u << (used + (target ? 4 : 0));
  if (rc == 0 && !(t->ring_copies_said & bit)) {
    t->ring_copies_said |= bit;
    const char *why = used == SX__COPY_KERNEL || !kernel_ok
                          ? NULL
                          : sx__mem_kernel_error(sx__mem_stream_device(s));
    sx__rdma_log(t, SX_LOG_INFO, "rdma staged (%s): ring copies by %s (first used for %zu "
                 "ranges, %s%s%s)", target ? "target" : "reader", sx__mem_copy_name(used), n,
                 !r->pinned ? "ring not pinned"
                 : kernel_ok ? "device memory of the stream's GPU"
                             : "host memory or another GPU on the far side",
                 why ? "; " : "", why ? why : "");
  }
  return rc;
}

int sx__rdma_ring_copy_sync(const sx__mem_range *rg, size_t n, int gpu) {
  for (size_t i = 0; i < n; i++) {
    void *dst = (void *)(uintptr_t)rg[i].dst;
    const void *src = (const void *)(uintptr_t)rg[i].src;
    if (!gpu) {
      memcpy(dst, src, rg[i].len);
      continue;
    }
    int rc = sx__mem_copy(dst, src, rg[i].len);
    if (rc)
      return rc;
  }
  return 0;
}
