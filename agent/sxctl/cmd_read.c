/*
 * sxctl read, ping: the data path from the command line.  Both start a
 * reader-only agent (no name, no listener), open the segment by name and
 * read from it over the transport the agent picks (or --transport).
 *
 * read mirrors the segment's regions locally (same keys and block sizes,
 * room for --batch x --depth blocks), reads whole blocks (every layer and
 * slot of a group, as an engine moves a KV block) in pipelined batches and,
 * with --verify SEED, checks every byte against sx-agent's fill pattern.
 */
#include <inttypes.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "mem/mem.h"
#include "pattern.h"
#include "segxfer/agent.h"
#include "sxctl.h"

/* ------------------------------------------------------------------ read */

/* The local copy of one remote region. */
typedef struct mregion {
  const sx_region *R;
  uint8_t *base;
  uint64_t layer_stride;
} mregion;

typedef struct read_opts {
  sxctl_data_opts c; /* NAME and the options write takes too */
  uint64_t seed;
  int verify, no_check;
  int notify;          /* --notify-tag: batch i sends a read notice, tag notify_tag+i */
  uint64_t notify_tag;
  const char *location;
  sx_layout layout; /* what to expect; empty fields: the segment's */
} read_opts;

typedef struct reader {
  const sxctl_cmd *cmd;
  const read_opts *o;
  sx_agent *a;
  sx_segment *seg;
  const sx_desc *d;
  mregion *m;
  uint8_t *mem;
  const char *location; /* of mem: "cpu" or "cuda:N" */
  sxctl_group *g; /* one entry shape per group */
  uint32_t n_groups;
  uint64_t max_block; /* blocks every region has */
  uint64_t per_block; /* bytes one block brings (all groups, layers, slots) */
  uint64_t bytes, checked, batches, ranges; /* the figures so far */
  double transfer;                          /* seconds in batches */
} reader;

/* Register local regions mirroring the segment's, cap blocks each. */
static int mirror(const sxctl_cmd *cmd, reader *r, uint64_t cap) {
  const sx_desc *d = r->d;
  uint64_t total = 0;
  r->m = calloc(d->n_regions ? d->n_regions : 1, sizeof(*r->m));
  r->g = calloc(d->n_regions ? d->n_regions : 1, sizeof(*r->g));
  if (r->m == NULL || r->g == NULL) {
    sxctl_err(cmd, "out of memory");
    return SXCTL_ERROR;
  }
  r->max_block = UINT64_MAX;
  for (uint32_t i = 0; i < d->n_regions; i++) {
    const sx_region *R = &d->regions[i];
    r->m[i].R = R;
    r->m[i].layer_stride = cap * R->block_bytes;
    total += r->m[i].layer_stride * R->layer_count;
    if (R->num_blocks < r->max_block)
      r->max_block = R->num_blocks;
    r->per_block += R->block_bytes * R->layer_count;
    sxctl_group_add(r->g, &r->n_groups, R);
  }
  sx__mem_info where;
  if (sx__mem_parse_location(r->location, &where) != 0) {
    sxctl_err(cmd, "--location: %s", sx_errmsg());
    return SXCTL_ERROR;
  }
  if (where.kind == SX__MEM_CUDA) {
    if (sx__mem_alloc(where.device, total ? total : 1, (void **)&r->mem) != 0) {
      sxctl_err(cmd, "cannot allocate %" PRIu64 " bytes on %s: %s", total, r->location,
                sx_errmsg());
      return SXCTL_ERROR;
    }
  } else if ((r->mem = calloc(1, total ? total : 1)) == NULL) {
    sxctl_err(cmd, "cannot allocate %" PRIu64 " bytes of local buffers", total);
    return SXCTL_ERROR;
  }
  uint64_t off = 0;
  for (uint32_t i = 0; i < d->n_regions; i++) {
    const sx_region *R = r->m[i].R;
    r->m[i].base = r->mem + off;
    sx_region_params rp = {.addr = r->m[i].base,
                           .length = r->m[i].layer_stride * R->layer_count,
                           .group = R->group, .layer_first = R->layer_first,
                           .layer_count = R->layer_count,
                           .layer_stride = r->m[i].layer_stride, .slot = R->slot,
                           .block_bytes = R->block_bytes, .num_blocks = cap,
                           .location = r->location};
    off += rp.length;
    uint32_t id;
    int rc = sx_agent_register(r->a, &rp, &id);
    if (rc) {
      sxctl_err(cmd, "registering a local copy of region %u: %s: %s", R->id,
                sx_err_name(rc), sx_errmsg());
      return SXCTL_ERROR;
    }
  }
  return SXCTL_OK;
}

/* Check the blocks a batch brought; returns the bytes checked or -1. */
static int64_t verify(const sxctl_cmd *cmd, const reader *r, const uint64_t *blocks,
                      size_t n, uint64_t first_local, uint64_t seed) {
  int64_t checked = 0;
  for (size_t i = 0; i < n; i++) {
    for (uint32_t k = 0; k < r->d->n_regions; k++) {
      const mregion *m = &r->m[k];
      const sx_region *R = m->R;
      for (uint32_t l = 0; l < R->layer_count; l++) {
        const uint8_t *local = m->base + l * m->layer_stride +
                               (first_local + i) * R->block_bytes;
        uint64_t off = l * R->layer_stride + blocks[i] * R->block_stride, bad;
        int bad_rc = sx__pattern_check_any(local, R->block_bytes, seed, R->id, off, &bad);
        if (bad_rc > 0 || bad_rc < -1) {
          sxctl_err(cmd, "verify: copying block %" PRIu64 " back: %s", blocks[i],
                    sx_errmsg());
          return -1;
        }
        if (bad_rc != 0) {
          sxctl_pattern_differs(cmd, R, l, blocks[i], bad, seed);
          return -1;
        }
        checked += (int64_t)R->block_bytes;
      }
    }
  }
  return checked;
}

/* sxctl_pipeline's start: a batch of n blocks into local blocks
 * [first_local, +n). */
static int submit(void *arg, const uint64_t *blocks, size_t n, uint64_t first_local,
                  uint64_t index, sx_batch **out) {
  reader *r = arg;
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = r->o->c.timeout_ms;
  if (r->o->notify) {
    bp.flags = SX_BATCH_NOTIFY;
    bp.tag = r->o->notify_tag + index;
  }
  sx_batch *b;
  int rc = sx_batch_create(r->seg, &bp, &b);
  for (size_t i = 0; i < n && rc == 0; i++) {
    for (uint32_t g = 0; g < r->n_groups && rc == 0; g++) {
      sx_block_read e = {.group = r->g[g].group, .layer_first = r->g[g].layer_first,
                         .layer_count = r->g[g].layer_end - r->g[g].layer_first,
                         .slots = r->g[g].slots, .remote_block = blocks[i],
                         .local_block = first_local + i, .count = 1};
      rc = sx_batch_add_blocks(b, &e, 1);
    }
  }
  if (rc == 0)
    rc = sx_batch_submit(b);
  if (rc) {
    sxctl_err(r->cmd, "batch: %s: %s", sx_err_name(rc), sx_errmsg());
    sx_batch_destroy(b);
    return SXCTL_ERROR;
  }
  *out = b;
  return SXCTL_OK;
}

/* sxctl_pipeline's done: the figures of a batch, and its bytes checked. */
static int received(void *arg, sx_batch *b, const uint64_t *blocks, size_t n,
                    uint64_t first_local) {
  reader *r = arg;
  sx_batch_result res;
  if (sxctl_batch_finish(r->cmd, b, &res) != SXCTL_OK)
    return SXCTL_ERROR;
  r->bytes += res.bytes;
  r->ranges += res.n_ranges;
  r->transfer += (double)res.transfer_ns / 1e9;
  r->batches++;
  if (r->o->verify) {
    int64_t c = verify(r->cmd, r, blocks, n, first_local, r->o->seed);
    if (c < 0)
      return SXCTL_NO;
    r->checked += (uint64_t)c;
  }
  return SXCTL_OK;
}

static const sxctl_pipe_ops read_pipe = {.start = submit, .done = received};

static int read_parse(const sxctl_cmd *cmd, int argc, char **argv, read_opts *o) {
  memset(o, 0, sizeof(*o));
  sxctl_data_opts_init(&o->c);
  o->location = "cpu";
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v;
    int rc;
    if (strcmp(a, "--verify") == 0) {
      if ((v = sxctl_opt_value(cmd, argc, argv, &i)) == NULL)
        return SXCTL_ERROR;
      if (sx__pattern_parse(v, &o->seed))
        return sxctl_usage(cmd, "--verify: %s", sx_errmsg());
      o->verify = 1;
    } else if (strcmp(a, "--location") == 0) {
      if ((v = sxctl_opt_value(cmd, argc, argv, &i)) == NULL)
        return SXCTL_ERROR;
      sx__mem_info m;
      if (sx__mem_parse_location(v, &m) != 0)
        return sxctl_usage(cmd, "--location '%s': use cpu or cuda:N", v);
      o->location = v;
    } else if (strcmp(a, "--fingerprint") == 0 || strcmp(a, "--dtype") == 0 ||
               strcmp(a, "--tag") == 0) {
      if ((v = sxctl_opt_value(cmd, argc, argv, &i)) == NULL)
        return SXCTL_ERROR;
      char *dst = a[2] == 'f' ? o->layout.fingerprint : a[2] == 'd' ? o->layout.dtype
                                                                    : o->layout.tag;
      size_t size = a[2] == 'f' ? sizeof(o->layout.fingerprint) : sizeof(o->layout.tag);
      if (strlen(v) >= size)
        return sxctl_usage(cmd, "%s '%s' is too long", a, v);
      memcpy(dst, v, strlen(v) + 1);
    } else if (strcmp(a, "--no-check") == 0) {
      o->no_check = 1;
    } else if (strcmp(a, "--notify-tag") == 0) {
      if ((v = sxctl_opt_value(cmd, argc, argv, &i)) == NULL)
        return SXCTL_ERROR;
      if (sxctl_parse_u64(v, &o->notify_tag))
        return sxctl_usage(cmd, "--notify-tag '%s' is not a number 0..2^64-1", v);
      o->notify = 1;
    } else if ((rc = sxctl_data_opt(cmd, &o->c, argc, argv, &i)) != 0) {
      return rc;
    }
  }
  if (o->c.name == NULL)
    return sxctl_usage(cmd, "which segment? (sxctl read NAME ...)");
  return 0;
}

static int read_run(sxctl_ctx *ctx, int argc, char **argv) {
  const sxctl_cmd *cmd = &sxctl_cmd_read;
  read_opts o;
  int rc = read_parse(cmd, argc, argv, &o);
  if (rc)
    return rc < 0 ? SXCTL_OK : rc;
  reader r;
  memset(&r, 0, sizeof(r));
  r.cmd = cmd;
  r.o = &o;
  uint64_t *blocks = NULL;
  size_t n_blocks = 0;
  sx_desc mine;
  int code = SXCTL_ERROR;
  /* Read notices of batches read over RDMA travel on TCP (docs/push.md):
   * --transport rdma then keeps the reads on RDMA and lets TCP carry them. */
  unsigned transports = o.c.transports;
  if (o.notify && transports == SX_TRANSPORTS_RDMA)
    transports |= SX_TRANSPORTS_TCP;
  if ((rc = sxctl_agent_start(cmd, ctx, NULL, NULL, transports, o.c.log_level, &r.a)))
    return rc;
  if ((code = sxctl_segment_open(cmd, r.a, o.c.name, o.c.wait_ms, &r.seg)) != SXCTL_OK)
    goto out;
  code = SXCTL_ERROR;
  if (transports != o.c.transports && sx_segment_transport(r.seg) != SX_TRANSPORT_RDMA) {
    sxctl_err(cmd, "--transport rdma: %s cannot be read over RDMA from here", o.c.name);
    goto out;
  }
  r.d = sx_segment_desc(r.seg);
  r.location = o.location;
  if ((rc = mirror(cmd, &r, o.c.batch * o.c.depth)) != SXCTL_OK)
    goto out;

  /* The compatibility check: the segment-wide facts are what the caller
   * said to expect (--fingerprint, --dtype, --tag; the segment's own where
   * not given), the regions are the local mirrors, registered above. */
  sx_mismatch m;
  const char *check = "compatible";
  sx_desc local;
  sx_desc_init(&local);
  local.layout = r.d->layout;
  if (o.layout.fingerprint[0])
    memcpy(local.layout.fingerprint, o.layout.fingerprint, sizeof(o.layout.fingerprint));
  if (o.layout.dtype[0])
    memcpy(local.layout.dtype, o.layout.dtype, sizeof(o.layout.dtype));
  if (o.layout.tag[0])
    memcpy(local.layout.tag, o.layout.tag, sizeof(o.layout.tag));
  rc = sx_agent_descriptor(r.a, &mine);
  for (uint32_t i = 0; rc == 0 && i < mine.n_regions; i++)
    rc = sx_desc_add_region(&local, &mine.regions[i]);
  sx_desc_free(&mine);
  if (rc == 0)
    rc = sx_layout_check(&local, r.d, 0, &m);
  sx_desc_free(&local);
  if (rc == SX_EINCOMPAT) {
    check = "INCOMPATIBLE";
    if (!o.c.json)
      printf("layout check: INCOMPATIBLE: %s\n", m.message);
    if (!o.no_check) {
      code = SXCTL_NO;
      goto out;
    }
  } else if (rc) {
    sxctl_err(cmd, "layout check: %s: %s", sx_err_name(rc), sx_errmsg());
    goto out;
  } else if (!o.c.json) {
    printf("layout check: compatible (fingerprint %s, tag %s, dtype %s, %u regions)\n",
           r.d->layout.fingerprint, r.d->layout.tag, r.d->layout.dtype, r.d->n_regions);
  }

  if (sxctl_blocks(cmd, &o.c, r.max_block, "the segment has", " per region", &blocks,
                   &n_blocks) != SXCTL_OK)
    goto out;
  double t0 = sxctl_now_s();
  if ((code = sxctl_pipeline(&o.c, blocks, n_blocks, &read_pipe, &r)) != SXCTL_OK)
    goto out;
  double wall = sxctl_now_s() - t0;
  const char *via = sxctl_transport_name(sx_segment_transport(r.seg));
  char hb[32];
  if (o.c.json) {
    json_t *j = sxctl_report_json(o.c.name, via, n_blocks, r.batches, r.bytes, wall, r.checked);
    json_object_set_new(j, "check", json_string(check));
    json_object_set_new(j, "ranges", json_integer((json_int_t)r.ranges));
    sxctl_json_line(j);
  } else {
    printf("read %zu blocks (%s) from %s via %s in %" PRIu64 " batches of up to %" PRIu64
           " blocks (%" PRIu64 " ranges after merging)\n",
           n_blocks, sxctl_bytes(r.bytes, hb, sizeof(hb)), o.c.name,
           via, r.batches, o.c.batch, r.ranges);
    printf("time %.3f s, %.2f GB/s (%d batches in flight; mean batch %.2f ms)\n", wall,
           wall > 0 ? (double)r.bytes / wall / 1e9 : 0.0, (int)o.c.depth,
           r.batches ? r.transfer * 1e3 / (double)r.batches : 0.0);
    if (o.verify)
      printf("verified every byte: %s against the pattern of seed %" PRIu64 "\n",
             sxctl_bytes(r.checked, hb, sizeof(hb)), o.seed);
  }
  code = o.verify && r.checked != r.bytes ? SXCTL_NO : SXCTL_OK;

out:
  free(blocks);
  sx_segment_close(r.seg);
  sx_agent_destroy(r.a);
  if (strcmp(r.location ? r.location : "cpu", "cpu") != 0)
    sx__mem_free(r.mem);
  else
    free(r.mem);
  free(r.m);
  free(r.g);
  return code;
}

const sxctl_cmd sxctl_cmd_read = {
    .name = "read",
    .summary = "read blocks of a segment over the data path (and verify them)",
    .help =
        "usage: sxctl read NAME [--blocks SPEC] [--verify SEED] [options]\n"
        "\n"
        "Open NAME as a reader, check its layout, read whole blocks (every layer and\n"
        "slot of each group) in pipelined batches and report bytes and GB/s.  With\n"
        "--verify, check every byte against the fill pattern of `sx-agent --fill SEED`.\n"
        "Exit 0 success, 1 not found / incompatible / a byte differs, 2 an error.\n"
        "\n"
        "  --blocks SPEC        random:N (default random:100), all, or a list such as\n"
        "                       0-9,17,40-41 (block ids every region has); at most\n"
        "                       16777216 blocks at a time\n"
        "  --verify SEED        check every byte read\n"
        "  --batch N            blocks per batch (default 64)\n"
        "  --depth N            batches in flight (default 2)\n"
        "  --seed N             seed of random:N (default: the time; printed by --json)\n"
        "  --timeout-ms MS      deadline per batch (default 10000)\n"
        "  --wait-ms MS         wait that long for NAME to be published (default 0)\n"
        "  --transport KIND     tcp, rdma, cuda_ipc or auto (default)\n"
        "  --location LOC       where the local buffers live: cpu (default) or cuda:N\n"
        "                       (GPU memory: reads land there, --verify copies back)\n"
        "  --notify-tag N       each batch ends with a read notice at the owner, batch i\n"
        "                       tagged N+i (SX_BATCH_NOTIFY)\n"
        "  --fingerprint F, --dtype D, --tag T\n"
        "                       the layout this reader expects; the check fails (exit 1)\n"
        "                       when the segment differs, unless --no-check\n"
        "  --json               one JSON object with the figures\n"
        "  --verbose            the agent's info messages on stderr\n"
        "  --debug              and its debug messages\n"
        "\n"
        "examples:\n"
        "  sxctl read pool-0 --blocks random:300 --verify 42\n"
        "  sxctl read prefill-0/tp3 --blocks 0-1023 --batch 256 --depth 4 --json\n",
    .run = read_run,
};

/* ------------------------------------------------------------------ ping */

static int ping_run(sxctl_ctx *ctx, int argc, char **argv) {
  const sxctl_cmd *cmd = &sxctl_cmd_ping;
  const char *name = NULL;
  uint64_t count = 3, timeout = 5000;
  unsigned transports = SX_TRANSPORTS_ALL;
  int json = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (sxctl_is_help(cmd, a))
      return SXCTL_OK;
    if (strcmp(a, "--count") == 0 || strcmp(a, "--timeout-ms") == 0) {
      uint64_t n;
      if (v == NULL || sxctl_parse_u64(v, &n) || n == 0 || n > 3600000)
        return sxctl_usage(cmd, "%s needs a number 1..3600000", a);
      *(a[2] == 'c' ? &count : &timeout) = n;
      i++;
    } else if (strcmp(a, "--transport") == 0) {
      if (v == NULL || sxctl_parse_transport(v, &transports))
        return sxctl_usage(cmd, "--transport: use tcp, rdma, cuda_ipc or auto");
      i++;
    } else if (strcmp(a, "--json") == 0) {
      json = 1;
    } else if (a[0] == '-') {
      return sxctl_usage(cmd, "unknown option '%s'", a);
    } else if (name == NULL) {
      name = a;
    } else {
      return sxctl_usage(cmd, "unexpected argument '%s'", a);
    }
  }
  if (name == NULL)
    return sxctl_usage(cmd, "which segment? (sxctl ping NAME)");
  sx_agent *a;
  sx_segment *seg = NULL;
  int code = sxctl_agent_start(cmd, ctx, NULL, NULL, transports, SX_LOG_WARN, &a);
  if (code != SXCTL_OK)
    return code;
  if ((code = sxctl_segment_open(cmd, a, name, 0, &seg)) != SXCTL_OK)
    goto out;
  const sx_desc *d = sx_segment_desc(seg);
  char ep[128] = "-", inc[9];
  for (uint32_t i = 0; i < d->n_endpoints; i++)
    if (d->endpoints[i].kind == sx_segment_transport(seg))
      sxctl_endpoint(&d->endpoints[i], ep, sizeof(ep));
  uint64_t min = UINT64_MAX, max = 0, sum = 0;
  sx_transport_kind via = SX_TRANSPORT_NONE;
  for (uint64_t i = 0; i < count; i++) {
    uint64_t rtt;
    int rc = sx_segment_ping(seg, (uint32_t)timeout, &rtt, &via);
    if (rc) {
      sxctl_err(cmd, "%s: %s: %s", name, sx_err_name(rc), sx_errmsg());
      code = rc == SX_ESTALE || rc == SX_EACCESS || rc == SX_ENOENT ? SXCTL_NO
                                                                    : SXCTL_ERROR;
      goto out;
    }
    if (!json)
      printf("%s: %s incarnation %s: rtt %" PRIu64 " us%s\n", name, ep,
             sxctl_short_inc(d->incarnation, inc), rtt, i == 0 ? " (with connect)" : "");
    min = rtt < min ? rtt : min;
    max = rtt > max ? rtt : max;
    sum += rtt;
  }
  if (json) {
    json_t *j = json_object();
    json_object_set_new(j, "name", json_string(name));
    json_object_set_new(j, "transport", json_string(sxctl_transport_name(via)));
    json_object_set_new(j, "endpoint", json_string(ep));
    json_object_set_new(j, "count", json_integer((json_int_t)count));
    json_object_set_new(j, "rtt_us_min", json_integer((json_int_t)min));
    json_object_set_new(j, "rtt_us_avg", json_integer((json_int_t)(sum / count)));
    json_object_set_new(j, "rtt_us_max", json_integer((json_int_t)max));
    sxctl_json_line(j);
  } else {
    printf("%s: %" PRIu64 " pings via %s: min %" PRIu64 " us, avg %" PRIu64
           " us, max %" PRIu64 " us\n",
           name, count, sxctl_transport_name(via), min, sum / count, max);
  }
  code = SXCTL_OK;
out:
  sx_segment_close(seg);
  sx_agent_destroy(a);
  return code;
}

const sxctl_cmd sxctl_cmd_ping = {
    .name = "ping",
    .summary = "connect to a segment's owner and time one-byte reads",
    .help = "usage: sxctl ping NAME [--count N] [--timeout-ms MS] [--transport KIND] "
            "[--json]\n"
            "\n"
            "Open NAME, connect to its owner over the transport the agent picks (or\n"
            "--transport) and read one byte --count times (default 3): prints the\n"
            "round-trip time of each (the first includes connecting) and which\n"
            "transport answered.  Exit 0 success, 1 not found, stale or refused, 2 an\n"
            "error (unreachable, timed out).\n"
            "\n"
            "example:\n"
            "  sxctl ping prefill-0/tp3 --count 5\n",
    .run = ping_run,
};
