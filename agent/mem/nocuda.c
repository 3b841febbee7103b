/*
 * The memory layer in a build without cuda.h: host memory only.  Every
 * CUDA call fails with SX_ENOTSUP and says why.
 */
#ifndef SX_HAVE_CUDA
#include <stdlib.h>

#include "internal.h"
#include "mem.h"

static int no_cuda(const char *what) {
  return sx__err(SX_ENOTSUP, "%s: this segxfer was built without CUDA support (cuda.h "
                 "was not found; rebuild with CUDA_HOME=<toolkit>)", what);
}

int sx__mem_check(const void *addr, uint64_t len, const char *location,
                  sx__mem_info *out) {
  (void)addr;
  (void)len;
  sx__mem_info m;
  int rc = sx__mem_parse_location(location, &m);
  if (rc)
    return rc;
  if (m.kind != SX__MEM_HOST)
    return no_cuda(location);
  *out = m;
  return 0;
}

void sx__mem_query(const void *addr, sx__mem_info *out) {
  (void)addr;
  *out = (sx__mem_info){.kind = SX__MEM_HOST, .device = -1};
}

int sx__mem_cuda_devices(int *n) {
  (void)n;
  return no_cuda("CUDA devices");
}

int sx__mem_alloc(int device, size_t len, void **out) {
  (void)device, (void)len, (void)out;
  return no_cuda("device memory");
}
void sx__mem_free(void *p) { (void)p; }
int sx__mem_copy(void *dst, const void *src, size_t len) {
  (void)dst, (void)src, (void)len;
  return no_cuda("copy");
}
int sx__mem_host_alloc(size_t len, void **out) {
  (void)len, (void)out;
  return no_cuda("pinned memory");
}
void sx__mem_host_free(void *p) { (void)p; }
int sx__mem_notifier_create(uv_loop_t *loop, sx__mem_notifier **out) {
  (void)loop, (void)out;
  return no_cuda("notifier");
}
void sx__mem_notifier_close(sx__mem_notifier *n) { (void)n; }
int sx__mem_stream_create(int device, sx__mem_stream **out) {
  (void)device, (void)out;
  return no_cuda("stream");
}
int sx__mem_stream_create_on(int device, sx__mem_launcher *l, sx__mem_stream **out) {
  (void)device, (void)l, (void)out;
  return no_cuda("stream");
}
int sx__mem_launcher_create(sx__mem_launcher **out) {
  (void)out;
  return no_cuda("launcher");
}
void sx__mem_launcher_destroy(sx__mem_launcher *l) { (void)l; }
void sx__mem_stream_defer(sx__mem_stream *s, int on) { (void)s, (void)on; }
void sx__mem_stream_passed(sx__mem_stream *s, const sx__mem_notice *note) {
  (void)s, (void)note;
}
long sx__mem_notifier_pending(sx__mem_notifier *n) {
  (void)n;
  return 0;
}
void sx__mem_stream_destroy(sx__mem_stream *s) { (void)s; }
int sx__mem_stream_device(const sx__mem_stream *s) {
  (void)s;
  return -1;
}
int sx__mem_copy_async(sx__mem_stream *s, void *dst, const void *src, size_t len) {
  (void)s, (void)dst, (void)src, (void)len;
  return no_cuda("copy");
}
int sx__mem_gather(sx__mem_stream *s, const sx__mem_range *r, size_t n, unsigned flags,
                   sx__mem_copy_method method, sx__mem_copy_method *used) {
  (void)s, (void)r, (void)n, (void)flags, (void)method, (void)used;
  return no_cuda("copy");
}
int sx__mem_gather_strided(sx__mem_stream *s, const sx__mem_strided *r, size_t n,
                           unsigned flags, sx__mem_copy_method method,
                           sx__mem_copy_method *used) {
  (void)s, (void)r, (void)n, (void)flags, (void)method, (void)used;
  return no_cuda("copy");
}
int sx__mem_gather_based(sx__mem_stream *s, const sx__mem_bpiece *table, size_t n,
                         const uint64_t *bases, unsigned nb) {
  (void)s, (void)table, (void)n, (void)bases, (void)nb;
  return no_cuda("gather kernel");
}
int sx__mem_pinned_get(int device, size_t bytes, void **out, size_t *cap) {
  (void)device, (void)bytes, (void)out, (void)cap;
  return no_cuda("pinned memory");
}
void sx__mem_pinned_put(void *p, size_t cap) { (void)p, (void)cap; }
size_t sx__mem_pinned_kept(void) { return 0; }
void sx__mem_pinned_drain(void) {}
sx__mem_copy_method sx__mem_copy_env(void) { return SX__COPY_AUTO; }
const char *sx__mem_copy_name(sx__mem_copy_method m) {
  static const char *const names[] = {"auto", "kernel", "batch", "range"};
  return (unsigned)m < 4 ? names[m] : "?";
}
const char *sx__mem_kernel_error(int device) {
  (void)device;
  return "built without CUDA support";
}
void sx__mem_copy_counts(uint64_t out[4]) { out[0] = out[1] = out[2] = out[3] = 0; }
int sx__mem_peer_enable(int device, int peer) {
  (void)device, (void)peer;
  return no_cuda("peer access");
}
int sx__mem_notify(sx__mem_stream *s, sx__mem_notifier *n, sx__mem_notice *note) {
  (void)s, (void)n, (void)note;
  return no_cuda("notify");
}
void sx__mem_notice_post(sx__mem_notifier *n, sx__mem_notice *note) {
  (void)n, (void)note;
}
void sx__mem_notice_counts(uint64_t out[4]) { out[0] = out[1] = out[2] = out[3] = 0; }
int sx__mem_stream_sync(sx__mem_stream *s) {
  (void)s;
  return no_cuda("stream");
}
int sx__mem_stream_mark(sx__mem_stream *s, uint64_t *word, uint64_t value, int *err) {
  (void)s, (void)word, (void)value, (void)err;
  return no_cuda("stream");
}
int sx__mem_stream_marks(int device) {
  (void)device;
  return 0;
}
int sx__mem_stream_stopped(sx__mem_stream *s) {
  (void)s;
  return no_cuda("stream");
}
int sx__mem_ctx_keep(void **saved) {
  (void)saved;
  return no_cuda("context");
}
void sx__mem_ctx_back(void *saved) { (void)saved; }
int sx__mem_ipc_export(const void *addr, uint8_t handle[SX__MEM_IPC_HANDLE]) {
  (void)addr, (void)handle;
  return no_cuda("IPC");
}
int sx__mem_ipc_open(int device, const uint8_t handle[SX__MEM_IPC_HANDLE], void **out,
                     uint64_t *size) {
  (void)device, (void)handle, (void)out, (void)size;
  return no_cuda("IPC");
}
void sx__mem_ipc_close(int device, void *p) { (void)device, (void)p; }
int sx__mem_dmabuf_supported(int device) {
  (void)device;
  no_cuda("dma-buf export");
  return 0;
}
int sx__mem_dmabuf_export(const void *addr, uint64_t len, int device, int *fd,
                          uint64_t *offset) {
  (void)addr, (void)len, (void)device, (void)fd, (void)offset;
  return no_cuda("dma-buf export");
}
int sx__mem_flush_rdma_writes(int device) {
  (void)device;
  return 0;
}
long sx__mem_ipc_open_count(void) { return 0; }
#else
typedef int sx__mem_nocuda_unused; /* ISO C wants something in a file */
#endif
