/*
 * sx-bench: metadata and data-path benchmarks, each figure next to a
 * baseline measured in the same run on the same machine.  Shared by the
 * mode files (codec.c, meta.c, fleet.c, read.c, target.c) and the helpers
 * (report.c: tables, CSV, JSON, plots; util.c: clocks, statistics,
 * progress, sizes, a private redis-server).
 */
#ifndef SX_BENCH_H
#define SX_BENCH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* ------------------------------------------------------------ options */

/* Options every mode takes (main.c parses them, the mode the rest). */
typedef struct bx_common {
  double duration;   /* seconds per measured case */
  const char *csv;   /* --csv FILE */
  const char *plot;  /* --plot FILE.png */
  int json;          /* --json: JSON on stdout instead of the table */
  int quiet;         /* --quiet: no progress on stderr */
} bx_common;

/* Exit codes of sx-bench. */
enum { BX_OK = 0, BX_FAIL = 1, BX_USAGE = 2 };

/* ------------------------------------------------------------ report */

typedef struct bx_report bx_report;
typedef struct bx_table bx_table;
typedef struct bx_row bx_row;

/* A column: key (CSV/JSON name), header (table), printf format of its
 * numbers ("%.2f"; NULL for a text column). */
typedef struct bx_col {
  const char *key;
  const char *head;
  const char *fmt;
} bx_col;

bx_report *bx_report_new(const char *mode, const bx_common *o);
void bx_report_free(bx_report *r);

/* A table of the report; cols is copied, n at most 24. */
bx_table *bx_table_add(bx_report *r, const char *id, const char *title, const bx_col *cols,
                       int n);
/* A note printed under the table (definitions, what was skipped). */
void bx_table_note(bx_table *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
bx_row *bx_row_add(bx_table *t);
/* Set a cell by column key; cells never set print as "-". */
void bx_set_num(bx_row *row, const char *key, double v);
void bx_set_str(bx_row *row, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* A target from the issue, judged on figures of this run. */
void bx_target(bx_report *r, const char *what, double measured, const char *unit,
               const char *op, double limit, const char *basis);
/* A target that could not be judged in this run (and why). */
void bx_target_skip(bx_report *r, const char *what, const char *why);

/* One line of a plot: points (x, y); baseline lines are drawn dashed. */
typedef struct bx_series {
  char name[96];
  int baseline;
  int color; /* 1.. a palette entry, 0 automatic */
  int dash;  /* 1 solid, 2 dashed, 3 dotted; 0 automatic */
  int n;
  double x[64], y[64];
} bx_series;

typedef struct bx_plot {
  char title[160];
  char xlabel[64], ylabel[64];
  int logx, logy;
  int xbytes; /* x values are byte sizes: label ticks 4K, 64K, 1M... */
  int n;
  bx_series s[16];
} bx_plot;

/* The series named name (created when missing; NULL if full). */
bx_series *bx_plot_series(bx_plot *p, const char *name, int baseline);
void bx_series_add(bx_series *s, double x, double y);

/* Print (table or JSON), write --csv and --plot.  0, or -1 when a file
 * could not be written (said on stderr). */
int bx_report_emit(bx_report *r, const bx_plot *plot);

/* ------------------------------------------------------------ util */

double bx_now(void);        /* monotonic seconds */
uint64_t bx_now_ns(void);

/* Latency samples (ns) and their percentiles. */
typedef struct bx_lat {
  uint64_t *v;
  size_t n, cap;
  int sorted;
} bx_lat;

void bx_lat_add(bx_lat *l, uint64_t ns);
/* q in [0, 1]; 0 when empty. */
double bx_lat_pct(bx_lat *l, double q);
void bx_lat_reset(bx_lat *l);
void bx_lat_free(bx_lat *l);

/* Median of n doubles (the array is sorted in place). */
double bx_median(double *v, int n);

/* CPU time of this process (all threads), seconds. */
double bx_cpu_self(void);
/* Seconds pid's threads (alive now) have spent runnable but waiting for a
 * CPU (/proc/PID/task/TID/schedstat), or -1 when the kernel does not say. */
double bx_runq_wait(pid_t pid);
/* CPU seconds process pid has used: its threads' run time (schedstat, in
 * ns), else user + system (/proc/PID/stat, in clock ticks); or -1. */
double bx_proc_cpu(pid_t pid);
/* CPU seconds the calling thread has used. */
double bx_cpu_thread(void);

/* "4K" "64KiB" "1M" "4096" -> bytes.  0 or -1. */
int bx_parse_size(const char *s, uint64_t *out);
/* "1,4,16" -> up to max numbers.  Returns the count, or -1. */
int bx_parse_list(const char *s, uint64_t *out, int max, int sizes);
/* 65536 -> "64K" */
const char *bx_size_name(uint64_t bytes, char *buf, size_t size);

/* Progress on stderr: shown only for runs expected to last more than a few
 * seconds; a rewritten line on a terminal, a line per step otherwise. */
void bx_progress_start(const bx_common *o, const char *mode, int steps, double est_s);
void bx_progress(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void bx_progress_end(void);

/* A private redis-server on a free loopback port, in a temporary directory,
 * killed with this process (PR_SET_PDEATHSIG). */
typedef struct bx_redis {
  pid_t pid;
  int port;
  char dir[128];
} bx_redis;

int bx_redis_start(bx_redis *r);
/* The same, as a Redis Cluster node (cluster-enabled; its bus port free). */
int bx_redis_start_node(bx_redis *r, int cluster);
void bx_redis_stop(bx_redis *r);

/* Start this program (/proc/self/exe) with args (NULL-ended, args[0] its
 * name) as a child reading *lifeline as its standard input (closing it
 * tells the child to end), and read the start of its first output into
 * line (size bytes, NUL-ended).  0, or -1 (nothing started, or the child
 * said nothing: *pid, if > 0, is still to be reaped). */
int bx_spawn(const char *const *args, pid_t *pid, int *lifeline, char *line, size_t size);

/* A private Redis Cluster of n masters (no replicas), joined with
 * redis-cli --cluster create: 0 with the nodes' seeds in url_hosts
 * ("127.0.0.1:P1,..."), or -1 (said why on stderr). */
#define BX_CLUSTER_MAX 8
typedef struct bx_rcluster {
  bx_redis node[BX_CLUSTER_MAX];
  int n;
  char url_hosts[BX_CLUSTER_MAX * 24];
} bx_rcluster;
int bx_rcluster_start(bx_rcluster *c, int masters);
void bx_rcluster_stop(bx_rcluster *c);

/* Machine facts for the report header. */
typedef struct bx_machine {
  int nproc;
  char cpu[128];
  char kernel[200];
  double load1;
} bx_machine;

void bx_machine_get(bx_machine *m);

/* ------------------------------------------------------------ descriptors */

struct sx_desc;
/* A valid descriptor like a prefill engine's (codec.c): n per-layer regions
 * (layer i/2, slot K or V) or, when strided, K and V over 80 layers in 2
 * regions; a TCP and an RDMA endpoint, labels, a full layout.  0 or SX_E*. */
int bx_make_desc(struct sx_desc *d, const char *name, uint32_t n, int strided);

struct sx_layout;
/* The layout both ends of `read` publish and expect. */
void bx_bench_layout(struct sx_layout *l);

/* ------------------------------------------------------------ modes */

typedef int (*bx_mode_fn)(const bx_common *o, int argc, char **argv);

int bx_codec_main(const bx_common *o, int argc, char **argv);
int bx_meta_main(const bx_common *o, int argc, char **argv);
int bx_read_main(const bx_common *o, int argc, char **argv);
int bx_target_main(const bx_common *o, int argc, char **argv);

extern const char bx_codec_help[], bx_meta_help[], bx_read_help[], bx_target_help[];

/* Read plans against equal layouts (plan.c). */
int bx_plan_main(const bx_common *o, int argc, char **argv);
extern const char bx_plan_help[];
/* strided.c: a read plan's token pieces copied as ranges, as strided
 * ranges and as whole runs (the memory layer, one GPU or two). */
int bx_strided_main(const bx_common *o, int argc, char **argv);
extern const char bx_strided_help[];
/* Its sources' process with --location cuda:N (plan.c). */
int bx_plan_target_main(const bx_common *o, int argc, char **argv);
extern const char bx_plan_target_help[];

/* GPU memory (read_gpu.c): `read --location cuda:N` and its far end. */
int bx_read_gpu_main(const bx_common *o, int argc, char **argv);
int bx_gpu_target_main(const bx_common *o, int argc, char **argv);
extern const char bx_gpu_target_help[];

/* The fleet part of meta (fleet.c). */
typedef struct bx_fleet bx_fleet;

typedef struct bx_fleet_params {
  const char *url;      /* metadata URL (namespace included) */
  uint32_t first;       /* the first agent's number (several fleets share a run) */
  uint32_t agents;      /* simulated agents */
  uint32_t conns;       /* store connections they share */
  uint32_t lease_ms;
  const uint8_t *value; /* a descriptor each agent publishes (name patched) */
  size_t len;
} bx_fleet_params;

typedef struct bx_fleet_stats {
  uint64_t renews, renew_errors, publishes;
  uint64_t late; /* renewals skipped: the previous one was still in flight */
  double renew_p50_us, renew_p99_us;
  double late_p99_ms, late_max_ms; /* from falling due to the answer */
  char first_error[160];           /* the first renewal that failed: why */
} bx_fleet_stats;

/* Publish every agent, then renew each lease every lease/3 on a thread of
 * its own until bx_fleet_stop().  0, or -1 with the reason in err. */
int bx_fleet_start(const bx_fleet_params *p, bx_fleet **out, char *err, size_t esize);
/* The same in two steps, so that several fleets publish at once: spawn
 * starts the thread (0, or -1 with the reason in err); ready waits until
 * every agent holds its lease (0), or says why not (-1; then stop it). */
int bx_fleet_spawn(const bx_fleet_params *p, bx_fleet **out, char *err, size_t esize);
int bx_fleet_ready(bx_fleet *f, char *err, size_t esize);
/* The same without waiting: 0 still publishing, 1 renewing, -1 failed
 * (the reason in err). */
int bx_fleet_state(bx_fleet *f, char *err, size_t esize);
/* Counters since the last call (or start). */
void bx_fleet_sample(bx_fleet *f, bx_fleet_stats *out);
void bx_fleet_stop(bx_fleet *f);
/* CPU seconds the fleet's thread has used so far (any thread may ask). */
double bx_fleet_cpu(bx_fleet *f);
/* The name of agent i: "fleet/NNNNNNN". */
void bx_fleet_name(uint32_t i, char *buf, size_t size);

#endif
