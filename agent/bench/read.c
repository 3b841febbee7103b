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
 * a warm-up), with both processes' CPU time over the same window.  The raw
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

const char bx_read_help[] =
    "usage: sx-bench read [options] [common options]\n"
    "\n"
    "Batched block reads between two processes: this one (a reader agent) and an\n"
    "`sx-bench target` it starts (an agent with one group of blocks per size, filled\n"
    "with the verification pattern, plus a raw TCP stream server over the same\n"
    "memory).  Baseline in the same run: for tcp the raw socket stream between the\n"
    "same two processes (blocking sockets, one thread per connection on each side,\n"
    "the block size as the chunk; measured in two halves around the cases of each\n"
    "size); for rdma perftest's ib_read_bw on the same device.  Reported: GB/s\n"
    "(10^9 bytes), blocks/s, p50/p99 batch latency (submit to end) and CPU seconds\n"
    "per GB of both processes (getrusage).\n"
    "\n"
    "  --metadata URL      redis:// store (default: a private redis-server)\n"
    "  --transport KIND    tcp (default) or rdma\n"
    "  --sizes LIST        block sizes (default 4K,16K,64K,256K,1M,4M)\n"
    "  --batches LIST      blocks per batch (default 1,16,64,256,1024)\n"
    "  --ids KIND          contiguous, scattered or both (default both): contiguous ids\n"
    "                      merge into few ranges, scattered ones are one range each\n"
    "  --conns LIST        connections (TCP) or QPs (RDMA) per peer (default 4)\n"
    "  --depth N           batches in flight (default 2)\n"
    "  --group-bytes N     target memory per block size (default 64M)\n"
    "  --max-batch-bytes N skip batches larger than this (default 64M)\n"
    "  --verify            check every byte read (segxfer and raw stream) against\n"
    "                      the fill pattern; the checking time is in the figures\n"
    "  --baseline KIND     stream, ib_read_bw or none (default: stream for tcp,\n"
    "                      ib_read_bw for rdma)\n"
    "  --rdma-device DEV   device for ib_read_bw (default: the segment's RDMA one)\n"
    "  --rdma-ip IP        address ib_read_bw's client connects to (default 127.0.0.1)\n"
    "  --target-batch N    batch size the targets are judged at (default 64, or the\n"
    "                      largest below it that ran)\n"
    "  --op KIND           read (default) or write: this process is a named producer\n"
    "                      writing its (filled) blocks into the target's pool in write\n"
    "                      batches, each ending with the target's notice (push mode);\n"
    "                      baselines: the raw TCP stream the other way round (this\n"
    "                      process sends, the target receives into its pool), or\n"
    "                      ib_write_bw; no --verify\n"
    "  --location cuda:N   read GPU memory (GPU pool on --target-location, default the\n"
    "                      same): cuda_ipc against a plain device-to-device copy of\n"
    "                      the same ranges, tcp (staged) against host-memory tcp;\n"
    "                      --transport cuda_ipc, tcp or auto (both, the default);\n"
    "                      --target-location cuda:N puts the target's pool elsewhere\n"
    "  --rounds N          measure each case in N windows, each after a baseline\n"
    "                      window of its own, and judge it against those (default 1:\n"
    "                      the baseline in two halves around all cases of a size);\n"
    "                      steadier ratios on a busy machine, twice the time\n"
    "\n"
    "targets: TCP batched reads of 64K blocks >= 0.8x the raw stream, 1M >= 0.9x;\n"
    "RDMA batched reads >= 0.9x ib_read_bw at 64K and 1M (judged on scattered ids\n"
    "when they ran, for each --conns value: both sides use that many connections);\n"
    "--op write: TCP writes of 64K blocks >= 0.8x the raw stream, RDMA writes >= 0.9x\n"
    "ib_write_bw at 64K and 1M.\n"
    "\n"
    "examples:\n"
    "  sx-bench read\n"
    "  sx-bench read --sizes 64K,1M --batches 16,64,256 --conns 1,4 --plot read.png\n"
    "  sx-bench read --sizes 64K --batches 4 --duration 0.2 --verify\n"
    "  sx-bench read --transport rdma --sizes 64K,1M --group-bytes 16M\n"
    "  sx-bench read --op write --sizes 64K,1M --batches 64\n";

enum { BASE_STREAM, BASE_IB, BASE_NONE };

typedef struct ropts {
  const char *url;
  int rdma;
  uint64_t sizes[BX_MAX_SIZES];
  int n_sizes;
  uint64_t batches[16];
  int n_batches;
  int contig, scattered;
  uint64_t conns[8];
  int n_conns;
  uint32_t depth;
  uint64_t group_bytes, max_batch_bytes, target_batch, rounds;
  int verify, baseline;
  const char *rdma_dev, *rdma_ip;
  int write; /* --op write (write.c) */
} ropts;

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
 * cache-cold monster (the strongest honest baseline). */
static uint64_t stream_dst(const ropts *o, uint64_t size) {
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
    if (R->local_blocks[g] == 0)
      continue;
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
  double t_begin = bx_now(), t0 = 0, t_last = 0, c0 = 0, tc0 = 0;
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
    if (!measuring && t - t_begin >= warm) {
      /* The window opens at a batch end; this batch is not counted. */
      measuring = 1;
      t0 = t;
      c0 = bx_cpu_self();
      tc0 = bx_target_cpu(&R->t);
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
      double tc1 = bx_target_cpu(&R->t);
      out->cpu_target = tc0 >= 0 && tc1 >= tc0 ? tc1 - tc0 : -1;
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

/* Add one window's figures to a running total (CPU unknown stays unknown). */
static void accumulate(bx_caseres *acc, const bx_caseres *r) {
  acc->secs += r->secs;
  acc->bytes += r->bytes;
  acc->blocks += r->blocks;
  acc->batches += r->batches;
  acc->cpu_reader = acc->cpu_reader < 0 || r->cpu_reader < 0 ? -1 : acc->cpu_reader + r->cpu_reader;
  acc->cpu_target = acc->cpu_target < 0 || r->cpu_target < 0 ? -1 : acc->cpu_target + r->cpu_target;
}

static double gbps(const bx_caseres *r) {
  return r->secs > 0 ? (double)r->bytes / r->secs / 1e9 : 0;
}

/* One baseline window of secs, added to *acc.  ib_read_bw gives a rate:
 * it counts as one second at that rate. */
static int base_round(rd *R, int g, uint32_t conns, const char *dev, double secs,
                      bx_caseres *acc, char *err, size_t esize) {
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
    accumulate(acc, &r);
  } else if (o->baseline == BASE_IB) {
    if (dev == NULL) {
      snprintf(err, esize, "ib_read_bw: no RDMA device (--rdma-device)");
      return -1;
    }
    double gb = bx_ib_bw(o->write ? "ib_write_bw" : "ib_read_bw", dev, o->rdma_ip, size, conns,
                         secs, err, esize);
    if (gb < 0)
      return -1;
    bx_caseres r = {.secs = 1, .bytes = (uint64_t)(gb * 1e9), .cpu_reader = -1,
                    .cpu_target = -1};
    r.blocks = r.bytes / size;
    accumulate(acc, &r);
  }
  return 0;
}

/* ------------------------------------------------------------ report */

static const bx_col cols[] = {
    {"transport", "TRANSPORT", NULL},    {"block", "BLOCK", NULL},
    {"batch", "BATCH", "%.0f"},          {"ids", "IDS", NULL},
    {"conns", "CONNS", "%.0f"},          {"gb_s", "GB/S", "%.3f"},
    {"blocks_s", "BLOCKS/S", "%.0f"},    {"p50_ms", "P50 MS", "%.3f"},
    {"p99_ms", "P99 MS", "%.3f"},        {"cpu_s_gb", "CPU S/GB", "%.2f"},
    {"cpu_reader_s_gb", "READER", "%.2f"}, {"cpu_target_s_gb", "TARGET", "%.2f"},
    {"baseline_gb_s", "BASELINE GB/S", "%.3f"}, {"ratio", "VS BASELINE", "%.2fx"},
};

static void add_row(bx_table *t, const char *tr, uint64_t size, uint64_t batch, const char *ids,
                    uint32_t conns, const bx_caseres *r, double base) {
  bx_row *row = bx_row_add(t);
  char b[16];
  double gb = r->secs > 0 ? (double)r->bytes / r->secs / 1e9 : 0;
  bx_set_str(row, "transport", "%s", tr);
  bx_set_str(row, "block", "%s", bx_size_name(size, b, sizeof(b)));
  if (batch)
    bx_set_num(row, "batch", (double)batch);
  bx_set_str(row, "ids", "%s", ids);
  bx_set_num(row, "conns", conns);
  bx_set_num(row, "gb_s", gb);
  if (r->secs > 0)
    bx_set_num(row, "blocks_s", (double)r->blocks / r->secs);
  if (batch) {
    bx_set_num(row, "p50_ms", r->p50_ms);
    bx_set_num(row, "p99_ms", r->p99_ms);
  }
  double gbytes = (double)r->bytes / 1e9;
  if (gbytes > 0 && r->cpu_reader >= 0) {
    bx_set_num(row, "cpu_reader_s_gb", r->cpu_reader / gbytes);
    if (r->cpu_target >= 0) {
      bx_set_num(row, "cpu_target_s_gb", r->cpu_target / gbytes);
      bx_set_num(row, "cpu_s_gb", (r->cpu_reader + r->cpu_target) / gbytes);
    }
  }
  if (base > 0) {
    bx_set_num(row, "baseline_gb_s", base);
    bx_set_num(row, "ratio", gb / base);
  }
}

/* ------------------------------------------------------------ options */

static int parse(ropts *o, int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    int ok = 1;
    if (strcmp(a, "--verify") == 0) {
      o->verify = 1;
      continue;
    }
    if (v == NULL) {
      fprintf(stderr, "sx-bench read: unknown option or missing value '%s' "
              "(sx-bench read --help)\n", a);
      return BX_USAGE;
    }
    i++;
    if (strcmp(a, "--metadata") == 0) {
      o->url = v;
    } else if (strcmp(a, "--op") == 0) {
      ok = strcmp(v, "read") == 0 || strcmp(v, "write") == 0;
      o->write = strcmp(v, "write") == 0;
    } else if (strcmp(a, "--transport") == 0) {
      ok = strcmp(v, "tcp") == 0 || strcmp(v, "rdma") == 0;
      o->rdma = strcmp(v, "rdma") == 0;
    } else if (strcmp(a, "--sizes") == 0) {
      ok = (o->n_sizes = bx_parse_list(v, o->sizes, BX_MAX_SIZES, 1)) > 0;
    } else if (strcmp(a, "--batches") == 0) {
      ok = (o->n_batches = bx_parse_list(v, o->batches, 16, 0)) > 0;
      for (int k = 0; k < o->n_batches; k++)
        ok &= o->batches[k] >= 1 && o->batches[k] <= 65536;
    } else if (strcmp(a, "--conns") == 0) {
      ok = (o->n_conns = bx_parse_list(v, o->conns, 8, 0)) > 0;
      for (int k = 0; k < o->n_conns; k++)
        ok &= o->conns[k] >= 1 && o->conns[k] <= 64;
    } else if (strcmp(a, "--ids") == 0) {
      o->contig = strcmp(v, "contiguous") == 0 || strcmp(v, "both") == 0;
      o->scattered = strcmp(v, "scattered") == 0 || strcmp(v, "both") == 0;
      ok = o->contig || o->scattered;
    } else if (strcmp(a, "--depth") == 0 || strcmp(a, "--target-batch") == 0 ||
               strcmp(a, "--rounds") == 0) {
      uint64_t x;
      ok = bx_parse_list(v, &x, 1, 0) == 1 && x >= 1 && x <= 65536;
      if (a[2] == 'd')
        o->depth = (uint32_t)x;
      else if (a[2] == 'r')
        o->rounds = x > 100 ? 100 : x;
      else
        o->target_batch = x;
    } else if (strcmp(a, "--group-bytes") == 0) {
      ok = bx_parse_size(v, &o->group_bytes) == 0 && o->group_bytes > 0;
    } else if (strcmp(a, "--max-batch-bytes") == 0) {
      ok = bx_parse_size(v, &o->max_batch_bytes) == 0 && o->max_batch_bytes > 0;
    } else if (strcmp(a, "--baseline") == 0) {
      o->baseline = strcmp(v, "stream") == 0       ? BASE_STREAM
                    : strcmp(v, "ib_read_bw") == 0 || strcmp(v, "ib_write_bw") == 0 ? BASE_IB
                    : strcmp(v, "none") == 0       ? BASE_NONE
                                                   : -2;
      ok = o->baseline != -2;
    } else if (strcmp(a, "--rdma-device") == 0) {
      o->rdma_dev = v;
    } else if (strcmp(a, "--rdma-ip") == 0) {
      o->rdma_ip = v;
    } else {
      ok = 0;
    }
    if (!ok) {
      fprintf(stderr, "sx-bench read: bad option '%s %s' (sx-bench read --help)\n", a, v);
      return BX_USAGE;
    }
  }
  for (int g = 0; g < o->n_sizes; g++)
    if (o->sizes[g] == 0 || o->sizes[g] > o->group_bytes) {
      fprintf(stderr, "sx-bench read: block size %llu: 1..--group-bytes\n",
              (unsigned long long)o->sizes[g]);
      return BX_USAGE;
    }
  if (o->baseline == -1)
    o->baseline = o->rdma ? BASE_IB : BASE_STREAM;
  if (o->write && o->verify) {
    fprintf(stderr, "sx-bench read: --verify checks reads only (sxctl write --verify checks "
            "writes)\n");
    return BX_USAGE;
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
  int rc = parse(&o, argc, argv);
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
  bx_table *t = bx_table_add(rep, "read", title, cols, (int)(sizeof(cols) / sizeof(cols[0])));
  bx_plot plot = {.logx = 1, .xbytes = 1};
  snprintf(plot.title, sizeof(plot.title), "segxfer batched %s %s against %s", o.rdma ? "rdma"
           : "tcp", ops, o.rdma ? (o.write ? "ib_write_bw, same device" : "ib_read_bw, same "
           "device") : "a raw TCP stream, same two processes");
  snprintf(plot.xlabel, sizeof(plot.xlabel), "block size");
  snprintf(plot.ylabel, sizeof(plot.ylabel), "GB/s");
  /* Local destinations: depth batches of the largest batch of each size. */
  int cases = 0;
  for (int g = 0; g < o.n_sizes; g++) {
    uint64_t mb = max_batch(&o, o.sizes[g]);
    R.local_blocks[g] = mb * o.depth;
    if (mb == 0)
      continue;
    R.local[g] = mmap(NULL, R.local_blocks[g] * o.sizes[g], PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (R.local[g] == MAP_FAILED) {
      fprintf(stderr, "sx-bench read: cannot map local buffers\n");
      R.local[g] = NULL;
      goto fail;
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
  /* The targets' ratios: [connections index][64K, 1M]. */
  double judged[8][2];
  for (int k = 0; k < 8; k++)
    judged[k][0] = judged[k][1] = -1;
  for (int ci = 0; ci < o.n_conns; ci++) {
    uint32_t conns = (uint32_t)o.conns[ci];
    if (reader_start(&R, conns, url, name, err, sizeof(err)) != 0) {
      reader_stop(&R);
      goto fail;
    }
    const char *dev = o.rdma_dev;
    const sx_desc *d = sx_segment_desc(R.seg);
    for (uint32_t e = 0; dev == NULL && e < d->n_endpoints; e++)
      if (d->endpoints[e].kind == SX_TRANSPORT_RDMA)
        dev = d->endpoints[e].device;
    for (int g = 0; g < o.n_sizes; g++) {
      uint64_t size = o.sizes[g];
      if (R.local_blocks[g] == 0)
        continue;
      char b[16];
      bx_size_name(size, b, sizeof(b));
      const char *bname = o.baseline == BASE_IB ? ib : "raw stream";
      /* The cases of this size. */
      rcase rc_list[32];
      int nres = 0;
      for (int bi = 0; bi < o.n_batches; bi++) {
        if (o.batches[bi] * size > o.max_batch_bytes)
          continue;
        for (int sc = 0; sc < 2; sc++)
          if (((sc == 0 && o.contig) || (sc == 1 && o.scattered)) && nres < 32)
            rc_list[nres++] = (rcase){.g = g, .size = size, .batch = o.batches[bi],
                                      .scattered = sc};
      }
      /* With one round, the baseline is measured in two halves around all
       * cases of the size; with more, each case alternates with a baseline
       * window of its own, round after round, and is judged against it. */
      bx_caseres res[32], cbase[32], base = {0};
      bx_lat lat[32];
      memset(res, 0, sizeof(res));
      memset(cbase, 0, sizeof(cbase));
      memset(lat, 0, sizeof(lat));
      int rounds = (int)o.rounds, have_base = o.baseline != BASE_NONE;
      double slice = co->duration / rounds;
      if (rounds == 1 && have_base) {
        bx_progress("%s baseline, %s blocks, %u conns", bname, b, conns);
        if (base_round(&R, g, conns, dev, co->duration / 2, &base, err, sizeof(err)))
          goto fail_reader;
      }
      for (int k = 0; k < nres; k++) {
        const rcase *c = &rc_list[k];
        bx_progress("%s %s blocks, batch %llu, %s, %u conns%s", tr, b,
                    (unsigned long long)c->batch, c->scattered ? "scattered" : "contiguous",
                    conns, rounds > 1 ? ", alternating with the baseline" : "");
        for (int r = 0; r < rounds; r++) {
          bx_caseres one;
          if (rounds > 1 && have_base &&
              base_round(&R, g, conns, dev, slice, &cbase[k], err, sizeof(err)))
            goto fail_reader;
          if (run_case(&R, c, slice, &one, &lat[k], err, sizeof(err)) != 0)
            goto fail_reader;
          accumulate(&res[k], &one);
        }
        res[k].p50_ms = bx_lat_pct(&lat[k], 0.5) / 1e6;
        res[k].p99_ms = bx_lat_pct(&lat[k], 0.99) / 1e6;
        bx_lat_free(&lat[k]);
        if (rounds > 1)
          accumulate(&base, &cbase[k]);
      }
      if (rounds == 1 && have_base) {
        if (base_round(&R, g, conns, dev, co->duration / 2, &base, err, sizeof(err)))
          goto fail_reader;
        for (int k = 0; k < nres; k++)
          cbase[k] = base;
      }
      double base_gb = gbps(&base);
      if (o.baseline == BASE_STREAM) {
        add_row(t, "raw stream", size, 0, "-", conns, &base, 0);
      } else if (o.baseline == BASE_IB) {
        bx_row *row = bx_row_add(t);
        bx_set_str(row, "transport", "%s", ib);
        bx_set_str(row, "block", "%s", b);
        bx_set_num(row, "conns", conns);
        bx_set_num(row, "gb_s", base_gb);
        bx_set_num(row, "blocks_s", base_gb * 1e9 / (double)size);
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
        if (rc_list[k].batch <= o.target_batch && rc_list[k].batch > tb)
          tb = rc_list[k].batch;
      for (int k = 0; k < nres; k++) {
        const rcase *c = &rc_list[k];
        double gb = gbps(&res[k]), cb = gbps(&cbase[k]);
        add_row(t, tr, size, c->batch, c->scattered ? "scattered" : "contiguous", conns,
                &res[k], cb);
        snprintf(sname, sizeof(sname), "segxfer batch %llu, %s, %u %s",
                 (unsigned long long)c->batch, c->scattered ? "scattered" : "contiguous",
                 conns, o.rdma ? "QPs" : "conns");
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
            (size == 65536 || size == 1048576))
          judged[ci][size == 65536 ? 0 : 1] = gb / cb;
      }
    }
    reader_stop(&R);
  }
  /* One verdict per block size and connection count: both sides always
   * run with the same number of connections (the raw stream with a thread
   * per connection on each side, the agents with one event loop each). */
  for (int ci = 0; ci < o.n_conns; ci++) {
    for (int k = 0; k < 2; k++) {
      double limit = o.rdma ? 0.9 : (k == 0 ? 0.8 : 0.9);
      char tname[160], basis[160];
      if (o.write && !o.rdma && k == 1)
        continue; /* TCP writes: the issue sets a target at 64K only */
      snprintf(tname, sizeof(tname), "%s batched %s, %s blocks, vs %s, %llu %s",
               o.rdma ? "RDMA" : "TCP", ops, k == 0 ? "64K" : "1M",
               o.rdma ? ib : "raw stream", (unsigned long long)o.conns[ci],
               o.rdma ? "QPs" : "conns");
      snprintf(basis, sizeof(basis), "GB/s ratio, same run, batch %llu or the largest below, "
               "%s ids", (unsigned long long)o.target_batch,
               o.scattered ? "scattered" : "contiguous");
      if (judged[ci][k] >= 0)
        bx_target(rep, tname, judged[ci][k], "x", ">=", limit, basis);
      else if (ci == 0)
        bx_target_skip(rep, tname, o.baseline == BASE_NONE ? "--baseline none"
                                                          : "block size not run");
    }
  }
  rc = BX_OK;
  goto out;
fail_reader:
  reader_stop(&R);
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
  bx_report_free(rep);
  return rc;
}
