/*
 * GPU suite: the dma-buf export rules of GPUDirect RDMA against the real
 * CUDA driver (docs/gpu.md, "GPUDirect tiers").  No RDMA device is needed:
 * it checks the memory layer's half (sx__mem_dmabuf_export), which the RDMA
 * transport hands to ibv_reg_dmabuf_mr.  For three kinds of memory:
 *
 *   cuMemAlloc         a region 4 KiB + 512 bytes into an allocation;
 *   VMM                cuMemCreate + cuMemMap, one range inside a chunk;
 *   expandable chunks  three physical chunks mapped back to back into one
 *                      reserved range, as PyTorch's expandable segments do,
 *                      and a region spanning all three;
 *
 * the export must round the region's own range to pages, give the region's
 * offset in the fd, hand out a dma-buf fd, and set SYNC_MEMOPS on cuMemAlloc
 * memory (the driver refuses it on VMM memory: the export goes on).  The range
 * that spans VMM chunks is what exporting the allocation's range (as
 * cuMemGetAddressRange names it) gets wrong; what the driver says to the
 * region's own range is printed either way.
 *
 * On the host-memory stand-in it skips, saying why: its export is a memfd,
 * and the rules it enforces are ours, not the driver's.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu_fixture.h"
#include "internal.h"
#include "mem/mem_int.h"

static int on_stand_in(void) {
  int n = 0;
  (void)sx__mem_cuda_devices(&n); /* loads the driver, or its stand-in */
  const char *lib = getenv("SX_CUDA_LIBRARY");
  void *h = lib != NULL ? dlopen(lib, RTLD_NOW | RTLD_NOLOAD) : NULL;
  return h != NULL && dlsym(h, "fake_cuda_is_device") != NULL;
}

#define SKIP_ON_STAND_IN()                                                                    \
  do {                                                                                        \
    if (on_stand_in()) {                                                                      \
      print_message("SKIP: the host-memory stand-in driver has no dma-buf export; this "    \
                    "checks the real driver's rules (make test-gpu on a GPU)\n");             \
      skip();                                                                                 \
    }                                                                                         \
  } while (0)

/* What the fd is, as the kernel names it ("anon_inode:dmabuf" or
 * "/dmabuf:"). */
static void fd_kind(int fd, char *buf, size_t size) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
  ssize_t n = readlink(path, buf, size - 1);
  buf[n > 0 ? n : 0] = '\0';
}

static unsigned sync_memops(const void *p) {
  CUresult (*get)(void *, CUpointer_attribute, CUdeviceptr) = NULL;
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (h != NULL)
    *(void **)&get = dlsym(h, "cuPointerGetAttribute");
  unsigned v = 0;
  if (get == NULL || get(&v, CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, (CUdeviceptr)(uintptr_t)p) !=
                         CUDA_SUCCESS)
    return 0;
  return v;
}

/* Export [p, p+len) and check what came back. */
/* must: the export has to succeed; legacy: cuMemAlloc memory, which has
 * to come back with SYNC_MEMOPS set (the driver refuses the attribute on
 * VMM memory, and the export goes on without it). */
static int export_check(const char *what, const void *p, uint64_t len, int must, int legacy) {
  int fd = -1;
  uint64_t off = 0;
  long ps = sysconf(_SC_PAGESIZE);
  int rc = sx__mem_dmabuf_export(p, len, 0, &fd, &off);
  if (rc != 0) {
    print_message("%s: %llu bytes at %p: export refused: %s\n", what,
                  (unsigned long long)len, p, sx_errmsg());
    if (must)
      fail_msg("%s: the region's own range must export", what);
    return rc;
  }
  char kind[128];
  fd_kind(fd, kind, sizeof(kind));
  print_message("%s: %llu bytes at %p: fd %d (%s), offset %llu, SYNC_MEMOPS %u\n", what,
                (unsigned long long)len, p, fd, kind, (unsigned long long)off, sync_memops(p));
  assert_int_equal(off, (uintptr_t)p % (uint64_t)ps);
  assert_non_null(strstr(kind, "dmabuf"));
  if (legacy)
    assert_int_equal(sync_memops(p), 1);
  close(fd);
  return 0;
}

static void test_gpu_dmabuf_supported_is_reported(void **state) {
  (void)state;
  SKIP_ON_STAND_IN();
  int ok = sx__mem_dmabuf_supported(0);
  print_message("cuda:0 dma-buf: %s%s\n", ok ? "supported" : "not supported: ",
                ok ? "" : sx_errmsg());
  if (!ok)
    skip();
}

static void test_gpu_dmabuf_cumemalloc_region_at_an_offset(void **state) {
  (void)state;
  SKIP_ON_STAND_IN();
  if (!sx__mem_dmabuf_supported(0))
    skip();
  void *m = NULL;
  sxt_ok(sx__mem_alloc(0, 8u << 20, &m));
  export_check("cuMemAlloc, region 4 KiB + 512 in", (uint8_t *)m + 4096 + 512, 3u << 20, 1, 1);
  export_check("cuMemAlloc, whole allocation", m, 8u << 20, 1, 1);
  sx__mem_free(m);
}

typedef struct vmm {
  CUresult (*Granularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
  CUresult (*Reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*Create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                     unsigned long long);
  CUresult (*Map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*SetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
  CUresult (*Unmap)(CUdeviceptr, size_t);
  CUresult (*Release)(CUmemGenericAllocationHandle);
  CUresult (*Free)(CUdeviceptr, size_t);
} vmm;

static void vmm_syms(vmm *v) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  assert_non_null(h);
  *(void **)&v->Granularity = dlsym(h, "cuMemGetAllocationGranularity");
  *(void **)&v->Reserve = dlsym(h, "cuMemAddressReserve");
  *(void **)&v->Create = dlsym(h, "cuMemCreate");
  *(void **)&v->Map = dlsym(h, "cuMemMap");
  *(void **)&v->SetAccess = dlsym(h, "cuMemSetAccess");
  *(void **)&v->Unmap = dlsym(h, "cuMemUnmap");
  *(void **)&v->Release = dlsym(h, "cuMemRelease");
  *(void **)&v->Free = dlsym(h, "cuMemAddressFree");
  assert_true(v->Granularity && v->Reserve && v->Create && v->Map && v->SetAccess &&
              v->Unmap && v->Release && v->Free);
}

/* n chunks of the granularity, mapped back to back.  The driver may want
 * gpuDirectRDMACapable on the physical chunks, which PyTorch does not set:
 * both are tried, and only the capable one must export. */
static void vmm_case(int n, int rdma_capable) {
  vmm v;
  vmm_syms(&v);
  void *warm = NULL; /* the primary context current on this thread */
  sxt_ok(sx__mem_alloc(0, 4096, &warm));
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.allocFlags.gpuDirectRDMACapable = (unsigned char)rdma_capable;
  size_t g = 0;
  assert_int_equal(v.Granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), CUDA_SUCCESS);
  CUdeviceptr base = 0;
  assert_int_equal(v.Reserve(&base, g * (size_t)n, 0, 0, 0), CUDA_SUCCESS);
  CUmemGenericAllocationHandle hs[8];
  CUmemAccessDesc acc = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  for (int i = 0; i < n; i++) {
    assert_int_equal(v.Create(&hs[i], g, &prop, 0), CUDA_SUCCESS);
    assert_int_equal(v.Map(base + (size_t)i * g, g, 0, hs[i], 0), CUDA_SUCCESS);
  }
  assert_int_equal(v.SetAccess(base, g * (size_t)n, &acc, 1), CUDA_SUCCESS);
  char what[160];
  snprintf(what, sizeof(what), "VMM (%s), %d chunk%s of %zu, range inside chunk 0",
           rdma_capable ? "gpuDirectRDMACapable" : "as PyTorch allocates", n, n > 1 ? "s" : "",
           g);
  export_check(what, (void *)(uintptr_t)(base + 4096 + 512), g / 2, rdma_capable, 0);
  if (n > 1) {
    snprintf(what, sizeof(what), "VMM (%s), region spanning %d chunks",
             rdma_capable ? "gpuDirectRDMACapable" : "as PyTorch allocates", n);
    export_check(what, (void *)(uintptr_t)(base + 4096 + 512), g * (size_t)n - 8192, 0, 0);
  }
  assert_int_equal(v.Unmap(base, g * (size_t)n), CUDA_SUCCESS);
  for (int i = 0; i < n; i++)
    v.Release(hs[i]);
  v.Free(base, g * (size_t)n);
  sx__mem_free(warm);
}

static void test_gpu_dmabuf_vmm_one_chunk(void **state) {
  (void)state;
  SKIP_ON_STAND_IN();
  if (!sx__mem_dmabuf_supported(0))
    skip();
  vmm_case(1, 1);
}

/* PyTorch's expandable segments: chunks mapped back to back into one
 * reserved range, a region spanning them. */
static void test_gpu_dmabuf_expandable_chunks(void **state) {
  (void)state;
  SKIP_ON_STAND_IN();
  if (!sx__mem_dmabuf_supported(0))
    skip();
  vmm_case(3, 1);
  vmm_case(3, 0);
}

/* On the stand-in only: a driver that refuses SYNC_MEMOPS as unsupported
 * (what the H100 says for VMM memory) still exports; any other refusal of
 * the attribute stops the export. */
static void test_gpu_dmabuf_sync_memops_refusals(void **state) {
  (void)state;
  if (!on_stand_in())
    skip();
  void *m = NULL;
  int fd = -1;
  uint64_t off = 0;
  sxt_ok(sx__mem_alloc(0, 1u << 20, &m));
  setenv("FAKE_CUDA_SYNC_MEMOPS", "unsupported", 1);
  int rc = sx__mem_dmabuf_export((uint8_t *)m + 512, 4096, 0, &fd, &off);
  if (rc != 0)
    fail_msg("export with SYNC_MEMOPS unsupported: %s", sx_errmsg());
  assert_true(fd >= 0);
  assert_int_equal(off, 512);
  close(fd);
  fd = -1;
  setenv("FAKE_CUDA_SYNC_MEMOPS", "fail", 1);
  assert_int_not_equal(sx__mem_dmabuf_export((uint8_t *)m + 512, 4096, 0, &fd, &off), 0);
  assert_int_equal(fd, -1);
  unsetenv("FAKE_CUDA_SYNC_MEMOPS");
  sx__mem_free(m);
}

/* The GPU's PCI address, as the RDMA transport's NIC choice reads it
 * (agent/mem/pci.c, from the driver's PCI attributes): on a real driver
 * each device's address must name a device in /sys/bus/pci/devices with a
 * numa_node file, which is where rdma_nic.c looks; on the stand-in it is
 * the address FAKE_CUDA_PCI gives, or its default 0000:(0x10 (d+1)):00.0. */
static void test_gpu_pci_address_in_sysfs(void **state) {
  (void)state;
  int n = 0, real = !on_stand_in();
  sxt_ok(sx__mem_cuda_devices(&n));
  setenv("FAKE_CUDA_PCI", "0000:3b:00.0", 1);
  for (int d = 0; d < n; d++) {
    char addr[32], want[32], path[96];
    sxt_ok(sx__mem_pci_address(d, addr, sizeof(addr)));
    print_message("cuda:%d is at PCI %s\n", d, addr);
    if (!real) {
      snprintf(want, sizeof(want), "0000:%02x:00.0", d == 0 ? 0x3b : 0x10 * (d + 1));
      assert_string_equal(addr, want);
      continue;
    }
    if (access("/sys/bus/pci/devices", F_OK) != 0) {
      print_message("no /sys/bus/pci/devices here: the address is not checked against it\n");
      continue;
    }
    snprintf(path, sizeof(path), "/sys/bus/pci/devices/%s/numa_node", addr);
    if (access(path, R_OK) != 0)
      fail_msg("cuda:%d: the driver says PCI %s, but %s is not there", d, addr, path);
  }
  unsetenv("FAKE_CUDA_PCI");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gpu_dmabuf_supported_is_reported),
      cmocka_unit_test(test_gpu_dmabuf_cumemalloc_region_at_an_offset),
      cmocka_unit_test(test_gpu_dmabuf_vmm_one_chunk),
      cmocka_unit_test(test_gpu_dmabuf_expandable_chunks),
      cmocka_unit_test(test_gpu_dmabuf_sync_memops_refusals),
      cmocka_unit_test(test_gpu_pci_address_in_sysfs),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
