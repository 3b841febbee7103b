/*
 * LD_PRELOAD shim for the RDMA suite's GPUDirect tests (test_rdma_gpu
 * dmabuf|peermem): Soft-RoCE refuses dma-buf MRs, and the GPU here is the
 * host-memory stand-in (tests/gpu/fake_cuda.c), so this plays a provider
 * that takes them.  It proves segxfer's tier detection, export offsets,
 * fd lifetime, rkeys and fallbacks; it proves nothing about GPU peer to
 * peer DMA, which no machine here can do.
 *
 *   ibv_reg_dmabuf_mr(pd, 0, len, 0, -1, ...)   the probe: EBADF (supported)
 *   ibv_reg_dmabuf_mr(pd, off, len, iova, fd, ...)
 *       the stand-in's dma-buf fd is a memfd: the pages at `off` of the
 *       exported range are mapped and registered with ibv_reg_mr_iova, so
 *       the MR covers the same pages at the iova asked for.
 *   ibv_reg_mr / ibv_reg_mr_iova2 on stand-in device memory: as the
 *       provider would without a peer-memory client: EFAULT when
 *       SXSHIM_PEERMEM=efault, else the real call (the pages are host pages).
 *
 * SXSHIM_DMABUF: "ok" (default), "off" (the probe says EOPNOTSUPP, as rxe
 * does), "fail" (the probe passes, registrations fail with EINVAL),
 * "unreachable" (registrations succeed, the NIC cannot read the pages).
 * SXSHIM_LOG=path appends one line per call, for the tests to read.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

static void say(const char *fmt, ...) {
  const char *path = getenv("SXSHIM_LOG");
  if (path == NULL)
    return;
  FILE *f = fopen(path, "a");
  if (f == NULL)
    return;
  va_list ap;
  va_start(ap, fmt);
  vfprintf(f, fmt, ap);
  va_end(ap);
  fputc('\n', f);
  fclose(f);
}

static void *fake(const char *sym) {
  const char *lib = getenv("SX_CUDA_LIBRARY");
  void *h = lib != NULL ? dlopen(lib, RTLD_NOW | RTLD_NOLOAD) : NULL;
  return h != NULL ? dlsym(h, sym) : NULL;
}

static int mode(const char *var, const char *value) {
  const char *v = getenv(var);
  return v != NULL && strcmp(v, value) == 0;
}

static int is_device(const void *p) {
  int (*f)(const void *) = (int (*)(const void *))fake("fake_cuda_is_device");
  return f != NULL && f(p);
}

/* ibv_reg_mr of stand-in device memory: what a provider without a peer
 * memory client does (EFAULT) when asked to, else it goes through. */
static int peermem_refuses(const void *addr) {
  if (!is_device(addr))
    return 0;
  if (mode("SXSHIM_PEERMEM", "efault")) {
    say("reg_mr device memory %p -> EFAULT", addr);
    errno = EFAULT;
    return 1;
  }
  say("reg_mr device memory %p -> peermem", addr);
  return 0;
}

EXPORT struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t length,
                                        uint64_t iova, int fd, int access) {
  if (fd < 0) {
    errno = mode("SXSHIM_DMABUF", "off") ? EOPNOTSUPP : EBADF;
    say("probe -> %s", errno == EBADF ? "EBADF" : "EOPNOTSUPP");
    return NULL;
  }
  if (mode("SXSHIM_DMABUF", "fail") || mode("SXSHIM_DMABUF", "off")) {
    say("dmabuf fd %d off %llu len %zu -> EINVAL", fd, (unsigned long long)offset, length);
    errno = EINVAL;
    return NULL;
  }
  int (*info)(int, uint64_t *, uint64_t *) =
      (int (*)(int, uint64_t *, uint64_t *))fake("fake_cuda_dmabuf_info");
  uint64_t base = 0, size = 0;
  if (info == NULL || info(fd, &base, &size) != 0 || offset > size || length > size - offset) {
    say("dmabuf fd %d off %llu len %zu -> EINVAL (not an exported range)", fd,
        (unsigned long long)offset, length);
    errno = EINVAL;
    return NULL;
  }
  long ps = sysconf(_SC_PAGESIZE);
  uint64_t at = base + offset, delta = at % (uint64_t)ps;
  uint8_t *m = mmap(NULL, length + delta, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                    (off_t)(at - delta));
  if (m == MAP_FAILED)
    return NULL;
  /* The mapping stays for the MR's life (a test's worth of leak).
   * SXSHIM_DMABUF=unreachable: registration succeeds, but the NIC cannot
   * read the memory (no remote access), as where no peer-to-peer path
   * exists: the first READ fails with a remote access error. */
  if (mode("SXSHIM_DMABUF", "unreachable"))
    access &= ~IBV_ACCESS_REMOTE_READ;
  struct ibv_mr *mr = ibv_reg_mr_iova(pd, m + delta, length, iova, access);
  say("dmabuf fd %d off %llu len %zu iova 0x%llx -> %s rkey 0x%x", fd, (unsigned long long)offset,
      length, (unsigned long long)iova, mr ? "ok" : strerror(errno), mr ? mr->rkey : 0);
  return mr;
}

#undef ibv_reg_mr /* verbs.h maps it onto inline code; the library's symbol is this */
EXPORT struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access) {
  static struct ibv_mr *(*real)(struct ibv_pd *, void *, size_t, int);
  if (real == NULL)
    real = (struct ibv_mr * (*)(struct ibv_pd *, void *, size_t, int)) dlsym(RTLD_NEXT, "ibv_reg_mr");
  if (peermem_refuses(addr))
    return NULL;
  return real(pd, addr, length, access);
}

EXPORT struct ibv_mr *ibv_reg_mr_iova2(struct ibv_pd *pd, void *addr, size_t length,
                                       uint64_t iova, unsigned int access) {
  static struct ibv_mr *(*real)(struct ibv_pd *, void *, size_t, uint64_t, unsigned int);
  if (real == NULL)
    real = (struct ibv_mr * (*)(struct ibv_pd *, void *, size_t, uint64_t, unsigned int))
        dlsym(RTLD_NEXT, "ibv_reg_mr_iova2");
  if (peermem_refuses(addr))
    return NULL;
  return real(pd, addr, length, iova, access);
}
