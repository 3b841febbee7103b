/*
 * sxctl: segxfer's admin CLI.  Each subcommand is an sxctl_cmd defined in a
 * cmd_*.c file of this folder; SXCTL_COMMANDS is the registry.  To add one
 * (say `read`, in cmd_read.c), define `const sxctl_cmd sxctl_cmd_read` there
 * and add X(read) to the list below: the declarations, the dispatch table
 * and `sxctl --help` follow from it.
 */
#ifndef SXCTL_H
#define SXCTL_H

#include <stdint.h>
#include <jansson.h>
#include <stdio.h>

#include "segxfer.h"

#define SXCTL_COMMANDS(X) X(ls) X(show) X(check) X(watch) X(rm) X(read) X(ping) X(write)

/* Exit codes, the same for every command. */
enum {
  SXCTL_OK = 0,
  SXCTL_NO = 1,    /* a negative answer: not found, incompatible, refused */
  SXCTL_ERROR = 2, /* trouble: usage, store unreachable, corrupt value */
};

typedef struct sxctl_ctx {
  const char *metadata; /* --metadata or SX_METADATA_URL; NULL if neither */
  const char *prog;     /* "sxctl" */
} sxctl_ctx;

typedef struct sxctl_cmd {
  const char *name;
  const char *summary; /* one line for `sxctl --help` */
  const char *help;    /* usage, options and examples for `sxctl CMD --help` */
  /* argv[0] is the command name; --metadata has been taken out already.
   * Returns an exit code. */
  int (*run)(sxctl_ctx *ctx, int argc, char **argv);
} sxctl_cmd;

#define SXCTL_DECLARE(name) extern const sxctl_cmd sxctl_cmd_##name;
SXCTL_COMMANDS(SXCTL_DECLARE)
#undef SXCTL_DECLARE

/* Open the store named by ctx, or print why not (the URL without password,
 * the error, a hint) and return SXCTL_ERROR. */
int sxctl_open(sxctl_ctx *ctx, sx_store **out);

/* "sxctl CMD: <message>" on stderr. */
void sxctl_err(const sxctl_cmd *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Print a usage error and the command's help; returns SXCTL_ERROR. */
int sxctl_usage(const sxctl_cmd *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* True for -h/--help; prints the help. */
int sxctl_is_help(const sxctl_cmd *cmd, const char *arg);

/* Formatting.  Each writes into buf and returns it. */
const char *sxctl_bytes(uint64_t n, char *buf, size_t size);       /* "256.0 KiB" */
const char *sxctl_duration(int64_t ms, char *buf, size_t size);    /* "4.1s", "-" if < 0 */
const char *sxctl_short_inc(const uint8_t *inc, char buf[9]);      /* first 8 hex digits */
const char *sxctl_endpoint(const sx_endpoint *e, char *buf, size_t size); /* tcp://h:p */


/* A text table with columns sized to their contents. */
typedef struct sxctl_table {
  int ncols;
  size_t nrows, cap;
  char **cells; /* nrows * ncols, row 0 is the header */
} sxctl_table;

void sxctl_table_init(sxctl_table *t, int ncols, ...);   /* the headers */
void sxctl_table_add(sxctl_table *t, ...);               /* ncols strings */
void sxctl_table_print(const sxctl_table *t, FILE *f, const char *indent);
void sxctl_table_free(sxctl_table *t);

/* ---- The commands that run an agent: read, ping, write (agentcmd.c) ---- */

/* At most this many block ids in one --blocks (128 MiB of them): a larger
 * random:N or list, or `all` of a larger pool, is refused, not allocated. */
#define SXCTL_MAX_BLOCKS (1u << 24)

/* Parsers: a number, tcp/rdma/cuda_ipc/auto, and a --blocks SPEC below max
 * (0, -1 malformed, -2 out of range, -3 more than SXCTL_MAX_BLOCKS); with
 * out NULL only checked and counted. */
int sxctl_parse_u64(const char *s, uint64_t *out);
int sxctl_parse_transport(const char *s, unsigned *out);
int sxctl_parse_blocks(const char *spec, uint64_t max, uint64_t rand_seed, uint64_t **out,
                       size_t *n);
const char *sxctl_transport_name(sx_transport_kind k); /* "tcp", ... "none" */
double sxctl_now_s(void);                              /* a monotonic clock */

/* The options read and write share, and their defaults. */
typedef struct sxctl_data_opts {
  const char *name;              /* NAME, the segment */
  const char *blocks;            /* --blocks SPEC: random:100 */
  uint64_t batch, depth;         /* --batch 64, --depth 2 */
  uint64_t rand_seed;            /* --seed: the time */
  uint32_t timeout_ms, wait_ms;  /* --timeout-ms 10000, --wait-ms 0 */
  unsigned transports;           /* --transport: auto */
  const char *kinds;             /* what --transport's usage message offers */
  int json;                      /* --json */
  sx_log_level log_level;        /* the agent's: warnings; --verbose, --debug */
} sxctl_data_opts;

void sxctl_data_opts_init(sxctl_data_opts *o);
/* Take argv[*i], which the command did not take itself: -h/--help (prints
 * the help, returns -1), one of the options above (with its value, moving
 * *i on) or NAME (returns 0), else a usage error (returns SXCTL_ERROR). */
int sxctl_data_opt(const sxctl_cmd *cmd, sxctl_data_opts *o, int argc, char **argv, int *i);
/* The value of option argv[*i], moving *i on; NULL after a usage message
 * if there is none. */
const char *sxctl_opt_value(const sxctl_cmd *cmd, int argc, char **argv, int *i);
/* Parse o's --blocks below max, or say why not ("--blocks SPEC: <has> max
 * blocks<per>" when out of range) and return SXCTL_ERROR. */
int sxctl_blocks(const sxctl_cmd *cmd, const sxctl_data_opts *o, uint64_t max,
                 const char *has, const char *per, uint64_t **out, size_t *n);

/* An agent on ctx's store: a reader (name NULL) or the named one on listen
 * (NULL: any port), its messages from level up on stderr.  Says why not and
 * returns SXCTL_ERROR if it cannot start. */
int sxctl_agent_start(const sxctl_cmd *cmd, const sxctl_ctx *ctx, const char *name,
                      const char *listen, unsigned transports, sx_log_level level,
                      sx_agent **out);
/* sx_segment_open, or say why not: SXCTL_NO if it is not published. */
int sxctl_segment_open(const sxctl_cmd *cmd, sx_agent *a, const char *name, uint32_t wait_ms,
                       sx_segment **out);

/* The shape of whole blocks of one group: every layer and slot of it that
 * the regions added have. */
typedef struct sxctl_group {
  uint32_t group, layer_first, layer_end;
  uint64_t slots;
} sxctl_group;

/* Widen R's group in g[0..*n) to take R in, adding the group if new (g has
 * room for one per region). */
void sxctl_group_add(sxctl_group *g, uint32_t *n, const sx_region *R);
/* "verify: block B group G layer L slot S (region R): byte X differs ..."
 * for layer l of R. */
void sxctl_pattern_differs(const sxctl_cmd *cmd, const sx_region *R, uint32_t l,
                           uint64_t block, uint64_t bad, uint64_t seed);

/* Wait for b and take its result: SXCTL_OK if it completed, else say why
 * and return SXCTL_ERROR. */
int sxctl_batch_finish(const sxctl_cmd *cmd, sx_batch *b, sx_batch_result *res);

/* How a command moves the blocks of sxctl_pipeline. */
typedef struct sxctl_pipe_ops {
  /* Start batch number `index` (from 0): blocks[0..n) with local blocks
   * [first, +n).  SXCTL_OK, or an exit code after saying why. */
  int (*start)(void *arg, const uint64_t *blocks, size_t n, uint64_t first, uint64_t index,
               sx_batch **out);
  /* Wait for b, started with those arguments, and take its result (b is
   * destroyed afterwards).  SXCTL_OK to go on, or an exit code. */
  int (*done)(void *arg, sx_batch *b, const uint64_t *blocks, size_t n, uint64_t first);
} sxctl_pipe_ops;

/* Move blocks[0..n) in batches of o->batch blocks, up to o->depth in flight,
 * each on its own slice of the local mirror (slice s: local blocks
 * [s * o->batch, +o->batch)); the oldest is waited for first and its slice
 * reused.  SXCTL_OK, or the first exit code of ops (SXCTL_ERROR if memory
 * runs out); no batch is left behind. */
int sxctl_pipeline(const sxctl_data_opts *o, const uint64_t *blocks, size_t n,
                   const sxctl_pipe_ops *ops, void *arg);

/* The --json figures read and write both report; the caller adds its own. */
json_t *sxctl_report_json(const char *name, const char *via, size_t blocks, uint64_t batches,
                          uint64_t bytes, double seconds, uint64_t verified);
/* Print j on one line (keys sorted) and release it. */
void sxctl_json_line(json_t *j);

#endif
