/* A fake sysfs tree for the RDMA transport's NIC choice, which reads the
 * tree SX_SYSFS_ROOT names instead of /sys (agent/transport/rdma/rdma_nic.c).
 * Paths are relative to root; a failure fails the test. */
#ifndef SXT_FAKE_SYSFS_H
#define SXT_FAKE_SYSFS_H
#include <stddef.h>

/* A new empty tree under /tmp (bus/pci/devices, class/infiniband) into root. */
void sxt_sysfs_make(char *root, size_t cap);
/* Write text into root/rel (created or replaced). */
void sxt_sysfs_put(const char *root, const char *rel, const char *text);
/* root/rel becomes a symbolic link to target (replacing what was there). */
void sxt_sysfs_link(const char *root, const char *target, const char *rel);
/* A PCI device at devices/path ("pci0000:00/0000:00:01.0/0000:17:00.0"),
 * its numa_node holding node (none when NULL), and its bus/pci/devices link. */
void sxt_sysfs_pci(const char *root, const char *path, const char *node);
/* RDMA device name whose device link leads to devices/path. */
void sxt_sysfs_ib(const char *root, const char *name, const char *path);
/* Remove the tree. */
void sxt_sysfs_remove(const char *root);
#endif
