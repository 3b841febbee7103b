/* NIC choice (agent/transport/rdma/rdma_nic.c) against a fake sysfs tree
 * the test builds (SX_SYSFS_ROOT): same NUMA node first, then PCI distance,
 * then load; unknown NUMA nodes; hostile and missing entries; a GPU's PCI
 * address from a fake driver table; the reader's endpoint pick following
 * the published choice; each range's NIC pair (rdma_route.c); staging
 * rings asking for their NIC's node.
 *
 * The tree (numa_node in brackets):
 *   devices/pci0000:00/0000:00:01.0/0000:17:00.0   GPU 0 [0]
 *   devices/pci0000:00/0000:00:01.0/0000:18:00.0   mlx5_0 [0]  (same switch as GPU 0)
 *   devices/pci0000:00/0000:00:02.0/0000:19:00.0   mlx5_1 [0]
 *   devices/pci0000:80/0000:80:01.0/0000:81:00.0   mlx5_2 [1]
 *   devices/pci0000:80/0000:80:01.0/0000:82:00.0   GPU 1 [1]
 *   devices/pci0000:00/0000:00:01.0/0000:1a:00.0   GPU 2 [1]  (near mlx5_0, but says node 1)
 */
#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <linux/mempolicy.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "fake_drv.h"
#include "fake_sysfs.h"
#include "mem/mem_int.h"
#include "transport/rdma/rdma_int.h"
#include "sxtest.h"

static char root[256];

static int tree_up(void **state) {
  (void)state;
  sxt_sysfs_make(root, sizeof(root));
  sxt_sysfs_pci(root, "pci0000:00/0000:00:01.0/0000:17:00.0", "0\n");
  sxt_sysfs_pci(root, "pci0000:00/0000:00:01.0/0000:18:00.0", "0\n");
  sxt_sysfs_pci(root, "pci0000:00/0000:00:02.0/0000:19:00.0", "0\n");
  sxt_sysfs_pci(root, "pci0000:80/0000:80:01.0/0000:81:00.0", "1\n");
  sxt_sysfs_pci(root, "pci0000:80/0000:80:01.0/0000:82:00.0", "1\n");
  sxt_sysfs_pci(root, "pci0000:00/0000:00:01.0/0000:1a:00.0", "1\n");
  sxt_sysfs_ib(root, "mlx5_0", "pci0000:00/0000:00:01.0/0000:18:00.0");
  sxt_sysfs_ib(root, "mlx5_1", "pci0000:00/0000:00:02.0/0000:19:00.0");
  sxt_sysfs_ib(root, "mlx5_2", "pci0000:80/0000:80:01.0/0000:81:00.0");
  setenv("SX_SYSFS_ROOT", root, 1);
  return 0;
}

static int tree_down(void **state) {
  (void)state;
  sxt_sysfs_remove(root);
  unsetenv("SX_SYSFS_ROOT");
  return 0;
}

static void topo_rdma(const char *dev, sx__nic_topo *t) {
  char why[400];
  if (sx__nic_topo_rdma(root, dev, t, why, sizeof(why)) != 0)
    fail_msg("%s: %s", dev, why);
}

static void topo_pci(const char *addr, sx__nic_topo *t) {
  char why[400];
  if (sx__nic_topo_pci(root, addr, t, why, sizeof(why)) != 0)
    fail_msg("%s: %s", addr, why);
}

static sx__nic_topo nics[3];

static void read_nics(void) {
  topo_rdma("mlx5_0", &nics[0]);
  topo_rdma("mlx5_1", &nics[1]);
  topo_rdma("mlx5_2", &nics[2]);
}

static void test_nic_topology_from_sysfs(void **state) {
  (void)state;
  sx__nic_topo g;
  read_nics();
  assert_int_equal(nics[0].numa, 0);
  assert_int_equal(nics[2].numa, 1);
  assert_true(nics[0].known);
  size_t n = strlen(nics[0].path);
  assert_string_equal(nics[0].path + n - strlen("/0000:00:01.0/0000:18:00.0"),
                      "/0000:00:01.0/0000:18:00.0");
  topo_pci("0000:17:00.0", &g);
  /* GPU 0 -> switch 0000:00:01.0 -> mlx5_0: one hop up, one down. */
  assert_int_equal(sx__nic_pci_distance(&g, &nics[0]), 2);
  assert_int_equal(sx__nic_pci_distance(&g, &nics[1]), 4);
  assert_int_equal(sx__nic_pci_distance(&g, &nics[2]), 6);
  assert_int_equal(sx__nic_pci_distance(&g, &g), 0);
  /* A component that only begins alike is not shared
   * (0000:00:01.0 and 0000:00:01.00 are two switches). */
  sx__nic_topo a = {.numa = -1, .known = 1}, b = {.numa = -1, .known = 1};
  snprintf(a.path, sizeof(a.path), "/s/devices/pci0000:00/0000:00:01.0/x");
  snprintf(b.path, sizeof(b.path), "/s/devices/pci0000:00/0000:00:01.00/x");
  assert_int_equal(sx__nic_pci_distance(&a, &b), 4);
  b.known = 0;
  assert_int_equal(sx__nic_pci_distance(&a, &b), -1);
}

static void test_nic_same_numa_wins(void **state) {
  (void)state;
  sx__nic_topo g;
  uint64_t load[3] = {0, 0, 1ull << 40}; /* mlx5_2 is loaded heavily */
  read_nics();
  topo_pci("0000:82:00.0", &g);
  assert_int_equal(sx__nic_choose(&g, nics, load, 3), 2);
  /* GPU 2 sits next to mlx5_0 on the bus, but on node 1: the node wins. */
  topo_pci("0000:1a:00.0", &g);
  assert_int_equal(g.numa, 1);
  assert_int_equal(sx__nic_pci_distance(&g, &nics[0]), 2);
  assert_int_equal(sx__nic_choose(&g, nics, load, 3), 2);
}

static void test_nic_pci_distance_breaks_ties(void **state) {
  (void)state;
  sx__nic_topo g;
  uint64_t load[3] = {1ull << 40, 0, 0}; /* the nearer one is loaded: still chosen */
  read_nics();
  topo_pci("0000:17:00.0", &g);
  assert_int_equal(sx__nic_choose(&g, nics, load, 3), 0);
  /* Listed the other way round, the same device wins. */
  sx__nic_topo rev[3] = {nics[2], nics[1], nics[0]};
  uint64_t rload[3] = {0, 0, 1ull << 40};
  assert_int_equal(sx__nic_choose(&g, rev, rload, 3), 2);
}

/* numa_node -1 (a machine without NUMA, or firmware that does not say):
 * the PCI distance decides, and a missing or garbled file counts as -1. */
static void test_nic_unknown_numa(void **state) {
  (void)state;
  sx__nic_topo g;
  uint64_t load[3] = {0, 0, 0};
  sxt_sysfs_put(root, "devices/pci0000:00/0000:00:01.0/0000:18:00.0/numa_node", "-1\n");
  sxt_sysfs_put(root, "devices/pci0000:00/0000:00:02.0/0000:19:00.0/numa_node", "-1\n");
  sxt_sysfs_put(root, "devices/pci0000:80/0000:80:01.0/0000:81:00.0/numa_node", "-1\n");
  sxt_sysfs_put(root, "devices/pci0000:00/0000:00:01.0/0000:17:00.0/numa_node", "-1\n");
  read_nics();
  topo_pci("0000:17:00.0", &g);
  assert_int_equal(g.numa, -1);
  assert_int_equal(nics[0].numa, -1);
  assert_int_equal(sx__nic_choose(&g, nics, load, 3), 0);
  /* The GPU's node known, no NIC's: still the nearest. */
  sxt_sysfs_put(root, "devices/pci0000:00/0000:00:01.0/0000:17:00.0/numa_node", "0\n");
  topo_pci("0000:17:00.0", &g);
  assert_int_equal(sx__nic_choose(&g, nics, load, 3), 0);
  /* Garbage in numa_node is no node (and no crash). */
  const char *bad[] = {"abc\n", "99999\n", "1 2\n", "", "-2\n", "0x1\n",
                       "00000000000000000000000000000000000000000000000001\n"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    sxt_sysfs_put(root, "devices/pci0000:00/0000:00:01.0/0000:18:00.0/numa_node", bad[i]);
    topo_rdma("mlx5_0", &nics[0]);
    assert_int_equal(nics[0].numa, -1);
  }
  /* A file missing on the device itself: its parent's node is used. */
  char p[PATH_MAX + 64];
  snprintf(p, sizeof(p), "%s/devices/pci0000:00/0000:00:01.0/0000:18:00.0/numa_node", root);
  unlink(p);
  sxt_sysfs_put(root, "devices/pci0000:00/0000:00:01.0/numa_node", "0\n");
  topo_rdma("mlx5_0", &nics[0]);
  assert_int_equal(nics[0].numa, 0);
  /* Put the tree back for the tests after. */
  sxt_sysfs_put(root, "devices/pci0000:00/0000:00:01.0/0000:18:00.0/numa_node", "0\n");
  sxt_sysfs_put(root, "devices/pci0000:00/0000:00:02.0/0000:19:00.0/numa_node", "0\n");
  sxt_sysfs_put(root, "devices/pci0000:80/0000:80:01.0/0000:81:00.0/numa_node", "1\n");
}

/* Host memory and equal NICs: least-loaded first, so regions alternate. */
static void test_nic_equal_devices_spread(void **state) {
  (void)state;
  uint64_t load[3] = {0, 0, 0};
  int seq[6];
  read_nics();
  for (int i = 0; i < 6; i++) {
    seq[i] = sx__nic_choose(NULL, nics, load, 3);
    load[seq[i]] += 4096;
  }
  int want[6] = {0, 1, 2, 0, 1, 2};
  assert_memory_equal(seq, want, sizeof(want));
  /* Two NICs at the same distance from a GPU share its regions. */
  sx__nic_topo g, two[2];
  topo_pci("0000:82:00.0", &g);
  two[0] = nics[2];
  two[1] = nics[2];
  uint64_t l2[2] = {0, 0};
  for (int i = 0; i < 4; i++) {
    int k = sx__nic_choose(&g, two, l2, 2);
    assert_int_equal(k, i % 2);
    l2[k] += 1 << 20;
  }
  assert_int_equal(sx__nic_choose(&g, two, l2, 0), -1);
}

/* What sysfs may hold on an odd or hostile host: links leading out of
 * devices/, missing entries, names that are paths.  Each gives -1 and a
 * reason, never a crash, and the choice still returns a device. */
static void test_nic_hostile_sysfs(void **state) {
  (void)state;
  char why[400];
  sx__nic_topo t;
  sxt_sysfs_ib(root, "evil0", "../../../../etc");
  assert_int_equal(sx__nic_topo_rdma(root, "evil0", &t, why, sizeof(why)), -1);
  assert_non_null(strstr(why, "not a device under"));
  assert_false(t.known);
  assert_int_equal(t.numa, -1);
  assert_int_equal(sx__nic_topo_rdma(root, "mlx5_9", &t, why, sizeof(why)), -1);
  assert_non_null(strstr(why, "No such file"));
  assert_int_equal(sx__nic_topo_rdma(root, "../../etc", &t, why, sizeof(why)), -1);
  assert_non_null(strstr(why, "cannot be looked up"));
  assert_int_equal(sx__nic_topo_rdma(root, "", &t, why, sizeof(why)), -1);
  assert_int_equal(sx__nic_topo_pci(root, "0000:17:00.0/../..", &t, why, sizeof(why)), -1);
  assert_non_null(strstr(why, "is not one"));
  assert_int_equal(sx__nic_topo_pci(root, "0000:99:00.0", &t, why, sizeof(why)), -1);
  /* A link loop. */
  sxt_sysfs_ib(root, "loop0", "pci0000:00/loop");
  sxt_sysfs_link(root, "loop", "devices/pci0000:00/loop");
  assert_int_equal(sx__nic_topo_rdma(root, "loop0", &t, why, sizeof(why)), -1);
  assert_non_null(strstr(why, "Too many"));
  /* No sysfs at all. */
  assert_int_equal(sx__nic_topo_rdma("/nonexistent-sysfs", "mlx5_0", &t, why, sizeof(why)), -1);
  /* Unknown devices rank after known ones and among themselves by load. */
  sx__nic_topo g, set[3];
  topo_pci("0000:17:00.0", &g);
  sx__nic_topo_rdma(root, "evil0", &set[0], why, sizeof(why));
  sx__nic_topo_rdma(root, "mlx5_9", &set[1], why, sizeof(why));
  topo_rdma("mlx5_1", &set[2]);
  uint64_t load[3] = {0, 0, 1ull << 40};
  assert_int_equal(sx__nic_choose(&g, set, load, 3), 2);
  set[2] = set[0];
  load[0] = 5;
  assert_int_equal(sx__nic_choose(&g, set, load, 3), 1);
}

#ifdef SX_HAVE_CUDA
/* A driver table that knows PCI addresses, as a real driver (and the
 * stand-in, tests/gpu/fake_cuda.c) answers them. */
static int pci_bus[3] = {0x17, 0x82, 0x1a};
static CUresult f_attr(int *v, CUdevice_attribute a, CUdevice d) {
  if (d < 0 || d > 2)
    return CUDA_ERROR_INVALID_DEVICE;
  switch (a) {
  case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: *v = 0; return CUDA_SUCCESS;
  case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: *v = pci_bus[d]; return CUDA_SUCCESS;
  case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: *v = 0; return CUDA_SUCCESS;
  default: return CUDA_ERROR_INVALID_VALUE;
  }
}
static sx__cuda_drv fake;

static int cuda_real(void **state) {
  (void)state;
  sx__mem_cuda_use(NULL);
  return 0;
}

static void fake_rdma(sx_rdma *t) {
  memset(t, 0, sizeof(*t));
  t->n_devs = 3;
  for (int i = 0; i < 3; i++) {
    t->devs[i].t = t;
    t->devs[i].index = i;
    snprintf(t->devs[i].name, sizeof(t->devs[i].name), "mlx5_%d", i);
  }
}

/* The transport's pick: GPU regions by the driver's PCI address, host
 * regions spread, loads given back on deregistration. */
static void test_nic_pick_per_region(void **state) {
  (void)state;
  sx_rdma *t = malloc(sizeof(*t));
  sx_lregion lr;
  char addr[32];
  assert_non_null(t);
  fake_rdma(t);
  sxt_fake_drv_base(&fake, 3);
  fake.DeviceGetAttribute = f_attr;
  sx__mem_cuda_use(&fake);
  sxt_ok(sx__mem_pci_address(1, addr, sizeof(addr)));
  assert_string_equal(addr, "0000:82:00.0");
  memset(&lr, 0, sizeof(lr));
  lr.r.length = 1 << 20;
  lr.mem.kind = SX__MEM_CUDA;
  lr.mem.device = 1; /* node 1: mlx5_2 */
  assert_int_equal(sx__rdma_nic_pick(t, &lr), 2);
  lr.mem.device = 0; /* node 0, same switch as mlx5_0 */
  assert_int_equal(sx__rdma_nic_pick(t, &lr), 0);
  lr.mem.device = 2; /* node 1 though near mlx5_0 */
  assert_int_equal(sx__rdma_nic_pick(t, &lr), 2);
  assert_true(t->nic_bytes[2] == 2u << 20 && t->nic_bytes[0] == 1u << 20);
  /* Host memory: to the least-loaded, mlx5_1, then mlx5_0, then mlx5_1 ... */
  lr.mem.kind = SX__MEM_HOST;
  lr.mem.device = -1;
  assert_int_equal(sx__rdma_nic_pick(t, &lr), 1);
  assert_int_equal(sx__rdma_nic_pick(t, &lr), 0);
  assert_int_equal(sx__rdma_nic_pick(t, &lr), 1);
  sx__rdma_nic_put(t, 2, 2u << 20);
  assert_true(t->nic_bytes[2] == 0);
  sx__rdma_nic_put(t, 2, 5); /* never below 0 */
  assert_true(t->nic_bytes[2] == 0);
  sx__rdma_nic_put(t, -1, 5);
  /* A GPU whose place is unknown (a driver answering an address sysfs
   * lacks): the least-loaded device, no crash. */
  pci_bus[0] = 0x77;
  lr.mem.kind = SX__MEM_CUDA;
  lr.mem.device = 0;
  assert_int_equal(sx__rdma_nic_pick(t, &lr), 2);
  pci_bus[0] = 0x17;
  /* A driver that gives an impossible bus number. */
  pci_bus[0] = 0x1000;
  sxt_rc(sx__mem_pci_address(0, addr, sizeof(addr)), SX_EIO);
  pci_bus[0] = 0x17;
  sx__mem_cuda_use(NULL);
  free(t);
}
#endif

/* Two RoCE ports, mlx5_0 at 10.1.2.10 and mlx5_1 at 10.1.2.11, no masks. */
static void fake_ports(sx_rdma *t) {
  t->n_devs = t->n_eps = 2;
  for (int i = 0; i < 2; i++) {
    t->devs[i].index = i;
    snprintf(t->devs[i].name, sizeof(t->devs[i].name), "mlx5_%d", i);
    rdma_ep *e = &t->eps[i];
    e->dev = &t->devs[i];
    e->link_layer = IBV_LINK_LAYER_ETHERNET;
    e->gid[10] = e->gid[11] = 0xff;
    e->gid[12] = 10, e->gid[13] = 1, e->gid[14] = 2, e->gid[15] = (uint8_t)(10 + i);
    memcpy(&e->ipv4, e->gid + 12, 4);
    e->has_ipv4 = 1;
  }
}

/* The reader's endpoint pair: among equally suited ports, the remote
 * endpoint its owner placed most bytes on, then the local port whose
 * device holds most of this agent's regions. */
static void test_nic_pick_follows_published_choice(void **state) {
  (void)state;
  sx_rdma *t = calloc(1, sizeof(*t));
  sx_desc d;
  uint32_t rk = 99;
  rdma_ep *lep = NULL;
  assert_non_null(t);
  fake_ports(t);
  /* Two remote NICs (10.1.2.3, 10.1.2.4), no masks: every pair scores alike. */
  sxt_desc_kv(&d, "two-nics", 2, 0, 4096, 8, 2);
  assert_true(sx__rdma_pick(t, &d, &rk, &lep) >= 0);
  assert_int_equal(rk, 0); /* no choice published: the first, as before */
  assert_ptr_equal(lep, &t->eps[0]);
  d.regions[0].nic = 2;
  d.regions[1].nic = 2;
  assert_true(sx__rdma_pick(t, &d, &rk, &lep) >= 0);
  assert_int_equal(rk, 1);
  assert_string_equal(d.endpoints[sx__rdma_pick(t, &d, &rk, &lep)].device, "mlx5_1");
  d.regions[0].nic = 1; /* a tie of bytes: the first */
  assert_true(sx__rdma_pick(t, &d, &rk, &lep) >= 0);
  assert_int_equal(rk, 0);
  /* This agent's own regions sit on its second device. */
  t->nic_bytes[1] = 1 << 20;
  assert_true(sx__rdma_pick(t, &d, &rk, &lep) >= 0);
  assert_ptr_equal(lep, &t->eps[1]);
  /* A better-suited pair (same subnet) still comes first. */
  t->eps[0].mask.s_addr = htonl(0xffffff00u);
  assert_true(sx__rdma_pick(t, &d, &rk, &lep) >= 0);
  assert_ptr_equal(lep, &t->eps[0]);
  /* Hostile lengths do not wrap the count. */
  d.regions[0].length = UINT64_MAX;
  d.regions[1].length = UINT64_MAX;
  d.regions[0].nic = 2;
  t->eps[0].mask.s_addr = 0;
  assert_true(sx__rdma_pick(t, &d, &rk, &lep) >= 0);
  assert_int_equal(rk, 1);
  sx_desc_free(&d);
  free(t);
}

/* Each range's NIC pair: the remote region's NIC, from the local port that
 * suits it best (then the local region's NIC); pair peers opened once and
 * reused; ranges naming no NIC, or a NIC no local port suits as well as the
 * segment's own pair, stay on the segment's peer. */
static void test_nic_route_pairs(void **state) {
  (void)state;
  sx_rdma *t = calloc(1, sizeof(*t));
  sx_desc d;
  uint32_t rk = 99;
  rdma_ep *lep = NULL;
  rdma_peer *p = NULL, *q = NULL, *q2 = NULL;
  rdma_mr rm;
  sx_lregion lr;
  assert_non_null(t);
  fake_ports(t);
  t->conns_per_peer = 2;
  for (int i = 0; i < 2; i++) /* both in the remote NICs' /24 */
    t->eps[i].mask.s_addr = htonl(0xffffff00u);
  sxt_desc_kv(&d, "two-nics", 2, 0, 4096, 8, 2);
  int idx = sx__rdma_pick(t, &d, &rk, &lep);
  assert_true(idx >= 0);
  assert_int_equal(rk, 0);
  assert_ptr_equal(lep, &t->eps[0]);
  sxt_ok(sx__rdma_peer_new(t, &d, (uint32_t)idx, rk, lep, NULL, &p));
  assert_int_equal(p->n_reps, 2);
  memset(&rm, 0, sizeof(rm));
  memset(&lr, 0, sizeof(lr));
  lr.tpriv[SX_TRANSPORT_RDMA] = &rm;
  rm.nic = 0;
  sx_xfer x = {.lreg = &lr, .rreg = &d.regions[0]};
  /* Both on the segment's own pair, or naming no NIC: p. */
  d.regions[0].nic = 1;
  sxt_ok(sx__rdma_route_pair(p, &x, &q));
  assert_ptr_equal(q, p);
  d.regions[0].nic = 0;
  rm.nic = 1;
  sxt_ok(sx__rdma_route_pair(p, &x, &q)); /* remote: p's; local region: mlx5_1 */
  assert_ptr_equal(q->lep, &t->eps[1]);
  assert_int_equal(q->rkey_index, 0);
  assert_ptr_equal(q->pair_of, p);
  /* The second remote NIC, from the local region's NIC: a pair peer of its
   * own, with that NIC's address, opened once. */
  d.regions[0].nic = 2;
  sxt_ok(sx__rdma_route_pair(p, &x, &q2));
  assert_true(q2 != p && q2 != q);
  assert_int_equal(q2->rkey_index, 1);
  assert_ptr_equal(q2->lep, &t->eps[1]);
  assert_non_null(strstr(q2->where, "10.1.2.4:7501 (mlx5_1, from mlx5_1)"));
  assert_int_equal(q2->n_conns, 2);
  sxt_ok(sx__rdma_route_pair(p, &x, &q));
  assert_ptr_equal(q, q2);
  rm.nic = 0;
  sxt_ok(sx__rdma_route_pair(p, &x, &q));
  assert_ptr_equal(q->lep, &t->eps[0]);
  assert_int_equal(q->rkey_index, 1);
  assert_int_equal(t->stats.pairs, 3);
  /* A remote NIC out of range (a store's value), or no local region: p. */
  d.regions[0].nic = 9;
  sxt_ok(sx__rdma_route_pair(p, &x, &q));
  assert_ptr_equal(q, p);
  x.lreg = NULL;
  d.regions[0].nic = 2;
  sxt_ok(sx__rdma_route_pair(p, &x, &q));
  assert_ptr_equal(q, p);
  x.lreg = &lr;
  /* A reader whose ports are all in the first NIC's subnet and a second
   * NIC elsewhere: its ranges stay on the segment's pair (every region is
   * registered on every NIC), not on a NIC this reader may not reach. */
  snprintf(d.endpoints[p->rep[1]].addr, sizeof(d.endpoints[0].addr), "10.9.0.4");
  rdma_peer *p2 = NULL;
  sxt_ok(sx__rdma_peer_new(t, &d, (uint32_t)idx, rk, lep, NULL, &p2));
  sxt_ok(sx__rdma_route_pair(p2, &x, &q));
  assert_ptr_equal(q, p2);
  /* An address that is not numeric: refused with the NIC named. */
  d.regions[0].nic = 2;
  snprintf(d.endpoints[p->rep[1]].addr, sizeof(d.endpoints[0].addr), "nic-b.example");
  t->eps[0].mask.s_addr = t->eps[1].mask.s_addr = 0; /* every pair scores alike */
  rdma_peer *p3 = NULL;
  sxt_ok(sx__rdma_peer_new(t, &d, (uint32_t)idx, rk, lep, NULL, &p3));
  sxt_rc(sx__rdma_route_pair(p3, &x, &q), SX_EUNREACH);
  assert_non_null(strstr(sx_errmsg(), "mlx5_1"));
  while (t->peers != NULL) {
    rdma_peer *n = t->peers->next;
    free(t->peers->conns);
    free(t->peers);
    t->peers = n;
  }
  sx_desc_free(&d);
  free(t);
}

static int node_online(int node) {
  char p[64];
  snprintf(p, sizeof(p), "/sys/devices/system/node/node%d", node);
  return access(p, F_OK) == 0;
}

/* Staging rings ask for their NIC's node.  This host has one node (the
 * test checks the request and the outcome the kernel gives, which is all
 * a one-node machine can show): node 0 is taken, a node the host lacks is
 * refused and logged, the ring is allocated either way, and the thread's
 * own policy is back afterwards. */
static void test_nic_ring_on_numa_node(void **state) {
  (void)state;
  sx_rdma *t = calloc(1, sizeof(*t));
  sx__rdma_ring r;
  int mode = -1;
  unsigned long mask[(SX__NIC_MAX_NODE + 1) / (8 * sizeof(unsigned long))];
  assert_non_null(t);
  t->n_devs = 3;
  for (int i = 0; i < 3; i++) {
    t->devs[i].index = i;
    snprintf(t->devs[i].name, sizeof(t->devs[i].name), "mlx5_%d", i);
  }
  sxt_ok(sx__rdma_ring_alloc_near(t, &t->devs[0], &r, 1 << 20, 4));
  assert_int_equal(t->stats.numa_rings, 1);
  assert_int_equal(t->stats.numa_node, 0);
  assert_non_null(r.mem);
  memset(r.mem, 1, r.bytes);
  if (syscall(SYS_get_mempolicy, &mode, mask, (unsigned long)SX__NIC_MAX_NODE + 1, r.mem,
              (unsigned long)(MPOL_F_NODE | MPOL_F_ADDR)) == 0)
    assert_int_equal(mode, 0); /* its pages are on node 0 */
  sx__rdma_ring_free(&r);
  assert_int_equal(t->stats.numa_refused, 0);
  sxt_ok(sx__rdma_ring_alloc_near(t, &t->devs[2], &r, 1 << 20, 4));
  assert_int_equal(t->stats.numa_rings, 2);
  assert_int_equal(t->stats.numa_node, 1);
  assert_int_equal(t->stats.numa_refused, node_online(1) ? 0 : 1);
  assert_non_null(r.mem);
  sx__rdma_ring_free(&r);
  assert_int_equal(syscall(SYS_get_mempolicy, &mode, mask, (unsigned long)SX__NIC_MAX_NODE + 1,
                           NULL, 0ul), 0);
  assert_int_equal(mode, MPOL_DEFAULT);
  /* A device whose node is unknown: no policy asked for. */
  snprintf(t->devs[1].name, sizeof(t->devs[1].name), "rxe0");
  t->nic_read = 0;
  sxt_ok(sx__rdma_ring_alloc_near(t, &t->devs[1], &r, 1 << 20, 4));
  assert_int_equal(t->stats.numa_rings, 2);
  sx__rdma_ring_free(&r);
  free(t);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_nic_topology_from_sysfs),
      cmocka_unit_test(test_nic_same_numa_wins),
      cmocka_unit_test(test_nic_pci_distance_breaks_ties),
      cmocka_unit_test(test_nic_unknown_numa),
      cmocka_unit_test(test_nic_equal_devices_spread),
      cmocka_unit_test(test_nic_hostile_sysfs),
#ifdef SX_HAVE_CUDA
      cmocka_unit_test_teardown(test_nic_pick_per_region, cuda_real),
#endif
      cmocka_unit_test(test_nic_pick_follows_published_choice),
      cmocka_unit_test(test_nic_route_pairs),
      cmocka_unit_test(test_nic_ring_on_numa_node),
  };
  return cmocka_run_group_tests(tests, tree_up, tree_down);
}
