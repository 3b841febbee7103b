/*
 * NIC choice: which RDMA device serves each region, from where the devices
 * and the memory sit in the machine (docs/gpu.md "NIC choice").
 *
 * A GPU region goes to the device on the GPU's NUMA node first, then to the
 * one with the shortest PCI path to the GPU (the two devices' sysfs paths
 * under /sys/devices, resolved with realpath: hops from each up to their
 * deepest common ancestor), then to the least-loaded, then the first.  Host
 * memory, whose node is not known here, goes to the least-loaded device, so
 * regions spread round-robin over the NICs.  The choice is published per
 * region in the descriptor (sx_region.nic); readers open a segment for the
 * endpoint most of its bytes name (rdma_dev.c, sx__rdma_pick) and send each
 * range through the NICs its regions name (rdma_route.c).
 *
 * Staging rings are allocated on their NIC's NUMA node: the thread's memory
 * policy prefers that node while the ring is allocated (cuMemHostAlloc
 * pins, so its pages are placed then), and memory that is not pinned is
 * bound to it with mbind before it is first touched.
 *
 * Everything here reads sysfs, which a hostile or odd host can fill with
 * anything: names are checked before they become paths, resolved paths
 * must stay under <root>/devices, numbers are parsed strictly, and what
 * cannot be read makes the device "unknown" (with a log line), never an
 * error.  SX_SYSFS_ROOT replaces /sys (a test hook: the unit tests build a
 * fake tree).
 */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/mempolicy.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "rdma_int.h"

const char *sx__nic_sysfs_root(void) {
  const char *r = getenv("SX_SYSFS_ROOT");
  return r != NULL && r[0] != '\0' ? r : "/sys";
}

/* A device or PCI name that can go into a path: no '/', no "..". */
static int name_ok(const char *s, int pci) {
  size_t n = strlen(s);
  if (n == 0 || n > 64 || strcmp(s, ".") == 0 || strcmp(s, "..") == 0)
    return 0;
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    int ok = pci ? isxdigit(c) || c == ':' || c == '.'
                 : isalnum(c) || c == '_' || c == '-' || c == '.';
    if (!ok)
      return 0;
  }
  return 1;
}

/* The NUMA node in dir/numa_node: 0 and *node, or -1 when the file is
 * missing or does not hold one number in -1..SX__NIC_MAX_NODE. */
static int read_node(const char *dir, int *node) {
  char p[SX__NIC_PATH + 16], buf[32];
  snprintf(p, sizeof(p), "%s/numa_node", dir);
  int fd = open(p, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0)
    return -1;
  ssize_t n = read(fd, buf, sizeof(buf));
  close(fd);
  if (n <= 0 || (size_t)n >= sizeof(buf)) /* empty, or longer than any node number */
    return -1;
  buf[n] = '\0';
  char *end;
  errno = 0;
  long v = strtol(buf, &end, 10);
  while (*end == '\n' || *end == ' ')
    end++;
  if (errno != 0 || end == buf || *end != '\0' || v < -1 || v > SX__NIC_MAX_NODE)
    return -1;
  *node = (int)v;
  return 0;
}

/* Resolve link (a sysfs device link) into out: 0, or -1 with why. */
static int topo_of(const char *root, const char *link, sx__nic_topo *out, char *why,
                   size_t cap) {
  char real[PATH_MAX], devices[PATH_MAX], top[SX__NIC_PATH + 16];
  memset(out, 0, sizeof(*out));
  out->numa = -1;
  snprintf(top, sizeof(top), "%s/devices", root);
  if (realpath(link, real) == NULL) {
    snprintf(why, cap, "%s: %s", link, strerror(errno));
    return -1;
  }
  if (realpath(top, devices) == NULL) {
    snprintf(why, cap, "%s: %s", top, strerror(errno));
    return -1;
  }
  size_t dl = strlen(devices), rl = strlen(real);
  if (rl <= dl + 1 || strncmp(real, devices, dl) != 0 || real[dl] != '/') {
    snprintf(why, cap, "%s leads to %.200s, which is not a device under %s", link, real, top);
    return -1;
  }
  if (rl >= sizeof(out->path)) {
    snprintf(why, cap, "%s: the device path is %zu bytes long", link, rl);
    return -1;
  }
  memcpy(out->path, real, rl + 1);
  out->known = 1;
  /* A device that is not itself on PCI (a virtio NIC's netdev, rxe over
   * it) has the node of its nearest ancestor that says one. */
  char dir[SX__NIC_PATH];
  memcpy(dir, real, rl + 1);
  while (strlen(dir) > dl) {
    if (read_node(dir, &out->numa) == 0)
      break;
    char *slash = strrchr(dir, '/');
    if (slash == NULL)
      break;
    *slash = '\0';
  }
  return 0;
}

/* Where device name sits: an RDMA device (pci 0) or a PCI address. */
static int topo_named(const char *root, const char *name, int pci, sx__nic_topo *out,
                      char *why, size_t cap) {
  char link[SX__NIC_PATH + 96];
  if (!name_ok(name, pci)) {
    memset(out, 0, sizeof(*out));
    out->numa = -1;
    if (pci)
      snprintf(why, cap, "PCI address '%.64s' is not one", name);
    else
      snprintf(why, cap, "device name '%.64s' cannot be looked up in sysfs", name);
    return -1;
  }
  if (pci)
    snprintf(link, sizeof(link), "%s/bus/pci/devices/%s", root, name);
  else
    snprintf(link, sizeof(link), "%s/class/infiniband/%s/device", root, name);
  return topo_of(root, link, out, why, cap);
}

int sx__nic_topo_rdma(const char *root, const char *dev, sx__nic_topo *out, char *why,
                      size_t cap) {
  return topo_named(root, dev, 0, out, why, cap);
}

int sx__nic_topo_pci(const char *root, const char *addr, sx__nic_topo *out, char *why,
                     size_t cap) {
  return topo_named(root, addr, 1, out, why, cap);
}

static int slashes(const char *p, size_t n) {
  int k = 0;
  for (size_t i = 0; i < n && p[i] != '\0'; i++)
    k += p[i] == '/';
  return k;
}

int sx__nic_pci_distance(const sx__nic_topo *a, const sx__nic_topo *b) {
  if (!a->known || !b->known)
    return -1;
  const char *p = a->path, *q = b->path;
  size_t i = 0;
  while (p[i] != '\0' && p[i] == q[i])
    i++;
  /* Components shared: those begun before the first difference, less the
   * one it falls in unless both paths end a component there. */
  int common = slashes(p, i);
  if (!((p[i] == '\0' || p[i] == '/') && (q[i] == '\0' || q[i] == '/')))
    common--;
  return (slashes(p, SIZE_MAX) - common) + (slashes(q, SIZE_MAX) - common);
}

int sx__nic_choose(const sx__nic_topo *mem, const sx__nic_topo *nics, const uint64_t *load,
                   int n) {
  int best = -1, best_same = 0, best_dist = 0;
  for (int i = 0; i < n; i++) {
    int same = mem != NULL && mem->numa >= 0 && nics[i].numa == mem->numa;
    int dist = mem != NULL ? sx__nic_pci_distance(mem, &nics[i]) : -1;
    if (dist < 0)
      dist = INT_MAX; /* unknown: farther than any known path */
    int better = best < 0 || same > best_same ||
                 (same == best_same && (dist < best_dist ||
                                        (dist == best_dist && load[i] < load[best])));
    if (better) {
      best = i;
      best_same = same;
      best_dist = dist;
    }
  }
  return best;
}

/* ------------------------------------------------------------ the transport */

/* Topology of every device, read once. */
static void nic_topos(sx_rdma *t) {
  if (t->nic_read)
    return;
  t->nic_read = 1;
  const char *root = sx__nic_sysfs_root();
  for (int i = 0; i < t->n_devs; i++) {
    char why[400];
    if (sx__nic_topo_rdma(root, t->devs[i].name, &t->nic_topo[i], why, sizeof(why)) != 0)
      sx__rdma_log(t, t->n_devs > 1 ? SX_LOG_WARN : SX_LOG_DEBUG,
                   "where %s sits is unknown (%s): it is chosen for GPU memory only after the "
                   "devices whose place is known", t->devs[i].name, why);
    else
      sx__rdma_log(t, SX_LOG_DEBUG, "%s: NUMA node %d, %s", t->devs[i].name,
                   t->nic_topo[i].numa, t->nic_topo[i].path);
  }
}

int sx__rdma_nic_node(sx_rdma *t, const rdma_dev *d) {
  nic_topos(t);
  return d->index >= 0 && d->index < t->n_devs ? t->nic_topo[d->index].numa : -1;
}

int sx__rdma_nic_pick(sx_rdma *t, const sx_lregion *lr) {
  if (t->n_devs <= 0)
    return -1;
  nic_topos(t);
  sx__nic_topo gpu, *mem = NULL;
  char why[400] = "", addr[32];
  if (lr->mem.kind == SX__MEM_CUDA) {
    int rc = sx__mem_pci_address(lr->mem.device, addr, sizeof(addr));
    if (rc != 0)
      snprintf(why, sizeof(why), "%s", sx_errmsg());
    else if (sx__nic_topo_pci(sx__nic_sysfs_root(), addr, &gpu, why, sizeof(why)) == 0)
      mem = &gpu;
  }
  int k = sx__nic_choose(mem, t->nic_topo, t->nic_bytes, t->n_devs);
  if (k < 0)
    return -1;
  t->nic_bytes[k] += lr->r.length;
  if (lr->mem.kind != SX__MEM_CUDA) {
    sx__rdma_log(t, SX_LOG_DEBUG, "region %u (%s): %s, the least-loaded of %d devices",
                 lr->r.id, lr->r.location, t->devs[k].name, t->n_devs);
  } else if (mem == NULL) {
    sx__rdma_log(t, t->n_devs > 1 ? SX_LOG_WARN : SX_LOG_INFO,
                 "region %u (%s): where the GPU sits is unknown (%s); %s, the least-loaded "
                 "of %d devices", lr->r.id, lr->r.location, why, t->devs[k].name, t->n_devs);
  } else {
    int same = gpu.numa >= 0 && t->nic_topo[k].numa == gpu.numa;
    sx__rdma_log(t, SX_LOG_INFO,
                 "region %u (%s at %s, NUMA node %d): %s (NUMA node %d%s, PCI distance %d) of "
                 "%d devices", lr->r.id, lr->r.location, addr, gpu.numa, t->devs[k].name,
                 t->nic_topo[k].numa, same ? ", the GPU's" : "",
                 sx__nic_pci_distance(&gpu, &t->nic_topo[k]), t->n_devs);
  }
  return k;
}

void sx__rdma_nic_put(sx_rdma *t, int k, uint64_t bytes) {
  if (k >= 0 && k < SX__RDMA_MAX_DEVS)
    t->nic_bytes[k] -= bytes <= t->nic_bytes[k] ? bytes : t->nic_bytes[k];
}

/* ------------------------------------------------------------ rings on a node */

#define NODE_WORDS ((SX__NIC_MAX_NODE + 1) / (8 * sizeof(unsigned long)))

int sx__rdma_ring_alloc_near(sx_rdma *t, rdma_dev *d, sx__rdma_ring *r, size_t bytes,
                             size_t n_msgs) {
  int node = sx__rdma_nic_node(t, d);
  if (node < 0)
    return sx__rdma_ring_alloc(r, bytes, n_msgs);
  unsigned long want[NODE_WORDS], old[NODE_WORDS];
  int old_mode = MPOL_DEFAULT, restore = 0;
  memset(want, 0, sizeof(want));
  const size_t bits = 8 * sizeof(unsigned long);
  want[(size_t)node / bits] |= 1ul << ((size_t)node % bits);
  /* The kernel reads one bit less than maxnode says (libnuma passes +1). */
  unsigned long maxnode = SX__NIC_MAX_NODE + 2;
  t->stats.numa_node = node;
  t->stats.numa_rings++;
  if (syscall(SYS_get_mempolicy, &old_mode, old, (unsigned long)SX__NIC_MAX_NODE + 1, NULL,
              0ul) != 0) {
    sx__rdma_log(t, SX_LOG_WARN, "staging ring for %s: get_mempolicy: %s; not placed on "
                 "NUMA node %d", d->name, strerror(errno), node);
    t->stats.numa_refused++;
    return sx__rdma_ring_alloc(r, bytes, n_msgs);
  }
  if (syscall(SYS_set_mempolicy, MPOL_PREFERRED, want, maxnode) != 0) {
    sx__rdma_log(t, SX_LOG_WARN, "staging ring for %s: set_mempolicy(MPOL_PREFERRED, node "
                 "%d): %s; the ring is allocated where the kernel likes", d->name, node,
                 strerror(errno));
    t->stats.numa_refused++;
  } else {
    restore = 1;
  }
  int rc = sx__rdma_ring_alloc(r, bytes, n_msgs);
  /* Pageable memory (no CUDA driver) is placed when first touched, which
   * may be on another thread: bind it now. */
  if (rc == 0 && restore && !r->pinned &&
      syscall(SYS_mbind, r->mem, r->bytes, MPOL_PREFERRED, want, maxnode, 0u) != 0)
    sx__rdma_log(t, SX_LOG_DEBUG, "staging ring for %s: mbind(node %d): %s", d->name, node,
                 strerror(errno));
  if (restore) {
    /* Back to what the thread had (the agent's loop thread, or a caller's). */
    int mode = old_mode & ~(MPOL_F_STATIC_NODES | MPOL_F_RELATIVE_NODES);
    long e = mode == MPOL_DEFAULT ? syscall(SYS_set_mempolicy, MPOL_DEFAULT, NULL, 0ul)
                                  : syscall(SYS_set_mempolicy, old_mode, old, maxnode);
    if (e != 0)
      sx__rdma_log(t, SX_LOG_WARN, "restoring the thread's memory policy: %s",
                   strerror(errno));
  }
  if (rc == 0)
    sx__rdma_log(t, SX_LOG_DEBUG, "staging ring of %zu bytes for %s on NUMA node %d%s", bytes,
                 d->name, node, restore ? "" : " (refused)");
  return rc;
}
