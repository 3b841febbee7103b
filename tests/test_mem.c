/*
 * The memory layer without a GPU: locations, pointer checks against a fake
 * CUDA driver table (device memory inside and across allocations, on
 * another device, managed, host), a host without a driver, and CUDA
 * region registration through a real agent on the mem:// store.
 */
#include <dlfcn.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "fake_drv.h"
#include "internal.h"
#include "mem/mem.h"
#include "mem/mem_int.h"

static void test_mem_location_parse(void **state) {
  (void)state;
  sx__mem_info m;
  sxt_ok(sx__mem_parse_location("cpu", &m));
  assert_int_equal(m.kind, SX__MEM_HOST);
  assert_int_equal(m.device, -1);
  sxt_ok(sx__mem_parse_location(NULL, &m));
  assert_int_equal(m.kind, SX__MEM_HOST);
  sxt_ok(sx__mem_parse_location("cuda:0", &m));
  assert_int_equal(m.kind, SX__MEM_CUDA);
  assert_int_equal(m.device, 0);
  sxt_ok(sx__mem_parse_location("cuda:1023", &m));
  assert_int_equal(m.device, 1023);
  const char *bad[] = {"", "gpu", "cuda", "cuda:", "cuda:01", "cuda:x", "cuda:1x",
                       "cuda:-1", "cuda:1024", "cuda:99999", "CPU", "cuda:0 "};
  for (size_t i = 0; i < SX__ARRAY_SIZE(bad); i++) {
    sx__mem_info keep = {.kind = 7};
    sxt_rc(sx__mem_parse_location(bad[i], &keep), SX_EINVAL);
    assert_int_equal(keep.kind, 7); /* untouched on failure */
    assert_non_null(strstr(sx_errmsg(), "cuda:N"));
  }
}

/* sx_mem_location on host memory: in every build, with or without a driver. */
static void test_mem_location_of_host_memory(void **state) {
  (void)state;
  char heap_loc[16], out[16] = "untouched";
  char *heap = malloc(4096);
  assert_non_null(heap);
  sxt_ok(sx_mem_location(heap, 4096, heap_loc, sizeof(heap_loc)));
  assert_string_equal(heap_loc, "cpu");
  sxt_ok(sx_mem_location(heap, 0, out, 4)); /* "cpu" and its NUL fit in 4 */
  assert_string_equal(out, "cpu");
  /* Refused, out untouched. */
  strcpy(out, "untouched");
  sxt_rc(sx_mem_location(heap, 4096, out, 3), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "needs 4 bytes"));
  sxt_rc(sx_mem_location(NULL, 4096, out, sizeof(out)), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "NULL addr"));
  sxt_rc(sx_mem_location(heap, 4096, NULL, 16), SX_EINVAL);
  assert_string_equal(out, "untouched");
  free(heap);
}

#ifdef SX_HAVE_CUDA
/* ------------------------------------------------------------ fake driver */

/* Two devices; allocations at made-up addresses the test never touches. */
typedef struct fake_alloc {
  uint64_t base, size;
  int device;
  int managed;
} fake_alloc;

static const fake_alloc allocs[] = {
    {0x7f0000000000ull, 1u << 20, 0, 0},
    {0x7f0000200000ull, 1u << 20, 1, 0},
    {0x7f0000400000ull, 1u << 20, 0, 1},
};

static CUresult f_attrs(unsigned n, CUpointer_attribute *at, void **data, CUdeviceptr p) {
  const fake_alloc *a = NULL;
  for (size_t i = 0; i < SX__ARRAY_SIZE(allocs); i++)
    if (p >= allocs[i].base && p < allocs[i].base + allocs[i].size)
      a = &allocs[i];
  for (unsigned i = 0; i < n; i++) {
    switch (at[i]) {
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
      *(unsigned *)data[i] = a ? CU_MEMORYTYPE_DEVICE : 0;
      break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
      *(int *)data[i] = a ? a->device : -2;
      break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
      *(CUdeviceptr *)data[i] = a ? a->base : 0;
      break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
      *(size_t *)data[i] = a ? a->size : 0;
      break;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
      *(unsigned char *)data[i] = a ? (unsigned char)a->managed : 0; /* a C bool */
      break;
    default:
      return CUDA_ERROR_INVALID_VALUE;
    }
  }
  return CUDA_SUCCESS;
}

static sx__cuda_drv fake;

static int use_fake(void **state) {
  (void)state;
  sxt_fake_drv_base(&fake, 2);
  fake.PointerGetAttributes = f_attrs;
  sx__mem_cuda_use(&fake);
  return 0;
}

static int use_real(void **state) {
  (void)state;
  sx__mem_cuda_use(NULL);
  sx__mem_cuda_library("libcuda.so.1");
  return 0;
}

static void *at(uint64_t a) { return (void *)(uintptr_t)a; }

static void test_mem_check_device_pointer(void **state) {
  (void)state;
  sx__mem_info m;
  sxt_ok(sx__mem_check(at(allocs[0].base + 4096), 65536, "cuda:0", &m));
  assert_int_equal(m.kind, SX__MEM_CUDA);
  assert_int_equal(m.device, 0);
  assert_true(m.base == allocs[0].base);
  assert_true(m.size == allocs[0].size);
  /* The whole allocation, to its last byte. */
  sxt_ok(sx__mem_check(at(allocs[1].base), allocs[1].size, "cuda:1", &m));
  assert_int_equal(m.device, 1);
  /* What the driver knows is reported for any pointer. */
  sx__mem_query(at(allocs[1].base + 7), &m);
  assert_int_equal(m.kind, SX__MEM_CUDA);
  assert_int_equal(m.device, 1);
  int stack;
  sx__mem_query(&stack, &m);
  assert_int_equal(m.kind, SX__MEM_HOST);
  int n;
  sxt_ok(sx__mem_cuda_devices(&n));
  assert_int_equal(n, 2);
}

static void test_mem_check_refuses_with_reason(void **state) {
  (void)state;
  sx__mem_info m = {.kind = 9};
  /* Another device than named. */
  sxt_rc(sx__mem_check(at(allocs[1].base), 4096, "cuda:0", &m), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "memory of cuda:1"));
  /* Past the allocation's end. */
  sxt_rc(sx__mem_check(at(allocs[0].base + allocs[0].size - 4096), 8192, "cuda:0", &m),
         SX_EBOUNDS);
  assert_non_null(strstr(sx_errmsg(), "not inside one allocation"));
  /* A length that wraps the address space. */
  sxt_rc(sx__mem_check(at(allocs[0].base), UINT64_MAX, "cuda:0", &m), SX_EBOUNDS);
  /* Host memory named as a GPU's. */
  char buf[64];
  sxt_rc(sx__mem_check(buf, sizeof(buf), "cuda:0", &m), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "not device memory"));
  /* Managed memory. */
  sxt_rc(sx__mem_check(at(allocs[2].base), 4096, "cuda:0", &m), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "managed"));
  /* Device memory named "cpu". */
  sxt_rc(sx__mem_check(at(allocs[0].base), 4096, "cpu", &m), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "device memory of cuda:0"));
  /* A device this host does not have. */
  sxt_rc(sx__mem_check(at(allocs[0].base), 4096, "cuda:5", &m), SX_ENODEV);
  assert_non_null(strstr(sx_errmsg(), "no CUDA device 5"));
  assert_int_equal(m.kind, 9); /* never written on failure */
}

static void test_mem_location_of_device_pointer(void **state) {
  (void)state;
  char out[16];
  sxt_ok(sx_mem_location(at(allocs[0].base + 4096), 65536, out, sizeof(out)));
  assert_string_equal(out, "cuda:0");
  sxt_ok(sx_mem_location(at(allocs[1].base), allocs[1].size, out, sizeof(out)));
  assert_string_equal(out, "cuda:1");
  int stack;
  sxt_ok(sx_mem_location(&stack, sizeof(stack), out, sizeof(out)));
  assert_string_equal(out, "cpu");
  /* "cuda:1" needs 7 bytes. */
  strcpy(out, "untouched");
  sxt_rc(sx_mem_location(at(allocs[1].base), 4096, out, 6), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "cuda:1, which needs 7 bytes"));
  /* What register would refuse is refused here, with register's reason. */
  sxt_rc(sx_mem_location(at(allocs[0].base + allocs[0].size - 4096), 8192, out,
                         sizeof(out)), SX_EBOUNDS);
  assert_non_null(strstr(sx_errmsg(), "not inside one allocation"));
  sxt_rc(sx_mem_location(at(allocs[2].base), 4096, out, sizeof(out)), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "managed"));
  assert_string_equal(out, "untouched");
}

/* ------------------------------------------------------------ no driver */

static int no_driver(void **state) {
  (void)state;
  sx__mem_cuda_use(NULL);
  sx__mem_cuda_library("libcuda-segxfer-test-absent.so.1");
  return 0;
}

static void test_mem_without_driver(void **state) {
  (void)state;
  sx__mem_info m;
  char buf[64];
  sxt_rc(sx__mem_check(at(allocs[0].base), 4096, "cuda:0", &m), SX_ENODEV);
  assert_non_null(strstr(sx_errmsg(), "no CUDA driver on this host"));
  assert_non_null(strstr(sx_errmsg(), "cuda:0"));
  int n;
  sxt_rc(sx__mem_cuda_devices(&n), SX_ENODEV);
  void *p;
  sxt_rc(sx__mem_alloc(0, 4096, &p), SX_ENODEV);
  sxt_rc(sx__mem_host_alloc(4096, &p), SX_ENODEV);
  /* Host memory is unaffected. */
  sxt_ok(sx__mem_check(buf, sizeof(buf), "cpu", &m));
  assert_int_equal(m.kind, SX__MEM_HOST);
  sx__mem_query(buf, &m);
  assert_int_equal(m.kind, SX__MEM_HOST);
  /* Without a driver nothing is device memory, whatever the address. */
  char out[16];
  sxt_ok(sx_mem_location(at(allocs[0].base), 4096, out, sizeof(out)));
  assert_string_equal(out, "cpu");
}

/* The CUDA stand-in (tests/gpu/fake_cuda.c) beside this binary, which make
 * test builds first; empty when it is not there. */
static char fake_lib[PATH_MAX];

/* Without a driver in the process, "host memory" is the answer, and it is
 * kept rather than asking the dynamic loader on every query: but only until
 * the process loads another object.  A driver an engine loads later (here:
 * the stand-in, loaded behind the memory layer's back) is seen at once. */
static void test_mem_query_sees_a_driver_loaded_later(void **state) {
  (void)state;
  if (fake_lib[0] == '\0' || access(fake_lib, R_OK) != 0) {
    print_message("no CUDA stand-in beside this binary (make test builds it): skipped\n");
    skip();
  }
  sx__mem_cuda_use(NULL);
  sx__mem_cuda_library(fake_lib);
  char buf[64];
  sx__mem_info m;
  sx__mem_query(buf, &m);
  assert_int_equal(m.kind, SX__MEM_HOST);
  sx__mem_query(buf, &m); /* the kept answer */
  assert_int_equal(m.kind, SX__MEM_HOST);
  void *h = dlopen(fake_lib, RTLD_NOW | RTLD_LOCAL);
  assert_non_null(h);
  CUresult (*alloc)(CUdeviceptr *, size_t) =
      (CUresult(*)(CUdeviceptr *, size_t))dlsym(h, "cuMemAlloc_v2");
  CUresult (*release)(CUdeviceptr) = (CUresult(*)(CUdeviceptr))dlsym(h, "cuMemFree_v2");
  assert_non_null(alloc);
  assert_non_null(release);
  CUdeviceptr p;
  assert_int_equal(alloc(&p, 8192), CUDA_SUCCESS);
  sx__mem_query((void *)(uintptr_t)(p + 100), &m);
  assert_int_equal(m.kind, SX__MEM_CUDA);
  assert_int_equal(m.device, 0);
  assert_true(m.base == (uint64_t)p && m.size == 8192);
  sx__mem_query(buf, &m);
  assert_int_equal(m.kind, SX__MEM_HOST);
  assert_int_equal(release(p), CUDA_SUCCESS);
  /* The stand-in stays loaded: the memory layer holds it now. */
}

/* ------------------------------------------------------------ agents */

static sx_agent *new_agent(char *url, size_t size) {
  static int seq;
  snprintf(url, size, "mem://mem-%d-%d", (int)getpid(), seq++);
  sx_agent_params p;
  sxt_params(&p, url, "gpu-0");
  p.listen = "127.0.0.1:0";
  sx_agent *a;
  sxt_ok(sx_agent_create(&p, &a));
  return a;
}

static sx_region_params gpu_region(uint64_t addr, uint64_t len, const char *loc,
                                   uint32_t slot) {
  return (sx_region_params){.addr = at(addr), .length = len, .slot = slot,
                            .block_bytes = 4096, .num_blocks = len / 4096,
                            .location = loc, .access = SX_ACCESS_REMOTE_READ};
}

static void test_mem_agent_registers_cuda_region(void **state) {
  (void)state;
  char url[64];
  sx_agent *a = new_agent(url, sizeof(url));
  uint32_t id, bad = 77;
  sx_region_params rp = gpu_region(allocs[0].base, 65536, "cuda:0", SX_SLOT_K);
  sxt_ok(sx_agent_register(a, &rp, &id));
  /* Refused, and the message says which rule: id untouched. */
  rp = gpu_region(allocs[1].base, 65536, "cuda:0", SX_SLOT_V);
  sxt_rc(sx_agent_register(a, &rp, &bad), SX_EINVAL);
  assert_non_null(strstr(sx_errmsg(), "memory of cuda:1"));
  rp = gpu_region(allocs[0].base + allocs[0].size - 4096, 8192, "cuda:0", SX_SLOT_V);
  sxt_rc(sx_agent_register(a, &rp, &bad), SX_EBOUNDS);
  rp = gpu_region(allocs[0].base, 4096, "npu:0", SX_SLOT_V);
  sxt_rc(sx_agent_register(a, &rp, &bad), SX_EINVAL);
  assert_int_equal(bad, 77);
  /* The right one works on the other device, and host memory still does. */
  rp = gpu_region(allocs[1].base, 65536, "cuda:1", SX_SLOT_V);
  sxt_ok(sx_agent_register(a, &rp, &id));
  uint8_t *host = calloc(1, 65536);
  rp = gpu_region((uint64_t)(uintptr_t)host, 65536, "cpu", SX_SLOT_INDEX);
  sxt_ok(sx_agent_register(a, &rp, &id));
  sxt_ok(sx_agent_publish(a, 0));
  sx_desc d;
  sxt_ok(sx_agent_descriptor(a, &d));
  assert_int_equal(d.n_regions, 3);
  assert_string_equal(d.regions[0].location, "cuda:0");
  assert_string_equal(d.regions[1].location, "cuda:1");
  assert_string_equal(d.regions[2].location, "cpu");
  /* The host identity goes with it. */
  char boot[64] = "";
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  assert_non_null(f);
  assert_non_null(fgets(boot, sizeof(boot), f));
  fclose(f);
  boot[strcspn(boot, "\n")] = '\0';
  assert_string_equal(d.host_id, boot);
  assert_true(d.hostname[0] != '\0');
  assert_true(d.process != 0);
  sx_desc_free(&d);
  sx_agent_destroy(a);
  free(host);
}

static void test_mem_agent_without_driver_refuses_cuda(void **state) {
  (void)state;
  char url[64];
  sx_agent *a = new_agent(url, sizeof(url));
  uint32_t id;
  sx_region_params rp = gpu_region(allocs[0].base, 65536, "cuda:0", SX_SLOT_K);
  sxt_rc(sx_agent_register(a, &rp, &id), SX_ENODEV);
  assert_non_null(strstr(sx_errmsg(), "no CUDA driver on this host"));
  /* Everything else works: host memory registers, publishes and is read. */
  uint8_t *host = calloc(1, 65536);
  rp = gpu_region((uint64_t)(uintptr_t)host, 65536, "cpu", SX_SLOT_K);
  sxt_ok(sx_agent_register(a, &rp, &id));
  sxt_ok(sx_agent_publish(a, 0));
  sx_segment *s;
  sxt_ok(sx_segment_open(a, "gpu-0", 1000, &s));
  assert_int_equal(sx_segment_transport(s), SX_TRANSPORT_TCP);
  uint64_t rtt;
  sxt_ok(sx_segment_ping(s, 2000, &rtt, NULL));
  sx_segment_close(s);
  sx_agent_destroy(a);
  free(host);
}
#endif

int main(int argc, char **argv) {
  (void)argc;
#ifdef SX_HAVE_CUDA
  /* argv[0], not /proc/self/exe: under valgrind that is valgrind. */
  char self[PATH_MAX];
  if (realpath(argv[0], self) != NULL)
    snprintf(fake_lib, sizeof(fake_lib), "%s/gpu/libfakecuda.so", dirname(self));
#else
  (void)argv;
#endif
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_mem_location_parse),
      cmocka_unit_test(test_mem_location_of_host_memory),
#ifdef SX_HAVE_CUDA
      cmocka_unit_test_setup_teardown(test_mem_check_device_pointer, use_fake, use_real),
      cmocka_unit_test_setup_teardown(test_mem_check_refuses_with_reason, use_fake,
                                      use_real),
      cmocka_unit_test_setup_teardown(test_mem_location_of_device_pointer, use_fake,
                                      use_real),
      cmocka_unit_test_setup_teardown(test_mem_without_driver, no_driver, use_real),
      cmocka_unit_test_setup_teardown(test_mem_agent_registers_cuda_region, use_fake,
                                      use_real),
      cmocka_unit_test_setup_teardown(test_mem_agent_without_driver_refuses_cuda,
                                      no_driver, use_real),
      /* Last: the stand-in it loads stays the memory layer's driver. */
      cmocka_unit_test_setup_teardown(test_mem_query_sees_a_driver_loaded_later, no_driver,
                                      use_real),
#endif
  };
#ifndef SX_HAVE_CUDA
  printf("test_mem: built without cuda.h: only the location rules run\n");
#endif
  return cmocka_run_group_tests(tests, NULL, NULL);
}
