/*
 * sx-bench read: batched block reads between two processes, against a raw
 * TCP stream between the same two processes (or perftest's ib_read_bw on
 * the same RDMA device) measured in the same run.
 *
 * This process is the reader: it spawns `sx-bench target` (read_base.c),
 * which publishes one group per block size, and for each number of
 * connections creates a reader agent with local regions of the same keys,
 * opens the segment by name and checks its layout.  A case (block size,
 * batch size, contiguous or scattered ids) keeps --depth batches in flight,
 * each of `batch` one-block entries into local blocks of its own, and
 * counts the batches that end in the window (between two batch ends, after
 * a warm-up that lasts until every batch in flight was submitted after a
 * batch ended), with both processes' CPU time over the same window, and
 * their threads' time waiting for a CPU (schedstat).  Local buffers are
 * populated before the first case (first-touch faults are not a read's
 * cost in steady state: an engine's KV cache is touched).  The raw
 * stream of each block size is measured in two halves around its cases, so
 * drift of the shared machine falls on both alike.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "bench.h"
#include "pattern.h"
#include "rawproto.h"
#include "read.h"
#include "segxfer/agent.h"
#include "transport/conn/engage.h"
#include "transport/conn/xpool.h"


/* The reader side of one run. */
typedef struct rd {
  const ropts *o;
  uint64_t seed;
  bx_tproc t;
  uint8_t *local[BX_MAX_SIZES];
  uint64_t local_blocks[BX_MAX_SIZES];
  sx_agent *a;
  sx_segment *seg;
  uint32_t region[BX_MAX_SIZES];  /* remote region id of each group */
  uint64_t rblocks[BX_MAX_SIZES]; /* remote blocks of each group */
  uint64_t rng;
} rd;

void bx_bench_layout(sx_layout *l) {
  memset(l, 0, sizeof(*l));
  snprintf(l->fingerprint, sizeof(l->fingerprint), "sx-bench/v1");
  snprintf(l->tag, sizeof(l->tag), "NHD");
  snprintf(l->dtype, sizeof(l->dtype), "bf16");
}

static uint64_t max_batch(const ropts *o, uint64_t size) {
  uint64_t m = 0;
  for (int i = 0; i < o->n_batches; i++)
    if (o->batches[i] * size <= o->max_batch_bytes && o->batches[i] > m)
      m = o->batches[i];
  return m;
}

/* The raw stream's receive buffer per connection: as many chunks as the
 * batches in flight hold at the target batch size, within 4..16 MiB, so it
 * lands in memory much like segxfer's destinations without being a
 * cache-cold monster (the strongest honest baseline); or --stream-bytes.
 * (Into cold memory the kernel's receive copy is slower: on loopback, one
 * connection into a 256 MiB ring made 0.5-0.75x of a 16 MiB one;
 * docs/benchmarks.md.) */
static uint64_t stream_dst(const ropts *o, uint64_t size) {
  if (o->stream_bytes)
    return o->stream_bytes < size ? size : o->stream_bytes / size * size;
  uint64_t b = size * o->depth * (o->target_batch ? o->target_batch : 64);
  if (b < (4u << 20))
    b = 4u << 20;
  if (b > (16u << 20))
    b = 16u << 20;
  return b < size ? size : b / size * size;
}

static void quiet_log(void *arg, sx_log_level level, const char *msg) {
  (void)arg;
  if (level <= SX_LOG_WARN)
    fprintf(stderr, "sx-bench read: agent: %s\n", msg);
}

/* A reader agent with conns per peer, local regions, the segment open and
 * checked. */
static int reader_start(rd *R, uint32_t conns, const char *url, const char *name, char *err,
                        size_t esize) {
  sx_agent_params p;
  char wname[64];
  sx_agent_params_init(&p);
  p.metadata_url = url;
  if (R->o->write) { /* a producer: consumers authorize it by its segment */
    snprintf(wname, sizeof(wname), "bench/writer-%d", (int)getpid());
    p.name = wname;
  }
  p.transports = R->o->rdma ? SX_TRANSPORTS_RDMA : SX_TRANSPORTS_TCP;
  p.conns_per_peer = conns;
  p.log = quiet_log;
  /* Errors only: closing a segment at the end of a case is not news. */
  p.log_level = SX_LOG_ERROR;
  bx_bench_layout(&p.layout);
  int rc = sx_agent_create(&p, &R->a);
  for (int g = 0; g < R->o->n_sizes && rc == 0; g++) {
    sx_region_params r = {.addr = R->local[g],
                          .length = R->local_blocks[g] * R->o->sizes[g],
                          .group = (uint32_t)g, .layer_count = 1, .slot = SX_SLOT_K,
                          .block_bytes = R->o->sizes[g], .num_blocks = R->local_blocks[g]};
    uint32_t id;
    rc = sx_agent_register(R->a, &r, &id);
  }
  if (rc == 0 && R->o->write)
    rc = sx_agent_publish(R->a, 0);
  if (rc == 0)
    rc = sx_segment_open(R->a, name, 10000, &R->seg);
  sx_mismatch mm;
  if (rc == 0 && (rc = sx_segment_check(R->seg, 0, &mm)) == SX_EINCOMPAT) {
    snprintf(err, esize, "layout check: %s", mm.message);
    return -1;
  }
  if (rc == 0 && sx_segment_transport(R->seg) !=
                     (R->o->rdma ? SX_TRANSPORT_RDMA : SX_TRANSPORT_TCP)) {
    snprintf(err, esize, "the segment is not reachable over %s", R->o->rdma ? "rdma" : "tcp");
    return -1;
  }
  if (rc != 0) {
    snprintf(err, esize, "reader: %s: %s", sx_err_name(rc), sx_errmsg());
    return -1;
  }
  const sx_desc *d = sx_segment_desc(R->seg);
  for (int g = 0; g < R->o->n_sizes; g++) {
    const sx_region *reg = sx_desc_find(d, (uint32_t)g, 0, SX_SLOT_K);
    if (reg == NULL || reg->block_bytes != R->o->sizes[g]) {
      snprintf(err, esize, "the target has no group %d of %llu-byte blocks", g,
               (unsigned long long)R->o->sizes[g]);
      return -1;
    }
    R->region[g] = reg->id;
    R->rblocks[g] = reg->num_blocks;
  }
  return 0;
}

static void reader_stop(rd *R) {
  sx_segment_close(R->seg);
  sx_agent_destroy(R->a);
  R->seg = NULL;
  R->a = NULL;
}

/* ------------------------------------------------------------ one case */

typedef struct rcase {
  int g;
  uint64_t size, batch;
  int scattered;
  char note[200]; /* why it was skipped or failed; "" when it ran */
  /* This reader's receive hand-overs to data-mover threads, and large
   * replies its loop kept (the threads not engaged), in the case's
   * windows and warm-ups (transport/conn/engage.h). */
  uint64_t rx_lent, rx_kept;
} rcase;

typedef struct slotb {
  sx_batch *b;
  uint64_t *ids;
} slotb;

static int submit(rd *R, const rcase *c, slotb *s, uint32_t k, sx_block_read *ent,
                  uint64_t *next) {
  uint64_t n = R->rblocks[c->g];
  for (uint64_t i = 0; i < c->batch; i++) {
    uint64_t id;
    if (c->scattered) {
      R->rng ^= R->rng << 13;
      R->rng ^= R->rng >> 7;
      R->rng ^= R->rng << 17;
      id = R->rng % n;
    } else {
      if (*next + c->batch > n)
        *next = 0;
      id = (*next)++;
    }
    s->ids[i] = id;
    ent[i] = (sx_block_read){.group = (uint32_t)c->g, .layer_first = 0, .layer_count = 1,
                             .slots = 1u << SX_SLOT_K, .remote_block = id,
                             .local_block = (uint64_t)k * c->batch + i, .count = 1};
  }
  if (R->o->write)
    return bx_write_batch(R->seg, ent, (size_t)c->batch, &s->b);
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = 30000;
  int rc = sx_batch_create(R->seg, &bp, &s->b);
  if (rc == 0 && (rc = sx_batch_add_blocks(s->b, ent, (size_t)c->batch)) == 0)
    rc = sx_batch_submit(s->b);
  return rc;
}

static int check_bytes(rd *R, const rcase *c, const slotb *s, uint32_t k) {
  for (uint64_t i = 0; i < c->batch; i++) {
    const uint8_t *p = R->local[c->g] + ((uint64_t)k * c->batch + i) * c->size;
    uint64_t bad;
    if (sx__pattern_check(p, c->size, R->seed, R->region[c->g], s->ids[i] * c->size, &bad)) {
      fprintf(stderr, "sx-bench read: --verify: block %llu of group %d: byte %llu differs "
              "from the pattern\n", (unsigned long long)s->ids[i], c->g,
              (unsigned long long)bad);
      return -1;
    }
  }
  return 0;
}

/* Run-queue wait of the reader's and the target's threads so far, or -1:
 * a batch's tail on a busy machine is mostly this (schedstat, issue 16). */
static double runq_both(rd *R) {
  double a = bx_runq_wait(getpid()), b = bx_runq_wait(R->t.pid);
  return a >= 0 && b >= 0 ? a + b : -1;
}

/* One window of a case: its figures into *out, its batch latencies added to
 * *lat (the caller's, which may gather several rounds). */
static int run_case(rd *R, const rcase *c, double secs, bx_caseres *out, bx_lat *lat,
                    char *err, size_t esize) {
  uint32_t depth = R->o->depth;
  slotb *sl = calloc(depth, sizeof(*sl));
  sx_block_read *ent = calloc((size_t)c->batch, sizeof(*ent));
  int rc = 0, measuring = 0, done = 0;
  uint64_t next = 0;
  memset(out, 0, sizeof(*out));
  if (sl == NULL || ent == NULL)
    goto oom;
  for (uint32_t k = 0; k < depth; k++)
    if ((sl[k].ids = calloc((size_t)c->batch, sizeof(uint64_t))) == NULL)
      goto oom;
  double warm = secs * 0.2 < 0.15 ? secs * 0.2 : 0.15;
  double t_begin = bx_now(), t0 = 0, t_last = 0, c0 = 0, tc0 = 0, rq0 = -1;
  for (uint32_t k = 0; k < depth && rc == 0; k++)
    rc = submit(R, c, &sl[k], k, ent, &next);
  for (uint64_t n = 0; rc == 0 && !done; n++) {
    uint32_t k = (uint32_t)(n % depth);
    sx_batch_result res;
    sx_batch_wait(sl[k].b, -1);
    sx_batch_result_get(sl[k].b, &res);
    double t = bx_now();
    if (res.state != SX_BATCH_COMPLETED) {
      snprintf(err, esize, "batch %s: %s: %s", sx_batch_state_name(res.state),
               sx_err_name(res.error), res.message);
      rc = -1;
      break;
    }
    if (R->o->verify && check_bytes(R, c, &sl[k], k) != 0) {
      snprintf(err, esize, "--verify found a byte that differs");
      rc = -1;
      break;
    }
    if (!measuring && t - t_begin >= warm && n + 1 >= 2 * (uint64_t)depth) {
      /* The window opens at a batch end, once every batch in flight was
       * submitted after a batch ended (the first ones wait for connections
       * and for each other); this batch is not counted. */
      measuring = 1;
      t0 = t;
      c0 = bx_cpu_self();
      tc0 = bx_target_cpu(&R->t);
      rq0 = runq_both(R);
    } else if (measuring) {
      out->bytes += res.bytes;
      out->blocks += c->batch;
      out->batches++;
      bx_lat_add(lat, res.transfer_ns);
      t_last = t;
      done = t - t0 >= secs;
    }
    sx_batch_destroy(sl[k].b);
    sl[k].b = NULL;
    if (!done)
      rc = submit(R, c, &sl[k], k, ent, &next);
    else if (rc == 0) {
      out->cpu_reader = bx_cpu_self() - c0;
      double tc1 = bx_target_cpu(&R->t), rq1 = runq_both(R);
      out->cpu_target = tc0 >= 0 && tc1 >= tc0 ? tc1 - tc0 : -1;
      out->runq = rq0 >= 0 && rq1 >= rq0 ? rq1 - rq0 : -1;
    }
  }
  if (rc != 0 && err[0] == '\0')
    snprintf(err, esize, "batch: %s: %s", sx_err_name(rc), sx_errmsg());
  out->secs = t_last - t0;
  goto out;
oom:
  snprintf(err, esize, "out of memory");
  rc = -1;
out:
  for (uint32_t k = 0; sl != NULL && k < depth; k++) {
    sx_batch_destroy(sl[k].b); /* waits for a running one */
    free(sl[k].ids);
  }
  free(sl);
  free(ent);
  return rc;
}

/* One baseline window of secs, added to *acc; ib is the perftest program
 * for an RDMA baseline (ib_read_bw, or ib_write_bw for its row only). */
static int base_round(rd *R, int g, uint32_t conns, const char *dev, const char *ib,
                      double secs, bx_caseres *acc, char *err, size_t esize) {
  const ropts *o = R->o;
  uint64_t size = o->sizes[g];
  if (o->baseline == BASE_STREAM) {
    bx_stream_req sq = {.size = size, .group = (uint32_t)g, .region = R->region[g],
                        .group_bytes = o->group_bytes, .conns = conns,
                        .dst_bytes = stream_dst(o, size), .secs = secs,
                        .verify = o->verify, .seed = R->seed, .reverse = o->write};
    bx_caseres r;
    if (bx_raw_stream(&R->t, &sq, &r, err, esize))
      return -1;
    bx_accumulate(acc, &r);
  } else if (o->baseline == BASE_IB) {
    if (dev == NULL) {
      snprintf(err, esize, "%s: no RDMA device (--rdma-device)", ib);
      return -1;
    }
    bx_caseres r;
    if (bx_ib_bw(ib, dev, o->rdma_ip, size, conns, secs, &r, err, esize))
      return -1;
    bx_accumulate(acc, &r);
  }
  return 0;
}

/* ------------------------------------------------------------ main */

int bx_read_main(const bx_common *co, int argc, char **argv) {
  /* GPU memory has its own cases and baselines (read_gpu.c). */
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--location") == 0 ||
        (strcmp(argv[i], "--transport") == 0 && i + 1 < argc &&
         strcmp(argv[i + 1], "cuda_ipc") == 0))
      return bx_read_gpu_main(co, argc, argv);
  ropts o = {.n_sizes = 6, .sizes = {4096, 16384, 65536, 262144, 1 << 20, 4 << 20},
             .n_batches = 5, .batches = {1, 16, 64, 256, 1024}, .contig = 1, .scattered = 1,
             .n_conns = 1, .conns = {4}, .depth = 2, .group_bytes = 64ull << 20,
             .max_batch_bytes = 64ull << 20, .target_batch = 64, .baseline = -1, .rounds = 1,
             .rdma_ip = "127.0.0.1"};
  int rc = bx_read_parse(&o, argc, argv);
  if (rc)
    return rc;
  rd R;
  memset(&R, 0, sizeof(R));
  R.o = &o;
  R.seed = 0x5eed0000u + (uint64_t)getpid();
  R.rng = 0x9E3779B97F4A7C15ull ^ R.seed;
  bx_redis srv = {0};
  char url[600], name[64], err[600] = "";
  const char *tr = o.rdma ? (o.write ? "rdma write" : "rdma") : (o.write ? "tcp write" : "tcp");
  const char *ib = o.write ? "ib_write_bw" : "ib_read_bw", *ops = o.write ? "writes" : "reads";
  snprintf(name, sizeof(name), "bench/read-%d", (int)getpid());
  if (o.url == NULL) {
    if (bx_redis_start(&srv) != 0)
      return BX_FAIL;
    snprintf(url, sizeof(url), "redis://127.0.0.1:%d?namespace=sx-bench", srv.port);
  } else {
    snprintf(url, sizeof(url), "%s", o.url);
  }
  bx_report *rep = bx_report_new("read", co);
  char title[200];
  snprintf(title, sizeof(title), o.rdma ? "Batched RDMA %s between two processes against %s "
           "on the same device (baseline), same run" : "Batched TCP %s between two processes "
           "against a raw TCP stream between the same two processes (baseline), same run%s",
           ops, o.rdma ? ib : o.write ? " (the stream runs from writer to target)" : "");
  bx_table *t = bx_table_add(rep, "read", title, bx_read_cols, bx_read_ncols);
  bx_plot plot = {.logx = 1, .xbytes = 1};
  snprintf(plot.title, sizeof(plot.title), "segxfer batched %s %s against %s", o.rdma ? "rdma"
           : "tcp", ops, o.rdma ? (o.write ? "ib_write_bw, same device" : "ib_read_bw, same "
           "device") : "a raw TCP stream, same two processes");
  snprintf(plot.xlabel, sizeof(plot.xlabel), "block size");
  snprintf(plot.ylabel, sizeof(plot.ylabel), "GB/s");
  /* Local destinations: depth batches of the largest batch of each size;
   * one block where no batch of the size runs, so the reader still has
   * every key the target publishes and the layout check passes. */
  char size_err[BX_MAX_SIZES][160], gone[96] = "";
  int cases = 0, failed = 0;
  memset(size_err, 0, sizeof(size_err));
  for (int g = 0; g < o.n_sizes; g++) {
    uint64_t mb = max_batch(&o, o.sizes[g]);
    R.local_blocks[g] = mb ? mb * o.depth : 1;
    /* Populated now, as an engine's KV cache is: first-touch page faults
     * (65,536 for 2 x 128 MiB) inside the window were a 1M x 128 case's
     * p99, at 3-5x its p50. */
    R.local[g] = mmap(NULL, R.local_blocks[g] * o.sizes[g], PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_POPULATE, -1, 0);
    if (R.local[g] == MAP_FAILED) {
      snprintf(size_err[g], sizeof(size_err[g]), "cannot map %llu MiB of local buffers",
               (unsigned long long)(R.local_blocks[g] * o.sizes[g] >> 20));
      R.local_blocks[g] = 1;
      R.local[g] = mmap(NULL, o.sizes[g], PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (R.local[g] == MAP_FAILED) {
        R.local[g] = NULL;
        snprintf(err, sizeof(err), "cannot map local buffers");
        goto fail;
      }
    }
    if (o.write) /* the sources: real bytes, not the shared zero page */
      sx__pattern_fill(R.local[g], R.local_blocks[g] * o.sizes[g], R.seed, 1000u + (uint32_t)g,
                       0);
    for (int b = 0; b < o.n_batches; b++)
      cases += o.batches[b] * o.sizes[g] <= o.max_batch_bytes ? o.contig + o.scattered : 0;
  }
  int steps = cases * o.n_conns + (o.rounds == 1 ? o.n_sizes * o.n_conns : 0) + 1;
  bx_progress_start(co, "read", steps,
                    (double)steps * (co->duration * (o.rounds > 1 ? 2 : 1) + 0.3) + 3);
  bx_progress("starting the target (filling %d x %llu MiB)", o.n_sizes,
              (unsigned long long)(o.group_bytes >> 20));
  if (bx_target_spawn(&R.t, url, name, o.sizes, o.n_sizes, o.group_bytes, R.seed,
                      o.rdma ? "auto" : "tcp", o.write) != 0)
    goto fail;
  bx_table_note(t, "%u batches in flight; each batch: one-block entries (group, layer 0, "
                "slot K) %s local blocks of its own; window between batch ends after "
                "a warm-up", o.depth, o.write ? "written from" : "into");
  if (o.write)
    bx_table_note(t, "write batches: this process is a named producer the target granted; "
                  "a batch ends when the target accepted its notice");
  char sbuf[32], bbuf[32];
  if (o.baseline == BASE_STREAM && o.n_sizes > 0)
    bx_table_note(t, "raw stream's receive buffer per connection: %s at %s blocks%s",
                  bx_size_name(stream_dst(&o, o.sizes[o.n_sizes - 1]), sbuf, sizeof(sbuf)),
                  bx_size_name(o.sizes[o.n_sizes - 1], bbuf, sizeof(bbuf)),
                  o.stream_bytes ? " (--stream-bytes)" : "");
  bx_table_note(t, "baseline: %s", o.baseline == BASE_STREAM
                ? "raw TCP stream of the same pool memory, chunk = block size, same "
                  "connection count (a thread per connection on each side)"
                : o.baseline == BASE_IB ? (o.write ? "ib_write_bw -s BLOCK -q CONNS -n N on "
                                                     "the same device"
                                                   : "ib_read_bw -s BLOCK -q CONNS -n N on "
                                                     "the same device")
                                        : "none");
  if (o.baseline != BASE_NONE)
    bx_table_note(t, o.rounds > 1 ? "each case: %llu windows, each right after a baseline "
                  "window of its own; VS BASELINE is against those windows, the baseline "
                  "row sums them" : "the baseline: %llu window in two halves, before and "
                  "after the cases of its block size", (unsigned long long)o.rounds);
  if (o.verify)
    bx_table_note(t, "--verify: every byte checked against the pattern, inside the timing");
  if (!o.rdma) {
    /* Both agents take the default, so this is what each of them runs
     * with (docs/data-plane.md#tcp). */
    int bad;
    const char *min = getenv("SX_TCP_THREAD_BYTES");
    bx_table_note(t, "TCP data-mover threads per agent: %u (SX_TCP_THREADS %s), for payloads "
                  "of %s bytes and more", sx__xpool_size(-1, &bad),
                  getenv("SX_TCP_THREADS") && !bad ? "set" : "unset: min(4, CPUs / 4)",
                  min && *min ? min : "262144");
  }
  /* What the targets are judged on, per connection count. */
  bx_judged judged[8];
  for (int k = 0; k < 8; k++)
    judged[k] = (bx_judged){.ratio = {-1, -1}, .cpu = {-1, -1}, .tail = -1};
  for (int ci = 0; ci < o.n_conns; ci++) {
    uint32_t conns = (uint32_t)o.conns[ci];
    /* Why no case of these connections can run ("" while they can). */
    char reader_err[600] = "";
    err[0] = '\0';
    if (R.t.pid == 0) /* the target is gone: what ended it is in gone */
      snprintf(reader_err, sizeof(reader_err), "%s", gone);
    else if (reader_start(&R, conns, url, name, err, sizeof(err)) != 0) {
      snprintf(reader_err, sizeof(reader_err), "%s", err);
      reader_stop(&R);
    }
    const char *dev = o.rdma_dev;
    const sx_desc *d = R.seg != NULL ? sx_segment_desc(R.seg) : NULL;
    for (uint32_t e = 0; d != NULL && dev == NULL && e < d->n_endpoints; e++)
      if (d->endpoints[e].kind == SX_TRANSPORT_RDMA)
        dev = d->endpoints[e].device;
    for (int g = 0; g < o.n_sizes; g++) {
      uint64_t size = o.sizes[g];
      char b[16];
      bx_size_name(size, b, sizeof(b));
      const char *bname = o.baseline == BASE_IB ? ib : "raw stream";
      /* The cases of this size; those that cannot run say why. */
      rcase rc_list[32];
      int nres = 0, runnable = 0;
      for (int bi = 0; bi < o.n_batches; bi++) {
        for (int sc = 0; sc < 2; sc++) {
          if (!((sc == 0 && o.contig) || (sc == 1 && o.scattered)) || nres == 32)
            continue;
          rcase *c = &rc_list[nres++];
          *c = (rcase){.g = g, .size = size, .batch = o.batches[bi], .scattered = sc};
          char mb[16];
          if (c->batch * size > o.max_batch_bytes)
            snprintf(c->note, sizeof(c->note), "skipped: %llu x %s is over --max-batch-bytes %s",
                     (unsigned long long)c->batch, b,
                     bx_size_name(o.max_batch_bytes, mb, sizeof(mb)));
          else if (!sc && c->batch > o.group_bytes / size)
            snprintf(c->note, sizeof(c->note), "skipped: the target's group holds %llu "
                     "blocks, fewer than the batch's contiguous ids",
                     (unsigned long long)(o.group_bytes / size));
          else if (size_err[g][0] || reader_err[0])
            snprintf(c->note, sizeof(c->note), "not run: %s",
                     size_err[g][0] ? size_err[g] : reader_err);
          runnable += c->note[0] == '\0';
        }
      }
      /* With one round, the baseline is measured in two halves around all
       * cases of the size; with more, each case alternates with a baseline
       * window of its own, round after round, and is judged against it.  A
       * baseline that fails leaves the cases without one, and says why. */
      bx_caseres res[32], cbase[32], base = {0};
      bx_lat lat[32];
      char base_err[240] = "";
      memset(res, 0, sizeof(res));
      memset(cbase, 0, sizeof(cbase));
      memset(lat, 0, sizeof(lat));
      int rounds = (int)o.rounds, have_base = o.baseline != BASE_NONE && runnable > 0;
      double slice = co->duration / rounds;
      if (rounds == 1 && have_base) {
        bx_progress("%s baseline, %s blocks, %u conns", bname, b, conns);
        err[0] = '\0';
        if (base_round(&R, g, conns, dev, ib, co->duration / 2, &base, err,
                       sizeof(err))) {
          snprintf(base_err, sizeof(base_err), "failed: %s", err);
          have_base = 0;
        }
      }
      for (int k = 0; k < nres; k++) {
        rcase *c = &rc_list[k];
        if (c->note[0] == '\0' && reader_err[0])
          snprintf(c->note, sizeof(c->note), "not run: %s", reader_err);
        if (c->note[0])
          continue;
        bx_progress("%s %s blocks, batch %llu, %s, %u conns%s", tr, b,
                    (unsigned long long)c->batch, c->scattered ? "scattered" : "contiguous",
                    conns, rounds > 1 ? ", alternating with the baseline" : "");
        for (int r = 0; r < rounds && c->note[0] == '\0'; r++) {
          bx_caseres one;
          err[0] = '\0';
          if (rounds > 1 && have_base &&
              base_round(&R, g, conns, dev, ib, slice, &cbase[k], err, sizeof(err))) {
            snprintf(base_err, sizeof(base_err), "failed: %s", err);
            have_base = 0;
          }
          err[0] = '\0';
          uint64_t lent0 = sx__xpool_runs(SX__XJOB_RECV), kept0 = sx__engage_kept(SX__XJOB_RECV);
          int crc = run_case(&R, c, slice, &one, &lat[k], err, sizeof(err));
          c->rx_lent += sx__xpool_runs(SX__XJOB_RECV) - lent0;
          c->rx_kept += sx__engage_kept(SX__XJOB_RECV) - kept0;
          if (crc != 0) {
            /* Say why, and go on with a fresh reader: the failure may have
             * left its connections in any state. */
            snprintf(c->note, sizeof(c->note), "failed: %s", err);
            reader_stop(&R);
            err[0] = '\0';
            if (bx_target_exited(&R.t, gone, sizeof(gone))) {
              snprintf(c->note, sizeof(c->note), "failed: %s", gone);
              snprintf(reader_err, sizeof(reader_err), "%s", gone);
            }
            else if (reader_start(&R, conns, url, name, err, sizeof(err)) != 0) {
              snprintf(reader_err, sizeof(reader_err), "%s", err);
              reader_stop(&R);
            }
            break;
          }
          bx_accumulate(&res[k], &one);
        }
        res[k].p50_ms = bx_lat_pct(&lat[k], 0.5) / 1e6;
        res[k].p99_ms = bx_lat_pct(&lat[k], 0.99) / 1e6;
        bx_lat_free(&lat[k]);
        if (rounds > 1)
          bx_accumulate(&base, &cbase[k]);
      }
      if (rounds == 1 && have_base) {
        err[0] = '\0';
        if (base_round(&R, g, conns, dev, ib, co->duration / 2, &base, err,
                       sizeof(err))) {
          snprintf(base_err, sizeof(base_err), "failed: %s", err);
          have_base = 0;
        }
        for (int k = 0; k < nres; k++)
          cbase[k] = have_base ? base : (bx_caseres){0};
      }
      double base_gb = have_base ? bx_gbps(&base) : 0;
      if (base_err[0] || have_base) {
        bx_row *row = bx_read_base_row(t, o.baseline == BASE_IB ? ib : "raw stream",
                                   size, conns, &base);
        if (base_err[0])
          bx_set_str(row, "note", "%s", base_err);
      }
      /* RDMA: the other perftest program too (ib_write_bw for reads,
       * ib_read_bw for writes), for its CPU per GB: a row, not a ratio's
       * baseline. */
      if (o.baseline == BASE_IB && runnable > 0) {
        const char *other = o.write ? "ib_read_bw" : "ib_write_bw";
        bx_caseres wb = {0};
        err[0] = '\0';
        int wrc = base_round(&R, g, conns, dev, other, co->duration / 2, &wb, err, sizeof(err));
        bx_row *row = bx_read_base_row(t, other, size, conns, &wb);
        bx_set_str(row, "note", wrc ? "failed: %s" : "for CPU per GB only%s", err);
      }
      char sname[96];
      snprintf(sname, sizeof(sname), "%s, %u %s (baseline)", o.baseline == BASE_IB
               ? ib : "raw TCP stream", conns, o.rdma ? "QPs" : "conns");
      if (have_base) {
        bx_series *se = bx_plot_series(&plot, sname, 1);
        if (se != NULL)
          se->dash = 2 + ci % 3;
        bx_series_add(se, (double)size, base_gb);
      }
      uint64_t tb = 0;
      for (int k = 0; k < nres; k++)
        if (rc_list[k].note[0] == '\0' && rc_list[k].batch <= o.target_batch &&
            rc_list[k].batch > tb)
          tb = rc_list[k].batch;
      for (int k = 0; k < nres; k++) {
        const rcase *c = &rc_list[k];
        const char *ids = c->scattered ? "scattered" : "contiguous";
        if (c->note[0]) {
          failed += strncmp(c->note, "skipped", 7) != 0;
          bx_row *row = bx_row_add(t);
          bx_set_str(row, "transport", "%s", tr);
          bx_set_str(row, "block", "%s", b);
          bx_set_num(row, "batch", (double)c->batch);
          bx_set_str(row, "ids", "%s", ids);
          bx_set_num(row, "conns", conns);
          bx_set_str(row, "note", "%s", c->note);
          continue;
        }
        double gb = bx_gbps(&res[k]), cb = bx_gbps(&cbase[k]);
        bx_row *row = bx_read_row(t, tr, size, c->batch, ids, conns, &res[k], &cbase[k],
                                  have_base ? &base : NULL);
        if (c->rx_lent + c->rx_kept > 0)
          bx_set_str(row, "note", "reader: %llu hand-overs to threads; %llu replies on its loop",
                     (unsigned long long)c->rx_lent, (unsigned long long)c->rx_kept);
        bx_judged *j = &judged[ci];
        if (c->batch >= 16 && c->batch <= 128 && size >= 65536 && size <= 1048576 &&
            res[k].p50_ms > 0 && res[k].p99_ms / res[k].p50_ms > j->tail) {
          j->tail = res[k].p99_ms / res[k].p50_ms;
          snprintf(j->tail_case, sizeof(j->tail_case), "%s x %llu %s", b,
                   (unsigned long long)c->batch, ids);
        }
        snprintf(sname, sizeof(sname), "segxfer batch %llu, %s, %u %s",
                 (unsigned long long)c->batch, ids, conns, o.rdma ? "QPs" : "conns");
        /* Colour by batch size (and connections), solid for scattered ids,
         * dotted for contiguous ones. */
        bx_series *se = bx_plot_series(&plot, sname, 0);
        if (se != NULL) {
          int bi = 0;
          while (bi < o.n_batches && o.batches[bi] != c->batch)
            bi++;
          se->color = 1 + (bi + ci * o.n_batches) % 10;
          se->dash = c->scattered ? 1 : 3;
        }
        bx_series_add(se, (double)size, gb);
        if (c->batch == tb && c->scattered == o.scattered && cb > 0 &&
            (size == 65536 || size == 1048576)) {
          int m = size == 65536 ? 0 : 1;
          j->ratio[m] = gb / cb;
          if (have_base && bx_cpu_gb(&base) > 0 && bx_cpu_gb(&res[k]) >= 0)
            j->cpu[m] = bx_cpu_gb(&res[k]) / bx_cpu_gb(&base);
        }
      }
    }
    reader_stop(&R);
  }
  bx_read_targets(rep, judged, o.conns, o.n_conns, o.rdma, o.write, o.target_batch,
                  o.scattered, o.baseline == BASE_NONE);
  rc = BX_OK;
  goto out;
fail:
  fprintf(stderr, "sx-bench read: %s\n", err[0] ? err : "failed");
  rc = BX_FAIL;
out:
  bx_progress_end();
  bx_target_stop(&R.t);
  if (R.t.ctl_fd > 0)
    close(R.t.ctl_fd);
  for (int g = 0; g < o.n_sizes; g++)
    if (R.local[g] != NULL)
      munmap(R.local[g], R.local_blocks[g] * o.sizes[g]);
  bx_redis_stop(&srv);
  if (rc == BX_OK && bx_report_emit(rep, &plot) != 0)
    rc = BX_FAIL;
  if (rc == BX_OK && failed > 0) {
    fprintf(stderr, "sx-bench read: %d case%s failed (the NOTE column says why); the others "
            "ran\n", failed, failed > 1 ? "s" : "");
    rc = BX_FAIL;
  }
  bx_report_free(rep);
  return rc;
}
