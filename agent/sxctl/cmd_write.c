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

#include "pattern.h"
#include "segxfer.h"
#include "sxctl.h"

typedef struct wregion {
  const sx_region *R; /* the consumer's */
  uint8_t *base;      /* local mirror: layer_count x cap blocks */
  uint64_t layer_stride;
} wregion;

typedef struct write_opts {
  sxctl_data_opts c; /* NAME and the options read takes too */
  const char *as, *listen;
  uint64_t seed, tag;
  int verify;
} write_opts;

typedef struct writer {
  const sxctl_cmd *cmd;
  const write_opts *o;
  sx_agent *a;
  sx_segment *seg;
  const sx_desc *d;
  wregion *w;
  uint32_t n_w;
  sxctl_group *g; /* the whole-block shape of each group */
  uint32_t n_g;
  uint8_t *mem;
  uint64_t max_block;
  uint64_t bytes, batches; /* the figures so far */
} writer;


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
    sxctl_group_add(wr->g, &wr->n_g, R);
  }
  if (wr->n_w == 0)
    return sxctl_err(cmd, "%s has no writable region", d->name), SXCTL_NO;
  for (uint32_t k = 0; k < wr->n_g; k++) {
    const sxctl_group *g = &wr->g[k];
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
        sxctl_pattern_differs(cmd, R, l, b, bad, seed);
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
  bp.timeout_ms = o->c.timeout_ms;
  bp.flags = write ? SX_BATCH_WRITE : 0;
  bp.tag = tag;
  sx_batch *b;
  int rc = sx_batch_create(wr->seg, &bp, &b);
  for (size_t i = 0; i < n && rc == 0; i++) {
    for (uint32_t k = 0; k < wr->n_g && rc == 0; k++) {
      const sxctl_group *g = &wr->g[k];
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

/* Wait for b; SXCTL_OK with its result, or the failure said (SXCTL_NO when
 * the consumer refused it). */
static int finish(const sxctl_cmd *cmd, sx_batch *b, sx_batch_result *res) {
  int code = sxctl_batch_finish(cmd, b, res);
  if (code != SXCTL_OK && (res->error == SX_EACCESS || res->error == SX_EDENIED))
    return SXCTL_NO;
  return code;
}

/* sxctl_pipeline's start: fill local slots [first, +n) with the bytes
 * blocks[] are to hold and write them, batch `index` tagged o->tag + index. */
static int fill_and_write(void *arg, const uint64_t *blocks, size_t n, uint64_t first,
                          uint64_t index, sx_batch **out) {
  writer *wr = arg;
  for (size_t i = 0; i < n; i++)
    pattern_block(wr->cmd, wr, first + i, blocks[i], wr->o->seed, 0);
  return submit(wr->cmd, wr, wr->o, 1, blocks, n, first, wr->o->tag + index, out);
}

/* sxctl_pipeline's done: the batch completed once the consumer accepted
 * its notice. */
static int written(void *arg, sx_batch *b, const uint64_t *blocks, size_t n, uint64_t first) {
  writer *wr = arg;
  sx_batch_result res;
  (void)blocks, (void)n, (void)first;
  int code = finish(wr->cmd, b, &res);
  if (code == SXCTL_OK) {
    wr->bytes += res.bytes;
    wr->batches++;
  }
  return code;
}

static const sxctl_pipe_ops write_pipe = {.start = fill_and_write, .done = written};

/* Read the written blocks back, batch by batch into local slot 0.., and
 * check them. */
static int verify_back(const sxctl_cmd *cmd, const writer *wr, const write_opts *o,
                       const uint64_t *blocks, size_t n, uint64_t *checked) {
  for (uint32_t i = 0; i < wr->n_w; i++)
    if (!(wr->w[i].R->access & SX_ACCESS_REMOTE_READ))
      return sxctl_err(cmd, "--verify: region %u of %s cannot be read back", wr->w[i].R->id,
                       o->c.name), SXCTL_ERROR;
  for (size_t done = 0; done < n;) {
    size_t k = n - done < o->c.batch ? n - done : o->c.batch;
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
  sxctl_data_opts_init(&o->c);
  o->c.kinds = "tcp, rdma or auto";
  int have_fill = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = NULL;
    int rc;
    if (strcmp(a, "--as") == 0 || strcmp(a, "--listen") == 0 || strcmp(a, "--fill") == 0 ||
        strcmp(a, "--tag") == 0) {
      if ((v = sxctl_opt_value(cmd, argc, argv, &i)) == NULL)
        return SXCTL_ERROR;
    }
    if (strcmp(a, "--as") == 0) {
      o->as = v;
    } else if (strcmp(a, "--listen") == 0) {
      o->listen = v;
    } else if (strcmp(a, "--fill") == 0) {
      if (sx__pattern_parse(v, &o->seed))
        return sxctl_usage(cmd, "--fill: %s", sx_errmsg());
      have_fill = 1;
    } else if (strcmp(a, "--tag") == 0) {
      if (sxctl_parse_u64(v, &o->tag))
        return sxctl_usage(cmd, "--tag '%s' is not a number 0..2^64-1", v);
    } else if (strcmp(a, "--verify") == 0) {
      o->verify = 1;
    } else if ((rc = sxctl_data_opt(cmd, &o->c, argc, argv, &i)) != 0) {
      return rc;
    }
  }
  if (o->c.name == NULL)
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
  writer wr;
  memset(&wr, 0, sizeof(wr));
  wr.cmd = cmd;
  wr.o = &o;
  uint64_t *blocks = NULL, checked = 0;
  size_t n_blocks = 0;
  int code = SXCTL_ERROR;
  if ((rc = sxctl_agent_start(cmd, ctx, o.as, o.listen, o.c.transports, o.c.log_level, &wr.a)))
    return rc;
  if ((code = sxctl_segment_open(cmd, wr.a, o.c.name, o.c.wait_ms, &wr.seg)) != SXCTL_OK)
    goto out;
  wr.d = sx_segment_desc(wr.seg);
  if ((code = mirror(cmd, &wr, o.c.batch * o.c.depth)) != SXCTL_OK)
    goto out;
  code = SXCTL_ERROR;
  if ((rc = sx_agent_publish(wr.a, 0)) != 0) {
    sxctl_err(cmd, "publishing %s: %s: %s", o.as, sx_err_name(rc), sx_errmsg());
    goto out;
  }
  if (sxctl_blocks(cmd, &o.c, wr.max_block, "the writable regions have", "", &blocks,
                   &n_blocks) != SXCTL_OK)
    goto out;
  double t0 = sxctl_now_s();
  if ((code = sxctl_pipeline(&o.c, blocks, n_blocks, &write_pipe, &wr)) != SXCTL_OK)
    goto out;
  double wall = sxctl_now_s() - t0;
  if (o.verify && (code = verify_back(cmd, &wr, &o, blocks, n_blocks, &checked)) != SXCTL_OK)
    goto out;
  const char *via = sxctl_transport_name(sx_segment_transport(wr.seg));
  char hb[32];
  if (o.c.json) {
    json_t *j = sxctl_report_json(o.c.name, via, n_blocks, wr.batches, wr.bytes, wall,
                                  checked);
    json_object_set_new(j, "producer", json_string(o.as));
    sxctl_json_line(j);
  } else {
    printf("wrote %zu blocks (%s) into %s as %s via %s in %" PRIu64 " batches, each "
           "acknowledged by a notice (tags %" PRIu64 "..%" PRIu64 ")\n", n_blocks,
           sxctl_bytes(wr.bytes, hb, sizeof(hb)), o.c.name, o.as, via, wr.batches, o.tag,
           o.tag + (wr.batches ? wr.batches - 1 : 0));
    printf("time %.3f s, %.2f GB/s (%d batches in flight)\n", wall,
           wall > 0 ? (double)wr.bytes / wall / 1e9 : 0.0, (int)o.c.depth);
    if (o.verify)
      printf("read back and verified every byte: %s against the pattern of seed %" PRIu64 "\n",
             sxctl_bytes(checked, hb, sizeof(hb)), o.seed);
  }
  code = SXCTL_OK;

out:
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
        "                       0-9,17,40-41 (destination block ids); at most 16777216\n"
        "                       blocks at a time\n"
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
