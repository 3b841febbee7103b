/*
 * sxctl write: push blocks into a writable segment (docs/push.md).
 *
 * The consumer authorizes producers by their published segment, so this
 * runs a named agent (--as) that publishes a small mirror of the target's
 * writable regions (room for --batch x --depth blocks), fills each block
 * with the bytes `sx-agent --fill SEED` would have put at its destination,
 * and writes whole blocks (every writable layer and slot of each group) in
 * pipelined write batches, each ending with a notice the consumer accepted.
 * Afterwards the destination holds the fill pattern of SEED, so any reader
 * (`sxctl read NAME --verify SEED`, or --verify here) can check it.
 */
#include <inttypes.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pattern.h"
#include "segxfer.h"
#include "sxctl.h"

static sx_log_level log_level = SX_LOG_WARN;

static void agent_log(void *arg, sx_log_level level, const char *msg) {
  (void)arg;
  static const char *const names[] = {"error", "warning", "info", "debug"};
  fprintf(stderr, "sxctl: agent %s: %s\n", names[level <= SX_LOG_DEBUG ? level : 3], msg);
}

typedef struct wregion {
  const sx_region *R; /* the consumer's */
  uint8_t *base;      /* local mirror: layer_count x cap blocks */
  uint64_t layer_stride;
} wregion;

typedef struct wgroup {
  uint32_t group, layer_first, layer_end;
  uint64_t slots;
} wgroup;

typedef struct writer {
  sx_agent *a;
  sx_segment *seg;
  const sx_desc *d;
  wregion *w;
  uint32_t n_w;
  wgroup *g;
  uint32_t n_g;
  uint8_t *mem;
  uint64_t max_block;
} writer;

typedef struct write_opts {
  const char *name, *as, *blocks, *listen;
  uint64_t batch, depth, seed, rand_seed, tag;
  int verify, json;
  uint32_t timeout_ms, wait_ms;
  unsigned transports;
} write_opts;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Mirror the writable regions and find each group's whole-block shape
 * (every layer and slot of the group must be writable). */
static int mirror(const sxctl_cmd *cmd, writer *wr, uint64_t cap) {
  const sx_desc *d = wr->d;
  uint64_t total = 0;
  wr->w = calloc(d->n_regions ? d->n_regions : 1, sizeof(*wr->w));
  wr->g = calloc(d->n_regions ? d->n_regions : 1, sizeof(*wr->g));
  if (wr->w == NULL || wr->g == NULL)
    return sxctl_err(cmd, "out of memory"), SXCTL_ERROR;
  wr->max_block = UINT64_MAX;
  for (uint32_t i = 0; i < d->n_regions; i++) {
    const sx_region *R = &d->regions[i];
    if (!(R->access & SX_ACCESS_REMOTE_WRITE))
      continue;
    wregion *m = &wr->w[wr->n_w++];
    m->R = R;
    m->layer_stride = cap * R->block_bytes;
    total += m->layer_stride * R->layer_count;
    if (R->num_blocks < wr->max_block)
      wr->max_block = R->num_blocks;
    wgroup *g = NULL;
    for (uint32_t k = 0; k < wr->n_g && g == NULL; k++)
      if (wr->g[k].group == R->group)
        g = &wr->g[k];
    if (g == NULL) {
      g = &wr->g[wr->n_g++];
      *g = (wgroup){R->group, R->layer_first, R->layer_first + R->layer_count, 0};
    }
    if (R->layer_first < g->layer_first)
      g->layer_first = R->layer_first;
    if (R->layer_first + R->layer_count > g->layer_end)
      g->layer_end = R->layer_first + R->layer_count;
    g->slots |= 1ull << R->slot;
  }
  if (wr->n_w == 0)
    return sxctl_err(cmd, "%s has no writable region", d->name), SXCTL_NO;
  for (uint32_t k = 0; k < wr->n_g; k++) {
    const wgroup *g = &wr->g[k];
    for (uint32_t l = g->layer_first; l < g->layer_end; l++)
      for (uint64_t m = g->slots; m; m &= m - 1) {
        const sx_region *R = sx_desc_find(d, g->group, l, (uint32_t)__builtin_ctzll(m));
        if (R == NULL || !(R->access & SX_ACCESS_REMOTE_WRITE))
          return sxctl_err(cmd, "%s: group %u layer %u slot %u is not writable, so whole "
                           "blocks of the group cannot be written", d->name, g->group, l,
                           (unsigned)__builtin_ctzll(m)), SXCTL_NO;
      }
  }
  if ((wr->mem = calloc(1, total)) == NULL)
    return sxctl_err(cmd, "cannot allocate %" PRIu64 " bytes", total), SXCTL_ERROR;
  uint64_t off = 0;
  for (uint32_t i = 0; i < wr->n_w; i++) {
    wregion *m = &wr->w[i];
    const sx_region *R = m->R;
    m->base = wr->mem + off;
    sx_region_params rp = {.addr = m->base, .length = m->layer_stride * R->layer_count,
                           .group = R->group, .layer_first = R->layer_first,
                           .layer_count = R->layer_count, .layer_stride = m->layer_stride,
                           .slot = R->slot, .block_bytes = R->block_bytes, .num_blocks = cap};
    off += rp.length;
    uint32_t id;
    int rc = sx_agent_register(wr->a, &rp, &id);
    if (rc)
      return sxctl_err(cmd, "registering a local mirror of region %u: %s: %s", R->id,
                       sx_err_name(rc), sx_errmsg()), SXCTL_ERROR;
  }
  return SXCTL_OK;
}

/* Local block `slot` of every mirror: the bytes destination block b is to
 * hold (check == 0), or check that it holds them (check == 1: 0 or -1). */
static int pattern_block(const sxctl_cmd *cmd, const writer *wr, uint64_t slot, uint64_t b,
                         uint64_t seed, int check) {
  for (uint32_t i = 0; i < wr->n_w; i++) {
    const wregion *m = &wr->w[i];
    const sx_region *R = m->R;
    for (uint32_t l = 0; l < R->layer_count; l++) {
      uint8_t *local = m->base + l * m->layer_stride + slot * R->block_bytes;
      uint64_t off = l * R->layer_stride + b * R->block_stride, bad;
      if (!check) {
        sx__pattern_fill(local, R->block_bytes, seed, R->id, off);
      } else if (sx__pattern_check(local, R->block_bytes, seed, R->id, off, &bad) != 0) {
        char s[16];
        sxctl_err(cmd, "verify: block %" PRIu64 " group %u layer %u slot %s (region %u): "
                  "byte %" PRIu64 " differs from the pattern of seed %" PRIu64, b, R->group,
                  R->layer_first + l, sx_slot_name(R->slot, s), R->id, bad, seed);
        return -1;
      }
    }
  }
  return 0;
}

/* A batch of n blocks between local slots [first, +n) and blocks[]. */
static int submit(const sxctl_cmd *cmd, const writer *wr, const write_opts *o, int write,
                  const uint64_t *blocks, size_t n, uint64_t first, uint64_t tag,
                  sx_batch **out) {
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = o->timeout_ms;
  bp.flags = write ? SX_BATCH_WRITE : 0;
  bp.tag = tag;
  sx_batch *b;
  int rc = sx_batch_create(wr->seg, &bp, &b);
  for (size_t i = 0; i < n && rc == 0; i++) {
    for (uint32_t k = 0; k < wr->n_g && rc == 0; k++) {
      const wgroup *g = &wr->g[k];
      uint64_t loc = first + i, rem = blocks[i];
      sx_block_ids ids = {.group = g->group, .layer_first = g->layer_first,
                          .layer_count = g->layer_end - g->layer_first, .slots = g->slots,
                          .local = &loc, .n_local = 1, .remote = &rem, .n_remote = 1};
      rc = sx_batch_add_block_ids(b, &ids);
    }
  }
  if (rc == 0)
    rc = sx_batch_submit(b);
  if (rc) {
    sxctl_err(cmd, "batch: %s: %s", sx_err_name(rc), sx_errmsg());
    sx_batch_destroy(b);
    return SXCTL_ERROR;
  }
  *out = b;
  return SXCTL_OK;
}

/* Wait for b; SXCTL_OK with its result, or the failure said. */
static int finish(const sxctl_cmd *cmd, sx_batch *b, sx_batch_result *res) {
  sx_batch_wait(b, -1);
  sx_batch_result_get(b, res);
  if (res->state == SX_BATCH_COMPLETED)
    return SXCTL_OK;
  sxctl_err(cmd, "batch %s: %s: %s", sx_batch_state_name(res->state), sx_err_name(res->error),
            res->message);
  return res->error == SX_EACCESS || res->error == SX_EDENIED ? SXCTL_NO : SXCTL_ERROR;
}

/* Read the written blocks back, batch by batch into local slot 0.., and
 * check them. */
static int verify_back(const sxctl_cmd *cmd, const writer *wr, const write_opts *o,
                       const uint64_t *blocks, size_t n, uint64_t *checked) {
  for (uint32_t i = 0; i < wr->n_w; i++)
    if (!(wr->w[i].R->access & SX_ACCESS_REMOTE_READ))
      return sxctl_err(cmd, "--verify: region %u of %s cannot be read back", wr->w[i].R->id,
                       o->name), SXCTL_ERROR;
  for (size_t done = 0; done < n;) {
    size_t k = n - done < o->batch ? n - done : o->batch;
    sx_batch *b;
    sx_batch_result res;
    if (submit(cmd, wr, o, 0, blocks + done, k, 0, 0, &b) != SXCTL_OK)
      return SXCTL_ERROR;
    int code = finish(cmd, b, &res);
    sx_batch_destroy(b);
    if (code != SXCTL_OK)
      return code;
    for (size_t i = 0; i < k; i++)
      if (pattern_block(cmd, wr, i, blocks[done + i], o->seed, 1) != 0)
        return SXCTL_NO;
    *checked += res.bytes;
    done += k;
  }
  return SXCTL_OK;
}

static int write_parse(const sxctl_cmd *cmd, int argc, char **argv, write_opts *o) {
  memset(o, 0, sizeof(*o));
  o->blocks = "random:100";
  o->batch = 64;
  o->depth = 2;
  o->timeout_ms = 10000;
  o->transports = SX_TRANSPORTS_ALL;
  o->rand_seed = (uint64_t)time(NULL) | 1;
  int have_fill = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    uint64_t n;
    if (sxctl_is_help(cmd, a))
      return -1;
    if (a[0] == '-' && strcmp(a, "--verify") != 0 && strcmp(a, "--json") != 0 &&
        strcmp(a, "--verbose") != 0 && strcmp(a, "--debug") != 0) {
      if (v == NULL)
        return sxctl_usage(cmd, "%s needs a value", a);
      i++;
    }
    if (strcmp(a, "--as") == 0) {
      o->as = v;
    } else if (strcmp(a, "--blocks") == 0) {
      o->blocks = v;
    } else if (strcmp(a, "--listen") == 0) {
      o->listen = v;
    } else if (strcmp(a, "--fill") == 0) {
      if (sx__pattern_parse(v, &o->seed))
        return sxctl_usage(cmd, "--fill '%s' is not a seed", v);
      have_fill = 1;
    } else if (strcmp(a, "--batch") == 0 || strcmp(a, "--depth") == 0) {
      if (sxctl_parse_u64(v, &n) || n == 0 || n > 65536)
        return sxctl_usage(cmd, "%s '%s' is not 1..65536", a, v);
      *(a[2] == 'b' ? &o->batch : &o->depth) = n;
    } else if (strcmp(a, "--seed") == 0) {
      if (sxctl_parse_u64(v, &o->rand_seed) || o->rand_seed == 0)
        return sxctl_usage(cmd, "--seed '%s' is not a non-zero number", v);
    } else if (strcmp(a, "--tag") == 0) {
      if (sxctl_parse_u64(v, &o->tag))
        return sxctl_usage(cmd, "--tag '%s' is not a number", v);
    } else if (strcmp(a, "--timeout-ms") == 0 || strcmp(a, "--wait-ms") == 0) {
      if (sxctl_parse_u64(v, &n) || n > 3600000)
        return sxctl_usage(cmd, "%s '%s' is not 0..3600000", a, v);
      *(a[2] == 't' ? &o->timeout_ms : &o->wait_ms) = (uint32_t)n;
    } else if (strcmp(a, "--transport") == 0) {
      if (sxctl_parse_transport(v, &o->transports))
        return sxctl_usage(cmd, "--transport '%s': use tcp, rdma or auto", v);
    } else if (strcmp(a, "--verify") == 0) {
      o->verify = 1;
    } else if (strcmp(a, "--json") == 0) {
      o->json = 1;
    } else if (strcmp(a, "--verbose") == 0) {
      log_level = SX_LOG_INFO;
    } else if (strcmp(a, "--debug") == 0) {
      log_level = SX_LOG_DEBUG;
    } else if (a[0] == '-') {
      return sxctl_usage(cmd, "unknown option '%s'", a);
    } else if (o->name == NULL) {
      o->name = a;
    } else {
      return sxctl_usage(cmd, "unexpected argument '%s'", a);
    }
  }
  if (o->name == NULL)
    return sxctl_usage(cmd, "which segment? (sxctl write NAME --as PRODUCER --fill SEED)");
  if (o->as == NULL)
    return sxctl_usage(cmd, "--as PRODUCER is needed: consumers authorize producers by "
                       "their published segment name");
  if (!have_fill)
    return sxctl_usage(cmd, "--fill SEED is needed");
  return 0;
}

static int write_run(sxctl_ctx *ctx, int argc, char **argv) {
  const sxctl_cmd *cmd = &sxctl_cmd_write;
  write_opts o;
  int rc = write_parse(cmd, argc, argv, &o);
  if (rc)
    return rc < 0 ? SXCTL_OK : rc;
  if (ctx->metadata == NULL) {
    sxctl_err(cmd, "no metadata store given: use --metadata URL or set SX_METADATA_URL");
    return SXCTL_ERROR;
  }
  writer wr;
  memset(&wr, 0, sizeof(wr));
  uint64_t *blocks = NULL;
  size_t n_blocks = 0;
  sx_batch **inflight = NULL;
  int code = SXCTL_ERROR;
  sx_agent_params p;
  sx_agent_params_init(&p);
  p.name = o.as;
  p.metadata_url = ctx->metadata;
  p.listen = o.listen;
  p.transports = o.transports;
  p.log = agent_log;
  p.log_level = log_level;
  if ((rc = sx_agent_create(&p, &wr.a)) != 0) {
    sxctl_err(cmd, "%s: %s", sx_err_name(rc), sx_errmsg());
    return SXCTL_ERROR;
  }
  if ((rc = sx_segment_open(wr.a, o.name, o.wait_ms, &wr.seg)) != 0) {
    sxctl_err(cmd, "%s: %s: %s", o.name, sx_err_name(rc), sx_errmsg());
    code = rc == SX_ENOENT ? SXCTL_NO : SXCTL_ERROR;
    goto out;
  }
  wr.d = sx_segment_desc(wr.seg);
  if ((code = mirror(cmd, &wr, o.batch * o.depth)) != SXCTL_OK)
    goto out;
  code = SXCTL_ERROR;
  if ((rc = sx_agent_publish(wr.a, 0)) != 0) {
    sxctl_err(cmd, "publishing %s: %s: %s", o.as, sx_err_name(rc), sx_errmsg());
    goto out;
  }
  rc = sxctl_parse_blocks(o.blocks, wr.max_block, o.rand_seed, &blocks, &n_blocks);
  if (rc == -2) {
    sxctl_err(cmd, "--blocks %s: the writable regions have %" PRIu64 " blocks", o.blocks,
              wr.max_block);
    goto out;
  }
  if (rc) {
    code = sxctl_usage(cmd, "--blocks '%s': use random:N, all, or a list like 0-9,17", o.blocks);
    goto out;
  }
  if ((inflight = calloc(o.depth, sizeof(*inflight))) == NULL)
    goto out;
  uint64_t bytes = 0, batches = 0, checked = 0;
  double t0 = now_s();
  size_t next = 0, done = 0;
  /* Pipeline: up to depth batches in flight, each from its own slice of
   * the mirror, which is filled just before. */
  while (done < n_blocks) {
    for (uint64_t s = 0; s < o.depth && next < n_blocks; s++) {
      if (inflight[s] != NULL)
        continue;
      size_t n = n_blocks - next < o.batch ? n_blocks - next : o.batch;
      for (size_t i = 0; i < n; i++)
        pattern_block(cmd, &wr, s * o.batch + i, blocks[next + i], o.seed, 0);
      if (submit(cmd, &wr, &o, 1, blocks + next, n, s * o.batch, o.tag + next / o.batch,
                 &inflight[s]) != SXCTL_OK)
        goto out;
      next += n;
    }
    uint64_t s = (done / o.batch) % o.depth;
    sx_batch_result res;
    if ((code = finish(cmd, inflight[s], &res)) != SXCTL_OK)
      goto out;
    code = SXCTL_ERROR;
    bytes += res.bytes;
    batches++;
    sx_batch_destroy(inflight[s]);
    inflight[s] = NULL;
    done += n_blocks - done < o.batch ? n_blocks - done : o.batch;
  }
  double wall = now_s() - t0;
  if (o.verify && (code = verify_back(cmd, &wr, &o, blocks, n_blocks, &checked)) != SXCTL_OK)
    goto out;
  const char *via = sxctl_transport_name(sx_segment_transport(wr.seg));
  char hb[32];
  if (o.json) {
    json_t *j = json_object();
    json_object_set_new(j, "name", json_string(o.name));
    json_object_set_new(j, "producer", json_string(o.as));
    json_object_set_new(j, "transport", json_string(via));
    json_object_set_new(j, "blocks", json_integer((json_int_t)n_blocks));
    json_object_set_new(j, "batches", json_integer((json_int_t)batches));
    json_object_set_new(j, "bytes", json_integer((json_int_t)bytes));
    json_object_set_new(j, "seconds", json_real(wall));
    json_object_set_new(j, "gb_per_s", json_real(wall > 0 ? (double)bytes / wall / 1e9 : 0));
    json_object_set_new(j, "verified_bytes", json_integer((json_int_t)checked));
    char *js = json_dumps(j, JSON_SORT_KEYS);
    json_decref(j);
    if (js)
      puts(js);
    free(js);
  } else {
    printf("wrote %zu blocks (%s) into %s as %s via %s in %" PRIu64 " batches, each "
           "acknowledged by a notice (tags %" PRIu64 "..%" PRIu64 ")\n", n_blocks,
           sxctl_bytes(bytes, hb, sizeof(hb)), o.name, o.as, via, batches, o.tag,
           o.tag + (batches ? batches - 1 : 0));
    printf("time %.3f s, %.2f GB/s (%d batches in flight)\n", wall,
           wall > 0 ? (double)bytes / wall / 1e9 : 0.0, (int)o.depth);
    if (o.verify)
      printf("read back and verified every byte: %s against the pattern of seed %" PRIu64 "\n",
             sxctl_bytes(checked, hb, sizeof(hb)), o.seed);
  }
  code = SXCTL_OK;

out:
  if (inflight != NULL) {
    for (uint64_t s = 0; s < o.depth; s++)
      sx_batch_destroy(inflight[s]);
    free(inflight);
  }
  free(blocks);
  sx_segment_close(wr.seg);
  sx_agent_destroy(wr.a);
  free(wr.mem);
  free(wr.w);
  free(wr.g);
  return code;
}

const sxctl_cmd sxctl_cmd_write = {
    .name = "write",
    .summary = "push blocks into a writable segment (push mode) and check them",
    .help =
        "usage: sxctl write NAME --as PRODUCER --fill SEED [--blocks SPEC] [options]\n"
        "\n"
        "Publish a producer segment PRODUCER (NAME's owner must have granted it writes:\n"
        "sx-agent --grant), fill blocks with the bytes `sx-agent --fill SEED` would put\n"
        "at their destination and write them, whole blocks (every writable layer and\n"
        "slot of each group), in pipelined write batches; each batch completes only once\n"
        "NAME accepted its notice.  NAME's blocks then hold the pattern of SEED:\n"
        "`sxctl read NAME --blocks SPEC --verify SEED` checks them from any reader, and\n"
        "--verify does so here.  Exit 0 success, 1 not found / refused (no grant, not\n"
        "writable) / a byte differs, 2 an error.\n"
        "\n"
        "  --as PRODUCER        the segment name this producer publishes (required)\n"
        "  --fill SEED          the pattern to write (required)\n"
        "  --blocks SPEC        random:N (default random:100), all, or a list such as\n"
        "                       0-9,17,40-41 (destination block ids)\n"
        "  --tag N              tag of the first batch's notice; batch i has N+i (default 0)\n"
        "  --batch N            blocks per batch (default 64)\n"
        "  --depth N            batches in flight (default 2)\n"
        "  --verify             read the blocks back and check every byte\n"
        "  --seed N             seed of random:N (default: the time)\n"
        "  --timeout-ms MS      deadline per batch (default 10000)\n"
        "  --wait-ms MS         wait that long for NAME to be published (default 0)\n"
        "  --transport KIND     tcp, rdma or auto (default)\n"
        "  --listen HOST:PORT   the producer's data-plane address (default 0.0.0.0:0)\n"
        "  --json               one JSON object with the figures\n"
        "  --verbose, --debug   the agent's messages on stderr\n"
        "\n"
        "example:\n"
        "  sxctl write decode-0 --as prefill-7 --fill 9 --blocks 0-255 --verify\n",
    .run = write_run,
};
