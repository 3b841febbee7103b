/*
 * sx-bench read --location cuda:N: batched reads of GPU memory between two
 * processes, each figure next to a baseline measured in the same run:
 *
 *   cuda_ipc  device-to-device reads from the target's GPU pool, against a
 *             plain device-to-device copy of the same ranges between the
 *             same GPUs (cuMemcpyAsync on as many streams, as many batches
 *             in flight), made by this process: the copy engine's limit.
 *   tcp       GPU -> GPU through pinned staging on both sides, against
 *             host-memory TCP reads between the same two processes (the
 *             target hosts the same pool in host memory as a second
 *             segment), alternating in halves around each case.
 *
 * This process is the reader; it starts `sx-bench gpu-target` (below) on
 * the target device.  Every case ends with one batch whose every byte is
 * checked against the fill pattern (copied back from the GPU).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "mem/mem.h"
#include "pattern.h"
#include "segxfer/agent.h"

#define MAX_SIZES 8
#define COPY_STREAMS 4 /* as many as the cuda_ipc transport uses per device */
#define IPC_ROUNDS 4   /* cuda_ipc and its baseline alternate this many times */
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
  uint64_t batch, depth, group_bytes;
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

/* Scattered ids: batch distinct random remote blocks into local slot k. */
static void entries(run *R, int g, uint64_t k, sx_block_read *e) {
  const gopts *o = R->o;
  uint64_t n = R->tblocks[g];
  for (uint64_t i = 0; i < o->batch; i++) {
    uint64_t b = next(R) % n;
    e[i] = (sx_block_read){.group = (uint32_t)g, .layer_count = 1, .slots = 1,
                           .remote_block = b, .local_block = k * o->batch + i, .count = 1};
  }
}

/* Reads for secs with depth batches in flight: GB/s, or -1. */
static double measure(run *R, sx_segment *seg, int g, double secs) {
  const gopts *o = R->o;
  uint64_t size = o->sizes[g], bytes = 0;
  sx_batch *b[64] = {0};
  sx_block_read *e = malloc(o->batch * sizeof(*e));
  double t0 = 0, t_end = 0;
  int ok = e != NULL, warm = 0;
  uint64_t k = 0;
  for (double start = bx_now(); ok;) {
    uint64_t slot = k % o->depth;
    if (b[slot] != NULL) {
      sx_batch_result res;
      sx_batch_wait(b[slot], -1);
      sx_batch_result_get(b[slot], &res);
      sx_batch_destroy(b[slot]);
      b[slot] = NULL;
      if (res.state != SX_BATCH_COMPLETED) {
        fprintf(stderr, "sx-bench: batch: %s\n", res.message);
        ok = 0;
        break;
      }
      if (warm)
        bytes += o->batch * size;
      double now = bx_now();
      if (!warm && now - start > secs / 5) {
        warm = 1;
        t0 = now;
      } else if (warm && now - t0 >= secs) {
        t_end = now;
        break;
      }
    }
    entries(R, g, slot, e);
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
  return ok && t_end > t0 ? (double)bytes / (t_end - t0) / 1e9 : -1;
}

/* The baseline of cuda_ipc: the same scattered ranges copied device to
 * device (src on the target's GPU, dst on ours) by this process, depth
 * batches in flight over COPY_STREAMS streams: GB/s, or -1. */
static double plain_copy(run *R, int g, int sdev, int ddev, double secs) {
  const gopts *o = R->o;
  uint64_t size = o->sizes[g], n = R->tblocks[g], bytes = 0;
  uint8_t *src = NULL, *dst = NULL;
  sx__mem_stream *s[COPY_STREAMS] = {0};
  double rate = -1;
  if (sx__mem_alloc(sdev, n * size, (void **)&src) != 0 ||
      sx__mem_alloc(ddev, o->batch * o->depth * size, (void **)&dst) != 0)
    goto out;
  for (int i = 0; i < COPY_STREAMS; i++)
    if (sx__mem_stream_create(ddev, &s[i]) != 0)
      goto out;
  double t0 = 0, start = bx_now();
  int warm = 0;
  for (uint64_t k = 0;; k++) {
    uint64_t slot = k % o->depth;
    for (uint64_t i = 0; i < o->batch; i++) {
      uint64_t b = next(R) % n;
      if (sx__mem_copy_async(s[i % COPY_STREAMS], dst + (slot * o->batch + i) * size,
                             src + b * size, size) != 0)
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
    } else if (warm && now - t0 >= secs) {
      rate = (double)bytes / (now - t0) / 1e9;
      break;
    }
  }
out:
  for (int i = 0; i < COPY_STREAMS; i++)
    sx__mem_stream_destroy(s[i]);
  sx__mem_free(src);
  sx__mem_free(dst);
  if (rate < 0)
    fprintf(stderr, "sx-bench: plain copy: %s\n", sx_errmsg());
  return rate;
}

/* One more batch, run to its end, every byte checked against the
 * pattern (copied back from the GPU). */
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
  for (int g = 0; g < o->n_sizes; g++)
    blocks[g] = o->batch * o->depth;
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
    {"batch", "BATCH", "%.0f"},       {"gb_s", "GB/S", "%.2f"},
    {"baseline", "BASELINE", NULL},   {"baseline_gb_s", "BASELINE GB/S", "%.2f"},
    {"ratio", "VS BASELINE", "%.2fx"},
};

static void row(bx_table *t, const char *tr, const char *path, uint64_t size,
                uint64_t batch, double v, const char *bname, double base) {
  char b[16];
  bx_row *r = bx_row_add(t);
  bx_set_str(r, "transport", "%s", tr);
  bx_set_str(r, "path", "%s", path);
  bx_set_str(r, "block", "%s", bx_size_name(size, b, sizeof(b)));
  bx_set_num(r, "batch", (double)batch);
  bx_set_num(r, "gb_s", v);
  bx_set_str(r, "baseline", "%s", bname);
  bx_set_num(r, "baseline_gb_s", base);
  bx_set_num(r, "ratio", v / base);
}

static int spawn(const gopts *o, const char *url, const char *name, pid_t *pid, int *lifeline) {
  int in[2], out[2];
  char sizes[256] = "", gb[32], b[16];
  for (int g = 0; g < o->n_sizes; g++)
    snprintf(sizes + strlen(sizes), sizeof(sizes) - strlen(sizes), "%s%s", g ? "," : "",
             bx_size_name(o->sizes[g], b, sizeof(b)));
  snprintf(gb, sizeof(gb), "%llu", (unsigned long long)o->group_bytes);
  if (pipe(in) != 0 || pipe(out) != 0)
    return -1;
  fflush(NULL);
  if ((*pid = fork()) == 0) {
    dup2(in[0], STDIN_FILENO);
    dup2(out[1], STDOUT_FILENO);
    close(in[1]);
    close(out[0]);
    execl("/proc/self/exe", "sx-bench", "gpu-target", "--metadata", url, "--name", name,
          "--location", o->target_location, "--sizes", sizes, "--group-bytes", gb,
          (char *)NULL);
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  *lifeline = in[1];
  char line[16] = "";
  ssize_t n = read(out[0], line, sizeof(line) - 1);
  close(out[0]);
  return n > 0 && strncmp(line, "ready", 5) == 0 ? 0 : -1;
}

/* Staged GPU->GPU reads over transport tr (gs) against host-memory reads
 * over the same transport between the same processes (hs), measured in two
 * halves around each case; judged[g] gets the ratio.  0, or -1. */
static int staged_vs_host(run *R, bx_table *t, double secs, side *gs, side *hs, const char *tr,
                          sx_block_read *last, double *judged) {
  const gopts *o = R->o;
  char host[16];
  snprintf(host, sizeof(host), "host %s", tr);
  for (int g = 0; g < o->n_sizes; g++) {
    bx_progress("%s staged, %llu-byte blocks", tr, (unsigned long long)o->sizes[g]);
    double b1 = measure(R, hs->seg, g, secs / 2);
    double v = measure(R, gs->seg, g, secs);
    int ok = v >= 0 && check(R, gs->seg, g, gs->mem[g], last) == 0;
    double b2 = measure(R, hs->seg, g, secs / 2);
    if (!ok || b1 < 0 || b2 < 0 || check(R, hs->seg, g, hs->mem[g], last) != 0)
      return -1;
    row(t, tr, "gpu->gpu staged", o->sizes[g], o->batch, v, host, (b1 + b2) / 2);
    judged[g] = v / ((b1 + b2) / 2);
  }
  return 0;
}

int bx_read_gpu_main(const bx_common *co, int argc, char **argv) {
  gopts o = {.location = "cuda:0", .batch = 64, .depth = 2, .group_bytes = 64ull << 20,
             .n_sizes = 2, .sizes = {65536, 1 << 20}, .ipc = 1, .tcp = 1};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    int ok = v != NULL;
    if (strcmp(a, "--location") == 0 && ok)
      o.location = v;
    else if (strcmp(a, "--target-location") == 0 && ok)
      o.target_location = v;
    else if (strcmp(a, "--metadata") == 0 && ok)
      o.url = v;
    else if (strcmp(a, "--sizes") == 0 && ok)
      ok = (o.n_sizes = bx_parse_list(v, o.sizes, MAX_SIZES, 1)) > 0;
    else if (strcmp(a, "--batches") == 0 && ok)
      ok = bx_parse_list(v, &o.batch, 1, 0) == 1;
    else if (strcmp(a, "--depth") == 0 && ok)
      ok = bx_parse_list(v, &o.depth, 1, 0) == 1 && o.depth >= 1 && o.depth <= 64;
    else if (strcmp(a, "--group-bytes") == 0 && ok)
      ok = bx_parse_size(v, &o.group_bytes) == 0;
    else if (strcmp(a, "--transport") == 0 && ok) {
      o.ipc = strcmp(v, "cuda_ipc") == 0 || strcmp(v, "auto") == 0;
      o.tcp = strcmp(v, "tcp") == 0 || strcmp(v, "auto") == 0;
      o.rdma = strcmp(v, "rdma") == 0; /* staged RDMA, against host-memory RDMA */
      ok = o.ipc || o.tcp || o.rdma;
    } else
      ok = 0;
    if (!ok) {
      fprintf(stderr, "sx-bench read (GPU): bad option '%s'; GPU reads take --location, "
              "--target-location, --transport cuda_ipc|tcp|rdma|auto, --sizes, --batches N, "
              "--depth, --group-bytes, --metadata\n", a);
      return BX_USAGE;
    }
    i++;
  }
  if (o.target_location == NULL)
    o.target_location = o.location;
  sx__mem_info rl, tl;
  if (sx__mem_parse_location(o.location, &rl) || sx__mem_parse_location(o.target_location, &tl) ||
      rl.kind != SX__MEM_CUDA || tl.kind != SX__MEM_CUDA) {
    fprintf(stderr, "sx-bench read: --location and --target-location must be cuda:N\n");
    return BX_USAGE;
  }
  run R = {.o = &o, .rng = 0x9E3779B97F4A7C15ull ^ (uint64_t)getpid()};
  for (int g = 0; g < o.n_sizes; g++) {
    R.tblocks[g] = o.group_bytes / o.sizes[g];
    if (R.tblocks[g] < o.batch) {
      fprintf(stderr, "sx-bench read: --group-bytes holds fewer than --batches blocks\n");
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
  int lifeline = -1, rc = BX_FAIL;
  bx_report *rep = bx_report_new("read", co);
  bx_table *t = bx_table_add(rep, "read_gpu", "Batched reads of GPU memory between two "
                             "processes, against same-run baselines", cols,
                             (int)(sizeof(cols) / sizeof(cols[0])));
  bx_table_note(t, "reader %s, target %s, scattered ids, %llu batches in flight",
                o.location, o.target_location, (unsigned long long)o.depth);
  bx_table_note(t, "cuda_ipc baseline: the same ranges copied device to device by one "
                "process (cuMemcpyAsync, %d streams), alternating with cuda_ipc in %d "
                "slices each", COPY_STREAMS, IPC_ROUNDS);
  bx_table_note(t, "tcp baseline: host-memory TCP reads between the same two processes, "
                "in two halves around each case");
  double judged[3][MAX_SIZES];
  side gs = {0}, hs = {0};
  sx_block_read *last = malloc(o.batch * sizeof(*last));
  if (last == NULL || spawn(&o, url, name, &pid, &lifeline) != 0) {
    fprintf(stderr, "sx-bench read: the GPU target did not start\n");
    goto out;
  }
  for (int g = 0; g < o.n_sizes; g++)
    judged[0][g] = judged[1][g] = judged[2][g] = -1;
  if (o.ipc) {
    if (side_open(&gs, &o, url, SX_TRANSPORTS_CUDA_IPC, o.location, name) != 0)
      goto out;
    for (int g = 0; g < o.n_sizes; g++) {
      bx_progress("cuda_ipc, %llu-byte blocks", (unsigned long long)o.sizes[g]);
      /* The copy engine's rate drifts by 20% and more over a second or so,
       * for any user: the two alternate in IPC_ROUNDS slices of equal time,
       * so that a slow spell weighs on both. */
      double base = 0, v = 0, slice = co->duration / IPC_ROUNDS;
      for (int k = 0; k < IPC_ROUNDS && base >= 0 && v >= 0; k++) {
        double b1 = plain_copy(&R, g, tl.device, rl.device, slice);
        double v1 = measure(&R, gs.seg, g, slice);
        base = b1 < 0 ? -1 : base + b1 / IPC_ROUNDS;
        v = v1 < 0 ? -1 : v + v1 / IPC_ROUNDS;
      }
      if (v < 0 || base < 0 || check(&R, gs.seg, g, gs.mem[g], last) != 0)
        goto out;
      row(t, "cuda_ipc", "gpu->gpu", o.sizes[g], o.batch, v, "plain D2D copy", base);
      judged[0][g] = v / base;
    }
    side_close(&gs, o.n_sizes);
    gs.a = NULL;
  }
  if (o.tcp) {
    if (side_open(&gs, &o, url, SX_TRANSPORTS_TCP, o.location, name) != 0 ||
        side_open(&hs, &o, url, SX_TRANSPORTS_TCP, "cpu", host_name) != 0)
      goto out;
    if (staged_vs_host(&R, t, co->duration, &gs, &hs, "tcp", last, judged[1]) != 0)
      goto out;
  }
  if (o.rdma) { /* alone: --transport rdma runs nothing else */
    if (side_open(&gs, &o, url, SX_TRANSPORTS_RDMA, o.location, name) != 0 ||
        side_open(&hs, &o, url, SX_TRANSPORTS_RDMA, "cpu", host_name) != 0)
      goto out;
    bx_table_note(t, "rdma baseline: host-memory RDMA reads between the same two processes, "
                  "in two halves around each case");
    if (staged_vs_host(&R, t, co->duration, &gs, &hs, "rdma", last, judged[2]) != 0)
      goto out;
  }
  for (int g = 0; g < o.n_sizes; g++) {
    char what[160], b[16];
    const char *sz = bx_size_name(o.sizes[g], b, sizeof(b));
    if ((o.sizes[g] == 65536 || o.sizes[g] == (1u << 20)) && judged[0][g] >= 0) {
      snprintf(what, sizeof(what), "cuda_ipc, %s blocks, vs plain D2D copy", sz);
      bx_target(rep, what, judged[0][g], "x", ">=", 0.8, "GB/s ratio, same run, scattered ids");
    }
    if (o.sizes[g] == (1u << 20) && judged[1][g] >= 0) {
      snprintf(what, sizeof(what), "tcp staged GPU->GPU, %s blocks, vs host tcp", sz);
      bx_target(rep, what, judged[1][g], "x", ">=", 0.7, "GB/s ratio, same run");
    }
    if ((o.sizes[g] == 32768 || o.sizes[g] == (1u << 20)) && judged[2][g] >= 0) {
      snprintf(what, sizeof(what), "rdma staged GPU->GPU, %s blocks, vs host rdma", sz);
      bx_target(rep, what, judged[2][g], "x", ">=", o.sizes[g] == 32768 ? 0.6 : 0.8,
                "GB/s ratio, same run, scattered ids");
    }
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
