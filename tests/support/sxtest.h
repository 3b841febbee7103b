/* Shared helpers for segxfer's cmocka tests. */
#ifndef SXTEST_H
#define SXTEST_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "segxfer.h"

/* Fill incarnation, token, name; one TCP endpoint; a typical layout. */
void sxt_desc_base(sx_desc *d, const char *name);

/*
 * An 80-layer style KV cache: for each slot in {K, V}, either one region
 * spanning all layers with a layer stride (per_layer == 0) or one region per
 * layer.  Regions are filled with plausible addresses and, when rdma_devices
 * is non-zero, that many RDMA endpoints and rkeys.
 */
void sxt_desc_kv(sx_desc *d, const char *name, uint32_t layers, int per_layer,
                 uint64_t block_bytes, uint64_t num_blocks, uint32_t rdma_devices);

/* Assert that a call returns 0, printing sx_errmsg() when it does not. */
#define sxt_ok(expr)                                                           \
  do {                                                                         \
    int sxt_rc_ = (expr);                                                      \
    if (sxt_rc_ != 0)                                                          \
      fail_msg("%s = %s (%s)", #expr, sx_err_name(sxt_rc_), sx_errmsg());      \
  } while (0)

/* Assert that a call returns exactly the code. */
#define sxt_rc(expr, code)                                                     \
  do {                                                                         \
    int sxt_rc_ = (expr);                                                      \
    if (sxt_rc_ != (code))                                                     \
      fail_msg("%s = %s, expected %s (%s)", #expr, sx_err_name(sxt_rc_),       \
               sx_err_name(code), sx_errmsg());                                \
  } while (0)

#endif
