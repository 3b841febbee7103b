/*
 * The transfer agent: register memory, publish it as a named segment, open
 * other agents' segments by name, check their layout, and read blocks from
 * them in batches.
 *
 * Threading: an agent runs its own event-loop thread, which talks to the
 * metadata store, serves reads of its memory and drives transfers.  Every
 * function here may be called from any thread unless it says otherwise;
 * callbacks run on the agent's thread and must not block.  Calls that wait
 * for the agent thread (register, unregister, publish, unpublish, the
 * synchronous open, ping, descriptor, batch wait) fail with SX_EBUSY when
 * called on the agent thread itself, i.e. from a callback; the
 * non-waiting ones (the asynchronous open, segment close, batch create,
 * add, submit, poll, cancel, result) work there too.  The agent's thread
 * blocks SIGPIPE (a peer that resets a connection fails that connection,
 * it does not kill the process), so the embedding program need not ignore
 * it.
 *
 * Errors: every call returns 0 or a negative SX_E* code, and a failing call
 * leaves a message for the calling thread (sx_errmsg()).  Output arguments
 * are written only on success.
 *
 * Lifetimes: segments and batches belong to the agent that made them and
 * must be closed/destroyed before it.  sx_agent_destroy() unpublishes the
 * segment at once (peers see it gone), ends batches still in flight and
 * closes segments left open.
 */
#ifndef SEGXFER_AGENT_H
#define SEGXFER_AGENT_H

#include <stddef.h>
#include <stdint.h>

#include "segxfer/descriptor.h"
#include "segxfer/layout.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sx_agent sx_agent;
typedef struct sx_segment sx_segment;
typedef struct sx_batch sx_batch;

/* Transports an agent may use (bit mask of 1 << sx_transport_kind). */
#define SX_TRANSPORTS_TCP (1u << SX_TRANSPORT_TCP)
#define SX_TRANSPORTS_RDMA (1u << SX_TRANSPORT_RDMA)
#define SX_TRANSPORTS_CUDA_IPC (1u << SX_TRANSPORT_CUDA_IPC)
#define SX_TRANSPORTS_ALL (SX_TRANSPORTS_TCP | SX_TRANSPORTS_RDMA | SX_TRANSPORTS_CUDA_IPC)

typedef enum sx_log_level {
  SX_LOG_ERROR = 0,
  SX_LOG_WARN = 1,
  SX_LOG_INFO = 2,
  SX_LOG_DEBUG = 3,
} sx_log_level;

typedef void (*sx_log_fn)(void *arg, sx_log_level level, const char *msg);

typedef struct sx_agent_params {
  /* The segment name this agent publishes; NULL for a reader-only agent. */
  const char *name;
  /* redis://..., redis+sentinel://..., etcd://...; see docs/store.md. */
  const char *metadata_url;
  /* Overrides the URL's namespace when not NULL. */
  const char *ns;
  /* host:port the data plane listens on.  NULL: "0.0.0.0:0" (any port)
   * when the agent has a name; a reader-only agent then does not listen. */
  const char *listen;
  /* Address peers are told to connect to: an IP address (not the
   * wildcard) or a host name, no port; anything else is SX_EINVAL at
   * create (default: the listen host, or the address of the interface
   * that routes to the metadata store). */
  const char *advertise;
  /* SX_TRANSPORTS_* the agent may serve and use (default ALL: RDMA where a
   * device exists, TCP always, cuda_ipc where a CUDA driver is). */
  unsigned transports;
  uint32_t lease_ms;       /* default 5000 */
  uint32_t renew_ms;       /* default lease_ms / 3 */
  uint32_t conns_per_peer; /* TCP connections or RDMA QPs per peer (default 4) */
  /* RDMA: devices to use ("mlx5_0,mlx5_1"), NULL for every active one;
   * GID index (-1: pick a RoCE v2 IPv4 GID); READ slice size (default 1 MiB). */
  const char *rdma_devices;
  int rdma_gid_index;
  uint32_t rdma_slice_bytes;
  /* The planner cuts ranges longer than this so that one large transfer
   * spreads over the connections (default 1 MiB, at most 64 MiB). */
  uint32_t slice_bytes;
  /* Longest time an opened descriptor is reused from the resolver cache
   * without an event confirming it (default 5000; never above the
   * descriptor's own lease). */
  uint32_t cache_ttl_ms;
  /* Published layout: fingerprint, tag, dtype, tp/pp. */
  sx_layout layout;
  /* Published labels (copied). */
  const sx_label *labels;
  uint32_t n_labels;
  /* Log sink (default: stderr at SX_LOG_INFO and above). */
  sx_log_fn log;
  void *log_arg;
  sx_log_level log_level;
  /* Pinned host memory for moving GPU regions over TCP, per direction
   * (serving, reading), allocated on first use (default 64 MiB, at least
   * 1 MiB).  Bounds the GPU bytes in flight on TCP; see docs/gpu.md. */
  uint64_t staging_bytes;
  /* How RDMA carries GPU regions (docs/gpu.md): SX_RDMA_GPU_AUTO picks
   * per device; the others force a tier.  The environment variable
   * SX_RDMA_GPU (dmabuf, peermem, staged, off, auto) overrides it. */
  uint32_t rdma_gpu;
  /* Threads that move TCP payload bytes off the agent's thread (receiving
   * replies, sending them), so that several connections go past one
   * core's copy rate: -1 (the default) min(4, online CPUs / 4), 0 none, at
   * most 64; payloads of tcp_thread_bytes and more use them (0: the
   * default, 256 KiB).  The environment variables SX_TCP_THREADS and
   * SX_TCP_THREAD_BYTES override them; see docs/data-plane.md. */
  int32_t tcp_threads;
  uint32_t tcp_thread_bytes;
} sx_agent_params;

/* Values of sx_agent_params.rdma_gpu. */
typedef enum sx_rdma_gpu {
  SX_RDMA_GPU_AUTO = 0,
  SX_RDMA_GPU_DMABUF = 1,
  SX_RDMA_GPU_PEERMEM = 2,
  SX_RDMA_GPU_STAGED = 3, /* through pinned rings: any RDMA device */
  SX_RDMA_GPU_OFF = 4,    /* GPU memory never goes over RDMA */
} sx_rdma_gpu;

/* Fill *p with the defaults above.  Always call it first: fields added in
 * later versions then keep their defaults. */
SX_EXTERN void sx_agent_params_init(sx_agent_params *p);

/*
 * Start an agent: a new incarnation and access token (128 random bits
 * each), its thread, its data-plane listeners and its store connection;
 * waits for the store's first answer (up to the URL's connect timeout).
 * Does not publish.  p and everything it points to are copied.
 * Errors: SX_EINVAL, SX_EURL, SX_ENAME, SX_ENOTSUP (store backend not
 * built), SX_EUNREACH/SX_EAUTH/SX_ETIMEDOUT (store), SX_EIO (listen),
 * SX_ENODEV (only RDMA allowed and no device).
 */
SX_EXTERN int sx_agent_create(const sx_agent_params *p, sx_agent **out);

/* Unpublish (if published; bounded by the store's command timeout), stop
 * serving, end batches in flight (SX_ESHUTDOWN, their callbacks run),
 * close segments left open, join the thread and free.  Not from the agent
 * thread (ignored there, with an error log).  NULL is a no-op. */
SX_EXTERN void sx_agent_destroy(sx_agent *a);

/* This agent's incarnation (random per sx_agent_create()).  Never fails. */
SX_EXTERN void sx_agent_incarnation(const sx_agent *a, uint8_t out[SX_INCARNATION_LEN]);

typedef struct sx_region_params {
  void *addr;
  uint64_t length;
  uint32_t group;
  uint32_t layer_first;
  uint32_t layer_count;    /* 0 is taken as 1 */
  uint64_t layer_stride;
  uint32_t slot;           /* SX_SLOT_K, SX_SLOT_V, ... */
  uint64_t block_bytes;
  uint64_t block_stride;   /* 0 is taken as block_bytes */
  uint64_t num_blocks;
  const char *location;    /* NULL is "cpu" */
  uint32_t access;         /* SX_ACCESS_REMOTE_READ to let peers read it,
                            * SX_ACCESS_REMOTE_WRITE to let granted producers
                            * write it (segxfer/push.h) */
} sx_region_params;

/*
 * Register a region: check it with the descriptor rules (and against the
 * other regions' keys), register it with every transport (RDMA memory
 * registration), and give it an id (*id; ids are never reused by one
 * incarnation).  The memory must stay valid until sx_agent_unregister()
 * returns, and it is the destination of this agent's block reads with the
 * same (group, layer, slot) keys.  Takes effect for peers at the next
 * sx_agent_publish().  Errors: the validation codes (SX_ESTRIDE,
 * SX_EBOUNDS, SX_EOVERLAP, ...), SX_ENOMEM, SX_EIO, SX_EBUSY (agent thread).
 */
SX_EXTERN int sx_agent_register(sx_agent *a, const sx_region_params *r, uint32_t *id);

/*
 * Where memory lives, as sx_region_params.location names it: writes "cpu"
 * or "cuda:N" (NUL-terminated, at most 10 bytes; SX_TAG_MAX + 1 always
 * suffices) into out.  For engines that hand over raw addresses (an
 * integer from tensor.data_ptr()) and no device: the CUDA driver is asked
 * about addr when this process has loaded it (a process that has not
 * cannot hold device memory, and the driver is not started to learn
 * that).  The whole range [addr, addr+length) is then checked as
 * sx_agent_register() checks it, so an answer is always one register
 * accepts for that range.  Any thread; never waits for an agent.
 * Errors: SX_EINVAL (NULL, out too small, managed memory), SX_EBOUNDS
 * (the range leaves its device allocation), SX_EIO (the driver failed);
 * out is written only on success.  Why not location "auto" in sx_region_params: a named location
 * is a claim register verifies (a cache on the wrong device is refused),
 * and callers often need the answer before registering (to pick a
 * transport or a staging size).
 */
SX_EXTERN int sx_mem_location(const void *addr, uint64_t length, char *out, size_t size);

/*
 * Retire a region in order: refuse new reads of it, withdraw it from the
 * published descriptor (republish with a new generation, if published),
 * wait for reads of it in flight, then deregister it from the transports.
 * When this returns no peer can read the memory any more.  Batches of this
 * agent that write into it must have ended.  Errors: SX_ENOREGION,
 * SX_EBUSY (agent thread).  A failed republish is logged, not returned:
 * the region is retired either way.
 */
SX_EXTERN int sx_agent_unregister(sx_agent *a, uint32_t id);

/* sx_agent_publish() flags. */
enum {
  SX_PUBLISH_TAKEOVER = 1u << 0, /* replace a live holder of the name */
};

/*
 * Publish the segment (first call) or republish it with the next
 * generation, and keep its lease renewed from then on (every renew_ms; at
 * once when the store connection comes back).  Waits for the store's
 * answer.  Errors: SX_EHELD (sx_errmsg() names the holder's incarnation and
 * lease age), SX_EFENCED, SX_EINVAL (no name), store errors.  If the store
 * is down the agent keeps retrying (state RECLAIMING) and publishes when it
 * returns, but this call reports the error.  If the store loses the segment
 * (expiry while this process was stopped, a restarted empty Redis) the
 * agent republishes by itself with the next generation; if another
 * incarnation took the name it stops (state FENCED) and logs an error.
 */
SX_EXTERN int sx_agent_publish(sx_agent *a, unsigned flags);

/* Remove the segment from the store now and stop renewing.  0 also when it
 * was not published.  Errors: store errors (the lease then runs out by
 * itself), SX_EBUSY (agent thread). */
SX_EXTERN int sx_agent_unpublish(sx_agent *a);

typedef enum sx_agent_state {
  SX_AGENT_UNPUBLISHED = 0,
  SX_AGENT_PUBLISHED,   /* lease held */
  SX_AGENT_RECLAIMING,  /* lease lost or store unreachable; republishing */
  SX_AGENT_FENCED,      /* another incarnation took the name: stopped */
} sx_agent_state;

typedef struct sx_agent_status {
  sx_agent_state state;
  uint64_t generation;    /* of the last successful publish */
  uint64_t renewals, renew_failures, republishes, store_reconnects;
  int last_error;         /* of the last lease operation, 0 when it worked */
  int store_up;           /* the store connection is up */
  /* Target side: reads served, bytes sent, requests refused. */
  uint64_t served_reads, served_bytes, served_errors;
} sx_agent_status;

/* A snapshot of the lease state and counters; never waits. */
SX_EXTERN int sx_agent_status_get(sx_agent *a, sx_agent_status *out);

/* ------------------------------------------------------------------ stats */

/* Upper bounds, in microseconds, of the batch latency histogram's buckets
 * (a last, unbounded bucket follows them).  For exporters:
 *   static const uint64_t bounds[] = SX_STATS_LATENCY_BOUNDS_US; */
#define SX_STATS_LATENCY_BOUNDS_US                                             \
  {100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000,       \
   500000, 1000000, 2500000, 5000000, 10000000, 30000000}
#define SX_STATS_LATENCY_BUCKETS 18 /* the 17 bounds above + one unbounded */
#define SX_STATS_ERRORS 64          /* error counters, indexed by -code */
#define SX_STATS_TRANSPORTS 4       /* indexed by sx_transport_kind */
#define SX_STATS_BATCH_STATES 6     /* indexed by sx_batch_state */

/*
 * Counters and gauges for monitoring (sx-agent exports them to Prometheus;
 * an engine embedding the library can export them the same way).  Counters
 * start at 0 when the agent is created and only grow.  Arrays indexed by
 * error are indexed by the negative SX_E* code (errors[-SX_EACCESS]); entry
 * 0 is unused.  Arrays indexed by transport use sx_transport_kind.
 */
typedef struct sx_agent_stats {
  /* Lease and store. */
  sx_agent_state state;
  int store_up;              /* the store connection is up now */
  int ready;                 /* published, the store is up and confirmed the
                              * lease less than one lease ago: peers can find
                              * this segment (what a readiness probe wants) */
  int last_error;            /* of the last lease operation, 0 when it worked */
  uint64_t generation;       /* of the last successful publish */
  uint64_t lease_ms;
  uint64_t lease_age_ms;     /* since the store last confirmed the lease
                              * (publish or renew); UINT64_MAX: never */
  uint64_t publishes;        /* successful publishes, republishes included */
  uint64_t republishes;      /* of them: the agent reclaiming a lost lease */
  uint64_t renewals, renew_failures, store_reconnects;
  uint64_t lease_errors[SX_STATS_ERRORS]; /* failed lease operations by code */

  /* Target side: reads of this agent's memory that it served itself.  RDMA
   * READs are one-sided (the target's CPU never sees them): they appear
   * only in the readers' counters. */
  uint64_t served_reads[SX_STATS_TRANSPORTS];
  uint64_t served_bytes[SX_STATS_TRANSPORTS];
  uint64_t served_errors[SX_STATS_TRANSPORTS][SX_STATS_ERRORS]; /* refused */

  /* Reader side: batches this agent ran, once each when they ended. */
  uint64_t batches[SX_STATS_BATCH_STATES]; /* by final state */
  uint64_t batch_errors[SX_STATS_ERRORS];  /* by first error (not COMPLETED) */
  uint64_t read_bytes[SX_STATS_TRANSPORTS]; /* bytes that arrived (read
                              * batches; write batches count in written_bytes) */
  uint64_t batch_latency[SX_STATS_LATENCY_BUCKETS]; /* submit -> end; bucket i
                              * counts bounds[i-1] < t <= bounds[i] (not
                              * cumulative) */
  uint64_t batch_latency_sum_us;

  /* Resolver cache (opens, and refreshes after transport failures). */
  uint64_t cache_hits;       /* answered from the cache */
  uint64_t cache_misses;     /* had to ask the store */
  uint64_t cache_refreshes;  /* forced store reads (after a failure) */
  uint64_t cache_fetches;    /* store reads sent (shared by concurrent misses) */
  uint64_t cache_events;     /* store events that dropped an entry */
  uint64_t cache_entries;    /* names tracked now */

  /* Now. */
  uint64_t open_segments;
  uint64_t regions, region_bytes; /* registered */

  /* Push mode, consumer side (segxfer/push.h): producers' writes into this
   * agent's memory that it served itself (TCP; RDMA WRITEs are one-sided),
   * writes refused, and notices accepted. */
  uint64_t served_writes[SX_STATS_TRANSPORTS];
  uint64_t served_write_bytes[SX_STATS_TRANSPORTS];
  uint64_t refused_writes[SX_STATS_TRANSPORTS];
  uint64_t notices;

  /* Push mode, producer side: the write batches among batches[] (they are
   * in batch_errors and batch_latency too), by final state, and the bytes
   * they wrote that the consumer acknowledged (COMPLETED: all of them). */
  uint64_t write_batches[SX_STATS_BATCH_STATES];
  uint64_t written_bytes[SX_STATS_TRANSPORTS];

  /* GPU memory over RDMA (docs/gpu.md): (RDMA device, GPU) pairs whose
   * registration succeeded but whose loopback READ of GPU memory failed at
   * first use, so that the pair is staged for the agent's life. */
  uint64_t rdma_gpu_unreachable;
  /* RDMA, per local device (NIC) this agent's reads and writes went
   * through: its name ("" for an index no batch used), the READ/WRITE work
   * requests and the bytes posted (staged GPU transfers: the staging
   * slots' bytes). */
  char rdma_devices[SX_MAX_DEVICES][SX_TAG_MAX + 1];
  uint64_t rdma_device_wrs[SX_MAX_DEVICES];
  uint64_t rdma_device_bytes[SX_MAX_DEVICES];

  /* CPU time the agent's own thread (its event loop: the store, the
   * transports' posts and completions) has used, in ns: its rate says how
   * busy it is.  0 where the clock cannot be read. */
  uint64_t loop_cpu_ns;
} sx_agent_stats;

/*
 * A snapshot of the counters above; never waits (atomic counters and a short
 * lock), so it may be called often, from any thread, also from callbacks.
 * size is sizeof(sx_agent_stats) as the caller was compiled: a caller built
 * against an older, smaller struct gets the fields it knows.  Errors:
 * SX_EINVAL (NULL, or size 0).
 */
SX_EXTERN int sx_agent_stats_get(sx_agent *a, sx_agent_stats *out, size_t size);

/*
 * The same snapshot as Prometheus text (exposition format 0.0.4, metric
 * names segxfer_*; docs/operations.md lists them), for an engine's own
 * /metrics endpoint.  Labels carry the segment name and incarnation, never
 * the access token or store credentials.  On success *text is a malloc()ed,
 * NUL-terminated buffer the caller frees with free(), and *len its length
 * without the NUL (len may be NULL).  Never waits; any thread.  Errors:
 * SX_EINVAL, SX_ENOMEM.
 */
SX_EXTERN int sx_agent_metrics_text(sx_agent *a, char **text, size_t *len);

/* A copy of the descriptor this agent publishes (or would publish);
 * the caller frees it with sx_desc_free().  Waits for the agent thread. */
SX_EXTERN int sx_agent_descriptor(sx_agent *a, sx_desc *out);

/*
 * Open a segment by name: resolve it through the agent's cache (one store
 * round trip when cold), waiting up to timeout_ms for it to appear if it is
 * not published yet (woken by the store's event, not by polling), and pick
 * the transport (RDMA when both sides have it and it is usable, TCP
 * otherwise, within params.transports).  Connections are made by the first
 * batch.  Errors: SX_ENOENT (not published within the timeout),
 * SX_ETIMEDOUT (store did not answer), the decode codes for a corrupt
 * descriptor, SX_ENAME, SX_EUNREACH (no common transport), SX_EBUSY (agent
 * thread: use sx_segment_open_async there).
 */
SX_EXTERN int sx_segment_open(sx_agent *a, const char *name, uint32_t timeout_ms,
                              sx_segment **out);

/* Asynchronous open: if this returns 0, cb runs exactly once on the agent
 * thread (never inside this call) with the segment or an error (then seg is
 * NULL); the segment is the callback's to close.  Errors here: SX_EINVAL,
 * SX_ENAME, SX_ENOMEM, SX_ESHUTDOWN. */
typedef void (*sx_open_cb)(void *arg, int status, sx_segment *seg);
SX_EXTERN int sx_segment_open_async(sx_agent *a, const char *name, uint32_t timeout_ms,
                                    sx_open_cb cb, void *arg);

/* Close a segment; batches on it must be destroyed first.  Never waits, so
 * it may be called from a callback.  NULL is a no-op. */
SX_EXTERN void sx_segment_close(sx_segment *s);

/* The remote descriptor as opened (valid until sx_segment_close()). */
SX_EXTERN const sx_desc *sx_segment_desc(const sx_segment *s);

/* Check the segment's layout against this agent's registered regions and
 * layout (sx_layout_check(local, remote, flags, mismatch)): 0, or
 * SX_EINCOMPAT with the first difference in *mismatch (may be NULL). */
SX_EXTERN int sx_segment_check(sx_segment *s, unsigned flags, sx_mismatch *mismatch);

/* Which transport reads from this segment would use (or were forced to). */
SX_EXTERN sx_transport_kind sx_segment_transport(const sx_segment *s);

/* Round trip to the segment's owner: connect if needed and read 1 byte of
 * its first readable region.  Returns 0 with the microseconds taken and the
 * transport that answered, or the batch's error (SX_ESTALE, SX_EACCESS,
 * SX_EDISCONN, SX_ETIMEDOUT ...).  Waits: not on the agent thread. */
SX_EXTERN int sx_segment_ping(sx_segment *s, uint32_t timeout_ms, uint64_t *rtt_us,
                              sx_transport_kind *via);

/* ------------------------------------------------------------------ batches */

/*
 * Read blocks: for each layer in [layer_first, layer_first+layer_count) and
 * each slot in the slots mask, blocks remote_block..remote_block+count-1 of
 * the remote region holding (group, layer, slot) go to blocks
 * local_block..local_block+count-1 of this agent's region with the same key.
 */
typedef struct sx_block_read {
  uint32_t group;
  uint32_t layer_first;
  uint32_t layer_count;
  uint64_t slots;        /* bit mask: 1 << SX_SLOT_K | 1 << SX_SLOT_V ... */
  uint64_t remote_block;
  uint64_t local_block;
  uint64_t count;
} sx_block_read;

/* Read length bytes at offset of the remote region into local memory (which
 * must lie in a registered region when the transport is RDMA). */
typedef struct sx_range_read {
  void *local;
  uint32_t remote_region; /* region id in the remote descriptor */
  uint64_t offset;
  uint64_t length;
} sx_range_read;

typedef enum sx_batch_state {
  SX_BATCH_NEW = 0,    /* being built */
  SX_BATCH_RUNNING,
  SX_BATCH_COMPLETED,  /* every byte arrived */
  SX_BATCH_FAILED,     /* at least one entry failed; see error, failed */
  SX_BATCH_TIMEOUT,    /* the deadline passed first */
  SX_BATCH_CANCELLED,
} sx_batch_state;

typedef void (*sx_batch_cb)(sx_batch *b, void *arg);

typedef struct sx_batch_params {
  uint32_t timeout_ms;   /* deadline from submit; 0 = 30000 */
  sx_batch_cb cb;        /* optional; runs once on the agent thread */
  void *cb_arg;
  unsigned flags;        /* SX_BATCH_WRITE or SX_BATCH_NOTIFY (segxfer/push.h);
                          * 0: a read batch without notice */
  uint64_t tag;          /* write batches and SX_BATCH_NOTIFY read batches:
                          * carried to the other side's notice */
} sx_batch_params;

SX_EXTERN void sx_batch_params_init(sx_batch_params *p);

/* A new, empty batch on an open segment.  params may be NULL.  The batch
 * takes a snapshot of this agent's registered regions for its
 * destinations.  Never waits. */
SX_EXTERN int sx_batch_create(sx_segment *s, const sx_batch_params *p, sx_batch **out);

/*
 * Add entries.  Each entry is planned at once, on the calling thread:
 * mapped onto region pairs, contiguous runs merged, every range checked
 * against both sides with overflow-safe arithmetic.  An entry that names a
 * missing key or an out-of-range block fails here (SX_EINVAL, SX_ENOREGION,
 * SX_EBOUNDS, SX_EOVERFLOW, SX_EDENIED, SX_EINCOMPAT; sx_errmsg() names
 * the entry) and nothing of the call is added.  Entries are numbered in
 * the order added across both calls, from 0.  Only before submit
 * (SX_EINVAL after).  One thread at a time per batch.
 */
SX_EXTERN int sx_batch_add_blocks(sx_batch *b, const sx_block_read *r, size_t n);
SX_EXTERN int sx_batch_add_ranges(sx_batch *b, const sx_range_read *r, size_t n);

/* Start the batch; never waits.  Once this returns 0 the batch ends exactly
 * once, in COMPLETED, FAILED, TIMEOUT or CANCELLED, and the callback (if
 * any) runs.  Errors: SX_EINVAL (submitted before), SX_ESHUTDOWN. */
SX_EXTERN int sx_batch_submit(sx_batch *b);

/* Wait until the batch ends or timeout_ms passes (-1: no limit).  Returns 0
 * when it ended (whatever its state), SX_ETIMEDOUT if still running,
 * SX_EINVAL if never submitted, SX_EBUSY on the agent thread.  On hosts of
 * 8 or more CPUs it spins up to 50 us before it sleeps (a batch that ends
 * meanwhile is seen without the sleep's wake-up); SX_WAIT_SPIN_US (0 to
 * 10000) sets that, 0 never spins. */
SX_EXTERN int sx_batch_wait(sx_batch *b, int timeout_ms);

/* 0 when ended, SX_EBUSY while running. */
SX_EXTERN int sx_batch_poll(sx_batch *b);

/* A file descriptor (an eventfd) that becomes readable when the batch
 * ends, for an engine's own poll/epoll loop.  Owned by the batch: do not
 * close or read it; it stays readable until sx_batch_destroy().  Returns
 * the fd, or SX_EIO if one cannot be made. */
SX_EXTERN int sx_batch_fd(sx_batch *b);

/* Ask a running batch to stop.  It ends CANCELLED (or with the state it
 * reached first); no transport writes into its destinations after it
 * ended.  Returns at once; wait for the end as usual.  0 also when the
 * batch already ended; SX_EINVAL if it was never submitted. */
SX_EXTERN int sx_batch_cancel(sx_batch *b);

typedef struct sx_batch_result {
  sx_batch_state state;
  int error;              /* first error (0 when COMPLETED) */
  char message[256];      /* what failed, where */
  uint64_t bytes;         /* bytes that arrived */
  uint32_t n_entries;
  uint32_t n_ranges;      /* after merging: what the transport posted */
  uint32_t n_failed;
  const uint32_t *failed; /* failed entry indexes; valid until destroy */
  sx_transport_kind transport;
  uint64_t post_ns;       /* submit -> everything posted */
  uint64_t transfer_ns;   /* submit -> end */
} sx_batch_result;

/* The result of an ended batch; SX_EBUSY while it is still running.  In
 * the batch's callback the result is already there. */
SX_EXTERN int sx_batch_result_get(sx_batch *b, sx_batch_result *out);

/* Free a batch.  A running batch is cancelled and waited for first, so no
 * transport writes into its destinations after this returns.  On the agent
 * thread (from a callback) a running batch cannot be waited for: it is
 * cancelled and freed when it ends, and its destinations may be written
 * until then.  NULL is a no-op. */
SX_EXTERN void sx_batch_destroy(sx_batch *b);

SX_EXTERN const char *sx_batch_state_name(sx_batch_state s);

#ifdef __cplusplus
}
#endif
#endif /* SEGXFER_AGENT_H */
