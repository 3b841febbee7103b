/*
 * sx-bench read's command line: the help text and the options (read.c runs
 * the cases).
 */
#include <stdio.h>
#include <string.h>

#include "bench.h"
#include "read.h"

const char bx_read_help[] =
    "usage: sx-bench read [options] [common options]\n"
    "\n"
    "Batched block reads between two processes: this one (a reader agent) and an\n"
    "`sx-bench target` it starts (an agent with one group of blocks per size, filled\n"
    "with the verification pattern, plus a raw TCP stream server over the same\n"
    "memory).  Baseline in the same run: for tcp the raw socket stream between the\n"
    "same two processes (blocking sockets, one thread per connection on each side,\n"
    "the block size as the chunk; measured in two halves around the cases of each\n"
    "size); for rdma perftest's ib_read_bw on the same device (and an ib_write_bw\n"
    "row).  Reported: GB/s (10^9 bytes), blocks/s, p50/p99 batch latency (submit\n"
    "to end) and CPU seconds per GB of both processes on every row (getrusage; the\n"
    "perftest programs' from wait4, as child processes), and both ratios.\n"
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
    "  --max-batch-bytes N skip batches larger than this (default 64M); skipped cases\n"
    "                      are listed, and a case that fails says why in its row (NOTE)\n"
    "                      while the others still run\n"
    "  --verify            check every byte read (segxfer and raw stream) against\n"
    "                      the fill pattern; the checking time is in the figures\n"
    "  --baseline KIND     stream, ib_read_bw or none (default: stream for tcp,\n"
    "                      ib_read_bw for rdma)\n"
    "  --stream-bytes N    the raw stream's receive buffer per connection (default:\n"
    "                      --depth x --target-batch blocks, within 4M..16M, which\n"
    "                      stays in cache; give the bytes in flight / conns to\n"
    "                      receive into as much memory as segxfer's destinations)\n"
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
    "                      same): cuda_ipc against the gather kernel copying the same\n"
    "                      ranges in one process (and a per-range cuMemcpyAsync\n"
    "                      reference row), tcp (staged) against host-memory tcp;\n"
    "                      --transport cuda_ipc, tcp or auto (both, the default);\n"
    "                      --target-location cuda:N puts the target's pool elsewhere;\n"
    "                      --batches LIST, --depth N (requests in flight), --rounds N\n"
    "                      (cuda_ipc and its baselines alternate, default 4); the\n"
    "                      engine shape --block-bytes B --layers L --kv 1|2\n"
    "                      --request-blocks LIST: R random blocks in each of L x kv\n"
    "                      tensors per request; rows give requests/s, GB/s, p50/p99\n"
    "                      per request and the copy method that ran (SX_GPU_COPY)\n"
    "  --rounds N          measure each case in N windows, each after a baseline\n"
    "                      window of its own, and judge it against those (default 1:\n"
    "                      the baseline in two halves around all cases of a size);\n"
    "                      steadier ratios on a busy machine, twice the time\n"
    "\n"
    "targets: TCP batched reads of 64K blocks >= 0.8x the raw stream, 1M >= 0.9x;\n"
    "RDMA batched reads >= 0.9x ib_read_bw at 64K and 1M; CPU per GB (both sides)\n"
    "<= 1.5x the baseline's at 64K and 1M (judged on scattered ids\n"
    "when they ran, for each --conns value: both sides use that many connections);\n"
    "p99 batch latency <= 2x p50 for batches of 16-128 blocks of 64K-1M; --op write:\n"
    "TCP writes of 64K blocks >= 0.8x the raw stream, RDMA writes >= 0.9x ib_write_bw\n"
    "at 64K and 1M (and CPU per GB and tails as for reads).  CPU WAIT\n"
    "MS/BATCH: time both processes' threads were runnable but waited for a CPU\n"
    "(schedstat), per batch: on a busy machine the tails follow it.\n"
    "\n"
    "examples:\n"
    "  sx-bench read\n"
    "  sx-bench read --sizes 64K,1M --batches 16,64,256 --conns 1,4 --plot read.png\n"
    "  sx-bench read --sizes 64K --batches 4 --duration 0.2 --verify\n"
    "  sx-bench read --transport rdma --sizes 64K,1M --group-bytes 16M\n"
    "  sx-bench read --op write --sizes 64K,1M --batches 64\n";

int bx_read_parse(ropts *o, int argc, char **argv) {
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
    } else if (strcmp(a, "--stream-bytes") == 0) {
      ok = bx_parse_size(v, &o->stream_bytes) == 0 && o->stream_bytes > 0 &&
           o->stream_bytes <= (16ull << 30);
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
