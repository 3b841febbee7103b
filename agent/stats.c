/*
 * The agent's counters: updated where things happen (relaxed atomic adds,
 * no lock on the serving path) and read as one snapshot by
 * sx_agent_stats_get().  The Prometheus rendering is in metrics.c.
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "agent_int.h"

#define ADD(p, v) __atomic_add_fetch((p), (v), __ATOMIC_RELAXED)
#define LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)

/* The counter slot of an error code; 0 gathers codes outside the table. */
static unsigned err_index(int err) {
  return err < 0 && -err < SX_STATS_ERRORS ? (unsigned)-err : 0;
}

static unsigned kind_index(sx_transport_kind k) {
  return (unsigned)k < SX_STATS_TRANSPORTS ? (unsigned)k : 0;
}

void sx__stats_served(sx_agent *a, sx_transport_kind kind, uint64_t bytes, int err) {
  unsigned k = kind_index(kind);
  if (err) {
    ADD(&a->stats.served_errors[k][err_index(err)], 1);
  } else {
    ADD(&a->stats.served_reads[k], 1);
    ADD(&a->stats.served_bytes[k], bytes);
  }
}

void sx__stats_written(sx_agent *a, sx_transport_kind kind, uint64_t bytes, int err) {
  unsigned k = kind_index(kind);
  if (err) {
    ADD(&a->stats.refused_writes[k], 1);
  } else {
    ADD(&a->stats.served_writes[k], 1);
    ADD(&a->stats.served_write_bytes[k], bytes);
  }
}

void sx__stats_notice(sx_agent *a) { ADD(&a->stats.notices, 1); }

void sx__stats_gpu_unreachable(sx_agent *a) { ADD(&a->stats.rdma_gpu_unreachable, 1); }

void sx__stats_nic(sx_agent *a, int dev, const char *name, uint64_t wrs, uint64_t bytes) {
  sx__stats *s = &a->stats;
  if (dev < 0 || dev >= SX_MAX_DEVICES)
    return;
  /* One writer (the RDMA transport, on the loop thread): the name is
   * written before named is released, and read only after named. */
  if (!LOAD(&s->nic_named[dev])) {
    snprintf(s->nic_name[dev], sizeof(s->nic_name[dev]), "%s", name);
    __atomic_store_n(&s->nic_named[dev], 1, __ATOMIC_RELEASE);
  }
  ADD(&s->nic_wrs[dev], wrs);
  ADD(&s->nic_bytes[dev], bytes);
}

void sx__stats_batch(sx_agent *a, const sx_batch_result *r, int write) {
  static const uint64_t bounds[] = SX_STATS_LATENCY_BOUNDS_US;
  sx__stats *s = &a->stats;
  if ((unsigned)r->state < SX_STATS_BATCH_STATES) {
    ADD(&s->batches[r->state], 1);
    if (write)
      ADD(&s->write_batches[r->state], 1);
  }
  if (r->error)
    ADD(&s->batch_errors[err_index(r->error)], 1);
  ADD(write ? &s->written_bytes[kind_index(r->transport)]
            : &s->read_bytes[kind_index(r->transport)], r->bytes);
  uint64_t us = r->transfer_ns / 1000;
  unsigned b = 0;
  while (b < sizeof(bounds) / sizeof(bounds[0]) && us > bounds[b])
    b++;
  ADD(&s->batch_latency[b], 1);
  ADD(&s->batch_latency_sum_us, us);
}

void sx__stats_lease_ok(sx_agent *a, int publish) {
  if (publish)
    ADD(&a->stats.publishes, 1);
  uint64_t now = sx__mono_ms();
  __atomic_store_n(&a->stats.lease_ok_ms, now ? now : 1, __ATOMIC_RELAXED);
}

void sx__stats_lease_error(sx_agent *a, int err) {
  ADD(&a->stats.lease_errors[err_index(err)], 1);
}

void sx__stats_segment(sx_agent *a, int delta) {
  if (delta > 0)
    ADD(&a->stats.open_segments, 1);
  else
    __atomic_sub_fetch(&a->stats.open_segments, 1, __ATOMIC_RELAXED);
}

void sx__stats_cache_closing(sx_agent *a) {
  pthread_mutex_lock(&a->lock);
  if (a->cache != NULL)
    sx__cache_stats(a->cache, &a->stats.cache_final);
  a->cache = NULL;
  pthread_mutex_unlock(&a->lock);
}

int sx_agent_stats_get(sx_agent *a, sx_agent_stats *out, size_t size) {
  if (a == NULL || out == NULL || size == 0)
    return sx__err(SX_EINVAL, "sx_agent_stats_get: NULL argument or size 0");
  sx_agent_stats s;
  memset(&s, 0, sizeof(s));
  const sx__stats *c = &a->stats;
  sx_cache_stats cs;

  /* What lives under the lock: lease state, the cache (it may be closing),
   * the registered regions. */
  pthread_mutex_lock(&a->lock);
  s.state = a->status.state;
  s.store_up = a->status.store_up;
  s.last_error = a->status.last_error;
  s.generation = a->status.generation;
  s.renewals = a->status.renewals;
  s.renew_failures = a->status.renew_failures;
  s.republishes = a->status.republishes;
  s.store_reconnects = a->status.store_reconnects;
  if (a->cache != NULL)
    sx__cache_stats(a->cache, &cs);
  else
    cs = c->cache_final;
  const sx__ltable *lt = a->lt;
  s.regions = lt ? lt->n : 0;
  for (uint32_t i = 0; lt && i < lt->n; i++)
    s.region_bytes += lt->v[i]->r.length;
  /* Under the lock: sx_agent_destroy joins the thread only after saying so. */
  clockid_t cid;
  struct timespec ts;
  if (!a->joining && pthread_getcpuclockid(a->thread, &cid) == 0 &&
      clock_gettime(cid, &ts) == 0)
    s.loop_cpu_ns = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
  pthread_mutex_unlock(&a->lock);
  for (unsigned k = 0; k < SX_MAX_DEVICES; k++)
    if (__atomic_load_n(&c->nic_named[k], __ATOMIC_ACQUIRE))
      memcpy(s.rdma_devices[k], c->nic_name[k], sizeof(s.rdma_devices[k]));

  s.lease_ms = a->p.lease_ms;
  uint64_t ok = LOAD(&c->lease_ok_ms);
  s.lease_age_ms = ok ? sx__mono_ms() - ok : UINT64_MAX;
  s.ready = s.state == SX_AGENT_PUBLISHED && s.store_up && s.lease_age_ms < s.lease_ms;
  s.publishes = LOAD(&c->publishes);
  for (unsigned e = 0; e < SX_STATS_ERRORS; e++) {
    s.lease_errors[e] = LOAD(&c->lease_errors[e]);
    s.batch_errors[e] = LOAD(&c->batch_errors[e]);
  }
  for (unsigned k = 0; k < SX_STATS_TRANSPORTS; k++) {
    s.served_reads[k] = LOAD(&c->served_reads[k]);
    s.served_bytes[k] = LOAD(&c->served_bytes[k]);
    s.read_bytes[k] = LOAD(&c->read_bytes[k]);
    for (unsigned e = 0; e < SX_STATS_ERRORS; e++)
      s.served_errors[k][e] = LOAD(&c->served_errors[k][e]);
    s.served_writes[k] = LOAD(&c->served_writes[k]);
    s.served_write_bytes[k] = LOAD(&c->served_write_bytes[k]);
    s.refused_writes[k] = LOAD(&c->refused_writes[k]);
    s.written_bytes[k] = LOAD(&c->written_bytes[k]);
  }
  s.notices = LOAD(&c->notices);
  s.rdma_gpu_unreachable = LOAD(&c->rdma_gpu_unreachable);
  for (unsigned k = 0; k < SX_MAX_DEVICES; k++) {
    s.rdma_device_wrs[k] = LOAD(&c->nic_wrs[k]);
    s.rdma_device_bytes[k] = LOAD(&c->nic_bytes[k]);
  }
  for (unsigned b = 0; b < SX_STATS_BATCH_STATES; b++) {
    s.batches[b] = LOAD(&c->batches[b]);
    s.write_batches[b] = LOAD(&c->write_batches[b]);
  }
  for (unsigned b = 0; b < SX_STATS_LATENCY_BUCKETS; b++)
    s.batch_latency[b] = LOAD(&c->batch_latency[b]);
  s.batch_latency_sum_us = LOAD(&c->batch_latency_sum_us);
  s.cache_hits = cs.hits;
  s.cache_misses = cs.misses;
  s.cache_refreshes = cs.refreshes;
  s.cache_fetches = cs.fetches;
  s.cache_events = cs.events;
  s.cache_entries = cs.entries;
  s.open_segments = LOAD(&c->open_segments);

  memcpy(out, &s, size < sizeof(s) ? size : sizeof(s));
  return 0;
}
