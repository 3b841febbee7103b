/*
 * sx-bench read --location cuda:N: batched reads of GPU memory between two
 * processes, each figure next to a baseline measured in the same run:
 *
 *   cuda_ipc  device-to-device reads from the target's GPU pool, against
 *             the memory layer's gather kernel copying the same ranges
 *             between the same GPUs inside this process (peer access
 *             enabled across GPUs; one launch per batch, as many batches in
 *             flight): what a user gets from one gather in one process.  A
 *             row of cuMemcpyAsync per range (4 streams) stays beside it as
 *             a reference (the copy engine's cost per range).
 *   tcp       GPU -> GPU through pinned staging on both sides, against
 *             host-memory TCP reads between the same two processes (the
 *             target hosts the same pool in host memory as a second
 *             segment), alternating in halves around each case.
 *   rdma      (--transport rdma, alone) GPU -> GPU over RDMA, staged
 *             through pinned rings where the NIC cannot reach GPU memory
 *             (docs/gpu.md), against host-memory RDMA reads between the
 *             same two processes, in halves around each case as for tcp.
 *
 * A batch is a request: --batches N scattered blocks, or, in the engine
 * shape (--layers L [--kv 2] --request-blocks R), R random blocks in each
 * of L x kv tensors (slices of the target's pool), each block one range
 * of --block-bytes.  Reported per row: requests/s, GB/s, p50/p99 per
 * request (submit to completion, --depth requests in flight) and which
 * copy method ran (sx__mem_gather's counts in this process).
 *
 * This process is the reader; it starts `sx-bench gpu-target` (below) on
 * the target device.  Every case ends with one batch whose every byte is
 * checked against the fill pattern (copied back from the GPU).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "mem/mem.h"
#include "pattern.h"
#include "segxfer/agent.h"

#define MAX_SIZES 8
#define MAX_BATCHES 8
#define COPY_STREAMS 4 /* as many as the cuda_ipc transport uses per device */
#define SEED 0x6b7cu

const char bx_gpu_target_help[] =
    "usage: sx-bench gpu-target --metadata URL --name NAME --location cuda:N\n"
    "                           --sizes LIST --group-bytes N\n"
    "\n"
    "The far end of `sx-bench read --location cuda:N`, which starts it; not meant\n"
    "to be run by hand.  Publishes NAME (one region per block size in GPU memory)\n"
    "and NAME-host (the same in host memory), both filled with the pattern, prints\n"
    "\"ready\" and serves until its stdin closes.\n";

typedef struct gopts {
  const char *url, *location, *target_location, *name;
  uint64_t sizes[MAX_SIZES];
  int n_sizes;
  uint64_t batches[MAX_BATCHES]; /* ranges per request */
  int n_batches;
  uint64_t batch; /* the one measured now */
  uint64_t depth, group_bytes, rounds;
  uint64_t layers, kv, req_blocks[MAX_BATCHES]; /* the engine shape (layers > 0) */
  int ipc, tcp, rdma;
} gopts;

static void quiet(void *arg, sx_log_level level, const char *msg) {
  (void)arg;
  if (level <= SX_LOG_WARN)
    fprintf(stderr, "  [agent] %s\n", msg);
}

static sx_agent *agent(const char *url, const char *name, unsigned transports) {
  sx_agent_params p;
  sx_agent_params_init(&p);
  p.name = name;
  p.metadata_url = url;
  p.listen = name ? "127.0.0.1:0" : NULL;
  p.transports = transports;
  p.log = quiet;
  p.log_level = SX_LOG_WARN;
  bx_bench_layout(&p.layout);
  sx_agent *a = NULL;
  if (sx_agent_create(&p, &a) != 0)
    fprintf(stderr, "sx-bench: agent %s: %s\n", name ? name : "(reader)", sx_errmsg());
  return a;
}

/* One region per size (group g, slot K, one layer) at location; mem[g]. */
static int pool(sx_agent *a, const char *location, const uint64_t *sizes, int n,
                const uint64_t *blocks, uint8_t **mem, int fill) {
  sx__mem_info m;
  if (sx__mem_parse_location(location, &m) != 0)
    return -1;
  for (int g = 0; g < n; g++) {
    uint64_t len = blocks[g] * sizes[g];
    int rc = m.kind == SX__MEM_CUDA ? sx__mem_alloc(m.device, len, (void **)&mem[g])
             : (mem[g] = malloc(len)) == NULL ? SX_ENOMEM : 0;
    uint32_t id;
    sx_region_params rp = {.addr = mem[g], .length = len, .group = (uint32_t)g,
                           .layer_count = 1, .block_bytes = sizes[g], .num_blocks = blocks[g],
                           .location = location, .access = SX_ACCESS_REMOTE_READ};
    if (rc == 0)
      rc = sx_agent_register(a, &rp, &id);
    if (rc == 0 && fill)
      rc = sx__pattern_fill_any(mem[g], len, SEED, id, 0);
    if (rc != 0) {
      fprintf(stderr, "sx-bench: pool on %s: %s\n", location, sx_errmsg());
      return -1;
    }
  }
  return 0;
}

/* ------------------------------------------------------------ the target */

int bx_gpu_target_main(const bx_common *co, int argc, char **argv) {
  (void)co;
  gopts o = {.group_bytes = 64ull << 20};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--metadata") == 0)
      o.url = argv[i + 1];
    else if (strcmp(argv[i], "--name") == 0)
      o.name = argv[i + 1];
    else if (strcmp(argv[i], "--location") == 0)
      o.location = argv[i + 1];
    else if (strcmp(argv[i], "--sizes") == 0)
      o.n_sizes = bx_parse_list(argv[i + 1], o.sizes, MAX_SIZES, 1);
    else if (strcmp(argv[i], "--group-bytes") == 0)
      bx_parse_size(argv[i + 1], &o.group_bytes);
  }
  if (o.url == NULL || o.name == NULL || o.location == NULL || o.n_sizes <= 0) {
    fputs(bx_gpu_target_help, stderr);
    return BX_USAGE;
  }
  char host_name[SX_NAME_MAX + 1];
  snprintf(host_name, sizeof(host_name), "%s-host", o.name);
  uint64_t blocks[MAX_SIZES];
  uint8_t *gmem[MAX_SIZES] = {0}, *hmem[MAX_SIZES] = {0};
  for (int g = 0; g < o.n_sizes; g++)
    blocks[g] = o.group_bytes / o.sizes[g] ? o.group_bytes / o.sizes[g] : 1;
  /* RDMA where a device exists (staged RDMA of GPU memory, docs/gpu.md). */
  sx_agent *ga = agent(o.url, o.name, SX_TRANSPORTS_ALL);
  sx_agent *ha = agent(o.url, host_name, SX_TRANSPORTS_TCP | SX_TRANSPORTS_RDMA);
  if (ga == NULL || ha == NULL ||
      pool(ga, o.location, o.sizes, o.n_sizes, blocks, gmem, 1) != 0 ||
      pool(ha, "cpu", o.sizes, o.n_sizes, blocks, hmem, 1) != 0 ||
      sx_agent_publish(ga, 0) != 0 || sx_agent_publish(ha, 0) != 0) {
    fprintf(stderr, "sx-bench gpu-target: %s\n", sx_errmsg());
    return BX_FAIL;
  }
  printf("ready\n");
  fflush(stdout);
  char buf[64];
  while (read(STDIN_FILENO, buf, sizeof(buf)) > 0) {
  }
  sx_agent_destroy(ga);
  sx_agent_destroy(ha);
  for (int g = 0; g < o.n_sizes; g++) {
    sx__mem_free(gmem[g]);
    free(hmem[g]);
  }
  return BX_OK;
}

/* ------------------------------------------------------------ measuring */

typedef struct run {
  const gopts *o;
  uint64_t rng;
  uint64_t tblocks[MAX_SIZES]; /* target blocks per size */
} run;

static uint64_t next(run *R) {
  R->rng ^= R->rng << 13;
  R->rng ^= R->rng >> 7;
  R->rng ^= R->rng << 17;
  return R->rng;
}

/* A request into local slot k: batch random remote blocks, or, in the
 * engine shape, the same number from each of layers x kv tensors (equal
 * slices of the pool); local blocks are distinct.  It costs both sides
 * the same, on the thread that submits, so it stays cheap: no division
 * per block (two took about 10 us of a 1024-block request on an H200
 * host), a random block by the high half of a 128-bit product. */
static void entries(run *R, int g, uint64_t k, sx_block_read *e) {
  const gopts *o = R->o;
  uint64_t tensors = o->layers ? o->layers * o->kv : 1, per = o->batch / tensors;
  uint64_t area = R->tblocks[g] / tensors, base = 0, left = per;
  for (uint64_t i = 0; i < o->batch; i++, left--) {
    if (left == 0) {
      base += area; /* the next tensor */
      left = per;
    }
    uint64_t b = base + (uint64_t)(((unsigned __int128)next(R) * area) >> 64);
    e[i] = (sx_block_read){.group = (uint32_t)g, .layer_count = 1, .slots = 1,
                           .remote_block = b, .local_block = k * o->batch + i, .count = 1};
  }
}

/* What a measured case gives. */
typedef struct mres {
  double gbps, rps, p50_ms, p99_ms;
  double post_us, end_us; /* p50: submit to posted, submit to ended (loop thread) */
  uint64_t methods[4]; /* gathers per copy method in this process */
  double caller_us, other_us; /* CPU per request: the submitting thread, the rest */
  double loop_us; /* CPU per request of the reader agent's own thread (its loop) */
} mres;

/* Reads for secs with depth requests in flight: adds the window's bytes,
 * requests, seconds and latencies to *acc; 0, or -1. */
typedef struct macc {
  uint64_t bytes, reqs;
  double secs;
  bx_lat lat, post, end;
  uint64_t methods[4];
  uint64_t caller_ns, proc_ns; /* CPU time of the submitting thread, of the process */
  uint64_t loop_ns;             /* of the reader agent's own thread */
} macc;

static uint64_t cpu_ns(clockid_t c) {
  struct timespec ts;
  clock_gettime(c, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* CPU time of the agent's own thread (its loop), ns. */
static uint64_t loop_ns(sx_agent *a) {
  sx_agent_stats st;
  return sx_agent_stats_get(a, &st, sizeof(st)) == 0 ? st.loop_cpu_ns : 0;
}

static int measure(run *R, sx_agent *a, sx_segment *seg, int g, double secs, macc *acc) {
  const gopts *o = R->o;
  uint64_t size = o->sizes[g], bytes = 0, reqs = 0;
  sx_batch *b[64] = {0};
  double at[64] = {0};
  sx_block_read *e = malloc(o->batch * sizeof(*e));
  double t0 = 0, t_end = 0;
  int ok = e != NULL, warm = 0;
  uint64_t k = 0, m0[4], m1[4], c0 = 0, c1 = 0, p0 = 0, p1 = 0, l0 = 0, l1 = 0;
  for (double start = bx_now(); ok;) {
    uint64_t slot = k % o->depth;
    if (b[slot] != NULL) {
      sx_batch_result res;
      sx_batch_wait(b[slot], -1);
      double now = bx_now();
      sx_batch_result_get(b[slot], &res);
      sx_batch_destroy(b[slot]);
      b[slot] = NULL;
      if (res.state != SX_BATCH_COMPLETED) {
        fprintf(stderr, "sx-bench: batch: %s\n", res.message);
        ok = 0;
        break;
      }
      if (warm) {
        bytes += o->batch * size;
        reqs++;
        bx_lat_add(&acc->lat, (uint64_t)((now - at[slot]) * 1e9));
        bx_lat_add(&acc->post, res.post_ns);
        bx_lat_add(&acc->end, res.transfer_ns);
      }
      if (!warm && now - start > secs / 5) {
        warm = 1;
        t0 = now;
        sx__mem_copy_counts(m0);
        c0 = cpu_ns(CLOCK_THREAD_CPUTIME_ID);
        p0 = cpu_ns(CLOCK_PROCESS_CPUTIME_ID);
        l0 = loop_ns(a);
      } else if (warm && now - t0 >= secs) {
        t_end = now;
        sx__mem_copy_counts(m1);
        c1 = cpu_ns(CLOCK_THREAD_CPUTIME_ID);
        p1 = cpu_ns(CLOCK_PROCESS_CPUTIME_ID);
        l1 = loop_ns(a);
        break;
      }
    }
    entries(R, g, slot, e);
    at[slot] = bx_now();
    if (sx_batch_create(seg, NULL, &b[slot]) != 0 ||
        sx_batch_add_blocks(b[slot], e, o->batch) != 0 || sx_batch_submit(b[slot]) != 0) {
      fprintf(stderr, "sx-bench: batch: %s\n", sx_errmsg());
      ok = 0;
    }
    k++;
  }
  for (uint64_t i = 0; i < o->depth; i++)
    sx_batch_destroy(b[i]);
  free(e);
  if (!ok || t_end <= t0)
    return -1;
  acc->bytes += bytes;
  acc->reqs += reqs;
  acc->secs += t_end - t0;
  acc->caller_ns += c1 - c0;
  acc->proc_ns += p1 - p0;
  acc->loop_ns += l1 > l0 ? l1 - l0 : 0;
  for (int m = 0; m < 4; m++)
    acc->methods[m] += m1[m] - m0[m];
  return 0;
}

static mres macc_result(macc *a) {
  mres r = {.gbps = (double)a->bytes / a->secs / 1e9, .rps = (double)a->reqs / a->secs,
            .p50_ms = bx_lat_pct(&a->lat, 0.5) / 1e6, .p99_ms = bx_lat_pct(&a->lat, 0.99) / 1e6,
            .post_us = bx_lat_pct(&a->post, 0.5) / 1e3, .end_us = bx_lat_pct(&a->end, 0.5) / 1e3};
  bx_lat_free(&a->lat);
  bx_lat_free(&a->post);
  bx_lat_free(&a->end);
  memcpy(r.methods, a->methods, sizeof(r.methods));
  if (a->reqs > 0 && a->proc_ns > 0) {
    r.caller_us = (double)a->caller_ns / 1e3 / (double)a->reqs;
    r.other_us = (double)(a->proc_ns - a->caller_ns) / 1e3 / (double)a->reqs;
    r.loop_us = (double)a->loop_ns / 1e3 / (double)a->reqs;
  }
  return r;
}

/* The baselines of cuda_ipc, in this process: the same requests (src on
 * the target's GPU, dst on ours), depth in flight, copied by the gather
 * kernel (one launch per request, requests over COPY_STREAMS streams, peer
 * access enabled across GPUs), or by one cuMemcpyAsync per range (ranges
 * over COPY_STREAMS streams).  Adds to *acc (no latencies); 0, or -1. */
static int base_copy(run *R, int g, int sdev, int ddev, double secs, sx__mem_copy_method how,
                     macc *acc) {
  const gopts *o = R->o;
  uint64_t size = o->sizes[g], n = R->tblocks[g], bytes = 0;
  uint8_t *src = NULL, *dst = NULL;
  sx__mem_stream *s[COPY_STREAMS] = {0};
  sx_block_read *e = malloc(o->batch * sizeof(*e));
  sx__mem_range *rg = malloc(o->batch * sizeof(*rg));
  int rc = -1;
  uint64_t m0[4], m1[4];
  if (e == NULL || rg == NULL || sx__mem_alloc(sdev, n * size, (void **)&src) != 0 ||
      sx__mem_alloc(ddev, o->batch * o->depth * size, (void **)&dst) != 0 ||
      sx__mem_peer_enable(ddev, sdev) != 0)
    goto out;
  for (int i = 0; i < COPY_STREAMS; i++)
    if (sx__mem_stream_create(ddev, &s[i]) != 0)
      goto out;
  double t0 = 0, start = bx_now();
  int warm = 0;
  for (uint64_t k = 0;; k++) {
    uint64_t slot = k % o->depth;
    entries(R, g, slot, e);
    for (uint64_t i = 0; i < o->batch; i++)
      rg[i] = (sx__mem_range){(uint64_t)(uintptr_t)(dst + e[i].local_block * size),
                              (uint64_t)(uintptr_t)(src + e[i].remote_block * size), size};
    if (how == SX__COPY_KERNEL) {
      sx__mem_copy_method used;
      if (sx__mem_gather(s[k % COPY_STREAMS], rg, o->batch, SX__GATHER_SM_OK, how, &used) != 0)
        goto out;
      if (used != how) {
        const char *why = sx__mem_kernel_error(ddev);
        fprintf(stderr, "sx-bench: the gather kernel did not run: %s\n", why ? why : "?");
        goto out;
      }
    } else {
      for (uint64_t i = 0; i < o->batch; i++)
        if (sx__mem_copy_async(s[i % COPY_STREAMS], (void *)(uintptr_t)rg[i].dst,
                               (const void *)(uintptr_t)rg[i].src, size) != 0)
          goto out;
    }
    if (slot + 1 < o->depth)
      continue;
    for (int i = 0; i < COPY_STREAMS; i++)
      sx__mem_stream_sync(s[i]);
    double now = bx_now();
    if (warm)
      bytes += o->depth * o->batch * size;
    if (!warm && now - start > secs / 5) {
      warm = 1;
      t0 = now;
      sx__mem_copy_counts(m0);
    } else if (warm && now - t0 >= secs) {
      sx__mem_copy_counts(m1);
      acc->bytes += bytes;
      acc->reqs += bytes / (o->batch * size);
      acc->secs += now - t0;
      for (int m = 0; m < 4; m++)
        acc->methods[m] += m1[m] - m0[m];
      rc = 0;
      break;
    }
  }
out:
  for (int i = 0; i < COPY_STREAMS; i++)
    sx__mem_stream_destroy(s[i]);
  sx__mem_free(src);
  sx__mem_free(dst);
  free(e);
  free(rg);
  if (rc != 0)
    fprintf(stderr, "sx-bench: %s baseline: %s\n", sx__mem_copy_name(how), sx_errmsg());
  return rc;
}

/* One more batch, run to its end, every byte checked against the
 * pattern (copied back from the GPU).  SX_BENCH_NO_CHECK=1 skips the byte
 * comparison (the batch still runs and must complete): only for profiling
 * segxfer's CPU cost on the CUDA stand-in with FAKE_CUDA_NO_COPY=1, which
 * moves no bytes; the table then says so. */
static int no_check(void) {
  const char *e = getenv("SX_BENCH_NO_CHECK");
  return e != NULL && strcmp(e, "1") == 0;
}

static int check(run *R, sx_segment *seg, int g, uint8_t *local, sx_block_read *e) {
  entries(R, g, 0, e);
  sx_batch *b;
  sx_batch_result res = {.state = SX_BATCH_FAILED};
  if (sx_batch_create(seg, NULL, &b) == 0) {
    if (sx_batch_add_blocks(b, e, R->o->batch) == 0 && sx_batch_submit(b) == 0 &&
        sx_batch_wait(b, -1) == 0)
      sx_batch_result_get(b, &res);
    sx_batch_destroy(b);
  }
  if (res.state != SX_BATCH_COMPLETED) {
    fprintf(stderr, "sx-bench: verify batch: %s\n", res.message);
    return -1;
  }
  if (no_check()) {
    fprintf(stderr, "sx-bench: SX_BENCH_NO_CHECK=1: bytes not checked (profiling only)\n");
    return 0;
  }
  const sx_region *Rg = NULL;
  const sx_desc *d = sx_segment_desc(seg);
  for (uint32_t i = 0; i < d->n_regions; i++)
    if (d->regions[i].group == (uint32_t)g)
      Rg = &d->regions[i];
  uint64_t size = R->o->sizes[g], bad;
  for (uint64_t i = 0; Rg != NULL && i < R->o->batch; i++)
    if (sx__pattern_check_any(local + e[i].local_block * size, size, SEED, Rg->id,
                              e[i].remote_block * size, &bad) != 0) {
      fprintf(stderr, "sx-bench: verify: block %lu byte %lu differs\n",
              (unsigned long)e[i].remote_block, (unsigned long)bad);
      return -1;
    }
  return Rg != NULL ? 0 : -1;
}

/* ------------------------------------------------------------ the reader */

typedef struct side {
  sx_agent *a;
  sx_segment *seg;
  uint8_t *mem[MAX_SIZES];
  const char *location;
} side;

static int side_open(side *s, const gopts *o, const char *url, unsigned tr,
                     const char *location, const char *name) {
  memset(s, 0, sizeof(*s));
  s->location = location;
  uint64_t blocks[MAX_SIZES];
  uint64_t most = 0;
  for (int k = 0; k < o->n_batches; k++)
    most = o->batches[k] > most ? o->batches[k] : most;
  for (int g = 0; g < o->n_sizes; g++)
    blocks[g] = most * o->depth;
  if ((s->a = agent(url, NULL, tr)) == NULL ||
      pool(s->a, location, o->sizes, o->n_sizes, blocks, s->mem, 0) != 0)
    return -1;
  if (sx_segment_open(s->a, name, 10000, &s->seg) != 0) {
    fprintf(stderr, "sx-bench: open %s: %s\n", name, sx_errmsg());
    return -1;
  }
  return 0;
}

static void side_close(side *s, int n) {
  sx_segment_close(s->seg);
  sx_agent_destroy(s->a);
  for (int g = 0; g < n; g++)
    strcmp(s->location, "cpu") == 0 ? free(s->mem[g]) : sx__mem_free(s->mem[g]);
}

static const bx_col cols[] = {
    {"transport", "TRANSPORT", NULL}, {"path", "PATH", NULL}, {"block", "BLOCK", NULL},
    {"batch", "RANGES/REQ", "%.0f"},  {"req_s", "REQ/S", "%.0f"},
    {"gb_s", "GB/S", "%.2f"},         {"p50_ms", "P50 MS", "%.3f"},
    {"p99_ms", "P99 MS", "%.3f"},     {"post_us", "POSTED US", "%.0f"},
    {"end_us", "ENDED US", "%.0f"},   {"caller_cpu_us", "CALLER CPU US", "%.1f"},
    {"other_cpu_us", "OTHER CPU US", "%.1f"}, {"loop_cpu_us", "LOOP CPU US", "%.1f"},
    {"method", "COPIES BY", NULL},
    {"baseline", "BASELINE", NULL},   {"baseline_gb_s", "BASELINE GB/S", "%.2f"},
    {"ratio", "VS BASELINE", "%.2fx"},
};

/* "kernel", "batch+range", ...: the methods that ran, most used first. */
static void methods_str(const uint64_t m[4], char *out, size_t cap) {
  int order[3] = {1, 2, 3};
  for (int i = 0; i < 3; i++)
    for (int j = i + 1; j < 3; j++)
      if (m[order[j]] > m[order[i]]) {
        int x = order[i];
        order[i] = order[j];
        order[j] = x;
      }
  out[0] = '\0';
  for (int i = 0; i < 3; i++)
    if (m[order[i]] > 0)
      snprintf(out + strlen(out), cap - strlen(out), "%s%s", out[0] ? "+" : "",
               sx__mem_copy_name((sx__mem_copy_method)order[i]));
  if (out[0] == '\0')
    snprintf(out, cap, "-");
}

static void row(bx_table *t, const char *tr, const char *path, uint64_t size,
                uint64_t batch, const mres *v, const char *method, const char *bname,
                double base) {
  char b[16], ms[32];
  bx_row *r = bx_row_add(t);
  bx_set_str(r, "transport", "%s", tr);
  bx_set_str(r, "path", "%s", path);
  bx_set_str(r, "block", "%s", bx_size_name(size, b, sizeof(b)));
  bx_set_num(r, "batch", (double)batch);
  bx_set_num(r, "req_s", v->rps);
  bx_set_num(r, "gb_s", v->gbps);
  if (v->p50_ms > 0) {
    bx_set_num(r, "p50_ms", v->p50_ms);
    bx_set_num(r, "p99_ms", v->p99_ms);
    bx_set_num(r, "post_us", v->post_us);
    bx_set_num(r, "end_us", v->end_us);
  }
  if (v->caller_us > 0) {
    bx_set_num(r, "caller_cpu_us", v->caller_us);
    bx_set_num(r, "other_cpu_us", v->other_us);
    if (v->loop_us > 0)
      bx_set_num(r, "loop_cpu_us", v->loop_us);
  }
  if (method == NULL) {
    methods_str(v->methods, ms, sizeof(ms));
    method = ms;
  }
  bx_set_str(r, "method", "%s", method);
  if (bname != NULL) {
    bx_set_str(r, "baseline", "%s", bname);
    bx_set_num(r, "baseline_gb_s", base);
    bx_set_num(r, "ratio", v->gbps / base);
  }
}

/* A target of the report, named by path, block size and request. */
static void judge(bx_report *rep, const char *path, uint64_t size, uint64_t batch,
                  const char *vs, double v, const char *unit, const char *op, double limit,
                  const char *basis) {
  char what[200], b[16];
  snprintf(what, sizeof(what), "%s, %s blocks, %llu ranges/request, %s", path,
           bx_size_name(size, b, sizeof(b)), (unsigned long long)batch, vs);
  bx_target(rep, what, v, unit, op, limit, basis);
}

static int spawn(const gopts *o, const char *url, const char *name, pid_t *pid, int *lifeline) {
  char sizes[256] = "", gb[32], b[16], line[16];
  for (int g = 0; g < o->n_sizes; g++)
    snprintf(sizes + strlen(sizes), sizeof(sizes) - strlen(sizes), "%s%s", g ? "," : "",
             bx_size_name(o->sizes[g], b, sizeof(b)));
  snprintf(gb, sizeof(gb), "%llu", (unsigned long long)o->group_bytes);
  const char *args[] = {"sx-bench", "gpu-target", "--metadata", url, "--name", name,
                        "--location", o->target_location, "--sizes", sizes,
                        "--group-bytes", gb, NULL};
  return bx_spawn(args, pid, lifeline, line, sizeof(line)) == 0 &&
                 strncmp(line, "ready", 5) == 0
             ? 0
             : -1;
}

/* The staged targets: GPU->GPU over tr against host->host over tr, for a
 * block size; < 0 where none is set (rdma: the sizes of issue 22). */
static double staged_limit(const char *tr, uint64_t size) {
  if (strcmp(tr, "tcp") == 0)
    return 0.7;
  return size == 32768 ? 0.6 : size == (1u << 20) ? 0.8 : -1;
}

/* Staged GPU->GPU reads over transport tr (gs) against host-memory reads
 * over the same transport between the same processes (hs), measured in two
 * halves around each case, for every block size and request size (o->batch
 * is set to each in turn): a row of each and the ratio judged.  0, or -1. */
static int staged_vs_host(run *R, gopts *o, bx_table *t, bx_report *rep, double secs, side *gs,
                          side *hs, const char *tr, sx_block_read *last) {
  char path[32], host[16], vs[24];
  snprintf(path, sizeof(path), "%s staged GPU->GPU", tr);
  snprintf(host, sizeof(host), "host %s", tr);
  snprintf(vs, sizeof(vs), "vs host %s", tr);
  for (int g = 0; g < o->n_sizes; g++) {
    for (int k = 0; k < o->n_batches; k++) {
      o->batch = o->batches[k];
      bx_progress("%s staged, %llu-byte blocks, %llu per request", tr,
                  (unsigned long long)o->sizes[g], (unsigned long long)o->batch);
      macc v = {0}, hb = {0};
      int ok = measure(R, hs->a, hs->seg, g, secs / 2, &hb) == 0 &&
               measure(R, gs->a, gs->seg, g, secs, &v) == 0 &&
               check(R, gs->seg, g, gs->mem[g], last) == 0 &&
               measure(R, hs->a, hs->seg, g, secs / 2, &hb) == 0 &&
               check(R, hs->seg, g, hs->mem[g], last) == 0;
      mres mv = macc_result(&v), mh = macc_result(&hb);
      if (!ok)
        return -1;
      row(t, tr, "gpu->gpu staged", o->sizes[g], o->batch, &mv, NULL, host, mh.gbps);
      row(t, tr, "host->host", o->sizes[g], o->batch, &mh, "-", NULL, 0);
      double limit = staged_limit(tr, o->sizes[g]);
      if (limit >= 0)
        judge(rep, path, o->sizes[g], o->batch, vs, mv.gbps / mh.gbps,
              "x", ">=", limit,
              strcmp(tr, "tcp") == 0 ? "GB/s ratio, same run"
                                     : "GB/s ratio, same run, scattered ids");
    }
  }
  return 0;
}

/* The options of sx-bench read --location: 0, or BX_USAGE (said). */
static int parse(gopts *o, int argc, char **argv) {
  uint64_t block_bytes = 0;
  int n_req = 0, batches_given = 0;
  /* Every option takes a value: i steps over both. */
  for (int i = 1; i < argc; i += 2) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    int ok = v != NULL;
    uint64_t x = 0;
    if (strcmp(a, "--location") == 0 && ok)
      o->location = v;
    else if (strcmp(a, "--target-location") == 0 && ok)
      o->target_location = v;
    else if (strcmp(a, "--metadata") == 0 && ok)
      o->url = v;
    else if (strcmp(a, "--sizes") == 0 && ok) {
      ok = (o->n_sizes = bx_parse_list(v, o->sizes, MAX_SIZES, 1)) > 0;
      for (int k = 0; ok && k < o->n_sizes; k++)
        ok = o->sizes[k] > 0; /* a block of 0 bytes divides the pool by zero */
    }
    else if (strcmp(a, "--block-bytes") == 0 && ok)
      ok = bx_parse_size(v, &block_bytes) == 0 && block_bytes > 0;
    else if (strcmp(a, "--batches") == 0 && ok) {
      ok = (o->n_batches = bx_parse_list(v, o->batches, MAX_BATCHES, 0)) > 0;
      batches_given = 1;
    } else if (strcmp(a, "--request-blocks") == 0 && ok)
      ok = (n_req = bx_parse_list(v, o->req_blocks, MAX_BATCHES, 0)) > 0;
    else if ((strcmp(a, "--depth") == 0 || strcmp(a, "--rounds") == 0 ||
              strcmp(a, "--layers") == 0 || strcmp(a, "--kv") == 0) && ok) {
      ok = bx_parse_list(v, &x, 1, 0) == 1 && x >= 1;
      if (a[2] == 'd')
        ok = ok && (o->depth = x) <= 64;
      else if (a[2] == 'r')
        ok = ok && (o->rounds = x) <= 100;
      else if (a[2] == 'l')
        ok = ok && (o->layers = x) <= 1024;
      else
        ok = ok && (o->kv = x) <= 2;
    } else if (strcmp(a, "--group-bytes") == 0 && ok)
      ok = bx_parse_size(v, &o->group_bytes) == 0 && o->group_bytes > 0;
    else if (strcmp(a, "--transport") == 0 && ok) {
      o->ipc = strcmp(v, "cuda_ipc") == 0 || strcmp(v, "auto") == 0;
      o->tcp = strcmp(v, "tcp") == 0 || strcmp(v, "auto") == 0;
      o->rdma = strcmp(v, "rdma") == 0; /* staged RDMA, against host-memory RDMA */
      ok = o->ipc || o->tcp || o->rdma;
    } else
      ok = 0;
    if (!ok) {
      fprintf(stderr, "sx-bench read (GPU): bad option '%s'; GPU reads take --location, "
              "--target-location, --transport cuda_ipc|tcp|rdma|auto, --sizes, --batches LIST, "
              "--depth N (1-64), --rounds N (1-100), --group-bytes, --metadata, and the "
              "engine shape --block-bytes B --layers L --kv 1|2 --request-blocks LIST\n", a);
      return BX_USAGE;
    }
  }
  int engine = o->layers > 0 || n_req > 0 || block_bytes > 0;
  if (engine) {
    if (o->layers == 0 || n_req == 0 || batches_given) {
      fprintf(stderr, "sx-bench read (GPU): the engine shape takes --layers L and "
              "--request-blocks LIST (with --block-bytes, --kv), not --batches\n");
      return BX_USAGE;
    }
    if (block_bytes > 0) {
      o->sizes[0] = block_bytes;
      o->n_sizes = 1;
    }
    o->n_batches = n_req;
    for (int k = 0; k < n_req; k++) {
      /* Bounded before multiplying: a product past 2^64 wrapped to a
       * small count that passed the check below. */
      if (o->req_blocks[k] > 1u << 20) {
        fprintf(stderr, "sx-bench read (GPU): --request-blocks %llu: at most 2^20\n",
                (unsigned long long)o->req_blocks[k]);
        return BX_USAGE;
      }
      o->batches[k] = o->req_blocks[k] * o->layers * o->kv;
    }
  }
  for (int k = 0; k < o->n_batches; k++)
    if (o->batches[k] == 0 || o->batches[k] > 1u << 20 || o->batches[k] * o->depth > 1u << 20) {
      fprintf(stderr, "sx-bench read (GPU): %llu ranges per request: 1 to 2^20 with depth\n",
              (unsigned long long)o->batches[k]);
      return BX_USAGE;
    }
  return 0;
}

int bx_read_gpu_main(const bx_common *co, int argc, char **argv) {
  gopts o = {.location = "cuda:0", .batches = {64}, .n_batches = 1, .depth = 2,
             .group_bytes = 64ull << 20, .rounds = 4, .kv = 2,
             .n_sizes = 2, .sizes = {65536, 1 << 20}, .ipc = 1, .tcp = 1};
  int rc = parse(&o, argc, argv);
  if (rc != 0)
    return rc;
  if (o.target_location == NULL)
    o.target_location = o.location;
  sx__mem_info rl, tl;
  if (sx__mem_parse_location(o.location, &rl) || sx__mem_parse_location(o.target_location, &tl) ||
      rl.kind != SX__MEM_CUDA || tl.kind != SX__MEM_CUDA) {
    fprintf(stderr, "sx-bench read: --location and --target-location must be cuda:N\n");
    return BX_USAGE;
  }
  uint64_t tensors = o.layers ? o.layers * o.kv : 1;
  run R = {.o = &o, .rng = 0x9E3779B97F4A7C15ull ^ (uint64_t)getpid()};
  for (int g = 0; g < o.n_sizes; g++) {
    R.tblocks[g] = o.group_bytes / o.sizes[g];
    for (int k = 0; k < o.n_batches; k++)
      if (R.tblocks[g] / tensors < o.batches[k] / tensors) {
        fprintf(stderr, "sx-bench read: --group-bytes holds fewer blocks than a request "
                "reads (per tensor)\n");
        return BX_USAGE;
      }
  }
  bx_redis srv = {0};
  char url[600], name[64], host_name[80];
  snprintf(name, sizeof(name), "bench/gpu-%d", (int)getpid());
  snprintf(host_name, sizeof(host_name), "%s-host", name);
  if (o.url == NULL) {
    if (bx_redis_start(&srv) != 0)
      return BX_FAIL;
    snprintf(url, sizeof(url), "redis://127.0.0.1:%d?namespace=sx-bench", srv.port);
  } else {
    snprintf(url, sizeof(url), "%s", o.url);
  }
  pid_t pid = -1;
  int lifeline = -1;
  rc = BX_FAIL;
  bx_report *rep = bx_report_new("read", co);
  bx_table *t = bx_table_add(rep, "read_gpu", "Batched reads of GPU memory between two "
                             "processes, against same-run baselines", cols,
                             (int)(sizeof(cols) / sizeof(cols[0])));
  bx_table_note(t, "reader %s, target %s, %llu requests in flight; a request: %s",
                o.location, o.target_location, (unsigned long long)o.depth,
                o.layers ? "R random blocks in each of layers x kv tensors (the engine "
                           "shape; RANGES/REQ = R x layers x kv)"
                         : "scattered random blocks");
  if (o.layers)
    bx_table_note(t, "engine shape: %llu layers x %llu (K,V) tensors, blocks of %llu bytes",
                  (unsigned long long)o.layers, (unsigned long long)o.kv,
                  (unsigned long long)o.sizes[0]);
  if (o.ipc)
    bx_table_note(t, "cuda_ipc baseline: the same requests gathered by the gather kernel in "
                  "one process (one launch each, %d streams, peer access across GPUs); "
                  "reference row: one cuMemcpyAsync per range over %d streams; the three "
                  "alternate in %llu rounds of equal time", COPY_STREAMS, COPY_STREAMS,
                  (unsigned long long)o.rounds);
  if (o.tcp)
    bx_table_note(t, "tcp baseline: host-memory TCP reads between the same two processes, "
                  "in two halves around each case");
  if (o.rdma)
    bx_table_note(t, "rdma baseline: host-memory RDMA reads between the same two processes, "
                  "in two halves around each case");
  bx_table_note(t, "POSTED US, ENDED US: medians from submit to the transport's post and "
                "to the batch's end on the agent's loop (the rest of P50 is the wake of the "
                "waiting thread)");
  bx_table_note(t, "CALLER CPU US, OTHER CPU US: CPU time per request of the thread that "
                "submits and waits (create, add, submit, wait, destroy), and of the rest of "
                "the reader's process (the agent's loop, the driver's threads), over the "
                "measured window; LOOP CPU US: of that, the agent's own thread (its loop; "
                "x REQ/S = the share of its time it was busy)");
  bx_table_note(t, "COPIES BY: the memory layer's gathers that ran in this process, the "
                "reader (SX_GPU_COPY=%s; staged tcp and rdma: into device memory from the "
                "staging chunks)", sx__mem_copy_name(sx__mem_copy_env()));
  side gs = {0}, hs = {0};
  uint64_t most = 0;
  for (int k = 0; k < o.n_batches; k++)
    most = o.batches[k] > most ? o.batches[k] : most;
  sx_block_read *last = malloc(most * sizeof(*last));
  if (last == NULL || spawn(&o, url, name, &pid, &lifeline) != 0) {
    fprintf(stderr, "sx-bench read: the GPU target did not start\n");
    goto out;
  }
  if (o.ipc) {
    if (side_open(&gs, &o, url, SX_TRANSPORTS_CUDA_IPC, o.location, name) != 0)
      goto out;
    for (int g = 0; g < o.n_sizes; g++) {
      for (int k = 0; k < o.n_batches; k++) {
        o.batch = o.batches[k];
        bx_progress("cuda_ipc, %llu-byte blocks, %llu per request",
                    (unsigned long long)o.sizes[g], (unsigned long long)o.batch);
        /* The copy rate drifts by 20% and more over a second or so, for any
         * user: the three alternate in rounds of equal time, so that a slow
         * spell weighs on all. */
        macc v = {0}, kb = {0}, cb = {0};
        double slice = co->duration / (double)o.rounds;
        int ok = 1;
        for (uint64_t r = 0; r < o.rounds && ok; r++)
          ok = base_copy(&R, g, tl.device, rl.device, slice, SX__COPY_KERNEL, &kb) == 0 &&
               measure(&R, gs.a, gs.seg, g, slice, &v) == 0 &&
               base_copy(&R, g, tl.device, rl.device, slice / 2, SX__COPY_RANGE, &cb) == 0;
        mres mv = macc_result(&v), mk = macc_result(&kb), mc = macc_result(&cb);
        if (!ok || check(&R, gs.seg, g, gs.mem[g], last) != 0)
          goto out;
        row(t, "cuda_ipc", "gpu->gpu", o.sizes[g], o.batch, &mv, NULL, "gather kernel, 1 proc",
            mk.gbps);
        row(t, "one process", "gather kernel", o.sizes[g], o.batch, &mk, NULL, NULL, 0);
        row(t, "one process", "cuMemcpyAsync/range", o.sizes[g], o.batch, &mc, "range", NULL, 0);
        judge(rep, "cuda_ipc", o.sizes[g], o.batch, "vs the gather kernel in one process",
              mv.gbps / mk.gbps, "x", ">=", 0.9, "GB/s ratio, same run");
        judge(rep, "cuda_ipc", o.sizes[g], o.batch, "p99 per request", mv.p99_ms / mv.p50_ms,
              "x p50", "<=", 2.0, "submit to end");
      }
    }
    side_close(&gs, o.n_sizes);
    gs.a = NULL;
  }
  if (o.tcp) {
    if (side_open(&gs, &o, url, SX_TRANSPORTS_TCP, o.location, name) != 0 ||
        side_open(&hs, &o, url, SX_TRANSPORTS_TCP, "cpu", host_name) != 0 ||
        staged_vs_host(&R, &o, t, rep, co->duration, &gs, &hs, "tcp", last) != 0)
      goto out;
  }
  if (o.rdma) { /* alone: --transport rdma runs nothing else */
    if (side_open(&gs, &o, url, SX_TRANSPORTS_RDMA, o.location, name) != 0 ||
        side_open(&hs, &o, url, SX_TRANSPORTS_RDMA, "cpu", host_name) != 0 ||
        staged_vs_host(&R, &o, t, rep, co->duration, &gs, &hs, "rdma", last) != 0)
      goto out;
  }
  rc = BX_OK;
out:
  bx_progress_end();
  if (gs.a != NULL)
    side_close(&gs, o.n_sizes);
  if (hs.a != NULL)
    side_close(&hs, o.n_sizes);
  if (lifeline >= 0)
    close(lifeline);
  if (pid > 0)
    waitpid(pid, NULL, 0);
  free(last);
  bx_redis_stop(&srv);
  if (rc == BX_OK && bx_report_emit(rep, NULL) != 0)
    rc = BX_FAIL;
  bx_report_free(rep);
  return rc;
}
