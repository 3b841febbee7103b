/*
 * The memory layer: what kind of memory a pointer is (host or CUDA device
 * memory), copies between kinds, pinned staging memory, and CUDA IPC
 * handles.  Transports ask it; they never call CUDA themselves.  Not
 * installed.
 *
 * The CUDA driver (libcuda.so.1) is loaded with dlopen() on first use, so
 * one build runs on hosts with and without a GPU: without one, every CUDA
 * call here fails with SX_ENODEV and a message that says why, and host
 * memory works as always.  The driver is reached through one table of
 * function pointers (sx__cuda_drv, mem_int.h), which unit tests replace
 * with a fake.  A build without cuda.h (SX_HAVE_CUDA undefined) answers
 * SX_ENOTSUP to every CUDA call.
 *
 * Contexts: every call works in the device's primary context
 * (cuDevicePrimaryCtxRetain), the one the CUDA runtime (PyTorch, an
 * engine) uses too, so device pointers from an engine are valid here.
 *
 * Threading: any thread.  Completion notices (sx__mem_notify) run on the
 * libuv loop they were created for.
 *
 * RDMA: GPU memory is registered with RDMA through a dma-buf fd this
 * layer exports (sx__mem_dmabuf_export); the RDMA transport registers
 * what it is given, or stages (docs/gpu.md).
 */
#ifndef SX_AGENT_MEM_H
#define SX_AGENT_MEM_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

typedef enum sx__mem_kind {
  SX__MEM_HOST = 0,
  SX__MEM_CUDA = 1,
} sx__mem_kind;

/* What a pointer (or a registered region) is. */
typedef struct sx__mem_info {
  sx__mem_kind kind;
  int device;    /* CUDA device ordinal; -1 for host memory */
  uint64_t base; /* CUDA: the allocation holding the range */
  uint64_t size; /* CUDA: that allocation's size */
} sx__mem_info;

/* "cpu" -> host; "cuda:N" -> CUDA device N (0..1023).  0, or SX_EINVAL
 * with a message for anything else. */
int sx__mem_parse_location(const char *location, sx__mem_info *out);

/*
 * Check that [addr, addr+len) is memory of the kind location names and
 * fill *out.  "cuda:N": device memory (not managed) of device N, lying
 * inside one allocation; the message says which rule broke (another
 * device, host memory, crossing the allocation's end).  "cpu": where a
 * driver is loaded, the range must not be device memory.  Errors:
 * SX_EINVAL, SX_EBOUNDS, SX_ENODEV (no driver or no such device),
 * SX_ENOTSUP (built without CUDA).
 */
int sx__mem_check(const void *addr, uint64_t len, const char *location,
                  sx__mem_info *out);

/* The kind of the memory at addr: host when no driver is loaded or the
 * driver does not know the pointer.  Never fails. */
void sx__mem_query(const void *addr, sx__mem_info *out);

/* Load the driver and count its devices.  0 with *n (>= 1), or SX_ENODEV /
 * SX_ENOTSUP with a message. */
int sx__mem_cuda_devices(int *n);

/* Synchronous helpers for programs and tests: device memory in the
 * primary context of device, a copy between any two kinds (unified
 * addressing), device memory freed. */
int sx__mem_alloc(int device, size_t len, void **out);
void sx__mem_free(void *p);
int sx__mem_copy(void *dst, const void *src, size_t len);

/* Pinned (page-locked) host memory, for staging. */
int sx__mem_host_alloc(size_t len, void **out);
void sx__mem_host_free(void *p);

/* ------------------------------------------------------------ streams */

typedef struct sx__mem_stream sx__mem_stream;
typedef struct sx__mem_notifier sx__mem_notifier;
typedef struct sx__mem_launcher sx__mem_launcher;

/* A notice queued behind the work on a stream; fn runs on the notifier's
 * loop once everything queued on the stream before it has finished. */
typedef struct sx__mem_notice {
  struct sx__mem_notice *next;
  void (*fn)(struct sx__mem_notice *n);
  sx__mem_notifier *nf; /* set by sx__mem_notify: where the host function posts it */
  /* 0, or the error of work queued before it through a launcher that
   * failed (set by the memory layer; fn reads it). */
  int status;
  uint64_t mark; /* set by sx__mem_notify: the stream's gathers before it */
} sx__mem_notice;

/* Delivers notices on loop (loop thread, or before the loop runs);
 * reads SX_GPU_NOTICE. */
int sx__mem_notifier_create(uv_loop_t *loop, sx__mem_notifier **out);
/* Close it (loop thread).  Every stream that queued notices for it must be
 * destroyed first (so every notice has fired); notices not delivered yet
 * are delivered now, inside this call. */
void sx__mem_notifier_close(sx__mem_notifier *n);

/* A non-blocking stream on device's primary context. */
int sx__mem_stream_create(int device, sx__mem_stream **out);
/* A thread that makes the gather launches and notices of the streams
 * created on it (launch.c): the caller only writes the tables and queues.
 * Destroy it after its streams. */
int sx__mem_launcher_create(sx__mem_launcher **out);
void sx__mem_launcher_destroy(sx__mem_launcher *l);
/* A stream whose gather launches and notices may go through l (NULL: made
 * by the caller, as sx__mem_stream_create).  A launch that fails there
 * reaches the next notice on the stream as its status. */
int sx__mem_stream_create_on(int device, sx__mem_launcher *l, sx__mem_stream **out);
/* The owner's choice for the calls it makes next on s: through its
 * launcher (on), or itself (off; still queued while earlier ones wait
 * there, to keep their order).  Off when created. */
void sx__mem_stream_defer(sx__mem_stream *s, int on);
/* Wait for the stream's work, then destroy it.  NULL is a no-op. */
void sx__mem_stream_destroy(sx__mem_stream *s);
int sx__mem_stream_device(const sx__mem_stream *s);
/* Queue an asynchronous copy of len bytes (any kinds; host memory should be
 * pinned for the copy to overlap). */
int sx__mem_copy_async(sx__mem_stream *s, void *dst, const void *src, size_t len);
/* Queue note behind the work on s.  0, or an error (note will not run).
 * As n was created (SX_GPU_NOTICE, see stream.c): polled by the loop
 * (auto, the default: a flag or an event), by a host function on the
 * stream (host, and where the driver lacks events), or by an event that a
 * thread of the stream's own waits for (event). */
int sx__mem_notify(sx__mem_stream *s, sx__mem_notifier *n, sx__mem_notice *note);
/* The thread that queues on s, in note's fn (s still alive): everything
 * queued on s before note has finished, so the gather tables of those
 * launches are free without asking the driver (a passed event costs
 * about 1.4 us to ask). */
void sx__mem_stream_passed(sx__mem_stream *s, const sx__mem_notice *note);
/* Deliver note on n's loop in a later iteration (any thread): for work
 * that must not run inside the current call stack. */
void sx__mem_notice_post(sx__mem_notifier *n, sx__mem_notice *note);
/* Notices queued on n and not delivered yet (poll mode; 0 otherwise). */
long sx__mem_notifier_pending(sx__mem_notifier *n);
/* Tests: the notices queued so far in this process, by how: [0] polled
 * events, [1] host functions (also the fallback), [2] waited events,
 * [3] polled flags. */
void sx__mem_notice_counts(uint64_t out[4]);
/* Wait for the work on s (setup and teardown only). */
int sx__mem_stream_sync(sx__mem_stream *s);

/* Marks (mark.c), for a thread that watches a stream's progress itself
 * rather than through a notifier's loop.  Any thread, one at a time per
 * stream (the caller serializes its calls on s).
 *
 * sx__mem_stream_mark: value is written into *word (pinned host memory,
 * from sx__mem_pinned_get) once the work queued on s before this call has
 * completed: by the stream, behind that work (cuStreamWriteValue64), or
 * by the host after waiting for the stream where the driver refuses the
 * write.  The error of a launch made for s by its launcher before the
 * mark (or of the wait) is stored into *err first.  0, or an error (no
 * driver): then nothing was queued.
 * sx__mem_stream_marks: 1 when device's driver has what marks and
 * sx__mem_stream_stopped need (stream writes, cuStreamQuery,
 * cuCtxGetCurrent), else 0.
 * sx__mem_stream_stopped: 1 when s has nothing left to run, 0 while it
 * has, or the stream's error (a broken stream never writes its marks).
 * sx__mem_ctx_keep / sx__mem_ctx_back: the calling thread's current
 * context, to be made current again after calls that make a device's
 * primary context current (an engine's thread keeps its own). */
int sx__mem_stream_mark(sx__mem_stream *s, uint64_t *word, uint64_t value, int *err);
int sx__mem_stream_marks(int device);
int sx__mem_stream_stopped(sx__mem_stream *s);
int sx__mem_ctx_keep(void **saved);
void sx__mem_ctx_back(void *saved);

/* ------------------------------------------------------------ gathers */

/*
 * A batch of copies in one call, by one of three methods:
 *
 *   kernel  the gather kernel (agent/mem/gather.cu, shipped as PTX and
 *           JIT-compiled by the driver once per device): one launch on s
 *           for all ranges, the GPU's SMs loading and storing 16 bytes at a
 *           time where aligned, from this GPU's memory, a peer GPU's (an
 *           IPC mapping, or peer access: over NVLink) or pinned host
 *           memory.  The ranges go to the GPU as a table in pinned host
 *           memory, read in place by the kernel.
 *   batch   cuMemcpyBatchAsync: one driver call, the copy engines pay per
 *           range (CUDA 12.8+ drivers; refused or missing: range).
 *   range   one cuMemcpyAsync per range.
 *
 * Which runs: the method asked for; SX__COPY_AUTO takes the environment's
 * SX_GPU_COPY=kernel|batch|range|auto, and on auto chooses per shape: one
 * range goes to the copy engine (range: no SMs taken for one copy); more
 * go to the kernel when flags say it may touch every pointer and the
 * average range is at most SX__GATHER_KERNEL_MAX bytes, else batch.  The
 * kernel is passed over (batch, else range) where flags lack
 * SX__GATHER_SM_OK (pageable host memory: only the copy engines reach it)
 * or where it does not load (sx__mem_kernel_error says why).
 */
typedef struct sx__mem_range {
  uint64_t dst, src, len;
} sx__mem_range;

typedef enum sx__mem_copy_method {
  SX__COPY_AUTO = 0,
  SX__COPY_KERNEL = 1,
  SX__COPY_BATCH = 2,
  SX__COPY_RANGE = 3,
} sx__mem_copy_method;

#define SX__GATHER_SM_OK 1u /* every pointer is device or pinned host memory */
/* SX__COPY_AUTO means "choose per shape": the caller read SX_GPU_COPY
 * already (once, with sx__mem_copy_env; getenv per launch was about 2% of
 * the cuda_ipc reader's loop). */
#define SX__GATHER_ENV_READ 2u
#define SX__GATHER_KERNEL_MAX (8u << 20) /* auto: kernel up to this mean range */
#define SX__GATHER_PIECE (64u << 10)     /* bytes one thread block copies at a time */

/* Queue r[0..n) on s (each r[i].len bytes from src to dst; any kinds the
 * method reaches).  *used (may be NULL): the method that ran.  0, or an
 * error (some copies may have been queued: they still run). */
int sx__mem_gather(sx__mem_stream *s, const sx__mem_range *r, size_t n, unsigned flags,
                   sx__mem_copy_method method, sx__mem_copy_method *used);
/* A strided copy: count pieces of len bytes, piece k from src + k * sstride
 * to dst + k * dstride (no piece overlapping another on either side). */
typedef struct sx__mem_strided {
  uint64_t dst, src, len, count, dstride, sstride;
} sx__mem_strided;

/* The same as sx__mem_gather for n strided copies: the kernel copies each
 * as a few table entries of up to SX__GATHER_PIECE bytes (a second entry
 * point of the same module, sx_gather_strided), batch passes every piece
 * to one cuMemcpyBatchAsync, range queues a cuMemcpyAsync per piece.  Auto
 * chooses as sx__mem_gather does, counting pieces as ranges. */
int sx__mem_gather_strided(sx__mem_stream *s, const sx__mem_strided *r, size_t n,
                           unsigned flags, sx__mem_copy_method method,
                           sx__mem_copy_method *used);
/* One entry of a based gather: len bytes from bases[region] + src to dst
 * (dst absolute).  32 bytes; entry_first/entry_last are the caller's (the
 * batch entries the piece serves) and the kernel ignores them. */
typedef struct sx__mem_bpiece {
  uint64_t dst, src;
  uint32_t len, region;
  uint32_t entry_first, entry_last;
} sx__mem_bpiece;
#define SX__GATHER_BASES 16 /* regions (bases) one based gather may name */

/* Queue one launch of the gather kernel's based entry point
 * (sx_gather_based) on s over table[0..n): every len is 1..SX__GATHER_PIECE,
 * every region < nb <= SX__GATHER_BASES.  The table is pinned host memory
 * from sx__mem_pinned_get that the caller wrote and leaves untouched until a
 * notice queued on s after this call has passed (the kernel reads it in
 * place: no copy, no ring slot).  By s's launcher when the stream is
 * deferred (as the other gathers), else now.  0; SX_ENOTSUP with the reason
 * (sx__mem_kernel_error) where the kernel does not load; or the driver's
 * error.  Counted as a kernel gather in sx__mem_copy_counts. */
int sx__mem_gather_based(sx__mem_stream *s, const sx__mem_bpiece *table, size_t n,
                         const uint64_t *bases, unsigned nb);

/* Pinned host memory (portable: every context may use it) for based-gather
 * tables, from a process-wide pool: at least bytes; *cap receives the size
 * actually held (a power of two, at least 16 KiB).  Any thread; a miss
 * allocates (cuMemHostAlloc) under device's primary context and then makes
 * the calling thread's own current context current again (the caller may
 * be an engine's thread whose CUDA runtime works on another device; no
 * other device's context is created), a hit takes a buffer put back
 * earlier.  0, or an error with its message (no CUDA driver: SX_ENODEV,
 * as everywhere here; built without CUDA, or a driver without
 * cuCtxGetCurrent: SX_ENOTSUP). */
int sx__mem_pinned_get(int device, size_t bytes, void **out, size_t *cap);
/* Give p (cap bytes, from sx__mem_pinned_get) back to the pool; NULL is
 * ignored.  The pool keeps at most SX__PINNED_KEEP buffers per size, and
 * SX__PINNED_KEEP_BYTES in all (pinned memory is the host's to lose),
 * and frees the rest. */
#define SX__PINNED_KEEP 64
#define SX__PINNED_KEEP_BYTES (64u << 20)
void sx__mem_pinned_put(void *p, size_t cap);
/* Tests: the bytes the pool keeps now; free them all. */
size_t sx__mem_pinned_kept(void);
void sx__mem_pinned_drain(void);

/* SX_GPU_COPY as a method (SX__COPY_AUTO when unset, or unknown: said once
 * on stderr). */
sx__mem_copy_method sx__mem_copy_env(void);
/* "auto", "kernel", "batch", "range". */
const char *sx__mem_copy_name(sx__mem_copy_method m);
/* Load the kernel for device: NULL when it is there, else why not. */
const char *sx__mem_kernel_error(int device);
/* Gathers queued so far in this process, per method (index: the enum),
 * for logs and benchmarks. */
void sx__mem_copy_counts(uint64_t out[4]);
/* Let device's context load and store peer's memory (cuCtxEnablePeerAccess;
 * already enabled is fine).  IPC mappings need none of it. */
int sx__mem_peer_enable(int device, int peer);

/* ------------------------------------------------------------ GPUDirect RDMA */

/* Can device's memory be exported as dma-buf (the driver has
 * cuMemGetHandleForAddressRange and the device reports
 * CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)?  1, or 0 with a message. */
int sx__mem_dmabuf_supported(int device);

/* A dma-buf fd for [addr, addr+len) of device memory, for
 * ibv_reg_dmabuf_mr: the range itself rounded out to host pages (never the
 * allocation cuMemGetAddressRange names: that breaks VMM and
 * expandable-segment memory, whose allocations are pieces), and *offset,
 * where addr lies in the fd.  Also sets CU_POINTER_ATTRIBUTE_SYNC_MEMOPS on
 * the range, so copies and kernels order against RDMA.  The caller closes
 * *fd once its registrations are done.  SX_ENOTSUP where dma-buf is not
 * there, SX_EIO with the driver's word otherwise. */
int sx__mem_dmabuf_export(const void *addr, uint64_t len, int device, int *fd,
                          uint64_t *offset);

/* After RDMA READs landed in GPU memory that another GPU (or a kernel not
 * ordered with the NIC) consumes: cuFlushGPUDirectRDMAWrites on the
 * current context.  0 where the driver lacks it (nothing to flush). */
int sx__mem_flush_rdma_writes(int device);

/* The PCI address of CUDA device `device` as sysfs names it
 * ("0000:17:00.0", lower-case hex), from the driver's PCI domain, bus and
 * device attributes, for the RDMA transport's NIC choice (pci.c).  0, or
 * SX_ENODEV / SX_ENOTSUP with a message (no driver, a driver without
 * cuDeviceGetAttribute, a build without CUDA). */
int sx__mem_pci_address(int device, char *buf, size_t len);

/* ------------------------------------------------------------ IPC */

#define SX__MEM_IPC_HANDLE 64 /* bytes in a CUDA IPC memory handle */

/* The IPC handle of the allocation holding addr (device memory). */
int sx__mem_ipc_export(const void *addr, uint8_t handle[SX__MEM_IPC_HANDLE]);
/* Map another process's allocation into device's context (peer access
 * enabled lazily when it lives on another GPU); close it again.  An open
 * mapping must be closed before this process lets go of the device.
 * *size: the bytes mapped, as the driver says (the exporter's word on the
 * allocation's size is not to be trusted). */
int sx__mem_ipc_open(int device, const uint8_t handle[SX__MEM_IPC_HANDLE], void **out,
                     uint64_t *size);
void sx__mem_ipc_close(int device, void *p);
/* Mappings open in this process now (for leak checks in tests). */
long sx__mem_ipc_open_count(void);

#endif
