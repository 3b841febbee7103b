/*
 * Where a GPU sits on the PCI bus (mem.h): the RDMA transport picks the NIC
 * nearest each GPU from sysfs (agent/transport/rdma/rdma_nic.c) and needs
 * the GPU's PCI address for that.  It asks the driver's PCI attributes
 * rather than cuDeviceGetPCIBusId: the attributes are already in the
 * driver table (dma-buf support uses cuDeviceGetAttribute), and numbers
 * format into sysfs's spelling (four hex digits of domain, lower case)
 * without parsing the driver's string.
 */
#include <stdio.h>

#include "internal.h"
#include "mem.h"

#ifdef SX_HAVE_CUDA
#include "mem_int.h"

int sx__mem_pci_address(int device, char *buf, size_t len) {
  int err = 0, v[3] = {0, 0, 0};
  static const CUdevice_attribute attrs[3] = {CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID,
                                              CU_DEVICE_ATTRIBUTE_PCI_BUS_ID,
                                              CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID};
  const sx__cuda_drv *d = sx__cuda_get(device, &err);
  if (d == NULL)
    return err;
  if (d->DeviceGetAttribute == NULL)
    return sx__err(SX_ENOTSUP, "the CUDA driver has no cuDeviceGetAttribute");
  for (int i = 0; i < 3; i++) {
    CUresult r = d->DeviceGetAttribute(&v[i], attrs[i], (CUdevice)device);
    if (r != CUDA_SUCCESS)
      return sx__cuda_err(d, r, "cuDeviceGetAttribute(PCI address)");
  }
  /* A PCI domain is 16 bits in sysfs names, a bus 8, a device 5. */
  if (v[0] < 0 || v[0] > 0xffff || v[1] < 0 || v[1] > 0xff || v[2] < 0 || v[2] > 0x1f)
    return sx__err(SX_EIO, "cuda:%d: the driver gives PCI domain %d, bus %d, device %d", device,
                   v[0], v[1], v[2]);
  snprintf(buf, len, "%04x:%02x:%02x.0", (unsigned)v[0], (unsigned)v[1], (unsigned)v[2]);
  return 0;
}
#else
int sx__mem_pci_address(int device, char *buf, size_t len) {
  (void)buf, (void)len;
  return sx__err(SX_ENOTSUP, "cuda:%d: this segxfer was built without CUDA support", device);
}
#endif
