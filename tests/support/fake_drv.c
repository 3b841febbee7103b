/* The common part of unit tests' fake CUDA driver tables (fake_drv.h). */
#include <stdint.h>
#include <string.h>

#include "fake_drv.h"

#ifdef SX_HAVE_CUDA
static int n_devices;

static CUresult f_ok0(unsigned x) {
  (void)x;
  return CUDA_SUCCESS;
}
static CUresult f_errstr(CUresult e, const char **s) {
  *s = e == CUDA_ERROR_INVALID_VALUE ? "invalid argument" : "fake error";
  return CUDA_SUCCESS;
}
static CUresult f_errname(CUresult e, const char **s) {
  (void)e;
  *s = "CUDA_ERROR_FAKE";
  return CUDA_SUCCESS;
}
static CUresult f_count(int *n) {
  *n = n_devices;
  return CUDA_SUCCESS;
}
static CUresult f_get(CUdevice *d, int ordinal) {
  *d = ordinal;
  return CUDA_SUCCESS;
}
static CUresult f_retain(CUcontext *c, CUdevice d) {
  *c = (CUcontext)(uintptr_t)(0x1000 + d);
  return CUDA_SUCCESS;
}
static __thread CUcontext cur;
static CUresult f_setcur(CUcontext c) {
  cur = c;
  return CUDA_SUCCESS;
}
static CUresult f_getcur(CUcontext *c) {
  *c = cur;
  return CUDA_SUCCESS;
}

void sxt_fake_drv_base(sx__cuda_drv *d, int devices) {
  memset(d, 0, sizeof(*d));
  n_devices = devices;
  d->Init = f_ok0;
  d->GetErrorString = f_errstr;
  d->GetErrorName = f_errname;
  d->DeviceGetCount = f_count;
  d->DeviceGet = f_get;
  d->DevicePrimaryCtxRetain = f_retain;
  d->CtxSetCurrent = f_setcur;
  d->CtxGetCurrent = f_getcur;
}
#else
typedef int sxt_fake_drv_unused; /* ISO C wants something in a file */
#endif
