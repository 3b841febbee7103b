/*
 * GPUDirect RDMA through dma-buf: which devices can export their memory,
 * and the export itself (mem.h).  The RDMA transport registers the fd this
 * returns with ibv_reg_dmabuf_mr; it never calls CUDA itself.
 *
 * The rules peers learned the hard way (Mooncake #2511, UCX #11461): export
 * the range being registered, rounded out to host pages, not the allocation
 * that cuMemGetAddressRange names (VMM and PyTorch expandable segments map
 * one "allocation" from several physical chunks, and exporting across them
 * fails or pins the wrong pages); register with the offset of the range
 * inside the fd and iova = the range's own address; set SYNC_MEMOPS so that
 * CUDA copies and kernels are ordered with the NIC's accesses (where the
 * driver takes it: cuMemAlloc memory, not VMM memory).
 */
#ifdef SX_HAVE_CUDA
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "mem_int.h"

int sx__mem_dmabuf_supported(int device) {
  int err = 0, v = 0;
  const sx__cuda_drv *d = sx__cuda_get(device, &err);
  if (d == NULL)
    return 0;
  if (d->MemGetHandleForAddressRange == NULL || d->DeviceGetAttribute == NULL) {
    sx__err(SX_ENOTSUP, "the CUDA driver has no cuMemGetHandleForAddressRange (CUDA 11.7+)");
    return 0;
  }
  CUresult r = d->DeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, (CUdevice)device);
  if (r != CUDA_SUCCESS || v == 0) {
    sx__err(SX_ENOTSUP, "cuda:%d does not report CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED",
            device);
    return 0;
  }
  return 1;
}

int sx__mem_dmabuf_export(const void *addr, uint64_t len, int device, int *fd,
                          uint64_t *offset) {
  int err = 0;
  const sx__cuda_drv *d = sx__cuda_get(device, &err);
  if (d == NULL)
    return err;
  if (d->MemGetHandleForAddressRange == NULL)
    return sx__err(SX_ENOTSUP, "the CUDA driver has no cuMemGetHandleForAddressRange");
  long ps = sysconf(_SC_PAGESIZE);
  uint64_t page = ps > 0 ? (uint64_t)ps : 4096, a = (uint64_t)(uintptr_t)addr;
  uint64_t start = a & ~(page - 1), end;
  if (len == 0 || !sx__add_ok(a, len, &end) || end > UINT64_MAX - page)
    return sx__err(SX_EINVAL, "dma-buf export of %llu bytes at 0x%llx",
                   (unsigned long long)len, (unsigned long long)a);
  end = (end + page - 1) & ~(page - 1);
  /* Copies and kernels on this memory synchronise with the NIC's DMA.
   * The driver takes the attribute for cuMemAlloc memory only: for VMM
   * memory (cuMemCreate + cuMemMap, PyTorch's expandable segments) an
   * H100 with driver 580 answers CUDA_ERROR_NOT_SUPPORTED
   * (tests/gpu/results/2026-11-26-h100-final-merged.txt), as NCCL, which
   * registers cuMem buffers without it, expects.  That answer is not a
   * reason to stage: the export goes on without the attribute. */
  if (d->PointerSetAttribute != NULL) {
    unsigned one = 1;
    CUresult r = d->PointerSetAttribute(&one, CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, (CUdeviceptr)a);
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_NOT_SUPPORTED)
      return sx__cuda_err(d, r, "cuPointerSetAttribute(SYNC_MEMOPS)");
  }
  int h = -1;
  CUresult r = d->MemGetHandleForAddressRange(&h, (CUdeviceptr)start, (size_t)(end - start),
                                              CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (r != CUDA_SUCCESS)
    return sx__cuda_err(d, r, "cuMemGetHandleForAddressRange(DMA_BUF_FD)");
  if (h < 0)
    return sx__err(SX_EIO, "cuMemGetHandleForAddressRange returned fd %d", h);
  *fd = h;
  *offset = a - start;
  return 0;
}

int sx__mem_flush_rdma_writes(int device) {
  int err = 0;
  const sx__cuda_drv *d = sx__cuda_get(device, &err);
  if (d == NULL || d->FlushGPUDirectRDMAWrites == NULL)
    return 0;
  CUresult r = d->FlushGPUDirectRDMAWrites(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                                           CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_ALL_DEVICES);
  return r == CUDA_SUCCESS ? 0 : sx__cuda_err(d, r, "cuFlushGPUDirectRDMAWrites");
}
#endif
