/*
 * segxfer: named, leased, layout-checked KV-cache segments and batched block
 * reads between LLM serving engines (RDMA, or TCP where no RDMA device
 * exists), coordinated through Redis or etcd.
 *
 * Include this one header; link with `pkg-config --libs segxfer`.
 */
#ifndef SEGXFER_H
#define SEGXFER_H

#include "segxfer/errors.h"
#include "segxfer/descriptor.h"
#include "segxfer/layout.h"
#include "segxfer/plan.h"
#include "segxfer/group.h"
#include "segxfer/store.h"
#include "segxfer/agent.h"
#include "segxfer/push.h"

#define SX_VERSION_MAJOR 0
#define SX_VERSION_MINOR 1
#define SX_VERSION_PATCH 0

#ifdef __cplusplus
extern "C" {
#endif

/* The library's version as "major.minor.patch". */
SX_EXTERN const char *sx_version(void);

#ifdef __cplusplus
}
#endif
#endif /* SEGXFER_H */
