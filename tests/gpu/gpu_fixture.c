/* Fixtures for the GPU suite (see gpu_fixture.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu_fixture.h"
#include "internal.h"
#include "pattern.h"

int gpu_devices(void) {
  int n = 0;
  return sx__mem_cuda_devices(&n) == 0 ? n : 0;
}

int gpu_store_setup(sxt_redis *r, char *url, size_t size, const char *who, const char *ns) {
  if (gpu_devices() == 0) {
    fprintf(stderr, "%s: no CUDA device: %s\n", who, sx_errmsg());
    return -1;
  }
  sxt_redis_opts o = {.notify = "Kx"};
  if (sxt_redis_start(r, &o) != 0) {
    fprintf(stderr, "%s: cannot start redis-server\n", who);
    return -1;
  }
  char q[64];
  snprintf(q, sizeof(q), "namespace=%s", ns);
  sxt_redis_url(r, url, size, q);
  return 0;
}

sx_agent *gpu_target_publish(const sx_agent_params *p, gpu_pool *pool, const char *location,
                             uint32_t layers, uint64_t blocks, uint64_t block_bytes,
                             uint64_t seed) {
  sx_agent *a;
  if (sx_agent_create(p, &a) != 0) {
    fprintf(stderr, "target: %s\n", sx_errmsg());
    return NULL;
  }
  gpu_pool_make(pool, a, location, layers, blocks, block_bytes, seed);
  if (sx_agent_publish(a, 0) != 0) {
    fprintf(stderr, "target: %s\n", sx_errmsg());
    return NULL;
  }
  return a;
}

int gpu_on_stand_in(void) {
  const char *lib = getenv("SX_CUDA_LIBRARY");
  return lib != NULL && strstr(lib, "fakecuda") != NULL;
}

uint64_t gpu_copy_count(sx__mem_copy_method m) {
  uint64_t c[4];
  sx__mem_copy_counts(c);
  return c[m];
}

pid_t gpu_spawn(const char *path, const char *const argv[], FILE **in, FILE **out) {
  int to[2], from[2];
  assert_int_equal(pipe(to), 0);
  assert_int_equal(pipe(from), 0);
  fflush(NULL);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    dup2(to[0], 0);
    dup2(from[1], 1);
    close(to[1]);
    close(from[0]);
    execv(path, (char *const *)argv); /* execv does not write them */
    _exit(127);
  }
  close(to[0]);
  close(from[1]);
  *in = fdopen(to[1], "w");
  *out = fdopen(from[0], "r");
  return pid;
}

sx_agent *gpu_agent(const char *url, const char *name, uint64_t staging_bytes,
                    unsigned transports) {
  sx_agent_params p;
  sxt_params(&p, url, name);
  p.listen = name ? "127.0.0.1:0" : NULL;
  p.staging_bytes = staging_bytes;
  if (transports)
    p.transports = transports;
  sx_agent *a;
  sxt_ok(sx_agent_create(&p, &a));
  return a;
}

void gpu_pool_make(gpu_pool *p, sx_agent *a, const char *location, uint32_t layers,
                   uint64_t blocks, uint64_t block_bytes, uint64_t seed) {
  gpu_pool_make_access(p, a, location, layers, blocks, block_bytes, seed,
                       SX_ACCESS_REMOTE_READ);
}

void gpu_pool_make_access(gpu_pool *p, sx_agent *a, const char *location, uint32_t layers,
                          uint64_t blocks, uint64_t block_bytes, uint64_t seed,
                          uint32_t access) {
  memset(p, 0, sizeof(*p));
  p->a = a;
  p->location = location;
  p->layers = layers;
  p->blocks = blocks;
  p->block_bytes = block_bytes;
  uint64_t layer_bytes = blocks * block_bytes, len = layers * layer_bytes;
  sx__mem_info m;
  sxt_ok(sx__mem_parse_location(location, &m));
  uint8_t *host = calloc(1, len);
  assert_non_null(host);
  for (int s = 0; s < 2; s++) {
    if (m.kind == SX__MEM_CUDA)
      sxt_ok(sx__mem_alloc(m.device, len, (void **)&p->mem[s]));
    else
      assert_non_null(p->mem[s] = malloc(len));
    sx_region_params rp = {.addr = p->mem[s], .length = len, .layer_count = layers,
                           .layer_stride = layer_bytes, .slot = (uint32_t)s,
                           .block_bytes = block_bytes, .num_blocks = blocks,
                           .location = location, .access = access};
    sxt_ok(sx_agent_register(a, &rp, &p->id[s]));
    /* The pattern is written into a host buffer and copied in. */
    if (seed != 0)
      sx__pattern_fill(host, len, seed, p->id[s], 0);
    else
      memset(host, 0, len);
    if (m.kind == SX__MEM_CUDA)
      sxt_ok(sx__mem_copy(p->mem[s], host, len));
    else
      memcpy(p->mem[s], host, len);
  }
  free(host);
}

void gpu_pool_free(gpu_pool *p) {
  for (int s = 0; s < 2; s++) {
    if (strcmp(p->location, "cpu") == 0)
      free(p->mem[s]);
    else
      sx__mem_free(p->mem[s]);
    p->mem[s] = NULL;
  }
}

int gpu_pool_verify(const gpu_pool *p, const sx_segment *seg, uint64_t seed,
                    const sx_block_read *e, size_t n) {
  uint64_t len = p->layers * p->blocks * p->block_bytes;
  uint8_t *host[2];
  for (int s = 0; s < 2; s++) {
    host[s] = calloc(1, len);
    assert_non_null(host[s]);
  }
  /* Only the blocks the entries wrote: other reads may still be writing
   * the rest of the pool (read_overlapped checks each batch as it ends). */
  for (size_t i = 0; i < n; i++) {
    for (uint32_t l = e[i].layer_first; l < e[i].layer_first + e[i].layer_count; l++) {
      for (int s = 0; s < 2; s++) {
        if (!(e[i].slots & (1ull << s)))
          continue;
        uint64_t off = ((uint64_t)l * p->blocks + e[i].local_block) * p->block_bytes,
                 n_bytes = e[i].count * p->block_bytes;
        assert_true(off + n_bytes <= len);
        sxt_ok(strcmp(p->location, "cpu") == 0
                   ? (memcpy(host[s] + off, p->mem[s] + off, n_bytes), 0)
                   : sx__mem_copy(host[s] + off, p->mem[s] + off, n_bytes));
      }
    }
  }
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++)
    rc = sxt_verify(host, p->blocks, seg, seed, &e[i]);
  free(host[0]);
  free(host[1]);
  return rc;
}

void gpu_entries(sx_block_read *e, size_t n, uint32_t layers, uint64_t remote_blocks,
                 uint64_t local_blocks, uint64_t count, uint32_t seed) {
  uint32_t rng = seed * 2654435761u + 1;
  assert_true(n * count <= local_blocks);
  for (size_t i = 0; i < n; i++) {
    rng = rng * 1103515245u + 12345u;
    e[i] = (sx_block_read){.group = 0, .layer_first = 0, .layer_count = layers,
                           .slots = SXT_KV,
                           .remote_block = (rng >> 8) % (remote_blocks - count + 1),
                           .local_block = (uint64_t)i * count, .count = count};
  }
}

/* Bytes [off, off+len) of slot s, copied to host memory (malloc()ed), or
 * NULL.  No cmocka assertion: the checks below also run in an agent's
 * notice callback, on its thread. */
static uint8_t *pool_bytes(const gpu_pool *p, int s, uint64_t off, uint64_t len) {
  uint8_t *h = malloc(len ? len : 1);
  if (h == NULL)
    return NULL;
  if (strcmp(p->location, "cpu") == 0)
    memcpy(h, p->mem[s] + off, len);
  else if (sx__mem_copy(h, p->mem[s] + off, len) != 0) {
    print_error("copying back: %s\n", sx_errmsg());
    free(h);
    return NULL;
  }
  return h;
}

int gpu_pool_check_written(const gpu_pool *p, const uint32_t pid[2], uint64_t pblocks,
                           uint64_t seed, uint64_t src, uint64_t dst, uint64_t count) {
  uint64_t bb = p->block_bytes, len = count * bb;
  for (int s = 0; s < 2; s++) {
    for (uint32_t l = 0; l < p->layers; l++) {
      uint8_t *h = pool_bytes(p, s, (l * p->blocks + dst) * bb, len);
      uint64_t bad = 0;
      int rc = h == NULL ? -1
                         : sx__pattern_check(h, len, seed, pid[s], (l * pblocks + src) * bb, &bad);
      free(h);
      if (rc != 0) {
        print_error("slot %d layer %u blocks %lu->%lu x%lu: byte %lu differs\n", s, l,
                    (unsigned long)src, (unsigned long)dst, (unsigned long)count,
                    (unsigned long)bad);
        return -1;
      }
    }
  }
  return 0;
}

int gpu_pool_zero(const gpu_pool *p, uint64_t dst, uint64_t count) {
  uint64_t len = count * p->block_bytes;
  for (int s = 0; s < 2; s++) {
    for (uint32_t l = 0; l < p->layers; l++) {
      uint8_t *h = pool_bytes(p, s, (l * p->blocks + dst) * p->block_bytes, len);
      uint64_t i = 0;
      while (h != NULL && i < len && h[i] == 0)
        i++;
      free(h);
      if (h == NULL || i < len) {
        print_error("slot %d layer %u block %lu: byte %lu is not zero\n", s, l,
                    (unsigned long)dst, (unsigned long)i);
        return -1;
      }
    }
  }
  return 0;
}

uint8_t *gpu_pool_snapshot(const gpu_pool *p) {
  uint64_t len = p->layers * p->blocks * p->block_bytes;
  uint8_t *h = malloc(2 * len);
  assert_non_null(h);
  for (int s = 0; s < 2; s++) {
    uint8_t *b = pool_bytes(p, s, 0, len);
    assert_non_null(b);
    memcpy(h + s * len, b, len);
    free(b);
  }
  return h;
}
