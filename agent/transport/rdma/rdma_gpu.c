/*
 * GPUDirect tiers: which (RDMA device, GPU) pairs register GPU memory, and
 * how (docs/gpu.md).  In order, unless SX_RDMA_GPU / rdma_gpu forces one:
 *
 *   dma-buf   the GPU reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, the
 *             driver has cuMemGetHandleForAddressRange, and the provider
 *             takes dma-buf MRs: ibv_reg_dmabuf_mr(pd, 0, page, 0, fd -1)
 *             fails with EBADF (it looked at the fd) where it does, with
 *             EOPNOTSUPP or the like where it does not.  The memory layer
 *             exports the region (mem.h); one fd serves every device and
 *             is closed once they registered.
 *   peermem   ibv_reg_mr on the device pointer, where nvidia_peermem or
 *             nv_peer_mem is loaded.
 *   staged    no MR: the region is published with rkey 0 and moves through
 *             rings (rdma_stage.c, rdma_sserve.c).
 *
 * A registration that fails drops to the next tier and the log says why.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rdma_int.h"

static int probe_dmabuf(sx_rdma *t, rdma_dev *d) {
  if (t->dmabuf[d->index] == 0) {
    long ps = sysconf(_SC_PAGESIZE);
    errno = 0;
    struct ibv_mr *mr = ibv_reg_dmabuf_mr(d->pd, 0, (size_t)(ps > 0 ? ps : 4096), 0, -1,
                                          IBV_ACCESS_LOCAL_WRITE);
    int e = errno;
    if (mr != NULL)
      ibv_dereg_mr(mr);
    t->dmabuf[d->index] = mr == NULL && e == EBADF ? 1 : -1;
    sx__rdma_log(t, SX_LOG_INFO, "%s %s dma-buf MRs (probe: %s)", d->name,
                 t->dmabuf[d->index] > 0 ? "takes" : "does not take",
                 mr != NULL ? "an MR on fd -1" : strerror(e));
  }
  return t->dmabuf[d->index] > 0;
}

/* nvidia_peermem (or the older nv_peer_mem) lets ibv_reg_mr pin GPU
 * pages.  SX_RDMA_SYSFS names another directory for /sys (tests). */
static int peermem_loaded(void) {
  const char *root = getenv("SX_RDMA_SYSFS");
  static const char *const mods[] = {"nvidia_peermem", "nv_peer_mem"};
  char path[512];
  for (size_t i = 0; i < sizeof(mods) / sizeof(mods[0]); i++) {
    snprintf(path, sizeof(path), "%s/module/%s", root != NULL ? root : "/sys", mods[i]);
    if (access(path, F_OK) == 0)
      return 1;
  }
  return 0;
}

int sx__rdma_gpu_reg(sx_rdma *t, sx_lregion *lr, rdma_mr **out) {
  sx__rdma_gpu_tier tier = t->gpu_tier;
  *out = NULL;
  if (tier == SX__RDMA_GPU_OFF || tier == SX__RDMA_GPU_STAGED) {
    sx__rdma_log(t, SX_LOG_INFO, "region %u (%s): no GPUDirect (SX_RDMA_GPU=%s)%s", lr->r.id,
                 lr->r.location, sx__rdma_gpu_tier_name(tier),
                 tier == SX__RDMA_GPU_STAGED ? ": staged" : "");
    return 0;
  }
  int want_dmabuf = tier == SX__RDMA_GPU_AUTO || tier == SX__RDMA_GPU_DMABUF;
  int want_peer = tier == SX__RDMA_GPU_AUTO || tier == SX__RDMA_GPU_PEERMEM;
  void *addr = (void *)(uintptr_t)lr->r.addr;
  size_t len = (size_t)lr->r.length;
  int remote = (lr->r.access & SX_ACCESS_REMOTE_READ) != 0;
  int access = IBV_ACCESS_LOCAL_WRITE | (remote ? IBV_ACCESS_REMOTE_READ : 0);
  int fd = -1, export_rc = 1, any = 0;
  uint64_t off = 0;
  char export_msg[200] = "";
  rdma_mr *rm = calloc(1, sizeof(*rm));
  if (rm == NULL)
    return sx__err(SX_ENOMEM, "rdma: out of memory");
  rm->lreg = lr;
  for (int i = 0; i < t->n_devs; i++) {
    rdma_dev *d = &t->devs[i];
    struct ibv_mr *mr = NULL;
    const char *how = "staged";
    char why[400] = "";
    if (want_dmabuf) {
      if (!sx__mem_dmabuf_supported(lr->mem.device)) {
        snprintf(why, sizeof(why), "dma-buf: %s", sx_errmsg());
      } else if (!probe_dmabuf(t, d)) {
        snprintf(why, sizeof(why), "dma-buf: %s does not take dma-buf MRs", d->name);
      } else {
        if (export_rc == 1) { /* one export for every device */
          export_rc = sx__mem_dmabuf_export(addr, len, lr->mem.device, &fd, &off);
          if (export_rc)
            snprintf(export_msg, sizeof(export_msg), "%s", sx_errmsg());
        }
        if (export_rc != 0) {
          snprintf(why, sizeof(why), "dma-buf: %s", export_msg);
        } else {
          mr = ibv_reg_dmabuf_mr(d->pd, off, len, lr->r.addr, fd, access);
          if (mr == NULL)
            snprintf(why, sizeof(why), "dma-buf: ibv_reg_dmabuf_mr(%s, offset %llu, %zu "
                     "bytes): %s", d->name, (unsigned long long)off, len, strerror(errno));
          else
            how = "dma-buf GPUDirect";
        }
      }
    }
    if (mr == NULL && want_peer) {
      size_t w = strlen(why);
      if (!peermem_loaded()) {
        snprintf(why + w, sizeof(why) - w, "%speermem: neither nvidia_peermem nor "
                 "nv_peer_mem is loaded", w ? "; " : "");
      } else if ((mr = ibv_reg_mr(d->pd, addr, len, access)) == NULL) {
        snprintf(why + w, sizeof(why) - w, "%speermem: ibv_reg_mr(%s): %s", w ? "; " : "",
                 d->name, strerror(errno));
      } else {
        how = "peermem GPUDirect";
      }
    }
    /* The first remote-readable MR of each pair proves the NIC reaches the
     * GPU (registration alone does not); a pair that cannot is staged. */
    int g = lr->mem.device;
    if (mr != NULL && remote && g >= 0 && g < SX__RDMA_REACH_GPUS) {
      char rwhy[200] = "";
      if (t->reach[i][g] == 0) {
        t->reach[i][g] = sx__rdma_reach(t, d, mr, lr->r.addr, rwhy, sizeof(rwhy)) ? 1 : -1;
        if (t->reach[i][g] < 0)
          sx__rdma_reach_failed(t, d, g, rwhy);
      }
      if (t->reach[i][g] < 0) {
        ibv_dereg_mr(mr);
        mr = NULL;
        how = "staged";
        snprintf(why, sizeof(why), "%s registered it, but a loopback READ of cuda:%d failed "
                 "earlier%s%s", d->name, g, rwhy[0] ? ": " : "", rwhy);
      }
    }
    rm->mr[i] = mr;
    any |= mr != NULL;
    sx__rdma_log(t, SX_LOG_INFO, "region %u (%s, %zu bytes) on %s: "
                 "%s%s%s%s", lr->r.id, lr->r.location, len, d->name, how,
                 mr != NULL ? "" : " (", why, mr != NULL ? "" : ")");
  }
  /* The MRs hold the pages; the fd is no longer needed. */
  if (fd >= 0)
    close(fd);
  if (!any) {
    free(rm);
    return 0;
  }
  *out = rm;
  return 0;
}
