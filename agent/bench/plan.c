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
 * After each read the local blocks are compared with the source, so every
 * figure is of bytes that arrived right.  The target: tp2 at >= 0.8x equal.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "segxfer.h"

const char bx_plan_help[] =
    "usage: sx-bench plan [--order HND|NHD] [--tokens N] [--heads N] [--head-dim N]\n"
    "                     [--layers N] [--batch N] [--rounds N] [common options]\n"
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
    "  --rounds N       rounds of the three cases (default 3)\n"
    "\n"
    "target: the TP=2 -> TP=1 plan at >= 0.8x the equal-layout rate.\n";

enum { BLOCKS = 256 };

typedef struct side {
  sx_agent *a;
  uint8_t *mem[2];
  uint64_t bb;
} side;

typedef struct cfg {
  sx_kv_order order;
  uint32_t tokens, heads, head_dim, layers, batch, rounds;
} cfg;

static void quiet(void *arg, sx_log_level level, const char *msg) {
  (void)arg;
  if (level <= SX_LOG_WARN)
    fprintf(stderr, "sx-bench plan: agent: %s\n", msg);
}

static int side_start(side *s, const cfg *c, const char *url, const char *name,
                      uint32_t first, uint32_t count, uint32_t rank, uint32_t size) {
  sx_agent_params p;
  sx_agent_params_init(&p);
  p.name = name;
  p.metadata_url = url;
  p.transports = SX_TRANSPORTS_TCP;
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
  for (uint32_t k = 0; k < 2; k++) {
    uint64_t len = (uint64_t)c->layers * BLOCKS * s->bb;
    uint32_t id;
    if ((s->mem[k] = calloc(1, len)) == NULL)
      return -1;
    sx_region_params rp = {.addr = s->mem[k], .length = len, .layer_count = c->layers,
                           .layer_stride = BLOCKS * s->bb, .slot = k,
                           .block_bytes = s->bb, .num_blocks = BLOCKS,
                           .access = SX_ACCESS_REMOTE_READ};
    if (sx_agent_register(s->a, &rp, &id))
      return -1;
  }
  return name ? sx_agent_publish(s->a, 0) : 0;
}

static void side_stop(side *s) {
  sx_agent_destroy(s->a);
  free(s->mem[0]);
  free(s->mem[1]);
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

/* Fill a side's heads [first, first+count) with val(). */
static void fill(side *s, const cfg *c, uint32_t first, uint32_t count) {
  for (uint32_t k = 0; k < 2; k++)
    for (uint64_t l = 0; l < c->layers; l++)
      for (uint64_t b = 0; b < BLOCKS; b++) {
        uint8_t *blk = s->mem[k] + (l * BLOCKS + b) * s->bb;
        for (uint64_t t = 0; t < c->tokens; t++)
          for (uint64_t h = first; h < first + count; h++)
            for (uint64_t e = 0; e < (uint64_t)c->head_dim * 2; e++)
              blk[at(c, count, first, t, h) + e] = val(k, l, b, t, h, e);
      }
}

/* The reader's blocks lb[i] hold the sources' blocks rb[i]. */
static int verify(const side *r, const cfg *c, const uint64_t *rb, const uint64_t *lb) {
  for (uint32_t k = 0; k < 2; k++)
    for (uint64_t l = 0; l < c->layers; l++)
      for (uint32_t i = 0; i < c->batch; i++) {
        const uint8_t *blk = r->mem[k] + (l * BLOCKS + lb[i]) * r->bb;
        for (uint64_t t = 0; t < c->tokens; t++)
          for (uint64_t h = 0; h < c->heads; h++)
            for (uint64_t e = 0; e < (uint64_t)c->head_dim * 2; e++)
              if (blk[at(c, c->heads, 0, t, h) + e] != val(k, l, rb[i], t, h, e))
                return -1;
      }
  return 0;
}

typedef enum { EQUAL, WHOLE, TP2, CASES } kase;

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

static int parse(cfg *c, int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    uint64_t v = 0;
    const char *a = argv[i];
    if (strcmp(a, "--order") == 0 && i + 1 < argc) {
      a = argv[++i];
      if (strcmp(a, "HND") && strcmp(a, "NHD"))
        goto bad;
      c->order = strcmp(a, "HND") == 0 ? SX_KV_HND : SX_KV_NHD;
      continue;
    }
    uint32_t *dst = strcmp(a, "--tokens") == 0 ? &c->tokens
                    : strcmp(a, "--heads") == 0 ? &c->heads
                    : strcmp(a, "--head-dim") == 0 ? &c->head_dim
                    : strcmp(a, "--layers") == 0 ? &c->layers
                    : strcmp(a, "--batch") == 0 ? &c->batch
                    : strcmp(a, "--rounds") == 0 ? &c->rounds : NULL;
    if (dst == NULL || i + 1 >= argc || bx_parse_size(argv[++i], &v) || v == 0 ||
        v > 65536)
      goto bad;
    *dst = (uint32_t)v;
  }
  if (c->heads % 2 || c->batch > BLOCKS || c->layers > 64 || c->heads > 256 ||
      (uint64_t)c->tokens * c->heads * c->head_dim * 2 > (4u << 20)) {
    fprintf(stderr, "sx-bench plan: heads must be even, batch <= %d, layers <= 64, heads "
            "<= 256 and a block at most 4 MiB\n", BLOCKS);
    return BX_USAGE;
  }
  return 0;
bad:
  fprintf(stderr, "sx-bench plan: bad option near '%s' (sx-bench plan --help)\n", argv[argc - 1]);
  return BX_USAGE;
}

int bx_plan_main(const bx_common *o, int argc, char **argv) {
  cfg c = {SX_KV_HND, 16, 8, 128, 8, 64, 3};
  int rc = parse(&c, argc, argv);
  if (rc)
    return rc;
  char url[96];
  snprintf(url, sizeof(url), "mem://sx-bench-plan-%d", (int)getpid());
  side full = {0}, p0 = {0}, p1 = {0}, rd = {0};
  sx_segment *seg = NULL;
  sx_group *whole = NULL, *tp2 = NULL;
  bx_report *rep = NULL;
  rc = BX_FAIL;
  uint32_t half = c.heads / 2;
  if (side_start(&full, &c, url, "bench/full", 0, c.heads, 0, 1) ||
      side_start(&p0, &c, url, "bench/pf/tp0", 0, half, 0, 2) ||
      side_start(&p1, &c, url, "bench/pf/tp1", half, half, 1, 2) ||
      side_start(&rd, &c, url, NULL, 0, c.heads, 0, 1)) {
    fprintf(stderr, "sx-bench plan: starting the agents: %s\n", sx_errmsg());
    goto out;
  }
  fill(&full, &c, 0, c.heads);
  fill(&p0, &c, 0, half);
  fill(&p1, &c, half, half);
  const char *one[] = {"bench/full"};
  sx_group_params gp;
  sx_group_params_init(&gp);
  gp.names = one;
  gp.n_names = 1;
  sx_mismatch m;
  if (sx_segment_open(rd.a, "bench/full", 5000, &seg) || sx_group_open(rd.a, &gp, &whole, &m)) {
    fprintf(stderr, "sx-bench plan: opening: %s\n", sx_errmsg());
    goto out;
  }
  gp.names = NULL;
  gp.engine = "bench/pf";
  gp.tp_size = 2;
  if (sx_group_open(rd.a, &gp, &tp2, &m)) {
    fprintf(stderr, "sx-bench plan: opening the TP=2 set: %s\n", sx_errmsg());
    goto out;
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
  double secs[CASES] = {0}, bytes[CASES] = {0};
  uint64_t per_read = 2ull * c.layers * c.batch * rd.bb;
  bx_progress_start(o, "plan", (int)(c.rounds * CASES), o->duration * c.rounds * CASES);
  for (uint32_t round = 0; round < c.rounds; round++)
    for (int k = 0; k < CASES; k++) {
      bx_progress("round %u: %s", round + 1, names[k]);
      memset(rd.mem[0], 0, (size_t)c.layers * BLOCKS * rd.bb);
      memset(rd.mem[1], 0, (size_t)c.layers * BLOCKS * rd.bb);
      if (read_once((kase)k, seg, whole, tp2, &c, rb, lb) || verify(&rd, &c, rb, lb)) {
        fprintf(stderr, "sx-bench plan: %s: %s\n", names[k], "the blocks that arrived "
                "differ from the source (or the read failed)");
        goto out;
      }
      double t0 = bx_now(), t;
      uint64_t n = 0;
      do {
        if (read_once((kase)k, seg, whole, tp2, &c, rb, lb))
          goto out;
        n++;
      } while ((t = bx_now() - t0) < o->duration);
      secs[k] += t;
      bytes[k] += (double)n * per_read;
    }
  bx_progress_end();
  rep = bx_report_new("plan", o);
  static const bx_col cols[] = {
      {"case", "CASE", NULL}, {"order", "ORDER", NULL}, {"pieces", "PIECES/UNIT", "%.0f"},
      {"gib_s", "GiB/s", "%.3f"}, {"vs_equal", "VS EQUAL", "%.2fx"},
  };
  bx_table *tb = bx_table_add(rep, "plan", "Reading through a read plan against equal "
                              "layouts, same bytes, same run (TCP, loopback)", cols, 5);
  char b1[32];
  bx_table_note(tb, "request: %u blocks x %u layers x K,V of %s (%u tokens x %u heads x "
                "%u x bf16), scattered ids; %u rounds of %.1f s per case", c.batch, c.layers,
                bx_size_name(rd.bb, b1, sizeof(b1)), c.tokens, c.heads, c.head_dim,
                c.rounds, o->duration);
  const sx_plan *plans[CASES] = {NULL, sx_group_plan(whole), sx_group_plan(tp2)};
  double rate[CASES];
  for (int k = 0; k < CASES; k++) {
    sx_plan_info info = {0};
    rate[k] = bytes[k] / secs[k] / (1 << 30);
    bx_row *row = bx_row_add(tb);
    bx_set_str(row, "case", "%s", names[k]);
    bx_set_str(row, "order", "%s", sx_kv_order_name(c.order));
    if (plans[k] && sx_plan_info_get(plans[k], &info) == 0)
      bx_set_num(row, "pieces", info.pieces);
    bx_set_num(row, "gib_s", rate[k]);
    bx_set_num(row, "vs_equal", rate[k] / rate[EQUAL]);
  }
  bx_target(rep, "TP=2 -> TP=1 plan read rate vs equal layouts", rate[TP2] / rate[EQUAL],
            "x", ">=", 0.8, "equal layouts read the same bytes in the same run");
  rc = bx_report_emit(rep, NULL) == 0 ? BX_OK : BX_FAIL;
out:
  bx_report_free(rep);
  sx_group_close(whole);
  sx_group_close(tp2);
  sx_segment_close(seg);
  if (rd.a)
    side_stop(&rd);
  if (p1.a)
    side_stop(&p1);
  if (p0.a)
    side_stop(&p0);
  if (full.a)
    side_stop(&full);
  return rc;
}
