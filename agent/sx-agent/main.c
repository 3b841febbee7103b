/*
 * sx-agent: host a memory pool as a segment.  It registers the pool's
 * regions (a layout given by flags or a layout file), optionally fills them
 * with the verification pattern, publishes the segment, keeps its lease and
 * serves reads until SIGTERM/SIGINT, when it unpublishes and exits 0.
 */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "agent_int.h"
#include "http.h"
#include "mem/mem.h"
#include "pattern.h"
#include "segxfer.h"
#include "segxfer/agent.h"

/* Exit codes. */
enum { EXIT_CLEAN = 0, EXIT_REFUSED = 1, EXIT_USAGE = 2, EXIT_FENCED = 3 };

static const char usage_text[] =
    "usage: sx-agent --name NAME [--metadata URL] [layout] [options]\n"
    "\n"
    "Host a memory pool as a segxfer segment: register it, publish it under NAME,\n"
    "renew its lease and serve reads until SIGTERM or SIGINT (then unpublish and\n"
    "exit 0).  One log line per event on stderr.\n"
    "\n"
    "  --name NAME            segment name (required), e.g. prefill-0/tp3\n"
    "  --metadata URL         metadata store (default: $SX_METADATA_URL), e.g.\n"
    "                         redis://127.0.0.1:6379?namespace=demo\n"
    "  --listen HOST:PORT     data-plane address (default 0.0.0.0:0, any port)\n"
    "  --advertise HOST       address peers connect to (default: the listen host,\n"
    "                         or the interface that routes to the store)\n"
    "  --transport KIND       tcp, rdma or auto (default auto: RDMA where a device\n"
    "                         exists, TCP always)\n"
    "  --rdma-devices LIST    RDMA devices to serve on, e.g. mlx5_0,mlx5_1 (default:\n"
    "                         every device with an active port)\n"
    "  --rdma-gpu TIER        how RDMA carries GPU memory: auto (default: dma-buf,\n"
    "                         then peermem, then staged), dmabuf, peermem, staged,\n"
    "                         off (SX_RDMA_GPU overrides it; docs/gpu.md)\n"
    "  --rdma-gid-index N     GID index on every RDMA port (default: a RoCE v2 GID\n"
    "                         with an IPv4 address; index 0 on InfiniBand)\n"
    "  --lease-ms N           lease (default 5000; renewed every lease/3)\n"
    "  --takeover             replace a live holder of NAME (it is fenced)\n"
    "  --label KEY=VALUE      published label (repeatable)\n"
    "  --metrics-listen ADDR  serve Prometheus metrics on http://ADDR/metrics, and\n"
    "                         /ready (200 once published with the lease held, else\n"
    "                         503) and /healthz for probes; ADDR is IP:PORT,\n"
    "                         [IPv6]:PORT or :PORT (every IPv4 address)\n"
    "  --hugepages SIZE       back the pool with huge pages of SIZE, 2M or 1G (fewer\n"
    "                         pages to register for RDMA); they must be reserved\n"
    "                         (vm.nr_hugepages, or the pod's hugepages limit)\n"
    "  --location LOC         put the pool in cpu memory (default) or on GPU cuda:N\n"
    "                         (one device allocation; served over tcp through pinned\n"
    "                         staging, to readers on this host over cuda_ipc)\n"
    "  --fill SEED            fill every region with the verification pattern of SEED\n"
    "                         (decimal or 0x-hex); readers check it with\n"
    "                         `sxctl read NAME --verify SEED`\n"
    "  --writable             let granted producers write the pool (push mode;\n"
    "                         docs/push.md); each completed write batch's notice is\n"
    "                         logged (as every reader's read notice is)\n"
    "  --grant NAME           grant writes to producer segment NAME, any incarnation\n"
    "                         (repeatable); '*' grants every segment of the namespace\n"
    "  --log-level LEVEL      error, warn, info (default) or debug\n"
    "  -h, --help             this text\n"
    "  --version              print the version\n"
    "\n"
    "layout by flags (one region per slot, all layers in it):\n"
    "  --layers N             layers (default 1)\n"
    "  --block-bytes N        bytes per block (default 64K; K/M/G suffixes)\n"
    "  --num-blocks N         blocks per layer and slot\n"
    "  --pool-size N          instead of --num-blocks: the pool's total size, split\n"
    "                         over layers x slots x block-bytes\n"
    "  --slots LIST           slots, each once, e.g. K,V (default) or K,V,index\n"
    "  --group N              KV-cache group (default 0)\n"
    "  --dtype D              e.g. bf16 (default), fp8_e4m3\n"
    "  --fingerprint F        model/layout fingerprint (default \"sx-agent\")\n"
    "  --tag T                layout tag, e.g. NHD (default)\n"
    "layout from a file:\n"
    "  --layout FILE          JSON layout file (see docs/architecture.md; `sxctl show --json`\n"
    "                         output is one); --dtype, --fingerprint, --tag override\n"
    "\n"
    "The fill pattern: byte o of region r is byte (o % 8) of\n"
    "splitmix64((SEED ^ r*0xD1B54A32D192ED03) + (o/8)*0x9E3779B97F4A7C15), little-endian.\n"
    "\n"
    "exit status: 0 after SIGTERM/SIGINT, 1 the name is held or refused, 2 usage or\n"
    "configuration errors or no store at start, 3 fenced (another agent took the name\n"
    "over).  A store outage later, even at the first publish, is waited out.\n"
    "\n"
    "examples:\n"
    "  sx-agent --name pool-0 --metadata redis://127.0.0.1:6379 \\\n"
    "           --layers 32 --block-bytes 64K --pool-size 1G --fill 42\n"
    "  sx-agent --name prefill-0/tp3 --layout llama70b.json --listen 10.0.0.5:7400\n";

static sx_log_level log_level = SX_LOG_INFO;

static void say(sx_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void say(sx_log_level level, const char *fmt, ...) {
  if (level > log_level)
    return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  sx__log_stderr(NULL, level, msg);
}

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int usage_error(const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, "sx-agent: ");
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\n(sx-agent --help for usage)\n");
  return EXIT_USAGE;
}

/* "64K", "1G", "4096" -> bytes; 0 on success. */
/* One line per completed write batch (push mode) or notifying read batch
 * (a reader's SX_BATCH_NOTIFY), taken, so that the queue of a daemon nobody
 * reads never fills and readers' notices are never refused for it. */
static int log_notice(void *arg, const sx_notice *n) {
  (void)arg;
  char inc[2 * SX_INCARNATION_LEN + 1];
  sx_hex(n->incarnation, SX_INCARNATION_LEN, inc);
  say(SX_LOG_INFO, "%s: %s (incarnation %.8s) %s %lu bytes in %u block runs and %u ranges, "
      "tag %lu", n->kind == SX_NOTICE_READ ? "read notice" : "notice",
      n->producer[0] ? n->producer : "(unnamed reader)", inc,
      n->kind == SX_NOTICE_READ ? "read" : "wrote", (unsigned long)n->bytes, n->n_blocks,
      n->n_ranges, (unsigned long)n->tag);
  return 1;
}

static int parse_size(const char *s, uint64_t *out) {
  /* NUMBER [K|M|G|T [i]] [B]: decimal or 0x hex digits first (no blank,
   * sign or octal), then at most one unit; "5BB" and "5iB" are no sizes. */
  const char *end;
  uint64_t v;
  if (sx__parse_num(s, &end, &v) != 0)
    return -1;
  uint64_t mul = 1;
  switch (*end) {
  case 'k': case 'K': mul = 1ull << 10; break;
  case 'm': case 'M': mul = 1ull << 20; break;
  case 'g': case 'G': mul = 1ull << 30; break;
  case 't': case 'T': mul = 1ull << 40; break;
  default: break;
  }
  if (mul > 1 && *++end == 'i')
    end++;
  if (*end == 'B')
    end++;
  if (*end != '\0' || (v && mul > UINT64_MAX / v))
    return -1;
  *out = v * mul;
  return 0;
}

typedef struct options {
  const char *name, *metadata, *listen, *advertise, *layout_file;
  const char *dtype, *fingerprint, *tag;
  const char *metrics_listen, *rdma_devices;
  int gid_index;
  uint32_t rdma_gpu; /* SX_RDMA_GPU_* */
  uint64_t hugepage; /* 0: ordinary pages */
  unsigned transports;
  uint32_t lease_ms, layers, group;
  uint64_t block_bytes, num_blocks, pool_size;
  uint32_t slots[SX_MAX_SLOTS];
  uint32_t n_slots;
  int fill, takeover, writable;
  const char *location; /* NULL: the layout's (cpu) */
  uint64_t seed;
  const char *grants[16];
  uint32_t n_grants;
  sx_label labels[SX_MAX_LABELS];
  uint32_t n_labels;
} options;

/* K,V,index: names or numbers, each once (a slot twice would be two
 * regions on one key, refused only at register, after the pool was made). */
static int parse_slots(const char *s, options *o) {
  o->n_slots = 0;
  for (const char *p = s;; p++) {
    const char *comma = strchr(p, ',');
    size_t len = comma ? (size_t)(comma - p) : strlen(p);
    char tok[32];
    uint32_t slot;
    if (len == 0)
      return usage_error("--slots '%s': an empty slot name", s);
    if (len >= sizeof(tok) || o->n_slots == SX_MAX_SLOTS)
      return usage_error("--slots '%s': at most %d slots of names or numbers, e.g. "
                         "K,V,index", s, SX_MAX_SLOTS);
    memcpy(tok, p, len);
    tok[len] = '\0';
    if (sx_slot_parse(tok, &slot) != 0)
      return usage_error("--slots '%s': %s", s, sx_errmsg());
    for (uint32_t i = 0; i < o->n_slots; i++)
      if (o->slots[i] == slot)
        return usage_error("--slots '%s': slot %s is given twice", s, tok);
    o->slots[o->n_slots++] = slot;
    if (comma == NULL)
      return 0;
    p = comma;
  }
}

/* --dtype, --fingerprint, --tag: published as given or not at all (a value
 * cut to the field's size would be another fingerprint, and readers would
 * check against it).  0, or the usage error said. */
static int layout_text(const char *opt, size_t max, const char **out) {
  if (strlen(optarg) > max)
    return usage_error("--%s '%s' is longer than %zu bytes", opt, optarg, max);
  *out = optarg;
  return 0;
}

static int parse_args(int argc, char **argv, options *o) {
  enum {
    O_NAME = 256, O_METADATA, O_LISTEN, O_ADVERTISE, O_POOL, O_LAYERS, O_BLOCK,
    O_NBLOCKS, O_SLOTS, O_GROUP, O_DTYPE, O_FP, O_TAG, O_LAYOUT, O_FILL, O_LOCATION, O_LEASE,
    O_TRANSPORT, O_TAKEOVER, O_LOG, O_LABEL, O_METRICS, O_RDMA_DEVICES, O_GID, O_HUGE, O_HELP,
    O_VERSION, O_WRITABLE, O_GRANT, O_RDMA_GPU
  };
  static const struct option opts[] = {
      {"name", required_argument, NULL, O_NAME},
      {"metadata", required_argument, NULL, O_METADATA},
      {"listen", required_argument, NULL, O_LISTEN},
      {"advertise", required_argument, NULL, O_ADVERTISE},
      {"pool-size", required_argument, NULL, O_POOL},
      {"layers", required_argument, NULL, O_LAYERS},
      {"block-bytes", required_argument, NULL, O_BLOCK},
      {"num-blocks", required_argument, NULL, O_NBLOCKS},
      {"slots", required_argument, NULL, O_SLOTS},
      {"group", required_argument, NULL, O_GROUP},
      {"dtype", required_argument, NULL, O_DTYPE},
      {"fingerprint", required_argument, NULL, O_FP},
      {"tag", required_argument, NULL, O_TAG},
      {"layout", required_argument, NULL, O_LAYOUT},
      {"fill", required_argument, NULL, O_FILL},
      {"location", required_argument, NULL, O_LOCATION},
      {"lease-ms", required_argument, NULL, O_LEASE},
      {"transport", required_argument, NULL, O_TRANSPORT},
      {"takeover", no_argument, NULL, O_TAKEOVER},
      {"log-level", required_argument, NULL, O_LOG},
      {"label", required_argument, NULL, O_LABEL},
      {"metrics-listen", required_argument, NULL, O_METRICS},
      {"rdma-devices", required_argument, NULL, O_RDMA_DEVICES},
      {"rdma-gpu", required_argument, NULL, O_RDMA_GPU},
      {"rdma-gid-index", required_argument, NULL, O_GID},
      {"hugepages", required_argument, NULL, O_HUGE},
      {"writable", no_argument, NULL, O_WRITABLE},
      {"grant", required_argument, NULL, O_GRANT},
      {"help", no_argument, NULL, O_HELP},
      {"version", no_argument, NULL, O_VERSION},
      {NULL, 0, NULL, 0},
  };
  memset(o, 0, sizeof(*o));
  o->metadata = getenv("SX_METADATA_URL");
  o->transports = SX_TRANSPORTS_ALL;
  o->gid_index = -1;
  o->lease_ms = 5000;
  o->layers = 1;
  o->block_bytes = 64 << 10;
  o->slots[0] = SX_SLOT_K;
  o->slots[1] = SX_SLOT_V;
  o->n_slots = 2;
  uint64_t v;
  int c;
  opterr = 0;
  /* The leading ':' makes a missing value ':' rather than '?' (which read
   * "unknown option '--layers'" for '--layers' at the end). */
  while ((c = getopt_long(argc, argv, ":h", opts, NULL)) != -1) {
    switch (c) {
    case O_NAME: o->name = optarg; break;
    case O_METADATA: o->metadata = optarg; break;
    case O_LISTEN: o->listen = optarg; break;
    case O_ADVERTISE: o->advertise = optarg; break;
    case O_LAYOUT: o->layout_file = optarg; break;
    case O_DTYPE:
      if (layout_text("dtype", SX_TAG_MAX, &o->dtype))
        return EXIT_USAGE;
      break;
    case O_FP:
      if (layout_text("fingerprint", SX_FINGERPRINT_MAX, &o->fingerprint))
        return EXIT_USAGE;
      break;
    case O_TAG:
      if (layout_text("tag", SX_TAG_MAX, &o->tag))
        return EXIT_USAGE;
      break;
    case O_TAKEOVER: o->takeover = 1; break;
    case O_WRITABLE: o->writable = 1; break;
    case O_GRANT:
      if (o->n_grants == sizeof(o->grants) / sizeof(o->grants[0]) ||
          (strcmp(optarg, "*") != 0 && sx_name_validate(optarg) != 0))
        return usage_error("--grant '%s': a segment name or '*' (at most 16)", optarg);
      o->grants[o->n_grants++] = optarg;
      break;
    case O_METRICS: o->metrics_listen = optarg; break;
    case O_RDMA_DEVICES: o->rdma_devices = optarg; break;
    case O_RDMA_GPU: {
      static const char *const tiers[] = {"auto", "dmabuf", "peermem", "staged", "off"};
      uint32_t k = 0;
      while (k < 5 && strcmp(optarg, tiers[k]) != 0)
        k++;
      if (k == 5)
        return usage_error("--rdma-gpu '%s': use auto, dmabuf, peermem, staged or off", optarg);
      _Static_assert(SX_RDMA_GPU_STAGED == 3 && SX_RDMA_GPU_OFF == 4, "tiers[] order");
      o->rdma_gpu = k;
      break;
    }
    case O_HUGE:
      if (parse_size(optarg, &o->hugepage) ||
          (o->hugepage != (2ull << 20) && o->hugepage != (1ull << 30)))
        return usage_error("--hugepages '%s': use 2M or 1G", optarg);
      break;
    case O_GID:
      if (parse_size(optarg, &v) || v > 255)
        return usage_error("--rdma-gid-index '%s' is not 0..255", optarg);
      o->gid_index = (int)v;
      break;
    case O_POOL:
      if (parse_size(optarg, &o->pool_size) || o->pool_size == 0)
        return usage_error("--pool-size '%s' is not a size", optarg);
      break;
    case O_BLOCK:
      if (parse_size(optarg, &o->block_bytes) || o->block_bytes == 0)
        return usage_error("--block-bytes '%s' is not a size", optarg);
      break;
    case O_NBLOCKS:
      if (parse_size(optarg, &o->num_blocks) || o->num_blocks == 0)
        return usage_error("--num-blocks '%s' is not a count", optarg);
      break;
    case O_LAYERS:
      if (parse_size(optarg, &v) || v == 0 || v > UINT32_MAX)
        return usage_error("--layers '%s' is not a count", optarg);
      o->layers = (uint32_t)v;
      break;
    case O_GROUP:
      if (parse_size(optarg, &v) || v > UINT32_MAX)
        return usage_error("--group '%s' is not a number", optarg);
      o->group = (uint32_t)v;
      break;
    case O_LEASE:
      if (parse_size(optarg, &v) || v < 100 || v > 3600000)
        return usage_error("--lease-ms '%s' is not 100..3600000", optarg);
      o->lease_ms = (uint32_t)v;
      break;
    case O_SLOTS:
      if (parse_slots(optarg, o))
        return EXIT_USAGE;
      break;
    case O_LOCATION: {
      sx__mem_info m;
      if (sx__mem_parse_location(optarg, &m) != 0)
        return usage_error("--location '%s': use cpu or cuda:N", optarg);
      o->location = optarg;
      break;
    }
    case O_FILL:
      if (sx__pattern_parse(optarg, &o->seed))
        return usage_error("--fill: %s", sx_errmsg());
      o->fill = 1;
      break;
    case O_TRANSPORT:
      if (strcmp(optarg, "tcp") == 0)
        o->transports = SX_TRANSPORTS_TCP;
      else if (strcmp(optarg, "rdma") == 0)
        o->transports = SX_TRANSPORTS_RDMA;
      else if (strcmp(optarg, "auto") == 0)
        o->transports = SX_TRANSPORTS_ALL;
      else
        return usage_error("--transport '%s': use tcp, rdma or auto", optarg);
      break;
    case O_LOG:
      if (strcmp(optarg, "error") == 0)
        log_level = SX_LOG_ERROR;
      else if (strcmp(optarg, "warn") == 0)
        log_level = SX_LOG_WARN;
      else if (strcmp(optarg, "info") == 0)
        log_level = SX_LOG_INFO;
      else if (strcmp(optarg, "debug") == 0)
        log_level = SX_LOG_DEBUG;
      else
        return usage_error("--log-level '%s': use error, warn, info or debug", optarg);
      break;
    case O_LABEL: {
      const char *eq = strchr(optarg, '=');
      sx_label *l = &o->labels[o->n_labels];
      if (eq == NULL || eq == optarg || o->n_labels == SX_MAX_LABELS ||
          (size_t)(eq - optarg) > SX_LABEL_KEY_MAX || strlen(eq + 1) > SX_LABEL_VALUE_MAX)
        return usage_error("--label '%s': use KEY=VALUE (at most %d)", optarg,
                           SX_MAX_LABELS);
      memcpy(l->key, optarg, (size_t)(eq - optarg));
      l->key[eq - optarg] = '\0';
      snprintf(l->value, sizeof(l->value), "%s", eq + 1);
      o->n_labels++;
      break;
    }
    case O_HELP:
    case 'h':
      fputs(usage_text, stdout);
      exit(EXIT_CLEAN);
    case O_VERSION:
      printf("sx-agent (segxfer %s)\n", sx_version());
      exit(EXIT_CLEAN);
    case ':':
      return usage_error("%s needs a value", argv[optind - 1]);
    default: {
      /* getopt says '?' for --takeover=1 too (with optopt naming it): a
       * value given to an option that takes none is no unknown option. */
      const char *arg = argv[optind - 1], *eq = strchr(arg, '=');
      if (strncmp(arg, "--", 2) == 0 && eq != NULL) {
        for (const struct option *x = opts; x->name != NULL && optopt != 0; x++)
          if (x->val == optopt && x->has_arg == no_argument)
            return usage_error("--%s takes no value ('%s')", x->name, arg);
        return usage_error("unknown option '%.*s'", (int)(eq - arg), arg);
      }
      return usage_error("unknown option '%s'", arg);
    }
    }
  }
  if (optind < argc)
    return usage_error("unexpected argument '%s'", argv[optind]);
  if (o->name == NULL)
    return usage_error("--name is required");
  if (o->metadata == NULL || o->metadata[0] == '\0')
    return usage_error("no metadata store: use --metadata URL or set SX_METADATA_URL");
  if (o->layout_file == NULL && o->num_blocks == 0 && o->pool_size == 0)
    return usage_error("give --num-blocks, --pool-size or --layout");
  return 0;
}

/* The regions to register: from the layout file or from the flags.
 * d gets layout and regions (addresses still 0). */
static int build_layout(const options *o, sx_desc *d) {
  if (o->layout_file != NULL) {
    int rc = sx_layout_load(o->layout_file, d);
    if (rc) {
      fprintf(stderr, "sx-agent: --layout %s: %s: %s\n", o->layout_file, sx_err_name(rc),
              sx_errmsg());
      return EXIT_USAGE;
    }
    if (d->n_regions == 0) {
      fprintf(stderr, "sx-agent: --layout %s has no regions\n", o->layout_file);
      sx_desc_free(d);
      return EXIT_USAGE;
    }
  } else {
    sx_desc_init(d);
    /* Sizes multiply: one that wraps 64 bits would map a pool of the
     * remainder and publish regions of wrapped lengths. */
    uint64_t per_block_row, nb = o->num_blocks, layer_stride, length, pool;
    if (__builtin_mul_overflow((uint64_t)o->layers * o->n_slots, o->block_bytes,
                               &per_block_row))
      return usage_error("--layers %u x %u slots x --block-bytes %lu is more than 2^64 bytes",
                         o->layers, o->n_slots, (unsigned long)o->block_bytes);
    if (nb == 0)
      nb = o->pool_size / per_block_row;
    if (nb == 0)
      return usage_error("--pool-size %lu is smaller than one block per layer and slot "
                         "(%lu bytes)", (unsigned long)o->pool_size,
                         (unsigned long)per_block_row);
    if (__builtin_mul_overflow(nb, o->block_bytes, &layer_stride) ||
        __builtin_mul_overflow(layer_stride, (uint64_t)o->layers, &length) ||
        __builtin_mul_overflow(per_block_row, nb, &pool))
      return usage_error("--layers %u x %u slots x --num-blocks %lu x --block-bytes %lu is "
                         "more than 2^64 bytes", o->layers, o->n_slots, (unsigned long)nb,
                         (unsigned long)o->block_bytes);
    if (o->pool_size && o->num_blocks && o->pool_size < pool)
      return usage_error("--pool-size is smaller than layers x slots x blocks x bytes");
    for (uint32_t i = 0; i < o->n_slots; i++) {
      sx_region r;
      memset(&r, 0, sizeof(r));
      r.id = i;
      r.group = o->group;
      r.layer_count = o->layers;
      r.layer_stride = layer_stride;
      r.slot = o->slots[i];
      r.block_bytes = r.block_stride = o->block_bytes;
      r.num_blocks = nb;
      r.length = length;
      if (sx_desc_add_region(d, &r) != 0)
        return usage_error("too many slots");
    }
    snprintf(d->layout.fingerprint, sizeof(d->layout.fingerprint), "sx-agent");
    snprintf(d->layout.tag, sizeof(d->layout.tag), "NHD");
    snprintf(d->layout.dtype, sizeof(d->layout.dtype), "bf16");
  }
  if (o->fingerprint)
    snprintf(d->layout.fingerprint, sizeof(d->layout.fingerprint), "%s", o->fingerprint);
  if (o->tag)
    snprintf(d->layout.tag, sizeof(d->layout.tag), "%s", o->tag);
  if (o->dtype)
    snprintf(d->layout.dtype, sizeof(d->layout.dtype), "%s", o->dtype);
  return 0;
}

/* Bytes a region needs: its length, at least its blocks' span. */
static uint64_t region_bytes(const sx_region *r) {
  uint64_t span = (uint64_t)(r->layer_count - 1) * r->layer_stride +
                  (r->num_blocks - 1) * r->block_stride + r->block_bytes;
  return r->length > span ? r->length : span;
}

/* The pool: host memory (mmap) or one device allocation (--location). */
static uint8_t *pool_alloc(const options *o, uint64_t total, int mflags) {
  sx__mem_info where;
  if (o->location != NULL && sx__mem_parse_location(o->location, &where) == 0 &&
      where.kind == SX__MEM_CUDA) {
    void *p;
    if (sx__mem_alloc(where.device, total, &p) != 0) {
      fprintf(stderr, "sx-agent: cannot allocate a pool of %lu bytes on %s: %s\n",
              (unsigned long)total, o->location, sx_errmsg());
      return NULL;
    }
    return p;
  }
  uint8_t *pool = mmap(NULL, total, PROT_READ | PROT_WRITE, mflags, -1, 0);
  return pool == MAP_FAILED ? NULL : pool;
}

static void pool_free(const options *o, uint8_t *pool, uint64_t total) {
  if (o->location != NULL && strcmp(o->location, "cpu") != 0)
    sx__mem_free(pool);
  else
    munmap(pool, total);
}

static double ms_since(const struct timespec *t0) {
  struct timespec t1;
  clock_gettime(CLOCK_MONOTONIC, &t1);
  return (double)(t1.tv_sec - t0->tv_sec) * 1e3 + (double)(t1.tv_nsec - t0->tv_nsec) / 1e6;
}

int main(int argc, char **argv) {
  options o;
  int rc = parse_args(argc, argv, &o);
  if (rc)
    return rc;
  sx_desc layout;
  if ((rc = build_layout(&o, &layout)) != 0)
    return rc;

  /* Signals are taken by sigwait() below: block them before any thread
   * starts, so the agent's thread never receives them. */
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, NULL);
  signal(SIGPIPE, SIG_IGN);

  /* One anonymous mapping holds every region, page aligned; with huge
   * pages, the whole mapping is a multiple of the huge page size. */
  uint64_t total = 0, page = o.hugepage ? o.hugepage : 4096;
  for (uint32_t i = 0; i < layout.n_regions; i++) {
    uint64_t b = region_bytes(&layout.regions[i]);
    if (b > UINT64_MAX - page || __builtin_add_overflow(total, (b + 4095) & ~4095ull, &total) ||
        total > UINT64_MAX - page) {
      fprintf(stderr, "sx-agent: the regions need more than 2^64 bytes\n");
      sx_desc_free(&layout);
      return EXIT_USAGE;
    }
  }
  int mflags = MAP_PRIVATE | MAP_ANONYMOUS;
  if (o.hugepage) {
    total = (total + o.hugepage - 1) / o.hugepage * o.hugepage;
    mflags |= MAP_HUGETLB | ((o.hugepage == (1ull << 30) ? 30 : 21) << MAP_HUGE_SHIFT);
  }
  if (o.hugepage && o.location != NULL && strcmp(o.location, "cpu") != 0) {
    fprintf(stderr, "sx-agent: --hugepages is for host memory, not --location %s\n",
            o.location);
    sx_desc_free(&layout);
    return EXIT_USAGE;
  }
  uint8_t *pool = pool_alloc(&o, total, mflags);
  if (pool == NULL && o.location != NULL && strcmp(o.location, "cpu") != 0) {
    sx_desc_free(&layout);
    return EXIT_USAGE;
  }
  if (pool == NULL) {
    int e = errno;
    if (o.hugepage)
      fprintf(stderr, "sx-agent: cannot map a pool of %lu bytes in %s huge pages: %s "
              "(reserve %lu of them: sysctl vm.nr_hugepages, or "
              "/sys/kernel/mm/hugepages/hugepages-%lukB/nr_hugepages)\n",
              (unsigned long)total, o.hugepage == (1ull << 30) ? "1 GiB" : "2 MiB",
              strerror(e), (unsigned long)(total / o.hugepage),
              (unsigned long)(o.hugepage >> 10));
    else
      fprintf(stderr, "sx-agent: cannot map a pool of %lu bytes: %s\n",
              (unsigned long)total, strerror(e));
    sx_desc_free(&layout);
    return EXIT_USAGE;
  }

  sx_agent_params p;
  sx_agent_params_init(&p);
  p.name = o.name;
  p.metadata_url = o.metadata;
  p.listen = o.listen ? o.listen : "0.0.0.0:0";
  p.advertise = o.advertise;
  p.transports = o.transports;
  p.lease_ms = o.lease_ms;
  p.rdma_devices = o.rdma_devices;
  p.rdma_gpu = o.rdma_gpu;
  p.rdma_gid_index = o.gid_index;
  p.layout = layout.layout;
  p.labels = o.n_labels ? o.labels : layout.labels;
  p.n_labels = o.n_labels ? o.n_labels : layout.n_labels;
  p.log = sx__log_stderr;
  p.log_level = log_level;
  sx_agent *a;
  if ((rc = sx_agent_create(&p, &a)) != 0) {
    say(SX_LOG_ERROR, "sx-agent: %s: %s", sx_err_name(rc), sx_errmsg());
    pool_free(&o, pool, total);
    sx_desc_free(&layout);
    return EXIT_USAGE;
  }

  int exit_code = EXIT_USAGE;
  /* Metrics first, so that probes see "not ready" while the pool is filled
   * and published rather than a refused connection. */
  sxa_http *http = NULL;
  if (o.metrics_listen != NULL) {
    char err[300];
    uint16_t port;
    if (sxa_http_start(o.metrics_listen, a, &http, &port, err, sizeof(err)) != 0) {
      say(SX_LOG_ERROR, "sx-agent: %s", err);
      goto out_destroy;
    }
    say(SX_LOG_INFO, "metrics: serving /metrics, /ready and /healthz on port %u (%s)",
        port, o.metrics_listen);
  }
  uint64_t off = 0;
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (uint32_t i = 0; i < layout.n_regions; i++) {
    const sx_region *r = &layout.regions[i];
    uint64_t bytes = region_bytes(r);
    sx_region_params rp = {.addr = pool + off, .length = bytes, .group = r->group,
                           .layer_first = r->layer_first, .layer_count = r->layer_count,
                           .layer_stride = r->layer_stride, .slot = r->slot,
                           .block_bytes = r->block_bytes, .block_stride = r->block_stride,
                           .num_blocks = r->num_blocks,
                           .location = o.location ? o.location
                                       : r->location[0] ? r->location : "cpu",
                           .access = SX_ACCESS_REMOTE_READ |
                                     (o.writable ? SX_ACCESS_REMOTE_WRITE : 0)};
    uint32_t id;
    if ((rc = sx_agent_register(a, &rp, &id)) != 0) {
      say(SX_LOG_ERROR, "sx-agent: region %u: %s: %s", i, sx_err_name(rc), sx_errmsg());
      goto out_destroy;
    }
    /* GPU memory gets the pattern through a host buffer and a copy. */
    if (o.fill && (rc = sx__pattern_fill_any(pool + off, bytes, o.seed, id, 0)) != 0) {
      say(SX_LOG_ERROR, "sx-agent: filling region %u: %s", id, sx_errmsg());
      goto out_destroy;
    }
    off += (bytes + 4095) & ~4095ull;
  }
  char size[32];
  snprintf(size, sizeof(size), "%.1f MiB%s%s", (double)total / (1 << 20),
           o.location ? " on " : "", o.location ? o.location : "");
  if (o.fill)
    say(SX_LOG_INFO, "%s: %u regions, %s, filled with pattern seed %lu in %.0f ms", o.name,
        layout.n_regions, size, (unsigned long)o.seed, ms_since(&t0));
  else
    say(SX_LOG_INFO, "%s: %u regions, %s", o.name, layout.n_regions, size);

  for (uint32_t i = 0; i < o.n_grants; i++) {
    const char *g = strcmp(o.grants[i], "*") == 0 ? NULL : o.grants[i];
    if ((rc = sx_agent_grant_write(a, g, NULL)) != 0) {
      say(SX_LOG_ERROR, "sx-agent: --grant %s: %s: %s", o.grants[i], sx_err_name(rc),
          sx_errmsg());
      goto out_destroy;
    }
  }
  sx_agent_notice_cb(a, log_notice, NULL);
  if ((rc = sx_agent_publish(a, o.takeover ? SX_PUBLISH_TAKEOVER : 0)) != 0) {
    sx_agent_status st;
    if (sx_agent_status_get(a, &st) == 0 && st.state == SX_AGENT_RECLAIMING) {
      /* The store is down or slow, which a daemon lives through: the agent
       * keeps retrying and publishes when the store answers.  (The publish
       * may even have landed with its answer lost.) */
      say(SX_LOG_WARN, "sx-agent: publish: %s: %s; serving anyway and publishing when "
          "the store answers", sx_err_name(rc), sx_errmsg());
    } else {
      say(SX_LOG_ERROR, "sx-agent: publish: %s: %s%s", sx_err_name(rc), sx_errmsg(),
          rc == SX_EHELD ? " (use --takeover to replace it)" : "");
      exit_code = rc == SX_EHELD || rc == SX_EFENCED ? EXIT_REFUSED : EXIT_USAGE;
      goto out_destroy;
    }
  }
  sx_desc d;
  if (sx_agent_descriptor(a, &d) == 0) {
    for (uint32_t i = 0; i < d.n_endpoints; i++)
      say(SX_LOG_INFO, "ready: serving %s on %s://%s:%u", o.name,
          d.endpoints[i].kind == SX_TRANSPORT_RDMA       ? "rdma"
          : d.endpoints[i].kind == SX_TRANSPORT_CUDA_IPC ? "cuda_ipc"
                                                         : "tcp",
          d.endpoints[i].addr, d.endpoints[i].port);
    sx_desc_free(&d);
  }

  /* Wait for a signal; look at the lease once a second. */
  for (;;) {
    struct timespec tick = {.tv_sec = 1};
    int sig = sigtimedwait(&sigs, NULL, &tick);
    if (sig == SIGINT || sig == SIGTERM) {
      say(SX_LOG_INFO, "received %s: unpublishing and stopping",
          sig == SIGINT ? "SIGINT" : "SIGTERM");
      exit_code = EXIT_CLEAN;
      break;
    }
    sx_agent_status st;
    if (sx_agent_status_get(a, &st) == 0 && st.state == SX_AGENT_FENCED) {
      say(SX_LOG_ERROR, "another agent took %s over: stopping", o.name);
      exit_code = EXIT_FENCED;
      break;
    }
  }

out_destroy:
  sxa_http_stop(http);
  sx_agent_destroy(a);
  pool_free(&o, pool, total);
  sx_desc_free(&layout);
  return exit_code;
}
