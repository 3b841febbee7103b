/*
 * sx-bench plan: reading through a read plan against reading equal layouts,
 * on the same bytes in the same run.
 *
 * Three agents in this process serve over TCP on loopback (a mem:// store
 * between them): "full" holds every KV head, "tp0" and "tp1" half of them
 * each (a TP=2 prefill).  One reader with every head reads the same
 * request (--batch blocks, scattered ids, every layer, K and V) three ways,
 * round after round so the machine's drift falls on all alike:
 *   equal   sx_batch_add_blocks from "full": the ordinary path (baseline)
 *   whole   a set of "full" alone through sx_group_read (the plan path with
 *           one piece per block)
 *   tp2     the set {tp0, tp1} through sx_group_read: the TP=2 -> TP=1 plan
 * The first read of each case is compared with the source byte for byte,
 * so every figure is of bytes that arrive right.  With --depth N, N threads
 * read at once, each through its own sets into its own blocks (an engine
 * loading several requests).  The target: tp2 at >= 0.8x equal.
 *
 * With --location cuda:N every pool is GPU memory and the sources live in
 * a child process (`sx-bench plan-target`, a Redis store between them),
 * because cuda_ipc reads another process's memory: the reader reads over
 * cuda_ipc, or with --transport tcp over TCP through its staging.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "mem/mem.h"
#include "segxfer.h"

const char bx_plan_help[] =
    "usage: sx-bench plan [--order HND|NHD] [--tokens N] [--heads N] [--head-dim N]\n"
    "                     [--layers N] [--batch N] [--depth N] [--rounds N]\n"
    "                     [--location cpu|cuda:N]\n"
    "                     [--transport cuda_ipc|tcp] [--metadata URL] [common options]\n"
    "\n"
    "Read one request's blocks from a TP=2 prefill (two segments, half the KV\n"
    "heads each) into a reader with every head, through the read plan, against\n"
    "the same bytes read from one segment with the reader's own layout (the\n"
    "ordinary block path, the baseline) and through the plan path with one piece\n"
    "per block.  Agents in this process, TCP on loopback.  Every read is checked\n"
    "byte for byte.  --duration is the time of each case in each round.\n"
    "\n"
    "  --order HND|NHD  the cache order on every side (default HND: head slices;\n"
    "                   NHD cuts a piece per token and rank)\n"
    "  --tokens N       tokens per block (default 16)\n"
    "  --heads N        KV heads of the model (default 8)\n"
    "  --head-dim N     (default 128; bf16)\n"
    "  --layers N       (default 8)\n"
    "  --batch N        blocks per read (default 64)\n"
    "  --depth N        reads in flight, each from a thread of its own (its own\n"
    "                   sets, its own blocks on both sides; default 1; depth x\n"
    "                   batch <= 256)\n"
    "  --rounds N       rounds of the three cases (default 3)\n"
    "  --location L     where every pool is: cpu (default: agents in this process,\n"
    "                   TCP) or cuda:N (the sources in a child process; the reader\n"
    "                   reads over --transport, default cuda_ipc)\n"
    "  --transport T    with cuda:N: cuda_ipc, or tcp (through TCP staging)\n"
    "  --metadata URL   with cuda:N: the store (default: a redis-server started\n"
    "                   for the run)\n"
    "\n"
    "target: the TP=2 -> TP=1 plan at >= 0.8x the equal-layout rate.\n";

enum { BLOCKS = 256 };

typedef struct side {
  sx_agent *a;
  uint8_t *mem[2];
  uint64_t bb;
  int device; /* of mem; -1 host */
} side;

typedef struct cfg {
  sx_kv_order order;
  uint32_t tokens, heads, head_dim, layers, batch, depth, rounds;
  const char *location; /* "cpu" or "cuda:N" */
  int device;           /* N, or -1 */
  int tcp;              /* cuda:N read over TCP staging instead of cuda_ipc */
  const char *url;      /* --metadata */
} cfg;

static void quiet(void *arg, sx_log_level level, const char *msg) {
  (void)arg;
  if (level <= SX_LOG_WARN)
    fprintf(stderr, "sx-bench plan: agent: %s\n", msg);
}

static uint64_t side_len(const side *s, const cfg *c) {
  return (uint64_t)c->layers * BLOCKS * s->bb;
}

static int side_start(side *s, const cfg *c, const char *url, const char *name,
                      uint32_t first, uint32_t count, uint32_t rank, uint32_t size) {
  sx_agent_params p;
  sx_agent_params_init(&p);
  p.name = name;
  p.metadata_url = url;
  /* Sources serve both; a GPU reader reads over the one asked for. */
  p.transports = c->device < 0 ? SX_TRANSPORTS_TCP
                 : name        ? SX_TRANSPORTS_TCP | SX_TRANSPORTS_CUDA_IPC
                 : c->tcp      ? SX_TRANSPORTS_TCP
                               : SX_TRANSPORTS_CUDA_IPC;
  p.listen = name ? "127.0.0.1:0" : NULL;
  p.log = quiet;
  p.log_level = SX_LOG_WARN;
  bx_bench_layout(&p.layout);
  p.layout.tp_rank = rank;
  p.layout.tp_size = size;
  p.layout.n_blocks = 1;
  p.layout.blocks[0] = (sx_block_desc){.order = c->order, .tokens = c->tokens,
                                       .head_first = first, .head_count = count,
                                       .heads_total = c->heads, .head_dim = c->head_dim};
  snprintf(p.layout.blocks[0].dtype, sizeof(p.layout.blocks[0].dtype), "bf16");
  if (sx_agent_create(&p, &s->a))
    return -1;
  s->bb = (uint64_t)c->tokens * count * c->head_dim * 2;
  s->device = c->device;
  for (uint32_t k = 0; k < 2; k++) {
    uint64_t len = side_len(s, c);
    uint32_t id;
    if (s->device >= 0 ? sx__mem_alloc(s->device, len, (void **)&s->mem[k]) != 0
                       : (s->mem[k] = calloc(1, len)) == NULL)
      return -1;
    sx_region_params rp = {.addr = s->mem[k], .length = len, .layer_count = c->layers,
                           .layer_stride = BLOCKS * s->bb, .slot = k,
                           .block_bytes = s->bb, .num_blocks = BLOCKS,
                           .location = c->location, .access = SX_ACCESS_REMOTE_READ};
    if (sx_agent_register(s->a, &rp, &id))
      return -1;
  }
  return name ? sx_agent_publish(s->a, 0) : 0;
}

static void side_stop(side *s) {
  sx_agent_destroy(s->a);
  for (int k = 0; k < 2; k++)
    s->device >= 0 ? sx__mem_free(s->mem[k]) : free(s->mem[k]);
}

/* Byte b of element (t, h, e) of a block: the same on every side. */
static uint8_t val(uint32_t k, uint64_t layer, uint64_t block, uint64_t t, uint64_t h,
                   uint64_t e) {
  return (uint8_t)(k * 131 + layer * 31 + block * 7 + t * 5 + h * 3 + e);
}

static uint64_t at(const cfg *c, uint32_t count, uint32_t first, uint64_t t, uint64_t h) {
  uint64_t hh = h - first, hd = (uint64_t)c->head_dim * 2;
  return c->order == SX_KV_HND ? (hh * c->tokens + t) * hd : (t * count + hh) * hd;
}

/* Fill a side's heads [first, first+count) with val(): in place, or on a
 * GPU through a host copy.  0 or -1 (said). */
static int fill(side *s, const cfg *c, uint32_t first, uint32_t count) {
  uint64_t len = side_len(s, c);
  uint8_t *h = s->device >= 0 ? malloc(len) : NULL;
  if (s->device >= 0 && h == NULL)
    return -1;
  for (uint32_t k = 0; k < 2; k++) {
    uint8_t *m = h ? h : s->mem[k];
    for (uint64_t l = 0; l < c->layers; l++)
      for (uint64_t b = 0; b < BLOCKS; b++) {
        uint8_t *blk = m + (l * BLOCKS + b) * s->bb;
        for (uint64_t t = 0; t < c->tokens; t++)
          for (uint64_t hd = first; hd < first + count; hd++)
            for (uint64_t e = 0; e < (uint64_t)c->head_dim * 2; e++)
              blk[at(c, count, first, t, hd) + e] = val(k, l, b, t, hd, e);
      }
    if (h != NULL && sx__mem_copy(s->mem[k], h, len) != 0) {
      fprintf(stderr, "sx-bench plan: filling GPU memory: %s\n", sx_errmsg());
      free(h);
      return -1;
    }
  }
  free(h);
  return 0;
}

/* The reader's blocks lb[i] hold the sources' blocks rb[i] (GPU memory is
 * looked at in host, a copy of it). */
static int verify(const side *r, const cfg *c, const uint64_t *rb, const uint64_t *lb,
                  uint8_t *host) {
  for (uint32_t k = 0; k < 2; k++) {
    const uint8_t *m = r->mem[k];
    if (r->device >= 0) {
      if (sx__mem_copy(host, m, side_len(r, c)) != 0)
        return -1;
      m = host;
    }
    for (uint64_t l = 0; l < c->layers; l++)
      for (uint32_t i = 0; i < c->batch; i++) {
        const uint8_t *blk = m + (l * BLOCKS + lb[i]) * r->bb;
        for (uint64_t t = 0; t < c->tokens; t++)
          for (uint64_t h = 0; h < c->heads; h++)
            for (uint64_t e = 0; e < (uint64_t)c->head_dim * 2; e++)
              if (blk[at(c, c->heads, 0, t, h) + e] != val(k, l, rb[i], t, h, e))
                return -1;
      }
  }
  return 0;
}

/* Zeros over the reader's blocks before a case (host: a zeroed copy). */
static int clear(side *r, const cfg *c, uint8_t *host) {
  for (uint32_t k = 0; k < 2; k++) {
    if (r->device < 0) {
      memset(r->mem[k], 0, side_len(r, c));
      continue;
    }
    memset(host, 0, side_len(r, c));
    if (sx__mem_copy(r->mem[k], host, side_len(r, c)) != 0)
      return -1;
  }
  return 0;
}

typedef enum { EQUAL, WHOLE, TP2, CASES } kase;

/* The calling thread's CPU time, seconds. */
static double thread_cpu(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Read the request once the case's way; 0 or -1 (said). */
static int read_once(kase k, sx_segment *full, sx_group *whole, sx_group *tp2, const cfg *c,
                     const uint64_t *rb, const uint64_t *lb) {
  if (k == EQUAL) {
    sx_block_read e[BLOCKS];
    for (uint32_t i = 0; i < c->batch; i++)
      e[i] = (sx_block_read){.layer_count = c->layers, .slots = 3, .remote_block = rb[i],
                             .local_block = lb[i], .count = 1};
    sx_batch *b;
    sx_batch_result r;
    if (sx_batch_create(full, NULL, &b) || sx_batch_add_blocks(b, e, c->batch) ||
        sx_batch_submit(b) || sx_batch_wait(b, -1) || sx_batch_result_get(b, &r)) {
      fprintf(stderr, "sx-bench plan: equal read: %s\n", sx_errmsg());
      return -1;
    }
    sx_batch_destroy(b);
    if (r.state != SX_BATCH_COMPLETED) {
      fprintf(stderr, "sx-bench plan: equal read: %s\n", r.message);
      return -1;
    }
    return 0;
  }
  sx_group_result r;
  if (sx_group_read(k == WHOLE ? whole : tp2, rb, c->batch, lb, c->batch, 30000, &r)) {
    fprintf(stderr, "sx-bench plan: set read: %s\n", sx_errmsg());
    return -1;
  }
  if (r.state != SX_BATCH_COMPLETED) {
    fprintf(stderr, "sx-bench plan: set read: %s\n", r.message);
    return -1;
  }
  return 0;
}

enum { DEPTH_MAX = BLOCKS };

/* One of --depth readers: its own sets and its own blocks on both sides
 * (rb, lb: --batch of them), reading one request after another. */
typedef struct worker {
  kase k;
  sx_segment *seg;
  sx_group *whole, *tp2;
  const cfg *c;
  const uint64_t *rb, *lb;
  double until;     /* bx_now() to stop at */
  uint64_t n;       /* reads done */
  double cpu;       /* its thread's CPU seconds */
  int rc;
  pthread_t tid;
} worker;

static void *worker_main(void *arg) {
  worker *w = arg;
  double k0 = thread_cpu();
  do {
    if ((w->rc = read_once(w->k, w->seg, w->whole, w->tp2, w->c, w->rb, w->lb)) != 0)
      break;
    w->n++;
  } while (bx_now() < w->until);
  w->cpu = thread_cpu() - k0;
  return NULL;
}

/* Run the case on every worker at once for duration seconds (the first on
 * this thread); 0, or -1 when a read failed (said). */
static int run_workers(worker *w, uint32_t depth, kase k, double duration) {
  double until = bx_now() + duration;
  uint32_t started = 1;
  for (uint32_t i = 0; i < depth; i++)
    w[i].k = k, w[i].until = until, w[i].n = 0, w[i].rc = 0;
  for (; started < depth; started++)
    if (pthread_create(&w[started].tid, NULL, worker_main, &w[started]) != 0) {
      fprintf(stderr, "sx-bench plan: cannot start a reading thread\n");
      w[0].rc = -1;
      break;
    }
  if (w[0].rc == 0)
    worker_main(&w[0]);
  int rc = w[0].rc;
  for (uint32_t i = 1; i < started; i++) {
    pthread_join(w[i].tid, NULL);
    rc |= w[i].rc;
  }
  return rc ? -1 : 0;
}

static int parse(cfg *c, int argc, char **argv) {
  int i = 1;
  for (; i < argc; i++) {
    uint64_t v = 0;
    const char *a = argv[i];
    if (strcmp(a, "--order") == 0 && i + 1 < argc) {
      a = argv[++i];
      if (strcmp(a, "HND") && strcmp(a, "NHD"))
        goto bad;
      c->order = strcmp(a, "HND") == 0 ? SX_KV_HND : SX_KV_NHD;
      continue;
    }
    const char **str = strcmp(a, "--location") == 0   ? &c->location
                       : strcmp(a, "--metadata") == 0 ? &c->url
                                                      : NULL;
    if (str != NULL && i + 1 < argc) {
      *str = argv[++i];
      continue;
    }
    if (strcmp(a, "--transport") == 0 && i + 1 < argc) {
      a = argv[++i];
      if (strcmp(a, "tcp") && strcmp(a, "cuda_ipc"))
        goto bad;
      c->tcp = strcmp(a, "tcp") == 0;
      continue;
    }
    uint32_t *dst = strcmp(a, "--tokens") == 0 ? &c->tokens
                    : strcmp(a, "--heads") == 0 ? &c->heads
                    : strcmp(a, "--head-dim") == 0 ? &c->head_dim
                    : strcmp(a, "--layers") == 0 ? &c->layers
                    : strcmp(a, "--batch") == 0 ? &c->batch
                    : strcmp(a, "--depth") == 0 ? &c->depth
                    : strcmp(a, "--rounds") == 0 ? &c->rounds : NULL;
    if (dst == NULL || i + 1 >= argc || bx_parse_size(argv[++i], &v) || v == 0 ||
        v > 65536)
      goto bad;
    *dst = (uint32_t)v;
  }
  if (c->heads % 2 || (uint64_t)c->batch * c->depth > BLOCKS || c->layers > 64 ||
      c->heads > 256 || (uint64_t)c->tokens * c->heads * c->head_dim * 2 > (4u << 20)) {
    fprintf(stderr, "sx-bench plan: heads must be even, depth x batch <= %d, layers <= 64, "
            "heads <= 256 and a block at most 4 MiB\n", BLOCKS);
    return BX_USAGE;
  }
  sx__mem_info m;
  if (sx__mem_parse_location(c->location, &m) != 0) {
    fprintf(stderr, "sx-bench plan: --location: %s\n", sx_errmsg());
    return BX_USAGE;
  }
  c->device = m.kind == SX__MEM_CUDA ? m.device : -1;
  return 0;
bad:
  fprintf(stderr, "sx-bench plan: bad option near '%s' (sx-bench plan --help)\n",
          argv[i < argc ? i : argc - 1]);
  return BX_USAGE;
}

#define CFG_DEFAULT {SX_KV_HND, 16, 8, 128, 8, 64, 1, 3, "cpu", -1, 0, NULL}

/* The three sources (full, tp0, tp1), filled and published: 0 or -1. */
static int sources_start(side src[3], const cfg *c, const char *url) {
  uint32_t half = c->heads / 2;
  if (side_start(&src[0], c, url, "bench/full", 0, c->heads, 0, 1) ||
      side_start(&src[1], c, url, "bench/pf/tp0", 0, half, 0, 2) ||
      side_start(&src[2], c, url, "bench/pf/tp1", half, half, 1, 2)) {
    fprintf(stderr, "sx-bench plan: starting the sources: %s\n", sx_errmsg());
    return -1;
  }
  return fill(&src[0], c, 0, c->heads) || fill(&src[1], c, 0, half) ||
                 fill(&src[2], c, half, half)
             ? -1
             : 0;
}

static void sources_stop(side src[3]) {
  for (int i = 2; i >= 0; i--)
    if (src[i].a)
      side_stop(&src[i]);
}

const char bx_plan_target_help[] =
    "usage: sx-bench plan-target --metadata URL --location cuda:N [plan options]\n"
    "\n"
    "The sources of `sx-bench plan --location cuda:N`, which starts it: GPU pools\n"
    "in a process of their own (cuda_ipc reads another process's memory); says\n"
    "\"ready\" once published and runs until its standard input closes.\n";

int bx_plan_target_main(const bx_common *o, int argc, char **argv) {
  cfg c = CFG_DEFAULT;
  (void)o;
  int rc = parse(&c, argc, argv);
  if (rc)
    return rc;
  if (c.url == NULL) {
    fputs(bx_plan_target_help, stderr);
    return BX_USAGE;
  }
  side src[3];
  memset(src, 0, sizeof(src));
  rc = sources_start(src, &c, c.url) == 0 ? BX_OK : BX_FAIL;
  if (rc == BX_OK) {
    printf("ready\n");
    fflush(stdout);
    char buf[64];
    while (read(STDIN_FILENO, buf, sizeof(buf)) > 0) {
    }
  }
  sources_stop(src);
  return rc;
}

/* Start plan-target with this run's options and the store url; wait for its
 * "ready".  Its standard input (*lifeline) ends it when closed.  0 or -1. */
static int spawn(int argc, char **argv, const char *url, pid_t *pid, int *lifeline) {
  const char **args = calloc((size_t)argc + 4, sizeof(*args));
  char line[16];
  if (args == NULL)
    return -1;
  int n = 0;
  args[n++] = "sx-bench";
  args[n++] = "plan-target";
  for (int i = 1; i < argc; i++)
    args[n++] = argv[i];
  args[n++] = "--metadata"; /* last: it wins over one given */
  args[n++] = url;
  int rc = bx_spawn(args, pid, lifeline, line, sizeof(line));
  free(args);
  if (rc == 0 && strncmp(line, "ready", 5) == 0)
    return 0;
  fprintf(stderr, "sx-bench plan: the sources' process (plan-target) did not start\n");
  return -1;
}

int bx_plan_main(const bx_common *o, int argc, char **argv) {
  cfg c = CFG_DEFAULT;
  int rc = parse(&c, argc, argv);
  if (rc)
    return rc;
  char url[600];
  bx_redis srv = {0};
  pid_t pid = -1;
  int lifeline = -1;
  if (c.device < 0) {
    snprintf(url, sizeof(url), "mem://sx-bench-plan-%d", (int)getpid());
  } else if (c.url != NULL) {
    snprintf(url, sizeof(url), "%s", c.url);
  } else {
    if (bx_redis_start(&srv) != 0)
      return BX_FAIL;
    snprintf(url, sizeof(url), "redis://127.0.0.1:%d?namespace=sx-bench-plan", srv.port);
  }
  side src[3], rd = {0};
  memset(src, 0, sizeof(src));
  sx_segment *seg = NULL;
  worker w[DEPTH_MAX];
  memset(w, 0, sizeof(w));
  bx_report *rep = NULL;
  uint8_t *host = NULL;
  rc = BX_FAIL;
  if (c.device < 0 ? sources_start(src, &c, url) : spawn(argc, argv, url, &pid, &lifeline))
    goto out;
  if (side_start(&rd, &c, url, NULL, 0, c.heads, 0, 1)) {
    fprintf(stderr, "sx-bench plan: starting the reader: %s\n", sx_errmsg());
    goto out;
  }
  if (c.device >= 0 && (host = malloc(side_len(&rd, &c))) == NULL)
    goto out;
  const char *one[] = {"bench/full"};
  sx_group_params gp;
  sx_group_params_init(&gp);
  gp.names = one;
  gp.n_names = 1;
  sx_mismatch m;
  if (sx_segment_open(rd.a, "bench/full", 5000, &seg) != 0) {
    fprintf(stderr, "sx-bench plan: opening: %s\n", sx_errmsg());
    goto out;
  }
  /* Sets read one request at a time: each reader has its own. */
  for (uint32_t i = 0; i < c.depth; i++) {
    sx_group_params tp = gp;
    tp.names = NULL;
    tp.engine = "bench/pf";
    tp.tp_size = 2;
    if (sx_group_open(rd.a, &gp, &w[i].whole, &m) || sx_group_open(rd.a, &tp, &w[i].tp2, &m)) {
      fprintf(stderr, "sx-bench plan: opening the sets: %s\n", sx_errmsg());
      goto out;
    }
  }
  /* A scattered request: a fixed shuffle of the blocks on each side. */
  uint64_t rb[BLOCKS], lb[BLOCKS], x = 0x9e3779b97f4a7c15ull;
  for (uint32_t i = 0; i < BLOCKS; i++)
    rb[i] = lb[i] = i;
  for (uint32_t i = BLOCKS - 1; i > 0; i--) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    uint64_t j = x % (i + 1), t = rb[i];
    rb[i] = rb[j], rb[j] = t;
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    j = x % (i + 1), t = lb[i], lb[i] = lb[j], lb[j] = t;
  }
  static const char *names[CASES] = {"equal layouts (sx_batch_add_blocks)",
                                     "equal layouts through a plan (sx_group_read)",
                                     "TP=2 -> TP=1 plan (sx_group_read)"};
  for (uint32_t i = 0; i < c.depth; i++) {
    w[i].seg = seg;
    w[i].c = &c;
    w[i].rb = rb + (size_t)i * c.batch;
    w[i].lb = lb + (size_t)i * c.batch;
  }
  double secs[CASES] = {0}, bytes[CASES] = {0}, cpu[CASES] = {0}, caller[CASES] = {0};
  uint64_t reads[CASES] = {0};
  uint64_t per_read = 2ull * c.layers * c.batch * rd.bb;
  bx_progress_start(o, "plan", (int)(c.rounds * CASES), o->duration * c.rounds * CASES);
  for (uint32_t round = 0; round < c.rounds; round++)
    for (int k = 0; k < CASES; k++) {
      bx_progress("round %u: %s", round + 1, names[k]);
      int bad = clear(&rd, &c, host);
      for (uint32_t i = 0; i < c.depth && !bad; i++)
        bad = read_once((kase)k, seg, w[i].whole, w[i].tp2, &c, w[i].rb, w[i].lb) ||
              verify(&rd, &c, w[i].rb, w[i].lb, host);
      if (bad) {
        fprintf(stderr, "sx-bench plan: %s: %s\n", names[k], "the blocks that arrived "
                "differ from the source (or the read failed)");
        goto out;
      }
      double t0 = bx_now(), c0 = bx_cpu_self();
      if (run_workers(w, c.depth, (kase)k, o->duration))
        goto out;
      secs[k] += bx_now() - t0;
      cpu[k] += bx_cpu_self() - c0;
      for (uint32_t i = 0; i < c.depth; i++) {
        caller[k] += w[i].cpu;
        reads[k] += w[i].n;
        bytes[k] += (double)w[i].n * per_read;
      }
    }
  bx_progress_end();
  rep = bx_report_new("plan", o);
  static const bx_col cols[] = {
      {"case", "CASE", NULL}, {"order", "ORDER", NULL}, {"pieces", "PIECES/UNIT", "%.0f"},
      {"gib_s", "GiB/s", "%.3f"}, {"vs_equal", "VS EQUAL", "%.2fx"},
      {"cpu_s_gib", "CPU s/GiB", "%.3f"}, {"cpu_vs_equal", "CPU VS EQUAL", "%.2fx"},
      {"us_read", "us/READ", "%.0f"}, {"caller_us_read", "CALLER us/READ", "%.1f"},
  };
  bx_table *tb = bx_table_add(rep, "plan", "Reading through a read plan against equal "
                              "layouts, same bytes, same run", cols, 9);
  char b1[32];
  sx_transport_kind tk = sx_segment_transport(seg);
  bx_table_note(tb, "pools on %s; read over %s%s", c.location,
                tk == SX_TRANSPORT_CUDA_IPC ? "cuda_ipc" : tk == SX_TRANSPORT_TCP ? "tcp" : "?",
                c.device < 0 ? " (loopback, agents in one process)"
                : tk == SX_TRANSPORT_TCP ? " (staged; the sources in a child process)"
                                         : " (the sources in a child process)");
  bx_table_note(tb, "CPU: this process's, every thread (%s)",
                c.device < 0 ? "the sources' agents and the reader's" : "the reader's only");
  bx_table_note(tb, "us/READ: wall time per read (%u in flight, from as many threads); "
                "CALLER us/READ: the CPU time of the threads that call (planning, submitting, "
                "waking), per read", c.depth);
  bx_table_note(tb, "request: %u blocks x %u layers x K,V of %s (%u tokens x %u heads x "
                "%u x bf16), scattered ids; %u rounds of %.1f s per case", c.batch, c.layers,
                bx_size_name(rd.bb, b1, sizeof(b1)), c.tokens, c.heads, c.head_dim,
                c.rounds, o->duration);
  const sx_plan *plans[CASES] = {NULL, sx_group_plan(w[0].whole), sx_group_plan(w[0].tp2)};
  double rate[CASES], cost[CASES];
  for (int k = 0; k < CASES; k++) {
    sx_plan_info info = {0};
    rate[k] = bytes[k] / secs[k] / (1 << 30);
    cost[k] = cpu[k] / (bytes[k] / (1 << 30));
    bx_row *row = bx_row_add(tb);
    bx_set_str(row, "case", "%s", names[k]);
    bx_set_str(row, "order", "%s", sx_kv_order_name(c.order));
    if (plans[k] && sx_plan_info_get(plans[k], &info) == 0)
      bx_set_num(row, "pieces", info.pieces);
    bx_set_num(row, "gib_s", rate[k]);
    bx_set_num(row, "vs_equal", rate[k] / rate[EQUAL]);
    bx_set_num(row, "cpu_s_gib", cost[k]);
    bx_set_num(row, "cpu_vs_equal", cost[k] / cost[EQUAL]);
    bx_set_num(row, "us_read", reads[k] ? secs[k] * c.depth / (double)reads[k] * 1e6 : 0);
    bx_set_num(row, "caller_us_read", reads[k] ? caller[k] / (double)reads[k] * 1e6 : 0);
  }
  bx_target(rep, "TP=2 -> TP=1 plan read rate vs equal layouts", rate[TP2] / rate[EQUAL],
            "x", ">=", 0.8, "equal layouts read the same bytes in the same run");
  rc = bx_report_emit(rep, NULL) == 0 ? BX_OK : BX_FAIL;
out:
  bx_report_free(rep);
  for (uint32_t i = 0; i < c.depth; i++) {
    sx_group_close(w[i].whole);
    sx_group_close(w[i].tp2);
  }
  sx_segment_close(seg);
  if (rd.a)
    side_stop(&rd);
  sources_stop(src);
  free(host);
  if (lifeline >= 0)
    close(lifeline);
  if (pid > 0)
    waitpid(pid, NULL, 0);
  if (srv.pid > 0)
    bx_redis_stop(&srv);
  return rc;
}
