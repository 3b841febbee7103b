/* Descriptor fixtures for tests. */
#include <stdio.h>
#include <string.h>

#include "sxtest.h"

void sxt_desc_base(sx_desc *d, const char *name) {
  sx_desc_init(d);
  snprintf(d->name, sizeof(d->name), "%s", name);
  for (int i = 0; i < SX_INCARNATION_LEN; i++)
    d->incarnation[i] = (uint8_t)(0xa0 + i);
  for (int i = 0; i < SX_TOKEN_LEN; i++)
    d->token[i] = (uint8_t)(0x10 + i);
  d->generation = 7;
  d->published_at_ms = 1763700000000ull;
  d->lease_ms = 5000;
  snprintf(d->layout.fingerprint, sizeof(d->layout.fingerprint), "llama-3-70b/bf16/v1");
  snprintf(d->layout.tag, sizeof(d->layout.tag), "NHD");
  snprintf(d->layout.dtype, sizeof(d->layout.dtype), "bf16");
  d->layout.tp_rank = 3;
  d->layout.tp_size = 8;
  d->layout.pp_rank = 0;
  d->layout.pp_size = 1;
  sx_endpoint e;
  memset(&e, 0, sizeof(e));
  e.kind = SX_TRANSPORT_TCP;
  snprintf(e.addr, sizeof(e.addr), "10.1.2.3");
  e.port = 7400;
  assert_int_equal(sx_desc_add_endpoint(d, &e), 0);
  assert_int_equal(sx_desc_set_label(d, "role", "prefill"), 0);
  assert_int_equal(sx_desc_set_label(d, "host", "node-17"), 0);
}

void sxt_desc_kv(sx_desc *d, const char *name, uint32_t layers, int per_layer,
                 uint64_t block_bytes, uint64_t num_blocks, uint32_t rdma_devices) {
  sxt_desc_base(d, name);
  for (uint32_t k = 0; k < rdma_devices; k++) {
    sx_endpoint e;
    memset(&e, 0, sizeof(e));
    e.kind = SX_TRANSPORT_RDMA;
    snprintf(e.addr, sizeof(e.addr), "10.1.2.%u", 3 + k);
    e.port = (uint16_t)(7500 + k);
    snprintf(e.device, sizeof(e.device), "mlx5_%u", k);
    e.gid[10] = 0xff;
    e.gid[11] = 0xff;
    e.gid[15] = (uint8_t)k;
    e.port_num = 1;
    e.mtu = 4096;
    assert_int_equal(sx_desc_add_endpoint(d, &e), 0);
  }
  uint64_t layer_bytes = block_bytes * num_blocks;
  uint64_t base = 0x7f3a00000000ull;
  uint32_t id = 0;
  for (uint32_t slot = SX_SLOT_K; slot <= SX_SLOT_V; slot++) {
    uint32_t n = per_layer ? layers : 1;
    for (uint32_t i = 0; i < n; i++) {
      sx_region r;
      memset(&r, 0, sizeof(r));
      r.id = id++;
      r.group = 0;
      r.slot = slot;
      r.layer_first = per_layer ? i : 0;
      r.layer_count = per_layer ? 1 : layers;
      r.layer_stride = per_layer ? 0 : layer_bytes;
      r.block_bytes = block_bytes;
      r.block_stride = block_bytes;
      r.num_blocks = num_blocks;
      r.length = layer_bytes * r.layer_count;
      r.addr = base;
      base += r.length + 4096;
      r.access = SX_ACCESS_REMOTE_READ;
      snprintf(r.location, sizeof(r.location), "cpu");
      r.n_rkeys = rdma_devices;
      for (uint32_t k = 0; k < rdma_devices; k++)
        r.rkeys[k] = 0x1000u * (k + 1) + r.id;
      assert_int_equal(sx_desc_add_region(d, &r), 0);
    }
  }
}
