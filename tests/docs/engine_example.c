/*
 * The engine-integration guide's program (docs/engine-guide.md): a prefill
 * engine registers its paged KV cache and publishes it; a decode engine
 * resolves it by name, checks the layout, and reads one request's blocks
 * asynchronously, watching the batch's fd while its compute loop goes on.
 * Both engines live in this one process, on the in-process store (mem://)
 * unless a metadata URL is given.  make check builds and runs it
 * (tests/docs/check-example.sh), and checks that the guide's code blocks
 * are lines of this file.  Exit 0 when every byte read is right.
 */
#include <poll.h>
#include <segxfer.h>
#include <stdint.h>
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

enum { LAYERS = 4, BLOCK_BYTES = 8192, PREFILL_BLOCKS = 64, DECODE_BLOCKS = 16 };

/* A paged KV cache as one allocation, laid out per layer as K blocks then V
 * blocks: [layer][K|V][block][BLOCK_BYTES], like a per-layer
 * (2, num_blocks, ...) tensor packed layer after layer. */
typedef struct kv_cache {
  uint8_t *base;
  uint64_t num_blocks;
} kv_cache;

static uint8_t *kv_block(const kv_cache *c, uint32_t layer, uint32_t slot, uint64_t block) {
  return c->base + ((uint64_t)layer * 2 + slot) * c->num_blocks * BLOCK_BYTES +
         block * BLOCK_BYTES;
}

/* The byte a prefill block holds, so that the decode side can check it. */
static uint8_t fill_byte(uint32_t layer, uint32_t slot, uint64_t block) {
  return (uint8_t)(layer * 31 + slot * 7 + block * 3 + 1);
}

static void register_paged_kv(sx_agent *a, const kv_cache *c) {
  uint64_t layer_stride = 2 * c->num_blocks * BLOCK_BYTES; /* K and V of a layer */
  for (uint32_t slot = SX_SLOT_K; slot <= SX_SLOT_V; slot++) {
    sx_region_params r = {
        .addr = kv_block(c, 0, slot, 0),
        .length = (LAYERS - 1) * layer_stride + c->num_blocks * BLOCK_BYTES,
        .group = 0,
        .layer_first = 0,
        .layer_count = LAYERS,
        .layer_stride = layer_stride,
        .slot = slot,
        .block_bytes = BLOCK_BYTES,
        .block_stride = BLOCK_BYTES,
        .num_blocks = c->num_blocks,
        .access = SX_ACCESS_REMOTE_READ,
    };
    uint32_t id;
    CHECK(sx_agent_register(a, &r, &id));
  }
}

static sx_agent *engine_agent(const char *url, const char *name) {
  sx_agent_params p;
  sx_agent_params_init(&p);
  p.metadata_url = url;
  p.name = name;                        /* NULL: a reader that publishes nothing */
  p.listen = name ? "127.0.0.1:0" : NULL;
  snprintf(p.layout.fingerprint, sizeof(p.layout.fingerprint), "llama-3-8b/v1");
  snprintf(p.layout.tag, sizeof(p.layout.tag), "NHD");
  snprintf(p.layout.dtype, sizeof(p.layout.dtype), "bf16");
  p.layout.tp_rank = 0;
  p.layout.tp_size = 1;
  sx_agent *a;
  CHECK(sx_agent_create(&p, &a));
  return a;
}

/* The request's blocks: remote_blocks[i] of the prefill cache go to
 * local_blocks[i] of ours, every layer, K and V.  One entry per block; the
 * planner merges runs that are consecutive on both sides. */
static sx_batch *read_request(sx_segment *seg, const uint64_t *remote_blocks,
                              const uint64_t *local_blocks, size_t n) {
  sx_block_read *e = calloc(n, sizeof(*e));
  for (size_t i = 0; i < n; i++)
    e[i] = (sx_block_read){.group = 0, .layer_first = 0, .layer_count = LAYERS,
                           .slots = 1u << SX_SLOT_K | 1u << SX_SLOT_V,
                           .remote_block = remote_blocks[i],
                           .local_block = local_blocks[i], .count = 1};
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = 5000;
  sx_batch *b;
  CHECK(sx_batch_create(seg, &bp, &b));
  CHECK(sx_batch_add_blocks(b, e, n));
  free(e);
  CHECK(sx_batch_submit(b)); /* returns at once */
  return b;
}

int main(int argc, char **argv) {
  const char *url = argc > 1 ? argv[1] : "mem://engine-guide";

  /* Prefill engine: its KV cache, registered and published. */
  kv_cache pc = {.base = malloc((size_t)LAYERS * 2 * PREFILL_BLOCKS * BLOCK_BYTES),
                 .num_blocks = PREFILL_BLOCKS};
  for (uint32_t l = 0; l < LAYERS; l++)
    for (uint32_t s = SX_SLOT_K; s <= SX_SLOT_V; s++)
      for (uint64_t b = 0; b < PREFILL_BLOCKS; b++)
        memset(kv_block(&pc, l, s, b), fill_byte(l, s, b), BLOCK_BYTES);
  sx_agent *prefill = engine_agent(url, "prefill-0/tp0");
  register_paged_kv(prefill, &pc);
  CHECK(sx_agent_publish(prefill, 0));

  /* Decode engine: the same layout, fewer blocks. */
  kv_cache dc = {.base = calloc((size_t)LAYERS * 2 * DECODE_BLOCKS, BLOCK_BYTES),
                 .num_blocks = DECODE_BLOCKS};
  sx_agent *decode = engine_agent(url, NULL);
  register_paged_kv(decode, &dc);

  /* Resolve the peer by name (waits up to 5 s for it to appear) and check
   * its layout against ours before reading anything. */
  sx_segment *seg;
  CHECK(sx_segment_open(decode, "prefill-0/tp0", 5000, &seg));
  sx_mismatch m;
  if (sx_segment_check(seg, 0, &m) != 0) {
    fprintf(stderr, "prefill-0/tp0 is incompatible: %s\n", m.message);
    return 1;
  }

  /* A request whose prompt sits in prefill blocks 7, 8, 9, 3, 40 and goes
   * to our blocks 0..4. */
  const uint64_t remote_blocks[] = {7, 8, 9, 3, 40};
  const uint64_t local_blocks[] = {0, 1, 2, 3, 4};
  const size_t n = sizeof(remote_blocks) / sizeof(remote_blocks[0]);
  sx_batch *b = read_request(seg, remote_blocks, local_blocks, n);

  /* The engine's loop: compute steps go on; the batch's fd joins the
   * descriptors the loop polls (here alone, without waiting). */
  struct pollfd pfd = {.fd = sx_batch_fd(b), .events = POLLIN};
  int steps = 0;
  while (poll(&pfd, 1, 0) == 0) {
    steps++; /* ... one step of decoding other requests ... */
    poll(NULL, 0, 1);
  }
  sx_batch_result res;
  CHECK(sx_batch_result_get(b, &res));
  if (res.state != SX_BATCH_COMPLETED) {
    fprintf(stderr, "request failed: %s %s: %s\n", sx_batch_state_name(res.state),
            sx_err_name(res.error), res.message);
    return 1;
  }
  printf("%s: %llu bytes in %u ranges via %s, %d compute steps meanwhile\n",
         sx_batch_state_name(res.state), (unsigned long long)res.bytes, res.n_ranges,
         sx_segment_transport(seg) == SX_TRANSPORT_RDMA ? "rdma" : "tcp", steps);
  sx_batch_destroy(b);

  int wrong = 0;
  for (size_t i = 0; i < n; i++)
    for (uint32_t l = 0; l < LAYERS; l++)
      for (uint32_t s = SX_SLOT_K; s <= SX_SLOT_V; s++) {
        const uint8_t *p = kv_block(&dc, l, s, local_blocks[i]);
        for (size_t k = 0; k < BLOCK_BYTES; k++)
          wrong += p[k] != fill_byte(l, s, remote_blocks[i]);
      }
  printf("%s\n", wrong ? "WRONG BYTES" : "every byte checked");

  sx_segment_close(seg);
  sx_agent_destroy(decode);
  sx_agent_destroy(prefill); /* unpublishes */
  free(pc.base);
  free(dc.base);
  return wrong ? 1 : 0;
}
