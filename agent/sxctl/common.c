/* sxctl helpers: opening the store, messages, formatting, tables. */
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "sxctl.h"

int sxctl_open(sxctl_ctx *ctx, sx_store **out) {
  if (ctx->metadata == NULL) {
    fprintf(stderr, "sxctl: no metadata store given: use --metadata URL or set "
            "SX_METADATA_URL (e.g. redis://127.0.0.1:6379?namespace=default)\n");
    return SXCTL_ERROR;
  }
  int rc = sx_store_open(ctx->metadata, out);
  if (rc != 0) {
    /* The library's message names the URL without its password and hints
     * at the cause. */
    fprintf(stderr, "sxctl: %s: %s\n", sx_err_name(rc), sx_errmsg());
    return SXCTL_ERROR;
  }
  return SXCTL_OK;
}

void sxctl_err(const sxctl_cmd *cmd, const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, "sxctl %s: ", cmd->name);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
}

int sxctl_usage(const sxctl_cmd *cmd, const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, "sxctl %s: ", cmd->name);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\n\n%s", cmd->help);
  return SXCTL_ERROR;
}

int sxctl_is_help(const sxctl_cmd *cmd, const char *arg) {
  if (strcmp(arg, "-h") != 0 && strcmp(arg, "--help") != 0)
    return 0;
  fputs(cmd->help, stdout);
  return 1;
}

const char *sxctl_bytes(uint64_t n, char *buf, size_t size) {
  static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = (double)n;
  int u = 0;
  while (v >= 1024 && u < 6) {
    v /= 1024;
    u++;
  }
  if (u == 0)
    snprintf(buf, size, "%" PRIu64 " B", n);
  else
    snprintf(buf, size, "%.1f %s", v, unit[u]);
  return buf;
}

const char *sxctl_duration(int64_t ms, char *buf, size_t size) {
  if (ms < 0)
    snprintf(buf, size, "-");
  else if (ms < 1000)
    snprintf(buf, size, "%" PRId64 "ms", ms);
  else if (ms < 60000)
    snprintf(buf, size, "%.1fs", (double)ms / 1000);
  else if (ms < 3600000)
    snprintf(buf, size, "%" PRId64 "m%02" PRId64 "s", ms / 60000, ms / 1000 % 60);
  else if (ms < 86400000)
    snprintf(buf, size, "%" PRId64 "h%02" PRId64 "m", ms / 3600000, ms / 60000 % 60);
  else
    snprintf(buf, size, "%" PRId64 "d%02" PRId64 "h", ms / 86400000, ms / 3600000 % 24);
  return buf;
}

const char *sxctl_short_inc(const uint8_t *inc, char buf[9]) {
  char hex[2 * SX_INCARNATION_LEN + 1];
  sx_hex(inc, SX_INCARNATION_LEN, hex);
  memcpy(buf, hex, 8);
  buf[8] = '\0';
  return buf;
}

const char *sxctl_endpoint(const sx_endpoint *e, char *buf, size_t size) {
  const char *kind = e->kind == SX_TRANSPORT_TCP ? "tcp" : e->kind == SX_TRANSPORT_RDMA ? "rdma"
                   : e->kind == SX_TRANSPORT_CUDA_IPC ? "cuda_ipc" : "?";
  if (strchr(e->addr, ':'))
    snprintf(buf, size, "%s://[%s]:%u", kind, e->addr, e->port);
  else
    snprintf(buf, size, "%s://%s:%u", kind, e->addr, e->port);
  return buf;
}

static char *dup_or_dash(const char *s) {
  char *d = strdup(s && *s ? s : "-");
  if (d == NULL) {
    fprintf(stderr, "sxctl: out of memory\n");
    exit(SXCTL_ERROR);
  }
  return d;
}

static void table_row(sxctl_table *t, va_list ap) {
  if (t->nrows == t->cap) {
    t->cap = t->cap ? 2 * t->cap : 16;
    t->cells = realloc(t->cells, t->cap * (size_t)t->ncols * sizeof(char *));
    if (t->cells == NULL) {
      fprintf(stderr, "sxctl: out of memory\n");
      exit(SXCTL_ERROR);
    }
  }
  for (int c = 0; c < t->ncols; c++)
    t->cells[t->nrows * (size_t)t->ncols + (size_t)c] = dup_or_dash(va_arg(ap, const char *));
  t->nrows++;
}

void sxctl_table_init(sxctl_table *t, int ncols, ...) {
  va_list ap;
  memset(t, 0, sizeof(*t));
  t->ncols = ncols;
  va_start(ap, ncols);
  table_row(t, ap);
  va_end(ap);
}

void sxctl_table_add(sxctl_table *t, ...) {
  va_list ap;
  va_start(ap, t);
  table_row(t, ap);
  va_end(ap);
}

void sxctl_table_print(const sxctl_table *t, FILE *f, const char *indent) {
  size_t w[32] = {0};
  for (size_t r = 0; r < t->nrows; r++)
    for (int c = 0; c < t->ncols && c < 32; c++) {
      size_t l = strlen(t->cells[r * (size_t)t->ncols + (size_t)c]);
      if (l > w[c])
        w[c] = l;
    }
  for (size_t r = 0; r < t->nrows; r++) {
    fputs(indent, f);
    for (int c = 0; c < t->ncols; c++) {
      const char *s = t->cells[r * (size_t)t->ncols + (size_t)c];
      if (c + 1 == t->ncols)
        fprintf(f, "%s\n", s);
      else
        fprintf(f, "%-*s  ", (int)w[c], s);
    }
  }
}

void sxctl_table_free(sxctl_table *t) {
  for (size_t i = 0; i < t->nrows * (size_t)t->ncols; i++)
    free(t->cells[i]);
  free(t->cells);
  memset(t, 0, sizeof(*t));
}
