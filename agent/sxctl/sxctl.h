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

/* Parsers shared by read, ping and write (cmd_read.c): a number, tcp/rdma/
 * auto, and a --blocks SPEC below max (0, -1 malformed, -2 out of range). */
int sxctl_parse_u64(const char *s, uint64_t *out);
int sxctl_parse_transport(const char *s, unsigned *out);
int sxctl_parse_blocks(const char *spec, uint64_t max, uint64_t rand_seed, uint64_t **out,
                       size_t *n);
const char *sxctl_transport_name(sx_transport_kind k);

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

#endif
