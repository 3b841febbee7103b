/* The part of a fake CUDA driver table every unit test needs (init, error
 * strings, devices, primary contexts); each test adds the calls it fakes. */
#ifndef SXT_FAKE_DRV_H
#define SXT_FAKE_DRV_H
#ifdef SX_HAVE_CUDA
#include "mem/mem_int.h"

/* Fill d with those calls for `devices` devices (the rest NULL).  Error
 * strings: "invalid argument" for CUDA_ERROR_INVALID_VALUE, "fake error"
 * for the others, named CUDA_ERROR_FAKE. */
void sxt_fake_drv_base(sx__cuda_drv *d, int devices);
#endif
#endif
