/*
 * GPU suite, strided ranges over cuda_ipc (sx__plan_add_strided, the
 * pieces a token-major read plan cuts): a reader and a target in two
 * processes of one host (this binary runs itself as the target), a real
 * redis-server as the store.  Each copy method forced (the strided gather
 * kernel, the batch call, single copies) and auto read the pieces byte for
 * byte into GPU memory and into host memory, next to plain ranges of the
 * same batch, and write nothing between them; between two GPUs where there
 * are two.  Bad strides, overlapping pieces and pieces outside either
 * region are refused with a message before anything moves; a batch that
 * ends by its deadline settles its strided xfers and leaves no mapping.
 *
 * The entries are added to the batch the way the set read feeds its
 * pieces (agent/group.c feed_one: sx__batch_entries, then the planner
 * with the local region found in the batch's own index).
 *
 * Also the memory layer's based gather on its own (sx__mem_gather_based,
 * a table written in place in memory of the pinned pool): every alignment
 * path, on a stream and through a launcher (whose failed launch reaches
 * the next notice).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "agent_int.h"
#include "gpu_fixture.h"
#include "internal.h"
#include "pattern.h"
#include "procs.h"
#include "push_int.h" /* sx__batch_entries */
#include "redis_harness.h"

#define SEED 0x57121dedu
#define LAYERS 2
#define BLOCKS 64
#define BB 32768

static sxt_redis redis;
static char url[256];
static char self[4096];

/* ------------------------------------------------------------ the target */

/* argv: target URL NAME LOCATION.  Says "ready" once published, exits at
 * the end of stdin. */
static int target_main(char **argv) {
  sx_agent_params p;
  sxt_params(&p, argv[2], argv[3]);
  p.listen = "127.0.0.1:0";
  gpu_pool pool;
  sx_agent *a = gpu_target_publish(&p, &pool, argv[4], LAYERS, BLOCKS, BB, SEED);
  if (a == NULL)
    return 1;
  printf("ready\n");
  fflush(stdout);
  char line[64];
  while (fgets(line, sizeof(line), stdin) != NULL) {
  }
  sx_agent_destroy(a);
  gpu_pool_free(&pool);
  return 0;
}

typedef struct target {
  pid_t pid;
  FILE *in, *out;
} target;

/* What a test holds, ended by the teardown when an assertion left early. */
static struct {
  target t;
  sx_agent *a;
  gpu_pool pool;
} held;

static void target_start(target *t, const char *name, const char *location) {
  const char *argv[] = {"test_gpu_stride", "target", url, name, location, NULL};
  t->pid = gpu_spawn(self, argv, &t->in, &t->out);
  held.t = *t;
  char line[64];
  if (fgets(line, sizeof(line), t->out) == NULL || strncmp(line, "ready", 5) != 0)
    fail_msg("the target (%s on %s) did not start", name, location);
}

static int target_end(target *t) {
  int st = -1;
  fclose(t->in); /* end of stdin: it exits */
  fclose(t->out);
  waitpid(t->pid, &st, 0);
  memset(&held.t, 0, sizeof(held.t));
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* ------------------------------------------------------------ expectations */

/* The reader's side: its pool and, per slot, what its memory must hold. */
typedef struct reader {
  sx_agent *a;
  gpu_pool pool;
  uint8_t *want[2];
  uint64_t len; /* of each region */
  sx_segment *seg;
  uint32_t rid[2]; /* the target's region ids (K, V) */
} reader;

static void reader_open_via(reader *r, const char *tname, const char *rname,
                            const char *location, unsigned transports,
                            sx_transport_kind want) {
  memset(r, 0, sizeof(*r));
  r->a = held.a = gpu_agent(url, rname, 0, transports);
  gpu_pool_make(&r->pool, r->a, location, LAYERS, BLOCKS, BB, 0);
  held.pool = r->pool;
  r->len = (uint64_t)LAYERS * BLOCKS * BB;
  for (int s = 0; s < 2; s++)
    assert_non_null(r->want[s] = calloc(1, r->len));
  sxt_ok(sx_segment_open(r->a, tname, 5000, &r->seg));
  assert_int_equal(sx_segment_transport(r->seg), want);
  const sx_desc *d = sx_segment_desc(r->seg);
  assert_int_equal(d->n_regions, 2);
  for (int s = 0; s < 2; s++)
    r->rid[d->regions[s].slot] = d->regions[s].id;
}

static void reader_open(reader *r, const char *tname, const char *rname, const char *location) {
  reader_open_via(r, tname, rname, location, 0, SX_TRANSPORT_CUDA_IPC);
}

static void reader_close(reader *r) {
  sx_segment_close(r->seg);
  for (int i = 0; i < 100 && sx__mem_ipc_open_count() != 0; i++)
    sxt_sleep_ms(10);
  assert_int_equal(sx__mem_ipc_open_count(), 0);
  sx_agent_destroy(r->a);
  held.a = NULL;
  gpu_pool_free(&r->pool);
  memset(&held.pool, 0, sizeof(held.pool));
  free(r->want[0]);
  free(r->want[1]);
}

/* A batch being filled, and its plan. */
typedef struct filling {
  reader *r;
  sx_batch *b;
  sx__plan *plan;
  uint64_t bytes;
} filling;

static void fill_start(filling *f, reader *r, uint32_t timeout_ms) {
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = timeout_ms;
  f->r = r;
  f->bytes = 0;
  sxt_ok(sx_batch_create(r->seg, &bp, &f->b));
  sx__pbatch *pb;
  sxt_ok(sx__batch_entries(f->b, 0, "test_gpu_stride", &f->plan, &pb));
}

/* count pieces of len from slot s's remote bytes roff (every rstride) into
 * the reader's slot s at loff (every lstride): the planner's answer. */
static int strided(filling *f, int s, uint64_t roff, uint64_t rstride, uint64_t loff,
                   uint64_t lstride, uint64_t len, uint32_t count) {
  reader *r = f->r;
  const sx_region *R = sx__rindex_id(&r->seg->ix, r->rid[s]);
  const sx_lregion *L = (const sx_lregion *)sx__rindex_id(f->plan->local, r->pool.id[s]);
  assert_non_null(R);
  assert_non_null(L);
  int rc = sx__plan_add_strided(f->plan, R, L, roff, rstride, r->pool.mem[s] + loff, lstride,
                                len, count);
  if (rc == 0) {
    for (uint64_t k = 0; k < count; k++)
      sx__pattern_fill(r->want[s] + loff + k * lstride, len, SEED, r->rid[s],
                       roff + k * rstride);
    f->bytes += len * count;
  }
  return rc;
}

/* One plain range in the same batch. */
static void plain(filling *f, int s, uint64_t roff, uint64_t loff, uint64_t len) {
  reader *r = f->r;
  sx_range_read rr = {.local = r->pool.mem[s] + loff, .remote_region = r->rid[s],
                      .offset = roff, .length = len};
  sxt_ok(sx_batch_add_ranges(f->b, &rr, 1));
  sx__pattern_fill(r->want[s] + loff, len, SEED, r->rid[s], roff);
  f->bytes += len;
}

static sx_batch_result fill_run(filling *f) {
  sx_batch_result res;
  sxt_ok(sx_batch_submit(f->b));
  sxt_ok(sx_batch_wait(f->b, -1));
  sxt_ok(sx_batch_result_get(f->b, &res));
  res.failed = NULL; /* not valid after destroy */
  sx_batch_destroy(f->b);
  f->b = NULL;
  return res;
}

/* Does the reader's memory hold exactly what it must, gaps included? */
static void reader_check(const reader *r) {
  uint8_t *got = malloc(r->len);
  assert_non_null(got);
  for (int s = 0; s < 2; s++) {
    sxt_ok(sx__mem_copy(got, r->pool.mem[s], r->len));
    for (uint64_t i = 0; i < r->len; i++)
      if (got[i] != r->want[s][i])
        fail_msg("slot %d byte %lu: 0x%02x, want 0x%02x", s, (unsigned long)i, got[i],
                 r->want[s][i]);
  }
  free(got);
}

/*
 * One read of every shape: a TP=2 -> TP=1 token-major plan (per local
 * block, each of two members' 16 pieces of 1 KiB: the member's 16 KiB
 * block read contiguously, landing every 2 KiB; consecutive blocks extend
 * one strided xfer, as a member's pieces come one after another), pieces
 * at odd addresses (the kernel's byte path), 4-byte aligned ones (its word
 * path), pieces longer than a kernel table entry, a run of pieces longer
 * than one, and plain ranges beside them.  Returns the batch's ranges.
 */
static uint32_t read_shapes(reader *r, sx_transport_kind want) {
  filling f;
  fill_start(&f, r, 10000);
  static const uint64_t rblocks[] = {3, 4, 5, 6, 40, 7};
  static const uint64_t lblocks[] = {10, 11, 12, 13, 2, 30};
  /* Member h's blocks of 16 KiB: the second half of the target's
   * layer from block BLOCKS / 2 on for h = 1. */
  for (uint32_t l = 0; l < LAYERS; l++)
    for (int s = 0; s < 2; s++)
      for (uint64_t h = 0; h < 2; h++)
        for (size_t i = 0; i < sizeof(rblocks) / sizeof(rblocks[0]); i++)
          sxt_ok(strided(&f, s, (l * BLOCKS + h * BLOCKS / 2) * BB + rblocks[i] * (BB / 2),
                         1024, (l * BLOCKS + lblocks[i]) * BB + h * 1024, 2048, 1024, 16));
  /* Local layer 1 from block 32 on is not written above. */
  uint64_t far = (uint64_t)(BLOCKS + 32) * BB;
  sxt_ok(strided(&f, 0, 3, 300, far + 5, 101, 100, 50));
  sxt_ok(strided(&f, 1, 4 * 7, 16, far + 4 * 9, 20, 12, 300));
  sxt_ok(strided(&f, 0, 8 * BB, 70000, far + 4 * BB, 80000, 70000, 2));
  sxt_ok(strided(&f, 1, 16 * BB, 1024, far + 8 * BB, 1024 + 512, 1024, 200));
  plain(&f, 0, 20 * BB + 1, far + 16 * BB + 3, 3 * BB);
  plain(&f, 1, 24 * BB, far + 20 * BB, BB);
  sx_batch_result res = fill_run(&f);
  if (res.state != SX_BATCH_COMPLETED)
    fail_msg("batch: %s (%s)", sx_batch_state_name(res.state), res.message);
  assert_int_equal(res.transport, want);
  assert_true(res.bytes == f.bytes);
  reader_check(r);
  return res.n_ranges;
}

/* A target at tloc and one reader at rloc (over transports, 0: the
 * default; the segment must go over want) reading every shape once: the
 * batch's ranges. */
static uint32_t one_read(const char *tloc, const char *rloc, unsigned transports,
                         sx_transport_kind want) {
  target t;
  target_start(&t, "stride-1", tloc);
  reader r;
  reader_open_via(&r, "stride-1", "stride-r1", rloc, transports, want);
  uint32_t ranges = read_shapes(&r, want);
  reader_close(&r);
  assert_int_equal(target_end(&t), 0);
  return ranges;
}

/* ------------------------------------------------------------ tests */

/* Each method forced, and auto, into GPU memory: byte for byte, by the
 * method asked for; and into host memory (where the kernel never runs). */
static void test_gpu_stride_every_method(void **state) {
  (void)state;
  const char *why = sx__mem_kernel_error(0);
  if (why != NULL)
    fail_msg("%s", why);
  target t;
  target_start(&t, "stride-t", "cuda:0");
  static const char *const methods[] = {"kernel", "batch", "range", "auto"};
  for (int k = 0; k < 4; k++) {
    setenv("SX_GPU_COPY", methods[k], 1);
    uint64_t before[4], after[4];
    sx__mem_copy_counts(before);
    reader r;
    reader_open(&r, "stride-t", "stride-r", "cuda:0");
    uint32_t ranges = read_shapes(&r, SX_TRANSPORT_CUDA_IPC);
    sx__mem_copy_counts(after);
    reader_close(&r);
    print_message("SX_GPU_COPY=%s: %u ranges; kernel %lu, batch %lu, range %lu gathers\n",
                  methods[k], ranges, (unsigned long)(after[1] - before[1]),
                  (unsigned long)(after[2] - before[2]), (unsigned long)(after[3] - before[3]));
    /* Per (layer, slot, member) a run of 4 blocks and 2 lone blocks: 3
     * strided xfers; the odd shapes 4 more, the plain ranges 2. */
    assert_int_equal(ranges, LAYERS * 2 * 2 * 3 + 4 + 2);
    int m = k == 3 ? SX__COPY_KERNEL : k + 1;
    assert_true(after[m] - before[m] >= 2); /* plain and strided gathers */
    /* Forced batch spreads ranges over streams, and a stream given one
     * plain range copies it singly. */
    for (int o = 1; o < 4; o++)
      if (o != m && !(m == SX__COPY_BATCH && o == SX__COPY_RANGE))
        assert_int_equal(after[o], before[o]);
    /* Into pageable host memory: the copy engines only. */
    uint64_t k0 = gpu_copy_count(SX__COPY_KERNEL);
    reader_open(&r, "stride-t", "stride-h", "cpu");
    read_shapes(&r, SX_TRANSPORT_CUDA_IPC);
    reader_close(&r);
    assert_int_equal(gpu_copy_count(SX__COPY_KERNEL), k0);
  }
  unsetenv("SX_GPU_COPY");
  assert_int_equal(target_end(&t), 0);
}

/* From another GPU's memory (over NVLink or PCIe on a real pair). */
static void test_gpu_stride_two_gpus(void **state) {
  (void)state;
  if (gpu_devices() < 2)
    skip();
  one_read("cuda:1", "cuda:0", 0, SX_TRANSPORT_CUDA_IPC);
}

/* A transport that does not take strided xfers (TCP, here from GPU memory
 * through the target's staging) gets the pieces as the plain ranges it
 * always did (the planner's merging only: the NHD pieces are 1 KiB
 * apart locally, so one range each), and reads them byte for byte. */
static void test_gpu_stride_tcp_gets_ranges(void **state) {
  (void)state;
  /* NHD: 2 layers x 2 slots x 2 members x 6 blocks x 16 pieces; the odd
   * shapes' 50 + 300 + 2 + 200 pieces; 2 plain ranges. */
  assert_int_equal(one_read("cuda:0", "cpu", SX_TRANSPORTS_TCP, SX_TRANSPORT_TCP),
                   LAYERS * 2 * 2 * 6 * 16 + 552 + 2);
}

/* Bad strides and pieces outside either region are refused with a
 * message naming the fault; the batch runs what was accepted. */
static void test_gpu_stride_refused(void **state) {
  (void)state;
  target t;
  target_start(&t, "stride-b", "cuda:0");
  reader r;
  reader_open(&r, "stride-b", "stride-rb", "cuda:0");
  filling f;
  fill_start(&f, &r, 10000);
  uint64_t len = r.len;
  sxt_rc(strided(&f, 0, 0, 1024, 0, 512, 1024, 4), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "overlap"));
  sxt_rc(strided(&f, 0, 0, 100, 0, 2048, 1024, 4), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "remote stride"));
  sxt_rc(strided(&f, 0, len - 3000, 1024, 0, 2048, 1024, 3), SX_EBOUNDS);
  assert_non_null(strstr(sx_errmsg(), "outside remote region"));
  sxt_rc(strided(&f, 1, 0, 1024, len - 5000, 2048, 1024, 3), SX_EBOUNDS);
  assert_non_null(strstr(sx_errmsg(), "outside local region"));
  sxt_rc(strided(&f, 1, 0, UINT64_MAX / 2, 0, 2048, 1024, 3), SX_EOVERFLOW);
  sxt_rc(strided(&f, 1, 0, 1024, 0, 2048, 1024, 0), SX_EINVAL);
  sxt_ok(strided(&f, 1, 5 * BB, 1024, 7 * BB, 4096, 1024, 8));
  sx_batch_result res = fill_run(&f);
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(res.n_entries, 1);
  assert_true(res.bytes == 8 * 1024);
  reader_check(&r);
  reader_close(&r);
  assert_int_equal(target_end(&t), 0);
}

/* A batch of strided xfers that outlives its deadline (copies slowed on
 * the stand-in) ends TIMEOUT once its copies ended, every xfer settled,
 * and closing the segment closes the mappings. */
static void test_gpu_stride_deadline(void **state) {
  (void)state;
  if (!gpu_on_stand_in())
    skip();
  target t;
  target_start(&t, "stride-d", "cuda:0");
  setenv("FAKE_CUDA_DELAY_US", "300000", 1); /* the reader's streams, made next */
  reader r;
  reader_open(&r, "stride-d", "stride-rd", "cuda:0");
  filling f;
  fill_start(&f, &r, 50);
  for (uint64_t b = 0; b < 8; b++)
    sxt_ok(strided(&f, 0, b * BB, 1024, b * BB, 2048, 1024, 16));
  sx_batch_result res = fill_run(&f);
  unsetenv("FAKE_CUDA_DELAY_US");
  assert_int_equal(res.state, SX_BATCH_TIMEOUT);
  assert_int_equal(res.n_failed, 8);
  reader_close(&r);
  assert_int_equal(target_end(&t), 0);
}

/* ------------------------------------------------------------ based gathers */

#define BREGION (4u << 20) /* bytes of each source region */
#define BPIECES 300

typedef struct based_note {
  sx__mem_notice n;
  int fired, status;
} based_note;

static void based_noted(sx__mem_notice *n) {
  based_note *b = (based_note *)n;
  b->status = n->status;
  b->fired = 1;
}

/* Pieces over 3 regions into one destination, byte for byte: lengths
 * 1..64 KiB, 16-byte aligned (the kernel's vector path), 4-byte aligned
 * (words) and odd (bytes), once on a plain stream and once through a
 * launcher; the table is put back into the pinned pool, which hands the
 * same buffer out again. */
static void test_gpu_stride_based_gather(void **state) {
  (void)state;
  const char *why = sx__mem_kernel_error(0);
  if (why != NULL)
    fail_msg("%s", why);
  uint8_t *src[3], *host[3];
  for (int r = 0; r < 3; r++) {
    sxt_ok(sx__mem_alloc(0, BREGION, (void **)&src[r]));
    assert_non_null(host[r] = malloc(BREGION));
    sx__pattern_fill(host[r], BREGION, SEED, (uint32_t)r + 1, 0);
    sxt_ok(sx__mem_copy(src[r], host[r], BREGION));
  }
  /* Region k is bases[k]: the allocations in another order. */
  const uint64_t bases[3] = {(uint64_t)(uintptr_t)src[2], (uint64_t)(uintptr_t)src[0],
                             (uint64_t)(uintptr_t)src[1]};
  const int alloc_of[3] = {2, 0, 1};
  size_t tbytes = BPIECES * sizeof(sx__mem_bpiece), cap = 0;
  sx__mem_bpiece *table = NULL;
  sxt_ok(sx__mem_pinned_get(0, tbytes, (void **)&table, &cap));
  assert_true(cap >= tbytes && cap >= (16u << 10) && (cap & (cap - 1)) == 0);
  /* The pieces lie one after another in dst, 16 bytes apart and moved by
   * what their alignment class asks. */
  uint64_t rng = 0x243f6a8885a308d3ull, at = 0;
  for (uint32_t i = 0; i < BPIECES; i++) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    uint32_t cls = i % 3, r = (uint32_t)(rng >> 60) % 3;
    uint32_t len = 1 + (uint32_t)(rng >> 20) % SX__GATHER_PIECE;
    if (i == 0)
      len = SX__GATHER_PIECE;
    if (i == 5)
      len = 1; /* odd class: one byte */
    uint64_t so = (rng >> 33) % (BREGION - SX__GATHER_PIECE);
    uint64_t doff = (at + 15) & ~15ull;
    if (cls == 0) {
      len = len < 16 ? 16 : len & ~15u;
      so &= ~15ull;
    } else if (cls == 1) {
      len = len < 4 ? 4 : len & ~3u;
      so = (so & ~3ull) | 4; /* 4-aligned, not 16 */
      doff += 4;
    } else {
      so |= 1;
      doff += 3;
    }
    table[i] = (sx__mem_bpiece){.dst = doff, .src = so, .len = len, .region = r,
                                .entry_first = i, .entry_last = i + 7};
    at = doff + len + 16;
  }
  uint64_t dlen = at;
  uint8_t *dst, *want = malloc(dlen), *got = malloc(dlen);
  assert_non_null(want);
  assert_non_null(got);
  sxt_ok(sx__mem_alloc(0, dlen, (void **)&dst));
  memset(want, 0xee, dlen);
  for (uint32_t i = 0; i < BPIECES; i++) {
    memcpy(want + table[i].dst, host[alloc_of[table[i].region]] + table[i].src, table[i].len);
    table[i].dst += (uint64_t)(uintptr_t)dst; /* absolute */
  }
  sx__mem_launcher *l = NULL;
  sxt_ok(sx__mem_launcher_create(&l));
  for (int pass = 0; pass < 2; pass++) {
    memset(got, 0xee, dlen);
    sxt_ok(sx__mem_copy(dst, got, dlen));
    sx__mem_stream *s;
    if (pass == 0) {
      sxt_ok(sx__mem_stream_create(0, &s));
    } else {
      sxt_ok(sx__mem_stream_create_on(0, l, &s));
      sx__mem_stream_defer(s, 1);
    }
    uint64_t k0 = gpu_copy_count(SX__COPY_KERNEL);
    sxt_ok(sx__mem_gather_based(s, table, BPIECES, bases, 3));
    sxt_ok(sx__mem_stream_sync(s));
    assert_true(gpu_copy_count(SX__COPY_KERNEL) == k0 + 1);
    sxt_ok(sx__mem_copy(got, dst, dlen));
    for (uint64_t i = 0; i < dlen; i++)
      if (got[i] != want[i])
        fail_msg("%s: byte %lu: 0x%02x, want 0x%02x", pass ? "launcher" : "stream",
                 (unsigned long)i, got[i], want[i]);
    sx__mem_stream_destroy(s);
  }
  /* A launch the driver refuses on the launcher's thread reaches the next
   * notice as its status (the stand-in refuses every launch when asked). */
  if (gpu_on_stand_in()) {
    uv_loop_t loop;
    assert_int_equal(uv_loop_init(&loop), 0);
    sx__mem_notifier *nf;
    sxt_ok(sx__mem_notifier_create(&loop, &nf));
    sx__mem_stream *s;
    sxt_ok(sx__mem_stream_create_on(0, l, &s));
    sx__mem_stream_defer(s, 1);
    setenv("FAKE_CUDA_FAIL_LAUNCH", "1", 1);
    sxt_ok(sx__mem_gather_based(s, table, BPIECES, bases, 3));
    based_note note = {.n.fn = based_noted};
    sxt_ok(sx__mem_notify(s, nf, &note.n));
    while (!note.fired)
      uv_run(&loop, UV_RUN_ONCE);
    unsetenv("FAKE_CUDA_FAIL_LAUNCH");
    assert_int_equal(note.status, SX_EIO);
    sx__mem_stream_destroy(s);
    sx__mem_notifier_close(nf);
    uv_run(&loop, UV_RUN_DEFAULT); /* its handles' close callbacks */
    assert_int_equal(uv_loop_close(&loop), 0);
  }
  sx__mem_launcher_destroy(l);
  /* More than 16 bases is refused before anything is queued. */
  sx__mem_stream *s;
  sxt_ok(sx__mem_stream_create(0, &s));
  uint64_t many[SX__GATHER_BASES + 1] = {0};
  sxt_rc(sx__mem_gather_based(s, table, BPIECES, many, SX__GATHER_BASES + 1), SX_EINVAL);
  /* The stand-in refuses a piece whose region has no base (a GPU would
   * fault). */
  if (gpu_on_stand_in()) {
    table[7].region = 3;
    sxt_rc(sx__mem_gather_based(s, table, BPIECES, bases, 3), SX_EIO);
    table[7].region = 0;
  }
  sxt_ok(sx__mem_stream_sync(s));
  sx__mem_stream_destroy(s);
  /* The pool hands the buffer put back out again. */
  sx__mem_pinned_put(table, cap);
  void *again = NULL;
  size_t cap2 = 0;
  sxt_ok(sx__mem_pinned_get(0, tbytes, &again, &cap2));
  assert_ptr_equal(again, table);
  assert_true(cap2 == cap);
  sx__mem_pinned_put(again, cap2);
  sx__mem_free(dst);
  for (int r = 0; r < 3; r++) {
    sx__mem_free(src[r]);
    free(host[r]);
  }
  free(want);
  free(got);
}

static int setup(void **state) {
  (void)state;
  return gpu_store_setup(&redis, url, sizeof(url), "test_gpu_stride", "stride");
}

static int test_teardown(void **state) {
  (void)state;
  unsetenv("SX_GPU_COPY");
  unsetenv("FAKE_CUDA_DELAY_US");
  unsetenv("FAKE_CUDA_FAIL_LAUNCH");
  if (held.a != NULL)
    sx_agent_destroy(held.a); /* ends its batches, closes its mappings */
  if (held.pool.mem[0] != NULL)
    gpu_pool_free(&held.pool);
  if (held.t.pid != 0) {
    kill(held.t.pid, SIGKILL);
    fclose(held.t.in);
    fclose(held.t.out);
    waitpid(held.t.pid, NULL, 0);
  }
  memset(&held, 0, sizeof(held));
  return 0;
}

static int teardown(void **state) {
  (void)state;
  sxt_redis_stop(&redis);
  return 0;
}

int main(int argc, char **argv) {
  if (argc == 5 && strcmp(argv[1], "target") == 0)
    return target_main(argv);
  if (realpath(argv[0], self) == NULL)
    snprintf(self, sizeof(self), "/proc/self/exe");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_gpu_stride_every_method, test_teardown),
      cmocka_unit_test_teardown(test_gpu_stride_two_gpus, test_teardown),
      cmocka_unit_test_teardown(test_gpu_stride_tcp_gets_ranges, test_teardown),
      cmocka_unit_test_teardown(test_gpu_stride_refused, test_teardown),
      cmocka_unit_test_teardown(test_gpu_stride_deadline, test_teardown),
      cmocka_unit_test_teardown(test_gpu_stride_based_gather, test_teardown),
  };
  const char *filter = getenv("SXT_FILTER");
  if (filter != NULL)
    cmocka_set_test_filter(filter);
  return cmocka_run_group_tests(tests, setup, teardown);
}
