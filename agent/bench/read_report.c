/*
 * sx-bench read's figures: a case's totals over its windows, the table's
 * rows (the baselines' included: every row has its CPU seconds per GB) and
 * the targets judged on them.
 */
#include <stdio.h>

#include "bench.h"
#include "read.h"

void bx_accumulate(bx_caseres *acc, const bx_caseres *r) {
  acc->secs += r->secs;
  acc->bytes += r->bytes;
  acc->blocks += r->blocks;
  acc->batches += r->batches;
  acc->cpu_reader = acc->cpu_reader < 0 || r->cpu_reader < 0 ? -1 : acc->cpu_reader + r->cpu_reader;
  acc->cpu_target = acc->cpu_target < 0 || r->cpu_target < 0 ? -1 : acc->cpu_target + r->cpu_target;
  acc->runq = acc->runq < 0 || r->runq < 0 ? -1 : acc->runq + r->runq;
}

double bx_gbps(const bx_caseres *r) {
  return r->secs > 0 ? (double)r->bytes / r->secs / 1e9 : 0;
}

double bx_cpu_gb(const bx_caseres *r) {
  return r->bytes > 0 && r->cpu_reader >= 0 && r->cpu_target >= 0
             ? (r->cpu_reader + r->cpu_target) / ((double)r->bytes / 1e9)
             : -1;
}

const bx_col bx_read_cols[] = {
    {"transport", "TRANSPORT", NULL},    {"block", "BLOCK", NULL},
    {"batch", "BATCH", "%.0f"},          {"ids", "IDS", NULL},
    {"conns", "CONNS", "%.0f"},          {"gb_s", "GB/S", "%.3f"},
    {"blocks_s", "BLOCKS/S", "%.0f"},    {"p50_ms", "P50 MS", "%.3f"},
    {"p99_ms", "P99 MS", "%.3f"},        {"runq_ms", "CPU WAIT MS/BATCH", "%.3f"},
    {"cpu_s_gb", "CPU S/GB", "%.2f"},
    {"cpu_reader_s_gb", "READER", "%.2f"}, {"cpu_target_s_gb", "TARGET", "%.2f"},
    {"baseline_gb_s", "BASELINE GB/S", "%.3f"}, {"ratio", "VS BASELINE", "%.2fx"},
    {"cpu_ratio", "CPU/GB VS BASELINE", "%.2fx"}, {"note", "NOTE", NULL},
};
const int bx_read_ncols = (int)(sizeof(bx_read_cols) / sizeof(bx_read_cols[0]));

bx_row *bx_read_row(bx_table *t, const char *tr, uint64_t size, uint64_t batch,
                    const char *ids, uint32_t conns, const bx_caseres *r,
                    const bx_caseres *base, const bx_caseres *base_cpu) {
  bx_row *row = bx_row_add(t);
  char b[16];
  double gb = bx_gbps(r);
  bx_set_str(row, "transport", "%s", tr);
  bx_set_str(row, "block", "%s", bx_size_name(size, b, sizeof(b)));
  if (batch)
    bx_set_num(row, "batch", (double)batch);
  bx_set_str(row, "ids", "%s", ids);
  bx_set_num(row, "conns", conns);
  if (r->secs > 0) {
    bx_set_num(row, "gb_s", gb);
    bx_set_num(row, "blocks_s", (double)r->blocks / r->secs);
  }
  if (batch) {
    bx_set_num(row, "p50_ms", r->p50_ms);
    bx_set_num(row, "p99_ms", r->p99_ms);
    if (r->runq >= 0 && r->batches > 0)
      bx_set_num(row, "runq_ms", r->runq * 1e3 / (double)r->batches);
  }
  double gbytes = (double)r->bytes / 1e9;
  if (gbytes > 0 && r->cpu_reader >= 0)
    bx_set_num(row, "cpu_reader_s_gb", r->cpu_reader / gbytes);
  if (gbytes > 0 && r->cpu_target >= 0)
    bx_set_num(row, "cpu_target_s_gb", r->cpu_target / gbytes);
  if (bx_cpu_gb(r) >= 0)
    bx_set_num(row, "cpu_s_gb", bx_cpu_gb(r));
  if (base != NULL && bx_gbps(base) > 0) {
    bx_set_num(row, "baseline_gb_s", bx_gbps(base));
    bx_set_num(row, "ratio", gb / bx_gbps(base));
  }
  if (base_cpu != NULL && bx_cpu_gb(base_cpu) > 0 && bx_cpu_gb(r) >= 0)
    bx_set_num(row, "cpu_ratio", bx_cpu_gb(r) / bx_cpu_gb(base_cpu));
  return row;
}

bx_row *bx_read_base_row(bx_table *t, const char *name, uint64_t size, uint32_t conns,
                         const bx_caseres *r) {
  return bx_read_row(t, name, size, 0, "-", conns, r, NULL, NULL);
}

/* One verdict per block size and connection count: both sides always run
 * with the same number of connections (the raw stream with a thread per
 * connection on each side, the agents with one event loop each). */
void bx_read_targets(bx_report *rep, const bx_judged *j, const uint64_t *conns, int n,
                     int rdma, int write, uint64_t target_batch, int scattered,
                     int no_baseline) {
  const char *unit = rdma ? "QPs" : "conns", *ops = write ? "writes" : "reads";
  const char *ib = write ? "ib_write_bw" : "ib_read_bw";
  for (int m = 0; m < 2; m++) {
    for (int ci = 0; ci < n; ci++) {
      for (int k = 0; k < 2; k++) {
        double limit = m ? 1.5 : rdma ? 0.9 : (k == 0 ? 0.8 : 0.9);
        double v = m ? j[ci].cpu[k] : j[ci].ratio[k];
        char tname[160], basis[160], what[32];
        if (write && !rdma && k == 1 && !m)
          continue; /* TCP writes: the issue sets a GB/s target at 64K only */
        snprintf(what, sizeof(what), "batched %s", ops);
        snprintf(tname, sizeof(tname), "%s %s, %s blocks, vs %s, %llu %s",
                 rdma ? "RDMA" : "TCP", m ? "CPU per GB (both sides)" : what,
                 k ? "1M" : "64K", rdma ? ib : "raw stream",
                 (unsigned long long)conns[ci], unit);
        snprintf(basis, sizeof(basis), "%s ratio, same run, batch %llu or the largest below, "
                 "%s ids", m ? "CPU s/GB" : "GB/s", (unsigned long long)target_batch,
                 scattered ? "scattered" : "contiguous");
        if (v >= 0)
          bx_target(rep, tname, v, "x", m ? "<=" : ">=", limit, basis);
        else if (ci == 0)
          bx_target_skip(rep, tname, no_baseline ? "--baseline none"
                         : m ? "block size not run, or CPU time unknown" : "block size not run");
      }
    }
  }
  /* The steady tail. */
  for (int ci = 0; ci < n; ci++) {
    char tname[160], basis[160];
    snprintf(tname, sizeof(tname), "%s%s p99 batch latency / p50, worst of batches of 16-128 "
             "blocks of 64K-1M, %llu %s", rdma ? "RDMA" : "TCP", write ? " write" : "",
             (unsigned long long)conns[ci], unit);
    snprintf(basis, sizeof(basis), "worst case: %s; steady window (every batch in flight "
             "submitted after a batch ended)", j[ci].tail >= 0 ? j[ci].tail_case : "-");
    if (j[ci].tail >= 0)
      bx_target(rep, tname, j[ci].tail, "x", "<=", 2, basis);
    else if (ci == 0)
      bx_target_skip(rep, tname, "no batch of 16-128 blocks of 64K-1M ran");
  }
}
