/* The README's agent example: a prefill agent publishes its KV cache, a
 * decode agent opens it by name, checks the layout and reads blocks.  Both
 * in one process here, on the in-process store (mem://) unless a metadata
 * URL is given. */
#include <segxfer.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                            \
  do {                                                                         \
    int rc_ = (call);                                                          \
    if (rc_ != 0) {                                                            \
      fprintf(stderr, "%s: %s: %s\n", #call, sx_err_name(rc_), sx_errmsg());   \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

enum { LAYERS = 4, BLOCKS = 64, BLOCK = 16384 };

/* K and V of every layer, one region each (layer stride = one layer). */
static void register_kv(sx_agent *a, uint8_t *kv[2], uint32_t blocks) {
  for (uint32_t slot = SX_SLOT_K; slot <= SX_SLOT_V; slot++) {
    sx_region_params r = {.addr = kv[slot], .length = (uint64_t)LAYERS * blocks * BLOCK,
                          .layer_count = LAYERS, .layer_stride = (uint64_t)blocks * BLOCK,
                          .slot = slot, .block_bytes = BLOCK, .num_blocks = blocks,
                          .access = SX_ACCESS_REMOTE_READ};
    uint32_t id;
    CHECK(sx_agent_register(a, &r, &id));
  }
}

int main(int argc, char **argv) {
  sx_agent_params p;
  sx_agent_params_init(&p);
  p.metadata_url = argc > 1 ? argv[1] : "mem://readme";
  strcpy(p.layout.fingerprint, "llama-3-8b/v1");
  strcpy(p.layout.tag, "NHD");
  strcpy(p.layout.dtype, "bf16");

  /* Prefill: register, publish (the lease is renewed from then on). */
  p.name = "prefill-0/tp0";
  p.listen = "127.0.0.1:0";
  sx_agent *prefill;
  CHECK(sx_agent_create(&p, &prefill));
  uint8_t *kv[2];
  for (int s = 0; s < 2; s++) {
    kv[s] = malloc((size_t)LAYERS * BLOCKS * BLOCK);
    memset(kv[s], 'K' + s * ('V' - 'K'), (size_t)LAYERS * BLOCKS * BLOCK);
  }
  register_kv(prefill, kv, BLOCKS);
  CHECK(sx_agent_publish(prefill, 0));

  /* Decode: a reader (no name) with the same layout and fewer blocks. */
  p.name = NULL;
  p.listen = NULL;
  sx_agent *decode;
  CHECK(sx_agent_create(&p, &decode));
  uint8_t *mine[2] = {calloc(LAYERS * 8, BLOCK), calloc(LAYERS * 8, BLOCK)};
  register_kv(decode, mine, 8);

  sx_segment *seg;
  CHECK(sx_segment_open(decode, "prefill-0/tp0", 5000, &seg)); /* waits up to 5 s */
  sx_mismatch m;
  if (sx_segment_check(seg, 0, &m) != 0) {
    fprintf(stderr, "incompatible: %s\n", m.message);
    return 1;
  }

  /* Blocks 10..17 of every layer, K and V, into local blocks 0..7. */
  sx_block_read rd = {.group = 0, .layer_first = 0, .layer_count = LAYERS,
                      .slots = 1u << SX_SLOT_K | 1u << SX_SLOT_V,
                      .remote_block = 10, .local_block = 0, .count = 8};
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = 5000;
  sx_batch *b;
  CHECK(sx_batch_create(seg, &bp, &b));
  CHECK(sx_batch_add_blocks(b, &rd, 1));
  CHECK(sx_batch_submit(b));
  CHECK(sx_batch_wait(b, -1)); /* or poll sx_batch_fd(b), or bp.cb */
  sx_batch_result res;
  CHECK(sx_batch_result_get(b, &res));
  printf("%s: %llu bytes in %u ranges, %.0f us; local V[0] = '%c'\n",
         sx_batch_state_name(res.state), (unsigned long long)res.bytes, res.n_ranges,
         (double)res.transfer_ns / 1e3, mine[1][0]);
  int ok = res.state == SX_BATCH_COMPLETED && mine[0][0] == 'K' && mine[1][0] == 'V';

  sx_batch_destroy(b);
  sx_segment_close(seg);
  sx_agent_destroy(decode);
  sx_agent_destroy(prefill); /* unpublishes */
  for (int s = 0; s < 2; s++) {
    free(kv[s]);
    free(mine[s]);
  }
  return ok ? 0 : 1;
}
