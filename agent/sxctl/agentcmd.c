/*
 * What the commands that run an agent (read, ping, write) share: the
 * options of the data path and their parsers, the agent and the segment
 * they open, the group shape of whole blocks, and the report.
 */
#include <inttypes.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"
#include "sxctl.h"

static void agent_log(void *arg, sx_log_level level, const char *msg) {
  (void)arg;
  static const char *const names[] = {"error", "warning", "info", "debug"};
  fprintf(stderr, "sxctl: agent %s: %s\n", names[level <= SX_LOG_DEBUG ? level : 3], msg);
}

double sxctl_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ------------------------------------------------------------------ parsers */

int sxctl_parse_u64(const char *s, uint64_t *out) {
  /* strtoull takes blanks and a sign first, reads 010 as octal, and gives
   * ULLONG_MAX with ERANGE for more than 64 bits (--tag 99999999999999999999
   * would be 2^64-1).  The same rule as seeds: decimal without leading
   * zeros, or 0x hex, that fits. */
  const char *end;
  uint64_t v;
  if (sx__parse_num(s, &end, &v) != 0 || *end != '\0')
    return -1;
  *out = v;
  return 0;
}

int sxctl_parse_transport(const char *s, unsigned *out) {
  if (strcmp(s, "tcp") == 0)
    *out = SX_TRANSPORTS_TCP;
  else if (strcmp(s, "rdma") == 0)
    *out = SX_TRANSPORTS_RDMA;
  else if (strcmp(s, "cuda_ipc") == 0)
    *out = SX_TRANSPORTS_CUDA_IPC;
  else if (strcmp(s, "auto") == 0)
    *out = SX_TRANSPORTS_ALL;
  else
    return -1;
  return 0;
}

const char *sxctl_transport_name(sx_transport_kind k) {
  return k == SX_TRANSPORT_RDMA ? "rdma" : k == SX_TRANSPORT_TCP ? "tcp"
       : k == SX_TRANSPORT_CUDA_IPC ? "cuda_ipc" : "none";
}

/* One item of a --blocks list, "A" or "A-B", from *p to the next ',' or
 * the end; *p moves past it and *more says whether a ',' followed.  An empty
 * item ("1,,2", "3,", "") is malformed, not skipped. */
static int list_item(const char **p, uint64_t *a, uint64_t *b, int *more) {
  const char *s = *p, *comma = strchr(s, ',');
  size_t len = comma ? (size_t)(comma - s) : strlen(s);
  char tok[64]; /* two 64-bit numbers in hex and a dash fit */
  if (len == 0 || len >= sizeof(tok))
    return -1;
  memcpy(tok, s, len);
  tok[len] = '\0';
  *p = s + len + (comma != NULL);
  *more = comma != NULL;
  char *dash = strchr(tok, '-');
  if (dash == NULL) {
    if (sxctl_parse_u64(tok, a))
      return -1;
    *b = *a;
    return 0;
  }
  *dash = '\0';
  return sxctl_parse_u64(tok, a) || sxctl_parse_u64(dash + 1, b) || *b < *a ? -1 : 0;
}

/* "random:N", "all", or a list "0-9,17,40-41": first counted (each id below
 * max, at most SXCTL_MAX_BLOCKS in all), then, with out, filled.  The list
 * is read where it lies: no copy of a bounded size cuts a long one short. */
int sxctl_parse_blocks(const char *spec, uint64_t max, uint64_t rand_seed, uint64_t **out,
                       size_t *n) {
  uint64_t count = 0, a, b;
  int rnd = strncmp(spec, "random:", 7) == 0, all = strcmp(spec, "all") == 0, more = 1;
  if (rnd) {
    if (sxctl_parse_u64(spec + 7, &count) || count == 0)
      return -1;
    if (max == 0)
      return -2;
  } else if (all) {
    if (max == 0)
      return -2;
    count = max;
  } else {
    for (const char *p = spec; more;) {
      if (list_item(&p, &a, &b, &more))
        return -1;
      if (b >= max)
        return -2;
      if (b - a >= SXCTL_MAX_BLOCKS - count)
        return -3;
      count += b - a + 1;
    }
  }
  if (count > SXCTL_MAX_BLOCKS)
    return -3;
  *n = (size_t)count;
  if (out == NULL)
    return 0;
  uint64_t *v = malloc((size_t)count * sizeof(*v));
  if (v == NULL)
    return -1;
  size_t k = 0;
  if (rnd) {
    uint64_t x = rand_seed;
    for (uint64_t i = 0; i < count; i++) {
      x ^= x << 13; /* xorshift64: reproducible for a given --seed */
      x ^= x >> 7;
      x ^= x << 17;
      v[k++] = x % max;
    }
  } else if (all) {
    for (uint64_t x = 0; x < count; x++)
      v[k++] = x;
  } else {
    more = 1;
    for (const char *p = spec; more && list_item(&p, &a, &b, &more) == 0;)
      for (uint64_t x = a;; x++) {
        v[k++] = x;
        if (x == b)
          break;
      }
  }
  *out = v;
  return 0;
}

int sxctl_blocks(const sxctl_cmd *cmd, const sxctl_data_opts *o, uint64_t max,
                 const char *has, const char *per, uint64_t **out, size_t *n) {
  int rc = sxctl_parse_blocks(o->blocks, max, o->rand_seed, out, n);
  if (rc == -2) {
    sxctl_err(cmd, "--blocks %s: %s %" PRIu64 " blocks%s", o->blocks, has, max, per);
    return SXCTL_ERROR;
  }
  if (rc == -3) {
    sxctl_err(cmd, "--blocks %s: more than %u blocks at a time (%s %" PRIu64 " blocks%s); "
              "give a list or random:N", o->blocks, SXCTL_MAX_BLOCKS, has, max, per);
    return SXCTL_ERROR;
  }
  if (rc)
    return sxctl_usage(cmd, "--blocks '%s': use random:N, all, or a list like 0-9,17", o->blocks);
  return SXCTL_OK;
}

/* --blocks SPEC as far as it can be judged before the segment is known:
 * its form and, but for `all`, its size.  0, or a usage error. */
static int blocks_spec_usage(const sxctl_cmd *cmd, const char *spec) {
  size_t n;
  int rc = strcmp(spec, "all") == 0 ? 0 : sxctl_parse_blocks(spec, UINT64_MAX, 1, NULL, &n);
  if (rc == -3)
    return sxctl_usage(cmd, "--blocks '%s': more than %u blocks at a time", spec,
                       SXCTL_MAX_BLOCKS);
  if (rc == -1)
    return sxctl_usage(cmd, "--blocks '%s': use random:N, all, or a list like 0-9,17", spec);
  return 0;
}

/* ------------------------------------------------------------------ options */

void sxctl_data_opts_init(sxctl_data_opts *o) {
  memset(o, 0, sizeof(*o));
  o->blocks = "random:100";
  o->batch = 64;
  o->depth = 2;
  o->rand_seed = (uint64_t)time(NULL) | 1;
  o->timeout_ms = 10000;
  o->transports = SX_TRANSPORTS_ALL;
  o->kinds = "tcp, rdma, cuda_ipc or auto";
  o->log_level = SX_LOG_WARN;
}

const char *sxctl_opt_value(const sxctl_cmd *cmd, int argc, char **argv, int *i) {
  if (*i + 1 >= argc) {
    sxctl_usage(cmd, "%s needs a value", argv[*i]);
    return NULL;
  }
  return argv[++*i];
}

/* The options of sxctl_data_opt that take a value. */
static int takes_value(const char *a) {
  static const char *const valued[] = {"--blocks", "--batch", "--depth", "--seed",
                                       "--timeout-ms", "--wait-ms", "--transport"};
  for (size_t k = 0; k < sizeof(valued) / sizeof(valued[0]); k++)
    if (strcmp(a, valued[k]) == 0)
      return 1;
  return 0;
}

int sxctl_data_opt(const sxctl_cmd *cmd, sxctl_data_opts *o, int argc, char **argv, int *i) {
  const char *a = argv[*i], *v;
  uint64_t n;
  if (sxctl_is_help(cmd, a))
    return -1;
  if (strcmp(a, "--json") == 0) {
    o->json = 1;
  } else if (strcmp(a, "--verbose") == 0) {
    o->log_level = SX_LOG_INFO;
  } else if (strcmp(a, "--debug") == 0) {
    o->log_level = SX_LOG_DEBUG;
  } else if (a[0] != '-') {
    if (o->name != NULL)
      return sxctl_usage(cmd, "unexpected argument '%s'", a);
    o->name = a;
  } else if (!takes_value(a)) {
    return sxctl_usage(cmd, "unknown option '%s'", a);
  } else if ((v = sxctl_opt_value(cmd, argc, argv, i)) == NULL) {
    return SXCTL_ERROR;
  } else if (strcmp(a, "--blocks") == 0) {
    if (blocks_spec_usage(cmd, v))
      return SXCTL_ERROR;
    o->blocks = v;
  } else if (strcmp(a, "--batch") == 0 || strcmp(a, "--depth") == 0) {
    if (sxctl_parse_u64(v, &n) || n == 0 || n > 65536)
      return sxctl_usage(cmd, "%s '%s' is not 1..65536", a, v);
    *(a[2] == 'b' ? &o->batch : &o->depth) = n;
  } else if (strcmp(a, "--seed") == 0) {
    if (sxctl_parse_u64(v, &o->rand_seed) || o->rand_seed == 0)
      return sxctl_usage(cmd, "--seed '%s' is not a non-zero number", v);
  } else if (strcmp(a, "--timeout-ms") == 0 || strcmp(a, "--wait-ms") == 0) {
    if (sxctl_parse_u64(v, &n) || n > 3600000)
      return sxctl_usage(cmd, "%s '%s' is not 0..3600000", a, v);
    *(a[2] == 't' ? &o->timeout_ms : &o->wait_ms) = (uint32_t)n;
  } else if (sxctl_parse_transport(v, &o->transports)) { /* --transport */
    return sxctl_usage(cmd, "--transport '%s': use %s", v, o->kinds);
  }
  return 0;
}

/* ------------------------------------------------------------------ agent */

int sxctl_agent_start(const sxctl_cmd *cmd, const sxctl_ctx *ctx, const char *name,
                      const char *listen, unsigned transports, sx_log_level level,
                      sx_agent **out) {
  if (ctx->metadata == NULL) {
    sxctl_err(cmd, "no metadata store given: use --metadata URL or set SX_METADATA_URL");
    return SXCTL_ERROR;
  }
  sx_agent_params p;
  sx_agent_params_init(&p);
  p.name = name;
  p.metadata_url = ctx->metadata;
  p.listen = listen;
  p.transports = transports;
  p.log = agent_log;
  p.log_level = level;
  int rc = sx_agent_create(&p, out);
  if (rc) {
    sxctl_err(cmd, "%s: %s", sx_err_name(rc), sx_errmsg());
    return SXCTL_ERROR;
  }
  return SXCTL_OK;
}

int sxctl_segment_open(const sxctl_cmd *cmd, sx_agent *a, const char *name, uint32_t wait_ms,
                       sx_segment **out) {
  int rc = sx_segment_open(a, name, wait_ms, out);
  if (rc == 0)
    return SXCTL_OK;
  sxctl_err(cmd, "%s: %s: %s", name, sx_err_name(rc), sx_errmsg());
  return rc == SX_ENOENT ? SXCTL_NO : SXCTL_ERROR;
}

void sxctl_group_add(sxctl_group *g, uint32_t *n, const sx_region *R) {
  sxctl_group *s = NULL;
  for (uint32_t k = 0; k < *n && s == NULL; k++)
    if (g[k].group == R->group)
      s = &g[k];
  if (s == NULL) {
    s = &g[(*n)++];
    *s = (sxctl_group){R->group, R->layer_first, R->layer_first + R->layer_count, 0};
  }
  if (R->layer_first < s->layer_first)
    s->layer_first = R->layer_first;
  if (R->layer_first + R->layer_count > s->layer_end)
    s->layer_end = R->layer_first + R->layer_count;
  s->slots |= 1ull << R->slot;
}

void sxctl_pattern_differs(const sxctl_cmd *cmd, const sx_region *R, uint32_t l,
                           uint64_t block, uint64_t bad, uint64_t seed) {
  char s[16];
  sxctl_err(cmd, "verify: block %" PRIu64 " group %u layer %u slot %s (region %u): byte %" PRIu64
            " differs from the pattern of seed %" PRIu64, block, R->group, R->layer_first + l,
            sx_slot_name(R->slot, s), R->id, bad, seed);
}

/* ------------------------------------------------------------------ batches */

int sxctl_batch_finish(const sxctl_cmd *cmd, sx_batch *b, sx_batch_result *res) {
  sx_batch_wait(b, -1);
  sx_batch_result_get(b, res);
  if (res->state == SX_BATCH_COMPLETED)
    return SXCTL_OK;
  sxctl_err(cmd, "batch %s: %s: %s", sx_batch_state_name(res->state), sx_err_name(res->error),
            res->message);
  return SXCTL_ERROR;
}

int sxctl_pipeline(const sxctl_data_opts *o, const uint64_t *blocks, size_t n,
                   const sxctl_pipe_ops *ops, void *arg) {
  sx_batch **inflight = calloc(o->depth, sizeof(*inflight));
  if (inflight == NULL)
    return SXCTL_ERROR;
  int code = SXCTL_OK;
  size_t next = 0, done = 0;
  while (done < n && code == SXCTL_OK) {
    for (uint64_t s = 0; s < o->depth && next < n && code == SXCTL_OK; s++) {
      if (inflight[s] != NULL)
        continue;
      size_t k = n - next < o->batch ? n - next : o->batch;
      code = ops->start(arg, blocks + next, k, s * o->batch, next / o->batch, &inflight[s]);
      next += k;
    }
    if (code != SXCTL_OK)
      break;
    /* The batch holding the oldest blocks. */
    uint64_t s = (done / o->batch) % o->depth;
    size_t k = n - done < o->batch ? n - done : o->batch;
    code = ops->done(arg, inflight[s], blocks + done, k, s * o->batch);
    sx_batch_destroy(inflight[s]);
    inflight[s] = NULL;
    done += k;
  }
  for (uint64_t s = 0; s < o->depth; s++)
    sx_batch_destroy(inflight[s]);
  free(inflight);
  return code;
}

/* ------------------------------------------------------------------ report */

json_t *sxctl_report_json(const char *name, const char *via, size_t blocks, uint64_t batches,
                          uint64_t bytes, double seconds, uint64_t verified) {
  json_t *j = json_object();
  json_object_set_new(j, "name", json_string(name));
  json_object_set_new(j, "transport", json_string(via));
  json_object_set_new(j, "blocks", json_integer((json_int_t)blocks));
  json_object_set_new(j, "batches", json_integer((json_int_t)batches));
  json_object_set_new(j, "bytes", json_integer((json_int_t)bytes));
  json_object_set_new(j, "seconds", json_real(seconds));
  json_object_set_new(j, "gb_per_s",
                      json_real(seconds > 0 ? (double)bytes / seconds / 1e9 : 0));
  json_object_set_new(j, "verified_bytes", json_integer((json_int_t)verified));
  return j;
}

void sxctl_json_line(json_t *j) {
  char *s = json_dumps(j, JSON_SORT_KEYS);
  json_decref(j);
  if (s)
    puts(s);
  free(s);
}
