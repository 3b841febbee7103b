/*
 * sx-bench: segxfer's benchmarks.  Every figure comes with a baseline
 * measured in the same run on the same machine (the machines are shared
 * and absolute numbers drift), and the targets are judged as
 * ratios of the two.
 *
 *   sx-bench codec   descriptor encode, decode+validate; JSON as the baseline
 *   sx-bench meta    publish, renew, cold/warm resolve, ls, fleet; raw GET
 *   sx-bench read    batched block reads between two processes; raw stream
 *   sx-bench target  the far end of `read` (spawned by it)
 *
 * This file parses the options every mode shares and dispatches.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

static const char usage_text[] =
    "usage: sx-bench MODE [options]\n"
    "\n"
    "segxfer's benchmarks.  Each figure is printed next to a baseline measured in\n"
    "the same run on the same machine, and the issue's targets are judged on their\n"
    "ratio, because shared machines make absolute numbers drift.\n"
    "\n"
    "modes:\n"
    "  codec    descriptor encode and decode+validate (1..1024 regions and the\n"
    "           strided 80-layer layout) against JSON of the same content\n"
    "  meta     metadata store: publish, renew, cold and warm resolve, ls of\n"
    "           1k..100k segments, a fleet of simulated agents renewing leases;\n"
    "           against raw hiredis GETs of values of the same size\n"
    "  read     batched block reads between two processes (tcp or rdma), block\n"
    "           sizes 4K..4M, batches 1..1024, contiguous or scattered ids;\n"
    "           against a raw TCP stream (or ib_read_bw) between the same processes\n"
    "  plan     a TP=2 -> TP=1 read plan (two segments of half the KV heads into\n"
    "           one reader) against equal layouts on the same bytes (tcp)\n"
    "  strided  a token-major plan's pieces copied on a GPU as ranges and as\n"
    "           strided ranges, against the same bytes as whole ranges\n"
    "  target   the far end of `read` (it spawns it; not for direct use)\n"
    "\n"
    "options of every mode:\n"
    "  --duration S     seconds per measured case (default 1; e.g. 0.2 for a smoke run)\n"
    "  --csv FILE       also write every row (and the targets) as CSV\n"
    "  --json           print JSON on stdout instead of the table\n"
    "  --plot FILE.png  draw the mode's plot with gnuplot (read: GB/s against block\n"
    "                   size with the raw stream dashed; meta: resolves/s against\n"
    "                   concurrency with raw GET dashed)\n"
    "  --quiet          no progress line on stderr\n"
    "  -h, --help       this text; `sx-bench MODE --help` for a mode's options\n"
    "\n"
    "exit status: 0 when every case ran (missed targets are reported, not failed),\n"
    "1 when a case failed (a store error, a batch that did not complete, a byte that\n"
    "differs under --verify), 2 usage.\n"
    "\n"
    "examples:\n"
    "  sx-bench codec\n"
    "  sx-bench meta --conc 1,16,64 --ls 1000,10000 --fleet 10000\n"
    "  sx-bench read --sizes 64K,1M --batches 64 --verify --plot read.png\n"
    "  sx-bench read --transport rdma --baseline ib_read_bw --sizes 64K,1M\n"
    "  make bench     # the representative set, into build/bench/\n";

static int usage_error(const char *fmt, const char *arg) {
  fprintf(stderr, "sx-bench: ");
  fprintf(stderr, fmt, arg);
  fprintf(stderr, "\n(sx-bench --help for usage)\n");
  return BX_USAGE;
}

typedef struct mode {
  const char *name;
  bx_mode_fn run;
  const char *help;
} mode;

static const mode modes[] = {
    {"codec", bx_codec_main, bx_codec_help},
    {"meta", bx_meta_main, bx_meta_help},
    {"read", bx_read_main, bx_read_help},
    {"plan", bx_plan_main, bx_plan_help},
    {"strided", bx_strided_main, bx_strided_help},
    {"target", bx_target_main, bx_target_help},
    {"gpu-target", bx_gpu_target_main, bx_gpu_target_help},
    {"plan-target", bx_plan_target_main, bx_plan_target_help},
};

int main(int argc, char **argv) {
  bx_common o = {.duration = 1.0};
  /* A reader whose peer died must see EPIPE, not die of SIGPIPE. */
  signal(SIGPIPE, SIG_IGN);
  if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
    fputs(usage_text, argc < 2 ? stderr : stdout);
    return argc < 2 ? BX_USAGE : BX_OK;
  }
  const mode *m = NULL;
  for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++)
    if (strcmp(argv[1], modes[i].name) == 0)
      m = &modes[i];
  if (m == NULL)
    return usage_error("unknown mode '%s'", argv[1]);
  /* Take the common options out; the mode parses what is left. */
  char **rest = calloc((size_t)argc + 1, sizeof(char *));
  if (rest == NULL)
    return BX_FAIL;
  int n = 0;
  rest[n++] = argv[1];
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      fputs(m->help, stdout);
      free(rest);
      return BX_OK;
    } else if (strcmp(a, "--duration") == 0) {
      char *end;
      /* Written so that NaN fails too: it compares false both ways, and a
       * case of NaN seconds never ended. */
      if (v == NULL || !((o.duration = strtod(v, &end)) > 0 && o.duration <= 3600) ||
          end == v || *end != '\0') {
        free(rest);
        return usage_error("--duration needs seconds (0 < S <= 3600), got '%s'",
                           v ? v : "");
      }
      i++;
    } else if (strcmp(a, "--csv") == 0 || strcmp(a, "--plot") == 0) {
      if (v == NULL) {
        free(rest);
        return usage_error("%s needs a file name", a);
      }
      *(a[2] == 'c' ? &o.csv : &o.plot) = v;
      i++;
    } else if (strcmp(a, "--json") == 0) {
      o.json = 1;
    } else if (strcmp(a, "--quiet") == 0) {
      o.quiet = 1;
    } else {
      rest[n++] = argv[i];
    }
  }
  int rc = m->run(&o, n, rest);
  free(rest);
  return rc;
}
