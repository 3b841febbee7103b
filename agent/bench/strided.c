/*
 * sx-bench strided: the copy of a token-major read plan's pieces, as plain
 * ranges (one per piece) against strided ranges (one per run of pieces at a
 * fixed stride) against the same bytes as whole contiguous ranges (the
 * equal-layout baseline), on the same GPU memory in the same run.
 *
 * This is the memory layer alone, in this process: the source on
 * --source, the destination on --location (peer access across GPUs, as a
 * cuda_ipc mapping is), every call a gather of the whole request on one
 * stream (sx__mem_gather, sx__mem_gather_strided), --depth calls queued
 * before the stream is waited for.  Piece k of run x is copied from
 * src + (x * pieces + k) * piece (the remote rank's block, contiguous) to
 * dst + x * pieces * lstride + k * lstride (every lstride, the local block
 * holding the other ranks' pieces between).  What the planner and the
 * cuda_ipc transport add per range is measured end to end by
 * `sx-bench plan --order NHD --location cuda:N`.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "mem/mem.h"
#include "pattern.h"
#include "segxfer/agent.h"

const char bx_strided_help[] =
    "usage: sx-bench strided [--location cuda:N] [--source cuda:N] [--runs N]\n"
    "                        [--pieces N] [--piece-bytes SIZE] [--local-stride SIZE]\n"
    "                        [--depth N] [--rounds N] [--method kernel|batch|range|auto]\n"
    "                        [common options]\n"
    "\n"
    "Copy one request of a token-major read plan's pieces (--runs runs of\n"
    "--pieces pieces of --piece-bytes, each run contiguous at the source and\n"
    "every --local-stride at the destination) three ways, round after round:\n"
    "  ranges      one range per piece (sx__mem_gather)\n"
    "  strided     one strided range per run (sx__mem_gather_strided)\n"
    "  contiguous  the same bytes as one range per run, contiguous on both\n"
    "              sides (the equal-layout baseline)\n"
    "Every case is checked byte for byte once.  --duration is the time of each\n"
    "case in each round.\n"
    "\n"
    "  --location L        the destination's GPU (default cuda:0)\n"
    "  --source L          the source's GPU (default: --location)\n"
    "  --runs N            runs per request (default 2048)\n"
    "  --pieces N          pieces per run (default 16)\n"
    "  --piece-bytes SIZE  (default 1K)\n"
    "  --local-stride SIZE the destination stride (default 2 x --piece-bytes)\n"
    "  --depth N           requests queued before waiting (default 8)\n"
    "  --rounds N          rounds of the three cases (default 3)\n"
    "  --method M          the copy method of every case (default kernel)\n";

enum { RANGES, STRIDED, CONTIG, NCASES };
static const char *const case_names[NCASES] = {"ranges", "strided", "contiguous"};

typedef struct sopts {
  int dst_dev, src_dev;
  uint64_t runs, pieces, piece, lstride, depth, rounds;
  sx__mem_copy_method method;
} sopts;

typedef struct sacc {
  uint64_t bytes, calls;
  double secs, host_secs;
} sacc;

static int device_of(const char *loc, int *out) {
  sx__mem_info m;
  if (sx__mem_parse_location(loc, &m) != 0 || m.kind != SX__MEM_CUDA) {
    fprintf(stderr, "sx-bench strided: %s is not cuda:N\n", loc);
    return -1;
  }
  *out = m.device;
  return 0;
}

static int parse(sopts *o, int argc, char **argv) {
  *o = (sopts){.runs = 2048, .pieces = 16, .piece = 1024, .depth = 8, .rounds = 3,
               .method = SX__COPY_KERNEL};
  const char *dst = "cuda:0", *src = NULL;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    int ok = v != NULL;
    if (strcmp(a, "--location") == 0 && ok)
      dst = v;
    else if (strcmp(a, "--source") == 0 && ok)
      src = v;
    else if (strcmp(a, "--runs") == 0 && ok)
      ok = sscanf(v, "%lu", &o->runs) == 1 && o->runs > 0;
    else if (strcmp(a, "--pieces") == 0 && ok)
      ok = sscanf(v, "%lu", &o->pieces) == 1 && o->pieces > 0 && o->pieces < (1u << 30);
    else if (strcmp(a, "--piece-bytes") == 0 && ok)
      ok = bx_parse_size(v, &o->piece) == 0 && o->piece > 0;
    else if (strcmp(a, "--local-stride") == 0 && ok)
      ok = bx_parse_size(v, &o->lstride) == 0;
    else if (strcmp(a, "--depth") == 0 && ok)
      ok = sscanf(v, "%lu", &o->depth) == 1 && o->depth > 0 && o->depth <= 32;
    else if (strcmp(a, "--rounds") == 0 && ok)
      ok = sscanf(v, "%lu", &o->rounds) == 1 && o->rounds > 0;
    else if (strcmp(a, "--method") == 0 && ok) {
      int m = 0;
      while (m < 4 && strcmp(v, sx__mem_copy_name((sx__mem_copy_method)m)) != 0)
        m++;
      ok = m < 4;
      o->method = (sx__mem_copy_method)m;
    } else {
      fprintf(stderr, "sx-bench strided: bad option '%s'\n%s", a, bx_strided_help);
      return -1;
    }
    if (!ok) {
      fprintf(stderr, "sx-bench strided: bad value for %s\n", a);
      return -1;
    }
    i++;
  }
  if (o->lstride == 0)
    o->lstride = 2 * o->piece;
  if (o->lstride < o->piece) {
    fprintf(stderr, "sx-bench strided: --local-stride is below --piece-bytes\n");
    return -1;
  }
  if (device_of(dst, &o->dst_dev) || device_of(src ? src : dst, &o->src_dev))
    return -1;
  return 0;
}

/* The request of case c as its copies. */
static size_t build(const sopts *o, int c, uint64_t src, uint64_t dst, sx__mem_range *rg,
                    sx__mem_strided *sr) {
  uint64_t run = o->pieces * o->piece;
  size_t n = 0;
  for (uint64_t x = 0; x < o->runs; x++) {
    uint64_t s = src + x * run, d = dst + x * o->pieces * o->lstride;
    if (c == STRIDED)
      sr[n++] = (sx__mem_strided){d, s, o->piece, o->pieces, o->lstride, o->piece};
    else if (c == CONTIG)
      rg[n++] = (sx__mem_range){dst + x * run, s, run};
    else
      for (uint64_t k = 0; k < o->pieces; k++)
        rg[n++] = (sx__mem_range){d + k * o->lstride, s + k * o->piece, o->piece};
  }
  return n;
}

/* Did case c land every piece where it belongs? */
static int verify(const sopts *o, int c, const uint8_t *dst, uint64_t dlen) {
  uint8_t *h = malloc(dlen);
  int rc = h == NULL || sx__mem_copy(h, dst, dlen) != 0 ? -1 : 0;
  uint64_t run = o->pieces * o->piece;
  for (uint64_t x = 0; x < o->runs && rc == 0; x++)
    for (uint64_t k = 0; k < o->pieces && rc == 0; k++) {
      uint64_t at = c == CONTIG ? x * run + k * o->piece : (x * o->pieces + k) * o->lstride;
      if (sx__pattern_check(h + at, o->piece, 1, 1, x * run + k * o->piece, NULL) != 0) {
        fprintf(stderr, "sx-bench strided: %s: run %lu piece %lu is wrong\n", case_names[c],
                (unsigned long)x, (unsigned long)k);
        rc = -1;
      }
    }
  free(h);
  return rc;
}

/* One round of case c for secs (the first call checked): adds to *acc. */
static int measure(const sopts *o, int c, sx__mem_stream *s, const sx__mem_range *rg,
                   const sx__mem_strided *sr, size_t n, uint8_t *dst, uint64_t dlen,
                   double secs, int check, sacc *acc) {
  uint64_t bytes = o->runs * o->pieces * o->piece;
  double t0 = bx_now(), host = 0;
  uint64_t calls = 0;
  for (;;) {
    for (uint64_t d = 0; d < o->depth; d++) {
      double h0 = bx_now();
      sx__mem_copy_method used;
      int rc = c == STRIDED ? sx__mem_gather_strided(s, sr, n, SX__GATHER_SM_OK, o->method,
                                                     &used)
                            : sx__mem_gather(s, rg, n, SX__GATHER_SM_OK, o->method, &used);
      host += bx_now() - h0;
      if (rc != 0) {
        fprintf(stderr, "sx-bench strided: %s: %s\n", case_names[c], sx_errmsg());
        return -1;
      }
      if (o->method != SX__COPY_AUTO && used != o->method) {
        fprintf(stderr, "sx-bench strided: %s ran by %s, not %s\n", case_names[c],
                sx__mem_copy_name(used), sx__mem_copy_name(o->method));
        return -1;
      }
      calls++;
    }
    if (sx__mem_stream_sync(s) != 0)
      return -1;
    if (check) {
      if (verify(o, c, dst, dlen) != 0)
        return -1;
      check = 0;
      t0 = bx_now();
      host = 0;
      calls = 0;
      continue;
    }
    double now = bx_now();
    if (now - t0 >= secs) {
      acc->bytes += calls * bytes;
      acc->calls += calls;
      acc->secs += now - t0;
      acc->host_secs += host;
      return 0;
    }
  }
}

int bx_strided_main(const bx_common *co, int argc, char **argv) {
  sopts o;
  if (argc > 1 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
    fputs(bx_strided_help, stdout);
    return BX_OK;
  }
  if (parse(&o, argc, argv) != 0)
    return BX_USAGE;
  uint64_t run = o.pieces * o.piece, slen = o.runs * run, dlen = o.runs * o.pieces * o.lstride;
  size_t nmax = (size_t)(o.runs * o.pieces);
  uint8_t *src = NULL, *dst = NULL, *host = malloc(slen);
  sx__mem_range *rg = malloc(nmax * sizeof(*rg));
  sx__mem_strided *sr = malloc((size_t)o.runs * sizeof(*sr));
  sx__mem_stream *s = NULL;
  int rc = BX_FAIL;
  sacc acc[NCASES] = {{0}};
  if (host == NULL || rg == NULL || sr == NULL ||
      sx__mem_alloc(o.src_dev, slen, (void **)&src) != 0 ||
      sx__mem_alloc(o.dst_dev, dlen, (void **)&dst) != 0 ||
      sx__mem_peer_enable(o.dst_dev, o.src_dev) != 0 ||
      sx__mem_stream_create(o.dst_dev, &s) != 0) {
    fprintf(stderr, "sx-bench strided: %s\n", sx_errmsg());
    goto out;
  }
  sx__pattern_fill(host, slen, 1, 1, 0);
  if (sx__mem_copy(src, host, slen) != 0)
    goto out;
  for (uint64_t r = 0; r < o.rounds; r++) {
    for (int c = 0; c < NCASES; c++) {
      size_t n = build(&o, c, (uint64_t)(uintptr_t)src, (uint64_t)(uintptr_t)dst, rg, sr);
      if (!co->quiet)
        fprintf(stderr, "sx-bench strided: round %lu, %s\n", (unsigned long)r + 1,
                case_names[c]);
      if (measure(&o, c, s, rg, sr, n, dst, dlen, co->duration, r == 0, &acc[c]) != 0)
        goto out;
    }
  }
  bx_report *rep = bx_report_new("strided", co);
  static const bx_col cols[] = {
      {"case", "case", NULL},          {"copies", "copies/request", "%.0f"},
      {"gbps", "GB/s", "%.2f"},        {"us_per_request", "us/request", "%.1f"},
      {"host_us", "host us/request", "%.1f"}, {"vs_contiguous", "vs contiguous", "%.2f"},
  };
  char pb[32], ls[32];
  bx_size_name(o.piece, pb, sizeof(pb));
  bx_size_name(o.lstride, ls, sizeof(ls));
  char title[200];
  snprintf(title, sizeof(title), "%lu runs of %lu x %s pieces (destination every %s), "
           "cuda:%d <- cuda:%d, by %s", (unsigned long)o.runs, (unsigned long)o.pieces, pb,
           ls, o.dst_dev, o.src_dev, sx__mem_copy_name(o.method));
  bx_table *t = bx_table_add(rep, "strided", title, cols, 6);
  double base = acc[CONTIG].secs > 0 ? (double)acc[CONTIG].bytes / acc[CONTIG].secs : 0;
  for (int c = 0; c < NCASES; c++) {
    bx_row *row = bx_row_add(t);
    double rate = acc[c].secs > 0 ? (double)acc[c].bytes / acc[c].secs : 0;
    bx_set_str(row, "case", "%s", case_names[c]);
    bx_set_num(row, "copies", (double)(c == RANGES ? nmax : o.runs));
    bx_set_num(row, "gbps", rate / 1e9);
    bx_set_num(row, "us_per_request", acc[c].calls ? acc[c].secs * 1e6 / (double)acc[c].calls : 0);
    bx_set_num(row, "host_us", acc[c].calls ? acc[c].host_secs * 1e6 / (double)acc[c].calls : 0);
    bx_set_num(row, "vs_contiguous", base > 0 ? rate / base : 0);
  }
  bx_table_note(t, "every case checked byte for byte once; %lu rounds of %.1f s per case",
                (unsigned long)o.rounds, co->duration);
  rc = bx_report_emit(rep, NULL) == 0 ? BX_OK : BX_FAIL;
  bx_report_free(rep);
out:
  if (s != NULL)
    sx__mem_stream_destroy(s);
  sx__mem_free(src);
  sx__mem_free(dst);
  free(host);
  free(rg);
  free(sr);
  return rc;
}
