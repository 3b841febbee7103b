/*
 * sx_agent_stats as Prometheus text (exposition format 0.0.4): one HELP and
 * TYPE line per family, then its samples.  Counters end in _total, sizes
 * are bytes, times seconds (Prometheus' base units).  Error labels are the
 * SX_E* names; only the codes that occurred are listed, so a healthy agent
 * exports a handful of series, not 64 per family.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent_int.h"
#include "segxfer.h"

static const char *const kinds[SX_STATS_TRANSPORTS] = {NULL, "tcp", "rdma", "cuda_ipc"};

static void family(FILE *f, const char *name, const char *type, const char *help) {
  fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void counter(FILE *f, const char *name, const char *help, uint64_t v) {
  family(f, name, "counter", help);
  fprintf(f, "%s %lu\n", name, (unsigned long)v);
}

static void gauge(FILE *f, const char *name, const char *help, uint64_t v) {
  family(f, name, "gauge", help);
  fprintf(f, "%s %lu\n", name, (unsigned long)v);
}

/* A label value: backslash, double quote and newline escaped.  Segment
 * names cannot hold them, but the format must stay valid whatever comes. */
static void label_value(FILE *f, const char *v) {
  for (; *v; v++) {
    if (*v == '\\' || *v == '"')
      fprintf(f, "\\%c", *v);
    else if (*v == '\n')
      fputs("\\n", f);
    else
      fputc(*v, f);
  }
}

/* name{transport="tcp"} v, for each transport this build knows. */
static void by_transport(FILE *f, const char *name, const char *type, const char *help,
                         const uint64_t *v) {
  family(f, name, type, help);
  for (unsigned k = 1; k < SX_STATS_TRANSPORTS; k++)
    fprintf(f, "%s{transport=\"%s\"} %lu\n", name, kinds[k], (unsigned long)v[k]);
}

/* name{error="SX_E..."} v for every code that occurred. */
static void by_error(FILE *f, const char *name, const char *help, const uint64_t *v) {
  family(f, name, "counter", help);
  for (int e = 0; e < SX_STATS_ERRORS; e++)
    if (v[e])
      fprintf(f, "%s{error=\"%s\"} %lu\n", name, sx_err_name(-e), (unsigned long)v[e]);
}

/* Batches by result (lower-case state names), of the states a batch ends in. */
static void by_result(FILE *f, const char *name, const char *help, const uint64_t *v) {
  static const sx_batch_state ends[] = {SX_BATCH_COMPLETED, SX_BATCH_FAILED,
                                        SX_BATCH_TIMEOUT, SX_BATCH_CANCELLED};
  family(f, name, "counter", help);
  for (unsigned i = 0; i < sizeof(ends) / sizeof(ends[0]); i++) {
    char result[16];
    const char *n = sx_batch_state_name(ends[i]);
    size_t j = 0;
    for (; n[j] && j < sizeof(result) - 1; j++)
      result[j] = (char)(n[j] >= 'A' && n[j] <= 'Z' ? n[j] - 'A' + 'a' : n[j]);
    result[j] = '\0';
    fprintf(f, "%s{result=\"%s\"} %lu\n", name, result, (unsigned long)v[ends[i]]);
  }
}

/* Push mode (docs/push.md): both sides. */
static void render_push(FILE *f, const sx_agent_stats *s) {
  by_transport(f, "segxfer_served_writes_total", "counter",
               "Producers' writes into this agent's memory that it served (TCP; RDMA WRITEs "
               "are one-sided and not seen here).", s->served_writes);
  by_transport(f, "segxfer_served_write_bytes_total", "counter",
               "Bytes producers wrote into this agent's memory (TCP).", s->served_write_bytes);
  by_transport(f, "segxfer_refused_writes_total", "counter",
               "Producers' writes or connections this agent refused (no grant, bad token, "
               "read-only, out of bounds...).", s->refused_writes);
  counter(f, "segxfer_notices_total", "Write notices this agent accepted.", s->notices);
  by_result(f, "segxfer_write_batches_total",
            "Write batches this agent ran as a producer, by result (also in "
            "segxfer_batches_total).", s->write_batches);
  by_transport(f, "segxfer_written_bytes_total", "counter",
               "Bytes this agent's write batches wrote, acknowledged by the consumer.",
               s->written_bytes);
}

static void render(FILE *f, sx_agent *a, const sx_agent_stats *s) {
  char inc[2 * SX_INCARNATION_LEN + 1];
  sx_hex(a->incarnation, SX_INCARNATION_LEN, inc);

  /* Identity and lease. */
  family(f, "segxfer_agent_info", "gauge",
         "The agent: segment name (empty for a reader), incarnation (new on every "
         "start) and library version.");
  fputs("segxfer_agent_info{segment=\"", f);
  label_value(f, a->name);
  fprintf(f, "\",incarnation=\"%s\",version=\"%s\"} 1\n", inc, sx_version());
  family(f, "segxfer_agent_state", "gauge", "Lease state: 1 for the current one.");
  static const sx_agent_state states[] = {SX_AGENT_UNPUBLISHED, SX_AGENT_PUBLISHED,
                                          SX_AGENT_RECLAIMING, SX_AGENT_FENCED};
  for (unsigned i = 0; i < sizeof(states) / sizeof(states[0]); i++)
    fprintf(f, "segxfer_agent_state{state=\"%s\"} %d\n", sx__agent_state_name(states[i]),
            s->state == states[i]);
  gauge(f, "segxfer_ready",
        "1 when the segment is published, the store is up and it confirmed the lease "
        "within one lease.", (uint64_t)s->ready);
  gauge(f, "segxfer_segment_generation", "Generation of the last successful publish.",
        s->generation);
  family(f, "segxfer_lease_seconds", "gauge", "Lease length.");
  fprintf(f, "segxfer_lease_seconds %.3f\n", (double)s->lease_ms / 1e3);
  if (s->lease_age_ms != UINT64_MAX) {
    family(f, "segxfer_lease_age_seconds", "gauge",
           "Time since the store last confirmed the lease (publish or renew).");
    fprintf(f, "segxfer_lease_age_seconds %.3f\n", (double)s->lease_age_ms / 1e3);
  }
  counter(f, "segxfer_publishes_total", "Successful publishes, republishes included.",
          s->publishes);
  counter(f, "segxfer_republishes_total",
          "Publishes that reclaimed a lost lease (expired, or a store that lost it).",
          s->republishes);
  counter(f, "segxfer_lease_renewals_total", "Lease renewals the store confirmed.",
          s->renewals);
  counter(f, "segxfer_lease_renew_failures_total",
          "Publishes and renewals that failed on a store error (retried).",
          s->renew_failures);
  by_error(f, "segxfer_lease_errors_total", "Failed lease operations by error.",
           s->lease_errors);
  gauge(f, "segxfer_store_up", "1 while the metadata store connection is up.",
        (uint64_t)s->store_up);
  counter(f, "segxfer_store_reconnects_total", "Store connections re-made after a loss.",
          s->store_reconnects);

  /* Target side. */
  by_transport(f, "segxfer_served_reads_total", "counter",
               "Read requests this agent served (RDMA READs are one-sided and not seen "
               "here).", s->served_reads);
  by_transport(f, "segxfer_served_bytes_total", "counter", "Bytes this agent served.",
               s->served_bytes);
  family(f, "segxfer_served_errors_total", "counter",
         "Requests this agent refused, by transport and error.");
  for (unsigned k = 1; k < SX_STATS_TRANSPORTS; k++)
    for (int e = 0; e < SX_STATS_ERRORS; e++)
      if (s->served_errors[k][e])
        fprintf(f, "segxfer_served_errors_total{transport=\"%s\",error=\"%s\"} %lu\n",
                kinds[k], sx_err_name(-e), (unsigned long)s->served_errors[k][e]);

  /* Reader side. */
  by_result(f, "segxfer_batches_total", "Batches this agent ran, by result.", s->batches);
  by_error(f, "segxfer_batch_errors_total", "Batches that did not complete, by first "
           "error.", s->batch_errors);
  by_transport(f, "segxfer_read_bytes_total", "counter",
               "Bytes that arrived in this agent's read batches.", s->read_bytes);
  static const uint64_t bounds[] = SX_STATS_LATENCY_BOUNDS_US;
  family(f, "segxfer_batch_duration_seconds", "histogram",
         "Batch time from submit to end, every result.");
  uint64_t cum = 0;
  for (unsigned b = 0; b < SX_STATS_LATENCY_BUCKETS; b++) {
    cum += s->batch_latency[b];
    if (b < sizeof(bounds) / sizeof(bounds[0]))
      fprintf(f, "segxfer_batch_duration_seconds_bucket{le=\"%g\"} %lu\n",
              (double)bounds[b] / 1e6, (unsigned long)cum);
    else
      fprintf(f, "segxfer_batch_duration_seconds_bucket{le=\"+Inf\"} %lu\n",
              (unsigned long)cum);
  }
  fprintf(f, "segxfer_batch_duration_seconds_sum %.6f\n",
          (double)s->batch_latency_sum_us / 1e6);
  fprintf(f, "segxfer_batch_duration_seconds_count %lu\n", (unsigned long)cum);

  /* Resolver cache and what is open. */
  counter(f, "segxfer_cache_hits_total", "Opens answered from the descriptor cache.",
          s->cache_hits);
  counter(f, "segxfer_cache_misses_total", "Opens that had to ask the store.",
          s->cache_misses);
  counter(f, "segxfer_cache_refreshes_total",
          "Forced store reads after a transport failure.", s->cache_refreshes);
  counter(f, "segxfer_cache_fetches_total",
          "Store reads sent (concurrent misses of one name share one).", s->cache_fetches);
  counter(f, "segxfer_cache_events_total", "Store events that dropped a cached entry.",
          s->cache_events);
  gauge(f, "segxfer_cache_entries", "Names the cache tracks.", s->cache_entries);
  gauge(f, "segxfer_open_segments", "Segments this agent has open.", s->open_segments);
  gauge(f, "segxfer_regions", "Registered regions.", s->regions);
  gauge(f, "segxfer_region_bytes", "Bytes in registered regions.", s->region_bytes);
  render_push(f, s);
  family(f, "segxfer_loop_cpu_seconds_total", "counter",
         "CPU time of the agent's own thread (its event loop); a rate near 1 means it is "
         "the bottleneck.");
  fprintf(f, "segxfer_loop_cpu_seconds_total %.6f\n", (double)s->loop_cpu_ns / 1e9);
  counter(f, "segxfer_rdma_gpu_unreachable_pairs_total",
          "(RDMA device, GPU) pairs whose loopback RDMA READ of GPU memory failed at first "
          "use although registration succeeded; each is staged from then on (docs/gpu.md).",
          s->rdma_gpu_unreachable);
  /* Per NIC: whether a multi-NIC host's batches spread over its NICs. */
  static const char *const nic_fam[2] = {"segxfer_rdma_device_work_requests_total",
                                         "segxfer_rdma_device_bytes_total"};
  static const char *const nic_help[2] = {
      "RDMA READ and WRITE work requests this agent posted, by local device.",
      "Bytes of RDMA READs and WRITEs this agent posted (staged GPU transfers: their "
      "staging slots' bytes), by local device."};
  for (int m = 0; m < 2; m++) {
    family(f, nic_fam[m], "counter", nic_help[m]);
    for (unsigned k = 0; k < SX_MAX_DEVICES; k++) {
      if (s->rdma_devices[k][0] == '\0')
        continue;
      fprintf(f, "%s{device=\"", nic_fam[m]);
      label_value(f, s->rdma_devices[k]);
      fprintf(f, "\"} %lu\n",
              (unsigned long)(m == 0 ? s->rdma_device_wrs[k] : s->rdma_device_bytes[k]));
    }
  }
}

int sx_agent_metrics_text(sx_agent *a, char **text, size_t *len) {
  if (a == NULL || text == NULL)
    return sx__err(SX_EINVAL, "sx_agent_metrics_text: NULL argument");
  sx_agent_stats s;
  int rc = sx_agent_stats_get(a, &s, sizeof(s));
  if (rc)
    return rc;
  char *buf = NULL;
  size_t n = 0;
  FILE *f = open_memstream(&buf, &n);
  if (f == NULL)
    return sx__err(SX_ENOMEM, "sx_agent_metrics_text");
  render(f, a, &s);
  int bad = ferror(f);
  if (fclose(f) != 0 || bad) {
    free(buf);
    return sx__err(SX_ENOMEM, "sx_agent_metrics_text: out of memory");
  }
  *text = buf;
  if (len != NULL)
    *len = n;
  return 0;
}
